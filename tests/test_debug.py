"""Debugging aids: the cross-rank consistency check."""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
import torch.nn as nn

from tests.models import shard_blocks

# ---------------------------------------------------------------- on every rank

class RankDependent(nn.Module):
    """Rank 0 runs an extra sharded layer: its graph has more collectives."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.extra = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        x = self.a(x)
        if dist.get_rank() == 0:
            x = self.extra(x)
        return self.b(x)


def run_rank_dependent_graph(backend: str = "inductor") -> tuple[str, float]:
    from fsdp_compile import fully_shard

    torch.manual_seed(0)
    model = RankDependent()
    for m in (model.a, model.extra, model.b, model):
        fully_shard(m)
    compiled = torch.compile(model, backend=backend)
    start = time.perf_counter()
    try:
        compiled(torch.randn(2, 4)).sum().backward()
    except Exception as e:  # noqa: BLE001 - the message is what the test checks
        return str(e), time.perf_counter() - start
    return "no error", time.perf_counter() - start


def compile_under_dump(path: str) -> list[str]:
    import fsdp_compile.debug
    from fsdp_compile import fully_shard
    from fsdp_compile.testing.models import MLPStack

    torch.manual_seed(0)
    model = shard_blocks(MLPStack(dim=8, n_layers=3, bias=True), fully_shard)
    with fsdp_compile.debug.dump(path) as here:
        torch.compile(model)(torch.randn(2, 8)).sum().backward()
    return sorted(str(p.relative_to(here)) for p in here.rglob("*") if p.is_file() and "depyf" not in p.parts) + [
        f"depyf files: {sum(1 for _ in (here / 'depyf').rglob('*'))}"
    ]


class EagerLinear(nn.Linear):
    """A layer whose forward Dynamo must not trace (as FSDP2's hooks are)."""

    @torch._dynamo.disable
    def forward(self, x):
        return super().forward(x)


class BreaksInsideAUnit(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = EagerLinear(4, 4)

    def forward(self, x):
        x = self.a(x)
        torch._dynamo.graph_break()
        return self.b(x)


def _our_warnings_from_a_step(model_class, then=None) -> list[str]:
    """Our warnings while one aot_eager step of ``model_class()`` (``b`` and the root
    sharded) runs, and ``then()`` after it."""
    import warnings

    from fsdp_compile import fully_shard

    torch.manual_seed(0)
    model = model_class()
    fully_shard(model.b)
    fully_shard(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(model, backend="aot_eager")(torch.randn(2, 4)).sum().backward()
        if then is not None:
            then()
    return [str(w.message) for w in caught if "fsdp_compile" in str(w.message)]


def _recompile_a_graph_of_units() -> None:
    """Recompiles of a graph that holds units (no break of its own). Dynamo skips the
    code of a frame it could not resume for the rest of the process, so start afresh."""
    from fsdp_compile import fully_shard

    torch._dynamo.reset()
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    compiled = torch.compile(model, backend="aot_eager")
    compiled(torch.randn(2, 4)).sum().backward()
    model.eval()
    with torch.no_grad():
        compiled(torch.randn(2, 4))
    compiled(torch.randn(3, 4))  # eval + new batch size: more recompiles


def warnings_after_another_models_break() -> tuple[int, list[str]]:
    """Dynamo's graph breaks while torch's FSDP2 model compiles (its hooks are
    ``torch._dynamo.disable``d), then our warnings while our sharded model, which does
    not break, compiles in the same process."""
    import warnings

    from torch.distributed.fsdp import fully_shard as fsdp2_fully_shard

    from fsdp_compile import fully_shard
    from fsdp_compile.base.compat import dynamo_graph_break_counts

    torch._dynamo.reset()
    torch.manual_seed(0)
    before = sum(dynamo_graph_break_counts().values())
    theirs = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    fsdp2_fully_shard(theirs[0])
    fsdp2_fully_shard(theirs)
    torch.compile(theirs, backend="aot_eager")(torch.randn(2, 4)).sum().backward()
    their_breaks = sum(dynamo_graph_break_counts().values()) - before
    ours = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    fully_shard(ours[0])
    fully_shard(ours)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.compile(ours, backend="aot_eager")(torch.randn(2, 4)).sum().backward()
    return their_breaks, [str(w.message) for w in caught if "fsdp_compile" in str(w.message)]


def warnings_from_break_and_recompile() -> list[str]:
    return _our_warnings_from_a_step(BreaksInsideAUnit, then=_recompile_a_graph_of_units)


@torch._dynamo.disable
def _eager_linear(x, module):
    return torch.nn.functional.linear(x, module.weight)


class ReadsAnotherUnitEagerly(nn.Module):
    """The root's compiled forward calls eager code that reads another unit's weight."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.b = nn.Linear(4, 4)

    def forward(self, x):
        return _eager_linear(self.a(x), self.b)


def warnings_from_eager_gather() -> list[str]:
    return _our_warnings_from_a_step(ReadsAnotherUnitEagerly)


# ---------------------------------------------------------------- tests

def test_rank_dependent_graph_raises_on_every_rank_instead_of_hanging(pool2):
    results = pool2.run(run_rank_dependent_graph, timeout_s=120)
    for rank, (message, seconds) in enumerate(results):
        assert "ranks compiled different collective sequences for the forward graph" in message, message
        assert "First difference at collective #" in message
        # Rank 0 runs one more (10-element) all-gather than rank 1.
        assert "rank 0 issues all_gather_into_tensor(float32[10]) on group" in message
        assert "rank 1 issues nothing (its sequence is shorter)" in message
        assert seconds < 60  # well before any collective timeout


def test_fingerprint_is_rank_independent_despite_padding():
    from fsdp_compile.passes.bucketing import bucket_collectives
    from fsdp_compile.passes.consistency import collective_fingerprint
    from fsdp_compile.passes.reordering import reorder_for_overlap
    from tests.pass_graphs import build_unit_graph

    prints = []
    for rank in (0, 1):
        gm, _ = build_unit_graph(2, rank, "0")
        bucket_collectives(gm.graph)
        reorder_for_overlap(gm.graph)
        prints.append(collective_fingerprint(gm.graph))
    assert prints[0] == prints[1]
    # Unit 0: weight [5, 6] and bias [5] over 2 ranks: padded shards of 3 x 6 + 3 elements.
    # (No process group is named "0" here: the group's ranks are unknown.)
    assert prints[0][0] == ["all_gather_into_tensor", "0", "", "float32[21]", None]


def test_ranks_compare_only_the_collectives_of_groups_they_share():
    """On a 2x2 (dp, tp) mesh the two dp groups are [0, 2] and [1, 3]: with uneven
    tensor-parallel shards each group gathers its own size, which is no disagreement;
    a size, order or count that differs within one group is."""
    from fsdp_compile.runtime.consistency import first_disagreement

    def gather(size, ranks, group="mesh dim 'dp' of size 2"):
        return ["all_gather_into_tensor", group, "", f"float32[{size}]", ranks]

    def tp_reduce(ranks):
        return ["all_reduce", "mesh dim 'tp' of size 2", "sum", "float32[8]", ranks]

    dp_even, dp_odd, tp_low, tp_high = [0, 2], [1, 3], [0, 1], [2, 3]
    uneven = [
        [gather(51, dp_even), tp_reduce(tp_low)],
        [gather(50, dp_odd), tp_reduce(tp_low)],
        [gather(51, dp_even), tp_reduce(tp_high)],
        [gather(50, dp_odd), tp_reduce(tp_high)],
    ]
    assert first_disagreement(uneven) is None
    within_a_group = [list(seq) for seq in uneven]
    within_a_group[2] = [gather(50, dp_even), tp_reduce(tp_high)]
    assert first_disagreement(within_a_group) == (0, 2, 0, gather(51, dp_even)[:4], gather(50, dp_even)[:4])
    reordered = [list(seq) for seq in uneven]
    reordered[1] = [tp_reduce(tp_low), gather(50, dp_odd)]  # ranks 0 and 1 share the tp group only
    assert first_disagreement(reordered) is None
    reordered[0] = [tp_reduce(tp_low), tp_reduce(tp_low)]
    assert first_disagreement(reordered)[:3] == (0, 1, 1)  # one more all-reduce on their tp group
    assert first_disagreement([[gather(4, None)], [gather(4, None)]]) is None  # unknown groups: compared
    assert first_disagreement([[gather(4, None)], [gather(6, None)]])[:3] == (0, 1, 0)


def test_dump_writes_every_stage_per_rank(pool2, tmp_path):
    import json

    listings = pool2.run(compile_under_dump, str(tmp_path))
    for rank, files in enumerate(listings):
        assert int(files[-1].split(": ")[1]) > 0, "depyf wrote nothing"
        for kind in ("forward", "backward"):
            folder = next(f.split("/")[0] for f in files if f.startswith("graph_") and f.split("/")[0].endswith(kind))
            for name in ("0_input.py", "1_bucketing.py", "2_reordering.py", "3_pinned.py", "output_code.py",
                         "collectives.md", "timeline.json", "timeline.svg"):
                assert f"{folder}/{name}" in files, (rank, folder, name)
            root = tmp_path / f"rank{rank}" / folder
            table = (root / "collectives.md").read_text()
            assert "| # | kind | unit | parameters |" in table
            assert table.count("| all_gather |" if kind == "forward" else "| reduce_scatter |") == 3
            trace = json.loads((root / "timeline.json").read_text())
            assert any(e.get("tid") == 1 and e["ph"] == "X" for e in trace["traceEvents"])
            assert (root / "timeline.svg").read_text().startswith("<svg")
        assert any(f.startswith("joint_") for f in files)


def test_environment_variable_dump_and_torch_logs(tmp_path):
    """FSDP_COMPILE_DUMP and TORCH_LOGS="+fsdp_compile" in a fresh process (fake world of 4)."""
    import os
    import subprocess
    import sys
    import textwrap

    script = textwrap.dedent(
        """
        import torch, torch.distributed as dist
        import fsdp_compile
        from fsdp_compile.testing._torch_internals import register_fake_process_group
        from fsdp_compile.testing._backends import register_test_backends
        from fsdp_compile.testing.models import MLPStack
        register_test_backends()  # inductor_passes: Inductor's passes and ours, no code generation
        register_fake_process_group()
        dist.init_process_group("fake", rank=0, world_size=4)
        model = MLPStack(dim=8, n_layers=2, bias=True)
        for layer in model.layers:
            fsdp_compile.fully_shard(layer)
        fsdp_compile.fully_shard(model)
        torch.compile(model, backend="inductor_passes")(torch.randn(2, 8)).sum().backward()
        """
    )
    env = dict(os.environ, FSDP_COMPILE_DUMP=str(tmp_path), TORCH_LOGS="+fsdp_compile")
    done = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "all_gather bucket for unit 'layers.0': 2 collective(s) -> 1" in done.stderr
    assert "issued before the wait of unit 'layers.0'" in done.stderr
    assert list((tmp_path / "rank0").glob("graph_*_forward/collectives.md"))


def test_graph_break_and_recompile_warnings_name_the_unit(pool2):
    messages = pool2.run(warnings_from_break_and_recompile)[0]
    breaks = [m for m in messages if "graph break in a compiled frame" in m]
    assert breaks and all("debug.dump" in m and "TORCH_LOGS=graph_breaks" in m for m in breaks)
    # The user's break is reported with the unit whose frame it split (the root's);
    # unit 'b', whose forward Dynamo must not trace, is named as gathered in eager code.
    assert any("graph_break()" in m and "'(root)'" in m for m in breaks), breaks
    eager_gathers = [m for m in messages if "graph break inside the sharded forward" in m]
    assert any("unit 'b'" in m and "'b.weight'" in m for m in eager_gathers), messages
    eager = pool2.run(warnings_from_eager_gather)[0]
    eager = [m for m in eager if "graph break inside the sharded forward" in m]
    assert any("unit 'b'" in m and "'b.weight'" in m for m in eager), eager

def recompile_warnings() -> dict[str, list[str]]:
    """Our recompile warnings, per cause, for a compiled sharded model (aot_eager): the
    model's own guards (eval and no_grad, a new batch size, a module attribute read in the
    forward, as a transformers layer reads its ``layer_idx``; a frozen parameter), then sharding state (the
    first ``set_requires_gradient_sync(False)`` step)."""
    import warnings

    from fsdp_compile import fully_shard

    class Scaled(nn.Module):
        def __init__(self):
            super().__init__()
            self.lin, self.factor = nn.Linear(4, 4), 1

        def forward(self, x):
            return self.lin(x) * self.factor

    torch._dynamo.reset()
    torch.manual_seed(0)
    model = nn.Sequential(Scaled(), nn.ReLU(), nn.Linear(4, 4))
    fully_shard(model[0])
    fully_shard(model)
    compiled = torch.compile(model, backend="aot_eager")
    out = {}

    def step(x):
        compiled(x).sum().backward()

    def caught_by(name, fn):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fn()
        out[name] = [str(w.message) for w in caught if "recompiling a graph" in str(w.message)]

    caught_by("first", lambda: step(torch.randn(2, 4)))
    # Freezing a layer: the failed check is on the shard's local view, as on the parameter unsharded.
    model[0].lin.weight.requires_grad_(False)
    caught_by("frozen parameter", lambda: [step(torch.randn(2, 4)) for _ in range(2)])
    model.eval()
    with torch.no_grad():
        caught_by("eval", lambda: compiled(torch.randn(2, 4)))
    model.train()
    caught_by("batch size", lambda: step(torch.randn(3, 4)))
    model[0].factor = 2
    caught_by("module attribute", lambda: step(torch.randn(3, 4)))
    model.set_requires_gradient_sync(False)
    caught_by("gradient sync off", lambda: step(torch.randn(3, 4)))
    return out


def test_recompile_warning_only_for_a_guard_on_sharding_state(pool2):
    """Recompiles the unsharded model (and FSDP2's) would have too are Dynamo's to report
    (accelerate's regional compile recompiles each transformers layer on its ``layer_idx``):
    no warning of ours; a guard on our units' state gets one that names the guard."""
    warned = pool2.run(recompile_warnings)[0]
    for cause in ("first", "eval", "batch size", "module attribute", "frozen parameter"):
        assert warned[cause] == [], (cause, warned[cause])
    assert len(warned["gradient sync off"]) == 1, warned
    message = warned["gradient sync off"][0]
    assert "because of a guard on sharding state" in message and "TORCH_LOGS=recompiles" in message, message


def test_another_models_graph_break_is_not_blamed_on_our_units(pool2):
    """Dynamo counts graph breaks per process: a break in a model compiled earlier
    (here FSDP2's) is not reported against a later sharded model that has none."""
    their_breaks, messages = pool2.run(warnings_after_another_models_break)[0]
    assert their_breaks > 0  # the earlier model did break
    assert not [m for m in messages if "graph break" in m], messages


def test_group_labels_do_not_outlive_their_process_group():
    """Group names are reused after destroy_process_group: a mesh label from an earlier
    process group must not name a group of the next one (it made the fingerprint
    test depend on which tests ran before it)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from fsdp_compile.base.compat import group_name_of
    from fsdp_compile.runtime.process_groups import group_label, label_mesh_groups
    from fsdp_compile.testing._torch_internals import register_fake_process_group

    register_fake_process_group()
    dist.init_process_group("fake", rank=0, world_size=8)
    try:
        mesh = init_device_mesh("cpu", (8,), mesh_dim_names=("stale",))
        name = group_name_of(mesh.get_group(0))
        label_mesh_groups(mesh)
        assert group_label(name) == "mesh dim 'stale' of size 8"
    finally:
        dist.destroy_process_group()
    dist.init_process_group("fake", rank=0, world_size=8)
    try:
        assert group_label(name) != "mesh dim 'stale' of size 8"
    finally:
        dist.destroy_process_group()
