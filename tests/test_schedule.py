"""Proof in the final code: Inductor's output for a compiled 4-unit model (2 gloo ranks).

Per step: one all-gather per unit in forward, one per resharded unit whose
weight the backward needs, one reduce-scatter per unit; every parameter
gathered once per pass and reduced once; and every collective but the first
all-gather and the last reduce-scatter has compute between its issue and wait.

Inductor may move collectives by itself (torch 2.15's ``simple_overlap``, on by
default; see ``_torch_internals.inductor_comm_overlap_flags``): the overlap is shown to be our
passes' doing with Inductor's own overlap off, and what Inductor does alone is
tested on its own.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from fsdp_compile.testing._output_code import collectives_in_output_code
from tests.models import shard_blocks

N_LAYERS = 4
_cache: dict = {}


def compiled_step_code(
    config_changes: dict, n_layers: int = 4, dim: int = 32, prefetch: dict | None = None, inductor_overlap: bool = True
) -> dict:
    """On every rank: compile a 4-unit model with Inductor and return its output code.

    ``prefetch``: {"forward" | "backward": {layer index: [layer indices]}} hints.
    ``inductor_overlap=False`` turns off Inductor's own compute/communication overlap
    (see ``_torch_internals.inductor_comm_overlap_flags``), leaving only what our passes do."""
    import torch._inductor.config as inductor_config
    from torch._inductor.utils import run_and_get_code

    from fsdp_compile import config, fully_shard
    from fsdp_compile._fully_shard import managed_params
    from fsdp_compile.testing._torch_internals import inductor_comm_overlap_flags
    from fsdp_compile.testing.models import MLPStack

    torch.manual_seed(0)
    model = shard_blocks(MLPStack(dim=dim, n_layers=n_layers, bias=True), fully_shard)
    for direction, hints in (prefetch or {}).items():
        for i, targets in hints.items():
            setter = getattr(model.layers[i], f"set_modules_to_{direction}_prefetch")
            setter([model.layers[t] for t in targets])
    x = torch.randn(4, dim)
    inductor_changes = {} if inductor_overlap else {flag: False for flag in inductor_comm_overlap_flags()}
    with config.patch(**config_changes), inductor_config.patch(inductor_changes):
        compiled = torch.compile(model, fullgraph=True)
        _, codes = run_and_get_code(lambda: compiled(x).sum().backward())
    layouts = {p.fqn: (p.layout.padded_numel, p.layout.world_size) for p in managed_params(model)}
    assert dist.get_world_size() == 2
    return {"codes": codes, "layouts": layouts, "inductor_overlap_flags": inductor_comm_overlap_flags()}


def _schedule(pool2, prefetch=None, inductor_overlap=True, **config_changes):
    """``inductor_overlap=False``: with Inductor's own compute/communication overlap off.
    gloo's own collectives unless ``gloo_all_to_all=True`` is passed: the schedule
    tests read all-gathers and reduce-scatters; the all-to-all transport (the default
    over gloo) is checked against them in ``test_gloo_all_to_all_keeps_the_schedule_and_the_bytes``."""
    config_changes.setdefault("gloo_all_to_all", False)
    key = (tuple(sorted(config_changes.items())), repr(prefetch), inductor_overlap)
    if key not in _cache:
        per_rank = pool2.run(
            compiled_step_code, config_changes, N_LAYERS, prefetch=prefetch, inductor_overlap=inductor_overlap
        )
        parsed = []
        for result in per_rank:
            forward_code, backward_code = result["codes"]
            parsed.append(
                {
                    "forward": collectives_in_output_code(forward_code),
                    "backward": collectives_in_output_code(backward_code),
                    "layouts": result["layouts"],
                    "inductor_overlap_flags": result["inductor_overlap_flags"],
                }
            )
        _cache[key] = parsed
    return _cache[key]


def _signature(schedule):
    return [(c.kind, c.output_numel) for c in schedule]


def _of(schedule, kind):
    return [c for c in schedule if c.kind == kind]


def test_ranks_issue_the_same_sequence(pool2):
    rank0, rank1 = _schedule(pool2)
    for graph in ("forward", "backward"):
        assert _signature(rank0[graph]) == _signature(rank1[graph])


def test_one_collective_per_unit(pool2):
    s = _schedule(pool2)[0]
    assert len(_of(s["forward"], "all_gather")) == N_LAYERS
    assert _of(s["forward"], "reduce_scatter") == []
    # Layer 0's weight only serves the input's gradient, which is not needed.
    assert len(_of(s["backward"], "all_gather")) == N_LAYERS - 1
    assert len(_of(s["backward"], "reduce_scatter")) == N_LAYERS


def test_volume_is_ideal(pool2):
    """Every parameter gathered once per pass and reduced once, no more, no less."""
    s = _schedule(pool2)[0]
    layouts = s["layouts"]
    gathered = {fqn: padded * ws for fqn, (padded, ws) in layouts.items()}
    assert sum(c.output_numel for c in _of(s["forward"], "all_gather")) == sum(gathered.values())
    needed_in_backward = [f for f in gathered if f.endswith(".weight") and not f.startswith("layers.0.")]
    assert sum(c.output_numel for c in _of(s["backward"], "all_gather")) == sum(gathered[f] for f in needed_in_backward)
    shard_elements = sum(padded for padded, _ in layouts.values())
    assert sum(c.output_numel for c in _of(s["backward"], "reduce_scatter")) == shard_elements


def _assert_overlapped_but_first_and_last(s, last_reduce_scatter=None):
    """``last_reduce_scatter``: where the code's kinds do not say it (all-to-alls)."""
    everything = s["forward"] + s["backward"]
    first_all_gather = s["forward"][0]
    last_reduce_scatter = last_reduce_scatter or _of(s["backward"], "reduce_scatter")[-1]
    assert all(c.wait_line is not None for c in everything)
    exposed = [c for c in everything if not c.compute_between and c not in (first_all_gather, last_reduce_scatter)]
    assert exposed == [], [(c.kind, c.output_numel) for c in exposed]


