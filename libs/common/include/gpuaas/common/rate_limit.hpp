#pragma once
// Per-principal request rate limits at the rpc edge (rpc.hpp): a token bucket per principal and
// subject class, its rate and burst configured per token role. Pure: the caller passes the
// clock. A request without a token (a platform identity: a service, a node) is never limited.
//
// The subject class is what the served address's last token says: `get`, `list`, `show` and
// `timeline` read (class "read"); everything else may change state (class "write").
//
// Configuration (`rpc.rate_limits`, runtime.cpp): comma-separated `<role>.<class>=<per_s>:<burst>`,
// e.g. "tenant.write=20:40,tenant.read=100:200". A role and class not listed is not limited. A
// principal with several roles gets the most generous limit among them.
#include <chrono>
#include <map>
#include <mutex>
#include <optional>
#include <string>
#include <unordered_map>
#include <utility>
#include <vector>

#include "gpuaas/common/result.hpp"

namespace gpuaas::ratelimit {

inline constexpr const char* kClassRead = "read";
inline constexpr const char* kClassWrite = "write";

// The class of a served address (see above).
std::string SubjectClass(const std::string& address);

struct Limit {
  double per_second = 0;  // sustained requests per second
  double burst = 0;       // requests allowed at once (the bucket's size), >= 1
};

// (role, class) -> limit.
using Limits = std::map<std::pair<std::string, std::string>, Limit>;

// Parses the `rpc.rate_limits` text; INVALID_ARGUMENT invalid_rate_limits naming the bad entry.
Result<Limits> ParseLimits(const std::string& text);

// The default of `rpc.rate_limits`.
inline constexpr const char* kDefaultLimits =
    "tenant.write=20:40,tenant.read=200:400,operator.write=200:400,operator.read=1000:2000,"
    "auditor.read=500:1000";

class Limiter {
 public:
  using Clock = std::chrono::steady_clock;
  explicit Limiter(Limits limits, size_t max_buckets = 100000)
      : limits_(std::move(limits)), max_buckets_(max_buckets) {}

  // Takes one request of `principal` (holding `roles`) in `klass` at `now`: nullopt when it may
  // go ahead, else how long until it would be allowed.
  std::optional<std::chrono::milliseconds> Take(const std::string& principal,
                                                const std::vector<std::string>& roles,
                                                const std::string& klass, Clock::time_point now);
  // The limit that applies to `roles` in `klass` (nullopt: unlimited).
  std::optional<Limit> LimitFor(const std::vector<std::string>& roles,
                                const std::string& klass) const;

 private:
  struct Bucket {
    double tokens = 0;
    Clock::time_point at;
  };
  Limits limits_;
  size_t max_buckets_;
  std::mutex mu_;
  std::unordered_map<std::string, Bucket> buckets_;
};

}  // namespace gpuaas::ratelimit
