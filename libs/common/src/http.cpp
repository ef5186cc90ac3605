#include "gpuaas/common/http.hpp"

#include <boost/asio.hpp>
#include <boost/beast/core.hpp>
#include <boost/beast/http.hpp>

#include <map>
#include <thread>

#include "gpuaas/common/reasons.hpp"

namespace gpuaas::http {

namespace asio = boost::asio;
namespace beast = boost::beast;
namespace bhttp = beast::http;
using tcp = asio::ip::tcp;

struct Server::Impl {
  std::string host;
  uint16_t port;
  log::Logger log;
  std::map<std::string, Handler> routes;
  asio::io_context io{1};
  std::unique_ptr<tcp::acceptor> acceptor;
  std::thread thread;

  struct Session : std::enable_shared_from_this<Session> {
    Session(tcp::socket s, Impl* o) : stream(std::move(s)), owner(o) {}
    beast::tcp_stream stream;
    beast::flat_buffer buffer;
    bhttp::request<bhttp::string_body> req;
    bhttp::response<bhttp::string_body> res;
    Impl* owner;

    void Read() {
      req = {};
      stream.expires_after(std::chrono::seconds(30));
      bhttp::async_read(stream, buffer, req,
                        [self = shared_from_this()](beast::error_code ec, size_t) {
                          if (ec) return;
                          self->Respond();
                        });
    }
    void Respond() {
      std::string target(req.target());
      const std::string path = target.substr(0, target.find('?'));
      Response r{404, "text/plain; charset=utf-8", "not found\n"};
      if (auto it = owner->routes.find(path); it != owner->routes.end()) {
        try {
          r = it->second(std::string(req.method_string()), target);
        } catch (const std::exception& e) {
          r = {500, "text/plain; charset=utf-8", std::string("internal error: ") + e.what()};
        }
      }
      res =
          bhttp::response<bhttp::string_body>(static_cast<bhttp::status>(r.status), req.version());
      res.set(bhttp::field::content_type, r.content_type);
      res.set(bhttp::field::server, "gpuaas");
      res.keep_alive(req.keep_alive());
      res.body() = std::move(r.body);
      res.prepare_payload();
      bhttp::async_write(stream, res, [self = shared_from_this()](beast::error_code ec, size_t) {
        if (ec) return;
        if (self->res.keep_alive()) {
          self->Read();
        } else {
          beast::error_code ignored;
          self->stream.socket().shutdown(tcp::socket::shutdown_send, ignored);
        }
      });
    }
  };

  void Accept() {
    acceptor->async_accept([this](beast::error_code ec, tcp::socket s) {
      if (ec) return;  // acceptor closed
      std::make_shared<Session>(std::move(s), this)->Read();
      Accept();
    });
  }
};

Server::Server(std::string host, uint16_t port, log::Logger logger)
    : impl_(std::make_unique<Impl>()) {
  impl_->host = std::move(host);
  impl_->port = port;
  impl_->log = std::move(logger);
}

Server::~Server() { Stop(); }

void Server::Route(const std::string& path, Handler handler) {
  impl_->routes[path] = std::move(handler);
}

Result<uint16_t> Server::Start() {
  try {
    tcp::endpoint ep(asio::ip::make_address(impl_->host), impl_->port);
    impl_->acceptor = std::make_unique<tcp::acceptor>(impl_->io);
    impl_->acceptor->open(ep.protocol());
    impl_->acceptor->set_option(asio::socket_base::reuse_address(true));
    impl_->acceptor->bind(ep);
    impl_->acceptor->listen();
    impl_->port = impl_->acceptor->local_endpoint().port();
  } catch (const std::exception& e) {
    return Error::Unavailable(reason::kHttpBindFailed,
                              impl_->host + ":" + std::to_string(impl_->port) + ": " + e.what());
  }
  impl_->Accept();
  impl_->thread = std::thread([this] { impl_->io.run(); });
  impl_->log.Info("http listening", {{"addr", impl_->host + ":" + std::to_string(impl_->port)}});
  return impl_->port;
}

void Server::Stop() {
  if (!impl_ || !impl_->thread.joinable()) return;
  asio::post(impl_->io, [this] {
    beast::error_code ec;
    impl_->acceptor->close(ec);
  });
  impl_->io.stop();
  impl_->thread.join();
}

Result<std::pair<int, std::string>> Get(const std::string& host, uint16_t port,
                                        const std::string& path) {
  try {
    asio::io_context io;
    beast::tcp_stream stream(io);
    stream.expires_after(std::chrono::seconds(5));
    stream.connect(tcp::endpoint(asio::ip::make_address(host), port));
    bhttp::request<bhttp::empty_body> req{bhttp::verb::get, path, 11};
    req.set(bhttp::field::host, host);
    bhttp::write(stream, req);
    beast::flat_buffer buf;
    bhttp::response<bhttp::string_body> res;
    bhttp::read(stream, buf, res);
    beast::error_code ec;
    stream.socket().shutdown(tcp::socket::shutdown_both, ec);
    return std::make_pair(static_cast<int>(res.result_int()), res.body());
  } catch (const std::exception& e) {
    return Error::Unavailable(reason::kHttpGetFailed, e.what());
  }
}

}  // namespace gpuaas::http
