"""colibri_mlx.load / generate / stream_generate and sampling, against transformers where it has
an equivalent (greedy generation, chat template, repetition penalty) and numpy otherwise."""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from helpers_models import build_config_model, save_checkpoint

import colibri_mlx
from colibri_mlx.generate import SamplingParams, apply_repetition_penalty, filter_logits, generate_tokens


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    hf = build_config_model("glm_shared_yarn", seed=3)
    path = save_checkpoint(hf, str(tmp_path_factory.mktemp("glm")))
    model, tokenizer = colibri_mlx.load(path, dtype="float32")
    return hf, path, model, tokenizer


def test_load_returns_model_and_tokenizer(checkpoint):
    _, _, model, tokenizer = checkpoint
    assert model.args.model_type == "glm_moe_dsa"
    assert tokenizer.encode("hi", add_special_tokens=False) == [ord("h"), ord("i")]


def test_chat_template_matches_transformers(checkpoint):
    from transformers import AutoTokenizer

    _, path, _, tokenizer = checkpoint
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "héllo"}]
    ref = AutoTokenizer.from_pretrained(path).apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    ref = ref["input_ids"] if isinstance(ref, dict) or hasattr(ref, "keys") else ref
    assert tokenizer.encode_chat(messages) == list(ref)


def test_greedy_generate_matches_transformers_text(checkpoint):
    import torch

    hf, _, model, tokenizer = checkpoint
    prompt = "The quick brown fox jumps over"  # 30 tokens: DSA (index_topk 8) active
    ids = tokenizer.encode(prompt)
    with torch.no_grad():
        ref = hf.generate(torch.tensor([ids]), max_new_tokens=20, min_new_tokens=20, do_sample=False,
                          pad_token_id=0)[0, len(ids):].tolist()
    text = colibri_mlx.generate(model, tokenizer, prompt, max_tokens=20)
    assert text == tokenizer.decode(ref)


def test_stream_generate_yields_one_response_per_token(checkpoint):
    _, _, model, tokenizer = checkpoint
    responses = list(colibri_mlx.stream_generate(model, tokenizer, "abc", max_tokens=12))
    assert len(responses) == 12
    assert [r.generation_tokens for r in responses] == list(range(1, 13))
    assert "".join(r.text for r in responses) == tokenizer.decode([r.token for r in responses])
    last = responses[-1]
    assert last.finish_reason == "length" and all(r.finish_reason is None for r in responses[:-1])
    assert last.prompt_tokens == 3 and last.prompt_tps > 0 and last.generation_tps > 0


def test_sampling_is_reproducible_with_seed(checkpoint):
    _, _, model, tokenizer = checkpoint
    kw = dict(max_tokens=10, temperature=1.5, top_p=0.95)
    a = colibri_mlx.generate(model, tokenizer, "xyz", seed=1, **kw)
    assert a == colibri_mlx.generate(model, tokenizer, "xyz", seed=1, **kw)
    others = {colibri_mlx.generate(model, tokenizer, "xyz", seed=s, **kw) for s in (2, 3, 4)}
    assert others != {a}


def test_degenerate_filters_equal_greedy(checkpoint):
    _, _, model, tokenizer = checkpoint
    greedy = colibri_mlx.generate(model, tokenizer, "q", max_tokens=8)
    assert colibri_mlx.generate(model, tokenizer, "q", max_tokens=8, temperature=2.0, top_k=1, seed=0) == greedy
    assert colibri_mlx.generate(model, tokenizer, "q", max_tokens=8, temperature=2.0, min_p=1.0, seed=0) == greedy


def test_stop_token_ends_generation(checkpoint):
    _, _, model, _ = checkpoint
    free = [t for t, _ in generate_tokens(model, [1, 2, 3], 8)]
    stopped = list(generate_tokens(model, [1, 2, 3], 8, stop_ids=[free[3]]))
    first = free.index(free[3])
    assert [t for t, _ in stopped] == free[:first + 1]
    assert stopped[-1][1]["finish_reason"] == "stop"


