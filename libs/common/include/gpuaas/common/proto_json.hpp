#pragma once
// Protobuf <-> JSON with proto field names (what operators read in `-o json`, and how
// services keep protobuf documents in jsonb columns).
#include <google/protobuf/message.h>

#include <string>

#include "gpuaas/common/result.hpp"

namespace gpuaas::protojson {

std::string ToJson(const google::protobuf::Message& m, bool pretty = false);
// Unknown fields are ignored (documents written by newer versions stay readable).
Result<void> FromJson(const std::string& json, google::protobuf::Message* m);

}  // namespace gpuaas::protojson
