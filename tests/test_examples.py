"""Smoke tests of the examples (train.py, hf_llama.py, qlora.py).

hf_llama.py runs as users run it: a process of its own that starts its own 2 CPU ranks
(``examples/_launch.py``). The others run the example's ``train(args)``, parsed from the
same command line, on ranks forked for that run from the test pools' server, which has
imported torch and fsdp_compile once (a fresh process per rank and run, so a resumed
run starts from the checkpoint alone): each start of a process costs its imports.
"""

from __future__ import annotations

import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from fsdp_compile.testing import RankPool
from fsdp_compile.testing._rank_pool import fastest_start_method

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["--layers", "1", "--dim", "32", "--vocab", "64", "--seq-len", "16", "--compile-backend", "aot_eager"]


def _run(script: str, *args: str) -> subprocess.CompletedProcess:
    done = subprocess.run(
        [sys.executable, str(ROOT / "examples" / script), *args],
        capture_output=True,
        text=True,
        timeout=300,
        env=dict(os.environ, OMP_NUM_THREADS="1"),
    )
    assert done.returncode == 0, f"stdout:\n{done.stdout[-1500:]}\nstderr:\n{done.stderr[-3000:]}"
    return done


def _example(script: str):
    """The example module ``script`` (``examples/`` joins ``sys.path``, as when it runs)."""
    import importlib

    examples = str(ROOT / "examples")
    if examples not in sys.path:
        sys.path.insert(0, examples)
    return importlib.import_module(script.removesuffix(".py"))


def train_on_rank(script: str, argv: list[str]) -> str:
    """On every rank: the example's ``train(parse_args(argv))``; what it printed."""
    import contextlib
    import io

    import torch.distributed as dist

    module = _example(script)
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        module.train(module.parse_args(argv))
    dist.barrier()  # as examples/_launch.py: no rank leaves while a peer still talks
    return printed.getvalue()


def _run_in_fresh_ranks(script: str, *args: str) -> str:
    """Rank 0's output of the example's ``train`` on as many fresh ranks as its command
    line asks for (``--world-size``, by default 2 x ``--tp``)."""
    world_size = _example(script).parse_args(list(args)).world_size
    with RankPool(world_size, start_method=fastest_start_method(), failure_grace_s=3.0) as pool:
        return pool.run(train_on_rank, script, list(args), timeout_s=300)[0]


def _step_losses(stdout: str) -> dict[int, str]:
    """train.py's printed loss of each step, by step."""
    return {int(m.group(1)): m.group(2) for m in re.finditer(r"^step +(\d+) +loss (\S+) .* ETA", stdout, re.M)}


def _train(*args: str) -> dict[int, str]:
    return _step_losses(_run_in_fresh_ranks("train.py", *SMALL, *args))


def test_train_save_resume_continues_exactly(tmp_path):
    """Eager (three runs of the example, each on fresh ranks; the compiled step with DCP:
    test_features)."""
    eager = ("--compile-backend", "eager")
    straight = _train("--steps", "3", *eager)
    assert sorted(straight) == [0, 1, 2]
    _train("--steps", "2", "--save", str(tmp_path / "ckpt"), *eager)
    resumed = _train("--steps", "1", "--resume", str(tmp_path / "ckpt"), *eager)
    assert resumed == {2: straight[2]}  # same loss, to the printed digits


def test_train_with_tensor_parallelism_matches_data_parallel_only():
    """--tp 2: 4 ranks as (dp=2, tp=2) see the same batches as 2 data-parallel ranks
    (dim 48: the feed-forward width, 128, splits evenly over the TP ranks). Eager: the
    compiled FSDP + TP step is tested in test_tensor_parallel.py."""
    args = ("--steps", "2", "--dim", "48", "--compile-backend", "eager")
    plain, tensor_parallel = _train(*args), _train(*args, "--tp", "2")
    assert sorted(tensor_parallel) == [0, 1]
    assert all(abs(float(plain[s]) - float(tensor_parallel[s])) < 2e-4 for s in plain)


def test_train_bf16_with_activation_checkpointing_runs():
    """Both options at once (one run: each start of the example costs its ranks' imports)."""
    assert len(_train("--steps", "2", "--bf16", "--activation-checkpointing", "selective")) == 2


def test_hf_llama_example_trains():
    done = _run("hf_llama.py", "--steps", "2", "--compile-backend", "aot_eager")
    assert len(re.findall(r"^step \d+  loss \d+\.\d+", done.stdout, re.M)) == 2


def _falling(losses: list[float]) -> bool:
    return all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_train_float8_compiled_trains():
    """--float8: torchao float8 training (emulated on CPU) of every linear in the blocks
    (dim 48: all of their dims are multiples of 16), float8 all-gathers, compiled step."""
    pytest.importorskip("torchao")
    printed = _run_in_fresh_ranks("train.py", *SMALL, "--steps", "3", "--dim", "48", "--float8")
    assert "float8 (emulated): 7 linears converted" in printed
    losses = _step_losses(printed)
    assert sorted(losses) == [0, 1, 2] and _falling([float(v) for v in losses.values()])


def test_train_refuses_float8_with_tensor_parallelism(capsys):
    with pytest.raises(SystemExit) as refused:
        _example("train.py").parse_args(["--float8", "--tp", "2"])
    assert refused.value.code == 2
    assert "--float8 with --tp is not supported" in capsys.readouterr().err


def test_qlora_example_trains_adapters_over_nf4_shards():
    """qlora.py: frozen NF4 projections (sharded, still NF4) and trainable LoRA adapters, compiled."""
    pytest.importorskip("torchao")
    pytest.importorskip("transformers")
    printed = _run_in_fresh_ranks("qlora.py", "--steps", "3", "--layers", "1", "--compile-backend", "aot_eager")
    losses = [float(v) for v in re.findall(r"^step +\d+  loss (\S+)", printed, re.M)]
    assert len(losses) == 3 and _falling(losses), printed
    assert "local tensor type: NF4Tensor" in printed
