#!/usr/bin/env node
// Drives console-gw's operator page in a real headless Chromium (puppeteer-core, system browser):
// log in, approve a slot, open a VM console and see pixels, then the WebSocket refusals (a used
// grant, a grant on another session's path, a cross-origin connect). One line per step; exits 1
// at the first failure, 2 on missing inputs. GPUAAS_SKIP_CONSOLE=1 leaves out the steps that need a
// VM whose console works (for a fleet of simulated VMs). See README.md beside it.
import fs from 'node:fs';
import http from 'node:http';
import path from 'node:path';
import { createRequire } from 'node:module';
import { fileURLToPath } from 'node:url';

const here = path.dirname(fileURLToPath(import.meta.url));
const toolsDir = process.env.GPUAAS_TOOLS_DIR || path.resolve(here, '../../tools');

const env = (name, fallback) => {
  const v = process.env[name];
  return v === undefined || v === '' ? fallback : v;
};

const inputs = {
  url: env('GPUAAS_CONSOLE_URL'),
  token: env('GPUAAS_OPERATOR_TOKEN'),
  nodeId: env('GPUAAS_NODE_ID'),
  slotKey: env('GPUAAS_SLOT_KEY'),
  allocationId: env('GPUAAS_ALLOCATION_ID'),
  screenshot: env('GPUAAS_SCREENSHOT'),
};
const skipConsole = env('GPUAAS_SKIP_CONSOLE', '0') === '1';
const missing = Object.entries({
  GPUAAS_CONSOLE_URL: inputs.url, GPUAAS_OPERATOR_TOKEN: inputs.token,
  GPUAAS_NODE_ID: inputs.nodeId, GPUAAS_SLOT_KEY: inputs.slotKey,
  GPUAAS_ALLOCATION_ID: inputs.allocationId,
  GPUAAS_SCREENSHOT: skipConsole ? 'unused' : inputs.screenshot,
}).filter(([, v]) => !v).map(([k]) => k);
if (missing.length) {
  console.error(`operator_page: missing environment: ${missing.join(', ')}`);
  process.exit(2);
}
const baseUrl = inputs.url.replace(/\/+$/, '');

function findChromium() {
  const candidates = [env('CHROMIUM'), '/usr/bin/chromium-headless-shell', '/usr/bin/chromium']
    .filter(Boolean);
  const found = candidates.find((c) => fs.existsSync(c));
  if (!found) {
    console.error(`operator_page: no browser found (tried ${candidates.join(', ')}); set CHROMIUM`);
    process.exit(2);
  }
  return found;
}
const chromium = findChromium();

// UI waits (the page polls its API every 3 s) and the wait for the VM's first pixels.
const stepTimeout = Number(env('GPUAAS_BROWSER_STEP_TIMEOUT_MS', '60000'));
const pixelTimeout = Number(env('GPUAAS_CONSOLE_PIXEL_TIMEOUT_MS', '120000'));

let puppeteer;
try {
  puppeteer = createRequire(path.join(toolsDir, 'package.json'))('puppeteer-core');
} catch (e) {
  console.error(`operator_page: puppeteer-core not found under ${toolsDir}/node_modules ` +
    `(scripts/install-deps installs it): ${e.message}`);
  process.exit(2);
}

// ---------- steps ----------

let stepNo = 0;
let browser;
let page;
let otherOrigin;
const browserLog = [];

async function step(name, fn) {
  stepNo += 1;
  const t0 = Date.now();
  try {
    const note = await fn();
    console.log(`step ${stepNo} ok: ${name}${note ? ` (${note})` : ''} [${Date.now() - t0} ms]`);
  } catch (e) {
    console.log(`step ${stepNo} FAILED: ${name}: ${e && e.message ? e.message : e}`);
    await failureEvidence();
    await cleanup();
    process.exit(1);
  }
}

