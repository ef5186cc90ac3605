// The operator page: a thin view over console-gw's JSON API (POST /api/call/<subject>).
// Responses are proto3 JSON, which leaves out every default-valued field (0, "", false, empty
// lists, UNSPECIFIED enums), so every read here has a fallback.

// ---------- API ----------

class ApiError extends Error {
  constructor(status, body) {
    const e = (body && body.error) || {};
    super(
      `${e.code || `HTTP ${status}`}${e.reason ? ` ${e.reason}` : ''}` +
        `${e.message ? `: ${e.message}` : ''}`,
    );
    this.status = status;
    this.code = e.code || '';
    this.reason = e.reason || '';
    this.details = e.details || {};
    this.serverMessage = e.message || '';
  }
}

// Field names are the proto names; a gateway printing lowerCamelCase would still be read right.
// Map fields (labels) and error details hold user keys and are left alone.
function snakeKeys(v) {
  if (Array.isArray(v)) return v.map(snakeKeys);
  if (v === null || typeof v !== 'object') return v;
  const out = {};
  for (const [k, val] of Object.entries(v)) {
    const sk = k.replace(/[A-Z]/g, (c) => `_${c.toLowerCase()}`);
    out[sk] = k === 'labels' || k === 'details' ? val : snakeKeys(val);
  }
  return out;
}

async function request(method, path, body) {
  const init = { method, credentials: 'same-origin', headers: {} };
  if (body !== undefined) {
    init.headers['Content-Type'] = 'application/json';
    init.body = JSON.stringify(body);
  }
  const res = await fetch(path, init);
  let json = null;
  const text = await res.text();
  if (text) {
    try {
      json = JSON.parse(text);
    } catch {
      json = { error: { code: `HTTP ${res.status}`, message: text.slice(0, 200) } };
    }
  }
  if (!res.ok) throw new ApiError(res.status, json);
  return snakeKeys(json || {});
}

async function call(subject, body = {}) {
  try {
    const r = await request('POST', `/api/call/${subject}`, body);
    return r.result || {};
  } catch (e) {
    if (e instanceof ApiError && e.status === 401) showLogin('Your session ended; log in again.');
    throw e;
  }
}

// ---------- small helpers ----------

const $ = (id) => document.getElementById(id);

function el(tag, attrs = {}, ...children) {
  const n = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (v === undefined || v === null || v === false) continue;
    if (k === 'class') n.className = v;
    else if (k === 'text') n.textContent = v;
    else if (k.startsWith('on')) n.addEventListener(k.slice(2), v);
    else if (k === 'dataset') Object.assign(n.dataset, v);
    else n.setAttribute(k, v === true ? '' : String(v));
  }
  for (const c of children.flat()) {
    if (c === undefined || c === null || c === false) continue;
    n.append(c instanceof Node ? c : document.createTextNode(String(c)));
  }
  return n;
}

function td(...children) {
  return el('td', {}, ...children);
}

function fill(tbody, rows, emptyText, cols) {
  tbody.replaceChildren(...rows);
  if (!rows.length && emptyText) {
    tbody.append(el('tr', { class: 'empty' }, el('td', { colspan: cols, text: emptyText })));
  }
}

function kv(container, pairs) {
  container.replaceChildren(
    ...pairs.map(([k, v, id]) =>
      el('div', {}, el('span', { class: 'k', text: k }), el('span', { class: 'v', id }, v ?? '')),
    ),
  );
}

// Enum names on the wire ("SLOT_ADMIN_STATE_AVAILABLE"); a gateway printing numbers is mapped
// through the tables of the enums the page decides on.
const ENUMS = {
  SLOT_ADMIN_STATE: ['UNSPECIFIED', 'AVAILABLE', 'DISABLED'],
  SLOT_HEALTH: ['UNSPECIFIED', 'UNKNOWN', 'HEALTHY', 'DEGRADED', 'FAILED'],
  SLOT_LIFECYCLE_STATE: ['UNSPECIFIED', 'DISABLED', 'AVAILABLE', 'RESERVED', 'PROVISIONING',
    'ACTIVE', 'RELEASING', 'CLEANUP', 'CLEANUP_BLOCKED'],
  ALLOCATION_STATE: ['UNSPECIFIED', 'PENDING', 'RESERVED', 'PROVISIONING', 'ACTIVE', 'RELEASING',
    'RELEASED', 'FAILED'],
  CAPACITY_SHAPE: ['UNSPECIFIED', 'BAREMETAL', 'GPU_SLICE', 'GPU_PARTITION', 'GPU_SHARED'],
  CHECK_STATUS: ['UNSPECIFIED', 'PASS', 'WARN', 'FAIL'],
  CONSOLE_SESSION_STATE: ['UNSPECIFIED', 'CREATED', 'CONNECTED', 'DISCONNECTED', 'FAILED',
    'EXPIRED', 'REVOKED'],
  NODE_ADMIN_STATE: ['UNSPECIFIED', 'ACTIVE', 'DRAINING', 'DRAINED', 'MAINTENANCE',
    'DECOMMISSIONED'],
  CAPACITY_PROFILE: ['UNSPECIFIED', 'BAREMETAL', 'SLICE_VM'],
};

// "SLOT_ADMIN_STATE_AVAILABLE" (or 1) -> "available"; absent -> "unspecified".
function enumText(value, prefix) {
  if (value === undefined || value === null || value === '' || value === 0) return 'unspecified';
  if (typeof value === 'number') {
    const names = prefix && ENUMS[prefix];
    return names && names[value] ? names[value].toLowerCase() : String(value);
  }
  const s = String(value);
  if (prefix && s.startsWith(`${prefix}_`)) return s.slice(prefix.length + 1).toLowerCase();
  return s.toLowerCase();
}

// Display form of an enum the page only shows (never decides on): its type prefix dropped.
const DISPLAY_PREFIXES = new RegExp('^(TASK_TYPE|TASK_STATUS|TASK_STAGE|TIMELINE_STEP|CLAIM_KIND|' +
  'CLAIM_PHASE|EXPOSURE_STATE|TRANSPORT_PROTOCOL|FABRIC_CLAIM_MODE|FABRIC_TYPE|CAPACITY_PROFILE|' +
  'NETWORK_MODE|LEASE_STATE|LIFECYCLE_STAGE)_');
function stripEnum(value) {
  if (value === undefined || value === null || value === '' || value === 0) return '';
  return String(value).replace(DISPLAY_PREFIXES, '').toLowerCase();
}

// A node's mode as the CLI spells it: "slice-vm" or "baremetal".
function nodeMode(v) {
  const t = enumText(v, 'CAPACITY_PROFILE');
  return t === 'unspecified' ? '?' : t.replace(/_/g, '-');
}

// The mode an open mode change is taking a node to ("baremetal"), or '' when none is open
// (proto3 JSON leaves an UNSPECIFIED mode_target out).
function modeTarget(node) {
  const t = enumText(node && node.mode_target, 'CAPACITY_PROFILE');
  return t === 'unspecified' ? '' : t.replace(/_/g, '-');
}

// Why a node's last mode change failed (the agent's blockers); [] after a clean change.
function modeBlockers(node) {
  return (node && node.mode_blockers) || [];
}

// A node's mode for a list or a tile: "slice-vm", or "slice-vm→baremetal" while it changes.
function modeShort(node) {
  const target = modeTarget(node);
  const mode = nodeMode(node && node.capacity_profile);
  return target ? `${mode}→${target}` : mode;
}

// The mode as an element (data-field="mode"), marked while a change is open or after one failed.
function modeTag(node, attrs = {}) {
  const target = modeTarget(node);
  const failed = modeBlockers(node);
  return el('span', { class: `mode${target ? ' mode-changing' : ''}${failed.length ? ' mode-failed' :
    ''}`, 'data-field': 'mode', 'data-mode-target': target || undefined,
  title: target ? `mode change open: ${nodeMode(node.capacity_profile)} → ${target}` :
    failed.length ? `last mode change failed: ${failed.join(', ')}` : undefined,
  text: modeShort(node) + (failed.length && !target ? ' (!)' : ''), ...attrs });
}

// A node's admin state: "active", "draining", "drained", "maintenance", "decommissioned".
function adminState(node) {
  return enumText(node && node.admin_state, 'NODE_ADMIN_STATE');
}

function adminBadge(state, attrs = {}) {
  return el('span', { class: `badge admin admin-${state}`, 'data-field': 'admin-state',
    'data-admin-state': state, text: state, ...attrs });
}

function fmtTime(s) {
  if (!s) return '';
  return String(s).replace('T', ' ').replace(/\.\d+Z$/, 'Z');
}

function num(v) {
  // int64 arrives as a decimal string in proto JSON.
  if (v === undefined || v === null || v === '') return 0;
  const n = Number(v);
  return Number.isFinite(n) ? n : 0;
}

