// Causal grouped-query attention on the GPU, flash-style (no T x T matrix in
// memory), in fp32 arithmetic on CUDA cores.
//
// Forward. A block owns kRows = 16 query rows of one (sequence, head): 4
// warps of 4 rows each. Keys and values stream through shared memory in tiles
// of kKeys = 32 (converted to fp32 once per tile). Within a tile, lane j
// computes the score of key j against each of its warp's rows, the warp
// reduces max and sum over the 32 keys, and an online softmax rescales the
// running output, whose D columns are spread over the lanes (lane owns
// columns lane, lane + 32, ...). Tiles past a block's last row are skipped
// (causality), and the log-sum-exp of every row is saved for the backward.
//
// Backward, in three passes, none with atomics:
//  1. delta = rowsum(dout * out) per (row, head);
//  2. dq: a block per 16 query rows, as the forward, recomputing
//     p = exp(s - lse) per tile and accumulating dq += ds k;
//  3. dk, dv: a block per 32 keys of one key/value head, looping over the
//     query heads of its group and over the query rows that see those keys,
//     8 rows at a time: each warp computes p and ds for 2 rows (lane j: key j)
//     into shared memory, then every thread adds them into the (key, column)
//     elements of dk and dv it owns in registers.
// Each element's sum is taken in a fixed order, so results are reproducible.
//
// Templated on the element type and on the columns per lane (DPL = 2: D <= 64,
// 4: D <= 128); columns past D are zero in shared memory and never written.
#include <cmath>
#include <type_traits>

#include "kernels/cuda/common.cuh"

