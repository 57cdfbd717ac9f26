$prelude
// depthwise conv ${KH}x$KW stride ($SH, $SW) padding ($PH, $PW) dilation ($DH, $DW), NHWC. Each thread:
// $TW consecutive output pixels of one row x $VEC channels; per kernel row it loads each input column
// of its window once ($COLS loads for $TW pixels) and adds it into every pixel that reads it, the
// row's weights held in registers. The block: $CG channels x $TP thread tiles, its weights
// (C, KH, KW) staged in shared memory as [tap][channel], rows $S floats apart (padded: the staging
// writes of one channel's taps fall in different banks). Epilogue: $epi_desc
extern "C" __global__ void __launch_bounds__($block)
$name(const $T* __restrict__ x, const $T* __restrict__ w$extra_params, $T* __restrict__ y) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef $idx idx_t;
  __shared__ __align__(16) float ws[$KK * $S];
  const int cg0 = (int)blockIdx.y * $CG;
  for (int i = threadIdx.x; i < $KK * $CG; i += $block) {  // read in the weight's order
    const int c = i / $KK, t = i - c * $KK;
    ws[t * $S + c] = fx_to_f32(w[(idx_t)cg0 * $KK + i]);
  }
  __syncthreads();
  const int tc = (int)threadIdx.x % $TC, tp = (int)threadIdx.x / $TC;
  const int c0 = cg0 + tc * $VEC;
  for (idx_t q = (idx_t)blockIdx.x * $TP + tp; q < (idx_t)$TILES; q += (idx_t)gridDim.x * $TP) {
    const int ow0 = (int)(q % $OWT) * $TW;
    const idx_t t1 = q / $OWT;
    const int oh = (int)(t1 % $OH);
    const idx_t n = t1 / $OH;
    const int iw0 = ow0 * $SW - $PW;
    float sum[$TW][$VEC];
#pragma unroll
    for (int u = 0; u < $TW; ++u)
#pragma unroll
      for (int j = 0; j < $VEC; ++j) sum[u][j] = 0.f;
#pragma unroll
    for (int kh = 0; kh < $KH; ++kh) {
      const int ih = oh * $SH - $PH + kh * $DH;
      if (ih < 0 || ih >= $H) continue;
      const $T* xr = x + (n * $H + ih) * (idx_t)$W * $C + c0;
      float wr[$KW][$VEC];
#pragma unroll
      for (int kw = 0; kw < $KW; ++kw) {
        const float* wp = ws + (kh * $KW + kw) * $S + tc * $VEC;
$load_weights
      }
$columns
    }
#pragma unroll
    for (int u = 0; u < $TW; ++u) {
      if (ow0 + u >= $OW) break;
      const idx_t o0 = ((n * $OH + oh) * $OW + ow0 + u) * $C + c0;
      fx_vec<$T, $VEC> out;
#pragma unroll
      for (int j = 0; j < $VEC; ++j) {
        const int c = c0 + j;
        const idx_t o = o0 + j;
        (void)c; (void)o;
        float acc = sum[u][j];
$epilogue
        out.v[j] = fx_from<$T>(acc);
      }
      *reinterpret_cast<fx_vec<$T, $VEC>*>(y + o0) = out;
    }
  }
}