def test_cache_continues_a_conversation(checkpoint):
    _, _, model, _ = checkpoint
    cache = model.make_cache()
    turn1 = [t for t, _ in generate_tokens(model, [10, 11, 12], 5, cache=cache)]
    # The last generated token is not in the cache yet: the next turn feeds it first.
    turn2 = [t for t, _ in generate_tokens(model, [turn1[-1], 40, 41], 5, cache=cache)]
    whole = [t for t, _ in generate_tokens(model, [10, 11, 12] + turn1 + [40, 41], 5)]
    assert turn2 == whole


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=1.3, top_k=20)])
def test_pipelined_generation_equals_step_by_step(checkpoint, params):
    """Building step n+1 before token n is read changes nothing: same tokens, same cache state
    (also after a stop token, which the pipelined loop feeds ahead and then takes back out)."""
    _, _, model, _ = checkpoint
    runs = {}
    for pipelined in (False, True):
        cache = model.make_cache()
        toks = [t for t, _ in generate_tokens(model, [5, 6, 7], 12, params, seed=3, cache=cache, pipelined=pipelined)]
        stop_cache = model.make_cache()
        stopped = list(generate_tokens(model, [5, 6, 7], 12, params, seed=3, cache=stop_cache,
                                       stop_ids=[toks[4]], pipelined=pipelined))
        nxt = [t for t, _ in generate_tokens(model, [stopped[-1][0], 9], 4, cache=stop_cache, pipelined=False)]
        runs[pipelined] = (toks, cache.offset, [t for t, _ in stopped], stop_cache.offset, nxt)
    assert runs[True] == runs[False]
    toks, offset, stopped, stop_offset, _ = runs[True]
    assert offset == 3 + 12 - 1 and stopped[-1] == toks[4]
    # prompt + generated but the last, then the next turn: 2 fed + 4 generated but the last
    assert stop_offset == (3 + len(stopped) - 1) + (2 + 4 - 1)


def test_pipelined_generation_refuses_a_repetition_penalty(checkpoint):
    _, _, model, _ = checkpoint
    with pytest.raises(ValueError, match="repetition penalty"):
        next(generate_tokens(model, [1, 2], 3, SamplingParams(repetition_penalty=1.2), pipelined=True))
    # the default chooses the step-by-step loop then
    assert len(list(generate_tokens(model, [1, 2], 3, SamplingParams(repetition_penalty=1.2)))) == 3


def test_filter_logits_against_numpy():
    rng = np.random.default_rng(0)
    logits = rng.standard_normal(50).astype(np.float32) * 3
    p = SamplingParams(temperature=0.7, top_k=20, top_p=0.8, min_p=0.05)
    got = np.array(filter_logits(mx.array(logits), p))
    x = logits / 0.7
    x = np.where(x >= np.sort(x)[-20], x, -np.inf)
    order = np.argsort(-x)
    probs = np.exp(x[order] - x[order][0])
    probs /= probs.sum()
    keep = np.zeros(50, bool)
    keep[order] = (np.cumsum(probs) - probs) < 0.8
    x = np.where(keep, x, -np.inf)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    x = np.where(probs >= 0.05 * probs.max(), x, -np.inf)
    np.testing.assert_array_equal(np.isfinite(got), np.isfinite(x))
    np.testing.assert_allclose(got[np.isfinite(got)], x[np.isfinite(x)], rtol=1e-6)
    assert 1 < np.isfinite(got).sum() < 20


def test_repetition_penalty_matches_transformers():
    import torch
    from transformers import RepetitionPenaltyLogitsProcessor

    logits = np.random.default_rng(1).standard_normal(30).astype(np.float32)
    seen = [3, 7, 7, 12, 29]
    ref = RepetitionPenaltyLogitsProcessor(1.3)(torch.tensor([seen]), torch.tensor(logits[None]))[0].numpy()
    got = np.array(apply_repetition_penalty(mx.array(logits), seen, 1.3))
    np.testing.assert_allclose(got, ref, rtol=1e-6)
    assert not np.allclose(got, logits)


def test_bad_sampling_arguments():
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(top_p=0.0)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)


def test_prompt_longer_than_context_is_refused(checkpoint):
    _, _, model, _ = checkpoint
    with pytest.raises(ValueError, match="exceeds the context limit of 512"):
        next(generate_tokens(model, [1] * 513, 4))


def test_load_without_tokenizer_or_model(checkpoint, tmp_path):
    import shutil

    _, path, _, _ = checkpoint
    dst = tmp_path / "no_tok"
    shutil.copytree(path, dst)
    (dst / "tokenizer.json").unlink()
    with pytest.raises(ValueError, match="no tokenizer.json"):
        colibri_mlx.load(dst)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        colibri_mlx.load(tmp_path / "missing")
