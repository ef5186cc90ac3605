// gpuaasctl app list / app check: the catalog's apps and whether one fits an allocation or an
// order (gpuaas.v1.scheduler.app.list, app.compatibility).
#include <iostream>
#include <memory>

#include <fmt/format.h>

#include "ctl.hpp"
#include "gpuaas/v1/apps.pb.h"

namespace gpuaas::ctl {

namespace {

std::string Shapes(const v1::AppManifest& a) {
  std::vector<std::string> out;
  out.reserve(a.shapes_size());
  for (int s : a.shapes()) out.push_back(Txt(static_cast<v1::CapacityShape>(s), std::to_string(s)));
  return out.empty() ? "-" : Join(out);
}

std::string Gpus(const v1::AppManifest& a) {
  if (a.max_gpu_count() == 0) return fmt::format("{}+", a.min_gpu_count());
  if (a.max_gpu_count() == a.min_gpu_count()) return std::to_string(a.min_gpu_count());
  return fmt::format("{}-{}", a.min_gpu_count(), a.max_gpu_count());
}

std::string Nodes(const v1::AppManifest& a) {
  return a.multi_node() ? fmt::format("{}+ (cluster)", a.min_node_count()) : "1";
}

// "ssh 22/tcp, jupyter 8888/tcp"
std::string Endpoints(const v1::AppManifest& a) {
  std::vector<std::string> out;
  out.reserve(a.endpoints_size());
  for (const auto& e : a.endpoints()) {
    out.push_back(fmt::format("{} {}/{}", e.name(), e.port(), Txt(e.protocol(), "?")));
  }
  return out.empty() ? "-" : Join(out, ", ");
}

void PrintApps(const v1::ListAppsResponse& r) {
  std::vector<std::vector<std::string>> rows;
  rows.reserve(r.apps_size());
  for (const auto& a : r.apps()) {
    rows.push_back(
        {a.name(), Txt(a.kind()), Shapes(a), Gpus(a), Nodes(a), Endpoints(a), a.description()});
  }
  PrintTable({"APP", "KIND", "SHAPES", "GPUS/NODE", "NODES", "ENDPOINTS", "DESCRIPTION"}, rows);
}

void PrintCheck(const v1::CheckAppCompatibilityResponse& r, const std::string& target) {
  std::cout << fmt::format("{} on {} ({}, {} GPU(s) per node, {} node(s)): {}\n", r.app().name(),
                           target, Txt(r.shape()), r.gpu_count(), r.node_count(),
                           r.compatible() ? "compatible" : "not compatible");
  if (r.compatible()) {
    std::cout << "endpoints: " << Endpoints(r.app()) << "\n";
    return;
  }
  std::vector<std::vector<std::string>> rows;
  rows.reserve(r.reasons_size());
  for (const auto& i : r.reasons()) rows.push_back({i.reason(), i.message()});
  PrintTable({"REASON", "MESSAGE"}, rows);
}

}  // namespace

Action AddAppCommands(CLI::App& app) {
  struct Opts {
    std::string app, allocation, sku, shape;
    int gpus = 0, nodes = 0;
  };
  auto o = std::make_shared<Opts>();
  auto* apps = app.add_subcommand("app", "Apps of the catalog and where they can run");
  apps->require_subcommand(1);
  auto* list = apps->add_subcommand("list", "Every app: shapes, GPUs, nodes, endpoints");
  auto* check = apps->add_subcommand(
      "check", "Can an app run on an allocation or an order? Exit 4 when it cannot");
  check->add_option("app", o->app, "App name (see gpuaasctl app list)")->required();
  auto* target = check->add_option_group("target", "An allocation, or an order not placed yet");
  auto* allocation = target->add_option("--allocation", o->allocation, "Allocation id");
  auto* sku = target->add_option("--sku", o->sku, "Order: catalog SKU (its shape is the order's)");
  auto* shape = OneOfEnum<v1::CapacityShape>(
      target->add_option("--shape", o->shape, "Order: capacity shape (required without --sku)"));
  target->require_option(1, 0);
  auto* gpus = check->add_option(
      "--gpus", o->gpus,
      "Order: GPUs per node (default with --sku: the SKU's default; required without)");
  auto* nodes = check->add_option("--nodes", o->nodes, "Order: nodes (default 1)");
  for (auto* order_flag : {sku, shape, gpus, nodes}) allocation->excludes(order_flag);

  return [=](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (list->parsed()) {
      auto r = client.Call<v1::ListAppsResponse>("gpuaas.v1.scheduler.app.list",
                                                 v1::ListAppsRequest(), g.Timeout());
      if (!r.ok()) return Fail(g, r.error());
      return Print(g, *r, [&] { PrintApps(*r); });
    }
    if (!check->parsed()) return std::nullopt;
    v1::CheckAppCompatibilityRequest req;
    req.set_app(o->app);
    std::string target_text;
    if (!o->allocation.empty()) {
      req.set_allocation_id(o->allocation);
      target_text = "allocation " + o->allocation;
    } else {
      int rc = kExitOk;
      auto s = ParseFlag<v1::CapacityShape>(g, "shape", o->shape, &rc);
      if (!s) return rc;
      auto* order = req.mutable_order();
      order->set_sku(o->sku);
      order->set_shape(*s);
      order->set_gpu_count(o->gpus);
      order->set_node_count(o->nodes);
      target_text = o->sku.empty() ? "an order" : "an order of " + o->sku;
    }
    auto r = client.Call<v1::CheckAppCompatibilityResponse>("gpuaas.v1.scheduler.app.compatibility",
                                                            req, g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    Print(g, *r, [&] { PrintCheck(*r, target_text); });
    return r->compatible() ? kExitOk : kExitOutcome;
  };
}

}  // namespace gpuaas::ctl
