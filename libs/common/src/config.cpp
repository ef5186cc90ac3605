#include "gpuaas/common/config.hpp"

#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <fstream>
#include <optional>
#include <set>
#include <sstream>

#include <fmt/format.h>
#include <yaml-cpp/yaml.h>

#include "gpuaas/common/reasons.hpp"

extern char** environ;  // NOLINT

namespace gpuaas::config {

struct Schema::Field {
  std::string key;
  std::string doc;
  std::string def_text;
  std::function<std::string(const std::string&)> apply;  // parse + validate + store
};

namespace {

std::string Trim(std::string s) {
  auto ns = [](unsigned char c) { return !std::isspace(c); };
  s.erase(s.begin(), std::find_if(s.begin(), s.end(), ns));
  s.erase(std::find_if(s.rbegin(), s.rend(), ns).base(), s.end());
  return s;
}

void Flatten(const YAML::Node& node, const std::string& prefix,
             std::map<std::string, std::string>& out, std::map<std::string, std::string>& errors) {
  if (node.IsMap()) {
    for (const auto& kv : node) {
      const std::string k = kv.first.as<std::string>();
      Flatten(kv.second, prefix.empty() ? k : fmt::format("{}.{}", prefix, k), out, errors);
    }
  } else if (node.IsScalar()) {
    out[prefix] = node.Scalar();
  } else if (node.IsNull()) {
    out[prefix] = "";
  } else {
    errors[prefix] = "expected a scalar value or a mapping";
  }
}

}  // namespace

std::string EnvName(const std::string& key) {
  std::string s = "GPUAAS_";
  for (char c : key) {
    s.push_back(c == '.' || c == '-' ? '_' : static_cast<char>(std::toupper(c)));
  }
  return s;
}

std::map<std::string, std::string> ProcessEnv() {
  std::map<std::string, std::string> env;
  for (char** e = environ; e && *e; ++e) {
    std::string kv = *e;
    auto pos = kv.find('=');
    if (pos != std::string::npos) env[kv.substr(0, pos)] = kv.substr(pos + 1);
  }
  return env;
}

namespace {

// Parses raw text into T, or says why it cannot.
template <typename T>
using Parser = std::function<std::optional<T>(const std::string&)>;

template <typename T>
std::function<std::string(const std::string&)> Applier(T* target, Parser<T> parse, const char* what,
                                                       Validator<T> validate) {
  return [=](const std::string& raw) -> std::string {
    std::optional<T> parsed = parse(raw);
    if (!parsed) return fmt::format("'{}' is not {}", raw, what);
    if (validate) {
      if (auto p = validate(*parsed); !p.empty()) return p;
    }
    *target = *parsed;
    return "";
  };
}

template <typename T, typename Conv>
Parser<T> Numeric(Conv conv) {
  return [conv](const std::string& raw) -> std::optional<T> {
    const std::string v = Trim(raw);
    size_t used = 0;
    T parsed{};
    try {
      parsed = conv(v, &used);
    } catch (...) {
      return std::nullopt;
    }
    if (v.empty() || used != v.size()) return std::nullopt;
    return parsed;
  };
}

}  // namespace

void Schema::AddField(std::string key, std::string doc, std::string def_text,
                      std::function<std::string(const std::string&)> apply) {
  auto f = std::make_shared<Field>();
  f->key = std::move(key);
  f->doc = std::move(doc);
  f->def_text = std::move(def_text);
  f->apply = std::move(apply);
  fields_.push_back(std::move(f));
}

void Schema::Add(std::string key, std::string* target, std::string doc, std::string def,
                 Validator<std::string> validate) {
  *target = def;
  Parser<std::string> identity = [](const std::string& v) { return std::optional(v); };
  AddField(std::move(key), std::move(doc), std::move(def),
           Applier(target, identity, "text", std::move(validate)));
}

void Schema::Add(std::string key, int64_t* target, std::string doc, int64_t def,
                 Validator<int64_t> validate) {
  *target = def;
  auto parse = Numeric<int64_t>(
      [](const std::string& v, size_t* used) { return static_cast<int64_t>(std::stoll(v, used)); });
  AddField(std::move(key), std::move(doc), std::to_string(def),
           Applier(target, parse, "an integer", std::move(validate)));
}

void Schema::Add(std::string key, bool* target, std::string doc, bool def) {
  *target = def;
  Parser<bool> parse = [](const std::string& raw) -> std::optional<bool> {
    const std::string v = Trim(raw);
    if (v == "true" || v == "1" || v == "yes") return true;
    if (v == "false" || v == "0" || v == "no") return false;
    return std::nullopt;
  };
  AddField(std::move(key), std::move(doc), def ? "true" : "false",
           Applier<bool>(target, parse, "a boolean", {}));
}

void Schema::Add(std::string key, double* target, std::string doc, double def,
                 Validator<double> validate) {
  *target = def;
  auto parse =
      Numeric<double>([](const std::string& v, size_t* used) { return std::stod(v, used); });
  AddField(std::move(key), std::move(doc), fmt::format("{}", def),
           Applier(target, parse, "a number", std::move(validate)));
}

Result<void> Schema::Load(const std::string& path, const std::map<std::string, std::string>& env) {
  std::string text;
  if (!path.empty()) {
    std::ifstream in(path);
    if (!in) {
      return Error::InvalidArgument(reason::kConfigUnreadable,
                                    fmt::format("cannot read config file {}", path));
    }
    std::stringstream ss;
    ss << in.rdbuf();
    text = ss.str();
  }
  return LoadFromString(text, env);
}

Result<void> Schema::LoadFromString(const std::string& yaml,
                                    const std::map<std::string, std::string>& env) {
  std::map<std::string, std::string> values;
  std::map<std::string, std::string> problems;
  if (!Trim(yaml).empty()) {
    try {
      YAML::Node root = YAML::Load(yaml);
      if (!root.IsNull()) {
        if (!root.IsMap()) {
          problems["<root>"] = "config must be a YAML mapping";
        } else {
          Flatten(root, "", values, problems);
        }
      }
    } catch (const YAML::Exception& e) {
      return Error::InvalidArgument(reason::kConfigYamlInvalid, e.what());
    }
  }
  std::set<std::string> known;
  for (const auto& f : fields_) known.insert(f->key);
  for (const auto& [k, v] : values) {
    if (!known.count(k)) problems[k] = "unknown key";
  }
  for (const auto& f : fields_) {
    std::optional<std::string> value;
    if (auto it = values.find(f->key); it != values.end()) value = it->second;
    if (auto it = env.find(EnvName(f->key)); it != env.end()) value = it->second;
    if (!value) value = f->def_text;
    if (auto p = f->apply(*value); !p.empty()) problems[f->key] = p;
  }
  if (!problems.empty()) {
    std::string msg = fmt::format("{} configuration problem(s):", problems.size());
    for (const auto& [k, v] : problems) msg += fmt::format(" {}: {};", k, v);
    return Error::InvalidArgument(reason::kConfigInvalid, msg, problems);
  }
  return Ok();
}

std::string Schema::Describe() const {
  std::string out;
  for (const auto& f : fields_) {
    out += fmt::format("# {} (env {})\n{}: {}\n", f->doc, EnvName(f->key), f->key, f->def_text);
  }
  return out;
}

Validator<int64_t> Range(int64_t lo, int64_t hi) {
  return [lo, hi](const int64_t& v) -> std::string {
    if (v < lo || v > hi) return fmt::format("{} is outside [{}, {}]", v, lo, hi);
    return "";
  };
}

Validator<std::string> OneOf(std::vector<std::string> allowed) {
  return [allowed = std::move(allowed)](const std::string& v) -> std::string {
    if (std::find(allowed.begin(), allowed.end(), v) != allowed.end()) return "";
    std::string list;
    for (const auto& a : allowed) list += (list.empty() ? "" : ", ") + a;
    return fmt::format("'{}' is not one of: {}", v, list);
  };
}

Validator<std::string> NonEmpty() {
  return [](const std::string& v) -> std::string { return v.empty() ? "must not be empty" : ""; };
}

}  // namespace gpuaas::config
