"""Where MoE checkpoints keep a sparse MoE block: its stored name, its router and each expert's projections.

The Qwen3-MoE and Mixtral checkpoints that transformers writes and reads
(float ones, and the quantized ones transformers' GPTQ loaders, gptqmodel
and vLLM read) keep each expert's projections as separate linear layers,
under the block's name as the original checkpoints spell it:

============  ============================  ==========================================
model_type    block (stored name)           layers of expert ``e``: gate / up / down
============  ============================  ==========================================
qwen3_moe     ``<layer>.mlp``               ``experts.<e>.gate_proj`` / ``up_proj`` / ``down_proj``
mixtral       ``<layer>.block_sparse_moe``  ``experts.<e>.w1`` / ``w3`` / ``w2``
============  ============================  ==========================================

and the router as ``<block>.gate.weight``. Both :mod:`hal_core.torch` (saving and loading ``QuantMoE``
blocks) and :mod:`hal_core.engine` (serving these models without torch) read this table.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["MOE_LAYOUTS", "MoeLayout"]


@dataclass(frozen=True)
class MoeLayout:
    """Where one architecture's checkpoints keep a block: its stored name and the projections' names."""

    block: str  #: the last component of the block's stored name
    projections: tuple[str, str, str]  #: gate, up, down

    def stored_prefix(self, name: str) -> str:
        """The stored name of the block the model holds at ``name``."""
        parent, _, _ = name.rpartition(".")
        return f"{parent}.{self.block}" if parent else self.block

    def expert_layer(self, prefix: str, expert: int, projection: int) -> str:
        """The stored name of expert ``expert``'s projection ``projection`` (0 gate, 1 up, 2 down)."""
        return f"{prefix}.experts.{expert}.{self.projections[projection]}"


#: ``model_type`` -> how its MoE checkpoints are laid out.
MOE_LAYOUTS: dict[str, MoeLayout] = {
    "qwen3_moe": MoeLayout("mlp", ("gate_proj", "up_proj", "down_proj")),
    "mixtral": MoeLayout("block_sparse_moe", ("w1", "w3", "w2")),
}
