"""Campaign 6: hostile arguments to `submit`.

A fake `sbatch` first on PATH records every call (its argv and the script it was given). A
positive control first: a clean `submit` with every option set does call it, once. Then:

  matrix   every string option of `submit` (and the --sbatch key, the --sbatch value, the job
           name, the script path, a script argument, --resume-from, --branch, a default from
           slurmresume.toml) x every ASCII control character (NUL, TAB, LF, VT, FF, CR, ESC,
           DEL, ...) -> exit != 0 with an `error:` line, no file in --ckpt-dir (it is not even
           created), the fake sbatch never called
  fuzz     (--count trials) a seeded random option, control character, position and payload
           ("#SBATCH --wrap=...", "$(touch PWNED)") -> the same
  unicode  U+2028, U+0085, U+000B-like separators that are not newlines to bash or sbatch:
           either refused, or the submitted script has no line that starts with the payload
  argv     script arguments with spaces, quotes, `$(...)`, backticks, `;`, `|`, globs: each is
           one element, verbatim, at the end of `node.torchrun_command(...)` (and of the
           --dry-run preview), never inside the sbatch script (they travel pickled)

Runs in-process through typer's CliRunner (NUL bytes cannot be passed through a real argv);
a few trials also through a real `python -m slurmresume submit` process.
"""

from __future__ import annotations

import os
import random
import shutil
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

from campaigns.harness import REPO, Report

NAME = "args"
DEFAULT_COUNT = 2000
EXAMPLE = REPO / "examples" / "train.py"
CONTROLS = [chr(c) for c in list(range(0, 32)) + [127]]
PAYLOADS = ["#SBATCH --wrap=touch PWNED", "touch PWNED", "$(touch PWNED)", "x", ""]
OPTIONS = ["--partition", "--account", "--qos", "--constraint", "--job-name", "--mem", "--time", "--signal",
           "--python", "--ckpt-dir", "sbatch-key", "sbatch-value", "script", "script-arg",
           "--resume-from", "--branch", "toml-partition", "toml-sbatch"]
BENIGN = {"--partition": "debug", "--account": "acct", "--qos": "normal", "--constraint": "a100",
          "--job-name": "job1", "--mem": "4G", "--time": "10", "--signal": "USR1"}
ARGV_HOSTILE = ["two words", "'single'", '"double"', "$(touch PWNED)", "`touch PWNED`", "a;touch PWNED",
                "a|b", "*", "~", "--lr=3e-4", "-", "", "a\\b", "\u00e9\u4e2d", "$HOME", "a&&b", "#comment"]


class Env:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.bin = work / "bin"
        self.calls = work / "sbatch.calls"
        self.bin.mkdir(parents=True, exist_ok=True)
        sbatch = self.bin / "sbatch"
        sbatch.write_text(f'#!/bin/sh\nprintf "%s\\n" "ARGV $*" >> "{self.calls}"\n'
                          f'[ -f "$1" ] && cat "$1" >> "{self.calls}"\necho "Submitted batch job 4242"\n')
        sbatch.chmod(sbatch.stat().st_mode | stat.S_IEXEC)
        self.path = f"{self.bin}:{os.environ.get('PATH', '')}"

    def reset(self) -> None:
        self.calls.unlink(missing_ok=True)


def _argv(env: Env, ck: Path, option: str, value: str) -> tuple[list[str], Path | None]:
    """`submit` arguments with `value` in `option` (others benign). Returns (argv, cwd)."""
    script = str(EXAMPLE)
    opts: dict[str, str] = dict(BENIGN)
    extra: list[str] = ["--sbatch", "exclusive"]
    tail: list[str] = ["--", "--steps", "3"]
    cwd = None
    if option == "--ckpt-dir":
        opts[option] = str(ck) + value  # absolute: an accepted value must not land in the cwd
    elif option in BENIGN or option in ("--python", "--resume-from", "--branch"):
        opts[option] = value
    elif option == "sbatch-key":
        extra = ["--sbatch", f"comm{value}ent=x"]
    elif option == "sbatch-value":
        extra = ["--sbatch", f"comment=a{value}b"]
    elif option == "script":
        script = str(env.work / f"train{value}.py")
    elif option == "script-arg":
        tail = ["--", "--note", f"a{value}b"]
    elif option.startswith("toml-"):
        cwd = env.work / "cfg"
        cwd.mkdir(exist_ok=True)
        key = "partition" if option == "toml-partition" else "sbatch"
        val = f'"p{_toml_escape(value)}q"' if key == "partition" else f'["comment=a{_toml_escape(value)}b"]'
        (cwd / "slurmresume.toml").write_text(f"{key} = {val}\n")
        opts.pop("--partition", None)
        extra = []  # a CLI --sbatch would win over the file's
    argv = ["submit", script]
    if option != "--ckpt-dir":
        argv += ["--ckpt-dir", str(ck)]
    for k, v in opts.items():
        argv += [k, v]
    return argv + extra + tail, cwd


