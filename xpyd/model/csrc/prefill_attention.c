/* Prefill attention on the CPU, bfloat16 in and out: the new tokens of a prompt [start, start + n) attend over
 * the prompt's keys [0, start + n) causally, products by AVX512-BF16 dot products (vdpbf16ps), softmax in float32.
 *
 * Why: torch's CPU flash attention computes this at a fraction of the rate its bfloat16 GEMMs reach on the same
 * cores (measured on an AMD EPYC with AVX512-BF16: ~70 GFLOP/s a thread against ~480 for a bfloat16 linear), and
 * attention is most of a long prompt's prefill. Here Q K^T and P V are both bfloat16 dot products with float32
 * accumulation, as the GEMMs are.
 *
 * Layout. Keys and values come in two parts: the prefix [0, start) (a cached prefix or earlier chunks, gathered
 * from the paged pool by the caller) and the new tokens [start, start + n); each part is addressed by a token
 * stride and a head stride (elements), so any layout the caller holds is read in place. They are first packed
 * per KV head for the dot products: K as 16-key tiles of bfloat16 pairs along head_dim (tile[p][j] = the pair
 * p of key j), V as pairs of consecutive keys per element (v[2t][d], v[2t + 1][d]), zero past the last key.
 *
 * Work items are (query head, 8 consecutive new tokens), spread over OpenMP threads. For each item the keys are
 * visited in blocks of 128 at absolute positions [128b, 128b + 128), in order from position 0, with the online
 * softmax (running max m, running sum l, output rescaled when m grows); keys after a query's own position
 * are masked. A query's arithmetic depends on its position, its q and the keys only: never on where the chunk
 * it arrived in starts or how many queries share its call, so a prompt computed whole or in any chunks gives
 * the same bits for every token.
 *
 * Numbers: scores are exact products summed in float32 (a bfloat16 times a bfloat16 fits float32's mantissa),
 * the softmax weights are rounded to bfloat16 for the P V products (as torch's bfloat16 flash attention
 * does), the running sum uses them unrounded, the output is rounded once to bfloat16.
 *
 * Built only where the compiler targets AVX512-BF16 (-march=native on such a CPU); elsewhere
 * xpyd_prefill_attention_supported() is 0 and the caller keeps torch's attention.
 */
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "bf16.h"

#define XPYD_PREFILL_ABI 2 /* 2: the prefix read in place from the paged pool (a block table) */
#define XPYD_PREFILL_MAX_HEAD_DIM 256
#define QROWS 8   /* queries per work item */
#define KBLOCK 128 /* keys per softmax step (a multiple of 32: pairs of 16-key tiles) */

/* The entry's parameters (one list for both builds; see xpyd_prefill_attention_bf16 below). */
#define PREFILL_ARGS                                                                                             \
    const uint16_t *q, int64_t q_tok, int64_t q_head, const uint16_t *k_pre, int64_t kp_tok, int64_t kp_head,   \
        const uint16_t *v_pre, int64_t vp_tok, int64_t vp_head, const uint16_t *k_new, int64_t kn_tok,           \
        int64_t kn_head, const uint16_t *v_new, int64_t vn_tok, int64_t vn_head, int64_t start, int64_t n,       \
        int heads, int kv_heads, int hd, float scale, uint16_t *out, int64_t out_tok, int64_t out_head,          \
        int threads, const int64_t *table, int64_t block_size, int64_t block_stride

int xpyd_prefill_abi_version(void) { return XPYD_PREFILL_ABI; }

#if defined(__AVX512F__) && defined(__AVX512BF16__) && defined(__AVX512BW__)
#include <immintrin.h>

int xpyd_prefill_attention_supported(void) { return 1; }

/* e^x for x <= 0 (scores minus their running max), float32, within ~2 ulp: Cephes' expf polynomial. */
static inline __m512 exp_neg(__m512 x) {
    x = _mm512_max_ps(x, _mm512_set1_ps(-87.0f));
    __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
    __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
    r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
    __m512 p = _mm512_set1_ps(1.9875691500e-4f);
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
    p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.0f)));
    return _mm512_scalef_ps(p, n);
}

/* One key part's rows: token t of KV head g at base + t * tok + g * head, or, paged (table not NULL), at
   base + table[t / block_size] * block_stride + (t % block_size) * tok + g * head (the pool's block of t). */
typedef struct {
    const uint16_t *base;
    int64_t tok, head;
    const int64_t *table;
    int64_t block_size, block_stride;
} Part;

