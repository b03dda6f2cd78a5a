"""A newcomer's first week (issue 46), the command line: `submit`, `doctor`, `status`, `verify` and
the drill's `next:` line. Each test is one mistake a new user made; the exact command runs through
the real `python -m slurmresume` (or CliRunner where only the command's own output matters), with
fake `sbatch`/`srun`/`scontrol` first on PATH (tests/helpers/slurm_fakes.py): a refusal that did not
happen shows as "Submitted batch job 4242". Refusals are one `error:` line, exit 1, nothing written.
"""

from __future__ import annotations

import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from helpers.procs import REPO, clean_env
from helpers.slurm_fakes import PARTITIONS, fake_slurm

from slurmresume import Checkpointer

SCRIPT = REPO / "examples" / "train.py"
GOOD = "import slurmresume\nckpt = slurmresume.Checkpointer()\nstep = ckpt.restore({})\nfor i in range(3):\n    ckpt.step(i, {})\n"


def cli(args: list[str], cwd: Path, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    env = clean_env(**{"PYTHONPATH": str(REPO), "COLUMNS": "200", "NO_COLOR": "1", **(env or {})})
    return subprocess.run([sys.executable, "-m", "slurmresume", *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=180)


def script(tmp: Path, body: str, name: str = "train.py") -> str:
    (tmp / name).write_text(body)
    return str(tmp / name)


def no_slurm(tmp: Path) -> dict[str, str]:
    """An environment whose PATH holds no Slurm command (this machine may have a real cluster)."""
    empty = tmp / "no-slurm-bin"
    empty.mkdir(exist_ok=True)
    return {"PATH": str(empty)}


def files(tmp: Path) -> list[str]:
    return sorted(str(p) for p in tmp.rglob("*"))


def one_error(proc: subprocess.CompletedProcess[str], fragment: str, code: int = 1) -> str:
    """The command failed with `code` and said so in one `error:` line holding `fragment`."""
    assert proc.returncode == code, (proc.returncode, proc.stdout[-2000:], proc.stderr[-2000:])
    assert "Traceback" not in proc.stdout + proc.stderr, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr[-3000:]
    assert fragment in lines[0], lines[0]
    assert "4242" not in proc.stdout  # nothing was queued
    return lines[0]


# -- row 2: --dry-run never runs or writes anything, with or without --local ----------------------


def test_a_local_dry_run_trains_nothing_and_writes_nothing(tmp_path: Path) -> None:
    bindir = fake_slurm(tmp_path)
    before = files(tmp_path)
    proc = cli(["submit", str(SCRIPT), "--local", "--dry-run", "--ckpt-dir", str(tmp_path / "ck"), "--nproc-per-node",
                "2", "--", "--steps", "3"], tmp_path, {"PATH": str(bindir)})
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert files(tmp_path) == before  # no root, no step, no event log
    assert "--standalone" in proc.stdout and "--nproc-per-node=2" in proc.stdout and "--steps 3" in proc.stdout
    assert "nothing was run" in proc.stdout
    assert "step" not in proc.stderr.lower()  # no training output


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "run"])
def test_local_refuses_nodes_it_cannot_run(tmp_path: Path, dry_run: bool) -> None:
    bindir = fake_slurm(tmp_path)
    before = files(tmp_path)
    proc = cli(["submit", str(SCRIPT), "--local", "--nodes", "2", "--ckpt-dir", str(tmp_path / "ck"),
                *(["--dry-run"] if dry_run else []), "--", "--steps", "3"], tmp_path, {"PATH": str(bindir)})
    one_error(proc, "--local runs one node on this machine")
    assert files(tmp_path) == before


def test_local_says_which_slurm_options_it_ignores(tmp_path: Path) -> None:
    bindir = fake_slurm(tmp_path)
    proc = cli(["submit", str(SCRIPT), "--local", "--dry-run", "-p", "gpu", "--time", "1:00:00", "--ckpt-dir",
                str(tmp_path / "ck")], tmp_path, {"PATH": str(bindir)})
    assert proc.returncode == 0, proc.stderr
    assert "warning: --local runs here without Slurm: --partition, --time apply only when submitted" in proc.stderr


# -- row 6: the check recognises the Checkpointer's own step() ------------------------------------

OPT_ONLY = ("import slurmresume, torch\nmodel = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(model.parameters(), 0.1)\n"
            "ckpt = slurmresume.Checkpointer()\nstate = {'model': model, 'opt': opt}\nstart = ckpt.restore(state)\n"
            "for i in range(start, 10):\n    opt.zero_grad()\n    model(torch.ones(2)).sum().backward()\n    opt.step()\n")


