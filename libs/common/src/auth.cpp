#include "gpuaas/common/auth.hpp"

#include <fcntl.h>
#include <jwt.h>
#include <openssl/bio.h>
#include <openssl/crypto.h>
#include <openssl/evp.h>
#include <openssl/pem.h>
#include <openssl/rand.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <cctype>
#include <cerrno>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <memory>
#include <optional>
#include <string_view>
#include <utility>

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/common/validate.hpp"

namespace gpuaas::auth {
namespace {

using nlohmann::json;

// ---- RAII for the C handles ----
struct PkeyFree {
  void operator()(EVP_PKEY* p) const { EVP_PKEY_free(p); }
};
using PkeyPtr = std::unique_ptr<EVP_PKEY, PkeyFree>;
struct BioFree {
  void operator()(BIO* b) const { BIO_free(b); }
};
using BioPtr = std::unique_ptr<BIO, BioFree>;
struct JwtFree {
  void operator()(jwt_t* j) const { jwt_free(j); }
};
using JwtPtr = std::unique_ptr<jwt_t, JwtFree>;
// Strings libjwt allocates with malloc (jwt_encode_str, jwt_get_grants_json).
struct CFree {
  void operator()(char* s) const { std::free(s); }  // NOLINT(*-no-malloc)
};
using CStrPtr = std::unique_ptr<char, CFree>;

class Fd {
 public:
  explicit Fd(int fd) : fd_(fd) {}
  ~Fd() {
    if (fd_ >= 0) ::close(fd_);
  }
  Fd(const Fd&) = delete;
  Fd& operator=(const Fd&) = delete;
  int get() const { return fd_; }
  int Release() { return std::exchange(fd_, -1); }

 private:
  int fd_;
};

// Secret bytes, scrubbed when they go.
class SecretBytes {
 public:
  SecretBytes() = default;
  ~SecretBytes() { Wipe(); }
  SecretBytes(const SecretBytes&) = delete;
  SecretBytes& operator=(const SecretBytes&) = delete;
  std::vector<uint8_t>& get() { return v_; }
  const std::vector<uint8_t>& get() const { return v_; }
  void Wipe() {
    if (!v_.empty()) OPENSSL_cleanse(v_.data(), v_.size());
  }

