// CPU kernels behind XLA's FFI: a matmul and the gated expert FFN (block and routed layouts)
// over packed weights.
//
// Both read weights where they lie (a pool slot, a dense parameter), in their stored format
// (bf16, float32, or a QArray's int8/int4/int2 codes with float16 scales and offsets), decode
// in registers or one small panel at a time into L1, and accumulate in float32. Work is split over
// 1024-column blocks (and experts) and run on XLA's intra-op thread pool. The instruction set
// (AVX-512 with or without VNNI, AVX2, or portable) is chosen once at run time.

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <immintrin.h>

#include "xla/ffi/api/ffi.h"
#include "isa.h"
#include "parallel.h"

namespace ffi = xla::ffi;

namespace jmoe {

constexpr int kTile = 64;             // columns per tile (four 16-float vectors)
constexpr int kBlock = 16 * kTile;    // columns per task with many rows (1024)
constexpr int kFewRowBlock = 64 * kTile;  // columns per task with few rows (4096): long runs of each weight row
constexpr int kMinPieceRows = 256;    // the fewest K rows of a piece when a product is split over K
constexpr int kPlainPanelRows = 64;   // K rows per panel for unquantized weights
constexpr int kMaxPanelRows = 128;    // the largest group size
constexpr int kFusedRows = 16;        // rows up to which weights are decoded in registers
// The few-row paths fetch the rows they will read a few passes ahead into L2 (prefetcht1: L1's
// few miss buffers would cap the fetches in flight); distances measured at Qwen3-30B-A3B shapes.
constexpr int kPlainPrefetchRows = 32;  // bf16/float32 rows ahead (four passes of eight)
constexpr int kCodePrefetchRows = 64;   // byte rows of codes ahead (two int4 groups of 64)
constexpr int kToL2 = 2;                // __builtin_prefetch's locality for prefetcht1

// One K-major weight [K, N] (one pool slot, or a dense parameter).
//
// Tiled (N a multiple of kTile): values, scales and offsets are stored in column tiles, tile t
// holding columns [64 t, 64 t + 64) of every row as a K-major [rows, 64] block of its own
// (kernel_formats.qarray's CPU layout; a plain bf16/float32 weight's rows are its K rows). A
// product then reads each tile as one sequential stream, where [K, N] walks eight byte rows N bytes
// apart at a time; the kernels run each tile as a plain weight of 64 columns (tile()).
struct Weight {
  const void* values;        // bf16/f32 [K, N] or uint8 codes [Kp / G * group_rows(), N]
  const uint8_t* scales;     // [Kp / G, N] (quantized only): float16, or uint8 codes (scale_bits 8)
  const uint8_t* offsets;    // [Kp / G, N] (asymmetric only): as scales
  int bits;                  // 32, 16 (bf16), 8, 6, 4, 3 or 2 (3: two sections per group, see low_rows();
                             // 6: values the low plane, `high` the high one)
  int64_t group;             // G (quantized only)
  bool symmetric;
  int64_t k, n;              // logical K, N
  int scale_bits = 16;       // 8: scale = code * bases[0][c], offset = (code - 128) * bases[1][c]
  const float* bases = nullptr;  // scale_bits 8: float32 [2, N] (kernel_formats.qarray)
  bool tiled = false;
  int64_t tile_rows = 0, tile_groups = 0;  // tiled: byte rows (plain: K rows) and groups of the whole weight's tiles
  int64_t first_group = 0;                 // tiled: the group rows(k0, k1) starts at
  int64_t first_row = 0;                   // tiled plain: the K row rows(k0, k1) starts at
  // Six bits (kernel_formats.qarray.QPlanes, the int8 dot only): values hold the codes' low four bits
  // as int4 packs them (G / 2 byte rows a group), `high` their high two bits as int2 packs them (G / 4
  // rows), both in the same layout; scales and offsets are the low plane's (offset + 32 scale), the
  // high plane's scales, 16 times those, are not read. The high bits of low byte row r's field j are
  // field 2j + r / (G / 4) of high row r % (G / 4).
  const uint8_t* high = nullptr;

  bool quantized() const { return bits <= 8; }
  int64_t padded_k() const { return quantized() ? (k + group - 1) / group * group : k; }
  // Byte rows of codes per group. Three bits: the low two bits as int2 packs them (low_rows(), G / 4
  // rows), then the high bits eight to a byte (G / 8 rows); the high bits of low byte row r's field j
  // are bit 2j + r / (G / 8) of high row r % (G / 8) (kernel_formats/qarray.py).
  int64_t group_rows() const { return bits == 6 ? group / 2 : group * bits / 8; }
  int64_t low_rows() const { return bits == 3 ? group / 4 : bits == 6 ? group / 2 : group / (8 / bits); }
  int64_t high_group_rows() const { return group / 4; }  // six bits: the high plane's byte rows a group
  // Three bits: the group's byte row holding the high bits of low byte row r, and which bit of it
  // is field j's (2j + r / (G / 8)).
  int64_t high_row(int64_t r) const { return low_rows() + r % (low_rows() / 2); }
  int high_bit(int64_t r, int field) const { return 2 * field + static_cast<int>(r / (low_rows() / 2)); }
  int64_t value_bytes() const { return quantized() ? padded_k() / group * group_rows() * n : k * n * (bits / 8); }
  int64_t scale_count() const { return quantized() ? padded_k() / group * n : 0; }
  int64_t scale_size() const { return scale_bits / 8; }  // bytes per scale or offset

  // Group g's scale and offset of column c (symmetric: offset = -midpoint * scale).
  float scale_at(int64_t g, int64_t c) const;
  float offset_at(int64_t g, int64_t c) const;

  Weight slot(int64_t s) const {
    Weight w = *this;
    w.values = static_cast<const uint8_t*>(values) + s * value_bytes();
    if (scales) w.scales = scales + s * scale_count() * scale_size();
    if (offsets) w.offsets = offsets + s * scale_count() * scale_size();
    if (bases) w.bases = bases + s * 2 * n;
    if (high) w.high = high + s * padded_k() / group * high_group_rows() * n;
    return w;
  }

  // Rows [k0, k1) as a weight of their own (k0 a multiple of the group when quantized).
  Weight rows(int64_t k0, int64_t k1) const {
    Weight w = *this;
    w.k = k1 - k0;
    if (tiled && !quantized()) {  // the tiles stay where they are: tile() starts each at the row
      w.first_row = first_row + k0;
    } else if (tiled) {  // tile() starts each at the group
      w.first_group = first_group + k0 / group;
    } else if (quantized()) {
      const int64_t g0 = k0 / group;
      w.values = static_cast<const uint8_t*>(values) + g0 * group_rows() * n;
      if (high) w.high = high + g0 * high_group_rows() * n;
      if (scales) w.scales = scales + g0 * n * scale_size();
      if (offsets) w.offsets = offsets + g0 * n * scale_size();
    } else {
      w.values = static_cast<const uint8_t*>(values) + k0 * n * (bits / 8);
    }
    return w;
  }