def test_doctor_and_submit_see_that_opt_step_is_not_ckpt_step(tmp_path: Path) -> None:
    path = script(tmp_path, OPT_ONLY)
    doc = cli(["doctor", path], tmp_path, no_slurm(tmp_path))
    assert doc.returncode == 1, doc.stdout
    assert "FAIL  script: step" in doc.stdout and "calls step() in a loop" not in doc.stdout
    bindir = fake_slurm(tmp_path)
    one_error(cli(["submit", path, "--ckpt-dir", str(tmp_path / "ck"), "--dry-run"], tmp_path, {"PATH": str(bindir)}),
              "never calls ckpt.step(...)")


BOUND = [
    ("assigned", GOOD, "ok"),
    ("with ... as", "import slurmresume\nwith slurmresume.Checkpointer() as c:\n    c.restore({})\n"
                    "    for i in range(3):\n        c.step(i, {})\n", "ok"),
    ("an attribute", "from slurmresume import Checkpointer\nclass T:\n    def __init__(self):\n"
                     "        self.ckpt = Checkpointer()\n    def fit(self, s):\n        self.ckpt.restore(s)\n"
                     "        while True:\n            self.ckpt.step(1, s)\n", "ok"),
    ("passed to a function", "import slurmresume\ndef loop(cp, s):\n    cp.restore(s)\n    for i in range(3):\n"
                             "        cp.step(i, s)\nloop(slurmresume.Checkpointer(), {})\n", "ok"),
    ("a factory", "import slurmresume\ndef make():\n    return slurmresume.Checkpointer()\nck = make()\nck.restore({})\n"
                  "for i in range(3):\n    ck.step(i, {})\n", "ok"),
    ("the Lightning callback", "from slurmresume.integrations.lightning import SlurmResume\n"
                               "trainer = Trainer(callbacks=[SlurmResume('r')])\ntrainer.fit(m)\n", "ok"),
    ("held where it cannot be followed", "import slurmresume\nrun = {}\nrun['ck'] = slurmresume.Checkpointer()\n"
                                         "run['ck'].restore({})\nfor i in range(3):\n    run['ck'].step(i, {})\n", "ok"),
    ("only sched.step()", GOOD.replace("ckpt.step(i, {})", "sched.step()"), "fail"),
    ("only other.restore()", GOOD.replace("ckpt.restore({})", "db.restore({})"), "fail"),
]


@pytest.mark.parametrize(("source", "verdict"), [b[1:] for b in BOUND], ids=[b[0] for b in BOUND])
def test_step_and_restore_are_the_checkpointers_own(source: str, verdict: str) -> None:
    from slurmresume.tools.doctor import check_script

    checks = check_script(source, "t.py")
    worst = "fail" if any(c.status == "fail" for c in checks) else "ok"
    assert worst == verdict, checks


@pytest.mark.parametrize("example", sorted(p.name for p in (REPO / "examples").glob("*.py")))
def test_every_example_passes_the_script_check(example: str) -> None:
    from slurmresume.tools.doctor import check_script

    checks = check_script((REPO / "examples" / example).read_text(), example)
    assert all(c.status == "ok" for c in checks), checks


# -- row 7: --gres gpu:N sets the ranks ------------------------------------------------------------


def test_gres_gpus_set_the_ranks_per_node(tmp_path: Path) -> None:
    bindir = fake_slurm(tmp_path)
    proc = cli(["submit", str(SCRIPT), "--gres", "gpu:4", "--ckpt-dir", str(tmp_path / "ck"), "--dry-run"], tmp_path,
               {"PATH": str(bindir)})
    assert proc.returncode == 0, proc.stderr
    assert "--nproc-per-node=4 " in proc.stdout and "#SBATCH --gres=gpu:4" in proc.stdout


@pytest.mark.parametrize(("sbatch", "fields", "procs"), [
    (["gres=gpu:4"], {}, 4), (["gres=gpu:a100:2"], {}, 2), (["gres=gpu:a100:2,nvme:1"], {}, 2),
    (["gres=gres/gpu"], {}, 1), (["gres=nvme:1"], {}, 1), (["gres=gpu:4"], {"nproc_per_node": 1}, 1),
    (["gres=gpu:4"], {"gpus_per_node": 4}, 4), ([], {"gpus_per_node": 8}, 8),
])
def test_ranks_per_node_from_gres(tmp_path: Path, sbatch: list[str], fields: dict[str, int], procs: int) -> None:
    from slurmresume.job.config import JobSpec, parse_sbatch_extras

    spec = JobSpec(script=SCRIPT, ckpt_dir=tmp_path, sbatch=parse_sbatch_extras(sbatch), **fields)
    assert spec.procs == procs


