"""vLLM's int4 weight-only (WNA16) linear layers on hal's ``quantized_gemm``: GPTQ and AWQ checkpoints on CPU.

vLLM's GPTQ (``AutoGPTQLinearMethod``) and AWQ (``AutoAWQMarlinLinearMethod``)
layers choose a mixed-precision kernel from a per-platform list, the first
whose ``can_implement`` accepts the layer. With ``HAL_VLLM=1`` the plugin
puts :class:`HalWNA16LinearKernel` first in the CPU list (a kernel
registered the usual way would come last and never be chosen). The
kernel receives the layer's tensors as vLLM holds them once loaded:

- ``qweight`` int32 ``[K/8, N]``, packed along K with nibble ``j`` of word
  ``[r, n]`` the code of row ``8r + j``: GPTQ's packing, which is hal's, so
  the words are kept as they are (AWQ checkpoints are repacked to it by
  vLLM before the kernel sees them);
- ``scales`` ``[K/G, N]`` in the activation dtype;
- zero points: none for GPTQ's ``uint4b8`` (codes biased by 8, hal's
  symmetric form); for AWQ's ``uint4``, int32 ``[N/8, G]`` packed along N,
  unpacked once here into hal's uint8 ``[K/G, N]``.

It builds hal's weight once, at load time (views of the layer's tensors
where the bits are unchanged; the zero points unpacked), and each forward
is one ``quantized_gemm`` of the flattened activations into a new output
tensor, with the activation precision ``HAL_VLLM_INT4_ACTIVATIONS`` sets
(:func:`int4_activations`; hal's ``"auto"`` by default). While vLLM compiles the model
(``torch.compile``, its default), the layer is ``torch.ops.hal.quantized_gemm``
over the same tensors instead: an operator the compiler keeps whole (the
bound call's numpy views would have it trace into hal's Python).
``VLLM_DISABLED_KERNELS=HalWNA16LinearKernel`` gives the layers back to
vLLM's own kernels while attention stays on hal.
"""

from __future__ import annotations

from typing import Any

import torch
from vllm.model_executor.kernels.linear.mixed_precision.MPLinearKernel import (
    MPLinearKernel,
)
from vllm.scalar_type import scalar_types

from hal_core import env
from hal_core.torch import FLOAT_DTYPE_NAMES

from ._startup import Route, device_type, serving_backend

__all__ = ["ACTIVATION_SETTINGS", "HalWNA16LinearKernel", "int4_activations", "unpack_zero_points"]

#: ``HAL_VLLM_INT4_ACTIVATIONS``'s values: hal's ``quantized_gemm`` ``activations`` setting for the int4 layers.
ACTIVATION_SETTINGS = ("float", "auto", "int8")


def int4_activations() -> str:
    """The int4 layers' activation precision, ``HAL_VLLM_INT4_ACTIVATIONS``: ``"auto"`` (the default, as in hal's
    own quantized models) lets hal choose per call, W4A8 (each row quantized to int8 on the fly, integer dot
    products) from two rows where it measured faster, W4A16 for one; ``"int8"`` is W4A8 always, ``"float"``
    W4A16 always (the arithmetic of vLLM's own int4 kernel for fp16, and for bf16 on CPUs without AMX). A
    misspelt value is an error naming the variable."""
    return env.choice("HAL_VLLM_INT4_ACTIVATIONS", "auto", ACTIVATION_SETTINGS)

_WEIGHT_TYPES = {"uint4b8": False, "uint4": True}  # vLLM's int4 weight types -> whether zero points come with them


def unpack_zero_points(packed: torch.Tensor) -> torch.Tensor:
    """vLLM's int32 ``[N/8, G]`` zero points (packed along N, nibble ``j`` = column ``8c + j``) as uint8 ``[G, N]``."""
    shifts = torch.arange(0, 32, 4, dtype=torch.int32, device=packed.device)
    nibbles = (packed.unsqueeze(1) >> shifts[None, :, None]) & 0xF  # [N/8, 8, G]
    return nibbles.reshape(-1, packed.shape[1]).t().contiguous().to(torch.uint8)


