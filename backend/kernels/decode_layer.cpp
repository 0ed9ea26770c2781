// One decoder layer of a step (decode, verify or prefill rows) in one call, for a layer
// whose linears are tiles (tiles.cpp): the same steps as llama.py's DecoderLayer (and
// gemma.py's), each by our kernels, with no Python between them. At one stream a layer's ~20
// torch calls from Python cost more than its non-matmul arithmetic; here they are one.
//
//   h = rms_norm(x); qkv = h @ Wqkv (+ bias); [q / k norms]; RoPE on q and k; k, v written at
//   their slots; a = attention(q, the cache) @ Wo (+ bias); x += a [Gemma: rms_norm(a)];
//   h = rms_norm(x); m = (gate(g) * u) @ Wdown, gate SiLU [Gemma: GELU]; x += m [rms_norm(m)]
//
// The elementwise steps are layer_ops.cpp's, which the layer-by-layer path calls too, and the
// linears, norms and attention the same kernels: a row's numbers are the same in either path.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <ATen/ThreadLocalState.h>
#include <immintrin.h>

#include <algorithm>
#include <vector>

#include "vec_exp.h"

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
torch::Tensor tiled_matmul(torch::Tensor x, torch::Tensor data, torch::Tensor params, torch::Tensor bias);
torch::Tensor tiled_matmul_a8(torch::Tensor x, torch::Tensor data, torch::Tensor params, torch::Tensor bias);
void tiled_matmul_add(torch::Tensor y, torch::Tensor x, torch::Tensor data, torch::Tensor params, torch::Tensor bias);
void tiled_matmul_a8_add(torch::Tensor y, torch::Tensor x, torch::Tensor data, torch::Tensor params,
                         torch::Tensor bias);
torch::Tensor paged_attention_rows(torch::Tensor q, torch::Tensor keys, torch::Tensor values,
                                   torch::Tensor block_tables, torch::Tensor seq, torch::Tensor lens,
                                   int64_t block_size, double scale, int64_t window, double softcap);
// layer_ops.cpp
void rope_rows(float* qkv, int64_t T, int64_t width, int64_t heads, int64_t D, const float* cos, const float* sin);
void head_norm_rows(float* x, int64_t T, int64_t width, int64_t first, int64_t heads, int64_t D, const float* w,
                    double eps);
torch::Tensor gated(torch::Tensor gate_up, bool gelu);

namespace {

// The operands' order in `weights` (llama.py `DecoderLayer.decode_operands`); the last three
// may be empty: q / k norms [H + KV, D] (Qwen3, Gemma 3), and the norms of the attention's and
// the MLP's outputs before their residual adds (Gemma's sandwich).
enum Operand { kInputNorm, kQkv, kQkvParams, kQkvBias, kO, kOParams, kOBias, kPostNorm, kGateUp, kGateUpParams,
               kDown, kDownParams, kQkNorm, kAttnOutNorm, kMlpOutNorm, kOperands };

}  // namespace

namespace {

// n values of `row` into `cache` (flat) from element `at`: copied into a float32 cache,
// rounded to the nearest float16 (ties to even, as torch's .to(float16)) into a float16 one.
void store_kv(const torch::Tensor& cache, int64_t at, const float* row, int64_t n) {
  if (cache.scalar_type() == torch::kFloat32) {
    std::copy(row, row + n, cache.data_ptr<float>() + at);
    return;
  }
  auto* out = static_cast<uint16_t*>(cache.data_ptr()) + at;
  for (int64_t i = 0; i < n; i += 16) {  // n: KV * head_dim, a multiple of 16
    const __m256i h = _mm512_cvtps_ph(_mm512_loadu_ps(row + i), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + i), h);
  }
}

}  // namespace

namespace {

// A step's operands that go row by row (x [T, hidden], cos / sin [T, D], slots, seq, lens [T]),
// cut together into runs of rows.
struct StepRows {
  torch::Tensor x, cos, sin, slots, seq, lens;

