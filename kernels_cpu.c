// kernels_cpu.c -- the CPU backend: ops_cpu, the fast versions of the ops on the CPU.
// Each op NAME has one function per form: NAME_ref in segnet.c (part I: its formula,
// the specification), NAME_cpu here where the CPU has a faster one (elsewhere ops_cpu
// takes NAME_ref), NAME_cuda in kernels.cu. segnet.c includes this file at its end, so
// that the program is one translation unit.

// ============================================================================
// MAKING IT FAST ON THE CPU
// The CPU's fast versions of conv2d, batch norm, the squeeze-excitation
// pieces and the memory-bound ops in fp32 (max-pool, upsampling, concat,
// fill, copy, axpby, add, dropout), each naming the reference of part I it
// replaces (the tests compare them: ref_table_vs_cpu and the ops' own tests);
// ops_cpu is ops_ref with them.
// ============================================================================

// ----------------------------------------------------------------------------
// elementwise ops in fp32 (fill_ref, copy_ref, axpby_ref, sum_squares_ref,
// add_*_ref and dropout_*_ref state them; these give the same bits)
//
// Loops over fp32 arrays that the compiler vectorises, where the references
// go through ld/st per element; dropout's per-sample factor (drop-path) is
// drawn once per sample instead of once per element with a 64-bit division.
// Other storage types take the references.

// both tensors fp32: the fast paths of this file; other storage types take the reference
static int all_f32(Tensor a, Tensor b) { return a.dtype == DT_F32 && b.dtype == DT_F32; }

static void fill_cpu(Ops *o, Tensor t, float value) {
    if (t.dtype != DT_F32) { fill_ref(o, t, value); return; }
    const size_t n = shape_numel(t.shape);
    float *p = (float *)t.data;
    #pragma omp parallel for simd schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) p[i] = value;
}

static void copy_cpu(Ops *o, Tensor dst, Tensor src, int accumulate) {
    const size_t n = shape_numel(src.shape);
    if (!all_f32(dst, src) || shape_numel(dst.shape) != n) {
        copy_ref(o, dst, src, accumulate);
        return;
    }
    float *d = (float *)dst.data;
    const float *s = (const float *)src.data;
    if (!accumulate) {
        if (d != s) memcpy(d, s, sizeof(float) * n);
        return;
    }
    #pragma omp parallel for simd schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) d[i] += s[i];
}

static void axpby_cpu(Ops *o, Tensor y, Tensor x, float a, float b, int accumulate) {
    if (!all_f32(y, x)) { axpby_ref(o, y, x, a, b, accumulate); return; }
    const size_t n = shape_numel(x.shape);
    float *yp = (float *)y.data;
    const float *xp = (const float *)x.data;
    #pragma omp parallel for simd schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) {
        const float v = a * xp[i] + b;
        yp[i] = accumulate ? yp[i] + v : v;
    }
}

// Σx² in sum_squares_ref's chunks, each summed in its own order: SUM_LANES
// chunks at a time, one fp64 sum per chunk, so that SUM_LANES chains of
// dependent additions run side by side where the reference runs one (its
// 4-cycle additions one after another took 1.4 ms a step for 2M gradients).
#define SUM_LANES 8
static void sum_squares_cpu(Ops *o, Tensor t, float *out) {
    if (t.dtype != DT_F32) { sum_squares_ref(o, t, out); return; }
    const float *x = (const float *)t.data;
    const size_t n = shape_numel(t.shape), n_chunks = (n + SUM_CHUNK - 1) / SUM_CHUNK;
    double total = 0.0;
    for (size_t g0 = 0; g0 < n_chunks; g0 += SUM_GROUP) {
        double part[SUM_GROUP];
        const size_t g1 = g0 + SUM_GROUP < n_chunks ? g0 + SUM_GROUP : n_chunks;
        const size_t n_sets = (g1 - g0 + SUM_LANES - 1) / SUM_LANES;
        #pragma omp parallel for schedule(static) if(PAR(n))
        for (size_t set = 0; set < n_sets; set++) {
            const size_t k0 = g0 + set * SUM_LANES;
            if (k0 + SUM_LANES <= g1 && (k0 + SUM_LANES) * SUM_CHUNK <= n) {
                double s[SUM_LANES] = {0};
                for (size_t i = 0; i < SUM_CHUNK; i++)
                    for (int l = 0; l < SUM_LANES; l++) {
                        const double v = x[(k0 + l) * SUM_CHUNK + i];
                        s[l] += v * v;
                    }
                for (int l = 0; l < SUM_LANES; l++) part[k0 + l - g0] = s[l];
                continue;
            }
            for (size_t k = k0; k < g1 && k < k0 + SUM_LANES; k++) {  // the last, ragged set
                const size_t i1 = (k + 1) * SUM_CHUNK < n ? (k + 1) * SUM_CHUNK : n;
                double s = 0.0;
                for (size_t i = k * SUM_CHUNK; i < i1; i++) {
                    const double v = x[i];
                    s += v * v;
                }
                part[k - g0] = s;
            }
        }
        for (size_t k = g0; k < g1; k++) total += part[k - g0];
    }
    *out = (float)total;
}

static void add_forward_cpu(Ops *o, Tensor y, Tensor a, Tensor b) {
    if (!all_f32(y, a) || b.dtype != DT_F32) { add_forward_ref(o, y, a, b); return; }
    const size_t n = shape_numel(y.shape);
    float *yp = (float *)y.data;
    const float *ap = (const float *)a.data, *bp = (const float *)b.data;
    #pragma omp parallel for simd schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) yp[i] = ap[i] + bp[i];
}

static void add_backward_cpu(Ops *o, Tensor da, Tensor db, Tensor dy, int accumulate_a,
                             int accumulate_b) {
    if (da.data) copy_cpu(o, da, dy, accumulate_a);
    if (db.data) copy_cpu(o, db, dy, accumulate_b);
}

// y = x·keep/(1 - rate) (+ residual); the factor per element, or per sample (E elements)
static void dropout_forward_cpu(Ops *o, Tensor y, Tensor x, Tensor residual, float rate,
                                const uint64_t *seed_at, int per_sample, uint64_t first_sample) {
    if (!all_f32(y, x) || (residual.data && residual.dtype != DT_F32)) {
        dropout_forward_ref(o, y, x, residual, rate, seed_at, per_sample, first_sample);
        return;
    }
    const uint64_t seed = *seed_at;
    const size_t n = shape_numel(x.shape), E = n / x.shape.n,
                 rows = per_sample ? (size_t)x.shape.n : 1;
    const size_t row = per_sample ? E : n;  // elements with one draw each, or all of them
    float *yp = (float *)y.data;
    const float *xp = (const float *)x.data, *rp = (const float *)residual.data;
    for (size_t s = 0; s < rows; s++) {
        const size_t i0 = s * row;
        const float f = per_sample ? dropout_keep(rate, seed, first_sample + s) : 0.0f;
        #pragma omp parallel for simd schedule(static) if(PAR(row))
        for (size_t i = i0; i < i0 + row; i++) {
            const float v =
                    xp[i] * (per_sample ? f : dropout_keep(rate, seed, first_sample * E + i));
            yp[i] = rp ? v + rp[i] : v;
        }
    }
}

static void dropout_backward_cpu(Ops *o, Tensor dx, Tensor dresidual, Tensor dy, float rate,
                                 const uint64_t *seed_at, int per_sample, uint64_t first_sample,
                                 int accumulate, int accumulate_residual) {
    if (dy.dtype != DT_F32 || (dx.data && dx.dtype != DT_F32) ||
        (dresidual.data && dresidual.dtype != DT_F32)) {
        dropout_backward_ref(o, dx, dresidual, dy, rate, seed_at, per_sample, first_sample,
                             accumulate, accumulate_residual);
        return;
    }
    const uint64_t seed = *seed_at;
    const size_t n = shape_numel(dy.shape), E = n / dy.shape.n,
                 rows = per_sample ? (size_t)dy.shape.n : 1;
    const size_t row = per_sample ? E : n;
    float *dxp = (float *)dx.data, *drp = (float *)dresidual.data;
    const float *g = (const float *)dy.data;
    for (size_t s = 0; s < rows; s++) {
        const size_t i0 = s * row;
        const float f = per_sample ? dropout_keep(rate, seed, first_sample + s) : 0.0f;
        #pragma omp parallel for simd schedule(static) if(PAR(row))
        for (size_t i = i0; i < i0 + row; i++) {  // dx may be dy (in place)
            const float gi = g[i];
            if (dxp) {
                const float v =
                        gi * (per_sample ? f : dropout_keep(rate, seed, first_sample * E + i));
                dxp[i] = accumulate ? dxp[i] + v : v;
            }
            if (drp) drp[i] = accumulate_residual ? drp[i] + gi : gi;
        }
    }
}

// ----------------------------------------------------------------------------
// conv2d, fast (conv2d_*_ref in part I states the sums)
//
// Dense k×k convs run as direct convolutions, register-blocked like a GEMM
// micro-kernel but on the padded image itself (below, "direct k×k
// convolution"). Grouped convs, some data and weight gradients (by stride,
// channels, image size and vector width: conv_is_direct and the rules after
// it) and, without AVX, convs with many input channels are lowered to GEMMs
// per image and group; that path is also the reference the direct one is
// tested against. im2col gathers the
// receptive fields into col[P][K] (P = OH·OW output pixels, K = kh·kw·Cg in
// weight order), and
//   forward          out_g[P][Coutg]  = col[P][K] · W_g[Coutg][K]ᵀ
//   backward data    dcol[P][K]       = dout_g[P][Coutg] · W_g[Coutg][K], then col2im
//   backward weight  dW_g[Coutg][K]  += Σ_n dout_g[P][Coutg]ᵀ · col[P][K]
// A 1×1 stride-1 conv (fp32) needs no im2col: NHWC is already [N·H·W][Cin].
// Depthwise convs (groups = Cin = Cout) are direct loops.
// Every weight gradient is a sum in fp64, rounded once: the GEMM path adds
// each image's product (an fp32 GEMM over its own P rows) to an fp64 sum in
// image order, the direct path its fp32 sums over blocks of about
// DW_FLUSH_PIXELS pixels (several images' when they are small). A batch split
// across replicas then regroups fp64 additions (2^-53) and at most those
// blocks' fp32 sums — one fp32 GEMM over all N·P rows regroups its whole fp32
// accumulation instead, 1e-6 of a U-Net's gradient.

static ConvGeom conv_geom(const ConvCfg *cfg, Shape in) {
    ConvGeom q;
    snCheck(conv_geom_of(cfg, in, &q),
            "conv2d: input " SHAPE_FMT " does not fit the conv (cin %d, kernel %dx%d)",
            SHAPE_ARGS(in), cfg->cin, cfg->kh, cfg->kw);
    return q;
}

// the GEMM paths' floats: col (P,K) and fp32 output rows (P,Cout); the weight
// gradient's fp64 sum (2 floats per weight) and one image's product (Coutg,K) before col
static size_t im2col_floats(const ConvGeom *q, DType dt) {
    return q->P * q->K + (dt != DT_F32 ? q->P * q->Cout : 0);
}
static size_t gemm_weight_grad_floats(const ConvGeom *q, DType dt) {
    return 2 * (size_t)q->Cout * q->K + (size_t)q->Coutg * q->K + im2col_floats(q, dt);
}

// sum[i] += x[i] in fp64 (one image's weight gradient into the batch's)
static void sum_into_f64(double *sum, const float *x, size_t n) {
    #pragma omp parallel for simd schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) sum[i] += x[i];
}
// dw[i] += sum[i] rounded once to fp32 (the batch's weight gradient into the step's)
static void add_rounded(float *dw, const double *sum, size_t n) {
    for (size_t i = 0; i < n; i++) dw[i] += (float)sum[i];
}

// col[p][(ky·kw + kx)·Cg + ci] = x[n, oy·s - pt + ky, ox·s - pl + kx, g·Cg + ci]
static void im2col(const ConvCfg *cfg, const ConvGeom *q, Tensor in, int n, int g, float *col) {
    #pragma omp parallel for schedule(static) if(PAR(q->P * q->K))
    for (int oy = 0; oy < q->OH; oy++) {
        for (int ox = 0; ox < q->OW; ox++) {
            float *row = col + ((size_t)oy * q->OW + ox) * q->K;
            for (int ky = 0; ky < cfg->kh; ky++) {
                int iy = oy * cfg->stride - q->pt + ky;
                for (int kx = 0; kx < cfg->kw; kx++) {
                    int ix = ox * cfg->stride - q->pl + kx;
                    float *dst = row + (ky * cfg->kw + kx) * q->Cg;
                    if (iy < 0 || iy >= q->H || ix < 0 || ix >= q->W) {
                        memset(dst, 0, sizeof(float) * q->Cg);
                        continue;
                    }
                    size_t src = (((size_t)n * q->H + iy) * q->W + ix) * q->C + (size_t)g * q->Cg;
                    ld_run(in, src, dst, (size_t)q->Cg);
                }
            }
        }
    }
}

// The adjoint of im2col, as a gather so that each input element is written
// once: din[n,iy,ix,g·Cg+ci] (=|+=) Σ_{ky,kx} dcol[oy·OW+ox][(ky·kw+kx)·Cg+ci]
// over the (ky,kx) with oy = (iy + pt - ky)/s an integer inside the output,
// summed in (ky,kx) order. Channels are innermost (contiguous in dcol and
// din), COL2IM_CHUNK at a time.
#define COL2IM_CHUNK 256
static void col2im(const ConvCfg *cfg, const ConvGeom *q, const float *dcol, Tensor din, int n,
                   int g, int accumulate) {
    const int s = cfg->stride;
    #pragma omp parallel for schedule(static) if(PAR((size_t)q->H * q->W * q->K))
    for (int iy = 0; iy < q->H; iy++) {
        float acc[COL2IM_CHUNK];
        for (int ix = 0; ix < q->W; ix++) {
            size_t dst = (((size_t)n * q->H + iy) * q->W + ix) * q->C + (size_t)g * q->Cg;
            for (int c0 = 0; c0 < q->Cg; c0 += COL2IM_CHUNK) {
                const int nc = q->Cg - c0 < COL2IM_CHUNK ? q->Cg - c0 : COL2IM_CHUNK;
                for (int ci = 0; ci < nc; ci++) acc[ci] = 0.0f;
                for (int ky = 0; ky < cfg->kh; ky++) {
                    int ty = iy + q->pt - ky;
                    if (ty < 0 || ty % s || ty / s >= q->OH) continue;
                    for (int kx = 0; kx < cfg->kw; kx++) {
                        int tx = ix + q->pl - kx;
                        if (tx < 0 || tx % s || tx / s >= q->OW) continue;
                        const float *src = dcol + ((size_t)(ty / s) * q->OW + tx / s) * q->K +
                                           (ky * cfg->kw + kx) * q->Cg + c0;
                        for (int ci = 0; ci < nc; ci++) acc[ci] += src[ci];
                    }
                }
                st_run(din, dst + c0, acc, (size_t)nc, accumulate);
            }
        }
    }
}

