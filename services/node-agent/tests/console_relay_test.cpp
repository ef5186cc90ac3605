// The node's console relay (label nats): a bare qemu serving VNC on a UNIX socket is the "VM",
// libvirt's test:///default holds its domain, the agent's ledger says it manages it, and the test
// acts as console-gw on its own identity against the node's: RFB handshake and a framebuffer
// update through ConsoleFrames, refusals without side effects, credit, and every way to close.
#include <gtest/gtest.h>

#include <google/protobuf/util/time_util.h>
#include <libvirt/libvirt.h>
#include <nats/nats.h>

#include <chrono>
#include <condition_variable>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <string>
#include <thread>

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/node_agent/agent/local_store.hpp"
#include "gpuaas/node_agent/console/console_relay.hpp"
#include "gpuaas/node_agent/runtime/domain_xml.hpp"
#include "gpuaas/node_agent/runtime/vm_runtime.hpp"
#include "gpuaas/v1/console.pb.h"
#include "test_env.hpp"

namespace gpuaas::node_agent {
namespace {

using google::protobuf::util::TimeUtil;
using namespace std::chrono_literals;

const std::string kNode = "console-node-1";
const std::string kAlloc = "0190a6f1-1c2d-7e3f-8a4b-5c6d7e8f9a0b";
const std::string kOtherAlloc = "0190a6f1-1c2d-7e3f-8a4b-5c6d7e8f9a0c";

TEST(ConsoleXmlTest, VncSocketComesFromTheGraphicsElement) {
  EXPECT_EQ(VncSocketFromXml("<domain><devices><graphics type='vnc' socket='/a/vnc.sock'>"
                             "<listen type='socket' socket='/a/vnc.sock'/></graphics>"
                             "</devices></domain>"),
            "/a/vnc.sock");
  EXPECT_EQ(VncSocketFromXml("<graphics type=\"vnc\">\n  <listen type=\"socket\" "
                             "socket=\"/x/it&apos;s.sock\"/>\n</graphics>"),
            "/x/it's.sock");
  // TCP VNC, another graphics type, a socket listen of another element: none.
  EXPECT_EQ(VncSocketFromXml("<graphics type='vnc' port='5900' listen='127.0.0.1'>"
                             "<listen type='address' address='127.0.0.1'/></graphics>"),
            "");
  EXPECT_EQ(VncSocketFromXml("<graphics type='spice' socket='/s'/><graphics type='vnc'/>"
                             "<channel><listen type='socket' socket='/nope'/></channel>"),
            "");
  EXPECT_EQ(VncSocketFromXml("<domain/>"), "");
}

// console-gw's side of one session, as the test plays it.
class FakeGw {
 public:
  FakeGw(std::shared_ptr<messaging::Connection> conn, std::string session)
      : conn_(std::move(conn)), session_(std::move(session)) {
    EXPECT_EQ(
        natsConnection_Subscribe(&sub_, conn_->raw(), ConsoleOutSubject(kNode, session_).c_str(),
                                 &FakeGw::OnMsg, this),
        NATS_OK);
    EXPECT_TRUE(conn_->Flush(5s).ok());
  }
  ~FakeGw() {
    // Drained: no callback (which may ack) runs once the gw is gone.
    if (natsSubscription_Drain(sub_) == NATS_OK) {
      (void)natsSubscription_WaitForDrainCompletion(sub_, 5000);
    }
    natsSubscription_Destroy(sub_);
  }
  FakeGw(const FakeGw&) = delete;
  FakeGw& operator=(const FakeGw&) = delete;

  Result<v1::OpenConsoleResponse> Open(const std::string& alloc, int64_t window,
                                       int64_t max_duration_s = 60,
                                       std::chrono::seconds open_in = 30s) {
    v1::OpenConsoleRequest req;
    req.set_session_id(session_);
    req.set_allocation_id(alloc);
    req.set_domain(DomainName(alloc));
    *req.mutable_open_by() = TimeUtil::MillisecondsToTimestamp(
        std::chrono::duration_cast<std::chrono::milliseconds>(
            (std::chrono::system_clock::now() + open_in).time_since_epoch())
            .count());
    req.set_window_bytes(window);
    req.set_max_duration_s(max_duration_s);
    return Open(req);
  }
  Result<v1::OpenConsoleResponse> Open(const v1::OpenConsoleRequest& req) {
    window_ = static_cast<uint64_t>(req.window_bytes());
    return rpc::Client(conn_).Call<v1::OpenConsoleResponse>(ConsoleOpenSubject(kNode), req, 10s);
  }

