// gpuaas-scheduler: allocations, claims, placement and the allocation lifecycle.
#include "gpuaas/scheduler/scheduler_service.hpp"

int main(int argc, char** argv) {
  using gpuaas::scheduler::SchedulerConfig;
  using gpuaas::scheduler::SchedulerService;
  return gpuaas::runtime::Main<SchedulerService, SchedulerConfig>(argc, argv, "scheduler");
}
