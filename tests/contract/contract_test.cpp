// Contract checks: what the services really do on NATS agrees with asyncapi/ and proto/.
//
// The subjects come from the services themselves, not from their source text: ipam, inventory,
// the scheduler and a node-agent run (tests/integration/platform.hpp), with ingress beside them,
// through one short slice lifecycle, and each one's /contract lists what it recorded at runtime
// (contract.hpp): the subjects its rpc server serves (with the request and result types of the
// typed handlers), its durable consumers' filters, what it published (the Event's packed type from
// the first message) and what it requested. Then:
//  * every recorded subject is a channel of the document, used in the direction the document
//    gives it (serve/request: a receive operation with a reply; consume: receive; publish:
//    send), with the same protobuf types where the service knows them;
//  * every operation of the document is done by some service (or is one of the few things
//    only an outside party does: kOutsideParties);
//  * every protobuf type the document names exists in proto/, and every reference resolves.
// GPUAAS_CONTRACT_PRINT=1 prints every entry the services recorded.
#include <gtest/gtest.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/websocket.hpp>

#include <google/protobuf/descriptor.h>
#include <google/protobuf/descriptor.pb.h>
#include <google/protobuf/util/time_util.h>

#include <cstdlib>
#include <fstream>
#include <iostream>
#include <map>
#include <set>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "gpuaas/common/access.hpp"
#include "gpuaas/common/contract.hpp"
#include "gpuaas/common/http.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/console_gw/console_gw_service.hpp"
#include "gpuaas/ingress/ingress_service.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "platform.hpp"

namespace gpuaas {
namespace {

using namespace std::chrono_literals;
using contract::Role;

// Operations only a party outside the platform's services performs, so no service registry
// can show them. Each says why; the test fails when a service starts doing one (then it goes).
const std::map<std::string, std::string> kOutsideParties = {
    {"publishLeases",
     "the node-agent reports leases only with network.apply = netns|host (root: a bridge and "
     "dnsmasq), so its agent here cannot; NetFlowTest runs that path as root. The test stands "
     "in for it (its report must match the channel) so that ipam's drift events run"},
    {"followTenantAllocations",
     "a tenant gateway (client role tenant-api), not a service, consumes the tenant feed: "
     "IdentityTest.ATenantGatewayFollowsOneTenantsAllocationsThroughTheFeed and the JS contract "
     "client (ContractClientTest) do, with the tenant-api identity"},
};

// ---- the document ----

bool IsParam(const std::string& t) { return t.size() >= 2 && t.front() == '{' && t.back() == '}'; }

using ParamValues = std::map<std::string, std::set<std::string>>;  // param -> its `enum`

// Does `pat` (a subject, or a filter with NATS wildcards * and >; {name} tokens match any one
// token) match `address`, whose {name} tokens match any token, or only the values of the
// parameter's `enum` when it has one?
bool Matches(const std::string& pat, const std::string& address, const ParamValues& enums = {}) {
  auto p = access::SubjectTokens(pat);
  auto a = access::SubjectTokens(address);
  for (size_t i = 0; i < p.size(); ++i) {
    if (p[i] == ">") return a.size() > i;
    if (i >= a.size()) return false;
    if (p[i] == "*" || IsParam(p[i])) continue;
    if (IsParam(a[i])) {
      auto e = enums.find(a[i].substr(1, a[i].size() - 2));
      if (e != enums.end() && !e->second.count(p[i])) return false;
      continue;
    }
    if (p[i] != a[i]) return false;
  }
  return p.size() == a.size();
}

struct Channel {
  std::string address;
  ParamValues enums;
  std::set<std::string> types;       // x-protobuf-type of its messages
  std::set<std::string> data_types;  // x-protobuf-data of its messages
};

struct Operation {
  std::string name;
  std::string action;  // send | receive
  std::string channel;
  bool reply = false;
  std::set<std::string> result_types;  // x-protobuf-result of the reply's messages
};

struct Document {
  YAML::Node doc;
  std::map<std::string, Channel> channels;  // by id
  std::vector<Operation> operations;
  std::vector<std::string> problems;  // references that do not resolve, and the like
  google::protobuf::DescriptorPool pool;

  // "#/a/b/c" within the document; an undefined node when it does not resolve.
  YAML::Node Resolve(const std::string& ref) const {
    if (ref.rfind("#/", 0) != 0) return YAML::Node(YAML::NodeType::Undefined);
    YAML::Node n = doc;
    std::stringstream ss(ref.substr(2));
    for (std::string part; std::getline(ss, part, '/');) {
      const YAML::Node& here = n;  // const: a lookup must not add the key
      const YAML::Node next = here.IsMap() ? here[part] : YAML::Node();
      if (!next.IsDefined()) return YAML::Node(YAML::NodeType::Undefined);
      n.reset(next);  // (operator= would assign into the document)
    }
    return n;
  }
  YAML::Node Message(const YAML::Node& ref_holder, const std::string& where) {
    const auto ref = ref_holder["$ref"] ? ref_holder["$ref"].as<std::string>() : "";
    YAML::Node m = Resolve(ref);
    if (!m.IsDefined() || !m.IsMap()) problems.push_back(where + ": $ref '" + ref + "' resolves");
    return m;
  }

