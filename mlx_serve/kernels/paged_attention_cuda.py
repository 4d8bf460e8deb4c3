"""CUDA source of the paged decode-attention kernel (compiled by `mx.fast.cuda_kernel` through NVRTC).

One thread block per (lane, kv head, partition of the history). Each warp walks tokens of its partition:
`D / VEC` threads share one token (16-byte loads of K and V), so a warp holds `32 * VEC / D` tokens per
iteration and `UNROLL` iterations' loads are issued before any arithmetic. Every warp keeps an online softmax
(max, sum, unnormalised output) per query head of the GQA group in fp32, rescaled once per `UNROLL` tokens; the
warps of a block merge through shared memory. With one partition the block writes the normalised output; with
several it writes partial (output, max, sum) rows and `REDUCE_SOURCE` merges them.
"""

from __future__ import annotations

HEADER = r"""
// MLX's default header already brings in cuda_fp16 / cuda_bf16 (its dtypes appear in the signature)
#define PA_NEG_INF __uint_as_float(0xff800000u)

__device__ __forceinline__ float pa_to_float(float x) { return x; }
__device__ __forceinline__ float pa_to_float(__half x) { return __half2float(x); }
__device__ __forceinline__ float pa_to_float(__nv_bfloat16 x) { return __bfloat162float(x); }

template <typename T> __device__ __forceinline__ T pa_from_float(float x);
template <> __device__ __forceinline__ float pa_from_float<float>(float x) { return x; }
template <> __device__ __forceinline__ __half pa_from_float<__half>(float x) { return __float2half(x); }
template <> __device__ __forceinline__ __nv_bfloat16 pa_from_float<__nv_bfloat16>(float x) {
  return __float2bfloat16(x);
}

// merge (m2, l2) into (m1, l1): returns the scales for side 1 and side 2; both -inf leaves zeros
__device__ __forceinline__ void pa_merge_scales(float m1, float m2, float& m_new, float& c1, float& c2) {
  m_new = fmaxf(m1, m2);
  c1 = (m1 == PA_NEG_INF) ? 0.f : __expf(m1 - m_new);
  c2 = (m2 == PA_NEG_INF) ? 0.f : __expf(m2 - m_new);
}
"""

