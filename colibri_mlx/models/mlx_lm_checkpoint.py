"""mlx-lm checkpoints (what ``mlx_lm.convert`` writes) as weights for :class:`deepseek_v3.Model`.

An mlx-lm checkpoint is recognised by config.json's ``quantization`` (or ``quantization_config``)
dict holding ``bits`` / ``group_size`` / ``mode``, or by its tensor names: ``X.scales`` beside a
``X.weight``, ``mlp.switch_mlp.*``, ``self_attn.embed_q`` / ``unembed_out``. Its layout, as mlx-lm's
``deepseek_v3`` / ``deepseek_v32`` / ``glm_moe_dsa`` models sanitize and save it:

* a quantized linear ``X`` is ``X.weight`` (uint32 ``[O, I*bits/32]``), ``X.scales`` and, for
  affine, ``X.biases`` (``[O, I/group_size]``), read as a QTensor fmt 7-10
  (:func:`formats.mlx_quant.qtensor_from_mlx`); a module left unquantized is a float ``X.weight``;
* routed experts are stacked: ``mlp.switch_mlp.{gate,up,down}_proj.{weight,scales,biases}`` with
  a leading expert axis ``[E, O, ...]``; expert ``e`` is row ``e`` of each (one contiguous slice);
* ``kv_b_proj`` is split per head into ``embed_q [H, kv_lora, nope]`` (the key part, transposed)
  and ``unembed_out [H, v, kv_lora]``; both are decoded (exactly, as ``mx.dequantize``) and joined
  back into the float ``kv_b_proj.weight [H*(nope+v), kv_lora]`` the model takes;
* per-module settings: ``quantization[<module path>]`` is a dict (its own bits / group_size /
  mode, the ``mixed_*`` recipes) or ``false`` (left unquantized); other modules use the top-level
  settings. The stored shapes are checked against the settings and the shape config.json implies.
"""

from __future__ import annotations

import dataclasses
import re
import weakref
from dataclasses import dataclass
from typing import Mapping, Optional

import mlx.core as mx
import numpy as np

from ..formats.mlx_quant import MLX_MODES, check_params, qtensor_from_mlx
from .weights import WeightTable

QUANT_KEYS = ("quantization", "quantization_config")
SWITCH = re.compile(r"^(model\.layers\.\d+\.mlp)\.switch_mlp\.(gate|up|down)_proj\.weight$")
EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp)\.experts\.(\d+)\.(gate|up|down)_proj\.weight$")
SPLIT_KV_B = re.compile(r"^(model\.layers\.\d+\.self_attn)\.(embed_q|unembed_out)\.weight$")
COMPANIONS = (".scales", ".biases")
# (group_size, bits) MLX uses for a mode when config.json gives None (mlx.nn.quantize).
MODE_DEFAULTS = {"affine": (64, 4), "mxfp4": (32, 4), "nvfp4": (16, 4), "mxfp8": (32, 8)}
STORED_DTYPES = {"F32": np.float32, "F16": np.float16, "BF16": np.uint16, "U32": np.uint32, "U8": np.uint8}


class MlxLmCheckpointError(ValueError):
    """An mlx-lm checkpoint whose quantization settings or tensors do not fit together."""


def global_scale_refusal(where: str, what: str) -> str:
    """The message for nvfp4 weights quantized with a per-tensor ``global_scale`` (mlx-lm's
    ``quantize_model(..., global_scale=True)``: one float32 per expert of a switch layer, every
    weight ``code * e4m3 scale * global_scale / (6 * 448)``), which the kernels do not apply."""
    return (f"{where}: {what}: nvfp4 with a per-tensor global_scale is not supported (the kernels "
            "apply the E4M3 group scales only); quantize without global_scale")


@dataclass(frozen=True)
class QuantParams:
    mode: str
    bits: int
    group_size: int


def quantization_dict(config: Mapping) -> Optional[dict]:
    """config.json's mlx-lm quantization dict (``quantization``, else ``quantization_config`` when it
    is mlx-lm's, not a Hugging Face ``quant_method`` one), or None."""
    for key in QUANT_KEYS:
        q = config.get(key)
        if isinstance(q, dict) and "quant_method" not in q and ("bits" in q or "group_size" in q):
            return q
    return None


