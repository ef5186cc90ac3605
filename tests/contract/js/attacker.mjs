#!/usr/bin/env node
// An attacker's script: with the official NATS JavaScript client and the published contracts
// only (asyncapi/, proto/), it tries each path the platform must refuse (asyncapi/gpuaas.asyncapi.yaml
// "Security") and checks that it is refused, positively: by the NATS server (an authorization or
// permissions violation it reports) or by the serving service (a gpuaas.v1.Reply naming the
// refusal), never by "nothing happened". Every attack is paired with a control: the same identity
// doing the legitimate thing succeeds, so no refusal is vacuous.
//
// One line per attack (`attack <n> <name>: refused (<how>)` or `... NOT REFUSED ...`) and per
// control (`control <n> <name>: ok` or `... FAILED ...`); then `attacker PASS: <k> attacks refused`.
// Exit 0 only when every attack was refused and every control held, 1 otherwise, 2 on the
// overall timeout.
//
// Usage: node attacker.mjs --node-a-seed F --node-a ID --node-b ID --tenant-seed F --tenant T
//          --tenant-token-file F --operator-token-file F --revoked-token-file F
//          --expired-token-file F --forged-token-file F --tenant-issued-operator-token-file F
//          [--nats URL] [--proto-dir DIR] [--timeout-s N]
// Environment: GPUAAS_NATS_URL, GPUAAS_PROTO_DIR, GPUAAS_CLIENT_TIMEOUT_S, GPUAAS_TENANT, and
//   GPUAAS_ATTACK_<FLAG> for the others (e.g. GPUAAS_ATTACK_NODE_A_SEED); the flags win.
// Node A's seed is an enrolled node's nkey (its inbox: _INBOX.node.<node id>); node B is another
// enrolled node. The tenant seed is the tenant-api nkey (inbox _INBOX.tenant-api, requests on
// <subject>.tenant-api); the token files hold, for --tenant: a valid tenant token, a revoked one,
// an expired one and one signed by a key the services do not know; a valid operator token; and an
// operator token signed by the tenant issuer's key (which may sign tenant tokens only).
import crypto from "node:crypto";
import fs from "node:fs";
import path from "node:path";
import { fileURLToPath } from "node:url";
import { parseArgs } from "node:util";
import { connect, ErrorCode, headers as natsHeaders, nkeyAuthenticator } from "nats";
import { defaultProtoDir, loadContracts } from "./proto.mjs";

// ---- From asyncapi/gpuaas.asyncapi.yaml ----
const SUBJECT = {
  desiredGet: (node) => `gpuaas.v1.inventory.node.${node}.desired.get`,
  networkGet: (node) => `gpuaas.v1.ipam.node.${node}.network.get`,
  exposuresGet: (node) => `gpuaas.v1.ingress.node.${node}.exposures.get`,
  exposuresAck: (node) => `gpuaas.v1.ingress.node.${node}.exposures.ack`,
  allocationList: "gpuaas.v1.scheduler.allocation.list",
  allocationCreate: "gpuaas.v1.scheduler.allocation.create",
  slotApprove: "gpuaas.v1.inventory.slot.approve", // an admin subject: operator only
};
const CLIENT_ROLE = "tenant-api";
const asClient = (subject) => `${subject}.${CLIENT_ROLE}`; // a client role's request subject
// The tenant write limit (the services' default rpc.rate_limits): 20 a second, bursts of 40.
const WRITE_RATE = 20;
const WRITE_BURST = 40;
const FLOOD = 120;
const REQUEST_TIMEOUT_MS = 5_000;

// ---- Options (flags win over the environment) ----
const FLAGS = ["nats", "proto-dir", "timeout-s", "node-a-seed", "node-a", "node-b", "tenant-seed", "tenant",
  "tenant-token-file", "operator-token-file", "revoked-token-file", "expired-token-file", "forged-token-file",
  "tenant-issued-operator-token-file"];
