#include "gpuaas/common/outbox.hpp"

#include <google/protobuf/any.pb.h>
#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>
#include <prometheus/counter.h>
#include <prometheus/histogram.h>
#include <prometheus/registry.h>

#include <chrono>
#include <optional>

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/event.pb.h"

namespace gpuaas::outbox {

namespace {
thread_local v1::Principal* t_actor = nullptr;
}  // namespace

ActorScope::ActorScope(v1::Principal actor) : previous_(t_actor), actor_(std::move(actor)) {
  t_actor = &actor_;
}
ActorScope::~ActorScope() { t_actor = previous_; }
const v1::Principal* CurrentActor() { return t_actor; }
void SetActorReason(const std::string& reason) {
  if (t_actor != nullptr) t_actor->set_reason(reason);
}

v1::Event MakeEvent(const EventSpec& spec) {
  v1::Event ev;
  ev.set_id(ids::NewUuidV7());
  ev.set_specversion("1.0");
  ev.set_type(spec.type.empty() ? DefaultType(spec.nats_subject) : spec.type);
  ev.set_source(spec.source);
  ev.set_subject(spec.entity);
  // TimeUtil::GetCurrentTime() has whole seconds only; the audit orders events by this time.
  *ev.mutable_time() = google::protobuf::util::TimeUtil::NanosecondsToTimestamp(
      std::chrono::duration_cast<std::chrono::nanoseconds>(
          std::chrono::system_clock::now().time_since_epoch())
          .count());
  ev.set_generation(spec.generation);
  ev.set_correlation_id(spec.correlation_id);
  if (spec.data) ev.mutable_data()->PackFrom(*spec.data);
  if (spec.actor != nullptr) {
    *ev.mutable_actor() = *spec.actor;
  } else if (const v1::Principal* current = CurrentActor(); current != nullptr) {
    *ev.mutable_actor() = *current;
  } else {
    ev.mutable_actor()->set_subject("service:" + spec.source.substr(0, spec.source.find('/')));
  }
  return ev;
}

std::string DefaultType(const std::string& nats_subject) {
  const std::string evt = "gpuaas.v1.evt.";
  if (nats_subject.rfind(evt, 0) == 0) return "gpuaas.v1." + nats_subject.substr(evt.size());
  // gpuaas.v1.node.<id>.<kind>: the type does not depend on which node.
  std::vector<std::string> tokens;
  for (size_t start = 0; start <= nats_subject.size();) {
    const size_t dot = std::min(nats_subject.find('.', start), nats_subject.size());
    tokens.push_back(nats_subject.substr(start, dot - start));
    start = dot + 1;
  }
  if (tokens.size() == 5 && tokens[2] == "node") {
    return tokens[0] + "." + tokens[1] + "." + tokens[2] + "." + tokens[4];
  }
  return nats_subject;
}

Result<std::string> Append(pqxx::work& tx, const EventSpec& spec) { return Append(tx, spec, ""); }

namespace {

Result<void> CheckSubject(const EventSpec& spec) {
  if (spec.nats_subject.rfind("gpuaas.v1.evt.", 0) != 0 &&
      spec.nats_subject.rfind("gpuaas.v1.node.", 0) != 0) {
    return Error::Internal(reason::kBadEventSubject,
                           "the outbox publishes events (gpuaas.v1.evt.>) and node tasks "
                           "(gpuaas.v1.node.>), not " +
                               spec.nats_subject);
  }
  return Ok();
}

}  // namespace

Result<std::string> Append(pqxx::work& tx, const EventSpec& spec, const std::string& msg_id) {
  if (auto ok = CheckSubject(spec); !ok.ok()) return ok.error();
  const v1::Event ev = MakeEvent(spec);
  const std::string payload = ev.SerializeAsString();
  pqxx::binarystring blob(payload.data(), payload.size());
  store::Prepared(
      tx,
      "INSERT INTO outbox (event_id, subject, payload, traceparent, msg_id) VALUES ($1, $2, $3, "
      "$4, NULLIF($5, ''))",
      ev.id(), spec.nats_subject, blob,
      spec.traceparent.empty() ? ids::NewTraceparent() : spec.traceparent, msg_id);
  // Delivered at commit; several NOTIFYs in one transaction fold into one.
  tx.exec0(fmt::format("NOTIFY {}", kNotifyChannel));
  return ev.id();
}

Result<std::vector<std::string>> AppendMany(pqxx::work& tx, const std::vector<EventSpec>& specs) {
  std::vector<std::string> ids;
  if (specs.empty()) return ids;
  store::ArrayColumns rows(4, {2});
  for (const auto& spec : specs) {
    if (auto ok = CheckSubject(spec); !ok.ok()) return ok.error();
    const v1::Event ev = MakeEvent(spec);
    ids.push_back(ev.id());
    rows.Add({ev.id(), spec.nats_subject, ev.SerializeAsString(),
              spec.traceparent.empty() ? ids::NewTraceparent() : spec.traceparent});
  }
  // WITH ORDINALITY: the rows get their seq in the order given.
  rows.Exec(tx,
            "INSERT INTO outbox (event_id, subject, payload, traceparent) SELECT e::uuid, s, p, t "
            "FROM unnest($1::text[], $2::text[], $3::bytea[], $4::text[]) WITH ORDINALITY "
            "AS x(e, s, p, t, n) ORDER BY n");
  tx.exec0(fmt::format("NOTIFY {}", kNotifyChannel));
  return ids;
}

struct Relay::Metrics {
  prometheus::Counter* published = nullptr;
  prometheus::Counter* errors = nullptr;
  prometheus::Histogram* lag = nullptr;
};

namespace {
class Receiver : public pqxx::notification_receiver {
 public:
  Receiver(pqxx::connection_base& c, const std::string& channel)
      : pqxx::notification_receiver(c, channel) {}
  void operator()(const std::string& /*payload*/, int /*backend_pid*/) override {}
};
}  // namespace

Relay::Relay(std::string dsn, std::shared_ptr<messaging::Connection> conn,
             const log::Logger& logger, prometheus::Registry* metrics, RelayOptions opts)
    : dsn_(std::move(dsn)),
      conn_(std::move(conn)),
      log_(logger.With({{"component", "outbox_relay"}})),
      opts_(opts),
      metrics_(std::make_shared<Metrics>()) {
  if (metrics) {
    metrics_->published = &prometheus::BuildCounter()
                               .Name("gpuaas_outbox_published_total")
                               .Help("Outbox events published to JetStream")
                               .Register(*metrics)
                               .Add({});
    metrics_->errors = &prometheus::BuildCounter()
                            .Name("gpuaas_outbox_errors_total")
                            .Help("Outbox relay batches that failed")
                            .Register(*metrics)
                            .Add({});
    metrics_->lag = &prometheus::BuildHistogram()
                         .Name("gpuaas_outbox_lag_seconds")
                         .Help("Time from outbox insert to JetStream ack")
                         .Register(*metrics)
                         .Add({}, prometheus::Histogram::BucketBoundaries{
                                      0.0005, 0.001, 0.002, 0.005, 0.01, 0.05, 0.1, 1, 10});
  }
}

Relay::~Relay() { Stop(false, std::chrono::milliseconds(0)); }

void Relay::Start() {
  stop_ = false;
  thread_ = std::thread([this] { Loop(); });
}

void Relay::Stop(bool flush, std::chrono::milliseconds timeout) {
  if (!thread_.joinable()) return;
  flush_ = flush;
  flush_deadline_ = std::chrono::steady_clock::now() + timeout;
  stop_ = true;
  thread_.join();
}

Result<int> Relay::RunBatch(pqxx::connection& c) {
  // One publisher at a time keeps the stream in outbox order across relay replicas: the leader
  // holds a session advisory lock for as long as its connection lives; the others retry on
  // every wake-up and take over when the leader's connection goes away. No transaction is
  // needed on the hot path: the leader alone reads and marks rows.
  if (!leader_) {
    pqxx::nontransaction nt(c);
    leader_ =
        nt.exec1("SELECT pg_try_advisory_lock(hashtext('gpuaas_outbox_relay'))")[0].as<bool>();
    if (!leader_) return 0;
    log_.Info("outbox relay is the publishing leader");
  }
  pqxx::nontransaction nt(c);
  auto rows = nt.exec_prepared("gpuaas_outbox_fetch", opts_.batch);
  if (rows.empty()) return 0;
  std::vector<int64_t> done;
  done.reserve(rows.size());
  std::optional<Error> failure;
  for (const auto& row : rows) {
    const std::string event_id = row[1].as<std::string>();
    pqxx::binarystring payload(row[3]);
    messaging::Headers h{{messaging::kHeaderTraceparent, row[4].as<std::string>()}};
    auto ack = messaging::JsPublish(*conn_, row[2].as<std::string>(), payload.str(),
                                    row[6].as<std::string>(), h);
    if (!ack.ok()) {
      failure = ack.error();
      break;
    }
    if (after_publish) after_publish(event_id);
    done.push_back(row[0].as<int64_t>());
    if (metrics_->lag) {
      const double now =
          std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch())
              .count();
      metrics_->lag->Observe(std::max(0.0, now - row[5].as<double>()));
    }
  }
  if (!done.empty()) {
    std::string ids = "{";
    for (size_t i = 0; i < done.size(); ++i) ids += (i ? "," : "") + std::to_string(done[i]);
    ids += "}";
    nt.exec_prepared("gpuaas_outbox_mark", ids);
    published_ += done.size();
    if (metrics_->published) metrics_->published->Increment(static_cast<double>(done.size()));
  }
  if (failure) return *failure;
  return static_cast<int>(done.size());
}

