"""Facts about the package's import graph, from the source (ast; nothing is imported):

    python scripts/import_graph.py            # report; exit 1 on a cycle or a layer violation

- cycles among imports that run when a module is imported (module level; an import inside a
  function runs later and is listed separately, it cannot form an import-time cycle);
- layer violations: each module belongs to one role (below); a module may import its own role
  and the roles listed after it, never one listed before it;
- private names crossing modules: `from .x import _name` of a non-module name (each private name
  stays in the module that defines it);
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
           slurm (the one seam that runs Slurm commands), mirror.s3/transfer
"""

from __future__ import annotations

import ast
import functools
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
    if top == "integrations" or mod in ("mirror.hook", "mirror.background", "mirror.remote"):
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
    by_role: dict[str, list[str]] = {}
    for m in sorted(top):
        by_role.setdefault(role(m), []).append(m)
    for r in ROLES:
        print(f"{r:8} {len(by_role.get(r, []))} modules, {sum(lines[m] for m in by_role.get(r, []))} lines")
    print("modules over 300 lines: " + ", ".join(f"{m} ({n})" for m, n in sorted(lines.items(), key=lambda x: -x[1]) if n > 300))
    print("longest functions: " + ", ".join(f"{name} ({n})" for n, name in funcs[:10]))
    return 1 if cyc or bad or private else 0


if __name__ == "__main__":
    sys.exit(main())