static inline const uint16_t *part_row(const Part *part, int64_t t, int g) {
    if (part->table)
        return part->base + part->table[t / part->block_size] * part->block_stride + (t % part->block_size) * part->tok +
               g * part->head;
    return part->base + t * part->tok + g * part->head;
}

static inline const uint16_t *row_of(const Part *prefix, const Part *fresh, int64_t start, int64_t pos, int g) {
    return pos < start ? part_row(prefix, pos, g) : part_row(fresh, pos - start, g);
}

/* K of KV head g into 16-key tiles: kt[(tile * hd/2 + p) * 16 + j] = pair p of key 16 tile + j (0 past L). */
static void pack_k(uint32_t *kt, const Part *kp, const Part *kn, int64_t start, int64_t length, int64_t tiles,
                   int g, int hd) {
    int pairs = hd / 2;
    for (int64_t tile = 0; tile < tiles; tile++) {
        uint32_t *dst = kt + tile * pairs * 16;
        for (int j = 0; j < 16; j++) {
            int64_t pos = tile * 16 + j;
            if (pos >= length) {
                for (int p = 0; p < pairs; p++) dst[p * 16 + j] = 0;
                continue;
            }
            const uint16_t *src = row_of(kp, kn, start, pos, g);
            for (int p = 0; p < pairs; p++) {
                uint32_t w;
                memcpy(&w, src + 2 * p, sizeof w);
                dst[p * 16 + j] = w;
            }
        }
    }
}

/* V of KV head g as key pairs: vp[t * hd + d] = (v[2t][d], v[2t + 1][d]) (0 past L). */
static void pack_v(uint32_t *vp, const Part *vpre, const Part *vnew, int64_t start, int64_t length, int64_t key_pairs,
                   int g, int hd) {
    for (int64_t t = 0; t < key_pairs; t++) {
        int64_t a = 2 * t, b = 2 * t + 1;
        const uint16_t *ra = a < length ? row_of(vpre, vnew, start, a, g) : NULL;
        const uint16_t *rb = b < length ? row_of(vpre, vnew, start, b, g) : NULL;
        uint32_t *dst = vp + t * hd;
        for (int d = 0; d < hd; d++)
            dst[d] = (uint32_t)(ra ? ra[d] : 0) | ((uint32_t)(rb ? rb[d] : 0) << 16);
    }
}

