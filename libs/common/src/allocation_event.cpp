#include "gpuaas/common/allocation_event.hpp"

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/reasons.hpp"

namespace gpuaas::inbox {

Result<AllocationEvent> ReadAllocationEvent(const v1::Event& ev) {
  AllocationEvent out;
  if (!ev.data().UnpackTo(&out.snapshot)) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "event data is not a gpuaas.v1.AllocationSnapshot");
  }
  const auto& a = out.allocation();
  if (!ids::IsUuid(a.allocation_id())) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "allocation event without an allocation id");
  }
  out.generation = ev.generation() > 0 ? ev.generation() : a.generation();
  return out;
}

}  // namespace gpuaas::inbox
