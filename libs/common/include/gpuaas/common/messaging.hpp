#pragma once
// NATS (nats.c) adapter: one connection per process with reconnect-forever and low-latency
// sends, core publish/request, JetStream streams declared idempotently, synchronous publish
// with Nats-Msg-Id de-duplication, and durable pull consumers with ack / nak-with-backoff for
// retryable failures (never dead-lettered) / dead-letter for what can never succeed. nats.c
// status codes become Error values here.
#include <nats/nats.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/result.hpp"

namespace prometheus {
class Registry;
}

namespace gpuaas::contract {
class Registry;
}

namespace gpuaas::messaging {

using Headers = std::map<std::string, std::string>;

inline constexpr const char* kHeaderMsgId = "Nats-Msg-Id";
inline constexpr const char* kHeaderTraceparent = "traceparent";
inline constexpr const char* kHeaderDeadline = "Gpuaas-Deadline-Ms";  // Unix epoch ms

struct Message {
  std::string subject;
  std::string reply;
  std::string data;
  Headers headers;
  std::string Header(const std::string& key) const {
    auto it = headers.find(key);
    return it == headers.end() ? std::string() : it->second;
  }
};

struct ConnectionOptions {
  std::string url = "nats://127.0.0.1:4222";
  std::string name;  // shows in nats-server connz
  int64_t connect_timeout_ms = 2000;
  int64_t reconnect_wait_ms = 250;
  // Also start when the server is down at first; the connection comes up when it does.
  bool retry_on_failed_connect = true;
  // The identity: a file holding this connection's NATS user nkey seed ("" = anonymous, which a
  // server with authorization refuses).
  std::string seed_file;
  // Where replies come back: requests use <inbox_prefix>.<random> (default "_INBOX"); the
  // server lets each identity subscribe only to its own prefix (access.hpp InboxPrefix).
  std::string inbox_prefix;
  // A client identity's role (operator, tenant-api, auditor; "" for a service or a node): its
  // requests on gpuaas.* subjects go out as <subject>.<client_role>, the only form the server lets
  // a client publish (access.hpp ClientSubject).
  std::string client_role;
  // TLS: verify the server against this CA bundle ("" = plain TCP).
  std::string tls_ca_file;
  // A client's request token (SetRequestToken), "" = none.
  std::string token;
};

class Connection {
 public:
  static Result<std::shared_ptr<Connection>> Connect(const ConnectionOptions& opts,
                                                     log::Logger logger);
  ~Connection();
  Connection(const Connection&) = delete;
  Connection& operator=(const Connection&) = delete;

  bool Connected() const;
  natsConnection* raw() const { return nc_; }
  jsCtx* js() const { return js_; }
  const log::Logger& logger() const { return log_; }
  // What this connection's owner serves, consumes, publishes and requests (contract.hpp).
  contract::Registry& contract() const { return *contract_; }

  // Publish, Request and JsPublish record their subject in contract().
  Result<void> Publish(const std::string& subject, const std::string& data,
                       const Headers& headers = {});
  // Answers a request on its reply subject (an inbox, not a contract subject: not recorded).
  Result<void> Reply(const std::string& reply_to, const std::string& data,
                     const Headers& headers = {});
  Result<Message> Request(const std::string& subject, const std::string& data,
                          const Headers& headers, std::chrono::milliseconds timeout);
  // Requests without an Authorization header get "Bearer <token>" (a client's request token,
  // auth.hpp); "" = none.
  void SetRequestToken(std::string token);
  // Round trip to the server (PING/PONG): proves the connection is usable.
  Result<void> Flush(std::chrono::milliseconds timeout);
  // Permission violations the server reported on this connection (nats.c reports a refused
  // subscription or publish only through the connection's error handler, which logs each at
  // error level and counts it here).
  uint64_t PermissionViolations() const;
  // The last asynchronous error text the server sent ("" = none).
  std::string LastAsyncError() const;
  // Flushes, then fails with PERMISSION_DENIED when the server refused `subject` (a
  // subscription just made, or a publish) since the connection started: nats.c gives no error
  // at the call itself.
  Result<void> CheckPermitted(const std::string& subject, std::chrono::milliseconds timeout);
  // A fresh reply subject under this connection's inbox prefix (the only inbox its identity may
  // subscribe to).
  std::string NewInbox() const;

 private:
  Connection() = default;
  natsConnection* nc_ = nullptr;
  natsOptions* opts_ = nullptr;
  jsCtx* js_ = nullptr;
  log::Logger log_;
  std::shared_ptr<contract::Registry> contract_;
  std::string token_;
  mutable std::mutex token_mu_;
  std::string seed_file_;  // signs the server's nonce at every (re)connect
  std::string inbox_prefix_ = "_INBOX";
  std::string client_role_;
  static natsStatus SignNonce(char** custom_err, unsigned char** signature, int* length,
                              const char* nonce, void* closure);

