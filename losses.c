// losses.c -- the loss menu's terms beyond cross-entropy (part I; segnet.c
// includes it after softmax_xent_ref): the focal term and the region terms
// (dice, jaccard, tversky), lovasz, and the per-image IoU. Their formulas are in segnet.h
// ("the loss menu", iou_per_image), with the arithmetic both backends share
// (focal_terms, region_coefs, image_iou_fixed).

// ----------------------------------------------------------------------------
// focal: w_y·(1-p_y)^γ·nll per pixel; the caller folds α and 1/K into the weights

static void softmax_focal_ref(Ops *o, Tensor logits, const int32_t *labels,
                              const float *class_weights, float gamma, float prob_clip,
                              const float *grad_scale, float *stats, Tensor dlogits) {
    (void)o;
    xent_rows(logits, labels, class_weights, gamma, prob_clip, grad_scale, stats, dlogits);
}

// ----------------------------------------------------------------------------
// region terms: per-class sums over groups of pixels, then the gradient
//   I_c = Σ p_ic·[y_i = c], P_c = Σ p_ic, G_c = Σ [y_i = c] over a group's valid pixels
//   ∂L/∂z_ik = p_ik·(d_ik - Σ_j p_ij·d_ij), d_ik = B_k + [y_i = k]·A_k (region_coefs)

// p (K) = softmax of row r, in fp64 with the max subtracted
static void softmax_row(Tensor logits, size_t r, int K, double *p) {
    float zmax = -INFINITY;
    for (int c = 0; c < K; c++) zmax = fmaxf(zmax, ld(logits, r * K + c));
    double sum = 0.0;
    for (int c = 0; c < K; c++) sum += p[c] = exp((double)ld(logits, r * K + c) - zmax);
    for (int c = 0; c < K; c++) p[c] /= sum;
}

// The softmax's chain rule for row r from d_k = ∂L/∂p_k: dlogits_k += p_k·(d_k - Σ_j p_j·d_j)·scale
static void softmax_chain_add(Tensor logits, size_t r, int K, const double *d, float scale,
                              Tensor dlogits) {
    double p[SN_MAX_CLASSES], pd = 0.0;
    softmax_row(logits, r, K, p);
    for (int c = 0; c < K; c++) pd += p[c] * d[c];
    for (int c = 0; c < K; c++)
        st_acc(dlogits, r * K + c, (float)(p[c] * (d[c] - pd) * scale), 1);
}

// sums (groups,3,K): chunks of XENT_CHUNK rows, their partials added in chunk order
// (deterministic for any thread count), a group of chunks at a time in REGION_PARTIALS
// doubles on the stack (ops do not allocate)
#define REGION_PARTIALS 8192
static void region_sums_ref(Ops *o, Tensor logits, const int32_t *labels, int groups, float *sums,
                            float *rows_ws) {
    (void)o;
    (void)rows_ws;  // each row's softmax in fp64 where it is used
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K, per = rows / (size_t)groups;
    const size_t chunks = (per + XENT_CHUNK - 1) / XENT_CHUNK, width = 3 * (size_t)K;
    const size_t at_once = REGION_PARTIALS / width ? REGION_PARTIALS / width : 1;
    double part[REGION_PARTIALS > 3 * SN_MAX_CLASSES ? REGION_PARTIALS : 3 * SN_MAX_CLASSES];
    double total[3 * SN_MAX_CLASSES];
    for (int g = 0; g < groups; g++) {
        memset(total, 0, sizeof(double) * width);
        for (size_t k0 = 0; k0 < chunks; k0 += at_once) {
            const size_t k1 = k0 + at_once < chunks ? k0 + at_once : chunks;
            memset(part, 0, sizeof(double) * width * (k1 - k0));
            #pragma omp parallel for schedule(static) if(PAR(per * K))
            for (size_t k = k0; k < k1; k++) {
                double p[SN_MAX_CLASSES], *s = part + (k - k0) * width;
                const size_t r1 = (k + 1) * XENT_CHUNK < per ? (k + 1) * XENT_CHUNK : per;
                for (size_t r = g * per + k * XENT_CHUNK; r < g * per + r1; r++) {
                    const int32_t y = labels[r];
                    if (y < 0 || y >= K) continue;
                    softmax_row(logits, r, K, p);
                    s[y] += p[y];
                    for (int c = 0; c < K; c++) s[K + c] += p[c];
                    s[2 * K + y] += 1.0;
                }
            }
            for (size_t k = k0; k < k1; k++)
                for (size_t j = 0; j < width; j++) total[j] += part[(k - k0) * width + j];
        }
        for (size_t j = 0; j < width; j++) sums[(size_t)g * width + j] = (float)total[j];
    }
}

static void region_grad_ref(Ops *o, Tensor logits, const int32_t *labels, int groups,
                            const float *sums, const RegionArgs *args, const float *class_weights,
                            const float *grad_scale, float *coefs, float *loss, Tensor dlogits) {
    (void)o;
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K, per = rows / (size_t)groups;
    double total = 0.0;
    for (int g = 0; g < groups; g++)
        total += region_coefs(args, class_weights, K, sums + (size_t)g * 3 * K,
                              coefs + (size_t)g * 2 * K);
    *loss += (float)total;
    if (!dlogits.data) return;
    const float gscale = *grad_scale;
#pragma omp parallel for schedule(static) if (PAR(rows * K))
    for (size_t r = 0; r < rows; r++) {
        const int32_t y = labels[r];
        if (y < 0 || y >= K) continue;
        const float *A = coefs + r / per * 2 * K, *B = A + K;
        double d[SN_MAX_CLASSES];
        for (int c = 0; c < K; c++) d[c] = B[c] + (c == y ? A[c] : 0.0f);
        softmax_chain_add(logits, r, K, d, gscale, dlogits);
    }
}

