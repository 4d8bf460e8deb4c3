"""CUDA helpers shared by the tiled GEMM kernels (`expert_tiles`, `quantized_tiles`): one warp's bf16 tensor-core
products over a K slice staged in shared memory (`ldmatrix` fragments, `mma.sync m16n8k16`, fp32 sums; inline
PTX: no header needed).

Layout: `As` holds the block's A rows and `Bs` its weight rows (`y = A W^T`), each row `LDS` bf16 apart with the
slice's K contiguous (a row stride of 16 bytes times an odd number of 4-bank groups keeps `ldmatrix` free of bank
conflicts: 80 and 144 bytes do); a warp owns `MT` m16 tiles from row `wm` and `NT` (even) n8 tiles from column
`wn`. One `ldmatrix.x4` loads an m16 x k16 A fragment, or the k16 B fragments of two n8 tiles.
"""

MMA_HEADER = r"""
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const __nv_bfloat16* p) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

template <int MT, int NT, int LDS, int BK>
__device__ __forceinline__ void mma_slice(const __nv_bfloat16* As, const __nv_bfloat16* Bs, int wm, int wn,
                                          float (&acc)[MT][NT][4]) {
  static_assert(NT % 2 == 0, "B fragments load two n8 tiles at a time");
  const int lane = threadIdx.x & 31;
  // A: lanes 0-15 address rows 0-15 at k, lanes 16-31 the same rows at k + 8 (matrices: rows 0-7 / 8-15, k / k+8)
  const __nv_bfloat16* a_base = As + (wm + (lane & 15)) * LDS + (lane >> 4) * 8;
  // B: lanes 0-7 rows n 0-7 at k, 8-15 the same at k + 8, 16-23 rows n 8-15 at k, 24-31 those at k + 8
  const __nv_bfloat16* b_base = Bs + (wn + (lane & 7) + ((lane >> 4) << 3)) * LDS + ((lane >> 3) & 1) * 8;
  #pragma unroll
  for (int kk = 0; kk < BK; kk += 16) {
    unsigned a[MT][4], b[NT][2];
    #pragma unroll
    for (int i = 0; i < MT; ++i) ldmatrix_x4(a[i], a_base + i * 16 * LDS + kk);
    #pragma unroll
    for (int j = 0; j < NT; j += 2) {
      unsigned r[4];
      ldmatrix_x4(r, b_base + j * 8 * LDS + kk);
      b[j][0] = r[0]; b[j][1] = r[1]; b[j + 1][0] = r[2]; b[j + 1][1] = r[3];
    }
    #pragma unroll
    for (int i = 0; i < MT; ++i)
      #pragma unroll
      for (int j = 0; j < NT; ++j)
        asm volatile(
            "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
            "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
            : "+f"(acc[i][j][0]), "+f"(acc[i][j][1]), "+f"(acc[i][j][2]), "+f"(acc[i][j][3])
            : "r"(a[i][0]), "r"(a[i][1]), "r"(a[i][2]), "r"(a[i][3]), "r"(b[j][0]), "r"(b[j][1]));
  }
}
"""
