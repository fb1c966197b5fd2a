"""Weights for :class:`deepseek_v3.Model` from a directory: a colibri container or an
unconverted Hugging Face checkpoint.

Both are directories of safetensors shards read through ``colibri_mlx.container.Container``
(strict header checks, lazy memory-mapped views). A tensor with a ``.qs`` companion is a
quantized weight and stays a QTensor; every other tensor is widened to float32, then cast once to
the model's activation dtype (``dtype``, :func:`deepseek_v3.resolve_dtype`) as the model takes it. FP8 e4m3 weights are dequantized with their ``weight_scale_inv`` blocks
(128×128 per scale, the DeepSeek-V3 / GLM-5-FP8 layout): ``W = fp8(w) * scale_inv[i//128, j//128]``.
"""

from __future__ import annotations

import weakref

import mlx.core as mx
import numpy as np

from ..container import Container
from ..formats.qtensor import QTensor
from .deepseek_v3 import Model, ModelArgs, WeightTable, resolve_dtype, sanitize

FP8_DTYPES = ("F8_E4M3",)
# Stored dtypes a float tensor (norm, bias, router, unquantized weight) may have.
VALUE_DTYPES = ("F32", "BF16", "F16") + FP8_DTYPES
SCALE_INV_SUFFIX = "_scale_inv"
FP8_BLOCK = 128
# Float tensors up to this many values (norms, biases, routers: not whole matrices of an
# unconverted checkpoint, where a pass over every value would cost more than it finds) are
# checked for NaN / inf at load.
FINITE_CHECK_MAX = 1 << 22


def read_config(path: str) -> dict:
    """config.json of a model directory, checked against the model's schema (ConfigError naming
    the file and the key); a directory without one is not a model directory."""
    from .modeldir import read_config as _read_config

    return _read_config(path)


def load_model(path: str, ram_gb: float | None = None, pin: str | None = None, pin_gb: float | None = None,
               expert_top_p: float | None = None, dtype=None, **store_options) -> Model:
    """The model of a container / checkpoint directory.

    Everything that can be checked without reading weights is checked first
    (:func:`modeldir.open_model_dir`: config.json against the schema, every shard's header,
    config.json against the shards), so a bad directory fails in a second, naming the file.

    ``ram_gb`` streams the routed experts from disk through an ``experts.ExpertStore`` with that
    many GB (1e9 bytes) of expert cache; ``pin`` ("auto" or a .coli_usage path) and ``pin_gb``
    choose its pinned set; other ``store_options`` go to the store. ``expert_top_p`` turns on
    router top-p (changes results). Without ``ram_gb`` every expert is resident. ``dtype``:
    activation dtype, "auto"/None (float32 on the CPU backend, bfloat16 on GPUs), "float32",
    "bfloat16" or "float16".
    """
    from .modeldir import open_model_dir, resolve_model_path

    dtype = resolve_dtype(dtype)  # a bad value fails before any tensor is read
    return build_model(open_model_dir(resolve_model_path(path)), ram_gb, pin, pin_gb, expert_top_p, dtype, **store_options)


def build_model(opened, ram_gb: float | None = None, pin: str | None = None, pin_gb: float | None = None,
                expert_top_p: float | None = None, dtype=None, **store_options) -> Model:
    """:func:`load_model` of an already opened and checked directory (``modeldir.ModelDir``)."""
    dtype = resolve_dtype(dtype)
    args, container = ModelArgs.from_config(opened.config), opened.container
    if ram_gb is None:
        if pin is not None or pin_gb is not None or store_options:
            raise ValueError("pin / pin_gb / expert store options need ram_gb (expert streaming)")
        model = Model(args, table_for(container, opened.config), dtype)
        model.expert_store = None
    else:
        from ..experts import ExpertStore, resident_bytes

        pin_bytes = None if pin_gb is None else int(pin_gb * 1e9)
        store = ExpertStore(container, int(ram_gb * 1e9), pin=pin, pin_bytes=pin_bytes, **store_options)
        table = table_for(container, opened.config)
        table.expert_store = store
        model = Model(args, table, dtype)
        model.expert_store = store
        # The store holds shard fds and reader threads: release them with the model.
        weakref.finalize(model, store.close)
        store.resident_weight_bytes = resident_bytes(model)
    if expert_top_p is not None:
        from ..experts import set_expert_top_p

        set_expert_top_p(model, expert_top_p)
    return model


