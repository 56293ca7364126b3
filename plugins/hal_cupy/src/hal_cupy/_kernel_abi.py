"""The GPU kernels' parameter lists, declared once in Python (:mod:`hal_cupy._kernel_params`) and used twice.

A kernel takes its parameters by value and in order (CuPy's ``RawKernel``
passes a tuple).  Each entry point's list is declared once as
``(name, C type)`` fields; from it

* the host fills the argument tuple **by name** (:func:`pack`): every field
  must be given, nothing else may be, and each value is converted to (or
  checked against) the field's C type -- ``int`` to ``np.int32``,
  ``hal_i64``/``long long`` to ``np.int64``, ``float`` to ``np.float32``
  (an integer outside the type's range is refused, never wrapped), a
  pointer from an array or ``None`` (null), an array of a fixed-width
  element type checked for its element size;
* the kernel source is checked against it when it loads
  (:func:`check_source`, from :func:`hal_cupy.kernel_source`): the
  ``HAL_GLOBAL`` signature of every entry point (each one where conditional
  builds repeat it) is read from the translation unit, a parameter that is
  an object-like macro (``HAL_PA_PARAMS``) expanded, ``HAL_RESTRICT``
  dropped and the spacing normalised; a list that differs from the
  declaration in length, a name or a type -- a stale declaration or an
  edited source -- is refused with a :class:`~hal_core.KernelCompileError`
  naming the kernel, the first differing field and both layouts, before
  anything is compiled.

:mod:`hal_cupy._kernel_params` holds the declarations and binds both
functions to them; a test keeps the ``kernels/README.md`` parameter tables
equal to the declarations.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Any

import numpy as np

from hal_core import KernelCompileError
from hal_core.arrays import untag

__all__ = ["Field", "check_source", "fields", "layout", "pack", "signatures"]

#: One parameter: its name and its C type as the source spells it, without ``HAL_RESTRICT`` (``const hal_t*``).
Field = tuple[str, str]

_SCALARS: dict[str, tuple[type, int, int]] = {
    "int": (np.int32, -(1 << 31), (1 << 31) - 1),
    "hal_i64": (np.int64, -(1 << 63), (1 << 63) - 1),
    "long long": (np.int64, -(1 << 63), (1 << 63) - 1),
}
#: Element sizes of the fixed-width pointer types (``hal_t``, ``void`` and the define-selected types are unchecked).
_ELEMENT_BYTES = {"int": 4, "float": 4, "hal_i64": 8, "long long": 8, "hal_u32": 4, "hal_u16": 2, "hal_u8": 1,
                  "hal_i8": 1}


def fields(*items: Field) -> tuple[Field, ...]:
    """A parameter list from ``(name, C type)`` pairs (names unique; the C type spelled as in the source)."""
    names = [name for name, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"duplicate parameter names in {names}")
    return tuple((name, _normal_type(ctype)) for name, ctype in items)


def layout(params: Iterable[Field]) -> str:
    """A readable one-line layout: ``type name, type name, ...``."""
    return ", ".join(f"{ctype} {name}" for name, ctype in params)


def _convert(kernel: str, name: str, ctype: str, value: Any) -> Any:
    if ctype.endswith("*"):
        if value is None:
            return None
        storage = untag(value)
        if not hasattr(storage, "dtype"):
            raise TypeError(f"kernel {kernel!r}: parameter {name!r} ({ctype}) takes an array or None, "
                            f"got {type(value).__name__}")
        want = _ELEMENT_BYTES.get(ctype.removeprefix("const ").removesuffix("*"))
        if want is not None and storage.dtype.itemsize != want:
            raise TypeError(f"kernel {kernel!r}: parameter {name!r} ({ctype}) takes {want}-byte elements, "
                            f"got {storage.dtype}")
        return value
    if ctype == "float":
        if isinstance(value, (bool, np.bool_)) or not isinstance(value, (int, float, np.integer, np.floating)):
            raise TypeError(f"kernel {kernel!r}: parameter {name!r} (float) takes a number, got {type(value).__name__}")
        return np.float32(value)
    scalar = _SCALARS.get(ctype)
    if scalar is None:
        raise TypeError(f"kernel {kernel!r}: parameter {name!r} has a C type {ctype!r} the host cannot pass")
    kind, low, high = scalar
    if not isinstance(value, (int, np.integer)) or isinstance(value, (bool, np.bool_)):
        raise TypeError(f"kernel {kernel!r}: parameter {name!r} ({ctype}) takes an integer, got {type(value).__name__}")
    if not low <= int(value) <= high:
        raise OverflowError(f"kernel {kernel!r}: parameter {name!r} = {int(value)} does not fit {ctype}")
    return kind(int(value))


def pack(kernel: str, values: Mapping[str, Any], declarations: Mapping[str, tuple[Field, ...]]) -> tuple[Any, ...]:
    """The argument tuple of ``kernel`` (declared in ``declarations``) from ``values`` by field name, each value in
    its field's C type.  Every declared field must be in ``values`` and nothing else."""
    params = _declaration(kernel, declarations)
    missing = [name for name, _ in params if name not in values]
    extra = sorted(set(values) - {name for name, _ in params})
    if missing or extra:
        raise TypeError(f"kernel {kernel!r}: arguments do not match its parameters "
                        f"(missing {missing}, unknown {extra}); declared: {layout(params)}")
    return tuple(_convert(kernel, name, ctype, values[name]) for name, ctype in params)


