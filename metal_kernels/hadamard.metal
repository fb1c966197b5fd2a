// hadamard: the fmt 6 input rotation Q^T x along the last axis of x [N, n] (FORMAT.md §3.6),
// exactly upstream's tiling and sign stream (colibri_mlx.formats.e8.block_tiling, sign_bits):
// per power-of-two block b: negate where the block's sign bit is 1, in-place Walsh-Hadamard
// butterflies at stride 1, 2, 4, ..., multiply by 1/sqrt(b). Output float32.
//
// Launch (colibri_mlx/kernels/moe.py rotate): one threadgroup per (block, row),
// grid = (TG * n_blocks, N, 1), threadgroup = (TG, 1, 1). The block lives in threadgroup
// memory (MAXB floats, MAXB = the largest block, <= 4096 so it fits Metal's 32 KB) and every
// butterfly stage ends with a barrier.
//
// blocks (int32, >= 8 elements): per block (offset, size, first sign byte); signs: the sign
// bytes of every block, LSB first. params (int32[8]): n, n_blocks, 0...
// The CUDA twin is metal_kernels/cuda/hadamard.cu.

// ==== kernel body ====
  threadgroup float buf[MAXB];
  const int n = params[0];
  const int blk = int(threadgroup_position_in_grid.x);
  const int row = int(threadgroup_position_in_grid.y);
  const int tid = int(thread_position_in_threadgroup.x);
  const int off = blocks[3 * blk];
  const int b = blocks[3 * blk + 1];
  const int soff = blocks[3 * blk + 2];
  const device T* xr = x + size_t(row) * n + off;
  for (int i = tid; i < b; i += TG) {
    const float v = float(xr[i]);
    buf[i] = ((signs[soff + (i >> 3)] >> (i & 7)) & 1) ? -v : v;
  }
  threadgroup_barrier(mem_flags::mem_threadgroup);
  for (int hs = 1; hs < b; hs <<= 1) {
    for (int p = tid; p < (b >> 1); p += TG) {
      const int i = (p / hs) * 2 * hs + (p % hs);
      const float u = buf[i];
      const float v = buf[i + hs];
      buf[i] = u + v;
      buf[i + hs] = u - v;
    }
    threadgroup_barrier(mem_flags::mem_threadgroup);
  }
  const float root = sqrt(float(b));
  device float* yr = y + size_t(row) * n + off;
  for (int i = tid; i < b; i += TG) {
    yr[i] = buf[i] / root;
  }