function flash(msg, isError = true) {
  const f = $('flash');
  if (!msg) {
    f.hidden = true;
    f.textContent = '';
    return;
  }
  f.hidden = false;
  f.className = isError ? 'error' : 'info';
  f.textContent = msg;
}

// Re-render a region only when its data changed, so that a periodic refresh does not swallow
// a click or reset a scroll position.
const lastRendered = new Map();
function changed(key, data) {
  const s = JSON.stringify(data);
  if (lastRendered.get(key) === s) return false;
  lastRendered.set(key, s);
  return true;
}

// ---------- login ----------

function showLogin(message) {
  $('app').hidden = true;
  $('whoami-bar').hidden = true;
  $('login-section').hidden = false;
  $('login-error').textContent = message || '';
  document.body.dataset.auth = 'out';
}

function showApp(who) {
  $('login-section').hidden = true;
  $('app').hidden = false;
  $('whoami-bar').hidden = false;
  $('whoami').textContent = `${who.principal || '?'} (${(who.roles || []).join(', ')})` +
    (who.expires_at ? ` until ${fmtTime(who.expires_at)}` : '');
  document.body.dataset.auth = 'in';
  document.body.dataset.principal = who.principal || '';
  lastRendered.clear();
  loadNodes();
  loadFleet();
}

async function login(ev) {
  ev.preventDefault();
  const token = $('login-token').value.trim();
  if (!token) {
    $('login-error').textContent = 'Paste a token first.';
    return;
  }
  $('login-submit').disabled = true;
  try {
    const who = await request('POST', '/api/login', { token });
    $('login-token').value = '';
    showApp(who);
  } catch (e) {
    $('login-error').textContent = `Login refused: ${e.message}`;
  } finally {
    $('login-submit').disabled = false;
  }
}

async function logout() {
  try {
    await request('POST', '/api/logout', {});
  } catch {
    // The cookie is gone either way once the server answers; a failure leaves nothing to do.
  }
  showLogin('Logged out.');
}

// ---------- tabs ----------

let currentTab = 'nodes';
function showTab(name) {
  currentTab = name;
  for (const b of document.querySelectorAll('#tabs button[data-tab]')) {
    b.classList.toggle('active', b.dataset.tab === name);
  }
  for (const p of document.querySelectorAll('[data-tab-panel]')) {
    p.hidden = p.dataset.tabPanel !== name;
  }
  if (name === 'nodes') {
    loadNodes();
    loadFleet();
  }
  if (name === 'allocs') loadAllocations();
  if (name === 'sessions') loadSessions();
}

// ---------- nodes ----------

let nodesNextToken = '';
let nodesList = [];
const nodeShows = new Map(); // node_id -> node.show result (list summaries)

function nodeState(show) {
  if (!show) return { state: 'unknown', cls: '' };
  if (!num(show.snapshot_version)) return { state: 'no topology', cls: 'warn' };
  if ((show.node_blockers || []).length) return { state: 'blocked', cls: 'bad' };
  // proto3 JSON leaves false out: absent means disabled.
  if (!show.region_enabled) return { state: 'region disabled', cls: 'warn' };
  return { state: 'ready', cls: 'good' };
}

function evidenceSummary(show) {
  const t = (show && show.topology) || {};
  const slots = (show && show.slots) || [];
  const avail = slots.filter((s) => enumText(s.admin_state, 'SLOT_ADMIN_STATE') === 'available');
  const checks = [...(t.prereqs || []), ...(t.network_checks || [])];
  const failed = checks.filter((c) => enumText(c.status, 'CHECK_STATUS') === 'fail').length;
  const warned = checks.filter((c) => enumText(c.status, 'CHECK_STATUS') === 'warn').length;
  return `snapshot v${num(show && show.snapshot_version)}: ${(t.gpus || []).length} GPU, ` +
    `${(t.nvme || []).length} NVMe, ${(t.fabric || []).length} fabric; ` +
    `${(t.candidates || []).length} candidates, ${avail.length} approved; ` +
    `checks ${checks.length} (${failed} fail, ${warned} warn)` +
    (t.reboot_required ? '; reboot required' : '');
}

async function loadNodes(more = false) {
  try {
    const req = { page_size: 100 };
    if (more && nodesNextToken) req.page_token = nodesNextToken;
    const r = await call('gpuaas.v1.inventory.node.list', req);
    const page = r.nodes || [];
    nodesList = more ? nodesList.concat(page) : page;
    nodesNextToken = r.next_page_token || '';
    $('nodes-more-bar').hidden = !nodesNextToken;
    renderNodes();
    // The state and evidence come from node.show, one call per listed node, a few at a time.
    const queue = page.map((n) => n.node_id);
    const worker = async () => {
      while (queue.length) {
        const id = queue.shift();
        try {
          nodeShows.set(id, await call('gpuaas.v1.inventory.node.show', { node_id: id }));
        } catch (e) {
          nodeShows.set(id, { error: e.message });
        }
        renderNodes();
        renderFleet();
      }
    };
    await Promise.all([worker(), worker(), worker(), worker()]);
  } catch (e) {
    flash(`Nodes: ${e.message}`);
  }
}

function renderNodes() {
  // The fleet picture reads node.list every refresh: its copy of a node is the fresher one.
  const data = nodesList.map((n) => [fleetNodes.get(n.node_id) || n, nodeShows.get(n.node_id)]);
  if (!changed('nodes', data)) return;
  const rows = data.map(([n, show]) => {
    const st = show && show.error ? { state: 'error', cls: 'bad' } : nodeState(show);
    const blockers = (show && show.node_blockers) || [];
    const admin = adminState(n);
    const failed = modeBlockers(n);
    return el('tr', { 'data-testid': 'node-row', 'data-node-id': n.node_id,
      'data-node-state': st.state, 'data-admin-state': admin,
      'data-mode': nodeMode(n.capacity_profile), 'data-mode-target': modeTarget(n) || undefined },
    td(el('b', { text: n.node_id })),
    td(n.hostname || ''),
    td(`${n.region || ''} / ${n.pool || ''}`),
    td(modeTag(n), modeTarget(n) ? el('div', { class: 'small', text: 'changing' }) : null,
      failed.length && !modeTarget(n) ? el('div', { class: 'small bad',
        'data-field': 'mode-blockers', text: `last change failed: ${failed.join(', ')}` }) : null),
    td(adminBadge(admin), n.admin_reason ? el('div', { class: 'small', text: n.admin_reason }) :
      null),
    td(n.agent_version || ''),
    td(String(num(n.generation))),
    td(el('span', { class: `badge ${st.cls}`, 'data-field': 'state', text: st.state }), ' ',
      el('span', { class: 'small', 'data-field': 'evidence',
        text: show && !show.error ? evidenceSummary(show) : (show && show.error) || '…' }),
      blockers.length ? el('div', { class: 'bad small', 'data-field': 'blockers',
        text: `blockers: ${blockers.join(', ')}` }) : null,
      ' ',
      el('button', { type: 'button', 'data-testid': 'node-open', onclick: () => openNode(n.node_id),
        text: 'Show' })));
  });
  fill($('nodes-body'), rows, 'No nodes registered.', 8);
}

// ---------- fleet picture ----------

// Every page of a list subject (bounded); `key` names the repeated field.
async function listAll(subject, req, key, maxPages = 50) {
  let all = [];
  let token = '';
  for (let i = 0; i < maxPages; i++) {
    const r = await call(subject, token ? { ...req, page_token: token } : req);
    all = all.concat(r[key] || []);
    token = r.next_page_token || '';
    if (!token) break;
  }
  return all;
}

const fleetNodes = new Map(); // node_id -> Node from node.list (the full record)
let fleetData = { nodes: [], slots: [], nodesErr: '', slotsErr: '' };
let fleetLoading = false;
let fleetAgain = false;

async function loadFleet() {
  if (fleetLoading) {
    fleetAgain = true;
    return;
  }
  fleetLoading = true;
  try {
    const [nodes, slots] = await Promise.all([
      listAll('gpuaas.v1.inventory.node.list', { page_size: 1000 }, 'nodes')
        .then((v) => ({ ok: v }), (e) => ({ err: e.message })),
      listAll('gpuaas.v1.scheduler.slot.list', { page_size: 1000 }, 'slots')
        .then((v) => ({ ok: v }), (e) => ({ err: e.message })),
    ]);
    fleetData = {
      // A failed read keeps what the last one showed, marked with its error.
      nodes: nodes.ok || fleetData.nodes, nodesErr: nodes.err || '',
      slots: slots.ok || fleetData.slots, slotsErr: slots.err || '',
    };
    if (nodes.ok) {
      fleetNodes.clear();
      for (const n of nodes.ok) fleetNodes.set(n.node_id, n);
    }
    renderFleet();
    renderNodes();
  } finally {
    fleetLoading = false;
  }
  if (fleetAgain) {
    fleetAgain = false;
    loadFleet();
  }
}

