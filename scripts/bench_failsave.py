"""What the failure-time save costs a step in steady state (issue 47): examples/train.py, each rank
timing `FailureGuard.at_step` (the training thread's part of the per-step snapshot: RNG states,
skeleton, per-rank tensors, handed to the publisher thread) plus its optimizer pre-hook (the tail
snapshot, the same way) against the time between two `ckpt.step()` calls.

One run (as before; the guard on unless BENCH_FAILSAVE_GUARD=off):

    torchrun --standalone --nproc-per-node 3 scripts/bench_failsave.py --steps 300 --save-every 100000

prints one line per rank: median and 90th percentile of the training thread's snapshot time, the
median step, the ratio; the first step (the one-time replicated-set check, a collective) apart.

Since the digests, the encoding and the write run on a background thread (train/snappub.py), the
training thread's time alone is no longer the cost: the publisher takes the GIL and a CPU too. The
step time with the guard on against off, interleaved rounds:

    python3 scripts/bench_failsave.py --rounds 5 --nproc 3 -- --steps 300 --save-every 100000

runs torchrun 2 x ROUNDS times (on, off, off, on, ...; a fresh checkpoint and heartbeat directory
each; `--thread` adds the publisher on its own thread, `--baseline DIR` the code in DIR) and prints each round's median step (the median over ranks of each rank's median step) on
and off, their ratio, and the medians over rounds with their spread (min-max). "CPU of both
threads per step" is the steady state: each rank's mean over its steps after WARMUP (the first
step's one-time replicated-set collective and layout learning, a few ms, are printed apart; before
2026-12-08 they were averaged in, ~15-30 us per step over 300 steps).

The training thread's work alone, less sensitive to a loaded machine (its CPU time,
`time.thread_time`, of `at_step` + the optimizer pre-hook per step, on the real state of
examples/train.py between its real steps: one process, a one-rank gloo group and DDP, one intra-op
thread as torchrun gives each of several ranks, the guard built as for rank 0 of 2 ranks on one
node):

    python3 scripts/bench_failsave.py --micro --rounds 3 [--baseline DIR] -- --steps 1000 --save-every 100000

prints per run the median, p10 and p90 of that CPU time per step (after WARMUP steps), the
pre-hook's part, the median step; then the median over runs of each arm (this tree, and the code
in DIR when given, alternating).
"""

from __future__ import annotations

import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ENV_GUARD = "BENCH_FAILSAVE_GUARD"
ENV_MICRO = "BENCH_FAILSAVE_MICRO"
WARMUP = 10  # steps left out of the step-time statistics (first steps: allocations, the collective)


