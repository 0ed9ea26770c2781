// Attention over the paged KV cache (kernels.cpp binds it), one arithmetic for every query
// row: a decode's token, a verify step's 1 + k, a prefill chunk's, after cached context or
// not. Row r of q attends over positions [lo, len[r]) of its sequence (lo = 0, or the last
// `window` positions), read in place through its block table, in float32 over a float32 or
// float16 cache, after the step's new keys and values were written there.
//
// Batch invariance (issue "Same request, same answer"): a row's result depends on its query,
// its length and the cache alone, never on the other rows, how many there are, or how the
// work is cut among threads. The positions are cut into spans of kSpan, aligned to absolute
// positions (0, 256, 512 ...), so a span's partial (its largest score, its numerators' sum,
// its unnormalized exp(scores - top) v) is the same whether the row is a decode or a prefill
// chunk's. In a span, a score is q . k as a chain of multiply-adds over d in 16 lanes, the
// lanes then added in one fixed order (hsum16x16, 16 positions' chains at once, for a decode's
// rows as for a prefill tile's), the numerators are summed in 16 lanes
// by position mod 16 then reduced in _mm512_reduce_add_ps's order, and v is accumulated in
// position order. Rows that share a unit (a sequence's tile of rows, a KV head, a span) share
// the loads; a row's lanes outside its own range hold exactly 0 (its sums and products
// unchanged). The spans merge in order, as one softmax over the whole context. Our softmax's
// exp is Cephes' (vec_exp.h); otherwise softmax(q k^T * scale) v up to the order of additions.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "vec_exp.h"

namespace {

constexpr int64_t kSpan = 256;     // positions per span: 16 blocks of 16
constexpr int64_t kRowTile = 16;   // rows of one sequence a unit takes (a prefill chunk's tokens)
constexpr int kScoreGroup = 8;     // queries whose scores share each key load
constexpr int64_t kScoreRow = kSpan + 16;  // a query's scores: rows 4 KiB apart would alias in L1

struct Rows {  // the operands, as pointers
  const float* q;          // [N, H, D]
  const int64_t* tables;   // [S, max_blocks]
  const int64_t* seq;      // [N]: the row's block table
  const int64_t* len;      // [N]: positions [lo, len) seen
  int64_t N, H, KV, D, max_blocks, block_size, window;
  float scale;
  float softcap;  // > 0: each score becomes softcap * tanh(score / softcap) (Gemma 2); 0: off
};

inline int64_t first_seen(const Rows& a, int64_t r) {
  return a.window > 0 ? std::max<int64_t>(0, a.len[r] - a.window) : 0;
}

// 16 cached values as float32: a float32 cache's as they are, a float16 cache's widened (exact).
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const uint16_t* p) { return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))); }

// The sums of 16 vectors' lanes at once, each in one fixed order (lane i with i + 8, then i + 4,
// i + 2, i + 1): lane j of the result is v[j]'s sum.
inline __m512 hsum16x16(const __m512 (&v)[16]) {
  __m512 u[8], w[4], x[2];
  for (int k = 0; k < 8; ++k) {  // lane i of each 8: i + 8
    u[k] = _mm512_add_ps(_mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0x44),
                         _mm512_shuffle_f32x4(v[2 * k], v[2 * k + 1], 0xEE));
  }
  for (int k = 0; k < 4; ++k) {  // chunk m of w[k]: v[4k + m]'s i + 4
    w[k] = _mm512_add_ps(_mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0x88),
                         _mm512_shuffle_f32x4(u[2 * k], u[2 * k + 1], 0xDD));
  }
  for (int k = 0; k < 2; ++k) {  // chunk m of x[k]: v[8k + m]'s i + 2 (lanes 0, 1), v[8k + 4 + m]'s (2, 3)
    x[k] = _mm512_add_ps(_mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(1, 0, 1, 0)),
                         _mm512_shuffle_ps(w[2 * k], w[2 * k + 1], _MM_SHUFFLE(3, 2, 3, 2)));
  }
  // lane 4m + l: v[4l + m]'s sum; put v[j]'s in lane j
  const __m512 y = _mm512_add_ps(_mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(2, 0, 2, 0)),
                                 _mm512_shuffle_ps(x[0], x[1], _MM_SHUFFLE(3, 1, 3, 1)));
  return _mm512_permutexvar_ps(_mm512_set_epi32(15, 11, 7, 3, 14, 10, 6, 2, 13, 9, 5, 1, 12, 8, 4, 0), y);
}

