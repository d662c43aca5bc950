"""Every private torch API the library touches, in one place (tests' and benchmarks'
are in :mod:`fsdp_compile.testing._torch_internals`).

A torch upgrade that moves one of these should need an edit here only.
Each name is listed with the torch file it comes from (torch 2.13).
"""

from __future__ import annotations

import contextlib
import functools
from typing import Callable

import torch
import torch._functorch.config as functorch_config

# torch/_ops.py: the functional collective ops (traceable, return a tensor that
# must be passed to wait_tensor before use).
c10d_functional = torch.ops._c10d_functional

# torch/fx/traceback.py: attach a dict to node.meta["custom"] of every FX node
# traced inside the context; Dynamo supports it and AOTAutograd carries it into
# the joint graph, which is how passes recognise the nodes our runtime emitted. It
# writes one process-wide dict: code that runs eagerly too enters it only while a graph
# is traced (``with fx_annotate(meta) if annotating() else NO_ANNOTATION:``), since eager
# code on several threads (ranks as threads) would leave it changed for later traces.
# Called where the ``with`` is, not returned from a helper: Dynamo handles the call there.
from torch.fx.traceback import annotate as fx_annotate  # noqa: E402

#: What code that runs eagerly too enters instead of :func:`fx_annotate` when nothing is traced.
NO_ANNOTATION = contextlib.nullcontext()


def annotating() -> bool:
    """Whether a graph is being traced now, so :func:`fx_annotate` has nodes to annotate: by
    Dynamo, or by ``make_fx`` (AOTAutograd's joint graph, compiled autograd)."""
    if torch.compiler.is_compiling():
        return True
    from torch.fx.experimental.proxy_tensor import get_proxy_mode

    return get_proxy_mode() is not None


# torch/utils/_pytree.py: map over nested containers (Dynamo traces it).
from torch.utils._pytree import tree_map  # noqa: E402

# torch/utils/checkpoint.py: partitioner policy tags in node.meta["recompute"].
from torch.utils.checkpoint import CheckpointPolicy  # noqa: E402  (public, listed for completeness)

# torch/_ops.py: the type of ``torch.ops.<namespace>.<op>.<overload>`` (FX node targets).
OpOverload = torch._ops.OpOverload


# aten/src/ATen/native/TensorShape.cpp ``_chunk_cat(tensors, dim, num_chunks)``: each
# tensor split into ``num_chunks`` chunks along ``dim`` as ``torch.chunk`` would, each chunk
# zero-padded to the first's size, and chunk ``i`` of every tensor side by side in row
# ``i`` of the output (FSDP2's reduce-scatter copy-in). One op instead of a copy per tensor.
chunk_cat = torch._chunk_cat


def stable_topological_sort(graph) -> None:
    """torch/_inductor/pattern_matcher.py: reorder ``graph``'s nodes so each comes after
    its inputs, otherwise keeping the current order (a node that is early waits and is
    placed right after the last of its inputs)."""
    from torch._inductor.pattern_matcher import stable_topological_sort as _sort

    _sort(graph)


def detect_fake_mode(tensors):
    """torch/_guards.py: the FakeTensorMode the given (fake) tensors belong to, if any."""
    return torch._guards.detect_fake_mode(tensors)


# torch/_inductor/custom_graph_pass.py: base class of Inductor custom passes
# (a __call__ on the graph plus a uuid() that keys Inductor's caches).
from torch._inductor.custom_graph_pass import CustomGraphPass  # noqa: E402
from torch._inductor.custom_graph_pass import get_hash_for_files as _hash_for_files  # noqa: E402


def hash_of_files(paths: tuple[str, ...], extra: str = "") -> bytes:
    return _hash_for_files(paths, extra)


def get_post_grad_custom_post_pass():
    """torch/_inductor/config.py: passes run on each post-grad graph (forward and backward)."""
    import torch._inductor.config as inductor_config

    return inductor_config.post_grad_custom_post_pass


