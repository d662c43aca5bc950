"""Real ``transformers`` architectures, sharded per block and compiled with Inductor.

For each model: 3 SGD (momentum) steps on 2 gloo ranks match a single-process unsharded reference
to fp32 rounding, and the compiled sharded model compiles no more graphs than the
unsharded model under the same ``torch.compile`` call (GPT-2 breaks the graph by itself;
the checkpointed Llama checkpoints around each sharded layer). SGD rather than Adam:
Adam scales each update by the gradient's own magnitude, so parameters whose true
gradient is zero (a key-projection bias: softmax ignores it) turn rounding noise into
full-size updates and no tolerance tells rounding from a bug.
"""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")

from fsdp_compile.testing import assert_parity  # noqa: E402
from tests import hf_models  # noqa: E402

# model: torch.compile arguments (fullgraph where the unsharded model compiles to one graph)
MODELS = {
    "dense_gqa": {"fullgraph": True},
    "moe": {"fullgraph": True},
    "gpt2": {},
    "bert_mlm": {"fullgraph": True},
    "llama_checkpointed": {},
}


@pytest.mark.parametrize("name", list(MODELS))
def test_real_model_trains_like_reference_without_extra_graphs(pool2, name):
    report = assert_parity(
        getattr(hf_models, name),
        hf_models.batch,
        hf_models.token_loss,
        shard_fn=hf_models.shard_per_block,
        backends=("inductor",),
        steps=3,
        rtol=1e-5,
        atol=1e-6,
        compile_kwargs=MODELS[name],
        check_graph_count=True,
        pool=pool2,
    )
    print(name, report)
    assert report.graphs["ours:inductor"] <= report.graphs["unsharded"]
    if MODELS[name].get("fullgraph"):
        assert report.graphs["ours:inductor"] == 1
    else:  # the model breaks the graph by itself
        assert report.graphs["unsharded"] > 1
