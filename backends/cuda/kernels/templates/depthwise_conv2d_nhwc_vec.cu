$prelude
// depthwise conv ${KH}x$KW stride ($SH, $SW) padding ($PH, $PW) dilation ($DH, $DW), NHWC, $VEC channels
// per thread (one vector load per tap), $CG channels x $TP output pixels per block, the block's
// weights (C, KH, KW) staged in shared memory as [tap][channel]; epilogue: $epi_desc
extern "C" __global__ void __launch_bounds__($block)
$name(const $T* __restrict__ x, const $T* __restrict__ w$extra_params, $T* __restrict__ y) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef $idx idx_t;
  __shared__ float ws[$KK][$CG];
  const int cg0 = blockIdx.y * $CG;
  for (int i = threadIdx.x; i < $KK * $CG; i += $block) {
    const int t = i / $CG, c = cg0 + i % $CG;
    ws[t][i % $CG] = c < $C ? fx_to_f32(w[(idx_t)c * $KK + t]) : 0.f;
  }
  __syncthreads();
  const int tc = threadIdx.x % $TC, tp = threadIdx.x / $TC;
  const int c0 = cg0 + tc * $VEC;
  if (c0 >= $C) return;
  for (idx_t p = (idx_t)blockIdx.x * $TP + tp; p < (idx_t)$PIXELS; p += (idx_t)gridDim.x * $TP) {
    const int ow = (int)(p % $OW);
    const idx_t t1 = p / $OW;
    const int oh = (int)(t1 % $OH);
    const idx_t n = t1 / $OH;
    float accv[$VEC];
#pragma unroll
    for (int j = 0; j < $VEC; ++j) accv[j] = 0.f;
#pragma unroll
    for (int kh = 0; kh < $KH; ++kh) {
      const int ih = oh * $SH - $PH + kh * $DH;
      if (ih < 0 || ih >= $H) continue;
#pragma unroll
      for (int kw = 0; kw < $KW; ++kw) {
        const int iw = ow * $SW - $PW + kw * $DW;
        if (iw < 0 || iw >= $W) continue;
        const fx_vec<$T, $VEC> v = *reinterpret_cast<const fx_vec<$T, $VEC>*>(
            x + ((n * $H + ih) * $W + iw) * $C + c0);
#pragma unroll
        for (int j = 0; j < $VEC; ++j) accv[j] += fx_to_f32(v.v[j]) * ws[kh * $KW + kw][tc * $VEC + j];
      }
    }
    const idx_t o0 = p * $C + c0;
    fx_vec<$T, $VEC> out;
#pragma unroll
    for (int j = 0; j < $VEC; ++j) {
      const int c = c0 + j;
      const idx_t o = o0 + j;
      (void)c; (void)o;
      float acc = accv[j];
$epilogue
      out.v[j] = fx_from<$T>(acc);
    }
    *reinterpret_cast<fx_vec<$T, $VEC>*>(y + o0) = out;
  }
}