def test_communication_overlaps_compute(pool2):
    _assert_overlapped_but_first_and_last(_schedule(pool2)[0])


def test_passes_overlap_without_inductors_own_overlap(pool2):
    """The overlap is our passes' doing: it is all there with Inductor's own
    reordering of collectives off, over the same collectives."""
    s = _schedule(pool2, inductor_overlap=False)[0]
    _assert_overlapped_but_first_and_last(s)
    default = _schedule(pool2)[0]
    for graph in ("forward", "backward"):
        assert _signature(s[graph]) == _signature(default[graph])


def test_without_passes_everything_is_exposed(pool2):
    """The baseline the passes improve on: per-parameter collectives, each waited at once
    (with Inductor's own overlap off; what it does alone is the next test)."""
    s = _schedule(pool2, inductor_overlap=False, bucketing=False, reorder=False)[0]
    n_params = 2 * N_LAYERS
    assert len(_of(s["forward"], "all_gather")) == n_params
    assert len(_of(s["backward"], "reduce_scatter")) == n_params
    assert all(not c.compute_between for c in s["forward"] + s["backward"])


def test_what_inductor_does_alone_without_passes(pool2):
    """Passes off, Inductor's defaults: it keeps the per-parameter collectives and
    their order, and hides at most what one adjacent swap can."""
    s = _schedule(pool2, bucketing=False, reorder=False)[0]
    baseline = _schedule(pool2, inductor_overlap=False, bucketing=False, reorder=False)[0]
    for graph in ("forward", "backward"):  # no collective added, merged or reordered
        assert _signature(s[graph]) == _signature(baseline[graph])
    everything = s["forward"] + s["backward"]
    assert all(c.wait_line is not None for c in everything)
    overlapped = [c for c in everything if c.compute_between]
    exposed = [c for c in everything if not c.compute_between]
    if not any(s["inductor_overlap_flags"].values()):
        # torch 2.13: no pass moving collectives is on by default; all are exposed.
        assert overlapped == []
    else:
        # torch 2.15: ``aten_distributed_optimizations.enable_simple_overlap`` (default
        # True) swaps each collective earlier and each wait later past adjacent kernels
        # it does not depend on (a collective never passes a collective, a wait never
        # a wait, and no swap may raise peak memory). Here: the all-gather of layers 1-3's weight is issued one
        # kernel early (before the previous layer's relu in forward, before
        # threshold_backward in backward), one weight reduce-scatter is waited one
        # kernel late; the rest (every bias gather, most reduce-scatters) stay exposed,
        # where our passes hide a whole layer's compute behind every collective but two.
        assert overlapped, "simple_overlap is on but hid nothing"
        assert all(len(c.compute_between) == 1 for c in overlapped), [(c.kind, c.compute_between) for c in overlapped]
        assert len(exposed) > len(overlapped)


def test_bucket_cap_splits_units(pool2):
    """A cap below one weight's shard gives every parameter its own collective."""
    s = _schedule(pool2, bucket_mode="cap", bucket_cap_mb=1e-4)[0]
    assert len(_of(s["forward"], "all_gather")) == 2 * N_LAYERS
    assert len(_of(s["backward"], "reduce_scatter")) == 2 * N_LAYERS


def test_auto_bucketing_keeps_ideal_volume(pool2):
    s = _schedule(pool2, bucket_mode="auto")
    assert _signature(s[0]["forward"]) == _signature(s[1]["forward"])
    assert _signature(s[0]["backward"]) == _signature(s[1]["backward"])
    layouts = s[0]["layouts"]
    total = sum(padded * ws for padded, ws in layouts.values())
    assert sum(c.output_numel for c in _of(s[0]["forward"], "all_gather")) == total


