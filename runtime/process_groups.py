"""Process-group helpers: small object exchanges without pickling, a side group for checks."""

from __future__ import annotations

import itertools
import json
import threading
from datetime import timedelta

import torch
import torch.distributed as dist


class _WorldTables:
    """What this module keeps for one default process group.

    ``labels``: group name -> a label that is the same on every rank (e.g. "mesh dim
    'shard' of size 2"): on a 2-D mesh each rank's shard group is a different group with
    a different name; comparisons across ranks (the consistency check) use the label.
    ``post_forward``: (mesh ranks, group size) -> the mesh whose dim 1 is
    ``reshard_after_forward=<int>``'s group: one set of groups for every unit that asks.
    ``tensor_parallel``: names of the groups of the meshes tensor parallelism put
    parameters on (their collectives are DTensor's, not ours). ``side``: the side group.
    ``verified``: the collective fingerprints the consistency check compared already."""

    def __init__(self) -> None:
        self.labels: dict[str, str] = {}
        self.post_forward: dict[tuple, object] = {}
        self.tensor_parallel: set[str] = set()
        self.side = None
        self.verified: set[str] = set()


# id(default process group) -> (that group, its tables). Per default group, not one for
# the process: ranks that are threads of one process (torch's ``threaded`` group, as
# ``MultiThreadedTestCase`` runs them) each have their own default group, and must not
# find the groups another thread-rank created (a group is created by every rank of the
# world together: a rank that found one cached skipped the creation, and the others
# hung in it); and group names are reused after ``destroy_process_group``, so a process
# group made again starts with empty tables (the side group of the old one is gone).
_TABLES: dict[int, tuple[object, _WorldTables]] = {}
_TABLES_LOCK = threading.Lock()
_TABLES_KEPT = 16  # default groups whose tables are kept: the most recently created


def _default_group():
    return dist.group.WORLD if dist.is_initialized() else None


def _tables() -> _WorldTables:
    """The tables of this rank's default process group (made on first use)."""
    world = _default_group()
    with _TABLES_LOCK:
        entry = _TABLES.get(id(world))
        if entry is None or entry[0] is not world:
            _TABLES.pop(id(world), None)
            entry = _TABLES[id(world)] = (world, _WorldTables())
            while len(_TABLES) > _TABLES_KEPT:
                _TABLES.pop(next(iter(_TABLES)))
        return entry[1]


def verified_fingerprints() -> set[str]:
    """The collective fingerprints compared across the ranks of this process group."""
    return _tables().verified


def group_label(group_name: str) -> str:
    """A rank-independent name for a group: a dimension of a mesh we were given, else
    the group's shape (each rank's tensor-parallel group is another group, with
    another name), else the name itself."""
    label = _tables().labels.get(group_name)
    if label is not None:
        return label
    from fsdp_compile.base.compat import group_ranks

    ranks = group_ranks(group_name)
    if ranks is None or len(ranks) < 2:
        return group_name
    strides = {b - a for a, b in itertools.pairwise(ranks)}
    return f"{len(ranks)} ranks, stride {strides.pop()}" if len(strides) == 1 else group_name


def label_mesh_groups(mesh, *, tensor_parallel: bool = False, data_parallel_dims: tuple[int, ...] = ()) -> None:
    """Name each dimension's group of ``mesh`` the same on every rank ("mesh dim 'dp'
    of size 2"): each rank's group along a dimension of a multi-dimensional mesh is
    a different group, with a different name. ``tensor_parallel``: the groups of its
    dimensions but ``data_parallel_dims`` are tensor-parallel ones."""
    from fsdp_compile.base.compat import group_name_of

    tables = _tables()
    for dim in range(mesh.ndim):
        name = group_name_of(mesh.get_group(dim))
        dim_name = mesh.mesh_dim_names[dim] if mesh.mesh_dim_names else str(dim)
        tables.labels[name] = f"mesh dim {dim_name!r} of size {mesh.size(dim)}"
        if tensor_parallel and dim not in data_parallel_dims:
            tables.tensor_parallel.add(name)


def is_tensor_parallel_group(group_name: str | None) -> bool:
    return group_name in _tables().tensor_parallel


def all_gather_json(value, group=None, device: torch.device | None = None) -> list:
    """Every rank's ``value`` (JSON-able), with two small all-gathers.

    ``all_gather_object`` would pickle and needs numpy; JSON keeps it to
    plain data and to the bytes that travel.
    """
    device = device or torch.device("cpu")
    payload = torch.tensor(list(json.dumps(value).encode()), dtype=torch.uint8, device=device)
    world_size = dist.get_world_size(group)
    sizes = [torch.zeros(1, dtype=torch.long, device=device) for _ in range(world_size)]
    dist.all_gather(sizes, torch.tensor([payload.numel()], device=device), group=group)
    longest = max(int(s.item()) for s in sizes)
    padded = torch.zeros(longest, dtype=torch.uint8, device=device)
    padded[: payload.numel()] = payload
    gathered = [torch.empty_like(padded) for _ in range(world_size)]
    dist.all_gather(gathered, padded, group=group)
    return [json.loads(bytes(g[: int(n.item())].tolist()).decode()) for g, n in zip(gathered, sizes, strict=True)]


def side_group(timeout_s: float):
    """A gloo group over all ranks for our own checks, apart from the training traffic.

    Created on first use, which every rank must reach (it is a collective call).
    """
    tables = _tables()
    if tables.side is None:
        tables.side = dist.new_group(backend="gloo", timeout=timedelta(seconds=timeout_s))
    return tables.side


