"""Parity over several optimizer steps on 2 gloo ranks.

Eager-ours vs compiled-ours (aot_eager) is bitwise: the same ops run. Every
sharded variant matches a single-process unsharded reference on the same
global batch to fp32 rounding (the global mean is computed in a different
order), and so does torch's own FSDP2 where it can run the model.

The rank-side functions (module-level, so they pickle) come first; the layout,
mixed-precision and feature tests run them too.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from fsdp_compile.testing import full_parameters, global_mean
from tests.models import batch, build, compile_counting_graphs, loss_fn

# ---------------------------------------------------------------- on every rank

COMPILE_BACKENDS = {
    "ours-eager": None,
    "ours-aot_eager": "aot_eager",
    "ours-inductor": "inductor",
    # Inductor's graph pipeline with our passes, no code generation (fsdp_compile.testing._backends).
    "ours-inductor_passes": "inductor_passes",
    # aot_eager with our joint and post-grad passes: bitwise eager (fsdp_compile.testing._backends).
    "ours-aot_eager_passes": "aot_eager_passes",
    "fsdp2": None,
}


MIXED_PRECISION = {
    None: None,
    "bf16": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.float32),
    "bf16-reduce-bf16": dict(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16),
    # No reduce dtype: FSDP2 reduces in bf16 on torch 2.13, in the parameters' fp32 on 2.15.
    "bf16-reduce-unset": dict(param_dtype=torch.bfloat16),
    # torch >= 2.15: parameters marked keep_fp32 (the routed model's routers) stay fp32.
    "bf16-router-fp32": dict(
        param_dtype=torch.bfloat16,
        reduce_dtype=torch.float32,
        param_dtype_override_fn=lambda p: p.dtype if getattr(p, "keep_fp32", False) else None,
    ),
}


def _shard_model(variant: str, units, mp: str | None = None, layout: str = "fsdp") -> None:
    """Shard ``units`` bottom-up. ``layout``: ``fsdp`` (1-D mesh), ``hsdp`` (2 x world/2
    mesh, replicate x shard), ``hsdp-1`` (world x 1: shard groups of one rank), ``ddp`` (``replicate``), ``offload`` (``CPUOffloadPolicy``)
    or ``reshard-half`` (1-D mesh, ``reshard_after_forward=world/2``)."""
    if variant == "reference":
        return
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy

    if variant == "fsdp2":
        from torch.distributed._composable.replicate_with_fsdp import replicate
        from torch.distributed.fsdp import fully_shard
    else:
        from fsdp_compile import fully_shard, replicate
    policy = MixedPrecisionPolicy(**(MIXED_PRECISION[mp] or {}))
    kwargs = {}
    if layout in ("hsdp", "hsdp-1"):
        shape = (2, dist.get_world_size() // 2) if layout == "hsdp" else (dist.get_world_size(), 1)
        kwargs["mesh"] = init_device_mesh("cpu", shape, mesh_dim_names=("replicate", "shard"))
    elif layout == "offload":
        kwargs["offload_policy"] = CPUOffloadPolicy(pin_memory=False)
    elif layout == "reshard-half":
        kwargs["reshard_after_forward"] = dist.get_world_size() // 2
    apply = replicate if layout == "ddp" else fully_shard
    for unit in units:
        apply(unit, mp_policy=policy, **kwargs)


def train(name: str, variant: str, steps: int = 3, with_eval: bool = False, mp: str | None = None, layout: str = "fsdp") -> dict:
    """Train ``name`` for ``steps`` SGD steps under ``variant``; the full parameters after each.

    ``reference`` is one unsharded model on the global batch (computed on every
    rank, without communication); the others shard it over the pool's ranks and
    feed each rank its slice of the same global batch.
    """
    for suffix in (
        "-a2a",
        "-gloo",
    ):  # the same, counting the compiled step's collectives: -a2a with config.gloo_all_to_all, -gloo without
        if variant.endswith(suffix):
            from fsdp_compile.base import config

            ops = ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
            base = variant.removesuffix(suffix)
            with config.patch(gloo_all_to_all=suffix == "-a2a"):
                if COMPILE_BACKENDS[base] == "inductor":  # in Inductor's code
                    from torch._inductor.utils import run_and_get_code

                    record, codes = run_and_get_code(train, name, base, steps, with_eval, mp, layout)
                    counts = {op: sum(code.count(f"_c10d_functional.{op}.default(") for code in codes) for op in ops}
                    counts["sum_received_slices"] = sum(code.count("fsdp_compile.sum_received_slices.default(") for code in codes)
                else:  # in the graphs after our passes
                    record, counts = _counting_collectives_after_our_passes(train, name, base, steps, with_eval, mp, layout)
            record["collectives"] = counts
            return record
    rank, world_size = dist.get_rank(), dist.get_world_size()
    model, units = build(name)
    _shard_model(variant, units, mp, layout)
    run, counter = compile_counting_graphs(model, COMPILE_BACKENDS.get(variant), fullgraph=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    sharded = variant != "reference"

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.chunk(world_size)[rank] if sharded else t

    record: dict = {"loss": [], "params": [], "buffers": [], "eval_out": None}

    def train_step(step: int) -> None:
        x, y = batch(name, step)
        loss = loss_fn(name, run(local(x)), local(y))
        loss.backward()
        opt.step()
        opt.zero_grad()
        record["loss"].append(global_mean(loss) if sharded else loss.item())
        record["params"].append(full_parameters(model))
        record["buffers"].append({fqn: b.detach().clone() for fqn, b in model.named_buffers()})

    for step in range(steps):
        train_step(step)
    if with_eval:
        model.eval()
        x, _ = batch(name, 99)
        with torch.no_grad():
            out = run(local(x))
        if sharded:
            pieces = [torch.empty_like(out) for _ in range(world_size)]
            dist.all_gather(pieces, out.contiguous())
            out = torch.cat(pieces)
        record["eval_out"] = out
        model.train()
        train_step(steps)
    record["frames"] = counter.frame_count if counter else None
    return record


def _counting_collectives_after_our_passes(fn, *args, before: str = "pin_schedule") -> tuple:
    """``fn(*args)``, and how many nodes of each collective op (by name) the graphs hold
    after our post-grad passes, counted just before the pass ``before`` of
    ``passes/registration.py``: by default their last one (pinning wraps the collectives
    in ``control_deps``); ``"lower_to_all_to_all"``: before the gloo transport rewrites
    the all-gathers and reduce-scatters as all-to-alls."""
    from fsdp_compile.passes import registration

    counts: dict[str, int] = {"all_gather_into_tensor": 0, "reduce_scatter_tensor": 0, "all_to_all_single": 0}
    counted_pass = getattr(registration, before)

    def counting_pass(graph, *pass_args, **pass_kwargs):
        for node in graph.nodes:
            op = getattr(node.target, "__name__", "").split(".")[0]
            if node.op == "call_function" and op in counts:
                counts[op] += 1
        return counted_pass(graph, *pass_args, **pass_kwargs)

    setattr(registration, before, counting_pass)
    try:
        return fn(*args), counts
    finally:
        setattr(registration, before, counted_pass)


def train_all(
    name: str, variants: list[str], steps: int = 3, with_eval: bool = False, mp: str | None = None, layout: str = "fsdp"
) -> dict:
    return {v: train(name, v, steps, with_eval, mp, layout) for v in variants}


# ---------------------------------------------------------------- tests

OURS = ["ours-eager", "ours-aot_eager", "ours-inductor"]
CASES = {
    # model: (variants, train/eval switch)
    "mlp": (["reference", *OURS, "fsdp2"], False),
    # Inductor with config.gloo_all_to_all (the default: "ours-inductor" is this run), and our
    # passes with and without it, for test_gloo_all_to_all_is_bitwise_equal_to_gloos_own_collectives.
    "llama": (
        ["reference", "ours-eager", "ours-aot_eager", "ours-inductor-a2a", "ours-aot_eager_passes-a2a", "ours-aot_eager_passes-gloo", "fsdp2"],
        False,
    ),
    "llama_tied_across_units": (["reference", "ours-eager", "ours-aot_eager"], False),
    "zoo": (["reference", *OURS], True),
}
STEPS = 3
_cache: dict = {}


def _results_of(pool2, name: str) -> dict:
    """Rank 0's records of every variant of ``CASES[name]``, trained once per session."""
    if name not in _cache:
        variants, with_eval = CASES[name]
        per_rank = pool2.run(train_all, name, variants, STEPS, with_eval)
        # Every rank reports the same full parameters and global losses.
        for variant in variants:
            _assert_records_equal(per_rank[0][variant], per_rank[1][variant], exact=True)
        _cache[name] = per_rank[0]
        if "ours-inductor-a2a" in _cache[name]:  # the default configuration's run
            _cache[name]["ours-inductor"] = _cache[name]["ours-inductor-a2a"]
    return _cache[name]


