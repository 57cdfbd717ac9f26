template <typename T> FX_INLINE T fx_from(float v) { T o; fx_from_f32(v, o); return o; }
FX_INLINE float fx_clamp(float x, float lo, float hi) { return x < lo ? lo : (x > hi ? hi : x); }
template <typename T, int N>
struct alignas(sizeof(T) * N >= 16 ? 16 : sizeof(T) * N) fx_vec { T v[N]; };
