"""Speculative decoding (colibri_mlx/speculative.py, models/mtp.py).

Oracles: greedy generation without speculation (token for token), the float64 MTP formula over
transformers' decoder layer, exact probabilities computed in numpy (chi-square), and the caches
of a run that never saw the rejected rows (bitwise).
"""

from __future__ import annotations

import json
import math
import os
from unittest.mock import ANY

import mlx.core as mx
import numpy as np
import pytest

from helpers_tiny import CONFIG, GLM, write_tiny_container

from colibri_mlx import kernels, speculative
from colibri_mlx.generate import SamplingParams, generate_tokens
from colibri_mlx.models.deepseek_v3 import rms_norm
from colibri_mlx.models.loading import load_model
from colibri_mlx.models.mtp import mtp_head

MODELS = {"v3": dict(CONFIG, num_nextn_predict_layers=1, max_position_embeddings=96),
          "glm": dict(GLM, num_nextn_predict_layers=1, max_position_embeddings=96)}   # DSA past 8 tokens
PROMPTS = [[7], [5, 9, 5, 9, 5], list(range(40, 53)), [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3, 8]]


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return {name: load_model(write_tiny_container(tmp_path_factory.mktemp(name), config, seed=4), dtype="float32")
            for name, config in MODELS.items()}


SAMPLING = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def run(model, prompt, n, **kw):
    params = SamplingParams(**{k: kw.pop(k) for k in SAMPLING if k in kw})
    return list(generate_tokens(model, prompt, n, params, **kw))


def tokens_of(model, prompt, n, **kw):
    return [t for t, _ in run(model, prompt, n, **kw)]


def last_stats(model, prompt, n, **kw):
    return run(model, prompt, n, **kw)[-1][1]


@pytest.fixture
def oracle_drafts(monkeypatch):
    """Drafts that are the greedy continuation with ~1 in 3 tokens corrupted: every accepted
    length 0..k occurs, so rollbacks of every depth are crossed (random MTP weights and short
    contexts alone give few acceptances)."""
    def install(prompt, reference, seed=0):
        rng = np.random.default_rng(seed)

        def truth(seen, j):
            i = len(seen) - len(prompt) + j
            if i >= len(reference):
                return 0
            return reference[i] if rng.random() > 0.33 else (reference[i] + 1) % 200

        def ngram(index, k, max_n=3):
            return [truth(index.tokens, j) for j in range(k)]

        def choose(self, logits, drafts):
            return truth(self.seen, len(drafts)), None

        monkeypatch.setattr(speculative.NgramIndex, "drafts", ngram)
        monkeypatch.setattr(speculative.Acceptor, "choose", choose)

    return install


# ----------------------------------------------------------------------------- greedy identity


@pytest.mark.parametrize("name", ["v3", "glm"])
@pytest.mark.parametrize("draft", ["mtp", "ngram"])
def test_greedy_identity_with_oracle_drafts(models, oracle_drafts, name, draft):
    model = models[name]
    for prompt, n, k in ((PROMPTS[1], 23, 3), (PROMPTS[2], 17, 2)):
        want = tokens_of(model, prompt, n, draft="none")
        oracle_drafts(prompt, want, seed=n)
        stats = last_stats(model, prompt, n, draft=draft, num_draft=k)
        got = tokens_of(model, prompt, n, draft=draft, num_draft=k)
        assert got == want, (prompt, draft)
        assert 0 < stats["draft_accepted"] < stats["draft_proposed"], stats   # both outcomes crossed


@pytest.mark.parametrize("name", ["v3", "glm"])
def test_greedy_identity_real_drafts(models, name):
    model = models[name]
    prompt = PROMPTS[3]
    want = tokens_of(model, prompt, 20, draft="none")
    for draft in ("mtp", "ngram"):
        assert tokens_of(model, prompt, 20, draft=draft, num_draft=3) == want, draft


@pytest.mark.parametrize("draft", ["mtp", "ngram"])
def test_greedy_identity_with_repetition_penalty(models, oracle_drafts, draft):
    """Greedy with a repetition penalty: a verify row's target is the argmax after the penalty
    over the tokens kept before it, so drafts of the penalized continuation are kept and the
    plain argmax (what an unpenalized target would be) is not taken for them."""
    model = models["v3"]
    prompt = PROMPTS[1]
    want = tokens_of(model, prompt, 23, draft="none", repetition_penalty=1.8)
    assert want != tokens_of(model, prompt, 23, draft="none")        # the penalty changes the text
    oracle_drafts(prompt, want, seed=5)
    stats = last_stats(model, prompt, 23, draft=draft, num_draft=3, repetition_penalty=1.8)
    assert tokens_of(model, prompt, 23, draft=draft, num_draft=3, repetition_penalty=1.8) == want
    assert 0 < stats["draft_accepted"] < stats["draft_proposed"], stats


