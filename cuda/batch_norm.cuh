// cuda/batch_norm.cuh -- chapter 4 of the CUDA backend: batch norm's statistics, apply and
// backward, alone and fused with the layer after it (BnNext).
// Needs: the seam; the reductions' channel_sums and Moments; from elementwise the
// residual end (dropout_residual_end) and add_backward_cuda, so that the fused paths
// give the unfused ones' bits.

// ----------------------------------------------------------------------------
// batch norm (see segnet.c for the formulas)
//   z = gamma·((x - mean)·invstd) + beta, the CPU's expression, so z falls on the
//   same side of ReLU's kink; y = act(z); backward g = dy·act'(z), z recomputed from x.
//   invstd = bn_invstd(var, c, eps) once per thread and channel, not per element.

// Σx and Σx² in one pass (fp64), then bn_moments_stats (segnet.h)
// running = (1-m)·running + m·batch, the variance made unbiased (bn_update_running)
static __device__ void running_update(float *run_mean, float *run_var, float mean, float var, int c,
                                      double unbias, float momentum) {
    run_mean[c] = (1.0f - momentum) * run_mean[c] + momentum * mean;
    run_var[c] = (1.0f - momentum) * run_var[c] + momentum * (float)(var * unbias);
}
// and the running statistics' update (bn_update_running's, run_mean not NULL),
// and the sums themselves (sums not NULL: --sync-bn)
struct StoreMoments {
    float *mean, *var; double M; float *run_mean, *run_var; float momentum; double *sums; int C;
    __device__ void operator()(int, int c, const double *s) const {
        bn_moments_stats(s[0], s[1], M, &mean[c], &var[c]);
        if (run_mean)
            running_update(run_mean, run_var, mean[c], var[c], c, bn_running_unbias(M), momentum);
        if (sums) { sums[c] = s[0]; sums[C + c] = s[1]; }
    }
};
static void bn_stats_cuda(Ops *o, Tensor x, float *mean, float *var, float *run_mean,
                          float *run_var, float momentum, double *sums) {
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    const StoreMoments e = {mean, var, (double)M, run_mean, run_var, momentum, sums, C};
    if (vec_ok({x.dtype}, C, {x.data})) {
        SWITCH_STORAGE(x.dtype, T, {
            typedef MomentsVec<T, NARROW_BYTES<T>> F;
            channel_sums<2, NARROW_CHANNELS>(o, F{(const T *)x.data, C}, e, 1, M, C, bytes_of(x));
        });
    } else {
        channel_sums<2, 1>(o, Moments{x.data, x.dtype, C}, e, 1, M, C, bytes_of(x));
    }
}
// --sync-bn: the statistics from the replicas' summed sums, one thread per channel
__global__ void bn_stats_finish_kernel(const double *sums, int C, double count, float *mean,
                                       float *var, float *run_mean, float *run_var,
                                       float momentum) {
    FOR_GRID(c, C) {
        bn_moments_stats(sums[c], sums[C + c], count, &mean[c], &var[c]);
        if (run_mean)
            running_update(run_mean, run_var, mean[c], var[c], c, bn_running_unbias(count),
                           momentum);
    }
}
static void bn_stats_finish_cuda(Ops *o, const double *sums, int C, size_t count, float *mean,
                                 float *var, float *run_mean, float *run_var, float momentum) {
    if (C <= 0) return;
    CU_LAUNCH(bn_stats_finish_kernel, grid_for((size_t)C), BLOCK, 0, stream_of(o),
              moves((2.0 * sizeof(double) + 6.0 * sizeof(float)) * C), sums, C, (double)count, mean,
              var, run_mean, run_var, momentum);
    launchCheck();
}

// per-channel constants of the batch norm of channel c
struct BnChannel {
    float mean, invstd, gamma, beta;
    __device__ BnChannel() {}
    __device__ BnChannel(const float *m, const float *var, const float *g, const float *b,
                         float eps, int c)
        : mean(m[c]), invstd(bn_invstd(var, c, eps)), gamma(g[c]), beta(b[c]) {}
    __device__ float xhat(float x) const { return (x - mean) * invstd; }
    __device__ float z(float xh) const { return __fmaf_rn(gamma, xh, beta); }
};

