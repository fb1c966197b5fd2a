"""Hot paths behind small functions: qmatmul, moe_block, mla_decode.

PLACEHOLDER until the kernel framework lands: qmatmul multiplies float weights directly and
dequantizes a QTensor through the numpy codec. The kernel helper replaces this module.
"""

from __future__ import annotations

import mlx.core as mx

from ..formats.qtensor import QTensor


def qmatmul(x: mx.array, w) -> mx.array:
    if isinstance(w, QTensor):
        w = mx.array(w.dequantize()).astype(x.dtype)
    return x @ w.T
