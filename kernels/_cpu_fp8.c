/* Fused FP8 (e4m3fn) amax and quantize for contiguous CPU tensors: the CPU fast path of the torch kernel; and the
 * W8A16 linear (linear_fp8, near the end) that multiplies by an FP8 weight without dequantizing it whole.
 *
 * Bit-exact with kernels/reference.py (the definition): amax = max |w| per group, read off the bits (a NaN
 * anywhere gives a NaN amax, an Inf an Inf); q = e4m3fn(clamp(float32(w) / scale, -448, 448)) with IEEE
 * float32 division and round-half-to-even, the float32 -> e4m3fn conversion being c10's
 * fp8e4m3fn_from_fp32_value (the one torch's own .to(torch.float8_e4m3fn) runs on CPU) rewritten without
 * branches, so the compiler vectorizes it.
 *
 * Why it exists: torch's CPU cast to float8 is a scalar loop (about 0.55 ns per element on one thread here),
 * and the reference needs four passes (widen, divide, clamp, cast). This is one pass that reads the
 * 16-bit weight and writes the byte: ~20x faster than the reference on an 8192 x 4096 BF16 weight; and where
 * the scale comes from the weight's own amax and the CPU has AVX-512 VBMI, a table lookup per 64 elements
 * (quantize_span_bf16_lut) halves that again, so that quantizing is bound by memory, not arithmetic.
 *
 * Inputs: bfloat16 (dtype code 0) or float32 (code 1), row-major [n_rows, k]. Granularity codes: 0 per
 * tensor (one scale), 1 per channel (one scale per row), 2 per 128 x 128 block (scales [ceil(n/128),
 * ceil(k/128)] row-major). Work is split over n_threads OpenMP threads by rows (per tensor: by elements);
 * the GIL is released meanwhile. Pointers are passed as integers (torch's data_ptr()); the Python side
 * (kernels/cpu_native.py) checks devices, dtypes, contiguity and shapes.
 */
#define PY_SSIZE_T_CLEAN
#include <Python.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define BLOCK 128
#define MAX_THREADS 256

#if defined(__x86_64__) && defined(__GNUC__) && !defined(__clang__)
#define MULTIVERSION __attribute__((target_clones("arch=x86-64-v4", "arch=x86-64-v3", "default")))
#else
#define MULTIVERSION
#endif

static inline float f32_from_bits(uint32_t b) {
    float f;
    memcpy(&f, &b, 4);
    return f;
}

static inline uint32_t bits_from_f32(float f) {
    uint32_t b;
    memcpy(&b, &f, 4);
    return b;
}

/* e4m3fn(q) for |q| < 464 (finite): c10's fp8e4m3fn_from_fp32_value without its overflow branch. Below 2^-6 the
 * subnormal grid (2^-9 steps) is reached by adding 2^14 in float32, whose rounding is round-half-to-even; above,
 * the mantissa is rounded to 3 bits half-to-even. Every value in [448, 464) rounds to 448 (0x7E). */
static inline uint8_t e4m3fn_in_range(float q) {
    uint32_t b = bits_from_f32(q);
    uint32_t sign = b & 0x80000000u;
    uint32_t a = b ^ sign;
    uint32_t sub = bits_from_f32(f32_from_bits(a) + 16384.0f) - (141u << 23);
    uint32_t nrm = (a + ((uint32_t)(7 - 127) << 23) + 0x7FFFFu + ((a >> 20) & 1u)) >> 20;
    uint32_t r = a < (121u << 23) ? sub : nrm;
    return (uint8_t)(r | (sign >> 24));
}

/* e4m3fn(clamp(q, -448, 448)) for any q: |q| >= 448 gives 448 (0x7E), NaN gives 0x7F (with q's sign). */
static inline uint8_t e4m3fn_clamped(float q) {
    uint32_t b = bits_from_f32(q);
    uint32_t a = b & 0x7FFFFFFFu, sign = (b >> 24) & 0x80u;
    uint32_t r = e4m3fn_in_range(q);
    r = a >= 0x43E00000u ? sign | 0x7Eu : r; /* 448.0f and up, Inf included */
    r = a > 0x7F800000u ? sign | 0x7Fu : r;  /* NaN */
    return (uint8_t)r;
}

static inline float widen_bf16(uint16_t h) { return f32_from_bits((uint32_t)h << 16); }

/* One row: n elements, scale[j / cols_per_scale] for element j. Two versions each: the clamped conversion, and
 * the in-range one (about 1.7x faster here) for a scale from the weight's own amax, where |w / scale| < 464. */
#define QUANTIZE_ROW(NAME, T, WIDEN, CONVERT)                                                                   \
    MULTIVERSION static void NAME(const T *src, uint8_t *dst, int64_t n, const float *scale, int64_t per) {     \
        for (int64_t c0 = 0, s = 0; c0 < n; c0 += per, s++) {                                                  \
            const int64_t c1 = c0 + per < n ? c0 + per : n;                                                    \
            const float d = scale[s];                                                                          \
            for (int64_t j = c0; j < c1; j++) dst[j] = CONVERT(WIDEN(src[j]) / d);                             \
        }                                                                                                      \
    }
#define AS_IS(x) (x)
QUANTIZE_ROW(quantize_row_bf16, uint16_t, widen_bf16, e4m3fn_clamped)
QUANTIZE_ROW(quantize_row_bf16_in_range, uint16_t, widen_bf16, e4m3fn_in_range)
QUANTIZE_ROW(quantize_row_f32, float, AS_IS, e4m3fn_clamped)
QUANTIZE_ROW(quantize_row_f32_in_range, float, AS_IS, e4m3fn_in_range)

/* The in-range bfloat16 conversion as a table lookup (x86-64 with AVX-512 VBMI: Zen 4, Ice Lake and later).
 *
 * For one scale d, e4m3fn(float32(w) / d) of a bfloat16 w = 2^(E-127) * (1 + m/128) depends on the 7-bit mantissa m
 * and on E only through a shift: where the quotient is a normal e4m3 number (>= 2^-6), doubling w doubles the
 * correctly rounded float32 quotient and adds 8 to the e4m3 code (one binade). So code = T[m] + 8 * E (mod 256)
 * with a 128-byte table T computed once per scale by the exact conversion at a reference exponent E0, and the
 * AVX-512 VBMI byte permutes look it up 64 elements at a time: about a quarter of the arithmetic of the
 * division and the conversion, which bound the exact path's speed here (0.19 ns per element on one thread).
 * Elements below the table's range (|w| < 2^(E_ok-127), zeros and subnormals included: rare for a scale from
 * the weight's own amax, about 1 in 3000 normal-distributed weights) make their 64-element vector take the exact
 * path. Every code comes from the exact conversion: tests/test_kernels_cpu_native.py compares with torch's cast
 * every bfloat16 the table covers, for scales from float32's smallest normal to its largest. */
typedef struct {
    uint8_t t[128];   /* T[m] - 8 * E0 (mod 256) */
    uint16_t min_abs; /* |w| bits (sign cleared) from which the table holds: E_ok << 7 */
    int ok;           /* 0: d is not a normal float (no table; the exact path runs) */
} Lut;

static void lut_build(float d, Lut *lut) {
    const uint32_t db = bits_from_f32(d);
    const int ed = (int)((db >> 23) & 0xFF) - 127;
    /* a normal positive d below 2^127: E0 (below) is then a finite bfloat16 exponent, at most 254 */
    lut->ok = (db >> 23 & 0xFF) != 0 && ed < 127 && !(db >> 31);
    if (!lut->ok) return;
    /* E0 = 128 + ed puts q(E0, m) = 2^(E0-127) (1 + m/128) / d in (1, 4): normal e4m3, far below 448. Every E >=
     * E0 - 6 gives q > 2^-6 (q(E, 0) = 2^(E-E0) q(E0, 0) with q(E0, 0) > 1); E >= 1 keeps w a normal float. */
    const int e0 = 128 + ed, e_ok = e0 - 6 > 1 ? e0 - 6 : 1;
    uint16_t w[128];
    for (int m = 0; m < 128; m++) w[m] = (uint16_t)((e0 << 7) | m);
    quantize_row_bf16_in_range(w, lut->t, 128, &d, 128);
    for (int m = 0; m < 128; m++) lut->t[m] = (uint8_t)(lut->t[m] - 8 * e0);
    lut->min_abs = (uint16_t)(e_ok << 7);
}

