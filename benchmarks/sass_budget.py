"""Static instruction budget of the tensor-core kernels, read from their SASS.

Compiles every ``quant_gemm_tc.cu`` and ``paged_attention_tc.cu`` specialisation with NVRTC for sm_80, sm_90 and
sm_120 (no GPU needed),
disassembles the cubin with ``nvdisasm`` (PyPI ``nvidia-cuda-nvdisasm``), and records per kernel: registers and
spills (ptxas), occupancy (CTAs per SM from registers, shared memory and threads), HMMA/IMMA counts, and for the
main loop (the loop holding the most tensor-core instructions): instructions per k-block and per byte of global
memory a warp moves, and, W4A16, the int4 conversion instructions per two weights; for the decode attention
(:func:`measure_attention`), instructions per chunk of K/V and per byte of K/V a warp's share of a chunk is.

    python benchmarks/sass_budget.py [--arch sm_90 ...] [--json benchmarks/sass_budget.json]

Writes ``benchmarks/sass_budget.json`` and the "Tensor-core kernels" and "Tensor-core decode attention" sections of
``docs/kernel-resources.md``.
The pure parts (parsing, loop detection, budgets) are imported by the tests.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ARCHS = ("sm_80", "sm_90", "sm_120")
#: Per-SM limits used for occupancy: registers, shared memory (bytes, the static-shared configuration
#: maximum), threads, CTAs.
SM_LIMITS = {
    "sm_80": (65536, 164 * 1024, 2048, 32),
    "sm_90": (65536, 228 * 1024, 2048, 32),
    "sm_120": (65536, 100 * 1024, 1536, 32),
}
#: Budgets held by the tests (see docs/kernel-resources.md for why these values).
#: The conversion's floor for nibbles packed 8 to a word (see markdown(): fp16 takes 2, bf16 4 views per word).
MAX_CONVERSION_PER_2_WEIGHTS = {1: 1.25, 2: 1.75}  # HAL_DTYPE f16: 4 LOP3 + 1 shift per 8; bf16: 4 LOP3 + 3
MAX_DEQUANT_PER_2_WEIGHTS = {1: 2.25, 2: 2.75}  # plus one HADD2/HFMA2 per pair for the zero point
#: W4A8 (int4 weights, int8 MMA): per word 2 LOP3 (even and odd nibbles as int8 bytes) + 1 shift, whatever the
#: dtype, and no zero-point subtraction (the row-sum MMA corrects for it): 3 per 8 weights.
MAX_W4A8_CONVERSION_PER_2_WEIGHTS = 0.75
MAX_ATTENTION_INSTR_PER_BYTE = 0.1  # decode attention main loop: warp instructions per byte of K/V
#: The HAL_VARLEN build (prefill rows, window, softcap, ALiBi): per logit a row mask, softcap and ALiBi on top
#: of the decode loop's work; its 16 rows are new tokens sharing each K/V byte, so per row it is 16x cheaper.
MAX_ATTENTION_VARLEN_INSTR_PER_BYTE = 0.15

_FUNC = re.compile(r"^\s*\.text\.(\S+):\s*$")
_LABEL = re.compile(r"^\s*(\.L_x_\d+):\s*$")
_INSN = re.compile(r"/\*[0-9a-f]{4,}\*/\s+(?:@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_]*(?:\.[A-Z0-9_]+)*)([^;]*);")
_TARGET = re.compile(r"`\((\.L_x_\d+)\)")


@dataclass
class Insn:
    opcode: str  # with modifiers, e.g. HMMA.16816.F32
    operands: str

    @property
    def base(self) -> str:
        return self.opcode.split(".")[0]


def nvdisasm_path() -> str | None:
    """nvdisasm from PATH or from the nvidia-cuda-nvdisasm wheel."""
    found = shutil.which("nvdisasm")
    if found:
        return found
    try:
        import nvidia  # namespace package of the CUDA wheels
    except ImportError:
        return None
    for base in getattr(nvidia, "__path__", []):
        for candidate in Path(base).glob("*/bin/nvdisasm"):
            return str(candidate)
    return None


def disassemble(cubin: bytes, tool: str) -> str:
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "k.cubin"
        path.write_bytes(cubin)
        res = subprocess.run([tool, str(path)], capture_output=True, text=True, check=True)
    return res.stdout


def parse_sass(text: str) -> dict[str, tuple[list[Insn], dict[str, int]]]:
    """Per function: its instructions and the instruction index of each label."""
    funcs: dict[str, tuple[list[Insn], dict[str, int]]] = {}
    current: tuple[list[Insn], dict[str, int]] | None = None
    for line in text.splitlines():
        m = _FUNC.match(line)
        if m:
            current = funcs.setdefault(m.group(1), ([], {}))
            continue
        if current is None:
            continue
        m = _LABEL.match(line)
        if m:
            current[1][m.group(1)] = len(current[0])
            continue
        m = _INSN.search(line)
        if m:
            current[0].append(Insn(m.group(1), m.group(2)))
    return funcs


def loops(insns: list[Insn], labels: dict[str, int]) -> list[tuple[int, int]]:
    """(first, last) instruction index of every loop: a branch back to a label at or before it."""
    out = []
    for i, insn in enumerate(insns):
        if insn.base != "BRA":
            continue
        m = _TARGET.search(insn.operands)
        if m and m.group(1) in labels and labels[m.group(1)] <= i:
            out.append((labels[m.group(1)], i))
    return out


def _is_mma(insn: Insn) -> bool:
    return insn.base in ("HMMA", "IMMA")


def main_loop(insns: list[Insn], labels: dict[str, int]) -> list[Insn]:
    """The loop body with the most tensor-core instructions (empty if none has any)."""
    best: list[Insn] = []
    best_mma = 0
    for lo, hi in loops(insns, labels):
        body = insns[lo: hi + 1]
        n = sum(map(_is_mma, body))
        if n > best_mma or (n == best_mma and n and len(body) < len(best)):
            best, best_mma = body, n
    return best


#: The conversion's LOP3 immediates: ``(w & mask) | magic`` (W4A16), ``w & 0x0f0f0f0f`` (W4A8).
_NIBBLE_MASKS = ("0xf000f,", "0xf000f0,", "0xf0f0f0f,")
_NIBBLE_SHIFTS = ("0x4,", "0x8,", "0xc,")  # w >> 4, 8, 12 feeding them


def conversion_counts(body: list[Insn]) -> dict[str, int]:
    """The int4 conversion's instructions in a loop body, recognised by their operands.

    ``lop3``: LOP3 with a nibble-pair mask immediate; ``shift``: logical right shifts by 4, 8 or 12;
    ``half2``: HADD2/HFMA2 on packed pairs (not the ``.F32`` half -> float moves of the scale path).
    """
    c: Counter[str] = Counter()
    for insn in body:
        ops = insn.operands.replace(" ", "") + ","
        if insn.base == "LOP3" and any(f",{m}" in ops for m in _NIBBLE_MASKS):
            c["lop3"] += 1
        elif insn.opcode.startswith("SHF.R.U32") and any(f",{m}" in ops for m in _NIBBLE_SHIFTS):
            c["shift"] += 1
        elif insn.base in ("HADD2", "HFMA2") and ".F32" not in insn.opcode:
            c["half2"] += 1
    return dict(c)


@dataclass
class SassBudget:
    """What every kernel's budget reads from its SASS: resources, occupancy and the main loop's size."""

    spec: str
    arch: str
    kernel: str
    registers: int
    spill_bytes: int
    static_shared_bytes: int
    ctas_per_sm: int
    mma_total: int
    mma_main_loop: int
    main_loop_instructions: int


@dataclass
class KernelBudget(SassBudget):
    kblocks_per_iteration: float
    instructions_per_kblock: float
    instructions_per_byte: float
    conversion_per_2_weights: float | None
    dequant_per_2_weights: float | None


def occupancy(arch: str, registers: int, shared: int, threads: int = 128) -> int:
    regs_sm, smem_sm, threads_sm, ctas_sm = SM_LIMITS[arch]
    regs_per_warp = -(-max(registers, 1) * 32 // 256) * 256  # allocated per warp in units of 256
    by_regs = regs_sm // (regs_per_warp * (threads // 32))
    by_smem = smem_sm // shared if shared else ctas_sm
    return max(0, min(by_regs, by_smem, threads_sm // threads, ctas_sm))


def budget(spec, arch: str, kernel: str, resources, insns: list[Insn], labels: dict[str, int]) -> KernelBudget:
    """Budget figures of one kernel (see the module docs)."""
    defines = dict(spec.defines)
    bits, frags = int(defines["HAL_QBITS"]), int(defines["HAL_M_FRAGS"])
    int8_x = int(defines.get("HAL_ABITS", 8 if bits == 8 else 16)) == 8  # W8A8 and W4A8: int8 MMA on xq
    body = main_loop(insns, labels)
    mma_loop = sum(map(_is_mma, body))
    # MMAs per warp and k-block: W4A16 2 k16 steps x 4 tiles x frags; int8 (4 tiles + 1 row-sum) x frags.
    per_kblock = 5 * frags if int8_x else 8 * frags
    kblocks = mma_loop / per_kblock if mma_loop else 0.0
    # Global bytes a warp's share of one k-block moves: weights, x rows, scales and zero points of 128 columns.
    cta_bytes = (128 * 32 // (2 if bits == 4 else 1)) + 16 * frags * 32 * (1 if int8_x else 2) + 256 + 128
    per_kb = len(body) / kblocks if kblocks else 0.0
    conv = deq = None
    if bits == 4 and kblocks:
        counts = conversion_counts(body)
        weights = kblocks * 4 * 8  # per thread: 4 tiles x one 8-weight word per k-block
        conv = (counts.get("lop3", 0) + counts.get("shift", 0)) / (weights / 2)
        deq = (counts.get("lop3", 0) + counts.get("shift", 0) + counts.get("half2", 0)) / (weights / 2)
    return KernelBudget(
        spec.id, arch, kernel, resources.registers, resources.spill_stores + resources.spill_loads,
        resources.shared_bytes, occupancy(arch, resources.registers, resources.shared_bytes),
        sum(map(_is_mma, insns)), mma_loop, len(body), kblocks, per_kb,
        per_kb / (cta_bytes / 4) if kblocks else 0.0, conv, deq,
    )


def tensor_core_specs() -> list:
    from hal_cupy import all_specializations

    return [s for s in all_specializations() if s.source == "quant_gemm_tc.cu"]


def measure(spec, arch: str, tool: str) -> list[KernelBudget]:
    """Compile one specialisation for ``arch`` and read its GEMM kernel's budget."""
    from hal_cuda import _nvrtc as N

    res = N.compile_specialization(spec, arch)
    funcs = parse_sass(disassemble(res.cubin, tool))
    out = []
    for kernel in spec.kernels:
        if kernel == "hal_tc_reduce":
            continue
        insns, labels = funcs[kernel]
        out.append(budget(spec, arch, kernel, res.kernels[kernel], insns, labels))
    return out