const ENV = {
  nats: "GPUAAS_NATS_URL", "proto-dir": "GPUAAS_PROTO_DIR", "timeout-s": "GPUAAS_CLIENT_TIMEOUT_S", tenant: "GPUAAS_TENANT",
};
function options() {
  const { values } = parseArgs({ options: Object.fromEntries(FLAGS.map((f) => [f, { type: "string" }])) });
  const get = (f) => values[f] ?? process.env[ENV[f] ?? `GPUAAS_ATTACK_${f.toUpperCase().replaceAll("-", "_")}`];
  const o = Object.fromEntries(FLAGS.map((f) => [f, get(f)]));
  o.nats ??= "nats://127.0.0.1:4222";
  o["proto-dir"] ??= defaultProtoDir;
  o["timeout-s"] = Number(o["timeout-s"] ?? 90);
  for (const f of FLAGS) if (!o[f]) fail(`--${f} is required`);
  return o;
}

// ---- Reporting ----
class CheckFailed extends Error {}
function fail(msg) {
  throw new CheckFailed(msg);
}
let refusals = 0;
let failures = 0;
function refused(n, name, how) {
  refusals++;
  console.log(`attack ${n} ${name}: refused (${how})`);
}
function notRefused(n, name, what) {
  failures++;
  console.log(`attack ${n} ${name}: NOT REFUSED (${what})`);
}
function controlOk(n, name, detail = "") {
  console.log(`control ${n} ${name}: ok${detail ? ` (${detail})` : ""}`);
}
function controlFailed(n, name, what) {
  failures++;
  console.log(`control ${n} ${name}: FAILED (${what})`);
}

// ---- NATS helpers ----
let c; // the contracts
let opt;
const read = (file) => fs.readFileSync(file, "utf8").trim();

async function connectAs(seedFile, inboxPrefix) {
  return connect({
    servers: opt.nats,
    name: "gpuaas-attacker",
    timeout: 5000,
    authenticator: nkeyAuthenticator(new TextEncoder().encode(read(seedFile))),
    inboxPrefix,
  });
}

// One request. The outcome is one of:
//   {serverRefused}: the NATS server refused the publish. It answers `-ERR 'Permissions Violation
//     for Publish to "<subject>"'`; nats.js (2.x, ProtocolHandler.toError and
//     MuxSubscription.handleError) turns that into a NatsError with code PERMISSIONS_VIOLATION and
//     permissionContext {operation: "publish", subject} and rejects the pending request with it.
//   {status, result}: the service answered a gpuaas.v1.Reply.
//   {error}: anything else (a timeout, no responders, a reply that is not a Reply).
async function send(conn, subject, reqType, req, token = "") {
  const h = natsHeaders();
  h.set("traceparent", `00-${crypto.randomBytes(16).toString("hex")}-${crypto.randomBytes(8).toString("hex")}-01`);
  h.set("Gpuaas-Deadline-Ms", String(Date.now() + REQUEST_TIMEOUT_MS));
  if (token) h.set("Authorization", `Bearer ${token}`);
  let msg;
  try {
    msg = await conn.request(subject, c.encode(reqType, req), { timeout: REQUEST_TIMEOUT_MS, headers: h });
  } catch (e) {
    if (e.code === ErrorCode.PermissionsViolation) return { serverRefused: e };
    return { error: `${e.code ?? "error"}: ${e.message}` };
  }
  try {
    const reply = c.decode("gpuaas.v1.Reply", msg.data);
    return { status: reply.status, result: reply.result };
  } catch (e) {
    return { error: `the reply is not a gpuaas.v1.Reply: ${e.message}` };
  }
}

function describe(r) {
  if (r.serverRefused) return `the server: ${r.serverRefused.message}`;
  if (r.error) return r.error;
  const st = r.status;
  const details = Object.entries(st.details ?? {}).map(([k, v]) => `${k}=${v}`).join(" ");
  return `${st.code}${st.reason ? ` ${st.reason}` : ""}${details ? ` ${details}` : ""}${st.retryable ? " retryable" : ""}`;
}

