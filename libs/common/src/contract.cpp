#include "gpuaas/common/contract.hpp"

#include <nlohmann/json.hpp>

#include "gpuaas/common/reasons.hpp"
#include "gpuaas/v1/event.pb.h"

namespace gpuaas::contract {

namespace {
constexpr const char* kTypeUrlPrefix = "type.googleapis.com/";

// The packed type of a gpuaas.v1.Event, or "" when `payload` is not one. An Event is told by
// what MakeEvent always sets; a payload of another type that happens to parse lacks them.
std::string EventDataType(const std::string& payload) {
  v1::Event ev;
  if (!ev.ParseFromString(payload) || ev.specversion() != "1.0" || ev.id().empty()) return "";
  const std::string& url = ev.data().type_url();
  const std::string prefix = kTypeUrlPrefix;
  if (url.rfind(prefix, 0) != 0 || url.size() == prefix.size()) return "";
  return url.substr(prefix.size());
}
}  // namespace

const char* RoleName(Role role) {
  switch (role) {
    case Role::kServe:
      return "serve";
    case Role::kConsume:
      return "consume";
    case Role::kPublish:
      return "publish";
    case Role::kRequest:
      return "request";
  }
  return "unknown";
}

Result<Role> ParseRole(const std::string& name) {
  for (Role r : {Role::kServe, Role::kConsume, Role::kPublish, Role::kRequest}) {
    if (name == RoleName(r)) return r;
  }
  return Error::InvalidArgument(reason::kUnknownRole, "not a contract role: '" + name + "'");
}

void Registry::Record(Entry e) {
  std::lock_guard lock(mu_);
  auto key = std::make_pair(e.role, e.subject);
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    if (entries_.size() >= max_entries_) {
      ++dropped_;
      return;
    }
    entries_.emplace(std::move(key), Slot{std::move(e), false});
    return;
  }
  Entry& have = it->second.entry;
  if (have.type.empty()) have.type = std::move(e.type);
  if (have.inner_type.empty()) have.inner_type = std::move(e.inner_type);
  if (have.via.empty()) have.via = std::move(e.via);
  have.count += e.count;
}

void Registry::RecordPublish(const std::string& subject, const std::string& payload,
                             const char* via) {
  std::lock_guard lock(mu_);
  auto key = std::make_pair(Role::kPublish, subject);
  auto it = entries_.find(key);
  if (it == entries_.end()) {
    if (entries_.size() >= max_entries_) {
      ++dropped_;
      return;
    }
    it = entries_.emplace(std::move(key), Slot{Entry{Role::kPublish, subject, "", "", via, 0}})
             .first;
  }
  Slot& slot = it->second;
  slot.entry.count++;
  // Once per subject: a publisher sends one type per subject, and parsing every message would
  // cost the hot path.
  if (slot.looked_at_payload || !slot.entry.type.empty()) return;
  slot.looked_at_payload = true;
  if (auto data = EventDataType(payload); !data.empty()) {
    slot.entry.type = v1::Event::descriptor()->full_name();
    if (slot.entry.inner_type.empty()) slot.entry.inner_type = std::move(data);
  }
}

std::vector<Entry> Registry::Snapshot() const {
  std::lock_guard lock(mu_);
  std::vector<Entry> out;
  out.reserve(entries_.size());
  for (const auto& [key, slot] : entries_) out.push_back(slot.entry);
  return out;
}

uint64_t Registry::Dropped() const {
  std::lock_guard lock(mu_);
  return dropped_;
}

std::string ToJson(const Registry& registry, const std::string& service,
                   const std::string& instance) {
  nlohmann::json entries = nlohmann::json::array();
  for (const auto& e : registry.Snapshot()) {
    entries.push_back({{"role", RoleName(e.role)},
                       {"subject", e.subject},
                       {"type", e.type},
                       {"inner_type", e.inner_type},
                       {"via", e.via},
                       {"count", e.count}});
  }
  nlohmann::json doc = {{"service", service},
                        {"instance", instance},
                        {"dropped", registry.Dropped()},
                        {"entries", std::move(entries)}};
  return doc.dump(2);
}

Result<std::vector<Entry>> EntriesFromJson(const std::string& json) {
  try {
    const auto doc = nlohmann::json::parse(json);
    std::vector<Entry> out;
    for (const auto& j : doc.at("entries")) {
      auto role = ParseRole(j.at("role").get<std::string>());
      if (!role.ok()) return role.error();
      out.push_back(Entry{*role, j.at("subject").get<std::string>(),
                          j.at("type").get<std::string>(), j.at("inner_type").get<std::string>(),
                          j.at("via").get<std::string>(), j.at("count").get<uint64_t>()});
    }
    return out;
  } catch (const std::exception& e) {
    return Error::InvalidArgument(reason::kMalformedContract,
                                  std::string("contract JSON: ") + e.what());
  }
}

}  // namespace gpuaas::contract
