"""CUDA helpers shared by the tiled GEMM kernels (`expert_tiles`, `quantized_tiles`): one warp's bf16 tensor-core
products over a K slice staged in shared memory (`ldmatrix` fragments, `mma.sync m16n8k16`, fp32 sums; inline
PTX: no header needed).

Layout: `As` holds the block's A rows and `Bs` its weight rows (`y = A W^T`), each row's K slice in 16-byte
chunks placed by a `Padded<LDS>` or `Swizzled` layout (both keep `ldmatrix` free of bank conflicts); a warp owns
`MT` m16 tiles from row `wm` and `NT` (even) n8 tiles from column `wn`. One `ldmatrix.x4` loads an m16 x k16 A fragment, or the k16 B fragments of two n8 tiles.

Staging: `cp_async16` copies 16 bytes from global to shared memory without passing through registers (zeros
where `valid` is false), so a block keeps several K steps of copies in flight behind one barrier a step.
"""

MMA_HEADER = r"""
__device__ __forceinline__ void ldmatrix_x4(unsigned (&r)[4], const __nv_bfloat16* p) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(p));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(address));
}

__device__ __forceinline__ void cp_async16(void* smem, const void* global, bool valid) {
  const unsigned address = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(address), "l"(global), "r"(valid ? 16 : 0)
               : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }
template <int PENDING>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" :: "n"(PENDING) : "memory");
}

// The copy pipeline over `steps` K steps in PIPE shared-memory stages, `copy_step(step)` issuing one step's
// cp.async copies into stage `step % PIPE`: `pipe_start` puts the first PIPE - 1 steps in flight; `pipe_next`,
// at the top of each step, waits for this step's copies (PIPE - 2 younger groups may stay in flight) and, past
// the barrier that also says every warp is done with the previous step's stage, refills that stage. A group is
// committed every time, empty or not, so the wait count stays right to the last step.
template <int PIPE, class Copy>
__device__ __forceinline__ void pipe_start(int steps, Copy& copy_step) {
  #pragma unroll
  for (int st = 0; st < PIPE - 1; ++st) {
    if (st < steps) copy_step(st);
    cp_async_commit();
  }
}
template <int PIPE, class Copy>
__device__ __forceinline__ void pipe_next(int step, int steps, Copy& copy_step) {
  cp_async_wait<PIPE - 2>();
  __syncthreads();
  if (step + PIPE - 1 < steps) copy_step(step + PIPE - 1);
  cp_async_commit();
}

template <int MT, int NT>
__device__ __forceinline__ void zero(float (&acc)[MT][NT][4]) {
  #pragma unroll
  for (int i = 0; i < MT; ++i)
    #pragma unroll
    for (int j = 0; j < NT; ++j)
      #pragma unroll
      for (int c = 0; c < 4; ++c) acc[i][j][c] = 0.f;
}

__device__ __forceinline__ void mma_bf16(float (&acc)[4], const unsigned (&a)[4], const unsigned (&b)[2]) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
      "{%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
      : "+f"(acc[0]), "+f"(acc[1]), "+f"(acc[2]), "+f"(acc[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

// Where a slice's 16-byte chunk `chunk` of row `row` sits, in bf16 elements from the slice's start: rows padded
// to LDS (a stride of 16 bytes times an odd number keeps ldmatrix's 8 rows on distinct banks), or rows of 8
// chunks unpadded with the chunk index XORed by the row's low 3 bits (the same 8 rows again on distinct banks).
template <int LDS>
struct Padded {
  static constexpr int ROW = LDS;  // bf16 a row takes in shared memory
  static __device__ __forceinline__ int at(int row, int chunk) { return row * LDS + chunk * 8; }
};
struct Swizzled {
  static constexpr int ROW = 64;
  static __device__ __forceinline__ int at(int row, int chunk) { return row * 64 + ((chunk ^ (row & 7)) * 8); }
};
// a k step's layout: 32 bf16 (rows padded to 80 bytes) or 64 (rows of 128 bytes, swizzled)
template <int KB> struct StepLayout { using type = Padded<40>; };
template <> struct StepLayout<64> { using type = Swizzled; };

template <int MT, int NT, int BK, class Layout>
__device__ __forceinline__ void mma_slice(const __nv_bfloat16* As, const __nv_bfloat16* Bs, int wm, int wn,
                                          float (&acc)[MT][NT][4]) {
  static_assert(NT % 2 == 0, "B fragments load two n8 tiles at a time");
  const int lane = threadIdx.x & 31;
  // A: lanes 0-15 address rows 0-15 at k, lanes 16-31 the same rows at k + 8 (matrices: rows 0-7 / 8-15, k / k+8)
  const int a_row = wm + (lane & 15), a_chunk = lane >> 4;
  // B: lanes 0-7 rows n 0-7 at k, 8-15 the same at k + 8, 16-23 rows n 8-15 at k, 24-31 those at k + 8
  const int b_row = wn + (lane & 7) + ((lane >> 4) << 3), b_chunk = (lane >> 3) & 1;
  #pragma unroll
  for (int kk = 0; kk < BK; kk += 16) {
    unsigned a[MT][4], b[NT][2];
    #pragma unroll
    for (int i = 0; i < MT; ++i) ldmatrix_x4(a[i], As + Layout::at(a_row + i * 16, a_chunk + kk / 8));
    #pragma unroll
    for (int j = 0; j < NT; j += 2) {
      unsigned r[4];
      ldmatrix_x4(r, Bs + Layout::at(b_row + j * 8, b_chunk + kk / 8));
      b[j][0] = r[0]; b[j][1] = r[1]; b[j + 1][0] = r[2]; b[j + 1][1] = r[3];
    }
    #pragma unroll
    for (int i = 0; i < MT; ++i)
      #pragma unroll
      for (int j = 0; j < NT; ++j) mma_bf16(acc[i][j], a[i], b[j]);
  }
}
"""