async function failureEvidence() {
  if (browserLog.length) {
    console.log('browser log (last 20):');
    for (const l of browserLog.slice(-20)) console.log(`  ${l}`);
  }
  if (page) {
    const file = (inputs.screenshot || 'operator_page.png').replace(/(\.png)?$/i, '.failure.png');
    try {
      await page.screenshot({ path: file, fullPage: true });
      console.log(`page at failure: ${file}`);
    } catch {
      // The page may be gone with the browser; the log above is what is left.
    }
  }
}

async function cleanup() {
  if (browser) await browser.close().catch(() => {});
  if (otherOrigin) otherOrigin.close();
}

// Wait for a predicate over the DOM; on timeout, say what the page showed instead.
async function waitFor(target, fn, arg, what, timeout = stepTimeout, describe) {
  try {
    await target.waitForFunction(fn, { timeout, polling: 250 }, arg);
  } catch (e) {
    let seen = '';
    if (describe) {
      seen = await target.evaluate(describe, arg).catch((err) => `(unreadable: ${err.message})`);
    }
    throw new Error(`timed out after ${timeout} ms waiting for ${what}` +
      `${seen ? `; the page shows: ${seen}` : ''}${e.name === 'TimeoutError' ? '' : ` (${e.message})`}`);
  }
}

// One WebSocket connect from page context with the browser's own WebSocket: how it ended.
function wsProbe(target, url) {
  return target.evaluate((u, timeoutMs) => new Promise((resolve) => {
    const out = { opened: false, errored: false, code: null, reason: '', timedOut: false };
    let ws;
    try {
      ws = new WebSocket(u);
    } catch (e) {
      resolve({ ...out, errored: true, reason: `constructor: ${e.message}` });
      return;
    }
    ws.binaryType = 'arraybuffer';
    const timer = setTimeout(() => {
      out.timedOut = true;
      ws.close();
      resolve(out);
    }, timeoutMs);
    ws.onopen = () => { out.opened = true; };
    ws.onerror = () => { out.errored = true; };
    ws.onclose = (e) => {
      clearTimeout(timer);
      resolve({ ...out, code: e.code, reason: e.reason });
    };
  }), url, 15000);
}

const wsBase = baseUrl.replace(/^http/, 'ws');
const wsUrl = (sessionId, grant) =>
  `${wsBase}/console/ws/${encodeURIComponent(sessionId)}?grant=${encodeURIComponent(grant)}`;

// A console session created with the logged-in page's cookie, for the refusal checks that need
// a fresh, unused grant.
async function createSession(reason) {
  const r = await page.evaluate(async (allocationId, why) => {
    const res = await fetch('/api/call/gpuaas.v1.console.session.create', {
      method: 'POST', credentials: 'same-origin', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ allocation_id: allocationId, reason: why }),
    });
    return { status: res.status, body: await res.text() };
  }, inputs.allocationId, reason);
  if (r.status !== 200) throw new Error(`session.create: HTTP ${r.status} ${r.body}`);
  const result = JSON.parse(r.body).result || {};
  const session = result.session || {};
  const id = session.session_id || session.sessionId;
  if (!id || !result.grant) throw new Error(`session.create answered without a session or grant: ${r.body}`);
  return { id, grant: result.grant };
}

function describeProbe(p) {
  return `opened=${p.opened} error=${p.errored} code=${p.code} reason=${JSON.stringify(p.reason)}` +
    (p.timedOut ? ' (no close within 15 s)' : '');
}

const rowSel = (attr, value) => `[${attr}="${value.replace(/["\\]/g, '\\$&')}"]`;

// ---------- the run ----------

console.log(`operator_page: ${baseUrl} node=${inputs.nodeId} slot=${inputs.slotKey} ` +
  `allocation=${inputs.allocationId} browser=${chromium}`);

