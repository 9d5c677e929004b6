#!/usr/bin/env bash
# A real single-node SLURM on this host, for trying sweeps on a laptop and for the tests.
#
#   scripts/local-slurm.sh start    # install (apt) if missing, configure, start: idempotent
#   scripts/local-slurm.sh status   # is it up? (exit 0 yes, 1 no)
#   scripts/local-slurm.sh stop     # stop slurmd, slurmctld and munged (state is kept)
#   scripts/local-slurm.sh env      # the lines to eval in a shell: export SLURM_CONF=...; PATH=...
#
# Debian's slurm-wlm and munge, as root: slurmctld and slurmd on 127.0.0.1 with
# proctrack/linuxproc and task/none (no cgroups, so it runs in containers), select/cons_tres, one
# partition `debug` holding this host; state, spool, logs and munged's socket live under
# $CHARLLM_SLURM_DIR (default /tmp/charllm-slurm), never in /etc, so a real SLURM configuration
# on the machine is not touched: clients find this one through SLURM_CONF (`env` prints it).
# MinJobAge keeps finished jobs visible to `scontrol show job` / `squeue -t all` for a day; without
# slurmdbd there is no accounting, so `env` also puts a `sacct` stand-in (scripts/sacct-standin)
# on PATH that answers from them: submitit asks sacct for the state of finished jobs.
# Job ids restart from 1 when the state directory is wiped (`stop` then `rm -rf` it).
set -euo pipefail

DIR="${CHARLLM_SLURM_DIR:-/tmp/charllm-slurm}"
HERE="$(cd "$(dirname "$0")" && pwd)"
HOST="$(hostname -s)"
CONF="$DIR/slurm.conf"
SOCKET="$DIR/munge/munge.socket.2"

log() { echo "local-slurm: $*" >&2; }

need_root() {
  if [ "$(id -u)" != 0 ]; then
    log "slurmctld and slurmd run as root here: run this script as root (or with sudo)"
    exit 2
  fi
}

install_if_missing() {
  if command -v slurmctld >/dev/null && command -v slurmd >/dev/null && command -v munged >/dev/null; then
    return
  fi
  log "installing slurm-wlm and munge with apt-get"
  export DEBIAN_FRONTEND=noninteractive
  apt-get install -y -q slurm-wlm munge >/dev/null || { apt-get update -q >/dev/null && apt-get install -y -q slurm-wlm munge >/dev/null; }
}

write_conf() {
  local cpus mem
  cpus="$(nproc)"
  mem="$(awk '/MemTotal/ {print int($2 / 1024 * 0.9)}' /proc/meminfo)"  # MB, a margin for the OS
  mkdir -p "$DIR/state" "$DIR/spool" "$DIR/munge"
  cat >"$CONF.tmp" <<EOF
# Written by scripts/local-slurm.sh: a single-node SLURM for tests and laptops.
ClusterName=charllm
SlurmctldHost=$HOST(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket=$SOCKET
CredType=cred/munge
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SwitchType=switch/none
SlurmdParameters=config_overrides
StateSaveLocation=$DIR/state
SlurmdSpoolDir=$DIR/spool
SlurmctldPidFile=$DIR/slurmctld.pid
SlurmdPidFile=$DIR/slurmd.pid
SlurmctldLogFile=$DIR/slurmctld.log
SlurmdLogFile=$DIR/slurmd.log
SlurmctldPort=${CHARLLM_SLURMCTLD_PORT:-6817}
SlurmdPort=${CHARLLM_SLURMD_PORT:-6818}
# Finished jobs stay in slurmctld's memory (squeue -t all, scontrol show job) for a day.
MinJobAge=86400
ReturnToService=2
KillWait=10
NodeName=$HOST NodeAddr=127.0.0.1 CPUs=$cpus RealMemory=$mem State=UNKNOWN
PartitionName=debug Nodes=$HOST Default=YES MaxTime=INFINITE State=UP
EOF
  mv "$CONF.tmp" "$CONF"
}

munge_up() { [ -S "$SOCKET" ] && munge --socket="$SOCKET" -n </dev/null | unmunge --socket="$SOCKET" >/dev/null 2>&1; }

start_munge() {
  munge_up && return
  chmod 0755 "$DIR/munge"
  if [ ! -s "$DIR/munge.key" ]; then
    dd if=/dev/urandom of="$DIR/munge.key" bs=1024 count=1 status=none
    chmod 0400 "$DIR/munge.key"
  fi
  munged --force --socket="$SOCKET" --key-file="$DIR/munge.key" --pid-file="$DIR/munged.pid" \
    --seed-file="$DIR/munged.seed" --log-file="$DIR/munged.log"
}

daemon_up() { [ -s "$DIR/$1.pid" ] && kill -0 "$(cat "$DIR/$1.pid")" 2>/dev/null; }

ready() { SLURM_CONF="$CONF" sinfo -h -N -o '%t' 2>/dev/null | grep -Eq '^(idle|mix|alloc)'; }

start() {
  need_root
  install_if_missing
  write_conf
  start_munge
  export SLURM_CONF="$CONF"
  daemon_up slurmctld || slurmctld -f "$CONF"
  daemon_up slurmd || slurmd -f "$CONF"
  for _ in $(seq 1 100); do
    if ready; then
      log "up: node $HOST idle, partition debug (SLURM_CONF=$CONF)"
      return 0
    fi
    # A node that was down when slurmctld last saw it comes back without an admin.
    scontrol update nodename="$HOST" state=resume >/dev/null 2>&1 || true
    sleep 0.2
  done
  log "did not come up in 20 s; see $DIR/slurmctld.log and $DIR/slurmd.log"
  sinfo -N >&2 || true
  return 1
}

stop_one() {
  if daemon_up "$1"; then
    local pid
    pid="$(cat "$DIR/$1.pid")"
    kill "$pid"
    for _ in $(seq 1 50); do kill -0 "$pid" 2>/dev/null || break; sleep 0.1; done
  fi
}

stop() {
  stop_one slurmd
  stop_one slurmctld
  stop_one munged
  log "stopped (state kept in $DIR)"
}

status() {
  if [ -s "$CONF" ] && ready; then
    SLURM_CONF="$CONF" sinfo -N
    return 0
  fi
  log "not running (scripts/local-slurm.sh start)"
  return 1
}

case "${1:-}" in
  start) start ;;
  stop) stop ;;
  status) status ;;
  env)
    echo "export SLURM_CONF=$CONF"
    echo "export PATH=$HERE/slurm-bin:\$PATH"
    ;;
  *)
    echo "usage: $0 start|stop|status|env" >&2
    exit 2
    ;;
esac
