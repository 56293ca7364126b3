"""Argument checks shared by every op: each error names the argument, expected and actual."""

from __future__ import annotations

import functools
from collections.abc import Collection
from typing import Any, Literal

import numpy as np

from .. import _env
from .._errors import ArgumentError, ArgumentTypeError
from ..arrays import dtype_name, is_c_contiguous, untag

__all__ = [
    "byte_range",
    "check_array",
    "check_block_tables",
    "check_disjoint",
    "check_slots",
    "check_writable",
    "fail",
    "host_index_checks",
    "rows_contiguous",
]

#: Index arrays up to this many entries are checked as Python lists: a numpy reduction costs about 1 us
#: of call overhead whatever its size, while ``tolist()`` and ``min``/``max`` over a few hundred ints
#: cost less than that (the decode steps of a small batch, where the front door is most of the call).
SMALL_INDEX_ARRAY = 256


#: The most candidate solutions :func:`numpy.shares_memory` may try before :func:`check_disjoint` uses its own test
#: (an engine's K and V halves need a handful).
_OVERLAP_WORK = 10_000


def fail(arg: str, expected: str, actual: Any) -> ArgumentError:
    """An ArgumentError in the common format."""
    return ArgumentError(f"argument {arg!r}: expected {expected}, got {actual}")


def host_index_checks(*arrays: Any) -> bool:
    """Whether validation checks these index arrays' values on the host, now, before any work.

    Only host (numpy) arrays, and only with ``HAL_CHECK_INDICES`` on (the
    default). Device arrays are never read back by an op call: the kernels
    check the values they use, never dereference one out of range, and
    record the argument in a device error flag that hal raises as
    :class:`~hal_core.ArgumentError` at its next synchronisation point or
    :func:`hal_core.check_errors` (docs/environment.md).
    """
    for array in arrays:
        if type(array) is not np.ndarray:
            return False
    return _env.check_indices()


def check_array(
    arg: str,
    value: Any,
    *,
    layout: str,
    ndim: int,
    dtypes: Collection[str],
    contiguous: bool | Literal["last"] = True,
    dtype_why: str = "",
) -> str:
    """Check rank, dtype and layout of ``value``; return its dtype name.

    ``layout`` names the dimensions for the message, e.g. ``'[num_seqs, num_heads, head_size]'``.
    ``contiguous``: True requires a C-contiguous array; ``"last"`` only a
    contiguous last dimension and non-negative strides (views such as the
    key slice of a fused QKV projection); False checks no layout.
    ``dtype_why`` follows the expected dtype in the message (``" (the query's)"``).
    """
    if type(value) is np.ndarray:  # the hot path: a valid numpy array answered in a few attribute reads
        name = dtype_name(value)
        if name in dtypes and value.ndim == ndim:
            if contiguous is True and value.flags.c_contiguous:
                return name
            if contiguous == "last" and rows_contiguous(value):
                return name
            if contiguous is False:
                return name
        # anything else: the checks below name what is wrong
    if not hasattr(value, "shape") or not hasattr(value, "dtype"):
        raise ArgumentTypeError(
            f"argument {arg!r}: expected an array {layout}, got {type(value).__name__}"
        )
    allowed = tuple(dtypes)
    name = dtype_name(value)
    if name not in allowed:
        raise ArgumentTypeError(
            f"argument {arg!r}: expected dtype {' or '.join(allowed)}{dtype_why}, got {name}"
        )
    if len(value.shape) != ndim:
        raise fail(arg, f"{ndim} dimensions {layout}", f"shape {tuple(value.shape)}")
    if contiguous == "last":
        _checkrows_contiguous(arg, value)
    elif contiguous and not is_c_contiguous(value):
        raise ArgumentError(
            f"argument {arg!r}: expected a C-contiguous array, got strides "
            f"{getattr(value, 'strides', '?')}; pass a contiguous copy (e.g. ascontiguousarray)"
        )
    return name


