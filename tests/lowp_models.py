"""Models with low-precision parameter subclasses (torchao), for tests on the rank pool:
QLoRA (frozen NF4 base weights, trainable LoRA adapters) and float8 training with
float8 all-gathers. Module-level functions, so the ranks can import them."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

DIM, LORA_RANK = 256, 8  # NF4 needs 64-element blocks, 256 blocks a scaler block, split evenly


class QLoRALinear(nn.Module):
    """A frozen NF4 weight plus a trainable low-rank adapter (torchtune's LoRALinear)."""

    def __init__(self, dim: int, rank: int, weight: torch.Tensor | None = None) -> None:
        super().__init__()
        from torchao.quantization import to_nf4

        weight = nn.Linear(dim, dim, bias=False).weight if weight is None else weight
        out_features, in_features = weight.shape
        self.weight = nn.Parameter(to_nf4(weight.detach()), requires_grad=False)
        self.lora_a = nn.Linear(in_features, rank, bias=False)
        self.lora_b = nn.Linear(rank, out_features, bias=False)
        nn.init.normal_(self.lora_b.weight, std=0.02)

    def forward(self, x):
        return F.linear(x, self.weight) + self.lora_b(self.lora_a(x))


class QLoRABlock(nn.Module):
    def __init__(self, dim: int, rank: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn_proj = QLoRALinear(dim, rank)
        self.mlp = QLoRALinear(dim, rank)

    def forward(self, x):
        x = x + torch.tanh(self.attn_proj(self.norm(x)))
        return x + F.gelu(self.mlp(x))


class QLoRAModel(nn.Module):
    def __init__(self, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(QLoRABlock(DIM, LORA_RANK) for _ in range(n_layers))
        self.head = nn.Linear(DIM, 8)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def build_qlora(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    model = QLoRAModel()
    for name, p in model.named_parameters():  # QLoRA trains the adapters (and the head) only
        if "lora" not in name and not name.startswith("head"):
            p.requires_grad_(False)
    return model


class Float8MLP(nn.Module):
    def __init__(self, dim: int = 64, n_layers: int = 2) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(dim, 2 * dim, bias=False), nn.GELU(), nn.Linear(2 * dim, dim, bias=False))
            for _ in range(n_layers)
        )
        self.head = nn.Linear(dim, 8)

    def forward(self, x):
        for layer in self.layers:
            x = x + layer(x)
        return self.head(x)


def build_float8(seed: int = 0) -> nn.Module:
    """Float8 training (emulated on CPU) with float8 all-gathers of the block weights."""
    from torchao.float8 import Float8LinearConfig, convert_to_float8_training

    torch.manual_seed(seed)
    model = Float8MLP()
    config = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=True)
    convert_to_float8_training(model, config=config, module_filter_fn=lambda m, fqn: fqn.startswith("layers"))
    return model


def build_int8_mixed_precision() -> nn.Module:
    """torchao's int8 mixed-precision training weights (``Int8MixedPrecisionTrainingLinearWeight``:
    FSDP2's five-argument pre hook) in the blocks."""
    from torchao.prototype.quantized_training import int8_mixed_precision_training
    from torchao.quantization import quantize_

    torch.manual_seed(0)
    model = Float8MLP()
    quantize_(model.layers, int8_mixed_precision_training())
    return model


def batch(step: int, dim: int = DIM):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, dim, generator=g), torch.randn(8, 8, generator=g)


def batch_float8(step: int):
    """Every rank's slice is the same rows (the batch is one half twice): float8 scales its
    activations by their max over the local batch, so ranks and the single-process
    reference then compute with the same scales."""
    x, y = batch(step, 64)
    return torch.cat([x[:4], x[:4]]), torch.cat([y[:4], y[:4]])


def mse(out, target):
    return F.mse_loss(out, target)


def shard_layers(model, fully_shard) -> None:
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model)


