"""Reliability campaigns: seeded fault-injection runs against the checkpoint protocol.

    python3 scripts/campaign.py NAME [--seed S] [--count N] [--workdir DIR] [--json-out FILE]
    python3 scripts/campaign.py all [--seed S]        # every campaign at its full default count
    python3 -m tests.campaigns NAME ...               # the same, from the repository root

NAME (one module tests/campaigns/NAME.py each; docs/reliability.md has the table):
  crash        SIGKILL at every file-system step of a save and of a prune, then seeded random
               SIGKILLs of a real training process while it saves
  diskfull     ENOSPC in every phase of a save, on a small tmpfs (needs root for mount)
  ioerror      an injected EIO at every file-system step of a save and of a prune
  corrupt      seeded bit flips, truncation, deletion, edits after commit
  hostile      a corpus of hostile checkpoints (tests/hostile/corpus.py)
  args         control characters in every `submit` option; torchrun argument lists
  concurrency  two prunes, a status reader and a writer at once; the lock swapped for a link
  readers      readers listing the root while a writer saves (never a half checkpoint)
  perms        modes of new roots, files and events.jsonl under umask 022 / 077

Every campaign module has one shape: NAME (its name above), DEFAULT_COUNT (the size of a full
run) and `run(report, work)`, which records into `report` (a Report carrying the seed and the
count) and uses `work` as scratch. The programs a campaign runs as processes of their own are
modules under tests/campaigns/children/ (spawn_child starts them).

Each run prints a one-line summary and one JSON report: trials, failures (each a sentence
naming the trial, seed and what broke), known issues hit (bugs reported in files this campaign
does not own), and counters. Exit 0 when there is no failure, 1 otherwise. The seed makes a
run repeatable; --count sets its size (trials or, for the crash campaign, random kills).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from types import ModuleType
from typing import Any

HERE = Path(__file__).resolve().parent
TESTS = HERE.parent
REPO = TESTS.parent
CHILDREN = HERE / "children"

CAMPAIGNS = ("crash", "diskfull", "ioerror", "corrupt", "hostile", "args", "concurrency", "readers", "perms")
TMP_RE = re.compile(r"^\..+\.tmp\.\d+$")
MAX_LISTED = 40


class Report:
    """What one campaign run found. `fail` records a broken guarantee (the run then exits 1);
    `known` records a hit of a bug already reported in a file the campaigns do not own."""

    def __init__(self, name: str, seed: int, count: int) -> None:
        self.name, self.seed, self.count = name, seed, count
        self.trials = 0
        self.failures: list[str] = []
        self.failure_count = 0
        self.known: dict[str, int] = {}
        self.stats: dict[str, Any] = {}
        self.started = time.perf_counter()
        self.elapsed: float | None = None  # set when the run ends
        self.skipped: str | None = None

    def fail(self, trial: str, msg: str) -> None:
        self.failure_count += 1
        if len(self.failures) < MAX_LISTED:
            self.failures.append(f"{trial}: {msg}")

    def check(self, ok: bool, trial: str, msg: str | Callable[[], str]) -> bool:
        if not ok:
            self.fail(trial, msg() if callable(msg) else msg)
        return ok

    def count_stat(self, key: str, n: int = 1) -> None:
        self.stats[key] = self.stats.get(key, 0) + n

    def known_issue(self, key: str) -> None:
        self.known[key] = self.known.get(key, 0) + 1

    def to_json(self) -> dict[str, Any]:
        return {"campaign": self.name, "seed": self.seed, "count": self.count, "trials": self.trials,
                "failure_count": self.failure_count, "failures": self.failures, "known_issues": self.known,
                "stats": self.stats, "skipped": self.skipped,
                "seconds": round(self.seconds, 2)}

    @property
    def seconds(self) -> float:
        return self.elapsed if self.elapsed is not None else time.perf_counter() - self.started

    def summary(self) -> str:
        if self.skipped:
            return f"{self.name}: SKIPPED ({self.skipped})"
        known = f", known issues hit: {self.known}" if self.known else ""
        return (f"{self.name}: {self.trials} trials, {self.failure_count} failures{known} "
                f"({self.seconds:.1f} s, seed {self.seed})")


# -- the fault seam of slurmresume/checkpoint/fsio.py, armed inside this process ---------------

SEAM_VARS = ("SLURMRESUME_TEST_KILL_AT", "SLURMRESUME_TEST_FAIL_AT", "SLURMRESUME_TEST_TRACE")


def arm(env: dict[str, str] | None) -> None:
    """Set (or, with None, clear) the seam variables and re-read them, as a fresh process would
    at import (the module object stays the same, so commit.py / shard.py / shardread.py see the new values)."""
    import slurmresume.checkpoint.fsio as fsio

    for var in SEAM_VARS:
        os.environ.pop(var, None)
    os.environ.update(env or {})
    importlib.reload(fsio)


@contextlib.contextmanager
def armed(env: dict[str, str]) -> Iterator[None]:
    arm(env)
    try:
        yield
    finally:
        arm(None)


def fork_call(fn: Callable[[], Any], *, env: dict[str, str] | None = None, out: Path | None = None,
              timeout: float = 120.0, on_started: Callable[[int], None] | None = None) -> tuple[int | None, int | None]:
    """Run `fn` in a forked child with the seam armed by `env`. Returns (exit code, signal):
    exit 0 when `fn` returned, 3 when it raised (the exception goes to `out`), or the signal
    that killed it. `on_started(pid)` runs in the parent right after the fork."""
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # child
        code = 0
        try:
            if out is not None:
                fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
                os.dup2(fd, 1)
                os.dup2(fd, 2)
            arm(env)
            fn()
        except BaseException as exc:  # noqa: BLE001 - reported as an exit code
            print(f"{type(exc).__name__}: {exc}", flush=True)
            code = 3
        sys.stdout.flush()
        os._exit(code)
    if on_started is not None:
        on_started(pid)
    deadline = time.monotonic() + timeout
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            return None, None
        time.sleep(0.002)
    if os.WIFSIGNALED(status):
        return None, os.WTERMSIG(status)
    return os.WEXITSTATUS(status), None


def trace_of(fn: Callable[[], Any], path: Path) -> list[str]:
    """Every seam label `fn` crosses (run in a forked child with SLURMRESUME_TEST_TRACE)."""
    path.unlink(missing_ok=True)
    code, sig = fork_call(fn, env={"SLURMRESUME_TEST_TRACE": str(path)}, out=path.with_suffix(".out"))
    if code != 0:
        raise RuntimeError(f"traced run failed ({code}, {sig}): {path.with_suffix('.out').read_text()[-2000:]}")
    return path.read_text().split() if path.exists() else []


def seam_spec(trace: list[str], i: int) -> str:
    """SLURMRESUME_TEST_KILL_AT / _FAIL_AT value that fires exactly at trace[i] (the seam counts
    prefix matches of the label across the whole process)."""
    label = trace[i]
    return f"{label}:{sum(1 for x in trace[: i + 1] if x.startswith(label))}"


# -- what is on disk ---------------------------------------------------------------------------

def where(exc: BaseException) -> str:
    """The innermost frame of `exc` inside the slurmresume package ("slurmresume/train/rng.py:restore"):
    which file a crash belongs to."""
    import traceback

    found = "?"
    for fr in traceback.extract_tb(exc.__traceback__):
        parts = Path(fr.filename).parts
        if "slurmresume" in parts and "tests" not in parts and "scripts" not in parts:
            found = "/".join(parts[len(parts) - 1 - parts[::-1].index("slurmresume"):]) + f":{fr.name}"
    return found


def tail(path: Path, n: int = 600) -> str:
    """The end of a child's output file, for a failure message."""
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


