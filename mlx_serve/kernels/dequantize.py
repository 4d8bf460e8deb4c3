"""Affine 4-bit weights to bf16 at memory speed, and the dense product of many rows over them.

Why: a 4-bit product of a prefill chunk's rows costs more through a quantized GEMM than dequantizing the weights
once and running the bf16 GEMM (cuBLAS) over them, from 129 rows (`quantized_tiles.DENSE_FROM_ROWS`): this kernel
writes the dense weights of an 8B layer (~0.5 GB moved: 0.1 GB packed read, 0.39 GB bf16 written) while the
quantized GEMM dequantizes each weight fragment once per row tile. MLX's own `mx.dequantize` is the same arithmetic
at about half the speed, and for weights split over K (`quantized_rows.split_k`) needs one more copy to put the
slices back in order.

Each weight comes out as MLX dequantizes it: `w = bf16(q * scale + bias)`, one rounding (`fma.rn.bf16x2`), so the
result equals `mx.dequantize`'s bit for bit. Whole `[N, K/8]` or split `[S, N, K/S/8]` weights come out as one
`[N, K]` matrix.

Speed: the first form turned one packed word per thread into 16 bytes (~2.5 TB/s of the H200's ~4.3): 4 bytes of
reads in flight per thread, a 256-thread block per 256 words. Now each thread turns `WORDS_PER_THREAD` words (all
its loads issued before the first use: 8 words, 32 bytes in flight), in one of two mappings (`CONTIGUOUS`):
- interleaved (default): a warp takes `32 * VEC` consecutive words of a slice, lane `l` the words `l, l + 32, ...`:
  every load instruction of a warp reads 128 consecutive bytes and every 16-byte store instruction writes 512
  consecutive bytes (writes are 4/5 of the traffic: whole sectors per instruction); a lane's words may cross rows
  and groups, so each has its own (scale, bias), mostly L1 hits;
- contiguous: a thread takes `VEC` consecutive words of one row (16-byte loads; one group per 4 words, so one
  (scale, bias) per 16 bytes read) and writes their `16 * VEC` bytes as 16-byte stores; a store instruction of a
  warp then covers 32 runs of 16 bytes, `16 * VEC` apart. Needs a slice row's words to be a multiple of `VEC`
  (the interleaved mapping takes any shape) and falls back to 4-byte loads where the weights are not 16-byte
  aligned (a view at an odd offset).
"""

from __future__ import annotations

import functools

import mlx.core as mx

GROUP_SIZES = (32, 64, 128)
THREADS = 256  # a block's threads
WORDS_PER_THREAD = 8  # packed words (64 weights) a thread turns into 128 bytes of bf16: 1 (the first form), 4 or 8
CONTIGUOUS = 0  # 1: a thread's words consecutive (16-byte loads); 0: a warp's lanes interleaved (coalesced stores)

# One packed word (8 weights, lowest nibble first) to 8 bf16 as MLX dequantizes them; shared with `quantized_gemm`
DEQUANTIZE_HEADER = r"""
// one 16-byte global store (the front end split the interleaved mapping's uint4 stores into four 4-byte ones)
__device__ __forceinline__ void store16(void* at, uint4 v) {
  asm volatile("st.global.v4.b32 [%0], {%1, %2, %3, %4};\n" :: "l"(at), "r"(v.x), "r"(v.y), "r"(v.z), "r"(v.w)
               : "memory");
}

// (a & 0x000F000F) | 0x43004300 as one instruction (ptxas otherwise emits an AND and an OR)
__device__ __forceinline__ uint32_t nibbles_over_128(uint32_t a) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;\n" : "=r"(r) : "r"(a), "r"(0x000F000Fu), "r"(0x43004300u));
  return r;
}

__device__ __forceinline__ uint4 dequantize_word(uint32_t word, __nv_bfloat162 scale, __nv_bfloat162 bias) {
  const uint32_t shifted = word >> 4;
  const __nv_bfloat162 magic = __floats2bfloat162_rn(128.f, 128.f);
  uint32_t pairs[4];
  #pragma unroll
  for (int h = 0; h < 4; ++h) {
    // byte h of the word (nibbles 2h, 2h + 1) to the low half, byte h of word >> 4 to the high half, masked to
    // the low nibbles over bf16 128's bits: 128 + q exactly; then q * scale + bias rounded once
    const uint32_t bits = nibbles_over_128(__byte_perm(word, shifted, h | ((4 + h) << 8)));
    const __nv_bfloat162 q = __hsub2(*reinterpret_cast<const __nv_bfloat162*>(&bits), magic);
    const __nv_bfloat162 v = __hfma2(q, scale, bias);
    pairs[h] = *reinterpret_cast<const uint32_t*>(&v);
  }
  return make_uint4(pairs[0], pairs[1], pairs[2], pairs[3]);
}
"""

