"""config.json against the model family's schema, before anything is built.

Every key :meth:`deepseek_v3.ModelArgs.from_config` (and the tensor-shape table,
``container.shapes``) reads is listed in :data:`SCHEMA` with its type and range; cross-field
rules (:data:`RULES`) tie keys together (``num_experts_per_tok <= n_routed_experts``, groups
that divide the experts, per-layer lists as long as ``num_hidden_layers``, RoPE scaling
fields). :func:`validate_config` checks all of it and raises one :class:`ConfigError` that
names the file and the key: a bad value never reaches numpy or MLX, where it would fail far from
its cause (``n_group: 0`` as ZeroDivisionError, a short ``mlp_layer_types`` as IndexError) or
run and print garbage (``num_experts_per_tok: 0``, ``rms_norm_eps: -1``).

``null`` counts as absent: the key takes its default, as in ``from_config``. Keys that this
engine does not read are not checked (a config carries many: ``initializer_range``, ...).
Upper bounds are generous (tens of times today's largest models) and exist so that a typo
(``num_hidden_layers: 6100``) fails here instead of looping over layers that do not exist.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Optional

from ..errors import ConfigError

INT32_MAX = (1 << 31) - 1
MAX_LAYERS = 4096
MAX_EXPERTS = 16384
MAX_DIM = 1 << 20

MODEL_TYPES = ("deepseek_v3", "kimi_k2", "deepseek_v32", "glm_moe_dsa")
DSA_TYPES = ("deepseek_v32", "glm_moe_dsa")
ROPE_TYPES = ("default", "yarn", "deepseek_yarn")
YARN_TYPES = ("yarn", "deepseek_yarn")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _show(v) -> str:
    """A JSON value as the user wrote it, with its type where that is the problem."""
    import json

    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = repr(v)
    if len(text) > 60:
        text = text[:57] + "..."
    kind = {str: "a string", bool: "a boolean", list: "a list", dict: "an object", float: "a number",
            int: "an integer"}.get(type(v))
    return f"{text} ({kind})" if isinstance(v, (str, bool, list, dict)) else text


@dataclass(frozen=True)
class Int:
    lo: Optional[int] = None
    hi: Optional[int] = None

    def problem(self, v) -> Optional[str]:
        if not _is_int(v) or (self.lo is not None and v < self.lo) or (self.hi is not None and v > self.hi):
            return f"got {_show(v)}; expected {self.expected()}"
        return None

    def expected(self) -> str:
        if self.lo is not None and self.hi is not None:
            return f"an integer from {self.lo} to {self.hi}"
        if self.lo is not None:
            return f"an integer >= {self.lo}"
        return "an integer"


@dataclass(frozen=True)
class Num:
    lo: Optional[float] = None
    hi: Optional[float] = None
    lo_open: bool = False
    hi_open: bool = False

    def problem(self, v) -> Optional[str]:
        ok = _is_number(v) and math.isfinite(v)
        if ok and self.lo is not None:
            ok = v > self.lo if self.lo_open else v >= self.lo
        if ok and self.hi is not None:
            ok = v < self.hi if self.hi_open else v <= self.hi
        return None if ok else f"got {_show(v)}; expected {self.expected()}"

    def expected(self) -> str:
        parts = []
        if self.lo is not None:
            parts.append(f"{'>' if self.lo_open else '>='} {self.lo:g}")
        if self.hi is not None:
            parts.append(f"{'<' if self.hi_open else '<='} {self.hi:g}")
        return "a finite number" + (" " + " and ".join(parts) if parts else "")


@dataclass(frozen=True)
class Bool:
    def problem(self, v) -> Optional[str]:
        # 0 / 1 pass: some exported configs write flags as integers, and Python reads them alike.
        if isinstance(v, bool) or (_is_int(v) and v in (0, 1)):
            return None
        return f"got {_show(v)}; expected true or false"


@dataclass(frozen=True)
class Choice:
    values: tuple

    def problem(self, v) -> Optional[str]:
        if isinstance(v, str) and v in self.values:
            return None
        return f"got {_show(v)}; expected one of {', '.join(repr(x) for x in self.values)}"


@dataclass(frozen=True)
class TokenIds:
    """An id or a list of ids (eos_token_id)."""

    def problem(self, v) -> Optional[str]:
        ids = v if isinstance(v, list) else [v]
        if all(_is_int(i) and 0 <= i <= INT32_MAX for i in ids):
            return None
        return f"got {_show(v)}; expected a token id (an integer >= 0) or a list of them"


@dataclass(frozen=True)
class Names:
    """A per-layer list of names (mlp_layer_types, indexer_types); its length is a RULE."""

    values: tuple

    def problem(self, v) -> Optional[str]:
        if isinstance(v, list) and all(isinstance(x, str) and x in self.values for x in v):
            return None
        bad = next((x for x in v if not (isinstance(x, str) and x in self.values)), None) if isinstance(v, list) \
            else None
        what = f"entry {_show(bad)}" if isinstance(v, list) else _show(v)
        return f"got {what}; expected a list of {' / '.join(repr(x) for x in self.values)}, one per layer"


@dataclass(frozen=True)
class Pattern:
    """index_topk_pattern: a string of F/S, or a list of 'full'/'shared', one per layer."""

    def problem(self, v) -> Optional[str]:
        if isinstance(v, str) and v and set(v) <= {"F", "S"}:
            return None
        if isinstance(v, list) and v and all(x in ("full", "shared") for x in v):
            return None
        return f"got {_show(v)}; expected a string of 'F'/'S' or a list of 'full'/'shared', one per layer"


@dataclass(frozen=True)
class Object:
    def problem(self, v) -> Optional[str]:
        return None if isinstance(v, dict) else f"got {_show(v)}; expected an object {{...}} or null"


@dataclass(frozen=True)
class Key:
    rule: Any
    required: bool = False
    families: tuple = MODEL_TYPES  # the model types that read this key


_DSA = DSA_TYPES
# key -> its type and range. Required keys are those ModelArgs.REQUIRED lists.
SCHEMA: dict[str, Key] = {
    "vocab_size": Key(Int(1, INT32_MAX), True),
    "hidden_size": Key(Int(1, MAX_DIM), True),
    "intermediate_size": Key(Int(1, 1 << 24), True),
    "moe_intermediate_size": Key(Int(1, 1 << 24), True),
    "num_hidden_layers": Key(Int(1, MAX_LAYERS), True),
    "num_attention_heads": Key(Int(1, 1 << 16), True),
    "n_routed_experts": Key(Int(1, MAX_EXPERTS), True),
    "num_experts_per_tok": Key(Int(1, MAX_EXPERTS), True),
    "kv_lora_rank": Key(Int(1, MAX_DIM), True),
    "qk_rope_head_dim": Key(Int(2, 1 << 16), True),
    "qk_nope_head_dim": Key(Int(1, 1 << 16), True),
    "v_head_dim": Key(Int(1, 1 << 16), True),
    "q_lora_rank": Key(Int(1, MAX_DIM)),
    "n_shared_experts": Key(Int(0, 1024)),
    "routed_scaling_factor": Key(Num(0, 100, lo_open=True)),
    "n_group": Key(Int(1, MAX_EXPERTS)),
    "topk_group": Key(Int(1, MAX_EXPERTS)),
    "norm_topk_prob": Key(Bool()),
    "first_k_dense_replace": Key(Int(0, MAX_LAYERS)),
    "moe_layer_freq": Key(Int(1, MAX_LAYERS)),
    "mlp_layer_types": Key(Names(("dense", "sparse"))),
    "max_position_embeddings": Key(Int(1, INT32_MAX)),
    "rms_norm_eps": Key(Num(0, 1, lo_open=True, hi_open=True)),
    "rope_theta": Key(Num(0, lo_open=True)),
    "rope_scaling": Key(Object()),
    "rope_parameters": Key(Object()),
    "rope_interleave": Key(Bool()),
    "attention_bias": Key(Bool()),
    "tie_word_embeddings": Key(Bool()),
    "num_nextn_predict_layers": Key(Int(0, 64)),
    "eos_token_id": Key(TokenIds()),
    "bos_token_id": Key(TokenIds()),
    "scoring_func": Key(Choice(("sigmoid",))),
    "topk_method": Key(Choice(("noaux_tc",))),
    "hidden_act": Key(Choice(("silu",))),
    "index_topk": Key(Int(1, INT32_MAX), families=_DSA),
    "index_n_heads": Key(Int(1, 1 << 16), families=_DSA),
    "index_head_dim": Key(Int(1, 1 << 16), families=_DSA),
    "indexer_types": Key(Names(("full", "shared")), families=("glm_moe_dsa",)),
    "index_topk_pattern": Key(Pattern(), families=("glm_moe_dsa",)),
    "index_topk_freq": Key(Int(1, MAX_LAYERS), families=("glm_moe_dsa",)),
    "index_skip_topk_offset": Key(Int(0, MAX_LAYERS), families=("glm_moe_dsa",)),
}

# Inside the RoPE dict (rope_parameters, or rope_scaling + rope_theta).
ROPE_SCHEMA: dict[str, Any] = {
    "rope_theta": Num(0, lo_open=True),
    "rope_type": Choice(ROPE_TYPES),
    "type": Choice(ROPE_TYPES),
    "factor": Num(0, lo_open=True),
    "original_max_position_embeddings": Int(1, INT32_MAX),
    "attention_factor": Num(0, lo_open=True),
    "mscale": Num(0),
    "mscale_all_dim": Num(0),
    "beta_fast": Num(0, lo_open=True),
    "beta_slow": Num(0, lo_open=True),
    "truncate": Bool(),
}


class _Config:
    """config.json values with defaults, for the cross-field rules."""

    DEFAULTS = {"n_group": 1, "topk_group": 1, "first_k_dense_replace": 0, "num_nextn_predict_layers": 0}

    def __init__(self, config: Mapping):
        self.config = config

    def __getitem__(self, key):
        value = self.config.get(key)
        return self.DEFAULTS.get(key) if value is None else value

    def given(self, key) -> bool:
        return self.config.get(key) is not None


def _experts_per_token(c: _Config) -> Optional[str]:
    E, K = c["n_routed_experts"], c["num_experts_per_tok"]
    if K > E:
        return (f"num_experts_per_tok={K} is more than n_routed_experts={E} (each token is routed to "
                "num_experts_per_tok of the n_routed_experts experts)")
    return None


def _groups(c: _Config) -> Optional[str]:
    E, G, TG, K = c["n_routed_experts"], c["n_group"], c["topk_group"], c["num_experts_per_tok"]
    if E % G:
        return f"n_group={G} does not divide n_routed_experts={E} (the experts form n_group equal groups)"
    if TG > G:
        return f"topk_group={TG} is more than n_group={G} (topk_group of the n_group groups are kept)"
    if K > TG * (E // G):
        return (f"num_experts_per_tok={K} is more than the {TG * (E // G)} experts in topk_group={TG} groups of "
                f"{E // G} (n_routed_experts={E} / n_group={G})")
    return None


def _dense_layers(c: _Config) -> Optional[str]:
    n, k = c["num_hidden_layers"], c["first_k_dense_replace"]
    if k > n:
        return f"first_k_dense_replace={k} is more than num_hidden_layers={n}"
    return None


def _per_layer(key: str, first: Optional[tuple] = None) -> Callable[[_Config], Optional[str]]:
    def rule(c: _Config) -> Optional[str]:
        if not c.given(key) or c["model_type"] not in SCHEMA[key].families:
            return None
        value, n = c[key], c["num_hidden_layers"]
        if len(value) != n:
            return f"{key} has {len(value)} entries; num_hidden_layers={n} needs one per layer"
        if first is not None and value[0] not in first:
            return f"{key} must start with a full indexer layer ({' or '.join(repr(f) for f in first)}), " \
                   f"got {value[0]!r}"
        return None

    return rule


def _token_ids_in_vocab(c: _Config) -> Optional[str]:
    V = c["vocab_size"]
    for key in ("bos_token_id", "eos_token_id"):
        value = c[key]
        for i in value if isinstance(value, list) else [] if value is None else [value]:
            if i >= V:
                return (f"{key}={_short(value)} is outside the vocabulary: vocab_size={V} (token ids run 0.."
                        f"{V - 1})")
    return None


def _moe_layer_freq(c: _Config) -> Optional[str]:
    # ModelArgs makes every layer from first_k_dense_replace on MoE; shapes.py would skip layers.
    if c.given("moe_layer_freq") and c["moe_layer_freq"] != 1 and not c.given("mlp_layer_types"):
        return (f"moe_layer_freq={c['moe_layer_freq']}: this engine makes every layer from first_k_dense_replace on "
                "MoE (moe_layer_freq 1); give mlp_layer_types (\"dense\" / \"sparse\", one per layer) to mix them")
    return None


def _rope_dims(c: _Config) -> Optional[str]:
    if c["qk_rope_head_dim"] % 2:
        return f"qk_rope_head_dim={c['qk_rope_head_dim']} must be even (RoPE rotates pairs of dimensions)"
    return None


def _dsa(c: _Config) -> Optional[str]:
    if c["model_type"] not in DSA_TYPES:
        return None
    if not c.given("q_lora_rank"):
        return f"q_lora_rank: {c['model_type']} needs it (its DSA indexer reads the query latent), got null"
    head_dim = c["index_head_dim"] if c.given("index_head_dim") else 128
    if head_dim < c["qk_rope_head_dim"] or head_dim % 2:
        return (f"index_head_dim={head_dim} must be even and at least qk_rope_head_dim="
                f"{c['qk_rope_head_dim']} (the indexer ropes its first qk_rope_head_dim dimensions)")
    return None



RULES: list[Callable[[_Config], Optional[str]]] = [
    _experts_per_token, _groups, _dense_layers, _per_layer("mlp_layer_types"),
    _per_layer("indexer_types", ("full",)), _per_layer("index_topk_pattern", ("F", "full")), _rope_dims, _dsa,
    _token_ids_in_vocab, _moe_layer_freq,
]

# model_type -> the architectures (lower case, no "_") its checkpoints name; an entry must start
# with one of them. Kimi-K2 ships as DeepseekV3ForCausalLM.
ARCHITECTURES = {
    "deepseek_v3": ("deepseekv3for", "kimi"),
    "kimi_k2": ("deepseekv3for", "kimi"),
    "deepseek_v32": ("deepseekv32",),
    "glm_moe_dsa": ("glmmoedsa",),
}


def _check_architectures(config: Mapping, source: str) -> None:
    """``architectures`` (optional) is a list of class names, one of them of ``model_type``'s family:
    a config.json whose two fields disagree was edited by hand, or belongs to another model."""
    value = config.get("architectures")
    if value is None:
        return
    if not isinstance(value, list) or not all(isinstance(a, str) for a in value):
        bad = next((a for a in value if not isinstance(a, str)), None) if isinstance(value, list) else None
        what = f"entry {_show(bad)}" if isinstance(value, list) else _show(value)
        raise ConfigError(f"{source}: architectures: got {what}; expected a list of class names, e.g. "
                          '["DeepseekV3ForCausalLM"]')
    model_type = config["model_type"]
    wanted = ARCHITECTURES[model_type]
    if value and not any(a.replace("_", "").lower().startswith(wanted) for a in value):
        example = {"deepseek_v3": "DeepseekV3ForCausalLM", "kimi_k2": "DeepseekV3ForCausalLM",
                   "deepseek_v32": "DeepseekV32ForCausalLM", "glm_moe_dsa": "GlmMoeDsaForCausalLM"}[model_type]
        raise ConfigError(f"{source}: architectures {_short(value)} does not match model_type {model_type!r} "
                          f"(expected {example}): one of the two is wrong, or config.json is another model's")


def _rope_source(config: Mapping) -> tuple[str, dict]:
    """The RoPE dict rope.rope_parameters reads and its key (rope_parameters wins when non-empty)."""
    params = config.get("rope_parameters")
    if isinstance(params, dict) and params:
        return "rope_parameters", params
    return "rope_scaling", config.get("rope_scaling") or {}


def _check_rope(config: Mapping) -> Optional[tuple[str, str]]:
    where, params = _rope_source(config)
    for key, rule in ROPE_SCHEMA.items():
        if params.get(key) is not None:
            problem = rule.problem(params[key])
            if problem:
                return f"{where}.{key}", problem
    if params.get("rope_type") is not None and params.get("type") is not None and \
            params["rope_type"] != params["type"]:
        return f"{where}.rope_type", (f"{params['rope_type']!r} disagrees with {where}.type {params['type']!r} "
                                      "(the same setting twice; keep one)")
    rope_type = params.get("rope_type") or params.get("type") or "default"
    if rope_type in YARN_TYPES:
        for key in ("factor", "original_max_position_embeddings"):
            if params.get(key) is None:
                return f"{where}.{key}", f"missing; {rope_type} RoPE scaling needs it"
    return None


def validate_config(config: Any, source: str = "config.json") -> None:
    """Raise :class:`ConfigError` (``source: key: problem``) unless ``config`` fits the schema."""
    if not isinstance(config, Mapping):
        raise ConfigError(f"{source}: expected a JSON object {{...}} at the top, got {_show(config)}")
    model_type = config.get("model_type")
    if model_type not in MODEL_TYPES:
        got = "no model_type" if model_type is None else f"unknown model_type {model_type!r}"
        raise ConfigError(f"{source}: {got}; supported: {', '.join(MODEL_TYPES)} "
                          "(DeepSeek-V3/R1, Kimi-K2, DeepSeek-V3.2, GLM-5.x)")
    missing = [k for k, spec in SCHEMA.items() if spec.required and config.get(k) is None]
    if missing:
        raise ConfigError(f"{source}: missing required key{'s' if len(missing) > 1 else ''} {', '.join(missing)} "
                          f"(model_type {model_type!r})")
    for key, spec in SCHEMA.items():
        if model_type in spec.families and config.get(key) is not None:
            problem = spec.rule.problem(config[key])
            if problem:
                raise ConfigError(f"{source}: {key}: {problem}")
    _check_architectures(config, source)
    rope = _check_rope(config)
    if rope is not None:
        raise ConfigError(f"{source}: {rope[0]}: {rope[1]}")
    c = _Config(config)
    for rule in RULES:
        problem = rule(c)
        if problem:
            raise ConfigError(f"{source}: {problem}")


def check_against_shards(config: Mapping, names, source: str, shards_dir: str) -> None:
    """config.json's layer and expert counts against the tensor names the shards hold, so that a
    count that is off names its key (and what the shards hold) instead of only the first tensor
    it makes missing or unused. Holes inside the held range are left to the weight table, which
    names the missing tensor."""
    import re

    layer_re = re.compile(r"^model\.layers\.(\d+)\.")
    expert_re = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.")
    layers: set[int] = set()
    mtp: set[int] = set()
    experts: dict[int, set] = {}
    for name in names:
        m = layer_re.match(name)
        if not m:
            continue
        i = int(m.group(1))
        layers.add(i)
        if name.endswith(".eh_proj.weight"):
            mtp.add(i)
        e = expert_re.match(name)
        if e:
            experts.setdefault(i, set()).add(int(e.group(2)))
    if not layers:
        return  # nothing to compare: the weight table names the first missing tensor
    n = config["num_hidden_layers"]
    mtp_slots = set(range(n, n + (config.get("num_nextn_predict_layers") or 0)))
    held = sorted(layers)
    main = [i for i in held if i < n]
    if main and main == list(range(len(main))) and len(main) < n:
        raise ConfigError(f"{shards_dir}: missing tensors of layers {len(main)}..{n - 1}: the shards hold layers "
                          f"{_ranges(held)}, {source} has num_hidden_layers={n} (a partial conversion, or a wrong "
                          "num_hidden_layers?)")
    extra = [i for i in held if i >= n and i not in mtp and i not in mtp_slots]
    if extra and extra == list(range(extra[0], extra[-1] + 1)) and extra[0] <= n + len(mtp_slots):
        raise ConfigError(f"{shards_dir}: tensors not used by this config.json: layer {_ranges(extra)} "
                          f"(model.layers.{extra[0]}.*) is past num_hidden_layers={n} in {source}; is "
                          f"num_hidden_layers {extra[-1] + 1}?")
    _check_layer_kinds(config, set(names), n, source, shards_dir)
    E = config["n_routed_experts"]
    for i in sorted(experts):
        found = sorted(experts[i])
        if i >= n or found != list(range(len(found))) or len(found) == E:
            continue
        what = "missing tensors of experts" if len(found) < E else "tensors not used by this config.json: experts"
        span = f"{len(found)}..{E - 1}" if len(found) < E else f"{E}..{len(found) - 1}"
        raise ConfigError(f"{shards_dir}: {what} {span} of layer {i}: the shards hold {len(found)} experts a layer, "
                          f"{source} has n_routed_experts={E}")


def _check_layer_kinds(config: Mapping, names: set, n: int, source: str, shards_dir: str) -> None:
    """Keys that choose which tensors a layer has, against what layer 0.. hold: the query
    projection (q_lora_rank), biases (attention_bias), dense or MoE MLP (first_k_dense_replace /
    mlp_layer_types), shared experts (n_shared_experts)."""
    p0 = "model.layers.0.self_attn."
    low_rank, full = p0 + "q_a_proj.weight" in names, p0 + "q_proj.weight" in names
    if config.get("q_lora_rank") is None and low_rank and not full:
        raise ConfigError(f"{source}: q_lora_rank is null (a full-rank q_proj), but the shards in {shards_dir} hold "
                          "q_a_proj / q_b_proj (low-rank queries): set q_lora_rank to q_a_proj's rank")
    if config.get("q_lora_rank") is not None and full and not low_rank:
        raise ConfigError(f"{source}: q_lora_rank={config['q_lora_rank']} (low-rank queries), but the shards in "
                          f"{shards_dir} hold a full-rank q_proj: set q_lora_rank to null")
    bias = p0 + "kv_a_proj_with_mqa.bias"
    if config.get("attention_bias") and low_rank | full and bias not in names:
        raise ConfigError(f"{source}: attention_bias is true, but the shards in {shards_dir} hold no attention "
                          f"biases ({bias}): set attention_bias to false")
    if config.get("mlp_layer_types") is not None:
        key, sparse = "mlp_layer_types", [t == "sparse" for t in config["mlp_layer_types"]]
    else:
        k = min(config.get("first_k_dense_replace") or 0, n)
        key, sparse = "first_k_dense_replace", [i >= k for i in range(n)]
    for i in range(n):
        p = f"model.layers.{i}.mlp."
        dense_held, moe_held = p + "gate_proj.weight" in names, p + "gate.weight" in names
        if dense_held == moe_held or sparse[i] == moe_held:
            continue
        held, want = ("a dense MLP", "MoE") if dense_held else ("MoE experts", "dense")
        raise ConfigError(f"{source}: {key}={_short(config.get(key))} makes layer {i} {want}, but the shards in "
                          f"{shards_dir} hold {held} there")
    shared = config.get("n_shared_experts")
    shared = 1 if shared is None else shared  # ModelArgs' default
    for i in range(n):
        p = f"model.layers.{i}.mlp."
        if p + "gate.weight" not in names:
            continue
        held = p + "shared_experts.gate_proj.weight" in names
        if held != bool(shared):
            raise ConfigError(f"{source}: n_shared_experts={shared}, but the shards in {shards_dir} hold "
                              f"{'a' if held else 'no'} shared expert in layer {i}")
        break


def _short(value) -> str:
    import json

    text = json.dumps(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _ranges(ids: list[int]) -> str:
    """[0, 1, 2, 5] -> '0..2, 5'."""
    out, start = [], None
    for j, i in enumerate(ids):
        if start is None:
            start = i
        if j + 1 == len(ids) or ids[j + 1] != i + 1:
            out.append(f"{start}" if start == i else f"{start}..{i}")
            start = None
    text = ", ".join(out[:6])
    return text + (", ..." if len(out) > 6 else "")
