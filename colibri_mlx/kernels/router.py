"""router_topk: noaux_tc routing (DeepSeek-V3 / Kimi-K2 / GLM-5) of a MoE layer.

``sigmoid(x . W^T)`` in float32; the correction bias steers the selection only; group-limited
top-k (a group scores the sum of its top-2 biased scores, the ``topk_group`` best groups stay);
the top ``num_experts_per_tok`` experts; weights are the unbiased scores, normalized
(``+1e-20``) when ``norm_topk_prob``, times ``routed_scaling_factor`` — transformers'
``DeepseekV3TopkRouter``. With ``shared_id`` every token gets one more slot ``(shared_id,
1.0)``: the shared expert run as expert E of moe_block.

Three implementations: :func:`router_reference` (pure MLX, the oracle and the CPU path) and
the two launches of metal_kernels/router.metal / cuda/router.cu for decode (S <= 8 tokens):
``router_scores`` (the float32 weight read once, E / ROWS threadgroups) and ``router_topk``
(one threadgroup per token). Kernel ties: the larger value wins, equal values go to the lower
expert / group index (MLX's argpartition leaves ties unspecified; equal float32 scores do not
occur with real weights). The kernel returns ids in selection order, the reference in
argpartition order: consumers (moe_block) do not depend on slot order.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import mlx.core as mx

from . import dispatch
from .moe import _Static, read_kernel_sections

MAX_TOKENS = 8            # decode; more tokens (prefill) use the reference
MAX_EXPERTS = 1024        # router_topk: one thread per expert in one threadgroup
MAX_K = 32                # selected experts per token (threadgroup table)
MAX_GROUPS = 32
SCORE_ROWS = 2            # experts per router_scores threadgroup: E / 2 threadgroups (128 for 256)
SCORE_SIMDGROUPS = 8      # 256 threads split each row (7168 floats: 7 float4 units per thread)
KERNEL_DTYPES = (mx.float32, mx.float16, mx.bfloat16)


@dataclass(frozen=True)
class RouterConfig:
    top_k: int
    n_group: int = 1
    topk_group: int = 1
    norm_topk_prob: bool = False
    routed_scaling_factor: float = 1.0


# ---------------------------------------------------------------------------------------
# Reference (pure MLX)


def reference_scores(x: mx.array, weight: mx.array) -> mx.array:
    """``sigmoid(x . W^T)`` in float32, ``[..., E]``."""
    return mx.sigmoid(x.astype(mx.float32) @ weight.T)


def reference_select(scores: mx.array, bias: mx.array, cfg: RouterConfig) -> tuple[mx.array, mx.array]:
    """``(ids [..., K], unbiased scores of the selected experts [..., K])``."""
    choice = scores + bias
    if cfg.n_group > 1:
        choice = _keep_top_groups(choice, cfg)
    ids = mx.argpartition(-choice, kth=cfg.top_k - 1, axis=-1)[..., : cfg.top_k]
    return ids, mx.take_along_axis(scores, ids, axis=-1)


def _keep_top_groups(choice: mx.array, cfg: RouterConfig) -> mx.array:
    grouped = choice.reshape(*choice.shape[:-1], cfg.n_group, -1)
    group_scores = mx.sort(grouped, axis=-1)[..., -2:].sum(axis=-1)
    top_groups = mx.argpartition(-group_scores, kth=cfg.topk_group - 1, axis=-1)[..., : cfg.topk_group]
    keep = mx.put_along_axis(mx.zeros(group_scores.shape, mx.bool_), top_groups, mx.array(True), axis=-1)
    return mx.where(keep[..., None], grouped, -mx.inf).reshape(choice.shape)


def normalize(weights: mx.array, cfg: RouterConfig) -> mx.array:
    if cfg.norm_topk_prob:
        weights = weights / (weights.sum(axis=-1, keepdims=True) + 1e-20)
    return weights * cfg.routed_scaling_factor


def with_shared_slot(ids: mx.array, weights: mx.array, shared_id: Optional[int]) -> tuple[mx.array, mx.array]:
    """Append the slot ``(shared_id, 1.0)`` to every token (nothing when ``shared_id`` is None)."""
    if shared_id is None:
        return ids, weights
    lead = ids.shape[:-1] + (1,)
    return (mx.concatenate([ids.astype(mx.int32), mx.full(lead, shared_id, mx.int32)], axis=-1),
            mx.concatenate([weights, mx.ones(lead, weights.dtype)], axis=-1))


def router_reference(x: mx.array, weight: mx.array, bias: mx.array, cfg: RouterConfig,
                     shared_id: Optional[int] = None) -> tuple[mx.array, mx.array]:
    ids, weights = reference_select(reference_scores(x, weight), bias, cfg)
    return with_shared_slot(ids.astype(mx.int32), normalize(weights, cfg), shared_id)


# ---------------------------------------------------------------------------------------
# Launches


_statics: dict = {}


def _static(key, build):
    """A launch's static parts (moe._Static), built once per key."""
    st = _statics.get(key)
    if st is None:
        st = _statics[key] = build()
    return st


