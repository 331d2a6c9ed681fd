// kernels.cu -- the CUDA ops table (ops_cuda): hand-written kernels, cuBLAS for
// GEMMs, NCCL for all-reduce; no vendor DNN library.
//
// One source, two builds (see DESIGN.md, "GPU code without a GPU"):
//   nvcc -c kernels.cu                         for GPUs (real <<<>>>, __shared__, cuBLAS, NCCL)
//   g++ -x c++ -std=c++17 -c kernels.cu        for the CPU, against cuda_emu.h / cuda_emu.cpp
// so every kernel launches through CU_LAUNCH and takes dynamic shared memory
// through CU_DYN_SHARED; the rules for kernels that must run on both are at the
// top of cuda_emu.h.
//
// Layout as on the CPU: activations NHWC in the Tensor's storage type (fp32,
// fp16, bf16), loaded to fp32 for arithmetic and rounded to nearest-even when
// stored, with the conversions of segnet.h (identical on both backends);
// parameters, gradients, statistics and optimiser state are fp32. The CPU ops
// (segnet.c) are the specification: the cuda_* tests compare every op here with
// them.

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#define CU_LAUNCH(kernel, grid, block, smem, stream, ...) \
    kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#define CU_DYN_SHARED(T, name)                                         \
    extern __shared__ __align__(16) unsigned char cu_dyn_smem_raw_[]; \
    T *name = reinterpret_cast<T *>(cu_dyn_smem_raw_)
#else
#include "cuda_emu.h"
#endif
#include <cublas_v2.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <mutex>
#include <unordered_map>

#include "segnet.h"

// ----------------------------------------------------------------------------
// checks: a failing CUDA or cuBLAS call is a bug or a dead device, not a user
// error the program can recover from; report where and stop.

static void cuda_check(cudaError_t e, const char *what, const char *file, int line) {
    if (e == cudaSuccess) return;
    fprintf(stderr, "segnet: CUDA error at %s:%d: %s: %s\n", file, line, what, cudaGetErrorString(e));
    exit(1);
}
#define cudaCheck(call) cuda_check((call), #call, __FILE__, __LINE__)
static void cublas_check(cublasStatus_t s, const char *what, const char *file, int line) {
    if (s == CUBLAS_STATUS_SUCCESS) return;
    fprintf(stderr, "segnet: cuBLAS error %d at %s:%d: %s\n", (int)s, file, line, what);
    exit(1);
}
#define cublasCheck(call) cublas_check((call), #call, __FILE__, __LINE__)
// After every launch and cuBLAS call: a bad configuration is reported at the
// launch. A fault inside a kernel (a bad address, a trap) surfaces only at a
// later synchronisation, far from its cause; with SEGNET_CUDA_SYNC=1 in the
// environment (read when a device is opened) each launch is followed by
// cudaDeviceSynchronize, so the message names the op (the function that
// launched) that faulted. Slow: for finding faults only.
static void launch_check(const char *op, const char *file, int line);
#define launchCheck() launch_check(__func__, __FILE__, __LINE__)

// ----------------------------------------------------------------------------
// the backend's state and small helpers shared by the kernels

// Partial sums of the deterministic reductions (sum_squares, softmax_xent): one
// row of REDUCE_WIDTH doubles per block of the first pass, summed in block order
// by the second.
#define REDUCE_BLOCKS_MAX 1024
#define REDUCE_WIDTH 3

// One per device: every ops table (ops_cuda for device 0, copies of it for the
// others: cuda_ops_for_device) has its own. Every entry point of a table makes
// its device current (ctx_of calls cudaSetDevice) before it touches memory,
// a stream or cuBLAS, so one thread may call the tables of several devices in
// turn (tests, the local replicas' turns) without setting the device itself.
// With the device already current, cudaSetDevice is a check of a thread-local.
struct CudaCtx {
    int device;
    cudaStream_t stream;  // every op runs on it, in order
    cublasHandle_t blas;
    double *reduce_partials;  // (REDUCE_BLOCKS_MAX, REDUCE_WIDTH), allocated once in ctx_open
    double *sums;  // (SUMS_SCRATCH) partial per-channel sums of channel_sums
    // the replicas' collectives (NCCL) run on a stream of their own, ordered
    // after the work on `stream` before them (compute_done) and before the
    // work after them (comm_done): see "NCCL communicators" below
    cudaStream_t comm_stream;
    cudaEvent_t compute_done, comm_done;
    void *blas_workspace;  // (CUBLAS_WORKSPACE_BYTES) cuBLAS's, given with cublasSetWorkspace
    bool sync_each;        // SEGNET_CUDA_SYNC: synchronise and check after every launch
};
static thread_local CudaCtx *ctx_current;  // the last table entered on this thread (launch_check's)
static CudaCtx *ctx_of(Ops *o) {
    CudaCtx *x = (CudaCtx *)o->ctx;
    cudaCheck(cudaSetDevice(x->device));
    ctx_current = x;
    return x;
}
static void launch_check(const char *op, const char *file, int line) {
    cudaError_t e = cudaGetLastError();
    const bool sync = ctx_current && ctx_current->sync_each;
    if (e == cudaSuccess && sync) e = cudaDeviceSynchronize();
    if (e == cudaSuccess) return;
    fprintf(stderr, "segnet: CUDA error in %s (%s:%d)%s: %s\n", op, file, line,
            sync ? ", synchronised after the launch (SEGNET_CUDA_SYNC)" : "", cudaGetErrorString(e));
    exit(1);
}
static cudaStream_t stream_of(Ops *o) { return ctx_of(o)->stream; }

#define BLOCK 256  // threads per block of the elementwise kernels

// blocks for a grid-stride loop over n elements (bounded: the loop covers the rest)
static unsigned grid_for(size_t n) {
    size_t b = (n + BLOCK - 1) / BLOCK;
    if (b < 1) b = 1;
    if (b > 4096) b = 4096;
    return (unsigned)b;
}

// storage-type load and store: the conversions of segnet.h, so a value rounds
// to the same bits on both backends
static __device__ __forceinline__ float ld(const void *p, DType dt, size_t i) {
    if (dt == DT_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dt == DT_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}
static __device__ __forceinline__ void st(void *p, DType dt, size_t i, float v) {
    if (dt == DT_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = dt == DT_F16 ? f32_to_f16(v) : f32_to_bf16(v);
}

// ----------------------------------------------------------------------------
// memory: device allocations, copies between host and device

// The backend counts the bytes it hands out (live and peak, as the CPU backend
// does): segnet bench reports the peak as peak_device_bytes.
size_t cuda_bytes_live, cuda_bytes_peak;
static std::unordered_map<void *, size_t> cuda_alloc_sizes;  // live allocations (every device): their sizes
static std::mutex cuda_alloc_mutex;  // local replicas allocate from their own threads

static void *cuda_alloc(Ops *o, size_t bytes) {
    ctx_of(o);
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky error: the caller reports "out of memory"
        return NULL;
    }
    std::lock_guard<std::mutex> lock(cuda_alloc_mutex);
    cuda_alloc_sizes[p] = bytes;
    cuda_bytes_live += bytes;
    if (cuda_bytes_live > cuda_bytes_peak) cuda_bytes_peak = cuda_bytes_live;
    return p;
}
static void cuda_free(Ops *o, void *p) {
    if (!p) return;
    ctx_of(o);
    {
        std::lock_guard<std::mutex> lock(cuda_alloc_mutex);
        auto it = cuda_alloc_sizes.find(p);
        if (it != cuda_alloc_sizes.end()) { cuda_bytes_live -= it->second; cuda_alloc_sizes.erase(it); }
    }
    cudaCheck(cudaFree(p));
}
static void cuda_upload(Ops *o, void *dst, const void *host_src, size_t bytes) {
    cudaCheck(cudaMemcpyAsync(dst, host_src, bytes, cudaMemcpyHostToDevice, stream_of(o)));
    cudaCheck(cudaStreamSynchronize(stream_of(o)));  // the host buffer may be reused at once
}
static void cuda_download(Ops *o, void *host_dst, const void *src, size_t bytes) {
    cudaCheck(cudaMemcpyAsync(host_dst, src, bytes, cudaMemcpyDeviceToHost, stream_of(o)));
    cudaCheck(cudaStreamSynchronize(stream_of(o)));
}
static void cuda_synchronize(Ops *o) { cudaCheck(cudaStreamSynchronize(stream_of(o))); }

// ----------------------------------------------------------------------------
// utilities over whole buffers

__global__ void fill_kernel(void *y, DType dt, size_t n, float value) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x)
        st(y, dt, i, value);
}
static void fill_cuda(Ops *o, Tensor t, float value) {
    size_t n = shape_numel(t.shape);
    if (!n) return;
    CU_LAUNCH(fill_kernel, grid_for(n), BLOCK, 0, stream_of(o), t.data, t.dtype, n, value);
    launchCheck();
}

// dst (=|+=) src, casting between storage types; += adds in fp32 and rounds once
__global__ void copy_kernel(void *dst, DType dt_dst, const void *src, DType dt_src, size_t n, int accumulate) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        float v = ld(src, dt_src, i);
        st(dst, dt_dst, i, accumulate ? ld(dst, dt_dst, i) + v : v);
    }
}
static void copy_cuda(Ops *o, Tensor dst, Tensor src, int accumulate) {
    size_t n = shape_numel(src.shape);
    if (!n) return;
    CU_LAUNCH(copy_kernel, grid_for(n), BLOCK, 0, stream_of(o), dst.data, dst.dtype, src.data, src.dtype, n,
              accumulate);
    launchCheck();
}

// t *= a
__global__ void scale_kernel(void *t, DType dt, size_t n, float a) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x)
        st(t, dt, i, a * ld(t, dt, i));
}
static void scale_cuda(Ops *o, Tensor t, float a) {
    size_t n = shape_numel(t.shape);
    if (!n) return;
    CU_LAUNCH(scale_kernel, grid_for(n), BLOCK, 0, stream_of(o), t.data, t.dtype, n, a);
    launchCheck();
}

// y (=|+=) a·x + b
__global__ void axpby_kernel(void *y, DType dt_y, const void *x, DType dt_x, size_t n, float a, float b,
                             int accumulate) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        float v = a * ld(x, dt_x, i) + b;
        st(y, dt_y, i, accumulate ? ld(y, dt_y, i) + v : v);
    }
}
static void axpby_cuda(Ops *o, Tensor y, Tensor x, float a, float b, int accumulate) {
    size_t n = shape_numel(x.shape);
    if (!n) return;
    CU_LAUNCH(axpby_kernel, grid_for(n), BLOCK, 0, stream_of(o), y.data, y.dtype, x.data, x.dtype, n, a, b,
              accumulate);
    launchCheck();
}

// ---- deterministic reductions: each block of the first pass sums a fixed set
// of elements (grid-stride over a grid that depends only on n) in fp64 and
// reduces them in a fixed tree; the second pass adds the blocks' partials in
// block order. The same input gives the same bits on any GPU, run to run.

static unsigned reduce_grid(size_t n) {
    size_t b = (n + BLOCK - 1) / BLOCK;
    if (b < 1) b = 1;
    if (b > REDUCE_BLOCKS_MAX) b = REDUCE_BLOCKS_MAX;
    return (unsigned)b;
}

// sh (BLOCK, REDUCE_WIDTH) holds each thread's values; afterwards sh[0..width-1]
// holds the block's sums, each paired in the same order whatever the timing
static __device__ void block_sum_tree(double *sh, int width) {
    __syncthreads();
    for (int s = BLOCK / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s)
            for (int j = 0; j < width; j++)
                sh[threadIdx.x * REDUCE_WIDTH + j] += sh[(threadIdx.x + s) * REDUCE_WIDTH + j];
        __syncthreads();
    }
}

// second pass, one block: out[j] (=|+=) (float)Σ_b partials[b, j] over the n_blocks rows
__global__ void reduce_partials_kernel(const double *partials, int n_blocks, int width, float *out, int accumulate) {
    __shared__ double sh[BLOCK * REDUCE_WIDTH];
    for (int j = 0; j < width; j++) {
        double s = 0.0;
        for (int b = threadIdx.x; b < n_blocks; b += BLOCK) s += partials[b * REDUCE_WIDTH + j];
        sh[threadIdx.x * REDUCE_WIDTH + j] = s;
    }
    block_sum_tree(sh, width);
    if (threadIdx.x == 0)
        for (int j = 0; j < width; j++) out[j] = accumulate ? out[j] + (float)sh[j] : (float)sh[j];
}
static void reduce_partials(Ops *o, unsigned n_blocks, int width, float *out, int accumulate) {
    CU_LAUNCH(reduce_partials_kernel, 1, BLOCK, 0, stream_of(o), ctx_of(o)->reduce_partials, (int)n_blocks, width,
              out, accumulate);
    launchCheck();
}

