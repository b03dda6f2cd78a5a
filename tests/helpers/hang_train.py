"""A small training loop for the hang tests: gloo, a DDP-like all_reduce per step.

Usage: hang_train.py STEPS STEP_SLEEP [SLOW_STEP SLOW_FACTOR] [SLOW_SAVE_S] [SAVE_EVERY]
SLOW_STEP: that step sleeps SLOW_FACTOR x STEP_SLEEP (once, in the first run only: a legitimately
slow step). SLOW_SAVE_S: every save's state_dict() of the `slow` entry takes that long (a slow
save). Writes $PIDDIR/rank<R>.pid and progress<R> like sig_train.py.
$EVALS="10:6:wrap,20:6:bare,30:6:wrap=40": after those steps (first run only) every rank
"evaluates" for that many seconds, inside `ckpt.busy("eval")` (wrap; wrap=S: budget_s=S) or not.
$CSTUCK="1:25": rank 1 blocks in a C call (libc sleep through ctypes) after step 25, first run only.
$HANG_ON="1:1:12": the rank with SLURM_NODEID 1 and LOCAL_RANK 1 stops before step 12's
collective (first run only), whatever global rank the rendezvous gave it.
Each rank prints "where: RANK=r LOCAL_RANK=l SLURM_NODEID=n" and writes it to
$PIDDIR/where-<run id>-<R> (the run id from the launcher; "bare" when run without it).
$THROTTLE_MBPS=1: a throttled writer (a slow parallel file system): every shard is fed to its
writer at about that many MB/s, and the state carries 4 MB more, so each save takes ~4 s while
its file visibly grows.
$FSYNC_PAUSE="*:5" (or "1:inf"): the first save of the first attempt, on every rank (or rank 1), sits
that many seconds in its shard's final fsync, no byte moving (a parallel file system flushing);
inf: it never returns. The state carries 4 MiB more (also with $BIG=1), so the save has bytes to
scale its budget.
"""

import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

import slurmresume


class SlowToSave:
    """A state entry whose state_dict() takes `seconds` in a save (SLOW_SAVE_S). The failure-time
    snapshot that every ckpt.step() takes (slurmresume/train/stepsnap.py) also calls state_dict();
    there it returns at once, else every step would take `seconds` too, and the tests of a slow
    save (judged by the save budget, not the step budget) would be testing slow steps instead."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.value = 0

    def state_dict(self) -> dict:
        if not _in_step_snapshot():
            time.sleep(self.seconds)
        return {"value": self.value}

    def load_state_dict(self, sd: dict) -> None:
        self.value = sd["value"]


def _in_step_snapshot() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals.get("__name__") == "slurmresume.train.stepsnap":
            return True
        frame = frame.f_back
    return False


def throttle(mbps: float) -> None:
    from slurmresume.checkpoint import writer

    feed = writer.ShardSink.feed
    piece = 64 << 10

    def slow_feed(self, data, *, reused: bool = False, digests=None) -> None:  # type: ignore[no-untyped-def]
        import xxhash

        view = memoryview(data).cast("B")
        for start in range(0, len(view), piece):
            feed(self, bytes(view[start : start + piece]), reused=True)
            time.sleep(piece / (mbps * 1e6))
        if digests is not None:  # the block digest the hasher would have appended (pieces are copies here)
            digests.append(xxhash.xxh3_64_hexdigest(view))

    writer.ShardSink.feed = slow_feed


def slow_fsync(seconds: float) -> None:
    from slurmresume.checkpoint import fsio

    fsync = fsio.fsync_fd
    paused = []

    def pause_once(fd: int, label: str, path: str = "", **kw) -> None:  # type: ignore[no-untyped-def]
        if label == "shard" and not paused:
            paused.append(True)
            time.sleep(1e6 if seconds == float("inf") else seconds)
        fsync(fd, label, path, **kw)

    fsio.fsync_fd = pause_once


def main() -> None:
    steps, sleep = int(sys.argv[1]), float(sys.argv[2])
    slow_step = int(sys.argv[3]) if len(sys.argv) > 3 else -1
    slow_factor = float(sys.argv[4]) if len(sys.argv) > 4 else 1.0
    slow_save = float(sys.argv[5]) if len(sys.argv) > 5 else 0.0
    save_every = int(sys.argv[6]) if len(sys.argv) > 6 else None
    if "RANK" in os.environ:
        dist.init_process_group("gloo")
    rank = dist.get_rank() if dist.is_initialized() else 0
    piddir = Path(os.environ["PIDDIR"])
    piddir.mkdir(parents=True, exist_ok=True)
    (piddir / f"rank{rank}.pid").write_text(str(os.getpid()))
    where = f"RANK={rank} LOCAL_RANK={os.environ.get('LOCAL_RANK', 0)} SLURM_NODEID={os.environ.get('SLURM_NODEID', 0)}"
    print(f"where: {where}", flush=True)
    (piddir / f"where-{os.environ.get('SLURMRESUME_RUN_ID', 'bare')}-{rank}").write_text(where)
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    ckpt = slurmresume.Checkpointer(save_every=save_every)
    state = {"model": model, "slow": SlowToSave(slow_save)}
    if os.environ.get("THROTTLE_MBPS"):
        throttle(float(os.environ["THROTTLE_MBPS"]))
        state["big"] = torch.nn.Linear(1024, 1024, bias=False)  # 4 MB
    pause = os.environ.get("FSYNC_PAUSE", "").split(":")
    if len(pause) == 2 or os.environ.get("BIG"):
        state["big"] = torch.nn.Linear(1024, 1024, bias=False)  # 4 MiB
    step = ckpt.restore(state)
    first_run = step == 0
    first_attempt = os.environ.get("SLURMRESUME_RUN_ID", "").endswith(".0")  # no save committed: step 0 again
    if first_run and first_attempt and len(pause) == 2 and pause[0] in ("*", str(rank)):
        slow_fsync(float(pause[1]))
    stuck = tuple(int(x) for x in os.environ["CSTUCK"].split(":")) if os.environ.get("CSTUCK") else None
    evals = {int(a): (float(b), c) for a, b, c in
             (item.split(":") for item in os.environ.get("EVALS", "").split(",") if item)}
    hang_on = tuple(int(x) for x in os.environ["HANG_ON"].split(":")) if os.environ.get("HANG_ON") else None
    here = (int(os.environ.get("SLURM_NODEID", 0)), int(os.environ.get("LOCAL_RANK", 0)))
    while step < steps:
        if first_run and hang_on is not None and hang_on == (*here, step + 1):
            while True:  # stopped before this step's collective; the peers wait in it
                time.sleep(3600)
        x = torch.randn(4, 8)
        model(x).square().mean().backward()
        if dist.is_initialized():
            for p in model.parameters():
                dist.all_reduce(p.grad)
        step += 1
        time.sleep(sleep * (slow_factor if step == slow_step and first_run else 1.0))
        (piddir / f"progress{rank}").write_text(str(step))
        ckpt.step(step, state)
        if first_run and stuck == (rank, step):
            import ctypes

            ctypes.CDLL(None).sleep(100000)  # in C: no Python frame runs, the GIL is released
        if first_run and step in evals:
            seconds, how = evals[step]
            if how == "bare":
                time.sleep(seconds)
            else:
                with ckpt.busy("eval", budget_s=float(how[5:]) if how.startswith("wrap=") else None):
                    time.sleep(seconds)
    ckpt.save(step, state, reason="final")
    ckpt.close()


if __name__ == "__main__":
    main()