#if defined(__x86_64__) && defined(__GNUC__)
#include <immintrin.h>
#define LUT_TARGET __attribute__((target("avx512f,avx512bw,avx512vbmi")))

static int lut_supported(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
                 __builtin_cpu_supports("avx512vbmi");
    }
    return cached;
}

typedef struct {
    __m512i idx_lo, idx_hi, abs_mask, bit3, high4, sign;
} LutConsts;

LUT_TARGET static inline LutConsts lut_consts(void) {
    static const uint8_t even[64] = {0,  2,  4,  6,  8,  10, 12, 14, 16, 18, 20, 22, 24, 26, 28, 30,
                                     32, 34, 36, 38, 40, 42, 44, 46, 48, 50, 52, 54, 56, 58, 60, 62,
                                     64, 66, 68, 70, 72, 74, 76, 78, 80, 82, 84, 86, 88, 90, 92, 94,
                                     96, 98, 100, 102, 104, 106, 108, 110, 112, 114, 116, 118, 120, 122, 124, 126};
    LutConsts c;
    c.idx_lo = _mm512_loadu_si512(even);
    c.idx_hi = _mm512_add_epi8(c.idx_lo, _mm512_set1_epi8(1));
    c.abs_mask = _mm512_set1_epi16(0x7FFF);
    c.bit3 = _mm512_set1_epi8(0x08);
    c.high4 = _mm512_set1_epi8((char)0xF0);
    c.sign = _mm512_set1_epi8((char)0x80);
    return c;
}

/* n elements (n > 0) with one table; the elements the table does not cover, and a tail of under 64, exactly.
 * Inlined into its callers, which set up the constants once for many spans. */
LUT_TARGET static inline __attribute__((always_inline)) void lut_span(const LutConsts *c, const uint16_t *src,
                                                                      uint8_t *dst, int64_t n, const Lut *lut, float d) {
    const __m512i t0 = _mm512_loadu_si512(lut->t), t1 = _mm512_loadu_si512(lut->t + 64);
    const __m512i min_abs = _mm512_set1_epi16((short)lut->min_abs);
    int64_t j = 0;
    for (; j + 64 <= n; j += 64) {
        const __m512i a = _mm512_loadu_si512(src + j), b = _mm512_loadu_si512(src + j + 32);
        const __mmask64 covered = (__mmask64)_mm512_cmpge_epu16_mask(_mm512_and_si512(a, c->abs_mask), min_abs) |
                                  ((__mmask64)_mm512_cmpge_epu16_mask(_mm512_and_si512(b, c->abs_mask), min_abs) << 32);
        if (covered != ~(__mmask64)0) {
            quantize_row_bf16_in_range(src + j, dst + j, 64, &d, 64);
            continue;
        }
        const __m512i lo = _mm512_permutex2var_epi8(a, c->idx_lo, b); /* low bytes: E's lowest bit, m */
        const __m512i hi = _mm512_permutex2var_epi8(a, c->idx_hi, b); /* high bytes: sign, E's upper 7 bits */
        const __m512i t = _mm512_permutex2var_epi8(t0, lo, t1);      /* T[m]: the permute reads 7 index bits */
        /* 8 * E mod 256 = (E mod 32) << 3: E bit 0 is lo bit 7 (-> bit 3), E bits 1-4 are hi bits 0-3 (-> 4-7) */
        const __m512i e8 = _mm512_or_si512(_mm512_and_si512(_mm512_srli_epi16(lo, 4), c->bit3),
                                           _mm512_and_si512(_mm512_slli_epi16(hi, 4), c->high4));
        const __m512i code = _mm512_or_si512(_mm512_add_epi8(t, e8), _mm512_and_si512(hi, c->sign));
        _mm512_storeu_si512(dst + j, code);
    }
    if (j < n) quantize_row_bf16_in_range(src + j, dst + j, n - j, &d, n - j);
}

/* n elements with one table. */
LUT_TARGET static void quantize_span_bf16_lut(const uint16_t *src, uint8_t *dst, int64_t n, const Lut *lut, float d) {
    const LutConsts c = lut_consts();
    lut_span(&c, src, dst, n, lut, d);
}

/* A row of n elements, `per` per table: luts[s] for elements [s * per, (s + 1) * per) (per block: one table per
 * 128 columns, each serving 128 rows), the constants set up once per row; a span whose table is not ok exactly. */
LUT_TARGET static void quantize_row_bf16_luts(const uint16_t *src, uint8_t *dst, int64_t n, const float *scale,
                                              int64_t per, const Lut *luts) {
    const LutConsts c = lut_consts();
    for (int64_t c0 = 0, s = 0; c0 < n; c0 += per, s++) {
        const int64_t len = c0 + per < n ? per : n - c0;
        if (luts[s].ok)
            lut_span(&c, src + c0, dst + c0, len, &luts[s], scale[s]);
        else
            quantize_row_bf16_in_range(src + c0, dst + c0, len, scale + s, len);
    }
}
#else
static int lut_supported(void) { return 0; }
static void quantize_span_bf16_lut(const uint16_t *src, uint8_t *dst, int64_t n, const Lut *lut, float d) {
    (void)lut;
    quantize_row_bf16_in_range(src, dst, n, &d, n);
}
static void quantize_row_bf16_luts(const uint16_t *src, uint8_t *dst, int64_t n, const float *scale, int64_t per,
                                   const Lut *luts) {
    (void)luts;
    quantize_row_bf16_in_range(src, dst, n, scale, per);
}
#endif

/* Elements below which a span's own table costs more than it saves (building one is an exact conversion of 128
 * values): measured on one thread here, per channel, rows of 512 break even; rows of 32 took 5.7x as long. */
#define LUT_MIN_SPAN 512

/* quantize_row_bf16_in_range through tables: `luts` one per scale (built by the caller: per block, where one table
 * serves 128 rows), or NULL to build each here (per tensor and per channel: one per `per` elements, for spans of
 * at least LUT_MIN_SPAN). */
static void quantize_row_bf16_lut(const uint16_t *src, uint8_t *dst, int64_t n, const float *scale, int64_t per,
                                  const Lut *luts) {
    if (luts) {
        quantize_row_bf16_luts(src, dst, n, scale, per, luts);
        return;
    }
    for (int64_t c0 = 0, s = 0; c0 < n; c0 += per, s++) {
        const int64_t len = c0 + per < n ? per : n - c0;
        Lut own = {.ok = 0};
        if (len >= LUT_MIN_SPAN) lut_build(scale[s], &own);
        if (own.ok)
            quantize_span_bf16_lut(src + c0, dst + c0, len, &own, scale[s]);
        else
            quantize_row_bf16_in_range(src + c0, dst + c0, len, scale + s, len);
    }
}

/* max |x| bits of a span (absmax_bits_*) and the per-128-column-block running max of one row (absmax_blocks_*:
 * m[cb] = max(m[cb], that of the row's block cb)), per 16-bit or 32-bit float, as 32-bit float bits: the bit
 * patterns of non-negative floats order as the values do, and every NaN pattern sorts above Inf, so the result
 * read back as a float is the amax (NaN if any element is NaN). (A running max per column, reduced once per block
 * row instead of once per row and block, measured 1.7x slower here: it loads and stores the maxima per element.) */
#define ABSMAX(SUFFIX, T, MASK, SHIFT)                                                                          \
    MULTIVERSION static uint32_t absmax_bits_##SUFFIX(const T *src, int64_t n) {                              \
        T m = 0;                                                                                               \
        for (int64_t j = 0; j < n; j++) {                                                                      \
            T a = src[j] & MASK;                                                                               \
            m = a > m ? a : m;                                                                                 \
        }                                                                                                      \
        return (uint32_t)m << SHIFT;                                                                           \
    }                                                                                                          \
    MULTIVERSION static void absmax_blocks_##SUFFIX(const T *src, int64_t k, uint32_t *m) {                   \
        for (int64_t c0 = 0, cb = 0; c0 < k; c0 += BLOCK, cb++) {                                              \
            const int64_t c1 = c0 + BLOCK < k ? c0 + BLOCK : k;                                                \
            T v = 0;                                                                                           \
            for (int64_t j = c0; j < c1; j++) {                                                                \
                T a = src[j] & MASK;                                                                           \
                v = a > v ? a : v;                                                                             \
            }                                                                                                  \
            const uint32_t bits = (uint32_t)v << SHIFT;                                                        \
            m[cb] = bits > m[cb] ? bits : m[cb];                                                               \
        }                                                                                                      \
    }
