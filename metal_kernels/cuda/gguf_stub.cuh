// gguf_stub.cuh: CUDA twin of metal_kernels/gguf_stub.h: gguf_decode.cuh's decoders for the
// launches of every other format (their kernel text stays short); a GGUF FMT does not compile.

template <int FMT, bool A16 = false>
__device__ __forceinline__ void gg_load(const uint8_t* wrow, int u, uint32_t* r) {
  static_assert(!gguf(FMT), "GGUF FMT without gguf_decode");
}

template <int FMT>
__device__ __forceinline__ float2 gg_seg_affine(const uint32_t* r, int g) {
  static_assert(!gguf(FMT), "GGUF FMT without gguf_decode");
  return make_float2(1.0f, 0.0f);
}

template <int FMT>
__device__ __forceinline__ void gg_codes8(const uint32_t* r, int k0, const uint32_t* lut, float* q) {
  static_assert(!gguf(FMT), "GGUF FMT without gguf_decode");
}

template <int FMT>
__device__ __forceinline__ void gg_decode8(const uint32_t* r, int k0, const uint32_t* lut, float* q) {
  static_assert(!gguf(FMT), "GGUF FMT without gguf_decode");
}

template <int FMT, int S, int ROWS, int XV, int W, typename T, int XP = 0, int NIB = 0>
__device__ __forceinline__ void seg_dots_gguf(const uint32_t (*raw)[W], const T* x, const int* xoff,
                                              uint32_t xmask, int I, int u, int g, const uint32_t* lut,
                                              float (*d)[S]) {
  static_assert(!gguf(FMT), "GGUF FMT without gguf_decode");
}

}  // namespace colibri_qd
