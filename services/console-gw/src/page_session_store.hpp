#pragma once
// console-gw's SQL for operator page sessions (table page_sessions, migration 0003). Every
// function runs in the caller's transaction.
#include <pqxx/pqxx>

#include <chrono>
#include <optional>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/console_gw/console_domain.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/event.pb.h"

namespace gpuaas::console_gw {

struct NewPageSession {
  std::string session_id;
  std::string cookie_hash;  // GrantHash of the cookie: the cookie itself is never stored
  std::string principal;
  std::vector<std::string> roles;
  std::string token;  // forwarded with the page's calls
  std::string token_id;
  std::chrono::system_clock::time_point expires;
};
v1::PageSession InsertPageSession(pqxx::work& tx, const NewPageSession& s);

// A session and the token it forwards.
struct StoredPageSession {
  v1::PageSession session;
  std::string token;
  std::chrono::system_clock::time_point last_seen;
  std::chrono::system_clock::time_point expires;
};
// The session (live or ended: see session.end_reason) whose cookie hashes to `cookie_hash`,
// locked (FOR UPDATE).
std::optional<StoredPageSession> LockPageSession(pqxx::work& tx, const std::string& cookie_hash);
// Notes a page call: last_seen_at = now, written only when older than `every` (to spare the
// database on a busy page).
void TouchPageSession(pqxx::work& tx, const std::string& session_id, std::chrono::seconds every);
// Ends a live session (ended_at now, `why`, `ended_by`); the session as it is afterwards,
// nullopt when there is none by that id. An ended one is returned unchanged. Either way it
// announces nothing: AnnouncePageSession does, when `ended_now` says this call ended it.
std::optional<v1::PageSession> EndPageSession(pqxx::work& tx, const std::string& session_id,
                                              PageEnd why, const std::string& ended_by,
                                              bool* ended_now = nullptr);
// The audit event of a login that started or ended (gpuaas.v1.evt.console.login.started|ended,
// data: the session), through the outbox in the caller's transaction. `actor`: who caused it
// (null: the request being handled, else service:console-gw).
Result<void> AnnouncePageSession(pqxx::work& tx, const std::string& source,
                                 const v1::PageSession& s, const v1::Principal* actor);

// Newest first; live ones only unless `include_ended`.
std::vector<v1::PageSession> ListPageSessions(pqxx::work& tx, bool include_ended, int limit);

}  // namespace gpuaas::console_gw
