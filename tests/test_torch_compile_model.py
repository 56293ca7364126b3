"""A quantized transformers model on hal (int4 QuantLinear, ``attn_implementation="hal"``, HalPagedCache) under
torch.compile: the compiled forward's graph breaks are the one planning break per forward, whatever the number of
layers; its greedy tokens are eager's; decoding further compiles nothing."""

from __future__ import annotations

import pytest
from torch_helpers import torch

transformers = pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

from transformers_helpers import VOCAB, hal_calls, prompts  # noqa: E402

import hal_core  # noqa: E402
import hal_core.torch.transformers as hal_hf  # noqa: E402
from hal_core.torch import kernelize, quantize_model  # noqa: E402

#: Graph breaks ``torch._dynamo.explain`` counts in a compiled forward (docs/engine-guide.md, "Compiling a
#: model"): the mask stage, one eager call per kind of mask, seen from each frame it is nested in (the model's
#: forward, its decoder's, transformers' mask builder): 3 for Llama (causal masks only), one more for Gemma 2 (its
#: sliding layers' mask too).
BREAKS = {"llama": 3, "gemma2": 4, "llama-kernelized": 3}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}
#: q, k, v, o, gate, up, down per layer, and lm_head.
PROJECTIONS = 7


@pytest.fixture(autouse=True)
def _transformers_rotary(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers' own rotary in every test (kernelize replaces it process-wide; a compiled forward runs torch's
    code there, so an eager run must too), and kernelize's replacement undone afterwards."""
    from transformers.models.llama import modeling_llama

    current = modeling_llama.apply_rotary_pos_emb
    monkeypatch.setattr(modeling_llama, "apply_rotary_pos_emb", getattr(current, "__hal_original__", current))


def _model(seed: int, layers: int, dtype: torch.dtype, family: str = "llama") -> torch.nn.Module:
    """A random Llama (or Gemma 2: a window of 4 on alternate layers, logit softcap 2) of ``layers`` layers, every
    linear layer int4 (group 32), hal attention, in ``dtype``; ``llama-kernelized``: norms, the MLP activation and
    rotary on hal ops too (:func:`hal_core.torch.kernelize`)."""
    torch.manual_seed(seed)
    common = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256, initializer_range=0.2,
                  attn_implementation=hal_hf.ATTN_IMPLEMENTATION)
    if family.startswith("llama"):
        config = transformers.LlamaConfig(**common)
    else:
        config = transformers.Gemma2Config(head_dim=16, query_pre_attn_scalar=16, sliding_window=4,
                                           attn_logit_softcapping=2.0, final_logit_softcapping=None, **common)
    model = transformers.AutoModelForCausalLM.from_config(config).eval()
    quantize_model(model, bits=4, group_size=32, layer_bits=None)
    if family.endswith("kernelized"):
        kernelize(model)
    return model.to(dtype)


def _cache(model: torch.nn.Module) -> hal_hf.HalPagedCache:
    return hal_hf.HalPagedCache(model.config, num_blocks=48, block_size=4, dtype=model.dtype)


def _explain(model: torch.nn.Module) -> object:
    """``torch._dynamo.explain`` of one forward: a left-padded prefill of three prompts into a new cache."""
    ids, mask = prompts(5)
    torch._dynamo.reset()
    with torch.no_grad():
        return torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask, past_key_values=_cache(model),
                                            use_cache=True)


def _hal_nodes(explained: object) -> dict[str, int]:
    """How many calls of each hal operator the traced graphs hold."""
    found: dict[str, int] = {}
    for graph in explained.graphs:
        for node in graph.graph.nodes:
            if node.op == "call_function" and str(node.target).startswith("hal."):
                name = str(node.target).split(".")[1]
                found[name] = found.get(name, 0) + 1
    return found


@pytest.mark.parametrize(("family", "dtype"), [("llama", "fp32"), ("llama", "bf16"), ("gemma2", "fp32"),
                                               ("llama-kernelized", "bf16")])
def test_graph_breaks_are_the_mask_stage_whatever_the_layer_count(family: str, dtype: str) -> None:
    """2 and 4 layers: the same breaks, all at hal's mask stage (where the step is planned), and every layer's ops
    in the graphs."""
    counts = {}
    for layers in (2, 4):
        explained = _explain(_model(3, layers, DTYPES[dtype], family))
        counts[layers] = (explained.graph_break_count, explained.graph_count)
        for reason in explained.break_reasons:
            assert reason.user_stack[-1].name == "hal_attention_mask", reason
            assert "_mask_stage" in reason.reason, reason.reason
        expected = {"paged_attention": layers, "write_kv_cache": layers, "quantized_gemm": PROJECTIONS * layers + 1}
        if family.endswith("kernelized"):  # two norms a layer and the final one, an activation a layer (kernelize's
            expected |= {"rms_norm": 2 * layers + 1, "gated_activation": layers}  # rotary is torch's in a trace)
        assert _hal_nodes(explained) == expected
    assert counts[2] == counts[4], counts
    assert counts[2][0] <= BREAKS[family], counts


