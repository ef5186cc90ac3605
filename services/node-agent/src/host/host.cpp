#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"

#include <dirent.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cctype>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <deque>
#include <filesystem>
#include <system_error>
#include <thread>

namespace gpuaas::node_agent {
namespace {

constexpr size_t kMaxFileBytes = 4u << 20;
constexpr size_t kMaxToolBytes = 1u << 20;
// Linux gives up after 40 links (ELOOP); so do we.
constexpr int kMaxLinks = 40;

std::vector<std::string> SplitPath(std::string_view p) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i <= p.size()) {
    size_t j = p.find('/', i);
    if (j == std::string_view::npos) j = p.size();
    if (j > i) out.emplace_back(p.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

std::string JoinPath(const std::vector<std::string>& parts) {
  std::string out;
  for (const auto& p : parts) {
    out += '/';
    out += p;
  }
  return out.empty() ? "/" : out;
}

std::optional<std::string> ReadLink(const std::string& real) {
  std::string buf(256, '\0');
  for (;;) {
    ssize_t n = ::readlink(real.c_str(), buf.data(), buf.size());
    if (n < 0) return std::nullopt;
    if (static_cast<size_t>(n) < buf.size()) {
      buf.resize(static_cast<size_t>(n));
      return buf;
    }
    if (buf.size() >= 65536) return std::nullopt;
    buf.resize(buf.size() * 2);
  }
}

// Opens a resolved real path read-only and checks its type. Returns -1 on any problem.
int OpenChecked(const std::string& real, bool allow_block) {
  int fd = ::open(real.c_str(), O_RDONLY | O_CLOEXEC | O_NOCTTY | O_NONBLOCK);
  if (fd < 0) return -1;
  struct stat st {};
  if (::fstat(fd, &st) != 0 || !(S_ISREG(st.st_mode) || (allow_block && S_ISBLK(st.st_mode)))) {
    ::close(fd);
    return -1;
  }
  return fd;
}

std::optional<std::string> ReadFd(int fd, size_t cap) {
  std::string out;
  char buf[8192];
  while (out.size() < cap) {
    size_t want = std::min(sizeof(buf), cap - out.size());
    ssize_t n = ::read(fd, buf, want);
    if (n < 0) {
      if (errno == EINTR) continue;
      // sysfs attributes that cannot be read (EIO, EACCES) read as missing.
      return std::nullopt;
    }
    if (n == 0) break;
    out.append(buf, static_cast<size_t>(n));
  }
  return out;
}

}  // namespace

HostRoot::HostRoot(std::string root) {
  if (!root.empty() && root.front() != '/') {
    // Tools found under a relative root must still get an absolute path for exec.
    std::error_code ec;
    auto abs = std::filesystem::absolute(root, ec);
    if (!ec) root = abs.lexically_normal().string();
  }
  while (root.size() > 1 && root.back() == '/') root.pop_back();
  if (root.empty() || root == "/") {
    root_ = "";
    display_ = "/";
  } else {
    root_ = std::move(root);
    display_ = root_;
  }
}

std::string HostRoot::Real(std::string_view logical) const {
  std::string out = root_;
  if (logical.empty() || logical.front() != '/') out += '/';
  out += logical;
  return out.empty() ? "/" : out;
}

std::optional<std::string> HostRoot::Resolve(std::string_view logical) const {
  std::vector<std::string> done;
  std::deque<std::string> todo;
  for (auto& c : SplitPath(logical)) todo.push_back(std::move(c));
  int links = 0;
  while (!todo.empty()) {
    std::string c = std::move(todo.front());
    todo.pop_front();
    if (c == ".") continue;
    if (c == "..") {
      // ".." at the top stays at the top: the root is the host's "/".
      if (!done.empty()) done.pop_back();
      continue;
    }
    done.push_back(std::move(c));
    std::string real = root_ + JoinPath(done);
    struct stat st {};
    if (::lstat(real.c_str(), &st) != 0 || !S_ISLNK(st.st_mode)) continue;
    if (++links > kMaxLinks) return std::nullopt;
    auto target = ReadLink(real);
    done.pop_back();
    if (!target) continue;  // vanished between lstat and readlink: treat as missing
    if (!target->empty() && target->front() == '/') done.clear();  // re-rooted
    auto parts = SplitPath(*target);
    todo.insert(todo.begin(), parts.begin(), parts.end());
  }
  return JoinPath(done);
}

bool HostRoot::Exists(std::string_view logical) const {
  auto r = Resolve(logical);
  if (!r) return false;
  struct stat st {};
  return ::lstat(Real(*r).c_str(), &st) == 0;
}

bool HostRoot::IsDir(std::string_view logical) const {
  auto r = Resolve(logical);
  if (!r) return false;
  struct stat st {};
  return ::lstat(Real(*r).c_str(), &st) == 0 && S_ISDIR(st.st_mode);
}

bool HostRoot::IsSymlink(std::string_view logical) const {
  std::string_view parent = logical;
  while (parent.size() > 1 && parent.back() == '/') parent.remove_suffix(1);
  size_t slash = parent.rfind('/');
  if (slash == std::string_view::npos) return false;
  std::string name(parent.substr(slash + 1));
  if (name.empty() || name == "." || name == "..") return false;
  auto dir = Resolve(parent.substr(0, slash));
  if (!dir) return false;
  std::string real = Real(*dir == "/" ? "/" + name : *dir + "/" + name);
  struct stat st {};
  return ::lstat(real.c_str(), &st) == 0 && S_ISLNK(st.st_mode);
}

std::optional<FileStat> HostRoot::Stat(std::string_view logical) const {
  auto r = Resolve(logical);
  if (!r) return std::nullopt;
  struct stat st {};
  if (::lstat(Real(*r).c_str(), &st) != 0) return std::nullopt;
  FileStat out;
  out.char_device = S_ISCHR(st.st_mode);
  out.regular = S_ISREG(st.st_mode);
  out.mode = st.st_mode & 07777;
  out.uid = st.st_uid;
  out.gid = st.st_gid;
  return out;
}

std::optional<std::string> HostRoot::ReadFile(std::string_view logical) const {
  auto r = Resolve(logical);
  if (!r) return std::nullopt;
  int fd = OpenChecked(Real(*r), false);
  if (fd < 0) return std::nullopt;
  auto out = ReadFd(fd, kMaxFileBytes);
  ::close(fd);
  return out;
}

std::optional<std::string> HostRoot::ReadPrefix(std::string_view logical, size_t n) const {
  auto r = Resolve(logical);
  if (!r) return std::nullopt;
  int fd = OpenChecked(Real(*r), true);
  if (fd < 0) return std::nullopt;
  auto out = ReadFd(fd, std::min(n, kMaxFileBytes));
  ::close(fd);
  return out;
}

std::optional<std::string> HostRoot::ReadLine(std::string_view logical) const {
  auto s = ReadFile(logical);
  if (!s) return std::nullopt;
  size_t nl = s->find('\n');
  return Trim(nl == std::string::npos ? std::string_view(*s) : std::string_view(*s).substr(0, nl));
}

std::optional<long long> HostRoot::ReadInt(std::string_view logical) const {
  auto s = ReadLine(logical);
  if (!s) return std::nullopt;
  return ParseInt(*s);
}

std::vector<std::string> HostRoot::ListDir(std::string_view logical) const {
  std::vector<std::string> out;
  auto r = Resolve(logical);
  if (!r) return out;
  DIR* d = ::opendir(Real(*r).c_str());
  if (d == nullptr) return out;
  while (dirent* e = ::readdir(d)) {
    std::string_view name = e->d_name;
    if (name == "." || name == "..") continue;
    out.emplace_back(name);
  }
  ::closedir(d);
  std::sort(out.begin(), out.end());
  return out;
}

std::optional<std::string> HostRoot::LinkBasename(std::string_view logical) const {
  if (!IsSymlink(logical)) return std::nullopt;
  auto r = Resolve(logical);
  if (!r) return std::nullopt;
  return Basename(*r);
}

std::optional<std::string> HostRoot::FindCommand(const std::string& name) const {
  return FindTool({"/usr/sbin/" + name, "/usr/bin/" + name, "/sbin/" + name, "/bin/" + name});
}

std::optional<std::string> HostRoot::FindTool(
    const std::vector<std::string>& logical_candidates) const {
  for (const auto& c : logical_candidates) {
    auto r = Resolve(c);
    if (!r) continue;
    std::string real = Real(*r);
    struct stat st {};
    if (::stat(real.c_str(), &st) == 0 && S_ISREG(st.st_mode) &&
        ::access(real.c_str(), X_OK) == 0) {
      // On the real root keep the name the tool was asked for: multi-call binaries
      // (iptables -> xtables-nft-multi) dispatch on argv[0]. Under a fixture root the resolved
      // path keeps execution inside the root.
      return root_.empty() ? Real(c) : real;
    }
  }
  return std::nullopt;
}

Result<ToolResult> RunTool(const std::vector<std::string>& argv,
                           std::chrono::milliseconds timeout) {
  if (argv.empty() || argv[0].empty() || argv[0].front() != '/') {
    return Error::InvalidArgument(reason::kToolPathInvalid, "tool path must be absolute");
  }
  // Everything the child touches is prepared before fork (only async-signal-safe calls after).
  std::vector<char*> cargv;
  cargv.reserve(argv.size() + 1);
  for (const auto& a : argv) cargv.push_back(const_cast<char*>(a.c_str()));
  cargv.push_back(nullptr);
  static char kPath[] = "PATH=/usr/sbin:/usr/bin:/sbin:/bin";
  static char kLcAll[] = "LC_ALL=C";
  char* envp[] = {kPath, kLcAll, nullptr};

  int out_p[2] = {-1, -1}, err_p[2] = {-1, -1}, exec_p[2] = {-1, -1};
  auto close_all = [&] {
    for (int* p : {out_p, err_p, exec_p}) {
      for (int i = 0; i < 2; ++i) {
        if (p[i] >= 0) {
          ::close(p[i]);
          p[i] = -1;
        }
      }
    }
  };
  if (::pipe2(out_p, O_CLOEXEC) != 0 || ::pipe2(err_p, O_CLOEXEC) != 0 ||
      ::pipe2(exec_p, O_CLOEXEC) != 0) {
    int e = errno;
    close_all();
    return Error::Internal(reason::kToolPipeFailed, std::string("pipe: ") + std::strerror(e));
  }
  pid_t pid = ::fork();
  if (pid < 0) {
    int e = errno;
    close_all();
    return Error::Internal(reason::kToolForkFailed, std::string("fork: ") + std::strerror(e));
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    // The agent's runtime blocks SIGINT/SIGTERM in its threads (one thread waits for them); a
    // tool must not inherit that mask, or a daemon it starts (dnsmasq) could never be stopped
    // with SIGTERM. sigprocmask and signal are async-signal-safe.
    sigset_t none;
    ::sigemptyset(&none);
    ::sigprocmask(SIG_SETMASK, &none, nullptr);
    for (int sig : {SIGINT, SIGTERM, SIGHUP, SIGPIPE, SIGCHLD}) ::signal(sig, SIG_DFL);
    int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    ::dup2(out_p[1], 1);
    ::dup2(err_p[1], 2);
    ::execve(cargv[0], cargv.data(), envp);
    int e = errno;
    ssize_t ignored = ::write(exec_p[1], &e, sizeof(e));
    (void)ignored;
    ::_exit(127);
  }
  ::setpgid(pid, pid);  // also from the parent, so the kill below never races the child
  ::close(out_p[1]);
  out_p[1] = -1;
  ::close(err_p[1]);
  err_p[1] = -1;
  ::close(exec_p[1]);
  exec_p[1] = -1;

  int exec_errno = 0;
  ssize_t got;
  do {
    got = ::read(exec_p[0], &exec_errno, sizeof(exec_errno));
  } while (got < 0 && errno == EINTR);
  if (got == static_cast<ssize_t>(sizeof(exec_errno))) {
    int status = 0;
    ::waitpid(pid, &status, 0);
    close_all();
    return Error::FailedPrecondition(reason::kToolExecFailed,
                                     argv[0] + ": " + std::strerror(exec_errno));
  }

  ToolResult res;
  auto deadline = std::chrono::steady_clock::now() + timeout;
  bool out_open = true, err_open = true;
  char buf[8192];
  auto remaining_ms = [&] {
    auto left = std::chrono::duration_cast<std::chrono::milliseconds>(
        deadline - std::chrono::steady_clock::now());
    return static_cast<int>(std::max<long long>(0, left.count()));
  };
  while ((out_open || err_open) && !res.timed_out) {
    pollfd fds[2];
    nfds_t n = 0;
    if (out_open) fds[n++] = {out_p[0], POLLIN, 0};
    if (err_open) fds[n++] = {err_p[0], POLLIN, 0};
    int ms = remaining_ms();
    if (ms == 0) {
      res.timed_out = true;
      break;
    }
    int pr = ::poll(fds, n, ms);
    if (pr < 0) {
      if (errno == EINTR) continue;
      break;
    }
    if (pr == 0) {
      res.timed_out = true;
      break;
    }
    for (nfds_t i = 0; i < n; ++i) {
      if (fds[i].revents == 0) continue;
      bool is_out = fds[i].fd == out_p[0];
      ssize_t r = ::read(fds[i].fd, buf, sizeof(buf));
      if (r < 0 && errno == EINTR) continue;
      if (r <= 0) {
        (is_out ? out_open : err_open) = false;
        continue;
      }
      std::string& dst = is_out ? res.out : res.err;
      size_t room = kMaxToolBytes - std::min(kMaxToolBytes, dst.size());
      dst.append(buf, std::min(room, static_cast<size_t>(r)));
    }
  }
  int status = 0;
  bool reaped = false;
  while (!res.timed_out) {
    pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid || (w < 0 && errno != EINTR)) {
      reaped = w == pid;
      break;
    }
    if (remaining_ms() == 0) {
      res.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  if (res.timed_out) {
    ::kill(-pid, SIGKILL);
    ::kill(pid, SIGKILL);
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    reaped = true;
  }
  close_all();
  if (reaped && WIFEXITED(status) && !res.timed_out) res.exit_code = WEXITSTATUS(status);
  return res;
}

std::string Lower(std::string s) {
  for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
  return s;
}

std::string Trim(std::string_view s) {
  size_t b = 0, e = s.size();
  while (b < e && std::isspace(static_cast<unsigned char>(s[b]))) ++b;
  while (e > b && std::isspace(static_cast<unsigned char>(s[e - 1]))) --e;
  return std::string(s.substr(b, e - b));
}

std::vector<std::string> SplitWs(std::string_view s) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < s.size()) {
    while (i < s.size() && std::isspace(static_cast<unsigned char>(s[i]))) ++i;
    size_t j = i;
    while (j < s.size() && !std::isspace(static_cast<unsigned char>(s[j]))) ++j;
    if (j > i) out.emplace_back(s.substr(i, j - i));
    i = j;
  }
  return out;
}

std::vector<std::string> SplitLines(std::string_view s) {
  std::vector<std::string> out;
  size_t i = 0;
  while (i < s.size()) {
    size_t j = s.find('\n', i);
    if (j == std::string_view::npos) j = s.size();
    out.emplace_back(s.substr(i, j - i));
    i = j + 1;
  }
  return out;
}

std::string Basename(std::string_view path) {
  while (path.size() > 1 && path.back() == '/') path.remove_suffix(1);
  size_t slash = path.rfind('/');
  return std::string(slash == std::string_view::npos ? path : path.substr(slash + 1));
}

bool StartsWith(std::string_view s, std::string_view prefix) {
  return s.substr(0, prefix.size()) == prefix;
}

bool LooksLikePciAddress(std::string_view s) {
  // DDDD[DD..]:BB:DD.F
  auto hex = [](char c) { return std::isxdigit(static_cast<unsigned char>(c)) != 0; };
  size_t colon = s.find(':');
  if (colon == std::string_view::npos || colon < 4) return false;
  for (size_t i = 0; i < colon; ++i) {
    if (!hex(s[i])) return false;
  }
  std::string_view rest = s.substr(colon + 1);
  return rest.size() == 7 && hex(rest[0]) && hex(rest[1]) && rest[2] == ':' && hex(rest[3]) &&
         hex(rest[4]) && rest[5] == '.' && rest[6] >= '0' && rest[6] <= '7';
}

std::optional<long long> ParseInt(std::string_view s) {
  std::string t = Trim(s);
  if (t.empty()) return std::nullopt;
  long long v = 0;
  const char* b = t.data();
  const char* e = t.data() + t.size();
  if (*b == '+') ++b;
  auto [p, ec] = std::from_chars(b, e, v);
  if (ec != std::errc() || p != e) return std::nullopt;
  return v;
}

}  // namespace gpuaas::node_agent
