#include "gpuaas/console_gw/console_bridge.hpp"

#include <nats/nats.h>

#include <algorithm>
#include <utility>

#include <fmt/format.h>

#include "gpuaas/common/contract.hpp"
#include "gpuaas/v1/console.pb.h"

namespace gpuaas::console_gw {

namespace {
constexpr size_t kMaxFrameData = size_t{64} * 1024;
}

Bridge::Bridge(std::shared_ptr<messaging::Connection> conn, Options opts, Callbacks cb)
    : conn_(std::move(conn)), opts_(std::move(opts)), cb_(std::move(cb)) {
  out_credit_.window = opts_.window_bytes;
}

Bridge::~Bridge() {
  if (sub_ != nullptr) {
    natsSubscription_Unsubscribe(sub_);
    natsSubscription_Destroy(sub_);
  }
}

std::string Bridge::Subject(const char* direction) const {
  return fmt::format("gpuaas.v1.node.{}.console.{}.{}", opts_.node_id, opts_.session_id, direction);
}

Result<std::shared_ptr<Bridge>> Bridge::Start(std::shared_ptr<messaging::Connection> conn,
                                              Options opts, Callbacks cb) {
  std::shared_ptr<Bridge> b(new Bridge(std::move(conn), std::move(opts), std::move(cb)));
  const std::string out = b->Subject("out");
  // A callback may still run after the bridge is gone (unsubscribing does not wait for one in
  // flight): it holds a weak reference, freed when nats.c says the subscription is complete.
  auto* ref = new std::weak_ptr<Bridge>(b);
  natsStatus s =
      natsConnection_Subscribe(&b->sub_, b->conn_->raw(), out.c_str(), &Bridge::OnMsg, ref);
  if (s != NATS_OK) {
    delete ref;
    return messaging::NatsError(s, "subscribe " + out);
  }
  natsSubscription_SetOnCompleteCB(
      b->sub_, [](void* c) { delete static_cast<std::weak_ptr<Bridge>*>(c); }, ref);
  natsSubscription_SetPendingLimits(b->sub_, -1, -1);
  b->conn_->contract().Record(
      {contract::Role::kConsume, out, "gpuaas.v1.ConsoleFrame", "", "console relay", 1});
  if (auto f = b->conn_->CheckPermitted(out, std::chrono::seconds(5)); !f.ok()) return f.error();
  return b;
}

void Bridge::OnMsg(natsConnection* /*nc*/, natsSubscription* /*sub*/, natsMsg* msg, void* closure) {
  std::string payload(natsMsg_GetData(msg), static_cast<size_t>(natsMsg_GetDataLength(msg)));
  natsMsg_Destroy(msg);
  if (auto self = static_cast<std::weak_ptr<Bridge>*>(closure)->lock()) self->Handle(payload);
}

void Bridge::Handle(const std::string& payload) {
  v1::ConsoleFrame f;
  std::function<void(EndReason)> notify;
  EndReason reason = EndReason::kRelayLost;
  std::string data;
  {
    std::lock_guard lock(mu_);
    if (ended_) return;
    if (!f.ParseFromString(payload) || f.seq() != expect_seq_ || f.data().size() > kMaxFrameData ||
        !out_credit_.Ack(f.acked()) ||
        received_ + f.data().size() - delivered_ > opts_.window_bytes) {
      // A lost or reordered frame, or a node ignoring the credit it was given.
      reason = EndReason::kRelayLost;
      SendLocked("", reason);
      EndLocked(&notify);
    } else {
      ++expect_seq_;
      received_ += f.data().size();
      data = f.data();
      if (f.close()) {
        // The node's words for why; a reason this gateway does not know is a broken relay.
        reason = f.close_reason().empty()
                     ? EndReason::kVmClosed
                     : ParseEndReason(f.close_reason()).value_or(EndReason::kRelayLost);
        EndLocked(&notify);
      } else {
        FlushLocked(false);
      }
    }
  }
  if (!data.empty() && cb_.on_data) cb_.on_data(std::move(data));
  if (notify) notify(reason);
}

void Bridge::FromClient(std::string_view bytes) {
  std::function<void(EndReason)> notify;
  {
    std::lock_guard lock(mu_);
    if (ended_) return;
    pending_.append(bytes);
    if (pending_.size() > opts_.max_pending_bytes) {
      SendLocked("", EndReason::kClientFlood);
      EndLocked(&notify);
    } else {
      FlushLocked(false);
    }
  }
  if (notify) notify(EndReason::kClientFlood);
}

void Bridge::Delivered(uint64_t n, bool idle) {
  std::lock_guard lock(mu_);
  if (ended_) return;
  delivered_ += n;
  // Acknowledge in steps of a quarter window, and whenever the browser caught up, so the node
  // never waits on an acknowledgement the browser already earned.
  if (delivered_ - acked_sent_ >= std::max<uint64_t>(1, opts_.window_bytes / 4) ||
      (idle && delivered_ > acked_sent_)) {
    FlushLocked(true);
  }
}

void Bridge::FlushLocked(bool force_ack) {
  bool sent = false;
  while (!pending_.empty()) {
    const uint64_t can = std::min<uint64_t>(out_credit_.Available(), kMaxFrameData);
    if (can == 0) break;
    const size_t n = std::min<size_t>(pending_.size(), can);
    std::string chunk = pending_.substr(0, n);
    pending_.erase(0, n);
    out_credit_.sent += n;
    SendLocked(std::move(chunk));
    sent = true;
  }
  if (!sent && force_ack) SendLocked("");
}

void Bridge::SendLocked(std::string data, std::optional<EndReason> close) {
  v1::ConsoleFrame f;
  f.set_seq(next_seq_++);
  *f.mutable_data() = std::move(data);
  f.set_acked(delivered_);
  acked_sent_ = delivered_;
  f.set_close(close.has_value());
  if (close) f.set_close_reason(TextOf(*close).str());
  // A failed publish (connection down) loses the frame: the node sees a gap and ends the relay.
  (void)conn_->Publish(Subject("in"), f.SerializeAsString());
}

void Bridge::EndLocked(std::function<void(EndReason)>* notify) {
  ended_ = true;
  if (sub_ != nullptr) natsSubscription_Unsubscribe(sub_);
  if (notify != nullptr && cb_.on_end) *notify = cb_.on_end;
}

void Bridge::Close(EndReason reason) {
  std::lock_guard lock(mu_);
  if (ended_) return;
  SendLocked("", reason);
  EndLocked(nullptr);
}

uint64_t Bridge::BytesToClient() const {
  std::lock_guard lock(mu_);
  return received_;
}

uint64_t Bridge::BytesFromClient() const {
  std::lock_guard lock(mu_);
  return out_credit_.sent;
}

}  // namespace gpuaas::console_gw
