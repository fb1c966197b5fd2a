"""What each checkpoint tensor becomes: its kind, its bit width, its container format.

Mirrors upstream's converter (`c/tools/convert_fp8_to_int4.py`: `classify`, the bits
resolution in `convert_shard`, `main`'s PROJ_BITS / bits_map); see docs/convert.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional, Union

E8 = "e8"  # a bits value that is not a width: selects fmt 6 (routed experts only)
Bits = Union[int, str]

# The three conversion passes; each writes its own shard prefix and progress manifest.
MODES = ("main", "mtp", "indexer")
SHARD_PREFIX = {"main": "out-", "mtp": "out-mtp-", "indexer": "out-idx-"}

# kind -> (what it is, which option sets its bits). "consumed" and "skip" are never written.
KINDS = {
    "consumed": "block/global scale folded into its weight",
    "skip": "not part of this pass (MTP layer, DSA indexer, ...)",
    "f32": "norm, router, bias: kept float32",
    "io": "embed_tokens / lm_head (--io-bits)",
    "x": "routed expert projection (--xbits, --gate/up/down-bits)",
    "sh": "shared expert (--shared-bits)",
    "o": "attention o_proj (--o-bits)",
    "kvb": "attention kv_b_proj (--kvb-bits)",
    "attn": "attention q_a/q_b/kv_a (--attn-bits)",
    "dmlp": "dense-layer MLP (--dmlp-bits)",
    "q": "any other weight (--ebits)",
}
QUANTIZED_KINDS = ("io", "x", "sh", "o", "kvb", "attn", "dmlp", "q")
BITS_MAP_KINDS = ("sh", "o", "kvb", "attn", "dmlp")  # kinds with their own override option
EXPERT_PROJECTIONS = ("gate_proj", "up_proj", "down_proj")

_SCALE_SUFFIXES = ("_scale_inv", ".weight_scale", ".weight_scale_2", ".input_scale")
_MAIN_SKIP_PARTS = ("indexer", "indexers_proj", "eh_proj", "enorm", "hnorm", "shared_head")
_ATTN_SUFFIXES = ("q_a_proj.weight", "q_b_proj.weight", "kv_a_proj_with_mqa.weight")
_DENSE_MLP_SUFFIXES = ("mlp.gate_proj.weight", "mlp.up_proj.weight", "mlp.down_proj.weight")
SUPPORTED_BITS = (2, 3, 4, 8, E8)


class ConvertError(ValueError):
    """A conversion that cannot proceed; the message names the file/tensor and the fix."""


def layer_index(name: str) -> int:
    """``model.layers.<i>.…`` -> i, anything else -> -1."""
    parts = name.split(".")
    if len(parts) > 2 and parts[0] == "model" and parts[1] == "layers":
        try:
            return int(parts[2])
        except ValueError:
            return -1
    return -1


def classify(name: str, n_layers: int, mode: str = "main") -> str:
    """Upstream's `classify`, rule for rule (the order matters: first match wins)."""
    if name.endswith(_SCALE_SUFFIXES):
        return "consumed"
    layer = layer_index(name)
    if mode == "indexer":
        if layer < 0 or layer >= n_layers or "indexer" not in name:
            return "skip"
        return "f32" if name.endswith("norm.weight") else "q"
    if mode == "mtp":
        if layer != n_layers or "indexer" in name:
            return "skip"
    else:
        # Layer n_layers is the MTP head, written only by the --mtp pass.
        if layer >= n_layers or any(part in name for part in _MAIN_SKIP_PARTS):
            return "skip"
    if name.endswith("e_score_correction_bias") or name.endswith("mlp.gate.weight"):
        return "f32"
    if name.endswith("norm.weight"):
        return "f32"
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        return "io"
    if ".mlp.experts." in name and name.endswith(".weight"):
        return "x"
    if "shared_experts" in name:
        return "sh"
    if name.endswith("o_proj.weight"):
        return "o"
    if name.endswith("kv_b_proj.weight"):
        return "kvb"
    if name.endswith(_ATTN_SUFFIXES):
        return "attn"
    if name.endswith(_DENSE_MLP_SUFFIXES):
        return "dmlp"
    return "q" if name.endswith(".weight") else "f32"


