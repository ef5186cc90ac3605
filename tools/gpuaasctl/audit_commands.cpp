// gpuaasctl audit allocation|slot|node --id ID: an entity's whole history replayed from the event
// streams (the streams are the audit log: this reads no service and no database). Every stored
// event of every event stream is read with $JS.API.STREAM.MSG.GET (what a read_streams role is
// granted; no consumer is created), pipelined; an event is about the entity when its envelope
// names it (subject, correlation id, a node's own subject) or when its payload does: payloads are
// decoded by their type URL from the descriptor pool and searched by reflection for
// allocation_id / node_id / slot_id and slot_key(s) under the node they belong to, so new event
// types are covered without a change here. Events are merged by event time (then stream,
// sequence); each line says what changed against the previous snapshot of the same entity.
#include <google/protobuf/descriptor.h>
#include <google/protobuf/dynamic_message.h>
#include <google/protobuf/util/message_differencer.h>
#include <google/protobuf/util/time_util.h>
#include <nats/nats.h>

#include <algorithm>
#include <chrono>
#include <ctime>
#include <iostream>
#include <map>
#include <memory>
#include <optional>
#include <random>
#include <regex>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "ctl.hpp"
#include "ctl_reasons.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/proto_json.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/node.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "gpuaas/v1/topology.pb.h"

