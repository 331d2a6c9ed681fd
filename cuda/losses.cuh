// cuda/losses.cuh -- chapter 7 of the CUDA backend: the losses and metrics. Softmax
// cross-entropy and focal, the region terms, lovasz (a bitonic sort per class), IoU per
// image and the confusion matrix.
// Needs: the seam; the reductions (reduce_finish, channel_sums).

// ----------------------------------------------------------------------------
// fused softmax + weighted cross-entropy, per pixel (row of K logits), as the
// CPU op: p = softmax(z) with the max subtracted, nll = log Σ_k exp(z_k - max) + max - z_y,
// loss += w[y]·nll, wsum += w[y], dz_k = w[y]·(p_k - [k = y])·grad_scale.
// One thread per row (K is small for segmentation); the per-row arithmetic is
// fp32, the sums over rows fp64 through the deterministic reduction (reduce_finish).

// gamma < 0: cross-entropy, dlogits overwritten; else the focal term (focal_terms, fp64),
// dlogits added into (softmax_focal)
__global__ void softmax_xent_kernel(const void *logits, DType dt, const int32_t *labels,
                                    const float *class_weights, XentClip clip, float gamma, int K,
                                    size_t rows, const float *grad_scale, void *dlogits,
                                    DType dt_grad, ReduceOut r) {
    CU_SHARED(double, sh, [BLOCK * REDUCE_WIDTH]);
    const float scale = dlogits ? *grad_scale : 0.0f;
    double loss = 0.0, wsum = 0.0, invalid = 0.0;
    for (size_t r = blockIdx.x * (size_t)blockDim.x + threadIdx.x; r < rows;
         r += (size_t)blockDim.x * gridDim.x) {
        const int32_t y = labels[r];
        const float wy = y >= 0 && y < K ? class_weights[y] : 0.0f;
        if (y >= K) invalid += 1.0;
        const size_t base = r * (size_t)K;
        float zmax = -INFINITY;
        for (int c = 0; c < K; c++) { float z = ld(logits, dt, base + c); if (z > zmax) zmax = z; }
        float sum = 0.0f;
        for (int c = 0; c < K; c++) sum += expf(ld(logits, dt, base + c) - zmax);
        int flat = 0;
        float h = 1.0f;  // the focal term's factor of (p - onehot(y))
        if (wy != 0.0f) {
            float nll = (float)xent_clip(logf(sum) + zmax - ld(logits, dt, base + y), clip, &flat);
            if (gamma >= 0.0f) {
                double value, dh;
                focal_terms(nll, gamma, &value, &dh);
                nll = (float)value;
                h = (float)dh;
            }
            loss += (double)wy * nll;
            wsum += wy;
        }
        if (dlogits)
            for (int c = 0; c < K; c++) {
                float p = expf(ld(logits, dt, base + c) - zmax) / sum;
                float g = flat ? 0.0f : wy * h * (p - (c == y ? 1.0f : 0.0f)) * scale;
                st(dlogits, dt_grad, base + c,
                   gamma >= 0.0f ? ld(dlogits, dt_grad, base + c) + g : g);
            }
    }
    sh[threadIdx.x * REDUCE_WIDTH + 0] = loss;
    sh[threadIdx.x * REDUCE_WIDTH + 1] = wsum;
    sh[threadIdx.x * REDUCE_WIDTH + 2] = invalid;
    block_sum_tree(sh, 3);
    reduce_finish(r, sh);
}
// logits (N,H,W,K), labels (N·H·W), class_weights (K); stats[0..2] += Σ w·nll, Σ w, labels ≥ K
static void softmax_loss(Ops *o, Tensor logits, const int32_t *labels, const float *class_weights,
                         float gamma, float prob_clip, const float *grad_scale, float *stats,
                         Tensor dlogits) {
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K;
    unsigned grid = reduce_grid(rows);
    // logits, labels, and the logits' gradient when asked for (read too when added into)
    const double grad_bytes = dlogits.data ? bytes_of(dlogits) * (gamma >= 0.0f ? 2 : 1) : 0.0;
    const Traffic m = moves(bytes_of(logits) + rows * sizeof(int32_t) + grad_bytes);
    CU_LAUNCH(softmax_xent_kernel, grid, BLOCK, 0, stream_of(o), m, logits.data, logits.dtype,
              labels, class_weights, xent_clip_bounds(prob_clip), gamma, K, rows, grad_scale,
              dlogits.data, dlogits.dtype, reduce_out(o, stats, 3, 1));
    launchCheck();
}
static void softmax_xent_cuda(Ops *o, Tensor logits, const int32_t *labels,
                              const float *class_weights, float prob_clip, const float *grad_scale,
                              float *stats, Tensor dlogits) {
    softmax_loss(o, logits, labels, class_weights, -1.0f, prob_clip, grad_scale, stats, dlogits);
}
static void softmax_focal_cuda(Ops *o, Tensor logits, const int32_t *labels,
                               const float *class_weights, float gamma, float prob_clip,
                               const float *grad_scale, float *stats, Tensor dlogits) {
    softmax_loss(o, logits, labels, class_weights, gamma, prob_clip, grad_scale, stats, dlogits);
}

