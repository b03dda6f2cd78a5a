"""The integrations are optional: `import slurmresume` (and the integrations package) loads no
framework; each integration module loads only its own."""

from __future__ import annotations

import subprocess
import sys

FRAMEWORKS = ("lightning", "pytorch_lightning", "transformers", "accelerate")


def loaded_after(code: str) -> set[str]:
    probe = f"{code}\nimport sys\nprint(' '.join(m for m in {FRAMEWORKS!r} if m in sys.modules))"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    return set(res.stdout.split())


def test_import_slurmresume_loads_no_framework() -> None:
    assert loaded_after("import slurmresume, slurmresume.integrations; slurmresume.Checkpointer") == set()
