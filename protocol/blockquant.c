/* Fused kernels of the blockwise integer codecs (int8, int4: protocol/codecs/block.py, _BlockCodec).
 *
 * The torch path walks a bucket in chunks with 6-9 elementwise passes (abs, amax, scale, round,
 * residual, cast); here each block of `block` floats (1 KiB for int8) is read once from memory
 * and stays in L1 for its two passes (amax, then quantize + residual). Compiled at first use by
 * protocol/native.py with -O3 -march=native -ffp-contract=off and loaded with ctypes.
 *
 * Bit-identical to the torch path for finite input, and the tests check it: the same float32
 * operations in the same order, each rounded on its own (no fused multiply-add here; the torch
 * path uses no op that fuses one, such as addcmul), round half to even (rintf under the default
 * rounding mode, as torch.round). A node and its workers may run either path: the int8 pull
 * deltas need every worker's copy to equal the node's shadow bit for bit.
 *
 *   scale s  = max(amax(block), floor);  inv = (1 / s) * levels;  stored scale = s / levels
 *   t        = rint(y * inv)                       (y = x, or residual += x first)
 *   residual = y - t * stored
 *   decode   = acc + t * (stored * alpha)          (decode_ without acc: t * (stored * alpha))
 *
 * A block holding NaN or inf gets a non-finite scale and zero codes, so it decodes as NaN
 * everywhere (0 * NaN, 0 * inf), as protocol/codecs/base.py's docstring promises.
 */
#include <stdint.h>
#include <string.h>

/* Largest |y| of a block, NaN if any is NaN: on the bit patterns, where non-negative floats sort
 * like unsigned integers and NaN above inf (an integer max reduction vectorizes; a float one
 * needs -ffast-math, which would break the bit-identity above). */
static inline float block_amax(const float *y, int64_t m) {
    const uint32_t *u = (const uint32_t *)y;
    uint32_t a = 0;
    for (int64_t i = 0; i < m; i++) {
        uint32_t v = u[i] & 0x7fffffffu;
        a = v > a ? v : a;
    }
    float f;
    memcpy(&f, &a, sizeof f);
    return f;
}

static inline int finite(float v) { return v - v == 0.0f; }

/* Quantize `m` values of block `y` into `t` (integer-valued floats); returns the stored scale. */
static inline float quantize(const float *y, float *t, int64_t m, float levels, float floor_) {
    float s = block_amax(y, m);
    if (!finite(s)) {
        for (int64_t i = 0; i < m; i++) t[i] = 0.0f;
        return s;
    }
    if (s < floor_) s = floor_;
    const float inv = (1.0f / s) * levels;
    for (int64_t i = 0; i < m; i++) t[i] = __builtin_rintf(y[i] * inv);
    return s / levels;
}

/* int8 codes of a finite block whose scale is found: quantize, keep the residual, store, in one pass
 * (the same operations as quantize() and the loops after it, element by element). */
/* A block's codes from `scratch` (its `m` quantized values) into q at the block's `start`: int8 one
 * a byte; int4 two a byte, low nibble first, offset by 8 (an odd tail's high nibble is 8). */
static inline void store_codes(void *q, int64_t start, const float *scratch, int64_t m, int32_t bits) {
    if (bits == 8) {
        int8_t *o = (int8_t *)q + start;
        for (int64_t i = 0; i < m; i++) o[i] = (int8_t)(int32_t)scratch[i];
    } else {
        uint8_t *o = (uint8_t *)q + start / 2;  /* block is even: a block starts on a byte */
        const int64_t pairs = m / 2;
        for (int64_t j = 0; j < pairs; j++)
            o[j] = (uint8_t)(((int32_t)scratch[2 * j] + 8) | (((int32_t)scratch[2 * j + 1] + 8) << 4));
        if (m & 1) o[pairs] = (uint8_t)(((int32_t)scratch[m - 1] + 8) | (8 << 4));
    }
}

static inline void int8_block(const float *restrict y, float *restrict r, int8_t *restrict o, int64_t m,
                              float inv, float sc) {
    if (r)
        for (int64_t i = 0; i < m; i++) {
            const float t = __builtin_rintf(r[i] * inv);
            r[i] = r[i] - t * sc;
            o[i] = (int8_t)(int32_t)t;
        }
    else
        for (int64_t i = 0; i < m; i++) o[i] = (int8_t)(int32_t)__builtin_rintf(y[i] * inv);
}