  // Column tile t of a tiled weight as a plain K-major weight of kTile columns.
  Weight tile(int64_t t) const {
    Weight w = *this;
    w.tiled = false;
    w.n = kTile;
    w.first_group = w.first_row = 0;
    if (!quantized()) {
      w.values = static_cast<const uint8_t*>(values) + (t * tile_rows + first_row) * kTile * (bits / 8);
      return w;
    }
    w.values = static_cast<const uint8_t*>(values) + (t * tile_rows + first_group * group_rows()) * kTile;
    if (scales) w.scales = scales + (t * tile_groups + first_group) * kTile * scale_size();
    if (offsets) w.offsets = offsets + (t * tile_groups + first_group) * kTile * scale_size();
    if (bases) w.bases = bases + t * 2 * kTile;  // the bases' [2, N] in tiles of [2, kTile]
    if (high) w.high = high + (t * tile_groups + first_group) * high_group_rows() * kTile;
    return w;
  }
};

static inline float half_to_float(uint16_t h) {
  const uint32_t sign = (h & 0x8000u) << 16, exp = (h >> 10) & 0x1f, mant = h & 0x3ffu;
  uint32_t bits;
  if (exp == 0x1f) {
    bits = sign | 0x7f800000u | (mant << 13);
  } else if (exp != 0) {
    bits = sign | ((exp + 112) << 23) | (mant << 13);
  } else {  // zero or subnormal: mant * 2^-24
    float f = std::ldexp(static_cast<float>(mant), -24);
    std::memcpy(&bits, &f, 4);
    bits |= sign;
  }
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

float Weight::scale_at(int64_t g, int64_t c) const {
  if (scale_bits == 8) return static_cast<float>(scales[g * n + c]) * bases[c];
  return half_to_float(reinterpret_cast<const uint16_t*>(scales)[g * n + c]);
}

float Weight::offset_at(int64_t g, int64_t c) const {
  if (symmetric) return -static_cast<float>(1 << (bits - 1)) * scale_at(g, c);
  if (scale_bits == 8) return (static_cast<float>(offsets[g * n + c]) - 128.0f) * bases[n + c];
  return half_to_float(reinterpret_cast<const uint16_t*>(offsets)[g * n + c]);
}

static inline float bf16_to_float(uint16_t h) {
  uint32_t bits = static_cast<uint32_t>(h) << 16;
  float f;
  std::memcpy(&f, &bits, 4);
  return f;
}

// One element of W (the ragged-tile path).
static float weight_at(const Weight& w, int64_t k, int64_t n) {
  if (w.bits == 32) return static_cast<const float*>(w.values)[k * w.n + n];
  if (w.bits == 16) return bf16_to_float(static_cast<const uint16_t*>(w.values)[k * w.n + n]);
  const int low_bits = w.bits == 3 ? 2 : w.bits;
  const int64_t plane = w.low_rows(), g = k / w.group, within = k % w.group;
  const int64_t field = within / plane, r = within % plane;
  const uint8_t* group = static_cast<const uint8_t*>(w.values) + g * w.group_rows() * w.n;
  uint32_t q = (group[r * w.n + n] >> (field * low_bits)) & ((1u << low_bits) - 1);
  if (w.bits == 3) q |= ((group[w.high_row(r) * w.n + n] >> w.high_bit(r, field)) & 1u) << 2;
  return static_cast<float>(q) * w.scale_at(g, n) + w.offset_at(g, n);
}

// The symmetric int8 grid of n values (W8A8's per token, the int8 dot's per group), as
// kernel_formats.qarray.int8_per_token forms it: step = max |x| / 127 (1 for zeros), codes rounded
// half to even and clipped to +-127.
static float int8_step(const float* x, int64_t n) {
  float amax = 0.0f;
  for (int64_t j = 0; j < n; ++j) amax = std::max(amax, std::fabs(x[j]));
  const float step = amax / 127.0f;
  return step == 0.0f ? 1.0f : step;
}

static inline float int8_code(float x, float step) {
  return std::min(127.0f, std::max(-127.0f, std::nearbyint(x / step)));
}

// One group of n inputs onto its int8 grid: codes, step * code into out, the codes' sum into *sum;
// returns the step (vectorised under AVX-512 and AVX2: prefill rounds every input of a layer, and at
// decode the scalar loop took 4.5% of a Qwen3-30B-A3B slice's step under AVX2).
static float quantize_group(const float* in, int64_t n, float* out, int8_t* codes, int32_t* sum);

// The inputs x[M, K] of one matmul (row stride ld). Under the int8 dot (QuantizedInputs::kInt8Groups) each
// row's K groups of G are also held as int8 codes with one float step per group, the way
// llama.cpp's Q8 blocks are (int8_step, int8_code), and x then holds step * code, so every path
// (VNNI or float) multiplies the same numbers.
struct Inputs {
  const float* x = nullptr;
  int64_t ld = 0;
  const int8_t* codes = nullptr;  // [M, groups * group], zero past K
  const float* steps = nullptr;   // [M, groups]
  const int32_t* sums = nullptr;  // [M, groups]: the sum of each group's codes
  int64_t group = 0, groups = 0;
  // Under the bf16 dot (a plain bf16 weight, QuantizedInputs::kBf16) x holds its inputs rounded to
  // bf16, and `pairs` the same inputs two to a 32-bit word, k's bits low and k + 1's high
  // ([M, ld_pairs], the last pair's high half zero for an odd K), as the AVX-512 BF16 dot reads them.
  const uint32_t* pairs = nullptr;
  int64_t ld_pairs = 0;

  Inputs from_row(int64_t m) const {
    Inputs r = *this;
    r.x += m * ld;
    if (codes) r.codes += m * groups * group, r.steps += m * groups, r.sums += m * groups;
    if (pairs) r.pairs += m * ld_pairs;
    return r;
  }

  // The inputs of K rows from k0 on (Weight::rows; k0 a multiple of the group when quantized).
  Inputs from_k(int64_t k0) const {
    Inputs r = *this;
    r.x += k0;
    if (codes) r.codes += k0, r.steps += k0 / group, r.sums += k0 / group;
    if (pairs) r.pairs += k0 / 2;  // pieces of K start at even rows (whole units of 8)
    return r;
  }
};

// x rounded to the nearest bf16, ties to even (as jax's astype(bfloat16) for finite x): its bits.
static inline uint32_t bf16_bits(float x) {
  uint32_t b;
  std::memcpy(&b, &x, sizeof b);
  return (b + 0x7FFFu + ((b >> 16) & 1u)) >> 16;
}

// Owns the quantized copy behind an Inputs (plain float inputs need none): `reserve` allocates it,
// `fill_row` rounds a row (PoolInputs rounds every row over the pool's threads, run_experts' one
// pass each run's rows as they become ready).
struct QuantizedInputs {
  // Left uninitialised (every element is written, the codes' padding too): zeroing them first
  // took a single-threaded pass over fresh pages, as long as the rounding itself at prefill sizes.
  std::unique_ptr<float[]> x, steps;
  std::unique_ptr<int8_t[]> codes;
  std::unique_ptr<int32_t[]> sums;
  std::unique_ptr<uint32_t[]> pairs;
  enum Mode { kAsIs, kInt8Groups, kBf16 };
  Mode mode = kAsIs;
  const float* src = nullptr;
  int64_t src_ld = 0, K = 0, group = 0, groups = 0, padded = 0, ldp = 0;

  // Inputs for x[M, K] (row stride ld): as they are, on the int8 dot's groups of `group`
  // (kInt8Groups), or rounded to bf16 for a plain bf16 weight under the bf16 dot (kBf16: in floats,
  // which every other path multiplies, and in pairs, Inputs::pairs). Rows hold their values once filled.
  Inputs reserve(const float* xp, int64_t ld, int64_t M, int64_t k, Mode how, int64_t g = 0) {
    mode = how, src = xp, src_ld = ld, K = k, group = g;
    Inputs in;
    in.x = xp, in.ld = ld;
    if (mode == kBf16) {
      ldp = (K + 1) / 2;
      x.reset(new float[M * K]), pairs.reset(new uint32_t[M * ldp]);
      in.x = x.get(), in.ld = K, in.pairs = pairs.get(), in.ld_pairs = ldp;
    } else if (mode == kInt8Groups) {
      groups = (K + group - 1) / group, padded = groups * group;
      x.reset(new float[M * K]), codes.reset(new int8_t[M * padded]);
      steps.reset(new float[M * groups]), sums.reset(new int32_t[M * groups]);
      in.x = x.get(), in.ld = K, in.codes = codes.get(), in.steps = steps.get(), in.sums = sums.get();
      in.group = group, in.groups = groups;
    }
    return in;
  }

  // Rounds row m of the reserved inputs.
  void fill_row(int64_t m) {
    const float* row_in = src + m * src_ld;
    if (mode == kBf16) {
      float* row = x.get() + m * K;
      uint32_t* row_pairs = pairs.get() + m * ldp;
      for (int64_t k = 0; k < K; k += 2) {
        const uint32_t lo = bf16_bits(row_in[k]), hi = k + 1 < K ? bf16_bits(row_in[k + 1]) : 0u;
        row_pairs[k / 2] = lo | hi << 16;
        const uint32_t lo_f = lo << 16, hi_f = hi << 16;
        std::memcpy(row + k, &lo_f, sizeof lo_f);
        if (k + 1 < K) std::memcpy(row + k + 1, &hi_f, sizeof hi_f);
      }
    } else if (mode == kInt8Groups) {
      int8_t* row_codes = codes.get() + m * padded;
      std::fill(row_codes + K, row_codes + padded, int8_t{0});
      for (int64_t g = 0; g < groups; ++g) {
        const int64_t k0 = g * group, n = std::min(K, k0 + group) - k0;
        steps[m * groups + g] = quantize_group(row_in + k0, n, x.get() + m * K + k0, row_codes + k0,
                                               &sums[m * groups + g]);
      }
    }
  }
};

// 16-lane vectors (GCC vector extensions): a zmm under AVX-512, two ymm under AVX2.
typedef float v16 __attribute__((vector_size(64)));
typedef uint32_t v16u __attribute__((vector_size(64)));
typedef int32_t v16i __attribute__((vector_size(64)));

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c")
namespace avx512 {
// 32 zmm: four rows of a whole tile (16 accumulators) beside its four decoded vectors.
constexpr int fused_vectors(int) { return 4; }
constexpr int kPanelRowBlock = 4, kPanelVectors = 4;
static inline v16 to_float(v16u c) { return __builtin_convertvector(__builtin_convertvector(c, v16i), v16); }
static inline v16 load16(const float* p) { return (v16)_mm512_loadu_ps(p); }
static inline void store16(float* p, v16 v) { _mm512_storeu_ps(p, (__m512)v); }
static inline v16 splat(float f) { return (v16)_mm512_set1_ps(f); }
static inline v16u widen_bytes(const uint8_t* p) {
  return (v16u)_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}
static inline v16 bf16_to_f32(const uint16_t* p) {
  return (v16)_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16);
}
static inline v16 half16_to_f32(const uint16_t* p) {
  return (v16)_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}
static bool int8_dot_tiles(const Inputs& in, int64_t M, const Weight& w, int64_t n0, int64_t tiles, float* y,
                           int64_t ldy);
static bool bf16_dot_cols(const Inputs& in, int64_t M, const Weight& w, int64_t n0, int64_t n1, float* y,
                          int64_t ldy);
#include "gemm.inc"
#include "int8_dot.inc"

// ---- the bf16 dot (AVX-512 BF16): many rows of a plain bf16 weight under the bf16 dot ----
static bool has_bf16_dot() {
  static const bool yes = [] {
    __builtin_cpu_init();
    return __builtin_cpu_supports("avx512bf16") != 0;
  }();
  return yes;
}

// Only these functions are compiled for AVX-512 BF16 (bf16_dot_cols calls them where the CPU has it).
#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma,f16c,avx512bf16")

// y[r, 0:64) += x's pairs (R rows, ldp apart) @ a repacked panel of np row pairs x 64 columns.
template <int R>
static inline void bf16_block(const uint32_t* xp, int64_t ldp, const uint32_t* panel, int64_t np, float* y,
                              int64_t ldy) {
  __m512 acc[R][4];
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_setzero_ps();
  for (int64_t p = 0; p < np; ++p) {
    __m512bh wv[4];
    for (int j = 0; j < 4; ++j) wv[j] = (__m512bh)_mm512_load_si512(panel + p * kTile + 16 * j);
    for (int r = 0; r < R; ++r) {
      const __m512bh xb = (__m512bh)_mm512_set1_epi32(static_cast<int>(xp[r * ldp + p]));
      for (int j = 0; j < 4; ++j) acc[r][j] = _mm512_dpbf16_ps(acc[r][j], wv[j], xb);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int j = 0; j < 4; ++j)
      _mm512_storeu_ps(y + r * ldy + 16 * j, _mm512_add_ps(_mm512_loadu_ps(y + r * ldy + 16 * j), acc[r][j]));
}

// bf16_dot_cols's product: K one panel of kPlainPanelRows rows at a time, each 64-column tile of it
// repacked into row pairs (column c's rows k and k + 1 in one 32-bit lane, as vdpbf16ps reads them)
// and multiplied by four rows at a time, two bf16 products a lane an instruction where the float
// path has one.
static void bf16_dot_panels(const Inputs& in, int64_t M, const Weight& w, int64_t n0, int64_t n1, float* y,
                            int64_t ldy) {
  for (int64_t m = 0; m < M; ++m) std::fill(y + m * ldy + n0, y + m * ldy + n1, 0.0f);
  alignas(64) uint32_t panel[kPlainPanelRows / 2 * kTile];
  const uint16_t* values = static_cast<const uint16_t*>(w.values);
  for (int64_t k0 = 0; k0 < w.k; k0 += kPlainPanelRows) {
    const int64_t kn = std::min<int64_t>(kPlainPanelRows, w.k - k0), np = (kn + 1) / 2;
    const uint32_t* xp = in.pairs + k0 / 2;
    for (int64_t c0 = n0; c0 < n1; c0 += kTile) {
      for (int64_t p = 0; p < np; ++p) {
        const uint16_t* row = values + (k0 + 2 * p) * w.n + c0;
        const bool last_alone = 2 * p + 1 == kn;
        for (int j = 0; j < 4; ++j) {
          const __m512i lo = _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + 16 * j)));
          const __m512i hi = last_alone ? _mm512_setzero_si512() : _mm512_slli_epi32(_mm512_cvtepu16_epi32(
              _mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + w.n + 16 * j))), 16);
          _mm512_store_si512(panel + p * kTile + 16 * j, _mm512_or_si512(lo, hi));
        }
      }
      int64_t m = 0;
      for (; m + 4 <= M; m += 4) bf16_block<4>(xp + m * in.ld_pairs, in.ld_pairs, panel, np, y + m * ldy + c0, ldy);
      for (; m < M; ++m) bf16_block<1>(xp + m * in.ld_pairs, in.ld_pairs, panel, np, y + m * ldy + c0, ldy);
    }
  }
}
#pragma GCC pop_options