// A unit's span of one KV head: each position's key and value rows, krow[p] and vrow[p] (p the
// position less the span's first), in the cache, or (a float16 cache read by many queries)
// widened once into ks / vs[p * D]; at[p]: the rows' offset in the cache, -1 outside [from, to).
struct Span {
  std::vector<float> ks, vs, scores;
  std::vector<const void*> krow, vrow;
  std::vector<int64_t> at;
};

// A chunk's cached rows (16 positions' keys and values of one KV head, `at`: their offsets, -1
// none) fetched ahead: the block table scatters blocks where no hardware prefetcher looks.
template <class T>
inline void prefetch_rows(const T* kp, const T* vp, const int64_t* at, int64_t D) {
  for (int i = 0; i < 16; ++i) {
    if (at[i] < 0) continue;
    for (int64_t b = 0; b < D * static_cast<int64_t>(sizeof(T)); b += 64) {
      _mm_prefetch(reinterpret_cast<const char*>(kp + at[i]) + b, _MM_HINT_T0);
      _mm_prefetch(reinterpret_cast<const char*>(vp + at[i]) + b, _MM_HINT_T0);
    }
  }
}

template <class T>
void load_span(const Rows& a, const T* kp, const T* vp, const int64_t* table, int64_t kvh, int64_t base,
               int64_t from, int64_t to, bool widen, Span& s) {
  const int64_t D = a.D, c0 = (from - base) / 16 * 16, c1 = (to - base + 15) / 16 * 16;
  int64_t* at = s.at.data();  // each position's row of this KV head in the cache, -1 outside [from, to)
  for (int64_t p = c0; p < c1;) {  // one division a block: a block's positions are consecutive slots
    const int64_t pos = base + p, offset = pos % a.block_size;
    const int64_t run = std::min(a.block_size - offset, c1 - p);
    const bool seen = pos < to && pos + run > from;  // the table read only for a block of the context
    const int64_t first = seen ? (table[pos / a.block_size] * a.block_size + offset) * a.KV + kvh : 0;
    for (int64_t i = 0; i < run; ++i, ++p) {
      at[p] = base + p < from || base + p >= to ? -1 : (first + i * a.KV) * D;
    }
  }
  const void **krow = s.krow.data(), **vrow = s.vrow.data();
  float *ks = s.ks.data(), *vs = s.vs.data();
  prefetch_rows(kp, vp, at + c0, D);
  for (int64_t c = c0; c < c1; c += 16) {
    if (c + 16 < c1) prefetch_rows(kp, vp, at + c + 16, D);
    for (int64_t i = c; i < c + 16; ++i) {
      krow[i] = vrow[i] = nullptr;
      if (at[i] < 0) continue;
      if (!widen) {
        krow[i] = kp + at[i], vrow[i] = vp + at[i];
        continue;
      }
      float *k = ks + i * D, *v = vs + i * D;
      for (int64_t d = 0; d < D; d += 16) {
        _mm512_storeu_ps(k + d, load16(kp + at[i] + d));
        _mm512_storeu_ps(v + d, load16(vp + at[i] + d));
      }
      krow[i] = k, vrow[i] = v;
    }
  }
}

struct Query {  // one (row, query head) of a unit: its positions [from, to) in the span
  const float* q;
  float *acc, *top, *total;  // its partial: [D], and one float each
  int64_t from, to;
};

// A score is q . k as the lanes' sum (hsum16x16) of the chain q[0:16] * k[0:16] + q[16:32] *
// k[16:32] + ... (one multiply, then multiply-adds), times scale; -inf at the positions of its
// chunks it does not see. Two loops give these numbers: a few queries (a decode's) take each
// key row once for all of them, in place (scores_rows); many (a prefill tile's) take 16 widened
// positions at a time, a query after another (scores_chunks).
template <int DV>
inline __m512 chain(const float* q, const __m512 (&k)[DV]) {
  __m512 acc = _mm512_mul_ps(_mm512_loadu_ps(q), k[0]);
  for (int d = 1; d < DV; ++d) acc = _mm512_fmadd_ps(_mm512_loadu_ps(q + d * 16), k[d], acc);
  return acc;
}

