"""torchrun for one node, without the interpreter's teardown: `python -m slurmresume.job.agent
ARGS` runs `torch.distributed.run` with ARGS and, when it returns normally (every worker exited
and torchrun has shut its rendezvous down), flushes and leaves with `os._exit(0)`.

Why: the launcher's decision (requeue, restart) waits for torchrun's agent to exit, and an agent
that has imported torch spends 0.3-2 s after its last line (module teardown, the TCP store's and
libtorch's destructors; more on a loaded node) doing nothing anyone reads. That wait sat
between the commit and `scontrol requeue` of every preemption.

Only for a single-node run (node.torchrun_command): with several nodes the first node's agent
hosts the rendezvous store, and the other agents' rendezvous shutdown may still need it when
this agent is done. A failure (an exception, SystemExit with a code) takes the ordinary path:
same exit status; a failed worker group is one line instead of torchrun's report. Imports nothing of slurmresume but this module.
"""

from __future__ import annotations

import logging
import os
import sys


def main() -> None:
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import main as torchrun

    sys.argv[0] = "torchrun"
    try:
        torchrun()
    except ChildFailedError as exc:
        # The worker's own traceback is already on stderr: torchrun's 30-line report of it (its
        # stack, then a box repeating the exit code) becomes one line; exit status 1, as torchrun's.
        rank, failure = exc.get_first_failure()
        how = f"signal {failure.signal_name()}" if failure.exitcode < 0 else f"exit code {failure.exitcode}"
        sys.stderr.write(f"torchrun: rank {rank} failed ({how}); its own output is above\n")
        sys.exit(1)
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