// Columns [n0, n1) (whole tiles) of y[M, N] = x @ W for a plain bf16 weight under the bf16 dot
// (in.pairs) on the AVX-512 BF16 dot. False where it does not apply (no pairs, another weight, a
// ragged tile, a CPU without AVX-512 BF16): the float path then multiplies the same rounded inputs.
static bool bf16_dot_cols(const Inputs& in, int64_t M, const Weight& w, int64_t n0, int64_t n1, float* y,
                          int64_t ldy) {
  if (!in.pairs || w.quantized() || w.bits != 16 || w.tiled || (n1 - n0) % kTile || !has_bf16_dot()) return false;
  bf16_dot_panels(in, M, w, n0, n1, y, ldy);
  return true;
}

// quantize_group for n a multiple of 16, with int8_step's and int8_code's arithmetic (roundscale
// rounds half to even, as nearbyint does).
static float quantize_group(const float* in, int64_t n, float* out, int8_t* codes, int32_t* sum) {
  __m512 amax = _mm512_setzero_ps();
  for (int64_t j = 0; j < n; j += 16) amax = _mm512_max_ps(amax, _mm512_abs_ps(_mm512_loadu_ps(in + j)));
  float step = _mm512_reduce_max_ps(amax) / 127.0f;
  if (step == 0.0f) step = 1.0f;
  const __m512 vstep = _mm512_set1_ps(step), lo = _mm512_set1_ps(-127.0f), hi = _mm512_set1_ps(127.0f);
  __m512i total = _mm512_setzero_si512();
  for (int64_t j = 0; j < n; j += 16) {
    __m512 c = _mm512_roundscale_ps(_mm512_div_ps(_mm512_loadu_ps(in + j), vstep), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm512_min_ps(hi, _mm512_max_ps(lo, c));
    const __m512i ci = _mm512_cvtps_epi32(c);
    _mm_storeu_si128(reinterpret_cast<__m128i*>(codes + j), _mm512_cvtsepi32_epi8(ci));
    _mm512_storeu_ps(out + j, _mm512_mul_ps(c, vstep));
    total = _mm512_add_epi32(total, ci);
  }
  *sum = _mm512_reduce_add_epi32(total);
  return step;
}
}  // namespace avx512
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma,f16c")
namespace avx2 {
// 16 lanes as two ymm in a plain struct, not a 64-byte GCC vector: an AVX2 target lowers those
// through the stack (measured: the int4 matvec ran no faster here than on the portable path).
struct v16 {
  __m256 lo, hi;
};
struct v16u {
  __m256i lo, hi;
};
// 16 ymm (a v16 is two): accumulators for at most eight, beside the decoded weights and a broadcast.
constexpr int fused_vectors(int rows) { return rows == 1 ? 4 : rows == 2 ? 2 : 1; }
constexpr int kPanelRowBlock = 6, kPanelVectors = 1;  // twelve accumulators, as BLIS's 6x16
static inline v16 operator+(v16 a, v16 b) { return {_mm256_add_ps(a.lo, b.lo), _mm256_add_ps(a.hi, b.hi)}; }
static inline v16 operator*(v16 a, v16 b) { return {_mm256_mul_ps(a.lo, b.lo), _mm256_mul_ps(a.hi, b.hi)}; }
static inline v16& operator+=(v16& a, v16 b) { return a = a + b; }
static inline v16u operator>>(v16u a, int bits) {
  const __m128i count = _mm_cvtsi32_si128(bits);
  return {_mm256_srl_epi32(a.lo, count), _mm256_srl_epi32(a.hi, count)};
}
static inline v16u operator&(v16u a, uint32_t mask) {
  const __m256i m = _mm256_set1_epi32(static_cast<int>(mask));
  return {_mm256_and_si256(a.lo, m), _mm256_and_si256(a.hi, m)};
}
static inline v16 to_float(v16u c) { return {_mm256_cvtepi32_ps(c.lo), _mm256_cvtepi32_ps(c.hi)}; }
static inline v16 load16(const float* p) { return {_mm256_loadu_ps(p), _mm256_loadu_ps(p + 8)}; }
static inline void store16(float* p, v16 v) { _mm256_storeu_ps(p, v.lo), _mm256_storeu_ps(p + 8, v.hi); }
static inline v16 splat(float f) { return {_mm256_set1_ps(f), _mm256_set1_ps(f)}; }
static inline v16u widen_bytes(const uint8_t* p) {
  return {_mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + 8)))};
}
static inline v16 bf16_to_f32(const uint16_t* p) {
  const auto half = [](const uint16_t* q) {
    return _mm256_castsi256_ps(
        _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(q))), 16));
  };
  return {half(p), half(p + 8)};
}
static inline v16 half16_to_f32(const uint16_t* p) {
  return {_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))),
          _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p + 8)))};
}
static bool int8_dot_tiles(const Inputs& in, int64_t M, const Weight& w, int64_t n0, int64_t tiles, float* y,
                           int64_t ldy);
static bool bf16_dot_cols(const Inputs&, int64_t, const Weight&, int64_t, int64_t, float*, int64_t) { return false; }
#include "gemm.inc"
#include "int8_dot_avx2.inc"

// quantize_group for n a multiple of 8, with int8_step's and int8_code's arithmetic (as avx512's).
static float quantize_group(const float* in, int64_t n, float* out, int8_t* codes, int32_t* sum) {
  const __m256 sign = _mm256_set1_ps(-0.0f);
  __m256 amax = _mm256_setzero_ps();
  for (int64_t j = 0; j < n; j += 8) amax = _mm256_max_ps(amax, _mm256_andnot_ps(sign, _mm256_loadu_ps(in + j)));
  __m128 m = _mm_max_ps(_mm256_castps256_ps128(amax), _mm256_extractf128_ps(amax, 1));
  m = _mm_max_ps(m, _mm_movehl_ps(m, m));
  m = _mm_max_ss(m, _mm_shuffle_ps(m, m, 1));
  float step = _mm_cvtss_f32(m) / 127.0f;
  if (step == 0.0f) step = 1.0f;
  const __m256 vstep = _mm256_set1_ps(step), lo = _mm256_set1_ps(-127.0f), hi = _mm256_set1_ps(127.0f);
  __m256i total = _mm256_setzero_si256();
  for (int64_t j = 0; j < n; j += 8) {
    __m256 c = _mm256_round_ps(_mm256_div_ps(_mm256_loadu_ps(in + j), vstep),
                               _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    c = _mm256_min_ps(hi, _mm256_max_ps(lo, c));
    const __m256i ci = _mm256_cvtps_epi32(c);
    const __m128i words = _mm_packs_epi32(_mm256_castsi256_si128(ci), _mm256_extracti128_si256(ci, 1));
    _mm_storel_epi64(reinterpret_cast<__m128i*>(codes + j), _mm_packs_epi16(words, words));
    _mm256_storeu_ps(out + j, _mm256_mul_ps(c, vstep));
    total = _mm256_add_epi32(total, ci);
  }
  __m128i t = _mm_add_epi32(_mm256_castsi256_si128(total), _mm256_extracti128_si256(total, 1));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0x4E));
  t = _mm_add_epi32(t, _mm_shuffle_epi32(t, 0xB1));
  *sum = _mm_cvtsi128_si32(t);
  return step;
}
}  // namespace avx2
#pragma GCC pop_options

namespace portable {
constexpr int fused_vectors(int) { return 4; }
constexpr int kPanelRowBlock = 4, kPanelVectors = 4;
static inline v16 to_float(v16u c) { return __builtin_convertvector(__builtin_convertvector(c, v16i), v16); }
static inline v16 load16(const float* p) {
  v16 v;
  std::memcpy(&v, p, sizeof(v));
  return v;
}
static inline void store16(float* p, v16 v) { std::memcpy(p, &v, sizeof(v)); }
static inline v16 splat(float f) { return v16{} + f; }
static inline v16u widen_bytes(const uint8_t* p) {
  v16u v;
  for (int i = 0; i < 16; ++i) v[i] = p[i];
  return v;
}
static inline v16 bf16_to_f32(const uint16_t* p) {
  v16 v;
  for (int i = 0; i < 16; ++i) v[i] = bf16_to_float(p[i]);
  return v;
}
static inline v16 half16_to_f32(const uint16_t* p) {
  v16 v;
  for (int i = 0; i < 16; ++i) v[i] = half_to_float(p[i]);
  return v;
}
static bool int8_dot_tiles(const Inputs&, int64_t, const Weight&, int64_t, int64_t, float*, int64_t) { return false; }
static bool bf16_dot_cols(const Inputs&, int64_t, const Weight&, int64_t, int64_t, float*, int64_t) { return false; }
#include "gemm.inc"
}  // namespace portable

using GemmCols = void (*)(const Inputs&, int64_t, const Weight&, int64_t, int64_t, float*, int64_t);

static GemmCols gemm_cols(Isa isa) {
  switch (isa) {
    case Isa::kAvx512: return avx512::gemm_cols;
    case Isa::kAvx2: return avx2::gemm_cols;
    default: return portable::gemm_cols;
  }
}

