"""hal-vllm: vLLM's attention through hal's ops, on vLLM's own KV cache and metadata.

Installed, the plugin does nothing until ``HAL_VLLM=1``: then, in every
vLLM process, :func:`register` points vLLM's CPU attention backend
(``CPU_ATTN``) at :class:`hal_vllm.cpu.HalCPUAttentionBackend`, or, on CUDA
and ROCm, vLLM's ``CUSTOM`` backend (``--attention-backend CUSTOM``) at
:class:`hal_vllm.gpu.HalAttentionBackend`. On CPU it also runs GPTQ and AWQ
int4 linear layers (:mod:`hal_vllm.linear`) and their mixture-of-experts
layers (:mod:`hal_vllm.moe`) on hal. Importing this package imports
neither vLLM nor torch. See docs/engine-guide.md, "hal under vLLM".
"""

from __future__ import annotations

from ._compat import SUPPORTED_MINORS, check_vllm_version
from ._plugin import enabled, register
from ._version import __version__

__all__ = ["SUPPORTED_MINORS", "__version__", "check_vllm_version", "enabled", "register"]
