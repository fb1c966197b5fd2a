"""A float64 numpy forward of a deepseek2 GGUF model, on the weights exactly as ``gguf.quants``
dequantizes them, read by GGUF tensor name straight from the file (independent of the loader's
name mapping, its kv_b join and its metadata mapping).

The numerics are Hugging Face DeepSeek-V3's (transformers ``modeling_deepseek_v3``): MLA without
absorption, YaRN rope on pairs (llama.cpp's "norm" rope; the same dot products as the interleaved
layout), sigmoid routing with the ``exp_probs_b`` bias choosing experts (groups by the sum of their
top two biased scores), the unbiased scores weighting them.
"""

from __future__ import annotations

import math

import numpy as np


class GgufOracle:
    def __init__(self, path: str):
        import gguf

        self.path = path
        self.reader = reader = gguf.GGUFReader(path)
        self.fields = {k: f.contents() for k, f in reader.fields.items() if not k.startswith("tokenizer.ggml.")}
        self.tensors = {t.name: t for t in reader.tensors}
        arch = self.fields["general.architecture"]
        a = lambda k, d=None: self.fields.get(f"{arch}.{k}", d)   # noqa: E731
        self.n_layers = a("block_count") - a("nextn_predict_layers", 0)   # NextN layers are not in the forward
        self.H = a("attention.head_count")
        self.rope = a("rope.dimension_count")
        self.kv_lora = a("attention.kv_lora_rank")
        self.nope = a("attention.key_length_mla") - self.rope
        self.v = a("attention.value_length_mla")
        self.eps = float(a("attention.layer_norm_rms_epsilon"))
        self.n_dense = a("leading_dense_block_count", 0)
        self.index_topk = a("attention.indexer.top_k")
        self.index_heads, self.index_dim = a("attention.indexer.head_count"), a("attention.indexer.key_length")
        self.k = a("expert_used_count")
        self.n_group, self.topk_group = a("expert_group_count", 1), a("expert_group_used_count", 1)
        self.scale_w = float(a("expert_weights_scale", 1.0))
        self.norm_w = bool(a("expert_weights_norm", False))
        base = float(a("rope.freq_base"))
        dim = self.rope
        inv = 1.0 / base ** (np.arange(0, dim, 2, dtype=np.float64) / dim)
        self.mscale_cos = 1.0
        self.softmax_scale = (self.nope + self.rope) ** -0.5
        if a("rope.scaling.type") == "yarn":
            factor = float(a("rope.scaling.factor"))
            orig = a("rope.scaling.original_context_length")
            fast, slow = float(a("rope.scaling.yarn_beta_fast", 32)), float(a("rope.scaling.yarn_beta_slow", 1))
            m_all = float(np.float32(a("rope.scaling.yarn_log_multiplier", 0.0))) / 0.1

            def corr(rot):
                return dim * math.log(orig / (rot * 2 * math.pi)) / (2 * math.log(base))

            low, high = max(math.floor(corr(fast)), 0), min(math.ceil(corr(slow)), dim - 1)
            if low == high:
                high += 0.001
            ramp = np.clip((np.arange(dim // 2, dtype=np.float64) - low) / (high - low), 0, 1)
            extrapolation = 1 - ramp
            inv = inv / factor * (1 - extrapolation) + inv * extrapolation

            def mscale(m):
                return 1.0 if factor <= 1 else 0.1 * m * math.log(factor) + 1.0

            self.mscale_cos = mscale(m_all) / mscale(m_all)   # llama.cpp: mscale == mscale_all_dim
            self.softmax_scale *= mscale(m_all) ** 2
        self.inv_freq = inv

    def w(self, name: str) -> np.ndarray:
        import gguf

        t = self.tensors[name]
        return gguf.quants.dequantize(t.data, t.tensor_type).astype(np.float64)

    def norm(self, x, name):
        return x / np.sqrt(np.mean(x * x, axis=-1, keepdims=True) + self.eps) * self.w(name)

    def rotate(self, x, positions):
        """Rope on pairs (x[2i], x[2i+1]) of the last axis; x [T, ..., rope]."""
        ang = positions[:, None] * self.inv_freq[None, :]
        shape = (len(positions),) + (1,) * (x.ndim - 2) + (-1,)
        cos, sin = (np.cos(ang) * self.mscale_cos).reshape(shape), (np.sin(ang) * self.mscale_cos).reshape(shape)
        x0, x1 = x[..., 0::2], x[..., 1::2]
        out = np.empty_like(x)
        out[..., 0::2], out[..., 1::2] = x0 * cos - x1 * sin, x0 * sin + x1 * cos
        return out

    def attention(self, x, i):
        p = f"blk.{i}."
        T, H, nope, rope = x.shape[0], self.H, self.nope, self.rope
        selected = np.tril(np.ones((T, T), bool))
        if p + "attn_q_a.weight" in self.tensors:
            q_latent = self.norm(x @ self.w(p + "attn_q_a.weight").T, p + "attn_q_a_norm.weight")
            q = q_latent @ self.w(p + "attn_q_b.weight").T
            if p + "indexer.attn_q_b.weight" in self.tensors:
                selected = self.indexer(x, q_latent, i)
        else:
            q = x @ self.w(p + "attn_q.weight").T
        q = q.reshape(T, H, nope + rope)
        kv_a = x @ self.w(p + "attn_kv_a_mqa.weight").T
        latent = self.norm(kv_a[:, :self.kv_lora], p + "attn_kv_a_norm.weight")
        pos = np.arange(T, dtype=np.float64)
        q_pe, k_pe = self.rotate(q[..., nope:], pos), self.rotate(kv_a[:, self.kv_lora:], pos)
        if p + "attn_kv_b.weight" in self.tensors:
            kv = (latent @ self.w(p + "attn_kv_b.weight").T).reshape(T, H, nope + self.v)
            k_nope, v = kv[..., :nope], kv[..., nope:]
        else:
            k_b, v_b = self.w(p + "attn_k_b.weight"), self.w(p + "attn_v_b.weight")   # [H, L, nope], [H, v, L]
            k_nope = np.einsum("tl,hln->thn", latent, k_b)
            v = np.einsum("tl,hvl->thv", latent, v_b)
        scores = (np.einsum("thn,shn->hts", q[..., :nope], k_nope) + np.einsum("thr,sr->hts", q_pe, k_pe)) \
            * self.softmax_scale
        scores = np.where(selected[None], scores, -np.inf)
        probs = np.exp(scores - scores.max(-1, keepdims=True))
        probs /= probs.sum(-1, keepdims=True)
        out = np.einsum("hts,shv->thv", probs, v).reshape(T, H * self.v)
        return out @ self.w(p + "attn_output.weight").T

    def indexer(self, x, q_latent, i):
        """The DSA lightning indexer's choice, ``[T, T]`` bool (transformers' GlmMoeDsaIndexer):
        per query the ``top_k`` keys of highest score (:meth:`index_scores`), ties to the lowest
        positions."""
        T = x.shape[0]
        order = self.top_k(self.index_scores(x, q_latent, i), self.index_topk)
        selected = np.zeros((T, T), bool)
        np.put_along_axis(selected, order, True, axis=-1)
        return selected & np.tril(np.ones((T, T), bool))

    @staticmethod
    def top_k(index, k):
        return np.argsort(-index, axis=-1, kind="stable")[:, :k]

    def index_scores(self, x, q_latent, i):
        """``[T, T]``: sum_h w_h relu(q_h . k) of each causal key (-inf past the query); rope on
        the first ``rope`` dims of each head (pairs), k LayerNorm with bias."""
        p = f"blk.{i}."
        T, nh, hd = x.shape[0], self.index_heads, self.index_dim
        pos = np.arange(T, dtype=np.float64)
        q = (q_latent @ self.w(p + "indexer.attn_q_b.weight").T).reshape(T, nh, hd)
        k = x @ self.w(p + "indexer.attn_k.weight").T
        k = (k - k.mean(-1, keepdims=True)) / np.sqrt(k.var(-1, keepdims=True) + 1e-6)
        k = k * self.w(p + "indexer.k_norm.weight") + self.w(p + "indexer.k_norm.bias")
        q = np.concatenate([self.rotate(q[..., :self.rope], pos), q[..., self.rope:]], -1)
        k = np.concatenate([self.rotate(k[:, :self.rope], pos), k[:, self.rope:]], -1)
        scores = np.maximum(np.einsum("thd,sd->ths", q, k) * hd ** -0.5, 0)
        weights = (x @ self.w(p + "indexer.proj.weight").T) * nh ** -0.5
        index = np.einsum("th,ths->ts", weights, scores)
        return np.where(np.tril(np.ones((T, T), bool)), index, -np.inf)

    def mlp(self, x, gate, up, down):
        g, u = x @ gate.T, x @ up.T
        return (g / (1 + np.exp(-g)) * u) @ down.T

    def moe(self, x, i):
        p = f"blk.{i}."
        scores = 1 / (1 + np.exp(-(x @ self.w(p + "ffn_gate_inp.weight").T)))
        choice = scores + self.w(p + "exp_probs_b.bias")
        T, E = scores.shape
        groups = choice.reshape(T, self.n_group, E // self.n_group)
        group_score = np.sort(groups, axis=-1)[..., -2:].sum(-1)
        keep = np.argsort(-group_score, axis=-1, kind="stable")[:, :self.topk_group]
        mask = np.zeros((T, self.n_group), bool)
        np.put_along_axis(mask, keep, True, axis=-1)
        masked = np.where(np.repeat(mask, E // self.n_group, axis=-1), choice, -np.inf)
        order = np.argsort(-masked, axis=-1, kind="stable")
        ids = order[:, :self.k]
        # the router's margin: how far the last chosen expert is ahead of the first one left out
        # (when one is left out within the kept groups), and the last kept group of the first dropped
        last, first_out = (np.take_along_axis(masked, order[:, j:j + 1], -1)[:, 0] for j in (self.k - 1, self.k))
        margin = np.where(np.isfinite(first_out), last - first_out, np.inf)
        if self.topk_group < self.n_group:
            ranked = -np.sort(-group_score, axis=-1)
            margin = np.minimum(margin, ranked[:, self.topk_group - 1] - ranked[:, self.topk_group])
        weights = np.take_along_axis(scores, ids, -1)
        if self.norm_w:
            weights = weights / (weights.sum(-1, keepdims=True) + 1e-20)
        weights = weights * self.scale_w
        gates, ups, downs = (self.w(p + f"ffn_{n}_exps.weight") for n in ("gate", "up", "down"))
        y = np.zeros_like(x)
        for t in range(T):
            for e, wt in zip(ids[t], weights[t]):
                y[t] += wt * self.mlp(x[t:t + 1], gates[e], ups[e], downs[e])[0]
        if p + "ffn_gate_shexp.weight" in self.tensors:
            y += self.mlp(x, *(self.w(p + f"ffn_{n}_shexp.weight") for n in ("gate", "up", "down")))
        return y, margin

    def logits(self, ids) -> tuple[np.ndarray, np.ndarray]:
        """float64 logits ``[T, V]`` and each position's smallest router margin over the MoE layers."""
        x = self.w("token_embd.weight")[np.asarray(ids)]
        margins = np.full(len(ids), np.inf)
        for i in range(self.n_layers):
            p = f"blk.{i}."
            x = x + self.attention(self.norm(x, p + "attn_norm.weight"), i)
            h = self.norm(x, p + "ffn_norm.weight")
            if i < self.n_dense:
                x = x + self.mlp(h, *(self.w(p + f"ffn_{n}.weight") for n in ("gate", "up", "down")))
            else:
                y, margin = self.moe(h, i)
                x, margins = x + y, np.minimum(margins, margin)
        out = self.w("output.weight") if "output.weight" in self.tensors else self.w("token_embd.weight")
        return self.norm(x, "output_norm.weight") @ out.T, margins
