// Offline check of the client's protobuf handling (no NATS, no services): the contracts load
// from proto/ with protobufjs, and the messages the client relies on round-trip with enums as
// names and oneofs as their case. Run: node selftest.mjs (exit 0 = every check held).
import assert from "node:assert/strict";
import { loadContracts } from "./proto.mjs";

const c = loadContracts(process.env.GPUAAS_PROTO_DIR || undefined);
let checks = 0;
function check(name, fn) {
  fn();
  checks++;
  console.log(`ok ${checks} ${name}`);
}

const sha = "ab".repeat(32);
const allocationId = "0190f0c8-0000-7000-8000-000000000001";

check("every contract file loads", () => {
  for (const f of ["event", "status", "types", "scheduler", "node"]) {
    assert.ok(c.files.includes(`gpuaas/v1/${f}.proto`), f);
  }
  for (const t of [
    "gpuaas.v1.Event",
    "gpuaas.v1.Reply",
    "gpuaas.v1.ListCatalogRequest",
    "gpuaas.v1.ListCatalogResponse",
    "gpuaas.v1.CreateAllocationRequest",
    "gpuaas.v1.CreateAllocationResponse",
    "gpuaas.v1.ReleaseAllocationRequest",
    "gpuaas.v1.ReleaseAllocationResponse",
    "gpuaas.v1.AllocationSnapshot",
    "gpuaas.v1.NodeTask",
    "gpuaas.v1.ProvisionBundle",
  ]) {
    c.type(t);
  }
});

check("NodeTask with vm_provision params round-trips inside an Event", () => {
  const task = {
    task_id: "0190f0c8-0000-7000-8000-0000000000aa",
    node_id: "node-1",
    type: "TASK_TYPE_VM_PROVISION",
    correlation_id: allocationId,
    vm_provision: {
      allocation_id: allocationId,
      attempt: 1,
      tenant: "acme",
      network_mode: "NETWORK_MODE_PRIVATE_NAT",
      slots: [{ slot_key: "gpu0", gpu_pci_address: "0000:19:00.0", fabric_type: "FABRIC_TYPE_ROCE", numa_node: 0 }],
      image: { name: "ubuntu", url: "file:///img", sha256: sha },
      shape: { vcpus: 8, memory_mib: 65536 },
    },
  };
  const ev = c.encode("gpuaas.v1.Event", {
    id: "e1",
    specversion: "1.0",
    type: "gpuaas.v1.node.task",
    generation: 7,
    data: c.pack("gpuaas.v1.NodeTask", task),
  });
  const e = c.decode("gpuaas.v1.Event", ev);
  assert.equal(e.generation, "7", "int64 as a decimal string");
  const { type, value: t } = c.unpack(e.data, "gpuaas.v1.NodeTask");
  assert.equal(type, "gpuaas.v1.NodeTask");
  assert.equal(t.type, "TASK_TYPE_VM_PROVISION");
  assert.equal(t.params, "vm_provision", "oneof case by name");
  assert.equal(t.vm_provision.allocation_id, allocationId);
  assert.equal(t.vm_provision.network_mode, "NETWORK_MODE_PRIVATE_NAT");
  assert.equal(t.vm_provision.slots.length, 1);
  assert.equal(t.vm_provision.slots[0].fabric_type, "FABRIC_TYPE_ROCE");
  assert.equal(t.vm_provision.slots[0].numa_node, 0, "proto3 optional keeps an explicit 0");
  assert.equal(t.vm_provision.image.sha256, sha);
  assert.ok(t.vm_release == null && t.slot_cleanup == null, "the other cases are unset");
});

check("a NodeTask whose params case is another task decodes as that case", () => {
  const bytes = c.encode("gpuaas.v1.NodeTask", {
    type: "TASK_TYPE_SLOT_CLEANUP",
    slot_cleanup: { allocation_id: allocationId, slots: [{ slot_key: "gpu1" }] },
  });
  const t = c.decode("gpuaas.v1.NodeTask", bytes);
  assert.equal(t.params, "slot_cleanup");
  assert.equal(t.type, "TASK_TYPE_SLOT_CLEANUP");
});

