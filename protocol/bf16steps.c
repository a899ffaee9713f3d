/* Kernels of the bf16_steps pull codec (protocol/codecs/steps.py): bf16 weights sent as steps on the
 * bf16 grid, one byte each. Compiled with blockquant.c into one library by protocol/native.py.
 *
 * Read as integers, the bf16 bit patterns of one sign are in order and adjacent values differ by one:
 * ord(b) = b for a positive pattern, -(b & 0x7fff) for a negative one (both zeros are 0). The step of
 * element i is ord(new_i) - ord(old_i); a step in [-127, 127] is its int8 code. Anything else -- a
 * larger step, a new value that is a zero of the other sign, a non-finite new value -- is the code
 * -128 (an escape), and the new bits follow in a second frame, in element order.
 *
 * Bit-identical to the torch path for finite weights (tests/unit/test_steps_codec.py): the rounding to
 * bf16 is torch's (to nearest even). The loops are written for gcc's vectorizer: two integer widths
 * per loop at most, escapes found eight codes at a time and handled apart.
 */
#include <stdint.h>
#include <string.h>

/* fp32 bits -> bf16 bits, round to nearest even (torch's rounding; a NaN becomes 0x7fc0) */
static inline uint16_t bf16_bits(uint32_t u) {
    const uint16_t r = (uint16_t)((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
    return (u & 0x7fffffffu) > 0x7f800000u ? (uint16_t)0x7fc0 : r;
}

/* bf16 bit patterns as ordered integers: adjacent values of the grid differ by one (both zeros are 0) */
static inline int32_t ord16(uint16_t b) {
    const int32_t neg = -(int32_t)(b >> 15);
    return ((int32_t)(b & 0x7fffu) ^ neg) - neg;
}
static inline uint16_t unord16(int32_t o) {
    const int32_t neg = o >> 31;
    return (uint16_t)(((o ^ neg) - neg) | (neg & 0x8000));
}

void luwu_bf16_round(const float *w, uint16_t *out, int64_t n) {
    const uint32_t *u = (const uint32_t *)w;
    for (int64_t i = 0; i < n; i++) out[i] = bf16_bits(u[i]);
}

#define RUN 64
#define SPAN 2048 /* elements per pass of the vector loops */

/* Where in codes[0, m) the escapes are (m <= 64): bit i set for codes[i] == -128. Eight codes at a time
 * (a word holds a 0x80 byte iff it has a zero byte after flipping the top bits), the bits of a word that has one. */
static inline uint64_t escapes_in(const int8_t *codes, int64_t m) {
    uint64_t mask = 0;
    int64_t i = 0;
    for (; i + 8 <= m; i += 8) {
        uint64_t v;
        memcpy(&v, codes + i, sizeof v);
        v ^= 0x8080808080808080ull;
        if ((v - 0x0101010101010101ull) & ~v & 0x8080808080808080ull)
            for (int64_t b = i; b < i + 8; b++) mask |= (uint64_t)(codes[b] == -128) << b;
    }
    for (; i < m; i++) mask |= (uint64_t)(codes[i] == -128) << i;
    return mask;
}

/* codes[i] = ord(bf16(w[i])) - ord(old[i]) where it lies in [-127, 127] and decodes to the same bits; else
 * -128, and the new bits go to esc, in order. Returns the number of escapes. */
int64_t luwu_bf16_steps_encode(const float *w, const uint16_t *old, int8_t *codes, uint16_t *esc, int64_t n) {
    const uint32_t *u = (const uint32_t *)w;
    int16_t any = 0;
    for (int64_t s = 0; s < n; s += SPAN) {  /* two passes per span, each over two widths: both vectorize */
        const int64_t m = n - s < SPAN ? n - s : SPAN;
        uint16_t nb[SPAN];
        for (int64_t i = 0; i < m; i++) nb[i] = bf16_bits(u[s + i]);
        for (int64_t i = 0; i < m; i++) {
            const uint16_t b = nb[i], ob = old[s + i];
            /* in 16 bits: the difference wraps, but not into [-127, 127] while the new value is finite */
            const int16_t sn = (int16_t)-(int16_t)(b >> 15), so = (int16_t)-(int16_t)(ob >> 15);
            const int16_t d = (int16_t)((((int16_t)(b & 0x7fff) ^ sn) - sn) - (((int16_t)(ob & 0x7fff) ^ so) - so));
            const int16_t e = (d < -127) | (d > 127) | ((b & 0x7f80) == 0x7f80) | (((b & 0x7fff) == 0) & (b != ob));
            codes[s + i] = (int8_t)(e ? -128 : d);
            any |= e;
        }
    }
    int64_t k = 0;
    for (int64_t s = 0; any && s < n; s += RUN)
        for (uint64_t mask = escapes_in(codes + s, n - s < RUN ? n - s : RUN); mask; mask &= mask - 1)
            esc[k++] = bf16_bits(u[s + __builtin_ctzll(mask)]);
    return k;
}

/* The escape codes (-128) in codes[0, n): compared in 32-bit counters a span at a time, which vectorizes
 * (one 64-bit counter per element does not: its widening costs more than the compare). */
static int64_t count_escapes(const int8_t *codes, int64_t n) {
    int64_t c = 0;
    for (int64_t s = 0; s < n; s += SPAN) {
        const int64_t m = n - s < SPAN ? n - s : SPAN;
        uint32_t cs = 0;
        for (int64_t i = 0; i < m; i++) cs += codes[s + i] == -128;
        c += cs;
    }
    return c;
}

/* The escapes in codes[0, n): how a reply's codes split its escapes between the segments of a bucket. */
int64_t luwu_bf16_steps_count(const int8_t *codes, int64_t n) { return count_escapes(codes, n); }

static inline uint16_t stepped(uint16_t ob, int8_t c) { return c == 0 ? ob : unord16(ord16(ob) + c); }

/* w (fp32 holding bf16 values, or bf16 bits when `half`) stepped by codes / replaced by the escapes.
 * Returns -1, writing nothing, when the codes name another number of escapes than k. One pass after
 * the count: a span is stepped (an escape's code makes garbage), then its escapes are written while
 * its codes and weights are still in L1. `restrict`: -fno-strict-aliasing lets an int8 pointer alias
 * anything, so without it each loop is versioned on a runtime overlap check. */
int64_t luwu_bf16_steps_apply(void *w, int32_t half, const int8_t *restrict codes, const uint16_t *restrict esc,
                              int64_t n, int64_t k) {
    if (count_escapes(codes, n) != k) return -1;
    uint32_t *restrict w32 = (uint32_t *)w;
    uint16_t *restrict w16 = (uint16_t *)w;
    int64_t j = 0;
    for (int64_t s = 0; s < n; s += SPAN) {
        const int64_t m = n - s < SPAN ? n - s : SPAN;
        if (half)
            for (int64_t i = s; i < s + m; i++) w16[i] = stepped(w16[i], codes[i]);
        else
            for (int64_t i = s; i < s + m; i++) {  /* in 32-bit lanes */
                const uint32_t x = w32[i];
                const int32_t c = codes[i], neg = -(int32_t)(x >> 31);
                const int32_t o = (((int32_t)((x >> 16) & 0x7fffu) ^ neg) - neg) + c;
                const int32_t sg = o >> 31;
                const uint32_t nb = (uint32_t)((o ^ sg) - sg) | ((uint32_t)sg & 0x8000u);
                w32[i] = c ? nb << 16 : x;
            }
        for (int64_t r = s; j < k && r < s + m; r += RUN)
            for (uint64_t b = escapes_in(codes + r, s + m - r < RUN ? s + m - r : RUN); b; b &= b - 1) {
                const int64_t i = r + __builtin_ctzll(b);  /* an escape: its bits as sent */
                if (half) w16[i] = esc[j++]; else w32[i] = (uint32_t)esc[j++] << 16;
            }
    }
    return j;
}
