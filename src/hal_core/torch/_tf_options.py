"""A transformers attention layer's :class:`~hal_core.AttentionOptions`, built once per layer.

The options come from what transformers passes the attention function (the layer's ``scaling``,
``sliding_window``, ``softcap``, its sinks as ``s_aux`` or the module's own ``sinks``) and are built the
first time a layer attends; every later call of that layer gets the same object, so nothing is converted
or checked again per call. They are built anew only when one of those values changes, or the sinks tensor
is replaced or written in place (its version counter). ``sinks`` is a float32 numpy view for the host
front door, a float32 tensor for the torch operators.
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from ..ops import AttentionOptions
from ._held_calls import version_of
from ._host import HostRoute

__all__ = ["layer_options", "layer_values"]

#: module -> (scale, window, softcap, route), the sinks tensor, its version, the options built from them.
_LAYERS: weakref.WeakKeyDictionary[torch.nn.Module, tuple[tuple[Any, ...], Any, int | None, AttentionOptions]] = \
    weakref.WeakKeyDictionary()


def layer_options(module: torch.nn.Module, kwargs: dict[str, Any], scale: float,
                  route: HostRoute | None) -> AttentionOptions:
    """The options of layer ``module``: sinks as ``route`` takes them (:meth:`HostRoute.native`; None: the tensor,
    for the torch operators)."""
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), _sinks(module, kwargs)
    key = (scale, window, softcap, route)
    held = _LAYERS.get(module)
    if held is not None and held[0] == key and held[1] is sinks and (sinks is None or held[2] == version_of(sinks)):
        return held[3]
    native: Any = None
    if sinks is not None:
        native = sinks.detach().to(torch.float32).reshape(-1).contiguous()
        native = native if route is None else route.native(native, "sinks")
    options = AttentionOptions(scale=scale, window=window, softcap=softcap, sinks=native)
    _LAYERS[module] = (key, sinks, 0 if sinks is None else version_of(sinks), options)
    return options


def layer_values(module: torch.nn.Module, kwargs: dict[str, Any]) -> tuple[int | None, float | None,
                                                                           torch.Tensor | None]:
    """The layer's window, softcap and float32 sinks as plain values (a traced forward: no object to keep)."""
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), _sinks(module, kwargs)
    if sinks is not None:
        sinks = sinks.detach().to(torch.float32).reshape(-1).contiguous()
    return (int(window) if window is not None else None, float(softcap) if softcap is not None else None, sinks)


def _sinks(module: torch.nn.Module, kwargs: dict[str, Any]) -> torch.Tensor | None:
    """The layer's attention sinks as transformers passes them (``s_aux``), else the module's own (gpt-oss)."""
    sinks = kwargs.get("s_aux")
    if sinks is None:  # read from the module's stores, not through Module.__getattr__
        for store in (module._parameters, module._buffers, module.__dict__):
            found = store.get("sinks")
            if isinstance(found, torch.Tensor):
                return found
    return sinks
