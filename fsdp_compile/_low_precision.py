"""Low-precision parameters: FSDP2's all-gather extension for tensor subclasses.

A parameter whose data is a tensor subclass defining

    fsdp_pre_all_gather(mesh) -> (inputs, metadata)
    fsdp_pre_all_gather(mesh, outer_size, outer_stride, module, mp_policy) -> (inputs, metadata)
    fsdp_post_all_gather(outputs, metadata, param_dtype, *, out=None) -> (tensor, inner_tensors)

(torchao's ``NF4Tensor`` for QLoRA, its float8 training weight wrapper, its int8
training weights, ...) decides what its all-gather moves (``inputs``: tensors of any
dtypes and sizes, e.g. 4-bit codes and their scales) and what the module computes with
(the post hook's tensor), as with FSDP2 (``torch/distributed/fsdp/_fully_shard/
_fsdp_param.py``). Here:

- the shard keeps the subclass: ``sharded_param`` is a ``DTensor`` whose local tensor is
  this rank's rows of the subclass tensor, so ``state_dict()``, DCP and ``full_tensor()``
  see what they see with FSDP2;
- a gather calls the pre hook on the local shard, all-gathers its inputs in one
  collective as bytes (``uint8`` views: gloo has no float8 all-gather, and one buffer
  carries inputs of several dtypes), splits the output back into one tensor per input
  (every rank's rows in rank order, as FSDP2 hands them over) and calls the post hook
  without ``out=``: each gather builds its compute tensor afresh, in eager code as in a
  compiled graph, where the hooks are traced like the module's own code;
- gradients: a trainable parameter's gradient (a plain tensor of the full shape) goes
  through the same reduction as any other's (``gather_with_grad_sync``'s backward); a
  frozen one (NF4) has none.

Rows that do not divide evenly are split as ``torch.chunk`` splits them (a tail rank may
hold none), as FSDP2 splits them: the pre hook gets the full ``outer_size`` and must pad
its shard's inputs to ``ceil(rows / world_size)`` rows (FSDP2 requires the same); the
post hook's tensor is then cut back to the parameter's rows.

Hooks set on the shard's local tensor (or its class) after ``fully_shard`` are picked up
at the next eager gather, as FSDP2 reads them there (:meth:`FSDPParam.notice_late_extension`);
a compiled graph keeps what it was traced with.

Limits (checked at ``fully_shard``, by name): shards on dim 0 only, no tensor parallelism
around them, and no ``reshard_after_forward=<int>`` (FSDP2 has the same limits).
"""

from __future__ import annotations

import inspect
from typing import TYPE_CHECKING

import torch
import torch.nn as nn

from fsdp_compile.base.compat import NO_ANNOTATION, annotating, fx_annotate, is_user_tensor_subclass
from fsdp_compile.runtime.collectives import NO_ACCUMULATION, GradAccumulation, all_gather_as_bytes, gather_with_grad_sync

if TYPE_CHECKING:
    from fsdp_compile._fsdp_param import FSDPParam


def has_all_gather_extension(data: torch.Tensor) -> bool:
    """Whether ``data`` (a parameter's tensor, or a shard's local tensor) defines FSDP2's
    all-gather extension."""
    return hasattr(data, "fsdp_pre_all_gather") and hasattr(data, "fsdp_post_all_gather")


def is_other_subclass(data: torch.Tensor) -> bool:
    """A tensor subclass without the extension: sharded keeping its subclass, as one with it,
    and it must get the extension's hooks (on its local tensor, as FSDP2 reads them) before
    its first gather, which otherwise raises (rather than silently gather it as a plain
    tensor, or turn it into one)."""
    from torch.distributed.tensor import DTensor

    return is_user_tensor_subclass(data) and not isinstance(data, DTensor) and not has_all_gather_extension(data)


