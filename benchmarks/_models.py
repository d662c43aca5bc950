"""The models the step benchmarks train, by family (``--model``):

- ``llama``: our Llama-style reference model (``fsdp_compile.testing.models.Llama``);
- ``hf-llama``: a ``transformers`` ``LlamaForCausalLM`` of the same shapes (built from a
  config, no download; SDPA attention, tied embeddings), what users arrive with.

Both take token ids and return logits; both are sharded one unit per decoder layer
plus the root. A model is described by a plain dict (:func:`spec`), so it travels to
the ranks, and built there by :func:`build`.
"""

from __future__ import annotations

FAMILIES = ("llama", "hf-llama")


def spec(family: str, *, vocab: int, dim: int, layers: int, seq: int) -> dict:
    """The model's description: ``dim // 64`` heads (at least 2), SwiGLU width ``8/3 dim``."""
    if family not in FAMILIES:
        raise SystemExit(f"unknown model family {family!r}; choose from {list(FAMILIES)}")
    return {
        "family": family,
        "vocab": vocab,
        "dim": dim,
        "layers": layers,
        "heads": max(2, dim // 64),
        "ffn": dim * 8 // 3,
        "seq": seq,
    }


def describe(model: dict) -> str:
    name = {"llama": "Llama-style", "hf-llama": "transformers Llama"}[model["family"]]
    return f"{name} ({model['layers']} layers, dim {model['dim']}, vocab {model['vocab']})"


_classes: dict = {}


def _class(family: str, own_frame: bool) -> type:
    """The model class; ``own_frame``: a subclass whose forward is a code object of its
    own. Dynamo caches compiled frames per code object, and the other setups' compiled
    frames of the same forward (FSDP2's, with its graph breaks) would make this one
    recompile in the timed steps."""
    key = (family, own_frame)
    if key in _classes:
        return _classes[key]
    if own_frame:
        base = _class(family, False)

        def forward(self, tokens):
            return base.forward(self, tokens)

        cls = type(f"OwnFrame{base.__name__}", (base,), {"forward": forward})
    elif family == "llama":
        from fsdp_compile.testing.models import Llama as cls
    else:
        from transformers import LlamaForCausalLM

        def forward(self, tokens):
            return LlamaForCausalLM.forward(self, input_ids=tokens, use_cache=False).logits

        cls = type("HFLlamaLogits", (LlamaForCausalLM,), {"forward": forward})
    _classes[key] = cls
    return cls


def build(model: dict, *, own_frame: bool = False):
    """A fresh model (seed it before calling): ``tokens -> logits``."""
    if model["family"] == "llama":
        from fsdp_compile.testing.models import LlamaConfig

        config = LlamaConfig(
            vocab_size=model["vocab"], dim=model["dim"], n_layers=model["layers"], n_heads=model["heads"],
            ffn_dim=model["ffn"], max_seq_len=model["seq"],
        )
    else:
        from transformers import LlamaConfig

        config = LlamaConfig(
            vocab_size=model["vocab"], hidden_size=model["dim"], intermediate_size=model["ffn"],
            num_hidden_layers=model["layers"], num_attention_heads=model["heads"],
            num_key_value_heads=model["heads"], max_position_embeddings=model["seq"],
            tie_word_embeddings=True, attn_implementation="sdpa",
        )
    return _class(model["family"], own_frame)(config)


def block_prefix(model: dict) -> str:
    """The qualified-name prefix of the decoder layers (``layers.`` / ``model.layers.``)."""
    return "layers." if model["family"] == "llama" else "model.layers."


def block_list(module):
    """The ``ModuleList`` holding a built model's decoder layers."""
    return module.layers if hasattr(module, "layers") else module.model.layers


def blocks(module) -> list:
    """The decoder layers of a built model, in order."""
    return list(block_list(module))


def bucket_plans(module) -> list:
    """torchtitan's ``get_transformer_block_buckets`` for a built model: the embedding,
    one bucket per decoder layer, and the final norm with the output projection."""
    if hasattr(module, "layers"):
        return ["tok_embeddings", *(f"layers.{i}" for i in range(len(module.layers))), ["norm", "output"]]
    n = len(module.model.layers)
    return ["model.embed_tokens", *(f"model.layers.{i}" for i in range(n)), ["model.norm", "lm_head"]]
