// RPC server/client and JetStream consumer behaviour against a real nats-server.
#include <gtest/gtest.h>

#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <mutex>
#include <thread>
#include <vector>

#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "gpuaas/v1/status.pb.h"
#include "test_env.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;

class MessagingTest : public ::testing::Test {
 protected:
  void SetUp() override {
    log_ = log::Logger("test", "t1", log::Level::kWarn);
    auto c = messaging::Connection::Connect(nats_.Options(testing::TestNats::kHarness), log_);
    ASSERT_TRUE(c.ok()) << c.error().ToString();
    conn_ = *c;
  }
  testing::TestNats nats_;
  log::Logger log_;
  std::shared_ptr<messaging::Connection> conn_;
  prometheus::Registry registry_;
};

std::unique_ptr<rpc::Server> EchoServer(const std::shared_ptr<messaging::Connection>& conn,
                                        const log::Logger& log, prometheus::Registry* reg,
                                        const rpc::ServerOptions& opts = {}) {
  auto s = std::make_unique<rpc::Server>(conn, "test", "gpuaas.*.test.>", log, reg, opts);
  s->Handle<v1::RegisterNodeRequest, v1::RegisterNodeResponse>(
      "gpuaas.v1.test.node.echo",
      [](const v1::RegisterNodeRequest& req,
         rpc::Context& ctx) -> Result<v1::RegisterNodeResponse> {
        if (req.node_id().empty()) {
          return Error::InvalidArgument("missing_fields", "node_id is required",
                                        {{"node_id", "required"}});
        }
        if (req.node_id() == "slow") std::this_thread::sleep_for(300ms);
        if (req.node_id() == "throw") throw std::runtime_error("boom");
        v1::RegisterNodeResponse resp;
        resp.mutable_node()->set_node_id(req.node_id());
        resp.mutable_node()->set_hostname(ctx.trace_id);
        return resp;
      });
  EXPECT_TRUE(s->Start().ok());
  return s;
}

v1::Reply RawReply(messaging::Connection& c, const std::string& subject, const std::string& data,
                   const messaging::Headers& h = {}) {
  auto r = c.Request(subject, data, h, 2000ms);
  EXPECT_TRUE(r.ok()) << (r.ok() ? "" : r.error().ToString());
  v1::Reply reply;
  EXPECT_TRUE(r.ok() && reply.ParseFromString(r->data));
  return reply;
}

TEST_F(MessagingTest, TypedRequestReplyPropagatesTrace) {
  auto server = EchoServer(conn_, log_, &registry_);
  rpc::Client client(conn_);
  v1::RegisterNodeRequest req;
  req.set_node_id("n1");
  const std::string tp = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01";
  auto r = client.Call<v1::RegisterNodeResponse>("gpuaas.v1.test.node.echo", req, 2000ms, tp);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->node().node_id(), "n1");
  EXPECT_EQ(r->node().hostname(), "0af7651916cd43dd8448eb211c80319c");
}

TEST_F(MessagingTest, BadInputGetsStructuredErrorsAndServerKeepsServing) {
  rpc::ServerOptions small;
  small.workers = 2;
  small.max_queue = 64;
  small.max_payload = 1024;
  auto server = EchoServer(conn_, log_, &registry_, small);
  // Malformed protobuf.
  auto bad = RawReply(*conn_, "gpuaas.v1.test.node.echo", std::string("\xff\xff\xff\xff", 4));
  EXPECT_EQ(bad.status().code(), v1::INVALID_ARGUMENT);
  EXPECT_EQ(bad.status().reason(), "malformed_payload");
  // Missing fields: the handler's own validation.
  auto missing = RawReply(*conn_, "gpuaas.v1.test.node.echo", "");
  EXPECT_EQ(missing.status().code(), v1::INVALID_ARGUMENT);
  EXPECT_EQ(missing.status().details().at("node_id"), "required");
  // Unknown version.
  auto v2 = RawReply(*conn_, "gpuaas.v2.test.node.echo", "");
  EXPECT_EQ(v2.status().code(), v1::INVALID_ARGUMENT);
  EXPECT_EQ(v2.status().reason(), "unsupported_version");
  // Unknown subject in a known version.
  auto unknown = RawReply(*conn_, "gpuaas.v1.test.node.frobnicate", "");
  EXPECT_EQ(unknown.status().code(), v1::UNIMPLEMENTED);
  EXPECT_EQ(unknown.status().reason(), "unknown_subject");
  // Oversize payload.
  auto big = RawReply(*conn_, "gpuaas.v1.test.node.echo", std::string(4096, 'x'));
  EXPECT_EQ(big.status().code(), v1::INVALID_ARGUMENT);
  EXPECT_EQ(big.status().reason(), "payload_too_large");
  // Deadline already passed when the request is handled.
  auto late =
      RawReply(*conn_, "gpuaas.v1.test.node.echo", "", {{messaging::kHeaderDeadline, "1000"}});
  EXPECT_EQ(late.status().code(), v1::DEADLINE_EXCEEDED);
  // Deadlines whose nanoseconds overflow (fuzz: Gpuaas-Deadline-Ms 99999999999999999): far
  // ahead is capped at a day and served; far back is past.
  v1::RegisterNodeRequest far_req;
  far_req.set_node_id("far");
  auto far = RawReply(*conn_, "gpuaas.v1.test.node.echo", far_req.SerializeAsString(),
                      {{messaging::kHeaderDeadline, "99999999999999999"}});
  EXPECT_EQ(far.status().code(), v1::OK) << far.status().reason();
  auto far_back = RawReply(*conn_, "gpuaas.v1.test.node.echo", far_req.SerializeAsString(),
                           {{messaging::kHeaderDeadline, "-99999999999999999"}});
  EXPECT_EQ(far_back.status().code(), v1::DEADLINE_EXCEEDED);
  // A handler that throws becomes INTERNAL.
  v1::RegisterNodeRequest t;
  t.set_node_id("throw");
  auto thrown = RawReply(*conn_, "gpuaas.v1.test.node.echo", t.SerializeAsString());
  EXPECT_EQ(thrown.status().code(), v1::INTERNAL);
  // And a good request still works.
  rpc::Client client(conn_);
  v1::RegisterNodeRequest ok;
  ok.set_node_id("still-here");
  auto r = client.Call<v1::RegisterNodeResponse>("gpuaas.v1.test.node.echo", ok);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->node().node_id(), "still-here");
}

