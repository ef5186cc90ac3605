#include "inventory_service.hpp"

#include <google/protobuf/util/time_util.h>

#include <regex>

#include "gpuaas/common/ids.hpp"

#include <fmt/format.h>
#include <nlohmann/json.hpp>

#include "gpuaas/common/enums.hpp"
#include "gpuaas/common/messaging.hpp"
#include "gpuaas/common/outbox.hpp"
#include "gpuaas/common/rpc.hpp"
#include "gpuaas/common/store.hpp"
#include "gpuaas/v1/inventory.pb.h"
#include "slots.hpp"

namespace gpuaas::inventory {

namespace {

const std::regex kLabel("^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$");
const std::regex kHostname("^[A-Za-z0-9]([A-Za-z0-9.-]{0,251}[A-Za-z0-9])?$");

std::string ProfileText(v1::CapacityProfile p) { return enums::Text(p); }
v1::CapacityProfile ProfileFromText(const std::string& s) {
  return enums::FromColumn<v1::CapacityProfile>(s);
}

google::protobuf::Timestamp Ts(const pqxx::field& f) {
  google::protobuf::Timestamp t;
  t.set_seconds(static_cast<int64_t>(f.as<double>()));
  t.set_nanos(static_cast<int32_t>((f.as<double>() - static_cast<double>(t.seconds())) * 1e9));
  return t;
}

constexpr const char* kNodeColumns =
    "node_id, hostname, region, pool, capacity_profile, labels::text, agent_version, generation, "
    "extract(epoch from registered_at)::float8, extract(epoch from updated_at)::float8";

v1::Node NodeFromRow(const pqxx::row& r) {
  v1::Node n;
  n.set_node_id(r[0].as<std::string>());
  n.set_hostname(r[1].as<std::string>());
  n.set_region(r[2].as<std::string>());
  n.set_pool(r[3].as<std::string>());
  n.set_capacity_profile(ProfileFromText(r[4].as<std::string>()));
  const auto labels = nlohmann::json::parse(r[5].as<std::string>());
  for (const auto& [k, v] : labels.items()) {
    (*n.mutable_labels())[k] = v.get<std::string>();
  }
  n.set_agent_version(r[6].as<std::string>());
  n.set_generation(r[7].as<int64_t>());
  *n.mutable_registered_at() = Ts(r[8]);
  *n.mutable_updated_at() = Ts(r[9]);
  return n;
}

std::string LabelsJson(const v1::RegisterNodeRequest& req) {
  nlohmann::json j = nlohmann::json::object();
  for (const auto& [k, v] : req.labels()) j[k] = v;
  return j.dump();
}

}  // namespace

bool ValidNodeId(const std::string& id) { return ids::IsNodeId(id); }

Result<void> ValidateRegister(const v1::RegisterNodeRequest& req) {
  std::map<std::string, std::string> problems;
  if (req.node_id().empty()) {
    problems["node_id"] = "required";
  } else if (!ValidNodeId(req.node_id())) {
    problems["node_id"] = "must be a lowercase DNS label (a-z, 0-9, '-', at most 63)";
  }
  if (req.hostname().empty()) {
    problems["hostname"] = "required";
  } else if (!std::regex_match(req.hostname(), kHostname)) {
    problems["hostname"] = "not a valid hostname";
  }
  for (const auto& [field, value] : {std::pair{"region", req.region()}, {"pool", req.pool()}}) {
    if (value.empty()) {
      problems[field] = "required";
    } else if (!std::regex_match(value, kLabel)) {
      problems[field] = "must be a lowercase DNS label";
    }
  }
  if (req.capacity_profile() == v1::CAPACITY_PROFILE_UNSPECIFIED) {
    problems["capacity_profile"] = "required: baremetal or slice-vm";
  } else if (!v1::CapacityProfile_IsValid(req.capacity_profile())) {
    problems["capacity_profile"] = "unknown value";
  }
  if (req.labels_size() > 64) problems["labels"] = "at most 64 labels";
  for (const auto& [k, v] : req.labels()) {
    if (k.empty() || k.size() > 63 || v.size() > 253) {
      problems["labels"] = "keys 1-63 characters, values at most 253";
    }
  }
  if (req.agent_version().size() > 64) problems["agent_version"] = "at most 64 characters";
  if (!problems.empty()) {
    return Error::InvalidArgument("invalid_node_registration",
                                  fmt::format("{} invalid field(s)", problems.size()), problems);
  }
  return Ok();
}

void InventoryConfig::Register(config::Schema& s) {
  common.Register(s, true);
  s.Add("inventory.ipam_timeout_ms", &ipam_timeout_ms,
        "Timeout of the MAC/IP reservation asked from ipam when a slot is approved", 5000,
        config::Range(1, 600000));
  s.Add("inventory.node_task_ack_wait_ms", &node_task_ack_wait_ms,
        "Ack wait of each node's task consumer, made when the node registers: a task not acked "
        "within this is redelivered (a running task is kept alive by its agent; after an agent "
        "crash it comes back within this)",
        30000, config::Range(1000, 3600000));
  s.Add("inventory.task_deadline_s", &task_deadline_s,
        "Deadline of typed tasks sent to node-agents (a task received later fails)", 300,
        config::Range(1, 86400));
}

InventoryService::InventoryService(InventoryConfig cfg)
    : cfg_(std::move(cfg)), svc_(runtime::Component{"inventory", &Migrations()}, cfg_.common) {}

Result<void> InventoryService::Start() {
  if (auto r = svc_.Start(); !r.ok()) return r;
  auto nats = svc_.nats();
  for (const auto& spec : {messaging::InventoryEventsStream(), messaging::DeadLetterStream()}) {
    if (auto r = messaging::EnsureStream(*nats, spec); !r.ok()) return r;
  }
  svc_.StartOutboxRelay();
  auto pool = svc_.pg();
  const std::string source = svc_.source();

  svc_.Rpc().Handle<v1::RegisterNodeRequest, v1::RegisterNodeResponse>(
      "gpuaas.v1.inventory.node.register",
      [pool, source, nats, ack_wait = cfg_.node_task_ack_wait_ms](
          const v1::RegisterNodeRequest& req,
          rpc::Context& ctx) -> Result<v1::RegisterNodeResponse> {
        if (auto v = ValidateRegister(req); !v.ok()) return v.error();
        const std::string labels = LabelsJson(req);
        const std::string profile = ProfileText(req.capacity_profile());
        // The node's task consumer: the node's own identity may only bind to it, so inventory
        // makes it (idempotent; an agent retries registration until this succeeds).
        if (auto c = messaging::EnsureConsumer(
                *nats, messaging::NodeTaskConsumerSpec(req.node_id(), ack_wait));
            !c.ok()) {
          return c.error();
        }
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::RegisterNodeResponse> {
          v1::RegisterNodeResponse resp;
          auto inserted = tx.exec_params(
              fmt::format(
                  "INSERT INTO nodes (node_id, hostname, region, pool, capacity_profile, "
                  "labels, agent_version, generation) VALUES ($1,$2,$3,$4,$5,$6::jsonb,$7,1) "
                  "ON CONFLICT (node_id) DO NOTHING RETURNING {}",
                  kNodeColumns),
              req.node_id(), req.hostname(), req.region(), req.pool(), profile, labels,
              req.agent_version());
          std::string subject;
          if (!inserted.empty()) {
            *resp.mutable_node() = NodeFromRow(inserted[0]);
            resp.set_created(true);
            resp.set_changed(true);
            subject = "gpuaas.v1.evt.inventory.node.registered";
          } else {
            // Same registration again: a no-op. Changed fields: a new generation and event.
            auto updated = tx.exec_params(
                fmt::format("UPDATE nodes SET hostname=$2, region=$3, pool=$4, "
                            "capacity_profile=$5, labels=$6::jsonb, agent_version=$7, "
                            "generation=generation+1, updated_at=now() WHERE node_id=$1 AND "
                            "(hostname, region, pool, capacity_profile, labels, agent_version) "
                            "IS DISTINCT FROM ($2, $3, $4, $5, $6::jsonb, $7) RETURNING {}",
                            kNodeColumns),
                req.node_id(), req.hostname(), req.region(), req.pool(), profile, labels,
                req.agent_version());
            if (updated.empty()) {
              auto cur =
                  tx.exec_params(fmt::format("SELECT {} FROM nodes WHERE node_id=$1", kNodeColumns),
                                 req.node_id());
              *resp.mutable_node() = NodeFromRow(cur.at(0));
              return resp;
            }
            *resp.mutable_node() = NodeFromRow(updated[0]);
            resp.set_changed(true);
            subject = "gpuaas.v1.evt.inventory.node.updated";
          }
          tx.exec_params("INSERT INTO regions (name) VALUES ($1) ON CONFLICT DO NOTHING",
                         req.region());
          if (!resp.created()) {
            // Slot snapshots carry region and pool: re-announce them with the node's change.
            if (auto r = ReemitNodeSlots(tx, req.node_id(), source, ctx.traceparent); !r.ok()) {
              return r.error();
            }
          }
          v1::NodeSnapshot snap;
          *snap.mutable_node() = resp.node();
          auto ev =
              outbox::Append(tx, {subject, "", source, req.node_id(), resp.node().generation(),
                                  req.node_id(), ctx.traceparent, &snap});
          if (!ev.ok()) return ev.error();
          ctx.log.Info(resp.created() ? "node registered" : "node updated",
                       {{"node_id", req.node_id()},
                        {"generation", std::to_string(resp.node().generation())},
                        {"event_id", *ev}});
          return resp;
        });
      });