@pytest.mark.slow
@pytest.mark.parametrize("name", ["v3", "glm"])
@pytest.mark.parametrize("draft", ["mtp", "ngram"])
def test_greedy_identity_sweep(models, name, draft):
    """Every prompt, several lengths and draft counts, up to the context limit (96)."""
    model = models[name]
    for prompt in PROMPTS[1:]:
        want = tokens_of(model, prompt, 96, draft="none")   # ends at the context limit
        for n in (2, 17, 96):
            for k in (1, 4, 7):
                got = tokens_of(model, prompt, n, draft=draft, num_draft=k)
                assert got == want[:n], (prompt, n, k)


def test_stop_token_and_cache_left_as_without_speculation(models, oracle_drafts):
    """A stop id inside the accepted drafts ends the reply there; the cache then holds what it
    holds without speculation (the prompt and every token but the last), and continuing from it
    gives the same tokens."""
    model = models["glm"]
    prompt = PROMPTS[2]
    ref = tokens_of(model, prompt, 30, draft="none")
    stop = ref[11]
    want = ref[:ref.index(stop) + 1]
    oracle_drafts(prompt, ref)
    caches = {}
    for draft in ("none", "ngram"):
        cache = model.make_cache()
        got = [t for t, _ in generate_tokens(model, prompt, 30, draft=draft, num_draft=4, cache=cache,
                                             stop_ids=[stop])]
        assert got == want
        assert cache.offset == len(prompt) + len(want) - 1
        caches[draft] = cache
    more = [[want[-1], 3, 4]]
    a, b = (tokens_of(model, more[0], 8, cache=caches[d], draft="none") for d in ("none", "ngram"))
    assert a == b


def test_context_limit_ends_as_without_speculation(models):
    model = models["v3"]
    prompt = list(range(1, 80))
    want = [(t, s["finish_reason"]) for t, s in generate_tokens(model, prompt, 50, draft="none")]
    got = [(t, s["finish_reason"]) for t, s in generate_tokens(model, prompt, 50, draft="ngram", num_draft=7)]
    assert got == want and len(want) == 96 - 79 + 1 and want[-1][1] == "length"


GGUF_GLM = os.path.join(os.path.dirname(__file__), "data", "gguf", "tiny-glm-bf16.gguf")


@pytest.mark.parametrize("prompt, n", [(PROMPTS[1], 9), (PROMPTS[3], 24)])   # 19 + 24 tokens: past index_topk 16
def test_gguf_nextn_layer_drafts_with_greedy_identity(oracle_drafts, prompt, n):
    """A GGUF file's NextN layer (``blk.N.nextn.*``, llama.cpp's glm-dsa files; tests/data/gguf)
    loads as the MTP layer and is the default draft; greedy output with it is the output without
    speculation, with its own drafts (random weights: rejected) and with oracle drafts through
    the layer (kept and rejected)."""
    import colibri_mlx

    model, _ = colibri_mlx.load(GGUF_GLM, dtype="float32")
    assert len(model.mtp_layers) == 1
    assert speculative.resolve_draft(model, None) == "mtp"
    want = tokens_of(model, prompt, n, draft="none")
    default = run(model, prompt, n)                              # no draft given: the NextN layer's
    assert [t for t, _ in default] == want
    assert default[-1][1]["draft_proposed"] > default[-1][1]["draft_accepted"], default[-1][1]
    assert tokens_of(model, prompt, n, draft="mtp", num_draft=4) == want
    oracle_drafts(prompt, want, seed=n)
    got = run(model, prompt, n, draft="mtp", num_draft=3)
    assert [t for t, _ in got] == want
    assert 0 < got[-1][1]["draft_accepted"] < got[-1][1]["draft_proposed"], got[-1][1]


# ----------------------------------------------------------------------------- rollback


def test_rollback_is_exact(models):
    """Rows verified and rejected, then rolled back: the next step's logits and every cache
    row (latent KV, DSA indexer keys) are bitwise those of a run that never saw them."""
    model = models["glm"]
    prompt = mx.array([PROMPTS[2]])
    P = prompt.shape[1]
    clean, rolled = model.make_cache(), model.make_cache()
    model(prompt, clean)
    model(prompt, rolled)
    model(mx.array([[11, 200, 201, 202]]), rolled)
    rolled.offset = P
    want, got = model(mx.array([[11]]), clean), model(mx.array([[11]]), rolled)
    np.testing.assert_array_equal(np.array(got), np.array(want))
    assert "index_key" in clean.layers[0].buffers
    for a, b in zip(clean.layers, rolled.layers):
        for stream in a.buffers:
            np.testing.assert_array_equal(np.array(a.read(stream, P + 1)), np.array(b.read(stream, P + 1)))


def test_mtp_cache_rollback_is_exact(models):
    model = models["glm"]
    head = mtp_head(model)
    ids = PROMPTS[2]
    h = rms_norm(model.hidden_states(mx.array([ids])), model.norm, model.args.rms_norm_eps)
    outs = []
    for junk in (False, True):
        cache = head.make_cache()
        _, x = head(h, mx.array([ids[1:] + [17]]), cache)
        if junk:
            start = cache.offset
            y = x[:, -1:]
            for t in (200, 201, 202):
                _, y = head(y, mx.array([[t]]), cache)
            cache.offset = start
        logits, _ = head(x[:, -1:], mx.array([[33]]), cache)
        outs.append(np.array(logits))
    np.testing.assert_array_equal(outs[1], outs[0])