// *out = Σ t², accumulated in fp64 (as on the CPU), rounded once to fp32
__global__ void sum_squares_kernel(const void *t, DType dt, size_t n, double *partials) {
    __shared__ double sh[BLOCK * REDUCE_WIDTH];
    double s = 0.0;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        double v = ld(t, dt, i);
        s += v * v;
    }
    sh[threadIdx.x * REDUCE_WIDTH] = s;
    block_sum_tree(sh, 1);
    if (threadIdx.x == 0) partials[blockIdx.x * REDUCE_WIDTH] = sh[0];
}
static void sum_squares_cuda(Ops *o, Tensor t, float *out) {
    size_t n = shape_numel(t.shape);
    unsigned grid = reduce_grid(n);
    CU_LAUNCH(sum_squares_kernel, grid, BLOCK, 0, stream_of(o), t.data, t.dtype, n, ctx_of(o)->reduce_partials);
    launchCheck();
    reduce_partials(o, grid, 1, out, 0);
}

// *flag = 1 if any element is inf or NaN; untouched otherwise (so one flag can
// collect the checks of several tensors)
__global__ void nonfinite_kernel(const void *t, DType dt, size_t n, int32_t *flag) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x)
        if (!isfinite(ld(t, dt, i))) atomicExch((int *)flag, 1);
}
static void nonfinite_cuda(Ops *o, Tensor t, int32_t *flag) {
    size_t n = shape_numel(t.shape);
    if (!n) return;
    CU_LAUNCH(nonfinite_kernel, grid_for(n), BLOCK, 0, stream_of(o), t.data, t.dtype, n, flag);
    launchCheck();
}

// ----------------------------------------------------------------------------
// fused softmax + weighted cross-entropy, per pixel (row of K logits), as the
// CPU op: p = softmax(z) with the max subtracted, nll = log Σ_k exp(z_k - max) + max - z_y,
// loss += w[y]·nll, wsum += w[y], dz_k = w[y]·(p_k - [k = y])·inv_norm.
// One thread per row (K is small for segmentation); the per-row arithmetic is
// fp32, the sums over rows fp64 through the deterministic two-pass reduction.

__global__ void softmax_xent_kernel(const void *logits, DType dt, const int32_t *labels, const float *class_weights,
                                    int K, size_t rows, float inv_norm, void *dlogits, DType dt_grad,
                                    double *partials) {
    __shared__ double sh[BLOCK * REDUCE_WIDTH];
    double loss = 0.0, wsum = 0.0, invalid = 0.0;
    for (size_t r = blockIdx.x * (size_t)blockDim.x + threadIdx.x; r < rows; r += (size_t)blockDim.x * gridDim.x) {
        const int32_t y = labels[r];
        const int valid = y >= 0 && y < K;
        const float wy = valid ? class_weights[y] : 0.0f;
        if (!valid) invalid += 1.0;
        const size_t base = r * (size_t)K;
        float zmax = -INFINITY;
        for (int c = 0; c < K; c++) { float z = ld(logits, dt, base + c); if (z > zmax) zmax = z; }
        float sum = 0.0f;
        for (int c = 0; c < K; c++) sum += expf(ld(logits, dt, base + c) - zmax);
        if (wy != 0.0f) {
            float nll = logf(sum) + zmax - ld(logits, dt, base + y);
            loss += (double)wy * nll;
            wsum += wy;
        }
        if (dlogits)
            for (int c = 0; c < K; c++) {
                float p = expf(ld(logits, dt, base + c) - zmax) / sum;
                st(dlogits, dt_grad, base + c, wy * (p - (c == y ? 1.0f : 0.0f)) * inv_norm);
            }
    }
    sh[threadIdx.x * REDUCE_WIDTH + 0] = loss;
    sh[threadIdx.x * REDUCE_WIDTH + 1] = wsum;
    sh[threadIdx.x * REDUCE_WIDTH + 2] = invalid;
    block_sum_tree(sh, 3);
    if (threadIdx.x == 0)
        for (int j = 0; j < 3; j++) partials[blockIdx.x * REDUCE_WIDTH + j] = sh[j];
}
// logits (N,H,W,K), labels (N·H·W), class_weights (K); stats[0..2] += Σ w·nll, Σ w, invalid labels
static void softmax_xent_cuda(Ops *o, Tensor logits, const int32_t *labels, const float *class_weights,
                              float inv_norm, float *stats, Tensor dlogits) {
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K;
    unsigned grid = reduce_grid(rows);
    CU_LAUNCH(softmax_xent_kernel, grid, BLOCK, 0, stream_of(o), logits.data, logits.dtype, labels, class_weights, K,
              rows, inv_norm, dlogits.data, dlogits.dtype, ctx_of(o)->reduce_partials);
    launchCheck();
    reduce_partials(o, grid, 3, stats, 1);
}

// confusion[y·K + argmax_k z_k] += 1 for labels in 0..K-1, ties to the lowest
// class (the CPU's strict >, so a NaN logit never wins unless it is the first).
// Integer atomics are exact, so the counts are deterministic. For K ≤
// CONFUSION_SHARED_MAX_K each block counts in shared memory first and adds its
// K×K counts once: segmentation has few classes and many pixels, which would
// otherwise all hit the same few counters.
#define CONFUSION_SHARED_MAX_K 64  // K·K·8 bytes = 32 KiB of shared memory at most

__global__ void confusion_kernel(const void *logits, DType dt, const int32_t *labels, int K, size_t rows,
                                 unsigned long long *confusion, int in_shared) {
    CU_DYN_SHARED(unsigned long long, block_counts);  // (K,K) when in_shared
    unsigned long long *counts = in_shared ? block_counts : confusion;
    if (in_shared) {
        for (int i = threadIdx.x; i < K * K; i += blockDim.x) block_counts[i] = 0;
        __syncthreads();
    }
    for (size_t r = blockIdx.x * (size_t)blockDim.x + threadIdx.x; r < rows; r += (size_t)blockDim.x * gridDim.x) {
        const int32_t y = labels[r];
        if (y < 0 || y >= K) continue;
        const size_t base = r * (size_t)K;
        int best = 0;
        float zbest = ld(logits, dt, base);
        for (int c = 1; c < K; c++) { float z = ld(logits, dt, base + c); if (z > zbest) { zbest = z; best = c; } }
        atomicAdd(&counts[y * K + best], 1ull);
    }
    if (in_shared) {
        __syncthreads();
        for (int i = threadIdx.x; i < K * K; i += blockDim.x)
            if (block_counts[i]) atomicAdd(&confusion[i], block_counts[i]);
    }
}
// logits (N,H,W,K), labels (N·H·W), confusion (K,K) int64, true class by row
static void confusion_accumulate_cuda(Ops *o, Tensor logits, const int32_t *labels, int64_t *confusion) {
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K;
    if (!rows) return;
    const int in_shared = K <= CONFUSION_SHARED_MAX_K;
    const size_t smem = in_shared ? (size_t)K * K * sizeof(unsigned long long) : 0;
    CU_LAUNCH(confusion_kernel, grid_for(rows), BLOCK, smem, stream_of(o), logits.data, logits.dtype, labels, K,
              rows, (unsigned long long *)confusion, in_shared);
    launchCheck();
}

// ----------------------------------------------------------------------------
// Adam over the whole parameter buffer (the formula is at AdamStep in segnet.h),
// elementwise. Every operation is rounded on its own (__fmul_rn and friends
// cannot be fused into multiply-adds) in the CPU op's order, which is compiled
// without contraction too: both backends give the same bits.

__global__ void adam_kernel(float *params, const float *grads, float *m, float *v, size_t n, AdamStep s) {
    const float decay = __fmul_rn(s.lr, s.weight_decay);
    const float one_minus_b1 = __fsub_rn(1.0f, s.beta1), one_minus_b2 = __fsub_rn(1.0f, s.beta2);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        float g = __fmul_rn(grads[i], s.grad_scale), p = params[i];
        if (decay != 0.0f) p = __fsub_rn(p, __fmul_rn(decay, p));
        float mi = __fadd_rn(m[i], __fmul_rn(__fsub_rn(g, m[i]), one_minus_b1));
        float vi = __fadd_rn(v[i], __fmul_rn(__fsub_rn(__fmul_rn(g, g), v[i]), one_minus_b2));
        m[i] = mi;
        v[i] = vi;
        params[i] = __fsub_rn(p, __fdiv_rn(__fmul_rn(s.alpha, mi), __fadd_rn(__fsqrt_rn(vi), s.eps)));
    }
}
// params, grads, m, v: (n) fp32
static void adam_update_cuda(Ops *o, float *params, const float *grads, float *m, float *v, size_t n,
                             const AdamStep *s) {
    if (!n) return;
    CU_LAUNCH(adam_kernel, grid_for(n), BLOCK, 0, stream_of(o), params, grads, m, v, n, *s);
    launchCheck();
}

// ----------------------------------------------------------------------------
// conv2d
//
// The lowering of the CPU ops (segnet.c, "conv2d"), on cuBLAS:
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
//     two-pass fixed-order reduction over N·OH·OW.
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
// the partial sums of the reductions. The ops run chunk after chunk on one
// stream, so a chunk may reuse the previous chunk's space.

size_t cuda_conv_chunk_bytes = (size_t)64 << 20;  // 64 MiB: a large conv still runs as a few big GEMMs

#define WS_ALIGN 256          // each part of the workspace starts on a 256-byte boundary
#define REDUCE_ROWS 256       // rows summed by one block of a column reduction, at least...
#define REDUCE_PARTS_MAX 64   // ...but at most this many partial sums per column (pass 2 adds them)

static size_t align_up(size_t b) { return (b + WS_ALIGN - 1) / WS_ALIGN * WS_ALIGN; }

// what a conv on a given input does, and where its workspace parts are
typedef struct {
    ConvGeom q;
    int G, GK;             // groups; columns of an im2col row, G·K = kh·kw·Cin
    int pointwise, depthwise;
    DType dt;
    int fwd_rows;          // output rows (n,oy) per forward / backward-weight chunk
    int bwd_rows;          // input rows (n,iy) per backward-data chunk
    int bwd_out_rows;      // the most output rows a backward-data chunk reads
    int parts;             // partial sums per column of a reduction over N·OH·OW
    size_t wcast;          // bytes of the weights in the storage type (at ws + 0; what follows is aligned)
    size_t col_row;        // bytes of im2col columns per output row (storage type)
    size_t rows32_row;     // bytes of fp32 output rows per output row (forward with bias, 16-bit)
    size_t dcol_row;       // bytes of fp32 dcol per output row
    size_t reduce;         // bytes of partial sums of the backward-weight reductions
} ConvPlan;

