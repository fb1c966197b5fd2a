"""colibri's quantized tensor formats fmt 0–6 (and MLX's fmt 7–10, formats/mlx_quant.py; GGUF's fmt 11–28,
formats/gguf_quant.py): byte counts, detection, numpy codecs.

Public surface (docs/format.md#formats): ``FMT_NAMES``, ``GS_CANDIDATES``, ``weight_nbytes``,
``scale_nbytes``, ``encode``, ``decode``, ``detect_format`` (upstream's exact rule),
``possible_formats`` / ``resolve_format`` (our rule), ``FormatError``, ``QTensor``.
"""

from .codecs import (
    DEFAULT_GS,
    FMT_BY_NAME,
    FMT_NAMES,
    GS_CANDIDATES,
    FormatError,
    codec,
    decode,
    encode,
    scale_nbytes,
    weight_nbytes,
)
from .detect import Resolution, detect_format, possible_formats, resolve_format
from .mlx_quant import MLX_FMT_NAMES, MLX_MODES, qtensor_from_mlx
from .qtensor import QTensor

__all__ = [
    "DEFAULT_GS", "FMT_BY_NAME", "FMT_NAMES", "GS_CANDIDATES", "FormatError", "MLX_FMT_NAMES",
    "MLX_MODES", "QTensor", "qtensor_from_mlx",
    "Resolution", "codec", "decode", "detect_format", "encode", "possible_formats",
    "resolve_format", "scale_nbytes", "weight_nbytes",
]
