#pragma once
// Shared pieces of gpuaasctl: global flags, structured error output, tables, JSON, paging, and
// the registry of command groups (each group adds its subcommands and returns the action that
// runs when one of them was parsed).
#include <google/protobuf/message.h>
#include <google/protobuf/timestamp.pb.h>

#include <chrono>
#include <functional>
#include <optional>
#include <string>
#include <vector>

#include <CLI/CLI.hpp>

#include "gpuaas/common/result.hpp"
#include "gpuaas/common/rpc.hpp"

namespace gpuaas::ctl {

struct Globals {
  std::string nats_url;
  std::string output = "table";
  int64_t timeout_ms = 10000;
};

// Prints a structured error (JSON with -o json) and returns the exit code 1.
int Fail(const Globals& g, const Error& e);
std::string ToJson(const google::protobuf::Message& m);
void PrintTable(const std::vector<std::string>& header,
                const std::vector<std::vector<std::string>>& rows);
std::string Time(const google::protobuf::Timestamp& t);
std::string Join(const std::vector<std::string>& items, const std::string& sep = ",");

// Calls a paginated list subject until the last page; `add` takes each page.
template <typename Resp, typename Req>
Result<void> ListAll(rpc::Client& client, const std::string& subject, Req req,
                     std::chrono::milliseconds timeout, const std::function<void(Resp&)>& add) {
  req.set_page_size(500);
  do {
    auto r = client.Call<Resp>(subject, req, timeout);
    if (!r.ok()) return r.error();
    add(*r);
    req.set_page_token(r->next_page_token());
  } while (!req.page_token().empty());
  return Ok();
}

// Runs the parsed subcommand of a group, or nullopt when none of the group's was parsed.
using Action = std::function<std::optional<int>(rpc::Client&, const Globals&)>;

// Inventory slot/topology/region commands (inventory_commands.cpp).
Action AddInventoryCommands(CLI::App& app, CLI::App* node);
// ipam reservations/leases/drift/network/subnet/release/reprovision (ipam_commands.cpp).
Action AddIpamCommands(CLI::App& app);
// Allocation commands (alloc_commands.cpp).
Action AddAllocCommands(CLI::App& app);

// Prints `m` as JSON when -o json; else runs `table`. Returns 0.
int Print(const Globals& g, const google::protobuf::Message& m, const std::function<void()>& table);

}  // namespace gpuaas::ctl
