#include "gpuaas/common/revocations.hpp"

#include <google/protobuf/util/time_util.h>
#include <nats/nats.h>

#include <algorithm>

#include <fmt/format.h>

#include "gpuaas/common/contract.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/reasons.hpp"
#include "gpuaas/v1/console.pb.h"
#include "gpuaas/v1/event.pb.h"

namespace gpuaas::revocation {

using google::protobuf::util::TimeUtil;

namespace {
List::Clock::time_point At(const google::protobuf::Timestamp& t) {
  return List::Clock::time_point(std::chrono::microseconds(TimeUtil::TimestampToMicroseconds(t)));
}
}  // namespace

void List::Apply(const v1::TokenRevocation& r, Clock::time_point now) {
  std::lock_guard lock(mu_);
  Forget(now);
  const auto expires = At(r.expires_at());
  if (expires <= now) return;
  if (!r.jti().empty()) {
    auto& e = tokens_[r.jti()];
    e = std::max(e, expires);
  }
  if (!r.subject().empty()) {
    auto [it, fresh] = subjects_.try_emplace(r.subject(), Subject{At(r.revoked_at()), expires});
    if (!fresh) {
      // The latest revocation of a principal covers every earlier one.
      it->second.revoked_at = std::max(it->second.revoked_at, At(r.revoked_at()));
      it->second.expires_at = std::max(it->second.expires_at, expires);
    }
  }
}

void List::Forget(Clock::time_point now) {
  for (auto it = tokens_.begin(); it != tokens_.end();) {
    it = it->second <= now ? tokens_.erase(it) : std::next(it);
  }
  for (auto it = subjects_.begin(); it != subjects_.end();) {
    it = it->second.expires_at <= now ? subjects_.erase(it) : std::next(it);
  }
}

Result<void> List::Check(const auth::Principal& p) const {
  std::lock_guard lock(mu_);
  if (tokens_.count(p.token_id) > 0) {
    return Error::Of(Code::kUnauthenticated, reason::kTokenRevoked,
                     "token " + p.token_id + " of " + p.subject + " is revoked",
                     {{"jti", p.token_id}}, false);
  }
  auto it = subjects_.find(p.subject);
  if (it != subjects_.end() && p.issued <= it->second.revoked_at) {
    return Error::Of(Code::kUnauthenticated, reason::kTokenRevoked,
                     "the tokens of " + p.subject + " issued until its revocation are revoked",
                     {{"sub", p.subject}}, false);
  }
  return Ok();
}

size_t List::Size() const {
  std::lock_guard lock(mu_);
  return tokens_.size() + subjects_.size();
}

struct Follower::Impl {
  std::shared_ptr<messaging::Connection> conn;
  std::shared_ptr<List> list;
  log::Logger log;
  natsSubscription* sub = nullptr;

  // One stored or live message: an Event whose data is a TokenRevocation. Anything else is
  // logged and skipped (it cannot revoke anything).
  void Take(const char* data, int len, const char* from) {
    v1::Event ev;
    v1::TokenRevocation r;
    if (!ev.ParseFromArray(data, len) || !ev.data().UnpackTo(&r)) {
      log.Warn("token revocation does not parse; skipped", {{"from", from}});
      return;
    }
    list->Apply(r);
  }

  static void OnMsg(natsConnection*, natsSubscription*, natsMsg* m, void* closure) {
    auto* self = static_cast<Impl*>(closure);
    self->Take(natsMsg_GetData(m), natsMsg_GetDataLength(m), "live");
    natsMsg_Destroy(m);
  }

  // Every stored revocation, first to last (gaps are messages aged out).
  Result<void> ReadStored() {
    const auto spec = messaging::AuthEventsStream();
    jsStreamInfo* si = nullptr;
    jsErrCode jerr = static_cast<jsErrCode>(0);
    natsStatus s = js_GetStreamInfo(&si, conn->js(), spec.name.c_str(), nullptr, &jerr);
    if (s != NATS_OK) return messaging::NatsError(s, "stream info " + spec.name);
    const uint64_t first = std::max<uint64_t>(si->State.FirstSeq, 1);
    const uint64_t last = si->State.LastSeq;
    const bool empty = si->State.Msgs == 0;
    jsStreamInfo_Destroy(si);
    for (uint64_t seq = first; !empty && seq <= last; ++seq) {
      natsMsg* m = nullptr;
      s = js_GetMsg(&m, conn->js(), spec.name.c_str(), seq, nullptr, &jerr);
      if (s == NATS_NOT_FOUND || jerr == JSNoMessageFoundErr) continue;
      if (s != NATS_OK) return messaging::NatsError(s, fmt::format("get {} {}", spec.name, seq));
      Take(natsMsg_GetData(m), natsMsg_GetDataLength(m), "stream");
      natsMsg_Destroy(m);
    }
    return Ok();
  }
};

Result<std::unique_ptr<Follower>> Follower::Start(std::shared_ptr<messaging::Connection> conn,
                                                  std::shared_ptr<List> list, log::Logger log) {
  std::unique_ptr<Follower> f(new Follower());
  f->impl_ = std::make_unique<Impl>();
  auto& i = *f->impl_;
  i.conn = std::move(conn);
  i.list = std::move(list);
  i.log = std::move(log);
  // Live first, then what is stored: a revocation published in between is seen at least once.
  natsStatus s =
      natsConnection_Subscribe(&i.sub, i.conn->raw(), kSubject, &Impl::OnMsg, f->impl_.get());
  if (s != NATS_OK) return messaging::NatsError(s, std::string("subscribe ") + kSubject);
  natsSubscription_SetPendingLimits(i.sub, -1, -1);
  i.conn->contract().Record(
      {contract::Role::kConsume, kSubject, "gpuaas.v1.Event", "", "token revocations", 1});
  if (auto p = i.conn->CheckPermitted(kSubject, std::chrono::seconds(5)); !p.ok()) {
    return p.error();
  }
  if (auto r = i.ReadStored(); !r.ok()) return r.error();
  i.log.Info("token revocations followed", {{"in_force", std::to_string(i.list->Size())}});
  return f;
}

Follower::~Follower() {
  if (impl_ && impl_->sub) {
    // Drained: no callback is running on impl_ once it returns.
    natsSubscription_Drain(impl_->sub);
    natsSubscription_WaitForDrainCompletion(impl_->sub, 2000);
    natsSubscription_Destroy(impl_->sub);
  }
}

}  // namespace gpuaas::revocation