 public:
  struct Async;  // what nats.c's error handler saw (shared with its callbacks)

 private:
  std::shared_ptr<Async> async_;
};

// Converts a natsMsg (not taking ownership) into a Message.
Message FromNats(natsMsg* m);
// Builds a natsMsg; the caller owns it.
Result<natsMsg*> ToNats(const std::string& subject, const std::string& reply,
                        const std::string& data, const Headers& headers);
Error NatsError(natsStatus s, const std::string& what);

// ---- JetStream ----

struct StreamSpec {
  std::string name;
  std::vector<std::string> subjects;
  int64_t max_age_s = 0;  // 0 = keep forever (events are the audit log)
  int64_t duplicate_window_s = 600;
  // Copies JetStream keeps (R1 on one server, R3 on a 3-server cluster; 0 = 1):
  // `gpuaasctl streams apply --replicas`.
  int replicas = 0;
};

// Creates the stream, or updates it when its subjects/limits differ. The deploy identity's job
// (`gpuaasctl streams apply`, ApplyStreams); services only look streams up (RequireStream).
Result<void> EnsureStream(Connection& conn, const StreamSpec& spec);
// Every platform stream (asyncapi/roles.yaml `streams`, which a test checks against this list).
std::vector<StreamSpec> PlatformStreams();
// EnsureStream of every platform stream; `replicas` > 0 overrides the default.
Result<void> ApplyStreams(Connection& conn, int replicas = 0);
// What a service does at start instead of declaring: looks the stream up (STREAM.INFO, the only
// stream call its identity may make) until it exists, for up to `wait` (the streams Job may run
// beside it): UNAVAILABLE stream_missing after that; FAILED_PRECONDITION stream_outdated when it
// exists without every subject of `spec`.
Result<void> RequireStream(Connection& conn, const StreamSpec& spec,
                           std::chrono::milliseconds wait = std::chrono::seconds(60));

struct PublishAck {
  std::string stream;
  uint64_t sequence = 0;
  bool duplicate = false;
};
Result<PublishAck> JsPublish(Connection& conn, const std::string& subject, const std::string& data,
                             const std::string& msg_id, const Headers& headers = {},
                             int64_t timeout_ms = 5000);

// The streams every service knows about (contracts; see asyncapi/).
StreamSpec InventoryEventsStream();
StreamSpec DeadLetterStream();
// Typed tasks for node-agents: gpuaas.v1.node.<node_id>.task (one durable consumer per node).
StreamSpec NodeTasksStream();
// What node-agents report: gpuaas.v1.evt.node.<node_id>.{topology,task.<status>}.
StreamSpec NodeEventsStream();
StreamSpec IpamEventsStream();
// Allocation lifecycle events: gpuaas.v1.evt.scheduler.allocation.<state>.
StreamSpec SchedulerEventsStream();
StreamSpec IngressEventsStream();
StreamSpec ConsoleEventsStream();
// Every tenant's events, each on its tenant's subject gpuaas.v1.tenant.<tenant>.evt.<...>
// (scheduler/tenant_feed.hpp): what a tenant gateway consumes, filtered per tenant. Kept 7 days.
StreamSpec TenantFeedStream();
// Token revocations (gpuaas.v1.evt.auth.>): kept 25 hours, longer than any token lives
// (auth::kMaxTokenTtl), so what a service reads at start is every revocation still in force.
StreamSpec AuthEventsStream();
// The usage ledger's records (services/usage), for an outside billing system. Kept forever.
StreamSpec UsageEventsStream();

// The durable consumers on a stream, by name.
Result<std::vector<std::string>> ConsumerNames(Connection& conn, const std::string& stream);
// Messages a durable consumer still has coming: not yet delivered + delivered and not yet acked
// (one held by a consumer process that died counts until its ack wait passes, it is delivered
// again and acked).
Result<uint64_t> ConsumerBacklog(Connection& conn, const std::string& stream,
                                 const std::string& durable);

// ---- Durable pull consumers ----

struct Delivery {
  Message msg;
  uint64_t stream_sequence = 0;
  uint64_t num_delivered = 0;
};

enum class Disposition {
  kAck,     // done (or a duplicate)
  kRetry,   // retryable failure: kept, redelivered with a bounded jittered backoff, never
            // dead-lettered
  kReject,  // can never succeed (undecodable, invalid, permanent): dead-lettered now
};

// What a dead letter's `kind` says (gpuaas.v1.DeadLetter.kind).
inline constexpr const char* kRejectUndecodable = "undecodable";
inline constexpr const char* kRejectInvalid = "invalid";
inline constexpr const char* kRejectPermanent = "permanent";

struct HandlerResult {
  Disposition disposition = Disposition::kAck;
  std::string reason;
  std::string kind;  // a rejection's kind (kReject*)
  static HandlerResult Ack() { return {}; }
  static HandlerResult Retry(std::string why) { return {Disposition::kRetry, std::move(why), ""}; }
  static HandlerResult Reject(std::string why, std::string kind = kRejectPermanent) {
    return {Disposition::kReject, std::move(why), std::move(kind)};
  }
};

// Delivery policy: a handler's kRetry is never dead-lettered. The consumer keeps the message in
// hand and runs the handler again after a jittered delay from `backoff_ms` (its batch held with
// in-progress acks, so nothing fetched after it overtakes it), for as long as it takes: an
// outage of the store costs a retry every few seconds, not a lost message. A consumer that dies
// meanwhile gets the message redelivered (the server's redelivery is unlimited). Only kReject
// goes to the dead-letter subject gpuaas.v1.dlq.<stream>.<durable>, with its reason and kind.
struct ConsumerSpec {
  std::string stream;
  std::string durable;
  std::string filter_subject;
  int64_t ack_wait_ms = 30000;
  int batch = 64;
  int64_t fetch_timeout_ms = 500;
  // Delay before retry n (1-based); the last value repeats. Each delay is jittered by
  // -25%..+25%.
  std::vector<int64_t> backoff_ms = {100, 500, 2000, 5000, 10000};
  // Long handlers: while the handler runs, the fetched messages not yet disposed get an
  // in-progress ack every ack_wait/3, so they are not redelivered meanwhile; a consumer that
  // dies gets them redelivered within ack_wait.
  bool keepalive = false;
  // Bind to a durable someone else manages (a node-agent may not create or change consumers):
  // no create/update; it waits (retrying) until the durable exists, and takes its ack wait from
  // the server.
  bool bind_only = false;
  // Short handlers with a backlog (a projection replaying its stream): after a full batch the
  // next one is pulled before this one is handled, so its delivery overlaps the handling. At
  // most two batches are delivered and unacked at once; not with keepalive (a prefetched
  // batch gets no in-progress acks).
  bool prefetch = false;
};

// The delay before redelivery `num_delivered` (1-based) under `backoff_ms`, jittered.
int64_t RetryDelayMs(const std::vector<int64_t>& backoff_ms, uint64_t num_delivered);

// Creates the durable, or updates it to `spec` (it keeps its position).
Result<void> EnsureConsumer(Connection& conn, const ConsumerSpec& spec);
// Deletes a durable (a decommissioned node's task consumer); one that does not exist is fine.
Result<void> DeleteConsumer(Connection& conn, const std::string& stream,
                            const std::string& durable);
// A node's task consumer: durable node-<id> on GPUAAS_NODE_TASKS, one task at a time, a long
// redelivery budget (a VM task waits while adoption or the first network apply is pending). The
// node's agent binds to it; inventory creates it when the node registers.
ConsumerSpec NodeTaskConsumerSpec(const std::string& node_id, int64_t ack_wait_ms = 30000);

// How a fetched message is settled with JetStream (its ack subject).
enum class Settle { kAck, kNak, kInProgress, kTerm };
// Publishes the acknowledgement `how` for a message a Puller fetched; a kNak with `nak_delay_ms`
// > 0 asks for redelivery no sooner than that.
Result<void> SettleMsg(Connection& conn, natsMsg* m, Settle how, int64_t nak_delay_ms = 0);

// Pulls a durable pull consumer's messages with JetStream's next-message API on a subscription
// of its own (nats.c 3.4.1's natsSubscription_Fetch can hand back more messages than the batch
// array it allocated when messages of an earlier pull were still queued: a heap overrun seen
// under a backlog of tens of thousands of events). A fetch first returns what an earlier pull
// left queued; otherwise it asks for what is there now, up to `batch` (no_wait: the server
// answers at once), and when nothing is, waits for one message (a pull that ends with the
// fetch). It never returns more than `batch`.
class Puller {
 public:
  enum class Outcome { kMessages, kTimeout, kConsumerGone, kError };
  struct Fetched {
    Outcome outcome = Outcome::kTimeout;
    std::vector<natsMsg*> msgs;  // owned by the caller (natsMsg_Destroy)
    std::string error;           // kConsumerGone / kError: the server's status and description
  };
  static Result<std::unique_ptr<Puller>> Open(std::shared_ptr<Connection> conn,
                                              const std::string& stream,
                                              const std::string& durable);
  ~Puller();
  Puller(const Puller&) = delete;
  Puller& operator=(const Puller&) = delete;
  Fetched Fetch(int batch, int64_t timeout_ms);
  // Pulls up to `batch` messages the server has now without waiting for them; the next Fetch
  // takes them first. One prefetch at a time (a second one before a Fetch does nothing).
  void Prefetch(int batch);
  // Messages (and pull statuses) delivered to it and not handed out yet.
  int Queued() const;