// The attack is refused by the NATS server itself: a permissions violation for this subject.
async function expectServerRefuses(n, name, conn, subject, reqType, req, token) {
  const r = await send(conn, subject, reqType, req, token);
  const ctx = r.serverRefused?.permissionContext;
  if (ctx && ctx.operation === "publish" && ctx.subject === subject) {
    refused(n, name, `server: ${r.serverRefused.code} publish ${subject}`);
  } else {
    notRefused(n, name, `${subject}: ${describe(r)}`);
  }
}

// The attack reaches the service, which answers a Reply with `code` and `reason`.
async function expectReply(n, name, conn, subject, reqType, req, token, code, reason) {
  const r = await send(conn, subject, reqType, req, token);
  if (r.status && r.status.code === code && r.status.reason === reason) {
    refused(n, name, `${subject}: ${describe(r)}`);
  } else {
    notRefused(n, name, `${subject}: ${describe(r)}, expected ${code} ${reason}`);
  }
}

// The control: the same identity's legitimate request answers OK with a `resultType`.
async function expectOk(n, name, conn, subject, reqType, req, token, resultType) {
  const r = await send(conn, subject, reqType, req, token);
  if (r.status?.code !== "OK") return controlFailed(n, name, `${subject}: ${describe(r)}`);
  try {
    c.unpack(r.result, resultType);
  } catch (e) {
    return controlFailed(n, name, `${subject}: OK, but its result: ${e.message}`);
  }
  controlOk(n, name, `${subject}: OK`);
}

// ---- The attacks ----
let nodeA; // node A's connection (its own key and inbox)
let gw; // the tenant-api connection
const tokens = {};

// 1. A connection with no key at all: the server must refuse it (authorization violation).
async function attackAnonymousConnect() {
  try {
    const anon = await connect({ servers: opt.nats, name: "gpuaas-attacker-anonymous", timeout: 5000, reconnect: false });
    await anon.close();
    notRefused(1, "anonymous-connect", "the server accepted a connection without a key");
  } catch (e) {
    if (e.code === ErrorCode.AuthorizationViolation) refused(1, "anonymous-connect", `server: ${e.code} ${e.message}`);
    else notRefused(1, "anonymous-connect", `the connect failed, not by the server's refusal: ${e.code} ${e.message}`);
  }
  // Control: node A's own key, with its own inbox prefix, connects.
  try {
    nodeA = await connectAs(opt["node-a-seed"], `_INBOX.node.${opt["node-a"]}`);
    controlOk(1, "node-a-key-connects", `as node ${opt["node-a"]}, inbox _INBOX.node.${opt["node-a"]}`);
  } catch (e) {
    controlFailed(1, "node-a-key-connects", `${e.code}: ${e.message}`);
    fail("without node A's connection attacks 2 and 3 cannot run");
  }
}

// 2. Node A's key asks for node B's desired set and network document and acks B's exposures:
// a node's permissions bind {node_id} to its own id, so the server refuses each publish.
async function attackOtherNodesSubjects() {
  const a = opt["node-a"];
  const b = opt["node-b"];
  await expectServerRefuses(2, "node-a-reads-b-desired", nodeA, SUBJECT.desiredGet(b),
    "gpuaas.v1.GetDesiredSlotsRequest", { node_id: b });
  await expectServerRefuses(2, "node-a-reads-b-network", nodeA, SUBJECT.networkGet(b),
    "gpuaas.v1.GetNodeNetworkRequest", { node_id: b });
  await expectServerRefuses(2, "node-a-acks-b-exposures", nodeA, SUBJECT.exposuresAck(b),
    "gpuaas.v1.AckNodeExposuresRequest", { node_id: b, version: 1 });
  // Control: node A's own desired set and network document answer.
  await expectOk(2, "node-a-reads-own-desired", nodeA, SUBJECT.desiredGet(a), "gpuaas.v1.GetDesiredSlotsRequest",
    { node_id: a }, "", "gpuaas.v1.GetDesiredSlotsResponse");
  await expectOk(2, "node-a-reads-own-network", nodeA, SUBJECT.networkGet(a), "gpuaas.v1.GetNodeNetworkRequest",
    { node_id: a }, "", "gpuaas.v1.GetNodeNetworkResponse");
}

