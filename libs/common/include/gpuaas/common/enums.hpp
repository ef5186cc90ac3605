#pragma once
// Text forms of the platform's closed sets (protobuf enums, proto/gpuaas/v1/types.proto): the one
// conversion every service, the CLI and the tests use between an enum on the wire and its text
// in a database column (CHECK constraint), a YAML file, a log line, a metric label or a flag.
//
// The text of a value is its `(gpuaas.v1.text)` option when set ("private-nat", "vm.provision"),
// else the lowercase name after the enum's prefix (ALLOCATION_STATE_CLEANUP_BLOCKED ->
// "cleanup_blocked"). `..._UNSPECIFIED = 0` has the text "" and is never parsed from text.
#include <google/protobuf/generated_enum_reflection.h>

#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "gpuaas/common/result.hpp"

namespace gpuaas::enums {

// By descriptor: "" for UNSPECIFIED or a number the enum does not have.
const std::string& TextOf(const google::protobuf::EnumDescriptor* d, int value);
// The number of `text`, or nullopt for "" and unknown text.
std::optional<int> NumberOf(const google::protobuf::EnumDescriptor* d, std::string_view text);
// Every valid text, in declaration order (UNSPECIFIED excluded).
std::vector<std::string> TextsOf(const google::protobuf::EnumDescriptor* d);

template <typename E>
const std::string& Text(E value) {
  return TextOf(google::protobuf::GetEnumDescriptor<E>(), static_cast<int>(value));
}

template <typename E>
std::optional<E> Parse(std::string_view text) {
  auto n = NumberOf(google::protobuf::GetEnumDescriptor<E>(), text);
  if (!n) return std::nullopt;
  return static_cast<E>(*n);
}

// A value read from a column whose CHECK constraint admits only valid texts; UNSPECIFIED when
// the text is unknown (a newer writer), so readers never fail on it.
template <typename E>
E FromColumn(std::string_view text) {
  return Parse<E>(text).value_or(static_cast<E>(0));
}

template <typename E>
std::vector<std::string> Texts() {
  return TextsOf(google::protobuf::GetEnumDescriptor<E>());
}

// "a, b, c": the valid texts, for error messages and CLI help.
std::string JoinTexts(const google::protobuf::EnumDescriptor* d);

// INVALID_ARGUMENT `<field>_invalid` (reason::FieldInvalid) naming the valid texts.
Error InvalidValue(std::string_view field, std::string_view got,
                   const google::protobuf::EnumDescriptor* d);
// The same with a reason from the caller's registry (e.g. its kDatapathInvalid).
Error InvalidValue(Reason reason, std::string_view field, std::string_view got,
                   const google::protobuf::EnumDescriptor* d);

// Parses user input (a flag, a YAML value) or answers INVALID_ARGUMENT `<field>_invalid`.
template <typename E>
Result<E> ParseField(std::string_view field, std::string_view text) {
  if (auto v = Parse<E>(text)) return *v;
  return InvalidValue(field, text, google::protobuf::GetEnumDescriptor<E>());
}

// A wire value must be a declared, specified one; else INVALID_ARGUMENT `<field>_invalid`.
template <typename E>
Result<E> RequireSpecified(std::string_view field, E value) {
  if (!Text(value).empty()) return value;
  return InvalidValue(field, std::to_string(static_cast<int>(value)),
                      google::protobuf::GetEnumDescriptor<E>());
}

}  // namespace gpuaas::enums
