// The operator page in a real browser, against the real services: inventory, ipam, the
// scheduler and console-gw in-process on real NATS and PostgreSQL, a node-agent (simulated VM
// runtime) whose slice's console is a real qemu serving VNC on a UNIX socket (no guest: SeaBIOS'
// screen), and tests/browser/operator_page.mjs driving headless Chromium through puppeteer-core:
// log in, approve a slot until the scheduler calls it schedulable, open the slice's console and
// see its framebuffer, and the refusals (replayed grant, wrong scope, another origin). Then the
// audit trail on GPUAAS_EVT_CONSOLE is checked here. The expired grant is console-gw's own test.
#include <gtest/gtest.h>

#include <sys/stat.h>

#include <filesystem>
#include <fstream>

#include <fmt/format.h>

#include "gpuaas/common/ids.hpp"
#include "gpuaas/console_gw/console_gw_service.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/event.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

constexpr const char* kNode = "gpu-web1";

std::string Which(const std::vector<std::string>& candidates) {
  for (const auto& c : candidates) {
    if (access(c.c_str(), X_OK) == 0) return c;
  }
  return "";
}

TEST(ConsoleBrowserTest, AnOperatorApprovesASlotAndOpensASlicesConsoleInTheBrowser) {
  const std::string chromium = Which({"/usr/bin/chromium-headless-shell", "/usr/bin/chromium"});
  const std::string qemu = Which({"/usr/bin/qemu-system-x86_64"});
  const std::string tools = std::string(GPUAAS_SOURCE_DIR) + "/tools";
  // scripts/install-deps installs all three; without them this test cannot say anything.
  ASSERT_FALSE(chromium.empty()) << "no chromium: run scripts/install-deps";
  ASSERT_FALSE(qemu.empty()) << "no qemu-system-x86_64: run scripts/install-deps";
  ASSERT_TRUE(std::filesystem::exists(tools + "/node_modules/puppeteer-core"))
      << "no puppeteer-core under tools/: run scripts/install-deps";

  testing::Platform p;
  p.Start();
  const std::string consoles = testing::MakeTempDir("gpuaas-consoles");
  p.StartAgent(kNode, 2, "default",
               {{"GPUAAS_NODE_DESIRED_POLL_MS", "100"},
                {"GPUAAS_NODE_AGENT_SIM_BEHAVIOR", "succeed"},
                {"GPUAAS_NODE_AGENT_SIM_STEP_MS", "5"},
                {"GPUAAS_CONSOLE_SIM_SOCKET_DIR", consoles}});
  // One slot approved here (for the slice whose console the browser opens); the other stays a
  // candidate for the browser to approve.
  std::vector<std::string> candidates;
  ASSERT_TRUE(testing::WaitFor([&] {
    v1::ShowNodeRequest r;
    r.set_node_id(kNode);
    auto s = p.Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
    if (!s.ok() || s->snapshot_version() < 1) return false;
    candidates.clear();
    for (const auto& c : s->topology().candidates()) {
      candidates.push_back(c.slot_key());
    }
    return candidates.size() == 2;
  }));
  std::sort(candidates.begin(), candidates.end());
  v1::ApproveSlotsRequest approve;
  approve.set_node_id(kNode);
  approve.add_slot_keys(candidates[0]);
  auto a = p.Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", approve);
  ASSERT_TRUE(a.ok()) << a.error().ToString();
  ASSERT_TRUE(testing::WaitFor([&] {
    v1::ListProjectedSlotsRequest lr;
    lr.set_node_id(kNode);
    auto l = p.Call<v1::ListProjectedSlotsResponse>("gpuaas.v1.scheduler.slot.list", lr);
    if (!l.ok()) return false;
    for (const auto& s : l->slots()) {
      if (s.slot_key() == candidates[0] && s.schedulable()) return true;
    }
    return false;
  }));
  v1::CreateAllocationRequest cr;
  cr.set_tenant("acme");
  cr.set_request_id(ids::NewUuidV7());
  cr.set_sku("h200-sxm-slice");
  cr.set_gpu_count(1);
  cr.set_region("us-east-1");
  auto created = p.Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", cr);
  ASSERT_TRUE(created.ok()) << created.error().ToString();
  const std::string alloc = created->allocation().allocation_id();
  ASSERT_TRUE(testing::WaitFor(
      [&] {
        v1::GetAllocationRequest g;
        g.set_allocation_id(alloc);
        auto r = p.Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g);
        return r.ok() && r->allocation().state() == v1::ALLOCATION_STATE_ACTIVE;
      },
      30s));

  // The slice's "VM": qemu with no guest, VNC on the UNIX socket the agent's runtime names.
  const std::string socket = consoles + "/gpuaas-" + alloc + ".vnc";
  testing::Process vm;
  vm.Spawn({qemu, "-machine", "accel=tcg", "-nodefaults", "-vga", "std", "-display", "none", "-vnc",
            "unix:" + socket},
           testing::MakeTempDir("gpuaas-qemu") + "/qemu.log");
  ASSERT_TRUE(testing::WaitFor([&] {
    struct stat st {};
    return stat(socket.c_str(), &st) == 0 && S_ISSOCK(st.st_mode);
  }));

  // console-gw, as deployed: its own identity, database and the page from the source tree.
  p.StartConsole();
  const std::string url = fmt::format("http://127.0.0.1:{}", p.console->gateway_port());

  const std::string shot = std::string(GPUAAS_BINARY_DIR) + "/console-browser/operator-console.png";
  std::filesystem::remove(shot);
  auto r = testing::RunCommand(
      {"/usr/bin/env", "GPUAAS_CONSOLE_URL=" + url,
       "GPUAAS_OPERATOR_TOKEN=" + p.nats.Token("operator", "", "user:browser-test"),
       std::string("GPUAAS_NODE_ID=") + kNode, "GPUAAS_SLOT_KEY=" + candidates[1],
       "GPUAAS_ALLOCATION_ID=" + alloc, "GPUAAS_SCREENSHOT=" + shot, "CHROMIUM=" + chromium,
       "GPUAAS_TOOLS_DIR=" + tools, "node",
       std::string(GPUAAS_SOURCE_DIR) + "/tests/browser/operator_page.mjs"});
  std::cout << r.out << r.err;
  ASSERT_EQ(r.rc, 0) << "the browser run failed (its steps are above)";
  EXPECT_GT(std::filesystem::file_size(shot), 1000U) << "the console screenshot";

  // The audit trail: the browser's console connected (and who opened it), and each refusal.
  std::map<std::string, int> seen;
  bool connected_by_browser_user = false;
  ASSERT_TRUE(testing::WaitFor([&] {
    seen.clear();
    for (const auto& e : testing::ReadStream(*p.conn, "GPUAAS_EVT_CONSOLE")) {
      v1::ConsoleSessionEvent d;
      if (!e.event.data().UnpackTo(&d)) continue;
      ++seen[e.subject + (d.failure().empty() ? "" : ":" + d.failure())];
      if (e.subject == "gpuaas.v1.evt.console.session.connected" &&
          d.session().allocation_id() == alloc &&
          e.event.actor().subject() == "user:browser-test") {
        connected_by_browser_user = true;
      }
    }
    return seen.count("gpuaas.v1.evt.console.connect.refused:grant_used") &&
           seen.count("gpuaas.v1.evt.console.connect.refused:wrong_scope") &&
           seen.count("gpuaas.v1.evt.console.connect.refused:cross_origin");
  }));
  EXPECT_TRUE(connected_by_browser_user);
  EXPECT_GE(seen["gpuaas.v1.evt.console.session.created"], 1);
  p.console->Shutdown();
  vm.Stop();
}

}  // namespace
}  // namespace gpuaas
