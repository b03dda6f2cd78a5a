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
same exit status, same traceback. Imports nothing of slurmresume but this module.
"""

from __future__ import annotations

import logging
import os
import sys


def main() -> None:
    from torch.distributed.run import main as torchrun

    sys.argv[0] = "torchrun"
    torchrun()  # raises on a failed worker group (exit 1 with torchrun's error report), as before
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


if __name__ == "__main__":
    main()
