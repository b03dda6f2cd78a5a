"""Where each sharded (DTensor / FSDP2) tensor goes on this rank, as a box of its global tensor,
and which saved ranks hold that box: geometry on shapes, offsets and placements, no I/O (no file
opened, no byte read; torch's placement classes are imported where they are asked about).

For each sharded name the live state decides the box this rank now owns (`targets`: a `Target`;
`box_of`, `boxes_of`), and `plan_reads` works out, in one pass, every box, the saved ranks whose
pieces intersect them (`sharding.Sharded.pieces_in`, `placement.holders`) and the staging bytes a
read of them takes. The reads themselves are `reshard`'s.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ..errors import ConfigError
from .dtensorspec import is_dtensor
from .placement import local_box
from .shard import ITEMSIZE
from .sharding import Sharded, check_placements


@dataclass(slots=True)  # slots: a restore plan makes one per DTensor (405B: 3,411 a rank)
class Target:
    """Where one sharded tensor goes on this rank: a DTensor (mesh + placements), or a plain
    tensor holding the whole global tensor. `live` is the user's tensor when there is one."""

    mesh: Any
    placements: Any
    live: Any

def _optimizer_params(state: Mapping[str, Any]) -> dict[str, Any]:
    """'opt/state/<id>/' -> the parameter, for torch optimizers in `state`, so that the state of
    a fresh optimizer (created at its first step) is rebuilt with its parameter's sharding."""
    import torch

    out: dict[str, Any] = {}
    for key, obj in state.items():
        if isinstance(obj, torch.optim.Optimizer):
            ids = [i for g in obj.state_dict()["param_groups"] for i in g["params"]]
            params = [p for g in obj.param_groups for p in g["params"]]
            out.update({f"{key}/state/{i}/": p for i, p in zip(ids, params)})
    return out

def targets(state: Mapping[str, Any], live: Mapping[str, Any], index: Mapping[str, Sharded],
            specs: Mapping[str, Any]) -> dict[str, Target]:
    """The rule (docs/design.md, "Another world size (elastic resume)"): a live DTensor at the same name gives its mesh and
    placements; else the optimizer's parameter for that state; else, when the live state holds
    DTensors, the saved placements on their mesh; else a plain tensor with the global value."""
    from torch.distributed.tensor import Replicate, Shard

    by_param = _optimizer_params(state) if not live.keys() >= index.keys() else {}
    mesh = next((t.device_mesh for t in live.values() if is_dtensor(t)), None)
    out: dict[str, Target] = {}
    kinds: dict[type, bool] = {}  # is_dtensor by type: asked once per type, not per tensor
    for name, tensor in index.items():
        t: Any = live.get(name)
        if t is not None:
            if t.shape != tensor.shape:  # torch.Size is a tuple
                raise ConfigError(f"tensor {name!r} is {list(tensor.shape)} in the checkpoint and {list(t.shape)} "
                                  "in this run's state: the model changed shape")
            dt = kinds.get(type(t))
            if dt is None:
                dt = kinds[type(t)] = is_dtensor(t)
            out[name] = Target(t.device_mesh, t.placements, t) if dt else Target(None, None, t)
            continue
        param: Any = by_param.get(name.rsplit("/", 1)[0] + "/")
        spec = specs.get(name)
        placements = spec.get("placements") if isinstance(spec, dict) else None
        if is_dtensor(param) and list(param.shape) == list(tensor.shape):
            out[name] = Target(param.device_mesh, param.placements, None)
        elif mesh is not None and placements and len(placements) == mesh.ndim:
            # the skeleton's spec, read here only (validate_skeleton(specs=False) left it to this)
            check_placements(placements, len(tensor.shape), f"checkpoint skeleton, DTensor {name!r}")
            parsed = [Replicate() if p == "replicate" else Shard(int(p[6:])) for p in placements]
            out[name] = Target(mesh, parsed, None)
        else:
            out[name] = Target(None, None, None)
    return out

def box_of(tensor: Sharded, target: Target) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """(shape, global offset) of this rank's box of `tensor` under `target`: by placement
    arithmetic for Shard/Replicate placements (torch's rule, `placement.local_box`; torch's own
    function costs ~30 us a call, most of a restore plan at 2,619 DTensors), else torch's."""
    if target.mesh is None:
        return tuple(tensor.shape), (0,) * len(tensor.shape)
    kinds = placement_kinds(tuple(target.placements))
    coord = target.mesh.get_coordinate() if kinds is not None else None
    if kinds is None or coord is None:
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, offset = compute_local_shape_and_global_offset(tensor.shape, target.mesh, target.placements)
        return tuple(shape), tuple(offset)
    offset, shape = local_box(tuple(tensor.shape), tuple(target.mesh.shape), tuple(coord), kinds)
    return shape, offset

def boxes_of(index: Mapping[str, Sharded], where: Mapping[str, Target]) -> dict[str, tuple[tuple[int, ...], tuple[int, ...]]]:
    """`box_of` of every tensor in `where`, asking each mesh its shape and this rank's coordinate
    once (DeviceMesh.shape costs ~100 us a call in torch 2.13: most of a restore plan, once per
    DTensor) and each placements tuple its kinds once."""
    meshes: dict[int, tuple[tuple[int, ...], tuple[int, ...]] | None] = {}
    return {name: _box(index[name], target, meshes) for name, target in where.items()}

