// The slice lifecycle with a real VM through the real services (ctest label e2e). Run by
// scripts/e2e/slice-e2e.sh, which builds the test guest and starts virtlogd + libvirtd inside a
// network namespace; without it (GPUAAS_E2E_GUEST unset) every test here SKIPs.
//
// In this process: real NATS and PostgreSQL on loopback, ipam, inventory and the scheduler (with
// a catalog naming the guest image and its sha256). As child processes: the node-agent binary on
// a fixture host whose slot NVMe is a loop device (vm.runtime=libvirt on qemu:///system, TCG;
// network.apply=netns, so the agent runs the bridge, dnsmasq and NAT in the namespace from ipam's
// document), and gpuaasctl for every tenant action. Ingress runs in this process too; the node's
// public uplink is one end of a veth pair in the namespace (203.0.113.10, TEST-NET-3), its other
// end is in a client namespace of its own (203.0.113.2), and the agent applies exposures there
// (exposure.apply=netns: nftables DNAT from the uplink). The tests run in order on one slot and
// each leaves it free again:
//   1. create with --expose ssh:22 -> placed -> provisioned (image, seed, UEFI domain) -> lease +
//      SSH -> endpoint applied -> active; SSH into the guest, from the slice network and from
//      the client namespace through the public endpoint; release -> exposure removed -> shutdown,
//      undefine -> wipe proof -> slot free again, the pool's port free, the public port closed
//   2. a mounted slot disk is refused before any write and its slot stays cleanup_blocked until
//      the disk is unmounted and the release is retried
//   3. a guest whose DHCP is dropped fails with lease_timeout at readiness; cleanup wipes
//   4. the agent SIGKILLed mid-provision and restarted: it adopts the running domain, the task
//      comes back and readiness resumes; the allocation goes active
//   5. the agent's RSS over repeated provision/release cycles stays small and steady
#include <gtest/gtest.h>
#include <signal.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/websocket.hpp>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/console_gw/console_gw_service.hpp"
#include "gpuaas/node_agent/discovery/discovery.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "loop_disk.hpp"
#include "platform.hpp"

