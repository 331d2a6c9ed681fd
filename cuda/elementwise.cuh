// cuda/elementwise.cuh -- chapter 3 of the CUDA backend: the ops a pixel at a time. The
// image-row thread layout (pooling, resampling, depthwise), activations, squeeze-excitation
// (average pool, channel scale, the gate), residual add, channel concat, dropout and
// drop-path, pooling and resampling.
// Needs: the seam; the reductions' channel_sums (squeeze-excitation's sums over pixels).

// ----------------------------------------------------------------------------
// image rows: the thread layout of pooling, resampling and depthwise kernels, one thread
// per output pixel and channel lane
// (backward: per pixel of dx, gathering), so nothing is written twice and no
// atomics are needed. Grid (channel tiles, column blocks, image rows): an
// image row t = n·H + y of the tensor a thread writes is blockIdx.z, split
// once per thread; the columns are walked by a grid-stride loop.

// (n, y) of image row t of a tensor of height h
struct ImageRow { uint32_t n, y; };
static __device__ __forceinline__ ImageRow image_row(uint32_t t, int h) { return {t / h, t % h}; }
// element (n, y, x, c) of a tensor of shape s
static __device__ __forceinline__ uint32_t nhwc_at(Shape s, uint32_t n, int y, int x, int c) {
    return ((n * s.h + y) * s.w + x) * s.c + c;
}
#define FOR_COLUMNS(x, width)                                                          \
    for (int x = blockIdx.y * blockDim.y + threadIdx.y; x < (width); x += blockDim.y * gridDim.y)

// Launches `kernel_for(grid, io_out, io_in, io_extra, out shape, in shape, bytes)` over
// chunks of images (the tensors' pointers advanced), so that the grid's z
// (image rows of out) stays within 65535 and every index within 2^31. `extra`
// (data NULL: none) is shaped like out. The vector accessors when every
// tensor has one storage type and C is a multiple of the width, else the
// generic ones.
// NARROW: NarrowIO instead of VecIO (4 channels a thread in every type)
template <bool NARROW = false, class K>
static void image_rows_launch(Tensor out, Tensor in, Tensor extra, K kernel_for) {
    const int N = out.shape.n, C = out.shape.c, H = out.shape.h;
    const size_t out_image = N ? shape_numel(out.shape) / N : 0,
                 in_image = N ? shape_numel(in.shape) / N : 0;
    const size_t per_image = out_image > in_image ? out_image : in_image;
    if (!N || !per_image) return;
    require_below(per_image, LAUNCH_MAX_ELEMENTS,
                  "elements per image of a pooling or resampling op");
    // gridDim.z ≤ 65535
    require_below((size_t)H, 65536, "rows per image of a pooling or resampling op");
    size_t images = 65535 / (H ? H : 1);  // at least 1 now
    if ((LAUNCH_MAX_ELEMENTS - 1) / per_image < images)
        images = (LAUNCH_MAX_ELEMENTS - 1) / per_image;
    const bool vec = vec_ok({out.dtype, in.dtype, extra.data ? extra.dtype : out.dtype}, C,
                            {out.data, in.data, extra.data});
    for (int n0 = 0; n0 < N; n0 += (int)images) {
        const int count = N - n0 < (int)images ? N - n0 : (int)images;
        Tensor oc =
                tensor(elem_ptr(out.data, out.dtype, (size_t)n0 * out_image), out.shape, out.dtype);
        Tensor ic = tensor(elem_ptr(in.data, in.dtype, (size_t)n0 * in_image), in.shape, in.dtype);
        Tensor ec = tensor(extra.data ? elem_ptr(extra.data, extra.dtype, (size_t)n0 * out_image)
                                      : NULL,
                           out.shape, extra.dtype);
        oc.shape.n = ic.shape.n = count;
        const double bytes = bytes_of(oc) + bytes_of(ic) +
                             (ec.data ? bytes_of(shape_numel(oc.shape), ec.dtype) : 0.0);
        if (vec) {
            SWITCH_STORAGE(out.dtype, T, {
                typedef std::conditional_t<NARROW, NarrowIO<T>, VecIO<T>> IO;
                RowGrid g = row_grid(C / IO::W, out.shape.w, (unsigned)(count * H));
                kernel_for(g, IO::of(oc), IO::of(ic), IO::of(ec), oc.shape, ic.shape, bytes);
            });
        } else {
            RowGrid g = row_grid(C, out.shape.w, (unsigned)(count * H));
            kernel_for(g, AnyIO::of(oc), AnyIO::of(ic), AnyIO::of(ec), oc.shape, ic.shape, bytes);
        }
        launchCheck();
    }
}

// ----------------------------------------------------------------------------
// activations: y = act(x), dx (=|+=) dy·act'(x)

static void act_forward_cuda(Ops *o, Act act, Tensor y, Tensor x) {
    map_op(o, tensor(y.data, x.shape, y.dtype), x, NO_TENSOR, 0, ActForward{act});
}
static void act_backward_cuda(Ops *o, Act act, Tensor dx, Tensor dy, Tensor x, int accumulate) {
    map_op(o, tensor(dx.data, x.shape, dx.dtype), dy, x, accumulate, ActBackward{act});
}

// ----------------------------------------------------------------------------
// squeeze-excitation pieces, x (N,H,W,C), pooled and s (N,1,1,C)
//   pool:  y[n,c] = Σ_{h,w} x[n,h,w,c] / (H·W);      dx[n,h,w,c] = dy[n,c] / (H·W)
//   scale: y[n,h,w,c] = x[n,h,w,c]·s[n,c];           dx = dy·s,  ds[n,c] = Σ_{h,w} dy·x

static void global_avg_pool_forward_cuda(Ops *o, Tensor y, Tensor x) {
    const int N = x.shape.n, C = x.shape.c;
    const size_t HW = (size_t)x.shape.h * x.shape.w;
    if (!N || !C) return;
    sums_of_product(o, StoreSum{y.data, y.dtype, C, (double)HW, 0}, x, NULL, N, HW, C);
}