 private:
  std::vector<uint8_t> v_;
};

// ---- NATS nkey encoding ----
constexpr uint8_t kPrefixSeed = 18 << 3;  // 'S'
constexpr uint8_t kPrefixUser = 20 << 3;  // 'U'
constexpr size_t kKeyLen = 32;
constexpr size_t kSeedChars = 58;    // base32 of 2 prefix bytes + 32 + 2 CRC bytes
constexpr size_t kPublicChars = 56;  // base32 of 1 prefix byte + 32 + 2 CRC bytes
constexpr std::string_view kBase32 = "ABCDEFGHIJKLMNOPQRSTUVWXYZ234567";

uint16_t Crc16(const uint8_t* data, size_t n) {  // CRC-16/XMODEM
  uint16_t crc = 0;
  for (size_t i = 0; i < n; ++i) {
    crc ^= static_cast<uint16_t>(data[i] << 8);
    for (int b = 0; b < 8; ++b) {
      crc = (crc & 0x8000) != 0 ? static_cast<uint16_t>((crc << 1) ^ 0x1021)
                                : static_cast<uint16_t>(crc << 1);
    }
  }
  return crc;
}

std::string Base32Encode(const std::vector<uint8_t>& data) {
  std::string out;
  uint32_t buf = 0;
  int bits = 0;
  for (uint8_t byte : data) {
    buf = (buf << 8) | byte;
    bits += 8;
    while (bits >= 5) {
      out += kBase32[(buf >> (bits - 5)) & 31];
      bits -= 5;
    }
    buf &= (1U << bits) - 1;
  }
  if (bits > 0) out += kBase32[(buf << (5 - bits)) & 31];
  return out;
}

// Strict: only the alphabet, no padding, and the unused trailing bits must be zero, so that
// every key has exactly one spelling (a changed last character cannot slip past the CRC).
bool Base32Decode(std::string_view s, std::vector<uint8_t>& out) {
  out.clear();
  uint32_t buf = 0;
  int bits = 0;
  for (char c : s) {
    const size_t v = kBase32.find(c);
    if (v == std::string_view::npos) return false;
    buf = (buf << 5) | static_cast<uint32_t>(v);
    bits += 5;
    if (bits >= 8) {
      out.push_back(static_cast<uint8_t>(buf >> (bits - 8)));
      bits -= 8;
    }
    buf &= (1U << bits) - 1;
  }
  return bits < 5 && buf == 0;
}

std::string EncodeChecked(std::vector<uint8_t> raw) {
  const uint16_t crc = Crc16(raw.data(), raw.size());
  raw.push_back(static_cast<uint8_t>(crc & 0xff));
  raw.push_back(static_cast<uint8_t>(crc >> 8));
  std::string out = Base32Encode(raw);
  OPENSSL_cleanse(raw.data(), raw.size());
  return out;
}

// Decodes and checks the CRC; `raw` keeps the bytes without the CRC.
bool DecodeChecked(std::string_view s, std::vector<uint8_t>& raw) {
  if (!Base32Decode(s, raw) || raw.size() < 3) return false;
  const size_t n = raw.size() - 2;
  const uint16_t want = static_cast<uint16_t>(raw[n] | (raw[n + 1] << 8));
  if (Crc16(raw.data(), n) != want) return false;
  raw.resize(n);
  return true;
}

Error SeedInvalid(const std::string& why) {
  return Error::InvalidArgument(reason::kNkeySeedInvalid, "not a NATS user seed: " + why);
}

std::string EncodeUserSeed(const uint8_t* key) {
  SecretBytes raw;
  raw.get().reserve(2 + kKeyLen);
  raw.get().push_back(kPrefixSeed | (kPrefixUser >> 5));
  raw.get().push_back(static_cast<uint8_t>((kPrefixUser & 31) << 3));
  raw.get().insert(raw.get().end(), key, key + kKeyLen);
  return EncodeChecked(raw.get());
}

Result<std::string> PublicFromRawSeed(const uint8_t* key) {
  PkeyPtr pkey(EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, key, kKeyLen));
  if (!pkey) return Error::Internal(reason::kNkeyCrypto, "cannot load an ed25519 key");
  std::vector<uint8_t> raw(1 + kKeyLen);
  raw[0] = kPrefixUser;
  size_t len = kKeyLen;
  if (EVP_PKEY_get_raw_public_key(pkey.get(), raw.data() + 1, &len) != 1 || len != kKeyLen) {
    return Error::Internal(reason::kNkeyCrypto, "cannot derive an ed25519 public key");
  }
  return EncodeChecked(std::move(raw));
}

std::string Trim(std::string_view s) {
  const auto space = [](char c) { return std::isspace(static_cast<unsigned char>(c)) != 0; };
  while (!s.empty() && space(s.front())) s.remove_prefix(1);
  while (!s.empty() && space(s.back())) s.remove_suffix(1);
  return std::string(s);
}

std::string Errno() { return std::strerror(errno); }

// ---- PEM keys ----
int NoPassphrase(char* /*buf*/, int /*size*/, int /*rwflag*/, void* /*u*/) { return -1; }

std::string BioString(BIO* bio) {
  char* data = nullptr;
  const long n = BIO_get_mem_data(bio, &data);
  return n > 0 ? std::string(data, static_cast<size_t>(n)) : std::string();
}

bool IsP256(EVP_PKEY* key) {
  if (EVP_PKEY_get_base_id(key) != EVP_PKEY_EC) return false;
  std::array<char, 64> name{};
  size_t len = 0;
  if (EVP_PKEY_get_group_name(key, name.data(), name.size(), &len) != 1) return false;
  const std::string_view group(name.data(), len);
  return group == "prime256v1" || group == "P-256" || group == "secp256r1";
}

bool IsP256PrivateKeyPem(const std::string& pem) {
  BioPtr bio(BIO_new_mem_buf(pem.data(), static_cast<int>(pem.size())));
  if (!bio) return false;
  PkeyPtr key(PEM_read_bio_PrivateKey(bio.get(), nullptr, NoPassphrase, nullptr));
  return key && IsP256(key.get());
}

// ---- tokens ----
constexpr const char* kIssuer = "gpuaas";
constexpr const char* kAudience = "gpuaas";
constexpr int64_t kLeewaySeconds = 30;

bool KnownRole(const std::string& role) {
  return role == kRoleOperator || role == kRoleTenant || role == kRoleAuditor;
}

// What is wrong with a principal's subject, tenant and roles, as {claim, message}; nullopt when
// nothing is.
std::optional<std::pair<std::string, std::string>> PrincipalProblem(
    const std::string& subject, const std::string& tenant, const std::vector<std::string>& roles) {
  if (subject.empty()) return std::pair{"sub", "the subject is empty"};
  if (roles.empty()) return std::pair{"roles", "no roles"};
  bool tenant_role = false;
  for (const auto& r : roles) {
    if (!KnownRole(r)) {
      return std::pair{"roles", fmt::format("unknown role '{}' (operator, tenant or auditor)", r)};
    }
    tenant_role = tenant_role || r == kRoleTenant;
  }
  if (tenant_role && tenant.empty()) {
    return std::pair{"tenant", "the tenant role needs a tenant"};
  }
  if (!tenant_role && !tenant.empty()) {
    return std::pair{"tenant", "a tenant is set only with the tenant role"};
  }
  return std::nullopt;
}

int64_t UnixSeconds(std::chrono::system_clock::time_point t) {
  return std::chrono::duration_cast<std::chrono::seconds>(t.time_since_epoch()).count();
}

Error Unauthenticated(Reason why, std::string message) {
  return Error::Of(Code::kUnauthenticated, why, std::move(message));
}
Error BadClaim(const std::string& claim, const std::string& message) {
  return Error::Of(Code::kUnauthenticated, reason::kTokenClaims, message, {{"claim", claim}},
                   false);
}

// base64url without padding, strictly (the JWS compact form).
bool Base64UrlDecode(std::string_view s, std::string& out) {
  out.clear();
  uint32_t buf = 0;
  int bits = 0;
  for (char c : s) {
    int v = -1;
    if (c >= 'A' && c <= 'Z') {
      v = c - 'A';
    } else if (c >= 'a' && c <= 'z') {
      v = c - 'a' + 26;
    } else if (c >= '0' && c <= '9') {
      v = c - '0' + 52;
    } else if (c == '-') {
      v = 62;
    } else if (c == '_') {
      v = 63;
    } else {
      return false;
    }
    buf = (buf << 6) | static_cast<uint32_t>(v);
    bits += 6;
    if (bits >= 8) {
      out.push_back(static_cast<char>((buf >> (bits - 8)) & 0xff));
      bits -= 8;
    }
    buf &= (1U << bits) - 1;
  }
  return bits < 6;  // a lone trailing character (6 bits) cannot end a base64 string
}

// A base64url segment holding a JSON object; nullopt otherwise.
std::optional<json> DecodeJsonSegment(std::string_view segment) {
  std::string text;
  if (segment.empty() || !Base64UrlDecode(segment, text)) return std::nullopt;
  json j = json::parse(text, nullptr, /*allow_exceptions=*/false);
  if (j.is_discarded() || !j.is_object()) return std::nullopt;
  return j;
}

Result<Principal> PrincipalFromClaims(const json& claims, int64_t now) {
  const auto str = [&](const char* name) -> std::optional<std::string> {
    auto it = claims.find(name);
    if (it == claims.end() || !it->is_string()) return std::nullopt;
    return it->get<std::string>();
  };
  const auto integer = [&](const char* name) -> std::optional<int64_t> {
    auto it = claims.find(name);
    if (it == claims.end() || !it->is_number_integer()) return std::nullopt;
    if (it->is_number_unsigned() && it->get<uint64_t>() > INT64_MAX) return std::nullopt;
    return it->get<int64_t>();
  };

  const auto exp = integer("exp");
  if (!exp) return BadClaim("exp", "exp is missing or not an integer");
  const auto iat = integer("iat");
  if (!iat) return BadClaim("iat", "iat is missing or not an integer");
  if (*exp <= now - kLeewaySeconds) {
    return Unauthenticated(reason::kTokenExpired,
                           fmt::format("the token expired {} s ago", now - *exp));
  }
  if (*iat > now + kLeewaySeconds) return BadClaim("iat", "iat is in the future");
  if (*exp <= *iat || *exp - *iat > kMaxTokenTtl.count()) {
    return BadClaim("exp", fmt::format("exp - iat must be in (0, {}] s", kMaxTokenTtl.count()));
  }
  if (claims.contains("nbf")) {
    const auto nbf = integer("nbf");
    if (!nbf || *nbf > now + kLeewaySeconds) return BadClaim("nbf", "the token is not valid yet");
  }
  if (str("iss") != kIssuer) return BadClaim("iss", "iss is not gpuaas");
  bool aud_ok = str("aud") == kAudience;
  if (auto it = claims.find("aud"); !aud_ok && it != claims.end() && it->is_array()) {
    aud_ok = std::find(it->begin(), it->end(), json(kAudience)) != it->end();
  }
  if (!aud_ok) return BadClaim("aud", "aud is not gpuaas");

  Principal p;
  p.subject = str("sub").value_or("");
  p.token_id = str("jti").value_or("");
  if (p.token_id.empty()) return BadClaim("jti", "jti is missing");
  p.issued = std::chrono::system_clock::time_point(std::chrono::seconds(*iat));
  if (claims.contains("tenant")) {
    auto tenant = str("tenant");
    if (!tenant) return BadClaim("tenant", "tenant is not a string");
    p.tenant = *tenant;
  }
  auto roles = claims.find("roles");
  if (roles == claims.end() || !roles->is_array()) {
    return BadClaim("roles", "roles is missing or not an array");
  }
  for (const auto& r : *roles) {
    if (!r.is_string()) return BadClaim("roles", "roles holds a non-string");
    p.roles.push_back(r.get<std::string>());
  }
  if (auto problem = PrincipalProblem(p.subject, p.tenant, p.roles)) {
    return BadClaim(problem->first, problem->second);
  }
  p.expires = std::chrono::system_clock::time_point(std::chrono::seconds(*exp));
  return p;
}

}  // namespace