// rows per chunk: whole images when one fits in `cap`, else as many rows as fit (at least 1)
static int rows_per_chunk(size_t row_bytes, int rows_per_image, int images, size_t cap) {
    if (row_bytes == 0) return rows_per_image * images;
    size_t image = row_bytes * rows_per_image;
    if (image <= cap) return rows_per_image * (int)(cap / image < (size_t)images ? cap / image : (size_t)images);
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
static void bwd_band_out_rows(const ConvCfg *cfg, const ConvGeom *q, int u0, int u1, int *t0, int *t1) {
    const int s = cfg->stride, n0 = u0 / q->H, iy0 = u0 % q->H, n1 = (u1 - 1) / q->H, iy1 = (u1 - 1) % q->H;
    int lo = iy0 + q->pt - (cfg->kh - 1);             // s·oy >= lo
    int oy_lo = lo <= 0 ? 0 : (lo + s - 1) / s;
    int oy_hi = (iy1 + q->pt) / s;                    // s·oy <= iy1 + pt
    if (oy_hi > q->OH - 1) oy_hi = q->OH - 1;
    *t0 = n0 * q->OH + oy_lo;
    *t1 = n1 * q->OH + oy_hi + 1;
    if (*t1 < *t0) *t1 = *t0;                         // rows no output reads: din = 0 (or unchanged)
}

static void conv_fail(const char *what, const ConvCfg *cfg, Shape in) {
    fprintf(stderr, "segnet: internal error in %s: input (%d,%d,%d,%d) for conv cin %d cout %d kernel %dx%d groups %d\n",
            what, in.n, in.h, in.w, in.c, cfg->cin, cfg->cout, cfg->kh, cfg->kw, cfg->groups);
    exit(1);
}

static ConvPlan conv_plan(const ConvCfg *cfg, Shape in, DType dt) {
    ConvPlan p;
    memset(&p, 0, sizeof p);
    if (!conv_geom_of(cfg, in, &p.q)) conv_fail("conv2d (input does not fit)", cfg, in);
    const ConvGeom *q = &p.q;
    const size_t es = dtype_size(dt), cap = cuda_conv_chunk_bytes;
    p.G = cfg->groups; p.GK = cfg->groups * q->K; p.dt = dt;
    p.pointwise = conv_is_pointwise(cfg); p.depthwise = conv_is_depthwise(cfg);
    size_t M = (size_t)q->N * q->P;
    p.parts = (int)((M + REDUCE_ROWS - 1) / REDUCE_ROWS);
    if (p.parts > REDUCE_PARTS_MAX) p.parts = REDUCE_PARTS_MAX;
    if (p.parts < 1) p.parts = 1;
    if (p.depthwise) {  // the weight gradient's partial sums, [part][c][ky][kx]; dbias uses the first C·parts
        p.reduce = (size_t)p.parts * q->C * cfg->kh * cfg->kw * sizeof(float);
        return p;
    }
    p.reduce = cfg->has_bias ? (size_t)p.parts * q->Cout * sizeof(float) : 0;
    p.wcast = dt == DT_F32 ? 0 : (size_t)q->Cout * q->K * es;
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
    size_t col = p->fwd_rows * p->col_row, rows32 = p->fwd_rows * p->rows32_row;
    if (rows32) col = align_up(col) + rows32;
    return col ? align_up(p->wcast) + col : p->wcast;
}
static size_t ws_backward_data(const ConvPlan *p) {
    size_t dcol = p->bwd_out_rows * p->dcol_row;
    return dcol ? align_up(p->wcast) + dcol : p->wcast;
}
static size_t ws_backward_weight(const ConvPlan *p) {
    size_t col = p->fwd_rows * p->col_row;
    return col > p->reduce ? col : p->reduce;
}

static size_t conv2d_workspace_cuda(Ops *o, const ConvCfg *cfg, Shape in, DType dt) {
    (void)o;
    ConvPlan p = conv_plan(cfg, in, dt);
    if (p.depthwise) return p.reduce;
    size_t f = ws_forward(&p), d = ws_backward_data(&p), w = ws_backward_weight(&p);
    return f > d ? (f > w ? f : w) : (d > w ? d : w);
}

static cudaDataType blas_type(DType dt) { return dt == DT_F32 ? CUDA_R_32F : dt == DT_F16 ? CUDA_R_16F : CUDA_R_16BF; }
static void *at_elem(const void *p, DType dt, size_t i) { return (char *)p + i * dtype_size(dt); }

// C (m×n, column-major) = op(A)·op(B) + beta·C with fp32 accumulation; A and B of
// type ab, C of type c: the combinations cuBLAS supports with CUBLAS_COMPUTE_32F
// (A = B = fp32 with C fp32; A = B = fp16 or bf16 with C the same or fp32)
static void gemm_ex(Ops *o, cublasOperation_t ta, cublasOperation_t tb, size_t m, size_t n, size_t k,
                    const void *A, int lda, const void *B, int ldb, DType ab, float beta, void *C, int ldc, DType c) {
    if (m > INT_MAX || n > INT_MAX || k > INT_MAX) {
        fprintf(stderr, "segnet: internal error: GEMM of %zux%zux%zu exceeds cuBLAS' int dimensions\n", m, n, k);
        exit(1);
    }
    const float alpha = 1.0f;
    cublasCheck(cublasGemmEx(ctx_of(o)->blas, ta, tb, (int)m, (int)n, (int)k, &alpha, A, blas_type(ab), lda, B,
                             blas_type(ab), ldb, &beta, C, blas_type(c), ldc, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
    launchCheck();
}

// col[p][g][ky][kx][ci] = x[n, oy·s - pt + ky, ox·s - pl + kx, g·Cg + ci] (0 outside)
// for the output pixels p of output rows t0.. (flattened n·OH + oy), p relative to t0
__global__ void im2col_kernel(void *col, const void *in, DType dt, ConvCfg cfg, ConvGeom q, int t0, size_t n) {
    const int taps = cfg.kh * cfg.kw, GK = cfg.groups * q.K;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)blockDim.x * gridDim.x) {
        const int ci = (int)(e % q.Cg), tap = (int)(e / q.Cg % taps), g = (int)(e / q.K % cfg.groups);
        const size_t p = e / GK;
        const int t = t0 + (int)(p / q.OW), ox = (int)(p % q.OW), img = t / q.OH, oy = t % q.OH;
        const int iy = oy * cfg.stride - q.pt + tap / cfg.kw, ix = ox * cfg.stride - q.pl + tap % cfg.kw;
        float v = 0.0f;
        if (iy >= 0 && iy < q.H && ix >= 0 && ix < q.W)
            v = ld(in, dt, (((size_t)img * q.H + iy) * q.W + ix) * q.C + (size_t)g * q.Cg + ci);
        st(col, dt, e, v);  // a stored value: exact in its own type
    }
}
static void im2col(Ops *o, void *col, Tensor in, const ConvCfg *cfg, const ConvGeom *q, int t0, int t1) {
    size_t n = (size_t)(t1 - t0) * q->OW * cfg->groups * q->K;
    CU_LAUNCH(im2col_kernel, grid_for(n), BLOCK, 0, stream_of(o), col, in.data, in.dtype, *cfg, *q, t0, n);
    launchCheck();
}

// din[n,iy,ix,g·Cg+ci] (=|+=) Σ_{ky,kx} dcol[p(oy,ox)][g][ky][kx][ci], oy = (iy + pt - ky)/s
// integral and inside the output (likewise ox), summed in (ky, kx) order like the
// CPU's col2im; input rows u0.. (flattened n·H + iy), dcol rows from output row t0
__global__ void col2im_kernel(void *din, DType dt, const float *dcol, ConvCfg cfg, ConvGeom q, int u0, int t0,
                              size_t n, int accumulate) {
    const int s = cfg.stride, GK = cfg.groups * q.K;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)blockDim.x * gridDim.x) {
        const int c = (int)(e % q.C), ix = (int)(e / q.C % q.W), u = u0 + (int)(e / ((size_t)q.C * q.W));
        const int img = u / q.H, iy = u % q.H, g = c / q.Cg, ci = c % q.Cg;
        float acc = 0.0f;
        for (int ky = 0; ky < cfg.kh; ky++) {
            const int ty = iy + q.pt - ky;
            if (ty < 0 || ty % s || ty / s >= q.OH) continue;
            for (int kx = 0; kx < cfg.kw; kx++) {
                const int tx = ix + q.pl - kx;
                if (tx < 0 || tx % s || tx / s >= q.OW) continue;
                const size_t p = (size_t)(img * q.OH + ty / s - t0) * q.OW + tx / s;
                acc += dcol[p * GK + (size_t)g * q.K + (ky * cfg.kw + kx) * q.Cg + ci];
            }
        }
        const size_t i = (size_t)u * q.W * q.C + (size_t)ix * q.C + c;
        st(din, dt, i, accumulate ? ld(din, dt, i) + acc : acc);
    }
}

// y[r][c] = rows[r][c] + b[c], rounded to y's type; rows may alias y when it is fp32
__global__ void bias_rows_kernel(void *y, DType dt, const float *rows, const float *b, int C, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x)
        st(y, dt, i, rows[i] + b[i % C]);
}

// Deterministic column sums, pass 1. A block is 32 columns × 8 row lanes; it
// sums the rows of its part [part·rows_per_part, ...) for its columns, each lane
// every 8th row in order, then the 8 lanes in order, and writes
// partial[part][col]. Pass 2 (sum_parts_kernel) adds the parts in order.
#define RED_X 32
#define RED_Y 8
static __device__ float block_rows_sum(float v) {  // the sum of v over threadIdx.y, valid in lane y = 0
    __shared__ float lanes[RED_Y][RED_X];
    lanes[threadIdx.y][threadIdx.x] = v;
    __syncthreads();
    float s = 0.0f;
    if (threadIdx.y == 0)
        for (int y = 0; y < RED_Y; y++) s += lanes[y][threadIdx.x];
    return s;
}
// partial[part][c] = Σ_{r in part} x[r][c]: x (M, C) in storage type
__global__ void column_sum_kernel(float *partial, const void *x, DType dt, size_t M, int C, size_t rows_per_part) {
    const int c = blockIdx.x * RED_X + threadIdx.x, part = blockIdx.y;
    const size_t r0 = part * rows_per_part, r1 = r0 + rows_per_part < M ? r0 + rows_per_part : M;
    float s = 0.0f;
    if (c < C)
        for (size_t r = r0 + threadIdx.y; r < r1; r += RED_Y) s += ld(x, dt, r * C + c);
    s = block_rows_sum(s);
    if (threadIdx.y == 0 && c < C) partial[(size_t)part * C + c] = s;
}
// dst[i] += Σ_{part} partial[part][i], parts in order
__global__ void sum_parts_kernel(float *dst, const float *partial, int parts, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        float s = 0.0f;
        for (int k = 0; k < parts; k++) s += partial[k * n + i];
        dst[i] += s;
    }
}
static size_t rows_per_part(size_t M, int parts) { return (M + parts - 1) / parts; }
// db[c] += Σ_{n,oy,ox} dout[n,oy,ox,c], through `partial` (parts·C floats)
static void bias_grad(Ops *o, float *db, Tensor dout, int parts, float *partial) {
    const int C = dout.shape.c;
    const size_t M = shape_numel(dout.shape) / C;
    dim3 grid((C + RED_X - 1) / RED_X, parts), block(RED_X, RED_Y);
    CU_LAUNCH(column_sum_kernel, grid, block, 0, stream_of(o), partial, dout.data, dout.dtype, M, C,
              rows_per_part(M, parts));
    launchCheck();
    CU_LAUNCH(sum_parts_kernel, grid_for(C), BLOCK, 0, stream_of(o), db, partial, parts, (size_t)C);
    launchCheck();
}

// depthwise: out[n,oy,ox,c] = b[c] + Σ_{ky,kx} x[n, oy·s - pt + ky, ox·s - pl + kx, c]·w[c][ky][kx],
// taps in (ky, kx) order after the bias, like the CPU
__global__ void depthwise_forward_kernel(void *out, const void *in, DType dt_out, DType dt_in, const float *w,
                                         const float *b, ConvCfg cfg, ConvGeom q, size_t n) {
    const int taps = cfg.kh * cfg.kw;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)blockDim.x * gridDim.x) {
        const int c = (int)(e % q.C), ox = (int)(e / q.C % q.OW), oy = (int)(e / ((size_t)q.C * q.OW) % q.OH);
        const int img = (int)(e / ((size_t)q.C * q.P));
        float acc = b ? b[c] : 0.0f;
        for (int ky = 0; ky < cfg.kh; ky++) {
            const int iy = oy * cfg.stride - q.pt + ky;
            if (iy < 0 || iy >= q.H) continue;
            for (int kx = 0; kx < cfg.kw; kx++) {
                const int ix = ox * cfg.stride - q.pl + kx;
                if (ix < 0 || ix >= q.W) continue;
                acc += ld(in, dt_in, (((size_t)img * q.H + iy) * q.W + ix) * q.C + c) * w[c * taps + ky * cfg.kw + kx];
            }
        }
        st(out, dt_out, e, acc);
    }
}
// din[n,iy,ix,c] (=|+=) Σ_{ky,kx} dout[n,oy,ox,c]·w[c][ky][kx], oy = (iy + pt - ky)/s integral
__global__ void depthwise_backward_data_kernel(void *din, const void *dout, DType dt_din, DType dt_dout,
                                               const float *w, ConvCfg cfg, ConvGeom q, size_t n, int accumulate) {
    const int taps = cfg.kh * cfg.kw, s = cfg.stride;
    for (size_t e = blockIdx.x * (size_t)blockDim.x + threadIdx.x; e < n; e += (size_t)blockDim.x * gridDim.x) {
        const int c = (int)(e % q.C), ix = (int)(e / q.C % q.W), iy = (int)(e / ((size_t)q.C * q.W) % q.H);
        const int img = (int)(e / ((size_t)q.C * q.W * q.H));
        float acc = 0.0f;
        for (int ky = 0; ky < cfg.kh; ky++) {
            const int ty = iy + q.pt - ky;
            if (ty < 0 || ty % s || ty / s >= q.OH) continue;
            for (int kx = 0; kx < cfg.kw; kx++) {
                const int tx = ix + q.pl - kx;
                if (tx < 0 || tx % s || tx / s >= q.OW) continue;
                acc += ld(dout, dt_dout, (((size_t)img * q.OH + ty / s) * q.OW + tx / s) * q.C + c) *
                       w[c * taps + ky * cfg.kw + kx];
            }
        }
        st(din, dt_din, e, accumulate ? ld(din, dt_din, e) + acc : acc);
    }
}
// pass 1 of dw[c][ky][kx] += Σ_{n,oy,ox} dout[n,oy,ox,c]·x[n, oy·s - pt + ky, ox·s - pl + kx, c]:
// block (columns c, part, tap = blockIdx.z) writes partial[part][c][tap]
__global__ void depthwise_weight_partial_kernel(float *partial, const void *dout, const void *in, DType dt_dout,
                                                DType dt_in, ConvCfg cfg, ConvGeom q, size_t rows_per_part) {
    const int c = blockIdx.x * RED_X + threadIdx.x, part = blockIdx.y, tap = blockIdx.z;
    const int ky = tap / cfg.kw, kx = tap % cfg.kw, taps = cfg.kh * cfg.kw;
    const size_t M = (size_t)q.N * q.P, r0 = part * rows_per_part, r1 = r0 + rows_per_part < M ? r0 + rows_per_part : M;
    float s = 0.0f;
    if (c < q.C)
        for (size_t r = r0 + threadIdx.y; r < r1; r += RED_Y) {  // r = (n·OH + oy)·OW + ox
            const int ox = (int)(r % q.OW), oy = (int)(r / q.OW % q.OH), img = (int)(r / q.P);
            const int iy = oy * cfg.stride - q.pt + ky, ix = ox * cfg.stride - q.pl + kx;
            if (iy < 0 || iy >= q.H || ix < 0 || ix >= q.W) continue;
            s += ld(dout, dt_dout, r * q.C + c) * ld(in, dt_in, (((size_t)img * q.H + iy) * q.W + ix) * q.C + c);
        }
    s = block_rows_sum(s);
    if (threadIdx.y == 0 && c < q.C) partial[((size_t)part * q.C + c) * taps + tap] = s;
}

