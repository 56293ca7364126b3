"""hal_core.engine refuses bad requests by name when they are queued, and an error leaves it serving."""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import transformers
from torch_helpers import torch

from hal_core import ArgumentError, OutOfBlocksError
from hal_core.engine import Engine, SamplingParams

GROUP = 32
VOCAB = 96


@pytest.fixture(scope="module")
def pristine(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small random Llama (one layer, 64 positions) saved as config.json + model.safetensors."""
    torch.manual_seed(0)
    folder = tmp_path_factory.mktemp("llama")
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                      tie_word_embeddings=False)
    transformers.LlamaForCausalLM(config).save_pretrained(folder)
    return folder



@pytest.fixture
def engine(cpu, pristine: Path) -> Iterator[Engine]:
    """An engine on the pristine checkpoint with a small cache (48 tokens, blocks of 8)."""
    with Engine(pristine, backend=cpu, group_size=GROUP, kv_cache_tokens=48, block_size=8,
                max_batch_tokens=16) as served:
        yield served


def assert_idle_and_serving(engine: Engine) -> None:
    """Nothing queued, no cache block held, and a good request still served."""
    assert not engine.waiting and not engine.running
    assert engine.cache.usage().used_blocks == 0
    assert len(engine.generate([[1, 2, 3]], max_new_tokens=2, stop_token_ids=())[0]) == 2


@pytest.mark.parametrize(("prompt", "kwargs", "match"), [
    ([], {}, "the prompt must be a non-empty sequence of token ids"),
    ([1, VOCAB], {}, rf"token ids must be in \[0, {VOCAB}\), got 1\.\.{VOCAB}"),
    ([-1, 2], {}, r"token ids must be in \[0, 96\)"),
    ([1.0, 2.0], {}, "non-empty sequence of token ids"), ([True], {}, "sequence of token ids"),
    (["a"], {}, "sequence of token ids"), ([[1, 2]], {}, "sequence of token ids"),
    ([2**70], {}, "sequence of token ids"),
    ([1], {"max_new_tokens": 0}, "argument 'max_new_tokens': expected an integer >= 1, got 0"),
    ([1], {"max_new_tokens": 2.5}, "argument 'max_new_tokens'"),
    ([1], {"stop_token_ids": ["x"]}, "argument 'stop_token_ids'"),
    ([1], {"sampling": {"temperature": 1}}, "argument 'sampling': expected SamplingParams"),
])
def test_bad_request_is_refused_naming_it(engine: Engine, prompt: Any, kwargs: dict[str, Any], match: str) -> None:
    """A bad prompt or request argument is refused naming the request; nothing is queued."""
    with pytest.raises(ArgumentError, match=rf"request 'r': .*{match}"):
        engine.add_request("r", prompt, **kwargs)
    assert_idle_and_serving(engine)


def test_bad_prompt_in_generate_queues_nothing(engine: Engine) -> None:
    """generate checks every prompt before queueing any: one bad prompt leaves the engine idle."""
    with pytest.raises(ArgumentError, match=r"request generate prompt 1: token ids"):
        engine.generate([[1, 2], [1, 999], [3]], max_new_tokens=2)
    assert_idle_and_serving(engine)


def test_duplicate_or_unhashable_request_id_is_refused(engine: Engine) -> None:
    """A request id already queued, or one that cannot be a key, is refused; the queue is unchanged."""
    engine.add_request("same", [1, 2], max_new_tokens=1)
    with pytest.raises(ArgumentError, match="request 'same': already queued"):
        engine.add_request("same", [3], max_new_tokens=1)
    with pytest.raises(ArgumentError, match=r"argument 'request_id': \[1\] is not hashable"):
        engine.add_request([1], [3], max_new_tokens=1)
    assert [r.request_id for r in engine.waiting] == ["same"]
    while engine.has_work:
        engine.step()
    assert_idle_and_serving(engine)


@pytest.mark.parametrize(("argument", "value", "match"), [
    ("temperature", -0.5, "expected >= 0"), ("temperature", math.nan, "finite"), ("temperature", math.inf, "finite"),
    ("temperature", "hot", "finite number"), ("top_k", -1, "expected >= 0"), ("top_k", 2.5, "an integer"),
    ("top_k", 2**31, "an integer in"), ("top_p", 0.0, r"in \(0, 1\]"), ("top_p", 1.5, r"in \(0, 1\]"),
    ("top_p", math.nan, "finite"), ("min_p", -0.1, r"in \[0, 1\]"), ("min_p", 2.0, r"in \[0, 1\]"),
    ("seed", 1.5, "an integer"), ("seed", None, "an integer"),
])
def test_sampling_params_out_of_range_are_refused(argument: str, value: Any, match: str) -> None:
    """SamplingParams refuses a value out of range or of the wrong type, naming the field."""
    with pytest.raises(ArgumentError, match=rf"argument '{argument}': .*{match}"):
        SamplingParams(**{argument: value})


def test_numpy_integers_are_accepted_as_sampling_and_lengths(engine: Engine) -> None:
    """numpy integers are integers: a numpy seed and max_new_tokens serve like Python ints."""
    params = SamplingParams(temperature=np.float32(1.0), top_k=np.int32(5), seed=np.int64(7))
    a = engine.generate([np.array([4, 5])], max_new_tokens=np.int64(3), sampling=params, stop_token_ids=())
    b = engine.generate([[4, 5]], max_new_tokens=3, sampling=SamplingParams(temperature=1.0, top_k=5, seed=7),
                        stop_token_ids=())
    assert a == b and len(a[0]) == 3


def test_prompt_longer_than_the_cache_is_refused_naming_the_request(engine: Engine) -> None:
    """A request whose prompt and new tokens cannot fit the whole cache is refused at once (never loops)."""
    capacity = engine.cache.num_blocks * engine.cache.config.block_size
    with pytest.raises(ArgumentError, match=rf"request 'long': .* needs {capacity + 9} positions, more than "
                                            rf"the KV cache's tokens \({capacity}\)"):
        engine.add_request("long", list(range(1, capacity + 2)), max_new_tokens=9)
    with pytest.raises(ArgumentError, match=r"request generate prompt 0: .* the KV cache's tokens"):
        engine.generate([list(range(1, capacity - 1))], max_new_tokens=4)
    assert_idle_and_serving(engine)
    out = engine.generate([list(range(1, capacity - 2))], max_new_tokens=4, stop_token_ids=())  # exactly fits
    assert len(out[0]) == 4
    assert_idle_and_serving(engine)


def test_request_beyond_max_position_embeddings_is_refused(cpu, pristine: Path) -> None:
    """A prompt plus max_new_tokens longer than max_position_embeddings is refused naming the request."""
    with Engine(pristine, backend=cpu, group_size=GROUP, kv_cache_tokens=512) as engine:
        with pytest.raises(ArgumentError, match=r"request 'r': a prompt of 60 tokens plus max_new_tokens=5 needs "
                                                r"65 positions, more than max_position_embeddings \(64\)"):
            engine.add_request("r", [1] * 60, max_new_tokens=5)
        assert len(engine.generate([[1] * 60], max_new_tokens=4, stop_token_ids=())[0]) == 4
        assert_idle_and_serving(engine)


def test_step_out_of_blocks_changes_nothing_and_abort_frees(engine: Engine) -> None:
    """A step whose running requests outgrow the cache raises OutOfBlocksError with the cache and queues as they
    were; aborting the requests frees their blocks and the engine serves on."""
    engine.add_request("x", [1] * 20, max_new_tokens=20, stop_token_ids=())
    engine.add_request("y", [2] * 20, max_new_tokens=20, stop_token_ids=())
    with pytest.raises(OutOfBlocksError) as caught:
        for _ in range(100):
            used = engine.cache.usage().used_blocks
            progress = [(r.request_id, r.prefilled, len(r.output)) for r in engine.running]
            engine.step()
    assert engine.cache.usage().used_blocks == used
    assert [(r.request_id, r.prefilled, len(r.output)) for r in engine.running] == progress
    if hasattr(caught.value, "__notes__"):
        assert "'x'" in caught.value.__notes__[0] and "'y'" in caught.value.__notes__[0]
    with pytest.raises(ArgumentError, match="request 'z': not queued"):
        engine.abort("z")
    engine.abort("x")
    engine.abort("y")
    assert_idle_and_serving(engine)


def test_generate_out_of_blocks_leaves_the_engine_idle(engine: Engine) -> None:
    """Requests that each fit but together outgrow the cache raise OutOfBlocksError from generate, and their
    blocks and queue entries are given back (the engine serves on)."""
    with pytest.raises(OutOfBlocksError):
        engine.generate([[1] * 20, [2] * 20], max_new_tokens=20, stop_token_ids=())
    assert_idle_and_serving(engine)


def test_a_step_with_nothing_queued_does_nothing(engine: Engine) -> None:
    """step() on an idle engine returns no finished request and changes nothing."""
    assert engine.step() == [] and not engine.has_work
    assert_idle_and_serving(engine)
