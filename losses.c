// losses.c -- the loss menu's terms beyond cross-entropy (part I; segnet.c
// includes it after softmax_xent_ref): the focal term and the region terms
// (dice, jaccard, tversky), and the per-image IoU. Their formulas are in segnet.h
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
        double p[SN_MAX_CLASSES], pd = 0.0;
        softmax_row(logits, r, K, p);
        for (int c = 0; c < K; c++) pd += p[c] * B[c];
        pd += p[y] * A[y];
        for (int c = 0; c < K; c++) {
            const double d = B[c] + (c == y ? A[c] : 0.0f);
            st_acc(dlogits, r * K + c, (float)(p[c] * (d - pd) * gscale), 1);
        }
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