// ----------------------------------------------------------------------------
// region terms (segnet.c states them): each row's max and 1/Σexp into the
// scratch (a thread a row), the per-class sums by channel_sums (a lane being one
// class c of a group's rows: p = exp(z_c - max)·(1/Σ), O(1) a value), then the
// coefficients in one thread (region_coefs, groups in order) and the gradient one
// thread a row as softmax_xent's.

// stats (rows,2): max_k z_k and 1/Σ_k exp(z_k - max) of each row, fp32 as softmax_xent_kernel
__global__ void row_softmax_stats_kernel(const void *z, DType dt, int K, size_t rows,
                                         float *stats) {
    for (size_t r = blockIdx.x * (size_t)blockDim.x + threadIdx.x; r < rows;
         r += (size_t)blockDim.x * gridDim.x) {
        const size_t base = r * (size_t)K;
        float zmax = -INFINITY, sum = 0.0f;
        for (int k = 0; k < K; k++) zmax = fmaxf(zmax, ld(z, dt, base + k));
        for (int k = 0; k < K; k++) sum += expf(ld(z, dt, base + k) - zmax);
        stats[2 * r] = zmax;
        stats[2 * r + 1] = 1.0f / sum;
    }
}
// p_c of row r from its row_softmax_stats
static __device__ __forceinline__ float row_prob(const void *z, DType dt, const float *stats,
                                                 size_t r, int K, int c) {
    return expf(ld(z, dt, r * K + c) - stats[2 * r]) * stats[2 * r + 1];
}
struct RegionSums {
    const void *z;
    DType dt;
    const int32_t *labels;
    const float *stats;
    int K;
    uint32_t rows;
    struct Lane {
        const void *z;
        DType dt;
        const int32_t *labels;
        const float *stats;
        int K, c;
        __device__ void add(uint32_t r, double (&acc)[1][3]) const {
            const int32_t y = labels[r];
            if (y < 0 || y >= K) return;
            const double p = row_prob(z, dt, stats, r, K, c);
            acc[0][0] += y == c ? p : 0.0;
            acc[0][1] += p;
            acc[0][2] += y == c ? 1.0 : 0.0;
        }
    };
    __device__ Lane lane(int g, int c) const {
        const size_t at = (size_t)g * rows;
        return {elem_ptr(z, dt, at * K), dt, labels + at, stats + 2 * at, K, c};
    }
};
// sums (G,3,K): I, P, G of class c in group g
struct StoreRegionSums {
    float *sums;
    int K;
    __device__ void operator()(int g, int c, const double *s) const {
        for (int q = 0; q < 3; q++) sums[((size_t)g * 3 + q) * K + c] = (float)s[q];
    }
};
static void region_sums_cuda(Ops *o, Tensor logits, const int32_t *labels, int groups, float *sums,
                             float *rows_ws) {
    const int K = logits.shape.c;
    const size_t all = shape_numel(logits.shape) / K, rows = all / (size_t)groups;
    if (all) {
        CU_LAUNCH(row_softmax_stats_kernel, grid_for(all), BLOCK, 0, stream_of(o),
                  moves(bytes_of(logits) + all * 2 * sizeof(float)), logits.data, logits.dtype, K,
                  all, rows_ws);
        launchCheck();
    }
    channel_sums<3, 1>(o, RegionSums{logits.data, logits.dtype, labels, rows_ws, K, (uint32_t)rows},
                       StoreRegionSums{sums, K}, groups, rows, K,
                       bytes_of(logits) + all * (sizeof(int32_t) + 2 * sizeof(float) * K));
}

