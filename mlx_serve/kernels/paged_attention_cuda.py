"""CUDA sources of the paged decode-attention kernels (compiled by `mx.fast.cuda_kernel` through NVRTC).

Two kernels with one block layout and one merge: `MMA_SOURCE` (bf16, tensor cores; the default where it fits)
and `PARTIAL_SOURCE` (any dtype, one thread per 16 bytes of a head), described here.
One thread block per (lane, kv head, partition of the history). Each warp walks tokens of its partition:
`D / VEC` threads share one token (16-byte loads of K and V), so a warp holds `32 * VEC / D` tokens per
iteration and `UNROLL` iterations' loads are issued before any arithmetic. Every warp keeps an online softmax
(max, sum, unnormalised output) per query head of the GQA group in fp32, rescaled once per `UNROLL` tokens; the
warps of a block merge through shared memory (`MERGE_SOURCE`). With one partition the block writes the normalised
output; with several it writes partial (output, max, sum) rows and `REDUCE_SOURCE` merges them.
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

# where a block is: its (partition, kv head, lane) and the partition's token range [start, end) of the lane's history
BLOCK_SOURCE = r"""
  const int part = blockIdx.x;
  const int kvh = blockIdx.y;
  const int lane_idx = blockIdx.z;
  const int num_parts = gridDim.x;
  const int KVH = k_pool_shape[1];
  const int MB = tables_shape[1];
  const int H = KVH * G;
  const int warp = threadIdx.x / 32;
  const int length = lengths[lane_idx];
  const int start = part * part_size[0];
  const int end = min(start + part_size[0], length);
  const float sc = scale[0];
  const int* table = tables + (size_t)lane_idx * MB;
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

  const int lane = threadIdx.x % 32;
  const int sub = lane % LPT;
  const int token_in_iter = lane / LPT;

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
"""

# Template: as PARTIAL_SOURCE with TQ = TK = bf16, D of 64 or 128, G <= 8, BS a multiple of 16, and TILES (16-token
# tiles a warp loads before any arithmetic); the header adds `mma.MMA_HEADER`. The same inputs, grid and outputs.
# Tensor cores instead of a thread per 8 elements: a warp takes 16 tokens at a time, S = Q K^T as m16n8k16 products
# (rows: the group's query heads, zero-padded to 16; columns: tokens) and O += P V (columns: head dims). K and V
# go from global memory straight into fragment registers: a dot product does not care in which order it walks the
# head dims, so each thread loads whole 16-byte runs of a token and Q's fragments take the same order of dims; V's
# fragments pair two tokens a register (`__byte_perm`), the output's columns come out permuted and are put back
# when the warps merge. The scalar kernel spends ~140 instructions a token a thread; this, about 12.
MMA_SOURCE = r"""
  static_assert(D == 64 || D == 128, "tensor-core decode attention takes heads of 64 or 128 dims");
  static_assert(G <= 8 && BS % 16 == 0, "at most 8 query heads a kv head, blocks of whole 16-token tiles");
  constexpr int KCH = D / 32;  // 16-byte runs of a token's K a thread loads (two k16 steps each)
  constexpr int VG = D / 64;   // 16-byte runs of a token's V a thread loads
  constexpr int NT = D / 8;    // n8 tiles of the output
  constexpr int ADVANCE = WARPS * 16 * TILES;

  const int r = (threadIdx.x % 32) / 4;  // fragment row: query head of the group; also a K token, a V dim run
  const int c = threadIdx.x % 4;         // fragment column pair
  const uint4 zero4 = make_uint4(0, 0, 0, 0);

  // Q's A fragments: row r (rows past the group and the upper 8 are zero), dims 32 j + 8 c .. + 7 as K's below
  uint4 qv[KCH];
  #pragma unroll
  for (int j = 0; j < KCH; ++j) {
    qv[j] = r < G ? *reinterpret_cast<const uint4*>(queries + ((size_t)lane_idx * H + kvh * G + r) * D + 32 * j + 8 * c)
                  : zero4;
  }
  float o[NT][4];
  #pragma unroll
  for (int nt = 0; nt < NT; ++nt) o[nt][0] = o[nt][1] = o[nt][2] = o[nt][3] = 0.f;
  float m = PA_NEG_INF, l = 0.f;  // row r's running max (the same in its 4 threads) and this thread's share of the sum

  for (int t0 = start + warp * 16 * TILES; t0 < end; t0 += ADVANCE) {  // warp-uniform
    uint4 kr[TILES][2][KCH], vr[TILES][4][VG];
    #pragma unroll
    for (int u = 0; u < TILES; ++u) {
      const int tb = t0 + 16 * u;
      const size_t base = tb < end ? (size_t)table[tb / BS] * BS + tb % BS : 0;  // a tile lies in one KV block
      #pragma unroll
      for (int h = 0; h < 2; ++h) {  // K: tokens r and 8 + r, the columns of S's two n8 tiles
        const bool ok = tb + 8 * h + r < end;
        const TK* kp = k_pool + ((base + 8 * h + r) * KVH + kvh) * D + 8 * c;
        #pragma unroll
        for (int j = 0; j < KCH; ++j) kr[u][h][j] = ok ? *reinterpret_cast<const uint4*>(kp + 32 * j) : zero4;
      }
      #pragma unroll
      for (int i = 0; i < 4; ++i) {  // V: tokens 2c, 2c + 1, 2c + 8, 2c + 9, the k rows of P V's B fragments
        const int tok = 2 * c + (i & 1) + 8 * (i >> 1);
        const bool ok = tb + tok < end;
        const TK* vp = v_pool + ((base + tok) * KVH + kvh) * D + 8 * r;
        #pragma unroll
        for (int g = 0; g < VG; ++g) vr[u][i][g] = ok ? *reinterpret_cast<const uint4*>(vp + 64 * g) : zero4;
      }
    }
    #pragma unroll
    for (int u = 0; u < TILES; ++u) {
      const int tb = t0 + 16 * u;
      float s[2][4];
      #pragma unroll
      for (int h = 0; h < 2; ++h) {
        s[h][0] = s[h][1] = s[h][2] = s[h][3] = 0.f;
        #pragma unroll
        for (int j = 0; j < KCH; ++j) {
          const unsigned* qw = reinterpret_cast<const unsigned*>(&qv[j]);
          const unsigned* kw = reinterpret_cast<const unsigned*>(&kr[u][h][j]);
          #pragma unroll
          for (int half = 0; half < 2; ++half) {
            const unsigned a[4] = {qw[2 * half], 0u, qw[2 * half + 1], 0u};
            const unsigned b[2] = {kw[2 * half], kw[2 * half + 1]};
            mma_bf16(s[h], a, b);
          }
        }
      }
      // row r's scores for tokens 2c, 2c + 1 (first n8 tile) and 8 + 2c, 9 + 2c (second)
      float x[4];
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int tok = 2 * c + (e & 1) + 8 * (e >> 1);
        x[e] = tb + tok < end ? s[e >> 1][e & 1] * sc : PA_NEG_INF;
      }
      float tile_max = fmaxf(fmaxf(x[0], x[1]), fmaxf(x[2], x[3]));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 1));
      tile_max = fmaxf(tile_max, __shfl_xor_sync(0xffffffffu, tile_max, 2));
      const float m_new = fmaxf(m, tile_max);
      if (m_new == PA_NEG_INF) continue;  // a tile past the end, and no token before it: nothing to add
      const float corr = __expf(m - m_new);  // m = -inf gives 0
      float p[4];
      #pragma unroll
      for (int e = 0; e < 4; ++e) p[e] = __expf(x[e] - m_new);
      l = l * corr + (p[0] + p[1]) + (p[2] + p[3]);
      m = m_new;
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) { o[nt][0] *= corr; o[nt][1] *= corr; }  // rows 8-15 stay zero
      __nv_bfloat162 p01 = __floats2bfloat162_rn(p[0], p[1]);
      __nv_bfloat162 p23 = __floats2bfloat162_rn(p[2], p[3]);
      const unsigned a[4] = {*reinterpret_cast<unsigned*>(&p01), 0u, *reinterpret_cast<unsigned*>(&p23), 0u};
      #pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        // n8 tile nt: column q is dim 64 (nt / 8) + 8 q + nt % 8, i.e. element nt % 8 of thread q's V runs
        const int g = nt / 8, word = (nt % 8) / 2;
        const unsigned pick = (nt & 1) ? 0x7632u : 0x5410u;  // high or low halves of two words: two tokens
        const unsigned* v0 = reinterpret_cast<const unsigned*>(&vr[u][0][g]);
        const unsigned* v1 = reinterpret_cast<const unsigned*>(&vr[u][1][g]);
        const unsigned* v2 = reinterpret_cast<const unsigned*>(&vr[u][2][g]);
        const unsigned* v3 = reinterpret_cast<const unsigned*>(&vr[u][3][g]);
        const unsigned b[2] = {__byte_perm(v0[word], v1[word], pick), __byte_perm(v2[word], v3[word], pick)};
        mma_bf16(o[nt], a, b);
      }
    }
  }
  l += __shfl_xor_sync(0xffffffffu, l, 1);
  l += __shfl_xor_sync(0xffffffffu, l, 2);

  // merge the warps through shared memory: thread (r, c) holds head r's dims 64 g + 16 c + {e, 8 + e}
  __shared__ float sm_m[WARPS][G];
  __shared__ float sm_l[WARPS][G];
  __shared__ float sm_acc[WARPS][G][D];
  if (r < G) {
    if (c == 0) { sm_m[warp][r] = m; sm_l[warp][r] = l; }
    #pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int d = 64 * (nt / 8) + 16 * c + nt % 8;
      sm_acc[warp][r][d] = o[nt][0];
      sm_acc[warp][r][d + 8] = o[nt][1];
    }
  }
"""

# the warps' (max, sum, output) in shared memory -> the block's output (normalised, or a partition's partial)
MERGE_SOURCE = r"""
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
