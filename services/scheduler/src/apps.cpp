#include "apps.hpp"

#include <google/protobuf/text_format.h>

#include <algorithm>
#include <cstdlib>
#include <iostream>
#include <map>
#include <regex>
#include <set>
#include <utility>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuaas/common/enums.hpp"
#include "scheduler_reasons.hpp"

namespace gpuaas::scheduler::apps {

namespace {

// The catalog's apps (gpuaas.v1.ListAppsResponse in protobuf text format). Every app declares
// ssh (tcp 22): a slice is a VM the tenant logs into with the keys of its create request, and
// exposing an app exposes only what it declares, so an app without ssh would leave its VM
// unreachable. Cluster profiles (multi_node) are baremetal-only until slice networking supports
// clusters; single-node Slurm and Kubernetes may run on a slice because their controller and
// workers stay inside the one allocation.
constexpr const char* kManifests = R"pb(
  apps {
    name: "oci-container"
    description: "A tenant's OCI container image with the GPUs passed through"
    kind: APP_KIND_OCI
    shapes: [ CAPACITY_SHAPE_GPU_SLICE, CAPACITY_SHAPE_BAREMETAL ]
    min_gpu_count: 1
    min_node_count: 1
    endpoints {
      name: "ssh"
      protocol: TRANSPORT_PROTOCOL_TCP
      port: 22
      description: "SSH to the host of the container"
    }
    endpoints {
      name: "http"
      protocol: TRANSPORT_PROTOCOL_TCP
      port: 8080
      description: "The port the container publishes"
    }
  }
  apps {
    name: "jupyter"
    description: "JupyterLab with the GPUs of the allocation"
    kind: APP_KIND_JUPYTER
    shapes: [ CAPACITY_SHAPE_GPU_SLICE, CAPACITY_SHAPE_BAREMETAL ]
    min_gpu_count: 1
    min_node_count: 1
    endpoints { name: "ssh" protocol: TRANSPORT_PROTOCOL_TCP port: 22 description: "SSH" }
    endpoints {
      name: "jupyter"
      protocol: TRANSPORT_PROTOCOL_TCP
      port: 8888
      description: "JupyterLab (token login)"
    }
  }
  apps {
    name: "vllm"
    description: "vLLM OpenAI-compatible inference server (tensor parallel within the node)"
    kind: APP_KIND_VLLM
    shapes: [ CAPACITY_SHAPE_GPU_SLICE, CAPACITY_SHAPE_BAREMETAL ]
    min_gpu_count: 1
    max_gpu_count: 8
    min_node_count: 1
    endpoints { name: "ssh" protocol: TRANSPORT_PROTOCOL_TCP port: 22 description: "SSH" }
    endpoints {
      name: "openai-api"
      protocol: TRANSPORT_PROTOCOL_TCP
      port: 8000
      description: "OpenAI-compatible HTTP API"
    }
  }
  apps {
    name: "slurm"
    description: "Single-node Slurm: controller and worker inside one allocation"
    kind: APP_KIND_SLURM
    shapes: [ CAPACITY_SHAPE_GPU_SLICE, CAPACITY_SHAPE_BAREMETAL ]
    min_gpu_count: 1
    min_node_count: 1
    endpoints {
      name: "ssh"
      protocol: TRANSPORT_PROTOCOL_TCP
      port: 22
      description: "SSH to the login/submit host"
    }
  }
  apps {
    name: "kubernetes"
    description: "Single-node Kubernetes: control plane and worker inside one allocation"
    kind: APP_KIND_KUBERNETES
    shapes: [ CAPACITY_SHAPE_GPU_SLICE, CAPACITY_SHAPE_BAREMETAL ]
    min_gpu_count: 1
    min_node_count: 1
    endpoints { name: "ssh" protocol: TRANSPORT_PROTOCOL_TCP port: 22 description: "SSH" }
    endpoints {
      name: "kube-api"
      protocol: TRANSPORT_PROTOCOL_TCP
      port: 6443
      description: "Kubernetes API server"
    }
  }
  apps {
    name: "slurm-cluster"
    description: "Multi-node Slurm cluster profile (controller and workers on separate nodes)"
    kind: APP_KIND_SLURM
    shapes: [ CAPACITY_SHAPE_BAREMETAL ]
    min_gpu_count: 1
    multi_node: true
    min_node_count: 2
    endpoints {
      name: "ssh"
      protocol: TRANSPORT_PROTOCOL_TCP
      port: 22
      description: "SSH to the login node"
    }
  }
  apps {
    name: "kubernetes-cluster"
    description: "Multi-node Kubernetes cluster profile (control plane and workers on separate nodes)"
    kind: APP_KIND_KUBERNETES
    shapes: [ CAPACITY_SHAPE_BAREMETAL ]
    min_gpu_count: 1
    multi_node: true
    min_node_count: 2
    endpoints { name: "ssh" protocol: TRANSPORT_PROTOCOL_TCP port: 22 description: "SSH" }
    endpoints {
      name: "kube-api"
      protocol: TRANSPORT_PROTOCOL_TCP
      port: 6443
      description: "Kubernetes API server"
    }
  }
)pb";

const std::regex kLabel("^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$");

std::string ShapeList(const v1::AppManifest& app) {
  std::vector<std::string> shapes;
  shapes.reserve(app.shapes_size());
  for (int s : app.shapes()) shapes.push_back(enums::Text(static_cast<v1::CapacityShape>(s)));
  return fmt::format("{}", fmt::join(shapes, ", "));
}

bool Unusable(v1::AllocationState s) {
  return s == v1::ALLOCATION_STATE_RELEASING || s == v1::ALLOCATION_STATE_RELEASED ||
         s == v1::ALLOCATION_STATE_FAILED;
}

}  // namespace