__global__ void region_coefs_kernel(int groups, int K, const float *sums, RegionArgs a,
                                    const float *class_weights, float *coefs, float *loss) {
    double total = 0.0;
    for (int g = 0; g < groups; g++)
        total += region_coefs(&a, class_weights, K, sums + (size_t)g * 3 * K,
                              coefs + (size_t)g * 2 * K);
    *loss += (float)total;
}
// blockIdx.y: the group, whose `per` rows the x blocks stride over
__global__ void region_grad_kernel(const void *z, DType dt, const int32_t *labels, int K,
                                   size_t per, const float *coefs, const float *grad_scale,
                                   void *dz, DType dt_grad) {
    const float scale = *grad_scale;
    const float *A = coefs + (size_t)blockIdx.y * 2 * K, *B = A + K;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < per;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t r = blockIdx.y * per + i;
        const int32_t y = labels[r];
        if (y < 0 || y >= K) continue;
        const size_t base = r * (size_t)K;
        float zmax = -INFINITY, sum = 0.0f, pd = 0.0f;
        for (int c = 0; c < K; c++) zmax = fmaxf(zmax, ld(z, dt, base + c));
        for (int c = 0; c < K; c++) sum += expf(ld(z, dt, base + c) - zmax);
        for (int c = 0; c < K; c++) pd += expf(ld(z, dt, base + c) - zmax) / sum * B[c];
        pd += expf(ld(z, dt, base + y) - zmax) / sum * A[y];
        for (int c = 0; c < K; c++) {
            const float p = expf(ld(z, dt, base + c) - zmax) / sum;
            const float d = B[c] + (c == y ? A[c] : 0.0f);
            st(dz, dt_grad, base + c, ld(dz, dt_grad, base + c) + p * (d - pd) * scale);
        }
    }
}
static void region_grad_cuda(Ops *o, Tensor logits, const int32_t *labels, int groups,
                             const float *sums, const RegionArgs *args, const float *class_weights,
                             const float *grad_scale, float *coefs, float *loss, Tensor dlogits) {
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K;
    CU_LAUNCH(region_coefs_kernel, 1, 1, 0, stream_of(o),
              moves(sizeof(float) * (5.0 * K * groups + K)), groups, K, sums, *args, class_weights,
              coefs, loss);
    launchCheck();
    if (!dlogits.data || !rows) return;
    const unsigned per_group = grid_for(rows) / (unsigned)groups;
    CU_LAUNCH(region_grad_kernel, dim3(per_group ? per_group : 1, groups), BLOCK, 0, stream_of(o),
              moves(bytes_of(logits) + rows * sizeof(int32_t) + 2.0 * bytes_of(dlogits)),
              logits.data, logits.dtype, labels, K, rows / (size_t)groups, coefs, grad_scale,
              dlogits.data, dlogits.dtype);
    launchCheck();
}

// ----------------------------------------------------------------------------
// lovasz (lovasz_ref states it): each row's max and 1/Σexp (row_softmax_stats_kernel),
// a sort key per (group, class, pixel) padded to a power of two per (group, class),
// the keys sorted by a bitonic network (each span's own ascending order: the
// direction bit of stage k is bit k of the position inside the span), then the
// walk: a block per chunk of LOVASZ_SORT_TILE sorted positions, F at the chunk's
// start from a scan of the chunks' counts of the class's pixels, F and B at each
// position hence its weight, its error's part of L_c and ∂L_c/∂p. The coefficients
// in one thread, the gradient a thread a row.

