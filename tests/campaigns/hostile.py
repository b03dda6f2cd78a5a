"""Campaign 5: hostile checkpoints.

Part A: the corpus of tests/hostile/corpus.py (path traversal and absolute names, symlinks and
FIFOs in place of files, safetensors headers claiming huge sizes, deep / enormous / duplicate-key
JSON, NaN and absurd sizes, a pickle posing as the shard and stray pickles next to it, hostile
event logs, locks and .inprogress notes). Part B (--count trials): seeded structural fuzzing: a
random value deep in the manifest, the shard header or the skeleton replaced by a hostile one
(huge or negative numbers, wrong types, paths, NUL bytes, deep nesting), with checksums and
marker re-computed so that only structural validation stands in the way.

Each case runs in a forked child (an alarm fails it after 30 s: nothing may block) that does
everything a user could: restore (default and verify=True), inspect_dir, the loader's own reads,
list / find_latest / status / verify / a prune plan, and the CLI (verify --all, status --json,
latest, prune --dry-run, inspect, export) in-process. It records, with audit hooks:
  open               every path opened: none may resolve into the decoy `outside/` directory,
                     and no planted pickle (x.pt, .bin, .metadata) is ever opened
  pickle.find_class  must never fire (nothing is unpickled), nor os.system / os.exec* /
                     subprocess other than Slurm's squeue/sacct that `status` runs
and the RSS growth (ru_maxrss of the child minus its RSS at fork). A case passes when: refused
cases fall back to step 1 with a warning naming step 2 and a one-line refusal containing the
expected text; ignored files are never opened and step 2 restores exactly; bounded cases stay
within their memory budget; hostile roots neither hang nor raise anything but a one-line error.
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import sys
import traceback
from pathlib import Path
from typing import Any

from campaigns.harness import LogCapture, Report, fork_call, tail
from campaigns.harness import where as _where

NAME = "hostile"
DEFAULT_COUNT = 1000  # fuzz trials (the corpus always runs whole)
SHARD = "rank-00000-of-00001.safetensors"
PICKLES = ("x.pt", "pytorch_model.bin", ".metadata")
# A battery that runs this long is blocked (a FIFO read, a lock): generous, since its CLI calls are
# subprocesses and a starved 2-core machine makes each take seconds (30 s failed under load).
BLOCKED_S = 90

_rec: dict[str, Any] = {"on": False, "opens": [], "events": []}


def _audit(event: str, args: tuple[Any, ...]) -> None:
    if not _rec["on"]:
        return
    if event == "open":
        path, _mode, flags = args
        if isinstance(path, (str, bytes, os.PathLike)):
            _rec["opens"].append((os.fsdecode(path), flags if isinstance(flags, int) else 0))
    elif event in ("pickle.find_class", "os.system", "os.exec", "os.posix_spawn", "os.spawn", "os.fork"):
        _rec["events"].append(f"{event} {args!r}"[:300])
    elif event == "subprocess.Popen":
        exe = os.path.basename(os.fsdecode(args[0])) if args and args[0] else ""
        argv = args[1] if len(args) > 1 else None
        first = os.path.basename(os.fsdecode(argv[0])) if argv else exe
        if first not in ("squeue", "sacct", "scontrol"):
            _rec["events"].append(f"subprocess {argv!r}"[:300])


def _status_kib(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    return 0


def _reset_peak() -> int:
    """Reset this process's peak RSS (a forked child inherits its parent's peak) and return the
    current RSS in bytes; `_peak()` is then the high-water mark since this call."""
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")
    return _status_kib("VmRSS") * 1024


def _peak() -> int:
    return _status_kib("VmHWM") * 1024


# A refusal by design, not a crash: the checkpoint does not match the script's live state
# (a key it lacks, a tensor of another shape); restore says so before touching anything.
MISFIT = ("ConfigError: checkpoint has no entry for state key", "ConfigError: the checkpoint does not fit state[")


def _cli(args: list[str]) -> dict[str, Any]:
    from typer.testing import CliRunner

    from slurmresume.cli import app

    res = CliRunner().invoke(app, args)
    out: dict[str, Any] = {"args": args[:2], "code": res.exit_code}
    if res.exception is not None and not isinstance(res.exception, SystemExit):
        out["crash"] = "".join(traceback.format_exception_only(type(res.exception), res.exception)).strip()
    err = (getattr(res, "stderr", "") or "") + res.output
    out["error_line"] = next((ln for ln in err.splitlines() if ln.startswith("error:")), "")
    return out


def _battery(root: Path, step2: Path, scratch: Path) -> dict[str, Any]:
    """Everything a user could run against a root. Returns what happened (plain JSON)."""
    from helpers.core import model_equal, tiny_model, tiny_state

    from slurmresume import Checkpointer
    from slurmresume.checkpoint.jsonenc import loads
    from slurmresume.checkpoint.manifest import read_manifest
    from slurmresume.checkpoint.shard import SKELETON_KEY
    from slurmresume.checkpoint.shardread import load_tensors, read_header
    from slurmresume.checkpoint.state import unflatten_into
    from slurmresume.checkpoint.store import find_latest, inspect_dir, list_checkpoints
    from slurmresume.errors import ConfigError, CorruptCheckpointError, UnreadableCheckpointError
    from slurmresume.retention import RetentionPolicy, plan_prune, scan
    from slurmresume.tools.status import compute_status, verify_checkpoints

    r: dict[str, Any] = {"crashes": []}

    def guard(what: str, fn: Any) -> Any:
        try:
            return fn()
        except (CorruptCheckpointError, UnreadableCheckpointError, ConfigError) as exc:  # refused, typed
            return exc
        except Exception as exc:  # noqa: BLE001
            r["crashes"].append(f"{what}: {type(exc).__name__}: {str(exc)[:300]} [{_where(exc)}]")
            return exc

    for verify in (False, True):
        state = tiny_state(987654)
        with LogCapture() as logs:
            try:
                with Checkpointer(root, handle_signals=False) as ck:  # closed: an open one keeps its lease beating into root
                    got = ck.restore(state, verify=verify)
                r[f"restore_{verify}"] = got
                want = tiny_state(got) if got else tiny_state(987654)
                r[f"data_ok_{verify}"] = bool(model_equal(state["model"], tiny_model(got if got else 987654))
                                              and state["step"] == want["step"] and state["extra"] == want["extra"])
            except Exception as exc:  # noqa: BLE001
                r[f"restore_{verify}"] = f"{type(exc).__name__}: {exc}"
                r[f"restore_where_{verify}"] = _where(exc)
        r[f"warnings_{verify}"] = logs.messages[:10]

    # the loader's own reads, in order: the first refusal
    def reads() -> None:
        m = read_manifest(step2, 2)
        s = m.shards[0]
        read_header(step2, s["file"], s["bytes"])
        tensors, meta, _ = load_tensors(step2, s["file"], s["bytes"])
        unflatten_into(tiny_state(0), loads(meta.get(SKELETON_KEY, ""), "skeleton"), tensors, strict=False)

    refusal = guard("reads", reads)
    r["refusal"] = f"{type(refusal).__name__}: {refusal}" if isinstance(refusal, Exception) else None
    r["refusal_is_checkpoint_error"] = isinstance(refusal, CorruptCheckpointError)
    r["refusal_is_unreadable"] = isinstance(refusal, UnreadableCheckpointError)
    r["inspect_complete"] = bool(getattr(guard("inspect_dir", lambda: inspect_dir(2, step2, verify=True)),
                                         "complete", False))
    guard("list_checkpoints", lambda: list_checkpoints(root, verify=True))
    guard("find_latest", lambda: find_latest(root, verify=True))
    guard("status", lambda: compute_status(root, verify=True))
    guard("verify", lambda: verify_checkpoints(root, every=True))
    guard("prune plan", lambda: plan_prune(scan(root), RetentionPolicy(keep=1, remove_incomplete_older_than=0), 0))
    cli = [
        ["verify", "--all", "--ckpt-dir", str(root)],
        ["status", "--json", "--ckpt-dir", str(root)],
        ["latest", "--ckpt-dir", str(root)],
        ["prune", "--keep", "1", "--dry-run", "--ckpt-dir", str(root)],
        ["inspect", "2", "--tensors", "--ckpt-dir", str(root)],
        ["export", "2", "--out", str(scratch / "export.safetensors"), "--ckpt-dir", str(root)],
    ]
    r["cli"] = [_cli(a) for a in cli]
    return r


def _child(c: Any, out: Path) -> None:
    scratch = c.root.parent / "scratch"
    scratch.mkdir(exist_ok=True)
    signal.signal(signal.SIGALRM, lambda *a: (_ for _ in ()).throw(TimeoutError(f"blocked for {BLOCKED_S} s")))
    signal.alarm(BLOCKED_S)
    start = _reset_peak()
    _rec.update(on=True, opens=[], events=[])
    try:
        res = _battery(c.root, c.step2, scratch)
    except BaseException as exc:  # noqa: BLE001
        res = {"crashes": [f"battery: {type(exc).__name__}: {exc}"]}
    _rec["on"] = False
    signal.alarm(0)
    res["growth"] = _peak() - start
    res["events"] = _rec["events"]
    outside = c.outside.resolve()
    bad, pickles = [], []
    for path, flags in _rec["opens"]:
        target = Path(os.path.abspath(path)) if flags & os.O_NOFOLLOW else Path(os.path.realpath(path))
        if target.is_relative_to(outside):
            bad.append(str(target))
        if target.name in PICKLES:
            pickles.append(str(target))
    res["opened_outside"] = sorted(set(bad))
    res["opened_pickles"] = sorted(set(pickles))
    res["pwned"] = (c.outside / "PWNED").exists()
    out.write_text(json.dumps(res, default=str))


def _judge(report: Report, c: Any, res: dict[str, Any]) -> None:
    t = f"{c.name} ({c.expect})"
    report.check(not res.get("crashes"), t, f"crashed: {res.get('crashes')}")
    report.check(not res.get("events"), t, f"executed or unpickled: {res.get('events')}")
    report.check(not res.get("pwned"), t, "the planted pickle ran")
    report.check(not res.get("opened_outside"), t, f"opened outside the step directory: {res.get('opened_outside')}")
    report.check(not res.get("opened_pickles"), t, f"opened a planted pickle: {res.get('opened_pickles')}")
    report.check(res.get("growth", 0) <= c.max_growth, t,
                 f"RSS grew by {res.get('growth', 0) >> 20} MiB (budget {c.max_growth >> 20} MiB)")
    mib = round(res.get("growth", 0) / 2**20, 1)
    if c.name.startswith("fuzz#"):
        report.stats["fuzz_max_rss_growth_mib"] = max(report.stats.get("fuzz_max_rss_growth_mib", 0), mib)
    else:
        report.stats.setdefault("max_rss_growth_mib", {})[c.name] = mib
    for call in res.get("cli", []):
        report.check("crash" not in call, t, f"CLI {' '.join(call['args'])} crashed: {call.get('crash')}")
        # `status` exits 3 (at risk: a corrupt checkpoint) or 4 (stopped) by design (health.py)
        allowed = (0, 1, 3, 4) if call["args"][:1] == ["status"] else (0, 1)
        report.check(call["code"] in allowed, t, f"CLI {' '.join(call['args'])} exit {call['code']}")
    if c.expect == "refused":
        for v in (False, True):
            report.check(res.get(f"restore_{v}") == 1 and bool(res.get(f"data_ok_{v}")), t,
                         f"restore(verify={v}) gave {res.get(f'restore_{v}')!r}, expected a fall back to step 1")
            named = [w for w in res.get(f"warnings_{v}", []) if str(c.step2) in w or "step 2 " in w]
            report.check(bool(named), t, f"no warning names step 2: {res.get(f'warnings_{v}')}")
        ref = res.get("refusal") or ""
        report.check(res.get("refusal_is_checkpoint_error", False), t, f"not refused as a checkpoint error: {ref}")
        report.check(c.message in ref, t, f"refusal does not say {c.message!r}: {ref}")
        report.check("\n" not in ref, t, f"refusal is not one line: {ref!r}")
        if not c.load_time:
            report.check(not res.get("inspect_complete"), t, "inspect_dir calls it complete")
        bad = [call for call in res.get("cli", []) if call["args"][0] == "verify"]
        report.check(all(call["code"] == 1 and call["error_line"] for call in bad) or not c.message, t,
                     f"verify --all did not exit 1 with an error line: {bad}")
    elif c.expect == "unreadable":
        for v in (False, True):
            got = res.get(f"restore_{v}")
            report.check(isinstance(got, str) and got.startswith("UnreadableCheckpointError") and c.message in got, t,
                         f"restore(verify={v}) gave {got!r}, expected a refusal: unreadable by this version")
        ref = res.get("refusal") or ""
        report.check(res.get("refusal_is_unreadable", False), t, f"not refused as unreadable by this version: {ref}")
        report.check(c.message in ref and "\n" not in ref, t, f"refusal does not say {c.message!r} in one line: {ref}")
        report.check(not res.get("inspect_complete"), t, "inspect_dir calls it complete")
    elif c.expect == "ignored":
        for v in (False, True):
            report.check(res.get(f"restore_{v}") == 2 and bool(res.get(f"data_ok_{v}")), t,
                         f"restore(verify={v}) gave {res.get(f'restore_{v}')!r}, expected step 2 intact")
    elif c.expect == "root":
        for v in (False, True):
            got = res.get(f"restore_{v}")
            ok = got == 2 or (isinstance(got, str) and "events.jsonl is not a regular file" in got)
            report.check(ok, t, f"restore(verify={v}) gave {got!r}")
            if isinstance(got, str):
                report.count_stat("root_refused_with_error")
    else:  # bounded
        for v in (False, True):
            report.check(res.get(f"restore_{v}") in (1, 2), t, f"restore(verify={v}) gave {res.get(f'restore_{v}')!r}")


def _control(work: Path) -> dict[str, Any]:
    """The recorders work: an open in `outside/` and an unpickling are both seen."""
    import collections
    import pickle

    outside = work / "control-outside"
    outside.mkdir(exist_ok=True)
    (outside / "decoy").write_text("x")
    out = work / "control.json"

    def child() -> None:
        _rec.update(on=True, opens=[], events=[])
        open(outside / "decoy").close()
        pickle.loads(pickle.dumps(collections.OrderedDict(a=1)))
        _rec["on"] = False
        out.write_text(json.dumps({"opens": [p for p, _ in _rec["opens"]], "events": _rec["events"]}))

    fork_call(child)
    seen: dict[str, Any] = json.loads(out.read_text())
    return seen


def corpus(report: Report, work: Path) -> None:
    from hostile.corpus import build

    ctl = _control(work)
    report.check(any(p.endswith("decoy") for p in ctl["opens"]) and any("pickle.find_class" in e for e in ctl["events"]),
                 "control", f"the audit hooks do not see an open / an unpickling: {ctl}")

    cases = build(work / "corpus")
    # warm up: every import and lazy path once, outside the recording
    warm = work / "warm"
    shutil.copytree(work / "corpus" / "_pristine", warm / "root")
    _battery(warm / "root", warm / "root" / "step_000000002", warm)
    for c in cases:
        res = _run_child(report, c, work / f"{c.name}.json", work, "corpus_cases")
        if res is not None:
            _judge(report, c, res)


def _run_child(report: Report, c: Any, out: Path, work: Path, stat: str) -> dict[str, Any] | None:
    """One trial: the battery in a forked child, its results read back (None: it failed)."""
    out.unlink(missing_ok=True)
    code, sig = fork_call(lambda: _child(c, out), timeout=BLOCKED_S + 60, out=work / "child.log")
    report.trials += 1
    report.count_stat(stat)
    if code != 0 or not out.exists():
        report.fail(c.name, f"child ended {code}/{sig}: {tail(work / 'child.log')}")
        return None
    res: dict[str, Any] = json.loads(out.read_text())
    return res


# -- part B: structural fuzzing ---------------------------------------------------------------

HOSTILE_VALUES: list[Any] = [
    -1, 0, 2**63, 2**70, -(2**63), 1.5, 1e308, True, None, "", "..", "../../outside/x", "/etc/passwd",
    "a\x00b", "x" * 10000, [], {}, [[[[[[[[[[[]]]]]]]]]]], {"__tensor__": "nope"}, {"__ndarray__": 1},
    {"__dict__": [[[1], 2]]}, {"__bytes__": "!!!"}, {"__float__": "zero"}, {"__tuple__": 5},
    {"__npscalar__": ["|O", 1]}, [2**40, 2**40], "F64", "rank-00000-of-00001.safetensors",
]


def _paths(node: Any, prefix: tuple[Any, ...] = ()) -> list[tuple[Any, ...]]:
    out = [prefix]
    if isinstance(node, dict):
        for k, v in node.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(node, list):  # long lists (the RNG key) would swamp the draw: a few items
        idx = range(len(node)) if len(node) <= 8 else [0, 1, len(node) - 1]
        for i in idx:
            out += _paths(node[i], prefix + (i,))
    return out


def _set(node: Any, path: tuple[Any, ...], value: Any) -> Any:
    if not path:
        return value
    node[path[0]] = _set(node[path[0]], path[1:], value)
    return node


def _fuzz_one(rng: random.Random, c: Any) -> str:
    from hostile import corpus as hc

    where = rng.choice(["manifest", "header", "skeleton"])
    value = rng.choice(HOSTILE_VALUES)
    if where == "manifest":
        m = hc._manifest(c.step2)
        path = rng.choice(_paths(m)[1:])
        _set(m, path, value)
        hc._write_manifest(c.step2, json.dumps(m, separators=(",", ":")).encode())
    else:
        header, body = hc._split((c.step2 / SHARD).read_bytes())
        if where == "header":
            path = rng.choice(_paths(header)[1:])
            header = _set(header, path, value)
        else:
            sk = json.loads(header["__metadata__"]["slurmresume.skeleton"])
            path = rng.choice(_paths(sk)[1:])
            sk = _set(sk, path, value)
            header["__metadata__"]["slurmresume.skeleton"] = json.dumps(sk, separators=(",", ":"))
        hc._replace_shard(hc._join(header if isinstance(header, dict) else json.dumps(header).encode(), body), c)
    return f"{where} {'/'.join(map(str, path))} := {json.dumps(value)[:40]}"


def fuzz(report: Report, work: Path, seed: int, count: int) -> None:
    from hostile.corpus import Case, pristine

    rng = random.Random(seed)
    src = pristine(work / "corpus")
    for t in range(count):
        c = Case(f"fuzz#{t}", "bounded")
        base = work / "fuzz"
        shutil.rmtree(base, ignore_errors=True)
        c.root, c.outside = base / "root", base / "outside"
        shutil.copytree(src, c.root)
        c.outside.mkdir(parents=True)
        try:
            desc = _fuzz_one(rng, c)
        except (TypeError, KeyError, IndexError, ValueError) as exc:
            report.count_stat("fuzz_mutation_not_applicable")
            del exc
            continue
        c.name = f"fuzz#{t} seed {seed}: {desc}"
        res = _run_child(report, c, work / "fuzz.json", work, "fuzz_trials")
        if res is None:
            continue
        for v in (False, True):
            got = res.get(f"restore_{v}")
            if isinstance(got, str) and got.startswith(MISFIT):
                # by design (state.validate_skeleton / check_fits): a checkpoint that does not match
                # the script is the script's mismatch, not corruption: refused before any change
                report.count_stat("fuzz_refused_misfit")
                res[f"restore_{v}"], res[f"data_ok_{v}"] = 1, True
        _judge(report, c, res)


def run(report: Report, work: Path) -> None:
    import torch

    torch.set_num_threads(1)
    sys.addaudithook(_audit)
    corpus(report, work)
    fuzz(report, work, report.seed, report.count)