  void Send(const std::string& data, bool close = false) {
    std::lock_guard lock(mu_);
    v1::ConsoleFrame f;
    f.set_seq(++seq_);
    f.set_data(data);
    f.set_acked(acked_);
    f.set_close(close);
    if (close) f.set_close_reason("client_closed");
    sent_ += data.size();
    ASSERT_TRUE(conn_->Publish(ConsoleInSubject(kNode, session_), f.SerializeAsString()).ok());
  }
  // Acknowledges everything received (the browser took it).
  void Ack() {
    {
      std::lock_guard lock(mu_);
      acked_ = received_;
    }
    Send("");
  }
  void AutoAck(bool on) {
    {
      std::lock_guard lock(mu_);
      auto_ack_ = on;
    }
    if (on) Ack();
  }
  // The next `n` VM bytes (empty on timeout).
  std::string Take(size_t n, std::chrono::milliseconds timeout = 15s) {
    std::unique_lock lock(mu_);
    if (!cv_.wait_for(lock, timeout, [&] { return buf_.size() >= n; })) return "";
    std::string out = buf_.substr(0, n);
    buf_.erase(0, n);
    return out;
  }
  bool WaitClosed(std::chrono::milliseconds timeout = 10s) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return closed_; });
  }
  bool WaitAgentAcked(uint64_t n, std::chrono::milliseconds timeout = 5s) {
    std::unique_lock lock(mu_);
    return cv_.wait_for(lock, timeout, [&] { return agent_acked_ >= n; });
  }
  uint64_t received() const {
    std::lock_guard lock(mu_);
    return received_;
  }
  uint64_t sent() const {
    std::lock_guard lock(mu_);
    return sent_;
  }
  std::string close_reason() const {
    std::lock_guard lock(mu_);
    return close_reason_;
  }
  // Protocol breaches the agent committed: a seq gap, more than window unacked, a frame after
  // its close, an oversized frame.
  std::vector<std::string> breaches() const {
    std::lock_guard lock(mu_);
    return breaches_;
  }
  size_t frames() const {
    std::lock_guard lock(mu_);
    return frames_;
  }
  uint64_t max_unacked() const {
    std::lock_guard lock(mu_);
    return max_unacked_;
  }

 private:
  static void OnMsg(natsConnection*, natsSubscription*, natsMsg* msg, void* closure) {
    auto* self = static_cast<FakeGw*>(closure);
    v1::ConsoleFrame f;
    const bool ok = f.ParseFromArray(natsMsg_GetData(msg), natsMsg_GetDataLength(msg));
    natsMsg_Destroy(msg);
    bool ack = false;
    {
      std::lock_guard lock(self->mu_);
      ++self->frames_;
      if (!ok) self->breaches_.push_back("unparsable frame");
      if (self->closed_) self->breaches_.push_back("frame after close");
      if (f.seq() != self->next_seq_) {
        self->breaches_.push_back("seq " + std::to_string(f.seq()) + " expected " +
                                  std::to_string(self->next_seq_));
      }
      self->next_seq_ = f.seq() + 1;
      if (f.data().size() > size_t{64} * 1024) self->breaches_.push_back("frame over 64 KiB");
      self->received_ += f.data().size();
      self->buf_ += f.data();
      self->agent_acked_ = std::max<uint64_t>(self->agent_acked_, f.acked());
      const uint64_t unacked = self->received_ - self->acked_;
      self->max_unacked_ = std::max(self->max_unacked_, unacked);
      if (self->window_ > 0 && unacked > self->window_) {
        self->breaches_.push_back("unacked " + std::to_string(unacked) + " over the window");
      }
      if (f.close()) {
        self->closed_ = true;
        self->close_reason_ = f.close_reason();
      }
      ack = self->auto_ack_ && !f.data().empty() && !f.close();
    }
    self->cv_.notify_all();
    if (ack) self->Ack();
  }

  std::shared_ptr<messaging::Connection> conn_;
  std::string session_;
  natsSubscription* sub_ = nullptr;
  mutable std::mutex mu_;
  std::condition_variable cv_;
  uint64_t window_ = 0;
  uint64_t seq_ = 0;
  uint64_t next_seq_ = 1;
  uint64_t acked_ = 0;
  uint64_t received_ = 0;
  uint64_t sent_ = 0;
  uint64_t agent_acked_ = 0;
  uint64_t max_unacked_ = 0;
  size_t frames_ = 0;
  bool auto_ack_ = true;
  bool closed_ = false;
  std::string close_reason_;
  std::string buf_;
  std::vector<std::string> breaches_;
};

