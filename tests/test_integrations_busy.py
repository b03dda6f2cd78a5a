"""Issue #26: framework evaluations run under ckpt.busy(), so the hang watch judges them by the
busy budget (never less than a step's), not as a step that never ends. In process, with a
heartbeat directory as the launcher would give: the record's phase during the evaluation."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from slurmresume.beatfile import BUSY, STEP, read_record, record_path


def _phase(hb: Path) -> str:
    rec = read_record(record_path(hb, 0))
    assert rec is not None
    return rec.phase


def test_lightning_validation_test_and_predict_run_under_busy(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("lightning.pytorch")
    import lightning.pytorch as pl
    import torch
    from torch.utils.data import DataLoader, TensorDataset

    from slurmresume.integrations.lightning import SlurmResume

    hb = tmp_path / "hb"
    hb.mkdir()
    monkeypatch.setenv("SLURMRESUME_HEARTBEAT_DIR", str(hb))
    seen: dict[str, list[str]] = {"train": [], "val": []}

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, idx):  # type: ignore[no-untyped-def]
            if (hb / "rank-00000.hb").exists():
                seen["train"].append(_phase(hb))
            return self.layer(batch[0]).square().mean()

        def validation_step(self, batch, idx):  # type: ignore[no-untyped-def]
            seen["val"].append(_phase(hb))

        def configure_optimizers(self):  # type: ignore[no-untyped-def]
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = DataLoader(TensorDataset(torch.randn(8, 2)), batch_size=2)
    trainer = pl.Trainer(max_steps=4, val_check_interval=2, limit_val_batches=1, num_sanity_val_steps=1,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, accelerator="cpu", devices=1,
                         callbacks=[SlurmResume(tmp_path / "ckpt", final_save=False)])
    trainer.fit(Tiny(), data, data)
    assert seen["val"] and set(seen["val"]) == {BUSY}, seen  # the sanity check and every validation
    assert STEP in seen["train"][1:] and BUSY not in seen["train"][1:], seen  # busy ends with the validation


def test_hf_trainer_evaluation_and_its_own_saves_run_under_busy(tmp_path: Path, monkeypatch) -> None:
    pytest.importorskip("transformers")
    from slurmresume import Checkpointer
    from slurmresume.integrations.transformers import SlurmResumeCallback

    hb = tmp_path / "hb"
    hb.mkdir()
    monkeypatch.setenv("SLURMRESUME_HEARTBEAT_DIR", str(hb))
    cb = SlurmResumeCallback(tmp_path / "ckpt", final_save=False)
    cb.ckpt = Checkpointer(tmp_path / "ckpt", handle_signals=False)
    args, control = SimpleNamespace(), SimpleNamespace(should_evaluate=False, should_save=False)
    state = SimpleNamespace(global_step=1, log_history=[], max_steps=10, epoch=0.1)
    cb.on_step_end(args, state, control)
    assert _phase(hb) == STEP  # nothing after this step
    cb.on_step_begin(args, state, control)
    state.global_step = 2
    control.should_evaluate = True  # set by the flow callback, which runs first
    cb.on_step_end(args, state, control)
    assert _phase(hb) == BUSY  # Trainer evaluates (and saves) now, before the next step begins
    cb.on_step_begin(args, state, control)
    assert _phase(hb) == STEP
    control.should_evaluate, control.should_save = False, True
    cb.on_epoch_end(args, state, control)
    assert _phase(hb) == BUSY
    cb.on_train_end(args, state, control)
    assert cb.ckpt is None