namespace strata::kernels::cuda {
namespace {

using namespace detail;

constexpr int kWarps = 4;
constexpr int kThreads = kWarps * 32;
constexpr int kRowsPerWarp = 4;
constexpr int kRows = kWarps * kRowsPerWarp;  // query rows per forward / dq block
constexpr int kKeys = 32;                     // keys per tile (one per lane)
constexpr int kBackwardRowsPerWarp = 2;
constexpr int kBackwardRows = kWarps * kBackwardRowsPerWarp;  // query rows per dk/dv step

// The dq pass keeps two more tiles in shared memory than the forward; at
// D = 128 it takes 2 rows per warp to stay within the 48 KiB of static
// shared memory.
constexpr int dq_rows_per_warp(int DPL) {
  return DPL == 4 ? 2 : kRowsPerWarp;
}

struct Params {
  int64_t B, T, H, KV, D, row_stride;
  float scale;  // 1 / sqrt(D)
};

// Rows [first, first + rows) of one head into shared memory as fp32 (times
// `factor`), zero past T and past D.
template <typename T, int kMaxD, int kStride>
__device__ __forceinline__ void load_rows(float (*tile)[kStride], const T* base, int64_t stride,
                                          int64_t first, int rows, int64_t limit, int64_t D,
                                          float factor) {
  for (int index = threadIdx.x; index < rows * kMaxD; index += blockDim.x) {
    const int r = index / kMaxD, d = index % kMaxD;
    const int64_t t = first + r;
    tile[r][d] = (t < limit && d < D) ? to_float(base[t * stride + d]) * factor : 0.0f;
  }
}

// dots[r] = a[first_row + r] . b[lane] over kMaxD columns, for the rows of one
// warp. Each b element is loaded once and reused for every row; a's rows
// (16-byte aligned) are read as float4 broadcasts. Columns are added in
// increasing order.
template <int kRowCount, int kMaxD, int kStrideA, int kStrideB>
__device__ __forceinline__ void row_dots(float (&dots)[kRowCount], const float (*a)[kStrideA],
                                         int first_row, const float (*b)[kStrideB], int lane) {
  static_assert(kStrideA % 4 == 0 && kMaxD % 4 == 0, "rows of a must be float4-aligned");
#pragma unroll
  for (int r = 0; r < kRowCount; ++r) dots[r] = 0.0f;
#pragma unroll 2
  for (int d = 0; d < kMaxD; d += 4) {
    const float b0 = b[lane][d], b1 = b[lane][d + 1], b2 = b[lane][d + 2], b3 = b[lane][d + 3];
#pragma unroll
    for (int r = 0; r < kRowCount; ++r) {
      const float4 av = *reinterpret_cast<const float4*>(&a[first_row + r][d]);
      dots[r] = fmaf(av.x, b0, dots[r]);
      dots[r] = fmaf(av.y, b1, dots[r]);
      dots[r] = fmaf(av.z, b2, dots[r]);
      dots[r] = fmaf(av.w, b3, dots[r]);
    }
  }
}

// acc[r][m] += sum over keys j of weight[r] (held by lane j) * tile[j][lane + 32 m],
// for the rows of one warp. The weights pass through the warp's `staging`
// (32 keys x kRowCount, 16-byte aligned rows) so that one vector broadcast
// gives every row's weight of key j, instead of a shuffle per row and key.
template <int kRowCount, int DPL, int kStride>
__device__ __forceinline__ void accumulate_rows(float (&acc)[kRowCount][DPL],
                                                const float (&weight)[kRowCount],
                                                float (*staging)[kRowCount],
                                                const float (*tile)[kStride], int lane) {
  static_assert(kRowCount == 2 || kRowCount == 4, "staged as float2 or float4");
#pragma unroll
  for (int r = 0; r < kRowCount; ++r) staging[lane][r] = weight[r];
  __syncwarp();
#pragma unroll 4
  for (int j = 0; j < kKeys; ++j) {
    float value[DPL];
#pragma unroll
    for (int m = 0; m < DPL; ++m) value[m] = tile[j][lane + 32 * m];
    float w[kRowCount];
    if constexpr (kRowCount == 4) {
      const float4 w4 = *reinterpret_cast<const float4*>(&staging[j][0]);
      w[0] = w4.x;
      w[1] = w4.y;
      w[2] = w4.z;
      w[3] = w4.w;
    } else {
      const float2 w2 = *reinterpret_cast<const float2*>(&staging[j][0]);
      w[0] = w2.x;
      w[1] = w2.y;
    }
#pragma unroll
    for (int r = 0; r < kRowCount; ++r) {
#pragma unroll
      for (int m = 0; m < DPL; ++m) acc[r][m] = fmaf(w[r], value[m], acc[r][m]);
    }
  }
  __syncwarp();  // staging may be overwritten by the next call
}

template <typename T, int DPL>
__global__ void __launch_bounds__(kThreads)
    attention_forward_kernel(T* out,      // (B, T, H*D)
                             float* lse,  // (B, H, T)
                             const T* q,  // (B, T, row_stride), H heads of D
                             const T* k,  // (B, T, row_stride), KV heads of D
                             const T* v,  // (B, T, row_stride), KV heads of D
                             Params p) {
  constexpr int kMaxD = 32 * DPL;
  __shared__ __align__(16) float q_tile[kRows][kMaxD];  // scaled by 1/sqrt(D); broadcasts
  __shared__ float k_tile[kKeys][kMaxD + 1];  // padded: lane j reads row j without conflicts
  __shared__ float v_tile[kKeys][kMaxD];      // lanes read consecutive columns of one row
  __shared__ __align__(16) float staging[kWarps][kKeys][kRowsPerWarp];  // probabilities
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.y / p.H, h = blockIdx.y % p.H, kvh = h / (p.H / p.KV);
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kRows;
  const int64_t sequence = b * p.T;  // first token row of this sequence
  load_rows<T, kMaxD, kMaxD>(q_tile, q + sequence * p.row_stride + h * p.D, p.row_stride, q0, kRows,
                             p.T, p.D, p.scale);

  float row_max[kRowsPerWarp], row_sum[kRowsPerWarp], acc[kRowsPerWarp][DPL];
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    row_max[r] = -INFINITY;
    row_sum[r] = 0.0f;
#pragma unroll
    for (int m = 0; m < DPL; ++m) acc[r][m] = 0.0f;
  }
  const int64_t last_row = min(q0 + kRows, p.T) - 1;
  for (int64_t k0 = 0; k0 <= last_row; k0 += kKeys) {
    __syncthreads();  // the previous tile has been read
    load_rows<T, kMaxD, kMaxD + 1>(k_tile, k + sequence * p.row_stride + kvh * p.D, p.row_stride,
                                   k0, kKeys, p.T, p.D, 1.0f);
    load_rows<T, kMaxD, kMaxD>(v_tile, v + sequence * p.row_stride + kvh * p.D, p.row_stride, k0,
                               kKeys, p.T, p.D, 1.0f);
    __syncthreads();
    const int64_t key = k0 + lane;
    float prob[kRowsPerWarp], scores[kRowsPerWarp];
    row_dots<kRowsPerWarp, kMaxD>(scores, q_tile, warp * kRowsPerWarp, k_tile, lane);
#pragma unroll
    for (int r = 0; r < kRowsPerWarp; ++r) {
      const int64_t i = q0 + warp * kRowsPerWarp + r;
      const bool visible = key <= i && i < p.T;
      const float score = visible ? scores[r] : -INFINITY;
      const float new_max = fmaxf(row_max[r], warp_max(score));
      // A row with nothing visible yet (only rows past T) keeps max -inf: use 0
      // as the reference so no inf - inf appears.
      const float reference = new_max == -INFINITY ? 0.0f : new_max;
      prob[r] = visible ? __expf(score - reference) : 0.0f;
      const float correction = __expf(row_max[r] - reference);
      row_sum[r] = row_sum[r] * correction + warp_sum(prob[r]);
#pragma unroll
      for (int m = 0; m < DPL; ++m) acc[r][m] *= correction;
      row_max[r] = new_max;
    }
    accumulate_rows<kRowsPerWarp, DPL>(acc, prob, staging[warp], v_tile, lane);
  }
#pragma unroll
  for (int r = 0; r < kRowsPerWarp; ++r) {
    const int64_t i = q0 + warp * kRowsPerWarp + r;
    if (i >= p.T) continue;
    const float inv_sum = 1.0f / row_sum[r];
    T* out_row = out + (sequence + i) * p.H * p.D + h * p.D;
#pragma unroll
    for (int m = 0; m < DPL; ++m) {
      const int d = lane + 32 * m;
      if (d < p.D) out_row[d] = from_float<T>(acc[r][m] * inv_sum);
    }
    if (lane == 0) lse[(b * p.H + h) * p.T + i] = row_max[r] + logf(row_sum[r]);
  }
}

// delta[(b, h, t)] = sum_d dout * out: one warp per (token row, head).
template <typename T>
__global__ void attention_delta_kernel(float* delta,   // (B, H, T)
                                       const T* dout,  // (B, T, H*D)
                                       const T* out,   // (B, T, H*D)
                                       Params p) {
  const int64_t row = (static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x) / 32;
  const int lane = threadIdx.x & 31;
  if (row >= p.B * p.T * p.H) return;
  const int64_t h = row % p.H, token = row / p.H;  // token = b*T + t
  const T* dy = dout + token * p.H * p.D + h * p.D;
  const T* y = out + token * p.H * p.D + h * p.D;
  float sum = 0.0f;
  for (int64_t d = lane; d < p.D; d += 32) sum = fmaf(to_float(dy[d]), to_float(y[d]), sum);
  sum = warp_sum(sum);
  const int64_t b = token / p.T, t = token % p.T;
  if (lane == 0) delta[(b * p.H + h) * p.T + t] = sum;
}

template <typename T, int DPL>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dq_kernel(T* dq,               // (B, T, row_stride), H heads of D, =
                                 const T* dout,       // (B, T, H*D)
                                 const float* lse,    // (B, H, T)
                                 const float* delta,  // (B, H, T)
                                 const T* q, const T* k, const T* v,  // (B, T, row_stride)
                                 Params p) {
  constexpr int kMaxD = 32 * DPL;
  constexpr int kRowsW = dq_rows_per_warp(DPL);
  constexpr int kRowsB = kWarps * kRowsW;
  __shared__ __align__(16) float q_tile[kRowsB][kMaxD];  // scaled by 1/sqrt(D)
  __shared__ __align__(16) float dout_tile[kRowsB][kMaxD];
  __shared__ float k_tile[kKeys][kMaxD + 1];  // lane-indexed rows (scores) and columns (dq)
  __shared__ float v_tile[kKeys][kMaxD + 1];  // lane-indexed rows (dp)
  __shared__ __align__(16) float staging[kWarps][kKeys][kRowsW];  // dscores
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.y / p.H, h = blockIdx.y % p.H, kvh = h / (p.H / p.KV);
  const int64_t q0 = static_cast<int64_t>(blockIdx.x) * kRowsB;
  const int64_t sequence = b * p.T;
  load_rows<T, kMaxD, kMaxD>(q_tile, q + sequence * p.row_stride + h * p.D, p.row_stride, q0,
                             kRowsB, p.T, p.D, p.scale);
  load_rows<T, kMaxD, kMaxD>(dout_tile, dout + sequence * p.H * p.D + h * p.D, p.H * p.D, q0,
                             kRowsB, p.T, p.D, 1.0f);
  float row_lse[kRowsW], row_delta[kRowsW], acc[kRowsW][DPL];
#pragma unroll
  for (int r = 0; r < kRowsW; ++r) {
    const int64_t i = q0 + warp * kRowsW + r;
    const int64_t at = (b * p.H + h) * p.T + min(i, p.T - 1);
    row_lse[r] = lse[at];
    row_delta[r] = delta[at];
#pragma unroll
    for (int m = 0; m < DPL; ++m) acc[r][m] = 0.0f;
  }
  const int64_t last_row = min(q0 + kRowsB, p.T) - 1;
  for (int64_t k0 = 0; k0 <= last_row; k0 += kKeys) {
    __syncthreads();
    load_rows<T, kMaxD, kMaxD + 1>(k_tile, k + sequence * p.row_stride + kvh * p.D, p.row_stride,
                                   k0, kKeys, p.T, p.D, 1.0f);
    load_rows<T, kMaxD, kMaxD + 1>(v_tile, v + sequence * p.row_stride + kvh * p.D, p.row_stride,
                                   k0, kKeys, p.T, p.D, 1.0f);
    __syncthreads();
    const int64_t key = k0 + lane;
    float dscore[kRowsW], scores[kRowsW], dprobs[kRowsW];
    row_dots<kRowsW, kMaxD>(scores, q_tile, warp * kRowsW, k_tile, lane);
    row_dots<kRowsW, kMaxD>(dprobs, dout_tile, warp * kRowsW, v_tile, lane);
#pragma unroll
    for (int r = 0; r < kRowsW; ++r) {
      const int64_t i = q0 + warp * kRowsW + r;
      const bool visible = key <= i && i < p.T;
      const float prob = visible ? __expf(scores[r] - row_lse[r]) : 0.0f;
      dscore[r] = prob * (dprobs[r] - row_delta[r]);
    }
    accumulate_rows<kRowsW, DPL>(acc, dscore, staging[warp], k_tile, lane);
  }
#pragma unroll
  for (int r = 0; r < kRowsW; ++r) {
    const int64_t i = q0 + warp * kRowsW + r;
    if (i >= p.T) continue;
    T* dq_row = dq + (sequence + i) * p.row_stride + h * p.D;
#pragma unroll
    for (int m = 0; m < DPL; ++m) {
      const int d = lane + 32 * m;
      if (d < p.D) dq_row[d] = from_float<T>(acc[r][m] * p.scale);  // s = scale * q . k
    }
  }
}

template <typename T, int DPL>
__global__ void __launch_bounds__(kThreads)
    attention_backward_dkv_kernel(T* dk,               // (B, T, row_stride), KV heads of D, =
                                  T* dv,               // (B, T, row_stride), KV heads of D, =
                                  const T* dout,       // (B, T, H*D)
                                  const float* lse,    // (B, H, T)
                                  const float* delta,  // (B, H, T)
                                  const T* q, const T* k, const T* v,  // (B, T, row_stride)
                                  Params p) {
  constexpr int kMaxD = 32 * DPL;
  constexpr int kOwned = kMaxD / kWarps;  // (key, column) elements of dk and dv per thread
  static_assert(kOwned % 4 == 0, "owned columns are read four at a time");
  __shared__ float k_tile[kKeys][kMaxD + 1];
  __shared__ float v_tile[kKeys][kMaxD + 1];
  __shared__ __align__(16) float q_tile[kBackwardRows][kMaxD];  // scaled by 1/sqrt(D)
  __shared__ __align__(16) float dout_tile[kBackwardRows][kMaxD];
  __shared__ float prob_tile[kBackwardRows][kKeys];
  __shared__ float dscore_tile[kBackwardRows][kKeys];
  __shared__ float row_lse[kBackwardRows], row_delta[kBackwardRows];
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
  const int64_t b = blockIdx.y / p.KV, kvh = blockIdx.y % p.KV, group = p.H / p.KV;
  const int64_t k0 = static_cast<int64_t>(blockIdx.x) * kKeys;
  const int64_t sequence = b * p.T;
  load_rows<T, kMaxD, kMaxD + 1>(k_tile, k + sequence * p.row_stride + kvh * p.D, p.row_stride, k0,
                                 kKeys, p.T, p.D, 1.0f);
  load_rows<T, kMaxD, kMaxD + 1>(v_tile, v + sequence * p.row_stride + kvh * p.D, p.row_stride, k0,
                                 kKeys, p.T, p.D, 1.0f);
  // This thread owns key `lane` of the tile, columns [warp * kOwned, (warp + 1) * kOwned).
  float dk_acc[kOwned], dv_acc[kOwned];
#pragma unroll
  for (int m = 0; m < kOwned; ++m) dk_acc[m] = dv_acc[m] = 0.0f;
  const int64_t key = k0 + lane;
  for (int64_t h = kvh * group; h < (kvh + 1) * group; ++h) {
    // Rows before k0 see none of these keys.
    for (int64_t i0 = k0; i0 < p.T; i0 += kBackwardRows) {
      __syncthreads();  // the previous rows have been used
      load_rows<T, kMaxD, kMaxD>(q_tile, q + sequence * p.row_stride + h * p.D, p.row_stride, i0,
                                 kBackwardRows, p.T, p.D, p.scale);
      load_rows<T, kMaxD, kMaxD>(dout_tile, dout + sequence * p.H * p.D + h * p.D, p.H * p.D, i0,
                                 kBackwardRows, p.T, p.D, 1.0f);
      if (threadIdx.x < kBackwardRows) {
        const int64_t i = min(i0 + threadIdx.x, p.T - 1);
        row_lse[threadIdx.x] = lse[(b * p.H + h) * p.T + i];
        row_delta[threadIdx.x] = delta[(b * p.H + h) * p.T + i];
      }
      __syncthreads();
      float scores[kBackwardRowsPerWarp], dprobs[kBackwardRowsPerWarp];
      row_dots<kBackwardRowsPerWarp, kMaxD>(scores, q_tile, warp * kBackwardRowsPerWarp, k_tile,
                                            lane);
      row_dots<kBackwardRowsPerWarp, kMaxD>(dprobs, dout_tile, warp * kBackwardRowsPerWarp, v_tile,
                                            lane);
#pragma unroll
      for (int r = 0; r < kBackwardRowsPerWarp; ++r) {
        const int row = warp * kBackwardRowsPerWarp + r;
        const int64_t i = i0 + row;
        const bool visible = key <= i && i < p.T;
        const float prob = visible ? __expf(scores[r] - row_lse[row]) : 0.0f;
        prob_tile[row][lane] = prob;
        dscore_tile[row][lane] = prob * (dprobs[r] - row_delta[row]);
      }
      __syncthreads();
#pragma unroll
      for (int row = 0; row < kBackwardRows; ++row) {
        const float prob = prob_tile[row][lane];
        const float ds = dscore_tile[row][lane];
        // The warp's columns are contiguous: float4 broadcasts of dout and q.
#pragma unroll
        for (int m = 0; m < kOwned; m += 4) {
          const float4 dy = *reinterpret_cast<const float4*>(&dout_tile[row][warp * kOwned + m]);
          const float4 qs = *reinterpret_cast<const float4*>(&q_tile[row][warp * kOwned + m]);
          dv_acc[m] = fmaf(prob, dy.x, dv_acc[m]);
          dv_acc[m + 1] = fmaf(prob, dy.y, dv_acc[m + 1]);
          dv_acc[m + 2] = fmaf(prob, dy.z, dv_acc[m + 2]);
          dv_acc[m + 3] = fmaf(prob, dy.w, dv_acc[m + 3]);
          dk_acc[m] = fmaf(ds, qs.x, dk_acc[m]);  // q_tile holds scale * q
          dk_acc[m + 1] = fmaf(ds, qs.y, dk_acc[m + 1]);
          dk_acc[m + 2] = fmaf(ds, qs.z, dk_acc[m + 2]);
          dk_acc[m + 3] = fmaf(ds, qs.w, dk_acc[m + 3]);
        }
      }
    }
  }
  if (key >= p.T) return;
  T* dk_row = dk + (sequence + key) * p.row_stride + kvh * p.D;
  T* dv_row = dv + (sequence + key) * p.row_stride + kvh * p.D;
#pragma unroll
  for (int m = 0; m < kOwned; ++m) {
    const int d = warp * kOwned + m;
    if (d < p.D) {
      dk_row[d] = from_float<T>(dk_acc[m]);
      dv_row[d] = from_float<T>(dv_acc[m]);
    }
  }
}

Status check_shape(const char* name, const AttentionShape& s, DType type, std::string* shape) {
  *shape = shape_text({{"B", s.B}, {"T", s.T}, {"H", s.H}, {"KV", s.KV}, {"D", s.D}});
  if (s.B < 0 || s.T < 0 || s.H <= 0 || s.KV <= 0 || s.H % s.KV != 0 || s.D <= 0) {
    return argument_error(name, type, *shape, "bad shape (H must be a multiple of KV)");
  }
  if (s.D > 128) return argument_error(name, type, *shape, "head dimension above 128");
  if (s.window > 0 && s.window < s.T) {
    return argument_error(name, type, *shape,
                          "a sliding window shorter than the sequence (these kernels have none)");
  }
  if (s.row_stride < s.D || s.B * s.H > 65535 || s.B * s.KV > 65535) {
    return argument_error(name, type, *shape, "row_stride below D or B*H above 65535");
  }
  return Status::ok();
}

Params make_params(const AttentionShape& s) {
  return {s.B, s.T, s.H, s.KV, s.D, s.row_stride, 1.0f / std::sqrt(static_cast<float>(s.D))};
}

// Calls launch(T{}, std::integral_constant<int, DPL>{}) for the type and D.
template <typename Launch>
Status dispatch_attention(DType type, int64_t D, Launch&& launch) {
  return dispatch_type(type, [&](auto tag) {
    if (D <= 64) return launch(tag, std::integral_constant<int, 2>{});
    return launch(tag, std::integral_constant<int, 4>{});
  });
}

}  // namespace