// ---- nkeys ----

Result<NKeyPair> NewUserNKey() {
  SecretBytes key;
  key.get().resize(kKeyLen);
  if (RAND_bytes(key.get().data(), static_cast<int>(kKeyLen)) != 1) {
    return Error::Internal(reason::kNkeyCrypto, "no random bytes for a new key");
  }
  auto pub = PublicFromRawSeed(key.get().data());
  if (!pub) return pub.error();
  return NKeyPair{EncodeUserSeed(key.get().data()), std::move(*pub)};
}

Result<std::string> NKeyPublicFromSeed(const std::string& seed) {
  // Errors never quote the seed: it is a secret.
  if (seed.size() != kSeedChars) {
    return SeedInvalid(fmt::format("{} characters, want {}", seed.size(), kSeedChars));
  }
  SecretBytes raw;
  if (!Base32Decode(seed, raw.get())) return SeedInvalid("bad base32");
  raw.Wipe();
  if (!DecodeChecked(seed, raw.get())) return SeedInvalid("bad checksum");
  const auto& b = raw.get();
  if (b.size() != 2 + kKeyLen || (b[0] & 0xf8) != kPrefixSeed) {
    return SeedInvalid("not a seed");
  }
  const auto type = static_cast<uint8_t>(((b[0] & 7) << 5) | ((b[1] & 0xf8) >> 3));
  if (type != kPrefixUser || (b[1] & 7) != 0) return SeedInvalid("not a user seed");
  return PublicFromRawSeed(b.data() + 2);
}

