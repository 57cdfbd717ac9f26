$prelude
// Winograd F(2x2,3x3) output transform Y = A^T m A, layout $layout; M: [16][$m_layout]
// epilogue: $epi_desc
extern "C" __global__ void __launch_bounds__($block)
$name(const $MT* __restrict__ M$extra_params, $T* __restrict__ y, long long N_, long long K_,
      long long OH_, long long OW_, long long TH_, long long TW_) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef $idx idx_t;
  const idx_t K = (idx_t)K_, TH = (idx_t)TH_, TW = (idx_t)TW_;
  const int OH = (int)OH_, OW = (int)OW_;
  const idx_t P = (idx_t)N_ * TH * TW;
  const idx_t total = P * K;
  const idx_t stride = (idx_t)gridDim.x * blockDim.x;
  for (idx_t o = (idx_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += stride) {
$decompose
    const int tw = (int)(p % TW);
    const idx_t t = p / TW;
    const int th = (int)(t % TH);
    const idx_t n = t / TH;
$loads
$transform
$stores
  }
}