template <int DV>
inline __m512 chain(const __m512 (&q)[DV], const float* k) {  // the same, q in registers
  __m512 acc = _mm512_mul_ps(q[0], _mm512_loadu_ps(k));
  for (int d = 1; d < DV; ++d) acc = _mm512_fmadd_ps(q[d], _mm512_loadu_ps(k + d * 16), acc);
  return acc;
}

inline void fill_unseen(const Query& q, int64_t base, float* sc) {
  const int64_t q0 = (q.from - base) / 16 * 16, q1 = (q.to - base + 15) / 16 * 16;
  for (int64_t c = q0; c < q1; c += 16) _mm512_storeu_ps(sc + c, _mm512_set1_ps(-INFINITY));
}

// Positions base + c .. + 15 of queries qs[0..n): lane j of a query's scores is position c + j
// seen (in [from, to)), stored over the -inf fill_unseen left; its chunks outside, untouched.
inline void store_scores(const Query& q, int64_t base, int64_t c, __m512 v, float* sc) {
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(base + c)), lanes);
  const __mmask16 seen = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(q.from))) &
                         _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(q.to)));
  if (seen != 0) _mm512_mask_storeu_ps(sc + c, seen, v);
}

// A few queries (a decode's): each key row read once, in place, for all of them; each query's
// 16 chains of a chunk summed together (one hsum16x16: a lane's sum alone took as many
// shuffles as 16 at once).
template <int DV, class T>
void scores_rows(const Query* qs, int n, int64_t base, int64_t p0, int64_t p1, float scale, Span& s) {
  for (int i = 0; i < n; ++i) fill_unseen(qs[i], base, s.scores.data() + i * kScoreRow);
  __m512 acc[kScoreGroup][16];
  const __m512 scaled = _mm512_set1_ps(scale);
  for (int64_t c = p0 / 16 * 16; c < p1; c += 16) {
    for (int j = 0; j < 16; ++j) {
      const T* row = static_cast<const T*>(s.krow[c + j]);
      if (row == nullptr) {  // outside the unit's positions: no query sees it
        for (int i = 0; i < n; ++i) acc[i][j] = _mm512_setzero_ps();
        continue;
      }
      __m512 k[DV];
      for (int d = 0; d < DV; ++d) k[d] = load16(row + d * 16);
      for (int i = 0; i < n; ++i) acc[i][j] = chain<DV>(qs[i].q, k);
    }
    for (int i = 0; i < n; ++i) {
      store_scores(qs[i], base, c, _mm512_mul_ps(hsum16x16(acc[i]), scaled), s.scores.data() + i * kScoreRow);
    }
  }
}

template <int DV>
void scores_chunks(const Query* qs, int n, int64_t base, float scale, Span& s) {
  const __m512i lanes = _mm512_set_epi32(15, 14, 13, 12, 11, 10, 9, 8, 7, 6, 5, 4, 3, 2, 1, 0);
  for (int i = 0; i < n; ++i) {
    const Query& q = qs[i];
    const int64_t q0 = (q.from - base) / 16 * 16, q1 = (q.to - base + 15) / 16 * 16;
    __m512 qv[DV];
    for (int d = 0; d < DV; ++d) qv[d] = _mm512_loadu_ps(q.q + d * 16);
    for (int64_t c = q0; c < q1; c += 16) {
      __m512 acc[16];
      for (int j = 0; j < 16; ++j) {
        const float* row = static_cast<const float*>(s.krow[c + j]);
        acc[j] = row == nullptr ? _mm512_setzero_ps() : chain<DV>(qv, row);
      }
      const __m512i pos = _mm512_add_epi32(_mm512_set1_epi32(static_cast<int>(base + c)), lanes);
      const __mmask16 seen = _mm512_cmpge_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(q.from))) &
                             _mm512_cmplt_epi32_mask(pos, _mm512_set1_epi32(static_cast<int>(q.to)));
      const __m512 v = _mm512_mul_ps(hsum16x16(acc), _mm512_set1_ps(scale));
      _mm512_storeu_ps(s.scores.data() + i * kScoreRow + c, _mm512_mask_mov_ps(_mm512_set1_ps(-INFINITY), seen, v));
    }
  }
}