// A node-scoped route (`….node.{node_id}.…`) answers every node's subject, binds the node from
// the subject, and holds the request's own node_id to it: a node cannot ask about, or ack for,
// another node even where the server let it publish the subject.
TEST_F(MessagingTest, ANodeScopedRouteBindsTheSubjectsNodeAndRefusesAnother) {
  auto server = std::make_unique<rpc::Server>(conn_, "test", "gpuaas.*.test.>", log_, &registry_);
  server->Handle<v1::RegisterNodeRequest, v1::RegisterNodeResponse>(
      "gpuaas.v1.test.node.{node_id}.echo",
      [](const v1::RegisterNodeRequest& req,
         rpc::Context& ctx) -> Result<v1::RegisterNodeResponse> {
        v1::RegisterNodeResponse resp;
        resp.mutable_node()->set_node_id(req.node_id());
        resp.mutable_node()->set_hostname(ctx.node_id + "|" + ctx.subject);
        return resp;
      });
  ASSERT_TRUE(server->Start().ok());
  rpc::Client client(conn_);
  v1::RegisterNodeRequest req;
  req.set_node_id("gpu-07");
  // The client binds the address to the request's node.
  auto r = client.Call<v1::RegisterNodeResponse>("gpuaas.v1.test.node.{node_id}.echo", req);
  ASSERT_TRUE(r.ok()) << r.error().ToString();
  EXPECT_EQ(r->node().node_id(), "gpu-07");
  EXPECT_EQ(r->node().hostname(), "gpu-07|gpuaas.v1.test.node.{node_id}.echo");
  // An empty node_id takes the subject's.
  auto empty = RawReply(*conn_, "gpuaas.v1.test.node.gpu-08.echo", "");
  ASSERT_EQ(empty.status().code(), v1::OK) << empty.status().reason();
  v1::RegisterNodeResponse got;
  ASSERT_TRUE(empty.result().UnpackTo(&got));
  EXPECT_EQ(got.node().node_id(), "gpu-08");
  // Another node in the request than in the subject is refused before the handler runs.
  auto other = RawReply(*conn_, "gpuaas.v1.test.node.gpu-08.echo", req.SerializeAsString());
  EXPECT_EQ(other.status().code(), v1::PERMISSION_DENIED);
  EXPECT_EQ(other.status().reason(), "node_id_mismatch");
  EXPECT_EQ(other.status().details().at("subject_node_id"), "gpu-08");
  EXPECT_EQ(other.status().details().at("node_id"), "gpu-07");
  // A caller without a node cannot bind the address.
  auto unbound = client.Call<v1::RegisterNodeResponse>("gpuaas.v1.test.node.{node_id}.echo",
                                                       v1::RegisterNodeRequest());
  ASSERT_FALSE(unbound.ok());
  EXPECT_TRUE(unbound.error().Is(reason::kNodeIdMissing));
  v1::RegisterNodeRequest wild;
  wild.set_node_id("*");
  auto wildcard = client.Call<v1::RegisterNodeResponse>("gpuaas.v1.test.node.{node_id}.echo", wild);
  ASSERT_FALSE(wildcard.ok());
  EXPECT_TRUE(wildcard.error().Is(reason::kNodeIdInvalid));
  // Metrics count the address, not one series per node.
  const std::string text = prometheus::TextSerializer().Serialize(registry_.Collect());
  EXPECT_NE(text.find("subject=\"gpuaas.v1.test.node.{node_id}.echo\""), std::string::npos);
  EXPECT_EQ(text.find("gpuaas.v1.test.node.gpu-08.echo"), std::string::npos);
}