uint32_t Be32(const std::string& s, size_t at) {
  return (uint32_t{static_cast<unsigned char>(s[at])} << 24) |
         (uint32_t{static_cast<unsigned char>(s[at + 1])} << 16) |
         (uint32_t{static_cast<unsigned char>(s[at + 2])} << 8) |
         uint32_t{static_cast<unsigned char>(s[at + 3])};
}
uint16_t Be16(const std::string& s, size_t at) {
  return static_cast<uint16_t>((static_cast<unsigned char>(s[at]) << 8) |
                               static_cast<unsigned char>(s[at + 1]));
}

class ConsoleRelayTest : public ::testing::Test {
 protected:
  void SetUp() override {
    if (testing::RunCommand({"sh", "-c", "command -v qemu-system-x86_64"}).rc != 0) {
      GTEST_SKIP() << "qemu-system-x86_64 not installed";
    }
    dir_ = testing::MakeTempDir("gpuaas-console");
    socket_ = dir_ + "/vnc.sock";
    StartQemu();
    // The domain as the agent's runtime would have it: libvirt knows it, running, its live XML
    // naming the socket; the ledger records it for the allocation.
    conn_ = virConnectOpen("test:///default");
    ASSERT_NE(conn_, nullptr);
    const std::string xml = "<domain type='test'><name>" + DomainName(kAlloc) +
                            "</name><memory>1048576</memory><os><type>hvm</type></os><devices>"
                            "<graphics type='vnc'><listen type='socket' socket='" +
                            socket_ + "'/></graphics></devices></domain>";
    dom_ = virDomainCreateXML(conn_, xml.c_str(), 0);
    ASSERT_NE(dom_, nullptr);
    auto store = LocalStore::Open(dir_ + "/state");
    ASSERT_TRUE(store.ok());
    store_.emplace(std::move(*store));
    ASSERT_TRUE(
        store_
            ->Put(DomainKey(kAlloc),
                  {{"name", DomainName(kAlloc)}, {"state", "ready"}, {"runtime", "libvirt"}})
            .ok());
    nats_.EnrollNode(kNode);
    node_conn_ = nats_.Connect("node-agent", kNode);
    gw_conn_ = nats_.Connect("console-gw");
    ASSERT_TRUE(node_conn_ && gw_conn_);
    StartServer();
  }
  void TearDown() override {
    server_.reset();
    if (dom_ != nullptr) {
      virDomainDestroy(dom_);
      virDomainFree(dom_);
    }
    if (conn_ != nullptr) virConnectClose(conn_);
    qemu_.reset();
    if (!dir_.empty()) std::filesystem::remove_all(dir_);
  }

  void StartQemu() {
    qemu_ = std::make_unique<testing::Process>();
    std::filesystem::remove(socket_);
    qemu_->Spawn({"qemu-system-x86_64", "-machine", "accel=tcg", "-display", "none", "-vnc",
                  "unix:" + socket_, "-nodefaults", "-vga", "std", "-m", "64"},
                 dir_ + "/qemu.log");
    ASSERT_TRUE(testing::WaitFor([&] { return std::filesystem::exists(socket_); }, 20s))
        << "qemu did not create its VNC socket";
  }
  void StartServer(int max_sessions = 2) {
    ConsoleOptions o;
    o.node_id = kNode;
    o.max_window_bytes = 262144;
    o.max_sessions = max_sessions;
    server_ = std::make_unique<ConsoleServer>(
        node_conn_, o, LedgerConsoleLocator(*store_, "test:///default"),
        log::Logger("node-agent", "t", log::Level::kError), nullptr);
    ASSERT_TRUE(server_->Start().ok());
  }

