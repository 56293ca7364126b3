"""The one rule that turns a kernel file into the translation unit a compiler gets.

:func:`translation_unit`: the prelude, then ``#line 1 "<file>"``, then the
kernel file (package data of ``hal_cupy.kernels``) with each header of that
package it includes (``#include "hal_common.cuh"``) inlined between ``#line``
directives.  Inlining (instead of an include path) makes the source text cover
every byte compiled, so CuPy's disk cache and the launcher's digest can never
go stale, and the ``#line`` directives keep compiler messages pointing at the
original files.  Headers are inlined one level deep: a header includes no
other hal header.

Every compile of a kernel goes through it: the runtime compiler and the
warm-up (:func:`kernel_source`, with the platform's prelude), the offline
NVRTC and HIP compile checks, the SASS budget and the kernel-resource report
(:func:`kernel_source` too, with hal-cuda's or hal-rocm's platform), and the
host-compiled tests (with the host prelude).  :func:`kernel_source` also
checks every entry point's parameter list against its declaration
(:mod:`hal_cupy._kernel_params`) before anything is compiled.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from importlib import resources

from hal_core import KernelSource

from ._kernel_params import check_source
from ._platform import GpuPlatform
from ._specialization import Specialization

__all__ = ["KERNEL_PACKAGE", "assemble", "kernel_source", "translation_unit"]

#: The package whose data holds the kernel files and the headers they include (``*.cuh``).
KERNEL_PACKAGE = "hal_cupy.kernels"


def _strip_pragma_once(text: str) -> str:
    # Inlined into one translation unit; a blank line keeps the line numbers.
    return "\n".join("" if line.strip() == "#pragma once" else line for line in text.split("\n"))


def assemble(body: str, source_name: str, prelude: str, headers: Mapping[str, str]) -> str:
    """One self-contained translation unit: ``prelude``, then ``body`` (the text of ``source_name``) with the
    headers it includes inlined.

    ``headers`` maps header names (``hal_common.cuh``) to their text; a line
    ``#include "<name>"`` of ``body`` becomes ``#line 1 "<name>"``, the header
    and ``#line <next> "<source_name>"``.  ``#pragma once`` lines of the
    prelude and the headers become blank lines.
    """
    out = [_strip_pragma_once(prelude), f'#line 1 "{source_name}"']
    for number, line in enumerate(body.split("\n"), start=1):
        name = next((h for h in headers if line.strip() == f'#include "{h}"'), None)
        if name is not None:
            out += [f'#line 1 "{name}"', _strip_pragma_once(headers[name]), f'#line {number + 1} "{source_name}"']
        else:
            out.append(line)
    return "\n".join(out)


def translation_unit(source: str, prelude: str) -> str:
    """The text compiled for kernel file ``source`` (e.g. ``paged_attention.cu``) after ``prelude``."""
    root = resources.files(KERNEL_PACKAGE)
    headers = {f.name: f.read_text() for f in root.iterdir() if f.name.endswith(".cuh")}
    return assemble(root.joinpath(source).read_text(), source, prelude, headers)


@functools.cache
def kernel_source(spec: Specialization, platform: GpuPlatform) -> KernelSource:
    """The :class:`~hal_core.KernelSource` of one specialisation: its translation unit after the platform's prelude,
    its entry points, and its defines as options (the platform's compile options are added by the launcher).

    Each entry point's parameter list is checked against its declaration first
    (:func:`hal_cupy._kernel_params.check_source`): a mismatch raises
    :class:`~hal_core.KernelCompileError` before anything is compiled.
    """
    code = translation_unit(spec.source, platform.prelude())
    check_source(spec.source, code, spec.kernels)
    return KernelSource(spec.source, code, spec.kernels, spec.options())