// Two issuers, each with keys that rotate: a server accepts a token that any listed key of its
// issuer verifies (the old and the new key live together during a rotation) and refuses one
// whose key is gone; the tenant issuer's keys verify tenant tokens only.
TEST_F(MessagingTest, TokensOfEitherLiveKeyVerifyAndTheTenantIssuerMintsTenantsOnly) {
  auto old_key = auth::NewSigningKey();
  auto new_key = auth::NewSigningKey();
  auto tenant_key = auth::NewSigningKey();
  ASSERT_TRUE(old_key.ok() && new_key.ok() && tenant_key.ok());
  auto token = [](const auth::SigningKey& k, const std::string& role) {
    auth::Principal p;
    p.subject = role == auth::kRoleTenant ? "tenant:acme/bob" : "user:alice";
    p.tenant = role == auth::kRoleTenant ? "acme" : "";
    p.roles = {role};
    return *auth::IssueToken(k.private_pem, p, std::chrono::seconds(600));
  };
  // A served subject operators and tenants may call with a token (the contract's callers).
  const std::string subject = "gpuaas.v1.scheduler.allocation.list";
  auto serve = [&](std::vector<std::string> platform, std::vector<std::string> tenant) {
    rpc::ServerOptions o;
    o.token_public_keys = std::move(platform);
    o.tenant_token_public_keys = std::move(tenant);
    auto s =
        std::make_unique<rpc::Server>(conn_, "scheduler", "gpuaas.*.scheduler.>", log_, nullptr, o);
    s->Handle<v1::ListAllocationsRequest, v1::ListAllocationsResponse>(
        subject,
        [](const v1::ListAllocationsRequest&, rpc::Context&)
            -> Result<v1::ListAllocationsResponse> { return v1::ListAllocationsResponse(); });
    EXPECT_TRUE(s->Start().ok());
    return s;
  };
  auto call = [&](const std::string& t) {
    return RawReply(*conn_, subject, "", {{auth::kHeaderAuthorization, "Bearer " + t}});
  };
  {
    // During a rotation: both platform keys live.
    auto server = serve({old_key->public_pem, new_key->public_pem}, {tenant_key->public_pem});
    EXPECT_EQ(call(token(*old_key, auth::kRoleOperator)).status().code(), v1::OK);
    EXPECT_EQ(call(token(*new_key, auth::kRoleOperator)).status().code(), v1::OK);
    // The tenant issuer: a tenant token is accepted, an operator or auditor one never.
    EXPECT_EQ(call(token(*tenant_key, auth::kRoleTenant)).status().code(), v1::OK);
    for (const char* role : {auth::kRoleOperator, auth::kRoleAuditor}) {
      auto r = call(token(*tenant_key, role));
      EXPECT_EQ(r.status().code(), v1::UNAUTHENTICATED) << role;
      EXPECT_EQ(r.status().reason(), "token_issuer_role") << role;
      EXPECT_EQ(r.status().details().at("role"), role);
    }
    server->Drain(2s);
  }
  // After it: the old key is gone.
  auto server = serve({new_key->public_pem}, {tenant_key->public_pem});
  EXPECT_EQ(call(token(*new_key, auth::kRoleOperator)).status().code(), v1::OK);
  auto old = call(token(*old_key, auth::kRoleOperator));
  EXPECT_EQ(old.status().code(), v1::UNAUTHENTICATED);
  EXPECT_EQ(old.status().reason(), "token_signature");
}

TEST(ParseDeadlineHeader, ClampsToTheEpochAndADayAheadMalformedIsAbsent) {
  const int64_t now = 1'700'000'000'000;
  const int64_t day = rpc::kMaxDeadlineAheadMs;
  EXPECT_EQ(rpc::ParseDeadlineHeader("", now, 10000), now + 10000);
  EXPECT_EQ(rpc::ParseDeadlineHeader(std::to_string(now + 5000), now, 10000), now + 5000);
  // In the past: stays past (answered deadline_exceeded), never before the epoch.
  EXPECT_EQ(rpc::ParseDeadlineHeader("1000", now, 10000), 1000);
  EXPECT_EQ(rpc::ParseDeadlineHeader("-99999999999999999", now, 10000), 0);
  EXPECT_EQ(rpc::ParseDeadlineHeader("-999999999999999999999999", now, 10000), 0);
  // Beyond a day ahead: a day ahead.
  EXPECT_EQ(rpc::ParseDeadlineHeader("99999999999999999", now, 10000), now + day);
  EXPECT_EQ(rpc::ParseDeadlineHeader("999999999999999999999999", now, 10000), now + day);
  EXPECT_EQ(rpc::ParseDeadlineHeader(std::to_string(now + day), now, 10000), now + day);
  // Not a decimal integer: as if absent.
  for (const char* bad : {"abc", "12abc", " 12", "1e9", "+5", "-", "0x10"}) {
    EXPECT_EQ(rpc::ParseDeadlineHeader(bad, now, 10000), now + 10000) << bad;
  }
  // Every result converts to a time_point without overflow.
  const auto tp = std::chrono::system_clock::time_point(
      std::chrono::milliseconds(rpc::ParseDeadlineHeader("99999999999999999", now, 0)));
  EXPECT_GT(tp, std::chrono::system_clock::time_point(std::chrono::milliseconds(now)));
}