def _child() -> None:
    import runpy

    from slurmresume.contract import ENV_HEARTBEAT_DIR
    from slurmresume.train import checkpointer, failsave

    guard_on = os.environ.get(ENV_GUARD, "on") != "off"
    if os.environ.get(ENV_GUARD) == "thread":
        failsave.PUBLISH_IN_BACKGROUND = True  # type: ignore[misc]
    if not os.environ.get(ENV_HEARTBEAT_DIR):  # as under the launcher: one node-local directory per run
        base = Path("/dev/shm") if Path("/dev/shm").is_dir() else Path(tempfile.gettempdir())
        shared = base / f"bench-failsave-{os.environ.get('TORCHELASTIC_RUN_ID', 'bare')}"
        shared.mkdir(exist_ok=True)
        os.environ[ENV_HEARTBEAT_DIR] = str(shared)

    snap_s: list[float] = []
    cpu = [0.0]  # the training thread's CPU seconds in both captures, over the run
    step_cpu: list[float] = []  # per step: the training thread's CPU in at_step + the pre-hook before it
    hook_cpu: list[float] = []  # per step: the pre-hook's part
    tail_cpu = [0.0]
    gaps: list[float] = []
    last = [0.0]
    tail = [0.0]  # the tail snapshot's time since the last boundary
    guards: list[failsave.FailureGuard] = []
    at_step, step = failsave.FailureGuard.at_step, checkpointer.Checkpointer.step
    pre_hook = failsave.FailureGuard._on_optimizer_step

    def timed_at_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        if not guards:
            guards.append(self)
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return at_step(self, *args, **kwargs)
        finally:
            spent = time.thread_time() - c0
            cpu[0] += spent
            step_cpu.append(spent + tail_cpu[0])
            hook_cpu.append(tail_cpu[0])
            snap_s.append(time.perf_counter() - t0 + tail[0])
            tail[0] = tail_cpu[0] = 0.0

    def timed_pre_hook(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        t0, c0 = time.perf_counter(), time.thread_time()
        try:
            return pre_hook(self, *args, **kwargs)
        finally:
            spent = time.thread_time() - c0
            cpu[0] += spent
            tail_cpu[0] += spent
            tail[0] += time.perf_counter() - t0

    def publisher_cpu() -> float | None:
        """The publisher thread's CPU seconds so far (Linux: its thread CPU clock)."""
        thread = getattr(getattr(guards[0], "_pub", None), "_thread", None) if guards else None
        if thread is None or not thread.is_alive() or thread.ident is None:
            return None
        return time.clock_gettime(time.pthread_getcpuclockid(thread.ident))

    def timed_step(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        now = time.perf_counter()
        if last[0]:
            gaps.append(now - last[0])
        last[0] = now
        return step(self, *args, **kwargs)

    failsave.FailureGuard.at_step = timed_at_step  # type: ignore[method-assign]
    failsave.FailureGuard._on_optimizer_step = timed_pre_hook  # type: ignore[method-assign]
    checkpointer.Checkpointer.step = timed_step  # type: ignore[method-assign]
    if not guard_on:
        checkpointer.failure_guard = lambda group, root: None  # type: ignore[assignment]
    elif os.environ.get(ENV_MICRO):  # one process: the guard of rank 0 of 2 on one node, its peer alive
        def micro_guard(group, root):  # type: ignore[no-untyped-def]
            from slurmresume.train.peers import publish_pid

            guard = failsave.FailureGuard(Path(os.environ[ENV_HEARTBEAT_DIR]) / failsave.SUBDIR, root, 0, 2,
                                          local=range(2))
            publish_pid(guard.dir, 1)  # "rank 1" is this process: watched as a live peer, as in a real run
            return guard

        checkpointer.failure_guard = micro_guard  # type: ignore[assignment]
    # the publisher's CPU time, read before the Checkpointer's close() ends its thread
    close = checkpointer.Checkpointer.close
    pub_cpu: list[float | None] = [None]

    def timed_close(self, *args, **kwargs):  # type: ignore[no-untyped-def]
        pub_cpu[0] = publisher_cpu()
        return close(self, *args, **kwargs)

    checkpointer.Checkpointer.close = timed_close  # type: ignore[method-assign]
    try:
        runpy.run_path(str(Path(__file__).resolve().parents[1] / "examples" / "train.py"), run_name="__main__")
    finally:
        rank = os.environ.get("RANK", "0")
        steady = gaps[WARMUP:] if len(gaps) > 2 * WARMUP else gaps
        if steady:
            gap = statistics.median(steady)
            record = {"rank": int(rank), "guard": guard_on, "step_median_s": gap, "step_mean_s": statistics.mean(steady)}
            if len(snap_s) > 2:
                rest = sorted(snap_s[1:])
                med, p90 = statistics.median(rest), rest[int(0.9 * (len(rest) - 1))]
                n = len(snap_s)
                # steady state: the mean over the steps after WARMUP (the first step's one-time
                # replicated-set collective and layout learning apart, reported on their own)
                steady_cpu = step_cpu[WARMUP:] if len(step_cpu) > 2 * WARMUP else step_cpu[1:]
                record.update(snapshot_median_s=med, snapshot_p90_s=p90, first_step_s=snap_s[0],
                              thread_cpu_per_step_s=statistics.mean(steady_cpu),
                              thread_cpu_all_steps_per_step_s=cpu[0] / n, first_step_cpu_s=step_cpu[0],
                              publisher_cpu_per_step_s=pub_cpu[0] / n if pub_cpu[0] is not None else None)
                pub = f"{pub_cpu[0] / n * 1e6:.0f} us" if pub_cpu[0] is not None else "-"
                print(f"rank {rank}: snapshot (training thread) median {med * 1e6:.0f} us, p90 {p90 * 1e6:.0f} us, "
                      f"mean {statistics.mean(rest) * 1e6:.0f} us (step mean {statistics.mean(steady) * 1e3:.2f} ms), "
                      f"first step {snap_s[0] * 1e3:.1f} ms; step median {gap * 1e3:.2f} ms; "
                      f"snapshot / step = {100 * med / gap:.2f} %; CPU per step: training thread "
                      f"{record['thread_cpu_per_step_s'] * 1e6:.0f} us in steady state ({cpu[0] / n * 1e6:.0f} us "
                      f"with the first step's {step_cpu[0] * 1e3:.1f} ms), publisher thread {pub}", flush=True)
            if os.environ.get(ENV_MICRO) and len(step_cpu) > 2 * WARMUP:
                per = sorted(step_cpu[WARMUP:])
                record.update(micro_cpu_median_s=statistics.median(per), micro_cpu_p10_s=per[len(per) // 10],
                              micro_cpu_p90_s=per[(9 * len(per)) // 10],
                              micro_hook_median_s=statistics.median(hook_cpu[WARMUP:]), micro_steps=len(per))
                print(f"micro: training-thread CPU per step (at_step + pre-hook) median "
                      f"{record['micro_cpu_median_s'] * 1e6:.0f} us (p10 {record['micro_cpu_p10_s'] * 1e6:.0f}, "
                      f"p90 {record['micro_cpu_p90_s'] * 1e6:.0f}; pre-hook alone "
                      f"{record['micro_hook_median_s'] * 1e6:.0f} us) over {len(per)} steps; "
                      f"step median {gap * 1e3:.2f} ms", flush=True)
            sys.stdout.flush()  # then one write: the ranks share the pipe, a line must not interleave
            os.write(sys.stdout.fileno(), ("BENCH " + json.dumps(record) + "\n").encode())


def _run_once(guard: str, nproc: int, train_args: list[str], code: str | None = None) -> list[dict]:
    import shutil
    import subprocess

    from slurmresume.contract import ENV_HEARTBEAT_DIR

    work = Path(tempfile.mkdtemp(prefix="bench-failsave-"))
    beats = Path(tempfile.mkdtemp(prefix="bench-failsave-hb-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
    try:
        env = {**os.environ, ENV_GUARD: guard, ENV_HEARTBEAT_DIR: str(beats)}
        if code:
            env["PYTHONPATH"] = code
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
               str(Path(__file__).resolve()), *train_args, "--ckpt-dir", str(work / "ckpt")]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
        if proc.returncode != 0:
            sys.exit(f"bench_failsave: a run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
        return [json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("BENCH ")]
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(beats, ignore_errors=True)


def _micro(train_args: list[str], rounds: int, baseline: str | None) -> None:
    """One process, as rank 0 of a one-rank gloo group (DDP included), one intra-op thread as
    torchrun gives each of several ranks: see the module docstring. With `baseline`, that code's
    run alternates with this tree's, `rounds` of each."""
    import shutil
    import socket
    import subprocess

    from slurmresume.contract import ENV_HEARTBEAT_DIR

    arms: list[tuple[str, str | None]] = [("this tree", None)] + ([("baseline", baseline)] if baseline else [])
    got: dict[str, list[dict]] = {name: [] for name, _ in arms}
    for r in range(rounds):
        for name, code in arms[r % len(arms):] + arms[:r % len(arms)]:
            work = Path(tempfile.mkdtemp(prefix="bench-failsave-"))
            beats = Path(tempfile.mkdtemp(prefix="bench-failsave-hb-",
                                          dir="/dev/shm" if Path("/dev/shm").is_dir() else None))
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            env = {**os.environ, ENV_GUARD: "on", ENV_MICRO: "1", ENV_HEARTBEAT_DIR: str(beats), "RANK": "0",
                   "WORLD_SIZE": "1", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
            if code:
                env["PYTHONPATH"] = code
            try:
                cmd = [sys.executable, str(Path(__file__).resolve()), *train_args, "--ckpt-dir", str(work / "ckpt")]
                proc = subprocess.run(cmd, env=env, capture_output=True, text=True, check=False)
                if proc.returncode != 0:
                    sys.exit(f"bench_failsave: the run failed (exit {proc.returncode}):\n{proc.stderr[-3000:]}")
                rec = [json.loads(line[6:]) for line in proc.stdout.splitlines() if line.startswith("BENCH ")][0]
                got[name].append(rec)
                print(f"round {r + 1}, {name}: " + next(line for line in proc.stdout.splitlines()
                                                     if line.startswith("micro:"))[7:], flush=True)
            finally:
                shutil.rmtree(work, ignore_errors=True)
                shutil.rmtree(beats, ignore_errors=True)
    for name, recs in got.items():
        cpu = [x["micro_cpu_median_s"] * 1e6 for x in recs]
        hook = [x["micro_hook_median_s"] * 1e6 for x in recs]
        step = [x["step_median_s"] * 1e3 for x in recs]
        print(f"over {len(recs)} runs, median (min-max): {name}: training-thread CPU per step "
              f"{statistics.median(cpu):.0f} ({min(cpu):.0f} .. {max(cpu):.0f}) us, pre-hook "
              f"{statistics.median(hook):.0f} us, step {statistics.median(step):.2f} ms", flush=True)


def _driver(argv: list[str]) -> None:
    import argparse

    sep = argv.index("--") if "--" in argv else len(argv)
    p = argparse.ArgumentParser(description="step time with the failure-save guard on vs off, interleaved rounds")
    p.add_argument("--rounds", type=int, default=5, help="rounds of (on, off); with --micro, runs of each arm (default: 5)")
    p.add_argument("--nproc", type=int, default=3, help="ranks per run (default: 3)")
    p.add_argument("--baseline", default=None,
                   help="a checkout of the code before (its PYTHONPATH): a third arm, guard on (default: none)")
    p.add_argument("--thread", action="store_true",
                   help="a fourth arm: the publisher on its own thread (default: off; the guard publishes inline)")
    p.add_argument("--micro", action="store_true",
                   help="instead: one process, the training thread's CPU per step in the guard (default: off)")
    args = p.parse_args(argv[:sep])
    train_args = argv[sep + 1:] or ["--steps", "300", "--save-every", "100000"]
    if args.micro:
        _micro(train_args, args.rounds, args.baseline)
        return
    rows = []
    arms: list[tuple[str, str, str | None]] = [("on", "on", None), ("off", "off", None)]
    if args.thread:
        arms.append(("thread", "thread", None))
    if args.baseline:
        arms.append(("baseline", "on", args.baseline))
    for r in range(args.rounds):
        got = {}
        for name, guard, code in arms[r % len(arms):] + arms[:r % len(arms)]:  # rotate which goes first
            got[name] = _run_once(guard, args.nproc, train_args, code)
        med = {name: statistics.median(x["step_median_s"] for x in recs) for name, recs in got.items()}
        snaps = {name: statistics.median(x["snapshot_median_s"] for x in recs if "snapshot_median_s" in x)
                 for name, recs in got.items() if name != "off"}
        cpus = {name: statistics.median(x["thread_cpu_per_step_s"] + (x.get("publisher_cpu_per_step_s") or 0.0)
                                        for x in recs if "thread_cpu_per_step_s" in x)
                for name, recs in got.items() if name != "off"}
        rows.append((med, snaps, cpus))
        print(f"round {r + 1}: " + ", ".join(f"{n} {v * 1e3:.2f} ms" for n, v in med.items()) + "; "
              + ", ".join(f"{n}/off {100 * (med[n] / med['off'] - 1):+.2f} %, {n} training-thread snapshot "
                          f"{snaps[n] * 1e6:.0f} us, CPU of both threads {cpus[n] * 1e6:.0f} us per step"
                          for n in snaps), flush=True)

    def spread(xs: list[float], scale: float, fmt: str) -> str:
        return f"{format(statistics.median(xs) * scale, fmt)} ({format(min(xs) * scale, fmt)} .. {format(max(xs) * scale, fmt)})"

    for name, _, _ in arms:
        steps = [m[name] for m, _, _ in rows]
        line = f"{name}: step median {spread(steps, 1e3, '.2f')} ms"
        if name != "off":
            line += (f", step / off - 1 = {spread([m[name] / m['off'] - 1 for m, _, _ in rows], 100, '+.2f')} %, "
                     f"training-thread snapshot {spread([s[name] for _, s, _ in rows], 1e6, '.0f')} us, "
                     f"CPU of both threads per step {spread([c[name] for _, _, c in rows], 1e6, '.0f')} us "
                     f"({spread([c[name] / m['off'] for m, _, c in rows], 100, '.2f')} % of the step off)")
        print(f"over {len(rows)} rounds, median (min-max): {line}", flush=True)


if __name__ == "__main__":
    if "RANK" in os.environ:
        _child()
    else:
        _driver(sys.argv[1:])
