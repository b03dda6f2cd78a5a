"""The order in which the full suite hands its real-Slurm tests to the xdist workers (a pure
function: tests/conftest.py applies it, tests/test_suite_order.py checks it).

The Slurm tests run as chains, one xdist group each, that share the one cluster
(helpers/cluster_lock.py). A module's tests stay together, one after another on one chain:
a module-scoped fixture runs once per worker and is torn down whenever the next test is from
another module. test_slurm_two_nodes.py's fixture switches the cluster to two nodes and back
(two daemon restarts, holding the cluster alone) and its uninterrupted 2 x 2 reference run
is shared by two tests; balanced test by test, its four tests went to both chains between
other modules' tests, and the switch and the reference ran up to four times and twice."""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

UNLISTED_S = 30.0  # a Slurm test not in durations.json: about a minute's run, half of it waiting


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def slurm_chains(nodeids: Sequence[str], seconds: Mapping[str, float], chains: int,
                 exclusive: Collection[str] = ()) -> list[list[str]]:
    """`chains` lists of nodeids: whole modules, the heaviest first, each to the chain with the
    fewest recorded seconds of shared tests so far; in a chain, its modules in that order and each
    module's tests the longest first. A test in `exclusive` holds the cluster alone: every chain
    waits for it whichever chain runs it, so only the shared tests' seconds are balanced."""
    modules: dict[str, list[str]] = {}
    for nodeid in nodeids:
        modules.setdefault(module_of(nodeid), []).append(nodeid)

    def cost(ids: list[str], shared_only: bool = False) -> float:
        return sum(seconds.get(i, UNLISTED_S) for i in ids if not (shared_only and i in exclusive))

    out: list[list[str]] = [[] for _ in range(chains)]
    load = [0.0] * chains
    for ids in sorted(modules.values(), key=lambda ids: -cost(ids)):
        i = load.index(min(load))
        load[i] += cost(ids, shared_only=True)
        out[i] += sorted(ids, key=lambda nodeid: -seconds.get(nodeid, UNLISTED_S))
    return out
