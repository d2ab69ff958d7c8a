#!/usr/bin/env bash
# A SLURM cluster on this machine, on loopback, for tests and for trying fastload by hand:
# one slurmctld and one slurmd per node (NodeName=n[1-N], all on 127.0.0.1, ports of their
# own), no munge (AuthType=auth/none, CredType=cred/none), everything under one directory.
# A prolog makes a node-local SLURM_TMPDIR per job and node (DIR/local/<node>/<job>), the
# task prolog exports it and the epilog removes it, as Mila and the Alliance do.
#
#   scripts/slurm-cluster.sh start DIR [NODES]   # writes DIR/slurm.conf, waits until idle
#   export SLURM_CONF=DIR/slurm.conf              # then srun, sbatch, sinfo, scancel ...
#   scripts/slurm-cluster.sh stop DIR            # cancels the jobs, stops what start started
#
# Installs nothing: needs slurmctld, slurmd, srun, sbatch, sinfo, scancel (Debian:
# apt-get install slurmctld slurmd slurm-client). Run as root (the daemons run as the
# user who starts them; slurmd as non-root can only run that user's jobs).
set -euo pipefail

die() { echo "slurm-cluster: $*" >&2; exit 1; }
cmd=${1:-}; dir=${2:-}
[ -n "$cmd" ] && [ -n "$dir" ] || die "usage: $0 start|stop DIR [NODES]"

# Every process this cluster starts carries this marker in its environment (slurmd passes
# its environment to slurmstepd): stop kills those and nothing else.
marker() { echo "FASTLOAD_SLURM_CLUSTER=$(cd "$1" && pwd)"; }

ours() { # pids whose environment holds the marker
  local m=$1 p
  for p in /proc/[0-9]*; do
    [ "${p#/proc/}" = "$$" ] && continue
    if grep -qzxF "$m" "$p/environ" 2>/dev/null; then echo "${p#/proc/}"; fi
  done
}

