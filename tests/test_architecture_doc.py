"""docs/architecture.md names only what exists, where it lives (issue 48, point 7: it named
`job.launcher.Relay` and `job.launcher.decide` after they had moved to `job.relay` and
`job.decision`, still importable from that module, now job/torchrun.py, through its re-exports)."""

from __future__ import annotations

import importlib
import inspect
import re

from helpers.procs import REPO

PKG = REPO / "slurmresume"
FILE_SUFFIXES = {"json", "jsonl", "md", "txt", "toml", "png"}  # `events.jsonl` is a file on disk


def is_code_name(span: str) -> bool:
    """Pure: a `a.b[.c]` span whose first part is one of the package's modules or sub-packages
    (`train.saving`, `checkpoint.collective.LaggedMax`), not a file name (`manifest.json`)."""
    first, last = span.split(".")[0], span.split(".")[-1]
    return bool(re.fullmatch(r"[a-z_]\w*(\.\w+)+", span)) and last not in FILE_SUFFIXES and (
        (PKG / f"{first}.py").is_file() or (PKG / first / "__init__.py").is_file())


def where_it_fails(span: str) -> str | None:
    """None when `span` names an importable module, or a name defined in the module cited (a
    re-export from another module does not count); else why not."""
    parts = span.split(".")
    for cut in range(len(parts), 0, -1):
        module = "slurmresume." + ".".join(parts[:cut])
        try:
            obj = importlib.import_module(module)
        except ModuleNotFoundError:
            continue
        for i, name in enumerate(parts[cut:]):
            if not hasattr(obj, name):
                return f"{module} has no {'.'.join(parts[cut:cut + i + 1])}"
            obj = getattr(obj, name)
            if i == 0 and (inspect.isclass(obj) or inspect.isfunction(obj)) and obj.__module__ != module:
                return f"{span} lives in {obj.__module__}"
        return None
    return "no such module"


def test_every_module_and_name_architecture_md_cites_exists_where_it_says() -> None:
    text = (REPO / "docs" / "architecture.md").read_text()
    spans = sorted({s.removesuffix(".py") for s in re.findall(r"`([\w./]+)`", text)})
    names = [s for s in spans if "/" not in s and is_code_name(s)]
    paths = [s for s in spans if "/" in s and s.split("/")[0] in {p.name for p in PKG.iterdir() if p.is_dir()}]
    assert len(names) > 30 and len(paths) > 5, (names, paths)  # the page is read, not skipped
    bad = [f"`{s}`: {why}" for s in names if (why := where_it_fails(s))]
    bad += [f"`{s}.py`: no such file" for s in paths if not (PKG / f"{s}.py").is_file() and not (PKG / s).is_dir()]
    assert not bad, "docs/architecture.md names what is not there:\n" + "\n".join(bad)


def test_the_check_catches_a_moved_name() -> None:
    assert where_it_fails("job.relay.Relay") is None
    assert where_it_fails("job.torchrun.Relay") == "job.torchrun.Relay lives in slurmresume.job.relay"
    assert where_it_fails("job.torchrun.NoSuchThing") == "slurmresume.job.torchrun has no NoSuchThing"
    assert where_it_fails("train.nosuchmodule") == "slurmresume.train has no nosuchmodule"
    assert is_code_name("checkpoint.collective.LaggedMax") and not is_code_name("manifest.json")
    assert not is_code_name("events.jsonl")
