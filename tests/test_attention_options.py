"""AttentionOptions: one value for paged_attention's scale and score modifiers, built once, passed whole."""

from __future__ import annotations

import dataclasses
from typing import Any

import numpy as np
import pytest

import hal_core
from hal_core import ArgumentError, ArgumentTypeError, AttentionOptions
from hal_core.ops import OPS, Arg, OpCall, PagedAttention
from hal_core.ops import paged_attention as paged_attention_module
from hal_core.ops._front_door import front_door
from hal_core.ops._groups import ArgGroup, grouped
from hal_core.ops.paged_attention_options import ATTENTION_OPTIONS
from hal_core.testing.inputs import paged_attention_inputs

SEED = 20261205
SPEC = OPS["paged_attention"]


def _inputs(seed: int = SEED, num_heads: int = 4) -> dict[str, Any]:
    rng = np.random.default_rng(seed)
    print(f"seed={seed}")
    return paged_attention_inputs(rng, seq_lens=[40, 7, 19], num_heads=num_heads, num_kv_heads=2, head_size=64,
                                  block_size=8, dtype="fp32", query_lens=[5, 1, 19])


def _split(args: dict[str, Any]) -> tuple[tuple[Any, ...], dict[str, Any]]:
    """The positional arrays and the keywords that are not options."""
    positional = tuple(args[k] for k in ("query", "key_cache", "value_cache", "block_tables", "seq_lens"))
    keywords = {k: args[k] for k in ("query_start_loc", "max_query_len")}
    return positional, keywords


def _options(rng: np.random.Generator, num_heads: int = 4) -> AttentionOptions:
    return AttentionOptions(scale=0.125, window=9, softcap=20.0,
                            sinks=rng.standard_normal(num_heads).astype(np.float32),
                            alibi_slopes=(rng.random(num_heads) * 0.1).astype(np.float32))


@pytest.mark.parametrize(("fields", "name", "error"), [
    ({"scale": float("nan")}, "scale", ArgumentTypeError),
    ({"scale": None}, "scale", ArgumentTypeError),
    ({"scale": 0.1, "window": 0}, "window", ArgumentError),
    ({"scale": 0.1, "window": 2.5}, "window", ArgumentTypeError),
    ({"scale": 0.1, "softcap": 0.0}, "softcap", ArgumentError),
    ({"scale": 0.1, "sinks": np.zeros(4, np.float16)}, "sinks", ArgumentTypeError),
    ({"scale": 0.1, "alibi_slopes": np.zeros((2, 2), np.float32)}, "alibi_slopes", ArgumentError),
    ({"scale": 0.1, "sinks": [0.0, 1.0]}, "sinks", ArgumentTypeError),
])
def test_options_are_checked_when_built_naming_the_field(fields: dict[str, Any], name: str, error: type) -> None:
    """A bad field is refused when the value is built, the error naming that field."""
    with pytest.raises(error, match=f"AttentionOptions: argument '{name}'"):
        AttentionOptions(**fields)


def test_options_normalise_numbers_and_stay_frozen() -> None:
    """numpy numbers become Python ones; the value cannot be changed after it is built."""
    options = AttentionOptions(scale=np.float32(0.5), window=np.int64(16))
    assert type(options.scale) is float and type(options.window) is int and options.window == 16
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.window = 3  # type: ignore[misc]
    assert {options: "layer 0"}[options] == "layer 0"  # hashed by identity, arrays or not


