#pragma once
// Who may do what on NATS, derived from the contract: asyncapi/roles.yaml (the roles) and each
// operation's `x-gpuaas-access` in asyncapi/gpuaas.asyncapi.yaml (who performs it, who may call
// it, which durable consumes it). From the two this renders the nats-server `authorization`
// block: one user per role key and per enrolled node, each with exactly the publish/subscribe
// subjects its operations need. The same code serves `gpuaasctl auth nats-config` (scripts/up,
// deploy/k8s) and the tests, so what runs is what the contract says.
//
// A keys directory holds the identities: <role>.seed / <role>.pub per role, nodes/<id>.pub per
// enrolled node (its seed goes to the host once and is not kept), token-signing.pem and
// token-signing.pub.pem (request tokens).
#include <map>
#include <optional>
#include <set>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"

namespace gpuaas::access {

// kDeploy: a one-shot deploy-time identity (`gpuaasctl streams apply`): it declares the platform
// streams and does nothing else.
enum class Kind { kService, kNode, kClient, kDeploy };

struct Role {
  std::string name;
  Kind kind = Kind::kClient;
  std::string ns;                         // services: the subjects they serve
  std::vector<std::string> read_streams;  // clients: streams they may read
  std::vector<std::string> token_roles;   // clients: token roles they may present
};

struct Consumer {
  std::string role;
  std::string durable;     // may contain {node_id}
  std::string managed_by;  // the service that creates it ("" = the role itself)
  std::string stream;      // the stream holding the channel (derived)
};

struct Operation {
  std::string name;
  std::string action;   // send | receive
  std::string address;  // the channel's address, with {params}
  bool reply = false;   // a request served with a reply
  bool core = false;    // a plain core-NATS subscription (no stream, no durable): live relays
  // With core: the subject is also stored; each instance follows it live and reads the stream
  // at start (its roles must read that stream: read_streams). Token revocations.
  bool live_copy = false;
  std::vector<std::string> roles;
  std::vector<std::string> callers;
  // Gateways (services) that may forward a client caller's request token to it (console-gw's
  // operator page): they may publish it, and the serving service still requires the token (a
  // gateway never becomes an internal caller).
  std::vector<std::string> via;
  std::vector<Consumer> consumers;
};

struct Contract {
  std::map<std::string, Role> roles;
  std::map<std::string, std::vector<std::string>> streams;  // name -> subjects
  std::vector<Operation> operations;
};

// Reads <dir>/gpuaas.asyncapi.yaml and <dir>/roles.yaml. Every problem is a contract error
// (FAILED_PRECONDITION contract_access, details: one entry per problem): an operation without
// x-gpuaas-access, a role not declared, a served subject outside its service's namespace, a
// consumed channel no stream holds, a consume operation without its durable.
Result<Contract> LoadContract(const std::string& dir);
// The same from the documents' text.
Result<Contract> ParseContract(const std::string& asyncapi_yaml, const std::string& roles_yaml);
// The contract this binary was built with (parsed once; aborts when it is invalid, which the
// contract tests rule out before anything ships).
const Contract& EmbeddedContract();

// Who may send a request on a served subject, for the service's request check (rpc.hpp):
// `token_roles` are the request-token roles of the client roles among its callers; `internal`
// says a platform identity (a service, a node) may call it without a token.
struct RequestAccess {
  bool declared = false;  // some operation serves this subject
  bool internal = false;
  std::vector<std::string> token_roles;
};
RequestAccess RequestAccessFor(const Contract& c, const std::string& subject);

struct Permissions {
  std::set<std::string> publish;
  std::set<std::string> subscribe;
  bool allow_responses = false;  // may answer requests on their reply subjects
};

// `node_id` is required for (and only for) the node role.
Result<Permissions> PermissionsFor(const Contract& c, const std::string& role,
                                   const std::string& node_id = "");

// A client role's requests travel on `<subject>.<client role>`: a client identity may publish a
// request subject only with its own role appended (PermissionsFor), so the serving service
// knows, on the server's word, which kind of connection sent it and refuses a token that role
// may not present (roles.yaml token_roles; PERMISSION_DENIED
// token_role_not_allowed_for_connection). Platform identities (services, nodes) call the
// subject itself. messaging::Connection appends the role of a client connection
// (ConnectionOptions::client_role); rpc::Server strips it (ServedSubject).
std::string ClientSubject(const std::string& subject, const std::string& client_role);
// `role` if it is a client role of `c` (what ConnectionOptions::client_role takes), else "".
std::string ClientRoleOf(const Contract& c, const std::string& role);
// The subject as served and the client role a request on `wire` came through: `wire` itself and
// "" when `is_served(wire)`, else, when its last token is a client role of `c` and the rest is
// served, the rest and that role; nullopt otherwise.
struct ServedSubject {
  std::string subject;
  std::string client_role;
};
template <typename IsServed>
std::optional<ServedSubject> ResolveServed(const Contract& c, const std::string& wire,
                                           const IsServed& is_served) {
  if (is_served(wire)) return ServedSubject{wire, ""};
  const auto dot = wire.rfind('.');
  if (dot == std::string::npos) return std::nullopt;
  auto it = c.roles.find(wire.substr(dot + 1));
  if (it == c.roles.end() || it->second.kind != Kind::kClient) return std::nullopt;
  std::string served = wire.substr(0, dot);
  if (!is_served(served)) return std::nullopt;
  return ServedSubject{std::move(served), it->first};
}

// The reply-subject prefix of an identity: _INBOX.<role>, a node's _INBOX.node.<node_id> (so no
// node id can name a role's inbox; no role may be called "node").
std::string InboxPrefix(const std::string& role, const std::string& node_id = "");

// The inbox prefixes a service answers on: those of every role that may call (or, as a gateway,
// forward) a request it serves; all nodes' as one, _INBOX.node. A service publishes replies
// there and nowhere else.
std::set<std::string> ReplyInboxes(const Contract& c, const std::string& role);

// The streams a role uses: those its durables read, those its published subjects land in, those
// it reads by sequence, and the dead-letter stream where it has a durable. A service may look
// each up (STREAM.INFO) to check it is declared; only the deploy role creates or updates one.
std::set<std::string> UsedStreams(const Contract& c, const std::string& role);

struct User {
  std::string nkey;  // public key "U..."
  std::string role;
  std::string node_id;  // node role only
};

// The nats-server config block `authorization { users = [...] }` (no anonymous users: a
// connection without a listed key is refused). `extra` is appended verbatim inside the users list
// (the tests' harness user); every service may also answer on `also_answer` (inbox prefixes: the
// harness's, which calls any service in the tests).
Result<std::string> RenderAuthorization(const Contract& c, const std::vector<User>& users,
                                        const std::string& extra = "",
                                        const std::set<std::string>& also_answer = {});

// ---- keys directory ----
// Creates the missing keys of every role of `c` and the token signing keys (the platform's and the
// tenant issuer's); keeps existing ones.
Result<void> InitKeys(const Contract& c, const std::string& dir);
// The users of a keys directory: every role's <role>.pub and every nodes/<id>.pub.
Result<std::vector<User>> UsersFromKeys(const Contract& c, const std::string& dir);
// A new key for node `node_id` (nodes/<id>.pub written; ALREADY_EXISTS when enrolled): returns the
// seed, which is not stored.
Result<std::string> EnrollNode(const std::string& dir, const std::string& node_id);
// Removes nodes/<id>.pub (NOT_FOUND when not enrolled).
Result<void> RevokeNode(const std::string& dir, const std::string& node_id);
std::string SeedPath(const std::string& dir, const std::string& role);
std::string TokenSigningKeyPath(const std::string& dir);
std::string TokenPublicKeyPath(const std::string& dir);
// The tenant issuer's key pair (token-tenant.pem / .pub.pem): signs tenant tokens only
// (auth::VerifyIssuedToken); the tenant gateway holds the private key.
std::string TenantTokenSigningKeyPath(const std::string& dir);
std::string TenantTokenPublicKeyPath(const std::string& dir);

// The dot-separated tokens of a subject or pattern.
std::vector<std::string> SubjectTokens(const std::string& subject);
// True when `subject` (no wildcards) matches the NATS pattern `pattern` (* and >).
bool SubjectMatches(const std::string& pattern, const std::string& subject);
// The values an operation's address binds when `subject` is that address with each `{param}`
// token filled in (e.g. "gpuaas.v1.ipam.node.{node_id}.network.get" and
// "gpuaas.v1.ipam.node.gpu-07.network.get" bind node_id=gpu-07); nullopt when it is not. A
// bound value is one non-empty token without wildcards. An address with no parameters binds
// nothing and matches only itself.
std::optional<std::map<std::string, std::string>> BindAddress(const std::string& address,
                                                              const std::string& subject);

}  // namespace gpuaas::access