def set_post_grad_custom_post_pass(value) -> None:
    """Set the post-grad passes, a list; torch before 2.12 (its Inductor takes one pass, no
    ``get_custom_graph_passes``) gets them as one :class:`_PostGradPasses`."""
    import torch._inductor.config as inductor_config
    from torch._inductor import custom_graph_pass

    if isinstance(value, list) and not hasattr(custom_graph_pass, "get_custom_graph_passes"):
        value = _PostGradPasses(value)
    inductor_config.post_grad_custom_post_pass = value


class _PostGradPasses(list, CustomGraphPass):
    """Several post-grad passes as the one pass older Inductors take: runs each in order;
    its uuid is theirs (so Inductor's cache still tells settings apart)."""

    def __call__(self, graph) -> None:
        for graph_pass in self:
            graph_pass(graph)

    def uuid(self):
        return tuple(p.uuid() if isinstance(p, CustomGraphPass) else repr(p) for p in self)


def fx_graph_cache_pickler() -> type:
    """torch/_inductor/codecache.py ``FxGraphCachePickler``: the pickler whose output keys
    Inductor's FX-graph cache (its ``dispatch_table`` maps a type to its reducer)."""
    from torch._inductor.codecache import FxGraphCachePickler

    return FxGraphCachePickler


def device_mesh_class() -> type:
    """torch/distributed/device_mesh.py ``DeviceMesh``."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh


def local_tensor_of(dtensor) -> torch.Tensor:
    """torch/distributed/tensor/_api.py: a ``DTensor``'s own local tensor (not a view of it)."""
    return dtensor._local_tensor


class _AliasOfLocalTensor(torch.autograd.Function):
    """``DTensor.to_local()`` without the view: the local tensor's ``detach()``, which shares
    its storage and version counter but carries no autograd view metadata, so in-place
    writes to the parameter (optimizer steps) never make autograd regenerate its
    ``grad_fn`` (which torch refuses for a view made in a custom Function).
    Backward: the gradient, contiguous, as a ``DTensor`` of the parameter's own spec (what
    ``from_local`` would build, made by ``DTensor.__new__`` directly: this runs once per
    parameter per step, and ``from_local`` is an autograd Function with argument checks;
    ``from_local`` where Dynamo traces it, under compiled autograd).
    ``on_backward()`` (if given) is called first, at every backward (``FSDPParam`` checks
    there whether the parameter was frozen since; no reference to the parameter is kept
    here: a weak one would stop ``swap_tensors``)."""

    @staticmethod
    def forward(dtensor, on_backward, spec):
        return dtensor._local_tensor.detach()

    @staticmethod
    def setup_context(ctx, inputs, output):
        # (A ``setup_context`` of its own: ``torch.func`` transforms need it; they hand it
        # the tensors unwrapped, hence the spec passed on its own.)
        _, ctx.on_backward, ctx.spec = inputs

    @staticmethod
    def backward(ctx, grad):
        if ctx.on_backward is not None:
            ctx.on_backward()
        dtensor = _dtensor_class()
        # The spec says the gradient is laid out as the (contiguous) shard, and autograd's
        # accumulation takes a gradient whose ``DTensor`` strides match as it is: so it must
        # be (a shard dim other than 0 hands back a transposed one).
        grad = grad.contiguous()
        if torch.compiler.is_compiling():
            # Traced (compiled autograd's backward graph): Dynamo cannot trace ``__new__``.
            spec = ctx.spec
            full = dtensor.from_local(grad, spec.mesh, spec.placements, run_check=False, shape=spec.shape, stride=spec.stride)
            return full, None, None
        return dtensor.__new__(dtensor, grad, ctx.spec, requires_grad=False), None, None


@functools.cache
def _dtensor_class() -> type:
    from torch.distributed.tensor import DTensor

    return DTensor


def alias_of_local_tensor(dtensor, on_backward=None) -> torch.Tensor:
    """A plain tensor over ``dtensor``'s local storage whose gradient flows back to
    ``dtensor`` (see :class:`_AliasOfLocalTensor`); ``on_backward()`` is called by each
    backward through it."""
    return _AliasOfLocalTensor.apply(dtensor, on_backward, dtensor._spec)