__global__ void bn_forward_kernel(void *y, DType dty, const void *x, DType dtx, uint32_t rows,
                                  int C, const float *mean, const float *var, const float *gamma,
                                  const float *beta, float eps, Act act) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const BnChannel bn(mean, var, gamma, beta, eps, c);
    FOR_ROWS(r, rows) st(y, dty, r * C + c, act_apply(act, bn.z(bn.xhat(ld(x, dtx, r * C + c)))));
}
// Out(i, r, y): what becomes of y's Vec at element i (row r of the launch):
// StoreVec (bn_forward) or ResidualEnd (BnNext FUSED_RESIDUAL, further on)
template <class T, int B = VEC_BYTES> struct StoreVec {
    static constexpr int BYTES = B;
    T *y;
    __device__ void operator()(uint32_t i, uint32_t, const VecB<T, B> &v) { store_vec(y + i, v); }
};
// Out: the consumer of a row's BYTES bytes of channels (StoreVec, ResidualEnd)
template <class T, class Out>
__global__ void bn_forward_vec_kernel(Out out, const T *x, uint32_t rows, int C, const float *mean,
                                      const float *var, const float *gamma, const float *beta,
                                      float eps, Act act) {
    constexpr int N = Out::BYTES / sizeof(T);
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * N;
    if (c0 >= C) return;
    BnChannel bn[N];
    for (int k = 0; k < N; k++) bn[k] = BnChannel(mean, var, gamma, beta, eps, c0 + k);
    // the textbook loop: FOR_ROWS(r, rows) { v = x's row; v = act(z(xhat(v))); out(row, v) }
    for_rows_ahead<rows_ahead(Out::BYTES)>(
            rows, [&](uint32_t r) { return load_vec<T, Out::BYTES>(x + r * C + c0); },
            [&](uint32_t r, VecB<T, Out::BYTES> v) {
                for (int k = 0; k < N; k++)
                    v.v[k] = from_f32<T>(act_apply(act, bn[k].z(bn[k].xhat(to_f32(v.v[k])))));
                out(r * C + c0, r, v);
            });
}
static void bn_forward_plain(Ops *o, Tensor y, Tensor x, const float *mean, const float *var,
                             const float *gamma, const float *beta, float eps, Act act) {
    const int C = x.shape.c;
    const size_t rows = shape_numel(x.shape) / (C ? C : 1);
    if (!rows || !C) return;
    const bool vec = vec_ok({y.dtype, x.dtype}, C, {y.data, x.data});
    for_row_launches(rows, C, [&](size_t r0, size_t count) {
        void *yc = elem_ptr(y.data, y.dtype, r0 * C);
        const void *xc = elem_ptr(x.data, x.dtype, r0 * C);
        const Traffic m = moves(bytes_of(count * C, y.dtype) + bytes_of(count * C, x.dtype));
        if (vec) {
            SWITCH_STORAGE(x.dtype, T, {
                with_lane_bytes<T>(C, count, 1, [&](RowGrid g, auto bytes) {
                    typedef StoreVec<T, decltype(bytes)::value> Out;
                    CU_LAUNCH((bn_forward_vec_kernel<T, Out>), g.grid, g.block, 0, stream_of(o), m,
                              Out{(T *)yc}, (const T *)xc, (uint32_t)count, C, mean, var, gamma,
                              beta, eps, act);
                });
            });
        } else {
            RowGrid g = row_grid(C, count);
            CU_LAUNCH(bn_forward_kernel, g.grid, g.block, 0, stream_of(o), m, yc, y.dtype, xc,
                      x.dtype, (uint32_t)count, C, mean, var, gamma, beta, eps, act);
        }
        launchCheck();
    });
}

// the C running statistics, one thread each; the unbiasing factor in fp64 as on the CPU
__global__ void bn_update_running_kernel(float *run_mean, float *run_var, const float *mean,
                                         const float *var, int C, double unbias, float momentum) {
    FOR_GRID(c, C) running_update(run_mean, run_var, mean[c], var[c], c, unbias, momentum);
}
static void bn_update_running_cuda(Ops *o, float *run_mean, float *run_var, const float *mean,
                                   const float *var, int C, size_t count, float momentum) {
    if (C <= 0) return;
    CU_LAUNCH(bn_update_running_kernel, grid_for((size_t)C), BLOCK, 0, stream_of(o),
              moves(6.0 * sizeof(float) * C), run_mean, run_var, mean, var, C,
              bn_running_unbias((double)count), momentum);
    launchCheck();
}

