// validate::NulStringFields / RefuseNulStrings: every string field holding a NUL is found,
// wherever it sits (nested, repeated, map key or value); bytes fields and clean messages pass.
#include <gtest/gtest.h>

#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/validate.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/inventory.pb.h"

namespace gpuaas::validate {
namespace {

using namespace std::string_literals;

TEST(ValidateTest, CleanMessagesPass) {
  v1::RegisterNodeRequest req;
  req.set_node_id("gpu-01");
  req.set_hostname("gpu-01.example");
  (*req.mutable_labels())["rack"] = "r1";
  EXPECT_TRUE(NulStringFields(req).empty());
  EXPECT_TRUE(RefuseNulStrings(req).ok());
  EXPECT_TRUE(RefuseNulStrings(v1::RegisterNodeRequest()).ok());
}

TEST(ValidateTest, TopLevelStringIsNamed) {
  v1::RegisterNodeRequest req;
  req.set_node_id("gpu-01");
  req.set_hostname("fuzz-ok\0nul-x"s);
  EXPECT_EQ(NulStringFields(req), std::vector<std::string>{"hostname"});
  auto r = RefuseNulStrings(req);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().code, Code::kInvalidArgument);
  EXPECT_EQ(r.error().reason, "string_has_nul");
  EXPECT_EQ(r.error().details.count("hostname"), 1u) << r.error().ToString();
  EXPECT_NE(r.error().message.find("hostname"), std::string::npos);
}

TEST(ValidateTest, NestedRepeatedAndMapFieldsAreNamed) {
  v1::ListNodesResponse resp;
  resp.add_nodes()->set_node_id("clean");
  auto* n = resp.add_nodes();
  n->set_node_id("a\0b"s);
  (*n->mutable_labels())["gpu"] = "h100\0"s;
  (*n->mutable_labels())["k\0ey"s] = "v";
  auto bad = NulStringFields(resp);
  std::sort(bad.begin(), bad.end());
  EXPECT_EQ(bad,
            (std::vector<std::string>{"nodes[1].labels[\"gpu\"]",
                                      "nodes[1].labels[\"k\\0ey\"] (key)", "nodes[1].node_id"}));

  v1::ApproveSlotsRequest approve;
  approve.add_slot_keys("s0");
  approve.add_slot_keys("\0"s);
  EXPECT_EQ(NulStringFields(approve), std::vector<std::string>{"slot_keys[1]"});
}

TEST(ValidateTest, BytesFieldsMayHoldNul) {
  v1::DeadLetter dl;
  dl.set_payload("\0\0binary\0"s);
  dl.set_stream("GPUAAS_EVT_NODE");
  EXPECT_TRUE(RefuseNulStrings(dl).ok());
  (*dl.mutable_headers())["Nats-Msg-Id"] = "x\0"s;
  EXPECT_EQ(NulStringFields(dl), std::vector<std::string>{"headers[\"Nats-Msg-Id\"]"});
}

// What every served request goes through before its handler.
TEST(ValidateTest, DecodeRequestRefusesNulStringsAndMalformedBodies) {
  v1::RegisterNodeRequest sent;
  sent.set_node_id("gpu-01");
  sent.set_hostname("fuzz-ok\0nul-x"s);
  v1::RegisterNodeRequest got;
  auto r = rpc::DecodeRequest(sent.SerializeAsString(), got);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.error().reason, "string_has_nul");

  sent.set_hostname("fuzz-ok");
  EXPECT_TRUE(rpc::DecodeRequest(sent.SerializeAsString(), got).ok());
  EXPECT_EQ(got.hostname(), "fuzz-ok");

  auto bad = rpc::DecodeRequest("\xff\xff\xff", got);
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.error().reason, "malformed_payload");
}

}  // namespace
}  // namespace gpuaas::validate

TEST(ValidateTest, TextProblemNamesControlCharactersBadUtf8AndNoncharacters) {
  using gpuaas::validate::TextProblem;
  EXPECT_EQ(TextProblem("acme/alice-ü-東京"), "");
  EXPECT_EQ(TextProblem(""), "");
  EXPECT_EQ(TextProblem("ab\x1b"
                        "c"),
            "control character 0x1b at byte 2");
  EXPECT_EQ(TextProblem(std::string("a\0b", 3)), "control character 0x00 at byte 1");
  EXPECT_EQ(TextProblem("x\x7f"), "control character 0x7f at byte 1");
  EXPECT_EQ(TextProblem("\xc0\xaf"), "not UTF-8 at byte 0");         // overlong '/'
  EXPECT_EQ(TextProblem("\xed\xa0\x80"), "not UTF-8 at byte 0");     // a surrogate
  EXPECT_EQ(TextProblem("ok\xe2\x82"), "not UTF-8 at byte 2");       // cut short
  EXPECT_EQ(TextProblem("\xef\xbf\xbe"), "noncharacter at byte 0");  // U+FFFE
}