await step('start the browser', async () => {
  browser = await puppeteer.launch({
    executablePath: chromium,
    headless: path.basename(chromium).includes('headless-shell') ? 'shell' : true,
    // Root in a container has no user namespace for the sandbox.
    args: ['--no-sandbox', '--disable-dev-shm-usage', '--disable-gpu'],
  });
  page = await browser.newPage();
  await page.setViewport({ width: 1400, height: 1000 });
  page.on('console', (m) => {
    if (m.type() === 'error' || m.type() === 'warn') browserLog.push(`console.${m.type()}: ${m.text()}`);
  });
  page.on('pageerror', (e) => browserLog.push(`pageerror: ${e.message}`));
  page.on('requestfailed', (r) => browserLog.push(`request failed: ${r.url()} ${r.failure()?.errorText}`));
  return (await browser.version());
});

await step(`log in and see node ${inputs.nodeId} listed`, async () => {
  const res = await page.goto(`${baseUrl}/`, { waitUntil: 'domcontentloaded', timeout: stepTimeout });
  if (!res || !res.ok()) throw new Error(`GET / answered ${res ? res.status() : 'nothing'}`);
  await waitFor(page, () => document.body.dataset.ready === 'true', null, 'the page to start');
  if (await page.$eval('body', (b) => b.dataset.auth) !== 'in') {
    await page.type('#login-token', inputs.token);
    await page.click('#login-submit');
    await waitFor(page, () => document.body.dataset.auth === 'in' ||
      document.getElementById('login-error').textContent !== '', null, 'the login answer');
    const error = await page.$eval('#login-error', (e) => e.textContent);
    if (await page.$eval('body', (b) => b.dataset.auth) !== 'in') throw new Error(error);
  }
  const sel = `#nodes-body tr[data-testid="node-row"]${rowSel('data-node-id', inputs.nodeId)}`;
  await waitFor(page, (s) => !!document.querySelector(s), sel, `a row for ${inputs.nodeId}`,
    stepTimeout, () => document.getElementById('nodes-body').innerText.replace(/\s+/g, ' ').slice(0, 400));
  await waitFor(page, (s) => document.querySelector(s).dataset.nodeState !== undefined &&
    !document.querySelector(s).innerText.includes('…'), sel, 'the node\'s state');
  const who = await page.$eval('#whoami', (e) => e.textContent);
  const state = await page.$eval(sel, (r) => r.dataset.nodeState);
  return `${who}; node state ${state}`;
});

await step(`approve ${inputs.slotKey} and see it approved and schedulable`, async () => {
  const nodeSel = `#nodes-body tr${rowSel('data-node-id', inputs.nodeId)}`;
  await page.click(`${nodeSel} [data-testid="node-open"]`);
  const slotSel = `#slots-body tr[data-testid="slot-row"]${rowSel('data-slot-key', inputs.slotKey)}`;
  await waitFor(page, (s) => !!document.querySelector(s), slotSel,
    `the slot row of ${inputs.slotKey}`, stepTimeout,
    () => document.getElementById('slots-body').innerText.replace(/\s+/g, ' ').slice(0, 600));
  await waitFor(page, (s) => !document.querySelector(`${s} [data-testid="slot-approve"]`).disabled,
    slotSel, 'an enabled Approve button (a candidate in the snapshot)');
  await page.evaluate(() => {
    delete document.getElementById('slot-action-result').dataset.ok;
  });
  await page.click(`${slotSel} [data-testid="slot-approve"]`);
  await waitFor(page, () => {
    const r = document.getElementById('slot-action-result');
    return r.dataset.ok !== undefined && !r.textContent.endsWith('…');
  }, null, 'the approval answer');
  const answer = await page.$eval('#slot-action-result', (e) => e.textContent);
  if (!answer.includes(`${inputs.slotKey}: approved`)) throw new Error(`approval: ${answer}`);
  await waitFor(page, (s) => {
    const r = document.querySelector(s);
    return r && r.dataset.adminState === 'available' && r.dataset.schedulable === 'true';
  }, slotSel, 'admin state available and the scheduler\'s schedulable', stepTimeout, (s) => {
    const r = document.querySelector(s);
    return r ? `admin=${r.dataset.adminState} health=${r.dataset.health} ` +
      `schedulable=${r.dataset.schedulable} lifecycle=${r.dataset.lifecycle}: ` +
      r.innerText.replace(/\s+/g, ' ').slice(0, 300) : 'no row';
  });
  const life = await page.$eval(slotSel, (r) => `${r.dataset.health}, ${r.dataset.lifecycle}`);
  return `${answer.split(' · ')[0]}; ${life}`;
});

