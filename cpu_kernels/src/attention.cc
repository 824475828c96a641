// Decode attention over a paged heads-major KV cache, read where it lies.
//
// A score may be the sum of two terms, each a query part times its own cached keys (latent
// attention's latent and rotary keys): the query is both parts side by side and a key row the two
// arrays' rows, made float32 side by side before the dot (each int8 row times its own scale).
//
// A few current tokens (decode, speculative verification) attend to the keys each may reach in the
// cache: a pool of pages [P, K, page, w] (float32, bfloat16 or int8 with a scale per slot) and a
// page table [B, n], row b's logical slot s at pool[table[b, s / page], :, s % page]. XLA:CPU ran
// the same scores and values as batched dots at 7-15 GB/s and copied each block of keys transposed
// first; here each task streams one (row, cache head)'s keys and values once, page by page, every
// query head of its group at a time, with an online softmax (no score matrix held beyond 32 keys).
// Long ranges are cut into chunks whose partial softmaxes are merged at the end (flash-decoding), so
// one row's few heads still use every thread. Where a head has 16 queries or more (a prompt chunk of
// a model with few, narrow heads; a verification at Qwen3's), the queries are vector lanes instead
// (attend_chunk_lanes): each pass is then two small matrix products, 1.1-1.6x faster there.

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <vector>

#include <immintrin.h>

#include "isa.h"
#include "parallel.h"
#include "xla/ffi/api/ffi.h"

namespace ffi = xla::ffi;