def _toml_escape(v: str) -> str:
    return "".join(f"\\u{ord(ch):04x}" if ord(ch) < 32 or ord(ch) == 127 or ch in '"\\' else ch for ch in v)


def _invoke(env: Env, argv: list[str], cwd: Path | None) -> Any:
    from typer.testing import CliRunner

    from slurmresume.cli import app

    old = Path.cwd()
    os.chdir(cwd if cwd is not None else env.work)  # whatever a relative path creates stays in work/
    try:
        return CliRunner().invoke(app, argv, env={"PATH": env.path, "COLUMNS": "200"})
    finally:
        os.chdir(old)


def _written(ck: Path) -> list[str]:
    if not ck.exists():
        return []
    return sorted(str(p.relative_to(ck)) for p in ck.rglob("*")) or ["(the directory itself)"]


def _refused(report: Report, trial: str, env: Env, ck: Path, argv: list[str], cwd: Path | None,
             extra_paths: tuple[Path, ...] = ()) -> None:
    env.reset()
    shutil.rmtree(ck, ignore_errors=True)
    before = set(os.listdir(env.work))
    res = _invoke(env, argv, cwd)
    report.trials += 1
    out = res.output or ""
    new = set(os.listdir(env.work)) - before - {env.calls.name}
    report.check(not new, trial, f"created {sorted(new)} next to --ckpt-dir before refusing")
    for name in new:
        shutil.rmtree(env.work / name, ignore_errors=True)
    report.check(res.exit_code != 0, trial, f"accepted (exit 0): {out[-300:]}")
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        report.fail(trial, f"crashed: {type(res.exception).__name__}: {res.exception}")
    # our `error:` line, or click's own usage error (exit 2) for a value it cannot even parse
    report.check("error:" in out or (res.exit_code == 2 and "Invalid value" in out), trial,
                 f"no `error:` line: {out[-300:]}")
    report.check(not env.calls.exists(), trial, "the fake sbatch was called")
    written = _written(ck)
    report.check(not written, trial, f"files written under --ckpt-dir before refusing: {written[:5]}")
    for p in extra_paths:
        if p.exists():
            report.fail(trial, f"created {p} before refusing")
            shutil.rmtree(p, ignore_errors=True)
    report.check(not (env.work / "PWNED").exists(), trial, "a payload ran")


def _resume_root(env: Env) -> Path:
    """A root with committed step 1 and a newer step 2, for --resume-from / --branch trials."""
    root = env.work / "resume-root"
    if not (root / "step_000000002" / "COMMITTED").exists():
        from helpers.core import save_steps

        shutil.rmtree(root, ignore_errors=True)
        save_steps(root, [1, 2]).close()
    return root


def _trial(report: Report, env: Env, option: str, value: str, trial: str) -> None:
    ck = env.work / "ck"
    extra: tuple[Path, ...] = ()
    if option in ("--resume-from", "--branch"):
        root = _resume_root(env)
        ck = root
        before = _written(root)
        branch = env.work / f"branch{value}"
        argv, cwd = _argv(env, root, option, value if option == "--resume-from" else str(branch))
        if option == "--branch":
            argv = argv[:2] + ["--resume-from", "1"] + argv[2:]
        env.reset()
        res = _invoke(env, argv, cwd)
        report.trials += 1
        report.check(res.exit_code != 0, trial, f"accepted (exit 0): {(res.output or '')[-300:]}")
        report.check(not env.calls.exists(), trial, "the fake sbatch was called")
        report.check(_written(root) == before, trial, "files under the checkpoint root changed")
        report.check(not branch.exists(), trial, "the refused --branch root was created")
        for p in env.work.iterdir():
            if p.name.startswith("branch"):
                shutil.rmtree(p, ignore_errors=True)
        return
    argv, cwd = _argv(env, ck, option, value)
    _refused(report, trial, env, ck, argv, cwd, extra)


UNICODE_BREAKS = ("\u2028", "\u2029", "\u0085")  # line breaks to str.splitlines(), not to bash


