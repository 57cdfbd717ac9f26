$prelude
// grouped conv ${KH}x$KW stride ($SH, $SW) padding ($PH, $PW) dilation ($DH, $DW), NHWC, $G groups of
// $CGI -> $CGO channels. Each thread: $PPT output pixel(s) x $COT consecutive output channels of one group
// ($TC threads per pixel, $TP threads' pixels per block), its input read $V channels per load; the block's
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
  for (idx_t q = (idx_t)blockIdx.x * $TP + tp; q * $PPT < (idx_t)$PIXELS; q += (idx_t)gridDim.x * $TP) {
    int ow[$PPT], oh[$PPT];
    idx_t n[$PPT];
#pragma unroll
    for (int u = 0; u < $PPT; ++u) {         // the thread's pixels q * PPT + u (the last ones clamped)
      const idx_t p = q * $PPT + u < (idx_t)$PIXELS ? q * $PPT + u : (idx_t)$PIXELS - 1;
      ow[u] = (int)(p % $OW);
      const idx_t t1 = p / $OW;
      oh[u] = (int)(t1 % $OH);
      n[u] = t1 / $OH;
    }
    float sum[$PPT][$COT];
#pragma unroll
    for (int u = 0; u < $PPT; ++u)
#pragma unroll
      for (int j = 0; j < $COT; ++j) sum[u][j] = 0.f;
#pragma unroll
    for (int kh = 0; kh < $KH; ++kh) {
#pragma unroll
      for (int kw = 0; kw < $KW; ++kw) {
        const $T* xp[$PPT];
        bool in[$PPT], any = false;
#pragma unroll
        for (int u = 0; u < $PPT; ++u) {
          const int ih = oh[u] * $SH - $PH + kh * $DH, iw = ow[u] * $SW - $PW + kw * $DW;
          in[u] = ih >= 0 && ih < $H && iw >= 0 && iw < $W;
          any |= in[u];
          xp[u] = x + ((n[u] * $H + (in[u] ? ih : 0)) * $W + (in[u] ? iw : 0)) * $CIN + ci0;
        }
        if (!any) continue;
        const float* wr = ws + (kh * $KW + kw) * $CGI * $CT + c1;
#pragma unroll $ci_unroll
        for (int ci = 0; ci < $CGI; ci += $V) {
          fx_vec<$T, $V> v[$PPT];
#pragma unroll
          for (int u = 0; u < $PPT; ++u) {
            if (in[u]) v[u] = *reinterpret_cast<const fx_vec<$T, $V>*>(xp[u] + ci);
            else {
#pragma unroll
              for (int e = 0; e < $V; ++e) v[u].v[e] = fx_from<$T>(0.f);
            }
          }
#pragma unroll
          for (int e = 0; e < $V; ++e) {
            float xv[$PPT];
#pragma unroll
            for (int u = 0; u < $PPT; ++u) xv[u] = fx_to_f32(v[u].v[e]);
            const float* wc = wr + (ci + e) * $CT;
$fma
          }
        }
      }
    }
#pragma unroll
    for (int u = 0; u < $PPT; ++u) {
      if (q * $PPT + u >= (idx_t)$PIXELS) break;
      const idx_t o0 = (q * $PPT + u) * $COUT + co0 + c1;
      fx_vec<$T, $COT> out;
#pragma unroll
      for (int j = 0; j < $COT; ++j) {
        const int c = co0 + c1 + j;
        const idx_t o = o0 + j;
        (void)c; (void)o;
        float acc = sum[u][j];
$epilogue
        out.v[j] = fx_from<$T>(acc);
      }
      *reinterpret_cast<fx_vec<$T, $COT>*>(y + o0) = out;
    }
  }
}
