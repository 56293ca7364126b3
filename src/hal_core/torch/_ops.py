"""``torch.ops.hal.*``: every hal op as torch operators, generated from the op's declaration.

For each op of :data:`hal_core.ops.OPS` (:func:`register_torch_ops`; hal's own ops when this module
is imported) the operators of :func:`~hal_core.torch._schema.torch_ops` are defined with
:class:`torch.library.Library`, with

- a real implementation that hands the tensors to the hal backend addressing their device
  (:mod:`._routing`, chosen once per device), unchanged: hal converts them without a copy and applies
  its own validation, fallback and strict-mode rules. On a device, outputs are allocated by torch (so a
  CUDA graph's memory pool owns them) and written by hal through ``out=``; on the host, hal's own result
  array is returned as a tensor view (no output copy);
- a fake implementation that checks what a trace can (ranks, the sizes the layouts share, matching
  dtypes: :func:`hal_core.ops._validate.check_shapes`) and returns the declared output's shape and
  dtype, so ``torch.compile`` traces through without a graph break and a CUDA graph captures the
  launches.

The Python functions :func:`paged_attention`, :func:`write_kv_cache`, :func:`quantized_gemm` (and
:func:`wrapper` for any op) take the op's arguments (a quantized weight as its tensor dict from
:func:`~hal_core.torch.weight_to_tensors` followed by ``bits``) and pick the functional or ``_out``
operator.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch

from .._errors import ArgumentError, ArgumentTypeError
from ..interop import host_view
from ..ops import OPS, BoundOp, OpSpec
from ..ops._validate import check_shapes
from ._autograd import refuse_grad_into_out, register_autograd
from ._convert import to_tensor
from ._dtypes import TORCH_DTYPES
from ._routing import backend_for, on_torch_stream
from ._schema import WEIGHT_FIELDS, TorchOp, torch_ops
from ._weights import _weight, host_weight

__all__ = ["gated_activation", "paged_attention", "quantized_gemm", "register_torch_ops", "rms_norm",
           "rotary_embedding", "sample", "wrapper", "write_kv_cache"]

_LIBRARY = torch.library.Library("hal", "FRAGMENT")
_registered: dict[str, OpSpec] = {}
_lock = threading.Lock()


def _op_args(spec: OpSpec, values: Mapping[str, Any], *, fake: bool) -> dict[str, Any]:
    """The op's arguments from an operator's parameters (a weight's tensors joined into one argument)."""
    args = {name: value for name, value in values.items() if name not in WEIGHT_FIELDS}
    for arg in spec.args:
        if arg.is_weight:
            qweight, bits = values["qweight"], values["bits"]
            if fake:  # what a trace can know of the weight: its shape
                if bits not in (4, 8):
                    raise ValueError(f"argument 'bits': expected 4 or 8, got {bits}")
                if qweight.ndim != 2:
                    raise ValueError(f"argument 'qweight': expected 2 dimensions, got shape {tuple(qweight.shape)}")
                rows, n = qweight.shape
                args[arg.name] = SimpleNamespace(shape=(rows * 8 if bits == 4 else rows, n))
            else:
                args[arg.name] = _weight(qweight, values["scales"], values["zeros"], values["g_idx"], bits,
                                         values["group_size"])
    return args


def _host_reader(spec: OpSpec, names: tuple[str, ...]) -> Callable[[tuple[Any, ...]], dict[str, Any]]:
    """A function from an operator's CPU parameters (in ``names`` order) to the op's arguments as numpy views.

    The positions of the arrays, numbers and weight fields are found once per operator; a weight's views
    are built once per set of tensors (:func:`~hal_core.torch._weights.host_weight`).
    """
    arrays = tuple((names.index(name), name) for name in spec.array_names if name in names)
    numbers = tuple((names.index(arg.name), arg.name) for arg in spec.number_args if arg.name in names)
    weight = tuple(names.index(field) for field in WEIGHT_FIELDS) if spec.weight_names else ()

    def read(values: tuple[Any, ...]) -> dict[str, Any]:
        count = len(values)  # trailing defaults are not passed
        args: dict[str, Any] = {}
        for index, name in arrays:
            if index < count and values[index] is not None:
                args[name] = host_view(values[index], name)
        for index, name in numbers:
            if index < count and values[index] is not None:
                args[name] = values[index]
        if weight:
            args[spec.weight_names[0]] = host_weight(*(values[index] for index in weight))
        return args

    return read


#: Bound ops of the weight ops' CPU calls: (id of the host weight, backend, the call's other non-array arguments)
#: -> (that weight, the op bound to it and to them). The weight object is the one :func:`host_weight` returns
#: for the same tensors (built once per set of tensors), kept here so that its id names it alone.
_HOST_BOUND: dict[tuple[Any, ...], tuple[Any, BoundOp]] = {}
#: More entries than any model has quantized layers (times its option sets); beyond it the cache starts over.
_HOST_BOUND_MAX = 4096


def _host_bound_call(spec: OpSpec, backend: Any, args: dict[str, Any]) -> Any:
    """A weight op's CPU call through an op bound to its weight and options (:meth:`Ops.bind
    <hal_core.ops.Ops.bind>`): the same front door, validation and kernels, without re-deriving per call what
    the weight fixes (its planned runner serves the repeated calls)."""
    weight = args.pop(spec.weight_names[0])
    options = tuple(sorted((name, value) for name, value in args.items() if not isinstance(value, np.ndarray)))
    key = (id(weight), id(backend), options)
    found = _HOST_BOUND.get(key)
    if found is None or found[0] is not weight:
        if len(_HOST_BOUND) >= _HOST_BOUND_MAX:
            _HOST_BOUND.clear()
        found = _HOST_BOUND[key] = (weight, backend.ops.bind(spec.name, **{spec.weight_names[0]: weight},
                                                             **dict(options)))
    return found[1](**{name: value for name, value in args.items() if isinstance(value, np.ndarray)})


#: Bound ops with nothing fixed, for the CPU calls of the ops without a weight: (op, id of the backend) -> (that
#: backend, the op bound). The same front door, checks and kernels; a repeated signature (shapes, dtypes, scalar
#: values) skips what its first call derived and runs the implementation's planned runner (:class:`BoundOp`).
_HOST_UNBOUND: dict[tuple[str, int], tuple[Any, BoundOp]] = {}
#: Every op on a few backends; beyond it the cache starts over.
_HOST_UNBOUND_MAX = 256


def _host_call(spec: OpSpec, backend: Any, args: dict[str, Any]) -> Any:
    """An op's CPU call without a weight, through the op bound with nothing fixed (see :data:`_HOST_UNBOUND`)."""
    key = (spec.name, id(backend))
    found = _HOST_UNBOUND.get(key)
    if found is None or found[0] is not backend:
        if len(_HOST_UNBOUND) >= _HOST_UNBOUND_MAX:  # backends of runtimes reset since: never asked for again
            _HOST_UNBOUND.clear()
        found = _HOST_UNBOUND[key] = (backend, backend.ops.bind(spec.name))
    return found[1](**args)


def _lead(spec: OpSpec, args: Mapping[str, Any]) -> torch.Tensor:
    """The first tensor argument given: its device decides the backend."""
    for name in spec.array_names:
        value = args.get(name)
        if value is not None:
            return value
    return args["qweight"]


def _real(op: TorchOp) -> Callable[..., Any]:
    spec, names = op.spec, op.params
    host_args = _host_reader(spec, names)
    # where the lead tensor is: the first array argument given, else the weight's qweight
    leads = tuple(names.index(name) for name in (*spec.array_names, "qweight") if name in names)

    def run(*values: Any) -> Any:
        if op.writes_out:
            refuse_grad_into_out(spec.name, dict(zip(names, values, strict=False)))
        lead = next(values[i] for i in leads if i < len(values) and values[i] is not None)
        backend = backend_for(lead)
        if lead.is_cpu:
            # numpy views of every tensor (a weight's built once per set of tensors): the front door then
            # converts nothing; hal's own result array is handed to torch as a view (no output copy)
            args = host_args(values)
            result = (_host_bound_call(spec, backend, args) if spec.weight_names
                      else _host_call(spec, backend, args))
            return to_tensor(result) if op.returns_tensor else None
        given = dict(zip(names, values, strict=False))  # defaults are not passed
        args = _op_args(spec, given, fake=False)
        out = None
        if op.returns_tensor:
            assert spec.output is not None
            shape = spec.output_shape(args)
            assert shape is not None
            out = torch.empty(shape, dtype=_output_dtype(spec, values, names), device=lead.device)
            args["out"] = out
        with on_torch_stream(backend, lead):
            backend.ops.call(spec.name, args)
        return out

    run.__name__ = op.name
    return run


def _fake(op: TorchOp) -> Callable[..., Any]:
    spec, names = op.spec, op.params

    def fake(*values: Any) -> Any:
        given = dict(zip(names, values, strict=False))
        _one_device(given)
        args = _op_args(spec, given, fake=True)
        check_shapes(spec, args)
        if not op.returns_tensor:
            return None
        assert spec.output is not None
        shape = spec.output_shape(args)
        assert shape is not None
        return _lead(spec, given).new_empty(shape, dtype=_output_dtype(spec, values, names))

    fake.__name__ = f"{op.name}_fake"
    return fake


def _output_dtype(spec: OpSpec, values: tuple[Any, ...], names: tuple[str, ...]) -> torch.dtype:
    """The torch dtype of the op's result: its declared fixed dtype, else that of the argument it follows."""
    assert spec.output is not None
    if spec.output.dtype:
        return TORCH_DTYPES[spec.output.dtype]  # a fixed dtype (``Output(dtype=...)``)
    dtype: torch.dtype = values[names.index(spec.output.dtype_of)].dtype
    return dtype


def _one_device(values: Mapping[str, Any]) -> None:
    """ArgumentError naming the first tensor on another device than the first one given.

    The fake implementation also serves torch's meta device: without this, host tensors mixed with
    meta ones would get an uninitialised host result.
    """
    tensors = [(name, value) for name, value in values.items() if isinstance(value, torch.Tensor)]
    for name, value in tensors[1:]:
        if value.device != tensors[0][1].device:
            raise ArgumentError(f"argument {name!r}: is on {value.device}, argument {tensors[0][0]!r} on "
                                f"{tensors[0][1].device}; hal moves nothing, put every tensor on one device")


def register_torch_ops(spec: OpSpec) -> None:
    """Define ``torch.ops.hal.<op>`` (and ``<op>_out``) for ``spec`` (idempotent per op name)."""
    with _lock:
        if spec.name in _registered:
            return
        for op in torch_ops(spec):
            _LIBRARY.define(f"{op.name}{op.schema}")
            _LIBRARY.impl(op.name, _real(op), "CompositeExplicitAutograd")
            torch.library.register_fake(f"hal::{op.name}", _fake(op), lib=_LIBRARY)
            if not op.writes_out:
                register_autograd(op.name, _LIBRARY)
        _registered[spec.name] = spec


def wrapper(spec: OpSpec) -> Callable[..., Any]:
    """A Python function with the op's signature calling its torch operators (``out=`` picks ``_out``).

    Required arguments are positional, the others keyword-only; a quantized weight is its tensor dict
    followed by ``bits``; an op's group (``paged_attention``'s :class:`~hal_core.ops.AttentionOptions`) may be
    given as ``options=`` instead of its fields (spread into the flat schema). Returns the result tensor (``out``
    when given), or None for in-place ops.
    """
    register_torch_ops(spec)
    ops = {op.writes_out: op for op in torch_ops(spec) if not op.without}
    bare = {op.writes_out: op for op in torch_ops(spec) if op.without}
    params, required, optional = [], [], []
    for arg in spec.args:
        if arg.is_weight:
            params += [arg.name, "bits"]
            required.append(f"*_weight_params({arg.name}, bits)")
        elif arg.required and arg.name != "out":
            params.append(arg.name)
            required.append(arg.name)
    keyword = [arg.name for arg in spec.args if not arg.required]
    optional = [name for name in keyword if name != "out"]
    grouped = spec.group_names()
    group = [] if spec.options is None else [spec.options.name]
    params = [f"{name}=None" if name in grouped else name for name in params]  # the group's value may give them
    signature = ", ".join([*params, *(["*"] if keyword or group else []),
                           *(f"{name}=None" for name in (*keyword, *group))])
    body = [f"def {spec.name}({signature}):"]
    if spec.options is not None:  # the schema is flat: the group's value is spread into its fields
        names = ", ".join(spec.options.names)
        body += [f"    if {spec.options.name} is not None:",
                 f"        {names}, = _spread(_spec, {spec.options.name}, {names})"]
        body += [f"    if {arg.name} is None:\n        _required({arg.name!r})"
                 for arg in spec.options.args if arg.required]
    def calls(writes_out: bool, head: list[str], ret: str) -> list[str]:
        """The body lines calling the operator (its overload without the optional mutated arguments when
        they are all None)."""
        full = ", ".join([*head, *optional])
        op = bare.get(writes_out)
        if op is None:
            return [f"    {ret}_hal.{ops[writes_out].name}({full})"]
        short = ", ".join([*head, *(name for name in optional if name not in op.without)])
        base, overload = op.name.split(".")
        return [f"    if {' and '.join(f'{name} is None' for name in op.without)}:",
                f"        {ret}_hal.{base}.{overload}({short})",
                "    else:",
                f"        {ret}_hal.{ops[writes_out].name}({full})"]

    if spec.output is None:
        body += calls(False, required, "")
    else:
        body += ["    if out is None:", *("    " + line for line in calls(False, required, "return "))]
        body += [*calls(True, [*required, "out"], ""), "    return out"]
    namespace: dict[str, Any] = {"_hal": torch.ops.hal, "_weight_params": _weight_params, "_spread": _spread,
                                 "_spec": spec, "_required": _required}
    exec(compile("\n".join(body) + "\n", f"<hal torch op {spec.name}>", "exec"), namespace)
    function = namespace[spec.name]
    function.__module__ = __name__
    function.__doc__ = (f"{(type(spec).__doc__ or spec.name).strip().splitlines()[0]} "
                        f"(``torch.ops.hal.{spec.name}``; layout: :mod:`{type(spec).__module__}`).")
    return function


def _spread(spec: OpSpec, options: Any, *flat: Any) -> tuple[Any, ...]:
    """The fields of ``spec``'s group value ``options``, in order; ArgumentError naming those also given flat."""
    assert spec.options is not None
    names = spec.options.names
    merged = spec.merge_options(dict(zip(names, flat, strict=True)), options)
    return tuple(merged[name] for name in names)


def _required(name: str) -> None:
    raise ArgumentTypeError(f"argument {name!r} is required")


def _weight_params(weight: Mapping[str, torch.Tensor], bits: int) -> tuple[Any, ...]:
    """A weight's operator parameters from its tensor dict (:func:`~hal_core.torch.weight_to_tensors`)."""
    qweight, scales = weight["qweight"], weight["scales"]
    k = qweight.shape[0] * (8 if bits == 4 else 1)
    group_size = k // scales.shape[0] if scales.shape[0] else 0
    return qweight, scales, weight.get("zeros"), weight.get("g_idx"), bits, group_size


for _spec in OPS.values():
    register_torch_ops(_spec)

#: Attention over a paged KV cache (layout: :mod:`hal_core.ops.paged_attention`).
paged_attention = wrapper(OPS["paged_attention"])
#: Scatter ``key``/``value`` into the caches in place (layout: :mod:`hal_core.ops.write_kv_cache`).
write_kv_cache = wrapper(OPS["write_kv_cache"])
#: ``x [M, K]`` times the quantized weight held as tensors (:func:`~hal_core.torch.weight_to_tensors`).
quantized_gemm = wrapper(OPS["quantized_gemm"])
#: One token per sequence from ``logits`` (int64 ids; layout and semantics: :mod:`hal_core.ops.sample`).
sample = wrapper(OPS["sample"])
#: RMSNorm of each row, after adding ``residual`` (mutated) when given (layout: :mod:`hal_core.ops.rms_norm`).
rms_norm = wrapper(OPS["rms_norm"])
#: ``act(gate) * up`` of a gated MLP (layout: :mod:`hal_core.ops.gated_activation`).
gated_activation = wrapper(OPS["gated_activation"])
#: Rotate ``query`` (and ``key``) in place by their positions (layout: :mod:`hal_core.ops.rotary_embedding`).
rotary_embedding = wrapper(OPS["rotary_embedding"])