# Template: GS (group size), VEC (words a thread), CONTIG (the mapping). Inputs: w [S, N, words] uint32 (words =
# Ks / 8), scales and biases [S, N, Ks / GS] bf16. Output: y [N, S * Ks] bf16. Grid: (ceil(N * words / (VEC *
# THREADS)) * THREADS, S, 1) threads, blocks of THREADS along x: block x's threads take the slice's flat words from
# x * THREADS * VEC on (flat: n * words + word), block y is the slice.
SOURCE = r"""
  constexpr int WG = GS / 8;                                   // packed words of a group
  const int S = w_shape[0], N = w_shape[1], words = w_shape[2];
  const uint32_t total = (uint32_t)N * words;                  // packed words of one slice
  const uint32_t groups = words / WG;                          // groups of a slice row
  const size_t K = (size_t)S * words * 8;
  const uint32_t* ws = w + (size_t)blockIdx.y * total;
  const __nv_bfloat16* ss = scales + (size_t)blockIdx.y * N * groups;
  const __nv_bfloat16* bs = biases + (size_t)blockIdx.y * N * groups;
  __nv_bfloat16* ys = y + (size_t)blockIdx.y * words * 8;     // the slice's first column
  if constexpr (CONTIG) {
    constexpr int V4 = VEC >= 4 ? VEC / 4 : 1;                 // 16-byte loads (the launcher keeps VEC % 4 == 0)
    const uint32_t f = (blockIdx.x * blockDim.x + threadIdx.x) * VEC;
    if (f >= total) return;
    const uint32_t n = f / words, word = f - n * words;        // words % VEC == 0: all VEC in row n
    const bool aligned = (reinterpret_cast<unsigned long long>(ws) & 15ull) == 0;  // the same everywhere
    uint4 packed[V4];
    __nv_bfloat162 pair[V4];                                   // (scale, bias) of each 4 words (32 weights <= GS)
    #pragma unroll
    for (int v = 0; v < V4; ++v) {
      const uint32_t* p = ws + f + 4 * v;
      packed[v] = aligned ? *reinterpret_cast<const uint4*>(p) : make_uint4(p[0], p[1], p[2], p[3]);
      const size_t g = (size_t)n * groups + (word + 4 * v) / WG;
      pair[v] = __halves2bfloat162(ss[g], bs[g]);
    }
    __nv_bfloat16* out = ys + (size_t)n * K + (size_t)word * 8;
    #pragma unroll
    for (int v = 0; v < V4; ++v) {
      const __nv_bfloat162 scale = __low2bfloat162(pair[v]), bias = __high2bfloat162(pair[v]);
      const uint32_t q[4] = {packed[v].x, packed[v].y, packed[v].z, packed[v].w};
      #pragma unroll
      for (int i = 0; i < 4; ++i) store16(out + (4 * v + i) * 8, dequantize_word(q[i], scale, bias));
    }
  } else {
    // the warp's 32 * VEC words from `base`; lane l takes base + l + 32 j
    const uint32_t base = (blockIdx.x * blockDim.x + (threadIdx.x & ~31u)) * VEC + (threadIdx.x & 31u);
    uint32_t n = base / words, word = base - n * words;
    uint32_t packed[VEC];
    __nv_bfloat162 pair[VEC];
    size_t at[VEC];
    #pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (j > 0) {
        word += 32;
        while (word >= (uint32_t)words) word -= words, ++n;
      }
      const bool valid = base + 32u * j < total;
      const size_t g = (size_t)n * groups + word / WG;
      packed[j] = valid ? ws[base + 32u * j] : 0u;
      pair[j] = valid ? __halves2bfloat162(ss[g], bs[g]) : __floats2bfloat162_rn(0.f, 0.f);
      at[j] = (size_t)n * K + (size_t)word * 8;
    }
    #pragma unroll
    for (int j = 0; j < VEC; ++j) {
      if (base + 32u * j >= total) break;
      store16(ys + at[j], dequantize_word(packed[j], __low2bfloat162(pair[j]), __high2bfloat162(pair[j])));
    }
  }
"""


