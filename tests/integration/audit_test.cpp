// gpuaasctl audit against the real platform: an allocation driven create -> active -> release
// by a tenant, then `gpuaasctl audit allocation|slot|node` (the built binary, as the auditor
// role) replays each entity's history from the event streams: complete, in time order, with who
// did each change and why. Then the services are stopped and their databases dropped, and the
// audit prints exactly the same: the streams are the log.
#include <google/protobuf/util/time_util.h>
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <fstream>
#include <pqxx/pqxx>
#include <set>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/auth.hpp"
#include "gpuaas/v1/scheduler.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;
using json = nlohmann::json;

using CtlRun = testing::CommandResult;

class AuditTest : public ::testing::Test {
 protected:
  // gpuaasctl as `role` (its NATS key and a request token of the matching token role).
  CtlRun Ctl(const std::vector<std::string>& args, const std::string& role = "auditor") {
    const std::string token_role = role == "tenant-api" ? auth::kRoleTenant : role;
    std::vector<std::string> argv = {GPUAASCTL_BIN,
                                     "--nats",
                                     p_.nats.url(),
                                     "--role",
                                     role,
                                     "--nats-seed-file",
                                     p_.nats.SeedFile(role),
                                     "--token",
                                     p_.nats.Token(token_role, role == "tenant-api" ? "acme" : "")};
    argv.insert(argv.end(), args.begin(), args.end());
    return testing::RunCommand(argv);
  }

  // The audit's JSON records (empty when it failed).
  json Audit(const std::string& kind, const std::string& id) {
    auto r = Ctl({"audit", kind, "--id", id, "-o", "json"});
    EXPECT_EQ(r.rc, 0) << r.err << r.out;
    json j = json::parse(r.out, nullptr, false);
    return r.rc == 0 && j.is_array() ? j : json::array();
  }

  std::shared_ptr<messaging::Connection> As(const std::string& role, const std::string& token) {
    auto o = p_.nats.Options(role);
    o.token = token;
    auto c = messaging::Connection::Connect(o, log::Logger("audit-test", "t", log::Level::kError));
    EXPECT_TRUE(c.ok()) << c.error().ToString();
    return c.ok() ? *c : nullptr;
  }

  static v1::CreateAllocationRequest Order(const std::string& id) {
    v1::CreateAllocationRequest r;
    r.set_tenant("acme");
    r.set_request_id(id);
    r.set_sku("h200-sxm-slice");
    r.set_gpu_count(1);
    r.set_region("us-east-1");
    r.set_pool("audit");
    return r;
  }

