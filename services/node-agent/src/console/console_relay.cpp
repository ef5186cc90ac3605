#include "gpuaas/node_agent/console/console_relay.hpp"

#include <filesystem>

#include <fcntl.h>
#include <libvirt/libvirt.h>
#include <libvirt/virterror.h>
#include <nats/nats.h>
#include <poll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <array>
#include <atomic>
#include <cerrno>
#include <cstring>
#include <optional>
#include <thread>

#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>
#include <prometheus/counter.h>
#include <prometheus/family.h>
#include <prometheus/gauge.h>
#include <prometheus/registry.h>

#include "gpuaas/common/contract.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"
#include "gpuaas/node_agent/runtime/domain_xml.hpp"
#include "gpuaas/node_agent/runtime/vm_runtime.hpp"
#include "gpuaas/v1/console.pb.h"

namespace gpuaas::node_agent {

namespace {

constexpr size_t kMaxFrameData = 64 * size_t{1024};
constexpr int64_t kMinWindowBytes = 1024;

Error Refusal(Code code, Reason reason, std::string message) {
  return {code, reason.str(), std::move(message), {}, false};
}

}  // namespace

std::string VncSocketFromXml(const std::string& xml) {
  for (size_t pos = xml.find("<graphics"); pos != std::string::npos;
       pos = xml.find("<graphics", pos + 1)) {
    const std::string tag = XmlStartTag(xml, pos);
    if (XmlAttr(tag, "type").value_or("") != "vnc") continue;
    if (auto s = XmlAttr(tag, "socket"); s && !s->empty()) return *s;
    if (!tag.empty() && tag.back() == '/') continue;  // <graphics .../>: no children
    const size_t close = xml.find("</graphics>", pos);
    for (size_t l = xml.find("<listen", pos); l != std::string::npos && l < close;
         l = xml.find("<listen", l + 1)) {
      const std::string ltag = XmlStartTag(xml, l);
      if (XmlAttr(ltag, "type").value_or("") != "socket") continue;
      if (auto s = XmlAttr(ltag, "socket"); s && !s->empty()) return *s;
    }
  }
  return "";
}

ConsoleLocator LedgerConsoleLocator(const LocalStore& store, std::string libvirt_uri,
                                    std::string sim_socket_dir) {
  return [&store, uri = std::move(libvirt_uri), sim = std::move(sim_socket_dir)](
             const std::string& allocation_id, const std::string& domain) -> Result<std::string> {
    auto rec = store.Get(DomainKey(allocation_id));
    if (!rec.ok()) return rec.error();
    if (!rec->has_value() || (**rec).value("name", "") != domain) {
      return Refusal(
          Code::kFailedPrecondition, reason::kDomainNotManaged,
          fmt::format("this node holds no domain {} for allocation {}", domain, allocation_id));
    }
    if (uri.empty()) {
      std::error_code ec;
      const std::string stand_in = sim + "/" + domain + ".vnc";
      if (!sim.empty() && std::filesystem::is_socket(stand_in, ec)) return stand_in;
      return Refusal(Code::kFailedPrecondition, reason::kConsoleUnavailable,
                     "the simulated VM runtime has no console");
    }
    virResetLastError();
    virConnectPtr conn = virConnectOpen(uri.c_str());
    if (conn == nullptr) {
      const virErrorPtr e = virGetLastError();
      return Error::Unavailable(reason::kLibvirtUnavailable,
                                fmt::format("cannot connect to {}: {}", uri,
                                            e != nullptr && e->message ? e->message : "?"));
    }
    std::string xml;
    bool active = false;
    if (virDomainPtr dom = virDomainLookupByName(conn, domain.c_str()); dom != nullptr) {
      active = virDomainIsActive(dom) == 1;
      if (char* desc = virDomainGetXMLDesc(dom, 0); desc != nullptr) {
        xml = desc;
        free(desc);  // NOLINT(cppcoreguidelines-no-malloc): libvirt allocates it
      }
      virDomainFree(dom);
    }
    virConnectClose(conn);
    if (!active) {
      return Refusal(Code::kFailedPrecondition, reason::kConsoleUnavailable,
                     "domain " + domain + " is not running");
    }
    std::string socket = VncSocketFromXml(xml);
    if (socket.empty()) {
      return Refusal(Code::kFailedPrecondition, reason::kConsoleUnavailable,
                     "domain " + domain + " serves no VNC UNIX socket");
    }
    return socket;
  };
}

std::string ConsoleOpenSubject(const std::string& node_id) {
  return "gpuaas.v1.node." + node_id + ".console.open";
}
std::string ConsoleInSubject(const std::string& node_id, const std::string& session_id) {
  return "gpuaas.v1.node." + node_id + ".console." + session_id + ".in";
}
std::string ConsoleOutSubject(const std::string& node_id, const std::string& session_id) {
  return "gpuaas.v1.node." + node_id + ".console." + session_id + ".out";
}

// One session: the socket, the .in subscription and the thread that moves bytes both ways.
class ConsoleRelay {
 public:
  struct Params {
    std::string session_id;
    std::string allocation_id;
    std::string in_subject;
    std::string out_subject;
    uint64_t window = 0;
    std::chrono::steady_clock::time_point deadline;
    std::chrono::milliseconds ack_delay{20};
  };

