// Pure pieces of the event envelope: types derived from subjects, envelope
// fields, array literals.
#include <gtest/gtest.h>

#include "gpuaas/common/allocation_event.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/status.pb.h"

namespace gpuaas {
namespace {

TEST(EnvelopeTest, TypeComesFromTheSubject) {
  EXPECT_EQ(outbox::DefaultType("gpuaas.v1.evt.inventory.slot.updated"),
            "gpuaas.v1.inventory.slot.updated");
  EXPECT_EQ(outbox::DefaultType("gpuaas.v1.node.gpu-01.task"), "gpuaas.v1.node.task")
      << "a node task's type does not depend on the node";
  EXPECT_EQ(outbox::DefaultType("gpuaas.v1.something"), "gpuaas.v1.something");
}

TEST(EnvelopeTest, MakeEventFillsTheEnvelope) {
  v1::Status data;
  data.set_reason("x");
  const auto ev = outbox::MakeEvent(
      {"gpuaas.v1.evt.node.gpu-01.topology", "", "node-agent/a", "gpu-01", 7, "corr", "", &data});
  EXPECT_TRUE(ids::IsUuid(ev.id()));
  EXPECT_EQ(ev.specversion(), "1.0");
  EXPECT_EQ(ev.type(), "gpuaas.v1.node.gpu-01.topology");
  EXPECT_EQ(ev.subject(), "gpu-01");
  EXPECT_EQ(ev.generation(), 7);
  EXPECT_EQ(ev.correlation_id(), "corr");
  v1::Status back;
  ASSERT_TRUE(ev.data().UnpackTo(&back));
  EXPECT_EQ(back.reason(), "x");
  EXPECT_NE(outbox::MakeEvent({"gpuaas.v1.evt.a.b", "", "s", "e", 1, "", "", nullptr}).id(),
            ev.id());
}

TEST(EnvelopeTest, AllocationEventsAreReadWithTheirGeneration) {
  const std::string id = ids::NewUuidV7();
  v1::AllocationSnapshot snap;
  snap.mutable_allocation()->set_allocation_id(id);
  snap.mutable_allocation()->set_generation(4);
  const std::string subject = "gpuaas.v1.evt.scheduler.allocation.active";
  auto read =
      inbox::ReadAllocationEvent(outbox::MakeEvent({subject, "", "s", id, 5, id, "", &snap}));
  ASSERT_TRUE(read.ok()) << read.error().ToString();
  EXPECT_EQ(read->allocation().allocation_id(), id);
  EXPECT_EQ(read->generation, 5);
  read = inbox::ReadAllocationEvent(outbox::MakeEvent({subject, "", "s", id, 0, id, "", &snap}));
  ASSERT_TRUE(read.ok()) << read.error().ToString();
  EXPECT_EQ(read->generation, 4) << "no envelope generation: the allocation's";

  v1::Status other;
  auto wrong =
      inbox::ReadAllocationEvent(outbox::MakeEvent({subject, "", "s", id, 5, id, "", &other}));
  ASSERT_FALSE(wrong.ok());
  EXPECT_EQ(wrong.error().reason, "malformed_event");
  EXPECT_EQ(wrong.error().message, "event data is not a gpuaas.v1.AllocationSnapshot");
  snap.mutable_allocation()->set_allocation_id("not-a-uuid");
  auto no_id =
      inbox::ReadAllocationEvent(outbox::MakeEvent({subject, "", "s", id, 5, id, "", &snap}));
  ASSERT_FALSE(no_id.ok());
  EXPECT_EQ(no_id.error().reason, "malformed_event");
  EXPECT_EQ(no_id.error().code, Code::kInvalidArgument);
}

TEST(EnvelopeTest, TextArrayLiteralQuotesEveryElement) {
  EXPECT_EQ(store::TextArrayLiteral({}), "{}");
  EXPECT_EQ(store::TextArrayLiteral({"a", "b,c", "d\"e", "f\\g"}),
            "{\"a\",\"b,c\",\"d\\\"e\",\"f\\\\g\"}");
}

}  // namespace
}  // namespace gpuaas
