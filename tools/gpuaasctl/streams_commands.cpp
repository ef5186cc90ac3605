// gpuaasctl streams apply: declares the platform's JetStream streams (messaging::PlatformStreams)
// as the deploy identity (roles.yaml `deployer`, kind deploy): the one identity that may create
// or update a stream. Run once per deployment before the services start (scripts/up, the k8s
// streams Job); a service only looks up the streams it uses and waits until they exist.
#include <iostream>
#include <memory>

#include <fmt/format.h>
#include <fmt/ranges.h>

#include "ctl.hpp"
#include "gpuaas/common/messaging.hpp"

namespace gpuaas::ctl {

ConnAction AddStreamsCommands(CLI::App& app) {
  auto* streams = app.add_subcommand("streams", "The platform's JetStream streams");
  streams->require_subcommand(1);
  auto replicas = std::make_shared<int>(1);
  auto* apply = streams->add_subcommand(
      "apply",
      "Create or update every platform stream (as the deploy identity: --role deployer "
      "--nats-seed-file deployer.seed)");
  apply
      ->add_option("--replicas", *replicas,
                   "Copies of each stream: 1 on one server, 3 on a cluster")
      ->check(CLI::Range(1, 5))
      ->capture_default_str();
  return [=](messaging::Connection& conn, const Globals& g) -> std::optional<int> {
    if (!apply->parsed()) return std::nullopt;
    if (auto r = messaging::ApplyStreams(conn, *replicas); !r.ok()) return Fail(g, r.error());
    for (const auto& s : messaging::PlatformStreams()) {
      std::cout << fmt::format("{} [{}] replicas {}\n", s.name, fmt::join(s.subjects, ","),
                               *replicas);
    }
    return kExitOk;
  };
}

}  // namespace gpuaas::ctl
