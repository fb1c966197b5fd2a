"""Read and write colibri containers: directories of safetensors shards (docs/format.md).

Public surface: ``Container`` (lazy, strictly validated reader), ``write_shard`` (atomic,
upstream-compatible writer), ``expected_shapes`` (config.json -> [O, I] of every 2-D weight),
``tensor_class``, ``ContainerError``.
"""

from .reader import Container, to_float32
from .safetensors_reader import ContainerError, ShardHeader, TensorInfo, parse_shard, read_shard_header
from .shapes import TENSOR_CLASSES, expected_shapes, expert_key, tensor_class
from .writer import STAMP_KEY, RawTensor, write_shard

__all__ = [
    "Container", "ContainerError", "RawTensor", "STAMP_KEY", "ShardHeader", "TENSOR_CLASSES", "TensorInfo",
    "expected_shapes", "expert_key", "parse_shard", "read_shard_header", "tensor_class", "to_float32",
    "write_shard",
]