# ----------------------------------------------------------------------------- MTP formula


def test_mtp_layer_from_out_mtp_shard(tmp_path, models):
    """A container whose MTP layer is in ``out-mtp-*`` (the converter's --mtp pass) loads it, and
    drafts as the one with the layer in the main shards; without the shard there is no MTP."""
    path = write_tiny_container(tmp_path / "c", MODELS["v3"], seed=4, mtp_shard=True)
    assert sorted(f for f in os.listdir(path) if f.endswith(".safetensors"))[-1] == "out-mtp-00000.safetensors"
    model = load_model(path, dtype="float32")
    assert len(model.mtp_layers) == 1
    got, want = (run(m, PROMPTS[3], 12, draft="mtp") for m in (model, models["v3"]))
    assert [t for t, _ in got] == [t for t, _ in want]
    assert got[-1][1] == dict(want[-1][1], prompt_time=ANY, generation_time=ANY)   # the same draft counts
    os.remove(os.path.join(path, "out-mtp-00000.safetensors"))
    config = json.loads(open(os.path.join(path, "config.json")).read())
    config["num_nextn_predict_layers"] = 0
    open(os.path.join(path, "config.json"), "w").write(json.dumps(config))
    plain = load_model(path, dtype="float32")
    assert plain.mtp_layers == [] and speculative.resolve_draft(plain, None) == "none"


def test_mtp_logits_match_float64_formula(tmp_path):
    """The MTP layer's logits against the formula in float64: numpy for the norms, eh_proj and
    head, transformers' DeepSeek-V3 decoder layer (the parity oracle) for the layer, its main
    hidden states from transformers' model (after the final norm). Then two recurrent draft
    steps as MTPDraft.propose takes them (offsets L and L + 1): the layer's own output x as h,
    the drafted token's embedding, one row attending to the layer's cache."""
    import torch
    from safetensors.numpy import save_file

    from helpers_models import build_hf_model, state_dict_numpy, write_tokenizer

    hf = build_hf_model("deepseek_v3", seed=5, num_hidden_layers=4)
    state = state_dict_numpy(hf)     # float32: what the checkpoint holds
    hf = hf.double()
    hf.set_experts_implementation("eager")   # grouped_mm takes no float64
    rng = np.random.default_rng(1)
    D = hf.config.hidden_size
    extra = {"eh_proj.weight": rng.standard_normal((D, 2 * D)) / np.sqrt(2 * D),
             "enorm.weight": 1 + 0.1 * rng.standard_normal(D), "hnorm.weight": 1 + 0.1 * rng.standard_normal(D),
             "shared_head.norm.weight": 1 + 0.1 * rng.standard_normal(D)}
    state.update({"model.layers.3." + k: v.astype(np.float32) for k, v in extra.items()})
    save_file(state, str(tmp_path / "model.safetensors"))
    config = hf.config.to_dict()
    config.update(num_hidden_layers=3, num_nextn_predict_layers=1, model_type="deepseek_v3")
    config["mlp_layer_types"] = config.get("mlp_layer_types", [None] * 4)[:3] if config.get("mlp_layer_types") else None
    config = {k: v for k, v in config.items() if v is not None}
    (tmp_path / "config.json").write_text(json.dumps(config))
    write_tokenizer(str(tmp_path))
    model = load_model(str(tmp_path), dtype="float32")

    ids = [3, 17, 200, 5, 9, 88, 41]
    L = len(ids) - 1
    # ours: rows 0..L-1 see tokens 1..L
    h = rms_norm(model.hidden_states(mx.array([ids[:L]])), model.norm, model.args.rms_norm_eps)
    head = mtp_head(model)
    cache = head.make_cache()
    got, x = head(h, mx.array([ids[1:]]), cache)
    got = np.array(got[0], dtype=np.float64)
    drafts = [int(np.argmax(got[-1]))]          # greedy drafts, fed back as propose does
    steps = []
    for _ in range(2):
        assert cache.offset == L + len(steps) > 0
        step_logits, x = head(x[:, -1:], mx.array([[drafts[-1]]]), cache, last_only=True)
        steps.append(np.array(step_logits[0, -1], dtype=np.float64))
        drafts.append(int(np.argmax(steps[-1])))

    # float64 oracle
    eps = hf.config.rms_norm_eps
    f64 = {k: v.astype(np.float64) for k, v in state.items()}

    def norm(x, w):
        return x / np.sqrt((x * x).mean(-1, keepdims=True) + eps) * w

    with torch.no_grad():
        tokens = torch.tensor([ids[:L]])
        x = hf.model.embed_tokens(tokens)
        pos = torch.arange(L)[None]
        cos_sin = hf.model.rotary_emb(x, pos)
        mask = torch.full((L, L), -1e300, dtype=torch.float64).triu(1)[None, None]
        for layer in hf.model.layers[:3]:
            x = layer(x, attention_mask=mask, position_ids=pos, position_embeddings=cos_sin)
        hidden = norm(x[0].numpy(), f64["model.norm.weight"])
        e = f64["model.embed_tokens.weight"][ids[1:]]
        e[0] = 0.0                                                           # position 0
        p = "model.layers.3."
        y = np.concatenate([norm(e, f64[p + "enorm.weight"]), norm(hidden, f64[p + "hnorm.weight"])], -1)
        y = y @ f64[p + "eh_proj.weight"].T

        def mtp_layer(rows):   # the layer over every row so far: causal, so earlier rows are unchanged
            n = len(rows)
            pos = torch.arange(n)[None]
            mask = torch.full((n, n), -1e300, dtype=torch.float64).triu(1)[None, None]
            rows = torch.tensor(rows)[None]
            return hf.model.layers[3](rows, attention_mask=mask, position_ids=pos,
                                      position_embeddings=hf.model.rotary_emb(rows, pos))[0].numpy()

        def head_logits(y):
            return norm(y, f64[p + "shared_head.norm.weight"]) @ f64["lm_head.weight"].T

        out = mtp_layer(y)
        want = head_logits(out)
        want_steps = []
        for token in drafts[:2]:
            # h = the layer's own output at the last row (before shared_head.norm), e = the draft's embedding
            e = f64["model.embed_tokens.weight"][token]
            row = np.concatenate([norm(e, f64[p + "enorm.weight"]), norm(out[-1], f64[p + "hnorm.weight"])])
            y = np.vstack([y, row @ f64[p + "eh_proj.weight"].T])
            out = mtp_layer(y)
            want_steps.append(head_logits(out[-1]))
    err = np.abs(got - want).max() / np.abs(want).max()
    assert err < 1e-4, err
    assert np.abs(want).max() > 1.0   # far from degenerate
    for j, (g, w) in enumerate(zip(steps, want_steps)):
        err = np.abs(g - w).max() / np.abs(w).max()
        assert err < 1e-4, (j, err)
        assert np.abs(w - want[-1]).max() > 0.1 * np.abs(w).max()   # a step's own logits, not the row before's


