// segnet.c -- the one readable C file: the math of every op, the models and the
// training step. The CPU's fast versions of the ops are in kernels_cpu.c (the
// GPU's in kernels.cu); the plumbing around them (files, data, the run, the
// command line) is in files of its own, included at the end.
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
//                        resampling; batch norm (derived in doc/batchnorm.md);
//                        softmax + weighted cross-entropy and the loss menu
//                        (the focal and region terms of --loss, lovasz, the
//                        per-image IoU); Adam; metrics and learning-rate
//                        schedules; the reference table ops_ref
//   II.  The models      the graph's builders; EfficientNetV2 and the U-Nets;
//                        initial weights
//   III. The step        fusing layers (a batch norm with the layer after it,
//                        for the tables that fuse); memory planning (with
//                        recompute); the executor (layer_forward,
//                        layer_backward); a batch's staging, loss and
//                        metrics; the training step (train_step, its work in
//                        numbered steps)
// Then, included at the end (the rest of the program):
//   kernels_cpu.c        in part I's order: the elementwise ops in fp32; the
//                        direct and GEMM convolutions; the squeeze-excitation
//                        pieces; pooling, upsampling, concat; batch norm in
//                        fp32 passes with exp_vec; ops_cpu = ops_ref with those
//   plumbing/            backends.c (--device), safetensors.c, weights.c (by
//                        name), images.c (and prediction), datasets.c, curves.c,
//                        replicas.c (communicators), run.c (the training run),
//                        bench.c, cli.c (the command line)
//
// Math index. An op NAME of the ops table (struct Ops in segnet.h: the backend contract) has
// one function per form, each under the same section title: NAME_ref in part I, below its
// formula (the specification); NAME_cpu in kernels_cpu.c where a fast version exists ("fast"
// below; elsewhere ops_cpu takes NAME_ref); NAME_cuda in kernels.cu. The tests of an op (gradient
// check, by hand, fast against reference, cuda_ against the CPU through the emulator) run with
// ./test_segnet --filter WORD, for each WORD listed. segnet.h holds the math both backends
// share bit for bit.
//
//   section (part I)         formula                                          fast  WORDs
//   memory and utilities     fill, y = a·x + b·y, Σx², any inf/NaN             yes   fill, axpby,
//                                                                                    nonfinite,
//                                                                                    elementwise
//   conv2d                   out = b + Σ w·x, SAME or symmetric (conv_axis);  yes   conv,
//                            dx, dw, db                                             depthwise
//   activations              ReLU, SiLU, sigmoid (act_apply, act_grad)         no    act
//   squeeze-excitation       s = σ(W2·SiLU(W1·p + b1) + b2), p = the mean     yes   se_, squeeze
//                            over pixels, y = x·s (se_gate_forward)
//   residual add and concat  y = a + b; y = [a, b] along channels             yes   concat
//   dropout and drop-path    keep = u ≥ rate, ×1/(1 − rate) (dropout_keep)    yes   dropout
//   pooling and resampling   2×2 max, nearest ×2, bilinear (bilinear_tap)     yes   pool, resize
//   batch norm               y = act(γ·(x − mean)/√(var + ε) + β), fp64 sums; yes   bn
//                            backward: Σg, Σg·x̂ per channel, then dx
//   softmax + cross-entropy  Σ w_y·nll / Σ w_y, Keras' clip                   no    xent
//   the loss menu            focal w_y·α(1-p_y)^γ·nll; dice, jaccard, tversky  no    loss_,
//                            from per-class sums I, P, G (region_coefs)              region,
//                                                                                    focal
//   Adam                     Keras' ε̂, decoupled weight decay (AdamStep)      no    adam
//   loss scaling, clipping   step_control_apply, clip_factor                  no    step_control,
//                                                                                    clip
//   metrics                  IoU = TP/(TP + FP + FN), mean IoU, accuracy;     no    metrics,
//                            per image (iou_per_image)                              confusion,
//                                                                                    iou_per
// Beyond the ops: learning-rate schedules (lr_at_step), memory planning (plan_build,
// plan_pack), the executor (layer_forward, layer_backward) and one optimiser step
// (train_step, step_work).
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
// the plumbing's declarations (included at the end): the step reads data sets and a run's settings
#include "plumbing/safetensors.h"
#include "plumbing/images.h"
#include "plumbing/datasets.h"
#include "plumbing/curves.h"
#include "plumbing/run.h"

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
#define snCheck(cond, ...) \
    do { if (!(cond)) fail_internal(__FILE__, __LINE__, __VA_ARGS__); } while (0)
#define SHAPE_FMT "(%d,%d,%d,%d)"
#define SHAPE_ARGS(s) (s).n, (s).h, (s).w, (s).c

static int shape_eq(Shape a, Shape b) {
    return a.n == b.n && a.h == b.h && a.w == b.w && a.c == b.c;
}

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
        for (size_t k = 0; k < n; k++)
            d[k] = (_Float16)(accumulate ? (float)d[k] + src[k] : src[k]);
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
static void cpu_memcpy(Ops *o, void *dst, const void *src, size_t bytes) {
    (void)o;
    memcpy(dst, src, bytes);
}
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
    snCheck(shape_numel(dst.shape) == n, "copy: dst " SHAPE_FMT " src " SHAPE_FMT,
            SHAPE_ARGS(dst.shape), SHAPE_ARGS(src.shape));
    #pragma omp parallel for schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) st_acc(dst, i, ld(src, i), accumulate);
}

