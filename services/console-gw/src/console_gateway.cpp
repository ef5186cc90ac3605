#include "gpuaas/console_gw/console_gateway.hpp"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>
#include <boost/beast/websocket.hpp>

#include <chrono>
#include <deque>
#include <filesystem>
#include <fstream>
#include <mutex>
#include <set>
#include <sstream>
#include <thread>

#include <nlohmann/json.hpp>

namespace gpuaas::console_gw {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
namespace websocket = beast::websocket;
using tcp = asio::ip::tcp;
using json = nlohmann::json;

namespace {

std::string_view SV(beast::string_view s) { return {s.data(), s.size()}; }

constexpr const char* kCookie = "gpuaas_session";
constexpr size_t kMaxBody = size_t{1024} * 1024;
constexpr size_t kMaxWsMessage = size_t{1024} * 1024;

std::string CookieValue(std::string_view header, std::string_view name) {
  while (!header.empty()) {
    const auto semi = header.find(';');
    std::string_view kv = header.substr(0, semi);
    while (!kv.empty() && kv.front() == ' ') kv.remove_prefix(1);
    if (kv.size() > name.size() && kv.substr(0, name.size()) == name && kv[name.size()] == '=') {
      return std::string(kv.substr(name.size() + 1));
    }
    if (semi == std::string_view::npos) break;
    header.remove_prefix(semi + 1);
  }
  return "";
}

json IdentityJson(const Identity& id) {
  return json{{"principal", id.subject},
              {"roles", id.roles},
              {"expires_unix", id.expires_unix},
              {"session_id", id.session_id}};
}

// The WebSocket subprotocol to answer: the first the client offered (noVNC offers "binary" in
// some versions); a browser fails a connect whose offered protocols get no answer.
std::string FirstProtocol(std::string_view offered) {
  const auto comma = offered.find(',');
  std::string_view p = offered.substr(0, comma);
  while (!p.empty() && p.front() == ' ') p.remove_prefix(1);
  while (!p.empty() && p.back() == ' ') p.remove_suffix(1);
  return std::string(p);
}

}  // namespace

struct Gateway::Impl : std::enable_shared_from_this<Impl> {
  Impl(GatewayOptions o, Backend& b, log::Logger l)
      : opts(std::move(o)), backend(b), log(std::move(l)), pool(std::max(1, opts.workers)) {}

  class WsSession;

  GatewayOptions opts;
  Backend& backend;
  log::Logger log;
  asio::io_context io{1};
  asio::thread_pool pool;
  std::unique_ptr<tcp::acceptor> acceptor;
  std::thread thread;
  std::mutex mu;
  std::set<std::shared_ptr<WsSession>> live;
  std::atomic<bool> stopped{false};

  void Accept();
  void AddLive(const std::shared_ptr<WsSession>& s) {
    std::lock_guard lock(mu);
    live.insert(s);
  }
  void RemoveLive(const std::shared_ptr<WsSession>& s) {
    std::lock_guard lock(mu);
    live.erase(s);
  }
};

// One console connection: one read and at most one write in flight (Beast allows one of each),
// all on the gateway's single I/O thread; the bridge's callbacks are posted onto it.
class Gateway::Impl::WsSession : public std::enable_shared_from_this<WsSession> {
 public:
  WsSession(std::shared_ptr<Impl> owner, beast::tcp_stream stream, ConnectAttempt a)
      : owner_(std::move(owner)), ws_(std::move(stream)), attempt_(std::move(a)) {}

  void Run(const bhttp::request<bhttp::string_body>& req) {
    beast::get_lowest_layer(ws_).expires_never();
    // A console is interactive: without TCP_NODELAY, Nagle holds a small write (the tail of an
    // update the relay delivered in several frames) until the browser's delayed ACK, ~40 ms
    // (bench/console_bench: round trip 2.4x websockify's without it, 1.0x with it).
    beast::error_code nodelay;
    beast::get_lowest_layer(ws_).socket().set_option(tcp::no_delay(true), nodelay);
    ws_.set_option(websocket::stream_base::timeout::suggested(beast::role_type::server));
    ws_.read_message_max(kMaxWsMessage);
    ws_.binary(true);
    const std::string proto = FirstProtocol(SV(req[bhttp::field::sec_websocket_protocol]));
    ws_.set_option(websocket::stream_base::decorator([proto](websocket::response_type& res) {
      res.set(bhttp::field::server, "gpuaas-console-gw");
      if (!proto.empty()) res.set(bhttp::field::sec_websocket_protocol, proto);
    }));
    ws_.async_accept(req, [self = shared_from_this()](beast::error_code ec) {
      if (ec) return;
      self->Claim();
    });
  }

