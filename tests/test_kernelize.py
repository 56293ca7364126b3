"""hal_core.torch.kernelize: a loaded transformers model's norms, MLP activations and rotary run on hal ops."""

from __future__ import annotations

import numpy as np
import pytest
import transformers
from torch_helpers import torch
from transformers_helpers import llama, prompts

import hal_core
from hal_core.torch import kernelize
from hal_core.torch._kernelize import _rotary

STEP_OPS = ("rms_norm", "gated_activation", "rotary_embedding")


def _calls() -> dict[str, int]:
    found = hal_core.stats().get("cpu", {})
    return {op: found.get(op, {}).get("calls", 0) for op in STEP_OPS}


def _greedy(model: torch.nn.Module, ids: torch.Tensor, mask: torch.Tensor):
    with torch.no_grad():
        return model.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                              output_logits=True, return_dict_in_generate=True)


def test_kernelized_model_generates_eager_tokens(cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernelized Llama's logits match the untouched model's step by step (its greedy tokens up to a near-tie
    that rounding may flip), and every step op ran on hal."""
    from transformers.models.llama import modeling_llama

    current = modeling_llama.apply_rotary_pos_emb  # transformers' own for the expected run, whatever ran before
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", getattr(current, "__hal_original__", current))
    seed = int(np.random.SeedSequence().entropy % 2**16)
    print(f"seed={seed}")
    model = llama(seed)
    ids, mask = prompts(seed)
    expected = _greedy(model, ids, mask)
    report = kernelize(model)
    assert len(report.norms) == 2 * 2 + 1 and len(report.mlps) == 2
    assert report.rotary == ["transformers.models.llama.modeling_llama"]
    before = _calls()
    got = _greedy(model, ids, mask)
    after = _calls()
    assert all(after[op] > before[op] for op in STEP_OPS), (before, after)
    tol = 2e-4
    for row in range(ids.shape[0]):  # steps up to the first difference: logits close; there a near-tie
        for step, (a, b) in enumerate(zip(got.logits, expected.logits, strict=True)):
            scale = float(b[row].float().abs().max())
            assert float((a[row].float() - b[row].float()).abs().max()) <= tol * scale, (row, step)
            mine, theirs = int(a[row].argmax()), int(b[row].argmax())
            if mine != theirs:
                assert float(b[row, theirs] - b[row, mine]) <= tol * scale, (row, step)
                break


def test_kernelized_bf16_model_is_as_close_to_fp32_as_eager(cpu, monkeypatch: pytest.MonkeyPatch) -> None:
    """In bf16 a kernelized Llama's prompt logits are as close to the fp32 model's as eager bf16's are (hal rounds
    once where the eager sequence rounds at every op; the two bf16 results differ by bf16 noise either way)."""
    from transformers.models.llama import modeling_llama

    current = modeling_llama.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", getattr(current, "__hal_original__", current))
    seed = int(np.random.SeedSequence().entropy % 2**16)
    print(f"seed={seed}")
    ids, mask = prompts(seed)
    model = llama(seed)
    with torch.no_grad():
        want = model(ids, attention_mask=mask).logits.double()
        model.to(torch.bfloat16)
        eager = model(ids, attention_mask=mask).logits.double()
        kernelize(model)
        before = _calls()
        got = model(ids, attention_mask=mask).logits.double()
    after = _calls()
    assert all(n > before[op] for op, n in after.items()), (before, after)
    valid = mask.bool()  # left padding: rows of padded positions are not compared
    # bf16 noise, amplified through the layers: its RMS over the logits is the stable measure (hal's is at most
    # 1.1x eager's over 24 seeds); the largest single difference is heavy-tailed (2x eager's at seed 14130, whose
    # RMS is 1.09x), so it only bounds gross outliers. A wrong kernel errs by the logits' own size (~1-5).
    eager_error, error = (float((x - want)[valid].pow(2).mean().sqrt()) for x in (eager, got))
    assert error <= 1.25 * eager_error + 1e-4 * float(want.abs().max()), (error, eager_error)
    eager_max, worst = (float((x - want).abs()[valid].max()) for x in (eager, got))
    assert worst <= 2.5 * eager_max + 1e-3 * float(want.abs().max()), (worst, eager_max)


def test_kernelize_is_idempotent_and_names_what_it_skips(cpu) -> None:
    """A second call replaces nothing again; an RMSNorm class hal does not know is listed as skipped."""
    model = llama(3)

    class OtherRMSNorm(torch.nn.Module):
        def forward(self, x: torch.Tensor) -> torch.Tensor:
            return x

    model.model.extra = OtherRMSNorm()
    first = kernelize(model)
    second = kernelize(model)
    assert first.norms and not second.norms and not second.mlps
    assert "OtherRMSNorm" in first.skipped["model.extra"]


def test_kernelized_layers_keep_autograd(cpu) -> None:
    """With gradients recorded the layers run their original code, so backward works and matches."""
    model = llama(4)
    x = torch.randn(1, 5, 64, requires_grad=True)
    norm = model.model.layers[0].input_layernorm
    reference = torch.autograd.grad(norm(x).sum(), x)[0]
    kernelize(model)
    got = torch.autograd.grad(norm(x).sum(), x)[0]
    torch.testing.assert_close(got, reference)


def test_rotary_matches_transformers_on_strided_layouts(cpu) -> None:
    """The hal rotary equals transformers' apply_rotary_pos_emb for the projection layout and a permuted copy."""
    from transformers.models.llama import modeling_llama

    original = getattr(modeling_llama.apply_rotary_pos_emb, "__hal_original__", modeling_llama.apply_rotary_pos_emb)
    rng = torch.Generator().manual_seed(7)
    b, s, h, kv, d = 2, 5, 4, 2, 32
    config = transformers.LlamaConfig(hidden_size=h * d, num_attention_heads=h, head_dim=d)
    rope = modeling_llama.LlamaRotaryEmbedding(config)
    q = torch.randn(b, s, h, d, generator=rng).transpose(1, 2)
    k = torch.randn(b, kv, s, d, generator=rng)  # contiguous in [B, heads, S, D]: the copy path
    cos, sin = rope(q, torch.arange(s).expand(b, s))
    want_q, want_k = original(q.clone(), k.clone(), cos, sin)
    q_in, k_in = q.clone(), k.clone()
    got_q, got_k = _rotary(original)(q_in, k_in, cos, sin)
    assert torch.equal(q_in, q) and torch.equal(k_in, k)  # the inputs are left as they were
    torch.testing.assert_close(got_q, want_q, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_k, want_k, rtol=1e-5, atol=1e-5)