// every value 0..255 is exact in each storage type
static void widen_bytes_ref(Ops *o, Tensor images, const uint8_t *bytes) {
    (void)o;
    size_t n = shape_numel(images.shape);
    #pragma omp parallel for schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) st(images, i, (float)bytes[i]);
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
//   din[n,iy,ix,ci] = Σ over the (oy, ox, ky, kx, co) that read it of
//                     dout[n,oy,ox,co]·w[co][ky][kx][ci]
//   dw[co][ky][kx][ci] += Σ_{n,oy,ox} dout[n,oy,ox,co]·x[n, oy·s - pt + ky, ox·s - pl + kx,
//                                                        g·Cg + ci]
//   db[co] += Σ_{n,oy,ox} dout[n,oy,ox,co]
// The references below compute each output value as one fp64 sum in the
// formula's order, in any storage type; kernels_cpu.c's direct convolutions and
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
    snCheck(conv_geom_of(cfg, in.shape, &q), "conv2d_forward_ref: input " SHAPE_FMT " does not fit",
            SHAPE_ARGS(in.shape));
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
static void conv2d_backward_data_ref(Ops *o, const ConvCfg *cfg, Tensor din, Tensor dout,
                                     const float *w, const void *w_cast, int accumulate, void *ws) {
    (void)o; (void)w_cast; (void)ws;
    ConvGeom q;
    snCheck(conv_geom_of(cfg, din.shape, &q),
            "conv2d_backward_data_ref: input " SHAPE_FMT " does not fit", SHAPE_ARGS(din.shape));
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
                                   ld(dout,
                                      (((size_t)n * q.OH + ty / s) * q.OW + tx / s) * q.Cout + co);
                        }
                    }
                }
                st_acc(din, (((size_t)n * q.H + iy) * q.W + ix) * q.C + c, (float)acc, accumulate);
            }
    }
}
// dw[co,ky,kx,ci] += Σ_{n,oy,ox} dout·in, db[co] += Σ dout
static void conv2d_backward_weight_ref(Ops *o, const ConvCfg *cfg, float *dw, float *db,
                                       Tensor dout, Tensor in, void *ws) {
    (void)o; (void)ws;
    ConvGeom q;
    snCheck(conv_geom_of(cfg, in.shape, &q),
            "conv2d_backward_weight_ref: input " SHAPE_FMT " does not fit", SHAPE_ARGS(in.shape));
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
                                if (ix < 0) continue;
                                const size_t out_px = ((size_t)n * q.OH + oy) * q.OW + ox;
                                const size_t in_px = ((size_t)n * q.H + iy) * q.W + ix;
                                acc += (double)ld(dout, out_px * q.Cout + co) *
                                       ld(in, in_px * q.C + c0 + ci);
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
// squeeze-excitation pieces (fp32 versions in kernels_cpu.c)
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
// squeeze-excitation's gate (the formulas are at se_gate_forward in segnet.h)
//   per image: z1 = W1·p + b1, y1 = act1(z1), z2 = W2·y1 + b2, s = act2(z2)

// z[n][a] = b[a] + Σ_k w[a][k]·x[n][k] for N images, rounded to dt: threads share
// the outputs, each a sum in fp64 in k order
static void affine_rows(DType dt, float *z, const float *w, const float *b, const float *x, int A,
                        int K, int N) {
    #pragma omp parallel for schedule(static) if(PAR((size_t)N * A * K))
    for (int a = 0; a < A; a++)
        for (int n = 0; n < N; n++) {
            double t = b[a];
            for (int k = 0; k < K; k++) t += (double)w[(size_t)a * K + k] * x[(size_t)n * K + k];
            z[(size_t)n * A + a] = dtype_round(dt, (float)t);
        }
}
// every image's z1, y1 (N,S) and z2 (N,C) from pv (N,C), rounded to dt as stored tensors would be
static void se_gate_images(DType dt, int N, const float *pv, const float *w1, const float *b1,
                           const float *w2, const float *b2, int C, int S, Act act1, float *z1,
                           float *y1, float *z2) {
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
    SeGateBuf b = {
            m, m + NC, m + NC + NS, m + NC + 2 * NS, m + 2 * NC + 2 * NS, m + 3 * NC + 2 * NS};
    for (size_t i = 0; i < NC; i++) b.pv[i] = ld(p, i);
    return b;
}
static void se_gate_forward_ref(Ops *o, Tensor s, Tensor p, const float *w1, const float *b1,
                                const float *w2, const float *b2, int S, Act act1, Act act2) {
    (void)o;
    const int N = p.shape.n, C = p.shape.c;
    SeGateBuf b = se_gate_buf(p, S);
    se_gate_images(s.dtype, N, b.pv, w1, b1, w2, b2, C, S, act1, b.z1, b.y1, b.z2);
    for (size_t i = 0; i < (size_t)N * C; i++) st(s, i, act_apply(act2, b.z2[i]));
    free(b.pv);
}
static void se_gate_backward_ref(Ops *o, Tensor dp, Tensor ds, Tensor p, const float *w1,
                                 const float *b1, const float *w2, const float *b2, int S, Act act1,
                                 Act act2, float *dw1, float *db1, float *dw2, float *db2,
                                 int accumulate) {
    (void)o;
    const int N = p.shape.n, C = p.shape.c;
    const DType dt = ds.dtype;
    SeGateBuf b = se_gate_buf(p, S);
    se_gate_images(dt, N, b.pv, w1, b1, w2, b2, C, S, act1, b.z1, b.y1, b.z2);
    for (size_t i = 0; i < (size_t)N * C; i++)
        b.dz2[i] = dtype_round(dt, ld(ds, i) * act_grad(act2, b.z2[i]));
    #pragma omp parallel for schedule(static) if(PAR((size_t)N * C * S))
    for (int j = 0; j < S; j++)
        for (int n = 0; n < N; n++) {
            double a = 0.0;
            for (int c = 0; c < C; c++)
                a += (double)w2[(size_t)c * S + j] * b.dz2[(size_t)n * C + c];
            const size_t i = (size_t)n * S + j;
            b.dz1[i] = dtype_round(dt, dtype_round(dt, (float)a) * act_grad(act1, b.z1[i]));
        }
    if (dp.data) {
        #pragma omp parallel for schedule(static) if(PAR((size_t)N * C * S))
        for (int c = 0; c < C; c++)
            for (int n = 0; n < N; n++) {
                double a = 0.0;
                for (int j = 0; j < S; j++)
                    a += (double)w1[(size_t)j * C + c] * b.dz1[(size_t)n * S + j];
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
// residual add and channel concat

static void add_forward_ref(Ops *o, Tensor y, Tensor a, Tensor b) {
    (void)o;
    #pragma omp parallel for schedule(static) if(PAR(shape_numel(y.shape)))
    for (size_t i = 0; i < shape_numel(y.shape); i++) st(y, i, ld(a, i) + ld(b, i));
}

static void add_backward_ref(Ops *o, Tensor da, Tensor db, Tensor dy, int accumulate_a,
                             int accumulate_b) {
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

static void concat_backward_ref(Ops *o, Tensor da, Tensor db, Tensor dy, int accumulate_a,
                                int accumulate_b) {
    (void)o;
    const int Ca = da.shape.c, Cb = db.shape.c, C = Ca + Cb;
    const size_t M = shape_numel(dy.shape) / C;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (size_t r = 0; r < M; r++) {
        if (da.data)
            for (int c = 0; c < Ca; c++) st_acc(da, r * Ca + c, ld(dy, r * C + c), accumulate_a);
        if (db.data)
            for (int c = 0; c < Cb; c++)
                st_acc(db, r * Cb + c, ld(dy, r * C + Ca + c), accumulate_b);
    }
}

// ----------------------------------------------------------------------------
// dropout and drop-path
//   keep_i = rng_uniform(seed, i) >= rate, i the element (dropout) or the sample (drop-path)
//   y = x·keep/(1 - rate),  dx = dy·keep/(1 - rate)

static void dropout_forward_ref(Ops *o, Tensor y, Tensor x, Tensor residual, float rate,
                                const uint64_t *seed_at, int per_sample, uint64_t first_sample) {
    (void)o;
    const uint64_t seed = *seed_at;
    const size_t n = shape_numel(x.shape), E = n / x.shape.n, per_draw = per_sample ? E : 1;
    #pragma omp parallel for schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) {
        const float v = ld(x, i) * dropout_factor(rate, seed, first_sample * E + i, per_draw);
        st(y, i, residual.data ? v + ld(residual, i) : v);
    }
}

static void dropout_backward_ref(Ops *o, Tensor dx, Tensor dresidual, Tensor dy, float rate,
                                 const uint64_t *seed_at, int per_sample, uint64_t first_sample,
                                 int accumulate, int accumulate_residual) {
    (void)o;
    const uint64_t seed = *seed_at;
    const size_t n = shape_numel(dy.shape), E = n / dy.shape.n, per_draw = per_sample ? E : 1;
    #pragma omp parallel for schedule(static) if(PAR(n))
    for (size_t i = 0; i < n; i++) {  // dx may be dy (in place)
        const float g = ld(dy, i);
        if (dx.data)
            st_acc(dx, i, g * dropout_factor(rate, seed, first_sample * E + i, per_draw),
                   accumulate);
        if (dresidual.data) st_acc(dresidual, i, g, accumulate_residual);
    }
}

// ----------------------------------------------------------------------------
// pooling and resampling

// the element (n, h, w, c) of a tensor of shape s: ((n·H + h)·W + w)·C + c
static size_t at_nhwc(Shape s, int n, int h, int w, int c) {
    return (((size_t)n * s.h + h) * s.w + w) * s.c + c;
}

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
                    float v = ld(x, at_nhwc(s, n, 2 * oy + k / 2, 2 * ox + k % 2, c));
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
                        float v = ld(x, at_nhwc(s, n, 2 * oy + k / 2, 2 * ox + k % 2, c));
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
                    g += ld(dy, at_nhwc(t, n, 2 * iy + k / 2, 2 * ix + k % 2, c));
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
            size_t r00 = (((size_t)n * s.h + ty.i0) * s.w + tx.i0) * s.c,
                   r01 = (((size_t)n * s.h + ty.i0) * s.w + tx.i1) * s.c;
            size_t r10 = (((size_t)n * s.h + ty.i1) * s.w + tx.i0) * s.c,
                   r11 = (((size_t)n * s.h + ty.i1) * s.w + tx.i1) * s.c;
            for (int c = 0; c < t.c; c++) {
                st(y, (((size_t)n * t.h + oy) * t.w + ox) * t.c + c,
                   bilinear_mix(ty, tx, ld(x, r00 + c), ld(x, r01 + c), ld(x, r10 + c),
                                ld(x, r11 + c)));
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
                        if (wx != 0.0f)
                            g += wy * wx * ld(dy, (((size_t)n * t.h + oy) * t.w + ox) * t.c + c);
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

// The reference versions below (any storage type, the formulas as written) are ops_ref's batch
// norm, the formula alone (ops_ref.plain_batch_norm: the layer after it runs as its own);
// kernels_cpu.c's bn_*_cpu compute the same in fewer passes. The backward derived term by
// term: doc/batchnorm.md.

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
static void bn_stats_ref(Ops *o, Tensor x, float *mean, float *var, float *run_mean, float *run_var,
                         float momentum, double *sums) {
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (int c0 = 0; c0 < C; c0 += BN_CBLOCK) {
        int nc = C - c0 < BN_CBLOCK ? C - c0 : BN_CBLOCK;
        // Σx, Σx², Σ(x − mean)²
        double s[BN_CBLOCK] = {0}, s2[BN_CBLOCK] = {0}, q[BN_CBLOCK] = {0};
        for (size_t r = 0; r < M; r++)
            for (int j = 0; j < nc; j++) {
                const double v = ld(x, r * C + c0 + j);
                s[j] += v;
                s2[j] += v * v;
            }
        for (int j = 0; j < nc; j++) {
            if (sums) { sums[c0 + j] = s[j]; sums[C + c0 + j] = s2[j]; }
            s[j] /= (double)M;
        }
        for (size_t r = 0; r < M; r++)
            for (int j = 0; j < nc; j++) { double d = ld(x, r * C + c0 + j) - s[j]; q[j] += d * d; }
        for (int j = 0; j < nc; j++) {
            mean[c0 + j] = (float)s[j];
            var[c0 + j] = (float)(q[j] / (double)M);
        }
    }
    if (run_mean) bn_update_running_ref(o, run_mean, run_var, mean, var, C, M, momentum);
}

static void bn_stats_finish_ref(Ops *o, const double *sums, int C, size_t count, float *mean,
                                float *var, float *run_mean, float *run_var, float momentum) {
    for (int c = 0; c < C; c++)
        bn_moments_stats(sums[c], sums[C + c], (double)count, &mean[c], &var[c]);
    if (run_mean) bn_update_running_ref(o, run_mean, run_var, mean, var, C, count, momentum);
}

// y = act(gamma·((x − mean)·invstd) + beta)
static void bn_forward_ref(Ops *o, Tensor y, Tensor x, const BnArgs *bn) {
    (void)o;
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (size_t r = 0; r < M; r++)
        for (int c = 0; c < C; c++) {
            const float xhat = (ld(x, r * C + c) - bn->mean[c]) * bn_invstd(bn->var, c, bn->eps);
            st(y, r * C + c, act_apply(bn->act, bn->gamma[c] * xhat + bn->beta[c]));
        }
}

// g = dy·act'(gamma·xhat + beta): Σg and Σg·xhat per channel, summed in fp64 and rounded once
// (sums: the fp64 sums as they are, --sync-bn), and added into dbeta and dgamma
static void bn_backward_reduce_ref(Ops *o, Tensor dy, Tensor x, const BnArgs *bn, float *sum_g,
                                   float *sum_gx, float *dgamma, float *dbeta, double *sums) {
    (void)o;
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (int c0 = 0; c0 < C; c0 += BN_CBLOCK) {
        int nc = C - c0 < BN_CBLOCK ? C - c0 : BN_CBLOCK;
        double sg[BN_CBLOCK] = {0}, sgx[BN_CBLOCK] = {0};
        for (size_t r = 0; r < M; r++)
            for (int j = 0; j < nc; j++) {
                int c = c0 + j;
                float xhat = (ld(x, r * C + c) - bn->mean[c]) * bn_invstd(bn->var, c, bn->eps);
                float g = ld(dy, r * C + c) * act_grad(bn->act, bn->gamma[c] * xhat + bn->beta[c]);
                sg[j] += g;
                sgx[j] += (double)g * xhat;
            }
        for (int j = 0; j < nc; j++) {
            bn_grad_sums_store(c0 + j, sg[j], sgx[j], sum_g, sum_gx, dgamma, dbeta);
            if (sums) { sums[c0 + j] = sg[j]; sums[C + c0 + j] = sgx[j]; }
        }
    }
}

static void bn_backward_finish_ref(Ops *o, const double *sums, int C, float *sum_g, float *sum_gx,
                                   float *dgamma, float *dbeta) {
    (void)o;
    for (int c = 0; c < C; c++)
        bn_grad_sums_store(c, sums[c], sums[C + c], sum_g, sum_gx, dgamma, dbeta);
}

// dx (=|+=) gamma·invstd·(g − (Σg + xhat·Σg·xhat)/count), count 0: running statistics
static void bn_backward_data_ref(Ops *o, Tensor dx, Tensor dy, Tensor x, const BnArgs *bn,
                                 const float *sum_g, const float *sum_gx, size_t count,
                                 int accumulate) {
    const float *gamma = bn->gamma;
    (void)o;
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    #pragma omp parallel for schedule(static) if(PAR(M * C))
    for (size_t r = 0; r < M; r++)
        for (int c = 0; c < C; c++) {
            float invstd = bn_invstd(bn->var, c, bn->eps);
            float xhat = (ld(x, r * C + c) - bn->mean[c]) * invstd;
            float g = ld(dy, r * C + c) * act_grad(bn->act, gamma[c] * xhat + bn->beta[c]);
            if (count) g -= (sum_g[c] + xhat * sum_gx[c]) / (float)count;
            st_acc(dx, r * C + c, gamma[c] * invstd * g, accumulate);
        }
}

// ----------------------------------------------------------------------------
// fused softmax + weighted cross-entropy, per pixel i with logits z (K classes):
//   p = softmax(z), nll_i = log Σ_k exp(z_k) - z_y  (computed with max subtracted)
//   loss contribution w[y]·nll_i, weight w[y]
//   dz_k = w[y]·(p_k - [k = y])·grad_scale
// The caller divides Σ w·nll by the global Σ w (the weighted mean: doc/design.md).
// With prob_clip ε > 0, Keras' categorical cross-entropy: p_y clipped to [ε, 1-ε]
// before the log, i.e. nll clamped to [-log(1-ε), -log ε], and a pixel whose p_y
// lies beyond the clip has no gradient (the clip's derivative is 0 there).

// The focal term (the loss menu, below) is the same loop with (1-p_y)^γ·nll (focal_terms):
// xent_rows.

#define XENT_CHUNK 4096

// gamma < 0: cross-entropy, dlogits overwritten; else the focal term, dlogits added into
static void xent_rows(Tensor logits, const int32_t *labels, const float *class_weights,
                      double gamma, float prob_clip, const float *grad_scale, float *stats,
                      Tensor dlogits) {
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
                const float wy = y >= 0 && y < K ? class_weights[y] : 0.0f;
                if (y >= K) bad += 1.0;
                float zmax = -INFINITY;
                for (int c = 0; c < K; c++) {
                    float z = ld(logits, r * K + c);
                    if (z > zmax) zmax = z;
                }
                double sum = 0.0;
                for (int c = 0; c < K; c++) sum += exp((double)ld(logits, r * K + c) - zmax);
                int flat = 0;
                double h = 1.0;  // the focal term's factor of (p - onehot(y))
                if (wy != 0.0f) {
                    double nll = xent_clip(log(sum) + zmax - ld(logits, r * K + y), clip, &flat);
                    if (gamma >= 0.0) focal_terms(nll, gamma, &nll, &h);
                    l += wy * nll;
                    w += wy;
                }
                if (dlogits.data)
                    for (int c = 0; c < K; c++) {
                        double p = exp((double)ld(logits, r * K + c) - zmax) / sum;
                        float g = flat ? 0.0f : (float)(wy * h * (p - (c == y)) * gscale);
                        st_acc(dlogits, r * K + c, g, gamma >= 0.0);
                    }
            }
            pl[k - g0] = l; pw[k - g0] = w; pi[k - g0] = bad;
        }
        for (size_t k = g0; k < g1; k++) {
            loss += pl[k - g0];
            wsum += pw[k - g0];
            invalid += pi[k - g0];
        }
    }
    stats[0] += (float)loss;
    stats[1] += (float)wsum;
    stats[2] += (float)invalid;
}
static void softmax_xent_ref(Ops *o, Tensor logits, const int32_t *labels,
                             const float *class_weights, float prob_clip, const float *grad_scale,
                             float *stats, Tensor dlogits) {
    (void)o;
    xent_rows(logits, labels, class_weights, -1.0, prob_clip, grad_scale, stats, dlogits);
}

// the first class of the largest logit of row r (ties to the lowest; a NaN never wins
// unless first)
static int argmax_row(Tensor logits, size_t r, int K) {
    int best = 0;
    float zbest = ld(logits, r * K);
    for (int c = 1; c < K; c++) {
        const float z = ld(logits, r * K + c);
        if (z > zbest) { zbest = z; best = c; }
    }
    return best;
}

// The loss menu's terms beyond cross-entropy: the focal term and the region terms
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

static void confusion_accumulate_ref(Ops *o, Tensor logits, const int32_t *labels,
                                     int64_t *confusion) {
    (void)o;
    const int K = logits.shape.c;
    const size_t M = shape_numel(logits.shape) / K;
    for (size_t r = 0; r < M; r++) {
        const int32_t y = labels[r];
        if (y < 0 || y >= K) continue;
        confusion[(size_t)y * K + argmax_row(logits, r, K)]++;
    }
}

double label_weight_sum(const int32_t *labels, size_t n, const float *class_weights, int K) {
    double s = 0.0;
    for (size_t i = 0; i < n; i++)
        if (labels[i] >= 0 && labels[i] < K) s += class_weights ? class_weights[labels[i]] : 1.0;
    return s;
}

// ----------------------------------------------------------------------------
// Adam (the formula is at AdamStep in segnet.h)

AdamStep adam_step_init(float lr, float beta1, float beta2, float eps, float weight_decay,
                        float grad_scale, int64_t t) {
    AdamStep s = {lr, beta1, beta2, eps, weight_decay, grad_scale, 0.0f, 0};
    s.alpha =
            (float)((double)lr * sqrt(1.0 - pow(beta2, (double)t)) / (1.0 - pow(beta1, (double)t)));
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
//   classes that occur, accuracy = Σ TP / Σ (TP + FN), Dice = 2·TP/(2·TP + FP + FN)
//   lr: linear warm-up over `warmup` steps, then constant, a cosine or poly to 0

void metrics_compute(const int64_t *cm, int K, const float *class_weights, Metrics *m) {
    int64_t correct = 0, counted = 0;
    double iou_sum = 0.0, dice_sum = 0.0;
    int n_iou = 0;
    for (int c = 0; c < K; c++) {
        m->iou[c] = NAN;
        if (m->dice) m->dice[c] = NAN;
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
            const double dice = 2.0 * (double)tp / (double)(2 * tp + fp + fn);
            if (m->dice) m->dice[c] = dice;
            iou_sum += m->iou[c], dice_sum += dice, n_iou++;
        }
    }
    m->mean_iou = n_iou ? iou_sum / n_iou : NAN;
    m->mean_dice = n_iou ? dice_sum / n_iou : NAN;
    m->accuracy = counted ? (double)correct / (double)counted : NAN;
}

double lr_at_step(double lr, Schedule s, int64_t warmup, int64_t total_steps, int64_t step) {
    if (step < warmup) return lr * (double)(step + 1) / (double)warmup;
    if (s == SCHEDULE_CONSTANT || s == SCHEDULE_PLATEAU || total_steps <= warmup) return lr;
    double progress = (double)(step - warmup) / (double)(total_steps - warmup);
    if (progress > 1.0) progress = 1.0;
    if (s == SCHEDULE_POLY) return lr * pow(1.0 - progress, POLY_POWER);
    return lr * 0.5 * (1.0 + cos(M_PI * progress));
}

// ----------------------------------------------------------------------------
// the reference table: every op above as its formula is written. ops_cpu
// (kernels_cpu.c) is this table with fast versions of conv2d, batch norm, the
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
    .plain_batch_norm = 1,  // bn_*_ref: the formula alone, the layer after it unfused
    .fill = fill_ref,
    .scale = scale_ref,
    .axpby = axpby_ref,
    .copy = copy_ref,
    .widen_bytes = widen_bytes_ref,
    .sum_squares = sum_squares_ref,
    .nonfinite = nonfinite_ref,
    .step_control = step_control_ref,
    .conv2d_workspace = conv2d_workspace_ref,
    .conv2d_forward = conv2d_forward_ref,
    .conv2d_backward_data = conv2d_backward_data_ref,
    .conv2d_backward_weight = conv2d_backward_weight_ref,
    .bn_stats = bn_stats_ref,
    .bn_stats_finish = bn_stats_finish_ref,
    .bn_forward = bn_forward_ref,
    .bn_update_running = bn_update_running_ref,
    .bn_backward_reduce = bn_backward_reduce_ref,
    .bn_backward_finish = bn_backward_finish_ref,
    .bn_backward_data = bn_backward_data_ref,
    .act_forward = act_forward_ref,
    .act_backward = act_backward_ref,
    .global_avg_pool_forward = global_avg_pool_forward_ref,
    .global_avg_pool_backward = global_avg_pool_backward_ref,
    .channel_scale_forward = channel_scale_forward_ref,
    .channel_scale_backward = channel_scale_backward_ref,
    .se_gate_forward = se_gate_forward_ref,
    .se_gate_backward = se_gate_backward_ref,
    .add_forward = add_forward_ref,
    .add_backward = add_backward_ref,
    .concat_forward = concat_forward_ref,
    .concat_backward = concat_backward_ref,
    .dropout_forward = dropout_forward_ref,
    .dropout_backward = dropout_backward_ref,
    .maxpool2_forward = maxpool2_forward_ref,
    .maxpool2_backward = maxpool2_backward_ref,
    .upsample2_forward = upsample2_forward_ref,
    .upsample2_backward = upsample2_backward_ref,
    .resize_bilinear_forward = resize_bilinear_forward_ref,
    .resize_bilinear_backward = resize_bilinear_backward_ref,
    .softmax_xent = softmax_xent_ref,
    .softmax_focal = softmax_focal_ref,
    .region_sums = region_sums_ref,
    .region_grad = region_grad_ref,
    .lovasz = lovasz_ref,
    .iou_per_image = iou_per_image_ref,
    .confusion_accumulate = confusion_accumulate_ref,
    .adam_update = adam_update_ref,
};

// ============================================================================
// PART II. THE MODELS
// A model is a graph of layers built from the ops' shapes; the builders check
// every shape and name the layer in their errors.
// ============================================================================

// ----------------------------------------------------------------------------
// the graph: builders validate shapes and name the layer in every error

static const char *LAYER_KIND_NAMES[LAYER_KIND_COUNT] = {
        "conv",      "dense",   "batchnorm", "activation", "global_avg_pool", "channel_scale",
        "add",       "concat",  "maxpool2",  "upsample2",  "resize_bilinear", "dropout",
        "drop_path", "rescale", "se_gate",
};
const char *layer_kind_name(LayerKind k) {
    return k >= 0 && k < LAYER_KIND_COUNT ? LAYER_KIND_NAMES[k] : "?";
}
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
    if ((n) == (cap)) { \
        (cap) = (cap) ? 2 * (cap) : 16; \
        (arr) = realloc((arr), sizeof *(arr) * (size_t)(cap)); \
        snCheck((arr) != NULL, "out of host memory growing the graph"); \
    } \
} while (0)

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