static float quantize_group(const float* in, int64_t n, float* out, int8_t* codes, int32_t* sum) {
  const Isa isa = current_isa();
  if (isa == Isa::kAvx512 && n % 16 == 0) return avx512::quantize_group(in, n, out, codes, sum);
  if (isa == Isa::kAvx2 && n % 8 == 0) return avx2::quantize_group(in, n, out, codes, sum);
  const float step = int8_step(in, n);
  int32_t total = 0;
  for (int64_t k = 0; k < n; ++k) {
    const float c = int8_code(in[k], step);
    codes[k] = static_cast<int8_t>(c);
    out[k] = c * step;
    total += static_cast<int32_t>(c);
  }
  *sum = total;
  return step;
}

extern "C" const char* jmoe_cpu_isa() {
  const Isa isa = current_isa();
  if (isa == Isa::kAvx512) return avx512::has_vnni() ? "avx512-vnni" : "avx512";
  if (isa == Isa::kAvx2) return "avx2";
  return "portable";
}

// Every kernel on `name` ("avx512", "avx2" or "portable") from the next call on: 1, or 0 where this
// CPU lacks it (nothing changes). The tests run the narrower paths with it; a user picks one with
// JMOE_CPU_ISA before the first call.
extern "C" int jmoe_cpu_set_isa(const char* name) {
  const std::string want = name;
  const Isa isa = want == "avx512" ? Isa::kAvx512 : want == "avx2" ? Isa::kAvx2 : Isa::kPortable;
  if ((want != "avx512" && want != "avx2" && want != "portable") || !cpu_has(isa)) return 0;
  active_isa().store(isa, std::memory_order_relaxed);
  return 1;
}

// The int8 dot's three-bit codes unpacked with GFNI (on = 1) or by shifts (0) from the next call on: 1, or 0
// where GFNI was asked for and the CPU lacks it (nothing changes). For the tests.
extern "C" int jmoe_cpu_use_gfni(int on) {
  if (on && !avx512::has_gfni()) return 0;
  avx512::use_gfni().store(on != 0, std::memory_order_relaxed);
  return 1;
}

// Whether the int8 dot unpacks three-bit codes with GFNI now.
extern "C" int jmoe_cpu_gfni() { return avx512::use_gfni().load(std::memory_order_relaxed) ? 1 : 0; }

// One product of a phase: y[M, N] (row stride ldy) = in @ w.
struct Product {
  Inputs in;
  int64_t M;
  Weight w;
  float* y;
  int64_t ldy;
};

// A phase's products cut into tasks of one column block each: kFewRowBlock columns for few rows
// (each task reads long runs of every weight row it touches), kBlock for many. Where the blocks
// alone would leave threads idle (one expert, or a projection of 512 or 2048 columns) a tiled
// weight's few-row product is cut into runs of whole tiles, and other few-row products are split
// over K into pieces of whole groups, each written to a partial buffer and summed afterwards
// (sum_pieces). Tasks point into the plan's own partial buffers: a plan stays where it was made.
struct PhasePlan {
  struct Task {
    int64_t product, n0, n1, k0, k1;
    float* y;
    int64_t ldy;
  };
  struct Pieces {
    int64_t count = 1, offset = 0;  // into parts: count partial [M, N] buffers
  };
  const std::vector<Product>& products;
  std::vector<Task> tasks;
  std::vector<int64_t> tasks_of;  // per product
  std::vector<Pieces> pieces;
  std::vector<float> parts;

  PhasePlan(int64_t threads, const std::vector<Product>& ps)
      : products(ps), tasks_of(ps.size()), pieces(ps.size()) {
    const int64_t want = 2 * threads;
    int64_t blocks = 0;
    for (const Product& p : products) {
      const int64_t width = p.M <= kFusedRows ? kFewRowBlock : kBlock;
      blocks += (p.w.n + width - 1) / width;
    }
    const bool narrow = blocks < want;  // the blocks alone would leave threads idle
    const int64_t split = (want + static_cast<int64_t>(products.size()) - 1) / static_cast<int64_t>(products.size());
    auto width_of = [&](const Product& p) -> int64_t {
      if (p.M > kFusedRows) return kBlock;
      if (!narrow || !p.w.tiled) return kFewRowBlock;
      const int64_t tiles = p.w.n / kTile;
      return std::min<int64_t>(kFewRowBlock, std::max<int64_t>(1, (tiles + split - 1) / split) * kTile);
    };
    int64_t part_floats = 0;
    for (size_t i = 0; i < products.size(); ++i) {
      const Product& p = products[i];
      if (p.M > kFusedRows || !narrow || p.w.tiled) continue;
      const int64_t most = std::max<int64_t>(1, p.w.k / kMinPieceRows);
      pieces[i].count = std::min<int64_t>(most, (want + blocks - 1) / blocks);
      pieces[i].offset = part_floats;
      if (pieces[i].count > 1) part_floats += pieces[i].count * p.M * p.w.n;
    }
    parts.resize(part_floats);
    for (size_t i = 0; i < products.size(); ++i) {
      const Product& p = products[i];
      const int64_t width = width_of(p), count = pieces[i].count, before = tasks.size();
      const int64_t unit = p.w.quantized() ? p.w.group : 8, units = (p.w.k + unit - 1) / unit;
      for (int64_t n0 = 0; n0 < p.w.n; n0 += width) {
        const int64_t n1 = std::min(p.w.n, n0 + width);
        if (count == 1) {
          tasks.push_back({static_cast<int64_t>(i), n0, n1, 0, p.w.k, p.y, p.ldy});
          continue;
        }
        for (int64_t s = 0; s < count; ++s)
          tasks.push_back({static_cast<int64_t>(i), n0, n1, std::min(p.w.k, units * s / count * unit),
                           std::min(p.w.k, units * (s + 1) / count * unit),
                           parts.data() + pieces[i].offset + s * p.M * p.w.n, p.w.n});
      }
      tasks_of[i] = static_cast<int64_t>(tasks.size()) - before;
    }
  }

  void run(GemmCols gemm, int64_t t) const {
    const Task& task = tasks[t];
    const Product& p = products[task.product];
    const Weight w = p.w.rows(task.k0, task.k1);
    if (!w.tiled) {
      gemm(p.in.from_k(task.k0), p.M, w, task.n0, task.n1, task.y, task.ldy);
      return;
    }
    for (int64_t c0 = task.n0; c0 < task.n1; c0 += kTile)  // blocks are whole tiles (N % kTile == 0)
      gemm(p.in.from_k(task.k0), p.M, w.tile(c0 / kTile), 0, kTile, task.y + c0, task.ldy);
  }

  // Product i's output from its pieces, once every task of it is done (nothing where it was not split).
  void sum_pieces(size_t i) const {
    const Product& p = products[i];
    if (pieces[i].count == 1) return;
    const float* part = parts.data() + pieces[i].offset;
    for (int64_t m = 0; m < p.M; ++m) {
      float* ym = p.y + m * p.ldy;
      std::memcpy(ym, part + m * p.w.n, p.w.n * sizeof(float));
      for (int64_t s = 1; s < pieces[i].count; ++s) {
        const float* ps = part + (s * p.M + m) * p.w.n;
        for (int64_t c = 0; c < p.w.n; ++c) ym[c] += ps[c];
      }
    }
  }
};

// Runs a phase's products on the pool (PhasePlan's tasks), one path for the whole phase.
static void run_products(ffi::ThreadPool& pool, const std::vector<Product>& products) {
  const PhasePlan plan(pool.num_threads(), products);
  const GemmCols gemm = gemm_cols(current_isa());
  parallel_for(pool, plan.tasks.size(), [&](int64_t t) { plan.run(gemm, t); });
  for (size_t i = 0; i < products.size(); ++i) plan.sum_pieces(i);
}

// A row loop over the pool (PoolInputs): tasks of 16 rows, one task for a single row.
static auto rows_on(ffi::ThreadPool& pool) {
  return [&pool](int64_t M, const std::function<void(int64_t)>& row) {
    const int64_t per = 16;
    parallel_for(pool, (M + per - 1) / per, [&](int64_t t) {
      for (int64_t m = t * per; m < std::min(M, (t + 1) * per); ++m) row(m);
    });
  };
}

// The inputs x [R, K] as each weight multiplies them (an expert pool's, or dense projections'): as
// they are, rounded per group for the int8 dot, or to bf16 for a plain bf16 weight under it; rounded
// once per distinct way among the weights: every row at once over the pool's threads, or (deferred)
// row by row as fill_rows asks.
struct PoolInputs {
  std::vector<QuantizedInputs> quantized;
  std::vector<Inputs> of_pool;
  std::vector<size_t> owner;  // the quantized copy pool t reads

  PoolInputs(ffi::ThreadPool* pool, const std::vector<const Weight*>& weights, const std::vector<bool>& int8_dot,
             const float* x, int64_t R, int64_t K)
      : quantized(weights.size()), of_pool(weights.size()), owner(weights.size()) {
    auto mode = [&](size_t t) {
      if (!int8_dot[t]) return QuantizedInputs::kAsIs;
      return weights[t]->quantized() ? QuantizedInputs::kInt8Groups
             : weights[t]->bits == 16 ? QuantizedInputs::kBf16
                                      : QuantizedInputs::kAsIs;
    };
    for (size_t t = 0; t < weights.size(); ++t) {
      size_t same = 0;
      while (same < t && !(mode(same) == mode(t) &&
                           (mode(t) != QuantizedInputs::kInt8Groups || weights[same]->group == weights[t]->group)))
        ++same;
      owner[t] = same;
      if (same < t) {
        of_pool[t] = of_pool[same];
        continue;
      }
      of_pool[t] = quantized[t].reserve(x, K, R, K, mode(t), weights[t]->group);
      if (pool && mode(t) != QuantizedInputs::kAsIs) rows_on(*pool)(R, [&](int64_t m) { quantized[t].fill_row(m); });
    }
  }

  // Rounds rows [m0, m1) for pool t's weight (a deferred PoolInputs, made without a thread pool).
  void fill_rows(size_t t, int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m) quantized[owner[t]].fill_row(m);
  }
};