  ConsoleRelay(ConsoleServer& server, Params p, int sock, int wake)
      : server_(server), p_(std::move(p)), sock_(sock), wake_(wake) {}
  ~ConsoleRelay() {
    Join();
    if (sub_ != nullptr) natsSubscription_Destroy(sub_);
    if (sock_ >= 0) close(sock_);
    if (wake_ >= 0) close(wake_);
  }
  ConsoleRelay(const ConsoleRelay&) = delete;
  ConsoleRelay& operator=(const ConsoleRelay&) = delete;

  Result<void> Subscribe() {
    natsStatus s = natsConnection_Subscribe(&sub_, server_.conn_->raw(), p_.in_subject.c_str(),
                                            &ConsoleRelay::OnMsg, this);
    if (s != NATS_OK) return messaging::NatsError(s, "subscribe " + p_.in_subject);
    natsSubscription_SetPendingLimits(sub_, -1, -1);
    server_.conn_->contract().Record({contract::Role::kConsume, p_.in_subject,
                                      "gpuaas.v1.ConsoleFrame", "", "console relay", 1});
    // The gw may send as soon as it has the reply: the subscription must be in place by then.
    if (auto f = server_.conn_->CheckPermitted(p_.in_subject, std::chrono::seconds(5)); !f.ok()) {
      return f.error();
    }
    return Ok();
  }

  void Begin() {
    thread_ = std::thread([this] { Run(); });
  }

  void RequestStop(Reason why) {
    {
      std::lock_guard lock(mu_);
      if (!stop_reason_) stop_reason_ = why;
    }
    Wake();
  }

  void Join() {
    if (thread_.joinable() && thread_.get_id() != std::this_thread::get_id()) thread_.join();
  }

  // Drops the subscription before the relay is forgotten (a refused open).
  void Unsubscribe() {
    if (sub_ != nullptr) {
      if (natsSubscription_Drain(sub_) == NATS_OK) {
        (void)natsSubscription_WaitForDrainCompletion(sub_, 2000);
      }
      natsSubscription_Destroy(sub_);
      sub_ = nullptr;
    }
  }

 private:
  static void OnMsg(natsConnection* /*nc*/, natsSubscription* /*sub*/, natsMsg* msg,
                    void* closure) {
    auto* self = static_cast<ConsoleRelay*>(closure);
    v1::ConsoleFrame f;
    const bool parsed = f.ParseFromArray(natsMsg_GetData(msg), natsMsg_GetDataLength(msg));
    natsMsg_Destroy(msg);
    self->OnFrame(parsed ? &f : nullptr);
  }

