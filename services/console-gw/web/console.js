// One VM console: connects to console-gw's WebSocket with the session's single-use grant and
// hands the socket to noVNC. The socket is opened here (not by noVNC) so that the close code and
// reason console-gw sends (1008 grant_used / wrong_scope / revoked, 1011 relay failure) can be
// shown: noVNC only reports clean or not.
import RFB from '/novnc/core/rfb.js';

const params = new URLSearchParams(window.location.search);
const sessionId = params.get('session') || '';
const grant = params.get('grant') || '';
const statusEl = document.getElementById('status');

// What the page knows about the connection, for a person (the status line) and for tests
// (window.consoleState, data-* on #status).
const state = { state: 'idle', closeCode: null, closeReason: '', opened: false, detail: '' };
window.consoleState = state;

function setStatus(name, detail = '') {
  state.state = name;
  state.detail = detail;
  statusEl.dataset.state = name;
  if (state.closeCode !== null) statusEl.dataset.closeCode = String(state.closeCode);
  statusEl.dataset.closeReason = state.closeReason;
  statusEl.textContent = detail ? `${name}: ${detail}` : name;
  statusEl.className = name === 'connected' ? 'good' : name === 'connecting' ? '' : 'bad';
  document.title = `VM console: ${name}`;
}

function wsUrl(loc, session, secret) {
  const scheme = loc.protocol === 'https:' ? 'wss:' : 'ws:';
  return `${scheme}//${loc.host}/console/ws/${encodeURIComponent(session)}` +
    `?grant=${encodeURIComponent(secret)}`;
}

function closeText(code, reason) {
  const meaning = { 1000: 'normal', 1005: 'closed without a code', 1006: 'abnormal, no close frame',
    1008: 'policy', 1011: 'relay failure' }[code] || '';
  return `code ${code}${meaning ? ` (${meaning})` : ''}${reason ? `, ${reason}` : ''}`;
}

function connect() {
  document.getElementById('session-id').textContent = sessionId;
  if (!sessionId || !grant) {
    setStatus('failed', 'the URL needs ?session=<id>&grant=<grant>');
    return;
  }
  setStatus('connecting');
  const ws = new WebSocket(wsUrl(window.location, sessionId, grant));
  ws.binaryType = 'arraybuffer';
  ws.addEventListener('open', () => {
    state.opened = true;
    // The grant is spent now; drop it from the address bar so a reload cannot look valid.
    window.history.replaceState(null, '', `?session=${encodeURIComponent(sessionId)}`);
  });
  ws.addEventListener('close', (e) => {
    state.closeCode = e.code;
    state.closeReason = e.reason || '';
    setStatus(state.state === 'failed' ? 'failed' : 'disconnected', closeText(e.code, e.reason));
  });

  const rfb = new RFB(document.getElementById('screen'), ws, { shared: true });
  rfb.scaleViewport = true;
  rfb.background = '#000';
  rfb.addEventListener('connect', () => {
    setStatus('connected');
    document.getElementById('ctrl-alt-del').disabled = false;
    document.getElementById('disconnect').disabled = false;
    rfb.focus();
  });
  rfb.addEventListener('disconnect', (e) => {
    document.getElementById('ctrl-alt-del').disabled = true;
    document.getElementById('disconnect').disabled = true;
    // The WebSocket's own close event carries the code; this covers an RFB-level failure on a
    // socket that stays open.
    if (state.closeCode === null) {
      setStatus('disconnected', e.detail && e.detail.clean ? 'clean' : 'connection lost');
    }
  });
  rfb.addEventListener('securityfailure', (e) => {
    setStatus('failed', `VNC security failure: ${(e.detail && e.detail.reason) || ''}`);
  });
  rfb.addEventListener('credentialsrequired', () => {
    // Consoles are relayed from the domain's UNIX socket, which has no VNC password.
    setStatus('failed', 'the VM asked for VNC credentials');
    rfb.disconnect();
  });
  rfb.addEventListener('desktopname', (e) => {
    document.title = `${(e.detail && e.detail.name) || 'VM'}: ${state.state}`;
  });
  document.getElementById('ctrl-alt-del').addEventListener('click', () => rfb.sendCtrlAltDel());
  document.getElementById('disconnect').addEventListener('click', () => rfb.disconnect());
  window.rfb = rfb;
}

connect();
