#!/usr/bin/env python3
"""Writes the hand-made seeds of fuzz/corpus/ (run from anywhere; protoc encodes the protobuf
ones). Inputs libFuzzer found and `scripts/fuzz --merge` kept sit beside them under content-hash
names; this script only rewrites the seed-*.* files it owns.

Layouts follow each target's FuzzedDataProvider use: integers are taken from the END of the input
(last byte first), strings from the front, each ended by a backslash and one more character."""
import base64
import json
import os
import subprocess
import sys

import yaml

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CORPUS = os.path.join(ROOT, "fuzz", "corpus")
END = b"\\ "  # ends a ConsumeRandomLengthString string


def encode(type_name, text):
    return subprocess.run(
        ["protoc", "--encode=" + type_name, "-I", os.path.join(ROOT, "proto")]
        + sorted(os.path.join("gpuaas/v1", f) for f in os.listdir(os.path.join(ROOT, "proto/gpuaas/v1"))
                 if f.endswith(".proto")),
        input=text.encode(), capture_output=True, check=True, cwd=os.path.join(ROOT, "proto")).stdout


def write(target, name, data):
    d = os.path.join(CORPUS, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, "seed-" + name), "wb") as f:
        f.write(data)


def served_subjects():
    """fuzz_requests' ServedSubjects() order: receive operations with a reply, in document order,
    one entry per channel message, then the two node reports."""
    doc = yaml.safe_load(open(os.path.join(ROOT, "asyncapi", "gpuaas.asyncapi.yaml")))
    out = []
    for op in doc["operations"].values():
        if op.get("action") != "receive" or "reply" not in op:
            continue
        ch = doc["channels"][op["channel"]["$ref"].rsplit("/", 1)[1]]
        for m in ch.get("messages", {}).values():
            msg = doc["components"]["messages"][m["$ref"].rsplit("/", 1)[1]]
            out.append((ch["address"], msg["x-protobuf-type"]))
    out.append(("node:lease_report", "gpuaas.v1.LeaseReport"))
    out.append(("node:topology_report", "gpuaas.v1.TopologyReport"))
    return out


def es256_token(claims):
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.hazmat.primitives.asymmetric.utils import decode_dss_signature
    src = open(os.path.join(ROOT, "fuzz", "fuzz_requests.cpp")).read()
    pem = src[src.index("-----BEGIN PRIVATE KEY-----"):src.index("-----END PRIVATE KEY-----") + 25]
    key = serialization.load_pem_private_key(pem.encode(), None)
    b64 = lambda b: base64.urlsafe_b64encode(b).rstrip(b"=")
    head = b64(json.dumps({"alg": "ES256", "typ": "JWT"}).encode())
    body = b64(json.dumps(claims).encode())
    r, s = decode_dss_signature(key.sign(head + b"." + body, ec.ECDSA(hashes.SHA256())))
    return head + b"." + body + b"." + b64(r.to_bytes(32, "big") + s.to_bytes(32, "big"))


PAYLOADS = {
    "gpuaas.v1.RegisterNodeRequest":
        'node_id: "node-a" hostname: "gpu-host-1.example" region: "eu-1" pool: "h200" '
        'labels { key: "rack" value: "r12" } agent_version: "0.1.0"',
    "gpuaas.v1.CreateAllocationRequest":
        'tenant: "acme" request_id: "r-1" sku: "h200-slice" gpu_count: 1 region: "eu-1" '
        'ssh_authorized_keys: "ssh-ed25519 AAAA x@y" hostname: "train-1"',
    "gpuaas.v1.SetSubnetRequest": 'node_id: "node-a" subnet: "10.100.0.0/24" gateway: "10.100.0.1"',
    "gpuaas.v1.ApproveSlotsRequest": 'node_id: "node-a" slot_keys: "node-a/0"',
    "gpuaas.v1.ListAllocationsRequest": 'tenant: "acme" page_size: 50',
    "gpuaas.v1.LeaseReport":
        'node_id: "node-a" document_version: 3 observations { slot_key: "node-a/0" '
        'mac: "52:54:00:aa:bb:01" expected_ip: "10.100.0.10" actual_ip: "10.100.0.10" '
        'lease_state: LEASE_STATE_BOUND hostname: "slice-1" }',
    "gpuaas.v1.TopologyReport":
        'node_id: "node-a" gpus { pci_address: "0000:18:00.0" vendor_id: "0x10de" device_id: "0x2335" } '
        'candidates { slot_key: "node-a/0" index: 0 gpu_pci_address: "0000:18:00.0" }',
}


