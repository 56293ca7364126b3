"""Every exception hal raises, in one place.

Each derives from :class:`HalError` and from the builtin a caller would
naturally catch, so ``except ValueError`` keeps working::

    HalError
    ├── BackendNotFoundError ........ LookupError   no installed backend has that name
    ├── BackendUnavailableError ..... RuntimeError  installed, but cannot run here (reason, remedy)
    ├── BackendConflictError ........ RuntimeError  two plugins offer one name at the same priority
    ├── ArgumentError ............... ValueError    bad shape, value or layout of an op argument
    ├── ArgumentTypeError ........... TypeError     bad dtype or type of an op argument
    ├── LaunchConfigError ........... ValueError    a launch config exceeds a device limit
    ├── ConfigurationError .......... ValueError    a setting of the user's is wrong: never a fallback
    │   └── EnvironmentVariableError  ValueError    a ``HAL_*`` variable holds a value it does not accept
    ├── CheckpointError ............. ValueError    a quantized checkpoint hal cannot load (names the config key)
    ├── KernelCompileError .......... RuntimeError  a kernel failed to compile (carries the log)
    ├── FallbackError ............... RuntimeError  a fallback happened under ``HAL_STRICT=1``
    ├── ImplementationError ......... RuntimeError  an op implementation failed or returned a bad result
    ├── DeviceOutOfMemoryError ...... MemoryError   an allocation failed (carries byte counts)
    └── OutOfBlocksError ............ MemoryError   a paged KV cache has no free blocks left

Messages say what happened and what to do next.

A :class:`ConfigurationError` is the user's to fix, so hal never answers it
with a slower path: the ops front door, backend probes and binding let it
through to the caller (:func:`configuration_error` finds one behind a
plugin's own exception), where other failures of plugin code fall back or
make the backend unavailable.
"""

from __future__ import annotations

__all__ = [
    "ArgumentError",
    "ArgumentTypeError",
    "BackendConflictError",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "CheckpointError",
    "ConfigurationError",
    "DeviceOutOfMemoryError",
    "EnvironmentVariableError",
    "FallbackError",
    "HalError",
    "ImplementationError",
    "KernelCompileError",
    "LaunchConfigError",
    "OutOfBlocksError",
]


class HalError(Exception):
    """Base class of every error hal raises."""


class BackendNotFoundError(HalError, LookupError):
    """No installed backend has the requested name."""

    def __init__(self, name: str, known: list[str]) -> None:
        self.name = name
        self.known = list(known)
        listing = ", ".join(sorted(self.known)) or "none"
        super().__init__(
            f"no backend named {name!r} is installed (installed: {listing}); "
            f"install its plugin (e.g. `pip install hal-{name}`) or choose another "
            f"with HAL_BACKEND / get_backend(name)"
        )

    def __reduce__(self):  # pragma: no cover - pickling support
        return (type(self), (self.name, self.known))


class BackendUnavailableError(HalError, RuntimeError):
    """A backend is installed but cannot run here; carries ``reason`` and ``remedy``."""

    def __init__(self, name: str, reason: str, remedy: str = "") -> None:
        self.name = name
        self.reason = reason
        self.remedy = remedy
        message = f"backend {name!r} is unavailable: {reason}"
        if remedy:
            message += f"; {remedy}"
        super().__init__(message)

    def __reduce__(self):  # pragma: no cover - pickling support
        return (type(self), (self.name, self.reason, self.remedy))


class BackendConflictError(HalError, RuntimeError):
    """Two plugins offer the same backend name with the same priority."""


class ArgumentError(HalError, ValueError):
    """An op argument has the wrong shape, value or layout."""


class ArgumentTypeError(HalError, TypeError):
    """An op argument has the wrong dtype or type."""


class LaunchConfigError(HalError, ValueError):
    """A launch configuration exceeds a limit of the device it targets."""


