"""Code the variants share runs on every CPU that calls it: no function reached from a smaller variant's code uses
a larger variant's instructions (setup.py's LINK_ORDER; an AVX-512 copy of std::vector's fill called by the avx2
variant stopped an AVX2-only CPU with SIGILL)."""

from __future__ import annotations

import re
import shutil
import subprocess
from collections import defaultdict
from pathlib import Path

import hal_cpu
import pytest

LIBRARY = Path(hal_cpu.__file__).parent / "_kernels.so"
#: The instruction sets in inclusion order, each with what marks its code in a disassembly and its namespace.
LEVELS = [("baseline", None, None), ("avx2", re.compile(r"%ymm"), "hal::avx2::"),
          ("avx512", re.compile(r"%zmm|%k[1-7]|\{1to"), "hal::avx512")]
HEADER = re.compile(r"^[0-9a-f]+ <(?P<name>.+)>:$")
#: A direct call or tail jump (std:: functions keep default visibility, so most are called through the PLT).
CALL = re.compile(r"\s(?:call|jmp)\s+[0-9a-f]+ <(?P<name>.+?)(?:@plt)?(?:\+0x[0-9a-f]+)?>$")


def _level_of_code(lines: list[str]) -> int:
    """The largest instruction set a function's instructions use (an index into LEVELS)."""
    text = "\n".join(lines)
    return max((i for i, (_, marker, _) in enumerate(LEVELS) if marker and marker.search(text)), default=0)


def _level_of_name(name: str) -> int:
    """The instruction set a function's name places it in (its variant's namespace, in any template argument)."""
    return max((i for i, (_, _, space) in enumerate(LEVELS) if space and space in name), default=0)


def test_shared_functions_use_no_larger_instruction_set_than_their_callers() -> None:
    """Every direct call into a function outside the callers' own variant goes to code their CPU runs."""
    objdump = shutil.which("objdump")
    if objdump is None:
        pytest.fail("objdump (binutils, installed with the compiler that built hal-cpu) is needed to read the library")
    listing = subprocess.run([objdump, "-d", "-C", "--no-show-raw-insn", str(LIBRARY)], check=True,
                             capture_output=True, text=True).stdout
    bodies: dict[str, list[str]] = defaultdict(list)
    current = None
    for line in listing.splitlines():
        header = HEADER.match(line)
        if header:
            current = header["name"]
        elif current is not None and line.strip():
            bodies[current].append(line)
    assert len(bodies) > 100, f"could not read the disassembly of {LIBRARY}"
    uses = {name: _level_of_code(lines) for name, lines in bodies.items()}
    wrong = []
    for caller, lines in bodies.items():
        allowed = max(_level_of_name(caller), uses[caller])
        for line in lines:
            call = CALL.search(line)
            if call and call["name"] in uses and uses[call["name"]] > allowed:
                wrong.append(f"{caller} ({LEVELS[allowed][0]}) calls {call['name']} ({LEVELS[uses[call['name']]][0]})")
    assert not wrong, "shared code compiled for a larger instruction set than its callers:\n" + "\n".join(wrong[:20])