TEST_F(MessagingTest, ClientSeesStatusAsErrorAndNoResponders) {
  rpc::Client client(conn_);
  v1::RegisterNodeRequest req;
  auto none = client.Call<v1::RegisterNodeResponse>("gpuaas.v1.nobody.node.echo", req, 500ms);
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().code, Code::kUnavailable);
  EXPECT_EQ(none.error().reason, "no_responders");
  auto server = EchoServer(conn_, log_, &registry_);
  auto missing = client.Call<v1::RegisterNodeResponse>("gpuaas.v1.test.node.echo", req);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, Code::kInvalidArgument);
  EXPECT_EQ(missing.error().details.at("node_id"), "required");
}

TEST_F(MessagingTest, QueueGroupSpreadsWorkAndDrainFinishesInFlight) {
  auto a = EchoServer(conn_, log_, &registry_);
  auto b = EchoServer(conn_, log_, &registry_);
  rpc::Client client(conn_);
  v1::RegisterNodeRequest slow;
  slow.set_node_id("slow");
  std::atomic<int> ok{0};
  std::vector<std::thread> callers;
  callers.reserve(4);
  for (int i = 0; i < 4; ++i) {
    callers.emplace_back([&] {
      if (client.Call<v1::RegisterNodeResponse>("gpuaas.v1.test.node.echo", slow, 3000ms).ok()) {
        ok++;
      }
    });
  }
  std::this_thread::sleep_for(50ms);
  a->Drain(3000ms);  // requests it already took are still answered
  for (auto& t : callers) t.join();
  EXPECT_EQ(ok.load(), 4);
  EXPECT_EQ(a->InFlight(), 0u);
}

TEST_F(MessagingTest, EnsureStreamIsIdempotentAndDeduplicates) {
  messaging::StreamSpec spec{"TEST_EVT", {"gpuaas.v1.evt.test.>"}, 0, 60};
  ASSERT_TRUE(messaging::EnsureStream(*conn_, spec).ok());
  ASSERT_TRUE(messaging::EnsureStream(*conn_, spec).ok());
  spec.subjects.push_back("gpuaas.v1.evt.test2.>");  // changed config: updated in place
  ASSERT_TRUE(messaging::EnsureStream(*conn_, spec).ok());
  auto a1 = messaging::JsPublish(*conn_, "gpuaas.v1.evt.test.x", "a", "id-1");
  auto a2 = messaging::JsPublish(*conn_, "gpuaas.v1.evt.test.x", "a", "id-1");
  ASSERT_TRUE(a1.ok() && a2.ok());
  EXPECT_FALSE(a1->duplicate);
  EXPECT_TRUE(a2->duplicate);
  EXPECT_EQ(*messaging::StreamSubjectCount(*conn_, "TEST_EVT", "gpuaas.v1.evt.test.x"), 1u);
}

// What a service does at start (it may not declare a stream): it waits for a stream that is not
// declared yet and goes on once the deploy step declares it; after its wait it says which stream
// is missing; a stream declared without a subject it uses is outdated, not waited for.
TEST_F(MessagingTest, RequireStreamWaitsForTheDeployStepAndNamesWhatIsMissing) {
  messaging::StreamSpec spec{"TEST_LATE", {"gpuaas.v1.evt.late.>"}, 0, 60};
  auto missing = messaging::RequireStream(*conn_, spec, 300ms);
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, Code::kUnavailable);
  EXPECT_TRUE(missing.error().Is(reason::kStreamMissing));
  EXPECT_NE(missing.error().message.find("TEST_LATE"), std::string::npos);

  std::thread deploy([&] {
    std::this_thread::sleep_for(700ms);
    EXPECT_TRUE(messaging::EnsureStream(*conn_, spec).ok());
  });
  const auto t0 = std::chrono::steady_clock::now();
  auto waited = messaging::RequireStream(*conn_, spec, 30s);
  const auto took = std::chrono::steady_clock::now() - t0;
  deploy.join();
  ASSERT_TRUE(waited.ok()) << waited.error().ToString();
  EXPECT_GE(took, 600ms) << "it did not wait for the stream";

  auto newer = spec;
  newer.subjects.push_back("gpuaas.v1.evt.later.>");
  auto outdated = messaging::RequireStream(*conn_, newer, 30s);
  ASSERT_FALSE(outdated.ok());
  EXPECT_TRUE(outdated.error().Is(reason::kStreamOutdated));
  EXPECT_EQ(outdated.error().details.at("missing"), "gpuaas.v1.evt.later.>");
}

