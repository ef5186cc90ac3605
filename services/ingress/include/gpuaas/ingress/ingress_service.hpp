#pragma once
// ingress: owns endpoint pools (ports of a node's public address, whole public addresses of a
// region), allocation-scoped exposures (an endpoint of a slice VM mapped from a public endpoint
// to its management IP), each node's versioned exposure document (libs/common documents.hpp)
// and its acks. Serves gpuaas.v1.ingress.*; consumes allocation events (GPUAAS_EVT_SCHEDULER):
// reserves what an allocation asked for when it is placed, applies it when its VM is up, removes
// it when it is released or failed; announces every exposure change through its outbox
// (GPUAAS_EVT_INGRESS). Pure rules live in ingress_domain.hpp.
#include <pqxx/pqxx>

#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "gpuaas/common/documents.hpp"
#include "gpuaas/common/runtime.hpp"
#include "gpuaas/v1/ingress.pb.h"

namespace gpuaas::v1 {
class Event;
}

namespace gpuaas::ingress {

const std::vector<store::Migration>& Migrations();

inline constexpr const char* kAllocationConsumer = "ingress-scheduler-allocations";

// The exposure document tables (names are code constants, never user input).
const documents::Tables& ExposureDocuments();

struct IngressConfig {
  runtime::CommonConfig common;
  std::string ssh_user = "root";  // the user in Exposure.connect for TCP port 22
  int64_t max_endpoints_per_allocation = 16;
  void Register(config::Schema& schema);
  Result<void> Validate() const;
};

class IngressMetrics;

// What the handlers and consumers share.
struct Context {
  IngressConfig cfg;
  std::string source;                 // "<service>/<instance>" of the events
  IngressMetrics* metrics = nullptr;  // may be null (tests)
};

// ---- effects (public for tests; each runs inside the caller's transaction) ----

// Creates or replaces a pool (ingress_pools.cpp): INVALID_ARGUMENT invalid_pool,
// FAILED_PRECONDITION pool_kind_not_supported, pool_overlap, pool_in_use (an endpoint an
// exposure holds would go, or a pool with held endpoints would move to another node or region).
Result<v1::SetEndpointPoolResponse> DefinePool(pqxx::work& tx, const v1::EndpointPool& want);

// Deletes a pool no exposure holds an endpoint of; returns it as it was. NOT_FOUND
// pool_not_found, FAILED_PRECONDITION pool_in_use {used}.
Result<v1::EndpointPool> RemovePool(pqxx::work& tx, const std::string& name);

// Reserves an endpoint for (allocation, name): idempotent per live name. RESOURCE_EXHAUSTED
// pool_exhausted / no_pool, FAILED_PRECONDITION endpoint_exists. With `apply`, an allocation
// whose VM is up gets it into its node's document at once (the allocation event handler
// reserves every endpoint first and applies them together: one new document version).
struct Reserved {
  v1::Exposure exposure;
  bool created = false;
};
Result<Reserved> Reserve(pqxx::work& tx, const Context& c, const std::string& allocation_id,
                         const std::string& name, v1::TransportProtocol protocol, int32_t port,
                         bool apply = true);

// An AllocationSnapshot event: the projection row, then reservations, applies and removals.
Result<void> ApplyAllocationEvent(pqxx::work& tx, const v1::Event& ev, const Context& c);

// The agent's ack: the document version, refusals, drift.
Result<v1::AckNodeExposuresResponse> ApplyAck(pqxx::work& tx, const Context& c,
                                              const v1::AckNodeExposuresRequest& req);

// One exposure as stored (nullopt: none with that id).
std::optional<v1::Exposure> FindExposure(pqxx::work& tx, const Context& c, const std::string& id);

// Stops exposing one endpoint (REMOVING, or REMOVED when it never reached the node).
Result<v1::Exposure> Remove(pqxx::work& tx, const Context& c, const std::string& exposure_id,
                            const std::string& tenant_scope);

class IngressService {
 public:
  explicit IngressService(IngressConfig cfg);
  ~IngressService();
  Result<void> Start();
  int Run() { return svc_.Run(); }
  void Shutdown() { svc_.Shutdown(); }
  runtime::Service& runtime() { return svc_; }

 private:
  IngressConfig cfg_;
  runtime::Service svc_;
  std::unique_ptr<IngressMetrics> metrics_;
  std::shared_ptr<void> gauges_;
};

}  // namespace gpuaas::ingress
