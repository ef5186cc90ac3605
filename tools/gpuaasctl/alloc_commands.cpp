// gpuaasctl alloc create/get/list/release/timeline (--watch follows it as it happens).
#include <iostream>
#include <memory>
#include <thread>

#include <fmt/format.h>

#include "ctl.hpp"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::ctl {

namespace {

std::string Claims(const v1::Allocation& a) {
  std::vector<std::string> out;
  for (const auto& c : a.claims()) {
    if (c.has_released_at()) continue;
    out.push_back(c.kind() == "slot" ? c.slot_key() : "node_exclusive");
  }
  return out.empty() ? "-" : Join(out);
}

void PrintAllocations(const google::protobuf::RepeatedPtrField<v1::Allocation>& as) {
  std::vector<std::vector<std::string>> rows;
  for (const auto& a : as) {
    rows.push_back({a.allocation_id(), a.tenant(), a.sku(), std::to_string(a.gpu_count()),
                    a.region(), a.state(), a.node_id().empty() ? "-" : a.node_id(), Claims(a),
                    a.has_network() ? a.network().actual_ip() : "",
                    a.has_failure() ? a.failure().stage() + "/" + a.failure().code() : ""});
  }
  PrintTable(
      {"ALLOCATION", "TENANT", "SKU", "GPUS", "REGION", "STATE", "NODE", "CLAIMS", "IP", "FAILURE"},
      rows);
}

std::string Claims(const v1::Allocation& a, bool phases) {
  if (!phases) return Claims(a);
  std::vector<std::string> out;
  for (const auto& c : a.claims()) {
    if (c.has_released_at()) continue;
    out.push_back((c.kind() == "slot" ? c.slot_key() : "node_exclusive") + ":" + c.phase());
  }
  return out.empty() ? "-" : Join(out);
}

void PrintEntry(const Globals& g, const v1::TimelineEntry& e) {
  if (g.output == "json") {
    std::cout << ToJson(e) << "\n";
    return;
  }
  std::string what = e.step();
  if (!e.task_type().empty()) what += " " + e.task_type();
  std::string extra;
  if (!e.stage().empty()) extra += "[" + e.stage() + "] ";
  if (e.step() == "task_progress" && e.percent() > 0) extra += std::to_string(e.percent()) + "% ";
  if (!e.code().empty()) extra += e.code() + ": ";
  extra += e.detail();
  std::cout << fmt::format("{:>6}  {}  {:<28} {:<13} {}\n", e.seq(), Time(e.at()), what, e.state(),
                           extra)
            << std::flush;
}

}  // namespace

