#include "gpuaas/scheduler/allocations.hpp"

#include <map>
#include <optional>
#include <regex>
#include <set>
#include <thread>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "allocation_rows.hpp"
#include "allocation_store.hpp"
#include "apps.hpp"
#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/group_commit.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/scheduler/placement.hpp"
#include "gpuaas/scheduler/placement_cache.hpp"
#include "scheduler_metrics.hpp"
#include "scheduler_reasons.hpp"

namespace gpuaas::scheduler {

namespace {

const std::regex kLabel("^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$");
constexpr int kChoices = 8;
// Placement rounds per create: the first kSkipAttempts skip rows other placers hold, the rest
// wait for them up to kLockWaitMs each.
constexpr int kPlaceAttempts = 8;
constexpr int kSkipAttempts = 3;
constexpr int kLockWaitMs = 2000;
// How long a refusal waits for the placement index to catch up before asking SQL instead.
constexpr int kSyncWaitMs = 1000;
constexpr int kMaxEndpoints = 16;

// A tenant principal asked for another tenant.
Error TenantDenied(const rpc::Context& ctx, const std::string& tenant) {
  return Error::Of(
      Code::kPermissionDenied, reason::kTenantNotAllowed,
      ctx.principal.subject + " acts for tenant " + ctx.principal.tenant + ", not " + tenant,
      {{"tenant", tenant}, {"principal_tenant", ctx.principal.tenant}});
}

// The request's `expose` entries: DNS-label names and ports, each named once.
void CheckExposures(const v1::CreateAllocationRequest& req,
                    std::map<std::string, std::string>& problems) {
  std::set<std::string> names;
  std::set<std::pair<int, int32_t>> ports;
  for (int i = 0; i < req.expose_size(); ++i) {
    const auto& e = req.expose(i);
    const std::string at = fmt::format("expose[{}]", i);
    if (!std::regex_match(e.name(), kLabel)) {
      problems[at + ".name"] = "a lowercase DNS label";
    } else if (!names.insert(e.name()).second) {
      problems[at + ".name"] = "names an endpoint twice";
    }
    if (enums::Text(e.protocol()).empty()) problems[at + ".protocol"] = "tcp or udp";
    if (e.port() < 1 || e.port() > 65535) {
      problems[at + ".port"] = "1..65535";
    } else if (!ports.insert({e.protocol(), e.port()}).second) {
      problems[at + ".port"] = "exposes a port twice";
    }
  }
}

Result<void> ValidateCreate(const v1::CreateAllocationRequest& req) {
  std::map<std::string, std::string> problems;
  if (!std::regex_match(req.tenant(), kLabel)) problems["tenant"] = "a lowercase DNS label";
  if (req.request_id().empty() || req.request_id().size() > 128) {
    problems["request_id"] = "required, at most 128 characters (the idempotency key)";
  }
  if (!std::regex_match(req.region(), kLabel)) problems["region"] = "a lowercase DNS label";
  if (!req.pool().empty() && !std::regex_match(req.pool(), kLabel)) {
    problems["pool"] = "empty or a lowercase DNS label";
  }
  if (req.gpu_count() < 0) problems["gpu_count"] = "must be >= 0";
  if (req.network_mode() != v1::NETWORK_MODE_UNSPECIFIED &&
      enums::Text(req.network_mode()).empty()) {
    problems["network_mode"] = "one of " + enums::JoinTexts(v1::NetworkMode_descriptor());
  }
  if (req.expose_size() > kMaxEndpoints) {
    problems["expose"] = fmt::format("at most {} endpoints", kMaxEndpoints);
  }
  CheckExposures(req, problems);
  if (!problems.empty()) {
    return Error::InvalidArgument(reason::kInvalidAllocationRequest,
                                  fmt::format("{} invalid field(s)", problems.size()), problems);
  }
  return Ok();
}

Error RegionDisabled(const std::string& region) {
  return Error::Of(Code::kFailedPrecondition, reason::kRegionDisabled,
                   "region " + region + " is disabled", {{"region", region}});
}

// A create request checked against the catalog and its app: what its transaction places.
struct CreateOrder {
  const v1::CreateAllocationRequest* req = nullptr;
  const Sku* sku = nullptr;
  v1::NetworkMode network_mode = v1::NETWORK_MODE_UNSPECIFIED;
  bool baremetal = false;
  const Image* image = nullptr;  // slices only
  int gpus = 0;
  std::vector<v1::EndpointRequest> expose;
};

Result<CreateOrder> CheckOrder(const Catalog& catalog, const v1::CreateAllocationRequest& req,
                               const rpc::Context& ctx) {
  if (auto v = ValidateCreate(req); !v.ok()) return v.error();
  if (const std::string scope = ctx.TenantScope(); !scope.empty() && req.tenant() != scope) {
    return TenantDenied(ctx, req.tenant());
  }
  auto checked = catalog.Validate(req.sku(), req.gpu_count(), req.network_mode());
  if (!checked.ok()) return checked.error();
  CreateOrder o;
  o.req = &req;
  o.sku = checked->first;
  o.network_mode = checked->second;
  o.baremetal = o.sku->shape == v1::CAPACITY_SHAPE_BAREMETAL;
  if (!o.baremetal) {
    auto img = catalog.FindImage(req.image());
    if (!img.ok()) return img.error();
    o.image = *img;
  } else if (!req.image().empty()) {
    return Error::InvalidArgument(reason::kImageNotForBaremetal,
                                  "baremetal nodes are handed over without a VM image",
                                  {{"image", req.image()}});
  }
  if (o.baremetal && req.expose_size() > 0) {
    return Error::InvalidArgument(
        reason::kExposureNotForBaremetal,
        "a bare-metal node has its own public addresses; ingress exposes slice VMs only",
        {{"expose", "must be empty for baremetal"}});
  }
  o.gpus = req.gpu_count() == 0 ? o.sku->allowed_gpu_counts.front() : req.gpu_count();
  // What to expose: the request's endpoints, then its app's (slices only: a bare-metal
  // node has its own public addresses).
  apps::Target target;
  target.shape = o.baremetal ? v1::CAPACITY_SHAPE_BAREMETAL : v1::CAPACITY_SHAPE_GPU_SLICE;
  target.gpu_count = o.gpus;
  auto expose = apps::EndpointsToExpose(req, target);
  if (!expose.ok()) return expose.error();
  o.expose = std::move(*expose);
  return o;
}

struct Placed {
  std::string node_id;
  std::vector<std::string> slots;
};

// Why nothing could be placed, with counts per reason (from SQL, or from a synced index).
Error NoPlacement(const v1::CreateAllocationRequest& req, const Sku& sku, int gpus,
                  const PlacementCache::FreeCounts& c) {
  std::map<std::string, std::string> d = {
      {"free_gpus_in_region", std::to_string(c.free_in_region)},
      {"free_gpus_of_sku", std::to_string(c.free_of_sku)},
      {"free_gpus_matching_fabric", std::to_string(c.matching)},
      {"max_free_matching_on_one_node", std::to_string(c.max_on_one_node)},
      {"nodes_with_enough_free_slots", std::to_string(c.nodes_with_enough)},
      {"nodes_with_wrong_fabric", std::to_string(c.nodes_with_wrong_fabric)},
      {"unschedulable_slots_in_region", std::to_string(c.unschedulable_in_region)},
      {"incomplete_slots_ignored", std::to_string(c.incomplete)},
      {"requested_gpus", std::to_string(gpus)}};
  const std::string& fabric = enums::Text(sku.fabric_type);
  return Error::Of(Code::kResourceExhausted, reason::kNoPlacement,
                   fmt::format("no node in {} has {} free {} slot(s) with {} fabric together "
                               "({} free matching GPUs in the region, at most {} on one node)",
                               req.region(), gpus, sku.gpu_sku, fabric.empty() ? "any" : fabric,
                               c.matching, c.max_on_one_node),
                   d, true);
}

// Why a slice found nothing, for gpuaas_no_placement_total: from the refusal's counts.
NoPlacementKind ClassifyNoPlacement(const PlacementCache::FreeCounts& c, int requested) {
  if (c.free_of_sku == 0) return NoPlacementKind::kNoFreeGpus;
  if (c.matching == 0) return NoPlacementKind::kFabricMismatch;
  if (c.nodes_with_enough > 0) return NoPlacementKind::kContended;
  if (requested > 0 && c.matching >= requested) return NoPlacementKind::kFragmented;
  return NoPlacementKind::kNotEnoughFreeGpus;
}

// What the proposals of one create request came to (gpuaas_placement_choices_total).
struct ChoiceStats {
  bool from_index = false;
  bool refused_by_index = false;  // the synced index had nothing: the refusal's counts from it
  bool region_disabled = false;   // SQL found the region's slots all disabled
  int placed = 0;
  int stale = 0;  // the re-check found them claimed or no longer schedulable
  int held = 0;   // locked by another placement
};

// The SQL read of the create path (every slot of the SKU in the region, with its live claims),
// ranked with placement::Rank: used when the replica's placement index has nothing to propose
// and cannot sync, or is not loaded. nullopt: the region is disabled.
std::optional<std::vector<placement::Choice>> RankFromSql(pqxx::work& tx,
                                                          const v1::CreateAllocationRequest& req,
                                                          const Sku& sku,
                                                          const placement::Request& preq) {
  bool region_enabled = false;
  const auto views = ReadNodeViews(tx, req.region(), req.pool(), sku.gpu_sku, &region_enabled);
  if (views.empty()) return std::vector<placement::Choice>();
  if (!region_enabled) return std::nullopt;
  return placement::Rank(views, preq, kChoices);
}

// The choices one placement round of a slice tries, best first (none: nothing to place).
struct Proposals {
  std::vector<placement::Choice> choices;
  bool from_index = false;
};

// Proposals from the replica's placement index, or, when it has none, from SQL.
Result<Proposals> Propose(pqxx::work& tx, const v1::CreateAllocationRequest& req, const Sku& sku,
                          int gpus, PlacementCache* cache, ChoiceStats* stats) {
  placement::Request preq;
  preq.gpus = gpus;
  preq.fabric_type = enums::Text(sku.fabric_type);
  Proposals out;
  if (cache != nullptr && cache->ready()) {
    auto ranked = cache->Rank(req.region(), req.pool(), sku.gpu_sku, preq, kChoices);
    // Nothing to propose: refused only by an index that has every commit made before this
    // request (a release the client saw answered included), else by SQL.
    if (ranked.any_node && ranked.region_enabled && ranked.choices.empty() &&
        cache->Sync(std::chrono::milliseconds(kSyncWaitMs))) {
      ranked = cache->Rank(req.region(), req.pool(), sku.gpu_sku, preq, kChoices);
      if (ranked.region_enabled && ranked.choices.empty()) {
        stats->refused_by_index = true;
        return out;
      }
    }
    if (ranked.region_enabled && !ranked.choices.empty()) {
      out.choices = std::move(ranked.choices);
      out.from_index = true;
      return out;
    }
  }
  auto ranked = RankFromSql(tx, req, sku, preq);
  if (!ranked) {
    stats->region_disabled = true;
    return RegionDisabled(req.region());
  }
  out.choices = std::move(*ranked);
  return out;
}

// Locks and re-checks the proposals in order; the first that holds is placed. Each choice is
// tried in its own savepoint: a choice given up releases the row locks it took, and a wait that
// ran past lock_timeout (an error, which aborts the transaction) is rolled back to it, so the
// next choice can be tried. A stale proposal of the index reads its node into the index again.
std::optional<Placed> TryChoices(pqxx::work& tx, const Proposals& p, int gpus, bool wait,
                                 PlacementCache* cache, ChoiceStats* stats) {
  std::vector<std::string> stale;
  for (const auto& choice : p.choices) {
    BeginChoice(tx);
    try {
      // Slices share the node row; a baremetal placer takes it exclusively.
      const NodeShare share = ShareNode(tx, choice.node_id, !wait);
      if (share != NodeShare::kShared) {
        AbandonChoice(tx);
        // A node drained since the proposal was made: its proposer reads it again.
        if (share == NodeShare::kNotActive) {
          stats->stale++;
          stale.push_back(choice.node_id);
        } else {
          stats->held++;
        }
        continue;
      }
      std::string keys = store::TextArrayLiteral(choice.slot_keys);
      const int locked = LockSchedulableSlots(tx, choice.node_id, keys, !wait);
      // Claims committed since our read (we hold the rows now, so none can appear after this).
      if (locked != gpus || SlotsClaimed(tx, choice.node_id, keys)) {
        AbandonChoice(tx);  // its row locks go with it
        // Fewer rows than asked while skipping: held by someone (or gone); waiting, or claims
        // found: what the proposal was made from is out of date.
        if (!wait && locked != gpus) {
          stats->held++;
        } else {
          stats->stale++;
          stale.push_back(choice.node_id);
        }
        continue;
      }
      KeepChoice(tx);
      stats->placed++;
      if (p.from_index && !stale.empty()) cache->Refresh(tx, stale);
      return Placed{choice.node_id, choice.slot_keys};
    } catch (const pqxx::sql_error& e) {
      // A wait that ran past lock_timeout: the next choice.
      if (e.sqlstate() != "55P03") throw;
      AbandonChoice(tx);
      stats->held++;
    }
  }
  // The index proposed what the database no longer has: read those nodes again now, so the
  // next round does not propose them again before their notifications arrive.
  if (p.from_index && !stale.empty()) cache->Refresh(tx, stale);
  return std::nullopt;
}

// One placement round for a slice in `tx`: proposals, then lock and re-check them in order.
// `wait`: lock the choices waiting for their holders (bounded by lock_timeout) instead of
// skipping them; used once skipping kept failing. `contended`: there were choices, and every
// one was taken or locked by someone else.
Result<std::optional<Placed>> PlaceSlice(pqxx::work& tx, const v1::CreateAllocationRequest& req,
                                         const Sku& sku, int gpus, bool wait, bool* contended,
                                         PlacementCache* cache, ChoiceStats* stats) {
  auto proposals = Propose(tx, req, sku, gpus, cache, stats);
  if (!proposals.ok()) return proposals.error();
  if (proposals->choices.empty()) return std::optional<Placed>();
  stats->from_index = stats->from_index || proposals->from_index;
  *contended = true;  // stays set when a choice is placed: the caller looks at that first
  return TryChoices(tx, *proposals, gpus, wait, cache, stats);
}

Result<std::optional<Placed>> PlaceBaremetal(pqxx::work& tx,
                                             const v1::CreateAllocationRequest& req) {
  for (const auto& node : BaremetalCandidates(tx, req.region(), req.pool(), kChoices)) {
    if (!LockNodeExclusive(tx, node)) continue;
    if (NodeClaimed(tx, node)) continue;
    return std::optional<Placed>(Placed{node, {}});
  }
  return std::optional<Placed>();
}

// One create's transaction, run as a unit of a group commit (each create in a savepoint, one
// commit for the creates that overlap) or on its own; a run may be repeated (a deadlock, a
// serialization failure, a group's statement failure), and the stats add up over the runs.
class CreateTransaction {
 public:
  CreateTransaction(const CreateOrder& order, const SagaOptions& saga, PlacementCache* cache,
                    store::GroupCommit* group, rpc::Context& ctx)
      : o_(order), req_(*order.req), saga_(saga), cache_(cache), group_(group), ctx_(ctx) {}