@pytest.fixture()
def results(pool2, request):
    return _results_of(pool2, request.param)


def _assert_records_equal(a: dict, b: dict, *, exact: bool, rtol=1e-5, atol=1e-6, what="") -> None:
    check = (
        (lambda x, y, m: torch.testing.assert_close(x, y, rtol=0, atol=0, msg=m))
        if exact
        else (lambda x, y, m: torch.testing.assert_close(x, y, rtol=rtol, atol=atol, msg=m))
    )
    assert len(a["loss"]) == len(b["loss"])
    for step, (la, lb) in enumerate(zip(a["loss"], b["loss"], strict=True)):
        check(torch.tensor(la), torch.tensor(lb), lambda m, s=step: f"{what} loss at step {s}: {m}")
    for step, (pa, pb) in enumerate(zip(a["params"], b["params"], strict=True)):
        assert pa.keys() == pb.keys()
        for fqn in pa:
            check(pa[fqn], pb[fqn], lambda m, s=step, f=fqn: f"{what} parameter {f} after step {s}: {m}")
    for step, (ba, bb) in enumerate(zip(a["buffers"], b["buffers"], strict=True)):
        assert ba.keys() == bb.keys()
        for fqn in ba:
            check(ba[fqn], bb[fqn], lambda m, s=step, f=fqn: f"{what} buffer {f} after step {s}: {m}")
    if a["eval_out"] is not None or b["eval_out"] is not None:
        check(a["eval_out"], b["eval_out"], lambda m: f"{what} eval output: {m}")