Result<std::string> SignWithSeed(const std::string& seed, std::string_view data) {
  if (auto pub = NKeyPublicFromSeed(seed); !pub.ok()) return pub.error();  // validates it
  SecretBytes raw;
  if (!DecodeChecked(seed, raw.get())) return SeedInvalid("bad checksum");
  PkeyPtr pkey(
      EVP_PKEY_new_raw_private_key(EVP_PKEY_ED25519, nullptr, raw.get().data() + 2, kKeyLen));
  if (!pkey) return SeedInvalid("not an Ed25519 key");
  std::unique_ptr<EVP_MD_CTX, decltype(&EVP_MD_CTX_free)> ctx(EVP_MD_CTX_new(), EVP_MD_CTX_free);
  std::string sig(64, '\0');
  size_t len = sig.size();
  if (!ctx || EVP_DigestSignInit(ctx.get(), nullptr, nullptr, nullptr, pkey.get()) != 1 ||
      EVP_DigestSign(ctx.get(), reinterpret_cast<unsigned char*>(sig.data()), &len,
                     reinterpret_cast<const unsigned char*>(data.data()), data.size()) != 1) {
    return Error::Internal(reason::kNkeySignFailed, "Ed25519 signing failed");
  }
  sig.resize(len);
  return sig;
}

