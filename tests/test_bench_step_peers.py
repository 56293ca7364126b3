"""hal bench's torch eager peers of rms_norm, gated_activation, rotary_embedding and sample, and the step preset.

Each peer must compute what hal's op computes (within the dtype's rounding), agree with the float64 reference,
be reported ``missing`` (never fatal) without torch, and appear with its speed ratio in the report.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np
import pytest

from hal_core import bench
from hal_core.ops import OPS
from hal_core.ops.gated_activation import gated_activation_inputs
from hal_core.ops.rms_norm import rms_norm_inputs
from hal_core.ops.rotary_embedding import rotary_embedding_inputs
from hal_core.ops.sample import sample_inputs

torch = pytest.importorskip("torch")

SEED = 20261204
#: (rtol, atol) of a peer against hal and the reference: bf16 eager sequences round after each op.
TOL = {"fp32": (1e-5, 1e-5), "fp16": (4e-3, 4e-3), "bf16": (3e-2, 3e-2)}


def _rng(request: pytest.FixtureRequest) -> np.random.Generator:
    seed = SEED + sum(map(ord, request.node.name))
    print(f"seed {seed}")
    return np.random.default_rng(seed)


def _peer(op: str) -> bench.Peer:
    (peer,) = bench.peers_for(bench.make_case(op), host=True)
    return peer


def _numpy(tensor: Any) -> np.ndarray:
    return tensor.to(torch.float64).numpy()


def _copy(args: dict[str, Any]) -> dict[str, Any]:
    return {k: v.copy() if isinstance(v, np.ndarray) else v for k, v in args.items()}


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
@pytest.mark.parametrize("residual", [False, True])
def test_rms_norm_peer_matches_hal_and_the_reference(cpu, request, dtype: str, residual: bool) -> None:
    """LlamaRMSNorm (after the residual add) on strided rows equals hal's rms_norm and the float64 reference."""
    args = rms_norm_inputs(_rng(request), num_tokens=5, hidden_size=96, dtype=dtype, residual=residual, row_stride=104)
    expected, expected_residual = OPS["rms_norm"].reference(args)
    out, new_residual = _peer("rms_norm").build([args], np)(0)
    hal_args = _copy(args)
    hal_out = cpu.ops.rms_norm(**hal_args)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(_numpy(out), np.asarray(hal_out, dtype=np.float64), rtol=rtol, atol=atol)
    np.testing.assert_allclose(_numpy(out), expected, rtol=rtol, atol=atol)
    if residual:
        np.testing.assert_array_equal(_numpy(new_residual), hal_args["residual"].astype(np.float64))
        np.testing.assert_array_equal(_numpy(new_residual), expected_residual)
    else:
        assert new_residual is None


def test_rms_norm_peer_is_transformers_module(request) -> None:
    """The peer's sequence gives transformers' LlamaRMSNorm bit for bit (bf16, where rounding order shows)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    args = rms_norm_inputs(_rng(request), num_tokens=4, hidden_size=64, dtype="bf16", residual=False)
    norm = llama.LlamaRMSNorm(64, eps=args["epsilon"])
    with torch.no_grad():
        norm.weight.copy_(torch.from_numpy(args["weight"].astype(np.float32)))
    norm = norm.to(torch.bfloat16)
    x = torch.from_numpy(args["x"].astype(np.float32)).to(torch.bfloat16)
    out, _ = _peer("rms_norm").build([args], np)(0)
    with torch.inference_mode():
        assert torch.equal(out, norm(x))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("activation", [None, "silu", "gelu", "gelu_tanh"])
def test_gated_activation_peer_matches_hal_and_the_reference(cpu, request, dtype: str, activation: str | None) -> None:
    """act(gate) * up on the halves of a fused projection equals hal's gated_activation and the reference."""
    args = gated_activation_inputs(_rng(request), num_tokens=3, intermediate_size=80, dtype=dtype,
                                   activation=activation)
    out = _peer("gated_activation").build([args], np)(0)
    hal_out = cpu.ops.gated_activation(**_copy(args))
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(_numpy(out), np.asarray(hal_out, dtype=np.float64), rtol=rtol, atol=atol)
    np.testing.assert_allclose(_numpy(out), OPS["gated_activation"].reference(args), rtol=rtol, atol=atol)


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize(("rotary_dim", "with_key"), [(None, True), (32, True), (None, False)])
def test_rotary_peer_matches_hal_and_the_reference(cpu, request, dtype: str, rotary_dim: int | None,
                                                   with_key: bool) -> None:
    """apply_rotary_pos_emb with cos/sin per token equals hal's in-place rotary (full and partial, key or not)."""
    args = rotary_embedding_inputs(_rng(request), num_tokens=6, num_heads=4, num_kv_heads=2, head_size=64,
                                   dtype=dtype, rotary_dim=rotary_dim, max_position=20, with_key=with_key)
    expected = OPS["rotary_embedding"].reference(args)
    query, key = _peer("rotary_embedding").build([args], np)(0)
    hal_args = _copy(args)
    cpu.ops.rotary_embedding(**hal_args)
    rtol, atol = TOL[dtype]
    np.testing.assert_allclose(_numpy(query), hal_args["query"].astype(np.float64), rtol=rtol, atol=atol)
    np.testing.assert_allclose(_numpy(query), expected[0], rtol=rtol, atol=atol)
    if with_key:
        np.testing.assert_allclose(_numpy(key), hal_args["key"].astype(np.float64), rtol=rtol, atol=atol)
        np.testing.assert_allclose(_numpy(key), expected[1], rtol=rtol, atol=atol)
    else:
        assert key is None


