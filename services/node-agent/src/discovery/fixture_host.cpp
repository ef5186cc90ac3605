#include "gpuaas/node_agent/discovery/fixture_host.hpp"
#include "gpuaas/node_agent/node_agent_reasons.hpp"

#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <map>
#include <stdexcept>
#include <vector>

namespace gpuaas::node_agent {
namespace {

namespace fs = std::filesystem;

std::string Hex(unsigned v, int width) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%0*x", width, v);
  return buf;
}

// "0000:18:00.0"
std::string Addr(unsigned dom, unsigned bus, unsigned dev, unsigned fn) {
  return Hex(dom, 4) + ":" + Hex(bus, 2) + ":" + Hex(dev, 2) + "." + std::to_string(fn);
}

// A network-order IPv4 address as /proc/net/route prints it on a little-endian host.
std::string RouteHex(unsigned a, unsigned b, unsigned c, unsigned d) {
  char buf[16];
  std::snprintf(buf, sizeof(buf), "%02X%02X%02X%02X", d, c, b, a);
  return buf;
}

// The first 8 KiB of a device with the given signatures.
std::string DiskHead(const std::string& fs_type, const std::string& table) {
  std::string h(8192, '\0');
  auto put = [&](size_t off, std::string_view s) { h.replace(off, s.size(), s); };
  auto boot_sig = [&] {
    h[510] = static_cast<char>(0x55);
    h[511] = static_cast<char>(0xAA);
  };
  if (table == "gpt") {
    boot_sig();
    h[446 + 4] = static_cast<char>(0xEE);  // protective MBR
    put(512, "EFI PART");
  } else if (table == "dos") {
    boot_sig();
    h[446 + 4] = static_cast<char>(0x83);
  }
  if (fs_type == "ext4") {
    h[1080] = static_cast<char>(0x53);
    h[1081] = static_cast<char>(0xEF);
    h[1024 + 0x60] = 0x40;  // INCOMPAT_EXTENTS
  } else if (fs_type == "xfs") {
    put(0, "XFSB");
  } else if (fs_type == "LVM2_member") {
    put(512, "LABELONE");
    put(512 + 24, "LVM2 001");
  } else if (fs_type == "swap") {
    put(4086, "SWAPSPACE2");
  } else if (fs_type == "vfat") {
    boot_sig();
    put(82, "FAT32   ");
  }
  return h;
}

class Tree {
 public:
  explicit Tree(fs::path root) : root_(std::move(root)) {}

  fs::path P(const std::string& logical) const { return root_ / logical.substr(1); }

  void File(const std::string& logical, const std::string& content, bool exec = false) {
    fs::path p = P(logical);
    fs::create_directories(p.parent_path());
    std::ofstream f(p, std::ios::binary | std::ios::trunc);
    f << content;
    if (!f) throw std::runtime_error("cannot write " + p.string());
    f.close();
    if (exec) {
      fs::permissions(p, fs::perms::owner_all | fs::perms::group_read | fs::perms::group_exec |
                             fs::perms::others_read | fs::perms::others_exec);
    }
  }

  void Dir(const std::string& logical) { fs::create_directories(P(logical)); }

  // A relative link, the way sysfs and udev write them.
  void Link(const std::string& link, const std::string& target) {
    fs::path lp = fs::path(link);
    fs::path rel = fs::path(target).lexically_relative(lp.parent_path());
    fs::create_directories(P(link).parent_path());
    fs::create_symlink(rel, P(link));
  }

  void AbsLink(const std::string& link, const std::string& target) {
    fs::create_directories(P(link).parent_path());
    fs::create_symlink(target, P(link));
  }

 private:
  fs::path root_;
};

struct Builder {
  const FixtureOptions& o;
  Tree t;
  int iommu_group = 10;
  std::vector<std::string> mounts;
  std::vector<std::string> cpulists = {"0-47,96-143", "48-95,144-191"};