  // RFB 3.8 up to ServerInit; returns width, height.
  static std::pair<uint16_t, uint16_t> Handshake(FakeGw& gw) {
    const std::string version = gw.Take(12);
    EXPECT_EQ(version.substr(0, 8), "RFB 003.");
    gw.Send("RFB 003.008\n");
    const std::string n = gw.Take(1);
    EXPECT_EQ(n.size(), 1U);
    const std::string types = gw.Take(static_cast<unsigned char>(n[0]));
    EXPECT_NE(types.find('\x01'), std::string::npos) << "security type None offered";
    gw.Send(std::string(1, '\x01'));
    EXPECT_EQ(gw.Take(4), std::string(4, '\0')) << "SecurityResult OK";
    gw.Send(std::string(1, '\x01'));  // ClientInit, shared
    const std::string init = gw.Take(24);
    EXPECT_EQ(init.size(), 24U);
    if (init.size() != 24) return {0, 0};
    const uint32_t name_len = Be32(init, 20);
    EXPECT_EQ(gw.Take(name_len).size(), name_len);
    return {Be16(init, 0), Be16(init, 2)};
  }
  static std::string UpdateRequest(uint16_t w, uint16_t h) {
    std::string r = {'\x03', '\x00', 0, 0, 0, 0};
    r += static_cast<char>(w >> 8);
    r += static_cast<char>(w & 0xff);
    r += static_cast<char>(h >> 8);
    r += static_cast<char>(h & 0xff);
    return r;
  }
  // Reads one FramebufferUpdate (raw encoding, 32 bpp: what the server uses without
  // SetEncodings/SetPixelFormat); true when some pixel is not zero.
  static bool ReadUpdate(FakeGw& gw, size_t* pixel_bytes) {
    const std::string head = gw.Take(4, 30s);
    EXPECT_EQ(head.size(), 4U);
    if (head.size() != 4) return false;
    EXPECT_EQ(head[0], '\0') << "FramebufferUpdate";
    bool nonzero = false;
    for (uint16_t r = 0, n = Be16(head, 2); r < n; ++r) {
      const std::string rect = gw.Take(12, 30s);
      EXPECT_EQ(rect.size(), 12U);
      if (rect.size() != 12) return false;
      EXPECT_EQ(Be32(rect, 8), 0U) << "raw encoding";
      const size_t bytes = size_t{Be16(rect, 4)} * Be16(rect, 6) * 4;
      const std::string px = gw.Take(bytes, 30s);
      EXPECT_EQ(px.size(), bytes);
      *pixel_bytes += px.size();
      nonzero = nonzero || px.find_first_not_of('\0') != std::string::npos;
    }
    return nonzero;
  }

  std::string dir_;
  std::string socket_;
  std::unique_ptr<testing::Process> qemu_;
  virConnectPtr conn_ = nullptr;
  virDomainPtr dom_ = nullptr;
  std::optional<LocalStore> store_;
  testing::TestNats nats_;
  std::shared_ptr<messaging::Connection> node_conn_;
  std::shared_ptr<messaging::Connection> gw_conn_;
  std::unique_ptr<ConsoleServer> server_;
};

TEST_F(ConsoleRelayTest, QemuServesVncOnItsUnixSocketOnly) {
  const auto unix = testing::RunCommand({"ss", "-xlpn"});
  EXPECT_NE(unix.out.find(socket_), std::string::npos) << unix.out;
  EXPECT_NE(unix.out.find("pid=" + std::to_string(qemu_->pid())), std::string::npos);
  const auto tcp = testing::RunCommand({"ss", "-ltnp"});
  EXPECT_EQ(tcp.rc, 0);
  EXPECT_EQ(tcp.out.find("pid=" + std::to_string(qemu_->pid()) + ","), std::string::npos)
      << "qemu listens on TCP:\n"
      << tcp.out;
}

TEST_F(ConsoleRelayTest, RfbHandshakeAndAFramebufferUpdateThroughTheRelay) {
  FakeGw gw(gw_conn_, ids::NewUuidV7());
  auto open = gw.Open(kAlloc, 262144);
  ASSERT_TRUE(open.ok()) << open.error().ToString();
  EXPECT_EQ(open->socket(), socket_);
  EXPECT_EQ(server_->LiveSessions(), 1U);
  const auto [w, h] = Handshake(gw);
  EXPECT_GT(w, 0);
  EXPECT_GT(h, 0);
  // The firmware draws after a while: ask for whole frames until one shows something.
  bool nonzero = false;
  size_t pixel_bytes = 0;
  for (int i = 0; i < 20 && !nonzero && !HasFailure(); ++i) {
    gw.Send(UpdateRequest(w, h));
    nonzero = ReadUpdate(gw, &pixel_bytes);
    if (!nonzero) std::this_thread::sleep_for(250ms);
  }
  EXPECT_TRUE(nonzero) << pixel_bytes << " pixel bytes, all zero";
  EXPECT_GT(pixel_bytes, 0U);
  // The agent acknowledged every byte the gw sent (its own acks, the gw sending no more data).
  EXPECT_TRUE(gw.WaitAgentAcked(gw.sent())) << "sent " << gw.sent();
  EXPECT_TRUE(gw.breaches().empty()) << gw.breaches().front();
  // The gw closes: the relay goes, nothing is sent after.
  gw.Send("", true);
  EXPECT_TRUE(testing::WaitFor([&] { return server_->LiveSessions() == 0; }));
  std::this_thread::sleep_for(100ms);
  EXPECT_FALSE(gw.WaitClosed(0ms)) << "the agent answered a gw close with its own";
  // The socket is free again: a new session gets the handshake from the start.
  FakeGw again(gw_conn_, ids::NewUuidV7());
  ASSERT_TRUE(again.Open(kAlloc, 0).ok());
  EXPECT_EQ(again.Take(12).substr(0, 4), "RFB ");
}