def test_rotary_peer_is_transformers_rotary(request) -> None:
    """cos/sin are transformers' rotary module's (to fp32 rounding of its float32 angles) and the rotation is its
    apply_rotary_pos_emb bit for bit (bf16)."""
    llama = pytest.importorskip("transformers.models.llama.modeling_llama")
    config = llama.LlamaConfig(hidden_size=256, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                               max_position_embeddings=64, rope_theta=10000.0)
    args = rotary_embedding_inputs(_rng(request), num_tokens=5, num_heads=4, num_kv_heads=2, head_size=64,
                                   dtype="bf16", max_position=64, poison=False)
    positions = torch.from_numpy(args["positions"].astype(np.int64))[None]
    probe = torch.zeros(1, dtype=torch.float32)
    cos_t, sin_t = llama.LlamaRotaryEmbedding(config)(probe, positions)  # [1, tokens, 64] float32
    from hal_core.bench._step_peers import rotary_cos_sin

    cos, sin = rotary_cos_sin(torch, args["cos_sin_cache"], args["positions"], torch.float32)
    torch.testing.assert_close(cos[:, 0], cos_t[0], rtol=0, atol=2e-5)
    torch.testing.assert_close(sin[:, 0], sin_t[0], rtol=0, atol=2e-5)
    query, key = _peer("rotary_embedding").build([args], np)(0)
    q, k = torch.from_numpy(args["query"].astype(np.float32)), torch.from_numpy(args["key"].astype(np.float32))
    cos_b, sin_b = rotary_cos_sin(torch, args["cos_sin_cache"], args["positions"], torch.bfloat16)
    q_t, k_t = llama.apply_rotary_pos_emb(q.to(torch.bfloat16), k.to(torch.bfloat16), cos_b[:, 0], sin_b[:, 0])
    assert torch.equal(query, q_t) and torch.equal(key, k_t)


def test_rotary_peer_refuses_gptj_pairs(request) -> None:
    """apply_rotary_pos_emb rotates halves: a gptj call is a PeerUnavailable (reported 'missing')."""
    args = rotary_embedding_inputs(_rng(request), num_tokens=2, num_heads=2, num_kv_heads=1, head_size=16,
                                   dtype="fp32")
    with pytest.raises(bench.PeerUnavailable, match="gptj"):
        _peer("rotary_embedding").build([{**args, "style": "gptj"}], np)


def _uniform(args: dict[str, Any], **settings: float) -> dict[str, Any]:
    rows = args["logits"].shape[0]
    out = {"logits": args["logits"], "seeds": args["seeds"]}
    for name, value in settings.items():
        out[name] = np.full(rows, value, np.int32 if name == "top_k" else np.float32)
    return out