namespace gpuaas::ctl {

namespace {

namespace pb = google::protobuf;
using json = nlohmann::ordered_json;

// Links every contract file's generated code into the binary, so the generated descriptor pool
// can decode any event payload by its type URL (a static library's unreferenced objects would
// otherwise be left out).
const std::vector<const pb::Descriptor*>& ContractFiles() {
  static const std::vector<const pb::Descriptor*> files = {v1::Event::descriptor(),
                                                           v1::NodeSnapshot::descriptor(),
                                                           v1::SlotReservation::descriptor(),
                                                           v1::NodeTask::descriptor(),
                                                           v1::AllocationSnapshot::descriptor(),
                                                           v1::ExposureSnapshot::descriptor(),
                                                           v1::ConsoleSessionEvent::descriptor(),
                                                           v1::TopologyReport::descriptor()};
  return files;
}

// The streams replayed: every event stream (not the task stream, not the dead letters).
std::vector<std::string> EventStreams() {
  return {messaging::InventoryEventsStream().name, messaging::SchedulerEventsStream().name,
          messaging::IpamEventsStream().name,      messaging::IngressEventsStream().name,
          messaging::ConsoleEventsStream().name,   messaging::NodeEventsStream().name};
}

enum class Kind { kAllocation, kSlot, kNode };

struct Target {
  Kind kind = Kind::kAllocation;
  std::string id;
  std::string node;      // slot: its node
  std::string slot_key;  // slot: its key within the node
  std::string Noun() const {
    return kind == Kind::kAllocation ? "allocation" : kind == Kind::kSlot ? "slot" : "node";
  }
};

// One stored message of a stream.
struct Stored {
  std::string stream;
  uint64_t seq = 0;
  std::string subject;  // the NATS subject
  std::string data;
  pb::Timestamp time;  // when the stream stored it
};

struct Change {
  std::string field, from, to;
};

// One event of the history.
struct Record {
  Stored msg;
  v1::Event ev;
  pb::Timestamp time;                    // the event's time (else the stream's)
  std::unique_ptr<pb::Message> payload;  // Event.data decoded; null when its type is unknown
  std::vector<Change> changes;
  std::string reason;
  std::string summary;
};

// ---- Reading the streams ----

std::string Base64Decode(const std::string& in) {
  static const std::string kAlphabet =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
  std::string out;
  out.reserve(in.size() * 3 / 4);
  uint32_t acc = 0;
  int bits = 0;
  for (char c : in) {
    const size_t v = kAlphabet.find(c);
    if (v == std::string::npos) continue;  // '=' padding, line breaks
    acc = (acc << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      bits -= 8;
      out.push_back(static_cast<char>((acc >> bits) & 0xff));
    }
  }
  return out;
}

// The JetStream API's error in `reply`, if it has one (err_code: nats-server's JSErrCode).
struct ApiError {
  int code = 0;
  int err_code = 0;
  std::string description;
};
std::optional<ApiError> JsApiError(const json& reply) {
  if (!reply.contains("error")) return std::nullopt;
  const auto& e = reply["error"];
  return ApiError{e.value("code", 0), e.value("err_code", 0), e.value("description", "")};
}

constexpr int kJsStreamNotFound = 10059;
constexpr int kJsNoMessageFound = 10037;
// Requests in flight per stream while reading it.
constexpr size_t kWindow = 128;

// Reads every message `stream` holds (as of its state when the read starts) with pipelined
// $JS.API.STREAM.MSG.GET requests, answered on this identity's inbox. A stream that does not
// exist yet is empty; sequences that were deleted are skipped.
Result<std::vector<Stored>> ReadStream(messaging::Connection& conn, const std::string& inbox_prefix,
                                       const std::string& stream,
                                       std::chrono::milliseconds timeout) {
  natsConnection* nc = conn.raw();
  static std::mt19937_64 rng(std::random_device{}());
  const std::string inbox = fmt::format("{}.audit{:016x}", inbox_prefix, rng());
  natsSubscription* sub = nullptr;
  natsStatus s = natsConnection_SubscribeSync(&sub, nc, (inbox + ".*").c_str());
  if (s != NATS_OK) return messaging::NatsError(s, "subscribe " + inbox);
  std::unique_ptr<natsSubscription, void (*)(natsSubscription*)> guard(sub,
                                                                       &natsSubscription_Destroy);
  (void)natsSubscription_SetPendingLimits(sub, -1, -1);

  // Waits for the next reply on the inbox; `what` names the request in errors.
  auto next = [&](const std::string& what, std::string* reply_subject) -> Result<json> {
    natsMsg* m = nullptr;
    natsStatus st = natsSubscription_NextMsg(&m, sub, timeout.count());
    if (st != NATS_OK) return messaging::NatsError(st, what);
    *reply_subject = natsMsg_GetSubject(m);
    json body = json::parse(natsMsg_GetData(m), natsMsg_GetData(m) + natsMsg_GetDataLength(m),
                            nullptr, false);
    natsMsg_Destroy(m);
    if (body.is_discarded()) {
      return Error::Internal(reason::kMalformedJsReply, what + ": the reply is not JSON");
    }
    return body;
  };

  // The stream's sequence range.
  const std::string info_subject = "$JS.API.STREAM.INFO." + stream;
  s = natsConnection_PublishRequestString(nc, info_subject.c_str(), (inbox + ".info").c_str(), "");
  if (s != NATS_OK) return messaging::NatsError(s, "stream info " + stream);
  // A subject this identity may not use is dropped by the server with an error, not answered:
  // say so instead of waiting out the timeout.
  if (auto p = conn.CheckPermitted(info_subject, timeout); !p.ok()) return p.error();
  std::string from;
  auto info = next("stream info " + stream, &from);
  if (!info.ok()) return info.error();
  if (auto e = JsApiError(*info)) {
    if (e->err_code == kJsStreamNotFound) return std::vector<Stored>{};
    return Error::Unavailable(reason::kStreamInfoFailed,
                              fmt::format("stream info {}: {}", stream, e->description));
  }
  const auto& state = (*info)["state"];
  const uint64_t first = state.value("first_seq", uint64_t{0});
  const uint64_t last = state.value("last_seq", uint64_t{0});
  std::vector<Stored> out;
  if (state.value("messages", uint64_t{0}) == 0 || last < first) return out;
  out.reserve(last - first + 1);

  const std::string get_subject = "$JS.API.STREAM.MSG.GET." + stream;
  uint64_t to_send = std::max<uint64_t>(first, 1);
  size_t in_flight = 0;
  auto send = [&]() -> Result<void> {
    const std::string body = fmt::format("{{\"seq\":{}}}", to_send);
    natsStatus st = natsConnection_PublishRequestString(
        nc, get_subject.c_str(), fmt::format("{}.{}", inbox, to_send).c_str(), body.c_str());
    if (st != NATS_OK) return messaging::NatsError(st, "message get " + stream);
    ++to_send;
    ++in_flight;
    return Ok();
  };
  while (in_flight < kWindow && to_send <= last) {
    if (auto r = send(); !r.ok()) return r.error();
  }
  if (auto p = conn.CheckPermitted(get_subject, timeout); !p.ok()) return p.error();
  while (in_flight > 0) {
    std::string reply_subject;
    auto body = next("message get " + stream, &reply_subject);
    if (!body.ok()) return body.error();
    --in_flight;
    if (auto e = JsApiError(*body)) {
      // A deleted message leaves a gap in the sequence.
      if (e->err_code != kJsNoMessageFound) {
        return Error::Unavailable(reason::kMessageGetFailed,
                                  fmt::format("message get {}: {}", stream, e->description));
      }
    } else {
      const auto& m = (*body)["message"];
      Stored st;
      st.stream = stream;
      st.seq = m.value("seq", uint64_t{0});
      st.subject = m.value("subject", "");
      st.data = Base64Decode(m.value("data", ""));
      (void)pb::util::TimeUtil::FromString(m.value("time", ""), &st.time);
      out.push_back(std::move(st));
    }
    if (to_send <= last) {
      if (auto r = send(); !r.ok()) return r.error();
    }
  }
  return out;
}

// ---- Decoding and matching ----

std::unique_ptr<pb::Message> Unpack(const pb::Any& any) {
  const std::string& url = any.type_url();
  const std::string name = url.substr(url.rfind('/') + 1);
  const pb::Descriptor* d = pb::DescriptorPool::generated_pool()->FindMessageTypeByName(name);
  if (d == nullptr) return nullptr;
  const pb::Message* proto = pb::MessageFactory::generated_factory()->GetPrototype(d);
  if (proto == nullptr) return nullptr;
  std::unique_ptr<pb::Message> m(proto->New());
  if (!m->ParseFromString(any.value())) return nullptr;
  return m;
}

bool IsAny(const pb::Descriptor* d) { return d->full_name() == "google.protobuf.Any"; }

// Whether a string field `name` = `value`, inside a message whose nearest node is `node`,
// names the target.
bool Names(const Target& t, const std::string& name, const std::string& value,
           const std::string& node) {
  switch (t.kind) {
    case Kind::kAllocation:
      return name == "allocation_id" && value == t.id;
    case Kind::kNode:
      return name == "node_id" && value == t.id;
    case Kind::kSlot:
      return (name == "slot_id" && value == t.id) ||
             ((name == "slot_key" || name == "slot_keys") && value == t.slot_key && node == t.node);
  }
  return false;
}

// Whether `m` (or anything nested in it, Any included) names the target. `node` is the node_id
// of the nearest enclosing message that has one: a slot key means that node's slot.
bool Mentions(const pb::Message& m, const Target& t, const std::string& outer_node, int depth) {
  if (depth > 32) return false;
  const pb::Descriptor* d = m.GetDescriptor();
  const pb::Reflection* r = m.GetReflection();
  std::string node = outer_node;
  if (const auto* f = d->FindFieldByName("node_id");
      f != nullptr && f->type() == pb::FieldDescriptor::TYPE_STRING && !f->is_repeated()) {
    const std::string v = r->GetString(m, f);
    if (!v.empty()) node = v;
  }
  std::vector<const pb::FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const auto* f : fields) {
    if (f->type() == pb::FieldDescriptor::TYPE_STRING) {
      if (!f->is_repeated()) {
        if (Names(t, f->name(), r->GetString(m, f), node)) return true;
        continue;
      }
      for (int i = 0; i < r->FieldSize(m, f); ++i) {
        if (Names(t, f->name(), r->GetRepeatedString(m, f, i), node)) return true;
      }
    } else if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      const int n = f->is_repeated() ? r->FieldSize(m, f) : 1;
      for (int i = 0; i < n; ++i) {
        const pb::Message& sub =
            f->is_repeated() ? r->GetRepeatedMessage(m, f, i) : r->GetMessage(m, f);
        if (IsAny(sub.GetDescriptor())) {
          pb::Any any;
          any.CopyFrom(sub);
          auto inner = Unpack(any);
          if (inner && Mentions(*inner, t, node, depth + 1)) return true;
        } else if (Mentions(sub, t, node, depth + 1)) {
          return true;
        }
      }
    }
  }
  return false;
}

