// Decode attention over the paged KV cache (kernels.cpp binds it): one query token per
// sequence against its cached keys / values, read in place through its block table, in
// float32 over a float32 or float16 cache. Our softmax's exp is Cephes' (vec_exp.h);
// otherwise the arithmetic is softmax(q k^T * scale) v's, up to the order of float additions.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "vec_exp.h"

namespace {

// scores[0..L) <- exp(scores - max), returning their sum; the max in *most (-inf for L = 0).
inline float softmax_numerators(float* scores, int64_t L, float* most) {
  __m512 top = _mm512_set1_ps(-INFINITY);
  int64_t l = 0;
  for (; l + 16 <= L; l += 16) top = _mm512_max_ps(top, _mm512_loadu_ps(scores + l));
  const __mmask16 tail = static_cast<__mmask16>((1u << (L - l)) - 1);
  top = _mm512_mask_max_ps(top, tail, top, _mm512_maskz_loadu_ps(tail, scores + l));
  *most = _mm512_reduce_max_ps(top);
  const __m512 shift = _mm512_set1_ps(*most);
  __m512 total = _mm512_setzero_ps();
  for (l = 0; l + 16 <= L; l += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(scores + l), shift));
    _mm512_storeu_ps(scores + l, e);
    total = _mm512_add_ps(total, e);
  }
  const __m512 e = exp16(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, scores + l), shift));
  _mm512_mask_storeu_ps(scores + l, tail, e);
  total = _mm512_mask_add_ps(total, tail, total, e);
  return _mm512_reduce_add_ps(total);
}

// 16 cached values as float32: a float32 cache's as they are, a float16 cache's
// (KV_CACHE_DTYPE=float16, stored as uint16_t) widened, which is exact.
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// The row of KV head `kvh` at position `pos` of a sequence: its slot found through `table`.
// Calls f(l, row) for l = 0 .. L - 1, row the cached row (of KV head kvh) of position
// first + l, found through `table`: a block's rows one after another, one division a block.
template <class T, class F>
inline void for_each_row(const T* base, const int64_t* table, int64_t block_size, int64_t first, int64_t L,
                         int64_t KV, int64_t kvh, int64_t D, F&& f) {
  constexpr int64_t kBytes = sizeof(T);
  for (int64_t l = 0; l < L;) {
    const int64_t pos = first + l, offset = pos % block_size, n = std::min(block_size - offset, L - l);
    const int64_t block = pos / block_size;
    const T* row = base + ((table[block] * block_size + offset) * KV + kvh) * D;
    if (l + n < L) {  // the next block's rows, wherever the table put it: no prefetcher guesses that
      const char* next = reinterpret_cast<const char*>(base + (table[block + 1] * block_size * KV + kvh) * D);
      const int64_t rows = std::min(block_size, L - l - n);
      for (int64_t i = 0; i < rows; ++i) {
        for (int64_t b = 0; b < D * kBytes; b += 64) _mm_prefetch(next + i * KV * D * kBytes + b, _MM_HINT_T0);
      }
    }
    for (int64_t i = 0; i < n; ++i, ++l) f(l, row + i * KV * D);
  }
}

// One (sequence, KV head) of paged_decode_attention: its G query heads over positions
// first .. first + L - 1, found through `table`. DV: head_dim / 16; GT query heads share
// each loaded value row, their DV * GT accumulators in registers.
// One span of one (sequence, KV head): its G query heads over positions first .. first + L - 1,
// found through `table`. DV: head_dim / 16; GT query heads share each loaded value row, their
// DV * GT accumulators in registers. With `top` null the span is the whole context and `out`
// gets softmax(scores) v; otherwise `out` gets the span's exp(scores - top) v unnormalized,
// top[g] the span's largest score and total[g] its numerators' sum, for merge_spans.
template <int DV, int GT, class T>
void attend_span(const float* qg, float* out, float* top, float* total, const T* kp, const T* vp,
                 const int64_t* table, int64_t block_size, int64_t first, int64_t L, int64_t G, int64_t KV,
                 int64_t kvh, float scale, float* scores) {
  constexpr int64_t D = DV * 16;
  for_each_row(kp, table, block_size, first, L, KV, kvh, D, [&](int64_t l, const T* kl) {
    __m512 k[DV];
    for (int d = 0; d < DV; ++d) k[d] = load16(kl + d * 16);
    for (int64_t g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(qg + g * D), k[0]);
      for (int d = 1; d < DV; ++d) acc = _mm512_fmadd_ps(_mm512_loadu_ps(qg + g * D + d * 16), k[d], acc);
      scores[g * L + l] = _mm512_reduce_add_ps(acc) * scale;
    }
  });
  for (int64_t g0 = 0; g0 < G; g0 += GT) {
    const int64_t gn = std::min<int64_t>(GT, G - g0);
    __m512 acc[GT][DV];
    float inv[GT];
    for (int g = 0; g < GT; ++g) {
      if (g < gn) {
        float most;
        const float sum = softmax_numerators(scores + (g0 + g) * L, L, &most);
        inv[g] = top ? 1.f : 1.f / sum;
        if (top) top[g0 + g] = most, total[g0 + g] = sum;
      }
      for (int d = 0; d < DV; ++d) acc[g][d] = _mm512_setzero_ps();
    }
    for_each_row(vp, table, block_size, first, L, KV, kvh, D, [&](int64_t l, const T* vl) {
      __m512 v[DV];
      for (int d = 0; d < DV; ++d) v[d] = load16(vl + d * 16);
      for (int g = 0; g < GT; ++g) {
        if (g < gn) {
          const __m512 w = _mm512_set1_ps(scores[(g0 + g) * L + l]);
          for (int d = 0; d < DV; ++d) acc[g][d] = _mm512_fmadd_ps(w, v[d], acc[g][d]);
        }
      }
    });
    for (int g = 0; g < gn; ++g) {
      for (int d = 0; d < DV; ++d) {
        _mm512_storeu_ps(out + (g0 + g) * D + d * 16, _mm512_mul_ps(acc[g][d], _mm512_set1_ps(inv[g])));
      }
    }
  }
}