TEST_F(MessagingTest, RetryableFailuresAreKeptInOrderOnlyWhatCanNeverSucceedIsDeadLettered) {
  ASSERT_TRUE(messaging::EnsureStream(*conn_, {"TEST_EVT", {"gpuaas.v1.evt.test.>"}, 0, 60}).ok());
  ASSERT_TRUE(messaging::EnsureStream(*conn_, messaging::DeadLetterStream()).ok());
  std::mutex mu;
  std::vector<std::string> handled;  // in the order they succeeded
  std::atomic<int> outage_attempts{0};
  std::atomic<bool> store_down{true};
  messaging::ConsumerSpec spec;
  spec.stream = "TEST_EVT";
  spec.durable = "test-consumer";
  spec.filter_subject = "gpuaas.v1.evt.test.>";
  spec.backoff_ms = {20, 40, 80};
  messaging::Consumer consumer(
      conn_, spec,
      [&](const messaging::Delivery& d) {
        if (d.msg.data == "garbage") {
          return messaging::HandlerResult::Reject("malformed", messaging::kRejectUndecodable);
        }
        if (d.msg.data == "during-outage") {
          // The store is down for many more deliveries than the old 5-delivery limit.
          outage_attempts++;
          if (store_down) return messaging::HandlerResult::Retry("UNAVAILABLE db_unavailable");
        }
        std::lock_guard lock(mu);
        handled.push_back(d.msg.data);
        return messaging::HandlerResult::Ack();
      },
      log_, &registry_);
  ASSERT_TRUE(consumer.Start().ok());
  for (const char* p : {"first", "during-outage", "after-1", "garbage", "after-2"}) {
    ASSERT_TRUE(
        messaging::JsPublish(*conn_, "gpuaas.v1.evt.test.e", p, std::string("m-") + p).ok());
  }
  ASSERT_TRUE(testing::WaitFor([&] { return outage_attempts >= 12; }, 20s));
  {
    std::lock_guard lock(mu);
    // Nothing after the failing message overtook it while it was retried.
    EXPECT_EQ(handled, std::vector<std::string>{"first"});
  }
  auto dlq = messaging::StreamSubjectCount(*conn_, "GPUAAS_DLQ", "gpuaas.v1.dlq.>");
  ASSERT_TRUE(dlq.ok());
  EXPECT_EQ(*dlq, 0u) << "a retryable failure was dead-lettered";
  store_down = false;  // the store is back
  ASSERT_TRUE(testing::WaitFor([&] {
    std::lock_guard lock(mu);
    return handled.size() == 4;
  }));
  {
    std::lock_guard lock(mu);
    EXPECT_EQ(handled, (std::vector<std::string>{"first", "during-outage", "after-1", "after-2"}));
  }
  // Only the undecodable one is a dead letter, with its reason and kind.
  ASSERT_TRUE(testing::WaitFor([&] {
    auto n = messaging::StreamSubjectCount(*conn_, "GPUAAS_DLQ", "gpuaas.v1.dlq.>");
    return n.ok() && *n == 1;
  }));
  auto last =
      messaging::StreamLastMessage(*conn_, "GPUAAS_DLQ", "gpuaas.v1.dlq.TEST_EVT.test-consumer");
  ASSERT_TRUE(last.ok());
  v1::DeadLetter dl;
  ASSERT_TRUE(dl.ParseFromString(last->data));
  EXPECT_EQ(dl.payload(), "garbage");
  EXPECT_EQ(dl.reason(), "malformed");
  EXPECT_EQ(dl.kind(), "undecodable");
  EXPECT_EQ(dl.consumer(), "test-consumer");
  // Replaying it runs the same handler (here: rejected again).
  messaging::Delivery again;
  again.msg.subject = dl.subject();
  again.msg.data = dl.payload();
  EXPECT_EQ(consumer.Replay(again).disposition, messaging::Disposition::kReject);
  // The metrics say the same.
  prometheus::TextSerializer ser;
  const std::string text = ser.Serialize(registry_.Collect());
  EXPECT_NE(text.find("gpuaas_dead_letters_total{consumer=\"test-consumer\",reason_kind="
                      "\"undecodable\"} 1"),
            std::string::npos)
      << text;
  EXPECT_NE(text.find("gpuaas_consumer_lag{"), std::string::npos);
  consumer.Stop();
}

TEST(RetryDelay, JitteredWithinAQuarterAndTheLastStepRepeats) {
  const std::vector<int64_t> steps = {100, 1000};
  for (int i = 0; i < 200; ++i) {
    const int64_t first = messaging::RetryDelayMs(steps, 1);
    EXPECT_GE(first, 75);
    EXPECT_LE(first, 125);
    const int64_t later = messaging::RetryDelayMs(steps, 40);
    EXPECT_GE(later, 750);
    EXPECT_LE(later, 1250);
  }
  EXPECT_EQ(messaging::RetryDelayMs({}, 3), 0);
}

