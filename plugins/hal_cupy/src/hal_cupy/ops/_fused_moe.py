"""``fused_moe`` on a GPU: routing, grouping and grouped GEMMs on the device (``fused_moe.cu``), no host read.

The plan (:mod:`hal_cupy.ops._fused_moe_plan`): one thread per token picks its experts and weights and counts
them per expert; one CTA pads each expert's rows to a row tile (:data:`~._fused_moe_rules.MOE_TILE`) and
records each tile's expert; one thread per (token, slot) pair takes a row slot of its expert; the grouped
GEMMs run over the worst-case number of tiles (the surplus CTAs exit after reading the padded total on device),
each CTA multiplying one tile of one expert by that expert's weights (SIMT, every device and SIMD width);
the gated intermediate and the per-pair results stay in float32 and the combine adds each token's slots in
slot order, rounded once. int8 experts (W8A8), and int4 experts with ``activations`` int8 (W4A8), quantise the
hidden states and the gated intermediate per row (``quant_util.cu``'s ``hal_w8a8_quantize_rows``) before their
GEMMs, whose integer sums are exact (``dp4a``-style byte dot products, emulated where the device has none).

Every size comes from shapes: no device read, no synchronisation (CUDA-graph capturable). The experts'
addresses go to the kernels as one small device table per projection, built by a host-to-device copy the first
time a set of expert arrays is seen and cached by those addresses (so a capture must follow one warm-up call).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from typing import Any

import numpy as np

from hal_core.arrays import dtype_name, is_c_contiguous
from hal_core.ops import OpCall
from hal_core.ops.fused_moe import int8_activations, routing_of
from hal_core.ops.gated_activation import activation_of
from hal_core.quant import ExpertWeights

from .._arrays import KERNEL_DTYPES, aligned, as_storage, empty_like_dtype
from .._cupy import cupy
from ._common import GpuOp, kernels_for, launch, storage_device
from ._fused_moe_plan import MoeShape, buffers, steps
from ._fused_moe_rules import MOE_GROUP_SIZES, MOE_TILE, max_tiles, moe_spec, specializations
from ._quantized_gemm_rules import quant_util_spec

__all__ = ["OP", "TABLES", "check", "run"]

_INT32_MAX = 2**31 - 1
#: Alignment the kernels' vector loads need, per QuantizedWeight array.
_WEIGHT_ALIGNMENT = {"qweight": 16, "scales": 8, "zeros": 4}
#: Most address tables kept (each ``3 * num_experts`` int64 on its device).
TABLE_CACHE_SIZE = 256


class AddressTables:
    """Device tables of expert addresses, keyed by (device, the addresses): a table's content is its key, so an
    entry can never be stale; the oldest entries go past :data:`TABLE_CACHE_SIZE`."""

    def __init__(self) -> None:
        self._tables: OrderedDict[tuple[int, tuple[int, ...]], Any] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, device_index: int, weights: Any) -> Any:
        """The ``[num_experts, 3]`` int64 table (qweight, scales, zeros or 0) of ``weights`` (device arrays)."""
        key = (device_index, tuple(0 if a is None else int(as_storage(a).data.ptr)
                                   for w in weights for a in (w.qweight, w.scales, w.zeros)))
        with self._lock:
            found = self._tables.get(key)
            if found is not None:
                self._tables.move_to_end(key)
                return found
        table = cupy().asarray(np.array(key[1], dtype=np.int64).reshape(-1, 3))
        with self._lock:
            self._tables[key] = table
            while len(self._tables) > TABLE_CACHE_SIZE:
                self._tables.popitem(last=False)
        return table


#: The address tables of every backend.
TABLES = AddressTables()


def check(call: OpCall) -> str:
    experts: ExpertWeights = call["experts"]
    num_experts, hidden, inter = experts.shape
    tokens = call["hidden_states"].shape[0]
    g = experts.group_size
    if g not in MOE_GROUP_SIZES:
        return f"group_size {g} has no GPU kernel (built for {MOE_GROUP_SIZES})"
    if hidden == 0 or inter == 0:
        return "experts with an empty hidden or intermediate size have no GPU kernel"
    if hidden % g or inter % g:
        return f"hidden={hidden} and intermediate={inter} must be multiples of group_size={g} for the GPU kernels"
    if tokens * int(call["top_k"]) * max(hidden, 1) > 2**40 or max_tiles(tokens, int(call["top_k"]),
                                                                         num_experts) * MOE_TILE > _INT32_MAX:
        return "dimensions too large for the kernels' 32-bit row indices"
    for name in ("hidden_states", "router_logits"):
        if not is_c_contiguous(call[name]):
            return f"argument {name!r} is not C-contiguous; pass a contiguous copy"
    for name, weight in experts.weights().items():
        if weight.g_idx is not None:
            return f"experts.{name}: act-order weights (g_idx) have no GPU kernel"
        if dtype_name(weight.scales) != "fp16":
            return (f"experts.{name}: scales are {dtype_name(weight.scales)}; the GPU kernels read float16 scales "
                    "(quantize_experts' default)")
        if call.host_arrays:
            continue
        for field, alignment in _WEIGHT_ALIGNMENT.items():
            value = getattr(weight, field)
            if value is not None and not aligned(value, alignment):
                return f"argument 'experts.{name}.{field}' is not {alignment}-byte aligned"
    return ""


def _float_logits(logits: Any, hal_dtype: str) -> Any:
    """The router logits as float32 on the device (a cast kernel, or the array itself)."""
    if hal_dtype == "fp32":
        return logits
    if hal_dtype == "bf16":  # bf16 bits -> fp32, exact
        return (logits.astype(np.uint32) << np.uint32(16)).view(np.float32)
    return logits.astype(np.float32)


def run(call: OpCall) -> Any:
    cp = cupy()
    x_arg, experts = call["hidden_states"], call["experts"]
    device_index = storage_device(x_arg)
    hal_dtype = dtype_name(x_arg)
    x = as_storage(x_arg)
    num_tokens, hidden = x.shape
    num_experts, _, inter = experts.shape
    shape = MoeShape(num_tokens, num_experts, int(call["top_k"]), hidden, inter, experts.group_size, experts.bits,
                     routing_of(call.args), activation_of(call.args), int8_activations(call.args))
    with cp.cuda.Device(device_index):
        out = empty_like_dtype((num_tokens, hidden), hal_dtype)
        if num_tokens == 0:
            return out
        caps = call.backend.device(device_index).capabilities
        width = caps.simd_width
        specs = {"moe": moe_spec(KERNEL_DTYPES[hal_dtype], experts.bits, width, shape.int8_activations),
                 "quant_x": quant_util_spec(KERNEL_DTYPES[hal_dtype], width),
                 "quant_act": quant_util_spec("float32", width)}
        values: dict[str, Any] = {
            name: (cp.zeros if b.zeroed else cp.empty)(b.shape, dtype=b.dtype) for name, b in buffers(shape).items()}
        values.update(x=x, out=as_storage(out),
                      logits=_float_logits(as_storage(call["router_logits"]), dtype_name(call["router_logits"])),
                      w13=TABLES.get(device_index, experts.w13), w2=TABLES.get(device_index, experts.w2))
        for step in steps(shape, width):
            kernels = kernels_for(call, device_index, specs[step.unit])
            launch(call, device_index, kernels, step.launch,
                   {name: values[v] if isinstance(v, str) else v for name, v in step.args.items()})
    return out


OP = GpuOp("fused_moe", check, run, specializations=specializations)
