#include "gpuaas/node_agent/agent/local_store.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"

#include <fcntl.h>
#include <unistd.h>

#include <cerrno>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include <fmt/format.h>

namespace gpuaas::node_agent {

namespace fs = std::filesystem;

namespace {
Error IoError(const std::string& what) {
  return Error::Internal(reason::kLocalStoreIo, fmt::format("{}: {}", what, std::strerror(errno)));
}
const std::regex kKey("^[a-z0-9][a-z0-9._-]{0,127}$");

Result<void> FsyncPath(const std::string& path, int flags) {
  int fd = ::open(path.c_str(), flags);
  if (fd < 0) return IoError("open " + path);
  int rc = ::fsync(fd);
  ::close(fd);
  if (rc != 0) return IoError("fsync " + path);
  return Ok();
}
}  // namespace

Result<LocalStore> LocalStore::Open(const std::string& dir) {
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) return Error::Internal(reason::kLocalStoreIo, "create " + dir + ": " + ec.message());
  // Temporary files left by a crash mid-write are incomplete by definition.
  for (const auto& e : fs::directory_iterator(dir, ec)) {
    if (e.path().extension() == ".tmp") fs::remove(e.path(), ec);
  }
  return LocalStore(dir);
}

std::string LocalStore::PathOf(const std::string& key) const {
  return (fs::path(dir_) / (key + ".json")).string();
}

Result<void> LocalStore::Put(const std::string& key, const nlohmann::json& value) {
  if (!std::regex_match(key, kKey)) {
    return Error::InvalidArgument(reason::kInvalidKey, "bad local store key: " + key);
  }
  std::lock_guard lock(mu_);
  const std::string path = PathOf(key);
  const std::string tmp = path + ".tmp";
  const std::string data = value.dump(2) + "\n";
  int fd = ::open(tmp.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0600);
  if (fd < 0) return IoError("open " + tmp);
  size_t off = 0;
  while (off < data.size()) {
    ssize_t n = ::write(fd, data.data() + off, data.size() - off);
    if (n < 0) {
      if (errno == EINTR) continue;
      ::close(fd);
      return IoError("write " + tmp);
    }
    off += static_cast<size_t>(n);
  }
  if (::fsync(fd) != 0) {
    ::close(fd);
    return IoError("fsync " + tmp);
  }
  ::close(fd);
  if (::rename(tmp.c_str(), path.c_str()) != 0) return IoError("rename " + tmp);
  return FsyncPath(dir_, O_RDONLY | O_DIRECTORY);
}

Result<std::optional<nlohmann::json>> LocalStore::Get(const std::string& key) const {
  std::lock_guard lock(mu_);
  std::ifstream in(PathOf(key));
  if (!in) return std::optional<nlohmann::json>();
  std::stringstream ss;
  ss << in.rdbuf();
  try {
    return std::optional<nlohmann::json>(nlohmann::json::parse(ss.str()));
  } catch (const std::exception& e) {
    return Error::Of(Code::kDataLoss, reason::kLocalStoreCorrupt,
                     fmt::format("{} is not valid JSON: {}", PathOf(key), e.what()));
  }
}

Result<void> LocalStore::Erase(const std::string& key) {
  std::lock_guard lock(mu_);
  std::error_code ec;
  fs::remove(PathOf(key), ec);
  if (ec) return Error::Internal(reason::kLocalStoreIo, ec.message());
  return FsyncPath(dir_, O_RDONLY | O_DIRECTORY);
}

std::vector<std::string> LocalStore::Keys() const {
  std::lock_guard lock(mu_);
  std::vector<std::string> keys;
  std::error_code ec;
  for (const auto& e : fs::directory_iterator(dir_, ec)) {
    if (e.path().extension() == ".json") keys.push_back(e.path().stem().string());
  }
  std::sort(keys.begin(), keys.end());
  return keys;
}

}  // namespace gpuaas::node_agent
