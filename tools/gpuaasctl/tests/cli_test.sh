#!/usr/bin/env bash
# gpuaasctl without servers (ctest label unit): cli_test.sh <path to gpuaasctl> <case>
#   version     --version prints "gpuaasctl <version>" and exits 0
#   usage       usage errors exit 2; --help exits 0 and names the exit codes
#   completion  `completion bash` is valid bash and completes commands, flags and enum values
#   json        every command's parser takes -o json (before or after the command): against an
#               unreachable NATS each gets as far as connecting and exits 3 with the Status as JSON
set -uo pipefail
CTL=$1
CASE=$2
# Nothing listens on port 1: connecting fails at once.
NOWHERE=(--nats nats://127.0.0.1:1 --timeout-ms 2000)
failures=0
ERRFILE=$(mktemp)
trap 'rm -f "$ERRFILE"' EXIT

fail() {
  echo "FAIL: $*" >&2
  failures=$((failures + 1))
}

# expect_rc <rc> <args...>: runs gpuaasctl; OUT and ERR hold its stdout and stderr.
expect_rc() {
  local want=$1 got
  shift
  OUT=$("$CTL" "$@" 2>"$ERRFILE")
  got=$?
  ERR=$(<"$ERRFILE")
  if [[ $got != "$want" ]]; then
    fail "gpuaasctl $* exited $got, want $want; stdout: $OUT; stderr: $ERR"
    return 1
  fi
}

# Every leaf command with the arguments it requires.
declare -A ARGS=(
  ['node register']='--id n1 --region r --profile baremetal'
  ['node list']=''
  ['node discover']='--id n1'
  ['node show']='--id n1'
  ['node drain']='--id n1 --reason r'
  ['node undrain']='--id n1 --reason r'
  ['node maintenance']='--id n1 --reason r'
  ['node decommission']='--id n1 --reason r'
  ['node holders']='--id n1'
  ['node mode']='--id n1 --mode baremetal --reason r'
  ['scheduler nodes']=''
  ['scheduler rebuild-projection']=''
  ['scheduler slots']='--node n1'
  ['slot approve']='--node n1'
  ['slot disable']='--node n1 --slot s1'
  ['slot repair']='--node n1 --slot s1'
  ['disk wipe-proof']='--node n1 --nvme /dev/disk/by-id/x --method wipefs --evidence e'
  ['availability']=''
  ['region list']=''
  ['region set']='--name r --enabled true'
  ['alloc create']='--tenant t --request-id q --gpus 1 --region r --network-mode private-nat --expose ssh:22 --expose dns:53/udp --expose web:8080/tcp --app jupyter'
  ['alloc get']='--id a'
  ['alloc list']='--state failed'
  ['alloc release']='--id a'
  ['alloc timeline']='--id a'
  ['ipam reservations']='--node n1'
  ['ipam leases']='--node n1'
  ['ipam drift']='--node n1 --all'
  ['ipam network']='--node n1'
  ['ipam subnet']='--region r --subnet 10.100.0.0/24 --datapath ovs --bridge ovsbr0'
  ['ipam release']='--node n1 --slot s1'
  ['ipam reprovision']='--node n1 --slot s1'
  ['ipam orphans']='--remove --node n1'
  ['catalog']=''
  ['status']=''
  ['catalog list']=''
  ['app list']=''
  ['app check']='jupyter --sku h200-sxm-slice --gpus 1'
  ['ingress pool set']='--name p1 --kind port_range --region r --node n1 --address 203.0.113.10 --ports 20000-20999'
  ['ingress pool list']='--region r'
  ['usage list']='--from 2026-11-01 --to 2026-12-01'
  ['usage export']='--from 2026-11-01 --to 2026-12-01 --format jsonl'
  ['usage summary']='--tenant acme --from 2026-11-01 --to 2026-12-01'
  ['ingress pool delete']='--name p1'
  ['ingress expose']='--alloc a --name ssh --port 22 --protocol udp'
  ['ingress unexpose']='--id e'
  ['ingress exposures']='--alloc a --node n1 --state active'
  ['ingress node']='--node n1 --version 2'
  ['console open']='--alloc a --reason debugging'
  ['console list']='--alloc a --state connected'
  ['console revoke']='--id s --reason done'
  ['console logins']='--all --limit 5'
  ['console end-login']='--id s'
  ['audit allocation']='--id a'
  ['audit slot']='--id n1/s1'
  ['audit node']='--id n1 --since 1h'
  ['dlq list']='--consumer c --limit 5'
  ['dlq show']='--seq 1'
  ['dlq replay']='--seq 1'
  ['dlq discard']='--seq 1 --yes'
  ['auth revoke']='--jti 01900000-0000-7000-8000-000000000000 --reason leaked'
  ['auth revocations']=''
  ['streams apply']='--replicas 1'
)
# Commands that work on a keys directory and need no NATS (the `auth` case runs them).
declare -A OFFLINE=(
  ['auth init']=1 ['auth nats-config']=1 ['auth login']=1 ['node enroll']=1 ['node revoke']=1
)

case $CASE in
  version)
    expect_rc 0 --version
    [[ $OUT =~ ^gpuaasctl\ [0-9]+\.[0-9]+\.[0-9]+(\+[^[:space:]]+)?$ ]] ||
      fail "--version printed '$OUT'"
    ;;

  usage)
    expect_rc 2                                    # a command is required
    expect_rc 2 alloc                              # and a subcommand
    expect_rc 2 alloc list --bogus                 # unknown flag
    expect_rc 2 alloc get                          # missing required --id
    if expect_rc 2 alloc list --state nope; then
      [[ $ERR == *releasing* ]] || fail "--state nope does not name the valid states: $ERR"
    fi
    expect_rc 2 alloc create --tenant t --request-id q --gpus 1 --region r --network-mode nat
    expect_rc 2 -o yaml node list                  # bad output format
    expect_rc 2 region set --name r --enabled maybe
    expect_rc 2 alloc create --tenant t --request-id q --gpus x --region r  # not a number
    expect_rc 2 app check jupyter                  # an allocation or an order is required
    expect_rc 2 app check jupyter --allocation a --sku h200-sxm-slice  # not both
    expect_rc 2 app check --allocation a           # the app is required
    expect_rc 2 app check jupyter --shape slice --gpus 1  # not a shape
    # --expose NAME:PORT[/tcp|udp]: each malformed form is a usage error saying what it wants.
    for bad in ssh ssh: ssh:x SSH:22 ssh:22/sctp ssh:0 :22 ssh:70000 ssh:22/ 'ssh:22 /tcp'; do
      if expect_rc 2 alloc create --tenant t --request-id q --gpus 1 --region r --expose "$bad"; then
        [[ $ERR == *"--expose"*"want NAME:PORT[/tcp|udp]"* ]] || fail "--expose '$bad': $ERR"
      fi
    done
    expect_rc 2 alloc create --tenant t --request-id q --gpus 1 --region r --expose ssh:22 --app
    expect_rc 2 ingress                            # a subcommand is required
    expect_rc 2 ingress pool                       # and one of pool's
    if expect_rc 2 ingress pool set --name p --kind port_range --region r --address 198.51.100.1 \
      --ports 20999-20000; then
      [[ $ERR == *"want MIN-MAX"* ]] || fail "--ports 20999-20000: $ERR"
    fi
    expect_rc 2 ingress pool set --name p --kind port_range --region r --address 198.51.100.1 \
      --ports 20000-x
    expect_rc 2 ingress pool set --name p --kind nat --region r --address 198.51.100.1
    expect_rc 2 ingress pool set --name p --kind public_ip --region r  # an address is required
    expect_rc 2 ingress expose --alloc a --name ssh --port 0
    expect_rc 2 ingress expose --alloc a --name ssh --port 22 --protocol sctp
    expect_rc 2 ingress expose --alloc a --port 22  # the name is required
    expect_rc 2 ingress exposures --state gone
    if expect_rc 2 ipam subnet --node n1 --subnet 10.100.0.0/24 --datapath linux_bridge; then
      [[ $ERR == *linux-bridge* ]] || fail "--datapath linux_bridge does not name the valid ones: $ERR"
    fi
    if expect_rc 0 --help; then
      [[ $OUT == *"Exit codes:"* ]] || fail "--help names no exit codes"
    fi
    if expect_rc 0 alloc create --help; then
      [[ $OUT == *private-nat* ]] || fail "alloc create --help does not list the network modes"
    fi
    ;;

  completion)
    expect_rc 0 completion bash
    script=$OUT
    bash -n <<<"$script" || fail "completion bash: syntax error"
    # shellcheck disable=SC1090
    source <(printf '%s\n' "$script")
    complete_line() {
      COMP_WORDS=("$@")
      COMP_CWORD=$((${#COMP_WORDS[@]} - 1))
      COMPREPLY=()
      _gpuaasctl
      echo "${COMPREPLY[*]}"
    }
    check() {
      local want=$1 got
      shift
      got=$(complete_line gpuaasctl "$@")
      [[ " $got " == *" $want "* ]] || fail "completing '$*': want '$want' in '$got'"
    }
    check catalog ''
    check alloc al
    check timeline alloc ''
    check --network-mode alloc create --net
    check private-nat alloc create --network-mode ''
    check fabric-only alloc create --region r --network-mode f
    check released alloc list --state ''
    check json --nats nats://x:4222 alloc list -o ''
    check json alloc list --output = j
    check --output ipam drift --node n1 --out        # a parent's flag after the command
    check bash completion ''
    check slice-vm node register --profile ''
    check ingress ''
    check --expose alloc create --exp
    check public_ip ingress pool set --kind ''
    check udp ingress expose --protocol ''
    check applying ingress exposures --state ''
    check linux-bridge ipam subnet --datapath ''
    check ovs ipam subnet --datapath o
    # The script knows every command the parser does (walked from the same tree).
    for path in "${!ARGS[@]}"; do
      parent=${path% *}
      [[ $parent == "$path" ]] && parent=''
      _gpuaasctl_subcommands "$parent"
      [[ " $REPLY " == *" ${path##* } "* ]] || fail "completion misses '$path'"
    done
    ;;

  json)
    # Every leaf command of the tree (walked in the completion script) has a row in ARGS.
    expect_rc 0 completion bash
    # shellcheck disable=SC1090
    source <(printf '%s\n' "$OUT")
    walk() {
      local p=$1 s
      _gpuaasctl_subcommands "$p"
      local subs=$REPLY
      for s in $subs; do
        local child=${p:+$p }$s
        [[ $child == completion* ]] && continue
        _gpuaasctl_subcommands "$child"
        if [[ -z $REPLY ]]; then
          [[ -v "ARGS[$child]" || -v "OFFLINE[$child]" ]] ||
            fail "no test arguments for '$child' (add it to ARGS, or OFFLINE and the auth case)"
        else
          walk "$child"
        fi
      done
    }
    walk ''
    for path in "${!ARGS[@]}"; do
      read -r -a cmd <<<"$path"
      read -r -a args <<<"${ARGS[$path]}"
      for where in before after; do
        if [[ $where == before ]]; then
          expect_rc 3 "${NOWHERE[@]}" -o json "${cmd[@]}" "${args[@]}" || continue
        else
          expect_rc 3 "${NOWHERE[@]}" "${cmd[@]}" "${args[@]}" --output json || continue
        fi
        [[ $OUT == *'"code": "UNAVAILABLE"'* && $OUT == *'"reason": "nats_unavailable"'* ]] ||
          fail "$path -o json ($where): not the Status as JSON: $OUT"
      done
    done
    expect_rc 0 completion bash -o json
    # Text: the error on stderr, nothing on stdout.
    if expect_rc 3 "${NOWHERE[@]}" node list; then
      [[ -z $OUT && $ERR == "error: UNAVAILABLE"* ]] ||
        fail "text error output: stdout '$OUT' stderr '$ERR'"
    fi
    # --watch streams JSON Lines: the Status is one line.
    if expect_rc 3 "${NOWHERE[@]}" alloc timeline --id a --watch -o json; then
      [[ $(wc -l <<<"$OUT") == 1 && $OUT == '{"code":"UNAVAILABLE"'* ]] ||
        fail "--watch -o json is not one JSON object per line: $OUT"
    fi
    ;;

  auth)
    # The identities of a deployment, offline: keys, the server's users, enrollment, tokens.
    keys=$(mktemp -d)
    trap 'rm -rf "$keys"' EXIT
    expect_rc 0 auth init --keys "$keys/k"
    for role in inventory scheduler ipam ingress console-gw operator tenant-api auditor deployer; do
      [[ $(stat -c %a "$keys/k/$role.seed") == 600 ]] || fail "$role.seed is not 0600"
      [[ $(cat "$keys/k/$role.pub") == U* ]] || fail "$role.pub is not a user nkey"
    done
    [[ -f $keys/k/token-signing.pem && -f $keys/k/token-signing.pub.pem ]] || fail "no token key"
    before=$(cat "$keys/k/operator.seed")
    expect_rc 0 auth init --keys "$keys/k"
    [[ $(cat "$keys/k/operator.seed") == "$before" ]] || fail "auth init replaced a key"
    expect_rc 0 node enroll n1 --keys "$keys/k"
    [[ $OUT == SU* && -f $keys/k/nodes/n1.pub ]] || fail "enroll printed '$OUT'"
    expect_rc 1 node enroll n1 --keys "$keys/k"
    [[ $ERR == *ALREADY_EXISTS* ]] || fail "a second enroll: $ERR"
    expect_rc 0 auth nats-config --keys "$keys/k" --out "$keys/auth.conf"
    [[ $(grep -c 'nkey:' "$keys/auth.conf") == 12 ]] || fail "not 11 roles + 1 node in auth.conf"
    grep -q '"\$JS.API.CONSUMER.MSG.NEXT.GPUAAS_NODE_TASKS.node-n1"' "$keys/auth.conf" ||
      fail "node n1 cannot fetch its own tasks"
    printf 'listen: 127.0.0.1:-1\njetstream { store_dir: "%s/js" }\ninclude ./auth.conf\n' \
      "$keys" >"$keys/nats.conf"
    if command -v nats-server >/dev/null; then
      nats-server -c "$keys/nats.conf" -t >/dev/null 2>&1 || fail "nats-server refuses the config"
    fi
    expect_rc 0 node revoke n1 --keys "$keys/k" --nats-config "$keys/auth.conf"
    [[ $(grep -c 'nkey:' "$keys/auth.conf") == 11 ]] || fail "revoked node still in auth.conf"
    expect_rc 1 node revoke n1 --keys "$keys/k"
    expect_rc 1 node enroll Bad_Id --keys "$keys/k"
    [[ $ERR == *node_id_invalid* ]] || fail "a bad node id: $ERR"
    expect_rc 0 auth login --keys "$keys/k" --user alice --role tenant --tenant acme --ttl 5m
    [[ $(tr -cd . <<<"$OUT" | wc -c) == 2 ]] || fail "auth login printed no JWT: $OUT"
    expect_rc 0 auth login --keys "$keys/k" --user gw --role tenant --tenant acme --issuer tenant
    [[ -f $keys/k/token-tenant.pem && -f $keys/k/token-tenant.pub.pem ]] ||
      fail "auth init made no tenant issuer key"
    expect_rc 2 auth login --keys "$keys/k" --user alice --role operator --issuer tenant
    [[ $ERR == *issuer_role* ]] || fail "--issuer tenant --role operator: $ERR"
    expect_rc 2 auth login --keys "$keys/k" --user alice --role root
    expect_rc 2 auth login --keys "$keys/k" --user alice --role tenant --ttl 48h
    ;;

  *)
    echo "unknown case $CASE" >&2
    exit 2
    ;;
esac

if ((failures > 0)); then
  echo "$failures failure(s)" >&2
  exit 1
fi
echo "ok: $CASE"
