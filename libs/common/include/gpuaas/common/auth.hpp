#pragma once
// Identity primitives. Two separate questions get two separate answers:
// - Which process is on this NATS connection? NATS nkeys (ed25519 user keys): each service or
//   node agent holds a seed file, nats-server holds the public keys, and a connection without a
//   listed key is refused. That is transport identity: it says nothing about who asked.
// - Who asked for this change? A request token: a short-lived JWT (ES256) naming a principal and
//   its roles, sent as "Authorization: Bearer <jwt>" and verified by the service that acts on it
//   against the issuer's public keys (several while a key rotates).
// Everything here is pure except the seed/secret file helpers.
#include <chrono>
#include <string>
#include <string_view>
#include <vector>

#include "gpuaas/common/result.hpp"

namespace gpuaas::auth {

// ---- NATS nkeys (user keys) ----
// ed25519 keys in the NATS encoding: base32 (RFC 4648 alphabet, no padding) of a prefix byte, the
// 32-byte key and a CRC16/XMODEM of both, little-endian.
struct NKeyPair {
  std::string seed;        // "SU..." (58 characters): the secret
  std::string public_key;  // "U..." (56 characters)
};

// A fresh random user key.
Result<NKeyPair> NewUserNKey();
// The public key of a user seed; INVALID_ARGUMENT nkey_seed_invalid on bad base32, a bad CRC or a
// seed that is not a user seed.
Result<std::string> NKeyPublicFromSeed(const std::string& seed);
// A well-formed user public key ("U...", valid CRC).
bool IsUserPublicKey(const std::string& key);
// The Ed25519 signature (64 bytes) of `data` by the user seed `seed` (OpenSSL): what a NATS
// client sends for the server's nonce. INVALID_ARGUMENT nkey_seed_invalid on a bad seed.
Result<std::string> SignWithSeed(const std::string& seed, std::string_view data);
// Reads a seed file, surrounding whitespace trimmed. NOT_FOUND seed_file_missing when it is
// missing or unreadable, FAILED_PRECONDITION seed_file_mode when group or others may read it (a
// secret must be 0600 or 0400), INVALID_ARGUMENT nkey_seed_invalid when it holds no user seed.
Result<std::string> ReadSeedFile(const std::string& path);
// Writes a secret file atomically (a temporary file in the same directory, then rename) with
// mode 0600; creates the parent directory (0700) when missing.
Result<void> WriteSecretFile(const std::string& path, const std::string& content);

// ---- request tokens: JWT, ES256 (EC P-256) ----
struct SigningKey {
  std::string private_pem;  // PKCS#8 PEM
  std::string public_pem;   // SubjectPublicKeyInfo PEM
};
Result<SigningKey> NewSigningKey();

inline constexpr const char* kHeaderAuthorization = "Authorization";  // value "Bearer <jwt>"
inline constexpr const char* kRoleOperator = "operator";
inline constexpr const char* kRoleTenant = "tenant";
inline constexpr const char* kRoleAuditor = "auditor";

struct Principal {
  std::string subject;                            // JWT "sub": "user:alice", "tenant:acme/bob"
  std::string tenant;                             // claim "tenant": set only for tenant principals
  std::vector<std::string> roles;                 // claim "roles": operator | tenant | auditor
  std::string token_id;                           // "jti"
  std::chrono::system_clock::time_point expires;  // "exp"
  std::chrono::system_clock::time_point issued;   // "iat"
  bool HasRole(const std::string& role) const;
};

inline constexpr std::chrono::seconds kMaxTokenTtl{24 * 3600};

// Signs {iss: "gpuaas", aud: "gpuaas", sub, tenant (when set), roles, jti (a fresh UUIDv7),
// iat = now, exp = now + ttl}. `principal.token_id` and `expires` are ignored. INVALID_ARGUMENT
// for an empty subject, no roles, a role outside the three, the tenant role without a tenant (or
// a tenant without the tenant role), a subject or tenant that is not UTF-8 or holds a control
// character (all these: principal_invalid, details.claim), ttl <= 0 or > kMaxTokenTtl, or a key
// that is not an EC P-256 private key.
Result<std::string> IssueToken(
    const std::string& private_pem, const Principal& principal, std::chrono::seconds ttl,
    std::chrono::system_clock::time_point now = std::chrono::system_clock::now());

// Verifies a token against any of `public_pems` (key rotation). Only ES256 is accepted; the
// header's algorithm is checked before anything else is trusted. Claims: iss and aud "gpuaas",
// exp > now - 30 s, iat <= now + 30 s, exp - iat <= kMaxTokenTtl, roles non-empty and known, the
// tenant rule as for IssueToken. Errors are UNAUTHENTICATED with reason token_missing (empty),
// token_malformed, token_algorithm, token_signature (no key verifies it), token_expired or
// token_claims (the message names the claim).
Result<Principal> VerifyToken(
    const std::string& token, const std::vector<std::string>& public_pems,
    std::chrono::system_clock::time_point now = std::chrono::system_clock::now());

// The two issuers of request tokens. The platform's key (`auth.token_public_keys`; gpuaasctl
// auth login) may sign any role; a tenant issuer's key (`auth.tenant_token_public_keys`: the
// tenant gateway's own signing key) may sign tenant tokens only, so a tenant-facing issuer that
// leaks or misbehaves can never mint an operator or auditor. Verifies against the platform keys,
// then (only on token_signature) the tenant keys; a tenant-issued token with any role but
// `tenant` is UNAUTHENTICATED token_issuer_role. Each key list may hold several keys (rotation).
Result<Principal> VerifyIssuedToken(
    const std::string& token, const std::vector<std::string>& platform_pems,
    const std::vector<std::string>& tenant_pems,
    std::chrono::system_clock::time_point now = std::chrono::system_clock::now());

// "Bearer <jwt>" -> "<jwt>" (the scheme is case-insensitive); "" when the value is not a bearer
// token.
std::string BearerToken(const std::string& header_value);

}  // namespace gpuaas::auth
