// gpuaasctl console open / list / revoke: audited VM consoles (gpuaas.v1.console.session.*).
// `open` prints the single-use link (valid 60 s) to the operator page's console, which relays
// the VM's VNC through console-gw; the grant in it is shown once and never stored.
#include <cstdlib>
#include <iostream>
#include <memory>

#include <fmt/format.h>

#include "ctl.hpp"
#include "gpuaas/v1/console.pb.h"

namespace gpuaas::ctl {

namespace {

void PrintSessions(const v1::ListConsoleSessionsResponse& r) {
  std::vector<std::vector<std::string>> rows;
  rows.reserve(r.sessions_size());
  for (const auto& s : r.sessions()) {
    rows.push_back({s.session_id(), s.allocation_id(), Txt(s.state()), s.created_by(),
                    Time(s.created_at()), Or(s.end_reason()),
                    fmt::format("{}/{}", s.bytes_to_client(), s.bytes_from_client()), s.reason()});
  }
  PrintTable({"SESSION", "ALLOCATION", "STATE", "BY", "CREATED", "END", "BYTES OUT/IN", "REASON"},
             rows);
}

void PrintLogins(const v1::ListPageSessionsResponse& r) {
  std::vector<std::vector<std::string>> rows;
  rows.reserve(r.sessions_size());
  for (const auto& s : r.sessions()) {
    rows.push_back({s.session_id(), s.principal(), Time(s.created_at()), Time(s.last_seen_at()),
                    Time(s.expires_at()), Or(s.end_reason()), Or(s.ended_by())});
  }
  PrintTable({"LOGIN", "PRINCIPAL", "SINCE", "LAST CALL", "TOKEN EXPIRES", "ENDED", "BY"}, rows);
}

}  // namespace

Action AddConsoleCommands(CLI::App& app) {
  struct Opts {
    std::string allocation, reason, id, state;
    std::string url = std::getenv("GPUAAS_CONSOLE_URL") ? std::getenv("GPUAAS_CONSOLE_URL") : "";
    int64_t max_duration_s = 0;
    int limit = 100;
    bool all = false;
  };
  auto o = std::make_shared<Opts>();
  auto* console = app.add_subcommand("console", "Audited VM consoles (operators)");
  console->require_subcommand(1);
  auto* open = console->add_subcommand(
      "open", "A console session on a slice's VM: prints its single-use link (valid 60 s)");
  open->add_option("--alloc", o->allocation, "Allocation id")->required();
  open->add_option("--reason", o->reason, "Why (required; recorded in the audit trail)")
      ->required();
  open->add_option("--max-duration-s", o->max_duration_s,
                   "Longest connection in seconds (default and cap: console-gw's)");
  open->add_option("--console-url", o->url,
                   "console-gw's page, e.g. http://127.0.0.1:8080 (env GPUAAS_CONSOLE_URL)");
  auto* list = console->add_subcommand("list", "Console sessions, newest first");
  list->add_option("--alloc", o->allocation, "Only this allocation's");
  OneOfEnum<v1::ConsoleSessionState>(list->add_option("--state", o->state, "Only in this state"));
  list->add_option("--limit", o->limit, "At most this many")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  auto* revoke = console->add_subcommand(
      "revoke", "End a session: its grant is refused, a live connection closed (1008 revoked)");
  revoke->add_option("--id", o->id, "Session id")->required();
  revoke->add_option("--reason", o->reason, "Why (recorded in the audit trail)");
  auto* logins = console->add_subcommand(
      "logins", "Operator page sessions (logins): who, since when, last call");
  logins->add_flag("--all", o->all, "Ended ones too, with how they ended");
  logins->add_option("--limit", o->limit, "At most this many")
      ->capture_default_str()
      ->check(CLI::Range(1, 1000));
  auto* end_login = console->add_subcommand(
      "end-login", "End an operator page session now: its cookie is refused from the next call");
  end_login->add_option("--id", o->id, "Login (page session) id")->required();

  return [=](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (open->parsed()) {
      v1::CreateConsoleSessionRequest req;
      req.set_allocation_id(o->allocation);
      req.set_reason(o->reason);
      req.set_max_duration_s(o->max_duration_s);
      auto r = client.Call<v1::CreateConsoleSessionResponse>("gpuaas.v1.console.session.create",
                                                             req, g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        std::cout << fmt::format("session {} on {} ({}), connect by {}, at most {} s open\n",
                                 r->session().session_id(), r->session().domain(),
                                 r->session().node_id(), Time(r->session().connect_by()),
                                 r->session().max_duration_s());
        std::cout << fmt::format("open (single use, within 60 s): {}{}\n",
                                 o->url.empty() ? "<console-gw page>" : o->url, r->page_path());
      });
    }
    if (list->parsed()) {
      int rc = kExitOk;
      auto s = ParseFlag<v1::ConsoleSessionState>(g, "state", o->state, &rc);
      if (!s) return rc;
      v1::ListConsoleSessionsRequest req;
      req.set_allocation_id(o->allocation);
      req.set_state(*s);
      req.set_page_size(o->limit);
      auto r = client.Call<v1::ListConsoleSessionsResponse>("gpuaas.v1.console.session.list", req,
                                                            g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] { PrintSessions(*r); });
    }
    if (logins->parsed()) {
      v1::ListPageSessionsRequest req;
      req.set_include_ended(o->all);
      req.set_page_size(o->limit);
      auto r = client.Call<v1::ListPageSessionsResponse>("gpuaas.v1.console.login.list", req,
                                                         g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] { PrintLogins(*r); });
    }
    if (end_login->parsed()) {
      v1::EndPageSessionRequest req;
      req.set_session_id(o->id);
      auto r =
          client.Call<v1::EndPageSessionResponse>("gpuaas.v1.console.login.end", req, g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        std::cout << fmt::format("login {} of {}: ended ({})\n", r->session().session_id(),
                                 r->session().principal(), r->session().end_reason());
      });
    }
    if (!revoke->parsed()) return std::nullopt;
    v1::RevokeConsoleSessionRequest req;
    req.set_session_id(o->id);
    req.set_reason(o->reason);
    auto r = client.Call<v1::RevokeConsoleSessionResponse>("gpuaas.v1.console.session.revoke", req,
                                                           g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      std::cout << fmt::format(
          "session {}: {}{}\n", r->session().session_id(), Txt(r->session().state()),
          r->session().revoked_by().empty() ? "" : " (by " + r->session().revoked_by() + ")");
    });
  };
}

}  // namespace gpuaas::ctl
