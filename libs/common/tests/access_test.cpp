// The NATS permissions derived from the contract (access.hpp): the repo's contract is complete
// and consistent, a node's permissions name only itself, and what makes a contract invalid (an
// operation nobody may use, an undeclared role, a served subject outside the namespace) is said.
#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <sstream>

#include <fmt/format.h>

#include "gpuaas/common/access.hpp"
#include "gpuaas/common/messaging.hpp"

namespace gpuaas::access {
namespace {

std::string Read(const std::string& path) {
  std::ifstream in(path);
  std::stringstream ss;
  ss << in.rdbuf();
  return ss.str();
}

bool Allows(const std::set<std::string>& allow, const std::string& subject) {
  for (const auto& p : allow) {
    if (SubjectMatches(p, subject)) return true;
  }
  return false;
}

TEST(AccessTest, TheRepositoryContractIsCompleteAndMatchesTheStreams) {
  auto c = LoadContract(GPUAAS_CONTRACT_DIR);
  ASSERT_TRUE(c.ok()) << c.error().ToString();
  EXPECT_GE(c->operations.size(), 50U);
  // roles.yaml's streams are the ones the code declares.
  for (const auto& spec : messaging::PlatformStreams()) {
    ASSERT_TRUE(c->streams.count(spec.name)) << spec.name;
    EXPECT_EQ(c->streams.at(spec.name), spec.subjects) << spec.name;
  }
  EXPECT_EQ(messaging::PlatformStreams().size(), c->streams.size());
  EXPECT_EQ(c->streams.size(), 11U);
  // The built-in copy is the same contract.
  EXPECT_EQ(EmbeddedContract().operations.size(), c->operations.size());
}

TEST(AccessTest, ANodeIsAllowedOnlyItsOwnSubjects) {
  const Contract& c = EmbeddedContract();
  auto p = PermissionsFor(c, "node-agent", "gpu-07");
  ASSERT_TRUE(p.ok()) << p.error().ToString();
  // Its inbox, the console opens it serves under its own id and its consoles' input relay.
  EXPECT_EQ(p->subscribe,
            (std::set<std::string>{"_INBOX.node.gpu-07.>", "gpuaas.v1.node.gpu-07.console.*.in",
                                   "gpuaas.v1.node.gpu-07.console.open"}));
  EXPECT_TRUE(p->allow_responses);  // it answers console.open
  EXPECT_TRUE(Allows(p->publish, "gpuaas.v1.node.gpu-07.console.0190.out"));
  EXPECT_FALSE(Allows(p->publish, "gpuaas.v1.node.gpu-08.console.0190.out"));
  EXPECT_FALSE(Allows(p->publish, "gpuaas.v1.node.gpu-07.console.0190.in"));
  for (const std::string s :
       {"$JS.API.CONSUMER.MSG.NEXT.GPUAAS_NODE_TASKS.node-gpu-07",
        "$JS.API.CONSUMER.INFO.GPUAAS_NODE_TASKS.node-gpu-07",
        "$JS.ACK.GPUAAS_NODE_TASKS.node-gpu-07.1.2.3.4.5", "gpuaas.v1.evt.node.gpu-07.topology",
        "gpuaas.v1.evt.node.gpu-07.task.succeeded", "gpuaas.v1.evt.node.gpu-07.leases",
        "gpuaas.v1.inventory.node.gpu-07.register", "gpuaas.v1.ipam.node.gpu-07.network.get",
        "gpuaas.v1.inventory.node.gpu-07.desired.get",
        "gpuaas.v1.inventory.node.gpu-07.desired.ack", "gpuaas.v1.ipam.node.gpu-07.network.ack",
        "gpuaas.v1.ingress.node.gpu-07.exposures.get",
        "gpuaas.v1.ingress.node.gpu-07.exposures.ack",
        "gpuaas.v1.dlq.GPUAAS_NODE_TASKS.node-gpu-07"}) {
    EXPECT_TRUE(Allows(p->publish, s)) << s;
  }
  for (const std::string s :
       {"$JS.API.CONSUMER.MSG.NEXT.GPUAAS_NODE_TASKS.node-gpu-08",
        "$JS.API.CONSUMER.CREATE.GPUAAS_NODE_TASKS.node-gpu-07",
        "$JS.API.CONSUMER.DURABLE.CREATE.GPUAAS_NODE_TASKS.node-gpu-07",
        "$JS.API.STREAM.MSG.GET.GPUAAS_NODE_TASKS", "$JS.API.DIRECT.GET.GPUAAS_NODE_TASKS",
        "$JS.API.STREAM.CREATE.GPUAAS_NODE_TASKS", "gpuaas.v1.evt.node.gpu-08.topology",
        "gpuaas.v1.node.gpu-07.task", "gpuaas.v1.inventory.slot.approve", "_INBOX.x.y",
        // Another node's node-scoped requests: the subject names the node.
        "gpuaas.v1.inventory.node.gpu-08.register", "gpuaas.v1.inventory.node.gpu-08.desired.get",
        "gpuaas.v1.inventory.node.gpu-08.desired.ack", "gpuaas.v1.ipam.node.gpu-08.network.get",
        "gpuaas.v1.ipam.node.gpu-08.network.ack", "gpuaas.v1.ingress.node.gpu-08.exposures.get",
        "gpuaas.v1.ingress.node.gpu-08.exposures.ack"}) {
    EXPECT_FALSE(Allows(p->publish, s)) << s;
  }
  // No pattern of a node names another node: every wildcard-free token is its own id.
  for (const auto& s : p->publish) {
    EXPECT_EQ(s.find("node-*"), std::string::npos) << s;
    EXPECT_EQ(s.find(".*.task"), std::string::npos) << s;
  }
  EXPECT_FALSE(PermissionsFor(c, "node-agent").ok()) << "a node role needs its node id";
}

// What `role` publishes to request `subject`: a client role appends its name (ClientSubject).
std::string Wire(const Contract& c, const std::string& role, const std::string& subject) {
  return ClientRoleOf(c, role).empty() ? subject : ClientSubject(subject, role);
}

TEST(AccessTest, DeadLettersAreReplayedByTheirServiceAndDiscardedByOperatorsAlone) {
  const Contract& c = EmbeddedContract();
  const std::string get = "$JS.API.STREAM.MSG.GET.GPUAAS_DLQ";
  const std::string del = "$JS.API.STREAM.MSG.DELETE.GPUAAS_DLQ";
  for (const auto& [name, role] : c.roles) {
    auto p = role.kind == Kind::kNode ? PermissionsFor(c, name, "gpu-07") : PermissionsFor(c, name);
    ASSERT_TRUE(p.ok()) << name;
    // Services read a dead letter to replay it; operators and auditors read the stream (a
    // billing system reads only the usage records).
    EXPECT_EQ(Allows(p->publish, get), name != "node-agent" && name != "tenant-api" &&
                                           name != "deployer" && name != "billing")
        << name;
    EXPECT_EQ(Allows(p->publish, del), name == "operator") << name;
    // Nobody deletes from another stream.
    for (const auto& [stream, subjects] : c.streams) {
      if (stream != "GPUAAS_DLQ") {
        EXPECT_FALSE(Allows(p->publish, "$JS.API.STREAM.MSG.DELETE." + stream)) << name;
      }
    }
    // The replay subjects are admin subjects: only operators call them.
    for (const std::string svc : {"inventory", "scheduler", "ipam", "ingress"}) {
      EXPECT_EQ(Allows(p->publish, Wire(c, name, "gpuaas.v1." + svc + ".dlq.replay")),
                name == "operator")
          << name << " " << svc;
    }
  }
  // inventory may put a node's task back on its subject (it manages the node-<id> durables).
  auto inventory = PermissionsFor(c, "inventory");
  ASSERT_TRUE(inventory.ok());
  EXPECT_TRUE(Allows(inventory->publish, "gpuaas.v1.node.gpu-07.task"));
  auto replay = RequestAccessFor(c, "gpuaas.v1.ipam.dlq.replay");
  EXPECT_TRUE(replay.declared);
  EXPECT_FALSE(replay.internal);
  EXPECT_EQ(replay.token_roles, std::vector<std::string>{"operator"});
}

// A service answers its callers on their inboxes, by its publish permission, not
// allow_responses: for a user with allow_responses nats-server 2.9 walks every recent JetStream
// delivery's reply subject on each delivery, which throttled a projection's replay 100-fold. It
// may answer only those who may call it (or forward to it): no other role's inbox. A node keeps
// allow_responses: it answers only what it was sent.
TEST(AccessTest, ServicesAnswerOnlyTheirCallersInboxesWithoutAllowResponses) {
  const Contract& c = EmbeddedContract();
  for (const auto& [name, role] : c.roles) {
    if (role.kind != Kind::kService) continue;
    auto p = PermissionsFor(c, name);
    ASSERT_TRUE(p.ok()) << name;
    EXPECT_FALSE(p->allow_responses) << name;
    EXPECT_FALSE(Allows(p->publish, "_INBOX.x")) << name << " answers only named inboxes";
    EXPECT_FALSE(p->subscribe.count("_INBOX.>")) << name << " reads only its own inbox";
    // Exactly the inboxes of the roles among its served operations' callers and gateways.
    std::set<std::string> callers;
    for (const auto& op : c.operations) {
      if (!op.reply || std::find(op.roles.begin(), op.roles.end(), name) == op.roles.end()) {
        continue;
      }
      callers.insert(op.callers.begin(), op.callers.end());
      callers.insert(op.via.begin(), op.via.end());
    }
    for (const auto& [other, kind] : c.roles) {
      const std::string inbox =
          kind.kind == Kind::kNode ? InboxPrefix(other, "gpu-07") : InboxPrefix(other);
      EXPECT_EQ(Allows(p->publish, inbox + ".0aZ9.1"), callers.count(other) > 0)
          << name << " answering " << other;
    }
  }
  // ipam answers nodes, inventory and operators; never the tenant gateway nor the scheduler
  // (which call it for nothing: the scheduler follows ipam's events).
  auto ipam = PermissionsFor(c, "ipam");
  ASSERT_TRUE(ipam.ok());
  EXPECT_TRUE(Allows(ipam->publish, "_INBOX.node.gpu-07.1"));
  EXPECT_TRUE(Allows(ipam->publish, "_INBOX.inventory.1"));
  EXPECT_TRUE(Allows(ipam->publish, "_INBOX.operator.1"));
  EXPECT_FALSE(Allows(ipam->publish, "_INBOX.tenant-api.1"));
  EXPECT_FALSE(Allows(ipam->publish, "_INBOX.scheduler.1"));
  auto node = PermissionsFor(c, "node-agent", "gpu-07");
  ASSERT_TRUE(node.ok());
  EXPECT_FALSE(Allows(node->publish, "_INBOX.scheduler.x.1"));
}

// No node id can name a role's inbox: nodes' inboxes are under _INBOX.node (a node enrolled as
// "scheduler" reads _INBOX.node.scheduler.>, never the scheduler's replies), and no role may be
// called "node".
TEST(AccessTest, NodeInboxesNeverNameARolesInbox) {
  const Contract& c = EmbeddedContract();
  auto sneaky = PermissionsFor(c, "node-agent", "scheduler");
  ASSERT_TRUE(sneaky.ok());
  EXPECT_EQ(sneaky->subscribe.count("_INBOX.scheduler.>"), 0U);
  EXPECT_EQ(sneaky->subscribe.count("_INBOX.node.scheduler.>"), 1U);
  auto roles = std::string(
      "roles:\n  node:\n    kind: client\n    description: x\nstreams: {}\ntoken_roles: {}\n");
  auto parsed = ParseContract("channels: {}\noperations: {}\n", roles);
  ASSERT_FALSE(parsed.ok());
  EXPECT_NE(parsed.error().details.at("role node").find("reserved"), std::string::npos);
}

// Streams are declared at deploy time by the deploy role alone; a running service may look up
// the streams it uses, and create, update or delete none.
TEST(AccessTest, OnlyTheDeployRoleDeclaresStreams) {
  const Contract& c = EmbeddedContract();
  for (const auto& [name, role] : c.roles) {
    auto p = role.kind == Kind::kNode ? PermissionsFor(c, name, "gpu-07") : PermissionsFor(c, name);
    ASSERT_TRUE(p.ok()) << name;
    const auto used = UsedStreams(c, name);
    for (const auto& [stream, subjects] : c.streams) {
      for (const char* verb : {"CREATE", "UPDATE", "DELETE", "PURGE"}) {
        const std::string api = fmt::format("$JS.API.STREAM.{}.{}", verb, stream);
        const std::string v = verb;
        const bool declares = role.kind == Kind::kDeploy && (v == "CREATE" || v == "UPDATE");
        EXPECT_EQ(Allows(p->publish, api), declares) << name << " " << api;
      }
      if (role.kind == Kind::kService) {
        EXPECT_EQ(Allows(p->publish, "$JS.API.STREAM.INFO." + stream), used.count(stream) > 0)
            << name << " " << stream;
      }
    }
  }
  // What the services look up at start (messaging::RequireStream) is among what they use.
  EXPECT_TRUE(UsedStreams(c, "inventory").count("GPUAAS_NODE_TASKS"));
  EXPECT_TRUE(UsedStreams(c, "scheduler").count("GPUAAS_EVT_INVENTORY"));
  EXPECT_TRUE(UsedStreams(c, "console-gw").count("GPUAAS_EVT_CONSOLE"));
  EXPECT_FALSE(UsedStreams(c, "console-gw").count("GPUAAS_NODE_TASKS"));
  ASSERT_TRUE(c.roles.count("deployer"));
  EXPECT_EQ(c.roles.at("deployer").kind, Kind::kDeploy);
}

TEST(AccessTest, AdminSubjectsAreTheOperatorsAlone) {
  const Contract& c = EmbeddedContract();
  const std::vector<std::string> admin = {
      "gpuaas.v1.inventory.slot.approve",       "gpuaas.v1.inventory.slot.disable",
      "gpuaas.v1.inventory.slot.repair",        "gpuaas.v1.inventory.region.set",
      "gpuaas.v1.scheduler.projection.rebuild", "gpuaas.v1.scheduler.allocation.force_release",
      "gpuaas.v1.ipam.reservation.reprovision", "gpuaas.v1.ipam.subnet.set"};
  for (const auto& [name, role] : c.roles) {
    if (role.kind == Kind::kNode) continue;
    auto p = PermissionsFor(c, name);
    ASSERT_TRUE(p.ok()) << name;
    for (const auto& s : admin) {
      // console-gw forwards an operator's token for the operator page's actions (via); the
      // serving service requires that token (below), so the gateway alone cannot use them.
      const bool via = name == "console-gw" && s.find(".slot.") != std::string::npos;
      EXPECT_EQ(Allows(p->publish, Wire(c, name, s)), name == "operator" || via)
          << name << " " << s;
    }
  }
  // A client role publishes a request only with its own role appended: never the bare subject
  // (where a platform identity's request arrives) nor another client role's form.
  for (const auto& [name, role] : c.roles) {
    if (role.kind != Kind::kClient) continue;
    auto p = PermissionsFor(c, name);
    ASSERT_TRUE(p.ok()) << name;
    bool calls_something = false;
    for (const auto& s : p->publish) {
      if (s.rfind("gpuaas.v1.", 0) != 0) continue;
      calls_something = true;
      EXPECT_EQ(s.substr(s.rfind('.') + 1), name) << s;
      EXPECT_FALSE(Allows(p->publish, s.substr(0, s.rfind('.')))) << name << " " << s;
      for (const auto& [other, r] : c.roles) {
        if (r.kind == Kind::kClient && other != name) {
          EXPECT_FALSE(Allows(p->publish, ClientSubject(s.substr(0, s.rfind('.')), other)))
              << name << " " << s;
        }
      }
    }
    EXPECT_TRUE(calls_something) << name;
  }
  for (const std::string s :
       {"gpuaas.v1.inventory.slot.approve", "gpuaas.v1.console.session.create"}) {
    auto a = RequestAccessFor(c, s);
    EXPECT_FALSE(a.internal) << s;
    EXPECT_EQ(a.token_roles, std::vector<std::string>{"operator"}) << s;
  }
  // The console relay: console-gw writes the input side and reads the output side of any node.
  auto gw = PermissionsFor(c, "console-gw");
  ASSERT_TRUE(gw.ok());
  EXPECT_TRUE(Allows(gw->publish, "gpuaas.v1.node.gpu-07.console.open"));
  EXPECT_TRUE(Allows(gw->publish, "gpuaas.v1.node.gpu-07.console.0190.in"));
  EXPECT_FALSE(Allows(gw->publish, "gpuaas.v1.node.gpu-07.console.0190.out"));
  EXPECT_TRUE(Allows(gw->subscribe, "gpuaas.v1.node.gpu-07.console.0190.out"));
  for (const auto& [name, role] : c.roles) {
    if (role.kind == Kind::kNode || name == "console-gw") continue;
    auto p = PermissionsFor(c, name);
    EXPECT_FALSE(Allows(p->publish, "gpuaas.v1.node.gpu-07.console.open")) << name;
    EXPECT_FALSE(Allows(p->subscribe, "gpuaas.v1.node.gpu-07.console.0190.out")) << name;
  }
  auto auditor = PermissionsFor(c, "auditor");
  ASSERT_TRUE(auditor.ok());
  EXPECT_FALSE(Allows(auditor->publish, "$JS.API.STREAM.MSG.GET.GPUAAS_NODE_TASKS"));
  EXPECT_TRUE(Allows(auditor->publish, "$JS.API.STREAM.MSG.GET.GPUAAS_EVT_SCHEDULER"));
  EXPECT_FALSE(Allows(auditor->publish, "gpuaas.v1.scheduler.allocation.create"));
  // Request access: who needs a token.
  auto create = RequestAccessFor(c, "gpuaas.v1.scheduler.allocation.create");
  EXPECT_TRUE(create.declared);
  EXPECT_FALSE(create.internal);
  EXPECT_EQ(create.token_roles, (std::vector<std::string>{"tenant", "operator"}));
  auto reserve = RequestAccessFor(c, "gpuaas.v1.ipam.reservation.reserve");
  EXPECT_TRUE(reserve.internal);
  EXPECT_TRUE(reserve.token_roles.empty());
  EXPECT_FALSE(RequestAccessFor(c, "gpuaas.v1.nobody.x").declared);
}

TEST(AccessTest, AnIncompleteContractIsAContractError) {
  const std::string doc = Read(std::string(GPUAAS_CONTRACT_DIR) + "/gpuaas.asyncapi.yaml");
  const std::string roles = Read(std::string(GPUAAS_CONTRACT_DIR) + "/roles.yaml");
  auto broken = [&](const std::string& from, const std::string& to) {
    std::string d = doc;
    const auto at = d.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    if (at != std::string::npos) d.replace(at, from.size(), to);
    auto c = ParseContract(d, roles);
    EXPECT_FALSE(c.ok()) << "accepted: " << to;
    return c.ok() ? std::string() : c.error().ToString();
  };
  // An operation nobody may use.
  EXPECT_NE(broken("    x-gpuaas-access:\n      roles: [inventory]\n      callers: [node-agent, "
                   "operator]\n",
                   "")
                .find("registerNode"),
            std::string::npos);
  // An undeclared role.
  EXPECT_NE(broken("callers: [node-agent, operator]", "callers: [intern]").find("intern"),
            std::string::npos);
  // Every role an operation names is declared in roles.yaml: the dead-letter publication is
  // every consumer's (every_consumer: true), not a pseudo-role.
  EXPECT_NE(
      broken("      every_consumer: true", "      roles: [every-consumer]").find("every-consumer"),
      std::string::npos);
  // A subject served outside its service's namespace.
  EXPECT_NE(broken("      roles: [inventory]\n      callers: [node-agent, operator]",
                   "      roles: [ipam]\n      callers: [node-agent, operator]")
                .find("namespace"),
            std::string::npos);
  // Only a service may forward a caller's token.
  EXPECT_NE(broken("      callers: [operator, auditor]\n      via: [console-gw]",
                   "      callers: [operator, auditor]\n      via: [auditor]")
                .find("only a service may forward"),
            std::string::npos);
  // A core subscription must be on a subject no stream holds, and a receive needs a durable
  // unless it is one.
  EXPECT_NE(broken("      $ref: '#/channels/nodeConsoleIn'\n    summary: the node's agent writes "
                   "them to the domain's VNC socket (core subscription).\n    x-gpuaas-access:\n"
                   "      roles: [node-agent]\n      core: true",
                   "      $ref: '#/channels/nodeConsoleIn'\n    summary: the node's agent writes "
                   "them to the domain's VNC socket (core subscription).\n    x-gpuaas-access:\n"
                   "      roles: [node-agent]")
                .find("core: true"),
            std::string::npos);
  EXPECT_NE(broken("      $ref: '#/channels/nodeConsoleIn'\n    summary: the node's agent writes",
                   "      $ref: '#/channels/nodeTask'\n    summary: the node's agent writes")
                .find("which stream GPUAAS_NODE_TASKS holds"),
            std::string::npos);
}

TEST(AccessTest, TheRenderedConfigListsEveryUserWithItsPermissions) {
  const Contract& c = EmbeddedContract();
  std::vector<User> users = {
      {"UCK5N7N66OBOINFXAYC2ACJQYFSOD4VYNU6APEJTAVFZB2SVHLKGEW7L", "operator", ""},
      {"UCK5N7N66OBOINFXAYC2ACJQYFSOD4VYNU6APEJTAVFZB2SVHLKGEW7L", "node-agent", "gpu-01"}};
  auto conf = RenderAuthorization(c, users);
  ASSERT_TRUE(conf.ok()) << conf.error().ToString();
  EXPECT_NE(conf->find("authorization {"), std::string::npos);
  EXPECT_NE(conf->find("\"_INBOX.node.gpu-01.>\""), std::string::npos);
  EXPECT_NE(conf->find("\"gpuaas.v1.inventory.slot.approve.operator\""), std::string::npos);
  users[0].nkey = "not-a-key";
  EXPECT_FALSE(RenderAuthorization(c, users).ok());
}

TEST(BindAddressTest, BindsEachParameterToOneTokenAndNothingElse) {
  const std::string a = "gpuaas.v1.ipam.node.{node_id}.network.get";
  auto b = BindAddress(a, "gpuaas.v1.ipam.node.gpu-07.network.get");
  ASSERT_TRUE(b.has_value());
  EXPECT_EQ(b->at("node_id"), "gpu-07");
  EXPECT_FALSE(BindAddress(a, "gpuaas.v1.ipam.node.gpu-07.network.ack"));
  EXPECT_FALSE(BindAddress(a, "gpuaas.v1.ipam.node.a.b.network.get"));
  EXPECT_FALSE(BindAddress(a, "gpuaas.v1.ipam.node.*.network.get"));
  EXPECT_FALSE(BindAddress(a, "gpuaas.v1.ipam.node.>.network.get"));
  EXPECT_FALSE(BindAddress(a, "gpuaas.v1.ipam.node.network.get"));
  // An address without parameters matches only itself.
  EXPECT_TRUE(BindAddress("gpuaas.v1.ipam.drift.list", "gpuaas.v1.ipam.drift.list"));
  EXPECT_FALSE(BindAddress("gpuaas.v1.ipam.drift.list", "gpuaas.v1.ipam.drift.list.operator"));
}

}  // namespace
}  // namespace gpuaas::access
