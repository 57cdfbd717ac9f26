$prelude
// fused pointwise region '$region': layout $layout, vector width $vec
FX_INLINE float ${name}_body($body_params) {
$body
}

extern "C" __global__ void __launch_bounds__($block)
$name($params, long long numel_, long long C_, long long HW_) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  typedef $idx idx_t;
  const idx_t numel = (idx_t)numel_;
  const idx_t C = (idx_t)C_;
  const idx_t HW = (idx_t)HW_;
  (void)C; (void)HW;
  const idx_t tid = (idx_t)blockIdx.x * blockDim.x + threadIdx.x;
  const idx_t stride = (idx_t)gridDim.x * blockDim.x;

$vector_loop
  for (idx_t i = $tail_start + tid; i < numel; i += stride) {
$scalar_loads
    out[i] = fx_from<$out_t>(${name}_body($scalar_args));
  }
}
