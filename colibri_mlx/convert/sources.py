"""Checkpoint shards in, float32 weights out.

Shards are memory-mapped behind the container's strict header parser (the `safetensors`
numpy API has no float8 dtypes), with the dequantizers for every input the converter accepts (docs/convert.md):
BF16 / F16 / F32, FP8 e4m3 with 128x128 block scales (f32 or UE8M0), and NVFP4 (modelopt).
All decoding is table-driven numpy and reproduces upstream's torch arithmetic exactly:
one float32 product per scale, in upstream's order.
"""

from __future__ import annotations

import mmap
import os

import numpy as np

from ..container.reader import E4M3FN, to_float32
from ..container.safetensors_reader import DTYPES, TensorInfo, read_shard_header
from .classify import ConvertError

FP8_BLOCK = 128
NVFP4_GROUP = 16

_PLAIN_FLOATS = ("F32", "F16", "BF16")


# e2m1: 1 sign, 2 exponent, 1 mantissa bits; bit 3 is the sign.
E2M1 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0,
                 -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0], dtype=np.float32)


class SafetensorsShard:
    """One checkpoint shard: header validated up front (container's strict parser), tensors
    handed out as read-only memory-mapped views in their storage dtype."""

    def __init__(self, path: str):
        self.path = os.fspath(path)
        self.header = read_shard_header(self.path)
        self.tensors = self.header.tensors
        for info in self.tensors.values():
            if info.nbytes != info.numel * info.itemsize:  # the container parser lets U8 be unshaped
                raise ConvertError(f"{self.path}: tensor {info.name!r}: {info.dtype}{list(info.shape)} needs "
                                   f"{info.numel * info.itemsize} bytes, header gives {info.nbytes}")
            if info.offset + info.nbytes > self.header.file_size:
                raise ConvertError(f"{self.path}: tensor {info.name!r} ends at byte {info.offset + info.nbytes} "
                                   f"but the file has {self.header.file_size} (truncated download?)")
        with open(self.path, "rb") as fh:
            size = self.header.file_size
            self._map = mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) if size else None

    def names(self) -> list[str]:
        return sorted(self.tensors)  # the order safetensors' safe_open.keys() gives upstream

    def __contains__(self, name: str) -> bool:
        return name in self.tensors

    def info(self, name: str) -> TensorInfo:
        try:
            return self.tensors[name]
        except KeyError:
            raise ConvertError(f"{self.path}: tensor {name!r} not found") from None

    def raw(self, name: str) -> np.ndarray:
        """Read-only view in the storage dtype (float8 and BF16 as unsigned integers)."""
        info = self.info(name)
        dtype = DTYPES[info.dtype].storage
        if info.nbytes == 0:
            return np.zeros(info.shape, dtype)
        return np.frombuffer(self._map, dtype, info.numel, info.offset).reshape(info.shape)

    def close(self):
        if self._map is not None:
            self._map.close()
            self._map = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