  // Waits until `id` is in `state` (the tenant's view).
  bool WaitState(rpc::Client& client, const std::string& id, v1::AllocationState state) {
    return testing::WaitFor(
        [&] {
          v1::GetAllocationRequest g;
          g.set_allocation_id(id);
          auto a = client.Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g);
          return a.ok() && a->allocation().state() == state;
        },
        30s);
  }

  // Drops the services' databases (after p_.Stop()); returns how many were dropped.
  int DropServiceDatabases() {
    pqxx::connection c(testing::SharedPostgres().AdminDsn());
    pqxx::nontransaction tx(c);
    // What this process made: <prefix>_<pid>_<n>.
    auto ours = [&] {
      std::vector<std::string> names;
      for (const char* prefix : {"ipam", "inv", "sched"}) {
        for (auto row : tx.exec_params("SELECT datname FROM pg_database WHERE datname LIKE $1",
                                       fmt::format("{}\\_{}\\_%", prefix, getpid()))) {
          names.push_back(row[0].as<std::string>());
        }
      }
      return names;
    };
    const std::vector<std::string> names = ours();
    for (const auto& n : names) tx.exec("DROP DATABASE " + tx.quote_name(n) + " WITH (FORCE)");
    EXPECT_TRUE(ours().empty());
    return static_cast<int>(names.size());
  }

  static google::protobuf::Timestamp At(const json& rec) {
    google::protobuf::Timestamp t;
    EXPECT_TRUE(google::protobuf::util::TimeUtil::FromString(rec["time"].get<std::string>(), &t))
        << rec["time"];
    return t;
  }

  // The records are in time order (then stream, sequence) and no event appears twice.
  static void ExpectOrdered(const json& recs) {
    std::set<std::string> ids;
    for (size_t i = 0; i < recs.size(); ++i) {
      EXPECT_TRUE(ids.insert(recs[i]["event_id"].get<std::string>()).second) << recs[i];
      if (i == 0) continue;
      const auto a = At(recs[i - 1]);
      const auto b = At(recs[i]);
      EXPECT_TRUE(a < b || (a == b && std::make_pair(recs[i - 1]["stream"].get<std::string>(),
                                                     recs[i - 1]["sequence"].get<uint64_t>()) <
                                          std::make_pair(recs[i]["stream"].get<std::string>(),
                                                         recs[i]["sequence"].get<uint64_t>())))
          << recs[i - 1] << "\n"
          << recs[i];
    }
  }

  // The records whose event type is `type`.
  static std::vector<json> OfType(const json& recs, const std::string& type) {
    std::vector<json> out;
    for (const auto& r : recs) {
      if (r["type"] == type) out.push_back(r);
    }
    return out;
  }

  // ipam's reservation event that unbinds the slot's address from the allocation: its payload no
  // longer names the allocation, the version before it did.
  static bool Unbound(const json& recs) {
    for (const auto& r : OfType(recs, "gpuaas.v1.ipam.reservation.updated")) {
      for (const auto& c : r["changes"]) {
        if (c["field"] == "allocation_id" && c["to"] == "" && r["reason"] == "unbound") return true;
      }
    }
    return false;
  }

  // `later` starts with `earlier` (a history only grows).
  static void ExpectPrefix(const json& earlier, const json& later) {
    ASSERT_GE(later.size(), earlier.size());
    for (size_t i = 0; i < earlier.size(); ++i) EXPECT_EQ(later[i], earlier[i]) << i;
  }

  static bool AnyFrom(const json& recs, const std::string& service) {
    for (const auto& r : recs) {
      if (r["service"] == service) return true;
    }
    return false;
  }

  testing::Platform p_;
};

