// gpuaasctl catalog [list]: the SKUs and images the scheduler sells.
#include <iostream>

#include <fmt/format.h>

#include "ctl.hpp"
#include "gpuaas/v1/scheduler.pb.h"

namespace gpuaas::ctl {

namespace {

std::string Runtime(const v1::CatalogSku& s) {
  if (!s.has_runtime_profile()) return "-";
  const auto& p = s.runtime_profile();
  return fmt::format("{} vCPU, {} MiB per GPU", p.vcpus_per_gpu(), p.memory_mib_per_gpu());
}

std::string NetworkModes(const v1::CatalogSku& s) {
  std::vector<std::string> modes;
  for (int m : s.network_modes()) {
    modes.push_back(Txt(static_cast<v1::NetworkMode>(m), std::to_string(m)));
  }
  // The first is the default.
  if (!modes.empty()) modes.front() += " (default)";
  return modes.empty() ? "-" : Join(modes, ", ");
}

void PrintCatalog(const v1::ListCatalogResponse& c) {
  std::vector<std::vector<std::string>> skus;
  for (const auto& s : c.skus()) {
    std::vector<std::string> counts;
    for (int n : s.allowed_gpu_counts()) counts.push_back(std::to_string(n));
    std::string orderable = s.orderable() ? "yes" : "no";
    if (!s.sharing_mechanism().empty()) orderable += " (" + s.sharing_mechanism() + ")";
    skus.push_back({s.name(), Txt(s.shape()), Or(s.gpu_sku()), counts.empty() ? "-" : Join(counts),
                    Txt(s.fabric_type(), "any"), NetworkModes(s), Runtime(s),
                    Txt(s.billable_unit(), "gpu_second"), orderable});
  }
  PrintTable({"SKU", "SHAPE", "GPU SKU", "GPUS", "FABRIC", "NETWORK MODES", "RUNTIME", "BILLED BY",
              "ORDERABLE"},
             skus);
  std::vector<std::vector<std::string>> images;
  for (const auto& i : c.images()) {
    images.push_back(
        {i.name(), Or(i.sha256().substr(0, 12)), i.url(), i.is_default() ? "yes" : ""});
  }
  std::cout << "\n";
  PrintTable({"IMAGE", "SHA256", "URL", "DEFAULT"}, images);
}

}  // namespace

Action AddCatalogCommands(CLI::App& app) {
  auto* catalog = app.add_subcommand("catalog", "What a tenant may order: SKUs and images");
  catalog->require_subcommand(0, 1);
  catalog->add_subcommand("list", "The SKUs and images (the same as `catalog`)");

  return [=](rpc::Client& client, const Globals& g) -> std::optional<int> {
    if (!catalog->parsed()) return std::nullopt;
    auto r = client.Call<v1::ListCatalogResponse>("gpuaas.v1.scheduler.catalog.list",
                                                  v1::ListCatalogRequest(), g.Timeout());
    if (!r.ok()) return Fail(g, r.error());
    return Print(g, *r, [&] { PrintCatalog(*r); });
  };
}

}  // namespace gpuaas::ctl
