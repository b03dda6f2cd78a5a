"""Test helper (2 gloo ranks, tests/test_side_group_teardown.py): a side group as a Checkpointer
makes it (`Group.create`; the per-node link's subgroup comes from the same `new_side_group`) is
destroyed while a forked child of rank 0 still holds copies of its sockets, as a DataLoader's
persistent workers do at the end of a script, the two ranks destroying TRIALS times at offsets
from -12 to +12 ms of each other.

    side_group_teardown.py [TRIALS]

With gloo's lazy init, a peer's close read during the last ticks of a group's teardown closed the
pair without taking its socket out of epoll; the child's copy kept it there and the next event
aborted rank 0 (`pair.cc:676 state_ <= CONNECTED. 5 vs 4`, SIGABRT). Rank 0 prints
`survived N` and what TORCH_GLOO_LAZY_INIT reads after the groups were made (the caller's value)."""

import os
import signal
import sys
import time

import torch.distributed as dist

from slurmresume.checkpoint.collective import LAZY, Group

dist.init_process_group("gloo")
rank = dist.get_rank()
trials = int(sys.argv[1]) if len(sys.argv) > 1 else 36
for i in range(trials):
    group = Group.create()
    group.max_int(1)
    child = os.fork() if rank == 0 else 1
    if child == 0:  # holds the parent's sockets, as a forked DataLoader worker does
        null = os.open(os.devnull, os.O_WRONLY)  # not the test's pipes: an aborted parent's child
        os.dup2(null, 1)  # would keep them open for its whole sleep
        os.dup2(null, 2)
        time.sleep(60)
        os._exit(0)
    deadline = group.broadcast_json(time.time() + 0.05)
    skew = ((i % 9) - 4) * 0.003 if rank == 1 else 0.0
    time.sleep(max(0.0, deadline + skew - time.time()))
    group.destroy()
    del group
    time.sleep(0.03)
    if rank == 0:
        os.kill(child, signal.SIGKILL)
        os.waitpid(child, 0)
    dist.barrier()
if rank == 0:
    print(f"survived {trials} {LAZY}={os.environ.get(LAZY)}", flush=True)
dist.destroy_process_group()
