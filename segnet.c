// segnet.c -- the one readable C file: the math of every op, the models, the
// training step, how the CPU makes them fast, and the plumbing around them.
//
// The CPU ops are the specification every other backend is tested against.
// Each op states its formula above it; index math uses NHWC:
//   x[n,h,w,c] = data[((n·H + h)·W + w)·C + c]
//
// Contents, in file order (each part opens with a `// ====` banner, each
// section within it with a `// ----` one):
//   I.   The math        element access in any storage type; memory and the
//                        vector ops; conv2d; activations; squeeze-excitation;
//                        add, concat; dropout and drop-path; pooling and
//                        resampling; batch norm (with the layer after it);
//                        softmax + weighted cross-entropy; Adam; metrics and
//                        learning-rate schedules; the reference table ops_ref
//   II.  The models      the graph's builders; EfficientNetV2 and the U-Nets;
//                        initial weights
//   III. The step        memory planning (with recompute); fusing layers; the
//                        executor (layer_forward, layer_backward); the training
//                        step (train_step, its work in numbered steps)
//   IV.  Making it fast  the direct and GEMM convolutions, batch norm in fp32
//                        passes with exp_vec, the squeeze-excitation pieces,
//                        pooling, upsampling, concat and the elementwise ops
//                        in fp32; ops_cpu = ops_ref with those; choosing a backend
//   V.   Plumbing        safetensors; weights by name; images and prediction;
//                        data sets; curves.svg; replicas' communicators; the
//                        training run (passes, checkpoints, metrics.csv,
//                        resume); benchmark; the command line
//
// Math index (formula → where it is computed; segnet.h holds what both
// backends must agree on bit for bit):
//   conv out = Σ w·in (+ b), SAME / symmetric padding   conv2d_forward_ref, conv_axis (segnet.h)
//   conv gradients dx, dw, db                           conv2d_backward_data_ref, conv2d_backward_weight_ref
//   batch norm statistics mean, var (biased, fp64 sums) bn_stats_ref, bn_moments_stats (segnet.h)
//   batch norm y = act(γ·(x − mean)/√(var + ε) + β)    bn_forward_ref; running statistics bn_update_running_ref
//   batch norm backward Σg, Σg·x̂, then dx              bn_backward_reduce_ref, bn_backward_data_ref
//   ReLU, SiLU, sigmoid and their derivatives           act_apply, act_grad (segnet.h)
//   squeeze-excitation gate s = σ(W2·SiLU(W1·p + b1) + b2)  se_gate_forward (segnet.h), se_gate_images
//   global average pool, channel scale                  global_avg_pool_forward_ref, channel_scale_forward_ref
//   dropout / drop-path keep = u ≥ rate, ×1/(1 − rate)  dropout_keep (segnet.h), dropout_forward_ref
//   max-pool, nearest and bilinear resampling           maxpool2_forward_ref, upsample2_forward_ref, bilinear_tap (segnet.h)
//   softmax + weighted cross-entropy, Keras' clip        softmax_xent_ref; its normaliser Σw label_weight_sum
//   Adam (Keras' ε̂), decoupled weight decay             AdamStep (segnet.h), adam_step_init, adam_update_ref
//   loss scaling, global-norm clipping                   step_control_apply, clip_factor (segnet.h)
//   learning-rate schedules with warm-up                 lr_at_step
//   IoU = TP/(TP + FP + FN), mean IoU, accuracy          metrics_compute
//   buffer lifetimes and offsets                         plan_build, plan_pack
//   one optimiser step                                   train_step, step_work
#define _GNU_SOURCE  // qsort_r
#include <stdio.h>
#include <stdlib.h>
#include <stdarg.h>
#include <string.h>
#include <math.h>
#include <errno.h>
#include <ctype.h>
#include <float.h>
#include <fcntl.h>
#include <inttypes.h>
#include <limits.h>
#include <dirent.h>
#include <strings.h>
#include <sys/stat.h>
#include <sys/file.h>
#include <signal.h>
#include <sys/resource.h>
#include <time.h>
#include <unistd.h>
#include <cblas.h>
#include <pthread.h>
#include <stb_image.h>  // Debian libstb-dev: declarations; the implementation is libstb.so
#include <stb_image_write.h>
#ifdef _OPENMP
#include <omp.h>
#endif
#ifdef SEGNET_MPI
#include <mpi.h>
#endif
#include "segnet.h"

// ============================================================================
// PART I. THE MATH
// Per op its formula, then a straightforward reference forward and backward:
// any storage type, reductions in fp64 in the formula's order. Together they
// are the table ops_ref at the end of the part, which runs a whole training step.
// ============================================================================

// ----------------------------------------------------------------------------
// checks for programming errors (conditions a user cannot cause: a user's bad
// shapes are refused by the graph builders with a message naming the layer)

static void fail_internal(const char *file, int line, const char *fmt, ...) {
    va_list ap;
    fprintf(stderr, "segnet: internal error at %s:%d: ", file, line);
    va_start(ap, fmt);
    vfprintf(stderr, fmt, ap);
    va_end(ap);
    fputc('\n', stderr);
    exit(70);
}
#define snCheck(cond, ...) do { if (!(cond)) fail_internal(__FILE__, __LINE__, __VA_ARGS__); } while (0)
#define SHAPE_FMT "(%d,%d,%d,%d)"
#define SHAPE_ARGS(s) (s).n, (s).h, (s).w, (s).c

static int shape_eq(Shape a, Shape b) { return a.n == b.n && a.h == b.h && a.w == b.w && a.c == b.c; }

// Loops with less work than this run on one thread: opening a parallel region
// costs microseconds, and a scheduler time slice per region when the cores are
// shared with other work (tiny ops would then take 1000× longer).
// (A variable so that the tests can force every loop onto the parallel path.)
static size_t omp_min_work __attribute__((unused)) = 32768;
#define PAR(work) ((size_t)(work) >= omp_min_work)

// ----------------------------------------------------------------------------
// element access in any storage type: loads give fp32, stores round

static inline float ld(Tensor t, size_t i) {
    switch (t.dtype) {
    case DT_F16: return f16_to_f32(((const uint16_t *)t.data)[i]);
    case DT_BF16: return bf16_to_f32(((const uint16_t *)t.data)[i]);
    default: return ((const float *)t.data)[i];
    }
}
static inline void st(Tensor t, size_t i, float v) {
    switch (t.dtype) {
    case DT_F16: ((uint16_t *)t.data)[i] = f32_to_f16(v); break;
    case DT_BF16: ((uint16_t *)t.data)[i] = f32_to_bf16(v); break;
    default: ((float *)t.data)[i] = v;
    }
}
// store or accumulate (the `accumulate` convention of the ops table)
static inline void st_acc(Tensor t, size_t i, float v, int accumulate) {
    st(t, i, accumulate ? ld(t, i) + v : v);
}

// Runs of n consecutive elements from element i: the storage type is resolved
// once per run, so each loop is a plain conversion the compiler vectorises.
// _Float16 is IEEE binary16 with round-to-nearest-even (F16C instructions with
// -march=native), the same bits as f32_to_f16 / f16_to_f32 (test fp16_runs).
static void ld_run(Tensor t, size_t i, float *dst, size_t n) {
    if (t.dtype == DT_F32) {
        memcpy(dst, (const float *)t.data + i, sizeof(float) * n);
    } else if (t.dtype == DT_BF16) {
        const uint16_t *s = (const uint16_t *)t.data + i;
        for (size_t k = 0; k < n; k++) dst[k] = bits_f32((uint32_t)s[k] << 16);
    } else {
        const _Float16 *s = (const _Float16 *)t.data + i;
        for (size_t k = 0; k < n; k++) dst[k] = (float)s[k];
    }
}
static void st_run(Tensor t, size_t i, const float *src, size_t n, int accumulate) {
    if (t.dtype == DT_F32) {
        float *d = (float *)t.data + i;
        if (accumulate) for (size_t k = 0; k < n; k++) d[k] += src[k];
        else memcpy(d, src, sizeof(float) * n);
    } else if (t.dtype == DT_BF16) {
        uint16_t *d = (uint16_t *)t.data + i;
        for (size_t k = 0; k < n; k++) {
            float v = accumulate ? bits_f32((uint32_t)d[k] << 16) + src[k] : src[k];
            d[k] = f32_to_bf16(v);
        }
    } else {
        _Float16 *d = (_Float16 *)t.data + i;
        for (size_t k = 0; k < n; k++) d[k] = (_Float16)(accumulate ? (float)d[k] + src[k] : src[k]);
    }
}

// n values from element i as fp32: a pointer into t when it is fp32, else
// converted into tmp (the fast paths' way to read any storage type)
static inline const float *ld_view(Tensor t, size_t i, float *tmp, size_t n) {
    if (t.dtype == DT_F32) return (const float *)t.data + i;
    ld_run(t, i, tmp, n);
    return tmp;
}

// ----------------------------------------------------------------------------
// memory and utilities (the CPU's "device" memory is host memory)

// The backend counts the bytes it hands out (a header before each block holds
// the size), so that a run's memory can be compared with its plan.
#define CPU_ALLOC_HEADER 64
size_t cpu_bytes_live, cpu_bytes_peak;
static void *cpu_alloc(Ops *o, size_t bytes) {
    (void)o;
    uint8_t *p = malloc(CPU_ALLOC_HEADER + (bytes ? bytes : 1));
    if (!p) return NULL;
    memcpy(p, &bytes, sizeof bytes);
    cpu_bytes_live += bytes;
    if (cpu_bytes_live > cpu_bytes_peak) cpu_bytes_peak = cpu_bytes_live;
    return p + CPU_ALLOC_HEADER;
}
static void cpu_free(Ops *o, void *p) {
    (void)o;
    if (!p) return;
    uint8_t *base = (uint8_t *)p - CPU_ALLOC_HEADER;
    size_t bytes;
    memcpy(&bytes, base, sizeof bytes);
    cpu_bytes_live -= bytes;
    free(base);
}
static void cpu_memcpy(Ops *o, void *dst, const void *src, size_t bytes) { (void)o; memcpy(dst, src, bytes); }
static void cpu_synchronize(Ops *o) { (void)o; }
static void *cpu_host_alloc(Ops *o, size_t bytes) { (void)o; return malloc(bytes ? bytes : 1); }
static void cpu_host_free(Ops *o, void *p) { (void)o; free(p); }
static void step_control_ref(Ops *o, const StepArgs *a, StepState *s, StepPhase phase) {
    (void)o;
    step_control_apply(a, s, phase);
}

static void fill_ref(Ops *o, Tensor t, float value) {
    (void)o;
    size_t n = shape_numel(t.shape);
    #pragma omp parallel for schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) st(t, i, value);
}

static void scale_ref(Ops *o, Tensor t, float a) {
    (void)o;
    size_t n = shape_numel(t.shape);
    #pragma omp parallel for schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) st(t, i, a * ld(t, i));
}

static void axpby_ref(Ops *o, Tensor y, Tensor x, float a, float b, int accumulate) {
    (void)o;
    size_t n = shape_numel(x.shape);
    #pragma omp parallel for schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) st_acc(y, i, a * ld(x, i) + b, accumulate);
}

static void copy_ref(Ops *o, Tensor dst, Tensor src, int accumulate) {
    (void)o;
    size_t n = shape_numel(src.shape);
    snCheck(shape_numel(dst.shape) == n, "copy: dst " SHAPE_FMT " src " SHAPE_FMT, SHAPE_ARGS(dst.shape), SHAPE_ARGS(src.shape));
    #pragma omp parallel for schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) st_acc(dst, i, ld(src, i), accumulate);
}

// Deterministic sums over long buffers: fixed chunks summed in fp64 in
// parallel, the partials added in chunk order, so the result does not depend
// on the thread count (recompute ≡ store, replicas ≡ one device).
#define SUM_CHUNK  65536
#define SUM_GROUP  256

static void sum_squares_ref(Ops *o, Tensor t, float *out) {
    (void)o;
    size_t n = shape_numel(t.shape), n_chunks = (n + SUM_CHUNK - 1) / SUM_CHUNK;
    double total = 0.0;
    for (size_t g0 = 0; g0 < n_chunks; g0 += SUM_GROUP) {
        double part[SUM_GROUP];
        size_t g1 = g0 + SUM_GROUP < n_chunks ? g0 + SUM_GROUP : n_chunks;
        #pragma omp parallel for schedule(static) if(PAR(n))
        for (size_t k = g0; k < g1; k++) {
            size_t i0 = k * SUM_CHUNK, i1 = i0 + SUM_CHUNK < n ? i0 + SUM_CHUNK : n;
            double s = 0.0;
            for (size_t i = i0; i < i1; i++) { double v = ld(t, i); s += v * v; }
            part[k - g0] = s;
        }
        for (size_t k = g0; k < g1; k++) total += part[k - g0];
    }
    *out = (float)total;
}

static void nonfinite_ref(Ops *o, Tensor t, int32_t *flag) {
    (void)o;
    size_t n = shape_numel(t.shape);
    int bad = 0;
    #pragma omp parallel for schedule(static) reduction(|:bad) if(PAR(n))
    for (size_t i = 0; i < n; i++) bad |= !isfinite(ld(t, i));
    if (bad) *flag = 1;
}

static double now_seconds(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// ----------------------------------------------------------------------------
// conv2d
//
// out[n,oy,ox,co] = b[co] + Σ_{ky,kx,ci} x[n, oy·s - pt + ky, ox·s - pl + kx, g·Cg + ci]
//                                      · w[co][ky][kx][ci]
// with g = co / (Cout/groups) the group of co, Cg = Cin/groups, x = 0 outside
// the input, and (pt, pl) the padding before (conv_axis in segnet.h).
//   din[n,iy,ix,ci] = Σ over the (oy, ox, ky, kx, co) that read it of dout[n,oy,ox,co]·w[co][ky][kx][ci]
//   dw[co][ky][kx][ci] += Σ_{n,oy,ox} dout[n,oy,ox,co]·x[n, oy·s - pt + ky, ox·s - pl + kx, g·Cg + ci]
//   db[co] += Σ_{n,oy,ox} dout[n,oy,ox,co]
// The references below compute each output value as one fp64 sum in the
// formula's order, in any storage type; part IV's direct convolutions and
// GEMMs compute the same in fp32 blocks.

// input pixel of output oy (stride s, tap ky, padding pt), or -1 outside
static inline int conv_tap(int o, int s, int k, int pad, int in) {
    const int i = o * s + k - pad;
    return i >= 0 && i < in ? i : -1;
}
static void conv2d_forward_ref(Ops *o, const ConvCfg *cfg, Tensor out, Tensor in, const float *w,
                               const void *w_cast, const float *b, void *ws) {
    (void)o; (void)w_cast; (void)ws;
    ConvGeom q;
    snCheck(conv_geom_of(cfg, in.shape, &q), "conv2d_forward_ref: input " SHAPE_FMT " does not fit", SHAPE_ARGS(in.shape));
    const int K = cfg->kh, L = cfg->kw;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(out.shape) * q.K))
    for (int row = 0; row < q.N * q.OH; row++) {
        const int n = row / q.OH, oy = row % q.OH;
        for (int ox = 0; ox < q.OW; ox++)
            for (int co = 0; co < q.Cout; co++) {
                const int c0 = co / q.Coutg * q.Cg;  // the group's first input channel
                double acc = b ? b[co] : 0.0;
                for (int ky = 0; ky < K; ky++) {
                    const int iy = conv_tap(oy, cfg->stride, ky, q.pt, q.H);
                    for (int kx = 0; iy >= 0 && kx < L; kx++) {
                        const int ix = conv_tap(ox, cfg->stride, kx, q.pl, q.W);
                        for (int ci = 0; ix >= 0 && ci < q.Cg; ci++)
                            acc += (double)w[((size_t)(co * K + ky) * L + kx) * q.Cg + ci] *
                                   ld(in, (((size_t)n * q.H + iy) * q.W + ix) * q.C + c0 + ci);
                    }
                }
                st(out, (((size_t)n * q.OH + oy) * q.OW + ox) * q.Cout + co, (float)acc);
            }
    }
}
// din[n,iy,ix,ci] (=|+=) Σ over the outputs that read it
static void conv2d_backward_data_ref(Ops *o, const ConvCfg *cfg, Tensor din, Tensor dout, const float *w,
                                     const void *w_cast, int accumulate, void *ws) {
    (void)o; (void)w_cast; (void)ws;
    ConvGeom q;
    snCheck(conv_geom_of(cfg, din.shape, &q), "conv2d_backward_data_ref: input " SHAPE_FMT " does not fit",
            SHAPE_ARGS(din.shape));
    const int K = cfg->kh, L = cfg->kw, s = cfg->stride;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(din.shape) * q.K))
    for (int row = 0; row < q.N * q.H; row++) {
        const int n = row / q.H, iy = row % q.H;
        for (int ix = 0; ix < q.W; ix++)
            for (int c = 0; c < q.C; c++) {
                const int grp = c / q.Cg, ci = c % q.Cg;
                double acc = 0.0;
                for (int ky = 0; ky < K; ky++) {
                    const int ty = iy + q.pt - ky;  // = oy·s
                    if (ty < 0 || ty % s || ty / s >= q.OH) continue;
                    for (int kx = 0; kx < L; kx++) {
                        const int tx = ix + q.pl - kx;
                        if (tx < 0 || tx % s || tx / s >= q.OW) continue;
                        for (int j = 0; j < q.Coutg; j++) {
                            const int co = grp * q.Coutg + j;
                            acc += (double)w[((size_t)(co * K + ky) * L + kx) * q.Cg + ci] *
                                   ld(dout, (((size_t)n * q.OH + ty / s) * q.OW + tx / s) * q.Cout + co);
                        }
                    }
                }
                st_acc(din, (((size_t)n * q.H + iy) * q.W + ix) * q.C + c, (float)acc, accumulate);
            }
    }
}
// dw[co,ky,kx,ci] += Σ_{n,oy,ox} dout·in, db[co] += Σ dout
static void conv2d_backward_weight_ref(Ops *o, const ConvCfg *cfg, float *dw, float *db, Tensor dout, Tensor in,
                                       void *ws) {
    (void)o; (void)ws;
    ConvGeom q;
    snCheck(conv_geom_of(cfg, in.shape, &q), "conv2d_backward_weight_ref: input " SHAPE_FMT " does not fit",
            SHAPE_ARGS(in.shape));
    const int K = cfg->kh, L = cfg->kw;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(dout.shape) * q.K))
    for (int co = 0; co < q.Cout; co++) {
        const int c0 = co / q.Coutg * q.Cg;
        for (int ky = 0; dw && ky < K; ky++)
            for (int kx = 0; kx < L; kx++)
                for (int ci = 0; ci < q.Cg; ci++) {
                    double acc = 0.0;
                    for (int n = 0; n < q.N; n++)
                        for (int oy = 0; oy < q.OH; oy++) {
                            const int iy = conv_tap(oy, cfg->stride, ky, q.pt, q.H);
                            for (int ox = 0; iy >= 0 && ox < q.OW; ox++) {
                                const int ix = conv_tap(ox, cfg->stride, kx, q.pl, q.W);
                                if (ix >= 0)
                                    acc += (double)ld(dout, (((size_t)n * q.OH + oy) * q.OW + ox) * q.Cout + co) *
                                           ld(in, (((size_t)n * q.H + iy) * q.W + ix) * q.C + c0 + ci);
                            }
                        }
                    dw[((size_t)(co * K + ky) * L + kx) * q.Cg + ci] += (float)acc;
                }
        if (db) {
            double acc = 0.0;
            for (size_t p = 0; p < (size_t)q.N * q.OH * q.OW; p++) acc += ld(dout, p * q.Cout + co);
            db[co] += (float)acc;
        }
    }
}

// the references work in place: no workspace
static size_t conv2d_workspace_ref(Ops *o, const ConvCfg *cfg, Shape in, DType dt) {
    (void)o; (void)cfg; (void)in; (void)dt;
    return 0;
}

// ----------------------------------------------------------------------------
// activations: y = act(x), dx = dy·act'(x)

static void act_forward_ref(Ops *o, Act act, Tensor y, Tensor x) {
    (void)o;
    size_t n = shape_numel(x.shape);
    #pragma omp parallel for schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) st(y, i, act_apply(act, ld(x, i)));
}

static void act_backward_ref(Ops *o, Act act, Tensor dx, Tensor dy, Tensor x, int accumulate) {
    (void)o;
    size_t n = shape_numel(x.shape);
    #pragma omp parallel for schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) st_acc(dx, i, ld(dy, i) * act_grad(act, ld(x, i)), accumulate);
}

// ----------------------------------------------------------------------------
// squeeze-excitation's gate (the formulas are at se_gate_forward in segnet.h)
//   per image: z1 = W1·p + b1, y1 = act1(z1), z2 = W2·y1 + b2, s = act2(z2)

// z[n][a] = b[a] + Σ_k w[a][k]·x[n][k] for N images, rounded to dt: threads share
// the outputs, each a sum in fp64 in k order
static void affine_rows(DType dt, float *z, const float *w, const float *b, const float *x, int A, int K, int N) {
    #pragma omp parallel for schedule(static) if(PAR((size_t)N * A * K))
    for (int a = 0; a < A; a++)
        for (int n = 0; n < N; n++) {
            double t = b[a];
            for (int k = 0; k < K; k++) t += (double)w[(size_t)a * K + k] * x[(size_t)n * K + k];
            z[(size_t)n * A + a] = dtype_round(dt, (float)t);
        }
}
// every image's z1, y1 (N,S) and z2 (N,C) from pv (N,C), rounded to dt as stored tensors would be
static void se_gate_images(DType dt, int N, const float *pv, const float *w1, const float *b1, const float *w2,
                           const float *b2, int C, int S, Act act1, float *z1, float *y1, float *z2) {
    affine_rows(dt, z1, w1, b1, pv, S, C, N);
    for (size_t i = 0; i < (size_t)N * S; i++) y1[i] = dtype_round(dt, act_apply(act1, z1[i]));
    affine_rows(dt, z2, w2, b2, y1, C, S, N);
}
// dw[a][b] += Σ_n dz[n][a]·v[n][b], db[a] += Σ_n dz[n][a] (fp64, images in order)
static void outer_sums(float *dw, float *db, const float *dz, int A, const float *v, int B, int N) {
    #pragma omp parallel for schedule(static) if(PAR((size_t)N * A * B))
    for (int a = 0; a < A; a++) {
        double t = 0.0;
        for (int n = 0; n < N; n++) t += dz[(size_t)n * A + a];
        db[a] += (float)t;
        for (int b = 0; b < B; b++) {
            t = 0.0;
            for (int n = 0; n < N; n++) t += (double)dz[(size_t)n * A + a] * v[(size_t)n * B + b];
            dw[(size_t)a * B + b] += (float)t;
        }
    }
}
// p's values and room for z1, y1 (N·S each), z2 (N·C), then dz2 (N·C), dz1 (N·S)
typedef struct { float *pv, *z1, *y1, *z2, *dz2, *dz1; } SeGateBuf;
static SeGateBuf se_gate_buf(Tensor p, int S) {
    const size_t NC = shape_numel(p.shape), NS = (size_t)p.shape.n * S;
    float *m = malloc(sizeof(float) * (3 * NC + 3 * NS + 1));
    snCheck(m != NULL, "out of host memory");
    SeGateBuf b = {m, m + NC, m + NC + NS, m + NC + 2 * NS, m + 2 * NC + 2 * NS, m + 3 * NC + 2 * NS};
    for (size_t i = 0; i < NC; i++) b.pv[i] = ld(p, i);
    return b;
}
static void se_gate_forward_ref(Ops *o, Tensor s, Tensor p, const float *w1, const float *b1, const float *w2,
                                const float *b2, int S, Act act1, Act act2) {
    (void)o;
    const int N = p.shape.n, C = p.shape.c;
    SeGateBuf b = se_gate_buf(p, S);
    se_gate_images(s.dtype, N, b.pv, w1, b1, w2, b2, C, S, act1, b.z1, b.y1, b.z2);
    for (size_t i = 0; i < (size_t)N * C; i++) st(s, i, act_apply(act2, b.z2[i]));
    free(b.pv);
}
static void se_gate_backward_ref(Ops *o, Tensor dp, Tensor ds, Tensor p, const float *w1, const float *b1,
                                 const float *w2, const float *b2, int S, Act act1, Act act2, float *dw1, float *db1,
                                 float *dw2, float *db2, int accumulate) {
    (void)o;
    const int N = p.shape.n, C = p.shape.c;
    const DType dt = ds.dtype;
    SeGateBuf b = se_gate_buf(p, S);
    se_gate_images(dt, N, b.pv, w1, b1, w2, b2, C, S, act1, b.z1, b.y1, b.z2);
    for (size_t i = 0; i < (size_t)N * C; i++) b.dz2[i] = dtype_round(dt, ld(ds, i) * act_grad(act2, b.z2[i]));
    #pragma omp parallel for schedule(static) if(PAR((size_t)N * C * S))
    for (int j = 0; j < S; j++)
        for (int n = 0; n < N; n++) {
            double a = 0.0;
            for (int c = 0; c < C; c++) a += (double)w2[(size_t)c * S + j] * b.dz2[(size_t)n * C + c];
            const size_t i = (size_t)n * S + j;
            b.dz1[i] = dtype_round(dt, dtype_round(dt, (float)a) * act_grad(act1, b.z1[i]));
        }
    if (dp.data) {
        #pragma omp parallel for schedule(static) if(PAR((size_t)N * C * S))
        for (int c = 0; c < C; c++)
            for (int n = 0; n < N; n++) {
                double a = 0.0;
                for (int j = 0; j < S; j++) a += (double)w1[(size_t)j * C + c] * b.dz1[(size_t)n * S + j];
                st_acc(dp, (size_t)n * C + c, (float)a, accumulate);
            }
    }
    if (dw1) {
        outer_sums(dw2, db2, b.dz2, C, b.y1, S, N);
        outer_sums(dw1, db1, b.dz1, S, b.pv, C, N);
    }
    free(b.pv);
}

// ----------------------------------------------------------------------------
// squeeze-excitation pieces (fp32 versions in part IV)
//   pool:  y[n,c] = Σ_{h,w} x[n,h,w,c] / (H·W);      dx[n,h,w,c] = dy[n,c] / (H·W)
//   scale: y[n,h,w,c] = x[n,h,w,c]·s[n,c];           dx = dy·s,  ds[n,c] = Σ_{h,w} dy·x

static void global_avg_pool_forward_ref(Ops *o, Tensor y, Tensor x) {
    (void)o;
    const int C = x.shape.c;
    const size_t HW = (size_t)x.shape.h * x.shape.w;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(x.shape)))
    for (int nc = 0; nc < x.shape.n * C; nc++) {
        int n = nc / C, c = nc % C;
        double s = 0.0;
        for (size_t p = 0; p < HW; p++) s += ld(x, ((size_t)n * HW + p) * C + c);
        st(y, nc, (float)(s / (double)HW));
    }
}

static void global_avg_pool_backward_ref(Ops *o, Tensor dx, Tensor dy, int accumulate) {
    (void)o;
    const int C = dx.shape.c;
    const size_t HW = (size_t)dx.shape.h * dx.shape.w;
    const float inv = 1.0f / (float)HW;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(dx.shape)))
    for (size_t i = 0; i < shape_numel(dx.shape); i++) {
        size_t n = i / (HW * C);
        int c = (int)(i % C);
        st_acc(dx, i, ld(dy, n * C + c) * inv, accumulate);
    }
}

static void channel_scale_forward_ref(Ops *o, Tensor y, Tensor x, Tensor s) {
    (void)o;
    const int C = x.shape.c;
    const size_t HWC = (size_t)x.shape.h * x.shape.w * C;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(x.shape)))
    for (size_t i = 0; i < shape_numel(x.shape); i++)
        st(y, i, ld(x, i) * ld(s, (i / HWC) * C + i % C));
}

static void channel_scale_backward_ref(Ops *o, Tensor dx, Tensor ds, Tensor dy, Tensor x, Tensor s,
                                       int accumulate_dx, int accumulate_ds) {
    (void)o;
    const int C = x.shape.c;
    const size_t HW = (size_t)x.shape.h * x.shape.w, HWC = HW * C;
    if (dx.data) {
        #pragma omp parallel for schedule(static) if(PAR(shape_numel(x.shape)))
        for (size_t i = 0; i < shape_numel(x.shape); i++)
            st_acc(dx, i, ld(dy, i) * ld(s, (i / HWC) * C + i % C), accumulate_dx);
    }
    if (ds.data) {
        #pragma omp parallel for schedule(static) if(PAR(shape_numel(x.shape)))
        for (int nc = 0; nc < x.shape.n * C; nc++) {
            int n = nc / C, c = nc % C;
            double acc = 0.0;
            for (size_t p = 0; p < HW; p++) {
                size_t i = ((size_t)n * HW + p) * C + c;
                acc += (double)ld(dy, i) * ld(x, i);
            }
            st_acc(ds, nc, (float)acc, accumulate_ds);
        }
    }
}

// ----------------------------------------------------------------------------
// residual add and channel concat

static void add_forward_ref(Ops *o, Tensor y, Tensor a, Tensor b) {
    (void)o;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(y.shape)))
    for (size_t i = 0; i < shape_numel(y.shape); i++) st(y, i, ld(a, i) + ld(b, i));
}

static void add_backward_ref(Ops *o, Tensor da, Tensor db, Tensor dy, int accumulate_a, int accumulate_b) {
    if (da.data) copy_ref(o, da, dy, accumulate_a);
    if (db.data) copy_ref(o, db, dy, accumulate_b);
}

// y[r, 0:Ca] = a[r, :], y[r, Ca:Ca+Cb] = b[r, :] for every pixel r
static void concat_forward_ref(Ops *o, Tensor y, Tensor a, Tensor b) {
    (void)o;
    const int Ca = a.shape.c, Cb = b.shape.c, C = Ca + Cb;
    const size_t M = shape_numel(y.shape) / C;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (size_t r = 0; r < M; r++) {
        for (int c = 0; c < Ca; c++) st(y, r * C + c, ld(a, r * Ca + c));
        for (int c = 0; c < Cb; c++) st(y, r * C + Ca + c, ld(b, r * Cb + c));
    }
}

static void concat_backward_ref(Ops *o, Tensor da, Tensor db, Tensor dy, int accumulate_a, int accumulate_b) {
    (void)o;
    const int Ca = da.shape.c, Cb = db.shape.c, C = Ca + Cb;
    const size_t M = shape_numel(dy.shape) / C;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (size_t r = 0; r < M; r++) {
        if (da.data) for (int c = 0; c < Ca; c++) st_acc(da, r * Ca + c, ld(dy, r * C + c), accumulate_a);
        if (db.data) for (int c = 0; c < Cb; c++) st_acc(db, r * Cb + c, ld(dy, r * C + Ca + c), accumulate_b);
    }
}

// ----------------------------------------------------------------------------
// dropout and drop-path
//   keep_i = rng_uniform(seed, i) >= rate, i the element (dropout) or the sample (drop-path)
//   y = x·keep/(1 - rate),  dx = dy·keep/(1 - rate)

static void dropout_forward_ref(Ops *o, Tensor y, Tensor x, Tensor residual, float rate, const uint64_t *seed_at,
                                int per_sample, uint64_t first_sample) {
    (void)o;
    const uint64_t seed = *seed_at;
    const size_t n = shape_numel(x.shape), E = n / x.shape.n, per_draw = per_sample ? E : 1;
    #pragma omp parallel for schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) {
        const float v = ld(x, i) * dropout_factor(rate, seed, first_sample * E + i, per_draw);
        st(y, i, residual.data ? v + ld(residual, i) : v);
    }
}

static void dropout_backward_ref(Ops *o, Tensor dx, Tensor dresidual, Tensor dy, float rate, const uint64_t *seed_at,
                                 int per_sample, uint64_t first_sample, int accumulate, int accumulate_residual) {
    (void)o;
    const uint64_t seed = *seed_at;
    const size_t n = shape_numel(dy.shape), E = n / dy.shape.n, per_draw = per_sample ? E : 1;
    #pragma omp parallel for schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) {  // dx may be dy (in place)
        const float g = ld(dy, i);
        if (dx.data) st_acc(dx, i, g * dropout_factor(rate, seed, first_sample * E + i, per_draw), accumulate);
        if (dresidual.data) st_acc(dresidual, i, g, accumulate_residual);
    }
}

// ----------------------------------------------------------------------------
// pooling and resampling

// y[n,oy,ox,c] = max_{dy,dx ∈ {0,1}} x[n, 2·oy + dy, 2·ox + dx, c]
static void maxpool2_forward_ref(Ops *o, Tensor y, Tensor x) {
    (void)o;
    const Shape s = x.shape, t = y.shape;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(x.shape)))
    for (int noy = 0; noy < t.n * t.h; noy++) {
        int n = noy / t.h, oy = noy % t.h;
        for (int ox = 0; ox < t.w; ox++)
            for (int c = 0; c < t.c; c++) {
                float m = -INFINITY;
                for (int k = 0; k < 4; k++) {
                    float v = ld(x, (((size_t)n * s.h + 2 * oy + k / 2) * s.w + 2 * ox + k % 2) * s.c + c);
                    if (v > m) m = v;
                }
                st(y, (((size_t)n * t.h + oy) * t.w + ox) * t.c + c, m);
            }
    }
}

static void maxpool2_backward_ref(Ops *o, Tensor dx, Tensor dy, Tensor x, int accumulate) {
    (void)o;
    const Shape s = x.shape, t = dy.shape;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(x.shape)))
    for (int niy = 0; niy < s.n * s.h; niy++) {
        int n = niy / s.h, iy = niy % s.h, oy = iy / 2;
        for (int ix = 0; ix < s.w; ix++) {
            int ox = ix / 2;
            for (int c = 0; c < s.c; c++) {
                size_t i = (((size_t)n * s.h + iy) * s.w + ix) * s.c + c;
                float g = 0.0f;
                if (oy < t.h && ox < t.w) {  // rows/cols past the floor get no gradient
                    int first = 0;
                    float m = -INFINITY;
                    for (int k = 0; k < 4; k++) {
                        float v = ld(x, (((size_t)n * s.h + 2 * oy + k / 2) * s.w + 2 * ox + k % 2) * s.c + c);
                        if (v > m) { m = v; first = k; }
                    }
                    if (first == (iy - 2 * oy) * 2 + (ix - 2 * ox))
                        g = ld(dy, (((size_t)n * t.h + oy) * t.w + ox) * t.c + c);
                }
                st_acc(dx, i, g, accumulate);
            }
        }
    }
}

// y[n,oy,ox,c] = x[n, oy/2, ox/2, c];  dx[n,iy,ix,c] = Σ of the 2×2 dy it was copied to
static void upsample2_forward_ref(Ops *o, Tensor y, Tensor x) {
    (void)o;
    const Shape s = x.shape, t = y.shape;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(y.shape)))
    for (int noy = 0; noy < t.n * t.h; noy++) {
        int n = noy / t.h, oy = noy % t.h;
        for (int ox = 0; ox < t.w; ox++)
            for (int c = 0; c < t.c; c++)
                st(y, (((size_t)n * t.h + oy) * t.w + ox) * t.c + c,
                   ld(x, (((size_t)n * s.h + oy / 2) * s.w + ox / 2) * s.c + c));
    }
}

static void upsample2_backward_ref(Ops *o, Tensor dx, Tensor dy, int accumulate) {
    (void)o;
    const Shape s = dx.shape, t = dy.shape;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(dy.shape)))
    for (int niy = 0; niy < s.n * s.h; niy++) {
        int n = niy / s.h, iy = niy % s.h;
        for (int ix = 0; ix < s.w; ix++)
            for (int c = 0; c < s.c; c++) {
                float g = 0.0f;
                for (int k = 0; k < 4; k++)
                    g += ld(dy, (((size_t)n * t.h + 2 * iy + k / 2) * t.w + 2 * ix + k % 2) * t.c + c);
                st_acc(dx, (((size_t)n * s.h + iy) * s.w + ix) * s.c + c, g, accumulate);
            }
    }
}

// Bilinear, half-pixel centres: the taps of segnet.h (bilinear_tap, tap_weight, tap_range).

static void resize_bilinear_forward_ref(Ops *o, Tensor y, Tensor x) {
    (void)o;
    const Shape s = x.shape, t = y.shape;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(y.shape)))
    for (int noy = 0; noy < t.n * t.h; noy++) {
        int n = noy / t.h, oy = noy % t.h;
        BilinearTap ty = bilinear_tap(oy, s.h, t.h);
        for (int ox = 0; ox < t.w; ox++) {
            BilinearTap tx = bilinear_tap(ox, s.w, t.w);
            size_t r00 = (((size_t)n * s.h + ty.i0) * s.w + tx.i0) * s.c, r01 = (((size_t)n * s.h + ty.i0) * s.w + tx.i1) * s.c;
            size_t r10 = (((size_t)n * s.h + ty.i1) * s.w + tx.i0) * s.c, r11 = (((size_t)n * s.h + ty.i1) * s.w + tx.i1) * s.c;
            for (int c = 0; c < t.c; c++) {
                float top = (1.0f - tx.l) * ld(x, r00 + c) + tx.l * ld(x, r01 + c);
                float bot = (1.0f - tx.l) * ld(x, r10 + c) + tx.l * ld(x, r11 + c);
                st(y, (((size_t)n * t.h + oy) * t.w + ox) * t.c + c, (1.0f - ty.l) * top + ty.l * bot);
            }
        }
    }
}

// The adjoint as a gather, each dx written once:
//   dx[n,iy,ix,c] (=|+=) Σ_{oy,ox} wy(oy,iy)·wx(ox,ix)·dy[n,oy,ox,c]
static void resize_bilinear_backward_ref(Ops *o, Tensor dx, Tensor dy, int accumulate) {
    (void)o;
    const Shape s = dx.shape, t = dy.shape;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(dy.shape)))
    for (int niy = 0; niy < s.n * s.h; niy++) {
        int n = niy / s.h, iy = niy % s.h, oy0, oy1;
        tap_range(iy, s.h, t.h, &oy0, &oy1);
        for (int ix = 0; ix < s.w; ix++) {
            int ox0, ox1;
            tap_range(ix, s.w, t.w, &ox0, &ox1);
            for (int c = 0; c < s.c; c++) {
                float g = 0.0f;
                for (int oy = oy0; oy <= oy1; oy++) {
                    float wy = tap_weight(bilinear_tap(oy, s.h, t.h), iy);
                    if (wy == 0.0f) continue;
                    for (int ox = ox0; ox <= ox1; ox++) {
                        float wx = tap_weight(bilinear_tap(ox, s.w, t.w), ix);
                        if (wx != 0.0f) g += wy * wx * ld(dy, (((size_t)n * t.h + oy) * t.w + ox) * t.c + c);
                    }
                }
                st_acc(dx, (((size_t)n * s.h + iy) * s.w + ix) * s.c + c, g, accumulate);
            }
        }
    }
}

// ----------------------------------------------------------------------------
// batch norm
//
// Per channel c over the M = N·H·W values of x:
//   mean = Σx/M, var = Σ(x - mean)²/M (biased, used to normalise)
//   xhat = (x - mean)·invstd, invstd = 1/sqrt(var + eps)
//   z = gamma·xhat + beta, y = act(z)
// Backward, with g = dy·act'(z):
//   dbeta = Σg, dgamma = Σ g·xhat
//   dx = gamma·invstd·(g - Σg/M - xhat·Σ(g·xhat)/M)   (batch statistics)
//   dx = gamma·invstd·g                               (running statistics)
// Reductions run per block of channels, each channel summed in row order in
// fp64 by one thread: deterministic whatever the thread count.

#define BN_CBLOCK 16

// The reference versions below (any storage type, the formulas as written)
// are ops_ref's batch norm; part IV's bn_*_cpu compute the same in fewer passes.

// Batch norm with the layer after it (BnNext): the two ops one after the
// other, the layer after it from the same table o (every backend's fallback
// where it has no fused kernel); a residual block's end in place in out
// (forward) and in out's gradient dy (backward), so y and its gradient need no
// memory.

// y written: the pool of y, or the residual end in place in out (which holds y)
void bn_next_forward_unfused(Ops *o, Tensor y, const BnNext *next) {
    if (next->kind == FUSED_POOL) o->global_avg_pool_forward(o, next->pooled, y);
    if (next->kind != FUSED_RESIDUAL) return;
    if (next->rate > 0.0f)
        o->dropout_forward(o, y, y, next->residual, next->rate, next->seed, 1, next->first_sample);
    else
        o->add_forward(o, y, y, next->residual);
}
// a residual end's backward: dresidual (=|+=) dy, and dy (out's gradient) becomes y's, dy·keep
void bn_next_backward_unfused(Ops *o, Tensor dy, const BnNext *next) {
    const int acc = next->accumulate_residual;
    if (next->rate > 0.0f)
        o->dropout_backward(o, dy, next->dresidual, dy, next->rate, next->seed, 1, next->first_sample, 0, acc);
    else if (next->dresidual.data)
        o->copy(o, next->dresidual, dy, acc);  // keep = 1: dy is y's gradient as it is
}

static void bn_update_running_ref(Ops *o, float *run_mean, float *run_var, const float *mean,
                                  const float *var, int C, size_t count, float momentum) {
    (void)o;
    const double unbias = bn_running_unbias((double)count);
    for (int c = 0; c < C; c++) {
        run_mean[c] = (1.0f - momentum) * run_mean[c] + momentum * mean[c];
        run_var[c] = (1.0f - momentum) * run_var[c] + momentum * (float)(var[c] * unbias);
    }
}

// mean and var per channel in two passes (Σx, then Σ(x − mean)²); the running
// statistics when asked, and the plain fp64 sums Σx, Σx² into sums when asked
// (--sync-bn adds them over replicas and finishes with bn_stats_finish)
static void bn_stats_ref(Ops *o, Tensor x, float *mean, float *var, float *run_mean, float *run_var, float momentum,
                         double *sums) {
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (int c0 = 0; c0 < C; c0 += BN_CBLOCK) {
        int nc = C - c0 < BN_CBLOCK ? C - c0 : BN_CBLOCK;
        double s[BN_CBLOCK] = {0}, s2[BN_CBLOCK] = {0}, q[BN_CBLOCK] = {0};  // Σx, Σx², Σ(x − mean)²
        for (size_t r = 0; r < M; r++)
            for (int j = 0; j < nc; j++) { const double v = ld(x, r * C + c0 + j); s[j] += v; s2[j] += v * v; }
        for (int j = 0; j < nc; j++) {
            if (sums) { sums[c0 + j] = s[j]; sums[C + c0 + j] = s2[j]; }
            s[j] /= (double)M;
        }
        for (size_t r = 0; r < M; r++)
            for (int j = 0; j < nc; j++) { double d = ld(x, r * C + c0 + j) - s[j]; q[j] += d * d; }
        for (int j = 0; j < nc; j++) { mean[c0 + j] = (float)s[j]; var[c0 + j] = (float)(q[j] / (double)M); }
    }
    if (run_mean) bn_update_running_ref(o, run_mean, run_var, mean, var, C, M, momentum);
}

static void bn_stats_finish_ref(Ops *o, const double *sums, int C, size_t count, float *mean, float *var,
                                float *run_mean, float *run_var, float momentum) {
    for (int c = 0; c < C; c++) bn_moments_stats(sums[c], sums[C + c], (double)count, &mean[c], &var[c]);
    if (run_mean) bn_update_running_ref(o, run_mean, run_var, mean, var, C, count, momentum);
}

// y = act(gamma·((x − mean)·invstd) + beta), then the layer after it (next)
static void bn_forward_ref(Ops *o, Tensor y, Tensor x, const float *mean, const float *var,
                           const float *gamma, const float *beta, float eps, Act act, const BnNext *next) {
    if (next && next->kind == FUSED_RESIDUAL) y = next->out;
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (size_t r = 0; r < M; r++)
        for (int c = 0; c < C; c++) {
            float z = gamma[c] * ((ld(x, r * C + c) - mean[c]) * bn_invstd(var, c, eps)) + beta[c];
            st(y, r * C + c, act_apply(act, z));
        }
    if (next) bn_next_forward_unfused(o, y, next);
}

// Σg and Σg·xhat per channel (sums: the same in fp64, --sync-bn), dgamma and dbeta;
// first, with a residual block's end, dy becomes y's gradient (bn_next_backward_unfused)
static void bn_backward_reduce_ref(Ops *o, Tensor dy, Tensor x, const float *mean, const float *var,
                                   const float *gamma, const float *beta, float eps, Act act,
                                   float *sum_g, float *sum_gx, float *dgamma, float *dbeta, double *sums,
                                   const BnNext *next) {
    if (next && next->kind == FUSED_RESIDUAL) bn_next_backward_unfused(o, dy, next);
    if (!sum_g) return;
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (int c0 = 0; c0 < C; c0 += BN_CBLOCK) {
        int nc = C - c0 < BN_CBLOCK ? C - c0 : BN_CBLOCK;
        double sg[BN_CBLOCK] = {0}, sgx[BN_CBLOCK] = {0};
        for (size_t r = 0; r < M; r++)
            for (int j = 0; j < nc; j++) {
                int c = c0 + j;
                float xhat = (ld(x, r * C + c) - mean[c]) * bn_invstd(var, c, eps);
                float g = ld(dy, r * C + c) * act_grad(act, gamma[c] * xhat + beta[c]);
                sg[j] += g;
                sgx[j] += (double)g * xhat;
            }
        for (int j = 0; j < nc; j++) {
            bn_grad_sums_store(c0 + j, sg[j], sgx[j], sum_g, sum_gx, dgamma, dbeta);
            if (sums) { sums[c0 + j] = sg[j]; sums[C + c0 + j] = sgx[j]; }
        }
    }
}

static void bn_backward_finish_ref(Ops *o, const double *sums, int C, float *sum_g, float *sum_gx, float *dgamma,
                                   float *dbeta) {
    (void)o;
    for (int c = 0; c < C; c++) bn_grad_sums_store(c, sums[c], sums[C + c], sum_g, sum_gx, dgamma, dbeta);
}

// dx (=|+=) gamma·invstd·(g − (Σg + xhat·Σg·xhat)/count), count 0: running statistics;
// dy is y's gradient, also with a residual block's end (bn_backward_reduce_ref made it so)
static void bn_backward_data_ref(Ops *o, Tensor dx, Tensor dy, Tensor x, const float *mean,
                                 const float *var, const float *gamma, const float *beta, float eps,
                                 Act act, const float *sum_g, const float *sum_gx, size_t count,
                                 int accumulate, const BnNext *next) {
    (void)o; (void)next;
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (size_t r = 0; r < M; r++)
        for (int c = 0; c < C; c++) {
            float invstd = bn_invstd(var, c, eps);
            float xhat = (ld(x, r * C + c) - mean[c]) * invstd;
            float g = ld(dy, r * C + c) * act_grad(act, gamma[c] * xhat + beta[c]);
            if (count) g -= (sum_g[c] + xhat * sum_gx[c]) / (float)count;
            st_acc(dx, r * C + c, gamma[c] * invstd * g, accumulate);
        }
}

// ----------------------------------------------------------------------------
// fused softmax + weighted cross-entropy, per pixel i with logits z (K classes):
//   p = softmax(z), nll_i = log Σ_k exp(z_k) - z_y  (computed with max subtracted)
//   loss contribution w[y]·nll_i, weight w[y]
//   dz_k = w[y]·(p_k - [k = y])·grad_scale
// The caller divides Σ w·nll by the global Σ w (the weighted mean: README.md, "How it works").
// With prob_clip ε > 0, Keras' categorical cross-entropy: p_y clipped to [ε, 1-ε]
// before the log, i.e. nll clamped to [-log(1-ε), -log ε], and a pixel whose p_y
// lies beyond the clip has no gradient (the clip's derivative is 0 there).

#define XENT_CHUNK 4096

static void softmax_xent_ref(Ops *o, Tensor logits, const int32_t *labels, const float *class_weights, float prob_clip,
                             const float *grad_scale, float *stats, Tensor dlogits) {
    (void)o;
    const float gscale = dlogits.data ? *grad_scale : 0.0f;
    const int K = logits.shape.c;
    const size_t M = shape_numel(logits.shape) / K, n_chunks = (M + XENT_CHUNK - 1) / XENT_CHUNK;
    const XentClip clip = xent_clip_bounds(prob_clip);
    double loss = 0.0, wsum = 0.0, invalid = 0.0;
    // fixed chunks, partials added in order: deterministic for any thread count
    for (size_t g0 = 0; g0 < n_chunks; g0 += SUM_GROUP) {
        double pl[SUM_GROUP], pw[SUM_GROUP], pi[SUM_GROUP];
        size_t g1 = g0 + SUM_GROUP < n_chunks ? g0 + SUM_GROUP : n_chunks;
        #pragma omp parallel for schedule(static) if(PAR(M * K))
        for (size_t k = g0; k < g1; k++) {
            double l = 0.0, w = 0.0, bad = 0.0;
            size_t r1 = (k + 1) * XENT_CHUNK < M ? (k + 1) * XENT_CHUNK : M;
            for (size_t r = k * XENT_CHUNK; r < r1; r++) {
                const int32_t y = labels[r];
                const int valid = y >= 0 && y < K;
                const float wy = valid ? class_weights[y] : 0.0f;
                if (!valid) bad += 1.0;
                float zmax = -INFINITY;
                for (int c = 0; c < K; c++) { float z = ld(logits, r * K + c); if (z > zmax) zmax = z; }
                double sum = 0.0;
                for (int c = 0; c < K; c++) sum += exp((double)ld(logits, r * K + c) - zmax);
                int flat = 0;
                if (wy != 0.0f) {
                    double nll = xent_clip(log(sum) + zmax - ld(logits, r * K + y), clip, &flat);
                    l += wy * nll;
                    w += wy;
                }
                if (dlogits.data)
                    for (int c = 0; c < K; c++) {
                        double p = exp((double)ld(logits, r * K + c) - zmax) / sum;
                        st(dlogits, r * K + c, flat ? 0.0f : (float)(wy * (p - (c == y)) * gscale));
                    }
            }
            pl[k - g0] = l; pw[k - g0] = w; pi[k - g0] = bad;
        }
        for (size_t k = g0; k < g1; k++) { loss += pl[k - g0]; wsum += pw[k - g0]; invalid += pi[k - g0]; }
    }
    stats[0] += (float)loss;
    stats[1] += (float)wsum;
    stats[2] += (float)invalid;
}

static void confusion_accumulate_ref(Ops *o, Tensor logits, const int32_t *labels, int64_t *confusion) {
    (void)o;
    const int K = logits.shape.c;
    const size_t M = shape_numel(logits.shape) / K;
    for (size_t r = 0; r < M; r++) {
        const int32_t y = labels[r];
        if (y < 0 || y >= K) continue;
        int best = 0;
        float zbest = ld(logits, r * K);
        for (int c = 1; c < K; c++) { float z = ld(logits, r * K + c); if (z > zbest) { zbest = z; best = c; } }
        confusion[(size_t)y * K + best]++;
    }
}

double label_weight_sum(const int32_t *labels, size_t n, const float *class_weights, int K) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        if (labels[i] >= 0 && labels[i] < K) s += class_weights[labels[i]];
    return s;
}

// ----------------------------------------------------------------------------
// Adam (the formula is at AdamStep in segnet.h)

AdamStep adam_step_init(float lr, float beta1, float beta2, float eps, float weight_decay, float grad_scale,
                        int64_t t) {
    AdamStep s = {lr, beta1, beta2, eps, weight_decay, grad_scale, 0.0f, 0};
    s.alpha = (float)((double)lr * sqrt(1.0 - pow(beta2, (double)t)) / (1.0 - pow(beta1, (double)t)));
    return s;
}

// Compiled without multiply-add contraction (-march=native would fuse some of
// these products into FMAs, others not): each operation rounds on its own, in
// the order written, so the CUDA kernel gives the same bits.
__attribute__((optimize("fp-contract=off")))
static void adam_update_ref(Ops *o, float *params, const float *grads, float *m, float *v, size_t n,
                            const AdamStep *s) {
    (void)o;
    if (s->skip) return;
    const float decay = s->lr * s->weight_decay;
    #pragma omp parallel for simd schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) {
        float g = grads[i] * s->grad_scale, p = params[i];
        if (decay != 0.0f) p -= decay * p;
        m[i] += (g - m[i]) * (1.0f - s->beta1);
        v[i] += (g * g - v[i]) * (1.0f - s->beta2);
        params[i] = p - s->alpha * m[i] / (sqrtf(v[i]) + s->eps);
    }
}

// ----------------------------------------------------------------------------
// metrics and learning-rate schedules
//   over the confusion matrix cm[true][predicted] of the classes with weight > 0:
//   IoU_c = TP/(TP + FP + FN) (FP counts only pixels whose true class has weight > 0,
//   so that "not annotated" pixels are no one's false positive), mean IoU over the
//   classes that occur, accuracy = Σ TP / Σ (TP + FN)
//   lr: linear warm-up over `warmup` steps, then constant or a cosine to 0

void metrics_compute(const int64_t *cm, int K, const float *class_weights, Metrics *m) {
    int64_t correct = 0, counted = 0;
    double iou_sum = 0.0;
    int n_iou = 0;
    for (int c = 0; c < K; c++) {
        m->iou[c] = NAN;
        if (!(class_weights[c] > 0.0f)) continue;
        int64_t tp = cm[(size_t)c * K + c], fn = 0, fp = 0;
        for (int k = 0; k < K; k++) {
            if (k == c) continue;
            fn += cm[(size_t)c * K + k];
            if (class_weights[k] > 0.0f) fp += cm[(size_t)k * K + c];
        }
        correct += tp;
        counted += tp + fn;
        if (tp + fp + fn > 0) {
            m->iou[c] = (double)tp / (double)(tp + fp + fn);
            iou_sum += m->iou[c];
            n_iou++;
        }
    }
    m->mean_iou = n_iou ? iou_sum / n_iou : NAN;
    m->accuracy = counted ? (double)correct / (double)counted : NAN;
}

double lr_at_step(double lr, Schedule s, int64_t warmup, int64_t total_steps, int64_t step) {
    if (step < warmup) return lr * (double)(step + 1) / (double)warmup;
    if (s == SCHEDULE_CONSTANT || total_steps <= warmup) return lr;
    double progress = (double)(step - warmup) / (double)(total_steps - warmup);
    if (progress > 1.0) progress = 1.0;
    return lr * 0.5 * (1.0 + cos(M_PI * progress));
}

// ----------------------------------------------------------------------------
// the reference table: every op above as its formula is written. ops_cpu
// (part IV) is this table with fast versions of conv2d, batch norm, the
// squeeze-excitation pieces and the memory-bound ops (pooling, upsampling,
// concat, adds, copies, dropout); the tests run a training forward and backward on
// both and compare them as they compare the GPU with the CPU.

Ops ops_ref = {
    .name = "ref",
    .ctx = NULL,
    .alloc = cpu_alloc,
    .free = cpu_free,
    .upload = cpu_memcpy,
    .download = cpu_memcpy,
    .synchronize = cpu_synchronize,
    .host_alloc = cpu_host_alloc,
    .host_free = cpu_host_free,
    .upload_async = cpu_memcpy,
#define OPS_REF_ENTRY(name) .name = name##_ref,
    SN_COMPUTE_OPS(OPS_REF_ENTRY)
#undef OPS_REF_ENTRY
};

// ============================================================================
// PART II. THE MODELS
// A model is a graph of layers built from the ops' shapes; the builders check
// every shape and name the layer in their errors.
// ============================================================================

// ----------------------------------------------------------------------------
// the graph: builders validate shapes and name the layer in every error

static const char *LAYER_KIND_NAMES[LAYER_KIND_COUNT] = {
    "conv", "dense", "batchnorm", "activation", "global_avg_pool", "channel_scale", "add",
    "concat", "maxpool2", "upsample2", "resize_bilinear", "dropout", "drop_path", "rescale", "se_gate",
};
const char *layer_kind_name(LayerKind k) { return k >= 0 && k < LAYER_KIND_COUNT ? LAYER_KIND_NAMES[k] : "?"; }
// a layer's parameter ids into ids (weight, bias, weight2, bias2, those it has); returns how many
static int layer_params(const Layer *l, int ids[4]) {
    const int all[4] = {l->weight, l->bias, l->weight2, l->bias2};
    int n = 0;
    for (int k = 0; k < 4; k++) if (all[k] >= 0) ids[n++] = all[k];
    return n;
}

void graph_init(Graph *g) {
    memset(g, 0, sizeof *g);
    g->input = -1;
}

void graph_free(Graph *g) {
    free(g->layers); free(g->tensors); free(g->params); free(g->buffers); free(g->stage_names);
    graph_init(g);
}

static void graph_fail(Graph *g, const char *fmt, ...) {
    if (g->err[0]) return;  // keep the first error
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(g->err, sizeof g->err, fmt, ap);
    va_end(ap);
}

// grow a dynamic array to hold one more element
#define GROW(arr, n, cap) do { \
    if ((n) == (cap)) { (cap) = (cap) ? 2 * (cap) : 16; (arr) = realloc((arr), sizeof *(arr) * (size_t)(cap)); \
                        snCheck((arr) != NULL, "out of host memory growing the graph"); } } while (0)

// The largest tensor or parameter table a graph may hold: 2^40 elements (4 TiB
// in fp32). Below it, every plan total (under 2^20 buffers) fits in 64 bits.
#define GRAPH_MAX_ELEMENTS ((uint64_t)1 << 40)

// n1·n2·...: the product, or UINT64_MAX if it overflows 64 bits
static uint64_t checked_product(const int64_t *v, int n) {
    uint64_t p = 1;
    for (int i = 0; i < n; i++)
        if (v[i] < 0 || __builtin_mul_overflow(p, (uint64_t)v[i], &p)) return UINT64_MAX;
    return p;
}

static int add_param(Graph *g, ParamInfo **table, int *n, int *cap, size_t *total, const char *layer,
                     const char *suffix, int ndim, const int *dims) {
    GROW(*table, *n, *cap);
    ParamInfo *p = &(*table)[*n];
    memset(p, 0, sizeof *p);
    if (snprintf(p->name, sizeof p->name, "%s.%s", layer, suffix) >= (int)sizeof p->name) {
        graph_fail(g, "layer '%s': parameter name too long (limit %d characters)", layer, SN_NAME_MAX - 1);
        return -1;
    }
    p->ndim = ndim;
    int64_t d64[4];  // ParamInfo.dims
    for (int i = 0; i < ndim; i++) { p->dims[i] = dims[i]; d64[i] = dims[i]; }
    const uint64_t count = checked_product(d64, ndim);
    if (count > GRAPH_MAX_ELEMENTS || *total + count > GRAPH_MAX_ELEMENTS) {
        graph_fail(g, "parameter '%s': the model's parameters would exceed the %.4g elements a plan can hold (a smaller --width)",
                   p->name, (double)GRAPH_MAX_ELEMENTS);
        return -1;
    }
    p->count = (size_t)count;
    p->offset = *total;
    *total += p->count;
    return (*n)++;
}
static int add_weight(Graph *g, const char *layer, const char *suffix, int ndim, const int *dims) {
    return add_param(g, &g->params, &g->n_params, &g->cap_params, &g->n_param_floats, layer, suffix, ndim, dims);
}
static int add_buffer(Graph *g, const char *layer, const char *suffix, int n) {
    return add_param(g, &g->buffers, &g->n_buffers, &g->cap_buffers, &g->n_buffer_floats, layer, suffix, 1, &n);
}

int graph_find_param(const Graph *g, const char *name) {
    for (int i = 0; i < g->n_params; i++)
        if (strcmp(g->params[i].name, name) == 0) return i;
    return -1;
}
static int graph_find_buffer(const Graph *g, const char *name) {
    for (int i = 0; i < g->n_buffers; i++)
        if (strcmp(g->buffers[i].name, name) == 0) return i;
    return -1;
}

static int new_tensor(Graph *g, const char *name, Shape s, int producer) {
    const int64_t dims[4] = {s.n, s.h, s.w, s.c};
    const uint64_t numel = checked_product(dims, 4);
    if (numel > GRAPH_MAX_ELEMENTS)
        graph_fail(g, "tensor '%s' would be (%d,%d,%d,%d), %.4g elements: more than the %.4g a plan can hold (a smaller "
                   "--size, --batch or --width)", name, s.n, s.h, s.w, s.c, (double)s.n * s.h * s.w * s.c, (double)GRAPH_MAX_ELEMENTS);
    GROW(g->tensors, g->n_tensors, g->cap_tensors);
    TensorInfo *t = &g->tensors[g->n_tensors];
    snprintf(t->name, sizeof t->name, "%s", name);
    t->shape = s;
    t->producer = producer;
    return g->n_tensors++;
}

int graph_input(Graph *g, Shape s) {
    if (g->err[0]) return -1;
    if (g->input >= 0) { graph_fail(g, "the graph already has an input"); return -1; }
    if (s.n < 1 || s.h < 1 || s.w < 1 || s.c < 1) {
        graph_fail(g, "input: shape " SHAPE_FMT " has an empty dimension", SHAPE_ARGS(s));
        return -1;
    }
    return g->input = new_tensor(g, "input", s, -1);
}

static int valid_tensor(Graph *g, const char *name, int t) {
    if (t < 0 || t >= g->n_tensors) {
        graph_fail(g, "layer '%s': input tensor id %d does not exist", name, t);
        return 0;
    }
    return 1;
}

// Appends a layer reading a (and b, or -1) and producing a new tensor of shape
// `out`; returns the layer (NULL after an error).
static Layer *add_layer(Graph *g, LayerKind kind, const char *name, int a, int b, Shape out) {
    if (g->err[0]) return NULL;
    if (strlen(name) + 16 >= SN_NAME_MAX) {  // room for ".running_mean"
        graph_fail(g, "layer '%s': name too long (limit %d characters)", name, SN_NAME_MAX - 17);
        return NULL;
    }
    for (int i = 0; i < g->n_layers; i++)
        if (strcmp(g->layers[i].name, name) == 0) {
            graph_fail(g, "layer '%s': a layer of that name already exists", name);
            return NULL;
        }
    if (out.n < 1 || out.h < 1 || out.w < 1 || out.c < 1) {
        graph_fail(g, "layer '%s': output shape " SHAPE_FMT " is empty", name, SHAPE_ARGS(out));
        return NULL;
    }
    GROW(g->layers, g->n_layers, g->cap_layers);
    Layer *l = &g->layers[g->n_layers];
    memset(l, 0, sizeof *l);
    l->kind = kind;
    snprintf(l->name, sizeof l->name, "%s", name);
    l->in[0] = a; l->in[1] = b;
    l->weight = l->bias = l->weight2 = l->bias2 = l->run_mean = l->run_var = -1;
    l->block = g->block;
    l->stage = g->n_stages - 1;
    l->out = new_tensor(g, name, out, g->n_layers);
    g->n_layers++;
    return l;
}

static Shape tshape(const Graph *g, int t) { return g->tensors[t].shape; }

static const char *pad_name(PadMode p) { return p == PAD_SAME ? "same" : "symmetric"; }

static int conv_layer(Graph *g, LayerKind kind, const char *name, int x, int cout, int k, int stride,
                      int groups, PadMode pad, int bias) {
    if (g->err[0] || !valid_tensor(g, name, x)) return -1;
    Shape in = tshape(g, x);
    if (cout < 1 || k < 1 || stride < 1 || groups < 1) {
        graph_fail(g, "layer '%s': cout %d, kernel %d, stride %d and groups %d must all be positive",
                   name, cout, k, stride, groups);
        return -1;
    }
    if (in.c % groups || cout % groups) {
        graph_fail(g, "layer '%s': groups %d must divide input channels %d (input " SHAPE_FMT ") and output channels %d",
                   name, groups, in.c, SHAPE_ARGS(in), cout);
        return -1;
    }
    int oh, ow, pt, pl;
    if (!conv_axis(in.h, k, stride, pad, &oh, &pt) || !conv_axis(in.w, k, stride, pad, &ow, &pl)) {
        graph_fail(g, "layer '%s': kernel %dx%d (weight (%d,%d,%d,%d)) is larger than the padded input " SHAPE_FMT
                   " with %s padding", name, k, k, cout, k, k, in.c / groups, SHAPE_ARGS(in), pad_name(pad));
        return -1;
    }
    Layer *l = add_layer(g, kind, name, x, -1, shape4(in.n, oh, ow, cout));
    if (!l) return -1;
    ConvCfg c = {in.c, cout, k, k, stride, groups, pad, bias};
    l->conv = c;
    if (kind == LAYER_DENSE) {
        int wd[2] = {cout, in.c};
        l->weight = add_weight(g, name, "weight", 2, wd);
    } else {
        int wd[4] = {cout, k, k, in.c / groups};
        l->weight = add_weight(g, name, "weight", 4, wd);
    }
    if (bias) l->bias = add_weight(g, name, "bias", 1, &cout);
    return g->err[0] ? -1 : l->out;
}

int graph_conv(Graph *g, const char *name, int x, int cout, int k, int stride, int groups, PadMode pad, int bias) {
    return conv_layer(g, LAYER_CONV, name, x, cout, k, stride, groups, pad, bias);
}

int graph_dense(Graph *g, const char *name, int x, int out, int bias) {
    if (g->err[0] || !valid_tensor(g, name, x)) return -1;
    Shape in = tshape(g, x);
    if (in.h != 1 || in.w != 1) {
        graph_fail(g, "layer '%s': a dense layer needs an (N,1,1,C) input, got " SHAPE_FMT
                   " (pool it first)", name, SHAPE_ARGS(in));
        return -1;
    }
    return conv_layer(g, LAYER_DENSE, name, x, out, 1, 1, 1, PAD_SAME, bias);
}

int graph_bn(Graph *g, const char *name, int x, float eps, Act act) {
    if (g->err[0] || !valid_tensor(g, name, x)) return -1;
    if (!(eps > 0.0f)) { graph_fail(g, "layer '%s': batch norm eps must be positive, got %g", name, eps); return -1; }
    Shape in = tshape(g, x);
    Layer *l = add_layer(g, LAYER_BN, name, x, -1, in);
    if (!l) return -1;
    l->eps = eps;
    l->act = act;
    l->weight = add_weight(g, name, "weight", 1, &in.c);   // gamma
    l->bias = add_weight(g, name, "bias", 1, &in.c);       // beta
    l->run_mean = add_buffer(g, name, "running_mean", in.c);
    l->run_var = add_buffer(g, name, "running_var", in.c);
    return g->err[0] ? -1 : l->out;
}

int graph_act(Graph *g, const char *name, int x, Act act) {
    if (g->err[0] || !valid_tensor(g, name, x)) return -1;
    Layer *l = add_layer(g, LAYER_ACT, name, x, -1, tshape(g, x));
    if (!l) return -1;
    l->act = act;
    return l->out;
}

int graph_gap(Graph *g, const char *name, int x) {
    if (g->err[0] || !valid_tensor(g, name, x)) return -1;
    Shape in = tshape(g, x);
    Layer *l = add_layer(g, LAYER_GAP, name, x, -1, shape4(in.n, 1, 1, in.c));
    return l ? l->out : -1;
}

int graph_scale(Graph *g, const char *name, int x, int s) {
    if (g->err[0] || !valid_tensor(g, name, x) || !valid_tensor(g, name, s)) return -1;
    Shape a = tshape(g, x), b = tshape(g, s);
    if (b.n != a.n || b.h != 1 || b.w != 1 || b.c != a.c) {
        graph_fail(g, "layer '%s': scale " SHAPE_FMT " must be (%d,1,1,%d) for input " SHAPE_FMT,
                   name, SHAPE_ARGS(b), a.n, a.c, SHAPE_ARGS(a));
        return -1;
    }
    Layer *l = add_layer(g, LAYER_SCALE, name, x, s, a);
    return l ? l->out : -1;
}

int graph_add(Graph *g, const char *name, int a, int b) {
    if (g->err[0] || !valid_tensor(g, name, a) || !valid_tensor(g, name, b)) return -1;
    Shape sa = tshape(g, a), sb = tshape(g, b);
    if (!shape_eq(sa, sb)) {
        graph_fail(g, "layer '%s': cannot add " SHAPE_FMT " and " SHAPE_FMT, name, SHAPE_ARGS(sa), SHAPE_ARGS(sb));
        return -1;
    }
    Layer *l = add_layer(g, LAYER_ADD, name, a, b, sa);
    return l ? l->out : -1;
}

int graph_concat(Graph *g, const char *name, int a, int b) {
    if (g->err[0] || !valid_tensor(g, name, a) || !valid_tensor(g, name, b)) return -1;
    Shape sa = tshape(g, a), sb = tshape(g, b);
    if (sa.n != sb.n || sa.h != sb.h || sa.w != sb.w) {
        graph_fail(g, "layer '%s': cannot concat " SHAPE_FMT " and " SHAPE_FMT " (N, H, W must match)",
                   name, SHAPE_ARGS(sa), SHAPE_ARGS(sb));
        return -1;
    }
    Layer *l = add_layer(g, LAYER_CONCAT, name, a, b, shape4(sa.n, sa.h, sa.w, sa.c + sb.c));
    return l ? l->out : -1;
}

int graph_maxpool(Graph *g, const char *name, int x) {
    if (g->err[0] || !valid_tensor(g, name, x)) return -1;
    Shape in = tshape(g, x);
    if (in.h < 2 || in.w < 2) {
        graph_fail(g, "layer '%s': 2x2 max-pool needs at least 2x2 pixels, input is " SHAPE_FMT, name, SHAPE_ARGS(in));
        return -1;
    }
    Layer *l = add_layer(g, LAYER_MAXPOOL, name, x, -1, shape4(in.n, in.h / 2, in.w / 2, in.c));
    return l ? l->out : -1;
}

int graph_upsample(Graph *g, const char *name, int x) {
    if (g->err[0] || !valid_tensor(g, name, x)) return -1;
    Shape in = tshape(g, x);
    Layer *l = add_layer(g, LAYER_UPSAMPLE, name, x, -1, shape4(in.n, 2 * in.h, 2 * in.w, in.c));
    return l ? l->out : -1;
}

int graph_resize(Graph *g, const char *name, int x, int oh, int ow) {
    if (g->err[0] || !valid_tensor(g, name, x)) return -1;
    Shape in = tshape(g, x);
    if (oh < 1 || ow < 1) {
        graph_fail(g, "layer '%s': cannot resize " SHAPE_FMT " to %dx%d", name, SHAPE_ARGS(in), oh, ow);
        return -1;
    }
    Layer *l = add_layer(g, LAYER_RESIZE, name, x, -1, shape4(in.n, oh, ow, in.c));
    return l ? l->out : -1;
}

static int dropout_layer(Graph *g, LayerKind kind, const char *name, int x, float rate) {
    if (g->err[0] || !valid_tensor(g, name, x)) return -1;
    if (!(rate >= 0.0f && rate < 1.0f)) {
        graph_fail(g, "layer '%s': rate %g is outside [0, 1)", name, rate);
        return -1;
    }
    Layer *l = add_layer(g, kind, name, x, -1, tshape(g, x));
    if (!l) return -1;
    l->rate = rate;
    return l->out;
}
int graph_rescale(Graph *g, const char *name, int x, float scale, float offset) {
    if (g->err[0] || !valid_tensor(g, name, x)) return -1;
    Layer *l = add_layer(g, LAYER_RESCALE, name, x, -1, tshape(g, x));
    if (!l) return -1;
    l->scale = scale;
    l->offset = offset;
    return l->out;
}

void graph_begin_block(Graph *g) { g->block++; }

void graph_begin_stage(Graph *g, const char *name) {
    GROW(g->stage_names, g->n_stages, g->cap_stages);
    snprintf(g->stage_names[g->n_stages++], SN_NAME_MAX, "%s", name);
}

int graph_dropout(Graph *g, const char *name, int x, float rate) { return dropout_layer(g, LAYER_DROPOUT, name, x, rate); }
int graph_drop_path(Graph *g, const char *name, int x, float rate) { return dropout_layer(g, LAYER_DROP_PATH, name, x, rate); }
int graph_drop_path_add(Graph *g, const char *name, int x, int residual, float rate) {
    if (g->err[0] || !valid_tensor(g, name, residual)) return -1;
    if (!shape_eq(tshape(g, x), tshape(g, residual))) {
        graph_fail(g, "layer '%s': cannot add " SHAPE_FMT " and " SHAPE_FMT, name, SHAPE_ARGS(tshape(g, x)),
                   SHAPE_ARGS(tshape(g, residual)));
        return -1;
    }
    int y = dropout_layer(g, LAYER_DROP_PATH, name, x, rate);
    if (y >= 0) g->layers[g->n_layers - 1].in[1] = residual;
    return y;
}

// layer name "prefix.suffix" (names are checked for length by add_layer)
static const char *lname(char buf[2 * SN_NAME_MAX], const char *prefix, const char *suffix) {
    if (snprintf(buf, 2 * SN_NAME_MAX, "%s.%s", prefix, suffix) >= 2 * SN_NAME_MAX) buf[2 * SN_NAME_MAX - 1] = 0;
    return buf;
}
int graph_se_gate(Graph *g, const char *name, int p, int squeeze, Act act1, Act act2) {
    if (g->err[0] || !valid_tensor(g, name, p)) return -1;
    const Shape in = tshape(g, p);
    if (in.h != 1 || in.w != 1 || squeeze < 1) {
        graph_fail(g, "layer '%s': a squeeze-excitation gate takes pooled (N,1,1,C) and squeezes to ≥ 1 channel, not "
                   SHAPE_FMT " to %d", name, SHAPE_ARGS(in), squeeze);
        return -1;
    }
    Layer *l = add_layer(g, LAYER_SE_GATE, name, p, -1, in);
    if (!l) return -1;
    const ConvCfg fc1 = {in.c, squeeze, 1, 1, 1, 1, PAD_SAME, 1};
    l->conv = fc1;  // fc2 is its transpose: squeeze -> C
    l->act = act1; l->act2 = act2;
    char b[2 * SN_NAME_MAX];
    int w1[4] = {squeeze, 1, 1, in.c}, w2[4] = {in.c, 1, 1, squeeze};
    l->weight = add_weight(g, lname(b, name, "fc1"), "weight", 4, w1);
    l->bias = add_weight(g, lname(b, name, "fc1"), "bias", 1, &squeeze);
    l->weight2 = add_weight(g, lname(b, name, "fc2"), "weight", 4, w2);
    l->bias2 = add_weight(g, lname(b, name, "fc2"), "bias", 1, &in.c);
    return g->err[0] ? -1 : l->out;
}

// ----------------------------------------------------------------------------
// models
//
// EfficientNetV2 (Tan & Le 2021) with the stage tables of torchvision's
// efficientnet.py and Keras' efficientnet_v2.py. Layer names are torchvision's,
// so its state_dict names are segnet's parameter names:
//   features.0            stem: 3×3 stride-2 conv, BN, SiLU
//   features.s.j          stage s, block j:
//     FusedMBConv         block.0 = k×k conv (stride) to in·e, BN, SiLU; block.1 = 1×1 conv to out, BN
//                         (expansion 1: block.0 = k×k conv to out, BN, SiLU)
//     MBConv              block.0 = 1×1 expand, BN, SiLU; block.1 = k×k depthwise (stride), BN, SiLU;
//                         block.2 = squeeze-excitation (fc1 to max(1, in/4), SiLU, fc2, sigmoid);
//                         block.3 = 1×1 project, BN
//     a block with stride 1 and in = out adds its input back after stochastic depth
//     with rate 0.2·b/B (b counts every block from 0, B blocks in all)
//   features.S+1          head: 1×1 conv to 1280, BN, SiLU
//   avgpool, classifier.0 dropout, classifier.1 dense
// BN eps is 1e-3 throughout.

typedef struct { int fused, expand, kernel, stride, cin, cout, layers; } EffStage;
typedef struct {
    const char *name;
    const EffStage *stages; int n_stages;
    int head_channels;
    float dropout;
} EffSpec;

static const EffStage EFFV2_S_STAGES[] = {
    {1, 1, 3, 1, 24, 24, 2}, {1, 4, 3, 2, 24, 48, 4}, {1, 4, 3, 2, 48, 64, 4},
    {0, 4, 3, 2, 64, 128, 6}, {0, 6, 3, 1, 128, 160, 9}, {0, 6, 3, 2, 160, 256, 15},
};
static const EffStage EFFV2_M_STAGES[] = {
    {1, 1, 3, 1, 24, 24, 3}, {1, 4, 3, 2, 24, 48, 5}, {1, 4, 3, 2, 48, 80, 5},
    {0, 4, 3, 2, 80, 160, 7}, {0, 6, 3, 1, 160, 176, 14}, {0, 6, 3, 2, 176, 304, 18},
    {0, 6, 3, 1, 304, 512, 5},
};
static const EffStage EFFV2_L_STAGES[] = {
    {1, 1, 3, 1, 32, 32, 4}, {1, 4, 3, 2, 32, 64, 7}, {1, 4, 3, 2, 64, 96, 7},
    {0, 4, 3, 2, 96, 192, 10}, {0, 6, 3, 1, 192, 224, 19}, {0, 6, 3, 2, 224, 384, 25},
    {0, 6, 3, 1, 384, 640, 7},
};
// tiny: every block type (fused with and without expansion, MBConv with SE,
// residual and strided blocks) and the same five stride-2 steps, for fast tests
static const EffStage EFFV2_T_STAGES[] = {
    {1, 1, 3, 1, 8, 8, 1}, {1, 4, 3, 2, 8, 16, 2}, {1, 4, 3, 2, 16, 24, 1},
    {0, 4, 3, 2, 24, 32, 2}, {0, 6, 3, 1, 32, 40, 1}, {0, 6, 3, 2, 40, 48, 1},
};
#define EFF_SPEC(n, st, head, drop) {n, st, (int)(sizeof st / sizeof st[0]), head, drop}
static const EffSpec EFF_SPECS[] = {
    EFF_SPEC("effv2-s", EFFV2_S_STAGES, 1280, 0.2f),
    EFF_SPEC("effv2-m", EFFV2_M_STAGES, 1280, 0.3f),
    EFF_SPEC("effv2-l", EFFV2_L_STAGES, 1280, 0.4f),
    EFF_SPEC("effv2-t", EFFV2_T_STAGES, 64, 0.2f),
};
#define EFF_STOCHASTIC_DEPTH 0.2f

static const EffSpec *eff_spec(const char *name) {
    for (size_t i = 0; i < sizeof EFF_SPECS / sizeof EFF_SPECS[0]; i++)
        if (!strcmp(EFF_SPECS[i].name, name)) return &EFF_SPECS[i];
    return NULL;
}

// conv (no bias) → BN (eps) → act, named P.0 and P.1 as torchvision's Conv2dNormActivation
static int conv_bn_act(Graph *g, const char *p, int x, int cout, int k, int stride, int groups, PadMode pad,
                       float eps, Act act) {
    char b[2 * SN_NAME_MAX];
    int c = graph_conv(g, lname(b, p, "0"), x, cout, k, stride, groups, pad, 0);
    return graph_bn(g, lname(b, p, "1"), c, eps, act);
}

static int squeeze_excitation(Graph *g, const char *p, int x, int squeeze) {
    char b[2 * SN_NAME_MAX];
    int s = graph_gap(g, lname(b, p, "avgpool"), x);
    s = graph_se_gate(g, p, s, squeeze, ACT_SILU, ACT_SIGMOID);  // fc1, SiLU, fc2, sigmoid
    return graph_scale(g, lname(b, p, "scale"), x, s);
}

// The EfficientNetV2 feature extractor, from the 0..255 input to the head
// activation. stage_out[s] receives the output of features.s (s = 0..S+1).
static int effnetv2_features(Graph *g, const EffSpec *sp, int x, PadMode pad, int *stage_out) {
    char p[SN_NAME_MAX], b[2 * SN_NAME_MAX];
    graph_begin_stage(g, "stem");
    graph_begin_block(g);
    // Keras include_preprocessing for V2-S/M/L: Rescaling(1/128, offset -1)
    x = graph_rescale(g, "rescale", x, 1.0f / 128.0f, -1.0f);
    x = conv_bn_act(g, "features.0", x, sp->stages[0].cin, 3, 2, 1, pad, BN_EPS_EFFNET, ACT_SILU);
    stage_out[0] = x;
    int total = 0, b_id = 0;
    for (int s = 0; s < sp->n_stages; s++) total += sp->stages[s].layers;
    for (int s = 0; s < sp->n_stages; s++) {
        const EffStage *st = &sp->stages[s];
        snprintf(p, sizeof p, "stage%d", s + 1);
        graph_begin_stage(g, p);
        for (int j = 0; j < st->layers; j++, b_id++) {
            graph_begin_block(g);
            int cin = j == 0 ? st->cin : st->cout, stride = j == 0 ? st->stride : 1;
            int exp = cin * st->expand;
            snprintf(p, sizeof p, "features.%d.%d", s + 1, j);
            int y;
            if (st->fused && st->expand == 1) {
                y = conv_bn_act(g, lname(b, p, "block.0"), x, st->cout, st->kernel, stride, 1, pad, BN_EPS_EFFNET, ACT_SILU);
            } else if (st->fused) {
                y = conv_bn_act(g, lname(b, p, "block.0"), x, exp, st->kernel, stride, 1, pad, BN_EPS_EFFNET, ACT_SILU);
                y = conv_bn_act(g, lname(b, p, "block.1"), y, st->cout, 1, 1, 1, pad, BN_EPS_EFFNET, ACT_NONE);
            } else {
                y = conv_bn_act(g, lname(b, p, "block.0"), x, exp, 1, 1, 1, pad, BN_EPS_EFFNET, ACT_SILU);
                y = conv_bn_act(g, lname(b, p, "block.1"), y, exp, st->kernel, stride, exp, pad, BN_EPS_EFFNET, ACT_SILU);
                y = squeeze_excitation(g, lname(b, p, "block.2"), y, cin / 4 > 1 ? cin / 4 : 1);
                y = conv_bn_act(g, lname(b, p, "block.3"), y, st->cout, 1, 1, 1, pad, BN_EPS_EFFNET, ACT_NONE);
            }
            if (stride == 1 && cin == st->cout) {
                y = graph_drop_path_add(g, lname(b, p, "stochastic_depth_add"), y, x,
                                        EFF_STOCHASTIC_DEPTH * (float)b_id / (float)total);
            }
            x = y;
        }
        stage_out[s + 1] = x;
    }
    graph_begin_stage(g, "head");
    graph_begin_block(g);
    snprintf(p, sizeof p, "features.%d", sp->n_stages + 1);
    x = conv_bn_act(g, p, x, sp->head_channels, 1, 1, 1, pad, BN_EPS_EFFNET, ACT_SILU);
    stage_out[sp->n_stages + 1] = x;
    return x;
}

ModelCfg model_cfg_default(void) {
    ModelCfg c = {"unet", 4, 1, 256, 256, PAD_SAME, 0, 4, 32, 0, -1.0f};
    return c;
}

// GAP → dropout → dense(classes), or GAP → dropout → dense(H) ReLU → dropout → dense(classes)
static int classifier_head(Graph *g, int x, const EffSpec *sp, const ModelCfg *c) {
    graph_begin_stage(g, "classifier");
    graph_begin_block(g);
    const float rate = c->dropout >= 0.0f ? c->dropout : sp->dropout;
    x = graph_dropout(g, "classifier.0", graph_gap(g, "avgpool", x), rate);
    if (c->head_hidden > 0) {
        x = graph_act(g, "classifier.2", graph_dense(g, "classifier.1", x, c->head_hidden, 1), ACT_RELU);
        x = graph_dropout(g, "classifier.3", x, rate);
        return graph_dense(g, "classifier.4", x, c->classes, 1);
    }
    return graph_dense(g, "classifier.1", x, c->classes, 1);
}

// two 3×3 conv (no bias) → BN → ReLU, named P.conv1.{0,1} and P.conv2.{0,1}
static int double_conv(Graph *g, const char *p, int x, int ch, float eps) {
    char b[2 * SN_NAME_MAX];
    x = conv_bn_act(g, lname(b, p, "conv1"), x, ch, 3, 1, 1, PAD_SYMMETRIC, eps, ACT_RELU);
    return conv_bn_act(g, lname(b, p, "conv2"), x, ch, 3, 1, 1, PAD_SYMMETRIC, eps, ACT_RELU);
}

// The classic U-Net (Ronneberger et al. 2015, with BN and same-size convs):
// level i (0..D) has W·2^i channels; D 2×2 max-pools down, D nearest 2×
// upsamplings each concatenated with the encoder level of that size; 1×1 head.
static int unet_build(Graph *g, const ModelCfg *c) {
    int div = 1 << c->depth;
    if (c->depth < 1 || c->depth > 8 || c->width_base < 1) {
        graph_fail(g, "model 'unet': depth %d must be 1..8 and width %d positive", c->depth, c->width_base);
        return -1;
    }
    if (c->height % div || c->width % div) {
        graph_fail(g, "model 'unet' (depth %d): input %dx%d must be a multiple of %d on each side (e.g. %dx%d)",
                   c->depth, c->height, c->width, div, (c->height + div - 1) / div * div, (c->width + div - 1) / div * div);
        return -1;
    }
    char p[SN_NAME_MAX], b[2 * SN_NAME_MAX];
    int skip[9];
    int x = graph_input(g, shape4(c->batch, c->height, c->width, 3));
    x = graph_rescale(g, "rescale", x, 1.0f / 128.0f, -1.0f);  // 0..255 input, as for the EfficientNets
    for (int i = 0; i <= c->depth; i++) {
        snprintf(p, sizeof p, "enc%d", i);
        graph_begin_stage(g, p);
        graph_begin_block(g);
        if (i > 0) x = graph_maxpool(g, lname(b, p, "pool"), x);
        x = skip[i] = double_conv(g, p, x, c->width_base << i, BN_EPS_UNET);
    }
    for (int i = c->depth - 1; i >= 0; i--) {
        snprintf(p, sizeof p, "dec%d", i);
        graph_begin_stage(g, p);
        graph_begin_block(g);
        x = graph_concat(g, lname(b, p, "cat"), graph_upsample(g, lname(b, p, "up"), x), skip[i]);
        x = double_conv(g, p, x, c->width_base << i, BN_EPS_UNET);
    }
    graph_begin_stage(g, "head");
    return graph_conv(g, "head", x, c->classes, 1, 1, 1, PAD_SAME, 1);
}

// U-Net on an EfficientNetV2 encoder, decoder as segmentation_models' Unet:
// skips at strides 16, 8, 4, 2 from the last stage at each resolution, the /32
// head activation as the bottleneck; per decoder stage nearest 2× upsample →
// concat skip → two 3×3 conv-BN-ReLU with (256,128,64,32,16) filters; a 3×3
// conv with bias to the class logits.
static const int UNET_DECODER_CHANNELS[5] = {256, 128, 64, 32, 16};

static int unet_effnetv2_build(Graph *g, const ModelCfg *c, const EffSpec *sp) {
    if (c->height % 32 || c->width % 32) {
        graph_fail(g, "model '%s': input %dx%d must be a multiple of 32 on each side (e.g. %dx%d)",
                   c->model, c->height, c->width, (c->height + 31) / 32 * 32, (c->width + 31) / 32 * 32);
        return -1;
    }
    int stage_out[16];
    int x = graph_input(g, shape4(c->batch, c->height, c->width, 3));
    x = effnetv2_features(g, sp, x, c->pad, stage_out);
    if (g->err[0]) return -1;
    // the last stage output at strides 2, 4, 8, 16
    int skip[5] = {-1, -1, -1, -1, -1};
    for (int s = 0; s <= sp->n_stages; s++) {
        int stride = c->height / tshape(g, stage_out[s]).h;
        for (int k = 1; k <= 4; k++) if (stride == 1 << k) skip[k] = stage_out[s];
    }
    char p[SN_NAME_MAX], b[2 * SN_NAME_MAX];
    for (int i = 0; i < 5; i++) {
        snprintf(p, sizeof p, "decoder.blocks.%d", i);
        graph_begin_stage(g, p);
        graph_begin_block(g);
        x = graph_upsample(g, lname(b, p, "up"), x);
        int sk = skip[4 - i];
        if (i < 4) {
            if (sk < 0) { graph_fail(g, "model '%s': the encoder has no stage at stride %d", c->model, 1 << (4 - i)); return -1; }
            x = graph_concat(g, lname(b, p, "cat"), x, sk);
        }
        x = double_conv(g, p, x, UNET_DECODER_CHANNELS[i], BN_EPS_UNET);
    }
    graph_begin_stage(g, "segmentation_head");
    return graph_conv(g, "segmentation_head.0", x, c->classes, 3, 1, 1, PAD_SYMMETRIC, 1);
}

// Builds the model named in c; returns the logits tensor, or -1 with g->err set.
static int model_build_unchecked(Graph *g, const ModelCfg *c) {
    if (c->classes < 1 || c->batch < 1 || c->height < 1 || c->width < 1) {
        graph_fail(g, "model '%s': classes %d, batch %d and size %dx%d must be positive",
                   c->model, c->classes, c->batch, c->height, c->width);
        return -1;
    }
    g->init = strcmp(c->model, "unet") ? INIT_EFFNET : INIT_TORCH_DEFAULT;  // unet-effv2: the encoder's
    if (!strcmp(c->model, "unet")) return unet_build(g, c);
    if (!strncmp(c->model, "unet-", 5) && eff_spec(c->model + 5)) return unet_effnetv2_build(g, c, eff_spec(c->model + 5));
    const EffSpec *sp = eff_spec(c->model);
    if (!sp) {
        graph_fail(g, "unknown model '%s' (models: unet, effv2-s, effv2-m, effv2-l, effv2-t, "
                   "unet-effv2-s, unet-effv2-m, unet-effv2-l, unet-effv2-t)", c->model);
        return -1;
    }
    int stage_out[16];
    int x = graph_input(g, shape4(c->batch, c->height, c->width, 3));
    x = effnetv2_features(g, sp, x, c->pad, stage_out);
    return classifier_head(g, x, sp, c);
}

// The model's graph: its logits, or -1 with g->err (also when a tensor failed
// a check after which building went on).
int model_build(Graph *g, const ModelCfg *c) {
    int logits = model_build_unchecked(g, c);
    return g->err[0] ? -1 : logits;
}

static int is_backbone_layer(const Layer *l) { return !strncmp(l->name, "features.", 9) || !strncmp(l->name, "enc", 3); }

int graph_freeze_base(Graph *g, int unfreeze_last) {
    int n_blocks = 0, seen = 0, last = -1;
    for (int i = 0; i < g->n_layers; i++)
        if (is_backbone_layer(&g->layers[i]) && g->layers[i].block != last) { n_blocks++; last = g->layers[i].block; }
    last = -1;
    for (int i = 0; i < g->n_layers; i++) {
        Layer *l = &g->layers[i];
        if (!is_backbone_layer(l)) continue;
        if (l->block != last) { seen++; last = l->block; }
        l->frozen = seen <= n_blocks - unfreeze_last;
    }
    return n_blocks;
}

// ----------------------------------------------------------------------------
// initial weights

// one layer's weight (and bias) in host: its own random stream, by parameter id
static void init_weights(const Graph *g, LayerKind kind, const ConvCfg *conv, int weight, int bias, uint64_t seed,
                         float *host) {
    const ParamInfo *p = &g->params[weight];
    float *w = host + p->offset;
    Rng r;  // one stream per tensor: adding a layer does not reshuffle the others
    rng_seed(&r, rng_mix64(seed ^ rng_mix64((uint64_t)weight + 1)));
    if ((kind == LAYER_CONV || kind == LAYER_DENSE) && g->init == INIT_TORCH_DEFAULT) {
        float bound = 1.0f / sqrtf((float)(conv->cin / conv->groups * conv->kh * conv->kw));
        for (size_t k = 0; k < p->count; k++) w[k] = bound * (2.0f * rng_float(&r) - 1.0f);
        if (bias >= 0) {
            const ParamInfo *pb = &g->params[bias];
            for (size_t k = 0; k < pb->count; k++) host[pb->offset + k] = bound * (2.0f * rng_float(&r) - 1.0f);
        }
    } else if (kind == LAYER_CONV) {
        double std = sqrt(2.0 / ((double)conv->cout * conv->kh * conv->kw));
        for (size_t k = 0; k < p->count; k++) w[k] = (float)(std * rng_normal(&r));
    } else if (kind == LAYER_DENSE) {
        float range = 1.0f / sqrtf((float)conv->cout);
        for (size_t k = 0; k < p->count; k++) w[k] = range * (2.0f * rng_float(&r) - 1.0f);
    } else if (kind == LAYER_BN) {
        for (size_t k = 0; k < p->count; k++) w[k] = 1.0f;
    }
}

void net_init_params(Net *net, uint64_t seed) {
    const Graph *g = net->g;
    float *host = calloc(g->n_param_floats ? g->n_param_floats : 1, sizeof(float));
    snCheck(host != NULL, "out of host memory");
    for (int i = 0; i < g->n_layers; i++) {
        const Layer *l = &g->layers[i];
        if (l->weight < 0) continue;
        if (l->kind == LAYER_SE_GATE) {  // fc1 and fc2 as the 1×1 convs they are
            const ConvCfg fc2 = {l->conv.cout, l->conv.cin, 1, 1, 1, 1, PAD_SAME, 1};
            init_weights(g, LAYER_CONV, &l->conv, l->weight, l->bias, seed, host);
            init_weights(g, LAYER_CONV, &fc2, l->weight2, l->bias2, seed, host);
        } else {
            init_weights(g, l->kind, &l->conv, l->weight, l->bias, seed, host);
        }
    }
    net->o->upload(net->o, net->params, host, sizeof(float) * g->n_param_floats);
    free(host);
}

// ============================================================================
// PART III. THE STEP
// What runs a graph: memory planned before the first step, fused layers, the
// executor that calls only an ops table, and one training step.
// ============================================================================

// ----------------------------------------------------------------------------
// memory planning: every activation and gradient gets a lifetime over the
// step's schedule of slots and an offset in one arena
//
// slots: forward of layer 0..L-1, the loss, then backward from layer L-1 to 0;
// with checkpointing, just before the backward of a block's last layer, the
// block's forward runs again (recompute slots). A buffer lives from the slot
// that writes it to the last slot that reads it:
//   activation  written by its producer's forward (or recompute); read by its
//               consumers' forwards (and recomputes), by the backward of a
//               consumer whose gradient needs its input (layer_backward_reads),
//               and, for the output, by the loss
//   gradient    written first by the backward of its last consumer (the loss,
//               for the output); read last by its producer's backward
// With checkpointing, a tensor produced and consumed inside one block keeps no
// forward life past its consumers: it lives again from the recompute. Only
// the layers producing such tensors run again; the others' outputs are kept.
// Offsets: largest buffer first, each in a gap between the placed buffers
// whose lifetimes intersect its own: the lowest gap that fits (first fit), or
// the smallest (best fit); the plan keeps the packing with the lower peak.

// Does layer l's backward read its input k (given whether it computes weight gradients)?
static int layer_backward_reads(const Layer *l, int k) {
    switch (l->kind) {
    case LAYER_CONV: case LAYER_DENSE: return k == 0 && !l->frozen && (l->weight >= 0 || l->bias >= 0);
    case LAYER_BN: case LAYER_ACT: case LAYER_MAXPOOL: case LAYER_SE_GATE: return k == 0;
    case LAYER_SCALE: return 1;
    default: return 0;
    }
}

// ----------------------------------------------------------------------------
// fusing layers
//
// A batch norm's output usually goes straight into one cheap layer. Where that
// layer only reads the tensor once more, the executor hands its work to the
// batch norm's ops (BnNext), which on a GPU saves a pass over the tensor and a
// kernel launch:
//   FUSED_POOL      squeeze-excitation's pool of the BN's output (forward; the
//                   output is still written, the channel scale reads it);
//   FUSED_RESIDUAL  a residual block's end, drop_path(BN output) + residual,
//                   when nothing else reads the BN's output (forward and
//                   backward: the BN's output and its gradient need not pass
//                   through memory).
// The results are the unfused ones, bit for bit (tests: fuse_layers 0). The
// plan gives the fused layer its batch norm's slots, so that what either
// layer touches is alive while the fused op runs.
int fuse_layers = 1;

Fusion layer_fusion(const Graph *g, int j) {
    if (!fuse_layers || j < 1 || j >= g->n_layers) return FUSED_NONE;
    const Layer *bn = &g->layers[j - 1], *l = &g->layers[j];
    if (bn->kind != LAYER_BN || l->in[0] != bn->out || l->block != bn->block) return FUSED_NONE;
    if (l->kind == LAYER_GAP) return FUSED_POOL;
    if (l->kind != LAYER_DROP_PATH || l->in[1] < 0 || l->in[1] == bn->out || bn->out == g->layers[g->n_layers - 1].out)
        return FUSED_NONE;
    for (int i = 0; i < g->n_layers; i++)
        if (i != j && (g->layers[i].in[0] == bn->out || g->layers[i].in[1] == bn->out)) return FUSED_NONE;
    return FUSED_RESIDUAL;
}

void graph_needs_grad(const Graph *g, int input_needs_grad, int *needs_grad) {
    memset(needs_grad, 0, sizeof(int) * (size_t)g->n_tensors);
    needs_grad[g->input] = input_needs_grad;
    for (int i = 0; i < g->n_layers; i++) {
        const Layer *l = &g->layers[i];
        int ng = !l->frozen && l->weight >= 0;
        for (int k = 0; k < 2; k++) if (l->in[k] >= 0) ng |= needs_grad[l->in[k]];
        needs_grad[l->out] = ng;
    }
}

void plan_free(Plan *p) {
    free(p->slot_kind); free(p->slot_layer); free(p->bufs);
    free(p->fwd_slot); free(p->rec_slot); free(p->bwd_slot); free(p->recompute);
    free(p->start_head); free(p->start_next); free(p->end_head); free(p->end_next);
    memset(p, 0, sizeof *p);
}

// Every buffer takes a multiple of SN_TENSOR_ALIGN bytes, so that every tensor
// of the arena starts aligned for the GPU's 16-byte vector accesses.
static int plan_add(Plan *p, int tensor, int is_grad, int recompute, int first, int last, size_t bytes) {
    PlanBuffer *b = &p->bufs[p->n_bufs];
    b->tensor = tensor; b->is_grad = is_grad; b->recompute = recompute;
    b->first = first; b->last = last; b->offset = 0;
    b->bytes = (bytes + SN_TENSOR_ALIGN - 1) / SN_TENSOR_ALIGN * SN_TENSOR_ALIGN;
    return p->n_bufs++;
}

static int cmp_buffer_size(const void *a, const void *b, void *bufs_) {
    const PlanBuffer *bufs = bufs_, *x = &bufs[*(const int *)a], *y = &bufs[*(const int *)b];
    if (x->bytes != y->bytes) return x->bytes > y->bytes ? -1 : 1;
    if (x->first != y->first) return x->first < y->first ? -1 : 1;
    return *(const int *)a - *(const int *)b;
}

// Places the buffers in `order` (placed, live: scratch of n_bufs ints); each goes
// into a gap among the placed buffers alive at the same time: the lowest that
// fits (first fit) or the smallest (best fit). Returns the arena's bytes.
// `placed` is kept in offset order, so the live buffers come out in it.
static size_t plan_pack(Plan *p, const int *order, int best_fit, size_t workspace, int *placed, int *live) {
    size_t peak = workspace;
    int n_placed = 0;
    for (int k = 0; k < p->n_bufs; k++) {
        PlanBuffer *b = &p->bufs[order[k]];
        int n_live = 0;
        for (int j = 0; j < n_placed; j++) {
            const PlanBuffer *q = &p->bufs[placed[j]];
            if (q->first <= b->last && b->first <= q->last) live[n_live++] = placed[j];
        }
        size_t at = workspace, gap_best = SIZE_MAX, from = workspace;  // from: where the next gap starts
        for (int j = 0; j <= n_live; j++) {
            const size_t to = j < n_live ? p->bufs[live[j]].offset : SIZE_MAX;  // the gap [from, to)
            if (to >= from && to - from >= b->bytes && to - from < gap_best) {
                at = from;
                gap_best = to - from;
                if (!best_fit) break;
            }
            if (j < n_live && p->bufs[live[j]].offset + p->bufs[live[j]].bytes > from)
                from = p->bufs[live[j]].offset + p->bufs[live[j]].bytes;
        }
        b->offset = at;
        if (at + b->bytes > peak) peak = at + b->bytes;
        int j = n_placed++;
        for (; j > 0 && p->bufs[placed[j - 1]].offset > at; j--) placed[j] = placed[j - 1];
        placed[j] = order[k];
    }
    return peak;
}

void plan_build(Plan *p, const Graph *g, const int *needs_grad, DType dtype, int output, int checkpoint, size_t workspace) {
    memset(p, 0, sizeof *p);
    const int L = g->n_layers, T = g->n_tensors;
    p->checkpoint = checkpoint;
    workspace = (workspace + SN_TENSOR_ALIGN - 1) / SN_TENSOR_ALIGN * SN_TENSOR_ALIGN;  // the tensors after it stay aligned
    p->workspace = workspace;
    p->fwd_slot = malloc(sizeof(int) * L); p->rec_slot = malloc(sizeof(int) * L); p->bwd_slot = malloc(sizeof(int) * L);
    p->recompute = calloc((size_t)L, sizeof(int));
    p->slot_kind = malloc(sizeof(int) * (3 * L + 1)); p->slot_layer = malloc(sizeof(int) * (3 * L + 1));
    p->bufs = calloc((size_t)3 * T + 1, sizeof(PlanBuffer));
    snCheck(p->fwd_slot && p->rec_slot && p->bwd_slot && p->slot_kind && p->slot_layer && p->bufs, "out of host memory");
    // the schedule; a block is recomputed only if some layer of it runs a backward
    int n = 0;
    for (int i = 0; i < L; i++) { p->fwd_slot[i] = n; p->slot_kind[n] = SLOT_FORWARD; p->slot_layer[n++] = i; }
    p->loss_slot = n; p->slot_kind[n] = SLOT_LOSS; p->slot_layer[n++] = -1;
    for (int i = 0; i < L; i++) p->rec_slot[i] = -1;
    for (int i = L - 1; i >= 0; i--) {
        if (checkpoint && (i == L - 1 || g->layers[i + 1].block != g->layers[i].block)) {
            int first = i, backward = 0;
            while (first > 0 && g->layers[first - 1].block == g->layers[i].block) first--;
            for (int j = first; j <= i; j++) backward |= needs_grad[g->layers[j].out];
            for (int j = first; backward && j <= i; j++) { p->rec_slot[j] = n; p->slot_kind[n] = SLOT_RECOMPUTE; p->slot_layer[n++] = j; }
        }
        p->bwd_slot[i] = n; p->slot_kind[n] = SLOT_BACKWARD; p->slot_layer[n++] = i;
    }
    p->n_slots = n;
    Fusion *fusion = malloc(sizeof(Fusion) * (size_t)(L + 1));
    snCheck(fusion != NULL, "out of host memory");
    for (int j = 0; j < L; j++) fusion[j] = layer_fusion(g, j);
    fusion[L] = FUSED_NONE;
    for (int j = 1; j < L; j++) {  // a fused layer runs in its batch norm's slots (their own stay empty)
        const Fusion f = fusion[j];
        if (f == FUSED_NONE) continue;
        p->fwd_slot[j] = p->fwd_slot[j - 1];
        if (p->rec_slot[j] >= 0) p->rec_slot[j] = p->rec_slot[j - 1];
        if (f == FUSED_RESIDUAL) p->bwd_slot[j] = p->bwd_slot[j - 1];
    }
    // lifetimes
    for (int t = 0; t < T; t++) {
        const size_t bytes = shape_numel(g->tensors[t].shape) * dtype_size(dtype);
        const int prod = g->tensors[t].producer;
        if (prod >= 0 && fusion[prod + 1] == FUSED_RESIDUAL) continue;  // y of a fused residual end: no memory
        const int block = prod >= 0 ? g->layers[prod].block : -1;
        int internal = checkpoint && prod >= 0 && t != output && p->rec_slot[prod] >= 0;
        int fwd_last = prod >= 0 ? p->fwd_slot[prod] : 0, keep_last = fwd_last, rec_last = -1;
        int grad_first = -1;
        for (int i = 0; i < L; i++) {
            const Layer *c = &g->layers[i];
            for (int k = 0; k < 2; k++) {
                if (c->in[k] != t) continue;
                if (c->block != block) internal = 0;
                const int reads = needs_grad[c->out] && layer_backward_reads(c, k);
                const int use = reads ? p->bwd_slot[i] : p->rec_slot[i] >= 0 ? p->rec_slot[i] : p->fwd_slot[i];
                if (p->fwd_slot[i] > fwd_last) fwd_last = p->fwd_slot[i];
                if (use > keep_last) keep_last = use;
                if (p->rec_slot[i] >= 0 && p->rec_slot[i] > keep_last) keep_last = p->rec_slot[i];
                if (use > rec_last) rec_last = use;
                if (needs_grad[c->out] && needs_grad[t] && (grad_first < 0 || p->bwd_slot[i] < grad_first))
                    grad_first = p->bwd_slot[i];
            }
        }
        if (t == output) { keep_last = fwd_last = p->loss_slot; grad_first = p->loss_slot; }
        const int first = prod >= 0 ? p->fwd_slot[prod] : 0;
        if (internal) {
            p->recompute[prod] = 1;
            plan_add(p, t, 0, 0, first, fwd_last, bytes);
            plan_add(p, t, 0, 1, p->rec_slot[prod], rec_last > p->rec_slot[prod] ? rec_last : p->rec_slot[prod], bytes);
        } else {
            plan_add(p, t, 0, 0, first, keep_last, bytes);
        }
        if (needs_grad[t]) {
            int last = prod >= 0 ? p->bwd_slot[prod] : p->n_slots - 1;
            if (grad_first < 0) grad_first = last;  // no path to the loss: zero-filled by its producer's backward
            plan_add(p, t, 1, 0, grad_first, last, bytes);
        }
    }
    // offsets: the workspace first, at 0, for the whole step; the lower of the two packings
    int *order = malloc(sizeof(int) * (size_t)(p->n_bufs + 1)), *placed = malloc(sizeof(int) * (size_t)(p->n_bufs + 1));
    int *live = malloc(sizeof(int) * (size_t)(p->n_bufs + 1));
    size_t *lowest = malloc(sizeof(size_t) * (size_t)(p->n_bufs + 1));
    snCheck(order && placed && live && lowest, "out of host memory");
    for (int b = 0; b < p->n_bufs; b++) order[b] = b;
    qsort_r(order, (size_t)p->n_bufs, sizeof(int), cmp_buffer_size, p->bufs);
    size_t peak = plan_pack(p, order, 0, workspace, placed, live);
    for (int b = 0; b < p->n_bufs; b++) lowest[b] = p->bufs[b].offset;
    const size_t best_fit_peak = plan_pack(p, order, 1, workspace, placed, live);
    if (best_fit_peak < peak) peak = best_fit_peak;
    else for (int b = 0; b < p->n_bufs; b++) p->bufs[b].offset = lowest[b];
    free(live); free(lowest); free(fusion);
    free(order); free(placed);
    p->peak = peak;
    // which buffers start and end at each slot
    p->start_head = malloc(sizeof(int) * (size_t)p->n_slots); p->end_head = malloc(sizeof(int) * (size_t)p->n_slots);
    p->start_next = malloc(sizeof(int) * (size_t)p->n_bufs + 1); p->end_next = malloc(sizeof(int) * (size_t)p->n_bufs + 1);
    snCheck(p->start_head && p->end_head && p->start_next && p->end_next, "out of host memory");
    for (int s = 0; s < p->n_slots; s++) p->start_head[s] = p->end_head[s] = -1;
    for (int b = p->n_bufs - 1; b >= 0; b--) {
        p->start_next[b] = p->start_head[p->bufs[b].first]; p->start_head[p->bufs[b].first] = b;
        p->end_next[b] = p->end_head[p->bufs[b].last]; p->end_head[p->bufs[b].last] = b;
    }
}

// ----------------------------------------------------------------------------
// executing a graph

// Views use the current batch size: every op takes N from its tensors, so a
// smaller last batch runs in the same memory.
static Shape net_shape(const Net *net, int t) {
    Shape s = net->g->tensors[t].shape;
    s.n = net->batch;
    return s;
}
Tensor net_tensor(const Net *net, int t) { return tensor(net->act[t], net_shape(net, t), net->dtype); }
Tensor net_grad(const Net *net, int t) { return tensor(net->grad[t], net_shape(net, t), net->dtype); }

static float *param_ptr(float *base, const Graph *g, int id) { return id < 0 ? NULL : base + g->params[id].offset; }
// a parameter in the storage type (weights_in_storage_type), or NULL
static const void *param_cast(const Net *net, int id) {
    return id < 0 || !net->params_cast ? NULL : (const char *)net->params_cast + net->g->params[id].offset * dtype_size(net->dtype);
}
// a parameter's gradient, NULL when it has none (no parameter, or frozen)
static float *grad_ptr(const Net *net, int id) {
    return id < 0 || net->grad_offset[id] == SIZE_MAX ? NULL : net->grads + net->grad_offset[id];
}

// Gradients exist for the parameters of layers not frozen when the net is
// created, packed in parameter order: the layout of the optimiser's moments.
static size_t grad_layout(const Graph *g, size_t *grad_offset) {
    for (int p = 0; p < g->n_params; p++) grad_offset[p] = SIZE_MAX;
    for (int i = 0; i < g->n_layers; i++) {
        const Layer *l = &g->layers[i];
        if (l->frozen) continue;
        int ids[4];
        for (int k = layer_params(l, ids); k-- > 0;) grad_offset[ids[k]] = 0;
    }
    size_t n = 0;
    for (int p = 0; p < g->n_params; p++)
        if (grad_offset[p] != SIZE_MAX) { grad_offset[p] = n; n += g->params[p].count; }
    return n;
}
static float *buffer_ptr(const Net *net, int id) { return net->buffers + net->g->buffers[id].offset; }

uint64_t net_layer_seed(const Net *net, int layer) {
    return rng_mix64(rng_mix64(net->seed ^ rng_mix64(net->step)) + (uint64_t)layer);
}
void net_layer_seeds(const Net *net, uint64_t *seeds) {
    for (int i = 0; i < net->g->n_layers; i++) seeds[i] = net_layer_seed(net, i);
}
// The dropout ops read their seeds from backend memory (so that a replayed
// step reads this step's): uploaded here unless the trainer already queued
// them for this (seed, step).
static void net_seeds_current(Net *net) {
    if (net->seeds_set && net->seeds_of[0] == net->seed && net->seeds_of[1] == net->step) return;
    const int L = net->g->n_layers;
    uint64_t *seeds = malloc(sizeof(uint64_t) * (size_t)L);
    snCheck(seeds != NULL, "out of host memory");
    net_layer_seeds(net, seeds);
    net->o->upload(net->o, net->layer_seeds, seeds, sizeof(uint64_t) * (size_t)L);
    free(seeds);
    net->seeds_of[0] = net->seed; net->seeds_of[1] = net->step; net->seeds_set = 1;
}

void net_free(Net *net) {
    Ops *o = net->o;
    if (!o) return;
    const Graph *g = net->g;
    if (net->plan) { plan_free(net->plan); free(net->plan); o->free(o, net->arena); net->ws = NULL; }
    else for (int t = 0; net->act && t < g->n_tensors; t++) { o->free(o, net->act[t]); if (net->grad) o->free(o, net->grad[t]); }
    for (int l = 0; net->bn_mean && l < g->n_layers; l++) { o->free(o, net->bn_mean[l]); o->free(o, net->bn_var[l]); }
    o->free(o, net->params); o->free(o, net->grads); o->free(o, net->buffers);
    o->free(o, net->bn_scratch); o->free(o, net->bn_sums); o->free(o, net->ws); o->free(o, net->layer_seeds);
    o->free(o, net->params_cast);
    free(net->act); free(net->grad); free(net->needs_grad); free(net->grad_written); free(net->bn_mean); free(net->bn_var);
    free(net->fusion);
    free(net->grad_offset);
    memset(net, 0, sizeof *net);
}

// the largest conv workspace of the graph
static size_t net_workspace_bytes(const Graph *g, Ops *o, DType dtype) {
    size_t ws = 0;
    for (int i = 0; i < g->n_layers; i++) {
        const Layer *l = &g->layers[i];
        if (l->kind != LAYER_CONV && l->kind != LAYER_DENSE) continue;
        size_t w = o->conv2d_workspace(o, &l->conv, tshape(g, l->in[0]), dtype);
        if (w > ws) ws = w;
    }
    return ws;
}

// Entering a slot places the buffers whose life starts there; leaving it ends
// the lives that end there (poisoned with NaN when asked: a later read shows).
// Pointers stay where they were last placed: between steps nothing is alive,
// so the input's place can take the next batch before the forward.
static void plan_enter(Net *net, int slot) {
    const Plan *p = net->plan;
    for (int b = p->start_head[slot]; b >= 0; b = p->start_next[b]) {
        const PlanBuffer *q = &p->bufs[b];
        void *ptr = net->arena + q->offset;
        if (q->is_grad) net->grad[q->tensor] = ptr; else net->act[q->tensor] = ptr;
        if (q->offset + q->bytes > net->arena_high) net->arena_high = q->offset + q->bytes;
    }
}
static void plan_leave(Net *net, int slot) {
    const Plan *p = net->plan;
    for (int b = p->end_head[slot]; b >= 0; b = p->end_next[b]) {
        const PlanBuffer *q = &p->bufs[b];
        if (net->poison)
            net->o->fill(net->o, tensor(net->arena + q->offset, shape4((int)(q->bytes / dtype_size(net->dtype)), 1, 1, 1),
                                        net->dtype), NAN);
    }
}

// plan: NULL for one allocation per tensor, else the arena's layout (taken over)
static int net_create_with(Net *net, const Graph *g, Ops *o, DType dtype, int input_needs_grad, Plan *plan,
                           char err[SN_ERR_MAX]) {
    memset(net, 0, sizeof *net);
    net->g = g; net->o = o; net->dtype = dtype; net->input_needs_grad = input_needs_grad;
    if (g->err[0] || g->input < 0 || g->n_layers == 0) {
        snprintf(err, SN_ERR_MAX, "%s", g->err[0] ? g->err : "the graph has no input or no layers");
        return -1;
    }
    net->batch = g->tensors[g->input].shape.n;
    int T = g->n_tensors, L = g->n_layers;
    net->act = calloc((size_t)T, sizeof(void *));
    net->grad = calloc((size_t)T, sizeof(void *));
    net->needs_grad = calloc((size_t)T, sizeof(int));
    net->grad_written = calloc((size_t)T, sizeof(int));
    net->bn_mean = calloc((size_t)L, sizeof(float *));
    net->bn_var = calloc((size_t)L, sizeof(float *));
    net->fusion = calloc((size_t)L, sizeof(Fusion));
    snCheck(net->act && net->grad && net->needs_grad && net->grad_written && net->bn_mean && net->bn_var && net->fusion,
            "out of host memory");
    for (int j = 0; j < L; j++) net->fusion[j] = layer_fusion(g, j);

    // A tensor needs a gradient when a trainable parameter (or the input, if
    // asked) lies upstream of it; nothing below the lowest trainable layer does.
    graph_needs_grad(g, input_needs_grad, net->needs_grad);

    size_t ws = net_workspace_bytes(g, o, dtype);
    int cmax = 1, ok = 1;
    if (plan) {
        net->plan = plan;
        ok = (net->arena = o->alloc(o, plan->peak ? plan->peak : 1)) != NULL;
        net->ws = ws ? net->arena : NULL;
        net->ws_bytes = ws;
    }
    for (int t = 0; !plan && t < T && ok; t++) {
        size_t bytes = shape_numel(g->tensors[t].shape) * dtype_size(dtype);
        ok &= (net->act[t] = o->alloc(o, bytes)) != NULL;
        if (ok && net->needs_grad[t]) ok &= (net->grad[t] = o->alloc(o, bytes)) != NULL;
    }
    for (int i = 0; i < L && ok; i++) {
        const Layer *l = &g->layers[i];
        if (l->kind == LAYER_BN) {
            int C = tshape(g, l->in[0]).c;
            if (C > cmax) cmax = C;
            ok &= (net->bn_mean[i] = o->alloc(o, sizeof(float) * (size_t)C)) != NULL;
            ok &= (net->bn_var[i] = o->alloc(o, sizeof(float) * (size_t)C)) != NULL;
        }
    }
    size_t pbytes = sizeof(float) * g->n_param_floats, bbytes = sizeof(float) * g->n_buffer_floats;
    net->grad_offset = malloc(sizeof(size_t) * ((size_t)g->n_params + 1));
    snCheck(net->grad_offset != NULL, "out of host memory");
    net->n_grad_floats = grad_layout(g, net->grad_offset);
    if (ok) {
        net->params = o->alloc(o, pbytes);
        const int cast = o->weights_in_storage_type && dtype != DT_F32;
        if (cast) net->params_cast = o->alloc(o, g->n_param_floats * dtype_size(dtype));
        net->grads = o->alloc(o, sizeof(float) * (net->n_grad_floats ? net->n_grad_floats : 1));
        net->buffers = o->alloc(o, bbytes);
        net->bn_scratch = o->alloc(o, sizeof(float) * 2 * (size_t)cmax);
        net->bn_sums = o->alloc(o, sizeof(double) * 2 * (size_t)cmax);
        net->layer_seeds = o->alloc(o, sizeof(uint64_t) * (size_t)L);
        if (!plan) {
            net->ws_bytes = ws;
            net->ws = ws ? o->alloc(o, ws) : NULL;
        }
        ok = net->params && net->grads && net->buffers && net->bn_scratch && net->bn_sums && net->layer_seeds &&
             (!ws || net->ws) && (!cast || net->params_cast);
    }
    if (!ok) {
        snprintf(err, SN_ERR_MAX, "out of %s memory allocating the network's tensors (%.2f GiB for the step's arena: "
                 "segnet plan --memory SIZE finds a setting that fits)", o->name, plan ? plan->peak / 1073741824.0 : 0.0);
        if (plan && !net->plan) { plan_free(plan); free(plan); }
        net_free(net);
        return -1;
    }
    if (plan) plan_enter(net, 0);  // the input's place is known before the first forward
    o->fill(o, tensor_f32(net->params, shape4((int)g->n_param_floats, 1, 1, 1)), 0.0f);
    o->fill(o, tensor_f32(net->grads, shape4((int)net->n_grad_floats, 1, 1, 1)), 0.0f);
    // running statistics start at mean 0, variance 1
    for (int b = 0; b < g->n_buffers; b++) {
        int is_var = strstr(g->buffers[b].name, ".running_var") != NULL;
        o->fill(o, tensor_f32(net->buffers + g->buffers[b].offset, shape4((int)g->buffers[b].count, 1, 1, 1)),
                is_var ? 1.0f : 0.0f);
    }
    return 0;
}

int net_create(Net *net, const Graph *g, Ops *o, DType dtype, int input_needs_grad, char err[SN_ERR_MAX]) {
    return net_create_with(net, g, o, dtype, input_needs_grad, NULL, err);
}

int net_create_planned(Net *net, const Graph *g, Ops *o, DType dtype, int input_needs_grad, int output,
                       int checkpoint, char err[SN_ERR_MAX]) {
    if (g->err[0] || g->input < 0 || g->n_layers == 0) return net_create_with(net, g, o, dtype, input_needs_grad, NULL, err);
    int *needs_grad = malloc(sizeof(int) * (size_t)g->n_tensors);
    Plan *plan = malloc(sizeof *plan);
    snCheck(needs_grad && plan, "out of host memory");
    graph_needs_grad(g, input_needs_grad, needs_grad);
    plan_build(plan, g, needs_grad, dtype, output, checkpoint, net_workspace_bytes(g, o, dtype));
    free(needs_grad);
    return net_create_with(net, g, o, dtype, input_needs_grad, plan, err);
}

// BN in a layer uses batch statistics when training and not frozen (a frozen
// BN runs in inference mode, Keras' trainable=False); dropout and drop-path
// are active under the same condition.
static int layer_in_train_mode(const Net *net, const Layer *l) { return net->training && !l->frozen; }

// ---- batch norm across replicas (--sync-bn)
//
// Each reduction over the batch is a set of fp64 sums that the replicas add
// up before anything is rounded to fp32:
//   forward   Σx, Σx² per channel (bn_stats), all-reduced, then
//             mean = Σx/n, var = Σx²/n - mean² (bn_stats_finish: bn_moments_stats)
//   backward  Σg, Σg·xhat per channel (bn_backward_reduce), all-reduced, then
//             rounded once (bn_backward_finish: bn_grad_sums_store)
// One replica forms the same fp64 sums in one piece and rounds them with the
// same formulas, so N replicas differ from it only in the order of the fp64
// additions: 2^-53 of the summands' magnitude. That keeps the statistics the
// one replica's to the fp32 bit but for values within that distance of a
// rounding boundary, and keeps Σg accurate where it nearly cancels (a BN whose
// output reaches another BN through a conv: rounding each shard's sums to fp32
// before adding them moved a 2-level U-Net's first-step gradient by 1.4e-4).
// dgamma, dbeta come from the global sums on rank 0 only: the gradients'
// all-reduce then adds the other replicas' zeros to them. A replica with an
// empty shard takes part with zero sums.

static int bn_synced(const Net *net, const Layer *l) {
    return net->sync_bn && l->kind == LAYER_BN && layer_in_train_mode(net, l);
}

// net->bn_sums (2C fp64, this replica's over `count` values per channel) summed
// over the replicas: on a device with a device communicator (NCCL) in device
// memory, else through the host. Returns the global count, or 0 when the
// collective failed (net->failed is then set).
static size_t bn_sync_sums(Net *net, int C, size_t count) {
    Comm *comm = net->sync_bn;
    Ops *o = net->o;
    const size_t n = 2 * (size_t)C;
    if (!count) o->fill(o, tensor_f32((float *)net->bn_sums, shape4((int)(2 * n), 1, 1, 1)), 0.0f);  // fp64 zeros
#ifdef SEGNET_CUDA
    if (comm->device && o != &ops_cpu) {
        int64_t total = (int64_t)count;
        if (comm->allreduce_i64(comm, &total, 1) || comm->device->allreduce_f64(comm->device, net->bn_sums, n)) {
            net->failed = 1;
            return 0;
        }
        return (size_t)total;
    }
#endif
    double s[n + 1];  // (2C) the sums, then the count
    o->download(o, s, net->bn_sums, sizeof(double) * n);
    s[n] = (double)count;
    if (comm->allreduce_f64(comm, s, n + 1)) { net->failed = 1; return 0; }
    o->upload(o, net->bn_sums, s, sizeof(double) * n);
    return (size_t)s[n];
}

// wall clock for net->layer_seconds
static double layer_clock(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

// The BnNext of batch norm i for the layer after it, fused (net->fusion[i + 1]):
// its forward's tensors, or (backward) the gradients, where `written` is updated
// as the drop_path_add's own backward would.
static const BnNext *bn_next(Net *net, int i, int backward, BnNext *next) {
    const Layer *l = &net->g->layers[i + 1];
    memset(next, 0, sizeof *next);  // tensors without data
    next->kind = net->fusion[i + 1];
    if (next->kind == FUSED_POOL) {
        next->pooled = net_tensor(net, l->out);
        return next;
    }
    next->rate = layer_in_train_mode(net, l) && l->rate > 0.0f ? l->rate : 0.0f;
    next->seed = net->layer_seeds + i + 1;
    next->first_sample = net->first_sample;
    if (!backward) {
        next->out = net_tensor(net, l->out);
        next->residual = net_tensor(net, l->in[1]);
        return next;
    }
    if (net->needs_grad[l->in[1]]) {
        next->dresidual = net_grad(net, l->in[1]);
        next->accumulate_residual = net->grad_written[l->in[1]];
        net->grad_written[l->in[1]] = 1;
    }
    return next;
}

// Layer i's forward; with_next: and layer i + 1's, fused into it (a batch norm's
// BnNext). A recompute (checkpointing) repeats the forward exactly:
// BN normalises with the batch statistics saved by the first forward and does
// not update the running statistics again; dropout masks come from the same
// (seed, step, layer).
static void layer_forward(Net *net, int i, int recompute, int with_next) {
    const Graph *g = net->g;
    Ops *o = net->o;
    {
        const Layer *l = &g->layers[i];
        // a replica with an empty shard (the last, small global batch) only takes part in the collectives
        if (net->failed || (net->batch == 0 && !(bn_synced(net, l) && !recompute))) return;
        Tensor x = net_tensor(net, l->in[0]), y = net_tensor(net, l->out);
        Tensor x2 = l->in[1] >= 0 ? net_tensor(net, l->in[1]) : tensor(NULL, x.shape, net->dtype);
        float *w = param_ptr(net->params, g, l->weight), *b = param_ptr(net->params, g, l->bias);
        double t0 = net->layer_seconds ? layer_clock() : 0.0;
        switch (l->kind) {
        case LAYER_CONV: case LAYER_DENSE:
            o->conv2d_forward(o, &l->conv, y, x, w, param_cast(net, l->weight), b, net->ws);
            break;
        case LAYER_BN: {
            float *rm = buffer_ptr(net, l->run_mean), *rv = buffer_ptr(net, l->run_var);
            BnNext fused;
            const BnNext *next = with_next ? bn_next(net, i, 0, &fused) : NULL;
            if (layer_in_train_mode(net, l)) {
                if (!recompute) {
                    const int C = x.shape.c;
                    size_t count = shape_numel(x.shape) / C;
                    float *mean = net->bn_mean[i], *var = net->bn_var[i];
                    if (!net->sync_bn) {  // the running statistics are updated in the same pass
                        if (count) o->bn_stats(o, x, mean, var, rm, rv, BN_MOMENTUM, NULL);
                    } else {
                        if (count) o->bn_stats(o, x, mean, var, NULL, NULL, 0.0f, net->bn_sums);
                        count = bn_sync_sums(net, C, count);
                        if (count) o->bn_stats_finish(o, net->bn_sums, C, count, mean, var, rm, rv, BN_MOMENTUM);
                    }
                }
                if (net->batch) o->bn_forward(o, y, x, net->bn_mean[i], net->bn_var[i], w, b, l->eps, l->act, next);
            } else {
                o->bn_forward(o, y, x, rm, rv, w, b, l->eps, l->act, next);
            }
            break;
        }
        case LAYER_ACT: o->act_forward(o, l->act, y, x); break;
        case LAYER_SE_GATE:
            o->se_gate_forward(o, y, x, w, b, param_ptr(net->params, g, l->weight2), param_ptr(net->params, g, l->bias2),
                               l->conv.cout, l->act, l->act2);
            break;
        case LAYER_GAP: o->global_avg_pool_forward(o, y, x); break;
        case LAYER_SCALE: o->channel_scale_forward(o, y, x, x2); break;
        case LAYER_ADD: o->add_forward(o, y, x, x2); break;
        case LAYER_CONCAT: o->concat_forward(o, y, x, x2); break;
        case LAYER_MAXPOOL: o->maxpool2_forward(o, y, x); break;
        case LAYER_UPSAMPLE: o->upsample2_forward(o, y, x); break;
        case LAYER_RESIZE: o->resize_bilinear_forward(o, y, x); break;
        case LAYER_RESCALE: o->axpby(o, y, x, l->scale, l->offset, 0); break;
        case LAYER_DROPOUT: case LAYER_DROP_PATH:
            if (layer_in_train_mode(net, l) && l->rate > 0.0f)
                o->dropout_forward(o, y, x, x2, l->rate, net->layer_seeds + i, l->kind == LAYER_DROP_PATH,
                                   net->first_sample);
            else if (x2.data)
                o->add_forward(o, y, x, x2);
            else
                o->copy(o, y, x, 0);
            break;
        default: snCheck(0, "forward: layer '%s' has unknown kind %d", l->name, (int)l->kind);
        }
        if (net->layer_seconds) { o->synchronize(o); net->layer_seconds[i] += layer_clock() - t0; }
    }
}

void net_forward(Net *net, int training) {
    net->training = training;
    if (training) net_seeds_current(net);
    if (net->params_cast)  // once per forward: whatever changed the fp32 weights since, the copy follows
        net->o->copy(net->o, tensor(net->params_cast, shape4((int)net->g->n_param_floats, 1, 1, 1), net->dtype),
                     tensor_f32(net->params, shape4((int)net->g->n_param_floats, 1, 1, 1)), 0);
    const int L = net->g->n_layers;
    for (int i = 0; i < L; i++) {
        if (net->fusion[i]) continue;  // runs with its batch norm, i - 1
        if (net->plan) plan_enter(net, net->plan->fwd_slot[i]);
        layer_forward(net, i, 0, i + 1 < L && net->fusion[i + 1]);
        if (net->plan) plan_leave(net, net->plan->fwd_slot[i]);
    }
    if (net->plan) plan_enter(net, net->plan->loss_slot);  // the loss writes the output's gradient
}

// Layer i's backward; written[t]: t's gradient already holds a contribution,
// so the next op adds into it. with_next: a batch norm's, with the
// drop_path_add after it fused in (FUSED_RESIDUAL): dy is that layer's output's.
static void layer_backward(Net *net, int i, int with_next) {
    const Graph *g = net->g;
    Ops *o = net->o;
    int *written = net->grad_written;
    {
        const Layer *l = &g->layers[i];
        if (!net->needs_grad[l->out]) return;
        if (net->failed || (net->batch == 0 && !bn_synced(net, l))) return;  // as in layer_forward
        const int dy_of = with_next ? g->layers[i + 1].out : l->out;
        Tensor dy = net_grad(net, dy_of);
        if (!written[dy_of]) { o->fill(o, dy, 0.0f); written[dy_of] = 1; }  // no path to the loss
        BnNext fused;
        const BnNext *next = with_next ? bn_next(net, i, 1, &fused) : NULL;
        const int a = l->in[0], b = l->in[1];
        Tensor x = net_tensor(net, a);
        Tensor x2 = b >= 0 ? net_tensor(net, b) : tensor(NULL, x.shape, net->dtype);
        // input gradients: data NULL where none is needed; acc_* follow `written`
        Tensor dx = net->needs_grad[a] ? net_grad(net, a) : tensor(NULL, x.shape, net->dtype);
        Tensor dx2 = b >= 0 && net->needs_grad[b] ? net_grad(net, b) : tensor(NULL, x2.shape, net->dtype);
        int acc_a = written[a];
        if (dx.data) written[a] = 1;
        int acc_b = b >= 0 ? written[b] : 0;
        if (dx2.data) written[b] = 1;
        const int trainable = !l->frozen;
        float *w = param_ptr(net->params, g, l->weight), *bias = param_ptr(net->params, g, l->bias);
        float *dw = trainable ? grad_ptr(net, l->weight) : NULL;
        float *dbias = trainable ? grad_ptr(net, l->bias) : NULL;
        double t0 = net->layer_seconds ? layer_clock() : 0.0;
        switch (l->kind) {
        case LAYER_CONV: case LAYER_DENSE:
            if (dw || dbias) o->conv2d_backward_weight(o, &l->conv, dw, dbias, dy, x, net->ws);
            if (dx.data) o->conv2d_backward_data(o, &l->conv, dx, dy, w, param_cast(net, l->weight), acc_a, net->ws);
            break;
        case LAYER_BN: {
            const int C = x.shape.c;
            float *sum_g = net->bn_scratch, *sum_gx = net->bn_scratch + C;
            int batch = layer_in_train_mode(net, l);
            const float *mean = batch ? net->bn_mean[i] : buffer_ptr(net, l->run_mean);
            const float *var = batch ? net->bn_var[i] : buffer_ptr(net, l->run_var);
            size_t count = batch ? shape_numel(x.shape) / C : 0;  // 0: the statistics were constants
            const int synced = batch && net->sync_bn && (net->needs_grad[a] || dw);
            if ((batch || dw || next) && net->batch)  // with next, always (BnNext)
                o->bn_backward_reduce(o, dy, x, mean, var, w, bias, l->eps, l->act, batch || dw ? sum_g : NULL, sum_gx,
                                      synced ? NULL : dw, synced ? NULL : dbias, synced ? net->bn_sums : NULL, next);
            if (synced) {
                count = bn_sync_sums(net, C, count);
                const int adds = net->sync_bn->rank == 0;  // see "batch norm across replicas"
                if (count)
                    o->bn_backward_finish(o, net->bn_sums, C, sum_g, sum_gx, adds ? dw : NULL, adds ? dbias : NULL);
            }
            if (dx.data && net->batch && !net->failed)
                o->bn_backward_data(o, dx, dy, x, mean, var, w, bias, l->eps, l->act, sum_g, sum_gx, count, acc_a, next);
            break;
        }
        case LAYER_ACT: if (dx.data) o->act_backward(o, l->act, dx, dy, x, acc_a); break;
        case LAYER_SE_GATE:
            o->se_gate_backward(o, dx, dy, x, w, bias, param_ptr(net->params, g, l->weight2),
                                param_ptr(net->params, g, l->bias2), l->conv.cout, l->act, l->act2, dw, dbias,
                                trainable ? grad_ptr(net, l->weight2) : NULL, trainable ? grad_ptr(net, l->bias2) : NULL,
                                acc_a);
            break;
        case LAYER_GAP: if (dx.data) o->global_avg_pool_backward(o, dx, dy, acc_a); break;
        case LAYER_SCALE: o->channel_scale_backward(o, dx, dx2, dy, x, x2, acc_a, acc_b); break;
        case LAYER_ADD: o->add_backward(o, dx, dx2, dy, acc_a, acc_b); break;
        case LAYER_CONCAT: o->concat_backward(o, dx, dx2, dy, acc_a, acc_b); break;
        case LAYER_MAXPOOL: if (dx.data) o->maxpool2_backward(o, dx, dy, x, acc_a); break;
        case LAYER_UPSAMPLE: if (dx.data) o->upsample2_backward(o, dx, dy, acc_a); break;
        case LAYER_RESIZE: if (dx.data) o->resize_bilinear_backward(o, dx, dy, acc_a); break;
        case LAYER_RESCALE: if (dx.data) o->axpby(o, dx, dy, l->scale, 0.0f, acc_a); break;
        case LAYER_DROPOUT: case LAYER_DROP_PATH:
            if (layer_in_train_mode(net, l) && l->rate > 0.0f)
                o->dropout_backward(o, dx, dx2, dy, l->rate, net->layer_seeds + i, l->kind == LAYER_DROP_PATH,
                                    net->first_sample, acc_a, acc_b);
            else
                o->add_backward(o, dx, dx2, dy, acc_a, acc_b);  // without a residual: a copy into dx
            break;
        default: snCheck(0, "backward: layer '%s' has unknown kind %d", l->name, (int)l->kind);
        }
        if (net->layer_seconds) { o->synchronize(o); net->layer_seconds[g->n_layers + i] += layer_clock() - t0; }
    }
}

void net_backward(Net *net, int output) {
    const Graph *g = net->g;
    const Plan *p = net->plan;
    memset(net->grad_written, 0, sizeof(int) * (size_t)g->n_tensors);
    net->grad_written[output] = 1;
    if (p) plan_leave(net, p->loss_slot);
    for (int i = g->n_layers - 1; i >= 0; i--) {
        if (p && p->rec_slot[i] >= 0 && (i == g->n_layers - 1 || p->rec_slot[i + 1] < 0 ||
                                          g->layers[i + 1].block != g->layers[i].block)) {
            int first = i;  // the block's forward again, from its saved inputs
            while (first > 0 && g->layers[first - 1].block == g->layers[i].block) first--;
            for (int j = first; j <= i; j++) {  // a kept output is still there (and may be dead by now)
                if (net->fusion[j]) continue;    // in its batch norm's slot
                const int next = j < i && net->fusion[j + 1] && p->recompute[j + 1];
                plan_enter(net, p->rec_slot[j]);
                if (p->recompute[j]) layer_forward(net, j, 1, next);
                else if (next) layer_forward(net, j + 1, 1, 0);
                plan_leave(net, p->rec_slot[j]);
            }
        }
        if (net->fusion[i] == FUSED_RESIDUAL) continue;  // with its batch norm, i - 1
        const int next = i + 1 < g->n_layers && net->fusion[i + 1] == FUSED_RESIDUAL;
        if (p) plan_enter(net, p->bwd_slot[i]);
        if (next && !net->needs_grad[g->layers[i].out]) layer_backward(net, i + 1, 0);  // nothing to fuse
        layer_backward(net, i, next && net->needs_grad[g->layers[i].out]);
        if (p) plan_leave(net, p->bwd_slot[i]);
    }
}

// ----------------------------------------------------------------------------
// the training step: one optimiser step of a Trainer (part V opens it, runs
// the passes and saves it), its work on the device in numbered steps

// ---- optimisation diagnostics (metrics.csv's last columns, steps.csv)
//
// Over a span of optimiser steps (an epoch; --log-every's interval), from
// what each step's StepState already says, read at its end with the rest of
// it (no other wait for the device): the global gradient norm before clipping
// (unscaled), whether clipping acted, whether fp16 overflow skipped the step,
// the loss scale after it; and the wall time of train_step. The update ratio
// ‖Δw‖/‖w‖ (trainable weights, fp64) is that of the span's last step: the
// weights are read before and after it, one wait per span.
typedef struct {
    int64_t steps, clipped, skipped;  // skipped: fp16 overflow, no update (the loss scale halved)
    int64_t skip_run, skip_run_max;   // skipped steps in a row: the current run, the longest in the span
    double norm_sum, norm_max;        // of the applied steps
    double loss_sum, label_sum;       // this replica's Σw·nll and Σw (or labels) of the steps
    double loss_scale;                // after the span's last step (1 without loss scaling)
    double update_ratio;              // of the span's last step; NAN: not measured
    double seconds;                   // in train_step, over `timed` steps: this process's (a checkpoint
    int64_t timed;                    // keeps no wall time, so that resumed runs save the same bits)
} StepStats;
#define STEP_STATS_FIELDS 11          // as text (checkpoint metadata): the fields up to update_ratio, space-separated
#define WARN_CLIP_FRACTION 0.5        // clipping acted on more than this fraction of an epoch's steps
#define WARN_SKIP_FRACTION 0.05       // fp16 overflow skipped more than this fraction of an epoch's steps
#define WARN_SKIP_RUN 3               // or more than this many steps in a row (the loss scale fell each time)
#define WARN_TRAIN_MODE_GAP 0.05      // the train metric below the validation one by more than this

static void step_stats_reset(StepStats *st) { *st = (StepStats){0}; st->loss_scale = 1.0; st->update_ratio = NAN; }

static void step_stats_add(StepStats *st, const StepState *s, double seconds, double local_norm) {
    st->steps++;
    if (s->applied) {
        st->skip_run = 0;
        st->clipped += s->clipped;
        st->norm_sum += s->grad_norm;
        st->norm_max = fmax(st->norm_max, s->grad_norm);
    } else {
        st->skipped++;
        if (++st->skip_run > st->skip_run_max) st->skip_run_max = st->skip_run;
    }
    st->seconds += seconds;
    st->timed++;
    st->loss_sum += s->loss[0];
    st->label_sum += local_norm;
    st->loss_scale = s->loss_scale;
}

// Everything a run holds: the model on its backend, the data, the optimiser
// state and the bookkeeping that a checkpoint saves.
typedef struct {
    const TrainCfg *c;
    Ops *o;
    Graph g;
    Net net;
    int logits, K, segmentation;
    Dataset train, val;
    int has_train, has_val;
    float *adam_m, *adam_v;     // (n_param_floats) backend memory
    float *class_weights;       // (K)
    int32_t *labels;            // (N·H·W) or (N)
    int64_t *confusion;         // (K,K)
    StepArgs *args;             // backend memory: the step's arguments, from host_args
    StepState *state;           // backend memory: what the step decides (step_control)
    StepArgs *host_args;        // host_alloc: written before each step, read when its upload runs
    StepState *host_state;      // host_alloc: the step's StepState, read back at its end
    uint64_t *host_seeds;       // host_alloc: (n_layers) the step's dropout seeds
    float *host_images;         // host_alloc: (N,H,W,3) the micro-batch being uploaded
    int32_t *host_labels;       // host_alloc: its labels
    void *record;               // the recorded step (Ops.capture_*), replayed by later steps; NULL: none
    int records;                // 1: record steps where the backend can (SEGNET_CUDA_GRAPHS=0: never)
    size_t per_image;           // labels per image: H·W (segmentation) or 1
    struct { size_t offset, count; } *ranges;  // trainable parameters: runs of the parameter buffer
    int n_ranges;
    size_t n_trainable;         // Σ counts: the size of each Adam moment
    float *stage;               // (N,H,W,3) fp32 images before the cast to the storage type
    float *accum_images;        // host: accum × (N,H,W,3), micro-batches waiting for their step
    int32_t *accum_labels;      // host: accum × (N·H·W or N)
    int64_t total_steps;        // optimiser steps of the whole run (schedules)
    float loss_scale;           // fp16: the dynamic loss scale; else 1
    int64_t good_steps;         // fp16: consecutive finite steps since the last change of scale
    int64_t step;               // optimiser steps taken
    int epoch;                  // epochs completed
    double best;                // lowest monitored loss so far (val_loss, else loss)
    int best_epoch, bad_epochs;
    int finished;               // stopped early (a run that reached its epochs can be extended)
    // an epoch interrupted part-way (SIGINT/SIGTERM): its training pass goes on at global batch
    // resume_batch (the pass's batch count: only the validation is left) with these totals,
    // this replica's so far; 0 when epochs start at their beginning
    int resume_batch;
    double resume_loss_sum, resume_norm_sum;
    int64_t *resume_cm;         // (K,K), NULL when resume_batch is 0
    Comm *comm;                 // the replicas (size 1: this trainer alone)
    int shard;                  // images of a full global batch on this replica: model.batch / replicas
    int borrowed_data;          // train and val belong to another replica (local replicas share them)
    double *bn_host;            // (n_buffer_floats + 1) fp64 staging to average BN statistics over replicas
    StepStats epoch_stats;      // the optimisation diagnostics of this epoch's steps so far
    StepStats log_stats;        // and of the steps since the last row of steps.csv (--log-every)
    int measure_update;         // 1: the next step measures its update ratio (the epoch's last)
    float *update_host;         // (2·n_trainable) host: the trainable weights before and after that step
    char *steps_csv;            // steps.csv's path (root, --log-every), else NULL
    int32_t *nonfinite;         // backend memory: set when a tensor of the model holds NaN or inf (model_finite)
    char data_print[64];        // the training set's fingerprint (data_fingerprint), saved with each checkpoint
} Trainer;

// One pass over a data set. Training: shuffled order, augmentation, one Adam
// step per batch. Returns the loss sum and normaliser sum, and the confusion
// matrix, all over the whole pass.
typedef struct { double loss_sum, norm_sum; int64_t *cm; } PassTotals;

// part V: steps.csv
static int steps_log_row(Trainer *t, double lr);

// A sum over the replicas of a buffer in the backend's memory. The CPU
// backend's memory is the host's; a device communicator (NCCL) reduces device
// memory in place; otherwise it is staged through the host.
static int comm_allreduce_backend(Trainer *t, float *buf, size_t n) {
    Comm *comm = t->comm;
    if (comm->size == 1 || n == 0) return 0;
    if (t->o == &ops_cpu) return comm->allreduce_f32(comm, buf, n);
    if (comm->device) return comm->device->allreduce_f32(comm->device, buf, n);
    float *host = malloc(sizeof(float) * n);
    snCheck(host != NULL, "out of host memory");
    t->o->download(t->o, host, buf, sizeof(float) * n);
    int rc = comm->allreduce_f32(comm, host, n);
    t->o->upload(t->o, buf, host, sizeof(float) * n);
    free(host);
    return rc;
}

// Without --sync-bn each replica's running statistics follow its own shard.
// Averaging them after every micro-batch, weighted by the shard sizes n_r,
// keeps them mirrored; the update is linear, so this equals running
// statistics fed the mean of the replicas' batch statistics (Keras reads its
// ON_READ MEAN variables the same way). Statistics the step did not change
// (frozen BN) come back exactly: Σ n_r·x / Σ n_r = x in fp64.
static int replicas_average_bn(Trainer *t, int n) {
    const Graph *g = &t->g;
    const size_t B = g->n_buffer_floats;
    int any = 0;
    for (int i = 0; i < g->n_layers; i++) any |= g->layers[i].kind == LAYER_BN && !g->layers[i].frozen;
    if (!any || t->comm->size == 1 || t->c->sync_bn) return 0;
    float *f = malloc(sizeof(float) * (B ? B : 1));
    snCheck(f != NULL, "out of host memory");
    t->o->download(t->o, f, t->net.buffers, sizeof(float) * B);
    for (size_t k = 0; k < B; k++) t->bn_host[k] = (double)n * f[k];
    t->bn_host[B] = n;
    int rc = t->comm->allreduce_f64(t->comm, t->bn_host, B + 1);
    for (size_t k = 0; k < B && rc == 0; k++) f[k] = (float)(t->bn_host[k] / t->bn_host[B]);
    if (rc == 0) t->o->upload(t->o, t->net.buffers, f, sizeof(float) * B);
    free(f);
    return rc;
}

// One micro-batch on the host: n images (n,H,W,3) fp32 0..255 and their labels;
// `first` numbers its first image among the optimiser step's images (over
// micro-batches and replicas), which is what dropout masks are drawn by.
typedef struct { int n; const float *images; const int32_t *labels; int first; } MicroBatch;

// A micro-batch into the host staging buffers (written while the device is
// idle: after the last step's download, or a synchronize).
static void stage_batch(Trainer *t, const MicroBatch *mb) {
    if (mb->n == 0) return;  // an empty shard (a last batch smaller than the replicas): its arrays are NULL
    const Shape in = t->g.tensors[t->g.input].shape;
    memcpy(t->host_images, mb->images, sizeof(float) * (size_t)mb->n * in.h * in.w * 3);
    memcpy(t->host_labels, mb->labels, sizeof(int32_t) * (size_t)mb->n * t->per_image);
}

// Queues the staged micro-batch's upload into the net's input (cast to the
// storage type) and the labels buffer.
static void upload_staged(Trainer *t, int n) {
    Ops *o = t->o;
    Net *net = &t->net;
    const Shape in = t->g.tensors[t->g.input].shape;
    const size_t floats = (size_t)n * in.h * in.w * 3;
    net->batch = n;
    if (net->dtype == DT_F32) {
        o->upload_async(o, net->act[t->g.input], t->host_images, sizeof(float) * floats);
    } else {
        o->upload_async(o, t->stage, t->host_images, sizeof(float) * floats);
        o->copy(o, net_tensor(net, t->g.input), tensor_f32(t->stage, shape4(n, in.h, in.w, 3)), 0);
    }
    o->upload_async(o, t->labels, t->host_labels, sizeof(int32_t) * (size_t)n * t->per_image);
}

// The loss and metrics of the batch in the net: softmax cross-entropy of the
// logits (its gradient into dlogits when that has data, scaled by
// state->xent_scale) and the confusion matrix, added into state->loss.
static void score_batch(Trainer *t, Tensor dlogits) {
    Ops *o = t->o;
    Tensor z = net_tensor(&t->net, t->logits);
    o->softmax_xent(o, z, t->labels, t->class_weights, t->c->loss_norm_keras ? KERAS_EPSILON : 0.0f,
                    dlogits.data ? &t->state->xent_scale : NULL, t->state->loss, dlogits);
    o->confusion_accumulate(o, z, t->labels, t->confusion);
}

// An evaluation batch: the forward and its loss Σ w·nll (metrics into the confusion matrix).
static float eval_batch(Trainer *t, const MicroBatch *mb) {
    Ops *o = t->o;
    Net *net = &t->net;
    stage_batch(t, mb);
    upload_staged(t, mb->n);
    net_forward(net, 0);
    o->fill(o, tensor_f32(t->state->loss, shape4(3, 1, 1, 1)), 0.0f);
    score_batch(t, tensor(NULL, net_tensor(net, t->logits).shape, net->dtype));
    float loss[3];
    o->download(o, loss, t->state->loss, sizeof loss);
    snCheck(loss[2] == 0.0f, "labels outside 0..%d passed the data set's checks", t->K - 1);
    return loss[0];
}

// the whole gradient buffer (the trainable parameters') as one tensor
static Tensor grads_tensor(Trainer *t) { return tensor_f32(t->net.grads, shape4((int)t->n_trainable, 1, 1, 1)); }

// The optimiser step's work on the device (steps 2–8 of train_step), from
// the uploads to Adam, all queued: no host synchronisation unless replicas exchange values (then
// returns -1 if a collective failed). Micro-batch 0 is staged by the caller.
static int step_work(Trainer *t, const MicroBatch *mb, int k) {
    const TrainCfg *c = t->c;
    Ops *o = t->o;
    Net *net = &t->net;
    Comm *comm = t->comm;
    o->upload_async(o, t->args, t->host_args, sizeof(StepArgs));
    o->upload_async(o, net->layer_seeds, t->host_seeds, sizeof(uint64_t) * (size_t)t->g.n_layers);
    o->step_control(o, t->args, t->state, STEP_BEGIN);
    o->fill(o, grads_tensor(t), 0.0f);
    // 2.–4. per micro-batch: forward, loss and its gradient, backward (gradients add up)
    for (int i = 0; i < k; i++) {
        if (i > 0) {  // the staging buffers hold one micro-batch
            o->synchronize(o);
            stage_batch(t, &mb[i]);
        }
        upload_staged(t, mb[i].n);
        net->first_sample = (uint64_t)mb[i].first;
        net_forward(net, 1);
        if (mb[i].n) score_batch(t, net_grad(net, t->logits));
        net_backward(net, t->logits);
        if (net->failed || replicas_average_bn(t, mb[i].n)) return -1;
    }
    // 5. all-reduce: the replicas' gradients summed, the gradient of the global loss
    if (comm_allreduce_backend(t, net->grads, t->n_trainable)) return -1;
    if (c->overflow_at_step == t->step)  // tests: as if this step's fp16 gradients had overflowed
        o->fill(o, tensor_f32(net->grads, shape4(1, 1, 1, 1)), INFINITY);
    // 6. finiteness: with fp16 storage, an inf/NaN gradient skips the update (the loss scale halves)
    if (net->dtype == DT_F16) {
        o->nonfinite(o, grads_tensor(t), &t->state->nonfinite);
        if (comm->size > 1) {
            // The summed gradients are the same bits on every replica, so their
            // flags agree; summing the flags makes that a guarantee, not a property.
            int32_t flag;
            o->download(o, &flag, &t->state->nonfinite, sizeof flag);
            int64_t any = flag;
            if (comm->allreduce_i64(comm, &any, 1)) return -1;
            flag = any != 0;
            o->upload(o, &t->state->nonfinite, &flag, sizeof flag);
        }
    }
    // 7. clip: the global norm, the clip factor and the loss scale's next value (step_control_apply)
    o->sum_squares(o, grads_tensor(t), &t->state->grad_sum_squares);
    o->step_control(o, t->args, t->state, STEP_DECIDE);
    // 8. Adam over the trainable ranges (a skipped step leaves them as they are)
    size_t packed = 0;  // offset of the range in the gradients and moments
    for (int r = 0; r < t->n_ranges; r++) {
        size_t off = t->ranges[r].offset, n = t->ranges[r].count;
        o->adam_update(o, net->params + off, net->grads + packed, t->adam_m + packed, t->adam_v + packed, n,
                       &t->state->adam);
        packed += n;
    }
    return 0;
}

// the trainable weights (t->ranges, packed) into t->update_host: its first half (before a step) or second (after)
static void trainable_download(Trainer *t, int after) {
    if (!t->update_host) {
        t->update_host = malloc(sizeof(float) * 2 * (t->n_trainable ? t->n_trainable : 1));
        snCheck(t->update_host != NULL, "out of host memory");
    }
    float *host = t->update_host + (after ? t->n_trainable : 0);
    size_t packed = 0;
    for (int r = 0; r < t->n_ranges; r++) {
        t->o->download(t->o, host + packed, t->net.params + t->ranges[r].offset, sizeof(float) * t->ranges[r].count);
        packed += t->ranges[r].count;
    }
}
// ‖w_after - w_before‖ / ‖w_before‖ in fp64 (trainable_download(t, 0) before the step)
static double trainable_update_ratio(Trainer *t) {
    const size_t n = t->n_trainable;
    trainable_download(t, 1);
    const float *before = t->update_host, *after = t->update_host + n;
    double d = 0.0, w = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double e = (double)after[i] - before[i];
        d += e * e;
        w += (double)before[i] * before[i];
    }
    return w > 0.0 ? sqrt(d / w) : NAN;
}

// One optimiser step over k micro-batches (gradient accumulation when k > 1).
// The loss is Σ w·nll over all k divided by their global Σ w (or pixel count),
// a denominator known before the first forward. With fp16 storage the loss is
// scaled (dynamic loss scaling, Keras' LossScaleOptimizer): unscale → check for
// inf/NaN (skip the update, halve the scale) → clip → Adam; the step counts
// either way, as in Keras. Returns 1 if the update was applied, 0 if it was
// skipped, -1 if a collective failed (another replica stopped).
//
// With replicas, mb are this replica's shards of the k global batches: the
// denominator is all-reduced before the forward (every replica divides by the
// global Σ w), the gradients after the backward (their sum is then the
// gradient of the global loss), and the inf/NaN flag with them, so every
// replica takes the same decision and the same Adam step.
//
// The host writes the step's arguments, queues the work (or replays the
// record of an earlier step with the same shapes) and reads StepState once
// at the end: the step's only wait for the device.
static int train_step(Trainer *t, const MicroBatch *mb, int k, PassTotals *pt) {
    const TrainCfg *c = t->c;
    Ops *o = t->o;
    Net *net = &t->net;
    Comm *comm = t->comm;
    // 1. the normaliser: Σw over the step's labels (or their count), summed over the replicas
    double local_norm = 0.0;
    for (int i = 0; i < k; i++) {
        size_t n_labels = (size_t)mb[i].n * t->per_image;
        local_norm += c->loss_norm_keras ? (double)n_labels : label_weight_sum(mb[i].labels, n_labels, c->class_weights, t->K);
    }
    double norm = local_norm;
    if (comm->size > 1 && comm->allreduce_f64(comm, &norm, 1)) return -1;
    const int64_t step = t->step;
    // the update ratio of the epoch's last step and of each logged one (rank 0 writes both)
    const int logged = c->log_every > 0 && (step + 1) % c->log_every == 0;
    const int measure = (t->measure_update || logged) && comm->rank == 0;
    if (measure) trainable_download(t, 0);
    const double started = now_seconds();
    t->step++;
    StepArgs *a = t->host_args;
    const double lr = lr_at_step(c->lr, c->schedule, c->warmup, t->total_steps, step);
    a->adam = adam_step_init((float)lr, ADAM_BETA1, ADAM_BETA2, c->adam_eps, c->weight_decay, 1.0f, step + 1);
    a->inv_norm = norm > 0 ? (float)(1.0 / norm) : 0.0f;
    a->clipnorm = c->clipnorm;
    a->loss_scaling = net->dtype == DT_F16;
    a->scale_interval = c->loss_scale_interval;
    a->loss_scale = t->loss_scale;
    a->good_steps = t->good_steps;
    net->step = (uint64_t)step;  // one seed per step; masks by image within it (first_sample)
    net_layer_seeds(net, t->host_seeds);
    net->seeds_of[0] = net->seed; net->seeds_of[1] = net->step; net->seeds_set = 1;  // step_work uploads them
    stage_batch(t, &mb[0]);
    // A record replays the same shapes: one full micro-batch (a smaller last
    // one runs op by op), no replicas (their collectives run on the host),
    // nothing timed per layer.
    const int recordable = t->records && o->capture_begin && k == 1 && mb[0].n == t->shard && comm->size == 1 &&
                           !net->layer_seconds && !c->overflow_at_step;
    if (recordable && !t->record && o->capture_begin(o) == 0) {
        int rc = step_work(t, mb, k);
        char err[SN_ERR_MAX];
        t->record = o->capture_end(o, err);
        snCheck(rc == 0, "a step without replicas failed a collective");
        if (!t->record) {  // nothing ran: run it eagerly, and the rest of the run too
            fprintf(stderr, "segnet: recording the training step failed (%s); running steps one op at a time\n", err);
            t->records = 0;
        }
    }
    // 2.–8. step_work: replayed from the record when there is one, else queued op by op
    if (recordable && t->record) {
        o->replay(o, t->record);
    } else if (step_work(t, mb, k)) {
        return -1;
    }
    // the step's one wait for the device: what it decided (applied, loss scale, norm)
    o->download(o, t->host_state, t->state, sizeof(StepState));
    const StepState s = *t->host_state;
    snCheck(s.loss[2] == 0.0f, "labels outside 0..%d passed the data set's checks", t->K - 1);
    pt->loss_sum += s.loss[0];
    pt->norm_sum += local_norm;  // the pass adds the replicas' parts up at its end
    t->loss_scale = s.loss_scale;
    t->good_steps = s.good_steps;
    const double seconds = now_seconds() - started;
    step_stats_add(&t->epoch_stats, &s, seconds, local_norm);
    step_stats_add(&t->log_stats, &s, seconds, local_norm);
    if (measure) {
        const double ratio = trainable_update_ratio(t);
        if (t->measure_update) t->epoch_stats.update_ratio = ratio;
        if (logged) t->log_stats.update_ratio = ratio;
    }
    t->measure_update = 0;
    if (logged && steps_log_row(t, lr)) return -1;
    return s.applied;
}

// ============================================================================
// PART IV. MAKING IT FAST
// The CPU's fast versions of conv2d, batch norm, the squeeze-excitation
// pieces and the memory-bound ops in fp32 (max-pool, upsampling, concat,
// fill, copy, axpby, add, dropout), each naming the reference of part I it
// replaces (the tests compare them: ref_table_vs_cpu and the ops' own tests);
// ops_cpu is ops_ref with them.
// ============================================================================

// ----------------------------------------------------------------------------
// conv2d, fast (conv2d_*_ref in part I states the sums)
//
// Dense k×k convs run as direct convolutions, register-blocked like a GEMM
// micro-kernel but on the padded image itself (below, "direct k×k
// convolution"). Grouped convs, and the gradients of convs with fewer input
// channels than a vector, are lowered to GEMMs per image and group; that path
// is also the reference the direct one is tested against. im2col gathers the
// receptive fields into col[P][K] (P = OH·OW output pixels, K = kh·kw·Cg in
// weight order), and
//   forward          out_g[P][Coutg]  = col[P][K] · W_g[Coutg][K]ᵀ
//   backward data    dcol[P][K]       = dout_g[P][Coutg] · W_g[Coutg][K], then col2im
//   backward weight  dW_g[Coutg][K]  += Σ_n dout_g[P][Coutg]ᵀ · col[P][K]
// A 1×1 stride-1 conv (fp32) needs no im2col: NHWC is already [N·H·W][Cin].
// Depthwise convs (groups = Cin = Cout) are direct loops.
// Every weight gradient is a sum over images in fp64, rounded once: each
// image's product (an fp32 GEMM over its own P rows) is added to an fp64 sum
// in image order. A batch split across replicas then regroups only fp64
// additions (2^-53) — one fp32 GEMM over all N·P rows regroups its fp32
// accumulation instead, 1e-6 of a U-Net's gradient.

static ConvGeom conv_geom(const ConvCfg *cfg, Shape in) {
    ConvGeom q;
    snCheck(conv_geom_of(cfg, in, &q), "conv2d: input " SHAPE_FMT " does not fit the conv (cin %d, kernel %dx%d)",
            SHAPE_ARGS(in), cfg->cin, cfg->kh, cfg->kw);
    return q;
}

// the GEMM paths' floats: col (P,K) and fp32 output rows (P,Cout); the weight
// gradient's fp64 sum (2 floats per weight) and one image's product (Coutg,K) before col
static size_t im2col_floats(const ConvGeom *q, DType dt) { return q->P * q->K + (dt != DT_F32 ? q->P * q->Cout : 0); }
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
static void col2im(const ConvCfg *cfg, const ConvGeom *q, const float *dcol, Tensor din, int n, int g,
                   int accumulate) {
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
                        const float *src = dcol + ((size_t)(ty / s) * q->OW + tx / s) * q->K + (ky * cfg->kw + kx) * q->Cg + c0;
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

// depthwise: out[n,oy,ox,c] = b[c] + Σ_{ky,kx} x[n, oy·s - pt + ky, ox·s - pl + kx, c] · w[c][ky][kx]
static void depthwise_forward_ref(const ConvCfg *cfg, const ConvGeom *q, Tensor out, Tensor in,
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
                        acc += ld(in, (((size_t)n * q->H + iy) * q->W + ix) * q->C + c) * w[c * KK + ky * cfg->kw + kx];
                    }
                }
                st(out, o_base + c, acc);
            }
        }
    }
}

// din[n,iy,ix,c] (=|+=) Σ_{ky,kx} dout[n,oy,ox,c]·w[c][ky][kx], oy = (iy + pt - ky)/s integral
static void depthwise_backward_data_ref(const ConvCfg *cfg, const ConvGeom *q, Tensor din, Tensor dout,
                                    const float *w, int accumulate) {
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
                        acc += ld(dout, (((size_t)n * q->OH + ty / s) * q->OW + tx / s) * q->C + c) * w[c * KK + ky * cfg->kw + kx];
                    }
                }
                st_acc(din, i_base + c, acc, accumulate);
            }
        }
    }
}

// dw[c][ky][kx] += Σ_{n,oy,ox} dout[n,oy,ox,c] · x[n, oy·s - pt + ky, ox·s - pl + kx, c]
static void depthwise_backward_weight_ref(const ConvCfg *cfg, const ConvGeom *q, float *dw, Tensor dout,
                                      Tensor in) {
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

static void depthwise_forward_f32(const ConvCfg *cfg, const ConvGeom *q, float *out, const float *in,
                                  const float *w, const float *b, float *wt) {
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
                    const float *xr = in + (((size_t)n * q->H + iy) * q->W + ix) * C, *wr = wt + (size_t)(ky * cfg->kw + kx) * C;
                    #pragma omp simd
                    for (int c = 0; c < C; c++) o[c] += xr[c] * wr[c];
                }
            }
        }
    }
}

static void depthwise_backward_data_f32(const ConvCfg *cfg, const ConvGeom *q, float *din, const float *dout,
                                        const float *w, int accumulate, float *wt) {
    const int C = q->C, s = cfg->stride;
    depthwise_weights_t(cfg, C, w, wt);
    #pragma omp parallel for schedule(static) if(PAR((size_t)q->N * q->H * q->W * C * cfg->kh * cfg->kw))
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
static void depthwise_backward_weight_f32(const ConvCfg *cfg, const ConvGeom *q, float *dw, const float *dout,
                                          const float *in) {
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
// pixels along a row and V vectors of VL output channels, the R·V sums
//   acc[r][v] = Σ_{ky,kx,ci} xp[oy·s + ky][(ox0 + r)·s + kx][ci] · wt[ky][kx][ci][co0 + v·VL ..]
// stay in vector registers while the (ky,kx,ci) loop streams the input row
// and the weights repacked as wt[ky][kx][ci][Cop] (output channels contiguous,
// padded to Cop, a multiple of VL, with zeros). That is the register blocking
// a GEMM micro-kernel does, on the image itself.
// The data gradient of a stride-1 conv is the same sum over dout padded by
// (k - 1 - pad) with the weights flipped and transposed:
//   din[iy][ix][ci] = Σ_{ky',kx',co} dpad[iy + ky'][ix + kx'][co] · w[co][kh-1-ky'][kw-1-kx'][ci]
#if defined(__AVX512F__)
#define CONV_VL 16                      // fp32 lanes per vector register
#define CONV_REGS 32                    // vector registers
#elif defined(__AVX__)
#define CONV_VL 8
#define CONV_REGS 16
#else                                   // SSE2 (every x86-64), NEON: 128-bit vectors
#define CONV_VL 4
#define CONV_REGS 16
#endif
#define CONV_VMAX 4                     // output-channel vectors per tile
#define CONV_RMAX 12                    // output pixels per tile
typedef float vfloat __attribute__((vector_size(CONV_VL * sizeof(float))));
static inline vfloat vload(const float *p) { vfloat v; memcpy(&v, p, sizeof v); return v; }
static inline void vstore(float *p, vfloat v) { memcpy(p, &v, sizeof v); }
static inline vfloat vsplat(float x) {  // x in every lane (one broadcast; (vfloat){0} + x would add 0 first)
    vfloat v;
    for (int i = 0; i < CONV_VL; i++) v[i] = x;
    return v;
}
// pixels per tile for V channel vectors: R·V accumulators + V weights + 1 broadcast fit the registers
static inline int conv_tile_pixels(int V) {
    int r = (CONV_REGS - 2 - V) / V;
    return r > CONV_RMAX ? CONV_RMAX : r;
}
// A row of tiles is the tiles of conv_tile_pixels(V) and then the rest in
// tiles of 8, 4, 2 and 1. Each tile shape (R, V) is compiled as a function of
// its own from an always-inline body with R and V constant: in one function
// the compiler allocated the shapes' accumulators together and kept some of
// them on the stack (the 4-pixel tiles of a 4×4 image ran at half speed).
enum { CONV_TILE_FULL, CONV_TILE_8, CONV_TILE_4, CONV_TILE_2, CONV_TILE_1, CONV_TILE_KINDS };
#define CONV_TILE_TABLE(prefix) {                                                                      \
    {NULL},                                                                                            \
    {prefix##_full1, prefix##_8x1, prefix##_4x1, prefix##_2x1, prefix##_1x1},                          \
    {prefix##_full2, prefix##_8x2, prefix##_4x2, prefix##_2x2, prefix##_1x2},                          \
    {prefix##_full3, prefix##_8x3, prefix##_4x3, prefix##_2x3, prefix##_1x3},                          \
    {prefix##_full4, prefix##_8x4, prefix##_4x4, prefix##_2x4, prefix##_1x4}}
// the R·V tiles along [from, to) (pixels of a row, or output channels)
#define CONV_TILE_ROW(tiles, V, from, to, call)                                                        \
    do {                                                                                               \
        const int R_ = conv_tile_pixels(V);                                                            \
        int at_ = (from);                                                                              \
        for (; at_ + R_ <= (to); at_ += R_) call((tiles)[CONV_TILE_FULL], at_);                        \
        if (R_ > 8 && (to) - at_ >= 8) { call((tiles)[CONV_TILE_8], at_); at_ += 8; }                  \
        if (R_ > 4 && (to) - at_ >= 4) { call((tiles)[CONV_TILE_4], at_); at_ += 4; }                  \
        if (R_ > 2 && (to) - at_ >= 2) { call((tiles)[CONV_TILE_2], at_); at_ += 2; }                  \
        if (at_ < (to)) call((tiles)[CONV_TILE_1], at_);                                               \
    } while (0)

typedef struct {
    const float *xp;      // (Hp,Wp,C) padded input of one image (the first of a chunk)
    int Wp, C, s, kh, kw;
    const float *wt;      // [kh][kw][C][Cop]
    int Cop;
    const float *bias;    // (Cout) or NULL
    Tensor out;           // (N,OH,OW,Cout)
    size_t out_image;     // element offset of this image in out
    int OW, Cout, accumulate;
    size_t xp_image, out_stride;  // floats per padded image, elements per output image (the chunk's next image)
} DirectConv;

static inline __attribute__((always_inline)) void direct_conv_tile(const DirectConv *d, int R, int V, int oy, int ox0,
                                                                   int co0) {
    vfloat acc[CONV_RMAX][CONV_VMAX];  // fixed sizes: indexed by constants once unrolled, so kept in registers
    #pragma GCC unroll 12
    for (int r = 0; r < R; r++)
        #pragma GCC unroll 4
        for (int v = 0; v < V; v++) acc[r][v] = (vfloat){0};
    const size_t row = (size_t)d->Wp * d->C;
    for (int ky = 0; ky < d->kh; ky++)
        for (int kx = 0; kx < d->kw; kx++) {
            const float *xr = d->xp + (size_t)(oy * d->s + ky) * row + ((size_t)ox0 * d->s + kx) * d->C;
            const float *wr = d->wt + (size_t)(ky * d->kw + kx) * d->C * d->Cop + co0;
            const size_t xstep = (size_t)d->s * d->C;
            for (int ci = 0; ci < d->C; ci++) {
                vfloat wv[CONV_VMAX];
                #pragma GCC unroll 4
                for (int v = 0; v < V; v++) wv[v] = vload(wr + (size_t)ci * d->Cop + v * CONV_VL);
                #pragma GCC unroll 12
                for (int r = 0; r < R; r++) {
                    vfloat b = vsplat(xr[r * xstep + ci]);
                    #pragma GCC unroll 4
                    for (int v = 0; v < V; v++) acc[r][v] += b * wv[v];
                }
            }
        }
    const int nc = d->Cout - co0 < V * CONV_VL ? d->Cout - co0 : V * CONV_VL;
    float tile[CONV_VMAX * CONV_VL];  // one pixel's channels co0.., then stored (rounded, accumulated) as a run
    #pragma GCC unroll 12
    for (int r = 0; r < R; r++) {
        #pragma GCC unroll 4
        for (int v = 0; v < V; v++) vstore(tile + v * CONV_VL, acc[r][v]);
        if (d->bias) for (int j = 0; j < nc; j++) tile[j] += d->bias[co0 + j];
        st_run(d->out, d->out_image + ((size_t)oy * d->OW + ox0 + r) * d->Cout + co0, tile, (size_t)nc, d->accumulate);
    }
}

typedef void (*DirectConvTile)(const DirectConv *d, int oy, int ox0, int co0);
#define DIRECT_CONV_TILE(name, R, V)                                                        \
    static __attribute__((noinline)) void name(const DirectConv *d, int oy, int ox0, int co0) { \
        direct_conv_tile(d, R, V, oy, ox0, co0);                                            \
    }
#define DIRECT_CONV_TILES(V)                                                                \
    DIRECT_CONV_TILE(direct_conv_tile_full##V, conv_tile_pixels(V), V)                      \
    DIRECT_CONV_TILE(direct_conv_tile_8x##V, 8, V) DIRECT_CONV_TILE(direct_conv_tile_4x##V, 4, V) \
    DIRECT_CONV_TILE(direct_conv_tile_2x##V, 2, V) DIRECT_CONV_TILE(direct_conv_tile_1x##V, 1, V)
DIRECT_CONV_TILES(1) DIRECT_CONV_TILES(2) DIRECT_CONV_TILES(3) DIRECT_CONV_TILES(4)
static const DirectConvTile direct_conv_tiles[CONV_VMAX + 1][CONV_TILE_KINDS] = CONV_TILE_TABLE(direct_conv_tile);

// row oy of the chunk's image n, output channels co0 .. co0 + CONV_VMAX·CONV_VL - 1
static void direct_conv_row(const DirectConv *chunk, int n, int oy, int co0) {
    DirectConv image = *chunk;
    image.xp += (size_t)n * chunk->xp_image;
    image.out_image += (size_t)n * chunk->out_stride;
    int V = (chunk->Cout - co0 + CONV_VL - 1) / CONV_VL;
    if (V > CONV_VMAX) V = CONV_VMAX;
#define CONV_TILE_AT(tile, ox) (tile)(&image, oy, ox, co0)
    CONV_TILE_ROW(direct_conv_tiles[V], V, 0, image.OW, CONV_TILE_AT);
#undef CONV_TILE_AT
}

static int conv_pad_to_vl(int c) { return (c + CONV_VL - 1) / CONV_VL * CONV_VL; }
static int conv_is_direct(const ConvCfg *cfg) { return cfg->groups == 1 && cfg->kh * cfg->kw > 1; }
// The gradients' vectors run over input channels: with fewer than a vector's
// worth (an RGB stem) most lanes would idle, and im2col + GEMM is faster. The
// weight gradient of a dense 1×1 conv takes the direct path too: a GEMM per
// image (its fp64 sum image by image) was slower for the small images of the
// late stages, where K = H·W is a few hundred.
static int conv_direct_grad_data(const ConvCfg *cfg) {
    return conv_is_direct(cfg) && cfg->cin >= CONV_VL && cfg->stride == 1;
}
static int conv_direct_grad_weight(const ConvCfg *cfg) { return cfg->groups == 1 && cfg->cin >= CONV_VL; }
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
    size_t pad = (size_t)((q->OH - 1) * cfg->stride + cfg->kh) * ((q->OW - 1) * cfg->stride + cfg->kw) * q->C;
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
static void pad_images(Tensor src, int n0, int nb, int top, int left, int Hp, int Wp, size_t image, float *xp) {
    const int H = src.shape.h, W = src.shape.w, C = src.shape.c;
    #pragma omp parallel for schedule(static) if(PAR((size_t)nb * Hp * Wp * C))
    for (int ky = 0; ky < nb * Hp; ky++) {
        const int k = ky / Hp, y = ky % Hp, n = n0 + k;
        float *dst = xp + k * image + (size_t)y * Wp * C;
        int sy = y - top;
        if (sy < 0 || sy >= H) { memset(dst, 0, sizeof(float) * Wp * C); continue; }
        int x0 = left > 0 ? left : 0, x1 = left + W < Wp ? left + W : Wp;  // destination columns with data
        memset(dst, 0, sizeof(float) * x0 * C);
        ld_run(src, (((size_t)n * H + sy) * W + (x0 - left)) * C, dst + (size_t)x0 * C, (size_t)(x1 - x0) * C);
        memset(dst + (size_t)x1 * C, 0, sizeof(float) * (Wp - x1) * C);
    }
}

// The conv of the images in chunks: each chunk padded (src with padding top,
// left into d->xp), then in one parallel loop its rows of all images, block of
// output channels by block: the threads stream one block's weights
// (kh·kw·C·CONV_VMAX·CONV_VL floats, a few hundred KiB) from their caches
// over all the chunk's rows before the next, where all the weights for each
// row would not stay in cache when they exceed it (deep levels of small images).
static void direct_conv_images(DirectConv *d, Tensor src, int N, int top, int left, int Hp, int Wp, int OH) {
    const int chunk = conv_chunk_images(d->xp_image, N), block = CONV_VMAX * CONV_VL;
    const int blocks = (d->Cout + block - 1) / block;
    for (int n0 = 0; n0 < N; n0 += chunk) {
        const int nb = N - n0 < chunk ? N - n0 : chunk, rows = nb * OH;
        pad_images(src, n0, nb, top, left, Hp, Wp, d->xp_image, (float *)d->xp);
        d->out_image = (size_t)n0 * d->out_stride;
        #pragma omp parallel for schedule(dynamic, 1) if(PAR((size_t)rows * d->OW * d->Cout * d->C * d->kh * d->kw))
        for (int item = 0; item < blocks * rows; item++) {
            const int row = item % rows;
            direct_conv_row(d, row / OH, row % OH, item / rows * block);
        }
    }
}

static void conv2d_forward_direct(const ConvCfg *cfg, const ConvGeom *q, Tensor out, Tensor in, const float *w,
                                  const float *b, float *ws) {
    const int s = cfg->stride, Hp = (q->OH - 1) * s + cfg->kh, Wp = (q->OW - 1) * s + cfg->kw;
    const int Cop = conv_pad_to_vl(q->Cout), KK = cfg->kh * cfg->kw;
    float *wt = ws, *xp = ws + (size_t)KK * q->C * Cop;  // [kh][kw][C][Cop], chunk of (Hp,Wp,C)
    #pragma omp parallel for schedule(static) if(PAR((size_t)KK * q->C * Cop))
    for (int kc = 0; kc < KK * q->C; kc++) {
        const int k = kc / q->C, ci = kc % q->C;
        for (int co = 0; co < Cop; co++)
            wt[(size_t)kc * Cop + co] = co < q->Cout ? w[((size_t)co * KK + k) * q->C + ci] : 0.0f;
    }
    DirectConv d = {xp, Wp, q->C, s, cfg->kh, cfg->kw, wt, Cop, b, out, 0, q->OW, q->Cout, 0,
                    direct_conv_image_floats(cfg, q, 0), q->P * q->Cout};
    direct_conv_images(&d, in, q->N, q->pt, q->pl, Hp, Wp, q->OH);
}

static void conv2d_backward_data_direct(const ConvCfg *cfg, const ConvGeom *q, Tensor din, Tensor dout,
                                        const float *w, int accumulate, float *ws) {
    const int Hp = q->H + cfg->kh - 1, Wp = q->W + cfg->kw - 1, KK = cfg->kh * cfg->kw;
    const int Cip = conv_pad_to_vl(q->C);
    float *wt = ws, *dp = ws + (size_t)KK * q->Cout * Cip;  // [kh][kw][Cout][Cip], chunk of (Hp,Wp,Cout)
    #pragma omp parallel for schedule(static) if(PAR((size_t)KK * q->Cout * Cip))
    for (int kc = 0; kc < KK * q->Cout; kc++) {
        const int k = kc / q->Cout, co = kc % q->Cout, ky = k / cfg->kw, kx = k % cfg->kw;
        const int flipped = (cfg->kh - 1 - ky) * cfg->kw + (cfg->kw - 1 - kx);
        for (int ci = 0; ci < Cip; ci++)
            wt[(size_t)kc * Cip + ci] = ci < q->C ? w[((size_t)co * KK + flipped) * q->C + ci] : 0.0f;
    }
    DirectConv d = {dp, Wp, q->Cout, 1, cfg->kh, cfg->kw, wt, Cip, NULL, din, 0, q->W, q->C, accumulate,
                    direct_conv_image_floats(cfg, q, 1), (size_t)q->H * q->W * q->C};
    direct_conv_images(&d, dout, q->N, cfg->kh - 1 - q->pt, cfg->kw - 1 - q->pl, Hp, Wp, q->H);
}

// The weight gradient, any stride:
//   dw[co][ky][kx][ci] += Σ_{n,oy,ox} dout[n,oy,ox,co] · xp_n[oy·s + ky][ox·s + kx][ci]
// per tap, a tile of R output channels (broadcast from dout) × V vectors of
// input channels (loaded from the padded input) accumulates whole output rows
// of a chunk's images, about DW_FLUSH_PIXELS pixels, in registers (fp32), then
// adds them into fp64 sums: rows in order, so the result does not depend on
// the thread count.
#define DW_FLUSH_PIXELS 512
typedef struct {
    const float *xp;      // nb × (Hp,Wp,C) padded input of the chunk's images (with CONV_VMAX·CONV_VL floats of slack)
    size_t xp_image;      // floats per padded image
    int Wp, C, s, kw, KK;
    const float *dy;      // (nb,OH,OW,Cout) fp32 output gradient of the same images
    int nb, OH, OW, Cout;
    double *sum;          // [Cout][kh][kw][C], the weight gradient's layout
} DirectDW;

static inline __attribute__((always_inline)) void direct_dw_tile(const DirectDW *d, int R, int V, int tap, int co0,
                                                                 int ci0) {
    const int ky = tap / d->kw, kx = tap % d->kw;
    const size_t xstep = (size_t)d->s * d->C;
    const int rows = d->OW >= DW_FLUSH_PIXELS ? 1 : DW_FLUSH_PIXELS / d->OW;  // rows per fp32 partial sum
    const int total = d->nb * d->OH;                                          // the chunk's rows, image by image
    for (int row0 = 0; row0 < total; row0 += rows) {
        vfloat acc[CONV_RMAX][CONV_VMAX];
        #pragma GCC unroll 12
        for (int r = 0; r < R; r++)
            #pragma GCC unroll 4
            for (int v = 0; v < V; v++) acc[r][v] = (vfloat){0};
        for (int row = row0; row < row0 + rows && row < total; row++) {
        const int n = row / d->OH, oy = row % d->OH;
        const float *xr = d->xp + n * d->xp_image + ((size_t)(oy * d->s + ky) * d->Wp + kx) * d->C + ci0;
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
        float lanes[CONV_VMAX * CONV_VL];
        #pragma GCC unroll 12
        for (int r = 0; r < R; r++) {
            #pragma GCC unroll 4
            for (int v = 0; v < V; v++) vstore(lanes + v * CONV_VL, acc[r][v]);
            double *sr = d->sum + ((size_t)(co0 + r) * d->KK + tap) * d->C + ci0;
            for (int j = 0; j < nc; j++) sr[j] += lanes[j];
        }
    }
}
typedef void (*DirectDWTile)(const DirectDW *d, int tap, int co0, int ci0);
#define DIRECT_DW_TILE(name, R, V)                                                        \
    static __attribute__((noinline)) void name(const DirectDW *d, int tap, int co0, int ci0) { \
        direct_dw_tile(d, R, V, tap, co0, ci0);                                           \
    }
#define DIRECT_DW_TILES(V)                                                                \
    DIRECT_DW_TILE(direct_dw_tile_full##V, conv_tile_pixels(V), V)                        \
    DIRECT_DW_TILE(direct_dw_tile_8x##V, 8, V) DIRECT_DW_TILE(direct_dw_tile_4x##V, 4, V) \
    DIRECT_DW_TILE(direct_dw_tile_2x##V, 2, V) DIRECT_DW_TILE(direct_dw_tile_1x##V, 1, V)
DIRECT_DW_TILES(1) DIRECT_DW_TILES(2) DIRECT_DW_TILES(3) DIRECT_DW_TILES(4)
static const DirectDWTile direct_dw_tiles[CONV_VMAX + 1][CONV_TILE_KINDS] = CONV_TILE_TABLE(direct_dw_tile);

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
    #pragma omp parallel for schedule(dynamic, 1) if(PAR((size_t)d->nb * d->OH * d->OW * d->Cout * d->C * d->KK))
    for (int item = 0; item < d->KK * n_ci * n_co; item++) {
        const int co_lo = item % n_co * part, co_hi = co_lo + part < d->Cout ? co_lo + part : d->Cout;
        const int tap = item / n_co / n_ci, ci0 = item / n_co % n_ci * CONV_VMAX * CONV_VL;
        int V = (d->C - ci0 + CONV_VL - 1) / CONV_VL;
        if (V > CONV_VMAX) V = CONV_VMAX;
#define DW_TILE_AT(tile, co) (tile)(d, tap, co, ci0)
        CONV_TILE_ROW(direct_dw_tiles[V], V, co_lo, co_hi, DW_TILE_AT);
#undef DW_TILE_AT
    }
}

static void conv2d_backward_weight_direct(const ConvCfg *cfg, const ConvGeom *q, float *dw, Tensor dout, Tensor in,
                                          float *ws) {
    const int s = cfg->stride, Hp = (q->OH - 1) * s + cfg->kh, Wp = (q->OW - 1) * s + cfg->kw;
    const size_t n_w = (size_t)q->Cout * cfg->kh * cfg->kw * q->C, image = (size_t)Hp * Wp * q->C;
    const int chunk = conv_chunk_images(direct_conv_image_floats(cfg, q, 2), q->N);
    double *sum = (double *)ws;                                     // (n_w) fp64
    float *xp = ws + 2 * n_w;                                       // chunk × (Hp,Wp,C) + slack
    float *rows = xp + chunk * image + CONV_VMAX * CONV_VL;         // (chunk,OH,OW,Cout) when dout is 16-bit
    memset(sum, 0, sizeof(double) * n_w);
    DirectDW d = {xp, image, Wp, q->C, s, cfg->kw, cfg->kh * cfg->kw, NULL, 0, q->OH, q->OW, q->Cout, sum};
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
static void conv2d_forward_gemm(const ConvCfg *cfg, const ConvGeom *qp, Tensor out, Tensor in, const float *w,
                                const float *b, float *ws) {
    const ConvGeom q = *qp;
    float *col = ws;                           // (P, K)
    float *rows = col + q.P * q.K;             // (P, Cout) when out is not fp32
    for (int n = 0; n < q.N; n++) {
        float *y = out.dtype == DT_F32 ? (float *)out.data + (size_t)n * q.P * q.Cout : rows;  // (P, Cout)
        for (int g = 0; g < cfg->groups; g++) {
            im2col(cfg, &q, in, n, g, col);
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, (int)q.P, q.Coutg, q.K, 1.0f,
                        col, q.K, w + (size_t)g * q.Coutg * q.K, q.K, 0.0f, y + (size_t)g * q.Coutg, q.Cout);
        }
        if (b) add_bias_rows(y, q.P, q.Cout, b);
        if (out.dtype != DT_F32) {
            #pragma omp parallel for schedule(static) if(PAR(q.P * q.Cout))
            for (size_t p = 0; p < q.P; p++)
                st_run(out, ((size_t)n * q.P + p) * q.Cout, rows + p * q.Cout, (size_t)q.Cout, 0);
        }
    }
}

static void conv2d_backward_data_gemm(const ConvCfg *cfg, const ConvGeom *qp, Tensor din, Tensor dout,
                                      const float *w, int accumulate, float *ws) {
    const ConvGeom q = *qp;
    float *dcol = ws;                             // (P, K)
    float *rows = dcol + q.P * q.K;               // (P, Cout) when dout is not fp32
    for (int n = 0; n < q.N; n++) {
        const float *dy = image_rows_f32(dout, n, q.P, q.Cout, rows);
        for (int g = 0; g < cfg->groups; g++) {
            cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, (int)q.P, q.K, q.Coutg, 1.0f,
                        dy + (size_t)g * q.Coutg, q.Cout, w + (size_t)g * q.Coutg * q.K, q.K, 0.0f, dcol, q.K);
            col2im(cfg, &q, dcol, din, n, g, accumulate);
        }
    }
}

static void conv2d_backward_weight_gemm(const ConvCfg *cfg, const ConvGeom *qp, float *dw, Tensor dout, Tensor in,
                                        float *ws) {
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
    if (conv_is_depthwise(cfg)) return sizeof(float) * (size_t)cfg->kh * cfg->kw * cfg->cin;  // weights [kh][kw][C]
    ConvGeom q = conv_geom(cfg, in);
    if (conv_is_pointwise(cfg) && dt == DT_F32)  // the weight gradient's: direct, or an fp64 sum and one image's
        return (conv_direct_grad_weight(cfg) ? direct_conv_floats(cfg, &q, 2) : 3 * (size_t)q.Cout * q.K) * sizeof(float);
    size_t im2col = im2col_floats(&q, dt), dw_gemm = gemm_weight_grad_floats(&q, dt);  // dw_gemm > im2col
    size_t dw = conv_direct_grad_weight(cfg) ? direct_conv_floats(cfg, &q, 2) : dw_gemm;
    if (!conv_is_direct(cfg)) return (dw > im2col ? dw : im2col) * sizeof(float);
    size_t floats = direct_conv_floats(cfg, &q, 0);
    size_t dx = conv_direct_grad_data(cfg) ? direct_conv_floats(cfg, &q, 1) : im2col;
    if (dw > floats) floats = dw;
    if (dx > floats) floats = dx;
    return floats * sizeof(float);
}

static void conv2d_forward_cpu(Ops *o, const ConvCfg *cfg, Tensor out, Tensor in, const float *w,
                               const void *w_cast, const float *b, void *ws) {
    (void)o; (void)w_cast;  // the CPU multiplies in fp32
    ConvGeom q = conv_geom(cfg, in.shape);
    snCheck(out.shape.n == q.N && out.shape.h == q.OH && out.shape.w == q.OW && out.shape.c == q.Cout,
            "conv2d_forward: out " SHAPE_FMT " for in " SHAPE_FMT, SHAPE_ARGS(out.shape), SHAPE_ARGS(in.shape));
    if (conv_is_depthwise(cfg)) {
        if (in.dtype == DT_F32 && out.dtype == DT_F32)
            depthwise_forward_f32(cfg, &q, (float *)out.data, (const float *)in.data, w, b, (float *)ws);
        else
            depthwise_forward_ref(cfg, &q, out, in, w, b);
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
    if (conv_is_direct(cfg)) conv2d_forward_direct(cfg, &q, out, in, w, b, (float *)ws);
    else conv2d_forward_gemm(cfg, &q, out, in, w, b, (float *)ws);
}

static void conv2d_backward_data_cpu(Ops *o, const ConvCfg *cfg, Tensor din, Tensor dout, const float *w,
                                     const void *w_cast, int accumulate, void *ws) {
    (void)o; (void)w_cast;
    ConvGeom q = conv_geom(cfg, din.shape);
    if (conv_is_depthwise(cfg)) {
        if (din.dtype == DT_F32 && dout.dtype == DT_F32)
            depthwise_backward_data_f32(cfg, &q, (float *)din.data, (const float *)dout.data, w, accumulate, (float *)ws);
        else
            depthwise_backward_data_ref(cfg, &q, din, dout, w, accumulate);
        return;
    }
    if (conv_is_pointwise(cfg) && din.dtype == DT_F32 && dout.dtype == DT_F32) {
        // din[N·H·W][Cin] (=|+=) dout[N·H·W][Cout] · W[Cout][Cin]
        int M = q.N * q.H * q.W;
        cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasNoTrans, M, q.C, q.Cout, 1.0f,
                    (const float *)dout.data, q.Cout, w, q.C, accumulate ? 1.0f : 0.0f, (float *)din.data, q.C);
        return;
    }
    if (conv_direct_grad_data(cfg)) conv2d_backward_data_direct(cfg, &q, din, dout, w, accumulate, (float *)ws);
    else conv2d_backward_data_gemm(cfg, &q, din, dout, w, accumulate, (float *)ws);
}

static void conv2d_backward_weight_cpu(Ops *o, const ConvCfg *cfg, float *dw, float *db, Tensor dout,
                                       Tensor in, void *ws) {
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
            depthwise_backward_weight_f32(cfg, &q, dw, (const float *)dout.data, (const float *)in.data);
        else
            depthwise_backward_weight_ref(cfg, &q, dw, dout, in);
        return;
    }
    if (conv_direct_grad_weight(cfg)) {
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

static void bn_stats_fast(Tensor x, float *mean, float *var, double *sums) {
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
}

// y = act(g·((x - m)·k) + b) over `rows` rows from x, y; `act` is a constant where this is inlined
static inline __attribute__((always_inline)) void bn_act_rows(float *y, const float *x, size_t rows, int C,
                                                              const float *m, const float *k, const float *g,
                                                              const float *b, Act act) {
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * C;
        float *yr = y + r * C;
        #pragma omp simd
        for (int c = 0; c < C; c++) yr[c] = act_apply_vec(act, g[c] * ((xr[c] - m[c]) * k[c]) + b[c]);
    }
}
static void bn_act_rows_any(float *y, const float *x, size_t rows, int C, const float *m, const float *k,
                            const float *g, const float *b, Act act) {
    switch (act) {
    case ACT_RELU: bn_act_rows(y, x, rows, C, m, k, g, b, ACT_RELU); break;
    case ACT_SILU: bn_act_rows(y, x, rows, C, m, k, g, b, ACT_SILU); break;
    case ACT_SIGMOID: bn_act_rows(y, x, rows, C, m, k, g, b, ACT_SIGMOID); break;
    default: bn_act_rows(y, x, rows, C, m, k, g, b, ACT_NONE);
    }
}

// 16-bit tensors go through the same loops a row at a time, converted to fp32
// on the way in and rounded once on the way out (as the reference's st does).
static void bn_forward_fast(Tensor y, Tensor x, const float *mean, const float *var,
                            const float *gamma, const float *beta, float eps, Act act) {
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    float k[C];  // (C)
    for (int c = 0; c < C; c++) k[c] = bn_invstd(var, c, eps);
    const size_t n_items = (M + BN_ROWS - 1) / BN_ROWS;
    const int f32 = x.dtype == DT_F32 && y.dtype == DT_F32;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (size_t it = 0; it < n_items; it++) {
        size_t r0 = it * BN_ROWS, r1 = r0 + BN_ROWS < M ? r0 + BN_ROWS : M;
        if (f32) {
            bn_act_rows_any((float *)y.data + r0 * C, (const float *)x.data + r0 * C, r1 - r0, C, mean, k, gamma,
                            beta, act);
            continue;
        }
        float xbuf[C], ybuf[C];  // (C) one row in fp32
        for (size_t r = r0; r < r1; r++) {
            bn_act_rows_any(ybuf, ld_view(x, r * C, xbuf, C), 1, C, mean, k, gamma, beta, act);
            st_run(y, r * C, ybuf, C, 0);
        }
    }
}

// Σg and Σg·xhat per channel over rows, g = dy·act'(gamma·xhat + b), xhat = (x - mean)·invstd, for nb
// whole channel blocks from c0 (sums [nb][BN_CBLOCK]); act constant where inlined. Rows outermost: a
// row's nb·BN_CBLOCK channels are read as one run (a thread per block, walking down the rows with
// the tensor's stride, ran at a tenth of the memory's speed); each channel's sums still take the
// rows in order.
#define BN_GROUP_MAX 8  // channel blocks per work item of the backward reduction
static inline __attribute__((always_inline)) void bn_grad_sums(Tensor dy, Tensor x, size_t M, int C, int c0, int nb,
                                                               const float *gam, const float *inv, const float *b,
                                                               const float *mean, Act act,
                                                               double (*sg)[BN_CBLOCK], double (*sgx)[BN_CBLOCK]) {
    float xbuf[BN_CBLOCK], dbuf[BN_CBLOCK];  // one block of a row in fp32 when the tensors are 16-bit
    for (size_t r = 0; r < M; r++)
        for (int k = 0; k < nb; k++) {
            const int c = c0 + k * BN_CBLOCK;
            const float *xr = ld_view(x, r * C + c, xbuf, BN_CBLOCK), *dr = ld_view(dy, r * C + c, dbuf, BN_CBLOCK);
            double *s = sg[k], *q = sgx[k];
            #pragma omp simd
            for (int j = 0; j < BN_CBLOCK; j++) {
                float xhat = (xr[j] - mean[c + j]) * inv[c + j], g = dr[j] * act_grad_vec(act, gam[c + j] * xhat + b[c + j]);
                s[j] += g;
                q[j] += (double)g * xhat;
            }
        }
}

static void bn_backward_reduce_fast(Tensor dy, Tensor x, const float *mean, const float *var, const float *gamma,
                                    const float *beta, float eps, Act act, float *sum_g, float *sum_gx,
                                    float *dgamma, float *dbeta, double *sums) {
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    // gamma, invstd, beta, mean padded to whole channel blocks (the padding lanes are computed and dropped)
    const int Cp = (C + BN_CBLOCK - 1) / BN_CBLOCK * BN_CBLOCK;
    float gam[Cp], b[Cp], m[Cp], invstd[Cp];  // (Cp)
    for (int c = 0; c < Cp; c++) {
        invstd[c] = c < C ? bn_invstd(var, c, eps) : 0.0f;
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
            case ACT_RELU: bn_grad_sums(dy, x, M, C, c0, nb, gam, invstd, b, m, ACT_RELU, sg, sgx); break;
            case ACT_SILU: bn_grad_sums(dy, x, M, C, c0, nb, gam, invstd, b, m, ACT_SILU, sg, sgx); break;
            case ACT_SIGMOID: bn_grad_sums(dy, x, M, C, c0, nb, gam, invstd, b, m, ACT_SIGMOID, sg, sgx); break;
            default: bn_grad_sums(dy, x, M, C, c0, nb, gam, invstd, b, m, ACT_NONE, sg, sgx);
            }
        } else {  // the last, partial block
            c0 = full * BN_CBLOCK;
            nc = C - c0;
            float xbuf[BN_CBLOCK], dbuf[BN_CBLOCK];
            for (size_t r = 0; r < M; r++) {
                const float *xr = ld_view(x, r * C + c0, xbuf, nc), *dr = ld_view(dy, r * C + c0, dbuf, nc);
                for (int j = 0; j < nc; j++) {
                    float xhat = (xr[j] - m[c0 + j]) * invstd[c0 + j];
                    float g = dr[j] * act_grad_vec(act, gam[c0 + j] * xhat + b[c0 + j]);
                    sg[0][j] += g;
                    sgx[0][j] += (double)g * xhat;
                }
            }
        }
        for (int j = 0; j < nc; j++) {
            const double s = sg[j / BN_CBLOCK][j % BN_CBLOCK], q = sgx[j / BN_CBLOCK][j % BN_CBLOCK];
            bn_grad_sums_store(c0 + j, s, q, sum_g, sum_gx, dgamma, dbeta);
            if (sums) { sums[c0 + j] = s; sums[C + c0 + j] = q; }
        }
    }
}

// dx (=|+=) a·(g - u - (x - mean)·v), a = gamma·invstd, u = Σg/count, v = invstd·Σg·xhat/count,
// over `rows` rows from dx, dy, x
static inline __attribute__((always_inline)) void bn_dx_rows(float *dx, const float *dy, const float *x, size_t rows,
                                                             int C, const float *a, const float *gam,
                                                             const float *inv, const float *b,
                                                             const float *mean, const float *u, const float *v,
                                                             Act act, int accumulate) {
    for (size_t r = 0; r < rows; r++) {
        const float *xr = x + r * C, *dr = dy + r * C;
        float *o = dx + r * C;
        #pragma omp simd
        for (int c = 0; c < C; c++) {
            float xm = xr[c] - mean[c], g = dr[c] * act_grad_vec(act, gam[c] * (xm * inv[c]) + b[c]);
            float d = a[c] * (g - u[c] - xm * v[c]);
            o[c] = accumulate ? o[c] + d : d;
        }
    }
}
static void bn_dx_rows_any(float *dx, const float *dy, const float *x, size_t rows, int C, const float *a,
                           const float *gam, const float *inv, const float *b, const float *mean, const float *u,
                           const float *v, Act act, int accumulate) {
    switch (act) {
    case ACT_RELU: bn_dx_rows(dx, dy, x, rows, C, a, gam, inv, b, mean, u, v, ACT_RELU, accumulate); break;
    case ACT_SILU: bn_dx_rows(dx, dy, x, rows, C, a, gam, inv, b, mean, u, v, ACT_SILU, accumulate); break;
    case ACT_SIGMOID: bn_dx_rows(dx, dy, x, rows, C, a, gam, inv, b, mean, u, v, ACT_SIGMOID, accumulate); break;
    default: bn_dx_rows(dx, dy, x, rows, C, a, gam, inv, b, mean, u, v, ACT_NONE, accumulate);
    }
}

static void bn_backward_data_fast(Tensor dx, Tensor dy, Tensor x, const float *mean, const float *var,
                                  const float *gamma, const float *beta, float eps, Act act, const float *sum_g,
                                  const float *sum_gx, size_t count, int accumulate) {
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    float a[C], inv[C], u[C], v[C];  // (C)
    for (int c = 0; c < C; c++) {
        inv[c] = bn_invstd(var, c, eps);
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
            bn_dx_rows_any((float *)dx.data + r0 * C, (const float *)dy.data + r0 * C, (const float *)x.data + r0 * C,
                           r1 - r0, C, a, gamma, inv, beta, mean, u, v, act, accumulate);
            continue;
        }
        float xbuf[C], dybuf[C], dxbuf[C];  // (C) one row in fp32
        for (size_t r = r0; r < r1; r++) {
            if (accumulate) ld_run(dx, r * C, dxbuf, C);
            bn_dx_rows_any(dxbuf, ld_view(dy, r * C, dybuf, C), ld_view(x, r * C, xbuf, C), 1, C, a, gamma, inv, beta,
                           mean, u, v, act, accumulate);
            st_run(dx, r * C, dxbuf, C, 0);
        }
    }
}

static void bn_stats_cpu(Ops *o, Tensor x, float *mean, float *var, float *run_mean, float *run_var, float momentum,
                         double *sums) {
    bn_stats_fast(x, mean, var, sums);
    const int C = x.shape.c;
    if (run_mean) bn_update_running_ref(o, run_mean, run_var, mean, var, C, shape_numel(x.shape) / C, momentum);
}

static void bn_forward_cpu(Ops *o, Tensor y, Tensor x, const float *mean, const float *var,
                           const float *gamma, const float *beta, float eps, Act act, const BnNext *next) {
    if (next && next->kind == FUSED_RESIDUAL) y = next->out;
    bn_forward_fast(y, x, mean, var, gamma, beta, eps, act);
    if (next) bn_next_forward_unfused(o, y, next);
}

static void bn_backward_reduce_cpu(Ops *o, Tensor dy, Tensor x, const float *mean, const float *var,
                                   const float *gamma, const float *beta, float eps, Act act,
                                   float *sum_g, float *sum_gx, float *dgamma, float *dbeta, double *sums,
                                   const BnNext *next) {
    if (next && next->kind == FUSED_RESIDUAL) bn_next_backward_unfused(o, dy, next);
    if (sum_g) bn_backward_reduce_fast(dy, x, mean, var, gamma, beta, eps, act, sum_g, sum_gx, dgamma, dbeta, sums);
}

// dy: y's gradient, also with a residual block's end (bn_backward_reduce made it so)
static void bn_backward_data_cpu(Ops *o, Tensor dx, Tensor dy, Tensor x, const float *mean,
                                 const float *var, const float *gamma, const float *beta, float eps,
                                 Act act, const float *sum_g, const float *sum_gx, size_t count,
                                 int accumulate, const BnNext *next) {
    (void)o; (void)next;
    bn_backward_data_fast(dx, dy, x, mean, var, gamma, beta, eps, act, sum_g, sum_gx, count, accumulate);
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
        const int n = nb / nblk, c0 = nb % nblk * SE_CBLOCK, nc = C - c0 < SE_CBLOCK ? C - c0 : SE_CBLOCK;
        double acc[SE_CBLOCK] = {0};
        for (size_t p = 0; p < HW; p++) {  // each acc[j] is a sum of its own: vectorised across j, same bits
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
            for (int c = 0; c < C; c++) dxp[r * C + c] = accumulate ? dxp[r * C + c] + g[c] * inv : g[c] * inv;
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
    const int f32 = x.dtype == DT_F32 && dy.dtype == DT_F32 && s.dtype == DT_F32 && (!dx.data || dx.dtype == DT_F32);
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
                dxp[r * C + c] = accumulate_dx ? dxp[r * C + c] + dyp[r * C + c] * sr[c] : dyp[r * C + c] * sr[c];
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

static int all_f32(Tensor a, Tensor b) { return a.dtype == DT_F32 && b.dtype == DT_F32; }

// z[n][a] = b[a] + Σ_k wt[k][a]·x[n][k], k in order; wt = wᵀ (K,A); t: (A) fp64
static void affine_rows_t(float *z, const float *wt, const float *b, const float *x, int A, int K, int n, double *t) {
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
static void se_gate_images_f32(int N, const float *pv, const float *w1, const float *b1, const float *w2,
                               const float *b2, int C, int S, Act act1, float *z1, float *y1, float *z2,
                               const SeGateWork *work) {
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

static void se_gate_forward_cpu(Ops *o, Tensor s, Tensor p, const float *w1, const float *b1, const float *w2,
                                const float *b2, int S, Act act1, Act act2) {
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
static void outer_sums_f32(float *dw, float *db, const float *dz, int A, const float *v, int B, int N) {
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

static void se_gate_backward_cpu(Ops *o, Tensor dp, Tensor ds, Tensor p, const float *w1, const float *b1,
                                 const float *w2, const float *b2, int S, Act act1, Act act2, float *dw1, float *db1,
                                 float *dw2, float *db2, int accumulate) {
    if (!all_f32(ds, p) || (dp.data && dp.dtype != DT_F32)) {
        se_gate_backward_ref(o, dp, ds, p, w1, b1, w2, b2, S, act1, act2, dw1, db1, dw2, db2, accumulate);
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
        const float *x0 = (const float *)x.data + ((size_t)n * s.h + 2 * oy) * s.w * C, *x1 = x0 + (size_t)s.w * C;
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
    if (!all_f32(dx, dy) || x.dtype != DT_F32) { maxpool2_backward_ref(o, dx, dy, x, accumulate); return; }
    const Shape s = x.shape, t = dy.shape;
    const int C = s.c;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(x.shape)))
    for (int niy = 0; niy < s.n * s.h; niy++) {
        const int n = niy / s.h, iy = niy % s.h, oy = iy / 2, row_k = (iy - 2 * oy) * 2;
        float *d = (float *)dx.data + (size_t)niy * s.w * C;
        int ix = 0;
        if (oy < t.h) {
            const float *x0 = (const float *)x.data + ((size_t)n * s.h + 2 * oy) * s.w * C, *x1 = x0 + (size_t)s.w * C;
            const float *g = (const float *)dy.data + ((size_t)n * t.h + oy) * t.w * C;
            for (int ox = 0; ox < t.w; ox++, ix += 2) {
                const float *a = x0 + (size_t)ix * C, *b = x1 + (size_t)ix * C, *gc = g + (size_t)ox * C;
                float *d0 = d + (size_t)ix * C, *d1 = d0 + C;
                #pragma omp simd
                for (int c = 0; c < C; c++) {
                    float m = -INFINITY;
                    int first = 0;
                    if (a[c] > m) { m = a[c]; first = 0; }
                    if (a[C + c] > m) { m = a[C + c]; first = 1; }
                    if (b[c] > m) { m = b[c]; first = 2; }
                    if (b[C + c] > m) first = 3;
                    const float g0 = first == row_k ? gc[c] : 0.0f, g1 = first == row_k + 1 ? gc[c] : 0.0f;
                    d0[c] = accumulate ? d0[c] + g0 : g0;
                    d1[c] = accumulate ? d1[c] + g1 : g1;
                }
            }
        }
        for (size_t i = (size_t)ix * C; i < (size_t)s.w * C; i++) d[i] = accumulate ? d[i] + 0.0f : 0.0f;  // past the floor
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
        for (int ox = 0; ox < t.w; ox++) memcpy(yr + (size_t)ox * C, xr + (size_t)(ox / 2) * C, sizeof(float) * C);
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
        const float *g0 = (const float *)dy.data + ((size_t)n * t.h + 2 * iy) * t.w * C, *g1 = g0 + (size_t)t.w * C;
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
static void concat_backward_cpu(Ops *o, Tensor da, Tensor db, Tensor dy, int accumulate_a, int accumulate_b) {
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
// elementwise ops in fp32 (fill_ref, copy_ref, axpby_ref, add_*_ref and
// dropout_*_ref state them; these give the same bits)
//
// Loops over fp32 arrays that the compiler vectorises, where the references
// go through ld/st per element; dropout's per-sample factor (drop-path) is
// drawn once per sample instead of once per element with a 64-bit division.
// Other storage types take the references.

static void fill_cpu(Ops *o, Tensor t, float value) {
    if (t.dtype != DT_F32) { fill_ref(o, t, value); return; }
    const size_t n = shape_numel(t.shape);
    float *p = (float *)t.data;
    #pragma omp parallel for simd schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) p[i] = value;
}

static void copy_cpu(Ops *o, Tensor dst, Tensor src, int accumulate) {
    const size_t n = shape_numel(src.shape);
    if (!all_f32(dst, src) || shape_numel(dst.shape) != n) { copy_ref(o, dst, src, accumulate); return; }
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

static void add_forward_cpu(Ops *o, Tensor y, Tensor a, Tensor b) {
    if (!all_f32(y, a) || b.dtype != DT_F32) { add_forward_ref(o, y, a, b); return; }
    const size_t n = shape_numel(y.shape);
    float *yp = (float *)y.data;
    const float *ap = (const float *)a.data, *bp = (const float *)b.data;
    #pragma omp parallel for simd schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) yp[i] = ap[i] + bp[i];
}

static void add_backward_cpu(Ops *o, Tensor da, Tensor db, Tensor dy, int accumulate_a, int accumulate_b) {
    if (da.data) copy_cpu(o, da, dy, accumulate_a);
    if (db.data) copy_cpu(o, db, dy, accumulate_b);
}

// y = x·keep/(1 - rate) (+ residual); the factor per element, or per sample (E elements)
static void dropout_forward_cpu(Ops *o, Tensor y, Tensor x, Tensor residual, float rate, const uint64_t *seed_at,
                                int per_sample, uint64_t first_sample) {
    if (!all_f32(y, x) || (residual.data && residual.dtype != DT_F32)) {
        dropout_forward_ref(o, y, x, residual, rate, seed_at, per_sample, first_sample);
        return;
    }
    const uint64_t seed = *seed_at;
    const size_t n = shape_numel(x.shape), E = n / x.shape.n, rows = per_sample ? (size_t)x.shape.n : 1;
    const size_t row = per_sample ? E : n;  // elements with one draw each, or all of them
    float *yp = (float *)y.data;
    const float *xp = (const float *)x.data, *rp = (const float *)residual.data;
    for (size_t s = 0; s < rows; s++) {
        const size_t i0 = s * row;
        const float f = per_sample ? dropout_keep(rate, seed, first_sample + s) : 0.0f;
        #pragma omp parallel for simd schedule(static) if(PAR(row))
        for (size_t i = i0; i < i0 + row; i++) {
            const float v = xp[i] * (per_sample ? f : dropout_keep(rate, seed, first_sample * E + i));
            yp[i] = rp ? v + rp[i] : v;
        }
    }
}

static void dropout_backward_cpu(Ops *o, Tensor dx, Tensor dresidual, Tensor dy, float rate, const uint64_t *seed_at,
                                 int per_sample, uint64_t first_sample, int accumulate, int accumulate_residual) {
    if (dy.dtype != DT_F32 || (dx.data && dx.dtype != DT_F32) || (dresidual.data && dresidual.dtype != DT_F32)) {
        dropout_backward_ref(o, dx, dresidual, dy, rate, seed_at, per_sample, first_sample, accumulate,
                             accumulate_residual);
        return;
    }
    const uint64_t seed = *seed_at;
    const size_t n = shape_numel(dy.shape), E = n / dy.shape.n, rows = per_sample ? (size_t)dy.shape.n : 1;
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
                const float v = gi * (per_sample ? f : dropout_keep(rate, seed, first_sample * E + i));
                dxp[i] = accumulate ? dxp[i] + v : v;
            }
            if (drp) drp[i] = accumulate_residual ? drp[i] + gi : gi;
        }
    }
}

// ----------------------------------------------------------------------------
// the CPU ops table: ops_ref with the fast versions above, filled before main

Ops ops_cpu;
__attribute__((constructor)) static void ops_cpu_make(void) {
    ops_cpu = ops_ref;
    ops_cpu.name = "cpu";
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
    ops_cpu.maxpool2_forward = maxpool2_forward_cpu;
    ops_cpu.maxpool2_backward = maxpool2_backward_cpu;
    ops_cpu.upsample2_forward = upsample2_forward_cpu;
    ops_cpu.upsample2_backward = upsample2_backward_cpu;
    ops_cpu.concat_forward = concat_forward_cpu;
    ops_cpu.concat_backward = concat_backward_cpu;
    ops_cpu.fill = fill_cpu;
    ops_cpu.copy = copy_cpu;
    ops_cpu.axpby = axpby_cpu;
    ops_cpu.add_forward = add_forward_cpu;
    ops_cpu.add_backward = add_backward_cpu;
    ops_cpu.dropout_forward = dropout_forward_cpu;
    ops_cpu.dropout_backward = dropout_backward_cpu;
}

// ----------------------------------------------------------------------------
// choosing a backend

// Every function entry of struct Ops by name (the test ops_entries_listed checks
// that none is left out); optional ones may be NULL (recording steps).
#define OPS_ENTRY(name) {#name, offsetof(Ops, name), 0}
#define OPS_OPTIONAL(name) {#name, offsetof(Ops, name), 1}
static const struct { const char *name; size_t offset; int optional; } OPS_ENTRIES[] = {
    OPS_ENTRY(alloc), OPS_ENTRY(free), OPS_ENTRY(upload), OPS_ENTRY(download), OPS_ENTRY(synchronize),
    OPS_ENTRY(host_alloc), OPS_ENTRY(host_free), OPS_ENTRY(upload_async), OPS_OPTIONAL(capture_begin),
    OPS_OPTIONAL(capture_end), OPS_OPTIONAL(replay), OPS_OPTIONAL(record_free),
#define OPS_COMPUTE_ENTRY(name) OPS_ENTRY(name),
    SN_COMPUTE_OPS(OPS_COMPUTE_ENTRY)
#undef OPS_COMPUTE_ENTRY
};
#define N_OPS_ENTRIES (sizeof OPS_ENTRIES / sizeof *OPS_ENTRIES)

int ops_missing(const Ops *o, char *list, size_t size) {
    int n = 0;
    list[0] = 0;
    for (size_t i = 0; i < N_OPS_ENTRIES; i++) {
        void (*fn)(void);
        memcpy(&fn, (const char *)o + OPS_ENTRIES[i].offset, sizeof fn);
        if (fn || OPS_ENTRIES[i].optional) continue;
        size_t len = strlen(list);
        snprintf(list + len, size - len, "%s%s", n++ ? ", " : "", OPS_ENTRIES[i].name);
    }
    return n;
}

const char *const DEVICE_NAMES[3] = {"cpu", "cuda", "auto"};

#define NO_CUDA_BUILD "this segnet was built without the CUDA backend (no nvcc when it was built)"

// --device auto without a usable GPU: one line on stderr, once per process
static void cpu_fallback_notice(const char *why) {
    static int noticed;
    if (!noticed++) fprintf(stderr, "segnet: not on a GPU: %s; running on the CPU\n", why);
}

Ops *ops_for_device(Device d, int gpu, char err[SN_ERR_MAX]) {
    if (d == DEVICE_CPU) return &ops_cpu;
    char why[SN_ERR_MAX];
#ifdef SEGNET_CUDA
    char missing[SN_ERR_MAX];
    Ops *o = cuda_ops_for_device(gpu, why);
    if (o) {
        if (!ops_missing(o, missing, sizeof missing)) return o;
        snprintf(why, sizeof why, "the CUDA backend of this build lacks %.400s", missing);
    }
#else
    (void)gpu;
    snprintf(why, sizeof why, "%s", NO_CUDA_BUILD);
#endif
    if (d == DEVICE_CUDA) {
        snprintf(err, SN_ERR_MAX, "--device cuda: %.480s", why);
        return NULL;
    }
    cpu_fallback_notice(why);
    return &ops_cpu;
}

// ============================================================================
// PART V. PLUMBING
// Files, data, replicas, the training run around the step, benchmark, and the
// command line.
// ============================================================================

// ----------------------------------------------------------------------------
// safetensors files
//
// The header parser is not a general JSON parser: it follows the one shape a
// safetensors header has (an object whose values are objects holding a string
// and arrays of integers; "__metadata__" an object of strings). It needs no
// recursion, and nesting beyond that shape is refused where it appears. Within
// that shape it is strict: RFC 8259 syntax, UTF-8 checked, no duplicate keys,
// no unknown fields, integers (no fraction or exponent) where integers belong.
//
// Layout rules enforced on read: every tensor's [begin, end) lies inside the
// data section, end - begin = numel·dtype_size, non-empty tensors do not
// overlap. Holes (bytes no tensor covers, between tensors or at the end) are
// accepted: they cost nothing to allow and break no invariant we rely on.
//
// Alignment: the data section starts at byte 8 + N and offsets are arbitrary,
// so SafetensorsTensor.data has no alignment guarantee; callers memcpy out of it.

#define SF_HEADER_MAX   ((uint64_t)100 << 20)  // a longer header is absurd (real ones are kilobytes)
#define SF_QUOTE_MAX    64                      // names shown in messages are cut to this

static const char *const SF_DTYPE_NAMES[] = {"F32", "F16", "BF16", "I64"};  // indexed by DType
#define SF_DTYPES ((int)(sizeof SF_DTYPE_NAMES / sizeof *SF_DTYPE_NAMES))

static void sf_errf(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sf_errf(char *err, const char *fmt, ...) {
    if (!err) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, SN_ERR_MAX, fmt, ap);
    va_end(ap);
}

// A name as shown in a message: one line (control bytes become '?') and at
// most SF_QUOTE_MAX bytes, cut on a UTF-8 boundary, "..." marking a cut.
static const char *sf_quote(char out[SF_QUOTE_MAX + 4], const char *s) {
    size_t n = strlen(s), k = n;
    if (k > SF_QUOTE_MAX) {
        k = SF_QUOTE_MAX;
        while (k > 0 && ((uint8_t)s[k] & 0xC0) == 0x80) k--;
    }
    for (size_t i = 0; i < k; i++) out[i] = (uint8_t)s[i] < 0x20 || s[i] == 0x7F ? '?' : s[i];
    strcpy(out + k, k < n ? "..." : "");
    return out;
}

// Length of the well-formed UTF-8 sequence at p (RFC 3629: no overlong forms,
// no surrogates, nothing above U+10FFFF), or 0 if there is none.
static size_t utf8_len(const uint8_t *p, size_t avail) {
    uint8_t c = p[0], lo = 0x80, hi = 0xBF;
    size_t n;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) { n = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { n = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
    else return 0;
    if (avail < n || p[1] < lo || p[1] > hi) return 0;
    for (size_t i = 2; i < n; i++)
        if ((p[i] & 0xC0) != 0x80) return 0;
    return n;
}

static int utf8_valid(const char *s) {
    size_t n = strlen(s), k;
    for (size_t i = 0; i < n; i += k)
        if (!(k = utf8_len((const uint8_t *)s + i, n - i))) return 0;
    return 1;
}

// Encodes code point cp (< 0x110000, not a surrogate) as UTF-8; returns its length.
static size_t utf8_put(uint32_t cp, uint8_t out[4]) {
    if (cp < 0x80) { out[0] = (uint8_t)cp; return 1; }
    if (cp < 0x800) { out[0] = (uint8_t)(0xC0 | cp >> 6); out[1] = (uint8_t)(0x80 | (cp & 0x3F)); return 2; }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | cp >> 12); out[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | cp >> 18); out[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F)); out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

// numel = Π dims; -1 if it (or numel·elem) does not fit in a size_t.
static int sf_numel(const int64_t *dims, int ndim, size_t elem, size_t *numel) {
    size_t n = 1;
    for (int i = 0; i < ndim; i++)
        if (dims[i] == 0) { *numel = 0; return 0; }  // empty, whatever the other dims
    for (int i = 0; i < ndim; i++) {
        if ((uint64_t)dims[i] > SIZE_MAX / n) return -1;
        n *= (size_t)dims[i];
    }
    if (n > SIZE_MAX / elem) return -1;
    *numel = n;
    return 0;
}

// "[2, 3, 4]"
static const char *sf_shape_str(char *out, size_t cap, const int64_t *dims, int ndim) {
    size_t k = (size_t)snprintf(out, cap, "[");
    for (int i = 0; i < ndim && k < cap; i++)
        k += (size_t)snprintf(out + k, cap - k, "%s%" PRId64, i ? ", " : "", dims[i]);
    if (k < cap) snprintf(out + k, cap - k, "]");
    return out;
}

// ---- reading: the header parser

typedef struct {
    const uint8_t *s, *p, *end;  // header text, cursor, end
    const char *path;
    const char *tensor;          // the entry being parsed (for messages), or NULL
    char *err;
} Json;

static int jfail(Json *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int jfail(Json *j, const char *fmt, ...) {
    char msg[SN_ERR_MAX], q[SF_QUOTE_MAX + 4];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (j->tensor) sf_errf(j->err, "%s: tensor '%s': %s", j->path, sf_quote(q, j->tensor), msg);
    else sf_errf(j->err, "%s: %s", j->path, msg);
    return -1;
}
static int jsyntax(Json *j, const char *what) {
    return jfail(j, "header is not valid JSON: %s at byte %zu of the header", what, (size_t)(j->p - j->s));
}

static void jws(Json *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r')) j->p++;
}
static int jpeek(Json *j) { jws(j); return j->p < j->end ? *j->p : -1; }
// consumes c, after whitespace, if it comes next
static int jeat(Json *j, int c) {
    if (jpeek(j) != c) return 0;
    j->p++;
    return 1;
}

static int jhex4(Json *j, uint32_t *v) {
    *v = 0;
    for (int i = 0; i < 4; i++, j->p++) {
        int c = j->p < j->end ? *j->p : -1, d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else return jsyntax(j, "\\u needs 4 hex digits");
        *v = *v << 4 | (uint32_t)d;
    }
    return 0;
}

// A JSON string, decoded into out. At most cap-1 bytes are kept (cut on a
// UTF-8 boundary, NUL-terminated); *len is the full decoded length, so
// *len >= cap means it did not fit. \u0000 is refused: names are C strings.
static int jstring(Json *j, char *out, size_t cap, size_t *len) {
    if (!jeat(j, '"')) return jsyntax(j, "expected a string");
    size_t n = 0, kept = 0;
    for (;;) {
        if (j->p >= j->end) return jsyntax(j, "unterminated string");
        uint8_t c = *j->p, buf[4];
        size_t k = 1;
        if (c == '"') { j->p++; break; }
        if (c < 0x20) return jsyntax(j, "control character inside a string");
        if (c == '\\') {
            if (j->end - j->p < 2) return jsyntax(j, "unterminated string");
            c = j->p[1];
            j->p += 2;
            switch (c) {
            case '"': case '\\': case '/': buf[0] = c; break;
            case 'b': buf[0] = '\b'; break;
            case 'f': buf[0] = '\f'; break;
            case 'n': buf[0] = '\n'; break;
            case 'r': buf[0] = '\r'; break;
            case 't': buf[0] = '\t'; break;
            case 'u': {
                uint32_t cp, lo;
                if (jhex4(j, &cp)) return -1;
                if (cp >= 0xDC00 && cp <= 0xDFFF) return jsyntax(j, "unpaired low surrogate in \\u escape");
                if (cp >= 0xD800 && cp <= 0xDBFF) {  // UTF-16 pair: 0x10000 + (hi - 0xD800)·2^10 + (lo - 0xDC00)
                    if (j->end - j->p < 2 || j->p[0] != '\\' || j->p[1] != 'u')
                        return jsyntax(j, "unpaired high surrogate in \\u escape");
                    j->p += 2;
                    if (jhex4(j, &lo)) return -1;
                    if (lo < 0xDC00 || lo > 0xDFFF) return jsyntax(j, "unpaired high surrogate in \\u escape");
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                }
                if (cp == 0) return jsyntax(j, "\\u0000 inside a string");
                k = utf8_put(cp, buf);
                break;
            }
            default: j->p -= 2; return jsyntax(j, "unknown escape inside a string");
            }
        } else {
            if (!(k = utf8_len(j->p, (size_t)(j->end - j->p))))
                return jfail(j, "header is not valid UTF-8 at byte %zu of the header", (size_t)(j->p - j->s));
            memcpy(buf, j->p, k);
            j->p += k;
        }
        if (kept == n && n + k < cap) { memcpy(out + n, buf, k); kept += k; }
        n += k;
    }
    if (cap) out[kept] = 0;
    *len = n;
    return 0;
}

// A JSON string of any length into a malloc'd buffer: decoding never makes a
// string longer than its source, so the header's remaining bytes bound it.
static int jstring_alloc(Json *j, char **out) {
    size_t len, cap = (size_t)(j->end - j->p) + 1;
    if (!(*out = malloc(cap))) return jfail(j, "out of memory reading a string of the header");
    if (jstring(j, *out, cap, &len)) return -1;
    char *fit = realloc(*out, len + 1);
    if (fit) *out = fit;
    return 0;
}

// A JSON number that must be an integer within int64.
static int jint(Json *j, int64_t *v, const char *what) {
    jws(j);
    const uint8_t *p = j->p, *q = p;
    int neg = p < j->end && *p == '-';
    if (neg) p++;
    if (p >= j->end || *p < '0' || *p > '9') return jfail(j, "%s must be an integer", what);
    if (*p == '0' && p + 1 < j->end && p[1] >= '0' && p[1] <= '9') return jsyntax(j, "number with a leading zero");
    uint64_t u = 0;
    int big = 0;
    for (; p < j->end && *p >= '0' && *p <= '9'; p++) {
        unsigned d = *p - '0';
        if (u > (UINT64_MAX - d) / 10) big = 1;
        else u = u * 10 + d;
    }
    if (p < j->end && (*p == '.' || *p == 'e' || *p == 'E')) {
        while (q < j->end && q - j->p < 32 && strchr("+-.eE0123456789", *q) && *q) q++;
        return jfail(j, "%s %.*s is not an integer", what, (int)(q - j->p), (const char *)j->p);
    }
    if (big || u > (uint64_t)INT64_MAX + neg) return jfail(j, "%s is too large", what);
    j->p = p;
    *v = neg ? (u == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)u) : (int64_t)u;
    return 0;
}

// {"dtype": "F32", "shape": [d0, ...], "data_offsets": [begin, end]}, fields in
// any order, each exactly once. data: the data section, data_len bytes.
static int sf_parse_tensor(Json *j, SafetensorsTensor *t, const uint8_t *data, size_t data_len) {
    char field[32], dtype[16] = "", q[SF_QUOTE_MAX + 4], shape[256];
    size_t len;
    int have_dtype = 0, have_shape = 0, n_off = -1;
    int64_t off[2];
    if (!jeat(j, '{')) return jfail(j, "entry must be an object with \"dtype\", \"shape\" and \"data_offsets\"");
    if (!jeat(j, '}')) for (;;) {
        if (jstring(j, field, sizeof field, &len)) return -1;
        if (!jeat(j, ':')) return jsyntax(j, "expected ':'");
        if (!strcmp(field, "dtype")) {
            if (have_dtype++) return jfail(j, "\"dtype\" appears twice");
            if (jpeek(j) != '"') return jfail(j, "\"dtype\" must be a string");
            if (jstring(j, dtype, sizeof dtype, &len)) return -1;
        } else if (!strcmp(field, "shape")) {
            if (have_shape++) return jfail(j, "\"shape\" appears twice");
            if (!jeat(j, '[')) return jfail(j, "\"shape\" must be an array of integers");
            t->ndim = 0;
            if (!jeat(j, ']')) for (;;) {
                if (t->ndim == SF_MAX_DIMS) return jfail(j, "shape has more than %d dimensions", SF_MAX_DIMS);
                int64_t d;
                if (jint(j, &d, "shape entry")) return -1;
                if (d < 0) return jfail(j, "shape entry %" PRId64 " is negative", d);
                t->dims[t->ndim++] = d;
                if (jeat(j, ']')) break;
                if (!jeat(j, ',')) return jsyntax(j, "expected ',' or ']' in \"shape\"");
            }
        } else if (!strcmp(field, "data_offsets")) {
            if (n_off >= 0) return jfail(j, "\"data_offsets\" appears twice");
            if (!jeat(j, '[')) return jfail(j, "\"data_offsets\" must be an array [begin, end]");
            n_off = 0;
            if (!jeat(j, ']')) for (;;) {
                if (n_off == 2) return jfail(j, "\"data_offsets\" must be [begin, end]: more than 2 entries");
                if (jint(j, &off[n_off], "data_offsets entry")) return -1;
                if (off[n_off] < 0) return jfail(j, "data_offsets entry %" PRId64 " is negative", off[n_off]);
                n_off++;
                if (jeat(j, ']')) break;
                if (!jeat(j, ',')) return jsyntax(j, "expected ',' or ']' in \"data_offsets\"");
            }
            if (n_off != 2) return jfail(j, "\"data_offsets\" must be [begin, end]: %d entries", n_off);
        } else {
            return jfail(j, "unknown field \"%s\"", sf_quote(q, field));
        }
        if (jeat(j, '}')) break;
        if (!jeat(j, ',')) return jsyntax(j, "expected ',' or '}'");
    }
    if (!have_dtype) return jfail(j, "missing \"dtype\"");
    if (!have_shape) return jfail(j, "missing \"shape\"");
    if (n_off < 0) return jfail(j, "missing \"data_offsets\"");

    int dt = -1;
    for (int k = 0; k < SF_DTYPES; k++)
        if (!strcmp(dtype, SF_DTYPE_NAMES[k])) dt = k;
    if (dt < 0) return jfail(j, "dtype \"%s\" is not supported (segnet reads F32, F16, BF16, I64)", sf_quote(q, dtype));
    t->dtype = (DType)dt;
    size_t elem = dtype_size(t->dtype);
    sf_shape_str(shape, sizeof shape, t->dims, t->ndim);
    if (sf_numel(t->dims, t->ndim, elem, &t->numel))
        return jfail(j, "shape %s overflows: its byte size does not fit in size_t", shape);
    if (off[0] > off[1])
        return jfail(j, "data_offsets [%" PRId64 ", %" PRId64 "]: begin > end", off[0], off[1]);
    if ((uint64_t)off[1] > data_len)
        return jfail(j, "data_offsets [%" PRId64 ", %" PRId64 "] run past the end of the data section "
                     "(%zu bytes): the file is truncated or the offsets are wrong", off[0], off[1], data_len);
    if ((uint64_t)(off[1] - off[0]) != t->numel * elem)
        return jfail(j, "data_offsets [%" PRId64 ", %" PRId64 "] hold %" PRId64 " bytes, but shape %s of %s needs %zu",
                     off[0], off[1], off[1] - off[0], shape, dtype, t->numel * elem);
    t->data = data + off[0];
    return 0;
}

// "__metadata__": {"key": "value", ...}; keys and values of any length (the
// header's limit bounds them), each in its own allocation
static int sf_parse_meta(Json *j, SafetensorsFile *f, size_t *cap) {
    char q[SF_QUOTE_MAX + 4];
    if (!jeat(j, '{')) return jfail(j, "\"__metadata__\" must be an object of strings");
    if (!jeat(j, '}')) for (;;) {
        if (f->n_meta == INT32_MAX) return jfail(j, "too many \"__metadata__\" entries");
        if ((size_t)f->n_meta == *cap) {
            size_t c = *cap ? 2 * *cap : 8;
            void *k = realloc(f->meta_keys, c * sizeof *f->meta_keys);
            if (k) f->meta_keys = k;
            void *v = realloc(f->meta_values, c * sizeof *f->meta_values);
            if (v) f->meta_values = v;
            if (!k || !v) return jfail(j, "out of memory reading \"__metadata__\"");
            *cap = c;
        }
        char **key = &f->meta_keys[f->n_meta], **val = &f->meta_values[f->n_meta];
        *key = *val = NULL;
        f->n_meta++;  // owned from here: safetensors_free frees what is set
        if (jstring_alloc(j, key)) return -1;
        if (!jeat(j, ':')) return jsyntax(j, "expected ':'");
        if (jpeek(j) != '"') return jfail(j, "\"__metadata__\" '%s': value must be a string", sf_quote(q, *key));
        if (jstring_alloc(j, val)) return -1;
        if (jeat(j, '}')) break;
        if (!jeat(j, ',')) return jsyntax(j, "expected ',' or '}' in \"__metadata__\"");
    }
    return 0;
}

static int sf_parse_header(Json *j, SafetensorsFile *f, const uint8_t *data, size_t data_len) {
    char name[SN_NAME_MAX], q[SF_QUOTE_MAX + 4];
    size_t len, cap_t = 0, cap_m = 0;
    int have_meta = 0;
    if (!jeat(j, '{'))
        return jfail(j, "header is not a JSON object (no '{' at byte %zu of the header)", (size_t)(j->p - j->s));
    if (!jeat(j, '}')) for (;;) {
        if (jstring(j, name, sizeof name, &len)) return -1;
        if (!jeat(j, ':')) return jsyntax(j, "expected ':'");
        if (!strcmp(name, "__metadata__")) {
            if (have_meta++) return jfail(j, "\"__metadata__\" appears twice");
            if (sf_parse_meta(j, f, &cap_m)) return -1;
        } else {
            if (len >= SN_NAME_MAX)
                return jfail(j, "tensor name '%s' is %zu bytes, longer than the %d allowed",
                             sf_quote(q, name), len, SN_NAME_MAX - 1);
            if (f->n_tensors == INT32_MAX) return jfail(j, "too many tensors");
            if ((size_t)f->n_tensors == cap_t) {
                size_t c = cap_t ? 2 * cap_t : 16;
                SafetensorsTensor *t = realloc(f->tensors, c * sizeof *t);
                if (!t) return jfail(j, "out of memory reading the header");
                f->tensors = t;
                cap_t = c;
            }
            SafetensorsTensor *t = &f->tensors[f->n_tensors];
            memset(t, 0, sizeof *t);
            memcpy(t->name, name, len + 1);
            j->tensor = t->name;
            if (sf_parse_tensor(j, t, data, data_len)) return -1;
            j->tensor = NULL;
            f->n_tensors++;
        }
        if (jeat(j, '}')) break;
        if (!jeat(j, ',')) return jsyntax(j, "expected ',' or '}'");
    }
    jws(j);  // the writer's padding
    if (j->p != j->end) return jsyntax(j, "text after the header object");
    return 0;
}

// ---- reading: whole-file checks

static int cmp_name(const void *a, const void *b) { return strcmp(*(const char *const *)a, *(const char *const *)b); }

// The first name (in sorted order) that occurs twice, or NULL. Sorts names.
static const char *sf_duplicate(const char **names, size_t n) {
    qsort(names, n, sizeof *names, cmp_name);
    for (size_t i = 1; i < n; i++)
        if (!strcmp(names[i - 1], names[i])) return names[i];
    return NULL;
}

static int cmp_tensor_begin(const void *a, const void *b) {
    const uint8_t *x = (*(const SafetensorsTensor *const *)a)->data, *y = (*(const SafetensorsTensor *const *)b)->data;
    return x < y ? -1 : x > y;
}

// Names are unique; non-empty tensors do not overlap (empty ones cover no byte).
static int sf_check_layout(const SafetensorsFile *f, const uint8_t *data, const char *path, char *err) {
    size_t n = (size_t)f->n_tensors;
    char q1[SF_QUOTE_MAX + 4], q2[SF_QUOTE_MAX + 4];
    const char **names = malloc(sizeof *names * (n ? n : 1));
    const SafetensorsTensor **by_begin = malloc(sizeof *by_begin * (n ? n : 1));
    int rc = -1;
    if (!names || !by_begin) { sf_errf(err, "%s: out of memory checking the tensor table", path); goto done; }
    for (size_t i = 0; i < n; i++) names[i] = f->tensors[i].name;
    const char *dup = sf_duplicate(names, n);
    if (dup) { sf_errf(err, "%s: tensor '%s' appears twice (duplicate name)", path, sf_quote(q1, dup)); goto done; }
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (f->tensors[i].numel) by_begin[m++] = &f->tensors[i];
    qsort(by_begin, m, sizeof *by_begin, cmp_tensor_begin);
    // sorted by begin, each must start at or after the furthest end so far
    const SafetensorsTensor *reach = NULL;
    const uint8_t *reach_end = NULL;
    for (size_t i = 0; i < m; i++) {
        const SafetensorsTensor *t = by_begin[i];
        const uint8_t *b = t->data, *e = b + t->numel * dtype_size(t->dtype);
        if (reach && b < reach_end) {
            sf_errf(err, "%s: tensors '%s' and '%s' overlap in the data section: bytes [%zu, %zu) and [%zu, %zu)",
                    path, sf_quote(q1, reach->name), sf_quote(q2, t->name), (size_t)((const uint8_t *)reach->data - data),
                    (size_t)(reach_end - data), (size_t)(b - data), (size_t)(e - data));
            goto done;
        }
        if (!reach || e > reach_end) { reach = t; reach_end = e; }
    }
    rc = 0;
done:
    free(names);
    free(by_begin);
    return rc;
}

void safetensors_free(SafetensorsFile *f) {
    free(f->tensors);
    for (int i = 0; i < f->n_meta; i++) { free(f->meta_keys[i]); free(f->meta_values[i]); }
    free(f->meta_keys);
    free(f->meta_values);
    free(f->bytes);
    memset(f, 0, sizeof *f);
}

// A descriptor for reading path only if it is a regular file: opening a FIFO
// waits for a writer, reading a device never ends (O_NONBLOCK, then blocking
// again). -1 with *why, errno kept from open (EINVAL: not a regular file).
static int open_regular(const char *path, struct stat *sb, const char **why) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) { *why = strerror(errno); return -1; }
    if (fstat(fd, sb) || !S_ISREG(sb->st_mode)) {
        close(fd);
        *why = "not a regular file";
        errno = EINVAL;
        return -1;
    }
    if (fcntl(fd, F_SETFL, 0)) { *why = strerror(errno); close(fd); return -1; }
    return fd;
}

// open_regular as a FILE (NULL with *why)
static FILE *fopen_regular_stat(const char *path, const char *mode, struct stat *sb, const char **why) {
    int fd = open_regular(path, sb, why);
    FILE *f = fd < 0 ? NULL : fdopen(fd, mode);
    if (fd >= 0 && !f) { *why = strerror(errno); close(fd); }
    return f;
}

// ... NULL with err ("path: why"), errno as open_regular's
static FILE *fopen_regular(const char *path, const char *mode, char err[SN_ERR_MAX]) {
    struct stat sb;
    const char *why;
    FILE *f = fopen_regular_stat(path, mode, &sb, &why);
    if (!f) snprintf(err, SN_ERR_MAX, "%.400s: %s", path, why);
    return f;
}

int safetensors_read(const char *path, SafetensorsFile *f, char err[SN_ERR_MAX]) {
    memset(f, 0, sizeof *f);
    struct stat sb;
    const char *why;
    FILE *fp = fopen_regular_stat(path, "rb", &sb, &why);
    if (!fp) { sf_errf(err, "%s: cannot open: %s", path, why); return -1; }
    if ((uint64_t)sb.st_size > SIZE_MAX) { sf_errf(err, "%s: too large to load", path); fclose(fp); return -1; }
    size_t n = (size_t)sb.st_size;
    f->bytes = malloc(n ? n : 1);
    if (!f->bytes) { sf_errf(err, "%s: out of memory loading %zu bytes", path, n); fclose(fp); return -1; }
    size_t got = fread(f->bytes, 1, n, fp);
    int read_err = ferror(fp);
    fclose(fp);
    if (got != n) {
        sf_errf(err, "%s: %s after %zu of %zu bytes", path, read_err ? "read error" : "file shrank while reading", got, n);
        safetensors_free(f);
        return -1;
    }
    f->n_bytes = n;
    if (n < 8) {
        sf_errf(err, "%s: file is %zu bytes, too short for safetensors (an 8-byte header length comes first)", path, n);
        safetensors_free(f);
        return -1;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | f->bytes[i];
    if (hlen > n - 8) {
        sf_errf(err, "%s: header length %" PRIu64 " runs past the end of the file (%zu bytes): truncated or not safetensors",
                path, hlen, n);
        safetensors_free(f);
        return -1;
    }
    if (hlen > SF_HEADER_MAX) {
        sf_errf(err, "%s: header length %" PRIu64 " is absurd (over %" PRIu64 " MB)", path, hlen, SF_HEADER_MAX >> 20);
        safetensors_free(f);
        return -1;
    }
    Json j = {f->bytes + 8, f->bytes + 8, f->bytes + 8 + hlen, path, NULL, err};
    const uint8_t *data = f->bytes + 8 + hlen;
    if (sf_parse_header(&j, f, data, n - 8 - (size_t)hlen) || sf_check_layout(f, data, path, err)) {
        safetensors_free(f);
        return -1;
    }
    return 0;
}

const SafetensorsTensor *safetensors_find(const SafetensorsFile *f, const char *name) {
    for (int i = 0; i < f->n_tensors; i++)
        if (!strcmp(f->tensors[i].name, name)) return &f->tensors[i];
    return NULL;
}

// ---- writing

typedef struct { char *p; size_t n, cap; int oom; } SfBuf;

static void sb_put(SfBuf *b, const char *s, size_t k) {
    if (b->oom) return;
    if (b->n + k > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->n + k) c *= 2;
        char *p = realloc(b->p, c);
        if (!p) { b->oom = 1; return; }
        b->p = p;
        b->cap = c;
    }
    memcpy(b->p + b->n, s, k);
    b->n += k;
}
static void sb_str(SfBuf *b, const char *s) { sb_put(b, s, strlen(s)); }

// a JSON string: '"' and '\' escaped, control bytes as \u00XX, UTF-8 as is
static void sb_json(SfBuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        char e[8];
        if (*s == '"' || *s == '\\') { e[0] = '\\'; e[1] = *s; sb_put(b, e, 2); }
        else if ((uint8_t)*s < 0x20) { snprintf(e, sizeof e, "\\u%04x", (unsigned)(uint8_t)*s); sb_put(b, e, 6); }
        else sb_put(b, s, 1);
    }
    sb_put(b, "\"", 1);
}

// Refuses what safetensors_read would refuse, so every file written reads back.
static int sf_check_write_args(const char *path, const SafetensorsTensor *ts, int n, const char *const *mk,
                               const char *const *mv, int n_meta, char *err) {
    char q[SF_QUOTE_MAX + 4];
    if (n < 0 || n_meta < 0 || (n && !ts) || (n_meta && (!mk || !mv))) {
        sf_errf(err, "%s: bad arguments (%d tensors, %d metadata entries)", path, n, n_meta);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        const SafetensorsTensor *t = &ts[i];
        if (strnlen(t->name, SN_NAME_MAX) == SN_NAME_MAX) {
            sf_errf(err, "%s: tensor %d: name is not NUL-terminated within %d bytes", path, i, SN_NAME_MAX);
            return -1;
        }
        const char *nm = sf_quote(q, t->name);
        size_t numel;
        if (!utf8_valid(t->name) || !strcmp(t->name, "__metadata__")) {
            sf_errf(err, "%s: tensor '%s': invalid name (not UTF-8, or \"__metadata__\")", path, nm);
            return -1;
        }
        if ((unsigned)t->dtype >= (unsigned)SF_DTYPES) { sf_errf(err, "%s: tensor '%s': unknown dtype %d", path, nm, (int)t->dtype); return -1; }
        if (t->ndim < 0 || t->ndim > SF_MAX_DIMS) {
            sf_errf(err, "%s: tensor '%s': ndim %d is outside 0..%d", path, nm, t->ndim, SF_MAX_DIMS);
            return -1;
        }
        for (int d = 0; d < t->ndim; d++)
            if (t->dims[d] < 0) { sf_errf(err, "%s: tensor '%s': negative dimension %" PRId64, path, nm, t->dims[d]); return -1; }
        if (sf_numel(t->dims, t->ndim, dtype_size(t->dtype), &numel) || numel != t->numel) {
            sf_errf(err, "%s: tensor '%s': numel %zu does not match its shape", path, nm, t->numel);
            return -1;
        }
        if (numel && !t->data) { sf_errf(err, "%s: tensor '%s': data is NULL", path, nm); return -1; }
    }
    for (int i = 0; i < n_meta; i++) {
        if (!mk[i] || !mv[i] || !utf8_valid(mk[i]) || !utf8_valid(mv[i])) {
            sf_errf(err, "%s: metadata entry %d: key and value must be UTF-8 strings", path, i);
            return -1;
        }
    }
    const char **names = malloc(sizeof *names * (size_t)(n > n_meta ? n : n_meta ? n_meta : 1));
    if (!names) { sf_errf(err, "%s: out of memory", path); return -1; }
    const char *dup;
    for (int i = 0; i < n; i++) names[i] = ts[i].name;
    if ((dup = sf_duplicate(names, (size_t)n)))
        sf_errf(err, "%s: tensor '%s' appears twice (duplicate name)", path, sf_quote(q, dup));
    else {
        for (int i = 0; i < n_meta; i++) names[i] = mk[i];
        if ((dup = sf_duplicate(names, (size_t)n_meta)))
            sf_errf(err, "%s: metadata key '%s' appears twice", path, sf_quote(q, dup));
    }
    free(names);
    return dup ? -1 : 0;
}

// ---- atomic replacement of a file: write a temporary file beside path (see
// atomic_tmp_name), fsync it, rename it over path, fsync the folder. A crash
// at any moment leaves either the old file or the new one, never a mix.

#define OUT_PATH_MAX 4200  // the buffers of output paths: a path may have PATH_MAX - 1 bytes
#define TMP_MARK ".tmp."   // "<name>.tmp.<pid>": run_remove_stale finds a dead writer's files by it

// The last component of path (after its last '/').
static const char *path_base(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

// The folder path lies in: "." for a bare name, "/" for one at the root.
static void path_folder(const char *path, char dir[OUT_PATH_MAX]) {
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(dir, OUT_PATH_MAX, ".");
    else if (slash == path) snprintf(dir, OUT_PATH_MAX, "/");
    else snprintf(dir, OUT_PATH_MAX, "%.*s", (int)(slash - path), path);
}

// An output path the file system takes: its name within NAME_MAX bytes, the
// whole within PATH_MAX - 1. Checked with the other inputs, before anything is
// written (a name too long found at the last file would leave the others written).
static int out_path_check(const char *path, char err[SN_ERR_MAX]) {
    const size_t base = strlen(path_base(path)), whole = strlen(path);
    if (base > NAME_MAX)
        snprintf(err, SN_ERR_MAX, "%.300s...: the file name is %zu bytes, more than the %d a file system takes", path, base,
                 NAME_MAX);
    else if (whole >= PATH_MAX)
        snprintf(err, SN_ERR_MAX, "%.300s...: the path is %zu bytes, more than the %d a path may have", path, whole,
                 PATH_MAX - 1);
    else
        return 0;
    return -1;
}

// "<name>.tmp.<pid>" in path's folder, the name cut short so that the whole
// fits NAME_MAX (any legal name may be written; the temporary one is ours).
static void atomic_tmp_name(const char *path, char tmp[OUT_PATH_MAX]) {
    char suffix[32];
    const int n_suffix = snprintf(suffix, sizeof suffix, TMP_MARK "%ld", (long)getpid());
    const char *base = path_base(path);
    const int dir = (int)(base - path), keep = (int)strnlen(base, NAME_MAX - n_suffix);
    snprintf(tmp, OUT_PATH_MAX, "%.*s%.*s%s", dir, path, keep, base, suffix);
}

// The temporary file, created new (O_EXCL): never a file or link that is
// already there (a link planted at the name would redirect the write).
static FILE *atomic_file_open(const char *path, char tmp[OUT_PATH_MAX], char err[SN_ERR_MAX]) {
    if (out_path_check(path, err)) return NULL;
    atomic_tmp_name(path, tmp);
    const int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    FILE *f = fd < 0 ? NULL : fdopen(fd, "wb");
    if (f) return f;
    if (fd >= 0) close(fd);
    if (errno == EEXIST)
        snprintf(err, SN_ERR_MAX, "%.200s: cannot write: its temporary file %.200s is already there (not this "
                 "process's; remove it)", path, path_base(tmp));
    else
        snprintf(err, SN_ERR_MAX, "%.400s: cannot write: %s", path, strerror(errno));
    return NULL;
}

// Closes f and renames tmp over path if ok (else, or on a failure, removes tmp).
// ok = 0 means the writer failed and has already set err.
static int atomic_file_commit(FILE *f, const char *tmp, const char *path, int ok, char err[SN_ERR_MAX]) {
    if (ok && (fflush(f) != 0 || ferror(f) || fsync(fileno(f)) != 0)) {
        snprintf(err, SN_ERR_MAX, "%.400s: cannot write: %s", path, strerror(errno));
        ok = 0;
    }
    if (fclose(f) != 0 && ok) { snprintf(err, SN_ERR_MAX, "%.400s: cannot write: %s", path, strerror(errno)); ok = 0; }
    if (ok && rename(tmp, path) != 0) {
        snprintf(err, SN_ERR_MAX, "%.400s: renaming the new file over it failed: %s", path, strerror(errno));
        ok = 0;
    }
    if (!ok) { unlink(tmp); return -1; }
    // The file is in place; syncing the folder makes the rename itself durable.
    char dir[OUT_PATH_MAX];
    path_folder(path, dir);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd)) {
        snprintf(err, SN_ERR_MAX, "%.400s: written, but syncing its folder failed: %s", path, strerror(errno));
        if (dfd >= 0) close(dfd);
        return -1;
    }
    close(dfd);
    return 0;
}

int file_write_atomic(const char *path, const void *const *parts, const size_t *sizes, int n_parts,
                      char err[SN_ERR_MAX]) {
    char tmp[OUT_PATH_MAX];
    FILE *f = atomic_file_open(path, tmp, err);
    if (!f) return -1;
    int ok = 1;
    for (int i = 0; ok && i < n_parts; i++) ok = !sizes[i] || fwrite(parts[i], 1, sizes[i], f) == sizes[i];  // an empty part may be NULL
    if (!ok) snprintf(err, SN_ERR_MAX, "%.400s: cannot write: %s", path, strerror(errno));
    return atomic_file_commit(f, tmp, path, ok, err);
}

int safetensors_write(const char *path, const SafetensorsTensor *tensors, int n, const char *const *meta_keys,
             const char *const *meta_values, int n_meta, char err[SN_ERR_MAX]) {
    if (sf_check_write_args(path, tensors, n, meta_keys, meta_values, n_meta, err)) return -1;

    // the header: compact JSON, "__metadata__" first, tensors contiguous in order
    SfBuf h = {0};
    char num[64];
    size_t off = 0;
    sb_str(&h, "{");
    if (n_meta) {
        sb_str(&h, "\"__metadata__\":{");
        for (int i = 0; i < n_meta; i++) {
            if (i) sb_str(&h, ",");
            sb_json(&h, meta_keys[i]);
            sb_str(&h, ":");
            sb_json(&h, meta_values[i]);
        }
        sb_str(&h, "}");
    }
    for (int i = 0; i < n; i++) {
        const SafetensorsTensor *t = &tensors[i];
        size_t bytes = t->numel * dtype_size(t->dtype);
        if (off > SIZE_MAX - bytes) { free(h.p); sf_errf(err, "%s: total size overflows", path); return -1; }
        sb_str(&h, n_meta || i ? "," : "");
        sb_json(&h, t->name);
        sb_str(&h, ":{\"dtype\":\"");
        sb_str(&h, SF_DTYPE_NAMES[t->dtype]);
        sb_str(&h, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) {
            snprintf(num, sizeof num, "%s%" PRId64, d ? "," : "", t->dims[d]);
            sb_str(&h, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%zu,%zu]}", off, off + bytes);
        sb_str(&h, num);
        off += bytes;
    }
    sb_str(&h, "}");
    while ((8 + h.n) % 8) sb_str(&h, " ");  // the data section starts 8-byte aligned
    if (h.oom) { free(h.p); sf_errf(err, "%s: out of memory building the header", path); return -1; }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)h.n >> (8 * i));

    const int n_parts = n + 2;
    const void **parts = malloc(sizeof(void *) * (size_t)n_parts);
    size_t *sizes = malloc(sizeof(size_t) * (size_t)n_parts);
    int rc = -1;
    if (parts && sizes) {
        parts[0] = len8; sizes[0] = 8;
        parts[1] = h.p; sizes[1] = h.n;
        for (int i = 0; i < n; i++) { parts[2 + i] = tensors[i].data; sizes[2 + i] = tensors[i].numel * dtype_size(tensors[i].dtype); }
        rc = file_write_atomic(path, parts, sizes, n_parts, err);
    } else {
        sf_errf(err, "%s: out of memory", path);
    }
    free(parts); free(sizes); free(h.p);
    return rc;
}

// ----------------------------------------------------------------------------
// weights by name: safetensors files in PyTorch layout
//
// Names are the graph's (torchvision's for EfficientNetV2). Files hold
// PyTorch's layout, so that they load into torchvision as they are: conv
// weights OIHW, transposed to and from segnet's OHWI on the way.

// element [o][i][y][x] of OIHW goes to [o][y][x][i]
static void oihw_to_ohwi(const float *src, float *dst, int n_out, int n_in, int kh, int kw) {
    for (int o = 0; o < n_out; o++)
        for (int i = 0; i < n_in; i++)
            for (int y = 0; y < kh; y++)
                for (int x = 0; x < kw; x++)
                    dst[(((size_t)o * kh + y) * kw + x) * n_in + i] = src[(((size_t)o * n_in + i) * kh + y) * kw + x];
}
static void ohwi_to_oihw(const float *src, float *dst, int n_out, int n_in, int kh, int kw) {
    for (int o = 0; o < n_out; o++)
        for (int i = 0; i < n_in; i++)
            for (int y = 0; y < kh; y++)
                for (int x = 0; x < kw; x++)
                    dst[(((size_t)o * n_in + i) * kh + y) * kw + x] = src[(((size_t)o * kh + y) * kw + x) * n_in + i];
}

// a file tensor's values as fp32 (its data may be unaligned and fp16/bf16/int64)
void safetensors_tensor_f32(const SafetensorsTensor *t, float *dst) {
    const uint8_t *p = (const uint8_t *)t->data;
    for (size_t i = 0; i < t->numel; i++) {
        if (t->dtype == DT_F32) { memcpy(&dst[i], p + 4 * i, 4); continue; }
        if (t->dtype == DT_I64) { int64_t v; memcpy(&v, p + 8 * i, 8); dst[i] = (float)v; continue; }
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        dst[i] = t->dtype == DT_F16 ? f16_to_f32(h) : bf16_to_f32(h);
    }
}

// timm's name for an EfficientNetV2 tensor named as torchvision names it
// (timm's tf_efficientnetv2_*: conv_stem/bn1, blocks.{s-1}.{j}.*, conv_head/bn2,
// classifier); 0 where timm has no such tensor. A block's kind decides its
// names: ConvBnAct (fused, expansion 1) conv/bn1; EdgeResidual (fused)
// conv_exp/bn1/conv_pwl/bn2; InvertedResidual (MBConv) conv_pw/bn1/conv_dw/bn2/
// se.conv_reduce/se.conv_expand/conv_pwl/bn3.
int effnet_timm_name(const Graph *g, const char *name, char out[SN_NAME_MAX]) {
    static const char *const IR[4][2] = {{"conv_pw", "bn1"}, {"conv_dw", "bn2"}, {NULL, NULL}, {"conv_pwl", "bn3"}};
    static const char *const ER[2][2] = {{"conv_exp", "bn1"}, {"conv_pwl", "bn2"}};
    int s, j, k, m, n = 0;
    if (sscanf(name, "classifier.1.%n", &n) == 0 && n > 0) {
        if (graph_find_param(g, "classifier.4.weight") >= 0) return 0;  // a hidden head: not timm's
        return snprintf(out, SN_NAME_MAX, "classifier.%s", name + n) < SN_NAME_MAX;
    }
    n = 0;
    if (sscanf(name, "features.%d.%n", &s, &n) != 1 || n == 0) return 0;
    const char *rest = name + n;
    int nb = 0;
    if (sscanf(rest, "%d.block.%n", &j, &nb) == 1 && nb > 0) {
        const char *tail = rest + nb, *field;
        char probe[SN_NAME_MAX];
        if (!strncmp(tail, "2.fc1.", 6) || !strncmp(tail, "2.fc2.", 6))
            return snprintf(out, SN_NAME_MAX, "blocks.%d.%d.se.%s.%s", s - 1, j,
                            tail[4] == '1' ? "conv_reduce" : "conv_expand", tail + 6) < SN_NAME_MAX;
        int nk = 0;
        if (sscanf(tail, "%d.%d.%n", &k, &m, &nk) != 2 || nk == 0 || k < 0 || k > 3 || m < 0 || m > 1) return 0;
        snprintf(probe, sizeof probe, "features.%d.%d.block.2.fc1.weight", s, j);
        if (graph_find_param(g, probe) >= 0) field = IR[k][m];
        else {
            snprintf(probe, sizeof probe, "features.%d.%d.block.1.0.weight", s, j);
            if (graph_find_param(g, probe) >= 0) field = k < 2 ? ER[k][m] : NULL;
            else field = k == 0 ? (m ? "bn1" : "conv") : NULL;
        }
        return field && snprintf(out, SN_NAME_MAX, "blocks.%d.%d.%s.%s", s - 1, j, field, tail + nk) < SN_NAME_MAX;
    }
    // stem (features.0) or head (the last features entry): P.0 conv, P.1 BN
    if ((rest[0] != '0' && rest[0] != '1') || rest[1] != '.') return 0;
    const char *field = rest[0] == '0' ? (s == 0 ? "conv_stem" : "conv_head") : (s == 0 ? "bn1" : "bn2");
    return snprintf(out, SN_NAME_MAX, "%s.%s", field, rest + 2) < SN_NAME_MAX;
}

// the PyTorch shape of a segnet parameter: OHWI (4-d) becomes OIHW
static void torch_dims(const ParamInfo *p, int64_t dims[4]) {
    for (int k = 0; k < p->ndim; k++) dims[k] = p->dims[k];
    if (p->ndim == 4) { dims[1] = p->dims[3]; dims[2] = p->dims[1]; dims[3] = p->dims[2]; }
}

static void dims_str(char *buf, size_t size, const int64_t *d, int n) {
    int k = snprintf(buf, size, "(");
    for (int i = 0; i < n && k < (int)size; i++) k += snprintf(buf + k, size - k, i ? ",%lld" : "%lld", (long long)d[i]);
    if (k < (int)size) snprintf(buf + k, size - k, ")");
}

// appends "name" to a comma-separated list, at most a few names then "..."
// (a name from a file may hold any byte but NUL: control bytes are shown as '?',
// so that the message stays one line)
static void list_add(char *list, size_t size, int *count, const char *name) {
    if (*count < 4) {
        size_t len = strlen(list);
        snprintf(list + len, size - len, "%s%s", *count ? ", " : "", name);
        for (char *p = list + len; *p; p++) if ((uint8_t)*p < 0x20 || *p == 0x7f) *p = '?';
    } else if (*count == 4) {
        size_t len = strlen(list);
        snprintf(list + len, size - len, ", ...");
    }
    (*count)++;
}

// whether name starts with one of the comma-separated prefixes ("*": any name)
static int has_prefix_in(const char *name, const char *prefixes) {
    if (!prefixes || !prefixes[0]) return 0;
    if (!strcmp(prefixes, "*")) return 1;
    for (const char *p = prefixes; *p;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len && !strncmp(name, p, len)) return 1;
        if (!end) break;
        p = end + 1;
    }
    return 0;
}

#define BN_STAT_SUFFIX ".running_var"       // one per batch norm: where num_batches_tracked goes
#define BN_COUNT_SUFFIX ".num_batches_tracked"

static int name_ends_with(const char *name, const char *suffix) {
    const size_t n = strlen(name), k = strlen(suffix);
    return n >= k && !strcmp(name + n - k, suffix);
}

// Values no model may hold: NaN or inf anywhere (a diverged run's), a
// negative batch-norm variance. -1 with err naming the file, the tensor and
// the first such element.
static int values_allowed(const char *path, const char *name, const float *v, size_t n, char err[SN_ERR_MAX]) {
    const int variance = name_ends_with(name, BN_STAT_SUFFIX);
    for (size_t i = 0; i < n; i++)
        if (!isfinite(v[i]) || (variance && v[i] < 0.0f)) {
            snprintf(err, SN_ERR_MAX, "%.250s: tensor '%.100s' holds %g at element %zu: %s", path, name, v[i], i,
                     isfinite(v[i]) ? "a variance cannot be negative" : "not a finite number (the weights of a diverged run?)");
            return -1;
        }
    return 0;
}

int net_load_weights(Net *net, const SafetensorsFile *f, const char *path, const char *allow_missing, int allow_unexpected,
                     char err[SN_ERR_MAX]) {
    const LoadRules rules = {allow_missing, allow_unexpected ? "*" : NULL, 0};
    return net_load_weights_rules(net, f, path, &rules, NULL, err);
}

int net_load_weights_rules(Net *net, const SafetensorsFile *f, const char *path, const LoadRules *rules, char *report,
                           char err[SN_ERR_MAX]) {
    const Graph *g = net->g;
    const char *allow_missing = rules ? rules->init : NULL;
    int n_loaded = 0, n_timm = 0, n_init = 0, n_ignored = 0;
    char init_list[256] = "", ignored_list[256] = "";
    const int n_entries = g->n_params + g->n_buffers;
    const SafetensorsTensor **src = calloc((size_t)n_entries, sizeof *src);
    char *used = calloc((size_t)f->n_tensors + 1, 1);
    snCheck(src && used, "out of host memory");
    char missing[256] = "", wrong[384] = "", unexpected[256] = "";
    int n_missing = 0, n_wrong = 0, n_unexpected = 0;
    // first every check, then the copy: a refused file changes nothing
    for (int e = 0; e < n_entries; e++) {
        const ParamInfo *p = e < g->n_params ? &g->params[e] : &g->buffers[e - g->n_params];
        const SafetensorsTensor *t = safetensors_find(f, p->name);
        char alias[SN_NAME_MAX];
        if (!t && effnet_timm_name(g, p->name, alias) && (t = safetensors_find(f, alias)) != NULL) n_timm++;  // timm's naming
        int skippable = has_prefix_in(p->name, allow_missing);
        if (t) used[t - f->tensors] = 1;
        int64_t want[4];
        torch_dims(p, want);
        int same = t && t->ndim == p->ndim && t->dtype != DT_I64;  // a weight is floating point
        for (int k = 0; same && k < p->ndim; k++) same = t->dims[k] == want[k];
        if (!t) {
            if (!skippable) list_add(missing, sizeof missing, &n_missing, p->name);
            else list_add(init_list, sizeof init_list, &n_init, p->name);
        } else if (!same) {
            if (skippable) {  // the model's tensor initialised, the file's (of another shape) ignored
                list_add(init_list, sizeof init_list, &n_init, p->name);
                list_add(ignored_list, sizeof ignored_list, &n_ignored, t->name);
            } else {
                char a[96], b[96], item[2 * SN_NAME_MAX + 200];
                dims_str(a, sizeof a, t->dims, t->ndim);
                dims_str(b, sizeof b, want, p->ndim);
                if (t->dtype == DT_I64)
                    snprintf(item, sizeof item, "%s is I64, a weight is floating point (F32, F16 or BF16)", p->name);
                else
                    snprintf(item, sizeof item, "%s is %s, the model needs %s", p->name, a, b);
                list_add(wrong, sizeof wrong, &n_wrong, item);
            }
        } else {
            src[e] = t;
            n_loaded++;
        }
    }
    for (int i = 0; i < f->n_tensors; i++) {
        const char *name = f->tensors[i].name;
        if (used[i] || strstr(name, "num_batches_tracked") || !strncmp(name, TRAIN_STATE_PREFIX, strlen(TRAIN_STATE_PREFIX)))
            continue;
        if (has_prefix_in(name, rules ? rules->ignore : NULL)) list_add(ignored_list, sizeof ignored_list, &n_ignored, name);
        else list_add(unexpected, sizeof unexpected, &n_unexpected, name);
    }
    int refuse = n_missing || n_wrong || n_unexpected;
    if (refuse) {
        int k = snprintf(err, SN_ERR_MAX, "%s: not loaded:", path);
        if (n_missing && k < SN_ERR_MAX) k += snprintf(err + k, SN_ERR_MAX - k, " %d missing (%s);", n_missing, missing);
        if (n_wrong && k < SN_ERR_MAX) k += snprintf(err + k, SN_ERR_MAX - k, " %d of the wrong shape or type (%s);", n_wrong, wrong);
        if (n_unexpected && k < SN_ERR_MAX)
            k += snprintf(err + k, SN_ERR_MAX - k, " %d unexpected (%s);", n_unexpected, unexpected);
        if (k < SN_ERR_MAX && (n_missing || n_wrong))
            snprintf(err + k, SN_ERR_MAX - k, " tensors a training run should initialise instead can be named with "
                     "--allow-missing PREFIX");
    }
    size_t max_count = 1;
    for (int e = 0; e < n_entries; e++) {
        const ParamInfo *p = e < g->n_params ? &g->params[e] : &g->buffers[e - g->n_params];
        if (p->count > max_count) max_count = p->count;
    }
    float *vals = malloc(sizeof(float) * max_count), *tmp = malloc(sizeof(float) * max_count);
    snCheck(vals && tmp, "out of host memory");
    for (int e = 0; e < n_entries && !refuse; e++)  // the values, before anything is copied
        if (src[e]) {
            safetensors_tensor_f32(src[e], vals);
            refuse = values_allowed(path, src[e]->name, vals, src[e]->numel, err) != 0;
        }
    if (!refuse && !(rules && rules->check_only)) {
        if (report)
            snprintf(report, SN_ERR_MAX, "weights: %d tensors loaded from %.200s (%s names), %d initialised%s%s%s, "
                     "%d ignored%s%s%s", n_loaded, path, n_timm ? "timm" : "torchvision", n_init, n_init ? " (" : "",
                     init_list, n_init ? ")" : "", n_ignored, n_ignored ? " (" : "", ignored_list, n_ignored ? ")" : "");
        Ops *o = net->o;
        for (int e = 0; e < n_entries; e++) {
            if (!src[e]) continue;  // skipped under allow_missing
            const int is_param = e < g->n_params;
            const ParamInfo *p = is_param ? &g->params[e] : &g->buffers[e - g->n_params];
            safetensors_tensor_f32(src[e], vals);
            if (p->ndim == 4) {
                oihw_to_ohwi(vals, tmp, p->dims[0], p->dims[3], p->dims[1], p->dims[2]);
                memcpy(vals, tmp, sizeof(float) * p->count);
            }
            o->upload(o, (is_param ? net->params : net->buffers) + p->offset, vals, sizeof(float) * p->count);
        }
    }
    free(vals); free(tmp);
    free(src); free(used);
    return refuse ? -1 : 0;
}

// a metadata value of the file, NULL if it has no such key
static const char *safetensors_meta(const SafetensorsFile *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++) if (!strcmp(f->meta_keys[i], key)) return f->meta_values[i];
    return NULL;
}

int weights_padding(const SafetensorsFile *f, PadMode *pad, const char **why) {
    const char *meta = safetensors_meta(f, "padding");
    if (meta && (!strcmp(meta, "same") || !strcmp(meta, "symmetric"))) {
        *pad = strcmp(meta, "same") ? PAD_SYMMETRIC : PAD_SAME;
        *why = "from the file's metadata";
        return 1;
    }
    if (safetensors_meta(f, "epoch")) return 0;  // a segnet checkpoint from before the padding was recorded
    if (safetensors_find(f, "conv_stem.weight")) { *pad = PAD_SAME; *why = "timm's tf_efficientnetv2 names: TensorFlow's SAME"; return 1; }
    if (safetensors_find(f, "features.0.0.weight")) { *pad = PAD_SYMMETRIC; *why = "torchvision names"; return 1; }
    return 0;
}

static const char *PAD_NAME[2] = {"same", "symmetric"};
int padding_follow_weights(ModelCfg *m, const char *weights, const char *cmd, char *note, char err[SN_ERR_MAX]) {
    note[0] = 0;
    const char *model = m->model;
    if (!weights || !(eff_spec(model) || (!strncmp(model, "unet-", 5) && eff_spec(model + 5)))) return 0;
    SafetensorsFile f;
    if (safetensors_read(weights, &f, err)) return -1;
    PadMode pad;
    const char *why, *source = m->pad_given == PAD_RUN ? "the run's config.txt" : m->pad_given ? "--padding" : "the default";
    if (!weights_padding(&f, &pad, &why)) {
        snprintf(note, SN_ERR_MAX, "padding %s (%s; the weights do not say)", PAD_NAME[m->pad], source);
    } else if (!m->pad_given) {
        m->pad = pad;
        snprintf(note, SN_ERR_MAX, "padding %s (%s)", PAD_NAME[pad], why);
    } else {
        if (m->pad != pad)
            fprintf(stderr, "segnet %s: warning: padding %s (%s), but the weights were trained with %s padding (%s)\n", cmd,
                    PAD_NAME[m->pad], source, PAD_NAME[pad], why);
        snprintf(note, SN_ERR_MAX, "padding %s (%s%s)", PAD_NAME[m->pad], source, m->pad != pad ? ", against the weights" : "");
    }
    safetensors_free(&f);
    return 0;
}

int net_save_weights(const Net *net, const char *path, char err[SN_ERR_MAX]) {
    return net_save_checkpoint(net, path, NULL, 0, NULL, NULL, 0, err);
}

int net_save_checkpoint(const Net *net, const char *path, const SafetensorsTensor *extra, int n_extra,
                        const char *const *meta_keys, const char *const *meta_values, int n_meta,
                        char err[SN_ERR_MAX]) {
    const Graph *g = net->g;
    Ops *o = net->o;
    const int n_model = g->n_params + g->n_buffers, n = n_model + n_extra;
    size_t total = g->n_param_floats + g->n_buffer_floats;
    float *host = malloc(sizeof(float) * (total ? total : 1)), *tmp = malloc(sizeof(float) * (total ? total : 1));
    SafetensorsTensor *ts = calloc((size_t)n, sizeof *ts);
    snCheck(host && tmp && ts, "out of host memory");
    o->download(o, host, net->params, sizeof(float) * g->n_param_floats);
    o->download(o, host + g->n_param_floats, net->buffers, sizeof(float) * g->n_buffer_floats);
    for (int e = 0; e < n_model; e++) {
        const int is_param = e < g->n_params;
        const ParamInfo *p = is_param ? &g->params[e] : &g->buffers[e - g->n_params];
        float *v = host + (is_param ? 0 : g->n_param_floats) + p->offset;
        if (p->ndim == 4) {  // to OIHW, in the spare copy at the same offset
            float *t = tmp + (is_param ? 0 : g->n_param_floats) + p->offset;
            ohwi_to_oihw(v, t, p->dims[0], p->dims[3], p->dims[1], p->dims[2]);
            v = t;
        }
        SafetensorsTensor *t = &ts[e];
        snprintf(t->name, sizeof t->name, "%s", p->name);
        t->dtype = DT_F32;
        t->ndim = p->ndim;
        torch_dims(p, t->dims);
        t->numel = p->count;
        t->data = v;
    }
    for (int e = 0; e < n_extra; e++) ts[n_model + e] = extra[e];
    const char **keys = calloc((size_t)n_meta + 2, sizeof(char *)), **values = calloc((size_t)n_meta + 2, sizeof(char *));
    snCheck(keys && values, "out of host memory");
    keys[0] = "format"; values[0] = "segnet";
    keys[1] = "layout"; values[1] = "pytorch (conv weights OIHW)";
    for (int k = 0; k < n_meta; k++) { keys[2 + k] = meta_keys[k]; values[2 + k] = meta_values[k]; }
    int rc = safetensors_write(path, ts, n, keys, values, n_meta + 2, err);
    free(host); free(tmp); free(ts); free(keys); free(values);
    return rc;
}

// ----------------------------------------------------------------------------
// images and classifier prediction
//
// Decoding is stb_image's (Debian libstb: the header declares, libstb.so
// implements). Images are RGB, values 0..255 as floats, (H,W,3).

// Lists a prediction's images: a folder's *.png, *.jpg, *.jpeg sorted by name,
// or the first column of a CSV (an optional header whose first field is
// "path"; paths relative to the CSV's folder unless absolute).

void path_list_free(PathList *l) {
    for (int i = 0; i < l->n; i++) free(l->paths[i]);
    free(l->paths);
    memset(l, 0, sizeof *l);
}

static void path_list_add(PathList *l, const char *dir, const char *name) {
    GROW(l->paths, l->n, l->cap);
    size_t len = strlen(name) + (dir ? strlen(dir) + 1 : 0) + 1;
    char *p = malloc(len);
    snCheck(p != NULL, "out of host memory");
    if (dir) snprintf(p, len, "%s/%s", dir, name); else snprintf(p, len, "%s", name);
    l->paths[l->n++] = p;
}

static int has_image_ext(const char *name) {
    const char *dot = strrchr(name, '.');
    return dot && (!strcasecmp(dot, ".png") || !strcasecmp(dot, ".jpg") || !strcasecmp(dot, ".jpeg"));
}

static int cmp_str(const void *a, const void *b) { return strcmp(*(char *const *)a, *(char *const *)b); }

// qsort for arrays that may be empty (and NULL, which qsort may not be given)
static void sort_n(void *base, size_t n, size_t size, int (*cmp)(const void *, const void *)) {
    if (n > 1) qsort(base, n, size, cmp);
}

// One CSV field starting at *s: quoted (with "" for a quote) or up to a comma,
// blanks around it dropped; *s moves past it and its comma. Returns NULL, or
// why the row is malformed. *more (if given): another field follows.
#define CSV_BLANKS " \t"
static const char *csv_field(const char **s, char *out, size_t size, int *more) {
    const char *p = *s + strspn(*s, CSV_BLANKS);
    size_t k = 0, n = 0;
    if (*p == '"') {
        for (p++;; p++) {
            if (!*p || *p == '\n' || *p == '\r') return "unterminated quoted field";
            if (*p == '"') { if (p[1] != '"') { p++; break; } p++; }
            if (k + 1 < size) out[k++] = *p;
            n++;
        }
        p += strspn(p, CSV_BLANKS);
        if (*p && *p != ',' && *p != '\n' && *p != '\r') return "text after a closing quote";
    } else {
        for (; *p && *p != ',' && *p != '\n' && *p != '\r'; p++, n++) if (k + 1 < size) out[k++] = *p;
        while (k > 0 && strchr(CSV_BLANKS, out[k - 1])) k--;
    }
    out[k] = 0;
    if (n >= size) return "a field is too long";
    if (more) *more = *p == ',';
    if (*p == ',') p++;
    *s = p;
    return NULL;
}

// A CSV's first row may start with a UTF-8 byte order mark (spreadsheets write one).
static const char *csv_skip_bom(const char *line, int row) {
    return row == 1 && !memcmp(line, "\xef\xbb\xbf", 3) ? line + 3 : line;
}

int list_images(const char *input, PathList *out, char err[SN_ERR_MAX]) {
    memset(out, 0, sizeof *out);
    struct stat sb;
    if (stat(input, &sb) != 0) { snprintf(err, SN_ERR_MAX, "%s: %s", input, strerror(errno)); return -1; }
    if (S_ISDIR(sb.st_mode)) {
        DIR *d = opendir(input);
        if (!d) { snprintf(err, SN_ERR_MAX, "%s: %s", input, strerror(errno)); return -1; }
        for (struct dirent *e; (e = readdir(d));)
            if (e->d_name[0] != '.' && has_image_ext(e->d_name)) path_list_add(out, input, e->d_name);
        closedir(d);
        sort_n(out->paths, (size_t)out->n, sizeof(char *), cmp_str);
    } else {
        FILE *f = fopen_regular(input, "r", err);
        if (!f) return -1;
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", input);
        char *slash = strrchr(dir, '/');
        if (slash) *slash = 0; else snprintf(dir, sizeof dir, ".");
        char line[8192], field[4096];
        for (int row = 1; fgets(line, sizeof line, f); row++) {
            if (!strchr(line, '\n') && !feof(f)) {
                snprintf(err, SN_ERR_MAX, "%s: row %d: longer than %zu characters", input, row, sizeof line - 1);
                fclose(f); path_list_free(out); return -1;
            }
            const char *s = csv_skip_bom(line, row), *why;
            if (!s[strspn(s, CSV_BLANKS "\r\n")]) continue;
            if ((why = csv_field(&s, field, sizeof field, NULL))) {
                snprintf(err, SN_ERR_MAX, "%s: row %d: %s", input, row, why);
                fclose(f); path_list_free(out); return -1;
            }
            if (row == 1 && !strcmp(field, "path")) continue;  // header
            if (!field[0]) {
                snprintf(err, SN_ERR_MAX, "%s: row %d: empty path", input, row);
                fclose(f); path_list_free(out); return -1;
            }
            path_list_add(out, field[0] == '/' ? NULL : dir, field);
        }
        fclose(f);
    }
    if (out->n == 0) { snprintf(err, SN_ERR_MAX, "%s: no images (*.png, *.jpg, *.jpeg) listed", input); return -1; }
    return 0;
}

// stb_image's reason for its last failure, printable: it may have none, and
// for an unknown PNG chunk it quotes the chunk's four raw bytes (from a static
// buffer that other decoding threads may be writing).
static const char *decoder_reason(void) {
    static __thread char shown[64];
    const char *why = stbi_failure_reason();
    if (!why || !why[0]) return "no reason given";
    size_t k = 0;
    for (; why[k] && k + 1 < sizeof shown; k++) shown[k] = (uint8_t)why[k] < 0x20 || (uint8_t)why[k] >= 0x7f ? '?' : why[k];
    shown[k] = 0;
    return shown;
}

// ---- image files: read whole (regular files only), recognised by their first
// bytes (PNG or JPEG, whatever the extension says), the size in the header
// checked against --max-pixels before anything is decoded.

#define IMAGE_MAX_PIXELS_DEFAULT 100000000  // 10^8: a 10000×10000 photograph; a decompression bomb declares more
#define TEXT_OF(x) TEXT_OF_(x)              // a macro's value as a string literal (for --help)
#define TEXT_OF_(x) #x
#define IMAGE_FILE_MAX ((size_t)1 << 30)    // stb_image takes an int length; real images are far smaller
static int64_t image_max_pixels = IMAGE_MAX_PIXELS_DEFAULT;  // --max-pixels

typedef enum { IMAGE_PNG, IMAGE_JPEG, IMAGE_UNKNOWN } ImageFormat;

static ImageFormat image_format(const uint8_t *b, size_t n) {
    if (n >= 8 && !memcmp(b, "\x89PNG\r\n\x1a\n", 8)) return IMAGE_PNG;
    if (n >= 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff) return IMAGE_JPEG;
    return IMAGE_UNKNOWN;
}

// The bytes of a regular file; a FIFO, device or folder is refused before a
// read could block on it. NULL with err.
static uint8_t *file_read_regular(const char *path, size_t max, size_t *n, char err[SN_ERR_MAX]) {
    struct stat sb;
    const char *why;
    int fd = open_regular(path, &sb, &why);
    if (fd < 0) { snprintf(err, SN_ERR_MAX, "%s: %s", path, why); return NULL; }
    uint8_t *b = NULL;
    if ((uint64_t)sb.st_size > max) {
        snprintf(err, SN_ERR_MAX, "%s: %" PRIu64 " bytes, more than the %zu an image may have", path, (uint64_t)sb.st_size, max);
    } else {
        size_t got = 0, want = (size_t)sb.st_size;
        b = malloc(want ? want : 1);
        snCheck(b != NULL, "out of host memory");
        for (ssize_t r; got < want; got += (size_t)r)
            if ((r = read(fd, b + got, want - got)) <= 0) {
                if (r < 0 && errno == EINTR) { r = 0; continue; }
                snprintf(err, SN_ERR_MAX, "%s: %s after %zu of %zu bytes", path, r ? strerror(errno) : "file shrank while reading",
                         got, want);
                free(b);
                b = NULL;
                break;
            }
        *n = got;
    }
    close(fd);
    return b;
}

// An image file's bytes, its format and header checked: (h,w) from the header,
// within image_max_pixels. png_only: masks (a JPEG's artefacts change classes).
static uint8_t *image_file_bytes(const char *path, int png_only, size_t *n, int *h, int *w, char err[SN_ERR_MAX]) {
    uint8_t *b = file_read_regular(path, IMAGE_FILE_MAX, n, err);
    if (!b) return NULL;
    const ImageFormat fmt = image_format(b, *n);
    int comp;
    if (fmt == IMAGE_UNKNOWN || (png_only && fmt != IMAGE_PNG)) {
        snprintf(err, SN_ERR_MAX, "%s: %s", path, fmt == IMAGE_JPEG ? "holds JPEG data, but a mask must be a PNG (JPEG's "
                 "compression changes pixel values, so classes)" : png_only ? "not a PNG file" : "not a PNG or JPEG file");
    } else if (!stbi_info_from_memory(b, (int)*n, w, h, &comp)) {
        snprintf(err, SN_ERR_MAX, "%s: cannot decode the image (%s)", path, decoder_reason());
    } else if ((int64_t)*w * *h > image_max_pixels) {
        snprintf(err, SN_ERR_MAX, "%s: %dx%d is %" PRId64 " pixels, more than the limit of %" PRId64 " (--max-pixels)", path,
                 *w, *h, (int64_t)*w * *h, image_max_pixels);
    } else {
        return b;
    }
    free(b);
    return NULL;
}

// The model's input size is an image too: what an image may not declare, the
// size every image is resized to may not be (decoding buffers are that large).
static int input_size_checked(const ModelCfg *m, char err[SN_ERR_MAX]) {
    if ((int64_t)m->height * m->width <= image_max_pixels) return 0;
    snprintf(err, SN_ERR_MAX, "--size %dx%d is %" PRId64 " pixels, more than the limit of %" PRId64 " (--max-pixels)", m->height,
             m->width, (int64_t)m->height * m->width, image_max_pixels);
    return -1;
}

// ---- EXIF orientation: a JPEG may say how its stored pixels are to be turned
// for display (the Orientation tag, 0x0112, of the TIFF structure in its APP1
// "Exif" segment). --exif ignore (the default, as tf.image.decode_jpeg and
// Keras' loaders) reads the pixels as stored; --exif apply as displayed (PIL's
// ImageOps.exif_transpose), the view masks are drawn on.

typedef enum { EXIF_IGNORE, EXIF_APPLY } ExifMode;
static const char *const EXIF_MODE_NAMES[] = {"ignore", "apply"};
static ExifMode image_exif = EXIF_IGNORE;  // --exif

#define JPEG_SOS 0xda                // start of scan: the entropy-coded data follows
#define JPEG_EOI 0xd9
#define JPEG_APP1 0xe1
#define EXIF_HEADER "Exif\0\0"       // an APP1 segment's first bytes when it holds EXIF
#define EXIF_HEADER_LEN 6
#define TIFF_HEADER_LEN 8            // byte order "II"/"MM", 42, IFD0's offset
#define TIFF_MAGIC 42
#define TIFF_ENTRY_LEN 12            // tag, type, count, value (or its offset)
#define TIFF_SHORT 3
#define EXIF_ORIENTATION_TAG 0x0112

// what display does to the stored pixels, by orientation 1..8 (the EXIF
// specification's "0th row / 0th column" table)
static const char *const EXIF_DISPLAYED[9] = {
    NULL, "shown as stored", "mirrored left to right", "rotated 180°", "mirrored top to bottom",
    "mirrored left to right and rotated 90° anticlockwise", "rotated 90° clockwise",
    "mirrored left to right and rotated 90° clockwise", "rotated 90° anticlockwise"};

static uint32_t tiff_u16(const uint8_t *p, int big) { return big ? (uint32_t)p[0] << 8 | p[1] : (uint32_t)p[1] << 8 | p[0]; }
static uint32_t tiff_u32(const uint8_t *p, int big) {
    return big ? tiff_u16(p, 1) << 16 | tiff_u16(p + 2, 1) : tiff_u16(p + 2, 0) << 16 | tiff_u16(p, 0);
}

// IFD0's Orientation in the TIFF structure t[0..n): 1..8, or 1 when it has
// none or anything on the way is malformed (every offset checked against n).
static int tiff_orientation(const uint8_t *t, size_t n) {
    if (n < TIFF_HEADER_LEN) return 1;
    const int big = !memcmp(t, "MM", 2);
    if ((!big && memcmp(t, "II", 2)) || tiff_u16(t + 2, big) != TIFF_MAGIC) return 1;
    const uint32_t ifd = tiff_u32(t + 4, big);
    if (ifd < TIFF_HEADER_LEN || ifd > n - 2) return 1;
    const uint32_t entries = tiff_u16(t + ifd, big);
    if (entries > (n - ifd - 2) / TIFF_ENTRY_LEN) return 1;
    for (uint32_t i = 0; i < entries; i++) {
        const uint8_t *e = t + ifd + 2 + (size_t)TIFF_ENTRY_LEN * i;
        if (tiff_u16(e, big) != EXIF_ORIENTATION_TAG) continue;
        if (tiff_u16(e + 2, big) != TIFF_SHORT || tiff_u32(e + 4, big) != 1) return 1;
        const uint32_t v = tiff_u16(e + 8, big);  // a single SHORT sits in the value field's first two bytes
        return v >= 1 && v <= 8 ? (int)v : 1;
    }
    return 1;
}

// A JPEG's EXIF orientation 1..8 from its bytes b[0..n): the first APP1
// "Exif" segment before the scan data; 1 for anything else (no tag, not a
// JPEG, a malformed segment). Reads nothing outside b.
static int exif_orientation(const uint8_t *b, size_t n) {
    if (n < 2 || b[0] != 0xff || b[1] != 0xd8) return 1;
    for (size_t p = 2; p + 4 <= n;) {
        if (b[p] != 0xff) return 1;
        const uint8_t marker = b[p + 1];
        if (marker == 0xff) { p++; continue; }  // a fill byte before the marker
        if (marker == JPEG_SOS || marker == JPEG_EOI) return 1;
        const size_t len = (size_t)b[p + 2] << 8 | b[p + 3];  // counts its own two bytes
        if (len < 2 || len > n - p - 2) return 1;
        const uint8_t *seg = b + p + 4;
        if (marker == JPEG_APP1 && len - 2 >= EXIF_HEADER_LEN && !memcmp(seg, EXIF_HEADER, EXIF_HEADER_LEN))
            return tiff_orientation(seg + EXIF_HEADER_LEN, len - 2 - EXIF_HEADER_LEN);
        p += 2 + len;
    }
    return 1;
}

// dst (H,W,3) = src (h,w,3) as displayed under orientation o: (H,W) = (w,h)
// for 5..8. Displayed pixel (y,x) is stored pixel (sy,sx) with
//   sy = a·(h−1) + b·y + c·x,  sx = d·(w−1) + e·y + f·x
// ({a,b,c,d,e,f} per orientation below, from the specification's table: e.g.
// 6, "the 0th row is the visual right-hand side, the 0th column the visual
// top", gives sy = h−1−x, sx = y).
static void exif_orient(float *dst, const uint8_t *src, int h, int w, int o) {
    static const int8_t M[9][6] = {
        {0, 1, 0, 0, 0, 1},  {0, 1, 0, 0, 0, 1},  {0, 1, 0, 1, 0, -1}, {1, -1, 0, 1, 0, -1}, {1, -1, 0, 0, 0, 1},
        {0, 0, 1, 0, 1, 0},  {1, 0, -1, 0, 1, 0}, {1, 0, -1, 1, -1, 0}, {0, 0, 1, 1, -1, 0}};
    const int8_t *m = M[o >= 1 && o <= 8 ? o : 1];
    const int H = o >= 5 ? w : h, W = o >= 5 ? h : w;
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) {
            const int sy = m[0] * (h - 1) + m[1] * y + m[2] * x, sx = m[3] * (w - 1) + m[4] * y + m[5] * x;
            const uint8_t *s = src + 3 * ((size_t)sy * w + sx);
            float *d = dst + 3 * ((size_t)y * W + x);
            d[0] = s[0]; d[1] = s[1]; d[2] = s[2];
        }
}

// For a message about an image's size: what its EXIF orientation o did (--exif
// apply) or would do (ignore) to it; "" when o is 1.
static const char *exif_size_note(char *s, size_t cap, int o) {
    if (o <= 1 || o > 8) s[0] = 0;
    else if (image_exif == EXIF_APPLY)
        snprintf(s, cap, " (the image's EXIF orientation %d was applied: it is read %s; --exif ignore reads images as stored)",
                 o, EXIF_DISPLAYED[o]);
    else
        snprintf(s, cap, " (the image's EXIF orientation is %d, %s when displayed; --exif apply reads images as displayed)",
                 o, EXIF_DISPLAYED[o]);
    return s;
}

// (h,w,3) RGB values 0..255, malloc'd, as stored or as displayed (--exif);
// *orientation: the file's EXIF orientation (1 without one). NULL with err
// naming the file and the problem.
static float *image_load_oriented(const char *path, int *h, int *w, int *orientation, char err[SN_ERR_MAX]) {
    size_t n;
    int hh, ww, comp;
    uint8_t *b = image_file_bytes(path, 0, &n, &hh, &ww, err);
    if (!b) return NULL;
    *orientation = exif_orientation(b, n);
    unsigned char *px = stbi_load_from_memory(b, (int)n, w, h, &comp, 3);
    free(b);
    if (!px || *w != ww || *h != hh) {
        snprintf(err, SN_ERR_MAX, "%s: cannot decode the image (%s)", path, px ? "its size changed while decoding" : decoder_reason());
        stbi_image_free(px);
        return NULL;
    }
    size_t count = (size_t)*h * *w * 3;
    float *img = malloc(sizeof(float) * count);
    snCheck(img != NULL, "out of host memory");
    if (image_exif == EXIF_APPLY && *orientation != 1) {
        exif_orient(img, px, *h, *w, *orientation);
        if (*orientation >= 5) { *h = ww; *w = hh; }
    } else {
        for (size_t i = 0; i < count; i++) img[i] = px[i];
    }
    stbi_image_free(px);
    return img;
}

// (h,w,3) RGB values 0..255, malloc'd, as --exif says; NULL with err naming the file and the problem
float *image_load_rgb(const char *path, int *h, int *w, char err[SN_ERR_MAX]) {
    int orientation;
    return image_load_oriented(path, h, w, &orientation, err);
}

// a path as a CSV field: quoted (with "" for ") when it holds a comma, quote or newline
static void csv_write_field(FILE *f, const char *s) {
    if (!strpbrk(s, ",\"\n\r")) { fputs(s, f); return; }
    fputc('"', f);
    for (; *s; s++) { if (*s == '"') fputc('"', f); fputc(*s, f); }
    fputc('"', f);
}

// a classifier's row: path,pred[,pred_name],p0,...,p{K-1} with p = softmax(z), pred = argmax (lowest on ties)
static void csv_write_prediction(FILE *f, const char *path, const float *z, int K, char *const *names, int n_names) {
    int best = 0;
    double sum = 0;
    for (int k = 1; k < K; k++) if (z[k] > z[best]) best = k;
    for (int k = 0; k < K; k++) sum += exp((double)z[k] - z[best]);
    csv_write_field(f, path);
    fprintf(f, ",%d", best);
    if (n_names) {
        fputc(',', f);
        csv_write_field(f, best < n_names ? names[best] : "");
    }
    for (int k = 0; k < K; k++) fprintf(f, ",%.7g", exp((double)z[k] - z[best]) / sum);
    fputc('\n', f);
}

// ---- segmentation outputs: per image OUT/<stem>.png, the mask (8-bit grey,
// pixel = class index), and OUT/<stem>_overlay.png, the image blended 50/50
// with a colour per class; both at the image's own size.

// class k is drawn in SEG_PALETTE[k % SEG_COLOURS]: black for class 0 (background in
// most data sets, as in Pascal VOC's colour map), then 15 colours far apart
// (Trubetskoy's "20 simple, distinct colours"). OUT/legend.png shows them: a
// swatch and the class number per row. SEG_PALETTE_HELP says the same in
// words (predict --help, README).
#define SEG_COLOURS 16
static const uint8_t SEG_PALETTE[SEG_COLOURS][3] = {
    {0, 0, 0},       {230, 25, 75},   {60, 180, 75},  {255, 225, 25}, {0, 130, 200},  {245, 130, 48},
    {145, 30, 180},  {70, 240, 240},  {240, 50, 230}, {210, 245, 60}, {250, 190, 212}, {0, 128, 128},
    {220, 190, 255}, {170, 110, 40},  {128, 0, 0},    {0, 0, 128},
};
#define SEG_PALETTE_HELP \
    "  0 black, 1 red, 2 green, 3 yellow, 4 blue, 5 orange, 6 purple, 7 cyan,\n" \
    "  8 magenta, 9 lime, 10 pink, 11 teal, 12 lavender, 13 brown, 14 maroon,\n" \
    "  15 navy; class k ≥ 16 takes the colour of k mod 16\n"
#define SEG_LEGEND_NAME "legend.png"

// The legend: per class k a row of LEGEND_ROW pixels, a LEGEND_SWATCH-wide
// swatch of its colour, then k in black digits (a 3×5 pixel font drawn
// LEGEND_SCALE times larger) on white.
#define LEGEND_ROW 24
#define LEGEND_SWATCH 32
#define LEGEND_SCALE 3
#define LEGEND_TEXT_X (LEGEND_SWATCH + 12)
// digit d's 5 rows of 3 pixels, the leftmost pixel in bit 2
static const uint8_t DIGIT_3X5[10][5] = {
    {7, 5, 5, 5, 7}, {2, 6, 2, 2, 7}, {7, 1, 7, 4, 7}, {7, 1, 7, 1, 7}, {5, 5, 7, 1, 1},
    {7, 4, 7, 1, 7}, {7, 4, 7, 5, 7}, {7, 1, 1, 1, 1}, {7, 5, 7, 5, 7}, {7, 5, 7, 1, 7},
};
static void seg_legend_path(const char *out, char path[OUT_PATH_MAX]) {
    snprintf(path, OUT_PATH_MAX, "%.*s/%s", (int)(OUT_PATH_MAX - sizeof SEG_LEGEND_NAME - 1), out, SEG_LEGEND_NAME);
}
static int seg_legend_write(const char *out, int K, char err[SN_ERR_MAX]) {
    const int digit_w = 4 * LEGEND_SCALE;  // 3 pixels and a space
    const int w = LEGEND_TEXT_X + 3 * digit_w + 4, h = K * LEGEND_ROW;
    uint8_t *rgb = malloc((size_t)w * h * 3);
    snCheck(rgb != NULL, "out of host memory");
    memset(rgb, 255, (size_t)w * h * 3);
    for (int k = 0; k < K; k++) {
        const int y0 = k * LEGEND_ROW;
        for (int y = y0 + 3; y < y0 + LEGEND_ROW - 3; y++)
            for (int x = 4; x < LEGEND_SWATCH; x++) memcpy(rgb + 3 * ((size_t)y * w + x), SEG_PALETTE[k % SEG_COLOURS], 3);
        char num[12];  // K ≤ 256: 3 digits
        snprintf(num, sizeof num, "%d", k);
        const int top = y0 + (LEGEND_ROW - 5 * LEGEND_SCALE) / 2;
        for (int d = 0; num[d]; d++)
            for (int gy = 0; gy < 5 * LEGEND_SCALE; gy++)
                for (int gx = 0; gx < 3 * LEGEND_SCALE; gx++)
                    if (DIGIT_3X5[num[d] - '0'][gy / LEGEND_SCALE] >> (2 - gx / LEGEND_SCALE) & 1)
                        memset(rgb + 3 * ((size_t)(top + gy) * w + LEGEND_TEXT_X + d * digit_w + gx), 0, 3);
    }
    char path[OUT_PATH_MAX];
    seg_legend_path(out, path);
    const int rc = png_write_atomic(path, w, h, 3, rgb, err);
    free(rgb);
    return rc;
}

// the mask and overlay paths of an image: "x/a.b.jpg" → OUT/a.b.png, OUT/a.b_overlay.png
static void seg_out_paths(const char *out, const char *image, char mask[OUT_PATH_MAX], char overlay[OUT_PATH_MAX]) {
    const char *base = strrchr(image, '/');
    base = base ? base + 1 : image;
    const char *dot = strrchr(base, '.');
    int stem = dot && dot != base ? (int)(dot - base) : (int)strlen(base);
    snprintf(mask, OUT_PATH_MAX, "%s/%.*s.png", out, stem, base);
    snprintf(overlay, OUT_PATH_MAX, "%s/%.*s_overlay.png", out, stem, base);
}

typedef struct { char *name; int image; } SegName;
static int cmp_seg_name(const void *a, const void *b) { return strcmp(((const SegName *)a)->name, ((const SegName *)b)->name); }

// ---- outputs never replace what the user owns
//
// predict writes no path that is, or lies inside, its input folder, and never
// replaces an input image or list, whatever the path says (files compared by
// device and inode). Any other existing file it replaces only with
// --overwrite, and only one that it wrote itself: a mask, overlay or legend
// that OUT/.segnet-predict lists (the names it has written into OUT), a
// classifier CSV whose first line is its own header.

#define PREDICT_MANIFEST      ".segnet-predict"
#define PREDICT_MANIFEST_HEAD "segnet predict: the files it wrote in this folder, which --overwrite may replace\n"
#define PREDICT_CSV_HEAD      "path,pred"  // what a classifier's CSV starts with (predict_run writes it)

static int stat_same(const struct stat *a, const struct stat *b) { return a->st_dev == b->st_dev && a->st_ino == b->st_ino; }

// Whether path, or when it does not exist yet the folder it would be made in,
// is the folder dir or lies inside it. Walks up through "..", so that links,
// mounts and spellings of the path make no difference.
static int path_inside(const char *path, const struct stat *dir) {
    char at[OUT_PATH_MAX];
    snprintf(at, sizeof at, "%s", path);
    struct stat sb;
    for (;;) {  // the nearest part of the path that exists
        if (stat(at, &sb) == 0) break;
        char *slash = strrchr(at, '/');
        if (!slash) { snprintf(at, sizeof at, "."); break; }
        if (slash == at) slash++;  // "/"
        *slash = 0;
    }
    int fd = open(at, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 && errno == ENOTDIR) {  // an existing file: where it lies
        char dir[OUT_PATH_MAX];
        path_folder(at, dir);
        fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    }
    for (int depth = 0; fd >= 0 && depth < PATH_MAX; depth++) {
        struct stat here, up_sb;
        if (fstat(fd, &here) || stat_same(&here, dir)) break;
        const int up = openat(fd, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        close(fd);
        fd = up;
        if (fd < 0 || fstat(fd, &up_sb) || stat_same(&up_sb, &here)) break;  // "/" is its own parent
    }
    if (fd < 0) return 0;
    struct stat last;
    const int inside = fstat(fd, &last) == 0 && stat_same(&last, dir);
    close(fd);
    return inside;
}

// The files a prediction reads, by identity: image i, or the list (-1)
typedef struct { dev_t dev; ino_t ino; int input; } FileId;
static int cmp_file_id(const void *a, const void *b) {
    const FileId *x = a, *y = b;
    if (x->dev != y->dev) return x->dev < y->dev ? -1 : 1;
    return x->ino < y->ino ? -1 : x->ino > y->ino;
}
static FileId *input_ids(const PredictCfg *pc, const PathList *l, int *n) {
    FileId *ids = malloc(sizeof(FileId) * ((size_t)l->n + 1));
    snCheck(ids != NULL, "out of host memory");
    struct stat sb;
    *n = 0;
    for (int i = -1; i < l->n; i++)
        if (stat(i < 0 ? pc->input : l->paths[i], &sb) == 0 && S_ISREG(sb.st_mode))
            ids[(*n)++] = (FileId){sb.st_dev, sb.st_ino, i};
    qsort(ids, (size_t)*n, sizeof(FileId), cmp_file_id);
    return ids;
}
// the input that `path` is ("input image X", "input list X"), or NULL
static const char *input_named(const PredictCfg *pc, const PathList *l, const FileId *ids, int n, const char *path,
                               char what[OUT_PATH_MAX]) {
    struct stat sb;
    if (stat(path, &sb) != 0) return NULL;
    const FileId key = {sb.st_dev, sb.st_ino, 0}, *hit = bsearch(&key, ids, (size_t)n, sizeof(FileId), cmp_file_id);
    if (!hit) return NULL;
    snprintf(what, OUT_PATH_MAX, "%s %.400s", hit->input < 0 ? "the input list" : "the input image",
             hit->input < 0 ? pc->input : l->paths[hit->input]);
    return what;
}

// The names OUT's manifest lists, sorted (NULL, 0 when there is none); -1 with err if it is not one.
static int manifest_read(const char *out, char **buf, char ***names, int *n, char err[SN_ERR_MAX]) {
    char path[OUT_PATH_MAX];
    snprintf(path, sizeof path, "%s/" PREDICT_MANIFEST, out);
    const size_t head = strlen(PREDICT_MANIFEST_HEAD);
    size_t bytes = 0;
    *buf = NULL; *names = NULL; *n = 0;
    struct stat sb;
    if (lstat(path, &sb) != 0 && errno == ENOENT) return 0;
    char *b = (char *)file_read_regular(path, (size_t)1 << 30, &bytes, err);
    if (!b) return -1;
    if (bytes < head || memcmp(b, PREDICT_MANIFEST_HEAD, head) || (bytes > head && b[bytes - 1])) {
        snprintf(err, SN_ERR_MAX, "%.300s: not segnet predict's list of the files it wrote (it names nothing for "
                 "--overwrite; remove it or choose another --out)", path);
        free(b);
        return -1;
    }
    int cap = 0;
    for (size_t i = head; i < bytes; i += strlen(b + i) + 1) {
        GROW(*names, *n, cap);
        (*names)[(*n)++] = b + i;
    }
    sort_n(*names, (size_t)*n, sizeof(char *), cmp_str);
    *buf = b;
    return 0;
}

// OUT's manifest: the names it listed and `add` (m of them), each once.
static int manifest_write(const char *out, char **listed, int n, const SegName *add, int m, char err[SN_ERR_MAX]) {
    const char **all = malloc(sizeof(char *) * ((size_t)n + m + 1));
    snCheck(all != NULL, "out of host memory");
    int k = 0;
    for (int i = 0; i < n; i++) all[k++] = listed[i];
    for (int i = 0; i < m; i++) all[k++] = path_base(add[i].name);
    qsort(all, (size_t)k, sizeof(char *), cmp_str);
    SfBuf b = {0};
    sb_str(&b, PREDICT_MANIFEST_HEAD);
    for (int i = 0; i < k; i++)
        if (i == 0 || strcmp(all[i - 1], all[i])) sb_put(&b, all[i], strlen(all[i]) + 1);
    free(all);
    snCheck(!b.oom, "out of host memory");
    char path[OUT_PATH_MAX];
    snprintf(path, sizeof path, "%s/" PREDICT_MANIFEST, out);
    const void *parts[1] = {b.p};
    const int rc = file_write_atomic(path, parts, &b.n, 1, err);
    free(b.p);
    return rc;
}

// Whether the file at path starts with a classifier CSV's header (segnet predict wrote it).
static int is_prediction_csv(const char *path) {
    struct stat sb;
    const char *why;
    const int fd = open_regular(path, &sb, &why);
    if (fd < 0) return 0;
    char head[sizeof PREDICT_CSV_HEAD] = "";
    const ssize_t got = read(fd, head, sizeof head - 1);
    close(fd);
    return got == (ssize_t)sizeof head - 1 && !memcmp(head, PREDICT_CSV_HEAD, sizeof head - 1);
}

// Refuses an output that predict may not write (see above): out inside the
// input folder, or any of `outs` (m paths) that exists and is an input, a
// folder, or not predict's own: in the manifest (seg: its names, sorted, in
// listed), else a classifier's CSV recognised by its header.
static int outputs_allowed(const PredictCfg *pc, const PathList *l, const SegName *outs, int m, int seg, char **listed,
                           int n_listed, char err[SN_ERR_MAX]) {
    struct stat in_sb;
    if (stat(pc->input, &in_sb) == 0 && S_ISDIR(in_sb.st_mode) && path_inside(pc->out, &in_sb)) {
        snprintf(err, SN_ERR_MAX, "--out %.180s is, or is inside, the input folder %.180s: predictions never go among "
                 "the images they are made from", pc->out, pc->input);
        return -1;
    }
    int n_ids, rc = 0;
    FileId *ids = input_ids(pc, l, &n_ids);
    for (int i = 0; i < m && rc == 0; i++) {
        const char *p = outs[i].name, *input;
        char what[OUT_PATH_MAX];
        struct stat sb;
        if (lstat(p, &sb) != 0) continue;  // a new file
        const char *base = path_base(p);
        rc = -1;
        if (S_ISDIR(sb.st_mode))
            snprintf(err, SN_ERR_MAX, "%.400s: is a folder, where segnet predict would write a file", p);
        else if ((input = input_named(pc, l, ids, n_ids, p, what)))
            snprintf(err, SN_ERR_MAX, "%.200s: segnet predict would replace %.250s", p, input);
        else if (!pc->overwrite)
            snprintf(err, SN_ERR_MAX, "%.300s: exists; segnet predict replaces a file only with --overwrite, and only "
                     "one it wrote itself (an earlier prediction)", p);
        else if (seg ? !n_listed || !bsearch(&base, listed, (size_t)n_listed, sizeof(char *), cmp_str) : !is_prediction_csv(p))
            snprintf(err, SN_ERR_MAX, "%.300s: exists and is not an output of segnet predict (%s): --overwrite does not "
                     "replace it", p, seg ? "not listed in " PREDICT_MANIFEST : "its first line is not " PREDICT_CSV_HEAD "...");
        else
            rc = 0;
    }
    free(ids);
    return rc;
}

// Before anything is written: no two images would write the same file (a.png
// and a.jpg, or a_overlay.png beside a.png), every name fits the file system,
// no output replaces what it may not (outputs_allowed) and every image decodes;
// then the folder `out` is created if absent and its manifest lists the files
// about to be written. Decoding twice costs far less than the forward pass,
// and a bad image found halfway would leave a partial folder.
static int seg_check_inputs(const PredictCfg *pc, const PathList *l, char err[SN_ERR_MAX]) {
    const char *out = pc->out;
    const int n = 2 * l->n + 1;  // the masks, the overlays and the legend (image -1)
    SegName *names = malloc(sizeof(SegName) * n);
    snCheck(names != NULL, "out of host memory");
    for (int i = 0; i < l->n; i++) {
        char m[OUT_PATH_MAX], o[OUT_PATH_MAX];
        seg_out_paths(out, l->paths[i], m, o);
        names[2 * i] = (SegName){strdup(m), i};
        names[2 * i + 1] = (SegName){strdup(o), i};
        snCheck(names[2 * i].name && names[2 * i + 1].name, "out of host memory");
    }
    char legend[OUT_PATH_MAX];
    seg_legend_path(out, legend);
    names[n - 1] = (SegName){strdup(legend), -1};
    snCheck(names[n - 1].name != NULL, "out of host memory");
    qsort(names, (size_t)n, sizeof(SegName), cmp_seg_name);
    int rc = 0;
    for (int i = 1; i < n && !rc; i++)
        if (!strcmp(names[i - 1].name, names[i].name)) {
            const SegName *a = &names[i - 1], *b = &names[i];
            if (a->image < 0 || b->image < 0)
                snprintf(err, SN_ERR_MAX, "%.200s would overwrite the colour legend %.170s (rename it)",
                         l->paths[a->image < 0 ? b->image : a->image], names[i].name);
            else
                snprintf(err, SN_ERR_MAX, "%.150s and %.150s would both write %.170s (rename one)", l->paths[a->image],
                         l->paths[b->image], names[i].name);
            rc = -1;
        }
    for (int i = 0; i < n && !rc; i++) rc = out_path_check(names[i].name, err);
    char *manifest = NULL, **listed = NULL;
    int n_listed = 0;
    if (!rc) rc = manifest_read(out, &manifest, &listed, &n_listed, err);
    if (!rc) rc = outputs_allowed(pc, l, names, n, 1, listed, n_listed, err);
    for (int i = 0; !rc && i < l->n; i++) {
        int h, w;
        float *img = image_load_rgb(l->paths[i], &h, &w, err);
        if (!img) rc = -1;
        free(img);
    }
    if (!rc && mkdir(out, 0777) != 0 && errno != EEXIST) {
        snprintf(err, SN_ERR_MAX, "%.400s: cannot create the folder: %s", out, strerror(errno));
        rc = -1;
    }
    if (!rc) rc = manifest_write(out, listed, n_listed, names, n, err);
    for (int i = 0; i < n; i++) free(names[i].name);
    free(names); free(listed); free(manifest);
    return rc;
}

// The mask and overlay of one image img (h,w,3) from its logits z (oh,ow,K):
// class = argmax_k z (the lowest k on ties) at the model's resolution, brought
// to h×w by nearest neighbour with half-pixel centres, src = floor((dst + ½)·in/out);
// overlay = (image + colour + 1) / 2 per channel (the 50/50 blend, rounded half up).
static int seg_write(const char *out, const char *image, const float *img, int h, int w,
                     const float *z, int oh, int ow, int K, char err[SN_ERR_MAX]) {
    uint8_t *cls = malloc((size_t)oh * ow), *mask = malloc((size_t)h * w), *rgb = malloc((size_t)h * w * 3);
    snCheck(cls && mask && rgb, "out of host memory");
    for (size_t p = 0; p < (size_t)oh * ow; p++) {
        const float *zp = z + p * K;
        int best = 0;
        for (int k = 1; k < K; k++) if (zp[k] > zp[best]) best = k;
        cls[p] = (uint8_t)best;
    }
    for (int y = 0; y < h; y++) {
        int sy = (int)(((int64_t)2 * y + 1) * oh / (2 * (int64_t)h));
        for (int x = 0; x < w; x++) {
            int sx = (int)(((int64_t)2 * x + 1) * ow / (2 * (int64_t)w));
            size_t i = (size_t)y * w + x;
            mask[i] = cls[(size_t)sy * ow + sx];
            for (int c = 0; c < 3; c++) rgb[3 * i + c] = (uint8_t)(((int)img[3 * i + c] + SEG_PALETTE[mask[i] % SEG_COLOURS][c] + 1) / 2);
        }
    }
    char m[OUT_PATH_MAX], o[OUT_PATH_MAX];
    seg_out_paths(out, image, m, o);
    int rc = png_write_atomic(m, w, h, 1, mask, err) || png_write_atomic(o, w, h, 3, rgb, err) ? -1 : 0;
    free(cls); free(mask); free(rgb);
    return rc;
}

// Predicts every listed image. Images of the model's size are used as they
// are, others resized (bilinear, half-pixel centres) for the forward pass.
// A classifier (1×1 output) writes one CSV row `path,pred,p0,...,p{K-1}` per
// image (softmax probabilities) to a temporary file, renamed over `out` only
// when every image has been read. A segmentation model writes a mask and an
// overlay per image into the folder `out`, after checking every input.
int predict_run(const PredictCfg *pc, char err[SN_ERR_MAX]) {
    if (input_size_checked(&pc->model, err)) return -1;
    Graph g;
    graph_init(&g);
    int out = model_build(&g, &pc->model);
    if (out < 0) { snprintf(err, SN_ERR_MAX, "%s", g.err); graph_free(&g); return -1; }
    const Shape so = g.tensors[out].shape, si = g.tensors[g.input].shape;
    const int seg = so.h > 1 || so.w > 1, K = so.c, N = si.n;
    if (seg && K > 256) {
        snprintf(err, SN_ERR_MAX, "model '%s': %d classes do not fit the 8-bit mask PNGs (at most 256)", pc->model.model, K);
        graph_free(&g);
        return -1;
    }
    struct stat sb;
    if (seg && stat(pc->out, &sb) == 0 && !S_ISDIR(sb.st_mode)) {
        snprintf(err, SN_ERR_MAX, "%.300s: exists and is not a folder (for segmentation model '%.60s', --out is the "
                 "folder that receives the masks and overlays)", pc->out, pc->model.model);
        graph_free(&g);
        return -1;
    }
    Net net;
    SafetensorsFile wf;
    PathList list;
    int rc = -1;
    Ops *o = ops_for_device(pc->device, 0, err);
    if (!o || net_create(&net, &g, o, DT_F32, 0, err) != 0) { graph_free(&g); return -1; }
    if (safetensors_read(pc->weights, &wf, err) != 0) goto done_net;
    if (net_load_weights(&net, &wf, pc->weights, NULL, 0, err) != 0) goto done_weights;
    if (list_images(pc->input, &list, err) != 0) goto done_weights;

    char tmp[OUT_PATH_MAX];
    FILE *f = NULL;
    if (seg) {
        if (seg_check_inputs(pc, &list, err) != 0 || seg_legend_write(pc->out, K, err) != 0) goto done_list;
    } else {
        const SegName csv = {(char *)pc->out, -1};
        if (outputs_allowed(pc, &list, &csv, 1, 0, NULL, 0, err) || !(f = atomic_file_open(pc->out, tmp, err)))
            goto done_list;
        fprintf(f, PREDICT_CSV_HEAD "%s", pc->n_class_names ? ",pred_name" : "");
        for (int k = 0; k < K; k++) fprintf(f, ",p%d", k);
        fputc('\n', f);
    }
    const size_t img_floats = (size_t)si.h * si.w * 3, out_floats = (size_t)so.h * so.w * K;
    float *x = malloc(sizeof(float) * N * img_floats);           // (N,H,W,3) on the host, uploaded per batch
    float *logits = malloc(sizeof(float) * N * out_floats);      // (N,OH,OW,K)
    float **imgs = calloc((size_t)N, sizeof(float *));           // N × (h,w,3)
    int *hw = malloc(sizeof(int) * 2 * N);
    snCheck(x && logits && imgs && hw, "out of host memory");
    int ok = 1, reported = 0;  // images the last progress line counted
    const int tty = isatty(STDERR_FILENO);
    for (int start = 0; ok && start < list.n; start += N) {
        int count = list.n - start < N ? list.n - start : N;
        memset(x, 0, sizeof(float) * img_floats * N);  // slots past the last image stay empty
        for (int j = 0; ok && j < count; j++) {
            int h, w;
            float *img = imgs[j] = image_load_rgb(list.paths[start + j], &h, &w, err);
            if (!img) { ok = 0; break; }
            hw[2 * j] = h; hw[2 * j + 1] = w;
            Tensor dst = tensor_f32(x + img_floats * j, shape4(1, si.h, si.w, 3));
            if (h == si.h && w == si.w) memcpy(dst.data, img, sizeof(float) * img_floats);
            else ops_cpu.resize_bilinear_forward(&ops_cpu, dst, tensor_f32(img, shape4(1, h, w, 3)));
        }
        if (ok) {
            o->upload(o, net.act[g.input], x, sizeof(float) * N * img_floats);
            net_forward(&net, 0);
            o->download(o, logits, net.act[out], sizeof(float) * N * out_floats);
        }
        for (int j = 0; ok && j < count; j++) {
            const char *path = list.paths[start + j];
            if (!seg) csv_write_prediction(f, path, logits + (size_t)j * K, K, pc->class_names, pc->n_class_names);
            else ok = seg_write(pc->out, path, imgs[j], hw[2 * j], hw[2 * j + 1], logits + out_floats * j,
                                so.h, so.w, K, err) == 0;
        }
        for (int j = 0; j < count; j++) { free(imgs[j]); imgs[j] = NULL; }
        // a terminal: one line rewritten; a log: a line per tenth of the images and the last
        const int done = start + count;
        if (pc->progress && tty) fprintf(stderr, "\rpredict: %d/%d images", done, list.n);
        else if (pc->progress && (done == list.n || (int64_t)(done - reported) * 10 >= list.n)) {
            fprintf(stderr, "predict: %d/%d images\n", done, list.n);
            reported = done;
        }
    }
    if (pc->progress && tty) fputc('\n', stderr);
    free(x); free(logits); free(imgs); free(hw);
    rc = f ? atomic_file_commit(f, tmp, pc->out, ok, err) : ok ? 0 : -1;
done_list:
    path_list_free(&list);
done_weights:
    safetensors_free(&wf);
done_net:
    net_free(&net);
    graph_free(&g);
    return rc;
}

// ----------------------------------------------------------------------------
// data sets: listing, decoding, resizing, augmentation, batching, prefetch
//
// dataset_open lists the samples, then decodes every one of them on `threads`
// threads: that is the validation, and it fills the cache when the resized
// samples fit. sample_load is the one place that decodes, checks and resizes a
// sample, so dataset_batch, which decodes again when nothing is cached, refuses
// a file that changed on disk with the same message. Threads are pthreads (the
// loader needs long-lived ones anyway); each runs OpenMP regions on one thread.

static int omp_serial_begin(void) {
#ifdef _OPENMP
    int n = omp_get_max_threads();
    omp_set_num_threads(1);  // a decoding thread is one core's work; no nested teams
    return n;
#else
    return 1;
#endif
}
static void omp_serial_end(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

// a path's file name without its extension, as pointer and length: "d/a.b.png" -> "a.b"
static const char *path_stem(const char *path, int *len) {
    const char *s = strrchr(path, '/'), *dot;
    s = s ? s + 1 : path;
    dot = strrchr(s, '.');
    *len = dot ? (int)(dot - s) : (int)strlen(s);
    return s;
}
static int cmp_stems(const char *a, const char *b) {
    int la, lb;
    const char *sa = path_stem(a, &la), *sb = path_stem(b, &lb);
    int c = memcmp(sa, sb, (size_t)(la < lb ? la : lb));
    return c ? c : la - lb;
}
// by stem, then by path: images and masks pair in one merge, duplicates are adjacent
static int cmp_by_stem(const void *a, const void *b) {
    int c = cmp_stems(*(char *const *)a, *(char *const *)b);
    return c ? c : cmp_str(a, b);
}

// A folder's images, sorted; an empty folder is no error here (callers say
// what is missing). Anything but a readable folder is one.
static int list_folder(const char *dir, PathList *out, char err[SN_ERR_MAX]) {
    struct stat sb;
    memset(out, 0, sizeof *out);
    if (stat(dir, &sb) != 0) { snprintf(err, SN_ERR_MAX, "%s: %s", dir, strerror(errno)); return -1; }
    if (!S_ISDIR(sb.st_mode)) { snprintf(err, SN_ERR_MAX, "%s: not a folder", dir); return -1; }
    if (list_images(dir, out, err) == 0) return 0;
    return out->n == 0 && access(dir, R_OK | X_OK) == 0 ? 0 : -1;  // list_images refuses an empty list
}

// DIR/images/<stem>.{png,jpg,jpeg} paired with DIR/masks/<stem>.png by one merge
// of the two lists sorted by stem; the first problem in that order is reported.
static int list_segmentation(Dataset *d, const char *dir, char err[SN_ERR_MAX]) {
    char sub[2][4096];
    PathList im = {0}, mk = {0};
    snprintf(sub[0], sizeof sub[0], "%s/images", dir);
    snprintf(sub[1], sizeof sub[1], "%s/masks", dir);
    for (int k = 0; k < 2; k++) {
        struct stat sb;
        if (stat(sub[k], &sb) != 0 || !S_ISDIR(sb.st_mode)) {
            snprintf(err, SN_ERR_MAX, "%.300s: no such folder (segmentation data is %s/images/*.{png,jpg,jpeg} and %s/masks/*.png)",
                     sub[k], dir, dir);
            return -1;
        }
    }
    if (list_folder(sub[0], &im, err) || list_folder(sub[1], &mk, err)) goto fail;
    if (im.n == 0) { snprintf(err, SN_ERR_MAX, "%.300s: no images (*.png, *.jpg, *.jpeg)", sub[0]); goto fail; }
    sort_n(im.paths, (size_t)im.n, sizeof(char *), cmp_by_stem);
    sort_n(mk.paths, (size_t)mk.n, sizeof(char *), cmp_by_stem);
    for (int k = 0; k < mk.n; k++) {
        const char *dot = strrchr(mk.paths[k], '.');
        if (strcasecmp(dot, ".png")) {  // listed, so it has an image extension
            snprintf(err, SN_ERR_MAX, "%s: a mask must be a PNG (JPEG compression changes class indices)", mk.paths[k]);
            goto fail;
        }
    }
    const PathList *lists[2] = {&im, &mk};
    for (int k = 0; k < 2; k++)
        for (int i = 1; i < lists[k]->n; i++)
            if (cmp_stems(lists[k]->paths[i - 1], lists[k]->paths[i]) == 0) {
                snprintf(err, SN_ERR_MAX, "%s: same name as %s (masks pair with images by name)", lists[k]->paths[i],
                         lists[k]->paths[i - 1]);
                goto fail;
            }
    for (int i = 0; i < im.n || i < mk.n; i++) {
        int c = i == im.n ? 1 : i == mk.n ? -1 : cmp_stems(im.paths[i], mk.paths[i]), len;
        if (c < 0) {
            const char *s = path_stem(im.paths[i], &len);
            snprintf(err, SN_ERR_MAX, "%s: no mask (expected %.300s/%.*s.png)", im.paths[i], sub[1], len, s);
            goto fail;
        }
        if (c > 0) {
            const char *s = path_stem(mk.paths[i], &len);
            snprintf(err, SN_ERR_MAX, "%s: no image (expected %.300s/%.*s.png, .jpg or .jpeg)", mk.paths[i], sub[0], len, s);
            goto fail;
        }
    }
    d->n = im.n;
    d->images = im.paths;
    d->masks = mk.paths;
    return 0;
fail:
    path_list_free(&im);
    path_list_free(&mk);
    return -1;
}

static void add_sample(Dataset *d, PathList *l, int *cap, const char *path, int label) {
    path_list_add(l, NULL, path);
    if (l->cap != *cap) {  // labels grow with the paths
        *cap = l->cap;
        d->labels = realloc(d->labels, sizeof(int32_t) * (size_t)*cap);
        snCheck(d->labels != NULL, "out of host memory");
    }
    d->labels[l->n - 1] = label;
}

// class names: d->names takes `names` (n of them, sorted, owned by d)
static void set_names(Dataset *d, char **names, int n) { d->names = names; d->n_names = n; }
// the index of `name` among names_from's, or -1 (a message naming the known ones in err)
static int name_index(const Dataset *from, const char *name, const char *where, char err[SN_ERR_MAX]) {
    for (int k = 0; k < from->n_names; k++) if (!strcmp(from->names[k], name)) return k;
    int n = snprintf(err, SN_ERR_MAX, "%.400s: class '%.100s' is not one of the training set's (", where, name);
    for (int k = 0; k < from->n_names && n < SN_ERR_MAX - 8; k++)
        n += snprintf(err + n, SN_ERR_MAX - n, "%s%.60s", k ? ", " : "", from->names[k]);
    if (n < SN_ERR_MAX) snprintf(err + n, SN_ERR_MAX - n, ")");
    return -1;
}
// copies of names (n)
static char **names_copy(char *const *names, int n) {
    char **c = malloc(sizeof(char *) * (size_t)(n ? n : 1));
    snCheck(c != NULL, "out of host memory");
    for (int k = 0; k < n; k++) { c[k] = strdup(names[k]); snCheck(c[k] != NULL, "out of host memory"); }
    return c;
}

// DIR/<class>/*: sub-folders sorted by name are classes 0, 1, ... (or the
// classes of names_from with those names)
static int list_class_folders(Dataset *d, const char *dir, const Dataset *names_from, char err[SN_ERR_MAX]) {
    PathList classes = {0}, all = {0};
    char **names = NULL;  // the folders' names (sorted)
    int cap = 0, rc = -1;
    DIR *dp = opendir(dir);
    if (!dp) { snprintf(err, SN_ERR_MAX, "%s: %s", dir, strerror(errno)); return -1; }
    for (struct dirent *e; (e = readdir(dp));) {
        if (e->d_name[0] == '.') continue;
        path_list_add(&classes, dir, e->d_name);
        struct stat sb;
        if (stat(classes.paths[classes.n - 1], &sb) != 0 || !S_ISDIR(sb.st_mode)) free(classes.paths[--classes.n]);
    }
    closedir(dp);
    sort_n(classes.paths, (size_t)classes.n, sizeof(char *), cmp_str);
    if (classes.n > d->classes) {
        snprintf(err, SN_ERR_MAX, "%s: %d class folders, but there are %d classes", dir, classes.n, d->classes);
        goto done;
    }
    names = malloc(sizeof(char *) * (size_t)(classes.n ? classes.n : 1));
    snCheck(names != NULL, "out of host memory");
    for (int c = 0; c < classes.n; c++) {
        const char *slash = strrchr(classes.paths[c], '/');
        names[c] = strdup(slash ? slash + 1 : classes.paths[c]);
        snCheck(names[c] != NULL, "out of host memory");
    }
    if (names_from && names_from->names) set_names(d, names_copy(names_from->names, names_from->n_names), names_from->n_names);
    else set_names(d, names, classes.n);
    for (int c = 0; c < classes.n; c++) {
        const int label = names_from && names_from->names ? name_index(names_from, names[c], classes.paths[c], err) : c;
        if (label < 0) goto done;
        PathList l;
        if (list_folder(classes.paths[c], &l, err)) goto done;
        for (int k = 0; k < l.n; k++) add_sample(d, &all, &cap, l.paths[k], label);
        path_list_free(&l);
    }
    if (all.n == 0) {
        snprintf(err, SN_ERR_MAX, "%s: no images (expected %s/<class>/*.{png,jpg,jpeg}, one sub-folder per class)", dir, dir);
        goto done;
    }
    d->n = all.n;
    d->images = all.paths;
    rc = 0;
done:
    if (rc) path_list_free(&all);
    if (names && d->names != names) {
        for (int c = 0; c < classes.n; c++) free(names[c]);
        free(names);
    }
    path_list_free(&classes);
    return rc;
}

// a CSV `path,label` (an optional header whose first field is "path"); every
// listed file must exist, every label be an integer 0..K-1, or every label a
// class name (the sorted distinct names are classes 0, 1, ..., or names_from's)
static int list_csv(Dataset *d, const char *csv, const Dataset *names_from, char err[SN_ERR_MAX]) {
    FILE *f = fopen_regular(csv, "r", err);
    if (!f) return -1;
    char dir[4096], line[8192], path[4096], label[64];
    snprintf(dir, sizeof dir, "%s", csv);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0; else snprintf(dir, sizeof dir, ".");
    PathList all = {0}, texts = {0};  // texts: each sample's label as written, while they are names
    int cap = 0, rc = 0, numeric = -1;   // numeric: -1 no label yet, 1 integers, 0 names
    int first_row[2] = {0, 0};            // the first row with an integer label, with a name
    for (int row = 1; rc == 0 && fgets(line, sizeof line, f); row++) {
        const char *s = csv_skip_bom(line, row), *why;
        struct stat sb;
        int more = 0;
        if (!strchr(line, '\n') && !feof(f)) {
            snprintf(err, SN_ERR_MAX, "%s: row %d: longer than %zu characters", csv, row, sizeof line - 1);
            rc = -1;
        } else if (!s[strspn(s, CSV_BLANKS "\r\n")]) {
            continue;
        } else if ((why = csv_field(&s, path, sizeof path, &more)) || (why = csv_field(&s, label, sizeof label, &more))) {
            snprintf(err, SN_ERR_MAX, "%s: row %d: %s", csv, row, why);
            rc = -1;
        } else if (more) {
            snprintf(err, SN_ERR_MAX, "%s: row %d: more than two fields (rows are path,label)", csv, row);
            rc = -1;
        } else if (row == 1 && !strcmp(path, "path")) {
            continue;  // header
        } else if (!path[0]) {
            snprintf(err, SN_ERR_MAX, "%s: row %d: empty path", csv, row);
            rc = -1;
        } else {
            char *end;
            errno = 0;
            long v = strtol(label, &end, 10);
            end += strspn(end, " \t");
            char full[8200];
            snprintf(full, sizeof full, "%s%s%s", path[0] == '/' ? "" : dir, path[0] == '/' ? "" : "/", path);
            const int is_int = label[0] && !*end && errno != ERANGE;
            if (label[0] && !first_row[is_int]) first_row[is_int] = row;
            if (!label[0]) {
                snprintf(err, SN_ERR_MAX, "%s: row %d: no label (rows are path,label)", csv, row);
                rc = -1;
            } else if (numeric >= 0 && numeric != is_int) {
                snprintf(err, SN_ERR_MAX, "%s: row %d: label '%s' is %s, but row %d's is %s (labels are all integers "
                         "0..K-1 or all class names)", csv, row, label, is_int ? "an integer" : "a name",
                         first_row[!is_int], is_int ? "a name" : "an integer");
                rc = -1;
            } else if (!is_int) {  // a class name: its index once every name is known
                numeric = 0;
                if (stat(full, &sb) != 0) {
                    snprintf(err, SN_ERR_MAX, "%s: row %d: %.400s: %s", csv, row, full, strerror(errno));
                    rc = -1;
                } else {
                    add_sample(d, &all, &cap, full, -1);
                    path_list_add(&texts, NULL, label);
                }
            } else if ((numeric = 1) && (v < 0 || v >= d->classes)) {
                snprintf(err, SN_ERR_MAX, "%s: row %d: label '%s' is out of range (there are %d classes: 0..%d)", csv, row,
                         label, d->classes, d->classes - 1);
                rc = -1;
            } else if (stat(full, &sb) != 0) {
                snprintf(err, SN_ERR_MAX, "%s: row %d: %.400s: %s", csv, row, full, strerror(errno));
                rc = -1;
            } else {
                add_sample(d, &all, &cap, full, (int)v);
            }
        }
    }
    fclose(f);
    if (rc == 0 && all.n == 0) { snprintf(err, SN_ERR_MAX, "%s: no images listed", csv); rc = -1; }
    if (rc == 0 && numeric == 0) {  // name the classes, then number the samples
        if (names_from && names_from->names) {
            set_names(d, names_copy(names_from->names, names_from->n_names), names_from->n_names);
        } else {
            char **sorted = names_copy(texts.paths, texts.n);
            sort_n(sorted, (size_t)texts.n, sizeof(char *), cmp_str);
            int n = 0;
            for (int i = 0; i < texts.n; i++) {
                if (n && !strcmp(sorted[n - 1], sorted[i])) { free(sorted[i]); continue; }
                sorted[n++] = sorted[i];
            }
            set_names(d, sorted, n);
            if (n > d->classes) {
                snprintf(err, SN_ERR_MAX, "%s: %d class names (%s, %s, ...), but there are %d classes", csv, n, sorted[0],
                         sorted[1], d->classes);
                rc = -1;
            }
        }
        for (int i = 0; rc == 0 && i < texts.n; i++) {
            const int k = name_index(d, texts.paths[i], csv, err);
            if (k < 0) rc = -1;
            else d->labels[i] = k;
        }
    }
    path_list_free(&texts);
    if (rc) { path_list_free(&all); return -1; }
    d->n = all.n;
    d->images = all.paths;
    return 0;
}

// A mask's class indices (h,w): the stored values of a PNG's pixels. Grey of
// 1 to 16 bits, grey + alpha (alpha ignored), or RGB(A) whose every pixel has
// R = G = B (grey stored as colour); a pixel of differing R, G, B is refused
// (a colour-coded mask has no class indices), as is a palette PNG (stb_image
// gives its colours, not the indices). Its size must be the image's (ih,iw),
// whose EXIF orientation a mismatch mentions, and every value below K.
static uint8_t *mask_load(const char *path, int ih, int iw, int image_orientation, int K, char err[SN_ERR_MAX]) {
    size_t n;
    int h, w, comp, hh, ww;
    uint8_t *b = image_file_bytes(path, 1, &n, &hh, &ww, err);
    if (!b) return NULL;
    // IHDR, the PNG's first chunk: bit depth at byte 24, colour type at 25
    const int ihdr = n >= 26 && !memcmp(b + 12, "IHDR", 4);
    const int depth = ihdr ? b[24] : 8, colour = ihdr ? b[25] : 0;
    if (colour == 3) {
        free(b);
        snprintf(err, SN_ERR_MAX, "%s: a palette PNG (stb_image gives its colours, not the class indices): "
                 "save masks as 8-bit grey", path);
        return NULL;
    }
    // stb_image scales 1-, 2- and 4-bit grey to 8 bits, v·255/(2^depth − 1): divided back, exactly
    const int grey_scale = colour == 0 && (depth == 1 || depth == 2 || depth == 4) ? 255 / ((1 << depth) - 1) : 1;
    const int deep = depth == 16;
    // req_comp 0: the file's channels, comp of them (with tRNS's alpha counted)
    void *px = deep ? (void *)stbi_load_16_from_memory(b, (int)n, &w, &h, &comp, 0) : (void *)stbi_load_from_memory(b, (int)n, &w, &h, &comp, 0);
    free(b);
    if (!px || w != ww || h != hh) {
        snprintf(err, SN_ERR_MAX, "%s: cannot decode the image (%s)", path, px ? "its size changed while decoding" : decoder_reason());
        stbi_image_free(px);
        return NULL;
    }
    uint8_t *m = NULL;
    if (w != iw || h != ih) {
        char note[SN_ERR_MAX];
        snprintf(err, SN_ERR_MAX, "%s: mask is %dx%d but its image is %dx%d%s", path, w, h, iw, ih,
                 exif_size_note(note, sizeof note, image_orientation));
    } else {
        m = malloc((size_t)h * w);
        snCheck(m != NULL, "out of host memory");
        for (size_t p = 0; p < (size_t)h * w; p++) {
            int v[3];
            for (int c = 0; c < 3; c++) {
                const size_t i = p * comp + (comp >= 3 ? c : 0);
                v[c] = deep ? ((const uint16_t *)px)[i] : ((const uint8_t *)px)[i];
            }
            if (v[1] != v[0] || v[2] != v[0]) {
                snprintf(err, SN_ERR_MAX, "%s: pixel (%d,%d) has the colour (%d,%d,%d), not a class index: save masks as "
                         "8-bit grey, pixel value = class index", path, (int)(p % w), (int)(p / w), v[0], v[1], v[2]);
            } else if (v[0] / grey_scale >= K) {
                snprintf(err, SN_ERR_MAX, "%s: pixel (%d,%d) has class %d, but there are %d classes (0..%d)", path,
                         (int)(p % w), (int)(p / w), v[0] / grey_scale, K, K - 1);
            } else {
                m[p] = (uint8_t)(v[0] / grey_scale);
                continue;
            }
            free(m);
            m = NULL;
            break;
        }
    }
    stbi_image_free(px);
    return m;
}

// (H,W,3) bytes from an (h,w,3) image: bilinear with half-pixel centres (the
// model's resize op), rounded to nearest and clamped to 0..255
static void image_to_bytes(uint8_t *dst, int H, int W, float *src, int h, int w) {
    float *y = src;
    if (h != H || w != W) {
        y = malloc(sizeof(float) * 3 * H * W);
        snCheck(y != NULL, "out of host memory");
        ops_cpu.resize_bilinear_forward(&ops_cpu, tensor_f32(y, shape4(1, H, W, 3)), tensor_f32(src, shape4(1, h, w, 3)));
    }
    for (size_t i = 0; i < (size_t)3 * H * W; i++) {
        long v = lrintf(y[i]);
        dst[i] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
    }
    if (y != src) free(y);
}

// (H,W) from (h,w), nearest neighbour with half-pixel centres, exact in integers:
//   dst[oy,ox] = src[⌊(oy + ½)·h/H⌋, ⌊(ox + ½)·w/W⌋]
static void mask_resize(uint8_t *dst, int H, int W, const uint8_t *src, int h, int w) {
    for (int oy = 0; oy < H; oy++) {
        int sy = (int)((2 * (int64_t)oy + 1) * h / (2 * (int64_t)H));
        for (int ox = 0; ox < W; ox++)
            dst[(size_t)oy * W + ox] = src[(size_t)sy * w + (2 * (int64_t)ox + 1) * w / (2 * (int64_t)W)];
    }
}

// Where sample i's bytes are: the cache, else scratch (H,W,3) + (H,W) to decode into.
static void sample_bytes(const Dataset *d, int i, uint8_t *scratch, uint8_t **rgb, uint8_t **mask) {
    const size_t P = (size_t)d->height * d->width;
    *rgb = d->image_cache ? d->image_cache + 3 * P * i : scratch;
    *mask = d->mask_cache ? d->mask_cache + P * i : scratch ? scratch + 3 * P : NULL;
}

// Sample i decoded, checked and resized: rgb (H,W,3), mask (H,W) (segmentation).
static int sample_load(const Dataset *d, int i, uint8_t *rgb, uint8_t *mask, char err[SN_ERR_MAX]) {
    int h, w, orientation;
    float *img = image_load_oriented(d->images[i], &h, &w, &orientation, err);
    if (!img) return -1;
    uint8_t *m = d->segmentation ? mask_load(d->masks[i], h, w, orientation, d->classes, err) : NULL;
    int ok = !d->segmentation || m;
    if (ok) image_to_bytes(rgb, d->height, d->width, img, h, w);
    if (m) mask_resize(mask, d->height, d->width, m, h, w);
    free(img);
    free(m);
    return ok ? 0 : -1;
}

// Starts up to n threads running fn(arg); returns how many started.
static int threads_start(pthread_t *t, int n, void *(*fn)(void *), void *arg) {
    int k = 0;
    while (k < n && pthread_create(&t[k], NULL, fn, arg) == 0) k++;
    return k;
}

// The first SIGINT or SIGTERM, 0 if none (see "interruption" below): a long
// check of the data stops at it too.
static volatile sig_atomic_t interrupt_signal;

// Validation: workers claim samples in order; the lowest failing sample's
// error wins, so the report does not depend on the threads.
typedef struct {
    const Dataset *d;
    int next;                // next sample to claim (atomic)
    int bad;                 // lowest failing sample so far, n if none (atomic; written under mu)
    char err[SN_ERR_MAX];    // its error
    int64_t *counts;         // (classes) the masks' pixels per class, every worker's added under mu
    pthread_mutex_t mu;
} DatasetCheck;

static void *check_worker(void *arg) {
    DatasetCheck *c = arg;
    const Dataset *d = c->d;
    const size_t P = (size_t)d->height * d->width;
    uint8_t *scratch = d->image_cache ? NULL : malloc(4 * P);  // (H,W,3) + (H,W) when not cached
    int64_t *counts = calloc((size_t)d->classes, sizeof(int64_t));
    snCheck((d->image_cache || scratch) && counts, "out of host memory");
    int omp = omp_serial_begin();
    for (int i; !interrupt_signal && (i = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED)) < __atomic_load_n(&c->bad, __ATOMIC_RELAXED);) {
        uint8_t *rgb, *mask;
        char e[SN_ERR_MAX];
        sample_bytes(d, i, scratch, &rgb, &mask);
        if (sample_load(d, i, rgb, mask, e) == 0) {
            if (d->segmentation) for (size_t p = 0; p < P; p++) counts[mask[p]]++;
            continue;
        }
        pthread_mutex_lock(&c->mu);
        if (i < c->bad) { __atomic_store_n(&c->bad, i, __ATOMIC_RELAXED); memcpy(c->err, e, SN_ERR_MAX); }
        pthread_mutex_unlock(&c->mu);
    }
    omp_serial_end(omp);
    pthread_mutex_lock(&c->mu);
    for (int k = 0; k < d->classes; k++) c->counts[k] += counts[k];
    pthread_mutex_unlock(&c->mu);
    free(counts);
    free(scratch);
    return NULL;
}

void dataset_free(Dataset *d) {
    for (int i = 0; i < d->n; i++) {
        free(d->images[i]);
        if (d->masks) free(d->masks[i]);
    }
    free(d->images);
    free(d->masks);
    free(d->labels);
    free(d->image_cache);
    free(d->mask_cache);
    free(d->class_counts);
    for (int k = 0; k < d->n_names; k++) free(d->names[k]);
    free(d->names);
    memset(d, 0, sizeof *d);
}

int dataset_open(Dataset *d, const char *path, int segmentation, int classes, int height, int width,
                 size_t cache_bytes, int threads, char err[SN_ERR_MAX]) {
    return dataset_open_named(d, path, segmentation, classes, height, width, cache_bytes, threads, NULL, err);
}

int dataset_open_named(Dataset *d, const char *path, int segmentation, int classes, int height, int width,
                       size_t cache_bytes, int threads, const Dataset *names_from, char err[SN_ERR_MAX]) {
    snCheck(classes >= 1 && height >= 1 && width >= 1 && threads >= 1, "dataset_open: classes %d, size %dx%d, threads %d",
            classes, width, height, threads);
    memset(d, 0, sizeof *d);
    d->segmentation = segmentation;
    d->classes = classes;
    d->height = height;
    d->width = width;
    if (segmentation && classes > 256) {
        snprintf(err, SN_ERR_MAX, "%d classes: segmentation supports at most 256 (masks hold 8-bit class indices)", classes);
        return -1;
    }
    struct stat sb;
    if (stat(path, &sb) != 0) { snprintf(err, SN_ERR_MAX, "%s: %s", path, strerror(errno)); return -1; }
    int rc = segmentation ? list_segmentation(d, path, err)
           : S_ISDIR(sb.st_mode) ? list_class_folders(d, path, names_from, err) : list_csv(d, path, names_from, err);
    if (rc) { dataset_free(d); return -1; }

    // cache the resized bytes when they fit (and can be allocated)
    const size_t P = (size_t)height * width, per = P * (segmentation ? 4 : 3);
    if (per <= cache_bytes / (size_t)d->n) {
        d->image_cache = malloc(3 * P * d->n);
        d->mask_cache = segmentation ? malloc(P * d->n) : NULL;
        if (!d->image_cache || (segmentation && !d->mask_cache)) {
            free(d->image_cache); free(d->mask_cache);
            d->image_cache = d->mask_cache = NULL;
        }
    }
    d->class_counts = calloc((size_t)classes, sizeof(int64_t));
    snCheck(d->class_counts != NULL, "out of host memory");
    if (!segmentation) for (int i = 0; i < d->n; i++) d->class_counts[d->labels[i]]++;
    DatasetCheck c = {d, 0, d->n, "", d->class_counts, PTHREAD_MUTEX_INITIALIZER};
    pthread_t *t = malloc(sizeof(pthread_t) * (size_t)threads);
    snCheck(t != NULL, "out of host memory");
    int started = threads_start(t, threads - 1, check_worker, &c);
    check_worker(&c);  // the calling thread is one of the workers
    for (int k = 0; k < started; k++) pthread_join(t[k], NULL);
    free(t);
    pthread_mutex_destroy(&c.mu);
    if (c.bad < d->n) { snprintf(err, SN_ERR_MAX, "%s", c.err); dataset_free(d); return -1; }
    if (interrupt_signal) { snprintf(err, SN_ERR_MAX, "%s: interrupted while checking its images", path); dataset_free(d); return -1; }
    return 0;
}

// Sample idx's augmented image (H,W,3) as 0..255 floats from its bytes (and its
// mask as labels): first the flip of image and mask together, then, on 0..1
// values v = x/255 (tf.image semantics, no clipping):
//   brightness  v + δ,                   δ ~ U[-D, D)
//   contrast    (v - mean_c)·f + mean_c,  f ~ U[lo, hi), mean_c over H·W per channel
// Draw k of sample idx is rng_uniform(seed, idx·AUG_DRAWS + k): a pure function
// of (seed, idx), whichever thread builds the batch.
enum { AUG_FLIP, AUG_BRIGHTNESS, AUG_CONTRAST, AUG_DRAWS };

static void sample_augment(const Dataset *d, const uint8_t *rgb, const uint8_t *mask, int idx, const Augment *aug,
                           uint64_t seed, float *out, int32_t *labels) {
    const int H = d->height, W = d->width;
    const size_t P = (size_t)H * W;
    const uint64_t ctr = (uint64_t)idx * AUG_DRAWS;
    int flip = aug && aug->flip && rng_uniform(seed, ctr + AUG_FLIP) < 0.5f;
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) {
            size_t o = (size_t)y * W + x, s = (size_t)y * W + (flip ? W - 1 - x : x);
            for (int c = 0; c < 3; c++) out[3 * o + c] = rgb[3 * s + c];
            if (mask) labels[o] = mask[s];
        }
    int bright = aug && aug->brightness > 0.0f, contrast = aug && (aug->contrast_lo != 0.0f || aug->contrast_hi != 0.0f);
    if (!bright && !contrast) return;
    float delta = bright ? aug->brightness * (2.0f * rng_uniform(seed, ctr + AUG_BRIGHTNESS) - 1.0f) : 0.0f;
    float f = contrast ? aug->contrast_lo + (aug->contrast_hi - aug->contrast_lo) * rng_uniform(seed, ctr + AUG_CONTRAST) : 1.0f;
    for (int c = 0; c < 3; c++) {
        double sum = 0.0;
        for (size_t p = 0; p < P; p++) {
            out[3 * p + c] = out[3 * p + c] / 255.0f + delta;
            sum += out[3 * p + c];
        }
        float mean = (float)(sum / (double)P);
        for (size_t p = 0; p < P; p++) {
            float v = out[3 * p + c];
            out[3 * p + c] = 255.0f * (contrast ? (v - mean) * f + mean : v);
        }
    }
}

int dataset_batch(const Dataset *d, const int *idx, int n, const Augment *aug, uint64_t seed,
                  float *images, int32_t *labels, char err[SN_ERR_MAX]) {
    const size_t P = (size_t)d->height * d->width;
    uint8_t *scratch = d->image_cache ? NULL : malloc(4 * P);  // (H,W,3) + (H,W) when not cached
    snCheck(d->image_cache || scratch, "out of host memory");
    int rc = 0;
    for (int j = 0; j < n && rc == 0; j++) {
        const int i = idx[j];
        snCheck(i >= 0 && i < d->n, "dataset_batch: sample %d of %d", i, d->n);
        uint8_t *rgb, *mask;
        sample_bytes(d, i, scratch, &rgb, &mask);
        if (scratch) rc = sample_load(d, i, rgb, mask, err);
        if (rc) break;
        sample_augment(d, rgb, d->segmentation ? mask : NULL, i, aug, seed, images + 3 * P * j,
                       d->segmentation ? labels + P * j : NULL);
        if (!d->segmentation) labels[j] = d->labels[i];
    }
    free(scratch);
    return rc;
}

// The loader: a ring of `depth` batch slots, batch b built in slot b % depth.
// A worker may claim batch b once b < released + depth (the slot's previous
// batch has been given back); loader_next gives back the batch it returned
// last, then waits for the next one in order. Everything below mu is guarded.
struct Loader {
    const Dataset *d;
    int *order, n_order, batch, n_batches, depth;
    Augment aug;
    int has_aug;
    uint64_t seed;
    LoaderBatch *slots;          // (depth)
    int *built;                  // (depth) the batch whose build finished in each slot, -1 if none
    pthread_t *threads;
    int n_threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;           // any change below
    int next_build;              // next batch a worker claims
    int released;                // batches given back by the consumer
    int next_out;                // next batch loader_next hands out
    int failed;                  // lowest batch whose build failed, n_batches if none
    int stop;
    char build_err[SN_ERR_MAX];  // the error of batch `failed`
    char err[SN_ERR_MAX];        // loader_error's text (the consumer's copy)
};

static void *loader_worker(void *arg) {
    Loader *l = arg;
    omp_serial_begin();
    pthread_mutex_lock(&l->mu);
    for (;;) {
        while (!l->stop && l->next_build < l->n_batches && l->next_build >= l->released + l->depth)
            pthread_cond_wait(&l->cv, &l->mu);
        if (l->stop || l->next_build >= l->n_batches) break;
        const int b = l->next_build++, first = b * l->batch;
        const int n = l->n_order - first < l->batch ? l->n_order - first : l->batch;
        LoaderBatch *s = &l->slots[b % l->depth];
        pthread_mutex_unlock(&l->mu);
        char e[SN_ERR_MAX];
        int rc = dataset_batch(l->d, l->order + first, n, l->has_aug ? &l->aug : NULL, l->seed, s->images, s->labels, e);
        pthread_mutex_lock(&l->mu);
        if (rc == 0) { s->n = n; s->index = b; l->built[b % l->depth] = b; }
        else if (b < l->failed) { l->failed = b; memcpy(l->build_err, e, SN_ERR_MAX); }
        pthread_cond_broadcast(&l->cv);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

Loader *loader_start(const Dataset *d, const int *order, int n_order, int batch, const Augment *aug,
                     uint64_t seed, int workers, int depth) {
    snCheck(n_order >= 0 && batch >= 1 && workers >= 1 && depth >= 1, "loader_start: n_order %d, batch %d, workers %d, depth %d",
            n_order, batch, workers, depth);
    Loader *l = calloc(1, sizeof *l);
    snCheck(l != NULL, "out of host memory");
    const size_t P = (size_t)d->height * d->width;
    l->d = d;
    l->n_order = n_order;
    l->batch = batch;
    l->n_batches = (n_order + batch - 1) / batch;
    l->depth = depth;
    l->has_aug = aug != NULL;
    if (aug) l->aug = *aug;
    l->seed = seed;
    l->failed = l->n_batches;
    l->order = malloc(sizeof(int) * (size_t)(n_order ? n_order : 1));
    l->slots = calloc((size_t)depth, sizeof *l->slots);
    l->built = malloc(sizeof(int) * (size_t)depth);
    l->threads = malloc(sizeof(pthread_t) * (size_t)workers);
    snCheck(l->order && l->slots && l->built && l->threads, "out of host memory");
    memcpy(l->order, order, sizeof(int) * (size_t)n_order);
    for (int k = 0; k < depth; k++) {
        l->built[k] = -1;
        l->slots[k].images = malloc(sizeof(float) * 3 * P * batch);
        l->slots[k].labels = malloc(sizeof(int32_t) * (d->segmentation ? P : 1) * batch);
        snCheck(l->slots[k].images && l->slots[k].labels, "out of host memory for %d batches of %d", depth, batch);
    }
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    l->n_threads = threads_start(l->threads, workers, loader_worker, l);
    if (l->n_threads == 0 && l->n_batches > 0) {  // loader_next reports it
        l->failed = 0;
        snprintf(l->build_err, SN_ERR_MAX, "cannot start a loader thread");
    }
    return l;
}

const LoaderBatch *loader_next(Loader *l) {
    const LoaderBatch *out = NULL;
    pthread_mutex_lock(&l->mu);
    l->released = l->next_out;  // the batch returned last is given back
    pthread_cond_broadcast(&l->cv);
    if (!l->err[0] && l->next_out < l->n_batches) {
        const int b = l->next_out, k = b % l->depth;
        while (l->built[k] != b && l->failed != b) pthread_cond_wait(&l->cv, &l->mu);
        if (l->failed == b) {
            memcpy(l->err, l->build_err, SN_ERR_MAX);
            l->stop = 1;
            pthread_cond_broadcast(&l->cv);
        } else {
            out = &l->slots[k];
            l->next_out++;
        }
    }
    pthread_mutex_unlock(&l->mu);
    return out;
}

const char *loader_error(const Loader *l) { return l->err; }

void loader_stop(Loader *l) {
    if (!l) return;
    pthread_mutex_lock(&l->mu);
    l->stop = 1;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    for (int k = 0; k < l->n_threads; k++) pthread_join(l->threads[k], NULL);
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    for (int k = 0; k < l->depth; k++) { free(l->slots[k].images); free(l->slots[k].labels); }
    free(l->slots);
    free(l->built);
    free(l->threads);
    free(l->order);
    free(l);
}

// PNG through stb_image_write's callback into the shared atomic writer
static void png_put(void *f, void *data, int size) { fwrite(data, 1, (size_t)size, (FILE *)f); }

int png_write_atomic(const char *path, int w, int h, int comp, const uint8_t *pixels, char err[SN_ERR_MAX]) {
    snCheck(w >= 1 && h >= 1 && (comp == 1 || comp == 3), "png_write_atomic: %dx%d, %d channels", w, h, comp);
    char tmp[OUT_PATH_MAX];
    FILE *f = atomic_file_open(path, tmp, err);
    if (!f) return -1;
    int ok = stbi_write_png_to_func(png_put, f, w, h, comp, pixels, w * comp) != 0;
    if (!ok) snprintf(err, SN_ERR_MAX, "%.400s: cannot encode the PNG", path);
    return atomic_file_commit(f, tmp, path, ok, err);
}

// ----------------------------------------------------------------------------
// training curves (curves.svg)
//
// Four panels in a 2×2 grid against the epoch: loss (train, val), the metric
// (train, val), the gradient norm (mean, max; the clipping threshold as a
// line; a cross at epochs with skipped steps; the loss scale on a right axis)
// and the learning rate (the update ratio on a right axis). A series is its
// finite values joined in row order (a missing validation epoch is bridged),
// with a marker on each value, so a single epoch shows as points. y axes start
// at 0 and end at a "nice" number above the largest value; the metric's axis
// spans at least 0..1. The best epoch is a dotted vertical line in each panel.

#define SVG_PANEL_W 480
#define SVG_PANEL_H 360
#define SVG_LEFT 70     // plot area inside a panel: x in [LEFT, PANEL_W - RIGHT],
#define SVG_RIGHT 20    // y in [TOP, PANEL_H - BOTTOM]; RIGHT_AXIS instead of
#define SVG_RIGHT_AXIS 70  // RIGHT when the panel has a second axis
#define SVG_TOP 40
#define SVG_BOTTOM 50

typedef struct { size_t offset; const char *name, *colour, *dash; } SvgSeries;
typedef struct {
    const char *title;
    const SvgSeries *left;   // 2 series on the left axis (name NULL: absent)
    const SvgSeries *right;  // NULL, or 1 series on a right axis of its own
    double y_min_top;        // the left axis reaches at least this
    double hline;            // > 0: a horizontal line at this left-axis value, named hline_name
    const char *hline_name;
    int mark_skipped;        // a red cross at the bottom of the epochs with skipped steps
} SvgPanel;

static double record_value(const EpochRecord *r, size_t offset) { return *(const double *)((const char *)r + offset); }

// a step of 1, 2 or 5 × 10^k near (hi - lo)/5 (computed so that it stays finite near ±DBL_MAX)
static double nice_step(double lo, double hi) {
    double raw = hi / 5 - lo / 5, mag = pow(10, floor(log10(raw))), f = raw / mag;
    return (f <= 1 ? 1 : f <= 2 ? 2 : f <= 5 ? 5 : 10) * mag;
}

// text with &, <, > and " escaped
static void svg_text(FILE *f, const char *s) {
    for (; *s; s++) {
        if (*s == '&') fputs("&amp;", f);
        else if (*s == '<') fputs("&lt;", f);
        else if (*s == '>') fputs("&gt;", f);
        else if (*s == '"') fputs("&quot;", f);
        else fputc(*s, f);
    }
}

// An axis 0..max(values, top) (or from a negative minimum), rounded out to a nice step
typedef struct { double lo, hi, step; int ticks; } SvgAxis;
static SvgAxis svg_axis(const EpochRecord *rows, int n, const SvgSeries *s, int n_series, double top, int *present) {
    SvgAxis a = {0, top, 0, 0};
    for (int k = 0; k < n_series; k++) {
        present[k] = 0;
        for (int i = 0; s[k].name && i < n; i++) {
            double v = record_value(&rows[i], s[k].offset);
            if (!isfinite(v)) continue;
            present[k]++;
            a.lo = fmin(a.lo, v); a.hi = fmax(a.hi, v);
        }
    }
    if (a.hi == a.lo) a.hi = a.lo + 1;  // all values 0
    a.step = nice_step(a.lo, a.hi);
    double lo = floor(a.lo / a.step) * a.step, hi = ceil(a.hi / a.step) * a.step;
    if (isfinite(lo)) a.lo = lo;
    if (isfinite(hi)) a.hi = hi;
    a.ticks = (int)floor(a.hi / a.step - a.lo / a.step + 1e-9);
    return a;
}

static void svg_panel(FILE *f, int x0, int y0, const SvgPanel *p, const EpochRecord *rows, int n, int best_epoch) {
    const double L = x0 + SVG_LEFT, R = x0 + SVG_PANEL_W - (p->right ? SVG_RIGHT_AXIS : SVG_RIGHT);
    const double T = y0 + SVG_TOP, B = y0 + SVG_PANEL_H - SVG_BOTTOM;
    // x: the epochs, ±½ around a single one
    double ex0 = rows[0].epoch, ex1 = rows[0].epoch;
    for (int i = 0; i < n; i++) { ex0 = fmin(ex0, rows[i].epoch); ex1 = fmax(ex1, rows[i].epoch); }
    if (ex1 == ex0) { ex0 -= 0.5; ex1 += 0.5; }
    const double xstep = fmax(1, round(nice_step(ex0, ex1)));
    int present[3];
    SvgAxis ya = svg_axis(rows, n, p->left, 2, fmax(p->y_min_top, p->hline), present), yr = {0, 1, 1, 0};
    if (p->right) yr = svg_axis(rows, n, p->right, 1, 0, present + 2);
    else present[2] = 0;
#define SVG_X(e) (L + ((e) - ex0) / (ex1 - ex0) * (R - L))
#define SVG_Y(a, v) (B - ((v) / 2 - (a).lo / 2) / ((a).hi / 2 - (a).lo / 2) * (B - T))  // halves: finite near ±DBL_MAX

    fprintf(f, "<g>\n<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" font-size=\"15\" font-weight=\"bold\">",
            (L + R) / 2, y0 + 24.0);
    svg_text(f, p->title);
    fputs("</text>\n", f);
    for (int i = 0; i <= ya.ticks; i++) {  // y ticks and grid
        double v = 2 * (ya.lo / 2 + i * (ya.step / 2)), y = SVG_Y(ya, v);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#ddd\"/>"
                "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"end\">%.3g</text>\n", L, y, R, y, L - 6, y + 4, v);
    }
    for (int i = 0; p->right && i <= yr.ticks; i++) {  // the right axis' ticks
        double v = 2 * (yr.lo / 2 + i * (yr.step / 2)), y = SVG_Y(yr, v);
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>"
                "<text x=\"%.1f\" y=\"%.1f\" fill=\"%s\">%.6g</text>\n", R, y, R + 5, y, R + 8, y + 4, p->right->colour, v);
    }
    for (double e = ceil(ex0 / xstep) * xstep; e <= ex1; e += xstep)  // x ticks
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#333\"/>"
                "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">%.0f</text>\n",
                SVG_X(e), B, SVG_X(e), B + 5, SVG_X(e), B + 19, e);
    fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"none\" stroke=\"#333\"/>\n",
            L, T, R - L, B - T);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\">epoch</text>\n", (L + R) / 2, B + 40.0);
    fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" transform=\"rotate(-90 %.1f %.1f)\">",
            x0 + 18.0, (T + B) / 2, x0 + 18.0, (T + B) / 2);
    svg_text(f, p->title);
    fputs("</text>\n", f);
    if (best_epoch >= ex0 && best_epoch <= ex1)
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#2ca02c\" stroke-dasharray=\"2 3\"/>"
                "<text x=\"%.1f\" y=\"%.1f\" fill=\"#2ca02c\" text-anchor=\"middle\">best</text>\n",
                SVG_X(best_epoch), T, SVG_X(best_epoch), B, SVG_X(best_epoch), T - 4);
    if (p->hline > 0)
        fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"#d62728\" stroke-dasharray=\"8 3\"/>\n",
                L, SVG_Y(ya, p->hline), R, SVG_Y(ya, p->hline));
    // the series: left ones, then the right one against its own axis
    const SvgSeries *all[3] = {&p->left[0], &p->left[1], p->right};
    const SvgAxis *axis[3] = {&ya, &ya, &yr};
    for (int k = 0; k < 3; k++) {
        if (!present[k]) continue;
        fprintf(f, "<polyline fill=\"none\" stroke=\"%s\" stroke-width=\"2\"%s points=\"", all[k]->colour, all[k]->dash);
        for (int i = 0; i < n; i++) {
            double v = record_value(&rows[i], all[k]->offset);
            if (isfinite(v)) fprintf(f, "%.1f,%.1f ", SVG_X(rows[i].epoch), SVG_Y(*axis[k], v));
        }
        fputs("\"/>\n", f);
        for (int i = 0; i < n; i++) {
            double v = record_value(&rows[i], all[k]->offset);
            if (isfinite(v))
                fprintf(f, "<circle cx=\"%.1f\" cy=\"%.1f\" r=\"3\" fill=\"%s\"/>\n", SVG_X(rows[i].epoch),
                        SVG_Y(*axis[k], v), all[k]->colour);
        }
    }
    for (int i = 0; p->mark_skipped && i < n; i++) {  // a cross at the bottom of each epoch with skipped steps
        if (!(rows[i].skipped_steps > 0)) continue;
        double x = SVG_X(rows[i].epoch);
        fprintf(f, "<path d=\"M%.1f %.1fl8 8m0 -8l-8 8\" stroke=\"#d62728\" stroke-width=\"2\"/>\n", x - 4, B - 14);
    }
    // the legend goes top right, or bottom right when more of the values in the panel's right
    // half lie in its upper half (curves that end high: accuracy, IoU)
    const char *names[5];
    const char *colours[5], *dashes[5];
    int n_legend = 0, upper = 0, lower = 0;
    for (int k = 0; k < 3; k++) {
        if (!present[k]) continue;
        names[n_legend] = all[k]->name; colours[n_legend] = all[k]->colour; dashes[n_legend++] = all[k]->dash;
        for (int i = 0; i < n; i++) {
            double v = record_value(&rows[i], all[k]->offset);
            if (!isfinite(v) || SVG_X(rows[i].epoch) < (L + R) / 2) continue;
            if (SVG_Y(*axis[k], v) < (T + B) / 2) upper++;
            else lower++;
        }
    }
    const int bottom = upper > lower;
    if (p->hline > 0) {
        names[n_legend] = p->hline_name;
        colours[n_legend] = "#d62728";
        dashes[n_legend++] = " stroke-dasharray=\"8 3\"";
    }
    int any_skipped = 0;
    for (int i = 0; p->mark_skipped && i < n; i++) any_skipped |= rows[i].skipped_steps > 0;
    const int lines = n_legend + any_skipped;
    if (lines) {  // on a white ground, over what it covers
        const double top = bottom ? B - 12 - 18 * (lines - 1) : T + 14;
        fprintf(f, "<rect x=\"%.1f\" y=\"%.1f\" width=\"%.1f\" height=\"%.1f\" fill=\"white\" fill-opacity=\"0.85\"/>\n",
                R - 116, top - 11, 112.0, 18.0 * lines + 4);
    }
    for (int k = 0; k < lines; k++) {
        double ly = bottom ? B - 12 - 18 * (lines - 1 - k) : T + 14 + 18 * k;
        if (k < n_legend)
            fprintf(f, "<line x1=\"%.1f\" y1=\"%.1f\" x2=\"%.1f\" y2=\"%.1f\" stroke=\"%s\" stroke-width=\"2\"%s/>",
                    R - 110, ly, R - 86, ly, colours[k], dashes[k]);
        else
            fprintf(f, "<path d=\"M%.1f %.1fl8 8m0 -8l-8 8\" stroke=\"#d62728\" stroke-width=\"2\"/>", R - 102, ly - 4);
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\">", R - 80, ly + 4);
        svg_text(f, k < n_legend ? names[k] : "skipped steps");
        fputs("</text>\n", f);
    }
    if (!present[0] && !present[1])
        fprintf(f, "<text x=\"%.1f\" y=\"%.1f\" text-anchor=\"middle\" fill=\"#888\">no values</text>\n", (L + R) / 2,
                (T + B) / 2);
    fputs("</g>\n", f);
#undef SVG_X
#undef SVG_Y
}

int write_curves_svg(const char *path, const EpochRecord *rows, int n, const char *metric_name, const CurveMarks *marks,
                     char err[SN_ERR_MAX]) {
    snCheck(rows != NULL && n >= 1 && metric_name != NULL, "write_curves_svg: no rows");
    static const char *VAL_DASH = " stroke-dasharray=\"6 4\"";
    const SvgSeries loss[2] = {{offsetof(EpochRecord, loss), "train", "#1f77b4", ""},
                               {offsetof(EpochRecord, val_loss), "val", "#ff7f0e", VAL_DASH}};
    const SvgSeries metric[2] = {{offsetof(EpochRecord, metric), "train", "#1f77b4", ""},
                                 {offsetof(EpochRecord, val_metric), "val", "#ff7f0e", VAL_DASH}};
    const SvgSeries norm[2] = {{offsetof(EpochRecord, grad_norm_mean), "mean", "#1f77b4", ""},
                               {offsetof(EpochRecord, grad_norm_max), "max", "#9467bd", VAL_DASH}};
    const SvgSeries scale = {offsetof(EpochRecord, loss_scale), "loss scale", "#8c564b", " stroke-dasharray=\"2 2\""};
    const SvgSeries lr[2] = {{offsetof(EpochRecord, lr), "lr", "#1f77b4", ""}, {0, NULL, NULL, NULL}};
    const SvgSeries ratio = {offsetof(EpochRecord, update_ratio), "update ratio", "#8c564b", " stroke-dasharray=\"2 2\""};
    int fp16 = 0;  // the loss scale is drawn when it is not 1 throughout
    for (int i = 0; i < n; i++) fp16 |= isfinite(rows[i].loss_scale) && rows[i].loss_scale != 1.0;
    const SvgPanel panels[4] = {
        {"loss", loss, NULL, 0, 0, NULL, 0},
        {metric_name, metric, NULL, 1, 0, NULL, 0},
        {"gradient norm", norm, fp16 ? &scale : NULL, 0, marks ? marks->clipnorm : 0, "clipnorm", 1},
        {"learning rate", lr, &ratio, 0, 0, NULL, 0},
    };
    char tmp[OUT_PATH_MAX];
    FILE *f = atomic_file_open(path, tmp, err);
    if (!f) return -1;
    fprintf(f, "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"%d\" height=\"%d\" viewBox=\"0 0 %d %d\" "
            "font-family=\"sans-serif\" font-size=\"12\">\n<rect width=\"100%%\" height=\"100%%\" fill=\"white\"/>\n",
            2 * SVG_PANEL_W, 2 * SVG_PANEL_H, 2 * SVG_PANEL_W, 2 * SVG_PANEL_H);
    for (int k = 0; k < 4; k++)
        svg_panel(f, (k % 2) * SVG_PANEL_W, (k / 2) * SVG_PANEL_H, &panels[k], rows, n, marks ? marks->best_epoch : 0);
    fputs("</svg>\n", f);
    return atomic_file_commit(f, tmp, path, 1, err);
}

// ----------------------------------------------------------------------------
// host RNG extras

// standard normal by Box-Muller
float rng_normal(Rng *r) {
    float u1 = rng_float(r), u2 = rng_float(r);
    if (u1 < 1e-7f) u1 = 1e-7f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530718f * u2);
}

// ----------------------------------------------------------------------------
// replicas: communicators
//
// A sum over ranks is ((b0 + b1) + b2) + ... element by element, the same
// expression on every rank and for every communicator, so `--replicas N` and
// `mpirun -np N` give the same bits, and every rank holds the same result.

// dst[i] = ((src[0][i] + src[1][i]) + ...) + src[size-1][i]; dst may be src[0]
#define DEFINE_SUM_RANKS(NAME, T)                                                   \
    static void NAME(T *dst, T *const *src, int size, size_t n) {                    \
        _Pragma("omp parallel for schedule(static) if(PAR(n * size))")               \
        for (size_t i = 0; i < n; i++) {                                             \
            T s = src[0][i];                                                         \
            for (int r = 1; r < size; r++) s += src[r][i];                           \
            dst[i] = s;                                                              \
        }                                                                            \
    }
DEFINE_SUM_RANKS(sum_ranks_f32, float)
DEFINE_SUM_RANKS(sum_ranks_f64, double)
DEFINE_SUM_RANKS(sum_ranks_i64, int64_t)

// "stopped: rank R failed" for a collective that returned -1
static int comm_failure(Comm *c, char err[SN_ERR_MAX]) {
    snprintf(err, SN_ERR_MAX, "stopped because rank %d failed", c->failed_rank(c));
    return -1;
}

int comm_agree(Comm *c, int rc, char err[SN_ERR_MAX]) {
    if (c->size == 1) return rc;
    int64_t failed[SN_MAX_REPLICAS] = {0};
    failed[c->rank] = rc != 0;
    if (c->allreduce_i64(c, failed, (size_t)c->size)) return comm_failure(c, err);
    int first = 0;
    while (first < c->size && !failed[first]) first++;
    if (first == c->size) return 0;
    char msg[SN_ERR_MAX];
    snprintf(msg, sizeof msg, "%s", c->rank == first ? err : "");
    if (c->broadcast(c, msg, sizeof msg, first)) return comm_failure(c, err);
    if (first == 0) snprintf(err, SN_ERR_MAX, "%s", msg);  // the rank that reads the data and writes the run: no prefix
    else snprintf(err, SN_ERR_MAX, "rank %d: %.480s", first, msg);
    return -1;
}

// ---- local: the ranks are threads of this process that take turns

typedef enum { LOCAL_F32, LOCAL_F64, LOCAL_I64, LOCAL_BCAST } LocalKind;

typedef struct {
    int size;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int turn;                     // a rank holds the turn (is running)
    int arrived;                  // ranks in the current collective
    uint64_t generation;          // collectives completed
    void *buf[SN_MAX_REPLICAS];   // each rank's buffer in the current collective
    size_t n[SN_MAX_REPLICAS];
    int failed_rank;              // first rank that aborted, -1
    int returned;                 // ranks whose thread has returned 0
} LocalGroup;

// The last rank to arrive combines every rank's buffer (all others are
// waiting, so nothing else runs) and keeps the turn; the others hand it on
// while they wait and take it back after.
int comm_local_gather(Comm *c, void *buf, size_t n, CommCombine combine, void *arg) {
    LocalGroup *g = c->ctx;
    if (g->size == 1) return 0;
    pthread_mutex_lock(&g->mu);
    if (g->failed_rank >= 0) { pthread_mutex_unlock(&g->mu); return -1; }
    g->buf[c->rank] = buf;
    g->n[c->rank] = n;
    int ok = 1;
    if (++g->arrived == g->size) {
        for (int r = 0; r < g->size; r++)
            snCheck(g->n[r] == n, "a collective of %zu elements on rank %d but %zu on rank %d", n, c->rank, g->n[r], r);
        combine(g->buf, g->size, n, arg);
        g->arrived = 0;
        g->generation++;
        pthread_cond_broadcast(&g->cv);
    } else {
        uint64_t gen = g->generation;
        g->turn = 0;
        pthread_cond_broadcast(&g->cv);
        while (g->generation == gen && g->failed_rank < 0) {
            // a rank that returned will never arrive: a mismatch of collectives, not a user error
            snCheck(g->returned == 0, "rank %d waits in a collective that a rank which has returned will never join", c->rank);
            pthread_cond_wait(&g->cv, &g->mu);
        }
        ok = g->generation != gen;
        while (g->turn) pthread_cond_wait(&g->cv, &g->mu);
        g->turn = 1;
    }
    pthread_mutex_unlock(&g->mu);
    return ok ? 0 : -1;
}

// host buffers: sums in rank order into every rank's buffer, or root's bytes to every rank
typedef struct { LocalKind kind; int root; } LocalOp;

static void local_combine(void *const *bufs, int size, size_t n, void *arg) {
    const LocalOp *op = arg;
    if (op->kind == LOCAL_BCAST) {
        for (int r = 0; r < size; r++) if (r != op->root) memcpy(bufs[r], bufs[op->root], n);
        return;
    }
    size_t elem = op->kind == LOCAL_F32 ? sizeof(float) : 8;
    if (op->kind == LOCAL_F32) sum_ranks_f32(bufs[0], (float *const *)bufs, size, n);
    else if (op->kind == LOCAL_F64) sum_ranks_f64(bufs[0], (double *const *)bufs, size, n);
    else sum_ranks_i64(bufs[0], (int64_t *const *)bufs, size, n);
    for (int r = 1; r < size; r++) memcpy(bufs[r], bufs[0], n * elem);
}

static int local_collective(Comm *c, void *buf, size_t n, LocalKind kind, int root) {
    LocalOp op = {kind, root};
    return comm_local_gather(c, buf, n, local_combine, &op);
}

static int local_allreduce_f32(Comm *c, float *b, size_t n) { return local_collective(c, b, n, LOCAL_F32, 0); }
static int local_allreduce_f64(Comm *c, double *b, size_t n) { return local_collective(c, b, n, LOCAL_F64, 0); }
static int local_allreduce_i64(Comm *c, int64_t *b, size_t n) { return local_collective(c, b, n, LOCAL_I64, 0); }
static int local_broadcast(Comm *c, void *b, size_t bytes, int root) { return local_collective(c, b, bytes, LOCAL_BCAST, root); }

static void local_abort(Comm *c, const char *why) {
    (void)why;  // the rank's own error is returned by its thread
    LocalGroup *g = c->ctx;
    pthread_mutex_lock(&g->mu);
    if (g->failed_rank < 0) g->failed_rank = c->rank;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static int local_failed_rank(Comm *c) {
    LocalGroup *g = c->ctx;
    pthread_mutex_lock(&g->mu);
    int r = g->failed_rank;
    pthread_mutex_unlock(&g->mu);
    return r;
}

int comm_local_create(Comm *comms, int n) {
    if (n < 1 || n > SN_MAX_REPLICAS) return -1;
    LocalGroup *g = calloc(1, sizeof *g);
    snCheck(g != NULL, "out of host memory");
    g->size = n;
    g->failed_rank = -1;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    for (int r = 0; r < n; r++)
        comms[r] = (Comm){"local", r, n, g, local_allreduce_f32, local_allreduce_f64, local_allreduce_i64,
                          local_broadcast, local_abort, local_failed_rank, .local_rank = r};
    return 0;
}

void comm_local_destroy(Comm *comms, int n) {
    if (n < 1) return;
    LocalGroup *g = comms[0].ctx;
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g);
}

typedef struct { Comm *c; int (*fn)(Comm *, void *); void *arg; int rc; } LocalRank;

static void *local_rank_main(void *p) {
    LocalRank *lr = p;
    LocalGroup *g = lr->c->ctx;
    pthread_mutex_lock(&g->mu);
    while (g->turn) pthread_cond_wait(&g->cv, &g->mu);
    g->turn = 1;
    pthread_mutex_unlock(&g->mu);
    lr->rc = lr->fn(lr->c, lr->arg);
    if (lr->rc) local_abort(lr->c, "returned an error");
    pthread_mutex_lock(&g->mu);
    if (!lr->rc) g->returned++;
    g->turn = 0;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

void comm_local_run(Comm *comms, int n, int (*fn)(Comm *c, void *arg), void **args, int *rc) {
    LocalRank lr[SN_MAX_REPLICAS];
    pthread_t th[SN_MAX_REPLICAS];
    for (int r = 0; r < n; r++) lr[r] = (LocalRank){&comms[r], fn, args[r], 0};
    if (n == 1) { rc[0] = fn(&comms[0], args[0]); return; }
    for (int r = 0; r < n; r++) snCheck(pthread_create(&th[r], NULL, local_rank_main, &lr[r]) == 0, "cannot start a replica thread");
    for (int r = 0; r < n; r++) { pthread_join(th[r], NULL); rc[r] = lr[r].rc; }
}

// ---- mpi: one process per rank

int comm_mpi_launched(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"};
    for (int k = 0; k < 3; k++) {
        const char *v = getenv(vars[k]);
        if (v && atoi(v) > 0) return atoi(v);
    }
    return 1;
}

#ifdef SEGNET_MPI
// A sum in rank order: every rank gathers every rank's chunk (at most
// MPI_CHUNK_BYTES from each) and adds them up itself. MPI_Allreduce would
// choose its own order (and grouping) by message size and rank count.
#define MPI_CHUNK_BYTES ((size_t)1 << 22)

static int mpi_sum(Comm *c, void *buf, size_t n, size_t elem, MPI_Datatype type) {
    if (c->size == 1 || n == 0) return 0;
    size_t chunk = MPI_CHUNK_BYTES / elem;
    if (chunk > n) chunk = n;
    uint8_t *all = malloc(chunk * elem * (size_t)c->size);
    snCheck(all != NULL, "out of host memory");
    void *src[SN_MAX_REPLICAS];
    for (size_t off = 0; off < n; off += chunk) {
        size_t m = n - off < chunk ? n - off : chunk;
        uint8_t *b = (uint8_t *)buf + off * elem;
        MPI_Allgather(b, (int)m, type, all, (int)m, type, MPI_COMM_WORLD);
        for (int r = 0; r < c->size; r++) src[r] = all + (size_t)r * m * elem;
        if (type == MPI_FLOAT) sum_ranks_f32((float *)b, (float *const *)src, c->size, m);
        else if (type == MPI_DOUBLE) sum_ranks_f64((double *)b, (double *const *)src, c->size, m);
        else sum_ranks_i64((int64_t *)b, (int64_t *const *)src, c->size, m);
    }
    free(all);
    return 0;
}
static int mpi_allreduce_f32(Comm *c, float *b, size_t n) { return mpi_sum(c, b, n, sizeof(float), MPI_FLOAT); }
static int mpi_allreduce_f64(Comm *c, double *b, size_t n) { return mpi_sum(c, b, n, sizeof(double), MPI_DOUBLE); }
static int mpi_allreduce_i64(Comm *c, int64_t *b, size_t n) { return mpi_sum(c, b, n, sizeof(int64_t), MPI_INT64_T); }

static int mpi_broadcast(Comm *c, void *buf, size_t bytes, int root) {
    for (size_t off = 0; off < bytes; off += MPI_CHUNK_BYTES) {
        size_t m = bytes - off < MPI_CHUNK_BYTES ? bytes - off : MPI_CHUNK_BYTES;
        MPI_Bcast((uint8_t *)buf + off, (int)m, MPI_BYTE, root, MPI_COMM_WORLD);
    }
    (void)c;
    return 0;
}

static void mpi_abort(Comm *c, const char *why) {
    fprintf(stderr, "segnet: rank %d ends the job (MPI_Abort): %s\n", c->rank, why);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static int mpi_failed_rank(Comm *c) { (void)c; return -1; }  // a failed rank has ended the job

static void mpi_finalize_at_exit(void) {
    int done = 0;
    MPI_Finalized(&done);
    if (!done) MPI_Finalize();
}

int comm_mpi_open(Comm *c, char err[SN_ERR_MAX]) {
    int started = 0, rank = 0, size = 1;
    MPI_Initialized(&started);
    if (!started) {
        if (MPI_Init(NULL, NULL) != MPI_SUCCESS) { snprintf(err, SN_ERR_MAX, "MPI_Init failed"); return -1; }
        atexit(mpi_finalize_at_exit);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size > SN_MAX_REPLICAS) { snprintf(err, SN_ERR_MAX, "%d MPI processes: at most %d replicas", size, SN_MAX_REPLICAS); return -1; }
    // the ranks sharing this machine's memory, numbered from 0: a rank's GPU
    MPI_Comm node;
    int local_rank = 0;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_free(&node);
    *c = (Comm){"mpi", rank, size, NULL, mpi_allreduce_f32, mpi_allreduce_f64, mpi_allreduce_i64, mpi_broadcast,
                mpi_abort, mpi_failed_rank, .local_rank = local_rank};
    return 0;
}
#else
int comm_mpi_open(Comm *c, char err[SN_ERR_MAX]) {
    (void)c;
    snprintf(err, SN_ERR_MAX, "started by mpirun with %d processes, but this segnet was built without MPI "
             "(install libopenmpi-dev and rebuild)", comm_mpi_launched());
    return -1;
}
#endif

// ----------------------------------------------------------------------------
// the training run: options, opening a trainer, passes, checkpoints, metrics.csv, resume

void train_cfg_default(TrainCfg *c) {
    memset(c, 0, sizeof *c);
    c->model = model_cfg_default();
    c->model.batch = 8;
    for (int k = 0; k < SN_MAX_CLASSES; k++) c->class_weights[k] = 1.0f;
    c->epochs = 10;
    c->lr = 1e-3f;
    c->adam_eps = ADAM_EPS;
    c->schedule = SCHEDULE_CONSTANT;
    c->seed = 1;
    c->workers = 1;
    c->cache_bytes = (size_t)2 << 30;
    c->progress = 1;
    c->precision = DT_F32;
    c->accum = 1;
    c->loss_scale_interval = LOSS_SCALE_GROWTH_INTERVAL;
}

static int model_is_classifier(const char *model) { return !strncmp(model, "effv2-", 6); }
static const char *const DTYPE_NAMES[] = {"fp32", "fp16", "bf16"};  // indexed by DType, as --precision spells them

// ",value" in `format` (a printf conversion of one double); "," for NaN
static void csv_value(SfBuf *b, double v, const char *format) {
    char s[48];
    s[0] = ',';
    if (isnan(v)) s[1] = 0;
    else snprintf(s + 1, sizeof s - 1, format, v);
    sb_str(b, s);
}
static void csv_num(SfBuf *b, double v) { csv_value(b, v, "%.6f"); }

// 6 significant digits: the diagnostics span decades
static void csv_sig(SfBuf *b, double v) { csv_value(b, v, "%.6g"); }

// the shortest decimal that reads back as the same float (0.001, not 0.00100000005)
static const char *float_str(char buf[32], float v) {
    for (int digits = 6; digits <= 9; digits++) {
        snprintf(buf, 32, "%.*g", digits, v);
        if (strtof(buf, NULL) == v) break;
    }
    return buf;
}

// --augment's value: none, or its items comma-separated
static void augment_text(const Augment *a, SfBuf *b) {
    char s[96], f[2][32];
    int n = 0;
    if (a->flip) { sb_str(b, "flip"); n++; }
    if (a->brightness > 0) {
        snprintf(s, sizeof s, "%sbrightness=%s", n++ ? "," : "", float_str(f[0], a->brightness));
        sb_str(b, s);
    }
    if (a->contrast_lo > 0 || a->contrast_hi > 0) {
        snprintf(s, sizeof s, "%scontrast=%s:%s", n++ ? "," : "", float_str(f[0], a->contrast_lo), float_str(f[1], a->contrast_hi));
        sb_str(b, s);
    }
    if (!n) sb_str(b, "none");
}

// --class-weights' value: K weights comma-separated
static void class_weights_text(const TrainCfg *c, SfBuf *b) {
    char f[32];
    for (int k = 0; k < c->model.classes; k++) {
        if (k) sb_str(b, ",");
        sb_str(b, float_str(f, c->class_weights[k]));
    }
}

// what early stopping and best.safetensors watch: the validation loss, or the
// validation mIoU (segmentation) / accuracy (classification); the training
// run's own values when there is no validation set
static const char *monitor_name(const TrainCfg *c) {
    return !c->monitor_metric ? "val_loss" : model_is_classifier(c->model.model) ? "val_accuracy" : "val_mIoU";
}

// the columns' values: norm mean and max, clip fraction, loss scale, skipped steps, update ratio, ms per step
#define STEP_STATS_N_COLUMNS 7
static const char *const STEP_STATS_COLUMNS = "grad_norm_mean,grad_norm_max,clip_fraction,loss_scale,skipped_steps,"
                                              "update_ratio,step_ms";
static void step_stats_columns(const StepStats *st, double v[STEP_STATS_N_COLUMNS]) {
    const int64_t applied = st->steps - st->skipped;
    v[0] = applied ? st->norm_sum / (double)applied : NAN;
    v[1] = applied ? st->norm_max : NAN;
    v[2] = st->steps ? (double)st->clipped / (double)st->steps : NAN;
    v[3] = st->steps ? st->loss_scale : NAN;
    v[4] = (double)st->skipped;
    v[5] = st->update_ratio;
    v[6] = st->timed ? 1000.0 * st->seconds / (double)st->timed : NAN;
}

static void step_stats_text(const StepStats *st, char *out, size_t size) {
    snprintf(out, size, "%" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 " %a %a %a %a %a %a", st->steps,
             st->clipped, st->skipped, st->skip_run, st->skip_run_max, st->norm_sum, st->norm_max, st->loss_sum,
             st->label_sum, st->loss_scale, st->update_ratio);
}
// the text of step_stats_text back, every field checked; -1 with err naming the file and key
static int step_stats_parse(const char *path, const char *key, const char *text, StepStats *st, char err[SN_ERR_MAX]) {
    int64_t n[5];
    double x[6];
    const char *p = text;
    for (int k = 0; k < STEP_STATS_FIELDS; k++) {
        char *end;
        errno = 0;
        if (k < 5) n[k] = strtoll(p, &end, 10);
        else x[k - 5] = strtod(p, &end);
        const char sep = k + 1 < STEP_STATS_FIELDS ? ' ' : 0;
        if (end == p || *p == ' ' || errno == ERANGE || *end != sep || (k < 5 && n[k] < 0)) {
            snprintf(err, SN_ERR_MAX, "%.300s: metadata '%s': item %d is not a number (a damaged checkpoint)", path, key, k + 1);
            return -1;
        }
        p = end + (sep != 0);
    }
    *st = (StepStats){n[0], n[1], n[2], n[3], n[4], x[0], x[1], x[2], x[3], x[4], x[5], 0.0, 0};
    if (st->clipped + st->skipped > st->steps || st->skip_run > st->skip_run_max || st->skip_run_max > st->skipped ||
        !(st->label_sum >= 0) || !(st->loss_scale > 0) || !isfinite(st->loss_scale) || st->update_ratio < 0) {
        snprintf(err, SN_ERR_MAX, "%.250s: metadata '%s' is '%.120s', counts or figures out of range (a damaged checkpoint)",
                 path, key, text);
        return -1;
    }
    return 0;
}

// the communicator of a trainer without replicas
static LocalGroup comm_one_group = {.size = 1, .mu = PTHREAD_MUTEX_INITIALIZER, .cv = PTHREAD_COND_INITIALIZER,
                                    .failed_rank = -1};
static Comm comm_one = {"local", 0, 1, &comm_one_group, local_allreduce_f32, local_allreduce_f64, local_allreduce_i64,
                        local_broadcast, local_abort, local_failed_rank, 0, NULL};

static void trainer_close(Trainer *t) {
    Ops *o = t->o;
    if (o) {
        o->free(o, t->adam_m); o->free(o, t->adam_v); o->free(o, t->class_weights);
        o->free(o, t->labels); o->free(o, t->confusion); o->free(o, t->args); o->free(o, t->state);
        o->free(o, t->stage); o->free(o, t->nonfinite);
        if (t->record) o->record_free(o, t->record);
        if (o->host_free) {
            o->host_free(o, t->host_args); o->host_free(o, t->host_state); o->host_free(o, t->host_seeds);
            o->host_free(o, t->host_images); o->host_free(o, t->host_labels);
        }
    }
    free(t->ranges); free(t->accum_images); free(t->accum_labels); free(t->bn_host); free(t->resume_cm);
    free(t->update_host); free(t->steps_csv);
    net_free(&t->net);
    graph_free(&t->g);
    if (t->has_train && !t->borrowed_data) dataset_free(&t->train);
    if (t->has_val && !t->borrowed_data) dataset_free(&t->val);
    memset(t, 0, sizeof *t);
}

// optimiser steps of the whole run: K global batches of model.batch images per step
static void trainer_count_steps(Trainer *t) {
    const TrainCfg *c = t->c;
    int64_t batches = (t->train.n + c->model.batch - 1) / c->model.batch;
    t->total_steps = t->has_train ? (batches + c->accum - 1) / c->accum * c->epochs : 0;
}

// The device of a replica. With replicas, replicas_on_gpus has decided before
// they start: a device communicator (comm->device) means GPUs; --device auto
// without one means the CPU. Without replicas, --device as given.
static Device replica_device(const TrainCfg *c, const Comm *comm) {
    if (comm->size > 1 && c->device == DEVICE_AUTO && !comm->device) return DEVICE_CPU;
    return c->device;
}

// The training set's fingerprint: an FNV-1a hash (64-bit) over its samples in order.
#define FNV1A_OFFSET 0xcbf29ce484222325ull
#define FNV1A_PRIME  0x100000001b3ull

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * FNV1A_PRIME;
    return h;
}
// a sample file's share of the hash: its name under root (whole when outside it) and its size
static uint64_t fingerprint_file(uint64_t h, const char *path, const char *root) {
    const size_t k = strlen(root);
    const char *name = !strncmp(path, root, k) && path[k] == '/' ? path + k + 1 : path;
    struct stat sb;
    const int64_t size = stat(path, &sb) == 0 ? (int64_t)sb.st_size : -1;
    return fnv1a(fnv1a(h, name, strlen(name) + 1), &size, sizeof size);
}
// "<samples> <hash>" of data set d, opened from path (a folder, or a CSV whose folder its paths start from)
static void data_fingerprint(const Dataset *d, const char *path, char out[64]) {
    char root[OUT_PATH_MAX];
    struct stat sb;
    if (stat(path, &sb) == 0 && !S_ISDIR(sb.st_mode)) path_folder(path, root);
    else snprintf(root, sizeof root, "%s", path);
    uint64_t h = FNV1A_OFFSET;
    for (int i = 0; i < d->n; i++) {
        h = fingerprint_file(h, d->images[i], root);
        if (d->masks) h = fingerprint_file(h, d->masks[i], root);
        else h = fnv1a(h, &d->labels[i], sizeof d->labels[i]);
    }
    snprintf(out, 64, "%d %016" PRIx64, d->n, h);
}

// A data set holds something the loss weighs: a pixel (sample) of a class
// whose weight is above 0. Without one its loss would be 0/0.
static int dataset_weighted(const Dataset *d, const char *path, const TrainCfg *c, char err[SN_ERR_MAX]) {
    char held[256] = "";
    int n_held = 0;
    for (int k = 0; k < d->classes; k++) {
        if (d->class_counts[k] && c->class_weights[k] > 0.0f) return 0;
        char item[64];
        snprintf(item, sizeof item, "%d (weight %g)", k, c->class_weights[k]);
        if (d->class_counts[k]) list_add(held, sizeof held, &n_held, item);
    }
    snprintf(err, SN_ERR_MAX, "%.200s: not one %s of a class whose weight is above 0: its %s only class%s %s, so its loss "
             "would be 0/0 (see --class-weights)", path, d->segmentation ? "pixel" : "image",
             d->segmentation ? "masks hold" : "labels are", n_held == 1 ? "" : "es", held);
    return -1;
}

// --freeze base (and --unfreeze-last N) on the graph; -1 with err for an N
// the backbone does not have, or an N without --freeze base (it would do nothing).
static int freeze_apply(Graph *g, const TrainCfg *c, char err[SN_ERR_MAX]) {
    if (!c->freeze_base) {
        if (c->unfreeze_last <= 0) return 0;
        snprintf(err, SN_ERR_MAX, "--unfreeze-last %d does nothing without --freeze base (every layer trains)", c->unfreeze_last);
        return -1;
    }
    const int blocks = graph_freeze_base(g, c->unfreeze_last);
    if (c->unfreeze_last <= blocks) return 0;
    snprintf(err, SN_ERR_MAX, "--unfreeze-last %d: model '%s' has %d blocks in its backbone", c->unfreeze_last, c->model.model,
             blocks);
    return -1;
}

// Builds the model and opens the data (train may be NULL: evaluation only).
// comm: the replicas (NULL: none); each builds the model for its shard,
// model.batch / replicas images.
static int trainer_open_on(Trainer *t, const TrainCfg *c, const char *train, const char *val, Comm *comm,
                           char err[SN_ERR_MAX]) {
    memset(t, 0, sizeof *t);
    t->c = c;
    t->comm = comm ? comm : &comm_one;
    graph_init(&t->g);
    if (input_size_checked(&c->model, err)) return -1;
    const int R = t->comm->size;
    if (c->model.batch % R) {
        snprintf(err, SN_ERR_MAX, "--batch %d is the global batch: it must be a multiple of the %d replicas", c->model.batch, R);
        return -1;
    }
    ModelCfg shard = c->model;
    shard.batch = t->shard = c->model.batch / R;
    t->logits = model_build(&t->g, &shard);
    if (t->logits < 0) { snprintf(err, SN_ERR_MAX, "%s", t->g.err); return -1; }
    Shape out = t->g.tensors[t->logits].shape, in = t->g.tensors[t->g.input].shape;
    t->K = out.c;
    t->segmentation = !model_is_classifier(c->model.model);
    if (t->segmentation && (out.h != in.h || out.w != in.w)) {
        snprintf(err, SN_ERR_MAX, "model '%s' gives (%d,%d) logits for (%d,%d) images", c->model.model,
                 out.h, out.w, in.h, in.w);
        return -1;
    }
    int any_weight = 0;
    for (int k = 0; k < t->K; k++) {
        if (!(c->class_weights[k] >= 0.0f) || isinf(c->class_weights[k])) {
            snprintf(err, SN_ERR_MAX, "class weight %d is %g: weights must be finite and ≥ 0", k, c->class_weights[k]);
            return -1;
        }
        any_weight |= c->class_weights[k] > 0.0f;
    }
    if (!any_weight) { snprintf(err, SN_ERR_MAX, "every class weight is 0: nothing to learn"); return -1; }
    if (train) {
        if (dataset_open(&t->train, train, t->segmentation, t->K, in.h, in.w, c->cache_bytes, c->threads > 0 ? c->threads : 2, err)) return -1;
        t->has_train = 1;
        data_fingerprint(&t->train, train, t->data_print);
    }
    if (val) {
        if (dataset_open_named(&t->val, val, t->segmentation, t->K, in.h, in.w, c->cache_bytes, c->threads > 0 ? c->threads : 2,
                               train ? &t->train : NULL, err)) return -1;
        t->has_val = 1;
    }
    if ((train && dataset_weighted(&t->train, train, c, err)) || (val && dataset_weighted(&t->val, val, c, err))) return -1;
    if (freeze_apply(&t->g, c, err)) return -1;
    if (c->accum < 1 || c->accum > SN_MAX_ACCUM) { snprintf(err, SN_ERR_MAX, "--accum %d must be 1..%d", c->accum, SN_MAX_ACCUM); return -1; }
    // the device after every input check: a bad input is one line, without the CPU notice before it
    if (!(t->o = ops_for_device(replica_device(c, t->comm), t->comm->local_rank, err))) return -1;
    Ops *o = t->o;
    if (net_create_planned(&t->net, &t->g, o, c->precision, 0, t->logits, c->checkpoint, err)) return -1;
    // trainable parameters as runs of the parameter buffer: their gradients
    // and Adam moments are packed in the same order; frozen ones have neither
    const Graph *g = &t->g;
    t->ranges = calloc((size_t)g->n_params + 1, sizeof *t->ranges);
    snCheck(t->ranges != NULL, "out of host memory");
    for (int p = 0; p < g->n_params; p++) {  // parameters are laid out in id order
        if (t->net.grad_offset[p] == SIZE_MAX) continue;
        if (t->n_ranges && t->ranges[t->n_ranges - 1].offset + t->ranges[t->n_ranges - 1].count == g->params[p].offset)
            t->ranges[t->n_ranges - 1].count += g->params[p].count;
        else
            t->ranges[t->n_ranges++] = (typeof(*t->ranges)){g->params[p].offset, g->params[p].count};
        t->n_trainable += g->params[p].count;
    }
    snCheck(t->n_trainable == t->net.n_grad_floats, "trainable ranges and gradient layout disagree");
    size_t T = t->n_trainable, labels = (size_t)in.n * (t->segmentation ? (size_t)in.h * in.w : 1);
    t->per_image = t->segmentation ? (size_t)in.h * in.w : 1;
    t->adam_m = o->alloc(o, sizeof(float) * (T ? T : 1));
    t->adam_v = o->alloc(o, sizeof(float) * (T ? T : 1));
    t->class_weights = o->alloc(o, sizeof(float) * t->K);
    t->labels = o->alloc(o, sizeof(int32_t) * labels);
    t->confusion = o->alloc(o, sizeof(int64_t) * t->K * t->K);
    t->args = o->alloc(o, sizeof(StepArgs));
    t->state = o->alloc(o, sizeof(StepState));
    t->nonfinite = o->alloc(o, sizeof(int32_t));
    const DType dtype = t->net.dtype;  // the storage type, from here on the net's
    t->stage = dtype == DT_F32 ? NULL : o->alloc(o, sizeof(float) * (size_t)in.n * in.h * in.w * 3);
    if (!t->adam_m || !t->adam_v || !t->class_weights || !t->labels || !t->confusion || !t->args || !t->state ||
        !t->nonfinite || (dtype != DT_F32 && !t->stage)) {
        snprintf(err, SN_ERR_MAX, "out of %s memory for the optimiser state", o->name);
        return -1;
    }
    t->host_args = o->host_alloc(o, sizeof(StepArgs));
    t->host_state = o->host_alloc(o, sizeof(StepState));
    t->host_seeds = o->host_alloc(o, sizeof(uint64_t) * (size_t)g->n_layers);
    t->host_images = o->host_alloc(o, sizeof(float) * (size_t)in.n * in.h * in.w * 3);
    t->host_labels = o->host_alloc(o, sizeof(int32_t) * labels);
    if (!t->host_args || !t->host_state || !t->host_seeds || !t->host_images || !t->host_labels) {
        snprintf(err, SN_ERR_MAX, "out of pinned host memory for the staging buffers");
        return -1;
    }
    const char *records = getenv("SEGNET_CUDA_GRAPHS");
    t->records = !(records && !strcmp(records, "0"));
    if (c->accum > 1) {
        t->accum_images = malloc(sizeof(float) * (size_t)c->accum * in.n * in.h * in.w * 3);
        t->accum_labels = malloc(sizeof(int32_t) * (size_t)c->accum * labels);
        if (!t->accum_images || !t->accum_labels) { snprintf(err, SN_ERR_MAX, "out of host memory for %d micro-batches", c->accum); return -1; }
    }
    o->fill(o, tensor_f32(t->adam_m, shape4((int)T, 1, 1, 1)), 0.0f);
    o->fill(o, tensor_f32(t->adam_v, shape4((int)T, 1, 1, 1)), 0.0f);
    o->upload(o, t->class_weights, c->class_weights, sizeof(float) * t->K);
    t->loss_scale = dtype == DT_F16 ? LOSS_SCALE_INIT : 1.0f;
    trainer_count_steps(t);
    if (R > 1) {
        t->bn_host = malloc(sizeof(double) * (g->n_buffer_floats + 1));
        snCheck(t->bn_host != NULL, "out of host memory");
        if (c->sync_bn) t->net.sync_bn = t->comm;
    }
    net_init_params(&t->net, c->seed);
    t->net.seed = c->seed;
    t->best = INFINITY;
    step_stats_reset(&t->epoch_stats);
    step_stats_reset(&t->log_stats);
    return 0;
}

static int trainer_open(Trainer *t, const TrainCfg *c, const char *train, const char *val, char err[SN_ERR_MAX]) {
    return trainer_open_on(t, c, train, val, NULL, err);
}

// Local replicas read the data sets opened once (by rank 0)
static void trainer_borrow_data(Trainer *t, const Dataset *train, const Dataset *val) {
    if (train) { t->train = *train; t->has_train = 1; }
    if (val) { t->val = *val; t->has_val = 1; }
    t->borrowed_data = 1;
    trainer_count_steps(t);
}

static int comm_broadcast_backend(Trainer *t, void *buf, size_t bytes) {
    Comm *comm = t->comm;
    if (comm->size == 1 || bytes == 0) return 0;
    if (t->o == &ops_cpu) return comm->broadcast(comm, buf, bytes, 0);
    if (comm->device) return comm->device->broadcast(comm->device, buf, bytes, 0);
    void *host = malloc(bytes);
    snCheck(host != NULL, "out of host memory");
    t->o->download(t->o, host, buf, bytes);
    int rc = comm->broadcast(comm, host, bytes, 0);
    t->o->upload(t->o, buf, host, bytes);
    free(host);
    return rc;
}

// Mirrors rank 0 on every replica (at the start, after loading weights or a
// checkpoint there): parameters, BN statistics, Adam moments and the counters.
static int trainer_broadcast(Trainer *t) {
    const Graph *g = &t->g;
    struct {
        int64_t step, good_steps;
        double best;
        float loss_scale;
        int epoch, best_epoch, bad_epochs, finished;
    } k = {t->step, t->good_steps, t->best, t->loss_scale, t->epoch, t->best_epoch, t->bad_epochs, t->finished};
    if (comm_broadcast_backend(t, t->net.params, sizeof(float) * g->n_param_floats) ||
        comm_broadcast_backend(t, t->net.buffers, sizeof(float) * g->n_buffer_floats) ||
        comm_broadcast_backend(t, t->adam_m, sizeof(float) * t->n_trainable) ||
        comm_broadcast_backend(t, t->adam_v, sizeof(float) * t->n_trainable) ||
        (t->comm->size > 1 && t->comm->broadcast(t->comm, &k, sizeof k, 0)))
        return -1;
    t->step = k.step; t->good_steps = k.good_steps; t->best = k.best; t->loss_scale = k.loss_scale;
    t->epoch = k.epoch; t->best_epoch = k.best_epoch; t->bad_epochs = k.bad_epochs; t->finished = k.finished;
    return 0;
}

// The tensors a fine-tuning run may initialise instead of loading, and the
// file's tensors it may leave unused: a classifier's head (another class
// count, a hidden layer); a U-Net on an EfficientNetV2 encoder from a
// classifier's weights: its decoder and head initialised, the classifier's
// head ignored. Plus the user's --allow-missing prefixes.
static LoadRules finetune_rules(const TrainCfg *c, char *init, size_t size) {
    const char *model = c->model.model, *own = "";
    LoadRules r = {init, NULL, 0};
    if (eff_spec(model)) own = "classifier.";
    else if (!strncmp(model, "unet-", 5)) { own = "decoder.,segmentation_head."; r.ignore = "classifier."; }
    snprintf(init, size, "%s%s%s", own, own[0] && c->allow_missing ? "," : "", c->allow_missing ? c->allow_missing : "");
    return r;
}

// ref/export_pretrained.py --random writes this metadata: a trial's starting
// weights, which no one should mistake for ImageNet's
#define WEIGHTS_KIND_KEY "weights"
#define WEIGHTS_RANDOM "random"

// Loads the initial weights of a training run (rules above; the report line
// in `report`, and in *random whether the file says its weights are random),
// or, with report NULL, weights to evaluate: every tensor.
static int trainer_load_weights(Trainer *t, const char *path, char *report, int *random, char err[SN_ERR_MAX]) {
    SafetensorsFile f;
    if (safetensors_read(path, &f, err)) return -1;
    char init[SN_ERR_MAX];
    const LoadRules strict = {NULL, NULL, 0}, rules = report ? finetune_rules(t->c, init, sizeof init) : strict;
    int rc = net_load_weights_rules(&t->net, &f, path, &rules, report, err);
    const char *kind = safetensors_meta(&f, WEIGHTS_KIND_KEY);
    if (random) *random = kind && !strcmp(kind, WEIGHTS_RANDOM);
    safetensors_free(&f);
    return rc;
}

static void progress_line(const Trainer *t, int training, int batch_no, int n_batches, double t0, int64_t images,
                          const PassTotals *pt, int tty) {
    double el = now_seconds() - t0, eta = batch_no ? el / batch_no * (n_batches - batch_no) : 0.0;
    Metrics m;
    double iou[SN_MAX_CLASSES];
    m.iou = iou;
    metrics_compute(pt->cm, t->K, t->c->class_weights, &m);
    fprintf(stderr, "%sepoch %d/%d %s %d/%d  %d:%02d left  %.1f img/s  loss %.4f  %s %.4f%s",
            tty ? "\r" : "", t->epoch + 1, t->c->epochs, training ? "train" : "val", batch_no, n_batches,
            (int)eta / 60, (int)eta % 60, el > 0 ? images / el : 0.0, pt->loss_sum / pt->norm_sum,
            t->segmentation ? "mIoU" : "accuracy", t->segmentation ? m.mean_iou : m.accuracy, tty ? "\033[K" : "\n");
    fflush(stderr);
}

// steps.csv's row for the steps since the last one (every replica calls it: the loss is summed over them)
static int steps_log_row(Trainer *t, double lr) {
    StepStats *st = &t->log_stats;
    double sums[2] = {st->loss_sum, st->label_sum}, v[STEP_STATS_N_COLUMNS];
    if (t->comm->size > 1 && t->comm->allreduce_f64(t->comm, sums, 2)) return -1;
    if (t->steps_csv) {
        SfBuf row = {0};
        char s[96], lr_text[32];
        snprintf(s, sizeof s, "%" PRId64 ",%d,%s", t->step, t->epoch + 1, float_str(lr_text, (float)lr));
        sb_str(&row, s);
        csv_num(&row, sums[1] > 0 ? sums[0] / sums[1] : NAN);
        step_stats_columns(st, v);
        for (int k = 0; k < STEP_STATS_N_COLUMNS; k++) csv_sig(&row, v[k]);
        sb_str(&row, "\n");
        sb_put(&row, "", 1);
        FILE *f = row.oom ? NULL : fopen(t->steps_csv, "a");
        if (!f || fputs(row.p, f) < 0 || fclose(f)) {
            fprintf(stderr, "segnet train: warning: %s: cannot append (%s); steps.csv is not written from here on\n",
                    t->steps_csv, strerror(errno));
            free(t->steps_csv);
            t->steps_csv = NULL;
        }
        free(row.p);
    }
    step_stats_reset(st);
    return 0;
}

// Images [lo, hi) of a global batch of n images are replica r's of R: the
// shards of a full batch are equal, those of a last, smaller one differ by at
// most one image (and may be empty).
static void shard_range(int n, int R, int r, int *lo, int *hi) {
    *lo = (int)((int64_t)n * r / R);
    *hi = (int)((int64_t)n * (r + 1) / R);
}

// The replicas' sums of a pass added up: loss, normaliser, confusion matrix
static int reduce_totals(Trainer *t, PassTotals *pt) {
    Comm *comm = t->comm;
    if (comm->size == 1) return 0;
    double sums[2] = {pt->loss_sum, pt->norm_sum};
    if (comm->allreduce_f64(comm, sums, 2) || comm->allreduce_i64(comm, pt->cm, (size_t)t->K * t->K)) return -1;
    pt->loss_sum = sums[0];
    pt->norm_sum = sums[1];
    return 0;
}

// ---- interruption: the first SIGINT or SIGTERM lets the step finish, then
// the run saves where it is (last.safetensors, mid-epoch) and exits 128 +
// the signal; a second one exits at once. The files stay whole either way:
// every write is atomic (a *.tmp.<pid> left behind is removed at the next start).

// interrupt_signal (declared with the data checks, which it also stops) is the first SIGINT/SIGTERM

// Whether to stop now: 0, or the signal (every replica stops at the same
// step: one that saw none stops with the others); -1 if a replica failed.
static int interrupt_poll(Trainer *t) {
    const int hook = t->c->interrupt_at_step && t->step >= t->c->interrupt_at_step;
    int64_t any = interrupt_signal || hook;
    if (t->comm->size > 1 && t->comm->allreduce_i64(t->comm, &any, 1)) return -1;
    return !any ? 0 : interrupt_signal ? (int)interrupt_signal : hook ? SIGINT : SIGTERM;
}

// One pass over a data set: global batches of model.batch images in a shuffled
// order (training) or in order; this replica runs its shard of each. Returns
// -1 with err if the data failed here (the other replicas are told) or on
// another replica; the signal when interrupted after a step (training: t->resume_batch
// says where the pass goes on; pt holds this replica's totals so far, not
// summed over the replicas).
static int run_pass(Trainer *t, const Dataset *d, int training, PassTotals *pt, char err[SN_ERR_MAX]) {
    const TrainCfg *c = t->c;
    Ops *o = t->o;
    Net *net = &t->net;
    Comm *comm = t->comm;
    const int B = c->model.batch, N = t->shard, K = t->K, R = comm->size;
    const Shape in = t->g.tensors[t->g.input].shape;
    int *order = malloc(sizeof(int) * (size_t)(d->n ? d->n : 1)), *mine = malloc(sizeof(int) * (size_t)(d->n ? d->n : 1));
    snCheck(order && mine, "out of host memory");
    for (int i = 0; i < d->n; i++) order[i] = i;
    uint64_t epoch_seed = rng_mix64(c->seed ^ rng_mix64(0x7261696e00000000ull + (uint64_t)t->epoch));
    if (training) {  // Fisher-Yates with the epoch's own stream
        Rng r;
        rng_seed(&r, epoch_seed);
        for (int i = d->n - 1; i > 0; i--) {
            int j = (int)(rng_next(&r) % (uint64_t)(i + 1)), tmp = order[i];
            order[i] = order[j]; order[j] = tmp;
        }
    }
    // this replica's shards of the global batches, in order: the loader takes them N at a time
    const int n_batches = (d->n + B - 1) / B, start = training ? t->resume_batch : 0;
    int n_mine = 0, skip = 0, lo, hi;
    for (int j = 0; j < n_batches; j++) {
        shard_range(d->n - j * B < B ? d->n - j * B : B, R, comm->rank, &lo, &hi);
        for (int i = lo; i < hi; i++) mine[n_mine++] = order[j * B + i];
        if (j + 1 == start) skip = n_mine;  // an interrupted epoch goes on after its last step
    }
    Loader *L = n_mine > skip ? loader_start(d, mine + skip, n_mine - skip, N, training ? &c->augment : NULL,
                                             rng_mix64(epoch_seed + 1), c->workers, 4) : NULL;
    o->fill(o, tensor_f32((float *)t->confusion, shape4(2 * K * K, 1, 1, 1)), 0.0f);  // int64 zeros
    pt->loss_sum = pt->norm_sum = 0.0;
    if (training && !start) step_stats_reset(&t->epoch_stats);  // else load_checkpoint restored them
    if (start) {  // the totals of the batches before it, as this replica had them
        o->upload(o, t->confusion, t->resume_cm, sizeof(int64_t) * K * K);
        pt->loss_sum = t->resume_loss_sum;
        pt->norm_sum = t->resume_norm_sum;
        free(t->resume_cm);
        t->resume_cm = NULL;
        t->resume_batch = 0;
    }
    const int tty = isatty(STDERR_FILENO) && comm->rank == 0;
    // With replicas, progress lines are totals over all of them (a collective
    // on every replica at the same batches): a quarter of the epoch apart.
    const int every = tty && R == 1 ? 1 : (n_batches + 3) / 4;
    const size_t image_floats = (size_t)N * in.h * in.w * 3, label_count = (size_t)N * t->per_image;
    double t0 = now_seconds();
    int64_t images = 0;
    int pending = 0, rc = 0, stopped = 0, stop_signal = 0;  // pending: micro-batches gathered for the next optimiser step
    MicroBatch mb[SN_MAX_ACCUM];
    for (int j = start; j < n_batches && rc == 0 && !stopped; j++) {
        const int nj = d->n - j * B < B ? d->n - j * B : B;
        shard_range(nj, R, comm->rank, &lo, &hi);
        MicroBatch shard = {0, NULL, NULL, pending * B + lo};
        if (hi > lo) {
            const LoaderBatch *b = loader_next(L);
            if (!b) {  // a file that changed on disk since the start: this replica cannot go on
                snprintf(err, SN_ERR_MAX, "%s", loader_error(L));
                rc = -2;
                break;
            }
            snCheck(b->n == hi - lo, "the loader gave %d images for a shard of %d", b->n, hi - lo);
            shard = (MicroBatch){b->n, b->images, b->labels, pending * B + lo};
        }
        int step_rc = 0;
        t->measure_update = training && j + 1 == n_batches;  // the epoch's last step (train_step clears it)
        if (training && c->accum == 1) {
            step_rc = train_step(t, &shard, 1, pt);
        } else if (training) {  // the loader reuses its buffers: keep copies until the step
            if (shard.n) {
                memcpy(t->accum_images + pending * image_floats, shard.images, sizeof(float) * (size_t)shard.n * in.h * in.w * 3);
                memcpy(t->accum_labels + pending * label_count, shard.labels, sizeof(int32_t) * (size_t)shard.n * t->per_image);
            }
            mb[pending] = (MicroBatch){shard.n, t->accum_images + pending * image_floats, t->accum_labels + pending * label_count,
                                       shard.first};
            if (++pending == c->accum || j + 1 == n_batches) { step_rc = train_step(t, mb, pending, pt); pending = 0; }
        } else if (shard.n) {
            pt->loss_sum += eval_batch(t, &shard);
            size_t n_labels = (size_t)shard.n * t->per_image;
            pt->norm_sum += c->loss_norm_keras ? (double)n_labels : label_weight_sum(shard.labels, n_labels, c->class_weights, K);
        }
        if (step_rc < 0) { rc = -1; break; }
        if (!training || pending == 0) {  // a step (or a validation batch) is complete: stop here if asked
            const int sig = interrupt_poll(t);
            if (sig < 0) { rc = -1; break; }
            if (sig) { stopped = j + 1; stop_signal = sig; }
        }
        images += nj;
        if (c->progress && (training || (tty && R == 1)) && ((j + 1) % every == 0 || j + 1 == n_batches)) {
            o->download(o, pt->cm, t->confusion, sizeof(int64_t) * K * K);
            PassTotals now = *pt;
            if (R > 1) {
                now.cm = malloc(sizeof(int64_t) * K * K);
                snCheck(now.cm != NULL, "out of host memory");
                memcpy(now.cm, pt->cm, sizeof(int64_t) * K * K);
                rc = reduce_totals(t, &now);
            }
            if (rc == 0 && comm->rank == 0) progress_line(t, training, j + 1, n_batches, t0, images, &now, tty);
            if (R > 1) free(now.cm);
        }
    }
    if (L) loader_stop(L);
    free(order); free(mine);
    net->batch = N;
    if (stopped && rc == 0) {  // this replica's totals so far; where the pass goes on
        o->download(o, pt->cm, t->confusion, sizeof(int64_t) * K * K);
        if (training) t->resume_batch = stopped;
        if (c->progress && tty) fputs("\r\033[K", stderr);
        return stop_signal;
    }
    if (rc == -2) {  // this replica failed: the others stop at their next collective (mpi: the job ends)
        if (R > 1) {
            char why[SN_ERR_MAX];
            snprintf(why, sizeof why, "rank %d: %.480s", comm->rank, err);
            snprintf(err, SN_ERR_MAX, "%s", why);
            comm->abort(comm, err);
        }
        return -1;
    }
    o->download(o, pt->cm, t->confusion, sizeof(int64_t) * K * K);
    if (rc == 0 && reduce_totals(t, pt)) rc = -1;
    if (rc) return comm_failure(comm, err);
    if (c->progress && tty && (training || d->n)) fputs("\r\033[K", stderr);
    return 0;
}

// ---- run folder: config.txt, metrics.csv, curves.svg, checkpoints

static int write_text_atomic(const char *path, const char *text, char err[SN_ERR_MAX]) {
    const void *parts[1] = {text};
    size_t sizes[1] = {strlen(text)};
    return file_write_atomic(path, parts, sizes, 1, err);
}

static void run_path(char *buf, size_t size, const char *run, const char *file) { snprintf(buf, size, "%s/%s", run, file); }

// Checkpoint = weights and BN statistics (PyTorch layout, loadable as weights)
// + train_state.adam_m / adam_v (the trainable parameters in segnet's order)
// + the counters as metadata.
#define CHECKPOINT_KEYS 9
static const char *const CHECKPOINT_META[CHECKPOINT_KEYS] = {
    "epoch", "step", "seed", "best_loss", "best_epoch", "bad_epochs", "finished", "loss_scale", "loss_scale_good_steps"};
// An epoch interrupted part-way: the global batch its training pass goes on
// at, and each replica's totals so far (metadata "batch" and "pass_totals":
// per replica `loss_sum norm_sum cm[0] ... cm[K·K-1]` with exact hex floats,
// replicas separated by ';').
typedef struct {
    int batch, replicas, K;
    double *sums;   // (replicas, 2): loss_sum, norm_sum
    int64_t *cms;   // (replicas, K, K) confusion counts
} PassSaved;

static void pass_saved_free(PassSaved *ps) { free(ps->sums); free(ps->cms); memset(ps, 0, sizeof *ps); }

static char *pass_totals_text(const PassSaved *ps) {
    SfBuf b = {0};
    char num[64];
    for (int r = 0; r < ps->replicas; r++) {
        snprintf(num, sizeof num, "%s%a %a", r ? ";" : "", ps->sums[2 * r], ps->sums[2 * r + 1]);
        sb_str(&b, num);
        for (size_t k = 0; k < (size_t)ps->K * ps->K; k++) {
            snprintf(num, sizeof num, " %" PRId64, ps->cms[(size_t)r * ps->K * ps->K + k]);
            sb_str(&b, num);
        }
    }
    sb_put(&b, "", 1);
    snCheck(!b.oom, "out of host memory");
    return b.p;
}

static int pass_totals_parse(const char *path, const char *text, int K, PassSaved *ps, char err[SN_ERR_MAX]) {
    int R = 1;
    for (const char *p = text; *p; p++) R += *p == ';';
    if (R > SN_MAX_REPLICAS) {
        snprintf(err, SN_ERR_MAX, "%.300s: metadata 'pass_totals' holds %d replicas, more than %d (a damaged checkpoint)", path, R,
                 SN_MAX_REPLICAS);
        return -1;
    }
    const size_t KK = (size_t)K * K;
    ps->replicas = R;
    ps->K = K;
    ps->sums = malloc(sizeof(double) * 2 * (size_t)R);
    ps->cms = malloc(sizeof(int64_t) * KK * (size_t)R);
    snCheck(ps->sums && ps->cms, "out of host memory");
    const char *p = text;
    for (int r = 0; r < R; r++) {
        for (size_t k = 0; k < 2 + KK; k++) {
            char *end;
            errno = 0;
            if (k < 2) ps->sums[2 * r + k] = strtod(p, &end);
            else ps->cms[(size_t)r * KK + k - 2] = strtoll(p, &end, 10);
            const int count_ok = k < 2 || (errno != ERANGE && ps->cms[(size_t)r * KK + k - 2] >= 0);
            const char sep = k + 1 < 2 + KK ? ' ' : r + 1 < R ? ';' : 0;
            if (end == p || *p == ' ' || !count_ok || *end != sep) {
                snprintf(err, SN_ERR_MAX, "%.300s: metadata 'pass_totals': replica %d, item %zu is not what %d classes need "
                         "(a damaged checkpoint)", path, r, k + 1, K);
                return -1;
            }
            p = end + (sep != 0);
        }
    }
    return 0;
}

// Whether the model is finite: its weights, batch-norm statistics and Adam's
// moments (one flag over all of them on the backend, one download). If not,
// -1 and `which` names the first tensor holding a NaN or inf (found on the
// host) and how many of its values are. Nothing non-finite is ever saved.
static int model_finite(Trainer *t, char which[SN_ERR_MAX]) {
    Ops *o = t->o;
    const Graph *g = &t->g;
    const size_t T = t->n_trainable;
    const struct { const float *data; size_t n; } parts[4] = {
        {t->net.params, g->n_param_floats}, {t->net.buffers, g->n_buffer_floats}, {t->adam_m, T}, {t->adam_v, T}};
    int32_t flag = 0;
    o->upload(o, t->nonfinite, &flag, sizeof flag);
    for (int k = 0; k < 4; k++)
        if (parts[k].n) o->nonfinite(o, tensor_f32((float *)parts[k].data, shape4((int)parts[k].n, 1, 1, 1)), t->nonfinite);
    o->download(o, &flag, t->nonfinite, sizeof flag);
    if (!flag) return 0;
    snprintf(which, SN_ERR_MAX, "a tensor holds NaN or inf");  // unless one is found below (the flag is all the backend says)
    for (int k = 0; k < 4; k++) {
        float *host = malloc(sizeof(float) * (parts[k].n ? parts[k].n : 1));
        snCheck(host != NULL, "out of host memory");
        o->download(o, host, parts[k].data, sizeof(float) * parts[k].n);
        const int n_tensors = k == 0 || k >= 2 ? g->n_params : g->n_buffers;
        for (int i = 0; i < n_tensors; i++) {
            const ParamInfo *p = k == 1 ? &g->buffers[i] : &g->params[i];
            const size_t at = k < 2 ? p->offset : t->net.grad_offset[i];
            if (k >= 2 && at == SIZE_MAX) continue;  // frozen: no moments
            size_t bad = 0;
            for (size_t j = 0; j < p->count; j++) bad += !isfinite(host[at + j]);
            if (!bad) continue;
            snprintf(which, SN_ERR_MAX, "%s%.200s holds NaN or inf (%zu of its %zu values)",
                     k == 2 ? "Adam's first moment of " : k == 3 ? "Adam's second moment of " : "", p->name, bad, p->count);
            free(host);
            return -1;
        }
        free(host);
    }
    return -1;
}

// ---- what a checkpoint's place in the run depends on
//
// A checkpoint records the training set it was made with (RESUME_DATA_KEY:
// the count of samples and an FNV-1a hash of their files' names under the
// data folder, sizes and labels, in order) and the settings that shape each
// step (RESUME_SETTINGS_KEY, `--flag=value` items). --resume compares them
// with its own. What the monitored loss measures (size, class weights, loss
// normalisation, the monitor) stays for the whole run, so that "best"
// compares like with like. The batch, accumulation, augmentation and the
// data may change between epochs (said), never inside one: an interrupted
// epoch's place (its batch, its shuffled order) means nothing under others.

#define RESUME_DATA_KEY     "data"
#define RESUME_SETTINGS_KEY "settings"
static const char *const RESUME_FIXED[] = {"size", "class-weights", "loss-norm", "monitor"};

// the settings that shape a step, `--flag=value` items separated by spaces (NUL-terminated, malloc'd)
static char *step_settings_text(const TrainCfg *c) {
    SfBuf b = {0};
    char s[160];
    snprintf(s, sizeof s, "size=%dx%d loss-norm=%s monitor=%s batch=%d accum=%d class-weights=", c->model.height,
             c->model.width, c->loss_norm_keras ? "keras" : "weighted", monitor_name(c), c->model.batch, c->accum);
    sb_str(&b, s);
    class_weights_text(c, &b);
    sb_str(&b, " augment=");
    augment_text(&c->augment, &b);
    sb_put(&b, "", 1);
    snCheck(!b.oom, "out of host memory");
    return b.p;
}

// setting `key`'s value in a settings text (its own, up to the next space), or NULL
static const char *setting_in(const char *text, const char *key, int *len) {
    const size_t k = strlen(key);
    for (const char *p = text; p && *p; p = strchr(p, ' '), p = p ? p + 1 : p)
        if (!strncmp(p, key, k) && p[k] == '=') {
            *len = (int)strcspn(p + k + 1, " ");
            return p + k + 1;
        }
    return NULL;
}

// A checkpoint's data and settings against this run's (see above): -1 with err
// for a change that may not happen now (mid: the checkpoint is inside an
// epoch), else 0, the changes said on stderr. A checkpoint from before they
// were recorded is taken as it is.
static int resume_compare(const Trainer *t, const char *path, const SafetensorsFile *f, int mid, char err[SN_ERR_MAX]) {
    const char *saved = safetensors_meta(f, RESUME_SETTINGS_KEY), *data = safetensors_meta(f, RESUME_DATA_KEY);
    const int epoch = t->epoch + 1;  // the epoch that goes on (mid) or starts
    int rc = 0;
    if (saved) {
        char *now = step_settings_text(t->c);
        for (const char *p = now; rc == 0 && *p;) {
            const int klen = (int)strcspn(p, "="), vlen = (int)strcspn(p + klen + 1, " ");
            char key[32];
            snprintf(key, sizeof key, "%.*s", klen, p);
            const char *value = p + klen + 1;
            p = value + vlen + (value[vlen] == ' ');
            int was_len;
            const char *was = setting_in(saved, key, &was_len);
            if (!was || (was_len == vlen && !memcmp(was, value, (size_t)vlen))) continue;
            int fixed = 0;
            for (size_t k = 0; k < sizeof RESUME_FIXED / sizeof *RESUME_FIXED; k++) fixed |= !strcmp(key, RESUME_FIXED[k]);
            if (fixed) {
                snprintf(err, SN_ERR_MAX, "%.150s: --%s %.*s, but the run was trained with %.*s: it defines the loss that "
                         "best.safetensors is judged by, so it stays for the whole run (a new run can start from the "
                         "weights: --weights RUN/best.safetensors)", path, key, vlen > 40 ? 40 : vlen, value,
                         was_len > 40 ? 40 : was_len, was);
                rc = -1;
            } else if (mid) {
                snprintf(err, SN_ERR_MAX, "%.150s: --%s %.*s, but the run was interrupted inside epoch %d with %.*s: that "
                         "epoch goes on only as it began (resume without the change; it may change between epochs)", path,
                         key, vlen > 40 ? 40 : vlen, value, epoch, was_len > 40 ? 40 : was_len, was);
                rc = -1;
            } else if (t->c->progress) {
                fprintf(stderr, "segnet train: --%s %.*s from epoch %d on (until now %.*s)\n", key, vlen, value, epoch,
                        was_len, was);
            }
        }
        free(now);
    }
    if (rc == 0 && data && t->has_train) {
        char now[64];
        data_fingerprint(&t->train, t->c->data, now);
        int was_n = 0, now_n = atoi(now);
        sscanf(data, "%d", &was_n);
        if (strcmp(data, now)) {
            char what[160];
            if (was_n != now_n) snprintf(what, sizeof what, "%d samples, the run's had %d", now_n, was_n);
            else snprintf(what, sizeof what, "%d samples as before, but not the same files (names, sizes or labels)", now_n);
            if (mid) {
                snprintf(err, SN_ERR_MAX, "%.120s: the training set %.100s has %.100s: the run was interrupted inside epoch %d, "
                         "whose order and place are those of its data (restore it to finish the epoch)", path, t->c->data,
                         what, epoch);
                rc = -1;
            } else if (t->c->progress) {
                fprintf(stderr, "segnet train: the training set %s has changed since the last checkpoint: %s; it is used "
                        "from epoch %d on\n", t->c->data, what, epoch);
            }
        }
    }
    return rc;
}

static int save_checkpoint(const Trainer *t, const char *path, const PassSaved *ps, char err[SN_ERR_MAX]) {
    Ops *o = t->o;
    size_t P = t->n_trainable;
    float *m = malloc(sizeof(float) * (P ? P : 1)), *v = malloc(sizeof(float) * (P ? P : 1));
    snCheck(m && v, "out of host memory");
    o->download(o, m, t->adam_m, sizeof(float) * P);
    o->download(o, v, t->adam_v, sizeof(float) * P);
    SafetensorsTensor extra[2];
    memset(extra, 0, sizeof extra);
    for (int k = 0; k < 2; k++) {
        snprintf(extra[k].name, sizeof extra[k].name, TRAIN_STATE_PREFIX "%s", k ? "adam_v" : "adam_m");
        extra[k].dtype = DT_F32;
        extra[k].ndim = 1;
        extra[k].dims[0] = (int64_t)P;
        extra[k].numel = P;
        extra[k].data = k ? v : m;
    }
    char vals[9][64];
    snprintf(vals[0], 64, "%d", t->epoch);
    snprintf(vals[1], 64, "%" PRId64, t->step);
    snprintf(vals[2], 64, "%" PRIu64, t->c->seed);
    snprintf(vals[3], 64, "%a", t->best);  // hex float: exact
    snprintf(vals[4], 64, "%d", t->best_epoch);
    snprintf(vals[5], 64, "%d", t->bad_epochs);
    snprintf(vals[6], 64, "%d", t->finished);
    snprintf(vals[7], 64, "%a", (double)t->loss_scale);
    snprintf(vals[8], 64, "%" PRId64, t->good_steps);
    // the required keys, then "padding" (weights_padding reads it; older checkpoints lack it),
    // then an interrupted epoch's position
    const char *keys[CHECKPOINT_KEYS + 7], *values[CHECKPOINT_KEYS + 7];
    for (int k = 0; k < CHECKPOINT_KEYS; k++) { keys[k] = CHECKPOINT_META[k]; values[k] = vals[k]; }
    int n_keys = CHECKPOINT_KEYS;
    keys[n_keys] = "padding";
    values[n_keys++] = PAD_NAME[t->c->model.pad];
    char *settings = step_settings_text(t->c);
    keys[n_keys] = RESUME_SETTINGS_KEY; values[n_keys++] = settings;
    if (t->has_train) { keys[n_keys] = RESUME_DATA_KEY; values[n_keys++] = t->data_print; }
    char batch[32], *totals = NULL, epoch_stats[512], log_stats[512];
    if (ps) {
        snprintf(batch, sizeof batch, "%d", ps->batch);
        totals = pass_totals_text(ps);
        step_stats_text(&t->epoch_stats, epoch_stats, sizeof epoch_stats);
        keys[n_keys] = "batch"; values[n_keys++] = batch;
        keys[n_keys] = "pass_totals"; values[n_keys++] = totals;
        keys[n_keys] = "epoch_stats"; values[n_keys++] = epoch_stats;
    }
    if (t->c->log_every > 0) {  // the steps since steps.csv's last row (they may span epochs)
        step_stats_text(&t->log_stats, log_stats, sizeof log_stats);
        keys[n_keys] = "log_stats"; values[n_keys++] = log_stats;
    }
    int rc = net_save_checkpoint(&t->net, path, extra, 2, keys, values, n_keys, err);
    free(m); free(v); free(totals); free(settings);
    return rc;
}

// A checkpoint's metadata is input like any file: each counter an integer in
// its range, each figure a number, or the checkpoint is refused naming both.
static int meta_int(const char *path, const char *key, const char *text, int64_t lo, int64_t hi, int64_t *v,
                    char err[SN_ERR_MAX]) {
    char *end;
    errno = 0;
    long long x = strtoll(text, &end, 10);
    if (!text[0] || *end || errno == ERANGE || x < lo || x > hi || isspace((unsigned char)text[0])) {
        snprintf(err, SN_ERR_MAX, "%.400s: metadata '%s' is '%.40s', not an integer in %" PRId64 "..%" PRId64 " (a damaged checkpoint)",
                 path, key, text, lo, hi);
        return -1;
    }
    *v = x;
    return 0;
}
static int meta_num(const char *path, const char *key, const char *text, double *v, char err[SN_ERR_MAX]) {
    char *end;
    *v = strtod(text, &end);
    if (!text[0] || *end || isnan(*v) || isspace((unsigned char)text[0])) {
        snprintf(err, SN_ERR_MAX, "%.400s: metadata '%s' is '%.40s', not a number (a damaged checkpoint)", path, key, text);
        return -1;
    }
    return 0;
}

// The counters of a checkpoint, read and range-checked before anything changes.
typedef struct {
    int64_t epoch, step, best_epoch, bad_epochs, finished, good_steps;
    double best, loss_scale;
} CheckpointCounters;

static int checkpoint_counters(const char *path, const char *const val[CHECKPOINT_KEYS], CheckpointCounters *k,
                               char err[SN_ERR_MAX]) {
    const int64_t most = (int64_t)1 << 53;  // exact in a double: steps and epochs of any real run
    if (meta_int(path, "epoch", val[0], 0, INT32_MAX - 1, &k->epoch, err) ||
        meta_int(path, "step", val[1], 0, most, &k->step, err) ||
        meta_num(path, "best_loss", val[3], &k->best, err) ||
        meta_int(path, "best_epoch", val[4], 0, k->epoch, &k->best_epoch, err) ||
        meta_int(path, "bad_epochs", val[5], 0, k->epoch, &k->bad_epochs, err) ||
        meta_int(path, "finished", val[6], 0, 1, &k->finished, err) ||
        meta_num(path, "loss_scale", val[7], &k->loss_scale, err) ||
        meta_int(path, "loss_scale_good_steps", val[8], 0, k->step, &k->good_steps, err))
        return -1;
    if (!(k->loss_scale > 0.0 && k->loss_scale <= FLT_MAX)) {
        snprintf(err, SN_ERR_MAX, "%.300s: metadata 'loss_scale' is '%.40s', not a positive float (a damaged checkpoint)", path, val[7]);
        return -1;
    }
    if ((k->best_epoch == 0) != (k->best == INFINITY)) {  // no best epoch yet exactly when nothing was finite
        snprintf(err, SN_ERR_MAX, "%.300s: metadata 'best_loss' '%.40s' does not fit 'best_epoch' %" PRId64 " (a damaged checkpoint)",
                 path, val[3], k->best_epoch);
        return -1;
    }
    return 0;
}

// Restores everything save_checkpoint wrote; checks it all before changing
// anything. An interrupted epoch's position goes to ps (batch 0 if none).
static int load_checkpoint(Trainer *t, const char *path, PassSaved *ps, char err[SN_ERR_MAX]) {
    SafetensorsFile f;
    if (safetensors_read(path, &f, err)) return -1;
    size_t P = t->n_trainable;
    const SafetensorsTensor *m = safetensors_find(&f, TRAIN_STATE_PREFIX "adam_m"), *v = safetensors_find(&f, TRAIN_STATE_PREFIX "adam_v");
    const char *val[CHECKPOINT_KEYS];
    CheckpointCounters k;
    int rc = -1;
    for (int i = 0; i < CHECKPOINT_KEYS; i++)
        if (!(val[i] = safetensors_meta(&f, CHECKPOINT_META[i]))) {
            snprintf(err, SN_ERR_MAX, "%.400s: not a segnet checkpoint (no '%s' in its metadata)", path, CHECKPOINT_META[i]);
            goto done;
        }
    const LoadRules check = {NULL, NULL, 1};  // the model's tensors first: an edited config.txt shows here
    if (net_load_weights_rules(&t->net, &f, path, &check, NULL, err)) {
        const size_t len = strlen(err);
        snprintf(err + len, SN_ERR_MAX - len, " (the model of config.txt and the options is not the run's?)");
        goto done;
    }
    if (!m || !v || m->numel != P || v->numel != P || m->dtype != DT_F32 || v->dtype != DT_F32) {
        snprintf(err, SN_ERR_MAX, "%.400s: the optimiser state (" TRAIN_STATE_PREFIX "adam_m/adam_v, %zu floats each) is missing or of another size",
                 path, P);
        goto done;
    }
    char seed_text[32];
    snprintf(seed_text, sizeof seed_text, "%" PRIu64, t->c->seed);
    if (strcmp(val[2], seed_text)) {
        snprintf(err, SN_ERR_MAX, "--seed %s, but the run was trained with seed %.40s (%.200s): a resumed run keeps its "
                 "seed, which its data order, augmentation and dropout follow", seed_text, val[2], path);
        goto done;
    }
    if (checkpoint_counters(path, val, &k, err)) goto done;
    const char *batch = safetensors_meta(&f, "batch"), *totals = safetensors_meta(&f, "pass_totals");
    t->epoch = (int)k.epoch;  // for resume_compare's messages (restored with the rest below)
    if (resume_compare(t, path, &f, batch || totals, err)) goto done;
    memset(ps, 0, sizeof *ps);
    if (batch || totals) {
        const int n_batches = (t->train.n + t->c->model.batch - 1) / t->c->model.batch;
        int64_t b;
        if (!batch || !totals) {
            snprintf(err, SN_ERR_MAX, "%.300s: metadata has '%s' without '%s' (a damaged checkpoint)", path,
                     batch ? "batch" : "pass_totals", batch ? "pass_totals" : "batch");
            goto done;
        }
        if (meta_int(path, "batch", batch, 1, INT32_MAX, &b, err)) goto done;
        if (b > n_batches || (b < n_batches && b % t->c->accum)) {
            snprintf(err, SN_ERR_MAX, "%.300s: interrupted at batch %" PRId64 " of an epoch, but the training set has %d batches of %d%s "
                     "(its images changed, or --accum?)", path, b, n_batches, t->c->model.batch,
                     t->c->accum > 1 ? " in steps of --accum" : "");
            goto done;
        }
        ps->batch = (int)b;
        if (pass_totals_parse(path, totals, t->K, ps, err)) { pass_saved_free(ps); goto done; }
    }
    // the diagnostics so far (a checkpoint without them: from here on)
    const char *epoch_stats = safetensors_meta(&f, "epoch_stats"), *log_stats = safetensors_meta(&f, "log_stats");
    StepStats es, ls;
    step_stats_reset(&es);
    step_stats_reset(&ls);
    if ((epoch_stats && step_stats_parse(path, "epoch_stats", epoch_stats, &es, err)) ||
        (log_stats && step_stats_parse(path, "log_stats", log_stats, &ls, err))) {
        pass_saved_free(ps);
        goto done;
    }
    float *host_m = malloc(sizeof(float) * (P ? P : 1)), *host_v = malloc(sizeof(float) * (P ? P : 1));
    snCheck(host_m && host_v, "out of host memory");
    safetensors_tensor_f32(m, host_m);
    safetensors_tensor_f32(v, host_v);
    size_t bad = P;  // Adam's second moment is a mean of squares: never negative
    for (size_t i = 0; i < P && bad == P; i++) if (!isfinite(host_m[i]) || !isfinite(host_v[i]) || host_v[i] < 0.0f) bad = i;
    if (bad < P)
        snprintf(err, SN_ERR_MAX, "%.300s: the optimiser state holds m = %g, v = %g at element %zu: not finite, or a negative "
                 "second moment (a damaged checkpoint)", path, host_m[bad], host_v[bad], bad);
    if (bad < P || net_load_weights(&t->net, &f, path, NULL, 0, err)) {
        free(host_m); free(host_v);
        pass_saved_free(ps);
        goto done;
    }
    t->o->upload(t->o, t->adam_m, host_m, sizeof(float) * P);
    t->o->upload(t->o, t->adam_v, host_v, sizeof(float) * P);
    free(host_m); free(host_v);
    t->epoch = (int)k.epoch;
    t->step = k.step;
    t->best = k.best;
    t->best_epoch = (int)k.best_epoch;
    t->bad_epochs = (int)k.bad_epochs;
    t->finished = (int)k.finished;
    t->loss_scale = (float)k.loss_scale;
    t->good_steps = k.good_steps;
    t->epoch_stats = es;
    t->log_stats = ls;
    rc = 0;
done:
    safetensors_free(&f);
    return rc;
}

// metrics.csv: epoch,lr,loss,val_loss, then the metrics (train, then val)
typedef struct {
    char **rows; EpochRecord *rec; int n, cap;
} History;

static void history_free(History *h) {
    for (int i = 0; i < h->n; i++) free(h->rows[i]);
    free(h->rows); free(h->rec);
    memset(h, 0, sizeof *h);
}

// the header; without `diagnostics` that of the runs written before the diagnostics' columns
static void csv_header(const Trainer *t, SfBuf *b, int diagnostics) {
    sb_str(b, "epoch,lr,loss,val_loss");
    char name[64];
    for (int pass = 0; pass < 2; pass++) {
        const char *p = pass ? "val_" : "";
        if (!t->segmentation) { snprintf(name, sizeof name, ",%saccuracy", p); sb_str(b, name); continue; }
        snprintf(name, sizeof name, ",%smIoU,%spixel_accuracy", p, p);
        sb_str(b, name);
        for (int k = 0; k < t->K; k++) { snprintf(name, sizeof name, ",%sIoU_%d", p, k); sb_str(b, name); }
    }
    if (diagnostics) { sb_str(b, ","); sb_str(b, STEP_STATS_COLUMNS); }
}

static void csv_metrics(const Trainer *t, SfBuf *b, const Metrics *m) {
    if (!t->segmentation) { csv_num(b, m ? m->accuracy : NAN); return; }
    csv_num(b, m ? m->mean_iou : NAN);
    csv_num(b, m ? m->accuracy : NAN);
    for (int k = 0; k < t->K; k++) csv_num(b, m ? m->iou[k] : NAN);
}

static void history_add(History *h, char *row, EpochRecord rec) {
    if (h->n == h->cap) {
        h->cap = h->cap ? 2 * h->cap : 16;
        h->rows = realloc(h->rows, sizeof(char *) * h->cap);
        h->rec = realloc(h->rec, sizeof(EpochRecord) * h->cap);
        snCheck(h->rows && h->rec, "out of host memory");
    }
    h->rows[h->n] = row;
    h->rec[h->n++] = rec;
}

// Reads back the rows of epochs 1..t->epoch (a resumed run), checking the header.
// A file from before the diagnostics' columns gets them empty.
static int history_load(const Trainer *t, const char *path, History *h, char err[SN_ERR_MAX]) {
    FILE *f = fopen_regular(path, "r", err);
    if (!f && errno == ENOENT && t->epoch == 0) return 0;  // interrupted in its first epoch
    if (!f) return -1;
    SfBuf want = {0}, older = {0};
    csv_header(t, &want, 1);
    csv_header(t, &older, 0);
    sb_put(&want, "", 1);
    sb_put(&older, "", 1);
    size_t cap = 1 << 16;
    char *line = malloc(cap);
    snCheck(line != NULL, "out of host memory");
    int rc = 0, row = 0, pad = 0;
    const int per_pass = t->segmentation ? 2 + t->K : 1, val_col = 4 + per_pass, diag_col = 4 + 2 * per_pass;
    while (rc == 0 && fgets(line, (int)cap, f)) {
        row++;
        line[strcspn(line, "\r\n")] = 0;
        if (row == 1) {
            pad = !strcmp(line, older.p);
            if (!pad && strcmp(line, want.p)) {
                snprintf(err, SN_ERR_MAX, "%.400s: the header does not match this run's model and classes", path);
                rc = -1;
            }
            continue;
        }
        double v[5 + STEP_STATS_N_COLUMNS];
        int cols[5 + STEP_STATS_N_COLUMNS] = {1, 2, 3, 4, val_col}, epoch = atoi(line);
        for (int k = 0; k < STEP_STATS_N_COLUMNS; k++) cols[5 + k] = diag_col + k;
        if (epoch != row - 1) { snprintf(err, SN_ERR_MAX, "%.400s: row %d: expected epoch %d", path, row, row - 1); rc = -1; break; }
        if (epoch > t->epoch) break;  // written after the checkpoint: that epoch runs again
        for (int k = 0; k < 5 + STEP_STATS_N_COLUMNS; k++) {
            const char *s = line;
            for (int col = 0; col < cols[k] && s; col++) { s = strchr(s, ','); if (s) s++; }
            v[k] = s && *s && *s != ',' ? strtod(s, NULL) : NAN;
        }
        EpochRecord r = {epoch, v[0], v[1], v[2], v[3], v[4], v[5], v[6], v[7], v[8], v[9], v[10], v[11]};
        const size_t len = strlen(line), empty = pad ? STEP_STATS_N_COLUMNS : 0;  // the diagnostics, empty
        char *kept = malloc(len + empty + 1);
        snCheck(kept != NULL, "out of host memory");
        memcpy(kept, line, len);
        memset(kept + len, ',', empty);
        kept[len + empty] = 0;
        history_add(h, kept, r);
    }
    if (rc == 0 && h->n != t->epoch) { snprintf(err, SN_ERR_MAX, "%.400s: holds %d epochs, the checkpoint %d", path, h->n, t->epoch); rc = -1; }
    fclose(f);
    free(line);
    free(want.p);
    free(older.p);
    return rc;
}

// The checkpoint's best figure must be metrics.csv's at its best epoch (the
// file keeps 6 decimals: within 5e-7, plus the double's own rounding).
static double monitored(const TrainCfg *c, const EpochRecord *r, int has_val) {
    const double metric = has_val ? r->val_metric : r->metric;
    return c->monitor_metric ? -metric : has_val ? r->val_loss : r->loss;
}
static int history_check_best(const Trainer *t, const History *h, const char *run, char err[SN_ERR_MAX]) {
    if (t->best_epoch == 0) return 0;
    const double want = monitored(t->c, &h->rec[t->best_epoch - 1], t->has_val);
    if (fabs(want - t->best) <= 1e-6 + 1e-9 * fabs(want)) return 0;
    snprintf(err, SN_ERR_MAX, "%.300s/last.safetensors: metadata 'best_loss' is %.6g, but metrics.csv's epoch %d (its best_epoch) "
             "has %.6g (a damaged checkpoint)", run, t->best, t->best_epoch, want);
    return -1;
}

static int history_write(const Trainer *t, const History *h, const char *run, char err[SN_ERR_MAX]) {
    SfBuf b = {0};
    csv_header(t, &b, 1);
    sb_str(&b, "\n");
    for (int i = 0; i < h->n; i++) { sb_str(&b, h->rows[i]); sb_str(&b, "\n"); }
    sb_put(&b, "", 1);
    char path[4200];
    run_path(path, sizeof path, run, "metrics.csv");
    int rc = b.oom ? -1 : write_text_atomic(path, b.p, err);
    free(b.p);
    if (rc) return rc;
    run_path(path, sizeof path, run, "curves.svg");
    const CurveMarks marks = {t->best_epoch, t->c->clipnorm};
    return write_curves_svg(path, h->rec, h->n, t->segmentation ? "mIoU" : "accuracy", &marks, err);
}

// steps.csv (--log-every): its header, then the rows that steps_log_row appends.
// A resumed run keeps the whole rows of the steps its checkpoint holds and
// drops the rest (written after it, or cut by a crash), rewriting the file
// atomically; then appends.
static const char *const STEPS_CSV_HEADER = "step,epoch,lr,loss,";
static int steps_csv_start(Trainer *t, const char *run, char err[SN_ERR_MAX]) {
    char path[4200];
    run_path(path, sizeof path, run, "steps.csv");
    SfBuf b = {0};
    sb_str(&b, STEPS_CSV_HEADER);
    sb_str(&b, STEP_STATS_COLUMNS);
    sb_str(&b, "\n");
    const size_t header_len = b.n;
    size_t n = 0;
    char unread[SN_ERR_MAX];  // absent or unreadable: the file starts again
    char *old = t->step > 0 ? (char *)file_read_regular(path, (size_t)1 << 40, &n, unread) : NULL;
    if (old && n >= header_len && !memcmp(old, b.p, header_len)) {
        for (size_t i = header_len; i < n;) {
            const char *nl = memchr(old + i, '\n', n - i);
            if (!nl) break;  // a row cut short
            char *end;
            const long long step = strtoll(old + i, &end, 10);
            if (end == old + i || *end != ',' || step < 1 || step > t->step) break;
            sb_put(&b, old + i, (size_t)(nl + 1 - (old + i)));
            i = (size_t)(nl + 1 - old);
        }
    }
    free(old);
    sb_put(&b, "", 1);
    int rc = b.oom ? -1 : write_text_atomic(path, b.p, err);
    free(b.p);
    if (rc == 0) {
        t->steps_csv = strdup(path);
        snCheck(t->steps_csv != NULL, "out of host memory");
    }
    return rc;
}

// What a user can act on, printed once per run at the first epoch where it holds (warned[k]).
static void training_warnings(const Trainer *t, const EpochRecord *r, const EpochRecord *prev, int warned[3]) {
    const TrainCfg *c = t->c;
    const StepStats *st = &t->epoch_stats;
    if (!warned[0] && c->clipnorm > 0.0f && st->steps && st->clipped > WARN_CLIP_FRACTION * (double)st->steps) {
        warned[0] = 1;
        fprintf(stderr, "segnet train: warning: epoch %d: --clipnorm %g scaled down the gradients of %.0f%% of the steps "
                "(gradient norm: mean %.3g, max %.3g). Clipping that acts on most steps no longer catches spikes: it "
                "rescales every update, which under Adam weighs the steps with large gradients down against the others; "
                "a threshold above the typical norm, e.g. --clipnorm %.2g (twice the mean), clips only the spikes.\n",
                r->epoch, c->clipnorm, 100.0 * r->clip_fraction, r->grad_norm_mean, r->grad_norm_max, 2 * r->grad_norm_mean);
    }
    if (!warned[1] && st->steps && (st->skipped > WARN_SKIP_FRACTION * (double)st->steps || st->skip_run_max > WARN_SKIP_RUN)) {
        warned[1] = 1;
        fprintf(stderr, "segnet train: warning: epoch %d: fp16 overflow skipped %" PRId64 " of %" PRId64 " steps (%" PRId64
                " in a row at most, the loss scale halved each time; %g now). Every skipped step is an update lost; "
                "if it goes on, --precision bf16 has fp32's range and needs no loss scaling.\n",
                r->epoch, st->skipped, st->steps, st->skip_run_max, r->loss_scale);
    }
    // from the second epoch on: the first one's average lags its end (the weights move most then)
    const double gap = WARN_TRAIN_MODE_GAP;
    const int below = r->epoch > 1 && r->metric < r->val_metric - gap;
    const int falling = prev && r->metric < prev->metric - gap && !(r->val_metric < prev->val_metric - gap);
    if (!warned[2] && !c->train_eval && t->has_val && (below || falling)) {
        warned[2] = 1;
        const char *name = t->segmentation ? "mIoU" : "accuracy";
        if (below)
            fprintf(stderr, "segnet train: note: epoch %d: train %s %.3f is below val_%s %.3f.", r->epoch, name, r->metric,
                    name, r->val_metric);
        else
            fprintf(stderr, "segnet train: note: epoch %d: train %s fell from %.3f to %.3f while val_%s held (%.3f).",
                    r->epoch, name, prev->metric, r->metric, name, r->val_metric);
        fprintf(stderr, " Train figures are measured while training (dropout on, batch norm with each batch's "
                "statistics, the weights changing through the epoch); validation in inference mode with the epoch's "
                "final weights. --train-eval measures the training set in inference mode at each epoch's end, so the "
                "two curves compare like with like.\n");
    }
}

// RUN/classes.txt: class k's name on line k+1, when the training set names its
// classes (class folders, a CSV's text labels); predict --run reads it back
#define CLASSES_FILE "classes.txt"
static int write_class_names(const Dataset *d, const char *run, char err[SN_ERR_MAX]) {
    if (!d->names) return 0;
    SfBuf b = {0};
    for (int k = 0; k < d->n_names; k++) {
        if (strpbrk(d->names[k], "\r\n")) {
            snprintf(err, SN_ERR_MAX, "class name '%.100s' contains a line break", d->names[k]);
            free(b.p);
            return -1;
        }
        sb_str(&b, d->names[k]);
        sb_str(&b, "\n");
    }
    sb_put(&b, "", 1);  // the terminator
    char path[4200];
    run_path(path, sizeof path, run, CLASSES_FILE);
    int rc = b.oom ? -1 : write_text_atomic(path, b.p, err);
    free(b.p);
    return rc;
}
// the names RUN/classes.txt lists (0 and NULL when there is none)
static int read_class_names(const char *run, char ***names) {
    char path[4200], line[4096];
    run_path(path, sizeof path, run, CLASSES_FILE);
    *names = NULL;
    char err[SN_ERR_MAX];
    FILE *f = fopen_regular(path, "r", err);
    if (!f) return 0;
    int n = 0, cap = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            *names = realloc(*names, sizeof(char *) * (size_t)cap);
            snCheck(*names != NULL, "out of host memory");
        }
        (*names)[n] = strdup(line);
        snCheck((*names)[n++] != NULL, "out of host memory");
    }
    fclose(f);
    return n;
}

// config.txt: `key = value`, one per setting, the keys being the train
// flags without their dashes, so that --resume can read it back as flags.
static void config_text(const TrainCfg *c, SfBuf *b) {
    char s[512];
    const ModelCfg *m = &c->model;
#define CFG(...) do { snprintf(s, sizeof s, __VA_ARGS__); sb_str(b, s); } while (0)
    CFG("# segnet train settings: `segnet train --resume RUN` continues with these\n");
    CFG("model = %s\nclasses = %d\nsize = %dx%d\nbatch = %d\n", m->model, m->classes, m->height, m->width, m->batch);
    CFG("padding = %s\n", PAD_NAME[m->pad]);
    if (model_is_classifier(m->model)) CFG("head-hidden = %d\n", m->head_hidden);
    if (!strcmp(m->model, "unet")) CFG("depth = %d\nwidth = %d\n", m->depth, m->width_base);
    char d[32];
    if (m->dropout >= 0.0f) CFG("dropout = %s\n", float_str(d, m->dropout));
    // absolute: --resume and predict --run work from any folder
    const char *keys[3] = {"data", "val", "weights"}, *paths[3] = {c->data, c->val, c->weights};
    for (int k = 0; k < 3; k++) {
        if (!paths[k]) continue;
        char abs[PATH_MAX];
        sb_str(b, keys[k]);
        sb_str(b, " = ");
        sb_str(b, realpath(paths[k], abs) ? abs : paths[k]);
        sb_str(b, "\n");
    }
    if (c->allow_missing) CFG("allow-missing = %s\n", c->allow_missing);
    char f[4][32];
    sb_str(b, "class-weights = ");
    class_weights_text(c, b);
    CFG("\nepochs = %d\nlr = %s\nadam-eps = %s\nweight-decay = %s\nclipnorm = %s\n", c->epochs, float_str(f[0], c->lr),
        float_str(f[1], c->adam_eps), float_str(f[2], c->weight_decay), float_str(f[3], c->clipnorm));
    CFG("schedule = %s\nwarmup = %d\nearly-stopping = %d\n", c->schedule == SCHEDULE_COSINE ? "cosine" : "constant",
        c->warmup, c->patience);
    CFG("monitor = %s\nmin-delta = %s\n", monitor_name(c), float_str(f[0], c->min_delta));
    sb_str(b, "augment = ");
    augment_text(&c->augment, b);
    CFG("\nloss-norm = %s\nseed = %" PRIu64 "\n", c->loss_norm_keras ? "keras" : "weighted", c->seed);
    CFG("precision = %s\naccum = %d\nfreeze = %s\nunfreeze-last = %d\ncheckpoint = %s\n", DTYPE_NAMES[c->precision],
        c->accum, c->freeze_base ? "base" : "none", c->unfreeze_last, c->checkpoint ? "blocks" : "none");
    CFG("device = %s\n", DEVICE_NAMES[c->device]);  // as asked (auto stays auto: a resumed run may move)
    // the replica count is not a setting of the run: any count (or mpirun) continues it
    CFG("sync-bn = %s\n", c->sync_bn ? "on" : "off");
    CFG("log-every = %d\ntrain-eval = %s\n", c->log_every, c->train_eval ? "on" : "off");
    CFG("exif = %s\n", EXIF_MODE_NAMES[image_exif]);  // process-wide, as --max-pixels, but it changes what the run sees
#undef CFG
}

static int write_config(const TrainCfg *c, const char *run, char err[SN_ERR_MAX]) {
    SfBuf b = {0};
    config_text(c, &b);
    sb_put(&b, "", 1);
    char path[4200];
    run_path(path, sizeof path, run, "config.txt");
    int rc = b.oom ? -1 : write_text_atomic(path, b.p, err);
    free(b.p);
    return rc;
}

static int mkdir_p(const char *path, char err[SN_ERR_MAX]) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1;; p++) {
        int end = *p == 0;
        if (*p == '/' || end) {
            *p = 0;
            if (mkdir(buf, 0755) && errno != EEXIST) { snprintf(err, SN_ERR_MAX, "%.400s: cannot create: %s", buf, strerror(errno)); return -1; }
            if (end) break;
            *p = '/';
        }
    }
    struct stat sb;
    if (stat(path, &sb) || !S_ISDIR(sb.st_mode)) { snprintf(err, SN_ERR_MAX, "%.400s: exists and is not a folder", path); return -1; }
    return 0;
}

// ---- one run per folder: RUN/.lock, held (flock) for the run's life by the
// process that writes the folder; it holds that process's id for the message
// of a second one. The kernel drops the lock when the holder exits, however
// it exits; the file goes when the holder lets go of it (a killed run's stays
// behind, and the next run takes the lock on it).

#define RUN_LOCK_FILE ".lock"

// Locks run (which must exist) for `who` ("segnet train", "segnet export");
// returns the lock's descriptor, or -1 with err. A reader (export) of a
// folder it cannot write takes no lock when there is none: nothing writes there.
#define RUN_NOT_LOCKED (-2)
static int run_lock(const char *run, const char *who, char err[SN_ERR_MAX]) {
    char path[4200];
    run_path(path, sizeof path, run, RUN_LOCK_FILE);
    const int reader = strcmp(who, "segnet train") != 0;
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && reader && (errno == EACCES || errno == EROFS)) {
        fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);  // flock needs no write access
        if (fd < 0 && errno == ENOENT) return RUN_NOT_LOCKED;
    }
    if (fd < 0) { snprintf(err, SN_ERR_MAX, "%.400s: cannot create the run's lock: %s", path, strerror(errno)); return -1; }
    if (flock(fd, LOCK_EX | LOCK_NB)) {
        char holder[64] = "";
        ssize_t n = pread(fd, holder, sizeof holder - 1, 0);
        holder[n > 0 ? n : 0] = 0;
        holder[strcspn(holder, "\r\n")] = 0;
        snprintf(err, SN_ERR_MAX, "%.300s: in use by another process (%s); %s", run, holder[0] ? holder : "process id unknown",
                 reader ? "a run is read when nothing writes it: wait for it to end"
                        : "wait for it to end or choose another --out");
        close(fd);
        return -1;
    }
    char me[64];
    int len = snprintf(me, sizeof me, "pid %ld, %s\n", (long)getpid(), who);
    if (ftruncate(fd, 0) || pwrite(fd, me, (size_t)len, 0) != len) { /* the lock holds without the note */ }
    return fd;
}

// Lets go of run_lock's lock, its file with it (the descriptor may be RUN_NOT_LOCKED or -1: nothing)
static void run_unlock(const char *run, int lock) {
    if (lock < 0) return;
    char path[4200];
    run_path(path, sizeof path, run, RUN_LOCK_FILE);
    unlink(path);
    close(lock);
}

// Temporary files a killed writer left in run ("<file>.tmp.<pid>", see
// atomic_tmp_name): removed once the lock is held, if their process is gone.
static void run_remove_stale(const char *run, int progress) {
    DIR *d = opendir(run);
    if (!d) return;
    int removed = 0;
    for (struct dirent *e; (e = readdir(d));) {
        const char *tmp = NULL;  // the last mark: the file's own name may hold one
        for (const char *p = e->d_name; (p = strstr(p, TMP_MARK)); p++) tmp = p;
        if (!tmp) continue;
        char *end;
        const char *digits = tmp + strlen(TMP_MARK);
        long pid = strtol(digits, &end, 10);
        if (end == digits || *end || pid <= 0) continue;
        if (kill((pid_t)pid, 0) == 0 || errno != ESRCH) continue;  // its writer lives (or is not ours to judge)
        char path[4096 + sizeof e->d_name + 2];
        run_path(path, sizeof path, run, e->d_name);
        removed += unlink(path) == 0;
    }
    closedir(d);
    if (removed && progress) fprintf(stderr, "segnet train: removed %d temporary file%s left in %s by a stopped run\n", removed,
                                     removed == 1 ? "" : "s", run);
}

// The files a run writes into its folder (besides its lock). A new run never
// replaces one of them unless --overwrite; export never writes one.
static const char *const RUN_FILES[] = {"last.safetensors", "best.safetensors", "config.txt", "metrics.csv",
                                        "curves.svg", "steps.csv", CLASSES_FILE};
#define RUN_N_FILES ((int)(sizeof RUN_FILES / sizeof *RUN_FILES))

static int is_run_file(const char *name) {
    for (int k = 0; k < RUN_N_FILES; k++) if (!strcmp(name, RUN_FILES[k])) return 1;
    return 0;
}

// The run files in run: a list for a message, and how many
static int run_files_held(const char *run, char *list, size_t size) {
    int n = 0;
    list[0] = 0;
    for (int k = 0; k < RUN_N_FILES; k++) {
        char path[4200];
        struct stat sb;
        run_path(path, sizeof path, run, RUN_FILES[k]);
        if (lstat(path, &sb) == 0) list_add(list, size, &n, RUN_FILES[k]);
    }
    return n;
}

// The epochs metrics.csv holds (its rows after the header; 0 when it is absent or unreadable)
static int metrics_rows(const char *run) {
    char path[4200], err[SN_ERR_MAX];
    run_path(path, sizeof path, run, "metrics.csv");
    FILE *f = fopen_regular(path, "r", err);
    if (!f) return 0;
    int rows = 0, c, last = '\n';
    while ((c = getc(f)) != EOF) { rows += c == '\n'; last = c; }
    rows += last != '\n';
    fclose(f);
    return rows > 0 ? rows - 1 : 0;
}

// Takes the run folder for this run: created if new (*made), locked, cleared
// of stale temporary files. A new run refuses a folder that holds any run file
// unless overwrite (*replace: they are removed when writing starts). --resume
// needs last.safetensors; a run that stopped before its first checkpoint
// (its settings, perhaps epoch 1's metrics row) starts again (*fresh); a run
// whose checkpoint is gone but that has trained longer is refused.
static int run_claim(const char *run, const char *resume, int overwrite, int *lock, int *made, int *fresh, int *replace,
                     int progress, char err[SN_ERR_MAX]) {
    struct stat sb;
    if (resume && (stat(run, &sb) != 0 || !S_ISDIR(sb.st_mode))) {
        snprintf(err, SN_ERR_MAX, "--resume %.300s: %s", run, stat(run, &sb) != 0 ? strerror(errno) : "not a folder");
        return -1;
    }
    char ckpt[4200], best[4200], tmp[OUT_PATH_MAX];
    run_path(ckpt, sizeof ckpt, run, "last.safetensors");
    run_path(best, sizeof best, run, "best.safetensors");
    atomic_tmp_name(ckpt, tmp);  // the longest path a run writes
    if (out_path_check(tmp, err)) return -1;
    if (!resume && stat(run, &sb) != 0) {
        if (mkdir_p(run, err)) return -1;
        *made = 1;
    }
    if ((*lock = run_lock(run, "segnet train", err)) < 0) return -1;
    run_remove_stale(run, progress);
    char held[256];
    const int n_held = run_files_held(run, held, sizeof held);
    const int has_ckpt = access(ckpt, F_OK) == 0, has_best = access(best, F_OK) == 0, epochs = metrics_rows(run);
    if (!resume) {
        if (n_held && !overwrite) {
            if (has_ckpt)
                snprintf(err, SN_ERR_MAX, "%.150s: already holds a run (last.safetensors); continue it with --resume %.150s, "
                         "start it again with --overwrite, or choose another --out", run, run);
            else
                snprintf(err, SN_ERR_MAX, "%.200s: holds an earlier run's files (%s) but no checkpoint; --overwrite replaces "
                         "them, or choose another --out", run, held);
            return -1;
        }
        *replace = n_held > 0;
        return 0;
    }
    if (!has_ckpt && (has_best || epochs > 1)) {
        snprintf(err, SN_ERR_MAX, "%.200s: has no last.safetensors, but %s%s%d epoch%s in metrics.csv: its checkpoint is gone, "
                 "so the run cannot go on (--weights %.100s/best.safetensors starts a new one from its best weights)", run,
                 has_best ? "best.safetensors" : "", has_best ? " and " : "", epochs, epochs == 1 ? "" : "s", run);
        return -1;
    }
    // metrics.csv is written before last.safetensors: without the checkpoint its row is re-run
    if (!has_ckpt) {
        *fresh = 1;
        if (progress) fprintf(stderr, "segnet train: %s has no checkpoint yet (stopped before its first one was written%s): "
                              "starting it again from the beginning\n", run, epochs ? "; metrics.csv is rewritten" : "");
    }
    return 0;
}

// A new run with --overwrite: the earlier run's files go before the first is written.
static int run_files_remove(const char *run, char err[SN_ERR_MAX]) {
    for (int k = 0; k < RUN_N_FILES; k++) {
        char path[4200];
        run_path(path, sizeof path, run, RUN_FILES[k]);
        if (unlink(path) != 0 && errno != ENOENT) {
            snprintf(err, SN_ERR_MAX, "%.400s: cannot remove it (--overwrite): %s", path, strerror(errno));
            return -1;
        }
    }
    return 0;
}

static void set_threads(int threads) {
    if (threads <= 0) return;
#ifdef _OPENMP
    omp_set_num_threads(threads);
#endif
    openblas_set_num_threads(threads);
}

// What every replica of a run shares (local replicas: one process)
typedef struct {
    const TrainCfg *c;
    const char *resume;
    int share_data;              // local replicas: rank 0 opens the data sets, the others read them
    Dataset train, val;          // ... here, freed by train_run after every replica has returned
    int has_train, has_val;
} RunShared;

typedef struct {
    RunShared *run;
    char err[SN_ERR_MAX];
    int interrupted;  // the signal that stopped the run (saved, to be resumed), 0 if none
} ReplicaArgs;

// Every replica's share of an interrupted epoch's totals, which rank 0 read:
// its own with as many replicas as were saved; else rank 0 takes their sums
// (the same totals, rounded in another order).
static int pass_resume_share(Trainer *t, PassSaved *ps) {
    Comm *comm = t->comm;
    int head[2] = {ps->batch, ps->replicas};
    if (comm->size > 1 && comm->broadcast(comm, head, sizeof head, 0)) return -1;
    if (!head[0]) return 0;
    const size_t KK = (size_t)t->K * t->K, R = (size_t)head[1];
    if (comm->rank != 0) {
        ps->sums = malloc(sizeof(double) * 2 * R);
        ps->cms = malloc(sizeof(int64_t) * KK * R);
        snCheck(ps->sums && ps->cms, "out of host memory");
    }
    if (comm->size > 1 && (comm->broadcast(comm, ps->sums, sizeof(double) * 2 * R, 0) ||
                           comm->broadcast(comm, ps->cms, sizeof(int64_t) * KK * R, 0)))
        return -1;
    t->resume_batch = head[0];
    t->resume_loss_sum = t->resume_norm_sum = 0.0;
    t->resume_cm = calloc(KK, sizeof(int64_t));
    snCheck(t->resume_cm != NULL, "out of host memory");
    for (size_t r = 0; r < R; r++) {
        if (R == (size_t)comm->size ? r != (size_t)comm->rank : comm->rank != 0) continue;
        t->resume_loss_sum += ps->sums[2 * r];
        t->resume_norm_sum += ps->sums[2 * r + 1];
        for (size_t k = 0; k < KK; k++) t->resume_cm[k] += ps->cms[r * KK + k];
    }
    return 0;
}

// An interrupted epoch into last.safetensors: where its training pass goes on
// (t->resume_batch) and every replica's totals, gathered to rank 0 (each in
// its own slot of zeros, so the sums are exact). reduced: the training pass
// had ended and its totals are the replicas' sums already (rank 0 keeps them).
static int save_interrupted(Trainer *t, const PassTotals *tr, int reduced, const char *run, char err[SN_ERR_MAX]) {
    Comm *comm = t->comm;
    const int R = comm->size;
    const size_t KK = (size_t)t->K * t->K;
    PassSaved ps = {t->resume_batch, R, t->K, calloc(2 * (size_t)R, sizeof(double)), calloc(KK * (size_t)R, sizeof(int64_t))};
    snCheck(ps.sums && ps.cms, "out of host memory");
    const int slot = reduced ? 0 : comm->rank;
    if (!reduced || comm->rank == 0) {
        ps.sums[2 * slot] = tr->loss_sum;
        ps.sums[2 * slot + 1] = tr->norm_sum;
        memcpy(ps.cms + (size_t)slot * KK, tr->cm, sizeof(int64_t) * KK);
    }
    int rc = 0;
    if (R > 1 && (comm->allreduce_f64(comm, ps.sums, 2 * (size_t)R) || comm->allreduce_i64(comm, ps.cms, KK * (size_t)R)))
        rc = comm_failure(comm, err);
    if (rc == 0 && comm->rank == 0) {
        char path[4200];
        run_path(path, sizeof path, run, "last.safetensors");
        rc = save_checkpoint(t, path, &ps, err);
    }
    pass_saved_free(&ps);
    return rc;
}

// RUN: --resume's folder, else --out, else runs/<date>-<time> (this replica's clock)
static void run_folder_name(const TrainCfg *c, const char *resume, char *run, size_t size) {
    if (resume) snprintf(run, size, "%s", resume);
    else if (c->out) snprintf(run, size, "%s", c->out);
    else {
        time_t now = time(NULL);
        strftime(run, size, "runs/%Y%m%d-%H%M%S", localtime(&now));
    }
}

// Keras' EarlyStopping(monitor, min_delta): an epoch improves when the loss is
// lower than the best by more than min_delta (a metric: higher; t->best holds
// the loss, or the metric negated); patience epochs without: the run finishes
// (and resuming it does nothing). Returns whether this epoch improved.
static int epoch_judged(Trainer *t, const EpochRecord *rec) {
    const TrainCfg *c = t->c;
    const double score = monitored(c, rec, t->has_val);
    // an epoch whose loss is not finite is never the best, whatever the monitored metric says
    const int improved = score < t->best - c->min_delta && isfinite(t->has_val ? rec->val_loss : rec->loss);
    if (improved) { t->best = score; t->best_epoch = t->epoch; t->bad_epochs = 0; }
    else t->bad_epochs++;
    if (c->patience > 0 && t->bad_epochs >= c->patience) t->finished = 1;
    return improved;
}

// The epoch's row of metrics.csv (rank 0), then best.safetensors when it
// improved and last.safetensors: metrics.csv first, so that a crash in
// between runs the epoch again. vm NULL: no validation set.
static int epoch_written(Trainer *t, History *h, const EpochRecord *rec, const Metrics *m, const Metrics *vm,
                         const double *diag, int improved, const char *run, char err[SN_ERR_MAX]) {
    SfBuf row = {0};
    char s[64], lr_text[32], path[4200];
    snprintf(s, sizeof s, "%d,%s", rec->epoch, float_str(lr_text, (float)rec->lr));
    sb_str(&row, s);
    csv_num(&row, rec->loss);
    csv_num(&row, rec->val_loss);
    csv_metrics(t, &row, m);
    csv_metrics(t, &row, vm);
    for (int k = 0; k < STEP_STATS_N_COLUMNS; k++) csv_sig(&row, diag[k]);
    sb_put(&row, "", 1);
    snCheck(!row.oom, "out of host memory");
    history_add(h, row.p, *rec);
    int rc = history_write(t, h, run, err);
    if (rc == 0 && improved) { run_path(path, sizeof path, run, "best.safetensors"); rc = save_checkpoint(t, path, NULL, err); }
    run_path(path, sizeof path, run, "last.safetensors");
    if (rc == 0) rc = save_checkpoint(t, path, NULL, err);
    return rc;
}

// The model before anything of epoch `epoch` (1-based) is written or judged:
// a model that is no longer finite stops the run (every replica checks its
// copy; they agree). Nothing of it is saved: the run folder keeps what it had.
static int epoch_model_finite(Trainer *t, int epoch, char err[SN_ERR_MAX]) {
    char which[SN_ERR_MAX];
    int rc = 0;
    if (model_finite(t, which)) {
        char kept[64] = "";
        if (t->best_epoch) snprintf(kept, sizeof kept, "; best.safetensors keeps epoch %d", t->best_epoch);
        snprintf(err, SN_ERR_MAX, "epoch %d: the model is no longer finite: %.250s. Training diverged (a lower --lr, or "
                 "--clipnorm, may help); nothing of this epoch was saved%s", epoch, which, kept);
        rc = -1;
    }
    return comm_agree(t->comm, rc, err);
}

// the epoch's progress line
static void epoch_print(const Trainer *t, const EpochRecord *rec, double seconds, int improved) {
    const char *metric = t->segmentation ? "mIoU" : "accuracy";
    fprintf(stderr, "epoch %d/%d  loss %.4f  %s %.4f", rec->epoch, t->c->epochs, rec->loss, metric, rec->metric);
    if (t->has_val) fprintf(stderr, "  val_loss %.4f  val_%s %.4f", rec->val_loss, metric, rec->val_metric);
    fprintf(stderr, "  (%.1f s)%s\n", seconds, improved ? "  best" : "");
}

// A replica's trainer, ready for its first epoch: the model and the data
// (rank 0 opens the data sets and, with local replicas, lends them to the
// others), the initial weights of a fresh run or the checkpoint and history
// of a resumed one (rank 0 reads them), then rank 0's state mirrored on every
// replica. claimed: rank 0's run_claim result. Returns 0, -1 with err, or the
// signal that interrupted the data's reading (without replicas; nothing was
// written).
static int replica_open(Comm *comm, RunShared *sh, int claimed, int fresh, const char *run, Trainer *t, History *h,
                        PassSaved *saved, char err[SN_ERR_MAX]) {
    const TrainCfg *c = sh->c;
    const int root = comm->rank == 0;
    char path[4200];
    int rc = claimed;
    if (rc == 0 && (root || !sh->share_data)) rc = trainer_open_on(t, c, c->data, c->val, comm, err);
    if (rc && interrupt_signal && comm->size == 1) return interrupt_signal;
    if (sh->share_data) {
        if (root && rc == 0) {  // the data sets now belong to the run
            sh->train = t->train; sh->has_train = t->has_train;
            sh->val = t->val; sh->has_val = t->has_val;
            t->borrowed_data = 1;
        }
        if (comm_agree(comm, rc, err)) return -1;
        if (!root) {
            rc = trainer_open_on(t, c, NULL, NULL, comm, err);
            if (rc == 0) trainer_borrow_data(t, sh->has_train ? &sh->train : NULL, sh->has_val ? &sh->val : NULL);
        }
    }
    if (rc == 0 && root && fresh && c->weights) {
        char report[SN_ERR_MAX];
        int random = 0;
        rc = trainer_load_weights(t, c->weights, report, &random, err);
        if (rc == 0) printf("%s%s%s\n", report, c->weights_note && c->weights_note[0] ? "; " : "",
                            c->weights_note ? c->weights_note : "");
        if (rc == 0 && random)
            printf("weights: %s holds random weights (ref/export_pretrained.py --random), not ImageNet's: a trial run, "
                   "whose validation figures will be poor\n", c->weights);
    }
    if (rc == 0 && root && !fresh) {
        run_path(path, sizeof path, run, "last.safetensors");
        rc = load_checkpoint(t, path, saved, err);
        run_path(path, sizeof path, run, "metrics.csv");
        if (rc == 0) rc = history_load(t, path, h, err);
        if (rc == 0) rc = history_check_best(t, h, run, err);
    }
    if (comm_agree(comm, rc, err)) return -1;
    if (trainer_broadcast(t) || pass_resume_share(t, saved)) return comm_failure(comm, err);
    return 0;
}

// One replica of a run (all of it without replicas). Every replica takes
// every decision from the same mirrored state and the same all-reduced
// figures; only rank 0 reads and writes the run folder. A failure that some
// replicas see and others do not is agreed on (comm_agree) before going on.
static int train_replica(Comm *comm, void *arg) {
    ReplicaArgs *a = arg;
    RunShared *sh = a->run;
    const TrainCfg *c = sh->c;
    const char *resume = sh->resume;
    char *err = a->err;
    const int root = comm->rank == 0;
    set_threads(c->threads);
    if (c->patience > 0 && !c->val) { snprintf(err, SN_ERR_MAX, "--early-stopping needs a validation set (--val)"); return -1; }
    char run[4096];
    run_folder_name(c, resume, run, sizeof run);
    if (comm->size > 1 && comm->broadcast(comm, run, sizeof run, 0)) return comm_failure(comm, err);  // rank 0's clock
    Trainer t;
    memset(&t, 0, sizeof t);
    History h = {0};
    int rc = 0;
    double *iou = malloc(sizeof(double) * 2 * c->model.classes);
    snCheck(iou != NULL, "out of host memory");
    int64_t *cm = malloc(sizeof(int64_t) * c->model.classes * c->model.classes),
            *cm_val = malloc(sizeof(int64_t) * c->model.classes * c->model.classes);
    snCheck(cm && cm_val, "out of host memory");
    PassSaved saved = {0};  // an interrupted epoch's position (rank 0 reads it)
    int lock = -1, made = 0, fresh = !resume, replace = 0, written = 0;
    if (root) rc = run_claim(run, resume, c->overwrite, &lock, &made, &fresh, &replace, c->progress, err);
    rc = replica_open(comm, sh, rc, fresh, run, &t, &h, &saved, err);
    if (rc > 0) {  // stopped while reading the data: nothing was written
        if (c->progress) fprintf(stderr, "segnet train: interrupted before training started; nothing was written\n");
        a->interrupted = rc;
        rc = 0;
        goto done;
    }
    if (rc) goto done;
    rc = -1;
    if (resume && (t.finished || t.epoch >= c->epochs)) {
        if (c->progress && root && !t.finished && t.resume_batch)
            fprintf(stderr, "segnet train: %s has completed %d epoch%s and was interrupted inside epoch %d; --epochs %d asks for "
                    "no more: nothing to do (--epochs %d completes epoch %d)\n", run, t.epoch, t.epoch == 1 ? "" : "s",
                    t.epoch + 1, c->epochs, t.epoch + 1, t.epoch + 1);
        else if (c->progress && root)
            fprintf(stderr, "segnet train: %s has finished (%d epoch%s%s); nothing to do (--epochs N trains longer)\n", run,
                    t.epoch, t.epoch == 1 ? "" : "s", t.finished ? ", stopped early" : "");
        rc = 0;
        goto done;
    }
    // every input has been checked: from here on the run folder is written
    written = 1;
    if (comm_agree(comm, root ? (replace && run_files_remove(run, err)) || mkdir_p(run, err) || write_config(c, run, err) ||
                               write_class_names(&t.train, run, err) : 0, err)) goto done;
    if (c->progress && root)
        fprintf(stderr, "segnet train: %s on %s, %d training images%s, %" PRIu64 " parameters%s; run folder %s\n",
                c->model.model, t.o->name, t.train.n, t.has_val ? "" : " (no validation set)", (uint64_t)t.g.n_param_floats,
                comm->size > 1 ? (c->sync_bn ? ", replicas with batch norm synchronised" : ", replicas with batch norm per replica") : "",
                run);
    Metrics m = {0, 0, iou}, vm = {0, 0, iou + c->model.classes};
    const int train_batches = (t.train.n + c->model.batch - 1) / c->model.batch;
    int warned[3] = {0, 0, 0};  // each warning once per run
    if (comm_agree(comm, root && c->log_every > 0 ? steps_csv_start(&t, run, err) : 0, err)) goto done;
    while (t.epoch < c->epochs && !t.finished) {
        double t0 = now_seconds();
        PassTotals tr = {0, 0, cm}, va = {0, 0, cm_val};
        int stop = t.resume_batch ? 0 : interrupt_poll(&t);  // asked before the epoch: last.safetensors is its start
        if (stop > 0) {
            if (c->progress && root) fprintf(stderr, "segnet train: interrupted before epoch %d; continue with: segnet train --resume %s\n",
                                             t.epoch + 1, run);
            a->interrupted = stop;
            rc = 0;
            goto done;
        }
        int reduced = 0;
        if (stop == 0) stop = run_pass(&t, &t.train, 1, &tr, err);
        if (stop < 0) goto done;
        double loss = tr.loss_sum / tr.norm_sum, val_loss = NAN;
        if (stop == 0) {
            metrics_compute(cm, t.K, c->class_weights, &m);
            if (c->train_eval) {  // the train figures again, in inference mode (cm_val is free until the validation)
                PassTotals te = {0, 0, cm_val};
                if ((stop = run_pass(&t, &t.train, 0, &te, err)) < 0) goto done;
                if (!stop) {
                    metrics_compute(cm_val, t.K, c->class_weights, &m);
                    loss = te.loss_sum / te.norm_sum;
                }
            }
            if (!stop && t.has_val && (stop = run_pass(&t, &t.val, 0, &va, err)) < 0) goto done;
            if (stop) { t.resume_batch = train_batches; reduced = 1; }  // the validation (and --train-eval) runs again
            if (t.has_val && !stop) {
                metrics_compute(cm_val, t.K, c->class_weights, &vm);
                val_loss = va.loss_sum / va.norm_sum;
            }
        }
        if (stop) {
            if (epoch_model_finite(&t, t.epoch + 1, err) || save_interrupted(&t, &tr, reduced, run, err) ||
                comm_agree(comm, 0, err)) goto done;
            if (c->progress && root)
                fprintf(stderr, "segnet train: interrupted at epoch %d, step %d of %d (saved in last.safetensors); "
                        "continue with: segnet train --resume %s\n", t.epoch + 1, (t.resume_batch + c->accum - 1) / c->accum,
                        (train_batches + c->accum - 1) / c->accum, run);
            a->interrupted = stop;
            rc = 0;
            goto done;
        }
        if (epoch_model_finite(&t, t.epoch + 1, err)) goto done;
        t.epoch++;
        double lr = lr_at_step(c->lr, c->schedule, c->warmup, t.total_steps, t.step - 1);
        double diag[STEP_STATS_N_COLUMNS];
        step_stats_columns(&t.epoch_stats, diag);
        EpochRecord rec = {t.epoch, lr, loss, val_loss, t.segmentation ? m.mean_iou : m.accuracy,
                           t.has_val ? (t.segmentation ? vm.mean_iou : vm.accuracy) : NAN,
                           diag[0], diag[1], diag[2], diag[3], diag[4], diag[5], diag[6]};
        const int improved = epoch_judged(&t, &rec);
        if (comm_agree(comm, root ? epoch_written(&t, &h, &rec, &m, t.has_val ? &vm : NULL, diag, improved, run, err) : 0,
                       err))
            goto done;
        if (c->progress && root) {
            epoch_print(&t, &rec, now_seconds() - t0, improved);
            training_warnings(&t, &rec, h.n > 1 ? &h.rec[h.n - 2] : NULL, warned);
        }
        if (c->stop_after_epochs && t.epoch >= c->stop_after_epochs && !t.finished) { rc = 0; goto done; }
    }
    if (c->progress && root && c->patience > 0 && t.epoch < c->epochs)
        fprintf(stderr, "early stopping: %s has not improved for %d epochs\n", monitor_name(c), c->patience);
    if (t.best_epoch == 0) {
        snprintf(err, SN_ERR_MAX, "no epoch had a finite %s: training diverged (a lower --lr, or --clipnorm, may help); "
                 "no best.safetensors was written", t.has_val ? "val_loss" : "loss");
        goto done;
    }
    if (c->progress && root) fprintf(stderr, "segnet train: best epoch %d; weights in %s/best.safetensors\n", t.best_epoch, run);
    if (root) {  // the best epoch's figures, for the weights that are kept
        const EpochRecord *best = &h.rec[t.best_epoch - 1];
        if (c->progress) printf("run: %s\nbest_epoch: %d\nloss: %.6f\n", run, t.best_epoch, best->loss);
        if (c->progress && t.has_val) printf("val_loss: %.6f\nval_%s: %.6f\n", best->val_loss, t.segmentation ? "mIoU" : "accuracy", best->val_metric);
    }
    rc = 0;
done:
    history_free(&h);
    trainer_close(&t);
    pass_saved_free(&saved);
    free(iou); free(cm); free(cm_val);
    run_unlock(run, lock);
    if (made && !written) rmdir(run);  // refused before writing: the folder this run created goes again
    return rc;
}

int train_run_comm(const TrainCfg *c, const char *resume, Comm *comm, char err[SN_ERR_MAX]) {
    RunShared sh = {.c = c, .resume = resume};
    ReplicaArgs a = {&sh, "", 0};
    int rc = train_replica(comm, &a);
    if (rc) snprintf(err, SN_ERR_MAX, "%s", a.err);
    return rc ? rc : a.interrupted ? 128 + a.interrupted : 0;
}

// Replicas on GPUs (--device cuda, or auto with one GPU per replica): NCCL
// communicators over the host ones, hosts[0..n) (local), or this process's
// (mpi), which become their `device`. Returns 0 (on GPUs, or on the CPU: cpu,
// or auto without the GPUs, after the notice), or -1 with err.
static int replicas_on_gpus(const TrainCfg *c, Comm *dcomms, Comm *hosts, int n, int mpi, char err[SN_ERR_MAX]) {
    if (c->device == DEVICE_CPU) return 0;
    char why[SN_ERR_MAX];
#ifdef SEGNET_CUDA
    if ((mpi ? cuda_comm_mpi_create(dcomms, hosts, why) : cuda_comm_local_create(dcomms, hosts, n, why)) == 0) return 0;
#else
    (void)dcomms; (void)n;
    snprintf(why, sizeof why, "%s", NO_CUDA_BUILD);
#endif
    if (c->device == DEVICE_CUDA) { snprintf(err, SN_ERR_MAX, "--device cuda: %.480s", why); return -1; }
    if (!mpi || hosts->rank == 0) cpu_fallback_notice(why);
    return 0;
}

static void replicas_gpus_close(Comm *dcomms, int n) {
#ifdef SEGNET_CUDA
    cuda_comm_destroy(dcomms, n);
#else
    (void)dcomms; (void)n;
#endif
}

// Without replicas and outside mpirun: one replica on a communicator of one.
int train_run(const TrainCfg *c, const char *resume, char err[SN_ERR_MAX]) {
    const int procs = comm_mpi_launched(), R = c->replicas > 1 ? c->replicas : 1;
    if (procs > 1) {
        if (R > 1) { snprintf(err, SN_ERR_MAX, "--replicas %d under mpirun: one replica per process (mpirun -np N)", R); return -1; }
        Comm comm, dcomm;
        if (comm_mpi_open(&comm, err) || replicas_on_gpus(c, &dcomm, &comm, 1, 1, err)) return -1;
        int rc = train_run_comm(c, resume, &comm, err);
        if (comm.device) replicas_gpus_close(&dcomm, 1);
        return rc;
    }
    if (R > SN_MAX_REPLICAS) { snprintf(err, SN_ERR_MAX, "--replicas %d: at most %d", R, SN_MAX_REPLICAS); return -1; }
    if (R == 1) return train_run_comm(c, resume, &comm_one, err);
    Comm comms[SN_MAX_REPLICAS];
    RunShared sh = {.c = c, .resume = resume, .share_data = 1};
    ReplicaArgs args[SN_MAX_REPLICAS];
    void *argp[SN_MAX_REPLICAS];
    int rc[SN_MAX_REPLICAS];
    for (int r = 0; r < R; r++) { args[r] = (ReplicaArgs){&sh, "", 0}; argp[r] = &args[r]; }
    snCheck(comm_local_create(comms, R) == 0, "cannot create %d local replicas", R);
    Comm dcomms[SN_MAX_REPLICAS];
    if (replicas_on_gpus(c, dcomms, comms, R, 0, err)) { comm_local_destroy(comms, R); return -1; }
    const int on_gpus = comms[0].device != NULL;
    comm_local_run(comms, R, train_replica, argp, rc);
    if (on_gpus) replicas_gpus_close(dcomms, R);
    // the first rank that failed on its own, else one that stopped with the others (an agreed error)
    int failed = comms[0].failed_rank(&comms[0]), any = 0;
    if (failed < 0) for (int r = R - 1; r >= 0; r--) if (rc[r]) failed = r;
    if (failed >= 0) { snprintf(err, SN_ERR_MAX, "%s", args[failed].err); any = 1; }
    comm_local_destroy(comms, R);
    if (sh.has_train) dataset_free(&sh.train);
    if (sh.has_val) dataset_free(&sh.val);
    return any ? -1 : args[0].interrupted ? 128 + args[0].interrupted : 0;
}

int eval_run(const TrainCfg *c, const char *weights, const char *data, EvalResult *r, char err[SN_ERR_MAX]) {
    set_threads(c->threads);
    Trainer t;
    int rc = -1;
    int64_t *cm = malloc(sizeof(int64_t) * c->model.classes * c->model.classes);
    snCheck(cm != NULL, "out of host memory");
    if (trainer_open(&t, c, NULL, data, err) || trainer_load_weights(&t, weights, NULL, NULL, err)) goto done;
    PassTotals pt = {0, 0, cm};
    if (run_pass(&t, &t.val, 0, &pt, err)) goto done;
    r->loss = pt.loss_sum / pt.norm_sum;
    metrics_compute(cm, t.K, c->class_weights, &r->m);
    rc = 0;
done:
    trainer_close(&t);
    free(cm);
    return rc;
}

// ---- export: a run's weights for PyTorch

// The names an export uses: torchvision's (segnet's own, plus batch norm's
// num_batches_tracked, so that load_state_dict(strict=True) takes them), timm's
// tf_efficientnetv2_* (also with num_batches_tracked), or segnet's as they are.
typedef enum { EXPORT_TORCHVISION, EXPORT_TIMM, EXPORT_SEGNET } ExportNames;
static const char *const EXPORT_NAMES[] = {"torchvision", "timm", "segnet"};  // indexed by ExportNames


// An export's metadata names its writer, so that --overwrite recognises an
// earlier export (and nothing else) as replaceable: in the compact header
// safetensors_write makes, the pair appears as EXPORT_WRITER_PAIR.
#define EXPORT_WRITER      "segnet export"
#define EXPORT_WRITER_PAIR "\"writer\":\"" EXPORT_WRITER "\""

// Whether the safetensors file at path was written by export (its header holds the pair).
static int is_export(const char *path) {
    struct stat sb;
    const char *why;
    const int fd = open_regular(path, &sb, &why);
    if (fd < 0) return 0;
    uint8_t len8[8];
    uint64_t hlen = 0;
    char *head = NULL;
    if (read(fd, len8, 8) == 8) {
        for (int i = 7; i >= 0; i--) hlen = hlen << 8 | len8[i];
        if (hlen <= SF_HEADER_MAX && (head = malloc(hlen + 1)) && read(fd, head, hlen) == (ssize_t)hlen) head[hlen] = 0;
        else { free(head); head = NULL; }
    }
    close(fd);
    const int ours = head && strstr(head, EXPORT_WRITER_PAIR) != NULL;
    free(head);
    return ours;
}

// Where an export may write: a name the file system takes, never a file a run
// writes in a run folder; an existing file only with overwrite, and only an
// earlier export (a run's checkpoint, pretrained weights, anything else: never).
static int export_out_allowed(const char *out, int overwrite, char err[SN_ERR_MAX]) {
    if (out_path_check(out, err)) return -1;
    const char *base = path_base(out);
    char dir[OUT_PATH_MAX], probe[OUT_PATH_MAX + 32];
    path_folder(out, dir);
    const char *marks[] = {"config.txt", "last.safetensors", RUN_LOCK_FILE};
    int run_folder = 0;
    for (int k = 0; k < 3; k++) {
        snprintf(probe, sizeof probe, "%s/%s", dir, marks[k]);
        run_folder |= access(probe, F_OK) == 0;
    }
    struct stat sb;
    if (run_folder && is_run_file(base))
        snprintf(err, SN_ERR_MAX, "%.300s: a file of the run in %.100s (export writes only a new file of its own there)", out, dir);
    else if (lstat(out, &sb) != 0)
        return 0;
    else if (S_ISDIR(sb.st_mode))
        snprintf(err, SN_ERR_MAX, "%.400s: is a folder (--out names the file to write)", out);
    else if (!overwrite)
        snprintf(err, SN_ERR_MAX, "%.300s: exists; export replaces a file only with --overwrite, and only an earlier export", out);
    else if (!is_export(out))
        snprintf(err, SN_ERR_MAX, "%.300s: exists and is not an earlier export (no %s in its metadata): --overwrite does not "
                 "replace it", out, EXPORT_WRITER_PAIR);
    else
        return 0;
    return -1;
}

// The weights and BN statistics of checkpoint `path` (a run's best or last),
// without the optimiser state, written atomically to out under `names`;
// num_batches_tracked is the checkpoint's step. report: one line.
int export_weights(const ModelCfg *m, const char *path, ExportNames names, const char *out, char report[SN_ERR_MAX],
                   char err[SN_ERR_MAX]) {
    SafetensorsFile f;
    if (safetensors_read(path, &f, err)) return -1;
    Graph g;
    graph_init(&g);
    int rc = -1, n = 0;
    SafetensorsTensor *ts = calloc(2 * (size_t)f.n_tensors + 1, sizeof *ts);
    snCheck(ts != NULL, "out of host memory");
    const char *step_text = safetensors_meta(&f, "step");
    int64_t step = 0;
    if (model_build(&g, m) < 0) { snprintf(err, SN_ERR_MAX, "%s", g.err); goto done; }
    if (step_text && meta_int(path, "step", step_text, 0, INT64_MAX, &step, err)) goto done;
    for (int i = 0; i < f.n_tensors; i++) {
        const SafetensorsTensor *t = &f.tensors[i];
        if (!strncmp(t->name, TRAIN_STATE_PREFIX, strlen(TRAIN_STATE_PREFIX)) || strstr(t->name, BN_COUNT_SUFFIX)) continue;
        if (graph_find_param(&g, t->name) < 0 && graph_find_buffer(&g, t->name) < 0) {
            snprintf(err, SN_ERR_MAX, "%.300s: tensor '%.100s' is not one of model '%s''s (another model's checkpoint?)", path,
                     t->name, m->model);
            goto done;
        }
        float *v = malloc(sizeof(float) * (t->numel ? t->numel : 1));
        snCheck(v != NULL, "out of host memory");
        safetensors_tensor_f32(t, v);
        const int allowed = values_allowed(path, t->name, v, t->numel, err) == 0;
        free(v);
        if (!allowed) goto done;
        ts[n] = *t;
        if (names == EXPORT_TIMM && !effnet_timm_name(&g, t->name, ts[n].name)) {
            snprintf(err, SN_ERR_MAX, "model '%s': '%.100s' has no timm name (timm's tf_efficientnetv2_* are EfficientNetV2 "
                     "classifiers without --head-hidden)", m->model, t->name);
            goto done;
        }
        n++;
        const size_t len = strlen(ts[n - 1].name), suffix = strlen(BN_STAT_SUFFIX);
        if (names != EXPORT_SEGNET && len > suffix && !strcmp(ts[n - 1].name + len - suffix, BN_STAT_SUFFIX)) {
            const SafetensorsTensor *var = &ts[n - 1];
            SafetensorsTensor *c = &ts[n++];
            memset(c, 0, sizeof *c);
            if (len - suffix + strlen(BN_COUNT_SUFFIX) >= sizeof c->name) {
                snprintf(err, SN_ERR_MAX, "'%.100s': its num_batches_tracked name is too long", var->name);
                goto done;
            }
            memcpy(c->name, var->name, len - suffix);
            memcpy(c->name + (len - suffix), BN_COUNT_SUFFIX, strlen(BN_COUNT_SUFFIX) + 1);
            c->dtype = DT_I64;
            c->ndim = 0;
            c->numel = 1;
            c->data = &step;
        }
    }
    const char *keys[3] = {"format", "padding", "writer"}, *values[3] = {"pt", PAD_NAME[m->pad], EXPORT_WRITER};
    if (safetensors_write(out, ts, n, keys, values, 3, err)) goto done;
    snprintf(report, SN_ERR_MAX, "wrote %.200s: %d tensors in %s names from %.200s (padding %s)", out, n, EXPORT_NAMES[names],
             path, PAD_NAME[m->pad]);
    rc = 0;
done:
    free(ts);
    graph_free(&g);
    safetensors_free(&f);
    return rc;
}

// export of a run's best (or last) checkpoint: its lock held while it is read
int export_run(const ModelCfg *m, const char *run, int last, ExportNames names, const char *out, int overwrite,
               char report[SN_ERR_MAX], char err[SN_ERR_MAX]) {
    char path[4200];
    run_path(path, sizeof path, run, last ? "last.safetensors" : "best.safetensors");
    if (export_out_allowed(out, overwrite, err)) return -1;
    const int lock = run_lock(run, "segnet export", err);
    if (lock == -1) return -1;
    const int rc = export_weights(m, path, names, out, report, err);
    run_unlock(run, lock);
    return rc;
}

// ---- memory of a run, from its plan (what trainer_open allocates)

typedef struct {
    size_t params, grads, optimizer, statistics, activations, workspace, io, backend, driver, total;
    size_t n_trainable;
} MemoryReport;

static void memory_report(const Graph *g, const Plan *p, const TrainCfg *c, int logits, const Ops *o,
                          MemoryReport *m) {
    memset(m, 0, sizeof *m);
    size_t *grad_offset = malloc(sizeof(size_t) * ((size_t)g->n_params + 1));
    snCheck(grad_offset != NULL, "out of host memory");
    m->n_trainable = grad_layout(g, grad_offset);  // what net_create gives gradients (and Adam moments)
    free(grad_offset);
    const Shape in = g->tensors[g->input].shape, out = g->tensors[logits].shape;
    const size_t K = (size_t)out.c, labels = (size_t)out.n * out.h * out.w;
    int cmax = 1;
    m->params = sizeof(float) * g->n_param_floats;
    if (o->weights_in_storage_type && c->precision != DT_F32) m->params += dtype_size(c->precision) * g->n_param_floats;
    m->grads = sizeof(float) * (m->n_trainable ? m->n_trainable : 1);  // as net_create allocates them
    m->optimizer = 2 * sizeof(float) * m->n_trainable;
    m->statistics = sizeof(float) * g->n_buffer_floats;
    for (int i = 0; i < g->n_layers; i++)
        if (g->layers[i].kind == LAYER_BN) {
            int C = tshape(g, g->layers[i].in[0]).c;
            m->statistics += 2 * sizeof(float) * (size_t)C;
            if (C > cmax) cmax = C;
        }
    m->statistics += 2 * (sizeof(float) + sizeof(double)) * (size_t)cmax;  // net->bn_scratch, net->bn_sums
    m->workspace = p->workspace;
    m->activations = p->peak - p->workspace;
    m->io = sizeof(float) * K + sizeof(int32_t) * labels + sizeof(int64_t) * K * K + sizeof(StepArgs) + sizeof(StepState) +
            sizeof(uint64_t) * (size_t)g->n_layers + sizeof(int32_t);  // the last: Trainer.nonfinite
    if (c->precision != DT_F32) m->io += sizeof(float) * shape_numel(in);
    m->backend = o->context_bytes;
    m->driver = o->driver_bytes;
    m->total = m->params + m->grads + m->optimizer + m->statistics + m->activations + m->workspace + m->io +
               m->backend + m->driver;
}

// Builds the graph of c (frozen layers marked) and its plan. Returns the logits, or -1 with err.
static int plan_for(const TrainCfg *c, Graph *g, Plan *p, Ops **op, char err[SN_ERR_MAX]) {
    graph_init(g);
    Ops *o = *op = ops_for_device(c->device, 0, err);  // its conv workspace sizes, its own memory
    if (!o) return -1;
    int logits = model_build(g, &c->model);
    if (logits < 0) { snprintf(err, SN_ERR_MAX, "%s", g->err); return -1; }
    if (freeze_apply(g, c, err)) return -1;
    int *needs_grad = malloc(sizeof(int) * (size_t)g->n_tensors);
    snCheck(needs_grad != NULL, "out of host memory");
    graph_needs_grad(g, 0, needs_grad);
    plan_build(p, g, needs_grad, c->precision, logits, c->checkpoint, net_workspace_bytes(g, o, c->precision));
    free(needs_grad);
    return logits;
}

// --memory: the fastest setting that fits, for the global batch c->model.batch
// (× c->accum): the largest micro-batch first; at each, stored activations
// before checkpointing, fp32 before fp16 storage; the micro-batches make up
// the global batch by accumulation. On success c holds the setting and why
// says what was tried; else -1 with err saying what the smallest setting needs.
static int choose_setting(TrainCfg *c, size_t budget, char *why, size_t why_size, char err[SN_ERR_MAX]) {
    const int global = c->model.batch * c->accum;
    size_t smallest = SIZE_MAX;
    int tried = 0;
    why[0] = 0;
    for (int micro = global; micro >= 1; micro = micro > 1 ? (micro + 1) / 2 : 0) {
        for (int v = 0; v < 4; v++) {
            TrainCfg t = *c;
            t.model.batch = micro;
            t.accum = (global + micro - 1) / micro;
            t.checkpoint = v & 1;
            t.precision = v & 2 ? DT_F16 : DT_F32;
            Graph g;
            Plan p;
            Ops *o;
            int logits = plan_for(&t, &g, &p, &o, err);
            if (logits < 0) { graph_free(&g); return -1; }
            MemoryReport m;
            memory_report(&g, &p, &t, logits, o, &m);
            plan_free(&p);
            graph_free(&g);
            tried++;
            if (m.total < smallest) smallest = m.total;
            size_t k = strlen(why);
            snprintf(why + k, why_size - k, "  micro-batch %d × %d, %s, checkpoint %s: %.2f GiB%s\n", micro, t.accum,
                     DTYPE_NAMES[t.precision], t.checkpoint ? "blocks" : "none", m.total / 1073741824.0,
                     m.total <= budget ? "  fits" : "");
            if (m.total <= budget) { *c = t; return 0; }
        }
        if (micro == 1) break;
    }
    snprintf(err, SN_ERR_MAX, "nothing fits in %.2f GiB: the smallest setting tried (of %d) needs %zu bytes (%.2f GiB)",
             budget / 1073741824.0, tried, smallest, smallest / 1073741824.0);
    return -1;
}

// ----------------------------------------------------------------------------
// benchmark: the trainer's own training steps (train_step: forward, loss,
// backward, loss scaling, Adam) on synthetic data, in the trainer's planned
// arena, so the time and the peak memory are a run's; optionally a profile by
// op kind from net->layer_seconds, the rest of the step (loss, optimiser,
// uploads) in one row.

typedef enum {
    BK_CONV1, BK_CONVK, BK_DEPTHWISE, BK_BN, BK_ACT, BK_SE, BK_OTHER, BK_REST, BK_COUNT
} BenchKind;
static const char *const BENCH_KIND_NAMES[BK_COUNT] = {
    "conv 1x1", "conv kxk", "depthwise", "batch norm", "activations", "squeeze-exc", "other", "loss+optim",
};

typedef struct {
    ModelCfg model;
    int steps, warmup;   // timed steps, untimed steps before them
    int threads;         // 0: OpenMP's default
    int profile;         // fill BenchResult's per-kind table
    DType precision;     // activation storage
    int checkpoint;      // recompute blocks in backward
    uint64_t seed;
    Device device;
} BenchCfg;

typedef struct {
    double step_ms;                  // median over the timed steps
    double images_per_s;             // batch / median step
    size_t peak_rss_bytes;           // getrusage ru_maxrss of the whole process
    size_t peak_device_bytes;        // the most the backend's alloc had handed out at once
    double kind_fwd_ms[BK_COUNT], kind_bwd_ms[BK_COUNT];  // per step (mean), with profile
    double kind_gflop[BK_COUNT];     // per step, forward + backward (convs only)
    size_t n_params;
    int threads;                     // the OpenMP threads it ran with
    const char *backend;             // the ops table's name
} BenchResult;

// The op kind a layer's time is booked under. The SE pieces are the pooling,
// the scale and the convs and activations on (N,1,1,C) tensors; dense layers
// (the classifier) count as "other".
static BenchKind bench_kind(const Graph *g, const Layer *l) {
    Shape in = tshape(g, l->in[0]);
    int on_pooled = in.h == 1 && in.w == 1;
    switch (l->kind) {
    case LAYER_CONV:
        if (on_pooled) return BK_SE;
        if (conv_is_depthwise(&l->conv)) return BK_DEPTHWISE;
        return l->conv.kh == 1 && l->conv.kw == 1 ? BK_CONV1 : BK_CONVK;
    case LAYER_BN: return BK_BN;
    case LAYER_ACT: return on_pooled ? BK_SE : BK_ACT;
    case LAYER_GAP: case LAYER_SCALE: case LAYER_SE_GATE: return BK_SE;
    default: return BK_OTHER;
    }
}

// multiply-adds ×2 of a conv's forward: 2·N·OH·OW·Cout·(kh·kw·Cin/groups)
static double conv_flops(const Graph *g, const Layer *l) {
    Shape out = tshape(g, l->out);
    return 2.0 * out.n * out.h * out.w * out.c * (double)l->conv.kh * l->conv.kw * (l->conv.cin / l->conv.groups);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}

int bench_run(const BenchCfg *c, BenchResult *r, char err[SN_ERR_MAX]) {
    memset(r, 0, sizeof *r);
    set_threads(c->threads);
    TrainCfg tc;  // the trainer's defaults: Adam (lr 1e-3), every class weight 1, no clipping
    train_cfg_default(&tc);
    tc.model = c->model;
    tc.precision = c->precision;
    tc.checkpoint = c->checkpoint;
    tc.device = c->device;
    tc.seed = c->seed;
    tc.progress = 0;
    Trainer t;
    if (trainer_open(&t, &tc, NULL, NULL, err)) { trainer_close(&t); return -1; }
    const Graph *g = &t.g;
    Ops *o = t.o;
    r->n_params = g->n_param_floats;
    r->backend = o->name;
#ifdef _OPENMP
    r->threads = omp_get_max_threads();
#else
    r->threads = 1;
#endif
    const Shape in = g->tensors[g->input].shape;
    const int K = t.K, N = in.n;
    const size_t n_in = shape_numel(in), n_labels = (size_t)N * t.per_image;
    // synthetic data: images 0..255, labels 0..K-1
    float *host_in = malloc(sizeof(float) * n_in);
    int32_t *host_lab = malloc(sizeof(int32_t) * n_labels);
    int64_t *cm = calloc((size_t)K * K, sizeof(int64_t));
    double *times = malloc(sizeof(double) * (size_t)(c->steps > 0 ? c->steps : 1));
    double *layer_s = c->profile ? calloc(2 * (size_t)g->n_layers, sizeof(double)) : NULL;
    snCheck(host_in && host_lab && cm && times && (!c->profile || layer_s), "out of host memory");
    Rng rng;
    rng_seed(&rng, c->seed ^ 0x62656e6368ull);
    for (size_t i = 0; i < n_in; i++) host_in[i] = (float)(rng_next(&rng) % 256);
    for (size_t i = 0; i < n_labels; i++) host_lab[i] = (int32_t)(rng_next(&rng) % (uint64_t)K);
    double rest_s = 0.0;  // what the layers' times leave of the timed steps: loss, optimiser, copies
    for (int step = 0; step < c->warmup + c->steps; step++) {
        const int timed = step >= c->warmup;
        double layers_before = 0.0;
        if (layer_s) for (int i = 0; i < 2 * g->n_layers; i++) layers_before += layer_s[i];
        t.net.layer_seconds = timed ? layer_s : NULL;
        double t0 = now_seconds();  // train_step returns when the device has finished the step (its one wait)
        MicroBatch mb = {N, host_in, host_lab, 0};
        PassTotals pt = {0.0, 0.0, cm};
        train_step(&t, &mb, 1, &pt);
        double dt = now_seconds() - t0;
        if (timed) {
            times[step - c->warmup] = dt;
            if (layer_s) {
                double layers = -layers_before;
                for (int i = 0; i < 2 * g->n_layers; i++) layers += layer_s[i];
                rest_s += dt - layers;
            }
        }
    }
    int n = c->steps > 0 ? c->steps : 0;
    qsort(times, (size_t)n, sizeof(double), cmp_double);
    double med = n ? (n % 2 ? times[n / 2] : 0.5 * (times[n / 2 - 1] + times[n / 2])) : 0.0;
    r->step_ms = 1e3 * med;
    r->images_per_s = med > 0.0 ? N / med : 0.0;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    r->peak_rss_bytes = (size_t)ru.ru_maxrss * 1024;
    r->peak_device_bytes = cpu_bytes_peak;
#ifdef SEGNET_CUDA
    if (o == &ops_cuda) r->peak_device_bytes = cuda_bytes_peak;
#endif
    if (c->profile && n) {
        for (int i = 0; i < g->n_layers; i++) {
            const Layer *l = &g->layers[i];
            BenchKind k = bench_kind(g, l);
            r->kind_fwd_ms[k] += 1e3 * layer_s[i] / n;
            r->kind_bwd_ms[k] += 1e3 * layer_s[g->n_layers + i] / n;
            if (l->kind == LAYER_CONV && k != BK_SE) {
                double f = conv_flops(g, l);
                int grads_w = !l->frozen, grads_x = t.net.needs_grad[l->in[0]];
                r->kind_gflop[k] += 1e-9 * f * (1 + grads_w + grads_x);
            }
        }
        r->kind_bwd_ms[BK_REST] += 1e3 * rest_s / n;
    }
    free(host_in); free(host_lab); free(cm); free(times); free(layer_s);
    trainer_close(&t);
    return 0;
}

// ----------------------------------------------------------------------------
// command line

// what `segnet train` with no options runs (make train): the bundled data set
#define QUICKSTART_ARGS "--model unet --depth 3 --width 16 --size 64x64 --data data/train --val data/val " \
    "--classes 4 --class-weights 0,1,1,1 --batch 8 --epochs 12 --schedule cosine --augment flip"

// A message on one printable line: bytes below 0x20 and 0x7f (from file names,
// file contents, a decoder's reason) shown as \xNN. UTF-8 stays as it is.
static void print_message(FILE *to, const char *who, const char *msg) {
    fputs(who, to);
    fputs(": ", to);
    for (const unsigned char *p = (const unsigned char *)msg; *p; p++) {
        if (*p < 0x20 || *p == 0x7f) fprintf(to, "\\x%02x", *p);
        else fputc(*p, to);
    }
    fputc('\n', to);
}

// strict integer option: the whole value must be a number in [lo, hi]
static int parse_int(const char *flag, const char *v, int lo, int hi, int *out) {
    char *end;
    long x = strtol(v, &end, 10);
    if (!*v || *end || x < lo || x > hi) {
        fprintf(stderr, "segnet: %s '%s' is not an integer in %d..%d\n", flag, v, lo, hi);
        return -1;
    }
    *out = (int)x;
    return 0;
}

// --max-pixels N: the largest width × height an image file may declare (process-wide, like --threads)
static int parse_max_pixels(const char *flag, const char *v) {
    int n;
    if (parse_int(flag, v, 1, INT32_MAX, &n)) return -1;
    image_max_pixels = n;
    return 0;
}

// --exif ignore|apply: images as stored or as their EXIF orientation displays them (process-wide, like --max-pixels)
static int parse_exif(const char *flag, const char *v) {
    for (int k = 0; k < 2; k++)
        if (!strcmp(v, EXIF_MODE_NAMES[k])) { image_exif = (ExifMode)k; return 0; }
    fprintf(stderr, "segnet: %s '%s' must be ignore or apply\n", flag, v);
    return -1;
}

// Parses the model options shared by plan (and later train, predict, bench).
// Returns the number of arguments consumed at argv[i] (0: not a model option), -1 on error.
static int parse_model_option(ModelCfg *c, int argc, char **argv, int i) {
    const char *f = argv[i];
    int is_model_flag = !strcmp(f, "--model") || !strcmp(f, "--classes") || !strcmp(f, "--size") ||
                        !strcmp(f, "--batch") || !strcmp(f, "--padding") || !strcmp(f, "--head-hidden") ||
                        !strcmp(f, "--depth") || !strcmp(f, "--width") || !strcmp(f, "--dropout");
    if (!is_model_flag) return 0;
    if (i + 1 >= argc) { fprintf(stderr, "segnet: %s needs a value\n", f); return -1; }
    const char *v = argv[i + 1];
    if (!strcmp(f, "--model")) c->model = v;
    else if (!strcmp(f, "--classes")) { if (parse_int(f, v, 1, 1 << 20, &c->classes)) return -1; }
    else if (!strcmp(f, "--batch")) { if (parse_int(f, v, 1, 1 << 16, &c->batch)) return -1; }
    else if (!strcmp(f, "--head-hidden")) { if (parse_int(f, v, 0, 1 << 20, &c->head_hidden)) return -1; }
    else if (!strcmp(f, "--dropout")) {
        char *end;
        double r = strtod(v, &end);
        if (end == v || *end || !(r >= 0.0 && r < 1.0)) {
            fprintf(stderr, "segnet: --dropout '%s' must be a rate in [0, 1)\n", v);
            return -1;
        }
        c->dropout = (float)r;
    }
    else if (!strcmp(f, "--depth")) { if (parse_int(f, v, 1, 8, &c->depth)) return -1; }
    else if (!strcmp(f, "--width")) { if (parse_int(f, v, 1, 1 << 16, &c->width_base)) return -1; }
    else if (!strcmp(f, "--padding")) {
        c->pad_given = PAD_OPTION;
        if (!strcmp(v, "same")) c->pad = PAD_SAME;
        else if (!strcmp(v, "symmetric")) c->pad = PAD_SYMMETRIC;
        else { fprintf(stderr, "segnet: --padding '%s' must be same or symmetric\n", v); return -1; }
    } else {  // --size HxW
        int h, w, k;
        if (sscanf(v, "%dx%d%n", &h, &w, &k) != 2 || v[k] || h < 1 || w < 1 || h > 1 << 15 || w > 1 << 15) {
            fprintf(stderr, "segnet: --size '%s' must be HxW, e.g. 384x384\n", v);
            return -1;
        }
        c->height = h; c->width = w;
    }
    return 2;
}

// the input size a model is used at when --size is not given (Keras' defaults for V2-S/M/L)
static void model_default_size(ModelCfg *c) {
    int side = 256;
    if (!strcmp(c->model, "effv2-s")) side = 384;
    else if (!strcmp(c->model, "effv2-m") || !strcmp(c->model, "effv2-l")) side = 480;
    else if (!strcmp(c->model, "effv2-t")) side = 64;
    c->height = c->width = side;
}

static int parse_float(const char *flag, const char *v, float lo, float *out) {
    char *end;
    double x = strtod(v, &end);
    if (!*v || *end || !(x >= lo) || isinf(x)) {
        fprintf(stderr, "segnet: %s '%s' is not a number ≥ %g\n", flag, v, lo);
        return -1;
    }
    *out = (float)x;
    return 0;
}

static int parse_augment(const char *v, Augment *a) {
    memset(a, 0, sizeof *a);
    if (!strcmp(v, "none")) return 0;
    char buf[256];
    snprintf(buf, sizeof buf, "%s", v);
    for (char *save = NULL, *item = strtok_r(buf, ",", &save); item; item = strtok_r(NULL, ",", &save)) {
        char *end;
        if (!strcmp(item, "flip")) a->flip = 1;
        else if (!strncmp(item, "brightness=", 11)) {
            a->brightness = strtof(item + 11, &end);
            if (item[11] == 0 || *end || !(a->brightness >= 0.0f && a->brightness <= 1.0f)) goto bad;
        } else if (!strncmp(item, "contrast=", 9)) {
            a->contrast_lo = strtof(item + 9, &end);
            if (*end != ':') goto bad;
            char *hi = end + 1;
            a->contrast_hi = strtof(hi, &end);
            if (!*hi || *end || !(a->contrast_lo > 0.0f && a->contrast_lo <= a->contrast_hi)) goto bad;
        } else goto bad;
        continue;
    bad:
        fprintf(stderr, "segnet: --augment item '%s' must be flip, brightness=D (0..1) or contrast=LO:HI (0 < LO ≤ HI)\n", item);
        return -1;
    }
    return 0;
}

// --device cpu|cuda|auto
static int parse_device(const char *v, Device *d) {
    for (int k = 0; k < 3; k++)
        if (!strcmp(v, DEVICE_NAMES[k])) { *d = (Device)k; return 0; }
    fprintf(stderr, "segnet: --device '%s' must be cpu, cuda or auto\n", v);
    return -1;
}

// "12G", "512M", "1.5G", or bytes
static int parse_bytes(const char *v, size_t *out) {
    char *end;
    double x = strtod(v, &end);
    double unit = !strcmp(end, "") ? 1 : !strcasecmp(end, "K") ? 1024.0 : !strcasecmp(end, "M") ? 1048576.0
                : !strcasecmp(end, "G") ? 1073741824.0 : -1;
    if (end == v || unit < 0 || !(x > 0) || x * unit > 1e18) {
        fprintf(stderr, "segnet: --memory '%s' must be a size such as 12G, 512M or a number of bytes\n", v);
        return -1;
    }
    *out = (size_t)(x * unit);
    return 0;
}

typedef struct {
    TrainCfg c;
    const char *class_weights, *resume, *run;
    const char *monitor;  // --monitor's metric name as given (checked against the model)
    int size_given;
    size_t memory;      // --memory: pick the setting that fits (0: not given)
    int fixed;          // --checkpoint or --precision given
    char **kept;        // config.txt's words, which c points into; train_args_free frees them
    int n_kept;
} TrainArgs;

static void train_args_free(TrainArgs *a) {
    for (int i = 0; i < a->n_kept; i++) free(a->kept[i]);
    free(a->kept);
    a->kept = NULL;
    a->n_kept = 0;
}

// Parses one train/eval option at argv[i]. Returns the arguments consumed
// (0: unknown), -1 on error.
static int parse_train_option(TrainArgs *a, int argc, char **argv, int i) {
    TrainCfg *c = &a->c;
    const char *f = argv[i];
    a->size_given |= !strcmp(f, "--size");
    if (!strcmp(f, "--sync-bn") || !strcmp(f, "--train-eval")) {  // switches; config.txt spells them `... = on|off`
        int valued = i + 1 < argc && (!strcmp(argv[i + 1], "on") || !strcmp(argv[i + 1], "off"));
        *(!strcmp(f, "--sync-bn") ? &c->sync_bn : &c->train_eval) = !valued || !strcmp(argv[i + 1], "on");
        return valued ? 2 : 1;
    }
    int k = parse_model_option(&c->model, argc, argv, i);
    if (k) return k;
    static const char *const FLAGS[] = {"--data", "--val", "--out", "--resume", "--weights", "--class-weights", "--epochs",
                                        "--lr", "--adam-eps", "--weight-decay", "--clipnorm", "--schedule", "--warmup",
                                        "--early-stopping", "--augment", "--seed", "--threads", "--workers", "--loss-norm",
                                        "--run", "--precision", "--accum", "--freeze", "--unfreeze-last", "--checkpoint",
                                        "--memory", "--device", "--replicas", "--allow-missing", "--monitor", "--min-delta",
                                        "--max-pixels", "--log-every", "--exif"};
    int known = 0;
    for (size_t j = 0; j < sizeof FLAGS / sizeof *FLAGS; j++) known |= !strcmp(f, FLAGS[j]);
    if (!known) return 0;
    if (i + 1 >= argc) { fprintf(stderr, "segnet: %s needs a value\n", f); return -1; }
    const char *v = argv[i + 1];
    int rc = 0, seed;
    a->fixed |= !strcmp(f, "--checkpoint") || !strcmp(f, "--precision");
    if (!strcmp(f, "--data")) c->data = v;
    else if (!strcmp(f, "--memory")) rc = parse_bytes(v, &a->memory);
    else if (!strcmp(f, "--device")) rc = parse_device(v, &c->device);
    else if (!strcmp(f, "--val")) c->val = v;
    else if (!strcmp(f, "--out")) c->out = v;
    else if (!strcmp(f, "--resume")) a->resume = v;
    else if (!strcmp(f, "--run")) a->run = v;
    else if (!strcmp(f, "--weights")) c->weights = v;
    else if (!strcmp(f, "--allow-missing")) c->allow_missing = v;
    else if (!strcmp(f, "--class-weights")) a->class_weights = v;
    else if (!strcmp(f, "--epochs")) rc = parse_int(f, v, 1, 1 << 20, &c->epochs);
    else if (!strcmp(f, "--warmup")) rc = parse_int(f, v, 0, 1 << 30, &c->warmup);
    else if (!strcmp(f, "--early-stopping")) rc = parse_int(f, v, 0, 1 << 20, &c->patience);
    else if (!strcmp(f, "--min-delta")) rc = parse_float(f, v, 0.0f, &c->min_delta);
    else if (!strcmp(f, "--monitor")) {
        if (!strcmp(v, "val_loss")) c->monitor_metric = 0;
        else if (!strcmp(v, "val_mIoU") || !strcmp(v, "val_accuracy")) { c->monitor_metric = 1; a->monitor = v; }
        else { fprintf(stderr, "segnet: --monitor '%s' must be val_loss, val_mIoU or val_accuracy\n", v); rc = -1; }
    }
    else if (!strcmp(f, "--threads")) rc = parse_int(f, v, 1, 4096, &c->threads);
    else if (!strcmp(f, "--max-pixels")) rc = parse_max_pixels(f, v);
    else if (!strcmp(f, "--exif")) rc = parse_exif(f, v);
    else if (!strcmp(f, "--workers")) rc = parse_int(f, v, 1, 256, &c->workers);
    else if (!strcmp(f, "--accum")) rc = parse_int(f, v, 1, SN_MAX_ACCUM, &c->accum);
    else if (!strcmp(f, "--log-every")) rc = parse_int(f, v, 0, 1 << 30, &c->log_every);
    else if (!strcmp(f, "--replicas")) rc = parse_int(f, v, 1, SN_MAX_REPLICAS, &c->replicas);
    else if (!strcmp(f, "--unfreeze-last")) rc = parse_int(f, v, 0, 1 << 20, &c->unfreeze_last);
    else if (!strcmp(f, "--checkpoint")) {
        if (!strcmp(v, "blocks")) c->checkpoint = 1;
        else if (!strcmp(v, "none")) c->checkpoint = 0;
        else { fprintf(stderr, "segnet: --checkpoint '%s' must be none or blocks\n", v); rc = -1; }
    } else if (!strcmp(f, "--freeze")) {
        if (!strcmp(v, "base")) c->freeze_base = 1;
        else if (!strcmp(v, "none")) c->freeze_base = 0;
        else { fprintf(stderr, "segnet: --freeze '%s' must be base or none\n", v); rc = -1; }
    } else if (!strcmp(f, "--precision")) {
        int k = 0;
        while (k < 3 && strcmp(v, DTYPE_NAMES[k])) k++;
        if (k == 3) { fprintf(stderr, "segnet: --precision '%s' must be fp32, fp16 or bf16\n", v); rc = -1; }
        else c->precision = (DType)k;
    }
    else if (!strcmp(f, "--seed")) { rc = parse_int(f, v, 0, 2147483647, &seed); c->seed = (uint64_t)seed; }
    else if (!strcmp(f, "--lr")) rc = parse_float(f, v, 0.0f, &c->lr);
    else if (!strcmp(f, "--adam-eps")) rc = parse_float(f, v, 0.0f, &c->adam_eps);
    else if (!strcmp(f, "--weight-decay")) rc = parse_float(f, v, 0.0f, &c->weight_decay);
    else if (!strcmp(f, "--clipnorm")) rc = parse_float(f, v, 0.0f, &c->clipnorm);
    else if (!strcmp(f, "--augment")) rc = parse_augment(v, &c->augment);
    else if (!strcmp(f, "--schedule")) {
        if (!strcmp(v, "constant")) c->schedule = SCHEDULE_CONSTANT;
        else if (!strcmp(v, "cosine")) c->schedule = SCHEDULE_COSINE;
        else { fprintf(stderr, "segnet: --schedule '%s' must be constant or cosine\n", v); rc = -1; }
    } else {  // --loss-norm
        if (!strcmp(v, "weighted")) c->loss_norm_keras = 0;
        else if (!strcmp(v, "keras")) c->loss_norm_keras = 1;
        else { fprintf(stderr, "segnet: --loss-norm '%s' must be weighted or keras\n", v); rc = -1; }
    }
    return rc ? -1 : 2;
}

// K comma-separated weights, each a finite number ≥ 0
static int parse_class_weights(const char *v, int K, float *w) {
    int n = 0;
    for (const char *s = v;; n++) {
        char *end;
        double x = strtod(s, &end);
        if (end == s || (*end && *end != ',') || !(x >= 0.0) || isinf(x)) {
            fprintf(stderr, "segnet: --class-weights '%s': item %d is not a number ≥ 0\n", v, n + 1);
            return -1;
        }
        if (n < K) w[n] = (float)x;
        if (!*end) { n++; break; }
        s = end + 1;
    }
    if (n != K) { fprintf(stderr, "segnet: --class-weights has %d values but there are %d classes\n", n, K); return -1; }
    return 0;
}

// RUN/config.txt as options: every `key = value` line is `--key value`.
static int read_run_config(TrainArgs *a, const char *run) {
    char path[4200], line[4096];
    snprintf(path, sizeof path, "%s/config.txt", run);
    char err[SN_ERR_MAX];
    FILE *f = fopen_regular(path, "r", err);
    if (!f) {
        char line1[SN_ERR_MAX + 32];
        snprintf(line1, sizeof line1, "%s (not a run folder?)", err);
        print_message(stderr, "segnet", line1);
        return -1;
    }
    int rc = 0;
    for (int row = 1; rc == 0 && fgets(line, sizeof line, f); row++) {
        line[strcspn(line, "\r\n")] = 0;
        if (!line[0] || line[0] == '#') continue;
        char *eq = strstr(line, " = ");
        if (!eq) { fprintf(stderr, "segnet: %s: line %d: expected `key = value`\n", path, row); rc = -1; break; }
        *eq = 0;
        char flag[256];
        snprintf(flag, sizeof flag, "--%.200s", line);
        char **grown = realloc(a->kept, sizeof(char *) * (size_t)(a->n_kept + 2));
        snCheck(grown != NULL, "out of host memory");
        a->kept = grown;
        char *argv2[2] = {strdup(flag), strdup(eq + 3)};  // kept: the config points into them
        snCheck(argv2[0] && argv2[1], "out of host memory");
        a->kept[a->n_kept++] = argv2[0];
        a->kept[a->n_kept++] = argv2[1];
        int k = parse_train_option(a, 2, argv2, 0);
        if (k == 0) fprintf(stderr, "segnet: %s: line %d: unknown setting '%s'\n", path, row, line);
        if (k <= 0) rc = -1;
    }
    fclose(f);
    a->size_given = 1;
    return rc;
}

// Parses train/eval arguments (argv[2..]); `usage` is printed for --help.
// Returns 0, 1 after --help, -1 on error.
static int parse_train_args(TrainArgs *a, int argc, char **argv, const char *cmd, const char *usage) {
    train_cfg_default(&a->c);
    a->c.device = DEVICE_AUTO;
    for (int i = 2; i < argc;) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(usage, stdout); return 1; }
        int k = parse_train_option(a, argc, argv, i);
        if (k < 0) return -1;
        if (k == 0) { fprintf(stderr, "segnet %s: unknown option '%s' (see segnet %s --help)\n", cmd, argv[i], cmd); return -1; }
        i += k;
    }
    const char *base = a->resume ? a->resume : a->run;
    if (base) {  // the run's settings first, then the command line's on top
        TrainArgs cli = *a;
        train_cfg_default(&a->c);
        a->c.device = DEVICE_AUTO;  // a config.txt written before --device existed
        a->class_weights = NULL;
        if (read_run_config(a, base)) return -1;
        for (int i = 2, k; i < argc; i += k) if ((k = parse_train_option(a, argc, argv, i)) <= 0) return -1;
        a->resume = cli.resume; a->run = cli.run;
    }
    if (!a->size_given) model_default_size(&a->c.model);
    if (a->c.model.classes > SN_MAX_CLASSES) { fprintf(stderr, "segnet %s: at most %d classes\n", cmd, SN_MAX_CLASSES); return -1; }
    if (a->monitor && strcmp(a->monitor, monitor_name(&a->c))) {
        fprintf(stderr, "segnet %s: --monitor %s: model '%s' reports %s\n", cmd, a->monitor, a->c.model.model,
                monitor_name(&a->c));
        return -1;
    }
    if (a->class_weights) {
        if (parse_class_weights(a->class_weights, a->c.model.classes, a->c.class_weights)) return -1;
        a->c.class_weights_given = 1;
    }
    return 0;
}

#ifndef TESTING

static const char *USAGE =
    "segnet: train U-Net segmentation and EfficientNetV2 classification models\n"
    "\n"
    "usage: segnet COMMAND [options]\n"
    "\n"
    "commands:\n"
    "  plan      print a model's stages and the memory a training step takes;\n"
    "            --memory 12G picks the fastest setting that fits\n"
    "  predict   run a trained model on images: class rows (CSV) for a classifier,\n"
    "            mask and overlay PNGs for a segmentation model\n"
    "  train     train a model and write a run folder (no options: the quickstart\n"
    "            on the bundled data/, as `make train`)\n"
    "  eval      print a model's validation loss and metrics on a data set\n"
    "  export    write a run's weights for PyTorch (torchvision or timm names)\n"
    "  bench     time training steps on synthetic data (segnet bench --help)\n"
    "  info      print the build: backend, BLAS, threads\n"
    "  help      this text (also --help, -h); segnet COMMAND --help for a command\n"
    "\n"
    "The test suite is `make test`; see README.md.\n";

static void print_shape(Shape s) {
    char buf[64];
    snprintf(buf, sizeof buf, "(%d,%d,%d,%d)", s.n, s.h, s.w, s.c);
    printf("%-22s", buf);
}

static const char *TRAIN_USAGE =
    "usage: segnet train --data TRAIN --classes K [options]\n"
    "       segnet train --resume RUN [options that override RUN/config.txt, e.g. --epochs]\n"
    "       segnet train              (no options: the quickstart, see below)\n"
    "\n"
    "Trains a model and writes a run folder: config.txt (every setting),\n"
    "metrics.csv (one row per epoch), curves.svg, last.safetensors (weights, BN\n"
    "statistics, Adam moments, step) after every epoch and best.safetensors for\n"
    "the epoch with the lowest val_loss (loss without --val). metrics.csv ends\n"
    "with the epoch's optimisation diagnostics: grad_norm_mean, grad_norm_max (the\n"
    "global gradient norm before clipping, over the applied steps), clip_fraction\n"
    "(steps that --clipnorm scaled down), loss_scale (fp16, after the epoch),\n"
    "skipped_steps (fp16 overflow: no update), update_ratio (|dw|/|w| of the\n"
    "trainable weights in the epoch's last step) and step_ms; curves.svg draws\n"
    "them, and warnings name what to change when clipping acts on most steps,\n"
    "overflow skips steps, or the train metric falls below the validation one.\n"
    "Files are replaced\n"
    "atomically; a run folder that holds another run's files is never\n"
    "overwritten (unless --overwrite), and one run at a time writes it\n"
    "(RUN/.lock). Ctrl-C, SIGTERM, SIGHUP (the terminal closed) or SIGPIPE (the\n"
    "reader of its output gone): the step ends, last.safetensors keeps the place\n"
    "inside the epoch, --resume RUN goes on from it exactly (exit 128 + the\n"
    "signal: 130 for Ctrl-C); a second Ctrl-C stops at once. A model that is no\n"
    "longer finite (NaN or inf in a weight, a batch-norm statistic or Adam's\n"
    "moments) stops the run with exit 1, naming the tensor; it is never saved.\n"
    "\n"
    "Data: segmentation models (unet, unet-effv2-*) read DIR/images/*.{png,jpg}\n"
    "with DIR/masks/*.png of the same name (pixel = class index, PNG only);\n"
    "classifiers (effv2-*) read a CSV `path,label` (an optional header `path,label`)\n"
    "or one sub-folder per class.\n"
    "\n"
    "  --model NAME          unet (default), unet-effv2-s|m|l|t, effv2-s|m|l|t\n"
    "  --data TRAIN          training data (required)\n"
    "  --val VAL             validation data (default: none)\n"
    "  --classes K           number of classes (required)\n"
    "  --class-weights LIST  K comma-separated weights ≥ 0 (default all 1); weight 0\n"
    "                        ignores a class, e.g. 0 = \"not annotated\"\n"
    "  --loss-norm MODE      weighted (default): Σ w·nll / Σ w over the batch;\n"
    "                        keras: Keras' loss, p[y] clipped to [1e-7, 1-1e-7] before\n"
    "                        the log (no gradient where clipped), Σ w·nll / pixels\n"
    "  --size HxW            input size, images are resized to it (default: unet\n"
    "                        256x256, effv2-s 384x384, effv2-m/l 480x480, effv2-t 64x64)\n"
    "  --batch B             images per step (default 8)\n"
    "  --epochs E            (default 10)\n"
    "  --lr LR               Adam learning rate (default 0.001)\n"
    "  --adam-eps EPS        Keras' epsilon-hat (default 1e-07)\n"
    "  --weight-decay WD     decoupled weight decay, AdamW (default 0)\n"
    "  --clipnorm C          clip the gradient's global norm to C (default 0: off)\n"
    "  --schedule S          constant (default) or cosine (decays to 0 at the end)\n"
    "  --warmup STEPS        linear warm-up steps (default 0)\n"
    "  --early-stopping P    stop when the monitored value has not improved for P\n"
    "                        epochs (default 0: off; needs --val)\n"
    "  --monitor M           what early stopping and best.safetensors watch: val_loss\n"
    "                        (default), val_mIoU (segmentation) or val_accuracy\n"
    "                        (classification); without --val the training values\n"
    "  --min-delta D         an epoch improves only by more than D (default 0), as\n"
    "                        Keras' EarlyStopping(min_delta)\n"
    "  --augment LIST        none (default) or any of flip, brightness=D,\n"
    "                        contrast=LO:HI (tf.image semantics), comma-separated\n"
    "  --weights W           initial weights (safetensors, torchvision or timm\n"
    "                        names); a classifier's head may differ in classes or\n"
    "                        be absent; a unet-effv2-* takes its encoder from an\n"
    "                        EfficientNetV2 classifier's weights (decoder and head\n"
    "                        initialised, the classifier's head ignored); one line\n"
    "                        `weights: ...` reports what was loaded\n"
    "  --allow-missing P     with --weights: tensors whose names start with P\n"
    "                        (comma-separated prefixes) may be absent from the file\n"
    "                        or of another shape and are initialised\n"
    "  --out RUN             run folder (default runs/<date>-<time>); one that holds\n"
    "                        another run's files is refused\n"
    "  --overwrite           start a new run in --out RUN, replacing the files of the\n"
    "                        run there (checkpoints, metrics, settings)\n"
    "  --resume RUN          continue RUN from its last.safetensors; the result\n"
    "                        equals an uninterrupted run bit for bit\n"
    "  --precision P         activation storage: fp32 (default), fp16 (dynamic loss\n"
    "                        scaling as Keras: from 2^15, halve and skip the update on\n"
    "                        inf/NaN, double after 2000 finite steps) or bf16; weights\n"
    "                        and Adam state stay fp32\n"
    "  --accum K             K micro-batches of --batch images per optimiser step; the\n"
    "                        loss is normalised over the whole step (default 1)\n"
    "  --memory SIZE         e.g. 12G: choose --batch/--accum (keeping the global batch),\n"
    "                        --checkpoint and --precision so that the run fits, as\n"
    "                        segnet plan --memory does\n"
    "  --checkpoint MODE     none (default) or blocks: keep only each block's inputs in\n"
    "                        the forward and recompute the block before its backward\n"
    "                        (less memory, the same result bit for bit)\n"
    "  --freeze base         train only the head/decoder: the backbone (EfficientNetV2\n"
    "                        trunk, U-Net encoder) is frozen, its BN in inference mode\n"
    "                        (default none)\n"
    "  --unfreeze-last N     with --freeze base, also train the backbone's last N blocks\n"
    "  --replicas N          N data-parallel replicas in this process, each on B/N\n"
    "                        images of every batch B (under `mpirun -np N`: one per\n"
    "                        process); loss, gradients and metrics are those of the\n"
    "                        global batch, so N does not change the result\n"
    "  --sync-bn             batch norm statistics over the global batch (fp64 sums,\n"
    "                        all-reduced): N replicas then train as one does; without\n"
    "                        it each replica normalises its own shard (Keras)\n"
    "  --log-every N         every N optimiser steps a row of steps.csv in the run\n"
    "                        folder: step, epoch, lr, loss and the diagnostics below\n"
    "                        over those N steps (default 0: none)\n"
    "  --train-eval          at each epoch's end, measure the training set again in\n"
    "                        inference mode (as the validation set is) for the train\n"
    "                        columns; without it they are measured while training\n"
    "                        (dropout on, batch norm with batch statistics)\n"
    "  --seed S              initialisation, data order, augmentation, dropout (default 1)\n"
    "  --device D            auto (default: the GPU if there is one, else the CPU,\n"
    "                        saying so), cuda or cpu\n"
    "  --threads T           CPU threads (default: all cores; shared by --replicas)\n"
    "  --workers N           data loading threads (default 1)\n"
    "  --max-pixels N        refuse an image whose header declares more than N pixels\n"
    "                        (default " TEXT_OF(IMAGE_MAX_PIXELS_DEFAULT) "), before decoding it\n"
    "  --exif MODE           a JPEG's EXIF orientation (a phone's turned photos): ignore\n"
    "                        (default: the pixels as stored, as tf.image and Keras) or\n"
    "                        apply (as displayed: the view masks are drawn on); kept\n"
    "                        in config.txt for --resume, eval --run and predict --run\n"
    "  --padding MODE        EfficientNetV2 convs: same or symmetric; default: as the\n"
    "                        --weights were trained (torchvision names symmetric,\n"
    "                        timm's SAME, segnet's recorded), else same\n"
    "  --head-hidden H       classifier hidden layer width (default 0: none); the\n"
    "                        seed's Keras head GAP → Dropout 0.2 → Dense 128 ReLU →\n"
    "                        Dropout 0.2 → Dense K is --head-hidden 128 --dropout 0.2\n"
    "  --dropout R           the classifier head's dropout rate (both dropouts with\n"
    "                        --head-hidden; default torchvision's: effv2-s 0.2,\n"
    "                        effv2-m 0.3, effv2-l 0.4)\n"
    "  --depth D, --width W  unet levels below the top (default 4), channels at the top (32)\n"
    "\n"
    "The quickstart (`segnet train` with no options, or `make train`, from the\n"
    "repository root) is:\n"
    "  segnet train " QUICKSTART_ARGS "\n";

static const char *EVAL_USAGE =
    "usage: segnet eval --run RUN [--data VAL]\n"
    "       segnet eval --weights W.safetensors --model NAME --classes K --data VAL [options]\n"
    "\n"
    "Evaluates weights on a data set and prints one metric per line, `name: value`:\n"
    "val_loss, then val_mIoU, val_pixel_accuracy and val_IoU_<class> (segmentation)\n"
    "or val_accuracy (classification). With --run, the run's config.txt gives the\n"
    "model and class weights, best.safetensors the weights and its validation set\n"
    "the data (unless --data is given). Otherwise the model options are those of\n"
    "segnet train (--model, --classes, --class-weights, --size, --padding, ...).\n"
    "  --batch B    images per forward pass (default 8)\n"
    "  --device D   auto (default), cuda or cpu, as for segnet train\n"
    "  --threads T  CPU threads\n"
    "  --max-pixels N  the largest image, width × height (default " TEXT_OF(IMAGE_MAX_PIXELS_DEFAULT) ")\n"
    "  --exif MODE     ignore or apply a JPEG's EXIF orientation, as for segnet\n"
    "                  train (default: the run's, else ignore)\n";

// --memory: choose the setting, print what was tried and picked; -1 if nothing fits
static int pick_setting(TrainArgs *a, const char *cmd, FILE *out) {
    if (a->fixed) { fprintf(stderr, "segnet %s: --memory chooses --checkpoint and --precision; leave them out\n", cmd); return -1; }
    char why[8192], err[SN_ERR_MAX];
    int global = a->c.model.batch * a->c.accum, rc = choose_setting(&a->c, a->memory, why, sizeof why, err);
    fprintf(out, "settings tried for %.2f GiB, global batch %d:\n%s", a->memory / 1073741824.0, global, why);
    if (rc) {
        char who[64];
        snprintf(who, sizeof who, "segnet %s", cmd);
        print_message(stderr, who, err);
        return -1;
    }
    fprintf(out, "picked: --batch %d --accum %d --precision %s --checkpoint %s\n", a->c.model.batch, a->c.accum,
            DTYPE_NAMES[a->c.precision], a->c.checkpoint ? "blocks" : "none");
    return 0;
}

static int has_flag(int argc, char **argv, const char *flag) {
    for (int i = 2; i < argc; i++) if (!strcmp(argv[i], flag)) return 1;
    return 0;
}

// An option on the command line that does nothing for the model is refused
// (a run would record it as if it did): the classifier head's for a U-Net,
// the plain unet's levels and channels for the others.
static int model_options_used(const char *cmd, const char *model, int argc, char **argv) {
    static const struct { const char *flag; int head; } OWN[] = {
        {"--head-hidden", 1}, {"--dropout", 1}, {"--depth", 0}, {"--width", 0}};
    for (size_t k = 0; k < sizeof OWN / sizeof *OWN; k++) {
        if (!has_flag(argc, argv, OWN[k].flag)) continue;
        if (OWN[k].head && !model_is_classifier(model))
            fprintf(stderr, "segnet %s: %s: model '%s' has no classifier head (an option of the classifiers, effv2-*)\n", cmd,
                    OWN[k].flag, model);
        else if (!OWN[k].head && strcmp(model, "unet"))
            fprintf(stderr, "segnet %s: %s: model '%s' does not use it (the levels and channels of the plain unet)\n", cmd,
                    OWN[k].flag, model);
        else
            continue;
        return -1;
    }
    return 0;
}

// SIGINT, SIGTERM, SIGHUP (the terminal or ssh session closed) and SIGPIPE
// (the reader of stdout or stderr gone, as `| head` does) set interrupt_signal
// (see run_pass): the step finishes and the run saves. A second SIGINT, SIGTERM
// or SIGHUP exits at once. SIGPIPE comes again with every write to the broken
// pipe: those writes fail (EPIPE) and the progress they carried is dropped.
static void on_interrupt(int sig) {
    if (sig == SIGPIPE) {
        if (!interrupt_signal) interrupt_signal = sig;
        return;
    }
    if (interrupt_signal && interrupt_signal != SIGPIPE) _exit(128 + sig);
    interrupt_signal = sig;
    static const char msg[] = "\nsegnet train: stopping after this step to save the run (again to stop at once)\n";
    ssize_t n = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)n;
}

static void interrupt_handlers_install(void) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = on_interrupt;
    sa.sa_flags = SA_RESTART;  // reads and writes in progress go on
    sigemptyset(&sa.sa_mask);
    const int signals[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE};
    for (size_t k = 0; k < sizeof signals / sizeof *signals; k++) sigaction(signals[k], &sa, NULL);
}

// A command's arguments, which hold the words of a run's config.txt when it
// reads one (--run, --resume): freed after the command, whatever it returns.
static int with_train_args(int (*cmd)(TrainArgs *, int, char **), int argc, char **argv) {
    TrainArgs a = {0};
    int rc = cmd(&a, argc, argv);
    train_args_free(&a);
    return rc;
}

static int cmd_train(TrainArgs *a, int argc, char **argv) {
    char *quick[64], words[] = QUICKSTART_ARGS;
    int quickstart = argc == 2;
    if (quickstart) {  // `segnet train` alone: the bundled data set
        quick[0] = argv[0]; quick[1] = argv[1];
        argc = 2;
        for (char *save = NULL, *w = strtok_r(words, " ", &save); w && argc < 64; w = strtok_r(NULL, " ", &save)) quick[argc++] = w;
        argv = quick;
    }
    int overwrite = 0;  // train's own switch (eval shares the other options): taken out before parsing
    for (int i = 2; i < argc; i++)
        if (!strcmp(argv[i], "--overwrite")) {
            overwrite = 1;
            memmove(&argv[i], &argv[i + 1], sizeof(char *) * (size_t)(argc - i - 1));
            argc--; i--;
        }
    int p = parse_train_args(a, argc, argv, "train", TRAIN_USAGE);
    if (p) return p > 0 ? 0 : 2;
    if (model_options_used("train", a->c.model.model, argc, argv)) return 2;
    a->c.overwrite = overwrite;
    if (a->resume && (a->c.out || overwrite)) {
        fprintf(stderr, "segnet train: --resume %s continues the run in its own folder; %s\n", a->resume,
                overwrite ? "--overwrite starts a new run (give --out instead of --resume)"
                          : "--out would be another one (a new run from its weights: --weights RUN/best.safetensors --out NEW)");
        return 2;
    }
    if (!a->resume && (!a->c.data || !has_flag(argc, argv, "--classes"))) {
        fprintf(stderr, "segnet train: --data and --classes are required (see segnet train --help)\n");
        return 2;
    }
    if (quickstart) fprintf(stderr, "segnet train: the quickstart: segnet train %s\n", QUICKSTART_ARGS);
    char err[SN_ERR_MAX], note[SN_ERR_MAX];
    if (!a->resume && padding_follow_weights(&a->c.model, a->c.weights, "train", note, err)) {
        print_message(stderr, "segnet train", err);
        return 1;
    }
    a->c.weights_note = note;
    if (a->memory && !a->resume && pick_setting(a, "train", stderr)) return 1;
    interrupt_handlers_install();
    const int rc = train_run(&a->c, a->resume, err);
    if (rc < 0) { print_message(stderr, "segnet train", err); return 1; }
    return rc;  // 0, or 128 + the signal that interrupted it (130 SIGINT, 143 SIGTERM)
}

static int cmd_eval(TrainArgs *a, int argc, char **argv) {
    int p = parse_train_args(a, argc, argv, "eval", EVAL_USAGE);
    if (p) return p > 0 ? 0 : 2;
    if (model_options_used("eval", a->c.model.model, argc, argv)) return 2;
    char weights[4200];
    if (a->run) snprintf(weights, sizeof weights, "%s/best.safetensors", a->run);
    else if (a->c.weights) snprintf(weights, sizeof weights, "%s", a->c.weights);
    else { fprintf(stderr, "segnet eval: give --run RUN, or --weights W with the model options (see segnet eval --help)\n"); return 2; }
    char err[SN_ERR_MAX], note[SN_ERR_MAX];
    if (!a->run && padding_follow_weights(&a->c.model, weights, "eval", note, err)) {
        print_message(stderr, "segnet eval", err);
        return 1;
    }
    const char *data = a->c.val;
    for (int i = 2; i + 1 < argc; i++) if (!strcmp(argv[i], "--data")) data = argv[i + 1];
    if (!data) { fprintf(stderr, "segnet eval: --data VAL is required\n"); return 2; }
    a->c.augment = (Augment){0};
    a->c.progress = isatty(STDERR_FILENO);
    EvalResult r;
    double iou[SN_MAX_CLASSES];
    r.m.iou = iou;
    if (eval_run(&a->c, weights, data, &r, err)) { print_message(stderr, "segnet eval", err); return 1; }
    printf("val_loss: %.6f\n", r.loss);
    if (model_is_classifier(a->c.model.model)) { printf("val_accuracy: %.6f\n", r.m.accuracy); return 0; }
    printf("val_mIoU: %.6f\nval_pixel_accuracy: %.6f\n", r.m.mean_iou, r.m.accuracy);
    for (int k = 0; k < a->c.model.classes; k++)
        if (!isnan(iou[k])) printf("val_IoU_%d: %.6f\n", k, iou[k]);
    return 0;
}

static const char *PREDICT_USAGE =
    "usage: segnet predict --run RUN --input DIR_OR_CSV --out OUT [options]\n"
    "       segnet predict --model NAME --classes K --weights W.safetensors\n"
    "                      --input DIR_OR_CSV --out OUT [options]\n"
    "\n"
    "With --run, the run's config.txt gives the model options (model, classes,\n"
    "size, padding, ...) and RUN/best.safetensors the weights (--last:\n"
    "last.safetensors); options given as well override them.\n"
    "\n"
    "Predicts every image of a folder (*.png, *.jpg, *.jpeg, sorted by name) or of\n"
    "a CSV's first column (paths relative to the CSV; a header 'path' is skipped).\n"
    "Images of the model's input size are used as they are; others are resized\n"
    "(bilinear) for the forward pass.\n"
    "\n"
    "Classifiers (effv2-*): OUT is a CSV with one row per image,\n"
    "path,pred,p0,...,p{K-1} (softmax probabilities); with --run of a run whose\n"
    "classes have names (class folders, text labels: RUN/classes.txt) also\n"
    "pred_name after pred. It is replaced only when every image was read.\n"
    "\n"
    "Segmentation models (unet, unet-effv2-*): OUT is a folder, created if missing,\n"
    "that receives for each image OUT/<stem>.png, the mask (8-bit grey, pixel =\n"
    "predicted class 0..K-1), and OUT/<stem>_overlay.png, the image blended 50/50\n"
    "with a colour per class, both at the image's own size (the mask is brought\n"
    "back by nearest neighbour); OUT/" SEG_LEGEND_NAME " shows each class's colour beside its\n"
    "number. The colours:\n"
    SEG_PALETTE_HELP
    "Every image is decoded, and no two may share a stem, before anything is\n"
    "written; each PNG is written atomically. A failure while writing (disk\n"
    "full) leaves the PNGs written before it. OUT/" PREDICT_MANIFEST " lists the files\n"
    "predict has written into OUT.\n"
    "\n"
    "Nothing the user owns is replaced: OUT may not be, or lie inside, the input\n"
    "folder; an input image or list is never replaced (whatever its path); an\n"
    "existing file only with --overwrite, and then only one that an earlier\n"
    "segnet predict wrote (listed in OUT/" PREDICT_MANIFEST ", or a CSV starting\n"
    "with its header).\n"
    "Progress goes to stderr: one line rewritten on a terminal, else a line per\n"
    "tenth of the images.\n"
    "\n"
    "  --overwrite         replace the outputs of an earlier segnet predict into OUT\n"
    "  --model NAME        effv2-s (default), effv2-m, effv2-l, effv2-t, unet,\n"
    "                      unet-effv2-s, unet-effv2-m, unet-effv2-l, unet-effv2-t\n"
    "  --weights W         safetensors in PyTorch layout (segnet, torchvision or timm\n"
    "                      names); training checkpoints load as they are\n"
    "  --padding MODE      same (Keras/TF weights) or symmetric (torchvision); default:\n"
    "                      as the weights were trained (their names or metadata), else same\n"
    "  --size HxW          input size (default: effv2-s 384x384, effv2-m/l 480x480,\n"
    "                      effv2-t 64x64, U-Nets 256x256)\n"
    "  --batch B           images per forward pass (default 8)\n"
    "  --head-hidden H     the classifier's hidden layer, as trained (default 0)\n"
    "  --depth D           unet levels below the top, as trained (default 4)\n"
    "  --width W           unet channels at the top level, as trained (default 32)\n"
    "  --device D          auto (default), cuda or cpu, as for segnet train\n"
    "  --threads T         CPU threads (default: all cores)\n"
    "  --max-pixels N      the largest image, width × height (default " TEXT_OF(IMAGE_MAX_PIXELS_DEFAULT) ")\n"
    "  --exif MODE         ignore (default; with --run: the run's) or apply a JPEG's EXIF\n"
    "                      orientation, as for segnet train; the outputs are of the\n"
    "                      image as read\n";

static int cmd_predict(TrainArgs *ta, int argc, char **argv) {
    PredictCfg pc = {model_cfg_default(), NULL, NULL, NULL, 1, DEVICE_AUTO, NULL, 0, 0};
    pc.model.model = "effv2-s";
    pc.model.batch = 8;
    int size_given = 0, classes_given = 0, last = 0;
    const char *run = NULL;
    char run_weights[4200];
    for (int i = 2; i + 1 < argc; i++) if (!strcmp(argv[i], "--run")) run = argv[i + 1];
    if (run) {  // the run's model settings first, then the command line's on top
        train_cfg_default(&ta->c);
        if (read_run_config(ta, run)) return 2;
        pc.model = ta->c.model;  // pointing into ta's words
        if (pc.model.pad_given) pc.model.pad_given = PAD_RUN;
        pc.model.batch = 8;
        size_given = classes_given = 1;
    }
    for (int i = 2; i < argc;) {
        const char *f = argv[i];
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) { fputs(PREDICT_USAGE, stdout); return 0; }
        if (!strcmp(f, "--last")) { last = 1; i++; continue; }
        if (!strcmp(f, "--overwrite")) { pc.overwrite = 1; i++; continue; }
        if (!strcmp(f, "--run")) { i += 2; continue; }
        if (!strcmp(f, "--max-pixels") || !strcmp(f, "--exif")) {
            if (i + 1 >= argc) { fprintf(stderr, "segnet predict: %s needs a value\n", f); return 2; }
            if ((!strcmp(f, "--exif") ? parse_exif : parse_max_pixels)(f, argv[i + 1])) return 2;
            i += 2;
            continue;
        }
        if (!strcmp(f, "--threads")) {
            int threads;
            if (i + 1 >= argc || parse_int(f, argv[i + 1], 1, 4096, &threads)) {
                if (i + 1 >= argc) fprintf(stderr, "segnet predict: --threads needs a value\n");
                return 2;
            }
            set_threads(threads);
            i += 2;
            continue;
        }
        const char **target = !strcmp(f, "--weights") ? &pc.weights : !strcmp(f, "--input") ? &pc.input
                            : !strcmp(f, "--out") ? &pc.out : NULL;
        if (target) {
            if (i + 1 >= argc) { fprintf(stderr, "segnet predict: %s needs a value\n", f); return 2; }
            *target = argv[i + 1];
            i += 2;
            continue;
        }
        if (!strcmp(f, "--device")) {
            if (i + 1 >= argc) { fprintf(stderr, "segnet predict: --device needs a value\n"); return 2; }
            if (parse_device(argv[i + 1], &pc.device)) return 2;
            i += 2;
            continue;
        }
        size_given |= !strcmp(f, "--size");
        classes_given |= !strcmp(f, "--classes");
        int k = parse_model_option(&pc.model, argc, argv, i);
        if (k < 0) return 2;
        if (k == 0) { fprintf(stderr, "segnet predict: unknown option '%s' (see segnet predict --help)\n", f); return 2; }
        i += k;
    }
    if (run && !pc.weights) {
        snprintf(run_weights, sizeof run_weights, "%s/%s.safetensors", run, last ? "last" : "best");
        pc.weights = run_weights;
    }
    if (run) pc.n_class_names = read_class_names(run, &pc.class_names);
    if (!pc.weights || !pc.input || !pc.out || !classes_given) {
        fprintf(stderr, "segnet predict: --input, --out and either --run RUN or --weights and --classes are required "
                "(see segnet predict --help)\n");
        return 2;
    }
    if (!size_given) model_default_size(&pc.model);
    if (model_options_used("predict", pc.model.model, argc, argv)) return 2;
    char err[SN_ERR_MAX], note[SN_ERR_MAX];
    if (padding_follow_weights(&pc.model, pc.weights, "predict", note, err)) {
        print_message(stderr, "segnet predict", err);
        return 1;
    }
    if (note[0]) print_message(stderr, "segnet predict", note);
    const int rc = predict_run(&pc, err);
    for (int k = 0; k < pc.n_class_names; k++) free(pc.class_names[k]);
    free(pc.class_names);
    if (rc != 0) { print_message(stderr, "segnet predict", err); return 1; }
    fprintf(stderr, "segnet predict: wrote %s\n", pc.out);
    return 0;
}

static const char *EXPORT_USAGE =
    "usage: segnet export --run RUN --out FILE.safetensors [--names N] [--best|--last]\n"
    "                     [--overwrite]\n"
    "\n"
    "Writes a run's weights and batch-norm statistics, without the optimiser\n"
    "state: best.safetensors (--last: last.safetensors), for PyTorch. The run is\n"
    "read while no segnet train writes it (RUN/.lock). FILE is new, or with\n"
    "--overwrite an earlier export; never a run's own file or anything else.\n"
    "  --names torchvision  (default) torchvision's names with batch norm's\n"
    "                       num_batches_tracked: load_state_dict(strict=True) into\n"
    "                       torchvision.models.efficientnet_v2_s/m/l(num_classes=K).\n"
    "                       With --head-hidden the head is classifier.1 and\n"
    "                       classifier.4: nn.Sequential(Dropout, Linear, ReLU,\n"
    "                       Dropout, Linear). A unet-effv2-* has its encoder in\n"
    "                       torchvision's names (features.*) and its decoder as\n"
    "                       ref/parity_live.py's UNetEff, which loads it strictly.\n"
    "  --names timm         timm's tf_efficientnetv2_s/m/l (EfficientNetV2\n"
    "                       classifiers without --head-hidden)\n"
    "  --names segnet       segnet's names only (segnet --weights reads all three)\n"
    "The padding the weights were trained with is in the file's metadata.\n";

static int cmd_export(TrainArgs *ta, int argc, char **argv) {
    const char *run = NULL, *out = NULL;
    int last = 0, overwrite = 0;
    ExportNames names = EXPORT_TORCHVISION;
    for (int i = 2; i < argc; i++) {
        const char *f = argv[i];
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) { fputs(EXPORT_USAGE, stdout); return 0; }
        if (!strcmp(f, "--last") || !strcmp(f, "--best")) { last = !strcmp(f, "--last"); continue; }
        if (!strcmp(f, "--overwrite")) { overwrite = 1; continue; }
        if (strcmp(f, "--run") && strcmp(f, "--out") && strcmp(f, "--names")) {
            fprintf(stderr, "segnet export: unknown option '%s' (see segnet export --help)\n", f);
            return 2;
        }
        if (i + 1 >= argc) { fprintf(stderr, "segnet export: %s needs a value\n", f); return 2; }
        const char *v = argv[++i];
        if (!strcmp(f, "--run")) run = v;
        else if (!strcmp(f, "--out")) out = v;
        else {
            int k = 0;
            while (k < 3 && strcmp(v, EXPORT_NAMES[k])) k++;
            if (k == 3) { fprintf(stderr, "segnet export: --names '%s' must be torchvision, timm or segnet\n", v); return 2; }
            names = (ExportNames)k;
        }
    }
    if (!run || !out) { fprintf(stderr, "segnet export: --run RUN and --out FILE are required (see segnet export --help)\n"); return 2; }
    train_cfg_default(&ta->c);
    if (read_run_config(ta, run)) return 2;
    char err[SN_ERR_MAX], report[SN_ERR_MAX];
    if (export_run(&ta->c.model, run, last, names, out, overwrite, report, err)) {
        print_message(stderr, "segnet export", err);
        return 1;
    }
    print_message(stderr, "segnet export", report);
    const char *model = ta->c.model.model;
    if (names == EXPORT_TORCHVISION && ta->c.model.pad == PAD_SAME && (eff_spec(model) || !strncmp(model, "unet-effv2", 10)))
        fprintf(stderr, "segnet export: note: the run pads as TensorFlow ('same'), torchvision's EfficientNetV2 (and "
                "UNetEff) symmetrically: there these weights give other outputs. For torchvision, train with --padding "
                "symmetric; timm's tf_efficientnetv2_* pads as 'same' (--names timm)\n");
    return 0;
}

static const char *BENCH_USAGE =
    "usage: segnet bench --model NAME [--size HxW] [--batch B] [--steps S] [options]\n"
    "\n"
    "Times S training steps of segnet train (forward, softmax cross-entropy,\n"
    "backward, fp16 loss scaling, Adam) on synthetic data (random images 0..255,\n"
    "random labels, every class weight 1) after warm-up steps, and prints\n"
    "  train_step_ms: X     median over the S steps\n"
    "  images_per_s: Y      batch / median step\n"
    "  peak_rss_bytes: Z    the process's peak resident memory (getrusage)\n"
    "  peak_device_bytes: D the backend's peak allocation (the GPU's with --device cuda)\n"
    "ref/bench_torch.py runs the same in PyTorch; `make bench` compares the two.\n"
    "\n"
    "  --model NAME        unet (default), effv2-s|m|l|t, unet-effv2-s|m|l|t\n"
    "  --size HxW          input size (defaults as segnet train)\n"
    "  --batch B           images per step (default 4)\n"
    "  --steps S           timed steps (default 5)\n"
    "  --warmup W          untimed steps first (default 1)\n"
    "  --threads T         CPU threads (default: all cores)\n"
    "  --profile           also print the time per op kind per step (forward,\n"
    "                      backward) and GFLOP/s of the convs\n"
    "  --precision P       activation storage: fp32 (default), fp16 or bf16\n"
    "  --checkpoint C      none (default) or blocks: recompute each block in backward\n"
    "  --seed S            initialisation and data (default 1)\n"
    "  --device D          auto (default), cuda or cpu, as for segnet train\n"
    "  --classes K, --padding MODE, --head-hidden H, --depth D, --width W:\n"
    "                      the model, as for segnet train\n";

static int cmd_bench(int argc, char **argv) {
    BenchCfg c = {model_cfg_default(), 5, 1, 0, 0, DT_F32, 0, 1, DEVICE_AUTO};
    c.model.batch = 4;
    int size_given = 0;
    for (int i = 2; i < argc;) {
        const char *f = argv[i];
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) { fputs(BENCH_USAGE, stdout); return 0; }
        if (!strcmp(f, "--profile")) { c.profile = 1; i++; continue; }
        size_given |= !strcmp(f, "--size");
        int k = parse_model_option(&c.model, argc, argv, i);
        if (k < 0) return 2;
        if (k > 0) { i += k; continue; }
        int is_own = !strcmp(f, "--steps") || !strcmp(f, "--warmup") || !strcmp(f, "--threads") ||
                     !strcmp(f, "--precision") || !strcmp(f, "--checkpoint") || !strcmp(f, "--seed") ||
                     !strcmp(f, "--device");
        if (!is_own) { fprintf(stderr, "segnet bench: unknown option '%s' (see segnet bench --help)\n", f); return 2; }
        if (i + 1 >= argc) { fprintf(stderr, "segnet bench: %s needs a value\n", f); return 2; }
        const char *v = argv[i + 1];
        int rc = 0, seed;
        if (!strcmp(f, "--steps")) rc = parse_int(f, v, 1, 1 << 20, &c.steps);
        else if (!strcmp(f, "--warmup")) rc = parse_int(f, v, 0, 1 << 20, &c.warmup);
        else if (!strcmp(f, "--threads")) rc = parse_int(f, v, 1, 4096, &c.threads);
        else if (!strcmp(f, "--seed")) { rc = parse_int(f, v, 0, 2147483647, &seed); c.seed = (uint64_t)seed; }
        else if (!strcmp(f, "--device")) rc = parse_device(v, &c.device);
        else if (!strcmp(f, "--precision")) {
            int k = 0;
            while (k < 3 && strcmp(v, DTYPE_NAMES[k])) k++;
            if (k == 3) { fprintf(stderr, "segnet bench: --precision '%s' must be fp32, fp16 or bf16\n", v); rc = -1; }
            else c.precision = (DType)k;
        } else if (!strcmp(f, "--checkpoint")) {
            if (!strcmp(v, "blocks")) c.checkpoint = 1;
            else if (strcmp(v, "none")) { fprintf(stderr, "segnet bench: --checkpoint '%s' must be none or blocks\n", v); rc = -1; }
        }
        if (rc) return 2;
        i += 2;
    }
    if (!size_given) model_default_size(&c.model);
    if (model_options_used("bench", c.model.model, argc, argv)) return 2;
    BenchResult r;
    char err[SN_ERR_MAX];
    if (bench_run(&c, &r, err)) { print_message(stderr, "segnet bench", err); return 1; }
    printf("model: %s  input (%d,%d,%d,3)  classes %d  parameters %zu  threads %d  backend %s\n", c.model.model,
           c.model.batch, c.model.height, c.model.width, c.model.classes, r.n_params, r.threads, r.backend);
    if (c.profile) {
        double total = 0.0;
        for (int k = 0; k < BK_COUNT; k++) total += r.kind_fwd_ms[k] + r.kind_bwd_ms[k];
        printf("%-12s %10s %10s %10s %7s %9s\n", "op kind", "fwd ms", "bwd ms", "total ms", "share", "GFLOP/s");
        for (int k = 0; k < BK_COUNT; k++) {
            double t = r.kind_fwd_ms[k] + r.kind_bwd_ms[k];
            printf("%-12s %10.2f %10.2f %10.2f %6.1f%%", BENCH_KIND_NAMES[k], r.kind_fwd_ms[k], r.kind_bwd_ms[k], t,
                   total > 0.0 ? 100.0 * t / total : 0.0);
            if (r.kind_gflop[k] > 0.0 && t > 0.0) printf(" %9.1f", r.kind_gflop[k] / (1e-3 * t));
            printf("\n");
        }
        printf("%-12s %10s %10s %10.2f   (the profiled steps; the median step may differ)\n", "sum", "", "", total);
    }
    printf("train_step_ms: %.2f\n", r.step_ms);
    printf("images_per_s: %.3f\n", r.images_per_s);
    printf("peak_rss_bytes: %zu\n", r.peak_rss_bytes);
    printf("peak_device_bytes: %zu\n", r.peak_device_bytes);
    return 0;
}

static int cmd_info(void) {
    printf("backend: %s\n", ops_cpu.name);
#ifdef SEGNET_CUDA
    char why[SN_ERR_MAX];
    size_t free_b, total_b;
    if (cuda_memory_info(0, &free_b, &total_b, why) == 0) {
        // what the device holds beyond segnet's own allocations: the driver's
        // context (and other processes' memory, if any share the device)
        size_t held = total_b - free_b, ours = cuda_bytes_live, driver = held > ours ? held - ours : 0;
        printf("cuda: device 0 (--device auto uses it), %.2f GiB, %.2f GiB free\n", total_b / 1073741824.0,
               free_b / 1073741824.0);
        printf("cuda_context_bytes: %zu measured (in use %zu less segnet's %zu; the plan counts %zu)\n", driver,
               held, ours, ops_cuda.driver_bytes);
    } else {
        printf("cuda: built, but %s\n", why);
    }
#else
    printf("cuda: not built (no nvcc)\n");
#endif
#ifdef SEGNET_MPI
    printf("mpi: yes\n");
#else
    printf("mpi: no (built without MPI)\n");
#endif
    printf("blas: %s\n", openblas_get_config());
    printf("blas_threads: %d\n", openblas_get_num_threads());
#ifdef _OPENMP
    printf("openmp_threads: %d\n", omp_get_max_threads());
#else
    printf("openmp_threads: off (built with NO_OMP=1)\n");
#endif
    return 0;
}

static const char *PLAN_USAGE =
    "usage: segnet plan --model NAME [options]\n"
    "\n"
    "Prints the model stage by stage (output shape (N,H,W,C), parameters, the bytes\n"
    "of activations kept for the backward and, with --checkpoint blocks, the bytes\n"
    "recomputed), then the memory a training step takes, from the same plan the\n"
    "run allocates with: parameters, gradients, Adam state, BN statistics,\n"
    "activations and their gradients (one arena laid out by lifetimes), conv\n"
    "workspace, and `peak: N bytes (X.XX GiB)`. Nothing is allocated.\n"
    "\n"
    "  --model NAME        unet (default), effv2-s, effv2-m, effv2-l, effv2-t,\n"
    "                      unet-effv2-s, unet-effv2-m, unet-effv2-l, unet-effv2-t\n"
    "  --classes K         output classes (default 4)\n"
    "  --size HxW          input size (default: effv2-s 384x384, effv2-m/l 480x480,\n"
    "                      effv2-t 64x64, U-Nets 256x256)\n"
    "  --batch B           images per step (default 1); with --memory, the global\n"
    "                      batch to keep\n"
    "  --precision P       fp32 (default), fp16 or bf16 activation storage\n"
    "  --checkpoint MODE   none (default) or blocks\n"
    "  --freeze base, --unfreeze-last N, --accum K   as for segnet train\n"
    "  --memory SIZE       e.g. 12G: pick the fastest setting that fits: the largest\n"
    "                      micro-batch first, then checkpointing, then fp16, then\n"
    "                      accumulation of smaller micro-batches; prints what was\n"
    "                      tried and picked (leave --precision and --checkpoint out)\n"
    "  --padding MODE      same (TensorFlow/Keras, default) or symmetric (torchvision)\n"
    "  --head-hidden H     classifier hidden layer width (default 0: none)\n"
    "  --depth D           unet levels below the top (default 4)\n"
    "  --width W           unet channels at the top level (default 32)\n"
    "  --device D          auto (default), cuda or cpu: whose conv workspace is planned\n"
    "  --roofline          also the bytes and FLOPs of a training step by op kind on\n"
    "                      the CUDA kernels, and the least time an H200 needs for them\n";

// ---- a roofline of the training step (segnet plan --roofline)
//
// The bytes each op of a training step moves through device memory, as the
// CUDA kernels and cuBLAS calls of today do it (each tensor read or written
// once per pass; accumulation reads, the weight gradient's partial sums and
// re-reads that L2 may serve (an implicit GEMM reads its input once per tile
// of 64 output channels) left out), and its FLOPs.
// An op takes at least max(bytes / bandwidth, FLOPs / peak): the step at least
// the sum. H200: 4.8 TB/s, 790 TFLOP/s dense bf16 (fp32: the 67 TFLOP/s of
// its CUDA cores).
#define ROOF_BANDWIDTH 4.8e12
#define ROOF_PEAK_16BIT 790e12
#define ROOF_PEAK_FP32 67e12
enum { ROOF_CONV_KXK, ROOF_CONV_1X1, ROOF_DEPTHWISE, ROOF_BN, ROOF_ELEMENTWISE, ROOF_SE, ROOF_RESAMPLE,
       ROOF_OPTIMIZER, ROOF_KINDS };
static const char *const ROOF_NAMES[ROOF_KINDS] = {
    "conv k×k (implicit GEMM)", "conv 1×1, dense (GEMM)", "depthwise conv", "batch norm (+act)",
    "elementwise (act, add, dropout)", "squeeze-excitation pool/scale", "pool, upsample, resize, concat",
    "optimizer (Adam, cast, zero)"};
typedef struct { double bytes[ROOF_KINDS], flops[ROOF_KINDS], seconds[ROOF_KINDS]; double peak; } Roofline;
static void roof_pass(Roofline *r, int kind, double bytes, double flops) {
    r->bytes[kind] += bytes;
    r->flops[kind] += flops;
    const double tb = bytes / ROOF_BANDWIDTH, tf = flops / r->peak;
    r->seconds[kind] += tb > tf ? tb : tf;
}
static void roofline_step(const Graph *g, DType dt, Roofline *r) {
    memset(r, 0, sizeof *r);
    r->peak = dt == DT_F32 ? ROOF_PEAK_FP32 : ROOF_PEAK_16BIT;
    int *needs = malloc(sizeof(int) * (size_t)g->n_tensors);
    snCheck(needs != NULL, "out of host memory");
    graph_needs_grad(g, 0, needs);
    const double e = (double)dtype_size(dt);
    double trainable = 0;
    for (int i = 0; i < g->n_layers; i++) {
        const Layer *l = &g->layers[i];
        const double X = (double)shape_numel(tshape(g, l->in[0])), Y = (double)shape_numel(tshape(g, l->out));
        const double X2 = l->in[1] >= 0 ? (double)shape_numel(tshape(g, l->in[1])) : 0.0;
        const int bwd = needs[l->out], dx = needs[l->in[0]], dx2 = l->in[1] >= 0 && needs[l->in[1]];
        const int wgrad = bwd && !l->frozen && l->weight >= 0;
        int ids[4];
        for (int k = layer_params(l, ids); k-- > 0;)
            if (!l->frozen) trainable += (double)g->params[ids[k]].count;
        switch (l->kind) {
        case LAYER_CONV: case LAYER_DENSE: {
            const ConvCfg *c = &l->conv;
            const Shape out = tshape(g, l->out);
            const double K = (double)c->kh * c->kw * (tshape(g, l->in[0]).c / c->groups), P = Y / out.c;
            const double flops = 2.0 * Y * K, col = P * K * c->groups, w = (double)out.c * K;
            if (conv_is_depthwise(c)) {
                roof_pass(r, ROOF_DEPTHWISE, (X + Y) * e, flops);
                if (dx) roof_pass(r, ROOF_DEPTHWISE, (X + Y) * e, flops);
                if (wgrad) roof_pass(r, ROOF_DEPTHWISE, (X + Y) * e, flops);
            } else if (conv_is_pointwise(c)) {
                roof_pass(r, ROOF_CONV_1X1, (X + Y + w) * e, flops);
                if (dx) roof_pass(r, ROOF_CONV_1X1, (X + Y + w) * e, flops);
                if (wgrad) roof_pass(r, ROOF_CONV_1X1, (X + Y) * e + w * 4, flops);
            } else if (c->stride <= 2) {  // implicit GEMM: the operands gathered from the tensors themselves
                roof_pass(r, ROOF_CONV_KXK, (X + Y + w) * e, flops);
                if (dx) roof_pass(r, ROOF_CONV_KXK, (Y + w + X) * e, flops);
                if (wgrad) roof_pass(r, ROOF_CONV_KXK, (X + Y) * e + w * 4, flops);
            } else {  // im2col: the columns written and read once per pass; backward data's in fp32, then col2im
                roof_pass(r, ROOF_CONV_KXK, X * e + 2 * col * e + (Y + w) * e, flops);
                if (dx) roof_pass(r, ROOF_CONV_KXK, (Y + w) * e + 2 * col * 4 + X * e, flops);
                if (wgrad) roof_pass(r, ROOF_CONV_KXK, X * e + 2 * col * e + Y * e + w * 4, flops);
            }
            if (l->bias >= 0) roof_pass(r, ROOF_ELEMENTWISE, 2 * Y * e, 0);  // bias_rows
            if (l->bias >= 0 && wgrad) roof_pass(r, ROOF_ELEMENTWISE, Y * e, 0);
            break;
        }
        case LAYER_BN:  // statistics, apply; backward reduce, data
            roof_pass(r, ROOF_BN, X * e, 2 * X);
            roof_pass(r, ROOF_BN, 2 * X * e, 4 * X);
            if (bwd) roof_pass(r, ROOF_BN, 2 * X * e, 6 * X);
            if (dx) roof_pass(r, ROOF_BN, 3 * X * e, 6 * X);
            break;
        case LAYER_ACT: case LAYER_RESCALE:
            roof_pass(r, ROOF_ELEMENTWISE, (X + Y) * e, 0);
            if (dx) roof_pass(r, ROOF_ELEMENTWISE, 3 * X * e, 0);
            break;
        case LAYER_ADD: case LAYER_DROPOUT: case LAYER_DROP_PATH:
            roof_pass(r, ROOF_ELEMENTWISE, (X + X2 + Y) * e, 0);
            if (dx || dx2) roof_pass(r, ROOF_ELEMENTWISE, (Y + (dx ? X : 0) + (dx2 ? X2 : 0)) * e, 0);
            break;
        case LAYER_SE_GATE: {  // two small GEMMs per image, fp32 weights; the backward recomputes the forward
            const double w = 2.0 * l->conv.cin * l->conv.cout;  // both weight matrices
            roof_pass(r, ROOF_SE, (X + Y) * e + 4 * w, 2 * w * tshape(g, l->in[0]).n);
            if (bwd) roof_pass(r, ROOF_SE, 2 * X * e + Y * e + (wgrad ? 12 : 4) * w, 6 * w * tshape(g, l->in[0]).n);
            break;
        }
        case LAYER_GAP: case LAYER_SCALE:
            roof_pass(r, ROOF_SE, (X + (l->kind == LAYER_SCALE ? X : 0)) * e, 0);
            if (dx) roof_pass(r, ROOF_SE, 2 * X * e, 0);
            if (dx2) roof_pass(r, ROOF_SE, 2 * X * e, 0);
            break;
        default:  // pooling, upsampling, resizing, concatenation
            roof_pass(r, ROOF_RESAMPLE, (X + X2 + Y) * e, 0);
            if (dx || dx2) roof_pass(r, ROOF_RESAMPLE, (X + X2 + Y) * e, 0);
            break;
        }
    }
    // Adam reads p, g, m, v and writes p, m, v (fp32); the weights are cast once per forward; the gradients zeroed
    const double params = (double)g->n_param_floats;
    roof_pass(r, ROOF_OPTIMIZER, 28 * trainable + 4 * trainable + (dt == DT_F32 ? 0 : (4 + e) * params), 10 * trainable);
    free(needs);
}
static void print_roofline(const Graph *g, DType dt) {
    Roofline r;
    roofline_step(g, dt, &r);
    double B = 0, F = 0, T = 0;
    printf("roofline of a training step (H200: %.1f TB/s, %.0f TFLOP/s %s; each tensor moved once per pass):\n",
           ROOF_BANDWIDTH / 1e12, r.peak / 1e12, dt == DT_F32 ? "fp32" : "dense 16-bit");
    printf("  %-34s %10s %10s %10s\n", "op kind", "GB moved", "TFLOP", "ms (bound)");
    for (int k = 0; k < ROOF_KINDS; k++) {
        if (r.bytes[k] == 0 && r.flops[k] == 0) continue;
        printf("  %-34s %10.2f %10.3f %10.3f\n", ROOF_NAMES[k], r.bytes[k] / 1e9, r.flops[k] / 1e12, 1e3 * r.seconds[k]);
        B += r.bytes[k]; F += r.flops[k]; T += r.seconds[k];
    }
    printf("  %-34s %10.2f %10.3f %10.3f\n", "step", B / 1e9, F / 1e12, 1e3 * T);
}

static int cmd_plan(int argc, char **argv) {
    TrainArgs a = {0};
    train_cfg_default(&a.c);
    a.c.model.batch = 1;
    a.c.device = DEVICE_AUTO;
    int roofline = 0;
    for (int i = 2; i < argc;) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) { fputs(PLAN_USAGE, stdout); return 0; }
        if (!strcmp(argv[i], "--roofline")) { roofline = 1; i++; continue; }
        int k = parse_train_option(&a, argc, argv, i);
        if (k < 0) return 2;
        if (k == 0) { fprintf(stderr, "segnet plan: unknown option '%s' (see segnet plan --help)\n", argv[i]); return 2; }
        i += k;
    }
    if (!a.size_given) model_default_size(&a.c.model);
    if (model_options_used("plan", a.c.model.model, argc, argv)) return 2;
    TrainCfg *c = &a.c;
    char err[SN_ERR_MAX];
    if (a.memory && pick_setting(&a, "plan", stdout)) return 1;
    Graph g;
    Plan p;
    Ops *o;
    int logits = plan_for(c, &g, &p, &o, err);
    if (logits < 0) { print_message(stderr, "segnet plan", err); graph_free(&g); return 1; }
    MemoryReport m;
    memory_report(&g, &p, c, logits, o, &m);
    printf("model: %s  input (%d,%d,%d,3)  classes %d  precision %s  checkpoint %s  accum %d%s\n", c->model.model,
           c->model.batch, c->model.height, c->model.width, c->model.classes, DTYPE_NAMES[c->precision],
           c->checkpoint ? "blocks" : "none", c->accum, c->freeze_base ? "  backbone frozen" : "");
    printf("%-28s %-22s %14s %14s %14s\n", "stage", "output", "parameters", "kept (bytes)", "recomputed");
    size_t total = 0, trainable = 0;
    for (int s = 0; s < g.n_stages; s++) {
        size_t n = 0, kept = 0, recomputed = 0;
        int last = -1;
        for (int l = 0; l < g.n_layers; l++) {
            const Layer *L = &g.layers[l];
            if (L->stage != s) continue;
            last = l;
            int ids[4];
            for (int k = layer_params(L, ids); k-- > 0;) {
                n += g.params[ids[k]].count;
                if (!L->frozen) trainable += g.params[ids[k]].count;
            }
        }
        if (last < 0) continue;
        for (int b = 0; b < p.n_bufs; b++) {
            const PlanBuffer *q = &p.bufs[b];
            int prod = g.tensors[q->tensor].producer;
            if (q->is_grad || prod < 0 || g.layers[prod].stage != s) continue;
            if (q->recompute) recomputed += q->bytes;
            else if (q->first <= p.loss_slot && q->last >= p.loss_slot) kept += q->bytes;
        }
        printf("%-28s ", g.stage_names[s]);
        print_shape(g.tensors[g.layers[last].out].shape);
        printf(" %14zu %14zu %14zu\n", n, kept, recomputed);
        total += n;
    }
    printf("parameters: %zu (trainable %zu)\n", total, trainable);
    printf("batch norm statistics: %zu values\n", g.n_buffer_floats);
    printf("memory (bytes):\n");
    printf("  parameters (fp32)       %14zu\n  gradients (fp32)        %14zu\n  optimiser state (Adam)  %14zu\n",
           m.params, m.grads, m.optimizer);
    printf("  BN statistics           %14zu\n  activations + gradients %14zu\n  conv workspace          %14zu\n"
           "  inputs, labels, metrics %14zu\n", m.statistics, m.activations, m.workspace, m.io);
    if (m.backend) printf("  backend scratch (%s)   %14zu\n", o->name, m.backend);
    if (m.driver) printf("  CUDA context (estimate) %14zu\n", m.driver);
    printf("peak: %zu bytes (%.2f GiB)\n", m.total, m.total / 1073741824.0);
    if (roofline) print_roofline(&g, c->precision);
    plan_free(&p);
    graph_free(&g);
    return 0;
}

int main(int argc, char **argv) {
    setvbuf(stdout, NULL, _IOLBF, 0);  // each report line when it happens, in a log too (a file is block-buffered)
    if (argc < 2 || !strcmp(argv[1], "help") || !strcmp(argv[1], "--help") || !strcmp(argv[1], "-h")) {
        fputs(USAGE, stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "info")) return cmd_info();
    if (!strcmp(argv[1], "plan")) return cmd_plan(argc, argv);
    if (!strcmp(argv[1], "predict")) return with_train_args(cmd_predict, argc, argv);
    if (!strcmp(argv[1], "train")) return with_train_args(cmd_train, argc, argv);
    if (!strcmp(argv[1], "eval")) return with_train_args(cmd_eval, argc, argv);
    if (!strcmp(argv[1], "bench")) return cmd_bench(argc, argv);
    if (!strcmp(argv[1], "export")) return with_train_args(cmd_export, argc, argv);
    fprintf(stderr, "segnet: unknown command '%s' (try segnet --help)\n", argv[1]);
    return 2;
}

#endif  // TESTING
