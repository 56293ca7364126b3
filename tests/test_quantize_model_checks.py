"""quantize_model checks every layer before it changes any: each problem names its layer, the model stays as it was."""

from __future__ import annotations

import itertools

import pytest
from torch_helpers import torch

import hal_core
from hal_core.quant import quantize
from hal_core.torch import QuantLinear, quantize_model


def _stack(seed: int, sizes: tuple[int, ...] = (64, 64, 64, 64)) -> torch.nn.Sequential:
    torch.manual_seed(seed)
    return torch.nn.Sequential(*(torch.nn.Linear(k, n) for k, n in itertools.pairwise(sizes)))


def _snapshot(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _assert_unchanged(model: torch.nn.Module, before: dict[str, torch.Tensor]) -> None:
    after = model.state_dict()
    assert after.keys() == before.keys()
    for key, value in before.items():
        torch.testing.assert_close(after[key], value, rtol=0, atol=0, equal_nan=True, msg=key)
    assert not any(isinstance(m, QuantLinear) for m in model.modules())


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")])
def test_a_non_finite_weight_in_the_last_layer_is_named_and_nothing_is_replaced(bad: float) -> None:
    """NaN or +-inf in the last layer: the error names it, the row and the group; no earlier layer was replaced."""
    model = _stack(1)
    with torch.no_grad():
        model[2].weight[17, 40] = bad
    before = _snapshot(model)
    with pytest.raises(hal_core.ArgumentError, match=r"layer '2' \(64 -> 64, int4\): its weight holds NaN or "
                                                      r"infinity \(output row 17, input rows 32\.\.63\)"):
        quantize_model(model, group_size=32)
    _assert_unchanged(model, before)


@pytest.mark.filterwarnings("ignore:overflow encountered in cast")  # quantize's own, called below
@pytest.mark.parametrize("symmetric", [True, False])
def test_scales_that_overflow_or_vanish_in_fp16_are_named_before_any_change(symmetric: bool) -> None:
    """A group whose fp16 scale overflows (|w| ~ 1e6) or rounds to zero (|w| ~ 1e-9) is refused; fp32 scales take it."""
    model = _stack(2)
    with torch.no_grad():
        model[1].weight[3, :32] = 1e6
        model[2].weight[:, 32:] *= 1e-9
    before = _snapshot(model)
    with pytest.raises(ValueError) as info:
        quantize_model(model, group_size=32, symmetric=symmetric)
    message = str(info.value)
    assert "2 layer(s) cannot be quantized, nothing was changed" in message
    assert "layer '1' (64 -> 64, int4): the scale" in message and "output row 3, input rows 0..31 overflows" in message
    assert "layer '2' (64 -> 64, int4): the scale" in message and "rounds to zero in torch.float16" in message
    assert "layer '0'" not in message and "scale_dtype=torch.float32" in message
    _assert_unchanged(model, before)
    for layer in (1, 2):  # the check agrees with quantize itself, which refuses the same weights
        with pytest.raises(ValueError, match="cannot represent these scales"):
            quantize(model[layer].weight.detach().T, group_size=32, symmetric=symmetric)
    report = quantize_model(model, group_size=32, symmetric=symmetric, scale_dtype=torch.float32)
    assert report.quantized == ("0", "1", "2")


def test_a_scale_just_inside_fp16_passes_and_one_just_outside_fails() -> None:
    """The check rounds scales as quantize does: 65504 * 7 is accepted, a group a little larger is refused."""
    for top, ok in ((65504.0 * 7, True), (65520.0 * 7, False)):
        model = _stack(3)
        with torch.no_grad():
            model[0].weight[5, 0] = top
        if ok:
            assert quantize_model(model, group_size=64).quantized == ("0", "1", "2")
            assert float(model[0].scales.float().max()) == 65504.0
        else:
            with pytest.raises(ValueError, match=r"layer '0' .*overflows torch.float16"):
                quantize_model(model, group_size=64)


def test_dtypes_devices_and_shapes_quantize_cannot_take_are_named() -> None:
    """A float8 weight, a meta weight, a weight of the wrong shape and an odd in_features for int4 are each named."""
    model = torch.nn.ModuleDict({"fine": torch.nn.Linear(64, 64), "f8": torch.nn.Linear(64, 64),
                                 "meta": torch.nn.Linear(64, 64, device="meta"), "odd": torch.nn.Linear(36, 64),
                                 "shape": torch.nn.Linear(64, 64)})
    model["f8"].weight.data = model["f8"].weight.data.to(torch.float8_e4m3fn)
    model["shape"].weight = torch.nn.Parameter(torch.zeros(64, 32))
    with pytest.raises(ValueError) as info:
        quantize_model(model, group_size=-1, layer_bits=None)
    message = str(info.value)
    assert "4 layer(s)" in message and "'fine'" not in message
    assert "layer 'f8' (64 -> 64, int4): its weight is torch.float8_e4m3fn" in message
    assert "layer 'meta' (64 -> 64, int4): its weight is on the meta device" in message
    assert "layer 'odd' (36 -> 64, int4): int4 packs 8 input rows per word" in message
    assert "layer 'shape' (64 -> 64, int4): its weight has shape (64, 32)" in message
    assert type(model["fine"]) is torch.nn.Linear
    with pytest.raises(ValueError, match="'group_size'"):
        quantize_model(model, group_size=0)
    with pytest.raises(TypeError, match="'scale_dtype'"):
        quantize_model(model, scale_dtype=torch.float64)
    with pytest.raises(TypeError, match="'symmetric'"):
        quantize_model(model, symmetric="yes")
    with pytest.raises(TypeError, match="'unmap'"):
        quantize_model(model, unmap=None)


def test_an_error_while_quantizing_leaves_the_model_whole(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failure after the checks (here out of memory at the third layer) leaves every layer float and unchanged."""
    model = _stack(4, (64, 64, 64, 64, 64))
    before = _snapshot(model)
    real = QuantLinear.from_linear
    calls = []

    def failing(linear: torch.nn.Linear, **kwargs: object) -> QuantLinear:
        calls.append(linear)
        if len(calls) == 3:
            raise MemoryError("no memory left")
        return real(linear, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(QuantLinear, "from_linear", failing)
    with pytest.raises(MemoryError):
        quantize_model(model, group_size=32)
    _assert_unchanged(model, before)
    assert all(type(m) is torch.nn.Linear for m in model)
