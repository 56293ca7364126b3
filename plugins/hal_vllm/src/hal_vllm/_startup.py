"""Start-up: which hal backend serves vLLM, and whether it can run each attention layer exactly.

Everything here runs while vLLM builds the model and its KV cache, so a
model hal cannot run is refused before the first request, with a
``ValueError`` naming the feature and what to do, never run wrong: a layer
is accepted only when hal's ``paged_attention`` has every feature it needs
(variable-length queries, sliding window, softcap, sinks, ALiBi) in the
model's dtype and cache dtype.

Whether the serving backend runs the layer's calls itself (its declared
:meth:`~hal_core.ops.Ops.coverage` of dtype, head size, block size and
variants: ``prefill`` for steps with prompt tokens, ``strided_cache`` for
vLLM's cache halves, ...) is checked here too: what it does not declare
runs on hal's fallback path, correct and slower, said once per process at
start-up; with ``HAL_STRICT=1`` (hal's rule: any fallback is an error) it
refuses the model instead.
"""

from __future__ import annotations

import inspect
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace
from typing import Any

import torch

import hal_core
from hal_core import AttentionOptions, Backend, env
from hal_core.torch import FLOAT_DTYPE_NAMES, HostRoute, backend_for

__all__ = ["LayerPlan", "Route", "check_cache_spec", "device_type", "plan_layer", "serving_backend"]

#: The logger of the plugin: a child of vLLM's, so its messages appear with vLLM's own.
log = logging.getLogger("vllm.hal_vllm")

#: The arguments of ``paged_attention`` vLLM's metadata and layers need beyond the decode form (the layer's
#: AttentionOptions go whole as ``options``).
_VARLEN_ARGUMENTS = ("query_start_loc", "max_query_len", "options")

_announced: set[int] = set()
_warned: set[tuple[int, str, str]] = set()


def _refuse(what: str, remedy: str = "unset HAL_VLLM to run this model on vLLM's own attention") -> ValueError:
    return ValueError(f"hal-vllm cannot run this model: {what}; {remedy}")


def device_type() -> str:
    """The torch device type of vLLM's platform in this process (``cpu``, ``cuda``)."""
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def serving_backend(device: str) -> Backend:
    """The hal backend that owns tensors of torch device type ``device``; logged once per process."""
    backend = backend_for(torch.empty(0, device=device))
    if os.getpid() not in _announced:
        _announced.add(os.getpid())
        info = {b.name: b for b in hal_core.list_backends()}.get(backend.name)
        where = f"{info.distribution} {info.version}" if info is not None else "?"
        log.info("hal-vllm: vLLM attention runs on hal backend %r (%s, hal-core %s)%s", backend.name, where,
                 hal_core.__version__, "; HAL_STRICT is on: any fallback is an error" if _strict() else "")
    return backend


def _strict() -> bool:
    return env.flag("HAL_STRICT", False)


def _check_covered(backend: Backend, features: dict[str, Any], variants: frozenset[str] | None = None) -> None:
    """Say (once) which attention calls ``backend`` leaves to hal's fallback; under ``HAL_STRICT``, refuse.

    ``variants`` are the optional behaviours of ``paged_attention`` the layer uses (``prefill``,
    ``strided_cache``, ``window``, ...); ``write_kv_cache`` is asked about ``features`` alone.
    """
    for op, asked in (("write_kv_cache", features),
                      ("paged_attention", features if variants is None else {**features, "variant": variants})):
        verdict = backend.ops.coverage(op).covers(asked)
        if verdict is True:
            continue
        if _strict():
            raise _refuse(f"HAL_STRICT is on, and hal backend {backend.name!r} would leave {op} calls of this "
                          f"model to hal's fallback path ({verdict})",
                          "choose what the backend declares (`hal info --explain`), unset HAL_STRICT to accept "
                          "the fallback, or unset HAL_VLLM")
        key = (os.getpid(), op, str(verdict))
        if key not in _warned:
            _warned.add(key)
            log.warning("hal-vllm: hal backend %r does not run every %s call of this model itself (%s); "
                        "those calls run on hal's fallback path: correct, slower", backend.name, op, verdict)


def _check_varlen(backend: Backend) -> None:
    parameters = inspect.signature(backend.ops.paged_attention).parameters
    missing = [name for name in _VARLEN_ARGUMENTS if name not in parameters]
    if missing:
        raise _refuse(f"hal-core {hal_core.__version__} has no variable-length paged_attention "
                      f"(no {', '.join(missing)})", "upgrade hal-core, or unset HAL_VLLM")