TEST_F(MessagingTest, KeepaliveHoldsALongHandlersMessageWithoutKeepaliveItIsRedelivered) {
  ASSERT_TRUE(messaging::EnsureStream(*conn_, {"TEST_EVT", {"gpuaas.v1.evt.test.>"}, 0, 60}).ok());
  // Two consumers on one durable (two replicas, or an agent and its restarted self); the first
  // handler runs 2.5 ack waits. With keepalive the message is handled once; without it the
  // server redelivers it to the idle consumer while the first handler still runs.
  auto run = [&](bool keepalive, const std::string& name) {
    std::atomic<int> calls{0};
    std::atomic<uint64_t> max_delivered{0};
    messaging::ConsumerSpec spec{"TEST_EVT", name, "gpuaas.v1.evt.test." + name};
    spec.ack_wait_ms = 800;
    spec.batch = 1;
    spec.keepalive = keepalive;
    auto handler = [&](const messaging::Delivery& d) {
      max_delivered = std::max<uint64_t>(max_delivered, d.num_delivered);
      if (++calls == 1) std::this_thread::sleep_for(2000ms);
      return messaging::HandlerResult::Ack();
    };
    messaging::Consumer a(conn_, spec, handler, log_);
    messaging::Consumer b(conn_, spec, handler, log_);
    EXPECT_TRUE(a.Start().ok());
    EXPECT_TRUE(b.Start().ok());
    EXPECT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.test." + name, "slow", name).ok());
    EXPECT_TRUE(testing::WaitFor([&] { return calls >= 1; }));
    std::this_thread::sleep_for(3000ms);
    a.Stop();
    b.Stop();
    return std::make_pair(calls.load(), max_delivered.load());
  };
  const auto held = run(true, "keepalive");
  EXPECT_EQ(held.first, 1);
  EXPECT_EQ(held.second, 1u);
  const auto lost = run(false, "nokeepalive");
  EXPECT_GE(lost.first, 2);
  EXPECT_GE(lost.second, 2u);
}

TEST_F(MessagingTest, ADurableStartsAgainWithChangedSettings) {
  // An upgraded service may change its consumer's ack wait or redelivery limit: the durable
  // keeps its position and takes the new settings, instead of refusing to start.
  ASSERT_TRUE(messaging::EnsureStream(*conn_, {"TEST_EVT", {"gpuaas.v1.evt.test.>"}, 0, 60}).ok());
  std::atomic<int> seen{0};
  auto handler = [&](const messaging::Delivery&) {
    seen++;
    return messaging::HandlerResult::Ack();
  };
  messaging::ConsumerSpec spec{"TEST_EVT", "changing", "gpuaas.v1.evt.test.changing"};
  spec.ack_wait_ms = 120000;
  {
    messaging::Consumer c(conn_, spec, handler, log_);
    ASSERT_TRUE(c.Start().ok());
    ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.test.changing", "1", "ch-1").ok());
    ASSERT_TRUE(testing::WaitFor([&] { return seen == 1; }));
    c.Stop();
  }
  spec.ack_wait_ms = 30000;
  messaging::Consumer c(conn_, spec, handler, log_);
  auto started = c.Start();
  ASSERT_TRUE(started.ok()) << started.error().ToString();
  ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.test.changing", "2", "ch-2").ok());
  EXPECT_TRUE(testing::WaitFor([&] { return seen == 2; }));
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(seen.load(), 2) << "the first message was not handled again";
  c.Stop();
}

TEST_F(MessagingTest, ConsumerSurvivesServerRestart) {
  ASSERT_TRUE(messaging::EnsureStream(*conn_, {"TEST_EVT", {"gpuaas.v1.evt.test.>"}, 0, 60}).ok());
  std::atomic<int> seen{0};
  messaging::ConsumerSpec spec{"TEST_EVT", "restart-consumer", "gpuaas.v1.evt.test.>"};
  messaging::Consumer consumer(
      conn_, spec,
      [&](const messaging::Delivery&) {
        seen++;
        return messaging::HandlerResult::Ack();
      },
      log_);
  ASSERT_TRUE(consumer.Start().ok());
  ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.test.a", "1", "r-1").ok());
  ASSERT_TRUE(testing::WaitFor([&] { return seen == 1; }));
  nats_.Stop();
  nats_.Start();
  ASSERT_TRUE(testing::WaitFor([&] { return conn_->Connected(); }));
  ASSERT_TRUE(testing::WaitFor(
      [&] { return messaging::JsPublish(*conn_, "gpuaas.v1.evt.test.a", "2", "r-2").ok(); }));
  EXPECT_TRUE(testing::WaitFor([&] { return seen == 2; }, std::chrono::seconds(15)));
  consumer.Stop();
}

