#!/usr/bin/env node
// Checks the production overlay's CloudNativePG objects without a cluster (scripts/test):
//
//   node tools/check-k8s-crds.mjs
//
// 1. Every YAML document in deploy/k8s/overlays/production/*.yaml whose apiVersion is
//    postgresql.cnpg.io/v1 is validated against the openAPIV3Schema of its kind's CRD, vendored
//    in deploy/k8s/crds/cloudnative-pg/ (deploy/k8s/crds/README.md: release, source, license).
//    The vendored files must still be byte for byte what was vendored (sha256 below). A kind
//    without a vendored CRD is an error.
//    Like the API server's strict field validation (kubectl's default), a field the schema does
//    not declare is an error: every object schema with `properties` and neither
//    `additionalProperties` nor `x-kubernetes-preserve-unknown-fields` gets
//    additionalProperties: false. Other x-kubernetes-* keywords (CEL rules among them) and
//    `format` are not evaluated; the API server still checks those on apply.
// 2. The validator can fail: broken copies of the Cluster (a string for `instances`, an
//    unknown field under spec, an unknown synchronous method) must each be rejected.
// 3. Every control-plane service is pointed at the CloudNativePG primary: its Deployment patch in
//    postgres-cnpg-services.yaml sets GPUAAS_POSTGRES_DSN with host=gpuaas-pg-rw,
//    target_session_attrs=read-write and its own user and database, and PGPASSWORD from its
//    role's Secret; the Cluster manages that role with that Secret and a Database gives the
//    role its database; kustomization.yaml applies both files.
// Exit 1 with one line per problem (file, object, path, message).
import crypto from 'node:crypto';
import fs from 'node:fs';
import path from 'node:path';
import { fileURLToPath } from 'node:url';
import Ajv from 'ajv';
import YAML from 'yaml';

const ROOT = path.resolve(path.dirname(fileURLToPath(import.meta.url)), '..');
const OVERLAY = 'deploy/k8s/overlays/production';
const CRD_DIR = 'deploy/k8s/crds/cloudnative-pg';
const GROUP = 'postgresql.cnpg.io';
const API_VERSION = `${GROUP}/v1`;
// Update together with the files and deploy/k8s/crds/README.md when re-vendoring.
const CNPG_VERSION = '1.30.1';
const CRDS = {
  Cluster: ['postgresql.cnpg.io_clusters.yaml',
    'e4842effb0e6b3786c0e5c71dbb1bda20a499b8b55daa64dac13b69b128b55aa'],
  Database: ['postgresql.cnpg.io_databases.yaml',
    '4f5f5b46b97754146a0df1836c4fef1bf395b9c42b517c76e6f827803800d453'],
  ScheduledBackup: ['postgresql.cnpg.io_scheduledbackups.yaml',
    '1ae741dd47bd3a0822146de48011defa219bcb43132945314717a7239ff56c22'],
};
const NAMESPACE = 'gpuaas';
const PG_RW_HOST = 'gpuaas-pg-rw';
const SERVICES = ['inventory', 'scheduler', 'ipam', 'ingress', 'usage', 'console-gw'];
const SERVICES_PATCH = 'postgres-cnpg-services.yaml';
const CLUSTER_FILE = 'postgres-cnpg.yaml';

const problems = [];
const fail = (where, msg) => problems.push(`${where}: ${msg}`);
const rel = p => path.relative(ROOT, p);

// Strict structural schema: undeclared fields are errors, as with kubectl's strict validation.
function strictify(node) {
  if (Array.isArray(node)) return node.map(strictify);
  if (node === null || typeof node !== 'object') return node;
  const out = {};
  for (const [k, v] of Object.entries(node)) {
    // `properties`, `default` and `example` hold data (field names, values), not schemas to
    // rewrite key by key; their values are schemas only under `properties`.
    if (k === 'properties') {
      out[k] = Object.fromEntries(Object.entries(v).map(([name, s]) => [name, strictify(s)]));
    } else if (k === 'default' || k === 'example' || k === 'enum') {
      out[k] = v;
    } else {
      out[k] = strictify(v);
    }
  }
  if (out.properties && out.additionalProperties === undefined &&
      out['x-kubernetes-preserve-unknown-fields'] !== true) {
    out.additionalProperties = false;
  }
  return out;
}

