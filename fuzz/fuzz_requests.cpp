// fuzz_requests: what a service does with a request before its handler touches a database, for
// every request subject the contract serves (the embedded AsyncAPI document: each receive
// operation with a reply, its channel's x-protobuf-type), plus the node reports the services
// validate the same way:
// - the subject (rpc's token split, the contract's access entry),
// - the traceparent header (a child span; a malformed parent starts a new trace),
// - the Gpuaas-Deadline-Ms header (rpc::ParseDeadlineHeader: clamped, no overflow),
// - the Authorization header (BearerToken, then VerifyToken with a fixed test key and clock),
// - request tokens issued from fuzzed principals (IssueToken -> VerifyToken round trip, a changed
//   byte refused),
// - the payload decoded as the subject's request type by rpc::DecodeRequest (what
//   rpc::Server::Handle runs: malformed_payload, or string_has_nul naming exactly the fields
//   validate::NulStringFields finds), binary and JSON round trips of what it accepts, then the pure
//   validators the handlers call (ValidateRegister, the catalog's order check, PageLimit,
//   CIDR/IPv4/MAC parsers, ValidateLeaseReport, ValidateCandidate) and what the validators promise
//   about what they accept.
#include <fuzzer/FuzzedDataProvider.h>
#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>
#include <google/protobuf/util/field_comparator.h>
#include <google/protobuf/util/json_util.h>
#include <google/protobuf/util/message_differencer.h>
#include <yaml-cpp/yaml.h>

#include <chrono>
#include <cstddef>
#include <cstdint>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

#include "fuzz_check.hpp"
#include "gpuaas/common/access.hpp"
#include "gpuaas/common/auth.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/proto_json.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/validate.hpp"
#include "gpuaas/inventory/inventory_service.hpp"
#include "gpuaas/inventory/slot_rules.hpp"
#include "gpuaas/ipam/ipam_domain.hpp"
#include "gpuaas/scheduler/catalog.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "gpuaas/v1/ipam.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "gpuaas/v1/topology.pb.h"

namespace gpuaas::access {
const char* EmbeddedAsyncApi();  // contract_embed.cpp (generated)
}  // namespace gpuaas::access

namespace gpuaas::fuzz {
namespace {

namespace pb = google::protobuf;

// A test-only ES256 key pair (never used outside the fuzzer): seeds in the corpus may carry
// tokens it signed, so the fuzzer starts from tokens that verify and mutates them.
constexpr const char* kTestPrivatePem = R"(-----BEGIN PRIVATE KEY-----
MIGHAgEAMBMGByqGSM49AgEGCCqGSM49AwEHBG0wawIBAQQg/qWH4zflxgBiLJ+O
mOohQ59CDwanMhObIVOADqBAEBuhRANCAARbul1GCVTKB1GnjxLtxxn2yXa4jaHV
xVrpR3Xgb8MoFMY7RobhI+Vv/DRjE3hfqSwsE06s5/kjqJpoViVNgbAl
-----END PRIVATE KEY-----
)";
constexpr const char* kTestPublicPem = R"(-----BEGIN PUBLIC KEY-----
MFkwEwYHKoZIzj0CAQYIKoZIzj0DAQcDQgAEW7pdRglUygdRp48S7ccZ9sl2uI2h
1cVa6Ud14G/DKBTGO0aG4SPlb/w0YxN4X6ksLBNOrOf5I6iaaFYlTYGwJQ==
-----END PUBLIC KEY-----
)";
// The verifier's clock: fixed, so a seed token stays valid (2025-06-01T00:00:00Z).
const auto kNow = std::chrono::system_clock::time_point(std::chrono::seconds(1748736000));

struct Served {
  std::string subject;
  const pb::Message* prototype = nullptr;
};

