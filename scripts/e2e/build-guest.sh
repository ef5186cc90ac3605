#!/bin/bash
# build-guest.sh OUT_DIR [--force] - a tiny direct-boot test guest for the node agent's real-VM
# e2e (adapted from the shared vm-e2e recipe). Writes into OUT_DIR:
#   vmlinuz       Debian cloud kernel (linux-image-cloud-amd64, downloaded, not installed)
#   initrd.img    busybox + dropbear + virtio/isofs/acpi modules; its init reads the NoCloud seed
#                 (any disk with meta-data: iso9660 label cidata), sets the hostname, installs the
#                 seed's ssh_authorized_keys for root, runs udhcpc on the first NIC, dropbear on
#                 port 22, and powers off on the ACPI power button (virDomainShutdown)
#   seed.iso      a sample NoCloud seed (the agent builds its own per allocation)
#   id_ed25519    an SSH key (its .pub is what tests put into the seed)
#   image.raw     a 16 MiB raw disk image with an ext4 filesystem (what provisioning writes)
#   .stamp        inputs of the last build: an unchanged build is skipped (idempotent)
# Needs (Debian 12): busybox or busybox-static, dropbear-bin, genisoimage, openssh-client,
# e2fsprogs, apt (apt-get download; or KERNEL_DEB=/path/to/linux-image-*.deb), cpio from busybox.
# Env: KPKG (default linux-image-cloud-amd64), KERNEL_DEB, GUEST_HOSTNAME (gpuslice-test-1),
#      INSTANCE_ID (iid-gpuslice-1).
set -euo pipefail
usage() { echo "usage: $0 OUT_DIR [--force]" >&2; exit 2; }
[ $# -ge 1 ] || usage
OUT=$1; FORCE=${2:-}
[ -z "$FORCE" ] || [ "$FORCE" = --force ] || usage
KPKG=${KPKG:-linux-image-cloud-amd64}
GUEST_HOSTNAME=${GUEST_HOSTNAME:-gpuslice-test-1}
INSTANCE_ID=${INSTANCE_ID:-iid-gpuslice-1}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
for t in busybox dropbear dropbearkey genisoimage ssh-keygen mkfs.ext4 dpkg-deb gzip; do
  command -v "$t" >/dev/null || { echo "build-guest: $t missing" >&2; exit 1; }
done
BUSYBOX=$(command -v busybox); DROPBEAR=$(command -v dropbear); DROPBEARKEY=$(command -v dropbearkey)
# The applet list read once (`busybox --list | grep -q` under pipefail fails at random: grep
# exits at the first match and busybox dies of SIGPIPE).
APPLETS=$("$BUSYBOX" --list)
for a in sh mount insmod udhcpc ip getty acpid cpio strings awk hostname poweroff; do
  grep -qx "$a" <<<"$APPLETS" || { echo "build-guest: busybox lacks the $a applet" >&2; exit 1; }
done

# ---- idempotence: skip when the outputs exist and the inputs are unchanged ----
if [ -n "${KERNEL_DEB:-}" ]; then KVER_PKG=$(dpkg-deb -f "$KERNEL_DEB" Package)
else
  KVER_PKG=$(apt-cache depends "$KPKG" 2>/dev/null | awk '/Depends: linux-image-[0-9]/{print $2; exit}')
  [ -n "$KVER_PKG" ] || KVER_PKG=$KPKG
fi
STAMP="script=$(sha256sum "$0" | cut -c1-16) kernel=$KVER_PKG host=$GUEST_HOSTNAME iid=$INSTANCE_ID busybox=$(sha256sum "$BUSYBOX" | cut -c1-16)"
if [ "$FORCE" != --force ] && [ -f "$OUT/.stamp" ] && [ "$(cat "$OUT/.stamp")" = "$STAMP" ]; then
  ok=1
  for f in vmlinuz initrd.img seed.iso id_ed25519 id_ed25519.pub image.raw; do [ -s "$OUT/$f" ] || ok=0; done
  if [ $ok = 1 ]; then echo "build-guest: $OUT is up to date"; exit 0; fi
fi

WORK=$OUT/work; rm -rf "$WORK"; mkdir -p "$WORK/deb" "$WORK/root"
trap 'rm -rf "$WORK"' EXIT
cd "$WORK"

# ---- 1. kernel + modules from the Debian package (not installed on the host) ----
if [ -n "${KERNEL_DEB:-}" ]; then cp "$KERNEL_DEB" deb/
else
  mkdir -p "$OUT/cache"
  ls "$OUT/cache/${KVER_PKG}"_*.deb >/dev/null 2>&1 ||
    (cd "$OUT/cache" && apt-get download "$KVER_PKG" 2>&1 | grep -v unsandboxed || true)
  cp "$OUT/cache/${KVER_PKG}"_*.deb deb/
fi
dpkg-deb -x deb/*.deb deb/x
KVER=$(ls deb/x/lib/modules | head -1)
cp deb/x/boot/vmlinuz-"$KVER" "$OUT/vmlinuz.tmp"
R=$WORK/root
mkdir -p $R/{bin,sbin,etc,proc,sys,dev,run,tmp,root/.ssh,mnt/seed,lib/modules,etc/dropbear,etc/acpi/PWRF,var/log,usr/share/udhcpc}
MODS="virtio_pci virtio_net virtio_blk virtio_rng isofs button evdev"   # deps resolved below
MODDIR=deb/x/lib/modules/$KVER; declare -A SEEN; : > $R/etc/modules.order
add_mod() {   # copy a module after its dependencies (read from the .modinfo "depends=" field)
  local m=$1 f d; [ -n "${SEEN[$m]:-}" ] && return; SEEN[$m]=1
  f=$(find $MODDIR \( -name "$m.ko" -o -name "${m//_/-}.ko" \) | head -1)
  [ -n "$f" ] || { echo "note: $m is not a module here (built in?)" >&2; return 0; }
  for d in $("$BUSYBOX" strings "$f" | sed -n 's/^depends=//p' | tr ',' ' '); do add_mod "$d"; done
  cp "$f" $R/lib/modules/; basename "$f" .ko >> $R/etc/modules.order
}
for m in $MODS; do add_mod $m; done
echo "modules: $(tr '\n' ' ' < $R/etc/modules.order)"

# ---- 2. userland: busybox + dropbear and the shared libraries they need ----
cp "$BUSYBOX" $R/bin/busybox
for a in $("$BUSYBOX" --list); do [ -e $R/bin/$a ] || ln -s busybox $R/bin/$a; done
ln -sf ../bin/busybox $R/sbin/init
cp "$DROPBEAR" "$DROPBEARKEY" $R/bin/
for lib in $(ldd "$BUSYBOX" "$DROPBEAR" "$DROPBEARKEY" 2>/dev/null | awk '/=>/{print $3} /ld-linux/{print $1}' | sort -u); do
  mkdir -p $R$(dirname $lib); cp -L $lib $R$lib
done

cat > $R/etc/passwd <<'EOF'
root:x:0:0:root:/root:/bin/sh
EOF
echo 'root:*:19000:0:99999:7:::' > $R/etc/shadow; chmod 600 $R/etc/shadow
echo 'root:x:0:' > $R/etc/group
echo '/bin/sh' > $R/etc/shells
echo 'hosts: files' > $R/etc/nsswitch.conf
echo '127.0.0.1 localhost' > $R/etc/hosts

cat > $R/init <<'EOF'
#!/bin/sh
export PATH=/bin:/sbin
mount -t proc proc /proc; mount -t sysfs sysfs /sys
mount -t devtmpfs devtmpfs /dev 2>/dev/null
mkdir -p /dev/pts; mount -t devpts devpts /dev/pts; mount -t tmpfs tmpfs /run
exec /sbin/init
EOF
cat > $R/etc/inittab <<'EOF'
::sysinit:/etc/rcS
ttyS0::respawn:/bin/sh -c 'exec /bin/getty -n -l /bin/sh 115200 ttyS0'
::shutdown:/bin/sh -c 'echo GUEST-SHUTDOWN > /dev/ttyS0; killall dropbear udhcpc acpid; umount -a -r'
EOF
# The guest's boot script: every path in it (/run, /root/.ssh, the seed mount) is inside the
# guest's own initramfs, never on the machine that builds or runs it.
cat > $R/etc/rcS <<'EOF'
#!/bin/sh
export PATH=/bin:/sbin
log() { echo "[guest] $*" > /dev/ttyS0; }
for m in $(cat /etc/modules.order); do insmod /lib/modules/$m.ko || log "insmod $m failed"; done
# --- NoCloud seed: any block device carrying meta-data (iso9660 label cidata or vfat) ---
SEED=
for i in 1 2 3 4 5 6 7 8 9 10; do
  for d in /dev/vd? /dev/sr? /dev/nvme?n?; do
    [ -b "$d" ] || continue
    mount -o ro -t iso9660 $d /mnt/seed 2>/dev/null || mount -o ro $d /mnt/seed 2>/dev/null || continue
    if [ -f /mnt/seed/meta-data ]; then SEED=/mnt/seed; break 2; fi
    umount /mnt/seed
  done
  sleep 0.2
done
HN=localhost
if [ -n "$SEED" ]; then
  # strip YAML quotes, then take hostname and every list item that looks like an SSH public key
  cat $SEED/meta-data $SEED/user-data 2>/dev/null | tr -d "\"'" > /run/seed.txt
  v=$(awk -F': *' '/^(local-hostname|hostname):/{print $2; exit}' /run/seed.txt)
  [ -n "$v" ] && HN=$v
  awk '/^[ \t]*-[ \t]*(ssh-|ecdsa-|sk-)/{sub(/^[ \t]*-[ \t]*/,""); print}' /run/seed.txt > /root/.ssh/authorized_keys
  chmod 700 /root/.ssh; chmod 600 /root/.ssh/authorized_keys
  log "seed=$SEED instance-id=$(awk -F': *' '/^instance-id:/{print $2}' $SEED/meta-data) keys=$(wc -l < /root/.ssh/authorized_keys)"
