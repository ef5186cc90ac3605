#pragma once
// Identifiers: UUIDv7 event ids, W3C trace context, instance ids.
#include <string>
#include <string_view>

namespace gpuaas::ids {

// RFC 9562 UUIDv7: 48-bit Unix ms timestamp, then random bits; sorts by creation time.
std::string NewUuidV7();
bool IsUuid(std::string_view s);

// W3C traceparent "00-<32 hex trace id>-<16 hex span id>-01".
std::string NewTraceparent();
// A child span in the same trace; a malformed parent starts a new trace.
std::string ChildTraceparent(std::string_view parent);
// The trace id of a traceparent, or "" when malformed.
std::string TraceId(std::string_view traceparent);

// "<hostname>-<pid>-<4 random hex>": unique per process, readable in logs.
std::string NewInstanceId();

// Node ids and slot keys become NATS subject tokens / durable names: a lowercase DNS label
// (a-z, 0-9, '-', 1..63 characters, no leading/trailing '-'). No dots, no wildcards.
bool IsNodeId(std::string_view s);

}  // namespace gpuaas::ids