  // /dev/kvm plus the /etc/passwd and /etc/group that name its owner. Files get this process's
  // ids; as root the node is moved to a gid of its own so that "kvm" is not also "root".
  void KvmNode() {
    constexpr unsigned kKvmGid = 993;
    unsigned file_gid = static_cast<unsigned>(::getegid());
    if (o.kvm) {
      t.File("/dev/kvm", "");
      std::string p = t.P("/dev/kvm").string();
      if (o.kvm_access && ::chown(p.c_str(), static_cast<uid_t>(-1), kKvmGid) == 0) {
        file_gid = kKvmGid;
      }
      if (::chmod(p.c_str(), o.kvm_access ? 0660 : 0600) != 0) {
        throw std::runtime_error("cannot chmod " + p);
      }
      struct stat st {};
      if (::stat(p.c_str(), &st) == 0) file_gid = st.st_gid;
    }
    const unsigned kvm_gid =
        o.kvm_access ? file_gid : (file_gid == kKvmGid ? kKvmGid + 1 : kKvmGid);
    std::string group = "root:x:0:\n";
    if (file_gid != 0 && file_gid != kvm_gid) {
      group += "users:x:" + std::to_string(file_gid) + ":\n";
    }
    group += "kvm:x:" + std::to_string(kvm_gid) + ":libvirt-qemu\n";
    t.File("/etc/group", group);
    std::string passwd = "root:x:0:0:root:/root:/bin/bash\n";
    if (::geteuid() != 0) {
      passwd += "builder:x:" + std::to_string(::geteuid()) + ":" + std::to_string(file_gid) +
                "::/nonexistent:/usr/sbin/nologin\n";
    }
    passwd += "libvirt-qemu:x:64055:" + std::to_string(kvm_gid) +
              ":Libvirt Qemu:/var/lib/libvirt:/usr/sbin/nologin\n";
    t.File("/etc/passwd", passwd);
  }

  // A PCI function under `parent` (a root complex or a bridge directory); returns its directory.
  std::string Pci(const std::string& parent, const std::string& addr, const std::string& vendor,
                  const std::string& device, const std::string& cls, int numa,
                  const std::string& driver = "") {
    std::string dir = parent + "/" + addr;
    t.File(dir + "/vendor", vendor + "\n");
    t.File(dir + "/device", device + "\n");
    t.File(dir + "/class", cls + "\n");
    t.File(dir + "/numa_node", std::to_string(numa) + "\n");
    t.File(dir + "/local_cpulist",
           (numa >= 0 && numa < 2 ? cpulists[static_cast<size_t>(numa)] : "0-191") + "\n");
    t.Link("/sys/bus/pci/devices/" + addr, dir);
    if (!driver.empty()) {
      t.Dir("/sys/bus/pci/drivers/" + driver);
      t.Link(dir + "/driver", "/sys/bus/pci/drivers/" + driver);
    }
    if (o.iommu && cls.rfind("0x0604", 0) != 0) {
      std::string g = "/sys/kernel/iommu_groups/" + std::to_string(iommu_group++);
      t.Link(g + "/devices/" + addr, dir);
      t.Link(dir + "/iommu_group", g);
    }
    return dir;
  }

  std::string Bridge(const std::string& parent, const std::string& addr, int numa) {
    return Pci(parent, addr, "0x1000", "0xc030", "0x060400", numa, "pcieport");
  }

  void Gpu(const std::string& parent, const std::string& addr, int numa) {
    Pci(parent, addr, "0x10de", "0x2335", "0x030200", numa, "vfio-pci");
  }

  // An IB/RoCE PF with its VFs; `next_ib` numbers the RDMA devices.
  void Fabric(const std::string& parent, unsigned dom, unsigned bus, int numa, int pf_index,
              int total_pfs) {
    std::string pf_addr = Addr(dom, bus, 0, 0);
    std::string pf = Pci(parent, pf_addr, "0x15b3", "0x1021", "0x020700", numa, "mlx5_core");
    IbDevice(pf, "mlx5_" + std::to_string(pf_index));
    t.File(pf + "/sriov_totalvfs", std::to_string(std::max(o.vfs_per_pf, 8)) + "\n");
    t.File(pf + "/sriov_numvfs", std::to_string(o.vfs_per_pf) + "\n");
    for (int v = 0; v < o.vfs_per_pf; ++v) {
      unsigned devfn = static_cast<unsigned>(v) + 1;
      std::string vf_addr = Addr(dom, bus, devfn / 8, devfn % 8);
      std::string vf = Pci(parent, vf_addr, "0x15b3", "0x101e", "0x020700", numa, "mlx5_core");
      t.Link(pf + "/virtfn" + std::to_string(v), vf);
      t.Link(vf + "/physfn", pf);
      if (o.vf_rdma_devices) {
        IbDevice(vf, "mlx5_" + std::to_string(total_pfs + pf_index * o.vfs_per_pf + v));
      }
    }
  }

