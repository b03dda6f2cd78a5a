"""Bad input gives one clear error naming the thing: a missing root is a fresh start, a root
that is a file (or under a file) or cannot be written is refused, a state object that is not
checkpointable is refused naming its key. Nothing is half-written in any of these cases."""

from __future__ import annotations

import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from helpers.core import model_equal, tiny_model, tiny_state

from slurmresume import Checkpointer, ConfigError, SaveError, SlurmResumeError
from slurmresume.checkpoint.layout import step_dir_name
from slurmresume.checkpoint.store import find_latest


def test_missing_root_is_a_fresh_start_and_save_creates_it(tmp_path: Path) -> None:
    root = tmp_path / "a" / "b" / "ckpt"
    ckpt = Checkpointer(root, handle_signals=False)
    state = tiny_state(4)
    assert ckpt.restore(state) == 0
    assert not root.exists()  # restoring does not create anything
    assert model_equal(state["model"], tiny_model(4))  # and leaves the state alone
    assert ckpt.save(3, state) == root / step_dir_name(3)
    assert find_latest(root).step == 3


def test_root_from_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SLURMRESUME_CKPT_DIR", str(tmp_path / "env-root"))
    assert Checkpointer(handle_signals=False).root == tmp_path / "env-root"
    monkeypatch.delenv("SLURMRESUME_CKPT_DIR")
    with pytest.raises(ConfigError, match="SLURMRESUME_CKPT_DIR"):
        Checkpointer(handle_signals=False)


def test_root_is_a_file(tmp_path: Path) -> None:
    f = tmp_path / "ckpt"
    f.write_text("not a directory")
    with pytest.raises(ConfigError) as exc:
        Checkpointer(f, handle_signals=False)
    assert str(f) in str(exc.value) and "\n" not in str(exc.value)


def test_root_under_a_file(tmp_path: Path) -> None:
    """`mkdir -p` cannot succeed; saving fails with SaveError naming the path, restoring and
    listing with ConfigError (not a raw NotADirectoryError)."""
    (tmp_path / "file").write_text("x")
    root = tmp_path / "file" / "ckpt"
    ckpt = Checkpointer(root, handle_signals=False)
    with pytest.raises(SaveError) as exc:
        ckpt.save(1, tiny_state(1))
    msg = str(exc.value)
    assert str(root) in msg and "\n" not in msg and "nothing committed" in msg
    with pytest.raises(ConfigError, match=str(root)):
        ckpt.restore(tiny_state(1))
    with pytest.raises(ConfigError, match=str(root)):
        find_latest(root)


@pytest.fixture
def unwritable_dir(tmp_path: Path) -> Iterator[Path]:
    """A directory no one can create files in. chmod is enough for a normal user; as root
    (these tests usually are) the directory is made immutable with chattr +i instead."""
    d = tmp_path / "ro"
    d.mkdir()
    if os.geteuid() != 0:
        d.chmod(0o500)
        yield d
        d.chmod(0o700)
        return
    if shutil.which("chattr") is None or subprocess.run(["chattr", "+i", str(d)], capture_output=True).returncode:
        pytest.skip("running as root and cannot make a directory immutable (chattr +i)")
    try:
        try:
            (d / "probe").touch()
        except OSError:
            pass
        else:
            pytest.skip("chattr +i did not make the directory unwritable here")
        yield d
    finally:
        subprocess.run(["chattr", "-i", str(d)], check=True)


def test_unwritable_root(unwritable_dir: Path) -> None:
    ckpt = Checkpointer(unwritable_dir, handle_signals=False)
    assert ckpt.restore(tiny_state(0)) == 0
    with pytest.raises(SaveError) as exc:
        ckpt.save(1, tiny_state(1))
    msg = str(exc.value)
    assert str(unwritable_dir) in msg and "\n" not in msg, msg
    assert os.listdir(unwritable_dir) == []


