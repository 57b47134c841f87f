/* XXH3-64 (seed 0, default secret) from the xxHash specification; see xxh3.h. */
#include "xxh3.h"

#include <string.h>

#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define XXH3_X86 1
#endif

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "the native I/O engine assumes a little-endian CPU"
#endif

#define P32_1 0x9E3779B1U
#define P32_2 0x85EBCA77U
#define P32_3 0xC2B2AE3DU
#define P64_1 0x9E3779B185EBCA87ULL
#define P64_2 0xC2B2AE3D27D4EB4FULL
#define P64_3 0x165667B19E3779F9ULL
#define P64_4 0x85EBCA77C2B2AE63ULL
#define P64_5 0x27D4EB2F165667C5ULL
#define PMX1 0x165667919E3779F9ULL
#define PMX2 0x9FB21C651E98DF25ULL

#define SECRET_SIZE 192
#define STRIPE_LEN 64
#define STRIPES_PER_BLOCK ((SECRET_SIZE - STRIPE_LEN) / 8)
#define BLOCK_LEN (STRIPE_LEN * STRIPES_PER_BLOCK)

static const uint8_t SECRET[SECRET_SIZE] = {
    0xb8, 0xfe, 0x6c, 0x39, 0x23, 0xa4, 0x4b, 0xbe, 0x7c, 0x01, 0x81, 0x2c, 0xf7, 0x21, 0xad, 0x1c,
    0xde, 0xd4, 0x6d, 0xe9, 0x83, 0x90, 0x97, 0xdb, 0x72, 0x40, 0xa4, 0xa4, 0xb7, 0xb3, 0x67, 0x1f,
    0xcb, 0x79, 0xe6, 0x4e, 0xcc, 0xc0, 0xe5, 0x78, 0x82, 0x5a, 0xd0, 0x7d, 0xcc, 0xff, 0x72, 0x21,
    0xb8, 0x08, 0x46, 0x74, 0xf7, 0x43, 0x24, 0x8e, 0xe0, 0x35, 0x90, 0xe6, 0x81, 0x3a, 0x26, 0x4c,
    0x3c, 0x28, 0x52, 0xbb, 0x91, 0xc3, 0x00, 0xcb, 0x88, 0xd0, 0x65, 0x8b, 0x1b, 0x53, 0x2e, 0xa3,
    0x71, 0x64, 0x48, 0x97, 0xa2, 0x0d, 0xf9, 0x4e, 0x38, 0x19, 0xef, 0x46, 0xa9, 0xde, 0xac, 0xd8,
    0xa8, 0xfa, 0x76, 0x3f, 0xe3, 0x9c, 0x34, 0x3f, 0xf9, 0xdc, 0xbb, 0xc7, 0xc7, 0x0b, 0x4f, 0x1d,
    0x8a, 0x51, 0xe0, 0x4b, 0xcd, 0xb4, 0x59, 0x31, 0xc8, 0x9f, 0x7e, 0xc9, 0xd9, 0x78, 0x73, 0x64,
    0xea, 0xc5, 0xac, 0x83, 0x34, 0xd3, 0xeb, 0xc3, 0xc5, 0x81, 0xa0, 0xff, 0xfa, 0x13, 0x63, 0xeb,
    0x17, 0x0d, 0xdd, 0x51, 0xb7, 0xf0, 0xda, 0x49, 0xd3, 0x16, 0x55, 0x26, 0x29, 0xd4, 0x68, 0x9e,
    0x2b, 0x16, 0xbe, 0x58, 0x7d, 0x47, 0xa1, 0xfc, 0x8f, 0xf8, 0xb8, 0xd1, 0x7a, 0xd0, 0x31, 0xce,
    0x45, 0xcb, 0x3a, 0x8f, 0x95, 0x16, 0x04, 0x28, 0xaf, 0xd7, 0xfb, 0xca, 0xbb, 0x4b, 0x40, 0x7e,
};

static inline uint64_t rd64(const uint8_t *p) {
    uint64_t v;
    memcpy(&v, p, 8);
    return v;
}

static inline uint32_t rd32(const uint8_t *p) {
    uint32_t v;
    memcpy(&v, p, 4);
    return v;
}

static inline uint64_t rotl64(uint64_t x, int r) { return (x << r) | (x >> (64 - r)); }

static inline uint64_t fold128(uint64_t a, uint64_t b) {
    __uint128_t r = (__uint128_t)a * b;
    return (uint64_t)r ^ (uint64_t)(r >> 64);
}

static inline uint64_t avalanche(uint64_t h) {
    h ^= h >> 37;
    h *= PMX1;
    return h ^ (h >> 32);
}

static inline uint64_t avalanche_xxh64(uint64_t h) {
    h ^= h >> 33;
    h *= P64_2;
    h ^= h >> 29;
    h *= P64_3;
    return h ^ (h >> 32);
}

static inline uint64_t mix16(const uint8_t *in, const uint8_t *secret) {
    return fold128(rd64(in) ^ rd64(secret), rd64(in + 8) ^ rd64(secret + 8));
}

