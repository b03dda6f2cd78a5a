"""A small training loop for the launcher-lifecycle tests, steered by environment variables.

Usage: lifecycle_train.py STEPS [STEP_SLEEP]
  LC_SAVE_EVERY=N     periodic save every N steps
  LC_WORKERS=N        DataLoader workers (processes of the tree)
  LC_WARN_AT=K        in restart 0, rank 0 sends the warning signal to the launcher at step K
  LC_SAVE_FAULT=...   what the emergency save (after a signal) does in restart 0:
                      "crash" (the process dies mid-save), "error" (raises OSError ENOSPC),
                      "slow:S" (sleeps S seconds, then saves)
  LC_FAST_AFTER=1     restarts after the first one run with no step sleep
  LC_CRASH_ONCE=1     every restart crashes once at start (exit 3) before it runs
  LC_IGNORE_WARNING=1 the script never calls ckpt.step() and saves nothing (warned, no save)
Writes $PIDDIR/rank<R>.pid, $PIDDIR/progress<R> (the last step done), $PIDDIR/start<R>-<pid>.
"""

import errno
import os
import signal
import sys
import time
from pathlib import Path

import torch

import slurmresume
from slurmresume.train.signals import warning_signal_from_env

steps = int(sys.argv[1])
sleep = float(sys.argv[2]) if len(sys.argv) > 2 else 0.05
restart = int(os.environ.get("SLURMRESUME_RESTART_COUNT") or 0)
piddir = Path(os.environ.get("PIDDIR") or Path(os.environ["SLURMRESUME_CKPT_DIR"]) / "pids")
piddir.mkdir(parents=True, exist_ok=True)
if os.environ.get("LC_CRASH_ONCE"):
    mark = piddir / f"crashed-{restart}"
    if not mark.exists():
        mark.write_text("1")
        sys.exit(3)
if restart > 0 and os.environ.get("LC_FAST_AFTER"):
    sleep = 0.0
(piddir / "rank0.pid").write_text(str(os.getpid()))

fault = os.environ.get("LC_SAVE_FAULT", "") if restart == 0 else ""
if fault:
    original = slurmresume.Checkpointer.save

    def faulty_save(self, step, state, *, reason="explicit", **kw):  # type: ignore[no-untyped-def]
        if reason in ("preempt", "terminate"):
            if fault == "crash":
                os._exit(9)
            if fault == "error":
                raise OSError(errno.ENOSPC, "No space left on device (injected)")
            if fault.startswith("slow:"):
                time.sleep(float(fault.split(":")[1]))
        return original(self, step, state, reason=reason, **kw)

    slurmresume.Checkpointer.save = faulty_save  # type: ignore[method-assign]

workers = int(os.environ.get("LC_WORKERS") or 0)
save_every = int(os.environ["LC_SAVE_EVERY"]) if os.environ.get("LC_SAVE_EVERY") else None
warn_at = int(os.environ["LC_WARN_AT"]) if os.environ.get("LC_WARN_AT") and restart == 0 else None

torch.manual_seed(0)
model = torch.nn.Linear(4, 4)
data = torch.utils.data.TensorDataset(torch.randn(64, 4))
loader = torch.utils.data.DataLoader(data, batch_size=4, num_workers=workers,
                                     worker_init_fn=slurmresume.ignore_in_worker, persistent_workers=workers > 0)
ckpt = slurmresume.Checkpointer(save_every=save_every)
state = {"model": model}
step = ckpt.restore(state)
(piddir / f"start0-{os.getpid()}").write_text(str(step))
it = iter(loader)
while step < steps:
    try:
        (x,) = next(it)
    except StopIteration:
        it = iter(loader)
        (x,) = next(it)
    with torch.no_grad():
        model.weight.add_(x.mean() * 1e-3)
    step += 1
    (piddir / "progress0").write_text(str(step))
    time.sleep(sleep)
    if warn_at is not None and step == warn_at:
        os.kill(int(os.environ["SLURMRESUME_LAUNCHER_PID"]), warning_signal_from_env())
        deadline = time.monotonic() + 30  # hold until the launcher's relay has reached us
        while ckpt.flag is not None and not ckpt.flag.request and time.monotonic() < deadline:
            time.sleep(0.01)
    if os.environ.get("LC_IGNORE_WARNING"):
        continue
    ckpt.step(step, state)
if not os.environ.get("LC_IGNORE_WARNING"):
    ckpt.save(step, state, reason="final")
ckpt.close()
signal.signal(signal.SIGTERM, signal.SIG_DFL)
