#pragma once
// Service runtime shared by every service: common configuration keys, instance identity,
// logger, metrics registry, the NATS connection, the PostgreSQL pool with migrations applied
// at start, the health/metrics HTTP server, signal handling and graceful drain.
//
// Drain order on SIGTERM/SIGINT: readiness goes false, then every drain step runs in the order
// registered (services register: stop taking requests, stop consumers, flush the outbox).
#include <atomic>
#include <condition_variable>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

#include "gpuaas/common/config.hpp"
#include "gpuaas/common/http.hpp"
#include "gpuaas/common/inbox.hpp"
#include "gpuaas/common/log.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/result.hpp"
#include "gpuaas/common/revocations.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"

#include <iostream>

namespace prometheus {
class Registry;
}

namespace gpuaas::runtime {

struct CommonConfig {
  std::string instance_id;
  std::string log_level;
  std::string nats_url;
  int64_t nats_request_timeout_ms = 5000;
  std::string nats_seed_file;     // this service's (or node's) NATS nkey seed
  std::string nats_inbox_prefix;  // "" = _INBOX.<service name>
  std::string nats_tls_ca_file;
  std::string token_public_keys;         // comma-separated PEM files that verify request tokens
  std::string tenant_token_public_keys;  // the tenant issuer's: tenant tokens only
  std::string pg_dsn;
  int64_t pg_pool_size = 4;
  std::string http_host;
  int64_t http_port = 0;
  int64_t rpc_workers = 4;
  std::string rpc_rate_limits;  // rate_limit.hpp's text: per token role and subject class
  int64_t drain_timeout_ms = 10000;

  // Registers the keys every service has; `with_postgres` adds the postgres.* keys.
  void Register(config::Schema& schema, bool with_postgres);
};

struct Component {
  std::string name;                                           // "inventory"
  const std::vector<store::Migration>* migrations = nullptr;  // null: no PostgreSQL
};

class Service {
 public:
  Service(Component component, CommonConfig cfg);
  ~Service();

  // Connects NATS (and PostgreSQL, retrying until it is reachable or `start_timeout`),
  // applies migrations, starts /healthz, /readyz, /metrics and /contract (what the service
  // serves, consumes, publishes and requests: contract.hpp).
  Result<void> Start(std::chrono::milliseconds start_timeout = std::chrono::seconds(30));

  const std::string& name() const { return component_.name; }
  const std::string& instance_id() const { return cfg_.instance_id; }
  std::string source() const { return component_.name + "/" + cfg_.instance_id; }
  const CommonConfig& config() const { return cfg_; }
  const log::Logger& log() const { return log_; }
  prometheus::Registry& metrics() { return *registry_; }
  std::shared_ptr<messaging::Connection> nats() { return nats_; }
  std::shared_ptr<store::Pool> pg() { return pool_; }
  uint16_t http_port() const { return http_port_; }
  // The PEMs of auth.token_public_keys (read at Start), for a service that verifies request
  // tokens outside the request server (console-gw's web login).
  const std::vector<std::string>& token_public_keys() const { return token_keys_; }
  // The token revocations in force, followed from Start (revocations.hpp); every token this
  // service accepts outside the request server must pass revocations().Check too.
  const revocation::List& revocations() const { return *revocations_; }

  // Starts an outbox relay for this service's database; it is flushed on drain.
  outbox::Relay& StartOutboxRelay(outbox::RelayOptions opts = {});

  // The service's request/reply server: queue group "<name>" on "gpuaas.*.<name>.>". Register
  // handlers, then ServeRequests(). Drained first on shutdown. ServeRequests() adds
  // gpuaas.v1.<name>.dlq.replay where the contract declares it (dlq.hpp).
  rpc::Server& Rpc();
  Result<void> ServeRequests();