TEST_F(AuditTest, HistoriesAreCompleteOrderedAndSurviveTheServicesDatabases) {
  p_.Start();
  p_.StartApprovedAgent("audit-n1", "audit", 2);
  auto acme = As("tenant-api", p_.nats.Token(auth::kRoleTenant, "acme", "tenant:acme/alice"));
  rpc::Client tenant(acme);
  auto created = tenant.Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create",
                                                           Order("audit-1"), 10s);
  ASSERT_TRUE(created.ok()) << created.error().ToString();
  const std::string id = created->allocation().allocation_id();
  // A neighbour on the node's other slot: in the node's history, not in the allocation's or in
  // the slot's.
  auto other = tenant.Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create",
                                                         Order("audit-2"), 10s);
  ASSERT_TRUE(other.ok()) << other.error().ToString();
  const std::string other_id = other->allocation().allocation_id();
  ASSERT_TRUE(WaitState(tenant, id, v1::ALLOCATION_STATE_ACTIVE));
  v1::GetAllocationRequest get;
  get.set_allocation_id(id);
  auto active = tenant.Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", get);
  ASSERT_TRUE(active.ok());
  ASSERT_EQ(active->allocation().slot_keys_size(), 1);
  const std::string slot = "audit-n1/" + active->allocation().slot_keys(0);

  v1::ReleaseAllocationRequest rel;
  rel.set_allocation_id(id);
  rel.set_reason("training run finished");
  auto released =
      tenant.Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release", rel);
  ASSERT_TRUE(released.ok()) << released.error().ToString();
  ASSERT_TRUE(WaitState(tenant, id, v1::ALLOCATION_STATE_RELEASED));

  // The released event reaches the stream through the scheduler's outbox relay, shortly after.
  json alloc;
  ASSERT_TRUE(testing::WaitFor([&] {
    alloc = Audit("allocation", id);
    return !OfType(alloc, "gpuaas.v1.scheduler.allocation.released").empty() && Unbound(alloc);
  }));
  ExpectOrdered(alloc);
  // The allocation's own lifecycle, every state in order, each a newer generation.
  std::vector<std::string> states;
  int64_t generation = 0;
  for (const auto& r : alloc) {
    if (r["service"] != "scheduler" || r["entity"] != id) continue;
    const std::string state = r["data"]["allocation"]["state"];
    if (states.empty() || states.back() != state) states.push_back(state);
    const auto g = std::stoll(r["generation"].dump());
    EXPECT_GT(g, generation) << r;
    generation = g;
  }
  EXPECT_EQ(states,
            (std::vector<std::string>{"ALLOCATION_STATE_RESERVED", "ALLOCATION_STATE_PROVISIONING",
                                      "ALLOCATION_STATE_ACTIVE", "ALLOCATION_STATE_RELEASING",
                                      "ALLOCATION_STATE_RELEASED"}))
      << alloc.dump(2);
  // Who did it and why: alice placed and released it; the scheduler finished both.
  auto reserved = OfType(alloc, "gpuaas.v1.scheduler.allocation.reserved");
  ASSERT_FALSE(reserved.empty());
  EXPECT_EQ(reserved.front()["actor"]["subject"], "tenant:acme/alice");
  auto releasing = OfType(alloc, "gpuaas.v1.scheduler.allocation.releasing");
  ASSERT_EQ(releasing.size(), 1U) << alloc.dump(2);
  EXPECT_EQ(releasing[0]["actor"]["subject"], "tenant:acme/alice");
  EXPECT_EQ(releasing[0]["actor"]["tenant"], "acme");
  EXPECT_EQ(releasing[0]["reason"], "training run finished");
  bool state_change = false;
  for (const auto& c : releasing[0]["changes"]) {
    state_change |= c["field"] == "state" && c["from"] == "active" && c["to"] == "releasing";
  }
  EXPECT_TRUE(state_change) << releasing[0].dump(2);
  auto done = OfType(alloc, "gpuaas.v1.scheduler.allocation.released");
  ASSERT_EQ(done.size(), 1U);
  EXPECT_EQ(done[0]["actor"]["subject"], "service:scheduler");
  EXPECT_EQ(done[0]["summary"].get<std::string>().find("state releasing -> released"), 0U)
      << done[0]["summary"];
  // Every service's events about it: the node's task results (correlated by the allocation id)
  // and ipam's binding of the slot's address to it.
  EXPECT_TRUE(AnyFrom(alloc, "node-agent")) << alloc.dump(2);
  EXPECT_TRUE(AnyFrom(alloc, "ipam")) << alloc.dump(2);
  for (const auto& r : alloc) EXPECT_NE(r["entity"], other_id) << r;

  // The slot: approved by inventory, reserved by ipam, then this allocation (not the neighbour).
  json slot_recs = Audit("slot", slot);
  ExpectOrdered(slot_recs);
  ASSERT_FALSE(slot_recs.empty());
  EXPECT_FALSE(OfType(slot_recs, "gpuaas.v1.inventory.slot.updated").empty());
  EXPECT_FALSE(OfType(slot_recs, "gpuaas.v1.ipam.reservation.created").empty());
  EXPECT_FALSE(OfType(slot_recs, "gpuaas.v1.scheduler.allocation.released").empty());
  for (const auto& r : slot_recs) EXPECT_NE(r["entity"], other_id) << r;

  // The node: registered first, its agent's reports, its slots, both allocations.
  json node_recs = Audit("node", "audit-n1");
  ExpectOrdered(node_recs);
  ASSERT_FALSE(node_recs.empty());
  EXPECT_EQ(node_recs.front()["type"], "gpuaas.v1.inventory.node.registered") << node_recs[0];
  EXPECT_TRUE(AnyFrom(node_recs, "node-agent"));
  EXPECT_FALSE(OfType(node_recs, "gpuaas.v1.inventory.slot.updated").empty());
  std::set<std::string> entities;
  for (const auto& r : node_recs) entities.insert(r["entity"]);
  EXPECT_TRUE(entities.count(id) == 1 && entities.count(other_id) == 1);
  EXPECT_GT(node_recs.size(), alloc.size());

  // The text form: one line per event, with the actor and the change.
  auto text = Ctl({"audit", "allocation", "--id", id});
  ASSERT_EQ(text.rc, 0) << text.err;
  EXPECT_NE(text.out.find("tenant:acme/alice (tenant)"), std::string::npos) << text.out;
  bool release_line = false;
  std::istringstream lines(text.out);
  for (std::string line; std::getline(lines, line);) {
    release_line |= line.find("scheduler.allocation.releasing") != std::string::npos &&
                    line.find("tenant:acme/alice (tenant)") != std::string::npos &&
                    line.find("state active -> releasing") != std::string::npos &&
                    line.find("reason: training run finished") != std::string::npos;
  }
  EXPECT_TRUE(release_line) << text.out;
  EXPECT_EQ(static_cast<size_t>(std::count(text.out.begin(), text.out.end(), '\n')),
            alloc.size() + 1);  // + the header

  // --since cuts the history at a time (what changed is still judged against all of it).
  const std::string since = releasing[0]["time"];
  json tail = json::parse(
      Ctl({"audit", "allocation", "--id", id, "--since", since, "-o", "json"}).out, nullptr, false);
  ASSERT_TRUE(tail.is_array());
  ASSERT_FALSE(tail.empty());
  EXPECT_EQ(tail[0]["event_id"], releasing[0]["event_id"]);
  EXPECT_EQ(tail[0]["summary"], releasing[0]["summary"]);

  // The streams are the log: with every service stopped, then with every service database
  // dropped, the same. (Stopped first so no late report lands between the two; what was read
  // while they ran is where each history starts.)
  p_.Stop();
  const json alloc_stopped = Audit("allocation", id);
  const json slot_stopped = Audit("slot", slot);
  const json node_stopped = Audit("node", "audit-n1");
  const std::string text_stopped = Ctl({"audit", "allocation", "--id", id}).out;
  ExpectPrefix(alloc, alloc_stopped);
  ExpectPrefix(slot_recs, slot_stopped);
  ExpectPrefix(node_recs, node_stopped);
  EXPECT_EQ(DropServiceDatabases(), 3);
  EXPECT_EQ(Audit("allocation", id), alloc_stopped);
  EXPECT_EQ(Audit("slot", slot), slot_stopped);
  EXPECT_EQ(Audit("node", "audit-n1"), node_stopped);
  EXPECT_EQ(Ctl({"audit", "allocation", "--id", id}).out, text_stopped);
}

