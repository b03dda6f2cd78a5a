"""Three gloo ranks (helpers/forkranks.py) with a DDP model, as under the launcher (the test sets
$SLURMRESUME_HEARTBEAT_DIR), four steps, then by argv[1]:
  no-close: every rank leaves without ckpt.close(), rank 0 first: no rank may take that for a death;
  raise:    rank 2 raises (its own bug), the others go on into a collective with it: they must
            commit a failure save of step 4."""

import sys
import time

import torch
import torch.distributed as dist

from slurmresume import Checkpointer

mode, root = sys.argv[1], sys.argv[2]
dist.init_process_group("gloo")
rank = dist.get_rank()
torch.manual_seed(rank)
model = torch.nn.Linear(4, 4)
ddp = torch.nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
ckpt = Checkpointer(root)
state = {"model": model, "optimizer": opt, "loss": 0.0}
ckpt.restore(state)
for step in range(1, 5):
    loss = ddp(torch.randn(2, 4)).sum()
    opt.zero_grad()
    loss.backward()
    opt.step()
    state["loss"] = loss.item()
    ckpt.step(step, state)
if mode == "no-close":
    time.sleep(0.5 * rank)
    sys.exit(0)
if rank == 2:
    raise RuntimeError("rank 2's own bug")
ddp(torch.randn(2, 4)).sum().backward()  # with the dead rank: raises (or blocks) until the save exits
