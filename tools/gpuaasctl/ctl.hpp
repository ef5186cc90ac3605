#pragma once
// Shared pieces of gpuaasctl: global flags, exit codes, structured error output, tables, JSON,
// enum-valued flags, paging, and the registry of command groups (each group adds its subcommands
// and returns the action that runs when one of them was parsed).
#include <google/protobuf/message.h>
#include <google/protobuf/timestamp.pb.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include <CLI/CLI.hpp>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/common/rpc.hpp"

namespace gpuaas::ctl {

// The exit codes (README "Exit codes", and the --help footer).
inline constexpr int kExitOk = 0;
// The platform answered an error (its Status is printed).
inline constexpr int kExitError = 1;
// A usage error: unknown flag, missing or invalid argument.
inline constexpr int kExitUsage = 2;
// NATS could not be reached or the request timed out (the transport's UNAVAILABLE /
// DEADLINE_EXCEEDED), or --watch-timeout-s passed while a task was still in flight.
inline constexpr int kExitUnreachable = 3;
// The request was answered but did not reach the outcome asked for: a --watch settled in another
// state, slot approve/repair rejected a slot, or app check found the app incompatible.
inline constexpr int kExitOutcome = 4;

// The --help footer naming the exit codes.
const std::string& ExitCodesHelp();

struct Globals {
  std::string nats_url;
  std::string seed_file;          // this client's NATS nkey seed
  std::string role = "operator";  // the client role the seed belongs to (its reply inbox)
  std::string token;              // the request token (Authorization: Bearer)
  std::string output = "text";    // text | json ("table" is read as text)
  int64_t timeout_ms = 10000;
  // Set while a --watch streams: JSON output is one compact object per line (JSON Lines).
  bool json_lines = false;
  bool Json() const { return output == "json"; }
  std::chrono::milliseconds Timeout() const { return std::chrono::milliseconds(timeout_ms); }
};

// Prints a structured error: the gpuaas.v1.Status as JSON on stdout with -o json, else
// "error: CODE reason: message {details}" on stderr. Returns kExitUnreachable for the transport's
// UNAVAILABLE / DEADLINE_EXCEEDED (no service answered), else kExitError.
int Fail(const Globals& g, const Error& e);
// Prints a usage error found after parsing (same format as Fail) and returns kExitUsage.
int Usage(const Globals& g, const Error& e);
// True when `e` comes from the transport (NATS unreachable, no responders, timed out) rather
// than from a service's reply.
bool FromTransport(const Error& e);

// Protobuf's JSON printer: proto field names, enum values as their proto names.
std::string ToJson(const google::protobuf::Message& m, bool pretty = true);
// Prints `m` as JSON when -o json (one document; one line under --watch); else runs `text`.
// Returns kExitOk.
int Print(const Globals& g, const google::protobuf::Message& m, const std::function<void()>& text);

void PrintTable(const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows);
std::string Time(const google::protobuf::Timestamp& t);
std::string Join(const std::vector<std::string>& items, const std::string& sep = ",");
// A duration flag: "90s", "15m", "2h", "7d" or plain seconds ("90"), in seconds; nullopt for
// anything else (at most 9 digits).
std::optional<int64_t> ParseSeconds(const std::string& text);
// `s`, or `dash` when it is empty.
std::string Or(const std::string& s, const std::string& dash = "-");

// An enum value's text (enums.hpp), or `dash` for UNSPECIFIED.
template <typename E>
std::string Txt(E value, const std::string& dash = "-") {
  return Or(enums::Text(value), dash);
}

// Restricts `opt` to `values` (another value is a usage error, exit 2; --help lists them) and
// offers them in shell completion.
CLI::Option* OneOf(CLI::Option* opt, const std::vector<std::string>& values);
// Offers `values` in shell completion without restricting the option.
CLI::Option* Suggest(CLI::Option* opt, const std::vector<std::string>& values);
// An enum-valued flag: one of E's texts (enums::Texts).
template <typename E>
CLI::Option* OneOfEnum(CLI::Option* opt) {
  return OneOf(opt, enums::Texts<E>());
}
// The completion values registered for `opt` (empty when none).
const std::vector<std::string>& CompletionValues(const CLI::Option* opt);

// Parses an enum-valued flag: nullopt (and *rc set to the usage exit code, the error printed)
// when `text` is not one of E's texts; UNSPECIFIED when `text` is empty.
template <typename E>
std::optional<E> ParseFlag(const Globals& g, std::string_view field, const std::string& text,
                           int* rc) {
  if (text.empty()) return static_cast<E>(0);
  auto v = enums::ParseField<E>(field, text);
  if (!v.ok()) {
    *rc = Usage(g, v.error());
    return std::nullopt;
  }
  return *v;
}

// Calls a paginated list subject until the last page; `add` takes each page.
template <typename Resp, typename Req>
Result<void> ListAll(rpc::Client& client, const std::string& subject, Req req,
                     std::chrono::milliseconds timeout, const std::function<void(Resp&)>& add) {
  req.set_page_size(500);
  do {
    auto r = client.Call<Resp>(subject, req, timeout);
    if (!r.ok()) return r.error();
    add(*r);
    req.set_page_token(r->next_page_token());
  } while (!req.page_token().empty());
  return Ok();
}

// Runs the parsed subcommand of a group, or nullopt when none of the group's was parsed.
using Action = std::function<std::optional<int>(rpc::Client&, const Globals&)>;

// A group's action from its commands' (each added by its own function, each nullopt unless its
// command was parsed): the first that ran, or nullopt.
template <typename ActionT>
ActionT FirstOf(std::vector<ActionT> actions) {
  return [actions = std::move(actions)](auto&... args) -> std::optional<int> {
    for (const auto& action : actions) {
      if (auto rc = action(args...)) return rc;
    }
    return std::nullopt;
  };
}

// node register/list, scheduler nodes/rebuild-projection (node_commands.cpp).
Action AddNodeCommands(CLI::App& app);
// Inventory slot/topology/region commands, scheduler slots (inventory_commands.cpp); after
// AddNodeCommands (it adds to the node and scheduler groups).
Action AddInventoryCommands(CLI::App& app);
// node drain/undrain/maintenance/holders (host_commands.cpp), under the existing "node".
Action AddHostCommands(CLI::App& node);
// ipam reservations/leases/drift/network/subnet/release/reprovision (ipam_commands.cpp).
Action AddIpamCommands(CLI::App& app);
// Allocation commands (alloc_commands.cpp).
Action AddAllocCommands(CLI::App& app);
// catalog [list] (catalog_commands.cpp).
Action AddCatalogCommands(CLI::App& app);
// app list|check (app_commands.cpp).
Action AddAppCommands(CLI::App& app);
// ingress pool set|list|delete, expose, unexpose, exposures, node (ingress_commands.cpp).
Action AddIngressCommands(CLI::App& app);
Action AddUsageCommands(CLI::App& app);
// console open|list|revoke (console_commands.cpp).
Action AddConsoleCommands(CLI::App& app);

// An action that works on the NATS connection itself (JetStream reads), not by requests.
using ConnAction = std::function<std::optional<int>(messaging::Connection&, const Globals&)>;
// audit allocation|slot|node (audit_commands.cpp): an entity's history from the event streams.
ConnAction AddAuditCommands(CLI::App& app);
// streams apply (streams_commands.cpp): declares the platform's streams (the deploy identity).
ConnAction AddStreamsCommands(CLI::App& app);

// dlq list|show|replay|discard (dlq_commands.cpp): reads and discards in GPUAAS_DLQ over the
// connection, replays through the owning service's request.
using DlqAction =
    std::function<std::optional<int>(messaging::Connection&, rpc::Client&, const Globals&)>;
DlqAction AddDlqCommands(CLI::App& app);

// auth init/nats-config/login, node enroll/revoke (auth_commands.cpp): no NATS needed; after
// AddNodeCommands (it adds to the node group).
std::function<std::optional<int>(const Globals&)> AddAuthCommands(CLI::App& app);
// auth revoke / revocations (revoke_commands.cpp): after AddAuthCommands, under its "auth".
Action AddRevokeCommands(CLI::App& app);

// `completion bash` (completion.cpp): the script completes every command, subcommand and flag
// of `app` (walked at run time, so it cannot drift) and the values of enum-valued flags. The
// returned action needs no NATS; it returns nullopt when `completion` was not parsed.
std::function<std::optional<int>()> AddCompletionCommand(CLI::App& app);
// Writes the bash completion script of `app`'s command tree to `out`.
void PrintBashCompletion(const CLI::App& app, std::ostream& out);

}  // namespace gpuaas::ctl
