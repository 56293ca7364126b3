"""numpy emulations of the hal kernels, following ``hal_cupy/kernels/README.md`` parameter by parameter.

With :class:`NumpyCupy` standing in for CuPy (device arrays are an ndarray
subclass), the CUDA op implementations run end to end on the host: argument
order and count, workspaces, split-KV and split-K flows, the W8A8 and
dequantise + matmul paths are checked without a GPU. Each emulated kernel
asserts the types of its parameters and the grid the README prescribes.
"""

from __future__ import annotations

import ctypes
from types import SimpleNamespace
from typing import Any

import fakecupy
import numpy as np

from hal_core.arrays import BFLOAT16, TaggedArray


class DevArray(np.ndarray):
    """A host array posing as a CuPy device array (``.data.ptr``, ``.device.id``, ``.get()``)."""

    @property
    def data(self) -> Any:  # type: ignore[override]
        return SimpleNamespace(ptr=self.__array_interface__["data"][0])

    @property
    def device(self) -> Any:  # type: ignore[override]
        return SimpleNamespace(id=0)

    def get(self) -> np.ndarray:
        return np.array(self)

    def __dlpack_device__(self) -> tuple[int, int]:
        return (2, 0)


def dev(array: np.ndarray) -> DevArray:
    """A DevArray copy of a host array (bf16 as uint16 storage, like the CUDA backend); a strided view of a
    C-contiguous array stays a view (same strides and offset) into a copy of that array."""
    if array.dtype == BFLOAT16:
        array = array.view(np.uint16)
    root = array
    while isinstance(root.base, np.ndarray):
        root = root.base
    if array.flags.c_contiguous or root is array or not root.flags.c_contiguous:
        return np.array(np.ascontiguousarray(array)).view(DevArray)
    copy = np.array(root).reshape(-1).view(np.uint8)
    offset = array.__array_interface__["data"][0] - root.__array_interface__["data"][0]
    return np.ndarray.__new__(DevArray, array.shape, array.dtype, buffer=copy, offset=offset,  # type: ignore[call-overload]
                              strides=array.strides)


def to_dev(value: Any) -> Any:
    """A host array as the emulated device holds it (bf16 tagged); anything else unchanged."""
    if isinstance(value, np.ndarray):
        storage = dev(value)
        return TaggedArray(storage, "bf16") if value.dtype == BFLOAT16 else storage
    return value


def host(value: Any) -> np.ndarray:
    """An emulated device array (or a host one) as a host numpy array, bf16 viewed as bf16."""
    if isinstance(value, TaggedArray):
        return np.asarray(value.storage).view(BFLOAT16)
    return np.asarray(value)


#: The numpy dtype of each hal dtype name the tests use.
NP = {"fp32": np.float32, "fp16": np.float16, "bf16": BFLOAT16}


def rel_err(out: Any, ref: np.ndarray, *, all_written: bool = True) -> float:
    """Relative Frobenius error of an (emulated device) result against a float64 reference; with
    ``all_written``, first that every element of it is finite (written)."""
    out64 = host(out).astype(np.float64)
    if all_written:
        assert np.isfinite(out64).all(), "an output element was not written"
    return float(np.linalg.norm(out64 - ref) / max(np.linalg.norm(ref), 1e-30))


