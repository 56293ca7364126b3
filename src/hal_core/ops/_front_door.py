"""The front door's methods: one per op, made from its declaration (like ``collections.namedtuple``)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from ._spec import OpSpec

__all__ = ["front_door", "method_for"]


#: op name -> (the spec, its front door function): rebuilt when another spec takes the name.
_METHODS: dict[str, tuple[OpSpec, Callable[..., Any]]] = {}


def method_for(spec: OpSpec) -> Callable[..., Any]:
    """The :class:`~hal_core.ops.Ops` method of ``spec``: made once, and again when another spec takes its name."""
    made = _METHODS.get(spec.name)
    if made is None or made[0] is not spec:
        made = _METHODS[spec.name] = (spec, front_door(spec))
    return made[1]


def front_door(spec: OpSpec) -> Callable[..., Any]:
    """The :class:`Ops` method of ``spec``: its declared signature, building the argument dict directly.

    Made once per op as source text (like ``collections.namedtuple``), so a call costs one Python
    function call and one dict, and ``help()``/``inspect.signature`` show the op's real arguments.
    """
    params, items = [], []
    keyword_only = False
    grouped = spec.group_names()
    for arg in spec.args:
        if arg.keyword_only and not keyword_only:
            params.append("*")
            keyword_only = True
        params.append(arg.name if arg.required and arg.name not in grouped else f"{arg.name}=None")
        items.append(f"{arg.name!r}: {arg.name}")
    returns = "return " if spec.output is not None else ""
    group = ""
    if spec.options is not None:  # its value, when given, fills the fields (Ops._call)
        params.append(f"{spec.options.name}=None")
        group = f", {spec.options.name}"
    source = (f"def {spec.name}(self, {', '.join(params)}):\n"
              f"    {returns}self._call({spec.name!r}, {{{', '.join(items)}}}{group})\n")
    namespace: dict[str, Any] = {}
    exec(compile(source, f"<hal op {spec.name}>", "exec"), namespace)
    method = namespace[spec.name]
    method.__qualname__ = f"Ops.{spec.name}"
    method.__module__ = "hal_core.ops"  # where Ops is public
    method.__doc__ = _method_doc(spec)
    return method


def _method_doc(spec: OpSpec) -> str:
    summary = (type(spec).__doc__ or spec.name).strip().splitlines()[0]
    lines = [f"{summary} See :mod:`{type(spec).__module__}`.", ""]
    for arg in spec.args:
        what = arg.layout or arg.kind.__name__
        lines.append(f"- ``{arg.name}`` ({arg.role.value}{', optional' if not arg.required else ''}): {what}"
                     + (f" — {arg.doc}" if arg.doc else ""))
    if spec.options is not None:
        group = spec.options
        lines.append(f"- ``{group.name}`` ({group.value_type.__name__}, optional): "
                     f"{', '.join(group.names)} as one value, instead of those keywords")
    return "\n".join(lines)
