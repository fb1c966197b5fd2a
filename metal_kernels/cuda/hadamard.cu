// hadamard, CUDA twin of metal_kernels/hadamard.metal: one block per (rotation block, row),
// the block in shared memory, sign flip, butterflies at stride 1, 2, 4, ... with a
// __syncthreads() after each stage, divide by sqrt(b). Output float32.

// ==== kernel body ====
  __shared__ float buf[MAXB];
  const int n = params[0];
  const int blk = int(blockIdx.x);
  const int row = int(blockIdx.y);
  const int tid = int(threadIdx.x);
  const int off = blocks[3 * blk];
  const int b = blocks[3 * blk + 1];
  const int soff = blocks[3 * blk + 2];
  const T* xr = x + size_t(row) * n + off;
  for (int i = tid; i < b; i += TG) {
    const float v = static_cast<float>(xr[i]);
    buf[i] = ((signs[soff + (i >> 3)] >> (i & 7)) & 1) ? -v : v;
  }
  __syncthreads();
  for (int hs = 1; hs < b; hs <<= 1) {
    for (int p = tid; p < (b >> 1); p += TG) {
      const int i = (p / hs) * 2 * hs + (p % hs);
      const float u = buf[i];
      const float v = buf[i + hs];
      buf[i] = u + v;
      buf[i + hs] = u - v;
    }
    __syncthreads();
  }
  const float root = sqrtf(float(b));
  float* yr = y + size_t(row) * n + off;
  for (int i = tid; i < b; i += TG) {
    yr[i] = buf[i] / root;
  }
