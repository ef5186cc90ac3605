#pragma once
// Invariant checks for the fuzz targets: a broken invariant prints what broke and aborts, which
// libFuzzer records as a crash (with the input saved as crash-<sha1>).
#include <cstdio>
#include <cstdlib>
#include <string>
#include <string_view>

#include "gpuaas/common/result.hpp"

namespace gpuaas::fuzz {

[[noreturn]] inline void Fail(const char* file, int line, const char* what,
                              const std::string& detail) {
  std::fprintf(stderr, "%s:%d: invariant broken: %s\n  %s\n", file, line, what, detail.c_str());
  std::abort();
}

// A stable machine reason: snake_case, as every structured error carries.
inline bool IsSnakeCase(std::string_view s) {
  if (s.empty() || s.front() == '_' || s.back() == '_') return false;
  for (char c : s) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '_')) return false;
  }
  return true;
}

inline std::string Describe(const Error& e) { return e.ToString(); }

}  // namespace gpuaas::fuzz

#define FUZZ_CHECK(cond, detail)                                                       \
  do {                                                                                 \
    if (!(cond)) ::gpuaas::fuzz::Fail(__FILE__, __LINE__, #cond, std::string(detail)); \
  } while (false)

// A refused input is a structured error: its code and a snake_case reason.
#define FUZZ_CHECK_ERROR(err, want_code)                                                   \
  do {                                                                                     \
    const ::gpuaas::Error& fuzz_e_ = (err);                                                \
    FUZZ_CHECK(fuzz_e_.code == (want_code) && ::gpuaas::fuzz::IsSnakeCase(fuzz_e_.reason), \
               fuzz_e_.ToString());                                                        \
  } while (false)

namespace gpuaas::fuzz {
// An invariant an open bug is known to break (fuzz/README.md, "Known issues"): reported once per
// process and the run goes on, so the other paths keep being fuzzed; GPUAAS_FUZZ_STRICT=1
// (scripts/fuzz --strict) makes it a crash like any other, to reproduce it or prove a fix.
inline void KnownIssue(const char* id, const char* file, int line, const std::string& detail) {
  static const bool strict = [] {
    const char* s = std::getenv("GPUAAS_FUZZ_STRICT");
    return s != nullptr && std::string(s) == "1";
  }();
  if (strict) Fail(file, line, id, detail);
  static bool reported = false;
  if (!reported) {
    reported = true;
    std::fprintf(stderr, "known issue %s (GPUAAS_FUZZ_STRICT=1 to stop on it): %s\n", id,
                 detail.c_str());
  }
}
}  // namespace gpuaas::fuzz

#define FUZZ_KNOWN_ISSUE(id, cond, detail)                                                \
  do {                                                                                    \
    if (!(cond)) ::gpuaas::fuzz::KnownIssue(id, __FILE__, __LINE__, std::string(detail)); \
  } while (false)
