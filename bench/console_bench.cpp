// P8: what the console relay costs an operator's VNC session, against a direct websockify, in
// the same run and on the same qemu VNC socket (`qemu-system-x86_64 -vga std -display none`, no
// guest: SeaBIOS' text screen).
//   relay   browser WebSocket -> console-gw (ConsoleGwService in-process: Beast gateway, session
//           grant, Bridge) -> ConsoleFrames over a real nats-server -> the node-agent's
//           ConsoleServer (LedgerConsoleLocator on the simulated runtime's socket directory, the
//           ledger record in a LocalStore) -> the VNC UNIX socket. PostgreSQL is real; the
//           scheduler is a token-checking fake answering allocation.get.
//   direct  `websockify --run-once 127.0.0.1:<port> --unix-target=<socket>` (what noVNC users
//           run without a control plane).
// One WebSocket client (Beast, TCP_NODELAY, no subprotocol offered: websockify then answers none
// and speaks binary frames, as console-gw does) per path speaks RFB 3.8 (security None, shared
// ClientInit, 32 bpp true colour, Raw encoding only so both paths carry the same bytes). Both
// stay connected and are sampled alternately, so machine noise lands on both.
//   rtt         KeyEvent Shift press, KeyEvent release, then a non-incremental 64x64
//               FramebufferUpdateRequest (three WebSocket messages, as noVNC flushes them),
//               timed until that update is fully received. Without a guest the key changes
//               nothing on screen: this is the path's input-to-update latency, not a guest's.
//   throughput  full-screen non-incremental updates back to back (request, read all, repeat),
//               in alternating one-second slices.
// Prints p50/p99 and relay/direct ratios; exits non-zero only when something fails.
// Diagnosis switch (docs/benchmarks.md, P8): GPUAAS_BENCH_WINDOW_BYTES sets the credit window on
// both sides.
#include <utility>  // before Asio: its awaitable.hpp uses std::exchange without it (GCC 12)

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/websocket.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <sys/socket.h>

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iterator>
#include <map>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include <fmt/format.h>

#include "bench_util.hpp"
#include "gpuaas/common/config.hpp"
#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/console_gw/console_gw_service.hpp"
#include "gpuaas/node_agent/agent/local_store.hpp"
#include "gpuaas/node_agent/console/console_relay.hpp"
#include "gpuaas/node_agent/runtime/domain_xml.hpp"
#include "gpuaas/node_agent/runtime/vm_runtime.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/scheduler.pb.h"
#include "test_env.hpp"

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace websocket = beast::websocket;
using tcp = asio::ip::tcp;
using Clock = std::chrono::steady_clock;
using namespace gpuaas;
using namespace std::chrono_literals;

namespace {

constexpr const char* kNode = "bench-node-1";

// Any failure ends the run through main's catch, so the servers and qemu are stopped.
struct Failure : std::runtime_error {
  using std::runtime_error::runtime_error;
};

double Ms(Clock::duration d) { return std::chrono::duration<double, std::milli>(d).count(); }

uint16_t Be16(const std::string& s, size_t at) {
  return static_cast<uint16_t>((static_cast<unsigned char>(s[at]) << 8) |
                               static_cast<unsigned char>(s[at + 1]));
}
uint32_t Be32(const std::string& s, size_t at) {
  return (uint32_t{Be16(s, at)} << 16) | Be16(s, at + 2);
}
void Put16(std::string& s, uint16_t v) {
  s += static_cast<char>(v >> 8);
  s += static_cast<char>(v & 0xff);
}
void Put32(std::string& s, uint32_t v) {
  Put16(s, static_cast<uint16_t>(v >> 16));
  Put16(s, static_cast<uint16_t>(v & 0xffff));
}

// An RFB client over a WebSocket, the way noVNC is one.
class RfbClient {
 public:
  RfbClient(std::string name, uint16_t port, const std::string& path, const std::string& origin)
      : name_(std::move(name)), ws_(io_) {
    beast::error_code ec;
    // websockify may still be starting (it is probed by this connect only: --run-once serves
    // exactly one connection).
    for (int i = 0; i < 200; ++i) {
      beast::get_lowest_layer(ws_).socket().close(ec);
      beast::get_lowest_layer(ws_).connect(tcp::endpoint(asio::ip::make_address("127.0.0.1"), port),
                                           ec);
      if (!ec) break;
      std::this_thread::sleep_for(50ms);
    }
    if (ec) throw Failure(name_ + ": connect: " + ec.message());
    beast::get_lowest_layer(ws_).socket().set_option(tcp::no_delay(true));
    ws_.set_option(websocket::stream_base::decorator(
        [origin](websocket::request_type& req) { req.set(beast::http::field::origin, origin); }));
    websocket::response_type res;
    ws_.handshake(res, fmt::format("127.0.0.1:{}", port), path, ec);
    if (ec) {
      throw Failure(
          fmt::format("{}: upgrade: {} (HTTP {})", name_, ec.message(), res.result_int()));
    }
    ws_.binary(true);
  }
  ~RfbClient() {
    beast::error_code ec;
    ws_.close(websocket::close_code::normal, ec);
  }
  RfbClient(const RfbClient&) = delete;
  RfbClient& operator=(const RfbClient&) = delete;