namespace jmoe {

typedef float f32x16 __attribute__((vector_size(64)));
typedef float f32x8 __attribute__((vector_size(32)));
typedef float f32x4 __attribute__((vector_size(16)));
typedef int32_t i32x16 __attribute__((vector_size(64)));
typedef int32_t i32x8 __attribute__((vector_size(32)));
typedef uint32_t u32x16 __attribute__((vector_size(64)));
typedef uint16_t u16x16 __attribute__((vector_size(32)));
typedef int8_t i8x16 __attribute__((vector_size(16)));

// What one task reads: the queries of one (row, cache head) and a range of its logical slots.
struct AttentionChunk {
  const float* q;  // [M, w], query m is head m / T's token m % T
  int64_t M, T, w, wv;
  int64_t kw;                  // the keys' width: w, or less where a second term holds the rest
  const void* keys;            // page 0's [page, kw] of this head; page p's page_stride rows further
  const float* key_scales;     // [page] likewise (int8 keys) or null
  const void* keys2;           // the second score term's keys [page, w - kw] likewise, or null
  const float* key2_scales;    // [page] (int8) or null
  const void* values;          // [page, wv]
  const float* value_scales;   // [page] (int8 values) or null
  ffi::DataType type;           // of keys and values alike
  const int32_t* table;        // [n]: the row's pages, those outside [0, pages) absent
  int64_t pages, page, page_stride;
  const int64_t* first;        // [T]: token t attends to slots [first[t], last[t])
  const int64_t* last;
  int64_t s0, s1;              // this chunk's slots
  float scale;
};

#pragma GCC push_options
#pragma GCC target("avx512f,avx512bw,avx512vl,avx512dq,fma")
// (The target pragma does not define __AVX512F__ or __AVX2__: the body is told which it is.)
#define JMOE_ATTENTION_ISA 512
namespace attention_avx512 {
#include "attention_body.inc"
}
#undef JMOE_ATTENTION_ISA
#pragma GCC pop_options

#pragma GCC push_options
#pragma GCC target("avx2,fma")
#define JMOE_ATTENTION_ISA 2
namespace attention_avx2 {
#include "attention_body.inc"
}
#undef JMOE_ATTENTION_ISA
#pragma GCC pop_options

#define JMOE_ATTENTION_ISA 0
namespace attention_portable {
#include "attention_body.inc"
}
#undef JMOE_ATTENTION_ISA

using Attend = void (*)(const AttentionChunk&, float*, float*, float*);

static Attend attend_for(Isa isa) {  // the matmul kernels' choice (isa.h)
  switch (isa) {
    case Isa::kAvx512: return attention_avx512::attend;
    case Isa::kAvx2: return attention_avx2::attend;
    default: return attention_portable::attend;
  }
}

constexpr int64_t kMinChunkKeys = 256;  // a chunk shorter than this costs more to merge than it saves

static bool cache_type(ffi::DataType t) { return t == ffi::F32 || t == ffi::BF16 || t == ffi::S8; }

// q [B, K, M, w] (M = groups x T, head-major) against the pages of keys [P, K, page, kw] and values
// [P, K, page, wv] (int8 ones with scales [P, K, page, 1]; float ones with empty scales) that table
// [B, n] gives each row, S = n * page logical slots a row (pages outside [0, P): absent slots). Token t
// of row b at slot start[b] + t attends to slots [key_start[b], start[b] + t], within `window` slots
// when window > 0.
// keys2 [P, K, page, w - kw] (and its scales) or empty: a second score term, whose query is q's last
// w - kw columns (kw = w without one).
// sink [K * groups] or empty: a logit per query head that joins the normaliser without a value.
// Out: the normalised attention [B, K, M, wv], and per query the softmax's maximum and normaliser
// [B, K, M] (-inf and 0 where a query has no key and no sink; its output is then 0).
static ffi::Error attention_impl(ffi::ThreadPool pool, ffi::Buffer<ffi::F32> q, ffi::AnyBuffer keys,
                                 ffi::Buffer<ffi::F32> key_scales, ffi::AnyBuffer keys2,
                                 ffi::Buffer<ffi::F32> key2_scales, ffi::AnyBuffer values,
                                 ffi::Buffer<ffi::F32> value_scales, ffi::Buffer<ffi::S32> start,
                                 ffi::Buffer<ffi::S32> key_start, ffi::Buffer<ffi::S32> table,
                                 ffi::Buffer<ffi::F32> sink,
                                 ffi::ResultBuffer<ffi::F32> out, ffi::ResultBuffer<ffi::F32> top_out,
                                 ffi::ResultBuffer<ffi::F32> norm_out, int64_t groups, float scale, int64_t window) {
  const auto qd = q.dimensions(), kd = keys.dimensions(), vd = values.dimensions(), td = table.dimensions();
  const bool two_terms = keys2.element_count() != 0;
  const auto k2d = keys2.dimensions();
  if (qd.size() != 4 || kd.size() != 4 || vd.size() != 4 || td.size() != 2 || (two_terms && k2d.size() != 4) ||
      groups < 1 || qd[2] % groups != 0)
    return ffi::Error::InvalidArgument("attention wants q [B, K, groups * T, w], keys [P, K, page, kw], "
                                       "keys2 [P, K, page, w - kw] or empty, values [P, K, page, wv] and table [B, n]");
  const int64_t B = qd[0], K = qd[1], M = qd[2], w = qd[3], T = M / groups, wv = vd[3], kw = kd[3];
  const int64_t P = kd[0], page = kd[2], n = td[1], S = n * page;
  const bool keys2_fit = two_terms ? k2d[0] == P && k2d[1] == K && k2d[2] == page && kw + k2d[3] == w : kw == w;
  if (kd[1] != K || !keys2_fit || vd[0] != P || vd[1] != K || vd[2] != page || td[0] != B ||
      start.element_count() != static_cast<size_t>(B) || key_start.element_count() != static_cast<size_t>(B))
    return ffi::Error::InvalidArgument("attention: queries, keys, values, table and positions disagree on their "
                                       "shapes");
  if (!cache_type(keys.element_type()) || values.element_type() != keys.element_type() ||
      (two_terms && keys2.element_type() != keys.element_type()))
    return ffi::Error::InvalidArgument("attention reads float32, bfloat16 or int8 caches, keys and values alike");
  const bool int8 = keys.element_type() == ffi::S8;
  const size_t slots = static_cast<size_t>(P * K * page);
  if (key_scales.element_count() != (int8 ? slots : 0) || value_scales.element_count() != (int8 ? slots : 0) ||
      key2_scales.element_count() != (int8 && two_terms ? slots : 0))
    return ffi::Error::InvalidArgument("attention: int8 caches want a scale per slot, float caches none");
  if (sink.element_count() != 0 && sink.element_count() != static_cast<size_t>(K * groups))
    return ffi::Error::InvalidArgument("attention: the sink has one logit per query head");
  const size_t bytes = ffi::ByteWidth(keys.element_type());

  // Each row's reach per token, and the slots some token of the row reaches.
  std::vector<int64_t> first(B * T), last(B * T), lo(B), hi(B);
  for (int64_t b = 0; b < B; ++b) {
    lo[b] = S, hi[b] = 0;
    for (int64_t t = 0; t < T; ++t) {
      const int64_t slot = static_cast<int64_t>(start.typed_data()[b]) + t;
      int64_t f = std::max<int64_t>(key_start.typed_data()[b], 0);
      if (window > 0) f = std::max(f, slot - window + 1);
      const int64_t l = std::min(slot + 1, S);
      first[b * T + t] = f, last[b * T + t] = l;
      if (f < l) lo[b] = std::min(lo[b], f), hi[b] = std::max(hi[b], l);
    }
  }
  // Chunks: enough tasks for every thread twice over, none shorter than kMinChunkKeys.
  const int64_t want = 2 * static_cast<int64_t>(pool.num_threads());
  struct Task {
    int64_t b, k, s0, s1;
  };
  std::vector<Task> tasks;
  std::vector<int64_t> first_task(B * K + 1);
  for (int64_t b = 0; b < B; ++b) {
    const int64_t reach = std::max<int64_t>(hi[b] - lo[b], 0);
    const int64_t chunks = std::max<int64_t>(1, std::min((want + B * K - 1) / (B * K), reach / kMinChunkKeys));
    for (int64_t k = 0; k < K; ++k) {
      first_task[b * K + k] = static_cast<int64_t>(tasks.size());
      for (int64_t c = 0; c < chunks; ++c)
        tasks.push_back({b, k, lo[b] + reach * c / chunks, lo[b] + reach * (c + 1) / chunks});
    }
  }
  first_task[B * K] = static_cast<int64_t>(tasks.size());
  std::vector<float> tops(tasks.size() * M, -INFINITY), norms(tasks.size() * M, 0.0f);
  std::vector<float> accs(tasks.size() * M * wv, 0.0f);
  const float* qp = q.typed_data();
  const auto* kp = static_cast<const uint8_t*>(keys.untyped_data());
  const auto* k2p = two_terms ? static_cast<const uint8_t*>(keys2.untyped_data()) : nullptr;
  const auto* vp = static_cast<const uint8_t*>(values.untyped_data());
  const Attend attend = attend_for(current_isa());
  parallel_for(pool, static_cast<int64_t>(tasks.size()), [&](int64_t i) {
    const Task& task = tasks[i];
    const int64_t head = task.b * K + task.k;
    AttentionChunk c;
    c.q = qp + head * M * w, c.M = M, c.T = T, c.w = w, c.wv = wv, c.kw = kw;
    c.keys = kp + task.k * page * kw * bytes, c.values = vp + task.k * page * wv * bytes;
    c.key_scales = int8 ? key_scales.typed_data() + task.k * page : nullptr;
    c.keys2 = two_terms ? k2p + task.k * page * (w - kw) * bytes : nullptr;
    c.key2_scales = int8 && two_terms ? key2_scales.typed_data() + task.k * page : nullptr;
    c.value_scales = int8 ? value_scales.typed_data() + task.k * page : nullptr;
    c.type = keys.element_type();
    c.table = table.typed_data() + task.b * n, c.pages = P, c.page = page, c.page_stride = K * page;
    c.first = first.data() + task.b * T, c.last = last.data() + task.b * T;
    c.s0 = task.s0, c.s1 = task.s1, c.scale = scale;
    attend(c, tops.data() + i * M, norms.data() + i * M, accs.data() + i * M * wv);
  });
  // Merge each head's chunks (and its sink) into one softmax.
  for (int64_t head = 0; head < B * K; ++head) {
    const int64_t k = head % K;
    for (int64_t m = 0; m < M; ++m) {
      const bool has_sink = sink.element_count() != 0;
      const float sink_logit = has_sink ? sink.typed_data()[k * groups + m / T] : -INFINITY;
      float top = sink_logit;
      for (int64_t i = first_task[head]; i < first_task[head + 1]; ++i) top = std::max(top, tops[i * M + m]);
      float norm = has_sink ? std::exp(sink_logit - top) : 0.0f;
      float* o = out->typed_data() + (head * M + m) * wv;
      std::fill(o, o + wv, 0.0f);
      for (int64_t i = first_task[head]; i < first_task[head + 1]; ++i) {
        if (tops[i * M + m] == -INFINITY) continue;
        const float weight = std::exp(tops[i * M + m] - top);
        norm += norms[i * M + m] * weight;
        const float* a = accs.data() + (i * M + m) * wv;
        for (int64_t d = 0; d < wv; ++d) o[d] += a[d] * weight;
      }
      if (norm > 0.0f)
        for (int64_t d = 0; d < wv; ++d) o[d] /= norm;
      top_out->typed_data()[head * M + m] = top;
      norm_out->typed_data()[head * M + m] = norm;
    }
  }
  return ffi::Error::Success();
}

}  // namespace jmoe

XLA_FFI_DEFINE_HANDLER_SYMBOL(JmoeCpuAttention, jmoe::attention_impl,
                              ffi::Ffi::Bind()
                                  .Ctx<ffi::ThreadPool>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::AnyBuffer>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::S32>>()
                                  .Arg<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Ret<ffi::Buffer<ffi::F32>>()
                                  .Attr<int64_t>("groups")
                                  .Attr<float>("scale")
                                  .Attr<int64_t>("window"));
