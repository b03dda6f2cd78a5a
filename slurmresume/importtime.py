"""When this process imported slurmresume: the mark the start-up breakdown of the `restored`
event counts from (after the script's own imports). The package imports this module first
thing, so the mark is the package's import; not API."""

from __future__ import annotations

import time

IMPORTED_AT = time.time()