static void conv_check_out(const char *what, const ConvGeom *q, Shape out, const ConvCfg *cfg, Shape in) {
    if (out.n != q->N || out.h != q->OH || out.w != q->OW || out.c != q->Cout) conv_fail(what, cfg, in);
}

static void conv2d_forward_cuda(Ops *o, const ConvCfg *cfg, Tensor out, Tensor in, const float *w, const float *b,
                                void *ws) {
    ConvPlan p = conv_plan(cfg, in.shape, in.dtype);
    const ConvGeom *q = &p.q;
    conv_check_out("conv2d_forward (out shape)", q, out.shape, cfg, in.shape);
    if (p.depthwise) {
        size_t n = shape_numel(out.shape);
        CU_LAUNCH(depthwise_forward_kernel, grid_for(n), BLOCK, 0, stream_of(o), out.data, in.data, out.dtype,
                  in.dtype, w, b, *cfg, *q, n);
        launchCheck();
        return;
    }
    if (out.dtype != in.dtype) conv_fail("conv2d_forward (in and out storage types differ)", cfg, in.shape);
    if (b && !cfg->has_bias) conv_fail("conv2d_forward (a bias for a conv without one)", cfg, in.shape);
    const DType dt = in.dtype;
    const void *wt = w;  // [Cout][K] in the storage type
    if (dt != DT_F32) {
        CU_LAUNCH(copy_kernel, grid_for((size_t)q->Cout * q->K), BLOCK, 0, stream_of(o), ws, dt, w, DT_F32,
                  (size_t)q->Cout * q->K, 0);
        launchCheck();
        wt = ws;
    }
    void *col = (char *)ws + align_up(p.wcast);                              // (rows·OW, G·K)
    float *rows32 = (float *)((char *)col + align_up(p.fwd_rows * p.col_row));  // (rows·OW, Cout)
    const int total = q->N * q->OH;
    for (int t0 = 0; t0 < total;) {
        const int t1 = chunk_end(t0, p.fwd_rows, q->OH, total);
        const size_t pix = (size_t)(t1 - t0) * q->OW, first = (size_t)t0 * q->OW;
        const void *B = in.data;  // pointwise: the input pixels are the output pixels
        int ldb = q->C;
        if (!p.pointwise) { im2col(o, col, in, cfg, q, t0, t1); B = col; ldb = p.GK; }
        else B = at_elem(in.data, dt, first * q->C);
        const int via32 = b && dt != DT_F32;
        void *y = via32 ? (void *)rows32 : at_elem(out.data, dt, first * q->Cout);
        // out_g[pix][Coutg] = col_g[pix][K]·W_g[Coutg][K]ᵀ; column-major: out_gᵀ (Coutg×pix) = W_gᵀ-as-stored (op T)·col_gᵀ
        for (int g = 0; g < p.G; g++)
            gemm_ex(o, CUBLAS_OP_T, CUBLAS_OP_N, q->Coutg, pix, q->K, at_elem(wt, dt, (size_t)g * q->Coutg * q->K), q->K,
                    at_elem(B, dt, (size_t)g * q->K), ldb, dt, 0.0f, at_elem(y, via32 ? DT_F32 : dt, (size_t)g * q->Coutg),
                    q->Cout, via32 ? DT_F32 : dt);
        if (b) {
            const size_t n = pix * q->Cout;
            void *dst = at_elem(out.data, dt, first * q->Cout);
            CU_LAUNCH(bias_rows_kernel, grid_for(n), BLOCK, 0, stream_of(o), dst, dt,
                      via32 ? (const float *)rows32 : (const float *)dst, b, q->Cout, n);
            launchCheck();
        }
        t0 = t1;
    }
}

static void conv2d_backward_data_cuda(Ops *o, const ConvCfg *cfg, Tensor din, Tensor dout, const float *w,
                                      int accumulate, void *ws) {
    if (!din.data) return;
    ConvPlan p = conv_plan(cfg, din.shape, din.dtype);
    const ConvGeom *q = &p.q;
    conv_check_out("conv2d_backward_data (dout shape)", q, dout.shape, cfg, din.shape);
    if (p.depthwise) {
        size_t n = shape_numel(din.shape);
        CU_LAUNCH(depthwise_backward_data_kernel, grid_for(n), BLOCK, 0, stream_of(o), din.data, dout.data,
                  din.dtype, dout.dtype, w, *cfg, *q, n, accumulate);
        launchCheck();
        return;
    }
    if (dout.dtype != din.dtype) conv_fail("conv2d_backward_data (din and dout storage types differ)", cfg, din.shape);
    const DType dt = din.dtype;
    const void *wt = w;
    if (dt != DT_F32) {
        CU_LAUNCH(copy_kernel, grid_for((size_t)q->Cout * q->K), BLOCK, 0, stream_of(o), ws, dt, w, DT_F32,
                  (size_t)q->Cout * q->K, 0);
        launchCheck();
        wt = ws;
    }
    if (p.pointwise) {
        // din[M][Cin] (=|+=) dout[M][Cout]·W[Cout][Cin]; column-major: dinᵀ (Cin×M) = W-as-stored (Cin×Cout)·doutᵀ
        gemm_ex(o, CUBLAS_OP_N, CUBLAS_OP_N, q->C, (size_t)q->N * q->H * q->W, q->Cout, wt, q->C, dout.data, q->Cout,
                dt, accumulate ? 1.0f : 0.0f, din.data, q->C, dt);
        return;
    }
    float *dcol = (float *)((char *)ws + align_up(p.wcast));  // (rows·OW, G·K) fp32
    const int total = q->N * q->H;
    for (int u0 = 0; u0 < total;) {
        const int u1 = chunk_end(u0, p.bwd_rows, q->H, total);
        int t0, t1;
        bwd_band_out_rows(cfg, q, u0, u1, &t0, &t1);
        const size_t pix = (size_t)(t1 - t0) * q->OW;
        // dcol_g[pix][K] = dout_g[pix][Coutg]·W_g[Coutg][K]; column-major: dcol_gᵀ (K×pix) = W_g-as-stored (K×Coutg)·dout_gᵀ
        for (int g = 0; g < p.G && pix; g++)
            gemm_ex(o, CUBLAS_OP_N, CUBLAS_OP_N, q->K, pix, q->Coutg, at_elem(wt, dt, (size_t)g * q->Coutg * q->K), q->K,
                    at_elem(dout.data, dt, (size_t)t0 * q->OW * q->Cout + (size_t)g * q->Coutg), q->Cout, dt, 0.0f,
                    dcol + (size_t)g * q->K, p.GK, DT_F32);
        const size_t n = (size_t)(u1 - u0) * q->W * q->C;
        CU_LAUNCH(col2im_kernel, grid_for(n), BLOCK, 0, stream_of(o), din.data, dt, dcol, *cfg, *q, u0, t0, n,
                  accumulate);
        launchCheck();
        u0 = u1;
    }
}

static void conv2d_backward_weight_cuda(Ops *o, const ConvCfg *cfg, float *dw, float *db, Tensor dout, Tensor in,
                                        void *ws) {
    ConvPlan p = conv_plan(cfg, in.shape, in.dtype);
    const ConvGeom *q = &p.q;
    conv_check_out("conv2d_backward_weight (dout shape)", q, dout.shape, cfg, in.shape);
    if (db && !cfg->has_bias && !p.depthwise)
        conv_fail("conv2d_backward_weight (a bias gradient for a conv without bias)", cfg, in.shape);
    if (db) bias_grad(o, db, dout, p.parts, (float *)ws);
    if (!dw) return;
    if (p.depthwise) {
        const int taps = cfg->kh * cfg->kw;
        dim3 grid((q->C + RED_X - 1) / RED_X, p.parts, taps), block(RED_X, RED_Y);
        CU_LAUNCH(depthwise_weight_partial_kernel, grid, block, 0, stream_of(o), (float *)ws, dout.data, in.data,
                  dout.dtype, in.dtype, *cfg, *q, rows_per_part((size_t)q->N * q->P, p.parts));
        launchCheck();
        size_t n = (size_t)q->C * taps;
        CU_LAUNCH(sum_parts_kernel, grid_for(n), BLOCK, 0, stream_of(o), dw, (const float *)ws, p.parts, n);
        launchCheck();
        return;
    }
    if (dout.dtype != in.dtype) conv_fail("conv2d_backward_weight (in and dout storage types differ)", cfg, in.shape);
    const DType dt = in.dtype;
    if (p.pointwise) {
        // dW[Cout][Cin] += dout[M][Cout]ᵀ·in[M][Cin]; column-major: dWᵀ (Cin×Cout) += inᵀ (Cin×M)·dout (op T)
        gemm_ex(o, CUBLAS_OP_N, CUBLAS_OP_T, q->C, q->Cout, (size_t)q->N * q->H * q->W, in.data, q->C, dout.data,
                q->Cout, dt, 1.0f, dw, q->C, DT_F32);
        return;
    }
    void *col = ws;  // (rows·OW, G·K), after the bias gradient is done with ws
    const int total = q->N * q->OH;
    for (int t0 = 0; t0 < total;) {
        const int t1 = chunk_end(t0, p.fwd_rows, q->OH, total);
        const size_t pix = (size_t)(t1 - t0) * q->OW;
        im2col(o, col, in, cfg, q, t0, t1);
        // dW_g[Coutg][K] += dout_g[pix][Coutg]ᵀ·col_g[pix][K]; column-major: dW_gᵀ (K×Coutg) += col_gᵀ·dout_g (op T)
        for (int g = 0; g < p.G; g++)
            gemm_ex(o, CUBLAS_OP_N, CUBLAS_OP_T, q->K, q->Coutg, pix, at_elem(col, dt, (size_t)g * q->K), p.GK,
                    at_elem(dout.data, dt, (size_t)t0 * q->OW * q->Cout + (size_t)g * q->Coutg), q->Cout, dt, 1.0f,
                    dw + (size_t)g * q->Coutg * q->K, q->K, DT_F32);
        t0 = t1;
    }
}

// ----------------------------------------------------------------------------
// per-channel sums over rows: batch norm statistics and gradient sums,
// squeeze-excitation pooling and scale gradient
//
//   out[g][c][q] = Σ_{r < rows} f(element (g·rows + r, c))[q]
// for G groups of `rows` rows of C channels (batch norm: G = 1, rows = N·H·W;
// squeeze-excitation: G = N, rows = H·W) and NQ quantities at once, summed in
// fp64 in an order fixed by the shape alone (deterministic on any GPU):
//   block: SUMS_CW channels (threadIdx.x, coalesced in NHWC) × SUMS_LANES row lanes
//   grid:  (channel tiles, row chunks, G)
//   a thread sums rows r0 + lane, r0 + lane + SUMS_LANES, ... of its chunk in order,
//   the lanes are added in lane order, and the chunks' partial sums (in the
//   context's scratch) are added in chunk order by a second kernel, one thread
//   per (g, c). With one chunk the first kernel finishes the sum itself.
// The callers are functors: F(i, c, v) gives the NQ values of element i =
// (g·rows + r)·C + c in v; E(g, c, s) consumes the NQ sums.

#define SUMS_CW 32            // channels per block
#define SUMS_LANES 8          // row lanes per block
#define SUMS_MIN_ROWS 32      // rows per chunk at least (4 per lane)
#define SUMS_MAX_CHUNKS 1024  // chunks per (channel tile, group) at most: enough blocks to fill a GPU
// The scratch of partial sums, (G, chunks, NQ, C) fp64: its size bounds the chunk
// count (chunks ≤ SUMS_SCRATCH/(G·NQ·C), at least 1, which needs no scratch); it
// never limits the shapes an op accepts.
#define SUMS_SCRATCH ((size_t)1 << 20)  // doubles (8 MiB)