std::string_view ReasonText(Reason r) {
  switch (r) {
    case Reason::kMultiNodeRequiresBaremetal:
      return reason::kMultiNodeRequiresBaremetal.text();
    case Reason::kShapeNotSupported:
      return reason::kShapeNotSupported.text();
    case Reason::kGpuCountBelowMinimum:
      return reason::kGpuCountBelowMinimum.text();
    case Reason::kGpuCountAboveMaximum:
      return reason::kGpuCountAboveMaximum.text();
    case Reason::kNodeCountBelowMinimum:
      return reason::kNodeCountBelowMinimum.text();
    case Reason::kMultiNodeNotSupported:
      return reason::kMultiNodeNotSupported.text();
    case Reason::kAllocationNotUsable:
      return reason::kAllocationNotUsable.text();
  }
  return "unknown";
}

std::vector<Incompatibility> Check(const v1::AppManifest& app, const Target& target) {
  std::vector<Incompatibility> out;
  const std::string shape = enums::Text(target.shape).empty()
                                ? std::to_string(static_cast<int>(target.shape))
                                : enums::Text(target.shape);
  const bool listed =
      std::find(app.shapes().begin(), app.shapes().end(), target.shape) != app.shapes().end();
  // A cluster profile on a slice gets the reason that says what would fix it, not only "shape".
  if (app.multi_node() && target.shape != v1::CAPACITY_SHAPE_BAREMETAL) {
    out.push_back({Reason::kMultiNodeRequiresBaremetal,
                   fmt::format("{} is a multi-node cluster profile: it runs on baremetal only "
                               "until slice networking supports clusters, not on {}",
                               app.name(), shape)});
  } else if (!listed) {
    out.push_back({Reason::kShapeNotSupported,
                   fmt::format("{} runs on {}, not on {}", app.name(), ShapeList(app), shape)});
  }
  if (target.gpu_count < app.min_gpu_count()) {
    out.push_back({Reason::kGpuCountBelowMinimum,
                   fmt::format("{} needs at least {} GPU(s) per node, the target has {}",
                               app.name(), app.min_gpu_count(), target.gpu_count)});
  }
  if (app.max_gpu_count() > 0 && target.gpu_count > app.max_gpu_count()) {
    out.push_back({Reason::kGpuCountAboveMaximum,
                   fmt::format("{} uses at most {} GPU(s) per node, the target has {}", app.name(),
                               app.max_gpu_count(), target.gpu_count)});
  }
  if (app.multi_node() && target.node_count < app.min_node_count()) {
    out.push_back({Reason::kNodeCountBelowMinimum,
                   fmt::format("{} needs at least {} nodes, the target has {}", app.name(),
                               app.min_node_count(), target.node_count)});
  }
  if (!app.multi_node() && target.node_count > 1) {
    out.push_back(
        {Reason::kMultiNodeNotSupported,
         fmt::format("{} runs on one node, the target has {}", app.name(), target.node_count)});
  }
  if (target.state && Unusable(*target.state)) {
    out.push_back(
        {Reason::kAllocationNotUsable,
         fmt::format("the allocation is {}: no app can start on it", enums::Text(*target.state))});
  }
  return out;
}

