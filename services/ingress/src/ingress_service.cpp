#include "ingress_service.hpp"

#include <google/protobuf/util/time_util.h>

#include <map>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/event.pb.h"
#include "ingress_domain.hpp"
#include "ingress_metrics.hpp"

namespace gpuaas::ingress {

namespace {

using google::protobuf::util::TimeUtil;

Result<void> CheckNodeId(const std::string& id) {
  if (!ids::IsNodeId(id)) {
    return Error::InvalidArgument("invalid_node_id", "node_id is not a valid node id",
                                  {{"node_id", id.empty() ? "required" : "not a node id"}});
  }
  return Ok();
}

std::vector<v1::EndpointPool> LoadPools(pqxx::work& tx, const std::string& where,
                                        const std::string& arg) {
  std::vector<v1::EndpointPool> out;
  for (const auto& r : tx.exec_params(
           fmt::format("SELECT p.name, p.kind, p.region, p.node_id, p.addresses, p.port_min, "
                       "p.port_max, p.generation, (extract(epoch from p.updated_at) * "
                       "1000)::int8, (SELECT count(*) FROM endpoint_leases l WHERE l.pool = "
                       "p.name) FROM endpoint_pools p WHERE {} ORDER BY p.name",
                       where),
           arg)) {
    v1::EndpointPool p;
    p.set_name(r[0].as<std::string>());
    p.set_kind(enums::FromColumn<v1::EndpointPoolKind>(r[1].as<std::string>()));
    p.set_region(r[2].as<std::string>());
    p.set_node_id(r[3].as<std::string>());
    for (const auto& a : store::TextArray(r[4])) p.add_addresses(a);
    p.set_port_min(r[5].as<int32_t>());
    p.set_port_max(r[6].as<int32_t>());
    p.set_generation(r[7].as<int64_t>());
    *p.mutable_updated_at() = TimeUtil::MillisecondsToTimestamp(r[8].as<int64_t>());
    p.set_total(PoolCapacity(p));
    p.set_used(r[9].as<int64_t>());
    out.push_back(std::move(p));
  }
  return out;
}

Result<v1::SetEndpointPoolResponse> SetPool(pqxx::work& tx, const v1::EndpointPool& want) {
  if (auto v = ValidatePool(want); !v.ok()) return v.error();
  tx.exec("LOCK TABLE endpoint_pools IN SHARE ROW EXCLUSIVE MODE");  // overlap checks see all
  // The pool's row before its leases are read: a reservation holding it commits first, and the
  // next statement sees its lease (READ COMMITTED), so a shrink cannot drop a port just taken.
  auto before = tx.exec_params(
      "SELECT region, node_id, (SELECT count(*) FROM endpoint_leases l WHERE l.pool = p.name) "
      "FROM endpoint_pools p WHERE name = $1 FOR UPDATE",
      want.name());
  std::vector<std::string> addrs(want.addresses().begin(), want.addresses().end());
  // Another pool handing out one of these addresses (for two port ranges: with a port in
  // common) would give an endpoint twice.
  auto clash = tx.exec_params(
      "SELECT name, a FROM endpoint_pools, unnest(addresses) a WHERE name <> $1 AND a = "
      "ANY($2::text[]) AND (kind = 'public_ip' OR $3 = 'public_ip' OR (port_min <= $5 AND $4 <= "
      "port_max)) ORDER BY name, a LIMIT 1",
      want.name(), store::TextArrayLiteral(addrs), enums::Text(want.kind()), want.port_min(),
      want.port_max());
  if (!clash.empty()) {
    Error e = Error::FailedPrecondition(
        "pool_overlap", fmt::format("address {} is already in pool {}",
                                    clash[0][1].as<std::string>(), clash[0][0].as<std::string>()));
    e.details = {{"pool", clash[0][0].as<std::string>()},
                 {"address", clash[0][1].as<std::string>()}};
    return e;
  }
  // Exposures hold endpoints of the node (region) the pool served: it cannot move under them.
  if (!before.empty() && before[0][2].as<int64_t>() > 0) {
    const auto region = before[0][0].as<std::string>();
    const auto node = before[0][1].as<std::string>();
    if (region != want.region() || node != want.node_id()) {
      Error e = Error::FailedPrecondition(
          "pool_in_use",
          fmt::format("{} endpoint(s) of pool {} are held by exposures on {}; it cannot move to "
                      "another {}",
                      before[0][2].as<int64_t>(), want.name(), node.empty() ? region : node,
                      region != want.region() ? "region" : "node"));
      e.details = {
          {region != want.region() ? "region" : "node_id", region != want.region() ? region : node},
          {"used", std::to_string(before[0][2].as<int64_t>())}};
      return e;
    }
  }
  // The change may not drop an endpoint an exposure holds.
  auto held = tx.exec_params(
      "SELECT address, port FROM endpoint_leases WHERE pool = $1 AND (NOT (address = "
      "ANY($2::text[])) OR (port <> 0 AND (port < $3 OR port > $4)) OR (port = 0 AND $5 = "
      "'port_range') OR (port <> 0 AND $5 = 'public_ip')) ORDER BY address, port LIMIT 1",
      want.name(), store::TextArrayLiteral(addrs), want.port_min(), want.port_max(),
      enums::Text(want.kind()));
  if (!held.empty()) {
    Error e = Error::FailedPrecondition(
        "pool_in_use",
        fmt::format("{}:{} of pool {} is held by an exposure", held[0][0].as<std::string>(),
                    held[0][1].as<int32_t>(), want.name()));
    e.details = {{"address", held[0][0].as<std::string>()},
                 {"port", std::to_string(held[0][1].as<int32_t>())}};
    return e;
  }
  auto r = tx.exec_params(
      "INSERT INTO endpoint_pools (name, kind, region, node_id, addresses, port_min, port_max) "
      "VALUES ($1, $2, $3, $4, $5::text[], $6, $7) ON CONFLICT (name) DO UPDATE SET kind = "
      "EXCLUDED.kind, region = EXCLUDED.region, node_id = EXCLUDED.node_id, addresses = "
      "EXCLUDED.addresses, port_min = EXCLUDED.port_min, port_max = EXCLUDED.port_max, "
      "generation = endpoint_pools.generation + 1, updated_at = now() RETURNING generation = 1",
      want.name(), enums::Text(want.kind()), want.region(), want.node_id(),
      store::TextArrayLiteral(addrs), want.port_min(), want.port_max());
  v1::SetEndpointPoolResponse resp;
  resp.set_created(r[0][0].as<bool>());
  auto pools = LoadPools(tx, "p.name = $1", want.name());
  *resp.mutable_pool() = pools.front();
  return resp;
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
  for (const auto& spec : {messaging::IngressEventsStream(), messaging::DeadLetterStream(),
                           messaging::SchedulerEventsStream()}) {
    if (auto r = messaging::EnsureStream(*svc_.nats(), spec); !r.ok()) return r;
  }
  svc_.StartOutboxRelay();
  metrics_ = std::make_unique<IngressMetrics>(svc_.metrics());
  auto pool = svc_.pg();
  gauges_ = StartExposureGauges(pool, svc_.metrics(), svc_.log(), std::chrono::seconds(5));
  auto ctx = std::make_shared<Context>();
  ctx->cfg = cfg_;
  ctx->source = svc_.source();
  ctx->metrics = metrics_.get();
  auto& rpc = svc_.Rpc();

  rpc.Handle<v1::SetEndpointPoolRequest, v1::SetEndpointPoolResponse>(
      "gpuaas.v1.ingress.pool.set",
      [pool](const v1::SetEndpointPoolRequest& req,
             rpc::Context&) -> Result<v1::SetEndpointPoolResponse> {
        return store::WithTx(*pool, [&](pqxx::work& tx) { return SetPool(tx, req.pool()); });
      });

  rpc.Handle<v1::ListEndpointPoolsRequest, v1::ListEndpointPoolsResponse>(
      "gpuaas.v1.ingress.pool.list",
      [pool](const v1::ListEndpointPoolsRequest& req,
             rpc::Context&) -> Result<v1::ListEndpointPoolsResponse> {
        return store::WithTx(
            *pool,
            [&](pqxx::work& tx) -> Result<v1::ListEndpointPoolsResponse> {
              v1::ListEndpointPoolsResponse resp;
              for (auto& p : LoadPools(tx, "($1 = '' OR p.region = $1)", req.region())) {
                *resp.add_pools() = std::move(p);
              }
              return resp;
            },
            store::ReadSnapshot());
      });

  rpc.Handle<v1::DeleteEndpointPoolRequest, v1::DeleteEndpointPoolResponse>(
      "gpuaas.v1.ingress.pool.delete",
      [pool](const v1::DeleteEndpointPoolRequest& req,
             rpc::Context&) -> Result<v1::DeleteEndpointPoolResponse> {
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::DeleteEndpointPoolResponse> {
          auto pools = LoadPools(tx, "p.name = $1", req.name());
          if (pools.empty()) return Error::NotFound("pool_not_found", "no pool " + req.name());
          tx.exec_params("SELECT 1 FROM endpoint_pools WHERE name = $1 FOR UPDATE", req.name());
          const auto used = tx.exec_params("SELECT count(*) FROM endpoint_leases WHERE pool = $1",
                                           req.name())[0][0]
                                .as<int64_t>();
          if (used > 0) {
            Error e = Error::FailedPrecondition(
                "pool_in_use",
                fmt::format("{} endpoint(s) of pool {} are held by exposures", used, req.name()));
            e.details = {{"used", std::to_string(used)}};
            return e;
          }
          tx.exec_params("DELETE FROM endpoint_pools WHERE name = $1", req.name());
          v1::DeleteEndpointPoolResponse resp;
          *resp.mutable_pool() = pools.front();
          return resp;
        });
      });