  Document() {
    const std::string root = GPUAAS_SOURCE_DIR;
    doc = YAML::LoadFile(root + "/asyncapi/gpuaas.asyncapi.yaml");
    for (const auto& ch : doc["channels"]) {
      const auto id = ch.first.as<std::string>();
      Channel c;
      if (ch.second["address"] && ch.second["address"].IsScalar()) {
        c.address = ch.second["address"].as<std::string>();
      } else {
        problems.push_back("channel " + id + " has no address");
      }
      for (const auto& p : ch.second["parameters"]) {
        if (!p.second["enum"]) continue;
        for (const auto& v : p.second["enum"]) {
          c.enums[p.first.as<std::string>()].insert(v.as<std::string>());
        }
      }
      for (const auto& m : ch.second["messages"]) {
        auto msg = Message(m.second, "channel " + id + " message " + m.first.as<std::string>());
        if (!msg.IsDefined()) continue;
        if (msg["x-protobuf-type"]) c.types.insert(msg["x-protobuf-type"].as<std::string>());
        if (msg["x-protobuf-data"]) c.data_types.insert(msg["x-protobuf-data"].as<std::string>());
      }
      channels[id] = c;
    }
    for (const auto& op : doc["operations"]) {
      Operation o;
      o.name = op.first.as<std::string>();
      o.action = op.second["action"] ? op.second["action"].as<std::string>() : "";
      const auto ref = op.second["channel"]["$ref"] ? op.second["channel"]["$ref"].as<std::string>()
                                                    : std::string();
      const std::string prefix = "#/channels/";
      if (ref.rfind(prefix, 0) == 0 && channels.count(ref.substr(prefix.size()))) {
        o.channel = ref.substr(prefix.size());
      } else {
        problems.push_back("operation " + o.name + ": channel $ref '" + ref + "' resolves");
      }
      if (const auto& reply = op.second["reply"]; reply) {
        o.reply = true;
        // AsyncAPI 3: the reply goes to an address (here the requester's inbox) or a channel.
        if (reply["address"]) {
          const auto a = reply["address"]["$ref"] ? reply["address"]["$ref"].as<std::string>() : "";
          if (!Resolve(a).IsDefined()) {
            problems.push_back("operation " + o.name + ": reply address '" + a + "' resolves");
          }
        } else if (!reply["channel"]) {
          problems.push_back("operation " + o.name + ": reply has neither address nor channel");
        }
        for (const auto& m : reply["messages"]) {
          auto msg = Message(m, "operation " + o.name + " reply");
          if (msg.IsDefined() && msg["x-protobuf-result"]) {
            o.result_types.insert(msg["x-protobuf-result"].as<std::string>());
          }
        }
      }
      operations.push_back(o);
    }
    google::protobuf::FileDescriptorSet set;
    std::ifstream in(GPUAAS_DESCRIPTOR_SET, std::ios::binary);
    if (!set.ParseFromIstream(&in)) problems.push_back("cannot read " GPUAAS_DESCRIPTOR_SET);
    for (const auto& f : set.file()) pool.BuildFile(f);
  }

