#!/bin/bash
# vm-e2e.sh BUILD_DIR - the node agent's libvirt runtime against a real VM (TCG, no KVM needed):
# builds the test guest, makes a network namespace with bridge + dnsmasq (one reservation), starts
# virtlogd and libvirtd inside it, then runs VmE2eTest (node_agent_vm_test) in that namespace:
# provision (image onto a loop device, seed, UEFI domain, DHCP lease, SSH banner) -> SSH into the
# guest -> graceful release with NVRAM undefine -> cleanup with wipe proof. Root only; the EXIT
# trap stops what this script started (by PID) and deletes the namespace. Nothing touches the
# host's own network. Exit 77 = skipped (not root, or a libvirtd is already running).
# Env: WORK (default BUILD_DIR/vm-e2e), NETNS (gpuaas-vme2e), BR (gpuaasbr0),
#      MAC (52:54:00:a0:00:01), IP (10.100.0.10), SKIP_GUEST_BUILD=1
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR" >&2; exit 2; }
BUILD=$(cd "$1" && pwd); TEST=$BUILD/services/node-agent/node_agent_vm_test
WORK=${WORK:-$BUILD/vm-e2e}; NETNS=${NETNS:-gpuaas-vme2e}; BR=${BR:-gpuaasbr0}
GW=10.100.0.1; MAC=${MAC:-52:54:00:a0:00:01}; IP=${IP:-10.100.0.10}
NS="ip netns exec $NETNS"
[ "$(id -u)" = 0 ] || { echo "vm-e2e: needs root (skipped)"; exit 77; }
[ -x "$TEST" ] || { echo "vm-e2e: build node_agent_vm_test first ($TEST)" >&2; exit 2; }
for p in /run/libvirtd.pid /run/virtqemud.pid; do
  if [ -f "$p" ] && kill -0 "$(cat "$p")" 2>/dev/null; then
    echo "vm-e2e: a libvirt daemon is already running ($p); skipped"; exit 77
  fi
done
T0=$(date +%s.%N); TL=$T0
step() { local now; now=$(date +%s.%N); printf '[%6.1fs +%5.1fs] %s\n' "$(echo "$now-$T0" | bc)" "$(echo "$now-$TL" | bc)" "$*"; TL=$now; }
LIBVIRTD_PID=; VIRTLOGD_PID=; DNSMASQ_PID=; NS_UP=
cleanup() {
  local rc=$?
  set +e
  [ -n "$LIBVIRTD_PID" ] && kill "$LIBVIRTD_PID" 2>/dev/null
  [ -n "$VIRTLOGD_PID" ] && kill "$VIRTLOGD_PID" 2>/dev/null
  [ -n "$DNSMASQ_PID" ] && kill "$DNSMASQ_PID" 2>/dev/null
  [ -n "$NS_UP" ] && ip netns del "$NETNS" 2>/dev/null
  [ "$rc" = 0 ] && echo "VM E2E PASS ($(echo "$(date +%s.%N)-$T0" | bc | cut -c1-5)s)" || echo "VM E2E FAIL rc=$rc (logs: $WORK)"
}
trap cleanup EXIT
mkdir -p "$WORK"; rm -f "$WORK"/dnsmasq.* "$WORK"/libvirtd.log

[ "${SKIP_GUEST_BUILD:-0}" = 1 ] || "$HERE/build-guest.sh" "$WORK/guest" >/dev/null
step "guest ready ($WORK/guest)"

ip netns add "$NETNS"; NS_UP=1
$NS ip link set lo up
$NS ip link add "$BR" type bridge stp_state 0 forward_delay 0
$NS ip addr add "$GW/24" dev "$BR"
$NS ip link set "$BR" up
: > "$WORK/dnsmasq.leases"
$NS dnsmasq --conf-file=/dev/null --pid-file="$WORK/dnsmasq.pid" --interface="$BR" \
  --bind-interfaces --except-interface=lo --port=0 --dhcp-range="${GW%.*}.100,${GW%.*}.200,255.255.255.0,1h" \
  --dhcp-authoritative --dhcp-host="$MAC,$IP" --dhcp-leasefile="$WORK/dnsmasq.leases" \
  --log-dhcp --log-facility="$WORK/dnsmasq.log"
DNSMASQ_PID=$(cat "$WORK/dnsmasq.pid")
step "netns $NETNS: bridge $BR $GW/24, dnsmasq $DNSMASQ_PID ($MAC -> $IP)"

# libvirt daemons without systemd, inside the netns (the VM's tap lands on the bridge there)
$NS /usr/sbin/virtlogd -d; sleep 0.2; VIRTLOGD_PID=$(cat /run/virtlogd.pid)
$NS env LIBVIRT_LOG_OUTPUTS="3:file:$WORK/libvirtd.log" /usr/sbin/libvirtd -d
for i in $(seq 1 100); do [ -f /run/libvirtd.pid ] && break; sleep 0.1; done
LIBVIRTD_PID=$(cat /run/libvirtd.pid)
for i in $(seq 1 300); do [ -S /run/libvirt/libvirt-sock ] && break; sleep 0.1; done
step "libvirtd $LIBVIRTD_PID + virtlogd $VIRTLOGD_PID up"

$NS env GPUAAS_VM_E2E_GUEST="$WORK/guest" GPUAAS_VM_E2E_LEASES="$WORK/dnsmasq.leases" \
  GPUAAS_VM_E2E_BRIDGE="$BR" GPUAAS_VM_E2E_MAC="$MAC" GPUAAS_VM_E2E_IP="$IP" \
  "$TEST" --gtest_filter='VmE2eTest.*' --gtest_brief=0
step "VmE2eTest done"
