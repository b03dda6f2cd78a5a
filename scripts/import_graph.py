"""Facts about the package's import graph, from the source (ast; nothing is imported):

    python scripts/import_graph.py            # report; exit 1 on a cycle or a layer violation

- cycles among imports that run when a module is imported (module level; an import inside a
  function runs later and is listed separately, it cannot form an import-time cycle);
- layer violations: each module belongs to one role (below); a module may import its own role
  and the roles listed after it, never one listed before it;
- private names crossing modules: `from .x import _name` of a non-module name (each private name
  stays in the module that defines it);
- event names spelled as strings outside events.py (`event_name_literals`: events.py owns them);
- a root reached around the storage interface (`storage_bypasses`: storage.py is the one place
  that tells a bucket from a directory and the one user of the tiers' own readers);
- a save's messages crossing checkpoint/ as dicts (`dict_crossings`: the commit protocol returns
  and takes the records of checkpoint/reports.py; no typed -> dict -> typed trip around a call);
- modules over 300 lines and the 10 longest functions.

Roles, from the top (may import downwards only); the package a module lives in is its role:
  cli      slurmresume/cli/: the command line (app, commands_*, options, render*, shared)
  tools    slurmresume/tools/: read-only tools over a root (status, inspect, export, compare,
           drill, lineage, doctor, plot, health), mirror.fetch
  job      slurmresume/job/: the job side (submit, node loop, launcher, guardian, hang watch, config)
  train    slurmresume/train/: what runs inside the training processes (Checkpointer and its
           helpers), the framework integrations, the mirror's uploader
  base     slurmresume/checkpoint/ (format, commit protocol) and the top-level modules every role
           shares: errors, contract (launcher <-> worker), events, retention, ownership, duration,
           slurm (the one seam that runs Slurm commands), storage (the one storage interface: a
           root on a file system or in a bucket: storage.bucketsteps reads a bucket, storage.s3 is the
           object-store seam); mirror/ (copying a root to a bucket) stands on storage/ and never the other way
"""

from __future__ import annotations

import ast
import functools
import re
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "slurmresume"
ROLES = ["cli", "tools", "job", "train", "base"]


def role(mod: str) -> str:
    """The role of a module: its package (cli/, tools/, job/, train/), else the base."""
    top = mod.split(".")[0]
    if top in ("cli", "tools", "job", "train"):
        return top
    if mod == "__main__":
        return "cli"
    if mod == "mirror.fetch":
        return "tools"
    if mod in ("mirror", "mirror.__main__"):
        return "job"
    if top == "integrations" or mod in ("mirror.hook", "mirror.background"):
        return "train"
    return "base"


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG).with_suffix("")
    parts = [p for p in rel.parts if p != "__init__"]
    return ".".join(parts) or "__init__"


def resolve(mod: str, is_pkg: bool, node: ast.ImportFrom | ast.Import, known: set[str]) -> list[str]:
    """The package modules an import statement names."""
    out: list[str] = []
    if isinstance(node, ast.Import):
        for a in node.names:
            if a.name.startswith("slurmresume."):
                out.append(a.name.removeprefix("slurmresume."))
        return [m for m in out if m in known]
    base_parts = mod.split(".") if mod != "__init__" else []
    if node.level:
        keep = len(base_parts) - node.level + (1 if is_pkg else 0)
        base_parts = base_parts[:max(keep, 0)]
    elif node.module and node.module.startswith("slurmresume"):
        base_parts = []
        node = ast.ImportFrom(module=node.module.removeprefix("slurmresume").lstrip("."), names=node.names, level=1)
    else:
        return []
    base = ".".join(base_parts + ([node.module] if node.module else []))
    for a in node.names:
        cand = f"{base}.{a.name}" if base else a.name
        if cand in known:
            out.append(cand)
        elif base in known:
            out.append(base)
    return sorted(set(out))