namespace gpuaas {
namespace {

namespace fs = std::filesystem;
using namespace std::chrono_literals;
using node_agent::RunTool;
using node_agent::Trim;

constexpr const char* kNode = "e2e-node-01";
constexpr const char* kPool = "e2e-ports";  // the node's port_range endpoint pool

std::string Env(const char* name) {
  const char* v = std::getenv(name);
  return v ? v : "";
}
std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}
std::string Tool(const std::string& name) {
  return node_agent::HostRoot("/").FindCommand(name).value_or(name);
}
// Runs argv; stdout + stderr into the test log when `echo`.
node_agent::ToolResult Exec(const std::vector<std::string>& argv,
                            std::chrono::milliseconds timeout = 60s, bool echo = false) {
  auto r = RunTool(argv, timeout);
  if (!r.ok()) {
    ADD_FAILURE() << argv[0] << ": " << r.error().ToString();
    return {};
  }
  if (echo) std::cout << r->out << r->err << std::flush;
  return *r;
}

// Everything the tests share: built once for the suite.
struct World {
  testing::Platform p;
  std::string guest, netns, work, root, state_dir, net_dir, agent_bin, ctl;
  // The node's public uplink (an interface in `netns`), its address and a client's namespace.
  std::string uplink, public_ip, client_netns, client_ip, sys_dir;
  std::string backing, loop, by_id, mnt;
  node_agent::testing::LoopDisk disk;
  uint16_t http_port = 0;
  std::unique_ptr<testing::Process> agent;
  int agent_starts = 0;
};
World* w = nullptr;

class SliceE2eTest : public ::testing::Test {
 protected:
  static void SetUpTestSuite() {
    if (Env("GPUAAS_E2E_GUEST").empty()) return;
    w = new World;
    w->guest = Env("GPUAAS_E2E_GUEST");
    w->netns = Env("GPUAAS_E2E_NETNS");
    w->work = Env("GPUAAS_E2E_WORK");
    w->agent_bin = Env("GPUAAS_E2E_AGENT");
    w->ctl = Env("GPUAAS_E2E_CTL");
    w->uplink = Env("GPUAAS_E2E_UPLINK");
    w->public_ip = Env("GPUAAS_E2E_PUBLIC_IP");
    w->client_netns = Env("GPUAAS_E2E_CLIENT_NETNS");
    w->client_ip = Env("GPUAAS_E2E_CLIENT_IP");
    ASSERT_FALSE(w->uplink.empty() || w->public_ip.empty() || w->client_netns.empty() ||
                 w->client_ip.empty())
        << "slice-e2e.sh sets GPUAAS_E2E_UPLINK, _PUBLIC_IP, _CLIENT_NETNS and _CLIENT_IP";
    fs::create_directories(w->work);
    // The uplink lives in the namespace, so the agent cannot see it under the host's /sys: its
    // sysfs entry for the fabric check (type 1: Ethernet) comes from this small tree.
    w->sys_dir = w->work + "/uplink-sys";
    fs::create_directories(w->sys_dir + "/class/net/" + w->uplink);
    std::ofstream(w->sys_dir + "/class/net/" + w->uplink + "/type") << "1\n";
    // qemu runs as another user: it must reach the disk node, the seed, kernel and initrd.
    for (fs::path d = w->work; d != d.root_path(); d = d.parent_path()) {
      fs::permissions(d, fs::perms::others_read | fs::perms::others_exec, fs::perm_options::add);
    }

    // The catalog: one slice SKU and the guest image with its digest.
    const std::string image = w->guest + "/image.raw";
    const std::string sha = Trim(Exec({Tool("sha256sum"), image}).out).substr(0, 64);
    const std::string catalog = w->work + "/catalog.yaml";
    std::ofstream(catalog) << fmt::format(
        "skus:\n  h200-sxm-slice:\n    shape: gpu_slice\n    gpu_sku: h200-sxm\n"
        "    allowed_gpu_counts: [1]\n    vcpus_per_gpu: 1\n    memory_mib_per_gpu: 256\n"
        "    fabric_type: infiniband\n    network_modes: [private-nat]\n"
        "images:\n  e2e-guest:\n    url: file://{}\n    sha256: {}\ndefault_image: e2e-guest\n",
        image, sha);
    // A task not acked within 3 s comes back (the agent restart test): the consumer inventory
    // makes for the node.
    w->p.inventory_env["GPUAAS_INVENTORY_NODE_TASK_ACK_WAIT_MS"] = "3000";
    w->p.Start({{"GPUAAS_SCHEDULER_CATALOG_FILE", catalog},
                {"GPUAAS_SCHEDULER_PROVISION_DEADLINE_S", "300"},
                {"GPUAAS_SCHEDULER_SWEEP_INTERVAL_MS", "200"}});
    w->p.StartIngress();

    // The host: a one-GPU fixture (its GPU's NUMA node unknown, as on many real hosts), whose
    // data NVMe node becomes a block node of a fresh loop device.
    w->root = w->work + "/host";
    fs::remove_all(w->root);
    node_agent::FixtureOptions fo;
    fo.gpus = 1;
    fo.hostname = kNode;
    fo.unknown_numa_gpus = {0};
    auto built = node_agent::BuildFixtureHost(w->root, fo);
    ASSERT_TRUE(built.ok()) << built.error().ToString();
    for (const auto& d : node_agent::DiscoverNvme(node_agent::HostRoot(w->root))) {
      if (!d.os_disk()) w->by_id = d.by_id_path();
    }
    ASSERT_FALSE(w->by_id.empty());
    w->backing = w->work + "/slot-nvme.raw";
    ASSERT_EQ(w->disk.Attach(w->root, w->by_id, w->backing), "");
    w->loop = w->disk.loop();
    for (const auto& d :
         {w->root, w->root + "/dev", w->root + "/dev/disk", w->root + "/dev/disk/by-id"}) {
      fs::permissions(d, fs::perms::others_read | fs::perms::others_exec, fs::perm_options::add);
    }

    w->state_dir = w->work + "/" + kNode;
    w->net_dir = w->state_dir + "/net";
    fs::create_directories(w->net_dir);
    fs::permissions(w->state_dir, fs::perms::others_read | fs::perms::others_exec,
                    fs::perm_options::add);
    w->http_port = testing::FreePort();
    StartAgent();

    // The operator approves the discovered slot; ipam reserves its MAC/IP; the agent applies
    // the network document (dnsmasq with the reservation) in the namespace.
    ASSERT_TRUE(testing::WaitFor(
        [&] {
          v1::ShowNodeRequest r;
          r.set_node_id(kNode);
          auto s = w->p.Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
          return s.ok() && s->snapshot_version() >= 1;
        },
        30s));
    v1::ApproveSlotsRequest approve;
    approve.set_node_id(kNode);
    auto a = w->p.Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", approve);
    ASSERT_TRUE(a.ok()) << a.error().ToString();
    ASSERT_EQ(a->results_size(), 1);
    ASSERT_TRUE(a->results(0).approved()) << a->results(0).DebugString();
    ASSERT_TRUE(testing::WaitFor([] { return SlotSchedulable(); }, 30s));
    ASSERT_TRUE(testing::WaitFor(
        [] { return ReadAll(w->net_dir + "/dhcp-hosts").find(':') != std::string::npos; }, 30s))
        << "the agent never applied its network document";

    // The operator gives the node's public address a port range for its slices' endpoints.
    auto pool =
        Ctl({"ingress", "pool", "set", "--name", kPool, "--kind", "port_range", "--region",
             "us-east-1", "--node", kNode, "--address", w->public_ip, "--ports", "20000-20009"});
    ASSERT_EQ(pool.exit_code, 0) << pool.err;

    // console-gw, for the operator's console of a slice.
    w->p.StartConsole();
  }
  static void TearDownTestSuite() {
    if (!w) return;
    if (w->p.console) w->p.console->Shutdown();
    if (w->agent) w->agent->Stop(20s);
    w->p.Stop();
    if (!w->mnt.empty()) (void)RunTool({Tool("umount"), w->mnt}, 30s);
    w->disk.Detach();
    delete w;
    w = nullptr;
  }
  void SetUp() override {
    if (!w) GTEST_SKIP() << "real-VM e2e: run scripts/e2e/slice-e2e.sh BUILD_DIR (root)";
    // The suite outlives a request token (10 min) on a slow TCG host: the test's own calls
    // (slots, allocations, timelines) get a fresh one per test, as gpuaasctl does per call.
    w->p.conn->SetRequestToken(w->p.nats.Token("operator"));
  }