const HELD_LIFECYCLES = ['reserved', 'provisioning', 'active', 'releasing', 'cleanup'];
const OUT_ADMIN_STATES = ['draining', 'drained', 'maintenance', 'decommissioned'];

// One projected slot's cell state, first match wins: a claim (held) or a cleanup waiting for
// its proof, then what keeps a free slot out of service.
function cellState(p, nodeAdmin) {
  const lifecycle = enumText(p.lifecycle, 'SLOT_LIFECYCLE_STATE');
  const health = enumText(p.health, 'SLOT_HEALTH');
  if (lifecycle === 'cleanup_blocked') return 'cleanup_blocked';
  if (p.allocation_id || HELD_LIFECYCLES.includes(lifecycle)) return 'held';
  if (health === 'degraded' || health === 'failed') return 'degraded';
  if (lifecycle === 'disabled' || enumText(p.admin_state, 'SLOT_ADMIN_STATE') === 'disabled') {
    return 'unschedulable';
  }
  // Inventory calls no slot of a node that is not active schedulable: the node's state says why.
  if (OUT_ADMIN_STATES.includes(nodeAdmin)) return 'draining';
  if (!p.schedulable) return 'unschedulable';
  return 'free';
}

// Capacity bar segments: the cell states folded into four.
const BAR_OF = { free: 'free', held: 'held', cleanup_blocked: 'blocked', degraded: 'blocked',
  unschedulable: 'blocked', draining: 'draining' };
const BAR_SEGMENTS = ['free', 'held', 'blocked', 'draining'];

// The model the picture draws: plain data, so that an unchanged fleet is not redrawn.
function fleetModel() {
  const nodes = new Map();
  // A slot whose node node.list did not return (yet) lends it only its region and pool.
  const nodeOf = (id, slot) => {
    if (!nodes.has(id)) {
      const n = fleetNodes.get(id) || { node_id: id, region: slot && slot.region,
        pool: slot && slot.pool };
      nodes.set(id, { id, region: n.region || '', pool: n.pool || '',
        mode: nodeMode(n.capacity_profile), modeTarget: modeTarget(n),
        modeBlockers: modeBlockers(n), admin: n.admin_state ? adminState(n) : 'unknown',
        reason: n.admin_reason || '',
        deadline: n.drain_deadline || '', hostname: n.hostname || '', blockers: [], cells: [],
        skus: [] });
    }
    return nodes.get(id);
  };
  for (const n of fleetData.nodes) nodeOf(n.node_id);
  const groups = new Map();
  for (const p of fleetData.slots) {
    const node = nodeOf(p.node_id, p);
    const state = cellState(p, node.admin);
    const lifecycle = enumText(p.lifecycle, 'SLOT_LIFECYCLE_STATE');
    const health = enumText(p.health, 'SLOT_HEALTH');
    node.cells.push({ key: p.slot_key, state, alloc: p.allocation_id || '',
      title: `${p.slot_key}: ${state.replace('_', ' ')} · ${lifecycle} · ${health}` +
        `${p.schedulable ? ' · schedulable' : ' · not schedulable'}` +
        `${p.allocation_id ? ` · allocation ${p.allocation_id}` : ''}` +
        `${p.sku ? ` · ${p.sku}` : ''}` });
    for (const b of p.node_blockers || []) if (!node.blockers.includes(b)) node.blockers.push(b);
    const sku = p.sku || 'unknown';
    if (!node.skus.includes(sku)) node.skus.push(sku);
    const gk = `${p.region || node.region}/${p.pool || node.pool}/${sku}`;
    if (!groups.has(gk)) {
      groups.set(gk, { key: gk, region: p.region || node.region, pool: p.pool || node.pool, sku,
        free: 0, held: 0, blocked: 0, draining: 0, total: 0, nodes: [] });
    }
    const g = groups.get(gk);
    g[BAR_OF[state]] += 1;
    g.total += 1;
    if (!g.nodes.includes(node.id)) g.nodes.push(node.id);
  }
  // Candidates of the latest snapshot not yet approved (node.show, loaded for the node list).
  for (const node of nodes.values()) {
    const show = nodeShows.get(node.id);
    if (!show || show.error) continue;
    const known = new Set([...node.cells.map((c) => c.key),
      ...(show.slots || []).map((x) => x.slot_key)]);
    for (const c of ((show.topology || {}).candidates) || []) {
      if (!c.slot_key || known.has(c.slot_key)) continue;
      node.cells.push({ key: c.slot_key, state: 'candidate', alloc: '',
        title: `${c.slot_key}: candidate (not approved)` });
    }
    for (const b of show.node_blockers || []) if (!node.blockers.includes(b)) node.blockers.push(b);
  }
  return {
    nodes: [...nodes.values()].sort((a, b) => (a.region + a.pool + a.id).localeCompare(
      b.region + b.pool + b.id)),
    groups: [...groups.values()].sort((a, b) => a.key.localeCompare(b.key)),
    nodesErr: fleetData.nodesErr,
    slotsErr: fleetData.slotsErr,
  };
}

function renderFleet() {
  const m = fleetModel();
  if (!changed('fleet', m)) return;
  const totals = { free: 0, held: 0, blocked: 0, draining: 0, total: 0 };
  for (const g of m.groups) for (const k of Object.keys(totals)) totals[k] += g[k];
  const candidates = m.nodes.reduce((n, x) => n + x.cells.filter((c) => c.state === 'candidate')
    .length, 0);
  const byAdmin = {};
  for (const n of m.nodes) byAdmin[n.admin] = (byAdmin[n.admin] || 0) + 1;
  const fleet = $('fleet');
  Object.assign(fleet.dataset, { nodes: String(m.nodes.length), slots: String(totals.total),
    free: String(totals.free), held: String(totals.held), loaded: 'true' });
  $('fleet-summary').textContent = `${m.nodes.length} nodes (` +
    Object.entries(byAdmin).map(([k, v]) => `${v} ${k}`).join(', ') + `), ${totals.total} slots: ` +
    `${totals.free} free, ${totals.held} held, ${totals.blocked} blocked, ` +
    `${totals.draining} draining` + (candidates ? `; ${candidates} candidates` : '') +
    (m.nodesErr ? ` · node.list: ${m.nodesErr}` : '') +
    (m.slotsErr ? ` · slot.list: ${m.slotsErr}` : '');
  $('fleet-summary').className = m.nodesErr || m.slotsErr ? 'small bad' : 'small';

  // Capacity: one stacked bar per region / pool / SKU, its length relative to the largest.
  const max = Math.max(1, ...m.groups.map((g) => g.total));
  const rows = m.groups.map((g) => {
    const bar = el('div', { class: 'cap-bar' });
    bar.style.width = `${(100 * g.total) / max}%`;
    for (const seg of BAR_SEGMENTS) {
      if (!g[seg]) continue;
      const s = el('span', { class: `cap-seg cell-${seg}`,
        'data-segment': seg, title: `${g[seg]} ${seg}`, text: String(g[seg]) });
      s.style.width = `${(100 * g[seg]) / g.total}%`;
      bar.append(s);
    }
    return el('div', { class: 'cap-row', 'data-testid': 'capacity-row', 'data-group': g.key,
      'data-free': g.free, 'data-held': g.held, 'data-blocked': g.blocked,
      'data-draining': g.draining, 'data-total': g.total },
    el('div', { class: 'cap-label' }, el('b', { text: `${g.region} / ${g.pool}` }), ' · ',
      el('code', { text: g.sku })),
    el('div', { class: 'cap-track' }, bar),
    el('div', { class: 'cap-count small', text: `${g.free} free of ${g.total} · ${g.held} held` +
      (g.blocked ? ` · ${g.blocked} blocked` : '') + (g.draining ? ` · ${g.draining} draining` :
      '') + ` · ${g.nodes.length} node${g.nodes.length === 1 ? '' : 's'}` }));
  });
  $('fleet-capacity').replaceChildren(...rows);
  if (!rows.length) {
    $('fleet-capacity').append(el('div', { class: 'small', text: m.slotsErr ?
      `scheduler slot.list: ${m.slotsErr}` : 'No approved slots yet.' }));
  }

  // Nodes: a tile each, grouped by region / pool, its slots as a grid of cells.
  const sections = [];
  let group = null;
  for (const n of m.nodes) {
    const gk = `${n.region} / ${n.pool}`;
    if (!group || group.key !== gk) {
      group = { key: gk, grid: el('div', { class: 'tile-grid' }) };
      sections.push(el('div', { class: 'tile-group', 'data-group': gk },
        el('div', { class: 'tile-group-title small', text: gk }), group.grid));
    }
    const count = (st) => n.cells.filter((c) => c.state === st).length;
    const cells = n.cells.map((c) => el('span', { class: `cell cell-${c.state}`,
      'data-testid': 'slot-cell', 'data-slot-key': c.key, 'data-cell-state': c.state,
      'data-allocation-id': c.alloc || undefined, title: c.title }));
    const open = () => openNode(n.id);
    group.grid.append(el('div', { class: `node-tile tile-${n.admin}` +
      `${n.modeTarget ? ' tile-mode-changing' : ''}`, role: 'button', tabindex: 0,
      'data-testid': 'fleet-node', 'data-node-id': n.id, 'data-admin-state': n.admin,
      'data-mode': n.mode, 'data-mode-target': n.modeTarget || undefined,
      'data-slots': n.cells.length, 'data-free': count('free'),
      'data-held': count('held'), title: `${n.id} (${n.hostname}) — open the node's view` +
        (n.reason ? `\n${n.admin}: ${n.reason}` : '') +
        (n.deadline ? `\ndrain deadline ${fmtTime(n.deadline)}` : '') +
        (n.modeTarget ? `\nmode change open: ${n.mode} → ${n.modeTarget}` : '') +
        (n.modeBlockers.length ? `\nlast mode change failed: ${n.modeBlockers.join(', ')}` : ''),
      onclick: open, onkeydown: (e) => {
        if (e.key === 'Enter' || e.key === ' ') {
          e.preventDefault();
          open();
        }
      } },
    el('div', { class: 'tile-head' }, el('span', { class: 'tile-id', text: n.id }),
      adminBadge(n.admin)),
    el('div', { class: 'tile-sub small' },
      // The model keeps display texts; they read back through the same helpers.
      modeTag({ capacity_profile: n.mode, mode_target: n.modeTarget,
        mode_blockers: n.modeBlockers }),
      ` · ${count('free')}/${n.cells.length} free`,
      n.skus.length ? ` · ${n.skus.join(', ')}` : ''),
    n.blockers.length ? el('div', { class: 'small bad', 'data-field': 'blockers',
      text: `blocked: ${n.blockers.join(', ')}` }) : null,
    n.modeBlockers.length && !n.modeTarget ? el('div', { class: 'small bad',
      'data-field': 'mode-blockers', text: `mode change failed: ${n.modeBlockers.join(', ')}` }) :
      null,
    el('div', { class: 'cells' }, cells.length ? cells :
      el('span', { class: 'small', text: 'no slots' }))));
  }
  $('fleet-nodes').replaceChildren(...sections);
  if (!sections.length) {
    $('fleet-nodes').append(el('div', { class: 'small', text: m.nodesErr ?
      `inventory node.list: ${m.nodesErr}` : 'No nodes registered.' }));
  }
}

