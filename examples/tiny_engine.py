"""A tiny decode engine on hal: paged KV cache, W4A16 projections, continuous batching.

A decoder-only transformer with random (seeded) weights: RMSNorm, rotary
embeddings, grouped-query attention through ``paged_attention``, every
projection (q/k/v/o, the SiLU-gated MLP and the LM head) int4-quantised and
run through ``quantized_gemm``, and the cache kept by
``hal_core.kvcache.PagedKVCache``. Requests arrive at different steps with
prompts of different lengths; each step batches the new prompts (prefill,
one query row per prompt token, causal by the cache's ``seq_lens``) with
one decode token for every running sequence. A finished sequence frees its
blocks at once.

Every op of a step runs on the backend, on its arrays: the embedding rows
are gathered there, ``rms_norm`` normalises (fusing the residual add from
the second norm on), ``rotary_embedding`` rotates the query and key in
place (its table from ``hal_core.rope.rope_cos_sin_cache``),
``write_kv_cache`` and ``paged_attention`` use the cache,
``gated_activation`` joins the MLP's gate and up halves, and ``sample`` at
temperature 0 picks each sequence's greedy token. Only the step's token ids
go in from the host, and the sampled tokens and the logits (for the check
below) come back.

The logits of every generated token are checked against a plain float64
numpy model of the same network (the same dequantised weights, full causal
attention, no paging), and each sampled token against the argmax of its
logits.

    python examples/tiny_engine.py                   # fp32 on hal_core.get_backend()
    python examples/tiny_engine.py --dtype bf16 --layers 4 --seed 7
    HAL_FORCE_CPU=1 python examples/tiny_engine.py   # same backend chosen, ops on the CPU path

Exits 1 when the logits differ from the float64 model by more than the tolerance, or a sampled token is not
the argmax of its logits.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass

import numpy as np

import hal_core
from hal_core.kvcache import CacheConfig, PagedKVCache
from hal_core.quant import QuantizedWeight, quantize
from hal_core.rope import rope_cos_sin_cache

#: Largest allowed |engine - float64| over all logits, as a fraction of the largest |logit|.
TOLERANCE = {"fp32": 2e-5, "fp16": 5e-3, "bf16": 4e-2}
PROJECTIONS = ("wq", "wk", "wv", "wo", "w_gate", "w_up", "w_down")


@dataclass(frozen=True)
class Config:
    vocab: int = 256
    hidden: int = 256
    layers: int = 2
    heads: int = 4
    kv_heads: int = 2
    head_size: int = 64
    ffn: int = 512
    group_size: int = 32
    rope_theta: float = 10000.0
    eps: float = 1e-6


# -- weights ---------------------------------------------------------------------------------


def make_weights(cfg: Config, seed: int) -> dict:
    """Random float weights, the projections quantised to int4 (host numpy)."""
    rng = np.random.default_rng(seed)

    def proj(k: int, n: int) -> QuantizedWeight:
        return quantize(rng.standard_normal((k, n)) / np.sqrt(k), bits=4, group_size=cfg.group_size,
                        symmetric=False)

    q_dim, kv_dim = cfg.heads * cfg.head_size, cfg.kv_heads * cfg.head_size
    layers = [
        dict(attn_norm=1 + 0.1 * rng.standard_normal(cfg.hidden), mlp_norm=1 + 0.1 * rng.standard_normal(cfg.hidden),
             wq=proj(cfg.hidden, q_dim), wk=proj(cfg.hidden, kv_dim), wv=proj(cfg.hidden, kv_dim),
             wo=proj(q_dim, cfg.hidden), w_gate=proj(cfg.hidden, cfg.ffn), w_up=proj(cfg.hidden, cfg.ffn),
             w_down=proj(cfg.ffn, cfg.hidden))
        for _ in range(cfg.layers)
    ]
    return dict(embed=rng.standard_normal((cfg.vocab, cfg.hidden)), final_norm=np.ones(cfg.hidden),
                lm_head=proj(cfg.hidden, cfg.vocab), layers=layers)


# -- float64 math of the reference ------------------------------------------------------------


def rms_norm(x: np.ndarray, w: np.ndarray, eps: float) -> np.ndarray:
    return x / np.sqrt((x * x).mean(axis=-1, keepdims=True) + eps) * w


def rotary(x: np.ndarray, positions: np.ndarray, theta: float) -> np.ndarray:
    """Rotate halves of each head ``x [T, heads, D]`` by position-dependent angles (NeoX style)."""
    half = x.shape[-1] // 2
    angles = positions[:, None] * theta ** (-np.arange(half) / half)  # [T, D/2]
    cos, sin = np.cos(angles)[:, None, :], np.sin(angles)[:, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)


def silu(x: np.ndarray) -> np.ndarray:
    return x / (1 + np.exp(-x))


# -- the engine (hal ops) ----------------------------------------------------------------------


class Engine:
    """Runs steps of the model through hal ops on one backend, with a paged KV cache.

    Every weight is copied to the backend once; a step's activations stay on
    it from the embedding rows to the sampled tokens.
    """

    def __init__(self, backend: hal_core.Backend, cfg: Config, weights: dict, cache: PagedKVCache,
                 max_position: int) -> None:
        self.be, self.cfg, self.cache = backend, cfg, cache
        act = cache.config.np_dtype
        vector = lambda v: backend.asarray(np.asarray(v, dtype=act))  # noqa: E731
        self.layers = [{k: v.map_arrays(backend.asarray) if k in PROJECTIONS else vector(v) for k, v in layer.items()}
                       for layer in weights["layers"]]
        self.lm_head = weights["lm_head"].map_arrays(backend.asarray)
        self.embed, self.final_norm = vector(weights["embed"].astype(np.float32)), vector(weights["final_norm"])
        self.cos_sin = backend.asarray(rope_cos_sin_cache(cfg.head_size, max_position, cfg.rope_theta))

    def step(self, tokens: dict, new_tokens: dict) -> tuple[dict, dict]:
        """Feed ``tokens[seq]`` (new token ids) of every sequence; return each one's next-token logits (read back
        for the check) and its greedy next token (``sample`` at temperature 0)."""
        cfg, be = self.cfg, self.be
        ops = be.ops
        step = self.cache.prepare_step(new_tokens)
        ids = np.concatenate([tokens[s] for s in step.seq_ids])
        t = len(ids)
        x = self.embed[be.asarray(ids)]  # [T, hidden] in the cache's dtype, on the backend
        positions = be.asarray(step.positions)
        residual = x
        for index, w in enumerate(self.layers):
            if index == 0:
                h = ops.rms_norm(x, w["attn_norm"], epsilon=cfg.eps)
            else:  # residual += x, then h = its norm: one op
                h = ops.rms_norm(x, w["attn_norm"], epsilon=cfg.eps, residual=residual)
            q = ops.quantized_gemm(h, w["wq"]).reshape(t, cfg.heads, cfg.head_size)
            k = ops.quantized_gemm(h, w["wk"]).reshape(t, cfg.kv_heads, cfg.head_size)
            v = ops.quantized_gemm(h, w["wv"]).reshape(t, cfg.kv_heads, cfg.head_size)
            ops.rotary_embedding(positions, q, self.cos_sin, key=k)  # in place, NeoX halves
            key_cache, value_cache = self.cache.layer(index)
            ops.write_kv_cache(k, v, key_cache, value_cache, step.slot_mapping)
            attn = ops.paged_attention(q, key_cache, value_cache, scale=cfg.head_size**-0.5, **step.attention_args())
            x = ops.quantized_gemm(attn.reshape(t, cfg.heads * cfg.head_size), w["wo"])
            h = ops.rms_norm(x, w["mlp_norm"], epsilon=cfg.eps, residual=residual)
            gated = ops.gated_activation(ops.quantized_gemm(h, w["w_gate"]), ops.quantized_gemm(h, w["w_up"]),
                                         activation="silu")
            x = ops.quantized_gemm(gated, w["w_down"])
        last = be.asarray(step.last_rows)
        h = ops.rms_norm(x[last], self.final_norm, epsilon=cfg.eps, residual=residual[last])
        logits = ops.quantized_gemm(h, self.lm_head)
        n = len(step.seq_ids)
        chosen = be.to_numpy(ops.sample(logits, temperature=be.asarray(np.zeros(n, np.float32)),
                                         seeds=be.asarray(np.zeros(n, np.int64))))
        host = be.to_numpy(logits).astype(np.float64)
        return ({seq: host[i] for i, seq in enumerate(step.seq_ids)},
                {seq: int(chosen[i]) for i, seq in enumerate(step.seq_ids)})


# -- the float64 model (numpy only, no paging) ---------------------------------------------------


def reference_logits(cfg: Config, weights: dict, ids: np.ndarray) -> np.ndarray:
    """Logits ``[len(ids), vocab]`` of a whole sequence with full causal attention, in float64."""
    n, group = len(ids), cfg.heads // cfg.kv_heads
    positions = np.arange(n)
    x = weights["embed"].astype(np.float32).astype(np.float64)[ids]
    mask = np.triu(np.full((n, n), -np.inf), 1)
    for w in weights["layers"]:
        dq = {k: w[k].dequantize(np.float64) for k in PROJECTIONS}
        h = rms_norm(x, w["attn_norm"], cfg.eps)
        q = rotary((h @ dq["wq"]).reshape(n, cfg.heads, -1), positions, cfg.rope_theta)
        k = np.repeat(rotary((h @ dq["wk"]).reshape(n, cfg.kv_heads, -1), positions, cfg.rope_theta), group, 1)
        v = np.repeat((h @ dq["wv"]).reshape(n, cfg.kv_heads, -1), group, axis=1)
        scores = np.einsum("qhd,khd->hqk", q, k) * cfg.head_size**-0.5 + mask
        p = np.exp(scores - scores.max(axis=-1, keepdims=True))
        attn = np.einsum("hqk,khd->qhd", p / p.sum(axis=-1, keepdims=True), v)
        x = x + attn.reshape(n, -1) @ dq["wo"]
        h = rms_norm(x, w["mlp_norm"], cfg.eps)
        x = x + (silu(h @ dq["w_gate"]) * (h @ dq["w_up"])) @ dq["w_down"]
    return rms_norm(x, weights["final_norm"], cfg.eps) @ weights["lm_head"].dequantize(np.float64)


# -- serving ---------------------------------------------------------------------------------------


@dataclass
class Request:
    name: str
    arrival: int  #: the step at which it arrives
    prompt: np.ndarray
    max_new: int
    generated: list
    logits: list
    joined: int = -1  #: the step at which it was admitted (later than arrival when the cache was full)


def serve(engine: Engine, requests: list[Request]) -> int:
    """Continuous batching: admit arrivals (prefill) alongside running decodes; free finished sequences.

    Arrivals that do not fit in the cache wait for blocks to free up; there
    is no preemption, so running sequences that outgrow the cache raise
    :class:`hal_core.OutOfBlocksError`. Returns the number of steps.
    """
    waiting, running, step = list(requests), [], 0
    while waiting or running:
        joining = [r for r in waiting if r.arrival <= step]
        batch = running + joining
        for r in joining:
            engine.cache.add(r.name)
        feed = {r.name: (r.prompt if r in joining else np.array(r.generated[-1:])) for r in batch}
        try:
            logits, chosen = engine.step(feed, {name: len(ids) for name, ids in feed.items()})
        except hal_core.OutOfBlocksError:  # the step changed nothing: retry with the running ones only
            for r in joining:
                engine.cache.free(r.name)
            if not running:
                raise
            joining, batch = [], running
            feed = {r.name: np.array(r.generated[-1:]) for r in batch}
            logits, chosen = engine.step(feed, {name: 1 for name in feed})
        waiting = [r for r in waiting if r not in joining]
        for r in joining:
            r.joined = step
        running = []
        for r in batch:
            r.logits.append(logits[r.name])
            r.generated.append(chosen[r.name])  # greedy, by the sample op
            if len(r.generated) == r.max_new:
                engine.cache.free(r.name)  # its blocks serve the next arrivals
            else:
                running.append(r)
        step += 1
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", choices=sorted(TOLERANCE), default="fp32", help="activations and KV cache")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--kv-heads", type=int, default=2)
    parser.add_argument("--head-size", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=256)
    parser.add_argument("--steps", type=int, default=12, help="new tokens of the longest request")
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--num-blocks", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)

    cfg = Config(vocab=args.vocab, hidden=args.hidden, layers=args.layers, heads=args.heads,
                 kv_heads=args.kv_heads, head_size=args.head_size, ffn=2 * args.hidden)
    backend = hal_core.get_backend()
    print(f"backend: {backend.name} ({backend.device(0).capabilities.name}), dtype {args.dtype}, seed {args.seed}")
    weights = make_weights(cfg, args.seed)
    cache = PagedKVCache(backend, CacheConfig(cfg.layers, cfg.kv_heads, cfg.head_size, args.block_size,
                                              args.dtype), num_blocks=args.num_blocks)
    rng = np.random.default_rng(args.seed + 1)
    shapes = [("a", 0, 7, args.steps), ("b", 0, 19, args.steps // 2), ("c", 2, 3, args.steps),
              ("d", 3, 33, max(1, args.steps // 3)), ("e", 5, 1, args.steps - 2)]
    requests = [Request(name, arrival, rng.integers(0, cfg.vocab, size=length), max(1, new), [], [])
                for name, arrival, length, new in shapes]
    engine = Engine(backend, cfg, weights, cache, max_position=max(len(r.prompt) + r.max_new for r in requests))
    started = time.perf_counter()
    steps = serve(engine, requests)
    elapsed = time.perf_counter() - started
    print(f"served {len(requests)} sequences in {steps} steps ({elapsed:.2f} s); "
          f"cache after: {cache.usage().used_blocks}/{cache.num_blocks} blocks in use")

    worst, scale = 0.0, 0.0
    for r in requests:
        ids = np.concatenate([r.prompt, r.generated[:-1]]).astype(np.int64)
        want = reference_logits(cfg, weights, ids)[len(r.prompt) - 1:]
        worst = max(worst, float(np.abs(np.array(r.logits) - want).max()))
        scale = max(scale, float(np.abs(want).max()))
        print(f"  {r.name}: arrived at step {r.arrival}, joined at {r.joined}, "
              f"prompt {len(r.prompt):>2} tokens -> {r.generated}")
    limit = TOLERANCE[args.dtype] * scale
    ok = worst <= limit
    print(f"logits max abs error vs float64 numpy model: {worst:.3e} "
          f"(tolerance {limit:.3e} = {TOLERANCE[args.dtype]:g} x max|logit| {scale:.2f}): {'OK' if ok else 'FAIL'}")
    greedy = all(r.generated == [int(np.argmax(row)) for row in r.logits] for r in requests)
    print(f"sampled tokens equal the argmax of their logits: {'OK' if greedy else 'FAIL'}")
    ok = ok and greedy
    cache.close()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