  // Channels `subject` (or filter) falls on.
  std::vector<std::string> ChannelsOf(const std::string& subject) const {
    std::vector<std::string> out;
    for (const auto& [id, c] : channels) {
      if (Matches(subject, c.address, c.enums)) out.push_back(id);
    }
    return out;
  }
};

Document& Doc() {
  static Document d;
  return d;
}

// The operation kind a registry entry stands for on a channel.
bool Fits(Role role, const Operation& op) {
  switch (role) {
    case Role::kServe:
    case Role::kRequest:
      return op.action == "receive" && op.reply;
    case Role::kConsume:
      return op.action == "receive" && !op.reply;
    case Role::kPublish:
      return op.action == "send";
  }
  return false;
}

// ---- the services ----

struct Recorded {
  std::string service;
  contract::Entry entry;
};

std::string Show(const Recorded& r) {
  static const std::map<Role, const char*> kVerb = {{Role::kServe, "serves"},
                                                    {Role::kConsume, "consumes"},
                                                    {Role::kPublish, "publishes"},
                                                    {Role::kRequest, "requests"}};
  return fmt::format("{} {} {} (via {}; type '{}', inner '{}'; {} times)", r.service,
                     kVerb.at(r.entry.role), r.entry.subject, r.entry.via, r.entry.type,
                     r.entry.inner_type, r.entry.count);
}

// Does some entry do `op`?
bool Done(const std::vector<Recorded>& recorded, const Operation& op) {
  const Channel& c = Doc().channels.at(op.channel);
  for (const auto& r : recorded) {
    if (r.entry.role == Role::kRequest || !Fits(r.entry.role, op)) continue;
    if (Matches(r.entry.subject, c.address, c.enums)) return true;
  }
  return false;
}

// Every service's /contract, as a user of its HTTP port reads it; "" or what failed.
std::string Collect(testing::Platform& p, ingress::IngressService& ingress,
                    console_gw::ConsoleGwService& console, std::vector<Recorded>& out) {
  std::vector<std::pair<std::string, runtime::Service*>> services = {
      {"ipam", &p.ipam->runtime()},           {"inventory", &p.inventory->runtime()},
      {"scheduler", &p.scheduler->runtime()}, {"ingress", &ingress.runtime()},
      {"console-gw", &console.runtime()},     {"usage", &p.usage->runtime()}};
  for (auto& a : p.agents) services.emplace_back("node-agent", &a->runtime());
  std::vector<Recorded> all;
  for (const auto& [name, svc] : services) {
    auto got = http::Get("127.0.0.1", svc->http_port(), "/contract");
    if (!got.ok()) return name + ": " + got.error().ToString();
    if (got->first != 200) return name + ": HTTP " + std::to_string(got->first);
    auto entries = contract::EntriesFromJson(got->second);
    if (!entries.ok()) return name + ": " + entries.error().ToString();
    for (auto& e : *entries) all.push_back({name, std::move(e)});
  }
  out = std::move(all);
  return "";
}

void ExpectEveryServiceRecorded(const std::vector<Recorded>& recorded) {
  std::map<std::string, std::map<Role, int>> by_service;
  for (const auto& r : recorded) by_service[r.service][r.entry.role]++;
  for (const char* s : {"ipam", "inventory", "scheduler", "ingress", "console-gw", "usage"}) {
    EXPECT_GT(by_service[s][Role::kServe], 0) << s << " recorded no served subject";
    EXPECT_GT(by_service[s][Role::kConsume], 0) << s << " recorded no consumer";
    EXPECT_GT(by_service[s][Role::kPublish], 0) << s << " recorded no publish";
  }
  EXPECT_GT(by_service["node-agent"][Role::kConsume], 0);
  EXPECT_GT(by_service["node-agent"][Role::kPublish], 0);
  EXPECT_GT(by_service["node-agent"][Role::kRequest], 0);
}

// Direction and types: every recorded subject is a channel, used the way its operation says.
void ExpectRecordedSubjectsDeclared(const std::vector<Recorded>& recorded) {
  for (const auto& r : recorded) {
    const auto channels = Doc().ChannelsOf(r.entry.subject);
    if (channels.empty()) {
      ADD_FAILURE() << Show(r) << ": no channel of asyncapi/gpuaas.asyncapi.yaml has this "
                    << (r.entry.role == Role::kConsume ? "filter's subjects" : "subject");
      continue;
    }
    for (const auto& id : channels) {
      const Channel& c = Doc().channels.at(id);
      std::vector<const Operation*> fitting;
      for (const auto& op : Doc().operations) {
        if (op.channel == id && Fits(r.entry.role, op)) fitting.push_back(&op);
      }
      if (fitting.empty()) {
        ADD_FAILURE() << Show(r) << ": channel " << id << " (" << c.address
                      << ") has no operation for this direction";
        continue;
      }
      // The wire type is the channel's message; the inner one its reply's result (serve,
      // request) or the Event's data (publish).
      if (!r.entry.type.empty()) {
        EXPECT_TRUE(c.types.count(r.entry.type))
            << Show(r) << ": channel " << id << " carries " << ::testing::PrintToString(c.types);
      }
      if (r.entry.inner_type.empty()) continue;
      if (r.entry.role == Role::kPublish) {
        EXPECT_TRUE(c.data_types.count(r.entry.inner_type))
            << Show(r) << ": channel " << id << "'s events pack "
            << ::testing::PrintToString(c.data_types);
      } else {
        bool any = false;
        for (const auto* op : fitting) any = any || op->result_types.count(r.entry.inner_type);
        EXPECT_TRUE(any) << Show(r) << ": channel " << id << "'s reply result is not this type";
      }
    }
  }
}

void ExpectRequestsServed(const std::vector<Recorded>& recorded) {
  for (const auto& r : recorded) {
    if (r.entry.role != Role::kRequest) continue;
    bool served = false;
    for (const auto& s : recorded) {
      // A node-scoped route serves every node's subject (its address keeps `{node_id}`).
      served =
          served || (s.entry.role == Role::kServe && Matches(r.entry.subject, s.entry.subject));
    }
    EXPECT_TRUE(served) << Show(r) << ": no service serves it";
  }
}

void ExpectOperationsDone(const std::vector<Recorded>& recorded) {
  for (const auto& op : Doc().operations) {
    if (op.channel.empty() || kOutsideParties.count(op.name)) continue;
    EXPECT_TRUE(Done(recorded, op))
        << "operation " << op.name << " (" << op.action << (op.reply ? " with reply" : "") << " on "
        << Doc().channels.at(op.channel).address << ") is declared, but no service registered it";
  }
}

// The outside parties' table stays true and small: it names operations of the document, none
// that a service does.
void ExpectOutsidePartiesOnlyThat(const std::vector<Recorded>& recorded) {
  for (const auto& [name, why] : kOutsideParties) {
    const Operation* found = nullptr;
    for (const auto& op : Doc().operations) found = op.name == name ? &op : found;
    if (found == nullptr) {
      ADD_FAILURE() << name << " is not an operation of the document";
      continue;
    }
    EXPECT_FALSE(Done(recorded, *found))
        << name << " is done by a service now: remove it from kOutsideParties";
  }
  EXPECT_LE(kOutsideParties.size(), 3u);
}

class ContractTest : public ::testing::Test {
 protected:
  template <typename Resp, typename Req>
  Result<Resp> Call(const std::string& subject, const Req& req) {
    return p_.Call<Resp>(subject, req);
  }

