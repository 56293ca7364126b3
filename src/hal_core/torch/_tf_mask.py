"""Which transformers mask functions ``attn_implementation="hal"`` honours: causal, optionally windowed.

transformers hands the mask interface a *mask function* (``(batch, head,
q_idx, kv_idx) -> bool``) built from its own pieces in
``transformers.masking_utils``. hal's paged kernel runs causal attention with
the layer's sliding window, so only ``causal_mask_function`` and
``sliding_window_causal_mask_function(w)`` are accepted; chunked attention,
bidirectional attention, packed sequences and image-token blocks are patterns
the kernel would silently ignore, so they raise. A function not recognised is
refused too (a clear error rather than a guess).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from transformers import masking_utils

from .._errors import ArgumentError

__all__ = ["check_mask_function"]


def _nonlocals(function: Callable[..., Any]) -> dict[str, Any]:
    cells = getattr(function, "__closure__", None) or ()
    return dict(zip(function.__code__.co_freevars, (c.cell_contents for c in cells), strict=True))


def _is(function: Any, qualname: str) -> bool:
    return (getattr(function, "__module__", None) == masking_utils.__name__
            and getattr(function, "__qualname__", None) == qualname)


def _causal_window(function: Any) -> bool:
    """Whether ``function`` is transformers' causal mask, or causal with a sliding window."""
    if function is masking_utils.causal_mask_function:
        return True
    if not _is(function, "and_masks.<locals>.and_mask"):
        return False
    parts = _nonlocals(function).get("mask_functions", ())
    return any(p is masking_utils.causal_mask_function for p in parts) and all(
        p is masking_utils.causal_mask_function or _is(p, "sliding_window_overlay.<locals>.inner_mask")
        for p in parts)


def _describe(function: Any) -> str:
    """A mask function as transformers composed it, e.g. ``and_masks(chunked_overlay, causal_mask_function)``."""
    for combine in ("and_masks", "or_masks"):
        if _is(function, f"{combine}.<locals>.{combine[:-1]}"):
            parts = _nonlocals(function).get("mask_functions", ())
            return f"{combine}({', '.join(_describe(p) for p in parts)})"
    name = getattr(function, "__qualname__", type(function).__name__)
    return name.removesuffix(".<locals>.inner_mask")


def check_mask_function(mask_function: Any) -> None:
    """Raise :class:`~hal_core.ArgumentError` unless ``mask_function`` is causal (optionally windowed)."""
    if mask_function is None or _causal_window(mask_function):
        return
    name = _describe(mask_function)
    raise ArgumentError(
        f"attn_implementation='hal' runs causal attention (with the layer's sliding window); this model's mask "
        f"function ({name}) adds another pattern (chunked or bidirectional attention, packed sequences, "
        f"image-token blocks) that hal's kernel would ignore: use attn_implementation='sdpa' or 'eager'")