// dst[n,h,w,c] (=|+=) b[n,h,w,c]·src[n,c], or src[n,c]·a where b is NULL; dst, b
// (N,H,W,C), src (N,1,1,C). Grid (channel tiles, row blocks, images): the image
// is blockIdx.z, the rows are its H·W pixels, src[n,c] is loaded once per thread.
__global__ void per_image_channel_kernel(void *dst, DType dt_dst, const void *src, DType dt_src,
                                         const void *b, DType dt_b, float a, uint32_t HW, int C,
                                         int accumulate) {
    const int c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    const uint32_t n = blockIdx.z;
    const float s = ld(src, dt_src, n * C + c);
    void *y = elem_ptr(dst, dt_dst, (size_t)n * HW * C);
    const void *bn = b ? elem_ptr(b, dt_b, (size_t)n * HW * C) : NULL;
    FOR_ROWS(r, HW) {
        const uint32_t i = r * C + c;
        float v = bn ? ld(bn, dt_b, i) * s : s * a;
        st(y, dt_dst, i, accumulate ? ld(y, dt_dst, i) + v : v);
    }
}
template <class T, int BYTES>
__global__ void per_image_channel_vec_kernel(T *dst, const T *src, const T *b, float a, uint32_t HW,
                                             int C, int accumulate) {
    constexpr int N = BYTES / sizeof(T);
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * N;
    if (c0 >= C) return;
    const uint32_t n = blockIdx.z;
    const VecB<T, BYTES> vs = load_vec<T, BYTES>(src + n * C + c0);
    T *y = dst + (size_t)n * HW * C + c0;
    const T *bn = b ? b + (size_t)n * HW * C + c0 : NULL;
    FOR_ROWS(r, HW) {
        VecB<T, BYTES> vb, vy;
        if (bn) vb = load_vec<T, BYTES>(bn + r * C);
        if (accumulate) vy = load_vec<T, BYTES>(y + r * C);
        for (int k = 0; k < N; k++) {
            const float s = to_f32(vs.v[k]), v = bn ? to_f32(vb.v[k]) * s : s * a;
            vy.v[k] = from_f32<T>(accumulate ? to_f32(vy.v[k]) + v : v);
        }
        store_vec(y + r * C, vy);
    }
}
static void per_image_channel(Ops *o, Tensor dst, Tensor src, const void *b, DType dt_b, float a,
                              int accumulate) {
    const int N = dst.shape.n, C = dst.shape.c;
    const size_t HW = (size_t)dst.shape.h * dst.shape.w;
    if (!N || !C || !HW) return;
    require_below(HW * C, LAUNCH_MAX_ELEMENTS, "elements per image of a per-image channel op");
    const bool vec =
            vec_ok({dst.dtype, src.dtype, b ? dt_b : dst.dtype}, C, {dst.data, src.data, b});
    for (int n0 = 0; n0 < N; n0 += 65535) {  // gridDim.z ≤ 65535
        const unsigned images = N - n0 < 65535 ? N - n0 : 65535;
        const size_t at = (size_t)n0 * HW * C;
        void *y = elem_ptr(dst.data, dst.dtype, at);
        const void *s = elem_ptr(src.data, src.dtype, (size_t)n0 * C),
                   *bb = b ? elem_ptr(b, dt_b, at) : NULL;
        const size_t e = images * HW * C;
        const Traffic m = moves(bytes_of(e, dst.dtype) + (b ? bytes_of(e, dt_b) : 0.0) +
                                bytes_of(images * C, src.dtype));
        if (vec) {
            SWITCH_STORAGE(dst.dtype, T, {
                with_lane_bytes<T>(C, HW, images, [&](RowGrid g, auto bytes) {
                    CU_LAUNCH((per_image_channel_vec_kernel<T, decltype(bytes)::value>), g.grid,
                              g.block, 0, stream_of(o), m, (T *)y, (const T *)s, (const T *)bb, a,
                              (uint32_t)HW, C, accumulate);
                });
            });
        } else {
            RowGrid g = row_grid(C, HW, images);
            CU_LAUNCH(per_image_channel_kernel, g.grid, g.block, 0, stream_of(o), m, y, dst.dtype,
                      s, src.dtype, bb, dt_b, a, (uint32_t)HW, C, accumulate);
        }
        launchCheck();
    }
}

static void global_avg_pool_backward_cuda(Ops *o, Tensor dx, Tensor dy, int accumulate) {
    if (!dx.data) return;
    per_image_channel(o, dx, dy, NULL, DT_F32, 1.0f / (float)((size_t)dx.shape.h * dx.shape.w),
                      accumulate);
}

static void channel_scale_forward_cuda(Ops *o, Tensor y, Tensor x, Tensor s) {
    per_image_channel(o, y, s, x.data, x.dtype, 1.0f, 0);
}

// channel_scale's backward in one pass when both are wanted: the per-image sums
// ds = Σ_pixels dy·x, each (pixel, channel) visited once, also writing
// dx (=|+=) dy·s[n,c] (the generic lane: one channel; the vector lane: a Vec)
struct ScaleGrad {
    const void *dy, *x, *s; void *dx; DType dt, dt_s, dt_dx; int C; uint32_t rows; int accumulate;
    struct Lane {
        const void *dy, *x; void *dx; DType dt, dt_dx; int C; float sc; int accumulate;
        __device__ void add(uint32_t r, double (&acc)[1][1]) const {
            const size_t i = (size_t)r * C;
            const float g = ld(dy, dt, i);
            acc[0][0] += (double)g * ld(x, dt, i);
            const float v = g * sc;
            st(dx, dt_dx, i, accumulate ? ld(dx, dt_dx, i) + v : v);
        }
    };
    __device__ Lane lane(int g, int c) const {
        const size_t at = (size_t)g * rows * C + c;
        return {elem_ptr(dy, dt, at), elem_ptr(x, dt, at), elem_ptr(dx, dt_dx, at), dt, dt_dx, C,
                ld(s, dt_s, (size_t)g * C + c), accumulate};
    }
};
template <class T> struct ScaleGradVec {
    const T *dy, *x, *s; T *dx; int C; uint32_t rows; int accumulate;
    static constexpr int N = Vec<T>::N;
    struct Lane {
        const T *dy, *x; T *dx; int C; float sc[N]; int accumulate;
        __device__ void add(uint32_t r, double (&acc)[N][1]) const {
            const size_t i = (size_t)r * C;
            Vec<T> g = load_vec(dy + i), v = load_vec(x + i), out;
            if (accumulate) out = load_vec(dx + i);
            for (int k = 0; k < N; k++) {
                const float gk = to_f32(g.v[k]);
                acc[k][0] += (double)gk * to_f32(v.v[k]);
                out.v[k] = from_f32<T>(accumulate ? to_f32(out.v[k]) + gk * sc[k] : gk * sc[k]);
            }
            store_vec(dx + i, out);
        }
    };
    __device__ Lane lane(int g, int c0) const {
        const size_t at = (size_t)g * rows * C + c0;
        Lane l = {dy + at, x + at, dx + at, C, {}, accumulate};
        for (int k = 0; k < N; k++) l.sc[k] = to_f32(s[(size_t)g * C + c0 + k]);
        return l;
    }
};
static void channel_scale_backward_cuda(Ops *o, Tensor dx, Tensor ds, Tensor dy, Tensor x, Tensor s,
                                        int accumulate_dx, int accumulate_ds) {
    const int N = x.shape.n, C = x.shape.c;
    const size_t rows = (size_t)x.shape.h * x.shape.w;
    if (!ds.data || !N || !C) {
        if (dx.data) per_image_channel(o, dx, s, dy.data, dy.dtype, 1.0f, accumulate_dx);
        return;
    }
    const StoreSum e = {ds.data, ds.dtype, C, 1.0, accumulate_ds};
    const double bytes = bytes_of(dy) + bytes_of(x) + bytes_of(s) + (dx.data ? bytes_of(dx) : 0.0);
    if (!dx.data) {
        sums_of_product(o, e, dy, &x, N, rows, C);
    } else if (dx.dtype == dy.dtype && s.dtype == dy.dtype && x.dtype == dy.dtype &&
               vec_ok({dy.dtype}, C, {dy.data, x.data, dx.data, s.data})) {
        SWITCH_STORAGE(dy.dtype, T, {
            ScaleGradVec<T> f = {
                    (const T *)dy.data, (const T *)x.data, (const T *)s.data, (T *)dx.data, C,
                    (uint32_t)rows,     accumulate_dx};
            channel_sums<1, Vec<T>::N>(o, f, e, N, rows, C, bytes);
        });
    } else {
        ScaleGrad f = {dy.data, x.data,   s.data, dx.data,        dy.dtype,
                       s.dtype, dx.dtype, C,      (uint32_t)rows, accumulate_dx};
        channel_sums<1, 1>(o, f, e, N, rows, C, bytes);
    }
}