# ----------------------------------------------------------------------------- sampling


def chi2_critical(df: int, z: float = 3.719) -> float:
    """Wilson–Hilferty upper quantile of chi-square (z = 3.719: p = 1e-4)."""
    a = 2.0 / (9 * df)
    return df * (1 - a + z * math.sqrt(a)) ** 3


def chi2(counts: np.ndarray, probs: np.ndarray) -> tuple[float, int]:
    n = counts.sum()
    keep = probs * n >= 5
    rest_p, rest_c = probs[~keep].sum(), counts[~keep].sum()
    exp = np.append(probs[keep] * n, rest_p * n)
    obs = np.append(counts[keep], rest_c)
    if rest_p * n < 5:
        assert rest_c <= max(5, 3 * rest_p * n), (rest_c, rest_p * n)
        exp, obs = exp[:-1], obs[:-1]
    return float(((obs - exp) ** 2 / exp).sum()), len(exp) - 1


def numpy_probs(logits: np.ndarray, seen, p: SamplingParams) -> np.ndarray:
    z = logits.astype(np.float64).copy()
    for t in set(seen):
        z[t] = z[t] / p.repetition_penalty if z[t] > 0 else z[t] * p.repetition_penalty
    z = z / p.temperature
    if p.top_k:
        z[z < np.sort(z)[-p.top_k]] = -np.inf
    e = np.exp(z - z.max())
    return e / e.sum()


@pytest.mark.parametrize("deterministic_drafts", [False, True])
def test_acceptance_rule_gives_the_model_distribution(deterministic_drafts):
    """Drafts from q (or fixed, as ngram's), the rule applied to p: the first token is
    distributed as p0, the second (after an accepted draft a) as p1 after a; penalty, temperature
    and top-k applied to both p and q."""
    V, N = 6, 2000
    rng = np.random.default_rng(0)
    p_logits = rng.standard_normal((3, V)) * 1.5
    q_logits = p_logits[:2] + rng.standard_normal((2, V))
    params = SamplingParams(temperature=0.9, top_k=5, repetition_penalty=1.4)
    seen = [2]
    first = np.zeros(V)
    second = np.zeros((V, V))
    acceptor = speculative.Acceptor(params, seed=1, seen=list(seen))
    pl = mx.array(p_logits.astype(np.float32))
    for _ in range(N):
        if deterministic_drafts:
            drafts, qs = [1, 3], [None, None]
        else:
            drafts, qs = [], []
            for j in range(2):
                t, q = acceptor.choose(mx.array(q_logits[j].astype(np.float32)), drafts)
                drafts.append(t)
                qs.append(q)
        out = acceptor.accept(pl, drafts, qs)
        first[out[0]] += 1
        if len(out) > 1:
            second[out[0], out[1]] += 1
    stat, df = chi2(first, numpy_probs(p_logits[0], seen, params))
    assert stat < chi2_critical(df), (stat, df)
    for a in range(V):
        if second[a].sum() >= 200:
            stat, df = chi2(second[a], numpy_probs(p_logits[1], seen + [a], params))
            assert stat < chi2_critical(df), (a, stat, df)
    assert (second.sum(axis=1) >= 200).sum() >= 1


