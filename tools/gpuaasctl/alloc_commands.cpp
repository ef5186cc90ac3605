// gpuaasctl alloc create/get/list/release/timeline (--watch follows it as it happens).
#include <algorithm>
#include <charconv>
#include <iostream>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "ctl.hpp"
#include "ctl_reasons.hpp"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::ctl {

namespace {

std::string ClaimName(const v1::ResourceClaim& c) {
  return c.kind() == v1::CLAIM_KIND_SLOT ? c.slot_key() : Txt(c.kind());
}

// The live claims (with their phases).
std::string Claims(const v1::Allocation& a, bool phases = false) {
  std::vector<std::string> out;
  for (const auto& c : a.claims()) {
    if (c.has_released_at()) continue;
    out.push_back(phases ? ClaimName(c) + ":" + Txt(c.phase()) : ClaimName(c));
  }
  return out.empty() ? "-" : Join(out);
}

void PrintAllocations(const google::protobuf::RepeatedPtrField<v1::Allocation>& as) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& a : as) {
    rows.push_back({a.allocation_id(), a.tenant(), a.sku(), std::to_string(a.gpu_count()),
                    a.region(), Txt(a.state()), Or(a.node_id()), Claims(a),
                    a.has_network() ? a.network().actual_ip() : "",
                    a.has_failure() ? Txt(a.failure().stage()) + "/" + a.failure().code() : ""});
  }
  PrintTable(
      {"ALLOCATION", "TENANT", "SKU", "GPUS", "REGION", "STATE", "NODE", "CLAIMS", "IP", "FAILURE"},
      rows);
}

void PrintAllocation(const v1::Allocation& a) {
  google::protobuf::RepeatedPtrField<v1::Allocation> one;
  *one.Add() = a;
  PrintAllocations(one);
}

// A lowercase RFC 1123 label of 1-63 characters (an endpoint's name).
bool IsLabel(std::string_view s) {
  if (s.empty() || s.size() > 63 || s.front() == '-' || s.back() == '-') return false;
  return std::all_of(s.begin(), s.end(), [](char c) {
    return (c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-';
  });
}

// --expose NAME:PORT[/tcp|udp] (tcp when left out); the error says what is wrong.
Result<v1::EndpointRequest> ParseExpose(std::string_view text) {
  const auto bad = [&](std::string_view why) {
    return Error::InvalidArgument(
        reason::kExposeInvalid,
        fmt::format("{}: {} (want NAME:PORT[/tcp|udp], e.g. ssh:22)", text, why));
  };
  const auto colon = text.find(':');
  if (colon == std::string_view::npos) return bad("no ':' between name and port");
  v1::EndpointRequest e;
  const auto name = text.substr(0, colon);
  if (!IsLabel(name)) return bad("the name is not a lowercase DNS label");
  e.set_name(std::string(name));
  auto rest = text.substr(colon + 1);
  const auto slash = rest.find('/');
  e.set_protocol(v1::TRANSPORT_PROTOCOL_TCP);
  if (slash != std::string_view::npos) {
    auto p = enums::Parse<v1::TransportProtocol>(rest.substr(slash + 1));
    if (!p) return bad("the protocol is not tcp or udp");
    e.set_protocol(*p);
    rest = rest.substr(0, slash);
  }
  int32_t port = 0;
  const auto* end = rest.data() + rest.size();
  auto [ptr, ec] = std::from_chars(rest.data(), end, port);
  if (rest.empty() || ec != std::errc() || ptr != end || port < 1 || port > 65535) {
    return bad("the port is not a number 1..65535");
  }
  e.set_port(port);
  return e;
}

// "provisioning" + nothing in flight: a slice whose VM is up, waiting until ingress reports
// its endpoints applied (the timeline says nothing more until they are, or one fails).
std::string PendingEndpoints(const v1::Allocation& a) {
  std::vector<std::string> out;
  for (const auto& e : a.endpoints()) {
    if (e.state() != v1::EXPOSURE_STATE_ACTIVE) {
      out.push_back(e.name() + " " + Txt(e.state(), "waiting"));
    }
  }
  return Join(out, ", ");
}

// The endpoints of `a`, one line each: how to reach it, and why it failed.
void PrintEndpoints(const v1::Allocation& a) {
  if (a.endpoints_size() == 0) return;
  std::vector<std::vector<std::string>> rows;
  rows.reserve(a.endpoints_size());
  for (const auto& e : a.endpoints()) {
    rows.push_back({"  " + e.name(), fmt::format("{}/{}", e.port(), Txt(e.protocol(), "?")),
                    Txt(e.state(), "waiting"), Or(e.connect()), e.reason()});
  }
  std::cout << "endpoints:\n";
  PrintTable({"  ENDPOINT", "PORT", "STATE", "CONNECT", "REASON"}, rows);
}

void PrintEntry(const Globals& g, const v1::TimelineEntry& e) {
  Print(g, e, [&] {
    std::string what = Txt(e.step(), "?");
    if (e.task_type() != v1::TASK_TYPE_UNSPECIFIED) what += " " + enums::Text(e.task_type());
    std::string extra;
    if (e.stage() != v1::TASK_STAGE_UNSPECIFIED) extra += "[" + enums::Text(e.stage()) + "] ";
    if (e.step() == v1::TIMELINE_STEP_TASK_PROGRESS && e.percent() > 0) {
      extra += std::to_string(e.percent()) + "% ";
    }
    if (!e.code().empty()) extra += e.code() + ": ";
    extra += e.detail();
    std::cout << fmt::format("{:>6}  {}  {:<28} {:<13} {}\n", e.seq(), Time(e.at()), what,
                             enums::Text(e.state()), extra)
              << std::flush;
  });
}

// What a --watch waits for.
enum class Want {
  kSettled,   // timeline --watch: active or released
  kActive,    // create --watch
  kReleased,  // release --watch: released, or failed with every claim cleaned and freed
};

Result<v1::GetAllocationResponse> GetAllocation(rpc::Client& client, const Globals& g,
                                                const std::string& id) {
  v1::GetAllocationRequest req;
  req.set_allocation_id(id);
  return client.Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", req,
                                                g.Timeout());
}

