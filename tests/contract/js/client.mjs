#!/usr/bin/env node
// An independent client of the GPUaaS control plane, written only from asyncapi/ and proto/:
// the official NATS JavaScript client and protobufjs loading proto/gpuaas/v1/*.proto at run time.
//
// It lists the catalog, places a gpu_slice allocation of an orderable slice SKU, follows its
// lifecycle on the scheduler's event stream, decodes the vm.provision node task sent for it,
// releases it and follows it to RELEASED. One line per step; exit 0 only when every check held,
// 1 on a failed check, 2 on the overall timeout.
//
// Usage: node client.mjs [--nats URL] [--seed-file F] [--inbox-prefix P] [--token-file F]
//                        [--region R] [--pool P] [--tenant T] [--timeout-s N] [--proto-dir DIR]
// Environment: GPUAAS_NATS_URL, GPUAAS_NATS_SEED_FILE, GPUAAS_NATS_INBOX_PREFIX,
//              GPUAAS_TOKEN_FILE, GPUAAS_REGION, GPUAAS_POOL, GPUAAS_TENANT,
//              GPUAAS_CLIENT_TIMEOUT_S, GPUAAS_PROTO_DIR (the flags win).
// Identity (asyncapi/roles.yaml, "Security" in the AsyncAPI document): the connection
// authenticates with the NATS nkey in the seed file and receives replies on its inbox prefix;
// every request carries the request token (Authorization: Bearer).
import crypto from "node:crypto";
import { parseArgs } from "node:util";
import fs from "node:fs";
import { connect, headers as natsHeaders, DeliverPolicy, nkeyAuthenticator } from "nats";
import { defaultProtoDir, loadContracts } from "./proto.mjs";

// ---- From asyncapi/gpuaas.asyncapi.yaml ----
const SUBJECT = {
  catalogList: "gpuaas.v1.scheduler.catalog.list",
  slotList: "gpuaas.v1.scheduler.slot.list",
  allocationCreate: "gpuaas.v1.scheduler.allocation.create",
  allocationRelease: "gpuaas.v1.scheduler.allocation.release",
  // schedulerAllocationChanged: gpuaas.v1.evt.scheduler.allocation.{state}
  allocationChanged: (state) => `gpuaas.v1.evt.scheduler.allocation.${state}`,
  // nodeTask: gpuaas.v1.node.{node_id}.task
  nodeTask: (node) => `gpuaas.v1.node.${node}.task`,
};
// schedulerAllocationChanged: "stream GPUAAS_EVT_SCHEDULER"; nodeTask: "stream GPUAAS_NODE_TASKS".
const STREAM = { scheduler: "GPUAAS_EVT_SCHEDULER", nodeTasks: "GPUAAS_NODE_TASKS" };

// ---- Options ----
const { values: args } = parseArgs({
  options: {
    nats: { type: "string" },
    "seed-file": { type: "string" },
    "inbox-prefix": { type: "string" },
    "token-file": { type: "string" },
    region: { type: "string" },
    pool: { type: "string" },
    tenant: { type: "string" },
    "timeout-s": { type: "string" },
    "proto-dir": { type: "string" },
  },
});
const opt = {
  nats: args.nats ?? process.env.GPUAAS_NATS_URL ?? "nats://127.0.0.1:4222",
  seedFile: args["seed-file"] ?? process.env.GPUAAS_NATS_SEED_FILE ?? "",
  inboxPrefix: args["inbox-prefix"] ?? process.env.GPUAAS_NATS_INBOX_PREFIX ?? "",
  tokenFile: args["token-file"] ?? process.env.GPUAAS_TOKEN_FILE ?? "",
  region: args.region ?? process.env.GPUAAS_REGION ?? "",
  pool: args.pool ?? process.env.GPUAAS_POOL ?? "",
  tenant: args.tenant ?? process.env.GPUAAS_TENANT ?? "contract-js",
  timeoutS: Number(args["timeout-s"] ?? process.env.GPUAAS_CLIENT_TIMEOUT_S ?? 60),
  protoDir: args["proto-dir"] ?? process.env.GPUAAS_PROTO_DIR ?? defaultProtoDir,
};
const REQUEST_TIMEOUT_MS = 10_000;

