#pragma once
// App manifests and app compatibility (checklist Phase 7). The manifests are a table compiled
// into the scheduler (apps.cpp, kManifests): each app declares the capacity shapes it runs on,
// the GPUs and nodes it needs, and the endpoints it listens on. Check() is the one rule that says
// whether an app fits a target (an allocation, or an order not placed yet): pure, no I/O, every
// reason at once. AppHandlers (apps_rpc.cpp) serves app.list and app.compatibility.
//
// The allocation-create path uses EndpointsToExpose: Lookup + Check to refuse an app that does not
// fit the order, and Endpoints to expand an app into the endpoints it exposes (only these).
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/scheduler/catalog.hpp"
#include "gpuaas/v1/apps.pb.h"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::rpc {
struct Context;
}  // namespace gpuaas::rpc
namespace gpuaas::store {
class Pool;
}  // namespace gpuaas::store

namespace gpuaas::scheduler {
namespace apps {

// Why an app cannot run on a target; the text (ReasonText) is AppIncompatibility.reason.
enum class Reason {
  // A cluster profile on anything but baremetal.
  kMultiNodeRequiresBaremetal,
  // The target's shape is not one the app lists.
  kShapeNotSupported,
  kGpuCountBelowMinimum,
  kGpuCountAboveMaximum,
  // A cluster profile with fewer nodes than it needs.
  kNodeCountBelowMinimum,
  // A single-node app asked for on several nodes.
  kMultiNodeNotSupported,
  // The allocation is releasing, released or failed.
  kAllocationNotUsable,
};
// The stable snake_case text of a reason ("multi_node_requires_baremetal").
std::string_view ReasonText(Reason r);

struct Incompatibility {
  Reason reason;
  std::string message;
};

// What an app is checked against. `state` is set for an existing allocation, unset for an order.
struct Target {
  v1::CapacityShape shape = v1::CAPACITY_SHAPE_UNSPECIFIED;
  int gpu_count = 0;  // per node
  int node_count = 1;
  std::optional<v1::AllocationState> state;
};

// Every reason `app` cannot run on `target` (empty: compatible), in a fixed order.
std::vector<Incompatibility> Check(const v1::AppManifest& app, const Target& target);

// The target of an order not placed yet. With a SKU: the catalog's answer to the order as
// allocation.create gives it (unknown_sku, shape_not_offered, gpu_count_not_allowed), the SKU's
// shape (shape_mismatch when the order names another) and its default GPU count for 0. Without:
// the order's shape and GPU count, both required. INVALID_ARGUMENT invalid_order for bad fields.
Result<Target> FromOrder(const Catalog& catalog, const v1::AppOrder& order);

// Every app of the catalog, by name (parsed once from the compiled-in table).
const v1::ListAppsResponse& All();
// The app named `name`, or nullptr.
const v1::AppManifest* Find(std::string_view name);
// Find, or NOT_FOUND unknown_app naming the apps there are (details: app, offered).
Result<const v1::AppManifest*> Lookup(std::string_view name);
// The endpoints exposing `app` exposes: exactly the ones it declares.
std::vector<v1::AppEndpoint> Endpoints(const v1::AppManifest& app);

// What an allocation create exposes (the create path's policy; pure): the request's `expose`,
// then, when it names an app, the app's declared endpoints on a slice `target` (a bare-metal
// node has its own public addresses). An app named twice (same name and port) is exposed once.
// Errors: NOT_FOUND unknown_app; FAILED_PRECONDITION app_not_compatible (every reason of Check
// in the details); INVALID_ARGUMENT invalid_allocation_request when the request and the app
// name one endpoint with another port, or one port under another name.
Result<std::vector<v1::EndpointRequest>> EndpointsToExpose(const v1::CreateAllocationRequest& req,
                                                           const Target& target);

// Problems of a manifest table (empty: valid): names, kinds, shapes, GPU and node bounds,
// endpoints (DNS-label names, 1..65535 ports, protocols, no duplicate name or port). The
// compiled-in table is checked by a unit test and once at start.
std::vector<std::string> Validate(const v1::ListAppsResponse& apps);

}  // namespace apps

// The handlers of gpuaas.v1.scheduler.app.list and gpuaas.v1.scheduler.app.compatibility
// (apps_rpc.cpp; routed in scheduler_routes.cpp). An order is validated against `catalog` as
// allocation.create validates it; an allocation is read as allocation.get reads it (a tenant
// principal sees only its own tenant's).
class AppHandlers {
 public:
  // Checks the compiled-in manifest table: a bad table aborts at start, not on a request.
  AppHandlers(std::shared_ptr<store::Pool> pool, Catalog catalog);
  Result<v1::ListAppsResponse> List(const v1::ListAppsRequest& req, rpc::Context& ctx);
  Result<v1::CheckAppCompatibilityResponse> Compatibility(
      const v1::CheckAppCompatibilityRequest& req, rpc::Context& ctx);

 private:
  std::shared_ptr<store::Pool> pool_;
  Catalog catalog_;
};

}  // namespace gpuaas::scheduler
