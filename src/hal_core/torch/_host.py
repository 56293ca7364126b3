"""How torch tensors reach a hal backend's ops: one public route (:class:`HostRoute`, :func:`route_for`).

Every torch-facing piece of hal (:class:`~hal_core.torch.QuantLinear`, :class:`~hal_core.torch.QuantMoE`,
:func:`~hal_core.torch.kernelize`, the transformers attention backend, the vLLM plugin) calls hal's ops
through it:

- on a **host** backend, :attr:`HostRoute.ops` is the backend's front door and :meth:`HostRoute.native`
  views a CPU tensor as a numpy array (no copy). What a caller calls often with the same tensors (a layer's
  weight, a step's block tables, a layer's :class:`~hal_core.AttentionOptions`) it converts once and keeps;
- on a **device** backend, :attr:`HostRoute.ops` is :mod:`hal_core.torch` (``torch.ops.hal``: torch's
  current stream, graph capture, ``torch.compile``) and :meth:`HostRoute.native` returns the tensor itself;
- :meth:`HostRoute.bind` binds arguments a caller gives on every call (a layer's weight) to an op of a host
  backend's front door once (:meth:`Ops.bind <hal_core.ops.Ops.bind>`);
- :meth:`HostRoute.call` is the fast path for eager CPU tensors (:meth:`HostRoute.eager`: a host backend,
  outside a trace, without autograd recording): numpy views in, hal's result array out as a tensor view (no
  ``torch.ops`` dispatch, no copy); anything else (a device, a trace, autograd) goes through the
  ``torch.ops.hal`` operators (:mod:`hal_core.torch`'s functions).

``torch.ops.hal.*`` costs a dispatcher pass and tensor assembly on every call, more than a decode-sized norm
or activation takes: that is what the fast path saves. Its result is the operator's (the same front door,
validation, selection and kernels).
"""

from __future__ import annotations

import sys
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch

from .._backend import Backend
from .._errors import ArgumentError
from ..interop import host_view
from ..ops import BoundOp
from ._convert import to_tensor
from ._routing import backend_for

__all__ = ["HostRoute", "eager_host", "route_for"]


def eager_host(*tensors: torch.Tensor) -> bool:
    """Whether a call on ``tensors`` may take the host route: all on the CPU, no trace, no autograd recording."""
    if torch.compiler.is_compiling():
        return False
    recording = torch.is_grad_enabled()
    return all(t.is_cpu and not (recording and t.requires_grad) for t in tensors)


@dataclass(frozen=True)
class HostRoute:
    """How torch tensors reach ``backend``'s ops (see the module docs); :func:`route_for` gives the one for a tensor."""

    backend: Backend

    @property
    def ops(self) -> Any:
        """What calls go through, with the ops' own signatures (``ops.paged_attention(...)``): the backend's front
        door on a host backend (give it :meth:`native` arrays), :mod:`hal_core.torch` on a device backend."""
        return self.backend.ops if self.backend.is_host else sys.modules["hal_core.torch"]

    def native(self, tensor: torch.Tensor, name: str) -> Any:
        """``tensor`` as :attr:`ops` takes it: a numpy view on a host backend (no copy; ArgumentTypeError naming
        ``name`` for a dtype numpy cannot view), the tensor itself on a device backend."""
        return host_view(tensor, name) if self.backend.is_host else tensor

    def eager(self, *tensors: torch.Tensor) -> bool:
        """Whether a call on ``tensors`` may take :meth:`call`'s fast path: a host backend, and :func:`eager_host`."""
        return self.backend.is_host and eager_host(*tensors)

    def call(self, op: str, args: Mapping[str, Any]) -> torch.Tensor | None:
        """The fast path, for calls where :meth:`eager` is True (the caller checks): run ``op`` on the front door
        with each tensor of ``args`` as a numpy view (mutated in place where the op mutates it) and other values
        unchanged (arrays a caller converted once with :meth:`native`, a weight of numpy views); returns hal's
        result as a tensor view, if any. Where :meth:`eager` is False the caller calls the ``torch.ops.hal``
        operator (:mod:`hal_core.torch`'s function) with the tensors instead."""
        hal_args = {name: host_view(value, name) if isinstance(value, torch.Tensor) else value
                    for name, value in args.items()}
        result = self.backend.ops.call(op, hal_args)
        return None if result is None else to_tensor(result)


    def bind(self, op: str, **fixed: Any) -> BoundOp:
        """``op`` with ``fixed`` bound on a host backend's front door (:meth:`Ops.bind <hal_core.ops.Ops.bind>`):
        what a caller that calls :meth:`call`'s fast path many times with the same arguments (a layer's weight)
        binds once, giving them as :meth:`native` arrays; call it with numpy views (:func:`host_view`) where
        :meth:`eager` is True, as :meth:`call`. ArgumentError on a device backend (its calls take ``torch.ops``)."""
        if not self.backend.is_host:
            raise ArgumentError(f"HostRoute.bind: backend {self.backend.name!r} is not a host backend; call its ops "
                                f"through torch.ops.hal")
        return self.backend.ops.bind(op, **fixed)


#: backend -> its route (one per backend: a route holds nothing else).
_routes: dict[int, HostRoute] = {}


def route_for(tensor: torch.Tensor) -> HostRoute:
    """The route to the hal backend addressing ``tensor``'s memory (:func:`~hal_core.torch.backend_for`)."""
    backend = backend_for(tensor)
    route = _routes.get(id(backend))
    if route is None or route.backend is not backend:
        route = _routes[id(backend)] = HostRoute(backend)
    return route
