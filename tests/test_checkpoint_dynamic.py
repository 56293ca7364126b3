"""GPTQ's per-module ``dynamic`` rules in ``quantization_config``: parsed, checked, applied per layer."""

from __future__ import annotations

import pytest

pytest.importorskip("torch", reason="torch is not installed (make test installs it)")

from hal_core import CheckpointError
from hal_core.quant._checkpoint_format import checkpoint_format

BASE = {"quant_method": "gptq", "bits": 4, "group_size": 128, "desc_act": False}


def test_the_first_matching_rule_overrides_bits_and_group_size() -> None:
    """Rules apply in order with re.match, as GPTQ readers do; an unmatched layer keeps the base format."""
    fmt = checkpoint_format({**BASE, "dynamic": {
        r"+:^lm_head$": {"bits": 8, "group_size": 32},
        r"model\.layers\.1\..*": {"group_size": -1, "sym": False},
        r"model\.layers\.\d+\.mlp\..*": {"bits": 8},
    }})
    assert (fmt.for_layer("lm_head").bits, fmt.for_layer("lm_head").group_size) == (8, 32)
    assert (fmt.for_layer("model.layers.1.mlp.up_proj").bits,
            fmt.for_layer("model.layers.1.mlp.up_proj").group_size) == (4, -1)
    assert fmt.for_layer("model.layers.0.mlp.up_proj").bits == 8
    assert fmt.for_layer("model.layers.0.self_attn.q_proj") == fmt
    assert fmt.for_layer("lm_head").dynamic == ()


def test_a_layer_a_negative_rule_excludes_cannot_store_codes() -> None:
    """A ``-:`` rule says the layer is float: a quantized layer under it is refused, naming both."""
    fmt = checkpoint_format({**BASE, "dynamic": {"-:.*down_proj": {}}})
    with pytest.raises(CheckpointError, match=r"layer 'model\.layers\.0\.mlp\.down_proj'.*'-:\.\*down_proj'"):
        fmt.for_layer("model.layers.0.mlp.down_proj")
    assert fmt.for_layer("model.layers.0.mlp.up_proj") == fmt


@pytest.mark.parametrize(("dynamic", "match"), [
    ([], r"dynamic: expected an object"),
    ({"+:(": {"bits": 8}}, r"dynamic\['\+:\('\]: not a regular expression"),
    ({"+:x": 8}, r"dynamic\['\+:x'\]: expected an object of overrides"),
    ({"+:x": {"bits": 3}}, r"dynamic\['\+:x'\]\.bits: hal runs 4- and 8-bit"),
    ({"+:x": {"bits": "8"}}, r"dynamic\['\+:x'\]\.bits: expected an integer"),
    ({"+:x": {"group_size": 0}}, r"dynamic\['\+:x'\]\.group_size: expected a positive size or -1"),
    ({"+:x": {"desc_act": "yes"}}, r"dynamic\['\+:x'\]\.desc_act: expected true or false"),
    ({"+:x": {"checkpoint_format": "marlin"}}, r"hal reads the overrides .*'checkpoint_format'"),
], ids=["list", "bad-regex", "not-an-object", "bits-3", "bits-string", "group-0", "desc-act-string", "unknown-key"])
def test_malformed_rules_are_refused_naming_the_rule(dynamic: object, match: str) -> None:
    """Every malformed rule is a CheckpointError naming quantization_config.dynamic and the rule."""
    with pytest.raises(CheckpointError, match=match):
        checkpoint_format({**BASE, "dynamic": dynamic})


def test_awq_has_no_dynamic_rules() -> None:
    """AWQ checkpoints have no per-module rules; one that claims some is refused."""
    with pytest.raises(CheckpointError, match="dynamic: per-module rules are a GPTQ key"):
        checkpoint_format({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemm",
                           "dynamic": {"+:x": {"bits": 8}}})
