#include "gpuaas/common/runtime.hpp"

#include <algorithm>

#include <signal.h>

#include <cstdio>
#include <fstream>
#include <iostream>
#include <sstream>
#include <thread>

#include <fmt/format.h>
#include <prometheus/registry.h>
#include <prometheus/text_serializer.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/access.hpp"
#include "gpuaas/common/contract.hpp"
#include "gpuaas/common/dlq.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/process_metrics.hpp"
#include "gpuaas/common/rate_limit.hpp"
#include "gpuaas/common/reasons.hpp"

namespace gpuaas::runtime {

void CommonConfig::Register(config::Schema& s, bool with_postgres) {
  s.Add("service.instance_id", &instance_id,
        "Instance identity in logs, events and NATS connection names (empty: generated)", "");
  s.Add("log.level", &log_level, "debug | info | warn | error", "info",
        config::OneOf({"debug", "info", "warn", "error"}));
  s.Add("nats.url", &nats_url, "NATS server URL", "nats://127.0.0.1:4222", config::NonEmpty());
  s.Add("nats.request_timeout_ms", &nats_request_timeout_ms,
        "Timeout of requests this service makes", 5000, config::Range(1, 600000));
  s.Add("nats.seed_file", &nats_seed_file,
        "File with this identity's NATS nkey seed (mode 0600; \"\" = anonymous, refused by a "
        "server with authorization)",
        "");
  s.Add("nats.inbox_prefix", &nats_inbox_prefix,
        "Reply subject prefix; the server lets this identity receive only there (\"\" = "
        "_INBOX.<service>; a node-agent: _INBOX.node.<node id>)",
        "");
  s.Add("nats.tls_ca_file", &nats_tls_ca_file,
        "CA bundle to verify the NATS server's TLS certificate (\"\" = plain TCP)", "");
  s.Add("auth.token_public_keys", &token_public_keys,
        "Comma-separated PEM public keys that verify request tokens (Authorization: Bearer); "
        "\"\" = requests that need a token are refused",
        "");
  s.Add("auth.tenant_token_public_keys", &tenant_token_public_keys,
        "Comma-separated PEM public keys of the tenant issuer (the tenant gateway's signing key): "
        "they verify tenant tokens only; a token they verify claiming another role is refused "
        "(token_issuer_role)",
        "");
  if (with_postgres) {
    s.Add("postgres.dsn", &pg_dsn, "libpq connection string of this service's own database", "",
          config::NonEmpty());
    s.Add("postgres.pool_size", &pg_pool_size, "Connections in the pool", 4, config::Range(1, 256));
  }
  s.Add("http.host", &http_host, "Address for /healthz, /readyz, /metrics", "127.0.0.1",
        config::NonEmpty());
  s.Add("http.port", &http_port, "Port for /healthz, /readyz, /metrics (0 = any free port)", 0,
        config::Range(0, 65535));
  s.Add("rpc.workers", &rpc_workers, "Request handler threads", 4, config::Range(1, 256));
  s.Add("rpc.rate_limits", &rpc_rate_limits,
        "Per-principal request limits by token role and subject class (read: get/list/show/"
        "timeline; write: the rest), comma-separated <role>.<read|write>=<per_s>:<burst>; over "
        "it: RESOURCE_EXHAUSTED rate_limited; \"\" = no limits",
        ratelimit::kDefaultLimits, [](const std::string& v) -> std::string {
          auto l = ratelimit::ParseLimits(v);
          return l.ok() ? "" : l.error().message;
        });
  s.Add("shutdown.drain_timeout_ms", &drain_timeout_ms,
        "How long a stopping service may take to finish in-flight work", 10000,
        config::Range(0, 600000));
}

Service::Service(Component component, CommonConfig cfg)
    : component_(std::move(component)),
      cfg_(std::move(cfg)),
      registry_(std::make_shared<prometheus::Registry>()) {
  if (cfg_.instance_id.empty()) cfg_.instance_id = ids::NewInstanceId();
  log_ = log::Logger(component_.name, cfg_.instance_id, log::ParseLevel(cfg_.log_level));
  metrics::AddProcessMetrics(*registry_, component_.name);  // process_*, gpuaas_build_info
}

Service::~Service() { Shutdown(); }

namespace {
// The streams the contract says service `name` uses (access::UsedStreams: exactly those its NATS
// user may look up) must be declared (by `gpuaasctl streams apply`); each is waited for
// (messaging::RequireStream). Not a service of the contract (a node-agent, a test's): none.
Result<void> RequireUsedStreams(messaging::Connection& conn, const std::string& name) {
  const auto& c = access::EmbeddedContract();
  auto role = c.roles.find(name);
  if (role == c.roles.end() || role->second.kind != access::Kind::kService) return Ok();
  const auto used = access::UsedStreams(c, name);
  for (const auto& spec : messaging::PlatformStreams()) {
    if (!used.count(spec.name)) continue;
    if (auto r = messaging::RequireStream(conn, spec); !r.ok()) return r;
  }
  return Ok();
}
}  // namespace

Result<void> Service::Start(std::chrono::milliseconds start_timeout) {
  const auto deadline = std::chrono::steady_clock::now() + start_timeout;
  if (auto r = ReadTokenKeys(); !r.ok()) return r;
  if (auto r = ConnectNats(); !r.ok()) return r;
  if (auto r = RequireUsedStreams(*nats_, component_.name); !r.ok()) return r;
  if (auto r = FollowRevocations(); !r.ok()) return r;
  if (component_.migrations) {
    if (auto r = OpenDatabase(deadline); !r.ok()) return r;
  }
  RouteHttp();
  auto port = http_->Start();
  if (!port.ok()) return port.error();
  http_port_ = *port;
  log_.Info("service started", {{"http_port", std::to_string(http_port_)}});
  return Ok();
}

Result<void> Service::FollowRevocations() {
  // A role the contract has follow token revocations (followTokenRevocations): every service.
  bool follows = false;
  for (const auto& op : access::EmbeddedContract().operations) {
    follows = follows || (op.live_copy && std::find(op.roles.begin(), op.roles.end(),
                                                    component_.name) != op.roles.end());
  }
  if (!follows) return Ok();
  auto f = revocation::Follower::Start(nats_, revocations_, log_);
  if (!f.ok()) return f.error();
  revocation_follower_ = std::move(*f);
  return Ok();
}

namespace {
// The PEM files of a comma-separated list (`key` names the option in the error).
Result<std::vector<std::string>> ReadPems(const std::string& list, const std::string& key) {
  std::vector<std::string> out;
  std::stringstream paths(list);
  for (std::string path; std::getline(paths, path, ',');) {
    if (path.empty()) continue;
    std::ifstream in(path);
    std::stringstream pem;
    pem << in.rdbuf();
    if (!in || pem.str().empty()) {
      return Error::InvalidArgument(reason::kTokenKeyUnreadable,
                                    fmt::format("{}: cannot read {}", key, path));
    }
    out.push_back(pem.str());
  }
  return out;
}
}  // namespace

Result<void> Service::ReadTokenKeys() {
  auto platform = ReadPems(cfg_.token_public_keys, "auth.token_public_keys");
  if (!platform.ok()) return platform.error();
  auto tenant = ReadPems(cfg_.tenant_token_public_keys, "auth.tenant_token_public_keys");
  if (!tenant.ok()) return tenant.error();
  token_keys_ = std::move(*platform);
  tenant_token_keys_ = std::move(*tenant);
  return Ok();
}

Result<void> Service::ConnectNats() {
  messaging::ConnectionOptions no;
  no.url = cfg_.nats_url;
  no.name = source();
  no.seed_file = cfg_.nats_seed_file;
  no.inbox_prefix =
      cfg_.nats_inbox_prefix.empty() ? "_INBOX." + component_.name : cfg_.nats_inbox_prefix;
  no.tls_ca_file = cfg_.nats_tls_ca_file;
  auto nc = messaging::Connection::Connect(no, log_);
  if (!nc.ok()) return nc.error();
  nats_ = *nc;
  AddReadinessCheck("nats", [this]() -> Result<void> {
    if (!nats_->Connected()) return Error::Unavailable(reason::kNatsDisconnected, "not connected");
    return Ok();
  });
  return Ok();
}

Result<void> Service::OpenDatabase(std::chrono::steady_clock::time_point deadline) {
  pool_ = std::make_shared<store::Pool>(
      store::PoolOptions{cfg_.pg_dsn, static_cast<int>(cfg_.pg_pool_size), 5000}, log_);
  while (true) {
    auto common = store::Migrate(*pool_, "common", store::CommonMigrations());
    Result<int> own = common.ok() ? store::Migrate(*pool_, component_.name, *component_.migrations)
                                  : Result<int>(common.error());
    if (own.ok()) break;
    if (!own.error().retryable || std::chrono::steady_clock::now() > deadline) {
      return own.error();
    }
    log_.Warn("database not ready, retrying", {{"error", own.error().ToString()}});
    std::this_thread::sleep_for(std::chrono::milliseconds(500));
  }
  AddReadinessCheck("postgres", [this]() { return pool_->Ping(); });
  auto role = metrics::StartDatabaseRole(pool_, component_.name, *registry_);
  OnDrain("database role sampler", [role] { role->Stop(); });
  return Ok();
}

void Service::RouteHttp() {
  http_ =
      std::make_unique<http::Server>(cfg_.http_host, static_cast<uint16_t>(cfg_.http_port), log_);
  http_->Route("/healthz", [](const std::string&, const std::string&) {
    return http::Response{200, "text/plain; charset=utf-8", "ok\n"};
  });
  http_->Route("/readyz", [this](const std::string&, const std::string&) {
    auto [ready, body] = Readiness();
    return http::Response{ready ? 200 : 503, "application/json", body + "\n"};
  });
  http_->Route("/metrics", [this](const std::string&, const std::string&) {
    prometheus::TextSerializer ser;
    metrics::RefreshProcessMetrics(*registry_);
    return http::Response{200, "text/plain; version=0.0.4", ser.Serialize(registry_->Collect())};
  });
  // What this service has served, consumed, published and requested so far (contract.hpp):
  // tests/contract holds it against asyncapi/.
  http_->Route("/contract", [this](const std::string&, const std::string&) {
    return http::Response{
        200, "application/json",
        contract::ToJson(nats_->contract(), component_.name, cfg_.instance_id) + "\n"};
  });
}

outbox::Relay& Service::StartOutboxRelay(outbox::RelayOptions opts) {
  relay_ = std::make_unique<outbox::Relay>(cfg_.pg_dsn, nats_, log_, registry_.get(), opts);
  relay_->Start();
  auto backlog = metrics::StartOutboxBacklog(pool_, component_.name, *registry_, log_);
  OnDrain("outbox backlog sampler", [backlog] { backlog->Stop(); });
  return *relay_;
}

rpc::Server& Service::Rpc() {
  if (!rpc_) {
    rpc::ServerOptions o;
    o.workers = static_cast<int>(cfg_.rpc_workers);
    o.token_public_keys = token_keys_;
    o.tenant_token_public_keys = tenant_token_keys_;
    o.revocations = revocations_;
    o.rate_limits = *ratelimit::ParseLimits(cfg_.rpc_rate_limits);  // validated by the schema
    // The namespace the contract gives this service (roles.yaml), which its NATS user may
    // subscribe to.
    const auto& roles = access::EmbeddedContract().roles;
    auto role = roles.find(component_.name);
    const std::string filter = role != roles.end() && !role->second.ns.empty()
                                   ? role->second.ns
                                   : fmt::format("gpuaas.*.{}.>", component_.name);
    rpc_ = std::make_unique<rpc::Server>(nats_, component_.name, filter, log_, registry_.get(), o);
  }
  return *rpc_;
}

Result<void> Service::ServeRequests() {
  // Operators replay dead letters of this service's consumers (dlq.hpp), where the contract says
  // it serves gpuaas.v1.<name>.dlq.replay.
  auto find = [this](const std::string& durable) -> messaging::Consumer* {
    std::lock_guard lock(consumers_mu_);
    for (auto& c : consumers_) {
      if (c->spec().durable == durable) return c.get();
    }
    return nullptr;
  };
  dlq::ServeReplay(Rpc(), {nats_, pool_, component_.name, find, log_});
  return Rpc().Start();
}

Result<messaging::Consumer*> Service::StartConsumer(messaging::ConsumerSpec spec,
                                                    messaging::Consumer::Handler handler,
                                                    messaging::Consumer::BatchHandler batch) {
  auto c = std::make_unique<messaging::Consumer>(nats_, std::move(spec), std::move(handler), log_,
                                                 registry_.get());
  if (batch) c->SetBatchHandler(std::move(batch));
  if (auto r = c->Start(); !r.ok()) return r.error();
  std::lock_guard lock(consumers_mu_);
  consumers_.push_back(std::move(c));
  return consumers_.back().get();
}

namespace {

// A projection's consumer: default settings plus prefetch (short handlers; a replay's next batch
// travels while one is applied).
messaging::ConsumerSpec ProjectionSpec(const std::string& stream, const std::string& durable,
                                       const std::string& filter) {
  messaging::ConsumerSpec spec;
  spec.stream = stream;
  spec.durable = durable;
  spec.filter_subject = filter;
  spec.prefetch = true;
  return spec;
}

}  // namespace

Result<messaging::Consumer*> Service::StartProjection(
    const std::string& stream, const std::string& durable, const std::string& filter,
    inbox::ApplyFn apply, std::shared_ptr<inbox::ProjectionStats> stats) {
  auto one = inbox::ProjectionHandler(pool_, durable, apply, log_, stats);
  auto batch =
      inbox::ProjectionBatchHandler(pool_, durable, std::move(apply), {}, log_, std::move(stats));
  return StartConsumer(ProjectionSpec(stream, durable, filter), std::move(one), std::move(batch));
}

Result<messaging::Consumer*> Service::StartBatchProjection(
    const std::string& stream, const std::string& durable, const std::string& filter,
    inbox::ApplyFn apply, inbox::BatchApplyFn apply_many, int batch) {
  messaging::ConsumerSpec spec = ProjectionSpec(stream, durable, filter);
  spec.batch = batch;
  auto one = inbox::ProjectionHandler(pool_, durable, apply, log_);
  auto many =
      inbox::ProjectionBatchHandler(pool_, durable, std::move(apply), std::move(apply_many), log_);
  return StartConsumer(spec, std::move(one), std::move(many));
}

void Service::AddReadinessCheck(std::string name, std::function<Result<void>()> check) {
  checks_.emplace_back(std::move(name), std::move(check));
}

void Service::OnDrain(std::string name, std::function<void()> step) {
  drains_.emplace_back(std::move(name), std::move(step));
}

std::pair<bool, std::string> Service::Readiness() {
  nlohmann::json j;
  bool ready = self_ready_ && !draining_;
  j["checks"] = nlohmann::json::object();
  for (const auto& [name, check] : checks_) {
    auto r = check();
    j["checks"][name] = r.ok() ? "ok" : r.error().ToString();
    ready = ready && r.ok();
  }
  if (!self_ready_) j["checks"]["service"] = "not ready";
  if (draining_) j["checks"]["service"] = "draining";
  j["ready"] = ready;
  return {ready, j.dump()};
}

int Service::Run() {
  // Signals are taken by a dedicated thread; every other thread has them blocked.
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
  std::thread waiter([this, set] {
    int sig = 0;
    sigwait(&set, &sig);
    if (sig != 0) log_.Info("signal received, draining", {{"signal", std::to_string(sig)}});
    RequestStop();
  });
  {
    std::unique_lock lock(stop_mu_);
    stop_cv_.wait(lock, [this] { return stop_requested_; });
  }
  Shutdown();
  // Wake the waiter if we stopped for another reason. SIGTERM is blocked in every thread, so
  // this only completes the waiter's sigwait(); it terminates nothing.
  // NOLINTNEXTLINE(bugprone-bad-signal-to-kill-thread): a wake-up for sigwait(), see above
  pthread_kill(waiter.native_handle(), SIGTERM);
  waiter.join();
  return 0;
}

void Service::RequestStop() {
  std::lock_guard lock(stop_mu_);
  stop_requested_ = true;
  stop_cv_.notify_all();
}

void Service::Shutdown() {
  if (shut_down_.exchange(true)) return;
  draining_ = true;
  if (rpc_) {
    log_.Info("drain step", {{"step", "requests"}});
    rpc_->Drain(std::chrono::milliseconds(cfg_.drain_timeout_ms));
  }
  for (auto& c : consumers_) c->Stop();
  for (auto& [name, step] : drains_) {
    log_.Info("drain step", {{"step", name}});
    step();
  }
  if (relay_) {
    relay_->Stop(true, std::chrono::milliseconds(cfg_.drain_timeout_ms));
    log_.Info("outbox flushed", {{"published", std::to_string(relay_->Published())}});
  }
  revocation_follower_.reset();
  if (http_) http_->Stop();
  log_.Info("service stopped");
}

void BlockTerminationSignals() {
  sigset_t set;
  sigemptyset(&set);
  sigaddset(&set, SIGINT);
  sigaddset(&set, SIGTERM);
  pthread_sigmask(SIG_BLOCK, &set, nullptr);
}

int ParseServiceArgs(int argc, char** argv, const std::string& service, config::Schema& schema) {
  // Before any thread exists, so that only Service::Run's waiter ever takes SIGINT/SIGTERM.
  BlockTerminationSignals();
  std::string path;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    if ((a == "--config" || a == "-c") && i + 1 < argc) {
      path = argv[++i];
    } else if (a.rfind("--config=", 0) == 0) {
      path = a.substr(9);
    } else if (a == "--print-config") {
      std::cout << schema.Describe();
      return 0;
    } else if (a == "--help" || a == "-h") {
      std::cout << fmt::format(
          "usage: gpuaas-{} [--config FILE] [--print-config]\n"
          "Every key can be overridden by GPUAAS_<KEY> (dots become _), e.g. GPUAAS_NATS_URL.\n",
          service);
      return 0;
    } else {
      std::cerr << "unknown argument: " << a << "\n";
      return 2;
    }
  }
  auto r = schema.Load(path, config::ProcessEnv());
  if (!r.ok()) {
    std::cerr << "gpuaas-" << service << ": " << r.error().message << "\n";
    return 2;
  }
  return -1;
}

}  // namespace gpuaas::runtime
