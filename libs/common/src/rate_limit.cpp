#include "gpuaas/common/rate_limit.hpp"

#include <algorithm>
#include <cmath>
#include <set>
#include <sstream>

#include <fmt/format.h>

#include "gpuaas/common/reasons.hpp"

namespace gpuaas::ratelimit {

std::string SubjectClass(const std::string& address) {
  static const std::set<std::string> kReads = {"get", "list", "show", "timeline"};
  const auto dot = address.rfind('.');
  const std::string verb = dot == std::string::npos ? address : address.substr(dot + 1);
  return kReads.count(verb) > 0 ? kClassRead : kClassWrite;
}

namespace {
Error Invalid(const std::string& entry, const std::string& why) {
  return Error::InvalidArgument(
      reason::kInvalidRateLimits,
      fmt::format("rate limit '{}': {} (want <role>.<read|write>=<per_s>:<burst>)", entry, why),
      {{"entry", entry}});
}

Result<double> Number(const std::string& entry, const std::string& text) {
  try {
    size_t used = 0;
    const double v = std::stod(text, &used);
    if (used != text.size() || !std::isfinite(v) || v <= 0) return Invalid(entry, "not > 0");
    return v;
  } catch (const std::exception&) {
    return Invalid(entry, "not a number");
  }
}
}  // namespace

Result<Limits> ParseLimits(const std::string& text) {
  Limits out;
  std::stringstream ss(text);
  std::string entry;
  while (std::getline(ss, entry, ',')) {
    entry.erase(0, entry.find_first_not_of(" \t"));
    entry.erase(entry.find_last_not_of(" \t") + 1);
    if (entry.empty()) continue;
    const auto eq = entry.find('=');
    const auto dot = entry.find('.');
    const auto colon = entry.find(':', eq == std::string::npos ? 0 : eq);
    if (eq == std::string::npos || dot == std::string::npos || dot > eq ||
        colon == std::string::npos) {
      return Invalid(entry, "malformed");
    }
    const std::string role = entry.substr(0, dot);
    const std::string klass = entry.substr(dot + 1, eq - dot - 1);
    if (role.empty() || (klass != kClassRead && klass != kClassWrite)) {
      return Invalid(entry, "the class is read or write");
    }
    auto rate = Number(entry, entry.substr(eq + 1, colon - eq - 1));
    if (!rate.ok()) return rate.error();
    auto burst = Number(entry, entry.substr(colon + 1));
    if (!burst.ok()) return burst.error();
    if (*burst < 1) return Invalid(entry, "the burst is at least 1");
    if (!out.emplace(std::make_pair(role, klass), Limit{*rate, *burst}).second) {
      return Invalid(entry, "listed twice");
    }
  }
  return out;
}

std::optional<Limit> Limiter::LimitFor(const std::vector<std::string>& roles,
                                       const std::string& klass) const {
  std::optional<Limit> best;
  for (const auto& r : roles) {
    auto it = limits_.find({r, klass});
    if (it == limits_.end()) return std::nullopt;  // a role without a limit: unlimited
    if (!best || it->second.per_second > best->per_second) best = it->second;
  }
  return best;
}

std::optional<std::chrono::milliseconds> Limiter::Take(const std::string& principal,
                                                       const std::vector<std::string>& roles,
                                                       const std::string& klass,
                                                       Clock::time_point now) {
  const auto limit = LimitFor(roles, klass);
  if (!limit) return std::nullopt;
  std::lock_guard lock(mu_);
  if (buckets_.size() >= max_buckets_) {
    // Bounded: a full bucket is the same as none, so forget those first, and all if need be.
    for (auto it = buckets_.begin(); it != buckets_.end();) {
      const double dt = std::chrono::duration<double>(now - it->second.at).count();
      it = it->second.tokens + dt * limit->per_second >= limit->burst ? buckets_.erase(it)
                                                                      : std::next(it);
    }
    if (buckets_.size() >= max_buckets_) buckets_.clear();
  }
  auto [it, fresh] = buckets_.try_emplace(principal + "\n" + klass, Bucket{limit->burst, now});
  Bucket& b = it->second;
  if (!fresh) {
    const double dt = std::max(0.0, std::chrono::duration<double>(now - b.at).count());
    b.tokens = std::min(limit->burst, b.tokens + dt * limit->per_second);
    b.at = now;
  }
  if (b.tokens >= 1) {
    b.tokens -= 1;
    return std::nullopt;
  }
  const double wait_s = (1 - b.tokens) / limit->per_second;
  return std::chrono::milliseconds(static_cast<int64_t>(std::ceil(wait_s * 1000)));
}

}  // namespace gpuaas::ratelimit
