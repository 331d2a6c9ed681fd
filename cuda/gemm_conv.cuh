// cuda/gemm_conv.cuh -- chapter 5 of the CUDA backend: convolutions through cuBLAS, the
// reference path (every product one cublasGemmEx, gemm_ex): the conv plan and its workspace,
// im2col, col2im and the bias rows; and the depthwise convs' direct kernels, which have no
// GEMM form. The conv2d entries that choose among the paths close the next chapter.
// Needs: the seam; the reductions' last-block protocol; elementwise's image rows (depthwise).

// ----------------------------------------------------------------------------
// conv2d
//
// k×k convs (stride ≤ 2, sm_80+) run as implicit GEMMs ("implicit-GEMM
// convolution" below); what follows first is the reference path they replace
// (SEGNET_CONV=gemm, and the only path otherwise), and the path of every
// pointwise conv. The lowering of the CPU ops (segnet.c, "conv2d"), on cuBLAS:
//   pointwise (1×1 stride 1 dense; dense layers are 1×1 convs on (N,1,1,C)):
//     NHWC is already the GEMM operand [N·H·W][Cin], so each op is one GEMM
//     on the tensors themselves, no copies.
//   other dense and grouped convs: im2col of a chunk of output pixels into
//     the workspace, col[p][g][ky][kx][ci] (K = kh·kw·Cg per group), then per group
//       forward          out_g[p][co]  = col_g[p][K] · W_g[co][K]ᵀ
//       backward data    dcol_g[p][K]  = dout_g[p][co] · W_g[co][K]   (fp32), then col2im
//       backward weight  dW_g[co][K]  += dout_g[p][co]ᵀ · col_g[p][K]
//     col2im is a gather: each input element sums the dcol entries that read it
//     in (ky, kx) order and is written once (deterministic, no atomics).
//   depthwise: direct kernels with threads along C; the weight gradient is a
//     fixed-order reduction over N·OH·OW (parts, added by the last block).
// cuBLAS is column-major: a row-major (R×C) matrix with leading dimension ld is
// the column-major (C×R) matrix with the same ld, so every product above is
// issued transposed, Cᵀ = op(B)ᵀ·op(A)ᵀ (see each call).
//
// Storage types: fp16/bf16 GEMMs read 16-bit A and B and accumulate in fp32
// (CUBLAS_COMPUTE_32F, tensor cores). The weights are rounded to the storage
// type into the workspace (a rounding the CPU does not make: the tests allow
// for it); im2col columns are copies of stored values (exact). Every output is
// rounded once from fp32, as on the CPU:
//   - forward without bias, pointwise backward data: the GEMM writes the
//     storage type; accumulate = 1 is beta = 1, which cuBLAS evaluates in fp32
//     and rounds once (= st_acc);
//   - forward with bias: fp32 rows in the workspace, then one kernel adds the
//     bias and rounds (round(acc + b), not round(round(acc) + b));
//   - im2col backward data: dcol in fp32, col2im adds and rounds once.
// Parameter gradients are fp32 (the GEMM's C, beta = 1: added into).
//
// Workspace (conv2d_workspace, the same plan as the ops): the 16-bit weights,
// then the columns of at most cuda_conv_chunk_bytes of output rows (whole
// images when one fits, else bands of rows of one image; at least one row), or
// the depthwise weight gradient's partial sums. The ops run chunk after chunk on one
// stream, so a chunk may reuse the previous chunk's space.

// 64 MiB: a large conv still runs as a few big GEMMs
size_t cuda_conv_chunk_bytes = (size_t)64 << 20;

#define WS_ALIGN 256          // each part of the workspace starts on a 256-byte boundary
// the depthwise weight gradient: one block sums at least REDUCE_ROWS pixels, and there are at
// most REDUCE_PARTS_MAX partial sums per weight
#define REDUCE_ROWS 256
#define REDUCE_PARTS_MAX 64