// Whether the event is about the target: its envelope names it, or its payload does.
bool About(const Record& rec, const Target& t) {
  const v1::Event& ev = rec.ev;
  if (ev.subject() == t.id || ev.correlation_id() == t.id) return true;
  if (t.kind == Kind::kNode) {
    // The node's slots ("<node>/<slot key>") and what its agent reports on its own subjects.
    if (ev.subject().rfind(t.id + "/", 0) == 0) return true;
    if (rec.msg.subject.rfind("gpuaas.v1.evt.node." + t.id + ".", 0) == 0) return true;
  }
  return rec.payload != nullptr && Mentions(*rec.payload, t, "", 0);
}

// ---- What changed ----

// The entity a snapshot event carries (AllocationSnapshot.allocation, SlotSnapshot.slot, ...):
// field 1 of a *Snapshot payload; nullptr for other payloads (reports, tasks, results: each
// stands alone, there is no earlier version to compare with).
const pb::Message* Entity(const pb::Message& payload) {
  const pb::Descriptor* d = payload.GetDescriptor();
  const std::string& name = d->name();
  const pb::FieldDescriptor* f = d->FindFieldByNumber(1);
  if (name.size() > 8 && name.compare(name.size() - 8, 8, "Snapshot") == 0 && f != nullptr &&
      f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE && !f->is_repeated() &&
      payload.GetReflection()->HasField(payload, f)) {
    return &payload.GetReflection()->GetMessage(payload, f);
  }
  return nullptr;
}

