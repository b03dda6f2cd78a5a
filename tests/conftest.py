"""Shared, generic fixtures. The functions behind them live in tests/helpers/procs.py, so a
test module can also import them directly: `from helpers.procs import run_example`."""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

TESTS = Path(__file__).resolve().parent
if str(TESTS) not in sys.path:
    sys.path.insert(0, str(TESTS))

from helpers import procs  # noqa: E402
from helpers.suite_order import fixture_groups, slurm_chains  # noqa: E402
from helpers.typer_cache import install as _cache_cli_commands  # noqa: E402

_cache_cli_commands()  # CliRunner builds each app's command once per worker, not per invoke


@pytest.fixture
def env_clean() -> dict[str, str]:
    """os.environ without SLURM_*, SLURMRESUME_*, torchrun variables (for child processes)."""
    return procs.clean_env()


@pytest.fixture
def port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    return procs.free_port()


@pytest.fixture
def run_example() -> Callable[..., object]:
    """`run_example(ckpt_dir, "--steps", 40, nproc=1)` -> CompletedProcess of examples/train.py."""
    return procs.run_example


@pytest.fixture
def run_python() -> Callable[..., object]:
    """`run_python([script, args...], env=...)` -> CompletedProcess, clean env by default."""
    return procs.run_python


def pytest_configure(config: pytest.Config) -> None:
    # pytest-xdist declares it; declared here too, so a run with -p no:xdist takes the marks below quietly
    config.addinivalue_line("markers", "xdist_group(name): tests of one group run on one xdist worker")
    keep_collection_order(config)


def keep_collection_order(config: pytest.Config) -> None:
    """`--dist loadgroup` hands out work units in the order of the items below, not xdist's
    default (`--loadscope-reorder`: the units with the most tests first). That default put the
    fixture groups of 41, 27, 20 and 10 quick tests ahead of the second Slurm chain (6 tests) and
    every listed long test behind them: the chain started only when a worker had drained its
    group. The order here is the Slurm chains first, then the longest first."""
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


@pytest.hookimpl(tryfirst=True)  # before xdist reads the xdist_group marks
def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Under pytest-xdist (`-n N --dist loadgroup`, what scripts/test uses): the tests on the real
    Slurm cluster form two groups (each runs one test after another on one worker), collected
    first, so their serial chains start while the other workers take everything else; the other
    tests that share a module-scoped fixture form one group per module.

    Tests marked `exhaustive` (the remaining points of a matrix such as start method x worker
    persistence, whose every value another test covers) run only with SLURMRESUME_EXHAUSTIVE=1
    (`bash scripts/test --exhaustive`) or when `-m` names them."""
    if os.environ.get("SLURMRESUME_EXHAUSTIVE") != "1" and "exhaustive" not in (config.getoption("markexpr") or ""):
        extra = [item for item in items if item.get_closest_marker("exhaustive")]
        if extra:  # the rest of a matrix whose every value another test already covers
            config.hook.pytest_deselected(items=extra)
            items[:] = [item for item in items if not item.get_closest_marker("exhaustive")]
    # The longest first (tests/durations.json, from a recorded run: scripts/durations.py): each
    # worker holds at most ~3 tests ahead, so a long test is never the last one left running
    # while the other workers are idle. Unlisted (short) tests keep their collection order.
    order = json.loads((TESTS / "durations.json").read_text()) if (TESTS / "durations.json").exists() else {}
    # Chains of real-Slurm tests, whole modules balanced by recorded duration (helpers/suite_order.py):
    # they share the cluster (helpers/cluster_lock.py), so neither chain's waiting on Slurm
    # (requeues, time limits) bounds the whole run alone.
    by_id = {item.nodeid: item for item in items if item.get_closest_marker("slurm")}
    slurm: list[pytest.Item] = []
    alone = {nodeid for nodeid, item in by_id.items() if item.get_closest_marker("slurm_exclusive")}
    for i, chain in enumerate(slurm_chains(list(by_id), order, SLURM_CHAINS, alone)):
        for nodeid in chain:
            by_id[nodeid].add_marker(pytest.mark.xdist_group(f"slurm{i}"))
            slurm.append(by_id[nodeid])
    rest = sorted((item for item in items if not item.get_closest_marker("slurm")),
                  key=lambda item: -order.get(item.nodeid, 0))
    # A module's tests that share a module-scoped fixture (a multi-rank save several tests read)
    # form one group, run one after another on one worker: the fixture runs once, not once for
    # each time the longest-first order comes back to the module (helpers/suite_order.py).
    grouped = {item.nodeid for item in rest if item.get_closest_marker("xdist_group")}
    groups = fixture_groups({item.nodeid: _scopes(item) for item in rest}, grouped)
    for item in rest:
        if item.nodeid in groups:
            item.add_marker(pytest.mark.xdist_group(groups[item.nodeid]))
    items[:] = slurm + rest


SLURM_CHAINS = 2


def _scopes(item: pytest.Item) -> list[str]:
    """The scopes of the fixtures a test uses."""
    info = getattr(item, "_fixtureinfo", None)
    return [defs[-1].scope for defs in info.name2fixturedefs.values() if defs] if info else []


@pytest.fixture(autouse=True)
def _cluster_share(request: pytest.FixtureRequest) -> Iterator[None]:
    """A real-Slurm test holds the cluster shared, or alone with `@pytest.mark.slurm_exclusive`."""
    if request.node.get_closest_marker("slurm") is None:
        yield
        return
    from helpers.cluster_lock import cluster_lock

    with cluster_lock(exclusive=request.node.get_closest_marker("slurm_exclusive") is not None):
        yield