// ---- Reporting ----
let step = "0 setup";
class CheckFailed extends Error {}
function say(line) {
  console.log(line);
}
function fail(msg) {
  throw new CheckFailed(msg);
}
function expect(cond, msg) {
  if (!cond) fail(msg);
}
const timer = setTimeout(() => {
  console.log(`FAIL step ${step}: timed out after ${opt.timeoutS} s`);
  process.exit(2);
}, opt.timeoutS * 1000);

// ---- NATS helpers ----
let c; // the contracts
let nc; // the connection
let token = ""; // the request token

function traceparent() {
  return `00-${crypto.randomBytes(16).toString("hex")}-${crypto.randomBytes(8).toString("hex")}-01`;
}

// A request/reply call: `reqType` encoded, a gpuaas.v1.Reply decoded; on OK its result Any must
// hold `resultType`. Returns the decoded result.
async function call(subject, reqType, req, resultType) {
  const h = natsHeaders();
  h.set("traceparent", traceparent());
  h.set("Gpuaas-Deadline-Ms", String(Date.now() + REQUEST_TIMEOUT_MS));
  if (token) h.set("Authorization", `Bearer ${token}`);
  let msg;
  try {
    msg = await nc.request(subject, c.encode(reqType, req), { timeout: REQUEST_TIMEOUT_MS, headers: h });
  } catch (e) {
    if (String(e.code) === "503") fail(`${subject}: no service answers it (NATS no responders)`);
    if (String(e.code) === "TIMEOUT") fail(`${subject}: no reply within ${REQUEST_TIMEOUT_MS} ms`);
    fail(`${subject}: ${e.message}`);
  }
  let reply;
  try {
    reply = c.decode("gpuaas.v1.Reply", msg.data);
  } catch (e) {
    fail(`${subject}: the reply is not a gpuaas.v1.Reply: ${e.message}`);
  }
  const st = reply.status;
  expect(st, `${subject}: the Reply has no status`);
  if (st.code !== "OK") {
    const details = Object.entries(st.details ?? {})
      .map(([k, v]) => `${k}=${v}`)
      .join(" ");
    fail(`${subject}: ${st.code} ${st.reason}: ${st.message}${details ? ` (${details})` : ""}`);
  }
  try {
    return c.unpack(reply.result, resultType).value;
  } catch (e) {
    fail(`${subject}: OK reply, but its result: ${e.message}`);
  }
}

// The stream that holds `subject` must be the one the AsyncAPI document names.
async function checkStream(jsm, subject, want) {
  let got;
  try {
    got = await jsm.streams.find(subject);
  } catch (e) {
    fail(`no JetStream stream holds ${subject} (want ${want}): ${e.message}`);
  }
  expect(got === want, `${subject} is in stream ${got}, the AsyncAPI document says ${want}`);
  return (await jsm.streams.info(want)).state.last_seq;
}

// An ordered (ephemeral, client-side) consumer of `stream` filtered to `filter`, from stream
// sequence `startSeq` on; next() returns the following message.
class Feed {
  constructor(label) {
    this.label = label;
    this.buf = [];
    this.waiter = null;
    this.error = null;
  }
  async start(js, stream, filter, startSeq) {
    const consumer = await js.consumers.get(stream, {
      filterSubjects: filter, // one subject: filter_subject, which pre-2.10 servers know too
      deliver_policy: DeliverPolicy.StartSequence,
      opt_start_seq: startSeq,
    });
    this.msgs = await consumer.consume();
    (async () => {
      try {
        for await (const m of this.msgs) this.push(m);
      } catch (e) {
        this.error = e;
        this.push(null);
      }
    })();
    return this;
  }
  push(m) {
    this.buf.push(m);
    if (this.waiter) {
      const w = this.waiter;
      this.waiter = null;
      w();
    }
  }
  async next() {
    while (this.buf.length === 0) await new Promise((r) => (this.waiter = r));
    const m = this.buf.shift();
    if (m === null) fail(`${this.label}: the consumer stopped: ${this.error}`);
    return m;
  }
  stop() {
    this.msgs?.stop();
  }
}

// Decodes a JetStream message as a gpuaas.v1.Event whose data is `dataType`.
function decodeEvent(m, dataType) {
  let ev;
  try {
    ev = c.decode("gpuaas.v1.Event", m.data);
  } catch (e) {
    fail(`${m.subject} (seq ${m.seq}): not a gpuaas.v1.Event: ${e.message}`);
  }
  try {
    return { ev, data: c.unpack(ev.data, dataType).value };
  } catch (e) {
    fail(`${m.subject} (seq ${m.seq}) event ${ev.id}: ${e.message}`);
  }
}