std::string Clip(std::string s, size_t n = 48) {
  if (s.size() > n) s = s.substr(0, n - 3) + "...";
  return s;
}

std::string ScalarText(const pb::Message& m, const pb::FieldDescriptor* f, int index = -1) {
  const pb::Reflection* r = m.GetReflection();
  const bool rep = index >= 0;
  switch (f->cpp_type()) {
    case pb::FieldDescriptor::CPPTYPE_STRING:
      if (f->type() == pb::FieldDescriptor::TYPE_BYTES) return "<bytes>";
      return Clip(rep ? r->GetRepeatedString(m, f, index) : r->GetString(m, f));
    case pb::FieldDescriptor::CPPTYPE_ENUM: {
      const int v = rep ? r->GetRepeatedEnumValue(m, f, index) : r->GetEnumValue(m, f);
      const std::string& text = enums::TextOf(f->enum_type(), v);
      return text.empty() ? (v == 0 ? "" : std::to_string(v)) : text;
    }
    case pb::FieldDescriptor::CPPTYPE_BOOL:
      return (rep ? r->GetRepeatedBool(m, f, index) : r->GetBool(m, f)) ? "true" : "false";
    case pb::FieldDescriptor::CPPTYPE_INT32:
      return std::to_string(rep ? r->GetRepeatedInt32(m, f, index) : r->GetInt32(m, f));
    case pb::FieldDescriptor::CPPTYPE_INT64:
      return std::to_string(rep ? r->GetRepeatedInt64(m, f, index) : r->GetInt64(m, f));
    case pb::FieldDescriptor::CPPTYPE_UINT32:
      return std::to_string(rep ? r->GetRepeatedUInt32(m, f, index) : r->GetUInt32(m, f));
    case pb::FieldDescriptor::CPPTYPE_UINT64:
      return std::to_string(rep ? r->GetRepeatedUInt64(m, f, index) : r->GetUInt64(m, f));
    case pb::FieldDescriptor::CPPTYPE_DOUBLE:
      return fmt::format("{}", rep ? r->GetRepeatedDouble(m, f, index) : r->GetDouble(m, f));
    case pb::FieldDescriptor::CPPTYPE_FLOAT:
      return fmt::format("{}", rep ? r->GetRepeatedFloat(m, f, index) : r->GetFloat(m, f));
    case pb::FieldDescriptor::CPPTYPE_MESSAGE:
      break;
  }
  return "";
}