// Every request the contract serves, from the embedded AsyncAPI document, plus the node reports
// (not requests, but node input the services validate with the same kind of pure function).
const std::vector<Served>& ServedSubjects() {
  static const auto* served = [] {
    // Parsing refuses strings that are not UTF-8 and says so on stderr at every input.
    pb::SetLogHandler(nullptr);
    auto* out = new std::vector<Served>;
    const YAML::Node doc = YAML::Load(access::EmbeddedAsyncApi());
    const YAML::Node channels = doc["channels"];
    const YAML::Node messages = doc["components"]["messages"];
    auto last = [](const std::string& ref) { return ref.substr(ref.rfind('/') + 1); };
    auto prototype = [](const std::string& type) -> const pb::Message* {
      const pb::Descriptor* d = pb::DescriptorPool::generated_pool()->FindMessageTypeByName(type);
      FUZZ_CHECK(d != nullptr, "contract type not linked: " + type);
      return pb::MessageFactory::generated_factory()->GetPrototype(d);
    };
    for (const auto& op : doc["operations"]) {
      const YAML::Node o = op.second;
      if (o["action"].as<std::string>("") != "receive" || !o["reply"]) continue;
      const YAML::Node ch = channels[last(o["channel"]["$ref"].as<std::string>())];
      std::string address = ch["address"].as<std::string>();
      if (auto p = address.find('{'); p != std::string::npos) {
        address.replace(p, address.find('}', p) - p + 1, "node-a");
      }
      for (const auto& m : ch["messages"]) {
        const YAML::Node msg = messages[last(m.second["$ref"].as<std::string>())];
        out->push_back({address, prototype(msg["x-protobuf-type"].as<std::string>())});
      }
    }
    FUZZ_CHECK(out->size() >= 20, "the contract serves " + std::to_string(out->size()));
    for (const auto& s : *out) {
      FUZZ_CHECK(access::RequestAccessFor(access::EmbeddedContract(), s.subject).declared,
                 s.subject + " is served but has no access entry");
    }
    out->push_back({"node:lease_report", prototype("gpuaas.v1.LeaseReport")});
    out->push_back({"node:topology_report", prototype("gpuaas.v1.TopologyReport")});
    return out;
  }();
  return *served;
}

const scheduler::Catalog& DefaultCatalog() {
  static const auto* catalog = [] {
    auto c = scheduler::Catalog::Parse(scheduler::Catalog::DefaultYaml());
    FUZZ_CHECK(c.ok(), c.ok() ? "" : c.error().ToString());
    return new scheduler::Catalog(*c);
  }();
  return *catalog;
}

