"""A DTensor as it is saved: its local tensor and a JSON spec of the box it is of its global
tensor (global shape, this rank's offset and local shape, placements, mesh shape; `describe`,
every rank, from `state.flatten`). The manifest's tensor index carries every piece's global
shape and offset (commit.write_rank); a restore reads them back as boxes (`boxes`, `reshard`).
"""

from __future__ import annotations

from typing import Any

from ..errors import ConfigError


def is_dtensor(t: Any) -> bool:
    return hasattr(t, "device_mesh") and hasattr(t, "placements") and hasattr(t, "to_local")


def describe(dt: Any, where: str) -> tuple[Any, dict[str, Any]]:
    """(local tensor, JSON spec) of a DTensor on this rank. Refuses placements that are not a
    box of the global tensor (Partial sums, FSDP2+TP strided shards)."""
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    names = []
    for p in dt.placements:
        if type(p) is Shard:
            names.append(f"shard:{p.dim % max(dt.ndim, 1)}")
        elif isinstance(p, Replicate):
            names.append("replicate")
        else:
            raise ConfigError(f"cannot checkpoint DTensor at '{where}' with placement {p}: only Shard and "
                              "Replicate are saved as boxes; redistribute() it (or save full_tensor()) first")
    local = dt.to_local()
    shape, offset = compute_local_shape_and_global_offset(dt.shape, dt.device_mesh, dt.placements)
    if list(shape) != list(local.shape):
        raise ConfigError(f"DTensor at '{where}': local tensor {list(local.shape)} is not the "
                          f"{list(shape)} its placements give (padded?): save an unpadded DTensor")
    return local, {"shape": list(dt.shape), "offset": [int(o) for o in offset], "local_shape": list(shape),
                   "placements": names, "mesh_shape": list(dt.device_mesh.shape),
                   "mesh_arange": _is_arange(dt.device_mesh)}


_ARANGE: dict[int, tuple[Any, bool]] = {}  # id(mesh) -> (mesh, whether its ranks are 0..n-1 in order)


def _is_arange(mesh: Any) -> bool:
    """Whether the mesh's rank at each coordinate is its row-major index (init_device_mesh over
    every rank): then a saved rank's piece follows from its rank and the placements alone."""
    hit = _ARANGE.get(id(mesh))
    if hit is None or hit[0] is not mesh:
        ranks = mesh.mesh.flatten().tolist()
        hit = _ARANGE[id(mesh)] = (mesh, ranks == list(range(len(ranks))))
    return hit[1]
