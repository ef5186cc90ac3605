#pragma once
// The agent side of a versioned per-node document (libs/common documents.hpp): inventory's
// desired slot set, ipam's network document, ingress's exposure document. Each round fetches
// the latest version, applies it when its version is new, acks it, and (with a `check` hook)
// periodically checks the host against the applied document and acks again when the blockers
// change. What "fetch", "apply", "check" and "ack" mean is the caller's (hooks); the order and
// the bookkeeping are here, once:
// - a document is acked only after it was applied: the control plane never shows a document
//   applied before it is (an apply failure is not acked and is tried again next round);
// - a failed ack is retried next round (without applying again);
// - a failed fetch keeps the last applied document (the caller decides what the error means,
//   e.g. isolation when the control plane does not know the node);
// - version 0 means nothing is desired yet: nothing is applied.
// Not thread-safe: one thread steps it; callers that share applied() guard it themselves.
#include <chrono>
#include <cstdint>
#include <functional>
#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "gpuaas/common/result.hpp"

namespace gpuaas::node_agent {

// Doc: a protobuf document message with `int64 version()`.
template <typename Doc>
class DocumentFollower {
 public:
  struct Hooks {
    std::function<Result<Doc>()> fetch;             // the latest document (version 0: none)
    std::function<Result<void>(const Doc&)> apply;  // make the host match it
    // Optional: the blockers after checking (and repairing) the host against the applied
    // document; an error keeps the blockers as they were.
    std::function<Result<std::vector<std::string>>(const Doc&)> check;
    std::function<Result<void>(int64_t version, const std::vector<std::string>& blockers)> ack;
  };

  // What one round did, for the caller's logs and follow-up work.
  struct Round {
    bool applied_now = false;           // a new version was applied this round
    bool checked = false;               // check ran this round
    bool acked_now = false;             // an ack was accepted this round
    std::vector<std::string> blockers;  // the current blockers of the applied document
    std::optional<Error> fetch_error;
    std::optional<Error> apply_error;
    std::optional<Error> check_error;
    std::optional<Error> ack_error;
  };

  DocumentFollower(Hooks hooks, std::chrono::steady_clock::duration check_interval)
      : hooks_(std::move(hooks)), check_interval_(check_interval) {}

  // A document applied and acked before a restart (kept in the agent's local store): it is
  // not applied or acked again unless the control plane's version differs.
  void Restore(Doc doc) {
    acked_version_ = doc.version();
    acked_blockers_.clear();
    blockers_.clear();
    applied_ = std::move(doc);
  }

  // One round: fetch; apply + ack when the version is new; every check interval (and right
  // after an apply) check, and ack again when the blockers changed; retry a failed ack.
  Round Step(std::chrono::steady_clock::time_point now) {
    Round round;
    auto fetched = hooks_.fetch();
    if (!fetched.ok()) {
      round.fetch_error = std::move(fetched.error());
    } else if (fetched->version() > 0 && fetched->version() != applied_version()) {
      if (auto applied = hooks_.apply(*fetched); !applied.ok()) {
        round.apply_error = std::move(applied.error());
        round.blockers = blockers_;
        return round;
      }
      applied_ = std::move(*fetched);
      blockers_.clear();
      round.applied_now = true;
    }
    if (applied_ && hooks_.check &&
        (round.applied_now || !checked_at_ || now - *checked_at_ >= check_interval_)) {
      checked_at_ = now;
      round.checked = true;
      auto checked = hooks_.check(*applied_);
      if (checked.ok()) {
        blockers_ = std::move(*checked);
      } else {
        round.check_error = std::move(checked.error());
      }
    }
    if (applied_ && (applied_version() != acked_version_ || blockers_ != acked_blockers_)) {
      if (auto acked = hooks_.ack(applied_version(), blockers_); !acked.ok()) {
        round.ack_error = std::move(acked.error());
      } else {
        acked_version_ = applied_version();
        acked_blockers_ = blockers_;
        round.acked_now = true;
      }
    }
    round.blockers = blockers_;
    return round;
  }

  // The document the host was last made to match (nullopt: none yet).
  const std::optional<Doc>& applied() const { return applied_; }
  int64_t applied_version() const { return applied_ ? applied_->version() : 0; }
  // The version the control plane accepted an ack of (0: none yet).
  int64_t acked_version() const { return acked_version_; }

 private:
  Hooks hooks_;
  std::chrono::steady_clock::duration check_interval_;
  std::optional<Doc> applied_;
  std::vector<std::string> blockers_;
  int64_t acked_version_ = 0;
  std::vector<std::string> acked_blockers_;
  std::optional<std::chrono::steady_clock::time_point> checked_at_;
};

}  // namespace gpuaas::node_agent