TEST_F(ConsoleRelayTest, RefusalsRunNothing) {
  const std::string session = ids::NewUuidV7();
  FakeGw gw(gw_conn_, session);
  auto code_reason = [](const Result<v1::OpenConsoleResponse>& r) {
    return r.ok() ? std::string("ok")
                  : std::to_string(static_cast<int>(r.error().code)) + " " + r.error().reason;
  };
  const auto fp = std::to_string(static_cast<int>(Code::kFailedPrecondition));
  // Not this agent's domain: no ledger record for the allocation (libvirt has no such domain
  // either), and a domain name that is not the allocation's.
  EXPECT_EQ(code_reason(gw.Open(kOtherAlloc, 0)), fp + " domain_not_managed");
  v1::OpenConsoleRequest req;
  req.set_session_id(session);
  req.set_allocation_id(kAlloc);
  req.set_domain(DomainName(kOtherAlloc));
  *req.mutable_open_by() = TimeUtil::GetCurrentTime() + TimeUtil::SecondsToDuration(30);
  EXPECT_EQ(code_reason(gw.Open(req)), fp + " domain_not_managed");
  // A domain in libvirt that the ledger does not hold for this allocation.
  ASSERT_TRUE(store_->Erase(DomainKey(kAlloc)).ok());
  EXPECT_EQ(code_reason(gw.Open(kAlloc, 0)), fp + " domain_not_managed");
  ASSERT_TRUE(store_->Put(DomainKey(kAlloc), {{"name", DomainName(kAlloc)}}).ok());
  // open_by passed.
  EXPECT_EQ(code_reason(gw.Open(kAlloc, 0, 60, -1s)),
            std::to_string(static_cast<int>(Code::kDeadlineExceeded)) + " open_expired");
  // Not a UUID.
  FakeGw bad(gw_conn_, "not-a-uuid");
  EXPECT_EQ(code_reason(bad.Open(kAlloc, 0)),
            std::to_string(static_cast<int>(Code::kInvalidArgument)) + " invalid_session_id");
  // Nothing ran: no relay, no frame on the session's subject.
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(server_->LiveSessions(), 0U);
  EXPECT_EQ(gw.frames(), 0U);

  // A duplicate live session; then the node's limit (2).
  ASSERT_TRUE(gw.Open(kAlloc, 0).ok());
  EXPECT_EQ(gw.Take(12).substr(0, 4), "RFB ");
  EXPECT_EQ(code_reason(gw.Open(kAlloc, 0)),
            std::to_string(static_cast<int>(Code::kAlreadyExists)) + " session_open");
  FakeGw second(gw_conn_, ids::NewUuidV7());
  ASSERT_TRUE(second.Open(kAlloc, 0).ok());
  FakeGw third(gw_conn_, ids::NewUuidV7());
  EXPECT_EQ(code_reason(third.Open(kAlloc, 0)),
            std::to_string(static_cast<int>(Code::kResourceExhausted)) + " too_many_sessions");
  std::this_thread::sleep_for(200ms);
  EXPECT_EQ(server_->LiveSessions(), 2U);
  EXPECT_EQ(third.frames(), 0U);
  EXPECT_EQ(gw.frames(), 1U) << "the duplicate open sent nothing more";

  // A domain without a VNC socket.
  const std::string alloc3 = "0190a6f1-1c2d-7e3f-8a4b-5c6d7e8f9a0d";
  virDomainPtr d3 =
      virDomainCreateXML(conn_,
                         ("<domain type='test'><name>" + DomainName(alloc3) +
                          "</name><memory>1048576</memory><os><type>hvm</type></os></domain>")
                             .c_str(),
                         0);
  ASSERT_NE(d3, nullptr);
  ASSERT_TRUE(store_->Put(DomainKey(alloc3), {{"name", DomainName(alloc3)}}).ok());
  gw.Send("", true);
  ASSERT_TRUE(testing::WaitFor([&] { return server_->LiveSessions() == 1; }));
  FakeGw fourth(gw_conn_, ids::NewUuidV7());
  EXPECT_EQ(code_reason(fourth.Open(alloc3, 0)), fp + " console_unavailable");
  virDomainDestroy(d3);
  virDomainFree(d3);
}