ABSMAX(bf16, uint16_t, 0x7FFFu, 16)
ABSMAX(f32, uint32_t, 0x7FFFFFFFu, 0)

typedef struct {
    const char *src;
    uint8_t *dst;     /* quantize only */
    float *out;       /* scales (quantize: read) or amaxes (amax: written) */
    int dtype;        /* 0 bf16, 1 f32 */
    int granularity;  /* 0 tensor, 1 channel, 2 block */
    int64_t n_rows, k;
    int64_t lo, hi;   /* this worker's range: elements (per tensor) or rows (per channel, per block row-blocks) */
    uint32_t result;  /* per tensor amax bits of [lo, hi) */
    int failed;       /* out of memory */
    int64_t non_finite; /* scale_quantize: rows of [lo, hi) whose amax is NaN or Inf */
    int in_range;     /* quantize: the caller guarantees finite |w / scale| < 464 (a scale from w's own amax) */
} Work;

static size_t elem_size(int dtype) { return dtype == 0 ? 2 : 4; }

/* kernels/reference.py's scale_from_amax of one amax: amax / 448 (IEEE float32 division), never below float32's
 * smallest normal, 1.0 where amax == 0; NaN or Inf (amaxes are never negative) returned as it is, *bad set. */
static inline float scale_of(float amax, int *bad) {
    if (!(amax <= 3.40282347e38f)) {
        *bad = 1;
        return amax;
    }
    float s = amax / 448.0f;
    s = s < 1.17549435e-38f ? 1.17549435e-38f : s;
    return amax > 0.0f ? s : 1.0f;
}

static uint32_t absmax_span(int dtype, const char *p, int64_t n) {
    return dtype == 0 ? absmax_bits_bf16((const uint16_t *)p, n) : absmax_bits_f32((const uint32_t *)p, n);
}

/* m[cb] = max |x| bits of block column cb of `rows` rows of w->k elements from src (m: one entry per block). */
static void absmax_block_row(const Work *w, const char *src, int64_t rows, uint32_t *m) {
    const int64_t k = w->k, kb = (k + BLOCK - 1) / BLOCK;
    memset(m, 0, kb * sizeof(uint32_t));
    for (int64_t r = 0; r < rows; r++) {
        if (w->dtype == 0)
            absmax_blocks_bf16((const uint16_t *)src + r * k, k, m);
        else
            absmax_blocks_f32((const uint32_t *)src + r * k, k, m);
    }
}

/* One row (or span) of n elements, scale[j / per] for element j; `luts`: that row's tables (per block), or NULL. */
static void quantize_row(const Work *w, const char *p, uint8_t *dst, int64_t n, const float *scale, int64_t per,
                         const Lut *luts) {
    if (w->dtype == 0 && w->in_range && lut_supported())
        quantize_row_bf16_lut((const uint16_t *)p, dst, n, scale, per, luts);
    else if (w->dtype == 0 && w->in_range)
        quantize_row_bf16_in_range((const uint16_t *)p, dst, n, scale, per);
    else if (w->dtype == 0)
        quantize_row_bf16((const uint16_t *)p, dst, n, scale, per);
    else if (w->in_range)
        quantize_row_f32_in_range((const float *)p, dst, n, scale, per);
    else
        quantize_row_f32((const float *)p, dst, n, scale, per);
}

static void amax_worker(Work *w) {
    const size_t es = elem_size(w->dtype);
    const int64_t k = w->k;
    if (w->granularity == 0) {
        w->result = absmax_span(w->dtype, w->src + w->lo * es, w->hi - w->lo);
    } else if (w->granularity == 1) {
        for (int64_t r = w->lo; r < w->hi; r++) {
            uint32_t m = absmax_span(w->dtype, w->src + r * k * es, k);
            w->out[r] = f32_from_bits(m);
        }
    } else { /* lo, hi count row blocks */
        const int64_t kb = (k + BLOCK - 1) / BLOCK;
        uint32_t *m = malloc((kb > 0 ? kb : 1) * sizeof(uint32_t)); /* maxima of one block row, as bits */
        if (!m) {
            w->failed = 1;
            return;
        }
        for (int64_t rb = w->lo; rb < w->hi; rb++) {
            const int64_t r0 = rb * BLOCK, r1 = r0 + BLOCK < w->n_rows ? r0 + BLOCK : w->n_rows;
            absmax_block_row(w, w->src + r0 * k * es, r1 - r0, m);
            for (int64_t cb = 0; cb < kb; cb++) w->out[rb * kb + cb] = f32_from_bits(m[cb]);
        }
        free(m);
    }
}

/* Rows [r0, r1) of a per-block weight whose row 0 is `src`/`dst` and whose first row is row `row0` of the
 * weight (scales: the weight's [ceil(n/128), kb]): each block row's tables built once for its rows. */
static void quantize_block_rows(Work *w, const char *src, uint8_t *dst, int64_t r0, int64_t r1, int64_t row0) {
    const size_t es = elem_size(w->dtype);
    const int64_t k = w->k, kb = (k + BLOCK - 1) / BLOCK;
    Lut *luts = w->dtype == 0 && w->in_range && lut_supported() ? malloc(kb * sizeof(Lut)) : NULL;
    int64_t built = -1; /* the block row whose tables `luts` holds */
    for (int64_t r = r0; r < r1; r++) {
        const int64_t rb = (row0 + r) / BLOCK;
        const float *scale = w->out + rb * kb;
        if (luts && rb != built) {
            for (int64_t cb = 0; cb < kb; cb++) lut_build(scale[cb], &luts[cb]);
            built = rb;
        }
        quantize_row(w, src + r * k * es, dst + r * k, k, scale, BLOCK, luts); /* luts NULL: built per block */
    }
    free(luts);
}

static void quantize_worker(Work *w) {
    const size_t es = elem_size(w->dtype);
    const int64_t k = w->k;
    if (w->granularity == 0) {
        quantize_row(w, w->src + w->lo * es, w->dst + w->lo, w->hi - w->lo, w->out, w->hi - w->lo, NULL);
    } else if (w->granularity == 1) {
        for (int64_t r = w->lo; r < w->hi; r++)
            quantize_row(w, w->src + r * k * es, w->dst + r * k, k, w->out + r, k, NULL);
    } else {
        quantize_block_rows(w, w->src, w->dst, w->lo, w->hi, 0);
    }
}

/* Per channel (lo, hi: rows): each row's amax, its scale into w->out[r], then the row quantized with it while it is
 * still in cache (a row is a few KB to a few tens of KB), so the weight is read from memory once instead of twice. A
 * row whose amax is NaN or Inf keeps that amax as its "scale", is counted in w->non_finite and is not quantized.
 * (Per block the same fusion, a 128-row block row at a time, measured no faster than amax then quantize here.) */
static void scale_quantize_worker(Work *w) {
    const size_t es = elem_size(w->dtype);
    const int64_t k = w->k;
    for (int64_t r = w->lo; r < w->hi; r++) {
        const char *row = w->src + r * k * es;
        int bad = 0;
        w->out[r] = scale_of(f32_from_bits(absmax_span(w->dtype, row, k)), &bad);
        if (bad)
            w->non_finite++;
        else
            quantize_row(w, row, w->dst + r * k, k, w->out + r, k, NULL);
    }
}

/* Split [0, total) into n_threads ranges (aligned to `align`) and run fn on each. The threads are OpenMP's:
 * linked against libgomp.so.1, the extension binds to the libgomp torch already loaded (same soname), so
 * the work runs on torch's own intra-op threads. Threads of our own would compete with those, which spin
 * for a while after each torch op: measured here, a second pthread then gained nothing. */