  static void StartAgent() {
    w->agent = std::make_unique<testing::Process>();
    w->p.nats.EnrollNode(kNode);
    std::vector<std::string> env = {
        "GPUAAS_LOG_LEVEL=info",
        "GPUAAS_HTTP_PORT=" + std::to_string(w->http_port),
        std::string("GPUAAS_NODE_ID=") + kNode,
        "GPUAAS_NODE_REGION=us-east-1",
        "GPUAAS_NODE_POOL=e2e",
        "GPUAAS_NODE_STATE_DIR=" + w->state_dir,
        "GPUAAS_NODE_HOST_ROOT=" + w->root,
        "GPUAAS_NODE_REGISTER_RETRY_MS=100",
        "GPUAAS_NODE_DESIRED_POLL_MS=200",
        "GPUAAS_LIBVIRT_URI=qemu:///system",
        "GPUAAS_VM_RUNTIME=libvirt",
        "GPUAAS_VM_DOMAIN_TYPE=qemu",
        "GPUAAS_VM_PASSTHROUGH=false",  // no GPU or VF to hand over on this machine
        "GPUAAS_VM_KERNEL=" + w->guest + "/vmlinuz",
        "GPUAAS_VM_INITRD=" + w->guest + "/initrd.img",
        "GPUAAS_VM_PROFILE_NAME=e2e_1c_256m",
        "GPUAAS_VM_VCPUS_PER_GPU=1",
        "GPUAAS_VM_MEMORY_MIB_PER_GPU=256",
        "GPUAAS_VM_LEASE_TIMEOUT_S=45",
        "GPUAAS_VM_SSH_TIMEOUT_S=90",
        "GPUAAS_NETWORK_APPLY=netns",
        "GPUAAS_NETWORK_NETNS=" + w->netns,
        "GPUAAS_NETWORK_STATE_DIR=" + w->net_dir,
        "GPUAAS_NETWORK_REPORT_MS=1000",
        "GPUAAS_EXPOSURE_APPLY=netns",
        "GPUAAS_EXPOSURE_UPLINK=" + w->uplink,
        "GPUAAS_EXPOSURE_SYS_ROOT=" + w->sys_dir,
    };
    // Its own node identity (enrolled above), as a host's bootstrap would deliver it.
    for (const auto& [k, v] : w->p.nats.Env("node-agent", kNode)) {
      env.push_back(fmt::format("{}={}", k, v));
    }
    w->agent->Spawn({w->agent_bin}, w->work + fmt::format("/agent-{}.log", ++w->agent_starts), env);
    ASSERT_TRUE(testing::WaitFor(
        [] {
          auto r = RunTool(
              {Tool("curl"), "-sf", fmt::format("http://127.0.0.1:{}/readyz", w->http_port)}, 2s);
          return r.ok() && r->exit_code == 0;
        },
        60s, 200ms))
        << "agent not ready; log " << w->work << "/agent-" << w->agent_starts << ".log";
  }

  static std::vector<v1::ProjectedSlot> Slots() {
    v1::ListProjectedSlotsRequest lr;
    lr.set_node_id(kNode);
    auto l = w->p.Call<v1::ListProjectedSlotsResponse>("gpuaas.v1.scheduler.slot.list", lr);
    if (!l.ok()) return {};
    return {l->slots().begin(), l->slots().end()};
  }
  // The scheduler's view of the node's slots, for failure messages.
  static std::string SlotsText() {
    std::string out;
    for (const auto& s : Slots()) out += s.DebugString();
    return out.empty() ? "(no slots)" : out;
  }
  static bool SlotSchedulable() {
    auto s = Slots();
    return s.size() == 1 && s[0].schedulable() &&
           s[0].lifecycle() == v1::SLOT_LIFECYCLE_STATE_AVAILABLE;
  }

