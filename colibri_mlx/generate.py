"""Text generation: sampling, ``generate_tokens`` (ids in, ids out), ``stream_generate`` and
``generate`` (text in, text out).

Sampling order (the usual one, as in transformers' logits processors): repetition penalty on the
raw logits, then temperature, top-k, top-p (nucleus), min-p, then a categorical draw from an
explicit ``mx.random`` key (``seed``) so that a run is reproducible. ``temperature == 0`` is greedy.

The prompt is used as given, as in mlx-lm: a string is encoded as is (the tokenizer's own special
tokens, such as a leading BOS, are added; the chat template is not applied), a list of ints is
fed as token ids. For a chat model, pass ``tokenizer.encode_chat(messages)`` (or the text of
``tokenizer.apply_chat_template(messages)``); the ``colibri generate`` command applies the
template by default.
"""

from __future__ import annotations

import functools
import math
import sys
import time
import types
from dataclasses import dataclass
from typing import Callable, Iterator, Optional, Sequence, Union

DRAFT_STATS = ("draft_steps", "draft_proposed", "draft_accepted")
SEED_MODULUS = 1 << 64  # mx.random.key takes 64 bits; larger and negative seeds are reduced mod 2**64

import mlx.core as mx

from . import ARGS_DOC


def peak_rss_bytes() -> int:
    """The process's peak resident set size (``ru_maxrss`` is KiB on Linux, bytes on macOS)."""
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak if sys.platform == "darwin" else peak * 1024


@dataclass
class GenerationResponse:
    """One generated token: its text delta and id, plus running statistics.

    Attributes:
        text: the text this token adds (may be "" while a multi-byte character is incomplete;
            the held-back text comes with a later token).
        token: the token id.
        prompt_tokens, prompt_tps: prompt length and prompt processing speed (tokens/s).
        generation_tokens, generation_tps: tokens generated so far and their speed (tokens/s).
        peak_memory_gb: MLX's peak memory so far (GB, 1e9 bytes).
        finish_reason: None while generating; on the last token "stop" (an end-of-sequence
            token: its text is not included) or "length" (``max_tokens`` reached, or the
            model's context limit, ``max_position_embeddings``: then ``generation_tokens <
            max_tokens``).
        expert_stats: with streamed experts only, ``ExpertStore.report()`` (docs/streaming.md).
    """

    text: str
    token: int
    prompt_tokens: int
    prompt_tps: float
    generation_tokens: int
    generation_tps: float
    peak_memory_gb: float
    finish_reason: Optional[str] = None  # "stop" (end-of-sequence token), "length", or None
    expert_stats: Optional[dict] = None  # streamed experts only: ExpertStore.report() (docs/streaming.md)
    draft_stats: Optional[dict] = None  # speculation only: draft_steps, draft_proposed, draft_accepted