@pytest.mark.parametrize("family", list(BREAKS))
def test_compiled_model_generates_the_eager_tokens(family: str) -> None:
    """fp32 greedy generate of left-padded prompts: compiled (aot_eager) tokens = eager tokens, through hal's paged
    attention; a second generate compiles nothing more (decode steps do not recompile). Gemma 2 plans once from two
    kinds of mask, its window cutting keys off; the kernelized Llama runs its norms, activation and rotary on hal."""
    seed = 11
    print(f"seed={seed}")
    model = _model(seed, 2, torch.float32, family)
    ids, mask = prompts(seed)

    def generate() -> torch.Tensor:
        with torch.no_grad():
            return model.generate(ids, attention_mask=mask, past_key_values=_cache(model), max_new_tokens=8,
                                  min_new_tokens=8, do_sample=False, pad_token_id=0)

    eager = generate()
    frames = []

    def backend(graph: torch.fx.GraphModule, inputs: list) -> object:
        frames.append(graph)
        return torch._dynamo.lookup_backend("aot_eager")(graph, inputs)

    torch._dynamo.reset()
    model.forward = torch.compile(model.forward, backend=backend)
    before = hal_calls()
    compiled = generate()
    assert hal_calls() - before == 2 * 8, "each of the 8 forwards calls hal's paged attention once per layer"
    assert torch.equal(compiled, eager), (compiled, eager)
    compiled_frames = len(frames)
    assert any("paged_attention" in str(g.graph) for g in frames)
    again = generate()
    assert torch.equal(again, eager)
    assert len(frames) == compiled_frames, "a second generate recompiled"


def test_compiled_forward_refuses_a_wrong_cache_before_planning() -> None:
    """Under compile the step is planned at the mask stage: a cache of another model, or too few blocks, is refused
    there (ArgumentError / OutOfBlocksError) with the cache left empty, and the cache then serves a forward."""
    model = _model(7, 2, torch.float32)
    model.forward = torch.compile(model.forward, backend="aot_eager")
    ids, mask = prompts(7)
    other = transformers.LlamaConfig(**{**model.config.to_dict(), "num_hidden_layers": 3})
    heads = transformers.LlamaConfig(**{**model.config.to_dict(), "num_key_value_heads": 1})
    small = hal_hf.HalPagedCache(model.config, num_blocks=3, block_size=4, dtype=torch.float32)
    cases = ((hal_hf.HalPagedCache(other, num_blocks=48, block_size=4), hal_core.ArgumentError,
              "3 layers, the model 2"),
             (hal_hf.HalPagedCache(heads, num_blocks=48, block_size=4), hal_core.ArgumentError, "1 kv heads of 16"),
             (small, hal_core.OutOfBlocksError, "blocks"))
    torch._dynamo.reset()
    with torch.no_grad():
        for cache, error, message in cases:
            with pytest.raises(error, match=message):
                model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            usage = cache.paged.usage()
            assert (usage.sequences, usage.tokens, cache.get_seq_length()) == (0, 0, 0)
        got = model(input_ids=ids[2:], attention_mask=mask[2:], past_key_values=small, use_cache=True).logits
        expected = model(input_ids=ids[2:], attention_mask=mask[2:], past_key_values=_cache(model),
                         use_cache=True).logits
    torch.testing.assert_close(got, expected, atol=0, rtol=0)


def test_the_sdpa_fallback_compiles_without_a_break() -> None:
    """"hal" attention without a HalPagedCache (a DynamicCache: torch SDPA) traces whole: the mask stage's eager
    call is made only for a HalPagedCache."""
    model = _model(5, 2, torch.float32)
    ids, mask = prompts(5)
    with torch.no_grad():
        model(input_ids=ids, attention_mask=mask)  # the fallback's one-time warning, outside the trace
        torch._dynamo.reset()
        explained = torch._dynamo.explain(model)(input_ids=ids, attention_mask=mask, use_cache=True,
                                                 past_key_values=transformers.DynamicCache(config=model.config))
    assert (explained.graph_break_count, explained.graph_count) == (0, 1), explained.break_reasons


def test_a_compiled_forward_that_breaks_off_after_planning() -> None:
    """A forward that fails between the mask stage (its step planned) and its layers: the same forward again runs on
    that plan and gives a fresh cache's logits; another one (other sizes, or the same sizes with other padding) is
    refused (ArgumentError) until cache.reset()."""
    model = _model(9, 2, torch.float32)
    ids, mask = prompts(9)
    rotary, failures = model.model.rotary_emb.forward, []

    def failing_rotary(*args: object, **kwargs: object) -> object:  # runs after the masks, before the layers
        if failures:
            raise RuntimeError("interrupted")
        return rotary(*args, **kwargs)

    model.model.rotary_emb.forward = failing_rotary
    model.forward = torch.compile(model.forward, backend="aot_eager")
    torch._dynamo.reset()
    with torch.no_grad():
        expected = model(input_ids=ids, attention_mask=mask, past_key_values=_cache(model), use_cache=True).logits
        repadded = mask.clone()
        repadded[0, 0] = 0  # the longest prompt one token shorter: the same sizes, another padding
        for retry_ids, retry_mask in ((ids, mask), (ids[:, :-1], mask[:, :-1]), (ids, repadded)):
            cache = _cache(model)
            failures[:] = [1]
            with pytest.raises(RuntimeError, match="interrupted"):
                model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True)
            failures.clear()
            if retry_mask is not mask:
                with pytest.raises(hal_core.ArgumentError, match="broke off before its layers"):
                    model(input_ids=retry_ids, attention_mask=retry_mask, past_key_values=cache, use_cache=True)
                cache.reset()
            got = model(input_ids=ids, attention_mask=mask, past_key_values=cache, use_cache=True).logits
            torch.testing.assert_close(got, expected, atol=0, rtol=0)
