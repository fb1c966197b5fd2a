"""Named option mixes (`--recipe`) and the resolution of options into a BitPlan.

Precedence: an option given on the command line > the recipe > upstream's default.
Measured size and error of each recipe: docs/convert.md (scripts/convert/measure_recipes.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from .classify import BITS_MAP_KINDS, E8, BitPlan, ConvertError, parse_bits

# Upstream's defaults (convert_fp8_to_int4.py @20b6143); ebits is 8 for --mtp/--indexer.
UPSTREAM_DEFAULTS = {"ebits": 4, "io_bits": 8, "group_size": 64}
PASS_EBITS = {"main": 4, "mtp": 8, "indexer": 8}

BIT_OPTIONS = ("ebits", "io_bits", "xbits", "shared_bits", "o_bits", "kvb_bits", "attn_bits",
               "dmlp_bits", "gate_bits", "up_bits", "down_bits")
_KIND_OPTION = dict(zip(BITS_MAP_KINDS, ("shared_bits", "o_bits", "kvb_bits", "attn_bits", "dmlp_bits")))
_PROJ_OPTION = {"gate_proj": "gate_bits", "up_proj": "up_bits", "down_proj": "down_bits"}


@dataclass(frozen=True)
class Recipe:
    name: str
    summary: str
    options: dict


RECIPES = {r.name: r for r in (
    Recipe("default", "int4 g64 for every matrix, int8 embed/lm_head (upstream's default container)",
           {"ebits": 4, "io_bits": 8, "group_size": 64}),
    Recipe("e8x4g64", "int8 per-row spine, int4 g64 routed experts (upstream's 'wq-v0' class)",
           {"ebits": 8, "io_bits": 8, "xbits": 4, "group_size": 64}),
    Recipe("wq-v0", "alias of e8x4g64",
           {"ebits": 8, "io_bits": 8, "xbits": 4, "group_size": 64}),
    Recipe("e8", "E8/IQ3 lattice (fmt 6, 3.06 bits/weight) routed experts, int4 g64 elsewhere",
           {"ebits": 4, "io_bits": 8, "xbits": E8, "group_size": 64}),
    Recipe("e8-int8", "E8/IQ3 lattice routed experts, int8 per-row spine",
           {"ebits": 8, "io_bits": 8, "xbits": E8, "group_size": 64}),
    Recipe("int3-up", "default, with routed up_proj in int3 g64 (fmt 5)",
           {"ebits": 4, "io_bits": 8, "group_size": 64, "up_bits": 3}),
    Recipe("int8", "int8 per-row everywhere (reference quality, ~2x the default's size)",
           {"ebits": 8, "io_bits": 8, "group_size": 64}),
    Recipe("row4", "legacy per-row int4 (fmt 2); measurably worse than g64, kept for comparison",
           {"ebits": 4, "io_bits": 8, "group_size": 0}),
)}


def resolve_plan(options: dict, recipe: Optional[str] = None, mode: str = "main",
                 n_layers: int = 78) -> BitPlan:
    """Options (None = not given) -> BitPlan, applying recipe and upstream defaults."""
    given = {k: v for k, v in options.items() if v is not None}
    unknown = set(given) - set(BIT_OPTIONS) - {"group_size"}
    if unknown:
        raise ConvertError(f"unknown conversion options {sorted(unknown)}")
    values = dict(UPSTREAM_DEFAULTS, ebits=PASS_EBITS[mode])
    if recipe is not None:
        if recipe not in RECIPES:
            raise ConvertError(f"unknown recipe {recipe!r}; choose one of {', '.join(RECIPES)}")
        if mode != "main":
            # Recipes describe the main model; the MTP head at int4 drafts nothing (upstream #8).
            raise ConvertError(f"--recipe applies to the main pass only; the --{mode} pass defaults to "
                               "int8 (pass bit options explicitly to change it)")
        values.update(RECIPES[recipe].options)
    values.update(given)
    for key in BIT_OPTIONS:
        if key in values:
            try:
                values[key] = parse_bits(values[key])
            except ConvertError as e:  # name the flag (or the recipe) that gave the value
                where = f"--{key.replace('_', '-')}" if key in given else f"--recipe {recipe}"
                raise ConvertError(f"{where}: {e}") from None
    ebits = values["ebits"]
    return BitPlan(
        ebits=ebits,
        io_bits=values["io_bits"],
        xbits=values.get("xbits", ebits),
        group_size=int(values["group_size"]),
        n_layers=int(n_layers),
        bits_map={kind: values[opt] for kind, opt in _KIND_OPTION.items() if opt in values},
        proj_bits={proj: values[opt] for proj, opt in _PROJ_OPTION.items() if opt in values},
    )


def describe(plan: BitPlan, mode: str) -> str:
    """One line like upstream's [PLAN], printed before any work starts."""
    from .classify import format_for
    from ..formats import FMT_NAMES

    def fmt(bits):
        f, gs = format_for(bits, plan.group_size)
        return f"{bits}-bit -> fmt {f} {FMT_NAMES[f]}" + (f" gs{gs}" if gs else "")

    parts = [f"mode {mode}", f"n_layers {plan.n_layers}", f"ebits {fmt(plan.ebits)}",
             f"io {fmt(plan.io_bits)}", f"experts {fmt(plan.xbits)}"]
    parts += [f"{kind} {fmt(bits)}" for kind, bits in sorted(plan.bits_map.items())]
    parts += [f"experts.{proj} {fmt(bits)}" for proj, bits in plan.proj_bits.items()]
    return "[plan] " + " | ".join(parts)