// backward: g = dy·act'(z), the sums Σg and Σg·xhat, then
// dx (=|+=) gamma·invstd·(g - (sum_g + xhat·sum_gx)/count); count 0: gamma·invstd·g
struct BnParams {
    const float *mean, *var, *gamma, *beta; float eps; Act act;
    __device__ BnChannel channel(int c) const { return BnChannel(mean, var, gamma, beta, eps, c); }
    __device__ void grad(const BnChannel &bn, float x, float dy, float *xhat, float *g) const {
        *xhat = bn.xhat(x);
        *g = dy * act_grad(act, bn.z(*xhat));
    }
};
struct BnGradTerms {  // the summands g and g·xhat, generic
    const void *dy; DType dt_dy; const void *x; DType dt_x; int C; BnParams p;
    struct Lane {
        const void *dy; DType dt_dy; const void *x; DType dt_x; int C; BnParams p; BnChannel bn;
        __device__ void add(uint32_t r, double (&acc)[1][2]) const {
            float xhat, g;
            p.grad(bn, ld(x, dt_x, (size_t)r * C), ld(dy, dt_dy, (size_t)r * C), &xhat, &g);
            acc[0][0] += g;
            acc[0][1] += (double)g * xhat;
        }
    };
    __device__ Lane lane(int, int c) const {
        return {elem_ptr(dy, dt_dy, c), dt_dy, elem_ptr(x, dt_x, c), dt_x, C, p, p.channel(c)};
    }
};
// Dy: where the vector kernels read the output gradient dy's Vec at element i
// (row r): DyVec (memory) or DyResidual (BnNext FUSED_RESIDUAL, further on)
template <class T, int B = VEC_BYTES> struct DyVec {
    static constexpr int BYTES = B;
    const T *dy;
    __device__ VecB<T, B> load(size_t i, uint32_t) { return load_vec<T, B>(dy + i); }
    // load split in two for sum_rows: fetch (the loads), then finish
    static constexpr int LOADS = 1;  // Vecs fetch reads
    typedef VecB<T, B> Raw;
    __device__ Raw fetch(size_t i) const { return load_vec<T, B>(dy + i); }
    __device__ VecB<T, B> finish(const Raw &d, size_t, uint32_t) { return d; }
    __device__ DyVec at(int c0) const { return {dy + c0}; }  // from channel c0 on
};
template <class T, class Dy = DyVec<T>> struct BnGradTermsVec {
    Dy dy; const T *x; int C; BnParams p;
    static constexpr int B = Dy::BYTES, N = VecB<T, B>::N;
    struct Lane {
        mutable Dy dy; const T *x; int C; BnParams p; BnChannel bn[N];
        // x and dy's loads; with DyResidual's two (dout and the residual), two rows
        // of the three would spill under MEMORY_BOUND's 64 registers (ptxas: 44
        // bytes), so one row: 24 bytes a thread with 2-byte storage
        static constexpr int UNROLL = Dy::LOADS > 1 ? 1 : rows_ahead((1 + Dy::LOADS) * B);
        struct Row { VecB<T, B> x; typename Dy::Raw dy; };
        __device__ Row load(uint32_t r) const {
            return {load_vec<T, B>(x + (size_t)r * C), dy.fetch((size_t)r * C)};
        }
        __device__ void add(uint32_t r, const Row &row, double (&acc)[N][2]) const {
            const VecB<T, B> vx = row.x, vdy = dy.finish(row.dy, (size_t)r * C, r);
            for (int k = 0; k < N; k++) {
                float xhat, g;
                p.grad(bn[k], to_f32(vx.v[k]), to_f32(vdy.v[k]), &xhat, &g);
                acc[k][0] += g;
                acc[k][1] += (double)g * xhat;
            }
        }
    };
    __device__ Lane lane(int, int c0) const {
        Lane l = {dy.at(c0), x + c0, C, p, {}};
        for (int k = 0; k < N; k++) l.bn[k] = p.channel(c0 + k);
        return l;
    }
};
// sum_g, sum_gx overwritten; dbeta, dgamma added into; sums (not NULL) the fp64 sums
struct BnGradSums {
    float *sum_g, *sum_gx, *dgamma, *dbeta; double *sums; int C;
    __device__ void operator()(int, int c, const double *s) const {
        bn_grad_sums_store(c, s[0], s[1], sum_g, sum_gx, dgamma, dbeta);
        if (sums) { sums[c] = s[0]; sums[C + c] = s[1]; }
    }
};
static void bn_backward_reduce_plain(Ops *o, Tensor dy, Tensor x, const float *mean,
                                     const float *var, const float *gamma, const float *beta,
                                     float eps, Act act, float *sum_g, float *sum_gx, float *dgamma,
                                     float *dbeta, double *sums) {
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    const BnParams p = {mean, var, gamma, beta, eps, act};
    const BnGradSums e = {sum_g, sum_gx, dgamma, dbeta, sums, C};
    if (vec_ok({dy.dtype, x.dtype}, C, {dy.data, x.data})) {
        SWITCH_STORAGE(x.dtype, T, {
            typedef DyVec<T, NARROW_BYTES<T>> Dy;
            channel_sums<2, NARROW_CHANNELS>(
                    o, BnGradTermsVec<T, Dy>{{(const T *)dy.data}, (const T *)x.data, C, p}, e, 1,
                    M, C, bytes_of(dy) + bytes_of(x));
        });
    } else {
        channel_sums<2, 1>(o, BnGradTerms{dy.data, dy.dtype, x.data, x.dtype, C, p}, e, 1, M, C,
                           bytes_of(dy) + bytes_of(x));
    }
}
// --sync-bn: the gradient sums from the replicas' summed sums, one thread per channel
__global__ void bn_backward_finish_kernel(const double *sums, int C, float *sum_g, float *sum_gx,
                                          float *dgamma, float *dbeta) {
    FOR_GRID(c, C) bn_grad_sums_store(c, sums[c], sums[C + c], sum_g, sum_gx, dgamma, dbeta);
}
static void bn_backward_finish_cuda(Ops *o, const double *sums, int C, float *sum_g, float *sum_gx,
                                    float *dgamma, float *dbeta) {
    if (C <= 0) return;
    CU_LAUNCH(bn_backward_finish_kernel, grid_for((size_t)C), BLOCK, 0, stream_of(o),
              moves((2.0 * sizeof(double) + 4.0 * sizeof(float)) * C), sums, C, sum_g, sum_gx,
              dgamma, dbeta);
    launchCheck();
}

