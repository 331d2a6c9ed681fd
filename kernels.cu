// kernels.cu -- the CUDA ops table (ops_cuda): hand-written kernels, cuBLAS for
// GEMMs, NCCL for all-reduce, no cuDNN.
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
#include <stdio.h>
#include <stdlib.h>

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
// after every launch: a bad configuration is reported at the launch, not later
#define launchCheck() cuda_check(cudaGetLastError(), "kernel launch", __FILE__, __LINE__)

// ----------------------------------------------------------------------------
// the backend's state and small helpers shared by the kernels

struct CudaCtx {
    int device;
    cudaStream_t stream;  // every op runs on it, in order
    cublasHandle_t blas;
};
static CudaCtx *ctx_of(Ops *o) { return (CudaCtx *)o->ctx; }
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

static void *cuda_alloc(Ops *o, size_t bytes) {
    (void)o;
    void *p = NULL;
    if (cudaMalloc(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();  // clear the sticky error: the caller reports "out of memory"
        return NULL;
    }
    return p;
}
static void cuda_free(Ops *o, void *p) {
    (void)o;
    if (p) cudaCheck(cudaFree(p));
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

// ----------------------------------------------------------------------------
// the CUDA ops table. Entries not filled in yet are NULL (the cuda_ops_complete
// test lists them).

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
    return o;
}
Ops ops_cuda = make_ops_cuda();  // declared extern "C" in segnet.h

// Opens the device for ops_cuda. A machine without a driver or a device is an
// ordinary situation (the caller falls back to the CPU), so it is a message.
int cuda_backend_open(int device, char *err) {
    static CudaCtx ctx;
    if (ops_cuda.ctx) return 0;
    int count = 0;
    cudaError_t e = cudaGetDeviceCount(&count);
    if (e != cudaSuccess) {
        snprintf(err, SN_ERR_MAX, "no usable CUDA driver (%s)", cudaGetErrorString(e));
        cudaGetLastError();
        return -1;
    }
    if (device < 0 || device >= count) {
        snprintf(err, SN_ERR_MAX, "no CUDA device %d (found %d)", device, count);
        return -1;
    }
    if ((e = cudaSetDevice(device)) != cudaSuccess) {
        snprintf(err, SN_ERR_MAX, "CUDA device %d: %s", device, cudaGetErrorString(e));
        return -1;
    }
    ctx.device = device;
    cudaCheck(cudaStreamCreate(&ctx.stream));
    cublasCheck(cublasCreate(&ctx.blas));
    cublasCheck(cublasSetStream(ctx.blas, ctx.stream));
    ops_cuda.ctx = &ctx;
    return 0;
}