  // gpuaasctl: the tenant's and the admin's tool.
  static node_agent::ToolResult Ctl(std::vector<std::string> args, bool echo = true) {
    // As an operator: its NATS key and a request token (what `gpuaasctl auth login` issues).
    std::vector<std::string> argv = {w->ctl,
                                     "--nats",
                                     w->p.nats.url(),
                                     "--nats-seed-file",
                                     w->p.nats.SeedFile("operator"),
                                     "--token",
                                     w->p.nats.Token("operator")};
    argv.insert(argv.end(), args.begin(), args.end());
    std::cout << "$ gpuaasctl " << fmt::format("{}", fmt::join(args, " ")) << "\n";
    return Exec(argv, 300s, echo);
  }
  // `gpuaasctl alloc create` (one slice in pool e2e, the guest's SSH key, `expose` as
  // --expose NAME:PORT); the allocation id.
  static std::string Create(const std::string& request_id, const std::string& hostname,
                            const std::vector<std::string>& expose = {}) {
    std::vector<std::string> args = {"-o",           "json",
                                     "alloc",        "create",
                                     "--tenant",     "acme",
                                     "--request-id", request_id,
                                     "--gpus",       "1",
                                     "--region",     "us-east-1",
                                     "--pool",       "e2e",
                                     "--hostname",   hostname,
                                     "--ssh-key",    Trim(ReadAll(w->guest + "/id_ed25519.pub"))};
    for (const auto& e : expose) {
      args.emplace_back("--expose");
      args.push_back(e);
    }
    auto r = Ctl(args, false);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    auto j = nlohmann::json::parse(r.out, nullptr, false);
    if (j.is_discarded() || !j.contains("allocation")) {
      ADD_FAILURE() << "create output: " << r.out;
      return "";
    }
    std::string id = j["allocation"].value("allocation_id", "");
    std::cout << "allocation " << id << " is " << j["allocation"].value("state", "") << "\n";
    return id;
  }
  // `gpuaasctl alloc timeline --watch`: 0 settled active/released, 4 failed or blocked.
  static int Watch(const std::string& id) {
    return Ctl({"alloc", "timeline", "--id", id, "--watch", "--watch-timeout-s", "240"}).exit_code;
  }
  static v1::Allocation Get(const std::string& id) {
    v1::GetAllocationRequest g;
    g.set_allocation_id(id);
    auto r = w->p.Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g);
    EXPECT_TRUE(r.ok());
    return r.ok() ? r->allocation() : v1::Allocation();
  }
  static v1::GetAllocationTimelineResponse Timeline(const std::string& id) {
    v1::GetAllocationTimelineRequest r;
    r.set_allocation_id(id);
    r.set_page_size(500);
    auto t =
        w->p.Call<v1::GetAllocationTimelineResponse>("gpuaas.v1.scheduler.allocation.timeline", r);
    EXPECT_TRUE(t.ok());
    return t.ok() ? *t : v1::GetAllocationTimelineResponse();
  }
  static bool TimelineHas(const std::string& id, const std::string& step,
                          const std::string& stage = "") {
    const auto t = Timeline(id);
    for (const auto& e : t.entries()) {
      if (enums::Text(e.step()) == step && (stage.empty() || enums::Text(e.stage()) == stage)) {
        return true;
      }
    }
    return false;
  }
  static std::string DomainState(const std::string& id) {
    return Trim(Exec({Tool("virsh"), "-c", "qemu:///system", "domstate", "gpuaas-" + id}).out);
  }
  static bool DomainExists(const std::string& id) {
    return Exec({Tool("virsh"), "-c", "qemu:///system", "domstate", "gpuaas-" + id}).exit_code == 0;
  }
  // Filesystem signatures on the slot disk ("" when none).
  static std::string Signatures() {
    auto r = Exec({Tool("blkid"), "-p", "-o", "value", "-s", "TYPE", w->loop});
    return Trim(r.out);
  }
  static void Release(const std::string& id, int want_rc = 0) {
    EXPECT_EQ(
        Ctl({"alloc", "release", "--id", id, "--watch", "--watch-timeout-s", "240"}).exit_code,
        want_rc);
  }
  // `cmd` in the guest as root with `key`, from inside the slice network's namespace.
  // An operator's console of allocation `id`, as a browser gets it: a session, the WebSocket
  // through console-gw, the node's relay to the domain's VNC UNIX socket, and the RFB handshake
  // up to the server's init. Returns the desktop name and size the VM's VNC server announced,
  // or "error: ...".
  static std::string ConsoleServerInit(const std::string& id) {
    namespace asio = boost::asio;
    namespace beast = boost::beast;
    namespace websocket = beast::websocket;
    v1::CreateConsoleSessionRequest req;
    req.set_allocation_id(id);
    req.set_reason("e2e: the VM's console");
    auto s = w->p.Call<v1::CreateConsoleSessionResponse>("gpuaas.v1.console.session.create", req);
    if (!s.ok()) return "error: " + s.error().ToString();
    asio::io_context io;
    websocket::stream<beast::tcp_stream> ws(io);
    const uint16_t port = w->p.console->gateway_port();
    beast::error_code ec;
    beast::get_lowest_layer(ws).connect({asio::ip::make_address("127.0.0.1"), port}, ec);
    if (ec) return "error: connect " + ec.message();
    beast::get_lowest_layer(ws).expires_after(30s);
    const std::string origin = fmt::format("http://127.0.0.1:{}", port);
    ws.set_option(websocket::stream_base::decorator(
        [&](websocket::request_type& r) { r.set(beast::http::field::origin, origin); }));
    ws.handshake(fmt::format("127.0.0.1:{}", port), s->ws_path(), ec);
    if (ec) return "error: handshake " + ec.message();
    ws.binary(true);
    std::string in;
    auto need = [&](size_t n) -> bool {
      beast::flat_buffer buf;
      while (in.size() < n) {
        ws.read(buf, ec);
        if (ec) return false;
        in += beast::buffers_to_string(buf.data());
        buf.consume(buf.size());
      }
      return true;
    };
    auto take = [&](size_t n) {
      std::string head = in.substr(0, n);
      in.erase(0, n);
      return head;
    };
    auto u32 = [](const std::string& b, size_t at) {
      return (uint32_t{static_cast<uint8_t>(b[at])} << 24) |
             (uint32_t{static_cast<uint8_t>(b[at + 1])} << 16) |
             (uint32_t{static_cast<uint8_t>(b[at + 2])} << 8) | static_cast<uint8_t>(b[at + 3]);
    };
    if (!need(12)) return "error: no RFB banner: " + ec.message();
    const std::string version = take(12);
    if (version.rfind("RFB 003.", 0) != 0) return "error: banner " + version;
    ws.write(asio::buffer(std::string("RFB 003.008\n")), ec);
    if (!need(1)) return "error: no security types";
    const size_t n = static_cast<uint8_t>(take(1)[0]);
    if (n == 0 || !need(n)) return "error: security refused";
    if (take(n).find('\x01') == std::string::npos) return "error: no security type None";
    ws.write(asio::buffer(std::string("\x01", 1)), ec);
    if (!need(4) || u32(take(4), 0) != 0) return "error: security result";
    ws.write(asio::buffer(std::string("\x01", 1)), ec);  // ClientInit: shared
    if (!need(24)) return "error: no ServerInit";
    const std::string init = take(24);
    const int width = (static_cast<uint8_t>(init[0]) << 8) | static_cast<uint8_t>(init[1]);
    const int height = (static_cast<uint8_t>(init[2]) << 8) | static_cast<uint8_t>(init[3]);
    const size_t name_len = u32(init, 20);
    if (name_len > 4096 || !need(name_len)) return "error: no desktop name";
    const std::string name = take(name_len);
    ws.close(websocket::close_code::normal, ec);
    return fmt::format("{} {}x{}", name, width, height);
  }

