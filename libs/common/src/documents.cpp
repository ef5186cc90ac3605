#include "gpuaas/common/documents.hpp"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/util/message_differencer.h>
#include <google/protobuf/util/time_util.h>

#include <algorithm>
#include <map>
#include <memory>

#include <fmt/format.h>

#include "gpuaas/common/proto_json.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/common/store.hpp"

namespace gpuaas::documents {

namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;
using google::protobuf::util::TimeUtil;

struct VersionFields {
  const FieldDescriptor* version = nullptr;
  const FieldDescriptor* created_at = nullptr;
};

Result<VersionFields> FieldsOf(const Message& m) {
  const auto* d = m.GetDescriptor();
  VersionFields f{d->FindFieldByName("version"), d->FindFieldByName("created_at")};
  const bool ok = f.version != nullptr && !f.version->is_repeated() &&
                  f.version->cpp_type() == FieldDescriptor::CPPTYPE_INT64 &&
                  f.created_at != nullptr && !f.created_at->is_repeated() &&
                  f.created_at->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE &&
                  f.created_at->message_type()->full_name() == "google.protobuf.Timestamp";
  if (!ok) {
    return Error::Internal(
        reason::kDocumentWithoutVersion,
        fmt::format("{} has no int64 version and google.protobuf.Timestamp created_at fields",
                    d->full_name()));
  }
  return f;
}

// Equal apart from version and created_at.
bool SameContent(const Message& a, const Message& b, const VersionFields& f) {
  std::unique_ptr<Message> x(a.New());
  std::unique_ptr<Message> y(b.New());
  x->CopyFrom(a);
  y->CopyFrom(b);
  for (Message* m : {x.get(), y.get()}) {
    m->GetReflection()->ClearField(m, f.version);
    m->GetReflection()->ClearField(m, f.created_at);
  }
  return google::protobuf::util::MessageDifferencer::Equals(*x, *y);
}

bool IsBlockerName(const std::string& b) {
  return !b.empty() && b.size() <= 64 && std::all_of(b.begin(), b.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_';
  });
}

}  // namespace

Result<int64_t> Publish(pqxx::work& tx, const Tables& t, const std::string& node_id, Message& want,
                        bool empty) {
  auto fields = FieldsOf(want);
  if (!fields.ok()) return fields.error();
  const auto* refl = want.GetReflection();
  auto latest = tx.exec_params(fmt::format("SELECT version, doc::text FROM {} WHERE node_id = $1 "
                                           "ORDER BY version DESC LIMIT 1",
                                           tx.quote_name(t.documents)),
                               node_id);
  int64_t version = 0;
  if (!latest.empty()) {
    version = latest[0][0].as<int64_t>();
    std::unique_ptr<Message> have(want.New());
    // A stored document that no longer parses is replaced by a new version.
    if (protojson::FromJson(latest[0][1].as<std::string>(), have.get()).ok() &&
        SameContent(*have, want, *fields)) {
      refl->SetInt64(&want, fields->version, version);
      refl->MutableMessage(&want, fields->created_at)
          ->CopyFrom(have->GetReflection()->GetMessage(*have, fields->created_at));
      return version;
    }
  } else if (empty) {
    return int64_t{0};
  }
  ++version;
  refl->SetInt64(&want, fields->version, version);
  refl->MutableMessage(&want, fields->created_at)->CopyFrom(TimeUtil::GetCurrentTime());
  tx.exec_params(fmt::format("INSERT INTO {} (node_id, version, doc) VALUES ($1, $2, $3::jsonb)",
                             tx.quote_name(t.documents)),
                 node_id, version, protojson::ToJson(want));
  return version;
}

int64_t Latest(pqxx::work& tx, const Tables& t, const std::string& node_id) {
  return tx
      .exec_params(fmt::format("SELECT COALESCE(max(version), 0) FROM {} WHERE node_id = $1",
                               tx.quote_name(t.documents)),
                   node_id)[0][0]
      .as<int64_t>();
}