def test_gloo_all_to_all_is_bitwise_equal_to_gloos_own_collectives(pool2):
    """``config.gloo_all_to_all`` (the default) on 2 ranks against gloo's own all-gather and
    reduce-scatter, through our passes (``aot_eager_passes``): the same arithmetic (a
    reduce-scatter sums two slices, and a + b is b + a), so the same losses and parameters,
    bit for bit, over 3 steps; and in Inductor's code of the default run, in one graph,
    every all-gather and reduce-scatter is an all-to-all, each reduce-scatter's sum our
    opaque op (traced, each was one more C++ kernel to build)."""
    result = _results_of(pool2, "llama")  # rank 1's records are checked equal to rank 0's there
    lowered, default = result["ours-aot_eager_passes-a2a"], result["ours-aot_eager_passes-gloo"]
    _assert_records_equal(lowered, default, exact=True, what="all-to-all vs gloo's collectives")
    lowered, default = lowered["collectives"], default["collectives"]
    assert default["all_to_all_single"] == lowered["all_gather_into_tensor"] == lowered["reduce_scatter_tensor"] == 0
    assert lowered["all_to_all_single"] == default["all_gather_into_tensor"] + default["reduce_scatter_tensor"] > 0
    inductor = result["ours-inductor-a2a"]
    assert inductor["frames"] == 1
    assert inductor["collectives"]["all_gather_into_tensor"] == inductor["collectives"]["reduce_scatter_tensor"] == 0
    assert inductor["collectives"]["all_to_all_single"] == lowered["all_to_all_single"]
    # Each reduce-scatter's sum over the ranks' slices is our one op, not a C++ kernel per size.
    assert inductor["collectives"]["sum_received_slices"] == default["reduce_scatter_tensor"] > 0


@pytest.mark.parametrize("results", list(CASES), indirect=True)
def test_compiled_aot_eager_is_bitwise_equal_to_eager(results):
    _assert_records_equal(results["ours-eager"], results["ours-aot_eager"], exact=True, what="aot_eager vs eager")


@pytest.mark.parametrize(
    "results,variant",
    [(name, v) for name, (variants, _) in CASES.items() for v in variants if v != "reference"],
    indirect=["results"],
)
def test_matches_single_process_reference(results, variant):
    _assert_records_equal(results["reference"], results[variant], exact=False, what=f"{variant} vs reference")


@pytest.mark.parametrize("results", ["mlp", "llama"], indirect=True)
def test_ours_compiled_matches_torch_fsdp2(results):
    _assert_records_equal(results["fsdp2"], results["ours-inductor"], exact=False, what="inductor vs FSDP2")


