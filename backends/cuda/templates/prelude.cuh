#define FX_INLINE __device__ __forceinline__
FX_INLINE float fx_to_f32(float x) { return x; }
FX_INLINE void fx_from_f32(float v, float& o) { o = v; }
