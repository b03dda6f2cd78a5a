"""What runs inside the training processes: the `Checkpointer` facade (checkpointer.py, set up by
wiring.py) over the save sequence (saving.py), the background writer (asyncsave.py), the
emergency sequence (emergency.py), restore with fallback (restoring.py; rank 0's choice:
restorechoice.py, loading one choice: restoreload.py, applying it: restoreapply.py, one rank's
part: restoreplan.py), the step-boundary verdict (verdict.py) and the rank<->rank messages
(messages.py); the warning flag (signals.py), the heartbeat (heartbeat.py), save policies, RNG
capture, samplers and seeding helpers. Users import these names from `slurmresume` itself."""
