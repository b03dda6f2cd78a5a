"""`python -m campaigns NAME ...` (tests/ on the path) or `python -m tests.campaigns NAME ...`
(from the repository root): see tests/campaigns/harness.py."""

from __future__ import annotations

import sys
from pathlib import Path

TESTS = str(Path(__file__).resolve().parents[1])
if TESTS not in sys.path:
    sys.path.insert(0, TESTS)

from campaigns.harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
