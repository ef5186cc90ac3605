#include "gpuaas/common/validate.hpp"

#include <google/protobuf/descriptor.h>
#include <google/protobuf/message.h>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "gpuaas/common/reasons.hpp"

namespace gpuaas::validate {

namespace {

using google::protobuf::FieldDescriptor;
using google::protobuf::Message;

bool HasNul(const std::string& s) { return s.find('\0') != std::string::npos; }

// A map key as it appears in a path: quoted, with a NUL written as \0.
std::string QuoteKey(const std::string& key) {
  std::string out = "\"";
  for (char c : key) {
    if (c == '\0') {
      out += "\\0";
    } else {
      out += c;
    }
  }
  return out + "\"";
}

// The key of a map entry as text (keys are strings or integers or bools).
std::string MapKey(const Message& entry) {
  const auto* key = entry.GetDescriptor()->map_key();
  const auto* r = entry.GetReflection();
  switch (key->cpp_type()) {
    case FieldDescriptor::CPPTYPE_STRING:
      return QuoteKey(r->GetString(entry, key));
    case FieldDescriptor::CPPTYPE_INT32:
      return std::to_string(r->GetInt32(entry, key));
    case FieldDescriptor::CPPTYPE_INT64:
      return std::to_string(r->GetInt64(entry, key));
    case FieldDescriptor::CPPTYPE_UINT32:
      return std::to_string(r->GetUInt32(entry, key));
    case FieldDescriptor::CPPTYPE_UINT64:
      return std::to_string(r->GetUInt64(entry, key));
    case FieldDescriptor::CPPTYPE_BOOL:
      return r->GetBool(entry, key) ? "true" : "false";
    default:
      return "?";
  }
}

bool IsString(const FieldDescriptor* f) { return f->type() == FieldDescriptor::TYPE_STRING; }

void Walk(const Message& m, const std::string& prefix, std::vector<std::string>& out) {
  const auto* r = m.GetReflection();
  std::vector<const FieldDescriptor*> fields;
  r->ListFields(m, &fields);  // set fields only: an empty string cannot hold a NUL
  for (const auto* f : fields) {
    const std::string path = prefix.empty() ? f->name() : prefix + "." + f->name();
    if (f->is_map()) {
      const auto* value = f->message_type()->map_value();
      for (int i = 0; i < r->FieldSize(m, f); ++i) {
        const Message& entry = r->GetRepeatedMessage(m, f, i);
        const std::string at = fmt::format("{}[{}]", path, MapKey(entry));
        const auto* key = entry.GetDescriptor()->map_key();
        if (IsString(key) && HasNul(entry.GetReflection()->GetString(entry, key))) {
          out.push_back(at + " (key)");
        }
        if (IsString(value) && HasNul(entry.GetReflection()->GetString(entry, value))) {
          out.push_back(at);
        } else if (value->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
          Walk(entry.GetReflection()->GetMessage(entry, value), at, out);
        }
      }
    } else if (f->is_repeated()) {
      for (int i = 0; i < r->FieldSize(m, f); ++i) {
        const std::string at = fmt::format("{}[{}]", path, i);
        if (IsString(f) && HasNul(r->GetRepeatedString(m, f, i))) {
          out.push_back(at);
        } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
          Walk(r->GetRepeatedMessage(m, f, i), at, out);
        }
      }
    } else if (IsString(f)) {
      if (HasNul(r->GetString(m, f))) out.push_back(path);
    } else if (f->cpp_type() == FieldDescriptor::CPPTYPE_MESSAGE) {
      Walk(r->GetMessage(m, f), path, out);
    }
  }
}

}  // namespace

std::vector<std::string> NulStringFields(const google::protobuf::Message& m) {
  std::vector<std::string> out;
  Walk(m, "", out);
  return out;
}

Result<void> RefuseNulStrings(const google::protobuf::Message& m) {
  const auto bad = NulStringFields(m);
  if (bad.empty()) return Ok();
  std::map<std::string, std::string> details;
  for (const auto& path : bad) details[path] = "contains a NUL byte";
  return Error::InvalidArgument(
      reason::kStringHasNul,
      fmt::format("{} has a NUL byte; text fields may not contain NUL", fmt::join(bad, ", ")),
      std::move(details));
}

std::string TextProblem(std::string_view s) {
  size_t i = 0;
  while (i < s.size()) {
    const auto c = static_cast<unsigned char>(s[i]);
    if (c < 0x20 || c == 0x7f) return fmt::format("control character 0x{:02x} at byte {}", c, i);
    if (c < 0x80) {
      ++i;
      continue;
    }
    // Continuation bytes and the range of the first one, per RFC 3629 (no overlongs, no
    // surrogates, nothing past U+10FFFF).
    int n = 0;
    unsigned char lo = 0x80;
    unsigned char hi = 0xbf;
    if (c >= 0xc2 && c <= 0xdf) {
      n = 1;
    } else if (c >= 0xe0 && c <= 0xef) {
      n = 2;
      if (c == 0xe0) lo = 0xa0;
      if (c == 0xed) hi = 0x9f;
    } else if (c >= 0xf0 && c <= 0xf4) {
      n = 3;
      if (c == 0xf0) lo = 0x90;
      if (c == 0xf4) hi = 0x8f;
    } else {
      return fmt::format("not UTF-8 at byte {}", i);
    }
    if (i + static_cast<size_t>(n) >= s.size()) return fmt::format("not UTF-8 at byte {}", i);
    for (int k = 1; k <= n; ++k) {
      const auto b = static_cast<unsigned char>(s[i + k]);
      if (b < (k == 1 ? lo : 0x80) || b > (k == 1 ? hi : 0xbf)) {
        return fmt::format("not UTF-8 at byte {}", i);
      }
    }
    // U+FFFE and U+FFFF are noncharacters (not XML characters either).
    if (c == 0xef && static_cast<unsigned char>(s[i + 1]) == 0xbf &&
        static_cast<unsigned char>(s[i + 2]) >= 0xbe) {
      return fmt::format("noncharacter at byte {}", i);
    }
    i += static_cast<size_t>(n) + 1;
  }
  return "";
}

}  // namespace gpuaas::validate