// Images n0 .. n0 + nb - 1 of an output (or output gradient) as fp32 rows
// [nb·P][Cout]: the tensor's own memory when it is fp32, else converted into `scratch`.
static float *images_rows_f32(Tensor t, int n0, int nb, size_t P, int Cout, float *scratch) {
    const size_t base = (size_t)n0 * P * Cout, rows = (size_t)nb * P;
    if (t.dtype == DT_F32) return (float *)t.data + base;
    #pragma omp parallel for schedule(static) if(PAR(rows * Cout))
    for (size_t p = 0; p < rows; p++) ld_run(t, base + p * Cout, scratch + p * Cout, (size_t)Cout);
    return scratch;
}
static float *image_rows_f32(Tensor t, int n, size_t P, int Cout, float *scratch) {
    return images_rows_f32(t, n, 1, P, Cout, scratch);
}

// depthwise: out[n,oy,ox,c] = b[c] + Σ_{ky,kx} x[n, oy·s - pt + ky, ox·s - pl + kx, c] ·
// w[c][ky][kx], in any storage type (the _any loops; depthwise_*_f32 below are the fp32 ones)
static void depthwise_forward_any(const ConvCfg *cfg, const ConvGeom *q, Tensor out, Tensor in,
                              const float *w, const float *b) {
    const int KK = cfg->kh * cfg->kw;
    #pragma omp parallel for schedule(static) if(PAR((size_t)q->N * q->P * q->C * KK))
    for (int noy = 0; noy < q->N * q->OH; noy++) {
        int n = noy / q->OH, oy = noy % q->OH;
        for (int ox = 0; ox < q->OW; ox++) {
            size_t o_base = (((size_t)n * q->OH + oy) * q->OW + ox) * q->C;
            for (int c = 0; c < q->C; c++) {
                float acc = b ? b[c] : 0.0f;
                for (int ky = 0; ky < cfg->kh; ky++) {
                    int iy = oy * cfg->stride - q->pt + ky;
                    if (iy < 0 || iy >= q->H) continue;
                    for (int kx = 0; kx < cfg->kw; kx++) {
                        int ix = ox * cfg->stride - q->pl + kx;
                        if (ix < 0 || ix >= q->W) continue;
                        acc += ld(in, (((size_t)n * q->H + iy) * q->W + ix) * q->C + c) *
                               w[c * KK + ky * cfg->kw + kx];
                    }
                }
                st(out, o_base + c, acc);
            }
        }
    }
}

// din[n,iy,ix,c] (=|+=) Σ_{ky,kx} dout[n,oy,ox,c]·w[c][ky][kx], oy = (iy + pt - ky)/s integral
static void depthwise_backward_data_any(const ConvCfg *cfg, const ConvGeom *q, Tensor din,
                                        Tensor dout, const float *w, int accumulate) {
    const int KK = cfg->kh * cfg->kw, s = cfg->stride;
    #pragma omp parallel for schedule(static) if(PAR((size_t)q->N * q->H * q->W * q->C * KK))
    for (int niy = 0; niy < q->N * q->H; niy++) {
        int n = niy / q->H, iy = niy % q->H;
        for (int ix = 0; ix < q->W; ix++) {
            size_t i_base = (((size_t)n * q->H + iy) * q->W + ix) * q->C;
            for (int c = 0; c < q->C; c++) {
                float acc = 0.0f;
                for (int ky = 0; ky < cfg->kh; ky++) {
                    int ty = iy + q->pt - ky;
                    if (ty < 0 || ty % s || ty / s >= q->OH) continue;
                    for (int kx = 0; kx < cfg->kw; kx++) {
                        int tx = ix + q->pl - kx;
                        if (tx < 0 || tx % s || tx / s >= q->OW) continue;
                        acc += ld(dout,
                                  (((size_t)n * q->OH + ty / s) * q->OW + tx / s) * q->C + c) *
                               w[c * KK + ky * cfg->kw + kx];
                    }
                }
                st_acc(din, i_base + c, acc, accumulate);
            }
        }
    }
}

// dw[c][ky][kx] += Σ_{n,oy,ox} dout[n,oy,ox,c] · x[n, oy·s - pt + ky, ox·s - pl + kx, c]
static void depthwise_backward_weight_any(const ConvCfg *cfg, const ConvGeom *q, float *dw,
                                          Tensor dout, Tensor in) {
    const int KK = cfg->kh * cfg->kw;
    #pragma omp parallel for schedule(static) if(PAR((size_t)q->N * q->P * q->C * KK))
    for (int ck = 0; ck < q->C * KK; ck++) {
        int c = ck / KK, ky = (ck % KK) / cfg->kw, kx = ck % cfg->kw;
        double acc = 0.0;
        for (int n = 0; n < q->N; n++)
            for (int oy = 0; oy < q->OH; oy++) {
                int iy = oy * cfg->stride - q->pt + ky;
                if (iy < 0 || iy >= q->H) continue;
                for (int ox = 0; ox < q->OW; ox++) {
                    int ix = ox * cfg->stride - q->pl + kx;
                    if (ix < 0 || ix >= q->W) continue;
                    acc += (double)ld(dout, (((size_t)n * q->OH + oy) * q->OW + ox) * q->C + c) *
                           ld(in, (((size_t)n * q->H + iy) * q->W + ix) * q->C + c);
                }
            }
        dw[ck] += (float)acc;
    }
}

// fp32 depthwise: the same sums with channels innermost, so that each tap is
// one vector multiply-add over C contiguous channels of x (or dout) and of the
// weights transposed to wt[ky][kx][C] (in the workspace). The forward and the
// data gradient add the taps in the reference's (ky, kx) order.
static void depthwise_weights_t(const ConvCfg *cfg, int C, const float *w, float *wt) {
    const int KK = cfg->kh * cfg->kw;
    for (int c = 0; c < C; c++)
        for (int k = 0; k < KK; k++) wt[(size_t)k * C + c] = w[(size_t)c * KK + k];
}

static void depthwise_forward_f32(const ConvCfg *cfg, const ConvGeom *q, float *out,
                                  const float *in, const float *w, const float *b, float *wt) {
    const int C = q->C, s = cfg->stride;
    depthwise_weights_t(cfg, C, w, wt);
    #pragma omp parallel for schedule(static) if(PAR((size_t)q->N * q->P * C * cfg->kh * cfg->kw))
    for (int noy = 0; noy < q->N * q->OH; noy++) {
        const int n = noy / q->OH, oy = noy % q->OH;
        for (int ox = 0; ox < q->OW; ox++) {
            float *o = out + (((size_t)n * q->OH + oy) * q->OW + ox) * C;  // (C)
            for (int c = 0; c < C; c++) o[c] = b ? b[c] : 0.0f;
            for (int ky = 0; ky < cfg->kh; ky++) {
                const int iy = oy * s - q->pt + ky;
                if (iy < 0 || iy >= q->H) continue;
                for (int kx = 0; kx < cfg->kw; kx++) {
                    const int ix = ox * s - q->pl + kx;
                    if (ix < 0 || ix >= q->W) continue;
                    const float *xr = in + (((size_t)n * q->H + iy) * q->W + ix) * C,
                                *wr = wt + (size_t)(ky * cfg->kw + kx) * C;
                    #pragma omp simd
                    for (int c = 0; c < C; c++) o[c] += xr[c] * wr[c];
                }
            }
        }
    }
}

static void depthwise_backward_data_f32(const ConvCfg *cfg, const ConvGeom *q, float *din,
                                        const float *dout, const float *w, int accumulate,
                                        float *wt) {
    const int C = q->C, s = cfg->stride;
    depthwise_weights_t(cfg, C, w, wt);
    const size_t work __attribute__((unused)) = (size_t)q->N * q->H * q->W * C * cfg->kh * cfg->kw;
    #pragma omp parallel for schedule(static) if(PAR(work))
    for (int niy = 0; niy < q->N * q->H; niy++) {
        const int n = niy / q->H, iy = niy % q->H;
        float acc[C];  // (C)
        for (int ix = 0; ix < q->W; ix++) {
            for (int c = 0; c < C; c++) acc[c] = 0.0f;
            for (int ky = 0; ky < cfg->kh; ky++) {
                const int ty = iy + q->pt - ky;
                if (ty < 0 || ty % s || ty / s >= q->OH) continue;
                for (int kx = 0; kx < cfg->kw; kx++) {
                    const int tx = ix + q->pl - kx;
                    if (tx < 0 || tx % s || tx / s >= q->OW) continue;
                    const float *dr = dout + (((size_t)n * q->OH + ty / s) * q->OW + tx / s) * C;
                    const float *wr = wt + (size_t)(ky * cfg->kw + kx) * C;
                    #pragma omp simd
                    for (int c = 0; c < C; c++) acc[c] += dr[c] * wr[c];
                }
            }
            float *d = din + (((size_t)n * q->H + iy) * q->W + ix) * C;
            if (accumulate) for (int c = 0; c < C; c++) d[c] += acc[c];
            else memcpy(d, acc, sizeof(float) * C);
        }
    }
}

// dw[c][ky][kx] += Σ_{n,oy,ox} dout·x in fp64, a block of channels per thread,
// pixels in order: the same bits for any thread count.
#define DW_CBLOCK 16
static void depthwise_backward_weight_f32(const ConvCfg *cfg, const ConvGeom *q, float *dw,
                                          const float *dout, const float *in) {
    const int C = q->C, s = cfg->stride, KK = cfg->kh * cfg->kw;
    #pragma omp parallel for schedule(static) if(PAR((size_t)q->N * q->P * C * KK))
    for (int c0 = 0; c0 < C; c0 += DW_CBLOCK) {
        const int nc = C - c0 < DW_CBLOCK ? C - c0 : DW_CBLOCK;
        double acc[KK][DW_CBLOCK];  // (KK, DW_CBLOCK)
        memset(acc, 0, sizeof acc);
        for (int n = 0; n < q->N; n++)
            for (int oy = 0; oy < q->OH; oy++)
                for (int ox = 0; ox < q->OW; ox++) {
                    const float *dr = dout + (((size_t)n * q->OH + oy) * q->OW + ox) * C + c0;
                    for (int ky = 0; ky < cfg->kh; ky++) {
                        const int iy = oy * s - q->pt + ky;
                        if (iy < 0 || iy >= q->H) continue;
                        for (int kx = 0; kx < cfg->kw; kx++) {
                            const int ix = ox * s - q->pl + kx;
                            if (ix < 0 || ix >= q->W) continue;
                            const float *xr = in + (((size_t)n * q->H + iy) * q->W + ix) * C + c0;
                            double *a = acc[ky * cfg->kw + kx];
                            if (nc == DW_CBLOCK) {
                                #pragma omp simd
                                for (int j = 0; j < DW_CBLOCK; j++) a[j] += (double)dr[j] * xr[j];
                            } else {
                                for (int j = 0; j < nc; j++) a[j] += (double)dr[j] * xr[j];
                            }
                        }
                    }
                }
        for (int j = 0; j < nc; j++)
            for (int k = 0; k < KK; k++) dw[(size_t)(c0 + j) * KK + k] += (float)acc[k][j];
    }
}

