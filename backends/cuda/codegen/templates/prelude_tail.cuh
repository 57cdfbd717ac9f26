template <typename T> FX_INLINE T fx_from(float v) { T o; fx_from_f32(v, o); return o; }
// exp and division of the activations (sigmoid, SiLU, hardswish, hardsigmoid, exp): IEEE (expf,
// a / b) unless the kernel's source defines FXOPT_FAST_MATH (option fast_math): the hardware
// approximations then, whose relative error (below 1.3e-5) is under the float32 tolerance and
// a 16-bit result's rounding (docs/NUMERICS.md).
#ifdef FXOPT_FAST_MATH
FX_INLINE float fx_exp(float x) { return __expf(x); }
FX_INLINE float fx_div(float a, float b) { return __fdividef(a, b); }
#else
FX_INLINE float fx_exp(float x) { return expf(x); }
FX_INLINE float fx_div(float a, float b) { return a / b; }
#endif
FX_INLINE float fx_clamp(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }
template <typename T, int N>
struct alignas(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) fx_vec { T v[N]; };
