"""Sibling projections that read the same input run as one GEMM: :func:`~hal_core.torch.kernelize`'s fusion.

An attention layer's ``q_proj``, ``k_proj`` and ``v_proj`` multiply the same
hidden states (an MLP's ``gate_proj`` and ``up_proj`` too). As three
``QuantLinear`` calls at decode size the two small ones cost more in call
and stream start-up than in bytes (in a 1B-class
model, hidden 2048 and GQA 16/4: 2048 x 512 int4 in about 80 µs from
memory, where the fused 2048 x 3072 GEMV takes 175 µs for all three); an
engine fuses them into one weight. :class:`ProjectionGroup` does the same
inside an unmodified model:

- the members' ``qweight``, ``scales`` and ``zeros`` are concatenated along
  N once, and each member's buffers become views of its columns (no copy
  is kept: the members' old tensors are released; ``state_dict`` still
  holds every member's own tensors, as views, and
  :func:`~hal_core.torch.save_quantized` writes them whole);
- the first member called with an input runs the fused GEMM and returns its
  columns; a sibling called next with the same tensor, unchanged (its
  ``_version``), takes its columns of that result; any other call computes
  again, so results never depend on the order or the number of calls;
- an inference tensor (made under ``torch.inference_mode``) has no version
  counter, so nothing is kept for it: each member's call computes the fused
  GEMM (the lean decoder layers make one fused call and are unaffected);
- outside eager host calls (autograd recording, ``torch.compile``, a device
  tensor) each member's call runs ``torch.ops.hal.quantized_gemm`` on the
  fused weight and takes its columns (correct, and as many GEMMs as calls);
- the group dissolves itself (every member gets its own contiguous copy of
  its columns back and its class ``forward``) when a member's buffer is
  replaced (``.to(device)``, ``load_state_dict(assign=True)``) or the
  members' ``activations`` differ; a common new ``activations`` is simply
  bound again.

Each member's bias is its own, added to its columns.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import torch

from ..interop import host_view
from ..ops import BoundOp
from ._convert import to_tensor
from ._host import HostRoute, eager_host, route_for
from ._modules import QuantLinear
from ._weights import _weight

__all__ = ["SIBLINGS", "ProjectionGroup", "fuse_siblings"]

#: Names of projections that read the same input, fused where a module holds all of them.
SIBLINGS: tuple[tuple[str, ...], ...] = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
_FUSED = ("qweight", "scales", "zeros")


def _format(layer: QuantLinear) -> tuple[Any, ...]:
    zeros = layer._buffers.get("zeros")
    return (layer.in_features, layer.bits, layer.group_size, layer.scales.dtype, zeros is None, layer.qweight.dtype,
            layer.qweight.device, layer.activations)


def fusion_problem(layers: Sequence[Any]) -> str | None:
    """Why ``layers`` cannot be fused (None when they can): each must be a ``QuantLinear`` on the CPU, unfused,
    without act-order, and all of one format (K, bits, group size, scale dtype, zero points, activations)."""
    for layer in layers:
        if not isinstance(layer, QuantLinear):
            return f"{type(layer).__name__} is not a QuantLinear"
        if getattr(layer, "_hal_group", None) is not None:
            return "already fused"
        if layer._buffers.get("g_idx") is not None:
            return "act-order weights (g_idx) are not fused"
        if layer.qweight.device.type != "cpu":
            return f"on {layer.qweight.device}, not the CPU"
    formats = {_format(layer) for layer in layers}
    if len(formats) != 1:
        return "the projections differ in format (in_features, bits, group size, scales, zeros or activations)"
    return None


class ProjectionGroup:
    """Projections of one input fused into one GEMM (see the module docs); :func:`fuse_siblings` makes them."""

    def __init__(self, members: Sequence[QuantLinear]) -> None:
        self.members = list(members)
        first = self.members[0]
        self.bits, self.group_size, self.activations = first.bits, first.group_size, first.activations
        #: The fused buffers (concatenated along N), and each member's column range.
        self.fused: dict[str, torch.Tensor | None] = {
            key: None if first._buffers.get(key) is None
            else torch.cat([m._buffers[key] for m in self.members], dim=1)  # type: ignore[misc]
            for key in _FUSED}
        self.columns: list[tuple[int, int]] = []
        start = 0
        for member in self.members:
            self.columns.append((start, start + member.out_features))
            start += member.out_features
        #: Each member's buffer views (what :meth:`intact` compares by identity).
        self.views: list[dict[str, torch.Tensor]] = []
        for member, (lo, hi) in zip(self.members, self.columns, strict=True):
            views = {key: fused[:, lo:hi] for key, fused in self.fused.items() if fused is not None}
            for key, view in views.items():
                member._buffers[key] = view
            member._host_weight = None
            self.views.append(views)
        self.sizes = [hi - lo for lo, hi in self.columns]
        self._bound: tuple[Any, str | None, BoundOp] | None = None
        #: The last fused result kept for the siblings: (input, its _version, each member's output or None once
        #: taken, [how many are left]).
        self._stash: tuple[torch.Tensor, int, list[torch.Tensor | None], list[int]] | None = None

    # -- state -------------------------------------------------------------------

    def intact(self) -> bool:
        """Whether every member still holds its views and all share one ``activations`` (rebinding on a common
        change)."""
        for member, views in zip(self.members, self.views, strict=True):
            buffers = member._buffers
            for key, view in views.items():
                if buffers.get(key) is not view:
                    return False
        activations = {m.activations for m in self.members}
        if len(activations) != 1:
            return False
        self.activations = next(iter(activations))
        return True

    def dissolve(self) -> None:
        """Give every member its own contiguous columns and its class ``forward`` back; the fused tensors go."""
        for member, views in zip(self.members, self.views, strict=True):
            for key, view in views.items():
                if member._buffers.get(key) is view:
                    member._buffers[key] = view.contiguous()
            member._host_weight = None
            member.__dict__.pop("forward", None)
            member.__dict__.pop("_hal_group", None)
        self.members, self.views, self.fused, self._bound, self._stash = [], [], {}, None, None

    # -- calls -------------------------------------------------------------------

    def _fused_host(self, rows: torch.Tensor) -> torch.Tensor:
        return to_tensor(self.host_bound(route_for(rows))(x=host_view(rows, "x")))

    def host_bound(self, route: HostRoute) -> BoundOp:
        """The fused GEMM bound on ``route`` (made again when the route's backend or ``activations`` changed); call
        it with ``x=`` a numpy view of ``[M, K]``: it returns ``[M, sum of the members' out_features]``, no bias."""
        bound = self._bound
        if bound is None or bound[0] is not route.backend or bound[1] != self.activations:
            qweight, scales, zeros = (None if tensor is None else route.native(tensor, key)
                                      for key, tensor in ((key, self.fused[key]) for key in _FUSED))
            fixed: dict[str, Any] = {"qweight": _weight(qweight, scales, zeros, None, self.bits, self.group_size)}
            if self.activations is not None:
                fixed["activations"] = self.activations
            bound = self._bound = (route.backend, self.activations, route.bind("quantized_gemm", **fixed))
        return bound[2]

    def _fused_op(self, rows: torch.Tensor) -> torch.Tensor:
        fused = self.fused
        return torch.ops.hal.quantized_gemm(rows, fused["qweight"], fused["scales"], fused["zeros"], None, self.bits,
                                            self.group_size, self.activations)

    def outputs(self, x: torch.Tensor, host: bool) -> list[torch.Tensor | None]:
        """Every member's ``[..., out_features]`` for input ``x`` (checked by the caller), biases added: one fused
        GEMM (``host``: the eager host route, else ``torch.ops.hal``), its columns split as views."""
        rows = (x if x.dim() == 2 else x.reshape(-1, x.shape[-1])).contiguous()
        y = self._fused_host(rows) if host else self._fused_op(rows)
        if x.dim() != 2:
            y = y.view(*x.shape[:-1], y.shape[-1])
        outs: list[torch.Tensor | None] = list(y.split(self.sizes, -1))
        for i, member in enumerate(self.members):
            if member.bias is not None:
                outs[i] = outs[i] + member.bias.to(y.dtype)  # type: ignore[operator]
        return outs

    def take(self, index: int, x: torch.Tensor) -> torch.Tensor | None:
        """Member ``index``'s output for ``x`` kept from the last fused GEMM, when that GEMM read this same tensor,
        unchanged since, and the member still holds its views and the group's ``activations``; None otherwise."""
        stash = self._stash
        if stash is None or stash[0] is not x or stash[1] != x._version:
            return None
        out = stash[2][index]
        if out is None or self.members[index].activations != self.activations:
            return None
        buffers = self.members[index]._buffers
        if any(buffers.get(key) is not view for key, view in self.views[index].items()):
            return None
        stash[2][index] = None
        stash[3][0] -= 1
        if not stash[3][0]:
            self._stash = None
        return out

    def compute(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output for ``x``: one fused GEMM; on the eager host path the siblings' columns are kept
        for their calls on the same tensor (:meth:`take`)."""
        host = eager_host(x)
        outs = self.outputs(x, host)
        out = outs[index]
        assert out is not None
        self._stash = None
        if host and not x.is_inference():  # an inference tensor has no version to tell a later write by
            outs[index] = None
            self._stash = (x, x._version, outs, [len(outs) - 1])
        return out


def _member_forward(group: ProjectionGroup, index: int, member: QuantLinear) -> Callable[[torch.Tensor], Any]:
    def forward(x: torch.Tensor) -> torch.Tensor:
        taken = group.take(index, x)
        if taken is not None:
            return taken
        if not group.intact():
            group.dissolve()
            return member(x)
        member._check_input(x)
        return group.compute(index, x)

    return forward


def fuse_siblings(module: torch.nn.Module) -> tuple[list[str], str | None]:
    """Fuse ``module``'s sibling projections (:data:`SIBLINGS`) where it holds a full set: the names fused, and why
    a set it holds was not (None when nothing was refused)."""
    for names in SIBLINGS:
        layers = [getattr(module, name, None) for name in names]
        if any(layer is None for layer in layers):
            continue
        problem = fusion_problem(layers)
        if problem is not None:
            return [], f"{'+'.join(names)} kept apart: {problem}"
        group = ProjectionGroup(layers)  # type: ignore[arg-type]
        for index, layer in enumerate(group.members):
            layer.__dict__["forward"] = _member_forward(group, index, layer)
            layer.__dict__["_hal_group"] = group
        return list(names), None
    return [], None