def check_param_type(
    fqn: str, data: torch.Tensor, *, shard_dim: int, shard_world_size: int | None, reshards_to_int: bool
) -> None:
    """Raise, naming the parameter, where its tensor type cannot be sharded as asked: a
    subclass without the extension, or the extension's limits (``shard_world_size``:
    ``None`` where the mesh replicates). Runs before any collective."""
    if isinstance(data, nn.Parameter) and type(data) is not nn.Parameter and not has_all_gather_extension(data):
        data = data.detach()  # an nn.Parameter subclass of a plain tensor
    awaits_extension = is_other_subclass(data)
    if not awaits_extension and not has_all_gather_extension(data):
        return
    what = f"fully_shard: parameter {fqn!r} is a {type(data).__name__} (FSDP2's all-gather extension)"
    if awaits_extension:  # its shards must get the hooks before the first gather (as FSDP2's must)
        what = (
            f"fully_shard: parameter {fqn!r} is a {type(data).__name__}, a tensor subclass without FSDP2's all-gather "
            "extension yet (its shards must get fsdp_pre_all_gather / fsdp_post_all_gather before the first gather)"
        )
    if shard_world_size is None:
        raise NotImplementedError(f"{what}: replicate() does not support it; shard it with fully_shard")
    if shard_dim != 0:
        raise NotImplementedError(f"{what}: it can only be sharded on dim 0 (shard_placement_fn gave dim {shard_dim})")
    if data.ndim == 0:
        raise ValueError(f"{what}: a 0-dim parameter cannot be sharded on dim 0; leave it out (ignored_params)")
    if reshards_to_int:
        raise NotImplementedError(f"{what}: reshard_after_forward=<int> is not supported for it (nor in FSDP2); pass True/False")
    try:  # the subclass's own split (views): its constraints (NF4: whole groups of 64 x 256 values a shard)
        pieces = [_rows_of(data.detach(), shard_world_size, rank) for rank in range(shard_world_size)]
    except Exception as error:  # noqa: BLE001 - any refusal of the subclass, reported with the parameter's name
        raise ValueError(f"{what}: its subclass cannot split it into {shard_world_size} shards: {error}") from error
    expected = [_row_count(data.shape[0], shard_world_size, rank) for rank in range(shard_world_size)]
    if [p.shape[0] for p in pieces] != expected:
        raise ValueError(f"{what}: its subclass split it into {[tuple(p.shape) for p in pieces]}, not rows {expected}")