@dataclass
class AttentionBudget(SassBudget):
    chunks_per_iteration: float
    kv_bytes_per_warp: int  # bytes of K and V of one chunk, divided by the CTA's 4 warps
    instructions_per_byte: float


def attention_mma_per_chunk(head_size: int) -> int:
    """MMAs one warp issues per chunk of ``paged_attention_tc.cu`` (mirror of its layout).

    Q K^T: ``tokens / 8`` tiles x ``head_size / 16`` k-steps; P V: ``columns / 8`` tiles per k-step (one k8
    step for 8 tokens, else ``tokens / 16`` k16 steps); plus one exp-sum MMA per P V step.
    """
    from hal_cupy.ops import _paged_attention_rules as rules

    chunk = rules.paged_attention_tc_chunk(head_size)
    groups = rules.paged_attention_tc_token_groups(head_size)
    tokens, columns = chunk // groups, head_size * groups // 4
    pv_steps = max(1, tokens // 16)
    return tokens // 8 * head_size // 16 + pv_steps * (columns // 8 + 1)


def attention_varlen(spec) -> bool:
    """Whether a ``paged_attention_tc.cu`` specialisation is the HAL_VARLEN build."""
    return dict(spec.defines).get("HAL_VARLEN") == "1"


def attention_instr_per_byte_budget(spec) -> float:
    """The instructions-per-byte budget of a tensor-core attention build (decode or HAL_VARLEN)."""
    return MAX_ATTENTION_VARLEN_INSTR_PER_BYTE if attention_varlen(spec) else MAX_ATTENTION_INSTR_PER_BYTE


def attention_specs() -> list:
    from hal_cupy import all_specializations

    return [s for s in all_specializations() if s.source == "paged_attention_tc.cu"]


def attention_budget(spec, arch: str, kernel: str, resources, insns: list[Insn],
                     labels: dict[str, int]) -> AttentionBudget:
    """Budget of the decode attention kernel: its main loop is one chunk of K/V (checked by its MMA count)."""
    from hal_cupy.ops import _paged_attention_rules as rules

    head_size = int(dict(spec.defines)["HAL_HEAD_SIZE"])
    body = main_loop(insns, labels)
    mma_loop = sum(map(_is_mma, body))
    chunks = mma_loop / attention_mma_per_chunk(head_size)
    kv_bytes = rules.paged_attention_tc_chunk(head_size) * head_size * 2 * 2 // 4
    return AttentionBudget(
        spec.id, arch, kernel, resources.registers, resources.spill_stores + resources.spill_loads,
        resources.shared_bytes, occupancy(arch, resources.registers, resources.shared_bytes),
        sum(map(_is_mma, insns)), mma_loop, len(body), chunks, kv_bytes,
        len(body) / (chunks * kv_bytes) if chunks else 0.0,
    )


def measure_attention(spec, arch: str, tool: str) -> list[AttentionBudget]:
    """Compile one ``paged_attention_tc.cu`` specialisation for ``arch`` and read its budget."""
    from hal_cuda import _nvrtc as N

    res = N.compile_specialization(spec, arch)
    funcs = parse_sass(disassemble(res.cubin, tool))
    return [attention_budget(spec, arch, k, res.kernels[k], *funcs[k]) for k in spec.kernels]


def attention_markdown(rows: list[AttentionBudget]) -> str:
    lines = [
        "## Tensor-core attention (SASS)",
        "",
        "From `python benchmarks/sass_budget.py`. *Main loop*: the loop with the most HMMA, one chunk of K/V per",
        "iteration (its HMMA count is the layout's per-chunk count); *instr/chunk*: its warp instructions;",
        "*K/V B/warp*: the bytes of K and V of one chunk divided by the CTA's 4 warps; *instr/byte*: the ratio.",
        "",
        "Held by `plugins/hal_cuda/tests/test_attention_sass_budget.py` on every arch: no spill; HMMA in the main",
        f"loop, one chunk per iteration; at most {MAX_ATTENTION_INSTR_PER_BYTE} warp-instructions per byte of K/V",
        f"for the decode builds (`VARLEN=0`), {MAX_ATTENTION_VARLEN_INSTR_PER_BYTE} for the `VARLEN=1` builds",
        "(prefill rows, window, softcap, ALiBi: a row mask, softcap and ALiBi per logit; their 16 rows are",
        "new tokens that share each K/V byte); at least 2 CTAs per SM.",
        "",
        "| specialisation | arch | regs | spill B | smem B | CTAs/SM | MMA (loop) | instr/chunk | K/V B/warp "
        "| instr/byte |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(f"| `{r.spec}` | {r.arch} | {r.registers} | {r.spill_bytes} | {r.static_shared_bytes} | "
                     f"{r.ctas_per_sm} | {r.mma_total} ({r.mma_main_loop}) | {r.main_loop_instructions} | "
                     f"{r.kv_bytes_per_warp} | {r.instructions_per_byte:.3f} |")
    lines.append("")
    return "\n".join(lines)


def markdown(rows: list[KernelBudget]) -> str:
    lines = [
        "## Tensor-core kernels (SASS)",
        "",
        "From `python benchmarks/sass_budget.py` (NVRTC cubin, `nvdisasm`). *Main loop*: the loop with the most",
        "HMMA/IMMA; *instr/byte*: its warp instructions per byte of global memory the warp's share of the CTA moves",
        "(weights, x rows, scales, zero points); *conv/2w*: the int4 conversion's LOP3s (nibble-mask immediates) and",
        "shifts per two weights, *deq/2w*: plus the HADD2/HFMA2 zero-point subtraction.",
        "",
        "Held by `plugins/hal_cuda/tests/test_tc_sass_budget.py` on every arch: no spill; HMMA (W4A16) / IMMA",
        "(W8A8, W4A8) in the main loop; at least 2 CTAs per SM; W4A16 conversion at most 1.25 (fp16) / 1.75 (bf16)",
        "instructions per two weights -- one LOP3 per two weights (the magic-number conversion) plus one shift per",
        "8 weights (bf16, whose 7-bit mantissa takes one nibble position per half: three) -- and at most 2.25 / 2.75",
        "with the zero point, one HADD2/HFMA2 per two weights. The zero point is subtracted per weight pair",
        "because feeding the MMA `1024 + q` and correcting afterwards cancels about ten bits of the fp32 sum.",
        "",
        "W4A8 (`ABITS=8`: int4 weights on the int8 MMA) is held to 0.75 per two weights for both: per 8-weight word",
        "one LOP3 keeps the even nibbles and one shift plus one LOP3 the odd ones, each nibble already an int8",
        "byte in [0, 15]; its zero point costs nothing in the loop (in int32, exactly, `sum xq (q - z) =",
        "sum xq q - z sum xq`, the row sums from a fifth MMA per k-block, as W8A8 does for its offset 128).",
        "",
        "These conversion counts are the least a LOP3 conversion of densely packed nibbles can reach, so one",
        "instruction per two weights is not a reachable budget for it. A LOP3 is bitwise: each half of its",
        "result takes its nibble from the same bit positions of its source register, and only the mantissa",
        "bits can hold it (fp16 10 bits: two nibbles per half; bf16 7 bits: one). A 32-bit word of 8 nibbles",
        "(4 per half) must therefore be seen through 2 (fp16) or 4 (bf16) registers, and each register beyond",
        "the loaded word costs one instruction (a shift, a PRMT or a funnel shift alike): 5 / 7 instructions",
        "per 8 weights at best. Fewer would need a layout spending more shared-memory bytes per weight or a",
        "lookup per value; moving the bias or zero point after the MMA would drop the HADD2/HFMA2, not these.",
        "",
        "| specialisation | arch | regs | spill B | smem B | CTAs/SM | MMA (loop) | instr/k-block | instr/byte "
        "| conv/2w | deq/2w |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        conv = f"{r.conversion_per_2_weights:.2f}" if r.conversion_per_2_weights is not None else "-"
        deq = f"{r.dequant_per_2_weights:.2f}" if r.dequant_per_2_weights is not None else "-"
        lines.append(f"| `{r.spec}` | {r.arch} | {r.registers} | {r.spill_bytes} | {r.static_shared_bytes} | "
                     f"{r.ctas_per_sm} | {r.mma_total} ({r.mma_main_loop}) | {r.instructions_per_kblock:.0f} | "
                     f"{r.instructions_per_byte:.3f} | {conv} | {deq} |")
    lines.append("")
    return "\n".join(lines)


_BEGIN, _END = "<!-- sass-budget:begin -->", "<!-- sass-budget:end -->"
_ATTN_BEGIN, _ATTN_END = "<!-- sass-budget-attention:begin -->", "<!-- sass-budget-attention:end -->"


def write_doc(path: Path, table: str, begin: str = _BEGIN, end: str = _END) -> None:
    """Replace the section of ``path`` between the markers ``begin`` and ``end`` (appended when absent)."""
    text = path.read_text() if path.exists() else ""
    block = f"{begin}\n{table}{end}\n"
    if begin in text and end in text:
        text = text[: text.index(begin)] + block + text[text.index(end) + len(end) + 1:]
    else:
        text = text.rstrip("\n") + "\n\n" + block
    path.write_text(text)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arch", action="append")
    ap.add_argument("--json", type=Path, default=ROOT / "benchmarks" / "sass_budget.json")
    ap.add_argument("--markdown", type=Path, default=ROOT / "docs" / "kernel-resources.md")
    args = ap.parse_args()
    tool = nvdisasm_path()
    if tool is None:
        print("nvdisasm not found: pip install nvidia-cuda-nvdisasm", file=sys.stderr)
        return 2
    archs = args.arch or DEFAULT_ARCHS
    rows = [b for spec in tensor_core_specs() for arch in archs for b in measure(spec, arch, tool)]
    attn = [b for spec in attention_specs() for arch in archs for b in measure_attention(spec, arch, tool)]
    args.json.write_text(json.dumps([asdict(r) for r in rows + attn], indent=1) + "\n")
    write_doc(args.markdown, markdown(rows))
    write_doc(args.markdown, attention_markdown(attn), _ATTN_BEGIN, _ATTN_END)
    print(markdown(rows))
    print(attention_markdown(attn))
    return 0


if __name__ == "__main__":
    sys.exit(main())