// The pull of our own (Puller) instead of nats.c 3.4.1's natsSubscription_Fetch, which could
// return more messages than its batch array held: every fetch stays within its batch, a
// backlog comes out whole and in order, and a deleted consumer is reported as gone.
TEST_F(MessagingTest, APullNeverReturnsMoreThanItsBatchAndLosesNothing) {
  ASSERT_TRUE(messaging::EnsureStream(*conn_, {"TEST_EVT", {"gpuaas.v1.evt.test.>"}, 0, 60}).ok());
  messaging::ConsumerSpec spec{"TEST_EVT", "puller", "gpuaas.v1.evt.test.pull"};
  ASSERT_TRUE(messaging::EnsureConsumer(*conn_, spec).ok());
  constexpr int kBacklog = 1500;
  for (int i = 0; i < kBacklog; ++i) {
    ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.test.pull", std::to_string(i),
                                     "pull-" + std::to_string(i))
                    .ok());
  }
  auto puller = messaging::Puller::Open(conn_, "TEST_EVT", "puller");
  ASSERT_TRUE(puller.ok()) << puller.error().ToString();
  std::vector<int> seen;
  int fetches = 0;
  size_t largest = 0;
  const auto until = std::chrono::steady_clock::now() + 30s;
  while (static_cast<int>(seen.size()) < kBacklog && std::chrono::steady_clock::now() < until) {
    // Batches of 7 and 64 alternate, so that what one pull brought beyond a batch is queued
    // for the next.
    const int batch = (fetches++ % 2 == 0) ? 64 : 7;
    auto f = (*puller)->Fetch(batch, 500);
    ASSERT_NE(f.outcome, messaging::Puller::Outcome::kError) << f.error;
    ASSERT_NE(f.outcome, messaging::Puller::Outcome::kConsumerGone) << f.error;
    ASSERT_LE(f.msgs.size(), static_cast<size_t>(batch));
    largest = std::max(largest, f.msgs.size());
    for (natsMsg* m : f.msgs) {
      seen.push_back(std::stoi(std::string(natsMsg_GetData(m), natsMsg_GetDataLength(m))));
      EXPECT_TRUE(messaging::SettleMsg(*conn_, m, messaging::Settle::kAck).ok());
      natsMsg_Destroy(m);
    }
  }
  ASSERT_EQ(seen.size(), static_cast<size_t>(kBacklog));
  for (int i = 0; i < kBacklog; ++i) ASSERT_EQ(seen[static_cast<size_t>(i)], i) << "in order";
  EXPECT_GT(largest, 7u) << "a backlog is fetched in batches, not one by one";
  // Nothing is left: an idle pull times out, and the server holds nothing unacked.
  auto idle = (*puller)->Fetch(64, 300);
  EXPECT_EQ(idle.outcome, messaging::Puller::Outcome::kTimeout);
  EXPECT_TRUE(testing::WaitFor([&] {
    messaging::Consumer probe(
        conn_, spec, [](const messaging::Delivery&) { return messaging::HandlerResult::Ack(); },
        log_);
    auto n = probe.Backlog();
    return n.ok() && *n == 0;
  }));

  // A message published while a fetch waits is handed over as soon as it comes.
  std::thread later([&] {
    std::this_thread::sleep_for(100ms);
    EXPECT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.test.pull", "late", "pull-late").ok());
  });
  auto waited = (*puller)->Fetch(64, 5000);
  later.join();
  ASSERT_EQ(waited.outcome, messaging::Puller::Outcome::kMessages);
  ASSERT_EQ(waited.msgs.size(), 1u);
  EXPECT_EQ(std::string(natsMsg_GetData(waited.msgs[0])), "late");
  for (natsMsg* m : waited.msgs) natsMsg_Destroy(m);

  jsErrCode jerr = static_cast<jsErrCode>(0);
  ASSERT_EQ(js_DeleteConsumer(conn_->js(), "TEST_EVT", "puller", nullptr, &jerr), NATS_OK);
  auto gone = (*puller)->Fetch(64, 2000);
  EXPECT_EQ(gone.outcome, messaging::Puller::Outcome::kConsumerGone) << gone.error;
}