/* Encode n floats: x (+= into residual first when residual is not NULL) -> codes q (int8, or int4
 * packed two per byte: low nibble first, nibble = code + 8; an odd tail pads with code 0) and one
 * scale per block. `scratch` holds `block` floats. */
/* One block of luwu_block_encode: the `m` floats `y` (the residual itself, `r`, when there is one:
 * x already added into it) -> its codes at q's `start`, its scale, and what the residual keeps. */
static inline void encode_block(const float *y, float *r, void *q, float *scales, int64_t start, int64_t b,
                                int64_t m, int32_t bits, float levels, float floor_, float *scratch) {
    if (bits == 8) { /* the common case in one pass after the amax; a non-finite block below */
        float s = block_amax(y, m);
        if (finite(s)) {
            if (s < floor_) s = floor_;
            const float sc = s / levels;
            scales[b] = sc;
            int8_block(y, r, (int8_t *)q + start, m, (1.0f / s) * levels, sc);
            return;
        }
    }
    const float sc = quantize(y, scratch, m, levels, floor_);
    scales[b] = sc;
    if (r && finite(sc))
        for (int64_t i = 0; i < m; i++) r[i] = r[i] - scratch[i] * sc;
    store_codes(q, start, scratch, m, bits);
}

void luwu_block_encode(const float *x, float *residual, void *q, float *scales, int64_t n, int64_t block,
                       int32_t bits, float levels, float floor_, float *scratch) {
    for (int64_t start = 0, b = 0; start < n; start += block, b++) {
        const int64_t m = n - start < block ? n - start : block;
        const float *y = x + start;
        float *r = residual ? residual + start : NULL;
        if (r) {
            const float *restrict xs = x + start;
            float *restrict rr = r;
            for (int64_t i = 0; i < m; i++) rr[i] = rr[i] + xs[i];
            y = r;
        }
        encode_block(y, r, q, scales, start, b, m, bits, levels, floor_, scratch);
    }
}

/* luwu_block_encode of x (no residual) with the codes written over x itself: q is x's own memory
 * (its first n bytes for int8, (n + 1) / 2 for int4), so a buffer that is not read again after its
 * push (a streamed bucket's gradient) carries its codes without a second buffer to allocate and fault
 * in. The same codes and scales as luwu_block_encode, bit for bit. A block's codes land at bytes
 * below its own floats (byte start against 4 * start), over floats already read: code i of a block
 * is stored after float i was read, and overwrites float (start + i) / 4 <= start + i. No `restrict`
 * (q and x alias on purpose): the compiler keeps that order, vectorizing where the ranges are apart
 * (every block but the first). `scratch` holds `block` floats. */
void luwu_block_encode_over(float *x, float *scales, int64_t n, int64_t block, int32_t bits, float levels,
                            float floor_, float *scratch) {
    uint8_t *q = (uint8_t *)x;
    for (int64_t start = 0, b = 0; start < n; start += block, b++) {
        const int64_t m = n - start < block ? n - start : block;
        const float *y = x + start;
        if (bits == 8) {  /* the common case as luwu_block_encode's */
            float s = block_amax(y, m);
            if (finite(s)) {
                if (s < floor_) s = floor_;
                const float inv = (1.0f / s) * levels, sc = s / levels;
                int8_t *o = (int8_t *)(q + start);
                scales[b] = sc;
                for (int64_t i = 0; i < m; i++) o[i] = (int8_t)(int32_t)__builtin_rintf(y[i] * inv);
                continue;
            }
        }
        const float sc = quantize(y, scratch, m, levels, floor_);  /* the whole block read first */
        scales[b] = sc;
        store_codes(q, start, scratch, m, bits);
    }
}

/* bf16 <-> fp32 as torch converts them: widening is exact; narrowing rounds to nearest even, NaN to
 * the quiet NaN 0x7fc0 (c10::BFloat16's round_to_nearest_even). */
static inline float bf16_to_f32(uint16_t h) {
    uint32_t u = (uint32_t)h << 16;
    float f;
    memcpy(&f, &u, sizeof f);
    return f;
}