  void IbDevice(const std::string& pci_dir, const std::string& name) {
    std::string dir = pci_dir + "/infiniband/" + name;
    t.Link(dir + "/device", pci_dir);
    bool ib = o.link_layer == "InfiniBand";
    t.File(dir + "/ports/1/link_layer", o.link_layer + "\n");
    t.File(dir + "/ports/1/state", "4: ACTIVE\n");
    t.File(dir + "/ports/1/rate", ib ? "400 Gb/sec (4X NDR)\n" : "400 Gb/sec (4X)\n");
    t.Link("/sys/class/infiniband/" + name, dir);
  }

  struct Part {
    std::string fs_type;
    std::string mount;  // as written in /proc/self/mounts (octal escapes)
  };

  // An NVMe controller + namespace `k` at PCI function `pci_dir`; `j` keeps ids stable.
  void Nvme(const std::string& pci_dir, int j, int k, int numa, const std::string& table,
            const std::string& disk_fs, const std::vector<Part>& parts, bool lvm_root) {
    const std::string ks = std::to_string(k);
    const std::string ctrl = pci_dir + "/nvme/nvme" + ks;
    const std::string model = "Dell Ent NVMe PM1733a RI 3.84TB";
    const std::string serial = "S6CRNA0W" + Hex(static_cast<unsigned>(0x100 + j), 4);
    t.Link(ctrl + "/device", pci_dir);
    t.File(ctrl + "/model", model + "          \n");
    t.File(ctrl + "/serial", serial + "    \n");
    t.File(ctrl + "/numa_node", std::to_string(numa) + "\n");
    t.Link("/sys/class/nvme/nvme" + ks, ctrl);
    const std::string kname = "nvme" + ks + "n1";
    const std::string ns = ctrl + "/" + kname;
    t.Link(ns + "/device", ctrl);
    t.File(ns + "/size", "7501476528\n");
    t.Link("/sys/class/block/" + kname, ns);
    t.File("/dev/" + kname, DiskHead(disk_fs, table));
    const std::string eui =
        "nvme-eui.000000000000000100a07524" + Hex(0x4a100000u + static_cast<unsigned>(j), 8);
    std::string model_id = model;
    std::replace(model_id.begin(), model_id.end(), ' ', '_');
    t.Link("/dev/disk/by-id/" + eui, "/dev/" + kname);
    t.Link("/dev/disk/by-id/nvme-" + model_id + "_" + serial, "/dev/" + kname);
    if (o.controller_path_names) {
      const std::string path_dev = ctrl + "/nvme" + ks + "c" + ks + "n1";
      t.File(path_dev + "/size", "7501476528\n");
      t.Link("/sys/class/block/nvme" + ks + "c" + ks + "n1", path_dev);
    }
    for (size_t p = 0; p < parts.size(); ++p) {
      const std::string pn = kname + "p" + std::to_string(p + 1);
      std::string part_dir = ns;
      part_dir += '/';
      part_dir += pn;
      t.File(part_dir + "/partition", std::to_string(p + 1) + "\n");
      t.File(part_dir + "/size", "2097152\n");
      t.Link("/sys/class/block/" + pn, part_dir);
      t.File("/dev/" + pn, DiskHead(parts[p].fs_type, ""));
      t.Link("/dev/disk/by-id/" + eui + "-part" + std::to_string(p + 1), "/dev/" + pn);
      if (!parts[p].mount.empty()) {
        mounts.push_back("/dev/" + pn + " " + parts[p].mount + " " + parts[p].fs_type +
                         " rw,relatime 0 0");
      }
    }
    if (lvm_root) {
      const std::string pn = kname + "p" + std::to_string(parts.size());
      const std::string dm = "/sys/devices/virtual/block/dm-0";
      t.File(dm + "/size", "7000000000\n");
      t.File(dm + "/dm/name", "vg0-root\n");
      t.Link(dm + "/slaves/" + pn, ns + "/" + pn);
      t.Link("/sys/class/block/dm-0", dm);
      t.File("/dev/dm-0", DiskHead("ext4", ""));
      t.Link("/dev/mapper/vg0-root", "/dev/dm-0");
      mounts.push_back("/dev/mapper/vg0-root / ext4 rw,relatime 0 0");
    }
  }

  // How many of each device the options ask for.
  struct Layout {
    int gpus = 0;
    int nvme = 0;
    int pfs = 0;
    int os_extra = 0;  // 1: a separate OS disk after the data disks
    int total_nvme = 0;
  };

