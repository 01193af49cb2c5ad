#!/usr/bin/env bash
# Creates or removes two "hosts" on this machine: network namespaces
# ${P}a and ${P}b joined by a veth pair, each with lo up and its own
# /etc/netns/NAME/hosts (which `ip netns exec` bind-mounts over /etc/hosts)
# so both host names resolve to the veth addresses inside both namespaces.
#
#   scripts/netns/hosts.sh up     [--prefix P]   # create (replaces leftovers)
#   scripts/netns/hosts.sh down   [--prefix P]   # remove; safe to repeat
#   scripts/netns/hosts.sh status [--prefix P]   # exit 0 if both hosts are up
#
# Default prefix: mbh (hosts mbha, mbhb). Addresses: MB_NETNS_ADDR_A,
# MB_NETNS_ADDR_B, MB_NETNS_PLEN (default 10.231.0.1, 10.231.0.2, /24).
# Exit 77 when namespaces cannot be created here (not root, no
# CAP_SYS_ADMIN, no `ip`); callers treat 77 as "skip".
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { sed -n '2,14p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

netns_cmd_args "$@"
cmd="$NETNS_CMD"
[[ ${#NETNS_REST[@]} -eq 0 ]] || { echo "hosts.sh: unknown argument '${NETNS_REST[0]}'" >&2; usage; }

skip() { echo "netns: cannot create network namespaces: $*" >&2; exit 77; }

# Kills what still runs inside a namespace (orted or ranks of a run that
# died), so that deleting the name also frees the namespace itself.
kill_inside() {
  local ns="$1" pids
  pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')" || true
  [[ -n "${pids// /}" ]] || return 0
  netns_say "killing processes left in $ns: $pids"
  kill -TERM $pids 2>/dev/null || true
  for _ in 1 2 3 4 5 6 7 8 9 10; do
    pids="$(ip netns pids "$ns" 2>/dev/null | tr '\n' ' ')" || true
    [[ -n "${pids// /}" ]] || return 0
    sleep 0.2
  done
  kill -KILL $pids 2>/dev/null || true
}

down() {
  local ns ifc
  for ns in "$NS_A" "$NS_B"; do
    if netns_exists "$ns"; then
      kill_inside "$ns"
      ip netns del "$ns" && netns_say "deleted namespace $ns (and its veth end)"
    fi
  done
  # A run that died between `ip link add` and moving the ends leaves the
  # pair in the root namespace.
  for ifc in "$IF_A" "$IF_B"; do
    if ip link show "$ifc" >/dev/null 2>&1; then
      ip link del "$ifc" 2>/dev/null && netns_say "deleted leftover interface $ifc" || true
    fi
  done
  for ns in "$NS_A" "$NS_B"; do
    if [[ -d "/etc/netns/$ns" ]]; then
      rm -rf "/etc/netns/$ns" && netns_say "removed /etc/netns/$ns"
    fi
  done
  rmdir /etc/netns 2>/dev/null || true
  rm -f /tmp/mb-netns-"$PREFIX"-s*.hosts
}

up() {
  command -v ip >/dev/null 2>&1 || skip "no 'ip' command (install iproute2)"
  [[ "$(id -u)" -eq 0 ]] || skip "needs root for ip netns (run as root, or skip this test)"
  command -v unshare >/dev/null 2>&1 || skip "no 'unshare' command (install util-linux)"
  down
  if ! ip netns add "$NS_A" 2>/tmp/netns-err.$$; then
    local msg; msg="$(cat /tmp/netns-err.$$)"; rm -f /tmp/netns-err.$$
    skip "'ip netns add $NS_A' failed ($msg): needs CAP_SYS_ADMIN and a kernel with network namespaces"
  fi
  rm -f /tmp/netns-err.$$
  ip netns add "$NS_B"
  netns_say "created namespaces $NS_A, $NS_B"
  if ! ip link add "$IF_A" type veth peer name "$IF_B"; then
    down; skip "cannot create a veth pair (kernel without CONFIG_VETH?)"
  fi
  ip link set "$IF_A" netns "$NS_A"
  ip link set "$IF_B" netns "$NS_B"
  ip -n "$NS_A" addr add "$ADDR_A/$PLEN" dev "$IF_A"
  ip -n "$NS_B" addr add "$ADDR_B/$PLEN" dev "$IF_B"
  local ns
  for ns in "$NS_A" "$NS_B"; do
    ip -n "$ns" link set lo up
  done
  ip -n "$NS_A" link set "$IF_A" up
  ip -n "$NS_B" link set "$IF_B" up
  netns_say "veth $IF_A ($ADDR_A/$PLEN in $NS_A) <-> $IF_B ($ADDR_B/$PLEN in $NS_B)"
  for ns in "$NS_A" "$NS_B"; do
    mkdir -p "/etc/netns/$ns"
    cat >"/etc/netns/$ns/hosts" <<HOSTS
127.0.0.1	localhost
::1	localhost ip6-localhost ip6-loopback
$ADDR_A	$NS_A
$ADDR_B	$NS_B
HOSTS
  done
  netns_say "wrote /etc/netns/{$NS_A,$NS_B}/hosts: $NS_A=$ADDR_A $NS_B=$ADDR_B"
}

status() {
  local ok=0 ns ifc
  for ns in "$NS_A" "$NS_B"; do
    [[ "$ns" == "$NS_A" ]] && ifc="$IF_A" || ifc="$IF_B"
    if netns_exists "$ns"; then
      echo "$ns: up  $(ip -n "$ns" -o -4 addr show dev "$ifc" 2>/dev/null | awk '{print $2, $4}')  $(ip -n "$ns" -o link show dev "$ifc" 2>/dev/null | grep -o 'state [A-Z]*')"
      echo "$ns: qdisc $(ip netns exec "$ns" tc qdisc show dev "$ifc" root 2>/dev/null | head -n1)"
    else
      echo "$ns: absent"; ok=1
    fi
  done
  return $ok
}

case "$cmd" in
  up) up ;;
  down) down ;;
  status) status ;;
  *) echo "hosts.sh: unknown command '$cmd'" >&2; usage ;;
esac