def is_mlx_lm_checkpoint(config: Mapping, names) -> bool:
    """config.json or the tensor names say this directory is an mlx-lm checkpoint."""
    if quantization_dict(config) is not None:
        return True
    names = set(names)
    return any(n.endswith(".scales") and n[:-7] + ".weight" in names or ".switch_mlp." in n
               or SPLIT_KV_B.match(n) for n in names)


class Quantization:
    """The quantization settings of every module (module docstring), checked at construction."""

    def __init__(self, config: Mapping, source: str = "config.json"):
        self.source = source
        q = quantization_dict(config)
        self.default: Optional[QuantParams] = None
        self.overrides: dict[str, Optional[QuantParams]] = {}
        if q is None:
            return
        self.default = self._params(q, "quantization", None)
        for key, value in q.items():
            if key in ("bits", "group_size", "mode"):
                continue
            if value is False:
                self.overrides[key] = None
            elif isinstance(value, dict):
                if value.get("global_scale"):
                    raise MlxLmCheckpointError(global_scale_refusal(source, f"quantization[{key!r}] has global_scale"))
                self.overrides[key] = self._params(value, f"quantization[{key!r}]", self.default)
            elif value is not True:
                raise MlxLmCheckpointError(f"{source}: quantization[{key!r}] must be a dict of bits / group_size / "
                                           f"mode, true or false, got {value!r}")

    def _params(self, q: dict, where: str, default: Optional[QuantParams]) -> QuantParams:
        mode = q.get("mode", default.mode if default else "affine")
        if mode not in MLX_MODES:
            raise MlxLmCheckpointError(f"{self.source}: {where}: mode {mode!r} is not one of {sorted(MLX_MODES)}")
        bits, gs = q.get("bits", default.bits if default else None), q.get("group_size",
                                                                           default.group_size if default else None)
        # None: MLX's default for the mode (``nn.quantize`` / ``to_quantized`` take None so).
        bits = MODE_DEFAULTS[mode][1] if bits is None else bits
        gs = MODE_DEFAULTS[mode][0] if gs is None else gs
        if not isinstance(bits, int) or not isinstance(gs, int) or isinstance(bits, bool) or isinstance(gs, bool):
            raise MlxLmCheckpointError(f"{self.source}: {where}: needs integer bits and group_size, got "
                                       f"bits={bits!r}, group_size={gs!r}")
        try:
            check_params(mode, bits, gs)
        except ValueError as e:
            raise MlxLmCheckpointError(f"{self.source}: {where}: {e}") from None
        return QuantParams(mode, bits, gs)

    def for_module(self, path: str) -> Optional[QuantParams]:
        """Settings of the module at ``path`` (mlx-lm module path); None: unquantized."""
        if path in self.overrides:
            return self.overrides[path]
        return self.default

    def describe(self) -> str:
        if self.default is None:
            return "mlx-lm (unquantized)"
        d = self.default
        text = f"mlx-lm {d.mode} {d.bits}-bit g{d.group_size}"
        if self.overrides:
            kinds = sorted({"unquantized" if p is None else f"{p.mode} {p.bits}-bit g{p.group_size}"
                            for p in self.overrides.values()})
            text += f", {len(self.overrides)} module overrides ({', '.join(kinds)})"
        return text


def stored_array(container, name: str, index: Optional[int] = None):
    """One stored tensor (``index``: its row ``index``, one expert of a stacked ``switch_mlp``
    tensor, a contiguous byte range) as an ``mx.array`` of its stored dtype (BF16 stays bfloat16).
    ``mx.array`` is the one copy out of the memory map (resident weights are really resident);
    ``np.require`` copies first only a misaligned view."""
    info = container.info(name)
    np_dtype = STORED_DTYPES.get(info.dtype)
    if np_dtype is None:
        raise MlxLmCheckpointError(f"{info.path}: tensor {name!r} is stored as {info.dtype}; an mlx-lm checkpoint "
                                   f"holds {sorted(STORED_DTYPES)}")
    raw, shape = container.raw(name), tuple(info.shape)
    if index is not None:
        per = info.nbytes // shape[0]
        raw, shape = raw[index * per: (index + 1) * per], shape[1:]
    arr = mx.array(np.require(raw.view(np_dtype), requirements="A").reshape(shape))
    return arr.view(mx.bfloat16) if info.dtype == "BF16" else arr


