#!/usr/bin/env python3
"""Refresh tests/durations.json (the order the full suite hands tests to its xdist workers: the
longest first, see tests/conftest.py) from the output of a run with `--durations=0`:

    bash scripts/test --durations=0 > run.log 2>&1; python3 scripts/durations.py run.log

Only the order matters, so a run on a loaded machine is good enough; tests under 3 s are left
out (they keep their collection order, after the listed ones). In a full run a real-Slurm test's
seconds include its wait for the cluster lock (tests/helpers/cluster_lock.py), which is not its
own cost: give a serial run of them as a later log, whose seconds replace the first's:

    python3 -m pytest -p no:xdist -m slurm --durations=0 tests > slurm.log 2>&1
    python3 scripts/durations.py run.log slurm.log"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

OUT = Path(__file__).resolve().parents[1] / "tests" / "durations.json"
LINE = re.compile(r"^\s*([\d.]+)s (?:call|setup|teardown)\s+(\S+)")


def main(argv: list[str]) -> int:
    if not argv:
        print(__doc__.strip().splitlines()[0], file=sys.stderr)
        return 2
    seconds: dict[str, float] = {}
    for log in argv:  # a later log's tests replace the earlier logs' seconds
        these: dict[str, float] = {}
        for line in Path(log).read_text(errors="replace").splitlines():
            m = LINE.match(line)
            if m:
                nodeid = m.group(2).split("@")[0]  # xdist adds "@group" to grouped tests
                these[nodeid] = these.get(nodeid, 0.0) + float(m.group(1))
        if not these:
            print(f"no durations in {log}: run pytest with --durations=0", file=sys.stderr)
            return 1
        seconds.update(these)
    kept = {k: round(v) for k, v in sorted(seconds.items(), key=lambda kv: -kv[1]) if v >= 3}
    OUT.write_text(json.dumps(kept, indent=0) + "\n")
    print(f"{OUT}: {len(kept)} tests")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