template <int NQ, class F, class E>
__global__ void channel_sums_kernel(F f, E e, double *partial, size_t rows, int C, size_t rows_per_chunk) {
    __shared__ double lane_sums[NQ][SUMS_LANES][SUMS_CW];
    const int c = blockIdx.x * SUMS_CW + threadIdx.x, chunk = blockIdx.y, g = blockIdx.z;
    const size_t r0 = chunk * rows_per_chunk, r1 = r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows;
    double acc[NQ];
    for (int q = 0; q < NQ; q++) acc[q] = 0.0;
    if (c < C)
        for (size_t r = r0 + threadIdx.y; r < r1; r += SUMS_LANES) {
            double v[NQ];
            f(((size_t)g * rows + r) * C + c, c, v);
            for (int q = 0; q < NQ; q++) acc[q] += v[q];
        }
    for (int q = 0; q < NQ; q++) lane_sums[q][threadIdx.y][threadIdx.x] = acc[q];
    __syncthreads();
    if (threadIdx.y != 0 || c >= C) return;
    double s[NQ];
    for (int q = 0; q < NQ; q++) {
        s[q] = 0.0;
        for (int l = 0; l < SUMS_LANES; l++) s[q] += lane_sums[q][l][threadIdx.x];
    }
    if (gridDim.y == 1) e(g, c, s);
    else
        for (int q = 0; q < NQ; q++) partial[(((size_t)g * gridDim.y + chunk) * NQ + q) * C + c] = s[q];
}

template <int NQ, class E>
__global__ void channel_sums_finish_kernel(E e, const double *partial, int G, int C, int chunks) {
    const size_t n = (size_t)G * C;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        const int g = (int)(i / C), c = (int)(i % C);
        double s[NQ];
        for (int q = 0; q < NQ; q++) {
            s[q] = 0.0;
            for (int k = 0; k < chunks; k++) s[q] += partial[(((size_t)g * chunks + k) * NQ + q) * C + c];
        }
        e(g, c, s);
    }
}

template <int NQ, class F, class E>
static void channel_sums(Ops *o, F f, E e, int G, size_t rows, int C) {
    size_t chunks = (rows + SUMS_MIN_ROWS - 1) / SUMS_MIN_ROWS;
    size_t fit = SUMS_SCRATCH / ((size_t)G * NQ * C);
    if (chunks > SUMS_MAX_CHUNKS) chunks = SUMS_MAX_CHUNKS;
    if (chunks > fit) chunks = fit;
    if (chunks < 1) chunks = 1;
    const size_t rows_per_chunk = rows ? (rows + chunks - 1) / chunks : 1;
    chunks = rows ? (rows + rows_per_chunk - 1) / rows_per_chunk : 1;  // no empty chunk
    dim3 grid((C + SUMS_CW - 1) / SUMS_CW, (unsigned)chunks, G), block(SUMS_CW, SUMS_LANES);
    double *partial = chunks > 1 ? ctx_of(o)->sums : NULL;
    CU_LAUNCH((channel_sums_kernel<NQ, F, E>), grid, block, 0, stream_of(o), f, e, partial, rows, C, rows_per_chunk);
    launchCheck();
    if (chunks == 1) return;
    CU_LAUNCH((channel_sums_finish_kernel<NQ, E>), grid_for((size_t)G * C), BLOCK, 0, stream_of(o), e, partial, G, C,
              (int)chunks);
    launchCheck();
}

// the summands: (x - mean)²; a or a·b
struct SquaredDeviation {
    const void *x; DType dt; const float *mean;
    __device__ void operator()(size_t i, int c, double *v) const {
        double d = (double)ld(x, dt, i) - mean[c];
        v[0] = d * d;
    }
};
struct SumOfProduct {  // b NULL: Σ a
    const void *a; DType dta; const void *b; DType dtb;
    __device__ void operator()(size_t i, int c, double *v) const {
        (void)c;
        v[0] = b ? (double)ld(a, dta, i) * ld(b, dtb, i) : (double)ld(a, dta, i);
    }
};
// the consumer: y (G,1,1,C) (=|+=) sum/divisor, in y's storage type
struct StoreSum {
    void *y; DType dt; int C; double divisor; int accumulate;
    __device__ void operator()(int g, int c, const double *s) const {
        size_t i = (size_t)g * C + c;
        float v = (float)(s[0] / divisor);
        st(y, dt, i, accumulate ? ld(y, dt, i) + v : v);
    }
};

// ----------------------------------------------------------------------------
// batch norm (see segnet.c for the formulas)
//   z = gamma·((x - mean)·invstd) + beta, the CPU's expression, so z falls on the
//   same side of ReLU's kink; y = act(z); backward g = dy·act'(z), z recomputed from x

// mean = Σx/M, then var = Σ(x - mean)²/M: two passes, each an fp64 sum
static void bn_stats_cuda(Ops *o, Tensor x, float *mean, float *var) {
    const int C = x.shape.c;
    const size_t M = shape_numel(x.shape) / C;
    channel_sums<1>(o, SumOfProduct{x.data, x.dtype, NULL, DT_F32}, StoreSum{mean, DT_F32, C, (double)M, 0}, 1, M, C);
    channel_sums<1>(o, SquaredDeviation{x.data, x.dtype, mean}, StoreSum{var, DT_F32, C, (double)M, 0}, 1, M, C);
}

__global__ void bn_forward_kernel(void *y, DType dty, const void *x, DType dtx, size_t n, int C, const float *mean,
                                  const float *var, const float *gamma, const float *beta, float eps, Act act) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        const int c = (int)(i % C);
        float z = gamma[c] * ((ld(x, dtx, i) - mean[c]) * bn_invstd(var, c, eps)) + beta[c];
        st(y, dty, i, act_apply(act, z));
    }
}
static void bn_forward_cuda(Ops *o, Tensor y, Tensor x, const float *mean, const float *var, const float *gamma,
                            const float *beta, float eps, Act act) {
    const size_t n = shape_numel(x.shape);
    if (!n) return;
    CU_LAUNCH(bn_forward_kernel, grid_for(n), BLOCK, 0, stream_of(o), y.data, y.dtype, x.data, x.dtype, n,
              x.shape.c, mean, var, gamma, beta, eps, act);
    launchCheck();
}

// the C running statistics, one thread each; the unbiasing factor in fp64 as on the CPU
__global__ void bn_update_running_kernel(float *run_mean, float *run_var, const float *mean, const float *var, int C,
                                         double unbias, float momentum) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += blockDim.x * gridDim.x) {
        run_mean[c] = (1.0f - momentum) * run_mean[c] + momentum * mean[c];
        run_var[c] = (1.0f - momentum) * run_var[c] + momentum * (float)(var[c] * unbias);
    }
}
static void bn_update_running_cuda(Ops *o, float *run_mean, float *run_var, const float *mean, const float *var,
                                   int C, size_t count, float momentum) {
    if (C <= 0) return;
    double unbias = count > 1 ? (double)count / (double)(count - 1) : 1.0;
    CU_LAUNCH(bn_update_running_kernel, grid_for((size_t)C), BLOCK, 0, stream_of(o), run_mean, run_var, mean, var, C,
              unbias, momentum);
    launchCheck();
}

// xhat and g = dy·act'(z) of element i (channel c)
struct BnGrad {
    const void *dy; DType dt_dy; const void *x; DType dt_x;
    const float *mean, *var, *gamma, *beta; float eps; Act act;
    __device__ void operator()(size_t i, int c, float *xhat, float *g) const {
        *xhat = (ld(x, dt_x, i) - mean[c]) * bn_invstd(var, c, eps);
        *g = ld(dy, dt_dy, i) * act_grad(act, gamma[c] * *xhat + beta[c]);
    }
};
struct BnGradTerms {  // the summands g and g·xhat
    BnGrad bg;
    __device__ void operator()(size_t i, int c, double *v) const {
        float xhat, g;
        bg(i, c, &xhat, &g);
        v[0] = g;
        v[1] = (double)g * xhat;
    }
};
struct BnGradSums {  // sum_g, sum_gx overwritten; dbeta, dgamma added into
    float *sum_g, *sum_gx, *dgamma, *dbeta;
    __device__ void operator()(int g, int c, const double *s) const {
        (void)g;
        if (sum_g) sum_g[c] = (float)s[0];
        if (sum_gx) sum_gx[c] = (float)s[1];
        if (dbeta) dbeta[c] += (float)s[0];
        if (dgamma) dgamma[c] += (float)s[1];
    }
};
static void bn_backward_reduce_cuda(Ops *o, Tensor dy, Tensor x, const float *mean, const float *var,
                                    const float *gamma, const float *beta, float eps, Act act, float *sum_g,
                                    float *sum_gx, float *dgamma, float *dbeta) {
    const int C = x.shape.c;
    BnGrad bg = {dy.data, dy.dtype, x.data, x.dtype, mean, var, gamma, beta, eps, act};
    channel_sums<2>(o, BnGradTerms{bg}, BnGradSums{sum_g, sum_gx, dgamma, dbeta}, 1, shape_numel(x.shape) / C, C);
}

// dx (=|+=) gamma·invstd·(g - (sum_g + xhat·sum_gx)/count); count 0: gamma·invstd·g
__global__ void bn_backward_data_kernel(void *dx, DType dt_dx, BnGrad bg, size_t n, int C, const float *sum_g,
                                        const float *sum_gx, size_t count, int accumulate) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        const int c = (int)(i % C);
        float xhat, g;
        bg(i, c, &xhat, &g);
        if (count) g -= (sum_g[c] + xhat * sum_gx[c]) / (float)count;
        float d = bg.gamma[c] * bn_invstd(bg.var, c, bg.eps) * g;
        st(dx, dt_dx, i, accumulate ? ld(dx, dt_dx, i) + d : d);
    }
}
static void bn_backward_data_cuda(Ops *o, Tensor dx, Tensor dy, Tensor x, const float *mean, const float *var,
                                  const float *gamma, const float *beta, float eps, Act act, const float *sum_g,
                                  const float *sum_gx, size_t count, int accumulate) {
    const size_t n = shape_numel(x.shape);
    if (!n || !dx.data) return;
    BnGrad bg = {dy.data, dy.dtype, x.data, x.dtype, mean, var, gamma, beta, eps, act};
    CU_LAUNCH(bn_backward_data_kernel, grid_for(n), BLOCK, 0, stream_of(o), dx.data, dx.dtype, bg, n, x.shape.c,
              sum_g, sum_gx, count, accumulate);
    launchCheck();
}

// ----------------------------------------------------------------------------
// activations: y = act(x), dx (=|+=) dy·act'(x)

__global__ void act_forward_kernel(Act act, void *y, DType dty, const void *x, DType dtx, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x)
        st(y, dty, i, act_apply(act, ld(x, dtx, i)));
}
static void act_forward_cuda(Ops *o, Act act, Tensor y, Tensor x) {
    const size_t n = shape_numel(x.shape);
    if (!n) return;
    CU_LAUNCH(act_forward_kernel, grid_for(n), BLOCK, 0, stream_of(o), act, y.data, y.dtype, x.data, x.dtype, n);
    launchCheck();
}

__global__ void act_backward_kernel(Act act, void *dx, DType dtdx, const void *dy, DType dtdy, const void *x,
                                    DType dtx, size_t n, int accumulate) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        float d = ld(dy, dtdy, i) * act_grad(act, ld(x, dtx, i));
        st(dx, dtdx, i, accumulate ? ld(dx, dtdx, i) + d : d);
    }
}
static void act_backward_cuda(Ops *o, Act act, Tensor dx, Tensor dy, Tensor x, int accumulate) {
    const size_t n = shape_numel(x.shape);
    if (!n || !dx.data) return;
    CU_LAUNCH(act_backward_kernel, grid_for(n), BLOCK, 0, stream_of(o), act, dx.data, dx.dtype, dy.data, dy.dtype,
              x.data, x.dtype, n, accumulate);
    launchCheck();
}

// ----------------------------------------------------------------------------
// squeeze-excitation pieces, x (N,H,W,C), pooled and s (N,1,1,C)
//   pool:  y[n,c] = Σ_{h,w} x[n,h,w,c] / (H·W);      dx[n,h,w,c] = dy[n,c] / (H·W)
//   scale: y[n,h,w,c] = x[n,h,w,c]·s[n,c];           dx = dy·s,  ds[n,c] = Σ_{h,w} dy·x

static void global_avg_pool_forward_cuda(Ops *o, Tensor y, Tensor x) {
    const int N = x.shape.n, C = x.shape.c;
    const size_t HW = (size_t)x.shape.h * x.shape.w;
    if (!N || !C) return;
    channel_sums<1>(o, SumOfProduct{x.data, x.dtype, NULL, DT_F32}, StoreSum{y.data, y.dtype, C, (double)HW, 0}, N,
                    HW, C);
}

// dst[i] (=|+=) b[i]·src[n,c], or src[n,c]·a where b is NULL, for the element
// i = ((n·H + h)·W + w)·C + c of dst (N,H,W,C), b likewise; src (N,1,1,C)
__global__ void per_image_channel_kernel(void *dst, DType dt_dst, const void *src, DType dt_src, const void *b,
                                         DType dt_b, float a, size_t n, size_t HWC, int C, int accumulate) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        float s = ld(src, dt_src, i / HWC * C + i % C);
        float v = b ? ld(b, dt_b, i) * s : s * a;
        st(dst, dt_dst, i, accumulate ? ld(dst, dt_dst, i) + v : v);
    }
}
static void per_image_channel(Ops *o, Tensor dst, Tensor src, const void *b, DType dt_b, float a,
                              int accumulate) {
    const size_t n = shape_numel(dst.shape), HWC = (size_t)dst.shape.h * dst.shape.w * dst.shape.c;
    if (!n) return;
    CU_LAUNCH(per_image_channel_kernel, grid_for(n), BLOCK, 0, stream_of(o), dst.data, dst.dtype, src.data, src.dtype,
              b, dt_b, a, n, HWC, dst.shape.c, accumulate);
    launchCheck();
}