static uint64_t hash_0to16(const uint8_t *in, size_t len) {
    if (len > 8) {
        uint64_t lo = rd64(in) ^ (rd64(SECRET + 24) ^ rd64(SECRET + 32));
        uint64_t hi = rd64(in + len - 8) ^ (rd64(SECRET + 40) ^ rd64(SECRET + 48));
        return avalanche(len + __builtin_bswap64(lo) + hi + fold128(lo, hi));
    }
    if (len >= 4) {
        uint64_t combined = (uint64_t)rd32(in + len - 4) | ((uint64_t)rd32(in) << 32);
        uint64_t v = combined ^ (rd64(SECRET + 8) ^ rd64(SECRET + 16));
        v ^= rotl64(v, 49) ^ rotl64(v, 24);
        v *= PMX2;
        v ^= (v >> 35) + len;
        v *= PMX2;
        return v ^ (v >> 28);
    }
    if (len > 0) {
        uint32_t combined = (uint32_t)in[len - 1] | ((uint32_t)len << 8) |
                            ((uint32_t)in[0] << 16) | ((uint32_t)in[len >> 1] << 24);
        return avalanche_xxh64((uint64_t)(rd32(SECRET) ^ rd32(SECRET + 4)) ^ combined);
    }
    return avalanche_xxh64(rd64(SECRET + 56) ^ rd64(SECRET + 64));
}

static uint64_t hash_17to128(const uint8_t *in, size_t len) {
    uint64_t acc = len * P64_1;
    size_t rounds = ((len - 1) >> 5) + 1;
    for (size_t i = rounds; i-- > 0;) {
        acc += mix16(in + 16 * i, SECRET + 32 * i);
        acc += mix16(in + len - 16 * i - 16, SECRET + 32 * i + 16);
    }
    return avalanche(acc);
}

static uint64_t hash_129to240(const uint8_t *in, size_t len) {
    uint64_t acc = len * P64_1;
    size_t chunks = len >> 4;
    for (size_t i = 0; i < 8; i++) acc += mix16(in + 16 * i, SECRET + 16 * i);
    acc = avalanche(acc);
    for (size_t i = 8; i < chunks; i++) acc += mix16(in + 16 * i, SECRET + 16 * (i - 8) + 3);
    acc += mix16(in + len - 16, SECRET + 119);
    return avalanche(acc);
}

/* -- the long-input loop: accumulate stripes, scramble after every block -------------- */

static void accumulate_scalar(uint64_t *acc, const uint8_t *in, const uint8_t *secret,
                              size_t stripes) {
    for (size_t s = 0; s < stripes; s++) {
        const uint8_t *stripe = in + s * STRIPE_LEN;
        const uint8_t *key = secret + s * 8;
        for (int i = 0; i < 8; i++) {
            uint64_t value = rd64(stripe + 8 * i);
            uint64_t keyed = value ^ rd64(key + 8 * i);
            acc[i ^ 1] += value;
            acc[i] += (keyed & 0xFFFFFFFFu) * (keyed >> 32);
        }
    }
}

static void scramble_scalar(uint64_t *acc, const uint8_t *secret) {
    for (int i = 0; i < 8; i++) {
        uint64_t a = acc[i];
        a ^= a >> 47;
        a ^= rd64(secret + 8 * i);
        acc[i] = a * P32_1;
    }
}

#ifdef XXH3_X86
__attribute__((target("sse2"))) static void accumulate_sse2(uint64_t *acc, const uint8_t *in,
                                                            const uint8_t *secret,
                                                            size_t stripes) {
    __m128i *xacc = (__m128i *)acc;
    for (size_t s = 0; s < stripes; s++) {
        for (int i = 0; i < 4; i++) {
            __m128i data = _mm_loadu_si128((const __m128i *)(in + s * STRIPE_LEN) + i);
            __m128i key = _mm_loadu_si128((const __m128i *)(secret + s * 8) + i);
            __m128i keyed = _mm_xor_si128(data, key);
            __m128i product = _mm_mul_epu32(keyed, _mm_srli_epi64(keyed, 32));
            __m128i swapped = _mm_shuffle_epi32(data, 0x4E); /* acc[i ^ 1] += data[i] */
            xacc[i] = _mm_add_epi64(xacc[i], _mm_add_epi64(product, swapped));
        }
    }
}

__attribute__((target("sse2"))) static void scramble_sse2(uint64_t *acc, const uint8_t *secret) {
    __m128i *xacc = (__m128i *)acc;
    const __m128i prime = _mm_set1_epi32((int)P32_1);
    for (int i = 0; i < 4; i++) {
        __m128i a = xacc[i];
        a = _mm_xor_si128(a, _mm_srli_epi64(a, 47));
        a = _mm_xor_si128(a, _mm_loadu_si128((const __m128i *)secret + i));
        __m128i lo = _mm_mul_epu32(a, prime);
        __m128i hi = _mm_mul_epu32(_mm_srli_epi64(a, 32), prime);
        xacc[i] = _mm_add_epi64(lo, _mm_slli_epi64(hi, 32));
    }
}

