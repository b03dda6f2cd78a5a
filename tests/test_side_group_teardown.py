"""The side groups' teardown never aborts a healthy rank, whatever the rank forked.

A DataLoader's persistent workers, forked after the restore, hold copies of the side groups'
sockets until the script ends. With gloo's lazy init (TORCH_GLOO_LAZY_INIT=1, which the side
groups used), a group's teardown stops its event loop before it frees its pairs; a peer's close
read in the loop's last ticks closed the pair without removing its socket from epoll, the child's
copy kept the socket registered, and the next event aborted the rank (`gloo::EnforceNotMet ...
pair.cc:676 state_ <= CONNECTED. 5 vs 4`, SIGABRT) after its final save: the 2-rank augmentation
drill's resumed run (test_augment.py) died that way now and then under load. Eager groups take
each socket out of epoll before they close it."""

from __future__ import annotations

import pytest
from helpers.procs import HELPERS, clean_env, run_ranks


@pytest.mark.parametrize("user_value", [None, "1"])
def test_side_groups_are_torn_down_safely_while_a_forked_child_holds_their_sockets(user_value: str | None) -> None:
    """36 teardowns at offsets of -12..+12 ms between the ranks (the old code aborted rank 0 in
    each of its runs); a user's TORCH_GLOO_LAZY_INIT does not make the side groups lazy and is
    left as it was."""
    env = clean_env() if user_value is None else clean_env(TORCH_GLOO_LAZY_INIT=user_value)
    res = run_ranks(2, HELPERS / "side_group_teardown.py", "36", env=env, timeout=180)
    assert res.returncode == 0 and "EnforceNotMet" not in res.stderr, res.stderr[-3000:]
    assert f"survived 36 TORCH_GLOO_LAZY_INIT={user_value}" in res.stdout, res.stdout[-2000:]


@pytest.mark.parametrize(("size", "user_value", "want"), [
    (2, None, "0"), (2, "1", "0"), (128, None, "0"), (128, "1", "0"),
    (129, None, "1"), (16_384, None, "1"), (16_384, "0", "0"), (16_384, "1", "1"),
])
def test_side_groups_are_eager_up_to_128_ranks_and_lazy_beyond(size: int, user_value: str | None, want: str) -> None:
    """Eager where the full mesh is affordable (~2 W sockets per rank for our two groups: 256 at
    128 ranks); beyond, lazy unless the job asked for eager groups: at 16,384 ranks a full mesh
    would open 16,384 sockets per rank and group (#29). The same answer on every rank, from W."""
    from slurmresume.checkpoint.collective import EAGER_MAX_RANKS, lazy_init_value

    assert EAGER_MAX_RANKS == 128
    assert lazy_init_value(size, user_value) == want