let openNodeId = '';
let nodeLoading = false;
let nodeAgain = false;
const adminAnswers = new Map(); // node_id -> Node from the last host operation's answer

function openNode(nodeId) {
  openNodeId = nodeId;
  $('node-detail').hidden = false;
  $('node-detail').dataset.nodeId = nodeId;
  $('node-detail-id').textContent = nodeId;
  $('slot-action-result').textContent = '';
  adminResult('', null);
  delete $('node-detail').dataset.adminState;
  for (const k of [...lastRendered.keys()]) if (k.startsWith('node:')) lastRendered.delete(k);
  loadNode();
  $('node-detail').scrollIntoView({ block: 'start' });
}

// The pieces of a node's view; each loads on its own so one failing service does not blank the
// rest.
let nodeView = {};

async function loadNode() {
  const nodeId = openNodeId;
  if (!nodeId) return;
  if (nodeLoading) {
    nodeAgain = true;
    return;
  }
  nodeLoading = true;
  const settle = async (subject, body) => {
    try {
      return { ok: await call(subject, body) };
    } catch (e) {
      return { err: e.message };
    }
  };
  try {
    const [show, proj, net, drift, desired, expo, holders] = await Promise.all([
      settle('gpuaas.v1.inventory.node.show', { node_id: nodeId }),
      settle('gpuaas.v1.scheduler.slot.list', { node_id: nodeId, page_size: 1000 }),
      settle(`gpuaas.v1.ipam.node.${nodeId}.network.get`, { node_id: nodeId }),
      settle('gpuaas.v1.ipam.drift.list', { node_id: nodeId }),
      settle(`gpuaas.v1.inventory.node.${nodeId}.desired.get`, { node_id: nodeId }),
      settle('gpuaas.v1.ingress.exposure.list', { node_id: nodeId }),
      settle('gpuaas.v1.scheduler.node.holders', { node_id: nodeId }),
    ]);
    if (nodeId !== openNodeId) return;
    nodeView = { show, proj, net, drift, desired, expo, holders };
    if (show.ok) nodeShows.set(nodeId, show.ok);
    renderNode();
  } finally {
    nodeLoading = false;
  }
  if (nodeAgain) {
    nodeAgain = false;
    loadNode();
  }
}

function renderNode() {
  const { show, proj, net, drift, desired, expo, holders } = nodeView;
  const s = show.ok || {};
  renderNodeAdmin(show, holders);
  if (changed('node:summary', show)) {
    const n = s.node || {};
    const st = show.err ? { state: `error: ${show.err}` } : nodeState(s);
    kv($('node-summary'), [
      ['State', st.state, 'node-state'],
      ['Host', n.hostname || ''],
      ['Region / pool', `${n.region || ''} / ${n.pool || ''}` +
        (s.region_enabled ? '' : ' (region disabled)')],
      ['Evidence', show.ok ? evidenceSummary(s) : '', 'node-evidence'],
      ['Snapshot', `v${num(s.snapshot_version)} at ${fmtTime(s.snapshot_at)}`, 'node-snapshot'],
      ['Desired / applied slot set', `v${num(s.desired_version)} / v${num(s.applied_version)}`],
    ]);
    const blockers = s.node_blockers || [];
    fill($('node-blockers'), blockers.map((b) => el('li', { class: 'bad', text: b })),
      '', 1);
    if (!blockers.length) $('node-blockers').append(el('li', { text: 'none' }));
    const t = s.topology || {};
    const checks = [
      ...(t.prereqs || []).map((c) => ['prereq', c]),
      ...(t.network_checks || []).map((c) => ['network', c]),
    ];
    fill($('node-checks'), checks.map(([kind, c]) => {
      const status = enumText(c.status, 'CHECK_STATUS');
      return el('tr', { 'data-testid': 'check-row', 'data-check': c.name, 'data-status': status },
        td(kind), td(c.name || ''),
        td(el('span', { class: `badge ${status === 'pass' ? 'good' : status === 'fail' ? 'bad' : 'warn'}`,
          text: status })),
        td(c.blocker ? 'blocker' : ''), td(c.detail || ''), td(c.remediation || ''));
    }), 'No checks reported.', 6);
    fill($('node-tasks'), (s.recent_tasks || []).map((t2) => el('tr', {},
      td(t2.task_id || ''), td(stripEnum(t2.type)), td(stripEnum(t2.status)),
      td(fmtTime(t2.queued_at)), td(fmtTime(t2.finished_at)), td(t2.error || ''))),
    'No tasks.', 6);
  }
  if (changed('node:slots', [show, proj])) renderSlots(s, proj);
  if (changed('node:desired', [desired, s.applied_version])) {
    const d = (desired.ok && desired.ok.desired) || {};
    kv($('node-desired'), desired.err ? [['Error', desired.err]] : [
      ['Desired version', `v${num(d.version)}`, 'node-desired-version'],
      ['Slots in it', (d.slots || []).map((x) => x.slot_key).join(', ') || 'none'],
      ['Written', fmtTime(d.created_at)],
      ['Agent applied', `v${num(s.applied_version)}`],
    ]);
  }
  if (changed('node:net', net)) {
    const r = net.ok || {};
    const doc = r.document || {};
    const nat = doc.nat || {};
    kv($('node-network'), net.err ? [['Error', net.err]] : [
      ['Document version', `v${num(doc.version)}`, 'node-network-version'],
      ['Latest version', `v${num(r.latest_version)}`],
      ['Acked by the agent', `v${num(r.applied_version)}` +
        (r.acked_at ? ` at ${fmtTime(r.acked_at)}` : ' (never)'), 'node-network-acked'],
      ['In sync', num(r.applied_version) >= num(r.latest_version) && num(r.latest_version) > 0 ?
        'yes' : 'no', 'node-network-in-sync'],
      ['Ack blockers', (r.blockers || []).join(', ') || 'none'],
      ['Bridge / subnet / gateway', `${doc.bridge || ''} ${doc.subnet || ''} ${doc.gateway || ''}`],
      ['NAT masquerade', nat.masquerade ? 'yes' : 'no'],
    ]);
    fill($('node-reservations'), (doc.reservations || []).map((x) => el('tr', {},
      td(x.slot_key || ''), td(x.mac || ''), td(x.ip || ''), td(x.hostname || ''),
      td(x.allocation_id || ''))), 'No reservations.', 5);
  }
  if (changed('node:drift', drift)) {
    const rows = drift.err ? [el('tr', {}, el('td', { colspan: 6, class: 'error',
      text: drift.err }))] : ((drift.ok && drift.ok.drift) || []).map((d) => el('tr', {},
      td(String(num(d.drift_id))), td(d.slot_key || ''), td(d.kind || ''),
      td(`${d.expected_ip || '-'} / ${d.actual_ip || '-'}`), td(d.detail || ''),
      td(fmtTime(d.detected_at))));
    fill($('node-ipam-drift'), rows, 'No open drift.', 6);
  }
  if (changed('node:expo', expo)) renderExposures($('node-exposures'), expo, true);
}