  void OnFrame(const v1::ConsoleFrame* f) {
    {
      std::lock_guard lock(mu_);
      if (finished_ || violation_ || peer_closed_) return;
      if (f == nullptr || f->seq() != next_in_seq_ || f->data().size() > kMaxFrameData) {
        // A lost, reordered or malformed frame: the byte stream is broken.
        violation_ = reason::kRelayLost;
      } else if (queued_in_ + f->data().size() > p_.window + kMaxFrameData) {
        violation_ = reason::kCreditExceeded;
      } else {
        ++next_in_seq_;
        peer_acked_ = std::max<uint64_t>(peer_acked_, f->acked());
        if (!f->data().empty()) {
          pending_in_ += f->data();
          queued_in_ += f->data().size();
        }
        if (f->close()) {
          peer_closed_ = true;
          peer_reason_ =
              f->close_reason().empty() ? reason::kClientClosed.str() : f->close_reason();
        }
      }
    }
    Wake();
  }

  void Wake() const {
    const uint64_t one = 1;
    (void)!write(wake_, &one, sizeof one);
  }

  void Send(uint64_t& seq, const std::string& data, uint64_t acked, bool close = false,
            const std::string& reason = "") {
    v1::ConsoleFrame f;
    f.set_seq(++seq);
    f.set_data(data);
    f.set_acked(acked);
    f.set_close(close);
    if (close) f.set_close_reason(reason);
    if (auto r = server_.conn_->Publish(p_.out_subject, f.SerializeAsString()); !r.ok()) {
      server_.log_.Warn("console frame not published",
                        {{"session_id", p_.session_id}, {"error", r.error().ToString()}});
    }
  }