  rpc.Handle<v1::CreateExposureRequest, v1::CreateExposureResponse>(
      "gpuaas.v1.ingress.exposure.create",
      [pool, ctx](const v1::CreateExposureRequest& req,
                  rpc::Context& rc) -> Result<v1::CreateExposureResponse> {
        const std::string scope = rc.TenantScope();
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::CreateExposureResponse> {
          auto owner = tx.exec_params("SELECT tenant FROM allocations WHERE allocation_id = $1",
                                      req.allocation_id());
          if (owner.empty() || (!scope.empty() && owner[0][0].as<std::string>() != scope)) {
            return Error::NotFound("allocation_not_found",
                                   "ingress has not seen allocation " + req.allocation_id());
          }
          auto r = Reserve(tx, *ctx, req.allocation_id(), req.name(), req.protocol(), req.port());
          if (!r.ok()) return r.error();
          v1::CreateExposureResponse resp;
          *resp.mutable_exposure() = r->exposure;
          resp.set_created(r->created);
          return resp;
        });
      });

  rpc.Handle<v1::DeleteExposureRequest, v1::DeleteExposureResponse>(
      "gpuaas.v1.ingress.exposure.delete",
      [pool, ctx](const v1::DeleteExposureRequest& req,
                  rpc::Context& rc) -> Result<v1::DeleteExposureResponse> {
        const std::string scope = rc.TenantScope();
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::DeleteExposureResponse> {
          auto e = Remove(tx, *ctx, req.exposure_id(), scope);
          if (!e.ok()) return e.error();
          v1::DeleteExposureResponse resp;
          *resp.mutable_exposure() = *e;
          return resp;
        });
      });

  rpc.Handle<v1::ListExposuresRequest, v1::ListExposuresResponse>(
      "gpuaas.v1.ingress.exposure.list",
      [pool, ctx](const v1::ListExposuresRequest& req,
                  rpc::Context& rc) -> Result<v1::ListExposuresResponse> {
        const std::string scope = rc.TenantScope();
        const std::string state = enums::Text(req.state());
        return store::WithTx(
            *pool,
            [&](pqxx::work& tx) -> Result<v1::ListExposuresResponse> {
              v1::ListExposuresResponse resp;
              for (const auto& r : tx.exec_params(
                       "SELECT exposure_id::text FROM exposures WHERE ($1 = '' OR allocation_id "
                       "= $1) AND ($2 = '' OR node_id = $2) AND (($3 = '' AND state <> "
                       "'removed') OR state = $3) AND ($4 = '' OR tenant = $4) ORDER BY "
                       "exposure_id DESC LIMIT 1000",
                       req.allocation_id(), req.node_id(), state, scope)) {
                auto e = FindExposure(tx, *ctx, r[0].as<std::string>());
                if (e) *resp.add_exposures() = *e;
              }
              return resp;
            },
            store::ReadSnapshot());
      });

  rpc.Handle<v1::GetNodeExposuresRequest, v1::GetNodeExposuresResponse>(
      "gpuaas.v1.ingress.node.exposures.get",
      [pool](const v1::GetNodeExposuresRequest& req,
             rpc::Context&) -> Result<v1::GetNodeExposuresResponse> {
        if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
        return store::WithTx(
            *pool,
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
      });

  rpc.Handle<v1::AckNodeExposuresRequest, v1::AckNodeExposuresResponse>(
      "gpuaas.v1.ingress.node.exposures.ack",
      [pool, ctx](const v1::AckNodeExposuresRequest& req,
                  rpc::Context&) -> Result<v1::AckNodeExposuresResponse> {
        if (auto v = CheckNodeId(req.node_id()); !v.ok()) return v.error();
        return store::WithTx(*pool, [&](pqxx::work& tx) { return ApplyAck(tx, *ctx, req); });
      });

  auto c1 = svc_.StartProjection(
      messaging::SchedulerEventsStream().name, kAllocationConsumer,
      "gpuaas.v1.evt.scheduler.allocation.>",
      [ctx](pqxx::work& tx, const v1::Event& ev) { return ApplyAllocationEvent(tx, ev, *ctx); });
  if (!c1.ok()) return c1.error();
  return svc_.ServeRequests();
}

}  // namespace gpuaas::ingress
