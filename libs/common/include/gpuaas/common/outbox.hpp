#pragma once
// Transactional outbox. Append() writes an event row inside the caller's transaction (so the
// state change and its announcement commit together) and NOTIFYs the relay. The Relay
// publishes unpublished rows in sequence order to JetStream with Nats-Msg-Id = event id (or the
// msg_id given to Append), then
// marks them; a crash between publish and mark re-publishes and JetStream drops the
// duplicate. Several relay replicas are safe: the one holding a session advisory lock publishes,
// the others stand by and take over when its connection goes away, so order is kept.
#include <google/protobuf/message.h>

#include <atomic>
#include <functional>
#include <memory>
#include <string>
#include <thread>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/event.pb.h"

namespace prometheus {
class Registry;
}

namespace gpuaas::outbox {

inline constexpr const char* kNotifyChannel = "gpuaas_outbox";

struct EventSpec {
  std::string nats_subject;  // e.g. "gpuaas.v1.evt.inventory.node.registered"
  std::string type;          // CloudEvents type; defaults to nats_subject minus ".evt"
  std::string source;        // "<service>/<instance>"
  std::string entity;        // the envelope's `subject`: entity id
  int64_t generation = 0;
  std::string correlation_id;
  std::string traceparent;
  const google::protobuf::Message* data = nullptr;
  // Who caused it; null = the request being handled on this thread (ActorScope), else the
  // sending service ("service:<name>" from `source`). A node-agent names itself ("node:<id>").
  const v1::Principal* actor = nullptr;
};

// The principal of the request a thread is handling: rpc::Server opens one around each handler,
// so every event the handler appends names who asked (the audit trail) without each handler
// passing it down. Handlers add the request's reason with SetActorReason.
class ActorScope {
 public:
  explicit ActorScope(v1::Principal actor);
  ~ActorScope();
  ActorScope(const ActorScope&) = delete;
  ActorScope& operator=(const ActorScope&) = delete;

 private:
  v1::Principal* previous_;
  v1::Principal actor_;
};
// The current request's principal, or null.
const v1::Principal* CurrentActor();
// Records why (the request's reason) on the current request's principal (no-op outside one).
void SetActorReason(const std::string& reason);

// The CloudEvents-style envelope for `spec` (new UUIDv7 id, time now, data packed). Used by
// Append and by publishers without a database (node-agent), which send it with JsPublish and
// Nats-Msg-Id = the event id.
v1::Event MakeEvent(const EventSpec& spec);
// CloudEvents type of a subject: an event subject without its evt token (gpuaas.v1.evt.X.Y
// becomes gpuaas.v1.X.Y); a node task subject without its node id token (gpuaas.v1.node.ID.task
// becomes gpuaas.v1.node.task).
std::string DefaultType(const std::string& nats_subject);

// Inserts the event into the outbox in `tx` (subjects gpuaas.v1.evt.> and, for typed tasks sent
// to node-agents, gpuaas.v1.node.>); returns the new event id (UUIDv7).
Result<std::string> Append(pqxx::work& tx, const EventSpec& spec);
// The same, published with Nats-Msg-Id = `msg_id` instead of the event id: for a logical message
// that JetStream must de-duplicate whatever event id each send gets (a node task's
// "<allocation id>.<type>.<attempt>").
Result<std::string> Append(pqxx::work& tx, const EventSpec& spec, const std::string& msg_id);
// Several events at once (a projection's batch): one INSERT for all of them, in the given order
// (the relay publishes them in that order), and one NOTIFY. Returns their ids, in order.
Result<std::vector<std::string>> AppendMany(pqxx::work& tx, const std::vector<EventSpec>& specs);

struct RelayOptions {
  int batch = 256;
  int64_t idle_poll_ms = 1000;  // safety net; NOTIFY wakes the relay immediately
  int64_t retain_published_s = 86400;
};

class Relay {
 public:
  Relay(std::string dsn, std::shared_ptr<messaging::Connection> conn, const log::Logger& logger,
        prometheus::Registry* metrics, RelayOptions opts = {});
  ~Relay();
  void Start();
  // Stops the loop; with flush, first publishes every row committed so far (bounded).
  void Stop(bool flush = true, std::chrono::milliseconds timeout = std::chrono::seconds(10));
  // Rows published by this relay since start.
  uint64_t Published() const { return published_.load(); }

  // Test and benchmark hooks, called on the relay thread: after JetStream acked an event
  // and before its row is marked. A hook that throws simulates a crash at that point.
  std::function<void(const std::string& event_id)> after_publish;

 private:
  void Loop();
  // Publishes one batch; returns rows published, or an error.
  Result<int> RunBatch(pqxx::connection& c);

  std::string dsn_;
  std::shared_ptr<messaging::Connection> conn_;
  log::Logger log_;
  RelayOptions opts_;
  struct Metrics;
  std::shared_ptr<Metrics> metrics_;
  std::thread thread_;
  std::atomic<bool> stop_{false};
  std::atomic<bool> flush_{true};
  std::chrono::steady_clock::time_point flush_deadline_;
  std::atomic<uint64_t> published_{0};
  bool leader_ = false;  // relay thread only
};

}  // namespace gpuaas::outbox
