"""Hugging Face checkpoint (BF16/F16/F32, FP8 block-scaled, NVFP4) -> colibri container.

`convert(outdir, indir=... | repo=..., **options)` is the entry point; docs/convert.md
describes the options and recipes.
"""

from .classify import ConvertError


def convert(*args, **kwargs):
    from .converter import convert as _convert

    return _convert(*args, **kwargs)


__all__ = ["ConvertError", "convert"]
