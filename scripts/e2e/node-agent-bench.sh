#!/bin/bash
# node-agent-bench.sh BUILD_DIR [ROUNDS] - P6 and P6b (see bench/node_agent_bench.cpp): the test
# guest, a 1 GiB image of random bytes (WORK/image-1g.raw, made once and kept: the guest boots
# its kernel directly, so what the disk holds does not matter, only how many bytes move), a
# network namespace with the slice bridge and virtlogd + libvirtd inside it, then the bench
# (16 MiB and 1 GiB provisions, then four 1 GiB provisions at once, each against dd + virsh
# start). Root only; exit 77 = skipped. Needs ~7 GB free in WORK (image, the agent's cached
# copy, four 1100 MiB loop backing files). Env: WORK (default BUILD_DIR/node-agent-bench), NETNS
# (gpuaas-p6), SKIP_GUEST_BUILD=1.
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR [ROUNDS]" >&2; exit 2; }
BUILD=$(cd "$1" && pwd); BENCH=$BUILD/bench/node_agent_bench
WORK=${WORK:-$BUILD/node-agent-bench}; NETNS=${NETNS:-gpuaas-p6}; BR=ovsbr0
source "$HERE/lib.sh"
e2e_require_root node-agent-bench
[ -x "$BENCH" ] || { echo "node-agent-bench: build $BENCH first" >&2; exit 2; }
mkdir -p "$WORK/run"
WORK=$(cd "$WORK" && pwd)
GUEST=${GUEST:-$BUILD/e2e-guest}  # shared by the e2e scripts and the bench
e2e_guest "$GUEST"
IMAGE_1G=$WORK/image-1g.raw
if [ "$(stat -c %s "$IMAGE_1G" 2>/dev/null || true)" != 1073741824 ]; then
  head -c 1G /dev/urandom >"$IMAGE_1G.tmp" && mv "$IMAGE_1G.tmp" "$IMAGE_1G"
  e2e_step "wrote $IMAGE_1G (1 GiB of random bytes)"
fi
e2e_netns "$NETNS"
ip netns exec "$NETNS" ip link add "$BR" type bridge stp_state 0 forward_delay 0
ip netns exec "$NETNS" ip link set "$BR" up
e2e_libvirtd "$NETNS" "$WORK"
# The bench detaches its loop devices; one killed half-way leaves them attached to WORK/run
# (after the test's domains are gone: registered after e2e_libvirtd's own exit step).
# shellcheck disable=SC2016 # expanded when it runs
e2e_on_exit 'for f in "$WORK"/run/slot-nvme-*.raw; do
  for l in $(losetup -j "$f" -O NAME -n 2>/dev/null); do losetup -d "$l"; done; done'
e2e_step "guest, netns $NETNS with bridge $BR, libvirtd $E2E_LIBVIRTD_PID"
GPUAAS_BENCH_GUEST="$GUEST" GPUAAS_BENCH_WORK="$WORK/run" GPUAAS_BENCH_BRIDGE="$BR" \
  GPUAAS_BENCH_IMAGE_1G="$IMAGE_1G" "$BENCH" "${2:-5}"
