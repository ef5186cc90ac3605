// gpuaas::auth: nkeys checked against published vectors, nkeys.js and a real nats-server that
// admits only a listed key; request tokens checked against forged, expired, tampered and
// wrong-algorithm tokens.
#include "gpuaas/common/auth.hpp"

#include <arpa/inet.h>
#include <jwt.h>
#include <nats/nats.h>
#include <netinet/in.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <array>
#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <memory>
#include <set>
#include <sstream>
#include <string>

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/ids.hpp"
#include "test_env.hpp"

namespace gpuaas::auth {
namespace {

namespace fs = std::filesystem;
using std::chrono::hours;
using std::chrono::seconds;
using std::chrono::system_clock;

// The key the NATS clients' own tests use (nats.py, nkeys.py, the Elixir and Erlang nkeys).
constexpr const char* kVectorSeed = "SUAMLK2ZNL35WSMW37E7UD4VZ7ELPKW7DHC3BWBSD2GCZ7IUQQXZIORRBU";
constexpr const char* kVectorPublic = "UCK5N7N66OBOINFXAYC2ACJQYFSOD4VYNU6APEJTAVFZB2SVHLKGEW7L";

// Replaces the character at `i` with another of the base32 alphabet.
std::string Corrupt(std::string s, size_t i) {
  s[i] = s[i] == 'A' ? 'B' : 'A';
  return s;
}

mode_t Mode(const std::string& path) {
  struct stat st {};
  EXPECT_EQ(::stat(path.c_str(), &st), 0) << path;
  return st.st_mode & 07777;
}

void WriteFile(const std::string& path, const std::string& content, mode_t mode) {
  std::ofstream(path) << content;
  ASSERT_EQ(::chmod(path.c_str(), mode), 0);
}

// ---------------------------------------------------------------- nkeys

TEST(AuthNKeyTest, NewKeysHaveTheNatsShape) {
  std::set<std::string> seen;
  for (int i = 0; i < 50; ++i) {
    auto kp = NewUserNKey();
    ASSERT_TRUE(kp.ok()) << kp.error().ToString();
    EXPECT_EQ(kp->seed.size(), 58u);
    EXPECT_EQ(kp->seed.substr(0, 2), "SU");
    EXPECT_EQ(kp->public_key.size(), 56u);
    EXPECT_EQ(kp->public_key[0], 'U');
    EXPECT_TRUE(IsUserPublicKey(kp->public_key)) << kp->public_key;
    auto pub = NKeyPublicFromSeed(kp->seed);
    ASSERT_TRUE(pub.ok()) << pub.error().ToString();
    EXPECT_EQ(*pub, kp->public_key);
    EXPECT_TRUE(seen.insert(kp->seed).second) << "a repeated seed";
  }
}

TEST(AuthNKeyTest, PublishedVector) {
  auto pub = NKeyPublicFromSeed(kVectorSeed);
  ASSERT_TRUE(pub.ok()) << pub.error().ToString();
  EXPECT_EQ(*pub, kVectorPublic);
  EXPECT_TRUE(IsUserPublicKey(kVectorPublic));
}

TEST(AuthNKeyTest, CorruptedSeedsAndKeysAreRefused) {
  // Every single-character change is caught, the last character (CRC and padding bits) included.
  const std::string seed = kVectorSeed;
  for (size_t i = 0; i < seed.size(); ++i) {
    auto pub = NKeyPublicFromSeed(Corrupt(seed, i));
    ASSERT_FALSE(pub.ok()) << "character " << i;
    EXPECT_EQ(pub.error().code, Code::kInvalidArgument);
    EXPECT_EQ(pub.error().reason, "nkey_seed_invalid");
    // A secret never appears in an error.
    EXPECT_EQ(pub.error().message.find(seed.substr(2, 20)), std::string::npos);
  }
  const std::string key = kVectorPublic;
  for (size_t i = 0; i < key.size(); ++i) {
    EXPECT_FALSE(IsUserPublicKey(Corrupt(key, i))) << "character " << i;
  }
  for (const std::string& bad :
       std::vector<std::string>{std::string(), seed.substr(1), seed + "A", std::string(58, 'A'),
                                seed.substr(0, 57) + "1", "su" + seed.substr(2)}) {
    EXPECT_FALSE(NKeyPublicFromSeed(bad).ok()) << bad;
  }
  EXPECT_FALSE(IsUserPublicKey(""));
  EXPECT_FALSE(IsUserPublicKey(kVectorSeed));  // a seed is not a public key
  // An account public key ("A...", from the nats.go tests) has a valid CRC but is not a user key.
  EXPECT_FALSE(IsUserPublicKey("AACKDD7DWAJM2K76WMDHTHTIN2WZLKA7MGSLNHIHSZ3ZRSEBZG6GWECF"));
  // A public key where a seed is expected.
  EXPECT_FALSE(NKeyPublicFromSeed(kVectorPublic).ok());
}

// Runs `script` with node; stdout and stderr together.
std::string RunNode(const std::string& script, int* exit_code) {
  *exit_code = -1;
  const fs::path file = fs::path(testing::MakeTempDir("gpuaas-nkeys-js")) / "check.js";
  std::ofstream(file) << script;
  const std::string cmd = "node '" + file.string() + "' 2>&1";
  std::string out;
  FILE* pipe = ::popen(cmd.c_str(), "r");
  if (pipe == nullptr) return out;
  std::array<char, 4096> buf{};
  size_t n = 0;
  while ((n = std::fread(buf.data(), 1, buf.size(), pipe)) > 0) out.append(buf.data(), n);
  const int status = ::pclose(pipe);
  *exit_code = status != -1 && WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  fs::remove_all(file.parent_path());
  return out;
}

// The official JavaScript nkeys library agrees with us both ways: it derives our public keys
// from our seeds, and we derive its public keys from its seeds.
TEST(AuthNKeyTest, AgreesWithNkeysJs) {
  const fs::path lib = fs::path(GPUAAS_SOURCE_DIR) / "tests/contract/js/node_modules/nkeys.js";
  if (!fs::exists(lib / "package.json")) {
    GTEST_SKIP() << lib.string() << " is missing (scripts/install-deps installs it)";
  }
  if (testing::Shell("command -v node >/dev/null 2>&1") != 0) GTEST_SKIP() << "node is not on PATH";

  std::vector<NKeyPair> ours;
  std::string seeds_js;
  for (int i = 0; i < 5; ++i) {
    auto kp = NewUserNKey();
    ASSERT_TRUE(kp.ok());
    seeds_js += "\"" + kp->seed + "\",";
    ours.push_back(*kp);
  }
  const std::string script =
      "const nk = require(" + nlohmann::json(lib.string()).dump() +
      ");\n"
      "const enc = new TextEncoder(), dec = new TextDecoder();\n"
      "for (const s of [" +
      seeds_js +
      "]) console.log('pub ' + nk.fromSeed(enc.encode(s)).getPublicKey());\n"
      "for (let i = 0; i < 5; i++) {\n"
      "  const u = nk.createUser();\n"
      "  console.log('new ' + dec.decode(u.getSeed()) + ' ' + u.getPublicKey());\n"
      "}\n";
  int rc = -1;
  const std::string out = RunNode(script, &rc);
  ASSERT_EQ(rc, 0) << out;
  std::istringstream lines(out);
  std::string kind;
  size_t pubs = 0;
  size_t news = 0;
  while (lines >> kind) {
    if (kind == "pub") {
      std::string pub;
      lines >> pub;
      ASSERT_LT(pubs, ours.size());
      EXPECT_EQ(pub, ours[pubs++].public_key);
    } else {
      ASSERT_EQ(kind, "new") << out;
      std::string seed;
      std::string pub;
      lines >> seed >> pub;
      auto derived = NKeyPublicFromSeed(seed);
      ASSERT_TRUE(derived.ok()) << derived.error().ToString();
      EXPECT_EQ(*derived, pub);
      EXPECT_TRUE(IsUserPublicKey(pub));
      ++news;
    }
  }
  EXPECT_EQ(pubs, 5u);
  EXPECT_EQ(news, 5u);
}

// ---------------------------------------------------------------- seed and secret files

class AuthSecretFileTest : public ::testing::Test {
 protected:
  void TearDown() override { fs::remove_all(dir_); }
  std::string dir_ = testing::MakeTempDir("gpuaas-auth");
};

TEST_F(AuthSecretFileTest, WriteThenReadSeed) {
  auto kp = NewUserNKey();
  ASSERT_TRUE(kp.ok());
  // A parent that does not exist yet is made, owner-only.
  const std::string path = dir_ + "/nats/keys/agent.seed";
  ASSERT_TRUE(WriteSecretFile(path, kp->seed + "\n").ok());
  EXPECT_EQ(Mode(path), 0600u);
  EXPECT_EQ(Mode(dir_ + "/nats/keys"), 0700u);
  EXPECT_EQ(Mode(dir_ + "/nats"), 0700u);
  auto seed = ReadSeedFile(path);
  ASSERT_TRUE(seed.ok()) << seed.error().ToString();
  EXPECT_EQ(*seed, kp->seed);

  // Overwriting replaces the content and leaves no temporary file behind.
  auto other = NewUserNKey();
  ASSERT_TRUE(other.ok());
  ASSERT_TRUE(WriteSecretFile(path, "  " + other->seed + "\n\n").ok());
  seed = ReadSeedFile(path);
  ASSERT_TRUE(seed.ok()) << seed.error().ToString();
  EXPECT_EQ(*seed, other->seed);
  size_t files = 0;
  for (const auto& e : fs::directory_iterator(dir_ + "/nats/keys")) {
    ++files;
    EXPECT_EQ(e.path().filename(), "agent.seed");
  }
  EXPECT_EQ(files, 1u);
}

TEST_F(AuthSecretFileTest, WriteTightensAnExistingLooseFile) {
  const std::string path = dir_ + "/token.key";
  WriteFile(path, "old", 0644);
  ASSERT_TRUE(WriteSecretFile(path, "new").ok());
  EXPECT_EQ(Mode(path), 0600u);
  std::ifstream in(path);
  std::string content((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
  EXPECT_EQ(content, "new");
}

TEST_F(AuthSecretFileTest, ReadRefusesMissingLooseAndMalformedFiles) {
  auto missing = ReadSeedFile(dir_ + "/nope.seed");
  ASSERT_FALSE(missing.ok());
  EXPECT_EQ(missing.error().code, Code::kNotFound);
  EXPECT_EQ(missing.error().reason, "seed_file_missing");

  for (mode_t loose : {0644, 0640, 0604, 0660}) {
    const std::string path = dir_ + "/loose.seed";
    WriteFile(path, kVectorSeed, loose);
    auto r = ReadSeedFile(path);
    ASSERT_FALSE(r.ok()) << std::oct << loose;
    EXPECT_EQ(r.error().code, Code::kFailedPrecondition);
    EXPECT_EQ(r.error().reason, "seed_file_mode");
  }
  const std::string read_only = dir_ + "/ro.seed";
  WriteFile(read_only, kVectorSeed, 0400);
  EXPECT_TRUE(ReadSeedFile(read_only).ok());

  for (const std::string& bad :
       std::vector<std::string>{std::string(), std::string("hello"), std::string(kVectorPublic),
                                Corrupt(kVectorSeed, 10)}) {
    const std::string path = dir_ + "/bad.seed";
    WriteFile(path, bad, 0600);
    auto r = ReadSeedFile(path);
    ASSERT_FALSE(r.ok()) << bad;
    EXPECT_EQ(r.error().code, Code::kInvalidArgument);
    EXPECT_EQ(r.error().reason, "nkey_seed_invalid");
  }
}

// ---------------------------------------------------------------- a real nats-server

bool PortOpen(uint16_t port) {
  const int fd = ::socket(AF_INET, SOCK_STREAM, 0);
  sockaddr_in addr{};
  addr.sin_family = AF_INET;
  addr.sin_addr.s_addr = htonl(INADDR_LOOPBACK);
  addr.sin_port = htons(port);
  const bool ok = ::connect(fd, reinterpret_cast<sockaddr*>(&addr), sizeof(addr)) == 0;
  ::close(fd);
  return ok;
}

// nats-server admitting one user nkey and nobody else.
class AuthNKeyNatsTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto kp = NewUserNKey();
    ASSERT_TRUE(kp.ok());
    allowed_ = *kp;
    allowed_seed_file_ = dir_ + "/allowed.seed";
    ASSERT_TRUE(WriteSecretFile(allowed_seed_file_, allowed_.seed + "\n").ok());
    const std::string conf = dir_ + "/nats.conf";
    std::ofstream(conf) << "authorization {\n  users = [\n    { nkey: " << allowed_.public_key
                        << " }\n  ]\n}\n";
    port_ = testing::FreePort();
    server_.Spawn({"nats-server", "-c", conf, "-a", "127.0.0.1", "-p", std::to_string(port_)},
                  dir_ + "/nats.log");
    ASSERT_TRUE(testing::WaitFor([&] { return PortOpen(port_); }))
        << "nats-server did not start; see " << dir_ << "/nats.log";
  }
  void TearDown() override {
    server_.Stop();
    fs::remove_all(dir_);
  }

  // Connects (no reconnects) as `public_key` signing with `seed_file`, or anonymously when
  // `public_key` is empty; the connect status.
  natsStatus Connect(const std::string& public_key, const std::string& seed_file) {
    natsOptions* opts = nullptr;
    if (natsOptions_Create(&opts) != NATS_OK) return NATS_ERR;
    std::unique_ptr<natsOptions, decltype(&natsOptions_Destroy)> guard(opts, natsOptions_Destroy);
    const std::string url = "nats://127.0.0.1:" + std::to_string(port_);
    natsOptions_SetURL(opts, url.c_str());
    natsOptions_SetTimeout(opts, 3000);
    natsOptions_SetAllowReconnect(opts, false);
    if (!public_key.empty()) {
      const natsStatus s = natsOptions_SetNKeyFromSeed(opts, public_key.c_str(), seed_file.c_str());
      if (s != NATS_OK) return s;
    }
    natsConnection* nc = nullptr;
    natsStatus s = natsConnection_Connect(&nc, opts);
    if (s == NATS_OK) {
      // Admitted means usable: a round trip to the server works.
      s = natsConnection_PublishString(nc, "auth.test", "hello");
      if (s == NATS_OK) s = natsConnection_FlushTimeout(nc, 3000);
    }
    natsConnection_Destroy(nc);
    return s;
  }

  std::string dir_ = testing::MakeTempDir("gpuaas-auth-nats");
  NKeyPair allowed_;
  std::string allowed_seed_file_;
  uint16_t port_ = 0;
  testing::Process server_;
};

TEST_F(AuthNKeyNatsTest, ListedKeyConnects) {
  // The seed file as ReadSeedFile accepts it is the one nats.c signs with.
  auto seed = ReadSeedFile(allowed_seed_file_);
  ASSERT_TRUE(seed.ok()) << seed.error().ToString();
  EXPECT_EQ(Connect(allowed_.public_key, allowed_seed_file_), NATS_OK);
}

TEST_F(AuthNKeyNatsTest, UnlistedKeyAndAnonymousAreRefused) {
  auto other = NewUserNKey();
  ASSERT_TRUE(other.ok());
  const std::string other_seed_file = dir_ + "/other.seed";
  ASSERT_TRUE(WriteSecretFile(other_seed_file, other->seed).ok());

  // Each refusal is the server's: it is up and still admits the listed key afterwards.
  EXPECT_EQ(Connect(other->public_key, other_seed_file), NATS_CONNECTION_AUTH_FAILED);
  EXPECT_EQ(Connect("", ""), NATS_CONNECTION_AUTH_FAILED);
  // Claiming the listed public key without its seed: the nonce signature gives it away.
  EXPECT_EQ(Connect(allowed_.public_key, other_seed_file), NATS_CONNECTION_AUTH_FAILED);
  EXPECT_EQ(Connect(allowed_.public_key, allowed_seed_file_), NATS_OK);
}

// ---------------------------------------------------------------- request tokens

std::string B64Url(const std::string& in) {
  static constexpr char kAlphabet[] =
      "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
  std::string out;
  uint32_t buf = 0;
  int bits = 0;
  for (unsigned char c : in) {
    buf = (buf << 8) | c;
    bits += 8;
    while (bits >= 6) {
      out += kAlphabet[(buf >> (bits - 6)) & 63];
      bits -= 6;
    }
  }
  if (bits > 0) out += kAlphabet[(buf << (6 - bits)) & 63];
  return out;
}

class AuthTokenTest : public ::testing::Test {
 protected:
  void SetUp() override {
    auto k = NewSigningKey();
    ASSERT_TRUE(k.ok()) << k.error().ToString();
    key_ = *k;
    auto o = NewSigningKey();
    ASSERT_TRUE(o.ok());
    other_ = *o;
  }

