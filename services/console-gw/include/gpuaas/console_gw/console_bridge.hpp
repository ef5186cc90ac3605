#pragma once
// The NATS side of one console relay in console-gw: ConsoleFrames to the node on
// gpuaas.v1.node.<node>.console.<session>.in (the browser's bytes, held back beyond the node's
// credit) and from it on .out (the VM's bytes, handed to the WebSocket, acknowledged as the
// browser's socket takes them). No Beast here: the WebSocket side calls FromClient/Delivered and
// gets on_data/on_end.
#include <functional>
#include <memory>
#include <mutex>
#include <optional>
#include <string>
#include <string_view>

#include "gpuaas/common/messaging.hpp"
#include "gpuaas/console_gw/console_domain.hpp"

namespace gpuaas::console_gw {

class Bridge : public std::enable_shared_from_this<Bridge> {
 public:
  struct Options {
    std::string node_id;
    std::string session_id;
    uint64_t window_bytes = uint64_t{256} * 1024;
    // The browser's bytes held for want of credit beyond this end the relay (client_flood).
    uint64_t max_pending_bytes = uint64_t{8} * 1024 * 1024;
  };
  struct Callbacks {
    // The VM's bytes for the browser, in order (NATS' delivery thread; must not block long).
    std::function<void(std::string data)> on_data;
    // Once, when the relay ends for a reason other than Close(): vm_closed, max_duration,
    // relay_lost, agent_stopping, ... (the node's close reason or the bridge's own; a close
    // reason from the node outside EndReason is relay_lost).
    std::function<void(EndReason reason)> on_end;
  };

  // Subscribes to the session's .out subject (before the node is asked to open, so its first
  // bytes are not missed).
  static Result<std::shared_ptr<Bridge>> Start(std::shared_ptr<messaging::Connection> conn,
                                               Options opts, Callbacks cb);
  ~Bridge();
  Bridge(const Bridge&) = delete;
  Bridge& operator=(const Bridge&) = delete;

  // The browser sent these bytes: sent now as far as the node's credit allows, the rest when it
  // acknowledges more.
  void FromClient(std::string_view bytes);
  // `n` more of the VM's bytes reached the browser's socket: acknowledged to the node.
  // `idle`: nothing more is queued for the browser (acknowledge now, however little).
  void Delivered(uint64_t n, bool idle);
  // Ends the relay from this side: a close frame with `reason` to the node, no on_end.
  void Close(EndReason reason);

  uint64_t BytesToClient() const;
  uint64_t BytesFromClient() const;
  std::string Subject(const char* direction) const;

 private:
  Bridge(std::shared_ptr<messaging::Connection> conn, Options opts, Callbacks cb);
  static void OnMsg(natsConnection* nc, natsSubscription* sub, natsMsg* msg, void* closure);
  void Handle(const std::string& payload);
  // Sends what the credit allows of pending_ (and an acknowledgement) under mu_.
  void FlushLocked(bool force_ack);
  // A data or acknowledgement frame; with `close`, the last one, saying why.
  void SendLocked(std::string data, std::optional<EndReason> close = std::nullopt);
  // Marks it ended and stops the subscription; `notify` (when given) gets on_end to call after
  // the lock is released.
  void EndLocked(std::function<void(EndReason)>* notify);

  std::shared_ptr<messaging::Connection> conn_;
  Options opts_;
  Callbacks cb_;
  natsSubscription* sub_ = nullptr;
  mutable std::mutex mu_;
  Credit out_credit_;        // the browser's bytes to the node
  uint64_t next_seq_ = 1;    // of frames this side sends
  uint64_t expect_seq_ = 1;  // of frames from the node
  uint64_t delivered_ = 0;   // VM bytes the browser's socket took
  uint64_t acked_sent_ = 0;  // the last `acked` this side told the node
  uint64_t received_ = 0;    // VM bytes received
  std::string pending_;      // browser bytes waiting for credit
  bool ended_ = false;
};

}  // namespace gpuaas::console_gw
