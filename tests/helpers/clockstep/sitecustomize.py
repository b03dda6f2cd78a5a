"""A wall-clock step for every process of a test run (launcher, torchrun, ranks), as an NTP
step or a VM resume would make it: once the file $CLOCK_STEP_FILE exists, time.time() (and
time.time_ns()) return the real time plus $CLOCK_STEP_S. time.monotonic() is not touched, as
on Linux. Loaded through PYTHONPATH (this directory first)."""

import os
import time

_FILE = os.environ.get("CLOCK_STEP_FILE")
if _FILE:
    _real, _real_ns, _mono = time.time, time.time_ns, time.monotonic
    _offset = float(os.environ.get("CLOCK_STEP_S", "0"))
    _state = {"checked": -1.0, "stepped": False}

    def _stepped() -> bool:
        if not _state["stepped"] and _mono() - _state["checked"] > 0.02:
            _state["checked"] = _mono()
            _state["stepped"] = os.path.exists(_FILE)
        return bool(_state["stepped"])

    def _time() -> float:
        return _real() + (_offset if _stepped() else 0.0)

    def _time_ns() -> int:
        return _real_ns() + (int(_offset * 1e9) if _stepped() else 0)

    time.time, time.time_ns = _time, _time_ns