let consoleSession = '';
let consoleGrant = '';
// Sessions made only to be refused; revoked at the end so that none waits out its 60 s.
const throwaway = [];

function skipped(name) {
  stepNo += 1;
  console.log(`step ${stepNo} skipped: ${name} (GPUAAS_SKIP_CONSOLE=1)`);
}

const consoleStep = skipConsole ? skipped : step;

await consoleStep(`open the console of ${inputs.allocationId}, see it connected with pixels`, async () => {
  await page.click('#tab-allocs');
  await page.$eval('#alloc-lookup', (e) => { e.value = ''; });
  await page.type('#alloc-lookup', inputs.allocationId);
  await page.click('#alloc-lookup-go');
  await waitFor(page, (id) => {
    const d = document.getElementById('alloc-detail');
    return !d.hidden && d.dataset.allocationId === id && !!d.dataset.loaded;
  }, inputs.allocationId, 'the allocation\'s details');
  const loaded = await page.$eval('#alloc-detail', (d) => ({ ...d.dataset,
    summary: document.getElementById('alloc-summary').innerText.replace(/\s+/g, ' ') }));
  if (loaded.loaded !== 'ok') throw new Error(`allocation.get: ${loaded.summary}`);
  if (await page.$eval('#console-open', (b) => b.disabled)) {
    throw new Error(`no console offered for a ${loaded.shape} allocation in state ${loaded.state}`);
  }
  await page.$eval('#console-new-tab', (c) => { c.checked = false; });
  await page.$eval('#console-reason', (e) => { e.value = ''; });
  await page.type('#console-reason', 'browser test');
  await page.click('#console-open');
  await waitFor(page, () => {
    const p = document.getElementById('console-panel');
    return (!p.hidden && !!p.dataset.sessionId) ||
      document.getElementById('console-error').textContent !== '';
  }, null, 'the console session');
  const error = await page.$eval('#console-error', (e) => e.textContent);
  if (error) throw new Error(error);
  const src = await page.$eval('#console-frame', (f) => f.getAttribute('src'));
  const q = new URL(src, baseUrl).searchParams;
  consoleSession = q.get('session');
  consoleGrant = q.get('grant');
  if (!consoleSession || !consoleGrant) throw new Error(`console page without session/grant: ${src}`);

  const frame = await (await page.$('#console-frame')).contentFrame();
  await waitFor(frame, () => !!document.getElementById('status') &&
    !['idle', 'connecting'].includes(document.getElementById('status').dataset.state), null,
  'the console to connect', stepTimeout, () => document.getElementById('status')?.textContent);
  const status = await frame.$eval('#status', (s) => s.textContent);
  if (status !== 'connected') throw new Error(`console status: ${status}`);

  // The VM's screen, read back from noVNC's canvas in the page: any pixel that is not black.
  // A guest whose console blanked shows black until a key arrives: after 10 s without pixels the
  // page sends one Shift press through noVNC, then waits out the rest.
  const nonBlack = () => {
    const c = document.querySelector('#screen canvas');
    if (!c || !c.width || !c.height) return false;
    const d = c.getContext('2d').getImageData(0, 0, c.width, c.height).data;
    for (let i = 0; i < d.length; i += 4) {
      if (d[i] > 16 || d[i + 1] > 16 || d[i + 2] > 16) return true;
    }
    return false;
  };
  const canvasSeen = () => {
    const c = document.querySelector('#screen canvas');
    return `status "${document.getElementById('status').textContent}", canvas ` +
      `${c ? `${c.width}x${c.height}` : 'absent'}`;
  };
  const firstWait = Math.min(10000, pixelTimeout);
  const early = await frame.waitForFunction(nonBlack, { timeout: firstWait, polling: 250 })
    .then(() => true, () => false);
  if (!early) {
    await frame.evaluate(() => window.rfb && window.rfb.sendKey(0xffe1, 'ShiftLeft'));
    await waitFor(frame, nonBlack, null, 'non-black pixels on the console canvas',
      Math.max(1000, pixelTimeout - firstWait), canvasSeen);
  }
  const size = await frame.$eval('#screen canvas', (c) => `${c.width}x${c.height}`);
  fs.mkdirSync(path.dirname(path.resolve(inputs.screenshot)), { recursive: true });
  await (await page.$('#console-frame')).screenshot({ path: inputs.screenshot });
  return `session ${consoleSession}, framebuffer ${size}, screenshot ${inputs.screenshot}`;
});

