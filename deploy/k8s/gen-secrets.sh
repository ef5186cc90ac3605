#!/usr/bin/env bash
# Creates the NATS identities of the platform and writes the Kubernetes Secrets that
# deploy/k8s expects (names below). Nothing it writes is committed (deploy/k8s/.gitignore).
#
#   deploy/k8s/gen-secrets.sh [--keys DIR] [--out DIR] [--contract DIR]
#   kubectl apply -f deploy/k8s/base/namespace.yaml
#   kubectl apply -k deploy/k8s/generated          # the Secrets (or --out DIR)
#   kubectl apply -k deploy/k8s                    # or deploy/k8s/overlays/production
#
# Steps (safe to re-run: existing keys are kept, the files are rewritten):
#   1. gpuaasctl auth init --keys KEYS              role nkeys <role>.seed/.pub (deployer.seed
#                                                   included) and the token signing keys
#                                                   token-signing.pem/.pub.pem (platform) and
#                                                   token-tenant.pem/.pub.pem (the tenant
#                                                   issuer: give the private key to the tenant
#                                                   gateway)
#   2. gpuaasctl auth nats-config --contract C --keys KEYS > OUT/auth.conf
#                                                   the NATS authorization: one user per
#                                                   service, client role and enrolled node
#                                                   (KEYS/nodes/<node_id>.pub), and the deployer
#   3. kubectl create secret generic ... --dry-run=client -o yaml  (no cluster needed):
#        gpuaas/nats-auth                  auth.conf              NATS StatefulSet (include)
#        gpuaas/gpuaas-<service>-nats      seed                   each control-plane service
#        gpuaas/gpuaas-deployer-nats       seed                   the streams Job (streams.yaml)
#        gpuaas/gpuaas-token-public-keys   token-signing.pub.pem, token-tenant.pub.pem  every service
#        gpuaas-node/gpuaas-token-public-keys  (same)             node-agent DaemonSet
#      plus OUT/kustomization.yaml listing them.
#
# Re-run after `gpuaasctl node enroll|revoke --keys KEYS` (or any key change), then
# `kubectl apply -k OUT`: the kubelet updates the mounted auth.conf and the NATS reloader sidecar
# makes nats-server reload it (deploy/README.md, "Enrolling a GPU host").
#
# KEYS holds every private key of the platform (role seeds, token-signing.pem): keep it off the
# cluster and out of images (the default, OUT/keys, is git- and docker-ignored), e.g. on the
# operator's machine or in a vault. Only the seeds of the six services, the deployer's (for the
# streams Job, `gpuaasctl streams apply`: it may create, update and look up the platform streams,
# nothing else) and the public parts go into the cluster. The operator, tenant-api, auditor and
# billing seeds stay in KEYS for whoever runs those clients; token-signing.pem is only for
# `gpuaasctl auth login`.
#
# Options:
#   --keys DIR      key directory (default: OUT/keys)
#   --out DIR       output directory (default: deploy/k8s/generated)
#   --contract DIR  directory with gpuaas.asyncapi.yaml and roles.yaml (default: <repo>/asyncapi)
# Environment: GPUAASCTL (the gpuaasctl binary; default: gpuaasctl on PATH, else the one in
# build/release or build/dev), KUBECTL (default: kubectl).
set -euo pipefail

here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
repo=$(cd "$here/../.." && pwd)

SERVICES=(inventory scheduler ipam ingress console-gw usage)
out="$here/generated"
keys=""
contract="$repo/asyncapi"

usage() { awk 'NR > 1 && !/^#/ { exit } NR > 1 { sub(/^# ?/, ""); print }' "${BASH_SOURCE[0]}"; }
while [ $# -gt 0 ]; do
  case "$1" in
    --keys) keys=${2:?--keys needs a directory}; shift 2 ;;
    --keys=*) keys=${1#*=}; shift ;;
    --out) out=${2:?--out needs a directory}; shift 2 ;;
    --out=*) out=${1#*=}; shift ;;
    --contract) contract=${2:?--contract needs a directory}; shift 2 ;;
    --contract=*) contract=${1#*=}; shift ;;
    -h|--help) usage; exit 0 ;;
    *) echo "gen-secrets.sh: unknown argument: $1 (see --help)" >&2; exit 2 ;;
  esac