// Weight description from a pool's buffers (leading slot dimension optional). Scales and offsets
// are float16, or uint8 codes with float32 bases [slots, 2, N] (8-bit scales); bases is empty otherwise.
static ffi::Error describe(ffi::AnyBuffer values, ffi::AnyBuffer scales, ffi::AnyBuffer offsets, ffi::AnyBuffer bases,
                           int64_t bits, int64_t group, bool symmetric, int64_t k, int64_t n, Weight* w,
                           bool tiled = false) {
  if (bits != 32 && bits != 16 && bits != 8 && bits != 4 && bits != 3 && bits != 2)
    return ffi::Error::InvalidArgument("bits must be 32, 16, 8, 4, 3 or 2");
  const auto dtype = values.element_type();
  if ((bits == 32 && dtype != ffi::F32) || (bits == 16 && dtype != ffi::BF16) || (bits <= 8 && dtype != ffi::U8))
    return ffi::Error::InvalidArgument("weight values have the wrong element type for their bits");
  if (bits <= 8 && (group != 32 && group != 64 && group != 128))
    return ffi::Error::InvalidArgument("group size must be 32, 64 or 128");
  const bool coded = bits <= 8 && scales.element_type() == ffi::U8;
  if (bits <= 8 && !coded && scales.element_type() != ffi::F16)
    return ffi::Error::InvalidArgument("scales must be float16 or uint8 codes");
  if (coded && (symmetric || offsets.element_type() != ffi::U8 || bases.element_type() != ffi::F32))
    return ffi::Error::InvalidArgument("8-bit scales need uint8 offsets and float32 bases (asymmetric only)");
  if (!coded && bits <= 8 && !symmetric && offsets.element_type() != ffi::F16)
    return ffi::Error::InvalidArgument("offsets must be float16 like the scales");
  *w = Weight{values.untyped_data(),
              bits <= 8 ? static_cast<const uint8_t*>(scales.untyped_data()) : nullptr,
              bits <= 8 && !symmetric ? static_cast<const uint8_t*>(offsets.untyped_data()) : nullptr,
              static_cast<int>(bits), group, symmetric, k, n};
  if (coded) {
    w->scale_bits = 8;
    w->bases = static_cast<const float*>(bases.untyped_data());
  }
  if (bits <= 8 && (scales.element_count() % w->scale_count() != 0 ||
                    (!symmetric && offsets.element_count() != scales.element_count()) ||
                    (coded && bases.element_count() != scales.element_count() / w->scale_count() * 2 * n)))
    return ffi::Error::InvalidArgument("scales, offsets or bases do not match the weight's shape");
  if (tiled) {
    if (n % kTile != 0) return ffi::Error::InvalidArgument("a tiled weight must have N a multiple of 64");
    w->tiled = true;
    w->tile_rows = w->quantized() ? w->padded_k() / group * w->group_rows() : k;
    w->tile_groups = w->quantized() ? w->padded_k() / w->group : 0;
  }
  return ffi::Error::Success();
}

// Six bits (kernel_formats.qarray.QPlanes) as one weight: the low plane (values, scales, offsets)
// with the high plane's codes beside it (Weight::high), where the int8 dot takes every tile (AVX-512
// VNNI, N a multiple of 64); else null, and the two planes run as the int4 and int2 weights they are.
static bool one_six_bit_weight(const Weight& low, const Weight& high, bool int8_dot, Weight* w) {
  if (!int8_dot || low.n % kTile != 0 || current_isa() != Isa::kAvx512 || !avx512::has_vnni()) return false;
  *w = low;
  w->bits = 6;
  w->high = static_cast<const uint8_t*>(high.values);
  return true;
}

// y [M, N] = x [M, K] @ W; six bits (bits 6): values, scales and offsets the low plane's, high_values
// and high_scales the high plane's (both empty otherwise). Batched: y [B, M, N] = x [B, M, K] @ W [B, K, N]
// for a plain untiled W (latent attention's per-head up-projections), one product a batch entry.
static ffi::Error matmul_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::AnyBuffer values,
                              ffi::AnyBuffer scales, ffi::AnyBuffer offsets, ffi::AnyBuffer bases,
                              ffi::AnyBuffer high_values, ffi::AnyBuffer high_scales, ffi::ResultBuffer<ffi::F32> y,
                              int64_t bits, int64_t group, bool symmetric, int64_t k, int64_t n, bool int8_dot,
                              bool tiled) {
  const bool six = bits == 6;
  if (six && symmetric) return ffi::Error::InvalidArgument("six bits are asymmetric");
  Weight w, high;
  if (auto err = describe(values, scales, offsets, bases, six ? 4 : bits, group, symmetric, k, n, &w, tiled);
      err.failure())
    return err;
  const auto dims = x.dimensions();
  const int64_t batch = dims.size() == 3 ? dims[0] : 1;
  if (dims.size() != 2 && dims.size() != 3) return ffi::Error::InvalidArgument("x must be [M, K] or [B, M, K]");
  if (batch != 1 && (w.quantized() || w.tiled || six))
    return ffi::Error::InvalidArgument("a batched matmul takes a plain untiled weight [B, K, N]");
  if (values.size_bytes() != static_cast<size_t>(batch * w.value_bytes()))
    return ffi::Error::InvalidArgument("weight values do not match [K, N] (or [B, K, N] for a batched x)");
  if (six) {
    if (auto err = describe(high_values, high_scales, offsets, bases, 2, group, true, k, n, &high, tiled);
        err.failure())
      return err;
    if (high_values.size_bytes() != static_cast<size_t>(high.value_bytes()))
      return ffi::Error::InvalidArgument("the high plane's values do not match [K, N]");
  }
  if (dims.back() != k) return ffi::Error::InvalidArgument("x's last dimension must be K");
  const int64_t M = dims[dims.size() - 2];
  // Under the int8 dot a plain bf16 weight multiplies inputs rounded to bf16 (the AVX-512 BF16 dot's).
  const PoolInputs rounded(&pool, {&w}, {int8_dot}, x.typed_data(), M * batch, k);
  const Inputs in = rounded.of_pool[0];
  float* yp = y->typed_data();
  if (batch != 1) {
    std::vector<Product> products;
    for (int64_t b = 0; b < batch; ++b)
      products.push_back(Product{in.from_row(b * M), M, w.slot(b), yp + b * M * n, n});
    run_products(pool, products);
    return ffi::Error::Success();
  }
  if (!six || one_six_bit_weight(w, high, int8_dot, &w)) {
    run_products(pool, {Product{in, M, w, yp, n}});
    return ffi::Error::Success();
  }
  std::vector<float> high_part(M * n);
  run_products(pool, {Product{in, M, w, yp, n}, Product{in, M, high, high_part.data(), n}});
  for (int64_t i = 0; i < M * n; ++i) yp[i] += high_part[i];
  return ffi::Error::Success();
}

// W8A8: a row onto its per-token int8 grid, as kernel_formats.qarray.quantize_activations does it
// (step = max |a| / 127, or 1 for a zero row; codes rounded half to even and clipped to +-127).
static void quantize_int8_per_token(float* a, int64_t n) {
  const float step = int8_step(a, n);
  for (int64_t j = 0; j < n; ++j) a[j] = int8_code(a[j], step) * step;
}

static inline float sigmoid_times(float g, float gain) { return g / (1.0f + std::exp(-gain * g)); }

// One layer's expert pools and how its experts compute (the attributes both FFN targets share).
struct ExpertPools {
  Weight gu, dn;  // gate_up [slots, D, 2F], down [slots, F, D]
  const float* gu_bias = nullptr;
  const float* dn_bias = nullptr;  // [slots, 2F], [slots, D] or none
  int64_t D = 0, F = 0, slots = 0;
  bool clamped = false, dn_int8_inputs = false;
  bool gu_int8_dot = false, dn_int8_dot = false;  // the int8 dot (Inputs::quantize) per weight
  float alpha = 1.702f, limit = 7.0f;
};

template <typename T>
static ffi::Error attr(const ffi::Dictionary& attrs, const char* name, T* out) {
  auto v = attrs.get<T>(name);
  if (v.has_error()) return ffi::Error::InvalidArgument(std::string("missing attribute ") + name);
  *out = *v;
  return ffi::Error::Success();
}

// The pool's attributes: the layer's shape and activation under their own names, the pool's own
// (formats, slots, int8 inputs) with `suffix` appended (a multi-pool call numbers its pools).
static ffi::Error read_pools(ffi::AnyBuffer gu_values, ffi::AnyBuffer gu_scales, ffi::AnyBuffer gu_offsets,
                             ffi::AnyBuffer gu_bases, ffi::Buffer<ffi::F32> gu_bias, ffi::AnyBuffer dn_values,
                             ffi::AnyBuffer dn_scales, ffi::AnyBuffer dn_offsets, ffi::AnyBuffer dn_bases,
                             ffi::Buffer<ffi::F32> dn_bias, const ffi::Dictionary& attrs, ExpertPools* p,
                             const std::string& suffix = "") {
  int64_t gu_bits, gu_group, dn_bits, dn_group;
  bool gu_sym, dn_sym, gu_tiled, dn_tiled;
  auto own = [&](const char* name) { return std::string(name) + suffix; };
  for (auto e : {attr(attrs, own("gu_bits").c_str(), &gu_bits), attr(attrs, own("gu_group").c_str(), &gu_group),
                 attr(attrs, own("gu_symmetric").c_str(), &gu_sym), attr(attrs, own("dn_bits").c_str(), &dn_bits),
                 attr(attrs, own("dn_group").c_str(), &dn_group), attr(attrs, own("dn_symmetric").c_str(), &dn_sym),
                 attr(attrs, own("gu_tiled").c_str(), &gu_tiled), attr(attrs, own("dn_tiled").c_str(), &dn_tiled),
                 attr(attrs, "hidden", &p->D), attr(attrs, "inner", &p->F),
                 attr(attrs, own("slots").c_str(), &p->slots),
                 attr(attrs, "clamped", &p->clamped), attr(attrs, "alpha", &p->alpha), attr(attrs, "limit", &p->limit),
                 attr(attrs, own("dn_int8_inputs").c_str(), &p->dn_int8_inputs),
                 attr(attrs, own("gu_int8_dot").c_str(), &p->gu_int8_dot),
                 attr(attrs, own("dn_int8_dot").c_str(), &p->dn_int8_dot)})
    if (e.failure()) return e;
  if (auto e = describe(gu_values, gu_scales, gu_offsets, gu_bases, gu_bits, gu_group, gu_sym, p->D, 2 * p->F,
                        &p->gu, gu_tiled); e.failure())
    return e;
  if (auto e = describe(dn_values, dn_scales, dn_offsets, dn_bases, dn_bits, dn_group, dn_sym, p->F, p->D, &p->dn,
                        dn_tiled); e.failure())
    return e;
  if (gu_values.size_bytes() != static_cast<size_t>(p->slots * p->gu.value_bytes()) ||
      dn_values.size_bytes() != static_cast<size_t>(p->slots * p->dn.value_bytes()))
    return ffi::Error::InvalidArgument("pool values do not match [slots, K, N]");
  if (gu_bias.element_count() > 0) {
    if (gu_bias.element_count() != static_cast<size_t>(p->slots * 2 * p->F) ||
        dn_bias.element_count() != static_cast<size_t>(p->slots * p->D))
      return ffi::Error::InvalidArgument("bias pools do not match [slots, N]");
    p->gu_bias = gu_bias.typed_data();
    p->dn_bias = dn_bias.typed_data();
  }
  return ffi::Error::Success();
}