// the data gradient of channel c from g and xhat
struct BnDataGrad {
    float scale, sum_g, sum_gx, count;  // gamma·invstd; count 0: no batch-statistics terms
    __device__ BnDataGrad() {}
    __device__ BnDataGrad(const BnChannel &bn, const float *sg, const float *sgx, uint32_t n, int c)
        : scale(bn.gamma * bn.invstd), sum_g(n ? sg[c] : 0.0f), sum_gx(n ? sgx[c] : 0.0f),
          count((float)n) {}
    __device__ float operator()(float g, float xhat) const {
        if (count != 0.0f) g -= (sum_g + xhat * sum_gx) / count;
        return scale * g;
    }
};
__global__ void bn_backward_data_kernel(void *dx, DType dt_dx, const void *dy, DType dt_dy,
                                        const void *x, DType dt_x, uint32_t rows, int C, BnParams p,
                                        const float *sum_g, const float *sum_gx, uint32_t count,
                                        int accumulate) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const BnChannel bn = p.channel(c);
    const BnDataGrad dgrad(bn, sum_g, sum_gx, count, c);
    FOR_ROWS(r, rows) {
        const uint32_t i = r * C + c;
        float xhat, g;
        p.grad(bn, ld(x, dt_x, i), ld(dy, dt_dy, i), &xhat, &g);
        const float d = dgrad(g, xhat);
        st(dx, dt_dx, i, accumulate ? ld(dx, dt_dx, i) + d : d);
    }
}
template <class T, class Dy>
__global__ void MEMORY_BOUND bn_backward_data_vec_kernel(T *dx, Dy dy, const T *x, uint32_t rows,
                                                         int C, BnParams p, const float *sum_g,
                                                         const float *sum_gx, uint32_t count,
                                                         int accumulate) {
    constexpr int B = Dy::BYTES, N = VecB<T, B>::N;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * N;
    if (c0 >= C) return;
    BnChannel bn[N];
    BnDataGrad dgrad[N];
    for (int k = 0; k < N; k++) {
        bn[k] = p.channel(c0 + k);
        dgrad[k] = BnDataGrad(bn[k], sum_g, sum_gx, count, c0 + k);
    }
    // the textbook loop: FOR_ROWS(r, rows) { load x, dy (and dx) of row r; dx = the formula }
    struct Row { VecB<T, B> x, dx; typename Dy::Raw dy; };
    for_rows_ahead<rows_ahead((2 + Dy::LOADS) * B)>(  // x, dx and dy's loads
            rows,
            [&](uint32_t r) {
                const uint32_t i = r * C + c0;
                Row v;
                v.x = load_vec<T, B>(x + i);
                v.dy = dy.fetch(i);
                if (accumulate) v.dx = load_vec<T, B>(dx + i);
                return v;
            },
            [&](uint32_t r, const Row &v) {
                const uint32_t i = r * C + c0;
                const VecB<T, B> vdy = dy.finish(v.dy, i, r);
                VecB<T, B> vdx = v.dx;
                for (int k = 0; k < N; k++) {
                    float xhat, g;
                    p.grad(bn[k], to_f32(v.x.v[k]), to_f32(vdy.v[k]), &xhat, &g);
                    const float d = dgrad[k](g, xhat);
                    vdx.v[k] = from_f32<T>(accumulate ? to_f32(vdx.v[k]) + d : d);
                }
                store_vec(dx + i, vdx);
            });
}
static void bn_backward_data_plain(Ops *o, Tensor dx, Tensor dy, Tensor x, const float *mean,
                                   const float *var, const float *gamma, const float *beta,
                                   float eps, Act act, const float *sum_g, const float *sum_gx,
                                   size_t count, int accumulate) {
    const int C = x.shape.c;
    const size_t rows = shape_numel(x.shape) / (C ? C : 1);
    if (!rows || !C || !dx.data) return;
    require_below(count, (size_t)1 << 31, "batch norm values per channel");
    const BnParams p = {mean, var, gamma, beta, eps, act};
    const bool vec = vec_ok({dx.dtype, dy.dtype, x.dtype}, C, {dx.data, dy.data, x.data});
    for_row_launches(rows, C, [&](size_t r0, size_t n_rows) {
        void *dxc = elem_ptr(dx.data, dx.dtype, r0 * C);
        const void *dyc = elem_ptr(dy.data, dy.dtype, r0 * C),
                   *xc = elem_ptr(x.data, x.dtype, r0 * C);
        const size_t e = n_rows * C;
        const Traffic m =
                moves(bytes_of(e, dx.dtype) + bytes_of(e, dy.dtype) + bytes_of(e, x.dtype));
        if (vec) {
            SWITCH_STORAGE(x.dtype, T, {
                typedef DyVec<T, NARROW_BYTES<T>> Dy;
                RowGrid g = row_grid(C / NARROW_CHANNELS, n_rows);
                CU_LAUNCH((bn_backward_data_vec_kernel<T, Dy>), g.grid, g.block, 0, stream_of(o), m,
                          (T *)dxc, Dy{(const T *)dyc}, (const T *)xc, (uint32_t)n_rows, C, p,
                          sum_g, sum_gx, (uint32_t)count, accumulate);
            });
        } else {
            RowGrid g = row_grid(C, n_rows);
            CU_LAUNCH(bn_backward_data_kernel, g.grid, g.block, 0, stream_of(o), m, dxc, dx.dtype,
                      dyc, dy.dtype, xc, x.dtype, (uint32_t)n_rows, C, p, sum_g, sum_gx,
                      (uint32_t)count, accumulate);
        }
        launchCheck();
    });
}

