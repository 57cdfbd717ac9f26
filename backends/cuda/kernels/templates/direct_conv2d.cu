$prelude
// direct conv ${KH}x$KW, C_in $CI -> C_out $CO (tile $COT per block), stride ($SH, $SW) padding ($PH, $PW)
// dilation ($DH, $DW), layout $layout, weight $weight_layout; epilogue: $epi_desc; then $pool_desc
// One thread per output pixel and tile of output channels; the tile's weights live in shared
// memory (every thread of a warp reads the same weight: a broadcast).$split_desc
extern "C" __global__ void __launch_bounds__($block)
$name(const $T* __restrict__ x, const $T* __restrict__ w$extra_params, $T* __restrict__ y,
      long long N_, long long H_, long long W_, long long CH_, long long CW_, long long OH_, long long OW_) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef $idx idx_t;
  __shared__ float ws[$COT * $CIKK];
  const int co0 = (int)blockIdx.y * $COT;
  for (int i = threadIdx.x; i < $COT * $CIKK; i += blockDim.x) {
    const int j = i / $CIKK, r = i - j * $CIKK;  // r = (ci * KH + kh) * KW + kw
    const int co = co0 + j;
    ws[i] = co < $CO ? fx_to_f32(w[$w_at]) : 0.f;
  }
  const int H = (int)H_, W = (int)W_, CH = (int)CH_, CW = (int)CW_;
  const idx_t OH = (idx_t)OH_, OW = (idx_t)OW_;
  const idx_t total = (idx_t)N_ * OH * OW;
  __syncthreads();
$split_setup
  for (idx_t p = first; p < total; p += step) {
    const int ow = (int)(p % OW);
    idx_t t = p / OW;
    const int oh = (int)(t % OH);
    const idx_t n = t / OH;
$body
#pragma unroll
    for (int j = 0; j < $COT; ++j) {
      const int co = co0 + j;
      if (co < $CO$store_guard) y[$out_at] = fx_from<$T>(best[j]);
    }
  }
}
