$prelude
// grouped conv ${KH}x$KW stride ($SH, $SW) padding ($PH, $PW) dilation ($DH, $DW), NHWC, $G groups of
// $CGI -> $CGO channels. Each thread: one output pixel x $COT consecutive output channels of one group
// ($TC threads per pixel, $TP pixels per block), its input read $V channels per load; the block's
// $CT output channels' weights staged in shared memory as ws[(tap * CGI + ci) * CT + channel], read
// in 16-byte pieces. Epilogue: $epi_desc
extern "C" __global__ void __launch_bounds__($block)
$name(const $T* __restrict__ x, const $T* __restrict__ w$extra_params, $T* __restrict__ y) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef $idx idx_t;
  __shared__ __align__(16) float ws[$R * $CT];
  const int co0 = (int)blockIdx.y * $CT;     // the block's first output channel
  const int ci0 = (co0 / $CGO) * $CGI;       // the first input channel of its group
  for (int i = threadIdx.x; i < $R * $CT; i += $block) {
    const int c = i / $R, r = i - c * $R;    // r = tap * CGI + ci: consecutive threads read one channel's row
    const int kk = r / $CGI, ci = r - kk * $CGI;
    (void)kk; (void)ci;
    ws[r * $CT + c] = fx_to_f32(w[$w_at]);
  }
  __syncthreads();
  const int tc = (int)threadIdx.x % $TC, tp = (int)threadIdx.x / $TC;
  const int c1 = tc * $COT;                  // this thread's first channel within the block's tile
  for (idx_t p = (idx_t)blockIdx.x * $TP + tp; p < (idx_t)$PIXELS; p += (idx_t)gridDim.x * $TP) {
    const int ow = (int)(p % $OW);
    const idx_t t1 = p / $OW;
    const int oh = (int)(t1 % $OH);
    const idx_t n = t1 / $OH;
    float sum[$COT];
#pragma unroll
    for (int j = 0; j < $COT; ++j) sum[j] = 0.f;
#pragma unroll
    for (int kh = 0; kh < $KH; ++kh) {
      const int ih = oh * $SH - $PH + kh * $DH;
      if (ih < 0 || ih >= $H) continue;
#pragma unroll
      for (int kw = 0; kw < $KW; ++kw) {
        const int iw = ow * $SW - $PW + kw * $DW;
        if (iw < 0 || iw >= $W) continue;
        const $T* xp = x + ((n * $H + ih) * $W + iw) * $CIN + ci0;
        const float* wr = ws + (kh * $KW + kw) * $CGI * $CT + c1;
#pragma unroll $ci_unroll
        for (int ci = 0; ci < $CGI; ci += $V) {
          const fx_vec<$T, $V> v = *reinterpret_cast<const fx_vec<$T, $V>*>(xp + ci);
#pragma unroll
          for (int e = 0; e < $V; ++e) {
            const float xv = fx_to_f32(v.v[e]);
            const float* wc = wr + (ci + e) * $CT;
$fma
          }
        }
      }
    }
    const idx_t o0 = p * $COUT + co0 + c1;
    fx_vec<$T, $COT> out;
#pragma unroll
    for (int j = 0; j < $COT; ++j) {
      const int c = co0 + c1 + j;
      const idx_t o = o0 + j;
      (void)c; (void)o;
      float acc = sum[j];
$epilogue
      out.v[j] = fx_from<$T>(acc);
    }
    *reinterpret_cast<fx_vec<$T, $COT>*>(y + o0) = out;
  }
}