class WeightSource:
    """How one named weight is turned into float32 rows, chosen once from its dtype and siblings."""

    def __init__(self, shard: SafetensorsShard, name: str):
        self.shard, self.name = shard, name
        info = shard.info(name)
        self.dtype = info.dtype
        if info.dtype == "U8" and name + "_scale" in shard:
            self.kind = "nvfp4"
            self.shape = self._check_nvfp4(info)
        elif info.dtype == "F8_E4M3":
            self.kind = "fp8"
            self.shape = info.shape
            self._check_fp8(info)
        elif info.dtype in _PLAIN_FLOATS:
            self.kind = "float"
            self.shape = info.shape
        else:
            # Upstream would cast these bytes to float; that is never a weight we understand.
            hint = " (an NVFP4 weight needs a '<name>_scale' sibling)" if info.dtype == "U8" else ""
            raise self._fail(f"dtype {info.dtype} is not a supported weight encoding{hint}")

    def _fail(self, what: str) -> ConvertError:
        return ConvertError(f"{self.shard.path}: tensor {self.name!r}: {what}")

    def _sibling(self, suffix: str, what: str) -> TensorInfo:
        if self.name + suffix not in self.shard:
            raise self._fail(f"{what} '{self.name}{suffix}' is missing from this shard")
        return self.shard.info(self.name + suffix)

    def _check_fp8(self, info: TensorInfo):
        if len(info.shape) != 2:
            raise self._fail(f"FP8 weight must be 2-D, got shape {list(info.shape)}")
        scale = self._sibling("_scale_inv", "FP8 block scale")
        O, I = info.shape
        want = (-(-O // FP8_BLOCK), -(-I // FP8_BLOCK))
        if scale.shape != want:
            raise self._fail(f"block scale '{scale.name}' has shape {list(scale.shape)}, expected "
                             f"{list(want)} = ceil([{O}, {I}] / {FP8_BLOCK})")
        if scale.dtype not in ("F32", "BF16", "F16", "F8_E8M0"):
            raise self._fail(f"block scale '{scale.name}' has dtype {scale.dtype}; expected F32 or F8_E8M0")

    def _check_nvfp4(self, info: TensorInfo) -> tuple:
        if len(info.shape) != 2:
            raise self._fail(f"NVFP4 weight must be 2-D [O, I/2], got shape {list(info.shape)}")
        O, I = info.shape[0], info.shape[1] * 2
        block = self._sibling("_scale", "NVFP4 block scale")
        glob = self._sibling("_scale_2", "NVFP4 global scale")
        want = (O, -(-I // NVFP4_GROUP))
        if block.shape != want or block.dtype != "F8_E4M3":
            # A padded or swizzled (cutlass) scale layout would silently misalign.
            raise self._fail(f"block scale '{block.name}' is {block.dtype}{list(block.shape)}, expected "
                             f"F8_E4M3{list(want)} (one scale per {NVFP4_GROUP} inputs, unswizzled)")
        if glob.dtype != "F32" or int(np.prod(glob.shape, dtype=np.int64)) != 1:
            raise self._fail(f"global scale '{glob.name}' is {glob.dtype}{list(glob.shape)}, expected one F32")
        g = float(self.shard.raw(glob.name).reshape(-1)[0])
        if not g < 1.0:
            # modelopt stores a small global and multiplies; compressed-tensors stores the
            # reciprocal and divides. Refuse instead of silently corrupting every tensor.
            raise self._fail(f"global scale '{glob.name}' = {g:.4g} >= 1 looks like the compressed-tensors "
                             "reciprocal convention; only NVIDIA modelopt NVFP4 (multiply) is supported")
        return (O, I)

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def read(self) -> np.ndarray:
        """The whole tensor as float32 (any shape)."""
        if self.kind == "float" and self.ndim != 2:
            return self._plain(self.shard.raw(self.name))
        return self.rows(0, self.shape[0])

    def rows(self, r0: int, r1: int) -> np.ndarray:
        """float32 rows [r0, r1) of a 2-D weight. For FP8, r0 must be a multiple of 128."""
        if self.kind == "float":
            return self._plain(self.shard.raw(self.name)[r0:r1])
        if self.kind == "fp8":
            return self._fp8_rows(r0, r1)
        return self._nvfp4_rows(r0, r1)

    def _plain(self, raw: np.ndarray) -> np.ndarray:
        return to_float32(raw, self.dtype)

    def _scale_f32(self, name: str) -> np.ndarray:
        return to_float32(self.shard.raw(name), self.shard.info(name).dtype)

    def _fp8_rows(self, r0: int, r1: int) -> np.ndarray:
        if r0 % FP8_BLOCK:
            raise ValueError(f"FP8 row blocks must start on a multiple of {FP8_BLOCK}, got {r0}")
        I = self.shape[1]
        w = E4M3FN[self.shard.raw(self.name)[r0:r1]]
        scale = self._scale_f32(self.name + "_scale_inv")[r0 // FP8_BLOCK: -(-r1 // FP8_BLOCK)]
        scale = np.repeat(np.repeat(scale, FP8_BLOCK, axis=0), FP8_BLOCK, axis=1)[: r1 - r0, :I]
        return w * scale  # "scale_inv" is a multiplier (upstream `dequant`)

    def _nvfp4_rows(self, r0: int, r1: int) -> np.ndarray:
        packed = self.shard.raw(self.name)[r0:r1]
        codes = np.empty((packed.shape[0], self.shape[1]), np.uint8)
        codes[:, 0::2] = packed & 0x0F  # even element in the low nibble
        codes[:, 1::2] = packed >> 4
        block = E4M3FN[self.shard.raw(self.name + "_scale")[r0:r1]]
        block = np.repeat(block, NVFP4_GROUP, axis=1)[:, : self.shape[1]]
        glob = self._scale_f32(self.name + "_scale_2").reshape(-1)[0]
        return (E2M1[codes] * block) * glob  # upstream: (w4 * sc) * gscale, each rounded to f32
