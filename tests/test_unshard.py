"""``unshard()`` keeps autograd, and other stacks' ``isinstance(m, FSDPModule)`` checks see
our units: the two defects that made torchtitan train silently wrong (its gradient-divide
loop skipped our units; its chunked loss ran forward/backward on ``lm_head.unshard()``-ed
parameters whose gradients were dropped). Each pattern is run against torch's FSDP2 on
the same ranks and data, eager and compiled."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from tests.models import fully_shard_of

STEPS = 3
CHUNKS = 2


class TinyLM(nn.Module):
    """An embedding, two blocks and a head that ``forward`` leaves to the loss: torchtitan's
    layout in miniature (its chunked loss calls the head)."""

    def __init__(self, vocab: int = 16, dim: int = 8) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(nn.Sequential(nn.Linear(dim, dim), nn.Tanh()) for _ in range(2))
        self.norm = nn.LayerNorm(dim)
        self.lm_head = nn.Linear(dim, vocab, bias=False)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.embed(tokens)
        for layer in self.layers:
            h = h + layer(h)
        return self.norm(h)


def _sharded_tiny_lm(kind: str) -> TinyLM:
    fully_shard = fully_shard_of(kind)
    torch.manual_seed(0)
    model = TinyLM()
    for layer in model.layers:
        fully_shard(layer)
    fully_shard(model.lm_head)
    fully_shard(model)
    return model


def _chunked_loss(model: TinyLM, hidden: torch.Tensor, labels: torch.Tensor, head) -> torch.Tensor:
    """torchtitan's chunked cross-entropy (``components/loss.py``): the head unsharded once,
    no gradient sync but on the last chunk, one forward/backward per chunk into a detached
    hidden state, whose accumulated gradient then flows through the trunk."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    lm_head = model.lm_head
    fsdp_enabled = isinstance(lm_head, TorchFSDPModule)  # torchtitan's own check
    assert fsdp_enabled
    lm_head.set_reshard_after_forward(False)
    lm_head.set_reshard_after_backward(False)
    lm_head.set_requires_gradient_sync(False, recurse=False)
    lm_head.unshard()
    h_chunks = [c.detach().requires_grad_(True) for c in hidden.chunk(CHUNKS, dim=1)]
    total, grads = hidden.new_zeros(()), []
    for i, (h, y) in enumerate(zip(h_chunks, labels.chunk(CHUNKS, dim=1), strict=True)):
        if i == len(h_chunks) - 1:
            lm_head.set_requires_gradient_sync(True, recurse=False)
        logits = head(h)
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), y.flatten()) / CHUNKS
        loss.backward()
        total = total + loss.detach()
        grads.append(h.grad)
    lm_head.set_reshard_after_forward(True)
    lm_head.set_reshard_after_backward(True)
    lm_head.set_requires_gradient_sync(True, recurse=False)
    lm_head.reshard()
    hidden.backward(torch.cat(grads, dim=1))
    return total


def train_chunked_loss(kind: str, backend: str | None) -> dict:
    """AdamW steps of :class:`TinyLM` with torchtitan's chunked loss and its
    ``set_gradient_divide_factor(1.0)`` loop (run over ``isinstance`` of torch's
    ``FSDPModule``); ``backend``: the trunk and the head each compiled."""
    import torch.distributed as dist
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule

    from fsdp_compile.testing import full_parameters, full_tensor
    from fsdp_compile.testing._torch_internals import reset_dynamo

    reset_dynamo()
    model = _sharded_tiny_lm(kind)
    seen = [name for name, m in model.named_modules() if isinstance(m, TorchFSDPModule)]
    for m in model.modules():
        if isinstance(m, TorchFSDPModule):
            m.set_gradient_divide_factor(1.0)
            m.set_force_sum_reduction_for_comms(True)  # gloo has no PREMUL_SUM (FSDP2's reduction otherwise)
    trunk = torch.compile(model, backend=backend) if backend else model
    head = torch.compile(model.lm_head, backend=backend) if backend else model.lm_head
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    losses, head_grads = [], []
    for _ in range(STEPS):
        tokens = torch.randint(0, 16, (2, 6), generator=gen)
        losses.append(_chunked_loss(model, trunk(tokens), torch.roll(tokens, -1, 1), head).item())
        head_grads.append(None if model.lm_head.weight.grad is None else full_tensor(model.lm_head.weight.grad))
        opt.step()
        opt.zero_grad()
    return {"seen": seen, "losses": losses, "head_grads": head_grads, "params": full_parameters(model)}