def functorch_transforms_active() -> bool:
    """torch/_C: whether a ``torch.func`` transform (``jvp``, ``vmap``, ``grad``) is running
    (then every autograd ``Function`` called needs a ``setup_context``)."""
    return torch._C._are_functorch_transforms_active()


def set_composable_state(module, api, state) -> None:
    """torch/distributed/_composable/contract.py: make ``api.state(module)`` return ``state``
    for ``api``, a ``@contract`` composable API such as torch's ``fully_shard`` (its state is
    kept in ``module.__dict__`` under ``STATE_KEY``, keyed by the undecorated function,
    which ``api.state`` closes over)."""
    import inspect
    from collections import OrderedDict

    from torch.distributed._composable.contract import REGISTRY_KEY, STATE_KEY, RegistryItem

    func = inspect.getclosurevars(api.state).nonlocals["func"]
    module.__dict__.setdefault(STATE_KEY, {})[func] = state
    # ``@contract`` also names the API in the module's registry (``_get_registry``), which
    # torch's ``replicate()`` reads to leave a ``"fully_shard"`` subtree to it.
    module.__dict__.setdefault(REGISTRY_KEY, OrderedDict()).setdefault(func.__name__, RegistryItem())


def torchs_fully_shard():
    """torch/distributed/fsdp/_fully_shard/_fully_shard.py ``fully_shard``: torch's own, from the
    module that defines it, not ``torch.distributed.fsdp.fully_shard``, which the stacks'
    switch to ours replaces (README: "Training stacks")."""
    from torch.distributed.fsdp._fully_shard._fully_shard import fully_shard

    return fully_shard


def fsdp2_reduces_in_original_dtype() -> bool:
    """torch/distributed/fsdp/_fully_shard/_fsdp_param.py ``FSDPParam.unsharded_grad_dtype``
    (torch 2.15): with ``MixedPrecisionPolicy.reduce_dtype`` unset, FSDP2 upcasts a
    gradient to its parameter's original dtype (``nn.Parameter.grad_dtype``) and reduces it
    in that dtype; before, in the gradient's own (``param_dtype``)."""
    from torch.distributed.fsdp._fully_shard._fsdp_param import FSDPParam

    return hasattr(FSDPParam, "unsharded_grad_dtype")


def composable_apis_applied(module) -> tuple[str, ...]:
    """torch/distributed/_composable/contract.py ``_get_registry``: the names of the
    ``@contract`` composable APIs applied to ``module`` (e.g. ``"replicate"`` after torch's
    ``torch.distributed._composable.replicate``)."""
    from torch.distributed._composable.contract import _get_registry

    return tuple(_get_registry(module) or ())


def is_functorch_wrapper(t: torch.Tensor) -> bool:
    """torch/_C/_functorch: whether ``t`` is a ``torch.func`` transform's wrapper (which has no storage)."""
    return torch._C._functorch.is_functorch_wrapped_tensor(t)


def is_user_tensor_subclass(t: torch.Tensor) -> bool:
    """torch/_subclasses: whether ``t`` is of a tensor subclass of its own (``TwoTensor``,
    NF4, ...), not a plain tensor nor one of the tensors torch's tracing stands in for
    plain ones (fake, functional)."""
    from torch._subclasses.fake_tensor import FakeTensor
    from torch._subclasses.functional_tensor import FunctionalTensor

    return type(t) not in (torch.Tensor, torch.nn.Parameter) and not isinstance(t, (FakeTensor, FunctionalTensor))


def optimizer_step_hooks(optimizer: torch.optim.Optimizer) -> list[Callable]:
    """torch/optim/optimizer.py: every step hook ``optimizer.step()`` runs, in its order
    (global pre hooks, the optimizer's pre hooks, its post hooks, global post hooks)."""
    from torch.optim import optimizer as optimizer_module

    return [
        *optimizer_module._global_optimizer_pre_hooks.values(),
        *optimizer._optimizer_step_pre_hooks.values(),
        *optimizer._optimizer_step_post_hooks.values(),
        *optimizer_module._global_optimizer_post_hooks.values(),
    ]