// Soft-capping (Gemma 2's attention): a query's seen scores become cap * tanh(score / cap), each
// on its own (its unseen positions stay -inf), so a row's numbers stay its own.
void cap_scores(float* sc, const Query& q, int64_t base, float cap) {
  const int64_t q0 = (q.from - base) / 16 * 16, q1 = (q.to - base + 15) / 16 * 16;
  for (int64_t p = q0; p < q1; ++p) {
    if (sc[p] != -INFINITY) sc[p] = cap * std::tanh(sc[p] / cap);
  }
}

// A query's scores (row i of the unit's scores) -> exp(score - top), 0 outside its positions,
// over chunks c0 .. c1; its top and sum of numerators into the query's partial.
void numerators(float* sc, const Query& q, int64_t base, int64_t c0, int64_t c1) {
  const int64_t q0 = (q.from - base) / 16 * 16, q1 = (q.to - base + 15) / 16 * 16;
  __m512 most = _mm512_set1_ps(-INFINITY);
  for (int64_t c = q0; c < q1; c += 16) most = _mm512_max_ps(most, _mm512_loadu_ps(sc + c));
  const float top = _mm512_reduce_max_ps(most);
  const __m512 shift = _mm512_set1_ps(top), minus_inf = _mm512_set1_ps(-INFINITY);
  __m512 total = _mm512_setzero_ps();
  for (int64_t c = c0; c < c1; c += 16) {
    if (c < q0 || c >= q1) {
      _mm512_storeu_ps(sc + c, _mm512_setzero_ps());
      continue;
    }
    const __m512 x = _mm512_loadu_ps(sc + c);
    const __mmask16 seen = _mm512_cmp_ps_mask(x, minus_inf, _CMP_NEQ_OQ);
    const __m512 e = _mm512_maskz_mov_ps(seen, exp16(_mm512_sub_ps(x, shift)));
    _mm512_storeu_ps(sc + c, e);
    total = _mm512_add_ps(total, e);
  }
  *q.top = top;
  *q.total = _mm512_reduce_add_ps(total);
}

// acc of queries qs[0..n) = sum over positions p in [p0, p1) of their numerator times v[p],
// in position order (numerators 0 outside a query's own positions).
template <int DV, int NQ, class T>
void weigh_values(const Query* qs, const float* sc, int64_t p0, int64_t p1, const Span& s) {
  constexpr int64_t D = DV * 16;
  __m512 acc[NQ][DV];
  for (int i = 0; i < NQ; ++i)
    for (int d = 0; d < DV; ++d) acc[i][d] = _mm512_setzero_ps();
  for (int64_t p = p0; p < p1; ++p) {
    __m512 v[DV];
    const T* row = static_cast<const T*>(s.vrow[p]);
    for (int d = 0; d < DV; ++d) v[d] = load16(row + d * 16);
    for (int i = 0; i < NQ; ++i) {
      const __m512 w = _mm512_set1_ps(sc[i * kScoreRow + p]);
      for (int d = 0; d < DV; ++d) acc[i][d] = _mm512_fmadd_ps(w, v[d], acc[i][d]);
    }
  }
  for (int i = 0; i < NQ; ++i)
    for (int d = 0; d < DV; ++d) _mm512_storeu_ps(qs[i].acc + d * 16, acc[i][d]);
}

template <int DV, class T>
void weigh_group(const Query* qs, int n, const float* sc, int64_t p0, int64_t p1, const Span& s) {
  constexpr int kGroup = DV >= 16 ? 1 : DV >= 8 ? 2 : DV >= 4 ? 4 : 8;  // accumulators in registers: 16 of 32
  for (int i = 0; i < n; i += kGroup) {
    const Query* q = qs + i;
    const float* w = sc + i * kScoreRow;
    switch (std::min(kGroup, n - i)) {
      case 1: weigh_values<DV, 1, T>(q, w, p0, p1, s); break;
      case 2: weigh_values<DV, 2, T>(q, w, p0, p1, s); break;
      case 3: weigh_values<DV, 3, T>(q, w, p0, p1, s); break;
      case 4: weigh_values<DV, 4, T>(q, w, p0, p1, s); break;
      case 5: weigh_values<DV, 5, T>(q, w, p0, p1, s); break;
      case 6: weigh_values<DV, 6, T>(q, w, p0, p1, s); break;
      case 7: weigh_values<DV, 7, T>(q, w, p0, p1, s); break;
      default: weigh_values<DV, 8, T>(q, w, p0, p1, s); break;
    }
  }
}

