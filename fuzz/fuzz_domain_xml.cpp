// fuzz_domain_xml: the libvirt domain XML of a slice VM. Input byte 0 picks the mode:
// - bit 7 set: the rest is domain XML as libvirt might return it, scanned by
//   HostdevPciAddresses (CheckDevicesFree's read-back): every address it returns is canonical
//   ("dddd:bb:ss.f", lowercase hex).
// - otherwise: the rest is a gpuaas.v1.ProvisionBundle (the scheduler's bundle: allocation id,
//   tenant, slot keys, MACs, PCI addresses, shape) and bits 0-4 pick agent options (passthrough,
//   OVS bridge, VNC on a socket, direct kernel boot, a mapped disk path). GenerateDomainXml either
//   refuses with INVALID_ARGUMENT and a reason, or returns XML that libxml2 parses as well-formed,
//   whose elements are only those the generator writes (a fuzzed string cannot add markup), with
//   exactly one <name> (gpuaas-<allocation id>), one <interface>, one <hostdev> per GPU and VF,
//   and whose hostdevs HostdevPciAddresses reads back as exactly the bundle's devices.
#include <google/protobuf/stubs/logging.h>
#include <libxml/parser.h>
#include <libxml/tree.h>

#include <cstddef>
#include <cstdint>
#include <map>
#include <set>
#include <string>
#include <vector>

#include "fuzz_check.hpp"
#include "gpuaas/node_agent/host/host.hpp"
#include "gpuaas/node_agent/runtime/domain_xml.hpp"
#include "gpuaas/node_agent/runtime/libvirt_runtime.hpp"
#include "gpuaas/v1/node.pb.h"