  static node_agent::ToolResult Ssh(const std::string& key, const std::string& ip,
                                    const std::string& cmd) {
    return Exec(
        {Tool("ip"), "netns", "exec", w->netns, Tool("ssh"), "-i", key, "-o",
         "StrictHostKeyChecking=no", "-o", "UserKnownHostsFile=/dev/null", "-o", "LogLevel=ERROR",
         "-o", "ConnectTimeout=10", "-o", "BatchMode=yes", "root@" + ip, cmd},
        60s);
  }
  // `gpuaasctl -o json ARGS...` parsed (discarded JSON when it failed).
  static nlohmann::json CtlJson(std::vector<std::string> args) {
    args.insert(args.begin(), {"-o", "json"});
    auto r = Ctl(std::move(args), false);
    EXPECT_EQ(r.exit_code, 0) << r.out << r.err;
    return nlohmann::json::parse(r.out, nullptr, false);
  }
  // `ssh ARGS... cmd` with the guest's key from the client namespace: the internet's view.
  static node_agent::ToolResult ClientSsh(const std::vector<std::string>& args,
                                          const std::string& cmd, int connect_timeout_s = 10) {
    std::vector<std::string> argv = {Tool("ip"),
                                     "netns",
                                     "exec",
                                     w->client_netns,
                                     Tool("ssh"),
                                     "-i",
                                     w->guest + "/id_ed25519",
                                     "-o",
                                     "StrictHostKeyChecking=no",
                                     "-o",
                                     "UserKnownHostsFile=/dev/null",
                                     "-o",
                                     "LogLevel=ERROR",
                                     "-o",
                                     fmt::format("ConnectTimeout={}", connect_timeout_s),
                                     "-o",
                                     "BatchMode=yes"};
    argv.insert(argv.end(), args.begin(), args.end());
    argv.push_back(cmd);
    return Exec(argv, 60s);
  }
  // The node's DNAT table as `nft list` prints it ("" when there is none).
  static std::string IngressTable() {
    auto r = RunTool({Tool("ip"), "netns", "exec", w->netns, Tool("nft"), "list", "table", "ip",
                      "gpuaas_ingress"},
                     30s);
    return r.ok() && r->exit_code == 0 ? r->out : "";
  }
  // Seconds from the VM's readiness (its task succeeded) to the allocation becoming active: the
  // time its endpoints took to be applied (-1 when the timeline lacks one of them).
  static double EndpointWaitS(const std::string& id) {
    double ready = -1;
    const auto timeline = Timeline(id);
    for (const auto& e : timeline.entries()) {
      const double t = static_cast<double>(e.at().seconds()) + e.at().nanos() / 1e9;
      if (ready < 0 && e.step() == v1::TIMELINE_STEP_TASK_SUCCEEDED) ready = t;
      if (ready >= 0 && e.state() == v1::ALLOCATION_STATE_ACTIVE) return t - ready;
    }
    return -1;
  }
  static long RssKib() {
    std::ifstream f(fmt::format("/proc/{}/status", w->agent->pid()));
    std::string line;
    while (std::getline(f, line)) {
      if (line.rfind("VmRSS:", 0) == 0) return std::stol(line.substr(6));
    }
    return -1;
  }
};