def _kept(args: dict[str, Any]) -> np.ndarray:
    """Per row, the tokens the rules of hal's sample docstring may draw (float64, written out here)."""
    x = np.asarray(args["logits"]).astype(np.float64)
    t = float(args["temperature"][0])
    w = np.exp((x - x.max(axis=1, keepdims=True)) / t)
    kept = np.ones_like(w, dtype=bool)
    k = int(args["top_k"][0]) if "top_k" in args else 0
    if 0 < k < x.shape[1]:
        kept &= x >= np.sort(x, axis=1)[:, -k][:, None]
    if "top_p" in args and args["top_p"][0] < 1:
        for row in range(x.shape[0]):
            mass = np.where(kept[row], w[row], 0.0)
            above = np.array([mass[mass > v].sum() for v in mass])
            kept[row] &= above < float(args["top_p"][0]) * mass.sum()
    if "min_p" in args:
        kept &= w >= float(args["min_p"][0])
    return kept


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_greedy_sample_peer_equals_hal(cpu, request, dtype: str) -> None:
    """Temperature 0: the peer's argmax is hal's token on every row."""
    args = sample_inputs(_rng(request), num_seqs=9, vocab_size=3000, dtype=dtype, greedy=True)
    tokens = _peer("sample").build([args], np)(0)
    hal_tokens = cpu.ops.sample(**args)
    np.testing.assert_array_equal(tokens.numpy(), hal_tokens)
    np.testing.assert_array_equal(tokens.numpy(), OPS["sample"].reference(args))


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("settings", [
    {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05},
    {"temperature": 1.3, "top_p": 0.6},
    {"temperature": 0.5, "top_k": 7},
    {"temperature": 1.0, "min_p": 0.2},
], ids=["all", "top_p", "top_k", "min_p"])
def test_sampled_token_is_in_the_kept_set(cpu, request, dtype: str, settings: dict[str, float]) -> None:
    """The warpers + multinomial draw only tokens hal's rules keep (as hal does), on repeated draws."""
    args = _uniform(sample_inputs(_rng(request), num_seqs=6, vocab_size=2000, dtype=dtype, scale=2.0), **settings)
    kept = _kept(args)
    assert kept.sum(axis=1).min() >= 1 and (kept.sum(axis=1) < kept.shape[1]).all()
    runner = _peer("sample").build([args], np)
    rows = np.arange(kept.shape[0])
    for _ in range(20):
        tokens = runner(0).numpy()
        assert kept[rows, tokens].all(), tokens
    assert kept[rows, cpu.ops.sample(**args)].all()


def test_sample_peer_draws_transformers_token_for_the_same_torch_seed(request) -> None:
    """With torch's generator seeded alike, the peer draws the token transformers' warpers + multinomial draw."""
    process = pytest.importorskip("transformers.generation.logits_process")
    settings = {"temperature": 0.8, "top_k": 50, "top_p": 0.9, "min_p": 0.05}
    args = _uniform(sample_inputs(_rng(request), num_seqs=4, vocab_size=1000, dtype="bf16"), **settings)
    warpers = process.LogitsProcessorList([process.TemperatureLogitsWarper(0.8), process.TopKLogitsWarper(50),
                                           process.TopPLogitsWarper(0.9), process.MinPLogitsWarper(0.05)])
    logits = torch.from_numpy(args["logits"].astype(np.float32))  # bf16 values, exactly
    runner = _peer("sample").build([args], np)
    for seed in range(5):
        torch.manual_seed(seed)
        scores = warpers(None, logits.clone())
        expected = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
        torch.manual_seed(seed)
        assert torch.equal(runner(0), expected)


def test_sample_peer_refuses_rows_with_different_settings(request) -> None:
    """transformers' warpers take one setting per batch: differing rows are a PeerUnavailable naming it."""
    args = _uniform(sample_inputs(_rng(request), num_seqs=3, vocab_size=100, dtype="fp32"), temperature=0.7)
    args["temperature"][1] = 0.9
    with pytest.raises(bench.PeerUnavailable, match="temperature"):
        _peer("sample").build([args], np)


STEP_PEER_CASES = [
    "rms_norm:tokens=3,hidden=64,dtype=bf16",
    "gated_activation:tokens=2,inter=96,dtype=fp32",
    "rotary_embedding:tokens=4,heads=4,kv_heads=2,head=32,max_pos=16,dtype=bf16",
    "sample:seqs=2,vocab=512,greedy=0,dtype=fp32",
]
QUICK = bench.BenchSettings(policy=bench.TimingPolicy(repeat=3, warmup=1, max_seconds=0.05), quick=True,
                            copy_bytes=1 << 20, blas_n=64)


def _step_cases() -> list[bench.Case]:
    return [bench.parse_shape(*text.split(":", 1)) for text in STEP_PEER_CASES]