// Queries qs[0..n) (n <= kScoreGroup) of one unit, the span loaded (its rows T; `widened`:
// float copies, read by the chunked loop): their partials.
template <int DV, class T>
void attend_group(const Query* qs, int n, int64_t base, float scale, float softcap, bool widened, Span& s) {
  int64_t p0 = qs[0].from, p1 = qs[0].to;
  for (int i = 1; i < n; ++i) p0 = std::min(p0, qs[i].from), p1 = std::max(p1, qs[i].to);
  const int64_t c0 = (p0 - base) / 16 * 16, c1 = (p1 - base + 15) / 16 * 16;
  if (widened) {
    scores_chunks<DV>(qs, n, base, scale, s);
  } else {
    scores_rows<DV, T>(qs, n, base, p0 - base, p1 - base, scale, s);
  }
  if (softcap > 0.f) {
    for (int i = 0; i < n; ++i) cap_scores(s.scores.data() + i * kScoreRow, qs[i], base, softcap);
  }
  for (int i = 0; i < n; ++i) numerators(s.scores.data() + i * kScoreRow, qs[i], base, c0, c1);
  weigh_group<DV, T>(qs, n, s.scores.data(), p0 - base, p1 - base, s);
}

// A group on the rows as loaded: widened (or a float32 cache's) floats, or the cache's T.
template <int DV, class T>
void run_group(const Query* qs, int n, int64_t base, float scale, float softcap, bool widened, Span& s) {
  if (widened) {
    attend_group<DV, float>(qs, n, base, scale, softcap, true, s);
  } else {
    attend_group<DV, T>(qs, n, base, scale, softcap, false, s);
  }
}

struct Plan {  // the work: units of (tile of rows, KV head, span), and where each row's partials go
  std::vector<int64_t> tile_first, tile_end;  // rows [first, end) of one sequence
  std::vector<int64_t> first_span, part;      // per row: its first span, its partials' first index
  struct Unit { int64_t tile, kvh, span; };
  std::vector<Unit> units;
  int64_t parts = 0;  // (row, span) partials
};

Plan plan_rows(const Rows& a) {
  Plan p;
  p.first_span.resize(a.N);
  p.part.resize(a.N);
  for (int64_t r = 0; r < a.N; ++r) {
    p.first_span[r] = first_seen(a, r) / kSpan;
    p.part[r] = p.parts;
    p.parts += (a.len[r] - 1) / kSpan - p.first_span[r] + 1;
    const bool joins = r > 0 && a.seq[r] == a.seq[r - 1] && r - p.tile_first.back() < kRowTile;
    if (!joins) p.tile_first.push_back(r), p.tile_end.push_back(r);
    p.tile_end.back() = r + 1;
  }
  for (int64_t t = 0; t < static_cast<int64_t>(p.tile_first.size()); ++t) {
    int64_t s0 = INT64_MAX, s1 = 0;
    for (int64_t r = p.tile_first[t]; r < p.tile_end[t]; ++r) {
      s0 = std::min(s0, p.first_span[r]), s1 = std::max(s1, (a.len[r] - 1) / kSpan + 1);
    }
    for (int64_t s = s0; s < s1; ++s)
      for (int64_t kvh = 0; kvh < a.KV; ++kvh) p.units.push_back({t, kvh, s});
  }
  return p;
}

// acc [parts, H, D], top and total [parts, H]: partial (row r's span s, head h) at
// (part[r] + s - first_span[r]) * H + h.
struct Partials {
  std::vector<float> acc, top, total;
};