// ---- direct k×k convolution (dense, groups 1): the forward and, for stride 1,
// the data gradient, without im2col. The input is copied once per image into
// a zero-padded fp32 image xp (Hp,Wp,C), so the inner loops have no bounds
// checks and any storage type is read once; then for a tile of R output
// pixels (oy_r, ox_r) and V vectors of VL output channels, the R·V sums
//   acc[r][v] = Σ_{ky,kx,ci} xp[oy_r·s + ky][ox_r·s + kx][ci] · wt[ky][kx][ci][co0 + v·VL ..]
// stay in vector registers while the (ky,kx,ci) loop streams the input rows
// and the weights repacked as wt[ky][kx][ci][Cop] (output channels contiguous,
// padded to Cop, a multiple of VL, with zeros), stored block by block of
// channels (direct_block_width). That is the register blocking a GEMM
// micro-kernel does, on the image itself.
// The data gradient of a stride-1 conv is the same sum over dout padded by
// (k - 1 - pad) with the weights flipped and transposed:
//   din[iy][ix][ci] = Σ_{ky',kx',co} dpad[iy + ky'][ix + kx'][co] · w[co][kh-1-ky'][kw-1-kx'][ci]
// At most CONV_VMAX vectors of channels per tile: 4 with 32 registers (6
// pixels, 24 sums), 2 with 16 (6 pixels, 12 sums). With 16 registers 4
// vectors leave room for 2 pixels: 8 FMAs for 6 loads, where 2 vectors make 12
// for 8.
#if defined(__AVX512F__)
#define CONV_VL 16                      // fp32 lanes per vector register
#define CONV_REGS 32                    // vector registers
#define CONV_VMAX 4
#elif defined(__AVX__)
#define CONV_VL 8
#define CONV_REGS 16
#define CONV_VMAX 2
#else                                   // SSE2 (every x86-64), NEON: 128-bit vectors
#define CONV_VL 4
#define CONV_REGS 16
#define CONV_VMAX 2
#endif
#define CONV_RMAX 12                    // output pixels per tile
typedef float vfloat __attribute__((vector_size(CONV_VL * sizeof(float))));
typedef double vdouble __attribute__((vector_size(CONV_VL * sizeof(double))));  // vfloat widened
static inline vfloat vload(const float *p) { vfloat v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vfloat v) { memcpy(p, &v, sizeof v); }
// x in every lane: x - (+0) is x exactly (-0 stays -0, unlike x + 0), and gcc
// compiles it to one broadcast. (A loop over the lanes, filled lane by lane,
// was vectorised at 256 bits under -march=native and rebuilt as a 512-bit
// vector through the stack: a failed store forward on every FMA of the conv
// tiles, which then ran at 16 GFLOP/s.)
static inline vfloat vsplat(float x) { return x - (vfloat){0}; }
// pixels per tile for V channel vectors: R·V accumulators + V weights + 1 broadcast fit the
// registers
static inline int conv_tile_pixels(int V) {
    int r = (CONV_REGS - 2 - V) / V;
    return r > CONV_RMAX ? CONV_RMAX : r;
}
// A run of pixels (or of channels) is cut into tiles of R =
// conv_tile_pixels(V), then the rest into tiles of 8, 4, 2 and 1. Each tile
// function (direct_conv_tile, direct_dw_tile) is written once, always
// inlined, with R and V as arguments; CONV_TILE_SHAPES compiles it once per
// shape (R, V) with both constant, as a function of its own, and
// CONV_TILE_TABLE lists those (20, or 10 with CONV_VMAX 2) by [V][kind]. In
// one function the compiler allocated all shapes' accumulators together and
// kept some of them on the stack (half speed).
enum { CONV_TILE_FULL, CONV_TILE_8, CONV_TILE_4, CONV_TILE_2, CONV_TILE_1, CONV_TILE_KINDS };
// define(name, R, V) for the five shapes of V channel vectors
#define CONV_TILE_SHAPES(define, prefix, V)                                               \
    define(prefix##_full##V, conv_tile_pixels(V), V) define(prefix##_8x##V, 8, V)          \
    define(prefix##_4x##V, 4, V) define(prefix##_2x##V, 2, V) define(prefix##_1x##V, 1, V)
#define CONV_TILE_KINDS_OF(prefix, V)                                                     \
    {prefix##_full##V, prefix##_8x##V, prefix##_4x##V, prefix##_2x##V, prefix##_1x##V}
#if CONV_VMAX == 4
#define CONV_TILE_ALL(define, prefix)                                                     \
    CONV_TILE_SHAPES(define, prefix, 1) CONV_TILE_SHAPES(define, prefix, 2)                \
    CONV_TILE_SHAPES(define, prefix, 3) CONV_TILE_SHAPES(define, prefix, 4)
#define CONV_TILE_TABLE(prefix)                                                           \
    {{NULL}, CONV_TILE_KINDS_OF(prefix, 1), CONV_TILE_KINDS_OF(prefix, 2),                 \
     CONV_TILE_KINDS_OF(prefix, 3), CONV_TILE_KINDS_OF(prefix, 4)}
#else
#define CONV_TILE_ALL(define, prefix)                                                     \
    CONV_TILE_SHAPES(define, prefix, 1) CONV_TILE_SHAPES(define, prefix, 2)
#define CONV_TILE_TABLE(prefix)                                                           \
    {{NULL}, CONV_TILE_KINDS_OF(prefix, 1), CONV_TILE_KINDS_OF(prefix, 2)}
#endif
// tiles along n: as many R wide as fit, then one each of 8, 4, 2, 1 narrower than R
static inline int conv_tile_count(int n, int R) {
    int tiles = n / R;
    n %= R;
    for (int w = 8; w >= 1; w /= 2)
        if (R > w && n >= w) { tiles++; n -= w; }
    return tiles;
}
// the R·V tiles along [from, to) (pixels of a run, or output channels): full
// ones, or tiles of 8 where they are fewer (16 channels: 8 + 8 rather than
// 9 + 4 + 2 + 1)
#define CONV_TILE_ROW(tiles, V, from, to, call)                                           \
    do {                                                                                  \
        const int full_ = conv_tile_pixels(V);                                            \
        const int eights_ = full_ > 8 && conv_tile_count((to) - (from), 8) <               \
                                                 conv_tile_count((to) - (from), full_);   \
        const int R_ = eights_ ? 8 : full_;                                               \
        const int kind_ = eights_ ? CONV_TILE_8 : CONV_TILE_FULL;                         \
        int at_ = (from);                                                                 \
        for (; at_ + R_ <= (to); at_ += R_) call((tiles)[kind_], at_);                    \
        if (R_ > 8 && (to) - at_ >= 8) { call((tiles)[CONV_TILE_8], at_); at_ += 8; }     \
        if (R_ > 4 && (to) - at_ >= 4) { call((tiles)[CONV_TILE_4], at_); at_ += 4; }     \
        if (R_ > 2 && (to) - at_ >= 2) { call((tiles)[CONV_TILE_2], at_); at_ += 2; }     \
        if (at_ < (to)) call((tiles)[CONV_TILE_1], at_);                                  \
    } while (0)

// The repacked weights wt[kc][Cop], kc = (ky·kw + kx)·C + ci, stored block by
// block of output channels: the block from co0 = b·CONV_VMAX·CONV_VL, bw wide
// (the last one narrower), is [KC][bw] at wt + KC·co0, so that a tile, which
// takes one block, reads its weights in order (with [KC][Cop] rows of 256 or
// 512 channels, it read 4 cache lines every 1 or 2 KiB).
static inline int direct_block_width(int Cop, int co0) {
    return Cop - co0 < CONV_VMAX * CONV_VL ? Cop - co0 : CONV_VMAX * CONV_VL;
}
// forward: wt[kc][co] = w[co][kc] (0 from Cout to Cop), a transpose done in
// tiles of 16 kc (one cache line of a weight row) by a block of channels
// (element by element with co innermost, every read was a page apart)
static void direct_repack_forward(const float *w, int KC, int Cout, int Cop, float *wt) {
    const int tiles = (KC + 15) / 16, block = CONV_VMAX * CONV_VL;
    #pragma omp parallel for schedule(static) if(PAR((size_t)KC * Cop))
    for (int t = 0; t < tiles; t++) {
        const int kc0 = t * 16, kc1 = kc0 + 16 < KC ? kc0 + 16 : KC;
        for (int co0 = 0; co0 < Cop; co0 += block) {
            const int bw = direct_block_width(Cop, co0);
            float *dst = wt + (size_t)KC * co0;
            for (int co = co0; co < co0 + bw; co++)
                for (int kc = kc0; kc < kc1; kc++)
                    dst[(size_t)kc * bw + (co - co0)] = co < Cout ? w[(size_t)co * KC + kc] : 0.0f;
        }
    }
}

typedef struct {
    const float *xp;      // (Hp,Wp,C) padded input of one image (the first of a chunk)
    int Wp, C, s, kh, kw;
    const float *wt;      // [kh][kw][C][Cop] by blocks of channels (direct_block_width)
    int Cop;
    const float *bias;    // (Cout) or NULL
    Tensor out;           // (N,OH,OW,Cout)
    size_t out_image;     // element offset of this image in out
    int OW, Cout, accumulate;
    // floats per padded image, elements per output image (the chunk's next image)
    size_t xp_image, out_stride;
} DirectConv;

// The R pixels of a tile are R consecutive output pixels p0 .. p0 + R - 1 of
// the image in row-major order, which may run from one row into the next: a
// small image (the deep levels of a U-Net, 8×8 or 4×4) is one run of whole
// tiles instead of rows too short for one. Pixel p reads its receptive field
// from the padded input at
//   at(p) = (p / OW)·s·Wp·C + (p % OW)·s·C,  then + ky·Wp·C + kx·C + ci.
static inline __attribute__((always_inline)) void
direct_conv_tile(const DirectConv *d, int R, int V, int p0, int co0) {
    // fixed sizes: indexed by constants once unrolled, so kept in registers
    vfloat acc[CONV_RMAX][CONV_VMAX];
    #pragma GCC unroll 12
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int v = 0; v < V; v++) acc[r][v] = (vfloat){0};
    const size_t row = (size_t)d->Wp * d->C;
    const int bw = direct_block_width(d->Cop, co0);
    size_t at[CONV_RMAX];
    #pragma GCC unroll 12
    for (int r = 0; r < R; r++)
        at[r] = (size_t)((p0 + r) / d->OW) * d->s * row + (size_t)((p0 + r) % d->OW) * d->s * d->C;
    for (int ky = 0; ky < d->kh; ky++)
        for (int kx = 0; kx < d->kw; kx++) {
            const float *xr = d->xp + (size_t)ky * row + (size_t)kx * d->C;
            const float *wr = d->wt + (size_t)d->kh * d->kw * d->C * co0 +
                              (size_t)(ky * d->kw + kx) * d->C * bw;
            for (int ci = 0; ci < d->C; ci++) {
                vfloat wv[CONV_VMAX];
                #pragma GCC unroll 4
                for (int v = 0; v < V; v++) wv[v] = vload(wr + (size_t)ci * bw + v * CONV_VL);
                #pragma GCC unroll 12
                for (int r = 0; r < R; r++) {
                    vfloat b = vsplat(xr[at[r] + ci]);
                    #pragma GCC unroll 4
                    for (int v = 0; v < V; v++) acc[r][v] += b * wv[v];
                }
            }
        }
    const int nc = d->Cout - co0 < V * CONV_VL ? d->Cout - co0 : V * CONV_VL;
    if (d->out.dtype == DT_F32 && nc == V * CONV_VL) {
        // whole fp32 vectors from the registers: the same sums as the run below, (acc + bias)
        // (+ out), without a call to memcpy per pixel (15% of a small U-Net's step)
        float *o = (float *)d->out.data + d->out_image + (size_t)p0 * d->Cout + co0;
        #pragma GCC unroll 12
        for (int r = 0; r < R; r++)
            #pragma GCC unroll 4
            for (int v = 0; v < V; v++) {
                vfloat y = acc[r][v];
                if (d->bias) y += vload(d->bias + co0 + v * CONV_VL);
                if (d->accumulate) y += vload(o + (size_t)r * d->Cout + v * CONV_VL);
                vstore(o + (size_t)r * d->Cout + v * CONV_VL, y);
            }
        return;
    }
    // one pixel's channels co0.., then stored (rounded, accumulated) as a run
    float tile[CONV_VMAX * CONV_VL];
    #pragma GCC unroll 12
    for (int r = 0; r < R; r++) {
        #pragma GCC unroll 4
        for (int v = 0; v < V; v++) vstore(tile + v * CONV_VL, acc[r][v]);
        if (d->bias) for (int j = 0; j < nc; j++) tile[j] += d->bias[co0 + j];
        st_run(d->out, d->out_image + ((size_t)p0 + r) * d->Cout + co0, tile,
               (size_t)nc, d->accumulate);
    }
}

// direct_conv_tile with (R, V) constant: direct_conv_tile_full1 .. direct_conv_tile_1x4
typedef void (*DirectConvTile)(const DirectConv *d, int p0, int co0);
#define DIRECT_CONV_TILE(name, R, V)                                                      \
    static __attribute__((noinline)) void name(const DirectConv *d, int p0, int co0) {    \
        direct_conv_tile(d, R, V, p0, co0);                                               \
    }
CONV_TILE_ALL(DIRECT_CONV_TILE, direct_conv_tile)
static const DirectConvTile direct_conv_tiles[CONV_VMAX + 1][CONV_TILE_KINDS] =
        CONV_TILE_TABLE(direct_conv_tile);

// A work item's output pixels: whole rows, at least DIRECT_RUN_PIXELS of them
// (a row of 64 or more; 2 rows of 32, ...; a whole 8×8 or 4×4 image), so that
// short rows make whole tiles.
#define DIRECT_RUN_PIXELS 64
static int direct_run_rows(int OH, int OW) {
    const int rows = (DIRECT_RUN_PIXELS + OW - 1) / OW;
    return rows < OH ? rows : OH;
}

// output pixels [p_from, p_to) of the chunk's image n, output channels from co0, up to
// CONV_VMAX·CONV_VL of them
static void direct_conv_run(const DirectConv *chunk, int n, int p_from, int p_to, int co0) {
    DirectConv image = *chunk;
    image.xp += (size_t)n * chunk->xp_image;
    image.out_image += (size_t)n * chunk->out_stride;
    int V = (chunk->Cout - co0 + CONV_VL - 1) / CONV_VL;
    if (V > CONV_VMAX) V = CONV_VMAX;
#define CONV_TILE_AT(tile, p) (tile)(&image, p, co0)
    CONV_TILE_ROW(direct_conv_tiles[V], V, p_from, p_to, CONV_TILE_AT);
#undef CONV_TILE_AT
}

static int conv_pad_to_vl(int c) { return (c + CONV_VL - 1) / CONV_VL * CONV_VL; }
// Which path a dense k×k conv takes, by vector width, from per-layer timings
// (best of 8-12 calls, 2 threads, builds alternating, on a 2-core virtual Xeon
// model 207; AVX2 and SSE2 built there with -march=haswell and -march=x86-64)
// of make bench's unet-64 (batch 8) and unet 256×256 (batch 4) layers:
// - With AVX2 or AVX-512 the forward and the data gradient are direct
//   whatever the channels. Against im2col + GEMM from 8 vectors of input
//   channels, the layers' forward and data-gradient times summed: AVX-512
//   39.1 → 33.2 ms (unet-64) and 1120 → 835 ms (unet 256×256); AVX2 60.0 →
//   48.2 and 2224 → 1310. (A GEMM per image, so that an image's sums do not
//   depend on its batch, has OpenBLAS pack the weights again for each image.)
// - Their weight gradient takes im2col + GEMM from 8 vectors of input
//   channels, but is direct for images of at most CONV_DIRECT_MAX_PIXELS
//   output pixels: unet-64's 8×8 and 4×4 layers with 128 channels or more
//   took AVX-512 11.6 → 8.9 ms, AVX2 14.2 → 12.8. Direct everywhere, the
//   unet 256×256 weight gradients took 1.03× as long on AVX-512 (1.2-1.5× at
//   32×32 and 16×16 with 128 channels or more, 0.8× at 128×128 with 192).
// - SSE2 (NO_NATIVE=1) runs its own loops on 4 lanes but OpenBLAS's on the
//   CPU's widest vectors: im2col + GEMM from 8 vectors (32 channels) in every
//   pass. Direct forward and data gradients for all channels took unet-64
//   1.9× and unet 256×256 2.4× as long; small images direct, unet-64's convs
//   1.5×.
#if defined(__AVX__)
#define CONV_GEMM_MIN_CIN INT_MAX          // forward, data gradient: never
#define CONV_DIRECT_MAX_PIXELS 64
#else
#define CONV_GEMM_MIN_CIN (8 * CONV_VL)
#define CONV_DIRECT_MAX_PIXELS 0
#endif
#define CONV_DW_GEMM_MIN_CIN (8 * CONV_VL)  // weight gradient
// a dense k×k conv below gemm_min_cin input channels, or on a small image
static int conv_dense_direct(const ConvCfg *cfg, const ConvGeom *q, int gemm_min_cin) {
    return cfg->groups == 1 && cfg->kh * cfg->kw > 1 &&
           (cfg->cin < gemm_min_cin || q->OH * q->OW <= CONV_DIRECT_MAX_PIXELS);
}
static int conv_is_direct(const ConvCfg *cfg, const ConvGeom *q) {
    return conv_dense_direct(cfg, q, CONV_GEMM_MIN_CIN);
}
// The gradients' vectors run over input channels. With fewer than a vector's
// worth (an RGB stem) most lanes idle: the data gradient takes im2col + GEMM;
// the weight gradient stays direct, which with 3 of the lanes still took half
// the GEMM's time (unet-64's stem, 64×64, 3 → 16 channels: AVX-512 2.22 → 1.08
// ms, AVX2 2.37 → 1.14, SSE2 2.44 → 1.33). The weight gradient of a dense 1×1
// conv with a vector of channels or more takes the direct path too: a GEMM per
// image (its fp64 sum image by image) is slow for the small images of the late
// stages, where K = H·W is a few hundred.
static int conv_direct_grad_data(const ConvCfg *cfg, const ConvGeom *q) {
    return conv_is_direct(cfg, q) && cfg->cin >= CONV_VL && cfg->stride == 1;
}
static int conv_direct_grad_weight(const ConvCfg *cfg, const ConvGeom *q) {
    if (cfg->kh * cfg->kw == 1) return cfg->groups == 1 && cfg->cin >= CONV_VL;
    return conv_dense_direct(cfg, q, CONV_DW_GEMM_MIN_CIN);
}
// The direct paths pad a chunk of images at a time: as many as fit in
// conv_chunk_floats, at least one. Small images (a U-Net's deep levels) then
// give each parallel loop rows of several images and each weight-gradient
// tile several images' pixels, with two parallel loops per chunk instead of
// per image, while a large image's workspace stays one image.
static size_t conv_chunk_floats = (size_t)1 << 20;  // 4 MiB (a variable: the tests lower it)
static int conv_chunk_images(size_t image_floats, int N) {
    size_t k = conv_chunk_floats / image_floats;
    return k < 1 ? 1 : k > (size_t)N ? N : (int)k;
}
// Floats of one padded image (backward: 0 forward, 1 data gradient, 2 weight
// gradient), with the weight gradient's fp32 dout rows: the data gradient pads
// dout, whose "image" has Cout channels.
static size_t direct_conv_image_floats(const ConvCfg *cfg, const ConvGeom *q, int backward) {
    if (backward == 1) return (size_t)(q->H + cfg->kh - 1) * (q->W + cfg->kw - 1) * q->Cout;
    size_t pad = (size_t)((q->OH - 1) * cfg->stride + cfg->kh) *
                 ((q->OW - 1) * cfg->stride + cfg->kw) * q->C;
    return pad + (backward == 2 ? q->P * q->Cout : 0);
}
// Floats of workspace for the direct paths: a chunk of padded images and the
// repacked weights (the data gradient's have Cin outputs); the weight
// gradient's fp64 sums and slack after the images instead (see below).
static size_t direct_conv_floats(const ConvCfg *cfg, const ConvGeom *q, int backward) {
    const size_t image = direct_conv_image_floats(cfg, q, backward), KK = (size_t)cfg->kh * cfg->kw;
    const size_t images = (size_t)conv_chunk_images(image, q->N) * image;
    if (backward == 2) return 2 * (size_t)q->Cout * KK * q->C + images + CONV_VMAX * CONV_VL;
    if (backward == 1) return images + KK * q->Cout * conv_pad_to_vl(q->C);
    return images + KK * q->C * conv_pad_to_vl(q->Cout);
}

// xp[k][y][x][c] = src[n0 + k, y - top, x - left, c] inside the source, else 0:
// (nb,Hp,Wp,C) fp32, the nb images from n0 (image k at xp + k·image floats)
static void pad_images(Tensor src, int n0, int nb, int top, int left, int Hp, int Wp, size_t image,
                       float *xp) {
    const int H = src.shape.h, W = src.shape.w, C = src.shape.c;
    #pragma omp parallel for schedule(static) if(PAR((size_t)nb * Hp * Wp * C))
    for (int ky = 0; ky < nb * Hp; ky++) {
        const int k = ky / Hp, y = ky % Hp, n = n0 + k;
        float *dst = xp + k * image + (size_t)y * Wp * C;
        int sy = y - top;
        if (sy < 0 || sy >= H) { memset(dst, 0, sizeof(float) * Wp * C); continue; }
        // destination columns with data
        int x0 = left > 0 ? left : 0, x1 = left + W < Wp ? left + W : Wp;
        memset(dst, 0, sizeof(float) * x0 * C);
        ld_run(src, (((size_t)n * H + sy) * W + (x0 - left)) * C, dst + (size_t)x0 * C,
               (size_t)(x1 - x0) * C);
        memset(dst + (size_t)x1 * C, 0, sizeof(float) * (Wp - x1) * C);
    }
}

// The conv of the images in chunks: each chunk padded (src with padding top,
// left into d->xp), then in one parallel loop its runs of rows of all images,
// block of output channels by block: the threads stream one block's weights
// (kh·kw·C·CONV_VMAX·CONV_VL floats, a few hundred KiB) from their caches
// over all the chunk's runs before the next, where all the weights for each
// row would not stay in cache when they exceed it (deep levels of small images).
static void direct_conv_images(DirectConv *d, Tensor src, int N, int top, int left, int Hp, int Wp,
                               int OH) {
    const int chunk = conv_chunk_images(d->xp_image, N), block = CONV_VMAX * CONV_VL;
    const int blocks = (d->Cout + block - 1) / block;
    for (int n0 = 0; n0 < N; n0 += chunk) {
        const int nb = N - n0 < chunk ? N - n0 : chunk;
        const int run = direct_run_rows(OH, d->OW), runs_per_image = (OH + run - 1) / run;
        const int runs = nb * runs_per_image;
        pad_images(src, n0, nb, top, left, Hp, Wp, d->xp_image, (float *)d->xp);
        d->out_image = (size_t)n0 * d->out_stride;
        const size_t work __attribute__((unused)) =
                (size_t)nb * OH * d->OW * d->Cout * d->C * d->kh * d->kw;
        #pragma omp parallel for schedule(dynamic, 1) if(PAR(work))
        for (int item = 0; item < blocks * runs; item++) {
            const int n = item % runs / runs_per_image, oy = item % runs % runs_per_image * run;
            const int oy_end = oy + run < OH ? oy + run : OH;
            direct_conv_run(d, n, oy * d->OW, oy_end * d->OW, item / runs * block);
        }
    }
}

static void conv2d_forward_direct(const ConvCfg *cfg, const ConvGeom *q, Tensor out, Tensor in,
                                  const float *w, const float *b, float *ws) {
    const int s = cfg->stride, Hp = (q->OH - 1) * s + cfg->kh, Wp = (q->OW - 1) * s + cfg->kw;
    const int Cop = conv_pad_to_vl(q->Cout), KK = cfg->kh * cfg->kw;
    // [kh][kw][C][Cop] by blocks (direct_block_width), chunk of (Hp,Wp,C)
    float *wt = ws, *xp = ws + (size_t)KK * q->C * Cop;
    direct_repack_forward(w, KK * q->C, q->Cout, Cop, wt);
    DirectConv d = {xp, Wp, q->C, s, cfg->kh, cfg->kw, wt, Cop, b, out, 0, q->OW, q->Cout, 0,
                    direct_conv_image_floats(cfg, q, 0), q->P * q->Cout};
    direct_conv_images(&d, in, q->N, q->pt, q->pl, Hp, Wp, q->OH);
}

static void conv2d_backward_data_direct(const ConvCfg *cfg, const ConvGeom *q, Tensor din,
                                        Tensor dout, const float *w, int accumulate, float *ws) {
    const int Hp = q->H + cfg->kh - 1, Wp = q->W + cfg->kw - 1, KK = cfg->kh * cfg->kw;
    const int Cip = conv_pad_to_vl(q->C);
    // [kh][kw][Cout][Cip] by blocks (direct_block_width), chunk of (Hp,Wp,Cout): row kc holds
    // the input channels of w[co][kh-1-ky][kw-1-kx][..], in order
    float *wt = ws, *dp = ws + (size_t)KK * q->Cout * Cip;
    const int KC = KK * q->Cout;
    #pragma omp parallel for schedule(static) if(PAR((size_t)KC * Cip))
    for (int kc = 0; kc < KC; kc++) {
        const int k = kc / q->Cout, co = kc % q->Cout, ky = k / cfg->kw, kx = k % cfg->kw;
        const int flipped = (cfg->kh - 1 - ky) * cfg->kw + (cfg->kw - 1 - kx);
        const float *src = w + ((size_t)co * KK + flipped) * q->C;
        for (int ci0 = 0; ci0 < Cip; ci0 += CONV_VMAX * CONV_VL) {
            const int bw = direct_block_width(Cip, ci0);
            float *dst = wt + (size_t)KC * ci0 + (size_t)kc * bw;
            for (int j = 0; j < bw; j++) dst[j] = ci0 + j < q->C ? src[ci0 + j] : 0.0f;
        }
    }
    DirectConv d = {dp,
                    Wp,
                    q->Cout,
                    1,
                    cfg->kh,
                    cfg->kw,
                    wt,
                    Cip,
                    NULL,
                    din,
                    0,
                    q->W,
                    q->C,
                    accumulate,
                    direct_conv_image_floats(cfg, q, 1),
                    (size_t)q->H * q->W * q->C};
    direct_conv_images(&d, dout, q->N, cfg->kh - 1 - q->pt, cfg->kw - 1 - q->pl, Hp, Wp, q->H);
}

// The weight gradient, any stride:
//   dw[co][ky][kx][ci] += Σ_{n,oy,ox} dout[n,oy,ox,co] · xp_n[oy·s + ky][ox·s + kx][ci]
// per tap, a tile of R output channels (broadcast from dout) × V vectors of
// input channels (loaded from the padded input) accumulates a block of whole
// output rows of a chunk's images, about DW_FLUSH_PIXELS pixels, in registers
// (fp32), then adds them into fp64 sums: blocks in order, so the result does
// not depend on the thread count. Every tile of a work item takes a block
// before the next block: the block's input and dout rows stay in the core's
// cache while the tiles go through them (tile by tile over the whole chunk,
// each tile streamed the chunk again from memory).
#define DW_FLUSH_PIXELS 512
typedef struct {
    // nb × (Hp,Wp,C) padded input of the chunk's images (with CONV_VMAX·CONV_VL floats of slack)
    const float *xp;
    size_t xp_image;      // floats per padded image
    int Wp, C, s, kw, KK;
    const float *dy;      // (nb,OH,OW,Cout) fp32 output gradient of the same images
    int nb, OH, OW, Cout;
    double *sum;          // [Cout][kh][kw][C], the weight gradient's layout
} DirectDW;

// rows per fp32 partial sum
static int direct_dw_block_rows(const DirectDW *d) {
    return d->OW >= DW_FLUSH_PIXELS ? 1 : DW_FLUSH_PIXELS / d->OW;
}
// the tile's sums over the block of rows from row0 (the chunk's rows, image by image)
static inline __attribute__((always_inline)) void
direct_dw_tile(const DirectDW *d, int R, int V, int tap, int co0, int ci0, int row0) {
    const int ky = tap / d->kw, kx = tap % d->kw;
    const size_t xstep = (size_t)d->s * d->C;
    const int rows = direct_dw_block_rows(d), total = d->nb * d->OH;
    vfloat acc[CONV_RMAX][CONV_VMAX];
    #pragma GCC unroll 12
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int v = 0; v < V; v++) acc[r][v] = (vfloat){0};
    for (int row = row0; row < row0 + rows && row < total; row++) {
        const int n = row / d->OH, oy = row % d->OH;
        const float *xr =
                d->xp + n * d->xp_image + ((size_t)(oy * d->s + ky) * d->Wp + kx) * d->C + ci0;
        const float *dr = d->dy + (size_t)row * d->OW * d->Cout + co0;
        for (int ox = 0; ox < d->OW; ox++) {
            vfloat xv[CONV_VMAX];
            #pragma GCC unroll 4
            for (int v = 0; v < V; v++) xv[v] = vload(xr + ox * xstep + v * CONV_VL);
            #pragma GCC unroll 12
            for (int r = 0; r < R; r++) {
                vfloat b = vsplat(dr[(size_t)ox * d->Cout + r]);
                #pragma GCC unroll 4
                for (int v = 0; v < V; v++) acc[r][v] += b * xv[v];
            }
        }
    }
    const int nc = d->C - ci0 < V * CONV_VL ? d->C - ci0 : V * CONV_VL;
    if (nc == V * CONV_VL) {
        // whole vectors widened to fp64 in registers: the same additions as the loop below,
        // which gcc left scalar (a sixth of the tile's time at 512 pixels a block)
        #pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            double *sr = d->sum + ((size_t)(co0 + r) * d->KK + tap) * d->C + ci0;
            #pragma GCC unroll 4
            for (int v = 0; v < V; v++) {
                vdouble s;
                memcpy(&s, sr + v * CONV_VL, sizeof s);
                s += __builtin_convertvector(acc[r][v], vdouble);
                memcpy(sr + v * CONV_VL, &s, sizeof s);
            }
        }
        return;
    }
    float lanes[CONV_VMAX * CONV_VL];
    #pragma GCC unroll 12
    for (int r = 0; r < R; r++) {
        #pragma GCC unroll 4
        for (int v = 0; v < V; v++) vstore(lanes + v * CONV_VL, acc[r][v]);
        double *sr = d->sum + ((size_t)(co0 + r) * d->KK + tap) * d->C + ci0;
        for (int j = 0; j < nc; j++) sr[j] += lanes[j];
    }
}
// direct_dw_tile with (R, V) constant, as direct_conv_tiles
typedef void (*DirectDWTile)(const DirectDW *d, int tap, int co0, int ci0, int row0);
#define DIRECT_DW_TILE(name, R, V)                                                        \
    static __attribute__((noinline)) void name(const DirectDW *d, int tap, int co0,       \
                                               int ci0, int row0) {                       \
        direct_dw_tile(d, R, V, tap, co0, ci0, row0);                                     \
    }
