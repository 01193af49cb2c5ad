#!/usr/bin/env bash
# Runs an MPI program with its ranks split across the two hosts made by
# hosts.sh: mpirun starts inside host a's namespace (hostname = ${P}a) and
# reaches host b through rsh-agent; all MPI traffic goes over the veth link.
#
#   scripts/netns/mpirun.sh [--prefix P] [--np N] [--per-host K]
#       [--map-by node|slot] [--timeout SECS] [--vader] [-x VAR]...
#       [--] PROGRAM ARGS...
#
#   --np N         number of ranks (default 2)
#   --per-host K   slots per host in the hostfile (default: ceil(N/2))
#   --map-by M     node (default: rank 0 on a, rank 1 on b, 2 on a, ...)
#                  or slot (fill host a first)
#   --bind-to B    mpirun's --bind-to (default none: the two "hosts" share
#                  one machine's cores, and each host's daemon would bind
#                  its first rank to core 0, the same core on both hosts)
#   --timeout S    mpirun aborts the job after S seconds (exit non-zero)
#   --vader        also use shared memory between ranks on the same host
#                  (btl self,vader,tcp); default is self,tcp only
#   -x VAR         pass one more environment variable to the ranks
#
# Passed to the ranks when set: PATH, LD_LIBRARY_PATH, HOME, RUST_LOG,
# RUST_BACKTRACE, RAYON_NUM_THREADS, OMP_NUM_THREADS, MALLOC_MMAP_THRESHOLD_,
# MALLOC_ARENA_MAX, every MACROBATCH_* and OMPI_* variable. The ranks start
# in the caller's working directory (-wdir). MB_NETNS_MPIRUN_ARGS adds raw
# mpirun arguments (split on spaces). MB_NETNS_DRY_RUN=1 prints the
# command instead. Exit code: mpirun's (77 when the hosts are not up).
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { sed -n '2,29p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

prefix="" np=2 per_host="" map_by=node bind_to=none timeout_s="" vader=0
extra_vars=()
while [[ $# -gt 0 ]]; do
  case "$1" in
    --prefix) prefix="$2"; shift 2 ;;
    --np|-np|-n) np="$2"; shift 2 ;;
    --per-host) per_host="$2"; shift 2 ;;
    --map-by) map_by="$2"; shift 2 ;;
    --timeout) timeout_s="$2"; shift 2 ;;
    --bind-to) bind_to="$2"; shift 2 ;;
    --vader) vader=1; shift ;;
    -x) extra_vars+=("$2"); shift 2 ;;
    -h|--help) usage ;;
    --) shift; break ;;
    -*) echo "mpirun.sh: unknown option '$1'" >&2; usage ;;
    *) break ;;
  esac
done
[[ $# -ge 1 ]] || { echo "mpirun.sh: no program given" >&2; usage; }
[[ "$np" =~ ^[1-9][0-9]*$ ]] || netns_die "--np '$np' is not a positive integer"
[[ -n "$per_host" ]] || per_host=$(( (np + 1) / 2 ))
[[ "$per_host" =~ ^[1-9][0-9]*$ ]] || netns_die "--per-host '$per_host' is not a positive integer"
(( np <= 2 * per_host )) || netns_die "--np $np does not fit in 2 hosts x $per_host slots: raise --per-host"
case "$map_by" in node|slot) ;; *) netns_die "--map-by '$map_by': use node or slot" ;; esac
netns_config "$prefix"

if ! netns_exists "$NS_A" || ! netns_exists "$NS_B"; then
  echo "netns: hosts $NS_A/$NS_B are not up: run scripts/netns/hosts.sh up${prefix:+ --prefix $prefix}" >&2
  exit 77
fi
command -v mpirun >/dev/null 2>&1 || netns_die "mpirun not found in PATH (install OpenMPI)"

# The hostfile lives in /tmp, which both namespaces see (same filesystem).
# Its name depends only on its content, so concurrent runs can share it;
# hosts.sh down removes it. (No cleanup trap here: this script execs
# mpirun, so that a caller's kill reaches mpirun itself.)
hostfile="/tmp/mb-netns-$PREFIX-s$per_host.hosts"
tmp="$(mktemp "$hostfile.XXXXXX")"
printf '%s slots=%s\n%s slots=%s\n' "$NS_A" "$per_host" "$NS_B" "$per_host" >"$tmp"
mv -f "$tmp" "$hostfile"

btl="self,tcp"; (( vader )) && btl="self,vader,tcp"
read -r ka_time ka_intvl ka_probes <<<"${MB_NETNS_KEEPALIVE:-2 1 3}"
args=(
  -np "$np" --hostfile "$hostfile" --map-by "$map_by"
  --bind-to "$bind_to"
  -wdir "$PWD"
  --mca plm rsh
  --mca plm_rsh_agent "$NETNS_DIR/rsh-agent"
  --mca plm_rsh_no_tree_spawn 1
  --mca pml ob1
  --mca btl "$btl"
  --mca btl_tcp_if_include "$NET_CIDR"
  --mca oob_tcp_if_include "$NET_CIDR"
  --mca osc ^ucx
  # A host whose link is cut is declared lost once its runtime connection
  # has been silent for keepalive_time + probes × intvl seconds (default
  # 2 + 3 × 1): mpirun then ends the job, and the far host's daemon, which
  # lost mpirun, ends its ranks. OpenMPI's defaults (300 + 9 × 20 s) leave a
  # job cut in two hanging for minutes. MB_NETNS_KEEPALIVE="T I P" overrides.
  --mca oob_tcp_keepalive_time "$ka_time"
  --mca oob_tcp_keepalive_intvl "$ka_intvl"
  --mca oob_tcp_keepalive_probes "$ka_probes"
)
[[ -n "$timeout_s" ]] && args+=(--timeout "$timeout_s")

vars=(PATH LD_LIBRARY_PATH HOME RUST_LOG RUST_BACKTRACE RAYON_NUM_THREADS OMP_NUM_THREADS
      MALLOC_MMAP_THRESHOLD_ MALLOC_ARENA_MAX)
while IFS= read -r v; do vars+=("$v"); done < <(compgen -e | grep -E '^(MACROBATCH_|OMPI_)' || true)
vars+=("${extra_vars[@]+"${extra_vars[@]}"}")
for v in "${vars[@]}"; do
  [[ -n "${!v+x}" ]] && args+=(-x "$v")
done
# shellcheck disable=SC2206
[[ -n "${MB_NETNS_MPIRUN_ARGS:-}" ]] && args+=(${MB_NETNS_MPIRUN_ARGS})

# mpirun refuses to run as root without these two.
if [[ "$(id -u)" -eq 0 ]]; then
  export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1
fi

cmd=(ip netns exec "$NS_A" unshare --uts -- /bin/sh -c 'hostname "$1" && shift && exec "$@"' mpirun.sh "$NS_A"
     mpirun "${args[@]}" "$@")
if [[ "${MB_NETNS_DRY_RUN:-0}" == 1 ]]; then
  printf '%q ' "${cmd[@]}"; echo; exit 0
fi
netns_say "mpirun -np $np on $NS_A,$NS_B (slots=$per_host, map-by $map_by, btl $btl, net $NET_CIDR)"
# ip netns exec, unshare and sh all exec in turn: this process becomes
# mpirun, so its exit code is mpirun's and signals sent to it reach mpirun.
exec "${cmd[@]}"
