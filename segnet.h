// segnet.h -- the backend contract: the types, the ops table and the math both backends
// share; the models, the planner and the step that segnet.c defines. The plumbing's
// declarations are in the headers beside its files (safetensors.h, images.h, datasets.h,
// curves.h, run.h).
//
// Layout conventions (see doc/design.md, "Tensors and layout"):
//   activations  NHWC, shape comment (N,H,W,C) on every tensor
//   conv weights [Cout][kh][kw][Cin/groups]  ("OHWI"), dense weights [out][in]
//   parameters   one fp32 buffer, an offset table of named slices into it
//
// This header is also included by kernels.cu, so the small formulas that both
// backends must agree on bit for bit (number formats, activation functions,
// the counter-based RNG, padding geometry) live here as static inline
// functions marked SN_HD.
#pragma once
#include <stddef.h>
#include <stdint.h>
#include <string.h>
#include <math.h>

#ifdef __CUDACC__
#define SN_HD __host__ __device__
#else
#define SN_HD
#endif

#ifdef __cplusplus
extern "C" {
#endif

// ----------------------------------------------------------------------------
// constants shared by every backend

#define BN_EPS_EFFNET 1e-3f  // EfficientNetV2 (Keras and torchvision)
#define BN_EPS_UNET   1e-5f  // U-Net convs (PyTorch BatchNorm2d default)
// running = (1 - BN_MOMENTUM)·running + BN_MOMENTUM·batch, with the unbiased
// batch variance (PyTorch momentum=0.1, Keras momentum=0.9).
#define BN_MOMENTUM   0.1f
#define SN_NAME_MAX   96     // longest parameter / layer name, with the NUL
#define SN_ERR_MAX    512    // longest error message
// bytes: every tensor of a planned arena starts on this boundary (GPU vector loads)
#define SN_TENSOR_ALIGN 16

// ----------------------------------------------------------------------------
// storage types: activations may be stored in fp32, fp16 or bf16; arithmetic
// is always fp32 (accumulations in fp64 on the CPU). Conversions are done in
// software with round-to-nearest-even, identically on every backend.

// Storage types of tensors; DT_I64 only in safetensors files (batch norm's
// num_batches_tracked, which PyTorch's strict loading wants), never storage.
typedef enum { DT_F32 = 0, DT_F16 = 1, DT_BF16 = 2, DT_I64 = 3 } DType;

static inline SN_HD size_t dtype_size(DType dt) { return dt == DT_F32 ? 4 : dt == DT_I64 ? 8 : 2; }

// Keras' categorical cross-entropy clips p[y] to [ε, 1-ε] before the log: nll
// to [-log(1-ε), -log ε] (Ops.softmax_xent's prob_clip; ε = 0: no clip).
#define KERAS_EPSILON 1e-7f  // Keras' backend.epsilon(): the seed's clip of probabilities
typedef struct { double lo, hi; } XentClip;
static inline XentClip xent_clip_bounds(float prob_clip) {
    XentClip c = {-1.0, INFINITY};  // nll ≥ 0 > lo: never moved
    if (prob_clip > 0.0f) { c.lo = -log1p(-(double)prob_clip); c.hi = -log((double)prob_clip); }
    return c;
}
// nll as clipped; *flat: the clip moved it (its gradient is 0)
static inline SN_HD double xent_clip(double nll, XentClip c, int *flat) {
    *flat = nll < c.lo || nll > c.hi;
    return nll < c.lo ? c.lo : nll > c.hi ? c.hi : nll;
}

// ----------------------------------------------------------------------------
// the loss menu (--loss): a weighted sum of terms over the same logits
//
// Per-pixel terms, divided by the global Σw (or the pixel count, --loss-norm keras):
//   ce     w_y·nll, nll = -log p_y (Ops.softmax_xent)
//   focal  w_y·α(1-p_y)^γ·nll / K, p_y clipped to [ε, 1-ε] (Ops.softmax_focal):
//          segmentation_models' CategoricalFocalLoss, a mean over pixels and classes
// Region terms, from per-class sums over a group of pixels (the global batch,
// or each image with --loss-per-image; Ops.region_sums):
//   I_c = Σ p_ic·[y_i = c], P_c = Σ p_ic, G_c = Σ [y_i = c], FP = P - I, FN = G - I
//   S_c = (a·I + s) / (a·I + α·FP + β·FN + s)
//     dice a = 2, α = β = 1 (the F1 score: 2I + s over P + G + s)
//     jaccard a = 1, α = β = 1 (I + s over P + G - I + s)
//     tversky a = 1, --tversky-alpha α, --tversky-beta β
//   a group's loss L = (Σ_c w_c·[G_c > 0]·(1 - S_c) / Σ_c w_c)^γ (γ = 1 but for tversky):
//   segmentation_models_pytorch's weighted mean, a class absent from the group adding 0;
//   the term is the mean of L over the step's groups (Ops.region_grad).
// lovasz (Berman et al. 2018, Lovász-softmax; Ops.lovasz), over a group's valid pixels:
//   e_i = |[y_i = c] - p_ic| sorted in decreasing order (ties by pixel index), G the pixels
//   of class c, and J(j) = 1 - (G - F)/(G + B) with F, B the pixels of c and of the other
//   classes in positions 0..j (J(-1) = 0): L_c = Σ_j e_(j)·(J(j) - J(j-1)), the Jaccard
//   loss's Lovász extension (1 - IoU of the crisp prediction where every e is 0 or 1);
//   the group's L = Σ_c w_c·L_c / Σ_c w_c over the classes present (G > 0), 0 if none:
//   segmentation_models_pytorch's LovaszLoss (multiclass, classes "present").
typedef enum {
    LOSS_CE, LOSS_FOCAL, LOSS_DICE, LOSS_JACCARD, LOSS_TVERSKY, LOSS_LOVASZ, LOSS_KIND_COUNT
} LossKind;
static const char *const LOSS_NAMES[LOSS_KIND_COUNT] = {"ce",      "focal",   "dice",
                                                        "jaccard", "tversky", "lovasz"};
// a term from per-class sums I, P, G (Ops.region_sums)
static inline int loss_is_region(LossKind k) { return k >= LOSS_DICE && k <= LOSS_TVERSKY; }
// a term over groups of pixels (the batch, or each image): the region terms and lovasz
static inline int loss_is_group(LossKind k) { return k >= LOSS_DICE; }
#define SN_MAX_LOSS_TERMS 6
#define FOCAL_GAMMA_DEFAULT 2.0f    // segmentation_models' CategoricalFocalLoss
#define FOCAL_ALPHA_DEFAULT 0.25f
#define REGION_SMOOTH_DEFAULT 1e-5f // segmentation_models' smooth
typedef struct {
    int n;                          // terms; 0 reads as ce alone
    LossKind kind[SN_MAX_LOSS_TERMS];
    float weight[SN_MAX_LOSS_TERMS];
    float smooth;                   // s of the region terms
    float focal_gamma, focal_alpha;
    float tversky_alpha, tversky_beta, tversky_gamma;
    int per_image;                  // region terms per image, averaged over the step's images
} LossCfg;

// the loss's first region term's name, or NULL
static inline const char *loss_region_name(const LossCfg *l) {
    for (int j = 0; j < l->n; j++) if (loss_is_region(l->kind[j])) return LOSS_NAMES[l->kind[j]];
    return NULL;
}
static inline int loss_has_region(const LossCfg *l) { return loss_region_name(l) != NULL; }
static inline int loss_has(const LossCfg *l, LossKind k) {
    for (int j = 0; j < l->n; j++) if (l->kind[j] == k) return 1;
    return 0;
}
// the loss's first term over groups of pixels, or NULL
static inline const char *loss_group_name(const LossCfg *l) {
    for (int j = 0; j < l->n; j++) if (loss_is_group(l->kind[j])) return LOSS_NAMES[l->kind[j]];
    return NULL;
}

static inline LossCfg loss_cfg_default(void) {
    LossCfg l = {1, {LOSS_CE}, {1.0f}, REGION_SMOOTH_DEFAULT, FOCAL_GAMMA_DEFAULT,
                 FOCAL_ALPHA_DEFAULT, 0.5f, 0.5f, 1.0f, 0};
    return l;
}

// One region term as its kernels take it: the score's constants, the power,
// and the term's weight over the step's group count (its mean).
typedef struct { float a, alpha, beta, gamma, smooth, scale; } RegionArgs;
static inline RegionArgs region_args(const LossCfg *l, int term, int groups) {
    const LossKind k = l->kind[term];
    RegionArgs r = {1.0f, 1.0f, 1.0f, 1.0f, l->smooth, l->weight[term] / (float)groups};
    if (k == LOSS_DICE) r.a = 2.0f;
    if (k == LOSS_TVERSKY) {
        r.alpha = l->tversky_alpha; r.beta = l->tversky_beta; r.gamma = l->tversky_gamma;
    }
    return r;
}
// D = a·I + α·FP + β·FN + s
static inline SN_HD double region_den(const RegionArgs *r, double i, double p, double g) {
    return r->a * i + r->alpha * (p - i) + r->beta * (g - i) + r->smooth;
}
// A group's term from its sums (I(K), P(K), G(K)) and the class weights w:
// returns scale·L; coef gets (A(K), B(K)), the loss's derivative by p_ic being
// B_c + [y_i = c]·A_c (scaled as the loss). With D = a·I + α·FP + β·FN + s and
// N = a·I + s: ∂S_c/∂p_ic = (a·[y=c]·D - N·((a - α - β)·[y=c] + α)) / D².
static inline SN_HD double region_coefs(const RegionArgs *r, const float *w, int K,
                                        const float *sums, float *coef) {
    const float *tp = sums, *pr = sums + K, *gt = sums + 2 * K;  // I, P, G
    double wsum = 0.0, mean = 0.0;
    for (int c = 0; c < K; c++) {
        wsum += w[c];
        const double d = region_den(r, tp[c], pr[c], gt[c]);
        if (gt[c] > 0.0f && d > 0.0) mean += w[c] * (1.0 - (r->a * tp[c] + r->smooth) / d);
    }
    if (!(wsum > 0.0)) wsum = 1.0;  // every weight 0: no loss
    mean /= wsum;
    // dL/d(1 - S_c) = scale·γ·mean^(γ-1)·w_c/Σw
    const double outer = r->scale * (r->gamma == 1.0f ? 1.0 : r->gamma * pow(mean, r->gamma - 1.0));
    for (int c = 0; c < K; c++) {
        const double d = region_den(r, tp[c], pr[c], gt[c]);
        const double num = r->a * tp[c] + r->smooth;
        const double dl = gt[c] > 0.0f && d > 0.0 ? -outer * w[c] / wsum / (d * d) : 0.0;
        coef[c] = (float)(dl * (r->a * d - num * (r->a - r->alpha - r->beta)));
        coef[K + c] = (float)(dl * -num * r->alpha);
    }
    return r->scale * (r->gamma == 1.0f ? mean : pow(mean, r->gamma));
}

// lovasz: a sorted position's weight J(j) - J(j-1), with F and B the class's and the other
// pixels before it, G > 0 the class's: 1/(G + B) for a pixel of the class, else
// (G - F)/((G + B)(G + B + 1)). Written out, not as a difference of J: no cancellation.
static inline SN_HD double lovasz_weight(double G, double F, double B, int in_class) {
    if (!(G > 0.0)) return 0.0;
    return in_class ? 1.0 / (G + B) : (G - F) / ((G + B) * (G + B + 1.0));
}
// A sort key: the error e in [0, 1] decreasing, then the position i increasing (the fp32
// bits of a non-negative float order as the float); LOVASZ_PAD sorts after every key.
#define LOVASZ_PAD UINT64_MAX
#define LOVASZ_ONE_BITS 0x3F800000u  // 1.0f
static inline SN_HD uint64_t lovasz_key(float e, uint32_t i) {
    uint32_t b;
    e = e < 0.0f ? 0.0f : e > 1.0f ? 1.0f : e;
    memcpy(&b, &e, 4);
    return (uint64_t)(LOVASZ_ONE_BITS - b) << 32 | i;
}
static inline SN_HD float lovasz_key_error(uint64_t key) {
    const uint32_t b = LOVASZ_ONE_BITS - (uint32_t)(key >> 32);
    float e;
    memcpy(&e, &b, 4);
    return e;
}
// A group's value from its classes' L_c and G_c (seg: (2,K)) and the class weights w:
// scale·Σ_c w_c·L_c/Σ_c w_c over the classes present; coef[c] = its factor of L_c (0 absent)
static inline SN_HD double lovasz_coefs(const float *seg, const float *w, int K, float scale,
                                        float *coef) {
    double wp = 0.0, v = 0.0;
    for (int c = 0; c < K; c++)
        if (seg[K + c] > 0.0f) { wp += w[c]; v += (double)w[c] * seg[c]; }
    if (!(wp > 0.0)) wp = 1.0;  // no class present, or all of weight 0: no loss
    for (int c = 0; c < K; c++) coef[c] = seg[K + c] > 0.0f ? (float)(scale * w[c] / wp) : 0.0f;
    return scale * v / wp;
}
// Ops.lovasz's workspace for `groups` runs of `per` pixels of K classes: the sort keys, a
// power of two per (group, class) (LOVASZ_SORT_TILE at least); per chunk of LOVASZ_SORT_TILE
// keys an fp64 part of L_c and a count (the CUDA walk's); per (group, class) G; then fp32
// (pixels,K) derivatives, (groups,2,K) L_c and G_c, (groups,K) coefficients, (pixels,2) row
// max and 1/Σexp
#define LOVASZ_SORT_TILE 2048  // keys a CUDA block sorts in shared memory (16 KiB)
static inline size_t lovasz_span(size_t per) {
    size_t p = LOVASZ_SORT_TILE;
    while (p < per) p *= 2;
    return p;
}
static inline size_t lovasz_ws_bytes(int groups, size_t per, int K) {
    const size_t pixels = (size_t)groups * per, keys = (size_t)groups * K * lovasz_span(per);
    return sizeof(uint64_t) * keys +
           (sizeof(double) + sizeof(uint32_t)) * (keys / LOVASZ_SORT_TILE) +
           sizeof(uint32_t) * (size_t)groups * K +
           sizeof(float) * (pixels * K + 3 * (size_t)groups * K + 2 * pixels);
}
typedef struct {
    uint64_t *keys;           // (groups,K,span): a class's keys in a group
    double *chunk_loss;       // (keys / LOVASZ_SORT_TILE)
    uint32_t *chunk_in, *seg_in;
    float *dl, *seg, *coef, *rows;
    size_t span;
} LovaszWs;
static inline LovaszWs lovasz_ws(void *ws, int groups, size_t per, int K) {
    LovaszWs w;
    w.span = lovasz_span(per);
    w.keys = (uint64_t *)ws;
    const size_t keys = (size_t)groups * K * w.span;
    w.chunk_loss = (double *)(w.keys + keys);
    w.chunk_in = (uint32_t *)(w.chunk_loss + keys / LOVASZ_SORT_TILE);
    w.seg_in = w.chunk_in + keys / LOVASZ_SORT_TILE;
    w.dl = (float *)(w.seg_in + (size_t)groups * K);
    w.seg = w.dl + (size_t)groups * per * K;
    w.coef = w.seg + 2 * (size_t)groups * K;
    w.rows = w.coef + (size_t)groups * K;
    return w;
}

// One pixel's focal term from its clipped nll = -log p: (1-p)^γ·nll into *value,
// and h with ∂(value)/∂z_k = h·(p_k - [k = y]): h = (1-p)^γ + γ(1-p)^(γ-1)·p·nll.
static inline SN_HD void focal_terms(double nll, double gamma, double *value, double *h) {
    const double p = exp(-nll), u = -expm1(-nll), ug = gamma == 0.0 ? 1.0 : pow(u, gamma);
    *value = ug * nll;
    *h = ug + (u > 0.0 ? gamma * ug / u * p * nll : 0.0);
}

static inline SN_HD uint32_t f32_bits(float f) { uint32_t u; memcpy(&u, &f, 4); return u; }
static inline SN_HD float bits_f32(uint32_t u) { float f; memcpy(&f, &u, 4); return f; }

// IEEE binary16: 1 sign, 5 exponent (bias 15), 10 mantissa bits.
static inline SN_HD uint16_t f32_to_f16(float f) {
    uint32_t x = f32_bits(f);
    uint32_t sign = (x >> 16) & 0x8000u;
    int exp32 = (int)((x >> 23) & 0xFF);
    uint32_t man = x & 0x7FFFFFu;
    if (exp32 == 0xFF)  // inf stays inf; NaN stays a (quiet) NaN
        return (uint16_t)(sign | 0x7C00u | (man ? 0x200u | (man >> 13) : 0u));
    int e = exp32 - 127 + 15;                       // rebiased exponent
    if (e >= 31) return (uint16_t)(sign | 0x7C00u); // too large: inf
    if (e <= 0) {
        // subnormal half: value in units of 2^-24 is (1.man·2^23) >> (14 - e)
        int shift = 14 - e;
        if (shift > 24) return (uint16_t)sign;      // below half the smallest subnormal
        uint32_t m = man | 0x800000u;
        uint32_t h = m >> shift, rem = m & ((1u << shift) - 1), half = 1u << (shift - 1);
        if (rem > half || (rem == half && (h & 1))) h++;
        return (uint16_t)(sign | h);
    }
    uint32_t h = sign | ((uint32_t)e << 10) | (man >> 13);
    uint32_t rem = man & 0x1FFFu;
    // a carry rolls into the exponent (up to inf)
    if (rem > 0x1000u || (rem == 0x1000u && (h & 1))) h++;
    return (uint16_t)h;
}

static inline SN_HD float f16_to_f32(uint16_t h) {
    uint32_t sign = (uint32_t)(h & 0x8000u) << 16;
    uint32_t e = (h >> 10) & 0x1F, man = h & 0x3FFu;
    if (e == 0) {  // zero or subnormal: man·2^-24, exact in fp32
        float v = (float)man * 5.9604644775390625e-8f;
        return sign ? -v : v;
    }
    // NaNs come out quiet, as in hardware
    if (e == 31) return bits_f32(sign | 0x7F800000u | (man << 13) | (man ? 0x400000u : 0u));
    return bits_f32(sign | ((e - 15 + 127) << 23) | (man << 13));
}

// bfloat16: the top 16 bits of an fp32.
static inline SN_HD uint16_t f32_to_bf16(float f) {
    uint32_t x = f32_bits(f);
    if ((x & 0x7FFFFFFFu) > 0x7F800000u) return (uint16_t)((x >> 16) | 0x40u);  // quiet NaN
    x += 0x7FFFu + ((x >> 16) & 1u);
    return (uint16_t)(x >> 16);
}
static inline SN_HD float bf16_to_f32(uint16_t b) { return bits_f32((uint32_t)b << 16); }

// Round an fp32 value through a storage type (what storing then loading does).
static inline SN_HD float dtype_round(DType dt, float v) {
    if (dt == DT_F16) return f16_to_f32(f32_to_f16(v));
    if (dt == DT_BF16) return bf16_to_f32(f32_to_bf16(v));
    return v;
}

// ----------------------------------------------------------------------------
// shapes and tensor views

typedef struct { int n, h, w, c; } Shape;  // (N,H,W,C)

static inline SN_HD size_t shape_numel(Shape s) { return (size_t)s.n * s.h * s.w * s.c; }
static inline Shape shape4(int n, int h, int w, int c) { Shape s = {n, h, w, c}; return s; }

// A tensor view: storage in the backend's memory, its shape and storage type.
// Views are passed by value; an op never owns the memory it is given.
typedef struct {
    void *data;
    Shape shape;
    DType dtype;
} Tensor;

static inline Tensor tensor(void *data, Shape s, DType dt) { Tensor t = {data, s, dt}; return t; }
static inline Tensor tensor_f32(float *data, Shape s) { return tensor(data, s, DT_F32); }
static inline size_t tensor_bytes(Tensor t) { return shape_numel(t.shape) * dtype_size(t.dtype); }

// ----------------------------------------------------------------------------
// activation functions (fused into batch norm, or a layer of their own)

typedef enum { ACT_NONE = 0, ACT_RELU, ACT_SILU, ACT_SIGMOID } Act;

static inline SN_HD float sigmoidf_(float z) { return 1.0f / (1.0f + expf(-z)); }

static inline SN_HD float act_apply(Act a, float z) {
    switch (a) {
    case ACT_RELU: return z > 0.0f ? z : 0.0f;
    case ACT_SILU: return z * sigmoidf_(z);                // swish: z·σ(z)
    case ACT_SIGMOID: return sigmoidf_(z);
    default: return z;
    }
}
// d act(z) / dz, from the pre-activation z
static inline SN_HD float act_grad(Act a, float z) {
    switch (a) {
    case ACT_RELU: return z > 0.0f ? 1.0f : 0.0f;
    case ACT_SILU: { float s = sigmoidf_(z); return s * (1.0f + z * (1.0f - s)); }
    case ACT_SIGMOID: { float s = sigmoidf_(z); return s * (1.0f - s); }
    default: return 1.0f;
    }
}

// batch norm's 1/sqrt(var + eps), per channel
static inline SN_HD float bn_invstd(const float *var, int c, float eps) {
    return 1.0f / sqrtf(var[c] + eps);
}

// batch norm's statistics of a channel from its fp64 sums over `count` values
// (bn_stats, and --sync-bn's sums added over the replicas: the same formula):
//   mean = Σx/count, var = Σx²/count - mean² (biased, ≥ 0)
// x² of an fp32 x is exact in fp64, so the subtraction loses (mean²/var)·2^-52
// of var: below its fp32 rounding unless |mean| > 2^14·σ.
static inline SN_HD void bn_moments_stats(double sum, double sum_sq, double count, float *mean,
                                          float *var) {
    const double m = sum / count, v = sum_sq / count - m * m;
    *mean = (float)m;
    *var = (float)(v > 0.0 ? v : 0.0);
}
// the running variance's unbiasing factor count/(count - 1) (bn_update_running)
static inline SN_HD double bn_running_unbias(double count) {
    return count > 1.0 ? count / (count - 1.0) : 1.0;
}
// bn_backward_reduce's results for channel c from its fp64 Σg, Σg·xhat: each
// rounded once to fp32, and added into dgamma, dbeta where they are not NULL
static inline SN_HD void bn_grad_sums_store(int c, double sg, double sgx, float *sum_g,
                                            float *sum_gx, float *dgamma, float *dbeta) {
    sum_g[c] = (float)sg;
    sum_gx[c] = (float)sgx;
    if (dbeta) dbeta[c] += (float)sg;
    if (dgamma) dgamma[c] += (float)sgx;
}

// ----------------------------------------------------------------------------
// counter-based RNG: a uniform number is a pure function of (seed, counter),
// so dropout masks are recomputed in backward (and in checkpoint recompute, and
// on the GPU) instead of stored. The mixer is the splitmix64 finalizer.

static inline SN_HD uint64_t rng_mix64(uint64_t z) {
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}
// uniform in [0, 1) with 24 random bits (exact in fp32)
static inline SN_HD float rng_uniform(uint64_t seed, uint64_t counter) {
    return (float)(rng_mix64(seed ^ rng_mix64(counter)) >> 40) * (1.0f / 16777216.0f);
}
// dropout's factor for the draw `counter`: 0 (dropped) or 1/(1 - rate) (kept)
static inline SN_HD float dropout_keep(float rate, uint64_t seed, uint64_t counter) {
    return rng_uniform(seed, counter) >= rate ? 1.0f / (1.0f - rate) : 0.0f;
}
// the factor of element index i of the step (see dropout_forward in the ops
// table): one draw per element (per_draw 1) or per sample (per_draw H·W·C)
static inline SN_HD float dropout_factor(float rate, uint64_t seed, uint64_t i, uint64_t per_draw) {
    return dropout_keep(rate, seed, i / per_draw);
}

// ----------------------------------------------------------------------------
// division by a constant as a multiply-high (the CUDA kernels' index math)
//
// For 1 ≤ d < 2^31 let l = ⌈log2 d⌉ and m = ⌊2^32·(2^l - d)/d⌋ + 1 (< 2^32), so
// that M = 2^32 + m ≥ 2^(32+l)/d with e = M·d - 2^(32+l) ≤ d. Then for 0 ≤ n < 2^31
//   n/d ≤ M·n/2^(32+l) = n/d + e·n/(d·2^(32+l)) < n/d + 1/(2d),
// and since n/d = q + r/d with r ≤ d - 1, the floor of the middle is q:
//   q = (⌊m·n/2^32⌋ + n) >> l, where the sum stays below 2^32.
typedef struct { uint32_t d, m, l; } FastDiv;
static inline SN_HD FastDiv fastdiv_make(uint32_t d) {
    uint32_t l = 0;
    while (l < 31 && ((uint32_t)1 << l) < d) l++;
    FastDiv f = {d, (uint32_t)((((uint64_t)1 << l) - d) * ((uint64_t)1 << 32) / d + 1), l};
    return f;
}
static inline SN_HD uint32_t fastdiv(FastDiv f, uint32_t n) {  // n / f.d for n < 2^31
    return (uint32_t)((((uint64_t)f.m * n) >> 32) + n) >> f.l;
}

// ----------------------------------------------------------------------------
// convolution geometry

typedef enum {
    // TensorFlow SAME: out = ceil(in/s), total pad max((out-1)·s + k - in, 0), extra pixel after
    PAD_SAME = 0,
    PAD_SYMMETRIC,  // PyTorch: (k-1)/2 each side, out = floor((in + 2p - k)/s) + 1
} PadMode;

typedef struct {
    int cin, cout;    // channels in and out
    int kh, kw;       // kernel size
    int stride;       // same in both directions
    int groups;       // 1: dense; cin: depthwise; anything dividing cin and cout
    PadMode pad;
    int has_bias;
} ConvCfg;

// Output size and padding before, along one axis. Returns 0 if the kernel
// does not fit in the padded input.
static inline SN_HD int conv_axis(int in, int k, int s, PadMode pad, int *out, int *pad_before) {
    if (pad == PAD_SAME) {
        int o = (in + s - 1) / s;
        int total = (o - 1) * s + k - in;
        if (total < 0) total = 0;
        *out = o; *pad_before = total / 2;
        return in >= 1;
    }
    int p = (k - 1) / 2;
    if (in + 2 * p < k) { *out = 0; *pad_before = p; return 0; }
    *out = (in + 2 * p - k) / s + 1; *pad_before = p;
    return 1;
}

// A conv on a given input: its sizes, padding and GEMM dimensions (both backends).
typedef struct {
    int N, H, W, C;      // input (N,H,W,C)
    int OH, OW, Cout;    // output (N,OH,OW,Cout)
    int pt, pl;          // padding before, top and left
    int Cg, Coutg, K;    // channels per group in and out; K = kh·kw·Cg
    size_t P;            // output pixels per image
} ConvGeom;

// Fills *q; returns 0 if the input does not fit the conv (wrong Cin, kernel
// larger than the padded input).
static inline int conv_geom_of(const ConvCfg *cfg, Shape in, ConvGeom *q) {
    q->N = in.n; q->H = in.h; q->W = in.w; q->C = in.c; q->Cout = cfg->cout;
    int okh = conv_axis(in.h, cfg->kh, cfg->stride, cfg->pad, &q->OH, &q->pt);
    int okw = conv_axis(in.w, cfg->kw, cfg->stride, cfg->pad, &q->OW, &q->pl);
    q->Cg = cfg->cin / cfg->groups; q->Coutg = cfg->cout / cfg->groups;
    q->K = cfg->kh * cfg->kw * q->Cg;
    q->P = (size_t)q->OH * q->OW;
    return okh && okw && in.c == cfg->cin;
}

// 1×1 stride 1 dense: NHWC is already the GEMM operand [N·H·W][Cin], no im2col
static inline int conv_is_pointwise(const ConvCfg *cfg) {
    return cfg->kh == 1 && cfg->kw == 1 && cfg->stride == 1 && cfg->groups == 1;
}
// one filter per channel: direct loops (kernels), no GEMM
static inline int conv_is_depthwise(const ConvCfg *cfg) {
    return cfg->groups > 1 && cfg->groups == cfg->cin && cfg->cout == cfg->cin;
}

// ----------------------------------------------------------------------------
// bilinear resampling geometry (the resize ops of both backends)
//
// Half-pixel centres: output o samples input coordinate
//   src = (o + 0.5)·in/out - 0.5, clamped below at 0,
// between i0 = floor(src) and i1 = min(i0 + 1, in - 1) with weight λ = src - i0.
typedef struct { int i0, i1; float l; } BilinearTap;

static inline SN_HD BilinearTap bilinear_tap(int o, int in, int out) {
    float src = ((float)o + 0.5f) * ((float)in / (float)out) - 0.5f;
    if (src < 0.0f) src = 0.0f;
    BilinearTap t;
    t.i0 = (int)src;
    if (t.i0 > in - 1) t.i0 = in - 1;
    t.i1 = t.i0 + 1 < in ? t.i0 + 1 : in - 1;
    t.l = src - (float)t.i0;
    return t;
}
// the sample between the four corners: a row mix in x, then in y (every backend,
// and the loader's resize of decoded bytes, in this one order)
static inline SN_HD float bilinear_mix(BilinearTap ty, BilinearTap tx, float x00, float x01,
                                       float x10, float x11) {
    const float top = (1.0f - tx.l) * x00 + tx.l * x01, bot = (1.0f - tx.l) * x10 + tx.l * x11;
    return (1.0f - ty.l) * top + ty.l * bot;
}
// weight with which output coordinate o (tap t) reads input coordinate i
static inline SN_HD float tap_weight(BilinearTap t, int i) {
    return (t.i0 == i ? 1.0f - t.l : 0.0f) + (t.i1 == i ? t.l : 0.0f);
}
// A range of outputs that contains every output reading input i: those with
// src in [i - 1, i + 1), widened by 2 for rounding and the clamps at the edges.
static inline SN_HD void tap_range(int i, int in, int out, int *lo, int *hi) {
    float inv_scale = (float)out / (float)in;
    *lo = (int)floorf(((float)i - 0.5f) * inv_scale - 0.5f) - 2;
    *hi = (int)ceilf(((float)i + 1.5f) * inv_scale - 0.5f) + 2;
    if (*lo < 0) *lo = 0;
    if (*hi > out - 1) *hi = out - 1;
}

// ----------------------------------------------------------------------------
// Adam and gradient clipping: the formulas both backends compute

// Adam as Keras implements it (Kingma & Ba 2015, Algorithm 1 with the "ε̂"
// placement of their section 2), step t = 1, 2, ...:
//   g  = grad_scale·grad
//   p -= lr·weight_decay·p                         (decoupled decay, AdamW; 0: off)
//   m  = β1·m + (1-β1)·g,   v = β2·v + (1-β2)·g²   (as m += (g-m)·(1-β1), Keras' form)
//   p -= α·m / (√v + ε),    α = lr·√(1-β2^t) / (1-β1^t)
// PyTorch puts ε inside the bias correction, p -= lr/(1-β1^t)·m / (√v/√(1-β2^t) + ε'),
// which is the same update when ε' = ε/√(1-β2^t).
typedef struct {
    float lr, beta1, beta2, eps, weight_decay, grad_scale;
    float alpha;  // lr·√(1-β2^t)/(1-β1^t), computed by adam_step_init in double
    int32_t skip; // 1: leave parameters and moments as they are (fp16 inf/NaN gradients)
} AdamStep;
#define ADAM_BETA1 0.9f
#define ADAM_BETA2 0.999f
#define ADAM_EPS   1e-7f   // Keras' default ε̂ (PyTorch's 1e-8 is ε', see above)
AdamStep adam_step_init(float lr, float beta1, float beta2, float eps, float weight_decay,
                        float grad_scale, int64_t t);

// tf.clip_by_global_norm's factor: clipnorm / max(norm, clipnorm) (1 if clipnorm ≤ 0)
static inline SN_HD float clip_factor(double global_norm, float clipnorm) {
    return clipnorm > 0.0f && global_norm > clipnorm ? (float)(clipnorm / global_norm) : 1.0f;
}

// ----------------------------------------------------------------------------
// an optimiser step's decisions, made where its values are (step_control)
//
// A training step needs no host synchronisation: the host writes what it
// knows before the step (StepArgs, uploaded from pinned memory), and what
// depends on the step's own values (the loss, the inf/NaN flag, the gradient
// norm) stays in backend memory (StepState) and is decided there by the one
// function below, which both backends run (the CUDA one in a one-thread
// kernel). The host reads StepState once, after the step, and passes the
// loss scale on to the next step's StepArgs.
typedef struct {
    AdamStep adam;          // lr, β1, β2, ε, decay, α of this step; grad_scale and skip are decided
    float inv_norm;         // 1 / the step's global Σw (or label count)
    float clipnorm;         // clip the global gradient norm to this (0: off)
    int32_t loss_scaling;   // 1: dynamic loss scaling (fp16 storage)
    int32_t scale_interval; // double the loss scale after this many finite steps
    float loss_scale;       // the scale so far (1 without loss scaling): the last step's StepState
    int64_t good_steps;     // consecutive finite steps since it last changed: likewise
} StepArgs;
typedef struct {
    float loss_scale;       // after the step
    int64_t good_steps;
    float xent_scale;       // softmax_xent's grad_scale: inv_norm·loss_scale
    float loss[3];          // softmax_xent's sums: Σw·nll, Σw, labels ≥ K
    float region_loss;      // the region terms of the loss (region_grad's), this replica's part
    float grad_sum_squares; // Σg² of the (still scaled) gradients
    // the global gradient norm before clipping, unscaled (inf/NaN when skipped)
    float grad_norm;
    int32_t clipped;        // 1: clipping scaled this step's gradients down
    int32_t nonfinite;      // 1: some gradient is inf or NaN (fp16)
    int32_t applied;        // 1: the update was applied (0: skipped, the scale halved)
    AdamStep adam;          // the update adam_update applies
} StepState;
typedef enum { STEP_BEGIN = 0, STEP_DECIDE = 1 } StepPhase;
// BEGIN, before the forward: the loss sums and the flag zeroed, the loss's
// gradient scale set. DECIDE, after the gradients (and nonfinite, and
// sum_squares): Keras' LossScaleOptimizer (inf/NaN: skip, halve the scale, at
// least 1; else double it after scale_interval good steps) and
// tf.clip_by_global_norm on the unscaled gradients, folded into Adam's grad_scale;
// the norm and whether clipping acted are kept for the run's diagnostics.
static inline SN_HD void step_control_apply(const StepArgs *a, StepState *s, int phase) {
    if (phase == STEP_BEGIN) {
        s->loss_scale = a->loss_scale;
        s->good_steps = a->good_steps;
        s->xent_scale = a->inv_norm * s->loss_scale;
        s->loss[0] = s->loss[1] = s->loss[2] = s->region_loss = 0.0f;
        s->grad_sum_squares = 0.0f;
        s->nonfinite = 0;
        return;
    }
    const float scale = s->loss_scale;  // the scale the gradients carry
    s->applied = 1;
    if (a->loss_scaling) {
        if (s->nonfinite) {
            s->loss_scale = scale / 2 > 1.0f ? scale / 2 : 1.0f;
            s->good_steps = 0;
            s->applied = 0;
        } else if (++s->good_steps >= a->scale_interval) {
            s->loss_scale = scale * 2;
            s->good_steps = 0;
        }
    }
    const double norm = sqrt((double)s->grad_sum_squares) / scale;
    const float clip = clip_factor(norm, a->clipnorm);
    s->grad_norm = (float)norm;
    s->clipped = s->applied && clip < 1.0f;
    s->adam = a->adam;
    s->adam.grad_scale = 1.0f / scale;
    if (a->clipnorm > 0.0f) s->adam.grad_scale *= clip;
    s->adam.skip = !s->applied;
}

// ----------------------------------------------------------------------------
// the ops table: every primitive the graph needs. One table per backend
// (ops_ref in segnet.c, ops_cpu in kernels_cpu.c, ops_cuda in kernels.cu); model code calls
// only these.
//
// Conventions, the same for every entry:
// - Tensor arguments carry their shape and storage type; float* arguments
//   are fp32 buffers in backend memory (parameters, gradients, statistics).
// - Input gradients (dx, da, ...) take an `accumulate` flag: 0 overwrites,
//   1 adds into what is there. The executor passes 1 when a tensor feeds
//   several layers (residuals, skips) and its gradient is already partly
//   written.
// - Parameter gradients (dw, db, dgamma, dbeta) are always added into, so
//   micro-batches accumulate in the one gradient buffer zeroed per step.
// - A NULL float* or a Tensor with NULL data means "not wanted".
// - Ops that need scratch memory say how much through a *_workspace entry and
//   receive it as `ws`; they never allocate.

// The layer after a batch norm, fused into the batch norm's ops by the executor
// (see "fusing layers" in segnet.c) for a table that fuses (plain_batch_norm 0);
// y below is the batch norm's output act(bn(x)).
// - FUSED_POOL (a global average pool of y): the forward also writes
//   pooled = global_avg_pool(y) (N,1,1,C); y is written as well.
// - FUSED_RESIDUAL (a residual block's end that alone reads y, drop_path_add):
//   y has no memory (the ops get a tensor without data); the forward writes
//   out = drop_path(y) + residual (dropout_forward per sample; rate 0: a plain
//   add). The backward's dy is out's gradient, which nothing reads after the
//   batch norm: bn_backward_reduce, which the executor always runs (sum_g NULL
//   when it wants none of the sums), writes dresidual (=|+=) dy (when it has
//   data) and may overwrite dy with y's gradient dy·keep; bn_backward_data, run
//   after it with the same dy, knows which of the two dy holds.
typedef enum { FUSED_NONE = 0, FUSED_POOL, FUSED_RESIDUAL } Fusion;
typedef struct {
    Fusion kind;
    Tensor pooled;                // FUSED_POOL, forward
    Tensor out, residual;         // FUSED_RESIDUAL, forward
    Tensor dresidual;             // FUSED_RESIDUAL, backward
    int accumulate_residual;
    // drop_path's (seed in backend memory)
    float rate; const uint64_t *seed; uint64_t first_sample;
} BnNext;

// What bn_forward, bn_backward_reduce and bn_backward_data share: the normalisation
// y = act(gamma·(x - mean)·invstd + beta), invstd = 1/sqrt(var + eps), and the layer fused
// after it
typedef struct {
    const float *mean, *var;    // (C) the batch's statistics (training) or the running ones
    const float *gamma, *beta;  // (C)
    float eps;
    Act act;
    // NULL, or the layer after the batch norm, fused; always NULL for a table with
    // plain_batch_norm (its batch norm is the formula alone)
    const BnNext *next;
} BnArgs;

typedef struct Ops Ops;
struct Ops {
    const char *name;  // "cpu", "cuda"
    // what else the application asks of the table's backend (below the table); NULL: the CPU
    const struct Backend *backend;
    void *ctx;         // backend state (streams, handles)
    // memory the backend allocates outside any plan (scratch, cuBLAS's workspace), per device
    size_t context_bytes;
    // memory the device's driver holds for the process (CUDA context, loaded kernels): an estimate,
    // counted by the plan; 0 on the CPU
    size_t driver_bytes;
    // the convs multiply in the activations' storage type: a net keeps a copy of its weights in it
    // (params_cast), made once per forward
    int weights_in_storage_type;
    // 1: the batch norm ops compute their formula alone (ops_ref): the executor runs the layer
    // after a batch norm as a layer of its own and passes no BnNext; 0 (ops_cpu, ops_cuda): it
    // may fuse that layer into them (layer_fusion, "fusing layers" in segnet.c)
    int plain_batch_norm;

    // memory in the backend's address space
    void *(*alloc)(Ops *o, size_t bytes);  // NULL on failure
    void (*free)(Ops *o, void *p);
    void (*upload)(Ops *o, void *dst, const void *host_src, size_t bytes);      // returns when done
    void (*download)(Ops *o, void *host_dst, const void *src, size_t bytes);    // returns when done
    void (*synchronize)(Ops *o);
    // host memory the device copies from without the host waiting (pinned on CUDA)
    void *(*host_alloc)(Ops *o, size_t bytes);  // NULL on failure
    void (*host_free)(Ops *o, void *p);
    // queued after the work before it; host_src (from host_alloc) is read when the
    // copy runs, so it must not change until the next download or synchronize
    void (*upload_async)(Ops *o, void *dst, const void *host_src, size_t bytes);
    // Uploads ahead of the step that reads them, while the step before it runs.
    // upload_ahead queues a copy on a queue of its own (the copy engine): after
    // the work queued so far, beside the work queued after it. await_uploads: the
    // work queued after it starts once every copy queued ahead before it has
    // finished (host_src must not change until then, and a synchronize after it).
    // copy_async: dst = src, both in the backend's memory, queued. NULL on a
    // backend whose work runs as it is queued (the CPU): it uploads at the step.
    void (*upload_ahead)(Ops *o, void *dst, const void *host_src, size_t bytes);
    void (*await_uploads)(Ops *o);
    void (*copy_async)(Ops *o, void *dst, const void *src, size_t bytes);

    // Recording the work of a step once and replaying it (CUDA graphs): between
    // capture_begin and capture_end the backend records what it is given
    // instead of running it; replay runs the record with the same arguments,
    // so whatever changes from step to step must be read from memory (StepArgs,
    // upload_async'ed buffers). NULL on a backend without it (the CPU).
    int (*capture_begin)(Ops *o);            // 0: recording; -1: not here (run eagerly)
    void *(*capture_end)(Ops *o, char *err); // the record, or NULL with err (nothing ran)
    void (*replay)(Ops *o, void *record);
    void (*record_free)(Ops *o, void *record);

    // utilities over whole buffers
    void (*fill)(Ops *o, Tensor t, float value);
    void (*scale)(Ops *o, Tensor t, float a);                      // t *= a
    // y (=|+=) a·x + b
    void (*axpby)(Ops *o, Tensor y, Tensor x, float a, float b, int accumulate);
    // dst (=|+=) src, casting between storage types
    void (*copy)(Ops *o, Tensor dst, Tensor src, int accumulate);
    // images[i] = bytes[i], the values 0..255 in images' storage type: a batch that
    // travels to the device as 8-bit (bytes: numel(images) in the backend's memory)
    void (*widen_bytes)(Ops *o, Tensor images, const uint8_t *bytes);
    void (*sum_squares)(Ops *o, Tensor t, float *out);             // *out = Σ t² (one float)
    // *flag = 1 if any inf/NaN, else unchanged
    void (*nonfinite)(Ops *o, Tensor t, int32_t *flag);
    // step_control_apply, there
    void (*step_control)(Ops *o, const StepArgs *a, StepState *s, StepPhase phase);

    // convolution: in (N,H,W,Cin), out (N,OH,OW,Cout), weight [Cout][kh][kw][Cin/groups], bias
    // [Cout];
    // weight_cast: NULL, or the weight in the storage type of `in` (weights_in_storage_type)
    size_t (*conv2d_workspace)(Ops *o, const ConvCfg *cfg, Shape in, DType dt);
    void (*conv2d_forward)(Ops *o, const ConvCfg *cfg, Tensor out, Tensor in, const float *weight,
                           const void *weight_cast, const float *bias, void *ws);
    void (*conv2d_backward_data)(Ops *o, const ConvCfg *cfg, Tensor din, Tensor dout,
                                 const float *weight, const void *weight_cast, int accumulate,
                                 void *ws);
    void (*conv2d_backward_weight)(Ops *o, const ConvCfg *cfg, float *dweight, float *dbias,
                                   Tensor dout, Tensor in, void *ws);

    // batch norm, split so that replicas can all-reduce between the pieces:
    //   stats -> (all-reduce) -> forward; backward_reduce -> (all-reduce) -> backward_data
    // mean, var: (C) biased per-channel statistics of x over N·H·W, from fp64 sums (the
    // reference in two passes, Σx then Σ(x − mean)²; the fast and CUDA versions in one,
    // bn_moments_stats of Σx and Σx²); with run_mean (not NULL) also bn_update_running with
    // count N·H·W; sums: NULL, or (2C) where Σx, then Σx², are also written in fp64
    // (--sync-bn adds them over the replicas, then bn_stats_finish)
    void (*bn_stats)(Ops *o, Tensor x, float *mean, float *var, float *run_mean, float *run_var,
                     float momentum, double *sums);
    // mean, var from sums (2C: Σx, Σx² over `count` values) as bn_stats computes them;
    // with run_mean (not NULL) also bn_update_running with `count`
    void (*bn_stats_finish)(Ops *o, const double *sums, int C, size_t count, float *mean,
                            float *var, float *run_mean, float *run_var, float momentum);
    // y = act(gamma·(x - mean)/sqrt(var + eps) + beta): training (batch stats) and inference
    // (running stats); bn->next: NULL, or the layer after it, fused (BnNext; never with
    // plain_batch_norm)
    void (*bn_forward)(Ops *o, Tensor y, Tensor x, const BnArgs *bn);
    // running = (1-m)·running + m·batch, the variance made unbiased with count/(count-1)
    void (*bn_update_running)(Ops *o, float *run_mean, float *run_var, const float *mean,
                              const float *var, int C, size_t count, float momentum);
    // g = dy·act'(z), xhat = (x - mean)·invstd (fp32): sum_g = Σ g, sum_gx = Σ g·xhat per
    // channel, summed in fp64 and rounded once (overwritten), also added into dgamma/dbeta
    // (either may be NULL); sums: NULL, or (2C) where the fp64 Σg, then Σg·xhat, are also
    // written (--sync-bn adds them over the replicas, then bn_backward_finish); bn->next: NULL,
    // or the layer after it, fused (BnNext: then sum_g NULL asks for none of the sums)
    void (*bn_backward_reduce)(Ops *o, Tensor dy, Tensor x, const BnArgs *bn, float *sum_g,
                               float *sum_gx, float *dgamma, float *dbeta, double *sums);
    // sum_g, sum_gx from sums (2C) as bn_backward_reduce rounds them, also added into dgamma/dbeta
    void (*bn_backward_finish)(Ops *o, const double *sums, int C, float *sum_g, float *sum_gx,
                               float *dgamma, float *dbeta);
    // dx = gamma·invstd·(g - sum_g/count - xhat·sum_gx/count); count = 0 means the
    // statistics were constants (inference mode): dx = gamma·invstd·g; next as bn_backward_reduce's
    void (*bn_backward_data)(Ops *o, Tensor dx, Tensor dy, Tensor x, const BnArgs *bn,
                             const float *sum_g, const float *sum_gx, size_t count,
                             int accumulate);

    // activations, elementwise
    void (*act_forward)(Ops *o, Act act, Tensor y, Tensor x);
    void (*act_backward)(Ops *o, Act act, Tensor dx, Tensor dy, Tensor x, int accumulate);

    // squeeze-excitation pieces. x (N,H,W,C), pooled and s (N,1,1,C)
    void (*global_avg_pool_forward)(Ops *o, Tensor y, Tensor x);
    void (*global_avg_pool_backward)(Ops *o, Tensor dx, Tensor dy, int accumulate);
    void (*channel_scale_forward)(Ops *o, Tensor y, Tensor x, Tensor s);  // y = x·s[n,c]
    void (*channel_scale_backward)(Ops *o, Tensor dx, Tensor ds, Tensor dy, Tensor x, Tensor s,
                                   int accumulate_dx, int accumulate_ds);

    // squeeze-excitation's gate (LAYER_SE_GATE), per image n of p (N,1,1,C):
    //   z1 = W1·p + b1, y1 = act1(z1) (S values), z2 = W2·y1 + b2, s = act2(z2) (C values),
    // W1 [S][C], W2 [C][S] fp32, sums in fp64, z1, y1, z2 rounded to s's storage type
    // (as the layers' tensors would be). The backward recomputes them from p:
    //   dz2 = ds·act2'(z2), dz1 = (W2ᵀ·dz2)·act1'(z1) (each rounded likewise),
    //   dp (=|+=) W1ᵀ·dz1 (dp without data: not wanted), and when dw1 is not NULL
    //   dW2 += Σ_n dz2 y1ᵀ, db2 += Σ_n dz2, dW1 += Σ_n dz1 pᵀ, db1 += Σ_n dz1.
    void (*se_gate_forward)(Ops *o, Tensor s, Tensor p, const float *w1, const float *b1,
                            const float *w2, const float *b2, int S, Act act1, Act act2);
    void (*se_gate_backward)(Ops *o, Tensor dp, Tensor ds, Tensor p, const float *w1,
                             const float *b1, const float *w2, const float *b2, int S, Act act1,
                             Act act2, float *dw1, float *db1, float *dw2, float *db2,
                             int accumulate);

    // residual add y = a + b; its backward da (=|+=) dy, db (=|+=) dy (either may have no data)
    void (*add_forward)(Ops *o, Tensor y, Tensor a, Tensor b);
    void (*add_backward)(Ops *o, Tensor da, Tensor db, Tensor dy, int accumulate_a,
                         int accumulate_b);
    // concat along C: y (N,H,W,Ca+Cb); backward splits dy into da, db
    void (*concat_forward)(Ops *o, Tensor y, Tensor a, Tensor b);
    void (*concat_backward)(Ops *o, Tensor da, Tensor db, Tensor dy, int accumulate_a,
                            int accumulate_b);

    // dropout (per element) and drop-path (per sample, stochastic depth):
    // keep with probability 1 - rate, kept values scaled by 1/(1 - rate);
    // the mask is rng_uniform(seed, counter) >= rate, counter the element's (or
    // sample's) index in the whole step: the tensor's samples are first_sample,
    // first_sample + 1, ... of it, so a replica's shard or a micro-batch draws
    // the masks those images get in one big batch:
    //   counter = (first_sample·E + i) / per_draw, E = H·W·C, per_draw = 1 or E
    // seed: in backend memory (it changes every step; a replayed record reads it there).
    // With a residual (data not NULL) the op is a residual block's end, y = dropout(x) + residual,
    // and its backward also gives dresidual (=|+=) dy.
    void (*dropout_forward)(Ops *o, Tensor y, Tensor x, Tensor residual, float rate,
                            const uint64_t *seed, int per_sample, uint64_t first_sample);
    void (*dropout_backward)(Ops *o, Tensor dx, Tensor dresidual, Tensor dy, float rate,
                             const uint64_t *seed, int per_sample, uint64_t first_sample,
                             int accumulate, int accumulate_residual);

    // 2×2 max-pool, stride 2, floor: y (N,H/2,W/2,C). Backward routes to the
    // first maximum of each window in row-major order, recomputed from x.
    void (*maxpool2_forward)(Ops *o, Tensor y, Tensor x);
    void (*maxpool2_backward)(Ops *o, Tensor dx, Tensor dy, Tensor x, int accumulate);
    // nearest 2× upsampling: y (N,2H,2W,C)
    void (*upsample2_forward)(Ops *o, Tensor y, Tensor x);
    void (*upsample2_backward)(Ops *o, Tensor dx, Tensor dy, int accumulate);
    // bilinear resize to y's size, half-pixel centres (PyTorch align_corners=False,
    // tf.image.resize bilinear)
    void (*resize_bilinear_forward)(Ops *o, Tensor y, Tensor x);
    void (*resize_bilinear_backward)(Ops *o, Tensor dx, Tensor dy, int accumulate);

    // fused softmax + weighted cross-entropy from logits (N,H,W,K), labels (N·H·W) int32.
    // Adds into stats[0] Σ w[y]·(-log p[y]), stats[1] Σ w[y], stats[2] the count of
    // labels ≥ K. Those and negative labels (SN_LABEL_IGNORED) contribute nothing
    // to the sums and get a zero gradient. If dlogits has data it is
    // overwritten with w[y]·(p - onehot(y))·grad_scale, grad_scale (in backend
    // memory; NULL without dlogits) = 1/(global normaliser), times a loss scale.
    // prob_clip ε > 0 (Keras): p[y] clipped to [ε, 1-ε] before the log, and no
    // gradient from a pixel whose p[y] the clip moved.
    void (*softmax_xent)(Ops *o, Tensor logits, const int32_t *labels, const float *class_weights,
                         float prob_clip, const float *grad_scale, float *stats, Tensor dlogits);
    // softmax_xent with the focal term: stats[0] += Σ w[y]·(1-p_y)^γ·nll (focal_terms), p_y
    // clipped by prob_clip as there; dlogits (when it has data) is added into with
    // w[y]·h·(p - onehot(y))·grad_scale.
    void (*softmax_focal)(Ops *o, Tensor logits, const int32_t *labels, const float *class_weights,
                          float gamma, float prob_clip, const float *grad_scale, float *stats,
                          Tensor dlogits);
    // The region terms' sums over `groups` equal runs of the pixels (1: all of them;
    // N: each image): sums (groups,3,K) = I, P, G of each (see LossKind), overwritten.
    // Labels outside 0..K-1 count nowhere. rows_ws: (pixels,2) fp32 scratch the op may use
    // (the CUDA one keeps each row's max and 1/Σexp there: O(K) a row, not O(K²)).
    void (*region_sums)(Ops *o, Tensor logits, const int32_t *labels, int groups, float *sums,
                        float *rows_ws);
    // One region term from the sums: coefs (groups,2,K) = region_coefs of each group,
    // *loss += Σ its values; dlogits (when it has data) is added into with
    // ∂loss/∂z_ik·grad_scale = p_ik·(d_ik - Σ_j p_ij·d_ij)·grad_scale, d_ik = B_k + [y_i = k]·A_k.
    void (*region_grad)(Ops *o, Tensor logits, const int32_t *labels, int groups,
                        const float *sums, const RegionArgs *args, const float *class_weights,
                        const float *grad_scale, float *coefs, float *loss, Tensor dlogits);
    // Per image of logits (N,H,W,K): TP_c, FP_c, FN_c over its pixels whose label has a class
    // weight above 0 (the pixels confusion_accumulate's metrics count), its mean IoU over the
    // classes of weight above 0, IoU_c = (TP + s)/(TP + FP + FN + s), s = IOU_IMAGE_SMOOTH
    // (segmentation_models' IOUScore(per_image=True) of the argmax). acc[0] += round(2^32·mIoU)
    // and acc[1] += 1 for each image: integers, the same sums in any order.
    void (*iou_per_image)(Ops *o, Tensor logits, const int32_t *labels,
                          const float *class_weights, int64_t *acc);
    // The lovasz term over `groups` equal runs of the pixels (see LossKind): *loss += Σ over
    // groups of scale·L (lovasz_coefs); dlogits (when it has data) is added into with
    // ∂/∂z_ik·grad_scale = p_ik·(d_ik - Σ_j p_ij·d_ij)·grad_scale, d_ik = coef_k·∂L_k/∂p_ik,
    // ∂L_k/∂p_ik = ∓ the weight at pixel i's sorted position (- for y_i = k). Labels outside
    // 0..K-1 take no part. ws: lovasz_ws_bytes(groups, pixels / groups, K) of scratch.
    void (*lovasz)(Ops *o, Tensor logits, const int32_t *labels, int groups, float scale,
                   const float *class_weights, const float *grad_scale, void *ws, float *loss,
                   Tensor dlogits);
    // confusion[y·K + argmax_k z_k] += 1 for every pixel with a label in 0..K-1
    // (an ignored pixel, SN_LABEL_IGNORED, is not counted)
    // (ties go to the lowest class); confusion is (K,K) int64, true class by row
    void (*confusion_accumulate)(Ops *o, Tensor logits, const int32_t *labels, int64_t *confusion);

    // one Adam step over n parameters (Keras' update, see AdamStep), with the
    // gradient multiplied by grad_scale first (loss-scale unscaling, clipping);
    // s in backend memory (StepState.adam: decided there)
    void (*adam_update)(Ops *o, float *params, const float *grads, float *m, float *v, size_t n,
                        const AdamStep *s);
};

// The compute entries of struct Ops (from fill on), in its order. The tables
// name each entry's function literally (ops_ref: NAME_ref in segnet.c, ops_cpu:
// NAME_cpu where it is faster, ops_cuda: NAME_cuda in kernels.cu); this list
// gives ops_missing every entry to check, so that a table that leaves one out
// fails the tests (ops_entries_listed checks that it covers the struct).
#define SN_COMPUTE_OPS(X)                                                                       \
    X(fill) X(scale) X(axpby) X(copy) X(widen_bytes) X(sum_squares) X(nonfinite)                \
    X(step_control) X(conv2d_workspace) X(conv2d_forward) X(conv2d_backward_data)               \
    X(conv2d_backward_weight)                                                                   \
    X(bn_stats) X(bn_stats_finish) X(bn_forward) X(bn_update_running) X(bn_backward_reduce)     \
    X(bn_backward_finish) X(bn_backward_data) X(act_forward) X(act_backward)                    \
    X(global_avg_pool_forward) X(global_avg_pool_backward) X(channel_scale_forward)             \
    X(channel_scale_backward) X(se_gate_forward) X(se_gate_backward) X(add_forward)             \
    X(add_backward) X(concat_forward) X(concat_backward) X(dropout_forward)                     \
    X(dropout_backward) X(maxpool2_forward) X(maxpool2_backward) X(upsample2_forward)           \
    X(upsample2_backward) X(resize_bilinear_forward) X(resize_bilinear_backward)                \
    X(softmax_xent) X(softmax_focal) X(region_sums) X(region_grad)                              \
    X(iou_per_image) X(lovasz) X(confusion_accumulate) X(adam_update)

// ops_ref: every op as its formula is written (segnet.c, part I; plain_batch_norm: no
// layer fused into its batch norm), what the tests compare ops_cpu with; ops_cpu: ops_ref
// with fast versions of conv2d, batch norm, the squeeze-excitation pieces and the
// memory-bound ops (kernels_cpu.c)
extern Ops ops_ref;
extern Ops ops_cpu;
// The layer after a batch norm by the table's own unfused ops, after the batch
// norm wrote y (for FUSED_RESIDUAL: y in out's memory, overwritten by out):
// what a backend without a fused kernel for a case runs (segnet.c). Backward:
// dresidual (=|+=) dy, and dy (out's gradient) becomes y's, in place.
void bn_next_forward_unfused(Ops *o, Tensor y, const BnNext *next);
void bn_next_backward_unfused(Ops *o, Tensor dy, const BnNext *next);
// The CUDA backend (kernels.cu): in builds with nvcc (SEGNET_CUDA) and, under
// the CPU emulator of cuda_emu.h, in test_segnet. cuda_backend_open picks the
// device and must succeed before ops_cuda is used; it returns -1 with a
// message when there is no driver or no such device.
// ops_cuda is device 0's table; cuda_ops_for_device(d) opens (once) and returns
// device d's: the same entries with a context of its own (stream, cuBLAS
// handle, scratch). Every entry makes its table's device current itself.
// cuda_backend_open(d) is cuda_ops_for_device(d) as 0 / -1.
extern Ops ops_cuda;
Ops *cuda_ops_for_device(int device, char *err);
int cuda_backend_open(int device, char *err);
// cudaMemGetInfo of device `device` (opened if it is not): its free and total bytes
int cuda_memory_info(int device, size_t *free_bytes, size_t *total_bytes, char *err);
// Bytes of im2col columns (and fp32 rows) the CUDA convs hold at once: larger
// convs run in chunks of output rows (whole images when they fit). It sizes
// conv2d_workspace, so change it only before planning (tests lower it to run
// the chunked paths on small shapes).
extern size_t cuda_conv_chunk_bytes;
// 1 (default): ops take their 16-byte vector kernels where they apply; 0: the
// generic kernels only (the tests run both)
extern int cuda_vector_kernels;
// 1 (default): k×k convs in fp16/bf16 run as implicit GEMMs on tensor cores
// (kernels.cu, "implicit-GEMM convolution") on GPUs of compute capability 8.0
// and later; 0 (SEGNET_CONV=gemm in the environment when the backend opens):
// im2col and cuBLAS, the reference path (the tests run both)
extern int cuda_conv_implicit;
// The implicit-GEMM convs' block tiles: 128 pixels × 64 channels, 128 × 32 (narrow
// layers) and 64 × 32 (small grids; not the weight gradient's). 0 (default):
// each conv picks the one that fills the GPU; a code forces one (a weight
// gradient forced small takes its own). The weight gradient's split follows
// it: change it only before planning.
enum { IG_TILE_WIDE = 1, IG_TILE_NARROW, IG_TILE_SMALL };
extern int cuda_conv_tile;
// 1 (default): batch norm's forward and the per-image channel scales run 4
// channels a thread (8 bytes of fp16/bf16) where 16-byte lanes would leave the
// GPU too few warps; 0: 16-byte lanes always (the tests run both)
extern int cuda_narrow_rows;
// the implicit-GEMM conv kernels' resident blocks per SM (pass 0 forward, 1
// backward data, 2 weight gradient, at that tile, the vector kernel or not, in
// storage type dt), from the build's registers and shared memory; -1: unknown
int cuda_conv_blocks_per_sm(int tile, int pass, int vec, DType dt);
// the 16-bit kernels' blocks per SM that the tile choice and the weight
// gradient's split assume (the same arguments)
int cuda_conv_assumed_blocks_per_sm(int tile, int pass, int vec);
// what ops_cuda.alloc has handed out (now, at most)
extern size_t cuda_bytes_live, cuda_bytes_peak;
// Device time per kernel (segnet bench --kernels): while cuda_kernel_timing is 1,
// every kernel launch and cuBLAS GEMM (a row per type combination) is timed
// by two events on its stream (run op by op: a replayed graph's kernels are
// not). cuda_kernel_times waits for the device,
// adds the launches since the last call to their kernels' rows and writes the
// rows, most time first, up to max of them; returns how many there are. bytes
// and flops: what the launches declared they move and compute (kernels.cu's
// Traffic), for achieved GB/s and TFLOP/s.
typedef struct {
    const char *name;
    long long launches;
    double ms, bytes, flops;
} KernelTimeRow;
extern int cuda_kernel_timing;
int cuda_kernel_times(KernelTimeRow *rows, int max);
void cuda_kernel_times_reset(void);

// What the application asks of a device backend besides its ops tables: a device's table,
// its memory, the bytes its tables have allocated, the kernels' device times (segnet bench
// --kernels) and the communicators of replicas on its devices. The plumbing (plumbing/)
// reaches a backend only through Ops and this: DEVICE_BACKEND (the build's, --device cuda
// and auto) and Ops.backend (a table's). kernels.cu's is backend_cuda, the cuda_ functions
// above; a port fills one of its own and names it in DEVICE_BACKEND.
typedef struct Comm Comm;
typedef struct Backend {
    const char *name;   // as --device spells it, and the prefix of `segnet info`'s lines: "cuda"
    const char *title;  // in messages: "CUDA"
    // device d's table (d: 0, or a replica's local rank), opened on first use; NULL with err
    // (no driver, no such device): cuda_ops_for_device
    Ops *(*ops_for_device)(int device, char *err);
    // the device's free and total bytes (opened if it is not): cuda_memory_info
    int (*memory_info)(int device, size_t *free_bytes, size_t *total_bytes, char *err);
    // what the tables' alloc has handed out (with each device's context scratch), now and at
    // most: cuda_bytes_live, cuda_bytes_peak
    size_t (*bytes_live)(void);
    size_t (*bytes_peak)(void);
    // device time per kernel: on (1) or off (0); the rows since the last reset, as
    // cuda_kernel_times; the reset
    void (*kernel_timing)(int on);
    int (*kernel_times)(KernelTimeRow *rows, int max);
    void (*kernel_times_reset)(void);
    // communicators over device memory for replicas on the devices (see
    // cuda_comm_local_create below): local (n replicas, devices 0..n-1), under MPI, and
    // closing those one call made
    int (*comm_local_create)(Comm *dcomms, Comm *hosts, int n, char err[SN_ERR_MAX]);
    int (*comm_mpi_create)(Comm *dcomm, Comm *host, char err[SN_ERR_MAX]);
    void (*comm_destroy)(Comm *dcomms, int n);
} Backend;
extern const Backend backend_cuda;  // kernels.cu
#ifdef SEGNET_CUDA
#define DEVICE_BACKEND (&backend_cuda)
#else
#define DEVICE_BACKEND ((const Backend *)NULL)  // a CPU-only build
#endif
extern size_t cpu_bytes_live, cpu_bytes_peak;  // what ops_cpu.alloc has handed out (now, at most)

// Where a command runs (--device): DEVICE_AUTO is GPU `gpu` (0, or a replica's
// local rank) when DEVICE_BACKEND's ops_for_device(gpu) succeeds, else the CPU with a
// one-line notice on stderr (once per process); DEVICE_CUDA without that GPU,
// or in a build without the CUDA backend, is an error. Returns the ops table,
// or NULL with err.
typedef enum { DEVICE_CPU = 0, DEVICE_CUDA, DEVICE_AUTO } Device;
extern const char *const DEVICE_NAMES[3];  // "cpu", "cuda", "auto": as --device spells them
Ops *ops_for_device(Device d, int gpu, char err[SN_ERR_MAX]);
// The entries of an ops table that are NULL, as "name, name, ..." in list
// (empty if none). Returns their number.
int ops_missing(const Ops *o, char *list, size_t size);

// Bytes of workspace the CPU backend's conv needs (the planner asks the table).
size_t conv2d_workspace_cpu(Ops *o, const ConvCfg *cfg, Shape in, DType dt);

// ----------------------------------------------------------------------------
// the graph: a flat array of layers in execution order over a table of tensors

typedef enum {
    LAYER_CONV = 0,   // conv2d (+ bias)
    LAYER_DENSE,      // fully connected on (N,1,1,C): a 1×1 conv, weights [out][in]
    LAYER_BN,         // batch norm (+ fused activation)
    LAYER_ACT,        // activation
    LAYER_GAP,        // global average pool -> (N,1,1,C)
    LAYER_SCALE,      // x (N,H,W,C) · s (N,1,1,C)
    LAYER_ADD,        // a + b
    LAYER_CONCAT,     // [a, b] along C
    LAYER_MAXPOOL,    // 2×2 stride 2
    LAYER_UPSAMPLE,   // nearest 2×
    LAYER_RESIZE,     // bilinear to (oh, ow)
    LAYER_DROPOUT,    // per element
    LAYER_DROP_PATH,  // per sample
    LAYER_RESCALE,    // y = scale·x + offset (input preprocessing inside the model)
    // squeeze-excitation's gate on pooled (N,1,1,C): act2(fc2(act(fc1(p)))) -> (N,1,1,C)
    LAYER_SE_GATE,
    LAYER_KIND_COUNT
} LayerKind;

typedef struct {
    char name[SN_NAME_MAX];
    int ndim;
    int dims[4];
    size_t offset;  // in floats, into the parameter (or buffer) array
    size_t count;
} ParamInfo;

typedef struct {
    char name[SN_NAME_MAX];
    Shape shape;     // (N,H,W,C)
    int producer;    // layer index, -1 for the graph input
} TensorInfo;

typedef struct {
    LayerKind kind;
    char name[SN_NAME_MAX];
    int in[2];       // input tensor ids (-1: unused)
    int out;         // output tensor id
    int weight, bias;          // parameter ids (-1: none); BN: gamma, beta; SE gate: fc1's
    int weight2, bias2;        // LAYER_SE_GATE: fc2's (else -1)
    int run_mean, run_var;     // BN running statistics: ids in the buffer table
    ConvCfg conv;              // LAYER_CONV, LAYER_DENSE; LAYER_SE_GATE: fc1 (fc2 is its transpose)
    Act act;                   // LAYER_BN (fused), LAYER_ACT, LAYER_SE_GATE (after fc1)
    Act act2;                  // LAYER_SE_GATE: the gate's (after fc2)
    float eps;                 // LAYER_BN
    float rate;                // LAYER_DROPOUT, LAYER_DROP_PATH
    float scale, offset;       // LAYER_RESCALE
    int frozen;                // no parameter gradients; BN in inference mode
    int block;                 // checkpoint segment id (an MBConv block, a decoder stage)
    int stage;                 // index into Graph.stage_names (what `segnet plan` reports)
} Layer;

// Weight initialisation, as the model's reference framework does it:
//   INIT_TORCH_DEFAULT  nn.Conv2d / nn.Linear defaults (kaiming_uniform with a = √5):
//                       weight and bias ~ U(-1/√fan_in, 1/√fan_in), fan_in = Cin/groups·kh·kw
//   INIT_EFFNET         torchvision's EfficientNet: conv He-normal with fan_out =
//                       Cout·kh·kw (std √(2/fan_out)), dense U(-1/√out, 1/√out), biases 0
// BN: γ = 1, β = 0 in both.
typedef enum { INIT_TORCH_DEFAULT = 0, INIT_EFFNET = 1 } InitScheme;

typedef struct {
    Layer *layers;        int n_layers, cap_layers;
    TensorInfo *tensors;  int n_tensors, cap_tensors;
    ParamInfo *params;    int n_params, cap_params;   size_t n_param_floats;
    ParamInfo *buffers;   int n_buffers, cap_buffers; size_t n_buffer_floats;  // BN running stats
    int input;            // tensor id of the graph's input (-1 before graph_input)
    InitScheme init;      // how net_init_params draws the weights
    int block;            // block id given to layers added from now on
    // layers added now go to the last stage
    char (*stage_names)[SN_NAME_MAX]; int n_stages, cap_stages;
    char err[SN_ERR_MAX]; // first error, "" if none; builders return -1 once set
} Graph;

void graph_init(Graph *g);
void graph_free(Graph *g);
const char *layer_kind_name(LayerKind k);

// Builders: each returns the id of the new output tensor, or -1 with g->err
// set (naming the layer and the shapes involved). After an error every
// builder returns -1, so a model builder may check once at the end.
int graph_input(Graph *g, Shape s);
int graph_conv(Graph *g, const char *name, int x, int cout, int k, int stride, int groups,
               PadMode pad, int bias);
int graph_dense(Graph *g, const char *name, int x, int out, int bias);
int graph_bn(Graph *g, const char *name, int x, float eps, Act act);
int graph_act(Graph *g, const char *name, int x, Act act);
int graph_gap(Graph *g, const char *name, int x);
int graph_scale(Graph *g, const char *name, int x, int s);
int graph_add(Graph *g, const char *name, int a, int b);
int graph_concat(Graph *g, const char *name, int a, int b);
int graph_maxpool(Graph *g, const char *name, int x);
int graph_upsample(Graph *g, const char *name, int x);
int graph_resize(Graph *g, const char *name, int x, int oh, int ow);
int graph_dropout(Graph *g, const char *name, int x, float rate);
int graph_drop_path(Graph *g, const char *name, int x, float rate);
// a residual block's end, residual + drop_path(x), as one layer (one pass, no tensor in between)
int graph_drop_path_add(Graph *g, const char *name, int x, int residual, float rate);
// squeeze-excitation's gate on pooled p (N,1,1,C), one layer with the parameters of
// two 1×1 convs with bias, name.fc1 (squeeze×C) and name.fc2 (C×squeeze):
// s = act2(fc2(act1(fc1(p)))) (N,1,1,C)
int graph_se_gate(Graph *g, const char *name, int p, int squeeze, Act act1, Act act2);
int graph_rescale(Graph *g, const char *name, int x, float scale, float offset);

// Layers added from now on belong to a new checkpoint block / a new named stage.
void graph_begin_block(Graph *g);
void graph_begin_stage(Graph *g, const char *name);

int graph_find_param(const Graph *g, const char *name);  // -1 if absent

// ----------------------------------------------------------------------------
// models: builders that emit a graph (layer and parameter names as torchvision's
// EfficientNetV2 and segmentation_models' Unet decoder)

typedef struct {
    const char *model;      // effv2-s|m|l|t, unet, unet-effv2-s|m|l|t
    int classes;
    int batch, height, width;
    // EfficientNetV2 convs: same (TensorFlow/Keras) or symmetric (torchvision)
    PadMode pad;
    int head_hidden;        // classifier: 0, or the width of a hidden ReLU layer
    int depth, width_base;  // unet: levels below the top, channels of level 0
    // PAD_DEFAULT, PAD_OPTION (--padding) or PAD_RUN (a run's config.txt); else the weights decide
    int pad_given;
#define PAD_DEFAULT 0
#define PAD_OPTION  1
#define PAD_RUN     2
    // classifier head's dropout rate(s); < 0: the model's (EffSpec: s 0.2, m 0.3, l 0.4)
    float dropout;
    // unet-effv2-*: what the decoder starts from, at stride 32 (--bottleneck)
    int bottleneck;
#define BOTTLENECK_HEAD  0  // the encoder's 1×1 head conv (1280 channels), a classifier's features
#define BOTTLENECK_STAGE 1  // the last stage's output, as timm's features_only (smp's tu- encoders)
} ModelCfg;

ModelCfg model_cfg_default(void);
// Returns the logits tensor id, or -1 with g->err naming the problem.
int model_build(Graph *g, const ModelCfg *cfg);

// ----------------------------------------------------------------------------
// executing a graph on a backend (fixed batch, one allocation per tensor; the
// memory planner replaces the per-tensor allocations with one arena)

// ----------------------------------------------------------------------------
// memory planning (see segnet.c): the step as a schedule of slots, every
// activation and gradient as a buffer with a lifetime [first, last] in slots
// and an offset in one arena

typedef enum { SLOT_FORWARD, SLOT_LOSS, SLOT_RECOMPUTE, SLOT_BACKWARD } SlotKind;

typedef struct {
    // the activation (its forward or recompute life) or the gradient of tensor
    int tensor, is_grad, recompute;
    int first, last;                 // slots, inclusive
    size_t bytes, offset;            // in the arena
} PlanBuffer;

typedef struct {
    int checkpoint;
    int n_slots, *slot_kind, *slot_layer;  // SlotKind and layer (-1 for the loss) of each slot
    // per layer (rec_slot -1: its block is not recomputed); a fused layer has its batch norm's
    // slots (bwd: FUSED_RESIDUAL only)
    int *fwd_slot, *rec_slot, *bwd_slot;
    int *recompute;                        // per layer: runs again in its recompute slot
    int loss_slot;
    PlanBuffer *bufs; int n_bufs;
    int *start_head, *start_next;          // per slot: list of the buffers whose life starts there
    int *end_head, *end_next;              // ... and ends there
    size_t workspace;                      // bytes at offset 0, alive for the whole step
    size_t peak;                           // arena bytes
} Plan;

// Layer j's work done by the batch norm j - 1 when table o runs the graph (its ops'
// BnNext; see "fusing layers" in segnet.c). fuse_layers 0 (tests: fused ≡ unfused) or
// o->plain_batch_norm: none.
extern int fuse_layers;
Fusion layer_fusion(const Graph *g, const Ops *o, int j);

// needs_grad[t] (per tensor): a trainable parameter (or the input) lies upstream
void graph_needs_grad(const Graph *g, int input_needs_grad, int *needs_grad);
// o: the table that will run the plan (its fusions decide the slots, layer_fusion)
void plan_build(Plan *p, const Graph *g, const Ops *o, const int *needs_grad, DType dtype,
                int output, int checkpoint, size_t workspace);
void plan_free(Plan *p);

typedef struct {
    const Graph *g;
    Ops *o;
    DType dtype;          // activation storage type
    float *params;        // (n_param_floats) fp32 master weights
    // (n_param_floats) in dtype, for backends with weights_in_storage_type; else NULL
    void *params_cast;
    // (n_grad_floats) the trainable parameters' gradients, packed in parameter order
    float *grads;
    // per parameter: its gradient's offset in grads, or SIZE_MAX (frozen: none)
    size_t *grad_offset;
    // Σ counts of the trainable parameters (= n_param_floats when nothing is frozen)
    size_t n_grad_floats;
    float *buffers;       // (n_buffer_floats) BN running statistics
    void **act;           // per tensor: activation storage
    void **grad;          // per tensor: gradient storage (NULL where none is needed)
    int *needs_grad;      // per tensor: some trainable parameter (or the input) lies upstream
    Fusion *fusion;       // per layer: layer_fusion with o, fixed when the net is created
    int *grad_written;    // per tensor, during backward: its gradient holds a contribution
    int input_needs_grad; // also compute the gradient of the graph input
    float **bn_mean, **bn_var;  // per layer (BN only): statistics used in the forward, (C)
    float *bn_scratch;    // (2·Cmax) per-channel sums in BN backward
    // (2·Cmax) --sync-bn: a BN layer's fp64 sums, all-reduced over the replicas
    double *bn_sums;
    void *ws; size_t ws_bytes;
    int training;
    uint64_t seed, step;  // dropout masks are rng(seed ⊕ step ⊕ layer)
    uint64_t *layer_seeds; // (n_layers) backend memory: net_layer_seed of each layer for seeds_of
    uint64_t seeds_of[2];  // the (seed, step) layer_seeds hold; seeds_set 0: none yet
    int seeds_set;
    // the batch's first image in the optimiser step's images (replica shard, micro-batch)
    uint64_t first_sample;
    // images of the pass under way, ≤ the graph's N (a capacity fixed at planning); set by
    // net_forward only
    int batch;
    Plan *plan;           // net_create_planned: the arena's layout, else NULL
    uint8_t *arena;
    // the highest arena byte a live buffer has reached (measured while running)
    size_t arena_high;
    // fill every buffer with NaN when its life ends (tests: nothing reads a dead buffer)
    int poison;
    double *layer_seconds; // (2·n_layers) or NULL: seconds per layer are added in, forward at [i],
                           // backward at [n_layers + i] (segnet bench --profile)
    // NULL, or the replicas whose batch norm statistics and gradient sums are all-reduced
    struct Comm *sync_bn;
    // a collective failed (another rank stopped): the rest of the pass is skipped
    int failed;
    // 1: a training forward leaves BN's running statistics as they are (the forwards that
    // sum a region loss over micro-batches before their backward: step_work)
    int keep_running;
} Net;

// Returns 0, or -1 with the reason in err (out of memory). One allocation per
// tensor: every activation stays readable after the step (tests, prediction).
int net_create(Net *net, const Graph *g, Ops *o, DType dtype, int input_needs_grad,
               char err[SN_ERR_MAX]);
// The same, with every activation, gradient and the workspace in one arena laid
// out by plan_build for the training step whose loss reads `output`; with
// checkpoint, blocks are recomputed in backward. Activations are then valid
// only during their lifetimes (net_tensor of the output: until net_backward).
int net_create_planned(Net *net, const Graph *g, Ops *o, DType dtype, int input_needs_grad,
                       int output, int checkpoint, char err[SN_ERR_MAX]);
void net_free(Net *net);
Tensor net_tensor(const Net *net, int t);       // activation view
Tensor net_grad(const Net *net, int t);         // gradient view (data NULL if none)
// The graph's N: the images a pass can hold (a capacity fixed at planning).
int net_capacity(const Net *net);
// The forward of the first n images of the input (n ≤ net_capacity; 0: a replica with an
// empty shard, which still takes part in the collectives); views (net_tensor) then have n.
void net_forward(Net *net, int n, int training);
// Backward of the same n images from the gradient already stored in net_grad(output):
// parameter gradients are added into net->grads, activation gradients overwritten.
void net_backward(Net *net, int n, int output);
uint64_t net_layer_seed(const Net *net, int layer);
// the n_layers seeds of net's (seed, step) into host memory `seeds`
void net_layer_seeds(const Net *net, uint64_t *seeds);

// ----------------------------------------------------------------------------
// losses (host-side helpers; the per-pixel work is ops->softmax_xent)

// Σ_i w[y_i] over the labels in 0..K-1: the weighted-mean denominator, known
// before the forward; class_weights NULL: their count (Keras' pixel mean).
double label_weight_sum(const int32_t *labels, size_t n, const float *class_weights, int K);

// ----------------------------------------------------------------------------
// replicas: the communicator of a data-parallel run (see README.md, "Replicas")
//
// Every rank calls every collective, in the same order, with the same sizes.
// A reduction is a sum in rank order, ((b0 + b1) + b2) + ..., computed the
// same way on every rank: every rank gets the same bits, whatever the timing.
// Buffers are host memory, reduced in place. A collective returns 0, or -1
// once a rank has failed (abort): the caller unwinds, and failed_rank names it.

#define SN_MAX_REPLICAS 64

typedef struct Comm Comm;
struct Comm {
    const char *name;  // "local", "mpi"
    int rank, size;
    void *ctx;
    int (*allreduce_f32)(Comm *c, float *buf, size_t n);
    int (*allreduce_f64)(Comm *c, double *buf, size_t n);
    int (*allreduce_i64)(Comm *c, int64_t *buf, size_t n);
    int (*broadcast)(Comm *c, void *buf, size_t bytes, int root);
    // This rank cannot go on (why: one line). local: every pending and later
    // collective of the other ranks returns -1; mpi: the job ends (MPI_Abort,
    // which mpirun reports with the rank), so other ranks never wait on it.
    void (*abort)(Comm *c, const char *why);
    int (*failed_rank)(Comm *c);  // the first rank that aborted, -1 if none
    int local_rank;  // this rank's index among the ranks on its machine: its GPU
    // The same rank's communicator over device memory (NCCL, kernels.cu), or
    // NULL: a backend's device buffers are then staged through the host.
    struct Comm *device;
};

// N ranks in one process (--replicas N): comms[r] is rank r's communicator.
// comm_local_run runs fn(comms[r], args[r]) on one thread per rank and returns
// when all have returned; a rank whose fn returns non-zero aborts the others.
// The ranks take turns: one runs at a time and hands the turn on while it
// waits in a collective, so each op still has all of --threads (the CPU
// backend runs replicas one after another, as one device would).
int comm_local_create(Comm *comms, int n);
void comm_local_destroy(Comm *comms, int n);
void comm_local_run(Comm *comms, int n, int (*fn)(Comm *c, void *arg), void **args, int *rc);
// The rendezvous behind every local collective: once every rank has called it
// with its buf (the same n on every rank), the last to arrive runs
// combine(bufs, size, n, arg) with the ranks' bufs in rank order while the
// others wait, and keeps the turn. Returns 0, or -1 once a rank has failed.
typedef void (*CommCombine)(void *const *bufs, int size, size_t n, void *arg);
int comm_local_gather(Comm *c, void *buf, size_t n, CommCombine combine, void *arg);

// One process per rank under mpirun (a build with MPI: SEGNET_MPI).
// comm_mpi_launched: the size of the job this process was started in (from the
// launcher's environment: OMPI_COMM_WORLD_SIZE, PMI_SIZE, PMIX_SIZE), 1 if none.
// comm_mpi_open initialises MPI (finalised at exit); -1 with err when the build
// has no MPI.
int comm_mpi_launched(void);
int comm_mpi_open(Comm *c, char err[SN_ERR_MAX]);

// Agreement after a step that can fail on some ranks: every rank passes its
// rc (0 or -1, err holding its message); returns -1 on every rank if any rank
// failed, err then "rank R: <that rank's message>" for the lowest failed rank.
int comm_agree(Comm *c, int rc, char err[SN_ERR_MAX]);

// NCCL communicators over CUDA device memory (kernels.cu; builds without NCCL
// return -1 saying so). Each becomes hosts[r].device / host->device; every
// collective is enqueued on the device's streams and returns, ordered before
// the device work after it (no host synchronisation). Local: replica r on
// device r (ncclCommInitAll; -1 with err if a device is missing). MPI: device
// host->local_rank, the NCCL id broadcast by rank 0 over host (a collective of
// host: every rank calls it). cuda_comm_destroy: all communicators made by one
// create call (n of them local, 1 under MPI).
int cuda_comm_local_create(Comm *dcomms, Comm *hosts, int n, char err[SN_ERR_MAX]);
int cuda_comm_mpi_create(Comm *dcomm, Comm *host, char err[SN_ERR_MAX]);
void cuda_comm_destroy(Comm *dcomms, int n);

// ----------------------------------------------------------------------------
// training: initialisation, metrics, schedules, the training loop, evaluation

// Draws every parameter by the graph's InitScheme. Deterministic in seed.
void net_init_params(Net *net, uint64_t seed);

// Metrics from one confusion matrix (K,K), true class by row, accumulated
// over a whole epoch. Only rows of classes with weight > 0 count (a pixel
// whose true class has weight 0 is not there):
//   IoU_c = TP_c / (TP_c + FP_c + FN_c) for weight_c > 0, NaN if 0/0 or weight_c = 0
//   mean IoU = mean of the IoU_c that are not NaN (classes with weight > 0
//              that occur, in the labels or the predictions: Keras' MeanIoU)
//   accuracy = Σ_c TP_c / (pixels counted)   (pixel accuracy; for a
//              classifier, the accuracy)
//   Dice_c = 2·TP_c / (2·TP_c + FP_c + FN_c)  (the F1 score: segmentation_models'
//              FScore with β = 1), NaN where IoU_c is; mean Dice over the same classes
typedef struct {
    double mean_iou, accuracy;
    double *iou;  // (K), caller's memory
    double mean_dice;
    double *dice;  // (K), caller's memory, or NULL
} Metrics;
void metrics_compute(const int64_t *confusion, int K, const float *class_weights, Metrics *m);

typedef enum {
    SCHEDULE_CONSTANT = 0, SCHEDULE_COSINE = 1, SCHEDULE_POLY = 2, SCHEDULE_PLATEAU = 3
} Schedule;
#define POLY_POWER 0.9  // the poly schedule's exponent: DeepLab's
// Learning rate for optimiser step `step` (0-based) of total_steps: a linear
// warm-up lr·(step+1)/warmup over the first `warmup` steps, then, with
// p = (step - warmup)/(total_steps - warmup): constant (also plateau, whose lr
// the run lowers between epochs), cosine lr·(1 + cos(π·p))/2, or poly
// lr·(1 - p)^POLY_POWER.
double lr_at_step(double lr, Schedule s, int64_t warmup, int64_t total_steps, int64_t step);

// Keras' ReduceLROnPlateau (cooldown 0) after each epoch, with v the epoch's
// monitored value (lower is better: a metric is negated): if v < best -
// min_delta, best = v and wait = 0; else wait += 1, and when wait reaches
// patience and lr > min_lr, lr = max(lr·factor, min_lr) (in fp32, as Keras'
// learning-rate variable holds it) and wait = 0.
typedef struct { float factor, min_lr, min_delta; int patience; } PlateauCfg;
typedef struct { double lr, best; int wait; } Plateau;  // lr: the base of lr_at_step

#define SN_MAX_CLASSES 4096
#define IOU_IMAGE_SMOOTH 1e-5  // segmentation_models' metrics' smooth
#define IOU_IMAGE_ONE 4294967296.0  // 2^32: iou_per_image's fixed point
#define IOU_IMAGE_MAX_K 1024  // classes iou_per_image counts (the CUDA kernel's shared memory)
// an image's mean IoU (iou_per_image) from its counts (3,K) TP, FP, FN: the fixed-point value
static inline SN_HD int64_t image_iou_fixed(const int64_t *counts, const float *w, int K) {
    double sum = 0.0;
    int n = 0;
    for (int c = 0; c < K; c++) {
        if (!(w[c] > 0.0f)) continue;
        const double tp = (double)counts[c], all = tp + counts[K + c] + counts[2 * K + c];
        sum += (tp + IOU_IMAGE_SMOOTH) / (all + IOU_IMAGE_SMOOTH);
        n++;
    }
    return n ? (int64_t)llround(sum / n * IOU_IMAGE_ONE) : 0;
}
// a label that counts nothing: a mask pixel of an --ignore-index value
#define SN_LABEL_IGNORED (-1)
#define SN_MAX_ACCUM   1024   // micro-batches per optimiser step

// Dynamic loss scaling for fp16 storage, Keras' defaults (LossScaleOptimizer):
// start at 2^15, halve on inf/NaN gradients (skipping the update, never below
// 1), double after this many consecutive finite steps.
#define LOSS_SCALE_INIT 32768.0f
#define LOSS_SCALE_GROWTH_INTERVAL 2000

// Keras' fine_tune_at recipe: freeze the backbone (layers named features.*,
// the EfficientNetV2 trunk also inside unet-effv2, or enc* in the plain U-Net)
// except its last `unfreeze_last` checkpoint blocks. Returns the number of
// blocks in the backbone (so a caller can refuse N larger than that).
int graph_freeze_base(Graph *g, int unfreeze_last);

// ----------------------------------------------------------------------------
// deterministic host RNG (initialisation, tests, data order)

typedef struct { uint64_t state; } Rng;
static inline void rng_seed(Rng *r, uint64_t seed) { r->state = seed; }
static inline uint64_t rng_next(Rng *r) {
    r->state += 0x9E3779B97F4A7C15ull;
    return rng_mix64(r->state);
}
static inline float rng_float(Rng *r) { return (float)(rng_next(r) >> 40) * (1.0f / 16777216.0f); }
float rng_normal(Rng *r);

#ifdef __cplusplus
}
#endif
