"""colibri_mlx: DeepSeek-V3 / Kimi-K2 / GLM-5.x mixture-of-experts inference on MLX,
straight from colibri's quantized containers.

    import colibri_mlx
    model, tokenizer = colibri_mlx.load("path/to/container")    # None: the bundled demo model
    text = colibri_mlx.generate(model, tokenizer, "Once upon a time", max_tokens=64)
    ids = tokenizer.encode_chat([{"role": "user", "content": "Hello"}])   # a chat model's prompt
    for response in colibri_mlx.stream_generate(model, tokenizer, ids, max_tokens=64):
        print(response.text, end="", flush=True)

As in mlx-lm, ``generate`` and ``stream_generate`` use the prompt as given: a string is encoded
as is (no chat template), a list of ints is fed as token ids. The ``colibri generate`` command
applies the chat template by default (``--no-chat-template`` feeds the prompt as is).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, Optional, Sequence, Union

if TYPE_CHECKING:  # the real imports are lazy: `import colibri_mlx` does not load MLX
    from .generate import GenerationResponse
    from .models import Model
    from .tokenizer import Tokenizer

__version__ = "0.1.0"


def load(path=None, **options) -> tuple[Model, Tokenizer]:
    """Load a container, Hugging Face or mlx-lm checkpoint directory, or a GGUF file (or a
    directory of split GGUF files: docs/gguf.md) -> ``(model, tokenizer)``.

    ``path=None`` loads the bundled demo model. Options: ``dtype`` ("auto", "float32",
    "bfloat16", "float16"), expert streaming (``ram_gb``, ``pin``, ``pin_gb``, ``expert_top_p``
    and store options: docs/streaming.md).

    Everything that can be checked without reading weights is checked first (config.json
    against the model's schema, every shard's header, the tokenizer files and chat template):
    a bad directory raises within a second, a ValueError (or FileNotFoundError) whose message
    names the file and the key or tensor at fault.
    """
    from .models import load as _load

    return _load(path, **options)


def generate(model, tokenizer, prompt: Union[str, Sequence[int]], max_tokens: int = 256, temperature: float = 0.0,
             top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0, repetition_penalty: float = 1.0,
             seed: Optional[int] = None, cache=None, draft: Optional[str] = None, num_draft: int = 3) -> str:
    """Generate text for ``prompt`` and return it (the end-of-sequence token not included).

    Returns:
        The generated text. :func:`stream_generate` gives it token by token, with statistics
        and the reason generation stopped.

    """
    from .generate import generate as _generate

    return _generate(model, tokenizer, prompt, max_tokens, temperature, top_p, top_k, min_p, repetition_penalty,
                     seed, cache, draft, num_draft)


def stream_generate(model, tokenizer, prompt: Union[str, Sequence[int]], max_tokens: int = 256,
                    temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, min_p: float = 0.0,
                    repetition_penalty: float = 1.0, seed: Optional[int] = None, cache=None,
                    draft: Optional[str] = None, num_draft: int = 3) -> Iterator[GenerationResponse]:
    """Generate text for ``prompt``, yielding one ``GenerationResponse`` per token as it is made.

    Each response has ``text`` (the text this token adds; join them for the reply), ``token``
    (its id), ``prompt_tokens``, ``prompt_tps``, ``generation_tokens``, ``generation_tps``,
    ``peak_memory_gb``, and ``finish_reason``: None until the last response, then "stop" (an
    end-of-sequence token, whose text is not included) or "length" (``max_tokens`` reached, or
    the context limit: then ``generation_tokens < max_tokens``). With streamed experts,
    ``expert_stats`` (docs/streaming.md). With speculative decoding, ``draft_stats``
    (docs/speculative.md).

    """
    from .generate import stream_generate as _stream_generate

    return _stream_generate(model, tokenizer, prompt, max_tokens, temperature, top_p, top_k, min_p,
                            repetition_penalty, seed, cache, draft, num_draft)


# The arguments of generate / stream_generate, here and in colibri_mlx.generate alike.
ARGS_DOC = """    Args:
        model: the model of ``colibri_mlx.load(path)``.
        tokenizer: its tokenizer (the second value ``load`` returns).
        prompt: a ``str``, encoded as is: the tokenizer adds its own special tokens (a leading
            BOS), the chat template is NOT applied (as mlx-lm's ``generate``; the ``colibri
            generate`` command applies it by default). For a chat model, pass
            ``tokenizer.encode_chat([{"role": "user", "content": text}])``. Or a list of token
            ids, fed as they are.
        max_tokens: most tokens to generate (>= 1). Generation also ends at an end-of-sequence
            token (``finish_reason == "stop"``) and at the model's context limit,
            ``model.max_length`` (``max_position_embeddings``; ``finish_reason == "length"`` with
            fewer than ``max_tokens`` tokens).
        temperature: 0 (default) is greedy; > 0 samples from the temperature-scaled softmax.
        top_p: nucleus sampling, keep the smallest set of tokens whose probability reaches it; 1 = off.
        top_k: keep the k most likely tokens; 0 = off.
        min_p: drop tokens less likely than this fraction of the most likely one; 0 = off.
        repetition_penalty: > 1 makes tokens already in the prompt or the reply less likely; 1 = off.
        seed: makes sampling reproducible; any integer (reduced modulo 2**64). None: a fresh
            seed per call. Greedy decoding ignores it.
        cache: ``model.make_cache()`` to continue a conversation over several calls: ``prompt``
            is then only the new tokens (the cache holds the earlier ones).
        draft: speculative decoding (docs/speculative.md): "mtp" (the model's multi-token-prediction
            layer), "ngram" (prompt lookup) or "none". Default: "mtp" when the model has an MTP
            layer, except for seeded sampling; else "none". Greedy output is the same either way.
        num_draft: tokens drafted per step (1..7, default 3).

    Raises:
        ValueError: a bad sampling value (the message names it), an empty prompt, a prompt
            longer than the context limit, or a token id outside the model's vocabulary.
"""
if generate.__doc__ and stream_generate.__doc__:  # python -OO drops docstrings
    generate.__doc__ = generate.__doc__.rstrip() + "\n\n" + ARGS_DOC
    stream_generate.__doc__ = stream_generate.__doc__.rstrip() + "\n\n" + ARGS_DOC
