// test_segnet.c -- every test of segnet: the framework, the ops' tests, the tests/ files it
// includes, the runner. Build: make test_segnet; run: ./test_segnet [--filter SUBSTR]
// The last line is "N passed, M failed, K skipped"; the exit status is non-zero if anything failed.
// Built with -DSEGNET_FUZZ it is fuzz_segnet instead: fuzz.c in place of the runner.
#ifndef SEGNET_FUZZ
#define TESTING
#include "segnet.c"
#else
#define main segnet_main  // fuzz_segnet calls segnet's command line too (its target cli)
#include "segnet.c"
#undef main
#endif
#include <time.h>
#include <sys/file.h>
#include <ctype.h>
#include <float.h>
#include <signal.h>
#include <sys/wait.h>
#include <malloc.h>
#include <sys/mman.h>
#include <setjmp.h>
#include <stb_image_write.h>  // Debian libstb-dev (implementation in libstb.so): test images

// the CUDA backend under the emulator (cuda_emu.cpp), not on a GPU (test_segnet_gpu)
#if defined(SEGNET_CUDA) && !defined(SEGNET_TEST_GPU)
#define EMULATED_CUDA 1
// threads and blocks of the following launches in reverse order
void cuemu_set_reverse(int reverse);
// blocks and threads of the following launches in a random order from seed (on = 1)
void cuemu_set_random(int on, unsigned long long seed);
// launches, cuBLAS calls, host waits, bytes copied, hazards found since the start
long long cuemu_count(const char *name);
// device allocations packed back to back between canaries (1), or each before a guard page
void cuemu_set_arena(int on);
// a·b + c as kernels.cu's build compiles it: one FMA in the strict build (kernels_strict.o)
float cuemu_kernels_mul_add(float a, float b, float c);
#else
#define EMULATED_CUDA 0
#endif

// ----------------------------------------------------------------------------
// a tiny test framework

static int g_failures;      // failed checks in the current test
static int g_verbose = 0;
static int g_quiet = 0;     // while a test checks that the checker fails

#define CHECK(cond, ...) do { \
    if (!(cond)) { \
        g_failures++; \
        if (!g_quiet) { \
            printf("    FAIL %s:%d: ", __FILE__, __LINE__); printf(__VA_ARGS__); printf("\n"); \
        } \
    } \
} while (0)
#define CHECK_NEAR(a, b, tol, what) do { \
    double a_ = (a), b_ = (b); \
    CHECK(fabs(a_ - b_) <= (tol), "%s: got %.9g, expected %.9g (tolerance %g)", what, a_, b_, \
          (double)(tol)); \
} while (0)

// TEST(name) { ... } defines the test `name` and registers it before main runs
// (a constructor); the runner takes the tests in the order they are written, in this file
// and the tests/ files it includes (__COUNTER__ counts on across them).
// SLOW_TEST(name): one that make test leaves to make check (what .ci/run runs).
typedef struct { const char *name; void (*fn)(void); int order, slow; } Test;
#define MAX_TESTS 512
static Test g_tests[MAX_TESTS];
static int g_n_tests;
static void test_register(const char *name, void (*fn)(void), int order, int slow) {
    if (g_n_tests == MAX_TESTS) {
        fprintf(stderr, "test_segnet: more than %d tests: raise MAX_TESTS\n", MAX_TESTS);
        exit(2);
    }
    g_tests[g_n_tests++] = (Test){name, fn, order, slow};
}
#define TEST_REGISTERED(name, slow)                                                 \
    static void test_##name(void);                                                  \
    __attribute__((constructor)) static void register_##name(void) {                \
        test_register(#name, test_##name, __COUNTER__, slow);                       \
    }                                                                               \
    static void test_##name(void)
#define TEST(name) TEST_REGISTERED(name, 0)
#define SLOW_TEST(name) TEST_REGISTERED(name, 1)

// A test that cannot run here says why and returns: it is counted as skipped
// (not passed) and listed with its reason at the end. One reason per missing
// thing, so that the list groups them.
#define SKIP_NO_MPI   "no MPI (./segnet built without it, or no mpirun: " \
                      "apt-get install openmpi-bin libopenmpi-dev, then make)"
#define SKIP_NO_TORCH "no PyTorch (/usr/bin/python3 cannot import torch and torchvision: " \
                      "apt-get install python3-torch python3-torchvision)"
#define SKIP_NO_NVCC  "no nvcc (the emulated CUDA backend is not built: " \
                      "install the CUDA toolkit, then make)"
#define SKIP_SLOW     "slow (make check runs them too, as .ci/run does)"
#define SKIP_HEAVY    "heavy (make test-heavy: minutes each, packages from PyPI)"
static const char *g_skip;  // the current test's reason to skip, or NULL
#define SKIP(reason) do { g_skip = (reason); return; } while (0)

static double now_s(void) {
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + 1e-9 * ts.tv_nsec;
}

static const Tensor NO_RESIDUAL = {NULL, {0, 0, 0, 0}, DT_F32};  // dropout without a residual
static float *randn(Rng *r, size_t n, float scale) {
    float *p = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) p[i] = scale * rng_normal(r);
    return p;
}

static int contains(const char *s, const char *sub) { return strstr(s, sub) != NULL; }

#define DT_NAME DTYPE_NAMES  // storage types as --precision spells them, indexed by DType

// max |a - b| / max(max |b|, floor)
static double rel_diff(const float *a, const float *b, size_t n, double floor) {
    double d = 0.0, m = floor;
    for (size_t i = 0; i < n; i++) {
        double e = fabs((double)a[i] - b[i]);
        if (!(e <= d)) d = e;  // NaN wins
        if (fabs(b[i]) > m) m = fabs(b[i]);
    }
    return d / m;
}

// ----------------------------------------------------------------------------
// finite-difference gradient check of a whole graph
//
// L(x, θ) = Σ_i r_i·y_i for a fixed random r, accumulated in fp64. The analytic
// gradient comes from net_backward with dL/dy = r; the numerical one from
// central differences (L(v+h) - L(v-h))/2h, one forward per evaluation.
//
// Before backward, every activation gradient is filled with NaN (an op that
// adds where it must overwrite poisons the result) and the parameter
// gradients with random values P (they must be added to: analytic = grad - P).
// Graphs in which the input feeds several layers exercise the accumulate mode.
//
// The reported error of a tensor is max_i |analytic_i - fd_i| / max_i |fd_i|
// (with max_i |fd_i| raised to grad_floor × the check's largest |fd| where a floor is given).

typedef struct {
    float h;            // finite-difference step
    float tol;          // largest accepted error
    int training;       // forward in training mode
    int max_samples;    // elements checked per tensor (a deterministic sample)
    uint64_t seed;
    float input_scale;  // input ~ N(0, input_scale²) unless `input` is given
    const float *input; // optional fixed input values
    int skip_input;     // do not check (or require) the input gradient
    // the error's denominator is at least this fraction of the largest numerical gradient of the
    // whole check (for tensors whose exact gradient is ~0)
    float grad_floor;
} GradOpts;

static GradOpts grad_opts(void) {
    GradOpts o = {1e-2f, 5e-3f, 1, 4096, 1234, 1.0f, NULL, 0, 0.0f};
    return o;
}

static double eval_loss(Net *net, int out, const float *r) {
  net_forward(net, net_capacity(net), net->training);
  const float *y = net->act[out];
  double L = 0.0;
  for (size_t i = 0; i < shape_numel(net->g->tensors[out].shape); i++)
    L += (double)r[i] * y[i];
  return L;
}

// eval_loss re-running the layers from `from` on (from the layer a fused one runs with), as
// net_forward does after a forward of the same batch: the layers before it read nothing that
// changed, so their outputs stand (each tensor's own buffer: no memory plan). graph_gradcheck
// checks that this gives the full forward's loss to the bit.
static double eval_loss_from(Net *net, int out, const float *r, int from) {
    if (net->plan || net->params_cast || from <= 0) return eval_loss(net, out, r);
    while (from > 0 && net->fusion[from]) from--;
    const int L = net->g->n_layers;
    if (net->training) net_seeds_current(net);
    for (int i = from; i < L; i++)
        if (!net->fusion[i]) layer_forward(net, i, 0, i + 1 < L && net->fusion[i + 1]);
    const float *y = net->act[out];
    double loss = 0.0;
    for (size_t i = 0; i < shape_numel(net->g->tensors[out].shape); i++)
        loss += (double)r[i] * y[i];
    return loss;
}

// Random parameters with O(1) activations: weights ~ N(0, 1/fan_in), BN gamma
// near 1, beta and running statistics near 0 / 1.
static void random_params(Net *net, Rng *rng) {
    const Graph *g = net->g;
    for (int i = 0; i < g->n_params; i++) {
        const ParamInfo *p = &g->params[i];
        int is_bn = 0;
        for (int l = 0; l < g->n_layers; l++)
            if (g->layers[l].kind == LAYER_BN &&
                (g->layers[l].weight == i || g->layers[l].bias == i))
                is_bn = 1;
        size_t fan_in = p->ndim > 1 ? p->count / (size_t)p->dims[0] : 1;
        for (size_t k = 0; k < p->count; k++) {
            float v = rng_normal(rng);
            if (is_bn) v = contains(p->name, ".weight") ? 1.0f + 0.2f * v : 0.2f * v;
            else if (p->ndim > 1) v /= sqrtf((float)fan_in);
            else v *= 0.3f;
            net->params[p->offset + k] = v;
        }
    }
    for (int b = 0; b < g->n_buffers; b++) {
        const ParamInfo *p = &g->buffers[b];
        for (size_t k = 0; k < p->count; k++)
            net->buffers[p->offset + k] = contains(p->name, "running_var") ? 0.5f + rng_float(rng)
                                                                           : 0.3f * rng_normal(rng);
    }
}

typedef struct { double err; int checked; } GradResult;

static void compare_grad(const char *what, const float *analytic, const float *fd,
                         const size_t *idx, int n, double *worst, double tol, double floor) {
    double maxfd = 0.0, maxdiff = 0.0;
    int arg = 0;
    for (int k = 0; k < n; k++) {
        if (fabs(fd[k]) > maxfd) maxfd = fabs(fd[k]);
        double d = fabs((double)analytic[k] - fd[k]);
        if (!(d <= maxdiff)) { maxdiff = d; arg = k; }  // also catches NaN
    }
    double err = maxdiff / fmax(fmax(maxfd, floor), 1e-12);
    if (isnan(maxdiff)) err = INFINITY;
    if (g_verbose)
        printf("      %-28s err %.2e (max |g| %.3g, %d elements)\n", what, err, maxfd, n);
    CHECK(err <= tol,
          "%s: gradient error %.3e > %.1e at element %zu (analytic %.6g, numerical %.6g)", what,
          err, tol, idx[arg], analytic[arg], fd[arg]);
    if (err > *worst) *worst = err;
}

// Checks the input gradient and every trainable parameter's gradient.
// Returns the worst error (and counts failures through CHECK).
static double graph_gradcheck(Graph *g, int out, GradOpts opt, Ops *ops) {
    Net net;
    char err[SN_ERR_MAX];
    CHECK(g->err[0] == 0, "graph: %s", g->err);
    if (net_create(&net, g, ops, DT_F32, !opt.skip_input, err) != 0) {
        CHECK(0, "net_create: %s", err);
        return INFINITY;
    }
    Rng rng;
    rng_seed(&rng, opt.seed);
    random_params(&net, &rng);
    net.training = opt.training;
    net.seed = opt.seed; net.step = 3;
    const int in = g->input;
    size_t nx = shape_numel(g->tensors[in].shape), ny = shape_numel(g->tensors[out].shape);
    float *x = net.act[in];
    for (size_t i = 0; i < nx; i++)
        x[i] = opt.input ? opt.input[i] : opt.input_scale * rng_normal(&rng);
    float *r = randn(&rng, ny, 1.0f);

    // analytic
    net_forward(&net, net_capacity(&net), opt.training);
    for (int t = 0; t < g->n_tensors; t++)
        if (net.grad[t])
            for (size_t i = 0; i < shape_numel(g->tensors[t].shape); i++)
                ((float *)net.grad[t])[i] = NAN;
    memcpy(net.grad[out], r, sizeof(float) * ny);
    float *prefill = randn(&rng, net.n_grad_floats, 1.0f);
    memcpy(net.grads, prefill, sizeof(float) * net.n_grad_floats);
    net_backward(&net, net_capacity(&net), out);
    const double loss0 = eval_loss(&net, out, r);  // every activation at the unperturbed values

    // analytic and numerical values of every checked tensor first, compared after
    // (the gradient floor is relative to the largest numerical gradient of all)
    int ns = opt.max_samples, n_checked = 0, max_checked = g->n_params + 1;
    size_t *idx_all = malloc(sizeof(size_t) * ns * max_checked);
    float *an_all = malloc(sizeof(float) * ns * max_checked),
          *fd_all = malloc(sizeof(float) * ns * max_checked);
    int *n_all = malloc(sizeof(int) * max_checked);
    const char **names = malloc(sizeof(char *) * max_checked);
    size_t *idx; float *an, *fd;
    #define NEXT(what) do { \
        idx = idx_all + (size_t)n_checked * ns; an = an_all + (size_t)n_checked * ns; \
        fd = fd_all + (size_t)n_checked * ns; names[n_checked] = (what); \
    } while (0)
    #define DONE() (n_all[n_checked++] = n)

    // numerical gradient of L w.r.t. v[idx[k]], for a sample of v's elements, re-running the
    // layers from `from` on; then the activations back at the unperturbed values, whose loss
    // is the full forward's
    #define SAMPLE(count) do { \
        n = (count) <= (size_t)ns ? (int)(count) : ns; \
        for (int k = 0; k < n; k++) \
            idx[k] = (count) <= (size_t)ns ? (size_t)k : (size_t)(rng_next(&rng) % (count)); \
    } while (0)
    #define FD(v, from) do { \
        for (int k = 0; k < n; k++) { \
            float keep = (v)[idx[k]]; \
            (v)[idx[k]] = keep + opt.h; double lp = eval_loss_from(&net, out, r, from); \
            (v)[idx[k]] = keep - opt.h; double lm = eval_loss_from(&net, out, r, from); \
            (v)[idx[k]] = keep; \
            fd[k] = (float)((lp - lm) / (2.0 * opt.h)); \
        } \
        const double back = eval_loss_from(&net, out, r, from); \
        CHECK(back == loss0, "%s: the loss re-run from layer %d is %.17g, the full forward's " \
              "%.17g", names[n_checked], from, back, loss0); \
    } while (0)

    int n;
    if (!opt.skip_input) {
        const float *dx = net.grad[in];
        NEXT("input");
        SAMPLE(nx);
        for (int k = 0; k < n; k++) an[k] = dx[idx[k]];
        FD(x, 0);
        DONE();
    }
    for (int l = 0; l < g->n_layers; l++) {
        const Layer *L = &g->layers[l];
        int ids[2] = {L->weight, L->bias};
        for (int j = 0; j < 2; j++) {
            if (ids[j] < 0) continue;
            const ParamInfo *p = &g->params[ids[j]];
            float *v = net.params + p->offset;
            if (L->frozen) {  // a frozen layer holds no gradient
                CHECK(net.grad_offset[ids[j]] == SIZE_MAX,
                      "%s: frozen parameter has gradient storage", p->name);
                continue;
            }
            const float *gr = net.grads + net.grad_offset[ids[j]],
                        *pre = prefill + net.grad_offset[ids[j]];
            NEXT(p->name);
            SAMPLE(p->count);
            for (int k = 0; k < n; k++) an[k] = gr[idx[k]] - pre[idx[k]];
            FD(v, l);
            DONE();
        }
    }
    double scale = 0.0, worst = 0.0;
    for (size_t k = 0; k < (size_t)ns * n_checked; k++)
        if (k % ns < (size_t)n_all[k / ns]) scale = fmax(scale, fabs(fd_all[k]));
    for (int t = 0; t < n_checked; t++)
        compare_grad(names[t], an_all + (size_t)t * ns, fd_all + (size_t)t * ns,
                     idx_all + (size_t)t * ns, n_all[t], &worst, opt.tol, opt.grad_floor * scale);
    free(idx_all); free(an_all); free(fd_all); free(n_all); free(names);
    #undef NEXT
    #undef DONE
    #undef SAMPLE
    #undef FD
    free(r); free(prefill);
    net_free(&net);
    return worst;
}

// The gradient checks of each op (in its group below) go through one- or few-layer graphs.
// Each "fan-out" graph feeds the input to two layers of the op under test and
// concatenates them: in backward the second layer overwrites the input
// gradient (accumulate = 0) and the first adds into it (accumulate = 1).
static double g_worst[LAYER_KIND_COUNT];  // worst gradient error per layer kind, for the summary
static double g_worst_xent;               // and of the loss

static void note_worst(LayerKind k, double e) { if (e > g_worst[k]) g_worst[k] = e; }

// ----------------------------------------------------------------------------
// the CUDA backend (kernels.cu), run on the CPU by the emulator (cuda_emu.h),
// op by op against the CPU ops: the CPU table is the specification.
// `make test` runs these tests a second time with the threads of every block in
// reverse order (CUEMU_ORDER=reverse), which breaks kernels missing a barrier.
// Each op's cuda_ tests are in its group below, the whole-step ones with the
// backends; all are built where nvcc is (SEGNET_CUDA). Here the helpers they share.

#ifdef SEGNET_CUDA
#include <cublas_v2.h>  // cuda_gemm_ex_types calls the library (the emulator's here) directly

static Ops *cu_ops(void) {
    static int opened = 0;
    if (!opened) {
        char err[SN_ERR_MAX];
        snCheck(cuda_backend_open(0, err) == 0, "cuda_backend_open: %s", err);
        opened = 1;
    }
    return &ops_cuda;
}

// One tensor on both backends: `cpu` in host memory for ops_cpu, `gpu` the
// same bytes in device memory for ops_cuda. Values are rounded to dt first.
typedef struct { Tensor cpu, gpu; } CuPair;

static CuPair cu_pair(const float *values, Shape s, DType dt) {
    CuPair p;
    size_t n = shape_numel(s);
    p.cpu = tensor(malloc(n * dtype_size(dt) + 1), s, dt);
    for (size_t i = 0; i < n; i++) st(p.cpu, i, values ? values[i] : NAN);
    p.gpu = tensor(cu_ops()->alloc(cu_ops(), n * dtype_size(dt)), s, dt);
    cu_ops()->upload(cu_ops(), p.gpu.data, p.cpu.data, n * dtype_size(dt));
    return p;
}
static void cu_pair_free(CuPair *p) {
    free(p->cpu.data);
    cu_ops()->free(cu_ops(), p->gpu.data);
}
// fp32 buffers (parameters, statistics): a device copy of n host floats
static void *cu_copy_of(const void *host, size_t bytes) {
    void *d = cu_ops()->alloc(cu_ops(), bytes);
    cu_ops()->upload(cu_ops(), d, host, bytes);
    return d;
}
static float *cu_floats(const float *host, size_t n) { return cu_copy_of(host, n * sizeof(float)); }
static float *cu_to_host(const void *dev, size_t n, DType dt) {
    Tensor t = tensor(malloc(n * dtype_size(dt) + 1), shape4(1, 1, 1, (int)n), dt);
    cu_ops()->download(cu_ops(), t.data, dev, n * dtype_size(dt));
    float *f = malloc(n * sizeof(float) + 1);
    for (size_t i = 0; i < n; i++) f[i] = ld(t, i);
    free(t.data);
    return f;
}
// max |gpu - cpu| / max(max |cpu|, floor): the error measure of every cuda_ test
static double cu_rel_err(const float *gpu, const float *cpu, size_t n, double floor) {
    double worst = 0.0, scale = floor;
    for (size_t i = 0; i < n; i++) scale = fmax(scale, fabs(cpu[i]));
    for (size_t i = 0; i < n; i++) {
        double d = fabs((double)gpu[i] - cpu[i]);
        if (isnan(gpu[i]) != isnan(cpu[i])) d = INFINITY;
        worst = fmax(worst, d);
    }
    return worst / scale;
}
static double cu_pair_err(CuPair p) {
    size_t n = shape_numel(p.cpu.shape);
    float *g = cu_to_host(p.gpu.data, n, p.gpu.dtype), *c = malloc(n * sizeof(float) + 1);
    for (size_t i = 0; i < n; i++) c[i] = ld(p.cpu, i);
    double e = cu_rel_err(g, c, n, 1e-30);
    free(g); free(c);
    return e;
}

// One unit in the last place of each storage type, relative to the value (2^-23,
// 2^-10, 2^-7): a result that differs by one rounding of fp32 arithmetic may
// round to the neighbouring storage value, which is this far from the CPU's.
static const double CU_ULP[] = {0x1p-23, 0x1p-10, 0x1p-7};

static void cu_check_err(const char *op, DType dt, double err, double tol) {
    if (g_verbose)
        printf("      %-28s %s error %.3g (tolerance %.3g)\n", op, DT_NAME[dt], err, tol);
    CHECK(err <= tol, "%s %s: error %.3g > %.3g", op, DT_NAME[dt], err, tol);
}
// an fp32 device buffer of n floats equal to the host's, bit for bit
static int cu_floats_equal(const float *dev, const float *host, size_t n) {
    float *g = cu_to_host(dev, n, DT_F32);
    int same = !memcmp(g, host, n * sizeof(float));
    free(g);
    return same;
}

// The cuda_ tests of batch norm, activations, squeeze-excitation, add/concat, dropout, pooling
// and resampling. Destinations are pre-filled on both backends with NaN where the
// op overwrites (an op that reads them fails) and with the same random values
// where it adds into. Tolerances are relative to the largest |CPU value|:
//   - ops that only move values, or add one pair (concat, add, upsample, maxpool,
//     dropout's mask and scaling, x·s): 0 in fp32, the same bits; with
//     `accumulate` a multiply-add may fuse into an FMA on one backend and not the
//     other (CU_FMA: one fp32 rounding);
//   - fp32 arithmetic (z of batch norm, exp in SiLU/sigmoid: CUDA's expf is
//     within 2 ulp, glibc's correctly rounded; FMA contraction differs between
//     compilers): a few fp32 roundings, stated per op;
//   - fp16/bf16 outputs: in addition one rounding of the result to the storage
//     type, where the fp32 values differ in their last bits across a rounding
//     boundary (CU_ULP16: one ulp relative to the value, 2^-10 fp16, 2^-7 bf16).
// Per-channel sums are fp64 on both backends (another order): a few fp32 roundings.

#define CU_FMA 0x1p-23
static double cu_ulp16(DType dt) { return dt == DT_F16 ? 0x1p-10 : dt == DT_BF16 ? 0x1p-7 : 0.0; }
static double cu_tol(DType dt, double fp32_tol) { return fp32_tol + cu_ulp16(dt); }

// err ≤ tol, printed with -v (the worst errors of the closing note)
static void cu_expect(double err, double tol, const char *what, DType dt) {
    if (g_verbose) printf("    %-40s %s err %.3g (tol %.3g)\n", what, DT_NAME[dt], err, tol);
    CHECK(err <= tol, "%s %s: error %.3g > tolerance %.3g", what, DT_NAME[dt], err, tol);
}
// a destination: the same random values on both backends (accumulate), else NaN
static CuPair cu_dest(Rng *r, Shape s, DType dt, int accumulate) {
    float *v = accumulate ? randn(r, shape_numel(s), 1.0f) : NULL;
    CuPair p = cu_pair(v, s, dt);
    free(v);
    return p;
}
// an fp32 device buffer against its CPU counterpart
static double cu_floats_err(const float *dev, const float *host, size_t n) {
    float *g = cu_to_host(dev, n, DT_F32);
    double e = cu_rel_err(g, host, n, 1e-30);
    free(g);
    return e;
}
static float *cu_nans(size_t n) {
    float *v = malloc(n * sizeof(float));
    for (size_t i = 0; i < n; i++) v[i] = NAN;
    return v;
}
static const char *const ACT_NAME[] = {"none", "relu", "silu", "sigmoid"};

// small odd shapes; C = 37 spans two channel tiles of the reduction kernels; rows
// from 15 (one chunk) to 2046 (64 chunks, the last partial; 1023 per image in squeeze-excitation)
// odd channel counts (the generic kernels), then multiples of the 16-byte
// vectors' 4 fp32 or 8 fp16/bf16 values (the vector kernels; 12: fp32 only)
static const Shape CU_SHAPES[] = {{1, 5, 3, 5},  {2, 5, 7, 3},   {2, 9, 7, 13},
                                  {2, 5, 5, 37}, {2, 33, 31, 3}, {2, 5, 7, 16},
                                  {1, 9, 5, 40}, {2, 5, 3, 12},  {2, 17, 19, 8}};
#define CU_NSHAPES (int)(sizeof CU_SHAPES / sizeof CU_SHAPES[0])
#endif

// ============================================================================
// THE OPS, in the order of segnet.c's part I (its math index names each op's tests).
// Per op: its gradient checks, its hand-computed cases, its fast fp32 CPU paths
// against the reference ops (issue 8: random shapes with odd channel counts
// (partial vector and channel blocks), every activation, strides 1 and 2, both
// padding modes, accumulate on and off), then its cuda_ tests.
// ============================================================================

// ----------------------------------------------------------------------------
// memory and utilities

static uint16_t f16_bits_of(float f) { return f32_to_f16(f); }

TEST(fp16_by_hand) {
    CHECK(f16_bits_of(1.0f) == 0x3C00, "1.0");
    CHECK(f16_bits_of(-2.0f) == 0xC000, "-2.0");
    CHECK(f16_bits_of(65504.0f) == 0x7BFF, "largest half");
    CHECK(f16_bits_of(65520.0f) == 0x7C00,
          "65520 is a tie: rounds to even, which overflows to inf");
    CHECK(f16_bits_of(1.0f + ldexpf(1, -11)) == 0x3C00, "tie 1 + 2^-11 rounds to even (down)");
    CHECK(f16_bits_of(1.0f + 3 * ldexpf(1, -11)) == 0x3C02, "tie 1 + 3·2^-11 rounds to even (up)");
    CHECK(f16_bits_of(ldexpf(1, -24)) == 0x0001, "smallest subnormal");
    CHECK(f16_bits_of(ldexpf(1, -25)) == 0x0000, "half the smallest subnormal: tie to even (zero)");
    CHECK(f16_bits_of(3 * ldexpf(1, -26)) == 0x0001, "0.75 of the smallest subnormal rounds up");
    CHECK(f16_bits_of(ldexpf(1, -14) - ldexpf(1, -25)) == 0x0400,
          "rounds up into the smallest normal");
    CHECK(f16_bits_of(INFINITY) == 0x7C00 && f16_bits_of(-INFINITY) == 0xFC00, "inf");
    uint16_t nan = f16_bits_of(NAN);
    CHECK((nan & 0x7C00) == 0x7C00 && (nan & 0x3FF), "NaN stays NaN");
    int roundtrip = 1;
    for (uint32_t b = 0; b < 65536; b++) {
        if ((b & 0x7C00) == 0x7C00 && (b & 0x3FF)) continue;  // NaNs
        roundtrip &= f32_to_f16(f16_to_f32((uint16_t)b)) == b;
    }
    CHECK(roundtrip, "every half value survives half -> float -> half");
}

// against the compiler's own conversion (hardware round-to-nearest-even)
TEST(fp16_vs_compiler) {
#if defined(__FLT16_MAX__)
    Rng r; rng_seed(&r, 5);
    int bad = 0;
    for (int i = 0; i < 200000; i++) {
        // random bit patterns over the whole float range, plus values near the half range
        float f = i % 2 ? bits_f32((uint32_t)rng_next(&r))
                        : ldexpf(rng_normal(&r), (int)(rng_next(&r) % 40) - 28);
        if (isnan(f)) continue;
        _Float16 h = (_Float16)f;
        uint16_t want;
        memcpy(&want, &h, 2);
        if (f32_to_f16(f) != want) {
            if (bad < 3) printf("    %a: got %04x, compiler %04x\n", f, f32_to_f16(f), want);
            bad++;
        }
        if ((float)h != f16_to_f32(want)) bad++;
    }
    CHECK(bad == 0, "%d conversions differ from the compiler's _Float16", bad);
#else
    CHECK(0, "this compiler has no _Float16 to compare against");
#endif
}

TEST(bf16_by_hand) {
    CHECK(f32_to_bf16(1.0f) == 0x3F80, "1.0");
    CHECK(f32_to_bf16(1.0f + ldexpf(1, -8)) == 0x3F80, "tie rounds to even (down)");
    CHECK(f32_to_bf16(1.0f + 3 * ldexpf(1, -8)) == 0x3F82, "tie rounds to even (up)");
    CHECK(f32_to_bf16(1.0f + ldexpf(1, -8) + ldexpf(1, -20)) == 0x3F81, "above the tie rounds up");
    CHECK(f32_to_bf16(bits_f32(0x7F7F0000u)) == 0x7F7F, "the largest bf16 is exact");
    CHECK(f32_to_bf16(bits_f32(0x7F7FFFFFu)) == 0x7F80,
          "the largest float is past the last tie: inf");
    uint16_t nan = f32_to_bf16(NAN);
    CHECK((nan & 0x7F80) == 0x7F80 && (nan & 0x7F), "NaN stays NaN");
    CHECK(bf16_to_f32(0xC0A0) == -5.0f, "0xC0A0 = -5");
    int roundtrip = 1;
    for (uint32_t b = 0; b < 65536; b++) {
        if ((b & 0x7F80) == 0x7F80 && (b & 0x7F)) continue;
        roundtrip &= f32_to_bf16(bf16_to_f32((uint16_t)b)) == b;
    }
    CHECK(roundtrip, "every bf16 value survives bf16 -> float -> bf16");
}

// FastDiv (segnet.h), the CUDA kernels' division by a launch constant: the
// quotient of every n < 2^31 equals n / d. Checked for every d up to 4096
// against n around each multiple of d and at the ends, and for random d up to
// 2^31 - 1 and random n (the bound's derivation is above fastdiv_make).
TEST(fastdiv) {
    Rng r;
    rng_seed(&r, 91);
    long bad = 0, checked = 0;
    for (uint32_t d = 1; d <= 4096; d++) {
        const FastDiv f = fastdiv_make(d);
        const uint32_t ns[] = {0,
                               1,
                               d - 1,
                               d,
                               d + 1,
                               7 * d - 1,
                               7 * d,
                               (1u << 31) - 1,
                               (1u << 31) - 2,
                               (1u << 31) - 1 - ((1u << 31) - 1) % d};
        for (int k = 0; k < (int)(sizeof ns / sizeof ns[0]); k++, checked++)
            bad += fastdiv(f, ns[k]) != ns[k] / d;
        for (int k = 0; k < 64; k++, checked++) {
            const uint32_t n = (uint32_t)(rng_next(&r) >> 33);
            bad += fastdiv(f, n) != n / d;
        }
    }
    for (int k = 0; k < 200000; k++, checked++) {
        const uint32_t d = (uint32_t)(rng_next(&r) >> 33) | 1u, n = (uint32_t)(rng_next(&r) >> 33);
        bad += fastdiv(fastdiv_make(d), n) != n / d;
    }
    CHECK(bad == 0, "fastdiv: %ld of %ld quotients wrong", bad, checked);
}

TEST(utilities) {
    float a[5] = {1, 2, 3, -4, 0.5f}, ss;
    Shape s5 = shape4(5, 1, 1, 1);
    ops_cpu.sum_squares(&ops_cpu, tensor_f32(a, s5), &ss);
    CHECK(ss == 1 + 4 + 9 + 16 + 0.25f, "sum of squares %g", ss);
    size_t n = 300001;  // several chunks and a ragged end
    float *big = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) big[i] = 0.5f;
    ops_cpu.sum_squares(&ops_cpu, tensor_f32(big, shape4((int)n, 1, 1, 1)), &ss);
    CHECK(ss == 0.25f * n, "sum of squares of %zu halves: %.1f", n, ss);
    {
        // the fast version, SUM_LANES chunks side by side, against the reference's chunk
        // after chunk: the same fp64 sums, so the same bits; a chunk missed, counted twice
        // or in another's place changes them (2 full sets of lanes and a ragged one; fewer
        // chunks than lanes)
        Rng rng; rng_seed(&rng, 5);
        const size_t sizes[] = {2 * SUM_LANES * SUM_CHUNK + 3 * SUM_CHUNK + 12345, 70000};
        for (int k = 0; k < 2; k++) {
            float *g = randn(&rng, sizes[k], 1.0f), fast, ref;
            Tensor gt = tensor_f32(g, shape4((int)sizes[k], 1, 1, 1));
            ops_cpu.sum_squares(&ops_cpu, gt, &fast);
            sum_squares_ref(&ops_cpu, gt, &ref);
            CHECK(f32_bits(fast) == f32_bits(ref),
                  "sum of squares of %zu values: %.9g, reference %.9g", sizes[k], fast, ref);
            free(g);
        }
    }
    int32_t flag = 0;
    ops_cpu.nonfinite(&ops_cpu, tensor_f32(big, shape4((int)n, 1, 1, 1)), &flag);
    CHECK(flag == 0, "finite buffer");
    big[123456] = INFINITY;
    ops_cpu.nonfinite(&ops_cpu, tensor_f32(big, shape4((int)n, 1, 1, 1)), &flag);
    CHECK(flag == 1, "inf found");
    big[123456] = NAN; flag = 0;
    ops_cpu.nonfinite(&ops_cpu, tensor_f32(big, shape4((int)n, 1, 1, 1)), &flag);
    CHECK(flag == 1, "NaN found");
    flag = 1;
    ops_cpu.nonfinite(&ops_cpu, tensor_f32(a, s5), &flag);
    CHECK(flag == 1, "a set flag is never cleared");
    uint16_t h[5];
    Tensor th = tensor(h, s5, DT_F16);
    ops_cpu.copy(&ops_cpu, th, tensor_f32(a, s5), 0);
    CHECK(h[0] == 0x3C00 && h[3] == 0xC400, "cast fp32 -> fp16");
    ops_cpu.scale(&ops_cpu, th, 2.0f);
    ops_cpu.copy(&ops_cpu, tensor_f32(a, s5), th, 1);
    CHECK(a[0] == 3 && a[1] == 6 && a[3] == -12, "fp16 -> fp32 accumulate after scale: [%g %g %g]",
          a[0], a[1], a[3]);
    uint16_t bf[5];
    Tensor tb = tensor(bf, s5, DT_BF16);
    ops_cpu.copy(&ops_cpu, tb, th, 0);
    CHECK(bf16_to_f32(bf[4]) == 1.0f, "cast fp16 -> bf16");
    ops_cpu.fill(&ops_cpu, tb, -3.0f);
    CHECK(bf[0] == f32_to_bf16(-3.0f) && bf[4] == bf[0], "fill");
    free(big);
}

// Storage types: an op on fp16/bf16 tensors equals the fp32 op on the same
// (rounded) values, rounded once at the end (to one unit in the last place).
static double max_ulp_diff(Tensor t, const float *ref) {
    double worst = 0;
    for (size_t i = 0; i < shape_numel(t.shape); i++) {
        float got = ld(t, i), want = dtype_round(t.dtype, ref[i]);
        float ulp = dtype_round(t.dtype,
                                fabsf(want) * (t.dtype == DT_F16 ? 1.0009765625f : 1.0078125f)) -
                    fabsf(want);
        if (ulp <= 0) ulp = 1e-7f;
        double d = fabs(got - want) / ulp;
        if (d > worst) worst = d;
    }
    return worst;
}

TEST(storage_types) {
    DType dts[2] = {DT_F16, DT_BF16};
    Rng r; rng_seed(&r, 77);
    for (int k = 0; k < 2; k++) {
        DType dt = dts[k];
        const char *dn = dt == DT_F16 ? "fp16" : "bf16";
        Shape in = shape4(2, 5, 6, 4);
        size_t nx = shape_numel(in);
        float *x = randn(&r, nx, 1.0f);
        for (size_t i = 0; i < nx; i++) x[i] = dtype_round(dt, x[i]);
        uint16_t *xs = malloc(2 * nx);
        Tensor tx = tensor(xs, in, dt);
        ops_cpu.copy(&ops_cpu, tx, tensor_f32(x, in), 0);
        ConvCfg cfgs[3] = {{4, 6, 3, 3, 2, 1, PAD_SAME, 1},
                           {4, 5, 1, 1, 1, 1, PAD_SAME, 1},
                           {4, 4, 3, 3, 1, 4, PAD_SAME, 1}};
        const char *names[3] = {"3x3 conv", "1x1 conv", "depthwise conv"};
        for (int c = 0; c < 3; c++) {
            ConvCfg *cfg = &cfgs[c];
            int oh, ow, p;
            conv_axis(in.h, cfg->kh, cfg->stride, cfg->pad, &oh, &p);
            conv_axis(in.w, cfg->kw, cfg->stride, cfg->pad, &ow, &p);
            Shape os = shape4(in.n, oh, ow, cfg->cout);
            float *w = randn(&r, (size_t)cfg->cout * cfg->kh * cfg->kw * (cfg->cin / cfg->groups),
                             0.4f),
                  *b = randn(&r, cfg->cout, 1.0f);
            float *y32 = malloc(sizeof(float) * shape_numel(os));
            uint16_t *ys = malloc(2 * shape_numel(os));
            size_t wsb = conv2d_workspace_cpu(&ops_cpu, cfg, in, dt),
                   wsf = conv2d_workspace_cpu(&ops_cpu, cfg, in, DT_F32);
            void *ws = malloc((wsb > wsf ? wsb : wsf) + 1);
            ops_cpu.conv2d_forward(&ops_cpu, cfg, tensor_f32(y32, os), tensor_f32(x, in), w, NULL,
                                   b, ws);
            ops_cpu.conv2d_forward(&ops_cpu, cfg, tensor(ys, os, dt), tx, w, NULL, b, ws);
            double u = max_ulp_diff(tensor(ys, os, dt), y32);
            CHECK(u <= 1.0, "%s %s forward: %.2f units in the last place from fp32", dn, names[c],
                  u);
            // backward data and weight with the output gradient stored in dt
            float *dy = randn(&r, shape_numel(os), 1.0f);
            for (size_t i = 0; i < shape_numel(os); i++) dy[i] = dtype_round(dt, dy[i]);
            ops_cpu.copy(&ops_cpu, tensor(ys, os, dt), tensor_f32(dy, os), 0);
            float *dx32 = malloc(sizeof(float) * nx);
            uint16_t *dxs = malloc(2 * nx);
            ops_cpu.conv2d_backward_data(&ops_cpu, cfg, tensor_f32(dx32, in), tensor_f32(dy, os), w,
                                         NULL, 0, ws);
            ops_cpu.conv2d_backward_data(&ops_cpu, cfg, tensor(dxs, in, dt), tensor(ys, os, dt), w,
                                         NULL, 0, ws);
            u = max_ulp_diff(tensor(dxs, in, dt), dx32);
            CHECK(u <= 1.0, "%s %s backward data: %.2f ulp", dn, names[c], u);
            size_t nw = (size_t)cfg->cout * cfg->kh * cfg->kw * (cfg->cin / cfg->groups);
            float *dw32 = calloc(nw, sizeof(float)), *dws = calloc(nw, sizeof(float));
            ops_cpu.conv2d_backward_weight(&ops_cpu, cfg, dw32, NULL, tensor_f32(dy, os),
                                           tensor_f32(x, in), ws);
            ops_cpu.conv2d_backward_weight(&ops_cpu, cfg, dws, NULL, tensor(ys, os, dt), tx, ws);
            double dmax = 0;
            for (size_t i = 0; i < nw; i++)
                dmax = fmax(dmax, fabs(dw32[i] - dws[i]) / (1e-3 + fabs(dw32[i])));
            CHECK(dmax < 1e-5, "%s %s backward weight (fp32 result) differs by %.3g", dn, names[c],
                  dmax);
            free(w);
            free(b);
            free(y32);
            free(ys);
            free(ws);
            free(dy);
            free(dx32);
            free(dxs);
            free(dw32);
            free(dws);
        }
        // batch norm + SiLU forward with the stats of the rounded input
        float mean[4], var[4], gam[4] = {1, 0.5f, 2, -1}, bet[4] = {0, 0.1f, -0.2f, 0.3f};
        ops_cpu.bn_stats(&ops_cpu, tx, mean, var, NULL, NULL, 0.0f, NULL);
        float m32[4], v32[4];
        ops_cpu.bn_stats(&ops_cpu, tensor_f32(x, in), m32, v32, NULL, NULL, 0.0f, NULL);
        CHECK(!memcmp(mean, m32, sizeof mean) && !memcmp(var, v32, sizeof var),
              "%s bn statistics equal fp32's", dn);
        float *y32 = malloc(sizeof(float) * nx);
        uint16_t *ys = malloc(2 * nx);
        ops_cpu.bn_forward(
            &ops_cpu, tensor_f32(y32, in), tensor_f32(x, in),
            &(BnArgs){mean, var, gam, bet, 1e-3f, ACT_SILU, NULL});
        ops_cpu.bn_forward(
            &ops_cpu, tensor(ys, in, dt), tx,
            &(BnArgs){mean, var, gam, bet, 1e-3f, ACT_SILU, NULL});
        double u = max_ulp_diff(tensor(ys, in, dt), y32);
        CHECK(u <= 1.0, "%s bn+silu forward: %.2f ulp", dn, u);
        free(x); free(xs); free(y32); free(ys);
    }
}

// ld_run / st_run (vectorised conversions) against ld / st element by element:
// every fp16 and bf16 value in, a sweep of fp32 bit patterns out (ties, subnormals,
// overflow, NaN), with and without accumulation: the same bits.
TEST(fp16_runs) {
    enum { N = 65536 };
    static uint16_t h[N], a[N], b[N];
    static float f1[N], f2[N];
    for (int dt = DT_F16; dt <= DT_BF16; dt++) {
        for (int i = 0; i < N; i++) h[i] = (uint16_t)i;
        Tensor t = tensor(h, shape4(1, 1, 1, N), (DType)dt);
        ld_run(t, 0, f1, N);
        int bad = 0;
        for (int i = 0; i < N; i++) bad += f32_bits(f1[i]) != f32_bits(ld(t, i));
        CHECK(bad == 0, "ld_run %s: %d of 65536 values differ from ld", DT_NAME[dt], bad);
        for (uint64_t base = 0; base < (1ull << 32); base += (1ull << 32) / 64) {
            for (int i = 0; i < N; i++) f2[i] = bits_f32((uint32_t)(base + (uint64_t)i * 37));
            for (int acc = 0; acc < 2; acc++) {
                for (int i = 0; i < N; i++) a[i] = b[i] = (uint16_t)(i * 7);
                Tensor ta = tensor(a, shape4(1, 1, 1, N), (DType)dt),
                       tb = tensor(b, shape4(1, 1, 1, N), (DType)dt);
                st_run(ta, 0, f2, N, acc);
                for (int i = 0; i < N; i++) st_acc(tb, i, f2[i], acc);
                bad = 0;
                for (int i = 0; i < N; i++) bad += a[i] != b[i];
                CHECK(bad == 0, "st_run %s accumulate %d from 0x%08llx: %d values differ from st",
                      DT_NAME[dt], acc, (unsigned long long)base, bad);
            }
        }
    }
}

// ops_cpu's fp32 elementwise ops against ops_ref's: the same bits for fill,
// copy, axpby, add (forward, backward), and dropout per element and per
// sample (drop-path: one draw per sample from first_sample on), with and
// without a residual, written, accumulated and in place.
TEST(fast_elementwise_vs_ref) {
    Rng r; rng_seed(&r, 87);
    const Shape s = shape4(8, 5, 7, 11);
    const size_t n = shape_numel(s);
    float *x = randn(&r, n, 1.0f), *b = randn(&r, n, 1.0f), *init = randn(&r, n, 1.0f);
    const uint64_t seed = 0x5eed;
    Ops *tables[2] = {&ops_cpu, &ops_ref};
    enum { OUTS = 18 };
    float *out[2][OUTS];
    for (int t = 0; t < 2; t++) {
        Ops *o = tables[t];
        int k = 0;
        for (int j = 0; j < OUTS; j++) {
            out[t][j] = malloc(sizeof(float) * n);
            memcpy(out[t][j], init, sizeof(float) * n);
        }
        o->fill(o, tensor_f32(out[t][k++], s), -0.75f);
        for (int acc = 0; acc < 2; acc++)
            o->copy(o, tensor_f32(out[t][k++], s), tensor_f32(x, s), acc);
        for (int acc = 0; acc < 2; acc++)
            o->axpby(o, tensor_f32(out[t][k++], s), tensor_f32(x, s), 1.0f / 3.0f, -0.2f, acc);
        o->add_forward(o, tensor_f32(out[t][k++], s), tensor_f32(x, s), tensor_f32(b, s));
        o->add_backward(o, tensor_f32(out[t][k], s), tensor_f32(out[t][k + 1], s), tensor_f32(x, s),
                        1, 0);
        k += 2;
        for (int per_sample = 0; per_sample < 2; per_sample++) {
            o->dropout_forward(o, tensor_f32(out[t][k++], s), tensor_f32(x, s),
                               tensor(NULL, s, DT_F32), 0.3f, &seed, per_sample, 5);
            o->dropout_forward(o, tensor_f32(out[t][k++], s), tensor_f32(x, s), tensor_f32(b, s),
                               0.3f, &seed, per_sample, 5);
            o->dropout_backward(o, tensor_f32(out[t][k], s), tensor_f32(out[t][k + 1], s),
                                tensor_f32(x, s), 0.3f, &seed, per_sample, 5, per_sample,
                                !per_sample);
            k += 2;
        }
        memcpy(out[t][k], x, sizeof(float) * n);  // in place: dx is dy
        o->dropout_backward(o, tensor_f32(out[t][k], s), tensor(NULL, s, DT_F32),
                            tensor_f32(out[t][k], s), 0.5f, &seed, 1, 2, 0, 0);
        k++;
        CHECK(k == OUTS - 1, "%d outputs", k);
    }
    for (int k = 0; k < OUTS - 1; k++) {
        size_t differ = 0;
        for (size_t i = 0; i < n; i++)
            differ += memcmp(&out[0][k][i], &out[1][k][i], sizeof(float)) != 0;
        CHECK(differ == 0, "output %d: ops_cpu and ops_ref differ in %zu of %zu values", k, differ,
              n);
    }
    size_t dropped = 0;  // per sample (output 12): whole samples dropped or kept
    for (int m = 0; m < s.n; m++) {
        const size_t E = n / s.n;
        size_t zeros = 0;
        for (size_t i = 0; i < E; i++) zeros += out[0][12][m * E + i] == 0.0f;
        dropped += zeros == E;
        CHECK(zeros == 0 || zeros == E, "drop-path: sample %d has %zu of %zu elements dropped", m,
              zeros, E);
    }
    CHECK(dropped > 0 && dropped < (size_t)s.n,
          "drop-path dropped %zu of %d samples (the comparison wants both)", dropped, s.n);
    free(x); free(b); free(init);
    for (int t = 0; t < 2; t++)
        for (int j = 0; j < OUTS; j++) free(out[t][j]);
}

#ifdef SEGNET_CUDA
// fill, and copy with every cast and both modes: bit-identical to the CPU; bytes
// widened into every storage type: the bytes' values, exactly, from an aligned
// buffer (8-byte runs and a tail) and from one a byte past alignment
TEST(cuda_fill_copy) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 71);
    // odd; whole 16-byte vectors
    const Shape shapes[2] = {shape4(2, 3, 5, 7), shape4(2, 3, 5, 16)};
    for (int si = 0; si < 2; si++) {
    const Shape s = shapes[si];
    float *v = randn(&r, shape_numel(s), 3.0f);
    for (int a = 0; a < 3; a++)
        for (int b = 0; b < 3; b++)
            for (int acc = 0; acc < 2; acc++) {
                CuPair src = cu_pair(v, s, (DType)a), dst = cu_pair(NULL, s, (DType)b);
                ops_cpu.fill(&ops_cpu, dst.cpu, 0.3f);
                o->fill(o, dst.gpu, 0.3f);
                ops_cpu.copy(&ops_cpu, dst.cpu, src.cpu, acc);
                o->copy(o, dst.gpu, src.gpu, acc);
                CHECK(cu_pair_err(dst) == 0.0, "copy %s -> %s accumulate %d: error %.3g",
                      DT_NAME[a], DT_NAME[b], acc, cu_pair_err(dst));
                cu_pair_free(&src); cu_pair_free(&dst);
            }
    free(v);
    const size_t n = shape_numel(s);
    uint8_t *bytes = malloc(n + 1);
    for (size_t i = 0; i <= n; i++) bytes[i] = (uint8_t)(rng_next(&r) % 256);
    uint8_t *dev = o->alloc(o, n + 1);
    o->upload(o, dev, bytes, n + 1);
    for (int a = 0; a < 3; a++)
        for (int off = 0; off < 2; off++) {
            CuPair dst = cu_pair(NULL, s, (DType)a);
            ops_cpu.widen_bytes(&ops_cpu, dst.cpu, bytes + off);
            o->widen_bytes(o, dst.gpu, dev + off);
            float *g = cu_to_host(dst.gpu.data, n, dst.gpu.dtype);
            size_t wrong = 0;
            for (size_t i = 0; i < n; i++)
                wrong += g[i] != (float)bytes[i + off] || ld(dst.cpu, i) != (float)bytes[i + off];
            CHECK(wrong == 0, "widen_bytes -> %s, %d byte past alignment: %zu of %zu values wrong",
                  DT_NAME[a], off, wrong, n);
            free(g);
            cu_pair_free(&dst);
        }
    o->free(o, dev);
    free(bytes);
    }
}

// scale: one product, rounded once: the same bits. axpby: gcc -march=native
// fuses a·x + b into one FMA on the CPU, the emulator's g++ does not: one fp32
// rounding apart (two when adding into y), so 2 ulp of the storage type.
TEST(cuda_scale_axpby) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 72);
    // odd sizes; several blocks; vectors
    Shape shapes[3] = {shape4(2, 3, 5, 7), shape4(1, 1, 1, 1031), shape4(2, 3, 5, 16)};
    for (int si = 0; si < 3; si++) {
        Shape s = shapes[si];
        float *v = randn(&r, shape_numel(s), 3.0f), *u = randn(&r, shape_numel(s), 2.0f);
        for (int a = 0; a < 3; a++) {
            CuPair t = cu_pair(v, s, (DType)a);
            ops_cpu.scale(&ops_cpu, t.cpu, -1.7f);
            o->scale(o, t.gpu, -1.7f);
            cu_check_err("scale", (DType)a, cu_pair_err(t), 0.0);
            cu_pair_free(&t);
            for (int b = 0; b < 3; b++)
                for (int acc = 0; acc < 2; acc++) {
                    CuPair x = cu_pair(v, s, (DType)a), y = cu_pair(u, s, (DType)b);
                    ops_cpu.axpby(&ops_cpu, y.cpu, x.cpu, 0.37f, -1.25f, acc);
                    o->axpby(o, y.gpu, x.gpu, 0.37f, -1.25f, acc);
                    cu_check_err(acc ? "axpby (x -> y, accumulate)" : "axpby (x -> y)", (DType)b,
                                 cu_pair_err(y), 2 * CU_ULP[b]);
                    cu_pair_free(&x); cu_pair_free(&y);
                }
        }
        free(v); free(u);
    }
}

// sum_squares: fp64 sums on both backends in different orders, rounded once to
// fp32: equal up to that rounding (1 ulp). Run twice: the same bits. nonfinite:
// the CPU's verdict for inf, -inf, NaN at the ends and in the middle, values
// that overflow fp16 only, and all finite (flag untouched).
TEST(cuda_sum_squares_nonfinite) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 73);
    // the 4th: more blocks than the reduction's grid; the last two: whole 16-byte vectors
    const int sizes[6] = {1, 37, 1031, 300007, 4096, 300008};
    float *out = o->alloc(o, sizeof(float));
    int32_t *flag = o->alloc(o, sizeof(int32_t));
    for (int si = 0; si < 6; si++) {
        Shape s = shape4(1, 1, 1, sizes[si]);
        size_t n = shape_numel(s);
        float *v = randn(&r, n, 3.0f);
        for (int a = 0; a < 3; a++) {
            CuPair t = cu_pair(v, s, (DType)a);
            float cpu = -1.0f, gpu = -1.0f, again = -2.0f;
            ops_cpu.sum_squares(&ops_cpu, t.cpu, &cpu);
            o->sum_squares(o, t.gpu, out);
            o->download(o, &gpu, out, sizeof gpu);
            o->sum_squares(o, t.gpu, out);
            o->download(o, &again, out, sizeof again);
            cu_check_err("sum_squares", (DType)a, fabs((double)gpu - cpu) / cpu, CU_ULP[DT_F32]);
            CHECK(f32_bits(gpu) == f32_bits(again), "sum_squares n=%zu %s: two runs differ", n,
                  DT_NAME[a]);
            cu_pair_free(&t);
        }
        if (n < 37) { free(v); continue; }
        const float bad_values[4] = {INFINITY, -INFINITY, NAN, 1e5f};  // 1e5: inf in fp16 only
        const size_t where[3] = {0, n / 2, n - 1};
        for (int a = 0; a < 3; a++)
            for (int bi = -1; bi < 4; bi++)
                for (int wi = 0; wi < 3; wi++) {
                    float keep = 0.0f;
                    if (bi >= 0) { keep = v[where[wi]]; v[where[wi]] = bad_values[bi]; }
                    CuPair t = cu_pair(v, s, (DType)a);
                    int32_t cpu = 5, gpu = -1;
                    o->upload(o, flag, &cpu, sizeof cpu);
                    ops_cpu.nonfinite(&ops_cpu, t.cpu, &cpu);
                    o->nonfinite(o, t.gpu, flag);
                    o->download(o, &gpu, flag, sizeof gpu);
                    CHECK(gpu == cpu, "nonfinite n=%zu %s value %g at %zu: flag %d, CPU %d", n,
                          DT_NAME[a], bi >= 0 ? bad_values[bi] : 0.0, where[wi], gpu, cpu);
                    CHECK(bi >= 0 || gpu == 5, "nonfinite %s: finite values changed the flag",
                          DT_NAME[a]);
                    if (bi >= 0) v[where[wi]] = keep;
                    cu_pair_free(&t);
                    if (bi < 0) break;
                }
        free(v);
    }
    o->free(o, out); o->free(o, flag);
}
#endif

#if EMULATED_CUDA
// elements per launch of the emulated kernels (kernels.cu's LAUNCH_MAX_ELEMENTS)
extern size_t cuda_launch_max_elements;
// Whole-buffer ops with the launch limit lowered to 40 elements, so that every
// op walks many chunks (10 vectors of fp32, 5 of fp16/bf16) and ends in a
// partial one: the CPU's results, as at full size (the same tolerances as
// above), and no 32-bit index of a chunk reaches the limit (the emulator stops
// a kernel whose vector's first element, vec_elem, would).
TEST(cuda_launch_split) {
    Ops *o = cu_ops();
    Rng r;
    rng_seed(&r, 74);
    const size_t full_limit = cuda_launch_max_elements;
    cuda_launch_max_elements = 40;
    const int sizes[2] = {1031, 1040};  // generic kernels; whole 16-byte vectors
    float *out = o->alloc(o, sizeof(float));
    int32_t *flag = o->alloc(o, sizeof(int32_t));
    for (int si = 0; si < 2; si++)
        for (int dt = 0; dt < 3; dt++) {
            const Shape s = shape4(1, 1, 1, sizes[si]);
            const size_t n = shape_numel(s);
            float *av = randn(&r, n, 2.0f), *bv = randn(&r, n, 2.0f);
            CuPair a = cu_pair(av, s, (DType)dt), b = cu_pair(bv, s, (DType)dt);
            CuPair y = cu_pair(NULL, s, (DType)dt);
            ops_cpu.fill(&ops_cpu, y.cpu, 0.3f);
            o->fill(o, y.gpu, 0.3f);
            cu_expect(cu_pair_err(y), 0.0, "fill, split", (DType)dt);
            ops_cpu.copy(&ops_cpu, y.cpu, a.cpu, 1);
            o->copy(o, y.gpu, a.gpu, 1);
            cu_expect(cu_pair_err(y), 0.0, "copy accumulate, split", (DType)dt);
            ops_cpu.scale(&ops_cpu, y.cpu, -1.7f);
            o->scale(o, y.gpu, -1.7f);
            cu_expect(cu_pair_err(y), 0.0, "scale, split", (DType)dt);
            ops_cpu.axpby(&ops_cpu, y.cpu, a.cpu, 0.37f, -1.25f, 1);
            o->axpby(o, y.gpu, a.gpu, 0.37f, -1.25f, 1);
            cu_expect(cu_pair_err(y), 2 * CU_ULP[dt], "axpby accumulate, split", (DType)dt);
            ops_cpu.add_forward(&ops_cpu, y.cpu, a.cpu, b.cpu);
            o->add_forward(o, y.gpu, a.gpu, b.gpu);
            cu_expect(cu_pair_err(y), 0.0, "add_forward, split", (DType)dt);
            ops_cpu.act_backward(&ops_cpu, ACT_RELU, y.cpu, a.cpu, b.cpu, 1);
            o->act_backward(o, ACT_RELU, y.gpu, a.gpu, b.gpu, 1);
            cu_expect(cu_pair_err(y), 0.0, "act_backward relu accumulate, split", (DType)dt);
            CuPair da = cu_dest(&r, s, (DType)dt, 1), db = cu_dest(&r, s, (DType)dt, 0);
            ops_cpu.add_backward(&ops_cpu, da.cpu, db.cpu, a.cpu, 1, 0);
            o->add_backward(o, da.gpu, db.gpu, a.gpu, 1, 0);
            cu_expect(cu_pair_err(da), 0.0, "add_backward accumulate, split", (DType)dt);
            cu_expect(cu_pair_err(db), 0.0, "add_backward, split", (DType)dt);
            float cpu = -1.0f, gpu = -1.0f;
            ops_cpu.sum_squares(&ops_cpu, a.cpu, &cpu);
            o->sum_squares(o, a.gpu, out);
            o->download(o, &gpu, out, sizeof gpu);
            cu_expect(fabs((double)gpu - cpu) / cpu, CU_ULP[DT_F32], "sum_squares, split",
                      (DType)dt);
            av[n - 1] = NAN;  // in the last, partial chunk
            CuPair bad = cu_pair(av, s, (DType)dt);
            int32_t seen = 0;
            o->upload(o, flag, &seen, sizeof seen);
            o->nonfinite(o, bad.gpu, flag);
            o->download(o, &seen, flag, sizeof seen);
            CHECK(seen == 1, "nonfinite n=%zu %s, split: a NaN in the last chunk not seen", n,
                  DT_NAME[dt]);
            cu_pair_free(&a);
            cu_pair_free(&b);
            cu_pair_free(&y);
            cu_pair_free(&da);
            cu_pair_free(&db);
            cu_pair_free(&bad);
            free(av);
            free(bv);
        }
    o->free(o, out);
    o->free(o, flag);
    cuda_launch_max_elements = full_limit;
}
#endif

// ----------------------------------------------------------------------------
// conv2d

static void conv_case(const char *label, Shape in, int cout, int k, int stride, int groups,
                      PadMode pad, int bias, int fanout) {
    Graph g; graph_init(&g);
    int x = graph_input(&g, in);
    int y = graph_conv(&g, "a", x, cout, k, stride, groups, pad, bias);
    if (fanout) {
        int y2 = graph_conv(&g, "b", x, cout, k, stride, groups, pad, !bias);
        y = graph_concat(&g, "cat", y, y2);
    }
    GradOpts o = grad_opts();
    if (g_verbose) printf("    %s\n", label);
    note_worst(LAYER_CONV, graph_gradcheck(&g, y, o, &ops_cpu));
    note_worst(LAYER_CONV, graph_gradcheck(&g, y, o, &ops_ref));  // the reference conv too
    graph_free(&g);
}

TEST(conv_grad_dense) {
    conv_case("3x3 s1 same, odd 5x7",            shape4(2, 5, 7, 3), 4, 3, 1, 1, PAD_SAME, 1, 1);
    conv_case("3x3 s2 same, even 6x8",           shape4(2, 6, 8, 3), 4, 3, 2, 1, PAD_SAME, 1, 1);
    conv_case("3x3 s2 same, odd 7x5",            shape4(1, 7, 5, 2), 3, 3, 2, 1, PAD_SAME, 0, 1);
    conv_case("3x3 s2 symmetric, odd 7x5", shape4(1, 7, 5, 2), 3, 3, 2, 1, PAD_SYMMETRIC, 1, 1);
    conv_case("5x5 s2 symmetric, 9x6", shape4(1, 9, 6, 2), 3, 5, 2, 1, PAD_SYMMETRIC, 1, 0);
    conv_case("2x2 s1 same (extra pad after)",   shape4(1, 5, 4, 2), 3, 2, 1, 1, PAD_SAME, 1, 0);
    conv_case("4x4 s3 same, 7x8",                shape4(1, 7, 8, 2), 2, 4, 3, 1, PAD_SAME, 1, 0);
    conv_case("kernel larger than input (same)", shape4(1, 2, 3, 2), 2, 5, 1, 1, PAD_SAME, 1, 0);
}

TEST(conv_grad_pointwise) {
    conv_case("1x1 s1 (one GEMM)",               shape4(2, 3, 5, 6), 5, 1, 1, 1, PAD_SAME, 1, 1);
    conv_case("1x1 s2 same, odd 5x5",            shape4(2, 5, 5, 3), 4, 1, 2, 1, PAD_SAME, 1, 1);
}

TEST(conv_grad_grouped) {
    conv_case("3x3 groups 2",                    shape4(2, 5, 6, 4), 6, 3, 1, 2, PAD_SAME, 1, 1);
    conv_case("3x3 s2 groups 3, odd", shape4(1, 7, 5, 6), 3, 3, 2, 3, PAD_SYMMETRIC, 1, 1);
    conv_case("1x1 groups 2",                    shape4(1, 3, 3, 4), 4, 1, 1, 2, PAD_SAME, 0, 1);
    conv_case("depthwise multiplier 2 (GEMM)",   shape4(1, 5, 5, 3), 6, 3, 1, 3, PAD_SAME, 1, 0);
}

TEST(conv_grad_depthwise) {
    conv_case("depthwise 3x3 s1 same",           shape4(2, 5, 6, 4), 4, 3, 1, 4, PAD_SAME, 1, 1);
    conv_case("depthwise 3x3 s2 same, even",     shape4(2, 6, 8, 3), 3, 3, 2, 3, PAD_SAME, 1, 1);
    conv_case("depthwise 5x5 s2 same, odd",      shape4(1, 7, 9, 3), 3, 5, 2, 3, PAD_SAME, 0, 1);
    conv_case("depthwise 3x3 s2 symmetric, odd", shape4(1, 7, 5, 5), 5, 3, 2, 5, PAD_SYMMETRIC, 1,
              1);
}

TEST(dense_grad) {
    Graph g; graph_init(&g);
    int x = graph_input(&g, shape4(3, 1, 1, 7));
    int a = graph_dense(&g, "fc_a", x, 5, 1);
    int b = graph_dense(&g, "fc_b", x, 4, 0);
    int y = graph_concat(&g, "cat", a, b);
    note_worst(LAYER_DENSE, graph_gradcheck(&g, y, grad_opts(), &ops_cpu));
    graph_free(&g);
}

// forward against an independent naive convolution (TF SAME / PyTorch
// padding computed here from their definitions, fp64 sums)
static void conv_naive(const float *x, Shape in, const float *w, const float *b, int cout, int k,
                       int s, int groups, PadMode pad, double *y, int *oh_, int *ow_) {
    int oh, ow, pt, pl;
    if (pad == PAD_SAME) {
        oh = (in.h + s - 1) / s; ow = (in.w + s - 1) / s;
        int th = (oh - 1) * s + k - in.h, tw = (ow - 1) * s + k - in.w;
        pt = th > 0 ? th / 2 : 0; pl = tw > 0 ? tw / 2 : 0;
    } else {
        pt = pl = (k - 1) / 2;
        oh = (in.h + 2 * pt - k) / s + 1; ow = (in.w + 2 * pl - k) / s + 1;
    }
    int cg = in.c / groups, og = cout / groups;
    for (int n = 0; n < in.n; n++)
        for (int i = 0; i < oh; i++)
            for (int j = 0; j < ow; j++)
                for (int co = 0; co < cout; co++) {
                    double acc = b ? b[co] : 0.0;
                    int grp = co / og;
                    for (int u = 0; u < k; u++)
                        for (int v = 0; v < k; v++)
                            for (int ci = 0; ci < cg; ci++) {
                                int r = i * s + u - pt, c = j * s + v - pl;
                                if (r < 0 || r >= in.h || c < 0 || c >= in.w) continue;
                                acc += (double)x[((n * in.h + r) * in.w + c) * in.c + grp * cg +
                                                 ci] *
                                       w[((co * k + u) * k + v) * cg + ci];
                            }
                    y[((n * oh + i) * ow + j) * cout + co] = acc;
                }
    *oh_ = oh; *ow_ = ow;
}

TEST(conv_forward_vs_naive) {
    struct { Shape in; int cout, k, s, groups; PadMode pad; int bias; } cases[] = {
        {{2, 5, 7, 3}, 4, 3, 1, 1, PAD_SAME, 1}, {{1, 6, 8, 3}, 4, 3, 2, 1, PAD_SAME, 0},
        {{1, 7, 5, 3}, 4, 3, 2, 1, PAD_SAME, 1}, {{1, 7, 5, 3}, 4, 3, 2, 1, PAD_SYMMETRIC, 1},
        {{2, 4, 4, 6}, 6, 1, 1, 1, PAD_SAME, 1}, {{1, 5, 5, 6}, 4, 1, 2, 1, PAD_SAME, 0},
        {{1, 6, 6, 4}, 6, 3, 1, 2, PAD_SAME, 1}, {{2, 9, 8, 5}, 5, 5, 2, 5, PAD_SAME, 1},
        {{1, 8, 9, 4}, 4, 3, 2, 4, PAD_SYMMETRIC, 0}, {{1, 5, 5, 3}, 6, 3, 1, 3, PAD_SAME, 1},
        {{1, 6, 7, 2}, 3, 2, 2, 1, PAD_SAME, 1}, {{1, 11, 10, 2}, 3, 4, 3, 1, PAD_SAME, 1},
    };
    Rng rng; rng_seed(&rng, 99);
    double worst = 0.0;
    for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++) {
        Shape in = cases[t].in;
        ConvCfg cfg = {in.c,       cases[t].cout,   cases[t].k,   cases[t].k,
                       cases[t].s, cases[t].groups, cases[t].pad, cases[t].bias};
        float *x = randn(&rng, shape_numel(in), 1.0f);
        float *w = randn(&rng, (size_t)cfg.cout * cfg.kh * cfg.kw * (in.c / cfg.groups), 0.5f);
        float *b = randn(&rng, cfg.cout, 1.0f);
        double *ref = malloc(sizeof(double) * in.n * in.h * in.w * cfg.cout);
        int oh, ow;
        conv_naive(x, in, w, cfg.has_bias ? b : NULL, cfg.cout, cfg.kh, cfg.stride, cfg.groups,
                   cfg.pad, ref, &oh, &ow);
        Shape os = shape4(in.n, oh, ow, cfg.cout);
        float *y = malloc(sizeof(float) * shape_numel(os));
        void *ws = malloc(conv2d_workspace_cpu(&ops_cpu, &cfg, in, DT_F32) + 1);
        ops_cpu.conv2d_forward(&ops_cpu, &cfg, tensor_f32(y, os), tensor_f32(x, in), w, NULL,
                               cfg.has_bias ? b : NULL, ws);
        double e = 0.0;
        for (size_t i = 0; i < shape_numel(os); i++)
            if (fabs(y[i] - ref[i]) > e) e = fabs(y[i] - ref[i]);
        CHECK(e < 1e-4, "case %zu: conv forward differs from the naive formula by %.3g", t, e);
        if (e > worst) worst = e;
        free(x); free(w); free(b); free(ref); free(y); free(ws);
    }
    if (g_verbose) printf("    worst |conv - naive| %.2e\n", worst);
}

// SAME vs symmetric padding by hand: one row [1 2 3 4], kernel row [1 10 100]
// (3×3 kernel, zero outside its middle row), stride 2.
//   TF SAME:   out 2, total pad (2-1)·2 + 3 - 4 = 1, all after:
//              [1·1+2·10+3·100, 3·1+4·10] = [321, 43]
//   PyTorch:   pad 1 each side: [0·1+1·10+2·100, 2·1+3·10+4·100] = [210, 432]
TEST(conv_padding_by_hand) {
    float x[4] = {1, 2, 3, 4}, w[9] = {0, 0, 0, 1, 10, 100, 0, 0, 0}, y[2];
    Shape in = shape4(1, 1, 4, 1), os = shape4(1, 1, 2, 1);
    ConvCfg same = {1, 1, 3, 3, 2, 1, PAD_SAME, 0}, sym = {1, 1, 3, 3, 2, 1, PAD_SYMMETRIC, 0};
    size_t wsb = conv2d_workspace_cpu(&ops_cpu, &same, in, DT_F32),
           wsb2 = conv2d_workspace_cpu(&ops_cpu, &sym, in, DT_F32);
    float *ws = malloc(wsb > wsb2 ? wsb : wsb2);
    ops_cpu.conv2d_forward(&ops_cpu, &same, tensor_f32(y, os), tensor_f32(x, in), w, NULL, NULL,
                           ws);
    CHECK(y[0] == 321 && y[1] == 43, "SAME: got [%g %g], expected [321 43]", y[0], y[1]);
    ops_cpu.conv2d_forward(&ops_cpu, &sym, tensor_f32(y, os), tensor_f32(x, in), w, NULL, NULL, ws);
    CHECK(y[0] == 210 && y[1] == 432, "symmetric: got [%g %g], expected [210 432]", y[0], y[1]);
    free(ws);
    int o, p;
    conv_axis(7, 3, 2, PAD_SAME, &o, &p);
    CHECK(o == 4 && p == 1, "SAME 7/3/2: out %d pad %d, expected 4 and 1 (total 2)", o, p);
    conv_axis(8, 3, 2, PAD_SAME, &o, &p);
    CHECK(o == 4 && p == 0, "SAME 8/3/2: out %d pad %d, expected 4 and 0 (total 1, after)", o, p);
    conv_axis(8, 3, 2, PAD_SYMMETRIC, &o, &p);
    CHECK(o == 4 && p == 1, "symmetric 8/3/2: out %d pad %d, expected 4 and 1", o, p);
}

// The direct k×k paths (register-blocked, no im2col) against im2col + GEMM on
// shapes that take them (input channels from a vector to below CONV_DW_GEMM_MIN_CIN,
// and more on a small image),
// with row and channel tails, strides 1 and 2, both paddings, accumulate, bias,
// 16-bit storage; all images padded at once, one by one, and two at a time
// (conv_chunk_floats).
// Both sum the same fp32 products in different orders (forward and data
// gradient: kh·kw·C terms; weight gradient: N·OH·OW terms, the direct path
// partly in fp64): 1e-5 of the largest value is far above that rounding
// (~1e-7 typical) and far below a wrong tap or lane. 16-bit outputs are
// rounded once more: two sums that close round to the same value or to
// neighbours, one ulp of the type apart at most; relative to the largest
// value that is ulp(max)/max, between 2^-(m+1) and 2^-m for m mantissa bits.
static double ulp_at_largest(const float *v, size_t n, DType dt) {
    if (dt == DT_F32) return 0.0;
    double m = 0.0;
    for (size_t i = 0; i < n; i++) m = fmax(m, fabs(v[i]));
    if (m == 0.0) return 0.0;
    int e;
    frexp(m, &e);  // m = f·2^e, f in [0.5, 1): the binade [2^(e-1), 2^e)
    return ldexp(1.0, e - 1 - (dt == DT_BF16 ? 7 : 10)) / m;
}
TEST(conv_direct_vs_gemm) {
    struct { Shape in; int cout, k, s; PadMode pad; int bias; } cases[] = {
        {{2, 7, 9, CONV_VL}, CONV_VL + 4, 3, 1, PAD_SAME, 1},
        {{1, 6, 11, CONV_VL + 1}, 2 * CONV_VL + 1, 5, 1, PAD_SYMMETRIC, 0},
        {{2, 9, 8, CONV_VL + 8}, CONV_VL, 3, 2, PAD_SAME, 1},
        {{1, 13, 14, 2 * CONV_VL}, 5 * CONV_VL / 2, 3, 2, PAD_SYMMETRIC, 1},
        {{1, 5, 31, CONV_VL}, 4 * CONV_VL + 6, 3, 1, PAD_SAME, 0},
        {{1, 4, 27, 5 * CONV_VL}, 7, 3, 1, PAD_SYMMETRIC, 1},
        {{3, 4, 5, 2 * CONV_VL}, 3 * CONV_VL, 3, 1, PAD_SAME, 0},
        // 8 vectors of input channels on a small image (4×5: direct in every pass with AVX);
        // runs of whole images across rows, and a last block of output channels narrower
        {{2, 4, 5, 8 * CONV_VL + 3}, 5 * CONV_VL + 3, 3, 1, PAD_SAME, 1},
        // 16 output channels from 3 vectors of input channels: with 32 registers, weight
        // gradient tiles of 8 + 8 channels (not 9 + 4 + 2 + 1)
        {{1, 6, 7, 3 * CONV_VL}, 16, 3, 1, PAD_SAME, 0},
        // an RGB stem: fewer input channels than a vector (the weight gradient direct)
        {{2, 9, 10, 3}, CONV_VL + 8, 3, 2, PAD_SAME, 1},
        {{1, 6, 7, 3}, 5, 3, 1, PAD_SYMMETRIC, 0},
        // 1×1: the weight gradient's items split along Cout
        {{2, 5, 6, CONV_VL}, 100, 1, 1, PAD_SAME, 1},
        {{1, 7, 3, 5 * CONV_VL + 3}, CONV_VL + 1, 1, 1, PAD_SAME, 0},
    };
    // the paths chosen: a k×k conv's weight gradient takes im2col + GEMM from
    // CONV_DW_GEMM_MIN_CIN input channels on images of more than CONV_DIRECT_MAX_PIXELS
    // output pixels, its other passes from CONV_GEMM_MIN_CIN; a 1×1 conv's weight gradient
    // stays direct
    {
        const int w = CONV_DW_GEMM_MIN_CIN;
        const ConvCfg wide = {w, 8, 3, 3, 1, 1, PAD_SAME, 0},
                      narrow = {w - 1, 8, 3, 3, 1, 1, PAD_SAME, 0},
                      wide1x1 = {w, 8, 1, 1, 1, 1, PAD_SAME, 0};
        const ConvGeom big = conv_geom(&wide, shape4(1, 9, 9, w)),
                       small = conv_geom(&wide, shape4(1, 8, 8, w)),
                       big1x1 = conv_geom(&wide1x1, shape4(1, 9, 9, w));
        const int wide_direct = w < CONV_GEMM_MIN_CIN, small_direct = CONV_DIRECT_MAX_PIXELS >= 64;
        CHECK(conv_is_direct(&narrow, &big) && conv_direct_grad_data(&narrow, &big) &&
                      conv_direct_grad_weight(&narrow, &big),
              "%d input channels, 9x9: all passes direct", w - 1);
        CHECK(conv_is_direct(&wide, &big) == wide_direct &&
                      conv_direct_grad_data(&wide, &big) == wide_direct &&
                      !conv_direct_grad_weight(&wide, &big),
              "%d input channels, 9x9: forward and data gradient %s, weight gradient GEMM", w,
              wide_direct ? "direct" : "GEMM");
        CHECK(conv_is_direct(&wide, &small) == (wide_direct || small_direct) &&
                      conv_direct_grad_weight(&wide, &small) == small_direct,
              "%d input channels, 8x8: direct %d, weight gradient direct %d", w,
              conv_is_direct(&wide, &small), conv_direct_grad_weight(&wide, &small));
        CHECK(conv_direct_grad_weight(&wide1x1, &big1x1), "1x1, %d input channels: direct", w);
    }
    Rng rng; rng_seed(&rng, 123);
    double worst[3] = {0};
    const size_t chunk_floats = conv_chunk_floats;
    for (size_t t = 0; t < sizeof cases / sizeof cases[0]; t++)
        for (int dt = DT_F32; dt <= DT_BF16; dt++)
        for (int chunking = 0; chunking < 3; chunking++) {
            Shape in = cases[t].in;
            {
                ConvCfg c = {in.c, cases[t].cout, cases[t].k, cases[t].k, cases[t].s,
                             1,    cases[t].pad,  0};
                ConvGeom g = conv_geom(&c, in);
                const size_t image = direct_conv_image_floats(&c, &g, 0);
                conv_chunk_floats = chunking == 0 ? chunk_floats : chunking == 1 ? 1 : 2 * image;
                CHECK(conv_chunk_images(image, in.n) == (chunking == 0   ? in.n
                                                         : chunking == 1 ? 1
                                                         : in.n < 2      ? in.n
                                                                         : 2),
                      "case %zu chunking %d: images per chunk", t, chunking);
            }
            ConvCfg cfg = {in.c, cases[t].cout, cases[t].k,   cases[t].k, cases[t].s,
                           1,    cases[t].pad,  cases[t].bias};
            ConvGeom q = conv_geom(&cfg, in);
            if (cfg.cin < CONV_DW_GEMM_MIN_CIN)
                CHECK((conv_is_direct(&cfg, &q) || conv_is_pointwise(&cfg)) &&
                              conv_direct_grad_weight(&cfg, &q),
                      "case %zu takes the direct paths", t);
            Shape os = shape4(in.n, q.OH, q.OW, cfg.cout);
            size_t nx = shape_numel(in), ny = shape_numel(os),
                   nw = (size_t)cfg.cout * cfg.kh * cfg.kw * in.c;
            float *xv = randn(&rng, nx, 1.0f), *dyv = randn(&rng, ny, 1.0f),
                  *w = randn(&rng, nw, 0.3f);
            float *b = randn(&rng, cfg.cout, 1.0f), *d0 = randn(&rng, nx, 1.0f);
            size_t wsb = conv2d_workspace_cpu(&ops_cpu, &cfg, in, (DType)dt),
                   gemm = 4 * gemm_weight_grad_floats(&q, (DType)dt);
            for (int pass = 0; pass < 3; pass++)  // a 1×1 conv's own paths are not all direct
                if (4 * direct_conv_floats(&cfg, &q, pass) > wsb)
                    wsb = 4 * direct_conv_floats(&cfg, &q, pass);
            float *ws = malloc((wsb > gemm ? wsb : gemm) + 64);  // the direct paths, or im2col's
            Tensor x = tensor(malloc(nx * 4), in, (DType)dt),
                   dy = tensor(malloc(ny * 4), os, (DType)dt);
            Tensor y1 = tensor(malloc(ny * 4), os, (DType)dt),
                   y2 = tensor(malloc(ny * 4), os, (DType)dt);
            Tensor dx1 = tensor(malloc(nx * 4), in, (DType)dt),
                   dx2 = tensor(malloc(nx * 4), in, (DType)dt);
            for (size_t i = 0; i < nx; i++) st(x, i, xv[i]);
            for (size_t i = 0; i < ny; i++) st(dy, i, dyv[i]);
            float *f1 = malloc(4 * (nx > ny ? nx : ny)), *f2 = malloc(4 * (nx > ny ? nx : ny));
            const float *bias = cfg.has_bias ? b : NULL;
            conv2d_forward_direct(&cfg, &q, y1, x, w, bias, ws);
            conv2d_forward_gemm(&cfg, &q, y2, x, w, bias, ws);
            for (size_t i = 0; i < ny; i++) { f1[i] = ld(y1, i); f2[i] = ld(y2, i); }
            double e = rel_diff(f1, f2, ny, 1e-3);
            worst[0] = fmax(worst[0], e);
            CHECK(e <= 1e-5 + ulp_at_largest(f2, ny, (DType)dt),
                  "case %zu %s: forward direct vs gemm %.2e", t, DT_NAME[dt], e);
            if (cfg.stride == 1)
                for (int acc = 0; acc < 2; acc++) {
                    for (size_t i = 0; i < nx; i++) { st(dx1, i, d0[i]); st(dx2, i, d0[i]); }
                    conv2d_backward_data_direct(&cfg, &q, dx1, dy, w, acc, ws);
                    conv2d_backward_data_gemm(&cfg, &q, dx2, dy, w, acc, ws);
                    for (size_t i = 0; i < nx; i++) { f1[i] = ld(dx1, i); f2[i] = ld(dx2, i); }
                    e = rel_diff(f1, f2, nx, 1e-3);
                    worst[1] = fmax(worst[1], e);
                    CHECK(e <= 1e-5 + ulp_at_largest(f2, nx, (DType)dt),
                          "case %zu %s accumulate %d: data gradient direct vs gemm %.2e", t,
                          DT_NAME[dt], acc, e);
                }
            float *dw1 = malloc(4 * nw), *dw2 = malloc(4 * nw);
            for (size_t i = 0; i < nw; i++) dw1[i] = dw2[i] = w[i];  // added into
            conv2d_backward_weight_direct(&cfg, &q, dw1, dy, x, ws);
            conv2d_backward_weight_gemm(&cfg, &q, dw2, dy, x, ws);
            e = rel_diff(dw1, dw2, nw, 1e-3);
            worst[2] = fmax(worst[2], e);
            CHECK(e <= 1e-5, "case %zu %s: weight gradient direct vs gemm %.2e", t, DT_NAME[dt], e);
            free(xv);
            free(dyv);
            free(w);
            free(b);
            free(d0);
            free(ws);
            free(f1);
            free(f2);
            free(dw1);
            free(dw2);
            free(x.data);
            free(dy.data);
            free(y1.data);
            free(y2.data);
            free(dx1.data);
            free(dx2.data);
        }
    conv_chunk_floats = chunk_floats;
    if (g_verbose)
        printf("    worst direct vs gemm: forward %.2e, data %.2e, weight %.2e\n", worst[0],
               worst[1], worst[2]);
}

// Depthwise: forward and data gradient add the taps in the reference's order,
// with the same products, so they differ at most by FMA contraction (1 ulp per
// tap, 25 taps): 1e-6 of the largest value. The weight gradient sums the same
// fp64 products in the same order: the same to fp32 rounding.
TEST(fast_depthwise_vs_ref) {
    Rng r; rng_seed(&r, 82);
    const int chans[3] = {37, 16, 5}, sizes[3][2] = {{9, 7}, {8, 8}, {5, 11}};
    for (int ci = 0; ci < 3; ci++)
        for (int k = 3; k <= 5; k += 2)
            for (int stride = 1; stride <= 2; stride++)
                for (int pad = 0; pad < 2; pad++) {
                    const int C = chans[ci];
                    Shape in = shape4(2, sizes[ci][0], sizes[ci][1], C);
                    ConvCfg cfg = {0};
                    cfg.cin = cfg.cout = cfg.groups = C; cfg.kh = cfg.kw = k; cfg.stride = stride;
                    cfg.pad = pad ? PAD_SAME : PAD_SYMMETRIC;
                    ConvGeom q = conv_geom(&cfg, in);
                    Shape out = shape4(2, q.OH, q.OW, C);
                    size_t ni = shape_numel(in), no = shape_numel(out);
                    float *x = randn(&r, ni, 1.0f), *w = randn(&r, (size_t)C * k * k, 0.3f),
                          *b = randn(&r, C, 0.1f);
                    float *dy = randn(&r, no, 1.0f),
                          *ws = malloc(conv2d_workspace_cpu(&ops_cpu, &cfg, in, DT_F32));
                    float *y1 = malloc(sizeof(float) * no), *y2 = malloc(sizeof(float) * no);
                    conv2d_forward_cpu(&ops_cpu, &cfg, tensor_f32(y1, out), tensor_f32(x, in), w,
                                       NULL, b, ws);
                    depthwise_forward_any(&cfg, &q, tensor_f32(y2, out), tensor_f32(x, in), w, b);
                    double e = rel_diff(y1, y2, no, 1.0);
                    CHECK(e < 1e-6,
                          "depthwise forward fast vs reference %.2e (C %d, k %d, stride %d, %s)", e,
                          C, k, stride, pad ? "same" : "symmetric");
                    float *d0 = randn(&r, ni, 1.0f), *g1 = malloc(sizeof(float) * ni),
                          *g2 = malloc(sizeof(float) * ni);
                    for (int acc = 0; acc < 2; acc++) {
                        memcpy(g1, d0, sizeof(float) * ni);
                        memcpy(g2, d0, sizeof(float) * ni);
                        conv2d_backward_data_cpu(&ops_cpu, &cfg, tensor_f32(g1, in),
                                                 tensor_f32(dy, out), w, NULL, acc, ws);
                        depthwise_backward_data_any(&cfg, &q, tensor_f32(g2, in),
                                                    tensor_f32(dy, out), w, acc);
                        e = rel_diff(g1, g2, ni, 1.0);
                        CHECK(e < 1e-6,
                              "depthwise data gradient fast vs reference %.2e (C %d, k %d, stride "
                              "%d, acc %d)",
                              e, C, k, stride, acc);
                    }
                    float *dw1 = randn(&r, (size_t)C * k * k, 1.0f),
                          *dw2 = malloc(sizeof(float) * C * k * k);
                    memcpy(dw2, dw1, sizeof(float) * C * k * k);
                    conv2d_backward_weight_cpu(&ops_cpu, &cfg, dw1, NULL, tensor_f32(dy, out),
                                               tensor_f32(x, in), ws);
                    depthwise_backward_weight_any(&cfg, &q, dw2, tensor_f32(dy, out),
                                                  tensor_f32(x, in));
                    e = rel_diff(dw1, dw2, (size_t)C * k * k, 1.0);
                    CHECK(e < 2e-7,
                          "depthwise weight gradient fast vs reference %.2e (C %d, k %d, stride "
                          "%d)",
                          e, C, k, stride);
                    free(x);
                    free(w);
                    free(b);
                    free(dy);
                    free(ws);
                    free(y1);
                    free(y2);
                    free(d0);
                    free(g1);
                    free(g2);
                    free(dw1); free(dw2);
                }
}

#ifdef SEGNET_CUDA
// cublasGemmEx as the convs use it (here the emulator's; on a GPU the library's):
// column-major with op T on A, every type combination cuBLAS documents for
// CUBLAS_COMPUTE_32F, beta = 0 not reading C (it starts as NaN), beta = 1 adding
// into C, fp32 accumulation with one rounding of a 16-bit C, and refusal of
// combinations cuBLAS does not support.
static cublasStatus_t cu_gemm_2x2x3(cublasHandle_t h, DType ab, DType ct, const float *a,
                                    const float *b, const float *c0, float beta, float *c_out) {
    static const cudaDataType T[3] = {CUDA_R_32F, CUDA_R_16F, CUDA_R_16BF};
    Ops *o = cu_ops();
    CuPair A = cu_pair(a, shape4(1, 1, 1, 6), ab), B = cu_pair(b, shape4(1, 1, 1, 6), ab);
    CuPair C = cu_pair(c0, shape4(1, 1, 1, 4), ct);
    const float alpha = 1.0f;
    // C (2×2) = op(A)·B, A stored 3×2 (lda 3) and transposed, B 3×2 (ldb 3)
    cublasStatus_t s = cublasGemmEx(h, CUBLAS_OP_T, CUBLAS_OP_N, 2, 2, 3, &alpha, A.gpu.data, T[ab],
                                    3, B.gpu.data, T[ab], 3, &beta, C.gpu.data, T[ct], 2,
                                    CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    o->synchronize(o);
    float *r = cu_to_host(C.gpu.data, 4, ct);
    memcpy(c_out, r, sizeof(float) * 4);
    free(r);
    cu_pair_free(&A); cu_pair_free(&B); cu_pair_free(&C);
    return s;
}
TEST(cuda_gemm_ex_types) {
    cu_ops();
    cublasHandle_t h;
    CHECK(cublasCreate(&h) == CUBLAS_STATUS_SUCCESS, "cublasCreate");
    // op(A) = [[1,2,3],[4,5,6]], B columns (1,0,-1), (2,1,0): C = [[-2,4],[-2,13]], column-major
    const float a[6] = {1, 2, 3, 4, 5, 6}, b[6] = {1, 0, -1, 2, 1, 0}, c0[4] = {0.5f, 0.25f, 1, 2};
    const float want0[4] = {-2, -2, 4, 13}, want1[4] = {-1.5f, -1.75f, 5, 15};
    const DType combos[5][2] = {{DT_F32, DT_F32},
                                {DT_F16, DT_F16},
                                {DT_F16, DT_F32},
                                {DT_BF16, DT_BF16},
                                {DT_BF16, DT_F32}};
    float c[4];
    for (int i = 0; i < 5; i++) {
        DType ab = combos[i][0], ct = combos[i][1];
        CHECK(cu_gemm_2x2x3(h, ab, ct, a, b, NULL, 0.0f, c) == CUBLAS_STATUS_SUCCESS,
              "%s x %s -> %s accepted", DT_NAME[ab], DT_NAME[ab], DT_NAME[ct]);
        CHECK(!memcmp(c, want0, sizeof c), "%s -> %s, beta 0: %g %g %g %g", DT_NAME[ab],
              DT_NAME[ct], c[0], c[1], c[2], c[3]);
        cu_gemm_2x2x3(h, ab, ct, a, b, c0, 1.0f, c);
        CHECK(!memcmp(c, want1, sizeof c), "%s -> %s, beta 1: %g %g %g %g", DT_NAME[ab],
              DT_NAME[ct], c[0], c[1], c[2], c[3]);
    }
    // 1 + 2^-8 + 2^-9 summed in fp32 and rounded once to bf16 is 1 + 2^-7; summed
    // in bf16 it would stay 1 (1 + 2^-8 ties to even)
    const float a2[6] = {1, 0x1p-8f, 0x1p-9f, 0, 0, 0}, b2[6] = {1, 1, 1, 0, 0, 0};
    cu_gemm_2x2x3(h, DT_BF16, DT_BF16, a2, b2, NULL, 0.0f, c);
    CHECK(c[0] == 1.0f + 0x1p-7f, "bf16 output rounded once from fp32: got %.9g", c[0]);
    // combinations cuBLAS does not support with CUBLAS_COMPUTE_32F
    Ops *o = cu_ops();
    void *m = o->alloc(o, 64);
    const float alpha = 1.0f, beta = 0.0f;
    const cudaDataType bad[3][3] = {{CUDA_R_16F, CUDA_R_16BF, CUDA_R_32F},
                                    {CUDA_R_32F, CUDA_R_32F, CUDA_R_16F},
                                    {CUDA_R_16BF, CUDA_R_16BF, CUDA_R_16F}};
    for (int i = 0; i < 3; i++)
        CHECK(cublasGemmEx(h, CUBLAS_OP_N, CUBLAS_OP_N, 2, 2, 2, &alpha, m, bad[i][0], 2, m,
                           bad[i][1], 2, &beta, m, bad[i][2], 2, CUBLAS_COMPUTE_32F,
                           CUBLAS_GEMM_DEFAULT) == CUBLAS_STATUS_NOT_SUPPORTED,
              "type combination %d refused", i);
    o->free(o, m);
    cublasDestroy(h);
}

// The cuda_conv_ tests: every lowering of kernels.cu (pointwise GEMM; im2col + GEMM in
// whole-image chunks and in bands of rows; grouped; depthwise kernels) against
// ops_cpu on the same storage-rounded inputs.
//
// Error bound, per element, derived rather than tuned: an output is a sum of
// T terms t_i (T per op below) plus what is added into. Both backends sum in
// fp32 in different orders (the CPU's weight and bias gradients in fp64), so
// each is within γ_T·S of the exact sum, S = Σ|t_i| (+ the |value| added into),
// and they differ by at most 2T·2^-24·S. With fp16/bf16 activations the GPU
// GEMMs use weights rounded to the storage type (unit roundoff u = 2^-11 for
// fp16, 2^-8 for bf16): that moves the sum by at most u·S (forward and
// backward-data of GEMM convs; depthwise kernels and weight gradients use no
// rounded weights). A 16-bit output is then rounded once on each side, which
// adds at most u·|cpu| + u·|gpu| ≈ 2u·|cpu|, plus twice the absolute error η of
// rounding a subnormal (fp16: half its spacing, 2^-25; bf16 has fp32's range). So
//     |gpu - cpu| <= (2T·2^-24 + u_w)·S + 2·u_out·|cpu| + 2·η
// with T = kh·kw·Cin/groups + 1 (forward, with the bias), kh·kw·Cout/groups + 1
// (backward data, with the accumulated din), N·OH·OW + 1 (weight and bias
// gradients, with the value added into); S is computed by the CPU op on |x|,
// |w|, |b| (|dout|, |din|...), i.e. the sum of absolute terms per element.
// The measured worst relative error max|gpu - cpu| / max|cpu| per op and
// precision is printed with -v.

typedef struct {
    const char *label;
    Shape in;
    int cout, k, stride, groups;
    PadMode pad;
} CuConvCase;

static double g_conv_worst[4][3];  // [forward, backward data, backward weight, bias][dtype]

static float dtype_unit_roundoff(DType dt) {
    return dt == DT_F16 ? 0x1p-11f : dt == DT_BF16 ? 0x1p-8f : 0.0f;
}
static double dtype_subnormal_error(DType dt) {
    return dt == DT_F16 ? 0x1p-25 : dt == DT_BF16 ? 0x1p-134 : 0.0;
}
static float *abs_copy(const float *v, size_t n) {
    float *a = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) a[i] = fabsf(v[i]);
    return a;
}
// the values a tensor holds, as floats (host copy)
static float *cu_host_values(Tensor t) {
    size_t n = shape_numel(t.shape);
    float *f = malloc(sizeof(float) * (n ? n : 1));
    for (size_t i = 0; i < n; i++) f[i] = ld(t, i);
    return f;
}
// checks gpu against cpu with the bound above; S = sum of absolute terms; returns the relative
// error
static double cu_conv_compare(const char *what, const char *label, int op, DType dt,
                              const float *gpu, const float *cpu, const float *S, size_t n,
                              size_t terms, float u_w, DType out) {
    const double rel = 2.0 * terms * 0x1p-24 + u_w, u_out = dtype_unit_roundoff(out),
                 eta = dtype_subnormal_error(out);
    size_t bad = 0, first = 0;
    for (size_t i = 0; i < n; i++) {
        double bound = rel * S[i] + 2.0 * u_out * fabs(cpu[i]) + 2.0 * eta;
        if (!(fabs((double)gpu[i] - cpu[i]) <= bound)) { if (!bad++) first = i; }
    }
    CHECK(!bad,
          "%s %s %s: %zu of %zu elements outside the bound, e.g. [%zu] gpu %.9g cpu %.9g S %.3g",
          label, what, DT_NAME[dt], bad, n, first, gpu[first], cpu[first], S[first]);
    double e = cu_rel_err(gpu, cpu, n, 1e-30);
    if (e > g_conv_worst[op][dt]) g_conv_worst[op][dt] = e;
    return e;
}

static void cuda_conv_case(const CuConvCase *tc, DType dt, int bias, Rng *r) {
    Ops *o = cu_ops();
    ConvCfg cfg = {0};
    cfg.cin = tc->in.c; cfg.cout = tc->cout; cfg.kh = cfg.kw = tc->k; cfg.stride = tc->stride;
    cfg.groups = tc->groups; cfg.pad = tc->pad; cfg.has_bias = bias;
    ConvGeom q;
    snCheck(conv_geom_of(&cfg, tc->in, &q), "test case %s does not fit", tc->label);
    const Shape in = tc->in, os = shape4(q.N, q.OH, q.OW, q.Cout);
    const size_t nin = shape_numel(in), nout = shape_numel(os), nw = (size_t)q.Cout * q.K,
                 M = (size_t)q.N * q.P;
    const int depthwise = conv_is_depthwise(&cfg);
    const float u_w = depthwise ? 0.0f : dtype_unit_roundoff(dt);
    float *x = randn(r, nin, 1.0f), *w = randn(r, nw, 1.0f / sqrtf((float)q.K)),
          *b = randn(r, q.Cout, 0.5f);
    float *dy = randn(r, nout, 1.0f), *din0 = randn(r, nin, 1.0f), *dw0 = randn(r, nw, 1.0f),
          *db0 = randn(r, q.Cout, 1.0f);
    CuPair X = cu_pair(x, in, dt), Y = cu_pair(NULL, os, dt), DY = cu_pair(dy, os, dt);
    // the inputs as the ops see them (rounded to dt), and their absolute values for S
    float *xr = cu_host_values(X.cpu), *dyr = cu_host_values(DY.cpu);
    float *ax = abs_copy(xr, nin), *aw = abs_copy(w, nw), *ab = abs_copy(b, q.Cout),
          *ady = abs_copy(dyr, nout);
    float *w_d = cu_floats(w, nw), *b_d = cu_floats(b, q.Cout);
    const size_t cws_f32 = conv2d_workspace_cpu(&ops_cpu, &cfg, in, DT_F32),
                 cws_dt = conv2d_workspace_cpu(&ops_cpu, &cfg, in, dt);
    // the ops in dt, the bounds S in fp32
    void *cws = malloc((cws_f32 > cws_dt ? cws_f32 : cws_dt) + 1);
    // the GPU workspace: exactly conv2d_workspace bytes, then a guard, both filled
    // with 0xff bytes (NaN), so reading unwritten workspace shows, and writes past the end too
    const size_t ws_bytes = o->conv2d_workspace(o, &cfg, in, dt), guard = 256;
    unsigned char *gws = o->alloc(o, ws_bytes + guard), *h = malloc(ws_bytes + guard);
    memset(h, 0xff, ws_bytes + guard);
    o->upload(o, gws, h, ws_bytes + guard);
    float *S =
            malloc(sizeof(float) * (nin > nout ? (nin > nw ? nin : nw) : (nout > nw ? nout : nw)));

    // forward
    ops_cpu.conv2d_forward(&ops_cpu, &cfg, Y.cpu, X.cpu, w, NULL, bias ? b : NULL, cws);
    o->conv2d_forward(o, &cfg, Y.gpu, X.gpu, w_d, NULL, bias ? b_d : NULL, gws);
    ops_cpu.conv2d_forward(&ops_cpu, &cfg, tensor_f32(S, os), tensor_f32(ax, in), aw, NULL,
                           bias ? ab : NULL, cws);
    float *yc = cu_host_values(Y.cpu), *yg = cu_to_host(Y.gpu.data, nout, dt);
    cu_conv_compare("forward", tc->label, 0, dt, yg, yc, S, nout, (size_t)q.K + 1, u_w, dt);
    free(yc); free(yg);
    // the weights cast by the caller (a net's params_cast): the same bits as cast here
    if (dt != DT_F32) {
        void *w_cast = o->alloc(o, nw * dtype_size(dt));
        o->copy(o, tensor(w_cast, shape4(1, 1, 1, (int)nw), dt),
                tensor_f32(w_d, shape4(1, 1, 1, (int)nw)), 0);
        CuPair Y2 = cu_pair(NULL, os, dt), DX1 = cu_pair(NULL, in, dt), DX2 = cu_pair(NULL, in, dt);
        o->conv2d_forward(o, &cfg, Y2.gpu, X.gpu, w_d, w_cast, bias ? b_d : NULL, gws);
        o->conv2d_backward_data(o, &cfg, DX1.gpu, DY.gpu, w_d, NULL, 0, gws);
        o->conv2d_backward_data(o, &cfg, DX2.gpu, DY.gpu, w_d, w_cast, 0, gws);
        float *a = cu_to_host(Y.gpu.data, nout, dt), *b2 = cu_to_host(Y2.gpu.data, nout, dt);
        float *c = cu_to_host(DX1.gpu.data, nin, dt), *d = cu_to_host(DX2.gpu.data, nin, dt);
        CHECK(!memcmp(a, b2, sizeof(float) * nout) && !memcmp(c, d, sizeof(float) * nin),
              "conv %s %s: with the caller's cast weights the outputs differ", tc->label,
              DT_NAME[dt]);
        free(a); free(b2); free(c); free(d);
        cu_pair_free(&Y2); cu_pair_free(&DX1); cu_pair_free(&DX2);
        o->free(o, w_cast);
    }

    // backward data, overwrite (din starts as NaN) and accumulate (din starts finite)
    for (int acc = 0; acc < 2; acc++) {
        CuPair DX = cu_pair(acc ? din0 : NULL, in, dt);
        ops_cpu.conv2d_backward_data(&ops_cpu, &cfg, DX.cpu, DY.cpu, w, NULL, acc, cws);
        o->conv2d_backward_data(o, &cfg, DX.gpu, DY.gpu, w_d, NULL, acc, gws);
        float *dx_old = abs_copy(din0, nin);  // |din| as stored: round through dt
        for (size_t i = 0; i < nin; i++) dx_old[i] = fabsf(dtype_round(dt, dx_old[i]));
        ops_cpu.conv2d_backward_data(&ops_cpu, &cfg, tensor_f32(S, in), tensor_f32(ady, os), aw,
                                     NULL, 0, cws);
        if (acc) for (size_t i = 0; i < nin; i++) S[i] += dx_old[i];
        float *c = cu_host_values(DX.cpu), *g = cu_to_host(DX.gpu.data, nin, dt);
        cu_conv_compare(acc ? "backward data (accumulate)" : "backward data", tc->label, 1, dt, g,
                        c, S, nin, (size_t)tc->k * tc->k * (q.Cout / cfg.groups) + 1, u_w, dt);
        free(c); free(g); free(dx_old);
        cu_pair_free(&DX);
    }

    // backward weight and bias, added into random values; then the bias alone (dweight not wanted)
    float *dw_c = malloc(sizeof(float) * nw), *db_c = malloc(sizeof(float) * q.Cout);
    memcpy(dw_c, dw0, sizeof(float) * nw); memcpy(db_c, db0, sizeof(float) * q.Cout);
    float *dw_d = cu_floats(dw0, nw), *db_d = cu_floats(db0, q.Cout);
    ops_cpu.conv2d_backward_weight(&ops_cpu, &cfg, dw_c, bias ? db_c : NULL, DY.cpu, X.cpu, cws);
    o->conv2d_backward_weight(o, &cfg, dw_d, bias ? db_d : NULL, DY.gpu, X.gpu, gws);
    for (size_t i = 0; i < nw; i++) S[i] = fabsf(dw0[i]);
    ops_cpu.conv2d_backward_weight(&ops_cpu, &cfg, S, NULL, tensor_f32(ady, os), tensor_f32(ax, in),
                                   cws);
    float *g = cu_to_host(dw_d, nw, DT_F32);
    cu_conv_compare("backward weight", tc->label, 2, dt, g, dw_c, S, nw, M + 1, 0.0f, DT_F32);
    free(g);
    if (bias) {
        for (int c = 0; c < q.Cout; c++) S[c] = fabsf(db0[c]);
        ops_cpu.conv2d_backward_weight(&ops_cpu, &cfg, NULL, S, tensor_f32(ady, os),
                                       tensor_f32(ax, in), cws);
        g = cu_to_host(db_d, q.Cout, DT_F32);
        cu_conv_compare("bias gradient", tc->label, 3, dt, g, db_c, S, q.Cout, M + 1, 0.0f, DT_F32);
        free(g);
        ops_cpu.conv2d_backward_weight(&ops_cpu, &cfg, NULL, db_c, DY.cpu, X.cpu, cws);
        o->conv2d_backward_weight(o, &cfg, NULL, db_d, DY.gpu, X.gpu, gws);
        for (int c = 0; c < q.Cout; c++) S[c] = S[c] * 2.0f;  // two sums added into db0
        g = cu_to_host(db_d, q.Cout, DT_F32);
        cu_conv_compare("bias gradient, no dweight", tc->label, 3, dt, g, db_c, S, q.Cout,
                        2 * M + 1, 0.0f, DT_F32);
        free(g);
    }

    // the workspace: nothing written past conv2d_workspace, and the last bytes
    // written by some op (the size is what the ops use, not more)
    o->download(o, h, gws, ws_bytes + guard);
    size_t past = 0;
    for (size_t i = ws_bytes; i < ws_bytes + guard; i++) past += h[i] != 0xff;
    CHECK(past == 0, "%s %s: %zu bytes written past the %zu-byte workspace", tc->label, DT_NAME[dt],
          past, ws_bytes);
    if (ws_bytes) {
        int used = 0;
        for (size_t i = ws_bytes - 4; i < ws_bytes; i++) used |= h[i] != 0xff;
        CHECK(used, "%s %s: no op wrote the last bytes of its %zu-byte workspace", tc->label,
              DT_NAME[dt], ws_bytes);
    }
    free(h);

    o->free(o, dw_d); o->free(o, db_d); o->free(o, w_d); o->free(o, b_d); o->free(o, gws);
    cu_pair_free(&X); cu_pair_free(&Y); cu_pair_free(&DY);
    free(x); free(w); free(b); free(dy); free(din0); free(dw0); free(db0); free(xr); free(dyr);
    free(ax); free(aw); free(ab); free(ady); free(cws); free(S); free(dw_c); free(db_c);
}

// each case in fp32, fp16, bf16, with and without bias; GEMM convs by both
// paths: the implicit-GEMM kernels, and the reference (SEGNET_CONV=gemm:
// im2col + cuBLAS) with the chunk budget as it is, at 1 byte (every chunk one
// output row, every backward band one input row) and at 2 KiB (a few rows,
// or whole images)
// runs: the implicit GEMMs at their own tiles (the narrow ones for these few
// channels and pixels) and forced to the wide one,
// then (chunked) the im2col path at three chunk budgets
static void cuda_conv_cases(const CuConvCase *cases, size_t n, int chunked) {
    Rng r; rng_seed(&r, 91);
    const size_t saved = cuda_conv_chunk_bytes, budgets[3] = {saved, 1, 2048};
    const int tiles[2] = {0, IG_TILE_WIDE};
    memset(g_conv_worst, 0, sizeof g_conv_worst);
    for (size_t i = 0; i < n; i++)
        for (int run = 0; run < (chunked ? 5 : 2); run++) {
            cuda_conv_implicit = run < 2;
            cuda_conv_tile = run < 2 ? tiles[run] : 0;
            cuda_conv_chunk_bytes = budgets[run < 2 ? 0 : run - 2];
            for (int dt = 0; dt < 3; dt++)
                for (int bias = 0; bias < 2; bias++) cuda_conv_case(&cases[i], (DType)dt, bias, &r);
        }
    cuda_conv_chunk_bytes = saved;
    cuda_conv_implicit = 1;
    cuda_conv_tile = 0;
    if (g_verbose) {
        static const char *const OP[4] = {"forward", "backward data", "backward weight",
                                          "bias gradient"};
        for (int op = 0; op < 4; op++)
            printf("    worst relative error %-16s fp32 %.2e  fp16 %.2e  bf16 %.2e\n", OP[op],
                   g_conv_worst[op][0], g_conv_worst[op][1], g_conv_worst[op][2]);
    }
}

TEST(cuda_conv_pointwise) {
    static const CuConvCase cases[] = {
        {"1x1 s1 (one GEMM)", {2, 7, 9, 5}, 13, 1, 1, 1, PAD_SAME},
        {"1x1 s1, 13 -> 3", {2, 5, 6, 13}, 3, 1, 1, 1, PAD_SYMMETRIC},
        {"dense layer (N,1,1,C)", {2, 1, 1, 13}, 5, 1, 1, 1, PAD_SAME},
        {"1x1 s2 same", {2, 7, 9, 5}, 3, 1, 2, 1, PAD_SAME},
        {"1x1 s2 symmetric", {2, 5, 6, 3}, 4, 1, 2, 1, PAD_SYMMETRIC},
    };
    cuda_conv_cases(cases, sizeof cases / sizeof cases[0], 1);
}
TEST(cuda_conv_dense) {
    static const CuConvCase cases[] = {
        {"3x3 s1 same", {2, 7, 9, 3}, 5, 3, 1, 1, PAD_SAME},
        {"3x3 s1 symmetric", {2, 5, 6, 5}, 3, 3, 1, 1, PAD_SYMMETRIC},
        {"3x3 s2 same", {2, 7, 9, 3}, 5, 3, 2, 1, PAD_SAME},
        {"3x3 s2 symmetric", {2, 5, 6, 5}, 4, 3, 2, 1, PAD_SYMMETRIC},
        {"5x5 s1 same", {2, 7, 9, 3}, 4, 5, 1, 1, PAD_SAME},
        {"5x5 s2 symmetric", {2, 7, 6, 2}, 3, 5, 2, 1, PAD_SYMMETRIC},
        // 646 output pixels: several pixel tiles, and the implicit-GEMM weight
        // gradient in 3 parts added by the last block; 16-byte chunks (8 channels) and not
        {"3x3 s1 same, 646 pixels, 8 -> 16", {2, 17, 19, 8}, 16, 3, 1, 1, PAD_SAME},
        {"3x3 s1 symmetric, 646 pixels, 3 -> 5", {2, 17, 19, 3}, 5, 3, 1, 1, PAD_SYMMETRIC},
    };
    cuda_conv_cases(cases, sizeof cases / sizeof cases[0], 1);
}
// The three tiles of the implicit-GEMM convs (kernels.cu): the forward and
// backward data give the same bits with each (every output's sum runs over k in
// one order), for channel counts of one narrow tile, two with a partial one,
// and three, over partial row tiles, at strides 1 and 2; the weight gradient,
// split in other parts, agrees to the sums' rounding (checked against the CPU
// in cuda_conv_dense, wide and narrow). And the blocks per SM that the tile
// choice and the split assume are the build's, by its registers and shared
// memory (on a GPU: the driver's occupancy).
TEST(cuda_conv_tiles) {
    static const char *const DTYPE_NAMES[3] = {"fp32", "fp16", "bf16"};
    static const char *const TILE_NAMES[4] = {"", "128x64", "128x32", "64x32"};
    Ops *o = cu_ops();
    for (int dt = 1; dt < 3; dt++)
        for (int tile = IG_TILE_WIDE; tile <= IG_TILE_SMALL; tile++)
            for (int pass = 0; pass < (tile == IG_TILE_SMALL ? 2 : 3); pass++)
                for (int vec = 0; vec < 2; vec++) {
                    const int got = cuda_conv_blocks_per_sm(tile, pass, vec, (DType)dt),
                              assumed = cuda_conv_assumed_blocks_per_sm(tile, pass, vec);
                    CHECK(got == assumed, "%s %s pass %d%s: %d blocks per SM, assumed %d",
                          DTYPE_NAMES[dt], TILE_NAMES[tile], pass, vec ? ", vector kernel" : "",
                          got, assumed);
                }
    Rng r;
    rng_seed(&r, 93);
    const struct {
        Shape in;
        int cout, stride;
    } cases[] = {{{2, 9, 11, 16}, 24, 1}, {{2, 9, 11, 40}, 40, 2}, {{1, 13, 7, 8}, 96, 1}};
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        for (int dt = 0; dt < 3; dt++) {
            ConvCfg cfg = {0};
            cfg.cin = cases[i].in.c;
            cfg.cout = cases[i].cout;
            cfg.kh = cfg.kw = 3;
            cfg.stride = cases[i].stride;
            cfg.groups = 1;
            cfg.pad = PAD_SAME;
            cfg.has_bias = 1;
            ConvGeom q;
            snCheck(conv_geom_of(&cfg, cases[i].in, &q), "case %zu does not fit", i);
            const Shape os = shape4(q.N, q.OH, q.OW, q.Cout);
            const size_t nin = shape_numel(cases[i].in), nout = shape_numel(os),
                         nw = (size_t)q.Cout * q.K;
            float *x = randn(&r, nin, 1.0f), *dy = randn(&r, nout, 1.0f),
                  *w = randn(&r, nw, 1.0f / sqrtf((float)q.K)), *b = randn(&r, q.Cout, 0.5f);
            CuPair X = cu_pair(x, cases[i].in, (DType)dt), DY = cu_pair(dy, os, (DType)dt);
            float *w_d = cu_floats(w, nw), *b_d = cu_floats(b, q.Cout);
            const size_t es = dtype_size((DType)dt);
            unsigned char *host[4][2];  // [tile][forward, backward data]
            for (int t = IG_TILE_WIDE; t <= IG_TILE_SMALL; t++) {
                cuda_conv_tile = t;
                const size_t ws_bytes = o->conv2d_workspace(o, &cfg, cases[i].in, (DType)dt);
                void *ws = o->alloc(o, ws_bytes + 1);
                Tensor y = tensor(o->alloc(o, nout * es), os, (DType)dt),
                       dx = tensor(o->alloc(o, nin * es), cases[i].in, (DType)dt);
                o->conv2d_forward(o, &cfg, y, X.gpu, w_d, NULL, b_d, ws);
                o->conv2d_backward_data(o, &cfg, dx, DY.gpu, w_d, NULL, 0, ws);
                host[t][0] = malloc(nout * es);
                host[t][1] = malloc(nin * es);
                o->download(o, host[t][0], y.data, nout * es);
                o->download(o, host[t][1], dx.data, nin * es);
                o->free(o, y.data);
                o->free(o, dx.data);
                o->free(o, ws);
            }
            for (int t = IG_TILE_NARROW; t <= IG_TILE_SMALL; t++) {
                CHECK(!memcmp(host[IG_TILE_WIDE][0], host[t][0], nout * es),
                      "case %zu %s: the forward differs between tiles %s and %s", i,
                      DTYPE_NAMES[dt], TILE_NAMES[IG_TILE_WIDE], TILE_NAMES[t]);
                CHECK(!memcmp(host[IG_TILE_WIDE][1], host[t][1], nin * es),
                      "case %zu %s: backward data differs between tiles %s and %s", i,
                      DTYPE_NAMES[dt], TILE_NAMES[IG_TILE_WIDE], TILE_NAMES[t]);
            }
            for (int t = IG_TILE_WIDE; t <= IG_TILE_SMALL; t++) {
                free(host[t][0]);
                free(host[t][1]);
            }
            o->free(o, w_d);
            o->free(o, b_d);
            cu_pair_free(&X);
            cu_pair_free(&DY);
            free(x);
            free(dy);
            free(w);
            free(b);
        }
    cuda_conv_tile = 0;
}

TEST(cuda_conv_grouped) {
    static const CuConvCase cases[] = {
        {"3x3 groups 2, 6 -> 4", {2, 5, 6, 6}, 4, 3, 1, 2, PAD_SAME},
        {"3x3 s2 groups 3, symmetric", {2, 7, 5, 6}, 3, 3, 2, 3, PAD_SYMMETRIC},
        {"1x1 groups 2", {2, 3, 5, 4}, 6, 1, 1, 2, PAD_SAME},
        {"depthwise multiplier 2 (GEMM)", {2, 5, 5, 3}, 6, 3, 1, 3, PAD_SAME},
    };
    cuda_conv_cases(cases, sizeof cases / sizeof cases[0], 1);
}
TEST(cuda_conv_depthwise) {
    static const CuConvCase cases[] = {
        {"depthwise 3x3 s1 same", {2, 7, 9, 13}, 13, 3, 1, 13, PAD_SAME},
        {"depthwise 3x3 s1 symmetric", {2, 5, 6, 5}, 5, 3, 1, 5, PAD_SYMMETRIC},
        {"depthwise 3x3 s2 same", {2, 7, 9, 13}, 13, 3, 2, 13, PAD_SAME},
        {"depthwise 3x3 s2 symmetric", {2, 5, 6, 5}, 5, 3, 2, 5, PAD_SYMMETRIC},
        {"depthwise 5x5 s1 same", {2, 5, 6, 5}, 5, 5, 1, 5, PAD_SAME},
        {"depthwise 5x5 s1 symmetric", {2, 7, 9, 3}, 3, 5, 1, 3, PAD_SYMMETRIC},
        {"depthwise 5x5 s2 same", {2, 7, 9, 13}, 13, 5, 2, 13, PAD_SAME},
        {"depthwise 5x5 s2 symmetric", {2, 5, 6, 5}, 5, 5, 2, 5, PAD_SYMMETRIC},
        // whole 16-byte vectors of channels (the vector kernels)
        {"depthwise 3x3 s1 same, 16 channels", {2, 7, 9, 16}, 16, 3, 1, 16, PAD_SAME},
        {"depthwise 3x3 s2 symmetric, 24 channels", {2, 9, 6, 24}, 24, 3, 2, 24, PAD_SYMMETRIC},
        {"depthwise 5x5 s2 same, 8 channels", {2, 7, 9, 8}, 8, 5, 2, 8, PAD_SAME},
        {"depthwise 3x3 s1 symmetric, 12 channels", {1, 6, 5, 12}, 12, 3, 1, 12, PAD_SYMMETRIC},
        // 1,152 output pixels of 512 channels (4 channel tiles): 5 parts of 256 pixels would be
        // 20 blocks; the weight gradient takes 116 parts of 10 (464 blocks, 0.88 of a wave)
        {"depthwise 3x3 s1 same, 512 channels in 116 parts", {2, 24, 24, 512}, 512, 3, 1, 512,
         PAD_SAME},
        // over 256 output pixels: the weight gradient in 3 parts, added by the last block
        {"depthwise 3x3 s1 same, 646 pixels, 16 channels", {2, 17, 19, 16}, 16, 3, 1, 16, PAD_SAME},
        {"depthwise 5x5 s1 same, 646 pixels", {2, 17, 19, 5}, 5, 5, 1, 5, PAD_SAME},
    };
    cuda_conv_cases(cases, sizeof cases / sizeof cases[0], 0);
}

// Every k×k conv that is neither pointwise nor depthwise in the model builders
// (both paddings of the EfficientNetV2s; the U-Nets' encoders and decoders),
// deduplicated by configuration: the convs the implicit-GEMM kernels run in
// training. Returns how many were written (at most cap).
static int model_conv_cfgs(ConvCfg *out, int cap) {
    static const char *const models[] = {"effv2-s",      "effv2-m",      "effv2-l",
                                         "effv2-t",      "unet",         "unet-effv2-s",
                                         "unet-effv2-m", "unet-effv2-l", "unet-effv2-t"};
    int n = 0;
    for (size_t mi = 0; mi < sizeof models / sizeof models[0]; mi++)
        for (int pad = PAD_SAME; pad <= PAD_SYMMETRIC; pad++) {
            ModelCfg c = model_cfg_default();
            c.model = models[mi];
            c.classes = 4;
            c.batch = 1;
            c.height = c.width = 64;
            c.pad = (PadMode)pad;
            Graph g;
            graph_init(&g);
            snCheck(model_build(&g, &c) >= 0, "model %s: %s", models[mi], g.err);
            for (int i = 0; i < g.n_layers; i++) {
                const ConvCfg *k = &g.layers[i].conv;
                if (g.layers[i].kind != LAYER_CONV || conv_is_pointwise(k) || conv_is_depthwise(k))
                    continue;
                int seen = 0;
                for (int j = 0; j < n && !seen; j++) seen = !memcmp(&out[j], k, sizeof *k);
                if (!seen && n < cap) out[n++] = *k;
            }
            graph_free(&g);
        }
    return n;
}

// The forward and backward (data, weight) of every conv of model_conv_cfgs,
// in fp32, fp16 and bf16 by turns (the implicit-GEMM kernels: tensor cores in
// 16 bits, the SIMT product in fp32), on a 2×5×7 input (one partial pixel tile; both paddings'
// edges; stride 2's four
// phases of unequal sizes), with and without bias, overwriting and
// accumulating, against the CPU op on the same rounded inputs with
// cu_conv_compare's bound (fp32 sums of K + 1 terms, weights rounded once to
// the storage type).
SLOW_TEST(cuda_conv_model_shapes) {
    ConvCfg cfgs[128];
    const int n = model_conv_cfgs(cfgs, 128);
    CHECK(n >= 40 && n < 128,
          "model_conv_cfgs found %d convs, expected the 62 of the models (at least 40)", n);
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 17);
    memset(g_conv_worst, 0, sizeof g_conv_worst);
    for (int i = 0; i < n; i++) {
        ConvCfg cfg = cfgs[i];
        const DType dt = (DType)(i % 3);
        cfg.has_bias = i % 4 < 2;
        ConvGeom q;
        const Shape in = shape4(2, 5, 7, cfg.cin);
        snCheck(conv_geom_of(&cfg, in, &q), "model conv %d does not fit a 5x7 input", i);
        const Shape os = shape4(q.N, q.OH, q.OW, q.Cout);
        const size_t nin = shape_numel(in), nout = shape_numel(os), nw = (size_t)q.Cout * q.K;
        float *x = randn(&r, nin, 1.0f), *w = randn(&r, nw, 1.0f / sqrtf((float)q.K)),
              *b = randn(&r, q.Cout, 0.5f);
        CuPair X = cu_pair(x, in, dt), Y = cu_pair(NULL, os, dt);
        float *xr = cu_host_values(X.cpu), *ax = abs_copy(xr, nin), *aw = abs_copy(w, nw),
              *ab = abs_copy(b, q.Cout);
        float *w_d = cu_floats(w, nw), *b_d = cu_floats(b, q.Cout),
              *S = malloc(sizeof(float) * nout);
        const size_t cws_f32 = conv2d_workspace_cpu(&ops_cpu, &cfg, in, DT_F32),
                     cws_dt = conv2d_workspace_cpu(&ops_cpu, &cfg, in, dt);
        const size_t gws = o->conv2d_workspace(o, &cfg, in, dt);
        // the ops in dt, the bounds in fp32
        void *cw = malloc((cws_f32 > cws_dt ? cws_f32 : cws_dt) + 1), *gw = o->alloc(o, gws + 1);
        ops_cpu.conv2d_forward(&ops_cpu, &cfg, Y.cpu, X.cpu, w, NULL, cfg.has_bias ? b : NULL, cw);
        o->conv2d_forward(o, &cfg, Y.gpu, X.gpu, w_d, NULL, cfg.has_bias ? b_d : NULL, gw);
        ops_cpu.conv2d_forward(&ops_cpu, &cfg, tensor_f32(S, os), tensor_f32(ax, in), aw, NULL,
                               cfg.has_bias ? ab : NULL, cw);
        float *yc = cu_host_values(Y.cpu), *yg = cu_to_host(Y.gpu.data, nout, dt);
        char label[96];
        snprintf(label, sizeof label, "model conv %d (cin %d cout %d %dx%d s%d pad %d)", i, cfg.cin,
                 cfg.cout, cfg.kh, cfg.kw, cfg.stride, (int)cfg.pad);
        cu_conv_compare("forward", label, 0, dt, yg, yc, S, nout, (size_t)q.K + 1,
                        dtype_unit_roundoff(dt), dt);
        free(yc); free(yg);

        // backward data, into NaN (every third conv: added into random values)
        const int acc = i % 3 == 0;
        float *dy = randn(&r, nout, 1.0f), *din0 = randn(&r, nin, 1.0f);
        CuPair DY = cu_pair(dy, os, dt), DX = cu_pair(acc ? din0 : NULL, in, dt);
        float *dyr = cu_host_values(DY.cpu), *ady = abs_copy(dyr, nout),
              *Sx = malloc(sizeof(float) * nin);
        ops_cpu.conv2d_backward_data(&ops_cpu, &cfg, DX.cpu, DY.cpu, w, NULL, acc, cw);
        o->conv2d_backward_data(o, &cfg, DX.gpu, DY.gpu, w_d, NULL, acc, gw);
        ops_cpu.conv2d_backward_data(&ops_cpu, &cfg, tensor_f32(Sx, in), tensor_f32(ady, os), aw,
                                     NULL, 0, cw);
        for (size_t e = 0; acc && e < nin; e++) Sx[e] += fabsf(dtype_round(dt, din0[e]));
        float *xc = cu_host_values(DX.cpu), *xg = cu_to_host(DX.gpu.data, nin, dt);
        cu_conv_compare(acc ? "backward data (accumulate)" : "backward data", label, 1, dt, xg, xc,
                        Sx, nin, (size_t)cfg.kh * cfg.kw * q.Coutg + 1, dtype_unit_roundoff(dt),
                        dt);
        free(xc); free(xg); free(din0); free(Sx);

        // backward weight, added into random values
        const size_t M = (size_t)q.N * q.P;
        float *dw0 = randn(&r, nw, 1.0f), *dw_c = malloc(sizeof(float) * nw),
              *Sw = malloc(sizeof(float) * nw);
        memcpy(dw_c, dw0, sizeof(float) * nw);
        float *dw_d = cu_floats(dw0, nw);
        ops_cpu.conv2d_backward_weight(&ops_cpu, &cfg, dw_c, NULL, DY.cpu, X.cpu, cw);
        o->conv2d_backward_weight(o, &cfg, dw_d, NULL, DY.gpu, X.gpu, gw);
        for (size_t e = 0; e < nw; e++) Sw[e] = fabsf(dw0[e]);
        ops_cpu.conv2d_backward_weight(&ops_cpu, &cfg, Sw, NULL, tensor_f32(ady, os),
                                       tensor_f32(ax, in), cw);
        float *wg = cu_to_host(dw_d, nw, DT_F32);
        cu_conv_compare("backward weight", label, 2, dt, wg, dw_c, Sw, nw, M + 1, 0.0f, DT_F32);
        free(wg); free(dw0); free(dw_c); free(Sw); free(dy); free(dyr); free(ady);
        o->free(o, dw_d);
        cu_pair_free(&DY); cu_pair_free(&DX);

        free(x); free(w); free(b); free(xr); free(ax); free(aw); free(ab); free(S); free(cw);
        o->free(o, w_d); o->free(o, b_d); o->free(o, gw);
        cu_pair_free(&X); cu_pair_free(&Y);
    }
    if (g_verbose)
        for (int op = 0; op < 3; op++)
            printf("    %d convs; worst relative error %-15s fp32 %.2e  fp16 %.2e  bf16 %.2e\n", n,
                   op == 0   ? "forward"
                   : op == 1 ? "backward data"
                             : "backward weight",
                   g_conv_worst[op][DT_F32], g_conv_worst[op][DT_F16], g_conv_worst[op][DT_BF16]);
}
#endif

// ----------------------------------------------------------------------------
// activations

// inputs bounded away from ReLU's kink: sign·(0.1 + |N(0,1)|)
static float *kink_free_input(size_t n, uint64_t seed) {
    Rng r; rng_seed(&r, seed);
    float *x = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) {
        float v = rng_normal(&r);
        x[i] = (v < 0 ? -1.0f : 1.0f) * (0.1f + fabsf(v));
    }
    return x;
}

TEST(act_grad) {
    Act acts[3] = {ACT_RELU, ACT_SILU, ACT_SIGMOID};
    float *xin = kink_free_input(2 * 3 * 5 * 3, 7);
    for (int i = 0; i < 3; i++) {
        Graph g; graph_init(&g);
        int x = graph_input(&g, shape4(2, 3, 5, 3));
        int y = graph_concat(&g, "cat", graph_act(&g, "act_a", x, acts[i]),
                             graph_act(&g, "act_b", x, acts[i]));
        GradOpts o = grad_opts();
        o.input = xin;
        note_worst(LAYER_ACT, graph_gradcheck(&g, y, o, &ops_cpu));
        graph_free(&g);
    }
    free(xin);
}

TEST(act_by_hand) {
    float x[4] = {-1.0f, 0.0f, 1.0f, 2.0f}, y[4];
    Tensor tx = tensor_f32(x, shape4(1, 1, 4, 1)), ty = tensor_f32(y, shape4(1, 1, 4, 1));
    ops_cpu.act_forward(&ops_cpu, ACT_RELU, ty, tx);
    CHECK(y[0] == 0 && y[1] == 0 && y[2] == 1 && y[3] == 2, "relu");
    ops_cpu.act_forward(&ops_cpu, ACT_SILU, ty, tx);
    CHECK_NEAR(y[2], 1.0 / (1.0 + exp(-1.0)), 1e-7, "silu(1)");
    CHECK_NEAR(y[0], -1.0 / (1.0 + exp(1.0)), 1e-7, "silu(-1)");
    ops_cpu.act_forward(&ops_cpu, ACT_SIGMOID, ty, tx);
    CHECK_NEAR(y[1], 0.5, 0, "sigmoid(0)");
    CHECK_NEAR(y[3], 1.0 / (1.0 + exp(-2.0)), 1e-7, "sigmoid(2)");
}

#ifdef SEGNET_CUDA
// y = act(x), dx (=|+=) dy·act'(x); exp as in batch norm: 8 fp32 roundings
TEST(cuda_act) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 83);
    // odd; whole 16-byte vectors
    const Shape shapes[2] = {shape4(2, 7, 5, 13), shape4(2, 7, 5, 16)};
    for (int si = 0; si < 2; si++)
    for (int dt = 0; dt < 3; dt++)
        for (int a = 0; a < 4; a++) {
            char what[64];
            const Shape s = shapes[si];
            const size_t n = shape_numel(s);
            float *xv = randn(&r, n, 3.0f), *dyv = randn(&r, n, 1.0f);
            CuPair x = cu_pair(xv, s, (DType)dt), dy = cu_pair(dyv, s, (DType)dt),
                   y = cu_pair(NULL, s, (DType)dt);
            ops_cpu.act_forward(&ops_cpu, (Act)a, y.cpu, x.cpu);
            o->act_forward(o, (Act)a, y.gpu, x.gpu);
            snprintf(what, sizeof what, "act_forward %s", ACT_NAME[a]);
            cu_expect(cu_pair_err(y), cu_tol((DType)dt, 8 * 0x1p-24), what, (DType)dt);
            for (int acc = 0; acc < 2; acc++) {
                CuPair dx = cu_dest(&r, s, (DType)dt, acc);
                ops_cpu.act_backward(&ops_cpu, (Act)a, dx.cpu, dy.cpu, x.cpu, acc);
                o->act_backward(o, (Act)a, dx.gpu, dy.gpu, x.gpu, acc);
                snprintf(what, sizeof what, "act_backward %s acc %d", ACT_NAME[a], acc);
                cu_expect(cu_pair_err(dx), cu_tol((DType)dt, 8 * 0x1p-24), what, (DType)dt);
                cu_pair_free(&dx);
            }
            cu_pair_free(&x); cu_pair_free(&dy); cu_pair_free(&y);
            free(xv); free(dyv);
        }
}
#endif

// ----------------------------------------------------------------------------
// squeeze-excitation: its pieces (global average pool, channel scale), then its gate

// squeeze-excitation as in MBConv: s = sigmoid(fc2(silu(fc1(gap(x))))), y = x·s
// (x feeds both the pool and the scale: accumulation through the SE branch)
TEST(se_grad) {
    Graph g; graph_init(&g);
    int x = graph_input(&g, shape4(2, 4, 3, 6));
    int p = graph_gap(&g, "se.pool", x);
    int h = graph_act(&g, "se.act", graph_conv(&g, "se.reduce", p, 2, 1, 1, 1, PAD_SAME, 1),
                      ACT_SILU);
    int s = graph_act(&g, "se.gate", graph_conv(&g, "se.expand", h, 6, 1, 1, 1, PAD_SAME, 1),
                      ACT_SIGMOID);
    int y = graph_scale(&g, "se.scale", x, s);
    double e = graph_gradcheck(&g, y, grad_opts(), &ops_cpu);
    note_worst(LAYER_GAP, e);
    note_worst(LAYER_SCALE, e);
    graph_free(&g);
    // the pooled tensor used directly as the scale (both inputs from one tensor's subgraph)
    graph_init(&g);
    x = graph_input(&g, shape4(2, 3, 3, 4));
    y = graph_scale(&g, "scale", x, graph_gap(&g, "pool", x));
    e = graph_gradcheck(&g, y, grad_opts(), &ops_cpu);
    note_worst(LAYER_GAP, e);
    note_worst(LAYER_SCALE, e);
    graph_free(&g);
}

// The squeeze-excitation gate (one layer, se_gate_*) against the four layers it
// replaces, run through the CPU's own ops (fc1: 1×1 conv + bias, SiLU, fc2,
// sigmoid; their backwards), fp32, N = 3, C = 24, S = 6. The fused op sums in
// fp64, the convs in fp32 over at most 24 terms of size ≤ 1: the two agree
// within 1e-5 of each tensor's largest value.
TEST(se_gate_matches_layers) {
    enum { N = 3, C = 24, S = 6 };
    Rng r; rng_seed(&r, 31);
    float *p = randn(&r, (size_t)N * C, 1.0f), *w1 = randn(&r, (size_t)S * C, 0.3f),
          *b1 = randn(&r, S, 0.3f);
    float *w2 = randn(&r, (size_t)C * S, 0.3f), *b2 = randn(&r, C, 0.3f),
          *ds = randn(&r, (size_t)N * C, 1.0f);
    const Shape sp = shape4(N, 1, 1, C), sz = shape4(N, 1, 1, S);
    const ConvCfg fc1 = {C, S, 1, 1, 1, 1, PAD_SAME, 1}, fc2 = {S, C, 1, 1, 1, 1, PAD_SAME, 1};
    float s_fused[N * C], z1[N * S], y1[N * S], z2[N * C], s_layers[N * C];
    float ws[4096];
    ops_cpu.se_gate_forward(&ops_cpu, tensor_f32(s_fused, sp), tensor_f32(p, sp), w1, b1, w2, b2, S,
                            ACT_SILU, ACT_SIGMOID);
    ops_cpu.conv2d_forward(&ops_cpu, &fc1, tensor_f32(z1, sz), tensor_f32(p, sp), w1, NULL, b1, ws);
    ops_cpu.act_forward(&ops_cpu, ACT_SILU, tensor_f32(y1, sz), tensor_f32(z1, sz));
    ops_cpu.conv2d_forward(&ops_cpu, &fc2, tensor_f32(z2, sp), tensor_f32(y1, sz), w2, NULL, b2,
                           ws);
    ops_cpu.act_forward(&ops_cpu, ACT_SIGMOID, tensor_f32(s_layers, sp), tensor_f32(z2, sp));
    CHECK(rel_diff(s_fused, s_layers, (size_t)N * C, 1e-30) < 1e-5,
          "se gate forward: %.3g from the layers",
          rel_diff(s_fused, s_layers, (size_t)N * C, 1e-30));
    // backward, into dp = 0.5 (accumulate) and zeroed parameter gradients
    float dp_f[N * C], dw1_f[S * C] = {0}, db1_f[S] = {0}, dw2_f[C * S] = {0}, db2_f[C] = {0};
    float dp_l[N * C], dw1_l[S * C] = {0}, db1_l[S] = {0}, dw2_l[C * S] = {0}, db2_l[C] = {0};
    float dz2[N * C], dy1[N * S], dz1[N * S];
    for (int i = 0; i < N * C; i++) dp_f[i] = dp_l[i] = 0.5f;
    ops_cpu.se_gate_backward(&ops_cpu, tensor_f32(dp_f, sp), tensor_f32(ds, sp), tensor_f32(p, sp),
                             w1, b1, w2, b2, S, ACT_SILU, ACT_SIGMOID, dw1_f, db1_f, dw2_f, db2_f,
                             1);
    ops_cpu.act_backward(&ops_cpu, ACT_SIGMOID, tensor_f32(dz2, sp), tensor_f32(ds, sp),
                         tensor_f32(z2, sp), 0);
    ops_cpu.conv2d_backward_weight(&ops_cpu, &fc2, dw2_l, db2_l, tensor_f32(dz2, sp),
                                   tensor_f32(y1, sz), ws);
    ops_cpu.conv2d_backward_data(&ops_cpu, &fc2, tensor_f32(dy1, sz), tensor_f32(dz2, sp), w2, NULL,
                                 0, ws);
    ops_cpu.act_backward(&ops_cpu, ACT_SILU, tensor_f32(dz1, sz), tensor_f32(dy1, sz),
                         tensor_f32(z1, sz), 0);
    ops_cpu.conv2d_backward_weight(&ops_cpu, &fc1, dw1_l, db1_l, tensor_f32(dz1, sz),
                                   tensor_f32(p, sp), ws);
    ops_cpu.conv2d_backward_data(&ops_cpu, &fc1, tensor_f32(dp_l, sp), tensor_f32(dz1, sz), w1,
                                 NULL, 1, ws);
    const struct { const char *name; const float *a, *b; size_t n;
    } pairs[5] = {{"dp", dp_f, dp_l, (size_t)N * C},
                  {"dW1", dw1_f, dw1_l, (size_t)S * C},
                  {"db1", db1_f, db1_l, S},
                  {"dW2", dw2_f, dw2_l, (size_t)C * S},
                  {"db2", db2_f, db2_l, C}};
    for (int k = 0; k < 5; k++)
        CHECK(rel_diff(pairs[k].a, pairs[k].b, pairs[k].n, 1e-30) < 1e-5,
              "se gate backward %s: %.3g from the layers", pairs[k].name,
              rel_diff(pairs[k].a, pairs[k].b, pairs[k].n, 1e-30));
    free(p); free(w1); free(b1); free(w2); free(b2); free(ds);
}

// Squeeze-excitation fp32 paths against the formulas in fp64 (per-image sums
// in fp64 in both: equal to fp32 rounding; products x·s: 1 rounding).
TEST(fast_se_vs_formula) {
    Rng r; rng_seed(&r, 83);
    Shape s = shape4(3, 5, 7, 37), p = shape4(3, 1, 1, 37);
    size_t n = shape_numel(s);
    float *x = randn(&r, n, 1.0f), *dy = randn(&r, n, 1.0f), *sc = randn(&r, 3 * 37, 1.0f),
          *dp = randn(&r, 3 * 37, 1.0f);
    float *y = malloc(sizeof(float) * n), *pool = malloc(sizeof(float) * 3 * 37),
          *ds = malloc(sizeof(float) * 3 * 37);
    double e_pool = 0, e_scale = 0, e_dx = 0, e_ds = 0, e_gapb = 0;
    ops_cpu.global_avg_pool_forward(&ops_cpu, tensor_f32(pool, p), tensor_f32(x, s));
    ops_cpu.channel_scale_forward(&ops_cpu, tensor_f32(y, s), tensor_f32(x, s), tensor_f32(sc, p));
    for (int k = 0; k < 3 * 37; k++) {
        int nn = k / 37, c = k % 37;
        double sx = 0, sdx = 0;
        for (int q = 0; q < 35; q++) {
            size_t i = ((size_t)nn * 35 + q) * 37 + c;
            sx += x[i];
            sdx += (double)dy[i] * x[i];
        }
        e_pool = fmax(e_pool, fabs(pool[k] - sx / 35));
        ds[k] = 0.5f;
        (void)sdx;
    }
    for (size_t i = 0; i < n; i++)
        e_scale = fmax(e_scale, fabs(y[i] - (double)x[i] * sc[i / (35 * 37) * 37 + i % 37]));
    for (int acc = 0; acc < 2; acc++) {
        for (size_t i = 0; i < n; i++) y[i] = 0.25f;
        for (int k = 0; k < 3 * 37; k++) ds[k] = 0.5f;
        ops_cpu.channel_scale_backward(&ops_cpu, tensor_f32(y, s), tensor_f32(ds, p),
                                       tensor_f32(dy, s), tensor_f32(x, s), tensor_f32(sc, p), acc,
                                       acc);
        for (size_t i = 0; i < n; i++)
            e_dx = fmax(e_dx, fabs(y[i] - (acc ? 0.25 : 0.0) -
                                   (double)dy[i] * sc[i / (35 * 37) * 37 + i % 37]));
        for (int k = 0; k < 3 * 37; k++) {
            double sdx = 0;
            for (int q = 0; q < 35; q++) {
                size_t i = ((size_t)(k / 37) * 35 + q) * 37 + k % 37;
                sdx += (double)dy[i] * x[i];
            }
            e_ds = fmax(e_ds, fabs(ds[k] - (acc ? 0.5 : 0.0) - sdx) / fmax(1.0, fabs(sdx)));
        }
        for (size_t i = 0; i < n; i++) y[i] = 0.25f;
        ops_cpu.global_avg_pool_backward(&ops_cpu, tensor_f32(y, s), tensor_f32(dp, p), acc);
        for (size_t i = 0; i < n; i++)
            e_gapb = fmax(e_gapb,
                          fabs(y[i] - (acc ? 0.25 : 0.0) - dp[i / (35 * 37) * 37 + i % 37] / 35.0));
    }
    CHECK(e_pool < 1e-6 && e_scale < 1e-6 && e_dx < 1e-6 && e_ds < 1e-6 && e_gapb < 1e-6,
          "SE fp32 paths vs formulas: pool %.1e scale %.1e dx %.1e ds %.1e pool backward %.1e",
          e_pool, e_scale, e_dx, e_ds, e_gapb);
    free(x); free(dy); free(sc); free(dp); free(y); free(pool); free(ds);
}

// The squeeze-excitation pieces of ops_cpu (kernels_cpu.c) against ops_ref's: the
// same fp64 sums over the pixels in the same order, and the same fp32
// products, so the same bits; except where a gradient is added to one already
// there (accumulate): the fast loop's a + b·c may be one fused multiply-add
// (the native build contracts it), fl(a + b·c), against the reference's
// fl(a + fl(b·c)), at most u·|b·c| + 2u·|result| apart (u = 2^-24), which
// 2^-23·(|b·c| + |result|) bounds.
TEST(fast_se_vs_ref) {
    Rng r; rng_seed(&r, 85);
    // a full channel block and a partial one
    const Shape s = shape4(2, 6, 5, 21), p = shape4(2, 1, 1, 21);
    const int C = s.c;
    const size_t n = shape_numel(s), np = shape_numel(p), HW = n / np;
    float *x = randn(&r, n, 1.0f), *dy = randn(&r, n, 1.0f), *sc = randn(&r, np, 1.0f),
          *dp = randn(&r, np, 1.0f);
    Ops *tables[2] = {&ops_cpu, &ops_ref};
    float *pool[2], *y[2], *dx[2][2], *ds[2][2], *dgap[2][2];  // [table] or [table][accumulate]
    for (int t = 0; t < 2; t++) {
        Ops *o = tables[t];
        pool[t] = malloc(sizeof(float) * np);
        y[t] = malloc(sizeof(float) * n);
        o->global_avg_pool_forward(o, tensor_f32(pool[t], p), tensor_f32(x, s));
        o->channel_scale_forward(o, tensor_f32(y[t], s), tensor_f32(x, s), tensor_f32(sc, p));
        for (int acc = 0; acc < 2; acc++) {
            dx[t][acc] = malloc(sizeof(float) * n);
            ds[t][acc] = malloc(sizeof(float) * np);
            dgap[t][acc] = malloc(sizeof(float) * n);
            for (size_t i = 0; i < n; i++) dx[t][acc][i] = dgap[t][acc][i] = 0.25f;
            for (size_t i = 0; i < np; i++) ds[t][acc][i] = 0.5f;
            o->channel_scale_backward(o, tensor_f32(dx[t][acc], s), tensor_f32(ds[t][acc], p),
                                      tensor_f32(dy, s), tensor_f32(x, s), tensor_f32(sc, p), acc,
                                      acc);
            o->global_avg_pool_backward(o, tensor_f32(dgap[t][acc], s), tensor_f32(dp, p), acc);
        }
    }
    // bits that differ where they must not; accumulated values beyond the bound
    size_t differ = 0, beyond = 0;
    for (size_t i = 0; i < np; i++)
        differ += memcmp(&pool[0][i], &pool[1][i], sizeof(float)) != 0 ||
                  memcmp(&ds[0][0][i], &ds[1][0][i], sizeof(float)) != 0 ||
                  memcmp(&ds[0][1][i], &ds[1][1][i], sizeof(float)) != 0;
    for (size_t i = 0; i < n; i++) {
        const size_t k = i / HW / C * C + i % C;  // (n, c) of element i
        differ += memcmp(&y[0][i], &y[1][i], sizeof(float)) != 0 ||
                  memcmp(&dx[0][0][i], &dx[1][0][i], sizeof(float)) != 0 ||
                  memcmp(&dgap[0][0][i], &dgap[1][0][i], sizeof(float)) != 0;
        const double pdx = fabs((double)dy[i] * sc[k]), pgap = fabs((double)dp[k] / (double)HW);
        beyond += fabs((double)dx[0][1][i] - dx[1][1][i]) > ldexp(pdx + fabs(dx[1][1][i]), -23) ||
                  fabs((double)dgap[0][1][i] - dgap[1][1][i]) >
                          ldexp(pgap + fabs(dgap[1][1][i]), -23);
    }
    CHECK(differ == 0 && beyond == 0,
          "squeeze-excitation pieces, ops_cpu against ops_ref: %zu values with other bits, %zu "
          "accumulated ones beyond the bound",
          differ, beyond);
    free(x); free(dy); free(sc); free(dp);
    for (int t = 0; t < 2; t++) {
        free(pool[t]); free(y[t]);
        for (int acc = 0; acc < 2; acc++) {
            free(dx[t][acc]);
            free(ds[t][acc]);
            free(dgap[t][acc]);
        }
    }
}

// ops_cpu's fp32 squeeze-excitation gate against ops_ref's: the same bits for
// s, dp (written and accumulated) and the weights' gradients (added into),
// with more squeezed channels than a vector and fewer, and C not a multiple
// of a vector.
TEST(fast_se_gate_vs_ref) {
    Rng r; rng_seed(&r, 88);
    const struct { int N, C, S; } cases[] = {{3, 37, 5}, {2, 70, 19}};
    for (int k = 0; k < 2; k++) {
        const int N = cases[k].N, C = cases[k].C, S = cases[k].S;
        const Shape ps = shape4(N, 1, 1, C);
        float *p = randn(&r, (size_t)N * C, 1.0f), *ds = randn(&r, (size_t)N * C, 1.0f);
        float *w1 = randn(&r, (size_t)S * C, 0.3f), *b1 = randn(&r, S, 0.3f);
        float *w2 = randn(&r, (size_t)C * S, 0.3f), *b2 = randn(&r, C, 0.3f);
        Ops *tables[2] = {&ops_cpu, &ops_ref};
        float *out[2][7];  // s, dp written, dp accumulated, dw1, db1, dw2, db2
        const size_t count[7] = {(size_t)N * C, (size_t)N * C, (size_t)N * C, (size_t)S * C,
                                 (size_t)S,     (size_t)C * S, (size_t)C};
        for (int t = 0; t < 2; t++) {
            Ops *o = tables[t];
            for (int j = 0; j < 7; j++) {
                out[t][j] = malloc(sizeof(float) * count[j]);
                for (size_t i = 0; i < count[j]; i++) out[t][j][i] = 0.125f * (float)(i % 7);
            }
            o->se_gate_forward(o, tensor_f32(out[t][0], ps), tensor_f32(p, ps), w1, b1, w2, b2, S,
                               ACT_SILU, ACT_SIGMOID);
            for (int acc = 0; acc < 2; acc++)
                o->se_gate_backward(o, tensor_f32(out[t][1 + acc], ps), tensor_f32(ds, ps),
                                    tensor_f32(p, ps), w1, b1, w2, b2, S, ACT_SILU, ACT_SIGMOID,
                                    out[t][3], out[t][4], out[t][5], out[t][6], acc);
        }
        const char *what[7] = {"s", "dp", "dp accumulated", "dW1", "db1", "dW2", "db2"};
        for (int j = 0; j < 7; j++) {
            size_t differ = 0;
            for (size_t i = 0; i < count[j]; i++)
                differ += memcmp(&out[0][j][i], &out[1][j][i], sizeof(float)) != 0;
            CHECK(differ == 0, "C %d, S %d: %s: ops_cpu and ops_ref differ in %zu of %zu values", C,
                  S, what[j], differ, count[j]);
        }
        for (int t = 0; t < 2; t++)
            for (int j = 0; j < 7; j++) free(out[t][j]);
        free(p); free(ds); free(w1); free(b1); free(w2); free(b2);
    }
}

#ifdef SEGNET_CUDA
// cases() with 4-channel lanes where the grid is small (the default), then with
// 16-byte lanes always (cuda_narrow_rows)
static void with_narrow_rows_both(void (*cases)(void)) {
    for (int narrow = 1; narrow >= 0; narrow--) {
        cuda_narrow_rows = narrow;
        cases();
    }
    cuda_narrow_rows = 1;
}
// pooling (fp64 sums: 4 fp32 roundings), its backward and the scale (one product:
// the same bits, CU_FMA with accumulate), the scale's ds (fp64 sums); dx or ds
// not wanted (NULL) in some cases
static void cuda_squeeze_excitation_cases(void) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 84);
    for (int si = 0; si < CU_NSHAPES; si++)
        for (int dt = 0; dt < 3; dt++) {
            const Shape s = CU_SHAPES[si], sp = shape4(s.n, 1, 1, s.c);
            const size_t n = shape_numel(s), np = shape_numel(sp);
            float *xv = randn(&r, n, 1.0f), *dyv = randn(&r, n, 1.0f), *sv = randn(&r, np, 1.0f),
                  *dpv = randn(&r, np, 1.0f);
            for (size_t i = 0; i < n; i++) xv[i] += 1.0f;
            CuPair x = cu_pair(xv, s, (DType)dt), dy = cu_pair(dyv, s, (DType)dt);
            CuPair sc = cu_pair(sv, sp, (DType)dt), dpool = cu_pair(dpv, sp, (DType)dt);
            CuPair pooled = cu_pair(NULL, sp, (DType)dt), y = cu_pair(NULL, s, (DType)dt);
            ops_cpu.global_avg_pool_forward(&ops_cpu, pooled.cpu, x.cpu);
            o->global_avg_pool_forward(o, pooled.gpu, x.gpu);
            cu_expect(cu_pair_err(pooled), cu_tol((DType)dt, 4 * 0x1p-24),
                      "global_avg_pool_forward", (DType)dt);
            ops_cpu.channel_scale_forward(&ops_cpu, y.cpu, x.cpu, sc.cpu);
            o->channel_scale_forward(o, y.gpu, x.gpu, sc.gpu);
            cu_expect(cu_pair_err(y), 0.0, "channel_scale_forward", (DType)dt);
            for (int acc = 0; acc < 2; acc++) {
                char what[64];
                CuPair dx = cu_dest(&r, s, (DType)dt, acc);
                ops_cpu.global_avg_pool_backward(&ops_cpu, dx.cpu, dpool.cpu, acc);
                o->global_avg_pool_backward(o, dx.gpu, dpool.gpu, acc);
                snprintf(what, sizeof what, "global_avg_pool_backward acc %d", acc);
                cu_expect(cu_pair_err(dx), acc ? cu_tol((DType)dt, CU_FMA) : 0.0, what, (DType)dt);
                cu_pair_free(&dx);
                // (dx, ds) wanted: both; dx only; ds only
                for (int want = 0; want < 3; want++) {
                    CuPair dxs = cu_dest(&r, s, (DType)dt, acc),
                           ds = cu_dest(&r, sp, (DType)dt, !acc);
                    Tensor dx_c = dxs.cpu, dx_g = dxs.gpu, ds_c = ds.cpu, ds_g = ds.gpu;
                    if (want == 2) dx_c.data = dx_g.data = NULL;
                    if (want == 1) ds_c.data = ds_g.data = NULL;
                    ops_cpu.channel_scale_backward(&ops_cpu, dx_c, ds_c, dy.cpu, x.cpu, sc.cpu, acc,
                                                   !acc);
                    o->channel_scale_backward(o, dx_g, ds_g, dy.gpu, x.gpu, sc.gpu, acc, !acc);
                    if (want != 2) {
                        snprintf(what, sizeof what, "channel_scale_backward dx acc %d", acc);
                        cu_expect(cu_pair_err(dxs), acc ? cu_tol((DType)dt, CU_FMA) : 0.0, what,
                                  (DType)dt);
                    }
                    if (want != 1) {
                        snprintf(what, sizeof what, "channel_scale_backward ds acc %d", !acc);
                        cu_expect(cu_pair_err(ds), cu_tol((DType)dt, 4 * 0x1p-24), what, (DType)dt);
                    }
                    cu_pair_free(&dxs); cu_pair_free(&ds);
                }
            }
            cu_pair_free(&x); cu_pair_free(&dy); cu_pair_free(&sc); cu_pair_free(&dpool);
            cu_pair_free(&pooled); cu_pair_free(&y);
            free(xv); free(dyv); free(sv); free(dpv);
        }
}
TEST(cuda_squeeze_excitation) { with_narrow_rows_both(cuda_squeeze_excitation_cases); }

// the squeeze-excitation gate against the CPU's (both sum in fp64; expf and the
// order of the sums differ): within 1e-5 of each tensor's largest value in
// fp32, plus two storage ulps where a rounded z1, y1 or z2 lands on the other
// side of a rounding boundary; dp overwritten, added into, and not wanted; the
// weights frozen (no parameter gradients). Two sizes: one block or several
// per image in each of the gate's kernels (C = 300: 10 blocks of 32 outputs of
// z2, 2 of 256 of dp; S = 40: 5 blocks of 8 outputs of z1, 2 of 32 of dz1)
TEST(cuda_se_gate) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 88);
    const int sizes[2][3] = {{3, 40, 10}, {3, 300, 40}};  // N, C, S
    for (int si = 0; si < 2; si++) {
        const int N = sizes[si][0], C = sizes[si][1], S = sizes[si][2];
        float *pv = randn(&r, (size_t)N * C, 1.0f), *dsv = randn(&r, (size_t)N * C, 1.0f);
        float *w1 = randn(&r, (size_t)S * C, 0.3f), *b1 = randn(&r, S, 0.3f),
              *w2 = randn(&r, (size_t)C * S, 0.3f);
        float *b2 = randn(&r, C, 0.3f);
        float *w1_d = cu_floats(w1, (size_t)S * C), *b1_d = cu_floats(b1, S),
              *w2_d = cu_floats(w2, (size_t)C * S);
        float *b2_d = cu_floats(b2, C);
        const Shape sp = shape4(N, 1, 1, C);
        for (int dt = 0; dt < 3; dt++) {
            const double tol = 1e-5 + 2 * cu_ulp16((DType)dt);
            CuPair p = cu_pair(pv, sp, (DType)dt), sg = cu_pair(NULL, sp, (DType)dt),
                   ds = cu_pair(dsv, sp, (DType)dt);
            ops_cpu.se_gate_forward(&ops_cpu, sg.cpu, p.cpu, w1, b1, w2, b2, S, ACT_SILU,
                                    ACT_SIGMOID);
            o->se_gate_forward(o, sg.gpu, p.gpu, w1_d, b1_d, w2_d, b2_d, S, ACT_SILU, ACT_SIGMOID);
            cu_expect(cu_pair_err(sg), tol, "se_gate_forward", (DType)dt);
            // dp overwritten, added into, not wanted; frozen weights
            for (int mode = 0; mode < 4; mode++) {
                const int acc = mode == 1, frozen = mode == 3;
                CuPair dp = cu_dest(&r, sp, (DType)dt, acc);
                Tensor dp_c = dp.cpu, dp_g = dp.gpu;
                if (mode == 2) dp_c.data = dp_g.data = NULL;
                // the gradients are added into these
                float *g0 = randn(&r, (size_t)2 * S * C + C + S, 1.0f);
                float *gc = malloc(sizeof(float) * ((size_t)2 * S * C + C + S));
                memcpy(gc, g0, sizeof(float) * ((size_t)2 * S * C + C + S));
                float *gg = cu_floats(g0, (size_t)2 * S * C + C + S);
                const size_t o_b1 = (size_t)S * C, o_w2 = o_b1 + S, o_b2 = o_w2 + (size_t)C * S;
                ops_cpu.se_gate_backward(&ops_cpu, dp_c, ds.cpu, p.cpu, w1, b1, w2, b2, S, ACT_SILU,
                                         ACT_SIGMOID, frozen ? NULL : gc, frozen ? NULL : gc + o_b1,
                                         frozen ? NULL : gc + o_w2, frozen ? NULL : gc + o_b2, acc);
                o->se_gate_backward(o, dp_g, ds.gpu, p.gpu, w1_d, b1_d, w2_d, b2_d, S, ACT_SILU,
                                    ACT_SIGMOID, frozen ? NULL : gg, frozen ? NULL : gg + o_b1,
                                    frozen ? NULL : gg + o_w2, frozen ? NULL : gg + o_b2, acc);
                char what[64];
                snprintf(what, sizeof what, "se_gate_backward mode %d dp", mode);
                if (mode != 2) cu_expect(cu_pair_err(dp), tol, what, (DType)dt);
                snprintf(what, sizeof what, "se_gate_backward mode %d weights", mode);
                cu_expect(cu_floats_err(gg, gc, (size_t)2 * S * C + C + S), tol, what, (DType)dt);
                if (frozen)
                    CHECK(!memcmp(gc, g0, sizeof(float) * ((size_t)2 * S * C + C + S)),
                          "se gate: frozen weights got gradients");
                o->free(o, gg);
                free(gc);
                free(g0);
                cu_pair_free(&dp);
            }
            cu_pair_free(&p);
            cu_pair_free(&sg);
            cu_pair_free(&ds);
        }
        o->free(o, w1_d);
        o->free(o, b1_d);
        o->free(o, w2_d);
        o->free(o, b2_d);
        free(pv);
        free(dsv);
        free(w1);
        free(b1);
        free(w2);
        free(b2);
    }
}
#endif

// ----------------------------------------------------------------------------
// residual add and channel concat

// residual add, concat and their backward (copy and split) with fan-out
TEST(add_concat_grad) {
    Graph g; graph_init(&g);
    int x = graph_input(&g, shape4(2, 3, 4, 3));
    int c = graph_conv(&g, "branch", x, 3, 3, 1, 1, PAD_SAME, 1);
    int y = graph_add(&g, "add", x, c);               // x: identity path and conv path
    int z = graph_concat(&g, "cat", y, c);            // c: feeds add and concat
    int w = graph_add(&g, "twice", z, z);             // one tensor as both inputs
    double e = graph_gradcheck(&g, w, grad_opts(), &ops_cpu);
    note_worst(LAYER_ADD, e);
    note_worst(LAYER_CONCAT, e);
    graph_free(&g);
}

#ifdef SEGNET_CUDA
// a + b (one sum), its backward, concat and its split (copies; one sum with accumulate): the same
// bits
TEST(cuda_add_concat) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 85);
    // odd channel counts, then whole 16-byte vectors (8 + 16 = 24 channels)
    const int chans[2][2] = {{5, 13}, {8, 16}};
    for (int ci = 0; ci < 2; ci++)
    for (int dt = 0; dt < 3; dt++) {
        const int Ca = chans[ci][0], Cb = chans[ci][1];
        const Shape sa = shape4(2, 5, 7, Ca), sb = shape4(2, 5, 7, Cb),
                    sy = shape4(2, 5, 7, Ca + Cb);
        float *av = randn(&r, shape_numel(sa), 1.0f), *bv = randn(&r, shape_numel(sa), 1.0f);
        float *cv = randn(&r, shape_numel(sb), 1.0f), *dyv = randn(&r, shape_numel(sy), 1.0f);
        CuPair a = cu_pair(av, sa, (DType)dt), b = cu_pair(bv, sa, (DType)dt),
               cb = cu_pair(cv, sb, (DType)dt);
        CuPair sum = cu_pair(NULL, sa, (DType)dt), cat = cu_pair(NULL, sy, (DType)dt),
               dy = cu_pair(dyv, sy, (DType)dt);
        ops_cpu.add_forward(&ops_cpu, sum.cpu, a.cpu, b.cpu);
        o->add_forward(o, sum.gpu, a.gpu, b.gpu);
        cu_expect(cu_pair_err(sum), 0.0, "add_forward", (DType)dt);
        ops_cpu.concat_forward(&ops_cpu, cat.cpu, a.cpu, cb.cpu);
        o->concat_forward(o, cat.gpu, a.gpu, cb.gpu);
        cu_expect(cu_pair_err(cat), 0.0, "concat_forward", (DType)dt);
        // (accumulate_a, accumulate_b) all four; da or db not wanted
        for (int mode = 0; mode < 6; mode++) {
            int acc_a = mode & 1, acc_b = (mode >> 1) & 1;
            CuPair da = cu_dest(&r, sa, (DType)dt, acc_a), db = cu_dest(&r, sb, (DType)dt, acc_b);
            Tensor da_c = da.cpu, da_g = da.gpu, db_c = db.cpu, db_g = db.gpu;
            if (mode == 4) da_c.data = da_g.data = NULL;
            if (mode == 5) db_c.data = db_g.data = NULL;
            ops_cpu.concat_backward(&ops_cpu, da_c, db_c, dy.cpu, acc_a, acc_b);
            o->concat_backward(o, da_g, db_g, dy.gpu, acc_a, acc_b);
            char what[64];
            snprintf(what, sizeof what, "concat_backward mode %d", mode);
            if (mode != 4) cu_expect(cu_pair_err(da), 0.0, what, (DType)dt);
            if (mode != 5) cu_expect(cu_pair_err(db), 0.0, what, (DType)dt);
            cu_pair_free(&da); cu_pair_free(&db);
            // add's backward: dy (here a) into both, in the same modes
            CuPair ga = cu_dest(&r, sa, (DType)dt, acc_a), gb = cu_dest(&r, sa, (DType)dt, acc_b);
            Tensor ga_c = ga.cpu, ga_g = ga.gpu, gb_c = gb.cpu, gb_g = gb.gpu;
            if (mode == 4) ga_c.data = ga_g.data = NULL;
            if (mode == 5) gb_c.data = gb_g.data = NULL;
            ops_cpu.add_backward(&ops_cpu, ga_c, gb_c, a.cpu, acc_a, acc_b);
            o->add_backward(o, ga_g, gb_g, a.gpu, acc_a, acc_b);
            snprintf(what, sizeof what, "add_backward mode %d", mode);
            if (mode != 4) cu_expect(cu_pair_err(ga), 0.0, what, (DType)dt);
            if (mode != 5) cu_expect(cu_pair_err(gb), 0.0, what, (DType)dt);
            cu_pair_free(&ga); cu_pair_free(&gb);
        }
        cu_pair_free(&a);
        cu_pair_free(&b);
        cu_pair_free(&cb);
        cu_pair_free(&sum);
        cu_pair_free(&cat);
        cu_pair_free(&dy);
        free(av); free(bv); free(cv); free(dyv);
    }
}
#endif

// ----------------------------------------------------------------------------
// dropout and drop-path

TEST(dropout_grad) {
    for (int per_sample = 0; per_sample < 2; per_sample++) {
        Graph g; graph_init(&g);
        int x = graph_input(&g, shape4(6, 3, 3, 4));
        int a = per_sample ? graph_drop_path(&g, "dp_a", x, 0.4f)
                           : graph_dropout(&g, "do_a", x, 0.3f);
        int b = per_sample ? graph_drop_path(&g, "dp_b", x, 0.5f)
                           : graph_dropout(&g, "do_b", x, 0.5f);
        int y = graph_concat(&g, "cat", a, b);
        double e = graph_gradcheck(&g, y, grad_opts(), &ops_cpu);
        note_worst(per_sample ? LAYER_DROP_PATH : LAYER_DROPOUT, e);
        graph_free(&g);
    }
}

TEST(dropout_masks) {
    const size_t n = 100000;
    float *x = malloc(sizeof(float) * n), *y = malloc(sizeof(float) * n),
          *y2 = malloc(sizeof(float) * n);
    float *dx = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) x[i] = 1.0f;
    Shape s = shape4(10, 10, 100, 10);
    const float rate = 0.3f;
    ops_cpu.dropout_forward(&ops_cpu, tensor_f32(y, s), tensor_f32(x, s), NO_RESIDUAL, rate,
                            &(uint64_t){42}, 0, 0);
    size_t kept = 0;
    int scaled = 1;
    for (size_t i = 0; i < n; i++) {
        if (y[i] != 0.0f) { kept++; scaled &= y[i] == 1.0f / (1.0f - rate); }
    }
    double frac = (double)kept / n, sigma = sqrt(rate * (1 - rate) / n);
    CHECK(fabs(frac - (1 - rate)) < 5 * sigma, "kept fraction %.4f, expected %.2f ± %.4f", frac,
          1 - rate, 5 * sigma);
    CHECK(scaled, "kept values are scaled by 1/(1 - rate)");
    ops_cpu.dropout_forward(&ops_cpu, tensor_f32(y2, s), tensor_f32(x, s), NO_RESIDUAL, rate,
                            &(uint64_t){42}, 0, 0);
    CHECK(!memcmp(y, y2, sizeof(float) * n), "same seed, same mask");
    ops_cpu.dropout_forward(&ops_cpu, tensor_f32(y2, s), tensor_f32(x, s), NO_RESIDUAL, rate,
                            &(uint64_t){43}, 0, 0);
    CHECK(memcmp(y, y2, sizeof(float) * n) != 0, "another seed, another mask");
    ops_cpu.dropout_backward(&ops_cpu, tensor_f32(dx, s), NO_RESIDUAL, tensor_f32(x, s), rate,
                             &(uint64_t){42}, 0, 0, 0, 0);
    CHECK(!memcmp(y, dx, sizeof(float) * n), "backward recomputes the forward mask");
    // drop-path: all or nothing per sample
    ops_cpu.dropout_forward(&ops_cpu, tensor_f32(y, s), tensor_f32(x, s), NO_RESIDUAL, 0.5f,
                            &(uint64_t){7}, 1, 0);
    int whole = 1, dropped = 0;
    size_t per = n / 10;
    for (int k = 0; k < 10; k++) {
        for (size_t i = 1; i < per; i++) whole &= y[k * per + i] == y[k * per];
        dropped += y[k * per] == 0.0f;
        whole &= y[k * per] == 0.0f || y[k * per] == 2.0f;
    }
    CHECK(whole, "drop-path drops or keeps (scaled by 2) each sample whole");
    CHECK(dropped > 0 && dropped < 10, "drop-path at rate 0.5 dropped %d of 10 samples", dropped);
    // a batch split in parts (replica shards, micro-batches) draws the masks of the
    // whole batch: samples 0..3 and 4..9 given first_sample 0 and 4
    for (int per_sample = 0; per_sample < 2; per_sample++) {
        ops_cpu.dropout_forward(&ops_cpu, tensor_f32(y, s), tensor_f32(x, s), NO_RESIDUAL, 0.5f,
                                &(uint64_t){9}, per_sample, 0);
        ops_cpu.dropout_forward(&ops_cpu, tensor_f32(y2, shape4(4, 10, 100, 10)),
                                tensor_f32(x, shape4(4, 10, 100, 10)), NO_RESIDUAL, 0.5f,
                                &(uint64_t){9}, per_sample, 0);
        ops_cpu.dropout_forward(&ops_cpu, tensor_f32(y2 + 4 * per, shape4(6, 10, 100, 10)),
                                tensor_f32(x, shape4(6, 10, 100, 10)), NO_RESIDUAL, 0.5f,
                                &(uint64_t){9}, per_sample, 4);
        CHECK(!memcmp(y, y2, sizeof(float) * n),
              "%s masks of a batch in two parts differ from the whole batch's",
              per_sample ? "drop-path" : "dropout");
        ops_cpu.dropout_backward(&ops_cpu, tensor_f32(dx, shape4(6, 10, 100, 10)), NO_RESIDUAL,
                                 tensor_f32(x, shape4(6, 10, 100, 10)), 0.5f, &(uint64_t){9},
                                 per_sample, 4, 0, 0);
        CHECK(!memcmp(y + 4 * per, dx, sizeof(float) * 6 * per),
              "backward of the second part: its masks");
    }
    // a residual block's end (drop-path + residual): y = x·keep + res, dres = dy, dx = dy·keep
    // (x = 1, res = 3, keep 0 or 2: every value exact); then added into dres = 1
    float *res = malloc(sizeof(float) * n), *dres = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) { res[i] = 3.0f; dres[i] = 1.0f; }
    ops_cpu.dropout_forward(&ops_cpu, tensor_f32(y, s), tensor_f32(x, s), NO_RESIDUAL, 0.5f,
                            &(uint64_t){7}, 1, 0);
    ops_cpu.dropout_forward(&ops_cpu, tensor_f32(y2, s), tensor_f32(x, s), tensor_f32(res, s), 0.5f,
                            &(uint64_t){7}, 1, 0);
    int sums = 1;
    for (size_t i = 0; i < n; i++) sums &= y2[i] == y[i] + 3.0f;
    CHECK(sums, "drop-path + residual: y is not the drop-path's output + 3");
    ops_cpu.dropout_backward(&ops_cpu, tensor_f32(dx, s), tensor_f32(dres, s), tensor_f32(x, s),
                             0.5f, &(uint64_t){7}, 1, 0, 0, 1);
    int grads = 1;
    for (size_t i = 0; i < n; i++) grads &= dx[i] == y[i] && dres[i] == 2.0f;
    CHECK(grads, "drop-path + residual backward: dx is not dy·keep or dres is not 1 + dy");
    free(res); free(dres);
    free(x); free(y); free(y2); free(dx);
}

#ifdef SEGNET_CUDA
// dropout and drop-path: the counter-based masks are the same bits, so the outputs
// are (one product each; CU_FMA with accumulate). Both masks keep and drop something.
TEST(cuda_dropout) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 86);
    const Shape shapes[2] = {shape4(8, 3, 5, 7), shape4(8, 3, 5, 8)};  // odd; whole 16-byte vectors
    for (int si = 0; si < 2; si++)
    for (int dt = 0; dt < 3; dt++)
        for (int per_sample = 0; per_sample < 2; per_sample++)
            for (int ri = 0; ri < 2; ri++) {
                const float rate = ri ? 0.5f : 0.2f;
                // per sample: drops 3 of 8 samples at either rate
                const uint64_t seed = 1000 + 2 * per_sample + ri;
                const Shape s = shapes[si];
                const size_t n = shape_numel(s);
                float *xv = randn(&r, n, 1.0f);
                // no zeros: a 0 out is a drop
                for (size_t i = 0; i < n; i++) xv[i] += xv[i] >= 0 ? 0.5f : -0.5f;
                CuPair x = cu_pair(xv, s, (DType)dt), y = cu_pair(NULL, s, (DType)dt);
                const uint64_t first = 3;  // the tensor is images 3.. of the step
                ops_cpu.dropout_forward(&ops_cpu, y.cpu, x.cpu, NO_RESIDUAL, rate,
                                        &(uint64_t){seed}, per_sample, first);
                uint64_t *seed_gpu = cu_copy_of(&seed, sizeof seed);
                o->dropout_forward(o, y.gpu, x.gpu, NO_RESIDUAL, rate, seed_gpu, per_sample, first);
                char what[64];
                snprintf(what, sizeof what, "dropout_forward %s rate %.1f",
                         per_sample ? "sample" : "element", rate);
                cu_expect(cu_pair_err(y), 0.0, what, (DType)dt);
                float *yg = cu_to_host(y.gpu.data, n, (DType)dt);
                size_t dropped = 0;
                for (size_t i = 0; i < n; i++) dropped += yg[i] == 0.0f;
                CHECK(dropped > 0 && dropped < n, "%s: %zu of %zu dropped", what, dropped, n);
                free(yg);
                for (int acc = 0; acc < 2; acc++) {
                    CuPair dx = cu_dest(&r, s, (DType)dt, acc);
                    ops_cpu.dropout_backward(&ops_cpu, dx.cpu, NO_RESIDUAL, x.cpu, rate,
                                             &(uint64_t){seed}, per_sample, first, acc, 0);
                    o->dropout_backward(o, dx.gpu, NO_RESIDUAL, x.gpu, rate, seed_gpu, per_sample,
                                        first, acc, 0);
                    snprintf(what, sizeof what, "dropout_backward %s rate %.1f acc %d",
                             per_sample ? "sample" : "element", rate, acc);
                    cu_expect(cu_pair_err(dx), acc ? cu_tol((DType)dt, CU_FMA) : 0.0, what,
                              (DType)dt);
                    cu_pair_free(&dx);
                }
                // a residual block's end: y = dropout(x) + res, and dx, dres (either absent) in
                // every accumulate mode
                CuPair res = cu_pair(xv, s, (DType)dt), yr = cu_pair(NULL, s, (DType)dt);
                ops_cpu.dropout_forward(&ops_cpu, yr.cpu, x.cpu, res.cpu, rate, &(uint64_t){seed},
                                        per_sample, first);
                o->dropout_forward(o, yr.gpu, x.gpu, res.gpu, rate, seed_gpu, per_sample, first);
                snprintf(what, sizeof what, "dropout_forward + residual %s",
                         per_sample ? "sample" : "element");
                cu_expect(cu_pair_err(yr), cu_tol((DType)dt, CU_FMA), what, (DType)dt);
                for (int mode = 0; mode < 6; mode++) {
                    const int acc = mode & 1, acc_res = (mode >> 1) & 1;
                    CuPair dx = cu_dest(&r, s, (DType)dt, acc),
                           dres = cu_dest(&r, s, (DType)dt, acc_res);
                    Tensor dx_c = dx.cpu, dx_g = dx.gpu, dr_c = dres.cpu, dr_g = dres.gpu;
                    if (mode == 4) dx_c.data = dx_g.data = NULL;
                    if (mode == 5) dr_c.data = dr_g.data = NULL;
                    ops_cpu.dropout_backward(&ops_cpu, dx_c, dr_c, x.cpu, rate, &(uint64_t){seed},
                                             per_sample, first, acc, acc_res);
                    o->dropout_backward(o, dx_g, dr_g, x.gpu, rate, seed_gpu, per_sample, first,
                                        acc, acc_res);
                    snprintf(what, sizeof what, "dropout_backward + residual mode %d", mode);
                    if (mode != 4)
                        cu_expect(cu_pair_err(dx), acc ? cu_tol((DType)dt, CU_FMA) : 0.0, what,
                                  (DType)dt);
                    if (mode != 5) cu_expect(cu_pair_err(dres), 0.0, what, (DType)dt);
                    cu_pair_free(&dx); cu_pair_free(&dres);
                }
                cu_pair_free(&res); cu_pair_free(&yr);
                cu_pair_free(&x); cu_pair_free(&y);
                o->free(o, seed_gpu);
                free(xv);
            }
}
#endif

// ----------------------------------------------------------------------------
// pooling and resampling

// distinct values 0.05 apart so a step of 1e-2 never changes a window's argmax
static float *spaced_input(size_t n, uint64_t seed) {
    Rng r; rng_seed(&r, seed);
    float *x = malloc(sizeof(float) * n);
    for (size_t i = 0; i < n; i++) x[i] = 0.05f * (float)i - 0.025f * (float)n;
    for (size_t i = n - 1; i > 0; i--) {
        size_t j = rng_next(&r) % (i + 1);
        float t = x[i];
        x[i] = x[j];
        x[j] = t;
    }
    return x;
}

TEST(pool_upsample_grad) {
    // even, and odd (floor drops a row and a column)
    Shape shapes[2] = {shape4(2, 4, 6, 3), shape4(1, 5, 7, 2)};
    for (int i = 0; i < 2; i++) {
        Graph g; graph_init(&g);
        int x = graph_input(&g, shapes[i]);
        int y = graph_concat(&g, "cat", graph_maxpool(&g, "pool_a", x),
                             graph_maxpool(&g, "pool_b", x));
        GradOpts o = grad_opts();
        float *xin = spaced_input(shape_numel(shapes[i]), 11 + i);
        o.input = xin;
        note_worst(LAYER_MAXPOOL, graph_gradcheck(&g, y, o, &ops_cpu));
        free(xin);
        graph_free(&g);
    }
    Graph g; graph_init(&g);
    int x = graph_input(&g, shape4(2, 3, 2, 3));
    int y = graph_concat(&g, "cat", graph_upsample(&g, "up_a", x), graph_upsample(&g, "up_b", x));
    note_worst(LAYER_UPSAMPLE, graph_gradcheck(&g, y, grad_opts(), &ops_cpu));
    graph_free(&g);
}

TEST(resize_grad) {
    // up, down, mixed, identity
    int sizes[][4] = {{4, 5, 9, 7}, {7, 6, 3, 4}, {3, 3, 7, 2}, {5, 4, 5, 4}};
    for (int i = 0; i < 4; i++) {
        Graph g; graph_init(&g);
        int x = graph_input(&g, shape4(2, sizes[i][0], sizes[i][1], 2));
        int y = graph_concat(&g, "cat", graph_resize(&g, "rs_a", x, sizes[i][2], sizes[i][3]),
                             graph_resize(&g, "rs_b", x, sizes[i][2], sizes[i][3]));
        note_worst(LAYER_RESIZE, graph_gradcheck(&g, y, grad_opts(), &ops_cpu));
        graph_free(&g);
    }
}

TEST(pool_upsample_by_hand) {
    // 3×3 input, one channel: the pool reads the top-left 2×2 only (floor)
    float x[9] = {1, 5, 9, 5, 2, 9, 9, 9, 9}, y[1], dy[1] = {7}, dx[9];
    ops_cpu.maxpool2_forward(&ops_cpu, tensor_f32(y, shape4(1, 1, 1, 1)),
                             tensor_f32(x, shape4(1, 3, 3, 1)));
    CHECK(y[0] == 5, "maxpool of [1 5; 5 2] = %g", y[0]);
    ops_cpu.maxpool2_backward(&ops_cpu, tensor_f32(dx, shape4(1, 3, 3, 1)),
                              tensor_f32(dy, shape4(1, 1, 1, 1)), tensor_f32(x, shape4(1, 3, 3, 1)),
                              0);
    float want[9] = {0, 7, 0, 0, 0, 0, 0, 0, 0};  // tie 5/5: the first in row-major order
    CHECK(!memcmp(dx, want, sizeof want), "maxpool backward routes to the first maximum only");
    float u[2] = {1, 2}, uy[8], ud[8] = {1, 2, 3, 4, 5, 6, 7, 8}, udx[2];
    ops_cpu.upsample2_forward(&ops_cpu, tensor_f32(uy, shape4(1, 2, 4, 1)),
                              tensor_f32(u, shape4(1, 1, 2, 1)));
    float uw[8] = {1, 1, 2, 2, 1, 1, 2, 2};
    CHECK(!memcmp(uy, uw, sizeof uw), "nearest upsample");
    ops_cpu.upsample2_backward(&ops_cpu, tensor_f32(udx, shape4(1, 1, 2, 1)),
                               tensor_f32(ud, shape4(1, 2, 4, 1)), 0);
    CHECK(udx[0] == 1 + 2 + 5 + 6 && udx[1] == 3 + 4 + 7 + 8,
          "upsample adjoint sums its 2x2: [%g %g]", udx[0], udx[1]);
    // global average pool and channel scale
    float g[8] = {1, 10, 2, 20, 3, 30, 4, 40}, gp[2];  // (1,2,2,2)
    ops_cpu.global_avg_pool_forward(&ops_cpu, tensor_f32(gp, shape4(1, 1, 1, 2)),
                                    tensor_f32(g, shape4(1, 2, 2, 2)));
    CHECK(gp[0] == 2.5f && gp[1] == 25.0f, "global average pool: [%g %g]", gp[0], gp[1]);
    float s[2] = {2, -1}, gs[8];
    ops_cpu.channel_scale_forward(&ops_cpu, tensor_f32(gs, shape4(1, 2, 2, 2)),
                                  tensor_f32(g, shape4(1, 2, 2, 2)),
                                  tensor_f32(s, shape4(1, 1, 1, 2)));
    CHECK(gs[0] == 2 && gs[1] == -10 && gs[7] == -40, "channel scale");
    // concat and its split
    float a[2] = {1, 2}, b[4] = {3, 4, 5, 6}, c[6], da[2], db[4];
    ops_cpu.concat_forward(&ops_cpu, tensor_f32(c, shape4(1, 1, 2, 3)),
                           tensor_f32(a, shape4(1, 1, 2, 1)), tensor_f32(b, shape4(1, 1, 2, 2)));
    float cw[6] = {1, 3, 4, 2, 5, 6};
    CHECK(!memcmp(c, cw, sizeof cw), "concat along channels");
    ops_cpu.concat_backward(&ops_cpu, tensor_f32(da, shape4(1, 1, 2, 1)),
                            tensor_f32(db, shape4(1, 1, 2, 2)), tensor_f32(c, shape4(1, 1, 2, 3)),
                            0, 0);
    CHECK(!memcmp(da, a, sizeof a) && !memcmp(db, b, sizeof b), "concat backward splits");
}

TEST(resize_by_hand) {
    // [1 3] -> 4 wide: sources -0.25(→0), 0.25, 0.75, 1.25(→ clamps to 1) = [1, 1.5, 2.5, 3]
    float x[2] = {1, 3}, y[4], d[4] = {1, 2, 4, 8}, dx[2];
    ops_cpu.resize_bilinear_forward(&ops_cpu, tensor_f32(y, shape4(1, 1, 4, 1)),
                                    tensor_f32(x, shape4(1, 1, 2, 1)));
    CHECK(y[0] == 1 && y[1] == 1.5f && y[2] == 2.5f && y[3] == 3, "upsize: [%g %g %g %g]", y[0],
          y[1], y[2], y[3]);
    // adjoint: dx0 = 1 + .75·2 + .25·4 = 3.5, dx1 = .25·2 + .75·4 + 8 = 11.5
    ops_cpu.resize_bilinear_backward(&ops_cpu, tensor_f32(dx, shape4(1, 1, 2, 1)),
                                     tensor_f32(d, shape4(1, 1, 4, 1)), 0);
    CHECK(dx[0] == 3.5f && dx[1] == 11.5f, "upsize adjoint: [%g %g]", dx[0], dx[1]);
    // [1 2 3 4] -> 2 wide: sources 0.5, 2.5 = [1.5, 3.5]
    float x4[4] = {1, 2, 3, 4}, y2[2];
    ops_cpu.resize_bilinear_forward(&ops_cpu, tensor_f32(y2, shape4(1, 1, 2, 1)),
                                    tensor_f32(x4, shape4(1, 1, 4, 1)));
    CHECK(y2[0] == 1.5f && y2[1] == 3.5f, "downsize: [%g %g]", y2[0], y2[1]);
}

// ops_cpu's fp32 max-pool, nearest upsampling and concatenation against
// ops_ref's element-by-element versions: the same bits, forward and backward,
// written and accumulated, on odd sizes (max-pool's floor: the last row and
// column get no gradient) with ties, NaN, ±inf and ±0 in the windows (the
// first maximum in window order takes the gradient; NaN never wins).
TEST(fast_pool_concat_vs_ref) {
    Rng r; rng_seed(&r, 86);
    const Shape s = shape4(2, 7, 9, 21), p = shape4(2, 3, 4, 21), u = shape4(2, 6, 8, 21),
                b = shape4(2, 7, 9, 5);
    const Shape cat = shape4(2, 7, 9, 26);
    const size_t n = shape_numel(s), np = shape_numel(p), nu = shape_numel(u), nb = shape_numel(b),
                 nc = shape_numel(cat);
    float *x = randn(&r, n, 1.0f), *dp = randn(&r, np, 1.0f), *du = randn(&r, nu, 1.0f),
          *xb = randn(&r, nb, 1.0f);
    float *dcat = randn(&r, nc, 1.0f);
    const float special[] = {NAN, INFINITY, -INFINITY, 0.0f, -0.0f, 1.0f};
    // in about a third of the windows' places
    for (size_t i = 0; i < n; i += 3) x[i] = special[(i / 3) % 6];
    // ties: in a row, and across the window's rows
    for (size_t i = 0; i < n; i++)
        if ((i / 21) % 9 % 2 == 1 && i % 4 == 0) x[i] = x[i - 21];
        else if ((i / 21 / 9) % 7 % 2 == 1 && i % 5 == 0) x[i] = x[i - 9 * 21];
    // whole windows of -0 (upsample's sum starts from +0, as the reference's)
    for (size_t i = 0; i < nu; i++)
        if ((i / 21) % 8 < 2 && (i / 21 / 8) % 6 < 2 && i % 21 < 3) du[i] = -0.0f;
    Ops *tables[2] = {&ops_cpu, &ops_ref};
    float *out[2][9];  // [table]: pool, dx pool (written, accumulated), up, dx up (2), cat, da, db
    for (int t = 0; t < 2; t++) {
        Ops *o = tables[t];
        float **q = out[t];
        q[0] = malloc(sizeof(float) * np);
        o->maxpool2_forward(o, tensor_f32(q[0], p), tensor_f32(x, s));
        for (int acc = 0; acc < 2; acc++) {
            q[1 + acc] = malloc(sizeof(float) * n);
            for (size_t i = 0; i < n; i++) q[1 + acc][i] = i % 5 ? 0.25f : -0.0f;
            o->maxpool2_backward(o, tensor_f32(q[1 + acc], s), tensor_f32(dp, p), tensor_f32(x, s),
                                 acc);
        }
        q[3] = malloc(sizeof(float) * nu);
        o->upsample2_forward(o, tensor_f32(q[3], u), tensor_f32(dp, shape4(2, 3, 4, 21)));
        for (int acc = 0; acc < 2; acc++) {
            q[4 + acc] = malloc(sizeof(float) * np);
            for (size_t i = 0; i < np; i++) q[4 + acc][i] = i % 5 ? 0.5f : -0.0f;
            o->upsample2_backward(o, tensor_f32(q[4 + acc], p), tensor_f32(du, u), acc);
        }
        q[6] = malloc(sizeof(float) * nc);
        o->concat_forward(o, tensor_f32(q[6], cat), tensor_f32(x, s), tensor_f32(xb, b));
        q[7] = malloc(sizeof(float) * n);
        q[8] = malloc(sizeof(float) * nb);
        for (size_t i = 0; i < n; i++) q[7][i] = 0.125f;
        for (size_t i = 0; i < nb; i++) q[8][i] = 0.125f;
        o->concat_backward(o, tensor_f32(q[7], s), tensor_f32(q[8], b), tensor_f32(dcat, cat), 1,
                           0);
    }
    const size_t count[9] = {np, n, n, nu, np, np, nc, n, nb};
    const char *what[9] = {"max-pool forward",
                           "max-pool backward",
                           "max-pool backward, accumulated",
                           "upsample forward",
                           "upsample backward",
                           "upsample backward, accumulated",
                           "concat forward",
                           "concat backward, accumulated",
                           "concat backward"};
    for (int k = 0; k < 9; k++) {
        size_t differ = 0;
        for (size_t i = 0; i < count[k]; i++)
            differ += memcmp(&out[0][k][i], &out[1][k][i], sizeof(float)) != 0;
        CHECK(differ == 0, "%s: ops_cpu and ops_ref differ in %zu of %zu values", what[k], differ,
              count[k]);
    }
    size_t floor_grad = 0;  // the written max-pool gradient past the floor (row 6, column 8) is 0
    for (int nn = 0; nn < 2; nn++)
        for (int y = 0; y < 7; y++)
            for (int xx = 0; xx < 9; xx++)
                if (y == 6 || xx == 8)
                    for (int c = 0; c < 21; c++)
                        floor_grad += out[0][1][(((size_t)nn * 7 + y) * 9 + xx) * 21 + c] != 0.0f;
    CHECK(floor_grad == 0, "max-pool backward: %zu gradients past the floor", floor_grad);
    free(x); free(dp); free(du); free(xb); free(dcat);
    for (int t = 0; t < 2; t++)
        for (int k = 0; k < 9; k++) free(out[t][k]);
}

#ifdef SEGNET_CUDA
// max-pool on small integers (ties in most windows: the gradient goes to the
// first maximum in row-major order), odd sizes (the floor drops a row/column);
// nearest upsampling: copies and sums of 4 in the CPU's order, the same bits
TEST(cuda_pool_upsample) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 87);
    // the last: 16-byte vectors
    const Shape shapes[] = {{2, 5, 7, 3}, {2, 9, 9, 5}, {1, 4, 6, 13}, {2, 5, 7, 16}};
    for (int si = 0; si < 4; si++)
        for (int dt = 0; dt < 3; dt++) {
            const Shape s = shapes[si], sp = shape4(s.n, s.h / 2, s.w / 2, s.c),
                        su = shape4(s.n, 2 * s.h, 2 * s.w, s.c);
            float *xv = malloc(shape_numel(s) * sizeof(float)),
                  *dpv = randn(&r, shape_numel(sp), 1.0f);
            float *duv = randn(&r, shape_numel(su), 1.0f);
            for (size_t i = 0; i < shape_numel(s); i++) xv[i] = (float)(rng_next(&r) % 3);
            CuPair x = cu_pair(xv, s, (DType)dt), dp = cu_pair(dpv, sp, (DType)dt),
                   du = cu_pair(duv, su, (DType)dt);
            CuPair yp = cu_pair(NULL, sp, (DType)dt), yu = cu_pair(NULL, su, (DType)dt);
            ops_cpu.maxpool2_forward(&ops_cpu, yp.cpu, x.cpu);
            o->maxpool2_forward(o, yp.gpu, x.gpu);
            cu_expect(cu_pair_err(yp), 0.0, "maxpool2_forward", (DType)dt);
            ops_cpu.upsample2_forward(&ops_cpu, yu.cpu, x.cpu);
            o->upsample2_forward(o, yu.gpu, x.gpu);
            cu_expect(cu_pair_err(yu), 0.0, "upsample2_forward", (DType)dt);
            for (int acc = 0; acc < 2; acc++) {
                char what[64];
                CuPair dx = cu_dest(&r, s, (DType)dt, acc);
                ops_cpu.maxpool2_backward(&ops_cpu, dx.cpu, dp.cpu, x.cpu, acc);
                o->maxpool2_backward(o, dx.gpu, dp.gpu, x.gpu, acc);
                snprintf(what, sizeof what, "maxpool2_backward acc %d", acc);
                cu_expect(cu_pair_err(dx), 0.0, what, (DType)dt);
                cu_pair_free(&dx);
                dx = cu_dest(&r, s, (DType)dt, acc);
                ops_cpu.upsample2_backward(&ops_cpu, dx.cpu, du.cpu, acc);
                o->upsample2_backward(o, dx.gpu, du.gpu, acc);
                snprintf(what, sizeof what, "upsample2_backward acc %d", acc);
                cu_expect(cu_pair_err(dx), 0.0, what, (DType)dt);
                cu_pair_free(&dx);
            }
            cu_pair_free(&x);
            cu_pair_free(&dp);
            cu_pair_free(&du);
            cu_pair_free(&yp);
            cu_pair_free(&yu);
            free(xv); free(dpv); free(duv);
        }
}

// bilinear resize up, down, to the same size and mixed. The taps are the shared
// ones of segnet.h, but FMA contraction of src = (o + 0.5)·in/out - 0.5 on one
// backend only moves src, and so λ, by up to an ulp of src (2^-20 for src < 16
// here), which moves y by 2^-20·|x1 - x0|: forward 4·2^-20 of max |y| (~ max |x|);
// the gather sums a few such terms per dx: 8·2^-20
TEST(cuda_resize_bilinear) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 88);
    // the last: vectors
    const Shape from[] = {{2, 5, 7, 3}, {2, 9, 9, 5}, {1, 7, 5, 13}, {2, 2, 3, 3}, {2, 5, 7, 8}};
    const int to[][2] = {{9, 13}, {5, 7}, {7, 5}, {7, 4}, {9, 13}};
    for (int k = 0; k < 5; k++)
        for (int dt = 0; dt < 3; dt++) {
            const Shape s = from[k], t = shape4(s.n, to[k][0], to[k][1], s.c);
            float *xv = randn(&r, shape_numel(s), 1.0f), *dyv = randn(&r, shape_numel(t), 1.0f);
            CuPair x = cu_pair(xv, s, (DType)dt), dy = cu_pair(dyv, t, (DType)dt),
                   y = cu_pair(NULL, t, (DType)dt);
            char what[64];
            ops_cpu.resize_bilinear_forward(&ops_cpu, y.cpu, x.cpu);
            o->resize_bilinear_forward(o, y.gpu, x.gpu);
            snprintf(what, sizeof what, "resize_bilinear_forward %dx%d->%dx%d", s.h, s.w, t.h, t.w);
            cu_expect(cu_pair_err(y), cu_tol((DType)dt, 4 * 0x1p-20), what, (DType)dt);
            for (int acc = 0; acc < 2; acc++) {
                CuPair dx = cu_dest(&r, s, (DType)dt, acc);
                ops_cpu.resize_bilinear_backward(&ops_cpu, dx.cpu, dy.cpu, acc);
                o->resize_bilinear_backward(o, dx.gpu, dy.gpu, acc);
                snprintf(what, sizeof what, "resize_bilinear_backward %dx%d->%dx%d acc %d", s.h,
                         s.w, t.h, t.w, acc);
                cu_expect(cu_pair_err(dx), cu_tol((DType)dt, 8 * 0x1p-20), what, (DType)dt);
                cu_pair_free(&dx);
            }
            cu_pair_free(&x); cu_pair_free(&dy); cu_pair_free(&y);
            free(xv); free(dyv);
        }
}
#endif

// ----------------------------------------------------------------------------
// batch norm

// BN in training mode (batch statistics) with each fused activation. With
// ReLU the check needs every pre-activation away from the kink, so inputs are
// redrawn until min |z| is 20 steps wide.
static void bn_case(Act act, int training, int fanout) {
    Graph g; graph_init(&g);
    int x = graph_input(&g, shape4(2, 3, 3, 4));
    int y = graph_bn(&g, "bn_a", x, BN_EPS_EFFNET, act);
    if (fanout) y = graph_concat(&g, "cat", y, graph_bn(&g, "bn_b", x, BN_EPS_UNET, act));
    GradOpts o = grad_opts();
    o.training = training;
    if (act == ACT_RELU) {
        o.h = 1e-3f;
        // pick a seed whose pre-activations stay clear of 0 (|z| > 20h) for every layer
        for (uint64_t s = 1;; s++) {
            Net net; char err[SN_ERR_MAX];
            Rng rng; rng_seed(&rng, s);
            net_create(&net, &g, &ops_cpu, DT_F32, 1, err);
            random_params(&net, &rng);
            float *xv = net.act[x];
            for (int i = 0; i < 72; i++) xv[i] = rng_normal(&rng);
            net_forward(&net, net_capacity(&net), training);
            double zmin = INFINITY;
            for (int l = 0; l < g.n_layers; l++) {
                const Layer *L = &g.layers[l];
                if (L->kind != LAYER_BN) continue;
                const float *m =
                        training ? net.bn_mean[l] : net.buffers + g.buffers[L->run_mean].offset;
                const float *v =
                        training ? net.bn_var[l] : net.buffers + g.buffers[L->run_var].offset;
                const float *gam = net.params + g.params[L->weight].offset,
                            *bet = net.params + g.params[L->bias].offset;
                for (int i = 0; i < 72; i++) {
                    int c = i % 4;
                    double z = gam[c] * (xv[i] - m[c]) / sqrt(v[c] + L->eps) + bet[c];
                    if (fabs(z) < zmin) zmin = fabs(z);
                }
            }
            net_free(&net);
            if (zmin > 20 * o.h) { o.seed = s; break; }
        }
    }
    note_worst(LAYER_BN, graph_gradcheck(&g, y, o, &ops_cpu));
    note_worst(LAYER_BN, graph_gradcheck(&g, y, o, &ops_ref));  // the reference batch norm too
    graph_free(&g);
}
// graph_gradcheck draws params then input from the same seed in the same order as the search above.

TEST(bn_grad_train) {
    bn_case(ACT_NONE, 1, 1);
    bn_case(ACT_SILU, 1, 1);
    bn_case(ACT_SIGMOID, 1, 0);
    bn_case(ACT_RELU, 1, 1);
}

TEST(bn_grad_inference) {
    bn_case(ACT_NONE, 0, 1);
    bn_case(ACT_SILU, 0, 1);
    bn_case(ACT_RELU, 0, 0);
}

TEST(bn_by_hand) {
    // one channel, x = 1 2 3 4: mean 2.5, biased var 1.25, unbiased 5/3
    float x[4] = {1, 2, 3, 4}, y[4], mean, var, gamma = 2, beta = 0.5f, rm = 0, rv = 1;
    Tensor tx = tensor_f32(x, shape4(1, 2, 2, 1)), ty = tensor_f32(y, shape4(1, 2, 2, 1));
    ops_cpu.bn_stats(&ops_cpu, tx, &mean, &var, NULL, NULL, 0.0f, NULL);
    CHECK_NEAR(mean, 2.5, 1e-7, "mean");
    CHECK_NEAR(var, 1.25, 1e-7, "biased variance");
    ops_cpu.bn_update_running(&ops_cpu, &rm, &rv, &mean, &var, 1, 4, BN_MOMENTUM);
    CHECK_NEAR(rm, 0.25, 1e-7, "running mean 0.9·0 + 0.1·2.5");
    CHECK_NEAR(rv, 0.9 + 0.1 * 5.0 / 3.0, 1e-6, "running var 0.9·1 + 0.1·(5/3) (unbiased)");
    ops_cpu.bn_forward(
        &ops_cpu, ty, tx,
        &(BnArgs){&mean, &var, &gamma, &beta, 1e-5f, ACT_NONE, NULL});
    for (int i = 0; i < 4; i++)
        CHECK_NEAR(y[i], 2.0 * (x[i] - 2.5) / sqrt(1.25 + 1e-5) + 0.5, 1e-5, "bn output");
    ops_cpu.bn_forward(
        &ops_cpu, ty, tx,
        &(BnArgs){&mean, &var, &gamma, &beta, 1e-5f, ACT_RELU, NULL});
    CHECK(y[0] == 0.0f && y[3] > 0.0f, "fused relu");
    // inference with running statistics mean 1, var 3: (x - 1)/2
    float m1 = 1, v1 = 3.999f, g1 = 1, b1 = 0;
    ops_cpu.bn_forward(&ops_cpu, ty, tx,
                       &(BnArgs){&m1, &v1, &g1, &b1, 1e-3f, ACT_NONE, NULL});
    CHECK_NEAR(y[2], 1.0, 1e-6, "inference bn (3-1)/sqrt(4)");
}

// exp_vec against libm over the range the activations use, and at the clamps
TEST(exp_vec) {
    double worst = 0.0;
    for (float x = -87.0f; x <= 88.0f; x += 0.013f) {
        double e = fabs((double)exp_vec(x) - exp((double)x)) / exp((double)x);
        if (e > worst) worst = e;
    }
    CHECK(worst < 4e-7, "exp_vec relative error %.2e (want a few ulp, < 4e-7)", worst);
    CHECK(exp_vec(-1000.0f) > 0.0f && exp_vec(-1000.0f) < 1e-37f && isfinite(exp_vec(1000.0f)),
          "exp_vec clamps");
    CHECK(isnan(exp_vec(NAN)), "exp_vec(NaN) is NaN");
}

// The fast BN differs from the reference only in rounding: the statistics are
// both fp64 sums (one-pass shifted vs two-pass: agree to ~1e-15, then one
// rounding to fp32); z is the reference's expression, exp_vec is within a
// few ulp of expf, and dx adds sum_g/M and xhat·sum_gx/M as two terms with
// pre-divided constants. A few fp32 ulp of the largest value: 2e-6.
TEST(fast_bn_vs_ref) {
    Rng r; rng_seed(&r, 81);
    const Shape shapes[3] = {shape4(2, 7, 5, 37), shape4(1, 9, 11, 16), shape4(3, 4, 6, 5)};
    for (int si = 0; si < 3; si++)
        for (int act = ACT_NONE; act <= ACT_SIGMOID; act++)
            for (int acc = 0; acc < 2; acc++) {
                Shape s = shapes[si];
                const int C = s.c;
                const size_t n = shape_numel(s), M = n / C;
                float *x = randn(&r, n, 1.5f), *dy = randn(&r, n, 1.0f), *d0 = randn(&r, n, 1.0f);
                for (size_t i = 0; i < n; i++) x[i] += 3.0f;  // a mean far from 0
                float gam[37], bet[37], m1[37], v1[37], m2[37], v2[37];
                for (int c = 0; c < C; c++) {
                    gam[c] = 1.0f + 0.3f * rng_normal(&r);
                    bet[c] = 0.5f * rng_normal(&r);
                }
                bn_stats_cpu(&ops_cpu, tensor_f32(x, s), m1, v1, NULL, NULL, 0, NULL);
                bn_stats_ref(&ops_ref, tensor_f32(x, s), m2, v2, NULL, NULL, 0.0f, NULL);
                CHECK(rel_diff(m1, m2, C, 1e-3) < 1e-6 && rel_diff(v1, v2, C, 1e-3) < 1e-6,
                      "bn_stats fast vs reference, shape " SHAPE_FMT, SHAPE_ARGS(s));
                float *y1 = malloc(sizeof(float) * n), *y2 = malloc(sizeof(float) * n);
                bn_forward_cpu(
                    &ops_cpu, tensor_f32(y1, s), tensor_f32(x, s),
                    &(BnArgs){m2, v2, gam, bet, 1e-3f, (Act)act, NULL});
                bn_forward_ref(
                    &ops_ref, tensor_f32(y2, s), tensor_f32(x, s),
                    &(BnArgs){m2, v2, gam, bet, 1e-3f, (Act)act, NULL});
                double e = rel_diff(y1, y2, n, 1.0);
                CHECK(e < 2e-6, "bn_forward fast vs reference: %.2e (act %d, shape " SHAPE_FMT ")",
                      e, act, SHAPE_ARGS(s));
                float sg1[37], sgx1[37], sg2[37], sgx2[37];
                float dgam1[37] = {0}, dbet1[37] = {0}, dgam2[37] = {0}, dbet2[37] = {0};
                bn_backward_reduce_cpu(
                    &ops_cpu, tensor_f32(dy, s), tensor_f32(x, s),
                    &(BnArgs){m2, v2, gam, bet, 1e-3f, (Act)act, NULL}, sg1,
                    sgx1, dgam1, dbet1, NULL);
                bn_backward_reduce_ref(
                    &ops_ref, tensor_f32(dy, s), tensor_f32(x, s),
                    &(BnArgs){m2, v2, gam, bet, 1e-3f, (Act)act, NULL}, sg2,
                    sgx2, dgam2, dbet2, NULL);
                CHECK(rel_diff(sg1, sg2, C, 1.0) < 2e-6 && rel_diff(sgx1, sgx2, C, 1.0) < 2e-6 &&
                              rel_diff(dgam1, dgam2, C, 1.0) < 2e-6 &&
                              rel_diff(dbet1, dbet2, C, 1.0) < 2e-6,
                      "bn_backward_reduce fast vs reference (act %d, shape " SHAPE_FMT ")", act,
                      SHAPE_ARGS(s));
                // batch statistics, and inference mode (count 0)
                for (int batch = 0; batch < 2; batch++) {
                    memcpy(y1, d0, sizeof(float) * n);
                    memcpy(y2, d0, sizeof(float) * n);
                    bn_backward_data_cpu(
                        &ops_cpu, tensor_f32(y1, s), tensor_f32(dy, s),
                        tensor_f32(x, s),
                        &(BnArgs){m2, v2, gam, bet, 1e-3f, (Act)act, NULL}, sg2,
                        sgx2, batch ? M : 0, acc);
                    bn_backward_data_ref(
                        &ops_ref, tensor_f32(y2, s), tensor_f32(dy, s),
                        tensor_f32(x, s),
                        &(BnArgs){m2, v2, gam, bet, 1e-3f, (Act)act, NULL}, sg2,
                        sgx2, batch ? M : 0, acc);
                    e = rel_diff(y1, y2, n, 1.0);
                    CHECK(e < 2e-6,
                          "bn_backward_data fast vs reference: %.2e (act %d, acc %d, count %d, "
                          "shape " SHAPE_FMT ")",
                          e, act, acc, batch, SHAPE_ARGS(s));
                }
                free(x); free(dy); free(d0); free(y1); free(y2);
            }
}

// 16-bit storage through the fast BN (rows converted to fp32 and back) against
// the reference. The inputs are the same 16-bit values, so the fp64 reductions
// agree as in fp32 (2e-6); outputs are rounded once to the storage type, where
// exp_vec's few-ulp fp32 difference can flip one rounding: one ulp of the
// type at the largest value (bf16 2^-8, fp16 2^-11).
TEST(fast_bn_16bit) {
    Rng r; rng_seed(&r, 83);
    const Shape s = shape4(2, 5, 3, 21);  // one full channel block and a partial one
    const int C = s.c;
    const size_t n = shape_numel(s), M = n / C;
    for (int dt = DT_F16; dt <= DT_BF16; dt++)
        for (int act = ACT_NONE; act <= ACT_SIGMOID; act++)
            for (int acc = 0; acc < 2; acc++) {
                const double ulp = dt == DT_BF16 ? 1.0 / 256 : 1.0 / 2048;
                float *xv = randn(&r, n, 1.5f), *dyv = randn(&r, n, 1.0f), *d0 = randn(&r, n, 1.0f);
                uint16_t xb[n], dyb[n], y1b[n], y2b[n];
                Tensor x = tensor(xb, s, (DType)dt), dy = tensor(dyb, s, (DType)dt);
                Tensor y1 = tensor(y1b, s, (DType)dt), y2 = tensor(y2b, s, (DType)dt);
                for (size_t i = 0; i < n; i++) { st(x, i, xv[i] + 2.0f); st(dy, i, dyv[i]); }
                float gam[21], bet[21], m1[21], v1[21], m2[21], v2[21], f1[n], f2[n];
                for (int c = 0; c < C; c++) {
                    gam[c] = 1.0f + 0.3f * rng_normal(&r);
                    bet[c] = 0.5f * rng_normal(&r);
                }
                bn_stats_cpu(&ops_cpu, x, m1, v1, NULL, NULL, 0.0f, NULL);
                bn_stats_ref(&ops_ref, x, m2, v2, NULL, NULL, 0.0f, NULL);
                CHECK(rel_diff(m1, m2, C, 1e-3) < 2e-6 && rel_diff(v1, v2, C, 1e-3) < 2e-6,
                      "bn_stats %s", DT_NAME[dt]);
                bn_forward_cpu(
                    &ops_cpu, y1, x,
                    &(BnArgs){m2, v2, gam, bet, 1e-3f, (Act)act, NULL});
                bn_forward_ref(
                    &ops_ref, y2, x,
                    &(BnArgs){m2, v2, gam, bet, 1e-3f, (Act)act, NULL});
                for (size_t i = 0; i < n; i++) { f1[i] = ld(y1, i); f2[i] = ld(y2, i); }
                double e = rel_diff(f1, f2, n, 1.0);
                CHECK(e <= ulp, "bn_forward %s act %d: %.2e", DT_NAME[dt], act, e);
                float sg1[21], sgx1[21], sg2[21], sgx2[21];
                float dg1[21] = {0}, db1[21] = {0}, dg2[21] = {0}, db2[21] = {0};
                bn_backward_reduce_cpu(
                    &ops_cpu, dy, x,
                    &(BnArgs){m2, v2, gam, bet, 1e-3f, (Act)act, NULL}, sg1,
                    sgx1, dg1, db1, NULL);
                bn_backward_reduce_ref(
                    &ops_ref, dy, x,
                    &(BnArgs){m2, v2, gam, bet, 1e-3f, (Act)act, NULL}, sg2,
                    sgx2, dg2, db2, NULL);
                CHECK(rel_diff(sg1, sg2, C, 1.0) < 2e-6 && rel_diff(sgx1, sgx2, C, 1.0) < 2e-6 &&
                      rel_diff(dg1, dg2, C, 1.0) < 2e-6 && rel_diff(db1, db2, C, 1.0) < 2e-6,
                      "bn_backward_reduce %s act %d", DT_NAME[dt], act);
                for (int batch = 0; batch < 2; batch++) {
                    for (size_t i = 0; i < n; i++) { st(y1, i, d0[i]); st(y2, i, d0[i]); }
                    bn_backward_data_cpu(
                        &ops_cpu, y1, dy, x,
                        &(BnArgs){m2, v2, gam, bet, 1e-3f, (Act)act, NULL}, sg2,
                        sgx2, batch ? M : 0, acc);
                    bn_backward_data_ref(
                        &ops_ref, y2, dy, x,
                        &(BnArgs){m2, v2, gam, bet, 1e-3f, (Act)act, NULL}, sg2,
                        sgx2, batch ? M : 0, acc);
                    for (size_t i = 0; i < n; i++) { f1[i] = ld(y1, i); f2[i] = ld(y2, i); }
                    e = rel_diff(f1, f2, n, 1.0);
                    CHECK(e <= ulp, "bn_backward_data %s act %d acc %d count %d: %.2e", DT_NAME[dt],
                          act, acc, batch, e);
                }
                free(xv); free(dyv); free(d0);
            }
}

// Batch norm with the layer after it fused (BnNext), on each backend against
// the same backend's ops one after the other, to the bit: the fused kernels
// round where the unfused ops store. Shapes with whole 16-byte vectors (the
// fused kernels) and without (the ops in sequence); drop_path with rate 0
// and with a seed under which some of the 4 images are dropped and some kept;
// dresidual overwritten and added into; the sums-free reduce (dresidual only).
static int bytes_equal(Ops *o, const Tensor a, const Tensor b) {
    const size_t n = shape_numel(a.shape) * dtype_size(a.dtype);
    uint8_t *ha = malloc(n + 1), *hb = malloc(n + 1);
    o->download(o, ha, a.data, n);
    o->download(o, hb, b.data, n);
    const int same = !memcmp(ha, hb, n);
    free(ha); free(hb);
    return same;
}
static Tensor backend_tensor(Ops *o, const float *values, Shape s, DType dt) {
    const size_t n = shape_numel(s);
    Tensor h = tensor(malloc(n * dtype_size(dt) + 1), s, dt);
    for (size_t i = 0; i < n; i++) st(h, i, values[i]);
    Tensor t = tensor(o->alloc(o, n * dtype_size(dt) + 1), s, dt);
    o->upload(o, t.data, h.data, n * dtype_size(dt));
    free(h.data);
    return t;
}
static void bn_fused_case(Ops *o, Shape s, DType dt, Act act, float rate, Rng *r) {
    const int C = s.c, N = s.n;
    const size_t n = shape_numel(s), M = n / C;
    const uint64_t first_sample = 3;
    uint64_t seed = 1;
    if (rate > 0.0f) {  // some image dropped, some kept
        for (;; seed++) {
            int dropped = 0;
            for (int i = 0; i < N; i++)
                dropped += dropout_keep(rate, seed, first_sample + (uint64_t)i) == 0.0f;
            if (dropped > 0 && dropped < N) break;
        }
    }
    float *xv = randn(r, n, 2.0f), *resv = randn(r, n, 1.0f), *dyv = randn(r, n, 1.0f),
          *accv = randn(r, n, 1.0f);
    float mean[64], var[64], gamma[64], beta[64], host[2][64];
    for (int c = 0; c < C; c++) {
        mean[c] = 0.3f * rng_normal(r); var[c] = 3.0f + rng_float(r);
        gamma[c] = 1.0f + 0.3f * rng_normal(r); beta[c] = 0.3f * rng_normal(r);
    }
    void *dmean = o->alloc(o, sizeof mean), *dvar = o->alloc(o, sizeof var),
         *dgam = o->alloc(o, sizeof gamma), *dbet = o->alloc(o, sizeof beta),
         *dseed = o->alloc(o, sizeof seed);
    float *f32[8];  // sum_g, sum_gx, dgamma, dbeta of the fused [0..3] and the unfused [4..7] runs
    for (int k = 0; k < 8; k++) f32[k] = o->alloc(o, sizeof(float) * C);
    o->upload(o, dmean, mean, sizeof mean); o->upload(o, dvar, var, sizeof var);
    o->upload(o, dgam, gamma, sizeof gamma); o->upload(o, dbet, beta, sizeof beta);
    o->upload(o, dseed, &seed, sizeof seed);
    const float eps = 1e-3f;
    const char *where = o->name;
    char what[160];
    snprintf(what, sizeof what, "%s bn fused %s act %d rate %g shape " SHAPE_FMT, where,
             DT_NAME[dt], (int)act, (double)rate, SHAPE_ARGS(s));
    Tensor x = backend_tensor(o, xv, s, dt), res = backend_tensor(o, resv, s, dt);
    Tensor y = backend_tensor(o, accv, s, dt), y2 = backend_tensor(o, accv, s, dt);
    const Shape ps = shape4(N, 1, 1, C);
    float *zeros = calloc(n, sizeof(float));
    Tensor p1 = backend_tensor(o, zeros, ps, dt), p2 = backend_tensor(o, zeros, ps, dt);

    // forward, FUSED_POOL: y and the pool
    BnNext pool = {.kind = FUSED_POOL, .pooled = p1};
    o->bn_forward(o, y, x, &(BnArgs){dmean, dvar, dgam, dbet, eps, act, &pool});
    o->bn_forward(o, y2, x, &(BnArgs){dmean, dvar, dgam, dbet, eps, act, NULL});
    o->global_avg_pool_forward(o, p2, y2);
    CHECK(bytes_equal(o, y, y2) && bytes_equal(o, p1, p2),
          "%s: pool forward differs from bn_forward, global_avg_pool", what);

    // forward, FUSED_RESIDUAL: out alone (y has no memory)
    Tensor out1 = backend_tensor(o, accv, s, dt), out2 = backend_tensor(o, accv, s, dt);
    BnNext end = {.kind = FUSED_RESIDUAL, .out = out1, .residual = res, .rate = rate, .seed = dseed,
                  .first_sample = first_sample};
    o->bn_forward(o, tensor(NULL, s, dt), x,
                  &(BnArgs){dmean, dvar, dgam, dbet, eps, act, &end});
    o->bn_forward(o, y2, x, &(BnArgs){dmean, dvar, dgam, dbet, eps, act, NULL});
    if (rate > 0.0f) o->dropout_forward(o, out2, y2, res, rate, dseed, 1, first_sample);
    else o->add_forward(o, out2, y2, res);
    CHECK(bytes_equal(o, out1, out2),
          "%s: residual forward differs from bn_forward, dropout_forward", what);

    // backward, FUSED_RESIDUAL, with the sums (training statistics) and without (dresidual alone)
    for (int acc = 0; acc < 2; acc++)
        for (int sums = 0; sums < 2; sums++) {
            Tensor dy1 = backend_tensor(o, dyv, s, dt), dy2 = backend_tensor(o, dyv, s, dt);
            Tensor dres1 = backend_tensor(o, accv, s, dt), dres2 = backend_tensor(o, accv, s, dt);
            Tensor dx1 = backend_tensor(o, accv, s, dt), dx2 = backend_tensor(o, accv, s, dt);
            Tensor dyb = backend_tensor(o, zeros, s, dt);
            for (int k = 0; k < 8; k++)
                o->upload(o, f32[k], k % 4 >= 2 ? gamma : zeros, sizeof(float) * C);
            BnNext back = {.kind = FUSED_RESIDUAL,
                           .dresidual = dres1,
                           .accumulate_residual = acc,
                           .rate = rate,
                           .seed = dseed,
                           .first_sample = first_sample};
            o->bn_backward_reduce(
                o, dy1, x, &(BnArgs){dmean, dvar, dgam, dbet, eps, act, &back},
                sums ? f32[0] : NULL, f32[1], f32[2], f32[3], NULL);
            o->bn_backward_data(
                o, dx1, dy1, x,
                &(BnArgs){dmean, dvar, dgam, dbet, eps, act, &back},
                sums ? f32[0] : NULL, sums ? f32[1] : NULL, sums ? M : 0, acc);
            if (rate > 0.0f)
                o->dropout_backward(o, dyb, dres2, dy2, rate, dseed, 1, first_sample, 0, acc);
            else o->add_backward(o, dyb, dres2, dy2, 0, acc);
            if (sums)
              o->bn_backward_reduce(
                  o, dyb, x, &(BnArgs){dmean, dvar, dgam, dbet, eps, act, NULL},
                  f32[4], f32[5], f32[6], f32[7], NULL);
            o->bn_backward_data(
                o, dx2, dyb, x,
                &(BnArgs){dmean, dvar, dgam, dbet, eps, act, NULL},
                sums ? f32[4] : NULL, sums ? f32[5] : NULL, sums ? M : 0, acc);
            for (int k = 0; k < 4; k++) {
                o->download(o, host[0], f32[k], sizeof(float) * C);
                o->download(o, host[1], f32[k + 4], sizeof(float) * C);
                CHECK(!memcmp(host[0], host[1], sizeof(float) * C),
                      "%s acc %d sums %d: per-channel result %d differs", what, acc, sums, k);
            }
            CHECK(bytes_equal(o, dres1, dres2), "%s acc %d sums %d: dresidual differs", what, acc,
                  sums);
            CHECK(bytes_equal(o, dx1, dx2), "%s acc %d sums %d: dx differs", what, acc, sums);
            Tensor ts[7] = {dy1, dy2, dres1, dres2, dx1, dx2, dyb};
            for (int k = 0; k < 7; k++) o->free(o, ts[k].data);
        }
    Tensor ts[8] = {x, res, y, y2, p1, p2, out1, out2};
    for (int k = 0; k < 8; k++) o->free(o, ts[k].data);
    for (int k = 0; k < 8; k++) o->free(o, f32[k]);
    o->free(o, dmean); o->free(o, dvar); o->free(o, dgam); o->free(o, dbet); o->free(o, dseed);
    free(xv); free(resv); free(dyv); free(accv); free(zeros);
}
static void bn_fused_cases(Ops *o, uint64_t rng_seed_value) {
    Rng r; rng_seed(&r, rng_seed_value);
    const Shape shapes[3] = {shape4(4, 5, 7, 16), shape4(4, 3, 11, 24), shape4(4, 3, 5, 13)};
    for (int si = 0; si < 3; si++)
        for (int dt = 0; dt < 3; dt++)
            for (int a = 0; a < 2; a++)
                for (int k = 0; k < 2; k++)
                    bn_fused_case(o, shapes[si], (DType)dt, a ? ACT_SILU : ACT_NONE,
                                  k ? 0.4f : 0.0f, &r);
}
TEST(bn_fused_next) { bn_fused_cases(&ops_cpu, 91); }

#ifdef SEGNET_CUDA
// statistics and running update; per (shape, storage type)
TEST(cuda_bn_stats) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 81);
    // and 3,200 rows of 512 channels (4 channel tiles): 100 chunks of 32 rows would be 400
    // blocks, 0.76 of a wave of 528; the sums take 107 chunks of 30 rows (428 blocks, 0.81)
    const Shape wave_filling = {1, 40, 80, 512};
    for (int si = 0; si <= CU_NSHAPES; si++)
        for (int dt = 0; dt < 3; dt++) {
            const Shape s = si < CU_NSHAPES ? CU_SHAPES[si] : wave_filling;
            const int C = s.c;
            const size_t n = shape_numel(s), M = n / C;
            float *xv = randn(&r, n, 2.0f);
            // channel means far from 0
            for (size_t i = 0; i < n; i++) xv[i] += 1.5f + (float)(i % C);
            CuPair x = cu_pair(xv, s, (DType)dt);
            float mean[C], var[C], *nan = cu_nans(C);
            float *dmean = cu_floats(nan, C), *dvar = cu_floats(nan, C);
            ops_cpu.bn_stats(&ops_cpu, x.cpu, mean, var, NULL, NULL, 0.0f, NULL);
            o->bn_stats(o, x.gpu, dmean, dvar, NULL, NULL, 0.0f, NULL);
            // fp64 sums in another order, rounded once to fp32; the deviations from the fp32 mean
            cu_expect(cu_floats_err(dmean, mean, C), 4 * 0x1p-24, "bn_stats mean", (DType)dt);
            cu_expect(cu_floats_err(dvar, var, C), 4 * 0x1p-24, "bn_stats var", (DType)dt);

            float *rm = randn(&r, C, 1.0f), *rv = randn(&r, C, 1.0f);
            for (int c = 0; c < C; c++) rv[c] = fabsf(rv[c]) + 0.1f;
            float *drm = cu_floats(rm, C), *drv = cu_floats(rv, C), *drm2 = cu_floats(rm, C),
                  *drv2 = cu_floats(rv, C);
            ops_cpu.bn_update_running(&ops_cpu, rm, rv, mean, var, C, M, BN_MOMENTUM);
            // dmean, dvar: within 4 ulp of mean, var
            o->bn_update_running(o, drm, drv, dmean, dvar, C, M, BN_MOMENTUM);
            // the same update, in the stats' pass
            o->bn_stats(o, x.gpu, dmean, dvar, drm2, drv2, BN_MOMENTUM, NULL);
            // (1-m)·r + m·b: the batch statistics' 4 ulp, two products and a sum (FMA or not)
            cu_expect(cu_floats_err(drm, rm, C), 8 * 0x1p-24, "bn_update_running mean", (DType)dt);
            cu_expect(cu_floats_err(drv, rv, C), 8 * 0x1p-24, "bn_update_running var", (DType)dt);
            cu_expect(cu_floats_err(drm2, rm, C), 8 * 0x1p-24, "bn_stats running mean", (DType)dt);
            cu_expect(cu_floats_err(drv2, rv, C), 8 * 0x1p-24, "bn_stats running var", (DType)dt);
            o->free(o, drm2); o->free(o, drv2);

            // --sync-bn's pieces: the fp64 sums themselves (another order: 2^-53 per addition, far
            // below 2^-40), and bn_stats_finish of the CPU's sums: the same fp64 formula on the
            // same input (1 ulp where the device contracts Σx²/n - mean² into an FMA), the running
            // update in the same launch (8 ulp as above)
            double sums[2 * C], dsums_host[2 * C], *dsums = o->alloc(o, sizeof(double) * 2 * C);
            float mean2[C], var2[C];
            ops_cpu.bn_stats(&ops_cpu, x.cpu, mean2, var2, NULL, NULL, 0.0f, sums);
            o->bn_stats(o, x.gpu, dmean, dvar, NULL, NULL, 0.0f, dsums);
            o->download(o, dsums_host, dsums, sizeof dsums_host);
            double es = 0;
            for (int k = 0; k < 2 * C; k++)
                es = fmax(es, fabs(dsums_host[k] - sums[k]) / fmax(fabs(sums[k]), 1e-300));
            cu_expect(es, 0x1p-40, "bn_stats fp64 sums", (DType)dt);
            CHECK(!memcmp(mean2, mean, sizeof mean) && !memcmp(var2, var, sizeof var),
                  "bn_stats with sums: the same statistics");
            o->upload(o, dsums, sums, sizeof sums);
            ops_cpu.bn_stats_finish(&ops_cpu, sums, C, M, mean2, var2, rm, rv, BN_MOMENTUM);
            o->bn_stats_finish(o, dsums, C, M, dmean, dvar, drm, drv, BN_MOMENTUM);
            CHECK(!memcmp(mean2, mean, sizeof mean) && !memcmp(var2, var, sizeof var),
                  "bn_stats_finish of bn_stats' sums: bn_stats' statistics");
            cu_expect(fmax(cu_floats_err(dmean, mean, C), cu_floats_err(dvar, var, C)), 0x1p-24,
                      "bn_stats_finish", (DType)dt);
            cu_expect(fmax(cu_floats_err(drm, rm, C), cu_floats_err(drv, rv, C)), 8 * 0x1p-24,
                      "bn_stats_finish running", (DType)dt);
            o->free(o, dsums);
            o->free(o, dmean); o->free(o, dvar); o->free(o, drm); o->free(o, drv);
            free(rm); free(rv); free(nan); free(xv);
            cu_pair_free(&x);
        }
}

// forward, backward_reduce and backward_data, every activation, training (batch
// statistics, count = M) and inference (running statistics, count = 0), both
// accumulate modes. Each op gets the CPU's inputs (statistics, sums), so each is
// measured alone.
static void cuda_bn_forward_backward_cases(void) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 82);
    for (int si = 0; si < CU_NSHAPES; si++)
        for (int dt = 0; dt < 3; dt++)
            for (int training = 0; training < 2; training++) {
                const Shape s = CU_SHAPES[si];
                const int C = s.c;
                const size_t n = shape_numel(s), M = n / C;
                const float eps = BN_EPS_EFFNET;
                float *xv = randn(&r, n, 2.0f), *dyv = randn(&r, n, 1.0f);
                for (size_t i = 0; i < n; i++) xv[i] += 1.5f;
                CuPair x = cu_pair(xv, s, (DType)dt), dy = cu_pair(dyv, s, (DType)dt);
                float mean[C], var[C], *gamma = randn(&r, C, 0.5f), *beta = randn(&r, C, 0.5f);
                for (int c = 0; c < C; c++) gamma[c] += 1.0f;
                if (training) ops_cpu.bn_stats(&ops_cpu, x.cpu, mean, var, NULL, NULL, 0.0f, NULL);
                else
                    for (int c = 0; c < C; c++) {
                        mean[c] = 1.5f + 0.3f * rng_normal(&r);
                        var[c] = 2.0f + rng_float(&r);
                    }
                float *dmean = cu_floats(mean, C), *dvar = cu_floats(var, C);
                float *dgamma_v = cu_floats(gamma, C), *dbeta_v = cu_floats(beta, C);
                for (int a = 0; a < 4; a++) {
                    char what[64];
                    // forward: z to the same bits but for FMA contraction (1 ulp of z), the
                    // activation's exp (2 ulp on a GPU): 8 fp32 roundings of the largest |y|
                    CuPair y = cu_pair(NULL, s, (DType)dt);
                    ops_cpu.bn_forward(
                        &ops_cpu, y.cpu, x.cpu,
                        &(BnArgs){mean, var, gamma, beta, eps, (Act)a, NULL});
                    o->bn_forward(o, y.gpu, x.gpu,
                                  &(BnArgs){dmean, dvar, dgamma_v, dbeta_v, eps,
                                            (Act)a, NULL});
                    snprintf(what, sizeof what, "bn_forward %s %s", training ? "train" : "infer",
                             ACT_NAME[a]);
                    cu_expect(cu_pair_err(y), cu_tol((DType)dt, 8 * 0x1p-24), what, (DType)dt);
                    cu_pair_free(&y);

                    // reduce: sums overwritten (NaN before), dgamma/dbeta added into (random
                    // before). fp64 sums of the same g, g·xhat but for their last bits: 16 fp32
                    // roundings
                    float sg[C], sgx[C], *dg = randn(&r, C, 1.0f), *db = randn(&r, C, 1.0f),
                                         *nan = cu_nans(C);
                    float *dsg = cu_floats(nan, C), *dsgx = cu_floats(nan, C),
                          *ddg = cu_floats(dg, C), *ddb = cu_floats(db, C);
                    ops_cpu.bn_backward_reduce(
                        &ops_cpu, dy.cpu, x.cpu,
                        &(BnArgs){mean, var, gamma, beta, eps, (Act)a, NULL},
                        sg, sgx, dg, db, NULL);
                    o->bn_backward_reduce(o, dy.gpu, x.gpu,
                                          &(BnArgs){dmean, dvar, dgamma_v,
                                                    dbeta_v, eps, (Act)a, NULL},
                                          dsg, dsgx, ddg, ddb, NULL);
                    snprintf(what, sizeof what, "bn_backward_reduce %s %s",
                             training ? "train" : "infer", ACT_NAME[a]);
                    double e = fmax(fmax(cu_floats_err(dsg, sg, C), cu_floats_err(dsgx, sgx, C)),
                                    fmax(cu_floats_err(ddg, dg, C), cu_floats_err(ddb, db, C)));
                    cu_expect(e, 16 * 0x1p-24, what, (DType)dt);
                    // --sync-bn's pieces: the fp64 sums (the same bound, relative to the largest),
                    // and bn_backward_finish of the CPU's sums: casts and adds, the CPU's bits
                    double sums[2 * C], dsums_host[2 * C],
                            *dsums = o->alloc(o, sizeof(double) * 2 * C), scale = 1e-300;
                    float sg2[C], sgx2[C], dg2[C], db2[C];
                    memcpy(dg2, dg, sizeof dg2);
                    memcpy(db2, db, sizeof db2);
                    ops_cpu.bn_backward_reduce(
                        &ops_cpu, dy.cpu, x.cpu,
                        &(BnArgs){mean, var, gamma, beta, eps, (Act)a, NULL},
                        sg2, sgx2, NULL, NULL, sums);
                    o->bn_backward_reduce(o, dy.gpu, x.gpu,
                                          &(BnArgs){dmean, dvar, dgamma_v,
                                                    dbeta_v, eps, (Act)a, NULL},
                                          dsg, dsgx, NULL, NULL, dsums);
                    o->download(o, dsums_host, dsums, sizeof dsums_host);
                    e = 0;
                    for (int k = 0; k < 2 * C; k++) scale = fmax(scale, fabs(sums[k]));
                    for (int k = 0; k < 2 * C; k++)
                        e = fmax(e, fabs(dsums_host[k] - sums[k]) / scale);
                    snprintf(what, sizeof what, "bn_backward_reduce fp64 sums %s %s",
                             training ? "train" : "infer", ACT_NAME[a]);
                    cu_expect(e, 16 * 0x1p-24, what, (DType)dt);
                    CHECK(!memcmp(sg2, sg, sizeof sg2) && !memcmp(sgx2, sgx, sizeof sgx2),
                          "%s: the same sums", what);
                    o->upload(o, dsums, sums, sizeof sums);
                    ops_cpu.bn_backward_finish(&ops_cpu, sums, C, sg2, sgx2, dg2, db2);
                    float *dsg2 = cu_floats(nan, C), *dsgx2 = cu_floats(nan, C),
                          *ddg2 = cu_floats(dg, C), *ddb2 = cu_floats(db, C);
                    o->bn_backward_finish(o, dsums, C, dsg2, dsgx2, ddg2, ddb2);
                    float *h[4] = {cu_to_host(dsg2, C, DT_F32), cu_to_host(dsgx2, C, DT_F32),
                                   cu_to_host(ddg2, C, DT_F32), cu_to_host(ddb2, C, DT_F32)};
                    CHECK(!memcmp(h[0], sg2, sizeof sg2) && !memcmp(h[1], sgx2, sizeof sgx2) &&
                                  !memcmp(h[2], dg2, sizeof dg2) && !memcmp(h[3], db2, sizeof db2),
                          "bn_backward_finish %s: the CPU's bits", what);
                    CHECK(!memcmp(sg2, sg, sizeof sg2) && !memcmp(sgx2, sgx, sizeof sgx2),
                          "bn_backward_finish of bn_backward_reduce's sums: its sums");
                    for (int k = 0; k < 4; k++) free(h[k]);
                    o->free(o, dsums);
                    o->free(o, dsg2);
                    o->free(o, dsgx2);
                    o->free(o, ddg2);
                    o->free(o, ddb2);

                    // data: g - (sum_g + xhat·sum_gx)/count cancels: 32 fp32 roundings of the
                    // largest |dx|; inference passes NULL sums (count 0 must not read them)
                    float *dsg_cpu = cu_floats(sg, C), *dsgx_cpu = cu_floats(sgx, C);
                    for (int acc = 0; acc < 2; acc++) {
                        CuPair dx = cu_dest(&r, s, (DType)dt, acc);
                        ops_cpu.bn_backward_data(
                            &ops_cpu, dx.cpu, dy.cpu, x.cpu,
                            &(BnArgs){mean, var, gamma, beta, eps, (Act)a,
                                      NULL},
                            training ? sg : NULL, training ? sgx : NULL,
                            training ? M : 0, acc);
                        o->bn_backward_data(
                            o, dx.gpu, dy.gpu, x.gpu,
                            &(BnArgs){dmean, dvar, dgamma_v, dbeta_v, eps,
                                      (Act)a, NULL},
                            training ? dsg_cpu : NULL,
                            training ? dsgx_cpu : NULL, training ? M : 0, acc);
                        snprintf(what, sizeof what, "bn_backward_data %s %s acc %d",
                                 training ? "train" : "infer", ACT_NAME[a], acc);
                        cu_expect(cu_pair_err(dx), cu_tol((DType)dt, 32 * 0x1p-24), what,
                                  (DType)dt);
                        cu_pair_free(&dx);
                    }
                    o->free(o, dsg); o->free(o, dsgx); o->free(o, ddg); o->free(o, ddb);
                    o->free(o, dsg_cpu); o->free(o, dsgx_cpu);
                    free(dg); free(db); free(nan);
                }
                o->free(o, dmean); o->free(o, dvar); o->free(o, dgamma_v); o->free(o, dbeta_v);
                free(xv); free(dyv); free(gamma); free(beta);
                cu_pair_free(&x); cu_pair_free(&dy);
            }
}
TEST(cuda_bn_forward_backward) { with_narrow_rows_both(cuda_bn_forward_backward_cases); }

// bn_fused_cases (see test_bn_fused_next) on the emulated GPU
static void cuda_bn_fused_next_cases(void) { bn_fused_cases(cu_ops(), 92); }
TEST(cuda_bn_fused_next) { with_narrow_rows_both(cuda_bn_fused_next_cases); }
#endif

// ----------------------------------------------------------------------------
// softmax + weighted cross-entropy

// the loss gradient against finite differences of the loss itself
TEST(softmax_xent_grad) {
    const int K = 5, M = 2 * 3 * 4;
    Rng r; rng_seed(&r, 21);
    float *z = randn(&r, (size_t)M * K, 2.0f), *dz = malloc(sizeof(float) * M * K);
    float w[5] = {0.0f, 1.0f, 2.5f, 0.5f, 1.0f};
    int32_t y[24];
    for (int i = 0; i < M; i++) y[i] = (int32_t)(rng_next(&r) % K);
    Shape s = shape4(2, 3, 4, K);
    float inv = (float)(1.0 / label_weight_sum(y, M, w, K));
    float st0[3] = {0, 0, 0};
    ops_cpu.softmax_xent(&ops_cpu, tensor_f32(z, s), y, w, 0.0f, &(float){inv}, st0,
                         tensor_f32(dz, s));
    double maxfd = 0, maxdiff = 0;
    const float h = 1e-2f;
    for (int i = 0; i < M * K; i++) {
        float keep = z[i], sp[3] = {0, 0, 0}, sm[3] = {0, 0, 0};
        z[i] = keep + h;
        ops_cpu.softmax_xent(&ops_cpu, tensor_f32(z, s), y, w, 0.0f, &(float){inv}, sp,
                             tensor_f32(NULL, s));
        z[i] = keep - h;
        ops_cpu.softmax_xent(&ops_cpu, tensor_f32(z, s), y, w, 0.0f, &(float){inv}, sm,
                             tensor_f32(NULL, s));
        z[i] = keep;
        double fd = ((double)sp[0] - sm[0]) / (2.0 * h) * inv;  // d(Σ w·nll / Σ w)/dz
        if (fabs(fd) > maxfd) maxfd = fabs(fd);
        if (fabs(fd - dz[i]) > maxdiff) maxdiff = fabs(fd - dz[i]);
    }
    double e = maxdiff / maxfd;
    if (e > g_worst_xent) g_worst_xent = e;
    if (g_verbose) printf("    softmax_xent gradient error %.2e\n", e);
    CHECK(e < 5e-3, "softmax_xent gradient error %.3g", e);
    free(z); free(dz);
}

// softmax + weighted cross-entropy by hand, K = 2, class weights (0, 2):
//   pixel A: logits (0, ln 3), label 1: p = (1/4, 3/4), nll = ln(4/3), weight 2
//   pixel B: label 0, weight 0: contributes nothing to loss, weight or gradient
//   pixel C: label 5, outside 0..1: counted as invalid, contributes nothing
//   pixel D: SN_LABEL_IGNORED: contributes nothing, not counted as invalid
TEST(softmax_xent_by_hand) {
    float z[8] = {0.0f, logf(3.0f), 4.0f, -1.0f, 0.3f, 0.7f, 9.0f, -9.0f}, w[2] = {0.0f, 2.0f};
    int32_t y[4] = {1, 0, 5, SN_LABEL_IGNORED};
    float stats[3] = {0, 0, 0}, dz[8];
    Tensor tz = tensor_f32(z, shape4(1, 1, 4, 2));
    ops_cpu.softmax_xent(&ops_cpu, tz, y, w, 0.0f, &(float){0.5f}, stats,
                         tensor_f32(dz, shape4(1, 1, 4, 2)));
    CHECK_NEAR(stats[0], 2.0 * log(4.0 / 3.0), 1e-6, "weighted nll sum");
    CHECK_NEAR(stats[1], 2.0, 0, "weight sum");
    CHECK_NEAR(stats[2], 1.0, 0, "invalid labels");
    CHECK_NEAR(dz[0], 2.0 * 0.25 * 0.5, 1e-7, "dz A class 0 = w·p·inv_norm");
    CHECK_NEAR(dz[1], 2.0 * (0.75 - 1.0) * 0.5, 1e-7, "dz A class 1 = w·(p-1)·inv_norm");
    CHECK(dz[2] == 0 && dz[3] == 0 && dz[4] == 0 && dz[5] == 0 && dz[6] == 0 && dz[7] == 0,
          "weight-0, invalid and ignored pixels have zero gradient");
    CHECK_NEAR(label_weight_sum(y, 4, w, 2), 2.0, 0, "label_weight_sum");
    CHECK_NEAR(label_weight_sum(y, 4, NULL, 2), 2.0, 0, "label_weight_sum counts A and B");
    // stats add up over calls (micro-batches)
    ops_cpu.softmax_xent(&ops_cpu, tz, y, w, 0.0f, &(float){0.5f}, stats,
                         tensor_f32(NULL, tz.shape));
    CHECK_NEAR(stats[1], 4.0, 0, "stats accumulate");
    // extreme logits stay finite
    float big[2] = {1000.0f, -1000.0f}, s2[3] = {0, 0, 0}, w1[2] = {1, 1};
    int32_t y1 = 1;
    ops_cpu.softmax_xent(&ops_cpu, tensor_f32(big, shape4(1, 1, 1, 2)), &y1, w1, 0.0f,
                         &(float){1.0f}, s2, tensor_f32(NULL, shape4(1, 1, 1, 2)));
    CHECK_NEAR(s2[0], 2000.0, 1e-3, "nll of a logit 2000 below the max");
}

// the weighted-mean loss and Keras' pixel mean, by hand from the logits
TEST(weighted_loss_by_hand) {
    const float z[9] = {2.0f, 0.5f, -1.0f,   0.1f, 0.2f, 0.3f,   -2.0f, 1.0f, 4.0f};
    const int32_t y[3] = {0, 1, 2};
    const float w[3] = {0.5f, 2.0f, 0.0f};
    float stats[3] = {0, 0, 0};
    ops_cpu.softmax_xent(&ops_cpu, tensor_f32((float *)z, shape4(1, 1, 3, 3)), y, w, 0.0f,
                         &(float){0.0f}, stats, tensor(NULL, shape4(1, 1, 3, 3), DT_F32));
    double nll0 = log(exp(2.0) + exp(0.5) + exp(-1.0)) - 2.0;
    double nll1 = log(exp(0.1) + exp(0.2) + exp(0.3)) - 0.2;
    double weighted = (0.5 * nll0 + 2.0 * nll1) / 2.5, keras = (0.5 * nll0 + 2.0 * nll1) / 3.0;
    double norm = label_weight_sum(y, 3, w, 3);
    CHECK_NEAR(norm, 2.5, 1e-12, "Σ w[y]");
    CHECK_NEAR(stats[0] / norm, weighted, 1e-6, "weighted mean loss");
    CHECK_NEAR(stats[0] / 3.0, keras, 1e-6, "Keras' loss (pixel mean)");
    CHECK(fabs(weighted - keras) > 0.1, "the two normalisations differ on this example");
}

// ----------------------------------------------------------------------------
// the loss menu: focal and region terms against segmentation_models' formulas
// written out here in fp64 (Keras: sm.losses, sm.base.functional), and their
// gradients against central differences of those formulas

// p (K) = softmax(z), fp64
static void softmax_f64(const float *z, int K, double *p) {
    double m = -INFINITY, s = 0.0;
    for (int c = 0; c < K; c++) m = fmax(m, z[c]);
    for (int c = 0; c < K; c++) s += p[c] = exp(z[c] - m);
    for (int c = 0; c < K; c++) p[c] /= s;
}
// sm's CategoricalFocalLoss: mean over pixels and classes of -gt·α(1-pr)^γ·log pr, pr clipped
// to [1e-7, 1-1e-7] (valid pixels only, as ignore leaves them out)
static double sm_focal(const float *z, const int32_t *y, size_t M, int K, double gamma,
                       double alpha) {
    double sum = 0.0, p[16];
    size_t n = 0;
    for (size_t i = 0; i < M; i++) {
        if (y[i] < 0 || y[i] >= K) continue;
        softmax_f64(z + i * K, K, p);
        const double pr = fmin(fmax(p[y[i]], 1e-7), 1.0 - 1e-7);
        sum += -alpha * pow(1.0 - pr, gamma) * log(pr);
        n++;
    }
    return sum / ((double)n * K);
}
// sm's f_score (dice, β = 1) and iou_score over a group of pixels, generalised to Tversky
// as smp's soft_tversky_score: per class tp = Σ gt·pr, fp = Σ pr - tp, fn = Σ gt - tp;
// dice (2tp + s)/(2tp + fn + fp + s), jaccard (tp + s)/(tp + fp + fn + s), tversky
// (tp + s)/(tp + α·fp + β·fn + s). The group's loss: the classes' 1 - score averaged with
// weights w over the classes present (smp's convention; unweighted with every class present,
// sm's 1 - mean score), to the power γ.
static double region_loss_f64(const float *z, const int32_t *y, size_t M, int K, LossKind kind,
                              double s, const float *w, double ta, double tb, double tg) {
    double tp[16] = {0}, pr[16] = {0}, gt[16] = {0}, p[16];
    for (size_t i = 0; i < M; i++) {
        if (y[i] < 0 || y[i] >= K) continue;
        softmax_f64(z + i * K, K, p);
        for (int c = 0; c < K; c++) pr[c] += p[c];
        tp[y[i]] += p[y[i]];
        gt[y[i]] += 1.0;
    }
    double num = 0.0, den = 0.0;
    for (int c = 0; c < K; c++) {
        const double fp = pr[c] - tp[c], fn = gt[c] - tp[c];
        double score = kind == LOSS_DICE      ? (2 * tp[c] + s) / (2 * tp[c] + fn + fp + s)
                       : kind == LOSS_JACCARD ? (tp[c] + s) / (tp[c] + fp + fn + s)
                                              : (tp[c] + s) / (tp[c] + ta * fp + tb * fn + s);
        num += gt[c] > 0 ? w[c] * (1.0 - score) : 0.0;
        den += w[c];
    }
    return pow(num / den, tg);
}

// the focal term: value against sm's formula (1e-6), gradient against central
// differences of it (1e-5 of the largest element: a float gradient, fp64 differences over
// the float steps ±1e-3, truncation error ~h²·f''' ≈ 1e-7 relative); added into dlogits;
// γ = 0 is ce·α/K
TEST(loss_focal_by_hand) {
    enum { K = 4, M = 2 * 5 * 6 };
    Rng r;
    rng_seed(&r, 35);
    float *z = randn(&r, (size_t)M * K, 2.0f), dz[M * K], w[K];
    int32_t y[M];
    for (int i = 0; i < M; i++) y[i] = (int32_t)(rng_next(&r) % K);
    y[3] = SN_LABEL_IGNORED;
    const double gamma = 2.0, alpha = 0.25;
    for (int c = 0; c < K; c++) w[c] = (float)(alpha / K);
    const Shape s = shape4(2, 5, 6, K);
    const double n = label_weight_sum(y, M, NULL, K);
    const float before = 0x1p-20f;  // added into (small: its float sums keep the gradient's bits)
    for (int i = 0; i < M * K; i++) dz[i] = before;
    float stats[3] = {0, 0, 0};
    ops_cpu.softmax_focal(&ops_cpu, tensor_f32(z, s), y, w, (float)gamma, KERAS_EPSILON,
                          &(float){(float)(1.0 / n)}, stats, tensor_f32(dz, s));
    const double want = sm_focal(z, y, M, K, gamma, alpha);
    CHECK_NEAR(stats[0] / n, want, 1e-6 * want, "focal loss against sm's formula");
    double worst = 0.0, largest = 0.0;
    for (int i = 0; i < M * K; i++) {
        const float keep = z[i], zp = keep + 1e-3f, zm = keep - 1e-3f;
        z[i] = zp;
        const double up = sm_focal(z, y, M, K, gamma, alpha);
        z[i] = zm;
        const double down = sm_focal(z, y, M, K, gamma, alpha);
        z[i] = keep;
        const double fd = (up - down) / ((double)zp - zm);  // the steps as rounded to float
        largest = fmax(largest, fabs(fd));
        worst = fmax(worst, fabs(fd - ((double)dz[i] - before)));
    }
    if (g_verbose) printf("    focal gradient error %.2e of %.2e\n", worst / largest, largest);
    CHECK(worst <= 1e-5 * largest, "focal gradient error %.3g of %.3g", worst, largest);
    CHECK(dz[3 * K] == before && dz[3 * K + 1] == before,
          "an ignored pixel's gradient stays as it was");
    // γ = 0 is the cross-entropy (Keras' clip) times the weights
    float sf[3] = {0, 0, 0}, sx[3] = {0, 0, 0}, ones[K] = {1, 1, 1, 1};
    ops_cpu.softmax_focal(&ops_cpu, tensor_f32(z, s), y, ones, 0.0f, KERAS_EPSILON, NULL, sf,
                          tensor_f32(NULL, s));
    ops_cpu.softmax_xent(&ops_cpu, tensor_f32(z, s), y, ones, KERAS_EPSILON, NULL, sx,
                         tensor_f32(NULL, s));
    CHECK(sf[0] == sx[0] && sf[1] == sx[1], "focal γ = 0: %.9g, ce %.9g", sf[0], sx[0]);
    free(z);
}

// One region term through the ops (sums, then coefficients and gradient) on
// logits z (s) and labels y: its value, the gradient added into dz
static double region_term(Shape s, float *z, const int32_t *y, const LossCfg *l, const float *w,
                          int groups, float *dz) {
    const int K = s.c;
    float sums[3 * 16 * 4], coefs[2 * 16 * 4], loss = 0.0f;
    ops_cpu.region_sums(&ops_cpu, tensor_f32(z, s), y, groups, sums, NULL);
    const RegionArgs a = region_args(l, 0, groups);
    ops_cpu.region_grad(&ops_cpu, tensor_f32(z, s), y, groups, sums, &a, w, &(float){1.0f}, coefs,
                        &loss, tensor_f32(dz, s));
    (void)K;
    return loss;
}

// dice, jaccard and tversky (γ 1 and 1.5), over the batch and per image, with
// class weights, an absent class, ignored and out-of-range labels: values within
// 1e-6 of the formulas above, gradients within 1e-5 of central differences of them
TEST(loss_region_by_hand) {
    enum { K = 4, N = 3, H = 4, W = 5, M = N * H * W };
    const Shape s = shape4(N, H, W, K);
    Rng r;
    rng_seed(&r, 36);
    float *z = randn(&r, (size_t)M * K, 1.5f), dz[M * K];
    int32_t y[M];
    for (int i = 0; i < M; i++) y[i] = (int32_t)(rng_next(&r) % (K - 1));  // class 3 absent
    y[5] = SN_LABEL_IGNORED;
    y[7] = K;  // out of range: counted nowhere
    const float weights[2][K] = {{1, 1, 1, 1}, {0.0f, 0.1f, 0.45f, 0.45f}};
    const struct {
        LossKind kind;
        float smooth, ta, tb, tg;
    } cases[] = {
            {LOSS_DICE, 1e-5f, 0, 0, 1},
            {LOSS_DICE, 1.0f, 0, 0, 1},
            {LOSS_JACCARD, 1e-5f, 0, 0, 1},
            {LOSS_TVERSKY, 1e-5f, 0.3f, 0.7f, 1},
            {LOSS_TVERSKY, 0.5f, 0.7f, 0.3f, 1.5f},
    };
    for (size_t k = 0; k < sizeof cases / sizeof *cases; k++)
        for (int wi = 0; wi < 2; wi++)
            for (int per_image = 0; per_image < 2; per_image++) {
                LossCfg l = loss_cfg_default();
                l.kind[0] = cases[k].kind;
                l.smooth = cases[k].smooth;
                l.tversky_alpha = cases[k].ta;
                l.tversky_beta = cases[k].tb;
                l.tversky_gamma = cases[k].tg;
                const float *w = weights[wi];
                const int groups = per_image ? N : 1;
                const size_t per = M / groups;
                // the reference: the formula per group, averaged over the groups
                double ta = cases[k].ta, tb = cases[k].tb, tg = cases[k].tg;
                if (cases[k].kind != LOSS_TVERSKY) ta = tb = tg = 1.0;
#define REF_LOSS()                                                                                 \
    ({                                                                                             \
        double v_ = 0.0;                                                                           \
        for (int g_ = 0; g_ < groups; g_++)                                                        \
            v_ += region_loss_f64(z + g_ * per * K, y + g_ * per, per, K, cases[k].kind,           \
                                  cases[k].smooth, w, ta, tb, tg);                                 \
        v_ / groups;                                                                               \
    })
                memset(dz, 0, sizeof dz);
                const double got = region_term(s, z, y, &l, w, groups, dz), want = REF_LOSS();
                CHECK(fabs(got - want) <= 1e-6 * fmax(fabs(want), 1e-3),
                      "%s w%d per_image %d: loss %.9g, formula %.9g", LOSS_NAMES[cases[k].kind], wi,
                      per_image, got, want);
                double worst = 0.0, largest = 0.0;
                for (int i = 0; i < M * K; i++) {
                    const float keep = z[i], zp = keep + 1e-3f, zm = keep - 1e-3f;
                    z[i] = zp;
                    const double up = REF_LOSS();
                    z[i] = zm;
                    const double down = REF_LOSS();
                    z[i] = keep;
                    const double fd = (up - down) / ((double)zp - zm);
                    largest = fmax(largest, fabs(fd));
                    worst = fmax(worst, fabs(fd - dz[i]));
                }
#undef REF_LOSS
                if (g_verbose)
                    printf("    %s w%d per_image %d: loss %.6f, gradient error %.2e\n",
                           LOSS_NAMES[cases[k].kind], wi, per_image, got, worst / largest);
                CHECK(worst <= 1e-5 * largest, "%s w%d per_image %d: gradient error %.3g of %.3g",
                      LOSS_NAMES[cases[k].kind], wi, per_image, worst, largest);
                CHECK(dz[5 * K] == 0.0f && dz[7 * K + 2] == 0.0f,
                      "ignored and out-of-range pixels get no gradient");
            }
    free(z);
}

// region terms by hand on two pixels, K = 2: p = (1/4, 3/4) labelled 1, p = (1/2, 1/2)
// labelled 0. Class 0: I = 1/2, P = 3/4, G = 1; class 1: I = 3/4, P = 5/4, G = 1.
// dice (s = 0): S0 = 1/(7/4) = 4/7, S1 = (3/2)/(9/4) = 2/3, loss = 1 - (4/7 + 2/3)/2 = 8/21.
// jaccard: S0 = (1/2)/(5/4) = 2/5, S1 = (3/4)/(3/2) = 1/2, loss = 1 - 9/20 = 11/20.
TEST(loss_region_two_pixels) {
    float z[4] = {0.0f, logf(3.0f), 0.0f, 0.0f}, dz[4] = {0}, w[2] = {1, 1};
    const int32_t y[2] = {1, 0};
    LossCfg l = loss_cfg_default();
    l.smooth = 0.0f;
    l.kind[0] = LOSS_DICE;
    CHECK_NEAR(region_term(shape4(1, 1, 2, 2), z, y, &l, w, 1, dz), 8.0 / 21.0, 1e-7, "dice");
    l.kind[0] = LOSS_JACCARD;
    CHECK_NEAR(region_term(shape4(1, 1, 2, 2), z, y, &l, w, 1, dz), 11.0 / 20.0, 1e-7, "jaccard");
    // every weight 0: no loss, no gradient
    float zero[2] = {0, 0}, dz0[4] = {0};
    CHECK(region_term(shape4(1, 1, 2, 2), z, y, &l, zero, 1, dz0) == 0.0 && dz0[0] == 0.0f &&
                  dz0[1] == 0.0f,
          "weights 0: nothing");
}

// lovasz by its definition, in fp64: per class present, the pixels in decreasing error
// |[y=c] - p_c| (ties by index) found by selection, the Jaccard set function
// f(A) = 1 - (G - |A ∩ c|)/(G + |A \ c|) evaluated on each prefix A of that order, and
// L_c = Σ_j e_(j)·(f(A_j) - f(A_(j-1))); then Σ w_c·L_c / Σ w_c over the classes present
static double lovasz_loss_f64(const double *z, const int32_t *y, size_t M, int K, const float *w) {
    double *e = malloc(sizeof(double) * M), vsum = 0.0, wsum = 0.0;
    char *used = malloc(M);
    for (int c = 0; c < K; c++) {
        double G = 0.0;
        for (size_t i = 0; i < M; i++) {
            e[i] = -1.0;  // no label: takes no part
            if (y[i] < 0 || y[i] >= K) continue;
            double zmax = -INFINITY, sum = 0.0;
            for (int k = 0; k < K; k++) zmax = fmax(zmax, z[i * K + k]);
            for (int k = 0; k < K; k++) sum += exp(z[i * K + k] - zmax);
            const double p = exp(z[i * K + c] - zmax) / sum;
            e[i] = y[i] == c ? 1.0 - p : p;
            G += y[i] == c;
        }
        if (G == 0.0) continue;
        memset(used, 0, M);
        double L = 0.0, f_prev = 0.0, in = 0.0, out = 0.0;
        for (;;) {
            size_t best = M;
            for (size_t i = 0; i < M; i++)
                if (e[i] >= 0.0 && !used[i] && (best == M || e[i] > e[best])) best = i;
            if (best == M) break;
            used[best] = 1;
            in += y[best] == c;
            out += y[best] != c;
            const double f = 1.0 - (G - in) / (G + out);
            L += e[best] * (f - f_prev);
            f_prev = f;
        }
        vsum += w[c] * L;
        wsum += w[c];
    }
    free(e);
    free(used);
    return wsum > 0.0 ? vsum / wsum : 0.0;
}

// Ops.lovasz (ops_cpu) on logits z (s): its value, the gradient added into dz
static double lovasz_term(Shape s, const float *z, const int32_t *y, int groups, float scale,
                          const float *w, float *dz) {
    const size_t rows = shape_numel(s) / s.c;
    void *ws = malloc(lovasz_ws_bytes(groups, rows / groups, s.c));
    float loss = 0.0f;
    ops_cpu.lovasz(&ops_cpu, tensor_f32((float *)z, s), y, groups, scale, w, &(float){1.0f}, ws,
                   &loss, tensor_f32(dz, s));
    free(ws);
    return loss;
}

// lovasz by hand, K = 2: pixels labelled 1, 0, 1 with p_1 = .9, .2, .6. Class 1 (G = 2):
// errors .1, .2, .4 sorted .4 (in), .2 (out), .1 (in), weights 1/2, 1/6, 1/3: L_1 = 4/15.
// Class 0 (G = 1): errors .1, .2, .4 sorted .4 (out), .2 (in), .1 (out), weights 1/2, 1/2,
// 0: L_0 = 3/10. The loss: 17/60. Crisp (logits ±20), it is 1 - IoU: labels 1, 1, 0, 0
// predicted 1, 0, 0, 0 give IoU 1/2 and 2/3, loss 5/12. Then against the definition above
// (values within 1e-6, gradients within 1e-5 of its central differences) with class weights,
// an absent class, ignored and out-of-range labels, over the batch and per image.
TEST(loss_lovasz_by_hand) {
    float ones[4] = {1, 1, 1, 1};
    {
        const float z[6] = {0, logf(9.0f), 0, logf(0.25f), 0, logf(1.5f)};
        const int32_t y[3] = {1, 0, 1};
        float dz[6] = {0};
        CHECK_NEAR(lovasz_term(shape4(1, 1, 3, 2), z, y, 1, 1.0f, ones, dz), 17.0 / 60.0, 1e-7,
                   "three pixels");
        const float crisp[8] = {-20, 20, 20, -20, 20, -20, 20, -20};
        const int32_t yc[4] = {1, 1, 0, 0};
        CHECK_NEAR(lovasz_term(shape4(1, 2, 2, 2), crisp, yc, 1, 1.0f, ones, dz), 5.0 / 12.0, 1e-7,
                   "crisp: 1 - IoU");
    }
    enum { K = 4, N = 3, H = 4, W = 5, M = N * H * W };
    const Shape s = shape4(N, H, W, K);
    Rng r;
    rng_seed(&r, 38);
    float *z = randn(&r, (size_t)M * K, 1.5f), dz[M * K];
    double zd[M * K];
    for (int i = 0; i < M * K; i++) zd[i] = z[i];
    int32_t y[M];
    for (int i = 0; i < M; i++) y[i] = (int32_t)(rng_next(&r) % (K - 1));  // class 3 absent
    for (int i = 2 * M / 3; i < M; i++) y[i] = y[i] == 2 ? 1 : y[i];  // 2 absent from image 2
    y[5] = SN_LABEL_IGNORED;
    y[7] = K;  // out of range: takes no part
    const float weights[2][K] = {{1, 1, 1, 1}, {0.0f, 0.1f, 0.45f, 0.45f}};
    for (int wi = 0; wi < 2; wi++)
        for (int per_image = 0; per_image < 2; per_image++) {
            const float *w = weights[wi], scale = 0.75f;
            const int groups = per_image ? N : 1;
            const size_t per = M / groups;
#define REF_LOSS()                                                                                 \
    ({                                                                                             \
        double v_ = 0.0;                                                                           \
        for (int g_ = 0; g_ < groups; g_++)                                                        \
            v_ += lovasz_loss_f64(zd + g_ * per * K, y + g_ * per, per, K, w);                     \
        scale *v_;                                                                                 \
    })
            memset(dz, 0, sizeof dz);
            const double got = lovasz_term(s, z, y, groups, scale, w, dz), want = REF_LOSS();
            CHECK(fabs(got - want) <= 1e-6 * fabs(want),
                  "w%d per_image %d: loss %.9g, formula %.9g", wi, per_image, got, want);
            double worst = 0.0, largest = 0.0;
            for (int i = 0; i < M * K; i++) {
                const double keep = zd[i], h = 1e-6;
                zd[i] = keep + h;
                const double up = REF_LOSS();
                zd[i] = keep - h;
                const double down = REF_LOSS();
                zd[i] = keep;
                const double fd = (up - down) / (2 * h);
                largest = fmax(largest, fabs(fd));
                worst = fmax(worst, fabs(fd - dz[i]));
            }
#undef REF_LOSS
            if (g_verbose)
                printf("    lovasz w%d per_image %d: loss %.6f, gradient error %.2e\n", wi,
                       per_image, got, worst / largest);
            CHECK(worst <= 1e-5 * largest, "w%d per_image %d: gradient error %.3g of %.3g", wi,
                  per_image, worst, largest);
            CHECK(dz[5 * K] == 0.0f && dz[7 * K + 2] == 0.0f,
                  "ignored and out-of-range pixels get no gradient");
        }
    // no class present (every label ignored): no loss, no gradient
    int32_t none[M];
    for (int i = 0; i < M; i++) none[i] = SN_LABEL_IGNORED;
    memset(dz, 0, sizeof dz);
    CHECK(lovasz_term(s, z, none, N, 1.0f, ones, dz) == 0.0 && dz[0] == 0.0f, "nothing labelled");
    free(z);
}

static int run_shell(const char *cmd, char *msg, size_t size);

// Parity with segmentation_models_pytorch (ref/losses_smp.py, float64 autograd):
// dice, jaccard and tversky (γ 1 and 1.5), with and without class weights
// (the seed's 0, .1, .45, .45), smooth 1e-5 and 1, over the batch and per image;
// lovasz (float32 in smp; it has no class weights) over the batch and per image;
// ignored pixels, and a class absent from one image. smp comes from PyPI into a
// venv beside Debian's torch (SEGNET_SMP_VENV, default /tmp/segnet_smp_venv, made
// once); without it the test says so and skips. Tolerances: the issue's 1e-6 of
// the loss and 1e-5 of the gradient's largest element (segnet's sums are fp64,
// its coefficients and gradient fp32).
// The python of a venv with segmentation-models-pytorch 0.6.0 (and timm) beside Debian's
// torch: SEGNET_SMP_VENV, default /tmp/segnet_smp_venv, made once. 0, or -1 after a line
// saying why it could not be made.
static int smp_python(char *python, size_t size) {
    const char *venv =
            getenv("SEGNET_SMP_VENV") ? getenv("SEGNET_SMP_VENV") : "/tmp/segnet_smp_venv";
    char cmd[2048], msg[4096];
    snprintf(python, size, "%s/bin/python", venv);
    snprintf(cmd, sizeof cmd,
             "%s -c 'import segmentation_models_pytorch' 2>/dev/null || { /usr/bin/python3 -m "
             "venv --system-site-packages %s && %s/bin/pip install -q "
             "segmentation-models-pytorch==0.6.0; }",
             python, venv, venv);
    if (run_shell(cmd, msg, sizeof msg) == 0) return 0;
    printf("    smp parity not run: cannot install segmentation-models-pytorch into %s: %.300s\n",
           venv, msg);
    return -1;
}
#define SKIP_NO_SMP "segmentation-models-pytorch could not be installed from PyPI (see above)"

TEST(parity_live_smp_losses) {
    enum { N = 2, H = 8, W = 9, K = 4, M = N * H * W };
    char python[600], cmd[2048], msg[4096];
    if (smp_python(python, sizeof python)) SKIP(SKIP_NO_SMP);
    Rng r;
    rng_seed(&r, 37);
    float *z = randn(&r, (size_t)M * K, 2.0f);
    int32_t y[M];
    for (int i = 0; i < M; i++) y[i] = (int32_t)(rng_next(&r) % K);
    for (int i = M / 2; i < M; i++) y[i] = y[i] == 3 ? 2 : y[i];  // class 3 absent from image 1
    for (int i = 0; i < M; i += 11) y[i] = SN_LABEL_IGNORED;
    const float weights[2][K] = {{1, 1, 1, 1}, {0.0f, 0.1f, 0.45f, 0.45f}};
    const struct {
        LossKind kind;
        float smooth, ta, tb, tg;
    } kinds[] = {
            {LOSS_DICE, 1e-5f, 0, 0, 1},          {LOSS_DICE, 1.0f, 0, 0, 1},
            {LOSS_JACCARD, 1e-5f, 0, 0, 1},       {LOSS_JACCARD, 1.0f, 0, 0, 1},
            {LOSS_TVERSKY, 1e-5f, 0.3f, 0.7f, 1}, {LOSS_TVERSKY, 1.0f, 0.7f, 0.3f, 1.5f},
    };
    enum { REGION_CASES = 6 * 2 * 2, CASES = REGION_CASES + 2 };  // then lovasz, per image 0, 1
    char in[64], out[64];
    snprintf(in, sizeof in, "/tmp/segnet_smp_in.%d", (int)getpid());
    snprintf(out, sizeof out, "/tmp/segnet_smp_out.%d", (int)getpid());
    FILE *f = fopen(in, "wb");
    const int32_t hdr[5] = {N, H, W, K, CASES};
    fwrite(hdr, sizeof hdr, 1, f);
    fwrite(y, sizeof y, 1, f);
    fwrite(z, sizeof(float), (size_t)M * K, f);
    for (int c = 0; c < CASES; c++) {
        const int k = c / 4, wi = c / 2 % 2, per_image = c % 2;
        if (c >= REGION_CASES) {
            const int32_t head[2] = {LOSS_LOVASZ - LOSS_DICE, c - REGION_CASES};
            const double constants[4] = {0}, wd[K] = {1, 1, 1, 1};
            fwrite(head, sizeof head, 1, f);
            fwrite(constants, sizeof constants, 1, f);
            fwrite(wd, sizeof wd, 1, f);
            continue;
        }
        const int32_t head[2] = {kinds[k].kind - LOSS_DICE, per_image};
        const double constants[4] = {kinds[k].smooth, kinds[k].ta, kinds[k].tb, kinds[k].tg};
        double wd[K];
        for (int j = 0; j < K; j++) wd[j] = weights[wi][j];
        fwrite(head, sizeof head, 1, f);
        fwrite(constants, sizeof constants, 1, f);
        fwrite(wd, sizeof wd, 1, f);
    }
    fclose(f);
    snprintf(cmd, sizeof cmd, "%s ref/losses_smp.py %s %s", python, in, out);
    CHECK(run_shell(cmd, msg, sizeof msg) == 0, "%s: %.300s", cmd, msg);
    f = fopen(out, "rb");
    CHECK(f != NULL, "reading %s", out);
    double worst_loss = 0.0, worst_grad = 0.0;
    for (int c = 0; f && c < CASES; c++) {
        const int lovasz = c >= REGION_CASES, k = lovasz ? 0 : c / 4, wi = lovasz ? 0 : c / 2 % 2,
                  per_image = lovasz ? c - REGION_CASES : c % 2;
        double want, grad[M * K];
        CHECK(fread(&want, sizeof want, 1, f) == 1 && fread(grad, sizeof grad, 1, f) == 1,
              "%s: case %d missing", out, c);
        LossCfg l = loss_cfg_default();
        l.kind[0] = kinds[k].kind;
        l.smooth = kinds[k].smooth;
        if (kinds[k].kind == LOSS_TVERSKY) {
            l.tversky_alpha = kinds[k].ta;
            l.tversky_beta = kinds[k].tb;
            l.tversky_gamma = kinds[k].tg;
        }
        float dz[M * K] = {0};
        const int groups = per_image ? N : 1;
        const double got =
                lovasz ? lovasz_term(shape4(N, H, W, K), z, y, groups, 1.0f / groups, weights[0],
                                     dz)
                       : region_term(shape4(N, H, W, K), z, y, &l, weights[wi], groups, dz);
        double largest = 0.0, e = 0.0;
        for (int i = 0; i < M * K; i++) {
            largest = fmax(largest, fabs(grad[i]));
            e = fmax(e, fabs(dz[i] - grad[i]));
        }
        const double el = fabs(got - want) / fabs(want);
        worst_loss = fmax(worst_loss, el);
        worst_grad = fmax(worst_grad, e / largest);
        CHECK(el <= 1e-6 && e <= 1e-5 * largest,
              "%s smooth %g weights %d per_image %d: loss %.9g, smp %.9g; gradient error %.3g "
              "of %.3g",
              lovasz ? "lovasz" : LOSS_NAMES[kinds[k].kind], kinds[k].smooth, wi, per_image, got,
              want, e, largest);
    }
    if (f) fclose(f);
    unlink(in);
    unlink(out);
    printf("    smp DiceLoss/JaccardLoss/TverskyLoss/LovaszLoss, %d cases: loss %.2g, gradient "
           "%.2g "
           "(relative)\n",
           CASES, worst_loss, worst_grad);
    free(z);
}

// pixels of weight-0 classes change neither the loss, nor the gradient, nor the metrics
TEST(weight0_pixels_ignored) {
    enum { K = 4 };
    const Shape s = shape4(2, 4, 4, K);
    const size_t M = shape_numel(s) / K;
    const float w[K] = {0, 0, 1, 2};  // two ignored classes, so labels can change among them
    Rng r;
    rng_seed(&r, 7);
    float *za = randn(&r, M * K, 2.0f), *zb = malloc(sizeof(float) * M * K);
    int32_t *ya = malloc(sizeof(int32_t) * M), *yb = malloc(sizeof(int32_t) * M);
    memcpy(zb, za, sizeof(float) * M * K);
    int n_ignored = 0;
    for (size_t i = 0; i < M; i++) {
        ya[i] = (int32_t)(rng_next(&r) % K);
        yb[i] = ya[i];
        if (w[ya[i]] == 0) {  // another ignored label and other logits at this pixel
            n_ignored++;
            yb[i] = 1 - ya[i];
            for (int k = 0; k < K; k++) zb[i * K + k] = 5.0f * rng_normal(&r);
        }
    }
    CHECK(n_ignored > 4 && n_ignored < (int)M - 4,
          "the example mixes ignored and counted pixels (%d)", n_ignored);
    float *ga = malloc(sizeof(float) * M * K), *gb = malloc(sizeof(float) * M * K);
    float sa[3] = {0}, sb[3] = {0};
    double na = label_weight_sum(ya, M, w, K), nb = label_weight_sum(yb, M, w, K);
    CHECK(na == nb, "weight sums %g vs %g", na, nb);
    ops_cpu.softmax_xent(&ops_cpu, tensor_f32(za, s), ya, w, 0.0f, &(float){(float)(1 / na)}, sa,
                         tensor_f32(ga, s));
    ops_cpu.softmax_xent(&ops_cpu, tensor_f32(zb, s), yb, w, 0.0f, &(float){(float)(1 / nb)}, sb,
                         tensor_f32(gb, s));
    CHECK(sa[0] == sb[0] && sa[1] == sb[1], "loss sums %g/%g vs %g/%g", sa[0], sa[1], sb[0], sb[1]);
    int bad = 0;
    for (size_t i = 0; i < M; i++)
        for (int k = 0; k < K; k++)
            bad += w[ya[i]] == 0 ? (ga[i * K + k] != 0 || gb[i * K + k] != 0)
                                 : ga[i * K + k] != gb[i * K + k];
    CHECK(bad == 0, "%d gradient entries differ or are non-zero at ignored pixels", bad);
    int64_t ca[K * K] = {0}, cb[K * K] = {0};
    ops_cpu.confusion_accumulate(&ops_cpu, tensor_f32(za, s), ya, ca);
    ops_cpu.confusion_accumulate(&ops_cpu, tensor_f32(zb, s), yb, cb);
    double ia[K], ib[K];
    Metrics ma = {.iou = ia}, mb = {.iou = ib};
    metrics_compute(ca, K, w, &ma);
    metrics_compute(cb, K, w, &mb);
    CHECK(ma.mean_iou == mb.mean_iou && ma.accuracy == mb.accuracy, "metrics %g/%g vs %g/%g",
          ma.mean_iou, ma.accuracy, mb.mean_iou, mb.accuracy);
    for (int k = 2; k < K; k++) CHECK(ia[k] == ib[k], "IoU_%d %g vs %g", k, ia[k], ib[k]);
    free(za); free(zb); free(ya); free(yb); free(ga); free(gb);
}

// --loss-norm keras is the seed's loss: Keras' categorical cross-entropy takes
// the softmax, clips p[y] to [1e-7, 1 - 1e-7] and takes -log; a pixel whose
// p[y] the clip moved has no gradient. Computed here from the probabilities.
TEST(keras_clipped_xent) {
    // pixels: confidently wrong (clipped low), confidently right (clipped high), ordinary, ordinary
    const float z[4 * 3] = {30.0f, 0.0f,  0.0f, 0.0f, 40.0f, 0.0f,
                            0.3f,  -0.2f, 0.5f, 1.0f, 2.0f,  -1.0f};
    const int32_t y[4] = {1, 1, 2, 0};
    const float w[3] = {0.5f, 1.0f, 2.0f};
    float stats[3] = {0}, dz[12];
    const Shape s = shape4(1, 1, 4, 3);
    ops_cpu.softmax_xent(&ops_cpu, tensor_f32((float *)z, s), y, w, KERAS_EPSILON, &(float){1.0f},
                         stats, tensor_f32(dz, s));
    double want = 0.0, wsum = 0.0;
    for (int i = 0; i < 4; i++) {
        double e[3], sum = 0.0;
        for (int c = 0; c < 3; c++) sum += e[c] = exp((double)z[3 * i + c]);
        const double p = e[y[i]] / sum, eps = KERAS_EPSILON,
                     clipped = p < eps         ? eps
                               : p > 1.0 - eps ? 1.0 - eps
                                               : p;
        want += w[y[i]] * -log(clipped);
        wsum += w[y[i]];
        for (int c = 0; c < 3; c++) {
            const double g = clipped != p ? 0.0 : w[y[i]] * (e[c] / sum - (c == y[i]));
            CHECK(fabs(dz[3 * i + c] - g) <= 1e-7, "pixel %d class %d: gradient %.9g, Keras %.9g",
                  i, c, dz[3 * i + c], g);
        }
    }
    CHECK_NEAR(stats[0], want, 1e-6 * want, "Σ w·(-log clip(p[y]))");
    CHECK_NEAR(stats[1], wsum, 0, "Σ w");
    CHECK_NEAR(stats[0] / 1.0,
               1.0 * -log(1e-7) + 1.0 * -log(1.0 - 1e-7) +
                       2.0 * -log(exp(0.5) / (exp(0.3) + exp(-0.2) + exp(0.5))) +
                       0.5 * -log(exp(1.0) / (exp(1.0) + exp(2.0) + exp(-1.0))),
               2e-5, "the four pixels' terms written out");
}

#ifdef SEGNET_CUDA
// Labels for a loss test: mostly 0..K-1, every 7th outside (-1, K, 1000).
static int32_t *cu_labels(Rng *r, size_t rows, int K) {
    int32_t *y = malloc(sizeof(int32_t) * rows);
    const int32_t invalid[3] = {-1, K, 1000};
    for (size_t i = 0; i < rows; i++)
        y[i] = i % 7 == 3 ? invalid[(i / 7) % 3] : (int32_t)(rng_next(r) % (uint64_t)K);
    return y;
}

// softmax_xent against the CPU op: K = 1, 2, 3, 7, a class weight 0, invalid
// labels, stats added into nonzero values, with and without the gradient.
// Tolerances: the CPU sums each row's exponentials in fp64, the kernel in fp32
// (expf and logf within 2 ulp, K terms): the loss sum within 1e-6 relative;
// Σ w and the invalid count are sums of small exact values: equal. The
// gradient is within 1e-6 of its largest element in fp32 (p computed in fp32
// vs fp64), plus a storage ulp where it is stored in fp16/bf16.
TEST(cuda_softmax_xent) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 74);
    const int Ks[4] = {1, 2, 3, 7};
    for (int ki = 0; ki < 4; ki++)
        for (int big = 0; big < 2; big++) {
            const int K = Ks[ki];
            Shape s = big ? shape4(2, 33, 31, K) : shape4(2, 3, 5, K);  // 2046 rows: 8 blocks
            size_t rows = shape_numel(s) / K;
            // big: logits up to ±40, so that Keras' clip (p[y] in [1e-7, 1-1e-7]) moves many pixels
            float *z = randn(&r, shape_numel(s), big ? 12.0f : 3.0f), w[7];
            const float clip = big ? KERAS_EPSILON : 0.0f;
            for (int c = 0; c < K; c++) w[c] = c == 1 ? 0.0f : 0.5f + 1.5f * rng_float(&r);
            int32_t *y = cu_labels(&r, rows, K), *y_gpu = o->alloc(o, sizeof(int32_t) * rows);
            o->upload(o, y_gpu, y, sizeof(int32_t) * rows);
            float *w_gpu = cu_floats(w, K), *stats_gpu = o->alloc(o, 3 * sizeof(float));
            const float inv_norm = (float)(1.0 / fmax(label_weight_sum(y, rows, w, K), 1.0));
            for (int a = 0; a < 3; a++)
                for (int with_grad = 0; with_grad < 2; with_grad++) {
                    CuPair t = cu_pair(z, s, (DType)a), dz = cu_pair(NULL, s, (DType)a);
                    float stats[3] = {0.5f, 1.5f, 2.0f}, gs[3];
                    o->upload(o, stats_gpu, stats, sizeof stats);
                    Tensor dz_cpu = dz.cpu, dz_gpu = dz.gpu;
                    if (!with_grad) dz_cpu.data = dz_gpu.data = NULL;
                    ops_cpu.softmax_xent(&ops_cpu, t.cpu, y, w, clip, &(float){inv_norm}, stats,
                                         dz_cpu);
                    float *scale_gpu = cu_floats(&inv_norm, 1);
                    o->softmax_xent(o, t.gpu, y_gpu, w_gpu, clip, scale_gpu, stats_gpu, dz_gpu);
                    o->free(o, scale_gpu);
                    o->download(o, gs, stats_gpu, sizeof gs);
                    cu_check_err("softmax_xent loss", (DType)a,
                                 fabs((double)gs[0] - stats[0]) / fabs(stats[0]), 1e-6);
                    CHECK(gs[1] == stats[1] && gs[2] == stats[2],
                          "softmax_xent K=%d %s: Σw %.9g invalid %g, CPU %.9g %g", K, DT_NAME[a],
                          gs[1], gs[2], stats[1], stats[2]);
                    if (with_grad)
                        cu_check_err("softmax_xent dlogits", (DType)a, cu_pair_err(dz),
                                     1e-6 + CU_ULP[a]);
                    // the clip acted: rows of a weighted class without gradient (fp32: dz.cpu holds
                    // floats)
                    if (with_grad && clip > 0.0f && K > 1 && dz.cpu.dtype == DT_F32) {
                        size_t flat = 0;
                        for (size_t i = 0; i < rows; i++) {
                            // cu_labels draws some out of range
                            int zero = y[i] >= 0 && y[i] < K && w[y[i]] != 0.0f;
                            for (int c = 0; c < K && zero; c++)
                                zero = ((float *)dz.cpu.data)[i * K + c] == 0.0f;
                            flat += zero;
                        }
                        CHECK(flat > rows / 20, "K=%d: the clip left %zu of %zu rows flat", K, flat,
                              rows);
                    }
                    cu_pair_free(&t); cu_pair_free(&dz);
                }
            o->free(o, y_gpu); o->free(o, w_gpu); o->free(o, stats_gpu);
            free(z); free(y);
        }
}

// softmax_focal against the CPU op: K = 1, 2, 4, 7, γ = 2 and 0.5, invalid labels,
// dlogits added into. Tolerances as cuda_softmax_xent's: the kernel's per-row
// arithmetic is fp32 (the focal factors fp64 from the fp32 nll), the CPU's fp64.
TEST(cuda_softmax_focal) {
    Ops *o = cu_ops();
    Rng r;
    rng_seed(&r, 75);
    const int Ks[4] = {1, 2, 4, 7};
    for (int ki = 0; ki < 4; ki++)
        for (int gi = 0; gi < 2; gi++) {
            const int K = Ks[ki];
            const float gamma = gi ? 0.5f : 2.0f;
            Shape s = shape4(2, 33, 31, K);
            size_t rows = shape_numel(s) / K;
            float *z = randn(&r, shape_numel(s), 4.0f), *before = randn(&r, shape_numel(s), 0.1f),
                  w[7];
            for (int c = 0; c < K; c++) w[c] = 0.25f / K * (0.5f + rng_float(&r));
            int32_t *y = cu_labels(&r, rows, K), *y_gpu = o->alloc(o, sizeof(int32_t) * rows);
            o->upload(o, y_gpu, y, sizeof(int32_t) * rows);
            const float scale = 1.0f / (float)rows;
            float *w_gpu = cu_floats(w, K), *stats_gpu = o->alloc(o, 3 * sizeof(float)),
                  *scale_gpu = cu_floats(&scale, 1);
            for (int a = 0; a < 3; a++) {
                CuPair t = cu_pair(z, s, (DType)a), dz = cu_pair(before, s, (DType)a);
                float stats[3] = {0.5f, 1.5f, 2.0f}, gs[3];
                o->upload(o, stats_gpu, stats, sizeof stats);
                ops_cpu.softmax_focal(&ops_cpu, t.cpu, y, w, gamma, KERAS_EPSILON, &scale, stats,
                                      dz.cpu);
                o->softmax_focal(o, t.gpu, y_gpu, w_gpu, gamma, KERAS_EPSILON, scale_gpu, stats_gpu,
                                 dz.gpu);
                o->download(o, gs, stats_gpu, sizeof gs);
                cu_check_err("softmax_focal loss", (DType)a,
                             fabs((double)gs[0] - stats[0]) / fabs(stats[0]), 1e-6);
                CHECK(gs[1] == stats[1] && gs[2] == stats[2], "softmax_focal K=%d: Σw, invalid", K);
                cu_check_err("softmax_focal dlogits", (DType)a, cu_pair_err(dz), 1e-6 + CU_ULP[a]);
                cu_pair_free(&t);
                cu_pair_free(&dz);
            }
            o->free(o, y_gpu);
            o->free(o, w_gpu);
            o->free(o, stats_gpu);
            o->free(o, scale_gpu);
            free(z);
            free(before);
            free(y);
        }
}

// region_sums and region_grad against the CPU ops: K = 1, 2, 4, 7, one group and
// one per image, invalid labels, dlogits added into, fp16 loss scale 4. The sums:
// the kernel's p is fp32 (the CPU's fp64), summed in fp64 either way: within 1e-6
// relative of the largest. region_grad is fed the CPU's sums, so that the
// coefficients (region_coefs, the same fp64 code) agree to a rounding of their own
// (1e-6) and the gradient to 1e-6 of its largest element plus a storage ulp.
TEST(cuda_region_losses) {
    Ops *o = cu_ops();
    Rng r;
    rng_seed(&r, 76);
    const int Ks[4] = {1, 2, 4, 7};
    for (int ki = 0; ki < 4; ki++)
        for (int per_image = 0; per_image < 2; per_image++) {
            const int K = Ks[ki], N = 3, groups = per_image ? N : 1;
            Shape s = shape4(N, 29, 31, K);
            size_t rows = shape_numel(s) / K;
            float *z = randn(&r, shape_numel(s), 2.0f), *before = randn(&r, shape_numel(s), 0.1f),
                  w[7];
            for (int c = 0; c < K; c++) w[c] = c == 1 ? 0.0f : 0.5f + rng_float(&r);
            int32_t *y = cu_labels(&r, rows, K), *y_gpu = o->alloc(o, sizeof(int32_t) * rows);
            o->upload(o, y_gpu, y, sizeof(int32_t) * rows);
            LossCfg l = loss_cfg_default();
            l.kind[0] = ki % 2 ? LOSS_TVERSKY : LOSS_DICE;
            l.weight[0] = 0.7f;
            l.tversky_alpha = 0.3f;
            l.tversky_beta = 0.7f;
            l.tversky_gamma = 1.5f;
            const RegionArgs args = region_args(&l, 0, groups);
            const float scale = 4.0f;
            float *w_gpu = cu_floats(w, K), *scale_gpu = cu_floats(&scale, 1),
                  *sums = malloc(sizeof(float) * 3 * K * groups),
                  *coefs = malloc(sizeof(float) * 2 * K * groups),
                  *sums_gpu = o->alloc(o, sizeof(float) * 3 * K * groups),
                  *coefs_gpu = o->alloc(o, sizeof(float) * 2 * K * groups),
                  *loss_gpu = o->alloc(o, sizeof(float)),
                  *rows_gpu = o->alloc(o, sizeof(float) * 2 * rows);
            for (int a = 0; a < 3; a++) {
                CuPair t = cu_pair(z, s, (DType)a), dz = cu_pair(before, s, (DType)a);
                ops_cpu.region_sums(&ops_cpu, t.cpu, y, groups, sums, NULL);
                o->region_sums(o, t.gpu, y_gpu, groups, sums_gpu, rows_gpu);
                float *gs = cu_to_host(sums_gpu, (size_t)3 * K * groups, DT_F32);
                cu_check_err("region_sums", (DType)a,
                             cu_rel_err(gs, sums, (size_t)3 * K * groups, 1e-30), 1e-6);
                free(gs);
                float loss = 0.25f, gloss = 0.25f;
                o->upload(o, sums_gpu, sums, sizeof(float) * 3 * K * groups);
                o->upload(o, loss_gpu, &loss, sizeof loss);
                ops_cpu.region_grad(&ops_cpu, t.cpu, y, groups, sums, &args, w, &scale, coefs,
                                    &loss, dz.cpu);
                o->region_grad(o, t.gpu, y_gpu, groups, sums_gpu, &args, w_gpu, scale_gpu,
                               coefs_gpu, loss_gpu, dz.gpu);
                o->download(o, &gloss, loss_gpu, sizeof gloss);
                cu_check_err("region_grad loss", (DType)a, fabs((double)gloss - loss) / loss, 1e-6);
                float *gc = cu_to_host(coefs_gpu, (size_t)2 * K * groups, DT_F32);
                cu_check_err("region_grad coefs", (DType)a,
                             cu_rel_err(gc, coefs, (size_t)2 * K * groups, 1e-30), 1e-6);
                free(gc);
                cu_check_err("region_grad dlogits", (DType)a, cu_pair_err(dz), 1e-6 + CU_ULP[a]);
                cu_pair_free(&t);
                cu_pair_free(&dz);
            }
            o->free(o, y_gpu);
            o->free(o, w_gpu);
            o->free(o, scale_gpu);
            o->free(o, sums_gpu);
            o->free(o, coefs_gpu);
            o->free(o, loss_gpu);
            o->free(o, rows_gpu);
            free(z);
            free(before);
            free(y);
            free(sums);
            free(coefs);
        }
}
// lovasz against the CPU op: K = 1, 2, 3, 5, over the batch and per image, a class weight 0,
// invalid labels, the gradient added into values below its own (~1/pixels); groups of 899
// pixels (one sort tile) and of 2,697 and 5,250 (spans of 4,096 and 8,192: the network's
// stages across tiles). Both sort errors from the same fp32 softmax: emulated, the same
// order. A GPU's expf may differ from the host's by an ulp and swap two errors that close:
// the large groups label one pixel in 8 (~650 a class), making such a pair unlikely, but for
// K = 2, whose pixels are all labelled (the walk's chunks of 2,048 carried over) and whose
// z_1 - z_0 are a shuffled grid -4 + 8(m + 1/4)/pixels: two errors p and 1 - p' are never
// within 1e-5. Tolerances: the loss 1e-6 relative (fp64 sums in another order), the
// gradient as region_grad's.
TEST(cuda_lovasz) {
    Ops *o = cu_ops();
    Rng r;
    rng_seed(&r, 77);
    const int Ks[4] = {1, 2, 3, 5};
    const Shape shapes[2] = {shape4(3, 29, 31, 1), shape4(1, 75, 70, 1)};
    for (int ki = 0; ki < 4; ki++)
        for (int si = 0; si < 2; si++)
            for (int per_image = 0; per_image < 2; per_image++) {
                const int K = Ks[ki];
                Shape s = shapes[si];
                s.c = K;
                const int groups = per_image ? s.n : 1;
                const size_t rows = shape_numel(s) / K, per = rows / groups;
                float *z = randn(&r, shape_numel(s), 2.0f),
                      *before = randn(&r, shape_numel(s), 1e-6f), w[5];
                for (int c = 0; c < K; c++) w[c] = c == 1 ? 0.0f : 0.5f + rng_float(&r);
                int32_t *y = cu_labels(&r, rows, K), *y_gpu = o->alloc(o, sizeof(int32_t) * rows);
                const int large = per > LOVASZ_SORT_TILE, sparse = large && K != 2,
                          dense = large && K == 2;
                for (size_t i = 0; i < rows && sparse; i++)
                    if (i % 8) y[i] = SN_LABEL_IGNORED;
                // dense, K = 2: the pixels' z_1 - z_0 a shuffled grid (see above)
                size_t *at = dense ? malloc(sizeof(size_t) * rows) : NULL;
                for (size_t i = 0; dense && i < rows; i++) at[i] = i;
                for (size_t i = rows; dense && i > 1; i--) {
                    const size_t j = rng_next(&r) % i, keep = at[i - 1];
                    at[i - 1] = at[j];
                    at[j] = keep;
                }
                for (size_t i = 0; dense && i < rows; i++) {
                    z[2 * i] = 0.0f;
                    z[2 * i + 1] = -4.0f + 8.0f * ((float)at[i] + 0.25f) / (float)rows;
                }
                free(at);
                o->upload(o, y_gpu, y, sizeof(int32_t) * rows);
                const float scale = 4.0f, term = 0.7f / (float)groups;
                const size_t ws_bytes = lovasz_ws_bytes(groups, per, K);
                float *w_gpu = cu_floats(w, K), *scale_gpu = cu_floats(&scale, 1),
                      *loss_gpu = o->alloc(o, sizeof(float));
                void *ws = malloc(ws_bytes), *ws_gpu = o->alloc(o, ws_bytes);
                for (int a = 0; a < 3; a++) {
                    CuPair t = cu_pair(z, s, (DType)a), dz = cu_pair(before, s, (DType)a);
                    float loss = 0.25f, gloss = 0.25f;
                    o->upload(o, loss_gpu, &loss, sizeof loss);
                    ops_cpu.lovasz(&ops_cpu, t.cpu, y, groups, term, w, &scale, ws, &loss, dz.cpu);
                    o->lovasz(o, t.gpu, y_gpu, groups, term, w_gpu, scale_gpu, ws_gpu, loss_gpu,
                              dz.gpu);
                    o->download(o, &gloss, loss_gpu, sizeof gloss);
                    cu_check_err("lovasz loss", (DType)a, fabs((double)gloss - loss) / loss, 1e-6);
                    cu_check_err("lovasz dlogits", (DType)a, cu_pair_err(dz), 1e-6 + CU_ULP[a]);
                    cu_pair_free(&t);
                    cu_pair_free(&dz);
                }
                o->free(o, y_gpu);
                o->free(o, w_gpu);
                o->free(o, scale_gpu);
                o->free(o, loss_gpu);
                o->free(o, ws_gpu);
                free(ws);
                free(z);
                free(before);
                free(y);
            }
}
#endif

// iou_per_image by hand, K = 3, weights (0, 1, 1), s = 1e-5. Image 0: (y 1, p 1),
// (y 1, p 2), (y 2, p 2), (y 0, p 1: weight 0, not counted), (ignored): class 1
// TP 1 FN 1, class 2 TP 1 FP 1: IoU (1 + s)/(2 + s) each. Image 1: every pixel
// (y 1, p 1): class 1 IoU 1, class 2 absent from both: (0 + s)/(0 + s) = 1.
TEST(iou_per_image_by_hand) {
    const float w[3] = {0, 1, 1};
    float z[2 * 5 * 3] = {0};
    const int32_t y[10] = {1, 1, 2, 0, SN_LABEL_IGNORED, 1, 1, 1, 1, 1};
    const int p[10] = {1, 2, 2, 1, 0, 1, 1, 1, 1, 1};
    for (int i = 0; i < 10; i++) z[i * 3 + p[i]] = 2.0f;
    int64_t acc[2] = {5, 7};  // added into
    ops_cpu.iou_per_image(&ops_cpu, tensor_f32(z, shape4(2, 1, 5, 3)), y, w, acc);
    const double m0 = (1 + 1e-5) / (2 + 1e-5);
    CHECK(acc[0] == 5 + llround(m0 * 0x1p32) + llround(0x1p32) && acc[1] == 9,
          "Σ 2^32·mIoU %" PRId64 ", images %" PRId64, acc[0], acc[1]);
}

#ifdef SEGNET_CUDA
// iou_per_image against the CPU op: K = 1, 2, 4, 7, every storage type, weights with a 0,
// invalid labels: the same integers (the same argmax of the same stored logits)
TEST(cuda_iou_per_image) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 77);
    const int Ks[4] = {1, 2, 4, 7};
    for (int ki = 0; ki < 4; ki++) {
        const int K = Ks[ki];
        Shape s = shape4(3, 17, 19, K);
        const size_t rows = shape_numel(s) / K;
        float *z = randn(&r, shape_numel(s), 1.0f), w[7];
        for (int c = 0; c < K; c++) w[c] = c == 1 ? 0.0f : 1.0f;
        int32_t *y = cu_labels(&r, rows, K), *y_gpu = o->alloc(o, sizeof(int32_t) * rows);
        o->upload(o, y_gpu, y, sizeof(int32_t) * rows);
        float *w_gpu = cu_floats(w, K);
        int64_t *acc_gpu = o->alloc(o, 2 * sizeof(int64_t));
        for (int a = 0; a < 3; a++) {
            CuPair t = cu_pair(z, s, (DType)a);
            int64_t acc[2] = {3, 1}, got[2];
            o->upload(o, acc_gpu, acc, sizeof acc);
            ops_cpu.iou_per_image(&ops_cpu, t.cpu, y, w, acc);
            o->iou_per_image(o, t.gpu, y_gpu, w_gpu, acc_gpu);
            o->download(o, got, acc_gpu, sizeof got);
            CHECK(got[0] == acc[0] && got[1] == acc[1] && acc[1] == 4,
                  "K=%d %s: %" PRId64 " %" PRId64 ", CPU %" PRId64 " %" PRId64, K, DT_NAME[a],
                  got[0], got[1], acc[0], acc[1]);
            cu_pair_free(&t);
        }
        o->free(o, y_gpu); o->free(o, w_gpu); o->free(o, acc_gpu);
        free(z); free(y);
    }
}
#endif

// ----------------------------------------------------------------------------
// Adam, loss scaling and clipping

// Keras' Adam, step by step in double (tf.keras.optimizers.Adam.update_step)
static void keras_adam_reference(double *p, double *m, double *v, const float *g, int n, double lr,
                                 double b1, double b2, double eps, double wd, double scale, int t) {
    double alpha = lr * sqrt(1 - pow(b2, t)) / (1 - pow(b1, t));
    for (int i = 0; i < n; i++) {
        double gi = g[i] * scale;
        p[i] -= p[i] * wd * lr;
        m[i] += (gi - m[i]) * (1 - b1);
        v[i] += (gi * gi - v[i]) * (1 - b2);
        p[i] -= m[i] * alpha / (sqrt(v[i]) + eps);
    }
}

TEST(adam_keras_formula) {
    enum { N = 64, STEPS = 6 };
    const struct {
        float lr, eps, wd, scale;
    } cases[3] = {{1e-3f, 1e-7f, 0, 1}, {0.05f, 1e-3f, 0.01f, 1}, {1e-2f, 1e-7f, 0.1f, 0.25f}};
    for (int c = 0; c < 3; c++) {
        Rng r;
        rng_seed(&r, 11 + c);
        float p[N], m[N] = {0}, v[N] = {0};
        double pr[N], mr[N] = {0}, vr[N] = {0};
        for (int i = 0; i < N; i++) pr[i] = p[i] = rng_normal(&r);
        double worst = 0;
        for (int t = 1; t <= STEPS; t++) {
            float g[N];
            // some tiny gradients: ε matters
            for (int i = 0; i < N; i++) g[i] = (i % 7 == 0 ? 1e-4f : 1.0f) * rng_normal(&r);
            AdamStep s = adam_step_init(cases[c].lr, ADAM_BETA1, ADAM_BETA2, cases[c].eps,
                                        cases[c].wd, cases[c].scale, t);
            ops_cpu.adam_update(&ops_cpu, p, g, m, v, N, &s);
            keras_adam_reference(pr, mr, vr, g, N, cases[c].lr, ADAM_BETA1, ADAM_BETA2,
                                 cases[c].eps, cases[c].wd, cases[c].scale, t);
            // norm-wise: fp32 rounding of parameters of size ~1 is ~6e-8 per step
            double scale = 0, e = 0;
            for (int i = 0; i < N; i++) {
                scale = fmax(scale, fabs(pr[i]));
                e = fmax(e, fabs(p[i] - pr[i]));
            }
            worst = fmax(worst, e / scale);
        }
        CHECK(worst < 1e-6,
              "case %d: Adam differs from Keras' formula by %.3g (relative to max |p|)", c, worst);
        if (g_verbose) printf("    case %d: worst %.3g\n", c, worst);
    }
    // step 1 by hand: m = 0.1·g, v = 0.001·g², α = lr·√0.001/0.1,
    //   update = α·m/(√v+ε) = lr·g/(|g| + ε/√0.001)
    float p = 1.0f, g = 0.5f, m = 0, v = 0;
    AdamStep s = adam_step_init(0.1f, 0.9f, 0.999f, 1e-7f, 0, 1, 1);
    ops_cpu.adam_update(&ops_cpu, &p, &g, &m, &v, 1, &s);
    CHECK_NEAR(p, 1.0 - 0.1 * 0.5 / (0.5 + 1e-7 / sqrt(0.001)), 1e-7, "first step by hand");
}

// Adam against PyTorch's (AdamW with weight decay), ε converted per step
TEST(parity_live_adam) {
    enum { N = 200, STEPS = 8 };
    const struct { double lr, eps, wd; } cases[2] = {{1e-3, 1e-7, 0.0}, {3e-2, 1e-4, 0.05}};
    for (int c = 0; c < 2; c++) {
        Rng r;
        rng_seed(&r, 21 + c);
        float p[N], m[N] = {0}, v[N] = {0}, g[STEPS][N];
        for (int i = 0; i < N; i++) p[i] = rng_normal(&r);
        for (int t = 0; t < STEPS; t++)
            for (int i = 0; i < N; i++) g[t][i] = (i % 5 == 0 ? 1e-5f : 1.0f) * rng_normal(&r);
        char in[64], out[64], cmd[256];
        snprintf(in, sizeof in, "/tmp/segnet_adam_in.%d", (int)getpid());
        snprintf(out, sizeof out, "/tmp/segnet_adam_out.%d", (int)getpid());
        FILE *f = fopen(in, "wb");
        int32_t hdr[2] = {N, STEPS};
        double hyper[5] = {cases[c].lr, ADAM_BETA1, ADAM_BETA2, cases[c].eps, cases[c].wd};
        fwrite(hdr, sizeof hdr, 1, f);
        fwrite(hyper, sizeof hyper, 1, f);
        fwrite(p, sizeof p, 1, f);
        fwrite(g, sizeof g, 1, f);
        fclose(f);
        snprintf(cmd, sizeof cmd, "/usr/bin/python3 ref/adam_torch.py %s %s", in, out);
        CHECK(system(cmd) == 0, "%s failed", cmd);
        float ref[N] = {0};
        f = fopen(out, "rb");
        CHECK(f && fread(ref, sizeof ref, 1, f) == 1, "reading %s", out);
        if (f) fclose(f);
        unlink(in); unlink(out);
        for (int t = 1; t <= STEPS; t++) {
            AdamStep s = adam_step_init((float)cases[c].lr, ADAM_BETA1, ADAM_BETA2,
                                        (float)cases[c].eps, (float)cases[c].wd, 1, t);
            ops_cpu.adam_update(&ops_cpu, p, g[t - 1], m, v, N, &s);
        }
        double scale = 0, e = 0;
        for (int i = 0; i < N; i++) {
            scale = fmax(scale, fabs(ref[i]));
            e = fmax(e, fabs(p[i] - ref[i]));
        }
        CHECK(e / scale < 1e-6, "case %d: segnet vs PyTorch Adam: %.3g (relative to max |p|)", c,
              e / scale);
        if (g_verbose) printf("    case %d: %.3g\n", c, e / scale);
    }
}

// step_control on a backend: the decisions of Keras' LossScaleOptimizer and
// clip_by_global_norm, worked by hand. Scale 1024, interval 3:
//   finite step, good 1 → 2: applied, scale kept; grad_scale 1/1024
//   finite step, good 2 → 3 = interval: scale 2048, good 0
//   inf/NaN: skipped, scale 512, good 0; at scale 1 it stays 1
//   clipping, norm 2: Σg² = (4·1024)² scaled → unscaled norm 4 → factor 2/4,
//   grad_scale 0.5/1024; below the norm (Σg² = 1024², norm 1): factor 1
// and BEGIN: xent_scale = inv_norm·scale, the sums and the flag zeroed.
static void step_control_case(Ops *o, const char *who) {
    struct {
        float scale;
        int64_t good;
        int nonfinite;
        float clip, ss;
        float want_scale;
        int64_t want_good;
        int applied;
        float want_gs;
    } cases[] = {
            {1024, 1, 0, 0, 0, 1024, 2, 1, 1.0f / 1024},
            {1024, 2, 0, 0, 0, 2048, 0, 1, 1.0f / 1024},
            {1024, 2, 1, 0, 0, 512, 0, 0, 1.0f / 1024},
            {1, 5, 1, 0, 0, 1, 0, 0, 1.0f},
            {1024, 0, 0, 2.0f, 4096.0f * 4096.0f, 1024, 1, 1, 0.5f / 1024},
            {1024, 0, 0, 2.0f, 1024.0f * 1024.0f, 1024, 1, 1, 1.0f / 1024},
    };
    StepArgs *a_dev = o->alloc(o, sizeof(StepArgs));
    StepState *s_dev = o->alloc(o, sizeof(StepState));
    for (int k = 0; k < (int)(sizeof cases / sizeof *cases); k++) {
        StepArgs a;
        memset(&a, 0, sizeof a);
        a.adam = adam_step_init(1e-3f, ADAM_BETA1, ADAM_BETA2, ADAM_EPS, 0.0f, 1.0f, 3);
        a.inv_norm = 0.25f; a.clipnorm = cases[k].clip; a.loss_scaling = 1; a.scale_interval = 3;
        a.loss_scale = cases[k].scale; a.good_steps = cases[k].good;
        StepState st;
        memset(&st, 0x7f, sizeof st);  // BEGIN must set what it owns
        o->upload(o, a_dev, &a, sizeof a);
        o->upload(o, s_dev, &st, sizeof st);
        o->step_control(o, a_dev, s_dev, STEP_BEGIN);
        o->download(o, &st, s_dev, sizeof st);
        CHECK(st.xent_scale == 0.25f * cases[k].scale && st.loss[0] == 0 && st.loss[1] == 0 &&
                      st.loss[2] == 0 && st.nonfinite == 0 && st.grad_sum_squares == 0 &&
                      st.loss_scale == cases[k].scale,
              "%s case %d BEGIN: xent_scale %g, flag %d, scale %g", who, k, st.xent_scale,
              st.nonfinite, st.loss_scale);
        st.nonfinite = cases[k].nonfinite;
        st.grad_sum_squares = cases[k].ss;
        o->upload(o, s_dev, &st, sizeof st);
        o->step_control(o, a_dev, s_dev, STEP_DECIDE);
        o->download(o, &st, s_dev, sizeof st);
        CHECK(st.loss_scale == cases[k].want_scale && st.good_steps == cases[k].want_good &&
                      st.applied == cases[k].applied && st.adam.skip == !cases[k].applied &&
                      st.adam.grad_scale == cases[k].want_gs && st.adam.alpha == a.adam.alpha &&
                      st.adam.lr == a.adam.lr,
              "%s case %d: scale %g good %lld applied %d skip %d grad_scale %.9g; expected %g %lld "
              "%d %.9g",
              who, k, st.loss_scale, (long long)st.good_steps, st.applied, st.adam.skip,
              st.adam.grad_scale, cases[k].want_scale, (long long)cases[k].want_good,
              cases[k].applied, cases[k].want_gs);
    }
    o->free(o, a_dev); o->free(o, s_dev);
}
TEST(step_control) { step_control_case(&ops_cpu, "cpu"); }

TEST(clip_global_norm) {
    CHECK_NEAR(clip_factor(5.0, 1.0f), 0.2, 1e-7, "norm 5 clipped to 1");
    CHECK(clip_factor(0.5, 1.0f) == 1.0f, "a norm below the limit is untouched");
    CHECK(clip_factor(1e9, 0.0f) == 1.0f, "clipnorm 0 is off");
    // the whole buffer is one vector: its norm after scaling is the limit
    enum { N = 1000 };
    Rng r;
    rng_seed(&r, 3);
    float *g = randn(&r, N, 3.0f), ss;
    ops_cpu.sum_squares(&ops_cpu, tensor_f32(g, shape4(N, 1, 1, 1)), &ss);
    double direct = 0;
    for (int i = 0; i < N; i++) direct += (double)g[i] * g[i];
    CHECK_NEAR(sqrt(ss), sqrt(direct), 1e-4 * sqrt(direct), "global norm");
    float f = clip_factor(sqrt(ss), 2.0f);
    double after = 0;
    for (int i = 0; i < N; i++) after += (double)(g[i] * f) * (g[i] * f);
    CHECK_NEAR(sqrt(after), 2.0, 1e-5, "norm after clipping");
    // Adam with grad_scale f equals Adam on the scaled gradient, bit for bit
    float p1[N], p2[N], m1[N] = {0}, v1[N] = {0}, m2[N] = {0}, v2[N] = {0}, gs[N];
    for (int i = 0; i < N; i++) { p1[i] = p2[i] = 0.5f; gs[i] = g[i] * f; }
    AdamStep s1 = adam_step_init(1e-2f, 0.9f, 0.999f, 1e-7f, 0, f, 1),
             s2 = adam_step_init(1e-2f, 0.9f, 0.999f, 1e-7f, 0, 1, 1);
    ops_cpu.adam_update(&ops_cpu, p1, g, m1, v1, N, &s1);
    ops_cpu.adam_update(&ops_cpu, p2, gs, m2, v2, N, &s2);
    CHECK(!memcmp(p1, p2, sizeof p1) && !memcmp(m1, m2, sizeof m1),
          "scaling inside Adam = scaling the gradient");
    free(g);
}

#ifdef SEGNET_CUDA
// adam_update: both backends round every operation on its own in the same
// order (no fused multiply-adds): params, m and v bit-identical over steps with
// and without weight decay and a gradient scale; a skipped step (fp16
// overflow) changes nothing.
TEST(cuda_adam) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 76);
    const size_t n = 1031;
    float *p = randn(&r, n, 1.0f), *m = calloc(n, sizeof(float)), *v = calloc(n, sizeof(float));
    float *p_gpu = cu_floats(p, n), *m_gpu = cu_floats(m, n), *v_gpu = cu_floats(v, n);
    for (int t = 1; t <= 4; t++) {
        float *g = randn(&r, n, 0.1f), *g_gpu = cu_floats(g, n);
        AdamStep st = adam_step_init(1e-2f, ADAM_BETA1, ADAM_BETA2, ADAM_EPS, t % 2 ? 0.0f : 0.05f,
                                     t < 3 ? 1.0f : 0.25f, t);
        st.skip = t == 2;
        float *p_before = t == 2 ? memcpy(malloc(n * sizeof(float)), p, n * sizeof(float)) : NULL;
        AdamStep *st_gpu = cu_copy_of(&st, sizeof st);
        ops_cpu.adam_update(&ops_cpu, p, g, m, v, n, &st);
        o->adam_update(o, p_gpu, g_gpu, m_gpu, v_gpu, n, st_gpu);
        CHECK(cu_floats_equal(p_gpu, p, n) && cu_floats_equal(m_gpu, m, n) &&
                      cu_floats_equal(v_gpu, v, n),
              "adam step %d: params, m or v differ from the CPU", t);
        if (p_before)
            CHECK(!memcmp(p_before, p, n * sizeof(float)),
                  "adam: a skipped step changed the parameters");
        o->free(o, g_gpu); o->free(o, st_gpu); free(g); free(p_before);
    }
    o->free(o, p_gpu); o->free(o, m_gpu); o->free(o, v_gpu);
    free(p); free(m); free(v);
}

TEST(cuda_step_control) { step_control_case(cu_ops(), "cuda"); }
#endif

// ----------------------------------------------------------------------------
// metrics and learning-rate schedules

// IoU and accuracy against a direct count over pixels, and one value by hand
TEST(metrics_by_hand) {
    enum { K = 4, M = 12 };
    const float w[K] = {0, 1, 1, 1};  // class 0: not annotated
    //                    true:  0  0  1  1  1  2  2  2  3  3  1  2
    const int32_t y[M] =       {0, 0, 1, 1, 1, 2, 2, 2, 3, 3, 1, 2};
    const int pred[M] =        {1, 2, 1, 1, 2, 2, 2, 1, 3, 3, 3, 2};
    float z[M * K];
    for (int i = 0; i < M; i++)
        for (int k = 0; k < K; k++) z[i * K + k] = k == pred[i] ? 2.0f : -1.0f;
    int64_t cm[K * K] = {0};
    ops_cpu.confusion_accumulate(&ops_cpu, tensor_f32(z, shape4(1, 3, 4, K)), y, cm);
    double iou[K], dice[K];
    Metrics m = {.iou = iou, .dice = dice};
    metrics_compute(cm, K, w, &m);
    // direct count: pixels whose true class has weight 0 do not exist
    double sum = 0, dice_sum = 0;
    int n = 0, correct = 0, counted = 0;
    for (int c = 0; c < K; c++) {
        int tp = 0, fp = 0, fn = 0;
        for (int i = 0; i < M; i++) {
            if (w[y[i]] == 0) continue;
            tp += y[i] == c && pred[i] == c;
            fn += y[i] == c && pred[i] != c;
            fp += y[i] != c && pred[i] == c;
        }
        if (w[c] == 0) {
            CHECK(isnan(iou[c]) && isnan(dice[c]),
                  "class %d has weight 0: IoU and Dice must be NaN, got %g %g", c, iou[c], dice[c]);
            continue;
        }
        CHECK_NEAR(iou[c], (double)tp / (tp + fp + fn), 1e-12, "IoU");
        // segmentation_models' FScore, β = 1: (1 + β²)·TP / ((1 + β²)·TP + β²·FN + FP)
        CHECK_NEAR(dice[c], 2.0 * tp / (2.0 * tp + fn + fp), 1e-12, "Dice");
        sum += (double)tp / (tp + fp + fn); n++;
        dice_sum += 2.0 * tp / (2.0 * tp + fn + fp);
    }
    CHECK_NEAR(m.mean_dice, dice_sum / n, 1e-12, "mean Dice");
    for (int i = 0; i < M; i++) if (w[y[i]] > 0) { counted++; correct += y[i] == pred[i]; }
    CHECK_NEAR(m.mean_iou, sum / n, 1e-12, "mean IoU");
    CHECK_NEAR(m.accuracy, (double)correct / counted, 1e-12, "pixel accuracy");
    // by hand: class 1 has TP 2 (pixels 2,3), FN 2 (4 → 2, 10 → 3), FP 1 (pixel 7; pixel 0 is
    // unannotated)
    CHECK_NEAR(iou[1], 2.0 / 5.0, 1e-12, "IoU_1 by hand");
    CHECK_NEAR(dice[1], 4.0 / 7.0, 1e-12, "Dice_1 by hand: 2·2 / (2·2 + 1 + 2)");
    CHECK_NEAR(m.accuracy, 7.0 / 10.0, 1e-12, "accuracy by hand");
    // a class that never occurs (in labels or predictions) is left out of the mean
    const float w3[3] = {1, 1, 1};
    int64_t cm3[9] = {5, 1, 0, 2, 4, 0, 0, 0, 0};
    double iou3[3];
    Metrics m3 = {.iou = iou3};
    metrics_compute(cm3, 3, w3, &m3);
    CHECK(isnan(iou3[2]), "absent class: NaN IoU");
    CHECK_NEAR(m3.mean_iou, (5.0 / 8.0 + 4.0 / 7.0) / 2.0, 1e-12, "mean over occurring classes");
    // ties go to the lowest class
    float zt[3] = {1.0f, 1.0f, 0.5f};
    int32_t yt = 1;
    int64_t cmt[9] = {0};
    ops_cpu.confusion_accumulate(&ops_cpu, tensor_f32(zt, shape4(1, 1, 1, 3)), &yt, cmt);
    CHECK(cmt[1 * 3 + 0] == 1, "a tie counts as the lowest class");
}

TEST(lr_schedule) {
    const double lr = 0.1;
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_CONSTANT, 0, 100, 0), lr, 1e-15, "constant");
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_CONSTANT, 4, 100, 0), lr / 4, 1e-15, "warm-up step 0");
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_CONSTANT, 4, 100, 3), lr, 1e-15, "warm-up last step");
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_COSINE, 10, 110, 10), lr, 1e-15, "cosine starts at lr");
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_COSINE, 10, 110, 60), lr / 2, 1e-12, "cosine half-way");
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_COSINE, 10, 110, 35), lr * (1 + cos(M_PI / 4)) / 2, 1e-12,
               "cosine quarter");
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_COSINE, 0, 100, 99), lr * (1 + cos(M_PI * 0.99)) / 2, 1e-12,
               "cosine last step");
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_COSINE, 0, 100, 150), 0.0, 1e-15, "past the end");
    // poly: lr·(1 - p)^0.9 after the warm-up; p = 1/2: 0.1·0.5^0.9 = 0.05358867312681466
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_POLY, 4, 100, 1), lr / 2, 1e-15, "poly warm-up");
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_POLY, 10, 110, 10), lr, 1e-15, "poly starts at lr");
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_POLY, 10, 110, 60), 0.05358867312681466, 1e-15,
               "poly half-way");
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_POLY, 10, 110, 110), 0.0, 1e-15, "poly ends at 0");
    CHECK_NEAR(lr_at_step(lr, SCHEDULE_PLATEAU, 4, 100, 50), lr, 1e-15, "plateau: its base lr");
}

// ReduceLROnPlateau, Keras' algorithm followed by hand (factor 0.5, patience
// 2, min_delta 0.01, min_lr 0.2 (fp32), lr 1); values: lower is better, none
// within rounding of best - min_delta.
//   epoch  value  best  wait  lr
//   1      1.0    1.0   0     1
//   2      0.995  1.0   1     1      not below 1.0 - 0.01
//   3      0.98   0.98  0     1      below 0.99
//   4      0.975  0.98  1     1
//   5      0.99   0.98  0     0.5    wait reached patience: lr × 0.5, wait 0
//   6      0.975  0.98  1     0.5
//   7      NaN    0.98  0     0.25   a NaN never improves
//   8      0.9    0.9   0     0.25
//   9, 10  0.95   0.9   1, 0  0.2    max(0.125, min_lr)
//   11, 12 0.95   0.9   1, 2  0.2    lr is min_lr: wait grows, nothing changes
TEST(plateau_by_hand) {
    const PlateauCfg c = {0.5f, 0.2f, 0.01f, 2};
    Plateau p = {1.0, INFINITY, 0};
    const double v[12] = {1.0, 0.995, 0.98, 0.975, 0.99, 0.975, NAN, 0.9, 0.95, 0.95, 0.95, 0.95};
    const double m = (double)0.2f;
    const double want_lr[12] = {1, 1, 1, 1, 0.5, 0.5, 0.25, 0.25, 0.25, m, m, m};
    const int want_wait[12] = {0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 2};
    const double want_best[12] = {1, 1, 0.98, 0.98, 0.98, 0.98, 0.98, 0.9, 0.9, 0.9, 0.9, 0.9};
    for (int e = 0; e < 12; e++) {
        const int lowered = plateau_update(&p, &c, v[e]);
        CHECK(p.lr == want_lr[e] && p.wait == want_wait[e] && p.best == want_best[e] &&
                      lowered == (e == 4 || e == 6 || e == 9),
              "epoch %d: lr %g wait %d best %g (lowered %d), want %g %d %g", e + 1, p.lr, p.wait,
              p.best, lowered, want_lr[e], want_wait[e], want_best[e]);
    }
}

#ifdef SEGNET_CUDA
// confusion_accumulate: exact counts. Integer logits make ties (the lowest
// class wins); K = 70 takes the kernel's global-atomics path; a NaN logit first
// in its row wins, elsewhere never (the CPU's strict >); counts add into what
// is there.
TEST(cuda_confusion) {
    Ops *o = cu_ops();
    Rng r; rng_seed(&r, 75);
    const int Ks[4] = {2, 3, 7, 70};
    for (int ki = 0; ki < 4; ki++)
        for (int big = 0; big < 2; big++) {
            const int K = Ks[ki];
            Shape s = big ? shape4(1, 17, 19, K) : shape4(2, 5, 7, K);
            size_t rows = shape_numel(s) / K, kk = (size_t)K * K;
            float *z = randn(&r, shape_numel(s), 1.5f);
            for (size_t i = 0; i < shape_numel(s); i++) z[i] = roundf(z[i]);
            z[0] = NAN;                 // row 0: NaN first
            z[(size_t)5 * K + 1] = NAN;  // row 5: NaN later
            int32_t *y = cu_labels(&r, rows, K), *y_gpu = o->alloc(o, sizeof(int32_t) * rows);
            y[0] = y[5] = 0;
            o->upload(o, y_gpu, y, sizeof(int32_t) * rows);
            int64_t *cm = malloc(sizeof(int64_t) * kk), *gm = malloc(sizeof(int64_t) * kk);
            for (size_t i = 0; i < kk; i++) cm[i] = (int64_t)(rng_next(&r) % 5);
            int64_t *cm_gpu = o->alloc(o, sizeof(int64_t) * kk);
            o->upload(o, cm_gpu, cm, sizeof(int64_t) * kk);
            for (int a = 0; a < 3; a++) {
                CuPair t = cu_pair(z, s, (DType)a);
                ops_cpu.confusion_accumulate(&ops_cpu, t.cpu, y, cm);
                o->confusion_accumulate(o, t.gpu, y_gpu, cm_gpu);
                o->download(o, gm, cm_gpu, sizeof(int64_t) * kk);
                CHECK(!memcmp(gm, cm, sizeof(int64_t) * kk),
                      "confusion K=%d rows %zu %s: counts differ", K, rows, DT_NAME[a]);
                cu_pair_free(&t);
            }
            o->free(o, y_gpu); o->free(o, cm_gpu);
            free(z); free(y); free(cm); free(gm);
        }
}
#endif

// ============================================================================
// BEYOND THE OPS, in tests/ (one file per reader, one translation unit: the runner
// takes the tests in the order they are written, these after the ops'): the
// gradient check on whole graphs, the models and their weights, the step, replicas,
// the backends, data, the run, its files, the sources; then the runner
// ============================================================================

#include "tests/harness.c"
#include "tests/step.c"
#include "tests/backends.c"
#include "tests/application.c"
#include "tests/sources.c"

// ----------------------------------------------------------------------------
// the runner

// The runner counts a test that cannot run here as skipped, never as passed,
// and lists it with its reason above the last line: one skipped by the runner
// (no PyTorch) and one that skips itself (no MPI), each in a suite of its own.
TEST(runner_counts_skips) {
    const struct { const char *env, *test, *reason; } cases[] = {
        {"SEGNET_NO_TORCH=1", "parity_live_adam", SKIP_NO_TORCH},
        {"SEGNET_NO_MPI=1", "replicas_mpi_faults", SKIP_NO_MPI},
    };
    for (int k = 0; k < 2; k++) {
        char cmd[600], want[600], unused[8];
        snprintf(cmd, sizeof cmd, "SEGNET_TEST_NESTED=1 %s /proc/%ld/exe --filter %s 2>&1",
                 cases[k].env, (long)getpid(), cases[k].test);
        int rc = run_shell(cmd, unused, sizeof unused);
        size_t n;
        char *out = read_file("/tmp/segnet_test_out.txt", &n);
        snprintf(want, sizeof want, "not run here (1):\n  %s: %s (1)\n", cases[k].reason,
                 cases[k].test);
        const char *last = out ? strstr(out, "\n0 passed, 0 failed, 1 skipped\n") : NULL;
        CHECK(rc == 0 && out && contains(out, want) && last &&
                      !last[strlen("\n0 passed, 0 failed, 1 skipped\n")],
              "%s: exit %d, output:\n%s", cmd, rc, out ? out : "");
        free(out);
    }
}

// ----------------------------------------------------------------------------
// the fuzz harness, last: make test builds fuzz_segnet where the compiler has
// the sanitizers and names it in SEGNET_FUZZ_BIN (or says in SEGNET_FUZZ_NONE
// why not); its self-test, then SEGNET_FUZZ_SECONDS per target (make fuzz: minutes)

#define SKIP_NO_FUZZ "no fuzz_segnet (make test builds it and names it in SEGNET_FUZZ_BIN)"

static const char *fuzz_env(const char *name, const char *otherwise) {
    const char *v = getenv(name);
    return v && v[0] ? v : otherwise;
}

// ./fuzz_segnet ARGS --out SEGNET_FUZZ_OUT: its exit status, and its output (malloc'd) in *out
static int run_fuzz(const char *args, char **out) {
    char cmd[1024], unused[8];
    snprintf(cmd, sizeof cmd, "%s %s --out %s 2>&1", fuzz_env("SEGNET_FUZZ_BIN", ""), args,
             fuzz_env("SEGNET_FUZZ_OUT", "fuzz-out"));
    int rc = run_shell(cmd, unused, sizeof unused);
    size_t n;
    *out = read_file("/tmp/segnet_test_out.txt", &n);
    if (!*out) *out = strdup("");
    return rc;
}

// the harness catches an overflow, a leak and a hang planted in readers of its own
TEST(fuzz_selftest) {
    if (!getenv("SEGNET_FUZZ_BIN")) SKIP(fuzz_env("SEGNET_FUZZ_NONE", SKIP_NO_FUZZ));
    char *out;
    int rc = run_fuzz("--selftest", &out);
    CHECK(rc == 0 && contains(out, "fuzz self-test: overflow, leak and hang caught\n"),
          "exit %d:\n%s", rc, out);
    free(out);
}

// every reader and whole commands: a finding fails the test, its reproducer saved
TEST(fuzz_targets) {
    if (!getenv("SEGNET_FUZZ_BIN")) SKIP(fuzz_env("SEGNET_FUZZ_NONE", SKIP_NO_FUZZ));
    char args[200], *out;
    snprintf(args, sizeof args, "--seconds %s --seed %s", fuzz_env("SEGNET_FUZZ_SECONDS", "3"),
             fuzz_env("SEGNET_FUZZ_SEED", "1"));
    int rc = run_fuzz(args, &out);
    const char *last = strstr(out, "\nfuzz: ");  // its summary line
    CHECK(rc == 0 && last, "fuzz_segnet %s: exit %d:\n%s", args, rc, out);
    if (rc == 0 && last) printf("    %.*s\n", (int)strcspn(last + 1, "\n"), last + 1);
    free(out);
}

#ifndef SEGNET_FUZZ  // fuzz_segnet: the tests compiled, its own main at the end

typedef struct { const char *name, *reason; } SkippedTest;
typedef struct {
    int passed, failed, skipped;
    SkippedTest list[4 * MAX_TESTS];  // every pass's skips (a name once per reason when printed)
} Tally;

static void tally_skip(Tally *tl, const char *name, const char *reason) {
    tl->skipped++;
    if (tl->skipped <= 4 * MAX_TESTS) tl->list[tl->skipped - 1] = (SkippedTest){name, reason};
}

typedef enum { RUN_FAST, RUN_ALL } RunSet;  // make test; make check (the slow tests too)
#ifdef SEGNET_TEST_STRICT
#define SHOW_EVERY_RESULT 1  // test_segnet counts the strict build's tests from its lines
#else
#define SHOW_EVERY_RESULT 0
#endif

// why the runner does not call test t here, or NULL
static const char *runner_skip(const Test *t, const char *filter, RunSet set) {
    if (!strncmp(t->name, "parity_live", 11) && !torch_found()) return SKIP_NO_TORCH;
    if (!strncmp(t->name, "heavy_", 6) && !getenv("SEGNET_HEAVY")) return SKIP_HEAVY;
    // a --filter that names it runs it
    if (t->slow && set == RUN_FAST && !filter) return SKIP_SLOW;
    return NULL;
}

// A passing test is silent: while it runs, its stdout and stderr (its own lines, the
// trainer's progress, the weights report, a child process's output) go to an unlinked
// file, shown only when it fails, or when it crashes the runner (a fatal signal). With -v
// (g_verbose) nothing is captured: every line shows as it comes.
typedef struct { int out, err, file; } Capture;  // the runner's stdout and stderr; the file
static Capture g_capture = {-1, -1, -1};
static pid_t g_runner_pid;  // a forked child that crashes (on purpose) shows nothing

static void capture_copy(int to) {  // async-signal-safe: read and write only
    char buf[4096];
    ssize_t n;
    if (lseek(g_capture.file, 0, SEEK_SET) != 0) return;
    while ((n = read(g_capture.file, buf, sizeof buf)) > 0)
        if (write(to, buf, (size_t)n) != n) break;
}

static void capture_crash(int sig) {
    if (getpid() == g_runner_pid && g_capture.file >= 0) capture_copy(g_capture.err);
    signal(sig, SIG_DFL);
    raise(sig);
}

// SIGSEGV goes first to the handler installed before main, if any (the CUDA
// emulator's guard pages: a kernel's overrun aborts naming the kernel); when it
// returns, the fault was not its own
static struct sigaction g_segv_before_runner;
static void capture_segv(int sig, siginfo_t *si, void *ctx) {
    if (g_segv_before_runner.sa_flags & SA_SIGINFO) g_segv_before_runner.sa_sigaction(sig, si, ctx);
    capture_crash(sig);
}

static void capture_begin(void) {
    fflush(stdout);
    fflush(stderr);
    char path[] = "/tmp/segnet_test_output_XXXXXX";
    const int fd = mkostemp(path, O_CLOEXEC);
    if (fd < 0) return;  // nothing captured: the test's lines show as they come
    unlink(path);
    g_capture = (Capture){fcntl(1, F_DUPFD_CLOEXEC, 3), fcntl(2, F_DUPFD_CLOEXEC, 3), fd};
    dup2(fd, 1);
    dup2(fd, 2);
}

// back to the runner's stdout and stderr; the test's lines onto stdout where show
static void capture_end(int show) {
    if (g_capture.file < 0) return;
    fflush(stdout);
    fflush(stderr);
    dup2(g_capture.out, 1);
    dup2(g_capture.err, 2);
    close(g_capture.out);
    close(g_capture.err);
    if (show) capture_copy(1);
    close(g_capture.file);
    g_capture = (Capture){-1, -1, -1};
}

// Runs the tests whose name contains `filter` (all: NULL) and, with `prefix`,
// only those whose name starts with it; `label` follows each name printed. Without -v
// only a failure prints (its captured lines, then "FAIL name"); the strict build prints
// every result, which test_segnet's strict pass counts and shows as it does its own.
static void run_tests(const char *filter, const char *prefix, const char *label, RunSet set,
                      Tally *tl) {
    for (int i = 0; i < g_n_tests; i++) {
        const Test *t = &g_tests[i];
        if (filter && !strstr(t->name, filter)) continue;
        if (prefix && strncmp(t->name, prefix, strlen(prefix))) continue;
        const char *why = runner_skip(t, filter, set);
        if (why) {
            tally_skip(tl, t->name, why);
#ifdef SEGNET_TEST_STRICT
            printf("skip %s%s: %s\n", t->name, label, why);  // for test_segnet's count
#endif
            continue;
        }
        g_failures = 0;
        g_skip = NULL;
        double t0 = now_s();
#if EMULATED_CUDA
        const long long hazards = cuemu_count("hazards");
#endif
        if (isatty(1) && !g_verbose) {  // where it is: one line, rewritten
            printf("\r\033[K%s%s", t->name, label);
            fflush(stdout);
        }
        if (!g_verbose) capture_begin();
        t->fn();
#if EMULATED_CUDA
        // the emulator's reports of races, missing fences and writes past an
        // allocation (cuda_emu.cpp, "hazards"), on stderr above
        const long long found = cuemu_count("hazards") - hazards;
        CHECK(found == 0, "the emulated GPU reported %lld hazards (the lines \"cuemu: hazard: "
              "...\" above)", found);
#endif
        double dt = now_s() - t0;
        capture_end(g_failures > 0);
        if (isatty(1) && !g_verbose) printf("\r\033[K");
        const int shown = g_verbose || SHOW_EVERY_RESULT;
        if (g_failures) {
            tl->failed++;
            printf("FAIL %s%s (%d checks, %.2fs)\n", t->name, label, g_failures, dt);
        } else if (g_skip) {
            tally_skip(tl, t->name, g_skip);
            if (shown) printf("skip %s%s: %s\n", t->name, label, g_skip);
        } else {
            tl->passed++;
            if (shown) printf("ok   %s%s (%.2fs)\n", t->name, label, dt);
        }
        fflush(stdout);
    }
}

// The tests not run, grouped by reason: "  REASON: a, b, c (N)".
static void print_not_run(const Tally *tl) {
    if (!tl->skipped) return;
    printf("not run here (%d):\n", tl->skipped);
    const int n = tl->skipped < 4 * MAX_TESTS ? tl->skipped : 4 * MAX_TESTS;
    for (int i = 0; i < n; i++) {
        const char *reason = tl->list[i].reason;
        int first = 1, count = 0, shown = 0;
        for (int j = 0; j < i && first; j++) first = strcmp(tl->list[j].reason, reason) != 0;
        if (!first) continue;
        printf("  %s:", reason);
        for (int j = i; j < n; j++) {
            if (strcmp(tl->list[j].reason, reason)) continue;
            count++;
            int again = 0;  // the same test in a later pass
            for (int k = i; k < j && !again; k++)
                again = !strcmp(tl->list[k].reason, reason) &&
                        !strcmp(tl->list[k].name, tl->list[j].name);
            if (again) continue;
            if (shown < 6) printf("%s %s", shown ? "," : "", tl->list[j].name);
            else if (shown == 6) printf(", ...");
            shown++;
        }
        printf(" (%d)\n", count);
    }
}

static int cmp_test_order(const void *a, const void *b) {
    return ((const Test *)a)->order - ((const Test *)b)->order;
}

#if EMULATED_CUDA && !defined(SEGNET_TEST_STRICT)
// The strict pass: test_segnet_strict (make test builds it and names it in
// SEGNET_STRICT_BIN) runs the cuda_ tests on kernels.cu built as nvcc builds it
// where results depend on it (multiply-adds fused into FMAs), with every access
// race-checked and device memory packed as an arena; its lines are shown and
// its tests counted here.
#define SKIP_NO_STRICT \
    "no test_segnet_strict (make test builds it and names it in SEGNET_STRICT_BIN)"
#define SKIP_NO_FMA "this CPU has no FMA instructions, which the strict build's kernels use"
static void strict_pass(const char *filter, RunSet set, Tally *tl) {
    const char *bin = getenv("SEGNET_STRICT_BIN");
    const char *why = !bin ? SKIP_NO_STRICT : !__builtin_cpu_supports("fma") ? SKIP_NO_FMA : NULL;
    if (why) {
        printf("== the strict pass not run: %s\n", why);
        tally_skip(tl, "cuda_ [strict]", why);
        return;
    }
    printf("== the emulated CUDA tests again on the strict build (%s): FMA contraction, races "
           "checked, device memory packed as an arena\n", bin);
    fflush(stdout);
    if (filter) setenv("SEGNET_STRICT_FILTER", filter, 1);
    char cmd[4096];
    snprintf(cmd, sizeof cmd, "SEGNET_TEST_NESTED=1 %s --order strict%s%s%s 2>&1", bin,
             set == RUN_ALL ? " --all" : "", g_verbose ? " -v" : "",
             filter ? " --filter \"$SEGNET_STRICT_FILTER\"" : "");
    FILE *p = popen(cmd, "r");
    if (!p) {
        tl->failed++;
        printf("FAIL the strict pass: cannot run %s\n", bin);
        return;
    }
    char line[8192];
    int counted = 0, passed = 0, failed = 0, skipped = 0;
    while (fgets(line, sizeof line, p)) {
        if (sscanf(line, "%d passed, %d failed, %d skipped", &passed, &failed, &skipped) == 3 &&
            !strchr(line, '(')) {
            counted = 1;
            continue;
        }
        char name[256];
        const int result = !strncmp(line, "ok   ", 5) || !strncmp(line, "skip ", 5);
        if (g_verbose || !result) {
            fputs(line, stdout);
            fflush(stdout);
        }
        if (!strncmp(line, "ok   ", 5)) tl->passed++;
        else if (!strncmp(line, "FAIL ", 5)) tl->failed++;
        else if (sscanf(line, "skip %255s", name) == 1) {
            const char *reason = strstr(line, ": ");
            const char *text = reason ? strndup(reason + 2, strcspn(reason + 2, "\n")) : "";
            tally_skip(tl, strdup(name), text);
        }
    }
    const int status = pclose(p);
    if (!counted || (WIFEXITED(status) && WEXITSTATUS(status) > 1) || WIFSIGNALED(status)) {
        tl->failed++;
        printf("FAIL the strict pass: %s stopped before its count (status %d)\n", bin, status);
    }
}
#endif

int main(int argc, char **argv) {
    // OpenBLAS's kernels as ./segnet's (cli.c), for runs compared with it bit for bit
    if (blas_core_default()) {
        execv("/proc/self/exe", argv);
        unsetenv("OPENBLAS_CORETYPE");  // no /proc: run on as started
    }
    const char *filter = NULL, *order = "both";
    RunSet set = RUN_FAST;
    // the file's order, whatever the constructors'
    qsort(g_tests, (size_t)g_n_tests, sizeof(Test), cmp_test_order);
    for (int i = 1; i < argc; i++) {
        if (!strcmp(argv[i], "--filter") && i + 1 < argc) filter = argv[++i];
        else if (!strcmp(argv[i], "--order") && i + 1 < argc &&
                 (!strcmp(argv[i + 1], "forward") || !strcmp(argv[i + 1], "reverse") ||
                  !strcmp(argv[i + 1], "random") || !strcmp(argv[i + 1], "both") ||
                  !strcmp(argv[i + 1], "strict")))
            order = argv[++i];
        else if (!strcmp(argv[i], "--all")) set = RUN_ALL;
        else if (!strcmp(argv[i], "-v") || !strcmp(argv[i], "--verbose")) g_verbose = 1;
        else {
            fprintf(stderr,
                    "usage: %s [--filter SUBSTRING] [--all] [--order "
                    "forward|reverse|random|strict|both] [-v]\n"
                    "  --filter: the tests whose name holds SUBSTRING (slow ones included)\n"
                    "  --all:    the slow tests too (make check); without it they are skipped\n"
                    "  --order:  forward: every test, the emulated GPU's blocks and threads in "
                    "order;\n"
                    "            reverse: the cuda_ tests, in reverse order; random: the cuda_ "
                    "tests with\n"
                    "            the generic kernels only, in a random order (seed CUEMU_SEED, "
                    "default 1);\n"
                    "            strict: the cuda_ tests on the strict build (test_segnet_strict:"
                    " FMA\n"
                    "            contraction, races checked, device memory as an arena);\n"
                    "            both (the default): the four passes\n",
                    argv[0]);
            return 2;
        }
    }
    // Tests write fixtures under /tmp/segnet_test*: a second suite running at
    // the same time (another checkout) waits for this one instead of colliding.
    // (A suite started by a test of this one, SEGNET_TEST_NESTED, does not wait on it.)
    int lock = getenv("SEGNET_TEST_NESTED")
                       ? -1
                       : open("/tmp/segnet_test.lock", O_CREAT | O_RDWR | O_CLOEXEC, 0666);
    if (lock >= 0 && flock(lock, LOCK_EX | LOCK_NB) != 0) {
        printf("another test_segnet is running: waiting for it\n");
        fflush(stdout);
        flock(lock, LOCK_EX);
    }
    static Tally tl;
    double t_all = now_s();
    g_runner_pid = getpid();
    const int fatal[] = {SIGBUS, SIGFPE, SIGILL, SIGABRT};
    for (size_t i = 0; i < sizeof fatal / sizeof *fatal; i++) signal(fatal[i], capture_crash);
    struct sigaction segv;
    memset(&segv, 0, sizeof segv);
    segv.sa_sigaction = capture_segv;
    segv.sa_flags = SA_SIGINFO;
    sigemptyset(&segv.sa_mask);
    sigaction(SIGSEGV, &segv, &g_segv_before_runner);
#ifdef SEGNET_TEST_GPU
    char why[SN_ERR_MAX];
    if (cuda_backend_open(0, why)) {  // the cuda_ tests would each stop at it
        printf("test_segnet_gpu: no GPU to test on: %s\n0 passed, 1 failed, 0 skipped\n", why);
        return 1;
    }
#endif
#if EMULATED_CUDA
#ifdef SEGNET_TEST_STRICT
    // test_segnet_strict: the strict pass alone (test_segnet runs it as its fourth)
    if (strcmp(order, "strict")) {
        fprintf(stderr,
                "test_segnet_strict runs --order strict only (./test_segnet runs the rest)\n");
        return 2;
    }
    cuemu_set_arena(1);
    run_tests(filter, "cuda_", " [strict]", set, &tl);
    printf("%d passed, %d failed, %d skipped\n", tl.passed, tl.failed, tl.skipped);
    return tl.failed ? 1 : 0;
#endif
    // A kernel that misses a barrier can pass with the threads of a block run
    // in one order and fail in the other: the cuda_ tests run in both.
    if (!strcmp(order, "forward") || !strcmp(order, "both")) run_tests(filter, NULL, "", set, &tl);
    if (!strcmp(order, "reverse") || !strcmp(order, "both")) {
        printf("== the emulated CUDA tests again, threads in reverse order\n");
        cuemu_set_reverse(1);
        run_tests(filter, "cuda_", " [reverse order]", set, &tl);
        cuemu_set_reverse(0);
    }
    if (!strcmp(order, "random") || !strcmp(order, "both")) {
        // every op has a generic and a vector kernel (kernels.cu, "indexing and
        // memory access"); the first passes ran the vector ones where they apply.
        // A race between warps that both fixed orders miss shows in some random one.
        const char *seed_text = getenv("CUEMU_SEED");
        const unsigned long long seed = seed_text ? strtoull(seed_text, NULL, 0) : 1;
        printf("== the emulated CUDA tests again, generic kernels only, blocks and threads in a "
               "random order (CUEMU_SEED=%llu)\n",
               seed);
        cuda_vector_kernels = 0;
        cuemu_set_random(1, seed);
        run_tests(filter, "cuda_", " [generic kernels, random order]", set, &tl);
        cuemu_set_random(0, 0);
        cuda_vector_kernels = 1;
    }
#ifndef SEGNET_TEST_STRICT
    if (!strcmp(order, "strict") || !strcmp(order, "both")) strict_pass(filter, set, &tl);
#endif
#else
    (void)order;
    run_tests(filter, NULL, "", set, &tl);
#ifndef SEGNET_CUDA
    for (size_t i = 0; i < sizeof CUDA_TESTS / sizeof CUDA_TESTS[0]; i++)
        if (CUDA_TESTS[i].nccl >= 0 && (!filter || strstr(CUDA_TESTS[i].name, filter)))
            tally_skip(&tl, CUDA_TESTS[i].name, SKIP_NO_NVCC);
#endif
#endif
    int any = 0;
    for (int k = 0; k < LAYER_KIND_COUNT; k++) any |= g_worst[k] > 0;
    if (any && g_verbose) {
        printf("worst gradient-check error per layer kind (max |analytic - numerical| / max "
               "|numerical|):\n");
        for (int k = 0; k < LAYER_KIND_COUNT; k++)
            if (g_worst[k] > 0) printf("  %-16s %.2e\n", layer_kind_name((LayerKind)k), g_worst[k]);
        if (g_worst_xent > 0) printf("  %-16s %.2e\n", "softmax_xent", g_worst_xent);
    }
    print_not_run(&tl);
    printf("total %.1fs\n", now_s() - t_all);
    printf("%d passed, %d failed, %d skipped\n", tl.passed, tl.failed, tl.skipped);
    return tl.failed ? 1 : 0;
}

#else  // SEGNET_FUZZ
#include "tests/fuzz.c"  // fuzz_segnet: the harness and its main
#endif  // SEGNET_FUZZ