bool IsHex(std::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

// ---- subject ----

void CheckSubject(const std::string& subject) {
  const auto tokens = access::SubjectTokens(subject);
  // A subject NATS would carry: no empty token (no leading, trailing or double dot).
  bool plain = !subject.empty() && subject.front() != '.' && subject.back() != '.' &&
               subject.find("..") == std::string::npos;
  std::string joined;
  for (const auto& t : tokens) {
    if (t.empty() || t == "*" || t == ">") plain = false;
    joined += (joined.empty() ? "" : ".") + t;
  }
  if (plain) {
    FUZZ_CHECK(joined == subject, subject);
    FUZZ_CHECK(access::SubjectMatches(subject, subject), subject);
    FUZZ_CHECK(access::SubjectMatches(">", subject), subject);
  }
  const auto a = access::RequestAccessFor(access::EmbeddedContract(), subject);
  if (a.declared) {
    bool known = false;
    for (const auto& s : ServedSubjects()) known = known || s.subject == subject;
    FUZZ_CHECK(known, "access declared for a subject no operation serves: " + subject);
  }
}

// ---- traceparent ----

void CheckTraceparent(const std::string& parent) {
  const std::string child = ids::ChildTraceparent(parent);
  FUZZ_CHECK(child.size() == 55 && child.compare(0, 3, "00-") == 0 && child[35] == '-' &&
                 child[52] == '-' && IsHex(child.substr(3, 32)) && IsHex(child.substr(36, 16)),
             "child of '" + parent + "' is '" + child + "'");
  const std::string trace = ids::TraceId(child);
  FUZZ_CHECK(trace == child.substr(3, 32), child);
  if (const std::string parent_trace = ids::TraceId(parent); !parent_trace.empty()) {
    FUZZ_CHECK(parent_trace == trace, parent + " -> " + child);
  }
}

// ---- Gpuaas-Deadline-Ms ----

// What rpc::Server makes of the header (rpc::ParseDeadlineHeader): a deadline between the epoch
// and a day ahead that converts to a system_clock time_point without overflow; a decimal in that
// range is kept as is, anything that is not a decimal integer is the default.
void CheckDeadline(const std::string& header) {
  const int64_t now_ms =
      std::chrono::duration_cast<std::chrono::milliseconds>(kNow.time_since_epoch()).count();
  constexpr int64_t kDefaultMs = 10000;
  const int64_t d = rpc::ParseDeadlineHeader(header, now_ms, kDefaultMs);
  FUZZ_CHECK(d >= 0 && d <= now_ms + rpc::kMaxDeadlineAheadMs, header + " -> " + std::to_string(d));
  const auto tp = std::chrono::system_clock::time_point(std::chrono::milliseconds(d));
  FUZZ_CHECK(tp - kNow <= std::chrono::milliseconds(rpc::kMaxDeadlineAheadMs), header);
  bool decimal = !header.empty() && header.size() <= 18;  // fits int64 without overflow
  for (size_t i = 0; i < header.size(); ++i) {
    decimal = decimal && ((header[i] >= '0' && header[i] <= '9') ||
                          (i == 0 && header[i] == '-' && header.size() > 1));
  }
  if (!decimal) {
    bool digits_only = !header.empty();
    for (char c : header) digits_only = digits_only && ((c >= '0' && c <= '9') || c == '-');
    if (!digits_only) FUZZ_CHECK(d == now_ms + kDefaultMs, header + " -> " + std::to_string(d));
    return;
  }
  const int64_t v = std::stoll(header);
  if (v >= 0 && v <= now_ms + rpc::kMaxDeadlineAheadMs) FUZZ_CHECK(d == v, header);
}

// ---- tokens ----

const std::set<std::string>& TokenReasons() {
  static const std::set<std::string> reasons = {"token_missing",   "token_malformed",
                                                "token_algorithm", "token_signature",
                                                "token_expired",   "token_claims"};
  return reasons;
}

bool KnownRole(const std::string& r) {
  return r == auth::kRoleOperator || r == auth::kRoleTenant || r == auth::kRoleAuditor;
}

void CheckPrincipal(const auth::Principal& p) {
  FUZZ_CHECK(!p.subject.empty() && !p.roles.empty(), p.subject);
  for (const auto& r : p.roles) FUZZ_CHECK(KnownRole(r), r);
  FUZZ_CHECK(p.HasRole(auth::kRoleTenant) == !p.tenant.empty(), p.subject + " / " + p.tenant);
}

void CheckAuthorization(const std::string& header) {
  const std::string bearer = auth::BearerToken(header);
  if (bearer.empty()) return;
  FUZZ_CHECK(header.find(bearer) != std::string::npos, header);
  auto p = auth::VerifyToken(bearer, {kTestPublicPem}, kNow);
  if (!p.ok()) {
    FUZZ_CHECK_ERROR(p.error(), Code::kUnauthenticated);
    FUZZ_CHECK(TokenReasons().count(p.error().reason) == 1, p.error().ToString());
    return;
  }
  CheckPrincipal(*p);
}

bool Printable(const std::string& s) {
  for (char c : s) {
    if (c < 0x20 || c > 0x7e) return false;
  }
  return true;
}

// A principal from the input, signed and verified: what IssueToken accepts VerifyToken gives
// back unchanged, and a token with a changed claim byte does not verify.
void CheckIssue(FuzzedDataProvider& in) {
  auth::Principal p;
  p.subject = in.ConsumeRandomLengthString(64);
  p.tenant = in.ConsumeRandomLengthString(32);
  const int nroles = in.ConsumeIntegralInRange(0, 3);
  for (int i = 0; i < nroles; ++i) {
    static const char* const kRoles[] = {auth::kRoleOperator, auth::kRoleTenant,
                                         auth::kRoleAuditor};
    const int pick = in.ConsumeIntegralInRange(0, 3);
    p.roles.emplace_back(pick < 3 ? std::string(kRoles[pick]) : in.ConsumeRandomLengthString(16));
  }
  const auto ttl = std::chrono::seconds(in.ConsumeIntegralInRange<int64_t>(-5, 2 * 86400));
  Result<std::string> token = Error::Internal("not_issued", "");
  try {
    token = auth::IssueToken(kTestPrivatePem, p, ttl, kNow);
  } catch (const std::exception& e) {
    FUZZ_CHECK(false, std::string("IssueToken threw: ") + e.what());
  }

  bool valid =
      !p.subject.empty() && !p.roles.empty() && ttl.count() > 0 && ttl <= auth::kMaxTokenTtl;
  for (const auto& r : p.roles) valid = valid && KnownRole(r);
  valid = valid && (p.HasRole(auth::kRoleTenant) == !p.tenant.empty());
  if (Printable(p.subject) && Printable(p.tenant)) {
    FUZZ_CHECK(token.ok() == valid,
               "IssueToken(" + p.subject + ") " + (token.ok() ? "ok" : token.error().ToString()));
  }
  if (!token.ok()) {
    FUZZ_CHECK_ERROR(token.error(), Code::kInvalidArgument);
    return;
  }
  auto v = auth::VerifyToken(*token, {kTestPublicPem}, kNow);
  FUZZ_CHECK(v.ok(), v.ok() ? "" : v.error().ToString());
  FUZZ_CHECK(v->subject == p.subject && v->tenant == p.tenant && v->roles == p.roles, *token);
  CheckPrincipal(*v);
  FUZZ_CHECK(v->expires == kNow + ttl, *token);
  auto late = auth::VerifyToken(*token, {kTestPublicPem}, kNow + ttl + std::chrono::seconds(31));
  FUZZ_CHECK(!late.ok() && late.error().reason == "token_expired", *token);
  // The payload's first character carries 6 significant bits: another base64url character there
  // is another claims document, which the signature does not cover.
  const size_t dot = token->find('.');
  FUZZ_CHECK(dot != std::string::npos && dot + 1 < token->size(), *token);
  std::string forged = *token;
  forged[dot + 1] = forged[dot + 1] == 'e' ? 'f' : 'e';
  auto f = auth::VerifyToken(forged, {kTestPublicPem}, kNow);
  FUZZ_CHECK(!f.ok(), forged);
  FUZZ_CHECK_ERROR(f.error(), Code::kUnauthenticated);
}

// ---- payload ----

std::unique_ptr<pb::Message> Fresh(const pb::Message& prototype) {
  return std::unique_ptr<pb::Message>(prototype.New());
}

bool SameMessage(const pb::Message& a, const pb::Message& b) {
  pb::util::DefaultFieldComparator cmp;
  cmp.set_treat_nan_as_equal(true);
  pb::util::MessageDifferencer d;
  d.set_field_comparator(&cmp);
  return d.Compare(a, b);
}

void CheckRoundTrips(const pb::Message& m) {
  std::string wire;
  FUZZ_CHECK(m.SerializeToString(&wire), m.GetTypeName());
  auto again = Fresh(m);
  FUZZ_CHECK(again->ParseFromString(wire) && SameMessage(m, *again), m.GetTypeName());

  // JSON (protojson: operators' -o json, jsonb columns) keeps every known field.
  auto known = Fresh(m);
  known->CopyFrom(m);
  known->DiscardUnknownFields();
  std::string json;
  pb::util::JsonPrintOptions o;
  o.preserve_proto_field_names = true;
  if (!pb::util::MessageToJsonString(*known, &json, o).ok()) return;  // e.g. Timestamp > 9999
  FUZZ_CHECK(protojson::ToJson(*known) == json, json);
  auto back = Fresh(m);
  auto r = protojson::FromJson(json, back.get());
  FUZZ_CHECK(r.ok(), json + "\n  " + (r.ok() ? "" : r.error().ToString()));
  FUZZ_CHECK(SameMessage(*known, *back), json + "\n  " + back->ShortDebugString());
}

// The field-level parsers the handlers apply, on every string field with that name (nested
// included): what they accept formats back to itself.
void CheckField(const std::string& name, const std::string& v) {
  // What DecodeRequest let through holds no NUL anywhere (validate::NulStringFields).
  FUZZ_CHECK(v.find('\0') == std::string::npos, name);
  if (name == "node_id" && ids::IsNodeId(v)) {
    FUZZ_CHECK(!v.empty() && v.size() <= 63 && v.front() != '-' && v.back() != '-', v);
    for (char c : v) FUZZ_CHECK((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-', v);
  }
  if (name == "mac" || name.ends_with("_mac")) {
    if (auto mac = ipam::ParseMac(v)) {
      FUZZ_CHECK(*mac < (uint64_t{1} << 48), v);
      FUZZ_CHECK(ipam::ParseMac(ipam::FormatMac(*mac)) == mac, v);
    }
  }
  if (name == "ip" || name.ends_with("_ip") || name == "gateway") {
    if (auto ip = ipam::ParseIpv4(v)) {
      FUZZ_CHECK(ipam::ParseIpv4(ipam::FormatIpv4(*ip)) == ip, v);
    }
  }
  if (name == "subnet" || name.ends_with("cidr")) {
    auto c = ipam::ParseCidr(v);
    if (!c.ok()) {
      FUZZ_CHECK_ERROR(c.error(), Code::kInvalidArgument);
      return;
    }
    FUZZ_CHECK(c->prefix >= 8 && c->prefix <= 30 && (c->network & ~c->Mask()) == 0, v);
    auto again = ipam::ParseCidr(c->ToString());
    FUZZ_CHECK(again.ok() && again->network == c->network && again->prefix == c->prefix, v);
  }
}

void WalkFields(const pb::Message& m, int depth) {
  if (depth > 8) return;
  const pb::Reflection* r = m.GetReflection();
  std::vector<const pb::FieldDescriptor*> fields;
  r->ListFields(m, &fields);
  for (const auto* f : fields) {
    if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_STRING) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(m, f); ++i) {
          CheckField(f->name(), r->GetRepeatedString(m, f, i));
        }
      } else {
        CheckField(f->name(), r->GetString(m, f));
      }
    } else if (f->cpp_type() == pb::FieldDescriptor::CPPTYPE_MESSAGE) {
      if (f->is_repeated()) {
        for (int i = 0; i < r->FieldSize(m, f); ++i) {
          WalkFields(r->GetRepeatedMessage(m, f, i), depth + 1);
        }
      } else {
        WalkFields(r->GetMessage(m, f), depth + 1);
      }
    } else if (f->name() == "page_size" && f->cpp_type() == pb::FieldDescriptor::CPPTYPE_INT32 &&
               !f->is_repeated()) {
      const int32_t size = r->GetInt32(m, f);
      auto limit = rpc::PageLimit(size);
      FUZZ_CHECK(limit.ok() == (size >= 0 && size <= 1000), std::to_string(size));
      if (limit.ok()) {
        FUZZ_CHECK(*limit >= 1 && *limit <= 1000, std::to_string(size));
      } else {
        FUZZ_CHECK_ERROR(limit.error(), Code::kInvalidArgument);
      }
    }
  }
}