static void global_avg_pool_backward_cuda(Ops *o, Tensor dx, Tensor dy, int accumulate) {
    if (!dx.data) return;
    per_image_channel(o, dx, dy, NULL, DT_F32, 1.0f / (float)((size_t)dx.shape.h * dx.shape.w), accumulate);
}

static void channel_scale_forward_cuda(Ops *o, Tensor y, Tensor x, Tensor s) {
    per_image_channel(o, y, s, x.data, x.dtype, 1.0f, 0);
}

static void channel_scale_backward_cuda(Ops *o, Tensor dx, Tensor ds, Tensor dy, Tensor x, Tensor s,
                                        int accumulate_dx, int accumulate_ds) {
    if (dx.data) per_image_channel(o, dx, s, dy.data, dy.dtype, 1.0f, accumulate_dx);
    const int N = x.shape.n, C = x.shape.c;
    if (!ds.data || !N || !C) return;
    channel_sums<1>(o, SumOfProduct{dy.data, dy.dtype, x.data, x.dtype},
                    StoreSum{ds.data, ds.dtype, C, 1.0, accumulate_ds}, N, (size_t)x.shape.h * x.shape.w, C);
}

// ----------------------------------------------------------------------------
// residual add and channel concat

__global__ void add_kernel(void *y, DType dty, const void *a, DType dta, const void *b, DType dtb, size_t n) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x)
        st(y, dty, i, ld(a, dta, i) + ld(b, dtb, i));
}
static void add_forward_cuda(Ops *o, Tensor y, Tensor a, Tensor b) {
    const size_t n = shape_numel(y.shape);
    if (!n) return;
    CU_LAUNCH(add_kernel, grid_for(n), BLOCK, 0, stream_of(o), y.data, y.dtype, a.data, a.dtype, b.data, b.dtype, n);
    launchCheck();
}

// y[r, 0:Ca] = a[r, :], y[r, Ca:Ca+Cb] = b[r, :] for every pixel r; one thread per element of y
__global__ void concat_forward_kernel(void *y, DType dty, const void *a, DType dta, int Ca, const void *b, DType dtb,
                                      int Cb, size_t n) {
    const int C = Ca + Cb;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        const size_t r = i / C;
        const int c = (int)(i % C);
        st(y, dty, i, c < Ca ? ld(a, dta, r * Ca + c) : ld(b, dtb, r * Cb + c - Ca));
    }
}
static void concat_forward_cuda(Ops *o, Tensor y, Tensor a, Tensor b) {
    const size_t n = shape_numel(y.shape);
    if (!n) return;
    CU_LAUNCH(concat_forward_kernel, grid_for(n), BLOCK, 0, stream_of(o), y.data, y.dtype, a.data, a.dtype, a.shape.c,
              b.data, b.dtype, b.shape.c, n);
    launchCheck();
}

// the adjoint: one thread per element of dy, into da or db (NULL: not wanted)
__global__ void concat_backward_kernel(void *da, DType dta, int Ca, int acc_a, void *db, DType dtb, int Cb, int acc_b,
                                       const void *dy, DType dtdy, size_t n) {
    const int C = Ca + Cb;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        const size_t r = i / C;
        const int c = (int)(i % C);
        const float g = ld(dy, dtdy, i);
        if (c < Ca && da) {
            const size_t j = r * Ca + c;
            st(da, dta, j, acc_a ? ld(da, dta, j) + g : g);
        } else if (c >= Ca && db) {
            const size_t j = r * Cb + c - Ca;
            st(db, dtb, j, acc_b ? ld(db, dtb, j) + g : g);
        }
    }
}
static void concat_backward_cuda(Ops *o, Tensor da, Tensor db, Tensor dy, int accumulate_a, int accumulate_b) {
    const size_t n = shape_numel(dy.shape);
    if (!n || (!da.data && !db.data)) return;
    CU_LAUNCH(concat_backward_kernel, grid_for(n), BLOCK, 0, stream_of(o), da.data, da.dtype, da.shape.c, accumulate_a,
              db.data, db.dtype, db.shape.c, accumulate_b, dy.data, dy.dtype, n);
    launchCheck();
}

// ----------------------------------------------------------------------------
// dropout and drop-path
//   keep_i = rng_uniform(seed, i / per_draw) >= rate, per_draw 1 (dropout: the
//   element index) or H·W·C (drop-path: the sample index), as on the CPU, so the
//   masks are the same bits; out (=|+=) in·keep/(1 - rate)

__global__ void dropout_kernel(void *out, DType dt_out, const void *in, DType dt_in, size_t n, size_t per_draw,
                               float rate, uint64_t seed, uint64_t first, int accumulate) {
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)blockDim.x * gridDim.x) {
        float v = ld(in, dt_in, i) * dropout_factor(rate, seed, first + i, per_draw);
        st(out, dt_out, i, accumulate ? ld(out, dt_out, i) + v : v);
    }
}
// element i of the tensor is element first_sample·E + i of the step (E = H·W·C)
static void dropout(Ops *o, Tensor out, Tensor in, float rate, uint64_t seed, int per_sample, uint64_t first_sample,
                    int accumulate) {
    const size_t n = shape_numel(in.shape);
    if (!n || !out.data) return;
    const size_t E = n / in.shape.n, per_draw = per_sample ? E : 1;
    CU_LAUNCH(dropout_kernel, grid_for(n), BLOCK, 0, stream_of(o), out.data, out.dtype, in.data, in.dtype, n, per_draw,
              rate, seed, (uint64_t)(first_sample * E), accumulate);
    launchCheck();
}
static void dropout_forward_cuda(Ops *o, Tensor y, Tensor x, float rate, uint64_t seed, int per_sample,
                                 uint64_t first_sample) {
    dropout(o, y, x, rate, seed, per_sample, first_sample, 0);
}
static void dropout_backward_cuda(Ops *o, Tensor dx, Tensor dy, float rate, uint64_t seed, int per_sample,
                                  uint64_t first_sample, int accumulate) {
    dropout(o, dx, dy, rate, seed, per_sample, first_sample, accumulate);
}

// ----------------------------------------------------------------------------
// pooling and resampling; one thread per output element (backward: per element
// of dx, gathering), so nothing is written twice and no atomics are needed

// element (n, y, x, c) of a tensor of shape s
static __device__ __forceinline__ size_t nhwc_at(Shape s, int n, int y, int x, int c) {
    return (((size_t)n * s.h + y) * s.w + x) * s.c + c;
}
// split an element index of shape s into (n, y, x, c)
static __device__ __forceinline__ void nhwc_coords(Shape s, size_t i, int *n, int *y, int *x, int *c) {
    *c = (int)(i % s.c);
    i /= s.c;
    *x = (int)(i % s.w);
    i /= s.w;
    *y = (int)(i % s.h);
    *n = (int)(i / s.h);
}
// which of the 2×2 window (row-major k = 0..3) at output (oy, ox) holds its first maximum
static __device__ __forceinline__ int window_first_max(const void *x, DType dt, Shape s, int n, int oy, int ox, int c,
                                                       float *max_value) {
    int first = 0;
    float m = -INFINITY;
    for (int k = 0; k < 4; k++) {
        float v = ld(x, dt, nhwc_at(s, n, 2 * oy + k / 2, 2 * ox + k % 2, c));
        if (v > m) { m = v; first = k; }
    }
    *max_value = m;
    return first;
}

// y[n,oy,ox,c] = max_{dy,dx ∈ {0,1}} x[n, 2·oy + dy, 2·ox + dx, c]
__global__ void maxpool2_forward_kernel(void *y, DType dty, Shape t, const void *x, DType dtx, Shape s) {
    const size_t n_out = shape_numel(t);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_out; i += (size_t)blockDim.x * gridDim.x) {
        int n, oy, ox, c;
        float m;
        nhwc_coords(t, i, &n, &oy, &ox, &c);
        window_first_max(x, dtx, s, n, oy, ox, c, &m);
        st(y, dty, i, m);
    }
}
static void maxpool2_forward_cuda(Ops *o, Tensor y, Tensor x) {
    const size_t n = shape_numel(y.shape);
    if (!n) return;
    CU_LAUNCH(maxpool2_forward_kernel, grid_for(n), BLOCK, 0, stream_of(o), y.data, y.dtype, y.shape, x.data, x.dtype,
              x.shape);
    launchCheck();
}

// dx gets dy of its window where it is the window's first maximum, else 0 (also
// in the row/column past the floor)
__global__ void maxpool2_backward_kernel(void *dx, DType dtdx, const void *dy, DType dtdy, Shape t, const void *x,
                                         DType dtx, Shape s, int accumulate) {
    const size_t n_in = shape_numel(s);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_in; i += (size_t)blockDim.x * gridDim.x) {
        int n, iy, ix, c;
        nhwc_coords(s, i, &n, &iy, &ix, &c);
        const int oy = iy / 2, ox = ix / 2;
        float g = 0.0f, m;
        if (oy < t.h && ox < t.w && window_first_max(x, dtx, s, n, oy, ox, c, &m) == (iy - 2 * oy) * 2 + (ix - 2 * ox))
            g = ld(dy, dtdy, nhwc_at(t, n, oy, ox, c));
        st(dx, dtdx, i, accumulate ? ld(dx, dtdx, i) + g : g);
    }
}
static void maxpool2_backward_cuda(Ops *o, Tensor dx, Tensor dy, Tensor x, int accumulate) {
    const size_t n = shape_numel(x.shape);
    if (!n || !dx.data) return;
    CU_LAUNCH(maxpool2_backward_kernel, grid_for(n), BLOCK, 0, stream_of(o), dx.data, dx.dtype, dy.data, dy.dtype,
              dy.shape, x.data, x.dtype, x.shape, accumulate);
    launchCheck();
}

// y[n,oy,ox,c] = x[n, oy/2, ox/2, c]
__global__ void upsample2_forward_kernel(void *y, DType dty, Shape t, const void *x, DType dtx, Shape s) {
    const size_t n_out = shape_numel(t);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_out; i += (size_t)blockDim.x * gridDim.x) {
        int n, oy, ox, c;
        nhwc_coords(t, i, &n, &oy, &ox, &c);
        st(y, dty, i, ld(x, dtx, nhwc_at(s, n, oy / 2, ox / 2, c)));
    }
}
static void upsample2_forward_cuda(Ops *o, Tensor y, Tensor x) {
    const size_t n = shape_numel(y.shape);
    if (!n) return;
    CU_LAUNCH(upsample2_forward_kernel, grid_for(n), BLOCK, 0, stream_of(o), y.data, y.dtype, y.shape, x.data, x.dtype,
              x.shape);
    launchCheck();
}

// dx[n,iy,ix,c] = Σ of the 2×2 dy it was copied to, in row-major order
__global__ void upsample2_backward_kernel(void *dx, DType dtdx, Shape s, const void *dy, DType dtdy, Shape t,
                                          int accumulate) {
    const size_t n_in = shape_numel(s);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_in; i += (size_t)blockDim.x * gridDim.x) {
        int n, iy, ix, c;
        nhwc_coords(s, i, &n, &iy, &ix, &c);
        float g = 0.0f;
        for (int k = 0; k < 4; k++) g += ld(dy, dtdy, nhwc_at(t, n, 2 * iy + k / 2, 2 * ix + k % 2, c));
        st(dx, dtdx, i, accumulate ? ld(dx, dtdx, i) + g : g);
    }
}
static void upsample2_backward_cuda(Ops *o, Tensor dx, Tensor dy, int accumulate) {
    const size_t n = shape_numel(dx.shape);
    if (!n || !dx.data) return;
    CU_LAUNCH(upsample2_backward_kernel, grid_for(n), BLOCK, 0, stream_of(o), dx.data, dx.dtype, dx.shape, dy.data,
              dy.dtype, dy.shape, accumulate);
    launchCheck();
}

// bilinear with half-pixel centres (the taps of segnet.h):
//   y = (1-λy)·((1-λx)·x00 + λx·x01) + λy·((1-λx)·x10 + λx·x11)
__global__ void resize_bilinear_forward_kernel(void *y, DType dty, Shape t, const void *x, DType dtx, Shape s) {
    const size_t n_out = shape_numel(t);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_out; i += (size_t)blockDim.x * gridDim.x) {
        int n, oy, ox, c;
        nhwc_coords(t, i, &n, &oy, &ox, &c);
        const BilinearTap ty = bilinear_tap(oy, s.h, t.h), tx = bilinear_tap(ox, s.w, t.w);
        const float x00 = ld(x, dtx, nhwc_at(s, n, ty.i0, tx.i0, c)), x01 = ld(x, dtx, nhwc_at(s, n, ty.i0, tx.i1, c));
        const float x10 = ld(x, dtx, nhwc_at(s, n, ty.i1, tx.i0, c)), x11 = ld(x, dtx, nhwc_at(s, n, ty.i1, tx.i1, c));
        float top = (1.0f - tx.l) * x00 + tx.l * x01;
        float bot = (1.0f - tx.l) * x10 + tx.l * x11;
        st(y, dty, i, (1.0f - ty.l) * top + ty.l * bot);
    }
}
static void resize_bilinear_forward_cuda(Ops *o, Tensor y, Tensor x) {
    const size_t n = shape_numel(y.shape);
    if (!n) return;
    CU_LAUNCH(resize_bilinear_forward_kernel, grid_for(n), BLOCK, 0, stream_of(o), y.data, y.dtype, y.shape, x.data,
              x.dtype, x.shape);
    launchCheck();
}