@functools.lru_cache(maxsize=1)
def sources() -> dict[str, tuple[bool, ast.Module, int]]:
    """Every module of the package, parsed once: {module: (is a package, its tree, its lines)}."""
    out = {}
    for path in PKG.rglob("*.py"):
        text = path.read_text()
        out[module_name(path)] = (path.name == "__init__.py", ast.parse(text), len(text.splitlines()))
    return out


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, int], list[tuple[int, str]]]:
    files = sources()
    known = set(files)
    top: dict[str, set[str]] = {m: set() for m in files}
    lazy: dict[str, set[str]] = {m: set() for m in files}
    lines: dict[str, int] = {}
    funcs: list[tuple[int, str]] = []
    for mod, (is_pkg, tree, count) in files.items():
        lines[mod] = count
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                funcs.append(((node.end_lineno or node.lineno) - node.lineno + 1, f"{mod}.{node.name}"))
        for node in tree.body:  # module level (incl. inside if/try at module level)
            for sub in ast.walk(node) if not isinstance(node, (ast.FunctionDef, ast.ClassDef)) else []:
                if isinstance(sub, (ast.Import, ast.ImportFrom)):
                    if _under_type_checking(node):
                        continue
                    top[mod].update(d for d in resolve(mod, is_pkg, sub, known) if d != mod)
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                for sub in ast.walk(node):
                    if isinstance(sub, (ast.Import, ast.ImportFrom)):
                        lazy[mod].update(d for d in resolve(mod, is_pkg, sub, known) if d != mod)
    return top, lazy, lines, sorted(funcs, reverse=True)


def private_imports() -> list[str]:
    """`from <package module> import _name` anywhere in the package (at module level or inside a
    function), where `_name` is not a module: a private name used outside its module."""
    files = sources()
    known = set(files)
    bad = []
    for mod, (is_pkg, tree, _) in sorted(files.items()):
        for node in ast.walk(tree):
            if not isinstance(node, ast.ImportFrom):
                continue
            targets = resolve(mod, is_pkg, node, known)
            if not targets:
                continue
            for alias in node.names:
                name = alias.name
                if name.startswith("_") and not name.startswith("__") and not any(
                        t == name or t.endswith("." + name) for t in targets):
                    bad.append(f"{mod} imports {name} from {targets[0]}")
    return bad


# -- the event vocabulary (events.py owns every name) -----------------------------------------
EVENT_WRITERS = {"append_event": 1, "try_append_event": 1, "_event": 0, "on_event": 0}  # the name's position
_WORDLIKE = re.compile(r"[a-z][a-z0-9]*(?:_[a-z0-9]+)*")


def declared_events() -> dict[str, str]:
    """{on-disk name: constant} of events.py's `EV_* = "..."` (read from the source)."""
    tree = ast.parse((PKG / "events.py").read_text())
    return {n.value.value: n.targets[0].id for n in tree.body
            if isinstance(n, ast.Assign) and len(n.targets) == 1 and isinstance(n.targets[0], ast.Name)
            and n.targets[0].id.startswith("EV_") and isinstance(n.value, ast.Constant) and isinstance(n.value.value, str)}


def _is_event(node: ast.AST, evars: set[str]) -> bool:
    """An event's name: `e["event"]`, `e.get("event")`, a variable holding one, `str(...)` of one,
    or a method's result on one (`kinds.keys()`)."""
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and node.slice.value == "event":
        return True
    if isinstance(node, ast.Name):
        return node.id in evars
    if isinstance(node, ast.Call):
        f = node.func
        if isinstance(f, ast.Attribute) and f.attr == "get" and node.args and isinstance(node.args[0], ast.Constant) \
                and node.args[0].value == "event":
            return True
        if isinstance(f, ast.Name) and f.id == "str" and node.args:
            return _is_event(node.args[0], evars)
        return isinstance(f, ast.Attribute) and _is_event(f.value, evars)
    return False


def _walk_scope(scope: ast.AST) -> list[ast.AST]:
    """The nodes of a function, or of a module outside its functions (each function is its own scope)."""
    out: list[ast.AST] = []
    todo = list(ast.iter_child_nodes(scope))
    while todo:
        node = todo.pop()
        out.append(node)
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or isinstance(scope, ast.FunctionDef):
            todo.extend(ast.iter_child_nodes(node))
    return out


def _event_vars(scope: ast.AST) -> set[str]:
    """Names assigned an event's name (or a dict keyed by them) in a function or module."""
    evars: set[str] = set()
    while True:
        before = len(evars)
        for node in _walk_scope(scope):
            if not isinstance(node, ast.Assign):
                continue
            pairs = [(t, node.value) for t in node.targets]
            for t, v in list(pairs):
                if isinstance(t, ast.Tuple) and isinstance(v, ast.Tuple) and len(t.elts) == len(v.elts):
                    pairs.extend(zip(t.elts, v.elts))
            for t, v in pairs:
                if isinstance(v, ast.IfExp):
                    v = v.body
                if isinstance(v, ast.DictComp):
                    v = v.key
                if isinstance(t, ast.Name) and _is_event(v, evars):
                    evars.add(t.id)
        if len(evars) == before:
            return evars