  Layout LayoutOf() const {
    Layout l;
    l.gpus = std::clamp(o.gpus, 0, 16);
    l.nvme = o.nvme < 0 ? l.gpus : o.nvme;
    l.pfs = o.fabric_pfs < 0 ? l.gpus : o.fabric_pfs;
    l.os_extra = (o.separate_os_disk && o.os_disk_nvme < 0) ? 1 : 0;
    l.total_nvme = l.nvme + l.os_extra;
    return l;
  }

  int KernelIndex(const Layout& l, int j) const {
    return o.shuffle_kernel_names ? l.total_nvme - 1 - j : j;
  }

  // Onboard VGA: display class but not NVIDIA.
  void OnboardVga() {
    std::string rc = "/sys/devices/pci0000:00";
    std::string rp = Bridge(rc, "0000:00:1c.0", 0);
    std::string br = Pci(rp, "0000:02:00.0", "0x1a03", "0x1150", "0x060400", 0);
    Pci(br, "0000:03:00.0", "0x1a03", "0x2000", "0x030000", 0, "ast");
  }

  // Data NVMe `j` at PCI function `dn`, with whatever the options put on it.
  void DataDisk(const Layout& l, const std::string& dn, int j, int numa) {
    std::string table, disk_fs;
    std::vector<Part> parts;
    bool lvm = false;
    if (j == o.os_disk_nvme) {
      table = "gpt";
      parts = {{"vfat", "/boot/efi"},
               {o.os_on_lvm ? "LVM2_member" : "ext4", o.os_on_lvm ? "" : "/"}};
      lvm = o.os_on_lvm;
    } else if (j == o.mounted_child_nvme) {
      table = "gpt";
      parts = {{"ext4", "/share\\0401"}};
    } else if (j == o.fs_nvme || j == o.mounted_nvme) {
      disk_fs = "xfs";
    }
    if (j == o.mounted_nvme) {
      mounts.push_back("/dev/nvme" + std::to_string(KernelIndex(l, j)) +
                       "n1 /scratch xfs rw,relatime 0 0");
    }
    Nvme(dn, j, KernelIndex(l, j), numa, table, disk_fs, parts, lvm);
  }

  // GPU i behind its own switch, with fabric PF i and data NVMe i on the same switch.
  void GpuSwitches(const Layout& l) {
    auto numa_of = [&](int i) { return l.gpus <= 1 ? 0 : (i * 2) / l.gpus; };
    for (int i = 0; i < l.gpus; ++i) {
      const unsigned dom = static_cast<unsigned>(i / 8);
      const unsigned base = 0x15u + static_cast<unsigned>(i % 8) * 0x15u;
      const int numa = numa_of(i);
      std::string rc = "/sys/devices/pci" + Hex(dom, 4) + ":" + Hex(base, 2);
      std::string rp = Bridge(rc, Addr(dom, base, 1, 0), numa);
      std::string up = Bridge(rp, Addr(dom, base + 1, 0, 0), numa);
      std::string dn_gpu = Bridge(up, Addr(dom, base + 2, 0, 0), numa);
      Gpu(dn_gpu, Addr(dom, base + 3, 0, 0), o.unknown_numa_gpus.count(i) ? -1 : numa);
      if (i < l.pfs) {
        std::string dn = Bridge(up, Addr(dom, base + 2, 1, 0), numa);
        Fabric(dn, dom, base + 4, numa, i, l.pfs);
      }
      if (i < l.nvme) {
        std::string dn = Bridge(up, Addr(dom, base + 2, 2, 0), numa);
        std::string pci =
            Pci(dn, Addr(dom, base + 5, 0, 0), "0x144d", "0xa824", "0x010802", numa, "nvme");
        DataDisk(l, pci, i, numa);
      }
    }
  }

  // Fabric PFs and data NVMe beyond one per GPU, and the separate OS disk: each on a root port
  // of its own in domain 0002.
  void DevicesOffSwitch(const Layout& l) {
    unsigned extra_bus = 0x10;  // domain 0002 holds devices that do not sit behind a GPU switch
    auto extra_port = [&](int numa) {
      std::string rc = "/sys/devices/pci0002:" + Hex(extra_bus, 2);
      std::string rp = Bridge(rc, Addr(2, extra_bus, 1, 0), numa);
      unsigned bus = extra_bus + 1;
      extra_bus += 2;
      return std::make_pair(rp, bus);
    };
    for (int p = l.gpus; p < l.pfs; ++p) {
      auto [rp, bus] = extra_port(0);
      Fabric(rp, 2, bus, 0, p, l.pfs);
    }
    for (int j = l.gpus; j < l.nvme; ++j) {
      auto [rp, bus] = extra_port(0);
      std::string pci = Pci(rp, Addr(2, bus, 0, 0), "0x144d", "0xa824", "0x010802", 0, "nvme");
      DataDisk(l, pci, j, 0);
    }
    if (l.os_extra) {
      auto [rp, bus] = extra_port(0);
      std::string pci = Pci(rp, Addr(2, bus, 0, 0), "0x1344", "0x51c3", "0x010802", 0, "nvme");
      std::vector<Part> parts = {{"vfat", "/boot/efi"},
                                 {o.os_on_lvm ? "LVM2_member" : "ext4", o.os_on_lvm ? "" : "/"}};
      Nvme(pci, l.nvme, KernelIndex(l, l.nvme), 0, "gpt", "", parts, o.os_on_lvm);
    }
  }