// ---- The allocation lifecycle as seen on the event stream ----
const ORDER = [
  "ALLOCATION_STATE_PENDING",
  "ALLOCATION_STATE_RESERVED",
  "ALLOCATION_STATE_PROVISIONING",
  "ALLOCATION_STATE_ACTIVE",
  "ALLOCATION_STATE_RELEASING",
  "ALLOCATION_STATE_RELEASED",
];
let lastGeneration = -1n;
let lastRank = -1;
let latest = null; // the newest Allocation seen on the stream

// Reads allocation events until `target`; every event of our allocation is printed and checked:
// generations strictly increase, states only move forward, FAILED ends the run.
async function followUntil(feed, allocationId, target, stepNo) {
  const seen = [];
  for (;;) {
    const m = await feed.next();
    const { ev, data } = decodeEvent(m, "gpuaas.v1.AllocationSnapshot");
    const a = data.allocation;
    if (!a || a.allocation_id !== allocationId) continue; // another allocation's event
    const gen = BigInt(ev.generation);
    say(`step ${stepNo} event: gen=${ev.generation} ${a.state} on ${m.subject}`);
    expect(c.isValidEnum("gpuaas.v1.AllocationState", a.state), `event ${ev.id}: state ${a.state} is not a valid AllocationState`);
    expect(m.subject === SUBJECT.allocationChanged(c.enumText("gpuaas.v1.AllocationState", a.state)),
      `event ${ev.id}: ${a.state} published on ${m.subject}`);
    expect(ev.subject === allocationId, `event ${ev.id}: Event.subject is ${ev.subject}, not the allocation id`);
    expect(ev.generation === a.generation,
      `event ${ev.id}: Event.generation ${ev.generation} != the snapshot's generation ${a.generation}`);
    const msgId = m.headers?.get("Nats-Msg-Id");
    expect(msgId === ev.id, `event ${ev.id}: Nats-Msg-Id is ${msgId}, not the event id`);
    expect(gen > lastGeneration, `event ${ev.id}: generation ${gen} after ${lastGeneration} (out of order)`);
    lastGeneration = gen;
    if (a.state === "ALLOCATION_STATE_FAILED") {
      const f = a.failure;
      fail(`allocation ${allocationId} is ALLOCATION_STATE_FAILED: ` +
        (f ? `${f.stage} ${f.code}: ${f.detail}` : "with no AllocationFailure"));
    }
    const rank = ORDER.indexOf(a.state);
    expect(rank >= lastRank, `allocation went back from ${ORDER[lastRank]} to ${a.state}`);
    lastRank = rank;
    seen.push(a.state);
    latest = a;
    if (a.state === target) return seen;
  }
}