static inline uint16_t f32_to_bf16(float f) {
    if (f != f) return 0x7fc0;
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* f32_to_bf16 of a value known not to be NaN (no test in the loop) */
static inline uint16_t f32_to_bf16_num(float f) {
    uint32_t u;
    memcpy(&u, &f, sizeof u);
    return (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

/* One block of luwu_block_encode_bf16res: the `m` floats `xs` (+ the block's bf16 residual `r`) -> its
 * codes at q's `start`, its scale, and the residual left. `y` and `scratch` hold `block` floats each. */
static inline void bf16res_block(const float *restrict xs, uint16_t *restrict r, void *q, float *scales,
                                 int64_t start, int64_t b, int64_t m, int32_t bits, float levels, float floor_,
                                 float *restrict y, float *scratch) {
    uint32_t amax = 0; /* block_amax(y, m), found as y is made */
    for (int64_t i = 0; i < m; i++) {
        const float v = bf16_to_f32(r[i]) + xs[i];
        uint32_t u;
        memcpy(&u, &v, sizeof u);
        u &= 0x7fffffffu;
        amax = u > amax ? u : amax;
        y[i] = v;
    }
    if (bits == 8) { /* the common case in one pass after the amax (as int8_block); a non-finite block below */
        float s;
        memcpy(&s, &amax, sizeof s);
        if (finite(s)) {
            if (s < floor_) s = floor_;
            const float inv = (1.0f / s) * levels, sc = s / levels;
            int8_t *restrict o = (int8_t *)q + start;
            scales[b] = sc;
            for (int64_t i = 0; i < m; i++) {
                const float t = __builtin_rintf(y[i] * inv);
                r[i] = f32_to_bf16_num(y[i] - t * sc); /* finite: y, t and sc are */
                o[i] = (int8_t)(int32_t)t;
            }
            return;
        }
    }
    const float sc = quantize(y, scratch, m, levels, floor_);
    scales[b] = sc;
    if (finite(sc))
        for (int64_t i = 0; i < m; i++) r[i] = f32_to_bf16(y[i] - scratch[i] * sc);
    else
        for (int64_t i = 0; i < m; i++) r[i] = f32_to_bf16(y[i]);
    store_codes(q, start, scratch, m, bits);
}

/* luwu_block_encode with a bf16 residual (compression.residual_dtype = "bfloat16"), in one pass:
 * the same bits as widening the residual to fp32, encoding with it, and rounding it back, which is
 * what protocol/feedback.py does without the kernels. `scratch` holds 2 * `block` floats. */
void luwu_block_encode_bf16res(const float *x, uint16_t *residual, void *q, float *scales, int64_t n,
                               int64_t block, int32_t bits, float levels, float floor_, float *scratch) {
    for (int64_t start = 0, b = 0; start < n; start += block, b++) {
        const int64_t m = n - start < block ? n - start : block;
        bf16res_block(x + start, residual + start, q, scales, start, b, m, bits, levels, floor_,
                      scratch + block, scratch);
    }
}

/* Whether n floats hold a NaN or an infinity (on the bit patterns, as luwu_copy_nonfinite) */
static int32_t any_nonfinite(const float *x, int64_t n) {
    const uint32_t *u = (const uint32_t *)x;
    uint32_t a = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t m = u[i] & 0x7fffffffu;
        a = m > a ? m : a;
    }
    return a >= 0x7f800000u;
}

/* luwu_block_encode of the concatenation of `npieces` float arrays (pieces[k], lens[k] floats each, n in
 * all) without copying them together first: a streamed bucket's push encoded straight from its parameters'
 * gradients (gpu_workers/bucket_fill.py). The same codes and scales, bit for bit; a block that spans pieces
 * is gathered into scratch. Returns 1, having written nothing, when a piece holds a NaN or an infinity
 * (checked first: that push goes uncompressed); 2 when the pieces do not add up to n; else 0. `scratch`
 * holds 2 * `block` floats. */
int32_t luwu_block_encode_pieces(const float *const *pieces, const int64_t *lens, int32_t npieces, void *q,
                                 float *scales, int64_t n, int64_t block, int32_t bits, float levels,
                                 float floor_, float *scratch) {
    int64_t total = 0;
    for (int32_t k = 0; k < npieces; k++) {
        if (any_nonfinite(pieces[k], lens[k])) return 1;
        total += lens[k];
    }
    if (total != n) return 2;
    float *gather = scratch + block;
    int32_t k = 0;
    int64_t at = 0; /* position in piece k */
    for (int64_t start = 0, b = 0; start < n; start += block, b++) {
        const int64_t m = n - start < block ? n - start : block;
        while (at == lens[k]) k++, at = 0; /* (skips empty pieces) */
        const float *xs = pieces[k] + at;
        if (lens[k] - at >= m) {
            at += m;
        } else { /* the block spans pieces */
            for (int64_t got = 0; got < m;) {
                while (at == lens[k]) k++, at = 0;
                const int64_t take = lens[k] - at < m - got ? lens[k] - at : m - got;
                memcpy(gather + got, pieces[k] + at, (size_t)take * sizeof(float));
                got += take, at += take;
            }
            xs = gather;
        }
        encode_block(xs, NULL, q, scales, start, b, m, bits, levels, floor_, scratch);
    }
    return 0;
}

/* out[i] = code_i * (scale_block * alpha), added to out[i] when `add` */
void luwu_block_decode(float *out, const void *q, const float *scales, int64_t n, int64_t block, int32_t bits,
                       float alpha, int32_t add) {
    for (int64_t start = 0, b = 0; start < n; start += block, b++) {
        const int64_t m = n - start < block ? n - start : block;
        const float sc = scales[b] * alpha;
        float *o = out + start;
        if (bits == 8) {
            const int8_t *c = (const int8_t *)q + start;
            if (add)
                for (int64_t i = 0; i < m; i++) o[i] = o[i] + (float)c[i] * sc;
            else
                for (int64_t i = 0; i < m; i++) o[i] = (float)c[i] * sc;
        } else if (add) {  /* block is even (validated), so a block starts on a byte */
            const uint8_t *c = (const uint8_t *)q + start / 2;
            int64_t j = 0;
            for (; 2 * j + 1 < m; j++) {
                o[2 * j] = o[2 * j] + ((float)(c[j] & 15) - 8.0f) * sc;
                o[2 * j + 1] = o[2 * j + 1] + ((float)(c[j] >> 4) - 8.0f) * sc;
            }
            if (2 * j < m) o[2 * j] = o[2 * j] + ((float)(c[j] & 15) - 8.0f) * sc;
        } else {
            const uint8_t *c = (const uint8_t *)q + start / 2;
            int64_t j = 0;
            for (; 2 * j + 1 < m; j++) {
                o[2 * j] = ((float)(c[j] & 15) - 8.0f) * sc;
                o[2 * j + 1] = ((float)(c[j] >> 4) - 8.0f) * sc;
            }
            if (2 * j < m) o[2 * j] = ((float)(c[j] & 15) - 8.0f) * sc;
        }
    }
}

/* out[i] = a_i * (sa * alpha) + b_i * (sb * alpha): two pushes of the same block codec and block
 * size in one pass (the torch path: decode_ then decode_add_). */
void luwu_block_decode_pair(float *out, const void *qa, const float *sa, const void *qb, const float *sb, int64_t n,
                            int64_t block, int32_t bits, float alpha) {
    for (int64_t start = 0, b = 0; start < n; start += block, b++) {
        const int64_t m = n - start < block ? n - start : block;
        const float s1 = sa[b] * alpha, s2 = sb[b] * alpha;
        float *o = out + start;
        if (bits == 8) {
            const int8_t *c1 = (const int8_t *)qa + start, *c2 = (const int8_t *)qb + start;
            for (int64_t i = 0; i < m; i++) o[i] = (float)c1[i] * s1 + (float)c2[i] * s2;
        } else {
            const uint8_t *c1 = (const uint8_t *)qa + start / 2, *c2 = (const uint8_t *)qb + start / 2;
            int64_t j = 0;
            for (; 2 * j + 1 < m; j++) {
                o[2 * j] = ((float)(c1[j] & 15) - 8.0f) * s1 + ((float)(c2[j] & 15) - 8.0f) * s2;
                o[2 * j + 1] = ((float)(c1[j] >> 4) - 8.0f) * s1 + ((float)(c2[j] >> 4) - 8.0f) * s2;
            }
            if (2 * j < m) o[2 * j] = ((float)(c1[j] & 15) - 8.0f) * s1 + ((float)(c2[j] & 15) - 8.0f) * s2;
        }
    }
}

/* dst = src (n floats), and whether src holds a NaN or an infinity: a gradient copied into its bucket is
 * checked for the push's codec choice (protocol/codecs/base.py, copy_finite_) as it passes, instead of in
 * a second pass over the bucket. On the bit patterns, as block_amax: |x| >= inf's pattern is non-finite. */
int32_t luwu_copy_nonfinite(float *restrict dst, const float *restrict src, int64_t n) {
    uint32_t *restrict d = (uint32_t *)dst;
    const uint32_t *restrict u = (const uint32_t *)src;
    uint32_t a = 0;
    for (int64_t i = 0; i < n; i++) {
        const uint32_t v = u[i];
        d[i] = v;
        const uint32_t m = v & 0x7fffffffu;
        a = m > a ? m : a;
    }
    return a >= 0x7f800000u;
}
