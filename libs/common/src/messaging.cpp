#include "gpuaas/common/messaging.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>

#include <fmt/format.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <google/protobuf/timestamp.pb.h>
#include <google/protobuf/util/time_util.h>

#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/contract.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/v1/event.pb.h"

namespace gpuaas::messaging {

Error NatsError(natsStatus s, const std::string& what) {
  const char* text = natsStatus_GetText(s);
  switch (s) {
    case NATS_TIMEOUT:
      return {Code::kDeadlineExceeded, "nats_timeout", what + ": " + text, {}, true};
    case NATS_NO_RESPONDERS:
      return {Code::kUnavailable,
              "no_responders",
              what + ": no service answers this subject",
              {},
              true};
    case NATS_CONNECTION_CLOSED:
    case NATS_CONNECTION_DISCONNECTED:
    case NATS_NO_SERVER:
    case NATS_STALE_CONNECTION:
    case NATS_NOT_YET_CONNECTED:
      return {Code::kUnavailable, "nats_unavailable", what + ": " + text, {}, true};
    case NATS_MAX_PAYLOAD:
      return {Code::kInvalidArgument, "payload_too_large", what + ": " + text, {}, false};
    default:
      return {Code::kUnavailable, "nats_error", what + ": " + text, {}, true};
  }
}

Message FromNats(natsMsg* m) {
  Message out;
  out.subject = natsMsg_GetSubject(m) ? natsMsg_GetSubject(m) : "";
  out.reply = natsMsg_GetReply(m) ? natsMsg_GetReply(m) : "";
  if (natsMsg_GetDataLength(m) > 0) {
    out.data.assign(natsMsg_GetData(m), static_cast<size_t>(natsMsg_GetDataLength(m)));
  }
  const char** keys = nullptr;
  int count = 0;
  if (natsMsgHeader_Keys(m, &keys, &count) == NATS_OK) {
    for (int i = 0; i < count; ++i) {
      const char* v = nullptr;
      if (natsMsgHeader_Get(m, keys[i], &v) == NATS_OK && v) out.headers[keys[i]] = v;
    }
    free(static_cast<void*>(keys));
  }
  return out;
}

Result<natsMsg*> ToNats(const std::string& subject, const std::string& reply,
                        const std::string& data, const Headers& headers) {
  natsMsg* m = nullptr;
  natsStatus s = natsMsg_Create(&m, subject.c_str(), reply.empty() ? nullptr : reply.c_str(),
                                data.data(), static_cast<int>(data.size()));
  if (s != NATS_OK) return NatsError(s, "create message on " + subject);
  for (const auto& [k, v] : headers) {
    s = natsMsgHeader_Set(m, k.c_str(), v.c_str());
    if (s != NATS_OK) {
      natsMsg_Destroy(m);
      return NatsError(s, "set header " + k);
    }
  }
  return m;
}

namespace {
// nats.c runs connection callbacks on its own thread, and may still run them after
// natsConnection_Destroy returns. They therefore get their own heap state, freed by the
// closed callback, which is always the last one nats.c invokes for a connection.
struct CallbackState {
  log::Logger log;
  std::shared_ptr<Connection::Async> async;
};
void OnDisconnected(natsConnection*, void* closure) {
  static_cast<CallbackState*>(closure)->log.Warn("nats disconnected");
}
void OnReconnected(natsConnection*, void* closure) {
  static_cast<CallbackState*>(closure)->log.Info("nats reconnected");
}
void OnConnected(natsConnection*, void* closure) {
  static_cast<CallbackState*>(closure)->log.Info("nats connected");
}
void OnClosed(natsConnection*, void* closure) { delete static_cast<CallbackState*>(closure); }
}  // namespace

struct Connection::Async {
  mutable std::mutex mu;
  uint64_t violations = 0;
  std::string last_error;
  std::vector<std::string> refused;  // subjects named in permission violations (bounded)
};

namespace {
void OnAsyncError(natsConnection* nc, natsSubscription* sub, natsStatus err, void* closure) {
  auto* st = static_cast<CallbackState*>(closure);
  std::string text;
  if (nc != nullptr) {
    const char* last = nullptr;
    if (natsConnection_GetLastError(nc, &last) != NATS_OK && last != nullptr) text = last;
    if (text.empty() && last != nullptr) text = last;
  }
  if (text.empty()) text = natsStatus_GetText(err);
  const bool permission =
      err == NATS_NOT_PERMITTED || text.find("Permissions Violation") != std::string::npos;
  {
    std::lock_guard lock(st->async->mu);
    st->async->last_error = text;
    if (permission) {
      st->async->violations++;
      if (st->async->refused.size() < 256) st->async->refused.push_back(text);
    }
  }
  log::Fields f{{"error", text}};
  if (sub != nullptr && natsSubscription_GetSubject(sub) != nullptr) {
    f.emplace_back("subscription", natsSubscription_GetSubject(sub));
  }
  // Loud on purpose: a refused subject means this identity's permissions and the contract
  // disagree (or the process is doing something it must not).
  st->log.Error(permission ? "nats permission violation" : "nats async error", f);
}
}  // namespace

Result<std::shared_ptr<Connection>> Connection::Connect(const ConnectionOptions& o,
                                                        log::Logger logger) {
  std::shared_ptr<Connection> c(new Connection());
  c->log_ = std::move(logger);
  c->contract_ = std::make_shared<contract::Registry>();
  natsStatus s = natsOptions_Create(&c->opts_);
  // A cluster: "nats://a:1,nats://b:2,..." (nats.c's SetURL takes one URL only).
  std::vector<std::string> urls;
  for (size_t start = 0; start <= o.url.size();) {
    const size_t comma = std::min(o.url.find(',', start), o.url.size());
    std::string u = o.url.substr(start, comma - start);
    u.erase(0, u.find_first_not_of(' '));
    u.erase(u.find_last_not_of(' ') + 1);
    if (!u.empty()) urls.push_back(u);
    start = comma + 1;
  }
  std::vector<const char*> servers;
  servers.reserve(urls.size());
  for (const auto& u : urls) servers.push_back(u.c_str());
  if (s == NATS_OK) {
    s = servers.size() > 1
            ? natsOptions_SetServers(c->opts_, servers.data(), static_cast<int>(servers.size()))
            : natsOptions_SetURL(c->opts_, o.url.c_str());
  }
  if (s == NATS_OK && !o.name.empty()) s = natsOptions_SetName(c->opts_, o.name.c_str());
  if (s == NATS_OK) s = natsOptions_SetTimeout(c->opts_, o.connect_timeout_ms);
  if (s == NATS_OK) s = natsOptions_SetMaxReconnect(c->opts_, -1);
  if (s == NATS_OK) s = natsOptions_SetReconnectWait(c->opts_, o.reconnect_wait_ms);
  if (s == NATS_OK) s = natsOptions_SetReconnectJitter(c->opts_, 50, 50);
  // Requests/replies are small and latency-bound: flush every send immediately.
  if (s == NATS_OK) s = natsOptions_SetSendAsap(c->opts_, true);
  // Keep publishing into the reconnect buffer while the server restarts.
  if (s == NATS_OK) s = natsOptions_SetReconnectBufSize(c->opts_, 32 * 1024 * 1024);
  if (s == NATS_OK && !o.seed_file.empty()) {
    // A missing, malformed or world-readable seed is a configuration error, said at start.
    auto seed = auth::ReadSeedFile(o.seed_file);
    auto pub = seed.ok() ? auth::NKeyPublicFromSeed(*seed) : Result<std::string>(seed.error());
    if (!pub.ok()) return pub.error();
    // The server's nonce is signed here (OpenSSL Ed25519, auth.hpp), from the seed file read at
    // every (re)connect.
    c->seed_file_ = o.seed_file;
    s = natsOptions_SetNKey(c->opts_, pub->c_str(), &Connection::SignNonce, c.get());
  }
  if (s == NATS_OK && !o.inbox_prefix.empty()) {
    s = natsOptions_SetCustomInboxPrefix(c->opts_, o.inbox_prefix.c_str());
  }
  if (s == NATS_OK && !o.tls_ca_file.empty()) {
    s = natsOptions_SetSecure(c->opts_, true);
    if (s == NATS_OK) s = natsOptions_LoadCATrustedCertificates(c->opts_, o.tls_ca_file.c_str());
  }
  c->async_ = std::make_shared<Async>();
  c->token_ = o.token;
  auto cb = std::make_unique<CallbackState>(CallbackState{c->log_, c->async_});
  if (s == NATS_OK) s = natsOptions_SetDisconnectedCB(c->opts_, OnDisconnected, cb.get());
  if (s == NATS_OK) s = natsOptions_SetReconnectedCB(c->opts_, OnReconnected, cb.get());
  if (s == NATS_OK) s = natsOptions_SetClosedCB(c->opts_, OnClosed, cb.get());
  if (s == NATS_OK) s = natsOptions_SetErrorHandler(c->opts_, OnAsyncError, cb.get());
  if (s != NATS_OK) return NatsError(s, "nats options");
  // First a plain connect, again on a refusal or a server too slow to answer:
  // - about 1 in 200 nkey handshakes with nats-server 2.9.10 is refused with a valid key and a
  //   correct signature of the nonce (6 of 1000 gpuaasctl connects measured; the next attempt
  //   passes), and nats.c closes a connection whose background (re)connect is refused. A key the
  //   server does not list keeps failing, so the attempts change nothing else.
  // - a server that took the TCP connection but did not finish the handshake within the timeout
  //   (a loaded host): nats.c 3.4's background connect gives up for good after such an attempt,
  //   so these are retried here, in the foreground.
  s = natsConnection_Connect(&c->nc_, c->opts_);
  for (int attempt = 1; attempt < 5; ++attempt) {
    const bool refused = s == NATS_CONNECTION_AUTH_FAILED && attempt < 4;
    const bool slow = s == NATS_TIMEOUT || s == NATS_IO_ERROR || s == NATS_STALE_CONNECTION;
    if (!refused && !slow) break;
    if (slow) {
      c->log_.Warn("nats connect failed, trying again",
                   {{"url", o.url}, {"error", natsStatus_GetText(s)}});
    }
    s = natsConnection_Connect(&c->nc_, c->opts_);
  }
  // No server yet: start anyway and connect in the background when it comes.
  if (s == NATS_NO_SERVER && o.retry_on_failed_connect) {
    s = natsOptions_SetRetryOnFailedConnect(c->opts_, true, OnConnected, cb.get());
    if (s == NATS_OK) s = natsConnection_Connect(&c->nc_, c->opts_);
  }
  if (s != NATS_OK && !(o.retry_on_failed_connect && s == NATS_NOT_YET_CONNECTED)) {
    return NatsError(s, "connect to " + o.url);  // no connection: nats.c never calls back
  }
  (void)cb.release();  // owned by the connection from here; freed in OnClosed
  jsOptions jo;
  jsOptions_Init(&jo);
  jo.Wait = 5000;
  s = natsConnection_JetStream(&c->js_, c->nc_, &jo);
  if (s != NATS_OK) return NatsError(s, "jetstream context");
  return c;
}

natsStatus Connection::SignNonce(char** custom_err, unsigned char** signature, int* length,
                                 const char* nonce, void* closure) {
  auto* self = static_cast<Connection*>(closure);
  // Read at every (re)connect: a rotated seed file is picked up.
  auto seed = auth::ReadSeedFile(self->seed_file_);
  auto sig = seed.ok() ? auth::SignWithSeed(*seed, nonce) : Result<std::string>(seed.error());
  if (!sig.ok()) {
    *custom_err = strdup(sig.error().message.c_str());
    return NATS_ERR;
  }
  *signature = static_cast<unsigned char*>(malloc(sig->size()));
  if (*signature == nullptr) return NATS_NO_MEMORY;
  memcpy(*signature, sig->data(), sig->size());
  *length = static_cast<int>(sig->size());
  return NATS_OK;
}

Connection::~Connection() {
  if (js_) jsCtx_Destroy(js_);
  if (nc_) {
    natsConnection_Close(nc_);
    natsConnection_Destroy(nc_);
  }
  if (opts_) natsOptions_Destroy(opts_);
}

bool Connection::Connected() const {
  return nc_ && natsConnection_Status(nc_) == NATS_CONN_STATUS_CONNECTED;
}

Result<void> Connection::Publish(const std::string& subject, const std::string& data,
                                 const Headers& headers) {
  contract_->RecordPublish(subject, data, "nats publish");
  return Reply(subject, data, headers);
}

Result<void> Connection::Reply(const std::string& reply_to, const std::string& data,
                               const Headers& headers) {
  auto m = ToNats(reply_to, "", data, headers);
  if (!m.ok()) return m.error();
  natsStatus s = natsConnection_PublishMsg(nc_, *m);
  natsMsg_Destroy(*m);
  if (s != NATS_OK) return NatsError(s, "publish " + reply_to);
  return Ok();
}

Result<Message> Connection::Request(const std::string& subject, const std::string& data,
                                    const Headers& headers, std::chrono::milliseconds timeout) {
  contract_->Record({contract::Role::kRequest, subject, "", "", "nats request", 1});
  Headers with_token;
  const Headers* h = &headers;
  {
    std::lock_guard lock(token_mu_);
    if (!token_.empty() && headers.count(auth::kHeaderAuthorization) == 0) {
      with_token = headers;
      with_token[auth::kHeaderAuthorization] = "Bearer " + token_;
      h = &with_token;
    }
  }
  auto m = ToNats(subject, "", data, *h);
  if (!m.ok()) return m.error();
  natsMsg* reply = nullptr;
  natsStatus s = natsConnection_RequestMsg(&reply, nc_, *m, timeout.count());
  natsMsg_Destroy(*m);
  if (s != NATS_OK) return NatsError(s, "request " + subject);
  Message out = FromNats(reply);
  natsMsg_Destroy(reply);
  return out;
}

Result<void> Connection::Flush(std::chrono::milliseconds timeout) {
  natsStatus s = natsConnection_FlushTimeout(nc_, timeout.count());
  if (s != NATS_OK) return NatsError(s, "flush");
  return Ok();
}

void Connection::SetRequestToken(std::string token) {
  std::lock_guard lock(token_mu_);
  token_ = std::move(token);
}

uint64_t Connection::PermissionViolations() const {
  std::lock_guard lock(async_->mu);
  return async_->violations;
}

std::string Connection::LastAsyncError() const {
  std::lock_guard lock(async_->mu);
  return async_->last_error;
}

Result<void> Connection::CheckPermitted(const std::string& subject,
                                        std::chrono::milliseconds timeout) {
  // The server sends -ERR before the PONG of a later PING, so after a flush any refusal of
  // what was sent before has been seen by the error handler.
  if (auto r = Flush(timeout); !r.ok()) return r;
  // nats.c records the -ERR as the connection's last error before it handles the PONG, and
  // runs the error handler later on its own thread: look at both.
  std::vector<std::string> seen;
  const char* last = nullptr;
  (void)natsConnection_GetLastError(nc_, &last);
  if (last != nullptr) seen.emplace_back(last);
  std::lock_guard lock(async_->mu);
  seen.insert(seen.end(), async_->refused.begin(), async_->refused.end());
  const std::string quoted = "\"" + subject + "\"";
  for (const auto& text : seen) {
    if (text.find("Permissions Violation") == std::string::npos) continue;
    if (text.find(quoted) != std::string::npos) {
      std::string message = "the NATS server refused ";
      message.append(subject).append(" for this identity: ").append(text);
      return Error{Code::kPermissionDenied,
                   "nats_permission_denied",
                   message,
                   {{"subject", subject}},
                   false};
    }
  }
  return Ok();
}

// ---- JetStream ----

namespace {
Error JsError(natsStatus s, jsErrCode jerr, const std::string& what) {
  Error e = NatsError(s, what);
  if (jerr != 0) e.details["js_err_code"] = std::to_string(static_cast<int>(jerr));
  natsStatus ls = NATS_OK;
  if (const char* last = nats_GetLastError(&ls); last != nullptr && *last != '\0') {
    e.details["nats_last_error"] = last;
  }
  return e;
}
}  // namespace

namespace {
std::atomic<int> g_stream_replicas{1};
}  // namespace

void SetStreamReplicas(int replicas) { g_stream_replicas = std::max(1, replicas); }
int StreamReplicas() { return g_stream_replicas.load(); }

Result<void> EnsureStream(Connection& conn, const StreamSpec& spec) {
  jsStreamConfig cfg;
  jsStreamConfig_Init(&cfg);
  std::vector<const char*> subjects;
  for (const auto& s : spec.subjects) subjects.push_back(s.c_str());
  cfg.Name = spec.name.c_str();
  cfg.Subjects = subjects.data();
  cfg.SubjectsLen = static_cast<int>(subjects.size());
  cfg.Storage = js_FileStorage;
  cfg.Retention = js_LimitsPolicy;
  cfg.MaxAge = spec.max_age_s * int64_t{1000000000};
  cfg.Duplicates = spec.duplicate_window_s * int64_t{1000000000};
  cfg.Replicas = spec.replicas > 0 ? spec.replicas : StreamReplicas();
  jsStreamInfo* si = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_AddStream(&si, conn.js(), &cfg, nullptr, &jerr);
  if (s == NATS_OK) {
    jsStreamInfo_Destroy(si);
    return Ok();
  }
  if (jerr == JSStreamNameExistErr) {
    s = js_UpdateStream(&si, conn.js(), &cfg, nullptr, &jerr);
    if (s == NATS_OK) {
      jsStreamInfo_Destroy(si);
      conn.logger().Info("stream updated", {{"stream", spec.name}});
      return Ok();
    }
  }
  return JsError(s, jerr, "ensure stream " + spec.name);
}

Result<PublishAck> JsPublish(Connection& conn, const std::string& subject, const std::string& data,
                             const std::string& msg_id, const Headers& headers,
                             int64_t timeout_ms) {
  // Recorded before it is sent: a subject no stream takes fails here, and is still what the
  // code publishes.
  conn.contract().RecordPublish(subject, data, "jetstream publish");
  auto m = ToNats(subject, "", data, headers);
  if (!m.ok()) return m.error();
  jsPubOptions po;
  jsPubOptions_Init(&po);
  po.MsgId = msg_id.empty() ? nullptr : msg_id.c_str();
  po.MaxWait = timeout_ms;
  jsPubAck* pa = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_PublishMsg(&pa, conn.js(), *m, &po, &jerr);
  natsMsg_Destroy(*m);
  if (s != NATS_OK) return JsError(s, jerr, "jetstream publish " + subject);
  PublishAck ack{pa->Stream ? pa->Stream : "", pa->Sequence, pa->Duplicate};
  jsPubAck_Destroy(pa);
  return ack;
}

StreamSpec InventoryEventsStream() {
  return {"GPUAAS_EVT_INVENTORY", {"gpuaas.v1.evt.inventory.>"}, 0, 600};
}
StreamSpec NodeTasksStream() { return {"GPUAAS_NODE_TASKS", {"gpuaas.v1.node.*.task"}, 0, 600}; }
StreamSpec NodeEventsStream() { return {"GPUAAS_EVT_NODE", {"gpuaas.v1.evt.node.>"}, 0, 600}; }
StreamSpec IpamEventsStream() { return {"GPUAAS_EVT_IPAM", {"gpuaas.v1.evt.ipam.>"}, 0, 600}; }
StreamSpec SchedulerEventsStream() {
  return {"GPUAAS_EVT_SCHEDULER", {"gpuaas.v1.evt.scheduler.>"}, 0, 600};
}
StreamSpec IngressEventsStream() {
  return {"GPUAAS_EVT_INGRESS", {"gpuaas.v1.evt.ingress.>"}, 0, 600};
}
StreamSpec ConsoleEventsStream() {
  return {"GPUAAS_EVT_CONSOLE", {"gpuaas.v1.evt.console.>"}, 0, 600};
}
StreamSpec DeadLetterStream() { return {"GPUAAS_DLQ", {"gpuaas.v1.dlq.>"}, 0, 600}; }

Result<uint64_t> StreamLastSequence(Connection& conn, const std::string& stream) {
  jsStreamInfo* si = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_GetStreamInfo(&si, conn.js(), stream.c_str(), nullptr, &jerr);
  if (s != NATS_OK) return JsError(s, jerr, "stream info " + stream);
  uint64_t last = si->State.LastSeq;
  jsStreamInfo_Destroy(si);
  return last;
}

Result<uint64_t> StreamSubjectCount(Connection& conn, const std::string& stream,
                                    const std::string& subject) {
  jsOptions o;
  jsOptions_Init(&o);
  o.Stream.Info.SubjectsFilter = subject.c_str();
  jsStreamInfo* si = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_GetStreamInfo(&si, conn.js(), stream.c_str(), &o, &jerr);
  if (s != NATS_OK) return JsError(s, jerr, "stream info " + stream);
  uint64_t n = 0;
  if (si->State.Subjects) {
    for (int i = 0; i < si->State.Subjects->Count; ++i) n += si->State.Subjects->List[i].Msgs;
  }
  jsStreamInfo_Destroy(si);
  return n;
}

Result<Message> StreamLastMessage(Connection& conn, const std::string& stream,
                                  const std::string& subject) {
  natsMsg* m = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_GetLastMsg(&m, conn.js(), stream.c_str(), subject.c_str(), nullptr, &jerr);
  if (s == NATS_NOT_FOUND || jerr == JSNoMessageFoundErr) {
    return Error::NotFound("no_message", "no message for " + subject + " in " + stream);
  }
  if (s != NATS_OK) return JsError(s, jerr, "last message of " + subject);
  Message out = FromNats(m);
  natsMsg_Destroy(m);
  return out;
}

// ---- Consumer ----

struct Consumer::Metrics {
  prometheus::Family<prometheus::Counter>* family = nullptr;
  prometheus::Counter* acked = nullptr;
  prometheus::Counter* retried = nullptr;
  prometheus::Counter* dead = nullptr;
  prometheus::Family<prometheus::Counter>* dead_family = nullptr;
  prometheus::Gauge* lag = nullptr;
};

Consumer::Consumer(std::shared_ptr<Connection> conn, ConsumerSpec spec, Handler handler,
                   const log::Logger& logger, prometheus::Registry* metrics)
    : conn_(std::move(conn)),
      spec_(std::move(spec)),
      handler_(std::move(handler)),
      log_(logger.With({{"consumer", spec_.durable}})),
      metrics_(std::make_shared<Metrics>()) {
  if (metrics) {
    metrics_->family = &prometheus::BuildCounter()
                            .Name("gpuaas_events_consumed_total")
                            .Help("Events handled by durable consumers, by outcome")
                            .Register(*metrics);
    metrics_->acked = &metrics_->family->Add({{"consumer", spec_.durable}, {"result", "ack"}});
    metrics_->retried = &metrics_->family->Add({{"consumer", spec_.durable}, {"result", "retry"}});
    metrics_->dead =
        &metrics_->family->Add({{"consumer", spec_.durable}, {"result", "dead_letter"}});
    metrics_->dead_family = &prometheus::BuildCounter()
                                 .Name("gpuaas_dead_letters_total")
                                 .Help(
                                     "Messages a durable consumer dead-lettered, by kind "
                                     "(undecodable, invalid, permanent)")
                                 .Register(*metrics);
    // Present at 0 from the start, so an alert on increase() sees the first one.
    for (const char* kind : {kRejectUndecodable, kRejectInvalid, kRejectPermanent}) {
      metrics_->dead_family->Add({{"consumer", spec_.durable}, {"reason_kind", kind}});
    }
    metrics_->lag = &prometheus::BuildGauge()
                         .Name("gpuaas_consumer_lag")
                         .Help(
                             "Messages the server holds for a durable consumer: not yet "
                             "delivered + delivered and not yet acked (sampled every 5 s)")
                         .Register(*metrics)
                         .Add({{"stream", spec_.stream}, {"consumer", spec_.durable}});
  }
}

Consumer::~Consumer() { Stop(); }

Result<void> EnsureConsumer(Connection& conn, const ConsumerSpec& spec) {
  jsConsumerConfig cc;
  jsConsumerConfig_Init(&cc);
  cc.Durable = spec.durable.c_str();
  cc.AckPolicy = js_AckExplicit;
  cc.DeliverPolicy = js_DeliverAll;
  // Unlimited: a retryable failure is redelivered until it succeeds; what can never succeed is
  // dead-lettered by the consumer itself (Dispose).
  cc.MaxDeliver = -1;
  cc.AckWait = spec.ack_wait_ms * int64_t{1000000};
  cc.FilterSubject = spec.filter_subject.c_str();
  cc.MaxAckPending = 10000;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_UpdateConsumer(nullptr, conn.js(), spec.stream.c_str(), &cc, nullptr, &jerr);
  if (s != NATS_OK && jerr == JSConsumerNotFoundErr) {
    jerr = static_cast<jsErrCode>(0);
    s = js_AddConsumer(nullptr, conn.js(), spec.stream.c_str(), &cc, nullptr, &jerr);
  }
  if (s != NATS_OK) return JsError(s, jerr, "create or update consumer " + spec.durable);
  return Ok();
}

ConsumerSpec NodeTaskConsumerSpec(const std::string& node_id, int64_t ack_wait_ms) {
  ConsumerSpec spec;
  spec.stream = NodeTasksStream().name;
  spec.durable = "node-" + node_id;
  spec.filter_subject = "gpuaas.v1.node." + node_id + ".task";
  // One task at a time: a fetched task waits for nothing but itself, and the consumer keeps it
  // alive while it runs (image writes and wipes take longer than any ack wait).
  spec.batch = 1;
  spec.ack_wait_ms = ack_wait_ms;
  spec.keepalive = true;
  // A VM task waits (redelivered) while adoption or the first network apply is pending, until
  // its deadline passes (then the agent answers it failed, deadline_exceeded).
  spec.backoff_ms = {100, 500, 2000, 5000, 10000};
  return spec;
}

Result<void> Consumer::Subscribe() {
  std::lock_guard lock(mu_);
  if (sub_) {
    natsSubscription_Destroy(sub_);
    sub_ = nullptr;
  }
  // The durable is created, or updated to this spec (an upgraded service may change its ack
  // wait or redelivery limit; the consumer keeps its position), then bound to. A bind-only
  // consumer takes the durable as its manager made it.
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = NATS_OK;
  if (!spec_.bind_only) {
    if (auto r = EnsureConsumer(*conn_, spec_); !r.ok()) return r;
  } else {
    jsConsumerInfo* ci = nullptr;
    s = js_GetConsumerInfo(&ci, conn_->js(), spec_.stream.c_str(), spec_.durable.c_str(), nullptr,
                           &jerr);
    if (s != NATS_OK) return JsError(s, jerr, "consumer info " + spec_.durable);
    if (ci->Config != nullptr && ci->Config->AckWait > 0) {
      spec_.ack_wait_ms = ci->Config->AckWait / int64_t{1000000};
    }
    jsConsumerInfo_Destroy(ci);
  }
  jsSubOptions so;
  jsSubOptions_Init(&so);
  so.Stream = spec_.stream.c_str();
  so.Consumer = spec_.durable.c_str();
  jerr = static_cast<jsErrCode>(0);
  s = js_PullSubscribe(&sub_, conn_->js(), spec_.filter_subject.c_str(), spec_.durable.c_str(),
                       nullptr, &so, &jerr);
  if (s != NATS_OK) {
    sub_ = nullptr;
    return JsError(s, jerr, "pull subscribe " + spec_.durable);
  }
  return Ok();
}

namespace {
std::string DeadLetterSubject(const ConsumerSpec& spec) {
  return fmt::format("gpuaas.v1.dlq.{stream}.{consumer}", fmt::arg("stream", spec.stream),
                     fmt::arg("consumer", spec.durable));
}
}  // namespace

Result<void> Consumer::Start() {
  if (auto r = Subscribe(); !r.ok()) return r;
  // What this consumer takes, and where it puts what it gives up on (before any message: it
  // is where every message may go).
  const std::string via = "consumer " + spec_.stream + "/" + spec_.durable;
  conn_->contract().Record({contract::Role::kConsume, spec_.filter_subject, "", "", via, 0});
  conn_->contract().Record({contract::Role::kPublish, DeadLetterSubject(spec_),
                            v1::DeadLetter::descriptor()->full_name(), "", via, 0});
  stop_ = false;
  thread_ = std::thread([this] { Loop(); });
  if (spec_.keepalive) keepalive_ = std::thread([this] { KeepAlive(); });
  log_.Info("consumer started", {{"stream", spec_.stream}, {"filter", spec_.filter_subject}});
  return Ok();
}

void Consumer::Stop() {
  {
    std::lock_guard lock(ka_mu_);
    stop_ = true;
  }
  ka_cv_.notify_all();
  if (thread_.joinable()) thread_.join();
  if (keepalive_.joinable()) keepalive_.join();
  std::lock_guard lock(mu_);
  if (sub_) {
    natsSubscription_Destroy(sub_);
    sub_ = nullptr;
  }
}

Result<void> Consumer::DeleteDurable() {
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s =
      js_DeleteConsumer(conn_->js(), spec_.stream.c_str(), spec_.durable.c_str(), nullptr, &jerr);
  if (s != NATS_OK && jerr != JSConsumerNotFoundErr) {
    return JsError(s, jerr, "delete consumer " + spec_.durable);
  }
  return Ok();
}

Result<uint64_t> Consumer::Backlog() {
  jsConsumerInfo* ci = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_GetConsumerInfo(&ci, conn_->js(), spec_.stream.c_str(), spec_.durable.c_str(),
                                    nullptr, &jerr);
  if (s != NATS_OK) return JsError(s, jerr, "consumer info " + spec_.durable);
  uint64_t n = ci->NumPending + static_cast<uint64_t>(ci->NumAckPending);
  jsConsumerInfo_Destroy(ci);
  return n;
}

void Consumer::KeepAlive() {
  const auto every = std::chrono::milliseconds(std::max<int64_t>(spec_.ack_wait_ms / 3, 10));
  std::unique_lock lock(ka_mu_);
  while (!stop_) {
    ka_cv_.wait_for(lock, every, [&] { return stop_.load(); });
    if (stop_) break;
    // Under ka_mu_: the fetch loop removes a message from inflight_ before it disposes of it.
    for (natsMsg* m : inflight_) {
      if (natsMsg_InProgress(m, nullptr) != NATS_OK) {
        log_.Warn("in-progress ack not sent", {{"consumer", spec_.durable}});
      }
    }
  }
}

int64_t RetryDelayMs(const std::vector<int64_t>& backoff_ms, uint64_t num_delivered) {
  if (backoff_ms.empty()) return 0;
  const size_t idx =
      std::min<size_t>(num_delivered == 0 ? 0 : num_delivered - 1, backoff_ms.size() - 1);
  const int64_t base = backoff_ms[idx];
  thread_local std::mt19937_64 rng(std::random_device{}());
  std::uniform_int_distribution<int64_t> jitter(-base / 4, base / 4);
  return std::max<int64_t>(1, base + jitter(rng));
}

namespace {
Delivery ToDelivery(natsMsg* m) {
  Delivery d;
  d.msg = FromNats(m);
  jsMsgMetaData* meta = nullptr;
  if (natsMsg_GetMetaData(&meta, m) == NATS_OK) {
    d.stream_sequence = meta->Sequence.Stream;
    d.num_delivered = meta->NumDelivered;
    jsMsgMetaData_Destroy(meta);
  }
  return d;
}
}  // namespace

HandlerResult Consumer::Replay(const Delivery& d) {
  std::lock_guard lock(handler_mu_);
  try {
    return handler_(d);
  } catch (const std::exception& e) {
    return HandlerResult::Retry(std::string("handler threw: ") + e.what());
  }
}

void Consumer::SampleLag() {
  if (!metrics_->lag) return;
  const auto now = std::chrono::steady_clock::now();
  if (now - lag_sampled_ < std::chrono::seconds(5)) return;
  lag_sampled_ = now;
  if (auto n = Backlog(); n.ok()) metrics_->lag->Set(static_cast<double>(*n));
}

void Consumer::Loop() {
  int64_t error_backoff_ms = 100;
  while (!stop_) {
    natsSubscription* sub = nullptr;
    {
      std::lock_guard lock(mu_);
      sub = sub_;
    }
    if (!sub) {
      if (auto r = Subscribe(); !r.ok()) {
        log_.Warn("consumer resubscribe failed", {{"error", r.error().ToString()}});
        std::this_thread::sleep_for(std::chrono::milliseconds(error_backoff_ms));
        error_backoff_ms = std::min<int64_t>(error_backoff_ms * 2, 2000);
      }
      continue;
    }
    SampleLag();
    natsMsgList list{nullptr, 0};
    jsErrCode jerr = static_cast<jsErrCode>(0);
    natsStatus s = natsSubscription_Fetch(&list, sub, spec_.batch, spec_.fetch_timeout_ms, &jerr);
    if (s == NATS_TIMEOUT) continue;
    if (s != NATS_OK) {
      if (!stop_) {
        log_.Warn("consumer fetch failed", {{"error", JsError(s, jerr, "fetch").ToString()}});
        if (jerr == JSConsumerNotFoundErr || s == NATS_INVALID_SUBSCRIPTION ||
            s == NATS_CONNECTION_CLOSED) {
          std::lock_guard lock(mu_);
          if (sub_) natsSubscription_Destroy(sub_);
          sub_ = nullptr;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(error_backoff_ms));
        error_backoff_ms = std::min<int64_t>(error_backoff_ms * 2, 2000);
      }
      continue;
    }
    error_backoff_ms = 100;
    if (list.Count > spec_.batch) {
      // More than the array nats.c 3.4.1 allocated for `batch` holds (seen with ASan under a
      // backlog of ~90,000 events, docs/benchmarks.md P8): it wrote past that array, so this
      // process's memory is corrupt. Stop now, loudly, rather than run on it; the durable
      // consumer resumes from its last ack when the service is started again.
      log_.Error("nats fetch overran its batch: aborting", {{"count", std::to_string(list.Count)},
                                                            {"batch", std::to_string(spec_.batch)},
                                                            {"consumer", spec_.durable}});
      std::abort();
    }
    if (spec_.keepalive) {
      std::lock_guard lock(ka_mu_);
      inflight_.assign(list.Msgs, list.Msgs + list.Count);
    }
    for (int i = 0; i < list.Count; ++i) {
      natsMsg* m = list.Msgs[i];
      const Delivery d = ToDelivery(m);
      if (stop_) {
        // Stopping: what is not handled yet goes back to the server now, for the next consumer.
        natsMsg_Nak(m, nullptr);
        continue;
      }
      HandlerResult r;
      // A retryable failure keeps the message in hand: retried here with a jittered backoff
      // (in-progress acks keep the server from redelivering it meanwhile), so nothing fetched
      // after it is handled before it and it is never dead-lettered. A consumer that dies
      // mid-retry gets it redelivered after the ack wait.
      for (uint64_t attempt = 1;; ++attempt) {
        {
          std::lock_guard lock(handler_mu_);
          try {
            r = handler_(d);
          } catch (const std::exception& e) {
            r = HandlerResult::Retry(std::string("handler threw: ") + e.what());
          }
        }
        if (r.disposition != Disposition::kRetry || stop_) break;
        const int64_t delay = RetryDelayMs(spec_.backoff_ms, attempt);
        LogRetry(d, r, attempt, delay);
        if (metrics_->retried) metrics_->retried->Increment();
        WaitHoldingBatch(list, i, delay);
      }
      if (spec_.keepalive) {
        std::lock_guard lock(ka_mu_);
        inflight_.erase(std::remove(inflight_.begin(), inflight_.end(), m), inflight_.end());
      }
      if (r.disposition == Disposition::kRetry) {
        natsMsg_Nak(m, nullptr);  // stopping mid-retry: another consumer takes it
        continue;
      }
      Dispose(m, d, r);
    }
    if (spec_.keepalive) {
      std::lock_guard lock(ka_mu_);
      inflight_.clear();
    }
    natsMsgList_Destroy(&list);
  }
}

void Consumer::LogRetry(const Delivery& d, const HandlerResult& r, uint64_t attempt,
                        int64_t delay_ms) {
  auto fields = log::Fields{{"subject", d.msg.subject},
                            {"stream_seq", std::to_string(d.stream_sequence)},
                            {"deliveries", std::to_string(d.num_delivered)},
                            {"attempt", std::to_string(attempt)},
                            {"retry_in_ms", std::to_string(delay_ms)},
                            {"reason", r.reason},
                            {"trace_id", ids::TraceId(d.msg.Header(kHeaderTraceparent))}};
  // The first failures are routine (a restart, a moment of contention); a message that keeps
  // failing is what an operator should see.
  if (attempt >= 5) {
    log_.Error("event handling still failing, kept and retried", fields);
  } else {
    log_.Warn("event handling failed, will retry", fields);
  }
}

void Consumer::WaitHoldingBatch(const natsMsgList& list, int from, int64_t delay_ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms);
  const auto every = std::chrono::milliseconds(std::max<int64_t>(spec_.ack_wait_ms / 3, 10));
  std::unique_lock lock(ka_mu_);
  while (!stop_) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) break;
    if (delay_ms >= spec_.ack_wait_ms / 3) {
      for (int j = from; j < list.Count; ++j) natsMsg_InProgress(list.Msgs[j], nullptr);
    }
    ka_cv_.wait_for(lock, std::min<std::chrono::steady_clock::duration>(until - now, every),
                    [&] { return stop_.load(); });
  }
}

