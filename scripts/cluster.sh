#!/usr/bin/env bash
# Single-machine Slurm cluster for slurmresume's tests (Debian 12, run as root).
#
# Starts, without any init system: munged -> mariadbd -> slurmdbd -> slurmctld -> slurmd
# (one node named after `hostname -s`, or two emulated nodes n1, n2 on this machine).
# Config, state, pid files and logs live under $SLURMRESUME_CLUSTER_DIR
# (default /var/lib/slurmresume-cluster); /etc/slurm/slurm.conf is a symlink to the
# generated slurm.conf so that plain `sbatch`, `sinfo`, ... find the cluster.
# Templates: scripts/slurm/*.in.  Run `scripts/cluster.sh --help` for usage.
set -euo pipefail
shopt -u patsub_replacement 2>/dev/null || true   # bash 5.2: '&' literal in ${x//a/b}

SCRIPT_DIR=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
TEMPLATE_DIR=$SCRIPT_DIR/slurm

STATE_DIR=${SLURMRESUME_CLUSTER_DIR:-/var/lib/slurmresume-cluster}
CPUS=${SLURMRESUME_CLUSTER_CPUS:-8}               # advertised CPUs per node
MEM_MB=${SLURMRESUME_CLUSTER_MEM_MB:-8192}        # advertised RealMemory per node
TIMEOUT=${SLURMRESUME_CLUSTER_TIMEOUT:-120}       # seconds for `up` (after packages)
GRACE_TIME=${SLURMRESUME_CLUSTER_GRACE_TIME:-20}  # preemption grace time (low/debug)
PROCTRACK_REQ=${SLURMRESUME_CLUSTER_PROCTRACK:-}  # ''|auto|cgroup|linuxproc

CLUSTER_NAME=slurmresume
CTLD_PORT=6817
SLURMD_PORT=6818          # 1-node mode; in 2-node mode n<i> uses 6830+i
DBD_PORT=6819
DB_PORT=3307              # not 3306: stay clear of a system MariaDB
PACKAGES=(munge slurmctld slurmd slurm-client slurmdbd mariadb-server)

ETC=$STATE_DIR/etc
RUN=$STATE_DIR/run
LOG=$STATE_DIR/log
SLURM_CONF_FILE=$ETC/slurm.conf
MY_CNF=$ETC/my.cnf
MUNGE_PID=/run/munge/munged.pid
MUNGE_LOG=/var/log/munge/munged.log
MARIADB_PID=$RUN/mysqld/mariadbd.pid
SLURMDBD_PID=$RUN/slurmdbd.pid
SLURMCTLD_PID=$RUN/slurmctld.pid
HOST=$(hostname -s)
export SLURM_CONF=$SLURM_CONF_FILE   # for the client commands this script runs
# Daemons get a clean environment (nothing of the caller's venv, CUDA_*, SLURM_* ...).
DAEMON_ENV=(env -i PATH=/usr/sbin:/usr/bin:/sbin:/bin HOME=/root LANG=C SLURM_CONF="$SLURM_CONF_FILE")