bool IsTimestamp(const pb::Descriptor* d) { return d->full_name() == "google.protobuf.Timestamp"; }

// A message in a few words: a time as text, else its first set scalar fields (k=v).
std::string Short(const pb::Message& m) {
  if (IsTimestamp(m.GetDescriptor())) {
    pb::Timestamp t;
    t.CopyFrom(m);
    return Time(t);
  }
  std::vector<const pb::FieldDescriptor*> fields;
  m.GetReflection()->ListFields(m, &fields);
  std::vector<std::string> parts;
  for (const auto* f : fields) {
    if (f->is_repeated() || f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) continue;
    parts.push_back(f->name() + "=" + ScalarText(m, f));
    if (parts.size() == 3) break;
  }
  return parts.empty() ? "set" : Join(parts, " ");
}

// A field's value in a few words: scalars as text, a repeated scalar as [a,b], a message by
// Short, a repeated message by its count.
std::string ValueText(const pb::Message& m, const pb::FieldDescriptor* f) {
  const pb::Reflection* r = m.GetReflection();
  if (f->is_repeated()) {
    const int n = r->FieldSize(m, f);
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      return fmt::format("{} {}", n, n == 1 ? "item" : "items");
    }
    std::vector<std::string> items;
    items.reserve(static_cast<size_t>(n));
    for (int i = 0; i < n; ++i) items.push_back(ScalarText(m, f, i));
    return Clip("[" + Join(items) + "]", 64);
  }
  if (f->cpp_type() != pb::FieldDescriptor::CPPTYPE_MESSAGE) return ScalarText(m, f);
  return r->HasField(m, f) ? Short(r->GetMessage(m, f)) : "";
}

// Fields whose change is bookkeeping, not news: the version and the last-change time.
bool Bookkeeping(const pb::FieldDescriptor* f) {
  return f->name() == "generation" || f->name() == "updated_at";
}

bool SameField(const pb::Message& a, const pb::Message& b, const pb::FieldDescriptor* f) {
  pb::util::MessageDifferencer diff;
  const std::vector<const pb::FieldDescriptor*> only = {f};
  return diff.CompareWithFields(a, b, only, only);
}

// What differs between two versions of an entity, field by field; nested messages present in
// both (and repeated messages of the same length, element by element) are compared inside, so a
// claim's phase shows as claims[0].phase.
void Diff(const pb::Message& before, const pb::Message& after, const std::string& prefix, int depth,
          std::vector<Change>* out) {
  const pb::Descriptor* d = after.GetDescriptor();
  const pb::Reflection* rb = before.GetReflection();
  const pb::Reflection* ra = after.GetReflection();
  for (int i = 0; i < d->field_count(); ++i) {
    const pb::FieldDescriptor* f = d->field(i);
    if (Bookkeeping(f) || SameField(before, after, f)) continue;
    const std::string name = prefix + f->name();
    const bool message = f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE &&
                         !IsTimestamp(f->message_type()) && !f->is_map() && depth < 3;
    if (message && !f->is_repeated() && rb->HasField(before, f) && ra->HasField(after, f)) {
      Diff(rb->GetMessage(before, f), ra->GetMessage(after, f), name + ".", depth + 1, out);
      continue;
    }
    if (message && f->is_repeated() && rb->FieldSize(before, f) == ra->FieldSize(after, f)) {
      for (int k = 0; k < ra->FieldSize(after, f); ++k) {
        Diff(rb->GetRepeatedMessage(before, f, k), ra->GetRepeatedMessage(after, f, k),
             fmt::format("{}[{}].", name, k), depth + 1, out);
      }
      continue;
    }
    out->push_back({name, ValueText(before, f), ValueText(after, f)});
  }
}

// A message seen on its own (a first version, a report, a task): its set enum fields (state,
// status, type, stage, ...) and its detail; a first version without enums by Short.
std::vector<Change> Initial(const pb::Message& m, bool first_version) {
  std::vector<Change> out;
  std::vector<const pb::FieldDescriptor*> fields;
  m.GetReflection()->ListFields(m, &fields);
  for (const auto* f : fields) {
    if (f->is_repeated()) continue;
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_ENUM || f->name() == "detail") {
      out.push_back({f->name(), "", ScalarText(m, f)});
    }
  }
  if (out.empty() && first_version) out.push_back({"created", "", Short(m)});
  return out;
}