def parse_bits(value) -> Bits:
    """CLI value -> 2/3/4/8 or "e8"."""
    if isinstance(value, str) and value.strip().lower() == E8:
        return E8
    try:
        bits = int(value)
    except (TypeError, ValueError):
        raise ConvertError(f"bits must be one of 2, 3, 4, 8 or e8, got {value!r}") from None
    if bits not in SUPPORTED_BITS:
        # Upstream would feed 5..7 to its int8 quantizer with a narrower range and 16 to a
        # clip that wraps around int8; neither is a format anyone asked for.
        raise ConvertError(f"bits must be one of 2, 3, 4, 8 or e8, got {bits}")
    return bits


def format_for(bits: Bits, group_size: int) -> tuple[int, Optional[int]]:
    """Upstream's bits -> (fmt, gs) priority order (docs/convert.md)."""
    if bits == E8:
        return 6, None
    if bits == 3:
        return 5, None
    if group_size > 0 and bits <= 4:
        if bits != 4:
            # Upstream writes ternary codes into an int4-grouped tensor here (qmax=1); our
            # fmt 4 codec is the int4 one, so refuse rather than write something else.
            raise ConvertError(f"{bits}-bit weights with --group-size {group_size} are not "
                               "supported; use --group-size 0 for int2-row (fmt 3)")
        return 4, group_size
    if bits <= 2:
        return 3, None
    if bits <= 4:
        return 2, None
    return 1, None


@dataclass(frozen=True)
class BitPlan:
    """Resolved bit widths; `params()` is the record the progress manifest compares."""

    ebits: int = 4
    io_bits: int = 8
    xbits: Bits = 4
    group_size: int = 64
    n_layers: int = 78
    bits_map: dict = field(default_factory=dict)   # kind -> bits, for BITS_MAP_KINDS
    proj_bits: dict = field(default_factory=dict)  # "up_proj" -> bits, routed experts only

    def __post_init__(self):
        self._check_group_size()
        effective = [self.proj_bits.get(p, self.xbits) for p in EXPERT_PROJECTIONS]
        # Upstream: gate and up share one rotated input in the engine, so e8 is all or none.
        if any(b == E8 for b in effective) and not all(b == E8 for b in effective):
            raise ConvertError(f"e8 covers all three expert projections or none (got {effective}); "
                               "use --xbits e8, or none of the e8 flags")
        for kind, bits in self.bits_map.items():
            if bits == E8:
                raise ConvertError(f"e8 (fmt 6) is for routed experts only, not for {kind!r}")
        if self.ebits == E8 or self.io_bits == E8:
            raise ConvertError("e8 (fmt 6) is for routed experts only (--xbits e8)")
        for bits in self._all_bits():
            format_for(bits, self.group_size)

    def _check_group_size(self):
        from ..formats import GS_CANDIDATES

        if self.group_size != 0 and self.group_size not in GS_CANDIDATES:
            # The engine finds gs from the scale count, trying only these candidates.
            raise ConvertError(f"--group-size must be 0 or one of {GS_CANDIDATES}, got {self.group_size}")

    def _all_bits(self):
        return [self.ebits, self.io_bits, self.xbits, *self.bits_map.values(), *self.proj_bits.values()]

    def bits_for(self, kind: str, name: str) -> Bits:
        if kind in self.bits_map:
            bits = self.bits_map[kind]
        else:
            bits = self.io_bits if kind == "io" else self.xbits if kind == "x" else self.ebits
        if kind == "x":
            for proj, proj_bits in self.proj_bits.items():
                if f".{proj}.weight" in name:
                    return proj_bits
        return bits

    def format_for(self, kind: str, name: str) -> tuple[int, Optional[int]]:
        return format_for(self.bits_for(kind, name), self.group_size)

    def params(self) -> dict:
        """Same keys and values as upstream's manifest `params`, so either tool can resume."""
        return {"ebits": self.ebits, "io_bits": self.io_bits, "xbits": self.xbits,
                "group_size": self.group_size, "n_layers": self.n_layers,
                "bits_map": dict(self.bits_map), "proj_bits": dict(self.proj_bits)}