template <class T>
void attend_unit(const Rows& a, const Plan& p, const Plan::Unit& u, const T* kp, const T* vp, Partials& out,
                 Span& s, std::vector<Query>& qs) {
  const int64_t G = a.H / a.KV, base = u.span * kSpan;
  qs.clear();
  int64_t from = INT64_MAX, to = 0;
  for (int64_t r = p.tile_first[u.tile]; r < p.tile_end[u.tile]; ++r) {
    const int64_t lo = std::max(base, first_seen(a, r)), hi = std::min(base + kSpan, a.len[r]);
    if (lo >= hi) continue;
    from = std::min(from, lo), to = std::max(to, hi);
    const int64_t at = (p.part[r] + u.span - p.first_span[r]) * a.H;
    for (int64_t g = 0; g < G; ++g) {
      const int64_t h = u.kvh * G + g;
      qs.push_back({a.q + (r * a.H + h) * a.D, out.acc.data() + (at + h) * a.D, out.top.data() + at + h,
                    out.total.data() + at + h, lo, hi});
    }
  }
  if (qs.empty()) return;
  const int64_t* table = a.tables + a.seq[p.tile_first[u.tile]] * a.max_blocks;
  const int64_t n = static_cast<int64_t>(qs.size());
  // many queries (a prefill tile): rows widened to float once (a float32 cache's as they are)
  // and scored 16 positions at a time; a few (a decode): each row read once in place
  const bool widen = n > kScoreGroup;
  load_span(a, kp, vp, table, u.kvh, base, from, to, widen && !std::is_same<T, float>::value, s);
  for (int64_t i = 0; i < n; i += kScoreGroup) {
    const int group = static_cast<int>(std::min<int64_t>(kScoreGroup, n - i));
    const Query* g = qs.data() + i;
    if (a.D == 32) run_group<2, T>(g, group, base, a.scale, a.softcap, widen, s);
    if (a.D == 64) run_group<4, T>(g, group, base, a.scale, a.softcap, widen, s);
    if (a.D == 128) run_group<8, T>(g, group, base, a.scale, a.softcap, widen, s);
    if (a.D == 256) run_group<16, T>(g, group, base, a.scale, a.softcap, widen, s);  // Gemma 2 / 3
  }
}

// Row r, head h: its spans' partials merged in order, each rescaled to the largest score of all.
void merge_row(const Rows& a, const Plan& p, const Partials& parts, int64_t r, float* out) {
  const int64_t spans = (a.len[r] - 1) / kSpan - p.first_span[r] + 1;
  for (int64_t h = 0; h < a.H; ++h) {
    const int64_t first = p.part[r] * a.H + h;
    float most = -INFINITY, sum = 0.f;
    for (int64_t s = 0; s < spans; ++s) most = std::max(most, parts.top[first + s * a.H]);
    float* o = out + (r * a.H + h) * a.D;
    std::fill(o, o + a.D, 0.f);
    for (int64_t s = 0; s < spans; ++s) {
      const int64_t i = first + s * a.H;
      const float weight = parts.total[i] > 0.f ? std::exp(parts.top[i] - most) : 0.f;
      sum += weight * parts.total[i];
      for (int64_t d = 0; d < a.D; ++d) o[d] += weight * parts.acc[i * a.D + d];
    }
    for (int64_t d = 0; d < a.D; ++d) o[d] /= sum;
  }
}

// Buffers kept across calls, grown to the largest step (a fresh one each call was zeroed and
// page-faulted in: a 512-row chunk at 8,192 positions has 38 MB of partials a layer). Every
// element a call reads, it wrote first.
template <class V>
V& grown(V& buffer, int64_t size) {
  if (static_cast<int64_t>(buffer.size()) < size) buffer.resize(static_cast<size_t>(size));
  return buffer;
}

template <class T>
void attend_rows(const Rows& a, const T* kp, const T* vp, float* out) {
  const Plan p = plan_rows(a);
  static thread_local Partials kept;  // the calling thread's (the engine's)
  Partials& parts = kept;  // a reference the workers capture (a thread_local name is each thread's own)
  grown(parts.acc, p.parts * a.H * a.D), grown(parts.top, p.parts * a.H), grown(parts.total, p.parts * a.H);
  const int64_t units = static_cast<int64_t>(p.units.size());
  const auto run = [&](int64_t begin, int64_t end) {
    static thread_local Span s;  // each worker thread's
    grown(s.ks, kSpan * a.D), grown(s.vs, kSpan * a.D), grown(s.scores, kScoreGroup * kScoreRow);
    grown(s.krow, kSpan), grown(s.vrow, kSpan), grown(s.at, kSpan);
    std::vector<Query> qs;
    for (int64_t i = begin; i < end; ++i) attend_unit(a, p, p.units[i], kp, vp, parts, s, qs);
  };
  units < 2 ? run(0, units) : at::parallel_for(0, units, 1, run);
  const auto merge = [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) merge_row(a, p, parts, r, out);
  };
  a.N < 16 ? merge(0, a.N) : at::parallel_for(0, a.N, 8, merge);
}

}  // namespace