class MlxLmWeights:
    """Model tensor names (Hugging Face layout) -> tensors of an mlx-lm checkpoint."""

    def __init__(self, container, config: Mapping):
        self.container = container
        self.path = container.path
        self.quant = Quantization(config, f"{container.path}/config.json")
        self.n_experts = int(config.get("n_routed_experts") or 0)
        self.stored = set(container.names())
        self.names: dict[str, tuple] = {}   # model name -> how to build it
        for name in self.stored:
            if name.endswith(".global_scale"):
                raise MlxLmCheckpointError(global_scale_refusal(container.info(name).path, f"tensor {name!r}"))
            if name.endswith(COMPANIONS) and name.rsplit(".", 1)[0] + ".weight" in self.stored:
                continue
            m = SWITCH.match(name)
            if m:
                for e in range(self.n_experts):
                    self.names[f"{m.group(1)}.experts.{e}.{m.group(2)}_proj.weight"] = ("expert", name, e)
                continue
            m = SPLIT_KV_B.match(name)
            if m:
                self.names[f"{m.group(1)}.kv_b_proj.weight"] = ("kv_b", m.group(1))
                continue
            self.names[name] = ("plain", name)

    def stored_bytes(self, name: str) -> int:
        """Stored bytes a fetch of model tensor ``name`` reads: its weight with the scales and biases
        (one row of each for an expert of a stacked tensor), both halves of a split ``kv_b_proj``."""
        kind, *rest = self.names[name]
        if kind == "kv_b":
            return sum(self._with_companions(f"{rest[0]}.{part}.weight") for part in ("embed_q", "unembed_out"))
        if kind == "expert":
            return self._with_companions(rest[0], rows=self.container.info(rest[0]).shape[0])
        return self._with_companions(rest[0])

    def _with_companions(self, stored: str, rows: int = 1) -> int:
        names = [stored] + [stored[:-len(".weight")] + c for c in COMPANIONS if stored.endswith(".weight")]
        return sum(self.container.info(n).nbytes // rows for n in names if n in self.stored)

    def fetch(self, name: str, shape: tuple):
        kind, *rest = self.names[name]
        if kind == "expert":
            stored, e = rest
            return self._linear(stored, shape, e)
        if kind == "kv_b":
            return self._kv_b(rest[0], shape)
        if rest[0].endswith(".weight") and len(shape) == 2:
            return self._linear(rest[0], shape)
        return self._float(rest[0], shape)

    def _float(self, name: str, shape: tuple):
        from .loading import _fetch

        return _fetch(self.container, name, shape)

    def _linear(self, weight_name: str, shape: tuple, expert: Optional[int] = None):
        """A quantized matrix ``[O, I]`` (``expert``: row of a stacked one), or the float one of an
        unquantized module."""
        module = weight_name[:-len(".weight")]
        scales_name, biases_name = module + ".scales", module + ".biases"
        info = self.container.info(weight_name)
        label = weight_name if expert is None else f"{weight_name}[{expert}]"
        if scales_name not in self.stored:
            if info.dtype == "U32":
                raise MlxLmCheckpointError(f"{info.path}: tensor {weight_name!r} is packed (U32) but "
                                           f"{scales_name!r} is missing")
            if expert is None:
                return self._float(weight_name, shape)
            values = stored_array(self.container, weight_name, expert).astype(mx.float32)
            return values
        params = self.quant.for_module(module)
        if params is None:
            raise self._marked_unquantized(module, scales_name)
        O, I = shape
        stacked = () if expert is None else (self.n_experts,)
        want_w = stacked + (O, I * params.bits // 32)
        want_s = stacked + (O, I // params.group_size)
        if tuple(info.shape) != want_w or tuple(self.container.info(scales_name).shape) != want_s:
            raise MlxLmCheckpointError(
                f"{info.path}: {weight_name!r} {list(info.shape)} with {scales_name!r} "
                f"{list(self.container.info(scales_name).shape)} does not match {params.mode} bits={params.bits} "
                f"group_size={params.group_size} for a [{O}, {I}] matrix (expected {list(want_w)} and {list(want_s)}; "
                "quantization in config.json does not describe this tensor)")
        has_biases = MLX_MODES[params.mode].has_biases
        if has_biases and biases_name not in self.stored:
            raise MlxLmCheckpointError(f"{info.path}: affine tensor {weight_name!r} has no {biases_name!r}")
        take = (lambda n: stored_array(self.container, n)) if expert is None else \
            (lambda n: stored_array(self.container, n, expert))
        return qtensor_from_mlx(take(weight_name), take(scales_name), take(biases_name) if has_biases else None,
                                mode=params.mode, bits=params.bits, group_size=params.group_size, name=label)

    def _marked_unquantized(self, module: str, scales_name: str) -> MlxLmCheckpointError:
        """A module stored quantized that config.json says is not (or that has no settings at all)."""
        return MlxLmCheckpointError(f"{self.path}/config.json: module {module!r} is stored quantized "
                                    f"({scales_name!r} present) but quantization says it is not")

    def _kv_b(self, attn: str, shape: tuple):
        """``kv_b_proj.weight`` from ``embed_q`` and ``unembed_out`` (module docstring)."""
        from ..kernels.reference import dequantize

        parts = {}
        for part in ("embed_q", "unembed_out"):
            name = f"{attn}.{part}.weight"
            if name not in self.stored:
                raise MlxLmCheckpointError(f"{self.path}: missing tensor {name!r} (mlx-lm stores kv_b_proj as "
                                           "embed_q and unembed_out)")
            info = self.container.info(name)
            if len(info.shape) != 3:
                raise MlxLmCheckpointError(f"{info.path}: {name!r} has shape {list(info.shape)}, expected "
                                           "[heads, out, in]")
            H, O, words_or_in = info.shape
            if f"{attn}.{part}.scales" in self.stored:
                params = self.quant.for_module(f"{attn}.{part}")
                if params is None:
                    raise self._marked_unquantized(f"{attn}.{part}", f"{attn}.{part}.scales")
                I = words_or_in * 32 // params.bits
                qt = self._linear_3d(name, params, H * O, I)
                # float32, widened scales, as mlx-lm's quantized_matmul reads it
                parts[part] = dequantize(qt).reshape(H, O, I)
            else:
                parts[part] = stored_array(self.container, name).astype(mx.float32)
        wk, wv = parts["embed_q"], parts["unembed_out"]   # [H, kv_lora, nope], [H, v, kv_lora]
        H = wk.shape[0]
        if wv.shape[0] != H or wk.shape[1] != wv.shape[2]:
            raise MlxLmCheckpointError(f"{self.path}: {attn}.embed_q {list(wk.shape)} and unembed_out "
                                       f"{list(wv.shape)} do not split one kv_b_proj")
        joined = mx.concatenate([wk.swapaxes(1, 2), wv], axis=1)
        return joined.reshape(-1, wk.shape[1])

    def _linear_3d(self, name: str, params: QuantParams, rows: int, I: int):
        module = name[:-len(".weight")]

        def flat(n):
            a = stored_array(self.container, n)
            return a.reshape(rows, a.shape[-1])

        biases = flat(module + ".biases") if MLX_MODES[params.mode].has_biases else None
        try:
            return qtensor_from_mlx(flat(name), flat(module + ".scales"), biases, mode=params.mode,
                                    bits=params.bits, group_size=params.group_size, name=name)
        except ValueError as e:
            raise MlxLmCheckpointError(f"{self.container.info(name).path}: {e}") from None


def weight_table(container, config: Mapping) -> WeightTable:
    weights = MlxLmWeights(container, config)
    return WeightTable(weights.names, weights.fetch, container.path)


# ------------------------------------------------------------------------- expert streaming


def stacked_tensor_name(layer: int, proj: str, part: str = "weight") -> str:
    return f"model.layers.{layer}.mlp.switch_mlp.{proj}_proj.{part}"


def _row_range(info, index: int):
    """(offset, nbytes) of row ``index`` of a stacked tensor: one contiguous byte range."""
    per = info.nbytes // info.shape[0]
    return info.offset + index * per, per


_quantizations: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def container_quantization(container) -> "Quantization":
    """The container's config.json quantization settings, parsed once per container (the
    expert store plans every expert of every layer with them)."""
    quant = _quantizations.get(container)
    if quant is None:
        quant = _quantizations[container] = Quantization(container.config, f"{container.path}/config.json")
    return quant


def plan_stacked_expert(container, layer: int, expert: int, shapes: dict):
    """Where expert ``expert`` of an mlx-lm ``switch_mlp`` layer lies: its row of each stacked
    tensor (weight, scales, biases of gate, up, down), one read each (adjacent rows merged)."""
    from ..experts.store import (PROJECTIONS, ByteRange, ExpertLayout, ExpertStoreError, Part, ProjectionLayout,
                                 _coalesce)

    quant = container_quantization(container)
    ranges, projections = [], []
    for proj in PROJECTIONS:
        O, I = shapes[proj]
        names = {part: stacked_tensor_name(layer, proj, part) for part in ("weight", "scales", "biases")}
        info = container.info(names["weight"])
        n_experts = info.shape[0]
        if not 0 <= expert < n_experts:
            raise ExpertStoreError(f"{info.path}: {names['weight']!r} stacks {n_experts} experts, config.json "
                                   f"has n_routed_experts > {expert}")
        params = quant.for_module(names["weight"][:-len(".weight")]) if names["scales"] in container else None
        if params is None:
            if info.dtype not in STORED_DTYPES or info.dtype in ("U32", "U8") or tuple(info.shape[1:]) != (O, I):
                raise ExpertStoreError(f"{info.path}: tensor {names['weight']!r}: stored {info.dtype} "
                                       f"{list(info.shape)}, expected a float [E, {O}, {I}] (or its .scales)")
            parts = ("weight",)
        else:
            want = (O, I * params.bits // 32)
            if tuple(info.shape[1:]) != want:
                raise ExpertStoreError(f"{info.path}: tensor {names['weight']!r}: stored {list(info.shape)}, "
                                       f"expected [E, {want[0]}, {want[1]}] ({params.mode} {params.bits}-bit)")
            parts = ("weight", "scales", "biases") if MLX_MODES[params.mode].has_biases else ("weight", "scales")
        for part in parts:
            pinfo = container.info(names[part])
            offset, nbytes = _row_range(pinfo, expert)
            label = f"model.layers.{layer}.mlp.experts.{expert}.{proj}_proj.weight" if part == "weight" \
                else f"{names[part]}[{expert}]"
            ranges.append((label, pinfo.dtype, pinfo.path, offset, nbytes))
        projections.append((proj, O, I, params, len(parts)))
    reads, where = _coalesce([ByteRange(*r) for r in ranges])
    layouts, at = [], 0
    for proj, O, I, params, n in projections:
        labels = [r[0] for r in ranges[at: at + n]]
        at += n
        parts = [Part(label, *where[label]) for label in labels] + [None] * (3 - n)
        layouts.append(ProjectionLayout(proj, O, I, parts[0], parts[1],
                                        None if params is None else MLX_MODES[params.mode].fmt,
                                        None if params is None else params.group_size,
                                        None if params is None else params.bits, parts[2]))
    return ExpertLayout(layer, expert, tuple(reads), tuple(layouts))


def stacked_projection(p, buffers):
    """A streamed expert projection (:func:`plan_stacked_expert`) as a QTensor over its read bytes."""
    from ..formats.mlx_quant import MLX_FMTS

    def arr(part, rows_shape):
        raw = buffers[part.read][part.start: part.start + part.nbytes]
        a = mx.array(np.require(raw.view(STORED_DTYPES[part.dtype]), requirements="A").reshape(rows_shape))
        return a.view(mx.bfloat16) if part.dtype == "BF16" else a

    mode = MLX_FMTS[p.fmt]
    weight = arr(p.weight, (p.O, p.I * p.bits // 32))
    scales = arr(p.scales, (p.O, p.I // p.gs))
    biases = arr(p.biases, (p.O, p.I // p.gs)) if p.biases is not None else None
    qt = qtensor_from_mlx(weight, scales, biases, mode=mode.mode, bits=p.bits, group_size=p.gs, name=p.weight.name)
    return dataclasses.replace(qt, streamed=True)


# ------------------------------------------------------------------------------------ inspect


def inspect_checkpoint(container):
    """``colibri inspect`` of an mlx-lm checkpoint: one row per stored module (weight with its
    scales and biases; a stacked ``switch_mlp`` tensor is one row of E experts). Each quantized
    row is checked against the module's settings in config.json; a mismatch is an unresolved row."""
    from ..container.inspect import MissingWeights, TensorRow, _summarize
    from ..container.shapes import tensor_class
    from ..formats.mlx_quant import MLX_FMT_NAMES

    quant = Quantization(container.config, f"{container.path}/config.json")
    stored = set(container.names())
    n_layers = container.config.get("num_hidden_layers")
    rows, experts = [], {}
    for name in sorted(stored):
        module, _, part = name.rpartition(".")
        if part in ("scales", "biases") and module + ".weight" in stored:
            continue
        info = container.info(name)
        cls = tensor_class(name.replace(".switch_mlp.", ".experts."), n_layers)
        companions = [module + s for s in COMPANIONS if part == "weight" and module + s in stored]
        nbytes = info.nbytes + sum(container.info(n).nbytes for n in companions)
        shape = tuple(info.shape)
        if not companions:
            O, I = (shape[-2], shape[-1]) if len(shape) >= 2 else (shape[0] if shape else None, None)
            row = TensorRow(name, cls, info.dtype, info.dtype.lower(), 0 if info.dtype == "F32" else None, None,
                            O, I, nbytes)
            if info.dtype == "U32":
                row.fmt, row.error = "?", f"{info.path}: tensor {name!r} is packed (U32) but {module}.scales is missing"
        else:
            params = quant.for_module(module)
            scales = container.info(module + ".scales")
            O = shape[-2]
            if params is None:
                row = TensorRow(name, cls, info.dtype, "?", None, None, O, None, nbytes,
                                error=f"{module}: stored quantized but config.json's quantization says it is not")
            else:
                I = shape[-1] * 32 // params.bits
                row = TensorRow(name, cls, info.dtype, f"{MLX_FMT_NAMES[MLX_MODES[params.mode].fmt]}-{params.bits}b",
                                MLX_MODES[params.mode].fmt, params.group_size, O, I, nbytes)
                if I % params.group_size or tuple(scales.shape[-1:]) != (I // params.group_size,):
                    row.fmt, row.error = "?", (f"{module}: scales {list(scales.shape)} do not fit {params.mode} "
                                               f"bits={params.bits} group_size={params.group_size} for "
                                               f"weight {list(shape)}")
        if len(shape) == 3:
            row.note = f"{shape[0]} x [{row.O}, {row.I}]" + (" (stacked experts)" if ".switch_mlp." in name else "")
            if ".switch_mlp." in name:
                layer = int(name.split(".")[2])
                for e in range(shape[0]):
                    experts[(layer, e)] = experts.get((layer, e), 0) + nbytes // shape[0]
        rows.append(row)
    report = _summarize(container.path, rows)
    report.routed_experts = len(experts)
    report.expert_nbytes = sorted(set(experts.values()))
    report.missing = MissingWeights(skipped="an mlx-lm checkpoint: its tensors are matched to the model at load")
    report.source_format = quant.describe()
    return report