  StepRows rows(int64_t first, int64_t n) const {
    return {x.narrow(0, first, n), cos.narrow(0, first, n), sin.narrow(0, first, n), slots.narrow(0, first, n),
            seq.narrow(0, first, n), lens.narrow(0, first, n)};
  }
};

// What a layer's call holds for every row alike.
struct Layer {
  const std::vector<torch::Tensor>& weights;
  torch::Tensor keys, values, tables;
  int64_t block_size, window, num_heads, num_kv_heads;
  double scale, eps;
  bool int8_activations;
  double softcap;
  bool gelu;
};

// The layer over rows `s` (any of the step's rows), its kernels' loops split as they split
// (on the calling thread alone inside a parallel region: ATen runs a nested loop inline).
void layer_rows(const StepRows& s, const Layer& l) {
  const torch::Tensor& x = s.x;
  const std::vector<torch::Tensor>& weights = l.weights;
  const int64_t T = x.size(0), D = l.keys.size(2), H = l.num_heads, KV = l.num_kv_heads;
  TORCH_CHECK(s.cos.is_contiguous() && s.sin.is_contiguous() && s.cos.numel() == T * D && s.sin.numel() == T * D,
              "cos, sin");
  TORCH_CHECK(s.slots.scalar_type() == torch::kInt64 && s.slots.numel() == T && s.slots.is_contiguous(),
              "slots: int64 [T]");
  const int64_t width = (H + 2 * KV) * D, num_slots = l.keys.size(0);
  const double eps = l.eps;
  const auto linear = [&](const torch::Tensor& in, int w, const torch::Tensor& bias) {
    return l.int8_activations ? tiled_matmul_a8(in, weights[w], weights[w + 1], bias)
                              : tiled_matmul(in, weights[w], weights[w + 1], bias);
  };
  const auto residual = [&](const torch::Tensor& in, int w, const torch::Tensor& bias) {  // x += linear(in)
    l.int8_activations ? tiled_matmul_a8_add(x, in, weights[w], weights[w + 1], bias)
                       : tiled_matmul_add(x, in, weights[w], weights[w + 1], bias);
  };
  torch::Tensor qkv = linear(rms_norm(x, weights[kInputNorm], eps), kQkv, weights[kQkvBias]);
  TORCH_CHECK(qkv.size(1) == width, "qkv: [T, (H + 2 KV) * D]");
  float* qp = qkv.data_ptr<float>();
  const torch::Tensor& qk_norm = weights[kQkNorm];
  if (qk_norm.numel() > 0) {  // q's weight in row 0, k's in row H
    TORCH_CHECK(qk_norm.numel() == (H + KV) * D && qk_norm.is_contiguous(), "qk_norm: [H + KV, D]");
    head_norm_rows(qp, T, width, 0, H, D, qk_norm.data_ptr<float>(), eps);
    head_norm_rows(qp, T, width, H, KV, D, qk_norm.data_ptr<float>() + H * D, eps);
  }
  rope_rows(qp, T, width, H + KV, D, s.cos.data_ptr<float>(), s.sin.data_ptr<float>());
  const int64_t* sp = s.slots.data_ptr<int64_t>();
  for (int64_t t = 0; t < T; ++t) {
    TORCH_CHECK(sp[t] >= 0 && sp[t] < num_slots, "a slot outside the cache");
    const float* row = qp + t * width;
    store_kv(l.keys, sp[t] * KV * D, row + H * D, KV * D);
    store_kv(l.values, sp[t] * KV * D, row + (H + KV) * D, KV * D);
  }
  torch::Tensor q = qkv.narrow(1, 0, H * D).contiguous().view({T, H, D});
  torch::Tensor attn = paged_attention_rows(q, l.keys, l.values, l.tables, s.seq, s.lens, l.block_size, l.scale,
                                            l.window, l.softcap);
  const bool sandwich = weights[kAttnOutNorm].numel() > 0;
  if (sandwich) {  // x + rms_norm(a), as gemma.py adds them
    x.add_(rms_norm(linear(attn.view({T, H * D}), kO, weights[kOBias]), weights[kAttnOutNorm], eps));
  } else {
    residual(attn.view({T, H * D}), kO, weights[kOBias]);
  }
  torch::Tensor act = gated(linear(rms_norm(x, weights[kPostNorm], eps), kGateUp, torch::Tensor()), l.gelu);
  if (sandwich) {
    x.add_(rms_norm(linear(act, kDown, torch::Tensor()), weights[kMlpOutNorm], eps));
  } else {
    residual(act, kDown, torch::Tensor());
  }
}

// Rows a thread's run takes at least: a pass of tiles_a8.cpp's GEMV (8 rows read a block of
// weights once); fewer rows split each loop's outputs among the threads instead.
constexpr int64_t kRunRows = 8;
// A row's work in the layer, in positions of attention: its linears weigh as ~450 positions
// (2 cores: 15.6 us a row through SmolLM2-135M's four linears, 0.035 us a position attended).
constexpr int64_t kRowWork = 450;

// Where `groups` runs of consecutive rows start (and the last ends: groups + 1 cuts), each about
// an equal share of the work: a row's kRowWork and the positions it attends (a prefill chunk's
// last rows attend over more than its first). A run ends where a sequence does: a row attends
// over the keys its sequence's earlier rows write in the same layer, which another thread's run
// might not have written yet. Empty when no such cuts come within kSlack of equal shares (one
// long prefill chunk): the loops' outputs are split then.
constexpr double kSlack = 1.25;

std::vector<int64_t> run_cuts(const torch::Tensor& lens, const torch::Tensor& seq, int64_t window, int64_t groups) {
  const torch::Tensor seen = lens.contiguous(), owner = seq.contiguous();
  const int64_t *len = seen.data_ptr<int64_t>(), *sq = owner.data_ptr<int64_t>();
  const int64_t T = seen.numel();
  std::vector<int64_t> work(T + 1, 0);
  for (int64_t r = 0; r < T; ++r) work[r + 1] = work[r] + kRowWork + (window > 0 ? std::min(len[r], window) : len[r]);
  const auto starts_sequence = [&](int64_t r) { return r == 0 || r == T || sq[r] != sq[r - 1]; };
  std::vector<int64_t> cuts(groups + 1, T);
  cuts[0] = 0;
  for (int64_t g = 1; g < groups; ++g) {  // the sequence start nearest g shares of the work
    const int64_t share = work[T] * g / groups;
    const int64_t mid = std::lower_bound(work.begin(), work.end(), share) - work.begin();
    int64_t before = mid, after = mid;
    while (!starts_sequence(before)) --before;
    while (!starts_sequence(after)) ++after;
    cuts[g] = share - work[before] <= work[after] - share ? before : after;
  }
  for (int64_t g = 0; g < groups; ++g) {
    const int64_t rows = cuts[g + 1] - cuts[g], done = work[cuts[g + 1]] - work[cuts[g]];
    if (rows < kRunRows || done > kSlack * work[T] / groups) return {};
  }
  return cuts;
}

}  // namespace