def train_unshard_before_forward(kind: str, backend: str | None, async_op: bool, reshard: bool = True) -> dict:
    """1F1B's order (``torch.distributed.pipelining``): ``unshard(async_op=...)`` on every
    unit, wait, then two micro-batches' forward and backward on the held parameters, then
    ``reshard()`` (unless ``reshard=False``: held across the optimizer step); AdamW steps
    after each."""
    import torch.distributed as dist

    from fsdp_compile.testing import full_parameters
    from fsdp_compile.testing._torch_internals import reset_dynamo

    reset_dynamo()
    model = _sharded_tiny_lm(kind)
    units = [m for m in model.modules() if hasattr(m, "unshard")]
    run = torch.compile(model, backend=backend) if backend else model
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        handles = [u.unshard(async_op=async_op) for u in units]
        for handle in handles:
            if handle is not None:
                handle.wait()
        for _ in range(2):
            run(torch.randint(0, 16, (2, 6), generator=gen)).square().mean().backward()
        if reshard:
            for u in units:
                u.reshard()
        opt.step()
        opt.zero_grad()
    return full_parameters(model)


def train_kept_across_steps(kind: str, reshard_after_backward: bool) -> dict:
    """AdamW steps of :class:`TinyLM` with ``set_reshard_after_backward`` as given for
    every micro-batch, the last one before each step included."""
    import torch.distributed as dist

    from fsdp_compile.testing import full_parameters

    model = _sharded_tiny_lm(kind)
    model.set_reshard_after_backward(reshard_after_backward)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(dist.get_rank())
    for _ in range(STEPS):
        for _ in range(2):
            model.lm_head(model(torch.randint(0, 16, (2, 6), generator=gen))).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return full_parameters(model)


def _assert_params_close(a: dict, b: dict, **tol) -> None:
    assert a.keys() == b.keys()
    for name in a:
        torch.testing.assert_close(a[name], b[name], msg=lambda m, name=name: f"{name}: {m}", **tol)


def test_torchtitans_chunked_loss_trains_as_with_fsdp2(pool2):
    """The head trains (its gradient is FSDP2's, not ``None``), every unit takes the
    divide factor, and the parameters after 3 steps are FSDP2's; compiled (aot_eager)
    bitwise ours eager."""
    fsdp2 = pool2.run(train_chunked_loss, "fsdp2", None)
    eager = pool2.run(train_chunked_loss, "ours", None)
    compiled = pool2.run(train_chunked_loss, "ours", "aot_eager")
    for rank in range(2):
        assert eager[rank]["seen"] == fsdp2[rank]["seen"] == ["", "layers.0", "layers.1", "lm_head"]
        for ours_grad, ref_grad in zip(eager[rank]["head_grads"], fsdp2[rank]["head_grads"], strict=True):
            assert ours_grad is not None and ref_grad is not None
            torch.testing.assert_close(ours_grad, ref_grad, rtol=1e-6, atol=1e-7)
        assert eager[rank]["losses"] == pytest.approx(fsdp2[rank]["losses"], rel=1e-6)
        _assert_params_close(eager[rank]["params"], fsdp2[rank]["params"], rtol=1e-6, atol=1e-7)
        _assert_params_close(compiled[rank]["params"], eager[rank]["params"], rtol=0, atol=0)
        assert compiled[rank]["losses"] == eager[rank]["losses"]


@pytest.mark.parametrize("async_op", [False, True])
def test_forward_on_unsharded_parameters_reduces_their_gradients_as_fsdp2(pool2, async_op):
    fsdp2 = pool2.run(train_unshard_before_forward, "fsdp2", None, async_op)
    eager = pool2.run(train_unshard_before_forward, "ours", None, async_op)
    for rank in range(2):
        _assert_params_close(eager[rank], fsdp2[rank], rtol=1e-6, atol=1e-7)
    if async_op:  # compiled once is enough: the two differ only in the handle
        compiled = pool2.run(train_unshard_before_forward, "ours", "aot_eager", async_op)
        for rank in range(2):
            _assert_params_close(compiled[rank], eager[rank], rtol=0, atol=0)