await consoleStep('a used grant is refused (1008 grant_used)', async () => {
  const p = await wsProbe(page, wsUrl(consoleSession, consoleGrant));
  if (p.code !== 1008 || !String(p.reason).includes('grant_used')) {
    throw new Error(`expected close 1008 grant_used, got ${describeProbe(p)}`);
  }
  return describeProbe(p);
});

await step('a grant on another session\'s path is refused (1008 wrong_scope)', async () => {
  const a = await createSession('browser test: wrong scope (grant of this one)');
  const b = await createSession('browser test: wrong scope (path of this one)');
  throwaway.push(a.id, b.id);
  const p = await wsProbe(page, wsUrl(b.id, a.grant));
  if (p.code !== 1008 || !String(p.reason).includes('wrong_scope')) {
    throw new Error(`expected close 1008 wrong_scope, got ${describeProbe(p)}`);
  }
  return `grant of ${a.id} on ${b.id}: ${describeProbe(p)}`;
});

await step('a connect from another origin is refused', async () => {
  const c = await createSession('browser test: cross-origin connect');
  throwaway.push(c.id);
  // A page served by this script on another port: same host, different origin.
  otherOrigin = http.createServer((req, res) => {
    res.writeHead(200, { 'Content-Type': 'text/html' });
    res.end('<!doctype html><title>other origin</title><p>not console-gw</p>');
  });
  await new Promise((resolve) => otherOrigin.listen(0, '127.0.0.1', resolve));
  const origin = `http://127.0.0.1:${otherOrigin.address().port}`;
  const other = await browser.newPage();
  try {
    await other.goto(`${origin}/`, { waitUntil: 'domcontentloaded', timeout: stepTimeout });
    const p = await wsProbe(other, wsUrl(c.id, c.grant));
    if (p.opened || p.timedOut) {
      throw new Error(`expected the upgrade refused (no open), got ${describeProbe(p)}`);
    }
    return `from ${origin}: ${describeProbe(p)}`;
  } finally {
    await other.close().catch(() => {});
  }
});

await consoleStep('the console is still connected after the refusals', async () => {
  const frame = await (await page.$('#console-frame')).contentFrame();
  const status = await frame.$eval('#status', (s) => s.textContent);
  if (status !== 'connected') throw new Error(`console status: ${status}`);
  return status;
});

// ---------- the fleet picture and host operations (drain, undrain) ----------

const tileSel = `#fleet-nodes [data-testid="fleet-node"]${rowSel('data-node-id', inputs.nodeId)}`;
const describeTile = (arg) => {
  const t = document.querySelector(Array.isArray(arg) ? arg[0] : arg);
  if (!t) {
    return `no tile; fleet: ${document.getElementById('fleet-summary').textContent} ` +
      document.getElementById('fleet-nodes').innerText.replace(/\s+/g, ' ').slice(0, 300);
  }
  const cells = [...t.querySelectorAll('[data-testid="slot-cell"]')]
    .map((c) => `${c.dataset.slotKey}=${c.dataset.cellState}`);
  return `admin=${t.dataset.adminState} mode=${t.dataset.mode} cells ${cells.join(' ')}`;
};
// What the node holds, as the fleet picture shows it before the drain.
let nodeHeld = { holdsAllocation: false };