  // An operator's console of allocation `id`: a session, its WebSocket through console-gw, the
  // node's relay to a stand-in VNC socket (the test's own: it says the RFB version and takes
  // the client's), a refused cross-origin connect, and another session revoked and listed.
  void RunConsole(const std::string& id, const std::string& socket_dir) {
    namespace asio = boost::asio;
    namespace beast = boost::beast;
    namespace websocket = beast::websocket;
    const std::string path = socket_dir + "/gpuaas-" + id + ".vnc";
    const int lfd = socket(AF_UNIX, SOCK_STREAM, 0);
    sockaddr_un addr{};
    addr.sun_family = AF_UNIX;
    ASSERT_LT(path.size(), sizeof addr.sun_path);
    std::copy(path.begin(), path.end(), addr.sun_path);
    ASSERT_EQ(bind(lfd, reinterpret_cast<sockaddr*>(&addr), sizeof addr), 0);
    ASSERT_EQ(listen(lfd, 1), 0);
    std::string vm_got;
    std::thread vm([&] {
      const int c = accept(lfd, nullptr, nullptr);
      if (c < 0) return;
      (void)!write(c, "RFB 003.008\n", 12);
      char buf[64];
      for (ssize_t n; (n = read(c, buf, sizeof buf)) > 0;) vm_got.append(buf, n);
      close(c);
    });
    v1::CreateConsoleSessionRequest create;
    create.set_allocation_id(id);
    create.set_reason("contract test");
    auto session =
        Call<v1::CreateConsoleSessionResponse>("gpuaas.v1.console.session.create", create);
    ASSERT_TRUE(session.ok()) << session.error().ToString();
    const uint16_t port = p_.console->gateway_port();
    const std::string host = fmt::format("127.0.0.1:{}", port);
    {
      asio::io_context io;
      websocket::stream<beast::tcp_stream> ws(io);
      beast::get_lowest_layer(ws).connect({asio::ip::make_address("127.0.0.1"), port});
      beast::get_lowest_layer(ws).expires_after(10s);
      ws.set_option(websocket::stream_base::decorator([&](websocket::request_type& r) {
        r.set(beast::http::field::origin, "http://" + host);
      }));
      ws.handshake(host, session->ws_path());
      ws.binary(true);
      beast::flat_buffer buf;
      std::string got;
      while (got.size() < 12) {
        ws.read(buf);
        got += beast::buffers_to_string(buf.data());
        buf.consume(buf.size());
      }
      EXPECT_EQ(got, "RFB 003.008\n");
      ws.write(asio::buffer(std::string("RFB 003.008\n")));
      EXPECT_TRUE(testing::WaitFor([&] { return vm_got.size() >= 12; }));
      ws.close(websocket::close_code::normal);
    }
    vm.join();
    close(lfd);
    // A page on another origin: the upgrade is refused (and audited).
    {
      asio::io_context io;
      beast::tcp_stream s(io);
      s.connect({asio::ip::make_address("127.0.0.1"), port});
      beast::http::request<beast::http::empty_body> req(beast::http::verb::get, session->ws_path(),
                                                        11);
      req.set(beast::http::field::host, host);
      req.set(beast::http::field::origin, "http://evil.example");
      req.set(beast::http::field::connection, "Upgrade");
      req.set(beast::http::field::upgrade, "websocket");
      req.set(beast::http::field::sec_websocket_key, "dGhlIHNhbXBsZSBub25jZQ==");
      req.set(beast::http::field::sec_websocket_version, "13");
      beast::http::write(s, req);
      beast::flat_buffer buf;
      beast::http::response<beast::http::string_body> res;
      beast::http::read(s, buf, res);
      EXPECT_EQ(res.result_int(), 403U);
    }
    auto other = Call<v1::CreateConsoleSessionResponse>("gpuaas.v1.console.session.create", create);
    ASSERT_TRUE(other.ok()) << other.error().ToString();
    v1::RevokeConsoleSessionRequest revoke;
    revoke.set_session_id(other->session().session_id());
    revoke.set_reason("contract test");
    auto revoked =
        Call<v1::RevokeConsoleSessionResponse>("gpuaas.v1.console.session.revoke", revoke);
    ASSERT_TRUE(revoked.ok()) << revoked.error().ToString();
    v1::ListConsoleSessionsRequest list;
    list.set_allocation_id(id);
    auto listed = Call<v1::ListConsoleSessionsResponse>("gpuaas.v1.console.session.list", list);
    ASSERT_TRUE(listed.ok()) << listed.error().ToString();
    EXPECT_EQ(listed->sessions_size(), 2);
    RunPageLogin(host, port);
  }

  // An operator logs in to the operator page and out again (the login's audit events).
  void RunPageLogin(const std::string& host, uint16_t port) {
    namespace asio = boost::asio;
    namespace beast = boost::beast;
    auto post = [&](const std::string& target, const std::string& body, const std::string& cookie) {
      asio::io_context io;
      beast::tcp_stream s(io);
      s.connect({asio::ip::make_address("127.0.0.1"), port});
      beast::http::request<beast::http::string_body> req(beast::http::verb::post, target, 11);
      req.set(beast::http::field::host, host);
      req.set(beast::http::field::origin, "http://" + host);
      req.set(beast::http::field::content_type, "application/json");
      if (!cookie.empty()) req.set(beast::http::field::cookie, cookie);
      req.body() = body;
      req.prepare_payload();
      beast::http::write(s, req);
      beast::flat_buffer buf;
      beast::http::response<beast::http::string_body> res;
      beast::http::read(s, buf, res);
      const std::string set_cookie(res[beast::http::field::set_cookie]);
      return std::make_pair(res.result_int(), set_cookie.substr(0, set_cookie.find(';')));
    };
    const std::string token = p_.nats.Token("operator", "", "user:contract");
    auto [in, cookie] = post("/api/login", R"({"token":")" + token + R"("})", "");
    ASSERT_EQ(in, 200U);
    ASSERT_FALSE(cookie.empty());
    EXPECT_EQ(post("/api/logout", "{}", cookie).first, 200U);
  }