done
keys=${keys:-$out/keys}

ctl=${GPUAASCTL:-}
if [ -z "$ctl" ]; then
  if command -v gpuaasctl >/dev/null 2>&1; then ctl=gpuaasctl
  else
    for c in "$repo"/build/{release,dev}/tools/gpuaasctl/gpuaasctl; do
      if [ -x "$c" ]; then ctl=$c; break; fi
    done
  fi
fi
die() { echo "gen-secrets.sh: $*" >&2; exit 1; }
[ -n "$ctl" ] || die "gpuaasctl not found (build it, or set GPUAASCTL)"
kubectl=${KUBECTL:-kubectl}
command -v "$kubectl" >/dev/null 2>&1 || die "$kubectl not found (set KUBECTL)"
for f in gpuaas.asyncapi.yaml roles.yaml; do
  [ -f "$contract/$f" ] || die "$contract/$f missing (--contract DIR)"
done

umask 077
mkdir -p "$out" "$keys"

# 1. Keys (idempotent: existing keys are kept).
"$ctl" auth init --keys "$keys"
for f in "${SERVICES[@]/%/.seed}" deployer.seed token-signing.pub.pem token-tenant.pub.pem; do
  [ -s "$keys/$f" ] || die "$keys/$f missing after auth init"
done

# 2. NATS authorization (written to a temporary file first: a failed run keeps the old one).
"$ctl" auth nats-config --contract "$contract" --keys "$keys" > "$out/auth.conf.tmp"
grep -q 'authorization' "$out/auth.conf.tmp" || die "auth nats-config printed no authorization block"
mv "$out/auth.conf.tmp" "$out/auth.conf"

# 3. Secret manifests.
secret() {  # secret NAMESPACE NAME FILE --from-file=...
  local ns=$1 name=$2 file=$3; shift 3
  "$kubectl" create secret generic "$name" --namespace "$ns" "$@" \
    --dry-run=client -o yaml > "$out/$file"
}
files=()
secret gpuaas nats-auth nats-auth.yaml --from-file=auth.conf="$out/auth.conf"
files+=(nats-auth.yaml)
for s in "${SERVICES[@]}"; do
  secret gpuaas "gpuaas-$s-nats" "gpuaas-$s-nats.yaml" --from-file=seed="$keys/$s.seed"
  files+=("gpuaas-$s-nats.yaml")
done
# The streams Job (base/streams.yaml) declares the JetStream streams as the deployer.
secret gpuaas gpuaas-deployer-nats gpuaas-deployer-nats.yaml --from-file=seed="$keys/deployer.seed"
files+=(gpuaas-deployer-nats.yaml)
for ns in gpuaas gpuaas-node; do
  secret "$ns" gpuaas-token-public-keys "token-public-keys.$ns.yaml" \
    --from-file=token-signing.pub.pem="$keys/token-signing.pub.pem" \
    --from-file=token-tenant.pub.pem="$keys/token-tenant.pub.pem"
  files+=("token-public-keys.$ns.yaml")
done

{
  echo "# Generated by deploy/k8s/gen-secrets.sh on $(date -u +%Y-%m-%dT%H:%M:%SZ). Do not commit."
  echo "# kubectl apply -k $out"
  echo "apiVersion: kustomize.config.k8s.io/v1beta1"
  echo "kind: Kustomization"
  echo "labels:"
  echo "  - pairs:"
  echo "      app.kubernetes.io/part-of: gpuaas"
  echo "    includeSelectors: false"
  echo "resources:"
  for f in "${files[@]}"; do echo "  - $f"; done
} > "$out/kustomization.yaml"

nodes=$( (find "$keys/nodes" -name '*.pub' 2>/dev/null || true) | wc -l)
cat >&2 <<EOF
gen-secrets.sh: wrote ${#files[@]} Secret manifests and auth.conf to $out
  keys: $keys (private: keep it safe, never in the cluster or an image); enrolled nodes: $nodes
next: kubectl apply -f $here/base/namespace.yaml && kubectl apply -k $out
EOF
