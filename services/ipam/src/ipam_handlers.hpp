#pragma once
// ipam's request handlers: one method per gpuaas.v1.ipam.* subject, routed by the table in
// ipam_service.cpp (RegisterRoutes). Each validates the request, runs the domain rules
// (ipam_domain.hpp) and store functions (ipam_store.hpp) in one transaction - orphan.remove one
// per node - and maps the result to the reply.
#include <memory>
#include <string>

#include "gpuaas/common/result.hpp"
#include "gpuaas/ipam/ipam_service.hpp"
#include "ipam_orphans.hpp"

namespace gpuaas::rpc {
struct Context;
}

namespace gpuaas::v1 {
class ReserveSlotAddressRequest;
class ReserveSlotAddressResponse;
class ListReservationsRequest;
class ListReservationsResponse;
class ReleaseSlotAddressRequest;
class ReleaseSlotAddressResponse;
class ReprovisionSlotAddressRequest;
class ReprovisionSlotAddressResponse;
class ListOrphansRequest;
class ListOrphansResponse;
class RemoveOrphansRequest;
class RemoveOrphansResponse;
class SetSubnetRequest;
class SetSubnetResponse;
class GetNodeNetworkRequest;
class GetNodeNetworkResponse;
class AckNodeNetworkRequest;
class AckNodeNetworkResponse;
class ListLeasesRequest;
class ListLeasesResponse;
class ListDriftRequest;
class ListDriftResponse;
}  // namespace gpuaas::v1

namespace gpuaas::ipam {

class IpamHandlers {
 public:
  // `inv` is ipam's projection of inventory, which reserve, reprovision and the orphan requests
  // check against; `source` names this instance in the events it appends.
  IpamHandlers(std::shared_ptr<store::Pool> pool, IpamConfig cfg, std::string source,
               InventoryView inv);

  Result<v1::ReserveSlotAddressResponse> Reserve(const v1::ReserveSlotAddressRequest& req,
                                                 rpc::Context& ctx) const;
  Result<v1::ListReservationsResponse> ListReservations(const v1::ListReservationsRequest& req,
                                                        rpc::Context& ctx) const;
  Result<v1::ReleaseSlotAddressResponse> Release(const v1::ReleaseSlotAddressRequest& req,
                                                 rpc::Context& ctx) const;
  Result<v1::ReprovisionSlotAddressResponse> Reprovision(
      const v1::ReprovisionSlotAddressRequest& req, rpc::Context& ctx) const;
  Result<v1::ListOrphansResponse> ListOrphans(const v1::ListOrphansRequest& req,
                                              rpc::Context& ctx) const;
  Result<v1::RemoveOrphansResponse> RemoveOrphans(const v1::RemoveOrphansRequest& req,
                                                  rpc::Context& ctx) const;
  Result<v1::SetSubnetResponse> SetSubnet(const v1::SetSubnetRequest& req, rpc::Context& ctx) const;
  Result<v1::GetNodeNetworkResponse> GetNodeNetwork(const v1::GetNodeNetworkRequest& req,
                                                    rpc::Context& ctx) const;
  Result<v1::AckNodeNetworkResponse> AckNodeNetwork(const v1::AckNodeNetworkRequest& req,
                                                    rpc::Context& ctx) const;
  Result<v1::ListLeasesResponse> ListLeases(const v1::ListLeasesRequest& req,
                                            rpc::Context& ctx) const;
  Result<v1::ListDriftResponse> ListDrift(const v1::ListDriftRequest& req, rpc::Context& ctx) const;

 private:
  std::shared_ptr<store::Pool> pool_;
  IpamConfig cfg_;
  std::string source_;
  InventoryView inv_;
};

}  // namespace gpuaas::ipam
