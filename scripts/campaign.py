#!/usr/bin/env python3
"""`python3 scripts/campaign.py NAME [--seed S] [--count N] ...`: runs a reliability campaign.
The campaigns live in tests/campaigns/ (harness.py says how to run them)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from campaigns.harness import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
