#!/usr/bin/env bash
# Degrades or cuts the veth link between the two hosts made by hosts.sh.
#
#   scripts/netns/link.sh [--prefix P] slow RATE [DELAY]  # e.g. slow 100mbit 5ms
#   scripts/netns/link.sh [--prefix P] cut                # both ends down
#   scripts/netns/link.sh [--prefix P] restore            # both ends up again
#   scripts/netns/link.sh [--prefix P] clear              # no shaping, link up
#   scripts/netns/link.sh [--prefix P] show
#
# `slow` shapes the egress of both ends, so each direction gets RATE and
# DELAY. It uses tc netem (rate + delay) when the kernel has it
# (CONFIG_NET_SCH_NETEM); otherwise it falls back to tbf, which limits the
# rate but cannot add delay: then a DELAY other than 0 is ignored with a
# warning on stderr, and MB_NETNS_REQUIRE_DELAY=1 makes that exit 77.
# RATE uses tc units (1gbit, 100mbit, 10mbit); DELAY tc time (5ms, 500us).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { sed -n '2,15p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

prefix=""
if [[ "${1:-}" == --prefix ]]; then prefix="${2:-}"; shift 2 || usage; fi
cmd="${1:-}"; [[ -n "$cmd" ]] || usage; shift
netns_config "$prefix"
for ns in "$NS_A" "$NS_B"; do
  netns_exists "$ns" || { echo "netns: host $ns is not up: run scripts/netns/hosts.sh up${prefix:+ --prefix $prefix}" >&2; exit 77; }
done
command -v tc >/dev/null 2>&1 || { echo "netns: no 'tc' command (install iproute2)" >&2; exit 77; }

ends=("$NS_A:$IF_A" "$NS_B:$IF_B")

clear_qdisc() {
  local e ns ifc
  for e in "${ends[@]}"; do
    ns="${e%%:*}"; ifc="${e#*:}"
    ip netns exec "$ns" tc qdisc del dev "$ifc" root 2>/dev/null || true
  done
}

# tbf's bucket must hold at least one (GSO) packet of the veth, 64 KiB;
# larger at high rates so the rate is reached with a 250 Hz timer.
tbf_burst() {
  local rate="$1" bits
  case "$rate" in
    *gbit) bits=$(( ${rate%gbit} * 1000000000 )) ;;
    *mbit) bits=$(( ${rate%mbit} * 1000000 )) ;;
    *kbit) bits=$(( ${rate%kbit} * 1000 )) ;;
    *bit)  bits=$(( ${rate%bit} )) ;;
    *) netns_die "rate '$rate' not understood: use NNNgbit, NNNmbit, NNNkbit or NNNbit" ;;
  esac
  local b=$(( bits / 8 / 250 ))
  (( b < 65536 )) && b=65536
  echo "$b"
}

slow() {
  local rate="${1:-}" delay="${2:-0ms}" e ns ifc err
  [[ -n "$rate" ]] || netns_die "slow needs a RATE, e.g. 'link.sh slow 100mbit 5ms'"
  clear_qdisc
  e="${ends[0]}"; ns="${e%%:*}"; ifc="${e#*:}"
  if err="$(ip netns exec "$ns" tc qdisc add dev "$ifc" root netem rate "$rate" delay "$delay" 2>&1)"; then
    ip netns exec "$NS_B" tc qdisc add dev "$IF_B" root netem rate "$rate" delay "$delay"
    netns_say "netem rate $rate delay $delay on $IF_A and $IF_B"
    return
  fi
  if [[ "$err" != *"unknown"* ]]; then
    netns_die "tc netem rejected 'rate $rate delay $delay': $err"
  fi
  if [[ ! "$delay" =~ ^0+(\.0+)?(s|ms|us)?$ ]]; then
    if [[ "${MB_NETNS_REQUIRE_DELAY:-0}" == 1 ]]; then
      echo "netns: this kernel has no netem qdisc, so delay $delay cannot be added (MB_NETNS_REQUIRE_DELAY=1)" >&2
      exit 77
    fi
    echo "netns: warning: this kernel has no netem qdisc (CONFIG_NET_SCH_NETEM): delay $delay ignored, only the rate is limited (tbf)" >&2
  fi
  local burst; burst="$(tbf_burst "$rate")"
  for e in "${ends[@]}"; do
    ns="${e%%:*}"; ifc="${e#*:}"
    ip netns exec "$ns" tc qdisc add dev "$ifc" root tbf rate "$rate" burst "$burst" latency 200ms \
      || netns_die "tc tbf rate $rate failed on $ifc"
  done
  netns_say "tbf rate $rate (burst $burst bytes) on $IF_A and $IF_B"
}

set_link() {
  local state="$1" e ns ifc
  for e in "${ends[@]}"; do
    ns="${e%%:*}"; ifc="${e#*:}"
    ip -n "$ns" link set "$ifc" "$state"
  done
  netns_say "link $IF_A <-> $IF_B $state"
}

show() {
  local e ns ifc
  for e in "${ends[@]}"; do
    ns="${e%%:*}"; ifc="${e#*:}"
    echo "$ns $ifc: $(ip -n "$ns" -o link show "$ifc" | grep -o 'state [A-Z]*')  $(ip netns exec "$ns" tc qdisc show dev "$ifc" root | head -n1)"
  done
}

case "$cmd" in
  slow) slow "$@" ;;
  cut) set_link down ;;
  restore) set_link up ;;
  clear) clear_qdisc; set_link up; netns_say "shaping removed" ;;
  show) show ;;
  *) echo "link.sh: unknown command '$cmd'" >&2; usage ;;
esac
