// Endpoint pools: creating, replacing and deleting them without dropping an endpoint an
// exposure holds or handing one out twice. The SQL is in ingress_store.cpp.
#include <fmt/format.h>

#include "gpuaas/ingress/ingress_service.hpp"
#include "ingress_domain.hpp"
#include "ingress_reasons.hpp"
#include "ingress_store.hpp"

namespace gpuaas::ingress {

namespace {

Error Overlap(const PoolAddress& clash) {
  Error e = Error::FailedPrecondition(
      reason::kPoolOverlap,
      fmt::format("address {} is already in pool {}", clash.address, clash.pool));
  e.details = {{"pool", clash.pool}, {"address", clash.address}};
  return e;
}

// Exposures hold endpoints of the node (region) the pool served: it cannot move under them.
std::optional<Error> MoveOfHeldPool(const v1::EndpointPool& want, const PoolPlacement& before) {
  if (before.used == 0) return std::nullopt;
  const auto& region = before.region;
  const auto& node = before.node_id;
  if (region == want.region() && node == want.node_id()) return std::nullopt;
  Error e = Error::FailedPrecondition(
      reason::kPoolInUse,
      fmt::format("{} endpoint(s) of pool {} are held by exposures on {}; it cannot move to "
                  "another {}",
                  before.used, want.name(), node.empty() ? region : node,
                  region != want.region() ? "region" : "node"));
  e.details = {
      {region != want.region() ? "region" : "node_id", region != want.region() ? region : node},
      {"used", std::to_string(before.used)}};
  return e;
}

Error HeldEndpointDropped(const v1::EndpointPool& want, const HeldEndpoint& held) {
  Error e = Error::FailedPrecondition(
      reason::kPoolInUse,
      fmt::format("{}:{} of pool {} is held by an exposure", held.address, held.port, want.name()));
  e.details = {{"address", held.address}, {"port", std::to_string(held.port)}};
  return e;
}

}  // namespace

Result<v1::SetEndpointPoolResponse> DefinePool(pqxx::work& tx, const v1::EndpointPool& want) {
  if (auto v = ValidatePool(want); !v.ok()) return v.error();
  LockPoolTable(tx);  // overlap checks see all
  // The pool's row before its leases are read: a reservation holding it commits first, and the
  // next statement sees its lease (READ COMMITTED), so a shrink cannot drop a port just taken.
  const auto before = LockPoolPlacement(tx, want.name());
  // Another pool handing out one of these addresses (for two port ranges: with a port in
  // common) would give an endpoint twice.
  if (auto clash = FindOverlappingPool(tx, want)) return Overlap(*clash);
  if (before) {
    if (auto moved = MoveOfHeldPool(want, *before)) return *moved;
  }
  // The change may not drop an endpoint an exposure holds.
  if (auto held = FindEndpointDroppedBy(tx, want)) return HeldEndpointDropped(want, *held);
  v1::SetEndpointPoolResponse resp;
  resp.set_created(UpsertPool(tx, want));
  *resp.mutable_pool() = *LoadPool(tx, want.name());
  return resp;
}

Result<v1::EndpointPool> RemovePool(pqxx::work& tx, const std::string& name) {
  auto pool = LoadPool(tx, name);
  if (!pool) return Error::NotFound(reason::kPoolNotFound, "no pool " + name);
  LockPool(tx, name);
  const auto used = CountLeasesOfPool(tx, name);
  if (used > 0) {
    Error e = Error::FailedPrecondition(
        reason::kPoolInUse,
        fmt::format("{} endpoint(s) of pool {} are held by exposures", used, name));
    e.details = {{"used", std::to_string(used)}};
    return e;
  }
  DeletePoolRow(tx, name);
  return *pool;
}

}  // namespace gpuaas::ingress
