$prelude
// global average pool + flatten, NHWC: x: channels of a block, y: 8 slices of HW; block (32, 8)
extern "C" __global__ void __launch_bounds__(256)
$name(const $T* __restrict__ x, $T* __restrict__ y, long long N_, long long C_, long long HW_) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef $idx idx_t;
  __shared__ float part[8][33];
  const idx_t N = (idx_t)N_, C = (idx_t)C_, HW = (idx_t)HW_;
  const idx_t c = (idx_t)blockIdx.x * 32 + threadIdx.x;
  for (idx_t n = blockIdx.y; n < N; n += gridDim.y) {
    float acc = 0.f;
    if (c < C) {
      const $T* p = x + n * HW * C + c;
      for (idx_t k = threadIdx.y; k < HW; k += 8) acc += fx_to_f32(p[k * C]);
    }
    part[threadIdx.y][threadIdx.x] = acc;
    __syncthreads();
    if (threadIdx.y == 0 && c < C) {
      float s = 0.f;
#pragma unroll
      for (int j = 0; j < 8; ++j) s += part[j][threadIdx.x];
      y[n * C + c] = fx_from<$T>(s / (float)HW);
    }
    __syncthreads();
  }
}
