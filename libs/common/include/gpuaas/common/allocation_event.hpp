#pragma once
// The scheduler's allocation events (gpuaas.v1.evt.scheduler.allocation.*) as the services that
// follow allocations (ipam, ingress) read them.
#include <cstdint>

#include "gpuaas/common/result.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::inbox {

struct AllocationEvent {
  v1::AllocationSnapshot snapshot;
  // The envelope's generation; the allocation's own when the envelope carries none.
  int64_t generation = 0;
  const v1::Allocation& allocation() const { return snapshot.allocation(); }
};

// INVALID_ARGUMENT malformed_event when the data is not an AllocationSnapshot or the allocation
// has no UUID id (the projection dead-letters it instead of retrying).
Result<AllocationEvent> ReadAllocationEvent(const v1::Event& ev);

}  // namespace gpuaas::inbox