// The adjoint as a gather, as on the CPU (same outputs, same order):
//   dx[n,iy,ix,c] (=|+=) Σ_{oy,ox} wy(oy,iy)·wx(ox,ix)·dy[n,oy,ox,c]
__global__ void resize_bilinear_backward_kernel(void *dx, DType dtdx, Shape s, const void *dy, DType dtdy, Shape t,
                                                int accumulate) {
    const size_t n_in = shape_numel(s);
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n_in; i += (size_t)blockDim.x * gridDim.x) {
        int n, iy, ix, c, oy0, oy1, ox0, ox1;
        nhwc_coords(s, i, &n, &iy, &ix, &c);
        tap_range(iy, s.h, t.h, &oy0, &oy1);
        tap_range(ix, s.w, t.w, &ox0, &ox1);
        float g = 0.0f;
        for (int oy = oy0; oy <= oy1; oy++) {
            float wy = tap_weight(bilinear_tap(oy, s.h, t.h), iy);
            if (wy == 0.0f) continue;
            for (int ox = ox0; ox <= ox1; ox++) {
                float wx = tap_weight(bilinear_tap(ox, s.w, t.w), ix);
                if (wx != 0.0f) g += wy * wx * ld(dy, dtdy, nhwc_at(t, n, oy, ox, c));
            }
        }
        st(dx, dtdx, i, accumulate ? ld(dx, dtdx, i) + g : g);
    }
}
static void resize_bilinear_backward_cuda(Ops *o, Tensor dx, Tensor dy, int accumulate) {
    const size_t n = shape_numel(dx.shape);
    if (!n || !dx.data) return;
    CU_LAUNCH(resize_bilinear_backward_kernel, grid_for(n), BLOCK, 0, stream_of(o), dx.data, dx.dtype, dx.shape,
              dy.data, dy.dtype, dy.shape, accumulate);
    launchCheck();
}

// ----------------------------------------------------------------------------
// the CUDA ops table (cuda_ops_complete checks that no entry is left NULL;
// ops_for_device refuses a table with NULL entries)

static Ops make_ops_cuda(void) {
    Ops o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.alloc = cuda_alloc;
    o.free = cuda_free;
    o.upload = cuda_upload;
    o.download = cuda_download;
    o.synchronize = cuda_synchronize;
    o.fill = fill_cuda;
    o.copy = copy_cuda;
    o.conv2d_workspace = conv2d_workspace_cuda;
    o.conv2d_forward = conv2d_forward_cuda;
    o.conv2d_backward_data = conv2d_backward_data_cuda;
    o.conv2d_backward_weight = conv2d_backward_weight_cuda;
    o.scale = scale_cuda;
    o.axpby = axpby_cuda;
    o.sum_squares = sum_squares_cuda;
    o.nonfinite = nonfinite_cuda;
    o.softmax_xent = softmax_xent_cuda;
    o.confusion_accumulate = confusion_accumulate_cuda;
    o.adam_update = adam_update_cuda;
    o.bn_stats = bn_stats_cuda;
    o.bn_forward = bn_forward_cuda;
    o.bn_update_running = bn_update_running_cuda;
    o.bn_backward_reduce = bn_backward_reduce_cuda;
    o.bn_backward_data = bn_backward_data_cuda;
    o.act_forward = act_forward_cuda;
    o.act_backward = act_backward_cuda;
    o.global_avg_pool_forward = global_avg_pool_forward_cuda;
    o.global_avg_pool_backward = global_avg_pool_backward_cuda;
    o.channel_scale_forward = channel_scale_forward_cuda;
    o.channel_scale_backward = channel_scale_backward_cuda;
    o.add_forward = add_forward_cuda;
    o.concat_forward = concat_forward_cuda;
    o.concat_backward = concat_backward_cuda;
    o.dropout_forward = dropout_forward_cuda;
    o.dropout_backward = dropout_backward_cuda;
    o.maxpool2_forward = maxpool2_forward_cuda;
    o.maxpool2_backward = maxpool2_backward_cuda;
    o.upsample2_forward = upsample2_forward_cuda;
    o.upsample2_backward = upsample2_backward_cuda;
    o.resize_bilinear_forward = resize_bilinear_forward_cuda;
    o.resize_bilinear_backward = resize_bilinear_backward_cuda;
    return o;
}
Ops ops_cuda = make_ops_cuda();  // declared extern "C" in segnet.h

// ----------------------------------------------------------------------------
// devices: one table per device, each with its own CudaCtx

#define CUDA_MAX_DEVICES SN_MAX_REPLICAS

static CudaCtx cuda_ctxs[CUDA_MAX_DEVICES];
static Ops cuda_tables[CUDA_MAX_DEVICES];  // [0] unused: device 0's table is ops_cuda
static std::mutex cuda_open_mutex;

// cuBLAS's workspace, ours so that the plan counts it: the size cuBLAS's
// documentation recommends for Hopper (4 MiB before it); without
// cublasSetWorkspace the library would allocate one of its own, unseen.
#define CUBLAS_WORKSPACE_BYTES ((size_t)32 << 20)
// a device context's own allocations (the reductions' scratch, cuBLAS's workspace)
#define CUDA_CONTEXT_BYTES \
    (sizeof(double) * REDUCE_BLOCKS_MAX * REDUCE_WIDTH + SUMS_SCRATCH * sizeof(double) + CUBLAS_WORKSPACE_BYTES)
// What the driver holds for the process on the device beyond any cudaMalloc:
// the context, the loaded kernels of segnet and cuBLAS (lazy loading, CUDA
// 12+), local memory and printf buffers. Not measurable before the device is
// opened, so the plan counts an estimate: processes holding a context and a
// cuBLAS handle show about 0.4-0.5 GiB in nvidia-smi on Hopper; `segnet info`
// measures it on the machine at hand (device memory in use minus segnet's).
#define CUDA_DRIVER_BYTES_ESTIMATE ((size_t)512 << 20)

// Makes ctx device `device`'s: its streams, events, cuBLAS handle and scratch.

static int ctx_open(CudaCtx *ctx, int device, char *err) {
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        snprintf(err, SN_ERR_MAX, "no usable CUDA driver (%s)", cudaGetErrorString(e));
        cudaGetLastError();
        return -1;
    }
    if (device < 0 || device >= count || device >= CUDA_MAX_DEVICES) {
        snprintf(err, SN_ERR_MAX, "no CUDA device %d (found %d)", device, count);
        return -1;
    }
    if ((e = cudaSetDevice(device)) != cudaSuccess) {
        snprintf(err, SN_ERR_MAX, "CUDA device %d: %s", device, cudaGetErrorString(e));
        cudaGetLastError();
        return -1;
    }
    ctx->device = device;
    cudaCheck(cudaStreamCreate(&ctx->stream));
    cudaCheck(cudaStreamCreate(&ctx->comm_stream));
    cudaCheck(cudaEventCreateWithFlags(&ctx->compute_done, cudaEventDisableTiming));
    cudaCheck(cudaEventCreateWithFlags(&ctx->comm_done, cudaEventDisableTiming));
    cublasCheck(cublasCreate(&ctx->blas));
    cublasCheck(cublasSetStream(ctx->blas, ctx->stream));
    const char *sync = getenv("SEGNET_CUDA_SYNC");
    ctx->sync_each = sync && *sync && strcmp(sync, "0");
    cudaCheck(cudaMalloc((void **)&ctx->reduce_partials, sizeof(double) * REDUCE_BLOCKS_MAX * REDUCE_WIDTH));
    if ((e = cudaMalloc(&ctx->sums, SUMS_SCRATCH * sizeof(double))) != cudaSuccess ||
        (e = cudaMalloc(&ctx->blas_workspace, CUBLAS_WORKSPACE_BYTES)) != cudaSuccess) {
        snprintf(err, SN_ERR_MAX, "CUDA device %d: cannot allocate %zu bytes of scratch (%s)", device,
                 CUDA_CONTEXT_BYTES, cudaGetErrorString(e));
        cudaGetLastError();
        return -1;
    }
    cublasCheck(cublasSetWorkspace(ctx->blas, ctx->blas_workspace, CUBLAS_WORKSPACE_BYTES));
    // counted with what the tables' alloc hands out: peak_device_bytes and the plan include it
    std::lock_guard<std::mutex> lock(cuda_alloc_mutex);
    cuda_bytes_live += CUDA_CONTEXT_BYTES;
    if (cuda_bytes_live > cuda_bytes_peak) cuda_bytes_peak = cuda_bytes_live;
    return 0;
}

// Device `device`'s table, opened on first use. A machine without a driver or
// a device is an ordinary situation (the caller falls back to the CPU or says
// so), so it is a message.
Ops *cuda_ops_for_device(int device, char *err) {
    std::lock_guard<std::mutex> lock(cuda_open_mutex);
    if (device < 0 || device >= CUDA_MAX_DEVICES) {
        snprintf(err, SN_ERR_MAX, "no CUDA device %d (at most %d are used)", device, CUDA_MAX_DEVICES);
        return NULL;
    }
    Ops *o = device == 0 ? &ops_cuda : &cuda_tables[device];
    if (o->ctx) return o;
    if (ctx_open(&cuda_ctxs[device], device, err)) return NULL;
    if (device > 0) *o = ops_cuda;  // the same entries, another context
    o->ctx = &cuda_ctxs[device];
    o->context_bytes = CUDA_CONTEXT_BYTES;
    o->driver_bytes = CUDA_DRIVER_BYTES_ESTIMATE;
    return o;
}

int cuda_backend_open(int device, char *err) { return cuda_ops_for_device(device, err) ? 0 : -1; }

int cuda_memory_info(int device, size_t *free_bytes, size_t *total_bytes, char *err) {
    Ops *o = cuda_ops_for_device(device, err);
    if (!o) return -1;
    ctx_of(o);
    cudaCheck(cudaMemGetInfo(free_bytes, total_bytes));
    return 0;
}

// ----------------------------------------------------------------------------
// NCCL communicators: the Comm interface of segnet.h over device buffers
//
// Local replicas (--replicas N --device cuda): replica r on device r, the
// communicators from ncclCommInitAll (like MirroredStrategy). The replicas are
// threads taking turns (comm_local_run), so no rank may block in NCCL waiting
// for another: every collective is a rendezvous of the host communicator
// (comm_local_gather), and the last rank to arrive enqueues the collective of
// every rank in one ncclGroupStart/End, as one thread driving N devices.
// Under mpirun (one process per rank): rank 0 makes the NCCL id, the host
// communicator (MPI) broadcasts it, every rank joins with ncclCommInitRank on
// device local_rank (its index on its machine) and enqueues its own call.
//
// Order of the sums. A collective returns once it is enqueued; it runs on the
// device's comm_stream after the work enqueued on its compute stream before it,
// and the work enqueued after it waits for it (events), so the trainer needs no
// host synchronisation for it. NCCL (ring or tree) adds the ranks in an order
// fixed by the topology, the rank count and the message size, not in rank
// order; every rank receives the same bits (each chunk is reduced once and then
// copied to every rank), so the replicas stay mirrored bit for bit, and a run is
// repeatable on the same machine with the same NCCL (NCCL_ALGO/NCCL_PROTO pin
// the choice). Results differ from the CPU replicas' rank-order sums by the
// fp32 rounding of another order: the tests compare with tolerances made of
// that noise (test_segnet.c, cuda_replicas_*). The emulator (cuda_emu.cpp)
// sums in rank order, as the CPU replicas do.
//
// Overlap, honestly: today nothing overlaps. The gradient all-reduce is one
// call over the whole gradient buffer after the backward pass has finished,
// and the next op on the compute stream (the inf check or Adam) waits for it.
// The second stream and the events are the plumbing for overlap: with buckets
// (runs of layers whose gradients are final once the backward passes them, in
// reverse layer order), net_backward would call the all-reduce per bucket as it
// goes, each waiting only on the compute work before it, so NCCL would run
// while the backward computes the earlier layers; that needs a hook in
// net_backward, buckets in the gradient layout, and the rendezvous of local
// replicas to stop serialising the ranks' host threads.

#ifdef SEGNET_NCCL
#include <nccl.h>