 private:
  Puller() = default;
  // One message, or nullptr when none came within `wait_ms`.
  natsMsg* Next(int64_t wait_ms);
  std::shared_ptr<Connection> conn_;
  std::string stream_;
  std::string durable_;
  std::string next_subject_;  // $JS.API.CONSUMER.MSG.NEXT.<stream>.<durable>
  std::string inbox_;         // <inbox>.<pull number> is each pull's reply subject
  uint64_t pulls_ = 0;
  std::string prefetch_reply_;  // the outstanding prefetch's reply subject ("" when none)
  size_t prefetched_ = 0;       // its batch
  natsSubscription* sub_ = nullptr;
};

class Consumer {
 public:
  using Handler = std::function<HandlerResult(const Delivery&)>;
  // Handles a whole fetched batch at once (e.g. one transaction for all of it) and says what
  // became of each message, in order. A message it answers kRetry (or every message, when it
  // throws or answers with the wrong count) goes to the one-message handler, with its retries,
  // as if there were no batch handler.
  using BatchHandler = std::function<std::vector<HandlerResult>(const std::vector<Delivery>&)>;
  Consumer(std::shared_ptr<Connection> conn, ConsumerSpec spec, Handler handler,
           const log::Logger& logger, prometheus::Registry* metrics = nullptr);
  ~Consumer();

