#pragma once
// A small HTTP/1.1 server (Boost.Beast, compiled only in http.cpp) for /healthz, /readyz and
// /metrics, and the base for services that serve more (console-gw). One I/O thread.
#include <cstdint>
#include <functional>
#include <memory>
#include <string>

#include "gpuaas/common/log.hpp"
#include "gpuaas/common/result.hpp"

namespace gpuaas::http {

struct Response {
  int status = 200;
  std::string content_type = "text/plain; charset=utf-8";
  std::string body;
};

using Handler = std::function<Response(const std::string& method, const std::string& target)>;

class Server {
 public:
  Server(std::string host, uint16_t port, log::Logger logger);
  ~Server();
  // Exact path match (query string ignored). Register before Start().
  void Route(const std::string& path, Handler handler);
  // Binds (port 0 picks a free one) and starts serving; returns the bound port.
  Result<uint16_t> Start();
  void Stop();

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// GET http://host:port/path; for tests and health probes. Returns {status, body}.
Result<std::pair<int, std::string>> Get(const std::string& host, uint16_t port,
                                        const std::string& path);

}  // namespace gpuaas::http