  void Run() {
    using Clock = std::chrono::steady_clock;
    uint64_t out_seq = 0;
    uint64_t sent = 0;      // VM bytes published on .out
    uint64_t written = 0;   // gw bytes written to the socket
    uint64_t reported = 0;  // the `acked` last sent
    constexpr Clock::time_point kNever = Clock::time_point::max();
    Clock::time_point ack_due = kNever;  // an unacknowledged write is acked by then
    std::string to_vm;                   // taken from pending_in_, not yet written
    std::string buf(kMaxFrameData, '\0');
    std::optional<std::string> why;  // the close reason, once the relay is to close
    bool send_close = true;
    while (true) {
      uint64_t peer_acked = 0;
      {
        std::lock_guard lock(mu_);
        to_vm += pending_in_;
        pending_in_.clear();
        peer_acked = std::min(peer_acked_, sent);
        if (peer_closed_) {
          why = peer_reason_;
          send_close = false;
        } else if (violation_) {
          why = violation_->str();
        } else if (stop_reason_) {
          why = stop_reason_->str();
        }
      }
      if (why) break;
      auto now = Clock::now();
      if (now >= p_.deadline) {
        why = reason::kMaxDuration.str();
        break;
      }
      const uint64_t credit = p_.window - (sent - peer_acked);
      short events = 0;
      if (credit > 0) events |= POLLIN;
      if (!to_vm.empty()) events |= POLLOUT;
      std::array<pollfd, 2> fds{};
      fds[0] = {wake_, POLLIN, 0};
      fds[1] = {events != 0 ? sock_ : -1, events, 0};
      auto until = p_.deadline;
      until = std::min(until, ack_due);
      const auto wait =
          std::chrono::ceil<std::chrono::milliseconds>(std::max(until - now, Clock::duration{}));
      const int n =
          poll(fds.data(), fds.size(),
               static_cast<int>(std::min<int64_t>(wait.count(), int64_t{24} * 3600 * 1000)));
      if (n < 0 && errno != EINTR) {
        why = reason::kRelayLost.str();
        break;
      }
      if ((fds[0].revents & POLLIN) != 0) {
        uint64_t v = 0;
        (void)!read(wake_, &v, sizeof v);
      }
      now = Clock::now();
      const short rev = fds[1].revents;
      if (!to_vm.empty() && (rev & (POLLOUT | POLLERR | POLLHUP)) != 0) {
        const ssize_t w = send(sock_, to_vm.data(), to_vm.size(), MSG_NOSIGNAL | MSG_DONTWAIT);
        if (w > 0) {
          to_vm.erase(0, static_cast<size_t>(w));
          written += static_cast<uint64_t>(w);
          {
            std::lock_guard lock(mu_);
            queued_in_ -= static_cast<size_t>(w);
          }
          server_.bytes_to_vm_->Increment(static_cast<double>(w));
          if (ack_due == kNever) ack_due = now + p_.ack_delay;
        } else if (w < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR) {
          why = reason::kVmClosed.str();
          break;
        }
      }
      if (credit > 0 && (rev & (POLLIN | POLLERR | POLLHUP)) != 0) {
        const size_t want = std::min<uint64_t>(credit, kMaxFrameData);
        const ssize_t r = recv(sock_, buf.data(), want, MSG_DONTWAIT);
        if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)) {
          why = reason::kVmClosed.str();
          break;
        }
        if (r > 0) {
          Send(out_seq, buf.substr(0, static_cast<size_t>(r)), written);
          sent += static_cast<uint64_t>(r);
          reported = written;
          ack_due = kNever;
          server_.bytes_to_client_->Increment(static_cast<double>(r));
        }
      }
      if (written > reported &&
          (written - reported >= std::max<uint64_t>(1, p_.window / 4) || now >= ack_due)) {
        Send(out_seq, "", written);
        reported = written;
        ack_due = kNever;
      }
    }
    const std::string close_reason = why.value_or("");  // every break above set it
    if (send_close) Send(out_seq, "", written, true, close_reason);
    shutdown(sock_, SHUT_RDWR);
    // Drained: no callback runs after this, so the relay may go.
    if (natsSubscription_Drain(sub_) == NATS_OK) {
      (void)natsSubscription_WaitForDrainCompletion(sub_, 2000);
    } else {
      natsSubscription_Unsubscribe(sub_);
    }
    {
      std::lock_guard lock(mu_);
      finished_ = true;
    }
    server_.log_.Info("console relay closed", {{"session_id", p_.session_id},
                                               {"allocation_id", p_.allocation_id},
                                               {"reason", close_reason},
                                               {"bytes_to_client", std::to_string(sent)},
                                               {"bytes_to_vm", std::to_string(written)}});
    server_.Finished(p_.session_id);
  }

  ConsoleServer& server_;
  Params p_;
  int sock_;
  int wake_;
  natsSubscription* sub_ = nullptr;
  std::thread thread_;
  std::mutex mu_;
  // Under mu_: what the .in callback hands the relay thread.
  std::string pending_in_;
  size_t queued_in_ = 0;  // gw bytes received and not yet written (credit check)
  uint64_t next_in_seq_ = 1;
  uint64_t peer_acked_ = 0;
  bool peer_closed_ = false;
  std::string peer_reason_;
  std::optional<Reason> violation_;    // the gw broke the protocol
  std::optional<Reason> stop_reason_;  // RequestStop's
  bool finished_ = false;
};

ConsoleServer::ConsoleServer(std::shared_ptr<messaging::Connection> conn, ConsoleOptions opts,
                             ConsoleLocator locate, const log::Logger& log,
                             prometheus::Registry* metrics)
    : conn_(std::move(conn)),
      opts_(std::move(opts)),
      locate_(std::move(locate)),
      log_(log.With({{"node_id", opts_.node_id}})) {
  // Without a registry (tests) the metrics still count, into one of our own.
  if (metrics == nullptr) own_metrics_ = std::make_unique<prometheus::Registry>();
  prometheus::Registry& reg = metrics != nullptr ? *metrics : *own_metrics_;
  sessions_gauge_ = &prometheus::BuildGauge()
                         .Name("gpuaas_node_agent_console_sessions")
                         .Help("Console relays open on this node")
                         .Register(reg)
                         .Add({});
  auto& bytes = prometheus::BuildCounter()
                    .Name("gpuaas_node_agent_console_bytes_total")
                    .Help(
                        "Console bytes relayed: to_vm (written to the VNC socket) and "
                        "to_client (published to console-gw)")
                    .Register(reg);
  bytes_to_vm_ = &bytes.Add({{"direction", "to_vm"}});
  bytes_to_client_ = &bytes.Add({{"direction", "to_client"}});
}