Action AddAllocCommands(CLI::App& app) {
  struct Opts {
    v1::CreateAllocationRequest create;
    std::string id, tenant, state;
    bool force = false, watch = false;
    int64_t watch_timeout_s = 900;
  };
  auto o = std::make_shared<Opts>();
  o->create.set_sku("h200-sxm-slice");
  auto* alloc = app.add_subcommand("alloc", "Allocations (baremetal nodes and GPU slices)");
  alloc->require_subcommand(1);
  auto* create = alloc->add_subcommand("create", "Place an allocation");
  create
      ->add_option_function<std::string>(
          "--tenant", [o](const std::string& v) { o->create.set_tenant(v); }, "Tenant")
      ->required();
  create
      ->add_option_function<std::string>(
          "--request-id", [o](const std::string& v) { o->create.set_request_id(v); },
          "Idempotency key (retries with it get the same allocation)")
      ->required();
  create->add_option_function<std::string>(
      "--sku", [o](const std::string& v) { o->create.set_sku(v); }, "SKU (default h200-sxm-slice)");
  create
      ->add_option_function<int>(
          "--gpus", [o](const int& v) { o->create.set_gpu_count(v); }, "GPU count")
      ->required();
  create
      ->add_option_function<std::string>(
          "--region", [o](const std::string& v) { o->create.set_region(v); }, "Region")
      ->required();
  create->add_option_function<std::string>(
      "--pool", [o](const std::string& v) { o->create.set_pool(v); }, "Pool (default: any)");
  create->add_option_function<std::string>(
      "--network-mode", [o](const std::string& v) { o->create.set_network_mode(v); },
      "private-nat | fabric-only (default: the SKU's)");
  create->add_option_function<std::string>(
      "--image", [o](const std::string& v) { o->create.set_image(v); },
      "Catalog image name (slices; default: the catalog's default)");
  create->add_option_function<std::vector<std::string>>(
      "--ssh-key",
      [o](const std::vector<std::string>& v) {
        for (const auto& k : v) o->create.add_ssh_authorized_keys(k);
      },
      "SSH public key for the VM's user (repeatable)");
  create->add_option_function<std::string>(
      "--hostname", [o](const std::string& v) { o->create.set_hostname(v); },
      "VM hostname (default slice-<id prefix>)");
  create->add_flag("--watch", o->watch, "Follow the allocation's timeline until it settles");
  auto* get = alloc->add_subcommand("get", "One allocation with its claims");
  get->add_option("--id", o->id, "Allocation id")->required();
  auto* list = alloc->add_subcommand("list", "Allocations");
  list->add_option("--tenant", o->tenant, "Only this tenant");
  list->add_option("--state", o->state, "Only this state");
  auto* release = alloc->add_subcommand("release", "Release an allocation");
  release->add_option("--id", o->id, "Allocation id")->required();
  release->add_flag("--force", o->force, "Admin force-release, whatever the state");
  release->add_flag("--watch", o->watch, "Follow the allocation's timeline until it settles");
  auto* timeline = alloc->add_subcommand("timeline", "An allocation's steps, tasks and results");
  timeline->add_option("--id", o->id, "Allocation id")->required();
  timeline->add_flag("--watch", o->watch,
                     "Keep printing new steps until no node task is in flight");
  for (auto* c : {create, release, timeline}) {
    c->add_option("--watch-timeout-s", o->watch_timeout_s, "Give up watching after this long");
  }

  // Prints the timeline from the start; with watch, polls for new steps until nothing is in
  // flight (exit 0 when it ends active/released, 2 when failed or blocked) or the timeout.
  // `releasing`: a failed allocation whose slots were all cleaned and freed is a successful
  // release too (it stays failed: the failure is its record).
  auto follow = [o](rpc::Client& client, const Globals& g, const std::string& id, bool watch,
                    bool releasing = false) -> int {
    const auto timeout = std::chrono::milliseconds(g.timeout_ms);
    const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(o->watch_timeout_s);
    v1::GetAllocationTimelineRequest req;
    req.set_allocation_id(id);
    req.set_page_size(500);
    if (!watch && g.output != "json") {
      std::cout << fmt::format("{:>6}  {:<23}  {:<28} {:<13} {}\n", "SEQ", "AT", "STEP", "STATE",
                               "DETAIL");
    }
    while (true) {
      auto r = client.Call<v1::GetAllocationTimelineResponse>(
          "gpuaas.v1.scheduler.allocation.timeline", req, timeout);
      if (!r.ok()) return Fail(g, r.error());
      for (const auto& e : r->entries()) PrintEntry(g, e);
      req.set_page_token(r->last_seq());
      if (!r->next_page_token().empty()) continue;
      if (!watch) return 0;
      if (!r->in_flight()) {
        bool good = r->state() == "active" || r->state() == "released";
        std::string note;
        if (releasing && r->state() == "failed") {
          v1::GetAllocationRequest one;
          one.set_allocation_id(id);
          auto a = client.Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", one,
                                                          timeout);
          if (!a.ok()) return Fail(g, a.error());
          good = true;
          for (const auto& c : a->allocation().claims()) good = good && c.has_released_at();
          note = good ? " (its slots cleaned and freed)" : " (slots still blocked)";
        }
        if (g.output != "json") std::cout << "settled: " << r->state() << note << "\n";
        return good ? 0 : 2;
      }
      if (std::chrono::steady_clock::now() > until) {
        std::cerr << "still in flight after " << o->watch_timeout_s << "s (state " << r->state()
                  << ")\n";
        return 3;
      }
      std::this_thread::sleep_for(std::chrono::milliseconds(200));
    }
  };

  return [=](rpc::Client& client, const Globals& g) -> std::optional<int> {
    const auto timeout = std::chrono::milliseconds(g.timeout_ms);
    if (create->parsed()) {
      auto r = client.Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create",
                                                         o->create, timeout);
      if (!r.ok()) return Fail(g, r.error());
      Print(g, *r, [&] {
        google::protobuf::RepeatedPtrField<v1::Allocation> one;
        *one.Add() = r->allocation();
        if (!r->created()) std::cout << "(a retry: the allocation made for this request id)\n";
        PrintAllocations(one);
      });
      if (o->watch) return follow(client, g, r->allocation().allocation_id(), true);
      return 0;
    }
    if (get->parsed()) {
      v1::GetAllocationRequest req;
      req.set_allocation_id(o->id);
      auto r = client.Call<v1::GetAllocationResponse>("gpuaas.v1.scheduler.allocation.get", req,
                                                      timeout);
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        google::protobuf::RepeatedPtrField<v1::Allocation> one;
        *one.Add() = r->allocation();
        PrintAllocations(one);
        const auto& a = r->allocation();
        std::cout << "claims: " << Claims(a, true) << "\n";
        if (a.has_network()) {
          std::cout << fmt::format("network: domain {} mac {} expected {} actual {} lease {}\n",
                                   a.network().domain_name(), a.network().mac(),
                                   a.network().expected_ip(), a.network().actual_ip(),
                                   a.network().lease_state());
        }
        if (a.has_failure()) {
          std::cout << fmt::format("failure: {} {}: {}\n", a.failure().stage(), a.failure().code(),
                                   a.failure().detail());
        }
      });
    }
    if (timeline->parsed()) return follow(client, g, o->id, o->watch);
    if (list->parsed()) {
      v1::ListAllocationsResponse all;
      v1::ListAllocationsRequest req;
      req.set_tenant(o->tenant);
      req.set_state(o->state);
      auto r = ListAll<v1::ListAllocationsResponse>(
          client, "gpuaas.v1.scheduler.allocation.list", req, timeout,
          [&](v1::ListAllocationsResponse& page) {
            all.mutable_allocations()->MergeFrom(page.allocations());
          });
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, all, [&] { PrintAllocations(all.allocations()); });
    }
    if (release->parsed()) {
      v1::ReleaseAllocationRequest req;
      req.set_allocation_id(o->id);
      req.set_force(o->force);
      auto r = client.Call<v1::ReleaseAllocationResponse>("gpuaas.v1.scheduler.allocation.release",
                                                          req, timeout);
      if (!r.ok()) return Fail(g, r.error());
      Print(g, *r, [&] {
        google::protobuf::RepeatedPtrField<v1::Allocation> one;
        *one.Add() = r->allocation();
        PrintAllocations(one);
      });
      if (o->watch) return follow(client, g, o->id, true, true);
      return 0;
    }
    return std::nullopt;
  };
}

}  // namespace gpuaas::ctl
