#include "gpuaas/common/ids.hpp"

#include <unistd.h>

#include <array>
#include <chrono>
#include <cstdint>
#include <random>

#include <fmt/format.h>

namespace gpuaas::ids {
namespace {

std::mt19937_64& Rng() {
  thread_local std::mt19937_64 rng([] {
    std::random_device rd;
    std::seed_seq seq{rd(), rd(), rd(), rd(), static_cast<unsigned>(getpid())};
    return std::mt19937_64(seq);
  }());
  return rng;
}

std::string Hex(uint64_t v, int digits) { return fmt::format("{:0{}x}", v, digits); }

bool IsHex(std::string_view s) {
  for (char c : s) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f'))) return false;
  }
  return true;
}

}  // namespace

std::string NewUuidV7() {
  const uint64_t ms = static_cast<uint64_t>(std::chrono::duration_cast<std::chrono::milliseconds>(
                                                std::chrono::system_clock::now().time_since_epoch())
                                                .count());
  const uint64_t r1 = Rng()();
  const uint64_t r2 = Rng()();
  std::array<uint8_t, 16> b{};
  for (int i = 0; i < 6; ++i) b[i] = static_cast<uint8_t>(ms >> (8 * (5 - i)));
  b[6] = static_cast<uint8_t>(0x70 | ((r1 >> 8) & 0x0f));  // version 7
  b[7] = static_cast<uint8_t>(r1);
  b[8] = static_cast<uint8_t>(0x80 | ((r2 >> 56) & 0x3f));  // variant 10
  for (int i = 9; i < 16; ++i) b[i] = static_cast<uint8_t>(r2 >> (8 * (15 - i)));
  std::string out;
  out.reserve(36);
  for (int i = 0; i < 16; ++i) {
    if (i == 4 || i == 6 || i == 8 || i == 10) out.push_back('-');
    out += fmt::format("{:02x}", b[i]);
  }
  return out;
}

bool IsUuid(std::string_view s) {
  if (s.size() != 36) return false;
  for (size_t i = 0; i < s.size(); ++i) {
    if (i == 8 || i == 13 || i == 18 || i == 23) {
      if (s[i] != '-') return false;
    } else if (!IsHex(s.substr(i, 1))) {
      return false;
    }
  }
  return true;
}

std::string NewTraceparent() {
  return "00-" + Hex(Rng()(), 16) + Hex(Rng()(), 16) + "-" + Hex(Rng()(), 16) + "-01";
}

std::string TraceId(std::string_view tp) {
  // version(2) - trace(32) - span(16) - flags(2)
  if (tp.size() != 55 || tp[2] != '-' || tp[35] != '-' || tp[52] != '-') return "";
  auto trace = tp.substr(3, 32);
  if (!IsHex(trace) || trace == std::string(32, '0') || !IsHex(tp.substr(36, 16))) return "";
  return std::string(trace);
}

std::string ChildTraceparent(std::string_view parent) {
  std::string trace = TraceId(parent);
  if (trace.empty()) return NewTraceparent();
  return "00-" + trace + "-" + Hex(Rng()(), 16) + "-" + std::string(parent.substr(53, 2));
}

std::string NewInstanceId() {
  std::array<char, 256> host{};
  if (gethostname(host.data(), host.size() - 1) != 0) host[0] = '\0';
  return fmt::format("{}-{}-{:04x}", host.data(), getpid(), Rng()() & 0xffff);
}

bool IsNodeId(std::string_view s) {
  if (s.empty() || s.size() > 63 || s.front() == '-' || s.back() == '-') return false;
  for (char c : s) {
    if (!((c >= 'a' && c <= 'z') || (c >= '0' && c <= '9') || c == '-')) return false;
  }
  return true;
}

}  // namespace gpuaas::ids
