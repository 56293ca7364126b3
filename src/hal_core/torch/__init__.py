"""hal inside PyTorch: ``torch.ops.hal.*`` custom operators and the weight helper.

Importing this module registers, with :mod:`torch.library`, the operators of every op of
:data:`hal_core.ops.OPS`, generated from the op's declaration (:mod:`._schema`):

- ``hal::paged_attention(query, key_cache, value_cache, block_tables, seq_lens, scale, ...) -> Tensor``
  and ``hal::paged_attention_out(..., scale, out, ...) -> ()`` (mutates ``out``);
- ``hal::write_kv_cache(key, value, key_cache, value_cache, slot_mapping) -> ()``
  (mutates both caches);
- ``hal::quantized_gemm(x, qweight, scales, zeros, g_idx, bits, group_size, activations=None) -> Tensor`` and
  ``hal::quantized_gemm_out(..., out) -> ()``;
- ``hal::sample(logits, temperature, seeds, top_k=None, top_p=None, min_p=None) -> Tensor`` (int64 token ids)
  and ``hal::sample_out(..., out, ...) -> ()``.
- ``hal::rms_norm(x, weight, epsilon, residual=None, weight_offset=None) -> Tensor`` (mutates ``residual``
  when given) and ``hal::rms_norm_out``;
- ``hal::gated_activation(gate, up, activation=None) -> Tensor`` and ``hal::gated_activation_out``.
- ``hal::rotary_embedding(positions, query, cos_sin_cache, key=None, style=None) -> ()`` (mutates ``query``
  and ``key``).

The Python functions of the same names are thin wrappers with each op's signature
(``paged_attention(..., out=None, query_start_loc=None, ...)``, ``quantized_gemm(x, weight_tensors, bits)``).

Quantized models: :class:`QuantLinear` (an ``nn.Module`` over hal's packed
weight), :class:`QuantMoE` (a sparse MoE block whose quantized experts run
in one ``fused_moe`` call), :func:`quantize_model` (every ``nn.Linear`` and
Qwen3-MoE / Mixtral MoE block of a model, in place)
and :func:`load_quantized` (a GPTQ or AWQ checkpoint directory, as
transformers users have them). :func:`kernelize` runs a loaded model's norms,
gated MLP activations and rotary embedding on hal ops. :data:`FLOAT_DTYPE_NAMES` names the torch
float dtypes hal's ops compute in as hal does (``torch.bfloat16`` -> ``"bf16"``).
:func:`route_for` gives the one public route from torch tensors to a hal backend's ops
(:class:`HostRoute`: ``.ops``, ``.native(tensor, name)``, and ``.call(op, args)``, the fast path for
eager CPU tensors), which all of the above use.
``import hal_core`` never imports this module (nor torch); the transformers
attention backend lives in :mod:`hal_core.torch.transformers`. See
docs/engine-guide.md, "hal from PyTorch".
"""

from __future__ import annotations

try:
    import torch as _torch  # noqa: F401
except ImportError as exc:  # pragma: no cover - exercised only without torch
    raise ImportError("hal_core.torch needs PyTorch: pip install 'hal-core[torch]'") from exc

from ._checkpoints import CheckpointFormat, checkpoint_format, load_quantized
from ._convert import to_tensor
from ._dtypes import FLOAT_DTYPE_NAMES
from ._host import HostRoute, eager_host, route_for
from ._kernelize import KernelizeReport, kernelize
from ._modules import QuantLinear
from ._moe import QuantMoE
from ._ops import (
    gated_activation,
    paged_attention,
    quantized_gemm,
    rms_norm,
    rotary_embedding,
    sample,
    write_kv_cache,
)
from ._quantize_model import DEFAULT_LAYER_BITS, DEFAULT_SKIP, QuantizeReport, quantize_model
from ._routing import backend_for
from ._save import save_quantized
from ._weights import weight_from_tensors, weight_to_tensors

__all__ = [
    "DEFAULT_LAYER_BITS",
    "DEFAULT_SKIP",
    "FLOAT_DTYPE_NAMES",
    "CheckpointFormat",
    "HostRoute",
    "KernelizeReport",
    "QuantLinear",
    "QuantMoE",
    "QuantizeReport",
    "backend_for",
    "checkpoint_format",
    "eager_host",
    "gated_activation",
    "kernelize",
    "load_quantized",
    "paged_attention",
    "quantize_model",
    "quantized_gemm",
    "sample",
    "rms_norm",
    "rotary_embedding",
    "route_for",
    "save_quantized",
    "to_tensor",
    "weight_from_tensors",
    "weight_to_tensors",
    "write_kv_cache",
]