def register_first_step_post_hook(optimizer: torch.optim.Optimizer, hook: Callable):
    """torch/optim/optimizer.py: ``register_step_post_hook``, the hook moved to the front of
    the optimizer's post hooks (run before the others; global post hooks run after them)."""
    handle = optimizer.register_step_post_hook(hook)
    optimizer._optimizer_step_post_hooks.move_to_end(handle.id, last=False)
    return handle


def mark_as_parameter_input(t: torch.Tensor) -> None:
    """torch/_dynamo/decorators.py: have Dynamo treat ``t``, a graph input that stands for a
    parameter, as it treats parameters: static shapes under ``dynamic=True`` and a static
    address for CUDA graphs (``mark_static``, ``mark_static_address``; unguarded)."""
    torch._dynamo.mark_static(t)
    torch._dynamo.mark_static_address(t, guard=False)


def preserve_node_ordering(graph, additional_deps: dict) -> None:
    """torch/_inductor/fx_passes/control_dependencies.py: wrap each dependent node in
    ``control_deps`` so Inductor's scheduler runs it after the given nodes."""
    from torch._inductor.fx_passes.control_dependencies import preserve_node_ordering as _preserve
    from torch.utils._ordered_set import OrderedSet

    _preserve(graph, {node: OrderedSet(deps) for node, deps in additional_deps.items()})


def mark_side_effectful(op) -> None:
    """torch/fx/node.py: keep ``op`` through FX's and Inductor's dead-code elimination
    (Inductor's FallbackKernel asks ``torch._library.utils.is_impure``, which reads this set)."""
    torch.fx.node.has_side_effect(op)


@contextlib.contextmanager
def output_code_hook(fn):
    """torch/_inductor/graph.py: ``GraphLowering.save_output_code`` receives each
    generated wrapper module's source; chain ``fn`` with any hook already set."""
    from torch._inductor.graph import GraphLowering

    previous = GraphLowering.save_output_code

    def both(code: str) -> None:
        fn(code)
        if previous is not None:
            previous(code)

    GraphLowering.save_output_code = staticmethod(both)
    try:
        yield
    finally:
        GraphLowering.save_output_code = previous


@contextlib.contextmanager
def graph_caches_off():
    """Inductor's FX graph cache and AOTAutograd's cache off (local and remote): a graph
    found in either skips the post-grad passes and code generation. The compiled-kernel
    cache stays on (``torch.compiler.config.force_disable_caches`` would also move
    Inductor to a fresh cache directory and recompile every C++/Triton kernel)."""
    import torch._functorch.config as functorch_config
    import torch._inductor.config as inductor_config

    with (
        inductor_config.patch(fx_graph_cache=False, fx_graph_remote_cache=False),
        functorch_config.patch(enable_autograd_cache=False, enable_remote_autograd_cache=False),
    ):
        yield


def register_torch_log(alias: str, logger_name: str) -> None:
    """torch/_logging/_internal.py: make ``TORCH_LOGS="+alias"`` control ``logger_name``."""
    import os

    from torch._logging import _internal

    _internal.register_log(alias, logger_name)
    if alias in os.environ.get("TORCH_LOGS", ""):
        _internal._init_logs()  # TORCH_LOGS was parsed before the alias existed


def current_compile_attempt() -> tuple[int, int] | None:
    """torch/_guards.py: (frame id, how many times this frame was compiled before)."""
    compile_id = torch._guards.CompileContext.current_compile_id()
    if compile_id is None or compile_id.frame_id is None:
        return None
    return compile_id.frame_id, compile_id.frame_compile_id


def current_recompile_reason() -> str | None:
    """torch/_dynamo/convert_frame.py: the first guard failure that made Dynamo compile the
    frame it is compiling again (its ``recompile_reason`` metric); ``None`` when none is
    recorded (a first compile)."""
    from torch._dynamo.utils import get_metrics_context

    context = get_metrics_context()
    return context._metrics.get("recompile_reason") if context.in_progress() else None


def dynamo_graph_break_counts() -> dict[str, int]:
    """torch/_dynamo/utils.py: graph breaks so far in this process, by reason."""
    from torch._dynamo.utils import counters

    return dict(counters["graph_break"])