// ---- batch norm with the layer after it (BnNext; the executor's "fusing layers" in
// segnet.c). The fused kernels compute what the two ops would, rounding where
// they store, so the results are the unfused ones bit for bit:
//   FUSED_POOL      forward: channel_sums over (image, pixels) as
//                   global_avg_pool_forward, whose summand applies the batch
//                   norm and stores y on the way (BnPoolVec)
//   FUSED_RESIDUAL  forward: out = y·keep(n) + residual from registers
//                   (ResidualEnd); backward: y's gradient dy·keep(n), rounded
//                   to the storage type, computed where the batch norm's two
//                   passes read it (DyResidual), dresidual written by the first
// keep(n) = dropout_keep(rate, seed, first_sample + n) of image n = row / (H·W).
// Where the vector kernels do not apply (bn_next_vec, the same answer for the
// reduce and the data op), the ops run one after the other, in place as on the
// CPU: bn_backward_reduce then leaves y's gradient in dy.

// drop_path's factor for the rows of one thread, which go up: the last image's
// factor is kept (rows r0 + r of a launch; rows < 2^31, checked by the host)
struct SampleKeep {
    float rate; const uint64_t *seed; uint64_t first_sample; FastDiv hw; uint32_t r0;
    uint32_t n; float keep;  // the image last asked for (UINT32_MAX: none yet) and its factor
    __device__ float at(uint32_t r) {
        if (rate <= 0.0f) return 1.0f;
        const uint32_t image = fastdiv(hw, r0 + r);
        if (image != n) { n = image; keep = dropout_keep(rate, *seed, first_sample + image); }
        return keep;
    }
};
static SampleKeep sample_keep(const BnNext *next, size_t rows_per_image, size_t r0) {
    return {next->rate,
            next->seed,
            next->first_sample,
            fastdiv_make((uint32_t)rows_per_image),
            (uint32_t)r0,
            UINT32_MAX,
            1.0f};
}