// ----------------------------------------------------------------------------
// lovasz: per group and class, the errors sorted (qsort of lovasz_key), then one
// pass down the order: F and B count the class's and the other pixels passed,
//   L_c += e_(j)·lovasz_weight(G, F, B, [y = c]),  ∂L_c/∂p_ic = ∓ that weight
// then the group's weighted mean (lovasz_coefs) and the softmax's chain rule.

// p (K) of row r in fp32 as the CUDA op computes it (row_softmax_stats_kernel,
// lovasz_keys_kernel), so that both sort the same keys
static void softmax_row_f32(Tensor logits, size_t r, int K, float *p) {
    float zmax = -INFINITY, sum = 0.0f;
    for (int k = 0; k < K; k++) zmax = fmaxf(zmax, ld(logits, r * K + k));
    for (int k = 0; k < K; k++) sum += expf(ld(logits, r * K + k) - zmax);
    const float inv = 1.0f / sum;
    for (int k = 0; k < K; k++) p[k] = expf(ld(logits, r * K + k) - zmax) * inv;
}

static int key_order(const void *a, const void *b) {
    const uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
    return (x > y) - (x < y);
}

static void lovasz_ref(Ops *o, Tensor logits, const int32_t *labels, int groups, float scale,
                       const float *class_weights, const float *grad_scale, void *ws, float *loss,
                       Tensor dlogits) {
    (void)o;
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K, per = rows / (size_t)groups;
    const LovaszWs w = lovasz_ws(ws, groups, per, K);
    // the probabilities into dl first: a (group, class) reads its column, then writes it
#pragma omp parallel for schedule(static) if (PAR(rows * K))
    for (size_t r = 0; r < rows; r++) softmax_row_f32(logits, r, K, w.dl + r * K);
#pragma omp parallel for schedule(dynamic) if (PAR(rows * K))
    for (int s = 0; s < groups * K; s++) {
        const int g = s / K, c = s % K;
        uint64_t *keys = w.keys + (size_t)s * w.span;
        size_t n = 0;
        double G = 0.0;
        for (size_t i = 0; i < per; i++) {
            const int32_t y = labels[g * per + i];
            if (y < 0 || y >= K) continue;
            const float p = w.dl[(g * per + i) * K + c];
            keys[n++] = lovasz_key(y == c ? 1.0f - p : p, (uint32_t)i);
            G += y == c;
        }
        qsort(keys, n, sizeof *keys, key_order);
        double L = 0.0, F = 0.0, B = 0.0;
        for (size_t j = 0; j < n; j++) {
            const size_t r = g * per + (uint32_t)keys[j];
            const int in_class = labels[r] == c;
            const double weight = lovasz_weight(G, F, B, in_class);
            L += lovasz_key_error(keys[j]) * weight;
            w.dl[r * K + c] = (float)(in_class ? -weight : weight);
            F += in_class;
            B += !in_class;
        }
        w.seg[(size_t)g * 2 * K + c] = (float)L;
        w.seg[(size_t)g * 2 * K + K + c] = (float)G;
    }
    double total = 0.0;
    for (int g = 0; g < groups; g++)
        total += lovasz_coefs(w.seg + (size_t)g * 2 * K, class_weights, K, scale,
                              w.coef + (size_t)g * K);
    *loss += (float)total;
    if (!dlogits.data) return;
    const float gscale = *grad_scale;
#pragma omp parallel for schedule(static) if (PAR(rows * K))
    for (size_t r = 0; r < rows; r++) {
        const int32_t y = labels[r];
        if (y < 0 || y >= K) continue;
        const float *coef = w.coef + r / per * K;
        double d[SN_MAX_CLASSES];
        for (int c = 0; c < K; c++)
            d[c] = coef[c] != 0.0f ? (double)coef[c] * w.dl[r * K + c] : 0.0;
        softmax_chain_add(logits, r, K, d, gscale, dlogits);
    }
}

// ----------------------------------------------------------------------------
// per-image IoU (Ops.iou_per_image): each image's TP, FP, FN per class, its mean IoU

static void iou_per_image_ref(Ops *o, Tensor logits, const int32_t *labels,
                              const float *class_weights, int64_t *acc) {
    (void)o;
    const int K = logits.shape.c;
    const size_t per = (size_t)logits.shape.h * logits.shape.w;
    snCheck(K <= IOU_IMAGE_MAX_K, "iou_per_image: %d classes, at most %d", K, IOU_IMAGE_MAX_K);
    int64_t counts[3 * IOU_IMAGE_MAX_K];  // TP, FP, FN
    for (int n = 0; n < logits.shape.n; n++) {
        memset(counts, 0, sizeof(int64_t) * 3 * K);
        for (size_t r = n * per; r < (n + 1) * per; r++) {
            const int32_t y = labels[r];
            if (y < 0 || y >= K || !(class_weights[y] > 0.0f)) continue;
            const int p = argmax_row(logits, r, K);
            if (p == y) { counts[y]++; continue; }
            counts[K + p]++;
            counts[2 * K + y]++;
        }
        acc[0] += image_iou_fixed(counts, class_weights, K);
        acc[1]++;
    }
}
