// gpuaas.v1.console.token.{revoke,revocation.list}: console-gw keeps the platform's record of
// revoked request tokens; every service follows them (libs/common revocations.hpp).
#include <google/protobuf/util/time_util.h>

#include <map>

#include "console_gw_routes.hpp"
#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/console_gw/console_gw_reasons.hpp"
#include "gpuaas/v1/console.pb.h"
#include "revocation_store.hpp"

namespace gpuaas::console_gw {

namespace {

using google::protobuf::util::TimeUtil;

// How long a revocation stays in force: no token it covers can be valid after it (the longest
// token life, plus the clock skew verification allows, rounded up).
constexpr std::chrono::seconds kRevocationLife = auth::kMaxTokenTtl + std::chrono::minutes(2);

// INVALID_ARGUMENT invalid_revocation unless exactly one of jti (a UUID) and subject is given.
Result<void> CheckRevokeRequest(const v1::RevokeTokenRequest& req) {
  std::map<std::string, std::string> bad;
  if (req.jti().empty() == req.subject().empty()) {
    bad["jti"] = "give exactly one of jti and subject";
  } else if (!req.jti().empty() && !ids::IsUuid(req.jti())) {
    bad["jti"] = "not a UUID (a token's jti)";
  } else if (req.subject().size() > 256) {
    bad["subject"] = "at most 256 characters";
  }
  if (req.reason().size() > 256) bad["reason"] = "at most 256 characters";
  if (bad.empty()) return Ok();
  return Error::InvalidArgument(reason::kInvalidRevocation, "token revocation is invalid", bad);
}

}  // namespace

TokenHandlers::TokenHandlers(std::shared_ptr<store::Pool> pool, std::string source)
    : pool_(std::move(pool)), source_(std::move(source)) {}

Result<v1::RevokeTokenResponse> TokenHandlers::Revoke(const v1::RevokeTokenRequest& req,
                                                      rpc::Context& ctx) const {
  if (auto c = CheckRevokeRequest(req); !c.ok()) return c.error();
  const auto now = std::chrono::system_clock::now();
  v1::TokenRevocation r;
  r.set_revocation_id(ids::NewUuidV7());
  r.set_jti(req.jti());
  r.set_subject(req.subject());
  *r.mutable_revoked_at() = TimeUtil::MillisecondsToTimestamp(
      std::chrono::duration_cast<std::chrono::milliseconds>(now.time_since_epoch()).count());
  r.set_revoked_by(ctx.principal.subject);
  r.set_reason(req.reason());
  *r.mutable_expires_at() =
      TimeUtil::MillisecondsToTimestamp(std::chrono::duration_cast<std::chrono::milliseconds>(
                                            (now + kRevocationLife).time_since_epoch())
                                            .count());
  return store::WithTx(*pool_, [&](pqxx::work& tx) -> Result<v1::RevokeTokenResponse> {
    v1::RevokeTokenResponse resp;
    auto created = InsertRevocation(tx, source_, r);
    if (!created.ok()) return created.error();
    resp.set_created(*created);
    if (*created) {
      ctx.log.Info("token revoked", {{"jti", r.jti()}, {"sub", r.subject()}});
      *resp.mutable_revocation() = r;
    } else {
      *resp.mutable_revocation() = FindRevocation(tx, r.jti(), "").value_or(r);
    }
    return resp;
  });
}

Result<v1::ListTokenRevocationsResponse> TokenHandlers::List(
    const v1::ListTokenRevocationsRequest& /*req*/, rpc::Context& /*ctx*/) const {
  return store::WithTx(
      *pool_,
      [&](pqxx::work& tx) -> Result<v1::ListTokenRevocationsResponse> {
        v1::ListTokenRevocationsResponse resp;
        for (auto& r : ListRevocations(tx)) *resp.add_revocations() = std::move(r);
        return resp;
      },
      store::ReadSnapshot());
}

}  // namespace gpuaas::console_gw
