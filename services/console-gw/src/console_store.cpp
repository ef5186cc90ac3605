#include "console_store.hpp"

#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>

#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/event.pb.h"

namespace gpuaas::console_gw {

namespace {

using google::protobuf::util::TimeUtil;

constexpr const char* kColumns =
    "session_id, allocation_id, node_id, domain, state, created_by, reason, "
    "(extract(epoch from created_at) * 1000)::int8, (extract(epoch from connect_by) * 1000)::int8, "
    "max_duration_s, coalesce((extract(epoch from connected_at) * 1000)::int8, 0), "
    "coalesce((extract(epoch from ended_at) * 1000)::int8, 0), bytes_to_client, "
    "bytes_from_client, end_reason, revoked_by, generation, gateway";

v1::ConsoleSession FromRow(const pqxx::row& r) {
  v1::ConsoleSession s;
  s.set_session_id(r[0].as<std::string>());
  s.set_allocation_id(r[1].as<std::string>());
  s.set_node_id(r[2].as<std::string>());
  s.set_domain(r[3].as<std::string>());
  s.set_state(enums::FromColumn<v1::ConsoleSessionState>(r[4].as<std::string>()));
  s.set_created_by(r[5].as<std::string>());
  s.set_reason(r[6].as<std::string>());
  *s.mutable_created_at() = TimeUtil::MillisecondsToTimestamp(r[7].as<int64_t>());
  *s.mutable_connect_by() = TimeUtil::MillisecondsToTimestamp(r[8].as<int64_t>());
  s.set_max_duration_s(r[9].as<int64_t>());
  if (r[10].as<int64_t>() > 0) {
    *s.mutable_connected_at() = TimeUtil::MillisecondsToTimestamp(r[10].as<int64_t>());
  }
  if (r[11].as<int64_t>() > 0) {
    *s.mutable_ended_at() = TimeUtil::MillisecondsToTimestamp(r[11].as<int64_t>());
  }
  s.set_bytes_to_client(r[12].as<int64_t>());
  s.set_bytes_from_client(r[13].as<int64_t>());
  s.set_end_reason(r[14].as<std::string>());
  s.set_revoked_by(r[15].as<std::string>());
  s.set_generation(r[16].as<int64_t>());
  s.set_gateway(r[17].as<std::string>());
  return s;
}

std::vector<v1::ConsoleSession> FromRows(const pqxx::result& rows) {
  std::vector<v1::ConsoleSession> out;
  out.reserve(rows.size());
  for (const auto& row : rows) out.push_back(FromRow(row));
  return out;
}

std::optional<v1::ConsoleSession> Load(pqxx::work& tx, const std::string& where,
                                       const std::string& arg, bool lock) {
  auto rows = tx.exec_params(fmt::format("SELECT {} FROM console_sessions WHERE {}{}", kColumns,
                                         where, lock ? " FOR UPDATE" : ""),
                             arg);
  if (rows.empty()) return std::nullopt;
  return FromRow(rows[0]);
}

// Moves a session to a terminal or connected state (a new generation).
// `extra` are $3, $4, ... of `set_sql`.
v1::ConsoleSession Move(pqxx::work& tx, const std::string& session_id,
                        v1::ConsoleSessionState state, const std::string& set_sql,
                        const std::vector<std::string>& extra = {}) {
  std::vector<std::string> p = {session_id, enums::Text(state)};
  p.insert(p.end(), extra.begin(), extra.end());
  auto rows = tx.exec_params(
      fmt::format("UPDATE console_sessions SET state = $2, generation = generation + 1{}{} WHERE "
                  "session_id = $1 RETURNING {}",
                  set_sql.empty() ? "" : ", ", set_sql, kColumns),
      pqxx::prepare::make_dynamic_params(p));
  return FromRow(rows[0]);
}

}  // namespace

v1::Principal OperatorActor(const std::string& subject) {
  v1::Principal p;
  p.set_subject(subject);
  p.add_roles(auth::kRoleOperator);
  return p;
}

Result<void> Announce(pqxx::work& tx, const std::string& source, const v1::ConsoleSession& s,
                      const Audit& a, bool refused) {
  v1::ConsoleSessionEvent ev;
  *ev.mutable_session() = s;
  ev.set_failure(a.failure);
  ev.set_detail(a.detail);
  ev.set_client_address(a.client_address);
  ev.set_origin(a.origin);
  outbox::EventSpec spec;
  spec.nats_subject = refused ? std::string("gpuaas.v1.evt.console.connect.refused")
                              : "gpuaas.v1.evt.console.session." + enums::Text(s.state());
  spec.source = source;
  spec.entity = s.session_id();
  spec.generation = refused ? 0 : s.generation();
  spec.correlation_id = s.allocation_id();
  spec.data = &ev;
  auto r = outbox::Append(tx, spec);
  if (!r.ok()) return r.error();
  return Ok();
}

std::optional<v1::ConsoleSession> LoadSession(pqxx::work& tx, const std::string& session_id,
                                              bool lock) {
  return Load(tx, "session_id = $1", session_id, lock);
}

std::optional<v1::ConsoleSession> LoadSessionByGrant(pqxx::work& tx, const std::string& grant_hash,
                                                     bool lock) {
  return Load(tx, "grant_hash = $1", grant_hash, lock);
}

v1::ConsoleSession InsertSession(pqxx::work& tx, const NewSession& s) {
  auto rows = tx.exec_params(
      fmt::format("INSERT INTO console_sessions (session_id, allocation_id, node_id, "
                  "domain, state, grant_hash, created_by, reason, connect_by, "
                  "max_duration_s) VALUES ($1, $2, $3, $4, $10, $5, $6, $7, now() + "
                  "$8 * interval '1 second', $9) RETURNING {}",
                  kColumns),
      s.session_id, s.allocation_id, s.node_id, s.domain, s.grant_hash, s.created_by, s.reason,
      s.grant_ttl_s, s.max_duration_s, enums::Text(v1::CONSOLE_SESSION_STATE_CREATED));
  return FromRow(rows[0]);
}

std::vector<v1::ConsoleSession> ListSessions(pqxx::work& tx, const std::string& allocation_id,
                                             const std::string& state, int limit) {
  return FromRows(
      tx.exec_params(fmt::format("SELECT {} FROM console_sessions WHERE ($1 = '' OR "
                                 "allocation_id = $1) AND ($2 = '' OR state = $2) ORDER BY "
                                 "created_at DESC, session_id DESC LIMIT $3",
                                 kColumns),
                     allocation_id, state, limit));
}

bool GrantPastConnectBy(pqxx::work& tx, const std::string& session_id) {
  return tx
      .exec_params("SELECT connect_by < now() FROM console_sessions WHERE session_id = $1",
                   session_id)[0][0]
      .as<bool>();
}

v1::ConsoleSession MarkConnected(pqxx::work& tx, const std::string& session_id,
                                 const std::string& gateway, const std::string& client_address,
                                 const std::string& origin) {
  return Move(tx, session_id, v1::CONSOLE_SESSION_STATE_CONNECTED,
              "connected_at = now(), gateway = $3, client_address = $4, origin = $5",
              {gateway, client_address, origin});
}

v1::ConsoleSession ExpireGrant(pqxx::work& tx, const std::string& session_id) {
  return Move(tx, session_id, v1::CONSOLE_SESSION_STATE_EXPIRED,
              "ended_at = now(), end_reason = $3", {TextOf(EndReason::kGrantExpired).str()});
}

v1::ConsoleSession FailWrongScope(pqxx::work& tx, const std::string& session_id) {
  return Move(tx, session_id, v1::CONSOLE_SESSION_STATE_FAILED, "ended_at = now(), end_reason = $3",
              {TextOf(EndReason::kWrongScope).str()});
}

v1::ConsoleSession RevokeSession(pqxx::work& tx, const std::string& session_id,
                                 const std::string& revoked_by) {
  return Move(tx, session_id, v1::CONSOLE_SESSION_STATE_REVOKED,
              "ended_at = now(), end_reason = $3, revoked_by = $4",
              {TextOf(EndReason::kRevoked).str(), revoked_by});
}

v1::ConsoleSession FailSession(pqxx::work& tx, const std::string& session_id,
                               EndReason end_reason) {
  return Move(tx, session_id, v1::CONSOLE_SESSION_STATE_FAILED, "ended_at = now(), end_reason = $3",
              {TextOf(end_reason).str()});
}

v1::ConsoleSession EndConnection(pqxx::work& tx, const std::string& session_id,
                                 uint64_t bytes_to_client, uint64_t bytes_from_client,
                                 EndReason end_reason) {
  return Move(tx, session_id,
              EndsFailed(end_reason) ? v1::CONSOLE_SESSION_STATE_FAILED
                                     : v1::CONSOLE_SESSION_STATE_DISCONNECTED,
              "ended_at = now(), bytes_to_client = $3::int8, bytes_from_client = $4::int8, "
              "end_reason = $5",
              {std::to_string(bytes_to_client), std::to_string(bytes_from_client),
               TextOf(end_reason).str()});
}

void RecordBytes(pqxx::work& tx, const std::string& session_id, uint64_t bytes_to_client,
                 uint64_t bytes_from_client) {
  tx.exec_params(
      "UPDATE console_sessions SET bytes_to_client = $2, bytes_from_client = $3 WHERE "
      "session_id = $1",
      session_id, static_cast<int64_t>(bytes_to_client), static_cast<int64_t>(bytes_from_client));
}

std::vector<v1::ConsoleSession> ExpireUnusedGrants(pqxx::work& tx) {
  return FromRows(tx.exec_params(
      fmt::format("UPDATE console_sessions SET state = $1, generation = generation + 1, "
                  "ended_at = now(), end_reason = $2 WHERE state = $3 AND "
                  "connect_by < now() RETURNING {}",
                  kColumns),
      enums::Text(v1::CONSOLE_SESSION_STATE_EXPIRED), TextOf(EndReason::kGrantExpired).str(),
      enums::Text(v1::CONSOLE_SESSION_STATE_CREATED)));
}

std::vector<v1::ConsoleSession> FailLostGatewaySessions(pqxx::work& tx) {
  return FromRows(tx.exec_params(
      fmt::format("UPDATE console_sessions SET state = $1, generation = generation + 1, "
                  "ended_at = now(), end_reason = $2 WHERE state = $3 AND "
                  "connected_at + (max_duration_s + 120) * interval '1 second' < now() "
                  "RETURNING {}",
                  kColumns),
      enums::Text(v1::CONSOLE_SESSION_STATE_FAILED), TextOf(EndReason::kGatewayLost).str(),
      enums::Text(v1::CONSOLE_SESSION_STATE_CONNECTED)));
}

std::vector<LiveSessionState> LoadLiveSessionStates(pqxx::work& tx,
                                                    const std::vector<std::string>& session_ids) {
  std::vector<LiveSessionState> out;
  if (session_ids.empty()) return out;
  for (const auto& row : tx.exec_params(
           "SELECT session_id, state, end_reason, connected_at + max_duration_s * interval "
           "'1 second' <= now() FROM console_sessions WHERE session_id = ANY($1::text[])",
           store::TextArrayLiteral(session_ids))) {
    LiveSessionState live;
    live.session_id = row[0].as<std::string>();
    live.state = enums::FromColumn<v1::ConsoleSessionState>(row[1].as<std::string>());
    live.end_reason = ParseEndReason(row[2].as<std::string>());
    // Read only for a connected session: the others may never have connected (NULL).
    live.past_max_duration = live.state == v1::CONSOLE_SESSION_STATE_CONNECTED && row[3].as<bool>();
    out.push_back(std::move(live));
  }
  return out;
}

std::map<std::string, int64_t> CountSessionsByState(pqxx::work& tx) {
  std::map<std::string, int64_t> by_state;
  for (const auto& row : tx.exec("SELECT state, count(*) FROM console_sessions GROUP BY state")) {
    by_state[row[0].as<std::string>()] = row[1].as<int64_t>();
  }
  return by_state;
}

}  // namespace gpuaas::console_gw