static int run_split(void (*fn)(Work *), Work *base, int64_t total, int64_t align, int n_threads, Work *works) {
    int64_t units = (total + align - 1) / align;
    if (n_threads > units) n_threads = (int)(units > 0 ? units : 1);
    for (int t = 0; t < n_threads; t++) {
        works[t] = *base;
        works[t].lo = units * t / n_threads * align;
        works[t].hi = units * (t + 1) / n_threads * align;
        if (works[t].hi > total) works[t].hi = total;
        works[t].result = 0;
        works[t].failed = 0;
        works[t].non_finite = 0;
    }
#pragma omp parallel for num_threads(n_threads) schedule(static, 1)
    for (int t = 0; t < n_threads; t++) fn(&works[t]);
    for (int t = 0; t < n_threads; t++)
        if (works[t].failed) return -1;
    return n_threads;
}

static int parse(PyObject *args, Work *w, int *n_threads, int with_dst) {
    unsigned long long src, dst = 0, out;
    long long n_rows, k;
    int ok;
    w->in_range = 0;
    if (with_dst)
        ok = PyArg_ParseTuple(args, "KiiLLKKi|p", &src, &w->dtype, &w->granularity, &n_rows, &k, &out, &dst, n_threads,
                              &w->in_range);
    else
        ok = PyArg_ParseTuple(args, "KiiLLKi", &src, &w->dtype, &w->granularity, &n_rows, &k, &out, n_threads);
    if (!ok) return 0;
    if (w->dtype < 0 || w->dtype > 1 || w->granularity < 0 || w->granularity > 2 || n_rows < 0 || k < 0) {
        PyErr_SetString(PyExc_ValueError, "bad dtype code, granularity code or shape");
        return 0;
    }
    w->src = (const char *)(uintptr_t)src;
    w->dst = (uint8_t *)(uintptr_t)dst;
    w->out = (float *)(uintptr_t)out;
    w->n_rows = n_rows;
    w->k = k;
    if (*n_threads < 1) *n_threads = 1;
    if (*n_threads > MAX_THREADS) *n_threads = MAX_THREADS;
    return 1;
}

/* work units below which one thread does everything: thread start-up costs about as much as 256K elements */
static int threads_for(int64_t numel, int n_threads) {
    int64_t most = numel / (1 << 18);
    return most < 1 ? 1 : (most < n_threads ? (int)most : n_threads);
}