  void Prerequisites() {
    t.File("/proc/sys/kernel/hostname", o.hostname + "\n");
    t.File("/etc/hostname", o.hostname + "\n");
    KvmNode();
    if (o.iommu) t.Dir("/sys/kernel/iommu_groups");
    t.File("/proc/cmdline", std::string("BOOT_IMAGE=/vmlinuz-6.8.0-60-generic root=/dev/mapper/"
                                        "vg0-root ro") +
                                (o.iommu_cmdline ? " intel_iommu=on iommu=pt" : "") + "\n");
    t.File("/sys/module/kvm/refcnt", "1\n");
    if (o.vfio) {
      for (const char* m : {"vfio", "vfio_iommu_type1", "vfio_pci"}) {
        t.File(std::string("/sys/module/") + m + "/refcnt", "0\n");
      }
    }
    if (o.ovmf) t.File("/usr/share/OVMF/OVMF_CODE_4M.fd", std::string(4096, '\xff'));
    t.File("/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages",
           std::to_string(o.hugepages_free) + "\n");
    t.File("/sys/kernel/mm/hugepages/hugepages-1048576kB/free_hugepages",
           std::to_string(o.hugepages_free) + "\n");
    t.AbsLink("/var/run", "/run");  // as on Ubuntu: an absolute link, re-rooted by HostRoot
    t.Dir("/run");
    if (o.reboot_required) {
      t.File("/run/reboot-required", "*** System restart required ***\n");
      t.File("/run/reboot-required.pkgs", "linux-image-6.8.0-61-generic\n");
    }
  }

  void NetDevices() {
    t.File("/sys/devices/pci0000:00/0000:00:1c.4/0000:04:00.0/net/eno8303/operstate", "up\n");
    t.Link("/sys/class/net/eno8303",
           "/sys/devices/pci0000:00/0000:00:1c.4/0000:04:00.0/net/eno8303");
    t.File("/sys/devices/virtual/net/lo/operstate", "unknown\n");
    t.Link("/sys/class/net/lo", "/sys/devices/virtual/net/lo");
    if (o.bridge) {
      t.File("/sys/devices/virtual/net/ovsbr0/operstate", "unknown\n");
      t.Link("/sys/class/net/ovsbr0", "/sys/devices/virtual/net/ovsbr0");
    }
    if (o.tmfifo) {
      t.File("/sys/devices/virtual/net/tmfifo_net0/operstate", "up\n");
      t.Link("/sys/class/net/tmfifo_net0", "/sys/devices/virtual/net/tmfifo_net0");
    }
    t.File("/proc/sys/net/ipv4/ip_forward", o.ip_forward ? "1\n" : "0\n");
  }

  // /proc/net/route and /proc/net/fib_trie; `gw`: the bridge has the gateway address.
  void RoutesAndAddresses(bool gw) {
    std::string route =
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n";
    auto route_line = [&](const std::string& ifc, const std::string& dst, const std::string& via,
                          const std::string& flags, int metric, const std::string& mask) {
      route += ifc + "\t" + dst + "\t" + via + "\t" + flags + "\t0\t0\t" + std::to_string(metric) +
               "\t" + mask + "\t0\t0\t0\n";
    };
    route_line("eno8303", "00000000", RouteHex(10, 177, 36, 1), "0003", 100, "00000000");
    route_line("eno8303", RouteHex(10, 177, 36, 0), "00000000", "0001", 100,
               RouteHex(255, 255, 255, 0));
    if (gw) {
      route_line("ovsbr0", RouteHex(10, 100, 0, 0), "00000000", "0001", 0,
                 RouteHex(255, 255, 255, 0));
    }
    if (o.tmfifo) {
      route_line("tmfifo_net0", RouteHex(192, 168, 100, 0), "00000000", "0001", 0,
                 RouteHex(255, 255, 255, 252));
    }
    t.File("/proc/net/route", route);

    std::string trie = "Main:\n  +-- 0.0.0.0/0 3 0 5\n";
    auto local = [&](const std::string& ip) {
      trie += "     |-- " + ip + "\n        /32 host LOCAL\n";
    };
    trie += "     |-- 0.0.0.0\n        /0 universe UNICAST\n";
    if (gw) local("10.100.0.1");
    local("10.177.36.20");
    local("127.0.0.1");
    if (o.tmfifo) local("192.168.100.1");
    t.File("/proc/net/fib_trie", trie);
  }

