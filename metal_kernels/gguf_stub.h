// gguf_stub.h: what qdecode.h calls of gguf_decode.h's decoders, for the launches of every other
// format: dispatch.decode_header puts it after gguf_decode.h's unit sizes instead of the decoders,
// so those kernels' text stays short (MLX builds and hashes a kernel's whole text on every call).
// A GGUF FMT launched with it does not compile. CUDA twin: cuda/gguf_stub.cuh.

template <int FMT>
inline void qd_gg_load(const device uint8_t* wrow, int u, thread uint* r) {
  static_assert(!qd_gguf(FMT), "GGUF FMT without gguf_decode");
}

template <int FMT>
inline float2 qd_gg_seg_affine(thread const uint* r, int g) {
  static_assert(!qd_gguf(FMT), "GGUF FMT without gguf_decode");
  return float2(1.0f, 0.0f);
}

template <int FMT>
inline void qd_gg_codes8(thread const uint* r, int k0, const device uint* lut, thread float* q) {
  static_assert(!qd_gguf(FMT), "GGUF FMT without gguf_decode");
}

template <int FMT>
inline void qd_gg_decode8(thread const uint* r, int k0, const device uint* lut, thread float* q) {
  static_assert(!qd_gguf(FMT), "GGUF FMT without gguf_decode");
}

template <int FMT, int S, int ROWS, int XV, int W, typename T, int XP = 0, int NIB = 0>
inline void qd_seg_dots_gguf(thread const uint (*raw)[W], const device T* x, thread const int* xoff,
                             uint xmask, int I, int u, int g, const device uint* lut, thread float (*d)[S]) {
  static_assert(!qd_gguf(FMT), "GGUF FMT without gguf_decode");
}