bool IsUserPublicKey(const std::string& key) {
  std::vector<uint8_t> raw;
  return key.size() == kPublicChars && DecodeChecked(key, raw) && raw.size() == 1 + kKeyLen &&
         raw[0] == kPrefixUser;
}

Result<std::string> ReadSeedFile(const std::string& path) {
  Fd fd(::open(path.c_str(), O_RDONLY | O_CLOEXEC));
  if (fd.get() < 0) return Error::NotFound(reason::kSeedFileMissing, path + ": " + Errno());
  struct stat st {};
  if (::fstat(fd.get(), &st) != 0) {
    return Error::NotFound(reason::kSeedFileMissing, path + ": " + Errno());
  }
  if (!S_ISREG(st.st_mode)) return Error::NotFound(reason::kSeedFileMissing, path + ": not a file");
  if ((st.st_mode & 077) != 0) {
    return Error::FailedPrecondition(
        reason::kSeedFileMode,
        fmt::format("{} has mode {:04o}: a secret must be readable by its owner "
                    "only (0600 or 0400)",
                    path, st.st_mode & 07777));
  }
  constexpr size_t kMaxSize = 4096;  // a seed is 58 characters
  std::string text;
  std::array<char, 512> buf{};
  for (;;) {
    const ssize_t n = ::read(fd.get(), buf.data(), buf.size());
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) {
      OPENSSL_cleanse(text.data(), text.size());
      return Error::NotFound(reason::kSeedFileMissing, path + ": " + Errno());
    }
    if (n == 0) break;
    text.append(buf.data(), static_cast<size_t>(n));
    if (text.size() > kMaxSize) break;
  }
  OPENSSL_cleanse(buf.data(), buf.size());
  std::string seed = Trim(text);
  OPENSSL_cleanse(text.data(), text.size());
  auto pub = NKeyPublicFromSeed(seed);
  if (!pub) {
    OPENSSL_cleanse(seed.data(), seed.size());
    Error e = pub.error();
    e.message = path + ": " + e.message;
    return e;
  }
  return seed;
}

Result<void> WriteSecretFile(const std::string& path, const std::string& content) {
  namespace fs = std::filesystem;
  const fs::path target(path);
  if (target.filename().empty()) {
    return Error::InvalidArgument(reason::kSecretFilePath, "not a file path: " + path);
  }
  const fs::path dir = target.has_parent_path() ? target.parent_path() : fs::path(".");
  const auto fail = [&](const std::string& what) {
    return Error::Internal(reason::kSecretFileWrite,
                           fmt::format("{}: {}: {}", path, what, Errno()));
  };

  // Create the missing directories, outermost first, each 0700.
  std::vector<fs::path> missing;
  std::error_code ec;
  for (fs::path d = dir; !d.empty() && !fs::exists(d, ec); d = d.parent_path()) {
    missing.push_back(d);
    if (d == d.parent_path()) break;
  }
  for (auto it = missing.rbegin(); it != missing.rend(); ++it) {
    if (::mkdir(it->c_str(), 0700) != 0 && errno != EEXIST) return fail("mkdir " + it->string());
  }

  std::string tmpl = (dir / ("." + target.filename().string() + ".tmp-XXXXXX")).string();
  Fd fd(::mkstemp(tmpl.data()));  // mode 0600
  if (fd.get() < 0) return fail("create a temporary file");
  const std::string tmp = tmpl;
  const auto abandon = [&](const std::string& what) {
    Error e = fail(what);
    ::unlink(tmp.c_str());
    return e;
  };
  if (::fchmod(fd.get(), 0600) != 0) return abandon("chmod");
  size_t done = 0;
  while (done < content.size()) {
    const ssize_t n = ::write(fd.get(), content.data() + done, content.size() - done);
    if (n < 0 && errno == EINTR) continue;
    if (n < 0) return abandon("write");
    done += static_cast<size_t>(n);
  }
  if (::fsync(fd.get()) != 0) return abandon("fsync");
  if (::close(fd.Release()) != 0) return abandon("close");
  if (::rename(tmp.c_str(), path.c_str()) != 0) return abandon("rename");
  // The rename itself survives a crash only once the directory is synced.
  Fd dfd(::open(dir.c_str(), O_RDONLY | O_DIRECTORY | O_CLOEXEC));
  if (dfd.get() >= 0) ::fsync(dfd.get());
  return Ok();
}

