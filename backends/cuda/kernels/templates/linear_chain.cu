$prelude
// $L linear layers over few rows in ONE thread block: y = L$last(...L0(x)), Li = act_i(h @ w_i^T (+ b_i)),
// x (M, $K0) with M <= $MR, y (M, $NLAST). Layers: $desc
// One warp per output feature (the warps stride over N), each lane a strided slice of K (16-byte
// weight loads), lanes summed with shuffles, epilogue before the store. Between layers the
// activations stay in shared memory (rounded to the layer's dtype, as separate layers store them),
// and __syncthreads() orders the layers: no launch between them.
extern "C" __global__ void __launch_bounds__($block)
$name(const $T* __restrict__ x$params, $T* __restrict__ y, long long M_) {
  fx_pdl_begin();  // before any memory access: see prelude.cuh
  __shared__ float act_[2][$MR * $NMAX];
  const int M = (int)M_;
  const int lane = (int)(threadIdx.x & 31);
  const int warp = (int)(threadIdx.x >> 5);
$layers
}