void CheckRegister(const v1::RegisterNodeRequest& req) {
  auto r = inventory::ValidateRegister(req);
  if (!r.ok()) {
    FUZZ_CHECK_ERROR(r.error(), Code::kInvalidArgument);
    FUZZ_CHECK(!r.error().details.empty(), r.error().ToString());
    return;
  }
  FUZZ_CHECK(inventory::ValidNodeId(req.node_id()) && !req.hostname().empty(),
             req.ShortDebugString());
}

void CheckCreate(const v1::CreateAllocationRequest& req) {
  auto r = DefaultCatalog().Validate(req.sku(), req.gpu_count(), req.network_mode());
  if (!r.ok()) {
    FUZZ_CHECK(IsSnakeCase(r.error().reason), r.error().ToString());
    FUZZ_CHECK(r.error().code == Code::kInvalidArgument || r.error().code == Code::kNotFound ||
                   r.error().code == Code::kFailedPrecondition,
               r.error().ToString());
    return;
  }
  const scheduler::Sku* sku = r->first;
  FUZZ_CHECK(sku != nullptr && sku->name == req.sku(), req.sku());
  FUZZ_CHECK(!sku->allowed_gpu_counts.empty(), sku->name);
  if (req.gpu_count() != 0) {
    bool allowed = false;
    for (int n : sku->allowed_gpu_counts) allowed = allowed || n == req.gpu_count();
    FUZZ_CHECK(allowed, req.ShortDebugString());
  }
  FUZZ_CHECK(r->second != v1::NETWORK_MODE_UNSPECIFIED, req.ShortDebugString());
}