// A prefetched batch is the next fetch's, in order; what a puller was sent but never handed
// out goes back to the server when it goes, so the next puller has it at once, not after the
// ack wait.
TEST_F(MessagingTest, APrefetchComesNextInOrderAndGoesBackWhenThePullerGoes) {
  ASSERT_TRUE(messaging::EnsureStream(*conn_, {"TEST_EVT", {"gpuaas.v1.evt.test.>"}, 0, 60}).ok());
  messaging::ConsumerSpec spec{"TEST_EVT", "prefetch", "gpuaas.v1.evt.test.prefetch"};
  spec.ack_wait_ms = 60000;
  ASSERT_TRUE(messaging::EnsureConsumer(*conn_, spec).ok());
  for (int i = 0; i < 300; ++i) {
    ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.test.prefetch", std::to_string(i),
                                     "prefetch-" + std::to_string(i))
                    .ok());
  }
  auto take = [&](messaging::Puller& p, int batch, int64_t timeout_ms, bool ack) {
    std::vector<int> got;
    auto f = p.Fetch(batch, timeout_ms);
    for (natsMsg* m : f.msgs) {
      got.push_back(std::stoi(std::string(natsMsg_GetData(m), natsMsg_GetDataLength(m))));
      if (ack) {
        EXPECT_TRUE(messaging::SettleMsg(*conn_, m, messaging::Settle::kAck).ok());
      }
      natsMsg_Destroy(m);
    }
    return got;
  };
  auto range = [](int from, int n) {
    std::vector<int> v(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) v[static_cast<size_t>(i)] = from + i;
    return v;
  };
  {
    auto puller = messaging::Puller::Open(conn_, "TEST_EVT", "prefetch");
    ASSERT_TRUE(puller.ok()) << puller.error().ToString();
    EXPECT_EQ(take(**puller, 100, 2000, true), range(0, 100));
    (*puller)->Prefetch(100);
    (*puller)->Prefetch(100);  // one at a time: this one does nothing
    EXPECT_EQ(take(**puller, 100, 2000, true), range(100, 100)) << "the prefetch, in order";
    (*puller)->Prefetch(100);
    // The prefetch's 100 messages and its end (408) are delivered to it, not handed out.
    ASSERT_TRUE(testing::WaitFor([&] { return (*puller)->Queued() >= 100; }));
  }
  auto next = messaging::Puller::Open(conn_, "TEST_EVT", "prefetch");
  ASSERT_TRUE(next.ok());
  std::vector<int> rest;
  const auto until = std::chrono::steady_clock::now() + 5s;  // far less than the 60 s ack wait
  while (rest.size() < 100 && std::chrono::steady_clock::now() < until) {
    for (int v : take(**next, 100, 500, true)) rest.push_back(v);
  }
  std::sort(rest.begin(), rest.end());
  EXPECT_EQ(rest, range(200, 100)) << "nak'ed when the first puller went, so here at once";
}

// Someone deletes a running consumer's durable (an operator, a stream reset): the consumer
// notices at its next idle pull, declares the durable again and goes on.
TEST_F(MessagingTest, AConsumerWhoseDurableWasDeletedDeclaresItAgain) {
  ASSERT_TRUE(messaging::EnsureStream(*conn_, {"TEST_EVT", {"gpuaas.v1.evt.test.>"}, 0, 60}).ok());
  std::mutex mu;
  std::vector<std::string> seen;
  messaging::ConsumerSpec spec{"TEST_EVT", "redeclared", "gpuaas.v1.evt.test.redeclared"};
  messaging::Consumer c(
      conn_, spec,
      [&](const messaging::Delivery& d) {
        std::lock_guard lock(mu);
        seen.push_back(d.msg.data);
        return messaging::HandlerResult::Ack();
      },
      log_);
  ASSERT_TRUE(c.Start().ok());
  ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.test.redeclared", "1", "rd-1").ok());
  ASSERT_TRUE(testing::WaitFor([&] {
    std::lock_guard lock(mu);
    return seen.size() == 1;
  }));
  ASSERT_TRUE(c.DeleteDurable().ok());
  ASSERT_TRUE(messaging::JsPublish(*conn_, "gpuaas.v1.evt.test.redeclared", "2", "rd-2").ok());
  // The new durable delivers the stream from its start: "1" again, then "2".
  EXPECT_TRUE(testing::WaitFor(
      [&] {
        std::lock_guard lock(mu);
        return !seen.empty() && seen.back() == "2";
      },
      std::chrono::seconds(15)));
  c.Stop();
}

// A server that takes the TCP connection but answers only later (a loaded host): the first
// connect tries again instead of failing the caller's start, and the connection comes up.
TEST_F(MessagingTest, AFirstConnectThatTimesOutIsTriedAgain) {
  nats_.Stop();
  int fd = socket(AF_INET, SOCK_STREAM, 0);
  int one = 1;
  setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(nats_.port());
  ASSERT_EQ(bind(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)), 0) << strerror(errno);
  ASSERT_EQ(listen(fd, 16), 0);  // the kernel completes handshakes; nothing ever says INFO
  // The real server answers once two attempts have timed out.
  std::thread later([&] {
    std::this_thread::sleep_for(700ms);
    close(fd);
    nats_.Start();
  });
  auto opts = nats_.Options(testing::TestNats::kHarness);
  opts.connect_timeout_ms = 300;
  auto c = messaging::Connection::Connect(opts, log_);
  later.join();
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  EXPECT_TRUE(testing::WaitFor([&] { return (*c)->Connected(); }, 15s));
  EXPECT_TRUE((*c)->Flush(2s).ok());
}

}  // namespace
}  // namespace gpuaas
