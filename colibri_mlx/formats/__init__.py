"""colibri's quantized tensor formats fmt 0–6: byte counts, detection, numpy codecs.

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
from .qtensor import QTensor

__all__ = [
    "DEFAULT_GS", "FMT_BY_NAME", "FMT_NAMES", "GS_CANDIDATES", "FormatError", "QTensor",
    "Resolution", "codec", "decode", "detect_format", "encode", "possible_formats",
    "resolve_format", "scale_nbytes", "weight_nbytes",
]