static int add_param(Graph *g, ParamInfo **table, int *n, int *cap, size_t *total,
                     const char *layer, const char *suffix, int ndim, const int *dims) {
    GROW(*table, *n, *cap);
    ParamInfo *p = &(*table)[*n];
    memset(p, 0, sizeof *p);
    if (snprintf(p->name, sizeof p->name, "%s.%s", layer, suffix) >= (int)sizeof p->name) {
        graph_fail(g, "layer '%s': parameter name too long (limit %d characters)", layer,
                   SN_NAME_MAX - 1);
        return -1;
    }
    p->ndim = ndim;
    int64_t d64[4];  // ParamInfo.dims
    for (int i = 0; i < ndim; i++) { p->dims[i] = dims[i]; d64[i] = dims[i]; }
    const uint64_t count = checked_product(d64, ndim);
    if (count > GRAPH_MAX_ELEMENTS || *total + count > GRAPH_MAX_ELEMENTS) {
        graph_fail(g,
                   "parameter '%s': the model's parameters would exceed the %.4g elements a plan "
                   "can hold (a smaller --width)",
                   p->name, (double)GRAPH_MAX_ELEMENTS);
        return -1;
    }
    p->count = (size_t)count;
    p->offset = *total;
    *total += p->count;
    return (*n)++;
}
static int add_weight(Graph *g, const char *layer, const char *suffix, int ndim, const int *dims) {
    return add_param(g, &g->params, &g->n_params, &g->cap_params, &g->n_param_floats, layer, suffix,
                     ndim, dims);
}
static int add_buffer(Graph *g, const char *layer, const char *suffix, int n) {
    return add_param(g, &g->buffers, &g->n_buffers, &g->cap_buffers, &g->n_buffer_floats, layer,
                     suffix, 1, &n);
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
        graph_fail(g,
                   "tensor '%s' would be (%d,%d,%d,%d), %.4g elements: more than the %.4g a plan "
                   "can hold (a smaller "
                   "--size, --batch or --width)",
                   name, s.n, s.h, s.w, s.c, (double)s.n * s.h * s.w * s.c,
                   (double)GRAPH_MAX_ELEMENTS);
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

static int conv_layer(Graph *g, LayerKind kind, const char *name, int x, int cout, int k,
                      int stride, int groups, PadMode pad, int bias) {
    if (g->err[0] || !valid_tensor(g, name, x)) return -1;
    Shape in = tshape(g, x);
    if (cout < 1 || k < 1 || stride < 1 || groups < 1) {
        graph_fail(g,
                   "layer '%s': cout %d, kernel %d, stride %d and groups %d must all be positive",
                   name, cout, k, stride, groups);
        return -1;
    }
    if (in.c % groups || cout % groups) {
        graph_fail(g,
                   "layer '%s': groups %d must divide input channels %d (input " SHAPE_FMT
                   ") and output channels %d",
                   name, groups, in.c, SHAPE_ARGS(in), cout);
        return -1;
    }
    int oh, ow, pt, pl;
    if (!conv_axis(in.h, k, stride, pad, &oh, &pt) || !conv_axis(in.w, k, stride, pad, &ow, &pl)) {
        graph_fail(g,
                   "layer '%s': kernel %dx%d (weight (%d,%d,%d,%d)) is larger than the padded "
                   "input " SHAPE_FMT " with %s padding",
                   name, k, k, cout, k, k, in.c / groups, SHAPE_ARGS(in), pad_name(pad));
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

int graph_conv(Graph *g, const char *name, int x, int cout, int k, int stride, int groups,
               PadMode pad, int bias) {
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
    if (!(eps > 0.0f)) {
        graph_fail(g, "layer '%s': batch norm eps must be positive, got %g", name, eps);
        return -1;
    }
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
        graph_fail(g, "layer '%s': cannot add " SHAPE_FMT " and " SHAPE_FMT, name, SHAPE_ARGS(sa),
                   SHAPE_ARGS(sb));
        return -1;
    }
    Layer *l = add_layer(g, LAYER_ADD, name, a, b, sa);
    return l ? l->out : -1;
}

int graph_concat(Graph *g, const char *name, int a, int b) {
    if (g->err[0] || !valid_tensor(g, name, a) || !valid_tensor(g, name, b)) return -1;
    Shape sa = tshape(g, a), sb = tshape(g, b);
    if (sa.n != sb.n || sa.h != sb.h || sa.w != sb.w) {
        graph_fail(g,
                   "layer '%s': cannot concat " SHAPE_FMT " and " SHAPE_FMT " (N, H, W must match)",
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
        graph_fail(g, "layer '%s': 2x2 max-pool needs at least 2x2 pixels, input is " SHAPE_FMT,
                   name, SHAPE_ARGS(in));
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
        graph_fail(g, "layer '%s': cannot resize " SHAPE_FMT " to %dx%d", name, SHAPE_ARGS(in), oh,
                   ow);
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

int graph_dropout(Graph *g, const char *name, int x, float rate) {
    return dropout_layer(g, LAYER_DROPOUT, name, x, rate);
}
int graph_drop_path(Graph *g, const char *name, int x, float rate) {
    return dropout_layer(g, LAYER_DROP_PATH, name, x, rate);
}
int graph_drop_path_add(Graph *g, const char *name, int x, int residual, float rate) {
    if (g->err[0] || !valid_tensor(g, name, residual)) return -1;
    if (!shape_eq(tshape(g, x), tshape(g, residual))) {
        graph_fail(g, "layer '%s': cannot add " SHAPE_FMT " and " SHAPE_FMT, name,
                   SHAPE_ARGS(tshape(g, x)), SHAPE_ARGS(tshape(g, residual)));
        return -1;
    }
    int y = dropout_layer(g, LAYER_DROP_PATH, name, x, rate);
    if (y >= 0) g->layers[g->n_layers - 1].in[1] = residual;
    return y;
}

// layer name "prefix.suffix" (names are checked for length by add_layer)
static const char *lname(char buf[2 * SN_NAME_MAX], const char *prefix, const char *suffix) {
    if (snprintf(buf, 2 * SN_NAME_MAX, "%s.%s", prefix, suffix) >= 2 * SN_NAME_MAX)
        buf[2 * SN_NAME_MAX - 1] = 0;
    return buf;
}
int graph_se_gate(Graph *g, const char *name, int p, int squeeze, Act act1, Act act2) {
    if (g->err[0] || !valid_tensor(g, name, p)) return -1;
    const Shape in = tshape(g, p);
    if (in.h != 1 || in.w != 1 || squeeze < 1) {
        graph_fail(g,
                   "layer '%s': a squeeze-excitation gate takes pooled (N,1,1,C) and squeezes to ≥ "
                   "1 channel, not " SHAPE_FMT " to %d",
                   name, SHAPE_ARGS(in), squeeze);
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
//     FusedMBConv         block.0 = k×k conv (stride) to in·e, BN, SiLU;
//                         block.1 = 1×1 conv to out, BN
//                         (expansion 1: block.0 = k×k conv to out, BN, SiLU)
//     MBConv              block.0 = 1×1 expand, BN, SiLU;
//                         block.1 = k×k depthwise (stride), BN, SiLU;
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
static int conv_bn_act(Graph *g, const char *p, int x, int cout, int k, int stride, int groups,
                       PadMode pad, float eps, Act act) {
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
// activation (with_head 0: to the last stage's output). stage_out[s] receives
// the output of features.s (s = 0..S+1).
static int effnetv2_features(Graph *g, const EffSpec *sp, int x, PadMode pad, int with_head,
                             int *stage_out) {
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
                y = conv_bn_act(g, lname(b, p, "block.0"), x, st->cout, st->kernel, stride, 1, pad,
                                BN_EPS_EFFNET, ACT_SILU);
            } else if (st->fused) {
                y = conv_bn_act(g, lname(b, p, "block.0"), x, exp, st->kernel, stride, 1, pad,
                                BN_EPS_EFFNET, ACT_SILU);
                y = conv_bn_act(g, lname(b, p, "block.1"), y, st->cout, 1, 1, 1, pad, BN_EPS_EFFNET,
                                ACT_NONE);
            } else {
                y = conv_bn_act(g, lname(b, p, "block.0"), x, exp, 1, 1, 1, pad, BN_EPS_EFFNET,
                                ACT_SILU);
                y = conv_bn_act(g, lname(b, p, "block.1"), y, exp, st->kernel, stride, exp, pad,
                                BN_EPS_EFFNET, ACT_SILU);
                y = squeeze_excitation(g, lname(b, p, "block.2"), y, cin / 4 > 1 ? cin / 4 : 1);
                y = conv_bn_act(g, lname(b, p, "block.3"), y, st->cout, 1, 1, 1, pad, BN_EPS_EFFNET,
                                ACT_NONE);
            }
            if (stride == 1 && cin == st->cout) {
                y = graph_drop_path_add(g, lname(b, p, "stochastic_depth_add"), y, x,
                                        EFF_STOCHASTIC_DEPTH * (float)b_id / (float)total);
            }
            x = y;
        }
        stage_out[s + 1] = x;
    }
    if (!with_head) return x;
    graph_begin_stage(g, "head");
    graph_begin_block(g);
    snprintf(p, sizeof p, "features.%d", sp->n_stages + 1);
    x = conv_bn_act(g, p, x, sp->head_channels, 1, 1, 1, pad, BN_EPS_EFFNET, ACT_SILU);
    stage_out[sp->n_stages + 1] = x;
    return x;
}

ModelCfg model_cfg_default(void) {
    ModelCfg c = {"unet", 4, 1, 256, 256, PAD_SAME, 0, 4, 32, 0, -1.0f, BOTTLENECK_HEAD};
    return c;
}

// GAP → dropout → dense(classes), or GAP → dropout → dense(H) ReLU → dropout → dense(classes)
static int classifier_head(Graph *g, int x, const EffSpec *sp, const ModelCfg *c) {
    graph_begin_stage(g, "classifier");
    graph_begin_block(g);
    const float rate = c->dropout >= 0.0f ? c->dropout : sp->dropout;
    x = graph_dropout(g, "classifier.0", graph_gap(g, "avgpool", x), rate);
    if (c->head_hidden > 0) {
        x = graph_act(g, "classifier.2", graph_dense(g, "classifier.1", x, c->head_hidden, 1),
                      ACT_RELU);
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
        graph_fail(g, "model 'unet': depth %d must be 1..8 and width %d positive", c->depth,
                   c->width_base);
        return -1;
    }
    if (c->height % div || c->width % div) {
        graph_fail(g,
                   "model 'unet' (depth %d): input %dx%d must be a multiple of %d on each side "
                   "(e.g. %dx%d)",
                   c->depth, c->height, c->width, div, (c->height + div - 1) / div * div,
                   (c->width + div - 1) / div * div);
        return -1;
    }
    char p[SN_NAME_MAX], b[2 * SN_NAME_MAX];
    int skip[9];
    int x = graph_input(g, shape4(c->batch, c->height, c->width, 3));
    // 0..255 input, as for the EfficientNets
    x = graph_rescale(g, "rescale", x, 1.0f / 128.0f, -1.0f);
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
// skips at strides 16, 8, 4, 2 from the last stage at each resolution; the
// bottleneck at /32 is the head activation (BOTTLENECK_HEAD, 1280 channels, as
// Keras' segmentation_models takes a backbone's output) or the last stage's
// (BOTTLENECK_STAGE: smp's Unet on a timm `tu-` encoder, which stops there); per
// decoder stage nearest 2× upsample → concat skip → two 3×3 conv-BN-ReLU with
// (256,128,64,32,16) filters; a 3×3 conv with bias to the class logits.
static const int UNET_DECODER_CHANNELS[5] = {256, 128, 64, 32, 16};

static int unet_effnetv2_build(Graph *g, const ModelCfg *c, const EffSpec *sp) {
    if (c->height % 32 || c->width % 32) {
        graph_fail(g, "model '%s': input %dx%d must be a multiple of 32 on each side (e.g. %dx%d)",
                   c->model, c->height, c->width, (c->height + 31) / 32 * 32,
                   (c->width + 31) / 32 * 32);
        return -1;
    }
    int stage_out[16];
    int x = graph_input(g, shape4(c->batch, c->height, c->width, 3));
    x = effnetv2_features(g, sp, x, c->pad, c->bottleneck == BOTTLENECK_HEAD, stage_out);
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
            if (sk < 0) {
                graph_fail(g, "model '%s': the encoder has no stage at stride %d", c->model,
                           1 << (4 - i));
                return -1;
            }
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
    g->init = strcmp(c->model, "unet") ? INIT_EFFNET : INIT_TORCH_DEFAULT;
    if (!strcmp(c->model, "unet")) return unet_build(g, c);
    if (!strncmp(c->model, "unet-", 5) && eff_spec(c->model + 5))
        return unet_effnetv2_build(g, c, eff_spec(c->model + 5));
    const EffSpec *sp = eff_spec(c->model);
    if (!sp) {
        graph_fail(g, "unknown model '%s' (models: unet, effv2-s, effv2-m, effv2-l, effv2-t, "
                   "unet-effv2-s, unet-effv2-m, unet-effv2-l, unet-effv2-t)", c->model);
        return -1;
    }
    int stage_out[16];
    int x = graph_input(g, shape4(c->batch, c->height, c->width, 3));
    x = effnetv2_features(g, sp, x, c->pad, 1, stage_out);
    return classifier_head(g, x, sp, c);
}

// The model's graph: its logits, or -1 with g->err (also when a tensor failed
// a check after which building went on).
int model_build(Graph *g, const ModelCfg *c) {
    int logits = model_build_unchecked(g, c);
    return g->err[0] ? -1 : logits;
}

static int is_backbone_layer(const Layer *l) {
    return !strncmp(l->name, "features.", 9) || !strncmp(l->name, "enc", 3);
}

int graph_freeze_base(Graph *g, int unfreeze_last) {
    int n_blocks = 0, seen = 0, last = -1;
    for (int i = 0; i < g->n_layers; i++)
        if (is_backbone_layer(&g->layers[i]) && g->layers[i].block != last) {
            n_blocks++;
            last = g->layers[i].block;
        }
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

// standard normal by Box-Muller
float rng_normal(Rng *r) {
    float u1 = rng_float(r), u2 = rng_float(r);
    if (u1 < 1e-7f) u1 = 1e-7f;
    return sqrtf(-2.0f * logf(u1)) * cosf(6.28318530718f * u2);
}

// one layer's weight (and bias) in host: its own random stream, by parameter id
static void init_weights(const Graph *g, LayerKind kind, const ConvCfg *conv, int weight, int bias,
                         uint64_t seed, float *host) {
    const ParamInfo *p = &g->params[weight];
    float *w = host + p->offset;
    Rng r;  // one stream per tensor: adding a layer does not reshuffle the others
    rng_seed(&r, rng_mix64(seed ^ rng_mix64((uint64_t)weight + 1)));
    if ((kind == LAYER_CONV || kind == LAYER_DENSE) && g->init == INIT_TORCH_DEFAULT) {
        float bound = 1.0f / sqrtf((float)(conv->cin / conv->groups * conv->kh * conv->kw));
        for (size_t k = 0; k < p->count; k++) w[k] = bound * (2.0f * rng_float(&r) - 1.0f);
        if (bias >= 0) {
            const ParamInfo *pb = &g->params[bias];
            for (size_t k = 0; k < pb->count; k++)
                host[pb->offset + k] = bound * (2.0f * rng_float(&r) - 1.0f);
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
// fusing layers
//
// A batch norm's output usually goes straight into one cheap layer. Where that
// layer only reads the tensor once more, and the table fuses (ops_cpu, ops_cuda;
// not ops_ref, whose plain_batch_norm keeps its batch norm the formula alone),
// the executor hands its work to the batch norm's ops (BnNext), which on a GPU
// saves a pass over the tensor and a kernel launch:
//   FUSED_POOL      squeeze-excitation's pool of the BN's output (forward; the
//                   output is still written, the channel scale reads it);
//   FUSED_RESIDUAL  a residual block's end, drop_path(BN output) + residual,
//                   when nothing else reads the BN's output (forward and
//                   backward: the BN's output and its gradient need not pass
//                   through memory).
// The results are the unfused ones, bit for bit (tests: fuse_layers 0). The
// plan, built for the table that runs it, gives the fused layer its batch
// norm's slots, so that what either layer touches is alive while the fused op
// runs.
int fuse_layers = 1;

Fusion layer_fusion(const Graph *g, const Ops *o, int j) {
    if (!fuse_layers || o->plain_batch_norm || j < 1 || j >= g->n_layers) return FUSED_NONE;
    const Layer *bn = &g->layers[j - 1], *l = &g->layers[j];
    if (bn->kind != LAYER_BN || l->in[0] != bn->out || l->block != bn->block) return FUSED_NONE;
    if (l->kind == LAYER_GAP) return FUSED_POOL;
    if (l->kind != LAYER_DROP_PATH || l->in[1] < 0 || l->in[1] == bn->out ||
        bn->out == g->layers[g->n_layers - 1].out)
        return FUSED_NONE;
    for (int i = 0; i < g->n_layers; i++)
        if (i != j && (g->layers[i].in[0] == bn->out || g->layers[i].in[1] == bn->out))
            return FUSED_NONE;
    return FUSED_RESIDUAL;
}

// A fusing table's batch norm with the layer after it (BnNext) as the two ops
// one after the other, the layer after it from the same table o (bn_*_cpu, and
// ops_cuda where it has no fused kernel for a case): a residual block's end in
// place in out (forward) and in out's gradient dy (backward), so y and its
// gradient need no memory.

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
        o->dropout_backward(o, dy, next->dresidual, dy, next->rate, next->seed, 1,
                            next->first_sample, 0, acc);
    else if (next->dresidual.data)
        o->copy(o, next->dresidual, dy, acc);  // keep = 1: dy is y's gradient as it is
}

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
    case LAYER_CONV:
    case LAYER_DENSE:
        return k == 0 && !l->frozen && (l->weight >= 0 || l->bias >= 0);
    case LAYER_BN: case LAYER_ACT: case LAYER_MAXPOOL: case LAYER_SE_GATE: return k == 0;
    case LAYER_SCALE: return 1;
    default: return 0;
    }
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
static int plan_add(Plan *p, int tensor, int is_grad, int recompute, int first, int last,
                    size_t bytes) {
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
static size_t plan_pack(Plan *p, const int *order, int best_fit, size_t workspace, int *placed,
                        int *live) {
    size_t peak = workspace;
    int n_placed = 0;
    for (int k = 0; k < p->n_bufs; k++) {
        PlanBuffer *b = &p->bufs[order[k]];
        int n_live = 0;
        for (int j = 0; j < n_placed; j++) {
            const PlanBuffer *q = &p->bufs[placed[j]];
            if (q->first <= b->last && b->first <= q->last) live[n_live++] = placed[j];
        }
        // from: where the next gap starts
        size_t at = workspace, gap_best = SIZE_MAX, from = workspace;
        for (int j = 0; j <= n_live; j++) {
            // the gap [from, to)
            const size_t to = j < n_live ? p->bufs[live[j]].offset : SIZE_MAX;
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

void plan_build(Plan *p, const Graph *g, const Ops *o, const int *needs_grad, DType dtype,
                int output, int checkpoint, size_t workspace) {
    memset(p, 0, sizeof *p);
    const int L = g->n_layers, T = g->n_tensors;
    p->checkpoint = checkpoint;
    // the tensors after it stay aligned
    workspace = (workspace + SN_TENSOR_ALIGN - 1) / SN_TENSOR_ALIGN * SN_TENSOR_ALIGN;
    p->workspace = workspace;
    p->fwd_slot = malloc(sizeof(int) * L);
    p->rec_slot = malloc(sizeof(int) * L);
    p->bwd_slot = malloc(sizeof(int) * L);
    p->recompute = calloc((size_t)L, sizeof(int));
    p->slot_kind = malloc(sizeof(int) * (3 * L + 1));
    p->slot_layer = malloc(sizeof(int) * (3 * L + 1));
    p->bufs = calloc((size_t)3 * T + 1, sizeof(PlanBuffer));
    snCheck(p->fwd_slot && p->rec_slot && p->bwd_slot && p->slot_kind && p->slot_layer && p->bufs,
            "out of host memory");
    // the schedule; a block is recomputed only if some layer of it runs a backward
    int n = 0;
    for (int i = 0; i < L; i++) {
        p->fwd_slot[i] = n;
        p->slot_kind[n] = SLOT_FORWARD;
        p->slot_layer[n++] = i;
    }
    p->loss_slot = n; p->slot_kind[n] = SLOT_LOSS; p->slot_layer[n++] = -1;
    for (int i = 0; i < L; i++) p->rec_slot[i] = -1;
    for (int i = L - 1; i >= 0; i--) {
        if (checkpoint && (i == L - 1 || g->layers[i + 1].block != g->layers[i].block)) {
            int first = i, backward = 0;
            while (first > 0 && g->layers[first - 1].block == g->layers[i].block) first--;
            for (int j = first; j <= i; j++) backward |= needs_grad[g->layers[j].out];
            for (int j = first; backward && j <= i; j++) {
                p->rec_slot[j] = n;
                p->slot_kind[n] = SLOT_RECOMPUTE;
                p->slot_layer[n++] = j;
            }
        }
        p->bwd_slot[i] = n; p->slot_kind[n] = SLOT_BACKWARD; p->slot_layer[n++] = i;
    }
    p->n_slots = n;
    Fusion *fusion = malloc(sizeof(Fusion) * (size_t)(L + 1));
    snCheck(fusion != NULL, "out of host memory");
    for (int j = 0; j < L; j++) fusion[j] = layer_fusion(g, o, j);  // as the net's, net_create
    fusion[L] = FUSED_NONE;
    // a fused layer runs in its batch norm's slots (their own stay empty)
    for (int j = 1; j < L; j++) {
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
        // y of a fused residual end: no memory
        if (prod >= 0 && fusion[prod + 1] == FUSED_RESIDUAL) continue;
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
                const int use = reads                 ? p->bwd_slot[i]
                                : p->rec_slot[i] >= 0 ? p->rec_slot[i]
                                                      : p->fwd_slot[i];
                if (p->fwd_slot[i] > fwd_last) fwd_last = p->fwd_slot[i];
                if (use > keep_last) keep_last = use;
                if (p->rec_slot[i] >= 0 && p->rec_slot[i] > keep_last) keep_last = p->rec_slot[i];
                if (use > rec_last) rec_last = use;
                if (needs_grad[c->out] && needs_grad[t] &&
                    (grad_first < 0 || p->bwd_slot[i] < grad_first))
                    grad_first = p->bwd_slot[i];
            }
        }
        if (t == output) { keep_last = fwd_last = p->loss_slot; grad_first = p->loss_slot; }
        const int first = prod >= 0 ? p->fwd_slot[prod] : 0;
        if (internal) {
            p->recompute[prod] = 1;
            plan_add(p, t, 0, 0, first, fwd_last, bytes);
            plan_add(p, t, 0, 1, p->rec_slot[prod],
                     rec_last > p->rec_slot[prod] ? rec_last : p->rec_slot[prod], bytes);
        } else {
            plan_add(p, t, 0, 0, first, keep_last, bytes);
        }
        if (needs_grad[t]) {
            int last = prod >= 0 ? p->bwd_slot[prod] : p->n_slots - 1;
            // no path to the loss: zero-filled by its producer's backward
            if (grad_first < 0) grad_first = last;
            plan_add(p, t, 1, 0, grad_first, last, bytes);
        }
    }
    // offsets: the workspace first, at 0, for the whole step; the lower of the two packings
    int *order = malloc(sizeof(int) * (size_t)(p->n_bufs + 1)),
        *placed = malloc(sizeof(int) * (size_t)(p->n_bufs + 1));
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
    p->start_head = malloc(sizeof(int) * (size_t)p->n_slots);
    p->end_head = malloc(sizeof(int) * (size_t)p->n_slots);
    p->start_next = malloc(sizeof(int) * (size_t)p->n_bufs + 1);
    p->end_next = malloc(sizeof(int) * (size_t)p->n_bufs + 1);
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
Tensor net_tensor(const Net *net, int t) {
    return tensor(net->act[t], net_shape(net, t), net->dtype);
}
Tensor net_grad(const Net *net, int t) {
    return tensor(net->grad[t], net_shape(net, t), net->dtype);
}

static float *param_ptr(float *base, const Graph *g, int id) {
    return id < 0 ? NULL : base + g->params[id].offset;
}
// a parameter in the storage type (weights_in_storage_type), or NULL
static const void *param_cast(const Net *net, int id) {
    return id < 0 || !net->params_cast ? NULL
                                       : (const char *)net->params_cast +
                                                 net->g->params[id].offset * dtype_size(net->dtype);
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
static float *buffer_ptr(const Net *net, int id) {
    return net->buffers + net->g->buffers[id].offset;
}

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
    if (net->plan) {
        plan_free(net->plan);
        free(net->plan);
        o->free(o, net->arena);
        net->ws = NULL;
    } else
        for (int t = 0; net->act && t < g->n_tensors; t++) {
            o->free(o, net->act[t]);
            if (net->grad) o->free(o, net->grad[t]);
        }
    for (int l = 0; net->bn_mean && l < g->n_layers; l++) {
        o->free(o, net->bn_mean[l]);
        o->free(o, net->bn_var[l]);
    }
    o->free(o, net->params); o->free(o, net->grads); o->free(o, net->buffers);
    o->free(o, net->bn_scratch);
    o->free(o, net->bn_sums);
    o->free(o, net->ws);
    o->free(o, net->layer_seeds);
    o->free(o, net->params_cast);
    free(net->act);
    free(net->grad);
    free(net->needs_grad);
    free(net->grad_written);
    free(net->bn_mean);
    free(net->bn_var);
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
            net->o->fill(net->o,
                         tensor(net->arena + q->offset,
                                shape4((int)(q->bytes / dtype_size(net->dtype)), 1, 1, 1),
                                net->dtype),
                         NAN);
    }
}

// plan: NULL for one allocation per tensor, else the arena's layout (taken over)
static int net_create_with(Net *net, const Graph *g, Ops *o, DType dtype, int input_needs_grad,
                           Plan *plan, char err[SN_ERR_MAX]) {
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
    snCheck(net->act && net->grad && net->needs_grad && net->grad_written && net->bn_mean &&
                    net->bn_var && net->fusion,
            "out of host memory");
    for (int j = 0; j < L; j++) net->fusion[j] = layer_fusion(g, o, j);

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
        ok = net->params && net->grads && net->buffers && net->bn_scratch && net->bn_sums &&
             net->layer_seeds && (!ws || net->ws) && (!cast || net->params_cast);
    }
    if (!ok) {
        snprintf(
                err, SN_ERR_MAX,
                "out of %s memory allocating the network's tensors (%.2f GiB for the step's arena: "
                "segnet plan --memory SIZE finds a setting that fits)",
                o->name, plan ? plan->peak / 1073741824.0 : 0.0);
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
        o->fill(o,
                tensor_f32(net->buffers + g->buffers[b].offset,
                           shape4((int)g->buffers[b].count, 1, 1, 1)),
                is_var ? 1.0f : 0.0f);
    }
    return 0;
}

int net_create(Net *net, const Graph *g, Ops *o, DType dtype, int input_needs_grad,
               char err[SN_ERR_MAX]) {
    return net_create_with(net, g, o, dtype, input_needs_grad, NULL, err);
}

int net_create_planned(Net *net, const Graph *g, Ops *o, DType dtype, int input_needs_grad,
                       int output, int checkpoint, char err[SN_ERR_MAX]) {
    if (g->err[0] || g->input < 0 || g->n_layers == 0)
        return net_create_with(net, g, o, dtype, input_needs_grad, NULL, err);
    int *needs_grad = malloc(sizeof(int) * (size_t)g->n_tensors);
    Plan *plan = malloc(sizeof *plan);
    snCheck(needs_grad && plan, "out of host memory");
    graph_needs_grad(g, input_needs_grad, needs_grad);
    plan_build(plan, g, o, needs_grad, dtype, output, checkpoint,
               net_workspace_bytes(g, o, dtype));
    free(needs_grad);
    return net_create_with(net, g, o, dtype, input_needs_grad, plan, err);
}

// BN in a layer uses batch statistics when training and not frozen (a frozen
// BN runs in inference mode, Keras' trainable=False); dropout and drop-path
// are active under the same condition.
static int layer_in_train_mode(const Net *net, const Layer *l) {
    return net->training && !l->frozen;
}

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
    // fp64 zeros
    if (!count) o->fill(o, tensor_f32((float *)net->bn_sums, shape4((int)(2 * n), 1, 1, 1)), 0.0f);
    if (comm->device && o->backend) {
        int64_t total = (int64_t)count;
        if (comm->allreduce_i64(comm, &total, 1) ||
            comm->device->allreduce_f64(comm->device, net->bn_sums, n)) {
            net->failed = 1;
            return 0;
        }
        return (size_t)total;
    }
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
    const Layer *l = &g->layers[i];
    // a replica with an empty shard (the last, small global batch) only takes part in the
    // collectives
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
            if (net->keep_running) rm = rv = NULL;
            if (!recompute) {
                const int C = x.shape.c;
                size_t count = shape_numel(x.shape) / C;
                float *mean = net->bn_mean[i], *var = net->bn_var[i];
                if (!net->sync_bn) {  // the running statistics are updated in the same pass
                    if (count) o->bn_stats(o, x, mean, var, rm, rv, BN_MOMENTUM, NULL);
                } else {
                    if (count) o->bn_stats(o, x, mean, var, NULL, NULL, 0.0f, net->bn_sums);
                    count = bn_sync_sums(net, C, count);
                    if (count)
                        o->bn_stats_finish(o, net->bn_sums, C, count, mean, var, rm, rv,
                                           BN_MOMENTUM);
                }
            }
            const BnArgs bn = {net->bn_mean[i], net->bn_var[i], w, b, l->eps, l->act, next};
            if (net->batch) o->bn_forward(o, y, x, &bn);
        } else {
            const BnArgs bn = {rm, rv, w, b, l->eps, l->act, next};
            o->bn_forward(o, y, x, &bn);
        }
        break;
    }
    case LAYER_ACT: o->act_forward(o, l->act, y, x); break;
    case LAYER_SE_GATE:
        o->se_gate_forward(o, y, x, w, b, param_ptr(net->params, g, l->weight2),
                           param_ptr(net->params, g, l->bias2), l->conv.cout, l->act, l->act2);
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
            o->dropout_forward(o, y, x, x2, l->rate, net->layer_seeds + i,
                               l->kind == LAYER_DROP_PATH, net->first_sample);
        else if (x2.data)
            o->add_forward(o, y, x, x2);
        else
            o->copy(o, y, x, 0);
        break;
    default: snCheck(0, "forward: layer '%s' has unknown kind %d", l->name, (int)l->kind);
    }
    if (net->layer_seconds) { o->synchronize(o); net->layer_seconds[i] += layer_clock() - t0; }
}

int net_capacity(const Net *net) { return net->g->tensors[net->g->input].shape.n; }

void net_forward(Net *net, int n, int training) {
    snCheck(n >= 0 && n <= net_capacity(net), "forward of %d images in a graph planned for %d", n,
            net_capacity(net));
    net->batch = n;
    net->training = training;
    if (training) net_seeds_current(net);
    // once per forward: whatever changed the fp32 weights since, the copy follows
    if (net->params_cast)
        net->o->copy(
                net->o,
                tensor(net->params_cast, shape4((int)net->g->n_param_floats, 1, 1, 1), net->dtype),
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
        Tensor dx2 = b >= 0 && net->needs_grad[b] ? net_grad(net, b)
                                                  : tensor(NULL, x2.shape, net->dtype);
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
            if (dx.data)
                o->conv2d_backward_data(o, &l->conv, dx, dy, w, param_cast(net, l->weight), acc_a,
                                        net->ws);
            break;
        case LAYER_BN: {
            const int C = x.shape.c;
            float *sum_g = net->bn_scratch, *sum_gx = net->bn_scratch + C;
            int batch = layer_in_train_mode(net, l);
            const float *mean = batch ? net->bn_mean[i] : buffer_ptr(net, l->run_mean);
            const float *var = batch ? net->bn_var[i] : buffer_ptr(net, l->run_var);
            // 0: the statistics were constants
            size_t count = batch ? shape_numel(x.shape) / C : 0;
            const int synced = batch && net->sync_bn && (net->needs_grad[a] || dw);
            const BnArgs bn = {mean, var, w, bias, l->eps, l->act, next};
            if ((batch || dw || next) && net->batch)  // with next, always (BnNext)
                o->bn_backward_reduce(o, dy, x, &bn, batch || dw ? sum_g : NULL, sum_gx,
                                      synced ? NULL : dw, synced ? NULL : dbias,
                                      synced ? net->bn_sums : NULL);
            if (synced) {
                count = bn_sync_sums(net, C, count);
                const int adds = net->sync_bn->rank == 0;  // see "batch norm across replicas"
                if (count)
                    o->bn_backward_finish(o, net->bn_sums, C, sum_g, sum_gx, adds ? dw : NULL,
                                          adds ? dbias : NULL);
            }
            if (dx.data && net->batch && !net->failed)
                o->bn_backward_data(o, dx, dy, x, &bn, sum_g, sum_gx, count, acc_a);
            break;
        }
        case LAYER_ACT: if (dx.data) o->act_backward(o, l->act, dx, dy, x, acc_a); break;
        case LAYER_SE_GATE:
            o->se_gate_backward(o, dx, dy, x, w, bias, param_ptr(net->params, g, l->weight2),
                                param_ptr(net->params, g, l->bias2), l->conv.cout, l->act, l->act2,
                                dw, dbias, trainable ? grad_ptr(net, l->weight2) : NULL,
                                trainable ? grad_ptr(net, l->bias2) : NULL, acc_a);
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
                o->dropout_backward(o, dx, dx2, dy, l->rate, net->layer_seeds + i,
                                    l->kind == LAYER_DROP_PATH, net->first_sample, acc_a, acc_b);
            else
                // without a residual: a copy into dx
                o->add_backward(o, dx, dx2, dy, acc_a, acc_b);
            break;
        default: snCheck(0, "backward: layer '%s' has unknown kind %d", l->name, (int)l->kind);
        }
        if (net->layer_seconds) {
            o->synchronize(o);
            net->layer_seconds[g->n_layers + i] += layer_clock() - t0;
        }
    }
}

void net_backward(Net *net, int n, int output) {
    snCheck(n == net->batch, "backward of %d images after a forward of %d", n, net->batch);
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
            // a kept output is still there (and may be dead by now)
            for (int j = first; j <= i; j++) {
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
        // nothing to fuse
        if (next && !net->needs_grad[g->layers[i].out]) layer_backward(net, i + 1, 0);
        layer_backward(net, i, next && net->needs_grad[g->layers[i].out]);
        if (p) plan_leave(net, p->bwd_slot[i]);
    }
}

// ----------------------------------------------------------------------------
// the training step: one optimiser step of a Trainer (the plumbing, run.c, opens it, runs
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
    // skipped steps in a row: the current run, the longest in the span
    int64_t skip_run, skip_run_max;
    double norm_sum, norm_max;        // of the applied steps
    double loss_sum, label_sum;       // this replica's Σw·nll and Σw (or labels) of the steps
    double loss_scale;                // after the span's last step (1 without loss scaling)
    double update_ratio;              // of the span's last step; NAN: not measured
    // wall time in train_step over `timed` steps, this process's (a checkpoint keeps no wall
    // time, so that resumed runs save the same bits)
    double seconds;
    int64_t timed;
} StepStats;
static void step_stats_add(StepStats *st, const StepState *s, double seconds, double loss,
                           double local_norm) {
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
    st->loss_sum += loss;
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
    LossCfg loss;               // c->loss, or ce alone
    // (terms + 1,K) each term's weights (trainer_open_on), then the classes' own (the metrics')
    float *class_weights;
    // the region terms' (groups,3,K) sums and (groups,2,K) coefficients, groups: 1, or the
    // shard's images with per_image; NULL without region terms
    float *region_sums, *region_coefs;  // region_coefs: and a float that takes no value
    float *region_rows;                 // (N·H·W,2) region_sums' scratch
    void *lovasz_ws;                    // Ops.lovasz's scratch (lovasz_ws_bytes), or NULL
    // region_sums already holds the step's sums over all its micro-batches (region_presum):
    // 1, 2 once a micro-batch has reported the step's value
    int region_presummed;
    int32_t *labels;            // (N·H·W) or (N)
    // (cm_len): the (K,K) confusion matrix, then with --iou-per-image its sums (iou_per_image)
    int64_t *confusion;
    size_t cm_len;
    StepArgs *args;             // backend memory: the step's arguments, from host_args
    StepState *state;           // backend memory: what the step decides (step_control)
    StepArgs *host_args;        // host_alloc: written before each step, read when its upload runs
    StepState *host_state;      // host_alloc: the step's StepState, read back at its end
    uint64_t *host_seeds;       // host_alloc: (n_layers) the step's dropout seeds
    float *host_images;         // host_alloc: (N,H,W,3) a micro-batch without a wire, staged
    int32_t *host_labels;       // host_alloc: its labels
    // the recorded step (Ops.capture_*), replayed by later steps; NULL: none
    void *record;
    // 1: record steps where the backend can (SEGNET_CUDA_GRAPHS=0: never); warmed: a
    // recordable step ran op by op (it loads every kernel: CUDA loads them lazily, at
    // first launch, which a capture may not do; drivers before 12.3 refuse it)
    int records, warmed;
    size_t per_image;           // labels per image: H·W (segmentation) or 1
    struct { size_t offset, count; } *ranges;  // trainable parameters: runs of the parameter buffer
    int n_ranges;
    size_t n_trainable;         // Σ counts: the size of each Adam moment
    // (N,H,W,3) the images on the device before they become the input: fp32 before the cast to
    // the storage type (when that is not fp32), or bytes before widen_bytes; or a batch
    // uploaded ahead: its wire, then its labels at stage_labels_offset
    void *stage;
    // the next step's batch (run_pass), which this step uploads ahead when the backend can,
    // or NULL
    const struct MicroBatch *next;
    const void *ahead_wire;     // the wire of the batch uploaded ahead into stage, or NULL
    int ahead_n;                // its images
    int64_t steps_ahead;        // the steps that found their batch uploaded ahead (tests)
    float *accum_images;        // host: accum × (N,H,W,3), micro-batches waiting for their step
    int32_t *accum_labels;      // host: accum × (N·H·W or N)
    int64_t total_steps;        // optimiser steps of the whole run (schedules)
    float loss_scale;           // fp16: the dynamic loss scale; else 1
    int64_t good_steps;         // fp16: consecutive finite steps since the last change of scale
    int64_t step;               // optimiser steps taken
    int step_images;            // the images of the step being taken, over the replicas
    int epoch;                  // epochs completed
    double best;                // lowest monitored loss so far (val_loss, else loss)
    int best_epoch, bad_epochs;
    int finished;               // stopped early (a run that reached its epochs can be extended)
    Plateau plateau;            // the lr steps start from; --schedule plateau lowers it
    // an epoch interrupted part-way (SIGINT/SIGTERM): its training pass goes on at global batch
    // resume_batch (the pass's batch count: only the validation is left) with these totals,
    // this replica's so far; 0 when epochs start at their beginning
    int resume_batch;
    double resume_loss_sum, resume_norm_sum;
    int64_t *resume_cm;         // (K,K), NULL when resume_batch is 0
    Comm *comm;                 // the replicas (size 1: this trainer alone)
    // images of a full global batch on this replica: model.batch / replicas
    int shard;
    // train and val belong to another replica (local replicas share them)
    int borrowed_data;
    // (n_buffer_floats + 1) fp64 staging to average BN statistics over replicas
    double *bn_host;
    StepStats epoch_stats;      // the optimisation diagnostics of this epoch's steps so far
    StepStats log_stats;        // and of the steps since the last row of steps.csv (--log-every)
    int measure_update;         // 1: the next step measures its update ratio (the epoch's last)
    // (2·n_trainable) host: the trainable weights before and after that step
    float *update_host;
    char *steps_csv;            // steps.csv's path (root, --log-every), else NULL
    // backend memory: set when a tensor of the model holds NaN or inf (model_finite)
    int32_t *nonfinite;
    // the training set's fingerprint (data_fingerprint), saved with each checkpoint
    char data_print[64];
    // the last step's host time outside its device work: before the work is
    // queued (the normaliser, the arguments, staging a batch without a wire) and
    // after its one wait (the state read back, the totals); the device idles through it
    double step_host_seconds;
} Trainer;

// One pass over a data set. Training: shuffled order, augmentation, one Adam
// step per batch. Returns the loss sum and normaliser sum, and the confusion
// matrix, all over the whole pass.
typedef struct {
    double loss_sum, norm_sum;
    int64_t *cm;
    double seconds_loader, seconds_steps;  // waiting for batches, and in train_step
} PassTotals;

// the plumbing (run.c): steps.csv; the update ratio ‖Δw‖/‖w‖ of a step
static int steps_log_row(Trainer *t, double lr);
static void trainable_download(Trainer *t, int after);
static double trainable_update_ratio(Trainer *t);

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
    for (int i = 0; i < g->n_layers; i++)
        any |= g->layers[i].kind == LAYER_BN && !g->layers[i].frozen;
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

// the weights of the loss normaliser's labels: the class weights, or NULL (a
// label counts 1) under --loss-norm keras
static const float *loss_norm_weights(const TrainCfg *c) {
    return c->loss_norm_keras ? NULL : c->class_weights;
}

// One micro-batch on the host: n images (n,H,W,3) fp32 0..255 and their labels;
// `first` numbers its first image among the optimiser step's images (over
// micro-batches and replicas), which is what dropout masks are drawn by;
// weight_sum, when given, is label_weight_sum of its labels with the loss's
// weights, summed by the loader's workers (NULL: train_step sums them).
// wire, when given, holds the same images ready to travel (the loader's: as
// bytes, wire_bytes, or in the net's storage type), and then it and labels
// lie in host_alloc memory that stays unchanged until the step returns: they
// are uploaded from where they are, not staged.
typedef struct MicroBatch {
    int n;
    const float *images;
    const int32_t *labels;
    int first;
    const double *weight_sum;
    const void *wire;
    int wire_bytes;
} MicroBatch;

// ----------------------------------------------------------------------------
// a batch in the trainer: the host staging of a micro-batch and its upload, the loss
// menu's terms and the metrics of the batch in the net (score_batch), an evaluation
// batch, and what the region terms exchange between replicas and micro-batches

// Trainer.stage: fp32 images before their cast, or bytes before they widen (fp32 storage);
// with uploads ahead (`ahead`), also a batch's wire (at most the storage type's bytes) and
// its `labels`, on a 16-byte boundary after it
static size_t stage_labels_offset(Shape in, DType dtype) {
    const size_t wire = dtype_size(dtype) * shape_numel(shape4(in.n, in.h, in.w, 3));
    return (wire + SN_TENSOR_ALIGN - 1) / SN_TENSOR_ALIGN * SN_TENSOR_ALIGN;
}
static size_t stage_bytes(Shape in, DType dtype, size_t labels, int ahead) {
    const size_t staged = (dtype == DT_F32 ? 1 : sizeof(float)) *
                          shape_numel(shape4(in.n, in.h, in.w, 3)),
                 uploaded = stage_labels_offset(in, dtype) + sizeof(int32_t) * labels;
    return ahead && uploaded > staged ? uploaded : staged;
}

// A micro-batch without a wire into the host staging buffers (written while
// the device is idle: after the last step's download, or a synchronize).
static void stage_batch(Trainer *t, const MicroBatch *mb) {
    // an empty shard (a last batch smaller than the replicas): its arrays are NULL
    if (mb->n == 0 || mb->wire) return;
    const Shape in = t->g.tensors[t->g.input].shape;
    memcpy(t->host_images, mb->images, sizeof(float) * (size_t)mb->n * in.h * in.w * 3);
    memcpy(t->host_labels, mb->labels, sizeof(int32_t) * (size_t)mb->n * t->per_image);
}

// Queues the micro-batch's upload into the net's input (in the storage type) and the
// labels buffer: from its wire (bytes widened on the device), else from the staging.
static void upload_batch(Trainer *t, const MicroBatch *mb) {
    if (mb->n == 0) return;
    Ops *o = t->o;
    Net *net = &t->net;
    const Shape in = t->g.tensors[t->g.input].shape, images = shape4(mb->n, in.h, in.w, 3);
    const size_t values = shape_numel(images);
    const Tensor input = tensor(net->act[t->g.input], images, net->dtype);
    if (mb->wire && mb->wire_bytes) {
        o->upload_async(o, t->stage, mb->wire, values);
        o->widen_bytes(o, input, t->stage);
    } else if (mb->wire) {
        o->upload_async(o, input.data, mb->wire, dtype_size(net->dtype) * values);
    } else if (net->dtype == DT_F32) {
        o->upload_async(o, input.data, t->host_images, sizeof(float) * values);
    } else {
        o->upload_async(o, t->stage, t->host_images, sizeof(float) * values);
        o->copy(o, input, tensor_f32(t->stage, images), 0);
    }
    o->upload_async(o, t->labels, mb->wire ? mb->labels : t->host_labels,
                    sizeof(int32_t) * (size_t)mb->n * t->per_image);
}

// ---- uploads ahead: while step j runs, the copy engine uploads batch j + 1 into
// Trainer.stage (upload_ahead, ordered after step j's use of the stage); step j + 1
// waits for it (await_uploads) and takes it into the net's input and labels from there.
// The loader's buffers it was read from stay unchanged until step j + 1 returns.

// Queues the upload of t->next (when the backend can, the batch has a wire, and there is
// nothing queued ahead already)
static void upload_next_ahead(Trainer *t) {
    Ops *o = t->o;
    const MicroBatch *next = t->next;
    t->next = NULL;
    if (!next || !next->wire || !next->n || !o->upload_ahead || t->ahead_wire) return;
    const Shape in = t->g.tensors[t->g.input].shape;
    const size_t values = (size_t)next->n * in.h * in.w * 3;
    o->upload_ahead(o, t->stage, next->wire,
                    next->wire_bytes ? values : dtype_size(t->net.dtype) * values);
    o->upload_ahead(o, (char *)t->stage + stage_labels_offset(in, t->net.dtype), next->labels,
                    sizeof(int32_t) * (size_t)next->n * t->per_image);
    t->ahead_wire = next->wire;
    t->ahead_n = next->n;
}

// What was queued ahead is done with: waited for (the stage free again, the loader's
// buffers no longer read)
static void drop_ahead(Trainer *t) {
    if (!t->ahead_wire) return;
    t->o->await_uploads(t->o);
    t->o->synchronize(t->o);
    t->ahead_wire = NULL;
}

// The step's first micro-batch into the net (queued): from the stage when it was uploaded
// ahead, else uploaded now; then the next step's batch is uploaded ahead.
static void batch_into_net(Trainer *t, const MicroBatch *mb, int k) {
    Ops *o = t->o;
    Net *net = &t->net;
    if (t->ahead_wire && k == 1 && mb[0].wire == t->ahead_wire && mb[0].n == t->ahead_n) {
        const Shape in = t->g.tensors[t->g.input].shape, images = shape4(mb[0].n, in.h, in.w, 3);
        const Tensor input = tensor(net->act[t->g.input], images, net->dtype);
        o->await_uploads(o);
        if (mb[0].wire_bytes) o->widen_bytes(o, input, t->stage);
        else o->copy_async(o, input.data, t->stage, dtype_size(net->dtype) * shape_numel(images));
        o->copy_async(o, t->labels, (const char *)t->stage + stage_labels_offset(in, net->dtype),
                      sizeof(int32_t) * (size_t)mb[0].n * t->per_image);
        t->ahead_wire = NULL;
        t->steps_ahead++;
    } else {
        if (t->ahead_wire) {  // another batch than the one uploaded ahead (not from run_pass)
            o->await_uploads(o);
            t->ahead_wire = NULL;
        }
        upload_batch(t, &mb[0]);
    }
    if (k == 1) upload_next_ahead(t);
    t->next = NULL;
}

// Region terms with replicas exchange values every batch, a collective every
// replica joins, an empty shard too: over the global batch, the sums before the
// gradient (score_batch); per image, the value after it (region_value).
static int region_exchanges(const Trainer *t) {
    return t->comm->size > 1 && loss_group_name(&t->loss);
}

// The loss and metrics of the n images in the net: the terms of the loss menu
// (their gradient into dlogits when that has data, the per-pixel ones scaled by
// state->xent_scale, the region ones by the loss scale) added into state->loss
// and state->region_loss, and the confusion matrix. Per image, a region term
// is the mean over the step's `step_images` (all micro-batches and replicas).
// Returns -1 if a collective failed.
static int score_batch(Trainer *t, Tensor dlogits, int n, int step_images) {
    Ops *o = t->o;
    const LossCfg *l = &t->loss;
    const int K = t->K, groups = l->per_image ? n : 1;
    const float *scale = dlogits.data ? &t->state->xent_scale : NULL;
    Tensor z = net_tensor(&t->net, t->logits);
    int summed = t->region_presummed;  // the region sums are in t->region_sums
    for (int j = 0; j < l->n && n > 0; j++) {
        const float *w = t->class_weights + (size_t)j * K;
        if (j == 0 && l->kind[0] != LOSS_CE && dlogits.data) o->fill(o, dlogits, 0.0f);
        if (l->kind[j] == LOSS_CE) {  // first when there (parse_loss): it overwrites dlogits
            o->softmax_xent(o, z, t->labels, w, t->c->loss_norm_keras ? KERAS_EPSILON : 0.0f, scale,
                            t->state->loss, dlogits);
        } else if (l->kind[j] == LOSS_FOCAL) {
            o->softmax_focal(o, z, t->labels, w, l->focal_gamma, KERAS_EPSILON, scale,
                             t->state->loss, dlogits);
        } else if (l->kind[j] == LOSS_LOVASZ) {
            o->lovasz(o, z, t->labels, groups,
                      l->weight[j] / (float)(l->per_image ? step_images : 1), w,
                      &t->state->loss_scale, t->lovasz_ws, &t->state->region_loss, dlogits);
        } else {
            if (!summed) o->region_sums(o, z, t->labels, groups, t->region_sums, t->region_rows);
            if (!summed && region_exchanges(t) && !l->per_image &&
                comm_allreduce_backend(t, t->region_sums, (size_t)3 * K))
                return -1;
            summed = 1;
            const RegionArgs a = region_args(l, j, l->per_image ? step_images : 1);
            // presummed: every micro-batch has the step's value; the first one reports it
            float *value = t->region_presummed == 2 ? t->region_coefs + 2 * K * groups
                                                    : &t->state->region_loss;
            o->region_grad(o, z, t->labels, groups, t->region_sums, &a, w, &t->state->loss_scale,
                           t->region_coefs, value, dlogits);
        }
    }
    if (t->region_presummed && n > 0) t->region_presummed = 2;
    // an empty shard adds zeros to the sums (unless region_presum summed them)
    if (n == 0 && region_exchanges(t) && !l->per_image && !t->region_presummed) {
        o->fill(o, tensor_f32(t->region_sums, shape4(3 * K, 1, 1, 1)), 0.0f);
        if (comm_allreduce_backend(t, t->region_sums, (size_t)3 * K)) return -1;
    }
    if (n > 0) o->confusion_accumulate(o, z, t->labels, t->confusion);
    if (n > 0 && t->c->iou_per_image)
        o->iou_per_image(o, z, t->labels, t->class_weights + (size_t)l->n * K,
                         t->confusion + (size_t)K * K);
    return 0;
}

// A step's region value *v from this replica's part (the replicas' parts summed
// when each holds its images' share); -1 if a collective failed.
static int region_value(Trainer *t, float part, double *v) {
    *v = part;
    return t->loss.per_image && t->comm->size > 1 && t->comm->allreduce_f64(t->comm, v, 1);
}

// An evaluation batch of the global batch's `images`: the forward, its loss Σ w·nll
// plus the region terms' value times the batch's Σ w here (norm), so that the pass's
// Σ over Σ norm weighs each batch's region value by its Σ w, into *loss; metrics
// into the confusion matrix. Returns -1 if a collective failed.
static int eval_batch(Trainer *t, const MicroBatch *mb, int images, double norm, double *loss) {
    Ops *o = t->o;
    Net *net = &t->net;
    stage_batch(t, mb);
    upload_batch(t, mb);
    net_forward(net, mb->n, 0);
    o->fill(o, tensor_f32(t->state->loss, shape4(4, 1, 1, 1)), 0.0f);  // loss[3], region_loss
    if (score_batch(t, tensor(NULL, net_tensor(net, t->logits).shape, net->dtype), mb->n, images))
        return -1;
    float sums[4];
    o->download(o, sums, t->state->loss, sizeof sums);
    snCheck(sums[2] == 0.0f, "labels outside 0..%d passed the data set's checks", t->K - 1);
    double region;
    if (region_value(t, sums[3], &region)) return -1;
    *loss = sums[0] + region * norm;
    return 0;
}

// A region term over the global batch of k > 1 micro-batches needs all their
// probabilities before the first backward: a forward of each (the same
// dropout masks and batch statistics, BN's running statistics left alone)
// adds its sums, the replicas add theirs, and score_batch takes them
// (region_presummed). The cost: one more forward per micro-batch. Micro-batch 0
// is staged again for the step. Returns -1 if a collective failed.
static int region_presum(Trainer *t, const MicroBatch *mb, int k) {
    const LossCfg *l = &t->loss;
    if (k == 1 || l->per_image || !t->region_sums) return 0;
    Ops *o = t->o;
    Net *net = &t->net;
    const Shape sums = shape4(3 * t->K, 1, 1, 1);
    float *part = t->region_sums + 3 * t->K;  // a micro-batch's, beside the total
    o->fill(o, tensor_f32(t->region_sums, sums), 0.0f);
    net->keep_running = 1;
    for (int i = 0; i < k; i++) {
        if (i > 0) {
            o->synchronize(o);
            stage_batch(t, &mb[i]);
        }
        upload_batch(t, &mb[i]);
        net->first_sample = (uint64_t)mb[i].first;
        net_forward(net, mb[i].n, 1);
        if (net->failed) break;
        if (!mb[i].n) continue;
        o->region_sums(o, net_tensor(net, t->logits), t->labels, 1, part, t->region_rows);
        o->axpby(o, tensor_f32(t->region_sums, sums), tensor_f32(part, sums), 1.0f, 0.0f, 1);
    }
    net->keep_running = 0;
    if (net->failed || comm_allreduce_backend(t, t->region_sums, (size_t)3 * t->K)) return -1;
    o->synchronize(o);
    stage_batch(t, &mb[0]);
    t->region_presummed = 1;
    return 0;
}

// the whole gradient buffer (the trainable parameters') as one tensor
static Tensor grads_tensor(Trainer *t) {
    return tensor_f32(t->net.grads, shape4((int)t->n_trainable, 1, 1, 1));
}

// The optimiser step's work on the device (steps 2–8 of train_step), from
// the step's arguments to Adam, all queued: no host synchronisation unless replicas exchange
// values (then returns -1 if a collective failed). Micro-batch 0 is uploaded by the caller,
// outside the record, so that a replayed step reads each batch from where the loader put it.
static int step_work(Trainer *t, const MicroBatch *mb, int k) {
    const TrainCfg *c = t->c;
    Ops *o = t->o;
    Net *net = &t->net;
    Comm *comm = t->comm;
    o->upload_async(o, t->args, t->host_args, sizeof(StepArgs));
    o->upload_async(o, net->layer_seeds, t->host_seeds, sizeof(uint64_t) * (size_t)t->g.n_layers);
    o->step_control(o, t->args, t->state, STEP_BEGIN);
    o->fill(o, grads_tensor(t), 0.0f);
    if (region_presum(t, mb, k)) return -1;
    // 2.–4. per micro-batch: forward, loss and its gradient, backward (gradients add up)
    for (int i = 0; i < k; i++) {
        if (i > 0) {  // the staging buffers hold one micro-batch
            o->synchronize(o);
            stage_batch(t, &mb[i]);
        }
        if (i > 0 || t->region_presummed) upload_batch(t, &mb[i]);  // region_presum staged 0
        net->first_sample = (uint64_t)mb[i].first;
        net_forward(net, mb[i].n, 1);
        if ((mb[i].n || region_exchanges(t)) &&
            score_batch(t, net_grad(net, t->logits), mb[i].n, t->step_images))
            return -1;
        net_backward(net, mb[i].n, t->logits);
        if (net->failed || replicas_average_bn(t, mb[i].n)) return -1;
    }
    t->region_presummed = 0;
    // 5. all-reduce: the replicas' gradients summed, the gradient of the global loss
    if (comm_allreduce_backend(t, net->grads, t->n_trainable)) return -1;
    if (c->overflow_at_step == t->step)  // tests: as if this step's fp16 gradients had overflowed
        o->fill(o, tensor_f32(net->grads, shape4(1, 1, 1, 1)), INFINITY);
    // 6. finiteness: with fp16 storage, an inf/NaN gradient skips the update (the loss scale
    // halves)
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
    // 7. clip: the global norm, the clip factor and the loss scale's next value
    // (step_control_apply)
    o->sum_squares(o, grads_tensor(t), &t->state->grad_sum_squares);
    o->step_control(o, t->args, t->state, STEP_DECIDE);
    // 8. Adam over the trainable ranges (a skipped step leaves them as they are)
    size_t packed = 0;  // offset of the range in the gradients and moments
    for (int r = 0; r < t->n_ranges; r++) {
        size_t off = t->ranges[r].offset, n = t->ranges[r].count;
        o->adam_update(o, net->params + off, net->grads + packed, t->adam_m + packed,
                       t->adam_v + packed, n, &t->state->adam);
        packed += n;
    }
    return 0;
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
    const double entered = now_seconds();
    // 1. the normaliser: Σw over the step's labels (or their count), summed over the replicas
    double local_norm = 0.0;
    for (int i = 0; i < k; i++) {
        local_norm += mb[i].weight_sum ? *mb[i].weight_sum
                                       : label_weight_sum(mb[i].labels,
                                                          (size_t)mb[i].n * t->per_image,
                                                          loss_norm_weights(c), t->K);
    }
    double global[2] = {local_norm, 0};  // Σw, images
    for (int i = 0; i < k; i++) global[1] += mb[i].n;
    if (comm->size > 1 && comm->allreduce_f64(comm, global, 2)) return -1;
    const double norm = global[0];
    t->step_images = (int)global[1];
    const int64_t step = t->step;
    // the update ratio of the epoch's last step and of each logged one (rank 0 writes both)
    const int logged = c->log_every > 0 && (step + 1) % c->log_every == 0;
    const int measure = (t->measure_update || logged) && comm->rank == 0;
    if (measure) trainable_download(t, 0);
    const double started = now_seconds();
    t->step++;
    StepArgs *a = t->host_args;
    const double lr = lr_at_step(t->plateau.lr, c->schedule, c->warmup, t->total_steps, step);
    a->adam = adam_step_init((float)lr, ADAM_BETA1, ADAM_BETA2, c->adam_eps, c->weight_decay, 1.0f,
                             step + 1);
    a->inv_norm = norm > 0 ? (float)(1.0 / norm) : 0.0f;
    a->clipnorm = c->clipnorm;
    a->loss_scaling = net->dtype == DT_F16;
    a->scale_interval = c->loss_scale_interval;
    a->loss_scale = t->loss_scale;
    a->good_steps = t->good_steps;
    net->step = (uint64_t)step;  // one seed per step; masks by image within it (first_sample)
    net_layer_seeds(net, t->host_seeds);
    // step_work uploads them
    net->seeds_of[0] = net->seed; net->seeds_of[1] = net->step; net->seeds_set = 1;
    stage_batch(t, &mb[0]);
    // the device's work from here on: the batch's upload, then the step
    const double queued = now_seconds();
    batch_into_net(t, mb, k);
    // A record replays the same shapes: one full micro-batch (a smaller last
    // one runs op by op), no replicas (their collectives run on the host),
    // nothing timed per layer; the first one runs op by op (warmed).
    const int recordable = t->records && o->capture_begin && k == 1 && mb[0].n == t->shard &&
                           comm->size == 1 && !net->layer_seconds && !c->overflow_at_step;
    if (recordable && !t->record && !t->warmed) {
        t->warmed = 1;
    } else if (recordable && !t->record && o->capture_begin(o) == 0) {
        int rc = step_work(t, mb, k);
        char err[SN_ERR_MAX];
        t->record = o->capture_end(o, err);
        snCheck(rc == 0, "a step without replicas failed a collective");
        if (!t->record) {  // nothing ran: run it eagerly, and the rest of the run too
            fprintf(stderr,
                    "segnet: recording the training step failed (%s); running steps one op at a "
                    "time\n",
                    err);
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
    const double done = now_seconds();
    const StepState s = *t->host_state;
    snCheck(s.loss[2] == 0.0f, "labels outside 0..%d passed the data set's checks", t->K - 1);
    // the region value weighted by the step's Σw (each replica's part of it)
    double region;
    if (region_value(t, s.region_loss, &region)) return -1;
    const double step_loss = s.loss[0] + region * local_norm;
    pt->loss_sum += step_loss;
    pt->norm_sum += local_norm;  // the pass adds the replicas' parts up at its end
    t->loss_scale = s.loss_scale;
    t->good_steps = s.good_steps;
    const double seconds = now_seconds() - started;
    step_stats_add(&t->epoch_stats, &s, seconds, step_loss, local_norm);
    step_stats_add(&t->log_stats, &s, seconds, step_loss, local_norm);
    if (measure) {
        const double ratio = trainable_update_ratio(t);
        if (t->measure_update) t->epoch_stats.update_ratio = ratio;
        if (logged) t->log_stats.update_ratio = ratio;
    }
    t->measure_update = 0;
    if (logged && steps_log_row(t, lr)) return -1;
    t->step_host_seconds = (queued - entered) + (now_seconds() - done);
    return s.applied;
}

// ============================================================================
// THE REST OF THE PROGRAM
// In files of their own, compiled with this one (one translation unit: they
// call the parts above directly, and the tests see all of it): the CPU
// backend's fast ops, beside kernels.cu (the GPU's); then the plumbing: files,
// data, replicas, the training run around the step, benchmark and the command
// line, what a reader of the math can skip, in files named for what they hold.
// ============================================================================

#include "kernels_cpu.c"           // the CPU backend: the fast ops, ops_cpu
#include "plumbing/backends.c"     // choosing a backend: --device, ops_missing
#include "plumbing/safetensors.c"  // safetensors files: reader and writer
#include "plumbing/weights.c"      // weights by name, into and out of a Net
#include "plumbing/images.c"       // images, EXIF, masks; prediction
#include "plumbing/datasets.c"     // data sets: decoding, augmentation, batching, prefetch
#include "plumbing/curves.c"       // curves.svg
#include "plumbing/replicas.c"     // replicas' communicators (threads, MPI)
#include "plumbing/run.c"          // the training run: passes, checkpoints, metrics.csv, resume
#include "plumbing/bench.c"        // segnet bench
#include "plumbing/cli.c"          // the command line and main