@pytest.mark.slow
@pytest.mark.parametrize("draft", ["mtp", "ngram"])
def test_sampled_pairs_have_the_model_distribution(models, draft):
    """The first two generated tokens with speculation, over many seeds, against the exact
    distribution computed from the model without speculation (top-k 3: 9 outcomes)."""
    model = models["v3"]
    prompt = [5, 9, 5, 9, 5, 9]
    params = SamplingParams(temperature=1.0, top_k=3)
    logits0 = np.array(model(mx.array([prompt]))[0, -1])
    p0 = numpy_probs(logits0, [], params)
    support = np.argsort(-p0)[:3]
    exact = {}
    for a in support:
        p1 = numpy_probs(np.array(model(mx.array([prompt + [int(a)]]))[0, -1]), [], params)
        for b in np.argsort(-p1)[:3]:
            exact[(int(a), int(b))] = p0[a] * p1[b]
    keys = sorted(exact)
    counts = np.zeros(len(keys))
    for seed in range(600):
        pair = tuple(tokens_of(model, prompt, 2, temperature=1.0, top_k=3, seed=seed, draft=draft, num_draft=2))
        counts[keys.index(pair)] += 1
    stat, df = chi2(counts, np.array([exact[k] for k in keys]))
    assert stat < chi2_critical(df), (stat, df, counts)


def test_seeded_sampling_default_is_without_speculation(models):
    model = models["v3"]
    kw = dict(temperature=1.0, seed=3)
    assert tokens_of(model, PROMPTS[1], 10, **kw) == tokens_of(model, PROMPTS[1], 10, draft="none", **kw)
    assert "draft_steps" not in last_stats(model, PROMPTS[1], 3, **kw)
    assert last_stats(model, PROMPTS[1], 3)["draft_steps"] > 0      # greedy: mtp by default
    assert speculative.resolve_draft(model, None) == "mtp"


# ----------------------------------------------------------------------------- drafts, options


def test_ngram_drafts():
    """The lookup index against a scan of the whole context for the latest earlier match, over
    random contexts of a small vocabulary (many matches of every length) as they grow."""
    def scan(seq, k, max_n=3):
        for n in range(min(max_n, len(seq) - 1), 0, -1):
            for i in range(len(seq) - n - 1, -1, -1):
                if seq[i:i + n] == seq[-n:]:
                    return seq[i + n:i + n + k]
        return []

    rng = np.random.default_rng(3)
    for vocab in (3, 8, 50):
        seq = [int(t) for t in rng.integers(0, vocab, 300)]
        index = speculative.NgramIndex(seq[:1])
        for i in range(1, len(seq)):
            index.extend(seq[i:i + 1])
            assert index.drafts(4) == scan(seq[:i + 1], 4), (vocab, i)
    assert speculative.NgramIndex([1, 2, 3, 9, 1, 2, 3]).drafts(3) == [9, 1, 2]
    assert speculative.NgramIndex([5, 1, 2, 7, 2]).drafts(2) == [7, 2]          # the 1-gram "2"
    assert speculative.NgramIndex([1, 2, 3]).drafts(2) == []
    assert speculative.NgramIndex([4, 4, 4, 4]).drafts(5) == [4]                # the latest earlier 3-gram match


def test_bad_draft_options(tmp_path):
    model = load_model(write_tiny_container(tmp_path / "plain"), dtype="float32")
    assert speculative.resolve_draft(model, None) == "none"
    with pytest.raises(ValueError, match="draft='mtp' needs the model's multi-token-prediction layer"):
        tokens_of(model, [1], 2, draft="mtp")
    with pytest.raises(ValueError, match="draft must be one of"):
        tokens_of(model, [1], 2, draft="eagle")
    with pytest.raises(ValueError, match="num_draft must be an integer in 1..7"):
        tokens_of(model, [1], 2, draft="ngram", num_draft=8)


def test_cli_draft_flags_and_stats_line(tmp_path):
    from click.testing import CliRunner

    from colibri_mlx.cli import main

    path = write_tiny_container(tmp_path / "m", MODELS["v3"], seed=4)
    runner = CliRunner()
    args = ["generate", "-m", path, "-p", "abab abab abab", "--no-chat-template", "--max-tokens", "12"]
    result = runner.invoke(main, args + ["--draft", "ngram", "--num-draft", "4"])
    assert result.exit_code == 0, result.output
    assert "% accepted" in result.output and "tokens/step" in result.output
    plain = runner.invoke(main, args + ["--draft", "none"])
    assert "accepted" not in plain.output
    assert plain.output.split("prompt:")[0] == result.output.split("prompt:")[0]   # same text
    bad = runner.invoke(main, args + ["--num-draft", "9"])
    assert bad.exit_code == 2 and "--num-draft" in bad.output
    chat = runner.invoke(main, ["chat", "-m", path, "--draft", "ngram", "--num-draft", "2", "--max-tokens", "6"],
                         input="abab abab\nabab\n/exit\n")
    assert chat.exit_code == 0 and chat.output.count("% accepted") == 2, chat.output
    for command in ("serve", "chat"):
        assert "--num-draft" in runner.invoke(main, [command, "--help"]).output
    no_mtp = write_tiny_container(tmp_path / "plain")
    bad = runner.invoke(main, ["generate", "-m", no_mtp, "-p", "ab", "--no-chat-template", "--draft", "mtp"])
    assert bad.exit_code == 2 and "multi-token-prediction" in bad.output


