"""Builds hal-cpu's compiled kernels: ``csrc/kernels.cpp`` once per instruction-set variant, one library.

The library is a plain shared object with a C ABI (``csrc/hal_cpu_kernels.h``),
loaded with ctypes by ``hal_cpu._native``; it is not a Python extension module,
so it does not depend on the Python version. Variants (x86-64): ``avx512vnni``
(the avx512 flags plus AVX512_VNNI byte dot products, used by W8A8), ``avx512``
(AVX-512 F/BW/VL/DQ, FMA, F16C), ``avx2`` (AVX2, FMA, F16C) and ``baseline``
(the architecture's base ISA); other architectures build the baseline only.
``dispatch.cpp`` picks one at load time. ``HAL_CPU_BUILD_VARIANTS=baseline``
(comma-separated names) limits what is built, e.g. for a compiler without
AVX-512 support; a variant whose flags the compiler rejects is skipped with a
warning (the library then runs the others).
"""

from __future__ import annotations

import os
import platform
import sys
from concurrent.futures import ThreadPoolExecutor

from setuptools import Extension, setup
from setuptools.command.build_ext import build_ext
from setuptools.errors import CompileError

CSRC = "csrc"
COMMON = ["-std=c++17", "-O3", "-fPIC", "-fvisibility=hidden", "-fno-math-errno", "-Wall",
          "-Wno-maybe-uninitialized"]
AVX512 = ["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma", "-mf16c"]
X86_VARIANTS = {
    "avx512vnni": [*AVX512, "-mavx512vnni"],
    "avx512": AVX512,
    "avx2": ["-mavx2", "-mfma", "-mf16c"],
    "baseline": [],
}
#: The order the variants' objects are linked in, each instruction set a subset of the next. An inline function
#: several variants instantiate out of line (std::vector's members, say) is kept once, from the first object that
#: defines it; every variant calling it defines it too, so the copy kept is compiled for that caller's instruction
#: set or a smaller one. Linked the other way round, an AVX2 CPU would run an AVX-512 copy (SIGILL).
LINK_ORDER = ("baseline", "avx2", "avx512", "avx512vnni")
#: The preprocessor names each variant's translation unit is compiled with (isa.h reads them).
VARIANT_MACROS = {"avx512vnni": ["HAL_ISA_AVX512", "HAL_ISA_VNNI"], "avx512": ["HAL_ISA_AVX512"],
                  "avx2": ["HAL_ISA_AVX2"], "baseline": []}
#: A translation unit each non-baseline variant's flags must compile (its intrinsics), else it is skipped.
PROBES = {
    "avx512vnni": "__m512i f(__m512i a, __m512i b, __m512i c) { return _mm512_dpbusd_epi32(a, b, c); }",
    "avx512": "__m512 f(__m512 a) { return _mm512_fmadd_ps(a, a, a); }",
    "avx2": "__m256 f(__m256 a) { return _mm256_fmadd_ps(a, a, a); }",
}


def _variants() -> dict[str, list[str]]:
    machine = platform.machine().lower()
    variants = X86_VARIANTS if machine in ("x86_64", "amd64") else {"baseline": []}
    wanted = os.environ.get("HAL_CPU_BUILD_VARIANTS")
    if wanted:
        names = {name.strip() for name in wanted.split(",")} | {"baseline"}
        unknown = sorted(names - set(variants))
        if unknown:
            raise SystemExit(f"HAL_CPU_BUILD_VARIANTS={wanted!r}: unknown variant(s) {', '.join(unknown)}; "
                             f"this architecture builds {', '.join(variants)} (comma-separated)")
        variants = {name: flags for name, flags in variants.items() if name in names}
    return variants


class BuildKernels(build_ext):
    """Compile the kernel variants in parallel and link them with the dispatcher into one library."""

    def get_ext_filename(self, fullname: str) -> str:
        return os.path.join(*fullname.split(".")[:-1], "_kernels.so")

    def build_extension(self, ext: Extension) -> None:
        variants = _variants()
        compiler = self.compiler
        for name in ("compiler_so", "compiler_cxx", "linker_so"):  # a C++ compiler for the .cpp sources
            cmd = getattr(compiler, name, None)
            if cmd and os.path.basename(cmd[0]).startswith(("gcc", "cc")) and name != "compiler_cxx":
                cmd[0] = os.environ.get("CXX", "g++")

        variants = {name: flags for name, flags in variants.items() if self._compiles(name, flags)}

        def compile_variant(item: tuple[str, list[str]]) -> list[str]:
            name, flags = item
            macros = [(macro, "1") for macro in VARIANT_MACROS.get(name, [])]
            return compiler.compile([os.path.join(CSRC, "kernels.cpp")], output_dir=os.path.join(self.build_temp, name),
                                    macros=macros, extra_postargs=COMMON + flags, depends=ext.depends)

        ordered = sorted(variants.items(), key=lambda item: LINK_ORDER.index(item[0]))
        with ThreadPoolExecutor(max(1, min(len(variants), os.cpu_count() or 1))) as pool:
            objects = [obj for objs in pool.map(compile_variant, ordered) for obj in objs]
        have = [(f"HAL_HAVE_{name.upper()}", "1") for name in variants if name != "baseline"]
        # dispatch.cpp and expert_mlps.cpp are compiled for the base instruction set: linked right after the
        # baseline (LINK_ORDER).
        objects[1:1] = compiler.compile([os.path.join(CSRC, name) for name in ("dispatch.cpp", "expert_mlps.cpp")],
                                        output_dir=os.path.join(self.build_temp, "dispatch"), macros=have,
                                        extra_postargs=COMMON, depends=ext.depends)
        target = self.get_ext_fullpath(ext.name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        compiler.link_shared_object(objects, target, target_lang="c++",
                                    extra_postargs=["-pthread", "-ldl", "-static-libstdc++", "-static-libgcc"])


    def _compiles(self, name: str, flags: list[str]) -> bool:
        """Whether the compiler accepts ``name``'s flags and intrinsics (always true for the baseline)."""
        if name not in PROBES:
            return True
        probe_dir = os.path.join(self.build_temp, "probe", name)
        os.makedirs(probe_dir, exist_ok=True)
        source = os.path.join(probe_dir, "probe.cpp")
        with open(source, "w") as f:
            f.write("#include <immintrin.h>\n" + PROBES[name] + "\n")
        try:
            self.compiler.compile([source], output_dir=probe_dir, extra_postargs=COMMON + flags)
        except CompileError:
            print(f"hal-cpu: the compiler rejects the {name} variant's flags ({' '.join(flags)}); building without it",
                  file=sys.stderr)
            return False
        return True


KERNELS = Extension(
    "hal_cpu._kernels",
    sources=[os.path.join(CSRC, name) for name in ("kernels.cpp", "dispatch.cpp", "expert_mlps.cpp")],
    depends=[os.path.join(CSRC, name) for name in sorted(os.listdir(CSRC)) if name.endswith((".h", ".inl"))],
)

setup(ext_modules=[KERNELS], cmdclass={"build_ext": BuildKernels})