// ---- tokens ----

Result<SigningKey> NewSigningKey() {
  PkeyPtr key(EVP_PKEY_Q_keygen(nullptr, nullptr, "EC", "P-256"));
  if (!key) return Error::Internal(reason::kSigningKeyCrypto, "cannot generate an EC P-256 key");
  BioPtr priv(BIO_new(BIO_s_mem()));
  BioPtr pub(BIO_new(BIO_s_mem()));
  if (!priv || !pub ||
      PEM_write_bio_PKCS8PrivateKey(priv.get(), key.get(), nullptr, nullptr, 0, nullptr, nullptr) !=
          1 ||
      PEM_write_bio_PUBKEY(pub.get(), key.get()) != 1) {
    return Error::Internal(reason::kSigningKeyCrypto, "cannot write the key as PEM");
  }
  SigningKey out{BioString(priv.get()), BioString(pub.get())};
  // The memory BIO held the private key; scrub it before it is freed.
  char* data = nullptr;
  const long n = BIO_get_mem_data(priv.get(), &data);
  if (n > 0) OPENSSL_cleanse(data, static_cast<size_t>(n));
  return out;
}

bool Principal::HasRole(const std::string& role) const {
  return std::find(roles.begin(), roles.end(), role) != roles.end();
}

Result<std::string> IssueToken(const std::string& private_pem, const Principal& principal,
                               std::chrono::seconds ttl,
                               std::chrono::system_clock::time_point now) {
  if (auto problem = PrincipalProblem(principal.subject, principal.tenant, principal.roles)) {
    return Error::InvalidArgument(reason::kPrincipalInvalid, problem->second,
                                  {{"claim", problem->first}});
  }
  for (const auto& [claim, text] :
       {std::pair<std::string, const std::string*>{"sub", &principal.subject},
        {"tenant", &principal.tenant}}) {
    if (auto why = validate::TextProblem(*text); !why.empty()) {
      return Error::InvalidArgument(reason::kPrincipalInvalid,
                                    fmt::format("the {} claim: {}", claim, why),
                                    {{"claim", claim}});
    }
  }
  if (ttl <= std::chrono::seconds(0) || ttl > kMaxTokenTtl) {
    return Error::InvalidArgument(
        reason::kTokenTtlInvalid,
        fmt::format("ttl {} s is outside (0, {}] s", ttl.count(), kMaxTokenTtl.count()));
  }
  // Checked here, not left to libjwt: it would read an encrypted key with OpenSSL's default
  // passphrase prompt, and sign with whatever key type it is given.
  if (!IsP256PrivateKeyPem(private_pem)) {
    return Error::InvalidArgument(reason::kSigningKeyInvalid,
                                  "the signing key is not an EC P-256 private key in PEM");
  }
  const int64_t iat = UnixSeconds(now);
  json claims = {{"iss", kIssuer},           {"aud", kAudience},        {"sub", principal.subject},
                 {"roles", principal.roles}, {"jti", ids::NewUuidV7()}, {"iat", iat},
                 {"exp", iat + ttl.count()}};
  if (!principal.tenant.empty()) claims["tenant"] = principal.tenant;

  jwt_t* raw = nullptr;
  if (jwt_new(&raw) != 0) return Error::Internal(reason::kTokenIssue, "jwt_new failed");
  JwtPtr jwt(raw);
  if (jwt_add_grants_json(jwt.get(), claims.dump().c_str()) != 0) {
    return Error::Internal(reason::kTokenIssue, "cannot add the claims");
  }
  if (jwt_set_alg(jwt.get(), JWT_ALG_ES256,
                  reinterpret_cast<const unsigned char*>(private_pem.data()),
                  static_cast<int>(private_pem.size())) != 0) {
    return Error::InvalidArgument(reason::kSigningKeyInvalid, "libjwt refused the signing key");
  }
  CStrPtr token(jwt_encode_str(jwt.get()));
  if (!token) {
    return Error::InvalidArgument(reason::kSigningKeyInvalid, "signing with the key failed");
  }
  return std::string(token.get());
}

