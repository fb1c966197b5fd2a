"""Weights by checkpoint name, and the activation dtype they are handed out in.

:class:`WeightTable` is what a model file takes its tensors from: container, Hugging Face
checkpoint or in-memory dictionary alike (models/loading.py builds it), each take checked
against the shape config.json implies.
"""

from __future__ import annotations

import re
from typing import Any, Callable, Iterable

import mlx.core as mx

ACTIVATION_DTYPES = {"float32": mx.float32, "bfloat16": mx.bfloat16, "float16": mx.float16}
FLOAT_DTYPES = tuple(ACTIVATION_DTYPES.values())


def resolve_dtype(dtype=None) -> mx.Dtype:
    """The activation dtype: ``None``/"auto" is float32 on the CPU backend (MLX's CPU half
    precision ops are several times slower than float32) and bfloat16 on a GPU (Metal or CUDA:
    half the bytes for activations and the latent cache, as mlx-lm)."""
    if dtype is None or dtype == "auto":
        return mx.float32 if mx.default_device().type == mx.cpu else mx.bfloat16
    if isinstance(dtype, mx.Dtype) and dtype in FLOAT_DTYPES:
        return dtype
    if isinstance(dtype, str) and dtype in ACTIVATION_DTYPES:
        return ACTIVATION_DTYPES[dtype]
    raise ValueError(f"unsupported activation dtype {dtype!r}; expected 'auto' or one of "
                     f"{sorted(ACTIVATION_DTYPES)}")


class WeightTable:
    """Tensors by checkpoint name, fetched on demand with the shape config.json implies.

    ``fetch(name, shape)`` returns a float ``mx.array`` or a QTensor. Every take is checked
    against the expected shape, and :meth:`check_all_used` refuses tensors nothing asked for.
    Float arrays are handed out in ``dtype`` (the model's activation dtype, set by
    :class:`Model`) unless the caller asks for another; QTensors as stored.
    """

    IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")

    def __init__(self, names: Iterable[str], fetch: Callable[[str, tuple], Any], source: str):
        self.names = set(names)
        self.fetch = fetch
        self.source = source
        self.used: set[str] = set()
        self.dtype = mx.float32

    def __contains__(self, name: str) -> bool:
        return name in self.names

    def take(self, name: str, shape: tuple, dtype: mx.Dtype | None = None) -> Any:
        if name not in self.names:
            raise ValueError(f"{self.source}: missing tensor {name!r} (expected shape {tuple(shape)})")
        value = self.fetch(name, tuple(shape))
        got = tuple(value.shape)
        if got != tuple(shape):
            raise ValueError(f"{self.source}: tensor {name!r} has shape {got}, config.json implies {tuple(shape)}")
        self.used.add(name)
        return _cast_float(value, dtype or self.dtype)

    def maybe(self, name: str, shape: tuple, dtype: mx.Dtype | None = None) -> Any:
        return self.take(name, shape, dtype) if name in self.names else None

    def has_prefix(self, prefix: str) -> bool:
        return any(n.startswith(prefix) for n in self.names)

    def check_all_used(self) -> None:
        extra = sorted(n for n in self.names - self.used if not self.IGNORED.search(n))
        if extra:
            more = f" (and {len(extra) - 8} more)" if len(extra) > 8 else ""
            raise ValueError(f"{self.source}: tensors not used by this config.json: {extra[:8]}{more}; "
                             "was the checkpoint built for another config?")


def _cast_float(value, dtype: mx.Dtype):
    if not isinstance(value, mx.array) or value.dtype not in FLOAT_DTYPES or value.dtype == dtype:
        return value
    value = value.astype(dtype)
    mx.eval(value)  # now, so the wider source array is freed tensor by tensor during load
    return value