// Mode, admin state and the last host operation; the allocations holding a node that is not
// active. node.show's node has no timestamps but admin_changed_at: node.list's record (or the
// last host operation's answer) gives it when it is of the same generation.
function renderNodeAdmin(show, holders) {
  const id = openNodeId;
  const full = [adminAnswers.get(id), fleetNodes.get(id)].filter(Boolean)
    .sort((a, b) => num(b.generation) - num(a.generation))[0];
  const n = show.ok ? (show.ok.node || {}) : full || {};
  const known = (show.ok || full) && n.admin_state;
  const state = known ? adminState(n) : 'unknown';
  const changedAt = full && num(full.generation) >= num(n.generation) ? full.admin_changed_at : '';
  const list = (holders && holders.ok && holders.ok.holders) || [];
  const mode = nodeMode(n.capacity_profile);
  const target = modeTarget(n);
  const failed = modeBlockers(n);
  const detail = $('node-detail');
  detail.dataset.adminState = state;
  detail.dataset.mode = mode;
  detail.dataset.modeTarget = target;
  // Only what the admin-state table allows is offered; an unknown state offers every operation
  // and inventory decides (its refusal is shown). While a mode change is open inventory refuses
  // every move of the drained node (mode_change_in_progress): they wait for the agent's report.
  const allow = { drain: ['active'], undrain: ['draining', 'drained'], maintenance: ['drained'],
    mode: ['drained'], decommission: ['drained'] };
  for (const [op, states] of Object.entries(allow)) {
    const b = $(`node-${op}`);
    const wrongState = state !== 'unknown' && !states.includes(state);
    const modeOpen = !!target && op !== 'drain';
    b.disabled = adminBusy || wrongState || modeOpen;
    b.title = adminBusy ? '' : wrongState ? `not from ${state}${states.length === 1 ?
      ` (only from ${states[0]})` : ''}` : modeOpen ? `a mode change to ${target} is open` : '';
  }
  $('node-mode-select').disabled = $('node-mode').disabled;
  // Preselect the other mode, once per node and mode, so that a refresh keeps a choice.
  const preselect = `${id}|${mode}`;
  if (modeSelectFor !== preselect && (mode === 'slice-vm' || mode === 'baremetal')) {
    modeSelectFor = preselect;
    $('node-mode-select').value = mode === 'slice-vm' ? 'CAPACITY_PROFILE_BAREMETAL' :
      'CAPACITY_PROFILE_SLICE_VM';
  }
  $('node-admin-hint').textContent = {
    active: 'Drain: no new placement lands; it is drained once nothing holds it.',
    draining: 'Draining until its last allocation is released; Undrain puts it back in service.',
    drained: target ? `Nothing holds it. A mode change to ${target} is open: the agent is ` +
      'rebinding its devices; every other operation waits for its report.' :
      'Nothing holds it. Maintenance takes it out; Undrain puts it back in service; Change mode ' +
      'or Decommission (final) below.',
    maintenance: 'Returns to active by itself once its agent\'s checks pass.',
    decommissioned: 'Retired for good; revoke its NATS key: gpuaasctl node revoke ' +
      `${id} --keys DIR.`,
  }[state] || '';
  if (!changed('node:admin', [show.err, n, changedAt, holders])) return;
  const deadline = n.drain_deadline || '';
  const overdue = deadline && state === 'draining' && Date.parse(deadline) < Date.now();
  kv($('node-admin'), [
    ['Mode', [el('span', { id: 'node-mode-text', 'data-mode': mode,
      'data-mode-target': target || undefined, class: target ? 'mode-changing' : undefined,
      text: target ? `${mode} → ${target} (changing)` : mode }),
    failed.length ? el('div', { id: 'node-mode-blockers', class: 'bad small',
      'data-field': 'mode-blockers', text: `last change failed: ${failed.join(', ')}` }) : null]],
    ['Admin state', known ? adminBadge(state, { id: 'node-admin-state' }) :
      `unknown${show.err ? ` (${show.err})` : ''}`],
    ['Reason', n.admin_reason || '', 'node-admin-reason-text'],
    ['By', n.admin_actor || '', 'node-admin-actor'],
    ['Changed', fmtTime(changedAt)],
    ['Drain deadline', deadline ? `${fmtTime(deadline)}${overdue ? ' (overdue)' : ''}` : 'none',
      'node-drain-deadline'],
  ]);
  if (overdue) $('node-drain-deadline').className = 'v bad';
  const block = $('node-holders-block');
  block.hidden = state === 'active' || state === 'unknown' ||
    (state !== 'draining' && !list.length && !(holders && holders.err));
  block.dataset.count = String(list.length);
  if (holders && holders.err) {
    fill($('node-holders'), [el('tr', {}, el('td', { colspan: 6, class: 'error',
      text: `scheduler node.holders: ${holders.err}` }))]);
    return;
  }
  fill($('node-holders'), list.map((h) => el('tr', { 'data-testid': 'holder-row',
    'data-allocation-id': h.allocation_id, 'data-state': enumText(h.state, 'ALLOCATION_STATE') },
  td(el('code', { text: h.allocation_id }), ' ', el('button', { type: 'button',
    'data-testid': 'holder-open', text: 'Details', onclick: () => {
      showTab('allocs');
      openAllocation(h.allocation_id);
    } })),
  td(h.tenant || ''), td(enumText(h.state, 'ALLOCATION_STATE')),
  td(enumText(h.shape, 'CAPACITY_SHAPE')),
  td((h.slot_keys || []).join(', ') || 'the whole node'), td(fmtTime(h.created_at)))),
  state === 'draining' ? 'Nothing holds it any more: it becomes drained.' : 'None.', 6);
}

let adminBusy = false;
let modeSelectFor = ''; // "<node>|<mode>" the mode select was last preselected for
const ADMIN_OPS = ['drain', 'undrain', 'maintenance', 'mode', 'decommission'];

// The answer of a host operation, or its refusal with the error's details.
function adminResult(text, ok, extra = {}) {
  const r = $('node-admin-result');
  if (ok === null) {
    r.replaceChildren();
    r.className = 'result';
    for (const k of Object.keys(r.dataset)) delete r.dataset[k];
    return;
  }
  r.replaceChildren(...[text].flat().filter((x) => x !== null && x !== undefined && x !== ''));
  r.className = `result ${ok ? 'good' : 'bad'}`;
  for (const k of Object.keys(r.dataset)) delete r.dataset[k];
  Object.assign(r.dataset, extra);
  r.dataset.ok = String(!!ok);
}

function errorParts(e) {
  if (!(e instanceof ApiError)) return [String(e && e.message ? e.message : e)];
  const details = Object.entries(e.details || {});
  return [el('b', { text: `${e.code || `HTTP ${e.status}`}${e.reason ? ` ${e.reason}` : ''}` }),
    e.serverMessage ? `: ${e.serverMessage}` : '',
    details.length ? el('ul', { class: 'details small' }, details.map(([k, v]) =>
      el('li', { 'data-detail': k }, el('code', { text: k }), ': ',
        k === 'allocations' ? allocationLinks(v) :
          typeof v === 'string' ? v : JSON.stringify(v))))
      : null];
}

// A details field naming allocations ("a,b" or a list): each id with a Details button.
function allocationLinks(v) {
  const ids = (Array.isArray(v) ? v : String(v).split(',')).map((x) => String(x).trim())
    .filter(Boolean);
  if (!ids.length) return 'none';
  return ids.flatMap((id, i) => [i ? ', ' : '', el('code', { text: id }), ' ',
    el('button', { type: 'button', 'data-testid': 'detail-alloc-open', 'data-allocation-id': id,
      text: 'Details', onclick: () => {
        showTab('allocs');
        openAllocation(id);
      } })]);
}