TEST_F(ConsoleRelayTest, CreditBoundsWhatTheAgentSendsUntilTheGwAcks) {
  FakeGw gw(gw_conn_, ids::NewUuidV7());
  ASSERT_TRUE(gw.Open(kAlloc, 4096).ok());
  const auto [w, h] = Handshake(gw);
  ASSERT_GT(size_t{w} * h * 4, size_t{4096} * 4) << "an update larger than several windows";
  // Withhold acks: the agent stops at the window.
  gw.AutoAck(false);
  const uint64_t before = gw.received();
  gw.Send(UpdateRequest(w, h));
  ASSERT_TRUE(testing::WaitFor([&] { return gw.received() - before >= 4096; }));
  std::this_thread::sleep_for(300ms);
  EXPECT_EQ(gw.received() - before, 4096U) << "the agent sent beyond its credit";
  EXPECT_LE(gw.max_unacked(), 4096U);
  // Acks resume the flow: the whole update arrives, never more than a window unacked.
  gw.AutoAck(true);
  size_t pixel_bytes = 0;
  ReadUpdate(gw, &pixel_bytes);
  EXPECT_GT(pixel_bytes, size_t{4096} * 4) << "the rectangles' pixels, all of them read";
  EXPECT_LE(gw.max_unacked(), 4096U);
  EXPECT_TRUE(gw.breaches().empty()) << gw.breaches().front();
}

TEST_F(ConsoleRelayTest, TheAgentClosesOnVmExitMaxDurationAndShutdown) {
  {
    // max_duration (1 s).
    FakeGw gw(gw_conn_, ids::NewUuidV7());
    ASSERT_TRUE(gw.Open(kAlloc, 0, 1).ok());
    EXPECT_TRUE(gw.WaitClosed(5s));
    EXPECT_EQ(gw.close_reason(), "max_duration");
    EXPECT_TRUE(testing::WaitFor([&] { return server_->LiveSessions() == 0; }));
  }
  {
    // A frame out of sequence (2..4 lost): relay_lost.
    const std::string session = ids::NewUuidV7();
    FakeGw gw(gw_conn_, session);
    ASSERT_TRUE(gw.Open(kAlloc, 0).ok());
    EXPECT_EQ(gw.Take(12).substr(0, 4), "RFB ");
    gw.Send("RFB 003.008\n");  // seq 1
    v1::ConsoleFrame f;
    f.set_seq(5);
    f.set_data(std::string(1, '\x01'));
    ASSERT_TRUE(gw_conn_->Publish(ConsoleInSubject(kNode, session), f.SerializeAsString()).ok());
    EXPECT_TRUE(gw.WaitClosed(5s));
    EXPECT_EQ(gw.close_reason(), "relay_lost");
  }
  EXPECT_TRUE(testing::WaitFor([&] { return server_->LiveSessions() == 0; }));
  {
    // Agent shutdown.
    FakeGw gw(gw_conn_, ids::NewUuidV7());
    ASSERT_TRUE(gw.Open(kAlloc, 0).ok());
    EXPECT_EQ(gw.Take(12).substr(0, 4), "RFB ");
    server_->Stop();
    EXPECT_TRUE(gw.WaitClosed(5s));
    EXPECT_EQ(gw.close_reason(), "agent_stopping");
    EXPECT_EQ(server_->LiveSessions(), 0U);
  }
  StartServer();
  {
    // The VM goes away.
    FakeGw gw(gw_conn_, ids::NewUuidV7());
    ASSERT_TRUE(gw.Open(kAlloc, 0).ok());
    EXPECT_EQ(gw.Take(12).substr(0, 4), "RFB ");
    qemu_->Stop(5s);
    EXPECT_TRUE(gw.WaitClosed(5s));
    EXPECT_EQ(gw.close_reason(), "vm_closed");
    EXPECT_TRUE(testing::WaitFor([&] { return server_->LiveSessions() == 0; }));
    EXPECT_TRUE(gw.breaches().empty());
  }
}

}  // namespace
}  // namespace gpuaas::node_agent