  // One short lifecycle, so that every publish path runs: a node registers and reports its
  // topology, its slots are approved (ipam reserves addresses, node tasks run), a slice is
  // placed, provisioned, given a public endpoint (ingress applies it through the node's
  // exposure document; the test acks as the node, with drift) and released, a lease report
  // shows drift and then none, an operator releases a reservation, removes an orphan MAC row
  // and registers a node twice with a change.
  void RunFlow() {
    p_.Start();
    if (HasFatalFailure()) return;
    p_.StartIngress();
    p_.StartConsole();
    p_.StartUsage();
    if (HasFatalFailure()) return;
    const std::string consoles = testing::MakeTempDir("contract-consoles");
    const std::string node = "contract-node";
    p_.StartAgent(node, 2, "contract",
                  {{"GPUAAS_NODE_DESIRED_POLL_MS", "100"},
                   {"GPUAAS_NODE_AGENT_SIM_BEHAVIOR", "succeed"},
                   {"GPUAAS_NODE_AGENT_SIM_STEP_MS", "5"},
                   {"GPUAAS_CONSOLE_SIM_SOCKET_DIR", consoles}});
    ASSERT_TRUE(testing::WaitFor([&] {
      v1::ShowNodeRequest r;
      r.set_node_id(node);
      auto s = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
      return s.ok() && s->snapshot_version() >= 1;
    }));
    v1::ApproveSlotsRequest approve;
    approve.set_node_id(node);
    auto approved = Call<v1::ApproveSlotsResponse>("gpuaas.v1.inventory.slot.approve", approve);
    ASSERT_TRUE(approved.ok()) << approved.error().ToString();
    ASSERT_TRUE(testing::WaitFor([&] {
      v1::ListProjectedSlotsRequest lr;
      lr.set_node_id(node);
      auto l = Call<v1::ListProjectedSlotsResponse>("gpuaas.v1.scheduler.slot.list", lr);
      int ok = 0;
      if (l.ok()) {
        for (const auto& s : l->slots()) ok += s.schedulable() ? 1 : 0;
      }
      return ok == 2;
    }));

    v1::CreateAllocationRequest create;
    create.set_tenant("contract");
    create.set_request_id("contract-1");
    create.set_sku("h200-sxm-slice");
    create.set_gpu_count(1);
    create.set_region("us-east-1");
    create.set_pool("contract");
    create.add_ssh_authorized_keys("ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuYWFzdGVzdA test");
    auto alloc =
        Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", create);
    ASSERT_TRUE(alloc.ok()) << alloc.error().ToString();
    const std::string id = alloc->allocation().allocation_id();
    auto state_is = [&](v1::AllocationState want) {
      return testing::WaitFor(
          [&] {
            v1::GetAllocationRequest g;
            g.set_allocation_id(id);
            auto a = Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", g);
            return a.ok() && a->allocation().state() == want;
          },
          20s);
    };
    ASSERT_TRUE(state_is(v1::ALLOCATION_STATE_ACTIVE));

    // An operator gives the node a port range and exposes the slice's SSH; the test acks the
    // node's exposure document as its agent would, with a foreign rule it removed (drift).
    v1::SetEndpointPoolRequest pool;
    pool.mutable_pool()->set_name("contract-ports");
    pool.mutable_pool()->set_kind(v1::ENDPOINT_POOL_KIND_PORT_RANGE);
    pool.mutable_pool()->set_region("us-east-1");
    pool.mutable_pool()->set_node_id(node);
    pool.mutable_pool()->add_addresses("203.0.113.10");
    pool.mutable_pool()->set_port_min(20000);
    pool.mutable_pool()->set_port_max(20009);
    auto set = Call<v1::SetEndpointPoolResponse>("gpuaas.v1.ingress.pool.set", pool);
    ASSERT_TRUE(set.ok()) << set.error().ToString();
    v1::CreateExposureRequest expose;
    expose.set_allocation_id(id);
    expose.set_name("ssh");
    expose.set_protocol(v1::TRANSPORT_PROTOCOL_TCP);
    expose.set_port(22);
    Result<v1::CreateExposureResponse> exposed = Error::Internal("x", "unset");
    // Ingress learns of the allocation from the scheduler's events.
    ASSERT_TRUE(testing::WaitFor([&] {
      exposed = Call<v1::CreateExposureResponse>("gpuaas.v1.ingress.exposure.create", expose);
      return exposed.ok() || exposed.error().reason != "allocation_not_found";
    }));
    ASSERT_TRUE(exposed.ok()) << exposed.error().ToString();
    const std::string exposure_id = exposed->exposure().exposure_id();
    auto exposure_is = [&](v1::ExposureState want) {
      return testing::WaitFor([&] {
        v1::ListExposuresRequest l;
        l.set_allocation_id(id);
        l.set_state(want);
        auto r = Call<v1::ListExposuresResponse>("gpuaas.v1.ingress.exposure.list", l);
        return r.ok() && r->exposures_size() == 1;
      });
    };
    auto ack_latest = [&](bool foreign_rule) {
      v1::GetNodeExposuresRequest g;
      g.set_node_id(node);
      auto doc =
          Call<v1::GetNodeExposuresResponse>("gpuaas.v1.ingress.node.{node_id}.exposures.get", g);
      ASSERT_TRUE(doc.ok()) << doc.error().ToString();
      v1::AckNodeExposuresRequest ack;
      ack.set_node_id(node);
      ack.set_version(doc->latest_version());
      if (foreign_rule) {
        auto* d = ack.add_drift();
        d->set_kind("rule_foreign");
        d->set_detail("tcp dport 2222 dnat to 10.100.0.99:22");
      }
      auto r =
          Call<v1::AckNodeExposuresResponse>("gpuaas.v1.ingress.node.{node_id}.exposures.ack", ack);
      ASSERT_TRUE(r.ok()) << r.error().ToString();
    };
    ASSERT_TRUE(exposure_is(v1::EXPOSURE_STATE_APPLYING)) << exposure_id;
    ack_latest(true);
    ASSERT_TRUE(exposure_is(v1::EXPOSURE_STATE_ACTIVE)) << exposure_id;
    RunConsole(id, consoles);
    if (HasFatalFailure()) return;
    // A token revocation: console-gw stores and publishes it, every service follows it.
    v1::RevokeTokenRequest revoke;
    revoke.set_subject("user:contract-leaked");
    revoke.set_reason("contract");
    auto revoked = Call<v1::RevokeTokenResponse>("gpuaas.v1.console.token.revoke", revoke);
    ASSERT_TRUE(revoked.ok()) << revoked.error().ToString();
    ASSERT_TRUE(Call<v1::ListTokenRevocationsResponse>("gpuaas.v1.console.token.revocation.list",
                                                       v1::ListTokenRevocationsRequest())
                    .ok());

    v1::ReleaseAllocationRequest rel;
    rel.set_allocation_id(id);
    auto released =
        Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release", rel);
    ASSERT_TRUE(released.ok()) << released.error().ToString();
    ASSERT_TRUE(state_is(v1::ALLOCATION_STATE_RELEASED));
    ASSERT_TRUE(exposure_is(v1::EXPOSURE_STATE_REMOVING)) << exposure_id;
    ack_latest(false);
    ASSERT_TRUE(exposure_is(v1::EXPOSURE_STATE_REMOVED)) << exposure_id;

    // A lease report from the node (the test stands in for the agent, see kOutsideParties):
    // a MAC nobody reserved holds a lease, then the lease is gone.
    const std::string leases =
        fmt::format("gpuaas.v1.evt.node.{node_id}.leases", fmt::arg("node_id", node));
    auto report = [&](bool stranger) {
      v1::LeaseReport r;
      r.set_node_id(node);
      if (stranger) {
        auto* o = r.add_observations();
        o->set_mac("52:54:00:de:ad:01");
        o->set_actual_ip("192.0.2.7");
        o->set_lease_state(v1::LEASE_STATE_UNEXPECTED);
      }
      *r.mutable_observed_at() = google::protobuf::util::TimeUtil::GetCurrentTime();
      outbox::EventSpec spec;
      spec.nats_subject = leases;
      spec.source = "contract-test/stand-in";
      spec.entity = node;
      spec.data = &r;
      const auto ev = outbox::MakeEvent(spec);
      auto ack = messaging::JsPublish(*p_.conn, leases, ev.SerializeAsString(), ev.id());
      ASSERT_TRUE(ack.ok()) << ack.error().ToString();
    };
    auto open_drift = [&] {
      v1::ListDriftRequest r;
      r.set_node_id(node);
      auto d = Call<v1::ListDriftResponse>("gpuaas.v1.ipam.drift.list", r);
      int open = 0;
      if (d.ok()) {
        for (const auto& x : d->drift()) open += x.has_resolved_at() ? 0 : 1;
      }
      return open;
    };
    report(true);
    ASSERT_TRUE(testing::WaitFor([&] { return open_drift() == 1; }));
    report(false);
    ASSERT_TRUE(testing::WaitFor([&] { return open_drift() == 0; }));

    // An operator gives a free slot's reservation back, and registers a node twice with a
    // change.
    std::string free_slot;
    for (const auto& r : approved->results()) {
      if (r.slot_key() != alloc->allocation().slot_keys(0)) free_slot = r.slot_key();
    }
    ASSERT_FALSE(free_slot.empty());
    v1::ReleaseSlotAddressRequest give_back;
    give_back.set_node_id(node);
    give_back.set_slot_key(free_slot);
    give_back.set_reason("contract test");
    auto gone =
        Call<v1::ReleaseSlotAddressResponse>("gpuaas.v1.ipam.reservation.release", give_back);
    ASSERT_TRUE(gone.ok()) << gone.error().ToString();
    EXPECT_TRUE(gone->released());
    // A MAC row of a slot inventory never announced (as a failed approval leaves): the operator
    // lists and removes orphans.
    auto stray = store::WithTx(*p_.ipam->runtime().pg(), [&](pqxx::work& tx) -> Result<void> {
      tx.exec_params(
          "INSERT INTO mac_assignments (node_id, slot_key, mac, source) VALUES ($1, 'stray', "
          "'52:54:01:ff:00:01', 'pool')",
          node);
      return Ok();
    });
    ASSERT_TRUE(stray.ok()) << stray.error().ToString();
    v1::ListOrphansRequest orphans;
    orphans.set_min_age_seconds(0);
    auto listed = Call<v1::ListOrphansResponse>("gpuaas.v1.ipam.orphan.list", orphans);
    ASSERT_TRUE(listed.ok()) << listed.error().ToString();
    EXPECT_EQ(listed->orphans_size(), 1);
    v1::RemoveOrphansRequest prune;
    prune.set_min_age_seconds(0);
    prune.set_reason("contract test");
    auto pruned = Call<v1::RemoveOrphansResponse>("gpuaas.v1.ipam.orphan.remove", prune);
    ASSERT_TRUE(pruned.ok()) << pruned.error().ToString();
    EXPECT_EQ(pruned->removed_size(), 1);
    for (const char* host : {"bare-1", "bare-1b"}) {
      v1::RegisterNodeRequest reg;
      reg.set_node_id("contract-bare");
      reg.set_hostname(host);
      reg.set_region("us-east-1");
      reg.set_pool("contract");
      reg.set_capacity_profile(v1::CAPACITY_PROFILE_BAREMETAL);
      auto r = Call<v1::RegisterNodeResponse>("gpuaas.v1.inventory.node.{node_id}.register", reg);
      ASSERT_TRUE(r.ok()) << r.error().ToString();
    }
    RunDrain("contract-bare");
  }

