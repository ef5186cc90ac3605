#pragma once
// Stranded capacity (pure, no I/O): free GPUs that no request tenants can order is able to use,
// given the shapes the catalog offers. The placement index keeps it per (region, pool, SKU) for
// gpuaas_stranded_gpus; a free GPU the catalog cannot sell is capacity paid for and idle.
#include <set>
#include <string>
#include <vector>

#include "gpuaas/scheduler/placement.hpp"

namespace gpuaas::scheduler::placement {

// What tenants can order on slots of one slot SKU: a slice of any of `gpu_counts` GPUs on one
// node, every slot of `fabric_type` ("" = any fabric).
struct OrderableShape {
  std::string gpu_sku;
  std::string fabric_type;
  std::set<int> gpu_counts;
};

// The free GPUs of one node (its slots of one SKU) that no mix of orderable slices can use.
// Each fabric's free slots are filled on their own by the counts of that fabric's shapes and of
// the any-fabric shapes (the largest sum of allowed counts no greater than its free slots); or
// every free slot together, whichever fabric, by the any-fabric shapes alone. The node uses the
// larger of the two ways; the rest is stranded.
// Orderable counts 1: nothing is ever stranded; counts {2, 4, 8} on 3 free slots: 1; slots of a
// fabric nothing is sold with: all of them.
int StrandedGpus(const std::vector<SlotView>& free, const std::vector<OrderableShape>& shapes);

// Whether every slot of `node` is free (no claim, nothing unschedulable): a node that could
// still take the largest slice or be moved to bare metal.
bool WholeNodeFree(const NodeView& node);

}  // namespace gpuaas::scheduler::placement