ConsoleServer::~ConsoleServer() { Stop(); }

Result<void> ConsoleServer::Start() {
  rpc::ServerOptions so;
  so.workers = 2;
  so.max_queue = 64;
  server_ = std::make_unique<rpc::Server>(conn_, "node-" + opts_.node_id,
                                          ConsoleOpenSubject(opts_.node_id), log_, nullptr, so);
  server_->Handle<v1::OpenConsoleRequest, v1::OpenConsoleResponse>(
      ConsoleOpenSubject(opts_.node_id),
      [this](const v1::OpenConsoleRequest& req, rpc::Context& /*ctx*/) { return Open(req); });
  return server_->Start();
}

void ConsoleServer::Stop() {
  if (server_) {
    server_->Drain(std::chrono::milliseconds(2000));
    server_.reset();
  }
  std::vector<std::shared_ptr<ConsoleRelay>> live;
  {
    std::lock_guard lock(mu_);
    stopping_ = true;
    for (auto& [id, r] : live_) live.push_back(r);
  }
  for (auto& r : live) r->RequestStop(reason::kAgentStopping);
  {
    std::unique_lock lock(mu_);
    cv_.wait(lock, [this] { return live_.empty(); });
  }
  Reap();
}

size_t ConsoleServer::LiveSessions() const {
  std::lock_guard lock(mu_);
  return live_.size();
}

void ConsoleServer::Finished(const std::string& session_id) {
  std::lock_guard lock(mu_);
  auto it = live_.find(session_id);
  if (it == live_.end()) return;
  done_.push_back(std::move(it->second));
  live_.erase(it);
  sessions_gauge_->Set(static_cast<double>(live_.size()));
  cv_.notify_all();
}

void ConsoleServer::Reap() {
  std::vector<std::shared_ptr<ConsoleRelay>> done;
  {
    std::lock_guard lock(mu_);
    done.swap(done_);
  }
  for (auto& r : done) r->Join();
}

