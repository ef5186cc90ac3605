#pragma once
// console-gw's SQL for token revocations (table token_revocations, migration 0002). Every
// function runs in the caller's transaction.
#include <pqxx/pqxx>

#include <optional>
#include <string>
#include <vector>

#include "gpuaas/common/result.hpp"

namespace gpuaas::v1 {
class TokenRevocation;
}

namespace gpuaas::console_gw {

// The revocation in force (expires_at in the future) of token `jti`, or the newest of principal
// `subject` (one of the two is "").
std::optional<v1::TokenRevocation> FindRevocation(pqxx::work& tx, const std::string& jti,
                                                  const std::string& subject);
// Stores `r` and appends its event (gpuaas.v1.evt.auth.token.revoked) to the outbox; false (and
// nothing stored) when its token is revoked already.
Result<bool> InsertRevocation(pqxx::work& tx, const std::string& source,
                              const v1::TokenRevocation& r);
// The revocations in force, newest first.
std::vector<v1::TokenRevocation> ListRevocations(pqxx::work& tx);

}  // namespace gpuaas::console_gw