// Rows [row0, row0 + rows) of the inputs all run through the expert in `slot` of pool `tier`.
struct Run {
  int64_t row0, rows, slot, tier = 0;
};

// Weights [K, N_i] that multiply the same x [M, K] (a layer's q, k and v projections; an MLP's gate
// and up), in one call: a result y_i [M, N_i] per weight (no slices of one wide result to copy out
// afterwards). One pass over
// the pool takes every weight's tasks, where a call each made a round trip (and an int8 rounding of
// x) per weight. Per weight i: the values, scales, offsets and bases of jmoe_cpu_matmul (six bits
// excepted) and attributes bits<i>, group<i>, symmetric<i>, n<i>, tiled<i>, int8_dot<i>; k shared.
constexpr size_t kWeightBuffers = 4;

static ffi::Error matmuls_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> x, ffi::RemainingArgs buffers,
                               ffi::RemainingRets outs, ffi::Dictionary attrs) {
  if (buffers.size() == 0 || buffers.size() % kWeightBuffers != 0)
    return ffi::Error::InvalidArgument("matmuls wants four buffers per weight");
  int64_t k;
  if (auto e = attr(attrs, "k", &k); e.failure()) return e;
  const auto dims = x.dimensions();
  if (dims.size() != 2 || dims[1] != k) return ffi::Error::InvalidArgument("x must be [M, K]");
  const int64_t M = dims[0], count = buffers.size() / kWeightBuffers;
  std::vector<Weight> weights(count);
  std::vector<const Weight*> of(count);
  std::vector<bool> int8_dot(count);
  for (int64_t i = 0; i < count; ++i) {
    auto any = [&](size_t j) { return buffers.get<ffi::AnyBuffer>(kWeightBuffers * i + j); };
    auto values = any(0), scales = any(1), offsets = any(2), bases = any(3);
    if (!values.has_value() || !scales.has_value() || !offsets.has_value() || !bases.has_value())
      return ffi::Error::InvalidArgument("matmuls: a weight buffer has the wrong type");
    const std::string own = std::to_string(i);
    int64_t bits, group, n;
    bool symmetric, tiled, dot;
    for (auto e : {attr(attrs, ("bits" + own).c_str(), &bits), attr(attrs, ("group" + own).c_str(), &group),
                   attr(attrs, ("symmetric" + own).c_str(), &symmetric), attr(attrs, ("n" + own).c_str(), &n),
                   attr(attrs, ("tiled" + own).c_str(), &tiled), attr(attrs, ("int8_dot" + own).c_str(), &dot)})
      if (e.failure()) return e;
    if (bits == 6) return ffi::Error::InvalidArgument("matmuls takes no six-bit weight");
    if (auto e = describe(*values, *scales, *offsets, *bases, bits, group, symmetric, k, n, &weights[i], tiled);
        e.failure())
      return e;
    if (values->size_bytes() != static_cast<size_t>(weights[i].value_bytes()))
      return ffi::Error::InvalidArgument("weight values do not match [K, N]");
    of[i] = &weights[i], int8_dot[i] = dot;
  }
  if (outs.size() != static_cast<size_t>(count)) return ffi::Error::InvalidArgument("matmuls wants a result per weight");
  const PoolInputs in(&pool, of, int8_dot, x.typed_data(), M, k);
  std::vector<Product> products;
  for (int64_t i = 0; i < count; ++i) {
    auto out = outs.get<ffi::Buffer<ffi::F32>>(i);
    if (!out.has_value()) return ffi::Error::InvalidArgument("matmuls: a result is not float32");
    const auto od = (*out)->dimensions();
    if (od.size() != 2 || od[0] != M || od[1] != weights[i].n)
      return ffi::Error::InvalidArgument("matmuls: result i must be [M, N of weight i]");
    products.push_back({in.of_pool[i], M, weights[i], (*out)->typed_data(), weights[i].n});
  }
  run_products(pool, products);
  return ffi::Error::Success();
}

// The activation of rows [m0, m1) of an expert's gate/up output h [., 2F] into act [., F].
static void activate(const ExpertPools& p, int64_t slot, const float* h, float* act, int64_t m0, int64_t m1) {
  const int64_t F = p.F;
  const float* bias = p.gu_bias ? p.gu_bias + slot * 2 * F : nullptr;
  for (int64_t m = m0; m < m1; ++m) {
    const float* hm = h + m * 2 * F;
    float* am = act + m * F;
    for (int64_t j = 0; j < F; ++j) {
      float g = hm[j], u = hm[F + j];
      if (bias) g += bias[j], u += bias[F + j];
      if (p.clamped) {
        g = std::min(g, p.limit);
        u = std::max(std::min(u, p.limit), -p.limit);
        am[j] = (u + 1.0f) * sigmoid_times(g, p.alpha);
      } else {
        am[j] = sigmoid_times(g, 1.0f) * u;
      }
    }
    if (p.dn_int8_inputs) quantize_int8_per_token(am, F);
  }
}

// y[r] = down(act(gate_up(x[r]))) for the rows of every run, each expert's weights read once; a
// run reads the pool of its tier (pools share D, F and the activation). One pass over the pool's
// threads: the gate/up tasks of every run, then the down tasks. Whoever finishes a run's last
// gate/up task computes its activation and rounds it for the down product; a down task waits for
// its run's (every gate/up task is taken before the first down task, so the wait is short and
// always ends). One token's experts keep every core busy with no round trip between phases.
static void run_experts(ffi::ThreadPool& pool, const std::vector<const ExpertPools*>& pools,
                        const std::vector<Run>& runs, const float* x, int64_t R, float* y) {
  const ExpertPools& first = *pools[0];
  const int64_t D = first.D, F = first.F;
  std::vector<float> h(R * 2 * F), act(R * F);
  std::vector<const Weight*> gu_weights, dn_weights;
  std::vector<bool> gu_int8, dn_int8;
  for (const ExpertPools* p : pools) {
    gu_weights.push_back(&p->gu), dn_weights.push_back(&p->dn);
    gu_int8.push_back(p->gu_int8_dot), dn_int8.push_back(p->dn_int8_dot);
  }
  const PoolInputs gu_in(&pool, gu_weights, gu_int8, x, R, D);
  PoolInputs dn_in(nullptr, dn_weights, dn_int8, act.data(), R, F);
  std::vector<Product> gu, dn;
  for (const Run& r : runs) {
    gu.push_back({gu_in.of_pool[r.tier].from_row(r.row0), r.rows, pools[r.tier]->gu.slot(r.slot),
                  h.data() + r.row0 * 2 * F, 2 * F});
    dn.push_back({dn_in.of_pool[r.tier].from_row(r.row0), r.rows, pools[r.tier]->dn.slot(r.slot), y + r.row0 * D, D});
  }
  const PhasePlan gu_plan(pool.num_threads(), gu), dn_plan(pool.num_threads(), dn);
  std::vector<std::atomic<int64_t>> left(runs.size());  // per run: gate/up tasks not done
  std::vector<std::atomic<bool>> ready(runs.size());    // per run: its down inputs rounded
  for (size_t i = 0; i < runs.size(); ++i) {
    left[i].store(gu_plan.tasks_of[i], std::memory_order_relaxed);
    ready[i].store(false, std::memory_order_relaxed);
  }
  const GemmCols gemm = gemm_cols(current_isa());
  const int64_t gu_tasks = gu_plan.tasks.size();
  parallel_for(pool, gu_tasks + dn_plan.tasks.size(), [&](int64_t t) {
    if (t >= gu_tasks) {
      const int64_t i = dn_plan.tasks[t - gu_tasks].product;
      while (!ready[i].load(std::memory_order_acquire)) std::this_thread::yield();
      dn_plan.run(gemm, t - gu_tasks);
      return;
    }
    gu_plan.run(gemm, t);
    const int64_t i = gu_plan.tasks[t].product;
    if (left[i].fetch_sub(1, std::memory_order_acq_rel) != 1) return;
    const Run& r = runs[i];
    gu_plan.sum_pieces(i);
    activate(*pools[r.tier], r.slot, h.data(), act.data(), r.row0, r.row0 + r.rows);
    dn_in.fill_rows(r.tier, r.row0, r.row0 + r.rows);
    ready[i].store(true, std::memory_order_release);
  });
  for (size_t i = 0; i < runs.size(); ++i) dn_plan.sum_pieces(i);
  for (const Run& r : runs) {
    const ExpertPools& p = *pools[r.tier];
    if (!p.dn_bias) continue;
    const float* bias = p.dn_bias + r.slot * D;
    for (int64_t m = r.row0; m < r.row0 + r.rows; ++m)
      for (int64_t c = 0; c < D; ++c) y[m * D + c] += bias[c];
  }
}

// A prefill routes thousands of rows to the experts: they run in chunks of at most kChunkRows
// rows (a run of one expert's rows may be split between two), so the scratch of run_experts and
// the routed rows' gathered copies stay a few MiB, reused chunk after chunk. (Whole, they were
// about 160 MiB per MoE layer at Qwen3-30B-A3B's widths for a 512-token chunk: the step's peak
// memory, and fresh pages faulted in at every layer.) 256 rows rather than 512 took about 20 MiB off
// the Qwen3-30B-A3B slice's resident set after a prefill, at the same prefill speed (Zen 5).
constexpr int64_t kChunkRows = 256;

// Runs over rows [row0, row0 + rows) of the inputs; its runs' row0 count from the chunk's.
struct Chunk {
  int64_t row0 = 0, rows = 0;
  std::vector<Run> runs;
};

// `runs` (in row order) cut into chunks spanning at most `most` rows each (gaps between runs included).
static std::vector<Chunk> chunks_of(const std::vector<Run>& runs, int64_t most) {
  std::vector<Chunk> out;
  for (Run r : runs) {
    while (r.rows > 0) {
      if (out.empty() || r.row0 - out.back().row0 >= most) out.push_back({r.row0, 0, {}});
      Chunk& c = out.back();
      const int64_t take = std::min(r.rows, most - (r.row0 - c.row0));
      c.runs.push_back({r.row0 - c.row0, take, r.slot, r.tier});
      c.rows = r.row0 + take - c.row0;
      r.row0 += take, r.rows -= take;
    }
  }
  return out;
}