// out = y·keep + residual, as dropout's forward (dropout_residual_end; with
// keep 1, y + residual rounded once, as add_forward)
template <class T, int B = VEC_BYTES> struct ResidualEnd {
    static constexpr int BYTES = B;
    T *out; const T *res; SampleKeep keep;
    __device__ void operator()(uint32_t i, uint32_t r, const VecB<T, B> &y) {
        const float f = keep.at(r);
        VecB<T, B> vr = load_vec<T, B>(res + i), v;
        for (int k = 0; k < VecB<T, B>::N; k++)
            v.v[k] = from_f32<T>(dropout_residual_end(to_f32(y.v[k]), f, to_f32(vr.v[k])));
        store_vec(out + i, v);
    }
};
// y's gradient from out's: dout·keep rounded as dropout_backward stores it;
// res (not NULL: the reduce pass) gets dresidual (=|+=) dout on the way
template <class T, int B = VEC_BYTES> struct DyResidual {
    static constexpr int BYTES = B;
    const T *dout; T *res; int accumulate_res; SampleKeep keep;
    __device__ VecB<T, B> load(size_t i, uint32_t r) { return finish(fetch(i), i, r); }
    // load split in two for sum_rows: fetch (the loads), then finish (the rest)
    static constexpr int LOADS = 2;  // Vecs fetch reads (dout; res when accumulated)
    struct Raw { VecB<T, B> d, vr; };
    __device__ Raw fetch(size_t i) const {
        Raw raw;
        raw.d = load_vec<T, B>(dout + i);
        if (res && accumulate_res) raw.vr = load_vec<T, B>(res + i);
        return raw;
    }
    __device__ VecB<T, B> finish(const Raw &raw, size_t i, uint32_t r) {
        const float f = keep.at(r);
        const VecB<T, B> d = raw.d;
        VecB<T, B> g, vr = raw.vr;
        for (int k = 0; k < VecB<T, B>::N; k++) {
            g.v[k] = from_f32<T>(__fmul_rn(to_f32(d.v[k]), f));  // as dropout_backward's
            if (res)
                vr.v[k] = from_f32<T>(accumulate_res ? to_f32(vr.v[k]) + to_f32(d.v[k])
                                                     : to_f32(d.v[k]));
        }
        if (res) store_vec(res + i, vr);
        return g;
    }
    __device__ DyResidual at(int c0) const {
        return {dout + c0, res ? res + c0 : NULL, accumulate_res, keep};
    }
};
// the batch norm applied to rows of image g, y stored, Σ y per channel (FUSED_POOL)
template <class T, int B = VEC_BYTES> struct BnPoolVec {
    const T *x; T *y; int C; uint32_t rows; BnParams p;
    static constexpr int N = VecB<T, B>::N;
    struct Lane {
        const T *x; T *y; int C; Act act; BnChannel bn[N];
        static constexpr int UNROLL = rows_ahead(B);
        typedef VecB<T, B> Row;
        __device__ Row load(uint32_t r) const { return load_vec<T, B>(x + (size_t)r * C); }
        __device__ void add(uint32_t r, Row v, double (&acc)[N][1]) const {
            for (int k = 0; k < N; k++) {
                v.v[k] = from_f32<T>(act_apply(act, bn[k].z(bn[k].xhat(to_f32(v.v[k])))));
                acc[k][0] += (double)to_f32(v.v[k]);
            }
            store_vec(y + (size_t)r * C, v);
        }
    };
    __device__ Lane lane(int g, int c0) const {
        const size_t at = (size_t)g * rows * C + c0;
        Lane l = {x + at, y + at, C, p.act, {}};
        for (int k = 0; k < N; k++) l.bn[k] = p.channel(c0 + k);
        return l;
    }
};

