#pragma once
// Checks every decoded request gets before its handler sees it (rpc::Server), also callable
// from fuzz targets and tests.
#include <string>
#include <string_view>
#include <vector>

#include "gpuaas/common/result.hpp"

namespace google::protobuf {
class Message;
}

namespace gpuaas::validate {

// Paths of every `string` field of `m` (nested messages, repeated and map fields included)
// holding a NUL byte, e.g. "hostname", "nodes[2].labels[\"gpu\"]", "slot_keys[0]". A NUL would
// be cut off silently by PostgreSQL text and C strings, so the value stored would not be the
// value sent. `bytes` fields may hold anything and are not checked; neither is the packed value
// of a google.protobuf.Any.
std::vector<std::string> NulStringFields(const google::protobuf::Message& m);

// INVALID_ARGUMENT string_has_nul naming every such field in `details` (path -> "contains a NUL
// byte"), or Ok.
Result<void> RefuseNulStrings(const google::protobuf::Message& m);

// Why `s` is not plain text ("" when it is): plain text is well-formed UTF-8 (RFC 3629: no
// overlongs, no surrogates, nothing past U+10FFFF) without control characters (C0, DEL) and
// without U+FFFE/U+FFFF — what JSON (token claims) and XML 1.0 (libvirt domains) can carry.
// E.g. "control character 0x1b at byte 3", "not UTF-8 at byte 0".
std::string TextProblem(std::string_view s);

}  // namespace gpuaas::validate
