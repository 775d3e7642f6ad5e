/* The gate's sum: the two ranks' partials added where the bytes already are.
 *
 * A gate ends with both ranks holding the same total. The MLX backend
 * (csrc/mlx/) calls this for the float sums of all_sum and sum_scatter, on
 * the group's stream thread, vectorised where the CPU allows (a scalar
 * float16 loop converts every element in software).
 *
 * Both ranks hold identical bits only if both compute the same expression:
 * `first` is always rank 0's partial, `second` rank 1's, whichever rank this
 * is. float16 and bfloat16 are added in float32 and rounded to nearest-even,
 * as MLX computes a + b for them: a float32 sum of two 16-bit floats rounded
 * once more to 16 bits equals the correctly rounded 16-bit sum (float32 has
 * at least 2p + 2 bits of precision for both, so the double rounding is
 * innocuous), which is what MLX's native half arithmetic gives too. A NaN sum
 * is a NaN whose payload bits are this conversion's (float16: the quiet NaN
 * of its sign; bfloat16: 0x7FC0), which may differ from the payload MLX's
 * own conversion keeps; both ranks still hold the same bits. */

#include <stdint.h>
#include <string.h>

#include "_verbs.h"
#include "_verbs_priv.h"

/* ---- 16-bit floats <-> float32, branch-free so the loops vectorise ---- */

static inline float bits_to_f32(uint32_t w) {
    float f;
    memcpy(&f, &w, sizeof(f));
    return f;
}

static inline uint32_t f32_to_bits(float f) {
    uint32_t w;
    memcpy(&w, &f, sizeof(w));
    return w;
}

/* cond ? a : b without a branch (a branch in the loop stops GCC's vectoriser). */
static inline uint32_t select_u32(int cond, uint32_t a, uint32_t b) {
    const uint32_t mask = (uint32_t)0 - (uint32_t)(cond != 0);
    return (a & mask) | (b & ~mask);
}

/* Exact float16 -> float32 (normals, subnormals, infinities, NaN payloads):
 * the exponent is rebased by a multiply, subnormals by a magic subtraction. */
static inline float f16_to_f32(uint16_t h) {
    const uint32_t w = (uint32_t)h << 16;
    const uint32_t sign = w & 0x80000000u;
    const uint32_t two_w = w + w;
    const uint32_t exp_offset = 0xE0u << 23;
    const float exp_scale = 0x1.0p-112f;
    const float normalized = bits_to_f32((two_w >> 4) + exp_offset) * exp_scale;
    const uint32_t magic_mask = 126u << 23;
    const float magic_bias = 0.5f;
    const float denormalized = bits_to_f32((two_w >> 17) | magic_mask) - magic_bias;
    const uint32_t denormalized_cutoff = 1u << 27;
    const uint32_t result = sign | select_u32(two_w < denormalized_cutoff, f32_to_bits(denormalized),
                                              f32_to_bits(normalized));
    return bits_to_f32(result);
}

/* float32 -> float16, round to nearest-even; overflow to infinity; a NaN
 * becomes the quiet NaN 0x7E00 with its sign (MLX's conversion on CPUs
 * without half-precision hardware, and what hardware gives for a NaN made by
 * an addition). */
static inline uint16_t f32_to_f16(float f) {
    const float scale_to_inf = 0x1.0p+112f;
    const float scale_to_zero = 0x1.0p-110f;
    const uint32_t w = f32_to_bits(f);
    float base = (bits_to_f32(w & 0x7FFFFFFFu) * scale_to_inf) * scale_to_zero;
    const uint32_t shl1_w = w + w;
    const uint32_t sign = w & 0x80000000u;
    uint32_t bias = shl1_w & 0xFF000000u;
    bias = select_u32(bias < 0x71000000u, 0x71000000u, bias);
    base = bits_to_f32((bias >> 1) + 0x07800000u) + base;
    const uint32_t bits = f32_to_bits(base);
    const uint32_t exp_bits = (bits >> 13) & 0x00007C00u;
    const uint32_t mantissa_bits = bits & 0x00000FFFu;
    const uint32_t nonsign = exp_bits + mantissa_bits;
    return (uint16_t)((sign >> 16) | select_u32(shl1_w > 0xFF000000u, 0x7E00u, nonsign));
}