// A string field `name` of `m` ("" when it has none).
std::string StringField(const pb::Message& m, const std::string& name) {
  const pb::FieldDescriptor* f = m.GetDescriptor()->FindFieldByName(name);
  if (f == nullptr || f->type() != pb::FieldDescriptor::TYPE_STRING || f->is_repeated()) return "";
  return m.GetReflection()->GetString(m, f);
}

// Why: the reason the caller gave (the actor's), else the payload's own reason, else the reason
// of an error or failure the payload (or its entity) carries.
std::string Reason(const Record& rec) {
  if (!rec.ev.actor().reason().empty()) return rec.ev.actor().reason();
  if (rec.payload == nullptr) return "";
  if (auto r = StringField(*rec.payload, "reason"); !r.empty()) return r;
  std::vector<const pb::Message*> where = {rec.payload.get()};
  if (const pb::Message* e = Entity(*rec.payload)) where.push_back(e);
  for (const pb::Message* m : where) {
    for (const char* name : {"error", "failure"}) {
      const pb::FieldDescriptor* f = m->GetDescriptor()->FindFieldByName(name);
      if (f == nullptr || f->cpp_type() != pb::FieldDescriptor::CPPTYPE_MESSAGE ||
          f->is_repeated() || !m->GetReflection()->HasField(*m, f)) {
        continue;
      }
      if (auto r = StringField(m->GetReflection()->GetMessage(*m, f), "reason"); !r.empty()) {
        return r;
      }
    }
  }
  return "";
}

// Remembers the last version of every entity of a stream, so each snapshot says what changed
// since the one before it, whether or not that one is part of the history asked for (a slot's
// reservation bound to an allocation is compared with the unbound one before it).
class Versions {
 public:
  // The version of rec's entity before rec (nullptr when rec is no snapshot or the first).
  const pb::Message* Previous(const Record& rec) const {
    if (rec.payload == nullptr || Entity(*rec.payload) == nullptr) return nullptr;
    auto it = last_.find(Key(rec));
    return it == last_.end() ? nullptr : it->second.get();
  }

  // Remembers rec's snapshot; when `describe`, fills rec's changes, reason and summary first.
  // Call in stream order.
  void See(Record& rec, bool describe) {
    if (rec.payload != nullptr) {
      if (const pb::Message* entity = Entity(*rec.payload)) {
        auto& last = last_[Key(rec)];
        if (describe && last) {
          Diff(*last, *entity, "", 0, &rec.changes);
        } else if (describe) {
          rec.changes = Initial(*entity, true);
        }
        last.reset(entity->New());
        last->CopyFrom(*entity);
      } else if (describe) {
        rec.changes = Initial(*rec.payload, false);
      }
    }
    if (!describe) return;
    rec.reason = Reason(rec);
    std::vector<std::string> parts;
    parts.reserve(rec.changes.size() + 1);
    for (const auto& c : rec.changes) {
      parts.push_back(c.from.empty() && !c.to.empty()
                          ? c.field + "=" + c.to
                          : c.field + " " + Or(c.from) + " -> " + Or(c.to));
    }
    if (!rec.reason.empty()) parts.push_back("reason: " + rec.reason);
    rec.summary = Join(parts, "; ");
  }

 private:
  static std::string Key(const Record& rec) {
    return rec.payload->GetDescriptor()->full_name() + "|" + rec.ev.subject();
  }
  std::map<std::string, std::unique_ptr<pb::Message>> last_;  // payload type|entity -> version
};

// ---- Output ----

// RFC 3339 UTC with milliseconds (events of one request are often within a second).
std::string TimeMs(const pb::Timestamp& t) {
  const std::time_t secs = static_cast<std::time_t>(t.seconds());
  std::tm tm{};
  gmtime_r(&secs, &tm);
  char buf[32];
  (void)std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%S", &tm);
  return fmt::format("{}.{:03d}Z", buf, t.nanos() / 1000000);
}

std::string Service(const std::string& source) { return source.substr(0, source.find('/')); }

