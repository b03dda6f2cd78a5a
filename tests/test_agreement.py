"""The restore's agreement (checkpoint/agreement.py): every rank's contribution, the MAX a group
makes of them, and what it means, by table (issue 48, item 1: named, not decoded by position)."""

from __future__ import annotations

import pytest

from slurmresume.checkpoint.agreement import ONE_PASS, TWO_PASS, WARM, LoadAgreement


class Ranks:
    """A group of ranks whose MAX is taken over their contributions, as gloo would."""

    def __init__(self, contributions: list[list[int]]) -> None:
        self.contributions = contributions

    def agreed(self) -> LoadAgreement:
        return LoadAgreement.decode([max(col) for col in zip(*self.contributions, strict=True)])


def rank(mode: int = ONE_PASS, planned: bool = True, digest: int = 7, forced: bool = False) -> list[int]:
    return LoadAgreement.encode(mode, planned, digest, forced)


@pytest.mark.parametrize(("ranks", "two_pass", "same", "forced"), [
    ([rank(), rank(), rank()], False, True, False),
    ([rank(), rank(TWO_PASS), rank()], True, True, False),  # one rank over its budget: all verify first
    ([rank(WARM), rank(WARM), rank(WARM)], True, True, False),  # warm everywhere: two passes
    ([rank(WARM), rank(), rank(WARM)], False, True, False),  # warm on some ranks only: one pass
    ([rank(), rank(digest=8), rank()], False, False, False),  # two plans: no exchange
    ([rank(digest=-3), rank(digest=-3), rank(digest=-3)], False, True, False),  # negative digests too
    ([rank(), rank(planned=False, digest=0), rank()], False, False, False),  # one rank without a plan
    ([rank(forced=True), rank(forced=True), rank(forced=True)], False, True, True),
    ([rank(forced=True), rank(), rank(forced=True)], False, True, False),  # forced only where all force
])
def test_the_agreement_means_the_same_on_every_rank(ranks: list[list[int]], two_pass: bool, same: bool,
                                                    forced: bool) -> None:
    got = Ranks(ranks).agreed()
    assert (got.two_pass, got.same_exchange, got.exchange_forced) == (two_pass, same, forced)


def test_agree_makes_one_max_of_five_ints() -> None:
    calls: list[list[int]] = []

    class One:
        def max_ints(self, values: list[int]) -> list[int]:
            calls.append(values)
            return values

    got = LoadAgreement.agree(One(), over_budget=False, warm=False, planned=True, digest=5, forced=False)
    assert calls == [[ONE_PASS, 0, 5, -5, 1]] and got == LoadAgreement(False, True, False)
