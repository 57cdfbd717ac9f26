  // layer $l: $K -> $N, $epi_desc
  for (int n = warp; n < $N; n += $WARPS) {
    float part[$MR];
#pragma unroll
    for (int m = 0; m < $MR; ++m) part[m] = 0.f;
    for (int k = lane * $VEC; k < $K; k += 32 * $VEC) {
      const fx_vec<$T, $VEC> wv = *reinterpret_cast<const fx_vec<$T, $VEC>*>(w$l + (long long)n * $K + k);
#pragma unroll
      for (int m = 0; m < $MR; ++m) {
        if (m < M) {
$accumulate
        }
      }
    }
#pragma unroll
    for (int m = 0; m < $MR; ++m) {
      float v = part[m];
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
      part[m] = v;
    }
#pragma unroll
    for (int m = 0; m < $MR; ++m) {
      if (lane == m && m < M) {
        float acc = part[m];
$epilogue
$store
      }
    }
  }
  __syncthreads();