def _declaration(kernel: str, declarations: Mapping[str, tuple[Field, ...]]) -> tuple[Field, ...]:
    try:
        return declarations[kernel]
    except KeyError:
        raise KeyError(f"kernel {kernel!r} has no declared parameter list (hal_cupy/_kernel_params.py)") from None


# -- reading the source ---------------------------------------------------------------------------------------

_COMMENTS = re.compile(r"//[^\n]*|/\*.*?\*/", re.S)
_DEFINE = re.compile(r"^[ \t]*#[ \t]*define[ \t]+([A-Za-z_]\w*)[ \t]+(.*)$", re.M)
_KERNEL = re.compile(r"\bHAL_GLOBAL\s+void\b(?:[^;{}]*?)\b([a-z_][a-z0-9_]*)\s*\(")


def _normal_type(text: str) -> str:
    text = re.sub(r"\b(HAL_RESTRICT|__restrict__)\b", " ", text)
    text = re.sub(r"\s*\*\s*", "*", " ".join(text.split()))
    return text.strip()


def _split_param(text: str) -> Field:
    found = re.fullmatch(r"(.*?)([A-Za-z_]\w*)", _normal_type(text))
    if found is None or not found.group(1).strip():
        raise ValueError(f"cannot read the kernel parameter {text.strip()!r}")
    return found.group(2), _normal_type(found.group(1))


def _body(code: str, start: int) -> str:
    """The text between the parenthesis before ``start`` and its match."""
    depth, i = 1, start
    while depth:
        depth += {"(": 1, ")": -1}.get(code[i], 0)
        i += 1
    return code[start:i - 1]


def signatures(code: str) -> dict[str, list[tuple[Field, ...]]]:
    """Every ``HAL_GLOBAL`` entry point's parameter lists in a translation unit (one per definition: a kernel
    defined under ``#if`` / ``#else`` is listed once per branch)."""
    code = _COMMENTS.sub("", code.replace("\\\n", " "))
    macros = {name: body.strip() for name, body in _DEFINE.findall(code)}
    directives = re.sub(r"^[ \t]*#[^\n]*$", "", code, flags=re.M)
    # A definition is the name after ``HAL_GLOBAL void`` (and its launch bounds), or the same name at the start
    # of a line (a conditional build's second definition under the same ``HAL_GLOBAL void``).
    names = {match.group(1) for match in _KERNEL.finditer(directives)}
    found: dict[str, list[tuple[Field, ...]]] = {}
    for name in sorted(names):
        starts = {m.end() for m in _KERNEL.finditer(directives) if m.group(1) == name}
        starts |= {m.end() for m in re.finditer(rf"(?m)^[ \t]*{name}\s*\(", directives)}
        for start in sorted(starts):
            items: list[str] = []
            for item in _body(directives, start).split(","):
                key = item.strip()
                items += macros[key].split(",") if key in macros else [item]
            found.setdefault(name, []).append(tuple(_split_param(item) for item in items))
    return found


def _difference(declared: tuple[Field, ...], source: tuple[Field, ...]) -> str:
    for index, (want, got) in enumerate(zip(declared, source, strict=False)):
        if want != got:
            return f"parameter {index}: declared '{want[1]} {want[0]}', the source has '{got[1]} {got[0]}'"
    longer, what = (declared, "declared") if len(declared) > len(source) else (source, "in the source only")
    extra = longer[min(len(declared), len(source))]
    return f"parameter {min(len(declared), len(source))} '{extra[1]} {extra[0]}' is {what}"


def check_source(source_name: str, code: str, entry_points: Iterable[str],
                 declarations: Mapping[str, tuple[Field, ...]]) -> None:
    """Refuse ``code`` (the translation unit of ``source_name``) when an entry point's parameter list differs from
    its declaration, or an entry point is not defined or not declared; :class:`~hal_core.KernelCompileError` names
    the kernel, the first differing field and both layouts."""
    found = signatures(code)
    for kernel in entry_points:
        try:
            declared = _declaration(kernel, declarations)
        except KeyError as exc:
            raise KernelCompileError(source_name, str(exc.args[0])) from None
        if kernel not in found:
            raise KernelCompileError(source_name, f"entry point {kernel!r} is not defined (HAL_GLOBAL void ...)")
        for params in found[kernel]:
            if params != declared:
                raise KernelCompileError(
                    source_name,
                    f"the parameters of {kernel!r} differ from their declaration in hal_cupy/_kernel_params.py "
                    f"({_difference(declared, params)}); a stale declaration or source, refused before compiling.\n"
                    f"  declared: {layout(declared)}\n  source:   {layout(params)}")