def table_for(container: Container, config: dict) -> WeightTable:
    """The weight table of a container, Hugging Face or mlx-lm checkpoint directory."""
    from .mlx_lm_checkpoint import is_mlx_lm_checkpoint, weight_table as mlx_lm_table

    if hasattr(container, "weight_table"):   # a GGUF model (models/gguf_checkpoint.py)
        return container.weight_table()
    if is_mlx_lm_checkpoint(config, container.names()):
        return mlx_lm_table(container, config)
    return weight_table(container)


def weight_table(container: Container) -> WeightTable:
    """Quantized tensors are copied out of the memory map into MLX arrays at load: resident
    weights are really resident (no per-call copy), and a shard truncated or rewritten while the
    model runs cannot fault them (SIGBUS on a mapped page past the new end of file)."""
    # FP8 scales are read together with their weight, never on their own.
    names = [n for n in container.weight_names() if not n.endswith(SCALE_INV_SUFFIX)]
    return WeightTable(names, lambda name, shape: _fetch(container, name, shape), container.path)


def table_from_dict(weights: dict, source: str = "weights") -> WeightTable:
    """A WeightTable over in-memory tensors (``sanitize``d names -> float arrays or QTensors)."""
    weights = sanitize(weights)
    return WeightTable(weights, lambda name, shape: weights[name], source)


def check_finite_scales(container: Container, name: str, qt):
    """``qt`` (tensor ``name`` or rows of it), refused when its ``.qs`` scales hold NaN or inf."""
    if qt.fmt != 6 and not np.isfinite(np.asarray(qt.scales)).all():  # fmt 6's .qs is a tag
        raise ValueError(f"{container.info(name + '.qs').path}: tensor {name + '.qs'!r} holds NaN or infinite "
                         "scales (a damaged shard?)")
    return qt


def _fetch(container: Container, name: str, shape: tuple):
    if container.is_quantized(name):
        if len(shape) != 2:
            raise ValueError(f"{container.path}: tensor {name!r} is quantized but config.json implies a "
                             f"{len(shape)}-D tensor of shape {shape}")
        return check_finite_scales(container, name, container.tensor(name, shape)).to_mlx()
    container.tensor(name, shape)  # header shape check, names the shard on mismatch
    info = container.info(name)
    if info.dtype not in VALUE_DTYPES or (info.dtype in FP8_DTYPES and len(shape) != 2):
        # U8/I8 without .qs, I64/U64, a bare scale dtype: bytes or integers read as weights would
        # run and print garbage.
        raise ValueError(f"{info.path}: tensor {name!r} is stored as {info.dtype}; the model takes it as values "
                         f"of shape {list(shape)}: expected F32, BF16 or F16 (or a 2-D F8_E4M3 weight with its "
                         f"{SCALE_INV_SUFFIX}, or a 2-D U8 weight with its .qs scales)")
    values = container.array(name, shape=shape)
    if container.info(name).dtype in FP8_DTYPES:
        values = _apply_fp8_scales(container, name, values)
    if values.size <= FINITE_CHECK_MAX and not np.isfinite(values).all():
        # Norms, biases, routers: a NaN here turns every output into garbage, silently.
        raise ValueError(f"{container.info(name).path}: tensor {name!r} holds NaN or infinite values "
                         "(a damaged shard?)")
    return mx.array(np.ascontiguousarray(values, dtype=np.float32))


def _apply_fp8_scales(container: Container, name: str, values: np.ndarray) -> np.ndarray:
    scale_name = name + SCALE_INV_SUFFIX
    if scale_name not in container:
        raise ValueError(f"{container.info(name).path}: FP8 tensor {name!r} has no {scale_name!r} (its 128x128 "
                         "block scales)")
    O, I = values.shape
    blocks = (-(-O // FP8_BLOCK), -(-I // FP8_BLOCK))
    scales = container.array(scale_name)
    if scales.shape != blocks:
        raise ValueError(f"{container.path}: {scale_name!r} has shape {scales.shape}, expected {blocks} "
                         f"({FP8_BLOCK}x{FP8_BLOCK} blocks of {name} [{O}, {I}])")
    full = np.repeat(np.repeat(scales, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[:O, :I]
    return values * full


def quantized_tensors(model: Model) -> list[QTensor]:
    """Every QTensor the model holds (for statistics)."""
    found = []

    def walk(obj, seen):
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if isinstance(obj, QTensor):
            found.append(obj)
        elif isinstance(obj, (list, tuple)):
            for v in obj:
                walk(v, seen)
        elif hasattr(obj, "__dict__"):
            for v in vars(obj).values():
                walk(v, seen)

    walk(model, set())
    return found
