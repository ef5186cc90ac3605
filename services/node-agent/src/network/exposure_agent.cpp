#include "gpuaas/node_agent/network/exposure_agent.hpp"

#include <algorithm>
#include <set>
#include <thread>

#include <fmt/format.h>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/node_agent/network/exposure_apply.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"

namespace gpuaas::node_agent {

ExposureAgent::ExposureAgent(std::function<std::shared_ptr<messaging::Connection>()> nats,
                             ExposureAgentOptions opts, log::Logger log)
    : nats_(std::move(nats)), opts_(std::move(opts)), log_(std::move(log)) {
  DocumentFollower<v1::NodeExposureDocument>::Hooks hooks;
  hooks.fetch = [this]() -> Result<v1::NodeExposureDocument> {
    v1::GetNodeExposuresRequest get;
    get.set_node_id(opts_.node_id);
    auto r = rpc::Client(nats_()).Call<v1::GetNodeExposuresResponse>(
        "gpuaas.v1.ingress.node.{node_id}.exposures.get", get, opts_.timeout);
    if (!r.ok()) return r.error();
    return r->document();
  };
  hooks.apply = [this](const v1::NodeExposureDocument& doc) { return Apply(doc); };
  if (opts_.mode != "simulate") {
    hooks.check = [this](const v1::NodeExposureDocument& doc) { return Check(doc); };
  }
  hooks.ack = [this](int64_t version, const std::vector<std::string>& blockers) {
    return Ack(version, blockers);
  };
  follower_ = std::make_unique<DocumentFollower<v1::NodeExposureDocument>>(std::move(hooks),
                                                                           opts_.check_interval);
}

Result<ExposureSpec> ExposureAgent::SpecOf(const v1::NodeExposureDocument& doc) const {
  ExposureSpec spec;
  spec.version = doc.version();
  spec.uplink = opts_.uplink;
  spec.sys_root = opts_.sys_root;
  auto net = opts_.network ? opts_.network() : std::nullopt;
  if (!net) {
    return Error::Unavailable(reason::kNetworkNotApplied,
                              "no network document applied yet: the slice addresses are unknown");
  }
  spec.subnet_cidr = net->subnet();
  for (const auto& r : net->reservations()) spec.slice_ips.push_back(r.ip());
  for (const auto& m : doc.mappings()) {
    ExposureRule rule;
    rule.exposure_id = m.exposure_id();
    rule.protocol = enums::Text(m.protocol());
    rule.public_ip = m.public_ip();
    rule.public_port = m.public_port();
    rule.target_ip = m.target_ip();
    rule.target_port = m.target_port();
    rule.slot_key = m.slot_key();
    spec.rules.push_back(std::move(rule));
  }
  return spec;
}

Result<void> ExposureAgent::Apply(const v1::NodeExposureDocument& doc) {
  refused_.clear();
  if (opts_.mode == "simulate") {
    log_.Info("exposure document taken (simulated: no kernel rules)",
              {{"version", std::to_string(doc.version())},
               {"mappings", std::to_string(doc.mappings_size())}});
    return Ok();
  }
  auto spec = SpecOf(doc);
  if (!spec.ok()) return spec.error();
  auto applied = ApplyExposures(*spec, opts_.ctx);
  if (!applied.ok()) {
    if (applied.error().code != Code::kInvalidArgument) return applied.error();
    // The document can never be applied here as it is (the uplink is a fabric interface, or
    // missing): every mapping is refused with that reason and the table is left alone.
    for (const auto& m : doc.mappings()) {
      auto* f = &refused_.emplace_back();
      f->set_exposure_id(m.exposure_id());
      f->set_reason(applied.error().reason);
      f->set_message(applied.error().message);
    }
    log_.Error("exposure document refused",
               {{"version", std::to_string(doc.version())}, {"error", applied.error().ToString()}});
    return Ok();
  }
  for (const auto& r : applied->refused) {
    auto* f = &refused_.emplace_back();
    f->set_exposure_id(r.exposure_id);
    f->set_reason(r.reason);
    f->set_message(r.message);
  }
  log_.Info("exposure document applied",
            {{"version", std::to_string(doc.version())},
             {"applied", std::to_string(applied->applied.size())},
             {"refused", std::to_string(applied->refused.size())},
             {"removed", std::to_string(applied->removed.size())},
             {"conntrack_flushed", std::to_string(applied->conntrack_flushed)}});
  return Ok();
}

Result<std::vector<std::string>> ExposureAgent::Check(const v1::NodeExposureDocument& doc) {
  auto spec = SpecOf(doc);
  if (!spec.ok()) return spec.error();
  std::set<std::string> refused;
  for (const auto& f : refused_) refused.insert(f.exposure_id());
  // Refused mappings are not in the kernel on purpose: the spec reconciled is what was applied.
  std::erase_if(spec->rules, [&](const ExposureRule& r) { return refused.count(r.exposure_id); });
  auto found = ReconcileExposures(*spec, opts_.ctx);
  if (!found.ok()) {
    log_.Warn("exposure check failed", {{"error", found.error().ToString()}});
    return std::vector<std::string>{reason::kExposureCheckFailed.str()};
  }
  for (const auto& d : *found) {
    auto* x = &drift_.emplace_back();
    x->set_exposure_id(d.exposure_id);
    x->set_kind(d.kind);
    x->set_detail(d.detail);
  }
  if (!found->empty()) {
    log_.Warn(
        "exposure rules drifted from the applied document; repaired",
        {{"version", std::to_string(doc.version())}, {"drift", std::to_string(found->size())}});
  }
  return std::vector<std::string>{};
}

Result<void> ExposureAgent::Ack(int64_t version, const std::vector<std::string>& blockers) {
  v1::AckNodeExposuresRequest ack;
  ack.set_node_id(opts_.node_id);
  ack.set_version(version);
  for (const auto& b : blockers) ack.add_blockers(b);
  for (const auto& f : refused_) *ack.add_refused() = f;
  for (const auto& d : drift_) *ack.add_drift() = d;
  ack.set_simulated(opts_.mode == "simulate");
  auto r = rpc::Client(nats_()).Call<v1::AckNodeExposuresResponse>(
      "gpuaas.v1.ingress.node.{node_id}.exposures.ack", ack, opts_.timeout);
  if (!r.ok()) return r.error();
  drift_acked_ = !drift_.empty();
  drift_.clear();
  return Ok();
}

void ExposureAgent::StepLocked() {
  const bool drift_was_acked = drift_acked_;
  auto round = follower_->Step(std::chrono::steady_clock::now());
  if (round.fetch_error) {
    log_.Debug("exposure document not fetched", {{"error", round.fetch_error->ToString()}});
  }
  if (round.apply_error) {
    log_.Warn("exposure document not applied", {{"error", round.apply_error->ToString()}});
  }
  if (round.acked_now || follower_->applied_version() == 0) return;
  // The follower acks on a new version or new blockers. Drift is news too, and so is the clean
  // check after it (ingress brings drifted exposures back to active on a clean ack).
  if (!drift_.empty() || (round.checked && drift_was_acked)) {
    if (auto a = Ack(follower_->applied_version(), round.blockers); !a.ok()) {
      log_.Warn("exposure drift not acked; will ack again", {{"error", a.error().ToString()}});
    }
  }
}

void ExposureAgent::Step() {
  std::lock_guard lock(mu_);
  StepLocked();
}

int64_t ExposureAgent::AppliedVersion() {
  std::lock_guard lock(mu_);
  return follower_->applied_version();
}

Result<void> ExposureAgent::WaitRemoved(const std::vector<std::string>& target_ips,
                                        std::chrono::milliseconds timeout) {
  const auto until = std::chrono::steady_clock::now() + timeout;
  std::string why;
  while (true) {
    {
      std::lock_guard lock(mu_);
      StepLocked();
      why.clear();
      if (const auto& doc = follower_->applied()) {
        for (const auto& m : doc->mappings()) {
          if (std::find(target_ips.begin(), target_ips.end(), m.target_ip()) != target_ips.end()) {
            why = fmt::format("exposure document {} still maps {}:{} to {}:{}", doc->version(),
                              m.public_ip(), m.public_port(), m.target_ip(), m.target_port());
            break;
          }
        }
      }
      if (why.empty() && opts_.mode != "simulate") {
        for (const auto& ip : target_ips) {
          auto none = NoExposureFor(ip, opts_.ctx);
          if (!none.ok()) {
            why = none.error().ToString();
          } else if (!*none) {
            why = "a rule in table ip gpuaas_ingress still targets " + ip;
          }
          if (!why.empty()) break;
        }
      }
    }
    if (why.empty()) return Ok();
    if (std::chrono::steady_clock::now() >= until) {
      return Error::Unavailable(reason::kExposureStillMapped, why);
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(250));
  }
}

}  // namespace gpuaas::node_agent