def is_real_multi_rank() -> bool:
    """True when there are several real ranks to talk to (not the ``fake`` backend)."""
    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and dist.get_backend() != "fake"


class DataParallelMesh:
    """Which mesh dimension shards and which replicates, resolved to group names.

    * 1-D mesh, ``shard=True`` — FSDP: parameters ``Shard(0)`` over the mesh.
    * 2-D mesh ``(replicate, shard)`` — HSDP: ``(Replicate(), Shard(0))``; the
      gradient is reduce-scattered over the shard dimension, then all-reduced
      over the replicate dimension.
    * 1-D mesh, ``shard=False`` — DDP (``replicate``): ``Replicate()``;
      gradients are all-reduced over the mesh.

    Attributes:
        mesh: the ``DeviceMesh`` given to ``fully_shard`` / ``replicate``.
        shard_group_name: the functional collectives' name of the shard group
            (``None`` in DDP mode).
        shard_world_size, shard_rank: size of, and this rank's index in, the shard group.
        replicate_group_name: the replicate group (``None`` in FSDP mode).
        spmd: with FSDP2's ``dp_mesh_dims``, the full mesh parameters and modules compute
            on and which of its dims ``mesh`` stands for (``fsdp_compile._tensor_parallel.SpmdMesh``);
            else ``None``.
    """

    def __init__(self, mesh, *, shard: bool = True, spmd=None) -> None:
        from fsdp_compile.base.compat import group_name_of

        self.mesh = mesh
        self.spmd = spmd
        if mesh.ndim == 2:
            shard_dim, replicate_dim = 1, 0
        elif shard:
            shard_dim, replicate_dim = 0, None
        else:
            shard_dim, replicate_dim = None, 0
        self.shard_dim, self.replicate_dim = shard_dim, replicate_dim
        self.shard_group_name = None if shard_dim is None else group_name_of(mesh.get_group(shard_dim))
        self.shard_world_size = 1 if shard_dim is None else mesh.size(shard_dim)
        self.shard_rank = 0 if shard_dim is None else mesh.get_local_rank(shard_dim)
        self.replicate_group_name = None if replicate_dim is None else group_name_of(mesh.get_group(replicate_dim))
        label_mesh_groups(mesh)

    @property
    def shards(self) -> bool:
        return self.shard_dim is not None

    @property
    def shard_mesh(self):
        """The 1-D ``DeviceMesh`` of the shard group (what FSDP2 hands the all-gather
        extension's pre hook); ``None`` in DDP mode."""
        if self.shard_dim is None:
            return None
        if self.mesh.ndim == 1:
            return self.mesh
        names = self.mesh.mesh_dim_names
        if names is not None:
            return self.mesh[names[self.shard_dim]]
        from torch.distributed.device_mesh import DeviceMesh

        return DeviceMesh.from_group(self.mesh.get_group(self.shard_dim), self.mesh.device_type)

    def placements(self, sharded: bool, shard_dim: int = 0, tp_placements: tuple = (), tp_shards: int = 1) -> tuple:
        """DTensor placements of a parameter on this mesh's dimensions, followed by its
        tensor-parallel placements (``tp_placements``) on the TP mesh's.

        ``sharded``: split along ``shard_dim`` here. A dim that tensor parallelism
        already splits into ``tp_shards`` pieces is split here *within* each TP
        piece, which DTensor spells ``_StridedShard(dim, split_factor=tp_shards)``
        (FSDP2's placement, so checkpoints interchange)."""
        from torch.distributed.tensor import Replicate, Shard

        from fsdp_compile.base.compat import strided_shard

        out = [Replicate()] * self.mesh.ndim
        if sharded and self.shard_dim is not None:
            out[self.shard_dim] = strided_shard(shard_dim, tp_shards) if tp_shards > 1 else Shard(shard_dim)
        return (*out, *tp_placements)

    def post_forward_group(self, size: int) -> tuple[str, int, int]:
        """The smaller group ``reshard_after_forward=size`` keeps shards over, as FSDP2's:
        the mesh's ranks in rows of ``size`` consecutive ranks (within one shard group,
        as ``size`` divides it). Returns (group name, ``size``, this rank's index in it).
        Creates the groups on first use: a collective over the mesh's ranks."""
        from torch.distributed.device_mesh import DeviceMesh

        from fsdp_compile.base.compat import group_name_of

        key = (tuple(self.mesh.mesh.flatten().tolist()), size)
        tables = _tables()
        mesh = tables.post_forward.get(key)
        if mesh is None:  # first use in this process group
            rows = self.mesh.mesh.reshape(-1, size)
            mesh = DeviceMesh(self.mesh.device_type, rows, mesh_dim_names=("post_forward_rows", "post_forward"))
            label_mesh_groups(mesh)
            tables.post_forward[key] = mesh
        return group_name_of(mesh.get_group(1)), size, mesh.get_local_rank(1)

    def reduce_group_names(self, sharded: bool) -> tuple[str, ...]:
        """Groups an all-reduced (not reduce-scattered) gradient is summed over, in order."""
        names = []
        if self.shard_group_name is not None and not sharded and self.shard_world_size > 1:
            names.append(self.shard_group_name)
        if self.replicate_group_name is not None and self.mesh.size(self.replicate_dim) > 1:
            names.append(self.replicate_group_name)
        return tuple(names)