// the keys of span-long runs (group, class); a position past `per`, or a pixel without a label
// in 0..K-1, gets LOVASZ_PAD
__global__ void lovasz_keys_kernel(const void *z, DType dt, const int32_t *labels, int K,
                                   size_t per, int span_log2, size_t n, const float *stats,
                                   unsigned long long *keys) {
    const size_t span = (size_t)1 << span_log2;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < n;
         t += (size_t)blockDim.x * gridDim.x) {
        const size_t i = t & (span - 1);
        const unsigned s = (unsigned)(t >> span_log2);
        const unsigned g = s / (unsigned)K, c = s % (unsigned)K;
        const size_t r = g * per + i;
        const int32_t y = i < per ? labels[r] : -1;
        if (y < 0 || y >= K) {
            keys[t] = LOVASZ_PAD;
            continue;
        }
        const float p = row_prob(z, dt, stats, r, K, (int)c);
        keys[t] = lovasz_key(y == (int32_t)c ? 1.0f - p : p, (uint32_t)i);
    }
}

// one compare-exchange of the bitonic network at pair q of stage (k, j): positions i and
// i + j, in increasing order where bit k of i's position in its span is 0
static __device__ __forceinline__ void bitonic_exchange(unsigned long long *a, size_t q, size_t at,
                                                        size_t span, size_t k, size_t j) {
    const size_t i = ((q & ~(j - 1)) << 1) | (q & (j - 1));
    const bool up = (((at + i) & (span - 1)) & k) == 0;
    const unsigned long long x = a[i], y = a[i + j];
    if ((x > y) == up) {
        a[i] = y;
        a[i + j] = x;
    }
}
// the stages of a LOVASZ_SORT_TILE-key tile in shared memory: k from k_lo to k_hi, j from
// j_top (the first k) or k/2 down to 1
__global__ void bitonic_tile_kernel(unsigned long long *keys, size_t span, size_t k_lo, size_t k_hi,
                                    size_t j_top) {
    CU_SHARED(unsigned long long, tile, [LOVASZ_SORT_TILE]);
    const size_t at = (size_t)blockIdx.x * LOVASZ_SORT_TILE;
    for (int i = threadIdx.x; i < LOVASZ_SORT_TILE; i += blockDim.x) tile[i] = keys[at + i];
    __syncthreads();
    for (size_t k = k_lo; k <= k_hi; k <<= 1)
        for (size_t j = k == k_lo ? j_top : k >> 1; j > 0; j >>= 1) {
            for (size_t q = threadIdx.x; q < LOVASZ_SORT_TILE / 2; q += blockDim.x)
                bitonic_exchange(tile, q, at, span, k, j);
            __syncthreads();
        }
    for (int i = threadIdx.x; i < LOVASZ_SORT_TILE; i += blockDim.x) keys[at + i] = tile[i];
}
// one stage (k, j ≥ LOVASZ_SORT_TILE) over all n keys
__global__ void bitonic_step_kernel(unsigned long long *keys, size_t n, size_t span, size_t k,
                                    size_t j) {
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < n / 2;
         q += (size_t)blockDim.x * gridDim.x)
        bitonic_exchange(keys, q, 0, span, k, j);
}
// each span of n keys (n/span spans, span a power of two ≥ LOVASZ_SORT_TILE) in increasing order
static void bitonic_sort(Ops *o, unsigned long long *keys, size_t n, size_t span) {
    const unsigned tiles = (unsigned)(n / LOVASZ_SORT_TILE), threads = LOVASZ_SORT_TILE / 2;
    const Traffic once = moves(2.0 * sizeof(uint64_t) * n);
    CU_LAUNCH(bitonic_tile_kernel, tiles, threads, 0, stream_of(o), once, keys, span, (size_t)2,
              (size_t)LOVASZ_SORT_TILE, (size_t)1);
    launchCheck();
    for (size_t k = 2 * (size_t)LOVASZ_SORT_TILE; k <= span; k <<= 1) {
        for (size_t j = k / 2; j >= LOVASZ_SORT_TILE; j >>= 1) {
            CU_LAUNCH(bitonic_step_kernel, grid_for(n / 2), BLOCK, 0, stream_of(o), once, keys, n,
                      span, k, j);
            launchCheck();
        }
        CU_LAUNCH(bitonic_tile_kernel, tiles, threads, 0, stream_of(o), once, keys, span, k, k,
                  (size_t)LOVASZ_SORT_TILE / 2);
        launchCheck();
    }
}