// jmoe.kernels.expert_ffn.reference's contract: rows [R, D] in blocks of block_rows, block b through the
// expert in slot block_slot[b] (-1: zeros); consecutive blocks of one slot run as one matmul.
static ffi::Error expert_ffn_impl(ffi::ThreadPool pool, ffi::AnyBuffer gu_values, ffi::AnyBuffer gu_scales,
                                  ffi::AnyBuffer gu_offsets, ffi::AnyBuffer gu_bases, ffi::Buffer<ffi::F32> gu_bias,
                                  ffi::AnyBuffer dn_values, ffi::AnyBuffer dn_scales, ffi::AnyBuffer dn_offsets,
                                  ffi::AnyBuffer dn_bases, ffi::Buffer<ffi::F32> dn_bias,
                                  ffi::Buffer<ffi::F32> rows, ffi::Buffer<ffi::S32> block_slot,
                                  ffi::ResultBuffer<ffi::F32> out, ffi::Dictionary attrs) {
  ExpertPools p;
  if (auto e = read_pools(gu_values, gu_scales, gu_offsets, gu_bases, gu_bias, dn_values, dn_scales, dn_offsets,
                         dn_bases, dn_bias, attrs, &p);
      e.failure())
    return e;
  int64_t block_rows;
  if (auto e = attr(attrs, "block_rows", &block_rows); e.failure()) return e;
  const int64_t R = rows.dimensions()[0], nb = block_slot.element_count(), D = p.D;
  if (rows.dimensions().size() != 2 || rows.dimensions()[1] != D || nb * block_rows != R)
    return ffi::Error::InvalidArgument("rows must be [blocks * block_rows, D]");
  std::vector<Run> runs;
  const int32_t* bs = block_slot.typed_data();
  float* y = out->typed_data();
  for (int64_t b = 0; b < nb; ++b) {
    const int64_t s = bs[b];
    if (s < 0 || s >= p.slots) {  // empty block (or an out-of-range slot): zeros
      std::fill(y + b * block_rows * D, y + (b + 1) * block_rows * D, 0.0f);
      continue;
    }
    if (!runs.empty() && runs.back().slot == s && runs.back().row0 + runs.back().rows == b * block_rows)
      runs.back().rows += block_rows;
    else
      runs.push_back({b * block_rows, block_rows, s});
  }
  for (const Chunk& c : chunks_of(runs, kChunkRows))
    run_experts(pool, {&p}, c.runs, rows.typed_data() + c.row0 * D, c.rows, y + c.row0 * D);
  return ffi::Error::Success();
}

// Routed assignments, grouped here: out[a] = expert slot[a] of pool tier[a] (tier: none, pool 0)
// applied to h[token[a]] (slot -1: zeros). Each expert runs once over exactly the rows routed to it
// (no padding to blocks), every pool's experts in the same passes. With combine weights (weight
// [A], else empty) the output is each token's sum instead: out [N, D], out[n] = sum over the
// assignments a of token n of weight[a] * (their expert's output), added chunk by chunk, so no
// [A, D] array is ever held (32 MiB for a 512-token prompt at Qwen3-30B-A3B's widths).
static ffi::Error run_routed(ffi::ThreadPool& pool, const std::vector<const ExpertPools*>& pools,
                             ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::S32> slot,
                             const int32_t* tier, ffi::Buffer<ffi::F32> weight, ffi::ResultBuffer<ffi::F32>& out) {
  const int64_t D = pools[0]->D, A = slot.element_count(), T = pools.size();
  if (h.dimensions().size() != 2 || h.dimensions()[1] != D || token.element_count() != static_cast<size_t>(A))
    return ffi::Error::InvalidArgument("h must be [N, D] and token, slot [A]");
  const int64_t N = h.dimensions()[0];
  const bool combine = weight.element_count() != 0;
  if (combine && weight.element_count() != static_cast<size_t>(A))
    return ffi::Error::InvalidArgument("weight must be empty or one combine weight per assignment [A]");
  const auto od = out->dimensions();
  if (od.size() != 2 || od[0] != (combine ? N : A) || od[1] != D)
    return ffi::Error::InvalidArgument(combine ? "out must be [N, D]" : "out must be [A, D]");
  float* y = out->typed_data();
  const float* w = combine ? weight.typed_data() : nullptr;
  if (combine) std::fill(y, y + N * D, 0.0f);
  const int32_t *tok = token.typed_data(), *sl = slot.typed_data();
  auto tier_of = [&](int64_t a) -> int64_t { return tier ? tier[a] : 0; };
  std::vector<int64_t> order;
  for (int64_t a = 0; a < A; ++a) {
    const int64_t t = tier_of(a);
    if (t >= 0 && t < T && sl[a] >= 0 && sl[a] < pools[t]->slots && tok[a] >= 0 && tok[a] < N)
      order.push_back(a);
    else if (!combine)
      std::fill(y + a * D, y + (a + 1) * D, 0.0f);
  }
  if (order.empty()) return ffi::Error::Success();
  std::stable_sort(order.begin(), order.end(), [&](int64_t i, int64_t j) {
    return tier_of(i) != tier_of(j) ? tier_of(i) < tier_of(j) : sl[i] < sl[j];
  });
  const int64_t R = order.size();
  std::vector<Run> runs;
  for (int64_t i = 0; i < R; ++i) {
    const int64_t a = order[i];
    if (!runs.empty() && runs.back().slot == sl[a] && runs.back().tier == tier_of(a))
      runs.back().rows += 1;
    else
      runs.push_back({i, 1, sl[a], tier_of(a)});
  }
  const int64_t most = std::min(R, kChunkRows);
  std::vector<float> xs(most * D), ys(most * D);  // one chunk's rows, gathered, and their outputs
  for (const Chunk& c : chunks_of(runs, most)) {
    for (int64_t i = 0; i < c.rows; ++i)
      std::memcpy(xs.data() + i * D, h.typed_data() + tok[order[c.row0 + i]] * D, D * sizeof(float));
    run_experts(pool, pools, c.runs, xs.data(), c.rows, ys.data());
    for (int64_t i = 0; i < c.rows; ++i) {
      const int64_t a = order[c.row0 + i];
      const float* yi = ys.data() + i * D;
      if (!combine) {
        std::memcpy(y + a * D, yi, D * sizeof(float));
        continue;
      }
      float* yn = y + tok[a] * D;
      const float wa = w[a];
      for (int64_t d = 0; d < D; ++d) yn[d] += wa * yi[d];
    }
  }
  return ffi::Error::Success();
}

static ffi::Error routed_ffn_impl(ffi::ThreadPool pool, ffi::AnyBuffer gu_values, ffi::AnyBuffer gu_scales,
                                  ffi::AnyBuffer gu_offsets, ffi::AnyBuffer gu_bases, ffi::Buffer<ffi::F32> gu_bias,
                                  ffi::AnyBuffer dn_values, ffi::AnyBuffer dn_scales, ffi::AnyBuffer dn_offsets,
                                  ffi::AnyBuffer dn_bases, ffi::Buffer<ffi::F32> dn_bias,
                                  ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::S32> token, ffi::Buffer<ffi::S32> slot,
                                  ffi::Buffer<ffi::F32> weight, ffi::ResultBuffer<ffi::F32> out,
                                  ffi::Dictionary attrs) {
  ExpertPools p;
  if (auto e = read_pools(gu_values, gu_scales, gu_offsets, gu_bases, gu_bias, dn_values, dn_scales, dn_offsets,
                         dn_bases, dn_bias, attrs, &p);
      e.failure())
    return e;
  return run_routed(pool, {&p}, h, token, slot, nullptr, weight, out);
}

// routed_ffn over several pools (tiers) at once: tier[a] picks assignment a's pool. The pools follow
// the inputs, kPoolBuffers buffers each (as the single-pool target takes them), their attributes numbered
// by pool (gu_bits0, gu_bits1, ...).
constexpr size_t kPoolBuffers = 10;  // per weight: values, scales, offsets, bases, bias

static ffi::Error routed_ffn_tiers_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> h, ffi::Buffer<ffi::S32> token,
                                        ffi::Buffer<ffi::S32> slot, ffi::Buffer<ffi::S32> tier,
                                        ffi::Buffer<ffi::F32> weight, ffi::RemainingArgs buffers, ffi::ResultBuffer<ffi::F32> out,
                                        ffi::Dictionary attrs) {
  if (buffers.size() == 0 || buffers.size() % kPoolBuffers != 0)
    return ffi::Error::InvalidArgument("routed_ffn_tiers wants ten buffers per pool");
  if (tier.element_count() != slot.element_count())
    return ffi::Error::InvalidArgument("routed_ffn_tiers wants a tier per assignment");
  std::vector<ExpertPools> storage(buffers.size() / kPoolBuffers);
  std::vector<const ExpertPools*> pools;
  for (size_t t = 0; t < storage.size(); ++t) {
    auto any = [&](size_t i) { return buffers.get<ffi::AnyBuffer>(kPoolBuffers * t + i); };
    auto f32 = [&](size_t i) { return buffers.get<ffi::Buffer<ffi::F32>>(kPoolBuffers * t + i); };
    auto guv = any(0), gus = any(1), guo = any(2), gua = any(3), dnv = any(5), dns = any(6), dno = any(7),
         dna = any(8);
    auto gub = f32(4), dnb = f32(9);
    if (!guv.has_value() || !gus.has_value() || !guo.has_value() || !gua.has_value() || !gub.has_value() ||
        !dnv.has_value() || !dns.has_value() || !dno.has_value() || !dna.has_value() || !dnb.has_value())
      return ffi::Error::InvalidArgument("routed_ffn_tiers: a pool buffer has the wrong type");
    if (auto e = read_pools(*guv, *gus, *guo, *gua, *gub, *dnv, *dns, *dno, *dna, *dnb, attrs, &storage[t],
                            std::to_string(t));
        e.failure())
      return e;
    pools.push_back(&storage[t]);
  }
  return run_routed(pool, pools, h, token, slot, tier.typed_data(), weight, out);
}