// The end of a --watch, nothing in flight any more: prints "settled: STATE" (text) and returns
// kExitOk when the allocation settled as `want` asks, else kExitOutcome.
int Settled(rpc::Client& client, const Globals& g, const std::string& id, v1::AllocationState state,
            Want want) {
  bool good = false;
  std::string note;
  switch (want) {
    case Want::kSettled:
      good = state == v1::ALLOCATION_STATE_ACTIVE || state == v1::ALLOCATION_STATE_RELEASED;
      break;
    case Want::kActive:
      good = state == v1::ALLOCATION_STATE_ACTIVE;
      break;
    case Want::kReleased:
      good = state == v1::ALLOCATION_STATE_RELEASED;
      if (state == v1::ALLOCATION_STATE_FAILED) {
        // A failed allocation whose slots were all cleaned and freed is a successful
        // release too (it stays failed: the failure is its record).
        auto a = GetAllocation(client, g, id);
        if (!a.ok()) return Fail(g, a.error());
        good = true;
        for (const auto& c : a->allocation().claims()) good = good && c.has_released_at();
        note = good ? " (its slots cleaned and freed)" : " (slots still blocked)";
      }
      break;
  }
  if (!g.Json()) std::cout << "settled: " << Txt(state) << note << "\n";
  return good ? kExitOk : kExitOutcome;
}

