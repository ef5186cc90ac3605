#include "gpuaas/node_agent/runtime/libvirt_runtime.hpp"

#include <arpa/inet.h>
#include <fcntl.h>
#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>
#include <linux/fs.h>
#include <netinet/in.h>
#include <poll.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/sysmacros.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <future>
#include <map>
#include <memory>
#include <set>
#include <sstream>
#include <thread>
#include <tuple>

#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>
#include <fmt/ranges.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/node_agent/discovery/discovery.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"
#include "gpuaas/v1/node.pb.h"
#include "host/tool_run.hpp"
#include "runtime/image_cache.hpp"

namespace gpuaas::node_agent {
namespace {

namespace fs = std::filesystem;
using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

constexpr const char* kRuntime = "libvirt";

std::string Errno(int e) { return std::strerror(e); }

// ---------------------------------------------------------------------------------------------
// libvirt.

void SilentVirError(void* /*user*/, virErrorPtr /*err*/) {}

struct DomainFree {
  void operator()(virDomainPtr d) const {
    if (d) virDomainFree(d);
  }
};
using DomainPtr = std::unique_ptr<virDomain, DomainFree>;

Error LibvirtError(const std::string& stage, Reason reason, const std::string& what,
                   std::map<std::string, std::string> det = {}) {
  const char* msg = virGetLastErrorMessage();
  det["libvirt_code"] = std::to_string(virGetLastErrorCode());
  return StageError(Code::kInternal, reason, fmt::format("{}: {}", what, msg ? msg : "unknown"),
                    stage, std::move(det));
}

// The domain called `name`, nullopt when there is none.
Result<std::optional<DomainPtr>> LookupDomain(virConnectPtr conn, const std::string& name,
                                              const std::string& stage) {
  virResetLastError();
  virDomainPtr d = virDomainLookupByName(conn, name.c_str());
  if (d) return std::optional<DomainPtr>(DomainPtr(d));
  if (virGetLastErrorCode() == VIR_ERR_NO_DOMAIN) return std::optional<DomainPtr>();
  return LibvirtError(stage, reason::kLibvirtError, "looking up domain " + name,
                      {{"domain_name", name}});
}

std::string StateName(int state) {
  switch (state) {
    case VIR_DOMAIN_RUNNING:
      return "running";
    case VIR_DOMAIN_BLOCKED:
      return "blocked";
    case VIR_DOMAIN_PAUSED:
      return "paused";
    case VIR_DOMAIN_SHUTDOWN:
      return "shutting_down";
    case VIR_DOMAIN_SHUTOFF:
      return "shutoff";
    case VIR_DOMAIN_CRASHED:
      return "crashed";
    case VIR_DOMAIN_PMSUSPENDED:
      return "suspended";
    default:
      return "unknown";
  }
}

std::string DomainState(virDomainPtr d) {
  int state = 0, reason = 0;
  if (virDomainGetState(d, &state, &reason, 0) != 0) return "unknown";
  return StateName(state);
}

}  // namespace

std::vector<std::string> HostdevPciAddresses(const std::string& xml) {
  std::vector<std::string> out;
  auto attr = [](const std::string& tag, const std::string& name) -> std::optional<unsigned> {
    const auto v = XmlAttr(tag, name);
    if (!v) return std::nullopt;
    try {
      return static_cast<unsigned>(std::stoul(*v, nullptr, 0));
    } catch (...) {
      return std::nullopt;
    }
  };
  for (size_t pos = xml.find("<hostdev"); pos != std::string::npos;
       pos = xml.find("<hostdev", pos + 1)) {
    const auto end = xml.find("</hostdev>", pos);
    if (end == std::string::npos) break;
    const std::string block = xml.substr(pos, end - pos);
    const auto src = block.find("<source");
    if (block.find("type='pci'") == std::string::npos || src == std::string::npos) continue;
    const auto addr = block.find("<address", src);
    if (addr == std::string::npos) continue;
    const std::string tag = block.substr(addr, block.find('>', addr) - addr);
    auto d = attr(tag, "domain"), b = attr(tag, "bus"), sl = attr(tag, "slot"),
         f = attr(tag, "function");
    if (d && b && sl && f) out.push_back(fmt::format("{:04x}:{:02x}:{:02x}.{:x}", *d, *b, *sl, *f));
  }
  return out;
}

namespace {

// Refuses (device_attached, stage validate) a GPU or fabric VF of the bundle that another
// libvirt domain (running or only defined) already passes through: a second VM must never get
// it, and starting that domain later would take it away from this one.
Result<void> CheckDevicesFree(virConnectPtr conn, const v1::ProvisionBundle& b,
                              const std::string& own_name) {
  std::map<std::string, std::string> wanted;  // lowercase PCI address -> what it is
  for (const auto& s : b.slots()) {
    if (!s.gpu_pci_address().empty()) wanted[Lower(s.gpu_pci_address())] = "gpu " + s.slot_key();
    if (!s.fabric_vf_pci_address().empty()) {
      wanted[Lower(s.fabric_vf_pci_address())] = "fabric VF " + s.slot_key();
    }
  }
  virDomainPtr* doms = nullptr;
  virResetLastError();
  const int n = virConnectListAllDomains(conn, &doms, 0);
  if (n < 0) return LibvirtError("validate", reason::kLibvirtError, "listing domains");
  std::optional<Error> conflict;
  for (int i = 0; i < n; ++i) {
    DomainPtr d(doms[i]);
    const char* name = virDomainGetName(d.get());
    if (conflict || !name || own_name == name) continue;
    char* xml = virDomainGetXMLDesc(d.get(), VIR_DOMAIN_XML_INACTIVE);
    if (!xml) continue;
    const std::string text(xml);
    std::free(xml);
    for (const auto& addr : HostdevPciAddresses(text)) {
      auto it = wanted.find(addr);
      if (it == wanted.end()) continue;
      conflict = StageError(
          Code::kFailedPrecondition, reason::kDeviceAttached,
          fmt::format("{} ({}) is passed through to domain {} ({})", it->second, addr, name,
                      DomainState(d.get())),
          "validate",
          {{"pci_address", addr}, {"domain_name", name}, {"state", DomainState(d.get())}});
      break;
    }
  }
  std::free(doms);
  if (conflict) return *conflict;
  return Ok();
}

// Undefines `d` with its NVRAM (and managed save / snapshot metadata), retried: a UEFI domain
// whose undefine fails stays behind as a shut-off domain that keeps its raw disks "in use". A
// driver without NVRAM support (the test driver) gets a plain undefine, and the NVRAM file the
// domain XML names is removed here. Returns a note for the progress detail.
Result<std::string> UndefineDomain(virConnectPtr conn, const std::string& name,
                                   const LibvirtOptions& o, const std::string& stage) {
  const unsigned full = VIR_DOMAIN_UNDEFINE_NVRAM | VIR_DOMAIN_UNDEFINE_MANAGED_SAVE |
                        VIR_DOMAIN_UNDEFINE_SNAPSHOTS_METADATA;
  unsigned flags = full;
  std::string note = "undefined with NVRAM";
  const int attempts = std::max(1, o.undefine_attempts);
  for (int i = 1;; ++i) {
    auto d = LookupDomain(conn, name, stage);
    if (!d.ok()) return d.error();
    if (!d->has_value()) return note;
    virResetLastError();
    if (virDomainUndefineFlags(d->value().get(), flags) == 0) continue;  // re-check: gone?
    const int code = virGetLastErrorCode();
    if (flags == full && (code == VIR_ERR_INVALID_ARG || code == VIR_ERR_NO_SUPPORT)) {
      flags = 0;  // the driver knows no NVRAM flag
      std::error_code ec;
      fs::remove(fmt::format("{}/{}_VARS.fd", o.domain.nvram_dir, name), ec);
      note = "undefined (driver without NVRAM support; NVRAM file removed by the agent)";
      continue;
    }
    if (i >= attempts) {
      return LibvirtError(stage, reason::kUndefineFailed,
                          fmt::format("undefining {} ({} attempts)", name, attempts),
                          {{"domain_name", name}});
    }
    std::this_thread::sleep_for(o.undefine_retry_delay);
  }
}

// ---------------------------------------------------------------------------------------------
// Disks.

struct SlotDisk {
  std::string slot_key;
  std::string by_id;        // as the bundle names it
  std::string xml_path;     // host path of the by-id link (stable across reboots)
  std::string target_path;  // the resolved device node: what is checked and written
};

Result<SlotDisk> ResolveSlotDisk(const HostRoot& host, const std::string& slot_key,
                                 const std::string& by_id, const std::string& stage) {
  auto r = host.Resolve(by_id);
  if (!r || !host.Exists(*r)) {
    return StageError(Code::kNotFound, reason::kDiskNotFound,
                      "slot " + slot_key + ": " + by_id + " does not resolve to a device", stage,
                      {{"slot_key", slot_key}, {"nvme_by_id", by_id}});
  }
  return SlotDisk{slot_key, by_id, host.Real(by_id), host.Real(*r)};
}

std::string ReadSmall(const std::string& path) {
  std::ifstream f(path);
  std::stringstream ss;
  ss << f.rdbuf();
  return ss.str();
}

std::string DevString(dev_t d) { return fmt::format("{}:{}", major(d), minor(d)); }

// "\040" escapes in /proc mount tables.
std::string Unescape(const std::string& s) {
  std::string out;
  for (size_t i = 0; i < s.size(); ++i) {
    auto octal = [&](size_t j) { return j < s.size() && s[j] >= '0' && s[j] <= '7'; };
    if (s[i] == '\\' && octal(i + 1) && octal(i + 2) && octal(i + 3)) {
      out += static_cast<char>(std::stoi(s.substr(i + 1, 3), nullptr, 8));
      i += 3;
    } else {
      out += s[i];
    }
  }
  return out;
}

// ---------------------------------------------------------------------------------------------
// Seeds and images.

bool IsHostname(const std::string& h) {
  if (h.empty() || h.size() > 253) return false;
  size_t start = 0;
  while (start <= h.size()) {
    size_t dot = h.find('.', start);
    if (dot == std::string::npos) dot = h.size();
    const std::string label = h.substr(start, dot - start);
    if (label.empty() || label.size() > 63 || label.front() == '-' || label.back() == '-') {
      return false;
    }
    if (!std::all_of(label.begin(), label.end(), [](char c) {
          return std::isalnum(static_cast<unsigned char>(c)) || c == '-';
        })) {
      return false;
    }
    start = dot + 1;
  }
  return true;
}

// A YAML double-quoted scalar (JSON strings are valid YAML).
std::string Quote(const std::string& s) { return nlohmann::json(s).dump(); }

}  // namespace

// ---------------------------------------------------------------------------------------------
// Public building blocks.

std::optional<std::string> LeasedIp(const std::string& lease_file, const std::string& mac) {
  std::ifstream f(lease_file);
  if (!f) return std::nullopt;
  const std::string want = Lower(mac);
  const auto now = std::chrono::duration_cast<std::chrono::seconds>(
                       std::chrono::system_clock::now().time_since_epoch())
                       .count();
  std::optional<std::string> ip;
  std::string line;
  while (std::getline(f, line)) {
    auto fields = SplitWs(line);
    if (fields.size() < 3 || Lower(fields[1]) != want) continue;
    auto expiry = ParseInt(fields[0]);
    if (!expiry || (*expiry != 0 && *expiry < now)) continue;
    if (!IsValidIpv4(fields[2])) continue;  // as ObserveLeases: only IPv4 leases count
    ip = fields[2];                         // the last entry for the MAC wins
  }
  return ip;
}

bool ProbeSshBanner(const std::string& ip, int port, milliseconds timeout) {
  const auto deadline = Clock::now() + timeout;
  auto left_ms = [&] {
    return static_cast<int>(std::max<long long>(
        0, std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count()));
  };
  sockaddr_in sa{};
  sa.sin_family = AF_INET;
  sa.sin_port = htons(static_cast<uint16_t>(port));
  if (::inet_pton(AF_INET, ip.c_str(), &sa.sin_addr) != 1) return false;
  const int fd = ::socket(AF_INET, SOCK_STREAM | SOCK_NONBLOCK | SOCK_CLOEXEC, 0);
  if (fd < 0) return false;
  bool ok = false;
  do {
    if (::connect(fd, reinterpret_cast<sockaddr*>(&sa), sizeof(sa)) != 0) {
      if (errno != EINPROGRESS) break;
      pollfd p{fd, POLLOUT, 0};
      if (::poll(&p, 1, left_ms()) != 1) break;
      int err = 0;
      socklen_t len = sizeof(err);
      if (::getsockopt(fd, SOL_SOCKET, SO_ERROR, &err, &len) != 0 || err != 0) break;
    }
    std::string banner;
    while (banner.size() < 4) {
      pollfd p{fd, POLLIN, 0};
      if (::poll(&p, 1, left_ms()) != 1) break;
      char buf[256];
      const ssize_t n = ::read(fd, buf, sizeof(buf));
      if (n <= 0) break;
      banner.append(buf, static_cast<size_t>(n));
    }
    ok = banner.rfind("SSH-", 0) == 0;
  } while (false);
  ::close(fd);
  return ok;
}

SshProbeFn SshProbeInNetns(const std::string& netns) {
  if (netns.empty()) return ProbeSshBanner;
  return [netns](const std::string& ip, int port, milliseconds timeout) {
    // setns(CLONE_NEWNET) moves only the calling thread: a short-lived thread enters the
    // namespace, probes and exits; the agent's own threads stay where they are.
    bool ok = false;
    std::thread t([&] {
      const int fd = ::open(("/run/netns/" + netns).c_str(), O_RDONLY | O_CLOEXEC);
      if (fd < 0) return;
      const bool entered = ::setns(fd, CLONE_NEWNET) == 0;
      ::close(fd);
      if (entered) ok = ProbeSshBanner(ip, port, timeout);
    });
    t.join();
    return ok;
  };
}

Result<DiskTarget> CheckDiskTarget(const std::string& path, bool allow_regular_file,
                                   const std::string& stage) {
  auto refuse = [&](Reason reason, std::string message,
                    std::map<std::string, std::string> det = {}) {
    det["path"] = path;
    det["evidence"] = "kernel";
    return StageError(Code::kFailedPrecondition, reason, std::move(message), stage, std::move(det));
  };
  struct stat st {};
  if (::stat(path.c_str(), &st) != 0) {
    return refuse(reason::kDiskNotFound, fmt::format("{}: {}", path, Errno(errno)));
  }
  DiskTarget t;
  t.path = path;
  if (S_ISREG(st.st_mode)) {
    if (!allow_regular_file) {
      return refuse(reason::kDiskNotBlockDevice, path + " is a regular file, not a block device");
    }
    t.size = static_cast<uint64_t>(st.st_size);
    return t;
  }
  if (!S_ISBLK(st.st_mode)) {
    return refuse(reason::kDiskNotBlockDevice, path + " is not a block device");
  }
  t.block = true;
  const std::string dev = DevString(st.st_rdev);
  const std::string sys = "/sys/dev/block/" + dev;
  // The disk and its partitions, by device number.
  std::map<std::string, std::string> devs = {{dev, ""}};
  std::error_code ec;
  const fs::path sysdir = fs::canonical(sys, ec);
  if (!ec) {
    for (const auto& e : fs::directory_iterator(sysdir, ec)) {
      if (!fs::exists(e.path() / "partition")) continue;
      devs[Trim(ReadSmall((e.path() / "dev").string()))] = e.path().filename().string();
    }
  }
  std::istringstream mi(ReadSmall("/proc/self/mountinfo"));
  std::string line;
  while (std::getline(mi, line)) {
    auto f = SplitWs(line);
    if (f.size() < 5) continue;
    auto it = devs.find(f[2]);
    if (it == devs.end()) continue;
    const std::string mnt = Unescape(f[4]);
    if (it->second.empty()) {
      return refuse(reason::kDiskMounted, fmt::format("{} is mounted at {}", path, mnt),
                    {{"mountpoint", mnt}});
    }
    return refuse(reason::kDiskChildMounted,
                  fmt::format("{}: partition {} is mounted at {}", path, it->second, mnt),
                  {{"partition", it->second}, {"mountpoint", mnt}});
  }
  std::istringstream sw(ReadSmall("/proc/swaps"));
  std::getline(sw, line);  // header
  while (std::getline(sw, line)) {
    auto f = SplitWs(line);
    struct stat ss {};
    if (f.empty() || ::stat(Unescape(f[0]).c_str(), &ss) != 0 || !S_ISBLK(ss.st_mode)) continue;
    if (auto it = devs.find(DevString(ss.st_rdev)); it != devs.end()) {
      return refuse(it->second.empty() ? reason::kDiskMounted : reason::kDiskChildMounted,
                    fmt::format("{} is in use as swap", path), {{"mountpoint", "[SWAP]"}});
    }
  }
  for (const auto& [d, part] : devs) {
    const std::string holders = "/sys/dev/block/" + d + "/holders";
    if (fs::is_directory(holders, ec) && !fs::is_empty(holders, ec)) {
      return refuse(reason::kDiskHeld,
                    fmt::format("{}{} is held by device-mapper/md ({})", path,
                                part.empty() ? "" : " (partition " + part + ")",
                                fs::directory_iterator(holders)->path().filename().string()));
    }
  }
  const int fd = ::open(path.c_str(), O_RDONLY | O_EXCL | O_CLOEXEC);
  if (fd < 0) {
    if (errno == EBUSY) {
      return refuse(reason::kDiskBusy, path + " is in exclusive use (open O_EXCL: busy)");
    }
    return refuse(reason::kDiskUnreadable, fmt::format("{}: {}", path, Errno(errno)));
  }
  uint64_t size = 0;
  if (::ioctl(fd, BLKGETSIZE64, &size) == 0) t.size = size;
  ::close(fd);
  auto discard = ParseInt(Trim(ReadSmall(sys + "/queue/discard_max_bytes")));
  t.discard = discard && *discard > 0;
  return t;
}

Result<SeedFiles> MakeSeedFiles(const v1::ProvisionBundle& b) {
  const std::string kStage = "seed";
  const auto& ci = b.cloud_init();
  std::string hostname = ci.hostname();
  if (hostname.empty()) hostname = "slice-" + b.allocation_id().substr(0, 8);
  if (!IsHostname(hostname)) {
    return StageError(Code::kInvalidArgument, reason::kInvalidHostname,
                      "cloud-init hostname is not a DNS name: '" + ci.hostname() + "'", kStage,
                      {{"field", "cloud_init.hostname"}});
  }
  const std::string iid = ci.instance_id().empty() ? b.allocation_id() : ci.instance_id();
  if (iid.size() > 128 || !std::all_of(iid.begin(), iid.end(), [](char c) {
        return std::isalnum(static_cast<unsigned char>(c)) || c == '-' || c == '.' || c == '_';
      })) {
    return StageError(Code::kInvalidArgument, reason::kInvalidInstanceId,
                      "cloud-init instance id has characters outside [A-Za-z0-9._-]", kStage,
                      {{"field", "cloud_init.instance_id"}});
  }
  SeedFiles f;
  f.meta_data = fmt::format("instance-id: {}\nlocal-hostname: {}\n", iid, hostname);
  f.user_data = fmt::format("#cloud-config\nhostname: {}\n", hostname);
  if (ci.ssh_authorized_keys_size() > 0) f.user_data += "ssh_authorized_keys:\n";
  for (int i = 0; i < ci.ssh_authorized_keys_size(); ++i) {
    const std::string key = Trim(ci.ssh_authorized_keys(i));
    const bool printable = std::all_of(key.begin(), key.end(), [](char c) {
      return static_cast<unsigned char>(c) >= 0x20 && c != 0x7f;
    });
    if (key.empty() || !printable || key.size() > 16384) {
      return StageError(Code::kInvalidArgument, reason::kInvalidSshKey,
                        fmt::format("ssh_authorized_keys[{}] is empty, too long or has control "
                                    "characters",
                                    i),
                        kStage, {{"field", fmt::format("cloud_init.ssh_authorized_keys[{}]", i)}});
    }
    f.user_data += "  - " + Quote(key) + "\n";
  }
  return f;
}

// ---------------------------------------------------------------------------------------------
// The runtime.

namespace {}  // namespace

LibvirtRuntime::LibvirtRuntime(LocalStore& store, LibvirtOptions opts)
    : store_(store), opts_(std::move(opts)) {
  ImageCacheOptions io;
  io.dir = opts_.image_cache_dir;
  io.tools_root = opts_.tools_root;
  io.timeout = opts_.image_timeout;
  images_ = std::make_unique<ImageCache>(std::move(io));
  static std::once_flag once;
  std::call_once(once, [] {
    virInitialize();
    virSetErrorFunc(nullptr, SilentVirError);  // errors are returned, not printed
  });
}

LibvirtRuntime::~LibvirtRuntime() {
  if (conn_) virConnectClose(conn_);
}

Result<std::string> EnsureRelayKey(const std::string& path, const std::string& comment,
                                   const std::string& tools_root) {
  const std::string kStage = "seed";
  auto fail = [&](const std::string& why) {
    return StageError(Code::kInternal, reason::kRelayKeyUnavailable,
                      "terminal relay key " + path + ": " + why, kStage, {{"path", path}});
  };
  std::error_code ec;
  if (!fs::exists(path, ec) || !fs::exists(path + ".pub", ec)) {
    const fs::path dir = fs::path(path).parent_path();
    fs::create_directories(dir, ec);
    if (ec) return fail(ec.message());
    fs::permissions(dir, fs::perms::owner_all, ec);
    auto keygen = FindToolIn(tools_root, "ssh-keygen", kStage);
    if (!keygen.ok()) return keygen.error();
    // A new pair under a temporary name, renamed into place: a crash never leaves half a key.
    const std::string tmp = fmt::format("{}.new-{}", path, ::getpid());
    fs::remove(tmp, ec);
    fs::remove(tmp + ".pub", ec);
    auto r = RunOk({*keygen, "-q", "-t", "ed25519", "-N", "", "-C", comment, "-f", tmp},
                   milliseconds(30000), kStage, reason::kRelayKeyUnavailable);
    if (!r.ok()) return r.error();
    fs::rename(tmp + ".pub", path + ".pub", ec);
    if (!ec) fs::rename(tmp, path, ec);
    if (ec) return fail(ec.message());
  }
  std::ifstream f(path + ".pub");
  std::string pub;
  std::getline(f, pub);
  pub = Trim(pub);
  if (pub.rfind("ssh-ed25519 ", 0) != 0) return fail("the .pub file is not an ed25519 key");
  return pub;
}

Result<virConnectPtr> LibvirtRuntime::Conn() {
  std::lock_guard lock(conn_mu_);
  if (conn_ && virConnectIsAlive(conn_) == 1) return conn_;
  if (conn_) {
    virConnectClose(conn_);
    conn_ = nullptr;
  }
  conn_ = virConnectOpen(opts_.uri.c_str());
  if (!conn_) {
    const char* msg = virGetLastErrorMessage();
    return Error::Of(
        Code::kUnavailable, reason::kLibvirtUnavailable,
        fmt::format("cannot connect to {}: {}", opts_.uri, msg ? msg : "unknown error"),
        {{"uri", opts_.uri}}, true);
  }
  return conn_;
}

bool LibvirtRuntime::Adopted() const {
  std::lock_guard lock(mu_);
  return adopted_;
}

namespace {

Result<std::string> BuildSeed(const LibvirtOptions& o, const v1::ProvisionBundle& b) {
  const std::string kStage = "seed";
  auto files = MakeSeedFiles(b);
  if (!files.ok()) return files.error();
  auto geniso = FindToolIn(o.tools_root, "genisoimage", kStage);
  if (!geniso.ok()) return geniso.error();
  const std::string dir = fmt::format("{}/{}", o.seed_dir, b.allocation_id());
  std::error_code ec;
  fs::create_directories(dir, ec);
  if (ec) {
    return StageError(Code::kInternal, reason::kSeedWriteFailed, dir + ": " + ec.message(), kStage);
  }
  // qemu (another user) reads the ISO.
  fs::permissions(dir,
                  fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                      fs::perms::others_read | fs::perms::others_exec,
                  ec);
  for (const auto& [name, text] :
       {std::pair<std::string, std::string>{"meta-data", files->meta_data},
        {"user-data", files->user_data}}) {
    std::ofstream f(fmt::format("{}/{}", dir, name), std::ios::binary | std::ios::trunc);
    f << text;
    f.close();
    if (!f) return StageError(Code::kInternal, reason::kSeedWriteFailed, "writing " + name, kStage);
  }
  const std::string iso = dir + "/seed.iso";
  const std::string tmp = iso + ".tmp";
  auto r = RunOk({*geniso, "-quiet", "-output", tmp, "-volid", "cidata", "-joliet", "-rock",
                  dir + "/user-data", dir + "/meta-data"},
                 milliseconds(60000), kStage, reason::kSeedBuildFailed);
  if (!r.ok()) return r.error();
  fs::rename(tmp, iso, ec);
  if (ec) {
    return StageError(Code::kInternal, reason::kSeedWriteFailed, iso + ": " + ec.message(), kStage);
  }
  fs::permissions(iso,
                  fs::perms::owner_read | fs::perms::owner_write | fs::perms::group_read |
                      fs::perms::others_read,
                  ec);
  return iso;
}

void RemoveSeed(const LibvirtOptions& o, const std::string& allocation_id) {
  if (o.seed_dir.empty() || !ids::IsUuid(allocation_id)) return;
  std::error_code ec;
  fs::remove_all(fmt::format("{}/{}", o.seed_dir, allocation_id), ec);
}

// Host CPUs of the NUMA node next to the boot GPU.
std::string NumaCpuset(const HostRoot& host, const v1::ProvisionBundle& b, int node) {
  auto valid = [](const std::string& s) {
    return !s.empty() && std::all_of(s.begin(), s.end(), [](char c) {
      return std::isdigit(static_cast<unsigned char>(c)) || c == ',' || c == '-';
    });
  };
  const auto& gpu = b.slots(0).gpu_pci_address();
  if (!gpu.empty()) {
    auto s = host.ReadLine("/sys/bus/pci/devices/" + gpu + "/local_cpulist");
    if (s && valid(*s)) return *s;
  }
  auto s = host.ReadLine(fmt::format("/sys/devices/system/node/node{}/cpulist", node));
  return s && valid(*s) ? *s : "";
}

// ---------------------------------------------------------------------------------------------
// Provision's steps.

using RecordStateFn = std::function<Result<void>(const std::string&, const std::string&)>;

// Every slot disk of the bundle, resolved and checked as the kernel sees it now (stage
// validate), before anything is written.
Result<std::vector<SlotDisk>> CheckSlotDisks(const HostRoot& host, const v1::ProvisionBundle& b,
                                             bool allow_regular_file) {
  std::vector<SlotDisk> disks;
  for (const auto& s : b.slots()) {
    if (s.nvme_by_id().empty()) continue;
    auto d = ResolveSlotDisk(host, s.slot_key(), s.nvme_by_id(), "validate");
    if (!d.ok()) return d.error();
    auto t = CheckDiskTarget(d->target_path, allow_regular_file, "validate");
    if (!t.ok()) {
      t.error().details["slot_key"] = s.slot_key();
      t.error().details["nvme_by_id"] = s.nvme_by_id();
      return t.error();
    }
    disks.push_back(*d);
  }
  return disks;
}

// Enough free 1 GiB hugepages for the shape: on the pinned NUMA node when its count is known,
// else host-wide.
Result<void> CheckHugepages(const HostRoot& host, const v1::ProvisionBundle& b,
                            std::optional<int> numa) {
  if (b.shape().hugepages_1g() <= 0) return Ok();
  const std::string leaf = "hugepages/hugepages-1048576kB/free_hugepages";
  std::optional<long long> free_pages;
  if (numa) {
    free_pages = host.ReadInt(fmt::format("/sys/devices/system/node/node{}/{}", *numa, leaf));
  }
  if (!free_pages) free_pages = host.ReadInt("/sys/kernel/mm/" + leaf);
  if (free_pages.value_or(0) < b.shape().hugepages_1g()) {
    return StageError(Code::kFailedPrecondition, reason::kHugepagesInsufficient,
                      fmt::format("the VM needs {} free 1 GiB hugepages, the host has {}",
                                  b.shape().hugepages_1g(), free_pages.value_or(0)),
                      "validate", {{"field", "shape.hugepages_1g"}});
  }
  return Ok();
}

// The bridge the vNIC joins: the applied slice network's when the agent runs it, else the
// configured one (which must exist when check_bridge is set).
Result<LibvirtOptions::AppliedBridge> ChooseBridge(const LibvirtOptions& o, const HostRoot& host) {
  if (o.applied_bridge) {
    // The agent runs the slice network itself: the bridge of the document it applied.
    auto applied = o.applied_bridge();
    if (!applied) {
      return StageError(Code::kUnavailable, reason::kNetworkNotApplied,
                        "this node has not applied a slice network document yet", "validate");
    }
    return *applied;
  }
  const std::string& bridge = o.domain.bridge;
  if (o.check_bridge && !host.Exists("/sys/class/net/" + bridge)) {
    return StageError(Code::kFailedPrecondition, reason::kBridgeMissing,
                      "slice bridge " + bridge + " does not exist on this host", "validate",
                      {{"bridge", bridge}});
  }
  return LibvirtOptions::AppliedBridge{bridge, o.domain.bridge_is_ovs, o.domain.userspace_datapath};
}

// The image job: onto the boot disk (the first slot disk), one read of the cached raw bytes.
// `writing` is set once: true when the write begins, false when the job ends before one.
Result<std::string> WriteBootImage(ImageCache& images, const LibvirtOptions& o,
                                   const v1::ProvisionBundle& b, const std::vector<SlotDisk>& disks,
                                   std::promise<bool>& writing, const ProgressFn& progress) {
  bool signalled = false;
  auto signal = [&](bool began) {
    if (!signalled) writing.set_value(began);
    signalled = true;
  };
  struct OnExit {
    std::function<void()> f;
    ~OnExit() { f(); }
  } on_exit{[&] { signal(false); }};
  if (disks.empty()) return std::string("no slot disk: image not written (kernel boot)");
  auto image = images.Ensure(b.image(), progress);
  if (!image.ok()) return image.error();
  // Re-check the disk right before the write: nothing may have mounted it meanwhile.
  auto t = CheckDiskTarget(disks[0].target_path, o.allow_regular_file_disks, "image");
  if (!t.ok()) return t.error();
  signal(true);
  auto wrote = WriteImage(*image, t->path, t->block, t->size, o.image_timeout, progress);
  if (!wrote.ok() && wrote.error().Is(reason::kImageDigestMismatch)) {
    // The cache's copy rotted since it was verified: fetched again, written again, once.
    progress("image",
             fmt::format("{}: the cached copy no longer matches its digest; fetching it again",
                         b.image().name()),
             0);
    images.Evict(b.image().sha256());
    image = images.Ensure(b.image(), progress);
    if (!image.ok()) return image.error();
    wrote = WriteImage(*image, t->path, t->block, t->size, o.image_timeout, progress);
  }
  if (!wrote.ok()) return wrote.error();
  return fmt::format("{} ({}, {} bytes) written to {} in {:.2f} s, sha256 verified",
                     b.image().name(), image->format, image->size, disks[0].by_id, wrote->seconds);
}

// The image job as the provisioning thread sees it while both overlap.
class ImageOverlap {
 public:
  explicit ImageOverlap(std::future<Result<std::string>> job) : job_(std::move(job)) {}