// 3. Node A on its own subjects, with a payload naming node B: the server lets the publish
// through (the subject is A's), the handler refuses it (PERMISSION_DENIED node_id_mismatch).
async function attackPayloadNamesAnotherNode() {
  const a = opt["node-a"];
  const b = opt["node-b"];
  await expectReply(3, "node-a-acks-exposures-for-b", nodeA, SUBJECT.exposuresAck(a), "gpuaas.v1.AckNodeExposuresRequest",
    { node_id: b, version: 1 }, "", "PERMISSION_DENIED", "node_id_mismatch");
  await expectReply(3, "node-a-reads-desired-for-b", nodeA, SUBJECT.desiredGet(a), "gpuaas.v1.GetDesiredSlotsRequest",
    { node_id: b }, "", "PERMISSION_DENIED", "node_id_mismatch");
  // Control: ingress answers node A about itself on its own subject.
  await expectOk(3, "node-a-reads-own-exposures", nodeA, SUBJECT.exposuresGet(a), "gpuaas.v1.GetNodeExposuresRequest",
    { node_id: a }, "", "gpuaas.v1.GetNodeExposuresResponse");
}

// The tenant gateway's list of its tenant's allocations, with `token`: on <subject>.tenant-api,
// as a client role must send it. expectListOk is the controls' legitimate call.
const LIST = "gpuaas.v1.ListAllocationsRequest";
const listReply = (n, name, token, code, reason) =>
  expectReply(n, name, gw, asClient(SUBJECT.allocationList), LIST, {}, token, code, reason);
const expectListOk = (n, name) =>
  expectOk(n, name, gw, asClient(SUBJECT.allocationList), LIST, {}, tokens.tenant, "gpuaas.v1.ListAllocationsResponse");

// 4. The tenant gateway publishes the bare subject (where platform identities' requests arrive)
// and an admin subject with its own suffix: the server refuses both.
async function attackTenantGatewaySubjects() {
  gw = await connectAs(opt["tenant-seed"], `_INBOX.${CLIENT_ROLE}`);
  await expectServerRefuses(4, "tenant-api-bare-subject", gw, SUBJECT.allocationList, LIST, {}, tokens.tenant);
  await expectServerRefuses(4, "tenant-api-admin-subject", gw, asClient(SUBJECT.slotApprove),
    "gpuaas.v1.ApproveSlotsRequest", { node_id: opt["node-a"] }, tokens.tenant);
  // Control: the same list on <subject>.tenant-api with the tenant token answers.
  await expectListOk(4, "tenant-api-lists-allocations");
}

// 5. The tenant gateway presents an operator's token: a tenant-api connection may present
// tenant tokens only (roles.yaml token_roles).
async function attackOperatorTokenOnGateway() {
  await listReply(5, "operator-token-on-tenant-api", tokens.operator, "PERMISSION_DENIED",
    "token_role_not_allowed_for_connection");
  // Control: the same call with the tenant token.
  await expectListOk(5, "tenant-token-on-tenant-api");
}

// 6. Tokens that must not work: revoked, expired, signed by an unknown key, signed by the tenant
// issuer but claiming the operator role, none at all.
async function attackBadTokens() {
  await listReply(6, "revoked-token", tokens.revoked, "UNAUTHENTICATED", "token_revoked");
  await listReply(6, "expired-token", tokens.expired, "UNAUTHENTICATED", "token_expired");
  await listReply(6, "forged-token", tokens.forged, "UNAUTHENTICATED", "token_signature");
  await listReply(6, "tenant-issued-operator-token", tokens["tenant-issued-operator"],
    "UNAUTHENTICATED", "token_issuer_role");
  await listReply(6, "no-token", "", "UNAUTHENTICATED", "token_missing");
  // Control: the valid tenant token, same connection and subject.
  await expectListOk(6, "valid-token");
}