void Consumer::Dispose(natsMsg* m, const Delivery& d, const HandlerResult& r) {
  auto fields = log::Fields{{"subject", d.msg.subject},
                            {"stream_seq", std::to_string(d.stream_sequence)},
                            {"deliveries", std::to_string(d.num_delivered)},
                            {"trace_id", ids::TraceId(d.msg.Header(kHeaderTraceparent))}};
  processed_++;
  if (r.disposition == Disposition::kAck) {
    natsMsg_Ack(m, nullptr);
    last_acked_ = d.stream_sequence;
    if (metrics_->acked) metrics_->acked->Increment();
    return;
  }
  const std::string kind = r.kind.empty() ? kRejectPermanent : r.kind;
  fields.emplace_back("reason", r.reason);
  fields.emplace_back("kind", kind);
  if (!DeadLetter(d, r)) {
    // Not stored in the dead-letter stream: the message stays where it is, to be tried again.
    natsMsg_NakWithDelay(m, 1000, nullptr);
    return;
  }
  log_.Error("event dead-lettered", fields);
  natsMsg_Term(m, nullptr);
  last_acked_ = d.stream_sequence;
  if (metrics_->dead) metrics_->dead->Increment();
  if (metrics_->dead_family) {
    metrics_->dead_family->Add({{"consumer", spec_.durable}, {"reason_kind", kind}}).Increment();
  }
}