await step(`the fleet picture shows ${inputs.nodeId} active with its slots`, async () => {
  await page.click('#tab-nodes');
  // The slot approved in step 3 has an approved cell (not a candidate's) once the picture has
  // read the scheduler's slot.list after the approval.
  await waitFor(page, ([s, key]) => {
    const t = document.querySelector(s);
    const cell = t && [...t.querySelectorAll('[data-testid="slot-cell"]')]
      .find((c) => c.dataset.slotKey === key);
    return !!cell && cell.dataset.cellState !== 'candidate' && t.dataset.adminState === 'active';
  }, [tileSel, inputs.slotKey], `a tile for ${inputs.nodeId}, active, with an approved cell for ` +
    `${inputs.slotKey}`, stepTimeout, describeTile);
  const tile = await page.$eval(tileSel, (t, alloc) => ({
    mode: t.dataset.mode,
    cells: [...t.querySelectorAll('[data-testid="slot-cell"]')]
      .map((c) => ({ key: c.dataset.slotKey, state: c.dataset.cellState,
        alloc: c.dataset.allocationId || '' })),
    badge: t.querySelector('[data-field="admin-state"]')?.textContent || '',
    holdsAllocation: !!alloc && !!t.querySelector(`[data-slot-key][data-allocation-id="${alloc}"]`),
  }), inputs.allocationId || '');
  if (tile.badge !== 'active') throw new Error(`the tile's badge reads "${tile.badge}"`);
  if (!['slice-vm', 'baremetal'].includes(tile.mode)) throw new Error(`mode "${tile.mode}"`);
  // The capacity bars count the node's slots somewhere.
  const bars = await page.$$eval('#fleet-capacity [data-testid="capacity-row"]',
    (rows) => rows.map((r) => `${r.dataset.group}: ${r.dataset.free} free/${r.dataset.total}`));
  if (!bars.length) throw new Error('no capacity bar');
  nodeHeld = { holdsAllocation: tile.holdsAllocation };
  return `${tile.mode}, ${tile.cells.map((c) => `${c.key}=${c.state}`).join(' ')}; ` +
    `capacity ${bars.slice(0, 3).join('; ')}${bars.length > 3 ? ` (+${bars.length - 3} more)` : ''}`;
});

// Type into a field after clearing it.
async function typeInto(sel, text) {
  await page.$eval(sel, (e) => { e.value = ''; });
  if (text) await page.type(sel, text);
}

// Click a host-operation button and wait for its answer; returns #node-admin-result's data.
async function hostOperation(op, reason, hours) {
  await typeInto('#node-admin-reason', reason);
  if (hours !== undefined) await typeInto('#node-drain-hours', hours);
  await waitFor(page, (b) => !document.getElementById(b).disabled, `node-${op}`,
    `an enabled ${op} button`, stepTimeout, () =>
      `admin state ${document.getElementById('node-detail').dataset.adminState}`);
  await page.click(`#node-${op}`);
  await waitFor(page, (o) => {
    const r = document.getElementById('node-admin-result');
    return r.dataset.op === o && r.dataset.ok !== undefined && !r.dataset.pending;
  }, op, `the ${op} answer`);
  const r = await page.$eval('#node-admin-result', (e) => ({ ...e.dataset,
    text: e.innerText.replace(/\s+/g, ' ') }));
  if (r.ok !== 'true') throw new Error(`${op}: ${r.text}`);
  return r;
}

