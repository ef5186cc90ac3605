#include "gpuaas/common/messaging.hpp"

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <random>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <google/protobuf/timestamp.pb.h>
#include <google/protobuf/util/time_util.h>

#include "gpuaas/common/access.hpp"
#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/contract.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/v1/event.pb.h"

namespace gpuaas::messaging {

Error NatsError(natsStatus s, const std::string& what) {
  const char* text = natsStatus_GetText(s);
  switch (s) {
    case NATS_TIMEOUT:
      return Error::Of(Code::kDeadlineExceeded, reason::kNatsTimeout, what + ": " + text, {}, true);
    case NATS_NO_RESPONDERS:
      return Error::Of(Code::kUnavailable, reason::kNoResponders,
                       what + ": no service answers this subject", {}, true);
    case NATS_CONNECTION_CLOSED:
    case NATS_CONNECTION_DISCONNECTED:
    case NATS_NO_SERVER:
    case NATS_STALE_CONNECTION:
    case NATS_NOT_YET_CONNECTED:
      return Error::Of(Code::kUnavailable, reason::kNatsUnavailable, what + ": " + text, {}, true);
    case NATS_MAX_PAYLOAD:
      return Error::Of(Code::kInvalidArgument, reason::kPayloadTooLarge, what + ": " + text, {},
                       false);
    default:
      return Error::Of(Code::kUnavailable, reason::kNatsError, what + ": " + text, {}, true);
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
    c->inbox_prefix_ = o.inbox_prefix;
  }
  c->client_role_ = o.client_role;
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
  // A client's request names its connection role (access.hpp ClientSubject).
  const bool bound = !client_role_.empty() && subject.rfind("gpuaas.", 0) == 0;
  auto m = ToNats(bound ? access::ClientSubject(subject, client_role_) : subject, "", data, *h);
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
      return Error::Of(Code::kPermissionDenied, reason::kNatsPermissionDenied, message,
                       {{"subject", subject}}, false);
    }
  }
  return Ok();
}