def test_package_api_takes_draft(models):
    import colibri_mlx

    model = models["v3"]

    class Ids:   # a tokenizer of token ids as text
        eos_token_ids = ()

        def encode(self, text):
            return [int(t) for t in text.split()]

        def detokenizer(self):
            class D:
                def add(self, t):
                    return f"{t} "

                def flush(self):
                    return ""
            return D()

    want = colibri_mlx.generate(model, Ids(), "5 9 5 9 5", max_tokens=12, draft="none")
    responses = list(colibri_mlx.stream_generate(model, Ids(), "5 9 5 9 5", max_tokens=12, draft="ngram",
                                                 num_draft=2))
    assert "".join(r.text for r in responses) == want
    assert responses[-1].draft_stats["draft_steps"] > 0


def test_serve_request_draft_fields(models):
    from colibri_mlx.serve import RequestError, SamplingDefaults, parse_sampling

    # The request's fields go to the engine's submit(); without them the engine uses the server's
    # defaults, which it was built with.
    extras = parse_sampling({"draft": "ngram", "num_draft": 5}, SamplingDefaults(), 4096)[-1]
    assert extras == {"draft": "ngram", "num_draft": 5}
    assert parse_sampling({}, SamplingDefaults(draft="none"), 4096)[-1] == {}
    with pytest.raises(RequestError, match="'draft' must be one of"):
        parse_sampling({"draft": "medusa"}, SamplingDefaults(), 4096)
    with pytest.raises(RequestError, match="'num_draft' must be an integer in 1..7"):
        parse_sampling({"num_draft": 0}, SamplingDefaults(), 4096)


# ----------------------------------------------------------------------------- kernels (MSL simulator)


REPEATS = [109, 4, 5, 9, 5, 9, 5]   # glm: ngram drafts from the repeats, one kept and one rejected in 8 tokens
KERNEL_CASES = [
    pytest.param("glm", "mtp", PROMPTS[2], 9, id="glm-mtp"),
    pytest.param("glm", "ngram", REPEATS, 8, id="glm-ngram"),
    pytest.param("v3", "mtp", PROMPTS[2], 9, marks=pytest.mark.slow, id="v3-mtp"),
    pytest.param("v3", "ngram", PROMPTS[1], 16, marks=pytest.mark.slow, id="v3-ngram"),
    pytest.param("glm", "mtp", PROMPTS[3], 20, marks=pytest.mark.slow, id="glm-mtp-long"),   # DSA selection
    pytest.param("glm", "ngram", REPEATS, 16, marks=pytest.mark.slow, id="glm-ngram-long"),
]


@pytest.mark.msl
@pytest.mark.parametrize("name, draft, prompt, n", KERNEL_CASES)
def test_greedy_identity_with_kernels_in_simulator(models, oracle_drafts, monkeypatch, name, draft, prompt, n):
    """Every hot-path launch in the MSL simulator, as on a Mac: the verify steps (multi-row
    qgemv, moe_block, mla_decode) keep greedy output identical to single-row decoding. ``mtp``:
    the MTP layer runs on the kernels, its drafts the oracle's (kept and rejected); ``ngram``:
    the drafts prompt lookup finds in the repeats, some kept and some rejected."""
    from moe_mla_oracle import route_launches_to_simulator, simulator_or_skip

    simulator = simulator_or_skip()
    model = models[name]
    launched = route_launches_to_simulator(monkeypatch, simulator)
    want = tokens_of(model, prompt, n, draft="none")
    if draft == "mtp":
        oracle_drafts(prompt, want, seed=2)
    got = run(model, prompt, n, draft=draft, num_draft=3)
    assert [t for t, _ in got] == want
    stats = got[-1][1]
    assert 0 < stats["draft_accepted"] < stats["draft_proposed"], stats   # drafts kept and rejected
    assert {"qgemv", "moe_gate_up"} <= set(launched), set(launched)