// A paged cache: pool [P, H, page, w] with new [B, H, T, w] written from logical slot start[b] of
// each row b, row b's slot s at pool[table[b, s / page], :, s % page] (table [B, n], n pages a row).
// Slots outside [0, n * page) and pages outside [0, P) are skipped. The result aliases the pool
// (input_output_aliases), so only the new rows are written: XLA's own update, read by both the
// attention and the step's output, was fused into each and copied the whole cache for every copy.
static ffi::Error write_rows_impl(ffi::AnyBuffer pool, ffi::AnyBuffer rows, ffi::Buffer<ffi::S32> start,
                                  ffi::Buffer<ffi::S32> table, ffi::Result<ffi::AnyBuffer> out) {
  const auto pd = pool.dimensions(), rd = rows.dimensions(), td = table.dimensions();
  if (pd.size() != 4 || rd.size() != 4 || td.size() != 2 || pd[1] != rd[1] || pd[3] != rd[3] || td[0] != rd[0] ||
      pool.element_type() != rows.element_type() || start.element_count() != static_cast<size_t>(rd[0]))
    return ffi::Error::InvalidArgument("write_rows wants pool [P, H, page, w], rows [B, H, T, w] of its type, "
                                       "start [B] and table [B, n]");
  const int64_t P = pd[0], H = pd[1], page = pd[2], B = rd[0], T = rd[2], n = td[1];
  const size_t row_bytes = ffi::ByteWidth(pool.element_type()) * pd[3];
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  if (dst != pool.untyped_data()) std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  const auto* src = static_cast<const uint8_t*>(rows.untyped_data());
  for (int64_t b = 0; b < B; ++b)
    for (int64_t t = 0; t < T; ++t) {
      const int64_t s = static_cast<int64_t>(start.typed_data()[b]) + t;
      if (s < 0 || s >= n * page) continue;
      const int64_t p = table.typed_data()[b * n + s / page];
      if (p < 0 || p >= P) continue;
      for (int64_t h = 0; h < H; ++h)
        std::memcpy(dst + ((p * H + h) * page + s % page) * row_bytes, src + ((b * H + h) * T + t) * row_bytes,
                    row_bytes);
    }
  return ffi::Error::Success();
}

// Greedy decoding's choice per row of logits [B, V]: the first index of the row's largest value,
// NaNs never chosen (a row of NaNs gives V - 1). A vector max, then the first index holding it:
// XLA:CPU (jax 0.10) ran the same two reductions over a 151,936-token vocabulary in about 0.4 ms.
// The largest of x[0 : 8 * (n / 8)], NaNs skipped; *done: how many elements that is.
__attribute__((target("avx2"))) static float vector_max(const float* x, int64_t n, int64_t* done) {
  __m256 m = _mm256_set1_ps(-INFINITY);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) m = _mm256_max_ps(_mm256_loadu_ps(x + i), m);  // a NaN operand gives m back
  alignas(32) float lanes[8];
  _mm256_store_ps(lanes, m);
  float best = -INFINITY;
  for (float v : lanes) best = std::max(best, v);
  *done = i;
  return best;
}

// The first i < 8 * (n / 8) with x[i] == value, or 8 * (n / 8) where there is none.
__attribute__((target("avx2"))) static int64_t vector_find(const float* x, int64_t n, float value) {
  const __m256 v = _mm256_set1_ps(value);
  int64_t i = 0;
  for (; i + 8 <= n; i += 8) {
    const int equal = _mm256_movemask_ps(_mm256_cmp_ps(_mm256_loadu_ps(x + i), v, _CMP_EQ_OQ));
    if (equal) return i + __builtin_ctz(equal);
  }
  return i;
}

// Whether the vector parts run: on the instruction set the kernels chose (both wide paths have
// AVX2; JMOE_CPU_ISA=portable keeps this scalar too).
static bool vectors() { return current_isa() != Isa::kPortable; }

static float row_max(const float* x, int64_t n) {
  int64_t i = 0;
  float best = vectors() ? vector_max(x, n, &i) : -INFINITY;
  for (; i < n; ++i)  // the rest one element at a time
    if (x[i] > best) best = x[i];
  return best;
}

static ffi::Error first_max_impl(ffi::Buffer<ffi::F32> logits, ffi::ResultBuffer<ffi::S32> out) {
  const auto d = logits.dimensions();
  if (d.size() != 2 || d[1] == 0 || out->element_count() != static_cast<size_t>(d[0]))
    return ffi::Error::InvalidArgument("first_max wants logits [B, V] (V > 0) and a result [B]");
  const int64_t B = d[0], V = d[1];
  for (int64_t b = 0; b < B; ++b) {
    const float* x = logits.typed_data() + b * V;
    const float best = row_max(x, V);
    int64_t i = vectors() ? vector_find(x, V, best) : 0;
    while (i < V && !(x[i] == best)) ++i;  // -inf rows find their first -inf; NaN rows run off the end
    out->typed_data()[b] = static_cast<int32_t>(std::min<int64_t>(i, V - 1));
  }
  return ffi::Error::Success();
}

// Rows of a pool [S, ...] replaced in place: row slot[i] = bytes [offset, offset + row bytes) of
// source row r[i] for every i with 0 <= slot[i] < S and 0 <= r[i] < n (others are skipped); r[i] = i
// without `source_row`. source [n, ...] of any type: an expert record's raw bytes, each leaf of the
// pool at its offset, need no conversion or slice. XLA:CPU's own dynamic_update_slice converts a
// bfloat16 array to float32 and back, a copy of the whole pool per write.
static ffi::Error copy_rows(ffi::AnyBuffer pool, ffi::AnyBuffer source, const int32_t* source_row,
                            ffi::Buffer<ffi::S32> slot, ffi::Result<ffi::AnyBuffer> out, int64_t offset) {
  const auto pd = pool.dimensions();
  const auto sd = source.dimensions();
  const int64_t m = static_cast<int64_t>(slot.element_count());
  const int64_t n = source_row ? (sd.size() ? sd[0] : 0) : m;
  if (pd.size() < 1 || pd[0] == 0 || n == 0 || source.size_bytes() % n != 0)
    return ffi::Error::InvalidArgument("write_slots wants pool [S, ...], values [n, ...] and slot [n]");
  const int64_t S = pd[0];
  const size_t row_bytes = pool.size_bytes() / S, stride = source.size_bytes() / n;
  if (offset < 0 || offset + row_bytes > stride)
    return ffi::Error::InvalidArgument("write_slots: a pool row does not fit its value row at that offset");
  auto* dst = static_cast<uint8_t*>(out->untyped_data());
  if (dst != pool.untyped_data()) std::memcpy(dst, pool.untyped_data(), pool.size_bytes());
  const auto* src = static_cast<const uint8_t*>(source.untyped_data());
  for (int64_t i = 0; i < m; ++i) {
    const int64_t s = slot.typed_data()[i];
    const int64_t r = source_row ? source_row[i] : i;
    if (s >= 0 && s < S && r >= 0 && r < n) std::memcpy(dst + s * row_bytes, src + r * stride + offset, row_bytes);
  }
  return ffi::Error::Success();
}

static ffi::Error write_slots_impl(ffi::AnyBuffer pool, ffi::AnyBuffer values, ffi::Buffer<ffi::S32> slot,
                                   ffi::Result<ffi::AnyBuffer> out, int64_t offset) {
  return copy_rows(pool, values, nullptr, slot, out, offset);
}

// write_slots reading its rows out of a store [n, ...] by index, for every leaf of a pool in one call:
// the CPU's in-step fetch, straight from the host store into the pool (no record materialised,
// nothing done for a skipped fetch). The store and indices first, then the leaves, each aliased to its
// result and read at its offset.
static ffi::Error copy_records_impl(ffi::AnyBuffer store, ffi::Buffer<ffi::S32> row, ffi::Buffer<ffi::S32> slot,
                                    ffi::RemainingArgs leaves, ffi::RemainingRets outs,
                                    ffi::Span<const int64_t> offsets) {
  if (row.element_count() != slot.element_count())
    return ffi::Error::InvalidArgument("copy_records wants as many store rows as slots");
  if (leaves.size() != outs.size() || leaves.size() != offsets.size())
    return ffi::Error::InvalidArgument("copy_records wants a result and an offset per leaf");
  for (size_t i = 0; i < leaves.size(); ++i) {
    auto leaf = leaves.get<ffi::AnyBuffer>(i);
    auto out = outs.get<ffi::AnyBuffer>(i);
    if (!leaf.has_value() || !out.has_value()) return ffi::Error::InvalidArgument("copy_records: a leaf is not a buffer");
    ffi::Error error = copy_rows(*leaf, store, row.typed_data(), slot, *out, offsets[i]);
    if (error.failure()) return error;
  }
  return ffi::Error::Success();
}

}  // namespace jmoe

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoeCpuMatmul, jmoe::matmul_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("bits")
                                  .Attr<int64_t>("group")
                                  .Attr<bool>("symmetric")
                                  .Attr<int64_t>("k")
                                  .Attr<int64_t>("n")
                                  .Attr<bool>("int8_dot")
                                  .Attr<bool>("tiled"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoeCpuMatmuls, jmoe::matmuls_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attrs());

// Both FFN targets take the pools first, then their own inputs, and their attributes as a dictionary.
static auto bind_pools() {
  return ffi::Ffi::Bind()
      .Ctx<ffi::ThreadPool>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::AnyBuffer>()
      .Arg<ffi::Buffer<ffi::F32>>();
}

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoeCpuExpertFfn, jmoe::expert_ffn_impl,
                              bind_pools()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attrs());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoeCpuRoutedFfn, jmoe::routed_ffn_impl,
                              bind_pools()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attrs());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoeCpuRoutedFfnTiers, jmoe::routed_ffn_tiers_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .RemainingArgs()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attrs());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoeCpuFirstMax, jmoe::first_max_impl,
                              ffi::Ffi::Bind().Arg<ffi::Buffer<ffi::F32>>().Ret<ffi::Buffer<ffi::S32>>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoeCpuWriteRows, jmoe::write_rows_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>());

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoeCpuWriteSlots, jmoe::write_slots_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Ret<ffi::AnyBuffer>()
                                  .Attr<int64_t>("offset"));

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoeCpuCopyRecords, jmoe::copy_records_impl,
                              ffi::Ffi::Bind()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .RemainingArgs()
                                  .RemainingRets()
                                  .Attr<ffi::Span<const int64_t>>("offsets"));

// A Python extension module of its own (so setuptools builds and installs it); the handlers are
// read from the shared object with ctypes.
#include <Python.h>
static struct PyModuleDef native_module = {PyModuleDef_HEAD_INIT, "_native", nullptr, -1, nullptr};
PyMODINIT_FUNC PyInit__native(void) { return PyModule_Create(&native_module); }
