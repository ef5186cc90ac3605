#include "gpuaas/common/proto_json.hpp"

#include <google/protobuf/util/json_util.h>

#include "gpuaas/common/reasons.hpp"

namespace gpuaas::protojson {

std::string ToJson(const google::protobuf::Message& m, bool pretty) {
  std::string out;
  google::protobuf::util::JsonPrintOptions o;
  o.add_whitespace = pretty;
  o.preserve_proto_field_names = true;
  (void)google::protobuf::util::MessageToJsonString(m, &out, o);
  return out;
}

Result<void> FromJson(const std::string& json, google::protobuf::Message* m) {
  google::protobuf::util::JsonParseOptions o;
  o.ignore_unknown_fields = true;
  auto s = google::protobuf::util::JsonStringToMessage(json, m, o);
  if (!s.ok()) {
    return Error::InvalidArgument(reason::kMalformedJson,
                                  "not a valid " + m->GetDescriptor()->full_name() +
                                      " document: " + std::string(s.message()));
  }
  return Ok();
}

}  // namespace gpuaas::protojson
