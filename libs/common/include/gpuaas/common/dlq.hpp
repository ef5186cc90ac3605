#pragma once
// Dead letters (stream GPUAAS_DLQ, gpuaas.v1.DeadLetter): reading, deleting and replaying them.
//
// A replay goes to the service that owns the failing consumer (gpuaas.v1.<service>.dlq.replay,
// operator only), which reads the dead letter by its GPUAAS_DLQ sequence and runs that
// consumer's handler on it again: no event is forged, and the handler's inbox makes a replay of
// something already applied a no-op. A node task durable (node-<id>) is consumed by the node's
// agent, not by a service: the service that manages the durable (inventory) re-publishes the task
// to its subject instead, with Nats-Msg-Id "replay:<dlq sequence>". A replay never deletes the
// dead letter; the operator discards it (`gpuaasctl dlq discard`), so services need only read
// GPUAAS_DLQ.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>
#include <vector>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/result.hpp"

namespace gpuaas::store {
class Pool;
}
namespace gpuaas::rpc {
class Server;
}
namespace gpuaas::access {
struct Contract;
}

namespace gpuaas::dlq {

inline constexpr const char* kStream = "GPUAAS_DLQ";

// gpuaas.v1.<service>.dlq.replay
std::string ReplaySubject(const std::string& service);

// One stored dead letter: its GPUAAS_DLQ sequence, subject (gpuaas.v1.dlq.<stream>.<consumer>)
// and body (a serialized gpuaas.v1.DeadLetter).
struct Entry {
  uint64_t sequence = 0;
  std::string subject;
  std::string data;
  std::string Stream() const;    // <stream> of the subject
  std::string Consumer() const;  // <consumer> of the subject
};

// The dead letter at `sequence`: NOT_FOUND dead_letter_not_found when there is none (never
// stored, discarded, or the stream does not exist).
Result<Entry> Get(messaging::Connection& conn, uint64_t sequence);
// The newest `limit` dead letters whose stream and consumer match ("" = any), newest first.
Result<std::vector<Entry>> ListNewest(messaging::Connection& conn, const std::string& stream,
                                      const std::string& consumer, size_t limit);
// Deletes the dead letter at `sequence` (NOT_FOUND dead_letter_not_found when there is none).
Result<void> Delete(messaging::Connection& conn, uint64_t sequence);

// Whether a contract durable (`node-{node_id}`: a {param} stands for any text) names `durable`.
bool DurableMatches(const std::string& pattern, const std::string& durable);
// The service that replays dead letters of durable `consumer` on `stream` ("" = any): the
// service role consuming it, else the service managing it (node-<id>: inventory). NOT_FOUND
// consumer_unknown when the contract declares no such durable.
Result<std::string> ReplayServiceOf(const access::Contract& c, const std::string& stream,
                                    const std::string& consumer);

struct ReplayDeps {
  std::shared_ptr<messaging::Connection> nats;
  std::shared_ptr<store::Pool> pool;  // where the consumers' inbox is (null: no duplicate check)
  std::string service;
  // This service's running consumer with that durable, or null.
  std::function<messaging::Consumer*(const std::string& durable)> find;
  log::Logger log;
};

// Registers gpuaas.v1.<service>.dlq.replay on `server` when the embedded contract says the
// service serves it (call before the server starts).
void ServeReplay(rpc::Server& server, ReplayDeps deps);

}  // namespace gpuaas::dlq