  Result<v1::CreateAllocationResponse> Run(pqxx::work& tx) {
    if (cache_ != nullptr && !provisional_.empty()) {
      cache_->Refresh(tx, {provisional_});  // run again: the earlier run's claim is gone
      provisional_.clear();
    }
    refusal_ = NoPlacementKind::kNone;  // this run's
    v1::CreateAllocationResponse resp;
    // Retries of one request id, on any replica, one at a time: the later ones find the
    // first one's allocation instead of racing it to the unique (tenant, request_id) key.
    LockRequestId(tx, req_.tenant(), req_.request_id());
    if (auto existing = FindByRequest(tx, req_.tenant(), req_.request_id())) {
      *resp.mutable_allocation() = *existing;
      return resp;  // a retry: same answer, no second placement
    }
    // Slices learn it from the slots they scan anyway.
    if (o_.baremetal && RegionHasOnlyDisabledSlots(tx, req_.region())) {
      refusal_ = NoPlacementKind::kRegionDisabled;
      return RegionDisabled(req_.region());
    }
    bool contended = false;
    auto placed = PlaceInRounds(tx, &contended);
    if (!placed.ok()) {
      if (stats_.region_disabled) refusal_ = NoPlacementKind::kRegionDisabled;
      return placed.error();
    }
    if (!placed->has_value()) return Refusal(tx, contended);
    auto a = Record(tx, **placed);
    if (!a.ok()) return a.error();
    *resp.mutable_allocation() = *a;
    resp.set_created(true);
    return resp;
  }