  // A durable consumer whose lifetime the runtime manages (stopped on drain, after requests).
  // `batch` (optional) handles a fetched batch first (messaging::Consumer::SetBatchHandler).
  Result<messaging::Consumer*> StartConsumer(messaging::ConsumerSpec spec,
                                             messaging::Consumer::Handler handler,
                                             messaging::Consumer::BatchHandler batch = {});
  // The usual one: durable `durable` on `stream` (consumer defaults otherwise), the events of
  // `filter` applied with inbox idempotency, a fetched batch in one transaction
  // (inbox::ProjectionBatchHandler), one by one when that fails (inbox::ProjectionHandler).
  Result<messaging::Consumer*> StartProjection(const std::string& stream,
                                               const std::string& durable,
                                               const std::string& filter, inbox::ApplyFn apply,
                                               std::shared_ptr<inbox::ProjectionStats> stats = {});
  // The same for a projection that applies a batch set-based: `apply_many` gets each fetched
  // batch's new events (up to `batch`) in one transaction; `apply` the one-by-one path's event.
  Result<messaging::Consumer*> StartBatchProjection(const std::string& stream,
                                                    const std::string& durable,
                                                    const std::string& filter, inbox::ApplyFn apply,
                                                    inbox::BatchApplyFn apply_many, int batch);

  // A readiness check; /readyz is 200 only while all pass and the service is not draining.
  void AddReadinessCheck(std::string name, std::function<Result<void>()> check);
  // Gate set by the service itself (e.g. node-agent until restart adoption finished).
  void SetReady(bool ready) { self_ready_ = ready; }
  // Steps run in registration order when the service stops.
  void OnDrain(std::string name, std::function<void()> step);

  // Blocks until SIGINT/SIGTERM or RequestStop(), then drains. Returns the exit code.
  int Run();
  void RequestStop();
  // Drains and closes everything (idempotent).
  void Shutdown();

  // JSON of every readiness check: {"ready":bool,"checks":{name:"ok"|error}}.
  std::pair<bool, std::string> Readiness();

 private:
  // Start's steps, in the order it runs them.
  Result<void> ReadTokenKeys();  // auth.(tenant_)token_public_keys: every file readable
  Result<void> ConnectNats();    // and its readiness check
  Result<void> FollowRevocations();
  // PostgreSQL pool and migrations (common, then own), retrying a retryable failure until
  // `deadline`; then its readiness check.
  Result<void> OpenDatabase(std::chrono::steady_clock::time_point deadline);
  void RouteHttp();  // /healthz, /readyz, /metrics, /contract (not yet listening)

  Component component_;
  CommonConfig cfg_;
  log::Logger log_;
  std::shared_ptr<prometheus::Registry> registry_;
  std::shared_ptr<messaging::Connection> nats_;
  std::shared_ptr<store::Pool> pool_;
  std::unique_ptr<http::Server> http_;
  std::unique_ptr<outbox::Relay> relay_;
  std::unique_ptr<rpc::Server> rpc_;
  std::vector<std::unique_ptr<messaging::Consumer>> consumers_;
  std::mutex consumers_mu_;  // consumers_ (a dead-letter replay looks one up)
  uint16_t http_port_ = 0;
  std::vector<std::string> token_keys_;         // PEMs of auth.token_public_keys
  std::vector<std::string> tenant_token_keys_;  // PEMs of auth.tenant_token_public_keys
  std::shared_ptr<revocation::List> revocations_ = std::make_shared<revocation::List>();
  std::unique_ptr<revocation::Follower> revocation_follower_;
  std::vector<std::pair<std::string, std::function<Result<void>()>>> checks_;
  std::vector<std::pair<std::string, std::function<void()>>> drains_;
  std::atomic<bool> self_ready_{true};
  std::atomic<bool> draining_{false};
  std::atomic<bool> shut_down_{false};
  std::mutex stop_mu_;
  std::condition_variable stop_cv_;
  bool stop_requested_ = false;
};

// Blocks SIGINT/SIGTERM in the calling thread (and threads it creates later).
void BlockTerminationSignals();

// Parses `--config FILE` / `--print-config` for a service main(); loads schema + env.
// Returns the exit code to use when main should stop now (help, bad config), else -1.
int ParseServiceArgs(int argc, char** argv, const std::string& service, config::Schema& schema);

// The whole main() of a service: config from --config/env, start, run until signalled.
// Svc: constructible from Cfg, with Result<void> Start() and int Run(); Cfg: Register(Schema&).
template <typename Svc, typename Cfg>
int Main(int argc, char** argv, const std::string& name) {
  Cfg cfg;
  config::Schema schema;
  cfg.Register(schema);
  if (int rc = ParseServiceArgs(argc, argv, name, schema); rc >= 0) return rc;
  Svc svc(cfg);
  if (auto r = svc.Start(); !r.ok()) {
    std::cerr << "gpuaas-" << name << ": start failed: " << r.error().ToString() << "\n";
    return 1;
  }
  return svc.Run();
}

}  // namespace gpuaas::runtime