TEST_F(SliceE2eTest, ProvisionsAReachableSliceAndReleasesItWithAWipeProof) {
  const std::string id = Create("e2e-happy", "e2e-slice-1", {"ssh:22"});
  ASSERT_FALSE(id.empty());
  ASSERT_EQ(Watch(id), 0) << "the slice did not become active";
  std::cout << fmt::format("endpoints applied {:.1f}s after the VM was ready\n", EndpointWaitS(id));
  auto a = Get(id);
  ASSERT_EQ(a.state(), v1::ALLOCATION_STATE_ACTIVE);
  ASSERT_TRUE(a.has_network());
  EXPECT_EQ(a.network().lease_state(), v1::LEASE_STATE_BOUND);
  EXPECT_EQ(a.network().actual_ip(), a.network().expected_ip());
  EXPECT_TRUE(DomainExists(id));
  EXPECT_EQ(Slots()[0].lifecycle(), v1::SLOT_LIFECYCLE_STATE_ACTIVE);

  // The tenant's view: SSH with the key from the request into the hostname from the request,
  // UEFI firmware, and the catalog image (ext4) on the slice disk.
  auto ssh = Ssh(w->guest + "/id_ed25519", a.network().actual_ip(),
                 "hostname; [ -d /sys/firmware/efi ] && echo efi; "
                 "dd if=/dev/vda bs=1 skip=1080 count=2 2>/dev/null | od -An -tx1");
  EXPECT_EQ(ssh.exit_code, 0) << ssh.err;
  EXPECT_NE(ssh.out.find("e2e-slice-1\n"), std::string::npos) << ssh.out;
  EXPECT_NE(ssh.out.find("efi\n"), std::string::npos) << ssh.out;
  EXPECT_NE(ssh.out.find("53 ef"), std::string::npos) << ssh.out;  // ext4 magic on vda
  EXPECT_EQ(Signatures(), "ext4");
  // The node's terminal relay key (created by the agent, seeded into every VM) gets in too:
  // the path the audited console takes.
  auto relay = Ssh(w->state_dir + "/terminal/id_ed25519", a.network().actual_ip(), "echo relay-ok");
  EXPECT_EQ(relay.exit_code, 0) << relay.err;
  EXPECT_EQ(Trim(relay.out), "relay-ok");

  // The operator's console: the VM's own VNC server (qemu's, on the UNIX socket libvirt gave the
  // domain) answers through console-gw and the node's relay, naming the domain. No qemu listens
  // on TCP.
  const std::string init = ConsoleServerInit(id);
  std::cout << "console: " << init << "\n";
  EXPECT_NE(init.find("(gpuaas-" + id + ") "), std::string::npos) << init;  // QEMU (<domain>) WxH
  auto listeners = RunTool({Tool("ss"), "-ltnpH"}, 10s);
  ASSERT_TRUE(listeners.ok());
  EXPECT_EQ(listeners->out.find("qemu"), std::string::npos) << listeners->out;

  // Its SSH endpoint: a port of the node's public address (from the pool), active, with the
  // connect hint a tenant copies. From the client namespace, through the node's DNAT, that hint
  // (plus the key) lands in this guest, which sees the client's own address.
  Ctl({"alloc", "get", "--id", id});
  auto got = CtlJson({"alloc", "get", "--id", id});
  ASSERT_FALSE(got.is_discarded());
  const auto endpoints = got["allocation"].value("endpoints", nlohmann::json::array());
  ASSERT_EQ(endpoints.size(), 1U) << got.dump();
  const auto& ep = endpoints[0];
  EXPECT_EQ(ep.value("name", ""), "ssh");
  EXPECT_EQ(ep.value("state", ""), "EXPOSURE_STATE_ACTIVE");
  EXPECT_EQ(ep.value("public_ip", ""), w->public_ip);
  const int port = ep.value("public_port", 0);
  EXPECT_TRUE(port >= 20000 && port <= 20009) << port;
  const std::string connect = ep.value("connect", "");
  ASSERT_EQ(connect, fmt::format("ssh -p {} root@{}", port, w->public_ip));
  EXPECT_NE(
      IngressTable().find(fmt::format("tcp dport {} dnat to {}:22", port, a.network().actual_ip())),
      std::string::npos)
      << IngressTable();
  const auto t_ssh = std::chrono::steady_clock::now();
  auto pub = ClientSsh({"-p", std::to_string(port), "root@" + w->public_ip},
                       "hostname; echo \"from $SSH_CLIENT\"");
  std::cout << fmt::format(
      "ssh through the endpoint took {:.1f}s\n",
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_ssh).count());
  std::cout << pub.out;
  EXPECT_EQ(pub.exit_code, 0) << pub.err;
  EXPECT_NE(pub.out.find("e2e-slice-1\n"), std::string::npos) << pub.out;
  EXPECT_NE(pub.out.find(fmt::format("from {} ", w->client_ip)), std::string::npos) << pub.out;

  // The node is drained for maintenance: the running VM is left alone (still reachable through
  // its endpoint, listed as what holds the node) and nothing new lands. Past the drain's
  // deadline the operator force-releases it: torn down with the wipe proof as any release.
  ASSERT_EQ(Ctl({"node", "drain", "--id", kNode, "--reason", "e2e maintenance", "--deadline", "1s"})
                .exit_code,
            0);
  auto holders = CtlJson({"node", "holders", "--id", kNode});
  ASSERT_FALSE(holders.is_discarded());
  const auto held = holders.value("holders", nlohmann::json::array());
  ASSERT_EQ(held.size(), 1U) << holders.dump();
  EXPECT_EQ(held[0].value("allocation_id", ""), id);
  auto during = ClientSsh({"-p", std::to_string(port), "root@" + w->public_ip}, "hostname");
  EXPECT_EQ(during.exit_code, 0) << during.err;
  EXPECT_NE(during.out.find("e2e-slice-1\n"), std::string::npos) << during.out;
  auto refused = Ctl({"alloc", "create", "--tenant", "acme", "--request-id", "e2e-while-draining",
                      "--gpus", "1", "--region", "us-east-1", "--pool", "e2e"});
  EXPECT_NE(refused.exit_code, 0) << "placed on a draining node: " << refused.out;
  EXPECT_NE(refused.err.find("no_placement"), std::string::npos) << refused.err;
  ASSERT_EQ(Ctl({"alloc", "release", "--id", id, "--force", "--reason", "drain deadline passed",
                 "--watch", "--watch-timeout-s", "240"})
                .exit_code,
            0);
  // Released: the exposure is removed, its port back in the pool, the node's DNAT rule gone and
  // the public port closed to the client (refused at once, not a hang).
  auto removed = CtlJson({"ingress", "exposures", "--alloc", id, "--state", "removed"});
  Ctl({"ingress", "exposures", "--alloc", id, "--state", "removed"});
  ASSERT_FALSE(removed.is_discarded());
  const auto exposures = removed.value("exposures", nlohmann::json::array());
  ASSERT_EQ(exposures.size(), 1U) << removed.dump();
  EXPECT_EQ(exposures[0].value("public_port", 0), port);
  Ctl({"ingress", "pool", "list"});
  auto pools = CtlJson({"ingress", "pool", "list"});
  ASSERT_FALSE(pools.is_discarded());
  bool pool_seen = false;
  for (const auto& p : pools.value("pools", nlohmann::json::array())) {
    if (p.value("name", "") != kPool) continue;
    pool_seen = true;
    // int64 is a JSON string; 0 is left out.
    EXPECT_EQ(p.value("used", "0"), "0") << p.dump();
    EXPECT_EQ(p.value("total", "0"), "10") << p.dump();
  }
  EXPECT_TRUE(pool_seen) << pools.dump();
  EXPECT_EQ(IngressTable().find(fmt::format("dport {} ", port)), std::string::npos)
      << IngressTable();
  const auto t_refused = std::chrono::steady_clock::now();
  auto closed = ClientSsh({"-p", std::to_string(port), "root@" + w->public_ip}, "hostname", 3);
  const double refused_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t_refused).count();
  EXPECT_NE(closed.exit_code, 0) << closed.out;
  EXPECT_EQ(closed.out.find("e2e-slice-1"), std::string::npos) << closed.out;
  EXPECT_LT(refused_s, 5.0) << closed.err;
  std::cout << fmt::format("after release: {} ({:.1f}s)\n", Trim(closed.err), refused_s);

  a = Get(id);
  EXPECT_EQ(a.state(), v1::ALLOCATION_STATE_RELEASED);
  for (const auto& c : a.claims()) EXPECT_TRUE(c.has_released_at());
  EXPECT_TRUE(TimelineHas(id, "claims_freed"));
  EXPECT_FALSE(DomainExists(id));
  EXPECT_EQ(Signatures(), "") << "the wipe left a signature";
  EXPECT_FALSE(fs::exists("/var/lib/libvirt/qemu/nvram/gpuaas-" + id + "_VARS.fd"));
  EXPECT_TRUE(TimelineHas(id, "force_released"));
  // Nothing holds the node any more: drained; back in service for the next cases.
  EXPECT_TRUE(testing::WaitFor(
      [] {
        auto show = CtlJson({"node", "show", "--id", kNode});
        return show.value("node", nlohmann::json::object()).value("admin_state", "") ==
               "NODE_ADMIN_STATE_DRAINED";
      },
      30s));
  ASSERT_EQ(Ctl({"node", "undrain", "--id", kNode, "--reason", "e2e maintenance done"}).exit_code,
            0);
  EXPECT_TRUE(testing::WaitFor([] { return SlotSchedulable(); }, 30s));
}

