#include "gpuaas/scheduler/saga.hpp"

#include <google/protobuf/util/time_util.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <map>
#include <set>

#include <fmt/format.h>

#include "allocation_rows.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/inbox.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/ingress.pb.h"
#include "gpuaas/v1/node.pb.h"
#include "lifecycle.hpp"
#include "saga_store.hpp"
#include "scheduler_metrics.hpp"
#include "scheduler_reasons.hpp"

namespace gpuaas::scheduler {

namespace {

using google::protobuf::util::TimeUtil;
using lifecycle::Event;

// Why the allocation failed, when the transition records a failure.
struct Cause {
  std::string code;
  std::string detail;
};

Result<std::string> SendTask(pqxx::work& tx, const v1::Allocation& a, v1::NodeTask t, int attempt,
                             int64_t deadline_s, const SagaOptions& opts,
                             const std::string& traceparent) {
  t.set_task_id(ids::NewUuidV7());
  t.set_node_id(a.node_id());
  *t.mutable_deadline() = TimeUtil::GetCurrentTime() + TimeUtil::SecondsToDuration(deadline_s);
  t.set_correlation_id(a.allocation_id());
  t.set_requested_by(opts.source);
  const std::string& type = enums::Text(t.type());
  InsertTask(tx, t.task_id(), a.allocation_id(), a.node_id(), t.type(), attempt, deadline_s);
  auto ev = outbox::Append(
      tx,
      {fmt::format("gpuaas.v1.node.{node_id}.task", fmt::arg("node_id", a.node_id())), "",
       opts.source, a.node_id(), 0, a.allocation_id(), traceparent, &t},
      fmt::format("{}.{}.{}", a.allocation_id(), type, attempt));
  if (!ev.ok()) return ev.error();
  AddTimeline(
      tx, a.allocation_id(),
      {v1::TIMELINE_STEP_TASK_SENT, a.state(), t.task_id(), t.type(), v1::TASK_STAGE_UNSPECIFIED,
       "", fmt::format("attempt {} to {}, deadline {}s", attempt, a.node_id(), deadline_s)});
  return t.task_id();
}

Result<std::string> SendCleanup(pqxx::work& tx, const v1::Allocation& a, const SagaOptions& opts,
                                const std::string& traceparent) {
  v1::NodeTask t;
  t.set_type(v1::TASK_TYPE_SLOT_CLEANUP);
  auto* p = t.mutable_slot_cleanup();
  p->set_allocation_id(a.allocation_id());
  for (auto& s : BundleSlots(tx, a.allocation_id(), nullptr, nullptr, nullptr, nullptr)) {
    *p->add_slots() = std::move(s);
  }
  const int attempt = NextAttempt(tx, a.allocation_id(), t.type());
  return SendTask(tx, a, std::move(t), attempt, opts.cleanup_deadline_s, opts, traceparent);
}

Result<std::string> SendRelease(pqxx::work& tx, const v1::Allocation& a, const SagaOptions& opts,
                                const std::string& traceparent) {
  v1::NodeTask t;
  t.set_type(v1::TASK_TYPE_VM_RELEASE);
  auto* p = t.mutable_vm_release();
  p->set_allocation_id(a.allocation_id());
  for (const auto& k : a.slot_keys()) p->add_slot_keys(k);
  p->set_graceful_timeout_s(60);
  const int attempt = NextAttempt(tx, a.allocation_id(), t.type());
  return SendTask(tx, a, std::move(t), attempt, opts.release_deadline_s, opts, traceparent);
}

// vm.provision with the concrete host bundle of `a`'s claims (attempt 1, from the create).
Result<std::string> SendProvision(pqxx::work& tx, const v1::Allocation& a,
                                  const v1::CreateAllocationRequest& req, const Sku& sku,
                                  const Image* image, const SagaOptions& opts,
                                  const std::string& traceparent) {
  v1::NodeTask t;
  t.set_type(v1::TASK_TYPE_VM_PROVISION);
  auto& b = *t.mutable_vm_provision();
  b.set_allocation_id(a.allocation_id());
  b.set_attempt(1);
  b.set_tenant(a.tenant());
  b.set_network_mode(a.network_mode());
  std::vector<int> vcpus, huge;
  std::vector<int64_t> mem;
  std::string profile;
  std::set<int> numas;
  bool numa_known = true;
  for (auto& s : BundleSlots(tx, a.allocation_id(), &vcpus, &mem, &huge, &profile)) {
    if (s.has_numa_node()) {
      numas.insert(s.numa_node());
    } else {
      numa_known = false;
    }
    *b.add_slots() = std::move(s);
  }
  auto* shape = b.mutable_shape();
  shape->set_profile(profile.empty() ? sku.name : profile);
  for (size_t i = 0; i < vcpus.size(); ++i) {
    shape->set_vcpus(shape->vcpus() + (vcpus[i] > 0 ? vcpus[i] : sku.vcpus_per_gpu));
    shape->set_memory_mib(shape->memory_mib() + (mem[i] > 0 ? mem[i] : sku.memory_mib_per_gpu));
    shape->set_hugepages_1g(shape->hugepages_1g() + huge[i]);
  }
  if (numa_known && numas.size() == 1) shape->set_numa_node(*numas.begin());
  if (image) {
    b.mutable_image()->set_name(image->name);
    b.mutable_image()->set_url(image->url);
    b.mutable_image()->set_sha256(image->sha256);
  }
  auto* ci = b.mutable_cloud_init();
  ci->set_hostname(req.hostname().empty() ? "slice-" + a.allocation_id().substr(0, 8)
                                          : req.hostname());
  ci->set_instance_id(a.allocation_id());
  for (const auto& k : req.ssh_authorized_keys()) ci->add_ssh_authorized_keys(k);
  RecordProvisionInputs(tx, a.allocation_id(), b.image().name(), ci->hostname(),
                        {req.ssh_authorized_keys().begin(), req.ssh_authorized_keys().end()});
  return SendTask(tx, a, std::move(t), 1, opts.provision_deadline_s, opts, traceparent);
}

// What the saga needs besides the allocation: everything else comes from the lifecycle table.
// `step_detail` is the detail of the table's own timeline row (claims freed, force release).
struct Applied {
  const v1::Allocation* a = nullptr;
  const v1::CreateAllocationRequest* req = nullptr;  // kStart
  const Sku* sku = nullptr;                          // kStart
  const Image* image = nullptr;                      // kStart
  Cause cause;
  std::string step_detail;
  std::string task_id;  // the task whose outcome this is, for the table's own rows
  v1::TaskType task_type = v1::TASK_TYPE_UNSPECIFIED;
};

// Applies one transition's effects in order: cancel tasks, claims, the table's timeline row, the
// state (new generation + event when announced), then the node tasks to send.
Result<v1::Allocation> Apply(pqxx::work& tx, const lifecycle::Effects& fx, const Applied& in,
                             const SagaOptions& opts, const std::string& traceparent) {
  const v1::Allocation& a = *in.a;
  const std::string& id = a.allocation_id();
  if (fx.noop || fx.late) return a;
  if (fx.cancel_open_tasks) CancelOpenTasks(tx, id);
  int freed = 0;
  if (fx.claims == lifecycle::Claims::kFree) freed = FreeClaims(tx, id);
  if (freed > 0) {
    // The last claim on a draining node: inventory marks it drained.
    if (auto r = AnnounceIfEmptied(tx, a.node_id(), opts.source, traceparent); !r.ok()) {
      return r.error();
    }
  }
  if (fx.claims == lifecycle::Claims::kSetPhase) SetClaimPhase(tx, id, fx.phase);
  if (fx.step != v1::TIMELINE_STEP_UNSPECIFIED) {
    std::string detail = in.step_detail;
    if (detail.empty() && fx.step == v1::TIMELINE_STEP_CLAIMS_FREED) {
      detail = fmt::format("{} claim(s) freed", freed);
    }
    if (fx.step == v1::TIMELINE_STEP_FORCE_RELEASED && fx.claims == lifecycle::Claims::kFree) {
      detail = fmt::format(
          "an admin force-released {} claim(s) from state {}; no host task had been sent", freed,
          enums::Text(a.state()));
    } else if (fx.step == v1::TIMELINE_STEP_FORCE_RELEASED) {
      detail = fmt::format(
          "an admin force-released it from state {}: tasks in flight cancelled, {} sent; the "
          "claims are freed by the cleanup proof (a node that does not answer leaves them "
          "cleanup_blocked until `gpuaasctl slot repair` once it answers)",
          enums::Text(a.state()), fx.send.empty() ? "nothing" : enums::Text(fx.send.front()));
    }
    AddTimeline(
        tx, id,
        {fx.step, fx.state, in.task_id, in.task_type, v1::TASK_STAGE_UNSPECIFIED,
         fx.step == v1::TIMELINE_STEP_FORCE_RELEASED ? reason::kForceReleased.str() : "", detail});
  }
  v1::Allocation after = a;
  if (fx.announce) {
    std::string stage, code, detail;
    if (fx.failure == lifecycle::FailureChange::kSet) {
      stage = enums::Text(fx.failure_stage);
      code = in.cause.code;
      detail = in.cause.detail;
    }
    SetAllocationState(tx, id, fx.state, fx.failure != lifecycle::FailureChange::kKeep, stage, code,
                       detail);
    auto loaded = LoadAllocation(tx, id, false);
    if (!loaded.ok()) return loaded.error();
    if (auto e = Announce(tx, *loaded, opts.source, traceparent); !e.ok()) return e.error();
    after = std::move(*loaded);
    if (opts.metrics && fx.state == v1::ALLOCATION_STATE_ACTIVE) opts.metrics->Activated(after);
  }
  for (auto type : fx.send) {
    Result<std::string> sent = std::string();
    switch (type) {
      case v1::TASK_TYPE_VM_PROVISION:
        sent = SendProvision(tx, after, *in.req, *in.sku, in.image, opts, traceparent);
        break;
      case v1::TASK_TYPE_VM_RELEASE:
        sent = SendRelease(tx, after, opts, traceparent);
        break;
      case v1::TASK_TYPE_SLOT_CLEANUP:
        sent = SendCleanup(tx, after, opts, traceparent);
        break;
      default:
        return Error::Internal(reason::kUnexpectedTask,
                               "the lifecycle has no task " + enums::Text(type));
    }
    if (!sent.ok()) return sent.error();
  }
  if (!fx.send.empty() && !fx.announce) return LoadAllocation(tx, id, false);
  return after;
}

// A task's outcome as the saga sees it.
enum class Verdict { kSucceeded, kFailed, kRejected, kTimedOut };

// The task row's status for a verdict (its text names the verdict in timeline details too).
TaskStatus VerdictStatus(Verdict v) {
  switch (v) {
    case Verdict::kSucceeded:
      return TaskStatus::kSucceeded;
    case Verdict::kFailed:
      return TaskStatus::kFailed;
    case Verdict::kRejected:
      return TaskStatus::kRejected;
    case Verdict::kTimedOut:
      return TaskStatus::kTimedOut;
  }
  return TaskStatus::kFailed;
}

std::string_view VerdictText(Verdict v) { return TaskStatusText(VerdictStatus(v)); }

// The failure code of a task that did not succeed and whose node gave no reason.
Reason VerdictReason(Verdict v) {
  switch (v) {
    case Verdict::kRejected:
      return reason::kTaskRejected;
    case Verdict::kTimedOut:
      return reason::kTaskTimedOut;
    case Verdict::kSucceeded:
    case Verdict::kFailed:
      break;
  }
  return reason::kTaskFailed;
}

v1::TimelineStep VerdictStep(Verdict v) {
  switch (v) {
    case Verdict::kSucceeded:
      return v1::TIMELINE_STEP_TASK_SUCCEEDED;
    case Verdict::kRejected:
      return v1::TIMELINE_STEP_TASK_REJECTED;
    case Verdict::kTimedOut:
      return v1::TIMELINE_STEP_TASK_TIMED_OUT;
    case Verdict::kFailed:
      return v1::TIMELINE_STEP_TASK_FAILED;
  }
  return v1::TIMELINE_STEP_TASK_FAILED;
}

struct Outcome {
  Verdict verdict = Verdict::kFailed;
  v1::TaskStage stage = v1::TASK_STAGE_UNSPECIFIED;
  std::string code;
  std::string detail;
  const v1::NodeTaskResult* result = nullptr;  // null when timed out
};

// Proof check: every live claim of the allocation has a clean proof.
std::string ProofProblem(pqxx::work& tx, const std::string& allocation_id,
                         const v1::CleanupOutput& out) {
  std::map<std::string, const v1::CleanupProof*> proofs;
  for (const auto& p : out.proofs()) proofs[p.slot_key()] = &p;
  for (const auto& key : LiveSlotKeys(tx, allocation_id)) {
    auto it = proofs.find(key);
    if (it == proofs.end()) return "no cleanup proof for slot " + key;
    const auto& p = *it->second;
    if (p.signatures_remaining()) return "slot " + key + ": signatures remain on the disk";
    if (!p.domain_undefined()) return "slot " + key + ": the domain is still defined";
    if (!p.network_state_removed()) return "slot " + key + ": DHCP/NAT state not removed";
    if (!p.exposure_state_removed()) {
      return "slot " + key + ": a public exposure still maps to it on the node";
    }
  }
  return "";
}

// What a finished (or timed-out) task means for its allocation: the lifecycle table decides,
// this writes the task's own timeline row and applies the effects. The caller holds the
// allocation row lock and has marked the task row.
Result<void> OnOutcome(pqxx::work& tx, const v1::Allocation& a, const TaskRow& task,
                       const Outcome& o, const SagaOptions& opts, const std::string& traceparent) {
  const bool ok = o.verdict == Verdict::kSucceeded;
  Event event{};
  std::string detail = o.detail;
  std::string code = o.code;
  v1::TimelineStep step = VerdictStep(o.verdict);
  switch (task.type) {
    case v1::TASK_TYPE_VM_PROVISION:
      event = ok ? Event::kProvisionSucceeded : Event::kProvisionFailed;
      if (ok && o.result) {
        const auto& out = o.result->vm_provision();
        detail = fmt::format("domain {} up, {} at {} (lease {}, {} runtime)", out.domain_name(),
                             out.mac(), out.actual_ip(), enums::Text(out.lease_state()),
                             enums::Text(out.runtime()));
      }
      break;
    case v1::TASK_TYPE_VM_RELEASE:
      event = ok ? Event::kReleaseSucceeded : Event::kReleaseFailed;
      if (ok && o.result) {
        const auto& out = o.result->vm_release();
        detail = fmt::format("domain {} stopped ({})", out.domain_name(), enums::Text(out.stop()));
      }
      break;
    case v1::TASK_TYPE_SLOT_CLEANUP: {
      std::string problem;
      if (ok) {
        if (!o.result || !o.result->has_slot_cleanup()) {
          problem = "the cleanup result carries no CleanupOutput";
        } else {
          problem = ProofProblem(tx, a.allocation_id(), o.result->slot_cleanup());
        }
      }
      event = ok && problem.empty() ? Event::kCleanupProved : Event::kCleanupFailed;
      if (ok && problem.empty()) {
        detail = fmt::format("cleanup proof for every slot ({} runtime)",
                             enums::Text(o.result->slot_cleanup().runtime()));
      } else {
        if (!problem.empty()) {
          code = reason::kCleanupProofIncomplete.str();
          detail = problem;
          step = v1::TIMELINE_STEP_TASK_FAILED;
        }
        detail += " (slots stay cleanup_blocked)";
      }
      break;
    }
    default:
      return Error::InvalidArgument(reason::kTaskTypeInvalid,
                                    "the scheduler sends no task " + enums::Text(task.type));
  }
  lifecycle::Context ctx;
  ctx.baremetal = a.shape() == v1::CAPACITY_SHAPE_BAREMETAL;
  ctx.endpoints_pending = EndpointsPending(tx, a.allocation_id());
  ctx.vm_ready = a.vm_ready() || (ok && task.type == v1::TASK_TYPE_VM_PROVISION);
  ctx.current_attempt = task.type != v1::TASK_TYPE_VM_PROVISION || task.attempt == a.attempt();
  auto fx = lifecycle::Next(a.state(), event, ctx);
  if (!fx.ok()) return fx.error();
  if (fx->late) {
    AddTimeline(tx, a.allocation_id(),
                {v1::TIMELINE_STEP_LATE_RESULT, a.state(), task.task_id, task.type, o.stage, o.code,
                 fmt::format("{} for attempt {} ignored: the allocation is {}",
                             VerdictText(o.verdict), task.attempt, enums::Text(a.state()))});
    return Ok();
  }
  if (ok && task.type == v1::TASK_TYPE_VM_PROVISION && o.result) {
    RecordObservedNetwork(tx, a.allocation_id(), o.result->vm_provision());
  }
  AddTimeline(tx, a.allocation_id(),
              {step, fx->state, task.task_id, task.type, o.stage, code, detail});
  Applied in;
  in.a = &a;
  in.cause = {code, o.detail.empty() ? detail : o.detail};
  if (task.type == v1::TASK_TYPE_SLOT_CLEANUP && event == Event::kCleanupFailed) {
    in.cause.detail = detail;
  }
  in.task_id = task.task_id;
  in.task_type = task.type;
  if (fx->step == v1::TIMELINE_STEP_CLAIMS_FREED) {
    in.step_detail = "claim(s) freed on cleanup proof";
  }
  auto applied = Apply(tx, *fx, in, opts, traceparent);
  if (!applied.ok()) return applied.error();
  return Ok();
}

}  // namespace

Result<v1::Allocation> StartLifecycle(pqxx::work& tx, const v1::Allocation& a,
                                      const v1::CreateAllocationRequest& req, const Sku& sku,
                                      const Image* image, const SagaOptions& opts,
                                      const std::string& traceparent) {
  lifecycle::Context ctx;
  ctx.baremetal = a.shape() == v1::CAPACITY_SHAPE_BAREMETAL;
  auto fx = lifecycle::Next(a.state(), Event::kStart, ctx);
  if (!fx.ok()) return fx.error();
  Applied in;
  in.a = &a;
  in.req = &req;
  in.sku = &sku;
  in.image = image;
  if (ctx.baremetal) {
    in.step_detail =
        "baremetal: the node is handed over as placed (no host task: bare-metal imaging is "
        "outside this product slice)";
  }
  return Apply(tx, *fx, in, opts, traceparent);
}

Result<v1::Allocation> ReleaseAllocation(pqxx::work& tx, const std::string& allocation_id,
                                         bool force, const SagaOptions& opts,
                                         const std::string& traceparent,
                                         const std::string& tenant_scope) {
  auto a = LoadAllocation(tx, allocation_id, true, tenant_scope);
  if (!a.ok()) return a.error();
  lifecycle::Context ctx;
  ctx.baremetal = a->shape() == v1::CAPACITY_SHAPE_BAREMETAL;
  ctx.has_live_claims = HasLiveClaims(tx, allocation_id);
  ctx.task_open = HasOpenTask(tx, allocation_id);
  auto fx =
      lifecycle::Next(a->state(), force ? Event::kForceRelease : Event::kReleaseRequested, ctx);
  if (!fx.ok()) return fx.error();
  // Who asked, and why: kept on the allocation (every later snapshot, the releasing one too,
  // shows it). A repeated request changes nothing, not even who asked.
  if (!fx->noop) {
    v1::Principal internal;
    internal.set_subject("internal");
    const v1::Principal* actor = outbox::CurrentActor();
    const v1::Principal& by = actor != nullptr ? *actor : internal;
    RecordReleaseActor(tx, allocation_id, by);
    *a->mutable_release_requested_by() = by;
  }
  Applied in;
  in.a = &*a;
  if (force) {
    in.cause = {reason::kForceReleased.str(),
                "force-released by " +
                    (outbox::CurrentActor() != nullptr ? outbox::CurrentActor()->subject()
                                                       : std::string("an operator")) +
                    " from state " + enums::Text(a->state()) +
                    (outbox::CurrentActor() != nullptr && !outbox::CurrentActor()->reason().empty()
                         ? ": " + outbox::CurrentActor()->reason()
                         : "")};
  } else if (fx->step == v1::TIMELINE_STEP_CLAIMS_FREED) {
    in.step_detail = "claim(s) freed: no host task was involved";
  }
  return Apply(tx, *fx, in, opts, traceparent);
}

Result<void> ApplyNodeTaskEvent(pqxx::work& tx, const v1::Event& ev, const SagaOptions& opts) {
  if (ev.data().Is<v1::NodeTaskProgress>()) {
    v1::NodeTaskProgress p;
    if (!ev.data().UnpackTo(&p)) {
      return Error::InvalidArgument(reason::kMalformedEvent, "progress without a NodeTaskProgress");
    }
    if (!ids::IsUuid(p.task_id())) return Ok();
    auto task = FindTask(tx, p.task_id(), false);
    if (!task) return Ok();  // not a task of this scheduler
    auto a = LoadAllocation(tx, task->allocation_id, true);
    if (!a.ok()) return a.error();
    auto fresh = FindTask(tx, p.task_id(), false);
    // Progress after the result: history.
    if (!fresh || fresh->status != TaskStatus::kSent) return Ok();
    AddTimeline(tx, a->allocation_id(),
                {v1::TIMELINE_STEP_TASK_PROGRESS, a->state(), p.task_id(), p.type(), p.stage(), "",
                 p.detail(), p.percent()});
    return Ok();
  }
  v1::NodeTaskResult res;
  if (!ev.data().UnpackTo(&res)) {
    return Error::InvalidArgument(reason::kMalformedEvent, "task event without a NodeTaskResult");
  }
  if (!ids::IsUuid(res.task_id())) return Ok();
  auto task = FindTask(tx, res.task_id(), false);
  if (!task) return Ok();
  // Lock order everywhere: allocation row, then task row.
  auto a = LoadAllocation(tx, task->allocation_id, true);
  if (!a.ok()) return a.error();
  task = FindTask(tx, res.task_id(), true);
  const Verdict verdict = res.status() == v1::TASK_STATUS_SUCCEEDED  ? Verdict::kSucceeded
                          : res.status() == v1::TASK_STATUS_REJECTED ? Verdict::kRejected
                                                                     : Verdict::kFailed;
  Outcome o{verdict, res.stage(), res.error().reason(), res.error().message(), &res};
  if (task->status != TaskStatus::kSent) {
    AddTimeline(
        tx, a->allocation_id(),
        {v1::TIMELINE_STEP_LATE_RESULT, a->state(), task->task_id, task->type, o.stage, o.code,
         fmt::format("{} arrived after the task was {}", VerdictText(verdict),
                     task->status ? TaskStatusText(*task->status) : "unknown")});
    return Ok();
  }
  FinishTask(tx, task->task_id, VerdictStatus(verdict), o.code, o.detail);
  if (o.code.empty() && verdict != Verdict::kSucceeded) o.code = VerdictReason(verdict).str();
  return OnOutcome(tx, *a, *task, o, opts, "");
}

Result<void> ApplyExposureEvent(pqxx::work& tx, const v1::Event& ev, const SagaOptions& opts) {
  v1::ExposureSnapshot snap;
  if (!ev.data().UnpackTo(&snap)) {
    return Error::InvalidArgument(reason::kMalformedEvent,
                                  "event data is not a gpuaas.v1.ExposureSnapshot");
  }
  const auto& e = snap.exposure();
  if (!ids::IsUuid(e.allocation_id()) || !ids::IsUuid(e.exposure_id())) {
    return Error::InvalidArgument(reason::kMalformedEvent, "exposure event without ids");
  }
  auto a = LoadAllocation(tx, e.allocation_id(), true);
  if (!a.ok()) {
    if (a.error().code == Code::kNotFound) return Ok();  // not one of this scheduler's
    return a.error();
  }
  const int64_t generation = ev.generation() > 0 ? ev.generation() : e.generation();
  if (auto stored = LockEndpointExposure(tx, e.allocation_id(), e.name())) {
    const auto& [have, have_generation] = *stored;
    // UUIDv7 ids sort by creation: an older exposure of the same name is history.
    if (!have.empty() && e.exposure_id() < have) return Ok();
    if (have == e.exposure_id() && have_generation >= generation) return Ok();
  }
  UpsertEndpointExposure(tx, e, generation);
  if (a->state() != v1::ALLOCATION_STATE_PROVISIONING) return Ok();
  lifecycle::Context ctx;
  ctx.baremetal = a->shape() == v1::CAPACITY_SHAPE_BAREMETAL;
  ctx.endpoints_pending = EndpointsPending(tx, a->allocation_id());
  ctx.vm_ready = a->vm_ready();
  const bool failed = e.state() == v1::EXPOSURE_STATE_FAILED;
  if (!failed && e.state() != v1::EXPOSURE_STATE_ACTIVE) return Ok();
  auto fx =
      lifecycle::Next(a->state(), failed ? Event::kExposureFailed : Event::kExposuresReady, ctx);
  if (!fx.ok()) return fx.error();
  if (fx->noop || fx->late) return Ok();
  const std::string detail =
      failed ? fmt::format("endpoint {} ({}/{}) failed: {}", e.name(), e.target_port(),
                           enums::Text(e.protocol()), e.detail())
             : fmt::format("every endpoint applied on node {} (last: {} at {}:{})", e.node_id(),
                           e.name(), e.public_ip(), e.public_port());
  AddTimeline(
      tx, a->allocation_id(),
      {failed ? v1::TIMELINE_STEP_TASK_FAILED : v1::TIMELINE_STEP_STATE, fx->state, "",
       v1::TASK_TYPE_UNSPECIFIED, v1::TASK_STAGE_UNSPECIFIED, failed ? e.reason() : "", detail});
  Applied in;
  in.a = &*a;
  in.cause = {e.reason().empty() ? reason::kExposureFailed.str() : e.reason(), detail};
  auto applied = Apply(tx, *fx, in, opts, "");
  if (!applied.ok()) return applied.error();
  return Ok();
}

Result<int> SweepOverdueTasks(store::Pool& pool, const SagaOptions& opts, int max) {
  auto due = store::WithTx(pool, [&](pqxx::work& tx) -> Result<std::vector<std::string>> {
    return OverdueTaskIds(tx, max);
  });
  if (!due.ok()) return due.error();
  int handled = 0;
  for (const auto& id : *due) {
    auto r = store::WithTx(pool, [&](pqxx::work& tx) -> Result<bool> {
      auto task = FindTask(tx, id, false);
      if (!task) return false;
      auto a = LoadAllocation(tx, task->allocation_id, true);
      if (!a.ok()) return a.error();
      // Another replica or the result got there first.
      if (!LockOverdueTask(tx, id)) return false;
      MarkTaskTimedOut(tx, id);
      Outcome o{Verdict::kTimedOut, v1::TASK_STAGE_UNSPECIFIED, reason::kNodeUnresponsive.str(),
                fmt::format("node {} did not answer {} within its deadline", a->node_id(),
                            enums::Text(task->type)),
                nullptr};
      auto done = OnOutcome(tx, *a, *task, o, opts, "");
      if (!done.ok()) return done.error();
      return true;
    });
    if (!r.ok()) return r.error();
    handled += *r ? 1 : 0;
  }
  return handled;
}

namespace {

class Sweeper {
 public:
  Sweeper(std::shared_ptr<store::Pool> pool, SagaOptions opts, log::Logger log,
          prometheus::Registry& metrics)
      : pool_(std::move(pool)), opts_(std::move(opts)), log_(std::move(log)) {
    overdue_ = &prometheus::BuildCounter()
                    .Name("gpuaas_scheduler_node_tasks_timed_out_total")
                    .Help("Node tasks this replica failed because their deadline passed")
                    .Register(metrics)
                    .Add({});
    open_ = &prometheus::BuildGauge()
                 .Name("gpuaas_scheduler_node_tasks_open")
                 .Help("Node tasks sent and not answered yet (all replicas), by type")
                 .Register(metrics);
    thread_ = std::thread([this] { Loop(); });
  }
  ~Sweeper() { Stop(); }
  void Stop() {
    {
      std::lock_guard lock(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
  }

 private:
  void Loop() {
    std::unique_lock lock(mu_);
    while (!stop_) {
      cv_.wait_for(lock, std::chrono::milliseconds(opts_.sweep_interval_ms));
      if (stop_) break;
      lock.unlock();
      auto n = SweepOverdueTasks(*pool_, opts_);
      if (!n.ok()) {
        log_.Warn("deadline sweep failed", {{"error", n.error().ToString()}});
      } else if (*n > 0) {
        overdue_->Increment(*n);
        log_.Info("overdue node tasks failed", {{"count", std::to_string(*n)}});
      }
      auto open = store::WithTx(*pool_, [](pqxx::work& tx) -> Result<std::map<std::string, int>> {
        return OpenTasksByType(tx);
      });
      if (open.ok()) {
        for (const auto& [type, count] : *open) open_->Add({{"type", type}}).Set(count);
      }
      lock.lock();
    }
  }
  std::shared_ptr<store::Pool> pool_;
  SagaOptions opts_;
  log::Logger log_;
  prometheus::Counter* overdue_ = nullptr;
  prometheus::Family<prometheus::Gauge>* open_ = nullptr;
  std::mutex mu_;
  std::condition_variable cv_;
  bool stop_ = false;
  std::thread thread_;
};

}  // namespace

Result<void> StartSaga(runtime::Service& svc, const SagaOptions& opts) {
  auto consumer = svc.StartProjection(
      messaging::NodeEventsStream().name, kTaskConsumer, "gpuaas.v1.evt.node.*.task.>",
      [opts](pqxx::work& tx, const v1::Event& ev) { return ApplyNodeTaskEvent(tx, ev, opts); });
  if (!consumer.ok()) return consumer.error();
  auto exposures = svc.StartProjection(
      messaging::IngressEventsStream().name, kExposureConsumer, "gpuaas.v1.evt.ingress.exposure.>",
      [opts](pqxx::work& tx, const v1::Event& ev) { return ApplyExposureEvent(tx, ev, opts); });
  if (!exposures.ok()) return exposures.error();

  auto sweeper = std::make_shared<Sweeper>(svc.pg(), opts, svc.log(), svc.metrics());
  svc.OnDrain("saga-deadline-sweeper", [sweeper] { sweeper->Stop(); });
  return Ok();
}

namespace {

// A timeline page token: the seq of the last row a reply had.
Result<int64_t> ParseSeqToken(const std::string& token) {
  int64_t after = 0;
  if (!token.empty()) {
    try {
      size_t used = 0;
      after = std::stoll(token, &used);
      if (used != token.size() || after < 0) throw std::invalid_argument("");
    } catch (const std::exception&) {
      return Error::InvalidArgument(reason::kInvalidPageToken,
                                    "page_token is a seq from a timeline reply",
                                    {{"page_token", token}});
    }
  }
  return after;
}

}  // namespace

Result<v1::GetAllocationTimelineResponse> SagaHandlers::Timeline(
    const v1::GetAllocationTimelineRequest& req, rpc::Context& ctx) {
  auto page = rpc::PageLimit(req.page_size());
  if (!page.ok()) return page.error();
  auto after = ParseSeqToken(req.page_token());
  if (!after.ok()) return after.error();
  const int limit = *page;
  return store::WithTx(
      *pool_,
      [&](pqxx::work& tx) -> Result<v1::GetAllocationTimelineResponse> {
        auto a = LoadAllocation(tx, req.allocation_id(), false, ctx.TenantScope());
        if (!a.ok()) return a.error();
        v1::GetAllocationTimelineResponse resp;
        resp.set_state(a->state());
        resp.set_in_flight(HasOpenTask(tx, a->allocation_id()));
        const int64_t last = AddTimelineEntries(tx, req.allocation_id(), *after, limit, resp);
        resp.set_last_seq(std::to_string(last));
        return resp;
      },
      store::ReadSnapshot());  // the state, in_flight and entries of one moment
}

}  // namespace gpuaas::scheduler