  void Stop(EndReason reason) {
    asio::post(ws_.get_executor(), [self = shared_from_this(), reason] { self->End(reason); });
  }

 private:
  void Claim() {
    auto self = shared_from_this();
    asio::post(owner_->pool, [self] {
      auto claim = self->owner_->backend.Claim(self->attempt_);
      if (!claim.ok() || !claim->claimed) {
        // Refused, or the claim could not be recorded (so no console opens unaudited): an error
        // outside the end reasons is closed 1011 with its own reason.
        std::optional<EndReason> refused;
        std::string why;
        if (claim.ok()) {
          refused = claim->refused;
        } else {
          why = claim.error().reason;
        }
        asio::post(self->ws_.get_executor(), [self, refused, why] {
          self->ended_ = true;
          if (refused) {
            self->CloseNow(*refused);
          } else {
            self->CloseNow(websocket::close_code::internal_error, why);
          }
        });
        return;
      }
      self->claimed_ = *claim->claimed;
      Bridge::Callbacks cb;
      std::weak_ptr<WsSession> weak = self;
      cb.on_data = [weak](std::string data) {
        if (auto s = weak.lock()) {
          asio::post(s->ws_.get_executor(),
                     [s, d = std::move(data)]() mutable { s->Queue(std::move(d)); });
        }
      };
      cb.on_end = [weak](EndReason reason) {
        if (auto s = weak.lock()) s->Stop(reason);
      };
      auto opened = self->owner_->backend.Open(self->claimed_, cb);
      asio::post(self->ws_.get_executor(), [self, opened]() mutable {
        if (!opened.bridge) {
          self->ended_ = true;
          self->CloseNow(opened.failed);
          return;
        }
        self->bridge_ = opened.bridge;
        // The VM may have spoken (and the browser taken it) while the node was still answering
        // the open: acknowledge that now, or its credit would be short for good.
        if (self->early_delivered_ > 0) {
          self->bridge_->Delivered(self->early_delivered_, self->out_.empty());
          self->early_delivered_ = 0;
        }
        self->owner_->AddLive(self);
        std::weak_ptr<WsSession> holder = self;
        self->owner_->backend.Live(self->claimed_.session_id, [holder](EndReason reason) {
          if (auto s = holder.lock()) s->Stop(reason);
        });
        if (self->owner_->stopped) {
          self->End(EndReason::kGatewayStopping);
          return;
        }
        self->Read();
      });
    });
  }

  void Read() {
    ws_.async_read(in_, [self = shared_from_this()](beast::error_code ec, size_t n) {
      if (ec) {
        // The browser closed (or the connection broke, or the idle timeout with unanswered
        // pings fired).
        self->End(EndReason::kClientClosed);
        return;
      }
      if (!self->ended_ && self->bridge_) {
        const auto data = self->in_.cdata();
        self->bridge_->FromClient(
            std::string_view(static_cast<const char*>(data.data()), data.size()));
      }
      self->in_.consume(n);
      if (!self->ended_) self->Read();
    });
  }

  void Queue(std::string data) {
    if (ended_) return;
    out_.push_back(std::move(data));
    if (!writing_) Write();
  }

  void Write() {
    writing_ = true;
    ws_.async_write(asio::buffer(out_.front()),
                    [self = shared_from_this()](beast::error_code ec, size_t n) {
                      self->writing_ = false;
                      self->out_.pop_front();
                      if (ec) {
                        self->End(EndReason::kClientClosed);
                        return;
                      }
                      if (self->bridge_) {
                        self->bridge_->Delivered(n, self->out_.empty());
                      } else {
                        self->early_delivered_ += n;  // before Open returned the bridge
                      }
                      if (self->close_reason_) {
                        self->CloseNow(*self->close_reason_);
                      } else if (!self->out_.empty() && !self->ended_) {
                        self->Write();
                      }
                    });
  }

  // Ends the relay once: tells the node (unless it ended it), records the end, closes the
  // WebSocket with the reason's code.
  void End(EndReason reason) {
    if (ended_) return;
    ended_ = true;
    if (bridge_) {
      bridge_->Close(reason);
      auto self = shared_from_this();
      const uint64_t to = bridge_->BytesToClient();
      const uint64_t from = bridge_->BytesFromClient();
      asio::post(owner_->pool, [self, reason, to, from] {
        self->owner_->backend.Finish(self->claimed_.session_id, reason, to, from);
      });
      owner_->RemoveLive(shared_from_this());
    }
    if (reason == EndReason::kClientClosed) return;  // nothing left to close
    out_.clear();
    if (writing_) {
      close_reason_ = reason;  // after the write in flight (one write at a time)
      return;
    }
    CloseNow(reason);
  }

