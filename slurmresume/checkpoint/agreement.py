"""What every rank of a restore agrees on before it reads (issue 48, item 1): one MAX over a few
ints, encoded and decoded here, in one place, instead of a vector read by position.

A MAX answers "does any rank ..." directly, and "is it the same on every rank" by reducing both a
value and its negation: the maximum of -v is -(the minimum of v), so the value is the same
everywhere exactly when max(v) == -max(-v).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol


class MaxGroup(Protocol):
    def max_ints(self, values: list[int]) -> list[int]: ...


# how this rank wants to read, in the order of preference a MAX resolves (the highest wins)
WARM, ONE_PASS, TWO_PASS = 0, 1, 2


@dataclass(frozen=True)
class LoadAgreement:
    """The restore's agreement, the same on every rank once `agree` returns."""

    two_pass: bool  # some rank's staging is over its budget, or some read warm: verify first, then load
    same_exchange: bool  # every rank planned an exchange, and from the same inputs (one plan digest)
    exchange_forced: bool  # every rank forces the exchange (SLURMRESUME_RESHARD_EXCHANGE=1)

    @classmethod
    def agree(cls, group: MaxGroup, *, over_budget: bool, warm: bool, planned: bool, digest: int,
              forced: bool) -> LoadAgreement:
        """Collective (one MAX of 5 ints). `digest`: this rank's exchange-plan digest (0: none)."""
        mode = TWO_PASS if over_budget else WARM if warm else ONE_PASS
        return cls.decode(group.max_ints(cls.encode(mode, planned, digest, forced)))

    @staticmethod
    def encode(mode: int, planned: bool, digest: int, forced: bool) -> list[int]:
        """This rank's contribution: [mode, any rank without a plan, digest, -digest, any rank not forcing]."""
        return [mode, 0 if planned else 1, digest, -digest, 0 if planned and forced else 1]

    @classmethod
    def decode(cls, agreed: list[int]) -> LoadAgreement:
        """Pure: the MAX of every rank's `encode`. A mode other than ONE_PASS anywhere (over budget
        on some rank; or warm everywhere, which only a warm MAX of 0 reaches) reads twice."""
        mode, unplanned, top, neg_bottom, not_forced = agreed
        return cls(two_pass=mode != ONE_PASS, same_exchange=unplanned == 0 and top == -neg_bottom,
                   exchange_forced=not_forced == 0)