@pytest.mark.parametrize("name", ["v3", "glm"])
def test_batch_engine_greedy_identity(models, oracle_drafts, monkeypatch, name):
    """The batching engine's verify steps on models with an MTP layer, the DSA one included
    (one cache per sequence, its indexer keys rolled back, past index_topk): MTP drafts (the
    oracle's for the first request: kept and rejected at every depth), n-gram drafts and a plain
    request decode together, each with its tokens alone."""
    from colibri_mlx.batch_engine import BatchEngine

    model = models[name]
    asks = [(PROMPTS[3], 24, "mtp", 3), (PROMPTS[1], 20, "ngram", 2), (PROMPTS[2], 12, "none", 1)]
    want = [tokens_of(model, p, n, draft="none") for p, n, _, _ in asks]
    real_ngrams = speculative.NgramIndex.drafts
    oracle_drafts(asks[0][0], want[0], seed=7)       # the MTP request's drafts; n-gram drafts stay real
    monkeypatch.setattr(speculative.NgramIndex, "drafts", real_ngrams)
    engine = BatchEngine(model, None, stop_ids=())
    try:
        handles = engine.submit_all([dict(prompt_ids=p, max_tokens=n, draft=d, num_draft=k) for p, n, d, k in asks])
        got = [[e.token for e in h] for h in handles]
        stats = [h.stats for h in handles]
    finally:
        engine.shutdown()
    assert got == want
    assert 0 < stats[0]["draft_accepted"] < stats[0]["draft_proposed"], stats[0]
    assert stats[1]["draft_accepted"] > 0, stats[1]


@pytest.mark.msl
@pytest.mark.parametrize("name, verify", [("v3", "pooled verify"), ("glm", "rows verify")])
def test_batch_engine_speculation_with_kernels_in_simulator(models, monkeypatch, name, verify):
    """The batching engine's verify steps with every hot-path launch in the MSL simulator: a
    verify step of ragged rows (n-gram drafts from repeats, kept and rejected; MTP drafts of two
    requests from one step of the layer on the kernels; a plain request) keeps each request's greedy output its single-row
    output alone. v3 pools its caches; the DSA model (glm) verifies each sequence's rows over its
    own cache, past index_topk."""
    from moe_mla_oracle import route_launches_to_simulator, simulator_or_skip

    from colibri_mlx.batch_engine import BatchEngine

    simulator = simulator_or_skip()
    model = models[name]
    asks = [(PROMPTS[1], 10, "ngram"), (PROMPTS[2], 6, "mtp"), ([3, 1, 4, 1, 5], 5, "none"), (PROMPTS[0], 5, "mtp")]
    want = [tokens_of(model, p, n, draft="none") for p, n, _ in asks]
    launched = route_launches_to_simulator(monkeypatch, simulator)
    pooled = kernels.dispatch.counters()["calls"].get(f"batch_decode/{verify}", 0)
    mtp_rows = kernels.dispatch.counters()["calls"].get("batch_decode/mtp rows", 0)
    engine = BatchEngine(model, None, stop_ids=())
    try:
        handles = engine.submit_all([dict(prompt_ids=p, max_tokens=n, draft=d, num_draft=2) for p, n, d in asks])
        got = [[e.token for e in h] for h in handles]
        stats = dict(engine.stats)
    finally:
        engine.shutdown()
    assert got == want
    assert 0 < stats["draft_accepted"] < stats["draft_proposed"], stats
    assert kernels.dispatch.counters()["calls"].get(f"batch_decode/{verify}", 0) > pooled
    assert kernels.dispatch.counters()["calls"].get("batch_decode/mtp rows", 0) > mtp_rows   # the MTP requests' rows together
    assert {"qgemv", "moe_gate_up"} <= set(launched) and any(k.startswith("mla_attn") for k in launched), set(launched)


@pytest.mark.slow
def test_bench_script_runs_on_cpu(tmp_path):
    from test_scripts import run_script

    out = run_script("scripts/bench/bench_speculative.py", "--tiny", "--experts", "16", "--vocab", "4096", "--steps",
                     "3", "--gen-tokens", "12", "--repeats", "1", "--out", str(tmp_path / "spec.json"))
    assert "verify step of 1+3 rows" in out and "greedy identity with drafts: ok" in out, out
    report = json.loads((tmp_path / "spec.json").read_text())
    assert report["greedy_identity"]["ok"] and report["verify"]["ratio"] > 0


@pytest.mark.parametrize("engine", ["BatchEngine", "SerialEngine"])
def test_server_request_draft(tmp_path, engine):
    """A request's own draft, under the batching engine (the server's) and the serial one (a
    model over several processes)."""
    import threading

    import colibri_mlx
    from colibri_mlx import batch_engine, serve_engine
    from colibri_mlx.serve import ModelServer
    from test_serve import post

    engine_class = getattr(batch_engine, engine, None) or getattr(serve_engine, engine)
    replies = {}
    for name, config in (("mtp", MODELS["v3"]), ("plain", CONFIG)):
        model, tokenizer = colibri_mlx.load(write_tiny_container(tmp_path / name, config, seed=4), dtype="float32")
        srv = ModelServer(("127.0.0.1", 0), model, tokenizer, name, log=None, engine=engine_class(model, tokenizer))
        thread = threading.Thread(target=srv.serve_forever, daemon=True)
        thread.start()
        try:
            for draft in ("none", "ngram", "mtp"):
                replies[name, draft] = post(srv, "/v1/completions", {"prompt": "abab abab", "max_tokens": 10,
                                                                     "draft": draft, "num_draft": 2})
        finally:
            srv.shutdown()
            srv.server_close()
            thread.join(5)
    texts = {key: body["choices"][0]["text"] for key, (status, body) in replies.items() if status == 200}
    assert texts[("mtp", "ngram")] == texts[("mtp", "mtp")] == texts[("mtp", "none")]
    assert texts[("plain", "ngram")] == texts[("plain", "none")]
    status, body = replies["plain", "mtp"]
    assert status == 400 and "multi-token-prediction" in body["error"]["message"], body


