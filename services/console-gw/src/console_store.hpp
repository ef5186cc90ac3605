#pragma once
// console-gw's SQL: the console_sessions table and the session events of its outbox. Every
// function runs in the caller's transaction; the caller decides where a transaction begins and
// ends and which rows it locks first (the Load functions with `lock`).
#include <pqxx/pqxx>

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/console_gw/console_domain.hpp"

#include "gpuaas/v1/event.pb.h"

namespace gpuaas::v1 {
class ConsoleSession;
enum ConsoleSessionState : int;
}  // namespace gpuaas::v1

namespace gpuaas::console_gw {

// What an event says beyond the session itself (ConsoleSessionEvent's other fields).
struct Audit {
  std::string failure;  // a registry reason's text (connect refusals, how a session failed)
  std::string detail;
  std::string client_address;
  std::string origin;
};

// An operator as the actor of an event console-gw writes outside a request (the operator who
// created a console session, for its connection; who logged in to or out of the page).
v1::Principal OperatorActor(const std::string& subject);

// The session's event: gpuaas.v1.evt.console.session.<state>, or connect.refused.
Result<void> Announce(pqxx::work& tx, const std::string& source, const v1::ConsoleSession& s,
                      const Audit& a, bool refused = false);

// The session by id / by its grant's hash; `lock`: FOR UPDATE.
std::optional<v1::ConsoleSession> LoadSession(pqxx::work& tx, const std::string& session_id,
                                              bool lock);
std::optional<v1::ConsoleSession> LoadSessionByGrant(pqxx::work& tx, const std::string& grant_hash,
                                                     bool lock);

// A new session in state `created`, its grant valid for `grant_ttl_s` from now.
struct NewSession {
  std::string session_id;
  std::string allocation_id;
  std::string node_id;
  std::string domain;
  std::string grant_hash;
  std::string created_by;
  std::string reason;
  int64_t grant_ttl_s = 0;
  int64_t max_duration_s = 0;
};
v1::ConsoleSession InsertSession(pqxx::work& tx, const NewSession& s);

// By allocation and state ("" = any), newest first.
std::vector<v1::ConsoleSession> ListSessions(pqxx::work& tx, const std::string& allocation_id,
                                             const std::string& state, int limit);

// Whether the session's grant is past its connect_by.
bool GrantPastConnectBy(pqxx::work& tx, const std::string& session_id);

// The session moves (a new generation each) and is returned as it is after the move.
// created -> connected: the grant was claimed by `gateway` for that client.
v1::ConsoleSession MarkConnected(pqxx::work& tx, const std::string& session_id,
                                 const std::string& gateway, const std::string& client_address,
                                 const std::string& origin);
// created -> expired (end_reason grant_expired).
v1::ConsoleSession ExpireGrant(pqxx::work& tx, const std::string& session_id);
// created -> failed (end_reason wrong_scope): its grant was presented for another session.
v1::ConsoleSession FailWrongScope(pqxx::work& tx, const std::string& session_id);
// -> revoked by `revoked_by` (end_reason revoked).
v1::ConsoleSession RevokeSession(pqxx::work& tx, const std::string& session_id,
                                 const std::string& revoked_by);
// connected -> failed with `end_reason` (the relay never opened).
v1::ConsoleSession FailSession(pqxx::work& tx, const std::string& session_id, EndReason end_reason);
// connected -> failed (EndsFailed(end_reason)) or disconnected: the connection ended with its
// byte counts.
v1::ConsoleSession EndConnection(pqxx::work& tx, const std::string& session_id,
                                 uint64_t bytes_to_client, uint64_t bytes_from_client,
                                 EndReason end_reason);
// The byte counts of a session whose end is recorded already (no new generation).
void RecordBytes(pqxx::work& tx, const std::string& session_id, uint64_t bytes_to_client,
                 uint64_t bytes_from_client);

// The sweeper's moves, each returning the sessions it moved.
// Unused grants past their connect_by: created -> expired.
std::vector<v1::ConsoleSession> ExpireUnusedGrants(pqxx::work& tx);
// Connections past their maximum by two minutes: connected -> failed (gateway_lost).
std::vector<v1::ConsoleSession> FailLostGatewaySessions(pqxx::work& tx);

// A live connection's session as the database has it now.
struct LiveSessionState {
  std::string session_id;
  v1::ConsoleSessionState state{};
  std::optional<EndReason> end_reason;  // as recorded ("" while connected: nullopt)
  bool past_max_duration = false;       // connected past its max_duration_s (false otherwise)
};
std::vector<LiveSessionState> LoadLiveSessionStates(pqxx::work& tx,
                                                    const std::vector<std::string>& session_ids);

// Every session ever made, counted by state.
std::map<std::string, int64_t> CountSessionsByState(pqxx::work& tx);

}  // namespace gpuaas::console_gw
