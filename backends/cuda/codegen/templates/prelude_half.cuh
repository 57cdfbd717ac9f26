#ifndef FXOPT_NO_CUDA_HEADERS
#include <cuda_fp16.h>
#include <cuda_bf16.h>
typedef __half fx_half;
typedef __nv_bfloat16 fx_bf16;
FX_INLINE float fx_to_f32(fx_half x) { return __half2float(x); }
FX_INLINE float fx_to_f32(fx_bf16 x) { return __bfloat162float(x); }
FX_INLINE void fx_from_f32(float v, fx_half& o) { o = __float2half_rn(v); }
FX_INLINE void fx_from_f32(float v, fx_bf16& o) { o = __float2bfloat16_rn(v); }
#else
struct __align__(2) fx_half { unsigned short x; };
struct __align__(2) fx_bf16 { unsigned short x; };
FX_INLINE float fx_to_f32(fx_half h) {
  float f; asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h.x)); return f;
}
FX_INLINE float fx_to_f32(fx_bf16 b) { return __uint_as_float(((unsigned int)b.x) << 16); }
FX_INLINE void fx_from_f32(float v, fx_half& o) { asm("cvt.rn.f16.f32 %0, %1;" : "=h"(o.x) : "f"(v)); }
FX_INLINE void fx_from_f32(float v, fx_bf16& o) {
  unsigned int u = __float_as_uint(v);
  if ((u & 0x7fffffffu) > 0x7f800000u) { o.x = (unsigned short)((u >> 16) | 0x40u); return; }
  u += 0x7fffu + ((u >> 16) & 1u);
  o.x = (unsigned short)(u >> 16);
}
#endif