Status attention_forward(void* out, float* lse, const void* q, const void* k, const void* v,
                         const AttentionShape& shape, DType type, cudaStream_t stream) {
  std::string text;
  if (Status s = check_shape("attention_forward", shape, type, &text); !s) return s;
  if (shape.B == 0 || shape.T == 0) return Status::ok();
  const Params p = make_params(shape);
  const dim3 grid(blocks_for(shape.T, kRows), static_cast<unsigned>(shape.B * shape.H));
  return dispatch_attention(type, shape.D, [&](auto tag, auto dpl) {
    using T = decltype(tag);
    attention_forward_kernel<T, decltype(dpl)::value>
        <<<grid, kThreads, 0, stream>>>(static_cast<T*>(out), lse, static_cast<const T*>(q),
                                        static_cast<const T*>(k), static_cast<const T*>(v), p);
    return check_launch("attention_forward", type, text);
  });
}

Status attention_backward(void* dq, void* dk, void* dv, float* delta, const void* dout,
                          const void* out, const float* lse, const void* q, const void* k,
                          const void* v, const AttentionShape& shape, DType type,
                          cudaStream_t stream) {
  std::string text;
  if (Status s = check_shape("attention_backward", shape, type, &text); !s) return s;
  if (shape.B == 0 || shape.T == 0) return Status::ok();
  const Params p = make_params(shape);
  return dispatch_attention(type, shape.D, [&](auto tag, auto dpl) {
    using T = decltype(tag);
    constexpr int DPL = decltype(dpl)::value;
    const int64_t rows = shape.B * shape.T * shape.H;
    attention_delta_kernel<T><<<blocks_for(rows * 32, 256), 256, 0, stream>>>(
        delta, static_cast<const T*>(dout), static_cast<const T*>(out), p);
    if (Status s = check_launch("attention_backward (delta)", type, text); !s) return s;
    const dim3 dq_grid(blocks_for(shape.T, kWarps * dq_rows_per_warp(DPL)),
                       static_cast<unsigned>(shape.B * shape.H));
    attention_backward_dq_kernel<T, DPL><<<dq_grid, kThreads, 0, stream>>>(
        static_cast<T*>(dq), static_cast<const T*>(dout), lse, delta, static_cast<const T*>(q),
        static_cast<const T*>(k), static_cast<const T*>(v), p);
    if (Status s = check_launch("attention_backward (dq)", type, text); !s) return s;
    const dim3 kv_grid(blocks_for(shape.T, kKeys), static_cast<unsigned>(shape.B * shape.KV));
    attention_backward_dkv_kernel<T, DPL><<<kv_grid, kThreads, 0, stream>>>(
        static_cast<T*>(dk), static_cast<T*>(dv), static_cast<const T*>(dout), lse, delta,
        static_cast<const T*>(q), static_cast<const T*>(k), static_cast<const T*>(v), p);
    return check_launch("attention_backward (dk, dv)", type, text);
  });
}

}  // namespace strata::kernels::cuda
