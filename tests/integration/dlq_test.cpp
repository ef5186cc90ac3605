// Dead letters end to end: the platform in process, real dead letters made by the scheduler's
// node projection, and `gpuaasctl dlq` (the built binary, as the operator) listing, showing,
// replaying and discarding them. An undecodable event is rejected again on replay and stays; an
// event dead-lettered as permanent (its insert violated a constraint) is applied by a replay once
// the cause is removed, a second replay is a duplicate (the inbox), and discard removes it.
#include <gtest/gtest.h>
#include <sys/wait.h>

#include <cstdio>
#include <fstream>
#include <pqxx/pqxx>
#include <sstream>
#include <string>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/access.hpp"
#include "gpuaas/common/dlq.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;
using json = nlohmann::json;

using CtlRun = testing::CommandResult;

class DlqTest : public ::testing::Test {
 protected:
  void SetUp() override { p_.Start(); }

  // gpuaasctl as the operator (its NATS key and an operator request token).
  CtlRun Ctl(const std::vector<std::string>& args) {
    std::vector<std::string> argv = {GPUAASCTL_BIN,
                                     "--nats",
                                     p_.nats.url(),
                                     "--role",
                                     "operator",
                                     "--nats-seed-file",
                                     p_.nats.SeedFile("operator"),
                                     "--token",
                                     p_.nats.Token("operator")};
    argv.insert(argv.end(), args.begin(), args.end());
    return testing::RunCommand(argv);
  }

  json CtlJson(const std::vector<std::string>& args, int want_rc) {
    auto all = args;
    all.insert(all.end(), {"-o", "json"});
    auto r = Ctl(all);
    EXPECT_EQ(r.rc, want_rc) << r.err << r.out;
    json j = json::parse(r.out, nullptr, false);
    EXPECT_FALSE(j.is_discarded()) << r.out;
    return j;
  }

  // Waits for the dead letter of the scheduler's node projection for stream sequence `seq`;
  // returns its GPUAAS_DLQ sequence (0 when none came).
  uint64_t WaitDeadLetter(uint64_t stream_seq) {
    const auto deadline = std::chrono::steady_clock::now() + 20s;
    while (std::chrono::steady_clock::now() < deadline) {
      auto l = dlq::ListNewest(*p_.conn, "GPUAAS_EVT_INVENTORY", scheduler::kNodeProjection, 20);
      if (l.ok()) {
        for (const auto& e : *l) {
          v1::DeadLetter dl;
          if (dl.ParseFromString(e.data) && dl.stream_sequence() == stream_seq) return e.sequence;
        }
      }
      std::this_thread::sleep_for(50ms);
    }
    return 0;
  }

  uint64_t Publish(const std::string& subject, const std::string& data) {
    auto ack = messaging::JsPublish(*p_.conn, subject, data, ids::NewUuidV7());
    EXPECT_TRUE(ack.ok()) << ack.error().ToString();
    return ack.ok() ? ack->sequence : 0;
  }

  std::string SchedulerDsn() { return p_.scheduler->runtime().config().pg_dsn; }

  int ProjectedNodes(const std::string& node_id) {
    pqxx::connection c(SchedulerDsn());
    pqxx::work tx(c);
    return tx.exec_params1("SELECT count(*) FROM projected_nodes WHERE node_id = $1", node_id)[0]
        .as<int>();
  }

  void Sql(const std::string& sql) {
    pqxx::connection c(SchedulerDsn());
    pqxx::work tx(c);
    tx.exec(sql);
    tx.commit();
  }

  testing::Platform p_;
};

