#include "sampler.h"

#include "alloc.h"

#include <math.h>
#include <stdlib.h>
#include <string.h>

void kr_sampling_default(struct kr_sampling *s)
{
    memset(s, 0, sizeof *s);
    s->temperature = 1.0f;
    s->top_k = 0;
    s->top_p = 1.0f;
    s->min_p = 0.0f;
    s->repetition_penalty = 1.0f;
    s->logprobs = -1;
    s->prompt_logprobs = -1;
    s->max_tokens = 16;
}

enum kr_status kr_sampling_validate(const struct kr_sampling *s, int64_t vocab, struct kr_err *err)
{
    if (!(s->temperature >= 0.0f) || !isfinite(s->temperature)) {
        kr_err_set(err, KR_ERR_INVAL, "temperature must be a finite number >= 0, got %g", s->temperature);
        return kr_err_param(err, KR_ERR_INVAL, "temperature");
    }
    if (!(s->top_p > 0.0f && s->top_p <= 1.0f)) {
        kr_err_set(err, KR_ERR_INVAL, "top_p must be in (0, 1], got %g", s->top_p);
        return kr_err_param(err, KR_ERR_INVAL, "top_p");
    }
    if (!(s->min_p >= 0.0f && s->min_p <= 1.0f)) {
        kr_err_set(err, KR_ERR_INVAL, "min_p must be in [0, 1], got %g", s->min_p);
        return kr_err_param(err, KR_ERR_INVAL, "min_p");
    }
    if (s->top_k < -1) {
        kr_err_set(err, KR_ERR_INVAL, "top_k must be -1, 0 (off) or positive, got %d", s->top_k);
        return kr_err_param(err, KR_ERR_INVAL, "top_k");
    }
    if (!(s->presence_penalty >= -2.0f && s->presence_penalty <= 2.0f)) {
        kr_err_set(err, KR_ERR_INVAL, "presence_penalty must be in [-2, 2], got %g", s->presence_penalty);
        return kr_err_param(err, KR_ERR_INVAL, "presence_penalty");
    }
    if (!(s->frequency_penalty >= -2.0f && s->frequency_penalty <= 2.0f)) {
        kr_err_set(err, KR_ERR_INVAL, "frequency_penalty must be in [-2, 2], got %g", s->frequency_penalty);
        return kr_err_param(err, KR_ERR_INVAL, "frequency_penalty");
    }
    if (!(s->repetition_penalty > 0.0f) || !isfinite(s->repetition_penalty)) {
        kr_err_set(err, KR_ERR_INVAL, "repetition_penalty must be a finite number > 0, got %g",
                   s->repetition_penalty);
        return kr_err_param(err, KR_ERR_INVAL, "repetition_penalty");
    }
    if (s->logprobs < -1 || s->logprobs > KR_MAX_TOP_LOGPROBS) {
        kr_err_set(err, KR_ERR_INVAL, "logprobs must be between 0 and %d, got %d", KR_MAX_TOP_LOGPROBS,
                   s->logprobs);
        return kr_err_param(err, KR_ERR_INVAL, "logprobs");
    }
    if (s->prompt_logprobs < -1 || s->prompt_logprobs > KR_MAX_TOP_LOGPROBS) {
        kr_err_set(err, KR_ERR_INVAL, "prompt_logprobs must be between 0 and %d, got %d", KR_MAX_TOP_LOGPROBS,
                   s->prompt_logprobs);
        return kr_err_param(err, KR_ERR_INVAL, "prompt_logprobs");
    }
    if (s->max_tokens < 1) {
        kr_err_set(err, KR_ERR_INVAL, "max_tokens must be at least 1, got %d", s->max_tokens);
        return kr_err_param(err, KR_ERR_INVAL, "max_tokens");
    }
    if (s->min_tokens < 0 || s->min_tokens > s->max_tokens) {
        kr_err_set(err, KR_ERR_INVAL, "min_tokens must be between 0 and max_tokens (%d), got %d", s->max_tokens,
                   s->min_tokens);
        return kr_err_param(err, KR_ERR_INVAL, "min_tokens");
    }
    if (s->n_stop_ids < 0 || s->n_stop_ids > KR_MAX_STOP_IDS) {
        kr_err_set(err, KR_ERR_INVAL, "at most %d stop_token_ids are allowed", KR_MAX_STOP_IDS);
        return kr_err_param(err, KR_ERR_INVAL, "stop_token_ids");
    }
    for (int32_t i = 0; i < s->n_stop_ids; i++) {
        if (s->stop_ids[i] < 0 || s->stop_ids[i] >= vocab) {
            kr_err_set(err, KR_ERR_INVAL, "stop_token_ids[%d] = %d is outside the vocabulary [0, %lld)", i,
                              s->stop_ids[i], (long long)vocab);
            return kr_err_param(err, KR_ERR_INVAL, "stop_token_ids");
        }
    }
    if (s->n_bias < 0 || s->n_bias > KR_MAX_LOGIT_BIAS) {
        kr_err_set(err, KR_ERR_INVAL, "logit_bias accepts at most %d tokens", KR_MAX_LOGIT_BIAS);
        return kr_err_param(err, KR_ERR_INVAL, "logit_bias");
    }
    for (int32_t i = 0; i < s->n_bias; i++) {
        if (s->bias_ids[i] < 0 || s->bias_ids[i] >= vocab) {
            kr_err_set(err, KR_ERR_INVAL, "logit_bias: token %d is outside the vocabulary [0, %lld)",
                              s->bias_ids[i], (long long)vocab);
            return kr_err_param(err, KR_ERR_INVAL, "logit_bias");
        }
        if (!(s->bias[i] >= -100.0f && s->bias[i] <= 100.0f)) {
            kr_err_set(err, KR_ERR_INVAL, "logit_bias: the bias of token %d must be in [-100, 100], got %g",
                              s->bias_ids[i], s->bias[i]);
            return kr_err_param(err, KR_ERR_INVAL, "logit_bias");
        }
    }
    return KR_OK;
}