stop() {
  [ -f "$dir/slurm.conf" ] || die "$dir/slurm.conf: no cluster there"
  local m; m=$(marker "$dir")
  export SLURM_CONF=$dir/slurm.conf
  # Jobs first, so that their steps end under slurmd's control.
  if [ -s "$dir/slurmctld.pid" ] && kill -0 "$(cat "$dir/slurmctld.pid")" 2>/dev/null; then
    timeout 5 scancel --full --quiet --user "$(id -un)" 2>/dev/null || true
    for _ in $(seq 50); do
      [ -z "$(timeout 5 squeue -h -o %i 2>/dev/null)" ] && break
      sleep 0.1
    done
  fi
  local pids; pids=$(ours "$m")
  [ -n "$pids" ] && kill -TERM $pids 2>/dev/null || true
  for _ in $(seq 50); do
    pids=$(ours "$m"); [ -z "$pids" ] && break
    sleep 0.1
  done
  pids=$(ours "$m")
  [ -n "$pids" ] && kill -KILL $pids 2>/dev/null || true
  rm -f "$dir"/*.pid
}

free_ports() { # N consecutive free TCP ports on 127.0.0.1
  python3 - "$1" <<'PY'
import random, socket, sys
n = int(sys.argv[1])
for _ in range(200):
    base = random.randrange(20000, 60000 - n)
    socks = []
    try:
        for p in range(base, base + n):
            s = socket.socket(); s.bind(("127.0.0.1", p)); socks.append(s)
    except OSError:
        continue
    finally:
        for s in socks: s.close()
    print(base); break
else:
    sys.exit("no free ports")
PY
}

start() {
  local nodes=${3:-3}
  for b in slurmctld slurmd srun sbatch sinfo scancel squeue; do
    command -v "$b" >/dev/null || die "$b not found (Debian: apt-get install slurmctld slurmd slurm-client)"
  done
  mkdir -p "$dir"; dir=$(cd "$dir" && pwd)
  [ -e "$dir/slurm.conf" ] && die "$dir/slurm.conf exists: stop that cluster first or use another directory"
  mkdir -p "$dir/state" "$dir/spool" "$dir/log" "$dir/local"
  local user; user=$(id -un)
  local base; base=$(free_ports $((nodes + 1)))
  local cpus=${SLURM_CLUSTER_CPUS:-4}

  cat >"$dir/prolog.sh" <<PRO
#!/bin/sh
# On each node of a job, as root, before its first task: the node-local directory.
d="$dir/local/\$SLURMD_NODENAME/\$SLURM_JOB_ID"
mkdir -p "\$d" && chown "\$SLURM_JOB_UID" "\$d" && chmod 700 "\$d"
PRO
  cat >"$dir/task_prolog.sh" <<PRO
#!/bin/sh
# Before each task, as the job's user: what it prints as "export X=Y" lands in the task.
echo "export SLURM_TMPDIR=$dir/local/\$SLURMD_NODENAME/\$SLURM_JOB_ID"
PRO
  cat >"$dir/epilog.sh" <<PRO
#!/bin/sh
rm -rf "$dir/local/\$SLURMD_NODENAME/\$SLURM_JOB_ID"
PRO
  chmod 755 "$dir/prolog.sh" "$dir/task_prolog.sh" "$dir/epilog.sh"

  cat >"$dir/slurm.conf" <<CONF
# Written by scripts/slurm-cluster.sh: a test cluster on loopback.
ClusterName=fastload
SlurmctldHost=localhost(127.0.0.1)
SlurmctldPort=$base
SlurmUser=$user
SlurmdUser=$user
AuthType=auth/none
CredType=cred/none
StateSaveLocation=$dir/state
SlurmdSpoolDir=$dir/spool/%n
SlurmctldPidFile=$dir/slurmctld.pid
SlurmdPidFile=$dir/slurmd-%n.pid
SlurmctldLogFile=$dir/log/slurmctld.log
SlurmdLogFile=$dir/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
LaunchParameters=use_interactive_step
SchedulerType=sched/builtin
# Batch jobs start on the next tick (about 1 s), not after the default 3 s of delay.
SchedulerParameters=batch_sched_delay=0,sched_min_interval=0
SelectType=select/cons_tres
SelectTypeParameters=CR_CPU
SlurmdParameters=config_overrides
ReturnToService=2
AccountingStorageType=accounting_storage/none
JobAcctGatherType=jobacct_gather/none
JobCompType=jobcomp/none
MaxArraySize=1000
SlurmctldTimeout=30
SlurmdTimeout=30
InactiveLimit=0
KillWait=2
MinJobAge=300
PrologFlags=Alloc
Prolog=$dir/prolog.sh
TaskProlog=$dir/task_prolog.sh
Epilog=$dir/epilog.sh
NodeName=n[1-$nodes] NodeHostname=localhost NodeAddr=127.0.0.1 Port=$((base + 1))-$((base + nodes)) CPUs=$cpus State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=NO
CONF

  local m; m=$(marker "$dir")
  export SLURM_CONF=$dir/slurm.conf
  # Own sessions (setsid): the daemons outlive this script and a terminal's signals.
  env "$m" setsid slurmctld -D -f "$SLURM_CONF" </dev/null >>"$dir/log/slurmctld.out" 2>&1 &
  local i
  for i in $(seq "$nodes"); do
    env "$m" setsid slurmd -D -f "$SLURM_CONF" -N "n$i" </dev/null >>"$dir/log/slurmd-n$i.out" 2>&1 &
  done
  # Until every node is idle (a daemon that died says why in its log).
  local t0=$SECONDS states
  while :; do
    states=$(timeout 5 sinfo -h -N -o '%N %T' 2>/dev/null || true)
    [ "$(grep -c ' idle$' <<<"$states")" = "$nodes" ] && break
    if [ $((SECONDS - t0)) -ge "${SLURM_CLUSTER_TIMEOUT:-60}" ]; then
      echo "slurm-cluster: nodes not idle after ${SLURM_CLUSTER_TIMEOUT:-60} s: $states" >&2
      tail -n 20 "$dir"/log/* >&2 || true
      stop; exit 1
    fi
    sleep 0.2
  done
  echo "SLURM_CONF=$SLURM_CONF"
}

case $cmd in
  start) start "$@" ;;
  stop) stop ;;
  *) die "unknown command $cmd (start or stop)" ;;
esac
