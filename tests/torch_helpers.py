"""Shared pieces of the torch tests: lazy skips, host inputs as tensors, and a tiny quantized decode model."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (make test installs it)")

import hal_core  # noqa: E402
import hal_core.torch as hal_torch  # noqa: E402
from hal_core.quant import quantize  # noqa: E402

TORCH_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


def cuda_or_skip() -> None:
    """Skip unless torch sees a CUDA device and a hal backend owns its memory."""
    if not torch.cuda.is_available():
        pytest.skip("no CUDA device visible to torch (the CUDA cases run on a GPU host)")
    try:
        hal_torch.backend_for(torch.empty(1, device="cuda"))
    except hal_core.ArgumentError as exc:
        pytest.skip(f"torch sees CUDA but no hal backend owns it: {exc}")


def tensor(array: Any, device: str = "cpu") -> torch.Tensor:
    """A host numpy array as a torch tensor on ``device`` (bf16 through its bits)."""
    return hal_torch.to_tensor(np.ascontiguousarray(array)).to(device)


def host(t: torch.Tensor) -> np.ndarray:
    """A tensor as float64 numpy (any float dtype)."""
    return t.detach().to("cpu", torch.float64).numpy()


class TinyDecoder(torch.nn.Module):
    """A decoder with quantized projections and paged attention; no norms or MLP (the hal ops are the point).

    Each layer: ``q, k, v = x @ Wq, x @ Wk, x @ Wv`` (``hal::quantized_gemm``), the new keys and values
    written into the layer's cache (``hal::write_kv_cache``), ``hal::paged_attention``, ``x += attn @ Wo``.
    The weights are registered buffers made once with :func:`hal_core.torch.weight_to_tensors`.
    """

    def __init__(self, rng: np.random.Generator, *, layers: int, hidden: int, heads: int, kv_heads: int,
                 head_size: int, dtype: torch.dtype, bits: int = 4, group_size: int = 32) -> None:
        super().__init__()
        self.layers, self.heads, self.kv_heads, self.head_size, self.bits = layers, heads, kv_heads, head_size, bits
        shapes = {"wq": (hidden, heads * head_size), "wk": (hidden, kv_heads * head_size),
                  "wv": (hidden, kv_heads * head_size), "wo": (heads * head_size, hidden)}
        for layer in range(layers):
            for name, (k, n) in shapes.items():
                qw = quantize(rng.standard_normal((k, n)) / np.sqrt(k), bits=bits, group_size=group_size,
                              symmetric=bool(layer % 2))
                for field, t in hal_torch.weight_to_tensors(qw).items():
                    self.register_buffer(f"{name}{layer}_{field}", t.to(dtype) if t.is_floating_point() else t)
        self.scale = head_size ** -0.5

    def weight(self, name: str, layer: int) -> dict[str, torch.Tensor]:
        prefix = f"{name}{layer}_"
        return {key[len(prefix):]: buf for key, buf in self.named_buffers() if key.startswith(prefix)}

    def forward(self, x: torch.Tensor, key_caches: list[torch.Tensor], value_caches: list[torch.Tensor],
                slot_mapping: torch.Tensor, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                query_start_loc: torch.Tensor, max_query_len: int) -> torch.Tensor:
        tokens = x.shape[0]
        for layer in range(self.layers):
            q = hal_torch.quantized_gemm(x, self.weight("wq", layer), self.bits)
            k = hal_torch.quantized_gemm(x, self.weight("wk", layer), self.bits)
            v = hal_torch.quantized_gemm(x, self.weight("wv", layer), self.bits)
            q = q.view(tokens, self.heads, self.head_size)
            k = k.view(tokens, self.kv_heads, self.head_size)
            v = v.view(tokens, self.kv_heads, self.head_size)
            hal_torch.write_kv_cache(k, v, key_caches[layer], value_caches[layer], slot_mapping)
            attn = hal_torch.paged_attention(q, key_caches[layer], value_caches[layer], block_tables, seq_lens,
                                             self.scale, query_start_loc=query_start_loc,
                                             max_query_len=max_query_len)
            x = x + hal_torch.quantized_gemm(attn.reshape(tokens, -1), self.weight("wo", layer), self.bits)
        return x