async function nodeAdmin(op) {
  const nodeId = openNodeId;
  const reason = $('node-admin-reason').value.trim();
  if (!nodeId) return;
  if (!reason) {
    adminResult(`A reason is required to ${op === 'mode' ? 'change the mode of' : op} a node.`,
      false, { op });
    return;
  }
  const req = { node_id: nodeId, reason };
  if (op === 'mode') {
    req.mode = $('node-mode-select').value;
    if (!['CAPACITY_PROFILE_SLICE_VM', 'CAPACITY_PROFILE_BAREMETAL'].includes(req.mode)) {
      adminResult('Pick the mode to change to.', false, { op });
      return;
    }
  }
  if (op === 'decommission') {
    // Final: asked once more, in words that say so.
    const ok = window.confirm(`Decommission ${nodeId}?\n\nThis is final: the node is retired ` +
      'for good, every slot disabled and its desired slot set emptied; it cannot be undrained ' +
      'or brought back.\n\nAfterwards revoke its NATS key:\n' +
      `  gpuaasctl node revoke ${nodeId} --keys DIR`);
    if (!ok) {
      adminResult(`decommission ${nodeId}: not confirmed, nothing sent.`, false,
        { op, cancelled: 'true' });
      return;
    }
  }
  if (op === 'drain') {
    const h = $('node-drain-hours').value.trim();
    if (h) {
      const hours = Number(h);
      if (!Number.isFinite(hours) || hours < 0) {
        adminResult('The drain deadline is a number of hours (empty: none).', false, { op });
        return;
      }
      req.deadline_s = Math.round(hours * 3600);
    }
  }
  adminBusy = true;
  for (const b of ADMIN_OPS) $(`node-${b}`).disabled = true;
  $('node-mode-select').disabled = true;
  const wanted = op === 'mode' ? nodeMode(req.mode) : '';
  adminResult(`${op} ${nodeId}${wanted ? ` to ${wanted}` : ''}…`, true, { op, pending: 'true' });
  try {
    const r = await call(`gpuaas.v1.inventory.node.${op}`, req);
    const node = r.node || {};
    if (node.node_id) adminAnswers.set(node.node_id, node);
    const state = adminState(node);
    const holding = r.holding_allocations || [];
    const target = modeTarget(node);
    if (nodeId === openNodeId && op === 'mode') {
      const mode = nodeMode(node.capacity_profile);
      adminResult([`mode: ${nodeId} `, target ? `is changing ${mode} → ${target}: its agent ` +
        'rebinds the devices, then the mode applies (or the change fails with its blockers)' :
        r.changed ? `is ${mode}` : `is ${mode} already (unchanged)`,
      (target || wanted) === 'slice-vm' && (target || r.changed) ? ' · once it is slice-vm ' +
        'again every slot is disabled: approve the slots again' : '',
      ' · ', adminBadge(state)], true,
      { op, adminState: state, changed: String(!!r.changed), mode, modeTarget: target });
    } else if (nodeId === openNodeId && op === 'decommission') {
      adminResult([`decommission: ${nodeId} is `, adminBadge(state),
        r.changed ? '' : ' (unchanged: it already was)',
        state === 'decommissioned' ? el('div', { class: 'small', 'data-field': 'revoke-hint' },
          'Now revoke its NATS key: ', el('code', {
            text: `gpuaasctl node revoke ${nodeId} --keys DIR` })) : null], true,
      { op, adminState: state, changed: String(!!r.changed) });
    } else if (nodeId === openNodeId) {
      adminResult([`${op}: ${nodeId} is `, adminBadge(state),
        r.changed ? '' : ' (unchanged: it already was)',
        op === 'drain' ? (holding.length ? ` · held by ${holding.length} allocation(s): ` +
          `${holding.join(', ')}` : ' · nothing holds it') : '',
        node.drain_deadline ? ` · deadline ${fmtTime(node.drain_deadline)}` : ''], true,
      { op, adminState: state, changed: String(!!r.changed) });
    }
  } catch (e) {
    // The answer belongs to the node it was asked for; another node's view may be open now.
    if (nodeId === openNodeId) {
      adminResult([`${op} ${nodeId} refused: `, ...errorParts(e)], false,
        { op, code: e.code || '', reason: e.reason || '' });
    }
  } finally {
    adminBusy = false;
  }
  lastRendered.delete('node:admin');
  if (nodeId === openNodeId) loadNode();
  loadFleet();
}

function renderExposures(tbody, expo, withAllocation) {
  if (expo.err) {
    fill(tbody, [el('tr', {}, el('td', { colspan: 6, class: 'error', text: expo.err }))]);
    return;
  }
  const list = (expo.ok && expo.ok.exposures) || [];
  fill(tbody, list.map((x) => el('tr', { 'data-exposure-id': x.exposure_id },
    td(`${x.name || ''} ${stripEnum(x.protocol)}/${x.target_port || ''}`),
    withAllocation ? td(x.allocation_id || '') : null,
    td(stripEnum(x.state)),
    td(x.public_ip ? `${x.public_ip}:${x.public_port || ''}` : ''),
    withAllocation ? td(x.target_ip ? `${x.target_ip}:${x.target_port || ''}` : '') :
      td(x.connect || ''),
    td([x.reason, x.detail].filter(Boolean).join(': ')))), 'No exposures.', 6);
}

// Candidates (advisory, from the latest topology) and approved/disabled slots, one row per
// slot key, with the scheduler's projection beside them.
function renderSlots(s, proj) {
  const candidates = ((s.topology || {}).candidates) || [];
  const slots = s.slots || [];
  const projected = new Map(((proj.ok && proj.ok.slots) || []).map((p) => [p.slot_key, p]));
  const keys = [];
  const seen = new Set();
  const add = (k) => {
    if (k && !seen.has(k)) {
      seen.add(k);
      keys.push(k);
    }
  };
  candidates.forEach((c) => add(c.slot_key));
  slots.forEach((x) => add(x.slot_key));
  const byKeyC = new Map(candidates.map((c) => [c.slot_key, c]));
  const byKeyS = new Map(slots.map((x) => [x.slot_key, x]));
  const rows = keys.map((key) => {
    const c = byKeyC.get(key);
    const sl = byKeyS.get(key);
    const p = projected.get(key);
    const admin = sl ? enumText(sl.admin_state, 'SLOT_ADMIN_STATE') : 'candidate';
    const health = sl ? enumText(sl.health, 'SLOT_HEALTH') : '';
    const schedulable = p ? String(!!p.schedulable) : proj.err ? 'unknown' : 'absent';
    const lifecycle = p ? enumText(p.lifecycle, 'SLOT_LIFECYCLE_STATE') : '';
    const cand = c ? [
      `${c.gpu_pci_address || ''} numa${c.numa_node ?? '?'} ${c.locality_group || ''}`,
      el('br'), `${c.nvme_by_id || 'no NVMe'} · ${stripEnum(c.fabric_claim_mode)} ` +
        `${c.fabric_vf_pci_address || ''}`,
      el('br'), `suggested ${c.suggested_mac || ''} ${c.suggested_ip || ''}` +
        (c.profile && c.profile.name ? ` · ${c.profile.name}` : ''),
      ...(c.notes || []).map((n) => el('div', { class: 'warn small', text: n })),
    ] : [el('span', { class: 'small', text: 'not in the latest snapshot' })];
    const problems = [
      ...((sl && sl.drift) || []).map((d) => `${d.kind}: ${d.detail || ''}`),
      ...((sl && sl.rejections) || []).map((r) => `rejected ${r.reason}: ${r.message || ''}`),
    ];
    if (sl && sl.disabled_reason) problems.unshift(`disabled: ${sl.disabled_reason}`);
    if (sl && sl.health_detail && !problems.length) problems.push(sl.health_detail);
    const schedText = p ? `${schedulable === 'true' ? 'schedulable' : 'not schedulable'} · ` +
      `${lifecycle}` + ((p.node_blockers || []).length ? ` · blocked: ${p.node_blockers.join(',')}` :
      '') : proj.err ? `error: ${proj.err}` : 'not projected';
    return el('tr', { 'data-testid': 'slot-row', 'data-slot-key': key, 'data-admin-state': admin,
      'data-health': health, 'data-schedulable': schedulable, 'data-lifecycle': lifecycle },
    td(el('code', { text: key })),
    td(String((c && c.index) ?? (sl && sl.index) ?? '')),
    td(...cand),
    td(el('span', { 'data-field': 'admin', class: `badge ${admin === 'available' ? 'good' :
      admin === 'disabled' ? 'bad' : ''}`, text: admin })),
    td(el('span', { 'data-field': 'health', class: `badge ${health === 'healthy' ? 'good' :
      health === 'degraded' || health === 'failed' ? 'bad' : ''}`, text: health }),
    sl && num(sl.generation) ? el('div', { class: 'small', text: `gen ${num(sl.generation)}` }) :
      null),
    td(el('span', { 'data-field': 'schedulable', class: schedulable === 'true' ? 'good' : '',
      text: schedText })),
    td(p && p.allocation_id ? p.allocation_id : ''),
    td(...problems.map((x) => el('div', { class: 'small bad', text: x }))),
    td(sl ? `${sl.mac || ''} ${sl.private_ip || ''}` : ''),
    td(
      el('button', { type: 'button', 'data-testid': 'slot-approve', text: 'Approve',
        // Re-approving an available slot is allowed (it re-validates; a failure leaves it
        // as it was), so only a key with no candidate in the snapshot cannot be approved.
        disabled: !c,
        onclick: () => approveSlots([key]) }),
      el('button', { type: 'button', 'data-testid': 'slot-disable', text: 'Disable',
        disabled: !sl || admin === 'disabled', onclick: () => disableSlot(key) }),
      el('button', { type: 'button', 'data-testid': 'slot-repair', text: 'Repair',
        disabled: !sl, onclick: () => repairSlot(key) })));
  });
  fill($('slots-body'), rows, num(s.snapshot_version) ? 'No candidates and no slots.' :
    'No topology reported yet.', 10);
}