# Template: TQ (query/output dtype), TK (pool dtype), D, G (query heads per kv head), BS (block size), WARPS,
# BLOCKWISE (load order, see the source);
# the macro PA_SPLIT (set in the header) picks partial or final outputs. Inputs: queries [n, H, 1, D],
# k_pool/v_pool [slots, KVH, D], tables [n, max_blocks] int32, lengths [n] int32, part_size [1] int32,
# scale [1] float32. Grid: (partitions, KVH, n) blocks of WARPS * 32 threads.
PARTIAL_SOURCE = r"""
  constexpr int VEC = 16 / sizeof(TK);
  constexpr int LPT = D / VEC;            // threads sharing one token
  constexpr int TPW = 32 / LPT;           // tokens per warp per iteration
  static_assert(D % VEC == 0 && 32 % LPT == 0, "head_dim must be 32, 64, 128 or 256 elements of 16 bytes");
  // BLOCKWISE: a warp's unrolled loads are consecutive tokens of one KV block (one table read, 8 loads in
  // flight); otherwise they are WARPS * TPW tokens apart (a table read per token, 4 loads in flight)
  static_assert(!BLOCKWISE || BS % TPW == 0, "blockwise needs whole iterations per KV block");
  constexpr int UNROLL = BLOCKWISE ? ((BS / TPW) < 8 ? (BS / TPW) : 8) : 4;
  constexpr int STEP = BLOCKWISE ? TPW : WARPS * TPW;
  constexpr int ADVANCE = WARPS * UNROLL * TPW;

  const int part = blockIdx.x;
  const int kvh = blockIdx.y;
  const int lane_idx = blockIdx.z;
  const int num_parts = gridDim.x;
  const int KVH = k_pool_shape[1];
  const int MB = tables_shape[1];
  const int H = KVH * G;
  const int warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const int sub = lane % LPT;
  const int token_in_iter = lane / LPT;
  const int length = lengths[lane_idx];
  const int psize = part_size[0];
  const int start = part * psize;
  const int end = min(start + psize, length);
  const float sc = scale[0];
  const int* table = tables + (size_t)lane_idx * MB;

  float q[G][VEC];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    const TQ* qp = queries + ((size_t)lane_idx * H + kvh * G + g) * D + sub * VEC;
    #pragma unroll
    for (int i = 0; i < VEC; ++i) q[g][i] = pa_to_float(qp[i]) * sc;
  }
  float m[G], l[G], acc[G][VEC];
  #pragma unroll
  for (int g = 0; g < G; ++g) {
    m[g] = PA_NEG_INF; l[g] = 0.f;
    #pragma unroll
    for (int i = 0; i < VEC; ++i) acc[g][i] = 0.f;
  }

  for (int base = start + warp * (BLOCKWISE ? UNROLL * TPW : TPW); base < end; base += ADVANCE) {  // warp-uniform
    uint4 kraw[UNROLL], vraw[UNROLL];
    bool valid[UNROLL];
    const size_t block_base = BLOCKWISE ? (size_t)table[base / BS] * BS + base % BS : 0;
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + u * STEP + token_in_iter;
      valid[u] = t < end;
      if (valid[u]) {
        const size_t slot = BLOCKWISE ? block_base + (t - base) : (size_t)table[t / BS] * BS + (t % BS);
        const size_t off = (slot * KVH + kvh) * D + sub * VEC;
        kraw[u] = *reinterpret_cast<const uint4*>(k_pool + off);
        vraw[u] = *reinterpret_cast<const uint4*>(v_pool + off);
      } else {
        kraw[u] = make_uint4(0, 0, 0, 0);
        vraw[u] = make_uint4(0, 0, 0, 0);
      }
    }
    // the UNROLL tokens' scores first, then one rescale of each head's running sums for all of them: an online
    // softmax per token spent most of the kernel's instructions on rescaling (it is issue-bound at few lanes)
    float s[UNROLL][G];
    #pragma unroll
    for (int u = 0; u < UNROLL; ++u) {
      const TK* kv = reinterpret_cast<const TK*>(&kraw[u]);
      #pragma unroll
      for (int g = 0; g < G; ++g) {
        float dot = 0.f;
        #pragma unroll
        for (int i = 0; i < VEC; ++i) dot += q[g][i] * pa_to_float(kv[i]);
        #pragma unroll
        for (int o = LPT / 2; o > 0; o /= 2) dot += __shfl_xor_sync(0xffffffffu, dot, o);
        s[u][g] = valid[u] ? dot : PA_NEG_INF;
      }
    }
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      float m_new = m[g];
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) m_new = fmaxf(m_new, s[u][g]);
      if (m_new == PA_NEG_INF) continue;  // no token of this thread's so far: nothing to add
      const float c = __expf(m[g] - m_new);  // m = -inf gives 0
      float p[UNROLL];
      float p_sum = 0.f;
      #pragma unroll
      for (int u = 0; u < UNROLL; ++u) {
        p[u] = __expf(s[u][g] - m_new);  // a token past the end (-inf) gives 0
        p_sum += p[u];
      }
      l[g] = l[g] * c + p_sum;
      #pragma unroll
      for (int i = 0; i < VEC; ++i) {
        float a = acc[g][i] * c;
        #pragma unroll
        for (int u = 0; u < UNROLL; ++u) a = fmaf(p[u], pa_to_float(reinterpret_cast<const TK*>(&vraw[u])[i]), a);
        acc[g][i] = a;
      }
      m[g] = m_new;
    }
  }

  // merge the warp's token groups (threads with the same `sub`)
  #pragma unroll
  for (int o = LPT; o < 32; o *= 2) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      const float m_o = __shfl_xor_sync(0xffffffffu, m[g], o);
      const float l_o = __shfl_xor_sync(0xffffffffu, l[g], o);
      float m_new, c1, c2;
      pa_merge_scales(m[g], m_o, m_new, c1, c2);
      l[g] = l[g] * c1 + l_o * c2;
      #pragma unroll
      for (int i = 0; i < VEC; ++i) {
        const float a_o = __shfl_xor_sync(0xffffffffu, acc[g][i], o);
        acc[g][i] = acc[g][i] * c1 + a_o * c2;
      }
      m[g] = m_new;
    }
  }

  // merge the warps through shared memory
  __shared__ float sm_m[WARPS][G];
  __shared__ float sm_l[WARPS][G];
  __shared__ float sm_acc[WARPS][G][D];
  if (token_in_iter == 0) {
    #pragma unroll
    for (int g = 0; g < G; ++g) {
      if (sub == 0) { sm_m[warp][g] = m[g]; sm_l[warp][g] = l[g]; }
      #pragma unroll
      for (int i = 0; i < VEC; ++i) sm_acc[warp][g][sub * VEC + i] = acc[g][i];
    }
  }
  __syncthreads();
  for (int idx = threadIdx.x; idx < G * D; idx += blockDim.x) {
    const int g = idx / D;
    const int d = idx % D;
    float mmax = PA_NEG_INF;
    #pragma unroll
    for (int w = 0; w < WARPS; ++w) mmax = fmaxf(mmax, sm_m[w][g]);
    float lsum = 0.f, a = 0.f;
    if (mmax != PA_NEG_INF) {
      #pragma unroll
      for (int w = 0; w < WARPS; ++w) {
        const float c = (sm_m[w][g] == PA_NEG_INF) ? 0.f : __expf(sm_m[w][g] - mmax);
        lsum += sm_l[w][g] * c;
        a += sm_acc[w][g][d] * c;
      }
    }
    const size_t row = (size_t)lane_idx * H + kvh * G + g;
#if PA_SPLIT
    o_part[(row * num_parts + part) * D + d] = a;
    if (d == 0) {
      ml_part[(row * num_parts + part) * 2] = mmax;
      ml_part[(row * num_parts + part) * 2 + 1] = lsum;
    }
#else
    out[row * D + d] = pa_from_float<TQ>(lsum > 0.f ? a / lsum : 0.f);
#endif
  }
"""