namespace gpuaas::fuzz {
namespace {

namespace na = node_agent;

// Every element GenerateDomainXml writes (domain_xml.cpp; gpuaas:allocation by its local name).
const std::set<std::string>& Elements() {
  static const std::set<std::string> names = {
      "acpi",       "address", "allocation", "apic",     "backend",       "boot",
      "clock",      "cmdline", "console",    "cpu",      "devices",       "disk",
      "domain",     "driver",  "emulator",   "features", "graphics",      "hostdev",
      "hugepages",  "initrd",  "interface",  "kernel",   "listen",        "loader",
      "log",        "mac",     "memballoon", "memory",   "memoryBacking", "metadata",
      "model",      "name",    "numatune",   "nvram",    "on_crash",      "on_poweroff",
      "on_reboot",  "os",      "page",       "port",     "readonly",      "rng",
      "serial",     "source",  "target",     "type",     "vcpu",          "video",
      "virtualport"};
  return names;
}

struct Shape {
  std::map<std::string, int> count;
  std::string name_text;
  std::vector<std::string> unknown;
};

void Walk(xmlNode* n, Shape& s, int depth) {
  for (; n != nullptr; n = n->next) {
    if (n->type != XML_ELEMENT_NODE) continue;
    const std::string name = reinterpret_cast<const char*>(n->name);
    ++s.count[name];
    if (Elements().count(name) == 0) s.unknown.push_back(name);
    if (name == "name" && depth == 1) {
      xmlChar* t = xmlNodeGetContent(n);
      s.name_text = t == nullptr ? "" : reinterpret_cast<const char*>(t);
      xmlFree(t);
    }
    Walk(n->children, s, depth + 1);
  }
}

// "dddd:bb:ss.f" as HostdevPciAddresses formats it: four lowercase hex fields (wider when
// libvirt's values are), never anything else.
bool Canonical(const std::string& a) {
  const size_t c1 = a.find(':');
  const size_t c2 = a.find(':', c1 == std::string::npos ? 0 : c1 + 1);
  const size_t dot = a.find('.');
  if (c1 == std::string::npos || c2 == std::string::npos || dot == std::string::npos || c1 < 4 ||
      c2 - c1 < 3 || dot - c2 < 3 || dot + 1 >= a.size() ||
      a.find_first_of(":.", dot + 1) != std::string::npos) {
    return false;
  }
  for (char c : a) {
    if (!((c >= '0' && c <= '9') || (c >= 'a' && c <= 'f') || c == ':' || c == '.')) return false;
  }
  return true;
}

void CheckReadBack(const std::string& xml) {
  for (const auto& a : na::HostdevPciAddresses(xml)) FUZZ_CHECK(Canonical(a), a);
}

// "0000:18:00.0" as HostdevPciAddresses writes it back (lowercase, 4+ digit domain).
std::string Normal(const std::string& addr) {
  std::string out = na::Lower(addr);
  const size_t c1 = out.find(':');
  if (c1 != std::string::npos && c1 < 4) out.insert(0, 4 - c1, '0');
  while (out.size() > 12 && out[0] == '0') out.erase(0, 1);
  return out;
}

void CheckGenerate(uint8_t mode, const std::string& wire) {
  v1::ProvisionBundle b;
  if (!b.ParseFromString(wire)) return;
  na::DomainXmlOptions o;
  o.seed_iso = "/var/lib/gpuaas/seeds/seed.iso";
  o.passthrough = (mode & 1) == 0;
  o.bridge_is_ovs = (mode & 2) != 0;
  if ((mode & 4) != 0) o.vnc_socket = "/run/gpuaas/vnc/x.sock";
  if ((mode & 8) != 0) {
    o.kernel = "/var/lib/gpuaas/vmlinuz";
    o.initrd = "/var/lib/gpuaas/initrd.img";
  }
  if ((mode & 16) != 0 && b.slots_size() > 0) {
    o.disk_paths[b.slots(0).slot_key()] = "/dev/disk/by-id/nvme-eui.0001";
  }
  o.serial_log = "/var/log/gpuaas/serial.log";
  o.numa_cpuset = "0-47";
  auto xml = na::GenerateDomainXml(b, o);
  if (!xml.ok()) {
    FUZZ_CHECK_ERROR(xml.error(), Code::kInvalidArgument);
    return;
  }
  xmlDoc* doc = xmlReadMemory(xml->data(), static_cast<int>(xml->size()), "domain.xml", nullptr,
                              XML_PARSE_NONET | XML_PARSE_NOERROR | XML_PARSE_NOWARNING);
  FUZZ_CHECK(doc != nullptr, "GenerateDomainXml returned XML libxml2 cannot parse for bundle " +
                                 b.ShortDebugString());
  Shape s;
  Walk(xmlDocGetRootElement(doc), s, 0);
  xmlFreeDoc(doc);
  FUZZ_CHECK(s.unknown.empty(), "injected element <" + (s.unknown.empty() ? "" : s.unknown[0]) +
                                    "> from bundle " + b.ShortDebugString());
  FUZZ_CHECK(s.count["domain"] == 1 && s.count["interface"] == 1 && s.count["devices"] == 1, *xml);
  FUZZ_CHECK(s.name_text == na::DomainName(b.allocation_id()), s.name_text);

  std::multiset<std::string> want;
  if (o.passthrough) {
    for (const auto& slot : b.slots()) {
      if (!slot.gpu_pci_address().empty()) want.insert(Normal(slot.gpu_pci_address()));
      if (!slot.fabric_vf_pci_address().empty()) want.insert(Normal(slot.fabric_vf_pci_address()));
    }
  }
  FUZZ_CHECK(s.count["hostdev"] == static_cast<int>(want.size()), *xml);
  const auto back = na::HostdevPciAddresses(*xml);
  const std::multiset<std::string> got(back.begin(), back.end());
  FUZZ_CHECK(got == want, *xml);
  // Each device once: a device passed through twice is a domain libvirt refuses to start.
  FUZZ_CHECK(std::set<std::string>(got.begin(), got.end()).size() == got.size(), *xml);
}

}  // namespace
}  // namespace gpuaas::fuzz

extern "C" int LLVMFuzzerInitialize(int* /*argc*/, char*** /*argv*/) {
  xmlInitParser();
  // Parsing refuses strings that are not UTF-8 and says so on stderr at every input.
  google::protobuf::SetLogHandler(nullptr);
  return 0;
}

extern "C" int LLVMFuzzerTestOneInput(const uint8_t* data, size_t size) {
  if (size == 0) return 0;
  const std::string rest(reinterpret_cast<const char*>(data) + 1, size - 1);
  if ((data[0] & 0x80) != 0) {
    gpuaas::fuzz::CheckReadBack(rest);
  } else {
    gpuaas::fuzz::CheckGenerate(data[0], rest);
  }
  return 0;
}
