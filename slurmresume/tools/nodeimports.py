"""Will the nodes' python import what the job needs? Checked by `submit` before `sbatch`, since
on the node a missing module only shows after the queue wait.

The nodes run `--python`: the launcher needs `slurmresume` and `submitit`, torchrun and the ranks
`torch`, and the script its own top-level imports. `script_imports` reads those from the source
(pure, `ast`: the script itself is never run; only its leading imports); `import_problem` imports every module in a child
`--python` with a timeout, from the script's folder as torchrun would, and returns one line.
"""

from __future__ import annotations

import ast
import json
import subprocess
from pathlib import Path

NEEDED = ("torch", "submitit", "slurmresume")
IMPORT_TIMEOUT_S = 120.0
_MARK = "slurmresume-import-check "

# Run by `--python -c`: first every module looked up (find_spec: a missing one fails fast), then
# each imported; the first failure is one JSON line after _MARK on stdout. sys.path[0] is the
# script's folder, as for `python script.py`.
_CHILD = f"""
import importlib, importlib.util, json, sys
sys.path[0] = sys.argv[1]
def fail(name, error, code):
    print({_MARK!r} + json.dumps({{"module": name, "error": error}}), flush=True)
    sys.exit(code)
for name in sys.argv[2:]:
    try:
        found = importlib.util.find_spec(name) is not None
    except BaseException as exc:
        fail(name, type(exc).__name__ + ": " + str(exc), 4)
    if not found:
        fail(name, None, 3)
for name in sys.argv[2:]:
    try:
        importlib.import_module(name)
    except BaseException as exc:
        fail(name, type(exc).__name__ + ": " + str(exc), 4)
"""


def script_imports(source: str) -> list[str]:
    """Pure: the absolute modules of the script's leading imports, in order: those before its
    first other statement (a `sys.path.insert` or an `os.environ[...] =` may change what a later
    import finds, so later ones are not judged). Imports under `if`/`try` (optional or
    version-dependent), in functions and relative ones are left out too."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return []
    out: list[str] = []
    for i, node in enumerate(tree.body):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module] if node.level == 0 and node.module else []
        elif i == 0 and isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
            continue  # the docstring
        else:
            break
        out += [n for n in names if n != "__future__" and n not in out]
    return out


def import_problem(python: str, script: Path, modules: list[str], *, setup: bool,
                   timeout: float = IMPORT_TIMEOUT_S) -> tuple[str | None, str | None]:
    """Import `NEEDED` and `modules` in `python`: (refusal, warning), each one line or None.
    `setup`: the batch script runs --setup lines first (module load, a venv), so a failure here
    may not happen there: it is a warning, not a refusal."""
    wanted = [*NEEDED, *(m for m in modules if m not in NEEDED)]
    try:
        proc = subprocess.run([python, "-c", _CHILD, str(script.parent), *wanted], capture_output=True, text=True,
                              timeout=timeout, check=False, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return None, f"--python {python} did not import {', '.join(wanted)} within {timeout:.0f} s: not checked"
    except OSError as exc:
        return f"--python {python} cannot be run: {exc.strerror or exc}", None
    line = next((x for x in reversed(proc.stdout.splitlines()) if x.startswith(_MARK)), None)
    if line is None:
        if proc.returncode == 0:
            return None, None
        last = (proc.stderr.strip().splitlines() or [f"exit {proc.returncode}"])[-1]
        return f"--python {python} failed before importing anything: {last}", None
    found = json.loads(line[len(_MARK):])
    line = _failure_line(python, script.name, found["module"], found["error"])
    if setup:
        return None, f"{line} (here; the nodes run --setup first, so it may import there)"
    return line, None


def _failure_line(python: str, script: str, module: str, error: str | None) -> str:
    if module in NEEDED:
        pkg = {"slurmresume": "slurmresume", "submitit": "submitit", "torch": "torch"}[module]
        what = f"cannot import {module}" if error is None else f"importing {module} failed: {error}"
        return (f"--python {python} {what}, which every node needs: install it there (pip install {pkg}) or pass "
                "the --python of the environment that has it")
    if error is None:
        return (f"{script} imports {module}, but --python {python} cannot import {module}: install it there, or pass "
                "--no-script-check if the nodes provide it")
    return (f"{script}: importing {module} failed: {error} (with --python {python}, which every node runs): fix it "
            "before queueing, or pass --no-script-check if the nodes differ")