bool Consumer::DeadLetter(const Delivery& d, const HandlerResult& r) {
  v1::DeadLetter dl;
  dl.set_stream(spec_.stream);
  dl.set_consumer(spec_.durable);
  dl.set_subject(d.msg.subject);
  dl.set_stream_sequence(d.stream_sequence);
  dl.set_deliveries(d.num_delivered);
  dl.set_payload(d.msg.data);
  for (const auto& [k, v] : d.msg.headers) (*dl.mutable_headers())[k] = v;
  dl.set_reason(r.reason);
  dl.set_kind(r.kind.empty() ? kRejectPermanent : r.kind);
  *dl.mutable_time() = google::protobuf::util::TimeUtil::GetCurrentTime();
  const std::string subject = DeadLetterSubject(spec_);
  Headers h;
  if (auto tp = d.msg.Header(kHeaderTraceparent); !tp.empty()) h[kHeaderTraceparent] = tp;
  auto res = JsPublish(*conn_, subject, dl.SerializeAsString(),
                       fmt::format("{}:{}:{}", spec_.stream, spec_.durable, d.stream_sequence), h);
  if (!res.ok()) {
    log_.Error("dead-letter publish failed; the message is kept",
               {{"error", res.error().ToString()}});
  }
  return res.ok();
}

}  // namespace gpuaas::messaging