CONV_TILE_ALL(DIRECT_DW_TILE, direct_dw_tile)
static const DirectDWTile direct_dw_tiles[CONV_VMAX + 1][CONV_TILE_KINDS] =
        CONV_TILE_TABLE(direct_dw_tile);

// Work items: (tap, block of input channels, part of the output channels).
// Each weight belongs to one item, which sums its rows in order, so neither
// the split nor the thread count changes a bit. Few taps and channel blocks (a
// 1×1 conv) are split along the output channels into parts of whole tiles
// (DW_PART_ALIGN: a multiple of every conv_tile_pixels) until there are
// DW_MIN_ITEMS items.
#define DW_MIN_ITEMS 8
#define DW_PART_ALIGN 36
static void direct_dw_chunk(const DirectDW *d) {
    const int n_ci = (d->C + CONV_VMAX * CONV_VL - 1) / (CONV_VMAX * CONV_VL);
    int part = d->Cout;
    if (d->KK * n_ci < DW_MIN_ITEMS) {
        const int parts = (DW_MIN_ITEMS + d->KK * n_ci - 1) / (d->KK * n_ci);
        part = ((d->Cout + parts - 1) / parts + DW_PART_ALIGN - 1) / DW_PART_ALIGN * DW_PART_ALIGN;
    }
    const int n_co = (d->Cout + part - 1) / part;
    const size_t work __attribute__((unused)) =
            (size_t)d->nb * d->OH * d->OW * d->Cout * d->C * d->KK;
    #pragma omp parallel for schedule(dynamic, 1) if(PAR(work))
    for (int item = 0; item < d->KK * n_ci * n_co; item++) {
        const int co_lo = item % n_co * part,
                  co_hi = co_lo + part < d->Cout ? co_lo + part : d->Cout;
        const int tap = item / n_co / n_ci, ci0 = item / n_co % n_ci * CONV_VMAX * CONV_VL;
        int V = (d->C - ci0 + CONV_VL - 1) / CONV_VL;
        if (V > CONV_VMAX) V = CONV_VMAX;
        const int rows = direct_dw_block_rows(d);
        for (int row0 = 0; row0 < d->nb * d->OH; row0 += rows) {
#define DW_TILE_AT(tile, co) (tile)(d, tap, co, ci0, row0)
            CONV_TILE_ROW(direct_dw_tiles[V], V, co_lo, co_hi, DW_TILE_AT);
#undef DW_TILE_AT
        }
    }
}

