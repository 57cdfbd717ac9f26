#define FX_INLINE __device__ __forceinline__
FX_INLINE float fx_to_f32(float x) { return x; }
FX_INLINE void fx_from_f32(float v, float& o) { o = v; }
// Programmatic dependent launch (sm_90+). Every generated kernel calls this first: launched with
// the programmatic-stream-serialization attribute, a kernel may start while the previous kernel of
// the stream is still finishing; the wait holds each thread until that kernel has completed and its
// writes are visible (a no-op for a kernel launched without the attribute). Only then may the next
// kernel launch early, so at most one kernel waits ahead of the running one.
FX_INLINE void fx_pdl_begin() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
