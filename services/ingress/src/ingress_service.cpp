#include "gpuaas/ingress/ingress_service.hpp"

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/event.pb.h"
#include "ingress_metrics.hpp"
#include "ingress_reasons.hpp"
#include "ingress_store.hpp"

namespace gpuaas::ingress {

namespace {

Result<void> CheckNodeId(const std::string& id) {
  if (!ids::IsNodeId(id)) {
    return Error::InvalidArgument(reason::kInvalidNodeId, "node_id is not a valid node id",
                                  {{"node_id", id.empty() ? "required" : "not a node id"}});
  }
  return Ok();
}

// ingress's request handlers, one per subject of RegisterRoutes: each validates, runs one
// transaction (reads in a snapshot) of pool, exposure or store code, and maps the result.
class IngressHandlers {
 public:
  IngressHandlers(std::shared_ptr<store::Pool> pool, std::shared_ptr<const Context> ctx)
      : pool_(std::move(pool)), ctx_(std::move(ctx)) {}

  Result<v1::SetEndpointPoolResponse> SetPool(const v1::SetEndpointPoolRequest& req,
                                              rpc::Context& rc) const;
  Result<v1::ListEndpointPoolsResponse> ListPools(const v1::ListEndpointPoolsRequest& req,
                                                  rpc::Context& rc) const;
  Result<v1::DeleteEndpointPoolResponse> DeletePool(const v1::DeleteEndpointPoolRequest& req,
                                                    rpc::Context& rc) const;
  Result<v1::CreateExposureResponse> CreateExposure(const v1::CreateExposureRequest& req,
                                                    rpc::Context& rc) const;
  Result<v1::DeleteExposureResponse> DeleteExposure(const v1::DeleteExposureRequest& req,
                                                    rpc::Context& rc) const;
  Result<v1::ListExposuresResponse> ListExposures(const v1::ListExposuresRequest& req,
                                                  rpc::Context& rc) const;
  Result<v1::GetNodeExposuresResponse> GetNodeExposures(const v1::GetNodeExposuresRequest& req,
                                                        rpc::Context& rc) const;
  Result<v1::AckNodeExposuresResponse> AckNodeExposures(const v1::AckNodeExposuresRequest& req,
                                                        rpc::Context& rc) const;

 private:
  std::shared_ptr<store::Pool> pool_;
  std::shared_ptr<const Context> ctx_;
};

// Every request subject ingress serves, and its handler. gpuaas.v1.ingress.dlq.replay (the
// allocation consumer's dead letters) is added by the runtime's ServeRequests().
void RegisterRoutes(rpc::Server& rpc, const std::shared_ptr<IngressHandlers>& h) {
  using H = IngressHandlers;
  rpc.Route("gpuaas.v1.ingress.pool.set", h, &H::SetPool);
  rpc.Route("gpuaas.v1.ingress.pool.list", h, &H::ListPools);
  rpc.Route("gpuaas.v1.ingress.pool.delete", h, &H::DeletePool);
  rpc.Route("gpuaas.v1.ingress.exposure.create", h, &H::CreateExposure);
  rpc.Route("gpuaas.v1.ingress.exposure.delete", h, &H::DeleteExposure);
  rpc.Route("gpuaas.v1.ingress.exposure.list", h, &H::ListExposures);
  rpc.Route("gpuaas.v1.ingress.node.{node_id}.exposures.get", h, &H::GetNodeExposures);
  rpc.Route("gpuaas.v1.ingress.node.{node_id}.exposures.ack", h, &H::AckNodeExposures);
}

Result<v1::SetEndpointPoolResponse> IngressHandlers::SetPool(const v1::SetEndpointPoolRequest& req,
                                                             rpc::Context& /*rc*/) const {
  return store::WithTx(*pool_, [&](pqxx::work& tx) { return DefinePool(tx, req.pool()); });
}

Result<v1::ListEndpointPoolsResponse> IngressHandlers::ListPools(
    const v1::ListEndpointPoolsRequest& req, rpc::Context& /*rc*/) const {
  return store::WithTx(
      *pool_,
      [&](pqxx::work& tx) -> Result<v1::ListEndpointPoolsResponse> {
        v1::ListEndpointPoolsResponse resp;
        for (auto& p : LoadPools(tx, req.region())) *resp.add_pools() = std::move(p);
        return resp;
      },
      store::ReadSnapshot());
}

Result<v1::DeleteEndpointPoolResponse> IngressHandlers::DeletePool(
    const v1::DeleteEndpointPoolRequest& req, rpc::Context& /*rc*/) const {
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::DeleteEndpointPoolResponse> {
    auto removed = RemovePool(tx, req.name());
    if (!removed.ok()) return removed.error();
    v1::DeleteEndpointPoolResponse resp;
    *resp.mutable_pool() = std::move(*removed);
    return resp;
  });
}

Result<v1::CreateExposureResponse> IngressHandlers::CreateExposure(
    const v1::CreateExposureRequest& req, rpc::Context& rc) const {
  const std::string scope = rc.TenantScope();
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::CreateExposureResponse> {
    const auto owner = LoadAllocationTenant(tx, req.allocation_id());
    if (!owner || (!scope.empty() && *owner != scope)) {
      return Error::NotFound(reason::kAllocationNotFound,
                             "ingress has not seen allocation " + req.allocation_id());
    }
    auto r = Reserve(tx, *ctx_, req.allocation_id(), req.name(), req.protocol(), req.port());
    if (!r.ok()) return r.error();
    v1::CreateExposureResponse resp;
    *resp.mutable_exposure() = r->exposure;
    resp.set_created(r->created);
    return resp;
  });
}