/* Queries i0 .. i0 + rows - 1 of head h (KV head g): the online softmax over key blocks [0, last block]. */
static void attend_rows(const uint16_t *q, int64_t q_tok, int64_t q_head, const uint32_t *kt, const uint32_t *vp,
                        int64_t start, int64_t i0, int rows, int h, int hd, float scale, uint16_t *out,
                        int64_t out_tok, int64_t out_head) {
    int pairs = hd / 2, vecs = hd / 16;
    uint32_t qw[QROWS][XPYD_PREFILL_MAX_HEAD_DIM / 2];
    float acc_o[QROWS][XPYD_PREFILL_MAX_HEAD_DIM] __attribute__((aligned(64)));
    float sc[QROWS][KBLOCK] __attribute__((aligned(64)));    /* a block's scaled scores */
    uint16_t pb[QROWS][KBLOCK] __attribute__((aligned(64))); /* its softmax weights, bfloat16 */
    float m[QROWS], l[QROWS];
    int64_t pos[QROWS];
    for (int r = 0; r < QROWS; r++) {
        int src = r < rows ? r : rows - 1; /* (rows past the last query repeat it; never stored) */
        memcpy(qw[r], q + (i0 + src) * q_tok + (int64_t)h * q_head, (size_t)hd * 2);
        pos[r] = start + i0 + src;
        m[r] = -INFINITY;
        l[r] = 0.0f;
        memset(acc_o[r], 0, (size_t)hd * sizeof(float));
    }
    int64_t last = pos[QROWS - 1]; /* the largest position among the rows */
    int64_t blocks = last / KBLOCK + 1;
    const __m512i lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    const __m512 vscale = _mm512_set1_ps(scale);
    for (int64_t b = 0; b < blocks; b++) {
        /* Q K^T, 32 keys (two 16-key tiles) at a time: 8 rows x 2 tiles of float32 accumulators */
        for (int c = 0; c < KBLOCK / 32 && b * KBLOCK + 32 * c <= last; c++) { /* (later keys: masked below) */
            const uint32_t *t0 = kt + (2 * (b * (KBLOCK / 32) + c)) * pairs * 16, *t1 = t0 + pairs * 16;
            __m512 s[QROWS][2];
            for (int r = 0; r < QROWS; r++) s[r][0] = s[r][1] = _mm512_setzero_ps();
            for (int p = 0; p < pairs; p++) {
                __m512bh k0 = (__m512bh)_mm512_loadu_si512(t0 + p * 16);
                __m512bh k1 = (__m512bh)_mm512_loadu_si512(t1 + p * 16);
                for (int r = 0; r < QROWS; r++) {
                    __m512bh qb = (__m512bh)_mm512_set1_epi32((int)qw[r][p]);
                    s[r][0] = _mm512_dpbf16_ps(s[r][0], qb, k0);
                    s[r][1] = _mm512_dpbf16_ps(s[r][1], qb, k1);
                }
            }
            for (int r = 0; r < QROWS; r++) {
                _mm512_store_ps(sc[r] + 32 * c, _mm512_mul_ps(s[r][0], vscale));
                _mm512_store_ps(sc[r] + 32 * c + 16, _mm512_mul_ps(s[r][1], vscale));
            }
        }
        /* the online softmax, once per block of KBLOCK keys; keys after a row's position weigh exactly 0 */
        int64_t first_key = b * KBLOCK;
        for (int r = 0; r < QROWS; r++) {
            if (first_key > pos[r]) { /* (every key of the block after this query: nothing to add) */
                memset(pb[r], 0, sizeof pb[r]);
                continue;
            }
            __m512i mine = _mm512_set1_epi32((int)(pos[r] - first_key));
            __mmask16 vis[KBLOCK / 16];
            __m512 top = _mm512_set1_ps(-INFINITY);
            for (int v = 0; v < KBLOCK / 16; v++) {
                vis[v] = _mm512_cmple_epi32_mask(_mm512_add_epi32(lane, _mm512_set1_epi32(16 * v)), mine);
                top = _mm512_mask_max_ps(top, vis[v], top, _mm512_load_ps(sc[r] + 16 * v));
            }
            float bmax = _mm512_reduce_max_ps(top);
            float m_new = bmax > m[r] ? bmax : m[r];
            float alpha = m[r] == -INFINITY ? 0.0f : expf(m[r] - m_new);
            __m512 mm = _mm512_set1_ps(m_new), sum = _mm512_setzero_ps();
            for (int v = 0; v < KBLOCK / 16; v += 2) {
                __m512 p0 = _mm512_maskz_mov_ps(vis[v], exp_neg(_mm512_sub_ps(_mm512_load_ps(sc[r] + 16 * v), mm)));
                __m512 p1 = _mm512_maskz_mov_ps(vis[v + 1],
                                                exp_neg(_mm512_sub_ps(_mm512_load_ps(sc[r] + 16 * v + 16), mm)));
                sum = _mm512_add_ps(sum, _mm512_add_ps(p0, p1));
                _mm512_store_si512(pb[r] + 16 * v, (__m512i)_mm512_cvtne2ps_pbh(p1, p0));
            }
            l[r] = l[r] * alpha + _mm512_reduce_add_ps(sum);
            m[r] = m_new;
            if (alpha != 1.0f) {
                __m512 va = _mm512_set1_ps(alpha);
                for (int v = 0; v < vecs; v++)
                    _mm512_store_ps(acc_o[r] + 16 * v, _mm512_mul_ps(_mm512_load_ps(acc_o[r] + 16 * v), va));
            }
        }
        /* P V: the block's key pairs, 4 query rows x 4 vectors of head_dim at a time */
        const uint32_t *vb = vp + (b * KBLOCK / 2) * hd;
        int64_t pairs_here = (last - first_key) / 2 + 1; /* (key pairs past every row's position weigh 0: skipped) */
        if (pairs_here > KBLOCK / 2) pairs_here = KBLOCK / 2;
        for (int r0 = 0; r0 < QROWS; r0 += 4) {
            for (int d0 = 0; d0 < vecs; d0 += 4) {
                int nv = vecs - d0 < 4 ? vecs - d0 : 4;
                __m512 o[4][4];
                for (int r = 0; r < 4; r++)
                    for (int v = 0; v < nv; v++) o[r][v] = _mm512_load_ps(acc_o[r0 + r] + 16 * (d0 + v));
                for (int t = 0; t < pairs_here; t++) {
                    __m512bh vv[4];
                    for (int v = 0; v < nv; v++) vv[v] = (__m512bh)_mm512_loadu_si512(vb + t * hd + 16 * (d0 + v));
                    for (int r = 0; r < 4; r++) {
                        uint32_t w;
                        memcpy(&w, pb[r0 + r] + 2 * t, sizeof w);
                        __m512bh pw = (__m512bh)_mm512_set1_epi32((int)w);
                        for (int v = 0; v < nv; v++) o[r][v] = _mm512_dpbf16_ps(o[r][v], pw, vv[v]);
                    }
                }
                for (int r = 0; r < 4; r++)
                    for (int v = 0; v < nv; v++) _mm512_store_ps(acc_o[r0 + r] + 16 * (d0 + v), o[r][v]);
            }
        }
    }
    for (int r = 0; r < rows; r++) {
        float inv = 1.0f / l[r];
        uint16_t *dst = out + (i0 + r) * out_tok + (int64_t)h * out_head;
        for (int d = 0; d < hd; d++) dst[d] = f32_to_bf16(acc_o[r][d] * inv);
    }
}

