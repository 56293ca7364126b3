"""vLLM's GPTQ and AWQ mixture-of-experts layers on hal's ``fused_moe``: int4 experts on CPU.

vLLM builds each MoE layer's quantization method from the checkpoint's
config (``AutoGPTQConfig`` / ``AutoAWQConfig.get_quant_method``); the method
chooses an experts kernel from a per-platform list. On a CPU that list is
AMD's zentorch kernel and vLLM's own ``CPUExpertsInt4``, which needs AMX:
elsewhere vLLM 0.32 stops at load time with "No WNA16 MoE backend supports
the deployment configuration". With ``HAL_VLLM=1`` the plugin answers that
call for MoE layers first (:func:`install`) with :class:`HalGPTQMoEMethod`
or :class:`HalAWQMoEMethod`: vLLM's own method of the format (its
parameters and weight loading), less the kernel choice, running each
forward as one hal ``fused_moe`` call.

What vLLM's interface allows: a method that says it is *monolithic*
receives the router's logits, not vLLM's routing, so hal routes. hal takes a
layer whose routing is one of ``fused_moe``'s (:data:`ROUTINGS`: softmax
then top-k, renormalised or not, or top-k then softmax), whose activation
is one of its gated activations, with no expert bias, no grouped or biased
routing, no routed scaling factor, no weights applied on the input, no
expert parallelism, and 4-bit weights (GPTQ: symmetric, without activation
reordering). Any other layer is left to vLLM's own method, and the log says
why hal did not take it (:func:`refusal`).

GPTQ experts stay vLLM's tensors: hal's weights are numpy views of the
layer's words (packed along K, hal's own packing) and scales. AWQ's words
are packed along N in AWQ's order, so each expert is repacked once at load
time (:func:`hal_core.quant.from_awq`) and the layer's own words are
released (the same bytes, not a second copy). Each forward is the bound
``fused_moe`` call over the layer's hidden states and router logits into a
new tensor; ``HAL_VLLM_INT4_ACTIVATIONS`` sets the experts' activation
precision, as it does for the linear layers.
"""

from __future__ import annotations

import re
import weakref
from collections.abc import Callable
from typing import Any

import torch

from ._startup import Route, device_type, log, serving_backend
from .linear import int4_activations

__all__ = ["ACTIVATIONS", "MOE_MINORS", "ROUTINGS", "install", "method_classes", "refusal"]

#: The vLLM minors whose MoE interface (monolithic methods, ``RoutedExperts``) hal's methods are built and tested for.
MOE_MINORS = ((0, 32),)
#: vLLM's routing method names -> ``fused_moe``'s ``routing``.
ROUTINGS = {"Default": "softmax_topk", "RenormalizeNaive": "softmax_topk_renorm", "Renormalize": "topk_softmax"}
#: vLLM's gated MoE activations -> ``fused_moe``'s ``activation``.
ACTIVATIONS = {"silu": "silu", "gelu": "gelu", "gelu_tanh": "gelu_tanh"}


def refusal(layer: Any, quant_config: Any, checkpoint: str = "gptq") -> str | None:
    """Why hal does not serve this vLLM MoE layer (``RoutedExperts``) of a ``checkpoint`` (``"gptq"`` or
    ``"awq"``) model, or None when it does."""
    moe = layer.moe_config
    routing = getattr(moe.routing_method, "name", str(moe.routing_method))
    checks = [
        (routing not in ROUTINGS, f"its routing is {routing} (hal routes {', '.join(ROUTINGS)})"),
        (moe.activation.value not in ACTIVATIONS, f"its activation is {moe.activation.value!r}"),
        (bool(moe.has_bias), "its experts have biases"),
        (moe.moe_parallel_config.use_ep, "it runs with expert parallelism"),
        (layer.custom_routing_function is not None, "it has a custom routing function"),
        (layer.use_grouped_topk, "it routes by groups of experts"),
        (layer.e_score_correction_bias is not None, "its routing adds a score-correction bias"),
        (layer.routed_scaling_factor != 1.0, f"it scales the routed output by {layer.routed_scaling_factor}"),
        (layer.apply_router_weight_on_input, "it applies the routing weights on the input"),
        (quant_config.weight_bits != 4, f"its weights are {quant_config.weight_bits}-bit (hal takes int4)"),
    ]
    if checkpoint == "gptq":
        checks += [(not quant_config.is_sym, "its weights have zero points (GPTQ sym=False)"),
                   (quant_config.desc_act, "its rows are reordered (GPTQ desc_act=True)")]
    reasons = [reason for failed, reason in checks if failed]
    return "; ".join(reasons) or None


#: The operator's handles on the loaded layers' methods (weakly: an engine's layers go with it).
_METHODS: weakref.WeakValueDictionary[str, Any] = weakref.WeakValueDictionary()


@torch.library.custom_op("hal_vllm::fused_moe", mutates_args=())
def _moe_operator(hidden_states: torch.Tensor, router_logits: torch.Tensor, layer: str) -> torch.Tensor:
    """A hal MoE layer's forward as one operator: what compiled models call (the bound call's numpy views would
    have the compiler trace into hal's Python). ``layer`` is the method's handle."""
    return _METHODS[layer].run(hidden_states, router_logits)


