$prelude
// $kind pool ${KH}x$KW stride ($SH, $SW) padding ($PH, $PW), layout $layout, pre-activation $act_name
extern "C" __global__ void __launch_bounds__($block)
$name(const $T* __restrict__ x, $T* __restrict__ y, long long N_, long long C_,
      long long H_, long long W_, long long OH_, long long OW_) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef $idx idx_t;
  const idx_t C = (idx_t)C_, OH = (idx_t)OH_, OW = (idx_t)OW_;
  const int H = (int)H_, W = (int)W_;
  const idx_t total = (idx_t)N_ * C * OH * OW;
  const idx_t stride = (idx_t)gridDim.x * blockDim.x;
  for (idx_t o = (idx_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += stride) {
$decompose
    const int hs = oh * $SH - $PH, ws = ow * $SW - $PW;
    float acc = $init;
#pragma unroll
    for (int kh = 0; kh < $KH; ++kh) {
      const int ih = hs + kh;
      if (ih < 0 || ih >= H) continue;
#pragma unroll
      for (int kw = 0; kw < $KW; ++kw) {
        const int iw = ws + kw;
        if (iw < 0 || iw >= W) continue;
        float v = fx_to_f32(x[$in_at]);
$act
        $accumulate
      }
    }
$finish
    y[o] = fx_from<$T>(acc);
  }
}
