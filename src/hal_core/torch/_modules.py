"""``QuantLinear``: a ``torch.nn.Module`` linear layer whose weight is hal's quantized format.

The layer holds a :class:`~hal_core.quant.QuantizedWeight` ``[K, N]``
(``K = in_features``, ``N = out_features``) as buffers, exactly the tensors
of :func:`~hal_core.torch.weight_to_tensors` (no float copy of the weight
ever exists), and computes ``y = x @ W + bias`` with
``torch.ops.hal.quantized_gemm`` on the hal backend that owns ``x``'s
device:

==========  =========================================  =====================================
buffer      int4 (``bits=4``, W4A16)                    int8 (``bits=8``, W8A8)
==========  =========================================  =====================================
qweight     int32 ``[K/8, N]`` (hal's uint32 bits)      uint8 ``[K, N]``
scales      fp16/bf16/fp32 ``[K/G, N]``                 same
zeros       uint8 ``[K/G, N]``; None when symmetric     same
g_idx       int32 ``[K]``; None unless act-order        same
bias        a parameter ``[N]`` or None                 same
==========  =========================================  =====================================

``state_dict`` holds exactly these (None ones left out), so it saves and
loads with ``torch.save`` or safetensors; loading checks every dtype (a
cast would change the format's bits), shape and the presence of zero points
and ``g_idx``, and loads nothing of the layer when one does not fit.
``.to(dtype)`` / ``.half()`` change the bias only: the scales keep their
dtype (hal's format), and the output has the input's dtype.
"""

from __future__ import annotations

from operator import is_not
from typing import Any

import torch

from ..arrays import numpy_dtype
from ..interop import host_view
from ..ops import BoundOp
from ..ops.quantized_gemm import ACTIVATIONS
from ..quant import QuantizedWeight, quantize
from ..quant._args import as_bool, as_int
from ._convert import to_tensor
from ._dtypes import FLOAT_DTYPE_NAMES
from ._host import HostRoute, route_for
from ._input_checks import check_activation
from ._weights import _weight, weight_to_tensors

__all__ = ["QuantLinear"]

#: torch dtype of each scale dtype hal reads, to the numpy dtype ``quantize`` takes.
_SCALE_DTYPES = {dtype: numpy_dtype(name) for dtype, name in FLOAT_DTYPE_NAMES.items()}
_BUFFERS = ("qweight", "scales", "zeros", "g_idx")


def check_activations(activations: str | None) -> str | None:
    """``activations`` checked: None or ``"float"`` (W4A16), ``"int8"`` (W4A8 for int4 weights; int8 weights are
    W8A8 either way) or ``"auto"`` (the backend's choice by the number of rows), else a ``ValueError`` naming
    the argument."""
    if activations is not None and activations not in ACTIVATIONS:
        raise ValueError(f"argument 'activations': expected None, 'float', 'int8' or 'auto', got {activations!r}")
    return activations


def resolve_group_size(group_size: Any, in_features: int) -> int:
    """``group_size`` as a positive divisor of ``in_features``; ``-1`` means one group over all of K."""
    group_size = as_int("group_size", group_size)
    if group_size == -1:
        return in_features
    if group_size <= 0 or in_features % group_size:
        raise ValueError(f"argument 'group_size': expected a positive divisor of in_features={in_features} "
                         f"(or -1 for one group), got {group_size}")
    return group_size