function actionResult(text, ok) {
  const r = $('slot-action-result');
  r.textContent = text;
  r.className = `result ${ok ? 'good' : 'bad'}`;
  r.dataset.ok = String(!!ok);
}

async function approveSlots(keys) {
  const s = (nodeView.show && nodeView.show.ok) || {};
  // Approve against the snapshot the operator is looking at, not whatever arrives meanwhile.
  const req = { node_id: openNodeId, snapshot_version: s.snapshot_version || 0 };
  if (keys) req.slot_keys = keys;
  actionResult(`approving ${keys ? keys.join(', ') : 'every candidate'}…`, true);
  try {
    const r = await call('gpuaas.v1.inventory.slot.approve', req);
    const results = r.results || [];
    const bad = results.filter((x) => !x.approved);
    actionResult(results.map((x) => `${x.slot_key}: ${x.approved ? 'approved' :
      `rejected (${(x.rejections || []).map((j) => `${j.reason}: ${j.message || ''}`).join('; ')})`}`)
      .join(' · ') + ` (snapshot v${num(r.snapshot_version)}, desired v${num(r.desired_version)})`,
    !bad.length);
  } catch (e) {
    actionResult(`approve failed: ${e.message}`, false);
  }
  loadNode();
  loadFleet();
}

async function disableSlot(key) {
  const reason = $('slot-reason').value.trim();
  try {
    const r = await call('gpuaas.v1.inventory.slot.disable',
      { node_id: openNodeId, slot_key: key, reason });
    actionResult(`${key}: disabled (desired v${num(r.desired_version)})`, true);
  } catch (e) {
    actionResult(`disable ${key} failed: ${e.message}`, false);
  }
  loadNode();
  loadFleet();
}

async function repairSlot(key) {
  try {
    const r = await call('gpuaas.v1.inventory.slot.repair', { node_id: openNodeId, slot_key: key });
    const res = r.result || {};
    actionResult(`${key}: ${res.approved ? 'repaired, available' : `still out of service (${
      (res.rejections || []).map((j) => j.reason).join(', ') || 'drift remains'})`}`,
    !!res.approved);
  } catch (e) {
    actionResult(`repair ${key} failed: ${e.message}`, false);
  }
  loadNode();
  loadFleet();
}

async function discoverNode() {
  try {
    const r = await call('gpuaas.v1.inventory.node.discover', { node_id: openNodeId });
    actionResult(`discovery queued: task ${r.task_id || ''}`, true);
  } catch (e) {
    actionResult(`discover failed: ${e.message}`, false);
  }
  loadNode();
}

// ---------- allocations ----------

let allocsLoading = false;

async function loadAllocations() {
  if (allocsLoading) return;
  allocsLoading = true;
  try {
    const state = $('allocs-state').value;
    let all = [];
    let token = '';
    // Creation order, oldest first; the newest are the interesting ones, so read every page
    // (bounded) and show them newest first.
    for (let i = 0; i < 20; i++) {
      const req = { page_size: 500 };
      if (state) req.state = state;
      if (token) req.page_token = token;
      const r = await call('gpuaas.v1.scheduler.allocation.list', req);
      all = all.concat(r.allocations || []);
      token = r.next_page_token || '';
      if (!token) break;
    }
    all.reverse();
    if (!changed('allocs', all)) return;
    fill($('allocs-body'), all.map((a) => {
      const st = enumText(a.state, 'ALLOCATION_STATE');
      return el('tr', { 'data-testid': 'alloc-row', 'data-allocation-id': a.allocation_id,
        'data-state': st },
      td(el('code', { text: a.allocation_id })), td(a.tenant || ''),
      td(enumText(a.shape, 'CAPACITY_SHAPE')), td(String(a.gpu_count || 0)), td(st),
      td(a.node_id || ''), td(fmtTime(a.created_at)),
      td(el('button', { type: 'button', 'data-testid': 'alloc-open', text: 'Details',
        onclick: () => openAllocation(a.allocation_id) })));
    }), 'No allocations.', 8);
  } catch (e) {
    flash(`Allocations: ${e.message}`);
  } finally {
    allocsLoading = false;
  }
}

let openAllocId = '';
let allocLoading = false;
let allocShape = '';

function openAllocation(id) {
  openAllocId = id;
  $('alloc-detail').hidden = false;
  $('alloc-detail').dataset.allocationId = id;
  $('alloc-detail-id').textContent = id;
  $('console-error').textContent = '';
  for (const k of [...lastRendered.keys()]) if (k.startsWith('alloc:')) lastRendered.delete(k);
  loadAllocation();
}

async function loadAllocation() {
  const id = openAllocId;
  if (!id || allocLoading) return;
  allocLoading = true;
  try {
    let a;
    try {
      a = (await call('gpuaas.v1.scheduler.allocation.get', { allocation_id: id })).allocation || {};
    } catch (e) {
      $('alloc-detail').dataset.loaded = 'error';
      $('console-open').disabled = true;
      lastRendered.delete('alloc:summary');
      kv($('alloc-summary'), [['Error', e.message, 'alloc-error']]);
      return;
    }
    const entries = [];
    let tl = {};
    let token = '';
    try {
      for (let i = 0; i < 20; i++) {
        const req = { allocation_id: id, page_size: 1000 };
        if (token) req.page_token = token;
        tl = await call('gpuaas.v1.scheduler.allocation.timeline', req);
        entries.push(...(tl.entries || []));
        token = tl.next_page_token || '';
        if (!token) break;
      }
    } catch (e) {
      tl = { err: e.message };
    }
    let expo;
    try {
      expo = { ok: await call('gpuaas.v1.ingress.exposure.list', { allocation_id: id }) };
    } catch (e) {
      expo = { err: e.message };
    }
    if (id !== openAllocId) return;
    renderAllocation(a, entries, tl, expo);
  } finally {
    allocLoading = false;
  }
}

