"""`submit`'s workflow (job.submitflow) without the CLI: the typed result of a preview, and what a
preview or a refusal leaves undone (no --resume-from preparation, no root probe, nothing on disk).
The checks from tools/ are recorded stand-ins; the CLI's output is tested in test_submit.py."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from slurmresume.errors import ConfigError
from slurmresume.job.config import JobSpec
from slurmresume.job.submitflow import (
    JobPreview,
    LocalPreview,
    SubmitChecks,
    SubmitFlags,
    run_submit,
)


class Recorded:
    """SubmitChecks whose steps only record their calls; `refuse`: preflight's one refusal."""

    def __init__(self, refuse: str | None = None, lead: str | None = None) -> None:
        self.calls: list[tuple[str, Any]] = []
        self.refuse, self.lead = refuse, lead

    def checks(self) -> SubmitChecks:
        def preflight(spec: JobSpec, **kwargs: Any) -> list[str]:
            self.calls.append(("preflight", kwargs))
            if self.refuse:
                raise ConfigError(self.refuse)
            return ["from preflight"]

        def prepare_resume(root: Path, resume_from: str, **kwargs: Any) -> Path:
            self.calls.append(("prepare_resume", resume_from))
            return root

        def check_root(root: Path) -> None:
            self.calls.append(("check_root", root))

        def lead_warning(root: Path, lead: int) -> str | None:
            self.calls.append(("lead_warning", lead))
            return self.lead

        return SubmitChecks(preflight=preflight, prepare_resume=prepare_resume, check_root=check_root,
                            lead_warning=lead_warning)


def _spec(tmp_path: Path) -> JobSpec:
    script = tmp_path / "train.py"
    script.write_text("")
    return JobSpec(script=script, ckpt_dir=tmp_path / "root")


def test_a_preview_prepares_nothing_and_returns_the_sbatch_script(tmp_path: Path) -> None:
    rec, warned = Recorded(lead="short lead"), []
    result = run_submit(_spec(tmp_path), SubmitFlags(dry_run=True, resume_from="5"), rec.checks(), warned.append)
    assert isinstance(result, JobPreview) and "#SBATCH" in result.sub.sbatch_script
    assert result.ckpt_dir == tmp_path / "root" and result.sub.job_id == ""
    assert [name for name, _ in rec.calls] == ["preflight", "lead_warning"]  # no prepare_resume, no root probe
    assert rec.calls[0][1]["shared_root"] and rec.calls[0][1]["slurm"] and rec.calls[0][1]["resume_from"] == "5"
    assert warned == ["from preflight", "short lead"]
    assert not (tmp_path / "root").exists()


def test_a_local_preview_is_the_torchrun_command(tmp_path: Path) -> None:
    rec = Recorded()
    result = run_submit(_spec(tmp_path), SubmitFlags(local=True, dry_run=True), rec.checks(), lambda _: None)
    assert isinstance(result, LocalPreview) and "--standalone" in result.torchrun
    assert not rec.calls[0][1]["slurm"]
    assert not (tmp_path / "root").exists()


def test_a_refusal_comes_before_the_resume_is_prepared(tmp_path: Path) -> None:
    rec = Recorded(refuse="no")
    with pytest.raises(ConfigError, match="no"):
        run_submit(_spec(tmp_path), SubmitFlags(local=True, resume_from="5"), rec.checks(), lambda _: None)
    assert [name for name, _ in rec.calls] == ["preflight"]


def test_branch_without_resume_from_is_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="only make sense with --resume-from"):
        run_submit(_spec(tmp_path), SubmitFlags(dry_run=True, branch=tmp_path / "b"), Recorded().checks(),
                   lambda _: None)