static PyObject *py_amax(PyObject *self, PyObject *args) {
    Work w, works[MAX_THREADS];
    int n_threads;
    (void)self;
    if (!parse(args, &w, &n_threads, 0)) return NULL;
    const int64_t numel = w.n_rows * w.k;
    n_threads = threads_for(numel, n_threads);
    int used = 0;
    Py_BEGIN_ALLOW_THREADS
    if (w.granularity == 0) {
        used = run_split(amax_worker, &w, numel, 4096, n_threads, works);
        uint32_t m = 0;
        for (int t = 0; t < used; t++) m = works[t].result > m ? works[t].result : m;
        w.out[0] = f32_from_bits(m);
    } else if (w.granularity == 1) {
        run_split(amax_worker, &w, w.n_rows, 1, n_threads, works);
    } else {
        used = run_split(amax_worker, &w, (w.n_rows + BLOCK - 1) / BLOCK, 1, n_threads, works);
    }
    Py_END_ALLOW_THREADS
    if (used < 0) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_quantize(PyObject *self, PyObject *args) {
    Work w, works[MAX_THREADS];
    int n_threads;
    (void)self;
    if (!parse(args, &w, &n_threads, 1)) return NULL;
    const int64_t numel = w.n_rows * w.k;
    n_threads = threads_for(numel, n_threads);
    Py_BEGIN_ALLOW_THREADS
    if (w.granularity == 0)
        run_split(quantize_worker, &w, numel, 4096, n_threads, works);
    else
        run_split(quantize_worker, &w, w.n_rows, 1, n_threads, works);
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* scale_quantize(src, dtype, granularity, n_rows, k, scales, dst, n_threads) -> how many rows hold NaN or Inf:
 * amax, scale and quantize of a per-channel (granularity 1) weight in one pass over its memory, scales written into
 * float32 `scales`, bytes into `dst`. Bit-exact with amax, then scale_from_amax, then quantize with in_range. Rows
 * are written as they are done, so on a non-zero return `dst` and `scales` hold a partial result: only for an
 * output nothing else reads yet (a first load's fresh tensor). */
static PyObject *py_scale_quantize(PyObject *self, PyObject *args) {
    Work w, works[MAX_THREADS];
    int n_threads;
    (void)self;
    if (!parse(args, &w, &n_threads, 1)) return NULL;
    if (w.granularity != 1) {
        PyErr_SetString(PyExc_ValueError, "scale_quantize: per channel (granularity 1) only");
        return NULL;
    }
    w.in_range = 1; /* every scale comes from its row's own amax */
    n_threads = threads_for(w.n_rows * w.k, n_threads);
    int used;
    int64_t non_finite = 0;
    Py_BEGIN_ALLOW_THREADS
    used = run_split(scale_quantize_worker, &w, w.n_rows, 1, n_threads, works);
    for (int t = 0; t < used; t++) non_finite += works[t].non_finite;
    Py_END_ALLOW_THREADS
    if (used < 0) return PyErr_NoMemory();
    return PyLong_FromLongLong(non_finite);
}

/* dst[j] = src[j] over a span, returning max |src| as float bits (the finiteness check of a copy, in its pass). */
#define COPY_ABSMAX(SUFFIX, T, MASK, SHIFT)                                                                     \
    MULTIVERSION static uint32_t copy_absmax_##SUFFIX(const T *src, T *dst, int64_t n) {                      \
        T m = 0;                                                                                               \
        for (int64_t j = 0; j < n; j++) {                                                                      \
            const T v = src[j];                                                                                \
            dst[j] = v;                                                                                        \
            const T a = v & MASK;                                                                              \
            m = a > m ? a : m;                                                                                 \
        }                                                                                                      \
        return (uint32_t)m << SHIFT;                                                                           \
    }
COPY_ABSMAX(bf16, uint16_t, 0x7FFFu, 16)
COPY_ABSMAX(f32, uint32_t, 0x7FFFFFFFu, 0)

static void copy_worker(Work *w) {
    const size_t es = elem_size(w->dtype);
    const char *src = w->src + w->lo * es;
    char *dst = (char *)w->dst + w->lo * es;
    w->result = w->dtype == 0 ? copy_absmax_bf16((const uint16_t *)src, (uint16_t *)dst, w->hi - w->lo)
                              : copy_absmax_f32((const uint32_t *)src, (uint32_t *)dst, w->hi - w->lo);
}

/* copy_amax(src, dst, numel, dtype, n_threads) -> max |src| as a float (NaN if any element is NaN): a copy of a
 * contiguous bfloat16 or float32 tensor into another of the same dtype that also checks it, in one pass. */
static PyObject *py_copy_amax(PyObject *self, PyObject *args) {
    unsigned long long src, dst;
    long long numel;
    int dtype, n_threads;
    Work w, works[MAX_THREADS];
    (void)self;
    if (!PyArg_ParseTuple(args, "KKLii", &src, &dst, &numel, &dtype, &n_threads)) return NULL;
    if (dtype < 0 || dtype > 1 || numel < 0) {
        PyErr_SetString(PyExc_ValueError, "bad dtype code or element count");
        return NULL;
    }
    memset(&w, 0, sizeof w);
    w.src = (const char *)(uintptr_t)src;
    w.dst = (uint8_t *)(uintptr_t)dst;
    w.dtype = dtype;
    n_threads = threads_for(numel, n_threads < 1 ? 1 : (n_threads > MAX_THREADS ? MAX_THREADS : n_threads));
    uint32_t m = 0;
    Py_BEGIN_ALLOW_THREADS
    const int used = run_split(copy_worker, &w, numel, 4096, n_threads, works);
    for (int t = 0; t < used; t++) m = works[t].result > m ? works[t].result : m;
    Py_END_ALLOW_THREADS
    return PyFloat_FromDouble((double)f32_from_bits(m));
}

/* A batch of pieces (the verbatim loads of several weights of one shape, e.g. every expert of an MoE layer):
 * `table` is int64 [n_pieces, 5] = (src pointer, dst pointer, numel, scale base, row0). All pieces share dtype,
 * granularity and k. `scale base` is the flat index of the piece's weight's first scale in the batch's float32
 * array (one scale per tensor, one per row per channel, ceil(k/128) per 128-row block row per block); per channel
 * and per block a piece is whole rows starting at row `row0` of its weight, and per block it may start or end
 * inside a block row (an expert's gate and up rows sharing one), whose scales then take the max of both pieces.
 * Pieces run in parallel, one thread each (dynamic schedule): each is one expert's gate, up or down, too small
 * to split well, and the batch is many of them. */
#define PIECE_COLUMNS 5

static void piece_work(const int64_t *row, int dtype, int granularity, int64_t k, float *scales, Work *w) {
    w->src = (const char *)(uintptr_t)row[0];
    w->dst = (uint8_t *)(uintptr_t)row[1];
    w->dtype = dtype;
    w->granularity = granularity;
    w->k = granularity == 0 ? row[2] : k;
    w->n_rows = granularity == 0 ? 1 : row[2] / k;
    w->out = scales + row[3] + (granularity == 1 ? row[4] : 0);
    w->lo = 0;
    w->hi = granularity == 0 ? row[2] : w->n_rows;
    w->result = 0;
    w->failed = 0;
    w->in_range = 0;
}

/* *p = max(*p, v) on float bits (non-negative floats order as their bits, NaN above Inf), atomically: two pieces
 * of one weight may share a scale (per tensor always, per block where a block row spans both). */
static void atomic_max_bits(float *p, uint32_t v) {
    uint32_t *q = (uint32_t *)p;
    uint32_t cur = __atomic_load_n(q, __ATOMIC_RELAXED);
    while (v > cur && !__atomic_compare_exchange_n(q, &cur, v, 1, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
    }
}

/* Per-block amax of a piece whose first row is row0 of its weight, merged into the weight's scales (w->out). */
static void amax_piece_blocks(Work *w, int64_t row0) {
    const size_t es = elem_size(w->dtype);
    const int64_t k = w->k, kb = (k + BLOCK - 1) / BLOCK;
    uint32_t *m = malloc((kb > 0 ? kb : 1) * sizeof(uint32_t));
    if (!m) {
        w->failed = 1;
        return;
    }
    for (int64_t r = 0; r < w->n_rows;) {
        const int64_t block_row = (row0 + r) / BLOCK;
        int64_t end = (block_row + 1) * BLOCK - row0;
        end = end < w->n_rows ? end : w->n_rows;
        absmax_block_row(w, w->src + r * k * es, end - r, m);
        r = end;
        for (int64_t cb = 0; cb < kb; cb++) atomic_max_bits(w->out + block_row * kb + cb, m[cb]);
    }
    free(m);
}

static int parse_batch(PyObject *args, const int64_t **table, long long *n, int *dtype, int *granularity,
                       long long *k, float **scales, int *n_threads, int *in_range, int with_range) {
    unsigned long long table_ptr, scales_ptr;
    *in_range = 0;
    int ok = with_range ? PyArg_ParseTuple(args, "KLiiLKi|p", &table_ptr, n, dtype, granularity, k, &scales_ptr,
                                           n_threads, in_range)
                        : PyArg_ParseTuple(args, "KLiiLKi", &table_ptr, n, dtype, granularity, k, &scales_ptr,
                                           n_threads);
    if (!ok) return 0;
    if (*dtype < 0 || *dtype > 1 || *granularity < 0 || *granularity > 2 || *n < 0 || *k < 1) {
        PyErr_SetString(PyExc_ValueError, "bad dtype code, granularity code, piece count or k");
        return 0;
    }
    *table = (const int64_t *)(uintptr_t)table_ptr;
    *scales = (float *)(uintptr_t)scales_ptr;
    int64_t numel = 0;
    for (long long i = 0; i < *n; i++) numel += (*table)[PIECE_COLUMNS * i + 2];
    *n_threads = threads_for(numel, *n_threads < 1 ? 1 : (*n_threads > MAX_THREADS ? MAX_THREADS : *n_threads));
    if (*n_threads > *n) *n_threads = (int)(*n > 0 ? *n : 1);
    return 1;
}

/* amax of every piece merged into its weight's scales (the caller zeroes the array first). */
static PyObject *py_amax_pieces(PyObject *self, PyObject *args) {
    const int64_t *table;
    long long n, k;
    int dtype, granularity, n_threads, in_range, failed = 0;
    float *scales;
    (void)self;
    if (!parse_batch(args, &table, &n, &dtype, &granularity, &k, &scales, &n_threads, &in_range, 0)) return NULL;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(n_threads) schedule(dynamic, 1) reduction(| : failed)
    for (long long i = 0; i < n; i++) {
        const int64_t *row = table + PIECE_COLUMNS * i;
        Work w;
        piece_work(row, dtype, granularity, k, scales, &w);
        if (granularity == 0) {
            amax_worker(&w);
            atomic_max_bits(w.out, w.result);
        } else if (granularity == 1) {
            amax_worker(&w);
        } else {
            amax_piece_blocks(&w, row[4]);
        }
        failed |= w.failed;
    }
    Py_END_ALLOW_THREADS
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

/* e4m3fn bytes of every piece into its dst, with its weight's scales. */
static PyObject *py_quantize_pieces(PyObject *self, PyObject *args) {
    const int64_t *table;
    long long n, k;
    int dtype, granularity, n_threads, in_range;
    float *scales;
    (void)self;
    if (!parse_batch(args, &table, &n, &dtype, &granularity, &k, &scales, &n_threads, &in_range, 1)) return NULL;
    Py_BEGIN_ALLOW_THREADS
#pragma omp parallel for num_threads(n_threads) schedule(dynamic, 1)
    for (long long i = 0; i < n; i++) {
        const int64_t *row = table + PIECE_COLUMNS * i;
        Work w;
        piece_work(row, dtype, granularity, k, scales, &w);
        w.in_range = in_range;
        if (granularity < 2)
            quantize_worker(&w);
        else /* row r of the piece is row row0 + r of the weight, in block row (row0 + r) / 128 */
            quantize_block_rows(&w, w.src, w.dst, 0, w.n_rows, row[4]);
    }
    Py_END_ALLOW_THREADS
    Py_RETURN_NONE;
}

/* amax -> scale in place, as kernels/reference.py's scale_from_amax: amax / 448 (IEEE float32 division), never
 * below float32's smallest normal, 1.0 where amax == 0. Returns how many entries were NaN or Inf (left as
 * they were); the caller raises if any. */
static PyObject *py_scale_from_amax(PyObject *self, PyObject *args) {
    unsigned long long ptr;
    long long count;
    (void)self;
    if (!PyArg_ParseTuple(args, "KL", &ptr, &count)) return NULL;
    float *a = (float *)(uintptr_t)ptr;
    long long non_finite = 0;
    for (long long i = 0; i < count; i++) {
        int bad = 0;
        a[i] = scale_of(a[i], &bad);
        non_finite += bad;
    }
    return PyLong_FromLongLong(non_finite);
}

/* ---- FP8 W8A16 linear: y[m, n] = sum_k x[m, k] * (float32(w[n, k]) * scale) + bias[n] ----
 *
 * The CPU forward of an FP8 linear without a dequantized copy of the weight. x (bfloat16, float16 or float32, rows
 * x_stride elements apart) is widened to float32 once per call (rows of kp = k rounded up to 8, zero padded; float32
 * rows of a multiple of 8 are read in place). Output features are split over the OpenMP threads; each thread
 * dequantizes its weight rows a tile at a time into float32 ([nb, kp], zero padded, cache-resident: about half an L2,
 * or half an L1 where x is one micro-tile of rows and the tile is read once) and runs a register-blocked micro-kernel
 * over it: GEMM_MR rows of x by GEMM_NR rows of the tile, 8 float32 lanes along k (lane l sums k = l mod 8) per
 * pair, FMA, the lanes added at the end. So every FP8 byte is read once per call and no whole float32 or bfloat16
 * weight exists. A tile element is float32(w) * scale rounded once, as kernels/reference.py's dequantize computes it
 * before its cast; y is the float32 sum plus the bias, rounded once to x's dtype (nearest even). Each y element is
 * the same sequence of operations whatever m, its row's place among them and the thread count: a row's output does
 * not depend on what it is batched with.
 *
 * e4m3fn -> float32: the byte b as float16 bits ((b & 0x80) << 8) | ((b & 0x7F) << 7) is exactly b's value / 2^8
 * (the 4-bit exponent lands in the low bits of float16's 5-bit one; e4m3 subnormals become float16 subnormals,
 * which F16C converts exactly), so F16C converts 8 at a time and one multiply by 2^8 * scale gives float32(w) *
 * scale with one rounding (2^8 * scale is exact while finite). The portable path, and the AVX2 one for NaN bytes
 * (0x7F, 0xFF), read a 256-entry table. Scale layouts: 0 one per tensor, 1 one per row, 2 one per 128 x 128
 * block ([ceil(n/128), ceil(k/128)]).
 * Dtype codes of x, y and the bias: 0 bfloat16, 1 float32, 2 float16. */
#define GEMM_MR 4                    /* rows of x per micro-tile */
#define GEMM_NR 3                    /* rows of the weight (output features) per micro-tile: 12 accumulators */
#define GEMM_TILE_BYTES (192 * 1024) /* a thread's dequantized tile: about half an L2 */
#define GEMM_SMALL_TILE_BYTES (16 * 1024) /* ... where it is read once (at most GEMM_MR rows of x): half an L1 */

static float e4m3_value[256]; /* float32 of every e4m3fn byte (filled at import) */

static void e4m3_table_init(void) {
    for (int b = 0; b < 256; b++) {
        const uint32_t sign = (uint32_t)(b & 0x80) << 24;
        const int e = (b >> 3) & 0xF, m = b & 7;
        if (e == 15 && m == 7)
            e4m3_value[b] = f32_from_bits(sign | 0x7FC00000u);
        else if (e == 0) /* subnormal: m * 2^-9 */
            e4m3_value[b] = f32_from_bits(sign | bits_from_f32((float)m * (1.0f / 512.0f)));
        else
            e4m3_value[b] = f32_from_bits(sign | (uint32_t)(e - 7 + 127) << 23 | (uint32_t)m << 20);
    }
}

static inline float f32_from_f16(uint16_t h) {
    const uint32_t sign = (uint32_t)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1F) return f32_from_bits(sign | 0x7F800000u | m << 13);
    if (e == 0) return f32_from_bits(sign | bits_from_f32((float)m * (1.0f / 16777216.0f))); /* m * 2^-24 */
    return f32_from_bits(sign | (e + 112) << 23 | m << 13);
}

/* float32 -> float16, round to nearest even; overflow to Inf, NaN stays NaN (quiet). */
static inline uint16_t f16_from_f32(float f) {
    const uint32_t b = bits_from_f32(f), a = b & 0x7FFFFFFFu;
    const uint16_t sign = (uint16_t)((b >> 16) & 0x8000u);
    if (a > 0x7F800000u) return sign | 0x7E00u | (uint16_t)((a >> 13) & 0x3FFu);
    if (a >= 0x477FF000u) return sign | 0x7C00u; /* 65520 and up round to Inf */
    if (a < 0x38800000u) { /* below 2^-14: a subnormal half, |f| * 2^24 rounded to an integer (2^23 trick) */
        const float v = f32_from_bits(a) * 16777216.0f;
        return sign | (uint16_t)(bits_from_f32(v + 8388608.0f) - 0x4B000000u);
    }
    const uint32_t r = a - ((uint32_t)(127 - 15) << 23);
    return sign | (uint16_t)((r + 0xFFFu + ((r >> 13) & 1u)) >> 13);
}

/* float32 -> bfloat16 as torch rounds it: nearest even, NaN -> 0x7FC0. */
static inline uint16_t bf16_from_f32(float f) {
    const uint32_t b = bits_from_f32(f);
    if ((b & 0x7FFFFFFFu) > 0x7F800000u) return 0x7FC0u;
    return (uint16_t)((b + 0x7FFFu + ((b >> 16) & 1u)) >> 16);
}

static inline float load_as_f32(const char *p, int64_t i, int dtype) {
    if (dtype == 0) return widen_bf16(((const uint16_t *)p)[i]);
    if (dtype == 2) return f32_from_f16(((const uint16_t *)p)[i]);
    return ((const float *)p)[i];
}

static inline void store_from_f32(char *p, int64_t i, int dtype, float v) {
    if (dtype == 0)
        ((uint16_t *)p)[i] = bf16_from_f32(v);
    else if (dtype == 2)
        ((uint16_t *)p)[i] = f16_from_f32(v);
    else
        ((float *)p)[i] = v;
}

typedef struct {
    const uint8_t *w;   /* [n, k] e4m3fn */
    const float *scale; /* 1, [n] or [ceil(n/128), ceil(k/128)] */
    int granularity;    /* 0 tensor, 1 channel, 2 block */
    const char *x;      /* [m, k], rows x_stride elements apart */
    int64_t x_stride;
    int dtype;          /* of x and y */
    const char *bias;   /* [n] or NULL */
    int bias_dtype;
    char *y;            /* [m, n], contiguous */
    int64_t m, n, k;
    const float *xf;    /* x as float32, rows ldx apart, zero padded from k to kp */
    int64_t ldx;
    int64_t kp;         /* k rounded up to a multiple of 8: the micro-kernel's length */
    int64_t ldw;        /* the tile's row stride: kp, 16 more where kp * 4 bytes is a multiple of 4 KiB */
    int64_t nb;         /* weight rows per tile, a multiple of GEMM_NR */
    int vector;         /* the AVX2 / FMA / F16C path */
} Gemm;

/* dst[j] = float32(src[j]) * scale[j / per] over a row of k, portably. */
static void dequantize_row_portable(const uint8_t *src, float *dst, int64_t k, const float *scale, int64_t per) {
    for (int64_t c0 = 0, s = 0; c0 < k; c0 += per, s++) {
        const int64_t c1 = c0 + per < k ? c0 + per : k;
        for (int64_t j = c0; j < c1; j++) dst[j] = e4m3_value[src[j]] * scale[s];
    }
}

/* The micro-kernel, portably: out[i * GEMM_NR + j] = sum over [0, kp) of x row i times tile row j, mr x nr of them,
 * in 8 lanes (k mod 8) reduced at the end, so the compiler vectorizes it. */
static inline void tile_portable(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t kp, int mr, int nr,
                                 float *out) {
    float acc[GEMM_MR][GEMM_NR][8];
    memset(acc, 0, sizeof acc);
    for (int64_t k = 0; k < kp; k += 8)
        for (int i = 0; i < mr; i++)
            for (int j = 0; j < nr; j++)
                for (int l = 0; l < 8; l++) acc[i][j][l] += x[i * ldx + k + l] * w[j * ldw + k + l];
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) {
            const float *a = acc[i][j];
            out[i * GEMM_NR + j] = ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]));
        }
}