TEST_F(AuditTest, UnknownIdsBadIdsAndRolesWithoutStreamsAreClearErrors) {
  p_.Start();
  // An id no event names: NOT_FOUND no_events (exit 1, as any NOT_FOUND the platform answers).
  auto none = Ctl({"audit", "allocation", "--id", "0190aaaa-0000-7000-8000-000000000000"});
  EXPECT_EQ(none.rc, 1);
  EXPECT_NE(none.err.find("NOT_FOUND no_events: no events for allocation "
                          "0190aaaa-0000-7000-8000-000000000000"),
            std::string::npos)
      << none.err;
  auto none_json = Ctl({"audit", "node", "--id", "nowhere", "-o", "json"});
  EXPECT_EQ(none_json.rc, 1);
  json status = json::parse(none_json.out, nullptr, false);
  EXPECT_EQ(status["code"], "NOT_FOUND") << none_json.out;
  EXPECT_EQ(status["reason"], "no_events");
  // A slot id names its node: usage error (exit 2).
  auto bad = Ctl({"audit", "slot", "--id", "gpu-0000:18:00.0"});
  EXPECT_EQ(bad.rc, 2);
  EXPECT_NE(bad.err.find("slot_id_invalid"), std::string::npos) << bad.err;
  auto bad_since = Ctl({"audit", "node", "--id", "n1", "--since", "yesterday"});
  EXPECT_EQ(bad_since.rc, 2);
  EXPECT_NE(bad_since.err.find("since_invalid"), std::string::npos) << bad_since.err;
  // The tenant gateway reads no stream: the server refuses it, and the audit says so at once.
  auto refused = Ctl({"audit", "node", "--id", "n1"}, "tenant-api");
  EXPECT_EQ(refused.rc, 1);
  EXPECT_NE(refused.err.find("PERMISSION_DENIED nats_permission_denied"), std::string::npos)
      << refused.err;
  // The operator reads them too.
  EXPECT_EQ(Ctl({"audit", "node", "--id", "n1"}, "operator").rc, 1);
}

}  // namespace
}  // namespace gpuaas