static void conv2d_backward_weight_direct(const ConvCfg *cfg, const ConvGeom *q, float *dw,
                                          Tensor dout, Tensor in, float *ws) {
    const int s = cfg->stride, Hp = (q->OH - 1) * s + cfg->kh, Wp = (q->OW - 1) * s + cfg->kw;
    const size_t n_w = (size_t)q->Cout * cfg->kh * cfg->kw * q->C, image = (size_t)Hp * Wp * q->C;
    const int chunk = conv_chunk_images(direct_conv_image_floats(cfg, q, 2), q->N);
    double *sum = (double *)ws;                                     // (n_w) fp64
    float *xp = ws + 2 * n_w;                                       // chunk × (Hp,Wp,C) + slack
    // (chunk,OH,OW,Cout) when dout is 16-bit
    float *rows = xp + chunk * image + CONV_VMAX * CONV_VL;
    memset(sum, 0, sizeof(double) * n_w);
    DirectDW d = {xp,   image, Wp,    q->C,  s,       cfg->kw, cfg->kh * cfg->kw,
                  NULL, 0,     q->OH, q->OW, q->Cout, sum};
    for (int n0 = 0; n0 < q->N; n0 += chunk) {
        d.nb = q->N - n0 < chunk ? q->N - n0 : chunk;
        pad_images(in, n0, d.nb, q->pt, q->pl, Hp, Wp, image, xp);
        memset(xp + d.nb * image, 0, sizeof(float) * CONV_VMAX * CONV_VL);
        d.dy = images_rows_f32(dout, n0, d.nb, q->P, q->Cout, rows);
        direct_dw_chunk(&d);
    }
    add_rounded(dw, sum, n_w);
}

static void add_bias_rows(float *y, size_t rows, int C, const float *b) {
    #pragma omp parallel for schedule(static) if(PAR(rows * C))
    for (size_t r = 0; r < rows; r++)
        for (int c = 0; c < C; c++) y[r * C + c] += b[c];
}

// im2col + GEMM per image and group: grouped convs, and the reference for the direct paths
static void conv2d_forward_gemm(const ConvCfg *cfg, const ConvGeom *qp, Tensor out, Tensor in,
                                const float *w, const float *b, float *ws) {
    const ConvGeom q = *qp;
    float *col = ws;                           // (P, K)
    float *rows = col + q.P * q.K;             // (P, Cout) when out is not fp32
    for (int n = 0; n < q.N; n++) {
        // (P, Cout)
        float *y = out.dtype == DT_F32 ? (float *)out.data + (size_t)n * q.P * q.Cout : rows;
        for (int g = 0; g < cfg->groups; g++) {
            im2col(cfg, &q, in, n, g, col);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)q.P, q.Coutg, q.K, 1.0f, col,
                        q.K, w + (size_t)g * q.Coutg * q.K, q.K, 0.0f, y + (size_t)g * q.Coutg,
                        q.Cout);
        }
        if (b) add_bias_rows(y, q.P, q.Cout, b);
        if (out.dtype != DT_F32) {
            #pragma omp parallel for schedule(static) if(PAR(q.P * q.Cout))
            for (size_t p = 0; p < q.P; p++)
                st_run(out, ((size_t)n * q.P + p) * q.Cout, rows + p * q.Cout, (size_t)q.Cout, 0);
        }
    }
}

static void conv2d_backward_data_gemm(const ConvCfg *cfg, const ConvGeom *qp, Tensor din,
                                      Tensor dout, const float *w, int accumulate, float *ws) {
    const ConvGeom q = *qp;
    float *dcol = ws;                             // (P, K)
    float *rows = dcol + q.P * q.K;               // (P, Cout) when dout is not fp32
    for (int n = 0; n < q.N; n++) {
        const float *dy = image_rows_f32(dout, n, q.P, q.Cout, rows);
        for (int g = 0; g < cfg->groups; g++) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)q.P, q.K, q.Coutg, 1.0f,
                        dy + (size_t)g * q.Coutg, q.Cout, w + (size_t)g * q.Coutg * q.K, q.K, 0.0f,
                        dcol, q.K);
            col2im(cfg, &q, dcol, din, n, g, accumulate);
        }
    }
}

static void conv2d_backward_weight_gemm(const ConvCfg *cfg, const ConvGeom *qp, float *dw,
                                        Tensor dout, Tensor in, float *ws) {
    const ConvGeom q = *qp;
    const size_t n_w = (size_t)q.Cout * q.K, n_wg = (size_t)q.Coutg * q.K;
    double *sum = (double *)ws;                   // (n_w) fp64
    float *image_dw = (float *)(sum + n_w);       // (Coutg, K) one image's product for one group
    float *col = image_dw + n_wg;                 // (P, K)
    float *rows = col + q.P * q.K;                // (P, Cout) when dout is not fp32
    memset(sum, 0, sizeof(double) * n_w);
    for (int n = 0; n < q.N; n++) {
        const float *dy = image_rows_f32(dout, n, q.P, q.Cout, rows);
        for (int g = 0; g < cfg->groups; g++) {
            im2col(cfg, &q, in, n, g, col);
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, q.Coutg, q.K, (int)q.P, 1.0f,
                        dy + (size_t)g * q.Coutg, q.Cout, col, q.K, 0.0f, image_dw, q.K);
            sum_into_f64(sum + (size_t)g * n_wg, image_dw, n_wg);
        }
    }
    add_rounded(dw, sum, n_w);
}

// Workspace in bytes: col (P·K) for the GEMM paths, plus an fp32 copy of one
// image's output or output gradient when activations are not stored in fp32,
// plus for the weight gradient its fp64 sum and one image's product (fp32);
// depthwise: its weights transposed to [kh][kw][C]; the direct convolutions' own.
size_t conv2d_workspace_cpu(Ops *o, const ConvCfg *cfg, Shape in, DType dt) {
    (void)o;
    // weights [kh][kw][C]
    if (conv_is_depthwise(cfg)) return sizeof(float) * (size_t)cfg->kh * cfg->kw * cfg->cin;
    ConvGeom q = conv_geom(cfg, in);
    // the weight gradient's: direct, or an fp64 sum and one image's
    if (conv_is_pointwise(cfg) && dt == DT_F32)
        return (conv_direct_grad_weight(cfg, &q) ? direct_conv_floats(cfg, &q, 2)
                                             : 3 * (size_t)q.Cout * q.K) *
               sizeof(float);
    // dw_gemm > im2col
    size_t im2col = im2col_floats(&q, dt), dw_gemm = gemm_weight_grad_floats(&q, dt);
    size_t dw = conv_direct_grad_weight(cfg, &q) ? direct_conv_floats(cfg, &q, 2) : dw_gemm;
    if (!conv_is_direct(cfg, &q)) return (dw > im2col ? dw : im2col) * sizeof(float);
    size_t floats = direct_conv_floats(cfg, &q, 0);
    size_t dx = conv_direct_grad_data(cfg, &q) ? direct_conv_floats(cfg, &q, 1) : im2col;
    if (dw > floats) floats = dw;
    if (dx > floats) floats = dx;
    return floats * sizeof(float);
}

static void conv2d_forward_cpu(Ops *o, const ConvCfg *cfg, Tensor out, Tensor in, const float *w,
                               const void *w_cast, const float *b, void *ws) {
    (void)o; (void)w_cast;  // the CPU multiplies in fp32
    ConvGeom q = conv_geom(cfg, in.shape);
    snCheck(out.shape.n == q.N && out.shape.h == q.OH && out.shape.w == q.OW &&
                    out.shape.c == q.Cout,
            "conv2d_forward: out " SHAPE_FMT " for in " SHAPE_FMT, SHAPE_ARGS(out.shape),
            SHAPE_ARGS(in.shape));
    if (conv_is_depthwise(cfg)) {
        if (in.dtype == DT_F32 && out.dtype == DT_F32)
            depthwise_forward_f32(cfg, &q, (float *)out.data, (const float *)in.data, w, b,
                                  (float *)ws);
        else
            depthwise_forward_any(cfg, &q, out, in, w, b);
        return;
    }
    if (conv_is_pointwise(cfg) && in.dtype == DT_F32 && out.dtype == DT_F32) {
        // out[N·H·W][Cout] = in[N·H·W][Cin] · W[Cout][Cin]ᵀ
        int M = q.N * q.H * q.W;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, M, q.Cout, q.C, 1.0f,
                    (const float *)in.data, q.C, w, q.C, 0.0f, (float *)out.data, q.Cout);
        if (b) add_bias_rows((float *)out.data, (size_t)M, q.Cout, b);
        return;
    }
    if (conv_is_direct(cfg, &q)) conv2d_forward_direct(cfg, &q, out, in, w, b, (float *)ws);
    else conv2d_forward_gemm(cfg, &q, out, in, w, b, (float *)ws);
}

static void conv2d_backward_data_cpu(Ops *o, const ConvCfg *cfg, Tensor din, Tensor dout,
                                     const float *w, const void *w_cast, int accumulate, void *ws) {
    (void)o; (void)w_cast;
    ConvGeom q = conv_geom(cfg, din.shape);
    if (conv_is_depthwise(cfg)) {
        if (din.dtype == DT_F32 && dout.dtype == DT_F32)
            depthwise_backward_data_f32(cfg, &q, (float *)din.data, (const float *)dout.data, w,
                                        accumulate, (float *)ws);
        else
            depthwise_backward_data_any(cfg, &q, din, dout, w, accumulate);
        return;
    }
    if (conv_is_pointwise(cfg) && din.dtype == DT_F32 && dout.dtype == DT_F32) {
        // din[N·H·W][Cin] (=|+=) dout[N·H·W][Cout] · W[Cout][Cin]
        int M = q.N * q.H * q.W;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, q.C, q.Cout, 1.0f,
                    (const float *)dout.data, q.Cout, w, q.C, accumulate ? 1.0f : 0.0f,
                    (float *)din.data, q.C);
        return;
    }
    if (conv_direct_grad_data(cfg, &q))
        conv2d_backward_data_direct(cfg, &q, din, dout, w, accumulate, (float *)ws);
    else conv2d_backward_data_gemm(cfg, &q, din, dout, w, accumulate, (float *)ws);
}