// ----------------------------------------------------------------------------
// squeeze-excitation's gate (se_gate_forward in segnet.h; the CPU op, se_gate_images
// in segnet.c, is the reference), split over images and outputs so that every
// launch fills the GPU (not one block per image). The matrix-vector products
// are fp64 sums in an order fixed by the shape:
//   rows of W1 (z1 = W1·p) and of W2 (z2 = W2·y1): a warp per output, lane l
//   adding terms l, l + WARP_SIZE, ..., the lanes added in a fixed butterfly;
//   columns of W2 (W2ᵀ·dz2): a block per (image, WARP_SIZE outputs), warp w
//   adding its SE_WARPS-th of the terms in order, the warps' sums added in
//   warp order; columns of W1 (W1ᵀ·dz1): a thread per output, terms in order
//   (neighbouring threads read neighbouring weights).
// Between the launches z1, y1, dz2 and dz1 of every image wait in the
// context's scratch (the backward's second kernel adds the weight gradients
// over the images from them, a thread per weight, images in order).
//   forward:  se_gate_hidden (z1, y1), se_gate_out (s = act2(z2))
//   backward: se_gate_hidden, se_gate_out (dz2 = ds·act2'(z2)), se_gate_hidden_backward
//             (dz1 = (W2ᵀ·dz2)·act1'(z1)), se_gate_input_backward (dp), se_gate_weights

#define SE_WARPS (BLOCK / WARP_SIZE)
#define SE_OUTPUTS_PER_WARP 4  // z2's outputs per warp (se_gate_out)