# Template: TQ, D. Inputs: o_part [n, H, P, D] fp32, ml_part [n, H, P, 2] fp32. One block per (head, lane).
REDUCE_SOURCE = r"""
  // one warp per (head, lane). The partitions' scales go through shared memory a chunk at a time so that the
  // loads of successive partitions' outputs are independent and overlap (a loop that computed each partition's
  // scale before loading its outputs waited out a memory latency per partition: 35 us for 32 partitions)
  constexpr int CHUNK = 256;
  constexpr int PER = (D + 31) / 32;
  const int h = blockIdx.y;
  const int lane_idx = blockIdx.z;
  const int H = gridDim.y;
  const int tid = threadIdx.x;
  const int P = o_part_shape[2];
  const size_t row = (size_t)lane_idx * H + h;
  const float* ml = ml_part + row * P * 2;
  float mmax = PA_NEG_INF;
  for (int p = tid; p < P; p += 32) mmax = fmaxf(mmax, ml[p * 2]);
  #pragma unroll
  for (int o = 16; o > 0; o /= 2) mmax = fmaxf(mmax, __shfl_xor_sync(0xffffffffu, mmax, o));
  __shared__ float scales[CHUNK];
  float lsum = 0.f;
  float a[PER];
  #pragma unroll
  for (int j = 0; j < PER; ++j) a[j] = 0.f;
  for (int base = 0; base < P; base += CHUNK) {
    const int count = min(CHUNK, P - base);
    for (int q = tid; q < count; q += 32) {
      const float mp = ml[(base + q) * 2];
      const float c = (mp == PA_NEG_INF || mmax == PA_NEG_INF) ? 0.f : __expf(mp - mmax);
      scales[q] = c;
      if (c != 0.f) lsum += ml[(base + q) * 2 + 1] * c;
    }
    __syncwarp();
    const float* op = o_part + (row * P + base) * D;
    #pragma unroll 8
    for (int q = 0; q < count; ++q) {
      const float c = scales[q];
      #pragma unroll
      for (int j = 0; j < PER; ++j) {
        const int d = tid + j * 32;
        if (d < D && c != 0.f) a[j] += op[(size_t)q * D + d] * c;
      }
    }
    __syncwarp();
  }
  #pragma unroll
  for (int o = 16; o > 0; o /= 2) lsum += __shfl_xor_sync(0xffffffffu, lsum, o);
  #pragma unroll
  for (int j = 0; j < PER; ++j) {
    const int d = tid + j * 32;
    if (d < D) out[row * D + d] = pa_from_float<TQ>(lsum > 0.f ? a[j] / lsum : 0.f);
  }
"""