@_moe_operator.register_fake
def _(hidden_states: torch.Tensor, router_logits: torch.Tensor, layer: str) -> torch.Tensor:
    return torch.empty_like(hidden_states)


class _HalMoE:
    """What both formats' methods share: hal routes (monolithic), builds its experts once, binds one call."""

    quant_config: Any

    def _start(self, quant_config: Any, moe: Any) -> None:
        from vllm.model_executor.layers.fused_moe.fused_moe_method_base import FusedMoEMethodBase

        FusedMoEMethodBase.__init__(self, moe)  # vLLM's parameters, not its kernel choice
        self.quant_config = quant_config
        self.input_dtype = None
        self.use_marlin = False
        self._activations = int4_activations()  # a misspelt setting stops the loading before anything is built

    @property
    def is_monolithic(self) -> bool:
        return True

    @property
    def method_name(self) -> str:
        return type(self).__name__

    def get_fused_moe_quant_config(self, layer: Any) -> None:
        return None

    def _experts(self, layer: Any, native: Callable[[Any], Any]) -> Any:
        raise NotImplementedError

    def process_weights_after_loading(self, layer: Any) -> None:
        """Build hal's experts from the layer's loaded tensors and bind the call (once, at load time)."""
        loaded = sorted(getattr(layer, "_loaded_expert_biases", ()))
        if loaded:
            raise ValueError(f"hal-vllm: layer {layer.layer_name!r} loaded expert biases {loaded}, which hal's "
                             f"fused_moe does not add; unset HAL_VLLM to run it on vLLM's kernels")
        route = Route(serving_backend(device_type()))
        if not route.backend.is_host:
            raise ValueError(f"hal-vllm runs MoE layers on the host backend, not {route.backend.name!r}")
        experts = self._experts(layer, lambda array: route.native(array, "experts"))
        for name in ("w13_bias", "w2_bias"):  # none loaded: not used
            if hasattr(layer, name):
                setattr(layer, name, None)
        self._route = route
        self._key = f"{layer.layer_name}#{id(self)}"  # the operator's handle on this layer
        _METHODS[self._key] = self
        self._moe = route.ops.bind("fused_moe", experts=experts, top_k=int(layer.top_k),
                                   routing=ROUTINGS[layer.moe_config.routing_method.name],
                                   activation=ACTIVATIONS[layer.activation.value], activations=self._activations)

    def apply(self, *args: Any, **kwargs: Any) -> torch.Tensor:
        raise AssertionError("hal-vllm's MoE methods route themselves (monolithic): vLLM calls apply_monolithic")

    def apply_monolithic(self, layer: Any, x: torch.Tensor, router_logits: torch.Tensor,
                         input_ids: torch.Tensor | None = None) -> torch.Tensor:
        """The layer's routed output for ``x [tokens, hidden]``: one ``fused_moe`` call (while vLLM compiles the
        model, through the operator ``torch.ops.hal_vllm.fused_moe``, which the compiler keeps whole)."""
        if layer.routing_sink is not None:
            raise NotImplementedError("hal-vllm's MoE layers do not record the routed experts vLLM asked for "
                                      "(routed-experts capture); unset HAL_VLLM to run them on vLLM's kernels")
        if torch.compiler.is_compiling():
            return torch.ops.hal_vllm.fused_moe(x, router_logits, self._key)
        return self.run(x, router_logits)

    def run(self, x: torch.Tensor, router_logits: torch.Tensor) -> torch.Tensor:
        """The bound ``fused_moe`` call into a new tensor."""
        rows = x if x.is_contiguous() else x.contiguous()
        logits = router_logits if router_logits.is_contiguous() else router_logits.contiguous()
        out = torch.empty_like(rows)
        if rows.shape[0]:
            native = self._route.native
            self._moe(hidden_states=native(rows, "hidden_states"), router_logits=native(logits, "router_logits"),
                      out=native(out, "out"))
        return out


def _gptq_experts(layer: Any, native: Callable[[Any], Any]) -> Any:
    """Views of the layer's GPTQ words ``[E, K/8, N]`` and scales ``[E, K/G, N]`` as hal's experts."""
    from hal_core.quant import ExpertWeights
    from hal_core.torch import weight_from_tensors

    def expert(words: torch.Tensor, scales: torch.Tensor) -> Any:
        return weight_from_tensors({"qweight": words, "scales": scales.contiguous()}, bits=4).map_arrays(native)

    w13, w2 = layer.w13_qweight.data.contiguous(), layer.w2_qweight.data.contiguous()
    s13, s2 = layer.w13_scales.data, layer.w2_scales.data
    for name in ("w13_qzeros", "w2_qzeros"):  # symmetric: not used
        setattr(layer, name, None)
    return ExpertWeights(tuple(expert(w13[e], s13[e]) for e in range(w13.shape[0])),
                         tuple(expert(w2[e], s2[e]) for e in range(w2.shape[0])))