// Σ_k a[k]·b[k] for k = lane, lane + WARP_SIZE, ... < n, then over the warp (the full mask:
// all 32 lanes)
static __device__ double warp_dot(const float *a, const float *b, int n) {
    double t = 0.0;
    for (int k = threadIdx.x % WARP_SIZE; k < n; k += WARP_SIZE) t += (double)a[k] * b[k];
    for (int d = WARP_SIZE / 2; d > 0; d /= 2) t += __shfl_xor_sync(0xffffffffu, t, d);
    return t;
}
// z1, y1 (N,S), rounded to dt: grid (N, S / SE_WARPS), a warp per output j;
// shared memory: the image's p (C)
__global__ void se_gate_hidden_kernel(float *z1, float *y1, const void *p, DType dt,
                                      const float *w1, const float *b1, int C, int S, Act act1) {
    CU_DYN_SHARED(float, pv);
    const int n = blockIdx.x, j = blockIdx.y * SE_WARPS + threadIdx.x / WARP_SIZE;
    for (int c = threadIdx.x; c < C; c += blockDim.x) pv[c] = ld(p, dt, (size_t)n * C + c);
    __syncthreads();
    if (j >= S) return;  // the whole warp
    const float z = dtype_round(dt, (float)(b1[j] + warp_dot(w1 + (size_t)j * C, pv, C)));
    if (threadIdx.x % WARP_SIZE == 0) {
        z1[(size_t)n * S + j] = z;
        y1[(size_t)n * S + j] = dtype_round(dt, act_apply(act1, z));
    }
}
// z2 (rounded to dt) of image blockIdx.x, a warp per output c; then the forward's
// s = act2(z2) (ds NULL) or the backward's dz2 = ds·act2'(z2) (rounded, into g2).
// Grid (N, C / (SE_WARPS·SE_OUTPUTS_PER_WARP)); shared memory: the image's y1 (S)
__global__ void se_gate_out_kernel(void *s, const void *ds, DType dt, const float *y1,
                                   const float *w2, const float *b2, int C, int S, Act act2,
                                   float *g2) {
    CU_DYN_SHARED(float, yv);
    const int n = blockIdx.x;
    for (int j = threadIdx.x; j < S; j += blockDim.x) yv[j] = y1[(size_t)n * S + j];
    __syncthreads();
    for (int c = blockIdx.y * SE_WARPS + threadIdx.x / WARP_SIZE; c < C;
         c += gridDim.y * SE_WARPS) {
        const float z = dtype_round(dt, (float)(b2[c] + warp_dot(w2 + (size_t)c * S, yv, S)));
        if (threadIdx.x % WARP_SIZE) continue;
        const size_t at = (size_t)n * C + c;
        if (ds)
            g2[at] = dtype_round(dt, ld(ds, dt, at) * act_grad(act2, z));
        else
            st(s, dt, at, act_apply(act2, z));
    }
}
// dz1 = (W2ᵀ·dz2)·act1'(z1) (N,S), rounded to dt as the CPU does: grid (N, S / WARP_SIZE),
// lane l the output j = blockIdx.y·WARP_SIZE + l, warp w adding terms c of its share
__global__ void se_gate_hidden_backward_kernel(float *g1, const float *g2, const float *z1,
                                               const float *w2, int C, int S, Act act1, DType dt) {
    CU_SHARED(double, part, [SE_WARPS * WARP_SIZE]);
    const int n = blockIdx.x, lane = threadIdx.x % WARP_SIZE, warp = threadIdx.x / WARP_SIZE;
    const int j = blockIdx.y * WARP_SIZE + lane, per = (C + SE_WARPS - 1) / SE_WARPS;
    const int c1 = (warp + 1) * per < C ? (warp + 1) * per : C;
    double a = 0.0;
    if (j < S)
        for (int c = warp * per; c < c1; c++)
            a += (double)w2[(size_t)c * S + j] * g2[(size_t)n * C + c];
    part[warp * WARP_SIZE + lane] = a;
    __syncthreads();
    if (warp || j >= S) return;
    double t = 0.0;
    for (int w = 0; w < SE_WARPS; w++) t += part[w * WARP_SIZE + lane];
    const size_t at = (size_t)n * S + j;
    g1[at] = dtype_round(dt, dtype_round(dt, (float)t) * act_grad(act1, z1[at]));
}
// dp (=|+=) W1ᵀ·dz1 (N,C): grid (C / BLOCK, N), a thread per output c, terms j in order
__global__ void se_gate_input_backward_kernel(void *dp, DType dt_dp, const float *g1,
                                              const float *w1, int C, int S, int accumulate) {
    const int n = blockIdx.y, c = blockIdx.x * blockDim.x + threadIdx.x;
    if (c >= C) return;
    double a = 0.0;
    for (int j = 0; j < S; j++) a += (double)w1[(size_t)j * C + c] * g1[(size_t)n * S + j];
    const size_t at = (size_t)n * C + c;
    st(dp, dt_dp, at, accumulate ? ld(dp, dt_dp, at) + (float)a : (float)a);
}
// dW2[c][j] += Σ_n dz2[n][c]·y1[n][j], dW1[j][c] += Σ_n dz1[n][j]·p[n][c], db2[c] += Σ_n dz2[n][c],
// db1[j] += Σ_n dz1[n][j]: item i < C·S is dW2's element i, then dW1's, db2's, db1's
__global__ void se_gate_weights_kernel(const float *keep, const void *p, DType dt, int N, int C,
                                       int S, float *dw1, float *db1, float *dw2, float *db2,
                                       FastDiv by_s, FastDiv by_c) {
    const uint32_t CS = (uint32_t)C * S, items = 2 * CS + C + S;
    const float *kz2 = keep, *ky1 = keep + (size_t)N * C, *kz1 = ky1 + (size_t)N * S;
    FOR_GRID(i, items) {
        double a = 0.0;
        if (i < CS) {
            const uint32_t c = fastdiv(by_s, i), j = i - c * S;
            for (int n = 0; n < N; n++)
                a += (double)kz2[(size_t)n * C + c] * ky1[(size_t)n * S + j];
            dw2[i] += (float)a;
        } else if (i < 2 * CS) {
            const uint32_t k = i - CS, j = fastdiv(by_c, k), c = k - j * C;
            for (int n = 0; n < N; n++)
                a += (double)kz1[(size_t)n * S + j] * ld(p, dt, (size_t)n * C + c);
            dw1[k] += (float)a;
        } else if (i < 2 * CS + C) {
            const uint32_t c = i - 2 * CS;
            for (int n = 0; n < N; n++) a += kz2[(size_t)n * C + c];
            db2[c] += (float)a;
        } else {
            const uint32_t j = i - 2 * CS - C;
            for (int n = 0; n < N; n++) a += kz1[(size_t)n * S + j];
            db1[j] += (float)a;
        }
    }
}
// The scratch of the gate's split (the context's sums): dz2 (N,C), y1, dz1, z1 (N,S
// each), the first three in se_gate_weights_kernel's order
struct SeScratch {
    float *g2, *y1, *g1, *z1;
};
static SeScratch se_scratch(Ops *o, int N, int C, int S) {
    require_below((size_t)N * (C + 3 * (size_t)S), 2 * SUMS_SCRATCH + 1,
                  "squeeze-excitation gate values kept");
    require_below(sizeof(float) * (size_t)C, (size_t)48 << 10,
                  "shared memory of a squeeze-excitation gate (bytes)");
    float *g2 = (float *)ctx_of(o)->sums, *y1 = g2 + (size_t)N * C, *g1 = y1 + (size_t)N * S;
    return {g2, y1, g1, g1 + (size_t)N * S};
}
// a launch of the gate: an (N, C) tensor of type dt in or out, a C×S fp32 weight
// matrix, `vectors` fp32 (N, S) or (N, C) vectors, N·C·S multiply-adds
static Traffic se_traffic(int N, int C, int S, DType dt, double vectors) {
    const double ncs = (double)N * C * S;
    return moves(bytes_of((size_t)N * C, dt) + 4.0 * ((double)C * S + vectors), 2.0 * ncs);
}
static void se_gate_front(Ops *o, const SeScratch &k, Tensor p, const float *w1, const float *b1,
                          int S, Act act1) {
    const int N = p.shape.n, C = p.shape.c;
    CU_LAUNCH(se_gate_hidden_kernel, dim3(N, (S + SE_WARPS - 1) / SE_WARPS), BLOCK,
              sizeof(float) * C, stream_of(o), se_traffic(N, C, S, p.dtype, 2.0 * N * S + S), k.z1,
              k.y1, p.data, p.dtype, w1, b1, C, S, act1);
    launchCheck();
}
static dim3 se_gate_out_grid(int N, int C) {
    return dim3(N, (C + SE_WARPS * SE_OUTPUTS_PER_WARP - 1) / (SE_WARPS * SE_OUTPUTS_PER_WARP));
}
static void se_gate_forward_cuda(Ops *o, Tensor s, Tensor p, const float *w1, const float *b1,
                                 const float *w2, const float *b2, int S, Act act1, Act act2) {
    const int N = p.shape.n, C = p.shape.c;
    if (!N) return;
    const SeScratch k = se_scratch(o, N, C, S);
    se_gate_front(o, k, p, w1, b1, S, act1);
    CU_LAUNCH(se_gate_out_kernel, se_gate_out_grid(N, C), BLOCK, sizeof(float) * S, stream_of(o),
              se_traffic(N, C, S, p.dtype, (double)N * S + C), s.data, (const void *)NULL, p.dtype,
              k.y1, w2, b2, C, S, act2, (float *)NULL);
    launchCheck();
}
static void se_gate_backward_cuda(Ops *o, Tensor dp, Tensor ds, Tensor p, const float *w1,
                                  const float *b1, const float *w2, const float *b2, int S,
                                  Act act1, Act act2, float *dw1, float *db1, float *dw2,
                                  float *db2, int accumulate) {
    const int N = p.shape.n, C = p.shape.c;
    if (!N || (!dp.data && !dw1)) return;
    const SeScratch k = se_scratch(o, N, C, S);
    se_gate_front(o, k, p, w1, b1, S, act1);
    CU_LAUNCH(se_gate_out_kernel, se_gate_out_grid(N, C), BLOCK, sizeof(float) * S, stream_of(o),
              se_traffic(N, C, S, p.dtype, (double)N * (S + C) + C), (void *)NULL, ds.data, p.dtype,
              k.y1, w2, b2, C, S, act2, k.g2);
    launchCheck();
    CU_LAUNCH(se_gate_hidden_backward_kernel, dim3(N, (S + WARP_SIZE - 1) / WARP_SIZE), BLOCK, 0,
              stream_of(o), se_traffic(N, C, S, DT_F32, 2.0 * N * S), k.g1, k.g2, k.z1, w2, C, S,
              act1, p.dtype);
    launchCheck();
    if (dp.data) {
        CU_LAUNCH(se_gate_input_backward_kernel, dim3((C + BLOCK - 1) / BLOCK, N), BLOCK, 0,
                  stream_of(o), se_traffic(N, C, S, dp.dtype, (double)N * S), dp.data, dp.dtype,
                  k.g1, w1, C, S, accumulate);
        launchCheck();
    }
    if (!dw1) return;
    const uint32_t items = 2 * (uint32_t)C * S + C + S;
    // both weight matrices' gradients from p, g1 (N, S), y1 (N, S) and g2 (N, C)
    Traffic m = se_traffic(N, C, S, p.dtype, (double)C * S + 2.0 * N * S + (double)N * C + C + S);
    m.flops *= 2;
    CU_LAUNCH(se_gate_weights_kernel, grid_for(items), BLOCK, 0, stream_of(o), m, k.g2, p.data,
              p.dtype, N, C, S, dw1, db1, dw2, db2, fastdiv_make((uint32_t)S),
              fastdiv_make((uint32_t)C));
    launchCheck();
}

