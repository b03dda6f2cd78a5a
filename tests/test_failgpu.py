"""Issue 47, item 4: the failure-time save with the state on a GPU (train/failgpu.py). The CPU tests
run everywhere; the CUDA ones run when a GPU is lent (`pytest tests/test_failgpu.py` on it)."""

from __future__ import annotations

import pytest
import torch

from slurmresume.train import failgpu

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


def test_cpu_tensors_pass_through_and_gloo_is_left_alone(tmp_path) -> None:
    import torch.distributed as dist

    t = torch.arange(6.0)
    assert failgpu.to_host([("a", t)])[0][1] is t and not failgpu.on_gpu([("a", t)])
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    try:
        assert failgpu.release(None) is None
        x = torch.ones(2)
        dist.all_reduce(x)  # gloo still works: nothing was aborted
        assert x.tolist() == [1.0, 1.0]
    finally:
        dist.destroy_process_group()


@cuda
def test_to_host_does_not_wait_for_a_blocked_compute_stream() -> None:
    """The default stream is busy for ~20 s (a spinning kernel, as behind a hung NCCL collective):
    the copy on a side stream returns the boundary's bytes while that stream is still busy."""
    params = torch.randn(1 << 20, device="cuda")
    expect = params.cpu()
    torch.cuda.synchronize()
    torch.cuda._sleep(int(2e10))  # queued on the default stream
    got = failgpu.to_host([("p", params)])
    assert not torch.cuda.current_stream().query(), "the blocked stream finished first: the test proves nothing"
    assert got[0][1].device.type == "cpu" and torch.equal(got[0][1], expect)


@cuda
def test_release_aborts_an_nccl_group(tmp_path) -> None:
    import torch.distributed as dist

    dist.init_process_group("nccl", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    x = torch.ones(2, device="cuda")
    dist.all_reduce(x)
    torch.cuda.synchronize()
    assert failgpu.release(None) is None
    with pytest.raises(Exception):  # noqa: B017, PT011 - aborted: any further collective fails
        dist.all_reduce(x)
        torch.cuda.synchronize()
