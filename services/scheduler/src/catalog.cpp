#include "gpuaas/scheduler/catalog.hpp"

#include <yaml-cpp/yaml.h>

#include <algorithm>
#include <functional>
#include <optional>
#include <set>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuaas/common/enums.hpp"
#include "scheduler_reasons.hpp"

namespace gpuaas::scheduler {

namespace {

// The shapes a catalog may model and the network modes this scheduler can sell today; the other
// modes exist in the contract for later issues.
const std::set<v1::CapacityShape> kShapes = {
    v1::CAPACITY_SHAPE_BAREMETAL, v1::CAPACITY_SHAPE_GPU_SLICE, v1::CAPACITY_SHAPE_GPU_PARTITION,
    v1::CAPACITY_SHAPE_GPU_SHARED};
const std::set<v1::NetworkMode> kModes = {v1::NETWORK_MODE_PRIVATE_NAT,
                                          v1::NETWORK_MODE_FABRIC_ONLY};
const std::set<std::string> kKeys = {
    "shape",         "sharing_mechanism",  "gpu_sku",     "allowed_gpu_counts",
    "vcpus_per_gpu", "memory_mib_per_gpu", "fabric_type", "network_modes",
    "billable_unit"};

// A scalar's text ("" for null); nullopt for a map or a sequence, where as<std::string>() throws.
std::optional<std::string> ScalarText(const YAML::Node& n) {
  if (n.IsNull()) return std::string();
  if (!n.IsScalar()) return std::nullopt;
  return n.Scalar();
}

// Shapes sold today; gpu_partition and gpu_shared are modelled, not offered.
bool Orderable(const Sku& s) {
  return s.shape == v1::CAPACITY_SHAPE_BAREMETAL || s.shape == v1::CAPACITY_SHAPE_GPU_SLICE;
}

std::vector<std::string> ModeTexts(const Sku& s) {
  std::vector<std::string> out;
  out.reserve(s.network_modes.size());
  for (auto m : s.network_modes) out.push_back(enums::Text(m));
  return out;
}

// One SKU's entry (`name`: `n`): what is wrong goes to `bad(key, why)`; nullopt when it cannot
// be read at all.
std::optional<Sku> ParseSku(
    const std::string& name, const YAML::Node& n,
    const std::function<void(const std::string&, const std::string&)>& bad) {
  if (!n.IsMap()) {
    bad("", "must be a map");
    return std::nullopt;
  }
  Sku s;
  s.name = name;
  std::string shape, fabric_type, unit;
  std::vector<std::string> modes;
  try {
    for (const auto& kv : n) {
      if (!kKeys.count(kv.first.as<std::string>())) {
        bad(kv.first.as<std::string>(), "unknown key");
      }
    }
    shape = n["shape"] ? n["shape"].as<std::string>() : "";
    s.sharing_mechanism = n["sharing_mechanism"] ? n["sharing_mechanism"].as<std::string>() : "";
    s.gpu_sku = n["gpu_sku"] ? n["gpu_sku"].as<std::string>() : "";
    if (n["allowed_gpu_counts"]) {
      s.allowed_gpu_counts = n["allowed_gpu_counts"].as<std::vector<int>>();
    }
    s.vcpus_per_gpu = n["vcpus_per_gpu"] ? n["vcpus_per_gpu"].as<int>() : 0;
    s.memory_mib_per_gpu = n["memory_mib_per_gpu"] ? n["memory_mib_per_gpu"].as<int64_t>() : 0;
    fabric_type = n["fabric_type"] ? n["fabric_type"].as<std::string>() : "";
    if (n["network_modes"]) modes = n["network_modes"].as<std::vector<std::string>>();
    unit = n["billable_unit"] ? n["billable_unit"].as<std::string>() : "gpu_second";
  } catch (const std::exception& e) {
    bad("", std::string("wrong type: ") + e.what());
    return std::nullopt;
  }
  if (auto f = enums::Parse<v1::FabricType>(fabric_type)) {
    s.fabric_type = *f;
  } else if (!fabric_type.empty()) {
    bad("fabric_type", "one of " + enums::JoinTexts(v1::FabricType_descriptor()));
  }
  if (auto u = enums::Parse<v1::BillableUnit>(unit)) {
    s.billable_unit = *u;
  } else {
    bad("billable_unit", "one of " + enums::JoinTexts(v1::BillableUnit_descriptor()));
  }
  if (auto sh = enums::Parse<v1::CapacityShape>(shape); sh && kShapes.count(*sh)) {
    s.shape = *sh;
  } else {
    bad("shape", "one of baremetal, gpu_slice, gpu_partition, gpu_shared");
  }
  if ((s.shape == v1::CAPACITY_SHAPE_GPU_PARTITION || s.shape == v1::CAPACITY_SHAPE_GPU_SHARED) &&
      s.sharing_mechanism.empty()) {
    bad("sharing_mechanism", "required for reserved shapes");
  }
  if (s.gpu_sku.empty()) bad("gpu_sku", "required");
  if (s.allowed_gpu_counts.empty()) bad("allowed_gpu_counts", "at least one count");
  for (int g : s.allowed_gpu_counts) {
    if (g < 1 || g > 16) bad("allowed_gpu_counts", "counts are 1..16");
  }
  if (modes.empty()) bad("network_modes", "at least one mode");
  for (const auto& text : modes) {
    if (auto m = enums::Parse<v1::NetworkMode>(text); m && kModes.count(*m)) {
      s.network_modes.push_back(*m);
    } else {
      bad("network_modes", "modes are private-nat, fabric-only");
    }
  }
  if (s.shape == v1::CAPACITY_SHAPE_GPU_SLICE &&
      std::count(s.network_modes.begin(), s.network_modes.end(), v1::NETWORK_MODE_FABRIC_ONLY)) {
    bad("network_modes", "fabric-only is not offered for slices (they need the NAT vNIC)");
  }
  return s;
}

}  // namespace

Result<Catalog> Catalog::Parse(const std::string& yaml) {
  std::map<std::string, std::string> problems;
  Catalog c;
  YAML::Node root;
  try {
    root = YAML::Load(yaml);
  } catch (const std::exception& e) {
    return Error::InvalidArgument(reason::kInvalidCatalog, std::string("not YAML: ") + e.what());
  }
  if (!root.IsNull() && !root.IsMap()) {
    return Error::InvalidArgument(reason::kInvalidCatalog, "the catalog must be a map with `skus`",
                                  {{"<root>", "must be a map"}});
  }
  if (!root["skus"] || !root["skus"].IsMap() || root["skus"].size() == 0) {
    return Error::InvalidArgument(reason::kInvalidCatalog,
                                  "the catalog needs a non-empty `skus` map",
                                  {{"skus", "required"}});
  }
  for (const auto& entry : root["skus"]) {
    const std::optional<std::string> sku_name = ScalarText(entry.first);
    if (!sku_name) {
      problems["skus"] = "SKU names must be strings";
      continue;
    }
    const std::string& name = *sku_name;
    const YAML::Node& n = entry.second;
    auto bad = [&](const std::string& key, const std::string& why) {
      problems[fmt::format("skus.{}.{}", name, key)] = why;
    };
    if (auto sku = ParseSku(name, n, bad)) c.skus_[name] = std::move(*sku);
  }
  if (root["images"] && !root["images"].IsMap()) {
    problems["images"] = "must be a map of name -> {url, sha256}";
  } else if (root["images"]) {
    for (const auto& entry : root["images"]) {
      const std::optional<std::string> image_name = ScalarText(entry.first);
      if (!image_name) {
        problems["images"] = "image names must be strings";
        continue;
      }
      Image img;
      img.name = *image_name;
      const YAML::Node& n = entry.second;
      auto bad = [&](const std::string& key, const std::string& why) {
        problems["images." + img.name + (key.empty() ? "" : "." + key)] = why;
      };
      if (!n.IsMap()) {
        bad("", "must be a map");
        continue;
      }
      for (const auto& kv : n) {
        const auto k = ScalarText(kv.first);
        if (!k) {
          bad("", "keys must be strings");
        } else if (*k != "url" && *k != "sha256") {
          bad(*k, "unknown key");
        }
      }
      const auto url = n["url"] ? ScalarText(n["url"]) : std::string();
      const auto sha256 = n["sha256"] ? ScalarText(n["sha256"]) : std::string();
      if (!url || !sha256) {
        bad(!url ? "url" : "sha256", "must be a string");
        continue;
      }
      img.url = *url;
      img.sha256 = *sha256;
      if (img.url.empty()) bad("url", "required");
      if (img.sha256.size() != 64 ||
          img.sha256.find_first_not_of("0123456789abcdef") != std::string::npos) {
        bad("sha256", "64 lowercase hex digits");
      }
      c.images_[img.name] = std::move(img);
    }
  }
  if (root["default_image"]) {
    const std::optional<std::string> image = ScalarText(root["default_image"]);
    if (!image) {
      problems["default_image"] = "must be an image name";
    } else {
      c.default_image_ = *image;
      if (!c.images_.count(c.default_image_)) problems["default_image"] = "not in `images`";
    }
  }
  if (!problems.empty()) {
    return Error::InvalidArgument(reason::kInvalidCatalog,
                                  fmt::format("{} problem(s) in the catalog", problems.size()),
                                  problems);
  }
  return c;
}

const Sku* Catalog::Find(const std::string& name) const {
  auto it = skus_.find(name);
  return it == skus_.end() ? nullptr : &it->second;
}

Result<const Image*> Catalog::FindImage(const std::string& name) const {
  const std::string want = name.empty() ? default_image_ : name;
  auto it = images_.find(want);
  if (it == images_.end()) {
    std::vector<std::string> names;
    for (const auto& [n, x] : images_) names.push_back(n);
    return Error::InvalidArgument(
        reason::kUnknownImage,
        want.empty() ? "the catalog has no default image; name one"
                     : "no image named '" + want + "' in the catalog",
        {{"image", want}, {"offered", fmt::format("{}", fmt::join(names, ","))}});
  }
  return &it->second;
}

Result<std::pair<const Sku*, v1::NetworkMode>> Catalog::Validate(const std::string& sku,
                                                                 int gpu_count,
                                                                 v1::NetworkMode mode) const {
  const Sku* s = Find(sku);
  if (!s) {
    std::vector<std::string> names;
    for (const auto& [n, x] : skus_) {
      if (Orderable(x)) names.push_back(n);
    }
    return Error::InvalidArgument(
        reason::kUnknownSku, "no SKU named '" + sku + "'",
        {{"sku", sku}, {"offered", fmt::format("{}", fmt::join(names, ","))}});
  }
  if (!Orderable(*s)) {
    return Error::InvalidArgument(
        reason::kShapeNotOffered,
        fmt::format("SKU {} has shape {} ({}), which is modelled but not offered yet", sku,
                    enums::Text(s->shape), s->sharing_mechanism),
        {{"shape", enums::Text(s->shape)}});
  }
  const bool count_ok =
      std::count(s->allowed_gpu_counts.begin(), s->allowed_gpu_counts.end(), gpu_count) > 0 ||
      (s->shape == v1::CAPACITY_SHAPE_BAREMETAL && gpu_count == 0);
  if (!count_ok) {
    return Error::InvalidArgument(
        reason::kGpuCountNotAllowed,
        fmt::format("SKU {} allows {} GPUs, not {}", sku, fmt::join(s->allowed_gpu_counts, "/"),
                    gpu_count),
        {{"gpu_count", std::to_string(gpu_count)},
         {"allowed", fmt::format("{}", fmt::join(s->allowed_gpu_counts, ","))}});
  }
  if (mode != v1::NETWORK_MODE_UNSPECIFIED && enums::Text(mode).empty()) {
    return enums::InvalidValue("network_mode", std::to_string(static_cast<int>(mode)),
                               v1::NetworkMode_descriptor());
  }
  const v1::NetworkMode effective =
      mode == v1::NETWORK_MODE_UNSPECIFIED ? s->network_modes.front() : mode;
  if (s->shape == v1::CAPACITY_SHAPE_GPU_SLICE && effective == v1::NETWORK_MODE_FABRIC_ONLY) {
    return Error::InvalidArgument(
        reason::kFabricOnlyNotForSlices,
        "slices always get the private-nat management vNIC; fabric-only is baremetal only",
        {{"network_mode", enums::Text(effective)}});
  }
  if (!std::count(s->network_modes.begin(), s->network_modes.end(), effective)) {
    return Error::InvalidArgument(
        reason::kNetworkModeNotAllowed,
        fmt::format("SKU {} offers network modes {}, not {}", sku, fmt::join(ModeTexts(*s), ","),
                    enums::Text(effective)),
        {{"network_mode", enums::Text(effective)}});
  }
  return std::make_pair(s, effective);
}

std::vector<placement::OrderableShape> Catalog::OrderableSlices() const {
  std::vector<placement::OrderableShape> out;
  for (const auto& [name, sku] : skus_) {
    if (sku.shape != v1::CAPACITY_SHAPE_GPU_SLICE) continue;
    out.push_back({sku.gpu_sku,
                   enums::Text(sku.fabric_type),
                   {sku.allowed_gpu_counts.begin(), sku.allowed_gpu_counts.end()}});
  }
  return out;
}

v1::ListCatalogResponse Catalog::ToProto() const {
  v1::ListCatalogResponse out;
  for (const auto& [name, s] : skus_) {
    auto* p = out.add_skus();
    p->set_name(name);
    p->set_shape(s.shape);
    p->set_gpu_sku(s.gpu_sku);
    for (int n : s.allowed_gpu_counts) p->add_allowed_gpu_counts(n);
    p->set_fabric_type(s.fabric_type);
    for (auto m : s.network_modes) p->add_network_modes(m);
    if (s.vcpus_per_gpu > 0 || s.memory_mib_per_gpu > 0) {
      p->mutable_runtime_profile()->set_vcpus_per_gpu(s.vcpus_per_gpu);
      p->mutable_runtime_profile()->set_memory_mib_per_gpu(s.memory_mib_per_gpu);
    }
    p->set_sharing_mechanism(s.sharing_mechanism);
    p->set_orderable(Orderable(s));
    p->set_billable_unit(s.billable_unit);
  }
  for (const auto& [name, img] : images_) {
    auto* p = out.add_images();
    p->set_name(name);
    p->set_url(img.url);
    p->set_sha256(img.sha256);
    p->set_is_default(name == default_image_);
  }
  return out;
}

}  // namespace gpuaas::scheduler
