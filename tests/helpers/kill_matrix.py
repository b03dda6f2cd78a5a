"""Test helper: crash many saves cheaply. Imports torch + slurmresume once, then for each job
forks a child that arms the fault seam through its environment (SLURMRESUME_TEST_KILL_AT /
_FAIL_AT), re-imports slurmresume.checkpoint.fsio so that the seam reads it (as a fresh process
would at import), and saves the given steps with `helpers/save_steps.py`'s code.

    python tests/helpers/kill_matrix.py JOBS.json     # [{"root", "steps", "env": {...}}, ...]

Prints one JSON list: per job {"root", "returncode", "signal", "stdout"}; returncode is the
child's exit status, signal the number of the signal that ended it (9 for the seam's SIGKILL).
"""

from __future__ import annotations

import importlib
import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from helpers import save_steps  # noqa: E402

import slurmresume.checkpoint.fsio as fsio  # noqa: E402


def run_child(job: dict) -> None:
    os.environ.update(job.get("env", {}))
    importlib.reload(fsio)  # same module object: commit.py / shard.py / shardread.py see the armed seam
    out = os.open(job["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(out, 1)
    os.dup2(out, 2)
    try:
        code = save_steps.main([job["root"], *map(str, job["steps"])])
    except BaseException as exc:  # noqa: BLE001 - report anything as an exit code
        print(f"{type(exc).__name__}: {exc}", flush=True)
        code = 3
    sys.stdout.flush()
    os._exit(code)


def main(path: str) -> int:
    jobs = json.loads(Path(path).read_text())
    results = []
    for job in jobs:
        pid = os.fork()
        if pid == 0:
            run_child(job)
        _, status = os.waitpid(pid, 0)
        results.append({
            "root": job["root"],
            "returncode": os.waitstatus_to_exitcode(status),
            "signal": os.WTERMSIG(status) if os.WIFSIGNALED(status) else None,
            "stdout": Path(job["stdout"]).read_text(errors="replace"),
        })
    print(json.dumps(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1]))
