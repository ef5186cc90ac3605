// Every metric the alert rules (deploy/prometheus/alerts.yaml) and the dashboard
// (deploy/grafana/gpuaas-dashboard.json) name is exported by some service of a running platform:
// ipam, inventory, the scheduler, ingress, usage and a node-agent go through a slice's lifecycle
// (with one public endpoint, applied and removed by the agent) and one create that finds no
// capacity, console-gw refuses a console connect, then each one's /metrics is scraped. A renamed or
// dropped metric fails here instead of leaving an alert that can never fire.
#include <gtest/gtest.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <set>
#include <sstream>
#include <string>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/http.hpp"
#include "gpuaas/console_gw/console_gw_service.hpp"
#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

// gpuaas_* and process_* names in a PromQL expression (label values are quoted, so "gpuaas_x"
// inside a string would be caught too: none of the rules has one).
void NamesIn(const std::string& expr, std::set<std::string>& out) {
  static const std::regex kName(R"(\b(gpuaas|process)_[a-z0-9_]+\b)");
  for (auto it = std::sregex_iterator(expr.begin(), expr.end(), kName);
       it != std::sregex_iterator(); ++it) {
    out.insert(it->str());
  }
}

std::set<std::string> AlertMetricNames() {
  std::set<std::string> names;
  const YAML::Node doc =
      YAML::LoadFile(std::string(GPUAAS_SOURCE_DIR) + "/deploy/prometheus/alerts.yaml");
  for (const auto& group : doc["groups"]) {
    for (const auto& rule : group["rules"]) NamesIn(rule["expr"].as<std::string>(), names);
  }
  return names;
}

void PanelNames(const nlohmann::json& panels, std::set<std::string>& out) {
  for (const auto& p : panels) {
    for (const auto& t : p.value("targets", nlohmann::json::array())) {
      NamesIn(t.value("expr", ""), out);
    }
    PanelNames(p.value("panels", nlohmann::json::array()), out);
  }
}

std::set<std::string> DashboardMetricNames() {
  std::ifstream in(std::string(GPUAAS_SOURCE_DIR) + "/deploy/grafana/gpuaas-dashboard.json");
  const auto dash = nlohmann::json::parse(in);
  std::set<std::string> names;
  PanelNames(dash.at("panels"), names);
  for (const auto& v : dash.at("templating").at("list")) {
    if (v.contains("definition")) NamesIn(v.value("definition", ""), names);
  }
  return names;
}

// Sample names (with _bucket/_sum/_count) and family names (# TYPE) of an exposition.
void Exported(const std::string& exposition, std::set<std::string>& out) {
  std::istringstream in(exposition);
  for (std::string line; std::getline(in, line);) {
    if (line.rfind("# TYPE ", 0) == 0) {
      std::istringstream f(line.substr(7));
      std::string name;
      f >> name;
      out.insert(name);
    } else if (!line.empty() && line[0] != '#') {
      out.insert(line.substr(0, line.find_first_of("{ ")));
    }
  }
}

// A console WebSocket upgrade from another origin, sent by hand: console-gw answers 403
// cross_origin before any grant is looked at. Returns the status line.
std::string CrossOriginUpgrade(uint16_t port) {
  const int fd = socket(AF_INET, SOCK_STREAM, 0);
  if (fd < 0) return "";
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_port = htons(port);
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  std::string got;
  if (connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0) {
    const std::string req = fmt::format(
        "GET /console/ws/00000000-0000-7000-8000-000000000000?grant=metrics HTTP/1.1\r\n"
        "Host: 127.0.0.1:{}\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
        "Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n"
        "Origin: http://evil.example\r\n\r\n",
        port);
    if (write(fd, req.data(), req.size()) == static_cast<ssize_t>(req.size())) {
      char buf[512];
      const ssize_t n = read(fd, buf, sizeof(buf));
      if (n > 0) got.assign(buf, static_cast<size_t>(n));
    }
  }
  close(fd);
  return got.substr(0, got.find("\r\n"));
}