void Relay::Loop() {
  std::unique_ptr<pqxx::connection> c;
  std::unique_ptr<Receiver> receiver;
  int64_t backoff_ms = 100;
  auto last_cleanup = std::chrono::steady_clock::now();
  auto last_batch = std::chrono::steady_clock::time_point{};
  bool woken = true;
  while (true) {
    if (stop_ && (!flush_ || std::chrono::steady_clock::now() >= flush_deadline_)) break;
    if (!c) {
      try {
        c = store::Connect(dsn_);
        // A lost mark only causes a re-publish, which JetStream de-duplicates by
        // Nats-Msg-Id, so marking need not wait for the WAL flush.
        c->set_variable("synchronous_commit", "off");
        // The outbox is a queue: its fetch and mark must walk indexes whatever the planner
        // thinks of the table. Plans made while it was young (few rows, no statistics) scanned
        // it on every mark from then on (a 30 s benchmark: 1,108 sequential scans reading 2.1 M
        // rows, 0.81 ms per mark of 3 rows), and a fetch planned as a bitmap scan visited the
        // index entry of every row marked since the last vacuum (0.65-1.6 ms per fetch). An
        // index scan of outbox_unpublished in seq order skips those entries once seen dead.
        c->set_variable("enable_seqscan", "off");
        c->set_variable("enable_bitmapscan", "off");
        c->prepare("gpuaas_outbox_fetch",
                   "SELECT seq, event_id::text, subject, payload, traceparent, "
                   "extract(epoch from created_at)::float8, COALESCE(msg_id, event_id::text) "
                   "FROM outbox "
                   "WHERE published_at IS NULL ORDER BY seq LIMIT $1");
        c->prepare("gpuaas_outbox_mark",
                   "UPDATE outbox SET published_at = now() WHERE seq = ANY($1::bigint[])");
        leader_ = false;
        receiver = std::make_unique<Receiver>(*c, kNotifyChannel);
        backoff_ms = 100;
        woken = true;
      } catch (const std::exception& e) {
        receiver.reset();
        c.reset();
        if (stop_) break;
        log_.Warn("relay cannot reach the database", {{"error", e.what()}});
        std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
        backoff_ms = std::min<int64_t>(backoff_ms * 2, 2000);
        continue;
      }
    }
    const auto now = std::chrono::steady_clock::now();
    if (woken || stop_ || now - last_batch >= std::chrono::milliseconds(opts_.idle_poll_ms)) {
      last_batch = now;
      Result<int> r = 0;  // RunBatch or the exception sets it
      try {
        r = RunBatch(*c);
      } catch (const std::exception& e) {
        bool retry = false;
        bool broken = false;
        r = store::FromException(e, &retry, &broken);
        if (broken || !c->is_open()) {
          receiver.reset();
          c.reset();
        }
      }
      if (!r.ok()) {
        if (metrics_->errors) metrics_->errors->Increment();
        log_.Warn("relay batch failed", {{"error", r.error().ToString()}});
        if (stop_ && !conn_->Connected()) break;
        std::this_thread::sleep_for(std::chrono::milliseconds(backoff_ms));
        backoff_ms = std::min<int64_t>(backoff_ms * 2, 2000);
        woken = true;
        continue;
      }
      backoff_ms = 100;
      if (*r >= opts_.batch) continue;  // more may be waiting
      if (stop_) break;                 // flushed everything committed so far
    }
    if (now - last_cleanup > std::chrono::minutes(5)) {
      last_cleanup = now;
      try {
        pqxx::work tx(*c);
        tx.exec_params("DELETE FROM outbox WHERE published_at < now() - make_interval(secs => $1)",
                       static_cast<double>(opts_.retain_published_s));
        tx.commit();
      } catch (const std::exception& e) {
        log_.Warn("outbox cleanup failed", {{"error", e.what()}});
      }
    }
    try {
      // Short waits so Stop() is seen promptly; a NOTIFY ends the wait at once.
      woken = c->await_notification(0, 200000) > 0;
    } catch (const std::exception& e) {
      receiver.reset();
      c.reset();
    }
  }
}

}  // namespace gpuaas::outbox
