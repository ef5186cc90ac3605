// gpuaasctl: the operator/tenant CLI. It talks to the services over NATS only, like any other
// client. Output: human text by default, `-o json` (protobuf's JSON printer) for scripts. Errors
// print the structured status (code, reason, message, details). Exit codes: ctl.hpp / README.
#include <cstdlib>
#include <fstream>
#include <iostream>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "ctl.hpp"
#include "ctl_reasons.hpp"
#include "gpuaas/common/access.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/rpc.hpp"

#ifndef GPUAASCTL_VERSION
#define GPUAASCTL_VERSION "unknown"
#endif

namespace gpuaas::ctl {
// status (status_commands.cpp): the platform's health summary; it reads GPUAAS_DLQ over the
// connection besides its requests.
DlqAction AddStatusCommand(CLI::App& app);
}  // namespace gpuaas::ctl

using namespace gpuaas;
using namespace gpuaas::ctl;

int main(int argc, char** argv) {
  CLI::App app{"gpuaasctl: manage the GPU cloud control plane over NATS", "gpuaasctl"};
  app.require_subcommand(1);
  // Global flags are accepted after any subcommand too (gpuaasctl alloc list -o json).
  app.fallthrough();
  app.footer(ExitCodesHelp());
  app.set_version_flag("--version", std::string("gpuaasctl ") + GPUAASCTL_VERSION,
                       "Print the version and exit");
  Globals g;
  const char* env_url = std::getenv("GPUAAS_NATS_URL");
  g.nats_url = env_url ? env_url : "nats://127.0.0.1:4222";
  app.add_option("--nats", g.nats_url, "NATS URL (env GPUAAS_NATS_URL)")->capture_default_str();
  Suggest(app.add_option("-o,--output", g.output,
                         "Output: text (default; `table` is the same) or json (protobuf JSON; "
                         "JSON Lines under --watch)")
              ->check(CLI::IsMember({"text", "json", "table"})),
          {"text", "json"});
  app.add_option("--timeout-ms", g.timeout_ms, "Request timeout")->capture_default_str();
  auto env = [](const char* name, const char* def = "") {
    const char* v = std::getenv(name);
    return std::string(v != nullptr ? v : def);
  };
  g.seed_file = env("GPUAAS_NATS_SEED_FILE");
  app.add_option("--nats-seed-file", g.seed_file,
                 "This client's NATS nkey seed file (env GPUAAS_NATS_SEED_FILE)");
  std::string tls_ca = env("GPUAAS_NATS_TLS_CA_FILE");
  app.add_option("--nats-tls-ca-file", tls_ca,
                 "Verify the NATS server's TLS certificate against this CA (env "
                 "GPUAAS_NATS_TLS_CA_FILE)");
  g.role = env("GPUAAS_ROLE", "operator");
  Suggest(app.add_option("--role", g.role,
                         "The role of the seed: operator | tenant-api | auditor | deployer "
                         "(streams apply) (env GPUAAS_ROLE)")
              ->capture_default_str(),
          {"operator", "tenant-api", "auditor", "deployer"});
  std::string token_file = env("GPUAAS_TOKEN_FILE");
  g.token = env("GPUAAS_TOKEN");
  app.add_option("--token", g.token, "Request token (env GPUAAS_TOKEN; `auth login` issues one)");
  app.add_option("--token-file", token_file,
                 "File holding the request token (env GPUAAS_TOKEN_FILE)");

  const std::vector<Action> actions = {
      AddNodeCommands(app),    AddInventoryCommands(app), AddAllocCommands(app),
      AddIpamCommands(app),    AddCatalogCommands(app),   AddAppCommands(app),
      AddIngressCommands(app), AddConsoleCommands(app),   AddUsageCommands(app)};
  const auto audit_action = AddAuditCommands(app);
  const auto streams_action = AddStreamsCommands(app);
  const auto dlq_action = AddDlqCommands(app);
  const auto status_action = AddStatusCommand(app);
  const auto auth_action = AddAuthCommands(app);
  const auto revoke_action = AddRevokeCommands(app);
  const auto completion = AddCompletionCommand(app);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every usage error exits 2 (CLI11's own codes are 100+).
    return app.exit(e) == 0 ? kExitOk : kExitUsage;
  }
  if (g.output == "table") g.output = "text";
  // A --watch streams: its JSON output is one object per line (JSON Lines), errors included.
  for (const CLI::App* cmd = &app; cmd != nullptr;
       cmd = cmd->get_subcommands().empty() ? nullptr : cmd->get_subcommands().front()) {
    const CLI::Option* watch = cmd->get_option_no_throw("--watch");
    if (watch != nullptr && watch->count() > 0) g.json_lines = true;
  }

  if (auto rc = completion()) return *rc;
  if (auto rc = auth_action(g)) return *rc;
  if (g.token.empty() && !token_file.empty()) {
    std::ifstream in(token_file);
    in >> g.token;
    if (!in && g.token.empty()) {
      return Usage(g, Error::InvalidArgument(ctl::reason::kTokenFile, "cannot read " + token_file));
    }
  }

  log::Logger quiet("gpuaasctl", "cli", log::Level::kError);
  messaging::ConnectionOptions co;
  co.url = g.nats_url;
  co.name = "gpuaasctl";
  co.retry_on_failed_connect = false;
  co.seed_file = g.seed_file;
  co.inbox_prefix = access::InboxPrefix(g.role);
  co.client_role = access::ClientRoleOf(access::EmbeddedContract(), g.role);
  co.tls_ca_file = tls_ca;
  auto conn = messaging::Connection::Connect(co, quiet);
  if (!conn.ok()) return Fail(g, conn.error());
  rpc::Client client(*conn);
  client.WithToken(g.token);

  if (auto rc = audit_action(**conn, g)) return *rc;
  if (auto rc = streams_action(**conn, g)) return *rc;
  if (auto rc = dlq_action(**conn, client, g)) return *rc;
  if (auto rc = status_action(**conn, client, g)) return *rc;
  for (const auto& action : actions) {
    if (auto rc = action(client, g)) return *rc;
  }
  if (auto rc = revoke_action(client, g)) return *rc;
  return kExitOk;
}