static void tile_portable_full(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t kp, float *out) {
    tile_portable(x, ldx, w, ldw, kp, GEMM_MR, GEMM_NR, out);
}

#if defined(__x86_64__) && defined(__GNUC__)
#define GEMM_TARGET __attribute__((target("avx2,fma,f16c")))

static int gemm_vector_supported(void) {
    static int cached = -1;
    if (cached < 0) {
        __builtin_cpu_init();
        cached = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma") && __builtin_cpu_supports("f16c");
    }
    return cached;
}

/* 16-bit lanes t = b << 8 (the byte in the high half) -> the float16 bits of b / 2^8 for a finite e4m3 b: the sign
 * stays in bit 15 and the arithmetic shift moves exponent and mantissa down one bit (its copy of the sign in bit 14
 * is cleared). */
GEMM_TARGET static inline __m256i f16_bits_of_e4m3(__m256i t) {
    return _mm256_and_si256(_mm256_srai_epi16(t, 1), _mm256_set1_epi16((short)0xBF80));
}

/* dst[j] = float32(src[j]) * s, 32 bytes at a time through float16 (see above); 32 bytes holding a NaN (|b| = 0x7F,
 * rare: never from our quantize), a tail of under 32, and a scale whose 2^8 multiple is not finite from the table,
 * whose product is the same. Inlined into the row loop: a per-block row is spans of 128. */