@pytest.mark.parametrize(("args", "message"), [
    (["--gres", "gpu:4", "--gpus-per-node", "2"], "--gpus-per-node 2 and --gres gpu:4 ask for different GPUs"),
    (["--sbatch", "gres=gpu:2", "--nproc-per-node", "4"], "--nproc-per-node 4 is more than the 2 GPUs"),
])
def test_gres_that_disagrees_is_refused(tmp_path: Path, args: list[str], message: str) -> None:
    bindir = fake_slurm(tmp_path)
    before = files(tmp_path)
    one_error(cli(["submit", str(SCRIPT), *args, "--ckpt-dir", str(tmp_path / "ck")], tmp_path, {"PATH": str(bindir)}),
              message)
    assert files(tmp_path) == before


# -- row 8: what the nodes' python cannot import is refused before sbatch ---------------------------


def _python_without(tmp: Path, module: str) -> str:
    """An interpreter (a wrapper of this one) that cannot import `module`, as a venv without it."""
    site = tmp / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(f"import sys\nsys.modules[{module!r}] = None\n")
    wrapper = tmp / "venv-python"
    wrapper.write_text(f"#!/bin/sh\nPYTHONPATH={site}:{REPO} exec {sys.executable} \"$@\"\n")
    wrapper.chmod(0o755)
    return str(wrapper)


@pytest.mark.parametrize(("module", "message"), [
    ("torch", "cannot import torch"), ("submitit", "cannot import submitit"),
])
def test_a_python_without_torch_or_submitit_is_refused(tmp_path: Path, module: str, message: str) -> None:
    bindir = fake_slurm(tmp_path)
    python = _python_without(tmp_path, module)
    before = files(tmp_path)
    line = one_error(cli(["submit", str(SCRIPT), "--python", python, "--ckpt-dir", str(tmp_path / "ck")], tmp_path,
                         {"PATH": str(bindir)}), message)
    assert python in line
    assert files(tmp_path) == before


@pytest.mark.parametrize(("imports", "message"), [
    ("import nosuchmodule_xyz\n", "cannot import nosuchmodule_xyz"),
    ("from helper_mod import x\n", "importing helper_mod failed: RuntimeError: CUDA driver too old"),
])
def test_a_script_whose_imports_fail_is_refused_without_running_it(tmp_path: Path, imports: str, message: str) -> None:
    bindir = fake_slurm(tmp_path)
    (tmp_path / "helper_mod.py").write_text("raise RuntimeError('CUDA driver too old')\n")
    ran = tmp_path / "main-ran"
    path = script(tmp_path, imports + f"open({str(ran)!r}, 'w').close()\n" + GOOD)
    before = files(tmp_path)
    for extra in ([], ["--dry-run"]):
        one_error(cli(["submit", path, *extra, "--ckpt-dir", str(tmp_path / "ck")], tmp_path, {"PATH": str(bindir)}),
                  message)
    assert files(tmp_path) == before and not ran.exists()


def test_only_the_leading_imports_are_judged() -> None:
    """What a script imports after its own code (a sys.path.insert first) or under try/if may
    import on the node although not here: not judged."""
    from slurmresume.tools.nodeimports import script_imports

    source = ('"""doc"""\nfrom __future__ import annotations\nimport os, torch.nn\nfrom . import sibling\n'
              "try:\n    import tomllib\nexcept ImportError:\n    import tomli\nimport sys\n"
              "sys.path.insert(0, 'lib')\nimport mylib\n")
    assert script_imports(source) == ["os", "torch.nn"]


# -- rows 9 and 10: --time against the partition and the lead ---------------------------------------


def test_time_over_the_partitions_max_time_is_refused(tmp_path: Path) -> None:
    bindir = fake_slurm(tmp_path, partitions=PARTITIONS)
    before = files(tmp_path)
    one_error(cli(["submit", str(SCRIPT), "--time", "2:00:00", "--ckpt-dir", str(tmp_path / "ck")], tmp_path,
                  {"PATH": str(bindir)}), "--time 2:00:00 is over the MaxTime of partition cpu (01:00:00)")
    assert files(tmp_path) == before