def _strides(value: Any) -> tuple[int, ...] | None:
    """Byte strides of ``value`` (its storage's, for a tagged array), or None when it has none."""
    strides = getattr(untag(value), "strides", None)
    return None if strides is None else tuple(int(x) for x in strides)


def rows_contiguous(value: Any) -> bool:
    """Whether ``value``'s last dimension is contiguous and no stride of a dimension above 1 is negative."""
    if is_c_contiguous(value):
        return True
    strides = _strides(value)
    itemsize = getattr(untag(value), "dtype", np.dtype(np.uint8)).itemsize
    shape = tuple(value.shape)
    return not (strides is None or (shape[-1] > 1 and strides[-1] != itemsize) or any(
        x < 0 for x, size in zip(strides, shape, strict=True) if size > 1
    ))


def _checkrows_contiguous(arg: str, value: Any) -> None:
    if not rows_contiguous(value):
        strides = _strides(value)
        shape = tuple(value.shape)
        raise ArgumentError(
            f"argument {arg!r}: expected a contiguous last dimension and non-negative strides, got strides "
            f"{strides if strides is not None else '?'} (bytes) for shape {shape}; pass a contiguous copy"
        )


def check_writable(arg: str, value: Any) -> None:
    """Refuse a read-only array (numpy's ``writeable`` flag) that an op would write."""
    if type(value) is np.ndarray and value.flags.writeable:
        return  # the common host case, in one attribute read
    flags = getattr(untag(value), "flags", None)
    writeable = getattr(flags, "writeable", None)
    if writeable is None and flags is not None:
        try:
            writeable = flags["WRITEABLE"]
        except (KeyError, TypeError):
            writeable = None
    if writeable is False:
        raise ArgumentError(f"argument {arg!r} is read-only; pass a writable array (e.g. a copy)")


def byte_range(value: Any) -> tuple[int, int] | None:
    """``[start, end)`` of the memory ``value`` spans, or None if unknown or empty.

    Read from a CuPy-style ``data.ptr`` with ``strides``, else from
    ``__array_interface__`` (arrays reach validation as the backend's own type): attributes only,
    no synchronisation and no copy.
    """
    layout = _layout(value)
    return None if layout is None else _extent(layout)


#: ``(pointer, shape, byte strides, itemsize)`` of an array's storage.
_Layout = tuple[int, tuple[int, ...], tuple[int, ...], int]


def _layout(value: Any) -> _Layout | None:
    """:func:`byte_range`'s reading of ``value``: its storage's address, shape, byte strides and itemsize."""
    storage = untag(value)
    # numpy's .data is a memoryview (and refuses float16): numpy arrays go through __array_interface__
    pointer = None if isinstance(storage, np.ndarray) else getattr(getattr(storage, "data", None), "ptr", None)
    if isinstance(pointer, int) and hasattr(storage, "strides"):
        shape, strides = tuple(int(x) for x in storage.shape), tuple(int(x) for x in storage.strides)
        itemsize = storage.dtype.itemsize
    else:
        interface = getattr(storage, "__array_interface__", None)
        if not isinstance(interface, dict):
            return None
        shape, pointer = tuple(int(x) for x in interface["shape"]), int(interface["data"][0])
        itemsize = np.dtype(interface["typestr"]).itemsize
        given = interface.get("strides")
        if given is not None:
            strides = tuple(int(x) for x in given)
        else:  # C-contiguous
            step, dense = itemsize, list[int]()
            for size in reversed(shape):
                dense.insert(0, step)
                step *= size
            strides = tuple(dense)
    return pointer, shape, strides, int(itemsize)


def _extent(layout: _Layout) -> tuple[int, int] | None:
    pointer, shape, strides, itemsize = layout
    if any(size == 0 for size in shape):
        return None
    low = pointer + sum(min(0, (size - 1) * stride) for size, stride in zip(shape, strides, strict=True))
    high = pointer + sum(max(0, (size - 1) * stride) for size, stride in zip(shape, strides, strict=True)) + itemsize
    return low, high