  // An operator drains a node that holds nothing: answered once the scheduler has it, drained
  // on the scheduler's node.emptied, then back in service.
  void RunDrain(const std::string& node) {
    v1::DrainNodeRequest drain;
    drain.set_node_id(node);
    drain.set_reason("contract test");
    drain.set_deadline_s(3600);
    auto drained = Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.drain", drain);
    ASSERT_TRUE(drained.ok()) << drained.error().ToString();
    EXPECT_TRUE(drained->changed());
    EXPECT_EQ(drained->holding_allocations_size(), 0);
    ASSERT_TRUE(testing::WaitFor([&] {
      v1::ShowNodeRequest r;
      r.set_node_id(node);
      auto s = Call<v1::ShowNodeResponse>("gpuaas.v1.inventory.node.show", r);
      return s.ok() && s->node().admin_state() == v1::NODE_ADMIN_STATE_DRAINED;
    }));
    v1::ListNodeHoldersRequest holders;
    holders.set_node_id(node);
    auto held = Call<v1::ListNodeHoldersResponse>("gpuaas.v1.scheduler.node.holders", holders);
    ASSERT_TRUE(held.ok()) << held.error().ToString();
    EXPECT_EQ(held->holders_size(), 0);
    v1::NodeAdminRequest back;
    back.set_node_id(node);
    back.set_reason("contract test done");
    auto undrained = Call<v1::NodeAdminResponse>("gpuaas.v1.inventory.node.undrain", back);
    ASSERT_TRUE(undrained.ok()) << undrained.error().ToString();
    EXPECT_EQ(undrained->node().admin_state(), v1::NODE_ADMIN_STATE_ACTIVE);
  }