GEMM_TARGET static inline __attribute__((always_inline)) void dequantize_span_avx2(const uint8_t *src, float *dst,
                                                                                   int64_t len, float s) {
    const float s256 = s * 256.0f;
    int64_t j = 0;
    if (s256 - s256 == 0.0f) {
        const __m256 vs = _mm256_set1_ps(s256);
        const __m256i zero = _mm256_setzero_si256(), ones = _mm256_set1_epi8(-1);
        const __m256i sign = _mm256_set1_epi8((char)0x80);
        for (; j + 32 <= len; j += 32) {
            const __m256i b = _mm256_loadu_si256((const __m256i *)(src + j));
            if (_mm256_movemask_epi8(_mm256_cmpeq_epi8(_mm256_or_si256(b, sign), ones))) {
                for (int64_t i = j; i < j + 32; i++) dst[i] = e4m3_value[src[i]] * s;
                continue;
            }
            /* in-lane unpacks: lo holds bytes 0-7 and 16-23, hi bytes 8-15 and 24-31 */
            const __m256i lo = f16_bits_of_e4m3(_mm256_unpacklo_epi8(zero, b));
            const __m256i hi = f16_bits_of_e4m3(_mm256_unpackhi_epi8(zero, b));
            _mm256_storeu_ps(dst + j, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(lo)), vs));
            _mm256_storeu_ps(dst + j + 8, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_castsi256_si128(hi)), vs));
            _mm256_storeu_ps(dst + j + 16, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(lo, 1)), vs));
            _mm256_storeu_ps(dst + j + 24, _mm256_mul_ps(_mm256_cvtph_ps(_mm256_extracti128_si256(hi, 1)), vs));
        }
    }
    for (; j < len; j++) dst[j] = e4m3_value[src[j]] * s;
}

/* A row of k bytes, scale[j / per] for element j. */
GEMM_TARGET static void dequantize_row_avx2(const uint8_t *src, float *dst, int64_t k, const float *scale,
                                            int64_t per) {
    for (int64_t c0 = 0, s = 0; c0 < k; c0 += per, s++)
        dequantize_span_avx2(src + c0, dst + c0, c0 + per < k ? per : k - c0, scale[s]);
}

GEMM_TARGET static inline float hsum_avx2(__m256 v) {
    __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
    s = _mm_add_ps(s, _mm_movehl_ps(s, s));
    return _mm_cvtss_f32(_mm_add_ss(s, _mm_movehdup_ps(s)));
}

/* The micro-kernel: mr x nr accumulators of 8 lanes along k (12 ymm registers for 4 x 3), FMA. Inlined with
 * constant mr and nr, so the loops unroll and the accumulators stay in registers. */
GEMM_TARGET static inline __attribute__((always_inline)) void tile_avx2(const float *x, int64_t ldx, const float *w,
                                                                        int64_t ldw, int64_t kp, const int mr,
                                                                        const int nr, float *out) {
    __m256 acc[GEMM_MR][GEMM_NR];
    for (int i = 0; i < GEMM_MR; i++)
        for (int j = 0; j < GEMM_NR; j++) acc[i][j] = _mm256_setzero_ps();
    for (int64_t k = 0; k < kp; k += 8) {
        __m256 wv[GEMM_NR];
        for (int j = 0; j < nr; j++) wv[j] = _mm256_loadu_ps(w + j * ldw + k);
        for (int i = 0; i < mr; i++) {
            const __m256 xv = _mm256_loadu_ps(x + i * ldx + k);
            for (int j = 0; j < nr; j++) acc[i][j] = _mm256_fmadd_ps(xv, wv[j], acc[i][j]);
        }
    }
    for (int i = 0; i < mr; i++)
        for (int j = 0; j < nr; j++) out[i * GEMM_NR + j] = hsum_avx2(acc[i][j]);
}

GEMM_TARGET static void tile_avx2_any(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t kp, int mr,
                                      int nr, float *out) {
#define TILE_CASE(MR_, NR_) \
    case MR_ * 4 + NR_:     \
        tile_avx2(x, ldx, w, ldw, kp, MR_, NR_, out); \
        return;
    switch (mr * 4 + nr) {
        TILE_CASE(4, 3) TILE_CASE(4, 2) TILE_CASE(4, 1)
        TILE_CASE(3, 3) TILE_CASE(3, 2) TILE_CASE(3, 1)
        TILE_CASE(2, 3) TILE_CASE(2, 2) TILE_CASE(2, 1)
        TILE_CASE(1, 3) TILE_CASE(1, 2) TILE_CASE(1, 1)
    }
#undef TILE_CASE
}

/* one row of x widened to float32 (ld elements, zero padded), 8 at a time */
GEMM_TARGET static void widen_row_avx2(const char *src, int dtype, float *dst, int64_t k, int64_t ld) {
    int64_t j = 0;
    if (dtype == 0)
        for (; j + 8 <= k; j += 8) {
            const __m256i h = _mm256_cvtepu16_epi32(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + j)));
            _mm256_storeu_ps(dst + j, _mm256_castsi256_ps(_mm256_slli_epi32(h, 16)));
        }
    else if (dtype == 2)
        for (; j + 8 <= k; j += 8)
            _mm256_storeu_ps(dst + j, _mm256_cvtph_ps(_mm_loadu_si128((const __m128i *)((const uint16_t *)src + j))));
    for (; j < k; j++) dst[j] = load_as_f32(src, j, dtype);
    for (; j < ld; j++) dst[j] = 0.0f;
}
#else
static int gemm_vector_supported(void) { return 0; }
static void dequantize_row_avx2(const uint8_t *src, float *dst, int64_t k, const float *scale, int64_t per) {
    dequantize_row_portable(src, dst, k, scale, per);
}
static void tile_avx2_any(const float *x, int64_t ldx, const float *w, int64_t ldw, int64_t kp, int mr, int nr,
                          float *out) {
    tile_portable(x, ldx, w, ldw, kp, mr, nr, out);
}
static void widen_row_avx2(const char *src, int dtype, float *dst, int64_t k, int64_t ld) {
    int64_t j = 0;
    for (; j < k; j++) dst[j] = load_as_f32(src, j, dtype);
    for (; j < ld; j++) dst[j] = 0.0f;
}
#endif

/* row r of x widened into dst (ldx elements, zero padded) */
static void widen_row(const Gemm *g, int64_t r, float *dst) {
    const char *src = g->x + r * g->x_stride * (g->dtype == 1 ? 4 : 2);
    if (g->vector) {
        widen_row_avx2(src, g->dtype, dst, g->k, g->ldx);
        return;
    }
    int64_t j = 0;
    for (; j < g->k; j++) dst[j] = load_as_f32(src, j, g->dtype);
    for (; j < g->ldx; j++) dst[j] = 0.0f;
}

/* Weight rows [r0, r1) dequantized into tile [r1 - r0, ldw], zero padded from k to kp. */
static void dequantize_rows(const Gemm *g, int64_t r0, int64_t r1, float *tile) {
    const int64_t k = g->k, kb = (k + BLOCK - 1) / BLOCK;
    for (int64_t r = r0; r < r1; r++) {
        const uint8_t *src = g->w + r * k;
        float *dst = tile + (r - r0) * g->ldw;
        const int64_t per = g->granularity == 2 ? BLOCK : k;
        const float *scale = g->granularity == 0 ? g->scale : g->granularity == 1 ? g->scale + r
                                                                                   : g->scale + r / BLOCK * kb;
        if (g->vector)
            dequantize_row_avx2(src, dst, k, scale, per);
        else
            dequantize_row_portable(src, dst, k, scale, per);
        for (int64_t j = k; j < g->kp; j++) dst[j] = 0.0f;
    }
}

/* Output features [lo, hi) of every row of x, one tile of weight rows at a time. Returns 0 when out of memory. */
static int gemm_worker(const Gemm *g, int64_t lo, int64_t hi) {
    float *tile = NULL;
    if (posix_memalign((void **)&tile, 64, (size_t)(g->nb * g->ldw) * sizeof(float))) return 0;
    float out[GEMM_MR * GEMM_NR];
    for (int64_t t0 = lo; t0 < hi; t0 += g->nb) {
        const int64_t t1 = t0 + g->nb < hi ? t0 + g->nb : hi;
        dequantize_rows(g, t0, t1, tile);
        for (int64_t m0 = 0; m0 < g->m; m0 += GEMM_MR) {
            const int mr = g->m - m0 < GEMM_MR ? (int)(g->m - m0) : GEMM_MR;
            const float *x = g->xf + m0 * g->ldx;
            for (int64_t n0 = t0; n0 < t1; n0 += GEMM_NR) {
                const int nr = t1 - n0 < GEMM_NR ? (int)(t1 - n0) : GEMM_NR;
                const float *w = tile + (n0 - t0) * g->ldw;
                if (g->vector)
                    tile_avx2_any(x, g->ldx, w, g->ldw, g->kp, mr, nr, out);
                else if (mr == GEMM_MR && nr == GEMM_NR)
                    tile_portable_full(x, g->ldx, w, g->ldw, g->kp, out);
                else
                    tile_portable(x, g->ldx, w, g->ldw, g->kp, mr, nr, out);
                for (int i = 0; i < mr; i++)
                    for (int j = 0; j < nr; j++) {
                        float v = out[i * GEMM_NR + j];
                        if (g->bias) v += load_as_f32(g->bias, n0 + j, g->bias_dtype);
                        store_from_f32(g->y, (m0 + i) * g->n + n0 + j, g->dtype, v);
                    }
            }
        }
    }
    free(tile);
    return 1;
}

