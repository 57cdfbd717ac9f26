$prelude
// global average pool + flatten, NCHW: one warp per (n, c) row; block (32, 8)
extern "C" __global__ void __launch_bounds__(256)
$name(const $T* __restrict__ x, $T* __restrict__ y, long long N_, long long C_, long long HW_) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef $idx idx_t;
  const idx_t rows = (idx_t)N_ * (idx_t)C_;
  const idx_t HW = (idx_t)HW_;
  for (idx_t r = (idx_t)blockIdx.x * blockDim.y + threadIdx.y; r < rows;
       r += (idx_t)gridDim.x * blockDim.y) {
    const $T* p = x + r * HW;
    float acc = 0.f;
    for (idx_t k = threadIdx.x; k < HW; k += 32) acc += fx_to_f32(p[k]);
#pragma unroll
    for (int off = 16; off > 0; off >>= 1) acc += __shfl_xor_sync(0xffffffffu, acc, off);
    if (threadIdx.x == 0) y[r] = fx_from<$T>(acc / (float)HW);
  }
}