Result<Principal> VerifyIssuedToken(const std::string& token,
                                    const std::vector<std::string>& platform_pems,
                                    const std::vector<std::string>& tenant_pems,
                                    std::chrono::system_clock::time_point now) {
  auto p = VerifyToken(token, platform_pems, now);
  if (p.ok() || tenant_pems.empty() || !p.error().Is(reason::kTokenSignature)) return p;
  auto t = VerifyToken(token, tenant_pems, now);
  if (!t.ok()) return t.error();
  for (const auto& r : t->roles) {
    if (r != kRoleTenant) {
      return Error::Of(Code::kUnauthenticated, reason::kTokenIssuerRole,
                       "the tenant issuer may sign tenant tokens only; this one claims " + r,
                       {{"role", r}}, false);
    }
  }
  return t;
}

Result<Principal> VerifyToken(const std::string& token, const std::vector<std::string>& public_pems,
                              std::chrono::system_clock::time_point now) {
  if (token.empty()) return Unauthenticated(reason::kTokenMissing, "no token");
  // JWS compact form: header.payload.signature.
  const size_t d1 = token.find('.');
  const size_t d2 = d1 == std::string::npos ? d1 : token.find('.', d1 + 1);
  if (d2 == std::string::npos || token.find('.', d2 + 1) != std::string::npos) {
    return Unauthenticated(reason::kTokenMalformed, "a token has three dot-separated parts");
  }
  const std::string_view view(token);
  auto header = DecodeJsonSegment(view.substr(0, d1));
  if (!header) return Unauthenticated(reason::kTokenMalformed, "the header is not base64url JSON");
  // The algorithm is decided here, before libjwt sees the token: libjwt picks the verification
  // from the header, so "none" or HS256 keyed with our public key would otherwise pass.
  auto alg = header->find("alg");
  if (alg == header->end() || !alg->is_string()) {
    return Unauthenticated(reason::kTokenMalformed, "the header names no algorithm");
  }
  if (alg->get<std::string>() != "ES256") {
    return Unauthenticated(
        reason::kTokenAlgorithm,
        fmt::format("algorithm '{}' is refused: only ES256 is accepted", alg->get<std::string>()));
  }
  if (!DecodeJsonSegment(view.substr(d1 + 1, d2 - d1 - 1))) {
    return Unauthenticated(reason::kTokenMalformed, "the payload is not base64url JSON");
  }
  std::string signature;
  if (d2 + 1 == token.size() || !Base64UrlDecode(view.substr(d2 + 1), signature)) {
    return Unauthenticated(reason::kTokenMalformed, "the signature is missing or not base64url");
  }

  JwtPtr verified;
  for (const auto& pem : public_pems) {
    if (pem.empty()) continue;
    jwt_t* raw = nullptr;
    const int rc =
        jwt_decode(&raw, token.c_str(), reinterpret_cast<const unsigned char*>(pem.data()),
                   static_cast<int>(pem.size()));
    JwtPtr candidate(raw);
    if (rc == 0 && candidate && jwt_get_alg(candidate.get()) == JWT_ALG_ES256) {
      verified = std::move(candidate);
      break;
    }
  }
  if (!verified) {
    return Unauthenticated(reason::kTokenSignature,
                           "no trusted key verifies the token's signature");
  }
  CStrPtr grants(jwt_get_grants_json(verified.get(), nullptr));
  if (!grants) return Unauthenticated(reason::kTokenMalformed, "the token has no claims");
  json claims = json::parse(grants.get(), nullptr, /*allow_exceptions=*/false);
  if (claims.is_discarded() || !claims.is_object()) {
    return Unauthenticated(reason::kTokenMalformed, "the claims are not a JSON object");
  }
  return PrincipalFromClaims(claims, UnixSeconds(now));
}

std::string BearerToken(const std::string& header_value) {
  const std::string value = Trim(header_value);
  constexpr std::string_view kScheme = "bearer";
  if (value.size() <= kScheme.size()) return "";
  for (size_t i = 0; i < kScheme.size(); ++i) {
    if (std::tolower(static_cast<unsigned char>(value[i])) != kScheme[i]) return "";
  }
  if (value[kScheme.size()] != ' ' && value[kScheme.size()] != '\t') return "";
  std::string token = Trim(std::string_view(value).substr(kScheme.size()));
  const bool spaced = std::any_of(token.begin(), token.end(), [](char c) {
    return std::isspace(static_cast<unsigned char>(c)) != 0;
  });
  return spaced ? "" : token;
}

}  // namespace gpuaas::auth