static void conv2d_backward_weight_cpu(Ops *o, const ConvCfg *cfg, float *dw, float *db,
                                       Tensor dout, Tensor in, void *ws) {
    (void)o;
    ConvGeom q = conv_geom(cfg, in.shape);
    if (db) {
        // db[co] += Σ_{n,oy,ox} dout[n,oy,ox,co]
        size_t M = (size_t)q.N * q.P;
        #pragma omp parallel for schedule(static) if(PAR(M * q.Cout))
        for (int co = 0; co < q.Cout; co++) {
            double s = 0.0;
            for (size_t p = 0; p < M; p++) s += ld(dout, p * q.Cout + co);
            db[co] += (float)s;
        }
    }
    if (!dw) return;
    if (conv_is_depthwise(cfg)) {
        if (in.dtype == DT_F32 && dout.dtype == DT_F32)
            depthwise_backward_weight_f32(cfg, &q, dw, (const float *)dout.data,
                                          (const float *)in.data);
        else
            depthwise_backward_weight_any(cfg, &q, dw, dout, in);
        return;
    }
    if (conv_direct_grad_weight(cfg, &q)) {
        conv2d_backward_weight_direct(cfg, &q, dw, dout, in, (float *)ws);
        return;
    }
    if (conv_is_pointwise(cfg) && in.dtype == DT_F32 && dout.dtype == DT_F32) {
        // dW[Cout][Cin] += Σ_n dout_n[H·W][Cout]ᵀ · in_n[H·W][Cin]
        const size_t n_w = (size_t)q.Cout * q.C;
        double *sum = (double *)ws;                // (n_w) fp64
        float *image_dw = (float *)(sum + n_w);    // (n_w) one image's product
        memset(sum, 0, sizeof(double) * n_w);
        for (int n = 0; n < q.N; n++) {
            cblas_sgemm(CblasRowMajor, CblasTrans, CblasNoTrans, q.Cout, q.C, (int)q.P, 1.0f,
                        (const float *)dout.data + (size_t)n * q.P * q.Cout, q.Cout,
                        (const float *)in.data + (size_t)n * q.P * q.C, q.C, 0.0f, image_dw, q.C);
            sum_into_f64(sum, image_dw, n_w);
        }
        add_rounded(dw, sum, n_w);
        return;
    }
    conv2d_backward_weight_gemm(cfg, &q, dw, dout, in, (float *)ws);
}

// ----------------------------------------------------------------------------
// squeeze-excitation pieces in fp32 (global_avg_pool_*_ref and
// channel_scale_*_ref otherwise): rows of C channels, the per-image sums
// over pixels a block of channels at a time, the same fp64 sums in the same
// order as the references (the same bits)

// fp32: Σ over the pixels of image n per channel, fp64, channels innermost;
// a block of channels per work item, pixels in order (any thread count, same bits)
#define SE_CBLOCK 16
static void channel_sums_f32(const float *a, const float *b, int N, size_t HW, int C, double *out) {
    const int nblk = (C + SE_CBLOCK - 1) / SE_CBLOCK;
    #pragma omp parallel for schedule(static) if(PAR((size_t)N * HW * C))
    for (int nb = 0; nb < N * nblk; nb++) {
        const int n = nb / nblk, c0 = nb % nblk * SE_CBLOCK,
                  nc = C - c0 < SE_CBLOCK ? C - c0 : SE_CBLOCK;
        double acc[SE_CBLOCK] = {0};
        // each acc[j] is a sum of its own: vectorised across j, same bits
        for (size_t p = 0; p < HW; p++) {
            const size_t i = ((size_t)n * HW + p) * C + c0;
            if (b) {
                #pragma omp simd
                for (int j = 0; j < nc; j++) acc[j] += (double)a[i + j] * b[i + j];   // Σ a·b
            } else {
                #pragma omp simd
                for (int j = 0; j < nc; j++) acc[j] += a[i + j];                       // Σ a
            }
        }
        for (int j = 0; j < nc; j++) out[(size_t)n * C + c0 + j] = acc[j];
    }
}

static void global_avg_pool_forward_cpu(Ops *o, Tensor y, Tensor x) {
    if (x.dtype == DT_F32) {
        const int N = x.shape.n, C = x.shape.c;
        const size_t HW = (size_t)x.shape.h * x.shape.w;
        double sums[N * C];  // (N,C)
        channel_sums_f32((const float *)x.data, NULL, N, HW, C, sums);
        for (int i = 0; i < N * C; i++) st(y, i, (float)(sums[i] / (double)HW));
        return;
    }
    global_avg_pool_forward_ref(o, y, x);
}

static void global_avg_pool_backward_cpu(Ops *o, Tensor dx, Tensor dy, int accumulate) {
    const int C = dx.shape.c;
    const size_t HW = (size_t)dx.shape.h * dx.shape.w;
    const float inv = 1.0f / (float)HW;
    if (dx.dtype == DT_F32 && dy.dtype == DT_F32) {  // rows of C, dy[n,:] per row
        const size_t M = (size_t)dx.shape.n * HW;
        const float *dyp = (const float *)dy.data;
        float *dxp = (float *)dx.data;
        #pragma omp parallel for schedule(static) if(PAR(M * C))
        for (size_t r = 0; r < M; r++) {
            const float *g = dyp + r / HW * C;
            #pragma omp simd
            for (int c = 0; c < C; c++)
                dxp[r * C + c] = accumulate ? dxp[r * C + c] + g[c] * inv : g[c] * inv;
        }
        return;
    }
    global_avg_pool_backward_ref(o, dx, dy, accumulate);
}

static void channel_scale_forward_cpu(Ops *o, Tensor y, Tensor x, Tensor s) {
    if (x.dtype == DT_F32 && y.dtype == DT_F32 && s.dtype == DT_F32) {  // rows of C, s[n,:] per row
        const int C = x.shape.c;
        const size_t HW = (size_t)x.shape.h * x.shape.w, M = (size_t)x.shape.n * HW;
        const float *xp = (const float *)x.data, *sp = (const float *)s.data;
        float *yp = (float *)y.data;
        #pragma omp parallel for schedule(static) if(PAR(M * C))
        for (size_t r = 0; r < M; r++) {
            const float *sr = sp + r / HW * C;
            #pragma omp simd
            for (int c = 0; c < C; c++) yp[r * C + c] = xp[r * C + c] * sr[c];
        }
        return;
    }
    channel_scale_forward_ref(o, y, x, s);
}

static void channel_scale_backward_cpu(Ops *o, Tensor dx, Tensor ds, Tensor dy, Tensor x, Tensor s,
                                       int accumulate_dx, int accumulate_ds) {
    const int f32 = x.dtype == DT_F32 && dy.dtype == DT_F32 && s.dtype == DT_F32 &&
                    (!dx.data || dx.dtype == DT_F32);
    if (!f32) {
        channel_scale_backward_ref(o, dx, ds, dy, x, s, accumulate_dx, accumulate_ds);
        return;
    }
    const int N = x.shape.n, C = x.shape.c;
    const size_t HW = (size_t)x.shape.h * x.shape.w;
    if (dx.data) {
        const size_t M = (size_t)N * HW;
        const float *dyp = (const float *)dy.data, *sp = (const float *)s.data;
        float *dxp = (float *)dx.data;
        #pragma omp parallel for schedule(static) if(PAR(M * C))
        for (size_t r = 0; r < M; r++) {
            const float *sr = sp + r / HW * C;
            #pragma omp simd
            for (int c = 0; c < C; c++)
                dxp[r * C + c] = accumulate_dx ? dxp[r * C + c] + dyp[r * C + c] * sr[c]
                                               : dyp[r * C + c] * sr[c];
        }
    }
    if (ds.data) {
        double sums[N * C];  // (N,C)
        channel_sums_f32((const float *)dy.data, (const float *)x.data, N, HW, C, sums);
        for (int nc = 0; nc < N * C; nc++) st_acc(ds, nc, (float)sums[nc], accumulate_ds);
    }
}

// ----------------------------------------------------------------------------
// squeeze-excitation's gate in fp32 (se_gate_forward_ref and
// se_gate_backward_ref otherwise; the same bits)
//
// The reference takes each output's fp64 sum as a dot product down a row or
// a column: one dependent add after another, and column walks through W.
// Here the loops are interchanged so that the innermost runs across
// independent outputs, contiguous in memory (vectorised), while each
// output's sum still adds its terms in the reference's order; W1 is read
// through its transpose for z1. Threads share the images (the gradients of
// the weights: their rows).

// z[n][a] = b[a] + Σ_k wt[k][a]·x[n][k], k in order; wt = wᵀ (K,A); t: (A) fp64
static void affine_rows_t(float *z, const float *wt, const float *b, const float *x, int A, int K,
                          int n, double *t) {
    for (int a = 0; a < A; a++) t[a] = b[a];
    for (int k = 0; k < K; k++) {
        const double xk = x[(size_t)n * K + k];
        const float *w = wt + (size_t)k * A;
        #pragma omp simd
        for (int a = 0; a < A; a++) t[a] += (double)w[a] * xk;
    }
    for (int a = 0; a < A; a++) z[(size_t)n * A + a] = (float)t[a];
}

// The fp64 sums t (N·max(C,S)), then W1ᵀ (C,S) and W2ᵀ (S,C): one allocation per call
typedef struct { double *t; float *w1t, *w2t; } SeGateWork;
static SeGateWork se_gate_work(int N, int C, int S) {
    const size_t T = (size_t)N * (C > S ? C : S);
    double *t = malloc(sizeof(double) * T + sizeof(float) * 2 * (size_t)C * S);
    snCheck(t != NULL, "out of host memory");
    return (SeGateWork){t, (float *)(t + T), (float *)(t + T) + (size_t)C * S};
}

// the gate's forward for every image: z1, y1 (N,S), z2 (N,C) from pv (N,C) as se_gate_images
static void se_gate_images_f32(int N, const float *pv, const float *w1, const float *b1,
                               const float *w2, const float *b2, int C, int S, Act act1, float *z1,
                               float *y1, float *z2, const SeGateWork *work) {
    float *w1t = work->w1t, *w2t = work->w2t;
    double *t = work->t;
    for (int j = 0; j < S; j++)
        for (int c = 0; c < C; c++) {
            w1t[(size_t)c * S + j] = w1[(size_t)j * C + c];
            w2t[(size_t)j * C + c] = w2[(size_t)c * S + j];
        }
    const int T = C > S ? C : S;
    #pragma omp parallel for schedule(static) if(PAR((size_t)N * C * S))
    for (int n = 0; n < N; n++) {
        affine_rows_t(z1, w1t, b1, pv, S, C, n, t + (size_t)n * T);
        for (int j = 0; j < S; j++) y1[(size_t)n * S + j] = act_apply(act1, z1[(size_t)n * S + j]);
        affine_rows_t(z2, w2t, b2, y1, C, S, n, t + (size_t)n * T);
    }
}

static void se_gate_forward_cpu(Ops *o, Tensor s, Tensor p, const float *w1, const float *b1,
                                const float *w2, const float *b2, int S, Act act1, Act act2) {
    if (!all_f32(s, p)) { se_gate_forward_ref(o, s, p, w1, b1, w2, b2, S, act1, act2); return; }
    const int N = p.shape.n, C = p.shape.c;
    SeGateBuf b = se_gate_buf(p, S);
    SeGateWork work = se_gate_work(N, C, S);
    se_gate_images_f32(N, b.pv, w1, b1, w2, b2, C, S, act1, b.z1, b.y1, b.z2, &work);
    float *sp = (float *)s.data;
    for (size_t i = 0; i < (size_t)N * C; i++) sp[i] = act_apply(act2, b.z2[i]);
    free(work.t);
    free(b.pv);
}

// dw[a][b] += Σ_n dz[n][a]·v[n][b], db[a] += Σ_n dz[n][a], n in order (outer_sums)
static void outer_sums_f32(float *dw, float *db, const float *dz, int A, const float *v, int B,
                           int N) {
    #pragma omp parallel for schedule(static) if(PAR((size_t)N * A * B))
    for (int a = 0; a < A; a++) {
        double t[B];  // (B)
        double d = 0.0;
        for (int j = 0; j < B; j++) t[j] = 0.0;
        for (int n = 0; n < N; n++) {
            const double g = dz[(size_t)n * A + a];
            d += g;
            #pragma omp simd
            for (int j = 0; j < B; j++) t[j] += g * v[(size_t)n * B + j];
        }
        db[a] += (float)d;
        for (int j = 0; j < B; j++) dw[(size_t)a * B + j] += (float)t[j];
    }
}

static void se_gate_backward_cpu(Ops *o, Tensor dp, Tensor ds, Tensor p, const float *w1,
                                 const float *b1, const float *w2, const float *b2, int S, Act act1,
                                 Act act2, float *dw1, float *db1, float *dw2, float *db2,
                                 int accumulate) {
    if (!all_f32(ds, p) || (dp.data && dp.dtype != DT_F32)) {
        se_gate_backward_ref(o, dp, ds, p, w1, b1, w2, b2, S, act1, act2, dw1, db1, dw2, db2,
                             accumulate);
        return;
    }
    const int N = p.shape.n, C = p.shape.c;
    SeGateBuf b = se_gate_buf(p, S);
    SeGateWork work = se_gate_work(N, C, S);
    se_gate_images_f32(N, b.pv, w1, b1, w2, b2, C, S, act1, b.z1, b.y1, b.z2, &work);
    const float *dsp = (const float *)ds.data;
    for (size_t i = 0; i < (size_t)N * C; i++) b.dz2[i] = dsp[i] * act_grad(act2, b.z2[i]);
    const int T = C > S ? C : S;
    double *t = work.t;  // the forward's sums are spent
    #pragma omp parallel for schedule(static) if(PAR((size_t)N * C * S))
    for (int n = 0; n < N; n++) {
        double *tn = t + (size_t)n * T;
        // dz1[n][j] = (Σ_c w2[c][j]·dz2[n][c]) · act1'(z1), c in order
        for (int j = 0; j < S; j++) tn[j] = 0.0;
        for (int c = 0; c < C; c++) {
            const double g = b.dz2[(size_t)n * C + c];
            const float *w = w2 + (size_t)c * S;
            #pragma omp simd
            for (int j = 0; j < S; j++) tn[j] += (double)w[j] * g;
        }
        for (int j = 0; j < S; j++) {
            const size_t i = (size_t)n * S + j;
            b.dz1[i] = (float)tn[j] * act_grad(act1, b.z1[i]);
        }
        if (!dp.data) continue;
        // dp[n][c] (=|+=) Σ_j w1[j][c]·dz1[n][j], j in order
        for (int c = 0; c < C; c++) tn[c] = 0.0;
        for (int j = 0; j < S; j++) {
            const double g = b.dz1[(size_t)n * S + j];
            const float *w = w1 + (size_t)j * C;
            #pragma omp simd
            for (int c = 0; c < C; c++) tn[c] += (double)w[c] * g;
        }
        float *d = (float *)dp.data + (size_t)n * C;
        for (int c = 0; c < C; c++) d[c] = accumulate ? d[c] + (float)tn[c] : (float)tn[c];
    }
    if (dw1) {
        outer_sums_f32(dw2, db2, b.dz2, C, b.y1, S, N);
        outer_sums_f32(dw1, db1, b.dz1, S, b.pv, C, N);
    }
    free(work.t);
    free(b.pv);
}