  void CloseNow(EndReason reason) {
    CloseNow(static_cast<websocket::close_code>(CloseCodeFor(reason)), TextOf(reason).str());
  }

  void CloseNow(websocket::close_code code, const std::string& reason) {
    if (closing_) return;
    closing_ = true;
    websocket::close_reason cr(code, reason);
    ws_.async_close(cr, [self = shared_from_this()](beast::error_code) {});
  }

  std::shared_ptr<Impl> owner_;
  websocket::stream<beast::tcp_stream> ws_;
  ConnectAttempt attempt_;
  Claimed claimed_;
  std::shared_ptr<Bridge> bridge_;
  beast::flat_buffer in_;
  std::deque<std::string> out_;
  bool writing_ = false;
  bool ended_ = false;
  bool closing_ = false;
  std::optional<EndReason> close_reason_;  // closes after the write in flight
  uint64_t early_delivered_ = 0;           // bytes written before bridge_ was set
};

namespace {

class HttpSession : public std::enable_shared_from_this<HttpSession> {
 public:
  HttpSession(std::shared_ptr<Gateway::Impl> owner, tcp::socket s)
      : owner_(std::move(owner)), stream_(std::move(s)) {}

  void Read() {
    parser_.emplace();
    parser_->body_limit(kMaxBody);
    stream_.expires_after(std::chrono::seconds(30));
    bhttp::async_read(stream_, buffer_, *parser_,
                      [self = shared_from_this()](beast::error_code ec, size_t) {
                        if (ec) return;
                        self->Dispatch(self->parser_->release());
                      });
  }

 private:
  using Request = bhttp::request<bhttp::string_body>;
  using Response = bhttp::response<bhttp::string_body>;

  std::string ClientAddress() {
    beast::error_code ec;
    auto ep = stream_.socket().remote_endpoint(ec);
    return ec ? "" : ep.address().to_string() + ":" + std::to_string(ep.port());
  }

  bool SameOrigin(const Request& req) const {
    return OriginAllowed(SV(req[bhttp::field::origin]), SV(req[bhttp::field::host]),
                         owner_->opts.allowed_origins);
  }

  void Dispatch(Request req) {
    const std::string target(req.target());
    const std::string path = target.substr(0, target.find('?'));
    if (websocket::is_upgrade(req)) {
      Upgrade(std::move(req), target);
      return;
    }
    if (path.rfind("/api/", 0) == 0) {
      Api(std::move(req), path);
      return;
    }
    if (req.method() != bhttp::verb::get && req.method() != bhttp::verb::head) {
      Send(req, Make(req, 405, "text/plain; charset=utf-8", "method not allowed\n"));
      return;
    }
    std::optional<std::string> file;
    if (path == "/" || path == "/index.html") {
      file = owner_->opts.web_dir + "/index.html";
    } else if (path.rfind("/static/", 0) == 0) {
      file = SafeJoin(owner_->opts.web_dir, std::string_view(path).substr(8));
    } else if (path.rfind("/novnc/", 0) == 0) {
      file = SafeJoin(owner_->opts.novnc_dir, std::string_view(path).substr(7));
    }
    std::error_code ec;
    if (!file || !std::filesystem::is_regular_file(*file, ec)) {
      Send(req, Make(req, 404, "text/plain; charset=utf-8", "not found\n"));
      return;
    }
    std::ifstream in(*file, std::ios::binary);
    std::stringstream body;
    body << in.rdbuf();
    auto res = Make(req, 200, ContentTypeFor(*file), body.str());
    res.set(bhttp::field::cache_control, "no-cache");
    Send(req, std::move(res));
  }

  Response Make(const Request& req, int status, const std::string& type, std::string body) {
    Response res(static_cast<bhttp::status>(status), req.version());
    res.set(bhttp::field::server, "gpuaas-console-gw");
    res.set(bhttp::field::content_type, type);
    res.set("X-Content-Type-Options", "nosniff");
    res.set("X-Frame-Options", "SAMEORIGIN");  // the page frames its own console
    res.set("Referrer-Policy", "no-referrer");
    // Everything the page loads comes from here: no CDN, no inline script.
    res.set("Content-Security-Policy",
            "default-src 'self'; img-src 'self' data: blob:; style-src 'self' 'unsafe-inline'; "
            "connect-src 'self' ws: wss:; frame-ancestors 'self'; base-uri 'none'");
    res.keep_alive(req.keep_alive());
    res.body() = std::move(body);
    res.prepare_payload();
    return res;
  }