def event_name_literals(files: dict[str, tuple[bool, ast.Module, int]] | None = None) -> list[str]:
    """Event names spelled as strings outside events.py: a name-like string constant (declared in
    events.py or not) given to an event writer (`append_event`, `try_append_event`, the mirror's
    `_event`/`on_event`), compared with an event's name (`==`, `in`; through a variable or a
    module's collection, also one imported from another module), looked up in a dict keyed by
    event names, or given to a method of an event's name (`startswith`). Docstrings and other
    strings (a run's outcome kind, a verdict) are not event names and pass. `files`: as
    `sources()` returns them (the default)."""
    files = files or sources()
    known = set(files)
    assigns: dict[str, dict[str, list[ast.expr]]] = {}
    imported: dict[str, dict[str, tuple[str, str]]] = {}
    for mod, (is_pkg, tree, _) in files.items():
        assigns[mod], imported[mod] = {}, {}
        for node in tree.body:
            if isinstance(node, ast.Assign):
                for t in node.targets:
                    if isinstance(t, ast.Name):
                        assigns[mod].setdefault(t.id, []).append(node.value)
            elif isinstance(node, ast.ImportFrom):
                targets = resolve(mod, is_pkg, node, known)
                for alias in node.names:
                    if targets and targets[0] in files:
                        imported[mod][alias.asname or alias.name] = (targets[0], alias.name)
    bad: list[str] = []

    def flag(mod: str, expr: ast.AST, local: dict[str, list[ast.expr]], evars: set[str], seen: set[int]) -> None:
        if mod == "events" or id(expr) in seen or _is_event(expr, evars):
            return
        seen.add(id(expr))
        if isinstance(expr, ast.Constant) and isinstance(expr.value, str):
            if _WORDLIKE.fullmatch(expr.value):
                bad.append(f"{mod}:{expr.lineno}:{expr.col_offset}: {expr.value!r}")
        elif isinstance(expr, ast.Name):
            for value in local.get(expr.id, []) or assigns[mod].get(expr.id, []):
                flag(mod, value, local, evars, seen)
            if expr.id in imported[mod] and expr.id not in local and expr.id not in assigns[mod]:
                src, name = imported[mod][expr.id]
                for value in assigns[src].get(name, []):
                    flag(src, value, {}, set(), seen)
        elif isinstance(expr, ast.Dict):  # a mapping to event names: its values
            for v in expr.values:
                flag(mod, v, local, evars, seen)
        elif isinstance(expr, ast.Call):  # {...}.get(key): the mapping, not the key
            f = expr.func
            if isinstance(f, ast.Attribute) and f.attr == "get":
                flag(mod, f.value, local, evars, seen)
                for a in expr.args[1:]:
                    flag(mod, a, local, evars, seen)
            else:
                for a in expr.args:
                    flag(mod, a, local, evars, seen)
        elif isinstance(expr, (ast.Tuple, ast.List, ast.Set, ast.BinOp, ast.IfExp, ast.BoolOp, ast.Starred)):
            for child in ast.iter_child_nodes(expr):
                flag(mod, child, local, evars, seen)

    for mod, (_, tree, _) in sorted(files.items()):
        if mod == "events":
            continue
        scopes: list[ast.AST] = [tree] + [n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
        for scope in scopes:
            local: dict[str, list[ast.expr]] = {}
            if scope is not tree:
                for n in _walk_scope(scope):
                    if isinstance(n, ast.Assign):
                        for t in n.targets:
                            for name in ast.walk(t):
                                if isinstance(name, ast.Name):
                                    local.setdefault(name.id, []).append(n.value)
            evars = _event_vars(scope) | (set() if scope is tree else _event_vars(tree))
            for node in _walk_scope(scope):
                positions: list[ast.AST] = []
                if isinstance(node, ast.Call):
                    f = node.func
                    name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
                    at = EVENT_WRITERS.get(name or "")
                    if at is not None and len(node.args) > at:
                        positions.append(node.args[at])
                    if isinstance(f, ast.Attribute) and _is_event(f.value, evars):
                        positions.extend(node.args)
                elif isinstance(node, ast.Compare):
                    sides = [node.left, *node.comparators]
                    if any(_is_event(s, evars) for s in sides):
                        positions.extend(s for s in sides if not _is_event(s, evars))
                elif isinstance(node, ast.BinOp):
                    if _is_event(node.left, evars) or _is_event(node.right, evars):
                        positions.extend(s for s in (node.left, node.right) if not _is_event(s, evars))
                elif isinstance(node, ast.Subscript) and isinstance(node.value, ast.Name) and node.value.id in evars:
                    positions.append(node.slice)
                for p in positions:
                    flag(mod, p, local, evars, set())
    return sorted(set(bad))


# -- one storage interface (storage.py: a root on a file system or in a bucket) ---------------
# Who may use a tier's own root-level readers: the interface and the tiers themselves (and the
# package's public re-exports of the directory tier's `find_latest`/`list_checkpoints`).
STORAGE_LAYER = {"storage", "storage.root", "storage.directory", "storage.bucket", "checkpoint.store", "retention",
                 "storage.bucketsteps", "storage.bucketcommit", "storage.s3", "storage.settings", "__init__", "mirror"}
ROOT_READERS = {"checkpoint.store": {"find_latest", "list_checkpoints"}}
SCHEME_TEST = "is_s3_url"


def storage_bypasses(files: dict[str, tuple[bool, ast.Module, int]] | None = None) -> list[str]:
    """Each place outside the storage layer that reaches a root around `storage.Root`: importing
    the bucket tier (`storage.bucketsteps`), a directory tier's root scan (`checkpoint.store.find_latest`,
    `list_checkpoints`), or testing a URL's scheme itself (`is_s3_url`; `storage.is_bucket` and
    `storage.open_root` are the one place). Type-only imports count too: the record is
    `storage.CheckpointInfo`, the same on every tier."""
    files = sources() if files is None else files
    known = set(files) | {"storage.bucketsteps", "checkpoint.store", "storage.s3"}
    bad: list[str] = []
    for mod, (is_pkg, tree, _) in sorted(files.items()):
        if mod in STORAGE_LAYER:
            continue
        for node in ast.walk(tree):
            where = f"{mod}:{getattr(node, 'lineno', 0)}"
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                targets = resolve(mod, is_pkg, node, known)
                names = {a.name for a in node.names}
                if "storage.bucketsteps" in targets:
                    bad.append(f"{where}: imports storage.bucketsteps (a bucket is storage.BucketRoot)")
                for target, readers in ROOT_READERS.items():
                    if target in targets and names & readers:
                        bad.append(f"{where}: imports {', '.join(sorted(names & readers))} from {target} "
                                   "(a root is read through storage.open_root / DirRoot)")
                if SCHEME_TEST in names:
                    bad.append(f"{where}: imports {SCHEME_TEST} (storage.is_bucket is the one test of a root's kind)")
            elif isinstance(node, ast.Attribute) and node.attr in ({SCHEME_TEST} | set().union(*ROOT_READERS.values())):
                bad.append(f"{where}: uses .{node.attr} (reach a root through storage.open_root)")
            elif isinstance(node, ast.Name) and node.id == SCHEME_TEST:
                bad.append(f"{where}: calls {SCHEME_TEST} (storage.is_bucket is the one test of a root's kind)")
    return sorted(set(bad))


# -- typed messages (checkpoint/ makes a save's records; train/ receives them typed) -------------
MESSAGE_MAKERS = ("checkpoint.commit",)  # the commit protocol: prepare, write_rank, commit
_UNTYPED = re.compile(r"^(Any|(dict|Dict|Mapping)(\[.*\])?)$")
_DICT_LIST = re.compile(r"^(list|List|Sequence|tuple)\[(dict|Dict|Mapping)\b")


def dict_crossings(files: dict[str, tuple[bool, ast.Module, int]] | None = None) -> list[str]:
    """Where a save's messages cross from checkpoint/ into the roles above as bare dicts: a public
    function of a message maker (checkpoint/commit.py) annotated to return a dict (or Any), or to
    take a list of dicts, instead of its record (checkpoint/reports.py); and, outside checkpoint/,
    a record decoded from what a checkpoint function returned (`X.from_json(commit.prepare(...))`)
    or encoded into its arguments (`commit.commit(..., [r.to_json() ...])`): a typed -> dict ->
    typed trip that is not a collective or a file (those are not message makers). `files`: as `sources()` returns them."""
    files = sources() if files is None else files
    known = set(files)
    bad: list[str] = []
    for mod in MESSAGE_MAKERS:
        if mod not in files:
            continue
        for node in files[mod][1].body:
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("_"):
                continue
            returns = ast.unparse(node.returns) if node.returns is not None else "Any"
            if _UNTYPED.match(returns):
                bad.append(f"{mod}:{node.lineno}: {node.name} returns {returns} (return its record: checkpoint/reports.py)")
            for arg in node.args.args + node.args.kwonlyargs:
                hint = ast.unparse(arg.annotation) if arg.annotation is not None else ""
                if _DICT_LIST.match(hint):
                    bad.append(f"{mod}:{node.lineno}: {node.name} takes {arg.arg}: {hint} (take the records)")
    for mod, (is_pkg, tree, _) in sorted(files.items()):
        if mod.startswith("checkpoint.") or mod == "checkpoint":
            continue
        modules: set[str] = set()  # names bound to a message maker
        functions: set[str] = set()  # names bound to a message maker's function
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                for target in resolve(mod, is_pkg, node, known | set(MESSAGE_MAKERS)):
                    if target not in MESSAGE_MAKERS:
                        continue
                    for alias in node.names:
                        bound = alias.asname or alias.name
                        (modules if target.endswith("." + alias.name) else functions).add(bound)
        for node in ast.walk(tree):
            if not isinstance(node, ast.Call):
                continue
            where = f"{mod}:{node.lineno}"
            f = node.func
            if isinstance(f, ast.Attribute) and f.attr == "from_json" and any(
                    _calls_maker(sub, modules, functions) for a in node.args for sub in ast.walk(a)):
                bad.append(f"{where}: decodes what the commit protocol returned ({ast.unparse(f)}): "
                           "it returns the record")
            if _calls_maker(node, modules, functions) and any(
                    isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr == "to_json"
                    for a in [*node.args, *(k.value for k in node.keywords)] for sub in ast.walk(a)):
                bad.append(f"{where}: encodes records for the commit protocol ({ast.unparse(node.func)}): "
                           "it takes the records")
    return sorted(set(bad))


def _calls_maker(call: ast.AST, modules: set[str], functions: set[str]) -> bool:
    """Whether `call` calls a message maker's function (`mod.f(...)` through a module name, or `f(...)`)."""
    if not isinstance(call, ast.Call):
        return False
    f = call.func
    return (isinstance(f, ast.Attribute) and isinstance(f.value, ast.Name) and f.value.id in modules) or \
        (isinstance(f, ast.Name) and f.id in functions)


# -- the bucket side: storage/ reads a bucket, mirror/ copies onto it ---------------------------

def storage_imports_mirror(files: dict[str, tuple[bool, ast.Module, int]] | None = None) -> list[str]:
    """Each import in storage/ of a mirror/ module (at import time, deferred or type-only): the
    storage interface is the base a bucket is read through, the mirror (copying a root to a
    bucket) stands on it, never the other way."""
    files = sources() if files is None else files
    known = set(files) | {"mirror"}
    bad: list[tuple[str, int, str]] = []
    for mod, (is_pkg, tree, _) in sorted(files.items()):
        if mod.split(".")[0] != "storage":
            continue
        for node in ast.walk(tree):
            if isinstance(node, (ast.Import, ast.ImportFrom)):
                for target in resolve(mod, is_pkg, node, known):
                    if target.split(".")[0] == "mirror":
                        bad.append((mod, node.lineno, target))
    return [f"{mod}:{line}: imports {target}" for mod, line, target in sorted(bad)]


# -- the box geometry of a reshard opens no file -------------------------------------------------
GEOMETRY = ("checkpoint.boxes", "checkpoint.dtensorspec", "checkpoint.placement", "checkpoint.sharding")
GEOMETRY_STDLIB = {"__future__", "collections.abc", "dataclasses", "functools", "itertools", "math", "re", "typing"}


def geometry_imports(files: dict[str, tuple[bool, ast.Module, int]] | None = None) -> list[str]:
    """Each import of a box-geometry module (`GEOMETRY`: what a saved DTensor is, the box a rank
    owns, which saved pieces hold it) that could open or read a file: anything but the pure
    standard library (`GEOMETRY_STDLIB`), each other, errors and the shard format's dtype sizes
    (`shard.ITEMSIZE`); torch only inside a function (its placement classes, asked about there)."""
    files = sources() if files is None else files
    known = set(files)
    bad: list[str] = []
    for mod in GEOMETRY:
        if mod not in files:
            continue
        is_pkg, tree, _ = files[mod]
        body = {id(n) for n in tree.body}
        for node in ast.walk(tree):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            names = [a.name for a in node.names]
            if isinstance(node, ast.ImportFrom) and node.level:
                ok = all(t in GEOMETRY or t == "errors" or (t == "checkpoint.shard" and names == ["ITEMSIZE"])
                         for t in resolve(mod, is_pkg, node, known))
                what = "." * node.level + (node.module or "")
            else:
                what = node.module if isinstance(node, ast.ImportFrom) and node.module else ", ".join(names)
                tops = [what] if isinstance(node, ast.ImportFrom) else names
                ok = all(t in GEOMETRY_STDLIB or (t.split(".")[0] == "torch" and id(node) not in body) for t in tops)
            if not ok:
                bad.append(f"{mod}:{node.lineno}: imports {what}")
    return bad


# -- scripts/: the benches and tools beside the package -----------------------------------------

SCRIPTS = Path(__file__).resolve().parent


def script_cycles(folder: Path = SCRIPTS) -> list[list[str]]:
    """Circles among the scripts (`import bench_x` / `from bench_x import ...`, at import time or
    deferred): what two scripts share lives in a third that both import (bench_world.py)."""
    names = {p.stem for p in folder.glob("*.py")}
    edges: dict[str, set[str]] = {n: set() for n in names}
    for n in names:
        for node in ast.walk(ast.parse((folder / f"{n}.py").read_text())):
            if isinstance(node, ast.Import):
                edges[n].update(a.name for a in node.names if a.name in names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module in names:
                edges[n].add(node.module)
    return cycles({n: deps - {n} for n, deps in edges.items()})


def _under_type_checking(node: ast.stmt) -> bool:
    return isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test)


def cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def visit(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(edges.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(10000)
    for v in sorted(edges):
        if v not in index:
            visit(v)
    return out


def violations(edges: dict[str, set[str]]) -> list[str]:
    bad = []
    for a, deps in sorted(edges.items()):
        for b in sorted(deps):
            if ROLES.index(role(b)) < ROLES.index(role(a)):
                bad.append(f"{a} ({role(a)}) imports {b} ({role(b)})")
    return bad


def main() -> int:
    top, lazy, lines, funcs = graph()
    cyc = cycles(top)
    bad = violations({m: top[m] | lazy[m] for m in top})
    print(f"{len(top)} modules, {sum(map(len, top.values()))} import-time edges, "
          f"{sum(map(len, lazy.values()))} deferred (inside functions)")
    print(f"import-time cycles: {len(cyc)}")
    for c in cyc:
        print("  " + " <-> ".join(c))
    print(f"layer violations (import-time or deferred): {len(bad)}")
    for b in bad:
        print("  " + b)
    private = private_imports()
    print(f"private names used outside their module: {len(private)}")
    for b in private:
        print("  " + b)
    spelled = event_name_literals()
    print(f"event names spelled outside events.py: {len(spelled)}")
    for b in spelled:
        print("  " + b)
    bypass = storage_bypasses()
    print(f"roots reached around the storage interface: {len(bypass)}")
    for b in bypass:
        print("  " + b)
    crossing = dict_crossings()
    print(f"save messages crossing checkpoint/ as dicts: {len(crossing)}")
    for b in crossing:
        print("  " + b)


    upward = storage_imports_mirror()
    print(f"storage/ importing mirror/: {len(upward)}")
    for b in upward:
        print("  " + b)
    geometry = geometry_imports()
    print(f"box geometry importing what reads files: {len(geometry)}")
    for b in geometry:
        print("  " + b)
    scyc = script_cycles()
    print(f"circles among scripts/: {len(scyc)}")
    for c in scyc:
        print("  " + " <-> ".join(c))
    by_role: dict[str, list[str]] = {}
    for m in sorted(top):
        by_role.setdefault(role(m), []).append(m)
    for r in ROLES:
        print(f"{r:8} {len(by_role.get(r, []))} modules, {sum(lines[m] for m in by_role.get(r, []))} lines")
    print("modules over 300 lines: " + ", ".join(f"{m} ({n})" for m, n in sorted(lines.items(), key=lambda x: -x[1]) if n > 300))
    print("longest functions: " + ", ".join(f"{name} ({n})" for n, name in funcs[:10]))
    return 1 if cyc or bad or private or spelled or bypass or crossing or upward or geometry or scyc else 0


if __name__ == "__main__":
    sys.exit(main())