else
  log "no NoCloud seed found"
fi
hostname "$HN"; echo "$HN" > /etc/hostname; echo "127.0.1.1 $HN" >> /etc/hosts
# --- network: DHCP on the first NIC ---
ip link set lo up
IF=$(ls /sys/class/net | grep -v '^lo$' | head -1)
ip link set "$IF" up
udhcpc -i "$IF" -s /usr/share/udhcpc/default.script -t 30 -T 1 -A 2 -b -x hostname:"$HN" >/dev/null 2>&1
# --- sshd + ACPI power button (virDomainShutdown) ---
dropbearkey -t ed25519 -f /etc/dropbear/dropbear_ed25519_host_key >/dev/null 2>&1
dropbear -s -r /etc/dropbear/dropbear_ed25519_host_key -p 22 -P /run/dropbear.pid
acpid -c /etc/acpi -l /var/log/acpid.log 2>/dev/null
log "GUEST-READY hostname=$HN if=$IF ip=$(ip -4 -o addr show dev $IF | awk '{print $4}')"
EOF
cat > $R/usr/share/udhcpc/default.script <<'EOF'
#!/bin/sh
case "$1" in
  deconfig) ip -4 addr flush dev "$interface"; ip link set "$interface" up ;;
  bound|renew)
    ip -4 addr flush dev "$interface"
    ip addr add "$ip/${mask:-24}" dev "$interface"
    [ -n "$router" ] && ip route replace default via "${router%% *}" dev "$interface"
    : > /etc/resolv.conf; for d in $dns; do echo "nameserver $d" >> /etc/resolv.conf; done ;;