def test_unwritable_root_below(unwritable_dir: Path) -> None:
    root = unwritable_dir / "ckpt"
    with pytest.raises(SaveError) as exc:
        Checkpointer(root, handle_signals=False).save(1, tiny_state(1))
    assert str(root) in str(exc.value) and "\n" not in str(exc.value)


class OnlyStateDict:
    def state_dict(self) -> dict:
        return {}


class OnlyLoad:
    def load_state_dict(self, sd: dict) -> None:
        pass


@pytest.mark.parametrize("obj", [OnlyStateDict(), OnlyLoad()], ids=["state_dict-only", "load-only"])
def test_half_stateful_object_names_its_key(tmp_path: Path, obj: object) -> None:
    with pytest.raises(ConfigError, match=r"state\['ema'\]"):
        Checkpointer(tmp_path, handle_signals=False).save(1, {"model": tiny_model(0), "ema": obj})
    assert not any(tmp_path.glob("step_*"))


@pytest.mark.parametrize("state, where", [
    ({"cfg": {"opt": {"fn": lambda: 0}}}, "cfg/opt/fn"),
    ({"hist": [1, 2, {3, 4}]}, "hist/2"),
    ({"model": tiny_model(0), "meta": (1, object())}, "meta/1"),
])
def test_unserialisable_value_names_the_key_path(tmp_path: Path, state: dict, where: str) -> None:
    with pytest.raises(ConfigError, match=f"'{where}'") as exc:
        Checkpointer(tmp_path, handle_signals=False).save(1, state)
    assert "\n" not in str(exc.value)
    assert not any(tmp_path.glob("step_*"))


@pytest.mark.parametrize("state", [[1, 2], {"": 1}, {1: 2}, {"__slurmresume__": 1}])
def test_bad_state_mapping(tmp_path: Path, state: object) -> None:
    with pytest.raises(ConfigError):
        Checkpointer(tmp_path, handle_signals=False).save(1, state)  # type: ignore[arg-type]


@pytest.mark.parametrize("step", [-1, 1.5, True, "3"])
def test_bad_step(tmp_path: Path, step: object) -> None:
    with pytest.raises(ConfigError, match="step"):
        Checkpointer(tmp_path, handle_signals=False).save(step, {"x": 1})  # type: ignore[arg-type]


def test_unsupported_tensor_dtype_fails_cleanly(tmp_path: Path) -> None:
    Checkpointer(tmp_path, handle_signals=False).save(1, tiny_state(1))
    with pytest.raises(SlurmResumeError) as exc:
        Checkpointer(tmp_path, handle_signals=False).save(2, {"z": torch.zeros(2, dtype=torch.complex64)})
    assert "complex64" in str(exc.value) and "\n" not in str(exc.value)
    assert find_latest(tmp_path).step == 1


def test_restore_checks_missing_and_foreign_keys(tmp_path: Path) -> None:
    Checkpointer(tmp_path, handle_signals=False).save(1, tiny_state(1))
    with pytest.raises(ConfigError, match=r"\['optimizer'\].*strict=False"):
        Checkpointer(tmp_path, handle_signals=False).restore({**tiny_state(0), "optimizer": None})
    state = {**tiny_state(0), "optimizer": None}
    assert Checkpointer(tmp_path, handle_signals=False).restore(state, strict=False) == 1
    assert state["optimizer"] is None and model_equal(state["model"], tiny_model(1))
    with pytest.raises(ConfigError, match=r"state\['model'\]"):
        Checkpointer(tmp_path, handle_signals=False).restore({**tiny_state(0), "model": 3})


def test_world_size_mismatch_is_an_error_not_a_fresh_start(tmp_path: Path) -> None:
    from helpers.core import save_as_world

    save_as_world(tmp_path, 4, world=2)
    assert find_latest(tmp_path).manifest.world_size == 2
    with pytest.raises(SlurmResumeError, match="2 ranks"):
        Checkpointer(tmp_path, handle_signals=False).restore(tiny_state(0))