TEST_F(DlqTest, ListShowReplayAndDiscardThroughTheOwningService) {
  // 1. An undecodable event: the node projection dead-letters it.
  const uint64_t bad_seq = Publish("gpuaas.v1.evt.inventory.node.registered", "\xff\x01not-proto");
  const uint64_t bad = WaitDeadLetter(bad_seq);
  ASSERT_NE(bad, 0U) << "no dead letter for the undecodable event";

  json list = CtlJson({"dlq", "list", "--consumer", scheduler::kNodeProjection}, 0);
  ASSERT_TRUE(list["dead_letters"].is_array());
  ASSERT_EQ(list["dead_letters"].size(), 1U) << list.dump();
  EXPECT_EQ(list["dead_letters"][0]["dlq_sequence"], bad);
  EXPECT_EQ(list["dead_letters"][0]["kind"], "undecodable");
  EXPECT_EQ(list["dead_letters"][0]["subject"], "gpuaas.v1.evt.inventory.node.registered");
  auto text = Ctl({"dlq", "list", "--stream", "GPUAAS_EVT_INVENTORY"});
  EXPECT_EQ(text.rc, 0) << text.err;
  EXPECT_NE(text.out.find("GPUAAS_EVT_INVENTORY/scheduler-inventory-nodes"), std::string::npos)
      << text.out;

  // Replayed: the scheduler's handler rejects it again (exit 4), and it stays.
  json again = CtlJson({"dlq", "replay", "--seq", std::to_string(bad)}, 4);
  EXPECT_EQ(again["outcome"], "REPLAY_OUTCOME_REJECTED") << again.dump();
  EXPECT_EQ(again["kind"], "undecodable");
  EXPECT_EQ(again["consumer"], scheduler::kNodeProjection);
  json shown = CtlJson({"dlq", "show", "--seq", std::to_string(bad)}, 0);
  EXPECT_EQ(shown["consumer"], scheduler::kNodeProjection);
  EXPECT_EQ(shown["payload_escaped"], "\\xff\\x01not-proto") << shown.dump();

  // 2. A valid event whose effect fails permanently now (the projection refuses the node).
  Sql("ALTER TABLE projected_nodes ADD CONSTRAINT dlq_test_block CHECK (node_id <> 'dlq-node')");
  v1::NodeSnapshot snap;
  snap.mutable_node()->set_node_id("dlq-node");
  snap.mutable_node()->set_hostname("dlq-node.test");
  snap.mutable_node()->set_region("us-east-1");
  snap.mutable_node()->set_pool("h200");
  snap.mutable_node()->set_capacity_profile(v1::CAPACITY_PROFILE_BAREMETAL);
  snap.mutable_node()->set_generation(1);
  v1::Event ev;
  ev.set_id(ids::NewUuidV7());
  ev.set_specversion("1.0");
  ev.set_type("gpuaas.v1.inventory.node.registered");
  ev.set_source("dlq-test");
  ev.set_subject("dlq-node");
  ev.mutable_data()->PackFrom(snap);
  const uint64_t blocked_seq =
      Publish("gpuaas.v1.evt.inventory.node.registered", ev.SerializeAsString());
  const uint64_t blocked = WaitDeadLetter(blocked_seq);
  ASSERT_NE(blocked, 0U) << "no dead letter for the refused event";
  shown = CtlJson({"dlq", "show", "--seq", std::to_string(blocked)}, 0);
  EXPECT_EQ(shown["kind"], "permanent");
  EXPECT_EQ(shown["payload_event"]["id"], ev.id()) << shown.dump();
  auto show_text = Ctl({"dlq", "show", "--seq", std::to_string(blocked)});
  EXPECT_NE(show_text.out.find("payload (gpuaas.v1.Event)"), std::string::npos) << show_text.out;
  EXPECT_EQ(ProjectedNodes("dlq-node"), 0);
  // Newest first.
  list = CtlJson({"dlq", "list", "--consumer", scheduler::kNodeProjection}, 0);
  ASSERT_EQ(list["dead_letters"].size(), 2U);
  EXPECT_EQ(list["dead_letters"][0]["dlq_sequence"], blocked);
  EXPECT_EQ(list["dead_letters"][1]["dlq_sequence"], bad);
  EXPECT_EQ(CtlJson({"dlq", "list", "--consumer", scheduler::kNodeProjection, "--limit", "1"},
                    0)["dead_letters"]
                .size(),
            1U);

  // While the cause remains, a replay is rejected again and changes nothing.
  again = CtlJson({"dlq", "replay", "--seq", std::to_string(blocked)}, 4);
  EXPECT_EQ(again["outcome"], "REPLAY_OUTCOME_REJECTED") << again.dump();
  EXPECT_EQ(again["kind"], "permanent");
  EXPECT_EQ(ProjectedNodes("dlq-node"), 0);

  // The cause removed: applied once; the second replay is a duplicate (the inbox).
  Sql("ALTER TABLE projected_nodes DROP CONSTRAINT dlq_test_block");
  json applied = CtlJson({"dlq", "replay", "--seq", std::to_string(blocked)}, 0);
  EXPECT_EQ(applied["outcome"], "REPLAY_OUTCOME_APPLIED") << applied.dump();
  EXPECT_EQ(ProjectedNodes("dlq-node"), 1);
  json dup = CtlJson({"dlq", "replay", "--seq", std::to_string(blocked)}, 0);
  EXPECT_EQ(dup["outcome"], "REPLAY_OUTCOME_DUPLICATE") << dup.dump();
  EXPECT_EQ(ProjectedNodes("dlq-node"), 1);

  // Discard: only with --yes; then it is gone, and the other one is still there.
  auto refused = Ctl({"dlq", "discard", "--seq", std::to_string(blocked)});
  EXPECT_EQ(refused.rc, 2);
  EXPECT_NE(refused.err.find("confirm_required"), std::string::npos) << refused.err;
  json discarded = CtlJson({"dlq", "discard", "--seq", std::to_string(blocked), "--yes"}, 0);
  EXPECT_EQ(discarded["discarded"], true);
  json gone = CtlJson({"dlq", "show", "--seq", std::to_string(blocked)}, 1);
  EXPECT_EQ(gone["reason"], "dead_letter_not_found") << gone.dump();
  gone = CtlJson({"dlq", "replay", "--seq", std::to_string(blocked)}, 1);
  EXPECT_EQ(gone["reason"], "dead_letter_not_found") << gone.dump();
  list = CtlJson({"dlq", "list", "--consumer", scheduler::kNodeProjection}, 0);
  ASSERT_EQ(list["dead_letters"].size(), 1U);
  EXPECT_EQ(list["dead_letters"][0]["dlq_sequence"], bad);
}

