#!/bin/bash
# slice-e2e.sh BUILD_DIR - the slice lifecycle with a real VM through the real services
# (ctest label e2e, part of scripts/test). This script prepares what needs root and a host: the
# test guest (build-guest.sh), a network namespace with virtlogd + libvirtd inside it, and the
# node's public uplink: a veth pair, gpuaas-up0 203.0.113.10/24 in that namespace and eth0
# 203.0.113.2/24 in a client namespace (TEST-NET-3, only inside these two namespaces). Then
# slice_e2e_test runs in the host namespace: real NATS and PostgreSQL on loopback, ipam,
# inventory, the scheduler and ingress, and the node-agent binary as a child process
# (vm.runtime=libvirt, qemu:///system, TCG; network.apply=netns: the agent sets up the bridge,
# dnsmasq and NAT in the namespace from ipam's document; exposure.apply=netns: nftables DNAT from
# the uplink from ingress's document). A loop device stands in for the slot's NVMe. The flow goes
# through gpuaasctl: alloc create --expose ssh:22 -> placed -> provisioned -> lease + SSH ->
# endpoint applied -> active -> SSH from the client namespace through the public endpoint ->
# release -> exposure removed, port free -> wipe proof -> slot free; a mounted disk refused before
# any write; a guest that never gets a lease; the agent killed mid-provision and restarted; agent
# RSS over repeated cycles.
# Root only; exit 77 = skipped (not root, or a libvirt daemon already runs on this host).
# Env: WORK (default BUILD_DIR/slice-e2e), NETNS (gpuaas-slice-e2e; the client's: NETNS-client),
#      SKIP_GUEST_BUILD=1,
#      GTEST_FILTER (default SliceE2eTest.*)
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR" >&2; exit 2; }
BUILD=$(cd "$1" && pwd); TEST=$BUILD/tests/slice_e2e_test
WORK=${WORK:-$BUILD/slice-e2e}; NETNS=${NETNS:-gpuaas-slice-e2e}
source "$HERE/lib.sh"
e2e_require_root slice-e2e
for b in "$TEST" "$BUILD/services/node-agent/gpuaas-node-agent" "$BUILD/tools/gpuaasctl/gpuaasctl"; do
  [ -x "$b" ] || { echo "slice-e2e: build $b first" >&2; exit 2; }
done
mkdir -p "$WORK"; rm -rf "$WORK/run"; mkdir -p "$WORK/run"; rm -f "$WORK/libvirtd.log"
# dnsmasq is the agent's child and outlives it (a restarted agent takes it over): stop it by
# the agent's pid file.
e2e_on_exit 'for f in "$WORK"/run/*/net/dnsmasq.pid; do [ -f "$f" ] && kill "$(cat "$f")" 2>/dev/null; done; echo "logs: $WORK/run"'

GUEST=${GUEST:-$BUILD/e2e-guest}  # shared by the e2e scripts and the bench
e2e_guest "$GUEST"
e2e_step "guest ready ($GUEST)"
e2e_netns "$NETNS"
UPLINK=gpuaas-up0; PUBLIC_IP=203.0.113.10; CLIENT_NETNS=$NETNS-client; CLIENT_IP=203.0.113.2
e2e_client_netns "$NETNS" "$CLIENT_NETNS" "$UPLINK" "$PUBLIC_IP/24" "$CLIENT_IP/24"
e2e_step "uplink $UPLINK $PUBLIC_IP in $NETNS, client $CLIENT_IP in $CLIENT_NETNS"
e2e_libvirtd "$NETNS" "$WORK"
e2e_step "libvirtd $E2E_LIBVIRTD_PID + virtlogd $E2E_VIRTLOGD_PID up in netns $NETNS"

GPUAAS_E2E_GUEST="$GUEST" GPUAAS_E2E_NETNS="$NETNS" GPUAAS_E2E_WORK="$WORK/run" \
  GPUAAS_E2E_AGENT="$BUILD/services/node-agent/gpuaas-node-agent" \
  GPUAAS_E2E_CTL="$BUILD/tools/gpuaasctl/gpuaasctl" \
  GPUAAS_E2E_UPLINK="$UPLINK" GPUAAS_E2E_PUBLIC_IP="$PUBLIC_IP" \
  GPUAAS_E2E_CLIENT_NETNS="$CLIENT_NETNS" GPUAAS_E2E_CLIENT_IP="$CLIENT_IP" \
  "$TEST" --gtest_filter="${GTEST_FILTER:-SliceE2eTest.*}" --gtest_brief=0
e2e_step "slice_e2e_test done"
