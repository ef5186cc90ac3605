#include "tool_run.hpp"

#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <thread>

#include <fmt/format.h>

#include "host.hpp"
#include "vm_runtime.hpp"

namespace gpuaas::node_agent {
namespace {

using Clock = std::chrono::steady_clock;
using std::chrono::milliseconds;

std::string Errno(int e) { return std::strerror(e); }

}  // namespace

Result<StreamResult> RunStreaming(const std::vector<std::string>& argv, milliseconds timeout,
                                  const std::function<void(const std::string&)>& on_out) {
  if (argv.empty() || argv[0].empty() || argv[0][0] != '/') {
    return Error::InvalidArgument("tool_path", "tool path must be absolute");
  }
  std::vector<char*> args;
  args.reserve(argv.size() + 1);
  for (const auto& a : argv) args.push_back(const_cast<char*>(a.c_str()));
  args.push_back(nullptr);
  static const char* kEnv[] = {"LC_ALL=C", "PATH=/usr/sbin:/usr/bin:/sbin:/bin", nullptr};
  int out_pipe[2], err_pipe[2], exec_pipe[2];
  if (::pipe2(out_pipe, O_CLOEXEC) != 0) return Error::Internal("pipe", Errno(errno));
  if (::pipe2(err_pipe, O_CLOEXEC) != 0) {
    ::close(out_pipe[0]);
    ::close(out_pipe[1]);
    return Error::Internal("pipe", Errno(errno));
  }
  if (::pipe2(exec_pipe, O_CLOEXEC) != 0) {
    for (int fd : {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1]}) ::close(fd);
    return Error::Internal("pipe", Errno(errno));
  }
  const pid_t pid = ::fork();
  if (pid < 0) {
    for (int fd :
         {out_pipe[0], out_pipe[1], err_pipe[0], err_pipe[1], exec_pipe[0], exec_pipe[1]}) {
      ::close(fd);
    }
    return Error::Internal("fork", Errno(errno));
  }
  if (pid == 0) {
    ::setpgid(0, 0);
    const int devnull = ::open("/dev/null", O_RDONLY);
    if (devnull >= 0) ::dup2(devnull, 0);
    ::dup2(out_pipe[1], 1);
    ::dup2(err_pipe[1], 2);
    ::execve(args[0], args.data(), const_cast<char* const*>(kEnv));
    const int e = errno;
    [[maybe_unused]] auto n = ::write(exec_pipe[1], &e, sizeof(e));
    ::_exit(127);
  }
  ::setpgid(pid, pid);
  ::close(out_pipe[1]);
  ::close(err_pipe[1]);
  ::close(exec_pipe[1]);
  int exec_errno = 0;
  if (::read(exec_pipe[0], &exec_errno, sizeof(exec_errno)) != sizeof(exec_errno)) exec_errno = 0;
  ::close(exec_pipe[0]);

  StreamResult res;
  const auto deadline = Clock::now() + timeout;
  pollfd fds[2] = {{out_pipe[0], POLLIN, 0}, {err_pipe[0], POLLIN, 0}};
  int open_fds = 2;
  char buf[8192];
  constexpr size_t kCap = 1 << 20;
  while (open_fds > 0) {
    const auto left = std::chrono::duration_cast<milliseconds>(deadline - Clock::now()).count();
    if (left <= 0) {
      res.timed_out = true;
      break;
    }
    const int n = ::poll(fds, 2, static_cast<int>(std::min<long long>(left, 1000)));
    if (n < 0 && errno != EINTR) break;
    for (int i = 0; i < 2; ++i) {
      if (fds[i].fd < 0 || !(fds[i].revents & (POLLIN | POLLHUP | POLLERR))) continue;
      const ssize_t r = ::read(fds[i].fd, buf, sizeof(buf));
      if (r <= 0) {
        ::close(fds[i].fd);
        fds[i].fd = -1;
        --open_fds;
        continue;
      }
      std::string chunk(buf, static_cast<size_t>(r));
      auto& sink = i == 0 ? res.out : res.err;
      if (sink.size() < kCap) sink += chunk.substr(0, kCap - sink.size());
      if (i == 0 && on_out) on_out(chunk);
    }
  }
  for (auto& f : fds) {
    if (f.fd >= 0) ::close(f.fd);
  }
  // A tool that closed its output but keeps running is still bounded by the deadline.
  int status = 0;
  while (!res.timed_out) {
    const pid_t w = ::waitpid(pid, &status, WNOHANG);
    if (w == pid || (w < 0 && errno != EINTR)) break;
    if (Clock::now() >= deadline) {
      res.timed_out = true;
      break;
    }
    std::this_thread::sleep_for(milliseconds(5));
  }
  if (res.timed_out) {
    ::kill(-pid, SIGKILL);
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
  }
  if (exec_errno != 0) {
    return Error::Internal("tool_exec_failed",
                           fmt::format("cannot run {}: {}", argv[0], Errno(exec_errno)));
  }
  res.exit_code = WIFEXITED(status) ? WEXITSTATUS(status) : -1;
  return res;
}

std::string FirstLine(const std::string& s) {
  auto t = Trim(s);
  auto nl = t.find('\n');
  return nl == std::string::npos ? t : t.substr(0, nl);
}

Error ToolFailed(const std::string& stage, const std::string& reason, const std::string& tool,
                 const StreamResult& r, std::map<std::string, std::string> det) {
  det["tool"] = tool;
  det["exit_code"] = std::to_string(r.exit_code);
  std::string why = r.timed_out ? "timed out" : FirstLine(r.err.empty() ? r.out : r.err);
  return StageError(r.timed_out ? Code::kDeadlineExceeded : Code::kInternal, reason,
                    fmt::format("{} failed: {}", Basename(tool), why), stage, std::move(det));
}

Result<std::string> FindToolIn(const std::string& root, const std::string& name,
                               const std::string& stage) {
  HostRoot r(root);
  if (auto t = r.FindCommand(name)) return *t;
  return StageError(Code::kFailedPrecondition, "tool_missing",
                    name + " is not installed on this host", stage, {{"tool", name}});
}

Result<StreamResult> RunOk(const std::vector<std::string>& argv, milliseconds timeout,
                           const std::string& stage, const std::string& reason,
                           const std::function<void(const std::string&)>& on_out,
                           std::map<std::string, std::string> det) {
  auto r = RunStreaming(argv, timeout, on_out);
  if (!r.ok()) return WithStage(r.error(), stage);
  if (r->exit_code != 0 || r->timed_out) {
    return ToolFailed(stage, reason, argv[0], *r, std::move(det));
  }
  return r;
}

}  // namespace gpuaas::node_agent