def _number(name: str, value) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise ValueError(f"{name} must be a number, got {value!r}")
    if not math.isfinite(value):
        raise ValueError(f"{name} must be a finite number, got {value}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """How the next token is drawn; every value is checked when the object is made.

    ``temperature`` >= 0 (0 = greedy), ``top_p`` in (0, 1] (1 = off), ``top_k`` >= 0 (0 = off),
    ``min_p`` in [0, 1] (0 = off), ``repetition_penalty`` > 0 (1 = off). ``presence_penalty`` and
    ``frequency_penalty`` in [-2, 2] (0 = off; OpenAI's rule: a token's logit minus
    ``frequency_penalty * count + presence_penalty * (count > 0)``, counted over the generated
    tokens) and ``logit_bias`` (``((token id, bias in [-100, 100]), ...)`` added to the logits)
    come before the repetition penalty. Errors are ValueErrors whose message starts with the
    parameter's name.
    """

    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    logit_bias: Optional[tuple] = None

    def __post_init__(self):
        if _number("temperature", self.temperature) < 0:
            raise ValueError(f"temperature must be >= 0, got {self.temperature}")
        if not 0 < _number("top_p", self.top_p) <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")
        if isinstance(self.top_k, bool) or not isinstance(self.top_k, int):
            raise ValueError(f"top_k must be an integer, got {self.top_k!r}")
        if self.top_k < 0:
            raise ValueError(f"top_k must be >= 0, got {self.top_k}")
        if not 0 <= _number("min_p", self.min_p) <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {self.min_p}")
        if _number("repetition_penalty", self.repetition_penalty) <= 0:
            raise ValueError(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            if not -2 <= _number(name, getattr(self, name)) <= 2:
                raise ValueError(f"{name} must be in [-2, 2], got {getattr(self, name)}")
        for pair in self.logit_bias or ():
            if (not isinstance(pair, tuple) or len(pair) != 2 or isinstance(pair[0], bool)
                    or not isinstance(pair[0], int) or pair[0] < 0
                    or not -100 <= _number("logit_bias", pair[1]) <= 100):
                raise ValueError(f"logit_bias must be (token id >= 0, bias in [-100, 100]) pairs, got {pair!r}")

    @property
    def counts_tokens(self) -> bool:
        """Whether a step needs the previous tokens' values (no pipelining)."""
        return self.repetition_penalty != 1.0 or self.presence_penalty != 0.0 or self.frequency_penalty != 0.0


def needs_plain_decoding(params: SamplingParams, logprobs: bool = False) -> bool:
    """Whether a request needs plain decoding: speculation applies the repetition penalty itself,
    not logprobs, ``logit_bias`` or the presence/frequency penalties."""
    return bool(logprobs or params.presence_penalty != 0.0 or params.frequency_penalty != 0.0 or params.logit_bias)


def apply_openai_penalties(logits: mx.array, generated: Sequence[int], params: SamplingParams) -> mx.array:
    """``logit_bias`` added, then OpenAI's presence and frequency penalties over ``generated``."""
    if params.logit_bias:
        ids, bias = _logit_bias_arrays(params.logit_bias, logits.dtype)
        logits = logits.at[ids].add(bias)
    if generated and (params.presence_penalty or params.frequency_penalty):
        counts: dict[int, int] = {}
        for t in generated:
            counts[t] = counts.get(t, 0) + 1
        ids = mx.array(list(counts), dtype=mx.int32)
        n = mx.array(list(counts.values()), dtype=logits.dtype)
        logits = logits.at[ids].subtract(n * params.frequency_penalty + params.presence_penalty)
    return logits


@functools.lru_cache(maxsize=256)
def _logit_bias_arrays(logit_bias: tuple, dtype) -> tuple[mx.array, mx.array]:
    """``logit_bias`` as ``(token ids, biases)`` arrays: made once per request, not per token."""
    return (mx.array([t for t, _ in logit_bias], dtype=mx.int32),
            mx.array([b for _, b in logit_bias], dtype=dtype))


def adjust_logits(logits: mx.array, params: SamplingParams, seen: Sequence[int], generated_from: int) -> mx.array:
    """The logits ``[V]`` the sampler sees: ``logit_bias`` and the presence/frequency penalties
    over the generated tokens (``seen[generated_from:]``), then the repetition penalty over all of
    ``seen``. Shared by ``generate_tokens`` and the batching engine, so both draw from the same values."""
    if params.logit_bias or params.presence_penalty or params.frequency_penalty:
        logits = apply_openai_penalties(logits, seen[generated_from:], params)
    if params.repetition_penalty != 1.0:
        logits = apply_repetition_penalty(logits, seen, params.repetition_penalty)
    return logits


def log_softmax32(logits: mx.array) -> mx.array:
    """The log-probabilities reported for ``logits``, in float32 whatever the model's dtype."""
    wide = logits.astype(mx.float32)
    return wide - mx.logsumexp(wide, axis=-1, keepdims=True)


def reduce_seed(seed: Optional[int]) -> Optional[int]:
    """``seed`` as the 64-bit key ``mx.random.key`` takes: any Python integer is accepted,
    reduced modulo 2**64 (so 0 .. 2**64 - 1 are used as they are, -1 is 2**64 - 1)."""
    if seed is None:
        return None
    if isinstance(seed, bool) or not isinstance(seed, int):
        try:
            import numpy as np

            if isinstance(seed, np.integer):
                return int(seed) % SEED_MODULUS
        except ImportError:  # pragma: no cover
            pass
        raise ValueError(f"seed must be an integer, got {seed!r}")
    return seed % SEED_MODULUS


def apply_repetition_penalty(logits: mx.array, seen: Sequence[int], penalty: float) -> mx.array:
    """transformers' rule: a seen token's logit is divided by ``penalty`` if positive, else multiplied."""
    if penalty == 1.0 or not seen:
        return logits
    ids = mx.array(sorted(set(int(t) for t in seen)), dtype=mx.int32)
    picked = logits[ids]
    logits[ids] = mx.where(picked > 0, picked / penalty, picked * penalty)
    return logits


def filter_logits(logits: mx.array, p: SamplingParams) -> mx.array:
    """Temperature-scaled logits ``[V]`` with the tokens outside top-k / top-p / min-p at -inf."""
    logits = logits / p.temperature
    if 0 < p.top_k < logits.shape[-1]:
        kth = mx.sort(logits)[-p.top_k]
        logits = mx.where(logits >= kth, logits, -mx.inf)
    if p.top_p < 1.0:
        order = mx.argsort(-logits)
        probs = mx.softmax(logits[order], precise=True)
        # Keep the smallest prefix whose mass reaches top_p (the token crossing it included).
        mass_before = mx.cumsum(probs) - probs
        keep_sorted = mass_before < p.top_p
        keep = mx.zeros(logits.shape, mx.bool_)
        keep[order] = keep_sorted
        logits = mx.where(keep, logits, -mx.inf)
    if p.min_p > 0.0:
        probs = mx.softmax(logits, precise=True)
        logits = mx.where(probs >= p.min_p * probs.max(), logits, -mx.inf)
    return logits


def make_sampler(params: SamplingParams, seed: Optional[int] = None) -> Callable[[mx.array], mx.array]:
    """``logits -> token`` as a lazy scalar ``mx.array`` (so the next step can be built before it is read)."""
    if params.temperature == 0:
        return lambda logits: mx.argmax(logits)
    seed = reduce_seed(seed)
    key = mx.random.key(seed if seed is not None else time.time_ns() % (1 << 63))

    def sample(logits):
        nonlocal key
        key, sub = mx.random.split(key)
        return mx.random.categorical(filter_logits(logits, params), key=sub)

    return sample


def generate_tokens(model, prompt_ids: Sequence[int], max_tokens: int, params: SamplingParams = SamplingParams(),
                    seed: Optional[int] = None, cache=None, stop_ids: Sequence[int] = (),
                    pipelined: Optional[bool] = None, draft: Optional[str] = None,
                    num_draft: int = 3, logprobs: bool = False) -> Iterator[tuple[int, dict]]:
    """Yield ``(token, stats)`` per generated token; ``stats`` has prompt/generation timing.

    ``cache`` continues a conversation: ``prompt_ids`` are the new tokens only. Generation ends
    at a stop id (yielded, ``finish_reason="stop"``), at ``max_tokens`` or at the context limit.
    When the generation ends, the cache holds the prompt and every generated token but the last.

    ``pipelined`` (default: on unless a repetition penalty needs each token's value first) builds
    step n+1's graph and queues it while step n still runs on the device, as mlx-lm does, so
    Python graph building overlaps the GPU. The tokens are the same either way; a step fed with a
    stop token is taken back out of the cache.

    ``logprobs``: ``stats["logprobs"]`` is the ``[V]`` log-softmax of the logits the sampler saw
    (after ``logit_bias`` and the penalties, before temperature and the top-k/top-p/min-p filters).

    ``draft`` ("mtp", "ngram", "none"; default :func:`speculative.resolve_draft`) and
    ``num_draft`` (tokens drafted per step) turn on speculative decoding (docs/speculative.md):
    the same tokens when greedy, the same distribution when sampling; ``stats`` then has
    ``draft_steps``, ``draft_proposed`` and ``draft_accepted``.
    """
    prompt_ids = [int(t) for t in prompt_ids]
    if not prompt_ids:
        raise ValueError("empty prompt")
    vocab = getattr(getattr(model, "args", None), "vocab_size", None)
    if vocab is not None and not all(0 <= t < vocab for t in prompt_ids):
        bad = next(t for t in prompt_ids if not 0 <= t < vocab)
        raise ValueError(f"prompt token id {bad} is outside the model's vocabulary (vocab_size={vocab} in "
                         "config.json): the tokenizer does not belong to this model?")
    cache = model.make_cache() if cache is None else cache
    limit = model.max_length
    if cache.offset + len(prompt_ids) > limit:
        raise ValueError(f"prompt of {len(prompt_ids)} tokens (+{cache.offset} in the cache) exceeds the "
                         f"context limit of {limit} tokens")
    penalty = params.counts_tokens
    pipelined = not penalty if pipelined is None else pipelined
    if pipelined and penalty:
        raise ValueError("pipelined generation cannot apply a repetition penalty or a presence/frequency penalty "
                         "(it needs each token first)")
    from .speculative import check_num_draft, resolve_draft, speculative_tokens

    per_token = needs_plain_decoding(params, logprobs)
    if per_token and draft not in (None, "none"):
        raise ValueError("logprobs, logit_bias and the presence/frequency penalties need draft='none'")
    draft = "none" if per_token else resolve_draft(model, draft, seeded_sampling=params.temperature > 0
                                                    and seed is not None)
    if draft != "none":
        yield from speculative_tokens(model, prompt_ids, max_tokens, params, seed, cache, stop_ids, draft,
                                      check_num_draft(num_draft))
        return
    sampler = make_sampler(params, seed)
    stop = set(int(s) for s in stop_ids)
    seen = list(prompt_ids)
    lp = None   # the log-probabilities of the token being drawn (logprobs=True)

    def next_token(logits):
        nonlocal lp
        logits = adjust_logits(logits, params, seen, len(prompt_ids))
        if logprobs:  # the sampler gets the logits as they are (the same draws as without)
            lp = log_softmax32(logits)
        return sampler(logits)

    t0 = time.perf_counter()
    logits = model(mx.array([prompt_ids]), cache)[0, -1]
    mx.eval(logits)
    stats = {"prompt_tokens": len(prompt_ids), "prompt_time": time.perf_counter() - t0}
    t1 = time.perf_counter()
    token_arr = next_token(logits)
    for n in range(1, max_tokens + 1):
        continues = n < max_tokens and cache.offset < limit    # known before the token's value
        fed_ahead = pipelined and continues
        token_lp = lp
        if fed_ahead:   # step n+1 is built and queued before token n is read
            following = next_token(model(token_arr.reshape(1, 1), cache)[0, -1])
            mx.async_eval(following)
        token = int(token_arr.item())
        if logprobs:
            stats["logprobs"] = token_lp
        seen.append(token)
        stats["generation_tokens"], stats["generation_time"] = n, time.perf_counter() - t1
        if token in stop:
            stats["finish_reason"] = "stop"
            if fed_ahead:
                cache.offset -= 1   # the stop token was fed ahead: take it back out
        elif not continues:
            stats["finish_reason"] = "length"
        else:
            stats["finish_reason"] = None
        yield token, dict(stats)
        if stats["finish_reason"] is not None:
            return
        if fed_ahead:
            token_arr = following
        else:
            token_arr = next_token(model(mx.array([[token]]), cache)[0, -1])


def _prompt_ids(tokenizer, prompt: Union[str, Sequence[int]]) -> list[int]:
    if isinstance(prompt, str):
        return tokenizer.encode(prompt)
    if isinstance(prompt, (bytes, bytearray)):
        raise ValueError("prompt must be a str or a sequence of token ids, got bytes (decode it first)")
    try:
        return [_token_id(t) for t in prompt]
    except TypeError:
        raise ValueError(f"prompt must be a str or a sequence of token ids, got {type(prompt).__name__}") from None


def _token_id(t) -> int:
    if isinstance(t, bool) or not hasattr(t, "__index__"):
        raise ValueError(f"prompt token ids must be integers, got {t!r}")
    return int(t)


def _stop_ids(model, tokenizer) -> set[int]:
    return set(getattr(tokenizer, "eos_token_ids", None) or ()) | set(model.args.eos_token_id)




def stream_generate(model, tokenizer, prompt: Union[str, Sequence[int]], max_tokens: int = 256,
                    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                    repetition_penalty: float = 1.0, seed: Optional[int] = None,
                    cache=None, draft: Optional[str] = None, num_draft: int = 3) -> Iterator[GenerationResponse]:
    """Generate text for ``prompt``, one :class:`GenerationResponse` per token as it is made.

    Join the ``text`` of the responses for the reply; the last response has ``finish_reason``
    set and the final statistics.
    """
    params = SamplingParams(temperature, top_p, top_k, min_p, repetition_penalty)
    if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or max_tokens < 1:
        raise ValueError(f"max_tokens must be an integer >= 1, got {max_tokens!r}")
    detok = tokenizer.detokenizer()
    store = getattr(model, "expert_store", None)
    for token, s in generate_tokens(model, _prompt_ids(tokenizer, prompt), max_tokens, params, seed, cache,
                                    _stop_ids(model, tokenizer), draft=draft, num_draft=num_draft):
        finished = s["finish_reason"] is not None
        if s["finish_reason"] == "stop":
            text = detok.flush()
        else:
            text = detok.add(token)
            if finished:
                text += detok.flush()
        yield GenerationResponse(
            text=text, token=token, prompt_tokens=s["prompt_tokens"],
            prompt_tps=s["prompt_tokens"] / max(s["prompt_time"], 1e-9),
            generation_tokens=s["generation_tokens"],
            generation_tps=s["generation_tokens"] / max(s["generation_time"], 1e-9),
            peak_memory_gb=mx.get_peak_memory() / 1e9, finish_reason=s["finish_reason"],
            expert_stats=store.report() if store is not None else None,
            draft_stats={k: s[k] for k in DRAFT_STATS} if "draft_steps" in s else None)
        if finished and store is not None:
            store.save_usage()  # upstream rewrites .coli_usage after every turn


def generate(model, tokenizer, prompt: Union[str, Sequence[int]], max_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
             seed: Optional[int] = None, cache=None, draft: Optional[str] = None, num_draft: int = 3) -> str:
    """Generate text for ``prompt`` and return it (the end-of-sequence token not included).

    ``colibri_mlx.generate(model, tokenizer, "Hello")`` continues the text "Hello"; it does not
    apply the chat template (use :func:`stream_generate` for the tokens as they come and the
    statistics).
    """
    return "".join(r.text for r in stream_generate(model, tokenizer, prompt, max_tokens, temperature, top_p, top_k,
                                                   min_p, repetition_penalty, seed, cache, draft, num_draft))


if stream_generate.__doc__ and generate.__doc__:  # python -OO drops docstrings
    stream_generate.__doc__ = stream_generate.__doc__.rstrip() + "\n\n" + ARGS_DOC
    generate.__doc__ = generate.__doc__.rstrip() + "\n\n" + ARGS_DOC


class _CallableModule(types.ModuleType):
    """``colibri_mlx.generate(...)`` must work after ``import colibri_mlx.generate`` too: importing
    the submodule rebinds the package attribute from the lazy function to this module."""

    def __call__(self, *args, **kwargs):
        return generate(*args, **kwargs)


sys.modules[__name__].__class__ = _CallableModule