const v1::ListAppsResponse& All() {
  static const v1::ListAppsResponse kAll = [] {
    v1::ListAppsResponse all;
    std::vector<std::string> problems;
    if (!google::protobuf::TextFormat::ParseFromString(kManifests, &all)) {
      problems.emplace_back("kManifests does not parse as gpuaas.v1.ListAppsResponse");
    } else {
      problems = Validate(all);
    }
    // A bad compiled-in table is a programming error the unit test rules out before it ships.
    if (!problems.empty()) {
      std::cerr << fmt::format("apps.cpp kManifests is invalid: {}\n", fmt::join(problems, "; "));
      std::abort();
    }
    std::sort(all.mutable_apps()->begin(), all.mutable_apps()->end(),
              [](const auto& a, const auto& b) { return a.name() < b.name(); });
    return all;
  }();
  return kAll;
}

const v1::AppManifest* Find(std::string_view name) {
  for (const auto& a : All().apps()) {
    if (a.name() == name) return &a;
  }
  return nullptr;
}

Result<const v1::AppManifest*> Lookup(std::string_view name) {
  if (const auto* a = Find(name)) return a;
  std::vector<std::string> names;
  names.reserve(All().apps_size());
  for (const auto& a : All().apps()) names.push_back(a.name());
  return Error::Of(
      Code::kNotFound, reason::kUnknownApp, fmt::format("no app named '{}' in the catalog", name),
      {{"app", std::string(name)}, {"offered", fmt::format("{}", fmt::join(names, ","))}});
}

std::vector<v1::AppEndpoint> Endpoints(const v1::AppManifest& app) {
  return {app.endpoints().begin(), app.endpoints().end()};
}

Result<std::vector<v1::EndpointRequest>> EndpointsToExpose(const v1::CreateAllocationRequest& req,
                                                           const Target& target) {
  std::vector<v1::EndpointRequest> expose(req.expose().begin(), req.expose().end());
  if (req.app().empty()) return expose;
  auto app = Lookup(req.app());
  if (!app.ok()) return app.error();
  if (auto why = Check(**app, target); !why.empty()) {
    Error e = Error::FailedPrecondition(
        reason::kAppNotCompatible,
        fmt::format("app {} cannot run on this order: {}", req.app(), why.front().message));
    for (const auto& w : why) {
      e.details[std::string(ReasonText(w.reason))] = w.message;
    }
    return e;
  }
  // A bare-metal node has its own public addresses: only slices expose the app's endpoints.
  const bool baremetal = target.shape == v1::CAPACITY_SHAPE_BAREMETAL;
  for (const auto& ep : baremetal ? std::vector<v1::AppEndpoint>{} : Endpoints(**app)) {
    const bool named = std::any_of(expose.begin(), expose.end(),
                                   [&](const auto& x) { return x.name() == ep.name(); });
    const bool same_port = std::any_of(expose.begin(), expose.end(), [&](const auto& x) {
      return x.protocol() == ep.protocol() && x.port() == ep.port();
    });
    if (named && same_port) continue;  // asked for explicitly as well
    if (named || same_port) {
      return Error::InvalidArgument(
          reason::kInvalidAllocationRequest,
          fmt::format("expose and app {} both name endpoint {} or port {}", req.app(), ep.name(),
                      ep.port()),
          {{"expose", "must not clash with the app's endpoints"}});
    }
    v1::EndpointRequest add;
    add.set_name(ep.name());
    add.set_protocol(ep.protocol());
    add.set_port(ep.port());
    expose.push_back(std::move(add));
  }
  return expose;
}