def test_full_tensors_kept_across_an_optimizer_step_are_gathered_again(pool2):
    """Parameters ``unshard()`` holds (or ``set_reshard_after_backward(False)`` keeps) across
    an optimizer step: the next read gathers the stepped values. Ours computed silently
    with the old ones (torch's ``test_unshard_async``, ported, trained wrong from step 2):
    FSDP2 reshards held parameters in backward; where it keeps them
    (``set_reshard_after_backward(False)`` left on for the last micro-batch) it computes
    with the old values, ours with the new (an intended difference)."""
    fsdp2 = pool2.run(train_unshard_before_forward, "fsdp2", None, True, False)
    eager = pool2.run(train_unshard_before_forward, "ours", None, True, False)
    compiled = pool2.run(train_unshard_before_forward, "ours", "aot_eager", True, False)
    resharded = pool2.run(train_unshard_before_forward, "ours", None, True, True)
    kept = pool2.run(train_kept_across_steps, "ours", False)
    regathered = pool2.run(train_kept_across_steps, "ours", True)
    for rank in range(2):
        _assert_params_close(eager[rank], fsdp2[rank], rtol=1e-6, atol=1e-7)
        _assert_params_close(eager[rank], resharded[rank], rtol=0, atol=0)
        _assert_params_close(compiled[rank], eager[rank], rtol=0, atol=0)
        _assert_params_close(kept[rank], regathered[rank], rtol=0, atol=0)


def test_a_sharded_parameter_still_pickles_and_deep_copies(pool2):
    """The optimizer hook's reference from each sharded parameter to its ``FSDPParam`` is
    weak, copied as it is and pickled as a dead one."""
    for r in pool2.run(_pickle_and_copy_a_sharded_parameter):
        assert r == (True, True, True), r


def _pickle_and_copy_a_sharded_parameter() -> tuple:
    import copy
    import pickle

    model = _sharded_tiny_lm("ours")
    p = model.lm_head.weight
    copied = copy.deepcopy(p)
    loaded = pickle.loads(pickle.dumps(p))
    return torch.equal(copied.to_local(), p.to_local()), torch.equal(loaded.to_local(), p.to_local()), copied is not p


def test_our_units_are_torchs_fsdp_modules_and_refuse_its_internals(fake_pg):
    """torch's public ``share_comm_ctx`` (which reads FSDP2's state) runs on our units; the
    parts of FSDP2's state that are not answered (``test_fsdp2_api.py``: ``_is_root``,
    ``_fsdp_param_group``, ...) are refused, naming the module."""
    from torch.distributed.fsdp import FSDPModule as TorchFSDPModule
    from torch.distributed.fsdp import share_comm_ctx

    from fsdp_compile import FSDPModule, fully_shard

    assert issubclass(FSDPModule, TorchFSDPModule)
    with pytest.raises(RuntimeError, match="not sharded"):
        FSDPModule._get_fsdp_state(nn.Linear(2, 2))
    blocks = [fully_shard(nn.Linear(2, 2)) for _ in range(3)]
    # Each unit its own context until share_comm_ctx (torch 2.15's pipeline schedules
    # refuse stages that share one, comparing them by identity), then those it was given.
    contexts = lambda: [id(b._get_fsdp_state()._comm_ctx) for b in blocks]  # noqa: E731
    assert len(set(contexts())) == 3
    share_comm_ctx(blocks[:2])
    assert contexts()[0] == contexts()[1] != contexts()[2]
    with pytest.raises(AttributeError, match=r"FSDPLinear is sharded by fsdp_compile.fully_shard, .* '_training_state'"):
        getattr(blocks[0]._get_fsdp_state(), "_training_state")  # noqa: B009


def outputs_after_loading_weights(kind: str) -> dict:
    """For each way a step can leave parameters (gathered by a forward that keeps them,
    ``reshard_after_forward=False``, with and without gradients; held by ``unshard()``;
    resharded), new weights loaded in place or by ``assign=True``, then a forward: its
    outputs, three loads in a row."""
    import itertools

    fully_shard = fully_shard_of(kind)
    x = torch.ones(2, 8)
    results = {}
    for reshard, grad, before_load, assign in itertools.product(
        (False, True), (False, True), ("nothing", "reshard", "unshard"), (False, True)
    ):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 4), nn.Linear(4, 4))
        fully_shard(model[0], reshard_after_forward=reshard)
        fully_shard(model, reshard_after_forward=reshard)
        outputs = []
        for version in (1, 2, 3):
            with torch.set_grad_enabled(grad):
                out = model(x)
            if grad:
                out.sum().backward()
            if before_load != "nothing":
                getattr(model, before_load)()
            state = {name: torch.full_like(t, float(version)) for name, t in model.state_dict().items()}
            model.load_state_dict(state, assign=assign)
            with torch.no_grad():
                outputs.append(model(x))
        results[(reshard, grad, before_load, assign)] = torch.stack(outputs)
    return results


