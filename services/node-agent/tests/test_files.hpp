#pragma once
// Small file and tool helpers the node-agent's VM tests share.
#include <fstream>
#include <iterator>
#include <optional>
#include <string>

#include "gpuaas/node_agent/host/host.hpp"

namespace gpuaas::node_agent {

// A tool of this machine (tests run the real ones), nullopt when it is not installed.
inline std::optional<std::string> Tool(const std::string& name) {
  return HostRoot("/").FindCommand(name);
}

inline std::string ReadAll(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  return {std::istreambuf_iterator<char>(f), std::istreambuf_iterator<char>()};
}

inline void WriteAll(const std::string& path, const std::string& text) {
  std::ofstream f(path, std::ios::binary | std::ios::trunc);
  f << text;
}

}  // namespace gpuaas::node_agent