@pytest.mark.parametrize(("time", "partition", "refused"), [
    ("1:00:00", None, False), ("61", None, True), ("3-00:00:00", "long", False), ("2:00:00", "cpu,long", False),
    ("2:00:00", "gpu", False), (None, "cpu", False), ("2:00:00", "cpu", True),
])
def test_max_time_is_the_chosen_partitions(time: str | None, partition: str | None, refused: bool) -> None:
    """The default partition when none is named; a comma list is refused only when no partition
    in it takes --time; a partition the text does not show is not judged (hidden ones exist)."""
    from slurmresume.tools.doctor import parse_partitions
    from slurmresume.tools.preflight import max_time_problem

    assert (max_time_problem(time, partition, parse_partitions(PARTITIONS)) is not None) == refused


def test_a_lead_over_a_third_of_the_time_is_warned(tmp_path: Path) -> None:
    bindir = fake_slurm(tmp_path)
    proc = cli(["submit", str(SCRIPT), "--time", "3", "--ckpt-dir", str(tmp_path / "ck"), "--dry-run"], tmp_path,
               {"PATH": str(bindir)})
    assert proc.returncode == 0, proc.stderr
    assert ("warning: --signal-lead 120 s is over a third of --time 3 (180 s): each allocation trains at most 60 s "
            "before the warning") in proc.stderr


def test_sbatch_time_is_refused_like_sbatch_signal(tmp_path: Path) -> None:
    bindir = fake_slurm(tmp_path)
    for key in ("time", "t"):
        one_error(cli(["submit", str(SCRIPT), "--time", "120", "--sbatch", f"{key}=60", "--ckpt-dir",
                       str(tmp_path / "ck"), "--dry-run"], tmp_path, {"PATH": str(bindir)}),
                  f"--sbatch {key}=... is set by slurmresume itself: use --time")


# -- rows 12 and 13: status on what is not a root; the root as a positional -------------------------


def test_status_on_a_folder_that_is_not_a_root_says_so(tmp_path: Path) -> None:
    home = tmp_path / "home"
    (home / "data").mkdir(parents=True)
    (home / ".bashrc").write_text("x")
    (home / "notes.txt").write_text("x")
    one_error(cli(["status", "-d", str(home)], tmp_path, no_slurm(tmp_path)),
              f"{home} is not a checkpoint root (no step_* folder, no events.jsonl)")


def test_a_root_submit_just_created_is_starting(tmp_path: Path) -> None:
    """What `submit` leaves before the job starts (logs/, the lease, the event log) and an empty
    directory are roots: STARTING, exit 0."""
    bindir = fake_slurm(tmp_path)
    root = tmp_path / "ck"
    sub = cli(["submit", str(SCRIPT), "--ckpt-dir", str(root)], tmp_path, {"PATH": str(bindir)})
    assert sub.returncode == 0 and "4242" in sub.stdout, sub.stderr
    (tmp_path / "empty").mkdir()
    (tmp_path / "logs-only" / "logs").mkdir(parents=True)
    for r in (root, tmp_path / "empty", tmp_path / "logs-only"):
        proc = cli(["status", "-d", str(r), "--no-mirror-check"], tmp_path, no_slurm(tmp_path))
        assert proc.returncode == 0, (r, proc.stdout, proc.stderr)
        assert "not a checkpoint root" not in proc.stderr


def _root(tmp: Path) -> Path:
    ckpt = Checkpointer(tmp / "ck", handle_signals=False)
    ckpt.save(1, {"w": 1})
    ckpt.close()
    return tmp / "ck"


@pytest.mark.parametrize("command", ["status", "verify", "doctor"])
def test_the_root_as_a_positional_gets_the_dash_d_hint(tmp_path: Path, command: str) -> None:
    root = _root(tmp_path)
    line = one_error(cli([command, str(root)], tmp_path, no_slurm(tmp_path)), f"-d {root}")
    assert f"slurmresume {command} -d {root}" in line


# -- row 14: status --plot names the formats and the file it wrote ----------------------------------


def _events_root(tmp: Path) -> Path:
    from helpers.timeline import example_events, write_events

    write_events(tmp / "root", example_events())
    return tmp / "root"


