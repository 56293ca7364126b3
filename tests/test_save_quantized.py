"""to_gptq: hal's weights as GPTQ tensors, checked against the independent packers of tests/quant_checkpoints.py."""

from __future__ import annotations

import numpy as np
import pytest

pytest.importorskip("torch", reason="torch is not installed (make test installs it)")
pytest.importorskip("transformers", reason="transformers is not installed (make test installs it)")

from quant_checkpoints import gptq_tensors, random_layer

from hal_core.quant import QuantizedWeight, from_gptq, quantize, to_gptq

FORMATS = {1: "gptq", 2: "gptq_v2"}


# -- to_gptq ------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("sym", [True, False])
@pytest.mark.parametrize("act_order", [False, True])
@pytest.mark.parametrize("version", [1, 2])
def test_to_gptq_gives_back_the_tensors_from_gptq_read(bits: int, sym: bool, act_order: bool, version: int) -> None:
    """to_gptq(from_gptq(t)) equals t exactly, t packed by the independent packers (v1 and v2, act-order or not)."""
    seed = 11 + 8 * bits + 4 * sym + 2 * act_order + version
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    top = (1 << bits) - 1
    zero_range = (1, min(top + 1, 255)) if version == 1 else (0, top)  # hal's uint8 zeros hold at most 255
    layer = random_layer(rng, 64, 32, bits=bits, group_size=16, sym=sym, act_order=act_order, zero_range=zero_range)
    stored = gptq_tensors(layer, bits=bits, version=version)
    weight = from_gptq(stored["qweight"], stored["qzeros"], stored["scales"], stored["g_idx"], bits=bits,
                       checkpoint_format=FORMATS[version])
    out = to_gptq(weight, checkpoint_format=FORMATS[version])
    assert sorted(out) == sorted(stored)
    for part, expected in stored.items():
        assert out[part].dtype == expected.dtype and np.array_equal(out[part], expected), part
    if bits == 4:  # hal's int4 words are GPTQ's: a view, not a copy
        assert np.shares_memory(out["qweight"], weight.qweight)


def test_to_gptq_refuses_what_gptq_cannot_hold() -> None:
    """Zero points outside the format's range, K or N off the word size, inexact scales, uneven groups."""
    rng = np.random.default_rng(5)
    w = rng.standard_normal((64, 16))
    asym = quantize(w, bits=4, group_size=16, symmetric=False)
    zeros = asym.zeros.copy()
    zeros[2, 3] = 0
    with pytest.raises(ValueError, match=r"zero point 0 \(group 2, column 3\).*'gptq_v2'"):
        to_gptq(QuantizedWeight(asym.qweight, asym.scales, zeros, 4, 16, (64, 16)))
    zeros[2, 3] = 16  # what a v1 checkpoint's nibble 15 reads back as: v1 holds it, v2 does not
    weight = QuantizedWeight(asym.qweight, asym.scales, zeros, 4, 16, (64, 16))
    assert int(to_gptq(weight)["qzeros"].view(np.uint32)[2, 0] >> 12 & 0xF) == 15
    with pytest.raises(ValueError, match=r"zero point 16 .*'gptq' \(v1\)"):
        to_gptq(weight, checkpoint_format="gptq_v2")
    with pytest.raises(ValueError, match="multiples of 4"):
        to_gptq(quantize(rng.standard_normal((6, 8)), bits=8, group_size=6))
    with pytest.raises(ValueError, match="multiples of 8"):
        to_gptq(quantize(rng.standard_normal((64, 12)), bits=4, group_size=16))
    with pytest.raises(ValueError, match=r"float32 scale .* not exact in float16"):
        to_gptq(quantize(w, bits=4, group_size=16, scale_dtype=np.float32))
    sym = quantize(w, bits=4, group_size=16)
    exact = QuantizedWeight(sym.qweight, sym.scales.astype(np.float32), None, 4, 16, (64, 16))
    assert to_gptq(exact)["scales"].dtype == np.float16 and np.array_equal(to_gptq(exact)["scales"], sym.scales)
    uneven = np.arange(64, dtype=np.int32) // 16
    uneven[0] = 1
    with pytest.raises(ValueError, match="puts 15 rows in group 0"):
        to_gptq(QuantizedWeight(sym.qweight, sym.scales, None, 4, 16, (64, 16), g_idx=uneven))
    with pytest.raises(ValueError, match="checkpoint_format"):
        to_gptq(sym, checkpoint_format="marlin")
    with pytest.raises(TypeError, match="QuantizedWeight"):
        to_gptq(w)
