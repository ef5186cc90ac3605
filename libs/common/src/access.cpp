#include "gpuaas/common/access.hpp"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/reasons.hpp"

namespace gpuaas::access {

namespace fs = std::filesystem;

namespace {

constexpr const char* kDeadLetterStream = "GPUAAS_DLQ";
// x-gpuaas-access consumers durable '*': any durable of the role's choosing.
constexpr const char* kAnyDurable = "*";
constexpr const char* kOperatorRole = "operator";
constexpr const char* kNodeSubjects = "gpuaas.v1.node.{node_id}.";
// Every node's inbox is under it (InboxPrefix), apart from every role's.
constexpr const char* kNodeInboxes = "_INBOX.node";
constexpr const char* kNodeInboxToken = "node";

std::vector<std::string> Strings(const YAML::Node& n) {
  std::vector<std::string> out;
  if (!n) return out;
  for (const auto& v : n) out.push_back(v.as<std::string>());
  return out;
}

// A token with a `{param}` becomes `*` (NATS wildcards are whole tokens: `node-{node_id}` is
// `*` too), except that `{node_id}` takes the node's id when one is given.
std::string Bind(const std::string& address, const std::string& node_id) {
  std::string out;
  for (auto t : SubjectTokens(address)) {
    if (!out.empty()) out += '.';
    const std::string param = "{node_id}";
    if (!node_id.empty()) {
      for (size_t at = t.find(param); at != std::string::npos; at = t.find(param)) {
        t.replace(at, param.size(), node_id);
      }
    }
    out += t.find('{') != std::string::npos ? "*" : t;
  }
  return out;
}

// Whether every subject `inner` (a pattern) can match is matched by `outer`.
bool Covers(const std::string& outer, const std::string& inner) {
  auto o = SubjectTokens(outer);
  auto i = SubjectTokens(inner);
  for (size_t k = 0; k < o.size(); ++k) {
    if (o[k] == ">") return k < i.size();
    if (k >= i.size()) return false;
    if (i[k] == ">") return false;
    if (o[k] == "*") continue;
    if (o[k] != i[k]) return false;
  }
  return o.size() == i.size();
}

bool Contains(const std::vector<std::string>& v, const std::string& s) {
  return std::find(v.begin(), v.end(), s) != v.end();
}

Result<std::string> ReadFile(const std::string& path) {
  std::ifstream in(path);
  if (!in) return Error::NotFound(reason::kFileMissing, "cannot read " + path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

}  // namespace

std::vector<std::string> SubjectTokens(const std::string& subject) {
  std::vector<std::string> out;
  std::stringstream ss(subject);
  std::string t;
  while (std::getline(ss, t, '.')) out.push_back(t);
  return out;
}

bool SubjectMatches(const std::string& pattern, const std::string& subject) {
  return Covers(pattern, subject);
}

std::optional<std::map<std::string, std::string>> BindAddress(const std::string& address,
                                                              const std::string& subject) {
  std::map<std::string, std::string> bound;
  if (address.find('{') == std::string::npos) {
    if (address == subject) return bound;
    return std::nullopt;
  }
  const auto pattern = SubjectTokens(address);
  const auto tokens = SubjectTokens(subject);
  if (pattern.size() != tokens.size()) return std::nullopt;
  for (size_t i = 0; i < pattern.size(); ++i) {
    const auto& p = pattern[i];
    if (p.size() > 2 && p.front() == '{' && p.back() == '}') {
      if (tokens[i].empty() || tokens[i] == "*" || tokens[i] == ">") return std::nullopt;
      bound[p.substr(1, p.size() - 2)] = tokens[i];
    } else if (p != tokens[i]) {
      return std::nullopt;
    }
  }
  return bound;
}

std::string ClientSubject(const std::string& subject, const std::string& client_role) {
  return subject + "." + client_role;
}

std::string ClientRoleOf(const Contract& c, const std::string& role) {
  auto it = c.roles.find(role);
  return it != c.roles.end() && it->second.kind == Kind::kClient ? role : std::string();
}

std::string InboxPrefix(const std::string& role, const std::string& node_id) {
  return node_id.empty() ? "_INBOX." + role : std::string(kNodeInboxes) + "." + node_id;
}

std::set<std::string> ReplyInboxes(const Contract& c, const std::string& role) {
  std::set<std::string> out;
  for (const auto& op : c.operations) {
    if (!op.reply || !Contains(op.roles, role)) continue;
    for (const auto* callers : {&op.callers, &op.via}) {
      for (const auto& caller : *callers) {
        auto it = c.roles.find(caller);
        if (it == c.roles.end()) continue;
        out.insert(it->second.kind == Kind::kNode ? kNodeInboxes : InboxPrefix(caller));
      }
    }
  }
  return out;
}

std::set<std::string> UsedStreams(const Contract& c, const std::string& role) {
  std::set<std::string> used;
  auto it = c.roles.find(role);
  if (it == c.roles.end()) return used;
  used.insert(it->second.read_streams.begin(), it->second.read_streams.end());
  for (const auto& op : c.operations) {
    for (const auto& k : op.consumers) {
      if (k.role != role && k.managed_by != role) continue;
      used.insert(k.stream);
      if (k.durable != kAnyDurable) used.insert(kDeadLetterStream);
    }
    if (op.action != "send" || !Contains(op.roles, role)) continue;
    const std::string subject = Bind(op.address, "");
    for (const auto& [stream, subjects] : c.streams) {
      for (const auto& s : subjects) {
        if (Covers(s, subject)) used.insert(stream);
      }
    }
  }
  return used;
}

const char* EmbeddedAsyncApi();  // contract_embed.cpp (generated)
const char* EmbeddedRoles();

Result<Contract> LoadContract(const std::string& dir) {
  auto doc = ReadFile(dir + "/gpuaas.asyncapi.yaml");
  if (!doc.ok()) return doc.error();
  auto roles = ReadFile(dir + "/roles.yaml");
  if (!roles.ok()) return roles.error();
  return ParseContract(*doc, *roles);
}

const Contract& EmbeddedContract() {
  static const Contract* c = [] {
    auto r = ParseContract(EmbeddedAsyncApi(), EmbeddedRoles());
    if (!r.ok()) {
      fprintf(stderr, "the embedded contract is invalid: %s\n", r.error().ToString().c_str());
      std::abort();
    }
    return new Contract(std::move(*r));
  }();
  return *c;
}

RequestAccess RequestAccessFor(const Contract& c, const std::string& subject) {
  RequestAccess a;
  for (const auto& op : c.operations) {
    if (!op.reply || !Covers(Bind(op.address, ""), subject)) continue;
    a.declared = true;
    for (const auto& caller : op.callers) {
      auto it = c.roles.find(caller);
      if (it == c.roles.end()) continue;
      if (it->second.kind != Kind::kClient) {
        a.internal = true;
        continue;
      }
      for (const auto& t : it->second.token_roles) {
        if (!Contains(a.token_roles, t)) a.token_roles.push_back(t);
      }
    }
  }
  return a;
}

namespace {
// roles.yaml: the roles, their kinds and token roles, and the streams.
void ParseRoles(const YAML::Node& roles, Contract& c,
                std::map<std::string, std::string>& problems) {
  for (const auto& r : roles["roles"]) {
    Role role;
    role.name = r.first.as<std::string>();
    const std::string kind = r.second["kind"].as<std::string>("");
    if (kind == "service") {
      role.kind = Kind::kService;
    } else if (kind == "node") {
      role.kind = Kind::kNode;
    } else if (kind == "client") {
      role.kind = Kind::kClient;
    } else if (kind == "deploy") {
      role.kind = Kind::kDeploy;
    } else {
      problems["role " + role.name] =
          "kind must be service | node | client | deploy, not '" + kind + "'";
    }
    if (role.name == kNodeInboxToken) {
      problems["role " + role.name] = "reserved: nodes' inboxes are _INBOX.node.<node id>";
    }
    role.ns = r.second["namespace"].as<std::string>("");
    if (role.kind == Kind::kService && role.ns.empty()) {
      problems["role " + role.name] = "a service needs a namespace";
    }
    role.read_streams = Strings(r.second["read_streams"]);
    role.token_roles = Strings(roles["token_roles"][role.name]);

    c.roles[role.name] = role;
  }
  for (const auto& s : roles["streams"]) {
    c.streams[s.first.as<std::string>()] = Strings(s.second);
  }
  for (const auto& [name, role] : c.roles) {
    for (const auto& s : role.read_streams) {
      if (!c.streams.count(s)) problems["role " + name] = "reads unknown stream " + s;
    }
  }
}
}  // namespace

Result<Contract> ParseContract(const std::string& asyncapi_yaml, const std::string& roles_yaml) {
  Contract c;
  std::map<std::string, std::string> problems;
  YAML::Node doc;
  YAML::Node roles;
  try {
    doc = YAML::Load(asyncapi_yaml);
    roles = YAML::Load(roles_yaml);
  } catch (const std::exception& e) {
    return Error::FailedPrecondition(reason::kContractUnreadable,
                                     std::string("the contract does not parse: ") + e.what());
  }
  try {
    ParseRoles(roles, c, problems);
    std::map<std::string, std::string> addresses;
    for (const auto& ch : doc["channels"]) {
      addresses[ch.first.as<std::string>()] = ch.second["address"].as<std::string>("");
    }
    auto known = [&](const std::string& where, const std::string& role) {
      if (!c.roles.count(role)) problems[where] = "names undeclared role '" + role + "'";
    };
    for (const auto& o : doc["operations"]) {
      Operation op;
      op.name = o.first.as<std::string>();
      const std::string where = "operation " + op.name;
      op.action = o.second["action"].as<std::string>("");
      std::string ref = o.second["channel"]["$ref"].as<std::string>("");
      ref = ref.substr(ref.rfind('/') + 1);
      if (!addresses.count(ref)) {
        problems[where] = "channel " + ref + " is not declared";
        continue;
      }
      op.address = addresses[ref];
      op.reply = static_cast<bool>(o.second["reply"]);
      const YAML::Node a = o.second["x-gpuaas-access"];
      if (!a) {
        problems[where] = "has no x-gpuaas-access: nobody could use " + op.address;
        continue;
      }
      op.roles = Strings(a["roles"]);
      op.callers = Strings(a["callers"]);
      op.core = a["core"].as<bool>(false);
      op.live_copy = a["live_copy"].as<bool>(false);
      op.via = Strings(a["via"]);
      for (const auto& g : op.via) {
        auto it = c.roles.find(g);
        if (it == c.roles.end() || it->second.kind != Kind::kService || !op.reply) {
          problems[where] = "via " + g + ": only a service may forward a request's token";
        }
      }
      // `every_consumer: true`: what every durable consumer does (publishDeadLetter); each
      // consumer's grant carries it (below), no role is named.
      const bool every_consumer = a["every_consumer"].as<bool>(false);
      if (every_consumer && (!op.roles.empty() || op.reply)) {
        problems[where] = "every_consumer is for a publication no role names";
      }
      if (op.roles.empty() && !every_consumer) {
        problems[where] = "x-gpuaas-access.roles is empty";
      }
      for (const auto& r : op.roles) known(where, r);
      for (const auto& r : op.callers) known(where, r);
      if (op.reply && op.callers.empty()) problems[where] = "a request nobody may call";
      if (op.reply) {
        for (const auto& r : op.roles) {
          auto it = c.roles.find(r);
          if (it == c.roles.end()) continue;
          // A service serves its namespace; a node serves only subjects bound to its own id
          // under gpuaas.v1.node.{node_id}.
          const bool ok =
              it->second.kind == Kind::kService
                  ? Covers(it->second.ns, Bind(op.address, ""))
                  : it->second.kind == Kind::kNode && op.address.rfind(kNodeSubjects, 0) == 0;
          if (!ok) {
            problems[where] = op.address + " is served by " + r + " but outside its namespace";
          }
        }
      }
      for (const auto& k : a["consumers"]) {
        Consumer cons;
        cons.role = k["role"].as<std::string>("");
        cons.durable = k["durable"].as<std::string>("");
        cons.managed_by = k["managed_by"].as<std::string>("");
        known(where, cons.role);
        if (!cons.managed_by.empty()) known(where, cons.managed_by);
        if (!Contains(op.roles, cons.role)) {
          problems[where] = "consumer role " + cons.role + " is not among its roles";
        }
        const std::string subject = Bind(op.address, "");
        for (const auto& [stream, subjects] : c.streams) {
          for (const auto& s : subjects) {
            if (Covers(s, subject)) cons.stream = stream;
          }
        }
        if (cons.stream.empty()) problems[where] = "no stream holds " + op.address;
        if (cons.durable.empty()) problems[where] = "a consumer without a durable";
        op.consumers.push_back(cons);
      }
      if (op.core) {
        const std::string subject = Bind(op.address, "");
        for (const auto& [stream, subjects] : c.streams) {
          for (const auto& s : subjects) {
            if (!Covers(s, subject) && !Covers(subject, s)) continue;
            if (!op.live_copy) {
              problems[where] =
                  "a core subscription on " + op.address + ", which stream " + stream + " holds";
            }
            for (const auto& role : op.live_copy ? op.roles : std::vector<std::string>{}) {
              auto it = c.roles.find(role);
              if (it != c.roles.end() && !Contains(it->second.read_streams, stream)) {
                problems[where] =
                    fmt::format("live_copy: {} does not read stream {}", role, stream);
              }
            }
          }
        }
        if (op.live_copy && problems.count(where) == 0) {
          bool stored = false;
          for (const auto& [stream, subjects] : c.streams) {
            for (const auto& s : subjects) stored = stored || Covers(s, subject);
          }
          if (!stored) problems[where] = "live_copy on " + op.address + ", which no stream holds";
        }
        if (op.reply || !op.consumers.empty()) {
          problems[where] = "core applies to plain subscriptions only (no reply, no consumers)";
        }
      }
      if (op.action == "receive" && !op.reply && op.consumers.empty() && !op.core) {
        problems[where] = "a consume operation without consumers (durables) or core: true";
      }
      c.operations.push_back(std::move(op));
    }
  } catch (const std::exception& e) {
    return Error::FailedPrecondition(reason::kContractAccess,
                                     std::string("malformed access contract: ") + e.what());
  }
  if (!problems.empty()) {
    Error e = Error::FailedPrecondition(
        reason::kContractAccess,
        fmt::format("{} access problem(s) in the contract", problems.size()));
    e.details = problems;
    return e;
  }
  return c;
}

Result<Permissions> PermissionsFor(const Contract& c, const std::string& role,
                                   const std::string& node_id) {
  auto it = c.roles.find(role);
  if (it == c.roles.end()) return Error::NotFound(reason::kRoleUnknown, "no role " + role);
  const Role& r = it->second;
  if ((r.kind == Kind::kNode) != !node_id.empty()) {
    return Error::InvalidArgument(reason::kNodeId,
                                  "a node id is required for, and only for, node roles");
  }
  Permissions p;
  p.subscribe.insert(InboxPrefix(role, node_id) + ".>");
  if (r.kind == Kind::kService) {
    p.subscribe.insert(r.ns);
    // A service answers whoever may call it, on the caller's inbox (ReplyInboxes), and nowhere
    // else. Not allow_responses: it refuses an occasional reply under load with nats-server 2.9,
    // and for a user with it the server keeps an entry per message delivered with a reply
    // subject (every JetStream delivery: $JS.ACK...) and, once over 4,096, walks them all on
    // every delivery (client.pruneReplyPerms): a projection replaying 80,000 events spent 98% of
    // the server's CPU there (docs/benchmarks.md, P8).
    for (const auto& inbox : ReplyInboxes(c, role)) p.publish.insert(inbox + ".>");
    // It checks at start that the streams it uses are declared (messaging::RequireStream); the
    // deploy role declares them (gpuaasctl streams apply).
    for (const auto& stream : UsedStreams(c, role)) {
      p.publish.insert("$JS.API.STREAM.INFO." + stream);
    }
    // A service replays a dead letter of its own consumers by reading it (dlq.hpp); it never
    // deletes one.
    p.publish.insert(fmt::format("$JS.API.STREAM.MSG.GET.{}", kDeadLetterStream));
  }
  if (r.kind == Kind::kDeploy) {
    // Declares the platform streams (create, update, look up); never deletes or purges one.
    for (const auto& [stream, subjects] : c.streams) {
      for (const char* verb : {"CREATE", "UPDATE", "INFO"}) {
        p.publish.insert(fmt::format("$JS.API.STREAM.{}.{}", verb, stream));
      }
    }
  }
  // Operators discard dead letters (`gpuaasctl dlq discard`): the one deletion anyone may make
  // in a platform stream.
  if (role == kOperatorRole) {
    p.publish.insert(fmt::format("$JS.API.STREAM.MSG.DELETE.{}", kDeadLetterStream));
  }
  for (const auto& s : r.read_streams) {
    p.publish.insert("$JS.API.STREAM.INFO." + s);
    p.publish.insert("$JS.API.STREAM.MSG.GET." + s);
    p.publish.insert("$JS.API.DIRECT.GET." + s);
    p.publish.insert("$JS.API.DIRECT.GET." + s + ".>");
  }
  auto manage = [&](const std::string& stream, const std::string& durable) {
    for (const std::string& s :
         {fmt::format("$JS.API.CONSUMER.CREATE.{}.{}", stream, durable),
          fmt::format("$JS.API.CONSUMER.CREATE.{}.{}.>", stream, durable),
          fmt::format("$JS.API.CONSUMER.DURABLE.CREATE.{}.{}", stream, durable),
          fmt::format("$JS.API.CONSUMER.INFO.{}.{}", stream, durable),
          fmt::format("$JS.API.CONSUMER.DELETE.{}.{}", stream, durable)}) {
      p.publish.insert(s);
    }
  };
  for (const auto& op : c.operations) {
    if (Contains(op.roles, role) && op.action == "send") {
      p.publish.insert(Bind(op.address, node_id));
    }
    if (Contains(op.callers, role)) {
      // A client calls with its role appended (ClientSubject): the service knows the sender's
      // connection role from the subject the server let through.
      const std::string subject = Bind(op.address, node_id);
      p.publish.insert(r.kind == Kind::kClient ? ClientSubject(subject, role) : subject);
    }
    if (Contains(op.via, role)) p.publish.insert(Bind(op.address, node_id));
    if (Contains(op.roles, role) && op.action == "receive") {
      // Live relays (core subscriptions), and the requests a node serves under its own id (a
      // service's served requests are its namespace, subscribed above).
      if (op.core) p.subscribe.insert(Bind(op.address, node_id));
      if (op.reply && r.kind == Kind::kNode) {
        p.subscribe.insert(Bind(op.address, node_id));
        p.allow_responses = true;
      }
    }
    for (const auto& k : op.consumers) {
      if (k.role == role) {
        const std::string d = Bind(k.durable, node_id);
        p.publish.insert(fmt::format("$JS.API.CONSUMER.MSG.NEXT.{}.{}", k.stream, d));
        p.publish.insert(fmt::format("$JS.API.CONSUMER.INFO.{}.{}", k.stream, d));
        p.publish.insert(fmt::format("$JS.ACK.{}.{}.>", k.stream, d));
        if (k.durable == kAnyDurable) {
          // Durables of its own choosing (a tenant gateway's feed consumers): it manages each,
          // and a client dead-letters nothing into the platform's stream.
          p.publish.insert("$JS.API.STREAM.INFO." + k.stream);
        } else {
          // What it gives up on (publishDeadLetter: every consumer).
          p.publish.insert(fmt::format("gpuaas.v1.dlq.{}.{}", k.stream, d));
        }
        if (k.managed_by.empty()) manage(k.stream, d);
      }
      if (k.managed_by == role) manage(k.stream, Bind(k.durable, ""));
    }
  }
  return p;
}

namespace {
std::string List(const std::set<std::string>& subjects) {
  std::string out = "[";
  bool first = true;
  for (const auto& s : subjects) {
    out += fmt::format("{}\"{}\"", first ? "" : ", ", s);
    first = false;
  }
  return out + "]";
}
}  // namespace

Result<std::string> RenderAuthorization(const Contract& c, const std::vector<User>& users,
                                        const std::string& extra,
                                        const std::set<std::string>& also_answer) {
  std::string out =
      "# Generated by `gpuaasctl auth nats-config` from asyncapi/roles.yaml and the operations'\n"
      "# x-gpuaas-access. Do not edit: change the contract and regenerate.\n"
      "authorization {\n  users = [\n";
  for (const auto& u : users) {
    if (!auth::IsUserPublicKey(u.nkey)) {
      return Error::InvalidArgument(reason::kNkeyInvalid, "not a user public nkey: " + u.nkey);
    }
    auto p = PermissionsFor(c, u.role, u.node_id);
    if (!p.ok()) return p.error();
    auto role = c.roles.find(u.role);
    if (role != c.roles.end() && role->second.kind == Kind::kService) {
      for (const auto& inbox : also_answer) p->publish.insert(inbox + ".>");
    }
    out += fmt::format("    # {}{}\n", u.role, u.node_id.empty() ? "" : " " + u.node_id);
    out += fmt::format("    {{ nkey: \"{}\", permissions: {{\n", u.nkey);
    out += fmt::format("        publish: {{ allow: {} }}\n", List(p->publish));
    out += fmt::format("        subscribe: {{ allow: {} }}\n", List(p->subscribe));
    if (p->allow_responses) out += "        allow_responses: true\n";
    out += "    } }\n";
  }
  out += extra;
  out += "  ]\n}\n";
  return out;
}

std::string SeedPath(const std::string& dir, const std::string& role) {
  return dir + "/" + role + ".seed";
}
namespace {
std::string PubPath(const std::string& dir, const std::string& role) {
  return dir + "/" + role + ".pub";
}
}  // namespace
std::string TokenSigningKeyPath(const std::string& dir) { return dir + "/token-signing.pem"; }
std::string TokenPublicKeyPath(const std::string& dir) { return dir + "/token-signing.pub.pem"; }
std::string TenantTokenSigningKeyPath(const std::string& dir) { return dir + "/token-tenant.pem"; }
std::string TenantTokenPublicKeyPath(const std::string& dir) {
  return dir + "/token-tenant.pub.pem";
}

namespace {
Result<void> WritePublic(const std::string& path, const std::string& content) {
  const std::string tmp = path + ".tmp";
  {
    std::ofstream out(tmp, std::ios::trunc);
    out << content;
    if (!out) return Error::Internal(reason::kWriteFailed, "cannot write " + tmp);
  }
  std::error_code ec;
  fs::rename(tmp, path, ec);
  if (ec) {
    return Error::Internal(reason::kWriteFailed, "cannot rename " + tmp + ": " + ec.message());
  }
  return Ok();
}
}  // namespace

Result<void> InitKeys(const Contract& c, const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir + "/nodes", ec);
  if (ec) return Error::Internal(reason::kKeysDir, "cannot create " + dir + ": " + ec.message());
  fs::permissions(dir, fs::perms::owner_all, ec);
  for (const auto& [name, role] : c.roles) {
    if (role.kind == Kind::kNode || fs::exists(SeedPath(dir, name))) continue;
    auto k = auth::NewUserNKey();
    if (!k.ok()) return k.error();
    if (auto r = auth::WriteSecretFile(SeedPath(dir, name), k->seed + "\n"); !r.ok()) return r;
    if (auto r = WritePublic(PubPath(dir, name), k->public_key + "\n"); !r.ok()) return r;
  }
  for (const auto& [priv, pub] :
       {std::pair{TokenSigningKeyPath(dir), TokenPublicKeyPath(dir)},
        std::pair{TenantTokenSigningKeyPath(dir), TenantTokenPublicKeyPath(dir)}}) {
    if (fs::exists(priv)) continue;
    auto k = auth::NewSigningKey();
    if (!k.ok()) return k.error();
    if (auto r = auth::WriteSecretFile(priv, k->private_pem); !r.ok()) return r;
    if (auto r = WritePublic(pub, k->public_pem); !r.ok()) return r;
  }
  return Ok();
}

namespace {
Result<std::string> ReadPublicKey(const std::string& path) {
  auto text = ReadFile(path);
  if (!text.ok()) return text.error();
  std::string key = *text;
  key.erase(std::remove_if(key.begin(), key.end(), [](char ch) { return std::isspace(ch); }),
            key.end());
  if (!auth::IsUserPublicKey(key)) {
    return Error::InvalidArgument(reason::kNkeyInvalid, path + " holds no user public nkey");
  }
  return key;
}
}  // namespace

Result<std::vector<User>> UsersFromKeys(const Contract& c, const std::string& dir) {
  std::vector<User> users;
  for (const auto& [name, role] : c.roles) {
    if (role.kind == Kind::kNode) continue;
    auto key = ReadPublicKey(PubPath(dir, name));
    if (!key.ok()) return key.error();
    users.push_back({*key, name, ""});
  }
  std::string node_role;
  for (const auto& [name, role] : c.roles) {
    if (role.kind == Kind::kNode) node_role = name;
  }
  std::error_code ec;
  std::vector<fs::path> nodes;
  for (const auto& e : fs::directory_iterator(dir + "/nodes", ec)) {
    if (e.path().extension() == ".pub") nodes.push_back(e.path());
  }
  std::sort(nodes.begin(), nodes.end());
  for (const auto& path : nodes) {
    auto key = ReadPublicKey(path.string());
    if (!key.ok()) return key.error();
    users.push_back({*key, node_role, path.stem().string()});
  }
  return users;
}

namespace {
bool ValidNodeId(const std::string& id) {
  if (id.empty() || id.size() > 63) return false;
  return std::all_of(id.begin(), id.end(), [](char ch) {
    return (ch >= 'a' && ch <= 'z') || (ch >= '0' && ch <= '9') || ch == '-';
  });
}
}  // namespace

Result<std::string> EnrollNode(const std::string& dir, const std::string& node_id) {
  if (!ValidNodeId(node_id)) {
    return Error::InvalidArgument(reason::kNodeIdInvalid,
                                  "node id must be 1-63 of [a-z0-9-]: '" + node_id + "'");
  }
  const std::string path = dir + "/nodes/" + node_id + ".pub";
  if (fs::exists(path)) {
    return Error::Of(Code::kAlreadyExists, reason::kNodeEnrolled,
                     node_id + " is enrolled already; revoke it first to issue a new key", {},
                     false);
  }
  std::error_code ec;
  fs::create_directories(dir + "/nodes", ec);
  auto k = auth::NewUserNKey();
  if (!k.ok()) return k.error();
  if (auto r = WritePublic(path, k->public_key + "\n"); !r.ok()) return r.error();
  return k->seed;
}

Result<void> RevokeNode(const std::string& dir, const std::string& node_id) {
  if (!ValidNodeId(node_id)) {
    return Error::InvalidArgument(reason::kNodeIdInvalid, "invalid node id '" + node_id + "'");
  }
  std::error_code ec;
  if (!fs::remove(dir + "/nodes/" + node_id + ".pub", ec)) {
    return Error::NotFound(reason::kNodeNotEnrolled, node_id + " is not enrolled");
  }
  return Ok();
}

}  // namespace gpuaas::access