std::string ShortType(const std::string& type) {
  const std::string prefix = "gpuaas.v1.";
  return type.rfind(prefix, 0) == 0 ? type.substr(prefix.size()) : type;
}

std::string ActorText(const v1::Principal& p) {
  if (p.subject().empty()) return "-";
  if (p.roles().empty()) return p.subject();
  const std::vector<std::string> roles(p.roles().begin(), p.roles().end());
  return p.subject() + " (" + Join(roles) + ")";
}

json ParseJson(const std::string& text) {
  json j = json::parse(text, nullptr, false);
  return j.is_discarded() ? json(text) : j;
}

json RecordJson(const Record& rec) {
  json j;
  j["time"] = pb::util::TimeUtil::ToString(rec.time);
  j["stream"] = rec.msg.stream;
  j["sequence"] = rec.msg.seq;
  j["nats_subject"] = rec.msg.subject;
  j["event_id"] = rec.ev.id();
  j["source"] = rec.ev.source();
  j["service"] = Service(rec.ev.source());
  j["type"] = rec.ev.type();
  j["entity"] = rec.ev.subject();
  j["generation"] = rec.ev.generation();
  j["correlation_id"] = rec.ev.correlation_id();
  j["actor"] = ParseJson(protojson::ToJson(rec.ev.actor()));
  j["summary"] = rec.summary;
  json changes = json::array();
  for (const auto& c : rec.changes) {
    changes.push_back({{"field", c.field}, {"from", c.from}, {"to", c.to}});
  }
  j["changes"] = changes;
  j["reason"] = rec.reason;
  // The payload as protobuf JSON ({"@type": ..., fields}); null when its type is unknown here.
  j["data"] = rec.payload != nullptr ? ParseJson(protojson::ToJson(rec.ev.data())) : json();
  return j;
}

// --since: RFC 3339 ("2025-01-31T12:00:00Z") or an age ("90s", "15m", "2h", "7d").
Result<pb::Timestamp> ParseSince(const std::string& text) {
  pb::Timestamp t;
  if (pb::util::TimeUtil::FromString(text, &t)) return t;
  if (auto age = ParseSeconds(text); age && !text.empty() && std::isalpha(text.back())) {
    const auto now = std::chrono::system_clock::now();
    const int64_t secs =
        std::chrono::duration_cast<std::chrono::seconds>(now.time_since_epoch()).count();
    t.set_seconds(secs - *age);
    return t;
  }
  return Error::InvalidArgument(
      reason::kSinceInvalid,
      "--since takes an RFC 3339 time (2025-01-31T12:00:00Z) or an age (90s, "
      "15m, 2h, 7d), got '" +
          text + "'");
}

struct Options {
  std::string id;
  std::string since;
};

