#!/usr/bin/env bash
# Smoke test of a running scripts/cluster.sh cluster: batch job + sacct, requeue latency,
# scancel --signal delivery, preemption (optional), multi-node srun (if 2 nodes).
# Usage: scripts/slurm/smoke-test.sh [--preempt] [--keep]
#   --preempt  also test high-partition preemption of an --exclusive low job (~30 s)
#   --keep     keep the work dir (default: removed on success)
set -euo pipefail

PREEMPT=0 KEEP=0
for a in "$@"; do
  case $a in
    --preempt) PREEMPT=1 ;;
    --keep) KEEP=1 ;;
    -h | --help) sed -n '2,7p' "$0"; exit 0 ;;
    *) echo "unknown argument: $a" >&2; exit 2 ;;
  esac
done

WORK=$(mktemp -d /tmp/slurmresume-smoke.XXXXXX)
cd "$WORK"
FAILED=0
pass() { printf 'PASS  %s\n' "$*"; }
fail() { printf 'FAIL  %s\n' "$*"; FAILED=1; }
now() { date +%s.%N; }
elapsed() { awk -v a="$1" -v b="$2" 'BEGIN { printf "%.1f", b - a }'; }

job_state() {  # current state from squeue, else from sacct
  local s
  s=$(squeue -h -j "$1" -o %T 2>/dev/null || true)
  [[ -n $s ]] || s=$(sacct -n -X -P -j "$1" -o State 2>/dev/null | head -n1 | awk '{print $1}')
  echo "$s"
}

# wait_state JOB REGEX TIMEOUT: poll every 0.1 s
wait_state() {
  local job=$1 re=$2 t=$3 end s
  end=$(($(date +%s) + t))
  while (($(date +%s) < end)); do
    s=$(job_state "$job")
    [[ $s =~ ^($re)$ ]] && return 0
    sleep 0.1
  done
  echo "  (job $job still '$s' after ${t}s)" >&2
  return 1
}

wait_file_grep() {  # FILE PATTERN TIMEOUT
  local end=$(($(date +%s) + $3))
  while (($(date +%s) < end)); do
    grep -q -- "$2" "$1" 2>/dev/null && return 0
    sleep 0.1
  done
  return 1
}

nnodes=$(sinfo -h -N -o %N | sort -u | wc -l)
echo "work dir $WORK; nodes: $(sinfo -h -N -o %N | sort -u | tr '\n' ' '); proctrack:" \
  "$(scontrol show config | awk '/^ProctrackType/ {print $3}')"

# 1. batch job, accounted as COMPLETED
t0=$(now)
j=$(sbatch --parsable -o hi.out --wrap 'sleep 1; echo hi')
if wait_state "$j" COMPLETED 60 && [[ $(cat hi.out) == hi ]]; then
  pass "sbatch --wrap job $j COMPLETED in sacct with output 'hi' ($(elapsed "$t0" "$(now)") s)"
else
  fail "sbatch job $j: state $(job_state "$j"), output '$(cat hi.out 2>/dev/null)'"
fi

# 2. scontrol requeue of a running job
cat >requeue.sh <<'EOF'
#!/bin/bash
echo "start restart_count=${SLURM_RESTART_COUNT:-0} $(date +%s.%N)"
sleep 300
EOF
j=$(sbatch --parsable -o requeue.out --open-mode=append requeue.sh)
if wait_state "$j" RUNNING 30 && wait_file_grep requeue.out 'restart_count=0' 10; then
  t0=$(now)
  scontrol requeue "$j"
  if wait_file_grep requeue.out 'restart_count=1' 120; then
    t1=$(awk '/restart_count=1/ {print $3}' requeue.out)
    pass "scontrol requeue $j: running again after $(elapsed "$t0" "$t1") s"
  else
    fail "requeued job $j did not restart (state $(job_state "$j"))"
  fi
else
  fail "requeue job $j never started"
fi
scancel "$j" 2>/dev/null || true

# 3. scancel --signal=USR1 JOB: who receives it (batch shell, step task, task's child)
cat >signal.sh <<'EOF'
#!/bin/bash
trap 'echo "batch-shell got USR1" >>sig.log' USR1
srun -n1 bash -c '
  trap "echo step-task got USR1 >>sig.log" USR1
  bash -c "trap \"echo task-child got USR1 >>sig.log\" USR1; echo child-ready >>sig.log; while :; do sleep 0.1; done" &
  echo task-ready >>sig.log
  while :; do sleep 0.1; done' &
wait
EOF
rm -f sig.log
j=$(sbatch --parsable -o signal.out signal.sh)
if wait_file_grep sig.log task-ready 30 && wait_file_grep sig.log child-ready 10; then
  sleep 0.5
  scancel --signal=USR1 "$j"
  sleep 2
  if grep -q 'step-task got USR1' sig.log; then
    pass "scancel --signal=USR1 reached the job step task"
  else
    fail "scancel --signal=USR1 did not reach the step task"
  fi
  echo "      receivers: $(grep -o '^[a-z-]* got USR1' sig.log | sort | uniq -c | tr -s ' ' | paste -sd ',')"
else
  fail "signal job $j did not start its step"
fi
scancel "$j" 2>/dev/null || true

# 4. preemption: high job preempts an --exclusive low job (signal at once, then requeue)
if ((PREEMPT)); then
  cat >low.sh <<'EOF'
#!/bin/bash
echo "low start restart_count=${SLURM_RESTART_COUNT:-0} $(date +%s.%N)"
srun -n1 bash -c 'trap "echo \"low got USR1 \$(date +%s.%N)\"" USR1; trap "echo \"low got TERM \$(date +%s.%N)\"; exit 0" TERM; while :; do sleep 0.1; done'
EOF
  j=$(sbatch --parsable -p low --exclusive -N "$nnodes" --signal=USR1@30 -o low.out --open-mode=append low.sh)
  if wait_state "$j" RUNNING 30; then
    sleep 1
    t0=$(now)
    h=$(sbatch --parsable -p high -n1 -o high.out --wrap 'echo high ran')
    if wait_state "$h" COMPLETED 90; then
      pass "high job $h preempted low job $j and completed after $(elapsed "$t0" "$(now)") s"
    else
      fail "high job $h: state $(job_state "$h")"
    fi
    if wait_file_grep low.out 'restart_count=1' 60; then
      pass "preempted low job $j was requeued and restarted"
    else
      fail "low job $j not restarted (state $(job_state "$j"))"
    fi
    awk -v t0="$t0" '/got/ {printf "      low job: %s %s at +%.1f s\n", $2, $3, $4 - t0}' low.out
  else
    fail "low job $j never started"
  fi
  scancel "$j" 2>/dev/null || true
fi

# 5. multi-node srun
if ((nnodes >= 2)); then
  out=$(timeout 60 srun --quiet -N "$nnodes" -l bash -c 'echo $SLURMD_NODENAME $(hostname)' 2>srun.err) || true
  if (($(grep -c . <<<"$out") == nnodes)) && [[ $(cut -d' ' -f2 <<<"$out" | sort -u | wc -l) == "$nnodes" ]]; then
    pass "srun -N$nnodes: $(sort <<<"$out" | paste -sd ';')"
  else
    fail "srun -N$nnodes: $out $(cat srun.err)"
  fi
fi

if ((FAILED)); then
  echo "some checks FAILED; work dir kept: $WORK"
  exit 1
fi
((KEEP)) || rm -rf "$WORK"
echo "all checks passed"