// ----------------------------------------------------------------------------
// pooling, nearest upsampling and concatenation in fp32 (maxpool2_*_ref,
// upsample2_*_ref and concat_*_ref state them; these give the same bits)
//
// The references read and write one element at a time through ld/st, for
// any storage type. With fp32 tensors (the CPU's default) these loop over
// rows of pixels with the channels innermost, so that the compiler
// vectorises them, and max-pool's backward finds each 2×2 window's argmax
// once per row of the window instead of once per element. Other storage
// types take the references.

// y[n,oy,ox,c] = max over the 2×2 window, taken in the reference's order
static void maxpool2_forward_cpu(Ops *o, Tensor y, Tensor x) {
    if (!all_f32(y, x)) { maxpool2_forward_ref(o, y, x); return; }
    const Shape s = x.shape, t = y.shape;
    const int C = s.c;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(x.shape)))
    for (int noy = 0; noy < t.n * t.h; noy++) {
        const int n = noy / t.h, oy = noy % t.h;
        const float *x0 = (const float *)x.data + ((size_t)n * s.h + 2 * oy) * s.w * C,
                    *x1 = x0 + (size_t)s.w * C;
        float *yr = (float *)y.data + (size_t)noy * t.w * C;
        for (int ox = 0; ox < t.w; ox++) {
            const float *a = x0 + (size_t)2 * ox * C, *b = x1 + (size_t)2 * ox * C;
            float *m = yr + (size_t)ox * C;
            #pragma omp simd
            for (int c = 0; c < C; c++) {
                float mc = -INFINITY;
                mc = a[c] > mc ? a[c] : mc;
                mc = a[C + c] > mc ? a[C + c] : mc;
                mc = b[c] > mc ? b[c] : mc;
                m[c] = b[C + c] > mc ? b[C + c] : mc;
            }
        }
    }
}

// dx (=|+=) dy at each window's first maximum, 0 elsewhere and past the floor
static void maxpool2_backward_cpu(Ops *o, Tensor dx, Tensor dy, Tensor x, int accumulate) {
    if (!all_f32(dx, dy) || x.dtype != DT_F32) {
        maxpool2_backward_ref(o, dx, dy, x, accumulate);
        return;
    }
    const Shape s = x.shape, t = dy.shape;
    const int C = s.c;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(x.shape)))
    for (int niy = 0; niy < s.n * s.h; niy++) {
        const int n = niy / s.h, iy = niy % s.h, oy = iy / 2, row_k = (iy - 2 * oy) * 2;
        float *d = (float *)dx.data + (size_t)niy * s.w * C;
        int ix = 0;
        if (oy < t.h) {
            const float *x0 = (const float *)x.data + ((size_t)n * s.h + 2 * oy) * s.w * C,
                        *x1 = x0 + (size_t)s.w * C;
            const float *g = (const float *)dy.data + ((size_t)n * t.h + oy) * t.w * C;
            for (int ox = 0; ox < t.w; ox++, ix += 2) {
                const float *a = x0 + (size_t)ix * C, *b = x1 + (size_t)ix * C,
                            *gc = g + (size_t)ox * C;
                float *d0 = d + (size_t)ix * C, *d1 = d0 + C;
                #pragma omp simd
                for (int c = 0; c < C; c++) {
                    float m = -INFINITY;
                    int first = 0;
                    if (a[c] > m) { m = a[c]; first = 0; }
                    if (a[C + c] > m) { m = a[C + c]; first = 1; }
                    if (b[c] > m) { m = b[c]; first = 2; }
                    if (b[C + c] > m) first = 3;
                    const float g0 = first == row_k ? gc[c] : 0.0f,
                                g1 = first == row_k + 1 ? gc[c] : 0.0f;
                    d0[c] = accumulate ? d0[c] + g0 : g0;
                    d1[c] = accumulate ? d1[c] + g1 : g1;
                }
            }
        }
        // past the floor
        for (size_t i = (size_t)ix * C; i < (size_t)s.w * C; i++)
            d[i] = accumulate ? d[i] + 0.0f : 0.0f;
    }
}

// y[n,oy,ox,c] = x[n, oy/2, ox/2, c]
static void upsample2_forward_cpu(Ops *o, Tensor y, Tensor x) {
    if (!all_f32(y, x)) { upsample2_forward_ref(o, y, x); return; }
    const Shape s = x.shape, t = y.shape;
    const int C = s.c;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(y.shape)))
    for (int noy = 0; noy < t.n * t.h; noy++) {
        const int n = noy / t.h, oy = noy % t.h;
        const float *xr = (const float *)x.data + ((size_t)n * s.h + oy / 2) * s.w * C;
        float *yr = (float *)y.data + (size_t)noy * t.w * C;
        for (int ox = 0; ox < t.w; ox++)
            memcpy(yr + (size_t)ox * C, xr + (size_t)(ox / 2) * C, sizeof(float) * C);
    }
}

// dx (=|+=) the 2×2 dy it was copied to, summed from 0 in the reference's order
static void upsample2_backward_cpu(Ops *o, Tensor dx, Tensor dy, int accumulate) {
    if (!all_f32(dx, dy)) { upsample2_backward_ref(o, dx, dy, accumulate); return; }
    const Shape s = dx.shape, t = dy.shape;
    const int C = s.c;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(dy.shape)))
    for (int niy = 0; niy < s.n * s.h; niy++) {
        const int n = niy / s.h, iy = niy % s.h;
        const float *g0 = (const float *)dy.data + ((size_t)n * t.h + 2 * iy) * t.w * C,
                    *g1 = g0 + (size_t)t.w * C;
        float *d = (float *)dx.data + (size_t)niy * s.w * C;
        for (int ix = 0; ix < s.w; ix++) {
            const float *a = g0 + (size_t)2 * ix * C, *b = g1 + (size_t)2 * ix * C;
            float *dc = d + (size_t)ix * C;
            #pragma omp simd
            for (int c = 0; c < C; c++) {
                const float g = 0.0f + a[c] + a[C + c] + b[c] + b[C + c];
                dc[c] = accumulate ? dc[c] + g : g;
            }
        }
    }
}

// y[r, 0:Ca] = a[r, :], y[r, Ca:Ca+Cb] = b[r, :]; backward: the same copies the other way (=|+=)
static void concat_forward_cpu(Ops *o, Tensor y, Tensor a, Tensor b) {
    if (!all_f32(y, a) || b.dtype != DT_F32) { concat_forward_ref(o, y, a, b); return; }
    const int Ca = a.shape.c, Cb = b.shape.c, C = Ca + Cb;
    const size_t M = shape_numel(y.shape) / C;
    float *yp = (float *)y.data;
    const float *ap = (const float *)a.data, *bp = (const float *)b.data;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (size_t r = 0; r < M; r++) {
        memcpy(yp + r * C, ap + r * Ca, sizeof(float) * Ca);
        memcpy(yp + r * C + Ca, bp + r * Cb, sizeof(float) * Cb);
    }
}

static void copy_or_add_f32(float *dst, const float *src, int n, int accumulate) {
    if (!accumulate) { memcpy(dst, src, sizeof(float) * n); return; }
    #pragma omp simd
    for (int i = 0; i < n; i++) dst[i] += src[i];
}
static void concat_backward_cpu(Ops *o, Tensor da, Tensor db, Tensor dy, int accumulate_a,
                                int accumulate_b) {
    if (dy.dtype != DT_F32 || (da.data && da.dtype != DT_F32) || (db.data && db.dtype != DT_F32)) {
        concat_backward_ref(o, da, db, dy, accumulate_a, accumulate_b);
        return;
    }
    const int Ca = da.shape.c, Cb = db.shape.c, C = Ca + Cb;
    const size_t M = shape_numel(dy.shape) / C;
    const float *g = (const float *)dy.data;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (size_t r = 0; r < M; r++) {
        if (da.data) copy_or_add_f32((float *)da.data + r * Ca, g + r * C, Ca, accumulate_a);
        if (db.data) copy_or_add_f32((float *)db.data + r * Cb, g + r * C + Ca, Cb, accumulate_b);
    }
}

// ----------------------------------------------------------------------------
// batch norm, fast (bn_*_ref in part I states the formulas)
//
// fp32 math (16-bit tensors converted a row at a time): the same formulas with
// per-channel constants hoisted out of the pixel loop and channels innermost
// (contiguous, so the compiler vectorises them), one pass over memory each:
//   stats    Σx, Σx² in fp64 (x² is exact there), then bn_moments_stats: plain
//            sums, so that replicas can add theirs (--sync-bn) and round once
//   z        gamma·((x - mean)·invstd) + beta with invstd per channel hoisted: the
//            reference's z to the bit (not a·x + b, which cancels when |mean·a| ≫ |z|,
//            nor (x - mean)·(gamma·invstd) + beta, which puts other values on the
//            other side of ReLU's kink than the reference and PyTorch do)
// Reductions keep the reference's scheme (a block of channels per thread,
// rows in order): the same bits for any thread count.
#define BN_ROWS 64  // rows per parallel work item of the elementwise passes

// e^x for the vectorised fp32 loops (the compiler cannot vectorise libm's
// expf): x = n·ln2 + r with |r| ≤ ln2/2 (ln2 split in two for an exact n·ln2_hi),
// e^r by its Taylor series to r^7 (truncation < 6e-9 relative), 2^n from the
// exponent bits; x is clamped to [-87, 88], where 2^n stays a normal float.
// Within a few ulp of expf, and the same bits whether vectorised or not
// (explicit fmaf, no data-dependent branch).
static inline float exp_vec(float x) {
    x = x < -87.0f ? -87.0f : x > 88.0f ? 88.0f : x;
    // n = round(x·log2 e): adding and subtracting 1.5·2^23 rounds to an integer
    const float n = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;
    float r = fmaf(n, -0.693145751953125f, x);
    r = fmaf(n, -1.428606765330187e-6f, r);
    float p = 1.0f / 5040.0f;
    p = fmaf(p, r, 1.0f / 720.0f);
    p = fmaf(p, r, 1.0f / 120.0f);
    p = fmaf(p, r, 1.0f / 24.0f);
    p = fmaf(p, r, 1.0f / 6.0f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    union { int32_t i; float f; } two_n = {.i = ((int32_t)n + 127) << 23};
    return p * two_n.f;
}
static inline float sigmoid_vec(float z) { return 1.0f / (1.0f + exp_vec(-z)); }
// act_apply and act_grad (segnet.h) with exp_vec
static inline float act_apply_vec(Act a, float z) {
    switch (a) {
    case ACT_RELU: return z > 0.0f ? z : 0.0f;
    case ACT_SILU: return z * sigmoid_vec(z);
    case ACT_SIGMOID: return sigmoid_vec(z);
    default: return z;
    }
}
static inline float act_grad_vec(Act a, float z) {
    switch (a) {
    case ACT_RELU: return z > 0.0f ? 1.0f : 0.0f;
    case ACT_SILU: { float s = sigmoid_vec(z); return s * (1.0f + z * (1.0f - s)); }
    case ACT_SIGMOID: { float s = sigmoid_vec(z); return s * (1.0f - s); }
    default: return 1.0f;
    }
}

static void bn_stats_cpu(Ops *o, Tensor x, float *mean, float *var, float *run_mean, float *run_var,
                         float momentum, double *sums) {
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (int c0 = 0; c0 < C; c0 += BN_CBLOCK) {
        const int nc = C - c0 < BN_CBLOCK ? C - c0 : BN_CBLOCK;
        double s[BN_CBLOCK] = {0}, q[BN_CBLOCK] = {0};
        float tmp[BN_CBLOCK];  // (BN_CBLOCK) one row's channels in fp32 when x is 16-bit
        if (nc == BN_CBLOCK) {  // the common case, with a constant trip count
            for (size_t r = 0; r < M; r++) {
                const float *xr = ld_view(x, r * C + c0, tmp, BN_CBLOCK);
                for (int j = 0; j < BN_CBLOCK; j++) { double v = xr[j]; s[j] += v; q[j] += v * v; }
            }
        } else {
            for (size_t r = 0; r < M; r++) {
                const float *xr = ld_view(x, r * C + c0, tmp, nc);
                for (int j = 0; j < nc; j++) { double v = xr[j]; s[j] += v; q[j] += v * v; }
            }
        }
        for (int j = 0; j < nc; j++) {
            bn_moments_stats(s[j], q[j], (double)M, &mean[c0 + j], &var[c0 + j]);
            if (sums) { sums[c0 + j] = s[j]; sums[C + c0 + j] = q[j]; }
        }
    }
    if (run_mean) bn_update_running_ref(o, run_mean, run_var, mean, var, C, M, momentum);
}

// y = act(g·((x - m)·k) + b) over `rows` rows from x, y; `act` is a constant where this is inlined
static inline __attribute__((always_inline)) void bn_act_rows(float *y, const float *x, size_t rows,
                                                              int C, const float *m, const float *k,
                                                              const float *g, const float *b,
                                                              Act act) {
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * C;
        float *yr = y + r * C;
        #pragma omp simd
        for (int c = 0; c < C; c++)
            yr[c] = act_apply_vec(act, g[c] * ((xr[c] - m[c]) * k[c]) + b[c]);
    }
}
static void bn_act_rows_any(float *y, const float *x, size_t rows, int C, const float *m,
                            const float *k, const float *g, const float *b, Act act) {
    switch (act) {
    case ACT_RELU: bn_act_rows(y, x, rows, C, m, k, g, b, ACT_RELU); break;
    case ACT_SILU: bn_act_rows(y, x, rows, C, m, k, g, b, ACT_SILU); break;
    case ACT_SIGMOID: bn_act_rows(y, x, rows, C, m, k, g, b, ACT_SIGMOID); break;
    default: bn_act_rows(y, x, rows, C, m, k, g, b, ACT_NONE);
    }
}