  // Why the last run refused for capacity (kNone: it did not); what the create's error was when
  // the create failed.
  NoPlacementKind refusal() const { return refusal_; }

  // After the transaction (committed or not): the choice metrics, and this replica's index.
  void Finish(store::Pool& pool, const Result<v1::CreateAllocationResponse>& created) {
    if (saga_.metrics) {
      saga_.metrics->Choices(stats_.from_index, stats_.placed, stats_.stale, stats_.held);
    }
    if (cache_ != nullptr && !provisional_.empty() && !created.ok()) {
      // Claimed in a run that was then undone (its savepoint rolled back): read the node
      // again, as it is committed.
      (void)store::WithTx(pool, [&](pqxx::work& tx) -> Result<void> {
        cache_->Refresh(tx, {provisional_});
        return Ok();
      });
    }
    // Committed: this replica's index has the claim now, not only once its notification
    // comes back (the other replicas learn it from the notification).
    if (cache_ != nullptr && created.ok() && created->created() && !o_.baremetal) {
      cache_->Claimed(created->allocation().node_id(), {created->allocation().slot_keys().begin(),
                                                        created->allocation().slot_keys().end()});
    }
  }

 private:
  // Skipping what others hold first; when that keeps failing, waiting for them: a request is
  // not refused while capacity exists only because others held it a moment.
  Result<std::optional<Placed>> PlaceInRounds(pqxx::work& tx, bool* contended) {
    Result<std::optional<Placed>> placed = std::optional<Placed>();
    stats_.refused_by_index = false;  // this run of the transaction's
    stats_.region_disabled = false;
    for (int attempt = 0; attempt < kPlaceAttempts; ++attempt) {
      const bool wait = attempt >= kSkipAttempts;
      if (wait && attempt == kSkipAttempts) SetLockTimeout(tx, kLockWaitMs);
      *contended = false;
      placed = o_.baremetal
                   ? PlaceBaremetal(tx, req_)
                   : PlaceSlice(tx, req_, *o_.sku, o_.gpus, wait, contended, cache_, &stats_);
      if (!placed.ok() || placed->has_value() || !*contended) break;
      // Others held or took our choices: read again (their commits are visible now).
      if (!wait) std::this_thread::sleep_for(std::chrono::milliseconds(2 * (attempt + 1)));
    }
    if (*contended) ClearLockTimeout(tx);
    return placed;
  }