def test_weights_loaded_after_a_step_are_what_the_next_forward_reads(pool2):
    """``load_state_dict`` (in place or ``assign=True``) after a forward that kept its
    parameters gathered, after ``unshard()`` or after ``reshard()``: the next forward
    computes with the loaded weights, FSDP2's outputs exactly (a gathered copy read
    instead would be a silent wrong result)."""
    fsdp2 = pool2.run(outputs_after_loading_weights, "fsdp2")
    ours = pool2.run(outputs_after_loading_weights, "ours")
    for rank in range(2):
        assert ours[rank].keys() == fsdp2[rank].keys()
        for case, expected in fsdp2[rank].items():
            torch.testing.assert_close(ours[rank][case], expected, rtol=0, atol=0, msg=lambda m, c=case: f"{c}: {m}")
        # the loaded weights, not the first ones: 8 inputs of 1 times v, plus v, through two layers
        torch.testing.assert_close(fsdp2[rank][(True, True, "nothing", False)][:, 0, 0], torch.tensor([37.0, 146.0, 327.0]))


def train_after_moving(kind: str, moved: bool | str) -> dict:
    """Two linear units that keep their parameters after forward, ``unshard(async_op=True)``
    before each forward (upstream's ``test_unshard_async``), Adam (foreach) for 4 steps;
    after sharding, with ``moved``: ``True``, ``.to("cpu")`` over a plain container of the
    model (torch 2.15 swaps each ``DTensor`` parameter's contents with a new one's,
    ``__dict__`` too); ``"loaded"``/``"swap-loaded"``, ``load_state_dict`` of a copy of its
    state dict, copying or (``torch.__future__.set_swap_module_params_on_conversion``)
    swapping. The losses and parameters."""
    import torch.distributed as dist

    from fsdp_compile.testing import full_parameters

    fully_shard = fully_shard_of(kind)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 8))
    fully_shard(model[0], reshard_after_forward=False)
    fully_shard(model[2], reshard_after_forward=False)
    fully_shard(model)
    if moved in ("loaded", "swap-loaded"):  # torch's load_state_dict: copy_, or swap_tensors when asked to
        swapping = torch.__future__.get_swap_module_params_on_conversion()
        torch.__future__.set_swap_module_params_on_conversion(moved == "swap-loaded")
        try:
            model.load_state_dict({k: v.detach().clone() for k, v in model.state_dict().items()})
        finally:
            torch.__future__.set_swap_module_params_on_conversion(swapping)
    elif moved:
        nn.ModuleList([model]).to("cpu")
    opt = torch.optim.Adam(model.parameters(), lr=1e-1, foreach=True)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1 + dist.get_rank()))
    losses = []
    for _ in range(4):
        model[0].unshard(async_op=True)
        model[2].unshard(async_op=True)
        loss = model(x).pow(2).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return {"losses": losses, "params": full_parameters(model)}


@pytest.mark.parametrize("how", [True, "loaded", "swap-loaded"], ids=["moved", "loaded", "swap-loaded"])
def test_moving_or_loading_the_model_after_fully_shard_keeps_it_training(pool2, how):
    """``.to(...)`` over a model holding units after ``fully_shard`` (torch 2.15), and
    ``load_state_dict`` with swapping on (both torch versions): the swap left the sharded
    parameters without what ours keeps on them, so the full tensors ``unshard()`` held
    were never dropped before the optimizer step and every forward computed with the first
    step's parameters (the loss never moved; upstream's ``test_unshard_async``). Bitwise
    the unmoved model's, and FSDP2's."""
    moved = pool2.run(train_after_moving, "ours", how)
    unmoved = pool2.run(train_after_moving, "ours", False)
    fsdp2 = pool2.run(train_after_moving, "fsdp2", how)
    for rank in range(2):
        assert moved[rank]["losses"] == unmoved[rank]["losses"], moved[rank]["losses"]
        assert moved[rank]["losses"][-1] < moved[rank]["losses"][0]
        assert moved[rank]["losses"] == pytest.approx(fsdp2[rank]["losses"], rel=1e-6)
        _assert_params_close(moved[rank]["params"], unmoved[rank]["params"], rtol=0, atol=0)
        _assert_params_close(moved[rank]["params"], fsdp2[rank]["params"], rtol=1e-6, atol=1e-7)