// One task's S spans into og [G, D], each span's share rescaled to the largest score of all
// (as one softmax over the whole context). Span s's partials are `tasks` units after span
// s - 1's: acc + s * tasks * G * D [G, D], top and total + s * tasks * G [G].
void merge_spans(float* og, const float* acc, const float* top, const float* total, int64_t S, int64_t tasks,
                 int64_t G, int64_t D) {
  std::vector<float> weight(static_cast<size_t>(S));
  for (int64_t g = 0; g < G; ++g) {
    float most = -INFINITY, sum = 0.f;
    for (int64_t s = 0; s < S; ++s) most = std::max(most, top[s * tasks * G + g]);
    for (int64_t s = 0; s < S; ++s) {
      weight[s] = total[s * tasks * G + g] > 0.f ? std::exp(top[s * tasks * G + g] - most) : 0.f;
      sum += weight[s] * total[s * tasks * G + g];
    }
    for (int64_t d = 0; d < D; ++d) {
      float value = 0.f;
      for (int64_t s = 0; s < S; ++s) value += weight[s] * acc[(s * tasks * G + g) * D + d];
      og[g * D + d] = value / sum;
    }
  }
}

// A decode batch of fewer (sequence, KV head) tasks than this many per thread splits each
// context into one span per thread, when the batch attends over at least kSplitFrom
// (position, KV head) pairs: one stream's attention (3 KV heads on the default model) would
// otherwise run on one core. Measured on 2 cores, one sequence, 3 KV heads, float16 cache:
// 171 positions 0.95x, 256 1.12x, 512 1.37x, 2048 1.73x against one thread.
constexpr int64_t kTasksPerThread = 4;
constexpr int64_t kSplitFrom = 768;

struct Batch {  // paged_decode_attention's operands, as pointers
  const float* q;
  float* out;
  const int64_t* tables;
  const int64_t* lens;
  int64_t B, H, KV, D, max_blocks, block_size, window;
  float scale;
};

// Positions first .. first + L - 1 of sequence b (its last `window` with a sliding window),
// cut in S spans: span s's [from, to).
void span_of(const Batch& a, int64_t b, int64_t s, int64_t S, int64_t& from, int64_t& to) {
  const int64_t length = a.lens[b], first = a.window > 0 ? std::max<int64_t>(0, length - a.window) : 0;
  const int64_t L = length - first, step = (L + S - 1) / S;
  from = std::min(length, first + s * step);
  to = std::min(length, from + step);
}

template <class T>
void attend(const Batch& a, const T* kp, const T* vp, int64_t task, int64_t s, int64_t S, float* out, float* top,
            float* total, std::vector<float>& scores) {
  const int64_t b = task / a.KV, kvh = task % a.KV, G = a.H / a.KV;
  int64_t from, to;
  span_of(a, b, s, S, from, to);
  const int64_t L = to - from;
  if (L == 0) {  // a short context's empty span: no share in the merge
    for (int64_t g = 0; g < G; ++g) top[g] = -INFINITY, total[g] = 0.f;
    std::fill(out, out + G * a.D, 0.f);
    return;
  }
  const int64_t* table = a.tables + b * a.max_blocks;
  const float* qg = a.q + (b * a.H + kvh * G) * a.D;  // the G query heads of this KV head
  scores.resize(static_cast<size_t>(G * L));
  float* sp = scores.data();
  if (a.D == 32) attend_span<2, 8>(qg, out, top, total, kp, vp, table, a.block_size, from, L, G, a.KV, kvh, a.scale, sp);
  if (a.D == 64) attend_span<4, 4>(qg, out, top, total, kp, vp, table, a.block_size, from, L, G, a.KV, kvh, a.scale, sp);
  if (a.D == 128) attend_span<8, 2>(qg, out, top, total, kp, vp, table, a.block_size, from, L, G, a.KV, kvh, a.scale, sp);
}

