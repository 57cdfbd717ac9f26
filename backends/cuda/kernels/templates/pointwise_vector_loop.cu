  const idx_t nvec = numel / $vec;
  for (idx_t v = tid; v < nvec; v += stride) {
    const idx_t i = v * $vec;
$vector_loads
    fx_vec<$out_t, $vec> o;
#pragma unroll
    for (int k = 0; k < $vec; ++k) o.v[k] = fx_from<$out_t>(${name}_body($vector_args));
    *reinterpret_cast<fx_vec<$out_t, $vec>*>(out + i) = o;
  }