TEST_F(SliceE2eTest, AMountedDiskIsRefusedBeforeAnyWriteAndStaysBlockedUntilUnmounted) {
  ASSERT_EQ(Exec({Tool("mkfs.ext4"), "-q", "-F", "-L", "tenant-data", w->loop}).exit_code, 0);
  w->mnt = w->work + "/mnt";
  fs::create_directories(w->mnt);
  ASSERT_EQ(Exec({Tool("mount"), w->loop, w->mnt}, 30s).exit_code, 0);
  std::ofstream(w->mnt + "/precious") << "do not wipe";
  const std::string id = Create("e2e-mounted", "e2e-slice-2");
  ASSERT_FALSE(id.empty());
  EXPECT_EQ(Watch(id), 4);
  auto a = Get(id);
  EXPECT_EQ(a.state(), v1::ALLOCATION_STATE_FAILED);
  EXPECT_EQ(a.failure().code(), "disk_mounted");
  EXPECT_TRUE(TimelineHas(id, "task_rejected", "validate"));
  EXPECT_FALSE(DomainExists(id));
  // Cleanup refuses the mounted disk too: the slot is cleanup_blocked, nothing was written.
  EXPECT_TRUE(testing::WaitFor(
      [&] { return Slots()[0].lifecycle() == v1::SLOT_LIFECYCLE_STATE_CLEANUP_BLOCKED; }, 30s));
  EXPECT_EQ(ReadAll(w->mnt + "/precious"), "do not wipe");
  ASSERT_EQ(Exec({Tool("umount"), w->mnt}, 30s).exit_code, 0);
  w->mnt.clear();
  EXPECT_EQ(Signatures(), "ext4");

  // The operator unmounted it; releasing again retries the cleanup, which now wipes. The
  // allocation stays failed (that is its record); its slot is freed.
  Release(id);
  auto a2 = Get(id);
  EXPECT_EQ(a2.state(), v1::ALLOCATION_STATE_FAILED);
  for (const auto& c : a2.claims()) EXPECT_TRUE(c.has_released_at());
  EXPECT_EQ(Signatures(), "");
  EXPECT_TRUE(testing::WaitFor([] { return SlotSchedulable(); }, 30s));
}