def requests_seeds():
    served = served_subjects()
    now = 1748736000
    token = es256_token({"iss": "gpuaas", "aud": "gpuaas", "sub": "user:alice", "roles": ["operator"],
                         "jti": "0190d7a2-0000-7000-8000-000000000001", "iat": now - 60,
                         "exp": now + 3600})
    tenant_token = es256_token({"iss": "gpuaas", "aud": "gpuaas", "sub": "tenant:acme/bob",
                                "tenant": "acme", "roles": ["tenant"],
                                "jti": "0190d7a2-0000-7000-8000-000000000002", "iat": now - 60,
                                "exp": now + 600})
    tp = b"00-4bf92f3577b34da6a3ce929d0e0e4736-00f067aa0ba902b7-01"
    seen = set()
    for i, (subject, typ) in enumerate(served):
        if typ in seen and typ not in PAYLOADS:
            continue
        seen.add(typ)
        payload = encode(typ, PAYLOADS[typ]) if typ in PAYLOADS else b""
        auth = b"Bearer " + (tenant_token if "allocation" in subject else token)
        # mode 0: the served subject; ints from the end: subject index, then mode.
        data = tp + END + auth + END + payload + bytes([i % 256, 0])
        write("fuzz_requests", typ.split(".")[-1] + ".bin", data)
    # mode 1 (a fuzzed subject) and mode 2 (a token issued from the input).
    write("fuzz_requests", "subject.bin",
          b"gpuaas.v2.inventory.node.list" + END + tp + END + END + bytes([0, 1]))
    write("fuzz_requests", "issue.bin",
          tp + END + END + b"tenant:acme/bob" + END + b"acme" + END + bytes([0x10, 0x0e, 1, 1, 0, 2]))
    # mode 4: a Gpuaas-Deadline-Ms header (after the Authorization header).
    write("fuzz_requests", "deadline.bin",
          tp + END + END + str(now * 1000 + 5000).encode() + END + bytes([0, 4]))


def config_seeds():
    # ints from the end: the target (0 inventory, 1 ipam, 2 scheduler, 3 node-agent, 4 catalog),
    # then the environment key's index; the environment value is the first string.
    for i, name in enumerate(["inventory", "ipam", "scheduler", "node-agent"]):
        path = os.path.join(ROOT, "services", name, "config", name + ".yaml")
        write("fuzz_config", name + ".yaml", END + open(path, "rb").read() + bytes([3, i]))
    write("fuzz_config", "env-override.yaml", b"5000" + END + b"nats:\n  url: nats://127.0.0.1:4222\n" +
          bytes([2, 0]))
    catalog = os.path.join(ROOT, "services", "scheduler", "config", "catalog.yaml")
    write("fuzz_config", "catalog.yaml", open(catalog, "rb").read() + bytes([4]))


def leases_seeds():
    write("fuzz_dnsmasq_leases", "bound.leases",
          b"0 52:54:00:aa:bb:01 10.100.0.10 slice-1 01:52:54:00:aa:bb:01\n"
          b"4102444800 52:54:00:AA:BB:02 10.100.0.11 slice-2 *\n")
    write("fuzz_dnsmasq_leases", "mismatch-unexpected.leases",
          b"4102444800 52:54:00:aa:bb:03 10.100.0.99 * *\n"
          b"4102444800 52:54:00:de:ad:01 10.100.0.50 intruder *\n"
          b"1 52:54:00:aa:bb:01 10.100.0.10 expired *\n")
    write("fuzz_dnsmasq_leases", "duid.leases",
          b"duid 00:01:00:01:2c:5f:1a:2b:52:54:00:aa:bb:01\n"
          b"4102444800 1234 fd00::10 slice-1 00:01:00:01\n")


def domain_seeds():
    bundle = (
        'allocation_id: "0190d7a2-1c2b-7e3f-8a4b-5c6d7e8f9a0b" attempt: 1 tenant: "acme" '
        'network_mode: NETWORK_MODE_PRIVATE_NAT '
        'slots { slot_key: "node-a/0" gpu_pci_address: "0000:18:00.0" '
        'fabric_vf_pci_address: "0000:19:00.1" nvme_by_id: "/dev/disk/by-id/nvme-eui.01" '
        'mac: "52:54:00:aa:bb:01" private_ip: "10.100.0.10" numa_node: 0 } '
        'slots { slot_key: "node-a/1" gpu_pci_address: "0000:2d:00.0" '
        'nvme_by_id: "/dev/disk/by-id/nvme-eui.02" mac: "52:54:00:aa:bb:02" numa_node: 0 } '
        'shape { profile: "h200_24c_64g" vcpus: 48 memory_mib: 131072 hugepages_1g: 128 }')
    wire = encode("gpuaas.v1.ProvisionBundle", bundle)
    for mode in (0, 1, 2, 4, 8, 16):
        write("fuzz_domain_xml", "bundle-%02x.bin" % mode, bytes([mode]) + wire)
    write("fuzz_domain_xml", "readback.xml", b"\x80" + (
        b"<domain type='kvm'><devices><hostdev mode='subsystem' type='pci' managed='yes'>"
        b"<driver name='vfio'/><source><address domain='0x0000' bus='0x18' slot='0x00' "
        b"function='0x0'/></source><address type='pci' domain='0x0000' bus='0x06' slot='0x00' "
        b"function='0x0'/></hostdev></devices></domain>"))


def discovery_seeds():
    # ints from the end: the number of edits, then per edit the file index; the contents are the
    # strings. The last edit takes the rest of the input.
    write("fuzz_discovery", "mounts", b"/dev/nvme1n1p1 /share\\040one ext4 rw 0 0\n"
          b"/dev/mapper/vg-root / ext4 rw 0 0\n" + bytes([0, 1]))
    write("fuzz_discovery", "route", b"Iface\tDestination\tGateway\tFlags\tRefCnt\tUse\tMetric\tMask\n"
          b"ovsbr0\t0064000A\t00000000\t0001\t0\t0\t0\t00FFFFFF\n" + bytes([7, 1]))
    write("fuzz_discovery", "numa", b"-1" + END + b"7\n" + bytes([40, 41, 2]))


if __name__ == "__main__":
    requests_seeds()
    config_seeds()
    leases_seeds()
    domain_seeds()
    discovery_seeds()
    print("seeds written under", CORPUS, file=sys.stderr)