def watch_dynamo_frame_compiles(start: Callable[[], None], end: Callable[[], None]) -> bool:
    """torch/_dynamo/callback.py: call ``start()`` when Dynamo starts compiling a frame and
    ``end()`` when it is done (restarts and the backend's compile of each of the frame's
    graphs included; a backward compiled lazily at its first run is outside). Idempotent;
    returns whether they were already installed (``torch._dynamo.reset()`` removes them)."""
    from torch._dynamo.callback import callback_handler

    on_start, on_end = _frame_compile_callbacks(start, end)
    installed = on_start in callback_handler.start_callbacks
    if not installed:
        callback_handler.register_start_callback(on_start)
        callback_handler.register_end_callback(on_end)
    return installed


@functools.cache
def _frame_compile_callbacks(start: Callable[[], None], end: Callable[[], None]) -> tuple:
    """Dynamo's start and end callbacks that call ``start`` / ``end`` for frame compiles
    only (one pair per pair, so that installing is idempotent)."""
    from torch._dynamo.callback import CallbackTrigger

    def on_start(args) -> None:
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            start()

    def on_end(args) -> None:
        if args.callback_trigger == CallbackTrigger.DYNAMO:
            end()

    return on_start, on_end


def saved_tensors_go_to_other_hooks(ours: Callable) -> bool:
    """Whether the innermost saved-tensors hooks installed now are someone else's than
    the ones whose pack function is ``ours`` (activation checkpointing's, a user's)."""
    top = torch._C._autograd._top_saved_tensors_default_hooks(False)
    return top is not None and top[0] is not ours


def saved_tensors_hooks_active() -> bool:
    """torch/csrc/autograd: whether some saved-tensors hooks (activation checkpointing's,
    a user's) are installed right now."""
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is not None


# torch/_dynamo/utils.py: ``allow_side_effects(fn, *args)`` is ``fn(*args)``; when Dynamo
# traces it inside a higher-order op's region (activation checkpointing), mutations of
# Python state outside the region are allowed instead of breaking the graph. Bound
# directly, not wrapped: it runs at every parameter read, and each wrapper is one more
# function Dynamo inlines there.
from torch._dynamo.utils import _disable_side_effect_safety_checks_for_current_subtracer as allow_side_effects  # noqa: E402


@torch._dynamo.assume_constant_result
def units_entered_in_this_trace() -> int:
    """torch/_dynamo/symbolic_convert.py: how many times it was called before while Dynamo
    traces the current frame (each restart of its analysis is a trace of its own, with
    its own ``OutputGraph``, on which the count is kept): 0 at the first call.
    ``assume_constant_result``: Dynamo runs it while tracing and bakes the result into
    the graph with no guard. Call it only while ``torch.compiler.is_compiling()``."""
    from torch._dynamo.symbolic_convert import InstructionTranslator

    output = InstructionTranslator.current_tx().output
    count = getattr(output, "_fsdp_compile_units_entered", 0)
    output._fsdp_compile_units_entered = count + 1
    return count


def is_compiled_module(module) -> bool:
    """torch/_dynamo/eval_frame.py: whether ``module`` is what ``torch.compile(module)``
    returns (an ``OptimizedModule``, whose instance attribute ``forward`` runs the
    compiled ``_orig_mod``)."""
    from torch._dynamo.eval_frame import OptimizedModule

    return isinstance(module, OptimizedModule)


def called_through_compiled_wrapper(module) -> bool:
    """Whether a ``torch.compile(module)`` wrapper (an ``OptimizedModule`` whose ``_orig_mod``
    is ``module``) is calling ``module`` now: one of the callers' frames has it as ``self``.
    (Walks the Python stack; for a once-per-unit decision, not a hot path.)"""
    import sys

    from torch._dynamo.eval_frame import OptimizedModule

    frame = sys._getframe(1)
    while frame is not None:
        caller = frame.f_locals.get("self")
        if isinstance(caller, OptimizedModule) and caller._orig_mod is module:
            return True
        frame = frame.f_back
    return False