  // Nothing placed: why, with counts.
  Error Refusal(pqxx::work& tx, bool contended) {
    const Sku& sku = *o_.sku;
    if (o_.baremetal) {
      refusal_ = NoPlacementKind::kNoFreeNode;
      return Error::Of(Code::kResourceExhausted, reason::kNoPlacement,
                       "no node in " + req_.region() + " is free of claims for baremetal",
                       {{"requested", "node_exclusive"}}, true);
    }
    if (contended) {
      // Still held by others after waiting: capacity may exist, so not no_placement.
      refusal_ = NoPlacementKind::kContended;
      return Error::Of(
          Code::kUnavailable, reason::kPlacementContended,
          fmt::format("every choice for {} GPU(s) in {} stayed held by other placements; try again",
                      o_.gpus, req_.region()),
          {{"requested_gpus", std::to_string(o_.gpus)},
           {"attempts", std::to_string(kPlaceAttempts)}},
          true);
    }
    const std::string& fabric = enums::Text(sku.fabric_type);
    const PlacementCache::FreeCounts counts =
        stats_.refused_by_index
            ? cache_->Count(req_.region(), req_.pool(), sku.gpu_sku, fabric, o_.gpus)
            : CountFree(tx, req_.region(), req_.pool(), sku.gpu_sku, fabric, o_.gpus);
    refusal_ = ClassifyNoPlacement(counts, o_.gpus);
    return NoPlacement(req_, sku, o_.gpus, counts);
  }