function loadValidators() {
  const ajv = new Ajv({ strict: false, allErrors: true, validateFormats: false });
  const validators = {};
  for (const [kind, [file, sha256]] of Object.entries(CRDS)) {
    const p = path.join(ROOT, CRD_DIR, file);
    const text = fs.readFileSync(p);
    const got = crypto.createHash('sha256').update(text).digest('hex');
    if (got !== sha256) {
      fail(rel(p), `sha256 ${got}, expected ${sha256}: the vendored CRD changed (re-vendor it as ` +
        'deploy/k8s/crds/README.md says, then update CNPG_VERSION and CRDS here)');
      continue;
    }
    const crd = YAML.parse(text.toString('utf8'));
    if (crd?.kind !== 'CustomResourceDefinition' || crd.spec?.group !== GROUP ||
        crd.spec?.names?.kind !== kind) {
      fail(rel(p), `not the ${GROUP} CRD of ${kind}`);
      continue;
    }
    const version = (crd.spec.versions ?? []).find(v => v.name === 'v1');
    const schema = version?.schema?.openAPIV3Schema;
    if (!schema) {
      fail(rel(p), 'no v1 openAPIV3Schema');
      continue;
    }
    validators[kind] = ajv.compile(strictify(schema));
  }
  return validators;
}

function loadDocs(file) {
  const text = fs.readFileSync(file, 'utf8');
  const out = [];
  for (const doc of YAML.parseAllDocuments(text)) {
    if (doc.errors.length) {
      for (const e of doc.errors) fail(rel(file), `YAML: ${e.message}`);
      continue;
    }
    const value = doc.toJS();
    if (value !== null) out.push(value);
  }
  return out;
}

const describe = obj => `${obj?.kind ?? '?'}/${obj?.metadata?.name ?? '?'}`;

function validate(validators, obj) {
  const errors = [];
  const validator = validators[obj.kind];
  if (!validator) return [`no vendored CRD schema for kind ${obj.kind}`];
  if (!validator(obj)) {
    for (const e of validator.errors) {
      const extra = e.keyword === 'additionalProperties' ? ` (${e.params.additionalProperty})`
        : e.keyword === 'enum' ? ` (${e.params.allowedValues.join(', ')})` : '';
      errors.push(`${e.instancePath || '/'} ${e.message}${extra}`);
    }
  }
  if (typeof obj.metadata?.name !== 'string' || obj.metadata.name === '') {
    errors.push('/metadata/name missing');
  }
  if (obj.metadata?.namespace !== NAMESPACE) {
    errors.push(`/metadata/namespace must be ${NAMESPACE}`);
  }
  return errors;
}

// A libpq key=value connection string (no quoting used here) as an object.
function parseDsn(dsn) {
  const out = {};
  for (const part of String(dsn).trim().split(/\s+/)) {
    const i = part.indexOf('=');
    if (i > 0) out[part.slice(0, i)] = part.slice(i + 1);
  }
  return out;
}