def _row_count(rows: int, world_size: int, rank: int) -> int:
    """How many of ``rows`` rank ``rank`` holds (``torch.chunk``'s split, as ``Shard(0)``)."""
    per_rank = -(-rows // world_size)
    return max(0, min(rows - rank * per_rank, per_rank))


def _rows_of(data: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """Rank ``rank``'s rows of ``data``: the subclass's own ``torch.chunk`` (a view; NF4 has
    no other split), an empty view for a tail rank past the last row."""
    pieces = torch.chunk(data, world_size, dim=0)
    return pieces[rank] if rank < len(pieces) else data.narrow(0, data.shape[0], 0)


def shard_extension_param(data: torch.Tensor, world_size: int, rank: int) -> torch.Tensor:
    """This rank's rows of ``data``, still of its subclass, in storage of their own (the
    subclass's own ``split``, ``new_zeros`` and ``copy_``, the ops FSDP2 uses, so the
    rest of the tensor is freed)."""
    rows = _rows_of(data, world_size, rank)
    local = rows.new_zeros(rows.shape)
    local.copy_(rows)
    return local


def pre_all_gather_arity(fqn: str, local: torch.Tensor) -> int:
    """How many arguments ``local``'s pre hook takes (FSDP2's rule: one, ``(mesh)``; five,
    ``(mesh, outer_size, outer_stride, module, mp_policy)``); read once, at ``fully_shard``
    (Dynamo cannot trace ``inspect``)."""
    n_params = len(inspect.signature(local.fsdp_pre_all_gather).parameters)
    if n_params not in (1, 5):
        raise TypeError(
            f"fully_shard: parameter {fqn!r}: {type(local).__name__}.fsdp_pre_all_gather takes {n_params} arguments; "
            "FSDP2's extension defines (mesh) or (mesh, outer_size, outer_stride, module, mp_policy)"
        )
    return n_params


def pre_all_gather(fsdp_param: FSDPParam, local: torch.Tensor) -> tuple[tuple[torch.Tensor, ...], object]:
    """The pre hook, called with the signature it declares (:func:`pre_all_gather_arity`)."""
    mesh = fsdp_param.dp_mesh.shard_mesh
    if fsdp_param.pre_all_gather_arity == 1:
        inputs, metadata = _call_hook(local, "fsdp_pre_all_gather", mesh)
    else:
        module = fsdp_param.owner[0] if fsdp_param.owner is not None else None
        shape = fsdp_param.sharded_param.shape
        stride = _contiguous_stride(shape)
        inputs, metadata = _call_hook(local, "fsdp_pre_all_gather", mesh, shape, stride, module, fsdp_param.unit.mp_policy)
    return tuple(inputs), metadata


def _call_hook(local: torch.Tensor, name: str, *args):
    """``local``'s hook ``name``: one set on the tensor itself (FSDP2 reads the hooks off
    the local tensor, so they may be attached to it after ``fully_shard``), else its
    class's, called as a function (Dynamo then inlines it; a method call on a tensor would
    be recorded as one opaque op, which cannot return metadata)."""
    own = vars(local).get(name)
    return own(*args) if own is not None else getattr(type(local), name)(local, *args)


def gather_extension_params(fsdp_params: list[FSDPParam], sources: list[torch.Tensor]) -> list[torch.Tensor]:
    """The compute tensors of ``fsdp_params`` (of one shard group) from their shards' local
    tensors ``sources``, with one all-gather for all of them (FSDP2's: one per unit); no
    autograd (a trainable parameter's gradient is connected by the caller)."""
    pre = [pre_all_gather(p, source) for p, source in zip(fsdp_params, sources, strict=True)]
    layout = fsdp_params[0].layout
    outputs = all_gather_as_bytes([t for inputs, _ in pre for t in inputs], layout.world_size, layout.group_name)
    fulls = []
    for p, source, (inputs, metadata) in zip(fsdp_params, sources, pre, strict=True):
        mine, outputs = tuple(outputs[: len(inputs)]), outputs[len(inputs) :]
        param_dtype = p.param_dtype or p.sharded_param.dtype
        full, _inner = _call_hook(source, "fsdp_post_all_gather", mine, metadata, param_dtype)
        rows = p.sharded_param.shape[0]
        fulls.append(full if full.shape[0] == rows else full.narrow(0, 0, rows))  # (padded rows: see above)
    return fulls


def gather_extension_param(fsdp_param: FSDPParam, source: torch.Tensor) -> torch.Tensor:
    return gather_extension_params([fsdp_param], [source])[0]


def with_gradient_reduction(
    fsdp_param: FSDPParam,
    full: torch.Tensor,
    carrier: torch.Tensor | None,
    accumulation: GradAccumulation = NO_ACCUMULATION,
) -> torch.Tensor:
    """``full`` whose gradient is reduced into the shard as any parameter's, through
    ``carrier`` (a tensor whose gradient reaches the sharded parameter): ``gather_with_grad_sync``
    handed ``full`` as already gathered (``accumulation`` as there); ``full`` itself
    where ``carrier`` is ``None`` (a frozen parameter, or no grad mode)."""
    if carrier is None:
        return full
    return gather_with_grad_sync(carrier, fsdp_param.spec, accumulation, kept=full)


def gather_extension_with_grad(
    fsdp_param: FSDPParam,
    source: torch.Tensor,
    carrier: torch.Tensor | None,
    accumulation: GradAccumulation = NO_ACCUMULATION,
) -> torch.Tensor:
    """:func:`gather_extension_param` then :func:`with_gradient_reduction`."""
    with fx_annotate(fsdp_param.spec.meta) if annotating() else NO_ANNOTATION:
        full = gather_extension_param(fsdp_param, source)
    return with_gradient_reduction(fsdp_param, full, carrier, accumulation)


# [Note: side tensors of a traced gather] torchao 0.18's float8 weight wrapper keeps the
# scale ``precompute_float8_dynamic_scale_for_fsdp`` computed in ``_precomputed_scale``, but
# its ``__tensor_flatten__`` tests that tensor's truth (a data-dependent branch on
# AOTAutograd's fake tensors) and its ``__tensor_unflatten__`` drops it, so a compiled graph
# cannot take the wrapper with its scale as an input. A traced gather therefore takes the
# local tensor's ``detach()`` (the same storage, no such attribute) and each attribute named
# here as an input of its own, and sets it on a ``detach()`` of that input (never on the
# graph's input itself) before the pre hook reads it.
SIDE_TENSOR_ATTRIBUTES = ("_precomputed_scale",)


def side_tensors(local: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
    """The :data:`SIDE_TENSOR_ATTRIBUTES` of ``local`` (``None`` where unset)."""
    return tuple(getattr(local, name, None) for name in SIDE_TENSOR_ATTRIBUTES)


def traced_gather(fsdp_param: FSDPParam):
    """:func:`gather_extension_with_grad` for ``fsdp_param`` as one node of Dynamo's graph
    (``allow_in_graph``), which AOTAutograd then traces through. The hooks are the
    subclass's own Python, which Dynamo may not follow (NF4's pre hook reads
    ``storage_offset()``), and Dynamo would speculate the gradient's backward with a
    gradient of the compute tensor's subclass, while the gradient that arrives is a plain
    tensor; AOTAutograd runs all of it on its fake tensors like any code. ``source`` is the
    local tensor's ``detach()``, ``side`` its side tensors (see [Note: side tensors of a
    traced gather])."""

    # (The accumulation's fields as arguments of their own: an ``allow_in_graph`` function
    # takes tensors.)
    def gather(source, side, carrier, pending, accumulator, partial_pending, partial_accumulator):
        if any(tensor is not None for tensor in side):
            source = source.detach()  # set on a tensor of our own, not on the graph's input
            for name, tensor in zip(SIDE_TENSOR_ATTRIBUTES, side, strict=True):
                if tensor is not None:
                    setattr(source, name, tensor)
        accumulation = GradAccumulation(pending, accumulator, partial_pending, partial_accumulator)
        return gather_extension_with_grad(fsdp_param, source, carrier, accumulation)

    return torch.compiler.allow_in_graph(gather)


def _contiguous_stride(shape) -> tuple[int, ...]:
    stride, acc = [], 1
    for size in reversed(shape):
        stride.append(acc)
        acc *= max(size, 1)
    return tuple(reversed(stride))
