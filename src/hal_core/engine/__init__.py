"""A small inference engine on hal alone: Llama, Mistral, Qwen3, Mixtral and Qwen3-MoE models served through
``get_backend()`` ops.

Every op of a decoder step (norms, projections, rotary, KV writes, attention,
the gated activation or the MoE block, sampling) is a hal op on the backend's
arrays: numpy on the host, the device's arrays on a GPU; only a MoE router's
small float matmul is the array library's. torch is never imported. See
:class:`Engine`; ``examples/tiny_engine.py`` serves a checkpoint with it.
"""

from __future__ import annotations

from ._config import ModelConfig
from ._engine import Engine
from ._requests import Request, SamplingParams

__all__ = ["Engine", "ModelConfig", "Request", "SamplingParams"]
