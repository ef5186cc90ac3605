#pragma once
// What a service really speaks on NATS, recorded where it happens: the rpc server records each
// subject it serves (request and result types from its typed handler), a durable consumer its
// filter (and the dead-letter subject it may publish to), JetStream publishes and core requests
// the subject they go to. One Registry per messaging::Connection, so each service of a process
// (the cross-service tests run several) has its own; the runtime serves it as JSON on
// /contract. tests/contract checks it against asyncapi/gpuaas.asyncapi.yaml, so the contract
// test reads what the code does instead of scanning its text.
#include <cstddef>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gpuaas/common/result.hpp"

namespace gpuaas::contract {

enum class Role {
  kServe,    // answers requests on the subject (AsyncAPI: receive, with a reply)
  kConsume,  // a durable consumer's filter (receive)
  kPublish,  // publishes to the subject (send)
  kRequest,  // sends requests to the subject and waits for the reply (a served subject's client)
};
const char* RoleName(Role role);
Result<Role> ParseRole(const std::string& name);

struct Entry {
  Role role = Role::kPublish;
  // As the code used it: a concrete subject, or a consumer's filter (NATS wildcards).
  std::string subject;
  // Fully-qualified protobuf type on the wire; "" where this side does not know it.
  std::string type;
  // The type inside the envelope: Reply.result (serve, request) or Event.data (publish).
  std::string inner_type;
  std::string via;     // what recorded it, e.g. "rpc server inventory", "consumer S/D"
  uint64_t count = 0;  // how often it was recorded (messages published, requests sent)
};

class Registry {
 public:
  // Beyond `max_entries` distinct (role, subject) pairs new ones are only counted (Dropped()):
  // publish subjects carry ids, and the registry must stay small in a long-running service.
  explicit Registry(size_t max_entries = 4096) : max_entries_(max_entries) {}

  // Adds the entry or merges it into the one with the same role and subject: types not known
  // yet are filled in, `count` grows by `e.count`.
  void Record(Entry e);
  // A message published to `subject` (JetStream or core). The first time a subject is seen its
  // payload is looked at: a gpuaas.v1.Event envelope (specversion 1.0, an id, packed data)
  // records gpuaas.v1.Event and the packed type; any other payload leaves the types unknown.
  void RecordPublish(const std::string& subject, const std::string& payload, const char* via);

  std::vector<Entry> Snapshot() const;  // ordered by role, then subject
  uint64_t Dropped() const;

 private:
  struct Slot {
    Entry entry;
    bool looked_at_payload = false;
  };
  mutable std::mutex mu_;
  size_t max_entries_;
  std::map<std::pair<Role, std::string>, Slot> entries_;
  uint64_t dropped_ = 0;
};

// The registry as served on /contract:
// {"service":..,"instance":..,"dropped":n,"entries":[{"role","subject","type","inner_type",
//  "via","count"}]}.
std::string ToJson(const Registry& registry, const std::string& service,
                   const std::string& instance);
// The entries of a ToJson() document (for tests and tools); INVALID_ARGUMENT when malformed.
Result<std::vector<Entry>> EntriesFromJson(const std::string& json);

}  // namespace gpuaas::contract