void CheckSetSubnet(const v1::SetSubnetRequest& req) {
  auto c = ipam::ParseCidr(req.subnet());
  if (!c.ok()) return;
  auto gw = ipam::ResolveGateway(*c, req.gateway());
  if (!gw.ok()) {
    FUZZ_CHECK_ERROR(gw.error(), Code::kInvalidArgument);
    return;
  }
  FUZZ_CHECK(c->Contains(*gw) && *gw != c->network && *gw != c->Broadcast(),
             req.ShortDebugString());
}

void CheckLeaseReport(const v1::LeaseReport& report) {
  auto r = ipam::ValidateLeaseReport(report);
  if (!r.ok()) {
    FUZZ_CHECK_ERROR(r.error(), Code::kInvalidArgument);
    return;
  }
  FUZZ_CHECK(ids::IsNodeId(report.node_id()), report.node_id());
}

void CheckTopology(const v1::TopologyReport& report) {
  static const std::set<std::string> kReasons = {
      inventory::reason::kGpuPciAddressMissing.str(),
      inventory::reason::kGpuNotFound.str(),
      inventory::reason::kNvmeByIdMissing.str(),
      inventory::reason::kNvmeNotFound.str(),
      inventory::reason::kNvmeOsDisk.str(),
      inventory::reason::kNvmeMounted.str(),
      inventory::reason::kNvmeChildPartitionMounted.str(),
      inventory::reason::kNvmeUnexpectedFilesystem.str(),
      inventory::reason::kNvmeInUse.str(),
      inventory::reason::kFabricNotPerSlotVf.str(),
      inventory::reason::kFabricVfMissing.str(),
      inventory::reason::kFabricVfNotFound.str(),
      inventory::reason::kFabricVfDuplicate.str()};
  inventory::ApprovalContext ctx;
  ctx.report = &report;
  for (const auto& c : report.candidates()) {
    for (const auto& rej : inventory::ValidateCandidate(c, ctx)) {
      FUZZ_CHECK(kReasons.count(rej.reason()) == 1, rej.ShortDebugString());
    }
  }
}

