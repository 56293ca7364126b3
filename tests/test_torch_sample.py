"""torch.ops.hal.sample: opcheck, the reference's tokens, int64 results from the fake, errors naming the argument."""

from __future__ import annotations

import numpy as np
import pytest
from torch_helpers import cuda_or_skip, tensor, torch

import hal_core
import hal_core.torch as hal_torch
from hal_core.ops import OPS
from hal_core.ops.sample import sample_inputs

DEVICES = ("cpu", "cuda")


@pytest.fixture(params=DEVICES)
def device(request: pytest.FixtureRequest) -> str:
    if request.param == "cuda":
        cuda_or_skip()
    return request.param


@pytest.mark.parametrize("dtype", ["fp32", "fp16", "bf16"])
def test_sample(device: str, dtype: str) -> None:
    """The operator returns the reference's int64 tokens (greedy rows included) and passes opcheck."""
    seed = 3100 + ["fp32", "fp16", "bf16"].index(dtype)
    print(f"seed={seed}")
    args = sample_inputs(np.random.default_rng(seed), num_seqs=6, vocab_size=257, dtype=dtype, scale=1.0)
    expected = OPS["sample"].reference(args)
    t = {name: tensor(value, device) for name, value in args.items()}
    got = hal_torch.sample(t["logits"], t["temperature"], t["seeds"], top_k=t["top_k"], top_p=t["top_p"],
                           min_p=t["min_p"])
    assert got.dtype == torch.int64 and got.device.type == device
    np.testing.assert_array_equal(got.cpu().numpy(), expected)
    out = torch.full((6,), 99, dtype=torch.int64, device=device)
    assert hal_torch.sample(t["logits"], t["temperature"], t["seeds"], top_k=t["top_k"], out=out) is out
    params = (t["logits"], t["temperature"], t["seeds"], t["top_k"], t["top_p"], t["min_p"])
    torch.library.opcheck(torch.ops.hal.sample.default, params)
    torch.library.opcheck(torch.ops.hal.sample_out.default, (*params[:3], out, *params[3:]))


def test_sample_fake_is_int64_on_the_meta_device() -> None:
    """The fake implementation gives an int64 ``[num_seqs]`` result (torch.compile traces without running)."""
    logits = torch.empty(3, 100, device="meta")
    got = torch.ops.hal.sample(logits, torch.empty(3, device="meta"), torch.empty(3, dtype=torch.int64, device="meta"))
    assert got.dtype == torch.int64 and tuple(got.shape) == (3,)


def test_sample_bad_value_is_named() -> None:
    """A temperature below 0 is refused naming ``temperature``."""
    args = sample_inputs(np.random.default_rng(5), num_seqs=2, vocab_size=10, dtype="fp32")
    args["temperature"][1] = -1.0
    t = {name: tensor(value) for name, value in args.items()}
    with pytest.raises(hal_core.ArgumentError, match="'temperature'"):
        hal_torch.sample(t["logits"], t["temperature"], t["seeds"])


def test_sample_compiles_without_graph_breaks() -> None:
    """A decode step's last op under torch.compile(fullgraph=True): traced through the fake, the same tokens."""
    args = sample_inputs(np.random.default_rng(8), num_seqs=3, vocab_size=64, dtype="fp32")
    t = {name: tensor(value) for name, value in args.items()}

    def step(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
        return torch.ops.hal.sample(logits * 2.0, temperature, seeds)

    compiled = torch.compile(step, fullgraph=True, backend="eager")
    got = compiled(t["logits"], t["temperature"], t["seeds"])
    expected = OPS["sample"].reference({**args, "logits": args["logits"] * 2.0, "top_k": None, "top_p": None,
                                        "min_p": None})
    np.testing.assert_array_equal(got.numpy(), expected)