int Run(messaging::Connection& conn, const Globals& g, Target t, const Options& o) {
  (void)ContractFiles();
  std::optional<pb::Timestamp> since;
  if (!o.since.empty()) {
    auto s = ParseSince(o.since);
    if (!s.ok()) return Usage(g, s.error());
    since = *s;
  }
  if (t.kind == Kind::kSlot) {
    const size_t slash = t.id.find('/');
    if (slash == std::string::npos || slash == 0 || slash + 1 == t.id.size()) {
      return Usage(g, Error::InvalidArgument(
                          reason::kSlotIdInvalid,
                          "a slot id is <node_id>/<slot_key> (gpu-01/gpu-0000:18:00.0), got '" +
                              t.id + "'"));
    }
    t.node = t.id.substr(0, slash);
    t.slot_key = t.id.substr(slash + 1);
  }

  std::vector<Record> records;
  std::set<std::string> seen_ids;
  for (const auto& stream : EventStreams()) {
    auto msgs = ReadStream(conn, "_INBOX." + g.role, stream, g.Timeout());
    if (!msgs.ok()) return Fail(g, msgs.error());
    Versions versions;  // an entity's snapshots are all in its owner's stream
    for (auto& m : *msgs) {
      Record rec;
      // Not an event envelope (never expected on these streams): not part of any history.
      if (!rec.ev.ParseFromString(m.data) || rec.ev.id().empty()) continue;
      // A republished event (same id) is the same event.
      if (!seen_ids.insert(rec.ev.id()).second) continue;
      rec.msg = std::move(m);
      rec.time = rec.ev.has_time() ? rec.ev.time() : rec.msg.time;
      if (rec.ev.has_data()) rec.payload = Unpack(rec.ev.data());
      // An entity that stops naming the target (a reservation unbound from the allocation) is
      // about it too.
      const pb::Message* previous = versions.Previous(rec);
      const bool about = About(rec, t) || (previous != nullptr && Mentions(*previous, t, "", 0));
      // Every snapshot is remembered: what changed is judged against the whole stream.
      versions.See(rec, about);
      if (about) records.push_back(std::move(rec));
    }
  }
  // Event time, then when the stream stored it (events made within the same instant by
  // different services), then stream and sequence.
  std::sort(records.begin(), records.end(), [](const Record& a, const Record& b) {
    if (a.time != b.time) return a.time < b.time;
    if (a.msg.time != b.msg.time) return a.msg.time < b.msg.time;
    if (a.msg.stream != b.msg.stream) return a.msg.stream < b.msg.stream;
    return a.msg.seq < b.msg.seq;
  });
  if (since) {
    records.erase(std::remove_if(records.begin(), records.end(),
                                 [&](const Record& r) { return r.time < *since; }),
                  records.end());
  }
  if (records.empty()) {
    std::string message = fmt::format("no events for {} {}", t.Noun(), t.id);
    if (since) message += " since " + pb::util::TimeUtil::ToString(*since);
    Error e = Error::NotFound(reason::kNoEvents, message);
    e.details = {{t.Noun() + "_id", t.id}};
    return Fail(g, e);
  }

  if (g.Json()) {
    json out = json::array();
    for (const auto& rec : records) out.push_back(RecordJson(rec));
    std::cout << out.dump(g.json_lines ? -1 : 2) << "\n" << std::flush;
    return kExitOk;
  }
  std::vector<std::vector<std::string>> rows;
  rows.reserve(records.size());
  for (const auto& rec : records) {
    rows.push_back({TimeMs(rec.time), Or(Service(rec.ev.source())), ShortType(rec.ev.type()),
                    Or(rec.ev.subject()), std::to_string(rec.ev.generation()),
                    ActorText(rec.ev.actor()), Or(rec.summary)});
  }
  PrintTable({"TIME", "SERVICE", "EVENT", "ENTITY", "GEN", "ACTOR", "CHANGE"}, rows);
  return kExitOk;
}

}  // namespace

ConnAction AddAuditCommands(CLI::App& app) {
  auto* audit = app.add_subcommand(
      "audit", "An entity's whole history, replayed from the event streams (no database read)");
  audit->require_subcommand(1);
  auto o = std::make_shared<Options>();
  struct Cmd {
    Kind kind;
    CLI::App* app;
  };
  std::vector<Cmd> cmds;
  for (const auto& [name, kind, what] :
       {std::tuple{"allocation", Kind::kAllocation, "Allocation id"},
        std::tuple{"slot", Kind::kSlot, "Slot id: <node_id>/<slot_key> (gpu-01/gpu-0000:18:00.0)"},
        std::tuple{"node", Kind::kNode, "Node id"}}) {
    auto* c = audit->add_subcommand(
        name, fmt::format("Every service's events about {} {}, in time order: what changed, "
                          "who did it, why",
                          name[0] == 'a' ? "an" : "a", name));
    c->add_option("--id", o->id, what)->required();
    c->add_option("--since", o->since,
                  "Only events at or after this time: RFC 3339 (2025-01-31T12:00:00Z) or an age "
                  "(90s, 15m, 2h, 7d)");
    cmds.push_back({kind, c});
  }
  return [o, cmds](messaging::Connection& conn, const Globals& g) -> std::optional<int> {
    for (const auto& c : cmds) {
      if (c.app->parsed()) {
        Target t;
        t.kind = c.kind;
        t.id = o->id;
        return Run(conn, g, t, *o);
      }
    }
    return std::nullopt;
  };
}

}  // namespace gpuaas::ctl