  // The image job's result, once: it stops the overlap wherever this thread is.
  const Result<std::string>& Finish() {
    if (!done_) done_ = job_.get();
    return *done_;
  }
  bool Finished() const { return done_.has_value(); }
  // A failure of this thread waits for the image job and reports the image's failure first.
  Error Fail(Error e) {
    if (!Finish().ok()) return Finish().error();
    return e;
  }
  // This thread's progress is held meanwhile and sent after the image's, in stage order.
  void Hold(std::string stage, std::string detail, int pct) {
    held_.emplace_back(std::move(stage), std::move(detail), pct);
  }
  void SendHeld(const ProgressFn& progress) const {
    for (const auto& [stage, detail, pct] : held_) progress(stage, detail, pct);
  }

 private:
  std::future<Result<std::string>> job_;
  std::optional<Result<std::string>> done_;
  std::vector<std::tuple<std::string, std::string, int>> held_;
};

// The domain XML's per-allocation options: the bridge, the seed, the disks' stable paths and the
// CPUs of the pinned NUMA node.
DomainXmlOptions AllocationXmlOptions(const LibvirtOptions& o, const v1::ProvisionBundle& b,
                                      const LibvirtOptions::AppliedBridge& bridge,
                                      const std::string& seed_iso,
                                      const std::vector<SlotDisk>& disks, std::optional<int> numa) {
  DomainXmlOptions xo = o.domain;
  xo.bridge = bridge.name;
  xo.bridge_is_ovs = bridge.ovs;
  xo.userspace_datapath = bridge.userspace;
  xo.seed_iso = seed_iso;
  // The console is relayed from a UNIX socket only (console_relay.hpp): no VNC port on TCP.
  if (xo.vnc_socket.empty()) xo.vnc_auto_socket = true;
  for (const auto& d : disks) xo.disk_paths[d.slot_key] = d.xml_path;
  if (numa) xo.numa_cpuset = NumaCpuset(HostRoot(o.host_root), b, *numa);
  return xo;
}

// Defines `domain` from `xml`, after undefining a shut-off domain of an earlier attempt; a
// running one is refused (domain_running).
Result<DomainPtr> DefineDomain(virConnectPtr conn, const std::string& domain,
                               const std::string& xml, const LibvirtOptions& o) {
  {
    auto existing = LookupDomain(conn, domain, "define");
    if (!existing.ok()) return existing.error();
    if (existing->has_value()) {
      if (virDomainIsActive(existing->value().get()) == 1) {
        return StageError(Code::kFailedPrecondition, reason::kDomainRunning,
                          "domain " + domain + " from an earlier attempt is still running",
                          "define", {{"domain_name", domain}});
      }
      if (auto u = UndefineDomain(conn, domain, o, "define"); !u.ok()) return u.error();
    }
  }
  virResetLastError();
  DomainPtr dom(virDomainDefineXMLFlags(conn, xml.c_str(), VIR_DOMAIN_DEFINE_VALIDATE));
  if (!dom) {
    return LibvirtError("define", reason::kDefineFailed, "defining " + domain,
                        {{"domain_name", domain}});
  }
  return dom;
}

// Starts the defined domain paused (no guest instruction runs while the image is written): true
// when it is; false for a driver without paused starts (libvirt's test driver), which starts it
// after the image instead.
Result<bool> StartPaused(virDomainPtr dom, const std::string& domain, const RecordStateFn& record) {
  if (auto r = record("paused", "start"); !r.ok()) return r.error();
  virResetLastError();
  if (virDomainCreateWithFlags(dom, VIR_DOMAIN_START_PAUSED) == 0) return true;
  const int code = virGetLastErrorCode();
  if (code != VIR_ERR_INVALID_ARG && code != VIR_ERR_NO_SUPPORT) {
    return LibvirtError("start", reason::kStartFailed, "starting " + domain + " paused",
                        {{"domain_name", domain}});
  }
  if (auto r = record("defined", "start"); !r.ok()) return r.error();
  return false;
}

}  // namespace

// What validation settled for one provision.
struct LibvirtRuntime::ProvisionTarget {
  std::string domain;                    // gpuaas-<allocation_id>
  virConnectPtr conn = nullptr;          // the connection that checked the devices
  std::vector<SlotDisk> disks;           // checked as the kernel sees them; [0] is the boot disk
  std::optional<int> numa;               // the NUMA node the VM is pinned to
  LibvirtOptions::AppliedBridge bridge;  // what the vNIC joins
};

Result<v1::ProvisionOutput> LibvirtRuntime::Provision(const v1::ProvisionBundle& b,
                                                      const ProgressFn& progress) {
  // ---- validate: the node scheduler, then the kernel's view of every disk ----
  auto devices = DiscoverDevices(opts_.host_root);
  if (!devices.ok()) return WithStage(devices.error(), "validate");
  auto plan = ValidateBundle(b, *devices);
  if (!plan.ok()) return plan.error();
  auto record = [&](const std::string& state, const std::string& stage) -> Result<void> {
    std::lock_guard lock(mu_);
    if (auto w = PutDomainRecord(store_, b, state, kRuntime); !w.ok()) {
      return WithStage(w.error(), stage);
    }
    return Ok();
  };
  // ---- resume: this attempt's VM is already running (the agent restarted mid-provision) ----
  if (auto resumed = ResumeStarted(b, *plan, record, progress)) return std::move(*resumed);
  auto target = CheckTarget(b, progress);
  if (!target.ok()) return target.error();
  progress("validate", fmt::format("node scheduler accepted a plan of {} steps", plan->size()),
           100);

  // ---- lease ----
  if (auto leased = LeaseSlots(b, progress); !leased.ok()) return leased.error();

  // ---- seed: its input checked now (before any write), the ISO built while the image is
  // verified and written (independent work; the job reports no progress of its own) ----
  auto seeded = SeedInput(b);
  if (!seeded.ok()) return seeded.error();
  return InstallAndStart(b, *seeded, *target, *plan, record, progress);
}

// The host side of validation, after the node scheduler: the slot disks, hugepages, the bridge,
// devices no other domain holds, and no VM of an earlier attempt on these disks.
Result<LibvirtRuntime::ProvisionTarget> LibvirtRuntime::CheckTarget(const v1::ProvisionBundle& b,
                                                                    const ProgressFn& progress) {
  const HostRoot host(opts_.host_root);
  ProvisionTarget t;
  auto disks = CheckSlotDisks(host, b, opts_.allow_regular_file_disks);
  if (!disks.ok()) return disks.error();
  t.disks = std::move(*disks);
  t.numa = PinnedNumaNode(b);
  if (auto pages = CheckHugepages(host, b, t.numa); !pages.ok()) return pages.error();
  auto bridge = ChooseBridge(opts_, host);
  if (!bridge.ok()) return bridge.error();
  t.bridge = std::move(*bridge);
  t.domain = DomainName(b.allocation_id());
  auto conn = Conn();
  if (!conn.ok()) return WithStage(conn.error(), "validate");
  t.conn = *conn;
  if (auto free = CheckDevicesFree(t.conn, b, t.domain); !free.ok()) return free.error();
  if (auto earlier = DestroyNeverRunDomain(t.conn, b, progress); !earlier.ok()) {
    return earlier.error();
  }
  return t;
}

// A VM of an earlier attempt still running on these disks: writing the image under it would
// corrupt both. Release it first (domain_running).
Result<void> LibvirtRuntime::DestroyNeverRunDomain(_virConnect* conn, const v1::ProvisionBundle& b,
                                                   const ProgressFn& progress) {
  const std::string domain = DomainName(b.allocation_id());
  auto existing = LookupDomain(conn, domain, "validate");
  if (!existing.ok()) return existing.error();
  if (!existing->has_value() || virDomainIsActive(existing->value().get()) != 1) return Ok();
  // Unless the ledger says this agent created it paused and never resumed it (it died while
  // the image was written): no guest instruction ever ran, and its disk is rewritten now.
  bool never_ran = false;
  {
    std::lock_guard lock(mu_);
    auto rec = store_.Get(DomainKey(b.allocation_id()));
    never_ran = rec.ok() && rec->has_value() && (**rec).value("state", "") == "paused";
  }
  if (!never_ran || virDomainDestroy(existing->value().get()) != 0) {
    return StageError(Code::kFailedPrecondition, reason::kDomainRunning,
                      "domain " + domain + " from an earlier attempt is still running", "validate",
                      {{"domain_name", domain}});
  }
  progress("validate",
           "domain " + domain +
               " was created paused by an earlier try and never resumed: "
               "destroyed",
           50);
  return Ok();
}

Result<void> LibvirtRuntime::LeaseSlots(const v1::ProvisionBundle& b, const ProgressFn& progress) {
  return LeaseBundleSlots(store_, mu_, b, progress);
}

// The bundle the seed is built from (the terminal relay key added to its SSH keys), its files
// checked before anything is written.
Result<v1::ProvisionBundle> LibvirtRuntime::SeedInput(const v1::ProvisionBundle& b) {
  v1::ProvisionBundle seeded = b;
  if (!opts_.relay_key_path.empty()) {
    std::lock_guard lock(mu_);  // one creator of the key
    auto pub = EnsureRelayKey(opts_.relay_key_path, "gpuaas-terminal-relay", opts_.tools_root);
    if (!pub.ok()) return pub.error();
    seeded.mutable_cloud_init()->add_ssh_authorized_keys(*pub);
  }
  if (auto files = MakeSeedFiles(seeded); !files.ok()) return files.error();
  return seeded;
}

// The seed ISO and the image, each on its own thread, then define, start and readiness.
Result<v1::ProvisionOutput> LibvirtRuntime::InstallAndStart(
    const v1::ProvisionBundle& b, const v1::ProvisionBundle& seeded, const ProvisionTarget& t,
    const std::vector<std::string>& plan, const RecordFn& record, const ProgressFn& progress) {
  auto seed_job =
      std::async(std::launch::async, [this, &seeded] { return BuildSeed(opts_, seeded); });

  // ---- image, on its own thread: onto the boot disk (the first slot disk), one read of the
  // cached raw bytes. Once its write begins, this thread defines the domain and starts it
  // *paused*: qemu's start (process, firmware, memory, devices) overlaps the write while no guest
  // instruction runs, and the domain is resumed only once the image's digest matched (its first
  // chunk, the boot sector, is written last). This thread's progress is held meanwhile and sent
  // after the image's, in stage order. ----
  std::promise<bool> writing;  // true: the write began; false: the job ended before one
  auto writing_begun = writing.get_future();
  ImageOverlap image(std::async(std::launch::async, [&] {
    return WriteBootImage(*images_, opts_, b, t.disks, writing, progress);
  }));
  if (!writing_begun.get() && !image.Finish().ok()) return image.Finish().error();

  auto seed = seed_job.get();
  if (!seed.ok()) return image.Fail(seed.error());
  image.Hold("seed", "NoCloud seed " + *seed + " written", 100);

  // ---- define ----
  auto xml = GenerateDomainXml(b, AllocationXmlOptions(opts_, b, t.bridge, *seed, t.disks, t.numa));
  if (!xml.ok()) return image.Fail(xml.error());
  auto dom = DefineDomain(t.conn, t.domain, *xml, opts_);
  if (!dom.ok()) return image.Fail(dom.error());
  if (auto r = record("defined", "define"); !r.ok()) return image.Fail(r.error());

  // ---- start: paused while the image is written (where the driver can), resumed after ----
  // Each state is recorded before its call: libvirt finishes a start even when this process dies
  // in it, and a restarted agent must know whose the domain is and whether it ever ran.
  bool paused = false;
  if (!t.disks.empty() && !image.Finished()) {
    auto started = StartPaused(dom->get(), t.domain, record);
    if (!started.ok()) return image.Fail(started.error());
    paused = *started;
  }
  image.Hold("define",
             "domain " + t.domain + " defined" +
                 (paused ? " and started paused while the image is written" : ""),
             100);
  if (const auto& img = image.Finish(); !img.ok()) {
    if (paused) {
      // It never ran: the disk's head is zero, the domain goes with release/cleanup.
      virDomainDestroy(dom->get());
      (void)record("defined", "image");
      progress("image",
               "domain " + t.domain + ", started paused for this image, destroyed: it never ran",
               100);
    }
    return img.error();
  }
  progress("image", image.Finish().value(), 100);
  image.SendHeld(progress);

  if (auto r = RunDomain(dom->get(), t.domain, paused, record, progress); !r.ok()) return r.error();
  return AwaitReadiness(dom->get(), b, plan, record, progress);
}

// Resumes the paused domain (or starts it), then lets the slice network admit its vNIC.
Result<void> LibvirtRuntime::RunDomain(_virDomain* dom, const std::string& domain, bool paused,
                                       const RecordFn& record, const ProgressFn& progress) {
  if (auto r = record("starting", "start"); !r.ok()) return r.error();
  virResetLastError();
  if (paused ? virDomainResume(dom) != 0 : virDomainCreate(dom) != 0) {
    return LibvirtError("start", reason::kStartFailed,
                        (paused ? "resuming " : "starting ") + domain, {{"domain_name", domain}});
  }
  if (auto r = record("started", "start"); !r.ok()) return r.error();
  progress("start",
           "domain " + domain +
               (paused ? " resumed: the image's digest matched" : std::string(" started")),
           100);
  if (opts_.vnic_attached) {
    auto admitted = opts_.vnic_attached();
    progress("start",
             admitted.ok() ? "slice network applied with the new vNIC"
                           : "slice network not re-applied (the next check repairs it): " +
                                 admitted.error().ToString(),
             100);
  }
  return Ok();
}

std::optional<Result<v1::ProvisionOutput>> LibvirtRuntime::ResumeStarted(
    const v1::ProvisionBundle& b, const std::vector<std::string>& plan, const RecordFn& record,
    const ProgressFn& progress) {
  std::vector<std::string> slot_keys;
  for (const auto& s : b.slots()) slot_keys.push_back(s.slot_key());
  {
    // Only this allocation's own attempt, recorded as started by this agent, on these slots.
    std::lock_guard lock(mu_);
    auto lease = store_.Get(LeaseKey(b.allocation_id()));
    auto rec = store_.Get(DomainKey(b.allocation_id()));
    if (!lease.ok() || !lease->has_value() || !rec.ok() || !rec->has_value()) return std::nullopt;
    const auto& l = **lease;
    const auto& r = **rec;
    const std::string state = r.value("state", "");
    if (l.value("attempt", -1) != b.attempt() || r.value("attempt", -1) != b.attempt() ||
        (state != "starting" && state != "started" && state != "running") ||
        l.value("slots", std::vector<std::string>{}) != slot_keys) {
      return std::nullopt;
    }
  }
  const std::string domain = DomainName(b.allocation_id());
  auto conn = Conn();
  if (!conn.ok()) return Result<v1::ProvisionOutput>(WithStage(conn.error(), "validate"));
  auto existing = LookupDomain(*conn, domain, "validate");
  if (!existing.ok()) return Result<v1::ProvisionOutput>(existing.error());
  if (!existing->has_value() || virDomainIsActive(existing->value().get()) != 1) {
    return std::nullopt;
  }
  progress("adopt",
           fmt::format("domain {} of attempt {} is already running (the agent restarted while "
                       "provisioning it): readiness resumed, nothing rewritten",
                       domain, b.attempt()),
           100);
  return AwaitReadiness(existing->value().get(), b, plan, record, progress);
}

// Readiness of a started domain: the reserved lease, then SSH; the record goes "running".
Result<v1::ProvisionOutput> LibvirtRuntime::AwaitReadiness(_virDomain* dom,
                                                           const v1::ProvisionBundle& b,
                                                           const std::vector<std::string>& plan,
                                                           const RecordFn& record,
                                                           const ProgressFn& progress) {
  const auto& first = b.slots(0);
  const std::string domain = DomainName(b.allocation_id());
  // ---- readiness: the reserved lease, then SSH ----
  const std::map<std::string, std::string> det = {
      {"mac", first.mac()}, {"expected_ip", first.private_ip()}, {"domain_name", domain}};
  auto not_running = [&]() -> std::optional<Error> {
    if (virDomainIsActive(dom) == 1) return std::nullopt;
    auto d = det;
    d["state"] = DomainState(dom);
    return StageError(
        Code::kFailedPrecondition, reason::kDomainNotRunning,
        "domain " + domain + " stopped while waiting for readiness (" + d["state"] + ")",
        "readiness", d);
  };
  std::optional<std::string> seen_ip;
  const auto lease_deadline = Clock::now() + opts_.lease_timeout;
  while (true) {
    seen_ip = LeasedIp(opts_.lease_file, first.mac());
    if (seen_ip && *seen_ip == first.private_ip()) break;
    if (auto e = not_running()) return *e;
    if (Clock::now() >= lease_deadline) {
      auto d = det;
      d["lease_file"] = opts_.lease_file;
      if (seen_ip) {
        d["actual_ip"] = *seen_ip;
        return StageError(Code::kFailedPrecondition, reason::kLeaseMismatch,
                          fmt::format("{} was leased {}, the reservation is {}", first.mac(),
                                      *seen_ip, first.private_ip()),
                          "readiness", d);
      }
      return StageError(Code::kDeadlineExceeded, reason::kLeaseTimeout,
                        fmt::format("no DHCP lease for {} within {} ms", first.mac(),
                                    opts_.lease_timeout.count()),
                        "readiness", d);
    }
    std::this_thread::sleep_for(opts_.poll_interval);
  }
  progress("readiness", fmt::format("DHCP lease bound: {} -> {}", first.mac(), *seen_ip), 50);
  const SshProbeFn probe = opts_.ssh_probe ? opts_.ssh_probe : ProbeSshBanner;
  const auto ssh_deadline = Clock::now() + opts_.ssh_timeout;
  while (true) {
    const auto left = std::chrono::duration_cast<milliseconds>(ssh_deadline - Clock::now());
    if (probe(*seen_ip, opts_.ssh_port, std::clamp(left, milliseconds(100), milliseconds(3000)))) {
      break;
    }
    if (auto e = not_running()) return *e;
    if (Clock::now() >= ssh_deadline) {
      return StageError(Code::kDeadlineExceeded, reason::kSshTimeout,
                        fmt::format("no SSH banner on {}:{} within {} ms", *seen_ip, opts_.ssh_port,
                                    opts_.ssh_timeout.count()),
                        "readiness", det);
    }
    std::this_thread::sleep_for(opts_.poll_interval);
  }
  if (auto r = record("running", "readiness"); !r.ok()) return r.error();
  progress("readiness", fmt::format("SSH banner on {}:{}", *seen_ip, opts_.ssh_port), 100);

  v1::ProvisionOutput out;
  out.set_domain_name(domain);
  out.set_mac(first.mac());
  out.set_expected_ip(first.private_ip());
  out.set_actual_ip(*seen_ip);
  out.set_lease_state(v1::LEASE_STATE_BOUND);
  for (const auto& step : plan) out.add_plan(step);
  out.set_runtime(v1::VM_RUNTIME_LIBVIRT);
  return out;
}

Result<v1::ReleaseOutput> LibvirtRuntime::Release(const v1::ReleaseParams& p,
                                                  const ProgressFn& progress) {
  const std::string kStage = "release";
  if (!ids::IsUuid(p.allocation_id())) {
    return StageError(Code::kInvalidArgument, reason::kInvalidAllocationId,
                      "allocation id is not a UUID: '" + p.allocation_id() + "'", kStage);
  }
  v1::ReleaseOutput out;
  const std::string domain = DomainName(p.allocation_id());
  out.set_domain_name(domain);
  out.set_runtime(v1::VM_RUNTIME_LIBVIRT);
  auto conn = Conn();
  if (!conn.ok()) return WithStage(conn.error(), kStage);
  auto dom = LookupDomain(*conn, domain, kStage);
  if (!dom.ok()) return dom.error();
  auto forget = [&]() -> Result<void> {
    RemoveSeed(opts_, p.allocation_id());
    std::lock_guard lock(mu_);
    if (auto e = store_.Erase(DomainKey(p.allocation_id())); !e.ok()) {
      return WithStage(e.error(), kStage);
    }
    return Ok();
  };
  if (!dom->has_value()) {
    if (auto f = forget(); !f.ok()) return f.error();
    out.set_stop(v1::STOP_METHOD_ABSENT);
    progress("stop", "no domain " + domain + " defined: nothing to stop", 100);
    return out;
  }
  virDomainPtr d = dom->value().get();
  out.set_stop(v1::STOP_METHOD_GRACEFUL);
  const auto timeout = p.graceful_timeout_s() > 0
                           ? milliseconds(int64_t{p.graceful_timeout_s()} * 1000)
                           : opts_.shutdown_timeout;
  std::string how = "was not running";
  if (virDomainIsActive(d) == 1) {
    const auto t0 = Clock::now();
    virResetLastError();
    const bool asked = virDomainShutdown(d) == 0;  // ACPI power button
    while (asked && virDomainIsActive(d) == 1 && Clock::now() - t0 < timeout) {
      std::this_thread::sleep_for(std::min(opts_.poll_interval, milliseconds(200)));
    }
    if (virDomainIsActive(d) == 1) {
      virResetLastError();
      if (virDomainDestroy(d) != 0 && virDomainIsActive(d) == 1) {
        return LibvirtError(kStage, reason::kDestroyFailed, "destroying " + domain,
                            {{"domain_name", domain}});
      }
      out.set_stop(v1::STOP_METHOD_HARD);
      how = asked ? fmt::format("did not stop within {} ms: destroyed", timeout.count())
                  : "refused the shutdown request: destroyed";
    } else {
      how = fmt::format("shut down gracefully in {} ms",
                        std::chrono::duration_cast<milliseconds>(Clock::now() - t0).count());
    }
  }
  dom->reset();
  auto undef = UndefineDomain(*conn, domain, opts_, kStage);
  if (!undef.ok()) return undef.error();
  if (auto f = forget(); !f.ok()) return f.error();
  progress("stop", fmt::format("domain {} {}; {}; seed removed", domain, how, *undef), 100);
  return out;
}

namespace {

// ---------------------------------------------------------------------------------------------
// Cleanup's steps.

// Under the ledger lock, before anything is touched (a wipe needs proof the disk is ours):
// CheckCleanup, every slot disk resolved and checked, then the slots leased to the allocation
// while they are wiped. Returns slot_key -> disk.
Result<std::map<std::string, SlotDisk>> HoldSlotsForCleanup(const v1::CleanupParams& p,
                                                            LocalStore& store,
                                                            const v1::TopologyReport& devices,
                                                            const LibvirtOptions& o,
                                                            const std::string& stage) {
  const HostRoot host(o.host_root);
  std::vector<std::string> slot_keys;
  std::map<std::string, SlotDisk> disks;
  if (auto ok = CheckCleanup(p, store, devices, stage); !ok.ok()) return ok.error();
  for (const auto& s : p.slots()) {
    slot_keys.push_back(s.slot_key());
    if (s.nvme_by_id().empty()) continue;
    auto d = ResolveSlotDisk(host, s.slot_key(), s.nvme_by_id(), stage);
    if (!d.ok()) return d.error();
    auto t = CheckDiskTarget(d->target_path, o.allow_regular_file_disks, stage);
    // A leftover VM may hold the disk open exclusively; it is destroyed below and the disk
    // checked again before the wipe.
    if (!t.ok() && !t.error().Is(reason::kDiskBusy)) {
      t.error().details["slot_key"] = s.slot_key();
      return t.error();
    }
    disks.emplace(s.slot_key(), *d);
  }
  // Hold the slots while they are wiped, so no other allocation can lease them meanwhile.
  int32_t attempt = 0;
  if (auto rec = store.Get(LeaseKey(p.allocation_id())); rec.ok() && rec->has_value()) {
    attempt = (**rec).value("attempt", 0);
  }
  if (auto r = TakeLease(store, p.allocation_id(), slot_keys, attempt); !r.ok()) {
    return WithStage(r.error(), stage);
  }
  return disks;
}

// A leftover domain goes before the wipe: a running VM would write to the disk during it.
Result<void> RemoveLeftoverDomain(virConnectPtr conn, const std::string& domain,
                                  const LibvirtOptions& o, const ProgressFn& progress) {
  auto dom = LookupDomain(conn, domain, "undefine");
  if (!dom.ok()) return dom.error();
  std::string note = "no domain " + domain + " left";
  if (dom->has_value()) {
    virDomainPtr d = dom->value().get();
    if (virDomainIsActive(d) == 1 && virDomainDestroy(d) != 0 && virDomainIsActive(d) == 1) {
      return LibvirtError("undefine", reason::kDestroyFailed, "destroying leftover " + domain,
                          {{"domain_name", domain}});
    }
    dom->reset();
    auto u = UndefineDomain(conn, domain, o, "undefine");
    if (!u.ok()) return u.error();
    note = "leftover domain " + domain + " destroyed and " + *u;
  }
  auto again = LookupDomain(conn, domain, "undefine");
  if (!again.ok()) return again.error();
  if (again->has_value()) {
    return StageError(Code::kInternal, reason::kUndefineFailed,
                      "domain " + domain + " is still defined", "undefine",
                      {{"domain_name", domain}});
  }
  progress("undefine", note, 100);
  return Ok();
}

using Details = std::map<std::string, std::string>;

// How a disk was wiped: "discard" or "zero", and why not discard ("" when it was).
struct Wiped {
  std::string method;
  std::string why;
};

// Zeroes a regular file (a fixture host's disk) over its whole size.
Result<void> ZeroFile(const std::string& path, uint64_t size, const Details& det) {
  const int fd = ::open(path.c_str(), O_WRONLY | O_CLOEXEC);
  if (fd < 0) {
    return StageError(Code::kInternal, reason::kWipeFailed,
                      fmt::format("{}: {}", path, Errno(errno)), "wipe", det);
  }
  const std::string zeros(1 << 20, '\0');
  uint64_t off = 0;
  bool ok = true;
  while (ok && off < size) {
    const size_t n = static_cast<size_t>(std::min<uint64_t>(zeros.size(), size - off));
    ok = ::pwrite(fd, zeros.data(), n, static_cast<off_t>(off)) == static_cast<ssize_t>(n);
    off += n;
  }
  ok = ok && ::fsync(fd) == 0;
  ::close(fd);
  if (!ok) return StageError(Code::kInternal, reason::kWipeFailed, "zeroing " + path, "wipe", det);
  return Ok();
}

// Discards the whole disk where the device supports it, else zeroes it.
Result<Wiped> DiscardOrZero(const SlotDisk& d, const DiskTarget& t, const Details& det,
                            const LibvirtOptions& o) {
  Wiped w;
  if (t.block && t.discard) {
    auto tool = FindToolIn(o.tools_root, "blkdiscard", "wipe");
    if (!tool.ok()) return tool.error();
    auto r = RunTool({*tool, d.target_path}, o.wipe_timeout);
    if (r.ok() && r->exit_code == 0) {
      w.method = "discard";
      return w;
    }
    w.why = r.ok() ? FirstLine(r->err) : r.error().message;
  } else {
    w.why = t.block ? "device does not support discard" : "regular file";
  }
  // Discard unsupported: zero the whole disk (zeroing only its edges would leave the
  // previous tenant's data readable).
  if (t.block) {
    auto tool = FindToolIn(o.tools_root, "blkdiscard", "wipe");
    if (!tool.ok()) return tool.error();
    if (auto r =
            RunOk({*tool, "-z", d.target_path}, o.wipe_timeout, "wipe", reason::kWipeFailed, det);
        !r.ok()) {
      return r.error();
    }
  } else if (auto z = ZeroFile(d.target_path, t.size, det); !z.ok()) {
    return z.error();
  }
  w.method = "zero";
  return w;
}

// Verify: neither wipefs nor blkid (probing the device itself) finds a signature.
Result<void> VerifyNoSignature(const SlotDisk& d, const std::string& wipefs,
                               const std::string& blkid, Details det) {
  auto listed = RunOk({wipefs, "--noheadings", "--output", "TYPE,OFFSET", d.target_path},
                      milliseconds(60000), "verify", reason::kVerifyFailed, det);
  if (!listed.ok()) return listed.error();
  auto probed = RunTool({blkid, "-p", "-o", "export", d.target_path}, milliseconds(60000));
  if (!probed.ok()) return WithStage(probed.error(), "verify");
  if (probed->exit_code != 0 && probed->exit_code != 2) {
    return ToolFailed("verify", reason::kVerifyFailed, blkid, *probed, det);
  }
  const bool remaining = !Trim(listed->out).empty() || probed->exit_code == 0;
  if (remaining) {
    det["wipefs"] = FirstLine(listed->out);
    det["blkid"] = FirstLine(probed->out);
    return StageError(Code::kInternal, reason::kSignaturesRemaining,
                      d.by_id + " still carries a signature after the wipe", "verify", det);
  }
  return Ok();
}

// One slot disk: the disk-safety checks again right before the write, wipefs -a, discard or
// zero, verification.
Result<Wiped> WipeDisk(const std::string& slot_key, const SlotDisk& d, const std::string& wipefs,
                       const std::string& blkid, const LibvirtOptions& o) {
  const Details det = {{"slot_key", slot_key}, {"nvme_by_id", d.by_id}};
  auto t = CheckDiskTarget(d.target_path, o.allow_regular_file_disks, "wipe");
  if (!t.ok()) {
    t.error().details["slot_key"] = slot_key;
    return t.error();
  }
  if (auto r = RunOk({wipefs, "-a", d.target_path}, milliseconds(120000), "wipe",
                     reason::kWipeFailed, det);
      !r.ok()) {
    return r.error();
  }
  auto wiped = DiscardOrZero(d, *t, det, o);
  if (!wiped.ok()) return wiped.error();
  if (auto v = VerifyNoSignature(d, wipefs, blkid, det); !v.ok()) return v.error();
  return wiped;
}

// Wipes and verifies the disks one by one. Returns slot_key -> method (discard|zero).
Result<std::map<std::string, std::string>> WipeSlotDisks(
    const std::map<std::string, SlotDisk>& disks, const LibvirtOptions& o,
    const ProgressFn& progress) {
  std::map<std::string, std::string> methods;
  auto wipefs = FindToolIn(o.tools_root, "wipefs", "wipe");
  if (!wipefs.ok()) return wipefs.error();
  auto blkid = FindToolIn(o.tools_root, "blkid", "verify");
  if (!blkid.ok()) return blkid.error();
  int done = 0;
  for (const auto& [slot_key, d] : disks) {
    auto wiped = WipeDisk(slot_key, d, *wipefs, *blkid, o);
    if (!wiped.ok()) return wiped.error();
    methods[slot_key] = wiped->method;
    ++done;
    progress("wipe",
             fmt::format("slot {}: {} wiped by {}{}; no signature left", slot_key, d.by_id,
                         wiped->method, wiped->why.empty() ? "" : " (" + wiped->why + ")"),
             done * 100 / static_cast<int>(disks.size()));
  }
  if (disks.empty()) progress("wipe", "no slot disks to wipe", 100);
  return methods;
}

// One proof per slot of what the cleanup did.
v1::CleanupOutput CleanupProofs(const v1::CleanupParams& p,
                                const std::map<std::string, std::string>& methods,
                                bool network_removed, bool exposure_removed) {
  v1::CleanupOutput out;
  out.set_runtime(v1::VM_RUNTIME_LIBVIRT);
  const auto now = google::protobuf::util::TimeUtil::GetCurrentTime();
  for (const auto& s : p.slots()) {
    auto* proof = out.add_proofs();
    proof->set_slot_key(s.slot_key());
    proof->set_nvme_by_id(s.nvme_by_id());
    auto it = methods.find(s.slot_key());
    proof->set_method(it == methods.end() ? v1::WIPE_METHOD_UNSPECIFIED
                                          : enums::FromColumn<v1::WipeMethod>(it->second));
    proof->set_signatures_remaining(false);
    proof->set_domain_undefined(true);
    proof->set_network_state_removed(network_removed);
    proof->set_exposure_state_removed(exposure_removed);
    *proof->mutable_verified_at() = now;
  }
  return out;
}

}  // namespace

Result<v1::CleanupOutput> LibvirtRuntime::Cleanup(const v1::CleanupParams& p,
                                                  const ProgressFn& progress) {
  const std::string kStage = "cleanup";
  auto devices = DiscoverDevices(opts_.host_root);
  if (!devices.ok()) return WithStage(devices.error(), kStage);
  std::map<std::string, SlotDisk> disks;  // slot_key -> disk
  // Refuse the whole cleanup before touching anything: a wipe needs proof the disk is ours.
  {
    std::lock_guard lock(mu_);
    auto held = HoldSlotsForCleanup(p, store_, *devices, opts_, kStage);
    if (!held.ok()) return held.error();
    disks = std::move(*held);
  }

  // ---- a leftover domain goes first: a running VM would write to the disk during the wipe ----
  const std::string domain = DomainName(p.allocation_id());
  auto conn = Conn();
  if (!conn.ok()) return WithStage(conn.error(), "undefine");
  if (auto r = RemoveLeftoverDomain(*conn, domain, opts_, progress); !r.ok()) return r.error();

  // ---- wipe and verify, disk by disk ----
  auto methods = WipeSlotDisks(disks, opts_, progress);
  if (!methods.ok()) return methods.error();

  // ---- network state (the networking code's hook) ----
  const auto [network_removed, exposure_removed] =
      RunCleanupHooks(opts_.network_cleanup, opts_.exposure_cleanup, p, progress, false,
                      "no network cleanup hook: network state not removed");

  RemoveSeed(opts_, p.allocation_id());
  {
    std::lock_guard lock(mu_);
    if (auto e = store_.Erase(DomainKey(p.allocation_id())); !e.ok()) {
      return WithStage(e.error(), kStage);
    }
    if (auto e = DropLease(store_, p.allocation_id()); !e.ok()) return WithStage(e.error(), kStage);
  }
  return CleanupProofs(p, *methods, network_removed, exposure_removed);
}

Result<AdoptionReport> LibvirtRuntime::Adopt() {
  const std::string kStage = "adopt";
  auto conn = Conn();
  if (!conn.ok()) return WithStage(conn.error(), kStage);
  virDomainPtr* list = nullptr;
  virResetLastError();
  const int n = virConnectListAllDomains(*conn, &list, 0);
  if (n < 0) return LibvirtError(kStage, reason::kLibvirtError, "listing domains");
  std::map<std::string, std::string> live;  // name -> state
  for (int i = 0; i < n; ++i) {
    DomainPtr d(list[i]);
    const char* name = virDomainGetName(d.get());
    if (name && std::string_view(name).rfind(kDomainPrefix, 0) == 0) {
      live[name] = DomainState(d.get());
    }
  }
  free(list);  // NOLINT(cppcoreguidelines-no-malloc): libvirt allocated it

  std::lock_guard lock(mu_);
  std::map<std::string, std::string> ledger;  // allocation -> domain record state / "leased"
  for (const auto& key : store_.Keys()) {
    std::string alloc;
    bool is_domain = false;
    if (key.rfind("domain-", 0) == 0) {
      alloc = key.substr(7);
      is_domain = true;
    } else if (key.rfind("lease-", 0) == 0) {
      alloc = key.substr(6);
    } else {
      continue;
    }
    if (!is_domain) {
      ledger.emplace(alloc, "leased");
      continue;
    }
    auto rec = store_.Get(key);
    if (rec.ok() && rec->has_value()) ledger[alloc] = (**rec).value("state", "defined");
  }
  AdoptionReport rep;
  for (const auto& [name, state] : live) {
    AdoptedDomain a;
    a.domain_name = name;
    a.state = state;
    const std::string alloc = name.substr(std::string(kDomainPrefix).size());
    if (ids::IsUuid(alloc)) a.allocation_id = alloc;
    auto it = ledger.find(alloc);
    if (!a.allocation_id.empty() && it != ledger.end()) {
      a.ledger_state = it->second;
      rep.adopted.push_back(a);
    } else {
      rep.orphans.push_back(a);
    }
  }
  for (const auto& [alloc, state] : ledger) {
    if (state == "leased" || live.count(DomainName(alloc))) continue;
    rep.missing.push_back({alloc, DomainName(alloc), "absent", state});
  }
  adopted_ = true;
  return rep;
}

}  // namespace gpuaas::node_agent