  static Principal Tenant() { return {"tenant:acme/bob", "acme", {kRoleTenant}, "", {}, {}}; }
  static Principal Operator() {
    return {"user:alice", "", {kRoleOperator, kRoleAuditor}, "", {}, {}};
  }

  std::string Issue(const Principal& p, seconds ttl = hours(1),
                    system_clock::time_point now = system_clock::now()) {
    auto t = IssueToken(key_.private_pem, p, ttl, now);
    EXPECT_TRUE(t.ok()) << t.error().ToString();
    return t.ok() ? *t : "";
  }

  // The reason a token is refused for, "" when accepted.
  std::string Refusal(const std::string& token,
                      system_clock::time_point now = system_clock::now()) {
    auto p = VerifyToken(token, {key_.public_pem}, now);
    if (p.ok()) return "";
    EXPECT_EQ(p.error().code, Code::kUnauthenticated) << p.error().ToString();
    return p.error().reason;
  }

  // A token with our header and key but these claims, signed with libjwt directly.
  std::string SignClaims(const nlohmann::json& claims) {
    jwt_t* raw = nullptr;
    EXPECT_EQ(jwt_new(&raw), 0);
    std::unique_ptr<jwt_t, decltype(&jwt_free)> jwt(raw, jwt_free);
    EXPECT_EQ(jwt_add_grants_json(jwt.get(), claims.dump().c_str()), 0);
    EXPECT_EQ(jwt_set_alg(jwt.get(), JWT_ALG_ES256,
                          reinterpret_cast<const unsigned char*>(key_.private_pem.data()),
                          static_cast<int>(key_.private_pem.size())),
              0);
    char* s = jwt_encode_str(jwt.get());
    std::string out = s != nullptr ? s : "";
    std::free(s);  // NOLINT(*-no-malloc)
    return out;
  }