class QuantLinear(torch.nn.Module):
    """``y = x @ W + bias`` for a group-wise quantized ``W [in_features, out_features]`` (see the module docs).

    The constructor makes an empty layer of a given format (all-zero
    scales: the weight is zero until a ``state_dict`` is loaded), e.g. on
    ``device="meta"`` to load with ``load_state_dict(..., assign=True)``.
    :meth:`from_linear` quantizes an ``nn.Linear``; :meth:`from_weight`
    wraps a :class:`~hal_core.quant.QuantizedWeight` (from
    :func:`~hal_core.quant.quantize`, :func:`~hal_core.quant.from_gptq` or
    :func:`~hal_core.quant.from_awq`).

    ``forward`` takes ``x [..., in_features]`` in fp16, bf16 or fp32 and
    returns ``[..., out_features]`` in ``x``'s dtype; any leading batch
    dimensions are flattened into the GEMM's M. W4A16 (``bits=4``) keeps
    the activations in floating point; W8A8 (``bits=8``) quantizes them per
    token (docs/quantization.md); ``activations="int8"`` runs an int4 layer as
    W4A8, its activations quantized per token to int8 for integer dot products. It compiles with
    ``torch.compile(fullgraph=True)``: the GEMM is one opaque custom op.

    Gradients flow to ``x`` (``dL/dx = dL/dy @ W^T``, see
    :mod:`hal_core.torch._autograd`) and to the bias when it requires grad;
    the quantized weight is frozen and has none. A wrong input (last
    dimension, dtype, device) is an ``ArgumentError`` /
    ``ArgumentTypeError`` naming ``'x'`` and the layer (its ``name``, the
    qualified name in its model, when given).
    """

    qweight: torch.Tensor
    scales: torch.Tensor
    zeros: torch.Tensor | None
    g_idx: torch.Tensor | None
    bias: torch.nn.Parameter | None

    def __init__(self, in_features: int, out_features: int, bias: bool = True, *, bits: int = 4,
                 group_size: int = 128, symmetric: bool = True, act_order: bool = False,
                 scale_dtype: torch.dtype = torch.float16, bias_dtype: torch.dtype = torch.float32,
                 device: torch.device | str | None = None, name: str | None = None,
                 activations: str | None = None) -> None:
        super().__init__()
        if name is not None and not isinstance(name, str):
            raise TypeError(f"argument 'name': expected the layer's qualified name (a str) or None, "
                            f"got {type(name).__name__}")
        #: The layer's qualified name in its model (the ``name`` argument), used in errors; None when unknown.
        self.name = name
        #: quantized_gemm's ``activations`` for every call (None / ``"float"``: W4A16; ``"int8"``: W4A8).
        self.activations = check_activations(activations)
        #: (the buffers, hal's weight over their numpy views): eager CPU calls reuse it (:meth:`_host_gemm`).
        self._host_weight: tuple[tuple[Any, ...], BoundOp, str | None] | None = None
        in_features, out_features = as_int("in_features", in_features), as_int("out_features", out_features)
        bits = as_int("bits", bits)
        if in_features <= 0 or out_features <= 0:
            raise ValueError(f"arguments 'in_features', 'out_features': expected positive sizes, "
                             f"got {in_features} and {out_features}")
        if bits not in (4, 8):
            raise ValueError(f"argument 'bits': expected 4 or 8, got {bits}")
        if bits == 4 and in_features % 8:
            raise ValueError(f"argument 'in_features': int4 packs 8 rows per word, so it must be a multiple "
                             f"of 8, got {in_features}")
        group_size = resolve_group_size(group_size, in_features)
        symmetric = bool(as_bool("symmetric", symmetric))
        act_order = bool(as_bool("act_order", act_order))
        if scale_dtype not in _SCALE_DTYPES:
            raise TypeError(f"argument 'scale_dtype': expected torch.float16, torch.bfloat16 or torch.float32, "
                            f"got {scale_dtype}")
        self.in_features, self.out_features = in_features, out_features
        self.bits, self.group_size = bits, group_size
        k, n, groups = in_features, out_features, in_features // group_size
        packed = (k // 8, n) if bits == 4 else (k, n)
        self.register_buffer("qweight", torch.zeros(packed, dtype=torch.int32 if bits == 4 else torch.uint8,
                                                    device=device))
        self.register_buffer("scales", torch.zeros((groups, n), dtype=scale_dtype, device=device))
        zeros = None if symmetric else torch.full((groups, n), 1 << (bits - 1), dtype=torch.uint8, device=device)
        self.register_buffer("zeros", zeros)
        g_idx = None
        if act_order:
            g_idx = torch.div(torch.arange(k, device=device), group_size, rounding_mode="floor").to(torch.int32)
        self.register_buffer("g_idx", g_idx)
        self.bias = torch.nn.Parameter(torch.zeros(n, dtype=bias_dtype, device=device),
                                       requires_grad=False) if bias else None

    # -- making one -------------------------------------------------------------

    @classmethod
    def from_weight(cls, weight: QuantizedWeight, bias: torch.Tensor | None = None, *,
                    device: torch.device | str | None = None, name: str | None = None,
                    activations: str | None = None) -> QuantLinear:
        """The layer holding ``weight`` (its arrays viewed, not copied, when they stay on the host).

        ``bias`` (``[out_features]``, any float dtype) is kept as given;
        ``device`` moves everything there (default: where the arrays are);
        ``name`` is the layer's qualified name in its model, for errors;
        ``activations`` the precision of the activations in every call
        (None or ``"float"``: W4A16; ``"int8"``: W4A8, docs/quantization.md).
        """
        if not isinstance(weight, QuantizedWeight):
            raise TypeError(f"argument 'weight': expected a hal_core.quant.QuantizedWeight, "
                            f"got {type(weight).__name__}")
        k, n = weight.shape
        if bias is not None and (not isinstance(bias, torch.Tensor) or tuple(bias.shape) != (n,)
                                 or not bias.is_floating_point()):
            raise ValueError(f"argument 'bias': expected a float tensor of shape ({n},), got "
                             f"{getattr(bias, 'dtype', type(bias).__name__)} {tuple(getattr(bias, 'shape', ()))}")
        tensors = weight_to_tensors(weight, device)
        scales = tensors["scales"]
        layer = cls(k, n, bias is not None, bits=weight.bits, group_size=weight.group_size,
                    symmetric=weight.zeros is None, act_order=weight.g_idx is not None,
                    scale_dtype=scales.dtype, device="meta", name=name, activations=activations)
        for field, tensor in tensors.items():
            layer._buffers[field] = tensor
        if bias is not None:
            layer.bias = torch.nn.Parameter(bias.detach().to(scales.device), requires_grad=False)
        return layer

    @classmethod
    def from_linear(cls, linear: torch.nn.Linear, *, bits: int = 4, group_size: int = 128, symmetric: bool = True,
                    scale_dtype: torch.dtype = torch.float16, name: str | None = None,
                    activations: str | None = None) -> QuantLinear:
        """Quantize ``linear`` with :func:`hal_core.quant.quantize` (on the host) into a new layer.

        The layer is on ``linear``'s device, its bias a copy of ``linear``'s;
        ``linear`` is left as it was; ``name`` and ``activations`` as in :meth:`from_weight`.
        ``group_size=-1`` makes one group of all ``in_features`` rows. The
        float weight is read once (its float64 copy on the host is the only
        transient, one layer's worth).
        """
        if not isinstance(linear, torch.nn.Linear):
            raise TypeError(f"argument 'linear': expected a torch.nn.Linear, got {type(linear).__name__}")
        if linear.weight.device.type == "meta":
            raise ValueError("argument 'linear': its weight is on the meta device (no values to quantize); "
                             "construct QuantLinear(...) and load a state_dict instead")
        if scale_dtype not in _SCALE_DTYPES:
            raise TypeError(f"argument 'scale_dtype': expected torch.float16, torch.bfloat16 or torch.float32, "
                            f"got {scale_dtype}")
        group_size = resolve_group_size(group_size, linear.in_features)
        weight = quantize(linear.weight.detach().T, bits=bits, group_size=group_size, symmetric=symmetric,
                          scale_dtype=_SCALE_DTYPES[scale_dtype])
        bias = None if linear.bias is None else linear.bias.detach().clone()
        return cls.from_weight(weight, bias, device=linear.weight.device, name=name, activations=activations)

    # -- using it ---------------------------------------------------------------

    def quantized_weight(self) -> QuantizedWeight:
        """hal's :class:`~hal_core.quant.QuantizedWeight` over this layer's buffers (views, no copy)."""
        return _weight(self.qweight, self.scales, self.zeros, self.g_idx, self.bits, self.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x [..., in_features]`` (fp16/bf16/fp32, on the weight's device) -> ``[..., out_features]``.

        Without grad (``torch.no_grad()``, ``inference_mode``, or no input requiring it) a CPU call
        goes straight to hal; otherwise the call is ``torch.ops.hal.quantized_gemm``, whose backward
        gives ``x`` its gradient (the weight is frozen) and the bias its own when it requires grad.
        """
        self._check_input(x)
        flat = x.dim() == 2  # already [M, K]: no reshape in, no view out
        rows = x.contiguous() if flat else x.reshape(-1, self.in_features).contiguous()
        if (rows.is_cpu and not torch.compiler.is_compiling()
                and not (rows.requires_grad and torch.is_grad_enabled())):
            y = self._host_gemm(rows)
        else:
            y = torch.ops.hal.quantized_gemm(rows, self.qweight, self.scales, self.zeros, self.g_idx, self.bits,
                                             self.group_size, self.activations)
        if not flat:
            y = y.view(*x.shape[:-1], self.out_features)
        if self.bias is not None:
            y = y + self.bias.to(y.dtype)
        return y

    def _describe(self) -> str:
        """How errors name this layer: its qualified name when known, else its shape."""
        shape = f"in_features={self.in_features}, out_features={self.out_features}"
        return f"QuantLinear {self.name!r} ({shape})" if self.name else f"QuantLinear({shape})"

    def _check_input(self, x: torch.Tensor) -> None:
        """ArgumentError / ArgumentTypeError naming ``x`` and this layer, before any work."""
        check_activation(x, "x", self._describe, self.in_features, self._buffers["qweight"],  # type: ignore[arg-type]
                         "the layer's weight")

    def _host_gemm(self, rows: torch.Tensor) -> torch.Tensor:
        """Eager CPU calls go to the host backend's front door through an op bound to this layer's weight
        (:meth:`Ops.bind <hal_core.ops.Ops.bind>`), made once from the buffers' numpy views.

        The result is what ``torch.ops.hal.quantized_gemm`` computes (the same front door, validation,
        fallbacks and kernels) without its per-call dispatch and weight assembly, which cost more than a
        decode-sized kernel. The bound op is made again whenever a buffer is replaced (``.to()``,
        ``load_state_dict`` with ``assign``), the layer's ``activations`` or the tensor's backend changes;
        in-place changes to a buffer reach it, its arrays being views. hal's result is a new array the kernel
        just wrote, handed to torch as a view (no output tensor, no copy).
        """
        return to_tensor(self._host_bound(route_for(rows))(x=host_view(rows, "x")))

    def _host_bound(self, route: HostRoute) -> BoundOp:
        """The op bound to this layer's weight on ``route`` (see :meth:`_host_gemm`), made again when a buffer, the
        ``activations`` or the route's backend changed; call it with ``x=`` a numpy view of ``[M, in_features]``."""
        found = self._buffers
        buffers = (found["qweight"], found["scales"], found.get("zeros"), found.get("g_idx"))
        cached = self._host_weight
        if (cached is None or cached[1].backend is not route.backend or cached[2] != self.activations
                or any(map(is_not, cached[0], buffers))):
            qweight, scales, zeros, g_idx = (None if t is None else route.native(t, name)
                                             for name, t in zip(_BUFFERS, buffers, strict=True))
            weight = _weight(qweight, scales, zeros, g_idx, self.bits, self.group_size)
            fixed: dict[str, Any] = {"qweight": weight}
            if self.activations is not None:
                fixed["activations"] = self.activations
            cached = self._host_weight = (buffers, route.bind("quantized_gemm", **fixed), self.activations)
        return cached[1]

    def extra_repr(self) -> str:
        kind = "symmetric" if self.zeros is None else "zero points"
        return (f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
                f"int{self.bits}, group_size={self.group_size}, {kind}"
                f"{', act-order' if self.g_idx is not None else ''}, scales={self.scales.dtype}"
                f"{f', activations={self.activations}' if self.activations else ''}")

    # -- keeping the format exact -------------------------------------------------

    def _apply(self, fn: Any, recurse: bool = True) -> QuantLinear:
        """Moves follow ``fn``; dtype casts reach the bias only (the scales' dtype is part of the format)."""
        scales = self._buffers["scales"]
        super()._apply(fn, recurse)
        moved = self._buffers["scales"]
        if moved is not None and scales is not None and moved.dtype != scales.dtype:
            self._buffers["scales"] = scales.to(moved.device)
        return self

    def _load_from_state_dict(self, state_dict: Any, prefix: str, local_metadata: Any, strict: bool,
                              missing_keys: list[str], unexpected_keys: list[str], error_msgs: list[str]) -> None:
        """Load nothing of this layer unless every tensor given fits its format (dtype, shape, zeros / g_idx)."""
        problems = self._state_dict_problems(state_dict, prefix)
        if problems:
            error_msgs.extend(problems)
            return
        super()._load_from_state_dict(state_dict, prefix, local_metadata, strict, missing_keys, unexpected_keys,
                                      error_msgs)

    def _state_dict_problems(self, state_dict: Any, prefix: str) -> list[str]:
        """What keeps ``state_dict``'s tensors for this layer from loading, each naming its key."""
        problems = []
        holds_weight = isinstance(state_dict.get(prefix + "qweight"), torch.Tensor)
        for name in (*_BUFFERS, "bias"):
            key, mine, given = prefix + name, getattr(self, name), state_dict.get(prefix + name)
            if mine is None and holds_weight and isinstance(given, torch.Tensor):
                what = "zero points" if name == "zeros" else "act-order g_idx" if name == "g_idx" else "a bias"
                problems.append(f"QuantLinear {key!r}: the checkpoint holds {what}, this layer has none; build "
                                f"the layer with the saved format (symmetric=False / act_order=True / bias=True)")
            elif mine is not None and holds_weight and given is None and name in ("zeros", "g_idx"):
                problems.append(f"QuantLinear {key!r}: this layer has {name} but the checkpoint does not; build "
                                f"the layer with the saved format (symmetric / act_order)")
            if mine is None or not isinstance(given, torch.Tensor):
                continue
            if name != "bias" and given.dtype != mine.dtype:
                problems.append(f"QuantLinear {key!r}: the checkpoint holds {given.dtype}, this layer {mine.dtype}; "
                                f"hal's format is not cast (build the layer with the saved bits / scale_dtype)")
            elif given.shape != mine.shape:
                problems.append(f"QuantLinear {key!r}: the checkpoint holds shape {tuple(given.shape)}, this layer "
                                f"({self.extra_repr()}) expects {tuple(mine.shape)}")
        return problems
