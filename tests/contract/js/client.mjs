#!/usr/bin/env node
// An independent client of the GPUaaS control plane, written only from asyncapi/ and proto/:
// the official NATS JavaScript client and protobufjs loading proto/gpuaas/v1/*.proto at run time.
//
// It runs as a tenant gateway (docs/integrating.md walks through the same steps): the `tenant-api`
// NATS identity and a tenant's request token, nothing more. It lists the catalog and picks an
// orderable gpu_slice SKU with capacity in the region (CatalogSku.availability), opens a durable
// pull consumer of the tenant's feed (stream GPUAAS_TENANT_FEED, filtered to the tenant), places
// a slice, follows it on that feed to ACTIVE (checking and acking every event), releases it,
// follows it to RELEASED and deletes its durable. One line per step; exit 0 only when every
// check held, 1 on a failed check, 2 on the overall timeout.
//
// Usage: node client.mjs --seed-file F --token-file F --region R [--nats URL] [--inbox-prefix P]
//                        [--client-role R] [--pool P] [--tenant T] [--timeout-s N] [--proto-dir DIR]
// Environment: GPUAAS_NATS_URL, GPUAAS_NATS_SEED_FILE, GPUAAS_NATS_INBOX_PREFIX,
//              GPUAAS_CLIENT_ROLE, GPUAAS_TOKEN_FILE, GPUAAS_REGION, GPUAAS_POOL, GPUAAS_TENANT,
//              GPUAAS_CLIENT_TIMEOUT_S, GPUAAS_PROTO_DIR (the flags win).
// Identity (asyncapi/roles.yaml, "Security" in the AsyncAPI document): the connection
// authenticates with the tenant-api nkey in the seed file and receives replies only on its inbox
// prefix `_INBOX.tenant-api` (the only inbox that identity may subscribe to); it sends each
// request on `<subject>.tenant-api` (a client role's connection may not publish the bare
// subject), carrying the tenant token (Authorization: Bearer; roles [tenant], tenant = --tenant:
// a tenant-api connection may present tenant tokens only). Its JetStream calls are only those
// the role is granted on GPUAAS_TENANT_FEED (stream info; create, info, pull, ack and delete its
// durable): no account info (hence checkAPI: false), no stream lookup, no platform stream.
import crypto from "node:crypto";
import { parseArgs } from "node:util";
import fs from "node:fs";
import {
  AckPolicy,
  connect,
  DeliverPolicy,
  ErrorCode,
  Events,
  headers as natsHeaders,
  nanos,
  nkeyAuthenticator,
} from "nats";
import { defaultProtoDir, loadContracts } from "./proto.mjs";

// ---- From asyncapi/gpuaas.asyncapi.yaml ----
const SUBJECT = {
  catalogList: "gpuaas.v1.scheduler.catalog.list",
  allocationCreate: "gpuaas.v1.scheduler.allocation.create",
  allocationRelease: "gpuaas.v1.scheduler.allocation.release",
  // The tenant feed: gpuaas.v1.tenant.{tenant}.evt.scheduler.allocation.{state}, each allocation
  // event of gpuaas.v1.evt.scheduler.allocation.{state} again, unchanged, on its tenant's subject.
  tenantAllocationChanged: (tenant, state) => `gpuaas.v1.tenant.${tenant}.evt.scheduler.allocation.${state}`,
};
// The feed's stream and the subjects it holds.
const FEED = { stream: "GPUAAS_TENANT_FEED", subjects: "gpuaas.v1.tenant.*.evt.>" };