def test_plot_to_an_unknown_format_is_one_line(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    root, env = _events_root(tmp_path), no_slurm(tmp_path)
    before = files(tmp_path)
    line = one_error(cli(["status", "-d", str(root), "--plot", str(tmp_path / "p.jpgg")], tmp_path, env), "--plot")
    assert ".jpgg" in line and "png" in line and "svg" in line
    assert files(tmp_path) == before


def test_plot_without_an_extension_says_the_file_it_wrote(tmp_path: Path) -> None:
    pytest.importorskip("matplotlib")
    root = _events_root(tmp_path)
    proc = cli(["status", "-d", str(root), "--plot", str(tmp_path / "plotnoext")], tmp_path, no_slurm(tmp_path))
    assert proc.returncode == 0, proc.stderr
    written = tmp_path / "plotnoext.png"
    assert written.read_bytes()[:4] == b"\x89PNG"
    assert proc.stderr.strip().splitlines()[-1] == f"timeline written to {written}"


# -- rows 15 and 16: --python on PATH; a directory as the script ------------------------------------


def test_python_is_found_on_path(tmp_path: Path) -> None:
    bindir = fake_slurm(tmp_path)
    (bindir / "python3").symlink_to(sys.executable)
    proc = cli(["submit", str(SCRIPT), "--python", "python3", "--ckpt-dir", str(tmp_path / "ck"), "--dry-run"],
               tmp_path, {"PATH": str(bindir)})
    assert proc.returncode == 0, proc.stderr
    assert f"{bindir / 'python3'} -m slurmresume.job.agent" in proc.stdout  # what the nodes run
    one_error(cli(["submit", str(SCRIPT), "--python", "nopython3", "--ckpt-dir", str(tmp_path / "ck")], tmp_path,
                  {"PATH": str(bindir)}), "nopython3 is not on PATH")


@pytest.mark.parametrize("command", ["submit", "drill"])
def test_a_directory_as_the_script_says_it_is_a_directory(tmp_path: Path, command: str) -> None:
    bindir = fake_slurm(tmp_path)
    (tmp_path / "proj").mkdir()
    one_error(cli([command, str(tmp_path / "proj"), "--ckpt-dir", str(tmp_path / "ck")] if command == "submit"
                  else [command, str(tmp_path / "proj")], tmp_path, {"PATH": str(bindir)}),
              f"training script {tmp_path / 'proj'} is a directory")


# -- row 17: the drill's `next:` command works when pasted -------------------------------------------


def test_the_drills_next_command_submits_as_printed(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from slurmresume.cli.job_inputs import next_command
    from slurmresume.job.config import JobSpec

    monkeypatch.chdir(tmp_path)  # no [tool.slurmresume] above it: the line must carry its own root
    spec = JobSpec(script=SCRIPT, script_args=("--steps", "60"), ckpt_dir=tmp_path / "runs" / "drill", nproc_per_node=2)
    printed = next_command(spec)  # what `drill` prints after `next:`
    argv = shlex.split(printed)
    assert argv[:2] == ["slurmresume", "submit"]
    bindir = fake_slurm(tmp_path)
    proc = cli(argv[1:], tmp_path, {"PATH": str(bindir)})  # as pasted: submitted (to the fake sbatch)
    assert proc.returncode == 0 and "4242" in proc.stdout, (printed, proc.stderr)
    import json

    root = tmp_path / "runs" / "train"  # its own root, not the drill's scratch folder
    submitted = [json.loads(line) for line in (root / "events.jsonl").read_text().splitlines()]
    assert [(e["event"], e["procs"], e["job_id"]) for e in submitted] == [("submitted", 2, "4242")]
    assert not (tmp_path / "runs" / "drill").exists()


# -- row 4 at the queue: a step folder as submit's --ckpt-dir is refused before sbatch ------------


@pytest.mark.parametrize("dry_run", [True, False], ids=["dry-run", "submit"])
def test_submit_refuses_a_step_folder_as_its_root_before_the_queue(tmp_path: Path, dry_run: bool) -> None:
    """What `latest` prints, pasted as --ckpt-dir, used to be queued and refused only on the node
    when the script started (after the queue wait): refused here, naming the root to use."""
    root = tmp_path / "ck"
    ckpt = Checkpointer(root, handle_signals=False)
    ckpt.save(3, {"w": 1})
    ckpt.close()
    step = root / "step_000000003"
    bindir, train = fake_slurm(tmp_path), script(tmp_path, GOOD)
    before = files(tmp_path)
    proc = cli(["submit", train, "--ckpt-dir", str(step), *(["--dry-run"] if dry_run else [])],
               tmp_path, {"PATH": str(bindir)})
    line = one_error(proc, "is a step folder, not a checkpoint root")
    assert f"--ckpt-dir {root}" in line
    assert files(tmp_path) == before