// ----------------------------------------------------------------------------
// residual add

static void add_forward_cuda(Ops *o, Tensor y, Tensor a, Tensor b) {
    map_op(o, y, a, b, 0, Sum2{});
}

// add's backward, the CPU's two copies in one pass over dy: da (=|+=) dy, db (=|+=) dy
__global__ void add_backward_kernel(void *da, DType dta, int acc_a, void *db, DType dtb, int acc_b,
                                    const void *dy, DType dt, size_t n) {
    FOR_CHUNKS(n, base, m) {
        void *a = da ? elem_ptr(da, dta, base) : NULL, *b = db ? elem_ptr(db, dtb, base) : NULL;
        const void *g = elem_ptr(dy, dt, base);
        FOR_GRID(i, m) {
            const float v = ld(g, dt, i);
            if (a) st(a, dta, i, acc_a ? ld(a, dta, i) + v : v);
            if (b) st(b, dtb, i, acc_b ? ld(b, dtb, i) + v : v);
        }
    }
}
template <class T>
__global__ void add_backward_vec_kernel(T *da, int acc_a, T *db, int acc_b, const T *dy,
                                        size_t n_vec) {
    constexpr int N = Vec<T>::N;
    FOR_VEC_CHUNKS(n_vec, N, base, m) {
        T *a = da ? da + base * N : NULL, *b = db ? db + base * N : NULL;
        const T *g = dy + base * N;
        FOR_GRID(i, m) {
            const uint32_t e = vec_elem<N>(i);
            const Vec<T> v = load_vec(g + e);
            for (int which = 0; which < 2; which++) {
                T *y = which ? b : a;
                if (!y) continue;
                Vec<T> out = v;
                if (which ? acc_b : acc_a) {
                    const Vec<T> old = load_vec(y + e);
                    for (int k = 0; k < N; k++)
                        out.v[k] = from_f32<T>(to_f32(old.v[k]) + to_f32(v.v[k]));
                }
                store_vec(y + e, out);
            }
        }
    }
}
static void add_backward_cuda(Ops *o, Tensor da, Tensor db, Tensor dy, int acc_a, int acc_b) {
    const size_t n = shape_numel(dy.shape);
    if (!n || (!da.data && !db.data)) return;
    const DType dta = da.data ? da.dtype : dy.dtype, dtb = db.data ? db.dtype : dy.dtype;
    const Traffic m = moves(bytes_of(dy) + (da.data ? bytes_of(n, dta) : 0.0) +
                            (db.data ? bytes_of(n, dtb) : 0.0));
    if (dta == dy.dtype && dtb == dy.dtype && vec_ok({dy.dtype}, n, {dy.data, da.data, db.data})) {
        SWITCH_STORAGE(dy.dtype, T, {
            CU_LAUNCH(add_backward_vec_kernel<T>, grid_for(n / Vec<T>::N), BLOCK, 0, stream_of(o),
                      m, (T *)da.data, acc_a, (T *)db.data, acc_b, (const T *)dy.data,
                      n / Vec<T>::N);
        });
    } else {
        CU_LAUNCH(add_backward_kernel, grid_for(n), BLOCK, 0, stream_of(o), m, da.data, dta, acc_a,
                  db.data, dtb, acc_b, dy.data, dy.dtype, n);
    }
    launchCheck();
}

// ----------------------------------------------------------------------------
// channel concat
//   y[r, 0:Ca] = a[r, :], y[r, Ca:Ca+Cb] = b[r, :] for every pixel r, and the
//   adjoint, each channel lane reading or writing a or b (fixed per thread)