static void nccl_check(ncclResult_t r, const char *what, const char *file, int line) {
    if (r == ncclSuccess) return;
    fprintf(stderr, "segnet: NCCL error at %s:%d: %s: %s\n", file, line, what, ncclGetErrorString(r));
    exit(1);
}
#define ncclCheck(call) nccl_check((call), #call, __FILE__, __LINE__)
// a broken invariant of the host code (a bug)
static void internal_check(bool ok, const char *what, const char *file, int line) {
    if (ok) return;
    fprintf(stderr, "segnet: internal error at %s:%d: %s\n", file, line, what);
    exit(1);
}
#define internalCheck(cond) internal_check((cond), #cond, __FILE__, __LINE__)

typedef enum { NCCL_SUM_F32, NCCL_SUM_F64, NCCL_SUM_I64, NCCL_BROADCAST } NcclKind;

struct NcclGroup;
struct NcclRank {
    Ops *o;             // this rank's device table: its streams
    ncclComm_t nccl;
    Comm *host;         // the same rank's host communicator: rendezvous, failures
    NcclGroup *group;
};
struct NcclGroup {      // the ranks this process drives: all of them (local), or one (mpi)
    int n;
    NcclRank ranks[SN_MAX_REPLICAS];
};

// collective `kind` over bufs[i] (count elements) of ranks[0..n): enqueued on
// every rank's comm_stream, ordered against its compute stream by events
static void nccl_enqueue(NcclRank *ranks, void *const *bufs, int n, size_t count, NcclKind kind, int root) {
    for (int i = 0; i < n; i++) {  // the collective waits for the compute work before it
        CudaCtx *x = ctx_of(ranks[i].o);
        cudaCheck(cudaEventRecord(x->compute_done, x->stream));
        cudaCheck(cudaStreamWaitEvent(x->comm_stream, x->compute_done, 0));
    }
    ncclCheck(ncclGroupStart());
    for (int i = 0; i < n; i++) {
        CudaCtx *x = ctx_of(ranks[i].o);
        if (kind == NCCL_BROADCAST) {
            ncclCheck(ncclBroadcast(bufs[i], bufs[i], count, ncclInt8, root, ranks[i].nccl, x->comm_stream));
        } else {
            ncclDataType_t type = kind == NCCL_SUM_F32 ? ncclFloat32 : kind == NCCL_SUM_F64 ? ncclFloat64 : ncclInt64;
            ncclCheck(ncclAllReduce(bufs[i], bufs[i], count, type, ncclSum, ranks[i].nccl, x->comm_stream));
        }
    }
    ncclCheck(ncclGroupEnd());
    for (int i = 0; i < n; i++) {  // the compute work after it waits for the collective
        CudaCtx *x = ctx_of(ranks[i].o);
        cudaCheck(cudaEventRecord(x->comm_done, x->comm_stream));
        cudaCheck(cudaStreamWaitEvent(x->stream, x->comm_done, 0));
    }
}

struct NcclCall { NcclGroup *group; NcclKind kind; int root; };

// comm_local_gather's combine: the last local rank to arrive enqueues every rank's part
static void nccl_combine(void *const *bufs, int size, size_t count, void *arg) {
    NcclCall *call = (NcclCall *)arg;
    internalCheck(size == call->group->n);  // every local rank is in the group
    nccl_enqueue(call->group->ranks, bufs, size, count, call->kind, call->root);
}

static int nccl_collective(Comm *c, void *buf, size_t count, NcclKind kind, int root) {
    NcclRank *k = (NcclRank *)c->ctx;
    if (c->size == 1 || count == 0) return 0;
    if (k->host->failed_rank(k->host) >= 0) return -1;
    NcclCall call = {k->group, kind, root};
    if (k->group->n > 1) return comm_local_gather(k->host, buf, count, nccl_combine, &call);
    nccl_enqueue(k, &buf, 1, count, kind, root);
    return 0;
}
static int nccl_allreduce_f32(Comm *c, float *buf, size_t n) { return nccl_collective(c, buf, n, NCCL_SUM_F32, 0); }
static int nccl_allreduce_f64(Comm *c, double *buf, size_t n) { return nccl_collective(c, buf, n, NCCL_SUM_F64, 0); }
static int nccl_allreduce_i64(Comm *c, int64_t *buf, size_t n) { return nccl_collective(c, buf, n, NCCL_SUM_I64, 0); }
static int nccl_broadcast(Comm *c, void *buf, size_t bytes, int root) { return nccl_collective(c, buf, bytes, NCCL_BROADCAST, root); }
// a rank that cannot go on stops the others through the host communicator
static void nccl_abort(Comm *c, const char *why) { NcclRank *k = (NcclRank *)c->ctx; k->host->abort(k->host, why); }
static int nccl_failed_rank(Comm *c) { NcclRank *k = (NcclRank *)c->ctx; return k->host->failed_rank(k->host); }

// dcomms[r] over the host communicator hosts[r], whose `device` it becomes
static void nccl_comm_bind(Comm *dcomm, Comm *host, NcclGroup *g, int i) {
    *dcomm = (Comm){"nccl", host->rank, host->size, &g->ranks[i], nccl_allreduce_f32, nccl_allreduce_f64,
                    nccl_allreduce_i64, nccl_broadcast, nccl_abort, nccl_failed_rank, host->local_rank, NULL};
    g->ranks[i].host = host;
    g->ranks[i].group = g;
    host->device = dcomm;
}

int cuda_comm_local_create(Comm *dcomms, Comm *hosts, int n, char err[SN_ERR_MAX]) {
    int devices[SN_MAX_REPLICAS] = {0};
    NcclGroup *g = (NcclGroup *)calloc(1, sizeof *g);
    internalCheck(g != NULL);  // out of host memory
    g->n = n;
    for (int r = 0; r < n; r++) {
        char why[SN_ERR_MAX];
        if (!(g->ranks[r].o = cuda_ops_for_device(r, why))) {
            snprintf(err, SN_ERR_MAX, "%d replicas need one CUDA device each: %.400s", n, why);
            free(g);
            return -1;
        }
        devices[r] = r;
    }
    ncclComm_t comms[SN_MAX_REPLICAS];
    ncclCheck(ncclCommInitAll(comms, n, devices));
    for (int r = 0; r < n; r++) {
        g->ranks[r].nccl = comms[r];
        nccl_comm_bind(&dcomms[r], &hosts[r], g, r);
    }
    return 0;
}

int cuda_comm_mpi_create(Comm *dcomm, Comm *host, char err[SN_ERR_MAX]) {
    char why[SN_ERR_MAX] = "";
    Ops *o = cuda_ops_for_device(host->local_rank, why);
    if (!o) snprintf(why + strlen(why), SN_ERR_MAX - strlen(why), " (its rank on its machine: %d)", host->local_rank);
    if (comm_agree(host, o ? 0 : -1, why)) {  // every rank has its device, or none goes on
        snprintf(err, SN_ERR_MAX, "%.480s", why);
        return -1;
    }
    ncclUniqueId id;
    if (host->rank == 0) ncclCheck(ncclGetUniqueId(&id));
    if (host->broadcast(host, &id, sizeof id, 0)) {
        snprintf(err, SN_ERR_MAX, "stopped because rank %d failed", host->failed_rank(host));
        return -1;
    }
    NcclGroup *g = (NcclGroup *)calloc(1, sizeof *g);
    internalCheck(g != NULL);  // out of host memory
    g->n = 1;
    g->ranks[0].o = o;
    ctx_of(o);  // ncclCommInitRank binds the communicator to the current device
    ncclCheck(ncclCommInitRank(&g->ranks[0].nccl, host->size, id, host->rank));
    nccl_comm_bind(dcomm, host, g, 0);
    return 0;
}

// ---- --sync-bn on the device: the fp64 per-channel sums of segnet.c's
// bn_sync_stats / bn_sync_grads (the same terms, segnet.h), in the ctx's
// `sums` scratch, all-reduced by NCCL. The scratch is free between ops: the
// ops after the all-reduce wait for it on the compute stream.

// s[c] = n·mean_r[c]
__global__ void bn_sync_mean_terms_kernel(double *s, const float *mean, int C, double n) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += blockDim.x * gridDim.x)
        s[c] = bn_sync_mean_term(n, mean[c]);
}
// the global mean into mean (fp32) and the centred terms q[c] (the replica's own mean first)
__global__ void bn_sync_var_terms_kernel(double *q, float *mean, const float *var, const double *s, int C, double n,
                                         double total) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += blockDim.x * gridDim.x) {
        double global_mean = s[c] / total;
        q[c] = bn_sync_var_term(n, mean[c], var[c], global_mean);
        mean[c] = (float)global_mean;
    }
}
__global__ void bn_sync_var_kernel(float *var, const double *q, int C, double total) {
    for (int c = blockIdx.x * blockDim.x + threadIdx.x; c < C; c += blockDim.x * gridDim.x)
        var[c] = (float)(q[c] / total);
}

int cuda_bn_sync_stats(Comm *dcomm, Ops *o, float *mean, float *var, int C, size_t count, size_t total) {
    double *s = ctx_of(o)->sums, *q = s + C;  // (C) each
    const unsigned grid = grid_for((size_t)C);
    CU_LAUNCH(bn_sync_mean_terms_kernel, grid, BLOCK, 0, stream_of(o), s, mean, C, (double)count);
    launchCheck();
    if (dcomm->allreduce_f64(dcomm, s, (size_t)C)) return -1;
    CU_LAUNCH(bn_sync_var_terms_kernel, grid, BLOCK, 0, stream_of(o), q, mean, var, s, C, (double)count, (double)total);
    launchCheck();
    if (dcomm->allreduce_f64(dcomm, q, (size_t)C)) return -1;
    CU_LAUNCH(bn_sync_var_kernel, grid, BLOCK, 0, stream_of(o), var, q, C, (double)total);
    launchCheck();
    return 0;
}

// s = (Σg, Σg·xhat) in fp64, 0 for an empty shard (its sums were not computed); back to fp32 after the sum
__global__ void bn_sync_grad_terms_kernel(double *s, const float *sum_g, const float *sum_gx, int C, int empty) {
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < 2 * C; k += blockDim.x * gridDim.x)
        s[k] = empty ? 0.0 : (double)(k < C ? sum_g[k] : sum_gx[k - C]);
}
__global__ void bn_sync_grads_kernel(float *sum_g, float *sum_gx, const double *s, int C) {
    for (int k = blockIdx.x * blockDim.x + threadIdx.x; k < 2 * C; k += blockDim.x * gridDim.x) {
        if (k < C) sum_g[k] = (float)s[k];
        else sum_gx[k - C] = (float)s[k];
    }
}

int cuda_bn_sync_grads(Comm *dcomm, Ops *o, float *sum_g, float *sum_gx, int C, size_t count) {
    double *s = ctx_of(o)->sums;  // (2C)
    const unsigned grid = grid_for(2 * (size_t)C);
    CU_LAUNCH(bn_sync_grad_terms_kernel, grid, BLOCK, 0, stream_of(o), s, sum_g, sum_gx, C, count == 0);
    launchCheck();
    if (dcomm->allreduce_f64(dcomm, s, 2 * (size_t)C)) return -1;
    CU_LAUNCH(bn_sync_grads_kernel, grid, BLOCK, 0, stream_of(o), sum_g, sum_gx, s, C);
    launchCheck();
    return 0;
}

void cuda_comm_destroy(Comm *dcomms, int n) {
    if (n < 1) return;
    NcclGroup *g = ((NcclRank *)dcomms[0].ctx)->group;
    for (int i = 0; i < g->n; i++) {
        ctx_of(g->ranks[i].o);
        cudaCheck(cudaStreamSynchronize(((CudaCtx *)g->ranks[i].o->ctx)->comm_stream));
        ncclCheck(ncclCommDestroy(g->ranks[i].nccl));
        g->ranks[i].host->device = NULL;
    }
    free(g);
}
#else
int cuda_comm_local_create(Comm *dcomms, Comm *hosts, int n, char err[SN_ERR_MAX]) {
    (void)dcomms; (void)hosts;
    snprintf(err, SN_ERR_MAX, "%d replicas on CUDA devices need NCCL: this segnet was built without it (NO_NCCL=1)", n);
    return -1;
}
int cuda_comm_mpi_create(Comm *dcomm, Comm *host, char err[SN_ERR_MAX]) {
    (void)dcomm;
    snprintf(err, SN_ERR_MAX, "%d replicas on CUDA devices need NCCL: this segnet was built without it (NO_NCCL=1)",
             host->size);
    return -1;
}
void cuda_comm_destroy(Comm *dcomms, int n) { (void)dcomms; (void)n; }
// without NCCL no Comm has a device communicator: these are never called
int cuda_bn_sync_stats(Comm *dcomm, Ops *o, float *mean, float *var, int C, size_t count, size_t total) {
    (void)dcomm; (void)o; (void)mean; (void)var; (void)C; (void)count; (void)total;
    return -1;
}
int cuda_bn_sync_grads(Comm *dcomm, Ops *o, float *sum_g, float *sum_gx, int C, size_t count) {
    (void)dcomm; (void)o; (void)sum_g; (void)sum_gx; (void)C; (void)count;
    return -1;
}
#endif