/* q [n tokens, heads, hd] (q_tok, q_head strides), K/V prefix [start] and new [n] parts per KV head (token and
   head strides each; with `table`, the prefix is read in place from the paged pool: token t of it in block
   table[t / block_size], block_stride elements apart, its K and V bases the layer's planes in block 0), out
   [n, heads, hd] (out_tok, out_head). heads a multiple of kv_heads (query head h reads
   KV head h / (heads / kv_heads)); hd a multiple of 16, at most 256. Returns 0, or a negative code for arguments
   it refuses (nothing written) or memory it could not get. */
int xpyd_prefill_attention_bf16(PREFILL_ARGS) {
    if (n <= 0 || start < 0 || heads <= 0 || kv_heads <= 0 || heads % kv_heads != 0 || hd <= 0 || hd % 16 != 0 ||
        hd > XPYD_PREFILL_MAX_HEAD_DIM || threads <= 0 || start + n > (int64_t)1 << 30 ||
        (table && (block_size <= 0 || block_stride <= 0)))
        return -1;
    if (table)
        for (int64_t j = 0; j < (start + block_size - 1) / block_size; j++)
            if (table[j] < 0) return -1;
    int64_t length = start + n;
    int64_t blocks = (length + KBLOCK - 1) / KBLOCK;
    int64_t tiles = blocks * (KBLOCK / 16), key_pairs = blocks * KBLOCK / 2;
    size_t k_words = (size_t)tiles * (hd / 2) * 16, v_words = (size_t)key_pairs * hd;
    uint32_t *kt = aligned_alloc(64, ((k_words * kv_heads * 4 + 63) / 64) * 64);
    uint32_t *vp = aligned_alloc(64, ((v_words * kv_heads * 4 + 63) / 64) * 64);
    if (!kt || !vp) {
        free(kt);
        free(vp);
        return -2;
    }
    Part kp = {k_pre, kp_tok, kp_head, table, block_size, block_stride}, kn = {k_new, kn_tok, kn_head, NULL, 0, 0};
    Part vpre = {v_pre, vp_tok, vp_head, table, block_size, block_stride}, vnew = {v_new, vn_tok, vn_head, NULL, 0, 0};
#pragma omp parallel for num_threads(threads) schedule(static)
    for (int g = 0; g < 2 * kv_heads; g++) {
        if (g < kv_heads)
            pack_k(kt + (size_t)g * k_words, &kp, &kn, start, length, tiles, g, hd);
        else
            pack_v(vp + (size_t)(g - kv_heads) * v_words, &vpre, &vnew, start, length, key_pairs, g - kv_heads, hd);
    }
    int group = heads / kv_heads;
    int64_t qblocks = (n + QROWS - 1) / QROWS;
    int64_t items = qblocks * heads;
    /* One KV head's items after another (their packed K/V stay in each core's cache), and within a KV head the
       longest items first (the last query blocks: the most keys), so the dynamic schedule ends level. */
#pragma omp parallel for num_threads(threads) schedule(dynamic, 1)
    for (int64_t it = 0; it < items; it++) {
        int g = (int)(it / (qblocks * group));
        int64_t rest = it % (qblocks * group);
        int64_t qb = qblocks - 1 - rest / group;
        int h = g * group + (int)(rest % group);
        int64_t i0 = qb * QROWS;
        int rows = n - i0 < QROWS ? (int)(n - i0) : QROWS;
        attend_rows(q, q_tok, q_head, kt + (size_t)g * k_words, vp + (size_t)g * v_words, start, i0, rows, h, hd,
                    scale, out, out_tok, out_head);
    }
    free(kt);
    free(vp);
    return 0;
}

#else

int xpyd_prefill_attention_supported(void) { return 0; }

int xpyd_prefill_attention_bf16(PREFILL_ARGS) { return -3; }

#endif
