$prelude
// depthwise conv ${KH}x$KW stride ($SH, $SW) padding ($PH, $PW) dilation ($DH, $DW), layout $layout
// weight layout: $weight_layout; epilogue: $epi_desc
extern "C" __global__ void __launch_bounds__($block)
$name(const $T* __restrict__ x, const $T* __restrict__ w$extra_params, $T* __restrict__ y,
      long long N_, long long C_, long long H_, long long W_, long long OH_, long long OW_) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef $idx idx_t;
  const idx_t C = (idx_t)C_, OH = (idx_t)OH_, OW = (idx_t)OW_;
  const int H = (int)H_, W = (int)W_;
  const idx_t total = (idx_t)N_ * C * OH * OW;
  const idx_t stride = (idx_t)gridDim.x * blockDim.x;
  for (idx_t o = (idx_t)blockIdx.x * blockDim.x + threadIdx.x; o < total; o += stride) {
$decompose
    const int hs = oh * $SH - $PH, ws = ow * $SW - $PW;
    float acc = 0.f;
#pragma unroll
    for (int kh = 0; kh < $KH; ++kh) {
      const int ih = hs + kh * $DH;
      if (ih < 0 || ih >= H) continue;
#pragma unroll
      for (int kw = 0; kw < $KW; ++kw) {
        const int iw = ws + kw * $DW;
        if (iw < 0 || iw >= W) continue;
        acc += fx_to_f32(x[$in_at]) * fx_to_f32(w[$w_at]);
      }
    }
$epilogue
    y[o] = fx_from<$T>(acc);
  }
}