def test_prefetch_hints(pool2):
    """set_modules_to_forward_prefetch / _backward_prefetch with the default prefetch off
    (prefetch_depth=0): the hinted all-gathers are issued before the hinting unit's
    compute and overlap it; an unhinted one is not prefetched."""
    hints = {"forward": {0: [1, 2]}, "backward": {3: [2, 1]}}
    s = _schedule(pool2, prefetch=hints, prefetch_depth=0)[0]
    l0, l1, l2, l3 = _of(s["forward"], "all_gather")
    # Both issued before layer 0's compute (one addmm and one relu kernel per layer): layer 1's
    # gather overlaps layer 0's two kernels, layer 2's those of layers 0 and 1.
    assert l0.compute_between == [] and l1.issue_line < l0.wait_line
    assert len(l1.compute_between) == 2 and len(l2.compute_between) == 4, (l1, l2)
    assert l2.compute_between[:2] == l1.compute_between
    assert l3.issue_line > l2.wait_line  # not hinted: gathered when needed
    b3, b2, b1 = _of(s["backward"], "all_gather")  # layer 0's weight is not needed
    # Issued while layer 3's backward runs: layer 3's compute is in flight with both.
    assert b3.wait_line < b2.wait_line and b3.wait_line < b1.wait_line
    assert b2.compute_between and set(b2.compute_between) <= set(b1.compute_between)
    assert len(b1.compute_between) > len(b2.compute_between)


def test_gloo_all_to_all_keeps_the_schedule_and_the_bytes(pool2):
    """``config.gloo_all_to_all``: every all-gather and reduce-scatter becomes one
    all-to-all, in the same order, the same on both ranks; a bucket's all-gather
    receives the other rank's block only (half the gathered size: a rank sends itself
    nothing, its own block comes from its copy-in; a lone parameter's re-gather, without
    a copy-in, receives both), a reduce-scatter's holds both ranks'
    slices (2x its shard, summed after the wait); and all but the first all-gather and the
    last reduce-scatter still overlap compute."""
    default = _schedule(pool2)[0]
    lowered = _schedule(pool2, gloo_all_to_all=True)
    for graph in ("forward", "backward"):
        assert _signature(lowered[0][graph]) == _signature(lowered[1][graph])
        assert [c.kind for c in lowered[0][graph]] == ["all_to_all"] * len(default[graph])
        for got, c in zip(lowered[0][graph], default[graph], strict=True):
            if c.kind == "reduce_scatter":
                assert got.output_numel == c.output_numel * 2
            elif graph == "forward":  # every forward all-gather gathers a bucket (copy-in, copy-out)
                assert got.output_numel == c.output_numel // 2
            else:  # a re-gather of one parameter without a copy-in receives every block
                assert got.output_numel in (c.output_numel // 2, c.output_numel)
    assert default["backward"][-1].kind == "reduce_scatter"
    _assert_overlapped_but_first_and_last(lowered[0], last_reduce_scatter=lowered[0]["backward"][-1])


def llama_step_code() -> list[str]:
    """On every rank: Inductor's forward and backward code for a ``transformers`` Llama
    (two decoder layers; the embedding, final norm and untied head in the root) sharded
    per layer, its loss (from ``labels``) in the compiled graph."""
    from torch._inductor.utils import run_and_get_code
    from transformers import LlamaConfig, LlamaForCausalLM

    from fsdp_compile import config, fully_shard

    hf_config = LlamaConfig(
        vocab_size=256,
        hidden_size=256,
        intermediate_size=704,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=32,
        tie_word_embeddings=False,
        attn_implementation="sdpa",
    )
    torch.manual_seed(0)
    model = LlamaForCausalLM(hf_config)
    shard_blocks(model, fully_shard, blocks=model.model.layers)
    tokens = torch.randint(0, 256, (2, 64))
    with config.patch(gloo_all_to_all=False):  # gloo's own collectives: the code names their kinds
        compiled = torch.compile(model)
        _, codes = run_and_get_code(lambda: compiled(input_ids=tokens, labels=tokens).loss.backward())
    return codes


def test_the_backward_overlaps_its_first_regather_with_the_head(pool2):
    """The root's head runs first in the backward: its matmuls are the compute the first
    re-gather (the last layer's weights) can hide behind, and they are between its issue
    and wait in Inductor's code (the backward starts with the loss's pointwise ops, which
    Inductor fuses into later kernels: pinned only to them, the issue sank below the
    head's matmuls). Every collective but the forward's first all-gather and
    the backward's last reduce-scatter has compute between issue and wait."""
    forward_code, backward_code = pool2.run(llama_step_code)[0]
    s = {"forward": collectives_in_output_code(forward_code), "backward": collectives_in_output_code(backward_code)}
    first_regather = _of(s["backward"], "all_gather")[0]
    assert any(k.startswith("extern_kernels.mm") for k in first_regather.compute_between), first_regather
    _assert_overlapped_but_first_and_last(s)