/* float32 -> bfloat16, round to nearest-even; a NaN becomes 0x7FC0 (MLX's
 * bfloat16 conversion). */
static inline uint16_t f32_to_bf16(float f) {
    const uint32_t w = f32_to_bits(f);
    const uint32_t rounded = (w + 0x7FFFu + ((w >> 16) & 1u)) >> 16;
    /* NaN: exponent all ones and a non-zero fraction. */
    return (uint16_t)select_u32((w & 0x7FFFFFFFu) > 0x7F800000u, 0x7FC0u, rounded);
}

/* ---- the sums ---- */

/* GCC vectorises at -O2 only loops that need no run-time checks; these need
 * the trip count's remainder handled, so they ask for -O3's vectoriser
 * (clang vectorises them at -O2 already). */
#if defined(__GNUC__) && !defined(__clang__)
#define TP_VECTORISE __attribute__((optimize("O3")))
#else
#define TP_VECTORISE
#endif

/* The loops, written once and compiled per instruction set below (a build may
 * leave one of them unused). */
#if defined(__GNUC__)
#define TP_MAYBE_UNUSED __attribute__((unused))
#else
#define TP_MAYBE_UNUSED
#endif
#define TP_SUM_LOOPS(suffix, attrs)                                                            \
    attrs TP_MAYBE_UNUSED static void sum_f32##suffix(const float *restrict a, const float *restrict b,         \
                                      float *restrict o, uint64_t n) {                          \
        for (uint64_t i = 0; i < n; i++) o[i] = a[i] + b[i];                                    \
    }                                                                                           \
    attrs TP_MAYBE_UNUSED static void sum_f16##suffix(const uint16_t *restrict a, const uint16_t *restrict b,   \
                                      uint16_t *restrict o, uint64_t n) {                       \
        for (uint64_t i = 0; i < n; i++) o[i] = f32_to_f16(f16_to_f32(a[i]) + f16_to_f32(b[i])); \
    }                                                                                           \
    attrs TP_MAYBE_UNUSED static void sum_bf16##suffix(const uint16_t *restrict a, const uint16_t *restrict b,  \
                                       uint16_t *restrict o, uint64_t n) {                      \
        for (uint64_t i = 0; i < n; i++)                                                        \
            o[i] = f32_to_bf16(bits_to_f32((uint32_t)a[i] << 16) +                              \
                               bits_to_f32((uint32_t)b[i] << 16));                              \
    }

TP_SUM_LOOPS(_base, TP_VECTORISE)

typedef void (*sum_fn)(const void *, const void *, void *, uint64_t);
static sum_fn sum_f32_fn = (sum_fn)sum_f32_base;
static sum_fn sum_f16_fn = (sum_fn)sum_f16_base;
static sum_fn sum_bf16_fn = (sum_fn)sum_bf16_base;

#if (defined(__x86_64__) || defined(__i386__)) && defined(__GNUC__)
/* x86: the build targets the baseline (SSE2, 4 floats a step), where the
 * 16-bit conversions above cost ~1-2 ns an item: 8-18 us for one 16 KiB gate,
 * as much as the exchange. Where the CPU has AVX2 the same loops run 8 wide,
 * and with F16C float16 converts in hardware (vcvtph2ps / vcvtps2ph, round to
 * nearest-even, as MLX's float16 add). Chosen once at run time, so one build
 * runs on any x86-64; both ranks are the same machine model, so they pick the
 * same code and hold the same bits. */
#include <cpuid.h>
#include <immintrin.h>

#define TP_AVX2 __attribute__((target("avx2,f16c"))) TP_VECTORISE
TP_SUM_LOOPS(_avx2, TP_AVX2)