  // Before Start: batches of more than one message go to `batch` first.
  void SetBatchHandler(BatchHandler batch) { batch_handler_ = std::move(batch); }
  // Declares the durable consumer (idempotent) and starts the fetch loop.
  Result<void> Start();
  // Stops fetching; the message in hand is finished first.
  void Stop();
  // Deletes the durable consumer so the next Start() replays the stream from the start.
  Result<void> DeleteDurable();
  // Stream sequence of the last message this consumer acked (for tests and rebuild).
  uint64_t LastAckedSequence() const { return last_acked_.load(); }
  uint64_t Processed() const { return processed_.load(); }
  // Messages the server still has for this consumer: not yet delivered + delivered unacked.
  Result<uint64_t> Backlog();
  // Runs this consumer's handler on a message outside the stream (a dead letter being
  // replayed): the handler's idempotency (inbox by event id) makes a replay of something already
  // applied an ack.
  HandlerResult Replay(const Delivery& d);
  const ConsumerSpec& spec() const { return spec_; }

 private:
  void Loop();
  Result<void> Subscribe();
  // Acks or dead-letters a handled message.
  void Dispose(natsMsg* m, const Delivery& d, const HandlerResult& r);
  void LogRetry(const Delivery& d, const HandlerResult& r, uint64_t attempt, int64_t delay_ms);
  // Waits `delay_ms` (or until Stop), keeping the batch's messages from `from` on in progress.
  void WaitHoldingBatch(const std::vector<natsMsg*>& batch, size_t from, int64_t delay_ms);
  bool DeadLetter(const Delivery& d, const HandlerResult& r);
  void SampleLag();
  void KeepAlive();

  std::shared_ptr<Connection> conn_;
  ConsumerSpec spec_;
  Handler handler_;
  BatchHandler batch_handler_;
  log::Logger log_;
  struct Metrics;
  std::shared_ptr<Metrics> metrics_;
  std::mutex mu_;
  std::unique_ptr<Puller> puller_;
  std::thread thread_;
  std::thread keepalive_;
  std::mutex ka_mu_;  // inflight_ and the keepalive's wake-up
  std::condition_variable ka_cv_;
  std::vector<natsMsg*> inflight_;  // fetched, not yet disposed
  std::atomic<bool> stop_{false};
  std::atomic<uint64_t> last_acked_{0};
  std::atomic<uint64_t> processed_{0};
  std::chrono::steady_clock::time_point lag_sampled_{};
  std::mutex handler_mu_;  // the fetch loop and a replay never run the handler at once
};

// Stream's last sequence (0 when empty).
Result<uint64_t> StreamLastSequence(Connection& conn, const std::string& stream);
// Number of messages stored for `subject` in `stream`.
Result<uint64_t> StreamSubjectCount(Connection& conn, const std::string& stream,
                                    const std::string& subject);
// The newest message stored for `subject` (wildcards allowed) in `stream`; NOT_FOUND when none.
Result<Message> StreamLastMessage(Connection& conn, const std::string& stream,
                                  const std::string& subject);

}  // namespace gpuaas::messaging
