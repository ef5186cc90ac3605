// gpuaasctl auth revoke / revocations: revoked request tokens (console-gw's
// gpuaas.v1.console.token.*). Every service refuses a revoked token within a second
// (UNAUTHENTICATED token_revoked); a principal's revocation covers its tokens issued until then.
#include <iostream>
#include <memory>

#include <fmt/format.h>

#include "ctl.hpp"
#include "gpuaas/v1/console.pb.h"

namespace gpuaas::ctl {

namespace {

void PrintRevocations(const v1::ListTokenRevocationsResponse& r) {
  std::vector<std::vector<std::string>> rows;
  rows.reserve(r.revocations_size());
  for (const auto& v : r.revocations()) {
    rows.push_back({v.revocation_id(), Or(v.jti()), Or(v.subject()), Time(v.revoked_at()),
                    v.revoked_by(), Time(v.expires_at()), v.reason()});
  }
  PrintTable({"REVOCATION", "JTI", "SUBJECT", "REVOKED", "BY", "IN FORCE UNTIL", "REASON"}, rows);
}

}  // namespace

Action AddRevokeCommands(CLI::App& app) {
  struct Opts {
    std::string jti, subject, reason;
  };
  auto o = std::make_shared<Opts>();
  CLI::App* auth_cmd = app.get_subcommand("auth");
  auto* revoke = auth_cmd->add_subcommand(
      "revoke",
      "Revoke a request token (--jti) or every token of a principal issued until now "
      "(--sub); every service refuses it within a second");
  auto* jti = revoke->add_option("--jti", o->jti, "The token's id (its jti claim)");
  auto* sub = revoke->add_option("--sub", o->subject, "A principal, e.g. user:alice");
  jti->excludes(sub);
  revoke->add_option("--reason", o->reason, "Why (recorded)");
  auto* list = auth_cmd->add_subcommand("revocations", "The token revocations in force");

  return [=](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (list->parsed()) {
      auto r = client.Call<v1::ListTokenRevocationsResponse>(
          "gpuaas.v1.console.token.revocation.list", v1::ListTokenRevocationsRequest(),
          g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] { PrintRevocations(*r); });
    }
    if (!revoke->parsed()) return std::nullopt;
    v1::RevokeTokenRequest req;
    req.set_jti(o->jti);
    req.set_subject(o->subject);
    req.set_reason(o->reason);
    auto r =
        client.Call<v1::RevokeTokenResponse>("gpuaas.v1.console.token.revoke", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] {
      const auto& v = r->revocation();
      std::cout << fmt::format("{} revoked{} ({}), in force until {}\n",
                               v.jti().empty() ? v.subject() : "token " + v.jti(),
                               r->created() ? "" : " already", v.revocation_id(),
                               Time(v.expires_at()));
    });
  };
}

}  // namespace gpuaas::ctl