def never_a_frame_of_its_own(fn: Callable) -> Callable:
    """torch/_dynamo/eval_frame.py ``skip_code``: Dynamo never compiles ``fn`` as a frame of
    its own (when eager code calls it, e.g. after a graph break made Dynamo fall back),
    but still inlines it into the frames it traces, and compiles the frames ``fn`` calls
    as usual. So our wrappers add no frame, and so no graph, that the unsharded model
    does not have."""
    from torch._dynamo.eval_frame import skip_code

    skip_code(fn.__code__)
    return fn


def inside_compiled_call() -> bool:
    """torch/_C/_dynamo/eval_frame: whether eager code runs inside a ``torch.compile``d
    call (Dynamo fell back to eager around it and compiles the frames it calls)."""
    from torch._C._dynamo.eval_frame import get_eval_frame_callback

    return bool(get_eval_frame_callback())


def run_by_compiled_code(frame) -> bool:
    """torch/_dynamo/utils.py ``orig_code_map``: whether ``frame`` runs bytecode Dynamo
    generated (a compiled frame, which after its graph replays the side effects the
    graph recorded, such as hooks the traced code registered on parameters)."""
    from torch._dynamo.utils import orig_code_map

    return frame is not None and frame.f_code in orig_code_map


def get_joint_custom_pass() -> Callable | None:
    """torch/_functorch/config.py: a callable run on the joint graph before partitioning."""
    return functorch_config.joint_custom_pass


def set_joint_custom_pass(fn: Callable | None) -> None:
    functorch_config.joint_custom_pass = fn


def is_backward_node(node: torch.fx.Node) -> bool:
    """torch/_functorch/partitioners.py's ``partitioner_tag`` of joint-graph backward nodes
    (AOTAutograd's own, or one we placed there with :func:`place_in_backward`)."""
    return node.meta.get("partitioner_tag", None) in ("is_backward", "must_be_in_backward")


def place_in_backward(node: torch.fx.Node) -> None:
    """Make the partitioner put a joint-graph node in the backward graph only (a
    collective that depends on forward values alone would otherwise be copied into
    the forward graph too, where ``wait_tensor``'s side effect keeps it alive)."""
    node.meta["partitioner_tag"] = "must_be_in_backward"


def group_name_of(group: torch.distributed.ProcessGroup) -> str:
    """The name the functional collectives use to find a process group."""
    return group.group_name


def flat_group_of(mesh) -> torch.distributed.ProcessGroup:
    """One process group over all ranks of a multi-dimensional ``DeviceMesh``
    (``DeviceMesh._flatten``, private in torch 2.13)."""
    return mesh._flatten().get_group()


def _about_named_group(group_name: str, question: Callable):
    """torch/distributed/distributed_c10d.py ``_resolve_process_group``: ``question`` of
    the process group the functional collectives call ``group_name`` (``None`` if no
    such group exists in this process)."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    if not dist.is_initialized():
        return None
    try:
        return question(_resolve_process_group(group_name))
    except Exception:  # unknown name
        return None


def group_ranks(group_name: str) -> list[int] | None:
    """The global ranks of the group named ``group_name`` (``None``: no such group)."""
    import torch.distributed as dist

    return _about_named_group(group_name, dist.get_process_group_ranks)


def group_rank(group_name: str) -> int | None:
    """This process's index in the group named ``group_name`` (``None``: no such group)."""
    import torch.distributed as dist

    return _about_named_group(group_name, dist.get_rank)


def group_backend(group_name: str) -> str | None:
    """The backend (``"gloo"``, ``"nccl"``, ``"fake"``...) of the group named
    ``group_name`` (``None``: no such group)."""
    import torch.distributed as dist

    return _about_named_group(group_name, dist.get_backend)


def collectives_observed() -> bool:
    """Whether this thread's eager collectives are being watched op by op: a Python
    dispatch mode is active (torch's ``CommDebugMode``, a test's op log; the mode stack
    is private in torch 2.13), or ``torch.distributed.reduce_scatter_single`` is patched
    (torch's FSDP2 tests patch it to check each reduce-scatter). Eager collectives then
    go out as FSDP2's, whatever their transport would otherwise be."""
    import torch.distributed as dist
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    return bool(_get_current_dispatch_mode_stack()) or dist.reduce_scatter_single is not _TORCH_REDUCE_SCATTER_SINGLE