  void Send(const std::string& bytes) {
    beast::error_code ec;
    ws_.write(asio::buffer(bytes), ec);
    if (ec) throw Failure(name_ + ": write: " + ec.message());
  }

  // The next n bytes of the server's stream (WebSocket message boundaries mean nothing to RFB).
  std::string Take(size_t n) {
    while (buf_.size() - pos_ < n) {
      beast::error_code ec;
      in_.clear();
      ws_.read(in_, ec);
      if (ec) {
        throw Failure(fmt::format("{}: read: {} (close {} '{}')", name_, ec.message(),
                                  ws_.reason().code, std::string(ws_.reason().reason.c_str())));
      }
      const auto d = in_.cdata();
      buf_.erase(0, pos_);
      pos_ = 0;
      buf_.append(static_cast<const char*>(d.data()), d.size());
    }
    std::string out = buf_.substr(pos_, n);
    pos_ += n;
    return out;
  }
  // Skips n bytes (pixel data the benchmark does not look at) without copying them out.
  void Skip(size_t n) {
    while (n > 0) {
      if (pos_ == buf_.size()) Fill();
      const size_t k = std::min(n, buf_.size() - pos_);
      pos_ += k;
      n -= k;
    }
  }

  // RFB 3.8 up to ServerInit, then 32 bpp true colour and Raw only.
  void Handshake() {
    const std::string version = Take(12);
    if (version.rfind("RFB 003.", 0) != 0) throw Failure(name_ + ": not RFB: " + version);
    Send("RFB 003.008\n");
    const auto types = Take(static_cast<unsigned char>(Take(1)[0]));
    if (types.find('\x01') == std::string::npos) throw Failure(name_ + ": no security None");
    Send(std::string(1, '\x01'));
    if (Take(4) != std::string(4, '\0')) throw Failure(name_ + ": security failed");
    Send(std::string(1, '\x01'));  // shared: the other path's client stays connected
    const std::string init = Take(24);
    width_ = Be16(init, 0);
    height_ = Be16(init, 2);
    (void)Take(Be32(init, 20));  // the desktop name
    std::string pf = {'\x00', 0, 0, 0};
    pf += {32, 24, 0, 1};  // bpp, depth, little-endian, true colour
    Put16(pf, 255);
    Put16(pf, 255);
    Put16(pf, 255);
    pf += {16, 8, 0, 0, 0, 0};  // shifts, padding
    Send(pf);
    std::string enc = {'\x02', 0};
    Put16(enc, 1);
    Put32(enc, 0);  // Raw
    Send(enc);
  }

  static std::string UpdateRequest(bool incremental, uint16_t x, uint16_t y, uint16_t w,
                                   uint16_t h) {
    std::string r = {'\x03', static_cast<char>(incremental ? 1 : 0)};
    Put16(r, x);
    Put16(r, y);
    Put16(r, w);
    Put16(r, h);
    return r;
  }
  static std::string Key(bool down, uint32_t keysym) {
    std::string k = {'\x04', static_cast<char>(down ? 1 : 0), 0, 0};
    Put32(k, keysym);
    return k;
  }

  // Reads messages until a whole FramebufferUpdate has arrived; returns its size in bytes.
  size_t ReadUpdate() {
    while (true) {
      const auto type = static_cast<unsigned char>(Take(1)[0]);
      if (type == 2) continue;  // Bell
      if (type == 3) {          // ServerCutText
        Skip(Be32(Take(7), 3));
        continue;
      }
      if (type != 0) throw Failure(fmt::format("{}: unexpected server message {}", name_, type));
      first_byte_ = Clock::now();  // the client waited on an empty buffer: about when it came
      const std::string head = Take(3);
      size_t bytes = 4;
      for (uint16_t r = 0, n = Be16(head, 1); r < n; ++r) {
        const std::string rect = Take(12);
        if (Be32(rect, 8) != 0) {
          throw Failure(
              fmt::format("{}: encoding {} although only Raw was allowed", name_, Be32(rect, 8)));
        }
        const size_t px = size_t{Be16(rect, 4)} * Be16(rect, 6) * 4;
        Skip(px);
        bytes += 12 + px;
      }
      return bytes;
    }
  }