/* ---- generator ----------------------------------------------------------------------------- */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

void kr_rng_seed(struct kr_rng *r, uint64_t seed)
{
    for (int i = 0; i < 4; i++) {
        r->s[i] = splitmix64(&seed);
    }
}

static uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

double kr_rng_uniform(struct kr_rng *r)
{
    uint64_t *s = r->s;
    const uint64_t result = rotl(s[1] * 5, 7) * 9;
    const uint64_t t = s[1] << 17;
    s[2] ^= s[0];
    s[3] ^= s[1];
    s[1] ^= s[2];
    s[0] ^= s[3];
    s[2] ^= t;
    s[3] = rotl(s[3], 45);
    return (double)(result >> 11) * 0x1.0p-53;
}

/* ---- token counts ---------------------------------------------------------------------------- */

void kr_token_counts_init(struct kr_token_counts *c)
{
    memset(c, 0, sizeof *c);
}

void kr_token_counts_free(struct kr_token_counts *c)
{
    kr_free(c->ids);
    kr_free(c->n_out);
    kr_free(c->in_prompt);
    memset(c, 0, sizeof *c);
}

static uint32_t hash_id(int32_t id)
{
    uint32_t h = (uint32_t)id * 2654435761u;
    return h ^ (h >> 16);
}

/* Slot of `id` or of the empty cell where it would go. */
static int32_t find_slot(const struct kr_token_counts *c, int32_t id)
{
    uint32_t mask = (uint32_t)c->cap - 1, i = hash_id(id) & mask;
    while (c->ids[i] != -1 && c->ids[i] != id) {
        i = (i + 1) & mask;
    }
    return (int32_t)i;
}