// x [T, hidden] float32 contiguous, updated in place and returned. cos, sin [T, D]; keys,
// values [num_slots, KV, D] (the layer's cache, flat); slots [T]; tables [B, max_blocks],
// seq [T], lens [T]: paged_attention_rows' operands (any rows: a decode's, a verify step's, a
// prefill chunk's). int8_activations: the linears take tiles_a8.cpp's
// GEMV (the tiles' `Tiles.activations`: QUANT_ACTIVATIONS), else tiles.cpp's. Each linear's
// params tell its layout to those GEMVs (int8 group 16: 4 dimensions, formats.Tiles), so a
// layer may mix group 16 (GGUF's Q6_K, Q3_K, Q2_K) and group 32 linears.
//
// With kRunRows rows a thread or more, the rows are cut into one run a thread at sequences'
// starts (run_cuts), each run through the whole layer on its thread: one join a layer, where splitting each loop's
// outputs joins at each of the layer's ~9 loops, and every thread waits there for one the OS
// took away for another process (on 2 cores serving 32 streams: step 34 -> 31 ms, alone). A
// row's numbers are the same either way: every kernel's arithmetic of a row is its own.
torch::Tensor decode_layer(torch::Tensor x, std::vector<torch::Tensor> weights, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor keys, torch::Tensor values, torch::Tensor slots, torch::Tensor tables,
                           torch::Tensor seq, torch::Tensor lens, int64_t block_size, int64_t window, int64_t num_heads,
                           int64_t num_kv_heads, double scale, double eps, bool int8_activations, double softcap,
                           bool gelu) {
  TORCH_CHECK(weights.size() == kOperands, "decode_layer: the layer's 15 operands");
  TORCH_CHECK(x.dim() == 2 && x.is_contiguous() && x.scalar_type() == torch::kFloat32, "x: float32 [T, hidden]");
  const int64_t T = x.size(0);
  TORCH_CHECK(keys.dim() == 3 && keys.size(1) == num_kv_heads && keys.is_contiguous() && values.is_contiguous(),
              "keys, values: [S, KV, D]");
  TORCH_CHECK((keys.scalar_type() == torch::kFloat32 || keys.scalar_type() == torch::kFloat16) &&
                  values.scalar_type() == keys.scalar_type(), "keys, values: float32 or float16");
  TORCH_CHECK(cos.size(0) == T && sin.size(0) == T && slots.numel() == T && seq.numel() == T && lens.numel() == T &&
                  seq.scalar_type() == torch::kInt64 &&
                  lens.scalar_type() == torch::kInt64, "one cos, sin, slot, seq and len (int64) a row");
  const Layer layer{weights, keys, values, tables, block_size, window, num_heads, num_kv_heads,
                    scale, eps, int8_activations, softcap, gelu};
  const StepRows all{x, cos, sin, slots, seq, lens};
  const int64_t groups = at::in_parallel_region() ? 1 : std::min<int64_t>(at::get_num_threads(), T / kRunRows);
  const std::vector<int64_t> cuts = groups < 2 ? std::vector<int64_t>() : run_cuts(lens, seq, window, groups);
  if (cuts.empty()) {
    layer_rows(all, layer);
    return x;
  }
  const at::ThreadLocalState caller;  // inference mode and the like, on the workers as on the caller
  at::parallel_for(0, groups, 1, [&](int64_t g0, int64_t g1) {
    const at::ThreadLocalStateGuard as_caller(caller);
    for (int64_t g = g0; g < g1; ++g) layer_rows(all.rows(cuts[g], cuts[g + 1] - cuts[g]), layer);
  });
  return x;
}