#: torch's own, as imported before any test could patch it.
_TORCH_REDUCE_SCATTER_SINGLE = getattr(torch.distributed, "reduce_scatter_single", None)


def issue_c10d_collective(kind: str, output: torch.Tensor, input_: torch.Tensor, group_name: str, reduce_op: str | None = None):
    """Issue one eager collective as FSDP2 does, through ``torch.distributed``
    (``all_gather_single``, ``reduce_scatter_single``, ``all_reduce`` into ``output``, a copy
    of ``input_``; or ``all_to_all_single``), so that torch's ``CommDebugMode`` and profiler see FSDP2's ops
    (``c10d._allgather_base_``, ``c10d._reduce_scatter_base_``, ``c10d.allreduce_``), and
    register its work on ``output`` (``torch._C._distributed_c10d._register_work``, private in
    torch 2.13) so that the functional ``wait_tensor(output)`` waits for it."""
    import torch.distributed as dist
    from torch.distributed.distributed_c10d import _resolve_process_group

    group = _resolve_process_group(group_name)
    if kind == "all_gather":
        work = dist.all_gather_single(output, input_, group=group, async_op=True)
    elif kind == "all_to_all":
        work = dist.all_to_all_single(output, input_, group=group, async_op=True)
    elif kind == "reduce_scatter":
        work = dist.reduce_scatter_single(output, input_, op=_REDUCE_OPS[reduce_op], group=group, async_op=True)
    else:
        output.copy_(input_)
        work = dist.all_reduce(output, op=_REDUCE_OPS[reduce_op], group=group, async_op=True)
    torch._C._distributed_c10d._register_work(output, work)
    return output


_REDUCE_OPS = {
    "sum": torch.distributed.ReduceOp.SUM,
    "avg": torch.distributed.ReduceOp.AVG,
    "max": torch.distributed.ReduceOp.MAX,
    "min": torch.distributed.ReduceOp.MIN,
}


def concatenate_meshes(meshes: list):
    """torch/distributed/device_mesh.py ``DeviceMesh._concatenate``: one mesh over the
    given sibling dimensions of one root mesh (e.g. ``mesh["dp"]`` and ``mesh["tp"]``);
    raises if they are not dimensions of one mesh."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh._concatenate(meshes)


def flatten_mesh(mesh, name: str):
    """torch/distributed/device_mesh.py ``DeviceMesh._flatten``: ``mesh``'s dimensions as one,
    named ``name`` (a group over their ranks; what FSDP2 builds for several ``dp_mesh_dims``)."""
    return mesh._flatten(name)


def strided_shard(dim: int, split_factor: int):
    """torch/distributed/tensor/placement_types.py ``_StridedShard``: FSDP2's placement for
    a dimension that tensor parallelism already shards on a later mesh dimension."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return _StridedShard(dim, split_factor=split_factor)


def is_strided_shard(placement) -> bool:
    """Whether ``placement`` is a ``_StridedShard`` (not a subclass of ``Shard``): what
    tensor parallelism uses for a packed weight (e.g. ``transformers``' ``packed_colwise``
    on a gate and up projection stored as one tensor)."""
    from torch.distributed.tensor.placement_types import _StridedShard

    return isinstance(placement, _StridedShard)


def outside_dispatch_modes():
    """Context manager running code with the active Python dispatch modes popped
    (``torch.utils._python_dispatch._disable_current_modes``): selective activation
    checkpointing's recompute mode rejects ops its region did not run in forward."""
    from torch.utils._python_dispatch import _disable_current_modes

    return _disable_current_modes()