// Row r of q [N, H, D] against its sequence's cached keys / values at positions [lo, len[r])
// (lo = 0, or len[r] - window with a sliding window), read in place through block table
// tables[seq[r]]: no gather into a padded copy, no mask. keys, values: [num_slots, KV, D]
// (a layer's flat slot views, float32 or float16); tables [S, max_blocks], seq and lens [N]
// int64. head_dim 32, 64, 128 or 256. softcap > 0: scores soft-capped (cap_scores); 0: off.
// -> [N, H, D] float32.
torch::Tensor paged_attention_rows(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                   torch::Tensor block_tables, torch::Tensor seq, torch::Tensor lens,
                                   int64_t block_size, double scale, int64_t window, double softcap) {
  TORCH_CHECK(q.dim() == 3 && keys.dim() == 3 && keys.sizes() == values.sizes(), "q [N, H, D]; keys [S, KV, D]");
  TORCH_CHECK(q.is_contiguous() && keys.is_contiguous() && values.is_contiguous(), "contiguous operands");
  const bool half = keys.scalar_type() == torch::kFloat16;
  TORCH_CHECK(q.scalar_type() == torch::kFloat32 && (half || keys.scalar_type() == torch::kFloat32) &&
                  values.scalar_type() == keys.scalar_type(), "q float32; keys, values float32 or float16");
  const auto i64 = torch::kInt64;
  TORCH_CHECK(block_tables.scalar_type() == i64 && seq.scalar_type() == i64 && lens.scalar_type() == i64, "int64");
  const int64_t N = q.size(0), H = q.size(1), D = q.size(2), KV = keys.size(1);
  TORCH_CHECK((D == 32 || D == 64 || D == 128 || D == 256) && H % KV == 0 && keys.size(2) == D,
              "head_dim 32, 64, 128 or 256; H a multiple of KV");
  TORCH_CHECK(block_tables.dim() == 2 && seq.numel() == N && lens.numel() == N, "one seq and len a row");
  TORCH_CHECK(softcap >= 0, "softcap 0 (off) or positive");
  auto tables = block_tables.contiguous(), seqs = seq.contiguous(), lengths = lens.contiguous();
  const int64_t max_blocks = tables.size(1), num_slots = keys.size(0), S = tables.size(0);
  const int64_t *tp = tables.data_ptr<int64_t>(), *sp = seqs.data_ptr<int64_t>(), *lp = lengths.data_ptr<int64_t>();
  for (int64_t r = 0; r < N; ++r) {
    TORCH_CHECK(sp[r] >= 0 && sp[r] < S, "a row's block table outside block_tables");
    TORCH_CHECK(lp[r] >= 1 && lp[r] <= max_blocks * block_size, "context length outside its block table");
    for (int64_t i = 0; i < (lp[r] + block_size - 1) / block_size; ++i) {
      const int64_t block = tp[sp[r] * max_blocks + i];
      TORCH_CHECK(block >= 0 && (block + 1) * block_size <= num_slots, "a block table points outside the cache");
    }
  }
  torch::Tensor out = torch::empty_like(q);
  const Rows rows{q.data_ptr<float>(), tp, sp, lp, N, H, KV, D, max_blocks, block_size, window,
                  static_cast<float>(scale), static_cast<float>(softcap)};
  if (half) {
    attend_rows(rows, static_cast<const uint16_t*>(keys.data_ptr()), static_cast<const uint16_t*>(values.data_ptr()),
                out.data_ptr<float>());
  } else {
    attend_rows(rows, keys.data_ptr<float>(), values.data_ptr<float>(), out.data_ptr<float>());
  }
  return out;
}

// One query token per sequence (a decode step): paged_attention_rows with row b of q on
// block table b at context_lens[b] positions. q: [B, H, D]; block_tables [B, max_blocks].
torch::Tensor paged_decode_attention(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                     torch::Tensor block_tables, torch::Tensor context_lens, int64_t block_size,
                                     double scale, int64_t window) {
  const auto seq = torch::arange(q.size(0), context_lens.options().dtype(torch::kInt64));
  return paged_attention_rows(q, keys, values, block_tables, seq, context_lens, block_size, scale, window, 0.0);
}