def _documented_bytes(case: bench.Case) -> int:
    """The byte formulas of docs/benchmarks.md for the step ops, written out independently of the op specs."""
    p = case.params
    item = {"fp32": 4, "fp16": 2, "bf16": 2}[str(p["dtype"])]
    if case.op == "rms_norm":
        return ((4 if p["residual"] else 2) * p["tokens"] * p["hidden"] + p["hidden"]) * item
    if case.op == "gated_activation":
        return 3 * p["tokens"] * p["inter"] * item
    if case.op == "rotary_embedding":
        rot = p["rotary"] or p["head"]
        return 2 * p["tokens"] * (p["heads"] + p["kv_heads"]) * rot * item + p["tokens"] * (4 * rot + 8)
    return p["seqs"] * (p["vocab"] * item + 32)


def test_report_holds_each_peer_with_the_ops_bytes_and_its_ratio(cpu) -> None:
    """Each case's bytes are its op's nbytes; its one torch peer is 'ok' with gbps on those bytes and hal_speedup."""
    report = bench.run_bench(_step_cases(), cpu, QUICK)
    copy = report["limits"]["copy"]["gbps"]
    for case, entry in zip(_step_cases(), report["cases"], strict=True):
        bench_cases = OPS[case.op].bench
        assert bench_cases is not None
        args = bench_cases.inputs(np.random.default_rng(0), case.params)
        assert entry["bytes"] == OPS[case.op].nbytes(args) == _documented_bytes(case)
        (peer,) = entry["peers"]
        assert peer["status"] == "ok" and peer["name"].startswith("torch eager"), peer
        seconds = peer["median_ms"] / 1e3
        assert peer["gbps"] == pytest.approx(entry["bytes"] / seconds / 1e9, rel=1e-9)
        assert peer["ratio_copy"] == pytest.approx(peer["gbps"] / copy, rel=1e-9)
        assert peer["hal_speedup"] == pytest.approx(peer["median_ms"] / entry["hal"]["median_ms"], rel=1e-9)
    assert "vs torch eager apply_rotary_pos_emb" in bench.format_table(report)


def test_step_peers_without_torch_are_missing_not_fatal(cpu, monkeypatch) -> None:
    """With torch unimportable, every step peer is 'missing' with the reason and hal's figures are still there."""
    monkeypatch.setitem(sys.modules, "torch", None)
    report = bench.run_bench(_step_cases(), cpu, QUICK)
    for entry in report["cases"]:
        assert "median_ms" in entry["hal"]
        (peer,) = entry["peers"]
        assert peer["status"] == "missing" and "torch is not installed" in peer["reason"]


def test_step_preset_lists_the_decode_and_prompt_cases_of_both_model_sizes() -> None:
    """step: the four ops at 1, 8 and 512 tokens (sample: 1 and 8 sequences), 1B and 7B shapes, fp32 and bf16."""
    make = bench.make_case
    dtypes = ("fp32", "bf16")
    expected = {make("rms_norm", tokens=t, hidden=h, residual=1, dtype=dt)
                for t in (1, 8, 512) for h in (2048, 4096) for dt in dtypes}
    expected |= {make("gated_activation", tokens=t, inter=i, dtype=dt)
                 for t in (1, 8, 512) for i in (5632, 11008) for dt in dtypes}
    expected |= {make("rotary_embedding", tokens=t, heads=h, kv_heads=kv, head=128, dtype=dt)
                 for t in (1, 8, 512) for h, kv in ((16, 4), (32, 32)) for dt in dtypes}
    expected |= {make("sample", seqs=s, vocab=v, greedy=g, dtype=dt)
                 for s in (1, 8) for v in (32000, 128256) for g in (0, 1) for dt in dtypes}
    cases = bench.preset_cases("step")
    assert len(cases) == len(expected) == 52 and set(cases) == expected
    assert "step" in bench.preset_names()
    assert all(len(bench.peers_for(case, host=True)) == 1 for case in cases)
    assert not any(bench.peers_for(case, host=False) for case in cases)


def test_step_peers_use_the_hosts_cores_for_torch() -> None:
    """Building a step peer sets torch's intra-op threads to the cores this process may run on."""
    from hal_core.bench._step_peers import host_threads

    before = torch.get_num_threads()
    try:
        torch.set_num_threads(max(1, host_threads() - 1) if host_threads() > 1 else 1)
        args = gated_activation_inputs(np.random.default_rng(SEED), num_tokens=1, intermediate_size=8, dtype="fp32")
        _peer("gated_activation").build([args], np)
        assert torch.get_num_threads() == host_threads()
    finally:
        torch.set_num_threads(before)