template <class IO>
__global__ void concat_forward_kernel(IO y, IO a, int Ca, IO b, int Cb, uint32_t rows) {
    constexpr int W = IO::W;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * W, C = Ca + Cb;
    if (c0 >= C) return;
    float v[W];
    FOR_ROWS(r, rows) {
        if (c0 < Ca) a.load(r * Ca + c0, v);
        else b.load(r * Cb + c0 - Ca, v);
        y.store(r * C + c0, v);
    }
}
template <class IO>
__global__ void concat_backward_kernel(IO da, int Ca, int acc_a, IO db, int Cb, int acc_b, IO dy,
                                       uint32_t rows) {
    constexpr int W = IO::W;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * W, C = Ca + Cb;
    if (c0 >= C || (c0 < Ca ? !da.p : !db.p)) return;
    const IO d = c0 < Ca ? da : db;  // a copy: a reference to a parameter goes through the stack
    const int Cd = c0 < Ca ? Ca : Cb, cd = c0 < Ca ? c0 : c0 - Ca, acc = c0 < Ca ? acc_a : acc_b;
    float g[W], old[W];
    FOR_ROWS(r, rows) {
        dy.load(r * C + c0, g);
        if (acc) {
            d.load(r * Cd + cd, old);
            for (int k = 0; k < W; k++) g[k] += old[k];
        }
        d.store(r * Cd + cd, g);
    }
}
// launches over row chunks with the generic or the vector accessors
template <class K> static void concat_launch(Tensor y, Tensor a, Tensor b, K kernel_for) {
    const int Ca = a.shape.c, Cb = b.shape.c, C = Ca + Cb;
    const size_t rows = shape_numel(y.shape) / C;
    const bool vec = vec_ok({y.dtype, a.dtype, b.dtype}, Ca, {y.data, a.data, b.data}) &&
                     Cb % (VEC_BYTES / dtype_size(y.dtype)) == 0;
    for_row_launches(rows, C, [&](size_t r0, size_t count) {
        Tensor yc = tensor(y.data ? elem_ptr(y.data, y.dtype, r0 * C) : NULL, y.shape, y.dtype);
        Tensor ac = tensor(a.data ? elem_ptr(a.data, a.dtype, r0 * Ca) : NULL, a.shape, a.dtype);
        Tensor bc = tensor(b.data ? elem_ptr(b.data, b.dtype, r0 * Cb) : NULL, b.shape, b.dtype);
        const double bytes = (y.data ? bytes_of(count * C, y.dtype) : 0.0) +
                             (a.data ? bytes_of(count * Ca, a.dtype) : 0.0) +
                             (b.data ? bytes_of(count * Cb, b.dtype) : 0.0);
        if (vec) {
            SWITCH_STORAGE(y.dtype, T, {
                RowGrid g = row_grid(C / Vec<T>::N, count);
                kernel_for(g, VecIO<T>::of(yc), VecIO<T>::of(ac), VecIO<T>::of(bc), (uint32_t)count,
                           bytes);
            });
        } else {
            RowGrid g = row_grid(C, count);
            kernel_for(g, AnyIO::of(yc), AnyIO::of(ac), AnyIO::of(bc), (uint32_t)count, bytes);
        }
        launchCheck();
    });
}
static void concat_forward_cuda(Ops *o, Tensor y, Tensor a, Tensor b) {
    if (!shape_numel(y.shape)) return;
    const int Ca = a.shape.c, Cb = b.shape.c;
    concat_launch(y, a, b,
                  [&](RowGrid g, auto yio, auto aio, auto bio, uint32_t rows, double bytes) {
                      CU_LAUNCH(concat_forward_kernel<decltype(yio)>, g.grid, g.block, 0,
                                stream_of(o), moves(bytes), yio, aio, Ca, bio, Cb, rows);
                  });
}
static void concat_backward_cuda(Ops *o, Tensor da, Tensor db, Tensor dy, int accumulate_a,
                                 int accumulate_b) {
    if (!shape_numel(dy.shape) || (!da.data && !db.data)) return;
    const int Ca = da.shape.c, Cb = db.shape.c;
    concat_launch(dy, da, db,
                  [&](RowGrid g, auto dyio, auto daio, auto dbio, uint32_t rows, double bytes) {
                      CU_LAUNCH(concat_backward_kernel<decltype(dyio)>, g.grid, g.block, 0,
                                stream_of(o), moves(bytes), daio, Ca, accumulate_a, dbio, Cb,
                                accumulate_b, dyio, rows);
                  });
}

// ----------------------------------------------------------------------------
// dropout and drop-path
//   keep_i = rng_uniform(seed, i / per_draw) >= rate, per_draw 1 (dropout: the
//   element index) or H·W·C (drop-path: the sample index), as on the CPU, so the
//   masks are the same bits; out (=|+=) in·keep/(1 - rate)

// A residual block's end, out = y·keep + residual, rounded once (one FMA),
// in the two dropout kernels and in batch norm's fused residual end
// (ResidualEnd), which must give the same bits ("bit-equal paths", above).
static __device__ __forceinline__ float dropout_residual_end(float y, float keep, float residual) {
    return __fmaf_rn(y, keep, residual);
}

// grid: (element blocks, samples); element i of sample blockIdx.y of this
// launch, whose first sample is the step's `first_sample`. Forward: out = in·keep
// (+ res, a residual block's end); backward: out (=|+=) in·keep, res (=|+=) in
// (out or res may be absent there).
__global__ void dropout_kernel(void *out, DType dt_out, const void *in, DType dt_in, void *res,
                               DType dt_res, int backward, uint32_t E, int per_sample, float rate,
                               const uint64_t *seed_at, uint64_t first_sample, int accumulate,
                               int accumulate_res) {
    const uint64_t sample = first_sample + blockIdx.y, seed = *seed_at;
    void *y = out ? elem_ptr(out, dt_out, (size_t)blockIdx.y * E) : NULL;
    void *r = res ? elem_ptr(res, dt_res, (size_t)blockIdx.y * E) : NULL;
    const void *x = elem_ptr(in, dt_in, (size_t)blockIdx.y * E);
    FOR_GRID(i, E) {
        const float xi = ld(x, dt_in, i);
        const float keep = dropout_keep(rate, seed, per_sample ? sample : sample * E + i);
        const float v = r && !backward ? dropout_residual_end(xi, keep, ld(r, dt_res, i))
                                       : __fmul_rn(xi, keep);
        if (y) st(y, dt_out, i, accumulate ? __fadd_rn(ld(y, dt_out, i), v) : v);
        if (r && backward) st(r, dt_res, i, accumulate_res ? ld(r, dt_res, i) + xi : xi);
    }
}
template <class T>
__global__ void dropout_vec_kernel(T *out, const T *in, T *res, int backward, uint32_t E,
                                   int per_sample, float rate, const uint64_t *seed_at,
                                   uint64_t first_sample, int accumulate, int accumulate_res) {
    constexpr int N = Vec<T>::N;
    const uint64_t sample = first_sample + blockIdx.y, seed = *seed_at;
    T *y = out ? out + (size_t)blockIdx.y * E : NULL,
      *r = res ? res + (size_t)blockIdx.y * E : NULL;
    const T *x = in + (size_t)blockIdx.y * E;
    const float keep_sample = per_sample ? dropout_keep(rate, seed, sample) : 0.0f;
    FOR_GRID(j, E / N) {
        Vec<T> vx = load_vec(x + j * N), vy, vr;
        if (y && accumulate) vy = load_vec(y + j * N);
        if (r && (!backward || accumulate_res)) vr = load_vec(r + j * N);
        for (int k = 0; k < N; k++) {
            const uint32_t i = j * N + k;
            const float xi = to_f32(vx.v[k]);
            const float keep = per_sample ? keep_sample : dropout_keep(rate, seed, sample * E + i);
            const float v = r && !backward ? dropout_residual_end(xi, keep, to_f32(vr.v[k]))
                                           : __fmul_rn(xi, keep);
            if (y) vy.v[k] = from_f32<T>(accumulate ? __fadd_rn(to_f32(vy.v[k]), v) : v);
            if (r && backward) vr.v[k] = from_f32<T>(accumulate_res ? to_f32(vr.v[k]) + xi : xi);
        }
        if (y) store_vec(y + j * N, vy);
        if (r && backward) store_vec(r + j * N, vr);
    }
}
// element i of sample n of the tensor is element (first_sample + n)·E + i of the
// step (E = H·W·C), whose draw is that index (dropout) or first_sample + n (drop-path);
// seed: device memory
static void dropout(Ops *o, Tensor out, Tensor in, Tensor res, int backward, float rate,
                    const uint64_t *seed, int per_sample, uint64_t first_sample, int accumulate,
                    int accumulate_res) {
    const size_t n = shape_numel(in.shape);
    if (!n || (!out.data && !res.data)) return;
    const size_t E = n / in.shape.n;
    require_below(E, LAUNCH_MAX_ELEMENTS, "dropout elements per sample");
    const unsigned blocks = grid_for(E) / 8 + 1;  // × samples: enough blocks for a GPU
    const DType dt_out = out.data ? out.dtype : in.dtype, dt_res = res.data ? res.dtype : in.dtype;
    const bool vec = dt_out == in.dtype && dt_res == in.dtype &&
                     vec_ok({in.dtype}, E, {out.data, in.data, res.data});
    for (int n0 = 0; n0 < in.shape.n; n0 += 65535) {  // gridDim.y ≤ 65535
        const int count = in.shape.n - n0 < 65535 ? in.shape.n - n0 : 65535;
        const dim3 grid(blocks, count);
        void *y = out.data ? elem_ptr(out.data, dt_out, (size_t)n0 * E) : NULL;
        void *r = res.data ? elem_ptr(res.data, dt_res, (size_t)n0 * E) : NULL;
        const void *x = elem_ptr(in.data, in.dtype, (size_t)n0 * E);
        const size_t e = (size_t)count * E;
        const Traffic m = moves(bytes_of(e, in.dtype) + (y ? bytes_of(e, dt_out) : 0.0) +
                                (r ? bytes_of(e, dt_res) : 0.0));
        if (vec) {
            SWITCH_STORAGE(in.dtype, T, {
                CU_LAUNCH(dropout_vec_kernel<T>, grid, BLOCK, 0, stream_of(o), m, (T *)y,
                          (const T *)x, (T *)r, backward, (uint32_t)E, per_sample, rate, seed,
                          first_sample + n0, accumulate, accumulate_res);
            });
        } else {
            CU_LAUNCH(dropout_kernel, grid, BLOCK, 0, stream_of(o), m, y, dt_out, x, in.dtype, r,
                      dt_res, backward, (uint32_t)E, per_sample, rate, seed, first_sample + n0,
                      accumulate, accumulate_res);
        }
        launchCheck();
    }
}
static void dropout_forward_cuda(Ops *o, Tensor y, Tensor x, Tensor residual, float rate,
                                 const uint64_t *seed, int per_sample, uint64_t first_sample) {
    dropout(o, y, x, residual, 0, rate, seed, per_sample, first_sample, 0, 0);
}
static void dropout_backward_cuda(Ops *o, Tensor dx, Tensor dresidual, Tensor dy, float rate,
                                  const uint64_t *seed, int per_sample, uint64_t first_sample,
                                  int accumulate, int accumulate_residual) {
    dropout(o, dx, dy, dresidual, 1, rate, seed, per_sample, first_sample, accumulate,
            accumulate_residual);
}