// Prints the timeline from the start. Without watch: every page, then 0 (-o json: one
// GetAllocationTimelineResponse with all the entries). With watch: each entry as it comes
// (-o json: one JSON object per line), polling until no node task is in flight and no endpoint
// is being applied; then 0 when the allocation settled as `want` asks, kExitOutcome when not,
// kExitUnreachable when the watch timeout passed first.
int FollowTimeline(rpc::Client& client, const Globals& g, const std::string& id, bool watch,
                   Want want, int64_t watch_timeout_s) {
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(watch_timeout_s);
  v1::GetAllocationTimelineRequest req;
  req.set_allocation_id(id);
  req.set_page_size(500);
  if (!watch && !g.Json()) {
    std::cout << fmt::format("{:>6}  {:<23}  {:<28} {:<13} {}\n", "SEQ", "AT", "STEP", "STATE",
                             "DETAIL");
  }
  v1::GetAllocationTimelineResponse all;  // -o json without watch
  std::string pending;                    // the endpoints last reported waiting
  while (true) {
    auto r = client.Call<v1::GetAllocationTimelineResponse>(
        "gpuaas.v1.scheduler.allocation.timeline", req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    if (!watch && g.Json()) {
      all.mutable_entries()->MergeFrom(r->entries());
    } else {
      for (const auto& e : r->entries()) PrintEntry(g, e);
    }
    req.set_page_token(r->last_seq());
    if (!r->next_page_token().empty()) continue;
    if (!watch) {
      if (g.Json()) {
        all.set_last_seq(r->last_seq());
        all.set_state(r->state());
        all.set_in_flight(r->in_flight());
        Print(g, all, [] {});
      }
      return kExitOk;
    }
    if (!r->in_flight() && r->state() == v1::ALLOCATION_STATE_PROVISIONING &&
        want != Want::kReleased) {
      // A slice with endpoints stays provisioning after its VM is up (no task in flight) until
      // ingress reports them all applied (-> active) or one failed (-> failed).
      auto a = GetAllocation(client, g, id);
      if (!a.ok()) return Fail(g, a.error());
      if (a->allocation().endpoints_size() > 0) {
        auto now = PendingEndpoints(a->allocation());
        if (!g.Json() && now != pending && !now.empty()) {
          std::cout << "waiting for endpoints: " << now << "\n" << std::flush;
        }
        pending = now;
        if (std::chrono::steady_clock::now() > until) {
          std::cerr << "endpoints still being applied after " << watch_timeout_s << "s ("
                    << Or(pending) << ")\n";
          return kExitUnreachable;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        continue;
      }
    }
    if (!r->in_flight()) return Settled(client, g, id, r->state(), want);
    if (std::chrono::steady_clock::now() > until) {
      std::cerr << "still in flight after " << watch_timeout_s << "s (state " << Txt(r->state())
                << ")\n";
      return kExitUnreachable;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(200));
  }
}

// --watch-timeout-s of a command that takes --watch.
void AddWatchTimeout(CLI::App& command, int64_t& watch_timeout_s) {
  command
      .add_option("--watch-timeout-s", watch_timeout_s, "Give up watching after this long (exit 3)")
      ->capture_default_str();
}

struct CreateOpts {
  v1::CreateAllocationRequest req;
  std::string network_mode;
  bool watch = false;
  int64_t watch_timeout_s = 900;
};

int RunAllocCreate(rpc::Client& client, const Globals& g, CreateOpts& o) {
  int rc = kExitOk;
  auto mode = ParseFlag<v1::NetworkMode>(g, "network_mode", o.network_mode, &rc);
  if (!mode) return rc;
  o.req.set_network_mode(*mode);
  auto r = client.Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create", o.req,
                                                     g.Timeout());
  if (!r.ok()) return Fail(g, r.error());
  Print(g, *r, [&] {
    if (!r->created()) std::cout << "(a retry: the allocation made for this request id)\n";
    PrintAllocation(r->allocation());
  });
  if (!o.watch) return kExitOk;
  const auto& id = r->allocation().allocation_id();
  const int watched = FollowTimeline(client, g, id, true, Want::kActive, o.watch_timeout_s);
  if (watched != kExitOk && watched != kExitOutcome) return watched;
  // How it settled, with the endpoints' connect hints (-o json: the allocation, last line).
  auto a = GetAllocation(client, g, id);
  if (!a.ok()) {
    Fail(g, a.error());
    return watched;
  }
  Print(g, *a, [&] { PrintEndpoints(a->allocation()); });
  return watched;
}

// alloc create: places an allocation; --watch follows it until it settles.
Action AddAllocCreate(CLI::App& alloc) {
  auto o = std::make_shared<CreateOpts>();
  o->req.set_sku("h200-sxm-slice");
  auto* create = alloc.add_subcommand("create", "Place an allocation");
  create
      ->add_option_function<std::string>(
          "--tenant", [o](const std::string& v) { o->req.set_tenant(v); }, "Tenant")
      ->required();
  create
      ->add_option_function<std::string>(
          "--request-id", [o](const std::string& v) { o->req.set_request_id(v); },
          "Idempotency key (retries with it get the same allocation)")
      ->required();
  create->add_option_function<std::string>(
      "--sku", [o](const std::string& v) { o->req.set_sku(v); },
      "SKU (default h200-sxm-slice; see gpuaasctl catalog)");
  create
      ->add_option_function<int>(
          "--gpus", [o](const int& v) { o->req.set_gpu_count(v); }, "GPU count")
      ->required();
  create
      ->add_option_function<std::string>(
          "--region", [o](const std::string& v) { o->req.set_region(v); }, "Region")
      ->required();
  create->add_option_function<std::string>(
      "--pool", [o](const std::string& v) { o->req.set_pool(v); }, "Pool (default: any)");
  OneOfEnum<v1::NetworkMode>(
      create->add_option("--network-mode", o->network_mode, "Network mode (default: the SKU's)"));
  create->add_option_function<std::string>(
      "--image", [o](const std::string& v) { o->req.set_image(v); },
      "Catalog image name (slices; default: the catalog's default)");
  create->add_option_function<std::vector<std::string>>(
      "--ssh-key",
      [o](const std::vector<std::string>& v) {
        for (const auto& k : v) o->req.add_ssh_authorized_keys(k);
      },
      "SSH public key for the VM's user (repeatable)");
  create->add_option_function<std::string>(
      "--hostname", [o](const std::string& v) { o->req.set_hostname(v); },
      "VM hostname (default slice-<id prefix>)");
  create
      ->add_option_function<std::vector<std::string>>(
          "--expose",
          [o](const std::vector<std::string>& v) {
            for (const auto& x : v) *o->req.add_expose() = *ParseExpose(x);
          },
          "Expose a VM port publicly, NAME:PORT[/tcp|udp] (repeatable), e.g. ssh:22")
      ->check(CLI::Validator(
          [](const std::string& v) {
            auto e = ParseExpose(v);
            return e.ok() ? std::string() : e.error().message;
          },
          "NAME:PORT[/tcp|udp]"));
  create->add_option_function<std::string>(
      "--app", [o](const std::string& v) { o->req.set_app(v); },
      "Catalog app to run (see gpuaasctl app list); its endpoints are exposed too");
  create->add_flag("--watch", o->watch,
                   "Follow the allocation's timeline until it settles; exit 4 unless active");
  AddWatchTimeout(*create, o->watch_timeout_s);
  return [create, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!create->parsed()) return std::nullopt;
    return RunAllocCreate(client, g, *o);
  };
}

