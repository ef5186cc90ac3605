// gpuaasctl alloc create/get/list/release.
#include <iostream>
#include <memory>

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
                    a.has_failure() ? a.failure().code() : ""});
  }
  PrintTable(
      {"ALLOCATION", "TENANT", "SKU", "GPUS", "REGION", "STATE", "NODE", "CLAIMS", "FAILURE"},
      rows);
}

}  // namespace

Action AddAllocCommands(CLI::App& app) {
  struct Opts {
    v1::CreateAllocationRequest create;
    std::string id, tenant, state;
    bool force = false;
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
  auto* get = alloc->add_subcommand("get", "One allocation with its claims");
  get->add_option("--id", o->id, "Allocation id")->required();
  auto* list = alloc->add_subcommand("list", "Allocations");
  list->add_option("--tenant", o->tenant, "Only this tenant");
  list->add_option("--state", o->state, "Only this state");
  auto* release = alloc->add_subcommand("release", "Release an allocation");
  release->add_option("--id", o->id, "Allocation id")->required();
  release->add_flag("--force", o->force, "Admin force-release, whatever the state");

  return [=](rpc::Client& client, const Globals& g) -> std::optional<int> {
    const auto timeout = std::chrono::milliseconds(g.timeout_ms);
    if (create->parsed()) {
      auto r = client.Call<v1::CreateAllocationResponse>("gpuaas.v1.scheduler.allocation.create",
                                                         o->create, timeout);
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] {
        google::protobuf::RepeatedPtrField<v1::Allocation> one;
        *one.Add() = r->allocation();
        if (!r->created()) std::cout << "(a retry: the allocation made for this request id)\n";
        PrintAllocations(one);
      });
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
      });
    }
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
      return Print(g, *r, [&] {
        google::protobuf::RepeatedPtrField<v1::Allocation> one;
        *one.Add() = r->allocation();
        PrintAllocations(one);
      });
    }
    return std::nullopt;
  };
}

}  // namespace gpuaas::ctl
