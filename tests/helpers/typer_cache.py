"""Build each Typer app's click command once per test process, not at every CliRunner.invoke.

typer.testing.CliRunner.invoke rebuilds the whole command tree from the app on each call:
typer reads every command's signature and evaluates its (postponed) annotations, ~0.1-0.2 s of
CPU per invoke on this machine; the hostile-arguments campaign alone spent 86 of its 119 s there
(cProfile, 625 invokes, 2026-12-04). The command object click parses with is stateless between
invocations (every invoke makes its own context), so one per app serves every call.
"""

from __future__ import annotations

from typing import Any

_built: dict[Any, Any] = {}  # Typer app -> its click command (apps hash by identity)


def install() -> None:
    import typer.testing

    if getattr(typer.testing._get_command, "_slurmresume_cached", False):
        return
    build = typer.testing._get_command

    def get_command(app: Any) -> Any:
        if app not in _built:
            _built[app] = build(app)
        return _built[app]

    get_command._slurmresume_cached = True  # type: ignore[attr-defined]
    typer.testing._get_command = get_command  # type: ignore[assignment]
