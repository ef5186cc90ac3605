#include "gpuaas/common/enums.hpp"

#include <google/protobuf/descriptor.h>

#include <cctype>
#include <map>
#include <mutex>

#include "gpuaas/common/reasons.hpp"
#include "gpuaas/v1/types.pb.h"

namespace gpuaas::enums {

namespace {

struct Table {
  std::map<int, std::string> text;  // number -> text (UNSPECIFIED absent)
  std::map<std::string, int, std::less<>> number;
  std::vector<std::string> ordered;
};

const Table& TableOf(const google::protobuf::EnumDescriptor* d) {
  static std::mutex mu;
  static std::map<const google::protobuf::EnumDescriptor*, Table> tables;
  std::lock_guard<std::mutex> lock(mu);
  auto [it, inserted] = tables.try_emplace(d);
  if (!inserted) return it->second;
  Table& t = it->second;
  // The prefix is the name of value 0 less "UNSPECIFIED" (ALLOCATION_STATE_).
  std::string prefix;
  if (const auto* zero = d->FindValueByNumber(0)) {
    prefix = zero->name();
    const std::string_view suffix = "UNSPECIFIED";
    if (prefix.size() >= suffix.size() &&
        prefix.compare(prefix.size() - suffix.size(), suffix.size(), suffix) == 0) {
      prefix.resize(prefix.size() - suffix.size());
    }
  }
  for (int i = 0; i < d->value_count(); ++i) {
    const auto* v = d->value(i);
    if (v->number() == 0) continue;
    std::string text = v->options().GetExtension(v1::text);
    if (text.empty()) {
      std::string_view name = v->name();
      if (name.substr(0, prefix.size()) == prefix) name.remove_prefix(prefix.size());
      for (char c : name) {
        text.push_back(static_cast<char>(std::tolower(static_cast<unsigned char>(c))));
      }
    }
    t.text[v->number()] = text;
    t.number[text] = v->number();
    t.ordered.push_back(text);
  }
  return t;
}

}  // namespace

const std::string& TextOf(const google::protobuf::EnumDescriptor* d, int value) {
  static const std::string kEmpty;
  const auto& t = TableOf(d);
  auto it = t.text.find(value);
  return it == t.text.end() ? kEmpty : it->second;
}

std::optional<int> NumberOf(const google::protobuf::EnumDescriptor* d, std::string_view text) {
  const auto& t = TableOf(d);
  auto it = t.number.find(text);
  if (it == t.number.end()) return std::nullopt;
  return it->second;
}

std::vector<std::string> TextsOf(const google::protobuf::EnumDescriptor* d) {
  return TableOf(d).ordered;
}

std::string JoinTexts(const google::protobuf::EnumDescriptor* d) {
  std::string out;
  for (const auto& t : TableOf(d).ordered) {
    if (!out.empty()) out += ", ";
    out += t;
  }
  return out;
}

namespace {
Error InvalidValueOf(std::string reason, std::string_view field, std::string_view got,
                     const google::protobuf::EnumDescriptor* d) {
  std::string f(field);
  return Error::InvalidArgument(std::move(reason),
                                f + " '" + std::string(got) + "' is not one of: " + JoinTexts(d),
                                {{f, "one of " + JoinTexts(d)}});
}
}  // namespace

Error InvalidValue(std::string_view field, std::string_view got,
                   const google::protobuf::EnumDescriptor* d) {
  return InvalidValueOf(reason::FieldInvalid(field), field, got, d);
}

Error InvalidValue(Reason reason, std::string_view field, std::string_view got,
                   const google::protobuf::EnumDescriptor* d) {
  return InvalidValueOf(reason.str(), field, got, d);
}

}  // namespace gpuaas::enums
