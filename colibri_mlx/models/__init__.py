"""The DeepSeek-V3 model family (DeepSeek-V3/R1, Kimi-K2, DeepSeek-V3.2, GLM-5.x) on MLX.

``load(path)`` reads a colibri container or a Hugging Face checkpoint directory and returns
``(model, tokenizer)``; ``load_model(path)`` returns the model alone.
"""

from __future__ import annotations

import os

from .deepseek_v3 import ACTIVATION_DTYPES, MODEL_TYPES, Model, ModelArgs, resolve_dtype
from .loading import load_model

__all__ = ["ACTIVATION_DTYPES", "DEMO_MODEL_DIR", "MODEL_TYPES", "Model", "ModelArgs", "load", "load_model",
           "resolve_dtype"]

# A 4-layer, 29M-parameter model of this family trained on the King James Bible, shipped as a
# colibri container (fmt 6 experts, fmt 4 attention/dense, fmt 1 embeddings): docs/demo-model.md.
DEMO_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "demo")


def load(path=None, dtype=None, **options):
    """``(model, tokenizer)`` from a container, Hugging Face or mlx-lm checkpoint directory, or a
    GGUF file or split set (docs/gguf.md).

    ``path=None`` loads the bundled demo model (:data:`DEMO_MODEL_DIR`). ``dtype``: activation
    dtype ("auto" = float32 on CPU, bfloat16 on GPU; "float32", "bfloat16", "float16"). Expert
    streaming options (``ram_gb``, ``pin``, ``pin_gb``, ``expert_top_p``, store options): see
    :func:`load_model` and docs/streaming.md.
    """
    if path is None:
        path = DEMO_MODEL_DIR
    unknown = set(options) - STREAMING_OPTIONS
    if unknown:
        raise TypeError(f"load() got unknown option(s): {sorted(unknown)}")
    from ..tokenizer import load_tokenizer
    from .loading import build_model
    from .modeldir import open_model_dir, resolve_model_path

    resolve_dtype(dtype)  # a bad value fails first
    path = resolve_model_path(path)   # a hub id (mlx-community/...) -> its cached snapshot
    # config.json, shard headers, then the tokenizer: every check before any weight is read.
    opened = open_model_dir(path)
    tokenizer = load_tokenizer(path)
    tokenizer.check_vocab(opened.config["vocab_size"], opened.config_path)
    return build_model(opened, dtype=dtype, **options), tokenizer


STREAMING_OPTIONS = frozenset(("ram_gb", "pin", "pin_gb", "expert_top_p", "prefetch", "workers", "max_inflight",
                               "usage_path", "record_usage", "preload_pinned", "drop_read_pages"))