class ConfigurationError(HalError, ValueError):
    """A setting the user chose (an environment variable, a configuration value) is wrong.

    Never turned into a fallback or an unavailable backend: the call that
    reads the setting raises it. Plugins raise it (or a subclass) for their
    own settings.
    """


def configuration_error(exc: BaseException | None) -> ConfigurationError | None:
    """The :class:`ConfigurationError` ``exc`` is, or was raised from or while handling; None if none.

    Follows ``__cause__`` and ``__context__``, so a plugin that wraps the
    error of a bad setting in its own exception still reports the setting.
    """
    seen: set[int] = set()
    while exc is not None and id(exc) not in seen:
        if isinstance(exc, ConfigurationError):
            return exc
        seen.add(id(exc))
        exc = exc.__cause__ or exc.__context__
    return None


class EnvironmentVariableError(ConfigurationError):
    """A ``HAL_*`` environment variable holds a value it does not accept.

    Carries ``name``, ``value`` and ``expected`` (the accepted values, in words).
    """

    def __init__(self, name: str, value: str, expected: str) -> None:
        self.name = name
        self.value = value
        self.expected = expected
        super().__init__(f"environment variable {name}={value!r}: expected {expected}; "
                         f"set it to one of those or unset it")

    def __reduce__(self):  # pragma: no cover - pickling support
        return (type(self), (self.name, self.value, self.expected))


class CheckpointError(HalError, ValueError):
    """A quantized checkpoint hal cannot or will not load; the message names the file and the key or layer.

    An unsupported or malformed ``quantization_config``, ``config.json`` or shard index; a file that
    resolves outside the checkpoint folder; a truncated or malformed safetensors file; a tensor that is
    missing, or whose stored shape or dtype does not fit its layer (checked before its data is read)."""


class KernelCompileError(HalError, RuntimeError):
    """A kernel failed to compile; ``log`` holds the compiler's output."""

    def __init__(self, name: str, log: str, options: tuple[str, ...] = ()) -> None:
        self.name = name
        self.log = log
        self.options = tuple(options)
        super().__init__(
            f"kernel {name!r} failed to compile with options {list(self.options)}:\n{log}"
        )

    def __reduce__(self):  # pragma: no cover - pickling support
        return (type(self), (self.name, self.log, self.options))


class FallbackError(HalError, RuntimeError):
    """A call would have fallen back to a slower path while ``HAL_STRICT=1``."""


class ImplementationError(HalError, RuntimeError):
    """An op implementation raised or returned a result of the wrong shape, dtype or device.

    Raised under ``HAL_STRICT=1``; otherwise the call falls back and the
    fault is logged once. The message names the implementation.
    """


class DeviceOutOfMemoryError(HalError, MemoryError):
    """An allocation failed even after freeing cached blocks.

    Carries ``requested``, ``free`` and ``total`` byte counts (``-1`` when unknown).
    """

    def __init__(self, requested: int, free: int = -1, total: int = -1, device: str = "") -> None:
        self.requested = int(requested)
        self.free = int(free)
        self.total = int(total)
        self.device = device
        where = f" on {device}" if device else ""
        super().__init__(
            f"out of device memory{where}: requested {self.requested} bytes, "
            f"{self.free} free of {self.total}; free tensors or caches you no longer need, "
            f"use smaller batches, or lower the KV-cache memory fraction"
        )

    def __reduce__(self):  # pragma: no cover - pickling support
        return (type(self), (self.requested, self.free, self.total, self.device))


class OutOfBlocksError(HalError, MemoryError):
    """A paged KV cache has too few free blocks; the cache state is unchanged."""

    def __init__(self, needed: int, free: int) -> None:
        self.needed = int(needed)
        self.free = int(free)
        super().__init__(
            f"KV cache needs {self.needed} more blocks but only {self.free} are free; "
            f"preempt or finish a sequence, or size the cache larger"
        )

    def __reduce__(self):  # pragma: no cover - pickling support
        return (type(self), (self.needed, self.free))