check("Reply with an Any result (ListCatalogResponse) round-trips", () => {
  const catalog = {
    skus: [
      {
        name: "bm",
        shape: "CAPACITY_SHAPE_BAREMETAL",
        allowed_gpu_counts: [8],
        orderable: true,
      },
      {
        name: "slice",
        shape: "CAPACITY_SHAPE_GPU_SLICE",
        gpu_sku: "h200-sxm",
        allowed_gpu_counts: [1, 2, 4],
        network_modes: ["NETWORK_MODE_PRIVATE_NAT"],
        runtime_profile: { vcpus_per_gpu: 8, memory_mib_per_gpu: 65536 },
        orderable: true,
      },
      { name: "mig", shape: "CAPACITY_SHAPE_GPU_PARTITION", sharing_mechanism: "mig" },
    ],
    images: [{ name: "ubuntu", url: "file:///img", sha256: sha, is_default: true }],
  };
  const bytes = c.encode("gpuaas.v1.Reply", {
    status: { code: "OK" },
    result: c.pack("gpuaas.v1.ListCatalogResponse", catalog),
  });
  const r = c.decode("gpuaas.v1.Reply", bytes);
  assert.equal(r.status.code, "OK");
  assert.equal(r.status.retryable, false);
  const { value } = c.unpack(r.result, "gpuaas.v1.ListCatalogResponse");
  assert.equal(value.skus.length, 3);
  assert.equal(value.skus[1].shape, "CAPACITY_SHAPE_GPU_SLICE");
  assert.deepEqual(value.skus[1].allowed_gpu_counts, [1, 2, 4]);
  assert.deepEqual(value.skus[1].network_modes, ["NETWORK_MODE_PRIVATE_NAT"]);
  assert.equal(value.skus[1].runtime_profile.memory_mib_per_gpu, "65536");
  assert.equal(value.skus[2].orderable, false);
  assert.equal(value.skus[0].fabric_type, "FABRIC_TYPE_UNSPECIFIED", "defaults as names");
  assert.equal(value.images[0].is_default, true);
  assert.throws(() => c.unpack(r.result, "gpuaas.v1.CreateAllocationResponse"), /expected/);
});

check("an error Reply carries a named code and details", () => {
  const r = c.decode(
    "gpuaas.v1.Reply",
    c.encode("gpuaas.v1.Reply", {
      status: {
        code: "RESOURCE_EXHAUSTED",
        reason: "no_placement",
        details: { free_gpus_in_region: "0" },
        retryable: true,
      },
    }),
  );
  assert.equal(r.status.code, "RESOURCE_EXHAUSTED");
  assert.equal(r.status.details.free_gpus_in_region, "0");
  assert.equal(r.result, null);
});

check("AllocationSnapshot states decode as AllocationState names", () => {
  const b = c.encode("gpuaas.v1.AllocationSnapshot", {
    allocation: { allocation_id: allocationId, state: "ALLOCATION_STATE_ACTIVE", generation: 3, shape: "CAPACITY_SHAPE_GPU_SLICE" },
  });
  const s = c.decode("gpuaas.v1.AllocationSnapshot", b);
  assert.equal(s.allocation.state, "ALLOCATION_STATE_ACTIVE");
  assert.equal(s.allocation.generation, "3");
  assert.equal(s.allocation.failure, null);
});

check("enum text forms follow types.proto", () => {
  assert.equal(c.enumText("gpuaas.v1.AllocationState", "ALLOCATION_STATE_ACTIVE"), "active");
  assert.equal(c.enumText("gpuaas.v1.AllocationState", "ALLOCATION_STATE_RELEASED"), "released");
  assert.equal(c.enumText("gpuaas.v1.TaskType", "TASK_TYPE_VM_PROVISION"), "vm.provision");
  assert.equal(c.enumText("gpuaas.v1.NetworkMode", "NETWORK_MODE_PRIVATE_NAT"), "private-nat");
  assert.ok(!c.isValidEnum("gpuaas.v1.AllocationState", "ALLOCATION_STATE_UNSPECIFIED"));
  assert.ok(c.isValidEnum("gpuaas.v1.AllocationState", "ALLOCATION_STATE_PENDING"));
});

check("requests with a field the contract lacks are refused", () => {
  assert.throws(() => c.encode("gpuaas.v1.CreateAllocationRequest", { tenant: "a", gpus: 1 }), /no field gpus/);
  assert.throws(() => c.encode("gpuaas.v1.CreateAllocationRequest", { network_mode: "NOPE" }));
});

console.log(`selftest: ${checks} passed, 0 failed`);