esac
exit 0
EOF
printf '#!/bin/sh\necho "[guest] ACPI power button -> poweroff" > /dev/ttyS0\npoweroff\n' > $R/etc/acpi/PWRF/00000080
chmod +x $R/init $R/etc/rcS $R/usr/share/udhcpc/default.script $R/etc/acpi/PWRF/00000080
(cd $R && find . | "$BUSYBOX" cpio -o -H newc -R 0:0 2>/dev/null | gzip -6) > "$OUT/initrd.img.tmp"

# ---- 3. SSH key, sample NoCloud seed, disk image ----
[ -f "$OUT/id_ed25519" ] || ssh-keygen -q -t ed25519 -N '' -C ci@node-agent -f "$OUT/id_ed25519"
mkdir -p $WORK/seed
cat > $WORK/seed/meta-data <<EOF
instance-id: $INSTANCE_ID
local-hostname: $GUEST_HOSTNAME
EOF
cat > $WORK/seed/user-data <<EOF
#cloud-config
hostname: $GUEST_HOSTNAME
ssh_authorized_keys:
  - $(cat "$OUT/id_ed25519.pub")
EOF
genisoimage -quiet -output "$OUT/seed.iso.tmp" -volid cidata -joliet -rock $WORK/seed/user-data $WORK/seed/meta-data
rm -f "$OUT/image.raw.tmp"; mkfs.ext4 -q -F -L gpuaas-guest "$OUT/image.raw.tmp" 16M
for f in vmlinuz initrd.img seed.iso image.raw; do mv -f "$OUT/$f.tmp" "$OUT/$f"; done
chmod 0644 "$OUT/vmlinuz" "$OUT/initrd.img" "$OUT/seed.iso" "$OUT/image.raw"
echo "$STAMP" > "$OUT/.stamp"
ls -la "$OUT"