Result<int64_t> Load(pqxx::work& tx, const Tables& t, const std::string& node_id, int64_t version,
                     Message& out) {
  const int64_t latest = Latest(tx, t, node_id);
  const int64_t want = version == 0 ? latest : version;
  if (want == 0) return latest;
  auto doc =
      tx.exec_params(fmt::format("SELECT doc::text FROM {} WHERE node_id = $1 AND version = $2",
                                 tx.quote_name(t.documents)),
                     node_id, want);
  if (doc.empty()) {
    return Error::Of(Code::kNotFound, reason::kDocumentVersionNotFound,
                     fmt::format("node {} has {} versions up to {}", node_id, t.what, latest),
                     {{"version", std::to_string(version)}, {"latest", std::to_string(latest)}},
                     false);
  }
  if (auto p = protojson::FromJson(doc[0][0].as<std::string>(), &out); !p.ok()) {
    return Error::Internal(reason::kCorruptDocument, fmt::format("{} {} of node {}: {}", t.what,
                                                                 want, node_id, p.error().message));
  }
  return latest;
}

AckState LoadAck(pqxx::work& tx, const Tables& t, const std::string& node_id) {
  AckState s;
  auto r = tx.exec_params(
      fmt::format("SELECT applied_version, blockers, (extract(epoch from acked_at) * 1000)::int8 "
                  "FROM {} WHERE node_id = $1",
                  tx.quote_name(t.acks)),
      node_id);
  if (r.empty()) return s;
  s.applied_version = r[0][0].as<int64_t>();
  s.blockers = store::TextArray(r[0][1]);
  s.acked_at = TimeUtil::MillisecondsToTimestamp(r[0][2].as<int64_t>());
  return s;
}

Result<void> ValidateAck(int64_t version, const std::vector<std::string>& blockers) {
  if (version < 0) {
    return Error::InvalidArgument(reason::kInvalidVersion, "version must be >= 0",
                                  {{"version", "must be >= 0"}});
  }
  std::map<std::string, std::string> problems;
  for (size_t i = 0; i < blockers.size(); ++i) {
    if (!IsBlockerName(blockers[i])) {
      problems[fmt::format("blockers[{}]", i)] = "snake_case, 1-64 characters";
    }
  }
  if (!problems.empty()) {
    return Error::InvalidArgument(reason::kInvalidBlocker, "blockers are stable snake_case names",
                                  std::move(problems));
  }
  return Ok();
}

Result<AckResult> RecordAck(pqxx::work& tx, const Tables& t, const std::string& node_id,
                            int64_t version, const std::vector<std::string>& blockers) {
  if (auto v = ValidateAck(version, blockers); !v.ok()) return v.error();
  const int64_t latest = Latest(tx, t, node_id);
  if (version > latest) {
    return Error::Of(Code::kInvalidArgument, reason::kUnknownVersion,
                     fmt::format("node {} has {} versions up to {}; cannot ack {}", node_id, t.what,
                                 latest, version),
                     {{"version", std::to_string(version)}, {"latest", std::to_string(latest)}},
                     false);
  }
  const std::string acks = tx.quote_name(t.acks);
  auto r = tx.exec_params(
      fmt::format(
          "INSERT INTO {0} (node_id, applied_version, blockers) VALUES ($1, $2, $3::text[]) "
          "ON CONFLICT (node_id) DO UPDATE SET "
          "blockers = CASE WHEN EXCLUDED.applied_version >= {0}.applied_version "
          "THEN EXCLUDED.blockers ELSE {0}.blockers END, "
          "applied_version = GREATEST({0}.applied_version, EXCLUDED.applied_version), "
          "acked_at = now() RETURNING applied_version, blockers",
          acks),
      node_id, version, store::TextArrayLiteral(blockers));
  AckResult out;
  out.applied_version = r[0][0].as<int64_t>();
  out.latest_version = latest;
  out.blockers = store::TextArray(r[0][1]);
  return out;
}

}  // namespace gpuaas::documents