def age_lease(root: Path) -> None:
    """The lease a killed writer left on `root`, as the next run finds it: its heartbeat no longer
    fresh. A requeue or a restart by hand comes long after the FRESH_BEATS intervals a fresh
    heartbeat counts for; a check started the moment the child died waited each one out instead
    (ownership._wait_out: ~0.45 s a kill, 60% of the crash campaign's time). The wait itself is
    test_ownership_evidence's (a dead local owner with a fresh heartbeat is waited out, then taken);
    the holder is still proven dead before its root is taken (its pid is gone). A torn or missing
    lease is left as it is."""
    from dataclasses import replace

    from slurmresume import evidence, ownership

    lease = ownership.read_lease(root)
    if lease is not None:
        aged = lease.heartbeat - evidence.FRESH_BEATS * max(lease.heartbeat_s, 0.1) - 1.0
        ownership._write(root, replace(lease, heartbeat=aged))


def temp_leftovers(root: Path) -> list[str]:
    """`.NAME.tmp.PID` files anywhere under root (a failed or finished save must leave none)."""
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        for n in filenames + dirnames:
            if TMP_RE.match(n):
                out.append(str(Path(dirpath, n).relative_to(root)))
    return sorted(out)


def half_checkpoints(root: Path) -> list[str]:
    """Directories that carry a commit marker but fail a full verification."""
    from slurmresume.checkpoint.store import inspect_dir, list_checkpoints

    bad = []
    for info in list_checkpoints(root):
        if info.has_marker:
            full = inspect_dir(info.step, info.path, verify=True)
            if not full.complete:
                bad.append(f"{info.path.name}: {full.problem}")
    return bad


