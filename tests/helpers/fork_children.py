"""Child for tests/test_child_signals.py: with a Checkpointer's handlers installed, a forked
`multiprocessing.Pool` must shut down at the end of its `with` block, `Process.terminate()` must
stop a forked child, and neither a forked nor a spawned child may die of the warning signal.
Prints one JSON line of findings."""

import json
import multiprocessing as mp
import os
import signal
import sys
import time

import slurmresume


def square(x: int) -> int:
    return x * x


def sleeper(_: int = 0) -> None:
    time.sleep(120)


def warned_then_exits(q) -> None:  # type: ignore[no-untyped-def]
    os.kill(os.getpid(), signal.SIGUSR1)  # would kill it at the default action
    time.sleep(0.2)
    q.put(signal.SIGUSR1 in signal.pthread_sigmask(signal.SIG_BLOCK, []))


if __name__ == "__main__":
    ckpt = slurmresume.Checkpointer(sys.argv[1])
    found: dict = {}
    t0 = time.monotonic()
    with mp.get_context("fork").Pool(2) as pool:  # __exit__ calls terminate(): SIGTERM to workers
        found["pool"] = pool.map(square, range(4))
        pool.map_async(sleeper, range(2))  # busy workers: only SIGTERM (terminate()) ends them now
        time.sleep(0.5)
    found["pool_exit_s"] = round(time.monotonic() - t0, 2)
    p = mp.get_context("fork").Process(target=sleeper)
    p.start()
    time.sleep(0.3)
    p.terminate()
    p.join(30)
    found["terminate_exitcode"] = p.exitcode
    if p.exitcode is None:
        p.kill()
    for method in ("fork", "spawn"):
        ctx = mp.get_context(method)
        q = ctx.Queue()
        c = ctx.Process(target=warned_then_exits, args=(q,))
        c.start()
        c.join(60)
        found[f"{method}_warned_exitcode"] = c.exitcode
        found[f"{method}_blocked"] = q.get(timeout=5) if c.exitcode == 0 else None
    # the process itself still hears the warning (through the sigwait thread)
    os.kill(os.getpid(), signal.SIGUSR1)
    deadline = time.monotonic() + 10
    while ckpt.flag is not None and ckpt.flag.request == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
    found["parent_flag"] = ckpt.flag.request if ckpt.flag is not None else None
    ckpt.close()
    found["mask_after_close"] = signal.SIGUSR1 in signal.pthread_sigmask(signal.SIG_BLOCK, [])
    print(json.dumps(found), flush=True)