await step(`drain ${inputs.nodeId} from its view: draining with its holders, or drained`, async () => {
  await page.click(tileSel);
  await waitFor(page, (id) => {
    const d = document.getElementById('node-detail');
    return !d.hidden && d.dataset.nodeId === id && d.dataset.adminState === 'active';
  }, inputs.nodeId, `the node view of ${inputs.nodeId}, active`, stepTimeout,
  () => `admin state ${document.getElementById('node-detail').dataset.adminState}`);
  const r = await hostOperation('drain', 'browser test: drain', '2');
  // Holding nothing, the node is drained at once; otherwise draining until its last
  // allocation is released (the answer says which; the picture before it must agree).
  const expect = r.adminState;
  if (!['draining', 'drained'].includes(expect)) throw new Error(`drain answered ${r.text}`);
  if (nodeHeld.holdsAllocation && expect !== 'draining') {
    throw new Error(`${inputs.allocationId} holds the node, yet the drain answered ${r.text}`);
  }
  await waitFor(page, (st) => document.getElementById('node-detail').dataset.adminState === st &&
    document.querySelector('#node-admin-state')?.dataset.adminState === st, expect,
  `the node view to show ${expect}`, stepTimeout,
  () => `admin state ${document.getElementById('node-detail').dataset.adminState}: ` +
    document.getElementById('node-admin').innerText.replace(/\s+/g, ' '));
  await waitFor(page, ([s, st]) => document.querySelector(s)?.dataset.adminState === st,
    [tileSel, expect], `the fleet tile to show ${expect}`, stepTimeout, describeTile);
  const deadline = await page.$eval('#node-drain-deadline', (e) => e.textContent);
  if (!deadline || deadline === 'none') throw new Error('no drain deadline shown');
  let holders = [];
  if (expect === 'draining') {
    const want = nodeHeld.holdsAllocation ? inputs.allocationId : '';
    await waitFor(page, (id) => {
      const b = document.getElementById('node-holders-block');
      const rows = document.querySelectorAll('#node-holders tr[data-testid="holder-row"]');
      return !b.hidden && rows.length > 0 &&
        (!id || [...rows].some((x) => x.dataset.allocationId === id));
    }, want, `the holding allocations${want ? ` (${want})` : ''}`, stepTimeout,
    () => document.getElementById('node-holders-block').innerText.replace(/\s+/g, ' '));
    holders = await page.$$eval('#node-holders tr[data-testid="holder-row"]',
      (rows) => rows.map((x) => `${x.dataset.allocationId} ${x.dataset.state}`));
  }
  return `${r.text}` + (holders.length ? `; holders listed: ${holders.join(', ')}` : '');
});

await step(`undrain ${inputs.nodeId} and see it active again`, async () => {
  const r = await hostOperation('undrain', 'browser test: undrain');
  await waitFor(page, () => document.getElementById('node-detail').dataset.adminState === 'active',
    null, 'the node view to show active', stepTimeout,
    () => `admin state ${document.getElementById('node-detail').dataset.adminState}`);
  await waitFor(page, (s) => document.querySelector(s)?.dataset.adminState === 'active', tileSel,
    'the fleet tile to show active', stepTimeout, describeTile);
  const hidden = await page.$eval('#node-holders-block', (b) => b.hidden);
  if (!hidden) throw new Error('the holders are still listed for an active node');
  return r.text;
});

// Best effort: a failure here says nothing about the page.
const revoked = await page.evaluate(async (ids) => {
  let n = 0;
  for (const id of ids) {
    const res = await fetch('/api/call/gpuaas.v1.console.session.revoke', {
      method: 'POST', credentials: 'same-origin', headers: { 'Content-Type': 'application/json' },
      body: JSON.stringify({ session_id: id, reason: 'browser test: refusal checks done' }),
    }).catch(() => null);
    if (res && res.ok) n += 1;
  }
  return n;
}, throwaway).catch(() => 0);
await cleanup();
console.log(`operator_page: all steps passed (${revoked}/${throwaway.length} throwaway sessions revoked)`);