@pytest.mark.parametrize(
    "results,variant",
    [(name, v) for name, (variants, _) in CASES.items() for v in variants if v == "ours-aot_eager" or v.startswith("ours-inductor")],
    indirect=["results"],
)
def test_one_graph_no_recompiles(results, variant):
    """fullgraph=True already forbids graph breaks; across steps nothing recompiles.
    The train/eval switch of ``zoo`` adds exactly one (eval, no-grad) graph."""
    with_eval = results["reference"]["eval_out"] is not None
    assert results[variant]["frames"] == (2 if with_eval else 1)


def train_counting_post_grad_passes(name: str, variant: str) -> dict:
    """``train``, and how many graphs our post-grad passes ran on meanwhile."""
    from fsdp_compile.passes import registration

    before = len([s for s in registration.pass_seconds if s[1] == "post_grad"])
    record = train(name, variant, STEPS)
    record["post_grad_graphs"] = len([s for s in registration.pass_seconds if s[1] == "post_grad"]) - before
    return record


def _control_deps_runs_eagerly() -> bool:
    from fsdp_compile.testing._torch_internals import control_deps_runs_eagerly

    return control_deps_runs_eagerly()


# torch 2.11's control_deps (our pinning wraps collectives in it) has no eager kernel.
needs_eager_control_deps = pytest.mark.skipif(
    not _control_deps_runs_eagerly(), reason="torch 2.11's control_deps has no eager kernel (inductor_passes)"
)


@needs_eager_control_deps
def test_inductor_passes_backend_runs_our_passes_and_trains_as_inductor(pool2):
    """The suite's ``"inductor_passes"`` backend (feature tests use it where Inductor's code
    generation is not their subject) runs our post-grad passes on the forward and the
    backward graph, as Inductor does, and trains as Inductor and the reference do."""
    per_rank = pool2.run(train_counting_post_grad_passes, "llama", "ours-inductor_passes")
    _assert_records_equal(per_rank[0], per_rank[1], exact=True, what="rank 0 vs rank 1")
    passes = per_rank[0]
    assert passes["post_grad_graphs"] == 2 and passes["frames"] == 1
    inductor = pool2.run(train, "llama", "ours-inductor", STEPS)[0]
    reference = pool2.run(train, "llama", "reference", STEPS)[0]
    _assert_records_equal(reference, passes, exact=False, what="inductor_passes vs reference")
    _assert_records_equal(inductor, passes, exact=False, what="inductor_passes vs inductor")


def train_through_aot_eager_passes(name: str, bucketing: bool) -> dict:
    """``train`` compiled with ``"aot_eager_passes"``, counting the graphs our post-grad
    passes ran on and the all-gathers and reduce-scatters they left (before the gloo
    transport sends them as all-to-alls; see :func:`train_split`)."""
    from fsdp_compile.base import config

    with config.patch(bucketing=bucketing):
        record, counts = _counting_collectives_after_our_passes(
            train_counting_post_grad_passes, name, "ours-aot_eager_passes", before="lower_to_all_to_all"
        )
    record["collectives"] = counts
    return record


@needs_eager_control_deps
def test_aot_eager_passes_backend_runs_our_passes_and_is_bitwise_eager(pool2):
    """The suite's ``"aot_eager_passes"`` backend (feature tests use it where our front-end
    and passes are their subject) runs our post-grad passes on the forward and the backward
    graph, bucketing as under Inductor, and on 2 ranks trains bit for bit as eager, with
    and without bucketing."""
    eager = pool2.run(train, "llama", "ours-eager", STEPS)[0]
    bucketed, per_parameter = (pool2.run(train_through_aot_eager_passes, "llama", b)[0] for b in (True, False))
    for record in (bucketed, per_parameter):
        assert record["post_grad_graphs"] == 2 and record["frames"] == 1
        _assert_records_equal(record, eager, exact=True, what="aot_eager_passes vs eager")
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        assert 0 < bucketed["collectives"][op] < per_parameter["collectives"][op], (op, bucketed, per_parameter)


