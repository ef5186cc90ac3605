#pragma once
// The SKU/profile catalog (YAML): what tenants can order and what each order needs from a slot
// (slot SKU, fabric type, GPU counts, network modes). Request validation against it gives each
// invalid request its own structured error.
#include <map>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"
#include "gpuaas/scheduler/stranded.hpp"
#include "gpuaas/v1/scheduler.pb.h"
#include "gpuaas/v1/types.pb.h"

namespace gpuaas::scheduler {

struct Sku {
  std::string name;
  v1::CapacityShape shape = v1::CAPACITY_SHAPE_UNSPECIFIED;  // never UNSPECIFIED once parsed
  std::string sharing_mechanism;  // reserved shapes only (mig, time-slicing, mps)
  std::string gpu_sku;            // inventory slot SKU ("h200-sxm")
  std::vector<int> allowed_gpu_counts;
  int vcpus_per_gpu = 0;
  int64_t memory_mib_per_gpu = 0;
  v1::FabricType fabric_type =
      v1::FABRIC_TYPE_UNSPECIFIED;             // required slot fabric (UNSPECIFIED = any)
  std::vector<v1::NetworkMode> network_modes;  // the first is the default
  // What its usage is billed by (YAML billable_unit: gpu_second, the default, or node_second).
  v1::BillableUnit billable_unit = v1::BILLABLE_UNIT_GPU_SECOND;
};

// A VM image tenants may boot on a slice: where the node fetches it and its digest.
struct Image {
  std::string name;
  std::string url;
  std::string sha256;  // 64 lowercase hex digits
};

class Catalog {
 public:
  // Parses the YAML; every problem is reported at once in the error's details.
  static Result<Catalog> Parse(const std::string& yaml);
  // The catalog compiled into the binary (services/scheduler/config/catalog.yaml).
  static const std::string& DefaultYaml();

  const Sku* Find(const std::string& name) const;
  const std::map<std::string, Sku>& skus() const { return skus_; }
  // The image named `name` ("" = the default image); unknown_image when there is none.
  Result<const Image*> FindImage(const std::string& name) const;

  // Checks an order: unknown_sku, shape_not_offered (reserved shapes), gpu_count_not_allowed,
  // fabric_only_not_for_slices, network_mode_not_allowed. Returns the SKU and the effective
  // network mode.
  // network_mode UNSPECIFIED means the SKU's default.
  Result<std::pair<const Sku*, v1::NetworkMode>> Validate(const std::string& sku, int gpu_count,
                                                          v1::NetworkMode network_mode) const;
  // The slices tenants can order (gpu_slice SKUs: slot SKU, fabric, GPU counts), what the
  // placement index measures stranded capacity against.
  std::vector<placement::OrderableShape> OrderableSlices() const;
  // The catalog as gpuaas.v1.scheduler.catalog.list answers it.
  v1::ListCatalogResponse ToProto() const;

 private:
  std::map<std::string, Sku> skus_;
  std::map<std::string, Image> images_;
  std::string default_image_;
};

}  // namespace gpuaas::scheduler