// The batch's tasks, one per (sequence, KV head), over a cache of T (float32 or float16's
// bits): whole contexts, or S spans each merged after (unit u: span u / tasks of task
// u % tasks, so each thread's run of units holds its span of every task).
template <class T>
void attend_paged(const Batch& a, const T* kp, const T* vp) {
  const int64_t tasks = a.B * a.KV, G = a.H / a.KV, threads = at::get_num_threads();
  int64_t work = 0;  // (position, KV head) pairs attended
  for (int64_t b = 0; b < a.B; ++b) {
    int64_t from, to;
    span_of(a, b, 0, 1, from, to);
    work += (to - from) * a.KV;
  }
  const int64_t S = threads > 1 && tasks < kTasksPerThread * threads && work >= kSplitFrom ? threads : 1;
  if (S == 1) {
    auto whole = [&](int64_t begin, int64_t end) {
      std::vector<float> scores;
      for (int64_t task = begin; task < end; ++task) {
        attend(a, kp, vp, task, 0, 1, a.out + task * G * a.D, nullptr, nullptr, scores);
      }
    };
    tasks < 4 ? whole(0, tasks) : at::parallel_for(0, tasks, 1, whole);
    return;
  }
  const int64_t units = S * tasks;  // partials: acc [S, tasks, G, D], top and total [S, tasks, G]
  std::vector<float> acc(static_cast<size_t>(units * G * a.D)), top(static_cast<size_t>(units * G)),
      total(static_cast<size_t>(units * G));
  at::parallel_for(0, units, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> scores;
    for (int64_t u = begin; u < end; ++u) {
      attend(a, kp, vp, u % tasks, u / tasks, S, acc.data() + u * G * a.D, top.data() + u * G, total.data() + u * G,
             scores);
    }
  });
  for (int64_t task = 0; task < tasks; ++task) {
    merge_spans(a.out + task * G * a.D, acc.data() + task * G * a.D, top.data() + task * G, total.data() + task * G, S,
                tasks, G, a.D);
  }
}

}  // namespace

// One query token for each of B sequences against its cached keys / values, read in place
// through its block table: no gather into a padded copy, no mask, no work past a
// sequence's own length. q: [B, H, D]; keys, values: [num_slots, KV, D] (a layer's flat
// slot views, float32 or float16); block_tables: [B, max_blocks] int64; context_lens: [B]
// int64; `window` > 0 keeps each query's last `window` positions (a sliding window). One
// task per (sequence, KV head), or per span of one with few tasks (attend_paged). head_dim
// 32, 64 or 128. -> [B, H, D] float32.
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     double scale, int64_t window) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && keys.sizes() == values.sizes(), "q [B, H, D]; keys [S, KV, D]");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous(), "contiguous operands");
  const bool half = keys.scalar_type() == torch::kFloat16;
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && (half || keys.scalar_type() == torch::kFloat32) &&
                  values.scalar_type() == keys.scalar_type(), "q float32; keys, values float32 or float16");
  TORCH_CHECK(block_tables.scalar_type() == torch::kInt64 && context_lens.scalar_type() == torch::kInt64, "int64");
  const int64_t B = q.size(0), H = q.size(1), D = q.size(2), KV = keys.size(1);
  TORCH_CHECK((D == 32 || D == 64 || D == 128) && H % KV == 0 && keys.size(2) == D,
              "head_dim 32, 64 or 128; H a multiple of KV");
  TORCH_CHECK(block_tables.dim() == 2 && block_tables.size(0) == B && context_lens.numel() == B, "one row a sequence");
  auto tables = block_tables.contiguous(), lens = context_lens.contiguous();
  const int64_t max_blocks = tables.size(1), num_slots = keys.size(0);
  const int64_t *tp = tables.data_ptr<int64_t>(), *lp = lens.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(lp[b] >= 1 && lp[b] <= max_blocks * block_size, "context length outside its block table");
    for (int64_t i = 0; i < (lp[b] + block_size - 1) / block_size; ++i) {
      const int64_t block = tp[b * max_blocks + i];
      TORCH_CHECK(block >= 0 && (block + 1) * block_size <= num_slots, "a block table points outside the cache");
    }
  }
  torch::Tensor out = torch::empty_like(q);
  const Batch batch{q.data_ptr<float>(), out.data_ptr<float>(), tp, lp, B, H, KV, D, max_blocks, block_size,
                    window, static_cast<float>(scale)};
  if (half) {
    attend_paged(batch, static_cast<const uint16_t*>(keys.data_ptr()), static_cast<const uint16_t*>(values.data_ptr()));
  } else {
    attend_paged(batch, keys.data_ptr<float>(), values.data_ptr<float>());
  }
  return out;
}

