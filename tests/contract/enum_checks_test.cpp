// The database's CHECK constraints and the protobuf enums agree: every column that stores a closed
// set admits exactly the enum's texts (enums::Texts), plus '' where the value is optional, or a
// declared subset where the column deliberately holds fewer (the shapes offered today, the tasks
// the scheduler sends). Read from each service's migrated schema (pg_constraint), so a new enum
// value without its migration, or a migration typo, fails here instead of at the first insert.
#include <gmock/gmock.h>
#include <gtest/gtest.h>

#include <regex>
#include <set>
#include <string>
#include <vector>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/console_gw/console_domain.hpp"
#include "gpuaas/ipam/ipam_domain.hpp"
#include "gpuaas/scheduler/task_status.hpp"
#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "gpuaas/v1/types.pb.h"
#include "test_env.hpp"

namespace gpuaas::scheduler {
const std::vector<store::Migration>& Migrations();
}
namespace gpuaas::inventory {
const std::vector<store::Migration>& Migrations();
}
namespace gpuaas::ipam {
const std::vector<store::Migration>& Migrations();
}
namespace gpuaas::console_gw {
const std::vector<store::Migration>& Migrations();
}
namespace gpuaas::ingress {
const std::vector<store::Migration>& Migrations();
}

namespace gpuaas {
namespace {

using Set = std::set<std::string>;

struct Column {
  std::string table, column;
  // The protobuf enum; nullptr for a closed set of the service's own (a C++ enum class that is
  // not on the wire), whose texts are then `subset`, taken from the code's own table.
  const google::protobuf::EnumDescriptor* e;
  bool optional = false;  // '' allowed too (no value yet)
  Set subset = {};        // when non-empty: the column holds exactly these (a subset of e)
};

Set PageEndTexts() {
  const auto texts = console_gw::PageEndTexts();
  return Set(texts.begin(), texts.end());
}

Set TaskStatusTexts() {
  Set out;
  for (const auto& e : scheduler::kTaskStatusTexts) out.insert(std::string(e.text));
  return out;
}

Set ScopeTexts() {
  Set out;
  for (const auto& [scope, text] : ipam::kScopeTexts) out.insert(std::string(text));
  return out;
}

Set Expected(const Column& c) {
  Set want = c.subset.empty() ? Set() : c.subset;
  if (c.subset.empty()) {
    for (const auto& t : enums::TextsOf(c.e)) want.insert(t);
  }
  if (c.optional) want.insert("");
  return want;
}

// The literals of the one CHECK constraint on exactly `table.column`.
Result<Set> CheckValues(store::Pool& pool, const std::string& table, const std::string& column) {
  Set out;
  int constraints = 0;
  auto r = store::WithTx(pool, [&](pqxx::work& tx) -> Result<void> {
    for (const auto& row : tx.exec_params(
             "SELECT pg_get_constraintdef(c.oid) FROM pg_constraint c JOIN pg_class t ON "
             "c.conrelid = t.oid JOIN pg_attribute a ON a.attrelid = t.oid AND a.attname = $2 "
             "WHERE t.relname = $1 AND c.contype = 'c' AND c.conkey = ARRAY[a.attnum]",
             table, column)) {
      ++constraints;
      const auto def = row[0].as<std::string>();
      static const std::regex kLiteral("'([^']*)'");
      for (auto it = std::sregex_iterator(def.begin(), def.end(), kLiteral);
           it != std::sregex_iterator(); ++it) {
        out.insert((*it)[1].str());
      }
    }
    return Ok();
  });
  if (!r.ok()) return r.error();
  if (constraints != 1) {
    return Error::FailedPrecondition("check_count", table + "." + column + " has " +
                                                        std::to_string(constraints) +
                                                        " single-column CHECK constraints");
  }
  return out;
}

void ExpectColumnsMatch(const std::string& component, const std::vector<store::Migration>& m,
                        const std::vector<Column>& columns) {
  store::PoolOptions po;
  po.dsn = testing::SharedPostgres().CreateDatabase(component);
  store::Pool pool(po, log::Logger("test", component, log::Level::kWarn));
  ASSERT_TRUE(store::Migrate(pool, "common", store::CommonMigrations()).ok());
  auto applied = store::Migrate(pool, component, m);
  ASSERT_TRUE(applied.ok()) << applied.error().ToString();
  for (const auto& c : columns) {
    SCOPED_TRACE(component + ": " + c.table + "." + c.column + " vs " +
                 (c.e != nullptr ? c.e->full_name() : "the service's own enum"));
    ASSERT_TRUE(c.e != nullptr || !c.subset.empty()) << "an own enum names its texts";
    for (const auto& s : c.subset) {
      if (c.e != nullptr) {
        EXPECT_TRUE(enums::NumberOf(c.e, s).has_value()) << "subset value '" << s << "'";
      }
    }
    auto got = CheckValues(pool, c.table, c.column);
    ASSERT_TRUE(got.ok()) << got.error().ToString();
    EXPECT_EQ(*got, Expected(c));
  }
}

TEST(EnumChecksTest, SchedulerColumnsMatchTheirEnums) {
  ExpectColumnsMatch(
      "scheduler", scheduler::Migrations(),
      {
          {"projected_nodes", "capacity_profile", v1::CapacityProfile_descriptor()},
          {"projected_nodes", "admin_state", v1::NodeAdminState_descriptor()},
          {"projected_slots", "admin_state", v1::SlotAdminState_descriptor()},
          {"projected_slots", "health", v1::SlotHealth_descriptor()},
          {"projected_slots", "fabric_type", v1::FabricType_descriptor(), true},
          {"projected_slots", "fabric_claim_mode", v1::FabricClaimMode_descriptor(), true},
          {"allocations", "state", v1::AllocationState_descriptor()},
          // Partitions and shared GPUs are modelled in the catalog but not sold yet.
          {"allocations",
           "shape",
           v1::CapacityShape_descriptor(),
           false,
           {"baremetal", "gpu_slice"}},
          {"allocations", "network_mode", v1::NetworkMode_descriptor()},
          {"allocations", "billable_unit", v1::BillableUnit_descriptor()},
          {"allocations", "failure_stage", v1::LifecycleStage_descriptor(), true},
          {"allocations", "net_lease_state", v1::LeaseState_descriptor(), true},
          {"allocation_endpoints", "protocol", v1::TransportProtocol_descriptor()},
          {"allocation_endpoints", "state", v1::ExposureState_descriptor(), true},
          {"allocation_resource_claims", "kind", v1::ClaimKind_descriptor()},
          {"allocation_resource_claims", "phase", v1::ClaimPhase_descriptor()},
          // The scheduler sends only the VM lifecycle's tasks; inventory sends the others.
          {"allocation_tasks",
           "type",
           v1::TaskType_descriptor(),
           false,
           {"vm.provision", "vm.release", "slot.cleanup"}},
          // The scheduler's own closed set (not on the wire): the code's table of texts.
          {"allocation_tasks", "status", nullptr, false, TaskStatusTexts()},
          {"allocation_timeline", "step", v1::TimelineStep_descriptor()},
          {"allocation_timeline", "state", v1::AllocationState_descriptor()},
          {"allocation_timeline",
           "task_type",
           v1::TaskType_descriptor(),
           true,
           {"vm.provision", "vm.release", "slot.cleanup"}},
          {"allocation_timeline", "stage", v1::TaskStage_descriptor(), true},
      });
}

TEST(EnumChecksTest, InventoryColumnsMatchTheirEnums) {
  ExpectColumnsMatch("inventory", inventory::Migrations(),
                     {
                         {"nodes", "capacity_profile", v1::CapacityProfile_descriptor()},
                         {"nodes", "mode_target", v1::CapacityProfile_descriptor()},
                         {"nodes", "admin_state", v1::NodeAdminState_descriptor()},
                         {"node_resource_slots", "admin_state", v1::SlotAdminState_descriptor()},
                         {"node_resource_slots", "health", v1::SlotHealth_descriptor()},
                         {"node_tasks", "type", v1::TaskType_descriptor()},
                         {"node_tasks", "status", v1::TaskStatus_descriptor()},
                     });
}

TEST(EnumChecksTest, IpamColumnsMatchTheirEnums) {
  ExpectColumnsMatch("ipam", ipam::Migrations(),
                     {
                         {"allocation_bindings", "state", v1::AllocationState_descriptor()},
                         // '' on a rule: inherit; on a node row: made before datapaths.
                         {"subnet_rules", "datapath", v1::NetworkDatapath_descriptor(), true},
                         {"node_subnets", "datapath", v1::NetworkDatapath_descriptor(), true},
                         // ipam's own closed set (not on the wire): the code's table of texts.
                         {"subnet_rules", "scope", nullptr, false, ScopeTexts()},
                     });
}

TEST(EnumChecksTest, IngressColumnsMatchTheirEnums) {
  ExpectColumnsMatch("ingress", ingress::Migrations(),
                     {
                         // DNS-name and overlay pools are in the contract, not served yet.
                         {"endpoint_pools",
                          "kind",
                          v1::EndpointPoolKind_descriptor(),
                          false,
                          {"port_range", "public_ip"}},
                         {"exposures", "protocol", v1::TransportProtocol_descriptor()},
                         {"exposures", "state", v1::ExposureState_descriptor()},
                         // The projection of the scheduler's allocations (read as an enum).
                         {"allocations", "state", v1::AllocationState_descriptor()},
                     });
}

TEST(EnumChecksTest, ConsoleGwColumnsMatchTheirEnums) {
  ExpectColumnsMatch("console", console_gw::Migrations(),
                     {
                         {"console_sessions", "state", v1::ConsoleSessionState_descriptor()},
                         // console-gw's own closed set: the code's table of texts.
                         {"page_sessions", "end_reason", nullptr, true, PageEndTexts()},
                     });
}

}  // namespace
}  // namespace gpuaas