std::vector<std::string> Validate(const v1::ListAppsResponse& apps) {
  std::vector<std::string> problems;
  std::set<std::string> names;
  for (const auto& a : apps.apps()) {
    const std::string at = a.name().empty() ? "<unnamed>" : a.name();
    auto bad = [&](const std::string& field, const std::string& why) {
      problems.push_back(fmt::format("{}.{}: {}", at, field, why));
    };
    if (!std::regex_match(a.name(), kLabel)) bad("name", "a lowercase DNS label");
    if (!names.insert(a.name()).second) bad("name", "used by another app");
    if (a.description().empty()) bad("description", "required");
    if (enums::Text(a.kind()).empty()) {
      bad("kind", "one of " + enums::JoinTexts(v1::AppKind_descriptor()));
    }
    if (a.shapes().empty()) bad("shapes", "at least one");
    std::set<int> shapes;
    for (int s : a.shapes()) {
      if (enums::Text(static_cast<v1::CapacityShape>(s)).empty()) {
        bad("shapes", "one of " + enums::JoinTexts(v1::CapacityShape_descriptor()));
      }
      if (!shapes.insert(s).second) bad("shapes", "listed twice");
    }
    if (a.min_gpu_count() < 1) bad("min_gpu_count", "at least 1");
    if (a.max_gpu_count() != 0 && a.max_gpu_count() < a.min_gpu_count()) {
      bad("max_gpu_count", "0 (no maximum) or at least min_gpu_count");
    }
    if (a.multi_node()) {
      if (a.min_node_count() < 2) bad("min_node_count", "at least 2 for a multi-node app");
      if (a.shapes_size() != 1 || a.shapes(0) != v1::CAPACITY_SHAPE_BAREMETAL) {
        bad("shapes", "a multi-node app runs on baremetal only");
      }
    } else if (a.min_node_count() != 1) {
      bad("min_node_count", "1 for a single-node app");
    }
    std::set<std::string> endpoint_names;
    std::set<std::pair<int, int>> ports;
    for (const auto& e : a.endpoints()) {
      const std::string where =
          fmt::format("endpoints.{}", e.name().empty() ? "<unnamed>" : e.name());
      if (!std::regex_match(e.name(), kLabel)) bad(where, "name: a lowercase DNS label");
      if (!endpoint_names.insert(e.name()).second) bad(where, "name used twice");
      if (enums::Text(e.protocol()).empty()) bad(where, "protocol: tcp or udp");
      if (e.port() < 1 || e.port() > 65535) bad(where, "port: 1..65535");
      if (!ports.insert({e.protocol(), e.port()}).second) bad(where, "port used twice");
      if (e.description().empty()) bad(where, "description: required");
    }
  }
  return problems;
}

Result<Target> FromOrder(const Catalog& catalog, const v1::AppOrder& order) {
  std::map<std::string, std::string> problems;
  if (order.gpu_count() < 0 || order.gpu_count() > 64) problems["gpu_count"] = "0..64";
  if (order.node_count() < 0 || order.node_count() > 1024) problems["node_count"] = "0..1024";
  if (order.shape() != v1::CAPACITY_SHAPE_UNSPECIFIED && enums::Text(order.shape()).empty()) {
    problems["shape"] = "one of " + enums::JoinTexts(v1::CapacityShape_descriptor());
  }
  if (order.sku().empty()) {
    if (order.shape() == v1::CAPACITY_SHAPE_UNSPECIFIED) {
      problems["shape"] = "required without a sku";
    }
    if (order.gpu_count() == 0) problems["gpu_count"] = "required without a sku (1..64)";
  }
  if (!problems.empty()) {
    return Error::InvalidArgument(reason::kInvalidOrder,
                                  fmt::format("{} invalid field(s)", problems.size()), problems);
  }
  Target t;
  t.node_count = order.node_count() == 0 ? 1 : order.node_count();
  t.shape = order.shape();
  t.gpu_count = order.gpu_count();
  if (!order.sku().empty()) {
    // The same answer allocation.create would give this order.
    auto checked = catalog.Validate(order.sku(), order.gpu_count(), v1::NETWORK_MODE_UNSPECIFIED);
    if (!checked.ok()) return checked.error();
    const Sku& sku = *checked->first;
    if (order.shape() != v1::CAPACITY_SHAPE_UNSPECIFIED && order.shape() != sku.shape) {
      return Error::InvalidArgument(
          reason::kShapeMismatch,
          fmt::format("SKU {} has shape {}, not {}", sku.name, enums::Text(sku.shape),
                      enums::Text(order.shape())),
          {{"shape", enums::Text(order.shape())}, {"sku_shape", enums::Text(sku.shape)}});
    }
    t.shape = sku.shape;
    if (t.gpu_count == 0) t.gpu_count = sku.allowed_gpu_counts.front();
  }
  return t;
}

}  // namespace gpuaas::scheduler::apps
