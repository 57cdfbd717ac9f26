$prelude
// Winograd F(2x2,3x3) input transform V = B^T d B, padding $PAD, layout $layout
// V: [16][$v_layout] with P = N * TH * TW tiles (p = (n * TH + th) * TW + tw)
extern "C" __global__ void __launch_bounds__($block)
$name(const $T* __restrict__ x, $VT* __restrict__ V, long long N_, long long C_,
      long long H_, long long W_, long long TH_, long long TW_) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef $idx idx_t;
  const idx_t C = (idx_t)C_, TH = (idx_t)TH_, TW = (idx_t)TW_;
  const int H = (int)H_, W = (int)W_;
  const idx_t P = (idx_t)N_ * TH * TW;
  const idx_t total = P * C;
  const idx_t stride = (idx_t)gridDim.x * blockDim.x;
  for (idx_t o = (idx_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += stride) {
$decompose
    const int tw = (int)(p % TW);
    const idx_t t = p / TW;
    const int th = (int)(t % TH);
    const idx_t n = t / TH;
    const int h0 = th * 2 - $PAD, w0 = tw * 2 - $PAD;
$loads
$transform
  }
}