  void MountTables() {
    std::string mnt;
    for (const auto& m : mounts) mnt += m + "\n";
    t.File("/proc/self/mounts", mnt);
    t.File("/proc/swaps", "Filename\t\t\t\tType\t\tSize\t\tUsed\t\tPriority\n");
  }

  // `ip -o -4 addr show`, canned; `gw`: the bridge has the gateway address.
  void IpTool(bool gw) {
    std::string out =
        "1: lo    inet 127.0.0.1/8 scope host lo\\       valid_lft forever preferred_lft "
        "forever\n"
        "2: eno8303    inet 10.177.36.20/24 metric 100 brd 10.177.36.255 scope global dynamic "
        "eno8303\\       valid_lft 85000sec preferred_lft 85000sec\n";
    if (gw) {
      out +=
          "7: ovsbr0    inet 10.100.0.1/24 brd 10.100.0.255 scope global ovsbr0\\       "
          "valid_lft forever preferred_lft forever\n";
    }
    if (o.tmfifo) {
      out +=
          "8: tmfifo_net0    inet 192.168.100.1/30 brd 192.168.100.3 scope global "
          "tmfifo_net0\\       valid_lft forever preferred_lft forever\n";
    }
    t.File("/usr/sbin/ip",
           "#!/bin/sh\n"
           "[ \"$*\" = \"-o -4 addr show\" ] || { echo \"ip: unexpected arguments: $*\" >&2; "
           "exit 2; }\n"
           "cat <<'EOF'\n" +
               out + "EOF\n",
           true);
  }

  // `iptables -t nat -S POSTROUTING`, canned.
  void IptablesTool() {
    std::string rules =
        "-P POSTROUTING ACCEPT\n"
        "-A POSTROUTING -s 172.17.0.0/16 ! -o docker0 -j MASQUERADE\n";
    if (o.nat_rule) rules += "-A POSTROUTING -s 10.100.0.0/24 -j MASQUERADE\n";
    t.File("/usr/sbin/iptables",
           "#!/bin/sh\n"
           "[ \"$*\" = \"-t nat -S POSTROUTING\" ] || { echo \"iptables: unexpected arguments: "
           "$*\" >&2; exit 2; }\n"
           "cat <<'EOF'\n" +
               rules + "EOF\n",
           true);
  }

  void Build() {
    const Layout l = LayoutOf();
    mounts = {"sysfs /sys sysfs rw,nosuid,nodev,noexec,relatime 0 0",
              "proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0",
              "tmpfs /run tmpfs rw,nosuid,nodev,size=26342612k,mode=755 0 0"};
    OnboardVga();
    GpuSwitches(l);
    DevicesOffSwitch(l);
    Prerequisites();
    NetDevices();
    const bool gw = o.bridge && o.gateway;
    RoutesAndAddresses(gw);
    MountTables();
    t.AbsLink("/sbin", "usr/sbin");  // as on merged-/usr systems
    if (o.ip_tool) IpTool(gw);
    if (o.iptables_tool) IptablesTool();
  }
};

}  // namespace

Result<void> BuildFixtureHost(const std::string& dir, const FixtureOptions& opts) {
  try {
    fs::path root = fs::absolute(dir);
    std::error_code ec;
    if (fs::exists(root, ec) && !fs::is_empty(root, ec)) {
      return Error::FailedPrecondition(reason::kFixtureDirNotEmpty,
                                       "fixture directory " + root.string() + " is not empty");
    }
    fs::create_directories(root);
    Builder b{opts, Tree(root), 10, {}, {"0-47,96-143", "48-95,144-191"}};
    b.Build();
    return Ok();
  } catch (const std::exception& e) {
    return Error::Internal(reason::kFixtureWriteFailed, e.what());
  }
}

}  // namespace gpuaas::node_agent