def test_rotary_table_follows_each_forward(cpu) -> None:
    """A new forward's cos/sin (even at a freed tensor's address) get their own table, never a stale one."""
    from transformers.models.llama import modeling_llama

    original = getattr(modeling_llama.apply_rotary_pos_emb, "__hal_original__", modeling_llama.apply_rotary_pos_emb)
    rotary = _rotary(original)
    config = transformers.LlamaConfig(hidden_size=128, num_attention_heads=4, head_dim=32)
    rope = modeling_llama.LlamaRotaryEmbedding(config)
    q, k = torch.randn(1, 4, 3, 32), torch.randn(1, 2, 3, 32)
    for start in (0, 7, 100, 7):  # each forward's cos/sin are new tensors, freed after the "forward"
        cos, sin = rope(q, torch.arange(start, start + 3)[None])
        got = rotary(q, k, cos, sin)
        want = original(q, k, cos, sin)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
        del cos, sin


def test_a_norms_replaced_weight_reaches_the_next_call(cpu) -> None:
    """A kernelized norm binds its weight's numpy view once; a weight given new storage (``param.data = ...``, as
    ``.to()`` does, the Parameter kept), replaced outright, or changed in place reaches the next call (float64
    reference)."""
    seed = int(np.random.SeedSequence().entropy % 2**16)
    print(f"seed={seed}")
    model = llama(seed)
    kernelize(model)
    norm = model.model.norm
    x = torch.from_numpy(np.random.default_rng(seed).standard_normal((3, norm.weight.shape[0])).astype(np.float32))

    def expected() -> np.ndarray:
        xd = x.double().numpy()
        rms = np.sqrt((xd * xd).mean(-1, keepdims=True) + norm.variance_epsilon)
        return xd / rms * norm.weight.detach().double().numpy()

    with torch.no_grad():
        for change in ("none", "data", "parameter", "in place"):
            if change == "data":
                norm.weight.data = norm.weight.data * 2
            elif change == "parameter":
                norm.weight = torch.nn.Parameter(norm.weight.detach() * 3)
            elif change == "in place":
                norm.weight.mul_(-1)
            got = norm(x)
            np.testing.assert_allclose(got.double().numpy(), expected(), rtol=1e-5, atol=1e-5, err_msg=change)