  void Send(const Request& req, Response res) {
    if (req.method() == bhttp::verb::head) res.body().clear();
    auto sp = std::make_shared<Response>(std::move(res));
    bhttp::async_write(stream_, *sp, [self = shared_from_this(), sp](beast::error_code ec, size_t) {
      if (ec) return;
      if (sp->keep_alive()) {
        self->Read();
      } else {
        beast::error_code ignored;
        self->stream_.socket().shutdown(tcp::socket::shutdown_send, ignored);
      }
    });
  }

  // Runs `fn` (a blocking backend call producing a response) on the worker pool, then sends.
  template <typename F>
  void Async(Request req, F fn) {
    auto self = shared_from_this();
    auto rq = std::make_shared<Request>(std::move(req));
    asio::post(owner_->pool, [self, rq, fn = std::move(fn)]() mutable {
      Response res = fn(*rq);
      asio::post(self->stream_.get_executor(),
                 [self, rq, r = std::move(res)]() mutable { self->Send(*rq, std::move(r)); });
    });
  }

  Response Json(const Request& req, int status, const std::string& body) {
    auto res = Make(req, status, "application/json", body);
    res.set(bhttp::field::cache_control, "no-store");
    return res;
  }

  std::string CookieHeader(const std::string& value, int64_t max_age) const {
    return std::string(kCookie) + "=" + value +
           "; Path=/; HttpOnly; SameSite=Strict; Max-Age=" + std::to_string(max_age) +
           (owner_->opts.secure_cookies ? "; Secure" : "");
  }

  void Api(Request req, const std::string& path) {
    const std::string cookie = CookieValue(SV(req[bhttp::field::cookie]), kCookie);
    if (req.method() == bhttp::verb::post && !SameOrigin(req)) {
      // A form or script on another site must not act with the operator's cookie.
      Send(req, Json(req, 403,
                     ErrorJson(Error::Of(Code::kPermissionDenied, reason::kCrossOrigin,
                                         "requests must come from this page's origin"))));
      return;
    }
    if (path == "/api/login" && req.method() == bhttp::verb::post) {
      Async(std::move(req), [this](const Request& r) {
        std::string tok;
        try {
          tok = json::parse(r.body()).value("token", "");
        } catch (const std::exception&) {
          return Json(
              r, 400,
              ErrorJson(Error::InvalidArgument(reason::kMalformedJson, "body is not JSON")));
        }
        auto login = owner_->backend.Login(tok);
        if (!login.ok()) {
          return Json(r, 401, ErrorJson(login.error()));
        }
        auto res = Json(r, 200, IdentityJson(login->identity).dump());
        const int64_t now = std::chrono::duration_cast<std::chrono::seconds>(
                                std::chrono::system_clock::now().time_since_epoch())
                                .count();
        // The cookie names the server-side session; it is never the token.
        res.set(
            bhttp::field::set_cookie,
            CookieHeader(login->cookie, std::max<int64_t>(0, login->identity.expires_unix - now)));
        return res;
      });
      return;
    }
    if (path == "/api/logout" && req.method() == bhttp::verb::post) {
      // Ends the session server-side: the cookie is worth nothing afterwards, wherever it is.
      Async(std::move(req), [this, cookie](const Request& r) {
        owner_->backend.Logout(cookie);
        auto res = Json(r, 200, "{}");
        res.set(bhttp::field::set_cookie, CookieHeader("", 0));
        return res;
      });
      return;
    }
    if (path == "/api/whoami" && req.method() == bhttp::verb::get) {
      Async(std::move(req), [this, cookie](const Request& r) {
        auto access = owner_->backend.Resume(cookie);
        if (!access.ok()) {
          return Json(r, 401, ErrorJson(access.error()));
        }
        return Json(r, 200, IdentityJson(access->identity).dump());
      });
      return;
    }
    if (path.rfind("/api/call/", 0) == 0 && req.method() == bhttp::verb::post) {
      const std::string subject = path.substr(10);
      Async(std::move(req), [this, cookie, subject](const Request& r) {
        auto access = owner_->backend.Resume(cookie);
        if (!access.ok()) return Json(r, 401, ErrorJson(access.error()));
        auto reply =
            owner_->backend.Call(access->token, subject, r.body().empty() ? "{}" : r.body());
        return Json(r, reply.status, reply.json);
      });
      return;
    }
    Send(req, Json(req, 404, ErrorJson(Error::NotFound(reason::kNoSuchApi, "no API at " + path))));
  }