// whether the fused vector kernels serve `next` for a batch norm over x (y, dx: the
// op's other tensors, when it has them)
static bool bn_next_vec(const BnNext *next, Tensor x, std::initializer_list<const void *> more) {
    const int C = x.shape.c;
    const size_t HW = (size_t)x.shape.h * x.shape.w;
    for (const Tensor *t : {&next->pooled, &next->out, &next->residual, &next->dresidual})
        if (t->data && t->dtype != x.dtype) return false;
    if (next->kind == FUSED_POOL)
        return x.shape.n < 65536 && vec_ok({x.dtype}, C, {x.data, next->pooled.data}) &&
               vec_ok({x.dtype}, C, more);
    // SampleKeep's row numbers
    if (shape_numel(x.shape) / (C ? C : 1) >= ((size_t)1 << 31) || !HW) return false;
    return vec_ok({x.dtype}, C,
                  {x.data, next->out.data, next->residual.data, next->dresidual.data}) &&
           vec_ok({x.dtype}, C, more);
}

static void bn_forward_cuda(Ops *o, Tensor y, Tensor x, const BnArgs *bn) {
    const float *mean = bn->mean, *var = bn->var, *gamma = bn->gamma, *beta = bn->beta;
    const float eps = bn->eps; const Act act = bn->act; const BnNext *next = bn->next;
    const int C = x.shape.c;
    const size_t rows = shape_numel(x.shape) / (C ? C : 1), HW = (size_t)x.shape.h * x.shape.w;
    if (next && next->kind == FUSED_RESIDUAL) y = next->out;  // y has no memory: out's, in place
    if (!next || !rows || !C || !bn_next_vec(next, x, {y.data})) {
        bn_forward_plain(o, y, x, mean, var, gamma, beta, eps, act);
        if (next) bn_next_forward_unfused(o, y, next);
        return;
    }
    const BnParams p = {mean, var, gamma, beta, eps, act};
    if (next->kind == FUSED_POOL) {
        SWITCH_STORAGE(x.dtype, T, {
            typedef BnPoolVec<T, NARROW_BYTES<T>> F;
            channel_sums<1, NARROW_CHANNELS>(
                    o, F{(const T *)x.data, (T *)y.data, C, (uint32_t)HW, p},
                    StoreSum{next->pooled.data, next->pooled.dtype, C, (double)HW, 0}, x.shape.n,
                    HW, C, bytes_of(x) + bytes_of(y));
        });
        return;
    }
    for_row_launches(rows, C, [&](size_t r0, size_t count) {
        SWITCH_STORAGE(x.dtype, T, {
            const size_t at = r0 * C;
            T *y = (T *)next->out.data + at;
            const T *res = (const T *)next->residual.data + at;
            const SampleKeep keep = sample_keep(next, HW, r0);
            with_lane_bytes<T>(C, count, 1, [&](RowGrid g, auto bytes) {
                typedef ResidualEnd<T, decltype(bytes)::value> Out;
                CU_LAUNCH((bn_forward_vec_kernel<T, Out>), g.grid, g.block, 0, stream_of(o),
                          moves(3.0 * count * C * sizeof(T)), Out{y, res, keep},
                          (const T *)x.data + at, (uint32_t)count, C, mean, var, gamma, beta, eps,
                          act);
            });
        });
        launchCheck();
    });
}

// whether the fused kernels serve a FUSED_RESIDUAL backward (else dy becomes y's gradient in place)
static bool bn_residual_fused(const BnNext *next, Tensor dy, Tensor x) {
    return dy.dtype == x.dtype && shape_numel(x.shape) && bn_next_vec(next, x, {dy.data});
}