// The walk in chunks of LOVASZ_SORT_TILE positions, a block each, LOVASZ_WALK_ITEMS
// consecutive positions a thread: the class's pixels counted per chunk, those counts
// scanned per (group, class) into each chunk's F at its start and G, then each chunk's
// weights (a scan of its threads' counts gives each thread F at its first position) and
// its part of L_c, added per class in chunk order by the coefficients' thread.
#define LOVASZ_WALK_ITEMS (LOVASZ_SORT_TILE / BLOCK)
// the pixels of class c at the thread's positions of chunk `chunk` (c: the chunk's class)
static __device__ unsigned lovasz_in_class(const unsigned long long *keys, size_t chunk,
                                           int span_log2, const int32_t *labels, int K,
                                           size_t per) {
    const size_t first = chunk * LOVASZ_SORT_TILE + (size_t)threadIdx.x * LOVASZ_WALK_ITEMS;
    const unsigned s = (unsigned)(first >> span_log2), g = s / (unsigned)K, c = s % (unsigned)K;
    unsigned in = 0;
    for (int q = 0; q < LOVASZ_WALK_ITEMS; q++) {
        const unsigned long long key = keys[first + q];
        in += key != LOVASZ_PAD && labels[g * per + (uint32_t)key] == (int32_t)c;
    }
    return in;
}
__global__ void lovasz_count_kernel(const unsigned long long *keys, int span_log2,
                                    const int32_t *labels, int K, size_t per, uint32_t *counts) {
    CU_SHARED(unsigned, part, [BLOCK]);
    part[threadIdx.x] = lovasz_in_class(keys, blockIdx.x, span_log2, labels, K, per);
    __syncthreads();
    for (unsigned s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) counts[blockIdx.x] = part[0];
}
// a thread a (group, class): its chunks' counts into their exclusive prefix sums, G into seg_in
__global__ void lovasz_offsets_kernel(uint32_t *counts, size_t chunks_per_seg, size_t segs,
                                      uint32_t *seg_in) {
    for (size_t s = blockIdx.x * (size_t)blockDim.x + threadIdx.x; s < segs;
         s += (size_t)blockDim.x * gridDim.x) {
        uint32_t sum = 0;
        for (size_t k = s * chunks_per_seg; k < (s + 1) * chunks_per_seg; k++) {
            const uint32_t c = counts[k];
            counts[k] = sum;
            sum += c;
        }
        seg_in[s] = sum;
    }
}
__global__ void lovasz_walk_kernel(const unsigned long long *keys, int span_log2,
                                   const int32_t *labels, int K, size_t per,
                                   const uint32_t *offsets, const uint32_t *seg_in, float *dl,
                                   double *chunk_loss) {
    CU_SHARED(unsigned, before, [BLOCK]);
    CU_SHARED(double, sh, [BLOCK * REDUCE_WIDTH]);
    const size_t chunk = blockIdx.x, at = chunk * LOVASZ_SORT_TILE, span = (size_t)1 << span_log2;
    const unsigned s = (unsigned)(at >> span_log2), g = s / (unsigned)K, c = s % (unsigned)K;
    const unsigned G = seg_in[s];
    const unsigned mine = G ? lovasz_in_class(keys, chunk, span_log2, labels, K, per) : 0;
    before[threadIdx.x] = mine;
    __syncthreads();
    for (unsigned off = 1; off < BLOCK; off <<= 1) {  // inclusive scan (Hillis-Steele)
        const unsigned v = threadIdx.x >= off ? before[threadIdx.x - off] : 0;
        __syncthreads();
        before[threadIdx.x] += v;
        __syncthreads();
    }
    unsigned F = offsets[chunk] + before[threadIdx.x] - mine;
    const size_t first = (at & (span - 1)) + (size_t)threadIdx.x * LOVASZ_WALK_ITEMS;
    double acc = 0.0;
    for (int q = 0; q < LOVASZ_WALK_ITEMS && G; q++) {
        const unsigned long long key = keys[at + (size_t)threadIdx.x * LOVASZ_WALK_ITEMS + q];
        if (key == LOVASZ_PAD) break;  // the valid keys come first
        const uint32_t i = (uint32_t)key;
        const int in_class = labels[g * per + i] == (int32_t)c;
        const double w = lovasz_weight(G, F, (double)(first + q) - F, in_class);
        acc += lovasz_key_error(key) * w;
        dl[((size_t)g * per + i) * K + c] = (float)(in_class ? -w : w);
        F += in_class;
    }
    sh[threadIdx.x * REDUCE_WIDTH] = acc;
    block_sum_tree(sh, 1);
    if (threadIdx.x == 0) chunk_loss[chunk] = sh[0];
}
// L_c of each (group, class) from its chunks in order, G_c, then the groups' coefficients
__global__ void lovasz_coefs_kernel(int groups, int K, size_t chunks_per_seg,
                                    const double *chunk_loss, const uint32_t *seg_in, float *seg,
                                    const float *w, float scale, float *coef, float *loss) {
    double total = 0.0;
    for (int g = 0; g < groups; g++) {
        float *sg = seg + (size_t)g * 2 * K;
        for (int c = 0; c < K; c++) {
            const size_t s = (size_t)g * K + c;
            double L = 0.0;
            for (size_t k = s * chunks_per_seg; k < (s + 1) * chunks_per_seg; k++)
                L += chunk_loss[k];
            sg[c] = (float)L;
            sg[K + c] = (float)seg_in[s];
        }
        total += lovasz_coefs(sg, w, K, scale, coef + (size_t)g * K);
    }
    *loss += (float)total;
}
// blockIdx.y: the group, whose `per` rows the x blocks stride over. p_k·(d_k - Σ_j p_j·d_j) as
// p_k·(d_k·Σ_j p_j - Σ_j p_j·d_j) = p_k·Σ_j p_j·(d_k - d_j) in fp64: where p_k is near 1 the
// difference is far below d_k, and fp32 p summing to 1 ± K ulp would swamp it
__global__ void lovasz_grad_kernel(const void *z, DType dt, const int32_t *labels, int K,
                                   size_t per, const float *stats, const float *dl,
                                   const float *coefs, const float *grad_scale, void *dz,
                                   DType dt_grad) {
    const float scale = *grad_scale;
    const float *coef = coefs + (size_t)blockIdx.y * K;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < per;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t r = blockIdx.y * per + i, base = r * (size_t)K;
        const int32_t y = labels[r];
        if (y < 0 || y >= K) continue;
        double ps = 0.0, pd = 0.0;
        for (int c = 0; c < K; c++) {
            const double p = row_prob(z, dt, stats, r, K, c);
            ps += p;
            if (coef[c] != 0.0f) pd += p * ((double)coef[c] * dl[base + c]);
        }
        for (int c = 0; c < K; c++) {
            const double p = row_prob(z, dt, stats, r, K, c);
            const double d = coef[c] != 0.0f ? (double)coef[c] * dl[base + c] : 0.0;
            const float g = (float)(p * (d * ps - pd) * scale);
            st(dz, dt_grad, base + c, ld(dz, dt_grad, base + c) + g);
        }
    }
}
static void lovasz_cuda(Ops *o, Tensor logits, const int32_t *labels, int groups, float scale,
                        const float *class_weights, const float *grad_scale, void *ws, float *loss,
                        Tensor dlogits) {
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K, per = rows / (size_t)groups;
    require_below(per, (size_t)1 << 32, "pixels of a lovasz group");
    const LovaszWs w = lovasz_ws(ws, groups, per, K);
    unsigned long long *keys = (unsigned long long *)w.keys;
    const size_t n = (size_t)groups * K * w.span;
    int span_log2 = 0;
    while (((size_t)1 << span_log2) < w.span) span_log2++;
    if (rows) {
        CU_LAUNCH(row_softmax_stats_kernel, grid_for(rows), BLOCK, 0, stream_of(o),
                  moves(bytes_of(logits) + rows * 2 * sizeof(float)), logits.data, logits.dtype, K,
                  rows, w.rows);
        launchCheck();
    }
    CU_LAUNCH(lovasz_keys_kernel, grid_for(n), BLOCK, 0, stream_of(o),
              moves(bytes_of(logits) + rows * (sizeof(int32_t) + 2 * sizeof(float)) * K +
                    n * sizeof(uint64_t)),
              logits.data, logits.dtype, labels, K, per, span_log2, n, w.rows, keys);
    launchCheck();
    bitonic_sort(o, keys, n, w.span);
    const size_t chunks = n / LOVASZ_SORT_TILE, per_seg = w.span / LOVASZ_SORT_TILE,
                 segs = (size_t)groups * K;
    require_below(chunks, (size_t)1 << 31, "chunks of the lovasz sort");
    const double walk_bytes = n * sizeof(uint64_t) + rows * K * sizeof(int32_t);
    CU_LAUNCH(lovasz_count_kernel, (unsigned)chunks, BLOCK, 0, stream_of(o), moves(walk_bytes),
              keys, span_log2, labels, K, per, w.chunk_in);
    launchCheck();
    CU_LAUNCH(lovasz_offsets_kernel, grid_for(segs), BLOCK, 0, stream_of(o),
              moves(2.0 * chunks * sizeof(uint32_t)), w.chunk_in, per_seg, segs, w.seg_in);
    launchCheck();
    CU_LAUNCH(lovasz_walk_kernel, (unsigned)chunks, BLOCK, 0, stream_of(o),
              moves(walk_bytes + rows * K * sizeof(float)), keys, span_log2, labels, K, per,
              w.chunk_in, w.seg_in, w.dl, w.chunk_loss);
    launchCheck();
    CU_LAUNCH(lovasz_coefs_kernel, 1, 1, 0, stream_of(o),
              moves(chunks * sizeof(double) + sizeof(float) * 4.0 * K * groups), groups, K,
              per_seg, w.chunk_loss, w.seg_in, w.seg, class_weights, scale, w.coef, loss);
    launchCheck();
    if (!dlogits.data || !rows) return;
    const unsigned per_group = grid_for(rows) / (unsigned)groups;
    CU_LAUNCH(lovasz_grad_kernel, dim3(per_group ? per_group : 1, groups), BLOCK, 0, stream_of(o),
              moves(bytes_of(logits) + rows * (sizeof(int32_t) + 2 * sizeof(float) * (1 + K)) +
                    2.0 * bytes_of(dlogits)),
              logits.data, logits.dtype, labels, K, per, w.rows, w.dl, w.coef, grad_scale,
              dlogits.data, dlogits.dtype);
    launchCheck();
}

