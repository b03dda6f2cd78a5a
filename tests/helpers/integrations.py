"""Shared by tests/test_integrations_*.py: run `slurmresume drill` on an example, and send a
signal to every process of a run by walking the process tree (torchrun puts each rank in its
own session, so a process group would miss them)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from helpers.procs import REPO, clean_env, process_tree, signal_tree  # noqa: F401 - re-exported

EXAMPLES = REPO / "examples"


def offline_env(**extra: str) -> dict[str, str]:
    return clean_env(HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", HF_DATASETS_OFFLINE="1",
                     PYTHONPATH=str(REPO), **extra)


def drill(tmp_path: Path, script: str, nproc: int, *script_args: str, seed: int = 85,
          preemptions: int = 2) -> dict:
    res = subprocess.run([sys.executable, "-m", "slurmresume", "drill", str(EXAMPLES / script), "--workdir",
                          str(tmp_path / "w"), "--json", "--preemptions", str(preemptions), "--seed", str(seed),
                          "--nproc-per-node", str(nproc), "--", *script_args],
                         capture_output=True, text=True, timeout=1500, cwd=tmp_path, env=offline_env())
    # the scripts' own output comes first (HF prints dicts); the verdict is the last JSON document
    start = res.stdout.rfind("\n{\n") + 1 if "\n{\n" in res.stdout else res.stdout.find("{\n")
    assert start >= 0, res.stdout[-2000:] + res.stderr[-4000:]
    verdict = json.loads(res.stdout[start:])
    verdict["returncode"] = res.returncode
    verdict["stderr"] = res.stderr[-4000:]
    return verdict


def events(root: Path) -> list[dict]:
    path = root / "events.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def fake_scontrol(tmp_path: Path) -> tuple[Path, Path]:
    """A `scontrol` on PATH that only records that it was called. Returns (bin dir, log)."""
    bindir, log = tmp_path / "bin", tmp_path / "scontrol.log"
    bindir.mkdir(exist_ok=True)
    script = bindir / "scontrol"
    script.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\nexit 0\n")
    script.chmod(0o755)
    return bindir, log