static size_t align_up(size_t b) { return (b + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN; }

// what a conv on a given input does, and where its workspace parts are
typedef struct {
    ConvGeom q;
    int G, GK;             // groups; columns of an im2col row, G·K = kh·kw·Cin
    int pointwise, depthwise;
    int implicit;          // forward and backward by the implicit-GEMM kernels (no columns)
    // implicit backward weight: pixel ranges summed apart (partials in `reduce`)...
    int wgrad_parts;
    uint32_t wgrad_part_pixels;  // ...of this many pixels each (a multiple of IG_BK)
    DType dt;
    int fwd_rows;          // output rows (n,oy) per forward / backward-weight chunk
    int bwd_rows;          // input rows (n,iy) per backward-data chunk
    int bwd_out_rows;      // the most output rows a backward-data chunk reads
    int parts;             // partial sums per column of a reduction over N·OH·OW
    // bytes of the weights in the storage type (at ws + 0; what follows is aligned)
    size_t wcast;
    size_t col_row;        // bytes of im2col columns per output row (storage type)
    size_t rows32_row;     // bytes of fp32 output rows per output row (forward with bias, 16-bit)
    size_t dcol_row;       // bytes of fp32 dcol per output row
    size_t reduce;         // bytes of partial sums of the backward-weight reductions
} ConvPlan;

// rows per chunk: whole images when one fits in `cap`, else as many rows as fit (at least 1)
static int rows_per_chunk(size_t row_bytes, int rows_per_image, int images, size_t cap) {
    if (row_bytes == 0) return rows_per_image * images;
    size_t image = row_bytes * rows_per_image;
    if (image <= cap)
        return rows_per_image * (int)(cap / image < (size_t)images ? cap / image : (size_t)images);
    size_t r = cap / row_bytes;
    return r < 1 ? 1 : (int)r;
}
// the chunk starting at row t0: whole images or a band inside one image
static int chunk_end(int t0, int step, int rows_per_image, int total) {
    int end = t0 + step, image_end = (t0 / rows_per_image + 1) * rows_per_image;
    if (step < rows_per_image && end > image_end) end = image_end;  // a band stays inside its image
    return end < total ? end : total;
}
// Output rows [*t0, *t1) (flattened n·OH + oy) that input rows [u0, u1)
// (flattened n·H + iy, whole images or a band of one) read in backward data:
// oy·s - pt + ky = iy for some ky in [0, kh).
static void bwd_band_out_rows(const ConvCfg *cfg, const ConvGeom *q, int u0, int u1, int *t0,
                              int *t1) {
    const int s = cfg->stride, n0 = u0 / q->H, iy0 = u0 % q->H, n1 = (u1 - 1) / q->H,
              iy1 = (u1 - 1) % q->H;
    int lo = iy0 + q->pt - (cfg->kh - 1);             // s·oy >= lo
    int oy_lo = lo <= 0 ? 0 : (lo + s - 1) / s;
    int oy_hi = (iy1 + q->pt) / s;                    // s·oy <= iy1 + pt
    if (oy_hi > q->OH - 1) oy_hi = q->OH - 1;
    *t0 = n0 * q->OH + oy_lo;
    *t1 = n1 * q->OH + oy_hi + 1;
    // rows no output reads: din = 0 (or unchanged)
    if (*t1 < *t0) *t1 = *t0;
}

static void conv_fail(const char *what, const ConvCfg *cfg, Shape in) {
    fprintf(stderr,
            "segnet: internal error in %s: input (%d,%d,%d,%d) for conv cin %d cout %d kernel "
            "%dx%d groups %d\n",
            what, in.n, in.h, in.w, in.c, cfg->cin, cfg->cout, cfg->kh, cfg->kw, cfg->groups);
    exit(1);
}

static bool conv_takes_implicit(Ops *o, const ConvCfg *cfg);
static int depthwise_weight_parts(const ConvGeom *q, int want);
static void wgrad_split(const ConvCfg *cfg, const ConvGeom *q, int *parts, uint32_t *part_pixels);
static ConvPlan conv_plan(Ops *o, const ConvCfg *cfg, Shape in, DType dt) {
    ConvPlan p;
    memset(&p, 0, sizeof p);
    if (!conv_geom_of(cfg, in, &p.q)) conv_fail("conv2d (input does not fit)", cfg, in);
    const ConvGeom *q = &p.q;
    const size_t es = dtype_size(dt), cap = cuda_conv_chunk_bytes;
    p.G = cfg->groups; p.GK = cfg->groups * q->K; p.dt = dt;
    p.pointwise = conv_is_pointwise(cfg); p.depthwise = conv_is_depthwise(cfg);
    p.implicit = conv_takes_implicit(o, cfg);
    size_t M = (size_t)q->N * q->P;
    p.parts = (int)((M + REDUCE_ROWS - 1) / REDUCE_ROWS);
    if (p.parts > REDUCE_PARTS_MAX) p.parts = REDUCE_PARTS_MAX;
    if (p.parts < 1) p.parts = 1;
    if (p.depthwise) {  // the weight gradient's partial sums, [part][c][ky][kx]
        p.parts = depthwise_weight_parts(q, p.parts);
        p.reduce = (size_t)p.parts * q->C * cfg->kh * cfg->kw * sizeof(float);
        return p;
    }
    p.wcast = dt == DT_F32 ? 0 : (size_t)q->Cout * q->K * es;
    if (p.implicit) {
        wgrad_split(cfg, q, &p.wgrad_parts, &p.wgrad_part_pixels);
        p.reduce = p.wgrad_parts > 1 ? (size_t)p.wgrad_parts * q->Cout * q->K * sizeof(float) : 0;
        return p;
    }
    p.col_row = p.pointwise ? 0 : (size_t)q->OW * p.GK * es;
    p.rows32_row = dt != DT_F32 && cfg->has_bias ? (size_t)q->OW * q->Cout * sizeof(float) : 0;
    p.dcol_row = p.pointwise ? 0 : (size_t)q->OW * p.GK * sizeof(float);
    p.fwd_rows = rows_per_chunk(p.col_row + p.rows32_row, q->OH, q->N, cap);
    if (p.pointwise) { p.bwd_rows = q->N * q->H; p.bwd_out_rows = 0; return p; }
    // backward data: bands of input rows whose dcol (at most (b-1+kh-1)/s + 1 output rows) fits
    if (p.dcol_row * q->OH <= cap) {
        p.bwd_rows = rows_per_chunk(p.dcol_row, q->OH, q->N, cap) / q->OH * q->H;
    } else {
        int b = q->H - 1;
        while (b > 1 && (size_t)((b - 1 + cfg->kh - 1) / cfg->stride + 1) * p.dcol_row > cap) b--;
        p.bwd_rows = b < 1 ? 1 : b;
    }
    for (int u0 = 0, total = q->N * q->H; u0 < total;) {
        int u1 = chunk_end(u0, p.bwd_rows, q->H, total), t0, t1;
        bwd_band_out_rows(cfg, q, u0, u1, &t0, &t1);
        if (t1 - t0 > p.bwd_out_rows) p.bwd_out_rows = t1 - t0;
        u0 = u1;
    }
    return p;
}
// the workspace parts of each op (bytes from ws); conv2d_workspace is their maximum
static size_t ws_forward(const ConvPlan *p) {
    if (p->implicit) return p->wcast;
    size_t col = p->fwd_rows * p->col_row, rows32 = p->fwd_rows * p->rows32_row;
    if (rows32) col = align_up(col) + rows32;
    return col ? align_up(p->wcast) + col : p->wcast;
}
static size_t ws_backward_data(const ConvPlan *p) {
    if (p->implicit) return p->wcast;
    size_t dcol = p->bwd_out_rows * p->dcol_row;
    return dcol ? align_up(p->wcast) + dcol : p->wcast;
}
static size_t ws_backward_weight(const ConvPlan *p) {
    if (p->implicit) return p->reduce;
    size_t col = p->fwd_rows * p->col_row;
    return col > p->reduce ? col : p->reduce;
}

static size_t conv2d_workspace_cuda(Ops *o, const ConvCfg *cfg, Shape in, DType dt) {
    ConvPlan p = conv_plan(o, cfg, in, dt);
    if (p.depthwise) return p.reduce;
    size_t f = ws_forward(&p), d = ws_backward_data(&p), w = ws_backward_weight(&p);
    return f > d ? (f > w ? f : w) : (d > w ? d : w);
}

static cudaDataType blas_type(DType dt) {
    return dt == DT_F32 ? CUDA_R_32F : dt == DT_F16 ? CUDA_R_16F : CUDA_R_16BF;
}
// C (m×n, column-major) = op(A)·op(B) + beta·C with fp32 accumulation; A and B of
// type ab, C of type c: the combinations cuBLAS supports with CUBLAS_COMPUTE_32F
// (A = B = fp32 with C fp32; A = B = fp16 or bf16 with C the same or fp32)
static void gemm_ex(Ops *o, cublasOperation_t ta, cublasOperation_t tb, size_t m, size_t n,
                    size_t k, const void *A, int lda, const void *B, int ldb, DType ab, float beta,
                    void *C, int ldc, DType c) {
    if (m > INT_MAX || n > INT_MAX || k > INT_MAX) {
        fprintf(stderr,
                "segnet: internal error: GEMM of %zux%zux%zu exceeds cuBLAS' int dimensions\n", m,
                n, k);
        exit(1);
    }
    const float alpha = 1.0f;
    // a row of bench --kernels per type combination: A·B's type, C's
    static const char *const labels[3][3] = {
            {"cublasGemmEx fp32->fp32", "cublasGemmEx fp32->fp16", "cublasGemmEx fp32->bf16"},
            {"cublasGemmEx fp16->fp32", "cublasGemmEx fp16->fp16", "cublasGemmEx fp16->bf16"},
            {"cublasGemmEx bf16->fp32", "cublasGemmEx bf16->fp16", "cublasGemmEx bf16->bf16"}};
    const Traffic traffic = moves(bytes_of(m * k + k * n, ab) + bytes_of(m * n, c) * (beta ? 2 : 1),
                                2.0 * m * n * k);
    cudaStream_t s = stream_of(o);
    kernel_time_begin(NULL, s, traffic, labels[ab][c]);
    cublasCheck(cublasGemmEx(ctx_of(o)->blas, ta, tb, (int)m, (int)n, (int)k, &alpha, A,
                             blas_type(ab), lda, B, blas_type(ab), ldb, &beta, C, blas_type(c), ldc,
                             CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    kernel_time_end(s);
    launchCheck();
}

// col[p][g][ky][kx][ci] = x[n, oy·s - pt + ky, ox·s - pl + kx, g·Cg + ci] (0 outside)
// for the output pixels p of output rows t0.. (flattened n·OH + oy), p relative to t0.
// A chunk holds fewer than 2^31 elements (cuda_conv_chunk_bytes); its element
// index is split by the FastDivs of the divisors named.
struct Im2colDivs { FastDiv GK, K, Cg, kw, OW, OH; };
static Im2colDivs im2col_divs(const ConvCfg *cfg, const ConvGeom *q) {
    return {fastdiv_make(cfg->groups * q->K),
            fastdiv_make(q->K),
            fastdiv_make(q->Cg),
            fastdiv_make(cfg->kw),
            fastdiv_make(q->OW),
            fastdiv_make(q->OH)};
}
__global__ void im2col_kernel(void *col, const void *in, DType dt, ConvCfg cfg, ConvGeom q, int t0,
                              uint32_t n, Im2colDivs d) {
    FOR_GRID(e, n) {
        const uint32_t p = fastdiv(d.GK, e), j = e - p * d.GK.d;                 // pixel, column
        // group, within the group
        const uint32_t g = fastdiv(d.K, j), r = j - g * d.K.d;
        const uint32_t tap = fastdiv(d.Cg, r), ci = r - tap * d.Cg.d;
        const uint32_t ky = fastdiv(d.kw, tap), kx = tap - ky * d.kw.d;
        // output row t = n·OH + oy
        const uint32_t ph = fastdiv(d.OW, p), ox = p - ph * d.OW.d, t = t0 + ph;
        const uint32_t img = fastdiv(d.OH, t), oy = t - img * d.OH.d;
        const int iy = (int)(oy * cfg.stride + ky) - q.pt, ix = (int)(ox * cfg.stride + kx) - q.pl;
        float v = 0.0f;
        if (iy >= 0 && iy < q.H && ix >= 0 && ix < q.W)
            v = ld(in, dt, ((img * q.H + iy) * q.W + ix) * q.C + g * q.Cg + ci);
        st(col, dt, e, v);  // a stored value: exact in its own type
    }
}
static void im2col(Ops *o, void *col, Tensor in, const ConvCfg *cfg, const ConvGeom *q, int t0,
                   int t1) {
    size_t n = (size_t)(t1 - t0) * q->OW * cfg->groups * q->K;
    require_below(n, (size_t)1 << 31, "im2col elements in one chunk (cuda_conv_chunk_bytes)");
    require_below(shape_numel(in.shape), (size_t)1 << 31, "im2col input elements");
    // the columns written; each gathers an input element (the band's rows: once from memory)
    const double band = (double)(t1 - t0) / ((double)q->N * q->OH);
    CU_LAUNCH(im2col_kernel, grid_for(n), BLOCK, 0, stream_of(o),
              moves(bytes_of(n, in.dtype) + band * bytes_of(in)), col, in.data, in.dtype, *cfg, *q,
              t0, (uint32_t)n, im2col_divs(cfg, q));
    launchCheck();
}

// din[n,iy,ix,g·Cg+ci] (=|+=) Σ_{ky,kx} dcol[p(oy,ox)][g][ky][kx][ci], oy = (iy + pt - ky)/s
// integral and inside the output (likewise ox), summed in (ky, kx) order like the
// CPU's col2im; input rows u0.. (flattened n·H + iy), dcol rows from output row t0
struct Col2imDivs { FastDiv C, W, H, Cg; };
__global__ void col2im_kernel(void *din, DType dt, const float *dcol, ConvCfg cfg, ConvGeom q,
                              int u0, int t0, uint32_t n, int accumulate, Col2imDivs d) {
    const int s = cfg.stride, GK = cfg.groups * q.K;
    FOR_GRID(e, n) {
        // input pixel, channel
        const uint32_t row = fastdiv(d.C, e), c = e - row * q.C;
        // input row u = n·H + iy
        const uint32_t ur = fastdiv(d.W, row), ix = row - ur * q.W, u = u0 + ur;
        const uint32_t img = fastdiv(d.H, u), iy = u - img * q.H;
        const uint32_t g = fastdiv(d.Cg, c), ci = c - g * q.Cg;
        float acc = 0.0f;
        for (int ky = 0; ky < cfg.kh; ky++) {
            const int ty = (int)iy + q.pt - ky;
            if (ty < 0 || ty % s || ty / s >= q.OH) continue;
            for (int kx = 0; kx < cfg.kw; kx++) {
                const int tx = (int)ix + q.pl - kx;
                if (tx < 0 || tx % s || tx / s >= q.OW) continue;
                const uint32_t p = (img * q.OH + ty / s - t0) * q.OW + tx / s;
                acc += dcol[p * GK + g * q.K + (ky * cfg.kw + kx) * q.Cg + ci];
            }
        }
        const uint32_t i = u * q.W * q.C + ix * q.C + c;
        st(din, dt, i, accumulate ? ld(din, dt, i) + acc : acc);
    }
}

// y[r][c] = rows[r][c] + b[c], rounded to y's type; rows (fp32) may alias y when it is fp32
__global__ void bias_rows_kernel(void *y, DType dt, const float *rows, const float *b, int C,
                                 uint32_t n_rows) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const float bc = b[c];
    FOR_ROWS(r, n_rows) st(y, dt, r * C + c, rows[r * C + c] + bc);
}
static void bias_rows(Ops *o, void *y, DType dt, const float *rows32, const float *b, int C,
                      size_t n_rows) {
    for_row_launches(n_rows, C, [&](size_t r0, size_t count) {
        RowGrid g = row_grid(C, count);
        CU_LAUNCH(bias_rows_kernel, g.grid, g.block, 0, stream_of(o),
                  moves(bytes_of(count * C, dt) + bytes_of(count * C, DT_F32)),
                  elem_ptr(y, dt, r0 * C), dt, rows32 + r0 * C, b, C, (uint32_t)count);
        launchCheck();
    });
}

static size_t rows_per_part(size_t M, int parts) { return (M + parts - 1) / parts; }

// ----------------------------------------------------------------------------
// depthwise: out[n,oy,ox,c] = b[c] + Σ_{ky,kx} x[n, oy·s - pt + ky, ox·s - pl + kx,
// c]·w[c][ky][kx],
// taps in (ky, kx) order after the bias, like the CPU. Threads over (channel
// lane, output pixel) in image rows (above): grid (channel tiles, column
// blocks, output image rows); W channels per lane (1 generic, Vec<T>::N vector).
// KS: the kernel size when it is known at compile time (3: EfficientNet's; 0:
// read from cfg); then the loops unroll and a thread keeps its channels' taps
// in registers (DepthwiseTaps) instead of loading them per output pixel.
template <int KS, int W> struct DepthwiseTaps {
    float v[KS ? KS * KS : 1][W];
    __device__ DepthwiseTaps(const float *w, int c0, int taps) {
        for (int q = 0; q < (KS ? KS * KS : 0); q++)
            for (int k = 0; k < W; k++) v[q][k] = w[(c0 + k) * taps + q];
    }
    // channel c0 + k's tap q: from registers (KS), else from w
    __device__ float at(const float *w, int c0, int taps, int q, int k) const {
        return KS ? v[KS ? q : 0][k] : w[(c0 + k) * taps + q];
    }
};
template <class IO, int KS>
__global__ void MEMORY_BOUND depthwise_forward_kernel(IO y, Shape t, IO x, Shape s, const float *w,
                                                      const float *b, ConvCfg cfg, int pt, int pl) {
    constexpr int W = IO::W;
    const int kh = KS ? KS : cfg.kh, kw = KS ? KS : cfg.kw, taps = kh * kw;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * W;
    if (c0 >= t.c) return;
    const DepthwiseTaps<KS, W> tap(w, c0, taps);
    const ImageRow row = image_row(blockIdx.z, t.h);
    FOR_COLUMNS(ox, t.w) {
        float acc[W], v[W];
        for (int k = 0; k < W; k++) acc[k] = b ? b[c0 + k] : 0.0f;
        #pragma unroll
        for (int ky = 0; ky < kh; ky++) {
            const int iy = (int)row.y * cfg.stride - pt + ky;
            if (iy < 0 || iy >= s.h) continue;
            #pragma unroll
            for (int kx = 0; kx < kw; kx++) {
                const int ix = ox * cfg.stride - pl + kx;
                if (ix < 0 || ix >= s.w) continue;
                x.load(nhwc_at(s, row.n, iy, ix, c0), v);
                for (int k = 0; k < W; k++) acc[k] += v[k] * tap.at(w, c0, taps, ky * kw + kx, k);
            }
        }
        y.store(nhwc_at(t, row.n, row.y, ox, c0), acc);
    }
}
// din[n,iy,ix,c] (=|+=) Σ_{ky,kx} dout[n,oy,ox,c]·w[c][ky][kx], oy = (iy + pt - ky)/s integral
// KS as in the forward; ST: the stride when known at compile time (1 or 2: the
// divisions by it are shifts), 0: cfg's
template <class IO, int KS, int ST>
__global__ void MEMORY_BOUND depthwise_backward_data_kernel(IO din, Shape s, IO dout, Shape t,
                                                            const float *w, ConvCfg cfg, int pt,
                                                            int pl, int accumulate) {
    constexpr int W = IO::W;
    const int kh = KS ? KS : cfg.kh, kw = KS ? KS : cfg.kw, taps = kh * kw,
              st = ST ? ST : cfg.stride;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * W;
    if (c0 >= s.c) return;
    const DepthwiseTaps<KS, W> tap(w, c0, taps);
    const ImageRow row = image_row(blockIdx.z, s.h);
    FOR_COLUMNS(ix, s.w) {
        float acc[W], v[W];
        for (int k = 0; k < W; k++) acc[k] = 0.0f;
        #pragma unroll
        for (int ky = 0; ky < kh; ky++) {
            const int ty = (int)row.y + pt - ky;
            if (ty < 0 || ty % st || ty / st >= t.h) continue;
            #pragma unroll
            for (int kx = 0; kx < kw; kx++) {
                const int tx = ix + pl - kx;
                if (tx < 0 || tx % st || tx / st >= t.w) continue;
                dout.load(nhwc_at(t, row.n, ty / st, tx / st, c0), v);
                for (int k = 0; k < W; k++) acc[k] += v[k] * tap.at(w, c0, taps, ky * kw + kx, k);
            }
        }
        store_acc(din, nhwc_at(s, row.n, row.y, ix, c0), acc, accumulate);
    }
}
// Pass 1 of dw[c][ky][kx] += Σ_{n,oy,ox} dout[n,oy,ox,c]·x[n, oy·s - pt + ky, ox·s - pl + kx, c]:
// block (channel lanes × row lanes) of part blockIdx.y sums the output pixels
// r = (n·OH + oy)·OW + ox of its part, each row lane every blockDim.y-th pixel,
// all taps of its W channels in registers (fp32), then the lanes in order;
// it writes partial[part][c][tap]. The last block of a channel tile
// (last_block) adds the parts in part order into dw.
#define DW_MAX_TAPS 9  // taps kept in registers (3×3); larger kernels run tap by tap
// blocks per SM asked of ptxas: MEMORY_BOUND's, but 3 for fp32 (16 bytes a
// thread: 9 taps × 4 channels of sums spill at 64 registers)
template <class IO> struct DepthwiseWeightBlocks { static constexpr int n = MEMORY_BOUND_BLOCKS; };
template <> struct DepthwiseWeightBlocks<VecIO<float>> { static constexpr int n = 3; };
template <class IO, int TAPS>
__global__ void __launch_bounds__(BLOCK, DepthwiseWeightBlocks<IO>::n)
        depthwise_weight_kernel(float *dw, float *partial, unsigned *done, IO dout, Shape t, IO x,
                                Shape s, ConvCfg cfg, int pt, int pl, uint32_t pixels_per_part,
                                int tap0, FastDiv by_ow, FastDiv by_oh) {
    constexpr int W = IO::W;
    CU_SHARED(float, lanes, [BLOCK * W]);
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * W, part = blockIdx.y, C = s.c;
    const int ntaps = cfg.kh * cfg.kw;
    const uint32_t M = (uint32_t)t.n * t.h * t.w, p0 = part * pixels_per_part;
    const uint32_t p1 = p0 + pixels_per_part < M ? p0 + pixels_per_part : M;
    float acc[TAPS][W];
    for (int q = 0; q < TAPS; q++)
        for (int k = 0; k < W; k++) acc[q][k] = 0.0f;
    if (c0 < C)
        for (uint32_t r = p0 + threadIdx.y; r < p1; r += blockDim.y) {
            const uint32_t rows = fastdiv(by_ow, r), img = fastdiv(by_oh, rows);
            const int ox = (int)(r - rows * t.w), oy = (int)(rows - img * t.h);
            float g[W], v[W];
            dout.load(r * C + c0, g);
            for (int q = 0; q < TAPS; q++) {
                const int tap = tap0 + q, ky = tap / cfg.kw, kx = tap % cfg.kw;
                if (tap >= ntaps) break;
                const int iy = oy * cfg.stride - pt + ky, ix = ox * cfg.stride - pl + kx;
                if (iy < 0 || iy >= s.h || ix < 0 || ix >= s.w) continue;
                x.load(nhwc_at(s, img, iy, ix, c0), v);
                for (int k = 0; k < W; k++) acc[q][k] += g[k] * v[k];
            }
        }
    // the row lanes' sums in lane order, tap by tap through shared memory
    const int lane = threadIdx.y * blockDim.x + threadIdx.x;
    #pragma unroll  // acc stays in registers: indices known at compile time
    for (int q = 0; q < TAPS; q++) {
        if (tap0 + q >= ntaps) break;  // the same in every thread
        for (int k = 0; k < W; k++) lanes[lane * W + k] = acc[q][k];
        __syncthreads();
        if (threadIdx.y == 0 && c0 < C)
            for (int k = 0; k < W; k++) {
                float sum = 0.0f;
                for (int l = 0; l < (int)blockDim.y; l++)
                    sum += lanes[(l * blockDim.x + threadIdx.x) * W + k];
                partial[((size_t)part * C + c0 + k) * ntaps + tap0 + q] = sum;
            }
        __syncthreads();
    }
    if (!last_block(done + blockIdx.x, gridDim.y)) return;
    // dw[c][tap] += Σ_part partial[part][c][tap] in part order, for this tile's channels and taps
    const int c_first = blockIdx.x * blockDim.x * W,
              n_c = C - c_first < (int)blockDim.x * W ? C - c_first : blockDim.x * W;
    const int n_taps = ntaps - tap0 < TAPS ? ntaps - tap0 : TAPS;
    for (int item = lane; item < n_c * n_taps; item += blockDim.x * blockDim.y) {
        const size_t at = (size_t)(c_first + item / n_taps) * ntaps + tap0 + item % n_taps;
        float sum = 0.0f;
        for (uint32_t part_k = 0; part_k < gridDim.y; part_k++)
            sum += from_other_blocks(&partial[part_k * (size_t)C * ntaps + at]);
        dw[at] += sum;
    }
}

static void depthwise_forward(Ops *o, const ConvCfg *cfg, const ConvGeom *q, Tensor out, Tensor in,
                              const float *w, const float *b) {
    if (!shape_numel(out.shape)) return;
    image_rows_launch<true>(
            out, in, NO_TENSOR,
            [&](RowGrid g, auto yio, auto xio, auto, Shape t, Shape s, double bytes) {
                typedef decltype(yio) IO;
                const Traffic m = moves(bytes, 2.0 * cfg->kh * cfg->kw * shape_numel(t));
                if (cfg->kh == 3 && cfg->kw == 3)
                    CU_LAUNCH((depthwise_forward_kernel<IO, 3>), g.grid, g.block, 0, stream_of(o),
                              m, yio, t, xio, s, w, b, *cfg, q->pt, q->pl);
                else
                    CU_LAUNCH((depthwise_forward_kernel<IO, 0>), g.grid, g.block, 0, stream_of(o),
                              m, yio, t, xio, s, w, b, *cfg, q->pt, q->pl);
            });
}
static void depthwise_backward_data(Ops *o, const ConvCfg *cfg, const ConvGeom *q, Tensor din,
                                    Tensor dout, const float *w, int accumulate) {
    if (!shape_numel(din.shape)) return;
    image_rows_launch<true>(
            din, dout, NO_TENSOR,
            [&](RowGrid g, auto dxio, auto dyio, auto, Shape s, Shape t, double bytes) {
                typedef decltype(dxio) IO;
                const bool k3 = cfg->kh == 3 && cfg->kw == 3;
                const Traffic m = moves(bytes, 2.0 * cfg->kh * cfg->kw * shape_numel(t));
                if (k3 && cfg->stride == 1)
                    CU_LAUNCH((depthwise_backward_data_kernel<IO, 3, 1>), g.grid, g.block, 0,
                              stream_of(o), m, dxio, s, dyio, t, w, *cfg, q->pt, q->pl, accumulate);
                else if (k3 && cfg->stride == 2)
                    CU_LAUNCH((depthwise_backward_data_kernel<IO, 3, 2>), g.grid, g.block, 0,
                              stream_of(o), m, dxio, s, dyio, t, w, *cfg, q->pt, q->pl, accumulate);
                else
                    CU_LAUNCH((depthwise_backward_data_kernel<IO, 0, 0>), g.grid, g.block, 0,
                              stream_of(o), m, dxio, s, dyio, t, w, *cfg, q->pt, q->pl, accumulate);
            });
}
// The weight gradient's pixel split (conv_plan): at least REDUCE_ROWS pixels a
// part and at most REDUCE_PARTS_MAX parts, or else the nearest count up to
// DW_PARTS_MAX (a row a thread at least) whose waves are WAVE_FILL_MIN full at
// the 16-bit kernels' MEMORY_BOUND_BLOCKS per SM
#define DW_PARTS_MAX (4 * WAVE_SMS)
static int depthwise_weight_parts(const ConvGeom *q, int want) {
    const size_t M = (size_t)q->N * q->P,
                 lanes = q->C % NARROW_CHANNELS == 0 ? q->C / NARROW_CHANNELS : q->C;
    const size_t tx = lanes < WARP_SIZE ? lanes : WARP_SIZE, tiles = (lanes + tx - 1) / tx;
    size_t hi = M / (BLOCK / tx);
    if (hi > DW_PARTS_MAX) hi = DW_PARTS_MAX;
    if (hi < (size_t)want) hi = want;
    auto whole = [&](size_t n) { return parts_of_whole_rows(M, n); };
    return (int)wave_fill_parts(tiles, want, hi, MEMORY_BOUND_BLOCKS, whole);
}
// partial (parts, C, taps) in the workspace, then dw += Σ_parts in part order, in one launch per 9
// taps
static void depthwise_backward_weight(Ops *o, const ConvCfg *cfg, const ConvGeom *q, float *dw,
                                      Tensor dout, Tensor in, int parts, float *partial) {
    const size_t M = (size_t)q->N * q->P, taps = (size_t)cfg->kh * cfg->kw;
    if (!M) return;
    require_below(shape_numel(in.shape) > shape_numel(dout.shape) ? shape_numel(in.shape)
                                                                  : shape_numel(dout.shape),
                  (size_t)1 << 31, "elements of a depthwise weight gradient's tensors");
    const uint32_t per_part = (uint32_t)rows_per_part(M, parts);
    const Shape t = dout.shape, s = in.shape;
    auto run = [&](auto dyio, auto xio, int lanes) {
        typedef decltype(dyio) IO;
        const unsigned tx = lanes < WARP_SIZE ? (unsigned)lanes : WARP_SIZE;
        const dim3 grid((lanes + tx - 1) / tx, parts), block(tx, BLOCK / tx);
        require_below(grid.x, SUMS_COUNTERS + 1, "channel tiles of a depthwise weight gradient");
        for (int tap0 = 0; tap0 < (int)taps; tap0 += DW_MAX_TAPS) {
            const int n_taps = taps - tap0 < DW_MAX_TAPS ? (int)taps - tap0 : DW_MAX_TAPS;
            CU_LAUNCH((depthwise_weight_kernel<IO, DW_MAX_TAPS>), grid, block, 0, stream_of(o),
                      moves(bytes_of(dout) + bytes_of(in), 2.0 * n_taps * shape_numel(t)), dw,
                      partial, ctx_of(o)->sums_done, dyio, t, xio, s, *cfg, q->pt, q->pl, per_part,
                      tap0, fastdiv_make(t.w), fastdiv_make(t.h));
            launchCheck();
        }
    };
    if (vec_ok({dout.dtype, in.dtype}, q->C, {dout.data, in.data})) {
        SWITCH_STORAGE(in.dtype, T,
                       { run(NarrowIO<T>::of(dout), NarrowIO<T>::of(in), q->C / NarrowIO<T>::W); });
    } else {
        run(AnyIO::of(dout), AnyIO::of(in), q->C);
    }
}