std::string Connection::NewInbox() const {
  natsInbox* inbox = nullptr;
  std::string unique;
  if (natsInbox_Create(&inbox) == NATS_OK) {
    const std::string made(inbox);  // _INBOX.<nuid>
    unique = made.substr(made.rfind('.') + 1);
    natsInbox_Destroy(inbox);
  } else {
    unique = ids::NewUuidV7();
  }
  return inbox_prefix_ + "." + unique;
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
  cfg.Replicas = std::max(1, spec.replicas);
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

std::vector<StreamSpec> PlatformStreams() {
  return {InventoryEventsStream(), IpamEventsStream(),    SchedulerEventsStream(),
          IngressEventsStream(),   ConsoleEventsStream(), NodeEventsStream(),
          NodeTasksStream(),       DeadLetterStream(),    TenantFeedStream(),
          AuthEventsStream(),      UsageEventsStream()};
}

Result<void> ApplyStreams(Connection& conn, int replicas) {
  for (auto spec : PlatformStreams()) {
    if (replicas > 0) spec.replicas = replicas;
    if (auto r = EnsureStream(conn, spec); !r.ok()) return r;
  }
  return Ok();
}

namespace {
// The subjects of `spec` the stream `si` does not hold.
std::vector<std::string> MissingSubjects(const jsStreamInfo* si, const StreamSpec& spec) {
  std::vector<std::string> missing;
  for (const auto& want : spec.subjects) {
    bool found = false;
    for (int i = 0; si->Config != nullptr && i < si->Config->SubjectsLen; ++i) {
      found = found || want == si->Config->Subjects[i];
    }
    if (!found) missing.push_back(want);
  }
  return missing;
}
}  // namespace

Result<void> RequireStream(Connection& conn, const StreamSpec& spec,
                           std::chrono::milliseconds wait) {
  const auto deadline = std::chrono::steady_clock::now() + wait;
  bool logged = false;
  for (;;) {
    jsStreamInfo* si = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    natsStatus s = js_GetStreamInfo(&si, conn.js(), spec.name.c_str(), nullptr, &jerr);
    if (s == NATS_OK) {
      const auto missing = MissingSubjects(si, spec);
      jsStreamInfo_Destroy(si);
      if (missing.empty()) return Ok();
      Error e = Error::FailedPrecondition(
          reason::kStreamOutdated,
          fmt::format("stream {} lacks subjects this build uses: run `gpuaasctl streams apply` "
                      "of this release",
                      spec.name));
      e.details["missing"] = fmt::format("{}", fmt::join(missing, ","));
      return e;
    }
    if (s != NATS_NOT_FOUND && jerr != JSStreamNotFoundErr) {
      return JsError(s, jerr, "stream info " + spec.name);
    }
    if (std::chrono::steady_clock::now() >= deadline) {
      return Error::Unavailable(
          reason::kStreamMissing,
          fmt::format("stream {} is not declared: run `gpuaasctl streams apply`", spec.name));
    }
    if (!logged) {
      conn.logger().Warn("waiting for a stream to be declared (gpuaasctl streams apply)",
                         {{"stream", spec.name}});
      logged = true;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
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
StreamSpec TenantFeedStream() {
  return {"GPUAAS_TENANT_FEED", {"gpuaas.v1.tenant.*.evt.>"}, int64_t{7} * 24 * 3600, 600};
}
StreamSpec AuthEventsStream() {
  return {"GPUAAS_EVT_AUTH", {"gpuaas.v1.evt.auth.>"}, int64_t{25} * 3600, 600};
}
StreamSpec UsageEventsStream() { return {"GPUAAS_EVT_USAGE", {"gpuaas.v1.evt.usage.>"}, 0, 600}; }
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
    return Error::NotFound(reason::kNoMessage, "no message for " + subject + " in " + stream);
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

Result<void> SettleMsg(Connection& conn, natsMsg* m, Settle how, int64_t nak_delay_ms) {
  const char* reply = natsMsg_GetReply(m);
  if (reply == nullptr || *reply == '\0') {
    return Error::FailedPrecondition(reason::kNotJetstream, "the message has no ack subject");
  }
  std::string body;
  switch (how) {
    case Settle::kAck:
      body = "+ACK";
      break;
    case Settle::kNak:
      body = nak_delay_ms > 0 ? fmt::format(R"(-NAK {{"delay":{}}})", nak_delay_ms * 1000000)
                              : std::string("-NAK");
      break;
    case Settle::kInProgress:
      body = "+WPI";
      break;
    case Settle::kTerm:
      body = "+TERM";
      break;
  }
  const natsStatus s =
      natsConnection_Publish(conn.raw(), reply, body.data(), static_cast<int>(body.size()));
  if (s != NATS_OK) return NatsError(s, "settle message");
  return Ok();
}

Result<std::unique_ptr<Puller>> Puller::Open(std::shared_ptr<Connection> conn,
                                             const std::string& stream,
                                             const std::string& durable) {
  std::unique_ptr<Puller> p(new Puller());
  p->next_subject_ = fmt::format("$JS.API.CONSUMER.MSG.NEXT.{}.{}", stream, durable);
  p->stream_ = stream;
  p->durable_ = durable;
  p->inbox_ = conn->NewInbox();
  const std::string pattern = p->inbox_ + ".*";
  const natsStatus s = natsConnection_SubscribeSync(&p->sub_, conn->raw(), pattern.c_str());
  if (s != NATS_OK) {
    p->sub_ = nullptr;
    return NatsError(s, "subscribe " + pattern);
  }
  if (auto r = conn->CheckPermitted(pattern, std::chrono::seconds(5)); !r.ok()) return r.error();
  p->conn_ = std::move(conn);
  return p;
}

Puller::~Puller() {
  if (!sub_) return;
  // Messages delivered but never handed out (a prefetch, a late answer to a waiting pull) go
  // back to the server now rather than after the ack wait.
  while (natsMsg* m = Next(0)) {
    const char* status = nullptr;
    if (conn_ && (natsMsgHeader_Get(m, "Status", &status) != NATS_OK || status == nullptr)) {
      (void)SettleMsg(*conn_, m, Settle::kNak);
    }
    natsMsg_Destroy(m);
  }
  natsSubscription_Destroy(sub_);
}

int Puller::Queued() const {
  int queued = 0;
  if (natsSubscription_GetPending(sub_, &queued, nullptr) != NATS_OK) return 0;
  return queued;
}

void Puller::Prefetch(int batch) {
  if (!prefetch_reply_.empty()) return;
  prefetched_ = static_cast<size_t>(std::max(batch, 1));
  prefetch_reply_ = fmt::format("{}.{}", inbox_, ++pulls_);
  const std::string req = fmt::format(R"({{"batch":{},"no_wait":true}})", prefetched_);
  if (natsConnection_PublishRequest(conn_->raw(), next_subject_.c_str(), prefetch_reply_.c_str(),
                                    req.data(), static_cast<int>(req.size())) != NATS_OK) {
    prefetch_reply_.clear();  // the next Fetch pulls as usual
  }
}

natsMsg* Puller::Next(int64_t wait_ms) {
  if (wait_ms <= 0) {
    int queued = 0;
    if (natsSubscription_GetPending(sub_, &queued, nullptr) != NATS_OK || queued <= 0) {
      return nullptr;
    }
    wait_ms = 1;
  }
  natsMsg* m = nullptr;
  if (natsSubscription_NextMsg(&m, sub_, wait_ms) != NATS_OK) return nullptr;
  return m;
}

Puller::Fetched Puller::Fetch(int batch, int64_t timeout_ms) {
  Fetched f;
  const size_t want = static_cast<size_t>(std::max(batch, 1));
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::milliseconds(timeout_ms);
  const auto left_ms = [&] {
    return std::max<int64_t>(0, std::chrono::duration_cast<std::chrono::milliseconds>(
                                    deadline - std::chrono::steady_clock::now())
                                    .count());
  };
  // Takes messages until `want` or the end of the pull `reply`: its status (nats-server ends a
  // no-wait pull at once: 404 when it had nothing, 408 after what it had) or its `pulled`-th
  // message; for "" (what earlier pulls left queued) until nothing is queued. Returns false on
  // a status that ends the pulling (f says why).
  const auto collect = [&](const std::string& reply, size_t pulled, bool* ended) {
    size_t of_reply = 0;
    while (f.msgs.size() < want) {
      natsMsg* m = Next(reply.empty() ? 0 : left_ms());
      if (m == nullptr) return true;
      const std::string subject = natsMsg_GetSubject(m);
      const char* status = nullptr;
      if (natsMsgHeader_Get(m, "Status", &status) != NATS_OK || status == nullptr) {
        f.msgs.push_back(m);  // a message, whichever pull brought it
        if (!reply.empty() && subject == reply && ++of_reply == pulled) {
          *ended = true;
          return true;
        }
        continue;
      }
      const std::string code(status);
      const char* desc = nullptr;
      std::string description;
      if (natsMsgHeader_Get(m, "Description", &desc) == NATS_OK && desc != nullptr) {
        description = desc;
      }
      natsMsg_Destroy(m);
      // 100 is a heartbeat; an earlier pull's status is over already.
      if (code == "100" || reply.empty() || subject != reply) continue;
      if (code == "404" || code == "408") {
        *ended = true;
        return true;
      }
      f.error = fmt::format("{} {} ({})", code, description, next_subject_);
      // 503: nobody answers the consumer's next-message subject; 409 Consumer Deleted.
      f.outcome = (code == "503" || description.find("Deleted") != std::string::npos)
                      ? Outcome::kConsumerGone
                      : Outcome::kError;
      return false;
    }
    return true;
  };
  const auto pull = [&](const std::string& reply, const std::string& req) {
    const natsStatus s =
        natsConnection_PublishRequest(conn_->raw(), next_subject_.c_str(), reply.c_str(),
                                      req.data(), static_cast<int>(req.size()));
    if (s == NATS_OK) return true;
    f.outcome = Outcome::kError;
    f.error = NatsError(s, "pull " + next_subject_).ToString();
    return false;
  };
  const auto finish = [&] {
    // Messages in hand are handled first; a failure that ended the pull shows again next time.
    if (!f.msgs.empty()) {
      f.outcome = Outcome::kMessages;
      f.error.clear();
    }
    return std::move(f);
  };

  bool ended = false;
  // A prefetch is taken first, to its end (its status, or its batch-th message).
  if (!prefetch_reply_.empty()) {
    const std::string reply = std::move(prefetch_reply_);
    prefetch_reply_.clear();
    if (!collect(reply, prefetched_, &ended) || !f.msgs.empty()) return finish();
    ended = false;
  }
  // What an earlier pull left queued comes first.
  if (!collect("", 0, &ended) || !f.msgs.empty()) return finish();
  // What is there now, up to the batch.
  const std::string now_reply = fmt::format("{}.{}", inbox_, ++pulls_);
  if (!pull(now_reply, fmt::format(R"({{"batch":{},"no_wait":true}})", want))) return finish();
  if (!collect(now_reply, want, &ended) || !f.msgs.empty()) return finish();
  if (!ended) {
    // A live consumer answers a no-wait pull at once (404 when it has nothing): silence means
    // the consumer is gone (nats-server 2.9 does not answer a pull of a deleted consumer) or
    // the server is slow; its info says which.
    jsConsumerInfo* ci = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    const natsStatus is =
        js_GetConsumerInfo(&ci, conn_->js(), stream_.c_str(), durable_.c_str(), nullptr, &jerr);
    if (ci != nullptr) jsConsumerInfo_Destroy(ci);
    if (is != NATS_OK && jerr == JSConsumerNotFoundErr) {
      f.outcome = Outcome::kConsumerGone;
      f.error = "consumer " + stream_ + "/" + durable_ + " not found";
    }
    return finish();
  }
  // Nothing now: one waiting pull for the next message, for one message so that it is over once
  // that came. The server ends it a little before this fetch stops waiting (its 408 comes
  // back here); a message it brings after all is queued for the next fetch. (A pull that
  // outlived the fetch, for fewer pulls from an idle consumer, delayed deliveries by seconds
  // with nats-server 2.9.10: SagaFlowTest missed its 3 s deadlines.)
  const int64_t left = left_ms();
  if (left <= 0) return finish();
  const std::string wait_reply = fmt::format("{}.{}", inbox_, ++pulls_);
  if (!pull(wait_reply, fmt::format(R"({{"batch":1,"expires":{}}})",
                                    (left >= 20 ? left - 10 : left) * int64_t{1000000}))) {
    return finish();
  }
  ended = false;
  collect(wait_reply, 1, &ended);
  return finish();
}

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
  puller_.reset();
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
  auto puller = Puller::Open(conn_, spec_.stream, spec_.durable);
  if (!puller.ok()) return puller.error();
  puller_ = std::move(*puller);
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
  puller_.reset();
}

Result<void> DeleteConsumer(Connection& conn, const std::string& stream,
                            const std::string& durable) {
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_DeleteConsumer(conn.js(), stream.c_str(), durable.c_str(), nullptr, &jerr);
  if (s != NATS_OK && jerr != JSConsumerNotFoundErr) {
    return JsError(s, jerr, "delete consumer " + durable);
  }
  return Ok();
}

Result<void> Consumer::DeleteDurable() {
  return DeleteConsumer(*conn_, spec_.stream, spec_.durable);
}

Result<uint64_t> Consumer::Backlog() {
  return ConsumerBacklog(*conn_, spec_.stream, spec_.durable);
}

Result<uint64_t> ConsumerBacklog(Connection& conn, const std::string& stream,
                                 const std::string& durable) {
  jsConsumerInfo* ci = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s =
      js_GetConsumerInfo(&ci, conn.js(), stream.c_str(), durable.c_str(), nullptr, &jerr);
  if (s != NATS_OK) return JsError(s, jerr, "consumer info " + durable);
  uint64_t n = ci->NumPending + static_cast<uint64_t>(ci->NumAckPending);
  jsConsumerInfo_Destroy(ci);
  return n;
}

Result<std::vector<std::string>> ConsumerNames(Connection& conn, const std::string& stream) {
  jsConsumerNamesList* list = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_ConsumerNames(&list, conn.js(), stream.c_str(), nullptr, &jerr);
  // A stream without consumers answers NATS_NOT_FOUND.
  if (s == NATS_NOT_FOUND) return std::vector<std::string>{};
  if (s != NATS_OK) return JsError(s, jerr, "consumer names of " + stream);
  std::vector<std::string> names(list->List, list->List + list->Count);
  jsConsumerNamesList_Destroy(list);
  return names;
}

void Consumer::KeepAlive() {
  const auto every = std::chrono::milliseconds(std::max<int64_t>(spec_.ack_wait_ms / 3, 10));
  std::unique_lock lock(ka_mu_);
  while (!stop_) {
    ka_cv_.wait_for(lock, every, [&] { return stop_.load(); });
    if (stop_) break;
    // Under ka_mu_: the fetch loop removes a message from inflight_ before it disposes of it.
    for (natsMsg* m : inflight_) {
      if (!SettleMsg(*conn_, m, Settle::kInProgress).ok()) {
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
    Puller* puller = nullptr;
    {
      std::lock_guard lock(mu_);
      puller = puller_.get();
    }
    if (!puller) {
      if (auto r = Subscribe(); !r.ok()) {
        log_.Warn("consumer resubscribe failed", {{"error", r.error().ToString()}});
        std::this_thread::sleep_for(std::chrono::milliseconds(error_backoff_ms));
        error_backoff_ms = std::min<int64_t>(error_backoff_ms * 2, 2000);
      }
      continue;
    }
    SampleLag();
    Puller::Fetched fetched = puller->Fetch(spec_.batch, spec_.fetch_timeout_ms);
    if (fetched.outcome == Puller::Outcome::kTimeout) continue;
    if (fetched.outcome != Puller::Outcome::kMessages) {
      if (!stop_) {
        log_.Warn("consumer fetch failed", {{"error", fetched.error}});
        if (fetched.outcome == Puller::Outcome::kConsumerGone) {
          // Declared again (or waited for, when someone else manages it) by the next Subscribe.
          std::lock_guard lock(mu_);
          puller_.reset();
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(error_backoff_ms));
        error_backoff_ms = std::min<int64_t>(error_backoff_ms * 2, 2000);
      }
      continue;
    }
    error_backoff_ms = 100;
    const std::vector<natsMsg*>& batch = fetched.msgs;
    // A full batch says there is a backlog: its next batch travels while this one is handled.
    if (spec_.prefetch && !spec_.keepalive && !stop_ &&
        batch.size() == static_cast<size_t>(spec_.batch)) {
      puller->Prefetch(spec_.batch);
    }
    if (spec_.keepalive) {
      std::lock_guard lock(ka_mu_);
      inflight_ = batch;
    }
    std::vector<Delivery> deliveries;
    deliveries.reserve(batch.size());
    for (natsMsg* m : batch) deliveries.push_back(ToDelivery(m));
    // The batch handler's answers; a kRetry (or none) sends a message to the one-message path.
    std::vector<HandlerResult> first;
    if (batch_handler_ && batch.size() > 1 && !stop_) {
      std::lock_guard lock(handler_mu_);
      try {
        first = batch_handler_(deliveries);
      } catch (const std::exception& e) {
        log_.Warn("batch handler threw; handling one by one", {{"error", e.what()}});
        first.clear();
      }
      if (first.size() != batch.size()) first.clear();
    }
    for (size_t i = 0; i < batch.size(); ++i) {
      natsMsg* m = batch[i];
      const Delivery& d = deliveries[i];
      if (!stop_ && !first.empty() && first[i].disposition != Disposition::kRetry) {
        if (spec_.keepalive) {
          std::lock_guard lock(ka_mu_);
          inflight_.erase(std::remove(inflight_.begin(), inflight_.end(), m), inflight_.end());
        }
        Dispose(m, d, first[i]);
        continue;
      }
      if (stop_) {
        // Stopping: what is not handled yet goes back to the server now, for the next consumer.
        (void)SettleMsg(*conn_, m, Settle::kNak);
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
        WaitHoldingBatch(batch, i, delay);
      }
      if (spec_.keepalive) {
        std::lock_guard lock(ka_mu_);
        inflight_.erase(std::remove(inflight_.begin(), inflight_.end(), m), inflight_.end());
      }
      if (r.disposition == Disposition::kRetry) {
        (void)SettleMsg(*conn_, m, Settle::kNak);  // stopping mid-retry: another consumer takes it
        continue;
      }
      Dispose(m, d, r);
    }
    if (spec_.keepalive) {
      std::lock_guard lock(ka_mu_);
      inflight_.clear();
    }
    for (natsMsg* m : batch) natsMsg_Destroy(m);
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

void Consumer::WaitHoldingBatch(const std::vector<natsMsg*>& batch, size_t from, int64_t delay_ms) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::milliseconds(delay_ms);
  const auto every = std::chrono::milliseconds(std::max<int64_t>(spec_.ack_wait_ms / 3, 10));
  std::unique_lock lock(ka_mu_);
  while (!stop_) {
    const auto now = std::chrono::steady_clock::now();
    if (now >= until) break;
    if (delay_ms >= spec_.ack_wait_ms / 3) {
      for (size_t j = from; j < batch.size(); ++j) {
        (void)SettleMsg(*conn_, batch[j], Settle::kInProgress);
      }
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
    (void)SettleMsg(*conn_, m, Settle::kAck);
    last_acked_ = d.stream_sequence;
    if (metrics_->acked) metrics_->acked->Increment();
    return;
  }
  const std::string kind = r.kind.empty() ? kRejectPermanent : r.kind;
  fields.emplace_back("reason", r.reason);
  fields.emplace_back("kind", kind);
  if (!DeadLetter(d, r)) {
    // Not stored in the dead-letter stream: the message stays where it is, to be tried again.
    (void)SettleMsg(*conn_, m, Settle::kNak, 1000);
    return;
  }
  log_.Error("event dead-lettered", fields);
  (void)SettleMsg(*conn_, m, Settle::kTerm);
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