static void bn_backward_reduce_cuda(Ops *o, Tensor dy, Tensor x, const BnArgs *bn, float *sum_g,
                                    float *sum_gx, float *dgamma, float *dbeta, double *sums) {
    const float *mean = bn->mean, *var = bn->var, *gamma = bn->gamma, *beta = bn->beta;
    const float eps = bn->eps; const Act act = bn->act; const BnNext *next = bn->next;
    if (next && next->kind == FUSED_RESIDUAL && !bn_residual_fused(next, dy, x)) {
        bn_next_backward_unfused(o, dy, next);
        next = NULL;  // dy is y's gradient now
    }
    if (!next || next->kind != FUSED_RESIDUAL) {
        if (sum_g)
            bn_backward_reduce_plain(o, dy, x, mean, var, gamma, beta, eps, act, sum_g, sum_gx,
                                     dgamma, dbeta, sums);
        return;
    }
    if (!sum_g) {  // dresidual alone
        if (next->dresidual.data)
            add_backward_cuda(o, NO_TENSOR, next->dresidual, dy, 0, next->accumulate_residual);
        return;
    }
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C, HW = (size_t)x.shape.h * x.shape.w;
    const BnParams p = {mean, var, gamma, beta, eps, act};
    const BnGradSums e = {sum_g, sum_gx, dgamma, dbeta, sums, C};
    SWITCH_STORAGE(x.dtype, T, {
        typedef DyResidual<T, NARROW_BYTES<T>> Dy;
        const Dy d = {(const T *)dy.data, (T *)next->dresidual.data, next->accumulate_residual,
                      sample_keep(next, HW, 0)};
        const double dres = next->dresidual.data ? bytes_of(next->dresidual) : 0.0;
        channel_sums<2, NARROW_CHANNELS>(o, BnGradTermsVec<T, Dy>{d, (const T *)x.data, C, p}, e, 1,
                                         M, C, bytes_of(dy) + bytes_of(x) + dres);
    });
}

static void bn_backward_data_cuda(Ops *o, Tensor dx, Tensor dy, Tensor x, const BnArgs *bn,
                                  const float *sum_g, const float *sum_gx, size_t count,
                                  int accumulate) {
    const float *mean = bn->mean, *var = bn->var, *gamma = bn->gamma, *beta = bn->beta;
    const float eps = bn->eps; const Act act = bn->act; const BnNext *next = bn->next;
    // dy: y's gradient
    if (!next || next->kind != FUSED_RESIDUAL || !bn_residual_fused(next, dy, x)) {
        bn_backward_data_plain(o, dx, dy, x, mean, var, gamma, beta, eps, act, sum_g, sum_gx, count,
                               accumulate);
        return;
    }
    const int C = x.shape.c;
    const size_t rows = shape_numel(x.shape) / C, HW = (size_t)x.shape.h * x.shape.w;
    if (!dx.data) return;
    if (dx.dtype != x.dtype || !vec_ok({x.dtype}, C, {dx.data})) {
        // dy becomes y's gradient (dresidual was written by the reduce)
        BnNext y_grad_only = *next;
        y_grad_only.dresidual = NO_TENSOR;
        bn_next_backward_unfused(o, dy, &y_grad_only);
        bn_backward_data_plain(o, dx, dy, x, mean, var, gamma, beta, eps, act, sum_g, sum_gx, count,
                               accumulate);
        return;
    }
    require_below(count, (size_t)1 << 31, "batch norm values per channel");
    const BnParams p = {mean, var, gamma, beta, eps, act};
    for_row_launches(rows, C, [&](size_t r0, size_t n_rows) {
        SWITCH_STORAGE(x.dtype, T, {
            const size_t at = r0 * C;
            typedef DyResidual<T, NARROW_BYTES<T>> Dy;
            RowGrid g = row_grid(C / NARROW_CHANNELS, n_rows);
            const Dy d = {(const T *)dy.data + at, NULL, 0, sample_keep(next, HW, r0)};
            CU_LAUNCH((bn_backward_data_vec_kernel<T, Dy>), g.grid, g.block, 0, stream_of(o),
                      moves(3.0 * n_rows * C * sizeof(T)), (T *)dx.data + at, d,
                      (const T *)x.data + at, (uint32_t)n_rows, C, p, sum_g, sum_gx,
                      (uint32_t)count, accumulate);
        });
        launchCheck();
    });
}
