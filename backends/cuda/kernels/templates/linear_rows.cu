$prelude
// linear, few rows: y = act(x @ w^T (+ bias)), x (M, $K) with M <= $MR, w ($N, $K), y (M, $N)
// epilogue: $epi_desc
// One warp per $NW output features: each lane accumulates a strided slice of K for every row
// ($VEC elements per 16-byte load), then the warp adds its lanes up with shuffles. Every weight is
// read once from memory whatever M is; the rows of x stay in L1/L2.
extern "C" __global__ void __launch_bounds__($block)
$name(const $T* __restrict__ x, const $T* __restrict__ w$extra_params, $T* __restrict__ y, long long M_) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef fx_vec<$T, $VEC> vec_t;
  const int M = (int)M_;
  const int lane = (int)(threadIdx.x & 31);
  const int n0 = ((int)blockIdx.x * ($block / 32) + (int)(threadIdx.x >> 5)) * $NW;
  if (n0 >= $N) return;  // the whole warp leaves: no shuffle below waits for it
  float part[$MR][$NW];
#pragma unroll
  for (int m = 0; m < $MR; ++m)
#pragma unroll
    for (int j = 0; j < $NW; ++j) part[m][j] = 0.f;
  for (int k = lane * $VEC; k < $K; k += 32 * $VEC) {
    vec_t wv[$NW];
#pragma unroll
    for (int j = 0; j < $NW; ++j) {  // a row past N reads row N-1 (never written)
      const int n = n0 + j < $N ? n0 + j : $N - 1;
      wv[j] = *reinterpret_cast<const vec_t*>(w + (long long)n * $K + k);
    }
#pragma unroll
    for (int m = 0; m < $MR; ++m) {
      if (m < M) {
        const vec_t xv = *reinterpret_cast<const vec_t*>(x + (long long)m * $K + k);
#pragma unroll
        for (int j = 0; j < $NW; ++j)
#pragma unroll
          for (int e = 0; e < $VEC; ++e) part[m][j] += fx_to_f32(xv.v[e]) * fx_to_f32(wv[j].v[e]);
      }
    }
  }
#pragma unroll
  for (int m = 0; m < $MR; ++m)
#pragma unroll
    for (int j = 0; j < $NW; ++j) {
      float v = part[m][j];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      part[m][j] = v;
    }
  // lane m * NW + j writes (m, n0 + j)
#pragma unroll
  for (int m = 0; m < $MR; ++m)
#pragma unroll
    for (int j = 0; j < $NW; ++j) {
      const int n = n0 + j;
      if (lane == m * $NW + j && m < M && n < $N) {
        float acc = part[m][j];
$epilogue
        y[(long long)m * $N + n] = fx_from<$T>(acc);
      }
    }
}