TP_AVX2 static void sum_f16_f16c(const uint16_t *restrict a, const uint16_t *restrict b,
                                 uint16_t *restrict o, uint64_t n) {
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256 fa = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(a + i)));
        const __m256 fb = _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)(b + i)));
        _mm_storeu_si128((__m128i *)(o + i),
                         _mm256_cvtps_ph(_mm256_add_ps(fa, fb), _MM_FROUND_TO_NEAREST_INT));
    }
    /* The tail goes through the same hardware conversion, one lane used, so
     * a NaN's bits do not depend on where in the array it sits. */
    for (; i < n; i++) {
        const __m128 fa = _mm_cvtph_ps(_mm_cvtsi32_si128(a[i]));
        const __m128 fb = _mm_cvtph_ps(_mm_cvtsi32_si128(b[i]));
        o[i] = (uint16_t)_mm_extract_epi16(_mm_cvtps_ph(_mm_add_ps(fa, fb), _MM_FROUND_TO_NEAREST_INT), 0);
    }
}

TP_AVX2 static void sum_bf16_avx2x(const uint16_t *restrict a, const uint16_t *restrict b,
                                   uint16_t *restrict o, uint64_t n) {
    /* f32_to_bf16 eight at a time: round to nearest-even by adding 0x7FFF plus
     * the kept part's lowest bit, a NaN becomes 0x7FC0. */
    const __m256i one = _mm256_set1_epi32(1), half = _mm256_set1_epi32(0x7FFF);
    const __m256i abs_mask = _mm256_set1_epi32(0x7FFFFFFF), inf = _mm256_set1_epi32(0x7F800000);
    const __m256i qnan = _mm256_set1_epi32(0x7FC0);
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8) {
        const __m256i wa = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(a + i))), 16);
        const __m256i wb = _mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)(b + i))), 16);
        const __m256i w = _mm256_castps_si256(_mm256_add_ps(_mm256_castsi256_ps(wa), _mm256_castsi256_ps(wb)));
        const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(w, 16), one);
        __m256i r = _mm256_srli_epi32(_mm256_add_epi32(_mm256_add_epi32(w, half), lsb), 16);
        const __m256i nan = _mm256_cmpgt_epi32(_mm256_and_si256(w, abs_mask), inf);
        r = _mm256_blendv_epi8(r, qnan, nan);
        /* 8 x 32-bit (each < 65536) to 8 x 16-bit: pack the two 128-bit halves. */
        const __m128i packed = _mm_packus_epi32(_mm256_castsi256_si128(r), _mm256_extracti128_si256(r, 1));
        _mm_storeu_si128((__m128i *)(o + i), packed);
    }
    sum_bf16_base(a + i, b + i, o + i, n - i);
}

static void pick_sums(void) {
    static int picked;
    if (picked) return;
    __builtin_cpu_init();
    /* F16C is CPUID leaf 1, ECX bit 29: asked directly, since clang before 15
     * does not know "f16c" as a __builtin_cpu_supports name. */
    unsigned int eax, ebx, ecx, edx;
    const int f16c = __get_cpuid(1, &eax, &ebx, &ecx, &edx) && (ecx & (1u << 29));
    if (__builtin_cpu_supports("avx2") && f16c) {
        sum_f16_fn = (sum_fn)sum_f16_f16c;
        sum_bf16_fn = (sum_fn)sum_bf16_avx2x;
    }
    picked = 1;
}
#else
static void pick_sums(void) {}
#endif

int tp_sum2(int dtype, const void *first, const void *second, void *out, uint64_t count) {
    pick_sums();
    if (dtype == TP_DTYPE_FLOAT32) sum_f32_fn(first, second, out, count);
    else if (dtype == TP_DTYPE_FLOAT16) sum_f16_fn(first, second, out, count);
    else if (dtype == TP_DTYPE_BFLOAT16) sum_bf16_fn(first, second, out, count);
    else return TP_EINVAL;
    return TP_OK;
}