// the first class of the largest logit of the row at base (ties to the lowest, as the CPU's
// argmax_row: a NaN never wins unless first)
static __device__ int argmax_at(const void *logits, DType dt, size_t base, int K) {
    int best = 0;
    float zbest = ld(logits, dt, base);
    for (int c = 1; c < K; c++) {
        const float z = ld(logits, dt, base + c);
        if (z > zbest) {
            zbest = z;
            best = c;
        }
    }
    return best;
}

// Shared-memory counters are 32-bit: sm_90 adds them with one atomic instruction
// (ATOMS.ADD), where a 64-bit add to shared memory is a compare-and-swap loop
// (ATOMS.CAST.SPIN.64); a block counts fewer than 2^32 pixels (checked by the host).

// iou_per_image: a block per image counts TP, FP, FN per class in shared memory
// (integer atomics: exact), widens them to 64 bits, then its first thread adds
// the image's fixed-point mean IoU (image_iou_fixed, segnet.h).
__global__ void iou_per_image_kernel(const void *logits, DType dt, const int32_t *labels, int K,
                                     size_t per, const float *w, unsigned long long *acc) {
    CU_DYN_SHARED(int64_t, wide);  // (3,K) TP, FP, FN, then as 32-bit counters (3,K)
    unsigned *counts = reinterpret_cast<unsigned *>(wide + 3 * K);
    for (int i = threadIdx.x; i < 3 * K; i += blockDim.x) counts[i] = 0;
    __syncthreads();
    for (size_t i = threadIdx.x; i < per; i += blockDim.x) {
        const size_t r = blockIdx.x * per + i;
        const int32_t y = labels[r];
        if (y < 0 || y >= K || !(w[y] > 0.0f)) continue;
        const int best = argmax_at(logits, dt, r * (size_t)K, K);
        if (best == y) {
            atomicAdd(&counts[y], 1u);
        } else {
            atomicAdd(&counts[K + best], 1u);
            atomicAdd(&counts[2 * K + y], 1u);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 3 * K; i += blockDim.x) wide[i] = counts[i];
    __syncthreads();
    if (threadIdx.x != 0) return;
    atomicAdd(&acc[0], (unsigned long long)image_iou_fixed(wide, w, K));
    atomicAdd(&acc[1], 1ull);
}
static void iou_per_image_cuda(Ops *o, Tensor logits, const int32_t *labels,
                               const float *class_weights, int64_t *acc) {
    const int K = logits.shape.c, N = logits.shape.n;
    require_below((size_t)K, IOU_IMAGE_MAX_K + 1, "classes of iou_per_image");
    if (!N) return;
    const size_t per = (size_t)logits.shape.h * logits.shape.w;
    require_below(per, (size_t)1 << 32, "pixels of an image (iou_per_image's 32-bit counters)");
    CU_LAUNCH(iou_per_image_kernel, N, BLOCK, (sizeof(int64_t) + sizeof(unsigned)) * 3 * K,
              stream_of(o),
              moves(bytes_of(logits) + N * per * sizeof(int32_t)), logits.data, logits.dtype,
              labels, K, per, class_weights, (unsigned long long *)acc);
    launchCheck();
}

// confusion[y·K + argmax_k z_k] += 1 for labels in 0..K-1, ties to the lowest
// class (the CPU's strict >, so a NaN logit never wins unless it is the first).
// Integer atomics are exact, so the counts are deterministic. For K ≤
// CONFUSION_SHARED_MAX_K each block counts in shared memory first and adds its
// K×K counts once: segmentation has few classes and many pixels, which would
// otherwise all hit the same few counters.
#define CONFUSION_SHARED_MAX_K 64  // K·K·4 bytes = 16 KiB of shared memory at most

__global__ void confusion_kernel(const void *logits, DType dt, const int32_t *labels, int K,
                                 size_t rows, unsigned long long *confusion, int in_shared) {
    CU_DYN_SHARED(unsigned, block_counts);  // (K,K) when in_shared
    if (in_shared) {
        for (int i = threadIdx.x; i < K * K; i += blockDim.x) block_counts[i] = 0;
        __syncthreads();
    }
    for (size_t r = blockIdx.x * (size_t)blockDim.x + threadIdx.x; r < rows;
         r += (size_t)blockDim.x * gridDim.x) {
        const int32_t y = labels[r];
        if (y < 0 || y >= K) continue;
        const int at = y * K + argmax_at(logits, dt, r * (size_t)K, K);
        if (in_shared) atomicAdd(&block_counts[at], 1u);
        else atomicAdd(&confusion[at], 1ull);
    }
    if (in_shared) {
        __syncthreads();
        for (int i = threadIdx.x; i < K * K; i += blockDim.x)
            if (block_counts[i]) atomicAdd(&confusion[i], (unsigned long long)block_counts[i]);
    }
}
// logits (N,H,W,K), labels (N·H·W), confusion (K,K) int64, true class by row
static void confusion_accumulate_cuda(Ops *o, Tensor logits, const int32_t *labels,
                                      int64_t *confusion) {
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K;
    if (!rows) return;
    const int in_shared = K <= CONFUSION_SHARED_MAX_K && rows < ((size_t)1 << 32);
    const size_t smem = in_shared ? (size_t)K * K * sizeof(unsigned) : 0;
    CU_LAUNCH(confusion_kernel, grid_for(rows), BLOCK, smem, stream_of(o),
              moves(bytes_of(logits) + rows * sizeof(int32_t)), logits.data, logits.dtype, labels,
              K, rows, (unsigned long long *)confusion, in_shared);
    launchCheck();
}
