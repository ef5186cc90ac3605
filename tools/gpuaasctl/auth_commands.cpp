// gpuaasctl auth init / nats-config / login, node enroll / revoke: the identities of a deployment.
// They work on a keys directory (access.hpp) and need no NATS connection.
#include <signal.h>

#include <filesystem>
#include <fstream>
#include <iostream>
#include <memory>
#include <sstream>

#include <fmt/format.h>

#include "ctl.hpp"
#include "ctl_reasons.hpp"
#include "gpuaas/common/access.hpp"
#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/reasons.hpp"

namespace gpuaas::ctl {

namespace {

Result<access::Contract> Contract(const std::string& dir) {
  if (dir.empty()) return access::EmbeddedContract();
  return access::LoadContract(dir);
}

Result<std::string> Read(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Error::NotFound(gpuaas::reason::kFileMissing, "cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

// Renders the authorization config of `keys` to `out` (atomically; "" = stdout) and, with a
// pid file, tells that nats-server to reload it.
Result<void> Render(const access::Contract& c, const std::string& keys, const std::string& out,
                    const std::string& pid_file) {
  auto users = access::UsersFromKeys(c, keys);
  if (!users.ok()) return users.error();
  auto conf = access::RenderAuthorization(c, *users);
  if (!conf.ok()) return conf.error();
  if (out.empty()) {
    std::cout << *conf;
  } else {
    {
      std::ofstream f(out + ".tmp", std::ios::trunc);
      f << *conf;
      if (!f) return Error::Internal(gpuaas::reason::kWriteFailed, "cannot write " + out + ".tmp");
    }
    std::filesystem::rename(out + ".tmp", out);
  }
  if (!pid_file.empty()) {
    auto pid = Read(pid_file);
    if (!pid.ok()) return pid.error();
    const int n = std::atoi(pid->c_str());
    if (n <= 0 || kill(n, SIGHUP) != 0) {
      return Error::Unavailable(reason::kNatsReloadFailed, "cannot signal nats-server pid " + *pid);
    }
  }
  return Ok();
}

}  // namespace

std::function<std::optional<int>(const Globals&)> AddAuthCommands(CLI::App& app) {
  struct Opts {
    std::string keys, contract, out, pid_file, user, role, tenant, seed_out, node_id;
    std::string issuer = "platform";
    std::string ttl = "15m";
  };
  auto o = std::make_shared<Opts>();
  auto* auth_cmd = app.add_subcommand("auth", "Identities: NATS keys, the server's users, tokens");
  auth_cmd->require_subcommand(1);
  auto keys_opt = [&](CLI::App* c) {
    c->add_option("--keys", o->keys, "Keys directory (secret: role seeds, token signing key)")
        ->required();
  };
  auto* init = auth_cmd->add_subcommand(
      "init", "Create every role's NATS key and the token signing key (existing ones are kept)");
  keys_opt(init);
  auto* conf = auth_cmd->add_subcommand(
      "nats-config",
      "Print (or write) the nats-server authorization block derived from the contract");
  keys_opt(conf);
  conf->add_option("--contract", o->contract,
                   "Directory with gpuaas.asyncapi.yaml and roles.yaml (default: built in)");
  conf->add_option("--out", o->out, "Write here (atomically) instead of stdout");
  conf->add_option("--reload-pid-file", o->pid_file, "Then reload this nats-server (SIGHUP)");
  auto* login = auth_cmd->add_subcommand("login", "Issue a short-lived request token");
  keys_opt(login);
  login->add_option("--user", o->user, "Who (user:<name>, or a bare name)")->required();
  OneOf(login->add_option("--role", o->role, "Token role")->required(),
        {auth::kRoleOperator, auth::kRoleTenant, auth::kRoleAuditor});
  login->add_option("--tenant", o->tenant, "The tenant (role tenant only)");
  login->add_option("--ttl", o->ttl, "Lifetime: <n>s | <n>m | <n>h (at most 24h)")
      ->capture_default_str();
  login->add_option("--out", o->out, "Write the token to this file (0600) instead of stdout");
  OneOf(login
            ->add_option("--issuer", o->issuer,
                         "Whose key signs it: platform (any role) | tenant (the tenant issuer's "
                         "key: tenant tokens only)")
            ->capture_default_str(),
        {"platform", "tenant"});

  CLI::App* node = app.get_subcommand("node");
  auto* enroll = node->add_subcommand(
      "enroll", "Issue a node's NATS key once (the seed goes to the host's bootstrap)");
  enroll->add_option("node_id", o->node_id, "Node id")->required();
  keys_opt(enroll);
  enroll->add_option("--seed-out", o->seed_out, "Write the seed here (0600) instead of stdout");
  enroll->add_option("--nats-config", o->out, "Then rewrite this authorization config");
  enroll->add_option("--reload-pid-file", o->pid_file, "Then reload this nats-server (SIGHUP)");
  auto* revoke = node->add_subcommand("revoke", "Remove a node's NATS key");
  revoke->add_option("node_id", o->node_id, "Node id")->required();
  keys_opt(revoke);
  revoke->add_option("--nats-config", o->out, "Then rewrite this authorization config");
  revoke->add_option("--reload-pid-file", o->pid_file, "Then reload this nats-server (SIGHUP)");

  return [=](const Globals& g) -> std::optional<int> {
    if (!init->parsed() && !conf->parsed() && !login->parsed() && !enroll->parsed() &&
        !revoke->parsed()) {
      return std::nullopt;
    }
    auto c = Contract(o->contract);
    if (!c.ok()) return Fail(g, c.error());
    if (init->parsed()) {
      if (auto r = access::InitKeys(*c, o->keys); !r.ok()) return Fail(g, r.error());
      std::cerr << "keys in " << o->keys << "\n";
      return kExitOk;
    }
    if (conf->parsed()) {
      if (auto r = Render(*c, o->keys, o->out, o->pid_file); !r.ok()) return Fail(g, r.error());
      return kExitOk;
    }
    if (login->parsed()) {
      if (o->issuer == "tenant" && o->role != auth::kRoleTenant) {
        return Usage(g, Error::InvalidArgument(reason::kIssuerRole,
                                               "the tenant issuer signs tenant tokens only"));
      }
      auto pem = Read(o->issuer == "tenant" ? access::TenantTokenSigningKeyPath(o->keys)
                                            : access::TokenSigningKeyPath(o->keys));
      if (!pem.ok()) return Fail(g, pem.error());
      const auto ttl = ParseSeconds(o->ttl);
      if (!ttl || *ttl <= 0) {
        return Usage(g, Error::InvalidArgument(reason::kInvalidTtl, "--ttl is <n>s|<n>m|<n>h"));
      }
      auth::Principal p;
      p.subject =
          o->user.find(':') == std::string::npos
              ? (o->tenant.empty() ? "user:" + o->user : "tenant:" + o->tenant + "/" + o->user)
              : o->user;
      p.tenant = o->tenant;
      p.roles = {o->role};
      auto token = auth::IssueToken(*pem, p, std::chrono::seconds(*ttl));
      if (!token.ok()) return Usage(g, token.error());
      if (o->out.empty()) {
        std::cout << *token << "\n";
      } else if (auto w = auth::WriteSecretFile(o->out, *token + "\n"); !w.ok()) {
        return Fail(g, w.error());
      }
      return kExitOk;
    }
    if (enroll->parsed()) {
      auto seed = access::EnrollNode(o->keys, o->node_id);
      if (!seed.ok()) return Fail(g, seed.error());
      if (o->seed_out.empty()) {
        std::cout << *seed << "\n";
      } else if (auto w = auth::WriteSecretFile(o->seed_out, *seed + "\n"); !w.ok()) {
        return Fail(g, w.error());
      }
    } else {
      if (auto r = access::RevokeNode(o->keys, o->node_id); !r.ok()) return Fail(g, r.error());
    }
    if (!o->out.empty()) {
      if (auto r = Render(*c, o->keys, o->out, o->pid_file); !r.ok()) return Fail(g, r.error());
    }
    std::cerr << o->node_id << (enroll->parsed() ? " enrolled" : " revoked") << "\n";
    return kExitOk;
  };
}

}  // namespace gpuaas::ctl
