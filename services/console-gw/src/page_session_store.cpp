#include "page_session_store.hpp"

#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>

#include "gpuaas/common/outbox.hpp"
#include "gpuaas/v1/console.pb.h"

namespace gpuaas::console_gw {

namespace {

using google::protobuf::util::TimeUtil;
using Clock = std::chrono::system_clock;

constexpr const char* kColumns =
    "session_id, principal, roles, token_id, (extract(epoch from created_at) * 1000)::int8, "
    "(extract(epoch from last_seen_at) * 1000)::int8, (extract(epoch from expires_at) * "
    "1000)::int8, "
    "coalesce((extract(epoch from ended_at) * 1000)::int8, 0), end_reason, ended_by, token";

int64_t Ms(Clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::milliseconds>(t.time_since_epoch()).count();
}
Clock::time_point At(int64_t ms) { return Clock::time_point(std::chrono::milliseconds(ms)); }

StoredPageSession FromRow(const pqxx::row& r) {
  StoredPageSession out;
  v1::PageSession& s = out.session;
  s.set_session_id(r[0].as<std::string>());
  s.set_principal(r[1].as<std::string>());
  std::string roles = r[2].as<std::string>();
  for (size_t at = 0; !roles.empty() && at <= roles.size();) {
    const size_t comma = std::min(roles.find(',', at), roles.size());
    s.add_roles(roles.substr(at, comma - at));
    at = comma + 1;
  }
  s.set_token_id(r[3].as<std::string>());
  *s.mutable_created_at() = TimeUtil::MillisecondsToTimestamp(r[4].as<int64_t>());
  *s.mutable_last_seen_at() = TimeUtil::MillisecondsToTimestamp(r[5].as<int64_t>());
  *s.mutable_expires_at() = TimeUtil::MillisecondsToTimestamp(r[6].as<int64_t>());
  if (r[7].as<int64_t>() > 0) {
    *s.mutable_ended_at() = TimeUtil::MillisecondsToTimestamp(r[7].as<int64_t>());
  }
  s.set_end_reason(r[8].as<std::string>());
  s.set_ended_by(r[9].as<std::string>());
  out.token = r[10].as<std::string>();
  out.last_seen = At(r[5].as<int64_t>());
  out.expires = At(r[6].as<int64_t>());
  return out;
}

}  // namespace

v1::PageSession InsertPageSession(pqxx::work& tx, const NewPageSession& s) {
  std::string roles;
  for (const auto& r : s.roles) roles += (roles.empty() ? "" : ",") + r;
  const auto rows = tx.exec_params(
      fmt::format("INSERT INTO page_sessions (session_id, cookie_hash, principal, roles, token, "
                  "token_id, expires_at) VALUES ($1, $2, $3, $4, $5, $6, "
                  "to_timestamp($7::float8 / 1000)) RETURNING {}",
                  kColumns),
      s.session_id, s.cookie_hash, s.principal, roles, s.token, s.token_id, Ms(s.expires));
  return FromRow(rows[0]).session;
}

std::optional<StoredPageSession> LockPageSession(pqxx::work& tx, const std::string& cookie_hash) {
  const auto rows = tx.exec_params(
      fmt::format("SELECT {} FROM page_sessions WHERE cookie_hash = $1 FOR UPDATE", kColumns),
      cookie_hash);
  if (rows.empty()) return std::nullopt;
  return FromRow(rows[0]);
}

void TouchPageSession(pqxx::work& tx, const std::string& session_id, std::chrono::seconds every) {
  tx.exec_params(
      "UPDATE page_sessions SET last_seen_at = now() WHERE session_id = $1 AND "
      "last_seen_at <= now() - make_interval(secs => $2)",
      session_id, static_cast<double>(every.count()));
}

std::optional<v1::PageSession> EndPageSession(pqxx::work& tx, const std::string& session_id,
                                              PageEnd why, const std::string& ended_by,
                                              bool* ended_now) {
  const auto ended = tx.exec_params(
      "UPDATE page_sessions SET ended_at = now(), end_reason = $2, ended_by = $3 WHERE "
      "session_id = $1 AND ended_at IS NULL",
      session_id, std::string(TextOf(why).text()), ended_by);
  if (ended_now != nullptr) *ended_now = ended.affected_rows() > 0;
  const auto rows = tx.exec_params(
      fmt::format("SELECT {} FROM page_sessions WHERE session_id = $1", kColumns), session_id);
  if (rows.empty()) return std::nullopt;
  return FromRow(rows[0]).session;
}

Result<void> AnnouncePageSession(pqxx::work& tx, const std::string& source,
                                 const v1::PageSession& s, const v1::Principal* actor) {
  outbox::EventSpec spec;
  spec.nats_subject =
      std::string("gpuaas.v1.evt.console.login.") + (s.end_reason().empty() ? "started" : "ended");
  spec.source = source;
  spec.entity = s.session_id();
  spec.data = &s;
  spec.actor = actor;
  auto r = outbox::Append(tx, spec);
  if (!r.ok()) return r.error();
  return Ok();
}

std::vector<v1::PageSession> ListPageSessions(pqxx::work& tx, bool include_ended, int limit) {
  std::vector<v1::PageSession> out;
  for (const auto& row :
       tx.exec_params(fmt::format("SELECT {} FROM page_sessions WHERE $1 OR ended_at IS NULL "
                                  "ORDER BY created_at DESC LIMIT $2",
                                  kColumns),
                      include_ended, limit)) {
    out.push_back(FromRow(row).session);
  }
  return out;
}

}  // namespace gpuaas::console_gw