Result<v1::DeleteExposureResponse> IngressHandlers::DeleteExposure(
    const v1::DeleteExposureRequest& req, rpc::Context& rc) const {
  const std::string scope = rc.TenantScope();
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::DeleteExposureResponse> {
    auto e = Remove(tx, *ctx_, req.exposure_id(), scope);
    if (!e.ok()) return e.error();
    v1::DeleteExposureResponse resp;
    *resp.mutable_exposure() = *e;
    return resp;
  });
}

Result<v1::ListExposuresResponse> IngressHandlers::ListExposures(
    const v1::ListExposuresRequest& req, rpc::Context& rc) const {
  const ExposureFilter filter{req.allocation_id(), req.node_id(), req.state(), rc.TenantScope()};
  return store::WithTx(
      *pool_,
      [&](pqxx::work& tx) -> Result<v1::ListExposuresResponse> {
        v1::ListExposuresResponse resp;
        for (const auto& id : ListExposureIds(tx, filter)) {
          if (auto e = LoadExposure(tx, *ctx_, id)) *resp.add_exposures() = *e;
        }
        return resp;
      },
      store::ReadSnapshot());
}

Result<v1::GetNodeExposuresResponse> IngressHandlers::GetNodeExposures(
    const v1::GetNodeExposuresRequest& req, rpc::Context& /*rc*/) const {
  if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
  return store::WithTx(
      *pool_,
      [&](pqxx::work& tx) -> Result<v1::GetNodeExposuresResponse> {
        v1::GetNodeExposuresResponse resp;
        auto latest = documents::Load(tx, ExposureDocuments(), req.node_id(), req.version(),
                                      *resp.mutable_document());
        if (!latest.ok()) return latest.error();
        resp.mutable_document()->set_node_id(req.node_id());
        resp.set_latest_version(*latest);
        auto ack = documents::LoadAck(tx, ExposureDocuments(), req.node_id());
        resp.set_applied_version(ack.applied_version);
        for (const auto& b : ack.blockers) resp.add_blockers(b);
        if (ack.acked_at) *resp.mutable_acked_at() = *ack.acked_at;
        return resp;
      },
      store::ReadSnapshot());
}

Result<v1::AckNodeExposuresResponse> IngressHandlers::AckNodeExposures(
    const v1::AckNodeExposuresRequest& req, rpc::Context& /*rc*/) const {
  if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
  return store::WithTx(*pool_, [&](pqxx::work& tx) { return ApplyAck(tx, *ctx_, req); });
}

}  // namespace

void IngressConfig::Register(config::Schema& s) {
  common.Register(s, true);
  s.Add("ingress.ssh_user", &ssh_user,
        "The user in an SSH endpoint's connect hint (ssh -p <port> <user>@<address>)", "root",
        config::NonEmpty());
  s.Add("ingress.max_endpoints_per_allocation", &max_endpoints_per_allocation,
        "Live exposures one allocation may have", 16, config::Range(1, 1024));
}

Result<void> IngressConfig::Validate() const { return Ok(); }

IngressService::IngressService(IngressConfig cfg)
    : cfg_(std::move(cfg)), svc_(runtime::Component{"ingress", &Migrations()}, cfg_.common) {}

IngressService::~IngressService() { gauges_.reset(); }

Result<void> IngressService::Start() {
  if (auto v = cfg_.Validate(); !v.ok()) return v;
  if (auto r = svc_.Start(); !r.ok()) return r;
  svc_.StartOutboxRelay();
  metrics_ = std::make_unique<IngressMetrics>(svc_.metrics());
  auto pool = svc_.pg();
  gauges_ = StartExposureGauges(pool, svc_.metrics(), svc_.log(), std::chrono::seconds(5));
  auto ctx = std::make_shared<Context>();
  ctx->cfg = cfg_;
  ctx->source = svc_.source();
  ctx->metrics = metrics_.get();

  RegisterRoutes(svc_.Rpc(), std::make_shared<IngressHandlers>(pool, ctx));
  auto c1 = svc_.StartProjection(
      messaging::SchedulerEventsStream().name, kAllocationConsumer,
      "gpuaas.v1.evt.scheduler.allocation.>",
      [ctx](pqxx::work& tx, const v1::Event& ev) { return ApplyAllocationEvent(tx, ev, *ctx); });
  if (!c1.ok()) return c1.error();
  return svc_.ServeRequests();
}

}  // namespace gpuaas::ingress