// ----------------------------------------------------------------------------
// pooling and resampling (the thread layout: image rows, above)

// y[n,oy,ox,c] = max_{dy,dx ∈ {0,1}} x[n, 2·oy + dy, 2·ox + dx, c]; ties and NaN
// as the CPU: the first maximum of the window in row-major order (strict >)
template <class IO>
__global__ void maxpool2_forward_kernel(IO y, Shape t, IO x, Shape s) {
    constexpr int W = IO::W;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * W;
    if (c0 >= t.c) return;
    const ImageRow row = image_row(blockIdx.z, t.h);
    FOR_COLUMNS(ox, t.w) {
        float m[W], v[W];
        for (int k = 0; k < W; k++) m[k] = -INFINITY;
        for (int q = 0; q < 4; q++) {
            x.load(nhwc_at(s, row.n, 2 * row.y + q / 2, 2 * ox + q % 2, c0), v);
            for (int k = 0; k < W; k++)
                if (v[k] > m[k]) m[k] = v[k];
        }
        y.store(nhwc_at(t, row.n, row.y, ox, c0), m);
    }
}
static void maxpool2_forward_cuda(Ops *o, Tensor y, Tensor x) {
    if (!shape_numel(y.shape)) return;
    image_rows_launch(y, x, NO_TENSOR,
                      [&](RowGrid g, auto yio, auto xio, auto, Shape t, Shape s, double bytes) {
                          CU_LAUNCH(maxpool2_forward_kernel<decltype(yio)>, g.grid, g.block, 0,
                                    stream_of(o), moves(bytes), yio, t, xio, s);
                      });
}

// dx gets dy of its window where it is the window's first maximum, else 0 (also
// in the row/column past the floor)
template <class IO>
__global__ void maxpool2_backward_kernel(IO dx, Shape s, IO dy, Shape t, IO x, int accumulate) {
    constexpr int W = IO::W;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * W;
    if (c0 >= s.c) return;
    const ImageRow row = image_row(blockIdx.z, s.h);
    const int iy = row.y, oy = iy / 2;
    FOR_COLUMNS(ix, s.w) {
        const int ox = ix / 2, mine = (iy - 2 * oy) * 2 + (ix - 2 * ox);
        float g[W];
        for (int k = 0; k < W; k++) g[k] = 0.0f;
        if (oy < t.h && ox < t.w) {
            float m[W], v[W], d[W];
            int first[W];
            for (int k = 0; k < W; k++) { m[k] = -INFINITY; first[k] = 0; }
            for (int q = 0; q < 4; q++) {
                x.load(nhwc_at(s, row.n, 2 * oy + q / 2, 2 * ox + q % 2, c0), v);
                for (int k = 0; k < W; k++)
                    if (v[k] > m[k]) { m[k] = v[k]; first[k] = q; }
            }
            dy.load(nhwc_at(t, row.n, oy, ox, c0), d);
            for (int k = 0; k < W; k++)
                if (first[k] == mine) g[k] = d[k];
        }
        store_acc(dx, nhwc_at(s, row.n, iy, ix, c0), g, accumulate);
    }
}
static void maxpool2_backward_cuda(Ops *o, Tensor dx, Tensor dy, Tensor x, int accumulate) {
    if (!shape_numel(x.shape) || !dx.data) return;
    image_rows_launch(
            dx, dy, x,
            [&](RowGrid g, auto dxio, auto dyio, auto xio, Shape s, Shape t, double bytes) {
                CU_LAUNCH(maxpool2_backward_kernel<decltype(dxio)>, g.grid, g.block, 0,
                          stream_of(o), moves(bytes), dxio, s, dyio, t, xio, accumulate);
            });
}

