#include "saga.hpp"

#include <google/protobuf/util/time_util.h>
#include <prometheus/counter.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include <map>
#include <set>

#include <fmt/format.h>

#include "allocation_rows.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/inbox.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/event.pb.h"
#include "gpuaas/v1/node.pb.h"

namespace gpuaas::scheduler {

namespace {

using google::protobuf::util::TimeUtil;

constexpr const char* kProvision = "vm.provision";
constexpr const char* kRelease = "vm.release";
constexpr const char* kCleanup = "slot.cleanup";

struct Failure {
  std::string stage;
  std::string code;
  std::string detail;
};

// Moves the allocation to `state` (generation + 1), optionally records a failure (an empty
// failure code clears it) and sets the phase of its live claims; announces the new snapshot.
Result<v1::Allocation> SetState(pqxx::work& tx, const v1::Allocation& a, const std::string& state,
                                const std::optional<Failure>& failure,
                                const std::string& claim_phase, const SagaOptions& opts,
                                const std::string& traceparent) {
  tx.exec_params(
      "UPDATE allocations SET state = $2, generation = generation + 1, updated_at = now(), "
      "failure_stage = CASE WHEN $3 THEN $4 ELSE failure_stage END, "
      "failure_code = CASE WHEN $3 THEN $5 ELSE failure_code END, "
      "failure_detail = CASE WHEN $3 THEN $6 ELSE failure_detail END WHERE allocation_id = $1",
      a.allocation_id(), state, failure.has_value(), failure ? failure->stage : "",
      failure ? failure->code : "", failure ? failure->detail : "");
  if (!claim_phase.empty()) {
    tx.exec_params(
        "UPDATE allocation_resource_claims SET phase = $2 WHERE allocation_id = $1 AND "
        "released_at IS NULL",
        a.allocation_id(), claim_phase);
  }
  auto after = LoadAllocation(tx, a.allocation_id(), false);
  if (!after.ok()) return after.error();
  if (auto e = Announce(tx, *after, opts.source, traceparent); !e.ok()) return e.error();
  return after;
}

void SetClaimPhase(pqxx::work& tx, const std::string& allocation_id, const std::string& phase) {
  tx.exec_params(
      "UPDATE allocation_resource_claims SET phase = $2 WHERE allocation_id = $1 AND "
      "released_at IS NULL",
      allocation_id, phase);
}

int NextAttempt(pqxx::work& tx, const std::string& allocation_id, const std::string& type) {
  return tx
      .exec_params1(
          "SELECT COALESCE(max(attempt), 0) + 1 FROM allocation_tasks WHERE allocation_id = $1 "
          "AND type = $2",
          allocation_id, type)[0]
      .as<int>();
}

// The live slots of an allocation as the node needs them (from the slot projection).
std::vector<v1::BundleSlot> BundleSlots(pqxx::work& tx, const std::string& allocation_id,
                                        std::vector<int>* vcpus, std::vector<int64_t>* mem,
                                        std::vector<int>* huge, std::string* profile) {
  std::vector<v1::BundleSlot> out;
  for (const auto& r : tx.exec_params(
           "SELECT c.slot_key, p.gpu_pci_address, p.fabric_vf_pci_address, p.fabric_type, "
           "p.nvme_by_id, p.mac, p.private_ip, p.numa, p.vcpus_per_gpu, p.memory_mib_per_gpu, "
           "p.hugepages_1g_per_gpu, p.profile_name FROM allocation_resource_claims c "
           "LEFT JOIN projected_slots p ON p.node_id = c.node_id AND p.slot_key = c.slot_key "
           "WHERE c.allocation_id = $1 AND c.released_at IS NULL AND c.kind = 'slot' "
           "ORDER BY c.slot_key",
           allocation_id)) {
    v1::BundleSlot s;
    s.set_slot_key(r[0].as<std::string>());
    s.set_gpu_pci_address(r[1].is_null() ? "" : r[1].as<std::string>());
    s.set_fabric_vf_pci_address(r[2].is_null() ? "" : r[2].as<std::string>());
    s.set_fabric_type(r[3].is_null() ? "" : r[3].as<std::string>());
    s.set_nvme_by_id(r[4].is_null() ? "" : r[4].as<std::string>());
    s.set_mac(r[5].is_null() ? "" : r[5].as<std::string>());
    s.set_private_ip(r[6].is_null() ? "" : r[6].as<std::string>());
    if (!r[7].is_null() && r[7].as<int>() >= 0) s.set_numa_node(r[7].as<int>());
    if (vcpus) vcpus->push_back(r[8].is_null() ? 0 : r[8].as<int>());
    if (mem) mem->push_back(r[9].is_null() ? 0 : r[9].as<int64_t>());
    if (huge) huge->push_back(r[10].is_null() ? 0 : r[10].as<int>());
    if (profile && !r[11].is_null() && profile->empty()) *profile = r[11].as<std::string>();
    out.push_back(std::move(s));
  }
  return out;
}

Result<std::string> SendTask(pqxx::work& tx, const v1::Allocation& a, const std::string& type,
                             int attempt, const google::protobuf::Message& params,
                             int64_t deadline_s, const std::string& state_after,
                             const SagaOptions& opts, const std::string& traceparent) {
  v1::NodeTask t;
  t.set_task_id(ids::NewUuidV7());
  t.set_node_id(a.node_id());
  t.set_type(type);
  *t.mutable_deadline() = TimeUtil::GetCurrentTime() + TimeUtil::SecondsToDuration(deadline_s);
  t.set_correlation_id(a.allocation_id());
  t.set_requested_by(opts.source);
  t.mutable_params()->PackFrom(params);
  tx.exec_params(
      "INSERT INTO allocation_tasks (task_id, allocation_id, node_id, type, attempt, deadline) "
      "VALUES ($1, $2, $3, $4, $5, now() + make_interval(secs => $6))",
      t.task_id(), a.allocation_id(), a.node_id(), type, attempt, static_cast<double>(deadline_s));
  auto ev = outbox::Append(
      tx,
      {fmt::format("gpuaas.v1.node.{node_id}.task", fmt::arg("node_id", a.node_id())), "",
       opts.source, a.node_id(), 0, a.allocation_id(), traceparent, &t},
      fmt::format("{}.{}.{}", a.allocation_id(), type, attempt));
  if (!ev.ok()) return ev.error();
  AddTimeline(tx, a.allocation_id(),
              {"task_sent", state_after, t.task_id(), type, "", "",
               fmt::format("attempt {} to {}, deadline {}s", attempt, a.node_id(), deadline_s)});
  return t.task_id();
}

Result<std::string> SendCleanup(pqxx::work& tx, const v1::Allocation& a, const SagaOptions& opts,
                                const std::string& traceparent) {
  v1::CleanupParams p;
  p.set_allocation_id(a.allocation_id());
  for (auto& s : BundleSlots(tx, a.allocation_id(), nullptr, nullptr, nullptr, nullptr)) {
    *p.add_slots() = std::move(s);
  }
  return SendTask(tx, a, kCleanup, NextAttempt(tx, a.allocation_id(), kCleanup), p,
                  opts.cleanup_deadline_s, a.state(), opts, traceparent);
}

Result<std::string> SendRelease(pqxx::work& tx, const v1::Allocation& a, const SagaOptions& opts,
                                const std::string& traceparent) {
  v1::ReleaseParams p;
  p.set_allocation_id(a.allocation_id());
  for (const auto& k : a.slot_keys()) p.add_slot_keys(k);
  p.set_graceful_timeout_s(60);
  return SendTask(tx, a, kRelease, NextAttempt(tx, a.allocation_id(), kRelease), p,
                  opts.release_deadline_s, a.state(), opts, traceparent);
}

// Frees the live claims (cleanup proof or force) and records it.
int FreeClaims(pqxx::work& tx, const std::string& allocation_id) {
  return static_cast<int>(
      tx.exec_params("UPDATE allocation_resource_claims SET released_at = now(), phase = "
                     "'released' WHERE allocation_id = $1 AND released_at IS NULL",
                     allocation_id)
          .affected_rows());
}

bool HasOpenTask(pqxx::work& tx, const std::string& allocation_id) {
  return !tx.exec_params(
                "SELECT 1 FROM allocation_tasks WHERE allocation_id = $1 AND status = 'sent' "
                "LIMIT 1",
                allocation_id)
              .empty();
}

struct TaskRow {
  std::string task_id;
  std::string allocation_id;
  std::string type;
  int attempt = 0;
  std::string status;
};

std::optional<TaskRow> FindTask(pqxx::work& tx, const std::string& task_id, bool lock) {
  auto r = tx.exec_params(std::string("SELECT task_id::text, allocation_id::text, type, attempt, "
                                      "status FROM allocation_tasks WHERE task_id = $1") +
                              (lock ? " FOR UPDATE" : ""),
                          task_id);
  if (r.empty()) return std::nullopt;
  return TaskRow{r[0][0].as<std::string>(), r[0][1].as<std::string>(), r[0][2].as<std::string>(),
                 r[0][3].as<int>(), r[0][4].as<std::string>()};
}

struct Outcome {
  std::string status;  // succeeded | failed | rejected | timed_out
  std::string stage;
  std::string code;
  std::string detail;
  const google::protobuf::Any* output = nullptr;
};

std::string StageOf(const std::string& type) {
  if (type == kProvision) return "provisioning";
  if (type == kRelease) return "release";
  return "cleanup";
}

// Proof check: every live claim of the allocation has a clean proof.
std::string ProofProblem(pqxx::work& tx, const std::string& allocation_id,
                         const v1::CleanupOutput& out) {
  std::map<std::string, const v1::CleanupProof*> proofs;
  for (const auto& p : out.proofs()) proofs[p.slot_key()] = &p;
  for (const auto& r : tx.exec_params(
           "SELECT slot_key FROM allocation_resource_claims WHERE allocation_id = $1 AND "
           "released_at IS NULL AND kind = 'slot' ORDER BY slot_key",
           allocation_id)) {
    const auto key = r[0].as<std::string>();
    auto it = proofs.find(key);
    if (it == proofs.end()) return "no cleanup proof for slot " + key;
    const auto& p = *it->second;
    if (p.signatures_remaining()) return "slot " + key + ": signatures remain on the disk";
    if (!p.domain_undefined()) return "slot " + key + ": the domain is still defined";
    if (!p.network_state_removed()) return "slot " + key + ": DHCP/NAT state not removed";
  }
  return "";
}

// What a finished (or timed-out) task means for its allocation. The caller holds the allocation
// row lock and has marked the task row.
Result<void> OnOutcome(pqxx::work& tx, const v1::Allocation& a, const TaskRow& task,
                       const Outcome& o, const SagaOptions& opts, const std::string& traceparent) {
  const bool ok = o.status == "succeeded";
  const std::string step = "task_" + o.status;
  auto record = [&](const std::string& state, const std::string& detail) {
    AddTimeline(tx, a.allocation_id(),
                {step, state, task.task_id, task.type, o.stage, o.code, detail});
  };
  if (task.type == kProvision) {
    if (a.state() != "provisioning" || task.attempt != a.attempt()) {
      AddTimeline(tx, a.allocation_id(),
                  {"late_result", a.state(), task.task_id, task.type, o.stage, o.code,
                   fmt::format("{} for attempt {} ignored: the allocation is {}", o.status,
                               task.attempt, a.state())});
      return Ok();
    }
    if (ok) {
      v1::ProvisionOutput out;
      if (o.output) o.output->UnpackTo(&out);
      tx.exec_params(
          "UPDATE allocations SET net_domain = $2, net_mac = $3, net_expected_ip = $4, "
          "net_actual_ip = $5, net_lease_state = $6 WHERE allocation_id = $1",
          a.allocation_id(), out.domain_name(), out.mac(), out.expected_ip(), out.actual_ip(),
          out.lease_state());
      record("active",
             fmt::format("domain {} up, {} at {} (lease {}, {} runtime)", out.domain_name(),
                         out.mac(), out.actual_ip(), out.lease_state(), out.runtime()));
      auto after = SetState(tx, a, "active", std::nullopt, "active", opts, traceparent);
      if (!after.ok()) return after.error();
      return Ok();
    }
    record("failed", o.detail);
    auto failed = SetState(tx, a, "failed", Failure{"provisioning", o.code, o.detail},
                           "cleanup_blocked", opts, traceparent);
    if (!failed.ok()) return failed.error();
    auto sent = SendCleanup(tx, *failed, opts, traceparent);
    if (!sent.ok()) return sent.error();
    return Ok();
  }
  if (task.type == kRelease) {
    if (a.state() != "releasing") {
      AddTimeline(tx, a.allocation_id(),
                  {"late_result", a.state(), task.task_id, task.type, o.stage, o.code,
                   fmt::format("{} ignored: the allocation is {}", o.status, a.state())});
      return Ok();
    }
    if (ok) {
      v1::ReleaseOutput out;
      if (o.output) o.output->UnpackTo(&out);
      record("releasing", fmt::format("domain {} stopped ({})", out.domain_name(), out.stop()));
      SetClaimPhase(tx, a.allocation_id(), "cleanup");
      auto sent = SendCleanup(tx, a, opts, traceparent);
      if (!sent.ok()) return sent.error();
      return Ok();
    }
    record("releasing", o.detail);
    auto after = SetState(tx, a, "releasing", Failure{"release", o.code, o.detail},
                          "cleanup_blocked", opts, traceparent);
    if (!after.ok()) return after.error();
    return Ok();
  }
  // slot.cleanup
  std::string problem;
  if (ok) {
    v1::CleanupOutput out;
    if (!o.output || !o.output->UnpackTo(&out)) {
      problem = "the cleanup result carries no CleanupOutput";
    } else {
      problem = ProofProblem(tx, a.allocation_id(), out);
    }
    if (problem.empty()) {
      record(a.state(), fmt::format("cleanup proof for every slot ({} runtime)", out.runtime()));
      const int freed = FreeClaims(tx, a.allocation_id());
      AddTimeline(tx, a.allocation_id(),
                  {"claims_freed", a.state() == "releasing" ? "released" : a.state(), task.task_id,
                   task.type, "", "", fmt::format("{} claim(s) freed on cleanup proof", freed)});
      // released, or failed again with its claims gone: either way a new generation and event,
      // so projections (ipam's binding) see the claims freed.
      auto after = a.state() == "releasing"
                       ? SetState(tx, a, "released", Failure{"", "", ""}, "", opts, traceparent)
                       : SetState(tx, a, a.state(), std::nullopt, "", opts, traceparent);
      if (!after.ok()) return after.error();
      return Ok();
    }
  }
  const std::string code = problem.empty() ? o.code : "cleanup_proof_incomplete";
  const std::string detail = problem.empty() ? o.detail : problem;
  AddTimeline(tx, a.allocation_id(),
              {problem.empty() ? step : "task_failed", a.state(), task.task_id, task.type, o.stage,
               code, detail + " (slots stay cleanup_blocked)"});
  if (a.state() == "releasing") {
    auto after = SetState(tx, a, "releasing", Failure{"cleanup", code, detail}, "cleanup_blocked",
                          opts, traceparent);
    if (!after.ok()) return after.error();
  } else {
    SetClaimPhase(tx, a.allocation_id(), "cleanup_blocked");
  }
  return Ok();
}

}  // namespace

Result<v1::Allocation> StartLifecycle(pqxx::work& tx, const v1::Allocation& a,
                                      const v1::CreateAllocationRequest& req, const Sku& sku,
                                      const Image* image, const SagaOptions& opts,
                                      const std::string& traceparent) {
  if (a.shape() == v1::CAPACITY_SHAPE_BAREMETAL) {
    AddTimeline(tx, a.allocation_id(),
                {"state", "active", "", "", "", "",
                 "baremetal: the node is handed over as placed (no host task: bare-metal "
                 "imaging is outside this product slice)"});
    return SetState(tx, a, "active", std::nullopt, "active", opts, traceparent);
  }
  v1::ProvisionBundle b;
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
  tx.exec_params(
      "UPDATE allocations SET attempt = 1, image = $2, hostname = $3, ssh_keys = $4::text[] "
      "WHERE allocation_id = $1",
      a.allocation_id(), b.image().name(), ci->hostname(),
      store::TextArrayLiteral(
          {req.ssh_authorized_keys().begin(), req.ssh_authorized_keys().end()}));
  auto prov = SetState(tx, a, "provisioning", std::nullopt, "provisioning", opts, traceparent);
  if (!prov.ok()) return prov.error();
  auto sent = SendTask(tx, *prov, kProvision, 1, b, opts.provision_deadline_s, "provisioning", opts,
                       traceparent);
  if (!sent.ok()) return sent.error();
  return prov;
}

Result<v1::Allocation> ReleaseAllocation(pqxx::work& tx, const std::string& allocation_id,
                                         bool force, const SagaOptions& opts,
                                         const std::string& traceparent) {
  auto a = LoadAllocation(tx, allocation_id, true);
  if (!a.ok()) return a.error();
  const std::string st = a->state();
  const bool has_claims = !tx.exec_params(
                                 "SELECT 1 FROM allocation_resource_claims WHERE allocation_id = "
                                 "$1 AND released_at IS NULL LIMIT 1",
                                 allocation_id)
                               .empty();
  if (force) {
    if (st == "released" || (st == "failed" && !has_claims)) return a;
    tx.exec_params(
        "UPDATE allocation_tasks SET status = 'cancelled', finished_at = now() WHERE "
        "allocation_id = $1 AND status = 'sent'",
        allocation_id);
    const int freed = FreeClaims(tx, allocation_id);
    const std::string to = st == "failed" ? "failed" : "released";
    AddTimeline(tx, allocation_id,
                {"force_released", to, "", "", "", "force_released",
                 fmt::format("an admin force-released {} claim(s) from state {}; the host state "
                             "was not proven clean",
                             freed, st)});
    return SetState(tx, *a, to,
                    st == "failed" ? std::nullopt
                                   : std::optional<Failure>(
                                         Failure{"release", "force_released",
                                                 "force-released by an admin from state " + st}),
                    "", opts, traceparent);
  }
  if (st == "released") return a;
  const bool open = HasOpenTask(tx, allocation_id);
  if (st == "failed") {
    // Claims still blocked after a failed cleanup: releasing again retries the cleanup.
    if (!has_claims || open) return a;
    SetClaimPhase(tx, allocation_id, "cleanup");
    auto sent = SendCleanup(tx, *a, opts, traceparent);
    if (!sent.ok()) return sent.error();
    return LoadAllocation(tx, allocation_id, false);
  }
  if (st == "reserved" || a->shape() == v1::CAPACITY_SHAPE_BAREMETAL) {
    // Nothing was created on a host for it: its claims are free now.
    const int freed = FreeClaims(tx, allocation_id);
    AddTimeline(tx, allocation_id,
                {"claims_freed", "released", "", "", "", "",
                 fmt::format("{} claim(s) freed: no host task was involved", freed)});
    return SetState(tx, *a, "released", std::nullopt, "", opts, traceparent);
  }
  if (st == "releasing") {
    if (open) return a;  // on its way
    // The last release or cleanup failed: start again from vm.release (idempotent on the node).
    auto again = SetState(tx, *a, "releasing", Failure{"", "", ""}, "releasing", opts, traceparent);
    if (!again.ok()) return again.error();
    auto sent = SendRelease(tx, *again, opts, traceparent);
    if (!sent.ok()) return sent.error();
    return LoadAllocation(tx, allocation_id, false);
  }
  // provisioning or active
  auto releasing = SetState(tx, *a, "releasing", std::nullopt, "releasing", opts, traceparent);
  if (!releasing.ok()) return releasing.error();
  auto sent = SendRelease(tx, *releasing, opts, traceparent);
  if (!sent.ok()) return sent.error();
  return LoadAllocation(tx, allocation_id, false);
}

Result<void> ApplyNodeTaskEvent(pqxx::work& tx, const v1::Event& ev, const SagaOptions& opts) {
  if (ev.data().Is<v1::NodeTaskProgress>()) {
    v1::NodeTaskProgress p;
    if (!ev.data().UnpackTo(&p)) {
      return Error::InvalidArgument("malformed_event", "progress without a NodeTaskProgress");
    }
    if (!ids::IsUuid(p.task_id())) return Ok();
    auto task = FindTask(tx, p.task_id(), false);
    if (!task) return Ok();  // not a task of this scheduler
    auto a = LoadAllocation(tx, task->allocation_id, true);
    if (!a.ok()) return a.error();
    auto fresh = FindTask(tx, p.task_id(), false);
    if (!fresh || fresh->status != "sent") return Ok();  // progress after the result: history
    AddTimeline(tx, a->allocation_id(),
                {"task_progress", a->state(), p.task_id(), p.type(), p.stage(), "", p.detail(),
                 p.percent()});
    return Ok();
  }
  v1::NodeTaskResult res;
  if (!ev.data().UnpackTo(&res)) {
    return Error::InvalidArgument("malformed_event", "task event without a NodeTaskResult");
  }
  if (!ids::IsUuid(res.task_id())) return Ok();
  auto task = FindTask(tx, res.task_id(), false);
  if (!task) return Ok();
  // Lock order everywhere: allocation row, then task row.
  auto a = LoadAllocation(tx, task->allocation_id, true);
  if (!a.ok()) return a.error();
  task = FindTask(tx, res.task_id(), true);
  std::string status = res.status() == v1::TASK_STATUS_SUCCEEDED  ? "succeeded"
                       : res.status() == v1::TASK_STATUS_REJECTED ? "rejected"
                                                                  : "failed";
  Outcome o{status, "", res.error().reason(), res.error().message(), &res.output()};
  auto st = res.error().details().find("stage");
  if (st != res.error().details().end()) o.stage = st->second;
  if (task->status != "sent") {
    AddTimeline(tx, a->allocation_id(),
                {"late_result", a->state(), task->task_id, task->type, o.stage, o.code,
                 fmt::format("{} arrived after the task was {}", status, task->status)});
    return Ok();
  }
  tx.exec_params(
      "UPDATE allocation_tasks SET status = $2, finished_at = now(), error_reason = $3, "
      "error_detail = $4 WHERE task_id = $1",
      task->task_id, status, o.code, o.detail);
  if (o.code.empty() && status != "succeeded") o.code = "task_" + status;
  return OnOutcome(tx, *a, *task, o, opts, "");
}

Result<int> SweepOverdueTasks(store::Pool& pool, const SagaOptions& opts, int max) {
  auto due = store::WithTx(pool, [&](pqxx::work& tx) -> Result<std::vector<std::string>> {
    std::vector<std::string> ids;
    for (const auto& r : tx.exec_params(
             "SELECT task_id::text FROM allocation_tasks WHERE status = 'sent' AND deadline < "
             "now() ORDER BY deadline LIMIT $1",
             max)) {
      ids.push_back(r[0].as<std::string>());
    }
    return ids;
  });
  if (!due.ok()) return due.error();
  int handled = 0;
  for (const auto& id : *due) {
    auto r = store::WithTx(pool, [&](pqxx::work& tx) -> Result<bool> {
      auto task = FindTask(tx, id, false);
      if (!task) return false;
      auto a = LoadAllocation(tx, task->allocation_id, true);
      if (!a.ok()) return a.error();
      auto locked = tx.exec_params(
          "SELECT 1 FROM allocation_tasks WHERE task_id = $1 AND status = 'sent' AND deadline < "
          "now() FOR UPDATE",
          id);
      if (locked.empty()) return false;  // another replica or the result got there first
      tx.exec_params(
          "UPDATE allocation_tasks SET status = 'timed_out', finished_at = now(), error_reason = "
          "'node_unresponsive' WHERE task_id = $1",
          id);
      Outcome o{
          "timed_out", StageOf(task->type), "node_unresponsive",
          fmt::format("node {} did not answer {} within its deadline", a->node_id(), task->type)};
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
        std::map<std::string, int> by_type = {
            {"vm.provision", 0}, {"vm.release", 0}, {"slot.cleanup", 0}};
        for (const auto& r : tx.exec(
                 "SELECT type, count(*) FROM allocation_tasks WHERE status = 'sent' GROUP BY 1")) {
          by_type[r[0].as<std::string>()] = r[1].as<int>();
        }
        return by_type;
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
  auto nats = svc.nats();
  for (const auto& spec : {messaging::NodeTasksStream(), messaging::NodeEventsStream()}) {
    if (auto r = messaging::EnsureStream(*nats, spec); !r.ok()) return r;
  }
  auto consumer = svc.StartProjection(
      messaging::NodeEventsStream().name, kTaskConsumer, "gpuaas.v1.evt.node.*.task.>",
      [opts](pqxx::work& tx, const v1::Event& ev) { return ApplyNodeTaskEvent(tx, ev, opts); });
  if (!consumer.ok()) return consumer.error();

  auto pool = svc.pg();
  svc.Rpc().Handle<v1::GetAllocationTimelineRequest, v1::GetAllocationTimelineResponse>(
      "gpuaas.v1.scheduler.allocation.timeline",
      [pool](const v1::GetAllocationTimelineRequest& req,
             rpc::Context&) -> Result<v1::GetAllocationTimelineResponse> {
        auto page = rpc::PageLimit(req.page_size());
        if (!page.ok()) return page.error();
        int64_t after = 0;
        if (!req.page_token().empty()) {
          try {
            size_t used = 0;
            after = std::stoll(req.page_token(), &used);
            if (used != req.page_token().size() || after < 0) throw std::invalid_argument("");
          } catch (const std::exception&) {
            return Error::InvalidArgument("invalid_page_token",
                                          "page_token is a seq from a timeline reply",
                                          {{"page_token", req.page_token()}});
          }
        }
        const int limit = *page;
        return store::WithTx(
            *pool,
            [&](pqxx::work& tx) -> Result<v1::GetAllocationTimelineResponse> {
              auto a = LoadAllocation(tx, req.allocation_id(), false);
              if (!a.ok()) return a.error();
              v1::GetAllocationTimelineResponse resp;
              resp.set_state(a->state());
              resp.set_in_flight(HasOpenTask(tx, a->allocation_id()));
              auto rows = tx.exec_params(
                  "SELECT seq, extract(epoch from at)::float8, step, state, "
                  "task_id, task_type, stage, code, detail, percent FROM "
                  "allocation_timeline WHERE allocation_id = $1 AND seq > $2 "
                  "ORDER BY seq LIMIT $3",
                  req.allocation_id(), after, limit + 1);
              int64_t last = after;
              for (size_t i = 0; i < rows.size() && static_cast<int>(i) < limit; ++i) {
                const auto& r = rows[i];
                auto* e = resp.add_entries();
                e->set_seq(r[0].as<int64_t>());
                *e->mutable_at() = TimeUtil::MillisecondsToTimestamp(
                    static_cast<int64_t>(r[1].as<double>() * 1000));
                e->set_step(r[2].as<std::string>());
                e->set_state(r[3].as<std::string>());
                e->set_task_id(r[4].as<std::string>());
                e->set_task_type(r[5].as<std::string>());
                e->set_stage(r[6].as<std::string>());
                e->set_code(r[7].as<std::string>());
                e->set_detail(r[8].as<std::string>());
                e->set_percent(r[9].as<int>());
                last = e->seq();
              }
              if (static_cast<int>(rows.size()) > limit) {
                resp.set_next_page_token(std::to_string(last));
              }
              resp.set_last_seq(std::to_string(last));
              return resp;
            },
            store::ReadSnapshot());  // the state, in_flight and entries of one moment
      });

  auto sweeper = std::make_shared<Sweeper>(pool, opts, svc.log(), svc.metrics());
  svc.OnDrain("saga-deadline-sweeper", [sweeper] { sweeper->Stop(); });
  return Ok();
}

}  // namespace gpuaas::scheduler
