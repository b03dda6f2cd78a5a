"""What a training script does with its Checkpointer, read statically (doctor's and submit's
script check): `opt.step()` or `scheduler.step()` is not `ckpt.step()`.

`script_facts` follows the Checkpointer from where it is made (`slurmresume.Checkpointer(...)`,
or a function of the script that returns one) to the names that hold it: variables
(`ckpt = ...`, `with ... as ckpt`, `ckpt := ...`, `c2 = ckpt`), attributes (`self.ckpt = ...`), the
parameters of the script's own functions and classes it is passed to, and parameters annotated
`Checkpointer`. Only `.restore(` and `.step(` called on those count. Where a Checkpointer goes
somewhere the script does not show (into a list, a function it imports), every `.restore(` and
`.step(` counts, as before: a check that cannot follow it must not refuse a correct script.
"""

from __future__ import annotations

import ast
from dataclasses import dataclass, field

# slurmresume.integrations' callbacks: they restore and call ckpt.step() inside the framework.
CALLBACKS = {"SlurmResume": "Lightning", "SlurmResumeCallback": "Hugging Face Trainer"}
_MAKER = "Checkpointer"
_LOOPS = (ast.For, ast.While, ast.AsyncFor)
_FUNCS = (ast.FunctionDef, ast.AsyncFunctionDef)


@dataclass
class ScriptFacts:
    creates: bool = False  # slurmresume.Checkpointer(...) is called
    callback: str | None = None  # an integration callback made, e.g. "SlurmResume"
    restores: int = 0  # .restore( calls on the Checkpointer
    steps: list[bool] = field(default_factory=list)  # .step( calls on it: whether each is inside a loop


def _callee(call: ast.Call) -> str | None:
    f = call.func
    return f.attr if isinstance(f, ast.Attribute) else f.id if isinstance(f, ast.Name) else None


def _names(target: ast.AST) -> set[str]:
    """Names a target binds: `a`, `self.a` (as "a"), each of `a, b`."""
    if isinstance(target, ast.Name):
        return {target.id}
    if isinstance(target, ast.Attribute):
        return {target.attr}
    if isinstance(target, (ast.Tuple, ast.List)):
        return set().union(*(_names(t) for t in target.elts)) if target.elts else set()
    return set()


def _annotated(arg: ast.arg) -> bool:
    return arg.annotation is not None and _MAKER in ast.unparse(arg.annotation)


class _Binding:
    """The names holding the Checkpointer, to a fixed point; `unfollowed`: a Checkpointer made
    where the script does not show what holds it."""

    def __init__(self, tree: ast.Module) -> None:
        self.tree = tree
        self.funcs: dict[str, tuple[ast.FunctionDef | ast.AsyncFunctionDef, int]] = {}
        for node in ast.walk(tree):
            if isinstance(node, _FUNCS):
                self.funcs.setdefault(node.name, (node, 0))
            elif isinstance(node, ast.ClassDef):
                init = next((b for b in node.body if isinstance(b, _FUNCS) and b.name == "__init__"), None)
                if init is not None:
                    self.funcs[node.name] = (init, 1)  # `Trainer(ckpt)`: __init__'s parameter after self
        self.makers = {_MAKER}
        self.names = {a.arg for f, _ in self.funcs.values() for a in _params(f) if _annotated(a)}
        self.followed: set[int] = set()
        while self._grow():
            pass
        made = [n for n in ast.walk(tree) if isinstance(n, ast.Call) and _callee(n) in self.makers]
        self.unfollowed = any(id(n) not in self.followed for n in made)

    def holds(self, e: ast.AST | None) -> bool:
        if isinstance(e, ast.Call):
            return _callee(e) in self.makers
        if isinstance(e, ast.Name):
            return e.id in self.names
        if isinstance(e, ast.Attribute):
            return e.attr in self.names
        return False

    def _bind(self, value: ast.AST | None, targets: set[str]) -> None:
        if targets and self.holds(value):  # `d["ckpt"] = Checkpointer()`: no name to follow
            self.names |= targets
            self.followed.add(id(value))

    def _grow(self) -> bool:
        before = (len(self.names), len(self.makers), len(self.followed))
        for node in ast.walk(self.tree):
            if isinstance(node, ast.Assign):
                self._bind(node.value, set().union(*(_names(t) for t in node.targets)))
            elif isinstance(node, (ast.AnnAssign, ast.NamedExpr)) and node.value is not None:
                self._bind(node.value, _names(node.target))
            elif isinstance(node, ast.withitem) and node.optional_vars is not None:
                self._bind(node.context_expr, _names(node.optional_vars))
            elif isinstance(node, ast.Call) and _callee(node) in self.funcs:
                self._call(node)
        for name, (func, _) in self.funcs.items():
            for node in ast.walk(func):
                if isinstance(node, ast.Return) and self.holds(node.value):
                    self.makers.add(name)
                    self.followed.add(id(node.value))
        return (len(self.names), len(self.makers), len(self.followed)) != before

    def _call(self, call: ast.Call) -> None:
        """A Checkpointer passed to one of the script's functions binds that parameter."""
        func, skip = self.funcs[_callee(call) or ""]
        params = _params(func)
        if isinstance(call.func, ast.Attribute) and params and params[0].arg in ("self", "cls"):
            skip = 1
        positional = params[skip:]
        for i, arg in enumerate(call.args):
            if i < len(positional):
                self._bind(arg, {positional[i].arg})
        by_name = {a.arg for a in params}
        for kw in call.keywords:
            if kw.arg in by_name:
                self._bind(kw.value, {kw.arg})


def _params(func: ast.FunctionDef | ast.AsyncFunctionDef) -> list[ast.arg]:
    return [*func.args.posonlyargs, *func.args.args, *func.args.kwonlyargs]


def script_facts(tree: ast.Module, source: str) -> ScriptFacts:
    """Pure: what `tree` (the parsed `source`) does with its Checkpointer."""
    facts = ScriptFacts()
    if "slurmresume.integrations" in source:
        facts.callback = next((_callee(n) for n in ast.walk(tree)
                               if isinstance(n, ast.Call) and _callee(n) in CALLBACKS), None)
    binding = _Binding(tree)
    facts.creates = any(isinstance(n, ast.Call) and _callee(n) == _MAKER for n in ast.walk(tree))

    def on_checkpointer(call: ast.Call) -> bool:
        f = call.func
        if binding.unfollowed or not facts.creates:  # cannot follow it: any .restore( / .step( counts
            return True
        return isinstance(f, ast.Attribute) and binding.holds(f.value)

    def walk(node: ast.AST, in_loop: bool) -> None:
        loop = in_loop or isinstance(node, _LOOPS)
        if isinstance(node, ast.Call) and _callee(node) in ("restore", "step") and on_checkpointer(node):
            if _callee(node) == "restore":
                facts.restores += 1
            else:
                facts.steps.append(loop)
        for child in ast.iter_child_nodes(node):
            walk(child, loop)

    walk(tree, False)
    return facts
