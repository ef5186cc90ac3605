#include "gpuaas/common/dlq.hpp"

#include <algorithm>
#include <cctype>
#include <regex>

#include <fmt/format.h>

#include "gpuaas/common/access.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/event.pb.h"

namespace gpuaas::dlq {

namespace {

Error JsFailure(natsStatus s, jsErrCode jerr, const std::string& what) {
  Error e = messaging::NatsError(s, what);
  if (jerr != 0) e.details["js_err_code"] = std::to_string(static_cast<int>(jerr));
  return e;
}

Error NotFound(uint64_t sequence) {
  return Error::NotFound(reason::kDeadLetterNotFound,
                         fmt::format("no dead letter at sequence {} of {}", sequence, kStream));
}

bool Missing(natsStatus s, jsErrCode jerr) {
  return s == NATS_NOT_FOUND || jerr == JSNoMessageFoundErr || jerr == JSStreamNotFoundErr;
}

// Token `i` of gpuaas.v1.dlq.<stream>.<consumer>.
std::string SubjectToken(const std::string& subject, size_t i) {
  auto t = access::SubjectTokens(subject);
  return t.size() == 5 && i < t.size() ? t[i] : std::string();
}

// The reply's outcome from what the consumer's handler said.
v1::ReplayDeadLetterResponse FromHandler(const messaging::HandlerResult& r, bool duplicate) {
  v1::ReplayDeadLetterResponse resp;
  switch (r.disposition) {
    case messaging::Disposition::kAck:
      resp.set_outcome(duplicate ? v1::REPLAY_OUTCOME_DUPLICATE : v1::REPLAY_OUTCOME_APPLIED);
      break;
    case messaging::Disposition::kRetry:
      resp.set_outcome(v1::REPLAY_OUTCOME_RETRY_LATER);
      break;
    case messaging::Disposition::kReject:
      resp.set_outcome(v1::REPLAY_OUTCOME_REJECTED);
      resp.set_kind(r.kind.empty() ? messaging::kRejectPermanent : r.kind);
      break;
  }
  resp.set_reason(r.reason);
  return resp;
}

// Whether the consumer's inbox already holds the event (ProjectionHandler records (durable,
// event id) with the effect): its replay is then a duplicate, acked without applying anything.
bool AlreadyApplied(store::Pool* pool, const std::string& durable, const std::string& payload) {
  v1::Event ev;
  if (pool == nullptr || !ev.ParseFromString(payload) || !ids::IsUuid(ev.id())) return false;
  auto r = store::WithTx(*pool, [&](pqxx::work& tx) -> Result<bool> {
    auto rows = tx.exec_params("SELECT 1 FROM inbox WHERE consumer = $1 AND event_id = $2", durable,
                               ev.id());
    return !rows.empty();
  });
  return r.ok() && *r;
}

// A contract operation lets `service` send on `subject`.
bool MaySend(const access::Contract& c, const std::string& service, const std::string& subject) {
  for (const auto& op : c.operations) {
    if (op.action != "send" || op.reply) continue;
    if (std::find(op.roles.begin(), op.roles.end(), service) == op.roles.end()) continue;
    std::string pattern;
    for (const auto& t : access::SubjectTokens(op.address)) {
      pattern += (pattern.empty() ? "" : ".") + (t.find('{') != std::string::npos ? "*" : t);
    }
    if (access::SubjectMatches(pattern, subject)) return true;
  }
  return false;
}

// Whether `service` manages (and does not consume) the durable `consumer` on `stream`.
bool Manages(const access::Contract& c, const std::string& service, const std::string& stream,
             const std::string& consumer) {
  for (const auto& op : c.operations) {
    for (const auto& k : op.consumers) {
      if (k.managed_by == service && k.stream == stream && DurableMatches(k.durable, consumer)) {
        return true;
      }
    }
  }
  return false;
}

Result<v1::ReplayDeadLetterResponse> Replay(const ReplayDeps& deps,
                                            const v1::ReplayDeadLetterRequest& req,
                                            rpc::Context& ctx) {
  if (req.dlq_sequence() == 0) {
    return Error::InvalidArgument(reason::kDlqSequenceRequired,
                                  "dlq_sequence: the dead letter's sequence in GPUAAS_DLQ");
  }
  auto entry = Get(*deps.nats, req.dlq_sequence());
  if (!entry.ok()) return entry.error();
  v1::DeadLetter dl;
  if (!dl.ParseFromString(entry->data) || dl.consumer().empty() || dl.subject().empty()) {
    return Error::FailedPrecondition(
        reason::kDeadLetterMalformed,
        fmt::format("GPUAAS_DLQ sequence {} is not a gpuaas.v1.DeadLetter", entry->sequence));
  }
  messaging::Headers headers(dl.headers().begin(), dl.headers().end());
  v1::ReplayDeadLetterResponse resp;
  if (messaging::Consumer* consumer = deps.find(dl.consumer());
      consumer != nullptr && consumer->spec().stream == dl.stream()) {
    const bool duplicate = AlreadyApplied(deps.pool.get(), dl.consumer(), dl.payload());
    messaging::Delivery d;
    d.msg.subject = dl.subject();
    d.msg.data = dl.payload();
    d.msg.headers = headers;
    d.stream_sequence = dl.stream_sequence();
    d.num_delivered = dl.deliveries() + 1;
    resp = FromHandler(consumer->Replay(d), duplicate);
  } else if (const auto& c = access::EmbeddedContract();
             Manages(c, deps.service, dl.stream(), dl.consumer()) &&
             MaySend(c, deps.service, dl.subject())) {
    // Its consumer is not a service (a node's agent): put the task back on its subject. The
    // agent de-duplicates by task id; a new message id so the stream takes it again.
    headers.erase(messaging::kHeaderMsgId);
    auto ack = messaging::JsPublish(*deps.nats, dl.subject(), dl.payload(),
                                    fmt::format("replay:{}", entry->sequence), headers);
    if (!ack.ok()) return ack.error();
    resp.set_outcome(v1::REPLAY_OUTCOME_REPUBLISHED);
    resp.set_republished_sequence(ack->sequence);
  } else {
    Error e = Error::NotFound(
        reason::kConsumerNotOwned,
        fmt::format("{} neither runs nor manages consumer {} on {}: replay it through the "
                    "service the contract names for it",
                    deps.service, dl.consumer(), dl.stream()));
    e.details = {{"consumer", dl.consumer()}, {"stream", dl.stream()}};
    return e;
  }
  resp.set_dlq_sequence(entry->sequence);
  resp.set_stream(dl.stream());
  resp.set_consumer(dl.consumer());
  resp.set_subject(dl.subject());
  ctx.log.Info("dead letter replayed", {{"dlq_sequence", std::to_string(entry->sequence)},
                                        {"consumer", dl.consumer()},
                                        {"stream_sequence", std::to_string(dl.stream_sequence())},
                                        {"outcome", v1::ReplayOutcome_Name(resp.outcome())},
                                        {"reason", resp.reason()}});
  return resp;
}

}  // namespace

std::string ReplaySubject(const std::string& service) {
  return fmt::format("gpuaas.v1.{}.dlq.replay", service);
}

std::string Entry::Stream() const { return SubjectToken(subject, 3); }
std::string Entry::Consumer() const { return SubjectToken(subject, 4); }

Result<Entry> Get(messaging::Connection& conn, uint64_t sequence) {
  natsMsg* m = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_GetMsg(&m, conn.js(), kStream, sequence, nullptr, &jerr);
  if (Missing(s, jerr)) return NotFound(sequence);
  if (s != NATS_OK) return JsFailure(s, jerr, fmt::format("get {} {}", kStream, sequence));
  Entry e;
  e.sequence = natsMsg_GetSequence(m);
  e.subject = natsMsg_GetSubject(m);
  e.data.assign(natsMsg_GetData(m), static_cast<size_t>(natsMsg_GetDataLength(m)));
  natsMsg_Destroy(m);
  return e;
}

Result<std::vector<Entry>> ListNewest(messaging::Connection& conn, const std::string& stream,
                                      const std::string& consumer, size_t limit) {
  std::vector<Entry> out;
  jsStreamInfo* si = nullptr;
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_GetStreamInfo(&si, conn.js(), kStream, nullptr, &jerr);
  if (Missing(s, jerr)) return out;  // nothing was ever dead-lettered
  if (s != NATS_OK) return JsFailure(s, jerr, std::string("stream info ") + kStream);
  const uint64_t first = si->State.FirstSeq;
  const uint64_t last = si->State.LastSeq;
  const bool empty = si->State.Msgs == 0;
  jsStreamInfo_Destroy(si);
  if (empty) return out;
  // Newest first; discarded sequences are gaps.
  for (uint64_t seq = last; seq >= std::max<uint64_t>(first, 1) && out.size() < limit; --seq) {
    auto e = Get(conn, seq);
    if (!e.ok()) {
      if (e.error().code == Code::kNotFound) continue;
      return e.error();
    }
    if ((stream.empty() || e->Stream() == stream) &&
        (consumer.empty() || e->Consumer() == consumer)) {
      out.push_back(std::move(*e));
    }
  }
  return out;
}

Result<void> Delete(messaging::Connection& conn, uint64_t sequence) {
  // Deleting a missing sequence fails with a generic error: say NOT_FOUND instead.
  if (auto e = Get(conn, sequence); !e.ok()) return e.error();
  jsErrCode jerr = static_cast<jsErrCode>(0);
  natsStatus s = js_DeleteMsg(conn.js(), kStream, sequence, nullptr, &jerr);
  if (Missing(s, jerr)) return NotFound(sequence);
  if (s != NATS_OK) return JsFailure(s, jerr, fmt::format("delete {} {}", kStream, sequence));
  return Ok();
}

bool DurableMatches(const std::string& pattern, const std::string& durable) {
  static const std::regex kParam(R"(\{[^}]*\})");
  std::string re;
  size_t at = 0;
  for (auto it = std::sregex_iterator(pattern.begin(), pattern.end(), kParam);
       it != std::sregex_iterator(); ++it) {
    for (size_t i = at; i < static_cast<size_t>(it->position()); ++i) {
      re += std::isalnum(static_cast<unsigned char>(pattern[i])) != 0
                ? std::string(1, pattern[i])
                : std::string("\\") + pattern[i];
    }
    re += "[^.]+";
    at = static_cast<size_t>(it->position() + it->length());
  }
  for (size_t i = at; i < pattern.size(); ++i) {
    re += std::isalnum(static_cast<unsigned char>(pattern[i])) != 0
              ? std::string(1, pattern[i])
              : std::string("\\") + pattern[i];
  }
  return std::regex_match(durable, std::regex(re));
}

Result<std::string> ReplayServiceOf(const access::Contract& c, const std::string& stream,
                                    const std::string& consumer) {
  for (const auto& op : c.operations) {
    for (const auto& k : op.consumers) {
      if ((!stream.empty() && k.stream != stream) || !DurableMatches(k.durable, consumer)) {
        continue;
      }
      auto role = c.roles.find(k.role);
      if (role != c.roles.end() && role->second.kind == access::Kind::kService) return k.role;
      if (!k.managed_by.empty()) return k.managed_by;
    }
  }
  Error e = Error::NotFound(reason::kConsumerUnknown, "the contract declares no durable consumer " +
                                                          consumer +
                                                          (stream.empty() ? "" : " on " + stream));
  e.details = {{"consumer", consumer}};
  return e;
}

void ServeReplay(rpc::Server& server, ReplayDeps deps) {
  const std::string subject = ReplaySubject(deps.service);
  const auto& c = access::EmbeddedContract();
  const bool declared = std::any_of(c.operations.begin(), c.operations.end(), [&](const auto& op) {
    return op.reply && op.address == subject &&
           std::find(op.roles.begin(), op.roles.end(), deps.service) != op.roles.end();
  });
  if (!declared) return;
  server.Handle<v1::ReplayDeadLetterRequest, v1::ReplayDeadLetterResponse>(
      subject, [deps = std::move(deps)](const v1::ReplayDeadLetterRequest& req, rpc::Context& ctx) {
        return Replay(deps, req, ctx);
      });
}

}  // namespace gpuaas::dlq
