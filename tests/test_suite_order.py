"""The full suite's Slurm chains (helpers/suite_order.py): a module's tests stay on one chain,
one after another, so its module-scoped fixture runs once (test_slurm_two_nodes.py's switches
the cluster to two nodes and back, and runs an uninterrupted reference both its runs compare to);
the other tests that share a module-scoped fixture form one xdist group per module."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from helpers.suite_order import fixture_groups, module_of, slurm_chains

TESTS = Path(__file__).resolve().parent

TWO = "tests/test_slurm_two_nodes.py::"
# the recorded seconds of the run that split test_slurm_two_nodes.py across both chains
SECONDS = {"tests/test_slurm_hang.py::test_hang": 256.0, TWO + "twice": 184.0,
           "tests/test_slurm_e2e.py::three": 143.0, "tests/test_slurm_ownership.py::resubmit": 138.0,
           "tests/test_slurm_e2e.py::partition": 130.0, "tests/test_slurm_e2e.py::limit": 129.0,
           TWO + "budget": 99.0, TWO + "once": 90.0, TWO + "hang": 64.0, "tests/test_doctor.py::clean": 30.0}


def _contiguous(chain: list[str]) -> bool:
    modules = [module_of(nodeid) for i, nodeid in enumerate(chain)
               if i == 0 or module_of(chain[i - 1]) != module_of(nodeid)]
    return len(modules) == len(set(modules))


def test_a_module_stays_on_one_chain_in_one_run_of_tests() -> None:
    chains = slurm_chains(list(SECONDS), SECONDS, 2)
    assert sorted(nodeid for chain in chains for nodeid in chain) == sorted(SECONDS)  # each test once
    holding = [chain for chain in chains if any(nodeid.startswith(TWO) for nodeid in chain)]
    assert len(holding) == 1 and all(_contiguous(chain) for chain in chains), chains
    two = [nodeid for nodeid in holding[0] if nodeid.startswith(TWO)]
    assert two == [TWO + "twice", TWO + "budget", TWO + "once", TWO + "hang"]  # the longest first
    loads = sorted(sum(SECONDS[nodeid] for nodeid in chain) for chain in chains)
    assert loads[1] - loads[0] <= 256  # balanced to within the heaviest module


def test_the_recorded_durations_keep_every_slurm_module_whole() -> None:
    recorded = json.loads((TESTS / "durations.json").read_text())
    slurm = [nodeid for nodeid in recorded if "slurm" in module_of(nodeid)]
    slurm.append("tests/test_slurm_new.py::unlisted")
    chains = slurm_chains(slurm, recorded, 2)
    assert all(_contiguous(chain) for chain in chains)
    assert len({module_of(n) for n in slurm}) == sum(len({module_of(n) for n in chain}) for chain in chains)


def test_only_the_shared_tests_are_balanced_between_the_chains() -> None:
    """A test that holds the cluster alone stops every chain whichever runs it: balancing it like
    a shared one left one chain with most of the shared tests (here 700 s against 300 s)."""
    seconds = {"tests/a.py::t": 500.0, "tests/b.py::t": 400.0, "tests/c.py::t": 300.0, "tests/d.py::t": 200.0}
    chains = slurm_chains(list(seconds), seconds, 2, exclusive={"tests/b.py::t"})
    shared = sorted(sum(seconds[n] for n in chain if n != "tests/b.py::t") for chain in chains)
    assert shared == [500.0, 500.0], chains


def test_a_modules_exclusive_test_comes_after_its_shared_ones() -> None:
    """The module's first test sets up its module-scoped fixture under that test's hold: the
    two-node module's longest test, the partition preemption (exclusive), ran first and held the
    cluster alone for the uninterrupted 2 x 2 reference run too."""
    chains = slurm_chains(list(SECONDS), SECONDS, 2, exclusive={TWO + "twice"})
    two = [nodeid for chain in chains for nodeid in chain if nodeid.startswith(TWO)]
    assert two == [TWO + "budget", TWO + "once", TWO + "hang", TWO + "twice"]


def test_a_modules_tests_that_share_a_module_fixture_form_one_group() -> None:
    scopes = {"tests/a.py::saved1": ["function", "module"], "tests/a.py::saved2": ["module"],
              "tests/a.py::pure": ["function"], "tests/b.py::t[1]": ["class", "session"],
              "tests/c.py::t": ["module"], "tests/d.py::t": ["session"]}
    groups = fixture_groups(scopes, grouped={"tests/c.py::t"})
    assert groups == {"tests/a.py::saved1": "fixture-a", "tests/a.py::saved2": "fixture-a",
                      "tests/b.py::t[1]": "fixture-b"}  # c.py keeps its own group, a session fixture runs once anyway


PLUGIN = '''
def pytest_collection_finish(session):
    for item in session.items:
        mark = item.get_closest_marker("xdist_group")
        print("GROUP", item.nodeid, mark.args[0] if mark else "-")
'''


def test_the_suite_groups_the_tests_of_test_node_layouts_saved_step(tmp_path: Path) -> None:
    """The conftest marks them (collected as the full suite would): test_node_layout.py's tests
    that read its module's 4-rank save share one xdist group; its pure tests stay free."""
    (tmp_path / "show_groups.py").write_text(PLUGIN)
    res = subprocess.run([sys.executable, "-m", "pytest", "-p", "no:xdist", "-p", "show_groups", "--collect-only", "-q",
                          "tests/test_node_layout.py"], cwd=TESTS.parent, capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(TESTS.parent)])})
    groups = dict(line.split()[1:] for line in res.stdout.splitlines() if line.startswith("GROUP "))
    assert res.returncode == 0 and groups, res.stdout + res.stderr
    saved = {nodeid for nodeid, group in groups.items() if group != "-"}
    assert {group for group in groups.values() if group != "-"} == {"fixture-test_node_layout"}
    assert len(saved) == 10 and all("test_a_nodes_ranks" not in nodeid for nodeid in saved), groups  # 10 read it


def test_xdist_hands_out_work_in_the_conftests_order() -> None:
    """The conftest turns off xdist's reorder by unit size (the Slurm chains and the longest tests
    would otherwise wait behind the groups with the most tests)."""
    from types import SimpleNamespace

    from conftest import keep_collection_order

    config = SimpleNamespace(option=SimpleNamespace(loadscopereorder=True))
    keep_collection_order(config)  # type: ignore[arg-type]
    assert config.option.loadscopereorder is False
    bare = SimpleNamespace(option=SimpleNamespace())  # -p no:xdist: no such option, nothing to set
    keep_collection_order(bare)  # type: ignore[arg-type]
    assert not hasattr(bare.option, "loadscopereorder")


def test_a_chain_runs_the_modules_that_hold_the_cluster_alone_last() -> None:
    """The two-node module (the heaviest) goes last on its chain, after the shared modules put there,
    so the other chain is not held idle on the lock while it runs (it runs its own shared tests
    meanwhile, then the tests beside Slurm)."""
    alone = {nodeid for nodeid in SECONDS if nodeid.startswith(TWO)}
    chains = slurm_chains(list(SECONDS), SECONDS, 2, alone)
    holding = next(chain for chain in chains if any(nodeid in alone for nodeid in chain))
    first = next(i for i, nodeid in enumerate(holding) if nodeid in alone)
    assert first > 0 and all(nodeid in alone for nodeid in holding[first:]), holding
    assert all(_contiguous(chain) for chain in chains)