void PrintAllocationDetail(const v1::Allocation& a) {
  PrintAllocation(a);
  std::cout << "claims: " << Claims(a, true) << "\n";
  if (a.has_network()) {
    std::cout << fmt::format("network: domain {} mac {} expected {} actual {} lease {}\n",
                             a.network().domain_name(), a.network().mac(),
                             a.network().expected_ip(), a.network().actual_ip(),
                             Txt(a.network().lease_state()));
  }
  if (a.has_failure()) {
    std::cout << fmt::format("failure: {} {}: {}\n", Txt(a.failure().stage()), a.failure().code(),
                             a.failure().detail());
  }
  if (!a.app().empty()) std::cout << "app: " << a.app() << "\n";
  if (a.state() == v1::ALLOCATION_STATE_PROVISIONING && a.vm_ready() && a.endpoints_size() > 0) {
    std::cout << "vm: ready; waiting for its endpoints to be applied\n";
  }
  PrintEndpoints(a);
}

// alloc get: one allocation with its claims, network, failure and endpoints.
Action AddAllocGet(CLI::App& alloc) {
  auto id = std::make_shared<std::string>();
  auto* get = alloc.add_subcommand("get", "One allocation with its claims");
  get->add_option("--id", *id, "Allocation id")->required();
  return [get, id](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!get->parsed()) return std::nullopt;
    auto r = GetAllocation(client, g, *id);
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] { PrintAllocationDetail(r->allocation()); });
  };
}

