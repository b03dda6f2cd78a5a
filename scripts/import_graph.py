"""Facts about the package's import graph, from the source (ast; nothing is imported):

    python scripts/import_graph.py            # report; exit 1 on a cycle or a layer violation

- cycles among imports that run when a module is imported (module level; an import inside a
  function runs later and is listed separately, it cannot form an import-time cycle);
- layer violations: each module belongs to one role (below); a module may import its own role
  and the roles listed after it, never one listed before it;
- modules over 300 lines and the 10 longest functions.

Roles, from the top (may import downwards only):
  cli      the command line: app, cli, commands_*, options, _render*, the s3:// commands
  tools    read-only tools over a root: status, inspect, export, compare, drill, lineage, doctor, plot
  job      the job side: submit (launch), node launcher, guardian, Slurm, mirror uploads
  library  what training scripts import: Checkpointer and its helpers (incl. the mirror hook a
           rank calls after a commit)
  base     the checkpoint format and commit protocol (slurmresume.checkpoint), the errors, the
           launcher<->worker contract, the one seam that runs Slurm commands, and the bucket's
           twin of the format (mirror.s3, mirror.transfer: one step moved with its commit intact)
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

PKG = Path(__file__).resolve().parents[1] / "slurmresume"
ROLES = ["cli", "tools", "job", "library", "base"]
ROLE_OF = {
    "cli": {"app", "cli", "__main__", "options", "_render", "_render_job", "commands_ckpt",
            "commands_doctor", "commands_export", "commands_inspect", "commands_job", "mirror.commands"},
    "tools": {"status", "inspect", "export", "compare", "drill", "lineage", "doctor", "plot", "health",
              "mirror.fetch"},
    "job": {"launch", "launcher", "node", "guardian", "config", "mirror", "mirror.__main__"},
    "base": {"errors", "contract", "duration", "slurm", "mirror.s3", "mirror.transfer"},
}


def role(mod: str) -> str:
    if mod == "checkpoint" or mod.startswith("checkpoint."):
        return "base"
    for name, mods in ROLE_OF.items():
        if mod in mods:
            return name
    return "library"


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


def graph() -> tuple[dict[str, set[str]], dict[str, set[str]], dict[str, int], list[tuple[int, str]]]:
    files = {module_name(p): p for p in PKG.rglob("*.py")}
    known = set(files)
    top: dict[str, set[str]] = {m: set() for m in files}
    lazy: dict[str, set[str]] = {m: set() for m in files}
    lines: dict[str, int] = {}
    funcs: list[tuple[int, str]] = []
    for mod, path in files.items():
        text = path.read_text()
        lines[mod] = len(text.splitlines())
        tree = ast.parse(text)
        is_pkg = path.name == "__init__.py"
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
    by_role: dict[str, list[str]] = {}
    for m in sorted(top):
        by_role.setdefault(role(m), []).append(m)
    for r in ROLES:
        print(f"{r:8} {len(by_role.get(r, []))} modules, {sum(lines[m] for m in by_role.get(r, []))} lines")
    print("modules over 300 lines: " + ", ".join(f"{m} ({n})" for m, n in sorted(lines.items(), key=lambda x: -x[1]) if n > 300))
    print("longest functions: " + ", ".join(f"{name} ({n})" for n, name in funcs[:10]))
    return 1 if cyc or bad else 0


if __name__ == "__main__":
    sys.exit(main())
