// Metal Shading Language shim for the MSL simulator: just enough of <metal_stdlib> and MLX's
// kernels/utils.h to compile our kernel sources with clang (C++17, SYCL-device address-space rules)
// and run them on the CPU under tests/msl/runtime.c. See tests/msl/README.md for what is covered.
#pragma once
#include <cstddef>
#include <cstdint>
#include <cstring>
#include <limits>
#include <type_traits>

// Address spaces. clang's SYCL rules make the generic (default) address space a superset of
// global/local/private, so `device`/`threadgroup` objects can call ordinary member functions and
// bind to `thread` references, while two named spaces never convert into each other:
// a `constant` pointer passed where `const device T*` is expected is a compile error, as in Metal.
// `constant` maps to the private space (it must also be usable for program-scope constants).
#define device __attribute__((opencl_global))
#define threadgroup __attribute__((opencl_local))
#define constant __attribute__((opencl_private))
#define thread
#define METAL_FUNC inline __attribute__((always_inline))
#define MSL_TGMEM static __attribute__((section("msl_tgmem"), aligned(16)))
#define MLX_MTL_PRAGMA_UNROLL _Pragma("clang loop unroll(full)")
#define MLX_MTL_CONST static constant constexpr const
#define MLX_MTL_LOOP_UNROLL _Pragma("clang loop unroll(full)")
#ifndef INFINITY
#define INFINITY __builtin_inff()
#endif
#ifndef NAN
#define NAN __builtin_nanf("")
#endif
#ifndef HUGE_VALF
#define HUGE_VALF __builtin_huge_valf()
#endif
#define MAXFLOAT 0x1.fffffep+127f

extern "C" {
struct msl_thread_info {
  uint32_t tpig[3], tptg[3], tgpig[3];
  uint32_t index_in_tg, simd_lane, simd_group;
};
struct msl_dispatch_info {
  uint32_t grid[3], tg[3], tgs_per_grid[3], tg_actual[3];
  uint32_t threads_in_tg, simdgroups_in_tg;
};
extern msl_dispatch_info msl_dispatch;
const msl_thread_info* msl_current_info(void);
void msl_threadgroup_barrier(int site);
void msl_fatal(const char* message) __attribute__((noreturn));
const void* msl_simd_exchange(const void* value, int size, int kind, int site, uint32_t* active);
}

typedef unsigned int uint;
typedef unsigned short ushort;
typedef unsigned char uchar;
typedef unsigned long ulong;
typedef __fp16 half;  // native half arithmetic (-fnative-half-type): every op rounds to half

