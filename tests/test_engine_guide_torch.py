"""The torch example of docs/engine-guide.md runs as written: right results, and it compiles without breaks."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
from torch_helpers import host, tensor, torch

from hal_core.ops import OPS
from hal_core.testing.inputs import assert_close, paged_attention_inputs, quantized_gemm_inputs

DOC = Path(__file__).resolve().parents[1] / "docs" / "engine-guide.md"


def _example() -> dict:
    blocks = re.findall(r"```python\n(import torch\nimport hal_core\.torch as hal_torch\n.*?)```", DOC.read_text(),
                        flags=re.S)
    assert len(blocks) == 1, "engine-guide.md should hold one torch.ops.hal example"
    namespace: dict = {}
    exec(compile(blocks[0], str(DOC), "exec"), namespace)
    return namespace


def test_the_quantized_projection_of_the_guide() -> None:
    seed = 21
    print(f"seed={seed}")
    args = quantized_gemm_inputs(np.random.default_rng(seed), m=3, k=128, n=32, bits=4, group_size=32,
                                 symmetric=False, dtype="fp32", act_order=True)
    projection = _example()["QuantizedProjection"](args["qweight"])
    assert {name for name, _ in projection.named_buffers()} == {"qweight", "scales", "zeros", "g_idx"}
    x = tensor(args["x"])
    y = projection(x)
    assert_close(host(y), OPS["quantized_gemm"].reference(args), kind="gemm", dtype="fp32")
    assert torch.equal(torch.compile(projection, backend="aot_eager", fullgraph=True)(x), y)


def test_the_attention_step_of_the_guide() -> None:
    seed = 22
    print(f"seed={seed}")
    rng = np.random.default_rng(seed)
    args = paged_attention_inputs(rng, seq_lens=(6, 13), num_heads=4, num_kv_heads=2, head_size=64, block_size=8,
                                  dtype="fp32")
    # the step's new token of each sequence is its last one: write it, then attend
    block_size = 8
    lens = args["seq_lens"]
    slots = np.array([args["block_tables"][s, (n - 1) // block_size] * block_size + (n - 1) % block_size
                      for s, n in enumerate(lens)], dtype=np.int64)
    k = rng.standard_normal((2, 2, 64)).astype(np.float32)
    v = rng.standard_normal((2, 2, 64)).astype(np.float32)
    written = dict(args)
    written["key_cache"], written["value_cache"] = OPS["write_kv_cache"].reference(
        dict(key=k, value=v, key_cache=args["key_cache"], value_cache=args["value_cache"], slot_mapping=slots))
    expected = OPS["paged_attention"].reference(written)
    t = {name: tensor(value) for name, value in args.items() if name != "scale"}
    out = _example()["attend"](t["query"], tensor(k), tensor(v), t["key_cache"], t["value_cache"], tensor(slots),
                               t["block_tables"], t["seq_lens"], args["scale"])
    assert_close(host(out), expected, kind="attention", dtype="fp32")
