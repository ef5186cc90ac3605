#!/bin/bash
# node-agent-bench.sh BUILD_DIR [ROUNDS] - P6 (see bench/node_agent_bench.cpp): the test guest,
# a network namespace with the slice bridge and virtlogd + libvirtd inside it, then the bench.
# Root only; exit 77 = skipped. Env: WORK (default BUILD_DIR/node-agent-bench), NETNS
# (gpuaas-p6), SKIP_GUEST_BUILD=1.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR [ROUNDS]" >&2; exit 2; }
BUILD=$(cd "$1" && pwd); BENCH=$BUILD/bench/node_agent_bench
WORK=${WORK:-$BUILD/node-agent-bench}; NETNS=${NETNS:-gpuaas-p6}; BR=ovsbr0
source "$HERE/lib.sh"
e2e_require_root node-agent-bench
[ -x "$BENCH" ] || { echo "node-agent-bench: build $BENCH first" >&2; exit 2; }
mkdir -p "$WORK"
GUEST=${GUEST:-$BUILD/e2e-guest}  # shared by the e2e scripts and the bench
e2e_guest "$GUEST"
e2e_netns "$NETNS"
ip netns exec "$NETNS" ip link add "$BR" type bridge stp_state 0 forward_delay 0
ip netns exec "$NETNS" ip link set "$BR" up
e2e_libvirtd "$NETNS" "$WORK"
e2e_step "guest, netns $NETNS with bridge $BR, libvirtd $E2E_LIBVIRTD_PID"
GPUAAS_BENCH_GUEST="$GUEST" GPUAAS_BENCH_WORK="$WORK/run" GPUAAS_BENCH_BRIDGE="$BR" \
  "$BENCH" "${2:-5}"
