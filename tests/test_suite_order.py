"""The full suite's Slurm chains (helpers/suite_order.py): a module's tests stay on one chain,
one after another, so its module-scoped fixture runs once (test_slurm_two_nodes.py's switches
the cluster to two nodes and back, and runs an uninterrupted reference both its runs compare to)."""

from __future__ import annotations

import json
from pathlib import Path

from helpers.suite_order import module_of, slurm_chains

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