def _awq_experts(layer: Any, native: Callable[[Any], Any]) -> Any:
    """The layer's AWQ words ``[E, K, N/8]``, zero points ``[E, K/G, N/8]`` and scales repacked into hal's experts
    (new host arrays: the host backend's own); the layer's words and zero points are released."""
    from hal_core.quant import ExpertWeights, from_awq

    def experts(prefix: str) -> tuple[Any, ...]:
        words, zeros, scales = (getattr(layer, f"{prefix}_{name}").data for name in ("qweight", "qzeros", "scales"))
        built = tuple(from_awq(words[e], zeros[e], scales[e]) for e in range(words.shape[0]))  # host numpy arrays
        for name in ("qweight", "qzeros", "scales"):
            setattr(layer, f"{prefix}_{name}", None)
        return built

    return ExpertWeights(experts("w13"), experts("w2"))


_CLASSES: dict[str, type] = {}


def method_classes() -> dict[str, type]:
    """``{"gptq": HalGPTQMoEMethod, "awq": HalAWQMoEMethod}``: vLLM's GPTQ and AWQ MoE methods with hal's
    ``fused_moe`` as their kernel (built on first use: they subclass vLLM's methods, imported only then)."""
    if not _CLASSES:
        from vllm.model_executor.layers.quantization.auto_awq import AutoAWQMoEMethod
        from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQMoEMethod

        class HalGPTQMoEMethod(_HalMoE, AutoGPTQMoEMethod):
            """vLLM's GPTQ MoE method (its parameters) with hal's ``fused_moe`` as its kernel."""

            def __init__(self, quant_config: Any, moe: Any) -> None:
                self._start(quant_config, moe)

            def _experts(self, layer: Any, native: Callable[[Any], Any]) -> Any:
                return _gptq_experts(layer, native)

        class HalAWQMoEMethod(_HalMoE, AutoAWQMoEMethod):
            """vLLM's AWQ MoE method (its parameters) with hal's ``fused_moe`` as its kernel."""

            def __init__(self, quant_config: Any, moe: Any) -> None:
                self._start(quant_config, moe)

            def _experts(self, layer: Any, native: Callable[[Any], Any]) -> Any:
                return _awq_experts(layer, native)

        _CLASSES.update(gptq=HalGPTQMoEMethod, awq=HalAWQMoEMethod)
    return _CLASSES


def install(version: str) -> bool:
    """Make GPTQ and AWQ checkpoints' MoE layers hal's where :func:`refusal` allows, on the vLLM minors of
    :data:`MOE_MINORS` (``version`` is vLLM's ``__version__``); False elsewhere, which leaves them vLLM's (said in
    the log). Idempotent."""
    match = re.match(r"(\d+)\.(\d+)", version)
    if match is None or (int(match[1]), int(match[2])) not in MOE_MINORS:
        log.info("hal-vllm: MoE layers stay vLLM's on vLLM %s (hal's MoE methods are built for vLLM %s)", version,
                 ", ".join(f"{a}.{b}" for a, b in MOE_MINORS))
        return False
    try:
        from vllm.model_executor.layers.fused_moe.routed_experts import RoutedExperts
        from vllm.model_executor.layers.quantization.auto_awq import AutoAWQConfig
        from vllm.model_executor.layers.quantization.auto_gptq import AutoGPTQConfig, get_moe_quant_method
        from vllm.model_executor.layers.quantization.utils.quant_utils import is_layer_skipped
    except ImportError as exc:
        log.info("hal-vllm: this vLLM has no GPTQ/AWQ MoE methods to serve (%s); MoE layers stay vLLM's", exc)
        return False

    def gptq(config: Any, layer: Any, prefix: str) -> Any:
        # vLLM's own per-layer handling (dynamic overrides, a layer left unquantized), with hal's method
        return get_moe_quant_method(config, layer, prefix, method_classes()["gptq"])

    def awq(config: Any, layer: Any, prefix: str) -> Any:
        if is_layer_skipped(prefix, getattr(config, "modules_to_not_convert", []) or [], match_mode="substring"):
            return None  # unquantized: vLLM's answer
        return method_classes()["awq"](config, layer.moe_config)

    for checkpoint, config_class, build in (("gptq", AutoGPTQConfig, gptq), ("awq", AutoAWQConfig, awq)):
        _wrap(config_class, checkpoint, build, RoutedExperts)
    return True


def _wrap(config_class: Any, checkpoint: str, build: Callable[[Any, Any, str], Any], layer_type: type) -> None:
    """Put hal's method ahead of ``config_class.get_quant_method`` for MoE layers (once)."""
    original = config_class.get_quant_method
    if getattr(original, "_hal", False):
        return

    def get_quant_method(self: Any, layer: torch.nn.Module, prefix: str) -> Any:
        if isinstance(layer, layer_type):
            method = build(self, layer, prefix)
            if isinstance(method, _HalMoE):
                reason = refusal(layer, method.quant_config, checkpoint)
                if reason is None:
                    return method
                log.warning("hal-vllm: MoE layer %r stays vLLM's: %s", prefix, reason)
            elif method is not None:
                return method
        return original(self, layer, prefix)

    get_quant_method._hal = True  # type: ignore[attr-defined]
    config_class.get_quant_method = get_quant_method