  svc_.Rpc().Handle<v1::ListNodesRequest, v1::ListNodesResponse>(
      "gpuaas.v1.inventory.node.list",
      [pool](const v1::ListNodesRequest& req, rpc::Context&) -> Result<v1::ListNodesResponse> {
        auto page = rpc::PageLimit(req.page_size());
        if (!page.ok()) return page.error();
        const int limit = *page;
        return store::WithTx(*pool, [&](pqxx::work& tx) -> Result<v1::ListNodesResponse> {
          auto rows = tx.exec_params(
              fmt::format("SELECT {} FROM nodes WHERE ($1 = '' OR region = $1) AND "
                          "($2 = '' OR pool = $2) AND node_id > $3 ORDER BY node_id LIMIT $4",
                          kNodeColumns),
              req.region(), req.pool(), req.page_token(), limit + 1);
          v1::ListNodesResponse resp;
          for (size_t i = 0; i < rows.size() && static_cast<int>(i) < limit; ++i) {
            *resp.add_nodes() = NodeFromRow(rows[i]);
          }
          if (static_cast<int>(rows.size()) > limit) {
            resp.set_next_page_token(resp.nodes(limit - 1).node_id());
          }
          return resp;
        });
      });
  SlotDeps deps;
  deps.source = source;
  deps.ipam_timeout_ms = cfg_.ipam_timeout_ms;
  deps.task_deadline_s = cfg_.task_deadline_s;
  if (auto r = StartSlotDomain(svc_, deps); !r.ok()) return r;
  return svc_.ServeRequests();
}

}  // namespace gpuaas::inventory