def _unicode(report: Report, env: Env) -> None:
    """Separators that are not newlines to bash or sbatch, but are to Python's str.splitlines():
    the payload must never start a line of the submitted script."""
    for sep in (*UNICODE_BREAKS, "\u3000", "\ufeff"):
        for option in ("sbatch-value", "--ckpt-dir", "script-arg", "--job-name"):
            env.reset()
            ck = env.work / "ck"
            shutil.rmtree(ck, ignore_errors=True)
            payload = "touch PWNED #"
            argv, cwd = _argv(env, ck, option, sep + payload)
            res = _invoke(env, argv, cwd)
            report.trials += 1
            trial = f"unicode {sep!r} in {option}"
            if res.exit_code == 0:
                text = env.calls.read_bytes() if env.calls.exists() else b""
                bad = [ln for ln in text.split(b"\n") if ln.lstrip().startswith(payload.encode())]
                report.check(not bad, trial, f"the payload became its own line: {bad}")
                report.count_stat("unicode_accepted_harmless")
            else:
                report.count_stat("unicode_refused")
            shutil.rmtree(ck, ignore_errors=True)


def _argv_verbatim(report: Report, env: Env, rng: random.Random) -> None:
    from slurmresume.job.config import JobSpec
    from slurmresume.job.node import torchrun_command
    from slurmresume.job.submit import preview

    for n in range(40):
        args = tuple(rng.sample(ARGV_HOSTILE, rng.randrange(1, 6))) if n else tuple(ARGV_HOSTILE)
        spec = JobSpec(script=EXAMPLE, script_args=args, ckpt_dir=env.work / "ck-argv", log_dir=env.work / "logs-argv")
        trial = f"argv {args!r}"
        report.trials += 1
        for cmd in (torchrun_command(spec, nnodes=1, endpoint=None, rdzv_id="x"),
                    torchrun_command(spec, nnodes=2, endpoint="h:1", rdzv_id="7"), preview(spec).torchrun):
            report.check(isinstance(cmd, list) and all(isinstance(a, str) for a in cmd), trial, f"not a list: {cmd!r}")
            report.check(tuple(cmd[-len(args):]) == args and cmd[-len(args) - 1] == str(EXAMPLE), trial,
                         f"arguments not verbatim at the end: {cmd!r}")
        text = preview(spec).sbatch_script
        leaked = [a for a in args if len(a) > 2 and a in text and a not in ("--lr=3e-4",)]
        report.check(not leaked, trial, f"script arguments inside the sbatch script: {leaked}")
    shutil.rmtree(env.work / "logs-argv", ignore_errors=True)


def _real_process(report: Report, env: Env) -> None:
    """A few trials through a real process (argv cannot carry NUL; the others can)."""
    ck = env.work / "ck-real"
    for option, ch in (("--job-name", "\n"), ("sbatch-value", "\r"), ("script-arg", "\x1b"), ("--partition", "\t")):
        env.reset()
        shutil.rmtree(ck, ignore_errors=True)
        argv, _ = _argv(env, ck, option, ch + "#SBATCH --wrap=touch PWNED")
        proc = subprocess.run([sys.executable, "-m", "slurmresume", *argv], capture_output=True, text=True,
                              cwd=str(env.work), env={**os.environ, "PATH": env.path}, timeout=120)
        report.trials += 1
        trial = f"real process {option} {ch!r}"
        report.check(proc.returncode == 1 and proc.stderr.startswith("error:") and proc.stderr.count("\n") == 1,
                     trial, f"exit {proc.returncode}, stderr {proc.stderr[-300:]!r}")
        report.check(not env.calls.exists() and not ck.exists(), trial, "sbatch called or files written")


def run(report: Report, work: Path) -> None:
    seed, count = report.seed, report.count
    rng = random.Random(seed)
    env = Env(work)
    # positive control: a clean submit reaches the fake sbatch, once, and writes the event log
    ck = work / "ck"
    argv, cwd = _argv(env, ck, "--job-name", "clean")
    env.reset()
    res = _invoke(env, argv, cwd)
    calls = env.calls.read_text() if env.calls.exists() else ""
    ok = res.exit_code == 0 and calls.count("ARGV ") == 1 and (ck / "events.jsonl").exists()
    if not report.check(ok, "control", f"a clean submit did not reach the fake sbatch: {res.output[-400:]} {calls[:200]}"):
        return
    report.stats["control_sbatch_lines"] = len(calls.splitlines())
    shutil.rmtree(ck, ignore_errors=True)
    for option in OPTIONS:
        for ch in CONTROLS:
            _trial(report, env, option, ch + PAYLOADS[0], f"{option} {ch!r}")
    report.stats["matrix_trials"] = report.trials
    for t in range(count):
        option, ch = rng.choice(OPTIONS), rng.choice(CONTROLS)
        payload = rng.choice(PAYLOADS)
        pos = rng.choice(["start", "middle", "end"])
        value = {"start": ch + payload, "middle": payload[:3] + ch + payload[3:], "end": payload + ch}[pos]
        _trial(report, env, option, value, f"fuzz#{t} seed {seed}: {option} {value!r}")
    _unicode(report, env)
    _argv_verbatim(report, env, rng)
    _real_process(report, env)