static enum kr_status grow(struct kr_token_counts *c)
{
    struct kr_token_counts n = {0};
    n.cap = c->cap ? 2 * c->cap : 64;
    n.ids = kr_malloc((size_t)n.cap * sizeof(int32_t));
    n.n_out = kr_calloc((size_t)n.cap, sizeof(int32_t));
    n.in_prompt = kr_calloc((size_t)n.cap, 1);
    if (!n.ids || !n.n_out || !n.in_prompt) {
        kr_token_counts_free(&n);
        return KR_ERR_NOMEM;
    }
    memset(n.ids, 0xff, (size_t)n.cap * sizeof(int32_t));
    for (int32_t i = 0; i < c->cap; i++) {
        if (c->ids[i] != -1) {
            int32_t j = find_slot(&n, c->ids[i]);
            n.ids[j] = c->ids[i];
            n.n_out[j] = c->n_out[i];
            n.in_prompt[j] = c->in_prompt[i];
            n.used++;
        }
    }
    kr_token_counts_free(c);
    *c = n;
    return KR_OK;
}

enum kr_status kr_token_counts_add(struct kr_token_counts *c, int32_t id, bool prompt)
{
    if (2 * (c->used + 1) > c->cap) {
        enum kr_status st = grow(c);
        if (st != KR_OK) {
            return st;
        }
    }
    int32_t i = find_slot(c, id);
    if (c->ids[i] == -1) {
        c->ids[i] = id;
        c->used++;
    }
    if (prompt) {
        c->in_prompt[i] = 1;
    } else {
        c->n_out[i]++;
    }
    return KR_OK;
}

enum kr_status kr_token_counts_copy(struct kr_token_counts *dst, const struct kr_token_counts *src)
{
    kr_token_counts_init(dst);
    if (!src->cap) {
        return KR_OK;
    }
    dst->cap = src->cap;
    dst->used = src->used;
    dst->ids = kr_malloc((size_t)src->cap * sizeof(int32_t));
    dst->n_out = kr_malloc((size_t)src->cap * sizeof(int32_t));
    dst->in_prompt = kr_malloc((size_t)src->cap);
    if (!dst->ids || !dst->n_out || !dst->in_prompt) {
        kr_token_counts_free(dst);
        return KR_ERR_NOMEM;
    }
    memcpy(dst->ids, src->ids, (size_t)src->cap * sizeof(int32_t));
    memcpy(dst->n_out, src->n_out, (size_t)src->cap * sizeof(int32_t));
    memcpy(dst->in_prompt, src->in_prompt, (size_t)src->cap);
    return KR_OK;
}

/* ---- sampling ----------------------------------------------------------------------------------- */

void kr_sampler_scratch_free(struct kr_sampler_scratch *s)
{
    kr_free(s->v);
    kr_free(s->order);
    kr_free(s->tmp);
    kr_free(s->bmass);
    kr_free(s->bwmin);
    kr_free(s->bcount);
    memset(s, 0, sizeof *s);
}

void kr_log_softmax(const float *logits, float *lp, int64_t vocab)
{
    float mx = -INFINITY;
    for (int64_t i = 0; i < vocab; i++) {
        mx = logits[i] > mx ? logits[i] : mx;
    }
    double sum = 0.0;
    for (int64_t i = 0; i < vocab; i++) {
        sum += exp((double)logits[i] - mx);
    }
    const float lse = (float)(mx + log(sum));
    for (int64_t i = 0; i < vocab; i++) {
        lp[i] = logits[i] - lse;
    }
}

void kr_log_softmax_masked(const float *logits, const uint32_t *mask, float *lp, int64_t vocab)
{
    if (!mask) {
        kr_log_softmax(logits, lp, vocab);
        return;
    }
    float mx = -INFINITY;
    for (int64_t i = 0; i < vocab; i++) {
        if (kr_mask_allows(mask, i) && logits[i] > mx) {
            mx = logits[i];
        }
    }
    double sum = 0.0;
    for (int64_t i = 0; i < vocab; i++) {
        if (kr_mask_allows(mask, i)) {
            sum += exp((double)logits[i] - mx);
        }
    }
    const float lse = (float)(mx + log(sum));
    for (int64_t i = 0; i < vocab; i++) {
        lp[i] = kr_mask_allows(mask, i) ? logits[i] - lse : -INFINITY;
    }
}