#: How vLLM's tensors reach the serving backend's ops: hal's public route (:class:`hal_core.torch.HostRoute`).
#: On the host backend its front door, each tensor viewed as a numpy array first (``native``, no copy), so a
#: step's metadata and a layer's cache halves are converted once, not per call; on a device backend hal's
#: torch functions, which enqueue on torch's current stream of the tensors' device.
Route = HostRoute


@dataclass(frozen=True)
class LayerPlan:
    """How one attention layer runs on hal, decided once: the route and the layer's attention options."""

    route: Route
    #: scale, window, softcap and ALiBi slopes (float32 [num_heads] as the route takes them); the sinks, a weight
    #: loaded later, are added by :meth:`options_with`.
    options: AttentionOptions

    def options_with(self, sinks: Any) -> AttentionOptions:
        """The layer's options with its ``sinks`` (float32 ``[num_heads]`` as the route takes them, or None)."""
        return self.options if sinks is None else replace(self.options, sinks=sinks)


def plan_layer(
    *,
    num_heads: int,
    head_size: int,
    scale: float,
    num_kv_heads: int,
    alibi_slopes: Sequence[float] | None,
    sliding_window: int | None,
    kv_cache_dtype: str,
    logits_soft_cap: float | None,
    attn_type: str,
    has_sinks: bool,
    unsupported: Sequence[str],
    dtype: torch.dtype,
) -> LayerPlan:
    """Check one layer's configuration against hal and the serving backend; raise ValueError if it cannot run."""
    if unsupported:
        raise _refuse(f"the attention layer asks for {', '.join(unsupported)}, which hal's paged_attention "
                      f"does not have")
    if attn_type != "decoder":  # vLLM's AttentionType is a str enum
        raise _refuse(f"attention of type {str.__str__(attn_type)!r} (hal runs causal decoder attention over "
                      f"the paged cache)")
    if dtype not in FLOAT_DTYPE_NAMES:
        raise _refuse(f"dtype {dtype} (hal's attention runs float32, float16 and bfloat16)",
                      "run with --dtype float32, float16 or bfloat16, or unset HAL_VLLM")
    if kv_cache_dtype not in ("auto", str(dtype).removeprefix("torch.")):
        raise _refuse(f"kv-cache dtype {kv_cache_dtype!r} (hal keeps the cache in the model's dtype, {dtype})",
                      "drop --kv-cache-dtype, or unset HAL_VLLM")
    if num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise _refuse(f"{num_heads} query heads over {num_kv_heads} KV heads (the KV heads must divide them)")
    if sliding_window is not None and sliding_window < 1:
        raise _refuse(f"sliding window {sliding_window} (hal takes a window of at least 1 token)")
    backend = serving_backend(device_type())
    _check_varlen(backend)
    used = {"window": sliding_window is not None, "softcap": bool(logits_soft_cap), "sinks": has_sinks,
            "alibi": alibi_slopes is not None}
    variants = frozenset({"prefill", "strided_cache"} | {name for name, on in used.items() if on})
    _check_covered(backend, {"dtype": FLOAT_DTYPE_NAMES[dtype], "head_size": head_size}, variants)
    route = Route(backend)
    slopes = None
    if alibi_slopes is not None:
        if len(alibi_slopes) != num_heads:
            raise _refuse(f"{len(alibi_slopes)} ALiBi slopes for {num_heads} heads")
        slopes = route.native(torch.tensor(list(alibi_slopes), dtype=torch.float32, device=device_type()),
                              "alibi_slopes")
    options = AttentionOptions(scale=float(scale), window=sliding_window,
                               softcap=float(logits_soft_cap) if logits_soft_cap else None, alibi_slopes=slopes)
    return LayerPlan(route=route, options=options)


def check_cache_spec(kv_cache_spec: Any, vllm_config: Any) -> None:
    """Refuse a KV-cache group hal cannot hold: keys and values of different sizes, a block size not covered."""
    head_size, head_size_v = kv_cache_spec.head_size, getattr(kv_cache_spec, "head_size_v", kv_cache_spec.head_size)
    if head_size_v != head_size:
        raise _refuse(f"keys of {head_size} and values of {head_size_v} elements per head "
                      f"(hal's cache holds both at one head size)")
    if getattr(vllm_config.attention_config, "use_non_causal", False):
        raise _refuse("non-causal attention (hal's paged_attention is causal)")
    if getattr(vllm_config, "kv_transfer_config", None) is not None:
        raise _refuse("a KV connector (hal-vllm has not been tested with KV transfer between instances)")
    dtype = kv_cache_spec.dtype
    if dtype not in FLOAT_DTYPE_NAMES:
        raise _refuse(f"a KV cache of dtype {dtype}")
    backend = serving_backend(device_type())
    _check_covered(backend, {"dtype": FLOAT_DTYPE_NAMES[dtype], "head_size": head_size,
                             "block_size": kv_cache_spec.block_size})