  testing::Platform p_;
};

// One test, one platform: the checks share the flow (a ctest entry per check would run it
// once each).
TEST_F(ContractTest, ServicesDoWhatTheDocumentSays) {
  RunFlow();
  ASSERT_FALSE(HasFatalFailure()) << "the flow did not complete";
  // Relays publish after their transactions commit: wait until every operation the document
  // gives a service is seen (or give up and let the checks say what is missing).
  std::vector<Recorded> recorded;
  std::string error;
  testing::WaitFor(
      [&] {
        error = Collect(p_, *p_.ingress, *p_.console, recorded);
        if (!error.empty()) return false;
        for (const auto& op : Doc().operations) {
          if (!kOutsideParties.count(op.name) && !op.channel.empty() && !Done(recorded, op)) {
            return false;
          }
        }
        return true;
      },
      20s, 100ms);
  ASSERT_EQ(error, "");
  if (std::getenv("GPUAAS_CONTRACT_PRINT") != nullptr) {
    for (const auto& r : recorded) std::cout << Show(r) << "\n";
  }
  {
    SCOPED_TRACE("every service recorded what it does");
    ExpectEveryServiceRecorded(recorded);
  }
  {
    SCOPED_TRACE("every recorded subject is declared, in its direction, with its types");
    ExpectRecordedSubjectsDeclared(recorded);
  }
  {
    SCOPED_TRACE("every request is served");
    ExpectRequestsServed(recorded);
  }
  {
    SCOPED_TRACE("every declared operation is done by some service");
    ExpectOperationsDone(recorded);
  }
  {
    SCOPED_TRACE("the outside parties are only that");
    ExpectOutsidePartiesOnlyThat(recorded);
  }
}

// ---- the document alone ----

TEST(ContractDocumentTest, ReferencesResolve) {
  EXPECT_EQ(Doc().doc["asyncapi"].as<std::string>(), "3.0.0");
  EXPECT_GE(Doc().channels.size(), 5u);
  EXPECT_TRUE(Doc().problems.empty()) << ::testing::PrintToString(Doc().problems);
}

TEST(ContractDocumentTest, EveryChannelHasAnOperation) {
  std::set<std::string> with_ops;
  for (const auto& op : Doc().operations) with_ops.insert(op.channel);
  for (const auto& [id, c] : Doc().channels) {
    EXPECT_TRUE(with_ops.count(id))
        << "channel " << id << " (" << c.address << ") has no operation";
  }
}

TEST(ContractDocumentTest, EveryRequestOperationNamesItsResult) {
  for (const auto& op : Doc().operations) {
    if (!op.reply) continue;
    EXPECT_EQ(op.action, "receive") << op.name;
    EXPECT_EQ(op.result_types.size(), 1u) << op.name << " names no (or several) reply results";
  }
}

TEST(ContractDocumentTest, EveryNamedProtobufTypeExists) {
  int named = 0;
  for (const auto& m : Doc().doc["components"]["messages"]) {
    for (const char* key : {"x-protobuf-type", "x-protobuf-result", "x-protobuf-data"}) {
      if (!m.second[key]) continue;
      const auto type = m.second[key].as<std::string>();
      ++named;
      EXPECT_NE(Doc().pool.FindMessageTypeByName(type), nullptr)
          << m.first << "." << key << " names " << type << ", which proto/ does not define";
    }
    EXPECT_TRUE(m.second["x-protobuf-type"]) << m.first << " names no protobuf type";
  }
  EXPECT_GT(named, 0);
}

TEST(ContractDocumentTest, MatcherSemantics) {
  EXPECT_TRUE(Matches("gpuaas.*.inventory.>", "gpuaas.v1.inventory.node.{node_id}.register"));
  EXPECT_FALSE(Matches("gpuaas.*.inventory.>", "gpuaas.v1.evt.inventory.node.registered"));
  EXPECT_TRUE(Matches("gpuaas.v1.dlq.{stream}.{consumer}", "gpuaas.v1.dlq.{stream}.{consumer}"));
  EXPECT_FALSE(Matches("gpuaas.v1.evt.inventory.node.>", "gpuaas.v1.evt.inventory"));
  EXPECT_TRUE(Matches("gpuaas.v1.dlq.GPUAAS_EVT_NODE.inv", "gpuaas.v1.dlq.{stream}.{consumer}"));
  const ParamValues status = {{"status", {"succeeded", "failed", "rejected"}}};
  EXPECT_TRUE(Matches("gpuaas.v1.evt.node.n1.task.failed",
                      "gpuaas.v1.evt.node.{node_id}.task.{status}", status));
  EXPECT_FALSE(Matches("gpuaas.v1.evt.node.n1.task.progress",
                       "gpuaas.v1.evt.node.{node_id}.task.{status}", status));
  EXPECT_TRUE(
      Matches("gpuaas.v1.evt.node.*.task.>", "gpuaas.v1.evt.node.{node_id}.task.{status}", status));
}

// The registry itself: merging, the payload look, the bound, the JSON round trip.
TEST(ContractRegistryTest, RecordsMergesAndRoundTrips) {
  contract::Registry reg(3);
  reg.Record({Role::kRequest, "gpuaas.v1.a.b.c", "", "", "nats request", 1});
  reg.Record({Role::kRequest, "gpuaas.v1.a.b.c", "gpuaas.v1.X", "gpuaas.v1.Y", "rpc client", 0});
  v1::RegisterNodeRequest data;
  outbox::EventSpec spec;
  spec.nats_subject = "gpuaas.v1.evt.a.b";
  spec.source = "t/1";
  spec.data = &data;
  const auto ev = outbox::MakeEvent(spec);
  reg.RecordPublish("gpuaas.v1.evt.a.b", ev.SerializeAsString(), "jetstream publish");
  reg.RecordPublish("gpuaas.v1.evt.a.b", "not an event", "jetstream publish");
  reg.RecordPublish("gpuaas.v1.raw", "not an event", "nats publish");
  reg.RecordPublish("gpuaas.v1.one.too.many", "", "nats publish");
  EXPECT_EQ(reg.Dropped(), 1u);
  auto back = contract::EntriesFromJson(contract::ToJson(reg, "svc", "i1"));
  ASSERT_TRUE(back.ok()) << back.error().ToString();
  ASSERT_EQ(back->size(), 3u);
  std::map<std::string, contract::Entry> by_subject;
  for (const auto& e : *back) by_subject[e.subject] = e;
  EXPECT_EQ(by_subject["gpuaas.v1.a.b.c"].type, "gpuaas.v1.X");
  EXPECT_EQ(by_subject["gpuaas.v1.a.b.c"].inner_type, "gpuaas.v1.Y");
  EXPECT_EQ(by_subject["gpuaas.v1.a.b.c"].via, "nats request");
  EXPECT_EQ(by_subject["gpuaas.v1.a.b.c"].count, 1u);
  EXPECT_EQ(by_subject["gpuaas.v1.evt.a.b"].type, "gpuaas.v1.Event");
  EXPECT_EQ(by_subject["gpuaas.v1.evt.a.b"].inner_type, "gpuaas.v1.RegisterNodeRequest");
  EXPECT_EQ(by_subject["gpuaas.v1.evt.a.b"].count, 2u);
  EXPECT_EQ(by_subject["gpuaas.v1.raw"].type, "");
  EXPECT_FALSE(contract::EntriesFromJson("{\"entries\":[{\"role\":\"sing\"}]}").ok());
}

}  // namespace
}  // namespace gpuaas