  // The allocation `reserved` on `p` with its endpoints and claims, announced, on the
  // timeline, and its lifecycle started.
  Result<v1::Allocation> Record(pqxx::work& tx, const Placed& p) {
    const std::string id = ids::NewUuidV7();
    InsertAllocation(
        tx, {id, req_.tenant(), req_.request_id(), req_.sku(), o_.sku->shape, o_.gpus,
             req_.region(), req_.pool(), o_.network_mode, p.node_id, o_.sku->billable_unit});
    if (!req_.app().empty()) SetAllocationApp(tx, id, req_.app());
    for (const auto& e : o_.expose) InsertEndpoint(tx, id, e);
    if (o_.baremetal) {
      InsertExclusiveClaim(tx, id, p.node_id);
    } else {
      InsertSlotClaims(tx, id, p.node_id, p.slots);
      // Told at once, so the creates after this one in a group's transaction (committed after
      // they ran) do not propose the same slots; corrected (the node read again) if this run's
      // work is undone.
      if (cache_ != nullptr && group_ != nullptr) {
        cache_->Claimed(p.node_id, p.slots);
        provisional_ = p.node_id;
      }
    }
    auto a = LoadAllocation(tx, id, false);
    if (!a.ok()) return a.error();
    if (auto e = Announce(tx, *a, saga_.source, ctx_.traceparent); !e.ok()) return e.error();
    AddTimeline(
        tx, id,
        {v1::TIMELINE_STEP_PLACED, v1::ALLOCATION_STATE_RESERVED, "", v1::TASK_TYPE_UNSPECIFIED,
         v1::TASK_STAGE_UNSPECIFIED, "",
         o_.baremetal ? "node " + p.node_id + " (node_exclusive)"
                      : fmt::format("node {} slots {}", p.node_id, fmt::join(p.slots, ","))});
    a = StartLifecycle(tx, *a, req_, *o_.sku, o_.image, saga_, ctx_.traceparent);
    if (!a.ok()) return a.error();
    ctx_.log.Info("allocation placed", {{"allocation_id", id},
                                        {"node_id", p.node_id},
                                        {"gpus", std::to_string(o_.gpus)},
                                        {"sku", req_.sku()}});
    return a;
  }