function renderAllocation(a, entries, tl, expo) {
  const st = enumText(a.state, 'ALLOCATION_STATE');
  allocShape = enumText(a.shape, 'CAPACITY_SHAPE');
  const detail = $('alloc-detail');
  detail.dataset.loaded = 'ok';
  detail.dataset.state = st;
  detail.dataset.shape = allocShape;
  if (changed('alloc:summary', a)) {
    const f = a.failure;
    const net = a.network || {};
    kv($('alloc-summary'), [
      ['State', st, 'alloc-state'],
      ['Tenant / request', `${a.tenant || ''} / ${a.request_id || ''}`],
      ['SKU / shape', `${a.sku || ''} / ${allocShape}`, 'alloc-shape'],
      ['GPUs', String(a.gpu_count || 0)],
      ['Region / pool', `${a.region || ''} / ${a.pool || ''}`],
      ['Node / slots', `${a.node_id || ''} ${(a.slot_keys || []).join(', ')}`],
      ['Image / app', `${a.image || ''} ${a.app || ''}`],
      ['VM ready', a.vm_ready ? 'yes' : 'no'],
      ['Network', net.domain_name ? `${net.domain_name} ${net.mac || ''} ` +
        `${net.expected_ip || ''} (lease ${stripEnum(net.lease_state) || '?'} ${net.actual_ip || ''})` :
        ''],
      ['Failure', f ? `${stripEnum(f.stage)} ${f.code || ''}: ${f.detail || ''}` : ''],
      ['Generation', String(num(a.generation))],
      ['Created / updated', `${fmtTime(a.created_at)} / ${fmtTime(a.updated_at)}`],
    ]);
    fill($('alloc-claims'), (a.claims || []).map((c) => el('tr', {},
      td(c.slot_key || c.node_id || ''), td(stripEnum(c.kind)), td(stripEnum(c.phase)),
      td(fmtTime(c.claimed_at)), td(fmtTime(c.released_at)))), 'No claims.', 5);
  }
  // A console needs a VM: only slices, and only while one can exist. The server decides the
  // rest (allocation_not_live, no_console) and the page shows its answer.
  const open = $('console-open');
  const consolable = allocShape === 'gpu_slice' && !['released', 'failed'].includes(st);
  open.disabled = !consolable;
  open.title = consolable ? '' : allocShape === 'gpu_slice' ? 'no VM any more' :
    'bare-metal allocations have no console';
  $('console-controls').dataset.available = String(consolable);
  if (changed('alloc:expo', [expo, a.endpoints])) {
    if (expo.err || !((expo.ok && expo.ok.exposures) || []).length) {
      // ingress may be absent; the allocation's own endpoint projection still says something.
      fill($('alloc-exposures'), (a.endpoints || []).map((x) => el('tr', {},
        td(`${x.name || ''} ${stripEnum(x.protocol)}/${x.port || ''}`), td(stripEnum(x.state)),
        td(x.public_ip ? `${x.public_ip}:${x.public_port || ''}` : ''), td(x.connect || ''),
        td(x.reason || ''))), expo.err ? `ingress: ${expo.err}` : 'No endpoints.', 5);
    } else {
      renderExposures($('alloc-exposures'), expo, false);
    }
  }
  if (changed('alloc:timeline', [entries, tl.err])) {
    const rows = entries.map((e) => el('tr', { 'data-testid': 'timeline-row',
      'data-seq': String(num(e.seq)) },
    td(String(num(e.seq))), td(fmtTime(e.at)), td(stripEnum(e.step)),
    td(enumText(e.state, 'ALLOCATION_STATE')),
    td(e.task_id ? `${stripEnum(e.task_type)} ${e.task_id}` : ''),
    td(stripEnum(e.stage) + (e.percent ? ` ${e.percent}%` : '')), td(e.code || ''),
    td(e.detail || '')));
    fill($('alloc-timeline'), rows, tl.err ? `timeline: ${tl.err}` : 'No entries.', 8);
    $('alloc-timeline').dataset.inFlight = String(!!tl.in_flight);
  }
}

async function lookupAllocation() {
  const id = $('alloc-lookup').value.trim();
  if (id) openAllocation(id);
}

// ---------- console ----------

function consolePageUrl(created) {
  // console-gw names the page; build it from the session and grant if it did not.
  if (created.page_path && created.page_path.startsWith('/')) return created.page_path;
  const sid = (created.session || {}).session_id || '';
  return `/static/console.html?session=${encodeURIComponent(sid)}` +
    `&grant=${encodeURIComponent(created.grant || '')}`;
}

async function openConsole() {
  const reason = $('console-reason').value.trim();
  const err = $('console-error');
  err.textContent = '';
  if (!reason) {
    err.textContent = 'A reason is required to open a console.';
    return;
  }
  const newTab = $('console-new-tab').checked;
  // Opened before the await, while the click still counts as a user gesture (popup blockers).
  const tab = newTab ? window.open('about:blank', '_blank') : null;
  $('console-open').disabled = true;
  try {
    const created = await call('gpuaas.v1.console.session.create',
      { allocation_id: openAllocId, reason });
    const url = consolePageUrl(created);
    const sid = (created.session || {}).session_id || '';
    document.body.dataset.lastConsoleSession = sid;
    if (tab) {
      tab.location.href = url;
      err.textContent = `Console session ${sid} opened in a new tab.`;
    } else if (newTab) {
      err.replaceChildren('Popup blocked: ', el('a', { href: url, target: '_blank',
        id: 'console-link', text: 'open the console' }), ' (the grant works once, within 60 s)');
    } else {
      $('console-panel').hidden = false;
      $('console-panel').dataset.sessionId = sid;
      $('console-allocation-id').textContent = openAllocId;
      $('console-session-id').textContent = sid;
      $('console-frame').src = url;
      $('console-panel').scrollIntoView({ block: 'start' });
    }
  } catch (e) {
    if (tab) tab.close();
    err.textContent = `Console refused: ${e.message}`;
  } finally {
    $('console-open').disabled = false;
  }
}

function closeConsole() {
  // Unloading the frame closes its WebSocket (client_closed).
  $('console-frame').src = 'about:blank';
  $('console-panel').hidden = true;
  delete $('console-panel').dataset.sessionId;
}

// ---------- console sessions ----------

let sessionsLoading = false;

async function loadSessions() {
  if (sessionsLoading) return;
  sessionsLoading = true;
  try {
    const r = await call('gpuaas.v1.console.session.list', { page_size: 200 });
    const list = r.sessions || [];
    if (!changed('sessions', list)) return;
    fill($('sessions-body'), list.map((x) => {
      const st = enumText(x.state, 'CONSOLE_SESSION_STATE');
      const live = st === 'created' || st === 'connected';
      return el('tr', { 'data-testid': 'session-row', 'data-session-id': x.session_id,
        'data-state': st },
      td(el('code', { text: x.session_id })), td(x.allocation_id || ''), td(x.node_id || ''),
      td(el('span', { 'data-field': 'state', text: st }),
        x.end_reason ? el('div', { class: 'small', text: x.end_reason }) : null,
        x.revoked_by ? el('div', { class: 'small', text: `by ${x.revoked_by}` }) : null),
      td(x.created_by || ''), td(x.reason || ''), td(fmtTime(x.created_at)),
      td(fmtTime(x.connected_at)), td(fmtTime(x.ended_at)),
      td(`${num(x.bytes_to_client)} / ${num(x.bytes_from_client)}`),
      td(el('button', { type: 'button', 'data-testid': 'session-revoke', text: 'Revoke',
        disabled: !live, onclick: () => revokeSession(x.session_id) })));
    }), 'No console sessions.', 11);
  } catch (e) {
    flash(`Console sessions: ${e.message}`);
  } finally {
    sessionsLoading = false;
  }
}

async function revokeSession(id) {
  const reason = $('revoke-reason').value.trim() || 'revoked from the operator page';
  try {
    await call('gpuaas.v1.console.session.revoke', { session_id: id, reason });
    flash(`Session ${id} revoked.`, false);
  } catch (e) {
    flash(`Revoke ${id}: ${e.message}`);
  }
  loadSessions();
}

// ---------- wiring ----------

function refreshVisible() {
  if ($('app').hidden || !$('auto-refresh').checked || document.hidden) return;
  if (currentTab === 'nodes') {
    loadFleet();
    if (openNodeId) loadNode();
  }
  if (currentTab === 'allocs') {
    if (openAllocId) loadAllocation();
  }
  if (currentTab === 'sessions') loadSessions();
}

async function start() {
  $('login-form').addEventListener('submit', login);
  $('logout').addEventListener('click', logout);
  for (const b of document.querySelectorAll('#tabs button[data-tab]')) {
    b.addEventListener('click', () => showTab(b.dataset.tab));
  }
  $('nodes-refresh').addEventListener('click', () => loadNodes());
  $('nodes-more').addEventListener('click', () => loadNodes(true));
  $('node-refresh').addEventListener('click', () => loadNode());
  $('node-discover').addEventListener('click', discoverNode);
  $('fleet-refresh').addEventListener('click', () => loadFleet());
  for (const op of ADMIN_OPS) {
    $(`node-${op}`).addEventListener('click', () => nodeAdmin(op));
  }
  $('node-close').addEventListener('click', () => {
    openNodeId = '';
    $('node-detail').hidden = true;
  });
  $('slots-approve-all').addEventListener('click', () => approveSlots(null));
  $('allocs-refresh').addEventListener('click', loadAllocations);
  $('allocs-state').addEventListener('change', loadAllocations);
  $('alloc-lookup-go').addEventListener('click', lookupAllocation);
  $('alloc-lookup').addEventListener('keydown', (e) => {
    if (e.key === 'Enter') lookupAllocation();
  });
  $('alloc-refresh').addEventListener('click', loadAllocation);
  $('alloc-close').addEventListener('click', () => {
    openAllocId = '';
    $('alloc-detail').hidden = true;
  });
  $('console-open').addEventListener('click', openConsole);
  $('console-close').addEventListener('click', closeConsole);
  $('sessions-refresh').addEventListener('click', loadSessions);
  $('flash').addEventListener('click', () => flash(''));
  setInterval(refreshVisible, 3000);

  try {
    showApp(await request('GET', '/api/whoami'));
  } catch {
    showLogin('');
  }
  document.body.dataset.ready = 'true';
}

start();