// bfloat: 16-bit storage, arithmetic through float (round-to-nearest-even on store).
struct bfloat {
  uint16_t bits;
  bfloat() = default;
  bfloat(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
      bits = uint16_t((u >> 16) | 0x40);
    } else {
      bits = uint16_t((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    }
  }
  bfloat(double d) : bfloat(float(d)) {}
  bfloat(int i) : bfloat(float(i)) {}
  bfloat(unsigned i) : bfloat(float(i)) {}
  bfloat(half h) : bfloat(float(h)) {}
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
  bfloat& operator+=(float o) { return *this = bfloat(float(*this) + o); }
  bfloat& operator-=(float o) { return *this = bfloat(float(*this) - o); }
  bfloat& operator*=(float o) { return *this = bfloat(float(*this) * o); }
  bfloat& operator/=(float o) { return *this = bfloat(float(*this) / o); }
};
static_assert(sizeof(bfloat) == 2, "bfloat must be 2 bytes");

// ---- vector types ---------------------------------------------------------------------------
#define MSL_VEC(T)                                            \
  typedef T T##2 __attribute__((ext_vector_type(2)));         \
  typedef T T##3 __attribute__((ext_vector_type(3)));         \
  typedef T T##4 __attribute__((ext_vector_type(4)));
MSL_VEC(float)
MSL_VEC(half)
MSL_VEC(int)
MSL_VEC(uint)
MSL_VEC(short)
MSL_VEC(ushort)
MSL_VEC(char)
MSL_VEC(uchar)
MSL_VEC(long)
MSL_VEC(ulong)
#undef MSL_VEC

namespace metal {
template <class T, int N>
using vec = T __attribute__((ext_vector_type(N)));

template <class T>
struct msl_vec_traits {
  static constexpr bool is_vec = false;
  static constexpr int n = 1;
  using elem = T;
};
template <class T, int N>
struct msl_vec_traits<T __attribute__((ext_vector_type(N)))> {
  static constexpr bool is_vec = true;
  static constexpr int n = N;
  using elem = T;
};
template <class V>
using msl_enable_vec = std::enable_if_t<msl_vec_traits<std::decay_t<V>>::is_vec, int>;

template <class V, class A>
inline void msl_put(V& r, int& k, A a) {
  using E = typename msl_vec_traits<V>::elem;
  if constexpr (msl_vec_traits<A>::is_vec) {
    for (int i = 0; i < msl_vec_traits<A>::n; i++) r[k++] = E(a[i]);
  } else {
    r[k++] = E(a);
  }
}

// Metal vector constructors: float4(x) splat / convert, float4(a, b, c, d), float4(f2, f2), ...
// The simulator rewrites `float4(` in kernel sources to `::metal::msl_vec_make<float4>(`.
template <class V, class... A>
inline V msl_vec_make(A... a) {
  using E = typename msl_vec_traits<V>::elem;
  constexpr int N = msl_vec_traits<V>::n;
  if constexpr (sizeof...(A) == 1) {
    using A0 = std::decay_t<decltype((a, ...))>;
    if constexpr (msl_vec_traits<A0>::is_vec) {
      static_assert(msl_vec_traits<A0>::n == N, "vector conversion needs the same length");
      V r;
      for (int i = 0; i < N; i++) r[i] = E((a, ...)[i]);
      return r;
    } else {
      return V(E((a, ...)));
    }
  } else {
    static_assert((msl_vec_traits<A>::n + ...) == N, "vector constructor: wrong component count");
    V r;
    int k = 0;
    (msl_put(r, k, a), ...);
    return r;
  }
}

// ---- numeric limits -------------------------------------------------------------------------
template <class T>
struct numeric_limits : std::numeric_limits<T> {};
template <>
struct numeric_limits<half> {
  static constexpr half max() { return half(65504.0f); }
  static constexpr half min() { return half(6.103515625e-05f); }
  static constexpr half lowest() { return half(-65504.0f); }
  static constexpr half infinity() { return half(__builtin_inff()); }
  static constexpr half quiet_NaN() { return half(__builtin_nanf("")); }
  static constexpr half epsilon() { return half(0.0009765625f); }
  static constexpr bool has_infinity = true;
};
template <>
struct numeric_limits<bfloat> {
  static bfloat max() { return from_bits(0x7f7f); }
  static bfloat min() { return from_bits(0x0080); }
  static bfloat lowest() { return from_bits(0xff7f); }
  static bfloat infinity() { return from_bits(0x7f80); }
  static bfloat quiet_NaN() { return from_bits(0x7fc0); }
  static bfloat epsilon() { return from_bits(0x3c00); }
  static constexpr bool has_infinity = true;
  static bfloat from_bits(uint16_t b) {
    bfloat r;
    r.bits = b;
    return r;
  }
};

// ---- as_type and bit ops --------------------------------------------------------------------
template <class T, class U>
inline T as_type(U x) {
  static_assert(sizeof(T) == sizeof(U), "as_type: sizes differ");
  T r;
  std::memcpy(&r, &x, sizeof(T));
  return r;
}
inline uint popcount(uint x) { return uint(__builtin_popcount(x)); }
inline int popcount(int x) { return __builtin_popcount(uint(x)); }
inline ulong popcount(ulong x) { return ulong(__builtin_popcountl(x)); }
inline uint clz(uint x) { return x ? uint(__builtin_clz(x)) : 32u; }
inline uint ctz(uint x) { return x ? uint(__builtin_ctz(x)) : 32u; }
inline uint reverse_bits(uint x) {
  uint r = 0;
  for (int i = 0; i < 32; i++) r |= ((x >> i) & 1u) << (31 - i);
  return r;
}
inline uint extract_bits(uint x, uint offset, uint bits) {
  return bits == 32 ? x : (x >> offset) & ((1u << bits) - 1u);
}

// ---- math -----------------------------------------------------------------------------------
// float versions use clang builtins; half/bfloat go through float and round back; vectors apply
// the scalar function per element.
#define MSL_UNARY(name, expr)                                                      \
  inline float name(float x) { return expr; }                                      \
  inline half name(half h) { return half(name(float(h))); }                        \
  inline bfloat name(bfloat b) { return bfloat(name(float(b))); }                  \
  template <class V, msl_enable_vec<V> = 0>                                        \
  inline V name(V v) {                                                             \
    V r;                                                                           \
    for (int i = 0; i < msl_vec_traits<V>::n; i++) r[i] = name(v[i]);             \
    return r;                                                                      \
  }
MSL_UNARY(exp, __builtin_expf(x))
MSL_UNARY(exp2, __builtin_exp2f(x))
MSL_UNARY(exp10, __builtin_powf(10.0f, x))
MSL_UNARY(log, __builtin_logf(x))
MSL_UNARY(log2, __builtin_log2f(x))
MSL_UNARY(log10, __builtin_log10f(x))
MSL_UNARY(log1p, __builtin_log1pf(x))
MSL_UNARY(sqrt, __builtin_sqrtf(x))
MSL_UNARY(rsqrt, 1.0f / __builtin_sqrtf(x))
MSL_UNARY(sin, __builtin_sinf(x))
MSL_UNARY(cos, __builtin_cosf(x))
MSL_UNARY(tan, __builtin_tanf(x))
MSL_UNARY(tanh, __builtin_tanhf(x))
MSL_UNARY(sinh, __builtin_sinhf(x))
MSL_UNARY(cosh, __builtin_coshf(x))
MSL_UNARY(asin, __builtin_asinf(x))
MSL_UNARY(acos, __builtin_acosf(x))
MSL_UNARY(atan, __builtin_atanf(x))
MSL_UNARY(erf, __builtin_erff(x))
MSL_UNARY(floor, __builtin_floorf(x))
MSL_UNARY(ceil, __builtin_ceilf(x))
MSL_UNARY(round, __builtin_roundf(x))
MSL_UNARY(rint, __builtin_rintf(x))
MSL_UNARY(trunc, __builtin_truncf(x))
MSL_UNARY(fabs, __builtin_fabsf(x))
MSL_UNARY(fract, x - __builtin_floorf(x))
MSL_UNARY(sign, x > 0.0f ? 1.0f : (x < 0.0f ? -1.0f : x))
MSL_UNARY(saturate, x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x))
#undef MSL_UNARY

#define MSL_BINARY(name, expr)                                                     \
  inline float name(float x, float y) { return expr; }                             \
  inline half name(half a, half b) { return half(name(float(a), float(b))); }      \
  inline bfloat name(bfloat a, bfloat b) { return bfloat(name(float(a), float(b))); } \
  template <class V, msl_enable_vec<V> = 0>                                        \
  inline V name(V a, V b) {                                                        \
    V r;                                                                           \
    for (int i = 0; i < msl_vec_traits<V>::n; i++) r[i] = name(a[i], b[i]);       \
    return r;                                                                      \
  }
MSL_BINARY(pow, __builtin_powf(x, y))
MSL_BINARY(powr, __builtin_powf(x, y))
MSL_BINARY(atan2, __builtin_atan2f(x, y))
MSL_BINARY(fmod, __builtin_fmodf(x, y))
MSL_BINARY(fmax, __builtin_fmaxf(x, y))
MSL_BINARY(fmin, __builtin_fminf(x, y))
MSL_BINARY(copysign, __builtin_copysignf(x, y))
MSL_BINARY(step, y < x ? 0.0f : 1.0f)
#undef MSL_BINARY

// max/min: Metal's float max/min return the non-NaN operand (fmax semantics).
#define MSL_MINMAX(T, MAXE, MINE)                             \
  inline T max(T a, T b) { return MAXE; }                     \
  inline T min(T a, T b) { return MINE; }
MSL_MINMAX(float, __builtin_fmaxf(a, b), __builtin_fminf(a, b))
MSL_MINMAX(half, half(__builtin_fmaxf(float(a), float(b))), half(__builtin_fminf(float(a), float(b))))
MSL_MINMAX(bfloat, bfloat(__builtin_fmaxf(float(a), float(b))), bfloat(__builtin_fminf(float(a), float(b))))
MSL_MINMAX(int, a > b ? a : b, a < b ? a : b)
MSL_MINMAX(uint, a > b ? a : b, a < b ? a : b)
MSL_MINMAX(short, a > b ? a : b, a < b ? a : b)
MSL_MINMAX(ushort, a > b ? a : b, a < b ? a : b)
MSL_MINMAX(char, a > b ? a : b, a < b ? a : b)
MSL_MINMAX(uchar, a > b ? a : b, a < b ? a : b)
MSL_MINMAX(long, a > b ? a : b, a < b ? a : b)
MSL_MINMAX(ulong, a > b ? a : b, a < b ? a : b)
#undef MSL_MINMAX
template <class V, msl_enable_vec<V> = 0>
inline V max(V a, V b) {
  V r;
  for (int i = 0; i < msl_vec_traits<V>::n; i++) r[i] = max(a[i], b[i]);
  return r;
}
template <class V, msl_enable_vec<V> = 0>
inline V min(V a, V b) {
  V r;
  for (int i = 0; i < msl_vec_traits<V>::n; i++) r[i] = min(a[i], b[i]);
  return r;
}
template <class T>
inline T clamp(T x, T lo, T hi) {
  return min(max(x, lo), hi);
}
inline int abs(int x) { return x < 0 ? -x : x; }
inline long abs(long x) { return x < 0 ? -x : x; }
inline float abs(float x) { return __builtin_fabsf(x); }
inline half abs(half x) { return half(__builtin_fabsf(float(x))); }
inline bfloat abs(bfloat x) { return bfloat(__builtin_fabsf(float(x))); }
template <class V, msl_enable_vec<V> = 0>
inline V abs(V v) {
  V r;
  for (int i = 0; i < msl_vec_traits<V>::n; i++) r[i] = abs(v[i]);
  return r;
}
inline float fma(float a, float b, float c) { return __builtin_fmaf(a, b, c); }
inline half fma(half a, half b, half c) { return half(__builtin_fmaf(float(a), float(b), float(c))); }
template <class V, msl_enable_vec<V> = 0>
inline V fma(V a, V b, V c) {
  V r;
  for (int i = 0; i < msl_vec_traits<V>::n; i++) r[i] = fma(a[i], b[i], c[i]);
  return r;
}
template <class T>
inline T mix(T a, T b, T t) {
  return a + (b - a) * t;
}
// select(a, b, c): c ? b : a (per element for vectors).
template <class T>
inline T select(T a, T b, bool c) {
  return c ? b : a;
}
template <class V, class C, msl_enable_vec<V> = 0, msl_enable_vec<C> = 0>
inline V select(V a, V b, C c) {
  V r;
  for (int i = 0; i < msl_vec_traits<V>::n; i++) r[i] = c[i] ? b[i] : a[i];
  return r;
}
template <class V, msl_enable_vec<V> = 0>
inline typename msl_vec_traits<V>::elem dot(V a, V b) {
  typename msl_vec_traits<V>::elem s = a[0] * b[0];
  for (int i = 1; i < msl_vec_traits<V>::n; i++) s += a[i] * b[i];
  return s;
}
inline bool isnan(float x) { return __builtin_isnan(x); }
inline bool isnan(half x) { return __builtin_isnan(float(x)); }
inline bool isnan(bfloat x) { return __builtin_isnan(float(x)); }
inline bool isinf(float x) { return __builtin_isinf(x); }
inline bool isinf(half x) { return __builtin_isinf(float(x)); }
inline bool isinf(bfloat x) { return __builtin_isinf(float(x)); }
inline bool isfinite(float x) { return __builtin_isfinite(x); }
inline bool isfinite(half x) { return __builtin_isfinite(float(x)); }
inline bool signbit(float x) { return __builtin_signbit(x); }
template <class V, msl_enable_vec<V> = 0>
inline bool all(V v) {
  for (int i = 0; i < msl_vec_traits<V>::n; i++)
    if (!v[i]) return false;
  return true;
}
template <class V, msl_enable_vec<V> = 0>
inline bool any(V v) {
  for (int i = 0; i < msl_vec_traits<V>::n; i++)
    if (v[i]) return true;
  return false;
}
inline bool all(bool b) { return b; }
inline bool any(bool b) { return b; }

namespace fast {
using metal::abs; using metal::ceil; using metal::clamp; using metal::cos; using metal::exp;
using metal::exp2; using metal::fabs; using metal::floor; using metal::fmax; using metal::fmin;
using metal::log; using metal::log2; using metal::max; using metal::min; using metal::pow;
using metal::powr; using metal::rsqrt; using metal::sin; using metal::sqrt; using metal::tanh;
using metal::round; using metal::trunc; using metal::exp10; using metal::log10;
using metal::saturate; using metal::sign; using metal::fract; using metal::tan;
using metal::atan; using metal::atan2;
}  // namespace fast
namespace precise {
using namespace metal::fast;
}  // namespace precise

// ---- synchronisation --------------------------------------------------------------------------
enum class mem_flags : uint { mem_none = 0, mem_device = 1, mem_threadgroup = 2, mem_texture = 4 };
inline mem_flags operator|(mem_flags a, mem_flags b) { return mem_flags(uint(a) | uint(b)); }
enum memory_order { memory_order_relaxed = 0, memory_order_seq_cst = 5 };
enum class thread_scope { thread_scope_thread, thread_scope_simdgroup, thread_scope_threadgroup, thread_scope_device };


// SIMD-group operations. Each deposits this lane's value and blocks until every live lane of the
// SIMD group arrived at the same operation (same kind, same source line/column); then every lane
// computes its result from all lanes' values (lanes visited in lane order: deterministic).
enum msl_simd_kind {
  MSL_SIMD_BARRIER, MSL_SIMD_SUM, MSL_SIMD_MAX, MSL_SIMD_MIN, MSL_SIMD_PREFIX_INCL,
  MSL_SIMD_PREFIX_EXCL, MSL_SIMD_SHUFFLE, MSL_SIMD_SHUFFLE_DOWN, MSL_SIMD_SHUFFLE_UP,
  MSL_SIMD_SHUFFLE_XOR, MSL_SIMD_BROADCAST, MSL_SIMD_BROADCAST_FIRST, MSL_SIMD_PRODUCT,
  MSL_SIMD_AND, MSL_SIMD_OR, MSL_SIMD_XOR, MSL_SIMD_ALL, MSL_SIMD_ANY, MSL_SIMD_BALLOT,
  MSL_SIMD_IS_FIRST, MSL_SIMD_MATRIX_LOAD, MSL_SIMD_MATRIX_STORE, MSL_SIMD_MATRIX_MULTIPLY
};
#define MSL_SITE int msl_line = __builtin_LINE(), int msl_col = __builtin_COLUMN()
#define MSL_SITE_ID ((msl_line << 12) | (msl_col & 0xfff))

template <class T>
struct msl_lanes {
  const unsigned char* slots;
  uint32_t mask;
  bool on(uint i) const { return i < 32 && ((mask >> i) & 1u); }
  T at(uint i) const {
    T v;
    if (on(i)) {
      std::memcpy(&v, slots + i * 64, sizeof(T));
    } else {
      std::memset(&v, 0xFF, sizeof(T));  // inactive lane: poison (NaN / all ones)
    }
    return v;
  }
};
template <class T>
inline msl_lanes<T> msl_exchange(T v, int kind, int site) {
  static_assert(sizeof(T) <= 64, "simd op on a type larger than 64 bytes");
  uint32_t mask;
  const void* s = msl_simd_exchange(&v, int(sizeof(T)), kind, site, &mask);
  return msl_lanes<T>{static_cast<const unsigned char*>(s), mask};
}
inline uint msl_lane() { return msl_current_info()->simd_lane; }

template <class T, class F>
inline T msl_reduce(const msl_lanes<T>& L, F f, uint upto = 32) {
  T acc{};
  bool first = true;
  for (uint i = 0; i < upto; i++) {
    if (!L.on(i)) continue;
    acc = first ? L.at(i) : T(f(acc, L.at(i)));
    first = false;
  }
  return acc;
}

inline void threadgroup_barrier(mem_flags = mem_flags::mem_none, MSL_SITE) {
  msl_threadgroup_barrier(MSL_SITE_ID);
}
inline void simdgroup_barrier(mem_flags = mem_flags::mem_none, MSL_SITE) {
  msl_exchange<int>(0, MSL_SIMD_BARRIER, MSL_SITE_ID);
}
template <class T>
inline T simd_sum(T x, MSL_SITE) {
  return msl_reduce(msl_exchange(x, MSL_SIMD_SUM, MSL_SITE_ID), [](T a, T b) { return a + b; });
}
template <class T>
inline T simd_product(T x, MSL_SITE) {
  return msl_reduce(msl_exchange(x, MSL_SIMD_PRODUCT, MSL_SITE_ID), [](T a, T b) { return a * b; });
}
template <class T>
inline T simd_max(T x, MSL_SITE) {
  return msl_reduce(msl_exchange(x, MSL_SIMD_MAX, MSL_SITE_ID), [](T a, T b) { return max(a, b); });
}
template <class T>
inline T simd_min(T x, MSL_SITE) {
  return msl_reduce(msl_exchange(x, MSL_SIMD_MIN, MSL_SITE_ID), [](T a, T b) { return min(a, b); });
}
template <class T>
inline T simd_and(T x, MSL_SITE) {
  return msl_reduce(msl_exchange(x, MSL_SIMD_AND, MSL_SITE_ID), [](T a, T b) { return a & b; });
}
template <class T>
inline T simd_or(T x, MSL_SITE) {
  return msl_reduce(msl_exchange(x, MSL_SIMD_OR, MSL_SITE_ID), [](T a, T b) { return a | b; });
}
template <class T>
inline T simd_xor(T x, MSL_SITE) {
  return msl_reduce(msl_exchange(x, MSL_SIMD_XOR, MSL_SITE_ID), [](T a, T b) { return a ^ b; });
}
inline bool simd_all(bool x, MSL_SITE) {
  return msl_reduce(msl_exchange(x, MSL_SIMD_ALL, MSL_SITE_ID), [](bool a, bool b) { return a && b; });
}
inline bool simd_any(bool x, MSL_SITE) {
  return msl_reduce(msl_exchange(x, MSL_SIMD_ANY, MSL_SITE_ID), [](bool a, bool b) { return a || b; });
}
template <class T>
inline T simd_prefix_inclusive_sum(T x, MSL_SITE) {
  auto L = msl_exchange(x, MSL_SIMD_PREFIX_INCL, MSL_SITE_ID);
  return msl_reduce(L, [](T a, T b) { return a + b; }, msl_lane() + 1);
}
template <class T>
inline T simd_prefix_exclusive_sum(T x, MSL_SITE) {
  auto L = msl_exchange(x, MSL_SIMD_PREFIX_EXCL, MSL_SITE_ID);
  uint lane = msl_lane();
  bool any_before = false;
  for (uint i = 0; i < lane; i++) any_before |= L.on(i);
  return any_before ? msl_reduce(L, [](T a, T b) { return a + b; }, lane) : T(0);
}
template <class T>
inline T simd_shuffle(T x, ushort lane, MSL_SITE) {
  return msl_exchange(x, MSL_SIMD_SHUFFLE, MSL_SITE_ID).at(lane);
}
template <class T>
inline T simd_broadcast(T x, ushort lane, MSL_SITE) {
  return msl_exchange(x, MSL_SIMD_BROADCAST, MSL_SITE_ID).at(lane);
}
template <class T>
inline T simd_shuffle_down(T x, ushort delta, MSL_SITE) {
  auto L = msl_exchange(x, MSL_SIMD_SHUFFLE_DOWN, MSL_SITE_ID);
  uint src = msl_lane() + delta;
  return src >= 32 ? x : L.at(src);  // the upper `delta` lanes keep their own value
}
template <class T>
inline T simd_shuffle_up(T x, ushort delta, MSL_SITE) {
  auto L = msl_exchange(x, MSL_SIMD_SHUFFLE_UP, MSL_SITE_ID);
  uint lane = msl_lane();
  return lane < delta ? x : L.at(lane - delta);  // the lower `delta` lanes keep their own value
}
template <class T>
inline T simd_shuffle_xor(T x, ushort mask, MSL_SITE) {
  return msl_exchange(x, MSL_SIMD_SHUFFLE_XOR, MSL_SITE_ID).at(msl_lane() ^ mask);
}
template <class T>
inline T simd_broadcast_first(T x, MSL_SITE) {
  auto L = msl_exchange(x, MSL_SIMD_BROADCAST_FIRST, MSL_SITE_ID);
  return L.at(uint(__builtin_ctz(L.mask)));
}
inline bool simd_is_first(MSL_SITE) {
  auto L = msl_exchange<int>(0, MSL_SIMD_IS_FIRST, MSL_SITE_ID);
  return msl_lane() == uint(__builtin_ctz(L.mask));
}
struct simd_vote {
  uint64_t v;
  explicit operator uint64_t() const { return v; }
  bool all() const { return v == 0xffffffffu; }
  bool any() const { return v != 0; }
};
inline simd_vote simd_ballot(bool x, MSL_SITE) {
  auto L = msl_exchange(x, MSL_SIMD_BALLOT, MSL_SITE_ID);
  uint64_t v = 0;
  for (uint i = 0; i < 32; i++)
    if (L.on(i) && L.at(i)) v |= uint64_t(1) << i;
  return simd_vote{v};
}

// ---- SIMD-group matrices: simdgroup_matrix<T, 8, 8> (T float, half, bfloat) ------------------
// As on the GPU, each lane holds 2 of the 64 elements (thread_elements), in the layout MLX's
// steel/gemm/mma.h relies on: lane l holds row (l / 4 & 4) + (l / 2 % 4), columns
// (l / 4 & 2) * 2 + (l % 2) * 2 + {0, 1}. Every function except the constructors is a SIMD-group
// collective at one call site, in lockstep like simd_shuffle: all 32 lanes must be active
// (Metal requires uniform control flow; an inactive lane is an error here). simdgroup_load reads
// once every lane arrived; simdgroup_store writes each lane's own two elements when that lane
// resumes, so another lane's elements are only visible after simdgroup_barrier (a missing one
// makes the forward and reverse schedules differ). Products are float fma chains in k order
// (half / bfloat: computed in float, rounded once). Only 8x8 matrices exist in Metal; loads and
// stores take threadgroup or device pointers of the matrix's element type (not thread or
// constant memory): anything else fails to compile, as with Metal's overloads.
inline void msl_mat_coord(uint lane, int& row, int& col) {
  const uint qid = lane / 4;
  row = int((qid & 4) + (lane / 2) % 4);
  col = int((qid & 2) * 2 + (lane % 2) * 2);
}
template <class T>
struct msl_mat_elem {
  static constexpr bool ok = std::is_same<T, float>::value || std::is_same<T, half>::value ||
                             std::is_same<T, bfloat>::value;
};
template <class T>
inline T msl_mat_poison() {
  T v;
  std::memset(&v, 0xFF, sizeof(T));  // NaN for float, half and bfloat
  return v;
}

template <typename T, int Cols, int Rows>
struct simdgroup_matrix {
  static_assert(Cols == 8 && Rows == 8, "simdgroup_matrix: Metal has 8x8 matrices only");
  static_assert(msl_mat_elem<T>::ok, "simdgroup_matrix: element type must be float, half or bfloat");
  alignas(2 * sizeof(T)) T e[2];
  simdgroup_matrix() : e{msl_mat_poison<T>(), msl_mat_poison<T>()} {}  // Metal: undefined
  // Metal: this lane's own two elements (msl_mat_coord's row, columns c and c + 1), read and
  // written without the SIMD group (no collective).
  vec<T, 2>& thread_elements() { return *reinterpret_cast<vec<T, 2>*>(e); }
  const vec<T, 2>& thread_elements() const { return *reinterpret_cast<const vec<T, 2>*>(e); }
  // Metal: simdgroup_matrix<T, C, R>(T dval) is the diagonal matrix dval * I.
  explicit simdgroup_matrix(T dval) {
    int r, c;
    msl_mat_coord(msl_lane(), r, c);
    e[0] = r == c ? dval : T(0.0f);
    e[1] = r == c + 1 ? dval : T(0.0f);
  }
};
typedef simdgroup_matrix<float, 8, 8> simdgroup_float8x8;
typedef simdgroup_matrix<half, 8, 8> simdgroup_half8x8;
typedef simdgroup_matrix<bfloat, 8, 8> simdgroup_bfloat8x8;

template <typename T, int Cols, int Rows>
inline simdgroup_matrix<T, Cols, Rows> make_filled_simdgroup_matrix(T value) {
  simdgroup_matrix<T, Cols, Rows> m;
  m.e[0] = value;
  m.e[1] = value;
  return m;
}

// Arrives at the collective and checks that all 32 lanes are there.
template <class X>
inline msl_lanes<X> msl_mat_collective(const X& x, int kind, int site, const char* what) {
  msl_lanes<X> L = msl_exchange(x, kind, site);
  if (L.mask != 0xffffffffu) {
    msl_fatal(what);
  }
  return L;
}
// Offset of element (r, c) of a matrix at `origin` (x = column, y = row) of the memory
// matrix with `stride` elements per row; transposed: the memory holds the matrix by columns.
inline ulong msl_mat_offset(int r, int c, ulong stride, ulong2 origin, bool transpose) {
  const ulong base = origin.y * stride + origin.x;
  return transpose ? base + ulong(c) * stride + ulong(r) : base + ulong(r) * stride + ulong(c);
}
template <class T, class P>
inline void msl_mat_load(simdgroup_matrix<T, 8, 8>& d, P src, ulong stride, ulong2 origin, bool tr, int site) {
  msl_mat_collective<int>(0, MSL_SIMD_MATRIX_LOAD, site,
                          "simdgroup_load with inactive lanes (all 32 lanes must call it)");
  int r, c;
  msl_mat_coord(msl_lane(), r, c);
  d.e[0] = src[msl_mat_offset(r, c, stride, origin, tr)];
  d.e[1] = src[msl_mat_offset(r, c + 1, stride, origin, tr)];
}
template <class T, class P>
inline void msl_mat_store(const simdgroup_matrix<T, 8, 8>& a, P dst, ulong stride, ulong2 origin, bool tr, int site) {
  msl_mat_collective<int>(0, MSL_SIMD_MATRIX_STORE, site,
                          "simdgroup_store with inactive lanes (all 32 lanes must call it)");
  int r, c;
  msl_mat_coord(msl_lane(), r, c);
  dst[msl_mat_offset(r, c, stride, origin, tr)] = a.e[0];
  dst[msl_mat_offset(r, c + 1, stride, origin, tr)] = a.e[1];
}

#define MSL_MAT_LOADSTORE(SPACE)                                                                  \
  template <typename T, int C, int R>                                                             \
  inline void simdgroup_load(thread simdgroup_matrix<T, C, R>& d, const SPACE T* src,             \
                             ulong elements_per_row = C, ulong2 matrix_origin = ulong2{0, 0},     \
                             bool transpose_matrix = false, MSL_SITE) {                           \
    msl_mat_load(d, src, elements_per_row, matrix_origin, transpose_matrix, MSL_SITE_ID);         \
  }                                                                                               \
  template <typename T, int C, int R>                                                             \
  inline void simdgroup_store(const thread simdgroup_matrix<T, C, R>& a, SPACE T* dst,            \
                              ulong elements_per_row = C, ulong2 matrix_origin = ulong2{0, 0},    \
                              bool transpose_matrix = false, MSL_SITE) {                          \
    msl_mat_store(a, dst, elements_per_row, matrix_origin, transpose_matrix, MSL_SITE_ID);        \
  }
MSL_MAT_LOADSTORE(device)
MSL_MAT_LOADSTORE(threadgroup)
#undef MSL_MAT_LOADSTORE

template <class T>
struct msl_mat_operands {
  T a[2], b[2], c[2];
};
// d = a * b + c for the whole SIMD group; `accumulate` false: c = 0.
template <class T>
inline void msl_mat_mad(simdgroup_matrix<T, 8, 8>& d, const simdgroup_matrix<T, 8, 8>& a,
                        const simdgroup_matrix<T, 8, 8>& b, const simdgroup_matrix<T, 8, 8>* c, int site) {
  msl_mat_operands<T> mine;
  for (int i = 0; i < 2; i++) {
    mine.a[i] = a.e[i];
    mine.b[i] = b.e[i];
    mine.c[i] = c ? c->e[i] : T(0.0f);
  }
  auto L = msl_mat_collective(mine, MSL_SIMD_MATRIX_MULTIPLY, site,
                              "simdgroup_multiply(_accumulate) with inactive lanes (all 32 lanes must call it)");
  float A[8][8], B[8][8], Cm[8][8];
  for (uint l = 0; l < 32; l++) {
    const msl_mat_operands<T> o = L.at(l);
    int r, col;
    msl_mat_coord(l, r, col);
    for (int i = 0; i < 2; i++) {
      A[r][col + i] = float(o.a[i]);
      B[r][col + i] = float(o.b[i]);
      Cm[r][col + i] = float(o.c[i]);
    }
  }
  int r, col;
  msl_mat_coord(msl_lane(), r, col);
  for (int i = 0; i < 2; i++) {
    float acc = Cm[r][col + i];
    for (int k = 0; k < 8; k++) {
      acc = __builtin_fmaf(A[r][k], B[k][col + i], acc);
    }
    d.e[i] = T(acc);
  }
}
template <typename T, int C, int R>
inline void simdgroup_multiply_accumulate(thread simdgroup_matrix<T, C, R>& d, const thread simdgroup_matrix<T, C, R>& a,
                                          const thread simdgroup_matrix<T, C, R>& b,
                                          const thread simdgroup_matrix<T, C, R>& c, MSL_SITE) {
  const simdgroup_matrix<T, C, R> cc = c;  // d may alias an operand
  msl_mat_mad(d, simdgroup_matrix<T, C, R>(a), simdgroup_matrix<T, C, R>(b), &cc, MSL_SITE_ID);
}
template <typename T, int C, int R>
inline void simdgroup_multiply(thread simdgroup_matrix<T, C, R>& d, const thread simdgroup_matrix<T, C, R>& a,
                               const thread simdgroup_matrix<T, C, R>& b, MSL_SITE) {
  msl_mat_mad<T>(d, simdgroup_matrix<T, C, R>(a), simdgroup_matrix<T, C, R>(b), nullptr, MSL_SITE_ID);
}
#undef MSL_SITE
#undef MSL_SITE_ID

// ---- atomics (threads of the simulator never run concurrently: plain loads/stores are atomic) --
template <class T>
struct atomic {
  T value;
};
typedef atomic<int> atomic_int;
typedef atomic<uint> atomic_uint;
typedef atomic<float> atomic_float;
template <class T, class U>
inline void atomic_store_explicit(volatile atomic<T>* a, U v, memory_order) { a->value = T(v); }
template <class T>
inline T atomic_load_explicit(volatile atomic<T>* a, memory_order) { return a->value; }
template <class T, class U>
inline T atomic_exchange_explicit(volatile atomic<T>* a, U v, memory_order) {
  T old = a->value;
  a->value = T(v);
  return old;
}
#define MSL_ATOMIC_RMW(name, op)                                              \
  template <class T, class U>                                                 \
  inline T name(volatile atomic<T>* a, U v, memory_order) {                   \
    T old = a->value;                                                         \
    a->value = T(old op T(v));                                                \
    return old;                                                               \
  }
MSL_ATOMIC_RMW(atomic_fetch_add_explicit, +)
MSL_ATOMIC_RMW(atomic_fetch_sub_explicit, -)
MSL_ATOMIC_RMW(atomic_fetch_and_explicit, &)
MSL_ATOMIC_RMW(atomic_fetch_or_explicit, |)
MSL_ATOMIC_RMW(atomic_fetch_xor_explicit, ^)
#undef MSL_ATOMIC_RMW
template <class T, class U>
inline T atomic_fetch_max_explicit(volatile atomic<T>* a, U v, memory_order) {
  T old = a->value;
  a->value = max(old, T(v));
  return old;
}
template <class T, class U>
inline T atomic_fetch_min_explicit(volatile atomic<T>* a, U v, memory_order) {
  T old = a->value;
  a->value = min(old, T(v));
  return old;
}
template <class T, class U>
inline bool atomic_compare_exchange_weak_explicit(volatile atomic<T>* a, T* expected, U desired,
                                                  memory_order, memory_order) {
  if (a->value == *expected) {
    a->value = T(desired);
    return true;
  }
  *expected = a->value;
  return false;
}
}  // namespace metal

