#!/usr/bin/env bash
# A Slurm cluster on the two hosts made by hosts.sh: slurmctld on host a,
# one slurmd on each host, Debian's Slurm packages (slurmctld, slurmd,
# slurm-client, slurm-wlm-basic-plugins), no munge (auth/none: one
# machine, root only), MPI through Slurm's PMIx plugin.
#
#   scripts/netns/slurm.sh up     [--prefix P]   # start (replaces leftovers)
#   scripts/netns/slurm.sh down   [--prefix P]   # stop and remove; safe to repeat
#   scripts/netns/slurm.sh run    [--prefix P] CMD...   # CMD on host a with SLURM_CONF set
#                                                       # (sbatch, srun, sinfo, squeue)
#
# Everything lives in /tmp/mb-slurm-P/ (slurm.conf, state, logs). Each
# daemon enters its host's network namespace with nsenter, not `ip netns
# exec`, which would remount /sys without the cgroup hierarchy slurmd
# reads; each slurmd gets its own mount namespace, where a folder of its
# own is bound over /run/mb-slurm-P-pmix, PMIx's client directory (both
# hosts share /tmp, and PMIx names that directory by job and step only).
# Exit 77 when the hosts are not up or Slurm is not installed; callers
# treat 77 as "skip".
set -euo pipefail
source "$(dirname "${BASH_SOURCE[0]}")/common.sh"

usage() { sed -n '2,19p' "$0" | sed 's/^# \{0,1\}//' >&2; exit 2; }

netns_cmd_args "$@"
cmd="$NETNS_CMD"
set -- "${NETNS_REST[@]+"${NETNS_REST[@]}"}"
dir="/tmp/mb-slurm-$PREFIX"
pmix="/run/mb-slurm-$PREFIX-pmix"
conf="$dir/slurm.conf"

stop() {
  local f pid
  # Jobs first (their steps and ranks), while the controller still answers.
  SLURM_CONF="$conf" timeout 10 ip netns exec "$NS_A" scancel --user=root >/dev/null 2>&1 || true
  for f in "$dir"/*.pid; do
    [[ -e "$f" ]] || continue
    pid="$(cat "$f" 2>/dev/null || true)"
    # Only a daemon of this cluster: a stale pid file may name another process now.
    [[ "$pid" =~ ^[0-9]+$ ]] && tr '\0' ' ' <"/proc/$pid/cmdline" 2>/dev/null | grep -qF -- "$conf" \
      && kill "$pid" 2>/dev/null || true
  done
  # Daemons started but not yet past writing their pid file.
  pkill -f -- "-f $conf" 2>/dev/null || true
  for _ in $(seq 50); do
    pgrep -f -- "-f $conf" >/dev/null 2>&1 || break
    sleep 0.1
  done
  pkill -9 -f -- "-f $conf" 2>/dev/null || true
}

case "$cmd" in
  down)
    [[ -d "$dir" ]] && stop
    rm -rf "$dir" "$pmix"
    ;;
  up)
    for b in slurmctld slurmd sbatch srun sinfo nsenter; do
      command -v "$b" >/dev/null 2>&1 || { echo "slurm.sh: $b not found (apt-get install slurmctld slurmd slurm-client slurm-wlm-basic-plugins)" >&2; exit 77; }
    done
    netns_exists "$NS_A" && netns_exists "$NS_B" \
      || { echo "slurm.sh: hosts $NS_A/$NS_B are not up: run scripts/netns/hosts.sh up --prefix $PREFIX" >&2; exit 77; }
    [[ -d "$dir" ]] && stop
    rm -rf "$dir" "$pmix"
    mkdir -p "$dir/state" "$dir/$NS_A" "$dir/$NS_B" "$dir/$NS_A-pmix" "$dir/$NS_B-pmix" "$pmix"
    cpus="$(nproc)"
    cat >"$conf" <<EOF
ClusterName=mb$PREFIX
SlurmctldHost=$NS_A($ADDR_A)
AuthType=auth/none
CredType=cred/none
SlurmUser=root
SlurmdUser=root
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/%n.pid
SlurmctldLogFile=$dir/slurmctld.log
SlurmdLogFile=$dir/%n.log
SlurmctldPort=${MB_SLURM_PORT:-6817}
SlurmdPort=$(( ${MB_SLURM_PORT:-6817} + 1 ))
ProctrackType=proctrack/pgid
TaskPlugin=task/none
MpiDefault=none
SchedulerType=sched/builtin
SelectType=select/linear
ReturnToService=2
JobCompType=jobcomp/none
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
NodeName=$NS_A NodeAddr=$ADDR_A CPUs=$cpus State=UNKNOWN
NodeName=$NS_B NodeAddr=$ADDR_B CPUs=$cpus State=UNKNOWN
PartitionName=mb Nodes=ALL Default=YES MaxTime=INFINITE State=UP
EOF
    cat >"$dir/cgroup.conf" <<EOF
CgroupPlugin=cgroup/v1
CgroupMountpoint=/sys/fs/cgroup
IgnoreSystemd=yes
EOF
    echo "PMIxCliTmpDirBase=$pmix" >"$dir/mpi.conf"
    setsid nsenter --net="/run/netns/$NS_A" unshare --uts -- /bin/sh -c 'hostname "$1" && exec slurmctld -D -f "$2"' \
      slurm.sh "$NS_A" "$conf" >"$dir/slurmctld.out" 2>&1 </dev/null &
    for h in "$NS_A" "$NS_B"; do
      setsid nsenter --net="/run/netns/$h" unshare --uts --mount --propagation private -- /bin/sh -c \
        'hostname "$1" && mount --bind "$3" "$4" && exec slurmd -D -N "$1" -f "$2"' \
        slurm.sh "$h" "$conf" "$dir/$h-pmix" "$pmix" >"$dir/$h.out" 2>&1 </dev/null &
    done
    # Up when both nodes are idle.
    for _ in $(seq 100); do
      state="$(SLURM_CONF="$conf" ip netns exec "$NS_A" sinfo -h -o '%T %D' 2>/dev/null || true)"
      [[ "$state" == "idle 2" ]] && { netns_say "slurm: slurmctld on $NS_A, slurmd on $NS_A and $NS_B ($conf)"; exit 0; }
      sleep 0.2
    done
    echo "slurm.sh: the nodes did not come up (sinfo: '${state:-}'); logs in $dir:" >&2
    tail -n 5 "$dir"/*.out "$dir"/*.log >&2 2>/dev/null || true
    stop
    exit 1
    ;;
  run)
    [[ -f "$conf" ]] || { echo "slurm.sh: no cluster for prefix $PREFIX: run scripts/netns/slurm.sh up --prefix $PREFIX" >&2; exit 77; }
    [[ $# -ge 1 ]] || usage
    export SLURM_CONF="$conf"
    exec ip netns exec "$NS_A" "$@"
    ;;
  *) usage ;;
esac