void kr_top_k_ids(const float *lp, int64_t vocab, int32_t k, int32_t *ids)
{
    int32_t n = 0;
    for (int64_t v = 0; v < vocab && k > 0; v++) {
        int32_t j;
        if (n < k) {
            j = n++;
        } else if (lp[v] > lp[ids[k - 1]]) {
            j = k - 1;
        } else {
            continue;
        }
        ids[j] = (int32_t)v;
        while (j > 0 && lp[ids[j]] > lp[ids[j - 1]]) { /* strict: equal values keep the lower id first */
            int32_t t = ids[j];
            ids[j] = ids[j - 1];
            ids[j - 1] = t;
            j--;
        }
    }
}

/* Candidates are 64-bit keys whose ascending order is the sampling order: the high half is the
 * logit mapped to an unsigned integer in descending order (-0 as +0), the low half the token id, so
 * that ties go to the lower id and every comparison, selection and sort is on plain integers. */
static inline uint64_t cand_key(float v, int32_t id)
{
    if (v == 0.0f) {
        v = 0.0f;
    }
    uint32_t u;
    memcpy(&u, &v, sizeof u);
    u = (u & 0x80000000u) ? ~u : (u | 0x80000000u); /* ascending in v */
    return (uint64_t)~u << 32 | (uint32_t)id;
}

static inline float cand_v(uint64_t k)
{
    uint32_t u = ~(uint32_t)(k >> 32);
    u = (u & 0x80000000u) ? (u & 0x7fffffffu) : ~u;
    float v;
    memcpy(&v, &u, sizeof v);
    return v;
}

static inline int32_t cand_id(uint64_t k)
{
    return (int32_t)(uint32_t)k;
}

