"""The layout's rules, checked from the source (scripts/import_graph.py): no import-time cycle,
no module importing a role above its own, the public names pinned, and `import slurmresume`
as cheap as its docstring says."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import slurmresume

REPO = Path(__file__).resolve().parents[1]


def _import_graph():  # noqa: ANN202
    spec = importlib.util.spec_from_file_location("import_graph", REPO / "scripts" / "import_graph.py")
    assert spec and spec.loader
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_no_import_time_cycle_and_no_upward_import() -> None:
    ig = _import_graph()
    top, lazy, _, _ = ig.graph()
    assert ig.cycles(top) == []
    assert ig.violations({m: top[m] | lazy[m] for m in top}) == []


def test_no_private_name_is_used_outside_its_module() -> None:
    assert _import_graph().private_imports() == []


def test_the_cycle_finder_finds_a_cycle() -> None:
    ig = _import_graph()
    assert ig.cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    assert ig.violations({"checkpoint.store": {"tools.status"}}) == ["checkpoint.store (base) imports tools.status (tools)"]


def test_no_cycle_even_through_deferred_imports() -> None:
    """An import inside a function cannot fail at import time, but a circle through one still
    ties two modules together (mirror.commands <-> cli.commands_ckpt was one, issue 31)."""
    ig = _import_graph()
    top, lazy, _, _ = ig.graph()
    assert ig.cycles({m: top[m] | lazy[m] for m in top}) == []


def test_a_mirror_module_importing_the_cli_is_a_violation() -> None:
    """mirror/ sits below the command line, every module in it: none may be counted as cli so
    that its imports of cli/ pass (mirror/commands.py was, issue 31)."""
    ig = _import_graph()
    top, _, _, _ = ig.graph()
    assert ig.violations({"mirror.commands": {"cli.commands_ckpt"}}) == [
        "mirror.commands (base) imports cli.commands_ckpt (cli)"]
    assert [m for m in top if m.startswith("mirror") and ig.role(m) == "cli"] == []


def test_public_names_are_pinned() -> None:
    assert slurmresume.__all__ == sorted([
        "CheckpointError", "CheckpointInfo", "Checkpointer", "ConfigError", "CorruptCheckpointError",
        "DDPBuckets", "EXIT_PREEMPTED", "EXIT_TERMINATED", "NoCheckpointError", "NotPermittedError",
        "PeerReadError", "RankFailedError", "RetentionPolicy", "ResumableSampler", "RootOwnedError",
        "SavePolicy", "SaveError", "SeededDataset", "SlurmError", "SlurmResumeError",
        "UnreadableCheckpointError", "UnsafeCheckpointError", "apply_policy", "compare_checkpoints",
        "find_latest", "ignore_in_worker", "list_checkpoints", "sample_seed"])
    for name in slurmresume.__all__:
        assert getattr(slurmresume, name) is not None


def test_every_public_error_class_is_exported_and_dir_shows_only_the_api() -> None:
    """A user catches what the library raises by its public name (#48.6): every class of the one
    hierarchy (errors.__all__, and ownership's RootOwnedError) is exported; `dir(slurmresume)` is
    the API, not the module's own imports and bookkeeping (Any, TYPE_CHECKING, time, IMPORTED_AT)."""
    from slurmresume import errors, ownership

    raised = set(errors.__all__) | {"RootOwnedError"}
    assert raised <= set(slurmresume.__all__), sorted(raised - set(slurmresume.__all__))
    assert slurmresume.RootOwnedError is ownership.RootOwnedError
    assert issubclass(slurmresume.RootOwnedError, slurmresume.SlurmResumeError)
    shown = [n for n in dir(slurmresume) if not n.startswith("__")]
    assert shown == slurmresume.__all__, sorted(set(shown) ^ set(slurmresume.__all__))


def test_import_slurmresume_loads_no_torch_typer_rich() -> None:
    probe = ("import sys, slurmresume\n"
             "print(' '.join(m for m in ('torch', 'typer', 'rich', 'submitit', 'numpy') if m in sys.modules))")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == []


def test_checkpoint_package_has_no_circle_even_through_deferred_imports() -> None:
    """calibrate measures through writer; writer never asks calibrate (open_sink joins them)."""
    ig = _import_graph()
    top, lazy, _, _ = ig.graph()
    both = {m: top[m] | lazy[m] for m in top}
    assert [c for c in ig.cycles(both) if any(m.startswith("checkpoint.") for m in c)] == []


def test_event_names_are_spelled_only_in_events_py() -> None:
    """The event log is read back for decisions (the hang watch's save budget, the auto save
    interval, a pull's rate, the lead warning): its names are one vocabulary, declared in
    events.py (#48.2). No string passed to an event writer or compared with an event's name
    outside events.py, through a variable or a module's collection."""
    assert _import_graph().event_name_literals() == []


def test_the_event_name_scan_finds_each_way_of_spelling_a_name() -> None:
    """Each way a name was spelled in place before #48.2 is found; other strings pass."""
    import ast

    ig = _import_graph()
    declared = ig.declared_events()
    assert declared["save_committed"] == "EV_SAVE_COMMITTED" and len(declared) == len(set(declared.values()))
    from slurmresume import events

    assert set(declared) == events.NAMES and all(getattr(events, c) == n for n, c in declared.items())
    code = {
        "job.a": """
from ..events import try_append_event
ENDS = {"gave_up", "stopped"}
def write(root, action, kind):
    try_append_event(root, "save_committed", seconds=1)      # 1 a writer's name
    terminal = {"finish": "finished"}.get(action)            # 2 a mapping to a name
    try_append_event(root, terminal)
    if kind == "failed":                                     # a run's outcome kind: not an event
        pass
def read(events, e):
    last = events[-1]["event"] if events else None
    kinds = {x["event"]: x for x in events}
    return (e.get("event") == "started",                     # 3 a comparison
            last in ("held", "hang"),                        # 4, 5 through a variable, a tuple
            e["event"] in ENDS,                              # 6, 7 a module's collection
            "run_ended" in kinds, kinds["restored"],         # 8, 9 a dict keyed by names
            str(e.get("event", "")).startswith("mirror_"),   # a prefix: passes
            e.get("kind") == "preempt")                      # another field: passes
""",
        "tools.b": """
from ..job.a import ENDS
def f(e):
    \"\"\"A docstring that says "save_committed" passes.\"\"\"
    name = e.get("event")
    self._event("mirror_uploaded")                           # 10 the mirror's writer
    return name in ENDS or name.startswith("hang")          # (ENDS again) 11 a method of a name
""",
    }
    files = {m: (False, ast.parse(c), 0) for m, c in code.items()}
    found = [b.split(": ")[1] for b in ig.event_name_literals(files)]
    assert sorted(found) == sorted(repr(n) for n in ["save_committed", "finished", "started", "held", "hang",
                                                      "gave_up", "stopped", "run_ended", "restored",
                                                      "mirror_uploaded", "hang"]), found


def test_job_imports_nothing_from_train() -> None:
    """Issue 48, item 3: the launcher side (job/) reads the formats it shares with the ranks from
    base modules (beatfile.py: the heartbeat record; contract.py: signals, the failure-save
    directory), never from the worker's package, deferred imports included."""
    ig = _import_graph()
    top, lazy, _, _ = ig.graph()
    crossing = sorted(f"{m} -> {d}" for m in top if m.startswith("job.")
                      for d in top[m] | lazy[m] if d == "train" or d.startswith("train."))
    assert crossing == []


def test_every_root_is_reached_through_the_storage_interface() -> None:
    """Issue 48, item 4: `status`, `prune`, `latest`, `verify`, restore and the mirror reach a
    checkpoint root through storage.py (a `DirRoot` or a `BucketRoot`, picked once by
    `open_root`); nothing outside the storage layer imports the bucket tier, scans a directory
    root with the store's own readers, or tests a URL's scheme itself."""
    assert _import_graph().storage_bypasses() == []


def test_the_storage_scan_finds_each_way_around_the_interface() -> None:
    import ast

    ig = _import_graph()
    code = {
        "cli.a": """
from ..storage import bucketsteps                             # 1 the bucket tier
from ..checkpoint.store import find_latest, inspect_dir       # 2 a directory root's scan (inspect_dir: one step, passes)
from ..storage.s3 import is_s3_url                             # 3 the scheme test imported
def f(root, s3, loc):
    from ..checkpoint import store
    store.list_checkpoints(root)                              # 4 through the module
    return is_s3_url(root)                                    # 5 the scheme test called
""",
        "tools.b": """
from ..storage import DirRoot, is_bucket, open_root
def g(value):
    return open_root(value) if is_bucket(value) else DirRoot(value).latest()
""",
        "storage": "from .s3 import is_s3_url\n",
    }
    files = {m: (False, ast.parse(c), 0) for m, c in code.items()}
    found = ig.storage_bypasses(files)
    assert [b.split(":")[1] for b in found] == ["2", "3", "4", "7", "8"], found
    assert all(b.startswith("cli.a:") for b in found)


def test_no_dict_crosses_from_checkpoint_to_train() -> None:
    """Issue 48, item 1: a save's messages are typed where they are made. checkpoint/commit.py's
    prepare, write_rank and commit return (and commit takes) the records of checkpoint/reports.py,
    and no caller decodes a dict they returned or encodes records into their arguments; a record
    becomes JSON only at a collective or a file."""
    assert _import_graph().dict_crossings() == []


def test_the_dict_crossing_scan_finds_each_way_of_crossing() -> None:
    import ast

    ig = _import_graph()
    code = {
        "checkpoint.commit": """
def prepare(root, step) -> dict[str, Any]: ...                   # 1 returns a dict
def write_rank(root, step) -> WriteReport: ...
def commit(root, reports: list[dict[str, Any]]) -> SaveOutcome: ...   # 2 takes dicts
def extra(root): ...                                             # 3 unannotated: Any
def _private(root) -> dict: ...
""",
        "train.a": """
from ..checkpoint import commit as _commit
from ..checkpoint.commit import prepare
from ..checkpoint.fsio import write_durable
def f(root, reports, outcome):
    d = PrepareDecision.from_json(prepare(root, 1) if root else prepare(root, 2))   # 4 decoded
    _commit.commit(root, [r.to_json() for r in reports])                           # 5 encoded
    write_durable(root, outcome.to_json(), "outcome")                               # a file: passes
    return WriteReport.from_json(group.broadcast_json(d.to_json()))                 # a collective: passes
""",
    }
    files = {m: (False, ast.parse(c), 0) for m, c in code.items()}
    found = ig.dict_crossings({**files, "checkpoint.fsio": (False, ast.parse(""), 0)})
    assert [b.split(": ")[0] for b in found] == [
        "checkpoint.commit:2", "checkpoint.commit:4", "checkpoint.commit:5", "train.a:6", "train.a:7"], found


def test_storage_never_imports_the_mirror() -> None:
    """Issue 48: the storage interface is the base a bucket is read through (storage.bucketsteps,
    .bucketcommit, .s3); the mirror copies onto it and imports it, never the other way."""
    import ast

    ig = _import_graph()
    assert ig.storage_imports_mirror() == []
    code = {"storage.bucket": "from ..mirror import remote\ndef f():\n    from ..mirror.s3 import client\n",
            "mirror.remote": "", "mirror.s3": "", "mirror": "", "storage": "from .bucket import BucketRoot\n"}
    files = {m: (m in ("mirror", "storage"), ast.parse(c), 0) for m, c in code.items()}
    assert ig.storage_imports_mirror(files) == ["storage.bucket:1: imports mirror.remote",
                                                "storage.bucket:3: imports mirror.s3"]


def test_the_box_geometry_of_a_reshard_opens_no_file() -> None:
    """Issue 48, item 3: what a saved DTensor is (checkpoint/dtensorspec.py), the box each rank
    owns and which saved pieces hold it (boxes.py, sharding.py, placement.py) import nothing that
    reads a file; the verified reads are reshard.py's. torch only inside a function."""
    import ast

    ig = _import_graph()
    assert ig.geometry_imports() == []
    code = {"checkpoint.boxes": "import os\nfrom .shard import ITEMSIZE, open_sink\nfrom .shardread import pread_exact\n"
                                "import torch\ndef f():\n    import torch.distributed\n    from .sharding import cover\n",
            "checkpoint.shard": "", "checkpoint.shardread": "", "checkpoint.sharding": ""}
    files = {m: (False, ast.parse(c), 0) for m, c in code.items()}
    assert ig.geometry_imports(files) == ["checkpoint.boxes:1: imports os", "checkpoint.boxes:2: imports .shard",
                                          "checkpoint.boxes:3: imports .shardread", "checkpoint.boxes:4: imports torch"]


def test_scripts_have_no_circle(tmp_path: Path) -> None:
    """What two benches share lives in a third both import (bench_world.py), so no script imports
    one that imports it back (a deferred import counts too)."""
    ig = _import_graph()
    assert ig.script_cycles() == []
    (tmp_path / "a.py").write_text("import b\n")
    (tmp_path / "b.py").write_text("def f():\n    from a import x\n")
    (tmp_path / "c.py").write_text("import a\n")
    assert ig.script_cycles(tmp_path) == [["a", "b"]]