usage() {
  cat <<EOF
Usage: $(basename "$0") COMMAND [OPTIONS]

Single-machine Slurm cluster (munge, MariaDB, slurmdbd, slurmctld, slurmd) for tests.

Commands:
  up [--nodes 1|2]   Install missing packages, write config, start all daemons and wait
                     until the node(s) are idle and sacct works. Idempotent; if the
                     config (e.g. node count) changed, slurmctld+slurmd are restarted.
                     1 node is named \`hostname -s\`; 2 nodes are n1 and n2.
  down [--purge]     Stop the daemons (by pid file, reverse order). --purge also
                     deletes the state dir (job state, accounting DB, logs).
  status             Show whether each daemon is alive, sinfo and squeue
                     (exit status 1 if a daemon is not running).
  logs [-n N] [-f]   Tail the daemon logs (N lines, default 30; -f follows).
  -h, --help         This message.

Environment:
  SLURMRESUME_CLUSTER_DIR        state dir (default /var/lib/slurmresume-cluster)
  SLURMRESUME_CLUSTER_CPUS       CPUs advertised per node (default 8)
  SLURMRESUME_CLUSTER_MEM_MB     RealMemory advertised per node (default 8192)
  SLURMRESUME_CLUSTER_TIMEOUT    seconds \`up\` waits for the daemons (default 120)
  SLURMRESUME_CLUSTER_GRACE_TIME preemption GraceTime of debug/low (default 20)
  SLURMRESUME_CLUSTER_PROCTRACK  cgroup | linuxproc | auto (default: the choice
                                 recorded in \$STATE_DIR/proctrack, else auto: cgroup
                                 if cgroup v1 works here, otherwise linuxproc)

Partitions: debug (default) and low (PriorityTier=1, GraceTime), high (PriorityTier=10).
A high job preempts (requeues) a low one only if it cannot fit otherwise: make the low
job hold all CPUs (--exclusive, or -c/-n \$SLURMRESUME_CLUSTER_CPUS). See slurm.conf.
EOF
}

log()  { printf '[cluster] %s\n' "$*" >&2; }
die()  { printf '[cluster] ERROR: %s\n' "$*" >&2; exit 1; }

# ---------------------------------------------------------------- process helpers

# pid_alive PIDFILE COMM: print the pid and succeed if PIDFILE names a live COMM process.
pid_alive() {
  local pidfile=$1 comm=$2 pid
  [[ -r $pidfile ]] || return 1
  pid=$(tr -dc '0-9' <"$pidfile")
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == "$comm" ]] || return 1
  echo "$pid"
}

# term_pidfile PIDFILE COMM: send SIGTERM if PIDFILE names a live COMM process.
term_pidfile() {
  local pid
  pid=$(pid_alive "$1" "$2") || return 0
  log "stopping $2 (pid $pid)"
  kill -TERM "$pid" 2>/dev/null || true
}

# await_pidfile PIDFILE COMM: wait up to 30 s for it to exit, then SIGKILL; remove PIDFILE.
await_pidfile() {
  local pidfile=$1 comm=$2 pid i
  if pid=$(pid_alive "$pidfile" "$comm"); then
    for ((i = 0; i < 300; i++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      log "$comm (pid $pid) ignored SIGTERM for 30 s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
      sleep 0.5
    fi
  fi
  rm -f "$pidfile"
}

stop_pidfile() {
  term_pidfile "$1" "$2"
  await_pidfile "$1" "$2"
}

slurmd_pidfiles() { compgen -G "$RUN/slurmd-*.pid" || true; }

stop_slurmds() {  # all slurmd instances at once
  local f
  for f in $(slurmd_pidfiles); do term_pidfile "$f" slurmd; done
  for f in $(slurmd_pidfiles); do await_pidfile "$f" slurmd; done
}

DEADLINE=0
remaining() { echo $((DEADLINE - SECONDS)); }

# wait_for DESCRIPTION CMD...: retry CMD until it succeeds or the `up` deadline passes.
wait_for() {
  local desc=$1
  shift
  while ! "$@" >/dev/null 2>&1; do
    ((SECONDS < DEADLINE)) || { log "timed out waiting for $desc"; return 1; }
    sleep 0.25
  done
}

all_logs() {
  local f
  printf '%s\n' "$MUNGE_LOG" "$LOG/mariadbd.log" "$LOG/slurmdbd.log" "$LOG/slurmctld.log"
  for f in $(compgen -G "$LOG/slurmd-*.log" || true); do printf '%s\n' "$f"; done
}

dump_logs() {
  local n=${1:-25} f
  for f in $(all_logs); do
    [[ -e $f ]] || continue
    printf '===== %s (last %s lines)\n' "$f" "$n"
    tail -n "$n" "$f"
  done
}

fail_up() {
  log "FAILED: $*"
  dump_logs 25 >&2
  exit 1
}

# ---------------------------------------------------------------- packages

packages_missing() {
  local p
  for p in "${PACKAGES[@]}"; do
    dpkg-query -W -f='${Status}\n' "$p" 2>/dev/null | grep -q '^install ok installed$' ||
      printf '%s\n' "$p"
  done
}

ensure_packages() {
  local missing policy_rc=/usr/sbin/policy-rc.d made_policy=0
  mapfile -t missing < <(packages_missing)
  ((${#missing[@]} == 0)) && return 0
  log "installing: ${missing[*]}"
  export DEBIAN_FRONTEND=noninteractive
  # Postinst scripts must not try to start the daemons through init scripts.
  if [[ ! -e $policy_rc ]]; then
    printf '#!/bin/sh\nexit 101\n' >"$policy_rc"
    chmod 755 "$policy_rc"
    made_policy=1
  fi
  local apt=(apt-get -y -q -o DPkg::Lock::Timeout=600 --no-install-recommends)
  local rc=0
  if ! compgen -G '/var/lib/apt/lists/*_Packages*' >/dev/null; then
    apt-get -q -o DPkg::Lock::Timeout=600 update >&2 || rc=$?
  fi
  if ((rc == 0)) && ! "${apt[@]}" install "${missing[@]}" >&2; then
    log "install failed; running apt-get update and retrying"
    apt-get -q -o DPkg::Lock::Timeout=600 update >&2 && "${apt[@]}" install "${missing[@]}" >&2 || rc=$?
  fi
  ((made_policy)) && rm -f "$policy_rc"
  ((rc == 0)) || die "apt-get failed (rc=$rc)"
  mapfile -t missing < <(packages_missing)
  ((${#missing[@]} == 0)) || die "still missing after install: ${missing[*]}"
}

# ---------------------------------------------------------------- config

declare -A VARS
NODE_NAMES=()
NODE_LINES=

# render TEMPLATE: substitute @KEY@ from VARS; a line "@NODE_LINES@" becomes $NODE_LINES.
render() {
  local line k
  while IFS= read -r line || [[ -n $line ]]; do
    if [[ $line == "@NODE_LINES@" ]]; then
      printf '%s\n' "$NODE_LINES"
      continue
    fi
    for k in "${!VARS[@]}"; do line=${line//@$k@/${VARS[$k]}}; done
    printf '%s\n' "$line"
  done <"$1"
}

# install_conf TEMPLATE DEST MODE: render to DEST if the content differs; succeed iff changed.
install_conf() {
  local tmpl=$1 dest=$2 mode=$3 tmp
  tmp=$(mktemp "$dest.XXXXXX")
  render "$tmpl" >"$tmp"
  chmod "$mode" "$tmp"
  if [[ -e $dest ]] && cmp -s "$tmp" "$dest"; then
    rm -f "$tmp"
    return 1
  fi
  mv -f "$tmp" "$dest"
  return 0
}

set_nodes() {
  local nodes=$1 i
  NODE_NAMES=()
  NODE_LINES=
  local res="CPUs=$CPUS RealMemory=$MEM_MB State=UNKNOWN"
  if ((nodes == 1)); then
    NODE_NAMES=("$HOST")
    NODE_LINES="NodeName=$HOST NodeAddr=127.0.0.1 $res"
  else
    for ((i = 1; i <= nodes; i++)); do
      NODE_NAMES+=("n$i")
      NODE_LINES+="NodeName=n$i NodeHostname=$HOST NodeAddr=127.0.0.1 Port=$((6830 + i)) $res"$'\n'
    done
    NODE_LINES=${NODE_LINES%$'\n'}
  fi
}

SLURM_CONF_CHANGED=0
DBD_CONF_CHANGED=0
MY_CNF_CHANGED=0

write_configs() {
  local nodes=$1 task_plugin=task/none
  [[ $PROCTRACK == cgroup ]] && task_plugin=task/cgroup
  set_nodes "$nodes"
  VARS=(
    [STATE_DIR]=$STATE_DIR [HOST]=$HOST [CLUSTER_NAME]=$CLUSTER_NAME
    [CTLD_PORT]=$CTLD_PORT [SLURMD_PORT]=$SLURMD_PORT [DBD_PORT]=$DBD_PORT
    [DB_PORT]=$DB_PORT [DB_PASS]=$(cat "$ETC/db.pass") [CPUS]=$CPUS
    [GRACE_TIME]=$GRACE_TIME [PROCTRACK]=$PROCTRACK [TASK_PLUGIN]=$task_plugin
    [NODE_MODE]="$nodes node(s): ${NODE_NAMES[*]}"
  )
  SLURM_CONF_CHANGED=0 DBD_CONF_CHANGED=0 MY_CNF_CHANGED=0
  install_conf "$TEMPLATE_DIR/slurm.conf.in" "$SLURM_CONF_FILE" 644 && SLURM_CONF_CHANGED=1
  if [[ $PROCTRACK == cgroup ]]; then
    install_conf "$TEMPLATE_DIR/cgroup.conf.in" "$ETC/cgroup.conf" 644 && SLURM_CONF_CHANGED=1
  elif [[ -e $ETC/cgroup.conf ]]; then
    rm -f "$ETC/cgroup.conf"
    SLURM_CONF_CHANGED=1
  fi
  install_conf "$TEMPLATE_DIR/slurmdbd.conf.in" "$ETC/slurmdbd.conf" 600 && DBD_CONF_CHANGED=1
  install_conf "$TEMPLATE_DIR/my.cnf.in" "$MY_CNF" 644 && MY_CNF_CHANGED=1
  return 0
}

prepare_dirs() {
  mkdir -p "$ETC" "$RUN/mysqld" "$LOG" "$STATE_DIR/spool" "$STATE_DIR/mysql" /etc/slurm
  chmod 755 "$STATE_DIR" "$ETC" "$RUN" "$LOG"
  chown mysql:mysql "$RUN/mysqld" "$STATE_DIR/mysql"
  touch "$LOG/mariadbd.log"
  chown mysql:mysql "$LOG/mariadbd.log"
  if [[ ! -s $ETC/db.pass ]]; then
    (umask 077 && od -An -N16 -tx1 /dev/urandom | tr -d ' \n' >"$ETC/db.pass")
  fi
  # Clients (sbatch, sinfo, submitit, ...) read /etc/slurm/slurm.conf by default.
  local link=/etc/slurm/slurm.conf
  if [[ -e $link && ! -L $link ]]; then
    log "moving existing $link to $link.orig"
    mv -f "$link" "$link.orig"
  fi
  ln -sfn "$SLURM_CONF_FILE" "$link"
}

# ---------------------------------------------------------------- proctrack choice

cgroup_v1_available() {
  awk '$2 == "/sys/fs/cgroup/freezer" && $3 == "cgroup" { found = 1 } END { exit !found }' /proc/mounts ||
    return 1
  local probe=/sys/fs/cgroup/freezer/slurmresume-probe.$$
  mkdir "$probe" 2>/dev/null || return 1
  rmdir "$probe"
}

PROCTRACK=
PROBE=0          # run a test job after bring-up
FALLBACK_OK=0    # on failure with cgroup, retry with linuxproc

choose_proctrack() {
  local recorded=
  [[ -r $STATE_DIR/proctrack ]] && recorded=$(tr -dc 'a-z' <"$STATE_DIR/proctrack")
  case $PROCTRACK_REQ in
    cgroup | linuxproc) PROCTRACK=$PROCTRACK_REQ PROBE=1 FALLBACK_OK=0 ;;
    "" | auto)
      if [[ -z $PROCTRACK_REQ && ($recorded == cgroup || $recorded == linuxproc) ]]; then
        PROCTRACK=$recorded PROBE=0 FALLBACK_OK=0
      elif cgroup_v1_available; then
        PROCTRACK=cgroup PROBE=1 FALLBACK_OK=1
      else
        log "cgroup v1 (freezer) not usable here"
        PROCTRACK=linuxproc PROBE=1 FALLBACK_OK=0
      fi
      ;;
    *) die "SLURMRESUME_CLUSTER_PROCTRACK must be cgroup, linuxproc or auto" ;;
  esac
}

# ---------------------------------------------------------------- daemons

start_munge() {
  if pid_alive "$MUNGE_PID" munged >/dev/null; then return 0; fi
  mkdir -p /run/munge /var/lib/munge /var/log/munge
  chown munge:munge /run/munge /var/lib/munge /var/log/munge
  chmod 755 /run/munge
  if [[ ! -s /etc/munge/munge.key ]]; then
    log "creating /etc/munge/munge.key"
    (umask 077 && dd if=/dev/urandom of=/etc/munge/munge.key bs=1024 count=1 status=none)
    chown munge:munge /etc/munge/munge.key
    chmod 400 /etc/munge/munge.key
  fi
  log "starting munged"
  "${DAEMON_ENV[@]}" runuser -u munge -- /usr/sbin/munged --force </dev/null >/dev/null 2>&1 ||
    fail_up "munged did not start"
  wait_for "munge" bash -c 'munge -n | unmunge' || fail_up "munge does not work"
}

mariadb_sql() { mariadb --defaults-file="$MY_CNF" -uroot "$@"; }

start_mariadb() {
  if ((MY_CNF_CHANGED)) && pid_alive "$MARIADB_PID" mariadbd >/dev/null; then
    stop_pidfile "$SLURMDBD_PID" slurmdbd   # reconnects more reliably when restarted too
    stop_pidfile "$MARIADB_PID" mariadbd
  fi
  if [[ ! -d $STATE_DIR/mysql/mysql ]]; then
    log "initialising MariaDB datadir $STATE_DIR/mysql"
    mariadb-install-db --defaults-file="$MY_CNF" --user=mysql --skip-test-db \
      --auth-root-authentication-method=socket >>"$LOG/mariadb-install.log" 2>&1 ||
      fail_up "mariadb-install-db failed (see $LOG/mariadb-install.log)"
  fi
  if ! pid_alive "$MARIADB_PID" mariadbd >/dev/null; then
    log "starting mariadbd (127.0.0.1:$DB_PORT)"
    "${DAEMON_ENV[@]}" setsid -f /usr/sbin/mariadbd --defaults-file="$MY_CNF" \
      </dev/null >>"$LOG/mariadbd.log" 2>&1
  fi
  wait_for "mariadbd" mariadb-admin --defaults-file="$MY_CNF" -uroot ping ||
    fail_up "mariadbd is not answering"
  local pass
  pass=$(cat "$ETC/db.pass")
  mariadb_sql <<SQL || fail_up "could not create the slurm database/user"
CREATE DATABASE IF NOT EXISTS slurm_acct_db;
CREATE USER IF NOT EXISTS 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
CREATE USER IF NOT EXISTS 'slurm'@'localhost' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'127.0.0.1' IDENTIFIED BY '$pass';
ALTER USER 'slurm'@'localhost' IDENTIFIED BY '$pass';
GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'127.0.0.1';
GRANT ALL PRIVILEGES ON slurm_acct_db.* TO 'slurm'@'localhost';
SQL
}

start_slurmdbd() {
  if ((DBD_CONF_CHANGED)); then stop_pidfile "$SLURMDBD_PID" slurmdbd; fi
  if ! pid_alive "$SLURMDBD_PID" slurmdbd >/dev/null; then
    log "starting slurmdbd"
    "${DAEMON_ENV[@]}" /usr/sbin/slurmdbd </dev/null >>"$LOG/slurmdbd.out" 2>&1 ||
      fail_up "slurmdbd did not start"
  fi
  wait_for "slurmdbd" sacctmgr -n -P show cluster format=cluster ||
    fail_up "slurmdbd is not answering"
}

# start_slurm: (re)start slurmctld and the slurmd(s) for NODE_NAMES.
start_slurm() {
  local f n keep
  if ((SLURM_CONF_CHANGED)); then
    if [[ -n $(slurmd_pidfiles) ]] || pid_alive "$SLURMCTLD_PID" slurmctld >/dev/null; then
      log "slurm config changed: restarting slurmctld and slurmd"
    fi
    stop_slurmds
    stop_pidfile "$SLURMCTLD_PID" slurmctld
  fi
  # slurmd instances of nodes that are no longer configured
  for f in $(slurmd_pidfiles); do
    keep=0
    for n in "${NODE_NAMES[@]}"; do [[ $f == "$RUN/slurmd-$n.pid" ]] && keep=1; done
    ((keep)) || stop_pidfile "$f" slurmd
  done
  if ! pid_alive "$SLURMCTLD_PID" slurmctld >/dev/null; then
    log "starting slurmctld"
    "${DAEMON_ENV[@]}" /usr/sbin/slurmctld </dev/null >>"$LOG/slurmctld.out" 2>&1 ||
      { log "slurmctld failed to start (exit $?)"; return 1; }
  fi
  wait_for "slurmctld" bash -c 'scontrol ping | grep -q UP' || return 1
  for n in "${NODE_NAMES[@]}"; do
    if ! pid_alive "$RUN/slurmd-$n.pid" slurmd >/dev/null; then
      mkdir -p "$STATE_DIR/spool/slurmd-$n"
      log "starting slurmd -N $n"
      "${DAEMON_ENV[@]}" /usr/sbin/slurmd -N "$n" </dev/null >>"$LOG/slurmd-$n.out" 2>&1 ||
        { log "slurmd -N $n failed to start (exit $?)"; return 1; }
    fi
  done
}

# nodes_ready: every configured node responds and is usable (idle/mixed/allocated).
# A node that responds but is down/drained (e.g. after an unclean stop) is resumed.
nodes_ready() {
  local n state ok=0
  for n in "${NODE_NAMES[@]}"; do
    state=$(sinfo -h -n "$n" -N -o '%t' 2>/dev/null | head -n1)
    case $state in
      idle | mix | alloc | comp) ;;
      down | drain | drng)
        scontrol update nodename="$n" state=resume >/dev/null 2>&1 || true
        ok=1
        ;;
      *) ok=1 ;;
    esac
  done
  return $ok
}

wait_slurm_ready() {
  local n
  for n in "${NODE_NAMES[@]}"; do
    pid_alive "$RUN/slurmd-$n.pid" slurmd >/dev/null || {
      sleep 1
      pid_alive "$RUN/slurmd-$n.pid" slurmd >/dev/null || { log "slurmd $n is not running"; return 1; }
    }
  done
  wait_for "node(s) ${NODE_NAMES[*]} idle" nodes_ready || return 1
  wait_for "cluster registration in slurmdbd" \
    bash -c "sacctmgr -n -P show cluster format=cluster | grep -qx '$CLUSTER_NAME'" || return 1
  wait_for "sacct" sacct -n -X -S now-1hour || return 1
}

# probe_job: run a job step on every node; with cgroup check it lives in a freezer cgroup.
probe_job() {
  local out t
  t=$(remaining)
  ((t > 5)) || t=5
  if ! out=$(timeout "$t" srun -N "${#NODE_NAMES[@]}" -n "${#NODE_NAMES[@]}" -t 1 \
    -J slurmresume-probe --quiet cat /proc/self/cgroup 2>&1); then
    log "probe job failed: $out"
    return 1
  fi
  if [[ $PROCTRACK == cgroup ]] && ! grep -q 'freezer:/slurm.*job_' <<<"$out"; then
    log "probe job is not in a Slurm freezer cgroup: $out"
    return 1
  fi
}

# ---------------------------------------------------------------- commands

cmd_up() {
  local nodes=1
  while (($#)); do
    case $1 in
      --nodes) nodes=${2:-}; shift 2 || die "--nodes needs a value" ;;
      --nodes=*) nodes=${1#--nodes=}; shift ;;
      -h | --help) usage; exit 0 ;;
      *) die "up: unknown argument '$1' (try --help)" ;;
    esac
  done
  [[ $nodes == 1 || $nodes == 2 ]] || die "--nodes must be 1 or 2"
  [[ $(id -u) == 0 ]] || die "must run as root"
  local t0=$SECONDS
  ensure_packages
  local t1=$SECONDS
  DEADLINE=$((SECONDS + TIMEOUT))
  prepare_dirs
  choose_proctrack
  write_configs "$nodes"
  start_munge
  start_mariadb
  start_slurmdbd
  if ! { start_slurm && wait_slurm_ready && { ((PROBE == 0)) || probe_job; }; }; then
    if [[ $PROCTRACK == cgroup ]] && ((FALLBACK_OK)); then
      log "proctrack/cgroup did not work here; falling back to proctrack/linuxproc"
      dump_logs 10 >&2
      PROCTRACK=linuxproc
      DEADLINE=$((SECONDS + TIMEOUT))
      write_configs "$nodes"
      SLURM_CONF_CHANGED=1
      { start_slurm && wait_slurm_ready && probe_job; } || fail_up "slurm did not come up"
    else
      fail_up "slurm did not come up (proctrack/$PROCTRACK)"
    fi
  fi
  echo "$PROCTRACK" >"$STATE_DIR/proctrack"
  echo "$nodes" >"$STATE_DIR/nodes"
  log "cluster up: nodes ${NODE_NAMES[*]}, proctrack/$PROCTRACK" \
    "(packages $((t1 - t0)) s, daemons $((SECONDS - t1)) s)"
  sinfo
}

cmd_down() {
  local purge=0
  while (($#)); do
    case $1 in
      --purge) purge=1; shift ;;
      -h | --help) usage; exit 0 ;;
      *) die "down: unknown argument '$1' (try --help)" ;;
    esac
  done
  [[ $(id -u) == 0 ]] || die "must run as root"
  stop_slurmds
  stop_pidfile "$SLURMCTLD_PID" slurmctld
  stop_pidfile "$SLURMDBD_PID" slurmdbd
  stop_pidfile "$MARIADB_PID" mariadbd
  stop_pidfile "$MUNGE_PID" munged
  local steps
  steps=$(pgrep -x slurmstepd 2>/dev/null | tr '\n' ' ' || true)
  [[ -z $steps ]] || log "note: job steps still running (slurmstepd pids: $steps)"
  if ((purge)); then
    log "removing $STATE_DIR"
    rm -rf "$STATE_DIR"
  fi
  log "cluster down"
}

cmd_status() {
  local name pidfile comm pid f
  printf 'state dir: %s   proctrack: %s\n' "$STATE_DIR" \
    "$(cat "$STATE_DIR/proctrack" 2>/dev/null || echo '?')"
  local -a daemons=("munged:$MUNGE_PID:munged" "mariadbd:$MARIADB_PID:mariadbd"
    "slurmdbd:$SLURMDBD_PID:slurmdbd" "slurmctld:$SLURMCTLD_PID:slurmctld")
  for f in $(slurmd_pidfiles); do
    name=${f##*/}
    daemons+=("${name%.pid}:$f:slurmd")
  done
  local all=0
  for f in "${daemons[@]}"; do
    IFS=: read -r name pidfile comm <<<"$f"
    if pid=$(pid_alive "$pidfile" "$comm"); then
      printf '  %-14s alive (pid %s)\n' "$name" "$pid"
    else
      printf '  %-14s DEAD\n' "$name"
      all=1
    fi
  done
  if pid_alive "$SLURMCTLD_PID" slurmctld >/dev/null; then
    sinfo || all=1
    squeue || true
  fi
  return $all
}

cmd_logs() {
  local n=30 follow=0
  while (($#)); do
    case $1 in
      -n) n=$2; shift 2 ;;
      -f) follow=1; shift ;;
      -h | --help) usage; exit 0 ;;
      *) die "logs: unknown argument '$1' (try --help)" ;;
    esac
  done
  if ((follow)); then
    local files=()
    mapfile -t files < <(for f in $(all_logs); do [[ -e $f ]] && echo "$f"; done)
    exec tail -n "$n" -F "${files[@]}"
  fi
  dump_logs "$n"
}

main() {
  local cmd=${1:-}
  (($#)) && shift
  case $cmd in
    up) cmd_up "$@" ;;
    down) cmd_down "$@" ;;
    status) cmd_status "$@" ;;
    logs) cmd_logs "$@" ;;
    -h | --help | help) usage ;;
    "") usage >&2; exit 2 ;;
    *) printf 'unknown command: %s\n\n' "$cmd" >&2; usage >&2; exit 2 ;;
  esac
}

main "$@"