TEST(MetricsContractTest, EveryMetricTheAlertsAndDashboardUseIsExported) {
  const auto alert_names = AlertMetricNames();
  const auto dashboard_names = DashboardMetricNames();
  ASSERT_GE(alert_names.size(), 10u);
  ASSERT_GE(dashboard_names.size(), 15u);

  testing::Platform p;
  p.Start();
  ASSERT_FALSE(HasFatalFailure());
  p.StartIngress();
  p.StartUsage();
  ASSERT_FALSE(HasFatalFailure());
  // The agent acks ingress's exposure documents without touching the kernel (simulate).
  p.StartApprovedAgent(
      "metrics-node", "metrics", 2,
      {{"GPUAAS_EXPOSURE_APPLY", "simulate"}, {"GPUAAS_NETWORK_REPORT_MS", "100"}});
  ASSERT_FALSE(HasFatalFailure());
  // A pool for the node's endpoints: gpuaas_endpoint_pool_endpoints has series once one exists.
  v1::SetEndpointPoolRequest pool;
  pool.mutable_pool()->set_name("metrics-node-ports");
  pool.mutable_pool()->set_kind(v1::ENDPOINT_POOL_KIND_PORT_RANGE);
  pool.mutable_pool()->set_region("us-east-1");
  pool.mutable_pool()->set_node_id("metrics-node");
  pool.mutable_pool()->add_addresses("203.0.113.20");
  pool.mutable_pool()->set_port_min(21000);
  pool.mutable_pool()->set_port_max(21009);
  auto pool_set = p.Call<v1::SetEndpointPoolResponse>("gpuaas.v1.ingress.pool.set", pool);
  ASSERT_TRUE(pool_set.ok()) << pool_set.error().ToString();
  // An agent on the libvirt runtime (libvirt's test driver): its restart adoption is measured.
  p.StartAgent("metrics-libvirt", 1, "metrics-libvirt",
               {{"GPUAAS_VM_RUNTIME", "libvirt"},
                {"GPUAAS_VM_DOMAIN_TYPE", "qemu"},
                {"GPUAAS_VM_PASSTHROUGH", "false"}});

  auto create = [&](const std::string& request_id, int gpus, bool expose_ssh) {
    v1::CreateAllocationRequest c;
    c.set_tenant("metrics");
    c.set_request_id(request_id);
    c.set_sku("h200-sxm-slice");
    c.set_gpu_count(gpus);
    c.set_region("us-east-1");
    c.set_pool("metrics");
    c.add_ssh_authorized_keys("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuYWFzdGVzdA test");
    if (expose_ssh) {
      auto* e = c.add_expose();
      e->set_name("ssh");
      e->set_protocol(v1::TRANSPORT_PROTOCOL_TCP);
      e->set_port(22);
    }
    return p.Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", c);
  };
  auto alloc = create("metrics-1", 1, true);
  ASSERT_TRUE(alloc.ok()) << alloc.error().ToString();
  const std::string id = alloc->allocation().allocation_id();
  auto state_is = [&](v1::AllocationState want) {
    return testing::WaitFor(
        [&] {
          v1::GetAllocationRequest g;
          g.set_allocation_id(id);
          auto a = p.Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g);
          return a.ok() && a->allocation().state() == want;
        },
        20s);
  };
  // Active only once the node acked its endpoint: gpuaas_exposure_apply_seconds has observed it.
  ASSERT_TRUE(state_is(v1::ALLOCATION_STATE_ACTIVE));
  // More GPUs than the fleet has free: a no_placement with its reason.
  auto none = create("metrics-2", 2, false);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().reason, "no_placement");
  v1::ReleaseAllocationRequest rel;
  rel.set_allocation_id(id);
  ASSERT_TRUE(
      p.Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release", rel).ok());
  ASSERT_TRUE(state_is(v1::ALLOCATION_STATE_RELEASED));

  // console-gw: its session gauges come from the sweeper; a refused connect counts by failure.
  auto gw = std::make_unique<console_gw::ConsoleGwService>(LoadConfig<console_gw::ConsoleGwConfig>(
      p.Env(testing::SharedPostgres().CreateDatabase("console"), "console-gw")));
  auto gw_started = gw->Start();
  ASSERT_TRUE(gw_started.ok()) << gw_started.error().ToString();
  EXPECT_EQ(CrossOriginUpgrade(gw->gateway_port()), "HTTP/1.1 403 Forbidden");

  std::vector<runtime::Service*> services = {&p.ipam->runtime(),      &p.inventory->runtime(),
                                             &p.scheduler->runtime(), &p.ingress->runtime(),
                                             &gw->runtime(),          &p.usage->runtime()};
  for (auto& a : p.agents) services.push_back(&a->runtime());
  std::set<std::string> exported;
  auto scrape = [&] {
    exported.clear();
    for (auto* svc : services) {
      auto m = http::Get("127.0.0.1", svc->http_port(), "/metrics");
      if (m.ok() && m->first == 200) Exported(m->second, exported);
    }
  };
  auto missing = [&](const std::set<std::string>& wanted) {
    std::vector<std::string> out;
    for (const auto& n : wanted) {
      if (!exported.count(n)) out.push_back(n);
    }
    return out;
  };
  // The sampled gauges (allocations, outbox backlog) and the slot.cleanup task's result come
  // moments after the allocation reads released.
  testing::WaitFor(
      [&] {
        scrape();
        return missing(alert_names).empty() && missing(dashboard_names).empty();
      },
      15s);
  for (const auto& n : missing(alert_names)) {
    ADD_FAILURE() << "deploy/prometheus/alerts.yaml uses " << n << ", which no service exports";
  }
  for (const auto& n : missing(dashboard_names)) {
    ADD_FAILURE() << "deploy/grafana/gpuaas-dashboard.json uses " << n
                  << ", which no service exports";
  }
  // The test can fail: a name no service has is reported missing.
  EXPECT_EQ(missing({"gpuaas_no_such_metric_total"}).size(), 1u);
}

}  // namespace
}  // namespace gpuaas