/* linear_fp8(x, dtype, m, k, x_stride, w, n, scale, granularity, bias, bias_dtype, y, n_threads, portable=False):
 * pointers as integers, bias 0 for none; the Python side (kernels/cpu_native.py) checks dtypes, shapes and
 * contiguity. portable: the plain C path even where AVX2 runs (tests). */
static PyObject *py_linear_fp8(PyObject *self, PyObject *args) {
    unsigned long long x, w, scale, bias, y;
    long long m, k, x_stride, n;
    int dtype, granularity, bias_dtype, n_threads, portable = 0;
    (void)self;
    if (!PyArg_ParseTuple(args, "KiLLLKLKiKiKi|p", &x, &dtype, &m, &k, &x_stride, &w, &n, &scale, &granularity, &bias,
                          &bias_dtype, &y, &n_threads, &portable))
        return NULL;
    if (dtype < 0 || dtype > 2 || bias_dtype < 0 || bias_dtype > 2 || granularity < 0 || granularity > 2 || m < 0 ||
        n < 1 || k < 1 || x_stride < k) {
        PyErr_SetString(PyExc_ValueError, "linear_fp8: bad dtype code, granularity code or shape");
        return NULL;
    }
    Gemm g;
    memset(&g, 0, sizeof g);
    g.w = (const uint8_t *)(uintptr_t)w;
    g.scale = (const float *)(uintptr_t)scale;
    g.granularity = granularity;
    g.x = (const char *)(uintptr_t)x;
    g.x_stride = x_stride;
    g.dtype = dtype;
    g.bias = bias ? (const char *)(uintptr_t)bias : NULL;
    g.bias_dtype = bias_dtype;
    g.y = (char *)(uintptr_t)y;
    g.m = m;
    g.n = n;
    g.k = k;
    g.kp = (k + 7) / 8 * 8;
    g.ldw = g.kp % 1024 ? g.kp : g.kp + 16;
    const int direct = dtype == 1 && k % 8 == 0; /* float32 rows of whole vectors: read in place */
    g.ldx = direct ? x_stride : g.ldw;
    g.vector = !portable && gemm_vector_supported();
    /* whole micro-tiles, about GEMM_TILE_BYTES; where one block of GEMM_MR rows of x is all there is, the tile is
     * read once, so it stays in L1 instead (GEMM_SMALL_TILE_BYTES) */
    const int64_t tile_bytes = m <= GEMM_MR ? GEMM_SMALL_TILE_BYTES : GEMM_TILE_BYTES;
    g.nb = tile_bytes / (int64_t)sizeof(float) / g.ldw / GEMM_NR * GEMM_NR;
    if (g.nb < GEMM_NR) g.nb = GEMM_NR;
    if (m == 0) Py_RETURN_NONE;
    /* threads: each a range of whole micro-tiles of output features, and enough work to pay for its start-up */
    const int64_t units = (n + GEMM_NR - 1) / GEMM_NR;
    const int64_t most = n * k * (4 + m) / (1 << 19);
    if (n_threads > MAX_THREADS) n_threads = MAX_THREADS;
    if (most < n_threads) n_threads = most < 1 ? 1 : (int)most;
    if (units < n_threads) n_threads = (int)units;
    if (n_threads < 1) n_threads = 1;
    float *xf = NULL;
    if (!direct && posix_memalign((void **)&xf, 64, (size_t)(m * g.ldx) * sizeof(float))) return PyErr_NoMemory();
    g.xf = direct ? (const float *)g.x : xf;
    int failed = 0;
    Py_BEGIN_ALLOW_THREADS
    /* one parallel region: x widened by rows, then (after the loop's barrier) the GEMM by output features */
#pragma omp parallel num_threads(n_threads)
    {
        if (!direct) {
#pragma omp for schedule(static)
            for (int64_t r = 0; r < m; r++) widen_row(&g, r, xf + r * g.ldx);
        }
#pragma omp for schedule(static, 1) reduction(| : failed)
        for (int t = 0; t < n_threads; t++) {
            const int64_t lo = units * t / n_threads * GEMM_NR, hi = units * (t + 1) / n_threads * GEMM_NR;
            if (!gemm_worker(&g, lo, hi < n ? hi : n)) failed = 1;
        }
    }
    Py_END_ALLOW_THREADS
    free(xf);
    if (failed) return PyErr_NoMemory();
    Py_RETURN_NONE;
}

static PyObject *py_gemm_path(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyUnicode_FromString(gemm_vector_supported() ? "avx2" : "portable");
}

static PyObject *py_table_path(PyObject *self, PyObject *args) {
    (void)self;
    (void)args;
    return PyBool_FromLong(lut_supported());
}

static PyMethodDef methods[] = {
    {"table_path", py_table_path, METH_NOARGS,
     "table_path(): whether the in-range bfloat16 conversion runs as a table lookup (AVX-512 VBMI) here."},
    {"gemm_path", py_gemm_path, METH_NOARGS,
     "gemm_path(): 'avx2' where linear_fp8 runs its AVX2 / FMA / F16C kernels here, else 'portable'."},
    {"linear_fp8", py_linear_fp8, METH_VARARGS,
     "linear_fp8(x, dtype, m, k, x_stride, w, n, scale, granularity, bias, bias_dtype, y, n_threads, portable=False): "
     "y = x @ dequantize(w)^T + bias."},
    {"amax", py_amax, METH_VARARGS,
     "amax(src, dtype, granularity, n_rows, k, out, n_threads): max |x| per group into float32 out."},
    {"quantize", py_quantize, METH_VARARGS,
     "quantize(src, dtype, granularity, n_rows, k, scale, dst, n_threads, in_range=False): e4m3fn bytes into dst."},
    {"scale_from_amax", py_scale_from_amax, METH_VARARGS,
     "scale_from_amax(ptr, count): float32 amaxes -> scales in place; returns the count of non-finite ones."},
    {"scale_quantize", py_scale_quantize, METH_VARARGS,
     "scale_quantize(src, dtype, granularity, n_rows, k, scales, dst, n_threads): amax, scale and quantize in one "
     "pass (per channel); returns the count of non-finite rows."},
    {"copy_amax", py_copy_amax, METH_VARARGS,
     "copy_amax(src, dst, numel, dtype, n_threads): copy src into dst; returns max |src| (NaN if any is NaN)."},
    {"amax_pieces", py_amax_pieces, METH_VARARGS,
     "amax_pieces(table, n, dtype, granularity, k, scales, n_threads): amax of a batch of pieces into scales."},
    {"quantize_pieces", py_quantize_pieces, METH_VARARGS,
     "quantize_pieces(table, n, dtype, granularity, k, scales, n_threads, in_range=False): a batch of pieces."},
    {NULL, NULL, 0, NULL},
};

static struct PyModuleDef module = {PyModuleDef_HEAD_INIT, "_cpu_fp8", NULL, -1, methods, NULL, NULL, NULL, NULL};

/* bumped when the functions' arguments change: kernels/cpu_native.py refuses a stale build of an editable install */
#define ABI_VERSION 7

PyMODINIT_FUNC PyInit__cpu_fp8(void) {
    (void)lut_supported(); /* the CPU checks made once here, not first by several OpenMP threads at once */
    (void)gemm_vector_supported();
    e4m3_table_init();
    PyObject *m = PyModule_Create(&module);
    if (m != NULL && PyModule_AddIntConstant(m, "ABI_VERSION", ABI_VERSION) < 0) {
        Py_DECREF(m);
        return NULL;
    }
    return m;
}