def check_disjoint(first: str, a: Any, second: str, b: Any) -> None:
    """Refuse two arrays (on one device) that share an element, e.g. one array given as both caches.

    Arrays whose extents interleave without sharing an element (the K and V halves of an engine's
    ``[..., 2 * block_size, head_size]`` cache view) are accepted. Two numpy arrays are compared exactly
    by numpy's overlap solver (:func:`numpy.shares_memory`, under a work bound: about 1 µs a check for
    those halves); other arrays, and numpy ones the solver gives up on, by hal's own test below: exact for
    arrays of one shape and strides, by extent otherwise.
    """
    if type(a) is np.ndarray and type(b) is np.ndarray and a is not b:
        if not (a.size and b.size and np.may_share_memory(a, b)):
            return  # numpy's extent check, in C (the hot path on a host)
        try:
            # numpy types max_work as the flags -1 and 0 only, though it documents and takes any bound
            if not np.shares_memory(a, b, max_work=_OVERLAP_WORK):  # type: ignore[arg-type]
                return  # interleaved, no byte shared (an engine's K and V halves, every call)
        except np.exceptions.TooHardError:
            pass
    if a is b or untag(a) is untag(b):
        raise ArgumentError(f"arguments {first!r} and {second!r} are the same array; pass two separate arrays")
    la, lb = _layout(a), _layout(b)
    if la is not None and lb is not None and _layouts_overlap(la, lb, _strides(a), _strides(b)):
        raise ArgumentError(f"arguments {first!r} and {second!r} overlap in memory; pass two separate arrays")


@functools.lru_cache(maxsize=256)
def _layouts_overlap(la: _Layout, lb: _Layout, sa: tuple[int, ...] | None, sb: tuple[int, ...] | None) -> bool:
    """:func:`check_disjoint`'s own test of two layouts (``sa``/``sb``: the arrays' own strides, None where they
    have none): a pure function of them, so its answers are kept (the last 256 pairs; an engine passes the same
    two device cache halves on every call, and the test costs about 15 µs)."""
    ra, rb = _extent(la), _extent(lb)
    if ra is None or rb is None or not (ra[0] < rb[1] and rb[0] < ra[1]):
        return False
    shape, itemsize = la[1], la[3]
    return sa is None or sa != sb or shape != lb[1] or \
        _offsets_meet(rb[0] - ra[0] + _low_offset(shape, sa) - _low_offset(shape, sb), shape, sa, itemsize)


def _low_offset(shape: tuple[int, ...], strides: tuple[int, ...]) -> int:
    return sum(min(0, (n - 1) * s) for n, s in zip(shape, strides, strict=True))