static int cmp_u64(const void *a, const void *b)
{
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static inline void key_swap(uint64_t *a, uint64_t *b)
{
    const uint64_t t = *a;
    *a = *b;
    *b = t;
}

/* Rearranges c[lo..hi) so that c[lo..k) holds the elements that come first in the sampling order
 * (in any order) and c[k..hi) the rest (quickselect, median of three). lo < k < hi. */
static void select_first(uint64_t *c, int64_t lo, int64_t hi, int64_t k)
{
    while (hi - lo > 16) {
        const int64_t mid = lo + (hi - lo) / 2;
        if (c[hi - 1] < c[lo]) {
            key_swap(&c[hi - 1], &c[lo]);
        }
        if (c[mid] < c[lo]) {
            key_swap(&c[mid], &c[lo]);
        }
        if (c[hi - 1] < c[mid]) {
            key_swap(&c[hi - 1], &c[mid]);
        }
        const uint64_t pivot = c[mid];
        int64_t i = lo, j = hi - 1;
        while (i <= j) {
            while (c[i] < pivot) {
                i++;
            }
            while (pivot < c[j]) {
                j--;
            }
            if (i <= j) {
                key_swap(&c[i], &c[j]);
                i++;
                j--;
            }
        }
        /* now c[lo..j] come no later than the pivot, c[i..hi) no earlier */
        if (k <= j + 1) {
            hi = j + 1;
        } else if (k >= i) {
            lo = i;
        } else {
            return; /* c[j+1..i) equal the pivot: the split at k holds */
        }
    }
    qsort(c + lo, (size_t)(hi - lo), sizeof *c, cmp_u64);
}

#define RADIX_BITS 11
#define RADIX_DIGITS 6 /* 6 x 11 bits cover the 64-bit key */

/* Sorts c[0..n) ascending: qsort for a few, else an LSD radix sort through tmp[n] that skips the
 * digits every key shares (the high bits of the ids, and of logits in a narrow range), so that a
 * deep walk over a flat distribution (temperature 1 over a whole vocabulary) costs a few linear
 * passes instead of a comparison sort. */
static void sort_keys(uint64_t *c, uint64_t *tmp, int64_t n)
{
    if (n < 2048 || !tmp) {
        qsort(c, (size_t)n, sizeof *c, cmp_u64);
        return;
    }
    static _Thread_local uint32_t count[RADIX_DIGITS][1 << RADIX_BITS];
    memset(count, 0, sizeof count);
    for (int64_t i = 0; i < n; i++) {
        const uint64_t k = c[i];
        for (int d = 0; d < RADIX_DIGITS; d++) {
            count[d][k >> (d * RADIX_BITS) & ((1u << RADIX_BITS) - 1)]++;
        }
    }
    uint64_t *src = c, *dst = tmp;
    for (int d = 0; d < RADIX_DIGITS; d++) {
        uint32_t *cnt = count[d];
        uint32_t at = 0;
        bool uniform = false;
        for (int x = 0; x < 1 << RADIX_BITS; x++) {
            if (cnt[x] == (uint32_t)n) {
                uniform = true;
                break;
            }
            const uint32_t m = cnt[x];
            cnt[x] = at;
            at += m;
        }
        if (uniform) {
            continue; /* every key has this digit: the pass would change nothing */
        }
        const int shift = d * RADIX_BITS;
        for (int64_t i = 0; i < n; i++) {
            dst[cnt[src[i] >> shift & ((1u << RADIX_BITS) - 1)]++] = src[i];
        }
        uint64_t *t = src;
        src = dst;
        dst = t;
    }
    if (src != c) {
        memcpy(c, src, (size_t)n * sizeof *c);
    }
}

static enum kr_status scratch_reserve(struct kr_sampler_scratch *sc, int64_t vocab)
{
    if (sc->cap < vocab) {
        kr_sampler_scratch_free(sc);
        sc->v = kr_malloc((size_t)vocab * sizeof(float));
        sc->order = kr_malloc((size_t)vocab * sizeof *sc->order);
        sc->tmp = kr_malloc(2 * (size_t)vocab * sizeof *sc->tmp); /* a bucket, and the radix sort's buffer */
        sc->bmass = kr_malloc(KR_SAMPLER_BUCKETS * sizeof *sc->bmass);
        sc->bwmin = kr_malloc(KR_SAMPLER_BUCKETS * sizeof *sc->bwmin);
        sc->bcount = kr_malloc(KR_SAMPLER_BUCKETS * sizeof *sc->bcount);
        if (!sc->v || !sc->order || !sc->tmp || !sc->bmass || !sc->bwmin || !sc->bcount) {
            kr_sampler_scratch_free(sc);
            return KR_ERR_NOMEM;
        }
        sc->cap = vocab;
    }
    return KR_OK;
}

/* A draw's walk over the sampling order, bucket by bucket (select_token). */
struct walk {
    struct kr_sampler_scratch *sc;
    int64_t keep;    /* candidates: sc->order[0..keep) */
    float inv_t, mx; /* 1 / temperature, the top logit / temperature */
    float top;       /* the top logit */
    double scale;    /* buckets per unit of logit below the top */
    int nb;          /* buckets */
    int cur;         /* the bucket whose tokens sc->tmp holds, sorted (-1: none) */
    int64_t m;       /* their number */
};

/* A logit's bucket: 0 for the top logit, growing as the logit falls (never decreasing, so that the
 * buckets in order hold the sampling order's consecutive runs). */
static inline int bucket_of(const struct walk *w, float v)
{
    const double x = ((double)w->top - (double)v) * w->scale;
    if (!(x >= 1.0)) { /* the top bucket, and NaN when the range is not finite */
        return 0;
    }
    return x >= (double)(w->nb - 1) ? w->nb - 1 : (int)x;
}

/* Gathers bucket b's tokens into sc->tmp, sorted into the sampling order; returns their number. */
static int64_t open_bucket(struct walk *w, int b)
{
    if (w->cur == b) {
        return w->m;
    }
    struct kr_sampler_scratch *sc = w->sc;
    int64_t m = 0;
    for (int64_t i = 0; i < w->keep; i++) {
        if (bucket_of(w, cand_v(sc->order[i])) == b) {
            sc->tmp[m++] = sc->order[i];
        }
    }
    sort_keys(sc->tmp, sc->tmp + sc->cap, m);
    w->cur = b;
    w->m = m;
    return m;
}

/* The unnormalized probability of the open bucket's j-th token (as the mass pass computed it). */
static inline double walk_w(const struct walk *w, int64_t j)
{
    return exp((double)cand_v(w->sc->tmp[j]) * w->inv_t - w->mx);
}

/* The selection on processed logits v (penalties and masks applied): greedy, or temperature,
 * top-k, top-p, min-p and a draw. The draw is taken from `rng` when given (exactly once, and only
 * when something can be drawn), else `u` is used. */
static enum kr_status select_token(float temperature, int32_t top_k, float top_p, float min_p, const float *v,
                                   int64_t vocab, struct kr_sampler_scratch *sc, struct kr_rng *rng, double u01,
                                   int32_t *out)
{
    if (temperature == 0.0f) { /* NaN counts as -inf (a bad row must not pin the argmax to id 0) */
        int64_t best = 0;
        float bv = isnan(v[0]) ? -INFINITY : v[0];
        for (int64_t i = 1; i < vocab; i++) {
            if (v[i] > bv) {
                best = i;
                bv = v[i];
            }
        }
        *out = (int32_t)best;
        return KR_OK;
    }
    /* the candidates: every finite logit (NaN counts as -inf, as in the greedy draw) */
    int64_t n = 0;
    for (int64_t i = 0; i < vocab; i++) {
        if (v[i] != -INFINITY && !isnan(v[i])) {
            sc->order[n++] = cand_key(v[i], (int32_t)i);
        }
    }
    if (n == 0) {
        *out = 0;
        return KR_ERR_INTERNAL;
    }
    int64_t keep = n;
    if (top_k > 0 && top_k < keep) {
        keep = top_k;
        select_first(sc->order, 0, n, keep); /* order[0..keep) holds the top k, unsorted */
    }
    /* The sampling order (descending logit, lower id first) is walked through buckets of logit
     * ranges: one pass gives each bucket its probability mass, and only the bucket where a cut or
     * the draw lands is sorted. A flat distribution (temperature 1 over a whole vocabulary, where
     * the draw lands deep) costs a few linear passes instead of a sort of the vocabulary. */
    struct walk w = {.sc = sc, .keep = keep, .inv_t = 1.0f / temperature, .cur = -1};
    uint64_t kmin = UINT64_MAX, kmax = 0;
    for (int64_t i = 0; i < keep; i++) {
        kmin = sc->order[i] < kmin ? sc->order[i] : kmin;
        kmax = sc->order[i] > kmax ? sc->order[i] : kmax;
    }
    w.top = cand_v(kmin);
    w.mx = w.top * w.inv_t;
    w.nb = keep < 4 * KR_SAMPLER_BUCKETS ? (int)(keep / 4) + 1 : KR_SAMPLER_BUCKETS;
    const double range = (double)w.top - (double)cand_v(kmax);
    w.scale = range > 0 && isfinite(range) ? w.nb / range : 0.0;
    memset(sc->bmass, 0, (size_t)w.nb * sizeof *sc->bmass);
    memset(sc->bcount, 0, (size_t)w.nb * sizeof *sc->bcount);
    for (int b = 0; b < w.nb; b++) {
        sc->bwmin[b] = INFINITY;
    }
    double total = 0.0;
    for (int64_t i = 0; i < keep; i++) {
        const float vi = cand_v(sc->order[i]);
        const double e = exp((double)vi * w.inv_t - w.mx);
        const int b = bucket_of(&w, vi);
        total += e;
        sc->bmass[b] += e;
        sc->bcount[b]++;
        sc->bwmin[b] = e < sc->bwmin[b] ? e : sc->bwmin[b];
    }
    /* what is kept: the first lim_c tokens of bucket lim_b and every token of the buckets before it */
    int lim_b = w.nb;
    int64_t lim_c = 0;
    bool cut = false;
    if (top_p < 1.0f) { /* smallest prefix whose probability reaches top_p */
        const double target = (double)top_p * total;
        double cum = 0.0;
        int b = 0;
        while (b < w.nb && (sc->bcount[b] == 0 || cum + sc->bmass[b] < target)) {
            cum += sc->bmass[b++];
        }
        if (b < w.nb) {
            const int64_t m = open_bucket(&w, b);
            int64_t j = 0;
            while (j < m) {
                cum += walk_w(&w, j++);
                if (cum >= target) {
                    break;
                }
            }
            lim_b = b;
            lim_c = j;
            cut = true;
        }
    }
    if (min_p > 0.0f) { /* drop tokens below min_p times the top probability (top is exp(0) = 1) */
        int b = 0;
        while (b < w.nb && b <= lim_b && (sc->bcount[b] == 0 || sc->bwmin[b] >= min_p)) {
            b++;
        }
        if (b < w.nb && b <= lim_b) {
            const int64_t m = open_bucket(&w, b);
            int64_t j = b == 0 ? 1 : 0; /* the top token always stays */
            while (j < m && walk_w(&w, j) >= min_p) {
                j++;
            }
            if (b < lim_b || j < lim_c) {
                lim_b = b;
                lim_c = j;
                cut = true;
            }
        }
    }
    if (cut) { /* the kept tokens' mass */
        total = 0.0;
        for (int b = 0; b < lim_b; b++) {
            total += sc->bmass[b];
        }
        if (lim_b < w.nb) {
            open_bucket(&w, lim_b);
            for (int64_t j = 0; j < lim_c; j++) {
                total += walk_w(&w, j);
            }
        }
    }
    const double u = (rng ? kr_rng_uniform(rng) : u01) * total;
    double cum = 0.0;
    int last_b = -1;
    for (int b = 0; b < w.nb && (b < lim_b || (b == lim_b && lim_c > 0)); b++) {
        if (sc->bcount[b] == 0) {
            continue;
        }
        last_b = b;
        if (b < lim_b && cum + sc->bmass[b] <= u) {
            cum += sc->bmass[b];
            continue;
        }
        const int64_t m = open_bucket(&w, b);
        const int64_t lim = b == lim_b ? lim_c : m;
        for (int64_t j = 0; j < lim; j++) {
            cum += walk_w(&w, j);
            if (u < cum) {
                *out = cand_id(sc->tmp[j]);
                return KR_OK;
            }
        }
    }
    /* u at the very end of the mass (rounding): the last kept token */
    const int64_t m = open_bucket(&w, last_b);
    *out = cand_id(sc->tmp[(last_b == lim_b ? lim_c : m) - 1]);
    return KR_OK;
}

/* Copies the row into v with the tokens the mask leaves out at -inf, a word (32 ids) at a time:
 * a whole word of allowed tokens is copied and a whole masked word filled without looking at its
 * bits (both loops vectorize), so that a grammar's mask, mostly such words, costs about what the
 * plain copy costs. */
static void copy_masked(float *v, const float *logits, const uint32_t *mask, int64_t vocab)
{
    if (!mask) {
        memcpy(v, logits, (size_t)vocab * sizeof(float));
        return;
    }
    for (int64_t w = 0; w * 32 < vocab; w++) {
        const uint32_t m = mask[w];
        const int64_t i0 = w * 32, n = i0 + 32 < vocab ? 32 : vocab - i0;
        if (m == 0xffffffffu) {
            memcpy(v + i0, logits + i0, (size_t)n * sizeof(float));
        } else if (m == 0) {
            for (int64_t i = 0; i < n; i++) {
                v[i0 + i] = -INFINITY;
            }
        } else {
            for (int64_t i = 0; i < n; i++) {
                v[i0 + i] = (m >> i) & 1u ? logits[i0 + i] : -INFINITY;
            }
        }
    }
}

/* One token's penalties, in the order kr_sample applies them. */
static void penalise(float *v, int32_t id, bool in_prompt, int32_t n_out, float repetition, float frequency,
                     float presence)
{
    if (repetition != 1.0f && (in_prompt || n_out)) {
        v[id] = v[id] > 0 ? v[id] / repetition : v[id] * repetition;
    }
    if (n_out) {
        v[id] -= frequency * (float)n_out + presence;
    }
}

enum kr_status kr_sample(const struct kr_sampling *s, const float *logits, const uint32_t *mask, int64_t vocab,
                         const struct kr_token_counts *counts, int32_t n_generated, const int32_t *eos_ids,
                         int32_t n_eos, struct kr_rng *rng, struct kr_sampler_scratch *sc, int32_t *out)
{
    enum kr_status st = scratch_reserve(sc, vocab);
    if (st != KR_OK) {
        return st;
    }
    float *v = sc->v;
    /* the constraint's mask first: a bias or penalty applied after it keeps -inf at -inf */
    copy_masked(v, logits, mask, vocab);
    /* logit bias (OpenAI: added to the model's logits before sampling) */
    for (int32_t i = 0; i < s->n_bias; i++) {
        if (s->bias_ids[i] >= 0 && s->bias_ids[i] < vocab) {
            v[s->bias_ids[i]] += s->bias[i];
        }
    }
    /* penalties */
    if (counts && counts->cap) {
        for (int32_t i = 0; i < counts->cap; i++) {
            const int32_t id = counts->ids[i];
            if (id < 0 || id >= vocab) {
                continue;
            }
            penalise(v, id, counts->in_prompt[i] != 0, counts->n_out[i], s->repetition_penalty,
                     s->frequency_penalty, s->presence_penalty);
        }
    }
    /* min_tokens: no end of sequence before it */
    if (n_generated < s->min_tokens) {
        for (int32_t i = 0; i < n_eos && !s->ignore_eos; i++) {
            v[eos_ids[i]] = -INFINITY;
        }
        for (int32_t i = 0; i < s->n_stop_ids; i++) {
            v[s->stop_ids[i]] = -INFINITY;
        }
    }
    return select_token(s->temperature, s->top_k, s->top_p, s->min_p, v, vocab, sc, rng, 0.0, out);
}

enum kr_status kr_sample_with_draw(const float *logits, const uint32_t *mask, int64_t vocab, float temperature,
                                   int32_t top_k, float top_p, float min_p, float presence, float frequency,
                                   float repetition, const int32_t *pen_ids, const int32_t *pen_count,
                                   const uint8_t *pen_flags, int64_t n_pen, double u, struct kr_sampler_scratch *sc,
                                   int32_t *out)
{
    enum kr_status st = scratch_reserve(sc, vocab);
    if (st != KR_OK) {
        return st;
    }
    float *v = sc->v;
    copy_masked(v, logits, mask, vocab);
    for (int64_t i = 0; i < n_pen; i++) {
        if (pen_ids[i] >= 0 && pen_ids[i] < vocab && !(pen_flags[i] & 2)) {
            penalise(v, pen_ids[i], (pen_flags[i] & 1) != 0, pen_count[i], repetition, frequency, presence);
        }
    }
    for (int64_t i = 0; i < n_pen; i++) {
        if (pen_ids[i] >= 0 && pen_ids[i] < vocab && (pen_flags[i] & 2)) {
            v[pen_ids[i]] = -INFINITY;
        }
    }
    return select_token(temperature, top_k, top_p, min_p, v, vocab, sc, NULL, u, out);
}