// 16-bit tensors go through the same loops a row at a time, converted to fp32
// on the way in and rounded once on the way out (as the reference's st does).
static void bn_forward_cpu(Ops *o, Tensor y, Tensor x, const BnArgs *bn) {
    const float *mean = bn->mean, *gamma = bn->gamma, *beta = bn->beta;
    const Act act = bn->act; const BnNext *next = bn->next;
    if (next && next->kind == FUSED_RESIDUAL) y = next->out;
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    float k[C];  // (C)
    for (int c = 0; c < C; c++) k[c] = bn_invstd(bn->var, c, bn->eps);
    const size_t n_items = (M + BN_ROWS - 1) / BN_ROWS;
    const int f32 = x.dtype == DT_F32 && y.dtype == DT_F32;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (size_t it = 0; it < n_items; it++) {
        size_t r0 = it * BN_ROWS, r1 = r0 + BN_ROWS < M ? r0 + BN_ROWS : M;
        if (f32) {
            bn_act_rows_any((float *)y.data + r0 * C, (const float *)x.data + r0 * C, r1 - r0, C,
                            mean, k, gamma, beta, act);
            continue;
        }
        float xbuf[C], ybuf[C];  // (C) one row in fp32
        for (size_t r = r0; r < r1; r++) {
            bn_act_rows_any(ybuf, ld_view(x, r * C, xbuf, C), 1, C, mean, k, gamma, beta, act);
            st_run(y, r * C, ybuf, C, 0);
        }
    }
    if (next) bn_next_forward_unfused(o, y, next);
}

// Σg and Σg·xhat per channel over rows, g = dy·act'(gamma·xhat + b), xhat = (x - mean)·invstd, for
// nb whole channel blocks from c0 (sums [nb][BN_CBLOCK]); act constant where inlined. Rows
// outermost: a row's nb·BN_CBLOCK channels are read as one contiguous run (a walk down the rows
// with the tensor's stride would use a fraction of the memory's bandwidth); each channel's sums
// still take the rows in order.
#define BN_GROUP_MAX 8  // channel blocks per work item of the backward reduction
static inline __attribute__((always_inline)) void
bn_grad_sums(Tensor dy, Tensor x, size_t M, int C, int c0, int nb, const float *gam,
             const float *inv, const float *b, const float *mean, Act act, double (*sg)[BN_CBLOCK],
             double (*sgx)[BN_CBLOCK]) {
    // one block of a row in fp32 when the tensors are 16-bit
    float xbuf[BN_CBLOCK], dbuf[BN_CBLOCK];
    for (size_t r = 0; r < M; r++)
        for (int k = 0; k < nb; k++) {
            const int c = c0 + k * BN_CBLOCK;
            const float *xr = ld_view(x, r * C + c, xbuf, BN_CBLOCK),
                        *dr = ld_view(dy, r * C + c, dbuf, BN_CBLOCK);
            double *s = sg[k], *q = sgx[k];
            #pragma omp simd
            for (int j = 0; j < BN_CBLOCK; j++) {
                float xhat = (xr[j] - mean[c + j]) * inv[c + j],
                      g = dr[j] * act_grad_vec(act, gam[c + j] * xhat + b[c + j]);
                s[j] += g;
                q[j] += (double)g * xhat;
            }
        }
}

static void bn_backward_reduce_cpu(Ops *o, Tensor dy, Tensor x, const BnArgs *bn, float *sum_g,
                                   float *sum_gx, float *dgamma, float *dbeta, double *sums) {
    const float *mean = bn->mean, *gamma = bn->gamma, *beta = bn->beta;
    const Act act = bn->act; const BnNext *next = bn->next;
    if (next && next->kind == FUSED_RESIDUAL) bn_next_backward_unfused(o, dy, next);
    if (!sum_g) return;
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    // gamma, invstd, beta, mean padded to whole channel blocks (the padding lanes are computed and
    // dropped)
    const int Cp = (C + BN_CBLOCK - 1) / BN_CBLOCK * BN_CBLOCK;
    float gam[Cp], b[Cp], m[Cp], invstd[Cp];  // (Cp)
    for (int c = 0; c < Cp; c++) {
        invstd[c] = c < C ? bn_invstd(bn->var, c, bn->eps) : 0.0f;
        gam[c] = c < C ? gamma[c] : 0.0f;
        b[c] = c < C ? beta[c] : 0.0f;
        m[c] = c < C ? mean[c] : 0.0f;
    }
    // work items: groups of at most BN_GROUP_MAX whole blocks, at least one per thread when there
    // are blocks enough (the grouping changes no sum), then the last, partial block
    const int full = C / BN_CBLOCK;
    int items = (full + BN_GROUP_MAX - 1) / BN_GROUP_MAX;
#ifdef _OPENMP
    const int threads = omp_get_max_threads() < full ? omp_get_max_threads() : full;
    if (items < threads) items = threads;
#endif
    const int per = items ? (full + items - 1) / items : 0;
    items = per ? (full + per - 1) / per : 0;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (int it = 0; it < items + (C % BN_CBLOCK != 0); it++) {
        double sg[BN_GROUP_MAX][BN_CBLOCK] = {{0}}, sgx[BN_GROUP_MAX][BN_CBLOCK] = {{0}};
        int c0, nc;  // the item's channels
        if (it < items) {
            const int nb = full - it * per < per ? full - it * per : per;
            c0 = it * per * BN_CBLOCK;
            nc = nb * BN_CBLOCK;
            switch (act) {
            case ACT_RELU:
                bn_grad_sums(dy, x, M, C, c0, nb, gam, invstd, b, m, ACT_RELU, sg, sgx);
                break;
            case ACT_SILU:
                bn_grad_sums(dy, x, M, C, c0, nb, gam, invstd, b, m, ACT_SILU, sg, sgx);
                break;
            case ACT_SIGMOID:
                bn_grad_sums(dy, x, M, C, c0, nb, gam, invstd, b, m, ACT_SIGMOID, sg, sgx);
                break;
            default: bn_grad_sums(dy, x, M, C, c0, nb, gam, invstd, b, m, ACT_NONE, sg, sgx);
            }
        } else {  // the last, partial block
            c0 = full * BN_CBLOCK;
            nc = C - c0;
            float xbuf[BN_CBLOCK], dbuf[BN_CBLOCK];
            for (size_t r = 0; r < M; r++) {
                const float *xr = ld_view(x, r * C + c0, xbuf, nc),
                            *dr = ld_view(dy, r * C + c0, dbuf, nc);
                for (int j = 0; j < nc; j++) {
                    float xhat = (xr[j] - m[c0 + j]) * invstd[c0 + j];
                    float g = dr[j] * act_grad_vec(act, gam[c0 + j] * xhat + b[c0 + j]);
                    sg[0][j] += g;
                    sgx[0][j] += (double)g * xhat;
                }
            }
        }
        for (int j = 0; j < nc; j++) {
            const double s = sg[j / BN_CBLOCK][j % BN_CBLOCK],
                         q = sgx[j / BN_CBLOCK][j % BN_CBLOCK];
            bn_grad_sums_store(c0 + j, s, q, sum_g, sum_gx, dgamma, dbeta);
            if (sums) { sums[c0 + j] = s; sums[C + c0 + j] = q; }
        }
    }
}

// dx (=|+=) a·(g - u - (x - mean)·v), a = gamma·invstd, u = Σg/count, v = invstd·Σg·xhat/count,
// over `rows` rows from dx, dy, x
static inline __attribute__((always_inline)) void
bn_dx_rows(float *dx, const float *dy, const float *x, size_t rows, int C, const float *a,
           const float *gam, const float *inv, const float *b, const float *mean, const float *u,
           const float *v, Act act, int accumulate) {
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * C, *dr = dy + r * C;
        float *o = dx + r * C;
        #pragma omp simd
        for (int c = 0; c < C; c++) {
            float xm = xr[c] - mean[c],
                  g = dr[c] * act_grad_vec(act, gam[c] * (xm * inv[c]) + b[c]);
            float d = a[c] * (g - u[c] - xm * v[c]);
            o[c] = accumulate ? o[c] + d : d;
        }
    }
}
static void bn_dx_rows_any(float *dx, const float *dy, const float *x, size_t rows, int C,
                           const float *a, const float *gam, const float *inv, const float *b,
                           const float *mean, const float *u, const float *v, Act act,
                           int accumulate) {
    switch (act) {
    case ACT_RELU:
        bn_dx_rows(dx, dy, x, rows, C, a, gam, inv, b, mean, u, v, ACT_RELU, accumulate);
        break;
    case ACT_SILU:
        bn_dx_rows(dx, dy, x, rows, C, a, gam, inv, b, mean, u, v, ACT_SILU, accumulate);
        break;
    case ACT_SIGMOID:
        bn_dx_rows(dx, dy, x, rows, C, a, gam, inv, b, mean, u, v, ACT_SIGMOID, accumulate);
        break;
    default: bn_dx_rows(dx, dy, x, rows, C, a, gam, inv, b, mean, u, v, ACT_NONE, accumulate);
    }
}

// dy: y's gradient, also with a residual block's end (bn_backward_reduce made it so)
static void bn_backward_data_cpu(Ops *o, Tensor dx, Tensor dy, Tensor x, const BnArgs *bn,
                                 const float *sum_g, const float *sum_gx, size_t count,
                                 int accumulate) {
    const float *mean = bn->mean, *gamma = bn->gamma, *beta = bn->beta;
    const Act act = bn->act;
    (void)o;
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    float a[C], inv[C], u[C], v[C];  // (C)
    for (int c = 0; c < C; c++) {
        inv[c] = bn_invstd(bn->var, c, bn->eps);
        a[c] = gamma[c] * inv[c];
        u[c] = count ? sum_g[c] / (float)count : 0.0f;
        v[c] = count ? inv[c] * sum_gx[c] / (float)count : 0.0f;
    }
    const size_t n_items = (M + BN_ROWS - 1) / BN_ROWS;
    const int f32 = dx.dtype == DT_F32 && dy.dtype == DT_F32 && x.dtype == DT_F32;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (size_t it = 0; it < n_items; it++) {
        size_t r0 = it * BN_ROWS, r1 = r0 + BN_ROWS < M ? r0 + BN_ROWS : M;
        if (f32) {
            bn_dx_rows_any((float *)dx.data + r0 * C, (const float *)dy.data + r0 * C,
                           (const float *)x.data + r0 * C, r1 - r0, C, a, gamma, inv, beta, mean, u,
                           v, act, accumulate);
            continue;
        }
        float xbuf[C], dybuf[C], dxbuf[C];  // (C) one row in fp32
        for (size_t r = r0; r < r1; r++) {
            if (accumulate) ld_run(dx, r * C, dxbuf, C);
            bn_dx_rows_any(dxbuf, ld_view(dy, r * C, dybuf, C), ld_view(x, r * C, xbuf, C), 1, C, a,
                           gamma, inv, beta, mean, u, v, act, accumulate);
            st_run(dx, r * C, dxbuf, C, 0);
        }
    }
}

// ----------------------------------------------------------------------------
// the CPU ops table: ops_ref with the fast versions above, filled before main

Ops ops_cpu;
__attribute__((constructor)) static void ops_cpu_make(void) {
    ops_cpu = ops_ref;
    ops_cpu.name = "cpu";
    ops_cpu.plain_batch_norm = 0;  // bn_*_cpu take the layer after them (BnNext)
    ops_cpu.fill = fill_cpu;
    ops_cpu.axpby = axpby_cpu;
    ops_cpu.copy = copy_cpu;
    ops_cpu.sum_squares = sum_squares_cpu;
    ops_cpu.conv2d_workspace = conv2d_workspace_cpu;
    ops_cpu.conv2d_forward = conv2d_forward_cpu;
    ops_cpu.conv2d_backward_data = conv2d_backward_data_cpu;
    ops_cpu.conv2d_backward_weight = conv2d_backward_weight_cpu;
    ops_cpu.bn_stats = bn_stats_cpu;
    ops_cpu.bn_forward = bn_forward_cpu;
    ops_cpu.bn_backward_reduce = bn_backward_reduce_cpu;
    ops_cpu.bn_backward_data = bn_backward_data_cpu;
    ops_cpu.global_avg_pool_forward = global_avg_pool_forward_cpu;
    ops_cpu.global_avg_pool_backward = global_avg_pool_backward_cpu;
    ops_cpu.channel_scale_forward = channel_scale_forward_cpu;
    ops_cpu.channel_scale_backward = channel_scale_backward_cpu;
    ops_cpu.se_gate_forward = se_gate_forward_cpu;
    ops_cpu.se_gate_backward = se_gate_backward_cpu;
    ops_cpu.add_forward = add_forward_cpu;
    ops_cpu.add_backward = add_backward_cpu;
    ops_cpu.concat_forward = concat_forward_cpu;
    ops_cpu.concat_backward = concat_backward_cpu;
    ops_cpu.dropout_forward = dropout_forward_cpu;
    ops_cpu.dropout_backward = dropout_backward_cpu;
    ops_cpu.maxpool2_forward = maxpool2_forward_cpu;
    ops_cpu.maxpool2_backward = maxpool2_backward_cpu;
    ops_cpu.upsample2_forward = upsample2_forward_cpu;
    ops_cpu.upsample2_backward = upsample2_backward_cpu;
}