TEST_F(DlqTest, AServiceReplaysOnlyItsOwnConsumersAndOnlyForOperators) {
  const uint64_t seq = Publish("gpuaas.v1.evt.inventory.node.registered", "junk");
  const uint64_t letter = WaitDeadLetter(seq);
  ASSERT_NE(letter, 0U);
  // ipam does not run the scheduler's consumer: it refuses instead of running anything.
  rpc::Client client(p_.conn);
  client.WithToken(p_.nats.Token("operator"));
  v1::ReplayDeadLetterRequest req;
  req.set_dlq_sequence(letter);
  auto r = client.Call<v1::ReplayDeadLetterResponse>("gpuaas.v1.ipam.dlq.replay", req, 5s);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "consumer_not_owned") << r.error().ToString();
  // A tenant token is refused by the scheduler.
  rpc::Client tenant(p_.conn);
  tenant.WithToken(p_.nats.Token("tenant", "acme"));
  auto t = tenant.Call<v1::ReplayDeadLetterResponse>("gpuaas.v1.scheduler.dlq.replay", req, 5s);
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.error().code, Code::kPermissionDenied) << t.error().ToString();
  // No sequence.
  req.set_dlq_sequence(0);
  auto z = client.Call<v1::ReplayDeadLetterResponse>("gpuaas.v1.scheduler.dlq.replay", req, 5s);
  ASSERT_FALSE(z.ok());
  EXPECT_EQ(z.error().reason, "dlq_sequence_required");
  // The contract maps durables to the service that replays them.
  const auto& c = access::EmbeddedContract();
  auto owner = [&](const std::string& stream, const std::string& durable) {
    auto o = dlq::ReplayServiceOf(c, stream, durable);
    return o.ok() ? *o : o.error().reason;
  };
  EXPECT_EQ(owner("", scheduler::kNodeProjection), "scheduler");
  EXPECT_EQ(owner("GPUAAS_NODE_TASKS", "node-gpu-07"), "inventory");
  EXPECT_EQ(owner("GPUAAS_EVT_NODE", "inventory-node-topology"), "inventory");
  EXPECT_FALSE(dlq::ReplayServiceOf(c, "", "nobody").ok());
}

}  // namespace
}  // namespace gpuaas