  Clock::time_point first_byte() const { return first_byte_; }
  uint16_t width() const { return width_; }
  uint16_t height() const { return height_; }

 private:
  void Fill() {
    beast::error_code ec;
    in_.clear();
    ws_.read(in_, ec);
    if (ec) throw Failure(name_ + ": read: " + ec.message());
    const auto d = in_.cdata();
    buf_.assign(static_cast<const char*>(d.data()), d.size());
    pos_ = 0;
  }

  std::string name_;
  asio::io_context io_;
  websocket::stream<beast::tcp_stream> ws_;
  beast::flat_buffer in_;
  std::string buf_;
  size_t pos_ = 0;
  uint16_t width_ = 0;
  uint16_t height_ = 0;
  Clock::time_point first_byte_;
};

constexpr uint32_t kShiftL = 0xffe1;

// One input-to-update round trip: Shift down, Shift up, a non-incremental 64x64 request.
double RoundTrip(RfbClient& c) {
  const auto t0 = Clock::now();
  c.Send(RfbClient::Key(true, kShiftL));
  c.Send(RfbClient::Key(false, kShiftL));
  c.Send(RfbClient::UpdateRequest(false, 0, 0, 64, 64));
  (void)c.ReadUpdate();
  return Ms(Clock::now() - t0);
}

struct Throughput {
  double seconds = 0;
  uint64_t bytes = 0;
  uint64_t updates = 0;
  std::vector<double> transfer_ms;  // an update's first byte to its last
  double MBps() const { return seconds > 0 ? static_cast<double>(bytes) / 1e6 / seconds : 0; }
  double Ups() const { return seconds > 0 ? static_cast<double>(updates) / seconds : 0; }
};

void FullScreenFor(RfbClient& c, Clock::duration slice, Throughput& t) {
  const auto t0 = Clock::now();
  auto now = t0;
  while (now - t0 < slice) {
    // The key keeps qemu's display refresh at its 30 ms base (it backs off on an idle screen and
    // serves requested updates only on that timer), so the path, not the back-off, is measured.
    c.Send(RfbClient::Key(true, kShiftL));
    c.Send(RfbClient::Key(false, kShiftL));
    c.Send(RfbClient::UpdateRequest(false, 0, 0, c.width(), c.height()));
    t.bytes += c.ReadUpdate();
    ++t.updates;
    now = Clock::now();
    t.transfer_ms.push_back(Ms(now - c.first_byte()));
  }
  t.seconds += std::chrono::duration<double>(now - t0).count();
}

std::string Which(const std::string& cmd) {
  auto r = testing::RunCommand({"sh", "-c", "command -v " + cmd});
  if (r.rc != 0) throw Failure(cmd + " is not installed (scripts/install-deps)");
  std::string out = r.out;
  while (!out.empty() && (out.back() == '\n' || out.back() == ' ')) out.pop_back();
  return out;
}

int Run(int rounds, int seconds) {
  const std::string qemu_bin = Which("qemu-system-x86_64");
  const std::string websockify_bin = Which("websockify");
  log::Logger logger("bench", "console", log::Level::kError);

  // The "VM": a bare qemu whose VNC socket sits where the simulated runtime looks for it.
  const std::string dir = testing::MakeTempDir("gpuaas-console-bench");
  const std::string alloc = ids::NewUuidV7();
  const std::string domain = node_agent::DomainName(alloc);
  const std::string socket = dir + "/" + domain + ".vnc";
  testing::Process qemu;
  qemu.Spawn({qemu_bin, "-machine", "accel=tcg", "-nodefaults", "-vga", "std", "-display", "none",
              "-m", "64", "-vnc", "unix:" + socket},
             dir + "/qemu.log");
  if (!testing::WaitFor([&] { return std::filesystem::exists(socket); }, 20s)) {
    throw Failure("qemu did not create its VNC socket; see " + dir + "/qemu.log");
  }

  testing::TestNats nats;
  const std::string dsn = testing::SharedPostgres().CreateDatabase("console_bench");
  auto harness = nats.Connect(testing::TestNats::kHarness);

  // The node: its ledger holds the domain, its console server relays it.
  auto store = node_agent::LocalStore::Open(dir + "/state");
  if (!store.ok()) throw Failure(store.error().ToString());
  if (auto r = store->Put(node_agent::DomainKey(alloc),
                          {{"name", domain}, {"state", "ready"}, {"runtime", "simulated"}});
      !r.ok()) {
    throw Failure(r.error().ToString());
  }
  nats.EnrollNode(kNode);
  node_agent::ConsoleOptions co;
  co.node_id = kNode;
  // Diagnosis: GPUAAS_BENCH_WINDOW_BYTES sets the credit window on both sides (default 256 KiB).
  const char* window = std::getenv("GPUAAS_BENCH_WINDOW_BYTES");
  if (window != nullptr && *window != '\0') co.max_window_bytes = std::atoll(window);
  node_agent::ConsoleServer agent(nats.Connect("node-agent", kNode), co,
                                  node_agent::LedgerConsoleLocator(*store, "", dir), logger,
                                  nullptr);
  if (auto r = agent.Start(); !r.ok()) throw Failure("console server: " + r.error().ToString());

  // The scheduler, as far as console-gw asks it: the allocation, live, on kNode.
  rpc::ServerOptions so;
  {
    std::ifstream key(nats.TokenPublicKeyFile());
    so.token_public_keys.emplace_back(std::istreambuf_iterator<char>(key),
                                      std::istreambuf_iterator<char>());
  }
  rpc::Server scheduler(harness, "scheduler", "gpuaas.*.scheduler.>", logger, nullptr, so);
  scheduler.Handle<v1::GetAllocationRequest, v1::GetAllocationResponse>(
      "gpuaas.v1.scheduler.allocation.get",
      [&](const v1::GetAllocationRequest& req, rpc::Context&) -> Result<v1::GetAllocationResponse> {
        if (req.allocation_id() != alloc) return Error::NotFound("allocation_not_found", "no");
        v1::GetAllocationResponse resp;
        auto* a = resp.mutable_allocation();
        a->set_allocation_id(alloc);
        a->set_tenant("bench");
        a->set_node_id(kNode);
        a->set_state(v1::ALLOCATION_STATE_ACTIVE);
        a->set_shape(v1::CAPACITY_SHAPE_GPU_SLICE);
        return resp;
      });
  if (auto r = scheduler.Start(); !r.ok()) throw Failure(r.error().ToString());

  auto env = nats.Env("console-gw");
  env["GPUAAS_POSTGRES_DSN"] = dsn;
  env["GPUAAS_LOG_LEVEL"] = "error";
  if (window != nullptr && *window != '\0') env["GPUAAS_CONSOLE_WINDOW_BYTES"] = window;
  auto cfg = bench::LoadConfig<console_gw::ConsoleGwConfig>(env);
  if (!cfg.ok()) throw Failure(cfg.error().ToString());
  console_gw::ConsoleGwService gw(*cfg);
  if (auto r = gw.Start(); !r.ok()) throw Failure("console-gw: " + r.error().ToString());
  const uint16_t gw_port = gw.gateway_port();

  v1::CreateConsoleSessionRequest creq;
  creq.set_allocation_id(alloc);
  creq.set_reason("console benchmark");
  rpc::Client operator_client(harness);
  operator_client.WithToken(nats.Token("operator", "", "user:bench"));
  auto created = operator_client.Call<v1::CreateConsoleSessionResponse>(
      "gpuaas.v1.console.session.create", creq, 10s);
  if (!created.ok()) throw Failure("session.create: " + created.error().ToString());

  const uint16_t ws_port = testing::FreePort();
  testing::Process websockify;
  websockify.Spawn({websockify_bin, "--run-once", fmt::format("127.0.0.1:{}", ws_port),
                    "--unix-target=" + socket},
                   dir + "/websockify.log");

  RfbClient relay("relay", gw_port, created->ws_path(),
                  fmt::format("http://127.0.0.1:{}", gw_port));
  RfbClient direct("direct", ws_port, "/", fmt::format("http://127.0.0.1:{}", ws_port));
  relay.Handshake();
  direct.Handshake();
  if (relay.width() != direct.width() || relay.height() != direct.height()) {
    throw Failure("the two paths see different screens");
  }
  std::printf("screen %ux%u (qemu -vga std, no guest: SeaBIOS)\n", relay.width(), relay.height());

  // ---- rtt ----
  for (int i = 0; i < 50; ++i) {
    (void)RoundTrip(relay);
    (void)RoundTrip(direct);
  }
  std::vector<double> rtt_relay, rtt_direct;
  for (int i = 0; i < rounds; ++i) {
    // Which path goes first alternates too, so neither always follows the other's burst.
    if (i % 2 == 0) {
      rtt_relay.push_back(RoundTrip(relay));
      rtt_direct.push_back(RoundTrip(direct));
    } else {
      rtt_direct.push_back(RoundTrip(direct));
      rtt_relay.push_back(RoundTrip(relay));
    }
  }

  // ---- throughput ----
  Throughput tp_relay, tp_direct;
  {
    Throughput warm;
    FullScreenFor(relay, 300ms, warm);
    FullScreenFor(direct, 300ms, warm);
  }
  for (int s = 0; s < seconds; ++s) {
    FullScreenFor(s % 2 == 0 ? relay : direct, 1s, s % 2 == 0 ? tp_relay : tp_direct);
    FullScreenFor(s % 2 == 0 ? direct : relay, 1s, s % 2 == 0 ? tp_direct : tp_relay);
  }

  using bench::Percentile;
  const double r50 = Percentile(rtt_relay, 0.5), r99 = Percentile(rtt_relay, 0.99);
  const double d50 = Percentile(rtt_direct, 0.5), d99 = Percentile(rtt_direct, 0.99);
  bench::Report("rtt relay", rtt_relay);
  bench::Report("rtt direct", rtt_direct);
  std::printf("\n%-34s %12s %12s %8s\n", "measure", "relay", "direct", "ratio");
  std::printf("%-34s %12.3f %12.3f %8.2f\n", "key+64x64 update rtt p50 (ms)", r50, d50, r50 / d50);
  std::printf("%-34s %12.3f %12.3f %8.2f\n", "key+64x64 update rtt p99 (ms)", r99, d99, r99 / d99);
  std::printf("%-34s %12.1f %12.1f %8.2f\n", "full-screen MB/s", tp_relay.MBps(), tp_direct.MBps(),
              tp_relay.MBps() / tp_direct.MBps());
  std::printf("%-34s %12.1f %12.1f %8.2f\n", "full-screen updates/s", tp_relay.Ups(),
              tp_direct.Ups(), tp_relay.Ups() / tp_direct.Ups());
  const double x_relay = Percentile(tp_relay.transfer_ms, 0.5),
               x_direct = Percentile(tp_direct.transfer_ms, 0.5);
  std::printf("%-34s %12.3f %12.3f %8.2f\n", "full-screen transfer p50 (ms)", x_relay, x_direct,
              x_relay / x_direct);
  std::printf("%-34s %12.3f %12.3f %8.2f\n", "full-screen transfer p99 (ms)",
              Percentile(tp_relay.transfer_ms, 0.99), Percentile(tp_direct.transfer_ms, 0.99),
              Percentile(tp_relay.transfer_ms, 0.99) / Percentile(tp_direct.transfer_ms, 0.99));
  auto per = [](const Throughput& t) {
    return t.updates > 0 ? static_cast<double>(t.bytes) / static_cast<double>(t.updates) : 0.0;
  };
  std::printf(
      "relay adds %.3f ms at p50 and %.3f ms at p99 to the round trip; bytes per "
      "full-screen update: relay %.0f, direct %.0f\n",
      r50 - d50, r99 - d99, per(tp_relay), per(tp_direct));
  std::printf(
      "(qemu sends a requested update on its display refresh timer, 30 ms after input, "
      "so the round trip has a ~30 ms floor on both paths and updates/s is qemu's pace; "
      "the transfer time is the path's own cost for %.2f MB)\n",
      per(tp_relay) / 1e6);
  std::printf(
      "(%d round trips and %d s of full-screen updates per path, alternating; the key "
      "changes nothing on SeaBIOS' screen: this is the path's latency, not a guest "
      "redraw)\n",
      rounds, seconds);
  std::printf("P8 relay_rtt_p50_ms=%.3f direct_rtt_p50_ms=%.3f ratio=%.2f\n", r50, d50, r50 / d50);
  return 0;
}

}  // namespace

int main(int argc, char** argv) {
  std::setvbuf(stdout, nullptr, _IOLBF, 0);
  const int rounds = argc > 1 ? std::atoi(argv[1]) : 500;
  const int seconds = argc > 2 ? std::atoi(argv[2]) : 5;
  try {
    return Run(rounds, seconds);
  } catch (const std::exception& e) {
    std::fprintf(stderr, "console_bench: %s\n", e.what());
    return 1;
  }
}