// alloc list: every page of allocations, of a tenant and/or in a state.
Action AddAllocList(CLI::App& alloc) {
  struct Opts {
    std::string tenant, state;
  };
  auto o = std::make_shared<Opts>();
  auto* list = alloc.add_subcommand("list", "Allocations");
  list->add_option("--tenant", o->tenant, "Only this tenant");
  OneOfEnum<v1::AllocationState>(list->add_option("--state", o->state, "Only this state"));
  return [list, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!list->parsed()) return std::nullopt;
    int rc = kExitOk;
    auto state = ParseFlag<v1::AllocationState>(g, "state", o->state, &rc);
    if (!state) return rc;
    v1::ListAllocationsResponse all;
    v1::ListAllocationsRequest req;
    req.set_tenant(o->tenant);
    req.set_state(*state);
    auto r = ListAll<v1::ListAllocationsResponse>(
        client, "gpuaas.v1.scheduler.allocation.list", req, g.Timeout(),
        [&](v1::ListAllocationsResponse& page) {
          all.mutable_allocations()->MergeFrom(page.allocations());
        });
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, all, [&] { PrintAllocations(all.allocations()); });
  };
}

struct ReleaseOpts {
  std::string id, reason;
  bool force = false, watch = false;
  int64_t watch_timeout_s = 900;
};

int RunAllocRelease(rpc::Client& client, const Globals& g, const ReleaseOpts& o) {
  auto r = [&]() -> Result<v1::ReleaseAllocationResponse> {
    if (o.force) {
      // Its own subject, which only the operator role may publish.
      v1::ForceReleaseAllocationRequest req;
      req.set_allocation_id(o.id);
      req.set_reason(o.reason);
      return client.Call<v1::ReleaseAllocationResponse>(
          "gpuaas.v1.scheduler.allocation.force_release", req, g.Timeout());
    }
    v1::ReleaseAllocationRequest req;
    req.set_allocation_id(o.id);
    req.set_reason(o.reason);
    return client.Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release", req,
                                                      g.Timeout());
  }();
  if (!r.ok()) return Fail(g, r.error());
  Print(g, *r, [&] { PrintAllocation(r->allocation()); });
  if (o.watch) return FollowTimeline(client, g, o.id, true, Want::kReleased, o.watch_timeout_s);
  return kExitOk;
}

// alloc release [--force]: releases an allocation; --watch follows it until it settles.
Action AddAllocRelease(CLI::App& alloc) {
  auto o = std::make_shared<ReleaseOpts>();
  auto* release = alloc.add_subcommand("release", "Release an allocation");
  release->add_option("--id", o->id, "Allocation id")->required();
  release->add_flag("--force", o->force,
                    "Operator force-release, whatever the host state (needs --reason)");
  release->add_option("--reason", o->reason, "Why (recorded with who released it)");
  release->add_flag("--watch", o->watch,
                    "Follow the allocation's timeline until it settles; exit 4 unless released");
  AddWatchTimeout(*release, o->watch_timeout_s);
  return [release, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!release->parsed()) return std::nullopt;
    return RunAllocRelease(client, g, *o);
  };
}

// alloc timeline: an allocation's steps; --watch keeps printing them until it settles.
Action AddAllocTimeline(CLI::App& alloc) {
  struct Opts {
    std::string id;
    bool watch = false;
    int64_t watch_timeout_s = 900;
  };
  auto o = std::make_shared<Opts>();
  auto* timeline = alloc.add_subcommand("timeline", "An allocation's steps, tasks and results");
  timeline->add_option("--id", o->id, "Allocation id")->required();
  timeline->add_flag("--watch", o->watch,
                     "Keep printing new steps until no node task is in flight; exit 4 unless it "
                     "settled active or released");
  AddWatchTimeout(*timeline, o->watch_timeout_s);
  return [timeline, o](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!timeline->parsed()) return std::nullopt;
    return FollowTimeline(client, g, o->id, o->watch, Want::kSettled, o->watch_timeout_s);
  };
}

}  // namespace

Action AddAllocCommands(CLI::App& app) {
  auto* alloc = app.add_subcommand("alloc", "Allocations (baremetal nodes and GPU slices)");
  alloc->require_subcommand(1);
  return FirstOf<Action>({AddAllocCreate(*alloc), AddAllocGet(*alloc), AddAllocList(*alloc),
                          AddAllocRelease(*alloc), AddAllocTimeline(*alloc)});
}

}  // namespace gpuaas::ctl
