// gpuaas-node-agent: runs on each GPU host.
#include "node_agent.hpp"

int main(int argc, char** argv) {
  using gpuaas::node_agent::NodeAgent;
  using gpuaas::node_agent::NodeAgentConfig;
  return gpuaas::runtime::Main<NodeAgent, NodeAgentConfig>(argc, argv, "node-agent");
}