__attribute__((target("avx2"))) static void accumulate_avx2(uint64_t *acc, const uint8_t *in,
                                                            const uint8_t *secret,
                                                            size_t stripes) {
    __m256i *xacc = (__m256i *)acc;
    __m256i a0 = _mm256_load_si256(xacc), a1 = _mm256_load_si256(xacc + 1);
    for (size_t s = 0; s < stripes; s++) {
        const __m256i *data = (const __m256i *)(in + s * STRIPE_LEN);
        const __m256i *key = (const __m256i *)(secret + s * 8);
        __m256i d0 = _mm256_loadu_si256(data), d1 = _mm256_loadu_si256(data + 1);
        __m256i k0 = _mm256_xor_si256(d0, _mm256_loadu_si256(key));
        __m256i k1 = _mm256_xor_si256(d1, _mm256_loadu_si256(key + 1));
        __m256i p0 = _mm256_mul_epu32(k0, _mm256_srli_epi64(k0, 32));
        __m256i p1 = _mm256_mul_epu32(k1, _mm256_srli_epi64(k1, 32));
        a0 = _mm256_add_epi64(a0, _mm256_add_epi64(p0, _mm256_shuffle_epi32(d0, 0x4E)));
        a1 = _mm256_add_epi64(a1, _mm256_add_epi64(p1, _mm256_shuffle_epi32(d1, 0x4E)));
    }
    _mm256_store_si256(xacc, a0);
    _mm256_store_si256(xacc + 1, a1);
}

__attribute__((target("avx2"))) static void scramble_avx2(uint64_t *acc, const uint8_t *secret) {
    __m256i *xacc = (__m256i *)acc;
    const __m256i prime = _mm256_set1_epi32((int)P32_1);
    for (int i = 0; i < 2; i++) {
        __m256i a = _mm256_load_si256(xacc + i);
        a = _mm256_xor_si256(a, _mm256_srli_epi64(a, 47));
        a = _mm256_xor_si256(a, _mm256_loadu_si256((const __m256i *)secret + i));
        __m256i lo = _mm256_mul_epu32(a, prime);
        __m256i hi = _mm256_mul_epu32(_mm256_srli_epi64(a, 32), prime);
        _mm256_store_si256(xacc + i, _mm256_add_epi64(lo, _mm256_slli_epi64(hi, 32)));
    }
}
#endif

static void (*accumulate)(uint64_t *acc, const uint8_t *in, const uint8_t *secret,
                          size_t stripes) = accumulate_scalar;
static void (*scramble)(uint64_t *acc, const uint8_t *secret) = scramble_scalar;

int xxh3_select(int simd) {
    switch (simd) {
    case XXH3_SCALAR:
        accumulate = accumulate_scalar;
        scramble = scramble_scalar;
        return 0;
#ifdef XXH3_X86
    case XXH3_SSE2:
        if (!__builtin_cpu_supports("sse2")) return -1;
        accumulate = accumulate_sse2;
        scramble = scramble_sse2;
        return 0;
    case XXH3_AVX2:
        if (!__builtin_cpu_supports("avx2")) return -1;
        accumulate = accumulate_avx2;
        scramble = scramble_avx2;
        return 0;
#endif
    default:
        return -1;
    }
}

int xxh3_init(void) {
#ifdef XXH3_X86
    __builtin_cpu_init();
#endif
    int simd = XXH3_AVX2;
    while (xxh3_select(simd) != 0) simd--; /* the scalar loop always runs */
    return simd;
}

static uint64_t hash_long(const uint8_t *in, size_t len) {
    uint64_t acc[8] __attribute__((aligned(32))) = {P32_3, P64_1, P64_2, P64_3,
                                                    P64_4, P32_2, P64_5, P32_1};
    size_t blocks = (len - 1) / BLOCK_LEN;
    for (size_t b = 0; b < blocks; b++) {
        accumulate(acc, in + b * BLOCK_LEN, SECRET, STRIPES_PER_BLOCK);
        scramble(acc, SECRET + SECRET_SIZE - STRIPE_LEN);
    }
    size_t tail_stripes = ((len - 1) - BLOCK_LEN * blocks) / STRIPE_LEN;
    accumulate(acc, in + blocks * BLOCK_LEN, SECRET, tail_stripes);
    accumulate(acc, in + len - STRIPE_LEN, SECRET + SECRET_SIZE - STRIPE_LEN - 7, 1);
    uint64_t result = len * P64_1;
    for (int i = 0; i < 4; i++)
        result += fold128(acc[2 * i] ^ rd64(SECRET + 11 + 16 * i),
                          acc[2 * i + 1] ^ rd64(SECRET + 11 + 16 * i + 8));
    return avalanche(result);
}

uint64_t xxh3_64(const void *data, size_t len) {
    const uint8_t *in = (const uint8_t *)data;
    if (len <= 16) return hash_0to16(in, len);
    if (len <= 128) return hash_17to128(in, len);
    if (len <= 240) return hash_129to240(in, len);
    return hash_long(in, len);
}