def test_options_and_flat_keywords_give_the_reference(cpu: Any) -> None:
    """options=AttentionOptions(...) and the same options as flat keywords give one result, the float64 reference's."""
    args = _inputs()
    options = _options(np.random.default_rng(SEED + 1))
    positional, keywords = _split(args)
    grouped_out = cpu.ops.paged_attention(*positional, **keywords, options=options)
    flat_out = cpu.ops.paged_attention(*positional, **keywords, **ATTENTION_OPTIONS.flat(options))
    np.testing.assert_array_equal(grouped_out, flat_out)
    expected = SPEC.reference({**args, **ATTENTION_OPTIONS.flat(options)})
    np.testing.assert_allclose(grouped_out, expected, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("flat", [{"window": 4}, {"scale": 0.5, "softcap": 3.0}])
def test_front_door_refuses_options_and_flat_keywords_together(cpu: Any, flat: dict[str, Any]) -> None:
    """Giving a field both inside options and as a keyword is an ArgumentError naming them; out stays untouched."""
    args = _inputs()
    positional, keywords = _split(args)
    out = np.full(args["query"].shape, 7.0, np.float32)
    with pytest.raises(ArgumentError) as caught:
        cpu.ops.paged_attention(*positional, **keywords, out=out, options=AttentionOptions(scale=0.1), **flat)
    for name in (*flat, "options"):
        assert f"'{name}'" in str(caught.value)
    assert (out == 7.0).all()


def test_front_door_refuses_options_of_another_type(cpu: Any) -> None:
    """options must be an AttentionOptions (a dict is refused naming 'options')."""
    positional, keywords = _split(_inputs())
    with pytest.raises(ArgumentTypeError, match="'options'"):
        cpu.ops.paged_attention(*positional, **keywords, options={"scale": 0.1})


def test_torch_wrapper_takes_options_or_flat_not_both() -> None:
    """hal_core.torch.paged_attention spreads options into the flat schema, refusing flat keywords beside it."""
    torch = pytest.importorskip("torch")
    import hal_core.torch as hal_torch

    args = _inputs()
    host = _options(np.random.default_rng(SEED + 2))
    options = dataclasses.replace(host, sinks=torch.from_numpy(host.sinks), alibi_slopes=torch.from_numpy(
        host.alibi_slopes))  # the torch operators take tensors
    tensors = {k: torch.from_numpy(v) if isinstance(v, np.ndarray) else v for k, v in args.items()}
    positional, keywords = _split(tensors)
    got = hal_torch.paged_attention(*positional, **keywords, options=options)
    expected = SPEC.reference({**args, **ATTENTION_OPTIONS.flat(host)})
    np.testing.assert_allclose(got.numpy(), expected, rtol=1e-4, atol=1e-5)
    with pytest.raises(ArgumentError, match="'window'"):
        hal_torch.paged_attention(*positional, **keywords, window=3, options=options)
    with pytest.raises(ArgumentTypeError, match="'scale'"):
        hal_torch.paged_attention(*positional, **keywords)


def test_the_cpu_implementation_receives_the_callers_options_whole(cpu: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """hal-cpu's implementation is handed the caller's AttentionOptions object itself (call.options)."""
    from hal_cpu.ops import paged_attention as cpu_attention

    seen: list[Any] = []
    real = cpu_attention.attend

    def spy(*arrays: Any, **knobs: Any) -> Any:
        seen.append(arrays[5])
        return real(*arrays, **knobs)

    monkeypatch.setattr(cpu_attention, "attend", spy)
    args = _inputs()
    options = _options(np.random.default_rng(SEED + 3))
    positional, keywords = _split(args)
    for _ in range(2):
        cpu.ops.paged_attention(*positional, **keywords, options=options)
    assert len(seen) == 2 and all(found is options for found in seen)
    cpu.ops.paged_attention(*positional, **keywords, scale=0.25, window=3)
    built = seen[-1]
    assert isinstance(built, AttentionOptions) and built is not options
    assert ATTENTION_OPTIONS.flat(built) == {"scale": 0.25, "window": 3, "softcap": None, "sinks": None,
                                             "alibi_slopes": None}


def test_the_fallback_and_the_reference_receive_the_options(cpu: Any) -> None:
    """A call falling back keeps the options (the same object on host arrays); the reference reads them whole."""
    args = _inputs()
    options = _options(np.random.default_rng(SEED + 4))
    positional, keywords = _split(args)
    call = cpu.ops.prepare("paged_attention", **dict(zip(("query", "key_cache", "value_cache", "block_tables",
                                                          "seq_lens"), positional, strict=True)),
                           **keywords, options=options)
    assert call.options is options
    moved = OpCall(call.spec, {**call.args, "sinks": np.array(call.args["sinks"])}, cpu,
                   given_options=call.given_options)
    assert moved.options is not options and moved.options.sinks is moved.args["sinks"]
    assert all(getattr(moved.options, name) is getattr(options, name) for name in ("scale", "window", "softcap",
                                                                                   "alibi_slopes"))
    flat = cpu.ops.prepare("paged_attention", **{**args, **ATTENTION_OPTIONS.flat(options)})
    assert isinstance(flat.options, AttentionOptions) and flat.options.window == options.window
    np.testing.assert_array_equal(SPEC.reference(call.args), SPEC.reference(flat.args))


def test_a_new_option_field_reaches_the_schema_front_door_and_variants(monkeypatch: pytest.MonkeyPatch) -> None:
    """One new field on the group is an argument of the op, of its torch schema and front door, and a variant."""
    from hal_core.torch._schema import torch_ops

    extended = dataclasses.make_dataclass(
        "ExtendedOptions",
        [(f.name, f.type, f) for f in dataclasses.fields(AttentionOptions)]
        + [("bias", "float | None", dataclasses.field(default=None, metadata=grouped(
            Arg.scalar("bias", float, required=False), variant="bias")))],
        frozen=True)
    group = ArgGroup.of(extended)

    class ExtendedAttention(PagedAttention):
        args = tuple(a for a in PagedAttention.args if a.name not in ATTENTION_OPTIONS.names)
        options = group

    spec = ExtendedAttention()
    assert spec.args[-1].name == "bias" and "bias" in spec.signature().parameters
    schemas = [op.schema for op in torch_ops(spec)]
    assert all("float? bias=None" in schema for schema in schemas), schemas
    assert "bias" in front_door(spec).__code__.co_varnames
    args = _inputs()
    monkeypatch.setattr(paged_attention_module, "ATTENTION_OPTIONS", group)
    assert "bias" in paged_attention_module.variants({**args, "bias": 1.5})
    assert "bias" not in paged_attention_module.variants(args)


def test_public_names() -> None:
    """AttentionOptions is public from hal_core and hal_core.ops, and the op declares it as its group."""
    assert hal_core.AttentionOptions is AttentionOptions
    assert SPEC.options is not None and SPEC.options.value_type is AttentionOptions
    assert SPEC.options.names == ("scale", "window", "softcap", "sinks", "alibi_slopes")
