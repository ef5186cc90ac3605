// gpuaas.v1.scheduler.app.list and app.compatibility (apps.hpp): the wiring around the pure
// apps::Check.
#include <pqxx/pqxx>

#include <fmt/format.h>

#include "allocation_rows.hpp"
#include "apps.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "scheduler_reasons.hpp"

namespace gpuaas::scheduler {

namespace {

// The allocation as a target: its shape, GPU count and state. An allocation holds one node.
Result<apps::Target> AllocationTarget(store::Pool& pool, const std::string& id,
                                      const std::string& tenant_scope) {
  return store::WithTx(
      pool,
      [&](pqxx::work& tx) -> Result<apps::Target> {
        auto a = LoadAllocation(tx, id, false, tenant_scope);
        if (!a.ok()) return a.error();
        apps::Target t;
        t.shape = a->shape();
        t.gpu_count = a->gpu_count();
        t.node_count = 1;
        t.state = a->state();
        return t;
      },
      store::ReadSnapshot());
}

}  // namespace

AppHandlers::AppHandlers(std::shared_ptr<store::Pool> pool, Catalog catalog)
    : pool_(std::move(pool)), catalog_(std::move(catalog)) {
  // Checked at start as well as by the unit test: a bad table aborts here, not on a request.
  (void)apps::All();
}

Result<v1::ListAppsResponse> AppHandlers::List(const v1::ListAppsRequest& /*req*/,
                                               rpc::Context& /*ctx*/) {
  return apps::All();
}

Result<v1::CheckAppCompatibilityResponse> AppHandlers::Compatibility(
    const v1::CheckAppCompatibilityRequest& req, rpc::Context& ctx) {
  if (req.app().empty()) {
    return Error::InvalidArgument(reason::kAppRequired, "name the app to check (app.list)",
                                  {{"app", "required"}});
  }
  auto app = apps::Lookup(req.app());
  if (!app.ok()) return app.error();
  Result<apps::Target> target = Error::InvalidArgument(
      reason::kTargetRequired, "check the app against an allocation_id or an order",
      {{"target", "allocation_id or order"}});
  if (req.has_order()) {
    target = apps::FromOrder(catalog_, req.order());
  } else if (req.target_case() == v1::CheckAppCompatibilityRequest::kAllocationId) {
    target = AllocationTarget(*pool_, req.allocation_id(), ctx.TenantScope());
  }
  if (!target.ok()) return target.error();
  v1::CheckAppCompatibilityResponse resp;
  *resp.mutable_app() = **app;
  resp.set_shape(target->shape);
  resp.set_gpu_count(target->gpu_count);
  resp.set_node_count(target->node_count);
  for (const auto& i : apps::Check(**app, *target)) {
    auto* r = resp.add_reasons();
    r->set_reason(std::string(apps::ReasonText(i.reason)));
    r->set_message(i.message);
  }
  resp.set_compatible(resp.reasons().empty());
  return resp;
}

}  // namespace gpuaas::scheduler
