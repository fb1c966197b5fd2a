import os

# MLX runs float32 matmuls at TF32 precision on CUDA tensor cores (and on M5 NAX) unless this is
# 0 (mlx#3860); our parity tests compare float32 logits at 1e-4, so pin full precision, as MLX's
# own test harness does. Must be set before the first MLX operation.
os.environ["MLX_ENABLE_TF32"] = "0"