def train_split(name: str, split_unit_min_mb: float | None) -> dict:
    """``train`` through our passes on eager's ops (``aot_eager_passes``) with
    ``config.split_unit_min_mb``, counting the all-gathers and reduce-scatters in the
    graphs after our passes, before the gloo transport sends them as all-to-alls. (Not
    with gloo's own collectives: run eagerly, two of gloo's coalesced all-gathers in
    flight corrupt a rank's heap; see [Note: gloo all-gathers].)"""
    from fsdp_compile.base import config

    with config.patch(split_unit_min_mb=split_unit_min_mb):
        record, counts = _counting_collectives_after_our_passes(
            train, name, "ours-aot_eager_passes", STEPS, before="lower_to_all_to_all"
        )
    record["collectives"] = counts
    return record


@needs_eager_control_deps
@pytest.mark.parametrize("name", ["llama", "llama_untied"])
def test_a_root_used_apart_is_bucketed_per_run_and_trains_the_same(pool2, name):
    """``split_unit_min_mb=0``: the root's parameters used before the layers (the token
    embedding) and after them (final norm; the output projection where untied; a tied
    one is used at both ends and stays with the embedding) get their own all-gather and
    reduce-scatter: one more of each than one bucket per unit, and the same training as
    without the split (bit for bit: eager's ops on 2 ranks) and as the single-process
    reference, in one graph."""
    per_rank = pool2.run(train_split, name, 0.0)
    whole = pool2.run(train_split, name, None)[0]
    _assert_records_equal(per_rank[0], per_rank[1], exact=True, what="rank 0 vs rank 1")
    split = per_rank[0]
    reference = pool2.run(train, name, "reference", STEPS)[0]
    _assert_records_equal(reference, split, exact=False, what="split vs reference")
    _assert_records_equal(whole, split, exact=True, what="split vs one bucket per unit")
    assert split["frames"] == whole["frames"] == 1
    for op in ("all_gather_into_tensor", "reduce_scatter_tensor"):
        assert split["collectives"][op] == whole["collectives"][op] + 1 > 1, op


def eager_collectives_per_step(name: str, **config_changes) -> dict:
    """Collectives one eager step of ours issues, counted by torch's ``CommDebugMode`` as
    FSDP2's tests count them: all-gathers in forward and in backward, reduce-scatters in
    backward (under ``config.patch(**config_changes)``)."""
    from torch.distributed.tensor.debug import CommDebugMode

    from fsdp_compile.base import config

    c10d = torch.ops.c10d
    model, units = build(name)
    # Units owning parameters of their own (a root may own none: the MLP's).
    inner = [{id(p) for p in unit.parameters()} for unit in units]
    owning = sum(bool(own - set().union(*inner[:i])) for i, own in enumerate(inner))
    _shard_model("ours", units)
    rank, world_size = dist.get_rank(), dist.get_world_size()
    x, y = batch(name, 0)
    with config.patch(**config_changes), CommDebugMode() as fwd:
        loss = loss_fn(name, model(x.chunk(world_size)[rank]), y.chunk(world_size)[rank])
    with config.patch(**config_changes), CommDebugMode() as bwd:
        loss.backward()
    counts = {
        "units": owning,
        "forward_all_gathers": fwd.get_comm_counts()[c10d._allgather_base_],
        "backward_all_gathers": bwd.get_comm_counts()[c10d._allgather_base_],
        "reduce_scatters": bwd.get_comm_counts()[c10d._reduce_scatter_base_],
    }
    counts["others"] = fwd.get_total_counts() + bwd.get_total_counts() - sum(v for k, v in counts.items() if k != "units")
    return counts


@pytest.mark.parametrize("name", ["mlp", "llama"])
def test_eager_issues_one_collective_per_unit_like_fsdp2(pool2, name):
    """Eager runs bucket as FSDP2 does: one all-gather per unit (that owns parameters) in
    forward, one re-gather per resharded unit (all but the root) in backward, one
    reduce-scatter per unit; not one per parameter. The compiled-graph bucket options do
    not change that (a cap smaller than any parameter)."""
    for changes in ({}, {"bucket_mode": "cap", "bucket_cap_mb": 1e-6}):
        for counts in pool2.run(eager_collectives_per_step, name, **changes):
            units = counts["units"]
            assert counts["forward_all_gathers"] == units, (changes, counts)
            assert counts["backward_all_gathers"] == units - 1, (changes, counts)
            assert counts["reduce_scatters"] == units, (changes, counts)
            assert counts["others"] == 0, (changes, counts)
