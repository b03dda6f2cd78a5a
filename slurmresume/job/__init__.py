"""The job side: `submit`'s workflow (submitflow.py), submission through submitit (submit.py), the per-node loop that runs torchrun
and turns each run's outcome into a requeue or an in-allocation restart (node.py, torchrun.py),
the guardian that kills the tree when a launcher dies, the hang watch (hang.py, hangwatch.py),
the lead-time planner (leadtime.py) and the job's configuration (config.py)."""