@contextlib.contextmanager
def outside_recompute_modes():
    """Run the block without selective activation checkpointing's dispatch modes
    (``torch.utils.checkpoint``'s private caching modes, which only accept the ops their
    region ran in forward); every other mode (``CommDebugMode``) still sees what runs.
    The modes above the lowest of them are popped, the others pushed back in order,
    and all restored after."""
    from torch.utils import checkpoint as ac
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack, _pop_mode, _push_mode

    kinds = tuple(getattr(ac, n) for n in ("_CachingTorchDispatchMode", "_CachedTorchDispatchMode") if hasattr(ac, n))
    stack = _get_current_dispatch_mode_stack()
    lowest = next((i for i, mode in enumerate(stack) if isinstance(mode, kinds)), None)
    if lowest is None:
        yield
        return
    popped = [_pop_mode() for _ in range(len(stack) - lowest)]  # top first
    kept = [mode for mode in reversed(popped) if not isinstance(mode, kinds)]
    for mode in kept:
        _push_mode(mode)
    try:
        yield
    finally:
        for _ in kept:
            _pop_mode()
        for mode in reversed(popped):
            _push_mode(mode)


@never_a_frame_of_its_own  # called from eager code inside a compiled call (fullgraph=True would refuse its frame)
def in_backward_recompute() -> bool:
    """True while the autograd engine runs a backward on this thread (where eager
    activation checkpointing re-runs forward code); ``_current_graph_task_id`` is private."""
    return torch._C._current_graph_task_id() != -1


def running_backward_id() -> int | None:
    """An id of the backward the autograd engine runs on this thread (``None``: none)."""
    task = torch._C._current_graph_task_id()
    return None if task == -1 else task


def will_run_in_this_backward(node) -> bool:
    """Whether the running backward will execute autograd ``node`` (call only inside a backward)."""
    return bool(torch._C._will_engine_execute_node(node))


def in_compiled_autograd() -> bool:
    """Whether compiled autograd is tracing the running backward (``torch._dynamo.compiled_autograd``)."""
    from torch._dynamo import compiled_autograd

    return bool(compiled_autograd.in_compiled_autograd_region)


def queue_end_of_backward_callback(fn: Callable[[], None]) -> None:
    """Run ``fn`` when the running backward finishes without error
    (``Variable._execution_engine.queue_callback``, what FSDP2's root post-backward uses)."""
    torch.autograd.Variable._execution_engine.queue_callback(fn)


__all__ = [
    "fx_graph_cache_pickler",
    "device_mesh_class",
    "functorch_transforms_active",
    "set_composable_state",
    "composable_apis_applied",
    "torchs_fully_shard",
    "is_functorch_wrapper",
    "issue_c10d_collective",
    "group_rank",
    "group_backend",
    "running_backward_id",
    "in_compiled_autograd",
    "queue_end_of_backward_callback",
    "watch_dynamo_frame_compiles",
    "is_strided_shard",
    "chunk_cat",
    "tree_map",
    "local_tensor_of",
    "alias_of_local_tensor",
    "mark_as_parameter_input",
    "c10d_functional",
    "place_in_backward",
    "fx_annotate",
    "annotating",
    "NO_ANNOTATION",
    "CheckpointPolicy",
    "get_joint_custom_pass",
    "set_joint_custom_pass",
    "is_backward_node",
    "group_name_of",
    "flat_group_of",
    "concatenate_meshes",
    "group_ranks",
    "strided_shard",
    "flatten_mesh",
    "run_by_compiled_code",
    "is_strided_shard",
    "in_backward_recompute",
    "outside_dispatch_modes",
    "outside_recompute_modes",
    "detect_fake_mode",
    "tree_map",
    "OpOverload",
    "stable_topological_sort",
    "CustomGraphPass",
    "hash_of_files",
    "get_post_grad_custom_post_pass",
    "set_post_grad_custom_post_pass",
    "preserve_node_ordering",
    "mark_side_effectful",
    "output_code_hook",
    "register_torch_log",
    "current_compile_attempt",
    "dynamo_graph_break_counts",
    "saved_tensors_hooks_active",
    "saved_tensors_go_to_other_hooks",
    "allow_side_effects",
    "units_entered_in_this_trace",
    "is_compiled_module",
    "called_through_compiled_wrapper",
    "never_a_frame_of_its_own",
    "inside_compiled_call",
]