def _offsets_meet(delta: int, shape: tuple[int, ...], strides: tuple[int, ...], itemsize: int) -> bool:
    """Whether two arrays of one shape and byte strides whose first elements lie ``delta`` bytes apart share a byte.

    They do when some difference of two index vectors ``d`` (``|d_k| < shape_k``) has ``|sum(strides * d) - delta|
    < itemsize``. Searched dimension by dimension, largest stride first, keeping only the ``d_k`` the smaller
    dimensions can still reach: a layout of nested strides (every engine's) leaves one or two per dimension.
    """
    dims = sorted(((abs(s), n) for s, n in zip(strides, shape, strict=True) if n > 1 and s), reverse=True)
    reach = [itemsize - 1]
    for stride, n in reversed(dims):
        reach.append(reach[-1] + stride * (n - 1))
    reach.reverse()  # reach[k]: the largest |offset| dimensions k.. can add, plus the element's own bytes

    def search(k: int, rest: int) -> bool:
        if k == len(dims):
            return abs(rest) < itemsize
        stride, n = dims[k]
        low = max(-(n - 1), -((reach[k + 1] - rest) // stride))
        high = min(n - 1, (rest + reach[k + 1]) // stride)
        return any(search(k + 1, rest - d * stride) for d in range(low, high + 1))

    return search(0, delta)


def check_block_tables(block_tables: np.ndarray, seq_lens: np.ndarray, num_blocks: int, block_size: int,
                       max_seq_len: int | None = None) -> None:
    """Check host ``seq_lens`` against the table's capacity (and ``max_seq_len`` when given) and every *used*
    entry of ``block_tables``.

    A sequence of length ``n`` uses the first ``ceil(n / block_size)``
    entries of its row; those must lie in ``[0, num_blocks)``. Entries past
    them may hold anything. The first offender (in row-major order) is named.
    """
    max_blocks = block_tables.shape[1]
    capacity = max_blocks * block_size
    if block_tables.size <= SMALL_INDEX_ARRAY:
        lens = seq_lens.tolist()
        if not lens:
            return
        low, high = min(lens), max(lens)
    else:
        lens = None
        low, high = int(seq_lens.min()), int(seq_lens.max())  # two reductions answer the common, valid case
    if low < 0:
        s = int(np.flatnonzero(seq_lens < 0)[0])
        raise fail("seq_lens", "lengths >= 0", f"seq_lens[{s}] = {int(seq_lens[s])}")
    if high > capacity:
        s = int(np.flatnonzero(seq_lens > capacity)[0])
        raise fail("seq_lens", f"lengths <= max_blocks_per_seq * block_size = {capacity} "
                   "(seq_len beyond its block table)", f"seq_lens[{s}] = {int(seq_lens[s])}")
    if max_seq_len is not None and high > max_seq_len:
        s = int(np.flatnonzero(seq_lens > max_seq_len)[0])
        raise fail("seq_lens", f"lengths <= max_seq_len = {max_seq_len}", f"seq_lens[{s}] = {int(seq_lens[s])}")
    if lens is not None:
        bad = _first_bad_used_entry(block_tables.tolist(), lens, num_blocks, block_size)
    elif block_tables.size and int(block_tables.min()) >= 0 and int(block_tables.max()) < num_blocks:
        return  # every entry is in range, used or not
    else:
        used = np.arange(max_blocks)[None, :] < -(-seq_lens[:, None] // block_size)
        flagged = np.argwhere(used & ((block_tables < 0) | (block_tables >= num_blocks)))
        bad = (int(flagged[0][0]), int(flagged[0][1])) if flagged.size else None
    if bad is not None:
        s, j = bad
        raise fail("block_tables", f"entries in [0, {num_blocks}) for used blocks",
                   f"block_tables[{s}, {j}] = {int(block_tables[s, j])}")


def _first_bad_used_entry(rows: list[list[int]], lens: list[int], num_blocks: int,
                          block_size: int) -> tuple[int, int] | None:
    """``(s, j)`` of the first used entry outside ``[0, num_blocks)``, from the table as lists, or None."""
    for s, (n, row) in enumerate(zip(lens, rows, strict=True)):
        used = row[: -(-n // block_size)]
        if used and (min(used) < 0 or max(used) >= num_blocks):
            return s, next(j for j, b in enumerate(used) if b < 0 or b >= num_blocks)
    return None


def check_slots(slot_mapping: np.ndarray, capacity: int) -> None:
    """Check host ``slot_mapping``: every slot below ``capacity`` (negative ones skip a token), no slot twice."""
    if slot_mapping.size <= SMALL_INDEX_ARRAY:
        slots = slot_mapping.tolist()
        if not slots:
            return
        high = max(slots)
        used = [slot for slot in slots if slot >= 0] if min(slots) < 0 else slots
        distinct = len(set(used))
    else:
        high = int(slot_mapping.max())
        kept = slot_mapping[slot_mapping >= 0]
        used, distinct = kept, np.unique(kept).size
    if high >= capacity:
        i = int(np.flatnonzero(slot_mapping >= capacity)[0])
        raise fail("slot_mapping", f"slots < num_blocks * block_size = {capacity} (or negative to skip)",
                   f"slot_mapping[{i}] = {int(slot_mapping[i])}")
    if distinct != len(used):
        raise fail("slot_mapping", "distinct non-negative slots", "a slot used twice")
