"""The order in which the full suite hands its real-Slurm tests to the xdist workers, and the
groups that keep a module-scoped fixture to one run (pure functions: tests/conftest.py applies
them, tests/test_suite_order.py checks them).

The Slurm tests run as chains, one xdist group each, that share the one cluster
(helpers/cluster_lock.py). A module's tests stay together, one after another on one chain:
a module-scoped fixture runs once per worker and is torn down whenever the next test is from
another module. test_slurm_two_nodes.py's fixture switches the cluster to two nodes and back
(two daemon restarts, holding the cluster alone) and its uninterrupted 2 x 2 reference run
is shared by two tests; balanced test by test, its four tests went to both chains between
other modules' tests, and the switch and the reference ran up to four times and twice. (The full
suite now starts the cluster with two nodes: no switch, and only the module's partition
preemption holds the cluster alone.)"""

from __future__ import annotations

from collections.abc import Collection, Mapping, Sequence

UNLISTED_S = 30.0  # a Slurm test not in durations.json: about a minute's run, half of it waiting


def module_of(nodeid: str) -> str:
    return nodeid.split("::", 1)[0]


def slurm_chains(nodeids: Sequence[str], seconds: Mapping[str, float], chains: int,
                 exclusive: Collection[str] = ()) -> list[list[str]]:
    """`chains` lists of nodeids: whole modules, the heaviest first, each to the chain with the
    fewest recorded seconds of shared tests so far; in a chain, its modules in that order and each
    module's tests the longest first, except that a module with a test in `exclusive` comes after
    the chain's other modules and, in a module, its tests in `exclusive` come after its shared ones
    (a module-scoped fixture, such as test_slurm_two_nodes.py's uninterrupted 2 x 2 reference run,
    is set up by the module's first test, under that test's hold: first in the module, the
    partition preemption held the cluster alone for the reference run too). A test in `exclusive` holds the cluster alone: every chain waits for
    it whichever chain runs it, so only the shared tests' seconds are balanced. Run first, the
    exclusive module (or the other chain's first test, whichever took the lock first) made the other
    chain's worker sit idle on the lock; run last, it starts when the other chain is done or nearly
    (the shared seconds are balanced), whose worker then goes on to the tests beside Slurm."""
    modules: dict[str, list[str]] = {}
    for nodeid in nodeids:
        modules.setdefault(module_of(nodeid), []).append(nodeid)

    def cost(ids: list[str], shared_only: bool = False) -> float:
        return sum(seconds.get(i, UNLISTED_S) for i in ids if not (shared_only and i in exclusive))

    placed: list[list[list[str]]] = [[] for _ in range(chains)]
    load = [0.0] * chains
    for ids in sorted(modules.values(), key=lambda ids: -cost(ids)):
        i = load.index(min(load))
        load[i] += cost(ids, shared_only=True)
        # its shared tests first: the first test sets up the module's fixtures, under its own hold
        placed[i].append(sorted(ids, key=lambda nodeid: (nodeid in exclusive, -seconds.get(nodeid, UNLISTED_S))))
    # a stable sort: the shared modules keep their order, the modules holding the cluster alone go last
    return [[nodeid for ids in sorted(mods, key=lambda ids: any(i in exclusive for i in ids)) for nodeid in ids]
            for mods in placed]


SHARED_SCOPES = frozenset({"module", "class"})  # set up once per module (or class), torn down on leaving it


def fixture_groups(scopes: Mapping[str, Collection[str]], grouped: Collection[str] = ()) -> dict[str, str]:
    """The xdist group of each test (nodeid -> the scopes of the fixtures it uses) that uses a
    module- or class-scoped fixture: one group per module; a test in `grouped` keeps its group.

    Under `--dist loadgroup` a group goes to one worker as one unit, its tests one after another,
    so the fixture runs once. Ungrouped, the suite's longest-first order interleaves modules on
    every worker and pytest tears a module's fixture down whenever the next test is from another
    module: test_node_layout.py's 4-rank save ran 4 times in one full run (40-48 s each), the
    2- and 3-rank saves of test_all_or_nothing.py 3 times, test_format2.py's 3-rank run 3 times."""
    return {nodeid: "fixture-" + module_of(nodeid).rpartition("/")[2].removesuffix(".py")
            for nodeid, used in scopes.items() if nodeid not in grouped and SHARED_SCOPES & set(used)}