def _box(tensor: Sharded, target: Target, meshes: dict[int, tuple[tuple[int, ...], tuple[int, ...]] | None]
         ) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """`box_of` of one tensor, the mesh's facts asked once per mesh (`meshes`, shared by the calls)."""
    kinds = placement_kinds(tuple(target.placements)) if target.mesh is not None else None
    facts = _mesh_facts(target.mesh, meshes) if kinds is not None else None
    if facts is None:
        return box_of(tensor, target)
    offset, shape = local_box(tuple(tensor.shape), facts[0], facts[1], kinds)
    return shape, offset

def _mesh_facts(mesh: Any, cache: dict[int, tuple[tuple[int, ...], tuple[int, ...]] | None]
                ) -> tuple[tuple[int, ...], tuple[int, ...]] | None:
    """(shape, this rank's coordinate) of `mesh`, asked once per mesh per call (None: not on it)."""
    if id(mesh) not in cache:
        coord = mesh.get_coordinate()
        cache[id(mesh)] = None if coord is None else (tuple(mesh.shape), tuple(coord))
    return cache[id(mesh)]

def _shard_class() -> Any:
    from torch.distributed.tensor import Shard

    return Shard

@functools.lru_cache(maxsize=64)
def placement_kinds(placements: tuple[Any, ...]) -> tuple[str, ...] | None:
    """Shard(d) / Replicate() placements as the manifest writes them; None for any other kind
    (a _StridedShard, a Partial: torch's function handles those)."""
    from torch.distributed.tensor import Replicate, Shard

    out = []
    for p in placements:
        if type(p) is Shard:
            out.append(f"shard:{p.dim}")
        elif type(p) is Replicate:
            out.append("replicate")
        else:
            return None
    return tuple(out)

def _kinds_by_type(placements: Sequence[Any], cache: dict[Any, tuple[str, ...] | None], shard: Any
                   ) -> tuple[str, ...] | None:
    """`placement_kinds` of `placements`, worked out once per distinct sequence of placement types (and a
    Shard's dim: all that `placement_kinds` reads of them) in `cache`: each DTensor has its own placement
    objects, and hashing or comparing them runs torch's Python __hash__ / __eq__ (~0.6 us a
    DTensor: 405B, 3,411 a rank, 2 ms of a restore plan). `shard`: torch's Shard class. One
    placement (FSDP's one mesh dimension): its dim or type is the key, no tuple built."""
    if len(placements) == 1:
        p = placements[0]
        key: Any = p.dim if type(p) is shard else type(p)
    else:
        key = tuple([p.dim if type(p) is shard else type(p) for p in placements])
    kinds = cache.get(key, ())
    if kinds == ():
        kinds = cache[key] = placement_kinds(tuple(placements))
    return kinds

def _holders(tensor: Sharded, target: Target, box: tuple[tuple[int, ...], tuple[int, ...]],
             meshes: dict[int, tuple[tuple[int, ...], tuple[int, ...]] | None]) -> tuple[int, ...]:
    """The saved ranks holding `box` (shape, offset) of `tensor` (`source_ranks` of one tensor)."""
    shape, offset = box
    if not math.prod(shape):
        return ()
    if tensor.layout is not None and target.mesh is not None and "replicate" not in tensor.layout[1]:
        facts = _mesh_facts(target.mesh, meshes)
        if (facts is not None and facts[0] == tuple(tensor.layout[0])
                and placement_kinds(tuple(target.placements)) == tuple(tensor.layout[1])):
            rank = 0
            for c, n in zip(facts[1], facts[0]):  # row-major, as placement.holders numbers them
                rank = rank * n + c
            return (rank,)
    return tuple(p.rank for p in tensor.pieces_in(tuple(offset), tuple(shape)))

def plan_reads(index: Mapping[str, Sharded], where: Mapping[str, Target]
               ) -> tuple[dict[str, tuple[tuple[int, ...], tuple[int, ...]]], set[int], int]:
    """(`boxes_of`, the saved ranks holding those boxes, the bytes of fresh memory a staged
    `load_sharded` of them takes) of `where`, in one pass: the tensors placed by
    arithmetic with one global shape, layout, mesh and target placements (a model's layers repeat
    a few: 405B, 3,411 DTensors per rank) share one box and one set of holders, worked out once."""
    meshes: dict[int, tuple[tuple[int, ...], tuple[int, ...]] | None] = {}
    Hit = tuple[tuple[tuple[int, ...], tuple[int, ...]], tuple[int, ...], int]  # box, holders, staging bytes
    memo: dict[tuple[Any, ...], Hit] = {}
    boxes: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    sources: set[int] = set()
    staging = 0
    kinds_of: dict[Any, tuple[str, ...] | None] = {}
    shard = _shard_class()
    for name, target in where.items():
        tensor = index[name]
        kinds = _kinds_by_type(target.placements, kinds_of, shard) if target.mesh is not None else None
        key = (tensor.shape, tensor.dtype, tensor.layout, id(target.mesh), kinds) if tensor.layout and kinds else None
        hit = memo.get(key) if key is not None else None
        if hit is None:
            box = _box(tensor, target, meshes)
            hit = (box, _holders(tensor, target, box, meshes), math.prod(box[0]) * ITEMSIZE[tensor.dtype])
            if key is not None:
                memo[key] = hit
        boxes[name] = hit[0]
        sources.update(hit[1])
        staging += hit[2]
    return boxes, sources, staging