// ---- Options ----
const { values: args } = parseArgs({
  options: {
    nats: { type: "string" },
    "seed-file": { type: "string" },
    "inbox-prefix": { type: "string" },
    "client-role": { type: "string" },
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
  inboxPrefix: args["inbox-prefix"] ?? process.env.GPUAAS_NATS_INBOX_PREFIX ?? "_INBOX.tenant-api",
  clientRole: args["client-role"] ?? process.env.GPUAAS_CLIENT_ROLE ?? "tenant-api",
  tokenFile: args["token-file"] ?? process.env.GPUAAS_TOKEN_FILE ?? "",
  region: args.region ?? process.env.GPUAAS_REGION ?? "",
  pool: args.pool ?? process.env.GPUAAS_POOL ?? "",
  tenant: args.tenant ?? process.env.GPUAAS_TENANT ?? "contract-js",
  timeoutS: Number(args["timeout-s"] ?? process.env.GPUAAS_CLIENT_TIMEOUT_S ?? 60),
  protoDir: args["proto-dir"] ?? process.env.GPUAAS_PROTO_DIR ?? defaultProtoDir,
};
const REQUEST_TIMEOUT_MS = 10_000;
const RELEASE_REASON = "contract-js: done";

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

// ---- NATS helpers ----
let c; // the contracts
let nc; // the connection
let token = ""; // the request token
let claims = null; // its claims (the gateway minted it, so it may read them)
let feed = null; // the durable on the tenant feed, once created

function traceparent() {
  return `00-${crypto.randomBytes(16).toString("hex")}-${crypto.randomBytes(8).toString("hex")}-01`;
}

// The claims of a JWT (not verified here: the services verify it).
function tokenClaims(jwt) {
  const parts = jwt.split(".");
  expect(parts.length === 3, "the token is not a JWT (header.payload.signature)");
  try {
    return JSON.parse(Buffer.from(parts[1], "base64url").toString("utf8"));
  } catch (e) {
    fail(`the token's payload is not JSON: ${e.message}`);
  }
}

// A request/reply call: `reqType` encoded, a gpuaas.v1.Reply decoded; on OK its result Any must
// hold `resultType`. Returns the decoded result.
async function call(subject, reqType, req, resultType) {
  const h = natsHeaders();
  h.set("traceparent", traceparent());
  h.set("Gpuaas-Deadline-Ms", String(Date.now() + REQUEST_TIMEOUT_MS));
  h.set("Authorization", `Bearer ${token}`);
  // A client role's connection sends `<subject>.<client role>`.
  const wire = opt.clientRole ? `${subject}.${opt.clientRole}` : subject;
  let msg;
  try {
    msg = await nc.request(wire, c.encode(reqType, req), { timeout: REQUEST_TIMEOUT_MS, headers: h });
  } catch (e) {
    if (e.code === ErrorCode.NoResponders) fail(`${wire}: no service answers it (NATS no responders)`);
    if (e.code === ErrorCode.Timeout) fail(`${wire}: no reply within ${REQUEST_TIMEOUT_MS} ms`);
    if (e.code === ErrorCode.PermissionsViolation) fail(`${wire}: the NATS server refuses this identity the subject (${e.message})`);
    fail(`${wire}: ${e.message}`);
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
    fail(`${subject}: ${st.code} ${st.reason}: ${st.message}${details ? ` (${details})` : ""}${st.retryable ? " [retryable]" : ""}`);
  }
  try {
    return c.unpack(reply.result, resultType).value;
  } catch (e) {
    fail(`${subject}: OK reply, but its result: ${e.message}`);
  }
}

// A durable pull consumer of the tenant feed: created (jsm.consumers.add), bound
// (js.consumers.get: CONSUMER.INFO), read with consume() (CONSUMER.MSG.NEXT on an inbox under the
// connection's prefix), each message acked by the caller (ackAck: the server confirms it), and
// deleted at the end (jsm.consumers.delete). next() returns the following message.
class Feed {
  constructor(jsm, js, name, filter) {
    this.jsm = jsm;
    this.js = js;
    this.name = name;
    this.filter = filter;
    this.buf = [];
    this.waiter = null;
    this.error = null;
    this.msgs = null;
  }
  async create() {
    // One filter subject: the API subject is $JS.API.CONSUMER.CREATE.<stream>.<name>.<filter>.
    return this.jsm.consumers.add(FEED.stream, {
      durable_name: this.name,
      filter_subject: this.filter,
      deliver_policy: DeliverPolicy.New,
      ack_policy: AckPolicy.Explicit,
      // A run that dies before it deletes its durable leaves it to the server for 5 minutes.
      inactive_threshold: nanos(5 * 60 * 1000),
    });
  }
  async start() {
    const consumer = await this.js.consumers.get(FEED.stream, this.name);
    this.msgs = await consumer.consume({ max_messages: 16, expires: 10_000 });
    (async () => {
      try {
        for await (const m of this.msgs) this.push(m);
      } catch (e) {
        this.error = e;
      }
      this.push(null);
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
    if (m === null) fail(`durable ${this.name}: the consumer stopped${this.error ? `: ${this.error.message}` : ""}`);
    return m;
  }
  stop() {
    this.msgs?.stop();
  }
  async delete() {
    this.stop();
    return this.jsm.consumers.delete(FEED.stream, this.name);
  }
}

// Best effort on a failed run: the durable goes (else the server drops it after 5 idle minutes).
async function cleanup() {
  if (!feed || !nc || nc.isClosed()) return;
  const f = feed;
  feed = null;
  await Promise.race([f.delete().catch(() => {}), new Promise((r) => setTimeout(r, 2000))]);
}

let timedOut = false;
const timer = setTimeout(() => {
  timedOut = true; // what fails from here on is the timeout's doing
  console.log(`FAIL step ${step}: timed out after ${opt.timeoutS} s`);
  cleanup().finally(() => process.exit(2));
}, opt.timeoutS * 1000);

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

// ---- The allocation lifecycle as seen on the tenant feed ----
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
let latest = null; // the newest Allocation seen on the feed
const eventOf = {}; // state -> the Event that announced it
const seenIds = new Set(); // event ids already applied: the feed is at-least-once
let eventsRead = 0;

// Reads the durable until our allocation reaches `target`. Every message must be one of this
// tenant's allocation events on its tenant subject, with Nats-Msg-Id = the event id; each is
// acked once checked, and an id seen before is skipped (a redelivery). Events of our allocation
// are printed and checked: generations strictly increase, states only move forward, FAILED ends
// the run.
async function followUntil(allocationId, target, stepNo) {
  const seen = [];
  for (;;) {
    const m = await feed.next();
    const { ev, data } = decodeEvent(m, "gpuaas.v1.AllocationSnapshot");
    const a = data.allocation;
    expect(a, `${m.subject} (seq ${m.seq}) event ${ev.id}: the snapshot has no allocation`);
    expect(a.tenant === opt.tenant, `${m.subject} (seq ${m.seq}): an event of tenant ${a.tenant} on tenant ${opt.tenant}'s durable`);
    expect(c.isValidEnum("gpuaas.v1.AllocationState", a.state), `event ${ev.id}: state ${a.state} is not a valid AllocationState`);
    expect(m.subject === SUBJECT.tenantAllocationChanged(opt.tenant, c.enumText("gpuaas.v1.AllocationState", a.state)),
      `event ${ev.id}: ${a.state} of tenant ${a.tenant} published on ${m.subject}`);
    const msgId = m.headers?.get("Nats-Msg-Id");
    expect(msgId === ev.id, `event ${ev.id}: Nats-Msg-Id is ${msgId}, not the event id`);
    try {
      await m.ackAck();
    } catch (e) {
      fail(`event ${ev.id} (seq ${m.seq}): the ack was not confirmed: ${e.message}`);
    }
    eventsRead++;
    if (seenIds.has(ev.id)) {
      say(`step ${stepNo} event: ${ev.id} again (delivery ${m.info.deliveryCount}): a duplicate, skipped`);
      continue;
    }
    seenIds.add(ev.id);
    if (a.allocation_id !== allocationId) continue; // another of the tenant's allocations
    const gen = BigInt(ev.generation);
    say(`step ${stepNo} event: gen=${ev.generation} ${a.state} on ${m.subject} (seq ${m.seq}, acked)`);
    expect(ev.subject === allocationId, `event ${ev.id}: Event.subject is ${ev.subject}, not the allocation id`);
    expect(ev.generation === a.generation,
      `event ${ev.id}: Event.generation ${ev.generation} != the snapshot's generation ${a.generation}`);
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
    eventOf[a.state] = ev;
    if (a.state === target) return seen;
  }
}

// The principal the token names, as the platform records it (gpuaas.v1.Principal).
function checkPrincipal(p, what) {
  expect(p, `${what}: unset`);
  const got = { subject: p.subject, tenant: p.tenant, roles: p.roles.join(","), token_id: p.token_id, reason: p.reason };
  const want = { subject: claims.sub, tenant: opt.tenant, roles: "tenant", token_id: claims.jti, reason: RELEASE_REASON };
  expect(JSON.stringify(got) === JSON.stringify(want), `${what} is ${JSON.stringify(got)}, want ${JSON.stringify(want)}`);
}

// ---- The run ----
async function main() {
  expect(opt.region, "no region: pass --region or set GPUAAS_REGION");
  expect(opt.seedFile, "no NATS seed file: pass --seed-file (the tenant-api nkey seed) or set GPUAAS_NATS_SEED_FILE");
  expect(opt.tokenFile, "no token file: pass --token-file (a tenant token) or set GPUAAS_TOKEN_FILE");
  expect(/^[a-z0-9]([a-z0-9-]{0,61}[a-z0-9])?$/.test(opt.tenant), `tenant ${opt.tenant} is not a lowercase DNS label`);
  expect(opt.timeoutS > 0, `bad timeout ${opt.timeoutS}`);
  c = loadContracts(opt.protoDir);
  try {
    token = fs.readFileSync(opt.tokenFile, "utf8").trim();
  } catch (e) {
    fail(`cannot read the token file: ${e.message}`);
  }
  claims = tokenClaims(token);
  // A tenant-api connection may present tenant tokens only (else PERMISSION_DENIED
  // token_role_not_allowed_for_connection), acting for the token's tenant only.
  expect(Array.isArray(claims.roles) && claims.roles.length > 0 && claims.roles.every((r) => r === "tenant"),
    `the token's roles are ${JSON.stringify(claims.roles)}: a tenant gateway presents tenant tokens only`);
  expect(claims.tenant === opt.tenant, `the token is for tenant ${claims.tenant}, not ${opt.tenant}`);
  expect(claims.sub && claims.jti, "the token has no sub or jti");
  const ttl = Math.round(Number(claims.exp) - Date.now() / 1000);
  expect(ttl > 0, `the token expired ${-ttl} s ago: get a new one`);
  let seed;
  try {
    seed = fs.readFileSync(opt.seedFile, "utf8").trim();
  } catch (e) {
    fail(`cannot read the seed file: ${e.message}`);
  }
  try {
    nc = await connect({
      servers: opt.nats,
      name: "gpuaas-contract-js",
      timeout: 5000,
      authenticator: nkeyAuthenticator(new TextEncoder().encode(seed)),
      inboxPrefix: opt.inboxPrefix,
    });
  } catch (e) {
    fail(`cannot connect to NATS at ${opt.nats}: ${e.message}`);
  }
  // Whatever the server refuses this identity (an asynchronous -ERR), said when it happens.
  (async () => {
    for await (const s of nc.status()) {
      if (s.type === Events.Error && s.permissionContext) {
        say(`nats: the server refused this identity: ${s.permissionContext.operation} ${s.permissionContext.subject}`);
      }
    }
  })().catch(() => {});
  say(`step 0 setup: connected to ${opt.nats} as client role ${opt.clientRole} (inbox ${opt.inboxPrefix}), ` +
    `token sub=${claims.sub} roles=${claims.roles.join(",")} tenant=${claims.tenant} expires in ${ttl} s`);
  // No account-info probe ($JS.API.INFO is not the tenant-api role's).
  const jsm = await nc.jetstreamManager({ checkAPI: false });
  const js = nc.jetstream({ checkAPI: false });

  // 1. The catalog, with where each SKU can be ordered now.
  step = "1 catalog";
  const catalog = await call(SUBJECT.catalogList, "gpuaas.v1.ListCatalogRequest", {}, "gpuaas.v1.ListCatalogResponse");
  for (const s of catalog.skus) {
    expect(c.isValidEnum("gpuaas.v1.CapacityShape", s.shape), `catalog SKU ${s.name}: shape ${s.shape} is not valid`);
    for (const a of s.availability) {
      expect(a.region, `catalog SKU ${s.name}: an availability entry names no region`);
      expect(a.free_gpus >= 0 && a.max_gpus_per_allocation >= 0 && a.max_gpus_per_allocation <= a.free_gpus,
        `catalog SKU ${s.name} in ${a.region}: free_gpus=${a.free_gpus} max_gpus_per_allocation=${a.max_gpus_per_allocation}`);
      expect(a.region_enabled || a.free_gpus === 0, `catalog SKU ${s.name}: ${a.free_gpus} free GPUs in disabled region ${a.region}`);
    }
  }
  const defaultImage = catalog.images.find((i) => i.is_default);
  say(`step 1 catalog: ${catalog.skus.length} SKUs [${catalog.skus.map((s) => `${s.name}:${s.shape}${s.orderable ? "" : "(not orderable)"}`).join(", ")}], ` +
    `${catalog.images.length} images, default image ${defaultImage?.name ?? "(none)"}`);
  expect(defaultImage, "the catalog has no default image (is_default)");
  expect(/^[0-9a-f]{64}$/.test(defaultImage.sha256), `default image ${defaultImage.name}: sha256 ${defaultImage.sha256} is not 64 hex digits`);
  const slices = catalog.skus.filter((s) => s.shape === "CAPACITY_SHAPE_GPU_SLICE");
  for (const s of slices) {
    const where = s.availability.map((a) => `${a.region}:${a.region_enabled ? "enabled" : "disabled"} free_gpus=${a.free_gpus} max_gpus_per_allocation=${a.max_gpus_per_allocation}`);
    say(`step 1 availability: ${s.name} allowed_gpu_counts=[${s.allowed_gpu_counts.join(",")}] ${where.length ? where.join("; ") : "(no region has its gpu_sku)"}`);
  }
  // An orderable slice SKU that fits now in the region: enabled, and one node with at least its
  // smallest GPU count free.
  const fits = (s) => {
    if (!s.orderable || s.allowed_gpu_counts.length === 0) return false;
    const a = s.availability.find((x) => x.region === opt.region);
    return a && a.region_enabled && a.max_gpus_per_allocation >= Math.min(...s.allowed_gpu_counts);
  };
  const sku = slices.find(fits);
  expect(sku, `no orderable CAPACITY_SHAPE_GPU_SLICE SKU has room in region ${opt.region} ` +
    "(availability: region enabled and max_gpus_per_allocation >= its smallest allowed_gpu_counts)");
  const gpuCount = Math.min(...sku.allowed_gpu_counts);

  // 2. The tenant feed, then the order. The durable exists before the create, so it gets every
  // event of the allocation (deliver_policy new).
  step = "2 create";
  let si;
  try {
    si = await jsm.streams.info(FEED.stream);
  } catch (e) {
    fail(`stream ${FEED.stream}: ${e.message}`);
  }
  expect(si.config.subjects.includes(FEED.subjects),
    `stream ${FEED.stream} holds [${si.config.subjects.join(", ")}], the AsyncAPI document says ${FEED.subjects}`);
  const filter = SUBJECT.tenantAllocationChanged(opt.tenant, "*");
  const durable = `contract-js-${crypto.randomBytes(6).toString("hex")}`;
  feed = new Feed(jsm, js, durable, filter);
  let ci;
  try {
    ci = await feed.create();
  } catch (e) {
    fail(`durable ${durable} on ${FEED.stream}: ${e.message}`);
  }
  expect(ci.config.durable_name === durable && ci.config.filter_subject === filter &&
      ci.config.ack_policy === AckPolicy.Explicit && ci.config.deliver_subject === undefined,
    `durable ${durable}: the server made ${JSON.stringify(ci.config)}`);
  try {
    await feed.start();
  } catch (e) {
    fail(`durable ${durable}: ${e.message}`);
  }
  const maxAgeH = Number(si.config.max_age) / 3.6e12;
  say(`step 2 feed: stream ${FEED.stream} subjects=[${si.config.subjects.join(",")}] max_age=${maxAgeH}h last_seq=${si.state.last_seq}; ` +
    `durable ${durable} filter=${filter} deliver_policy=${ci.config.deliver_policy} ack_policy=${ci.config.ack_policy}`);

  const requestId = crypto.randomUUID();
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
  say(`step 2 create: allocation ${id} tenant=${alloc.tenant} sku=${sku.name} shape=${sku.shape} gpu_count=${gpuCount} ` +
    `region=${opt.region} request_id=${requestId} created=${created.created} state=${alloc.state} node=${alloc.node_id || "(none yet)"}`);
  expect(created.created === true, "created=false for a new request_id");
  expect(alloc.shape === "CAPACITY_SHAPE_GPU_SLICE", `allocation shape ${alloc.shape}`);
  expect(alloc.sku === sku.name && alloc.gpu_count === gpuCount && alloc.tenant === opt.tenant && alloc.request_id === requestId,
    `the allocation does not echo the request: ${JSON.stringify({ sku: alloc.sku, gpu_count: alloc.gpu_count, tenant: alloc.tenant, request_id: alloc.request_id })}`);
  expect(c.isValidEnum("gpuaas.v1.AllocationState", alloc.state), `create reply state ${alloc.state} is not valid`);
  if (alloc.state === "ALLOCATION_STATE_FAILED") fail(`allocation FAILED at once: ${JSON.stringify(alloc.failure)}`);

  // 3. Its lifecycle from the tenant feed, up to ACTIVE.
  step = "3 lifecycle";
  const up = await followUntil(id, "ALLOCATION_STATE_ACTIVE", 3);
  const iProv = up.indexOf("ALLOCATION_STATE_PROVISIONING");
  expect(iProv >= 0 && iProv < up.indexOf("ALLOCATION_STATE_ACTIVE"), `no PROVISIONING event before ACTIVE (saw ${up.join(", ")})`);
  const active = latest;
  expect(active.node_id, "the ACTIVE allocation names no node");
  expect(active.slot_keys.length === gpuCount, `ACTIVE allocation holds ${active.slot_keys.length} slots for gpu_count ${gpuCount}`);
  say(`step 3 lifecycle: ${up.join(" -> ")} node=${active.node_id} slots=${active.slot_keys.join(",")}` +
    `${active.network ? ` ip=${active.network.actual_ip}` : ""}`);

  // 4. Release (with a reason), and follow it to RELEASED.
  step = "4 release";
  const rel = await call(SUBJECT.allocationRelease, "gpuaas.v1.ReleaseAllocationRequest",
    { allocation_id: id, reason: RELEASE_REASON }, "gpuaas.v1.ReleaseAllocationResponse");
  say(`step 4 release: allocation ${id} state=${rel.allocation?.state} reason="${RELEASE_REASON}"`);
  const down = await followUntil(id, "ALLOCATION_STATE_RELEASED", 4);
  // Who released it, and why: the token's principal and the request's reason, whole, as the
  // actor of the RELEASING event and on the RELEASED snapshot.
  expect(eventOf.ALLOCATION_STATE_RELEASING, `no RELEASING event before RELEASED (saw ${down.join(", ")})`);
  checkPrincipal(eventOf.ALLOCATION_STATE_RELEASING.actor, "the RELEASING event's actor");
  checkPrincipal(latest.release_requested_by, "the RELEASED snapshot's release_requested_by");
  const by = latest.release_requested_by;
  say(`step 4 lifecycle: ${down.join(" -> ")} release_requested_by=${by.subject} tenant=${by.tenant} ` +
    `roles=${by.roles.join(",")} token_id=${by.token_id} reason="${by.reason}"`);

  // 5. The durable goes.
  step = "5 done";
  const f = feed;
  feed = null;
  let deleted;
  try {
    deleted = await f.delete();
  } catch (e) {
    fail(`deleting durable ${durable}: ${e.message}`);
  }
  expect(deleted === true, `deleting durable ${durable}: the server said ${deleted}`);
  say(`step 5 PASS: catalog with availability, ${up.length + down.length} lifecycle events of tenant ${opt.tenant} ` +
    `in generation order through durable ${durable} (${eventsRead} read and acked, then deleted), release`);
}

main()
  .then(async () => {
    clearTimeout(timer);
    await nc?.close();
    process.exit(0);
  })
  .catch(async (e) => {
    if (timedOut) return; // the timer reports and exits 2
    clearTimeout(timer);
    console.log(`FAIL step ${step}: ${e instanceof CheckFailed ? e.message : e.stack || e}`);
    await cleanup();
    process.exit(1);
  });
