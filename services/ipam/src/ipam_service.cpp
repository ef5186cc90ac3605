#include "ipam_service.hpp"

#include <google/protobuf/util/time_util.h>

#include <fmt/format.h>

#include "gpuaas/common/ids.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/ipam.pb.h"

namespace gpuaas::ipam {

void IpamConfig::Register(config::Schema& s) {
  common.Register(s, true);
  s.Add("ipam.default_subnet", &default_subnet,
        "Management subnet given to a node on its first reservation (node-local, NAT egress)",
        "10.100.0.0/24", config::NonEmpty());
  s.Add("ipam.first_host", &first_host, "First host offset handed to slots (gateway is .1)", 10,
        config::Range(2, 65000));
  s.Add("ipam.last_host", &last_host, "Last host offset handed to slots", 250,
        config::Range(2, 65000));
}

std::string DeterministicMac(const std::string& node_id, const std::string& slot_key, int attempt) {
  uint64_t h = 1469598103934665603ULL;
  for (char c : fmt::format("{}/{}#{}", node_id, slot_key, attempt)) {
    h ^= static_cast<unsigned char>(c);
    h *= 1099511628211ULL;
  }
  return fmt::format("52:54:00:{:02x}:{:02x}:{:02x}", (h >> 16) & 0xff, (h >> 8) & 0xff, h & 0xff);
}

namespace {

constexpr const char* kColumns =
    "r.node_id, r.slot_key, r.mac::text, host(r.ip), s.subnet::text, host(s.gateway), "
    "(extract(epoch from r.created_at) * 1000)::int8, r.generation";

v1::SlotReservation FromRow(const pqxx::row& r) {
  v1::SlotReservation out;
  out.set_node_id(r[0].as<std::string>());
  out.set_slot_key(r[1].as<std::string>());
  out.set_mac(r[2].as<std::string>());
  out.set_ip(r[3].as<std::string>());
  out.set_subnet(r[4].as<std::string>());
  out.set_gateway(r[5].as<std::string>());
  *out.mutable_created_at() =
      google::protobuf::util::TimeUtil::MillisecondsToTimestamp(r[6].as<int64_t>());
  out.set_generation(r[7].as<int64_t>());
  return out;
}

Result<void> ValidateKeys(const std::string& node_id, const std::string& slot_key) {
  std::map<std::string, std::string> problems;
  if (!ids::IsNodeId(node_id)) problems["node_id"] = "must be a lowercase DNS label";
  if (slot_key.empty() || slot_key.size() > 128) problems["slot_key"] = "required, at most 128";
  if (!problems.empty()) {
    return Error::InvalidArgument("invalid_reservation_request", "invalid field(s)", problems);
  }
  return Ok();
}

}  // namespace

IpamService::IpamService(IpamConfig cfg)
    : cfg_(std::move(cfg)), svc_(runtime::Component{"ipam", &Migrations()}, cfg_.common) {}

Result<void> IpamService::Start() {
  if (cfg_.first_host > cfg_.last_host) {
    return Error::InvalidArgument("invalid_config", "ipam.first_host must be <= ipam.last_host");
  }
  if (auto r = svc_.Start(); !r.ok()) return r;
  for (const auto& spec : {messaging::IpamEventsStream(), messaging::DeadLetterStream()}) {
    if (auto r = messaging::EnsureStream(*svc_.nats(), spec); !r.ok()) return r;
  }
  svc_.StartOutboxRelay();
  auto pool = svc_.pg();
  const std::string source = svc_.source();
  const IpamConfig cfg = cfg_;

  svc_.Rpc().Handle<v1::ReserveSlotAddressRequest, v1::ReserveSlotAddressResponse>(
      "gpuaas.v1.ipam.reservation.reserve",
      [pool, source, cfg](const v1::ReserveSlotAddressRequest& req,
                          rpc::Context& ctx) -> Result<v1::ReserveSlotAddressResponse> {
        if (auto v = ValidateKeys(req.node_id(), req.slot_key()); !v.ok()) return v.error();
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::ReserveSlotAddressResponse> {
          v1::ReserveSlotAddressResponse resp;
          const std::string find = fmt::format(
              "SELECT {} FROM slot_reservations r JOIN node_subnets s USING (node_id) "
              "WHERE r.node_id = $1 AND r.slot_key = $2",
              kColumns);
          auto existing = tx.exec_params(find, req.node_id(), req.slot_key());
          if (!existing.empty()) {
            *resp.mutable_reservation() = FromRow(existing[0]);
            return resp;
          }
          tx.exec_params(
              "INSERT INTO node_subnets (node_id, subnet, gateway) "
              "VALUES ($1, network($2::cidr), network($2::cidr)::inet + 1) "
              "ON CONFLICT (node_id) DO NOTHING",
              req.node_id(), cfg.default_subnet);
          // One reservation at a time per node: the subnet row is the lock.
          tx.exec_params("SELECT 1 FROM node_subnets WHERE node_id = $1 FOR UPDATE", req.node_id());
          // A concurrent first reservation of the same slot may have committed while we waited.
          existing = tx.exec_params(find, req.node_id(), req.slot_key());
          if (!existing.empty()) {
            *resp.mutable_reservation() = FromRow(existing[0]);
            return resp;
          }
          auto ip = tx.exec_params(
              "SELECT host(network(s.subnet)::inet + o) FROM node_subnets s, "
              "generate_series($2::int, $3::int) o WHERE s.node_id = $1 "
              "AND set_masklen(network(s.subnet)::inet + o, 32) << s.subnet "
              "AND host(network(s.subnet)::inet + o) <> host(broadcast(s.subnet)) "
              "AND host(network(s.subnet)::inet + o) <> host(s.gateway) AND NOT EXISTS (SELECT 1 "
              "FROM "
              "slot_reservations r WHERE r.node_id = $1 AND host(r.ip) = "
              "host(network(s.subnet)::inet + o)) ORDER BY o LIMIT 1",
              req.node_id(), cfg.first_host, cfg.last_host);
          if (ip.empty()) {
            return Error{Code::kResourceExhausted,
                         "subnet_exhausted",
                         "no free slot address left in the node's management subnet",
                         {{"node_id", req.node_id()}},
                         false};
          }
          std::string mac;
          for (int attempt = 0; attempt < 64 && mac.empty(); ++attempt) {
            auto candidate = DeterministicMac(req.node_id(), req.slot_key(), attempt);
            if (tx.exec_params("SELECT 1 FROM slot_reservations WHERE mac = $1::macaddr", candidate)
                    .empty()) {
              mac = candidate;
            }
          }
          if (mac.empty()) return Error::Internal("mac_exhausted", "no free MAC after 64 tries");
          tx.exec_params(
              "INSERT INTO slot_reservations (node_id, slot_key, mac, ip) "
              "VALUES ($1, $2, $3::macaddr, $4::inet)",
              req.node_id(), req.slot_key(), mac, ip[0][0].as<std::string>());
          *resp.mutable_reservation() =
              FromRow(tx.exec_params(find, req.node_id(), req.slot_key()).at(0));
          resp.set_created(true);
          v1::ReservationSnapshot snap;
          *snap.mutable_reservation() = resp.reservation();
          auto ev = outbox::Append(
              tx, {"gpuaas.v1.evt.ipam.reservation.created", "", source,
                   req.node_id() + "/" + req.slot_key(), 1, req.node_id(), ctx.traceparent, &snap});
          if (!ev.ok()) return ev.error();
          ctx.log.Info("slot address reserved", {{"node_id", req.node_id()},
                                                 {"slot_key", req.slot_key()},
                                                 {"mac", mac},
                                                 {"ip", resp.reservation().ip()}});
          return resp;
        });
      });

  svc_.Rpc().Handle<v1::ListReservationsRequest, v1::ListReservationsResponse>(
      "gpuaas.v1.ipam.reservation.list",
      [pool](const v1::ListReservationsRequest& req,
             rpc::Context&) -> Result<v1::ListReservationsResponse> {
        if (!req.node_id().empty() && !ids::IsNodeId(req.node_id())) {
          return Error::InvalidArgument("invalid_node_id", "node_id must be a lowercase DNS label",
                                        {{"node_id", "must be a lowercase DNS label"}});
        }
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::ListReservationsResponse> {
          v1::ListReservationsResponse resp;
          auto rows = tx.exec_params(
              fmt::format("SELECT {} FROM slot_reservations r JOIN node_subnets s USING (node_id) "
                          "WHERE ($1 = '' OR r.node_id = $1) ORDER BY r.node_id, r.ip",
                          kColumns),
              req.node_id());
          for (const auto& r : rows) *resp.add_reservations() = FromRow(r);
          return resp;
        });
      });
  return svc_.ServeRequests();
}

}  // namespace gpuaas::ipam