  const CreateOrder& o_;
  const v1::CreateAllocationRequest& req_;
  const SagaOptions& saga_;
  PlacementCache* cache_;
  store::GroupCommit* group_;
  rpc::Context& ctx_;
  ChoiceStats stats_;
  NoPlacementKind refusal_ = NoPlacementKind::kNone;
  // The node this create claimed slots of in a run that may not have committed (a group's
  // transaction is committed after later creates ran in it): the index is told at once, so
  // those creates do not propose the same slots, and is corrected (the node read again) if
  // that run's work was undone.
  std::string provisional_;
};

}  // namespace

AllocationHandlers::AllocationHandlers(std::shared_ptr<store::Pool> pool, Catalog catalog,
                                       SagaOptions saga, PlacementCache* cache,
                                       store::GroupCommit* group)
    : pool_(std::move(pool)),
      catalog_(std::move(catalog)),
      listed_(catalog_.ToProto()),
      saga_(std::move(saga)),
      cache_(cache),
      group_(group) {}

Result<v1::CreateAllocationResponse> AllocationHandlers::Create(
    const v1::CreateAllocationRequest& req, rpc::Context& ctx) {
  NoPlacementKind refusal = NoPlacementKind::kNone;
  auto r = PlaceAndCommit(req, ctx, &refusal);
  if (saga_.metrics) saga_.metrics->CreateAnswered(r, refusal);
  return r;
}

Result<v1::CreateAllocationResponse> AllocationHandlers::PlaceAndCommit(
    const v1::CreateAllocationRequest& req, rpc::Context& ctx, NoPlacementKind* refusal) {
  auto order = CheckOrder(catalog_, req, ctx);
  if (!order.ok()) return order.error();
  CreateTransaction run(*order, saga_, cache_, group_, ctx);
  const auto create = [&](pqxx::work& tx) -> Result<v1::CreateAllocationResponse> {
    return run.Run(tx);
  };
  auto created = group_ != nullptr ? group_->Run(create) : store::WithTx(*pool_, create);
  run.Finish(*pool_, created);
  // A failed create's error is its last run's answer (a run that throws runs again, and a
  // failed group transaction runs every unit again alone).
  if (!created.ok()) *refusal = run.refusal();
  return created;
}

Result<v1::ListCatalogResponse> AllocationHandlers::ListCatalog(
    const v1::ListCatalogRequest& /*req*/, rpc::Context& /*ctx*/) {
  return store::WithTx(
      *pool_,
      [&](pqxx::work& tx) -> Result<v1::ListCatalogResponse> {
        v1::ListCatalogResponse resp = listed_;
        const auto capacity = ReadRegionCapacity(tx);
        for (auto& sku : *resp.mutable_skus()) {
          for (const auto& c : capacity) {
            if (c.sku != sku.gpu_sku()) continue;
            // Baremetal takes a whole node that nothing else holds.
            const bool whole = sku.shape() == v1::CAPACITY_SHAPE_BAREMETAL;
            auto* a = sku.add_availability();
            a->set_region(c.region);
            a->set_region_enabled(c.region_enabled);
            a->set_free_gpus(static_cast<int32_t>(whole ? c.free_on_clean_nodes : c.free_gpus));
            a->set_max_gpus_per_allocation(
                static_cast<int32_t>(whole ? c.max_on_one_clean_node : c.max_on_one_node));
          }
        }
        return resp;
      },
      store::ReadSnapshot());
}

Result<v1::GetAllocationResponse> AllocationHandlers::Get(const v1::GetAllocationRequest& req,
                                                          rpc::Context& ctx) {
  return store::WithTx(
      *pool_,
      [&](pqxx::work& tx) -> Result<v1::GetAllocationResponse> {
        auto a = LoadAllocation(tx, req.allocation_id(), false, ctx.TenantScope());
        if (!a.ok()) return a.error();
        v1::GetAllocationResponse resp;
        *resp.mutable_allocation() = *a;
        return resp;
      },
      store::ReadSnapshot());
}

Result<v1::ListAllocationsResponse> AllocationHandlers::List(const v1::ListAllocationsRequest& req,
                                                             rpc::Context& ctx) {
  // A tenant principal lists its own tenant's, whatever it asked for.
  const std::string scope = ctx.TenantScope();
  if (!scope.empty() && !req.tenant().empty() && req.tenant() != scope) {
    return TenantDenied(ctx, req.tenant());
  }
  const std::string tenant = scope.empty() ? req.tenant() : scope;
  auto page = rpc::PageLimit(req.page_size());
  if (!page.ok()) return page.error();
  if (!req.page_token().empty() && !ids::IsUuid(req.page_token())) {
    return Error::InvalidArgument(reason::kInvalidPageToken, "page_token is not from a list reply",
                                  {{"page_token", "use next_page_token"}});
  }
  if (req.state() != v1::ALLOCATION_STATE_UNSPECIFIED && enums::Text(req.state()).empty()) {
    return enums::InvalidValue("state", std::to_string(req.state()),
                               v1::AllocationState_descriptor());
  }
  const int limit = *page;
  return store::WithTx(
      *pool_,
      [&](pqxx::work& tx) -> Result<v1::ListAllocationsResponse> {
        auto rows = ListAllocations(tx, tenant, enums::Text(req.state()), req.page_token(), limit);
        v1::ListAllocationsResponse resp;
        for (auto& a : rows.allocations) *resp.add_allocations() = std::move(a);
        if (rows.more) resp.set_next_page_token(resp.allocations(limit - 1).allocation_id());
        return resp;
      },
      store::ReadSnapshot());
}

Result<v1::ReleaseAllocationResponse> AllocationHandlers::Release(
    const v1::ReleaseAllocationRequest& req, rpc::Context& ctx) {
  if (req.force()) {
    return Error::Of(Code::kPermissionDenied, reason::kForceMoved,
                     "force-release is gpuaas.v1.scheduler.allocation.force_release, which "
                     "only the operator role may call",
                     {{"subject", "gpuaas.v1.scheduler.allocation.force_release"}});
  }
  outbox::SetActorReason(req.reason());
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::ReleaseAllocationResponse> {
    auto after = ReleaseAllocation(tx, req.allocation_id(), false, saga_, ctx.traceparent,
                                   ctx.TenantScope());
    if (!after.ok()) return after.error();
    ctx.log.Info("allocation release", {{"allocation_id", req.allocation_id()},
                                        {"state", enums::Text(after->state())},
                                        {"reason", req.reason()}});
    v1::ReleaseAllocationResponse resp;
    *resp.mutable_allocation() = *after;
    return resp;
  });
}

Result<v1::ReleaseAllocationResponse> AllocationHandlers::ForceRelease(
    const v1::ForceReleaseAllocationRequest& req, rpc::Context& ctx) {
  if (req.reason().empty()) {
    return Error::InvalidArgument(reason::kReasonRequired,
                                  "a force-release skips the cleanup proof: say why",
                                  {{"reason", "required"}});
  }
  outbox::SetActorReason(req.reason());
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::ReleaseAllocationResponse> {
    auto after = ReleaseAllocation(tx, req.allocation_id(), true, saga_, ctx.traceparent);
    if (!after.ok()) return after.error();
    ctx.log.Warn("allocation force-released", {{"allocation_id", req.allocation_id()},
                                               {"state", enums::Text(after->state())},
                                               {"reason", req.reason()}});
    v1::ReleaseAllocationResponse resp;
    *resp.mutable_allocation() = *after;
    return resp;
  });
}

}  // namespace gpuaas::scheduler