class _CollectiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes each all-gather sends from this rank (by input dtype), and all-reduces, as run."""

    def __init__(self):
        super().__init__()
        self.gathers: list[tuple[str, int]] = []
        self.all_reduces = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from fsdp_compile.base.compat import c10d_functional as c10d

        name = getattr(func, "_overloadpacket", func)
        if name in (c10d.all_gather_into_tensor, torch.ops.c10d._allgather_base_):
            sent = args[1] if name is torch.ops.c10d._allgather_base_ else args[0]  # (output, input, ...) there
            self.gathers.append((str(sent.dtype).replace("torch.", ""), sent.numel() * sent.element_size()))
        elif name in (c10d.all_reduce, torch.ops.c10d.allreduce_):
            self.all_reduces += 1
        return func(*args, **(kwargs or {}))


def collective_bytes(kind: str, precompute: bool = False) -> dict:
    """One eager step of the sharded model: what its forward's all-gathers move, what a
    float32 gather of the same weights would, and the all-reduces of a step; also the
    local tensor types of the sharded parameters."""
    import torch.distributed as dist

    from fsdp_compile import fully_shard

    model = build_qlora() if kind == "nf4" else build_float8()
    shard_layers(model, fully_shard)
    inputs, targets = (batch if kind == "nf4" else batch_float8)(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    inputs, targets = inputs.chunk(world)[rank], targets.chunk(world)[rank]
    low = [p for p in model.parameters() if type(p._local_tensor) is not torch.Tensor]
    fp32_bytes = sum(p._local_tensor.numel() * 4 for p in low)  # the weights as float32 shards
    precompute_all_reduces = []
    if precompute:
        import torch.distributed._functional_collectives as funcol
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

        all_reduce = funcol.all_reduce  # what DTensor's redistribution calls
        funcol.all_reduce = lambda *args, **kwargs: precompute_all_reduces.append(1) or all_reduce(*args, **kwargs)
        try:
            precompute_float8_dynamic_scale_for_fsdp(model)
        finally:
            funcol.all_reduce = all_reduce
    forward = _CollectiveBytes()
    with forward:
        loss = mse(model(inputs), targets)
    loss.backward()
    return {
        "local_types": sorted({type(p._local_tensor).__name__ for p in low}),
        "dtypes": sorted({p._local_tensor.dtype for p in low}, key=str),
        "gathers": forward.gathers,
        "all_reduces": forward.all_reduces,
        "precompute_all_reduces": len(precompute_all_reduces),
        "units": len(model.layers) + 1,
        "fp32_bytes": fp32_bytes,
        "grads": {n: p.grad is not None for n, p in model.named_parameters()},
    }


def saved_gathered_in_compiled_step(kind: str) -> list[str]:
    """Compile one step (Inductor's partitioner): the forward-graph outputs (saved for the
    backward) made by a resharded unit's gather chain (all-gather, its copy-out, the post
    hook): gathered low-precision weights kept alive from forward to backward."""
    import torch.distributed as dist

    from fsdp_compile import fully_shard
    from fsdp_compile.runtime.vocabulary import Role, tag_of
    from fsdp_compile.testing import GraphCapture

    model = build_qlora() if kind == "nf4" else build_float8()
    shard_layers(model, fully_shard)
    capture = GraphCapture("min_cut")
    inputs, targets = (batch if kind == "nf4" else batch_float8)(0)
    rank, world = dist.get_rank(), dist.get_world_size()
    mse(torch.compile(model, backend=capture)(inputs.chunk(world)[rank]), targets.chunk(world)[rank]).backward()
    (forward,) = capture.forward_graphs
    (output,) = [n for n in forward.graph.nodes if n.op == "output"]
    full_shapes = {tuple(p.shape) for p in model.parameters() if type(p._local_tensor) is not torch.Tensor}
    saved = []
    for node in output.args[0]:
        if not isinstance(node, torch.fx.Node):
            continue
        tag = tag_of(node)
        if tag is not None and tag.role is Role.UNSHARD and tag.reshard_after_forward:
            saved.append(f"{node.name} ({tag.param_fqn})")
        elif tuple(node.meta["val"].shape) in full_shapes:  # e.g. the weight dequantized
            saved.append(f"{node.name} (full weight shape {tuple(node.meta['val'].shape)})")
    return saved


def train_float8(backend: str | None, precompute: bool, steps: int = 3) -> dict:
    """Float8 training sharded on the ranks, compiled with ``backend`` (``None``: eager), with
    or without ``precompute_float8_dynamic_scale_for_fsdp`` before every step (FSDP2's
    recipe): the losses, the full parameters after each step and the compiled graphs."""
    import torch.distributed as dist
    from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp

    from fsdp_compile import fully_shard
    from fsdp_compile.testing import GraphCapture, collective_nodes, full_parameters
    from fsdp_compile.testing._tensors import global_mean
    from fsdp_compile.testing._torch_internals import compile_counter, reset_dynamo

    reset_dynamo()
    model = build_float8()
    shard_layers(model, fully_shard)
    counter = (GraphCapture() if backend == "capture" else compile_counter(backend)) if backend else None
    run = torch.compile(model, backend=counter) if counter else model
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    rank, world = dist.get_rank(), dist.get_world_size()
    losses, params = [], []
    for step in range(steps):
        if precompute:
            precompute_float8_dynamic_scale_for_fsdp(model)
        inputs, targets = batch_float8(step)
        loss = mse(run(inputs.chunk(world)[rank]), targets.chunk(world)[rank])
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(global_mean(loss))
        params.append(full_parameters(model))
    all_reduces = None
    if backend == "capture":  # the all-reduces in the compiled step's graphs
        graphs = counter.forward_graphs + counter.backward_graphs
        all_reduces = sum(len(collective_nodes(g, torch.ops._c10d_functional.all_reduce)) for g in graphs)
    graphs = counter.frame_count if counter else None
    return {"losses": losses, "params": params, "graphs": graphs, "all_reduces": all_reduces}


def state_dict_view(shard_with: str, checkpoint_dir: str) -> dict:
    """What a user's checkpoint code sees of the low-precision parameters, sharded by our
    ``fully_shard`` or FSDP2's: the state dict's types, ``full_tensor()`` (float8 only, see
    below), and a DCP save and load into a fresh sharded model (each rank's shard compared,
    dequantized, after the load).

    ``full_tensor()`` of an NF4 shard is not called here: it issues three asynchronous
    all-gathers (one per inner tensor) before waiting for any, and over gloo two in flight
    race in its coalesced all-gather (README, Limitations); a rank died of SIGSEGV or heap
    corruption in about half of the full runs of 2026-11-28. NCCL has no such race."""
    import torch.distributed.checkpoint as dcp

    if shard_with == "ours":
        from fsdp_compile import fully_shard
    else:
        from torch.distributed.fsdp import fully_shard
    view = {}
    for kind, build in (("nf4", build_qlora), ("float8", build_float8)):
        model = build()
        shard_layers(model, fully_shard)
        state = model.state_dict()
        name = next(n for n, p in model.named_parameters() if type(p._local_tensor) is not torch.Tensor)
        if kind == "float8":
            full = state[name].full_tensor()
            full_view = (type(full).__name__, tuple(full.shape))  # read at once: nothing left in flight
        else:
            full_view = ("not gathered over gloo", tuple(state[name].shape))
        saved = state[name]._local_tensor.to(torch.float32)
        dcp.save(state, checkpoint_id=f"{checkpoint_dir}/{shard_with}-{kind}")
        fresh = build(seed=1)
        shard_layers(fresh, fully_shard)
        loaded = fresh.state_dict()
        before = torch.equal(loaded[name]._local_tensor.to(torch.float32), saved)
        dcp.load(loaded, checkpoint_id=f"{checkpoint_dir}/{shard_with}-{kind}")
        same = not before and torch.equal(loaded[name]._local_tensor.to(torch.float32), saved)
        view[kind] = (type(state[name]).__name__, type(state[name]._local_tensor).__name__, *full_view, same)
    return view


def build_hf_qlora() -> nn.Module:
    """A small ``transformers`` Llama whose attention and MLP projections are frozen NF4
    weights plus trainable adapters (QLoRA, as torchtune and PEFT lay it out). One decoder
    layer: with the root that is two units (more layers are the same unit again)."""
    import transformers

    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=DIM, intermediate_size=2 * DIM, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=32, tie_word_embeddings=False,
    )  # fmt: skip
    config._attn_implementation = "sdpa"
    model = transformers.LlamaForCausalLM(config)
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, QLoRALinear(0, LORA_RANK, weight=child.weight))
    for name, p in model.named_parameters():
        p.requires_grad_("lora" in name)
    return model


def batch_tokens(step: int):
    g = torch.Generator().manual_seed(200 + step)
    tokens = torch.randint(0, 128, (4, 17), generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def next_token_loss(output, targets):
    return F.cross_entropy(output.logits.flatten(0, 1), targets.flatten())


def shard_hf_layers(model, fully_shard) -> None:
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
