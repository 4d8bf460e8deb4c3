"""CUDA source of the decode QKV kernel: one launch in place of q_norm, k_norm, two RoPEs and two KV scatters.

One warp per (row, head) of the fused q/k/v projection output. A query head is RMS-normalised, rotated and
written to the output; a key head is normalised, rotated and written into the KV pool at the row's slot, with
the matching value head copied beside it. The rounding points are MLX's own: `mx.fast.rms_norm` rounds
`x * rsqrt(mean(x^2) + eps)` to the activation dtype before the weight multiply, and `mx.fast.rope` computes
`theta = scale * position * exp2(-(i / (D/2)) * log2(base))` in fp32 and rounds the rotated pair.

The pool arrays are inputs (MLX custom kernels have no in/out buffers) and are written through their pointers:
they are row-contiguous and persistent, so MLX hands the kernel the pool's own memory, and every later reader is
queued behind this kernel on the same stream.
"""

from __future__ import annotations

# Template: T (activation dtype), TK (pool dtype), D, H, KVH, NORM (q/k RMSNorm), TRAD (interleaved RoPE pairs),
# WARPS. Inputs: qkv [rows, (H + 2 KVH) * D], q_weight [D], k_weight [D], positions [rows] int32, slots [rows]
# int32, k_pool / v_pool [slots, KVH, D], params [3] float32 (eps, log2(base), scale). Output: q_out [rows, H, 1, D].
# Grid: ceil(rows * (H + KVH) / WARPS) blocks of WARPS * 32 threads.
QKV_SOURCE = r"""
  constexpr int PAIRS = D / 2;
  constexpr int PPL = PAIRS / 32;  // rotation pairs per thread
  static_assert(PAIRS % 32 == 0, "head_dim must be a multiple of 64");
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int rows = positions_shape[0];
  const int item = blockIdx.x * WARPS + warp;
  if (item >= rows * (H + KVH)) return;  // warp-uniform
  const int row = item / (H + KVH);
  const int head = item % (H + KVH);
  const bool is_query = head < H;
  const T* src = qkv + ((size_t)row * (H + 2 * KVH) + head) * D;

  int i1[PPL], i2[PPL];
  float x1[PPL], x2[PPL];
  #pragma unroll
  for (int j = 0; j < PPL; ++j) {
    const int p = lane + 32 * j;
    i1[j] = TRAD ? 2 * p : p;
    i2[j] = TRAD ? 2 * p + 1 : p + PAIRS;
    x1[j] = pa_to_float(src[i1[j]]);
    x2[j] = pa_to_float(src[i2[j]]);
  }
  // a K head's V row is loaded now, before any store: a load after a store to the pool (which may alias) waits
  T vv[D / 32];
  const int kvh = head - H;
  if (!is_query) {
    const T* vs = qkv + ((size_t)row * (H + 2 * KVH) + H + KVH + kvh) * D;
    #pragma unroll
    for (int j = 0; j < D / 32; ++j) vv[j] = vs[lane + 32 * j];
  }

  if (NORM) {
    float ss = 0.f;
    #pragma unroll
    for (int j = 0; j < PPL; ++j) ss += x1[j] * x1[j] + x2[j] * x2[j];
    #pragma unroll
    for (int o = 16; o > 0; o /= 2) ss += __shfl_xor_sync(0xffffffffu, ss, o);
    const float inv = rsqrtf(ss / D + params[0]);
    const auto* w = is_query ? q_weight : k_weight;  // one dtype: both norms' weights, or the pool twice
    #pragma unroll
    for (int j = 0; j < PPL; ++j) {
      // MLX: w * T(x * inv), the product rounded to T
      x1[j] = pa_to_float(pa_from_float<T>(pa_to_float(w[i1[j]]) * pa_to_float(pa_from_float<T>(x1[j] * inv))));
      x2[j] = pa_to_float(pa_from_float<T>(pa_to_float(w[i2[j]]) * pa_to_float(pa_from_float<T>(x2[j] * inv))));
    }
  }

  const float base = params[1];
  const float L = params[2] * (float)positions[row];
  T r1[PPL], r2[PPL];
  #pragma unroll
  for (int j = 0; j < PPL; ++j) {
    const float d = (float)(lane + 32 * j) / (float)PAIRS;
    const float theta = L * exp2f(-d * base);
    const float c = cosf(theta);
    const float s = sinf(theta);
    r1[j] = pa_from_float<T>(x1[j] * c - x2[j] * s);
    r2[j] = pa_from_float<T>(x1[j] * s + x2[j] * c);
  }

  if (is_query) {
    T* dst = q_out + ((size_t)row * H + head) * D;
    #pragma unroll
    for (int j = 0; j < PPL; ++j) { dst[i1[j]] = r1[j]; dst[i2[j]] = r2[j]; }
    return;
  }
  const size_t at = ((size_t)slots[row] * KVH + kvh) * D;
  TK* kd = const_cast<TK*>(k_pool) + at;
  TK* vd = const_cast<TK*>(v_pool) + at;
  #pragma unroll
  for (int j = 0; j < PPL; ++j) {
    kd[i1[j]] = pa_from_float<TK>(pa_to_float(r1[j]));
    kd[i2[j]] = pa_from_float<TK>(pa_to_float(r2[j]));
  }
  #pragma unroll
  for (int j = 0; j < D / 32; ++j) vd[lane + 32 * j] = pa_from_float<TK>(pa_to_float(vv[j]));
"""