def scores_spec(x: mx.array, weight: mx.array, backend: str = dispatch.METAL, rows: int = SCORE_ROWS,
                simdgroups: int = SCORE_SIMDGROUPS) -> dispatch.LaunchSpec:
    """``scores [S, E]`` float32 = sigmoid(x . W^T) for ``x [S, D]``, ``weight [E, D]`` float32."""
    S, D = x.shape
    E = weight.shape[0]

    def build():
        header, bodies = read_kernel_sections("router", backend)
        return _Static(
            name="router_scores", input_names=("x", "w", "params"), output_names=("scores",),
            source=bodies["router_scores"], header=header, output_shapes=[(S, E)], output_dtypes=[mx.float32],
            grid=(32 * simdgroups * -(-E // rows), 1, 1), threadgroup=(32 * simdgroups, 1, 1),
            template=[("T", x.dtype), ("S", S), ("ROWS", rows), ("NW", simdgroups), ("V4", int(D % 4 == 0))],
            params=dispatch.int_params(D, E))

    st = _static(("scores", S, D, E, x.dtype, backend, rows, simdgroups), build)
    return st.spec([x, weight, st.params])


def topk_params(E: int, cfg: RouterConfig, shared_id: Optional[int] = None) -> tuple[mx.array, mx.array]:
    """router_topk's ``(params, fparams)``."""
    return (dispatch.int_params(E, cfg.top_k, cfg.n_group, cfg.topk_group, int(cfg.norm_topk_prob),
                                -1 if shared_id is None else int(shared_id)),
            dispatch.float_params(float(cfg.routed_scaling_factor)))


def topk_spec(scores: mx.array, bias: mx.array, cfg: RouterConfig, shared_id: Optional[int] = None,
              backend: str = dispatch.METAL) -> dispatch.LaunchSpec:
    """``ids [S, K(+1)]`` int32 and ``weights [S, K(+1)]`` float32 from ``scores [S, E]``."""
    S, E = scores.shape

    def build():
        KO = cfg.top_k + (shared_id is not None)
        tg = 32 * -(-E // 32)
        header, bodies = read_kernel_sections("router", backend)
        return _Static(
            name="router_topk", input_names=("scores", "bias", "params", "fparams"),
            output_names=("ids", "weights"), source=bodies["router_topk"], header=header,
            output_shapes=[(S, KO), (S, KO)], output_dtypes=[mx.int32, mx.float32],
            grid=(tg, S, 1), threadgroup=(tg, 1, 1), template=[("TG", tg)],
            params=topk_params(E, cfg, shared_id))

    st = _static(("topk", S, E, cfg, shared_id, backend), build)
    return st.spec([scores, bias, *st.params])


def decline_reason(x: mx.array, weight: mx.array, bias: mx.array, cfg: RouterConfig) -> Optional[str]:
    E = weight.shape[0]
    if x.dtype not in KERNEL_DTYPES:
        return f"x dtype {x.dtype} not float32/float16/bfloat16"
    if weight.dtype != mx.float32 or bias.dtype != mx.float32:
        return f"router weight/bias {weight.dtype}/{bias.dtype} (the kernel reads float32)"
    if E > MAX_EXPERTS:
        return f"E={E} experts above {MAX_EXPERTS}"
    if not 1 <= cfg.top_k <= min(MAX_K, E):
        return f"top_k={cfg.top_k} outside 1..{min(MAX_K, E)}"
    if cfg.n_group > 1 and (cfg.n_group > MAX_GROUPS or E // cfg.n_group < 2):
        return f"n_group={cfg.n_group} (the kernel takes <= {MAX_GROUPS} groups of >= 2 experts)"
    return None


_declined: dict = {}


def _decline_cached(x, weight, bias, cfg) -> Optional[str]:
    key = (x.dtype, weight.dtype, bias.dtype, weight.shape[0], cfg)
    if key not in _declined:
        _declined[key] = decline_reason(x, weight, bias, cfg)
    return _declined[key]


def router_topk(x: mx.array, weight: mx.array, bias: mx.array, cfg: RouterConfig,
                shared_id: Optional[int] = None) -> tuple[mx.array, mx.array]:
    """``(ids [..., K(+1)] int32, weights [..., K(+1)] float32)`` for ``x [..., D]`` (the model
    passes ``[S, D]``: no reshapes on the decode path)."""
    if x.ndim != 2:
        lead = x.shape[:-1]
        ids, weights = router_topk(x.reshape(-1, x.shape[-1]), weight, bias, cfg, shared_id)
        return ids.reshape(*lead, ids.shape[-1]), weights.reshape(*lead, ids.shape[-1])
    impl = dispatch.backend()
    if impl == dispatch.REFERENCE or x.shape[0] > MAX_TOKENS:
        dispatch.record_call("router", dispatch.REFERENCE if impl == dispatch.REFERENCE else "prefill")
        return router_reference(x, weight, bias, cfg, shared_id)
    reason = _decline_cached(x, weight, bias, cfg)
    if reason is not None:
        dispatch.record_fallback("router", reason)
        return router_reference(x, weight, bias, cfg, shared_id)
    dispatch.record_call("router", impl)
    scores = dispatch.launch(impl, scores_spec(x, weight, impl))[0]
    ids, weights = dispatch.launch(impl, topk_spec(scores, bias, cfg, shared_id, impl))
    return ids, weights