using namespace metal;

// ---- subset of MLX's kernels/utils.h (prepended by mx.fast.metal_kernel) -----------------------
typedef half float16_t;
typedef bfloat bfloat16_t;
inline uint16_t bfloat16_to_uint16(const bfloat16_t x) { return as_type<uint16_t>(x); }
inline bfloat16_t uint16_to_bfloat16(const uint16_t x) { return as_type<bfloat16_t>(x); }

template <typename U>
struct Limits {
  static U max() { return metal::numeric_limits<U>::max(); }
  static U min() { return metal::numeric_limits<U>::min(); }
};
// MLX's Limits<T>::max/min are static data members; for floats they are +/-infinity.
#define MSL_INT_LIMIT(T)                                                       \
  template <>                                                                  \
  struct Limits<T> {                                                           \
    static constexpr T max = std::numeric_limits<T>::max();                   \
    static constexpr T min = std::numeric_limits<T>::min();                   \
    static constexpr T finite_max = std::numeric_limits<T>::max();            \
    static constexpr T finite_min = std::numeric_limits<T>::min();            \
  };
MSL_INT_LIMIT(uint8_t)
MSL_INT_LIMIT(uint16_t)
MSL_INT_LIMIT(uint32_t)
MSL_INT_LIMIT(uint64_t)
MSL_INT_LIMIT(int8_t)
MSL_INT_LIMIT(int16_t)
MSL_INT_LIMIT(int32_t)
MSL_INT_LIMIT(int64_t)
#undef MSL_INT_LIMIT
template <>
struct Limits<float> {
  static constexpr float max = __builtin_inff();
  static constexpr float min = -__builtin_inff();
  static constexpr float finite_max = 3.40282347e+38f;
  static constexpr float finite_min = -3.40282347e+38f;
};
template <>
struct Limits<half> {
  static constexpr half max = half(__builtin_inff());
  static constexpr half min = half(-__builtin_inff());
  static constexpr half finite_max = half(65504.0f);
  static constexpr half finite_min = half(-65504.0f);
};
template <>
struct Limits<bool> {
  static constexpr bool max = true;
  static constexpr bool min = false;
};
// Limits<bfloat16_t> is not provided: MLX's needs constexpr bfloat construction.

template <typename T, typename U>
inline T ceildiv(T N, U M) {
  return (N + M - 1) / M;
}

template <typename IdxT = int64_t>
METAL_FUNC IdxT elem_to_loc(IdxT elem, constant const int* shape, constant const int64_t* strides,
                            int ndim) {
  IdxT loc = 0;
  for (int i = ndim - 1; i >= 0 && elem > 0; --i) {
    loc += (elem % shape[i]) * IdxT(strides[i]);
    elem /= shape[i];
  }
  return loc;
}