void CheckPayload(const Served& s, const std::string& payload) {
  auto m = Fresh(*s.prototype);
  // rpc::Server's one decode path: malformed_payload, or string_has_nul naming every field.
  auto decoded = rpc::DecodeRequest(payload, *m);
  auto parsed = Fresh(*s.prototype);
  const bool parses = parsed->ParseFromString(payload);
  const auto nul_fields = parses ? validate::NulStringFields(*parsed) : std::vector<std::string>{};
  if (!decoded.ok()) {
    FUZZ_CHECK_ERROR(decoded.error(), Code::kInvalidArgument);
    if (!parses) {
      FUZZ_CHECK(decoded.error().reason == "malformed_payload", decoded.error().ToString());
    } else {
      FUZZ_CHECK(decoded.error().reason == "string_has_nul" && !nul_fields.empty() &&
                     decoded.error().details.size() == nul_fields.size(),
                 decoded.error().ToString());
      for (const auto& path : nul_fields) {
        FUZZ_CHECK(decoded.error().details.count(path) == 1, path);
      }
    }
    return;
  }
  FUZZ_CHECK(parses && nul_fields.empty(), parsed->ShortDebugString());
  CheckRoundTrips(*m);
  WalkFields(*m, 0);
  const std::string& type = m->GetDescriptor()->full_name();
  if (type == "gpuaas.v1.RegisterNodeRequest") {
    CheckRegister(static_cast<const v1::RegisterNodeRequest&>(*m));
  } else if (type == "gpuaas.v1.CreateAllocationRequest") {
    CheckCreate(static_cast<const v1::CreateAllocationRequest&>(*m));
  } else if (type == "gpuaas.v1.SetSubnetRequest") {
    CheckSetSubnet(static_cast<const v1::SetSubnetRequest&>(*m));
  } else if (type == "gpuaas.v1.LeaseReport") {
    CheckLeaseReport(static_cast<const v1::LeaseReport&>(*m));
  } else if (type == "gpuaas.v1.TopologyReport") {
    CheckTopology(static_cast<const v1::TopologyReport&>(*m));
  }
}

}  // namespace
}  // namespace gpuaas::fuzz

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  using namespace gpuaas::fuzz;  // NOLINT(google-build-using-namespace)
  FuzzedDataProvider in(data, size);
  const auto& served = ServedSubjects();
  const uint8_t mode = in.ConsumeIntegral<uint8_t>();
  const Served& s = served[in.ConsumeIntegralInRange<size_t>(0, served.size() - 1)];
  CheckSubject((mode & 1) != 0 ? in.ConsumeRandomLengthString(256) : s.subject);
  CheckTraceparent(in.ConsumeRandomLengthString(128));
  CheckAuthorization(in.ConsumeRandomLengthString(1024));
  if ((mode & 4) != 0) CheckDeadline(in.ConsumeRandomLengthString(32));
  if ((mode & 2) != 0) CheckIssue(in);  // ES256 sign + verify: ~2 ms, so not every input
  CheckPayload(s, in.ConsumeRemainingBytesAsString());
  return 0;
}