TEST_F(SliceE2eTest, AGuestThatNeverGetsALeaseFailsWithANetworkingReason) {
  // DHCP requests from the slice bridge are dropped inside the namespace.
  const std::vector<std::string> rule = {"INPUT", "-p", "udp", "--dport", "67", "-j", "DROP"};
  auto ipt = [&](const std::string& op) {
    std::vector<std::string> argv = {Tool("ip"), "netns", "exec", w->netns, Tool("iptables"), op};
    argv.insert(argv.end(), rule.begin(), rule.end());
    return Exec(argv).exit_code;
  };
  ASSERT_EQ(ipt("-I"), 0);
  const std::string id = Create("e2e-nolease", "e2e-slice-3");
  ASSERT_FALSE(id.empty());
  // The slot is cleanup_blocked from the failure until the cleanup proof arrives.
  bool saw_blocked = false;
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        auto s = Slots();
        saw_blocked = saw_blocked ||
                      (!s.empty() && s[0].lifecycle() == v1::SLOT_LIFECYCLE_STATE_CLEANUP_BLOCKED);
        return Get(id).state() == v1::ALLOCATION_STATE_FAILED && !Timeline(id).in_flight();
      },
      180s, 200ms));
  EXPECT_EQ(ipt("-D"), 0);
  auto a = Get(id);
  EXPECT_EQ(a.state(), v1::ALLOCATION_STATE_FAILED);
  EXPECT_EQ(a.failure().code(), "lease_timeout");
  EXPECT_TRUE(TimelineHas(id, "task_failed", "readiness"));
  EXPECT_TRUE(saw_blocked) << "the failed slot was never cleanup_blocked";
  EXPECT_TRUE(TimelineHas(id, "claims_freed")) << "cleanup proof did not free the claim";
  EXPECT_FALSE(DomainExists(id));
  EXPECT_EQ(Signatures(), "");
  EXPECT_TRUE(testing::WaitFor([] { return SlotSchedulable(); }, 30s));
}

TEST_F(SliceE2eTest, AnAgentKilledMidProvisionAdoptsTheRunningVmAfterRestart) {
  const std::string id = Create("e2e-kill", "e2e-slice-4");
  ASSERT_FALSE(id.empty());
  // Kill -9 once the domain runs (the guest is booting; readiness not reached).
  ASSERT_TRUE(testing::WaitFor([&] { return DomainState(id) == "running"; }, 120s, 100ms));
  w->agent->Signal(SIGKILL);
  w->agent->Stop(5s);  // reaps it
  std::cout << "agent killed while provisioning " << id << "\n";
  EXPECT_TRUE(DomainExists(id)) << "the VM must outlive its agent";
  StartAgent();  // ready only after adoption
  EXPECT_EQ(Watch(id), 0);
  auto a = Get(id);
  EXPECT_EQ(a.state(), v1::ALLOCATION_STATE_ACTIVE);
  EXPECT_TRUE(TimelineHas(id, "task_progress", "adopt")) << "readiness was not resumed";
  // The restarted agent found the VM in libvirt and in its ledger: adopted, no drift.
  auto metrics =
      Exec({Tool("curl"), "-sf", fmt::format("http://127.0.0.1:{}/metrics", w->http_port)});
  EXPECT_NE(metrics.out.find("gpuaas_node_agent_adopted_domains{result=\"adopted\"} 1"),
            std::string::npos)
      << metrics.out;
  EXPECT_NE(metrics.out.find("gpuaas_node_agent_adopted_domains{result=\"orphan\"} 0"),
            std::string::npos);
  Release(id);
  EXPECT_EQ(Get(id).state(), v1::ALLOCATION_STATE_RELEASED);
  EXPECT_FALSE(DomainExists(id));
  EXPECT_TRUE(testing::WaitFor([] { return SlotSchedulable(); }, 30s));
}

TEST_F(SliceE2eTest, AgentRssStaysSmallAndSteadyOverRepeatedCycles) {
  std::vector<long> rss;
  for (int i = 0; i < 3; ++i) {
    const std::string id = Create(fmt::format("e2e-cycle-{}", i), fmt::format("e2e-cycle-{}", i));
    ASSERT_FALSE(id.empty());
    ASSERT_EQ(Watch(id), 0);
    Release(id);
    ASSERT_TRUE(testing::WaitFor([] { return SlotSchedulable(); }, 30s)) << SlotsText();
    rss.push_back(RssKib());
    std::cout << fmt::format("cycle {}: agent RSS {} KiB\n", i + 1, rss.back());
  }
  for (long r : rss) EXPECT_LT(r, 64 * 1024) << "agent RSS above 64 MiB";
  EXPECT_LT(rss.back() - rss.front(), 4 * 1024) << "agent RSS grew by more than 4 MiB";
}

}  // namespace
}  // namespace gpuaas
