#include "revocation_store.hpp"

#include <google/protobuf/util/time_util.h>

#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/revocations.hpp"
#include "gpuaas/v1/console.pb.h"

namespace gpuaas::console_gw {

namespace {

using google::protobuf::util::TimeUtil;

constexpr const char* kColumns =
    "revocation_id, jti, subject, (extract(epoch from revoked_at) * 1000)::int8, revoked_by, "
    "reason, (extract(epoch from expires_at) * 1000)::int8";

v1::TokenRevocation FromRow(const pqxx::row& row) {
  v1::TokenRevocation r;
  r.set_revocation_id(row[0].as<std::string>());
  r.set_jti(row[1].as<std::string>());
  r.set_subject(row[2].as<std::string>());
  *r.mutable_revoked_at() = TimeUtil::MillisecondsToTimestamp(row[3].as<int64_t>());
  r.set_revoked_by(row[4].as<std::string>());
  r.set_reason(row[5].as<std::string>());
  *r.mutable_expires_at() = TimeUtil::MillisecondsToTimestamp(row[6].as<int64_t>());
  return r;
}

}  // namespace

std::optional<v1::TokenRevocation> FindRevocation(pqxx::work& tx, const std::string& jti,
                                                  const std::string& subject) {
  const auto rows = tx.exec_params(std::string("SELECT ") + kColumns +
                                       " FROM token_revocations WHERE expires_at > now() AND "
                                       "(($1 <> '' AND jti = $1) OR ($2 <> '' AND subject = $2)) "
                                       "ORDER BY revoked_at DESC LIMIT 1",
                                   jti, subject);
  if (rows.empty()) return std::nullopt;
  return FromRow(rows[0]);
}

Result<bool> InsertRevocation(pqxx::work& tx, const std::string& source,
                              const v1::TokenRevocation& r) {
  // A token revoked by a concurrent request (the jti index) is not revoked twice.
  const auto rows = tx.exec_params(
      "INSERT INTO token_revocations (revocation_id, jti, subject, revoked_at, revoked_by, "
      "reason, expires_at) VALUES ($1, $2, $3, to_timestamp($4::float8 / 1000), $5, $6, "
      "to_timestamp($7::float8 / 1000)) ON CONFLICT (jti) WHERE jti <> '' DO NOTHING "
      "RETURNING revocation_id",
      r.revocation_id(), r.jti(), r.subject(), TimeUtil::TimestampToMilliseconds(r.revoked_at()),
      r.revoked_by(), r.reason(), TimeUtil::TimestampToMilliseconds(r.expires_at()));
  if (rows.empty()) return false;
  outbox::EventSpec spec;
  spec.nats_subject = revocation::kSubject;
  spec.source = source;
  spec.entity = r.revocation_id();
  spec.data = &r;
  auto e = outbox::Append(tx, spec);
  if (!e.ok()) return e.error();
  return true;
}

std::vector<v1::TokenRevocation> ListRevocations(pqxx::work& tx) {
  std::vector<v1::TokenRevocation> out;
  for (const auto& row :
       tx.exec(std::string("SELECT ") + kColumns +
               " FROM token_revocations WHERE expires_at > now() ORDER BY revoked_at DESC")) {
    out.push_back(FromRow(row));
  }
  return out;
}

}  // namespace gpuaas::console_gw