Result<v1::OpenConsoleResponse> ConsoleServer::Open(const v1::OpenConsoleRequest& req) {
  using google::protobuf::util::TimeUtil;
  Reap();
  if (!ids::IsUuid(req.session_id())) {
    return Error::InvalidArgument(reason::kInvalidSessionId, "session_id must be a UUID");
  }
  if (!ids::IsUuid(req.allocation_id())) {
    return Error::InvalidArgument(reason::kInvalidAllocationId, "allocation_id must be a UUID");
  }
  if (!req.has_open_by()) {
    return Error::InvalidArgument(reason::kOpenByRequired,
                                  "an open must say until when it is valid");
  }
  if (TimeUtil::TimestampToMilliseconds(req.open_by()) <=
      std::chrono::duration_cast<std::chrono::milliseconds>(
          std::chrono::system_clock::now().time_since_epoch())
          .count()) {
    return Refusal(Code::kDeadlineExceeded, reason::kOpenExpired,
                   "the open was valid until " + TimeUtil::ToString(req.open_by()));
  }
  if (req.window_bytes() < 0 || (req.window_bytes() > 0 && req.window_bytes() < kMinWindowBytes)) {
    return Error::InvalidArgument(
        reason::kInvalidWindowBytes,
        fmt::format("window_bytes must be 0 or at least {}", kMinWindowBytes));
  }
  if (req.max_duration_s() < 0) {
    return Error::InvalidArgument(reason::kInvalidMaxDuration,
                                  "max_duration_s must not be negative");
  }
  if (req.domain() != DomainName(req.allocation_id())) {
    return Refusal(
        Code::kFailedPrecondition, reason::kDomainNotManaged,
        fmt::format("domain {} is not allocation {}'s", req.domain(), req.allocation_id()));
  }
  {
    std::lock_guard lock(mu_);
    if (stopping_) return Error::Unavailable(reason::kAgentStopping, "the agent is stopping");
    if (live_.count(req.session_id()) != 0) {
      return Refusal(Code::kAlreadyExists, reason::kSessionOpen,
                     "session " + req.session_id() + " is already relayed");
    }
    if (live_.size() >= static_cast<size_t>(opts_.max_sessions)) {
      return Refusal(Code::kResourceExhausted, reason::kTooManySessions,
                     fmt::format("this node relays at most {} consoles", opts_.max_sessions));
    }
  }
  auto path = locate_(req.allocation_id(), req.domain());
  if (!path.ok()) return path.error();

  sockaddr_un addr{};
  addr.sun_family = AF_UNIX;
  if (path->size() >= sizeof addr.sun_path) {
    return Refusal(Code::kFailedPrecondition, reason::kConsoleUnavailable,
                   "the VNC socket path is too long: " + *path);
  }
  std::memcpy(addr.sun_path, path->c_str(), path->size() + 1);
  const int sock = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
  if (sock < 0) return Error::Internal(reason::kSocketFailed, std::strerror(errno));
  // A UNIX stream connect completes at once or fails (no EINPROGRESS on Linux).
  if (connect(sock, reinterpret_cast<const sockaddr*>(&addr), sizeof addr) != 0) {
    const std::string why = std::strerror(errno);
    close(sock);
    return Refusal(Code::kFailedPrecondition, reason::kConsoleUnavailable,
                   "cannot connect to " + *path + ": " + why);
  }
  const int wake = eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK);
  if (wake < 0) {
    close(sock);
    return Error::Internal(reason::kEventfdFailed, std::strerror(errno));
  }
  const int64_t window = req.window_bytes() == 0
                             ? opts_.max_window_bytes
                             : std::min<int64_t>(req.window_bytes(), opts_.max_window_bytes);
  const int64_t max_s = req.max_duration_s() == 0
                            ? opts_.max_duration_s
                            : std::min<int64_t>(req.max_duration_s(), opts_.max_duration_s);
  ConsoleRelay::Params p;
  p.session_id = req.session_id();
  p.allocation_id = req.allocation_id();
  p.in_subject = ConsoleInSubject(opts_.node_id, req.session_id());
  p.out_subject = ConsoleOutSubject(opts_.node_id, req.session_id());
  p.window = static_cast<uint64_t>(window);
  p.deadline = std::chrono::steady_clock::now() + std::chrono::seconds(max_s);
  p.ack_delay = opts_.ack_delay;
  auto relay = std::make_shared<ConsoleRelay>(*this, std::move(p), sock, wake);
  {
    std::lock_guard lock(mu_);
    // Checked again: another open of the same session may have got here first.
    if (stopping_ || live_.count(req.session_id()) != 0 ||
        live_.size() >= static_cast<size_t>(opts_.max_sessions)) {
      return stopping_ ? Error::Unavailable(reason::kAgentStopping, "the agent is stopping")
             : live_.count(req.session_id()) != 0
                 ? Refusal(Code::kAlreadyExists, reason::kSessionOpen,
                           "session " + req.session_id() + " is already relayed")
                 : Refusal(Code::kResourceExhausted, reason::kTooManySessions,
                           fmt::format("this node relays at most {} consoles", opts_.max_sessions));
    }
    live_[req.session_id()] = relay;
    sessions_gauge_->Set(static_cast<double>(live_.size()));
  }
  if (auto s = relay->Subscribe(); !s.ok()) {
    relay->Unsubscribe();
    std::lock_guard lock(mu_);
    live_.erase(req.session_id());
    sessions_gauge_->Set(static_cast<double>(live_.size()));
    cv_.notify_all();
    return s.error();
  }
  relay->Begin();
  log_.Info("console relay opened", {{"session_id", req.session_id()},
                                     {"allocation_id", req.allocation_id()},
                                     {"socket", *path},
                                     {"window_bytes", std::to_string(window)},
                                     {"max_duration_s", std::to_string(max_s)}});
  v1::OpenConsoleResponse resp;
  resp.set_session_id(req.session_id());
  resp.set_socket(*path);
  return resp;
}

}  // namespace gpuaas::node_agent