// ---- The run ----
async function main() {
  expect(opt.region, "no region: pass --region or set GPUAAS_REGION");
  expect(opt.timeoutS > 0, `bad timeout ${opt.timeoutS}`);
  c = loadContracts(opt.protoDir);
  try {
    const o = { servers: opt.nats, name: "gpuaas-contract-js", timeout: 5000 };
    if (opt.seedFile) {
      o.authenticator = nkeyAuthenticator(new TextEncoder().encode(fs.readFileSync(opt.seedFile, "utf8").trim()));
    }
    if (opt.inboxPrefix) o.inboxPrefix = opt.inboxPrefix;
    if (opt.tokenFile) token = fs.readFileSync(opt.tokenFile, "utf8").trim();
    nc = await connect(o);
  } catch (e) {
    fail(`cannot connect to NATS at ${opt.nats}: ${e.message}`);
  }
  const jsm = await nc.jetstreamManager();
  const js = nc.jetstream();

  // 1. The catalog.
  step = "1 catalog";
  const catalog = await call(SUBJECT.catalogList, "gpuaas.v1.ListCatalogRequest", {}, "gpuaas.v1.ListCatalogResponse");
  for (const s of catalog.skus) {
    expect(c.isValidEnum("gpuaas.v1.CapacityShape", s.shape), `catalog SKU ${s.name}: shape ${s.shape} is not valid`);
  }
  const defaultImage = catalog.images.find((i) => i.is_default);
  say(`step 1 catalog: ${catalog.skus.length} SKUs [${catalog.skus.map((s) => `${s.name}:${s.shape}${s.orderable ? "" : "(not orderable)"}`).join(", ")}], ` +
    `${catalog.images.length} images, default image ${defaultImage?.name ?? "(none)"}`);
  expect(defaultImage, "the catalog has no default image (is_default)");
  expect(/^[0-9a-f]{64}$/.test(defaultImage.sha256), `default image ${defaultImage.name}: sha256 ${defaultImage.sha256} is not 64 hex digits`);

  // 2. Pick an orderable gpu_slice SKU and place a slice.
  step = "2 create";
  const slices = catalog.skus.filter((s) => s.shape === "CAPACITY_SHAPE_GPU_SLICE" && s.orderable && s.allowed_gpu_counts.length > 0);
  expect(slices.length > 0, "the catalog has no orderable CAPACITY_SHAPE_GPU_SLICE SKU with allowed_gpu_counts");
  let sku = slices[0];
  if (slices.length > 1) {
    // Several: take one with free capacity in the region (the scheduler's slot projection).
    const slots = await call(SUBJECT.slotList, "gpuaas.v1.ListProjectedSlotsRequest", { region: opt.region }, "gpuaas.v1.ListProjectedSlotsResponse");
    const free = new Map(); // "gpu_sku node" -> schedulable free slots
    for (const s of slots.slots) {
      if (!s.schedulable || s.allocation_id) continue;
      const k = `${s.sku} ${s.node_id}`;
      free.set(k, (free.get(k) ?? 0) + 1);
    }
    const fits = (k) => Math.max(0, ...[...free].filter(([key]) => key.startsWith(`${k.gpu_sku} `)).map(([, n]) => n)) >= Math.min(...k.allowed_gpu_counts);
    sku = slices.find(fits) ?? slices[0];
  }
  const gpuCount = Math.min(...sku.allowed_gpu_counts);
  const requestId = crypto.randomUUID();

  // Subscribe before creating: both feeds start after the streams' current last sequence.
  const evtSeq = await checkStream(jsm, SUBJECT.allocationChanged("active"), STREAM.scheduler);
  const taskSeq = await checkStream(jsm, SUBJECT.nodeTask("contract-probe"), STREAM.nodeTasks);
  const events = await new Feed("allocation events").start(js, STREAM.scheduler, SUBJECT.allocationChanged("*"), evtSeq + 1);

  const created = await call(SUBJECT.allocationCreate, "gpuaas.v1.CreateAllocationRequest", {
    tenant: opt.tenant,
    request_id: requestId,
    sku: sku.name,
    gpu_count: gpuCount,
    region: opt.region,
    pool: opt.pool,
    ssh_authorized_keys: ["ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIGpuYWFzdGVzdA contract-js"],
  }, "gpuaas.v1.CreateAllocationResponse");
  const alloc = created.allocation;
  expect(alloc && alloc.allocation_id, "CreateAllocationResponse has no allocation");
  const id = alloc.allocation_id;
  say(`step 2 create: allocation ${id} sku=${sku.name} shape=${sku.shape} gpu_count=${gpuCount} ` +
    `region=${opt.region} request_id=${requestId} created=${created.created} state=${alloc.state} node=${alloc.node_id || "(none yet)"}`);
  expect(created.created === true, "created=false for a new request_id");
  expect(alloc.shape === "CAPACITY_SHAPE_GPU_SLICE", `allocation shape ${alloc.shape}`);
  expect(alloc.sku === sku.name && alloc.gpu_count === gpuCount && alloc.tenant === opt.tenant && alloc.request_id === requestId,
    `the allocation does not echo the request: ${JSON.stringify({ sku: alloc.sku, gpu_count: alloc.gpu_count, tenant: alloc.tenant, request_id: alloc.request_id })}`);
  expect(c.isValidEnum("gpuaas.v1.AllocationState", alloc.state), `create reply state ${alloc.state} is not valid`);
  if (alloc.state === "ALLOCATION_STATE_FAILED") fail(`allocation FAILED at once: ${JSON.stringify(alloc.failure)}`);

  // 3. Its lifecycle from the event stream, up to ACTIVE.
  step = "3 lifecycle";
  const up = await followUntil(events, id, "ALLOCATION_STATE_ACTIVE", 3);
  const iProv = up.indexOf("ALLOCATION_STATE_PROVISIONING");
  expect(iProv >= 0 && iProv < up.indexOf("ALLOCATION_STATE_ACTIVE"), `no PROVISIONING event before ACTIVE (saw ${up.join(", ")})`);
  const active = latest;
  expect(active.node_id, "the ACTIVE allocation names no node");
  expect(active.slot_keys.length === gpuCount, `ACTIVE allocation holds ${active.slot_keys.length} slots for gpu_count ${gpuCount}`);
  say(`step 3 lifecycle: ${up.join(" -> ")} node=${active.node_id} slots=${active.slot_keys.join(",")}` +
    `${active.network ? ` ip=${active.network.actual_ip}` : ""}`);

  // 4. The vm.provision task sent to its node (an ephemeral consumer, not the node's durable).
  step = "4 node task";
  const tasks = await new Feed("node tasks").start(js, STREAM.nodeTasks, SUBJECT.nodeTask(active.node_id), taskSeq + 1);
  let task;
  let taskMsg;
  for (;;) {
    const m = await tasks.next();
    const { data } = decodeEvent(m, "gpuaas.v1.NodeTask");
    const mine = data.correlation_id === id || data.vm_provision?.allocation_id === id;
    if (mine && (data.type === "TASK_TYPE_VM_PROVISION" || data.params === "vm_provision")) {
      task = data;
      taskMsg = m;
      break;
    }
  }
  tasks.stop();
  const b = task.vm_provision;
  say(`step 4 node task: ${task.type} params=${task.params} task_id=${task.task_id} node=${task.node_id} ` +
    `allocation_id=${b?.allocation_id} attempt=${b?.attempt} slots=${b?.slots.length} image=${b?.image?.name} sha256=${b?.image?.sha256} ` +
    `Nats-Msg-Id=${taskMsg.headers?.get("Nats-Msg-Id")}`);
  expect(task.type === "TASK_TYPE_VM_PROVISION", `task type ${task.type}, want TASK_TYPE_VM_PROVISION`);
  expect(task.params === "vm_provision", `params case ${task.params}, want vm_provision`);
  expect(task.node_id === active.node_id, `task for node ${task.node_id}, sent on ${taskMsg.subject}`);
  expect(b.allocation_id === id, `bundle allocation_id ${b.allocation_id} != ${id}`);
  expect(b.slots.length > 0, "the bundle has no slots");
  expect(b.slots.every((s) => s.slot_key && s.gpu_pci_address), "a bundle slot lacks slot_key or gpu_pci_address");
  expect([...b.slots.map((s) => s.slot_key)].sort().join() === [...active.slot_keys].sort().join(),
    `bundle slots ${b.slots.map((s) => s.slot_key)} != the allocation's ${active.slot_keys}`);
  expect(b.image && /^[0-9a-f]{64}$/.test(b.image.sha256), `bundle image sha256 ${b.image?.sha256} is not 64 hex digits`);
  expect(b.image.sha256 === defaultImage.sha256 && b.image.name === defaultImage.name,
    `bundle image ${b.image.name}/${b.image.sha256} is not the catalog default ${defaultImage.name}/${defaultImage.sha256}`);
  const taskMsgId = taskMsg.headers?.get("Nats-Msg-Id") ?? "";
  expect(taskMsgId.startsWith(`${id}.`) && taskMsgId.endsWith(`.${b.attempt}`),
    `task Nats-Msg-Id ${taskMsgId} is not <allocation id>.<type>.<attempt>`);

  // 5. Release, and follow it to RELEASED.
  step = "5 release";
  const rel = await call(SUBJECT.allocationRelease, "gpuaas.v1.ReleaseAllocationRequest", { allocation_id: id }, "gpuaas.v1.ReleaseAllocationResponse");
  say(`step 5 release: allocation ${id} state=${rel.allocation?.state}`);
  const down = await followUntil(events, id, "ALLOCATION_STATE_RELEASED", 5);
  events.stop();
  say(`step 5 lifecycle: ${down.join(" -> ")}`);

  step = "6 done";
  say(`step 6 PASS: catalog, create, ${up.length + down.length} lifecycle events in generation order, vm.provision task, release`);
}

main()
  .then(async () => {
    clearTimeout(timer);
    await nc?.close();
    process.exit(0);
  })
  .catch((e) => {
    clearTimeout(timer);
    console.log(`FAIL step ${step}: ${e instanceof CheckFailed ? e.message : e.stack || e}`);
    process.exit(1);
  });