def complete_steps(root: Path, verify: bool = False) -> list[int]:
    from slurmresume.checkpoint.store import list_checkpoints

    return sorted(i.step for i in list_checkpoints(root, verify=verify) if i.complete)


def check_survivors(report: Report, trial: str, root: Path, committed: list[int], keep: int | None) -> list[int]:
    """The two guarantees every fault campaign checks after its fault: no directory carries a
    marker without being whole, and no committed checkpoint that must survive (all of them, or
    the newest `keep` under a prune) is gone. Returns the complete steps now on disk."""
    half = half_checkpoints(root)
    report.check(not half, trial, f"marked but not whole: {half}")
    done = complete_steps(root)
    universe = set(committed) | set(done)
    must = set(sorted(universe)[-keep:]) if keep else set(committed)
    lost = sorted(must - set(done))
    report.check(not lost, trial, f"committed checkpoint(s) {lost} lost (complete now: {done})")
    if lost:
        report.count_stat("lost_committed", len(lost))
    return done


def quiet_logs() -> None:
    """Keep the library's warnings (expected by the hundreds here) off the terminal."""
    import logging

    logging.getLogger("slurmresume").propagate = False
    logging.getLogger("slurmresume").addHandler(logging.NullHandler())


class LogCapture:
    """Collect the messages of the `slurmresume` logger (warnings name the bad files)."""

    def __init__(self) -> None:
        import logging

        self.messages: list[str] = []
        outer = self

        class _H(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                outer.messages.append(record.getMessage())

        self.handler = _H(level=logging.WARNING)
        self.logger = logging.getLogger("slurmresume")

    def __enter__(self) -> LogCapture:
        self.messages.clear()
        self.logger.addHandler(self.handler)
        return self

    def __exit__(self, *exc: object) -> None:
        self.logger.removeHandler(self.handler)


# -- the programs a campaign runs as processes of their own (tests/campaigns/children/) ---------

def spawn_child(name: str, *args: str | Path, stdout: int | None = None) -> subprocess.Popen[str]:
    """Start tests/campaigns/children/NAME.py with `args` (clean environment, cwd the repository);
    its stderr is a pipe (read it after it ends), its stdout goes to `stdout` (default: nowhere)."""
    from helpers.procs import clean_env

    return subprocess.Popen([sys.executable, str(CHILDREN / f"{name}.py"), *map(str, args)], env=clean_env(),
                            cwd=str(REPO), stdout=subprocess.DEVNULL if stdout is None else stdout,
                            stderr=subprocess.PIPE, text=True)


# -- for the CI-sized tests (tests/test_campaigns.py) -------------------------------------------

def run_in_subprocess(name: str, count: int, workdir: Path, seed: int | None = None,
                      timeout: float = 600) -> dict[str, Any]:
    """Run one campaign in a fresh process (`python -m campaigns NAME ...` with tests/ on the
    path) and return its JSON report. The seed is $SLURMRESUME_CAMPAIGN_SEED when set (to rotate
    seeds in CI)."""
    from helpers.procs import clean_env

    seed = int(os.environ.get("SLURMRESUME_CAMPAIGN_SEED", "1")) if seed is None else seed
    out = Path(workdir) / f"{name}-report.json"
    path = os.pathsep.join(p for p in (str(TESTS), os.environ.get("PYTHONPATH", "")) if p)
    proc = subprocess.run([sys.executable, "-m", "campaigns", name, "--seed", str(seed), "--count",
                           str(count), "--workdir", str(workdir), "--json-out", str(out), "--quiet"],
                          env=clean_env(PYTHONPATH=path), cwd=str(workdir), capture_output=True, text=True,
                          timeout=timeout)
    if not out.exists():
        raise AssertionError(f"campaign {name} produced no report (exit {proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return dict(json.loads(out.read_text()))


def assert_clean(report: dict[str, Any]) -> None:
    """Fail on any broken guarantee; surface known issues (bugs reported in files the campaigns do
    not own) as warnings, so that CI shows them without failing on them."""
    import warnings

    for issue, hits in report.get("known_issues", {}).items():
        warnings.warn(f"campaign {report['campaign']}: known issue hit {hits}x: {issue}", stacklevel=2)
    failures = report.get("failures", [])
    assert report.get("failure_count", 0) == 0, (
        f"campaign {report['campaign']} (seed {report['seed']}, count {report['count']}): "
        f"{report['failure_count']} failures\n" + "\n".join(failures))


# -- the command line ---------------------------------------------------------------------------

def campaign(name: str) -> ModuleType:
    """The module of campaign `name`, checked to have the one shape every campaign has."""
    mod = importlib.import_module(f"campaigns.{name}")
    shape = (getattr(mod, "NAME", None) == name, isinstance(getattr(mod, "DEFAULT_COUNT", None), int),
             callable(getattr(mod, "run", None)))
    if not all(shape):
        raise TypeError(f"campaigns.{name} lacks NAME = {name!r}, DEFAULT_COUNT or run(report, work)")
    return mod


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="campaign.py", description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("name", choices=[*CAMPAIGNS, "all"])
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--count", type=int, default=None, help="size of the run (default: the campaign's full size)")
    p.add_argument("--workdir", type=Path, default=None, help="scratch directory (default: a new temp dir)")
    p.add_argument("--json-out", type=Path, default=None, help="also write the JSON report(s) here")
    p.add_argument("--quiet", action="store_true", help="print only the summary line(s)")
    args = p.parse_args(argv)
    names = list(CAMPAIGNS) if args.name == "all" else [args.name]
    if args.count is not None and len(names) > 1:
        p.error("--count applies to one campaign; `all` runs each at its default")
    quiet_logs()
    from helpers.typer_cache import install

    install()  # CliRunner builds the command once, not at each of a campaign's invokes
    reports = []
    for name in names:
        mod = campaign(name)
        count = args.count if args.count is not None else mod.DEFAULT_COUNT
        base = args.workdir or Path(tempfile.mkdtemp(prefix=f"campaign-{name}-"))
        work = base / name if len(names) > 1 else base
        work.mkdir(parents=True, exist_ok=True)
        report = Report(name, args.seed, count)
        mod.run(report, work)
        report.elapsed = time.perf_counter() - report.started
        reports.append(report)
        print(report.summary(), flush=True)
        if not args.quiet:
            for f in report.failures:
                print(f"  FAIL {f}", flush=True)
    data = [r.to_json() for r in reports]
    text = json.dumps(data if len(data) > 1 else data[0], indent=2)
    if not args.quiet:
        print(text)
    if args.json_out:
        args.json_out.write_text(text)
    return 1 if any(r.failure_count for r in reports) else 0