class HalWNA16LinearKernel(MPLinearKernel):  # type: ignore[misc, unused-ignore]
    """A vLLM mixed-precision linear kernel: int4 weights, fp32/fp16/bf16 activations, through hal."""

    @classmethod
    def get_min_capability(cls) -> int:
        return -1  # no device capability needed; the serving hal backend decides what it runs

    @classmethod
    def can_implement(cls, c: Any) -> tuple[bool, str | None]:
        weight_type = next((name for name in _WEIGHT_TYPES if c.weight_type == getattr(scalar_types, name)), None)
        if weight_type is None:
            return False, f"hal runs int4 weights (uint4b8, uint4), not {c.weight_type}"
        if c.zero_points != _WEIGHT_TYPES[weight_type]:
            return False, f"{weight_type} {'without' if _WEIGHT_TYPES[weight_type] else 'with'} zero points"
        if c.act_type not in FLOAT_DTYPE_NAMES:
            return False, f"activations of dtype {c.act_type}"
        k = c.partition_weight_shape[0]
        group = k if c.group_size == -1 else c.group_size
        if k % 8 or group <= 0 or k % group:
            return False, f"K={k} is not a multiple of 8 and of the group size {group}"
        if c.out_type is not None and c.out_type != c.act_type:
            return False, f"an output dtype {c.out_type} other than the activations' {c.act_type}"
        backend = serving_backend(device_type())
        verdict = backend.ops.coverage("quantized_gemm").covers(
            {"dtype": FLOAT_DTYPE_NAMES[c.act_type], "group_size": group, "bits": 4})
        if verdict is not True:
            return False, f"hal backend {backend.name!r} does not run quantized_gemm here ({verdict})"
        return True, None

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        """Build hal's weight over the layer's loaded tensors (once, at load time)."""
        from hal_core.torch import weight_from_tensors

        activations = int4_activations()  # a misspelt setting stops the loading before anything is built
        qweight, scales, zeros = self._get_weight_params(layer)
        if getattr(qweight, "input_dim", 0) != getattr(qweight, "packed_dim", 0):
            raise ValueError("hal-vllm: expected int4 weights packed along the input dimension (GPTQ layout)")
        tensors = {"qweight": qweight.data.contiguous(), "scales": scales.data.contiguous()}
        if self.config.zero_points:
            if getattr(zeros, "output_dim", 0) != 0:  # [G, N/8]: the column-packed layout transposed
                zeros = zeros.t()
            tensors["zeros"] = unpack_zero_points(zeros.data.contiguous())
        elif self.w_zp_name is not None:
            setattr(layer, self.w_zp_name, None)  # a symmetric layer's zero points are not used
        route = Route(serving_backend(device_type()))
        if not route.backend.is_host:
            raise ValueError(f"hal-vllm runs int4 linear layers on the host backend, not {route.backend.name!r}")
        # numpy views of the layer's tensors (the zero points new), made once
        self._weight = weight_from_tensors(tensors, bits=4).map_arrays(lambda a: route.native(a, "qweight"))
        self._route = route
        self._activations = activations
        # repeated calls: the planned runner
        self._gemm = route.ops.bind("quantized_gemm", qweight=self._weight, activations=self._activations)
        self._tensors = tensors  # for torch.ops.hal.quantized_gemm while vLLM compiles the model

    def apply_weights(self, layer: torch.nn.Module, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        """``x @ W (+ bias)`` over the last dimension of ``x``, through hal's ``quantized_gemm``."""
        k, n = self._weight.shape
        rows = x.reshape(-1, k)
        if not rows.is_contiguous():
            rows = rows.contiguous()
        if torch.compiler.is_compiling():  # the operator, opaque to the compiler (its fake gives the shape)
            t = self._tensors
            out = torch.ops.hal.quantized_gemm(rows, t["qweight"], t["scales"], t.get("zeros"), None, 4,
                                               self._weight.group_size, self._activations)
        else:
            out = torch.empty((rows.shape[0], n), dtype=x.dtype, device=x.device)
            if rows.shape[0]:
                native = self._route.native
                self._gemm(x=native(rows, "x"), out=native(out, "out"))
        if bias is not None:
            out += bias
        return out.reshape(*x.shape[:-1], n)