@functools.cache
def _kernel() -> object:
    return mx.fast.cuda_kernel("mlx_serve_dequantize", ["w", "scales", "biases"], ["y"], SOURCE,
                               header=DEQUANTIZE_HEADER)  # fmt: skip


def supports(weight: mx.array, scales: mx.array, biases: mx.array | None, group_size: int, bits: int,
             mode: str = "affine") -> bool:  # fmt: skip
    """Affine 4-bit weights (`[N, K/8]` or split `[S, N, Ks/8]` uint32) with bf16 scales and biases."""
    if bits != 4 or mode != "affine" or biases is None or group_size not in GROUP_SIZES:
        return False
    if weight.dtype != mx.uint32 or scales.dtype != mx.bfloat16 or biases.dtype != mx.bfloat16:
        return False
    words_fit = weight.shape[-2] * weight.shape[-1] < 2**31  # a slice's flat word index in 32 bits
    return weight.ndim in (2, 3) and (weight.shape[-1] * 8) % group_size == 0 and words_fit


def mapping(words: int) -> tuple[int, bool]:
    """(words a thread, contiguous) for slice rows of `words` packed words: the module's choice, interleaved where
    the contiguous mapping cannot take the rows (`words` not a multiple of its `VEC`)."""
    vec = WORDS_PER_THREAD
    contiguous = bool(CONTIGUOUS) and vec % 4 == 0 and words % vec == 0
    return vec, contiguous


def dequantize_4bit(weight: mx.array, scales: mx.array, biases: mx.array, group_size: int) -> mx.array:
    """The dense `[N, K]` bf16 weight of 4-bit `weight` `[N, K/8]` or `[S, N, K/S/8]` (K in slices, put back in
    order), equal to `mx.dequantize`'s."""
    if weight.ndim == 2:
        weight, scales, biases = weight[None], scales[None], biases[None]
    slices, n, words = weight.shape
    vec, contiguous = mapping(words)
    (y,) = _kernel()(
        inputs=[weight, scales, biases],
        template=[("GS", group_size), ("VEC", vec), ("CONTIG", contiguous)],
        grid=(-(-n * words // (vec * THREADS)) * THREADS, slices, 1),
        threadgroup=(THREADS, 1, 1),
        output_shapes=[(n, slices * words * 8)],
        output_dtypes=[mx.bfloat16],
    )
    return y


def dense_matmul(x: mx.array, weight: mx.array, scales: mx.array, biases: mx.array, group_size: int,
                 bits: int = 4) -> mx.array:  # fmt: skip
    """`x @ dequantize(weight).T` as the bf16 GEMM over weights dequantized by `dequantize_4bit`."""
    if bits != 4:
        raise ValueError(f"the dequantize kernel takes 4-bit weights, not {bits}-bit")
    return x @ dequantize_4bit(weight, scales, biases, group_size).T
