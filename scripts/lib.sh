# Shared helpers for scripts/*. Sourced, not run.
ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
log() { printf '[%s] %s\n' "$(date +%H:%M:%S)" "$*"; }
die() { printf 'error: %s\n' "$*" >&2; exit 1; }

# Configure and build one CMake preset (dev | asan | release).
build_preset() {
  local preset=$1
  cmake --preset "$preset" >/dev/null
  # 2 cores: compile with 2 jobs; the presets' link pool keeps links to one at a time.
  cmake --build --preset "$preset" -- -j"${GPUAAS_JOBS:-$(nproc)}"
}

# A free TCP port on 127.0.0.1.
free_port() {
  python3 - <<'PY' 2>/dev/null || node -e 'const s=require("net").createServer();s.listen(0,"127.0.0.1",()=>{console.log(s.address().port);s.close()})'
import socket
s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1]); s.close()
PY
}

pg_bindir() {
  if [[ -n "${GPUAAS_PG_BINDIR:-}" ]]; then echo "$GPUAAS_PG_BINDIR"; return; fi
  ls -d /usr/lib/postgresql/*/bin 2>/dev/null | sort -V | tail -1
}

# Runs a PostgreSQL command as the postgres user when we are root (postgres refuses root).
as_pg() {
  if [[ $(id -u) == 0 ]]; then runuser -u postgres -- "$@"; else "$@"; fi
}

# Contract validators must never phone home: analytics off, config kept in the repo's tools/.
asyncapi_cli() {
  local cfg="$ROOT/tools/.asyncapi-analytics"
  [[ -f $cfg ]] || echo '{"analyticsEnabled":"false","infoMessageShown":"true","userID":"gpuaas"}' >"$cfg"
  ASYNCAPI_METRICS_CONFIG_PATH="$cfg" SUPPRESS_NO_CONFIG_WARNING=1 CI=true \
    "$ROOT/tools/node_modules/.bin/asyncapi" "$@"
}
