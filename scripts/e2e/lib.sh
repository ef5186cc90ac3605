# shellcheck shell=bash
# Shared by the real-VM scripts (vm-e2e.sh, slice-e2e.sh, scripts/bench node-agent): root and
# libvirt checks, the test guest, a network namespace with virtlogd + libvirtd inside it (a VM's
# tap lands on a bridge in that namespace; the daemons' UNIX socket is reachable from the host
# namespace), and an EXIT trap that stops what was started, by PID, and deletes the namespace.
# Nothing here touches the host's own network.
#   e2e_require_root NAME          exit 77 (skipped) unless root and no libvirt daemon runs;
#                                  then scripts/host-bootstrap (e.g. /dev/kvm for libvirt's qemu,
#                                  so a run straight from ctest gets a set-up host too)
#   e2e_guest DIR                  build the guest (idempotent; SKIP_GUEST_BUILD=1 skips); the
#                                  scripts share BUILD_DIR/e2e-guest (env GUEST overrides)
#   e2e_netns NAME                 create the namespace (lo up); removed on exit
#   e2e_client_netns NS CLIENT IF NODE_CIDR CLIENT_CIDR
#                                  a second namespace CLIENT (removed on exit) wired to NS by a
#                                  veth pair: IF in NS with NODE_CIDR (the node's public uplink),
#                                  eth0 in CLIENT with CLIENT_CIDR (a client on the internet)
#   e2e_libvirtd NAME LOGDIR       virtlogd + libvirtd inside namespace NAME (gpuaas-* domains
#                                  defined after it started are destroyed/undefined on exit)
#   e2e_on_exit CMD                run CMD (a string) on exit, before the daemons stop
#   e2e_step MSG                   a timestamped progress line
E2E_HERE=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
E2E_T0=$(date +%s.%N); E2E_TL=$E2E_T0
E2E_LIBVIRTD_PID=; E2E_VIRTLOGD_PID=; E2E_NETNS=; E2E_CLIENT_NETNS=; E2E_ON_EXIT=(); E2E_NAME=e2e

e2e_step() {
  local now; now=$(date +%s.%N)
  printf '[%6.1fs +%5.1fs] %s\n' "$(echo "$now-$E2E_T0" | bc)" "$(echo "$now-$E2E_TL" | bc)" "$*"
  E2E_TL=$now
}

e2e_cleanup() {
  local rc=$?
  set +e
  local c
  for c in "${E2E_ON_EXIT[@]}"; do eval "$c"; done
  [ -n "$E2E_LIBVIRTD_PID" ] && kill "$E2E_LIBVIRTD_PID" 2>/dev/null
  [ -n "$E2E_VIRTLOGD_PID" ] && kill "$E2E_VIRTLOGD_PID" 2>/dev/null
  [ -n "$E2E_CLIENT_NETNS" ] && ip netns del "$E2E_CLIENT_NETNS" 2>/dev/null
  [ -n "$E2E_NETNS" ] && ip netns del "$E2E_NETNS" 2>/dev/null
  local took; took=$(echo "$(date +%s.%N)-$E2E_T0" | bc | cut -c1-5)
  if [ "$rc" = 0 ]; then echo "$E2E_NAME PASS (${took}s)"
  elif [ "$rc" = 77 ]; then echo "$E2E_NAME SKIPPED"
  else echo "$E2E_NAME FAIL rc=$rc (${took}s)"; fi
  exit "$rc"
}
trap e2e_cleanup EXIT

e2e_on_exit() { E2E_ON_EXIT+=("$1"); }

e2e_require_root() {
  E2E_NAME=$1
  [ "$(id -u)" = 0 ] || { echo "$E2E_NAME: needs root (skipped)"; exit 77; }
  "$E2E_HERE/../host-bootstrap"
  local p
  for p in /run/libvirtd.pid /run/virtqemud.pid; do
    if [ -f "$p" ] && kill -0 "$(cat "$p")" 2>/dev/null; then
      echo "$E2E_NAME: a libvirt daemon is already running ($p); skipped"; exit 77
    fi
  done
}

e2e_guest() {
  [ "${SKIP_GUEST_BUILD:-0}" = 1 ] || "$E2E_HERE/build-guest.sh" "$1" >/dev/null
}

e2e_netns() {
  ip netns del "$1" 2>/dev/null || true
  ip netns add "$1"; E2E_NETNS=$1
  ip netns exec "$1" ip link set lo up
}

e2e_client_netns() {
  local ns=$1 client=$2 ifname=$3 node_cidr=$4 client_cidr=$5
  ip netns del "$client" 2>/dev/null || true
  ip netns add "$client"; E2E_CLIENT_NETNS=$client
  ip -n "$client" link set lo up
  ip -n "$ns" link add "$ifname" type veth peer name eth0 netns "$client"
  ip -n "$ns" addr add "$node_cidr" dev "$ifname"
  ip -n "$ns" link set "$ifname" up
  ip -n "$client" addr add "$client_cidr" dev eth0
  ip -n "$client" link set eth0 up
}

# libvirt daemons without systemd, inside the namespace.
e2e_libvirtd() {
  local ns=$1 logdir=$2 i
  rm -f /run/libvirtd.pid /run/virtlogd.pid
  ip netns exec "$ns" /usr/sbin/virtlogd -d
  for i in $(seq 1 50); do [ -f /run/virtlogd.pid ] && break; sleep 0.1; done
  E2E_VIRTLOGD_PID=$(cat /run/virtlogd.pid)
  ip netns exec "$ns" env LIBVIRT_LOG_OUTPUTS="3:file:$logdir/libvirtd.log" /usr/sbin/libvirtd -d
  for i in $(seq 1 100); do [ -f /run/libvirtd.pid ] && break; sleep 0.1; done
  E2E_LIBVIRTD_PID=$(cat /run/libvirtd.pid)
  for i in $(seq 1 300); do [ -S /run/libvirt/libvirt-sock ] && break; sleep 0.1; done
  [ -S /run/libvirt/libvirt-sock ] || { echo "libvirtd did not open its socket" >&2; return 1; }
  # Domain definitions outlive this libvirtd (/etc/libvirt/qemu): a test that stops half-way
  # must not leave its VM defined (or running) for the next libvirtd to find as an orphan. The
  # domains there now are not ours; any gpuaas-* domain that appears later is, and goes on exit.
  E2E_DOMAINS_BEFORE=$(virsh -c qemu:///system list --all --name 2>/dev/null || true)
  e2e_on_exit 'e2e_forget_new_domains'
}

e2e_forget_new_domains() {
  local d
  for d in $(virsh -c qemu:///system list --all --name 2>/dev/null); do
    [[ $d == gpuaas-* ]] || continue
    grep -qxF "$d" <<<"$E2E_DOMAINS_BEFORE" && continue
    echo "e2e: removing domain $d left by the test"
    virsh -c qemu:///system destroy "$d" >/dev/null 2>&1
    virsh -c qemu:///system undefine --nvram "$d" >/dev/null 2>&1 ||
      virsh -c qemu:///system undefine "$d" >/dev/null 2>&1
  done
}