function checkServices(overlayDocs) {
  const patchFile = path.join(ROOT, OVERLAY, SERVICES_PATCH);
  const where = rel(patchFile);
  const deployments = (overlayDocs.get(patchFile) ?? []).filter(d => d.kind === 'Deployment');
  const clusterFile = path.join(ROOT, OVERLAY, CLUSTER_FILE);
  const clusterDocs = overlayDocs.get(clusterFile) ?? [];
  const cluster = clusterDocs.find(d => d.apiVersion === API_VERSION && d.kind === 'Cluster');
  const roles = new Map((cluster?.spec?.managed?.roles ?? []).map(r => [r.name, r]));
  const databases = clusterDocs.filter(d => d.apiVersion === API_VERSION && d.kind === 'Database');
  if (!cluster) fail(rel(clusterFile), 'no CloudNativePG Cluster');
  let ok = 0;
  for (const svc of SERVICES) {
    const user = `gpuaas_${svc.replaceAll('-', '_')}`;
    const secret = `gpuaas-pg-${svc}`;
    const d = deployments.find(x => x.metadata?.name === `gpuaas-${svc}`);
    const c = d?.spec?.template?.spec?.containers?.find(x => x.name === svc);
    if (!c) {
      fail(where, `no Deployment gpuaas-${svc} patch with container ${svc}`);
      continue;
    }
    const env = new Map((c.env ?? []).map(e => [e.name, e]));
    const dsnValue = env.get('GPUAAS_POSTGRES_DSN')?.value;
    const dsn = parseDsn(dsnValue ?? '');
    const before = problems.length;
    const want = { host: PG_RW_HOST, port: '5432', user, dbname: user,
      target_session_attrs: 'read-write' };
    for (const [k, v] of Object.entries(want)) {
      if (dsn[k] !== v) {
        fail(where, `gpuaas-${svc}: GPUAAS_POSTGRES_DSN ${k}=${dsn[k] ?? '(missing)'}, ` +
          `want ${k}=${v} (${JSON.stringify(dsnValue ?? null)})`);
      }
    }
    const ref = env.get('PGPASSWORD')?.valueFrom?.secretKeyRef;
    if (ref?.name !== secret || ref?.key !== 'password') {
      fail(where, `gpuaas-${svc}: PGPASSWORD must come from Secret ${secret} key password`);
    }
    const role = roles.get(user);
    if (!role || role.login !== true || role.passwordSecret?.name !== secret ||
        (role.ensure ?? 'present') !== 'present') {
      fail(rel(clusterFile),
        `Cluster managed.roles: ${user} must be present, login, passwordSecret ${secret}`);
    }
    const db = databases.find(x => x.spec?.name === user);
    if (!db || db.spec.owner !== user || db.spec.cluster?.name !== cluster?.metadata?.name ||
        (db.spec.ensure ?? 'present') !== 'present') {
      fail(rel(clusterFile),
        `no Database ${user} owned by ${user} on Cluster ${cluster?.metadata?.name}`);
    }
    if (problems.length === before) ok++;
  }
  const extra = deployments.map(x => x.metadata?.name)
    .filter(n => !SERVICES.some(s => n === `gpuaas-${s}`));
  if (extra.length) fail(where, `unexpected Deployment patches: ${extra.join(', ')}`);

  const kfile = path.join(ROOT, OVERLAY, 'kustomization.yaml');
  const k = overlayDocs.get(kfile)?.[0] ?? {};
  if (!(k.resources ?? []).includes(CLUSTER_FILE)) {
    fail(rel(kfile), `resources must list ${CLUSTER_FILE}`);
  }
  if (!(k.patches ?? []).some(p => p.path === SERVICES_PATCH)) {
    fail(rel(kfile), `patches must list ${SERVICES_PATCH}`);
  }
  return ok;
}

function selfCheck(validators, clusterDoc) {
  if (!clusterDoc || !validators.Cluster) return 0;
  const broken = [
    ['instances: "three"', c => { c.spec.instances = 'three'; }],
    ['an unknown field spec.instancesTypo', c => { c.spec.instancesTypo = 3; }],
    ['synchronous.method "all"', c => {
      c.spec.postgresql ??= {};
      c.spec.postgresql.synchronous = { method: 'all', number: 1 };
    }],
  ];
  for (const [what, mutate] of broken) {
    const copy = structuredClone(clusterDoc);
    mutate(copy);
    if (validate(validators, copy).length === 0) {
      fail('self-check', `the validator accepted a Cluster with ${what}`);
    }
  }
  return broken.length;
}

const validators = loadValidators();
const overlayDir = path.join(ROOT, OVERLAY);
const overlayDocs = new Map();
for (const name of fs.readdirSync(overlayDir).filter(n => n.endsWith('.yaml')).sort()) {
  const file = path.join(overlayDir, name);
  overlayDocs.set(file, loadDocs(file));
}

let validated = 0;
const counts = {};
let firstCluster = null;
for (const [file, docs] of overlayDocs) {
  for (const obj of docs) {
    if (obj === null || typeof obj !== 'object' || Array.isArray(obj)) continue;
    const apiVersion = String(obj.apiVersion ?? '');
    if (!apiVersion.startsWith(`${GROUP}/`)) continue;
    const where = `${rel(file)} ${describe(obj)}`;
    if (apiVersion !== API_VERSION) {
      fail(where, `apiVersion ${apiVersion}: only ${API_VERSION} is vendored`);
      continue;
    }
    for (const e of validate(validators, obj)) fail(where, e);
    validated++;
    counts[obj.kind] = (counts[obj.kind] ?? 0) + 1;
    if (obj.kind === 'Cluster' && !firstCluster) firstCluster = obj;
  }
}
if (!firstCluster) fail(OVERLAY, 'no CloudNativePG Cluster to check');
const rejected = selfCheck(validators, firstCluster);
const services = checkServices(overlayDocs);

if (problems.length) {
  for (const p of problems) console.error(`check-k8s-crds: ${p}`);
  process.exit(1);
}
const kinds = Object.entries(counts).map(([k, n]) => `${k} x${n}`).join(', ');
console.log(`k8s: ${validated} CloudNativePG documents valid against CRD v${CNPG_VERSION} (${kinds}); ` +
  `${rejected} broken Clusters rejected; ${services} service DSNs on ${PG_RW_HOST} ` +
  'with target_session_attrs=read-write');