// y[n,oy,ox,c] = x[n, oy/2, ox/2, c]
template <class IO>
__global__ void upsample2_forward_kernel(IO y, Shape t, IO x, Shape s) {
    constexpr int W = IO::W;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * W;
    if (c0 >= t.c) return;
    const ImageRow row = image_row(blockIdx.z, t.h);
    float v[W];
    FOR_COLUMNS(ox, t.w) {
        x.load(nhwc_at(s, row.n, row.y / 2, ox / 2, c0), v);
        y.store(nhwc_at(t, row.n, row.y, ox, c0), v);
    }
}
static void upsample2_forward_cuda(Ops *o, Tensor y, Tensor x) {
    if (!shape_numel(y.shape)) return;
    image_rows_launch(y, x, NO_TENSOR,
                      [&](RowGrid g, auto yio, auto xio, auto, Shape t, Shape s, double bytes) {
                          CU_LAUNCH(upsample2_forward_kernel<decltype(yio)>, g.grid, g.block, 0,
                                    stream_of(o), moves(bytes), yio, t, xio, s);
                      });
}

// dx[n,iy,ix,c] = Σ of the 2×2 dy it was copied to, in row-major order
template <class IO>
__global__ void upsample2_backward_kernel(IO dx, Shape s, IO dy, Shape t, int accumulate) {
    constexpr int W = IO::W;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * W;
    if (c0 >= s.c) return;
    const ImageRow row = image_row(blockIdx.z, s.h);
    FOR_COLUMNS(ix, s.w) {
        float g[W], v[W];
        for (int k = 0; k < W; k++) g[k] = 0.0f;
        for (int q = 0; q < 4; q++) {
            dy.load(nhwc_at(t, row.n, 2 * row.y + q / 2, 2 * ix + q % 2, c0), v);
            for (int k = 0; k < W; k++) g[k] += v[k];
        }
        store_acc(dx, nhwc_at(s, row.n, row.y, ix, c0), g, accumulate);
    }
}
// 4 channels a thread (NarrowIO): a thread per pixel of dx, a quarter of dy's,
// so 16-byte vectors would leave too few threads to fill the GPU's waves
static void upsample2_backward_cuda(Ops *o, Tensor dx, Tensor dy, int accumulate) {
    if (!shape_numel(dx.shape) || !dx.data) return;
    image_rows_launch<true>(
            dx, dy, NO_TENSOR,
            [&](RowGrid g, auto dxio, auto dyio, auto, Shape s, Shape t, double bytes) {
                CU_LAUNCH(upsample2_backward_kernel<decltype(dxio)>, g.grid, g.block, 0,
                          stream_of(o), moves(bytes), dxio, s, dyio, t, accumulate);
            });
}

// bilinear with half-pixel centres (the taps of segnet.h):
//   y = (1-λy)·((1-λx)·x00 + λx·x01) + λy·((1-λx)·x10 + λx·x11)
template <class IO>
__global__ void resize_bilinear_forward_kernel(IO y, Shape t, IO x, Shape s) {
    constexpr int W = IO::W;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * W;
    if (c0 >= t.c) return;
    const ImageRow row = image_row(blockIdx.z, t.h);
    const BilinearTap ty = bilinear_tap(row.y, s.h, t.h);
    FOR_COLUMNS(ox, t.w) {
        const BilinearTap tx = bilinear_tap(ox, s.w, t.w);
        float x00[W], x01[W], x10[W], x11[W], out[W];
        x.load(nhwc_at(s, row.n, ty.i0, tx.i0, c0), x00);
        x.load(nhwc_at(s, row.n, ty.i0, tx.i1, c0), x01);
        x.load(nhwc_at(s, row.n, ty.i1, tx.i0, c0), x10);
        x.load(nhwc_at(s, row.n, ty.i1, tx.i1, c0), x11);
        for (int k = 0; k < W; k++) {
            out[k] = bilinear_mix(ty, tx, x00[k], x01[k], x10[k], x11[k]);
        }
        y.store(nhwc_at(t, row.n, row.y, ox, c0), out);
    }
}
static void resize_bilinear_forward_cuda(Ops *o, Tensor y, Tensor x) {
    if (!shape_numel(y.shape)) return;
    image_rows_launch(y, x, NO_TENSOR,
                      [&](RowGrid g, auto yio, auto xio, auto, Shape t, Shape s, double bytes) {
                          CU_LAUNCH(resize_bilinear_forward_kernel<decltype(yio)>, g.grid, g.block,
                                    0, stream_of(o), moves(bytes), yio, t, xio, s);
                      });
}

// The adjoint as a gather, as on the CPU (same outputs, same order):
//   dx[n,iy,ix,c] (=|+=) Σ_{oy,ox} wy(oy,iy)·wx(ox,ix)·dy[n,oy,ox,c]
template <class IO>
__global__ void resize_bilinear_backward_kernel(IO dx, Shape s, IO dy, Shape t, int accumulate) {
    constexpr int W = IO::W;
    const int c0 = (blockIdx.x * blockDim.x + threadIdx.x) * W;
    if (c0 >= s.c) return;
    const ImageRow row = image_row(blockIdx.z, s.h);
    const int iy = row.y;
    int oy0, oy1;
    tap_range(iy, s.h, t.h, &oy0, &oy1);
    FOR_COLUMNS(ix, s.w) {
        int ox0, ox1;
        tap_range(ix, s.w, t.w, &ox0, &ox1);
        float g[W], v[W];
        for (int k = 0; k < W; k++) g[k] = 0.0f;
        for (int oy = oy0; oy <= oy1; oy++) {
            const float wy = tap_weight(bilinear_tap(oy, s.h, t.h), iy);
            if (wy == 0.0f) continue;
            for (int ox = ox0; ox <= ox1; ox++) {
                const float wx = tap_weight(bilinear_tap(ox, s.w, t.w), ix);
                if (wx == 0.0f) continue;
                dy.load(nhwc_at(t, row.n, oy, ox, c0), v);
                for (int k = 0; k < W; k++) g[k] += wy * wx * v[k];
            }
        }
        store_acc(dx, nhwc_at(s, row.n, iy, ix, c0), g, accumulate);
    }
}
static void resize_bilinear_backward_cuda(Ops *o, Tensor dx, Tensor dy, int accumulate) {
    if (!shape_numel(dx.shape) || !dx.data) return;
    image_rows_launch(dx, dy, NO_TENSOR,
                      [&](RowGrid g, auto dxio, auto dyio, auto, Shape s, Shape t, double bytes) {
                          CU_LAUNCH(resize_bilinear_backward_kernel<decltype(dxio)>, g.grid,
                                    g.block, 0, stream_of(o), moves(bytes), dxio, s, dyio, t,
                                    accumulate);
                      });
}