def attention_inputs(rng: np.random.Generator, dtype: str, seq_lens: list[int], heads: int = 8, kv_heads: int = 2,
                     head_size: int = 64, block: int = 16, spare_blocks: int = 0) -> dict[str, Any]:
    """Host paged_attention arguments: random distinct blocks (two unused), ``spare_blocks`` table columns past
    the longest sequence."""
    max_blocks = max(1, -(-max(seq_lens) // block)) + spare_blocks
    n = len(seq_lens)
    table = rng.permutation(n * max_blocks + 2)[: n * max_blocks].reshape(n, max_blocks).astype(np.int32)
    shape = (n * max_blocks + 2, kv_heads, block, head_size)
    return dict(query=rng.standard_normal((n, heads, head_size)).astype(NP[dtype]),
                key_cache=rng.standard_normal(shape).astype(NP[dtype]),
                value_cache=rng.standard_normal(shape).astype(NP[dtype]),
                block_tables=table, seq_lens=np.array(seq_lens, np.int32), scale=0.125)


def _floats(array: np.ndarray, code: int) -> np.ndarray:
    base = np.asarray(array)
    if code == 2:
        assert base.dtype == np.uint16, base.dtype
        return base.view(BFLOAT16).astype(np.float32)
    assert base.dtype == (np.float16 if code == 1 else np.float32), (code, base.dtype)
    return base.astype(np.float32)


def _store(target: np.ndarray, values: np.ndarray, code: int) -> None:
    values = np.asarray(values, np.float32)
    if code == 2:
        target[...] = values.astype(BFLOAT16).view(np.uint16)
    else:
        target[...] = values.astype(np.float16 if code == 1 else np.float32)


def _ptr(value: Any, dtype: Any = None, nullable: bool = False) -> np.ndarray | None:
    if isinstance(value, np.uint64) and nullable:
        assert int(value) == 0
        return None
    assert isinstance(value, DevArray), f"expected a device array, got {type(value).__name__}"
    assert value.flags["C_CONTIGUOUS"]
    if dtype is not None:
        assert value.dtype == np.dtype(dtype), (value.dtype, dtype)
    return np.asarray(value)


def _rows(value: Any, token_stride: Any, head_stride: Any, nullable: bool = False) -> np.ndarray | None:
    """A device array of head rows addressed by (token, head) strides in elements, last dimension contiguous."""
    if isinstance(value, np.uint64) and nullable:
        assert int(value) == 0
        return None
    assert isinstance(value, DevArray), f"expected a device array, got {type(value).__name__}"
    assert isinstance(token_stride, np.int64) and isinstance(head_stride, np.int64)
    item = value.itemsize
    assert value.strides[2] == item or value.shape[2] == 1
    assert (int(token_stride) * item, int(head_stride) * item) == value.strides[:2] or 0 in value.shape[:2]
    return np.asarray(value)


def _i32(value: Any) -> int:
    assert isinstance(value, np.int32), f"expected np.int32, got {type(value).__name__}"
    return int(value)


def _i64(value: Any) -> int:
    assert isinstance(value, np.int64), f"expected np.int64, got {type(value).__name__}"
    return int(value)


def _row_view(value: Any, stride: int, cols: int) -> np.ndarray:
    """A 2-D device array the kernel reads as rows ``stride`` elements apart (a strided view allowed)."""
    assert isinstance(value, DevArray), f"expected a device array, got {type(value).__name__}"
    assert value.ndim == 2 and value.shape[1] == cols and value.strides[1] == value.itemsize
    assert value.shape[0] <= 1 or value.strides[0] == stride * value.itemsize, (value.strides, stride)
    return np.asarray(value)


def _codes4(qweight: np.ndarray) -> np.ndarray:
    shifts = (4 * np.arange(8, dtype=np.uint32))[None, :, None]
    return ((qweight[:, None, :] >> shifts) & 15).reshape(qweight.shape[0] * 8, qweight.shape[1])


def _w4a8_columns(k: int) -> np.ndarray:
    """Column of hal_w4a8_quantize_rows' output holding each activation column: in every 32-column block, the byte
    the int8 MMA pairs with that k in the int4 record (b[0] = even nibbles, b[1] = odd; README "W4A8")."""
    c = np.arange(k)
    b = c % 32
    a, h, t, e = b // 16, (b // 8) % 2, (b // 2) % 4, b % 2
    return c - b + 16 * h + 4 * t + 2 * e + a


def _dequant(codes: np.ndarray, scales: np.ndarray, zeros: np.ndarray | None, g: int, default: int) -> np.ndarray:
    groups = np.arange(codes.shape[0]) // g
    z = default if zeros is None else zeros.astype(np.float32)[groups]
    return (codes.astype(np.float32) - z) * scales.astype(np.float32)[groups]


def _attend(q: np.ndarray, kc: np.ndarray, vc: np.ndarray, table: np.ndarray, t0: int, t1: int, scale: float,
            kv_head: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Unnormalised output, max logit and exp-sum of query heads ``q [G, D]`` over tokens ``[t0, t1)``."""
    t = np.arange(t0, t1)
    block_size = kc.shape[2]
    keys = kc[table[t // block_size], kv_head, t % block_size]
    values = vc[table[t // block_size], kv_head, t % block_size]
    logits = (q @ keys.T) * scale
    m = logits.max(axis=1)
    p = np.exp(logits - m[:, None])
    return p @ values, m, p.sum(axis=1)


#: Names of the kernels launched, in order (tests clear it).
LAUNCHED: list[str] = []


class Kernel:
    """One emulated entry point; ``defines`` come from the module's ``-D`` options."""

    def __init__(self, name: str, defines: dict[str, int]) -> None:
        self.name, self.defines = name, defines
        self.kernel = SimpleNamespace(ptr=id(self))
        self._attributes = {"max_threads_per_block": 256 if "quant_util" in name else 1024, "num_regs": 64,
                            "shared_size_bytes": 4096, "max_dynamic_shared_size_bytes": 48 * 1024 - 4096}
        self.calls: list[tuple[Any, ...]] = []

    @property
    def attributes(self) -> dict[str, int]:
        return dict(self._attributes)

    def __call__(self, grid: tuple[int, int, int], block: tuple[int, int, int], args: tuple[Any, ...], *,
                 shared_mem: int = 0) -> None:
        assert shared_mem == 0, "no hal kernel uses dynamic shared memory"
        self.calls.append((grid, block))
        LAUNCHED.append(self.name)
        getattr(self, self.name)(grid, block, *args)

    # -- paged_attention.cu ------------------------------------------------------------------

    def _pa_common(self, q: Any, kc: Any, vc: Any, bt: Any, sl: Any, scale: Any, nh: Any, nkv: Any, bs: Any,
                   maxb: Any) -> tuple[Any, ...]:
        code = self.defines["HAL_DTYPE"]
        q, kc, vc = (_floats(_ptr(a), code) for a in (q, kc, vc))
        bt, sl = _ptr(bt, np.int32), _ptr(sl, np.int32)
        assert isinstance(scale, np.float32)
        nh, nkv, bs, maxb = _i32(nh), _i32(nkv), _i32(bs), _i32(maxb)
        assert q.shape[2] == self.defines["HAL_HEAD_SIZE"] and kc.shape[1:3] == (nkv, bs)
        assert bt.shape[1] == maxb
        return q, kc, vc, bt, sl, float(scale), nh, nkv

    @staticmethod
    def _index_code(bt: np.ndarray, sl: np.ndarray, s: int, t0: int, t1: int, block_size: int,
                    checks: tuple[Any, ...]) -> int:
        """hal_index_checks.cuh for tokens [t0, t1) of sequence s: 0 when readable, else the code (flag set)."""
        num_blocks, limit, flag = _i32(checks[0]), _i32(checks[1]), _ptr(checks[2], np.int32)
        assert flag.shape == (1,), "the error flag is one int32"
        n = int(sl[s])
        code = 0
        if n < 0 or n > min(limit, bt.shape[1] * block_size):
            code = 2
        elif t1 > t0:
            used = bt[s, t0 // block_size:(t1 - 1) // block_size + 1]
            code = 1 if ((used < 0) | (used >= num_blocks)).any() else 0
        flag[0] |= code
        return code

    def _pa_varlen(self, rest: tuple[Any, ...]) -> SimpleNamespace:
        """The 23 parameters paged_attention.cu's kernels share (README), checked and converted."""
        assert len(rest) == 23, "paged_attention.cu's kernels share 23 parameters"
        code = self.defines["HAL_DTYPE"]
        (q, kc, vc, bt, sl, qsl, sinks, slopes, scale, softcap, nh, nkv, bs, maxb, window, ntok, mql) = rest[:17]
        caches = []
        for cache, strides in ((kc, rest[17:20]), (vc, rest[20:23])):
            assert isinstance(cache, DevArray) and cache.strides[3] == cache.itemsize
            assert all(isinstance(x, np.int64) for x in strides)
            assert tuple(int(x) * cache.itemsize for x in strides) == cache.strides[:3], "element strides"
            caches.append(_floats(np.asarray(cache), code))
        assert isinstance(scale, np.float32) and isinstance(softcap, np.float32)
        a = SimpleNamespace(q=_floats(_ptr(q), code), kc=caches[0], vc=caches[1], bt=_ptr(bt, np.int32),
                            sl=_ptr(sl, np.int32), qsl=_ptr(qsl, np.int32, nullable=True),
                            sinks=_ptr(sinks, np.float32, nullable=True),
                            slopes=_ptr(slopes, np.float32, nullable=True), scale=float(scale),
                            softcap=float(softcap), nh=_i32(nh), nkv=_i32(nkv), bs=_i32(bs), window=_i32(window),
                            ntok=_i32(ntok), mql=_i32(mql))
        assert a.q.shape == (a.ntok, a.nh, self.defines["HAL_HEAD_SIZE"]) and a.kc.shape[1:3] == (a.nkv, a.bs)
        assert a.bt.shape[1] == _i32(maxb)
        if a.qsl is None:
            assert a.ntok == a.sl.shape[0] and a.mql == 1
        return a

    def _pa_grid(self, a: SimpleNamespace, grid: Any, block: Any, z: int) -> None:
        group = a.nh // a.nkv
        rows = self.defines["HAL_GQA"]
        assert rows == (min(1 << (group - 1).bit_length(), 8) if a.mql == 1 else 8)
        assert grid == (a.nkv * -(-a.mql * group // rows), a.sl.shape[0], z) and block == (128, 1, 1)

    @staticmethod
    def _pa_sequence(a: SimpleNamespace, s: int, checks: tuple[Any, ...]) -> tuple[int, int, int]:
        """(first row, q_len, code) of sequence s after hal_index_checks.cuh (code 0: readable; the flag set)."""
        num_blocks, limit, flag = _i32(checks[0]), _i32(checks[1]), _ptr(checks[2], np.int32)
        assert flag.shape == (1,), "the error flag is one int32"
        n = int(a.sl[s])
        code = 0
        if a.qsl is None:
            q0, q_len = s, 1
        else:
            q0, q_len = int(a.qsl[s]), int(a.qsl[s + 1]) - int(a.qsl[s])
            ok = a.qsl[0] == 0 and a.qsl[-1] == a.ntok and (np.diff(a.qsl) >= 0).all()
            if not ok or q0 < 0 or q_len < 0 or q0 + q_len > a.ntok or q_len > min(a.mql, n):
                code = 8
        if n < 0 or n > min(limit, a.bt.shape[1] * a.bs):
            code |= 2
        elif code == 0 and n > 0:
            first = max(0, n - q_len - a.window + 1) if a.window > 0 else 0
            used = a.bt[s, first // a.bs:(n - 1) // a.bs + 1]
            code = 1 if ((used < 0) | (used >= num_blocks)).any() else 0
        flag[0] |= code
        return q0, q_len, code

    @staticmethod
    def _pa_rows(a: SimpleNamespace, s: int, q0: int, q_len: int, t0: int, t1: int) -> tuple[Any, ...]:
        """Unnormalised output, max and exp-sum of sequence s's rows [q_len, heads] over keys [t0, t1)."""
        n = int(a.sl[s])
        group = a.nh // a.nkv
        t = np.arange(t0, t1)
        blocks = a.bt[s, t // a.bs]
        keys = np.repeat(a.kc[blocks, :, t % a.bs], group, axis=1)  # [T, heads, d]
        values = np.repeat(a.vc[blocks, :, t % a.bs], group, axis=1)
        pos = n - q_len + np.arange(q_len)
        x = np.einsum("ihd,thd->iht", a.q[q0:q0 + q_len] * np.float32(a.scale), keys)
        if a.softcap > 0:
            x = a.softcap * np.tanh(x / a.softcap)
        if a.slopes is not None:
            x = x + a.slopes[None, :, None] * (t[None, None, :] - pos[:, None, None])
        visible = t[None, :] <= pos[:, None]
        if a.window > 0:
            visible &= t[None, :] > pos[:, None] - a.window
        x = np.where(visible[:, None, :], x, -np.inf).astype(np.float32)
        m = x.max(axis=2, initial=-np.inf)
        with np.errstate(invalid="ignore"):
            p = np.exp(x - np.where(m == -np.inf, 0, m)[:, :, None])
        return np.einsum("iht,thd->ihd", p, values), m, p.sum(axis=2)

    def hal_paged_attention(self, grid: Any, block: Any, out: Any, *rest: Any) -> None:
        assert len(rest) == 26, "hal_paged_attention takes 27 parameters"
        a = self._pa_varlen(rest[:23])
        self._pa_grid(a, grid, block, 1)
        self._pa_single(a, out, rest[23:])

    def _pa_single(self, a: SimpleNamespace, out: Any, checks: tuple[Any, ...]) -> None:
        o = _ptr(out)
        # Rows no CTA places keep what the output held (the op allocates it zeroed for prefill rows).
        result = _floats(o, self.defines["HAL_DTYPE"]) if a.qsl is not None else np.zeros(a.q.shape, np.float32)
        for s in range(a.sl.shape[0]):
            q0, q_len, code = self._pa_sequence(a, s, checks)
            if code:
                if q0 >= 0 and 0 <= q_len <= a.mql and q0 + q_len <= a.ntok:
                    result[q0:q0 + q_len] = 0
                continue
            n = int(a.sl[s])
            if q_len == 0 or n == 0:
                result[q0:q0 + q_len] = 0
                continue
            acc, m, lsum = self._pa_rows(a, s, q0, q_len, 0, n)
            if a.sinks is not None:
                top = np.maximum(m, a.sinks[None, :])
                f = np.exp(m - top)
                acc, lsum = acc * f[:, :, None], lsum * f + np.exp(a.sinks[None, :] - top)
            result[q0:q0 + q_len] = acc / lsum[:, :, None]
        _store(o, result, self.defines["HAL_DTYPE"])

    def hal_paged_attention_split(self, grid: Any, block: Any, tmp_out: Any, max_logits: Any, exp_sums: Any,
                                  *rest: Any) -> None:
        assert len(rest) == 28, "hal_paged_attention_split takes 31 parameters"
        a = self._pa_varlen(rest[:23])
        ps, parts = _i32(rest[23]), _i32(rest[24])
        self._pa_grid(a, grid, block, parts)
        self._pa_split(a, tmp_out, max_logits, exp_sums, ps, parts, rest[25:])

    def _pa_split(self, a: SimpleNamespace, tmp_out: Any, max_logits: Any, exp_sums: Any, ps: int, parts: int,
                  checks: tuple[Any, ...]) -> None:
        tmp, ml, es = _ptr(tmp_out, np.float32), _ptr(max_logits, np.float32), _ptr(exp_sums, np.float32)
        assert tmp.shape == (a.ntok, a.nh, parts, a.q.shape[2]) and ml.shape == es.shape == (a.ntok, a.nh, parts)
        for s in range(a.sl.shape[0]):
            q0, q_len, code = self._pa_sequence(a, s, checks)
            rows = slice(q0, q0 + q_len)
            if code:
                if q0 >= 0 and 0 <= q_len <= a.mql and q0 + q_len <= a.ntok:
                    ml[rows], es[rows] = 0, -1  # marked: the reduce writes zeros
                continue
            n = int(a.sl[s])
            for p in range(parts):
                t0 = p * ps
                if t0 >= n or q_len == 0:
                    continue  # writes nothing
                acc, m, lsum = self._pa_rows(a, s, q0, q_len, t0, min(t0 + ps, n))
                tmp[rows, :, p], ml[rows, :, p], es[rows, :, p] = acc, m, lsum

    def hal_paged_attention_reduce(self, grid: Any, block: Any, out: Any, tmp_out: Any, max_logits: Any,
                                   exp_sums: Any, seq_lens: Any, query_start_loc: Any, sinks: Any, nh: Any,
                                   num_seqs: Any, mql: Any, ps: Any, parts: Any) -> None:
        o = _ptr(out)
        tmp, ml, es = _ptr(tmp_out, np.float32), _ptr(max_logits, np.float32), _ptr(exp_sums, np.float32)
        sl, nh, ps, parts = _ptr(seq_lens, np.int32), _i32(nh), _i32(ps), _i32(parts)
        qsl, sk = _ptr(query_start_loc, np.int32, nullable=True), _ptr(sinks, np.float32, nullable=True)
        num_seqs, mql = _i32(num_seqs), _i32(mql)
        assert sl.shape == (num_seqs,) and (qsl is not None or mql == 1)
        # grid z: column slices of every head (together they cover each row once)
        assert grid[:2] == (nh, o.shape[0]) and o.shape[-1] % grid[2] == 0 and o.shape[-1] // grid[2] >= 32
        result = np.zeros(o.shape, np.float32)
        for row in range(o.shape[0]):
            s = row
            if qsl is not None:
                s = max(0, int(np.searchsorted(qsl[:num_seqs], row, side="right")) - 1)
                q0, q1 = int(qsl[s]), int(qsl[s + 1])
                if not (0 <= q0 <= row < q1 <= o.shape[0] and q1 - q0 <= mql):
                    continue  # zeros
            n = min(-(-int(sl[s]) // ps), parts)
            if n <= 0 or (es[row, :, :n] < 0).any():  # empty, or a partition marked by the index checks: zeros
                continue
            m = ml[row, :, :n].max(axis=1)
            if sk is not None:
                m = np.maximum(m, sk)
            w = np.exp(ml[row, :, :n] - m[:, None])
            den = (w * es[row, :, :n]).sum(axis=1) + (0 if sk is None else np.exp(sk - m))
            result[row] = (w[:, :, None] * tmp[row, :, :n]).sum(axis=1) / den[:, None]
        _store(o, result, self.defines["HAL_DTYPE"])

    # -- paged_attention_tc.cu ----------------------------------------------------------------

    def hal_paged_attention_tc(self, grid: Any, block: Any, out: Any, tmp_out: Any, max_logits: Any,
                               exp_sums: Any, *rest: Any) -> None:
        assert len(rest) == 28, "hal_paged_attention_tc takes 32 parameters"
        a = self._pa_varlen(rest[:23])
        ps, parts, checks = _i32(rest[23]), _i32(rest[24]), rest[25:]
        group = a.nh // a.nkv
        assert grid == (a.nkv * -(-a.mql * group // 16), a.sl.shape[0], parts) and block == (128, 1, 1)
        assert ps % {64: 64, 128: 32}.get(a.q.shape[2], 16) == 0, "partitions are whole chunks"
        assert tuple(rest[17:20]) == tuple(rest[20:23]), "the tensor-core kernel takes equal K and V strides"
        if parts == 1:
            assert _ptr(tmp_out, nullable=True) is None and _ptr(max_logits, nullable=True) is None
            assert _ptr(exp_sums, nullable=True) is None
            self._pa_single(a, out, checks)
            return
        assert _ptr(out, nullable=True) is None
        self._pa_split(a, tmp_out, max_logits, exp_sums, ps, parts, checks)

    # -- write_kv_cache.cu -------------------------------------------------------------------

    def hal_write_kv_cache(self, grid: Any, block: Any, key: Any, value: Any, key_cache: Any, value_cache: Any,
                           slots: Any, nkv: Any, bs: Any, row_bytes: Any, num_blocks: Any, error_flag: Any) -> None:
        slot_dtype = np.int64 if self.defines["HAL_SLOT_INT64"] else np.int32
        k, v, kc, vc = (_ptr(a) for a in (key, value, key_cache, value_cache))
        slots = _ptr(slots, slot_dtype)
        nkv, bs, row_bytes, num_blocks = _i32(nkv), _i32(bs), _i32(row_bytes), _i32(num_blocks)
        flag = _ptr(error_flag, np.int32)
        assert grid == (k.shape[0], 1, 1) and row_bytes == k.shape[2] * k.dtype.itemsize
        assert num_blocks == kc.shape[0]
        for t, slot in enumerate(slots):
            if slot >= num_blocks * bs:
                flag[0] |= 4  # skipped, slot_mapping reported
            elif slot >= 0:
                kc[slot // bs, :, slot % bs] = k[t]
                vc[slot // bs, :, slot % bs] = v[t]

    # -- rms_norm.cu, gated_activation.cu ---------------------------------------------------

    def hal_rms_norm(self, grid: Any, block: Any, out: Any, x: Any, weight: Any, residual: Any, x_stride: Any,
                     residual_stride: Any, hidden: Any, epsilon: Any, weight_offset: Any) -> None:
        code = self.defines["HAL_DTYPE"]
        o, w = _ptr(out), _ptr(weight)
        hidden = _i32(hidden)
        assert isinstance(epsilon, np.float32) and isinstance(weight_offset, np.float32)
        xr = _row_view(x, _i64(x_stride), hidden)
        assert grid == (o.shape[0], 1, 1) and o.shape == (xr.shape[0], hidden) == (xr.shape[0], w.shape[0])
        h = _floats(xr, code)
        if not (isinstance(residual, np.uint64) and int(residual) == 0):
            rr = _row_view(residual, _i64(residual_stride), hidden)
            _store(rr, h + _floats(rr, code), code)
            h = _floats(rr, code)
        with np.errstate(invalid="ignore", divide="ignore", over="ignore"):
            scale = np.float32(1) / np.sqrt(np.mean(h * h, axis=1, keepdims=True) + epsilon)
            _store(o, h * scale * (_floats(w, code) + weight_offset), code)

    def hal_gated_activation(self, grid: Any, block: Any, out: Any, gate: Any, up: Any, gate_stride: Any,
                             up_stride: Any, inter: Any, activation: Any) -> None:
        from hal_core.ops.gated_activation import ACTIVATIONS, activate

        code = self.defines["HAL_DTYPE"]
        o, inter = _ptr(out), _i32(inter)
        g, u = _row_view(gate, _i64(gate_stride), inter), _row_view(up, _i64(up_stride), inter)
        columns = block[0] * 16 // np.dtype(o.dtype).itemsize
        assert grid == (o.shape[0], -(-inter // columns), 1) and o.shape == g.shape == u.shape
        with np.errstate(invalid="ignore", over="ignore"):
            _store(o, activate(_floats(g, code), ACTIVATIONS[_i32(activation)]) * _floats(u, code), code)
    # -- rotary_embedding.cu -----------------------------------------------------------------

    def hal_rotary_embedding(self, grid: Any, block: Any, positions: Any, query: Any, key: Any, table: Any,
                             q_token_stride: Any, q_head_stride: Any, k_token_stride: Any, k_head_stride: Any,
                             num_heads: Any, num_kv_heads: Any, rotary_dim: Any, gptj: Any, max_position: Any,
                             error_flag: Any) -> None:
        from hal_core.ops.rotary_embedding import rotary_pairs

        code = self.defines["HAL_DTYPE"]
        pos = _ptr(positions, np.int64 if self.defines["HAL_POS_INT64"] else np.int32)
        q = _rows(query, q_token_stride, q_head_stride)
        k = _rows(key, k_token_stride, k_head_stride, nullable=True)
        cs = _ptr(table, np.float32)
        nh, nkv, rd, gptj = _i32(num_heads), _i32(num_kv_heads), _i32(rotary_dim), _i32(gptj)
        assert isinstance(max_position, np.int64) and int(max_position) == cs.shape[0]
        flag = _ptr(error_flag, np.int32)
        assert grid == (q.shape[0], 1, 1) and block == (128, 1, 1) and nh == q.shape[1] and rd == cs.shape[1]
        assert nkv == (0 if k is None else k.shape[1])
        first, second = rotary_pairs(rd, "gptj" if gptj else "neox")
        for t, p in enumerate(pos):
            if not 0 <= p < cs.shape[0]:
                flag[0] |= 128  # left as it is, positions reported
                continue
            cos, sin = cs[p, : rd // 2], cs[p, rd // 2:]
            for x in (q, k):
                if x is not None:
                    x1, x2 = _floats(x[t][..., first], code), _floats(x[t][..., second], code)
                    _store(x[t][..., first], x1 * cos - x2 * sin, code)
                    _store(x[t][..., second], x2 * cos + x1 * sin, code)

    # -- quant_gemm.cu -----------------------------------------------------------------------

    def _gemm(self, grid: Any, out: Any, ws: Any, acts: np.ndarray, weight: np.ndarray, row_scale: Any,
              m: int, n: int, k: int, g: int, per_split: int) -> None:
        code = self.defines["HAL_DTYPE"]
        o = _ptr(out)
        ws = _ptr(ws, np.float32, nullable=True)
        m_tile = self.defines["HAL_M_TILE"]
        ksplit = grid[1]
        columns = 4 * self.defines.get("HAL_WARP_SIZE", 32)  # four warps/wavefronts, one column each
        assert grid == (-(-n // columns), ksplit, -(-m // m_tile)), grid
        assert (ws is None) == (ksplit == 1)
        groups = k // g
        for y in range(ksplit):
            lo, hi = y * per_split * g, min((y + 1) * per_split, groups) * g
            part = acts[:, lo:hi] @ weight[lo:hi]
            if row_scale is not None:
                part = part * row_scale[:, None]
            if ksplit == 1:
                _store(o, part, code)
            else:
                ws[y] = part

    def hal_w4a16_gemm(self, grid: Any, block: Any, out: Any, ws: Any, x: Any, qweight: Any, scales: Any,
                       zeros: Any, m: Any, n: Any, k: Any, g: Any, per_split: Any) -> None:
        assert self.defines["HAL_QBITS"] == 4
        m, n, k, g = _i32(m), _i32(n), _i32(k), _i32(g)
        xf = _floats(_ptr(x), self.defines["HAL_DTYPE"])
        w = _dequant(_codes4(_ptr(qweight, np.uint32)), _ptr(scales, np.float16),
                     _ptr(zeros, np.uint8, nullable=True), g, 8)
        self._gemm(grid, out, ws, xf, w, None, m, n, k, g, _i32(per_split))

    def hal_w8a8_gemm(self, grid: Any, block: Any, out: Any, ws: Any, xq: Any, sx: Any, qweight: Any, scales: Any,
                      zeros: Any, m: Any, n: Any, k: Any, g: Any, per_split: Any) -> None:
        assert self.defines["HAL_QBITS"] == 8
        m, n, k, g = _i32(m), _i32(n), _i32(k), _i32(g)
        w = _dequant(_ptr(qweight, np.uint8), _ptr(scales, np.float16), _ptr(zeros, np.uint8, nullable=True), g, 128)
        acts = _ptr(xq, np.int8).astype(np.float32)
        self._gemm(grid, out, ws, acts, w, _ptr(sx, np.float32), m, n, k, g, _i32(per_split))

    # -- quant_gemm_tc.cu --------------------------------------------------------------------

    @staticmethod
    def _tc_weight(qtc: np.ndarray, bits: int, k: int, npad: int) -> np.ndarray:
        """Codes [K, npad] (W8: q - 128 as int) read back from the tensor-core layout, element by element."""
        kb_count = k // 32
        out = np.zeros((k, npad), np.int64)
        words = np.asarray(qtc).view(np.uint32).reshape(kb_count, npad // 32, 32, -1)  # kb, cg, lane, word
        for lane in range(32):
            group, tig = lane >> 2, lane % 4
            for j in range(4):
                cols = np.arange(npad // 32) * 32 + 8 * j + group
                if bits == 4:
                    for p in range(4):
                        for e in range(2):
                            rows = np.arange(kb_count) * 32 + 16 * (p // 2) + 8 * (p % 2) + 2 * tig + e
                            out[np.ix_(rows, cols)] = (words[:, :, lane, j] >> (4 * (p + 4 * e))) & 0xF
                else:
                    for i in range(2):
                        for b in range(4):
                            rows = np.arange(kb_count) * 32 + 16 * i + 4 * tig + b
                            byte = (words[:, :, lane, 2 * j + i] >> (8 * b)) & 0xFF
                            out[np.ix_(rows, cols)] = byte.astype(np.uint8).view(np.int8)
        return out

    def _tc_gemm(self, grid: Any, out: Any, ws: Any, acts: np.ndarray, weight: np.ndarray, row_scale: Any,
                 m: int, n: int, k: int, per_split: int) -> None:
        code = self.defines["HAL_DTYPE"]
        frags = self.defines["HAL_M_FRAGS"]
        ksplit = grid[1]
        assert grid == (-(-n // 128), ksplit, -(-m // (16 * frags))), grid
        ws = _ptr(ws, np.float32, nullable=True)
        assert (ws is None) == (ksplit == 1)
        kblocks = k // 32
        assert ksplit == -(-kblocks // per_split)
        parts = []
        for y in range(ksplit):
            lo, hi = 32 * y * per_split, 32 * min((y + 1) * per_split, kblocks)
            part = acts[:, lo:hi] @ weight[lo:hi]
            parts.append(part * row_scale[:, None] if row_scale is not None else part)
        if ksplit == 1:
            _store(_ptr(out), parts[0], code)
        else:
            ws[...] = np.stack(parts)

    def hal_w4a16_gemm_tc(self, grid: Any, block: Any, out: Any, ws: Any, x: Any, qtc: Any, scales: Any,
                          zeros: Any, m: Any, n: Any, k: Any, g: Any, per_split: Any) -> None:
        assert self.defines["HAL_QBITS"] == 4 and block == (128, 1, 1)
        m, n, k, g = _i32(m), _i32(n), _i32(k), _i32(g)
        npad = grid[0] * 128
        codes = self._tc_weight(_ptr(qtc, np.uint32), 4, k, npad)
        w = _dequant(codes, _ptr(scales, np.float16), _ptr(zeros, np.uint8, nullable=True), g, 8)[:, :n]
        self._tc_gemm(grid, out, ws, _floats(_ptr(x), self.defines["HAL_DTYPE"]), w, None, m, n, k, _i32(per_split))

    def hal_w8a8_gemm_tc(self, grid: Any, block: Any, out: Any, ws: Any, xq: Any, sx: Any, qtc: Any, scales: Any,
                         zeros: Any, m: Any, n: Any, k: Any, g: Any, per_split: Any) -> None:
        assert self.defines["HAL_QBITS"] == 8 and block == (128, 1, 1)
        m, n, k, g = _i32(m), _i32(n), _i32(k), _i32(g)
        npad = grid[0] * 128
        codes = self._tc_weight(_ptr(qtc, np.uint32), 8, k, npad) + 128
        w = _dequant(codes, _ptr(scales, np.float16), _ptr(zeros, np.uint8, nullable=True), g, 128)[:, :n]
        acts = _ptr(xq, np.int8).astype(np.float32)
        self._tc_gemm(grid, out, ws, acts, w, _ptr(sx, np.float32), m, n, k, _i32(per_split))

    def hal_w4a8_gemm_tc(self, grid: Any, block: Any, out: Any, ws: Any, xq: Any, sx: Any, qtc: Any, scales: Any,
                         zeros: Any, m: Any, n: Any, k: Any, g: Any, per_split: Any) -> None:
        assert self.defines["HAL_QBITS"] == 4 and self.defines["HAL_ABITS"] == 8 and block == (128, 1, 1)
        m, n, k, g = _i32(m), _i32(n), _i32(k), _i32(g)
        npad = grid[0] * 128
        codes = self._tc_weight(_ptr(qtc, np.uint32), 4, k, npad)
        w = _dequant(codes, _ptr(scales, np.float16), _ptr(zeros, np.uint8, nullable=True), g, 8)[:, :n]
        acts = _ptr(xq, np.int8)[:, _w4a8_columns(k)].astype(np.float32)  # back to column order
        self._tc_gemm(grid, out, ws, acts, w, _ptr(sx, np.float32), m, n, k, _i32(per_split))

    def hal_tc_reduce(self, grid: Any, block: Any, out: Any, ws: Any, count: Any, splits: Any) -> None:
        assert isinstance(count, np.int64) and block == (128, 1, 1)
        parts = _ptr(ws, np.float32)
        assert parts.shape[0] == _i32(splits) and parts[0].size == int(count)
        total = parts[0].copy()
        for y in range(1, parts.shape[0]):
            total = total + parts[y]
        _store(_ptr(out), total, self.defines["HAL_DTYPE"])

    # -- quant_util.cu -----------------------------------------------------------------------

    def hal_w4a16_dequant(self, grid: Any, block: Any, w: Any, qweight: Any, scales: Any, zeros: Any, k: Any,
                          n: Any, g: Any) -> None:
        assert block == (256, 1, 1)
        _store(_ptr(w), _dequant(_codes4(_ptr(qweight, np.uint32)), _ptr(scales, np.float16),
                                 _ptr(zeros, np.uint8, nullable=True), _i32(g), 8), self.defines["HAL_DTYPE"])

    def hal_w8_dequant(self, grid: Any, block: Any, w: Any, qweight: Any, scales: Any, zeros: Any, k: Any,
                       n: Any, g: Any) -> None:
        assert block == (256, 1, 1)
        _store(_ptr(w), _dequant(_ptr(qweight, np.uint8), _ptr(scales, np.float16),
                                 _ptr(zeros, np.uint8, nullable=True), _i32(g), 128), self.defines["HAL_DTYPE"])

    def hal_w8a8_quantize_rows(self, grid: Any, block: Any, xq: Any, sx: Any, x: Any, k: Any) -> None:
        xf = _floats(_ptr(x), self.defines["HAL_DTYPE"])
        assert grid == (xf.shape[0], 1, 1) and _i32(k) == xf.shape[1]
        finite = np.isfinite(xf).all(axis=1)  # a row holding NaN or inf: sx NaN, xq 0
        xf = np.where(finite[:, None], xf, np.float32(0))
        amax = np.abs(xf).max(axis=1)
        tiny = np.finfo(np.float32).smallest_subnormal
        scale = np.where(amax > 0, np.maximum(amax / np.float32(127), tiny), np.float32(1)).astype(np.float32)
        _ptr(sx, np.float32)[...] = np.where(finite, scale, np.float32(np.nan))
        _ptr(xq, np.int8)[...] = np.clip(np.rint(xf / scale[:, None]), -127, 127).astype(np.int8)

    def hal_w4a8_quantize_rows(self, grid: Any, block: Any, xq: Any, sx: Any, x: Any, k: Any) -> None:
        self.hal_w8a8_quantize_rows(grid, block, xq, sx, x, k)  # column order, then moved to the MMA's
        codes = _ptr(xq, np.int8)
        codes[:, _w4a8_columns(_i32(k))] = codes.copy()

    def hal_f32_splits_to_dtype(self, grid: Any, block: Any, out: Any, ws: Any, count: Any, splits: Any) -> None:
        assert isinstance(count, np.int64)
        o = _ptr(out)
        parts = _ptr(ws, np.float32)
        assert o.size == int(count) and parts.shape[0] == _i32(splits)
        total = parts[0].astype(np.float32)
        for y in range(1, parts.shape[0]):  # in split order, in float32, as the kernel adds
            total = total + parts[y]
        _store(o, total, self.defines["HAL_DTYPE"])

    def hal_f32_to_dtype(self, grid: Any, block: Any, out: Any, ws: Any, count: Any) -> None:
        assert isinstance(count, np.int64)
        o = _ptr(out)
        assert o.size == int(count)
        _store(o, _ptr(ws, np.float32), self.defines["HAL_DTYPE"])

    # -- fused_moe.cu ------------------------------------------------------------------------

    def hal_moe_route(self, grid: Any, block: Any, ids: Any, weights: Any, counts: Any, logits: Any, tokens: Any,
                      experts: Any, top_k: Any, routing: Any) -> None:
        from hal_core.ops.fused_moe import ROUTINGS, reference_routing

        t, e, k = _i32(tokens), _i32(experts), _i32(top_k)
        values = _ptr(logits, np.float32).reshape(t, e)
        assert grid[0] * block[0] >= t
        chosen, w = reference_routing(values, k, ROUTINGS[_i32(routing)])
        _ptr(ids, np.int32)[...] = chosen.reshape(-1)
        _ptr(weights, np.float32)[...] = w.reshape(-1).astype(np.float32)
        _ptr(counts, np.int32)[...] += np.bincount(chosen.reshape(-1), minlength=e).astype(np.int32)

    def hal_moe_align(self, grid: Any, block: Any, offsets: Any, tile_expert: Any, sorted_pairs: Any, cursor: Any,
                      counts: Any, experts: Any, max_tiles: Any) -> None:
        tile = self.defines.get("HAL_MOE_TILE", 8)
        c = _ptr(counts, np.int32)
        padded = -(-c // tile) * tile
        o = _ptr(offsets, np.int32)
        o[0], o[1:] = 0, np.cumsum(padded)
        te = _ptr(tile_expert, np.int32)
        te[...] = -1
        te[: o[-1] // tile] = np.repeat(np.arange(_i32(experts)), padded // tile)
        _ptr(sorted_pairs, np.int32)[...] = -1
        _ptr(cursor, np.int32)[...] = 0
        assert grid == (1, 1, 1) and te.size == _i32(max_tiles)

    def hal_moe_scatter(self, grid: Any, block: Any, sorted_pairs: Any, cursor: Any, ids: Any, offsets: Any,
                        pairs: Any) -> None:
        sp, cur, o = _ptr(sorted_pairs, np.int32), _ptr(cursor, np.int32), _ptr(offsets, np.int32)
        for p, e in enumerate(_ptr(ids, np.int32)[: _i32(pairs)]):
            sp[o[e] + cur[e]] = p
            cur[e] += 1

    def _moe_weight(self, table: Any, e: int, k: int, n: int, g: int) -> np.ndarray:
        """Expert ``e``'s [k, n] weight from the address table, dequantised in float32."""
        q, s, z = (int(a) for a in _ptr(table, np.int64).reshape(-1, 3)[e])
        bits = self.defines["HAL_QBITS"]
        scales = _from_address(s, k // g * n, np.float16).reshape(k // g, n)
        zeros = None if z == 0 else _from_address(z, k // g * n, np.uint8).reshape(k // g, n)
        if bits == 4:
            codes = _codes4(_from_address(q, k // 8 * n, np.uint32).reshape(k // 8, n))
        else:
            codes = _from_address(q, k * n, np.uint8).reshape(k, n)
        return _dequant(codes, scales, zeros, g, 8 if bits == 4 else 128)

    def _moe_tiles(self, sorted_pairs: Any, tile_expert: Any, offsets: Any, experts: Any) -> list[tuple[int, int]]:
        """(tile, expert) of every tile within the padded total."""
        tile = self.defines.get("HAL_MOE_TILE", 8)
        total = int(_ptr(offsets, np.int32)[_i32(experts)])
        return [(t, int(e)) for t, e in enumerate(_ptr(tile_expert, np.int32)) if t * tile < total]

    def _moe_gate_up(self, act: Any, rows_of: Any, sorted_pairs: Any, tile_expert: Any, offsets: Any, w13: Any,
                     hidden: Any, inter: Any, group: Any, top_k: Any, experts: Any, activation: Any) -> None:
        from hal_core.ops.gated_activation import ACTIVATIONS, activate

        tile, h, i, g = self.defines.get("HAL_MOE_TILE", 8), _i32(hidden), _i32(inter), _i32(group)
        a, sp = _ptr(act, np.float32).reshape(-1, i), _ptr(sorted_pairs, np.int32)
        for t, e in self._moe_tiles(sorted_pairs, tile_expert, offsets, experts):
            pairs = sp[t * tile:(t + 1) * tile]
            valid = pairs >= 0
            y = rows_of(pairs[valid] // _i32(top_k)) @ self._moe_weight(w13, e, h, 2 * i, g)
            a[t * tile:(t + 1) * tile] = 0
            with np.errstate(invalid="ignore", over="ignore"):
                a[t * tile:(t + 1) * tile][valid] = activate(y[:, :i], ACTIVATIONS[_i32(activation)]) * y[:, i:]

    def hal_moe_w4_gate_up(self, grid: Any, block: Any, act: Any, x: Any, *rest: Any) -> None:
        xf = _floats(_ptr(x), self.defines["HAL_DTYPE"])
        self._moe_gate_up(act, lambda tokens: xf[tokens], *rest)

    def hal_moe_w8_gate_up(self, grid: Any, block: Any, act: Any, xq: Any, sx: Any, *rest: Any) -> None:
        q, s = _ptr(xq, np.int8), _ptr(sx, np.float32)
        self._moe_gate_up(act, lambda tokens: q[tokens].astype(np.float32) * s[tokens][:, None], *rest)

    hal_moe_w4a8_gate_up = hal_moe_w8_gate_up  # the codes' width comes from HAL_QBITS (_moe_weight)

    def _moe_down(self, y: Any, rows_of: Any, sorted_pairs: Any, tile_expert: Any, offsets: Any, w2: Any,
                  hidden: Any, inter: Any, group: Any, experts: Any) -> None:
        tile, h, i, g = self.defines.get("HAL_MOE_TILE", 8), _i32(hidden), _i32(inter), _i32(group)
        out, sp = _ptr(y, np.float32).reshape(-1, h), _ptr(sorted_pairs, np.int32)
        for t, e in self._moe_tiles(sorted_pairs, tile_expert, offsets, experts):
            slots = np.arange(t * tile, (t + 1) * tile)
            valid = sp[slots] >= 0
            out[sp[slots][valid]] = rows_of(slots[valid]) @ self._moe_weight(w2, e, i, h, g)

    def hal_moe_w4_down(self, grid: Any, block: Any, y: Any, act: Any, *rest: Any) -> None:
        a = _ptr(act, np.float32).reshape(-1, _i32(rest[5]))
        self._moe_down(y, lambda slots: a[slots], *rest)

    def hal_moe_w8_down(self, grid: Any, block: Any, y: Any, aq: Any, sa: Any, *rest: Any) -> None:
        q, s = _ptr(aq, np.int8), _ptr(sa, np.float32)
        self._moe_down(y, lambda slots: q[slots].astype(np.float32) * s[slots][:, None], *rest)

    hal_moe_w4a8_down = hal_moe_w8_down

    def hal_moe_combine(self, grid: Any, block: Any, out: Any, y: Any, weights: Any, hidden: Any,
                        top_k: Any) -> None:
        o, k = _ptr(out), _i32(top_k)
        ys = _ptr(y, np.float32).reshape(o.shape[0], k, _i32(hidden))
        w = _ptr(weights, np.float32).reshape(o.shape[0], k)
        total = np.zeros(o.shape, np.float32)
        with np.errstate(invalid="ignore", over="ignore"):
            for j in range(k):  # in slot order, as the kernel adds
                total = total + w[:, j:j + 1] * ys[:, j]
        _store(o, total, self.defines["HAL_DTYPE"])

    # -- sample.cu ---------------------------------------------------------------------------

    def hal_sample(self, grid: Any, block: Any, logits: Any, row_stride: Any, vocab: Any, temperature: Any,
                   top_k: Any, top_p: Any, min_p: Any, seeds: Any, out: Any, error_flag: Any) -> None:
        from hal_core.testing.sampling import kept_weights, uniform_of_seed

        assert isinstance(logits, DevArray) and logits.ndim == 2 and logits.strides[1] == logits.itemsize
        assert isinstance(row_stride, np.int64) and int(row_stride) * logits.itemsize == logits.strides[0]
        rows, n = logits.shape[0], _i32(vocab)
        assert grid == (rows, 1, 1) and n == logits.shape[1]
        x = _floats(np.ascontiguousarray(np.asarray(logits)), self.defines["HAL_DTYPE"]).astype(np.float64)
        t, seed = _ptr(temperature, np.float32), _ptr(seeds, np.int64)
        k, p, mp = _ptr(top_k, np.int32, True), _ptr(top_p, np.float32, True), _ptr(min_p, np.float32, True)
        o, flag = _ptr(out, np.int64), _ptr(error_flag, np.int32)
        for r in range(rows):
            tr, pr, mr = float(t[r]), 1.0 if p is None else float(p[r]), 0.0 if mp is None else float(mp[r])
            bad = (0 if 0 <= tr < np.inf else 16) | (0 if 0 < pr <= 1 else 32) | (0 if 0 <= mr <= 1 else 64)
            flag[0] |= bad
            weights = None if bad else kept_weights(x[r], tr, 0 if k is None else int(k[r]), pr, mr)
            if weights is None:
                o[r] = -1
                continue
            cdf = np.cumsum(weights)
            o[r] = min(int(np.searchsorted(cdf, uniform_of_seed(int(seed[r])) * cdf[-1], side="right")),
                       int(np.flatnonzero(weights)[-1]))


class EmulatedModule:
    """``cupy.RawModule`` over the emulated kernels; records what was compiled."""

    compiled: list[tuple[str, tuple[str, ...]]] = []  # noqa: RUF012 - a log shared by every module

    def __init__(self, code: str, options: tuple[str, ...] = ()) -> None:
        self.code, self.options = code, tuple(options)
        self.defines = {o[2:].split("=")[0]: int(o.split("=")[1]) for o in options if o.startswith("-D")}

    def compile(self) -> None:
        EmulatedModule.compiled.append((self.code, self.options))

    def get_function(self, name: str) -> Kernel:
        assert f"void {name}" in self.code or f"\n{name}(" in self.code, f"{name} is not in the source"
        return Kernel(name, self.defines)


class NumpyCupy(fakecupy.FakeCupy):
    """The fake CuPy of fakecupy.py plus numpy-backed array functions returning DevArray."""

    def __init__(self) -> None:
        super().__init__(total=1 << 34)
        self.ndarray = DevArray
        self.RawModule = EmulatedModule
        EmulatedModule.compiled = []
        self.cuda.cublas = SimpleNamespace(gemmEx=_gemm_ex)
        self.cuda.device = SimpleNamespace(get_cublas_handle=lambda: 1)
        self.gemm_calls: list[dict[str, Any]] = GEMM_CALLS
        GEMM_CALLS.clear()

    @staticmethod
    def empty(shape: Any, dtype: Any = np.float32) -> DevArray:
        return _poison(shape, dtype)

    @staticmethod
    def asarray(array: Any) -> DevArray:
        return np.array(array).view(DevArray)

    @staticmethod
    def zeros(shape: Any, dtype: Any = np.float32) -> DevArray:
        return np.zeros(shape, dtype).view(DevArray)

    @staticmethod
    def arange(*args: Any, **kwargs: Any) -> DevArray:
        return np.arange(*args, **kwargs).view(DevArray)

    @staticmethod
    def ascontiguousarray(array: Any) -> DevArray:
        return np.ascontiguousarray(array).view(DevArray)

    @staticmethod
    def matmul(a: Any, b: Any, out: Any = None) -> DevArray:
        result = np.matmul(np.asarray(a, np.float32), np.asarray(b, np.float32))
        if out is not None:
            out[...] = result.astype(out.dtype)
            return out
        return result.astype(np.result_type(a.dtype, b.dtype)).view(DevArray)


#: Every emulated cuBLAS gemmEx call: shapes, types and beta.
GEMM_CALLS: list[dict[str, Any]] = []
_CUDA_TYPES = {0: np.float32, 2: np.float16, 14: np.uint16}  # CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF


def _from_address(ptr: int, count: int, dtype: Any) -> np.ndarray:
    """A writable view of ``count`` elements of ``dtype`` at a raw host address (the emulated device memory)."""
    dtype = np.dtype(dtype)
    return np.ctypeslib.as_array((ctypes.c_uint8 * (count * dtype.itemsize)).from_address(ptr)).view(dtype)


def _as_float(values: np.ndarray, cuda_type: int) -> np.ndarray:
    return values.view(BFLOAT16).astype(np.float64) if cuda_type == 14 else values.astype(np.float64)


def _gemm_ex(handle: Any, transa: int, transb: int, m: int, n: int, k: int, alpha: int, a: int, atype: int, lda: int,
             b: int, btype: int, ldb: int, beta: int, c: int, ctype: int, ldc: int, compute: int, algo: int) -> None:
    """cublasGemmEx, column-major, no transposes, host alpha/beta, fp32 compute (what the CUDA plugin uses)."""
    assert (transa, transb, compute) == (0, 0, 68) and atype == btype
    alpha_v = float(_from_address(alpha, 1, np.float32)[0])
    beta_v = float(_from_address(beta, 1, np.float32)[0])
    # Column-major A [m, k] (ld lda), B [k, n] (ld ldb), C [m, n] (ld ldc), as row-major transposes.
    a_cm = _as_float(_from_address(a, lda * (k - 1) + m, _CUDA_TYPES[atype]), atype)
    b_cm = _as_float(_from_address(b, ldb * (n - 1) + k, _CUDA_TYPES[btype]), btype)
    a_mat = np.stack([a_cm[j * lda: j * lda + m] for j in range(k)], axis=1)  # [m, k]
    b_mat = np.stack([b_cm[j * ldb: j * ldb + k] for j in range(n)], axis=1)  # [k, n]
    c_raw = _from_address(c, ldc * (n - 1) + m, _CUDA_TYPES[ctype])
    c_old = np.stack([_as_float(c_raw[j * ldc: j * ldc + m], ctype) for j in range(n)], axis=1)
    result = alpha_v * (a_mat @ b_mat) + (beta_v * c_old if beta_v != 0 else 0.0)
    GEMM_CALLS.append(dict(m=m, n=n, k=k, atype=atype, ctype=ctype, beta=beta_v))
    for j in range(n):
        col = result[:, j].astype(np.float32)
        if ctype == 14:
            c_raw[j * ldc: j * ldc + m] = col.astype(BFLOAT16).view(np.uint16)
        else:
            c_raw[j * ldc: j * ldc + m] = col.astype(_CUDA_TYPES[ctype])


def _poison(shape: Any, dtype: Any) -> DevArray:
    """Uninitialised memory: NaN for floats, 0x5A bytes otherwise (never zeros)."""
    dtype = np.dtype(dtype)
    fill = np.nan if dtype.kind == "f" else (0x5A if dtype.itemsize == 1 else 0x5A5A)
    return np.full(shape, fill, dtype).view(DevArray)
