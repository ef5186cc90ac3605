#!/bin/bash
# vm-e2e.sh BUILD_DIR - the node agent's libvirt runtime against a real VM (TCG, no KVM needed):
# builds the test guest, makes a network namespace with bridge + dnsmasq (one reservation), starts
# virtlogd and libvirtd inside it, then runs VmE2eTest (node_agent_vm_test) in that namespace:
# provision (image onto a loop device, seed, UEFI domain, DHCP lease, SSH banner) -> SSH into the
# guest -> graceful release with NVRAM undefine -> cleanup with wipe proof. Root only; the EXIT
# trap stops what this script started (by PID) and deletes the namespace. Nothing touches the
# host's own network. Exit 77 = skipped (not root, or a libvirtd is already running).
# DATAPATH=ovs (the default; the seeds' slice hosts run Open vSwitch) puts the VM on an OVS
# bridge: ovsdb-server + ovs-vswitchd (userspace datapath, no kernel module) in the namespace,
# state in WORK/ovs, libvirtd pointed at it with OVS_RUNDIR; the test applies the slice network
# with the agent's own applier (bridge, dnsmasq, flows, policing) and the domain's vNIC carries
# <virtualport type='openvswitch'/>. DATAPATH=linux-bridge: a Linux bridge and dnsmasq made here
# (slice-e2e.sh runs the agent's own Linux bridge with a real VM).
# Env: WORK (default BUILD_DIR/vm-e2e), NETNS (gpuaas-vme2e), BR (ovsbr0 | gpuaasbr0),
#      MAC (52:54:00:a0:00:01), IP (10.100.0.10), SKIP_GUEST_BUILD=1, DATAPATH
set -euo pipefail
HERE=$(cd "$(dirname "$0")" && pwd)
[ $# -ge 1 ] || { echo "usage: $0 BUILD_DIR" >&2; exit 2; }
BUILD=$(cd "$1" && pwd); TEST=$BUILD/services/node-agent/node_agent_vm_test
DATAPATH=${DATAPATH:-ovs}
[ "$DATAPATH" = ovs ] && DEFAULT_BR=ovsbr0 || DEFAULT_BR=gpuaasbr0
WORK=${WORK:-$BUILD/vm-e2e}; NETNS=${NETNS:-gpuaas-vme2e}; BR=${BR:-$DEFAULT_BR}
GW=10.100.0.1; MAC=${MAC:-52:54:00:a0:00:01}; IP=${IP:-10.100.0.10}
NS="ip netns exec $NETNS"
source "$HERE/lib.sh"
e2e_require_root vm-e2e
[ -x "$TEST" ] || { echo "vm-e2e: build node_agent_vm_test first ($TEST)" >&2; exit 2; }
step() { e2e_step "$@"; }
DNSMASQ_PID=
e2e_on_exit '[ -n "$DNSMASQ_PID" ] && kill "$DNSMASQ_PID" 2>/dev/null; echo "logs: $WORK"'
mkdir -p "$WORK"; rm -f "$WORK"/dnsmasq.* "$WORK"/libvirtd.log

GUEST=${GUEST:-$BUILD/e2e-guest}  # shared by the e2e scripts and the bench
e2e_guest "$GUEST"
step "guest ready ($GUEST)"

e2e_netns "$NETNS"
OVS_ENV=()
if [ "$DATAPATH" = ovs ]; then
  O=$WORK/ovs; rm -rf "$O"; mkdir -p "$O"
  export OVS_RUNDIR=$O OVS_LOGDIR=$O OVS_DBDIR=$O
  e2e_on_exit 'for p in ovs-vswitchd ovsdb-server; do [ -f "$O/$p.pid" ] && kill "$(cat "$O/$p.pid")"; done'
  ovsdb-tool create "$O/conf.db" /usr/share/openvswitch/vswitch.ovsschema
  $NS ovsdb-server "$O/conf.db" --remote="punix:$O/db.sock" --pidfile="$O/ovsdb-server.pid" \
    --detach --log-file="$O/ovsdb-server.log"
  ovs-vsctl --no-wait init
  $NS ovs-vswitchd "unix:$O/db.sock" --pidfile="$O/ovs-vswitchd.pid" --detach \
    --log-file="$O/ovs-vswitchd.log"
  # The test applies the network itself with the agent's applier (bridge, dnsmasq, flows).
  rm -rf "$WORK/net"
  OVS_ENV=(GPUAAS_VM_E2E_OVS=1 OVS_RUNDIR="$O" GPUAAS_VM_E2E_NET_DIR="$WORK/net")
  step "netns $NETNS: Open vSwitch up (the test applies bridge $BR, dnsmasq, flows)"
else
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
fi

e2e_libvirtd "$NETNS" "$WORK"
step "libvirtd $E2E_LIBVIRTD_PID + virtlogd $E2E_VIRTLOGD_PID up in $NETNS"

$NS env "${OVS_ENV[@]}" GPUAAS_VM_E2E_GUEST="$GUEST" GPUAAS_VM_E2E_LEASES="$WORK/dnsmasq.leases" \
  GPUAAS_VM_E2E_BRIDGE="$BR" GPUAAS_VM_E2E_MAC="$MAC" GPUAAS_VM_E2E_IP="$IP" \
  "$TEST" --gtest_filter='VmE2eTest.*' --gtest_brief=0
step "VmE2eTest done"