// 7. A flood of creates with the valid tenant token, back to back: over the tenant's write limit
// the service answers RESOURCE_EXHAUSTED rate_limited (retryable, retry_after_ms, class write),
// and never lets more through than the burst and the rate allow over the flood's time.
async function attackFlood() {
  const name = "create-flood";
  let through = 0;
  let limited = 0;
  let first = null;
  const bad = [];
  const t0 = performance.now();
  for (let i = 0; i < FLOOD; i++) {
    const r = await send(gw, asClient(SUBJECT.allocationCreate), "gpuaas.v1.CreateAllocationRequest", {
      tenant: opt.tenant, request_id: crypto.randomUUID(), sku: "h200-sxm-slice", gpu_count: 1,
      region: "us-east-1", pool: "attack",
    }, tokens.tenant);
    if (!r.status) return notRefused(7, name, `create ${i + 1}: ${describe(r)}`);
    first ??= r;
    const st = r.status;
    if (st.code === "RESOURCE_EXHAUSTED" && st.reason === "rate_limited") {
      limited++;
      const ms = Number(st.details?.retry_after_ms);
      if (!st.retryable || !(ms > 0) || st.details?.class !== "write") bad.push(describe(r));
    } else {
      through++; // placed or answered for want of capacity: either way let through
    }
  }
  const elapsed = (performance.now() - t0) / 1000;
  const allowed = Math.floor(WRITE_BURST + WRITE_RATE * elapsed + 5);
  // Control: the token may create; the first create was let through.
  if (first.status.reason === "rate_limited") controlFailed(7, "first-create-let-through", describe(first));
  else controlOk(7, "first-create-let-through", `answered ${describe(first)}`);
  const summary = `${limited} of ${FLOOD} creates in ${elapsed.toFixed(2)} s RESOURCE_EXHAUSTED rate_limited, ` +
    `${through} let through (at most ${allowed})`;
  if (limited === 0) notRefused(7, name, summary);
  else if (bad.length > 0) notRefused(7, name, `${summary}; one lacks retryable, retry_after_ms > 0 or class write: ${bad[0]}`);
  else if (through > allowed) notRefused(7, name, `${summary}: too many let through`);
  else refused(7, name, `${summary}, each retryable with retry_after_ms > 0 and class write`);
}

// ---- The run ----
async function main() {
  opt = options();
  if (!(opt["timeout-s"] > 0)) fail(`bad timeout ${opt["timeout-s"]}`);
  const timer = setTimeout(() => {
    console.log(`attacker FAIL: timed out after ${opt["timeout-s"]} s`);
    process.exit(2);
  }, opt["timeout-s"] * 1000);
  c = loadContracts(opt["proto-dir"]);
  for (const k of ["tenant", "operator", "revoked", "expired", "forged", "tenant-issued-operator"]) {
    tokens[k] = read(opt[`${k}-token-file`]);
  }
  await attackAnonymousConnect();
  await attackOtherNodesSubjects();
  await attackPayloadNamesAnotherNode();
  await attackTenantGatewaySubjects();
  await attackOperatorTokenOnGateway();
  await attackBadTokens();
  await attackFlood(); // last: it spends the tenant token's write budget
  clearTimeout(timer);
  await Promise.all([nodeA?.close(), gw?.close()]);
  if (failures > 0) {
    console.log(`attacker FAIL: ${failures} check(s) failed (${refusals} attacks refused)`);
    return 1;
  }
  console.log(`attacker PASS: ${refusals} attacks refused`);
  return 0;
}

// Runs only when executed (node attacker.mjs ...), not when imported.
if (process.argv[1] && path.resolve(process.argv[1]) === fileURLToPath(import.meta.url)) {
  main()
    .then((code) => process.exit(code))
    .catch((e) => {
      console.log(`attacker FAIL: ${e instanceof CheckFailed ? e.message : e.stack || e}`);
      process.exit(1);
    });
}
