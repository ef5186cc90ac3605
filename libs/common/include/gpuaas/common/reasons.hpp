#pragma once
// libs/common's reason registry: every reason (Status.reason, Error::reason) the shared library
// produces, by area. The texts are the wire contract: never change one; add a new one instead.
// Each entry: its code and what it means (libs/common/README.md "Reasons" lists them all).
// Services keep their own reasons in their own registry (<svc>_reasons.hpp) and compare with
// these as `gpuaas::reason::kX`.
#include <string>
#include <string_view>

#include "gpuaas/common/result.hpp"

namespace gpuaas::reason {

// ---- rpc: the request/reply server and client (rpc.hpp) ----
inline constexpr Reason kPayloadTooLarge{"payload_too_large"};       // INVALID_ARGUMENT: too big
inline constexpr Reason kUnknownSubject{"unknown_subject"};          // INVALID_ARGUMENT: not served
inline constexpr Reason kUnsupportedVersion{"unsupported_version"};  // INVALID_ARGUMENT: not v1
inline constexpr Reason kDeadlineExceeded{"deadline_exceeded"};      // DEADLINE_EXCEEDED: too late
inline constexpr Reason kHandlerException{"handler_exception"};      // INTERNAL: the handler threw
inline constexpr Reason kRoleNotAllowed{"role_not_allowed"};  // PERMISSION_DENIED: no allowed role
// PERMISSION_DENIED: a client connection presented a token its role may not (roles.yaml
// token_roles: a tenant-api connection with an operator or auditor token).
inline constexpr Reason kTokenRoleNotAllowedForConnection{"token_role_not_allowed_for_connection"};
inline constexpr Reason kMalformedPayload{"malformed_payload"};  // INVALID_ARGUMENT: unparsable
inline constexpr Reason kMalformedReply{"malformed_reply"};      // INTERNAL: reply does not parse
inline constexpr Reason kUnexpectedReplyType{"unexpected_reply_type"};  // INTERNAL: wrong result
inline constexpr Reason kInvalidPageSize{"invalid_page_size"};  // INVALID_ARGUMENT: page_size range
// PERMISSION_DENIED: a node-scoped subject's node differs from the request's node_id (a node
// asking about, or acking for, another node).
inline constexpr Reason kNodeIdMismatch{"node_id_mismatch"};
// INVALID_ARGUMENT: a node-scoped request without the node_id its subject is bound to.
inline constexpr Reason kNodeIdMissing{"node_id_missing"};
// RESOURCE_EXHAUSTED: this principal sent more requests of this class than its role's limit
// (rate_limit.hpp; details: retry_after_ms, class). Retryable after the wait.
inline constexpr Reason kRateLimited{"rate_limited"};
// INVALID_ARGUMENT: `rpc.rate_limits` does not parse (details: entry).
inline constexpr Reason kInvalidRateLimits{"invalid_rate_limits"};

// ---- validate: checks every decoded request gets (validate.hpp) ----
inline constexpr Reason kStringHasNul{"string_has_nul"};  // INVALID_ARGUMENT: text has NUL

// ---- messaging: NATS and JetStream (messaging.hpp) ----
inline constexpr Reason kNatsTimeout{"nats_timeout"};    // DEADLINE_EXCEEDED: no reply in time
inline constexpr Reason kNoResponders{"no_responders"};  // UNAVAILABLE: nobody serves the subject
inline constexpr Reason kNatsUnavailable{"nats_unavailable"};  // UNAVAILABLE: not connected to NATS
inline constexpr Reason kNatsError{"nats_error"};  // UNAVAILABLE: any other NATS failure
inline constexpr Reason kNatsPermissionDenied{"nats_permission_denied"};  // PERMISSION_DENIED
inline constexpr Reason kNoMessage{"no_message"};  // NOT_FOUND: no stored message on the subject
inline constexpr Reason kNotJetstream{"not_jetstream"};  // FAILED_PRECONDITION: no ack subject
// UNAVAILABLE: a stream the service uses is not declared yet (run `gpuaasctl streams apply`).
inline constexpr Reason kStreamMissing{"stream_missing"};
// FAILED_PRECONDITION: a declared stream lacks subjects this build uses (details: missing);
// `gpuaasctl streams apply` of this release updates it.
inline constexpr Reason kStreamOutdated{"stream_outdated"};

// ---- store: PostgreSQL pool, transactions, migrations (store.hpp) ----
inline constexpr Reason kDbPoolExhausted{"db_pool_exhausted"};  // RESOURCE_EXHAUSTED: pool full
inline constexpr Reason kDbUnavailable{"db_unavailable"};       // UNAVAILABLE: database unreachable
// UNAVAILABLE: the connection broke during COMMIT, so whether it committed is unknown; not
// retried inside (the unit may not be idempotent): the caller retries with the same request_id.
inline constexpr Reason kDbCommitInDoubt{"db_commit_in_doubt"};
// UNAVAILABLE: the server reached is a standby (in recovery), not the primary.
inline constexpr Reason kDbNotPrimary{"db_not_primary"};
// UNAVAILABLE: the server is out of a resource (SQLSTATE class 53: disk full, memory,
// connections; details: sqlstate). Nothing was written, and the resource may come back.
inline constexpr Reason kDbInsufficientResources{"db_insufficient_resources"};
inline constexpr Reason kTxConflict{"tx_conflict"};  // ABORTED: serialization failure/deadlock
inline constexpr Reason kDbError{"db_error"};   // INTERNAL: other SQL error (details: sqlstate)
inline constexpr Reason kInternal{"internal"};  // INTERNAL: unexpected exception in a transaction
inline constexpr Reason kMigrationChanged{"migration_changed"};  // FAILED_PRECONDITION: edited

// ---- outbox (outbox.hpp) ----
inline constexpr Reason kBadEventSubject{"bad_event_subject"};  // INTERNAL: not evt/node subject

// ---- documents: versioned node documents and acks (documents.hpp) ----
inline constexpr Reason kDocumentWithoutVersion{"document_without_version"};     // INTERNAL
inline constexpr Reason kDocumentVersionNotFound{"document_version_not_found"};  // NOT_FOUND
inline constexpr Reason kCorruptDocument{"corrupt_document"};  // INTERNAL: stored JSON unparsable
inline constexpr Reason kInvalidVersion{"invalid_version"};    // INVALID_ARGUMENT: ack version < 0
inline constexpr Reason kInvalidBlocker{"invalid_blocker"};    // INVALID_ARGUMENT: not snake_case
inline constexpr Reason kUnknownVersion{"unknown_version"};    // INVALID_ARGUMENT: ack past latest

// ---- auth: request tokens (auth.hpp) ----
inline constexpr Reason kTokenMissing{"token_missing"};      // UNAUTHENTICATED: no token
inline constexpr Reason kTokenMalformed{"token_malformed"};  // UNAUTHENTICATED: not a JWS/JWT
inline constexpr Reason kTokenAlgorithm{"token_algorithm"};  // UNAUTHENTICATED: not ES256
inline constexpr Reason kTokenSignature{"token_signature"};  // UNAUTHENTICATED: unverified
inline constexpr Reason kTokenClaims{"token_claims"};        // UNAUTHENTICATED: a claim is wrong
// UNAUTHENTICATED: signed by the tenant issuer's key, which may grant the tenant role only
// (auth::VerifyIssuedToken; details: role).
inline constexpr Reason kTokenIssuerRole{"token_issuer_role"};
inline constexpr Reason kTokenExpired{"token_expired"};  // UNAUTHENTICATED: past exp
// UNAUTHENTICATED: the token, or its principal as of the token's iat, is revoked
// (revocations.hpp; details: jti or sub).
inline constexpr Reason kTokenRevoked{"token_revoked"};
inline constexpr Reason kTokenTtlInvalid{"token_ttl_invalid"};  // INVALID_ARGUMENT: ttl range
inline constexpr Reason kTokenIssue{"token_issue"};  // INTERNAL: libjwt could not build the token
inline constexpr Reason kPrincipalInvalid{"principal_invalid"};     // INVALID_ARGUMENT: claims
inline constexpr Reason kSigningKeyInvalid{"signing_key_invalid"};  // INVALID_ARGUMENT: not P-256
inline constexpr Reason kSigningKeyCrypto{"signing_key_crypto"};    // INTERNAL: keygen failed

// ---- auth: NATS nkeys and secret files (auth.hpp) ----
inline constexpr Reason kNkeySeedInvalid{"nkey_seed_invalid"};  // INVALID_ARGUMENT: not a seed
inline constexpr Reason kNkeyCrypto{"nkey_crypto"};           // INTERNAL: ed25519 operation failed
inline constexpr Reason kNkeySignFailed{"nkey_sign_failed"};  // INTERNAL: ed25519 signing failed
inline constexpr Reason kSeedFileMissing{"seed_file_missing"};  // NOT_FOUND: seed file unreadable
inline constexpr Reason kSeedFileMode{"seed_file_mode"};      // FAILED_PRECONDITION: not 0600/0400
inline constexpr Reason kSecretFilePath{"secret_file_path"};  // INVALID_ARGUMENT: not a file path
inline constexpr Reason kSecretFileWrite{"secret_file_write"};  // INTERNAL: cannot write it

// ---- access: the contract's NATS permissions and node enrolment (access.hpp) ----
inline constexpr Reason kFileMissing{"file_missing"};  // NOT_FOUND: a file cannot be read
inline constexpr Reason kContractUnreadable{"contract_unreadable"};  // FAILED_PRECONDITION
inline constexpr Reason kContractAccess{"contract_access"};  // FAILED_PRECONDITION: bad access
inline constexpr Reason kRoleUnknown{"role_unknown"};        // NOT_FOUND: no such contract role
inline constexpr Reason kNodeId{"node_id"};  // INVALID_ARGUMENT: node id for node roles only
inline constexpr Reason kNkeyInvalid{"nkey_invalid"};  // INVALID_ARGUMENT: not a user public nkey
inline constexpr Reason kWriteFailed{"write_failed"};  // INTERNAL: cannot write or rename a file
inline constexpr Reason kKeysDir{"keys_dir"};          // INTERNAL: cannot create the keys directory
inline constexpr Reason kNodeIdInvalid{"node_id_invalid"};  // INVALID_ARGUMENT: not a node id
inline constexpr Reason kNodeEnrolled{"node_enrolled"};     // ALREADY_EXISTS: node already enrolled
inline constexpr Reason kNodeNotEnrolled{"node_not_enrolled"};  // NOT_FOUND: node not enrolled

// ---- contract: the recorded/embedded contract (contract.hpp) ----
inline constexpr Reason kUnknownRole{"unknown_role"};  // INVALID_ARGUMENT: not a contract role
inline constexpr Reason kMalformedContract{"malformed_contract"};  // INVALID_ARGUMENT: bad JSON

// ---- config (config.hpp) ----
inline constexpr Reason kConfigUnreadable{"config_unreadable"};     // INVALID_ARGUMENT: unreadable
inline constexpr Reason kConfigYamlInvalid{"config_yaml_invalid"};  // INVALID_ARGUMENT: bad YAML
inline constexpr Reason kConfigInvalid{"config_invalid"};  // INVALID_ARGUMENT: problems in details

// ---- dlq: dead letters (dlq.hpp) ----
inline constexpr Reason kDeadLetterNotFound{"dead_letter_not_found"};   // NOT_FOUND
inline constexpr Reason kDlqSequenceRequired{"dlq_sequence_required"};  // INVALID_ARGUMENT
inline constexpr Reason kDeadLetterMalformed{"dead_letter_malformed"};  // FAILED_PRECONDITION
inline constexpr Reason kConsumerNotOwned{"consumer_not_owned"};  // NOT_FOUND: not this service's
inline constexpr Reason kConsumerUnknown{"consumer_unknown"};     // NOT_FOUND: no such durable

// ---- http, runtime, proto_json, allocation_event ----
inline constexpr Reason kHttpBindFailed{"http_bind_failed"};  // UNAVAILABLE: cannot listen
inline constexpr Reason kHttpGetFailed{"http_get_failed"};    // UNAVAILABLE: an HTTP GET failed
inline constexpr Reason kTokenKeyUnreadable{"token_public_key_unreadable"};  // INVALID_ARGUMENT
inline constexpr Reason kNatsDisconnected{"nats_disconnected"};  // UNAVAILABLE: readiness check
inline constexpr Reason kMalformedJson{"malformed_json"};    // INVALID_ARGUMENT: not the JSON form
inline constexpr Reason kMalformedEvent{"malformed_event"};  // INVALID_ARGUMENT: bad alloc event

// ---- enums: a value outside a closed set (enums.hpp) ----
// INVALID_ARGUMENT `<field>_invalid` (enums::InvalidValue/ParseField/RequireSpecified without a
// Reason of their own): the text is made from the field's name, e.g. "datapath_invalid".
inline std::string FieldInvalid(std::string_view field) { return std::string(field) + "_invalid"; }

}  // namespace gpuaas::reason