def test_drafts_refused_under_several_ranks():
    """Rank 0 rewinds its cache on a rejected draft, outside the steps the other ranks mirror."""
    from colibri_mlx.distributed import DistributedModel
    from colibri_mlx.speculative import resolve_draft

    from types import SimpleNamespace

    for mtp_layers in ([], [object()]):      # the default is "none" there, MTP layer or not
        model = DistributedModel(SimpleNamespace(mtp_layers=mtp_layers), comm=None, load=None)
        for draft in ("ngram", "mtp"):
            with pytest.raises(ValueError, match="one process"):
                resolve_draft(model, draft)
        assert resolve_draft(model, None) == "none" and resolve_draft(model, "none") == "none"


@pytest.mark.msl
@pytest.mark.parametrize("L", [1, 3])
def test_mtp_step_graph_kernel_path_equals_reference(models, monkeypatch, L):
    """The MTP layer's compiled draft step (MTPHead._step: embedding gathered on the device,
    eh_proj, the layer's 1-row or verify-rows step, the head of the last row) with every launch
    in the MSL simulator equals the reference path's op-by-op call, cache rows included."""
    from moe_mla_oracle import route_launches_to_simulator, simulator_or_skip

    simulator = simulator_or_skip()
    model = models["v3"]
    head = mtp_head(model)
    D = model.args.hidden_size
    rng = np.random.default_rng(1)
    seen_h = mx.array(rng.standard_normal((1, 6, D)).astype(np.float32))
    h = mx.array(rng.standard_normal((1, L, D)).astype(np.float32))
    tokens = mx.array([[7, 8, 9][:L]], dtype=mx.int32)

    def draft_step(kernel_graph):
        cache = head.make_cache()
        head(seen_h, mx.array([[1, 2, 3, 4, 5, 6]]), cache)
        if not kernel_graph:
            logits, x = head(h, tokens, cache, last_only=True)
            return logits, x, cache.layers[0].buffers["kv"][:, :6 + L]
        kv, params = head.layer.layer.self_attn.step_inputs(h, cache.layers[0], 6)
        slots = mx.array(6, dtype=mx.int32) if L == 1 else mx.arange(6, 6 + L, dtype=mx.int32)
        logits, x, kv = head._step(h, tokens, slots, kv, params)
        return logits, x, kv[:, :6 + L]

    want = [np.array(a) for a in draft_step(False)]
    launched = route_launches_to_simulator(monkeypatch, simulator)
    got = [np.array(a) for a in draft_step(True)]
    assert {"qgemv", "mla_rows_into", "mla_qb_qabs", "moe_gate_up"} <= set(launched), launched
    assert got[0].shape == want[0].shape == (1, 1, model.args.vocab_size)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-4 * np.abs(w).max())
    assert (got[0].argmax(-1) == want[0].argmax(-1)).all()


def test_draft_length_follows_acceptance():
    """MTP drafts per step: one fewer after a rejection (not below 1), one more after a step
    that kept every draft (not above num_draft); fixed for n-gram drafts."""
    length = speculative.DraftLength(3)
    seen = []
    for proposed, kept in [(3, 1), (2, 0), (1, 0), (1, 1), (2, 2), (3, 3), (3, 3), (3, 2)]:
        assert length.k == proposed
        length.update(proposed, kept)
        seen.append(length.k)
    assert seen == [2, 1, 1, 2, 3, 3, 3, 2]
    fixed = speculative.DraftLength(3, adaptive=False)
    fixed.update(3, 0)
    assert fixed.k == 3


def test_greedy_identity_adaptive_draft_length(models):
    model = models["v3"]
    for prompt in PROMPTS[:3]:
        assert tokens_of(model, prompt, 14, draft="mtp", num_draft=4) == tokens_of(model, prompt, 14, draft="none")


def test_greedy_identity_with_steps_handed_over_early(models, monkeypatch):
    """As on a GPU: each decode layer and each MTP step handed to the device as soon as it is
    built (mx.async_eval, deepseek_v3.commits_layers, here forced on the CPU): the same tokens."""
    from colibri_mlx.models import deepseek_v3

    model = models["v3"]
    prompt = PROMPTS[1]
    want = tokens_of(model, prompt, 12, draft="none")
    submitted = []
    real = mx.async_eval
    monkeypatch.setattr(deepseek_v3, "commits_layers", lambda L: L <= deepseek_v3.DECODE_ROWS)
    monkeypatch.setattr(mx, "async_eval", lambda *a: submitted.append(len(a)) or real(*a))
    assert tokens_of(model, prompt, 12, draft="mtp", num_draft=3) == want
    assert submitted
