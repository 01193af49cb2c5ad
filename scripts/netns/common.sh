# Shared settings for the scripts in scripts/netns/ (sourced, not run).
#
# Two "hosts" are two network namespaces, ${MB_NETNS_PREFIX}a and
# ${MB_NETNS_PREFIX}b, joined by one veth pair. The namespace name is also
# the host name: it resolves through /etc/netns/NAME/hosts inside both
# namespaces and it is the UTS hostname the launched processes see.
#
# Environment (all optional):
#   MB_NETNS_PREFIX   namespace prefix (default mbh -> mbha, mbhb); at most
#                     10 characters, [a-z0-9] only, since interface names
#                     are ${PREFIX}a-v / ${PREFIX}b-v and must fit in 15
#   MB_NETNS_ADDR_A   address of host a (default 10.231.0.1)
#   MB_NETNS_ADDR_B   address of host b (default 10.231.0.2)
#   MB_NETNS_PLEN     prefix length of the link (default 24)

NETNS_DIR="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"

netns_die() { echo "netns: error: $*" >&2; exit 1; }
netns_say() { echo "netns: $*" >&2; }

# Sets PREFIX, NS_A, NS_B, IF_A, IF_B, ADDR_A, ADDR_B, PLEN, NET_CIDR.
netns_config() {
  PREFIX="${1:-${MB_NETNS_PREFIX:-mbh}}"
  [[ "$PREFIX" =~ ^[a-z][a-z0-9]{0,9}$ ]] \
    || netns_die "prefix '$PREFIX' is invalid: use 1-10 characters [a-z0-9], starting with a letter"
  NS_A="${PREFIX}a"; NS_B="${PREFIX}b"
  IF_A="${PREFIX}a-v"; IF_B="${PREFIX}b-v"
  ADDR_A="${MB_NETNS_ADDR_A:-10.231.0.1}"
  ADDR_B="${MB_NETNS_ADDR_B:-10.231.0.2}"
  PLEN="${MB_NETNS_PLEN:-24}"
  # The network address of the link, for OpenMPI's *_if_include (CIDR form
  # works in both namespaces, unlike the interface names, which differ).
  local IFS=. a b c d mask n
  read -r a b c d <<<"$ADDR_A"
  n=$(( (a << 24) | (b << 16) | (c << 8) | d ))
  mask=$(( PLEN == 0 ? 0 : (0xffffffff << (32 - PLEN)) & 0xffffffff ))
  n=$(( n & mask ))
  NET_CIDR="$(( (n >> 24) & 255 )).$(( (n >> 16) & 255 )).$(( (n >> 8) & 255 )).$(( n & 255 ))/$PLEN"
}

# Parses `COMMAND [--prefix P] [ARGS...]` (the caller defines `usage`):
# sets NETNS_CMD, NETNS_REST (the arguments after the options) and, through
# netns_config, the hosts' names and addresses.
netns_cmd_args() {
  NETNS_CMD="${1:-}"; [[ -n "$NETNS_CMD" ]] || usage; shift
  local prefix=""
  NETNS_REST=()
  while [[ $# -gt 0 ]]; do
    case "$1" in
      --prefix) [[ $# -ge 2 ]] || usage; prefix="$2"; shift 2 ;;
      --prefix=*) prefix="${1#*=}"; shift ;;
      -h|--help) usage ;;
      *) NETNS_REST=("$@"); break ;;
    esac
  done
  netns_config "$prefix"
}

netns_exists() { [[ -e "/var/run/netns/$1" ]] || [[ -e "/run/netns/$1" ]]; }

# For the benchmark sweeps (scripts/*-sweep.sh): reads [RATE] [STEPS] into
# rate (default 1gbit) and steps (default 6), bin and model from
# MACROBATCH_BIN and SWEEP_MODEL, brings up the two hosts named PREFIX
# joined by a link limited to the rate, and takes them down on exit.
netns_sweep_hosts() { # PREFIX [RATE] [STEPS]
  local prefix=$1
  rate=${2:-1gbit}
  steps=${3:-6}
  bin=${MACROBATCH_BIN:-target/release/macrobatch}
  model=${SWEEP_MODEL:-mini}
  "$NETNS_DIR/hosts.sh" up --prefix "$prefix"
  # shellcheck disable=SC2064 # the prefix is fixed now
  trap "'$NETNS_DIR/hosts.sh' down --prefix '$prefix'" EXIT
  "$NETNS_DIR/link.sh" --prefix "$prefix" slow "$rate"
}