  nlohmann::json GoodClaims(int64_t now) const {
    return {{"iss", "gpuaas"},       {"aud", "gpuaas"},         {"sub", "user:alice"},
            {"roles", {"operator"}}, {"jti", ids::NewUuidV7()}, {"iat", now},
            {"exp", now + 600}};
  }

  SigningKey key_;
  SigningKey other_;
};

TEST_F(AuthTokenTest, KeysArePem) {
  EXPECT_EQ(key_.private_pem.rfind("-----BEGIN PRIVATE KEY-----", 0), 0u) << key_.private_pem;
  EXPECT_EQ(key_.public_pem.rfind("-----BEGIN PUBLIC KEY-----", 0), 0u) << key_.public_pem;
  EXPECT_NE(key_.private_pem, other_.private_pem);
}

TEST_F(AuthTokenTest, IssueVerifyRoundTrip) {
  const auto now = system_clock::now();
  const std::string token = Issue(Tenant(), hours(2), now);
  ASSERT_FALSE(token.empty());
  auto p = VerifyToken(token, {key_.public_pem}, now);
  ASSERT_TRUE(p.ok()) << p.error().ToString();
  EXPECT_EQ(p->subject, "tenant:acme/bob");
  EXPECT_EQ(p->tenant, "acme");
  EXPECT_EQ(p->roles, std::vector<std::string>{kRoleTenant});
  EXPECT_TRUE(p->HasRole(kRoleTenant));
  EXPECT_FALSE(p->HasRole(kRoleOperator));
  EXPECT_TRUE(ids::IsUuid(p->token_id)) << p->token_id;
  const auto exp = std::chrono::duration_cast<seconds>((now + hours(2)).time_since_epoch());
  EXPECT_EQ(std::chrono::duration_cast<seconds>(p->expires.time_since_epoch()), exp);

  auto op = VerifyToken(Issue(Operator()), {key_.public_pem});
  ASSERT_TRUE(op.ok()) << op.error().ToString();
  EXPECT_EQ(op->subject, "user:alice");
  EXPECT_EQ(op->tenant, "");
  EXPECT_TRUE(op->HasRole(kRoleOperator));
  EXPECT_TRUE(op->HasRole(kRoleAuditor));

  // Each token has its own id.
  auto again = VerifyToken(Issue(Operator()), {key_.public_pem});
  ASSERT_TRUE(again.ok());
  EXPECT_NE(again->token_id, op->token_id);
}

TEST_F(AuthTokenTest, ClaimsOnTheWire) {
  // What another implementation would read: the standard claims with the standard names.
  const auto now = system_clock::now();
  const std::string token = Issue(Tenant(), seconds(900), now);
  jwt_t* raw = nullptr;
  ASSERT_EQ(jwt_decode(&raw, token.c_str(),
                       reinterpret_cast<const unsigned char*>(key_.public_pem.data()),
                       static_cast<int>(key_.public_pem.size())),
            0);
  std::unique_ptr<jwt_t, decltype(&jwt_free)> jwt(raw, jwt_free);
  EXPECT_EQ(jwt_get_alg(jwt.get()), JWT_ALG_ES256);
  EXPECT_STREQ(jwt_get_grant(jwt.get(), "iss"), "gpuaas");
  EXPECT_STREQ(jwt_get_grant(jwt.get(), "aud"), "gpuaas");
  EXPECT_STREQ(jwt_get_grant(jwt.get(), "sub"), "tenant:acme/bob");
  EXPECT_STREQ(jwt_get_grant(jwt.get(), "tenant"), "acme");
  const long iat = jwt_get_grant_int(jwt.get(), "iat");
  EXPECT_EQ(iat, std::chrono::duration_cast<seconds>(now.time_since_epoch()).count());
  EXPECT_EQ(jwt_get_grant_int(jwt.get(), "exp"), iat + 900);
  char* roles = jwt_get_grants_json(jwt.get(), "roles");
  ASSERT_NE(roles, nullptr);
  EXPECT_EQ(nlohmann::json::parse(roles), nlohmann::json({"tenant"}));
  std::free(roles);  // NOLINT(*-no-malloc)
}

TEST_F(AuthTokenTest, ExpiryWithLeeway) {
  const auto now = system_clock::now();
  // Issued two hours ago for one hour.
  EXPECT_EQ(Refusal(Issue(Operator(), hours(1), now - hours(2)), now), "token_expired");
  // Expired 10 s ago: inside the 30 s leeway for clock skew. 60 s ago: outside.
  const std::string t = Issue(Operator(), seconds(60), now - seconds(70));
  EXPECT_EQ(Refusal(t, now), "");
  EXPECT_EQ(Refusal(t, now + seconds(50)), "token_expired");
  // Issued in the future (a signer whose clock runs ahead by more than the leeway).
  EXPECT_EQ(Refusal(Issue(Operator(), hours(1), now + seconds(120)), now), "token_claims");
  EXPECT_EQ(Refusal(Issue(Operator(), hours(1), now + seconds(10)), now), "");
}

TEST_F(AuthTokenTest, SignatureAndKeyRotation) {
  const std::string token = Issue(Operator());
  // Signed by a key we do not trust.
  auto foreign = IssueToken(other_.private_pem, Operator(), hours(1));
  ASSERT_TRUE(foreign.ok());
  EXPECT_EQ(Refusal(*foreign), "token_signature");
  auto none = VerifyToken(token, {});
  ASSERT_FALSE(none.ok());
  EXPECT_EQ(none.error().reason, "token_signature");
  // During a rotation both keys are trusted; order does not matter.
  EXPECT_TRUE(VerifyToken(token, {other_.public_pem, key_.public_pem}).ok());
  EXPECT_TRUE(VerifyToken(*foreign, {other_.public_pem, key_.public_pem}).ok());
  EXPECT_TRUE(VerifyToken(token, {"not a key", key_.public_pem}).ok());
}

TEST_F(AuthTokenTest, TamperedTokensAreRefused) {
  const std::string token = Issue(Tenant());
  const size_t d1 = token.find('.');
  const size_t d2 = token.find('.', d1 + 1);

  // A payload rewritten to another tenant, re-encoded cleanly: only the signature tells.
  const std::string forged_payload =
      B64Url(R"({"iss":"gpuaas","aud":"gpuaas","sub":"tenant:evil/bob","tenant":"evil",)"
             R"("roles":["tenant"],"jti":"x","iat":)" +
             std::to_string(std::time(nullptr)) + R"(,"exp":)" +
             std::to_string(std::time(nullptr) + 3600) + "}");
  EXPECT_EQ(Refusal(token.substr(0, d1 + 1) + forged_payload + token.substr(d2)),
            "token_signature");
  // An operator role added to a payload the same way.
  const std::string escalated =
      B64Url(R"({"iss":"gpuaas","aud":"gpuaas","sub":"tenant:acme/bob","tenant":"acme",)"
             R"("roles":["tenant","operator"],"jti":"x","iat":)" +
             std::to_string(std::time(nullptr)) + R"(,"exp":)" +
             std::to_string(std::time(nullptr) + 3600) + "}");
  EXPECT_EQ(Refusal(token.substr(0, d1 + 1) + escalated + token.substr(d2)), "token_signature");

  // Any changed character of the payload or signature.
  for (size_t i = d1 + 1; i < token.size(); i += 7) {
    if (token[i] == '.') continue;
    std::string t = token;
    t[i] = t[i] == 'A' ? 'B' : 'A';
    const std::string reason = Refusal(t);
    EXPECT_TRUE(reason == "token_signature" || reason == "token_malformed")
        << "character " << i << ": " << reason;
  }
  // The signature dropped.
  EXPECT_EQ(Refusal(token.substr(0, d2 + 1)), "token_malformed");
}

TEST_F(AuthTokenTest, OnlyEs256IsAccepted) {
  const std::string token = Issue(Operator());
  const std::string payload =
      token.substr(token.find('.') + 1, token.rfind('.') - token.find('.') - 1);
  // alg "none", with and without a signature part.
  const std::string none_header = "eyJhbGciOiJub25lIn0";  // {"alg":"none"}
  ASSERT_EQ(none_header, B64Url(R"({"alg":"none"})"));
  EXPECT_EQ(Refusal(none_header + "." + payload + "."), "token_algorithm");
  EXPECT_EQ(Refusal(none_header + "." + payload + "." + token.substr(token.rfind('.') + 1)),
            "token_algorithm");
  EXPECT_EQ(Refusal(B64Url(R"({"alg":"NONE","typ":"JWT"})") + "." + payload + "."),
            "token_algorithm");

  // HS256 keyed with our public key (the public key is no secret): the classic confusion.
  jwt_t* raw = nullptr;
  ASSERT_EQ(jwt_new(&raw), 0);
  std::unique_ptr<jwt_t, decltype(&jwt_free)> jwt(raw, jwt_free);
  const int64_t now = std::time(nullptr);
  ASSERT_EQ(jwt_add_grants_json(jwt.get(), GoodClaims(now).dump().c_str()), 0);
  ASSERT_EQ(jwt_set_alg(jwt.get(), JWT_ALG_HS256,
                        reinterpret_cast<const unsigned char*>(key_.public_pem.data()),
                        static_cast<int>(key_.public_pem.size())),
            0);
  char* hs = jwt_encode_str(jwt.get());
  ASSERT_NE(hs, nullptr);
  const std::string hs256 = hs;
  std::free(hs);  // NOLINT(*-no-malloc)
  // libjwt alone would take it: it picks the algorithm from the token.
  jwt_t* check = nullptr;
  const int libjwt_rc = jwt_decode(&check, hs256.c_str(),
                                   reinterpret_cast<const unsigned char*>(key_.public_pem.data()),
                                   static_cast<int>(key_.public_pem.size()));
  jwt_free(check);
  EXPECT_EQ(libjwt_rc, 0) << "libjwt no longer accepts the confused token by itself";
  EXPECT_EQ(Refusal(hs256), "token_algorithm");

  // Other asymmetric algorithms are refused by name too.
  EXPECT_EQ(Refusal(B64Url(R"({"alg":"ES384"})") + "." + payload + ".c2ln"), "token_algorithm");
  EXPECT_EQ(Refusal(B64Url(R"({"alg":"RS256"})") + "." + payload + ".c2ln"), "token_algorithm");
}

TEST_F(AuthTokenTest, MalformedTokens) {
  auto empty = VerifyToken("", {key_.public_pem});
  ASSERT_FALSE(empty.ok());
  EXPECT_EQ(empty.error().code, Code::kUnauthenticated);
  EXPECT_EQ(empty.error().reason, "token_missing");
  for (const std::string& bad : std::vector<std::string>{
           "garbage", "a.b", "a.b.c.d", "...", "!!!.???.***", "eyJhbGciOiJFUzI1NiJ9..sig",
           B64Url("not json") + "." + B64Url("{}") + ".c2ln",
           B64Url(R"(["ES256"])") + "." + B64Url("{}") + ".c2ln",
           B64Url(R"({"typ":"JWT"})") + "." + B64Url("{}") + ".c2ln",
           B64Url(R"({"alg":"ES256"})") + "." + B64Url("[1,2]") + ".c2ln",
           B64Url(R"({"alg":"ES256"})") + "." + B64Url("{}") + ".not base64!"}) {
    EXPECT_EQ(Refusal(bad), "token_malformed") << bad;
  }
}

TEST_F(AuthTokenTest, SignedButWrongClaims) {
  // Properly signed by the trusted key, but not a token we would issue.
  const int64_t now = std::time(nullptr);
  struct Case {
    const char* claim;
    nlohmann::json value;  // null: the claim removed
  };
  for (const Case& c : std::vector<Case>{{"iss", "someone-else"},
                                         {"iss", nullptr},
                                         {"aud", "other-service"},
                                         {"aud", nullptr},
                                         {"sub", ""},
                                         {"sub", nullptr},
                                         {"jti", nullptr},
                                         {"roles", nlohmann::json::array()},
                                         {"roles", {"root"}},
                                         {"roles", "operator"},
                                         {"roles", nullptr},
                                         {"tenant", "acme"},  // operator with a tenant
                                         {"iat", nullptr},
                                         {"iat", "yesterday"},
                                         {"exp", nullptr},
                                         {"exp", now + int64_t{2} * 24 * 3600},  // longer than 24 h
                                         {"nbf", now + 3600}}) {
    nlohmann::json claims = GoodClaims(now);
    if (c.value.is_null()) {
      claims.erase(c.claim);
    } else {
      claims[c.claim] = c.value;
    }
    auto p = VerifyToken(SignClaims(claims), {key_.public_pem});
    ASSERT_FALSE(p.ok()) << c.claim << " = " << c.value;
    EXPECT_EQ(p.error().reason, "token_claims") << c.claim << " = " << c.value;
    EXPECT_FALSE(p.error().message.empty());
  }
  // A tenant-role token without a tenant.
  nlohmann::json claims = GoodClaims(now);
  claims["roles"] = {"tenant"};
  EXPECT_EQ(Refusal(SignClaims(claims)), "token_claims");
  claims["tenant"] = "acme";
  EXPECT_EQ(Refusal(SignClaims(claims)), "");
  // The audience may also be a list that names us.
  claims["aud"] = {"billing", "gpuaas"};
  EXPECT_EQ(Refusal(SignClaims(claims)), "");
}

TEST_F(AuthTokenTest, IssueRefusesBadPrincipalsTtlsAndKeys) {
  const auto refused = [&](const Principal& p, seconds ttl, const std::string& pem) {
    auto t = IssueToken(pem, p, ttl);
    if (t.ok()) return std::string("issued");
    EXPECT_EQ(t.error().code, Code::kInvalidArgument);
    return t.error().reason;
  };
  const std::string& k = key_.private_pem;
  EXPECT_EQ(refused({"", "", {kRoleOperator}, "", {}, {}}, hours(1), k), "principal_invalid");
  EXPECT_EQ(refused({"user:a", "", {}, "", {}, {}}, hours(1), k), "principal_invalid");
  EXPECT_EQ(refused({"user:a", "", {"admin"}, "", {}, {}}, hours(1), k), "principal_invalid");
  EXPECT_EQ(refused({"tenant:x/a", "", {kRoleTenant}, "", {}, {}}, hours(1), k),
            "principal_invalid");
  EXPECT_EQ(refused({"user:a", "acme", {kRoleOperator}, "", {}, {}}, hours(1), k),
            "principal_invalid");
  EXPECT_EQ(refused(Operator(), seconds(0), k), "token_ttl_invalid");
  EXPECT_EQ(refused(Operator(), seconds(-5), k), "token_ttl_invalid");
  EXPECT_EQ(refused(Operator(), kMaxTokenTtl + seconds(1), k), "token_ttl_invalid");
  EXPECT_EQ(refused(Operator(), kMaxTokenTtl, k), "issued");
  EXPECT_EQ(refused(Operator(), hours(1), ""), "signing_key_invalid");
  EXPECT_EQ(refused(Operator(), hours(1), "not a pem"), "signing_key_invalid");
  EXPECT_EQ(refused(Operator(), hours(1), key_.public_pem), "signing_key_invalid");
}

// fuzz_requests (issue_token_non_utf8): a subject or tenant that is not UTF-8 threw nlohmann's
// type_error 316, a control character gave INTERNAL; both are INVALID_ARGUMENT naming the claim.
TEST_F(AuthTokenTest, IssueRefusesClaimsThatAreNotUtf8OrHoldControlCharacters) {
  const std::string& k = key_.private_pem;
  const auto claim_refused = [&](const Principal& p) {
    Result<std::string> t = Error::Internal("not_issued", "");
    EXPECT_NO_THROW(t = IssueToken(k, p, hours(1)));
    if (t.ok()) return std::string("issued");
    EXPECT_EQ(t.error().code, Code::kInvalidArgument) << t.error().ToString();
    EXPECT_EQ(t.error().reason, "principal_invalid");
    return t.error().details.count("claim") ? t.error().details.at("claim") : std::string();
  };
  for (const std::string& bad :
       {std::string("\x9f"), std::string("user:\xc3"), std::string("user:\xc0\xaf"),
        std::string("user:\xed\xa0\x80"), std::string("user:\xf4\x90\x80\x80"),
        std::string("user:a\x1b[31m"), std::string("user:a\nb"), std::string("user:\x7f"),
        std::string("user:a\0b", 8)}) {
    EXPECT_EQ(claim_refused({bad, "", {kRoleOperator}, "", {}, {}}), "sub") << bad;
    EXPECT_EQ(claim_refused({"tenant:x/a", bad, {kRoleTenant}, "", {}, {}}), "tenant") << bad;
  }
  // UTF-8 text is a claim like any other and comes back unchanged.
  const Principal p{
      "user:j\xc3\xbcrgen \xe2\x82\xac \xf0\x9f\x98\x80", "", {kRoleOperator}, "", {}, {}};
  auto t = IssueToken(k, p, hours(1));
  ASSERT_TRUE(t.ok()) << t.error().ToString();
  auto v = VerifyToken(*t, {key_.public_pem});
  ASSERT_TRUE(v.ok()) << v.error().ToString();
  EXPECT_EQ(v->subject, p.subject);
}

TEST(AuthBearerTokenTest, ParsesTheAuthorizationValue) {
  EXPECT_STREQ(kHeaderAuthorization, "Authorization");
  EXPECT_EQ(BearerToken("Bearer abc.def.ghi"), "abc.def.ghi");
  EXPECT_EQ(BearerToken("bearer abc.def.ghi"), "abc.def.ghi");
  EXPECT_EQ(BearerToken("  BEARER   abc.def.ghi  "), "abc.def.ghi");
  EXPECT_EQ(BearerToken(""), "");
  EXPECT_EQ(BearerToken("Bearer"), "");
  EXPECT_EQ(BearerToken("Bearer "), "");
  EXPECT_EQ(BearerToken("Bearerabc.def.ghi"), "");
  EXPECT_EQ(BearerToken("Basic dXNlcjpwYXNz"), "");
  EXPECT_EQ(BearerToken("abc.def.ghi"), "");
  EXPECT_EQ(BearerToken("Bearer abc def"), "");
}

}  // namespace
}  // namespace gpuaas::auth