  void Upgrade(Request req, const std::string& target) {
    ConnectAttempt a;
    a.origin = std::string(req[bhttp::field::origin]);
    a.client_address = ClientAddress();
    auto parsed = ParseWsTarget(target);
    if (parsed) {
      a.session_id = parsed->session_id;
      a.grant = parsed->grant;
    }
    auto self = shared_from_this();
    auto refuse = [self, &req](const ConnectAttempt& at, int status, Reason failure,
                               const std::string& detail) {
      asio::post(self->owner_->pool, [self, at, failure, detail] {
        self->owner_->backend.Refused(at, failure, detail);
      });
      self->Send(req, self->Json(req, status,
                                 ErrorJson(Error::Of(Code::kPermissionDenied, failure, detail))));
    };
    if (!parsed) {
      refuse(a, 400, reason::kGrantUnknown, "not /console/ws/<session id>?grant=<grant>");
      return;
    }
    if (!SameOrigin(req)) {
      // Cross-site WebSocket hijacking (OpenStack's CVE-2015-0259): a page on another origin
      // must not reach a console even with a grant it somehow got.
      refuse(a, 403, reason::kCrossOrigin,
             "Origin '" + a.origin + "' may not open consoles here (Host '" +
                 std::string(req[bhttp::field::host]) + "')");
      return;
    }
    std::make_shared<Gateway::Impl::WsSession>(owner_, std::move(stream_), std::move(a))->Run(req);
  }

  std::shared_ptr<Gateway::Impl> owner_;
  beast::tcp_stream stream_;
  beast::flat_buffer buffer_;
  std::optional<bhttp::request_parser<bhttp::string_body>> parser_;
};

}  // namespace

void Gateway::Impl::Accept() {
  acceptor->async_accept([self = shared_from_this()](beast::error_code ec, tcp::socket s) {
    if (ec) return;  // closed
    std::make_shared<HttpSession>(self, std::move(s))->Read();
    self->Accept();
  });
}

Gateway::Gateway(GatewayOptions opts, Backend& backend, log::Logger logger)
    : impl_(std::make_shared<Impl>(std::move(opts), backend, std::move(logger))) {}

Gateway::~Gateway() { Stop(); }

Result<uint16_t> Gateway::Start() {
  beast::error_code ec;
  auto addr = asio::ip::make_address(impl_->opts.host, ec);
  if (ec) {
    return Error::InvalidArgument(reason::kInvalidHost, "console.http_host: " + impl_->opts.host);
  }
  impl_->acceptor = std::make_unique<tcp::acceptor>(impl_->io);
  tcp::endpoint ep(addr, impl_->opts.port);
  impl_->acceptor->open(ep.protocol(), ec);
  if (!ec) impl_->acceptor->set_option(asio::socket_base::reuse_address(true), ec);
  if (!ec) impl_->acceptor->bind(ep, ec);
  if (!ec) impl_->acceptor->listen(asio::socket_base::max_listen_connections, ec);
  if (ec) {
    return Error::Unavailable(reason::kListenFailed,
                              "console gateway cannot listen on " + impl_->opts.host + ":" +
                                  std::to_string(impl_->opts.port) + ": " + ec.message());
  }
  const uint16_t port = impl_->acceptor->local_endpoint().port();
  impl_->Accept();
  impl_->thread = std::thread([impl = impl_] { impl->io.run(); });
  return port;
}

void Gateway::Stop() {
  if (!impl_ || impl_->stopped.exchange(true)) return;
  if (impl_->acceptor) {
    asio::post(impl_->io, [impl = impl_] {
      beast::error_code ignored;
      impl->acceptor->close(ignored);
    });
  }
  std::vector<std::shared_ptr<Impl::WsSession>> live;
  {
    std::lock_guard lock(impl_->mu);
    live.assign(impl_->live.begin(), impl_->live.end());
  }
  for (auto& s : live) s->Stop(EndReason::kGatewayStopping);
  // The close frames and the sessions' Finish records get a moment before the loop stops.
  const auto until = std::chrono::steady_clock::now() + std::chrono::seconds(2);
  while (LiveConnections() > 0 && std::chrono::steady_clock::now() < until) {
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
  }
  impl_->pool.join();
  impl_->io.stop();
  if (impl_->thread.joinable()) impl_->thread.join();
}

size_t Gateway::LiveConnections() const {
  std::lock_guard lock(impl_->mu);
  return impl_->live.size();
}

}  // namespace gpuaas::console_gw
