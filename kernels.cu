// kernels.cu -- the CUDA ops table (ops_cuda): hand-written kernels, cuBLAS for
// GEMMs, NCCL for all-reduce; no vendor DNN library.
//
// This file holds what the kernels run in: the checks, the launch, the device context, the
// ops table, the devices and the Backend. The kernels and their launchers are in chapters,
// cuda/*.cuh, which it includes in the porting order (doc/porting.md): seam, reductions,
// elementwise, batch_norm, gemm_conv, implicit_gemm, losses, adam, communicators.
//
// One source, two builds (see doc/design.md, "GPU code without a GPU"):
//   nvcc -c kernels.cu                         for GPUs (real <<<>>>, __shared__, cuBLAS, NCCL)
//   g++ -x c++ -std=c++17 -c kernels.cu        for the CPU, against cuda/cuda_emu.h and .cpp
// so every kernel launches through CU_LAUNCH and takes shared memory through
// CU_DYN_SHARED (dynamic) or CU_SHARED(type, name, [dims]) (static); the rules
// for kernels that must run on both are at the top of cuda/cuda_emu.h.
//
// Layout as on the CPU: activations NHWC in the Tensor's storage type (fp32,
// fp16, bf16), loaded to fp32 for arithmetic and rounded to nearest-even when
// stored, with the conversions of segnet.h (identical on both backends);
// parameters, gradients, statistics and optimiser state are fp32. The CPU ops
// (segnet.c) are the specification: the cuda_* tests compare every op here with
// them.
//
// Bit-equal paths. nvcc contracts a·b + c into one fused multiply-add wherever
// it can (-fmad=true, its default); of the emulator's builds, kernels_emu.o
// never does and kernels_strict.o does wherever g++ can (make test runs the
// cuda_ tests on both). Where two paths must give the same bits, the cuda_
// tests compare them byte for byte:
//   - batch norm fused with the layer after it (BnNext) and the two ops one
//     after the other (cuda_bn_fused_next, cuda_fused_layers_bitwise): the
//     residual end out = y·keep + residual is one FMA in ResidualEnd and in
//     both dropout kernels (dropout_residual_end; with keep 1 that is
//     add_forward's y + residual), y's gradient dy·keep one rounded product in
//     DyResidual and in dropout's backward (__fmul_rn); the rest is batch
//     norm's per-element code that both paths share (BnChannel, whose z is
//     an explicit FMA; BnParams::grad, BnDataGrad), so the same instructions;
//   - a training step replayed as a CUDA graph and run op by op
//     (cuda_graph_step): the same kernels on the same values;
//   - Adam with grad_scale and on the pre-scaled gradient: every operation
//     rounded on its own (__fmul_rn and friends, AdamStep).
// A new pair of paths that must agree writes the arithmetic in which they
// differ in structure with explicit rounding (__fmul_rn, __fadd_rn, __fmaf_rn).

#if defined(__CUDACC__)
#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#define CU_LAUNCH_RAW(kernel, grid, block, smem, stream, ...)                                      \
    kernel<<<(grid), (block), (smem), (stream)>>>(__VA_ARGS__)
#define CU_DYN_SHARED(T, name)                                         \
    extern __shared__ __align__(16) unsigned char cu_dyn_smem_raw_[]; \
    T *name = reinterpret_cast<T *>(cu_dyn_smem_raw_)
#define CU_SHARED(T, name, dims) __shared__ T name dims
#else
#include "cuda_emu.h"
#endif
#include <cublas_v2.h>
#include <cxxabi.h>
#include <limits.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <initializer_list>
#include <type_traits>
#include <algorithm>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

#include "segnet.h"

// ----------------------------------------------------------------------------
// checks: a failing CUDA or cuBLAS call is a bug or a dead device, not a user
// error the program can recover from; report where and stop.

// the errors of work the runtime refuses while a stream captures (a training step being recorded)
#define CAPTURE_HINT \
    " (while recording the training step as a CUDA graph: SEGNET_CUDA_GRAPHS=0 runs steps op by op)"
static bool capture_error(cudaError_t e) {
    return e == cudaErrorStreamCaptureUnsupported || e == cudaErrorStreamCaptureInvalidated ||
           e == cudaErrorStreamCaptureImplicit || e == cudaErrorStreamCaptureIsolation ||
           e == cudaErrorStreamCaptureUnjoined || e == cudaErrorCapturedEvent;
}
static void cuda_check(cudaError_t e, const char *what, const char *file, int line) {
    if (e == cudaSuccess) return;
    fprintf(stderr, "segnet: CUDA error at %s:%d: %s: %s%s\n", file, line, what,
            cudaGetErrorString(e), capture_error(e) ? CAPTURE_HINT : "");
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

#if !defined(__CUDACC__)
// The emulator builds this file twice, differing in one way that changes
// results: kernels_strict.o contracts a·b + c into one fused multiply-add
// wherever the compiler can, as nvcc does by default (-fmad=true), and
// kernels_emu.o never does. cuda_emu_semantics asks this build which it is.
extern "C" float cuemu_kernels_mul_add(float a, float b, float c) { return a * b + c; }
#endif

// ----------------------------------------------------------------------------
// device time per kernel (segnet.h: cuda_kernel_timing, cuda_kernel_times):
// CU_LAUNCH brackets each launch with two events from a pool while timing is on

// What a launch moves and computes, declared at every CU_LAUNCH: bytes, the
// elements of the tensors it reads or writes, each counted once in its storage
// type (as segnet plan --roofline counts them: an accumulated output's read,
// and re-reads that L1 or L2 may serve, left out); flops, 2 per multiply-add
// of its products (convolutions, squeeze-excitation), 0 for elementwise work.
// make gpucount weighs its launches by them; bench --kernels divides them by
// device time.
struct Traffic {
    double bytes, flops;
};
static Traffic moves(double bytes, double flops = 0.0) { return Traffic{bytes, flops}; }
static double bytes_of(Tensor t) { return (double)tensor_bytes(t); }
// n elements of type dt
static double bytes_of(size_t n, DType dt) { return (double)n * (double)dtype_size(dt); }

int cuda_kernel_timing = 0;
struct TimedLaunch {
    const void *func;  // the kernel, or a cuBLAS call's row key (its label's address)
    const char *label;  // a cuBLAS call's row name; NULL: the kernel's
    cudaEvent_t start, stop;
    Traffic traffic;
};
static std::mutex g_timing_mu;
static std::vector<TimedLaunch> g_timed;  // launched, not read yet
static std::vector<cudaEvent_t> g_events;  // free
static std::unordered_map<const void *, KernelTimeRow> g_time_rows;
static cudaEvent_t timing_event() {
    cudaEvent_t e;
    if (!g_events.empty()) {
        e = g_events.back();
        g_events.pop_back();
    } else {
        cudaCheck(cudaEventCreate(&e));
    }
    return e;
}
// label: a cuBLAS call, timed as a kernel (its own row, named by the label)
static void kernel_time_begin(const void *func, cudaStream_t s, Traffic traffic,
                              const char *label = NULL) {
#if !defined(__CUDACC__)
    if (!label) cuemu::next_launch_traffic(traffic.bytes, traffic.flops);
#endif
    if (!cuda_kernel_timing) return;
    std::lock_guard<std::mutex> lock(g_timing_mu);
    const TimedLaunch t = {label ? (const void *)label : func, label, timing_event(),
                           timing_event(), traffic};
    cudaCheck(cudaEventRecord(t.start, s));
    g_timed.push_back(t);
}
static void kernel_time_end(cudaStream_t s) {
    if (!cuda_kernel_timing) return;
    std::lock_guard<std::mutex> lock(g_timing_mu);
    if (!g_timed.empty()) cudaCheck(cudaEventRecord(g_timed.back().stop, s));
}
#undef CU_LAUNCH  // the emulator's: CU_LAUNCH_RAW
#define CU_LAUNCH(kernel, grid, block, smem, stream, traffic, ...)                                 \
    do {                                                                                           \
        kernel_time_begin(reinterpret_cast<const void *>(kernel), (stream), (traffic));            \
        CU_LAUNCH_RAW(kernel, grid, block, smem, stream, ##__VA_ARGS__);                           \
        kernel_time_end(stream);                                                                   \
    } while (0)
// a kernel's name as written, template arguments included (no parameters)
static const char *kernel_name(const void *func) {
    const char *mangled = NULL;
    if (cudaFuncGetName(&mangled, func) != cudaSuccess || !mangled) {
        cudaGetLastError();
        return "?";
    }
    int status = 0;
    char *d = abi::__cxa_demangle(mangled, NULL, NULL, &status);
    std::string name = d && !status ? d : mangled;
    free(d);
    if (!name.compare(0, 5, "void ")) name.erase(0, 5);
    int depth = 0;
    for (size_t i = 0; i < name.size(); i++) {
        depth += name[i] == '<' ? 1 : name[i] == '>' ? -1 : 0;
        if (name[i] == '(' && !depth) {
            name.resize(i);
            break;
        }
    }
    return strdup(name.c_str());  // kept for the process: one per kernel
}
int cuda_kernel_times(KernelTimeRow *rows, int max) {
    std::lock_guard<std::mutex> lock(g_timing_mu);
    cudaCheck(cudaDeviceSynchronize());
    for (const TimedLaunch &t : g_timed) {
        float ms = 0.0f;
        cudaCheck(cudaEventElapsedTime(&ms, t.start, t.stop));
        KernelTimeRow &r = g_time_rows[t.func];
        if (!r.name) r.name = t.label ? t.label : kernel_name(t.func);
        r.launches++;
        r.ms += ms;
        r.bytes += t.traffic.bytes;
        r.flops += t.traffic.flops;
        g_events.push_back(t.start);
        g_events.push_back(t.stop);
    }
    g_timed.clear();
    std::vector<KernelTimeRow> all;
    for (const auto &kv : g_time_rows) all.push_back(kv.second);
    std::sort(all.begin(), all.end(), [](const KernelTimeRow &a, const KernelTimeRow &b) {
        return a.ms != b.ms ? a.ms > b.ms : strcmp(a.name, b.name) < 0;
    });
    for (int i = 0; i < max && i < (int)all.size(); i++) rows[i] = all[i];
    return (int)all.size();
}
void cuda_kernel_times_reset(void) {
    std::lock_guard<std::mutex> lock(g_timing_mu);
    g_time_rows.clear();
}

// ----------------------------------------------------------------------------
// the backend's state and small helpers shared by the kernels

// Partial sums of the deterministic reductions (sum_squares, softmax_xent): one
// row of REDUCE_WIDTH doubles per block, summed in block order by the block
// that finishes last (reduce_finish).
// REDUCE_BLOCKS_MAX: 30 blocks per SM, whole waves at 5 or 6 resident (the two
// reductions'), ≥ 0.9 full at 4 or 8
#define REDUCE_BLOCKS_MAX (30 * WAVE_SMS)
#define REDUCE_WIDTH 3

// Counters of finished blocks for the reductions whose last block adds the
// others' partials (last_block): one per (channel tile, group) of a channel-sums
// launch, per output tile of an implicit-GEMM weight gradient. 0 between launches.
#define SUMS_COUNTERS ((size_t)1 << 15)

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
    // (SUMS_COUNTERS) its finished chunks per (tile, group), 0 between launches
    unsigned *sums_done;
    // the replicas' collectives (NCCL) run on a stream of their own, ordered
    // after the work on `stream` before them (compute_done) and before the
    // work after them (comm_done): see "NCCL communicators" below
    cudaStream_t comm_stream;
    cudaEvent_t compute_done, comm_done;
    // uploads ahead of their step run on a stream of their own, after the work on
    // `stream` before them (copy_start); the work after await_uploads waits for them
    // (copy_done)
    cudaStream_t copy_stream;
    cudaEvent_t copy_start, copy_done;
    void *blas_workspace;  // (CUBLAS_WORKSPACE_BYTES) cuBLAS's, given with cublasSetWorkspace
    bool sync_each;        // SEGNET_CUDA_SYNC: synchronise and check after every launch
    int sm_major;          // compute capability (major): the tensor-core kernels need 8 or more
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
    fprintf(stderr, "segnet: CUDA error in %s (%s:%d)%s: %s%s\n", op, file, line,
            sync ? ", synchronised after the launch (SEGNET_CUDA_SYNC)" : "", cudaGetErrorString(e),
            capture_error(e) ? CAPTURE_HINT : "");
    exit(1);
}
static cudaStream_t stream_of(Ops *o) { return ctx_of(o)->stream; }

#define BLOCK 256  // threads per block of the elementwise kernels

// ----------------------------------------------------------------------------
// the chapters, in the porting order (doc/porting.md): each needs only the ones before it
// and the above; its first lines say what it holds

#include "cuda/seam.cuh"
#include "cuda/reductions.cuh"
#include "cuda/elementwise.cuh"
#include "cuda/batch_norm.cuh"
#include "cuda/gemm_conv.cuh"
#include "cuda/implicit_gemm.cuh"
#include "cuda/losses.cuh"
#include "cuda/adam.cuh"

// ----------------------------------------------------------------------------
// the CUDA ops table (cuda_ops_complete checks that no entry is left NULL;
// ops_for_device refuses a table with NULL entries)

static Ops make_ops_cuda(void) {
    Ops o;
    memset(&o, 0, sizeof o);
    o.name = "cuda";
    o.backend = &backend_cuda;
    o.weights_in_storage_type = 1;  // cuBLAS multiplies bf16 and fp16 operands
    o.alloc = cuda_alloc;
    o.free = cuda_free;
    o.upload = cuda_upload;
    o.download = cuda_download;
    o.synchronize = cuda_synchronize;
    o.host_alloc = cuda_host_alloc;
    o.host_free = cuda_host_free;
    o.upload_async = cuda_upload_async;
    o.upload_ahead = cuda_upload_ahead;
    o.await_uploads = cuda_await_uploads;
    o.copy_async = cuda_copy_async;
    o.capture_begin = cuda_capture_begin;
    o.capture_end = cuda_capture_end;
    o.replay = cuda_replay;
    o.record_free = cuda_record_free;
    o.fill = fill_cuda;
    o.scale = scale_cuda;
    o.axpby = axpby_cuda;
    o.copy = copy_cuda;
    o.widen_bytes = widen_bytes_cuda;
    o.sum_squares = sum_squares_cuda;
    o.nonfinite = nonfinite_cuda;
    o.step_control = step_control_cuda;
    o.conv2d_workspace = conv2d_workspace_cuda;
    o.conv2d_forward = conv2d_forward_cuda;
    o.conv2d_backward_data = conv2d_backward_data_cuda;
    o.conv2d_backward_weight = conv2d_backward_weight_cuda;
    o.bn_stats = bn_stats_cuda;
    o.bn_stats_finish = bn_stats_finish_cuda;
    o.bn_forward = bn_forward_cuda;
    o.bn_update_running = bn_update_running_cuda;
    o.bn_backward_reduce = bn_backward_reduce_cuda;
    o.bn_backward_finish = bn_backward_finish_cuda;
    o.bn_backward_data = bn_backward_data_cuda;
    o.act_forward = act_forward_cuda;
    o.act_backward = act_backward_cuda;
    o.global_avg_pool_forward = global_avg_pool_forward_cuda;
    o.global_avg_pool_backward = global_avg_pool_backward_cuda;
    o.channel_scale_forward = channel_scale_forward_cuda;
    o.channel_scale_backward = channel_scale_backward_cuda;
    o.se_gate_forward = se_gate_forward_cuda;
    o.se_gate_backward = se_gate_backward_cuda;
    o.add_forward = add_forward_cuda;
    o.add_backward = add_backward_cuda;
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
    o.softmax_xent = softmax_xent_cuda;
    o.softmax_focal = softmax_focal_cuda;
    o.region_sums = region_sums_cuda;
    o.region_grad = region_grad_cuda;
    o.iou_per_image = iou_per_image_cuda;
    o.lovasz = lovasz_cuda;
    o.confusion_accumulate = confusion_accumulate_cuda;
    o.adam_update = adam_update_cuda;
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
    (sizeof(double) * REDUCE_BLOCKS_MAX * REDUCE_WIDTH + SUMS_SCRATCH * sizeof(double) + \
     SUMS_COUNTERS * sizeof(unsigned) + CUBLAS_WORKSPACE_BYTES)
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
    cudaCheck(cudaStreamCreate(&ctx->copy_stream));
    cudaCheck(cudaEventCreateWithFlags(&ctx->copy_start, cudaEventDisableTiming));
    cudaCheck(cudaEventCreateWithFlags(&ctx->copy_done, cudaEventDisableTiming));
    cublasCheck(cublasCreate(&ctx->blas));
    cublasCheck(cublasSetStream(ctx->blas, ctx->stream));
    const char *sync = getenv("SEGNET_CUDA_SYNC");
    ctx->sync_each = sync && *sync && strcmp(sync, "0");
    cudaCheck(cudaDeviceGetAttribute(&ctx->sm_major, cudaDevAttrComputeCapabilityMajor, device));
    if (ctx->sm_major >= 8) ig_raise_smem_limits();
    const char *conv = getenv("SEGNET_CONV");
    if (conv && !strcmp(conv, "gemm")) cuda_conv_implicit = 0;
    cudaCheck(cudaMalloc((void **)&ctx->reduce_partials,
                         sizeof(double) * REDUCE_BLOCKS_MAX * REDUCE_WIDTH));
    if ((e = cudaMalloc(&ctx->sums, SUMS_SCRATCH * sizeof(double))) != cudaSuccess ||
        (e = cudaMalloc(&ctx->sums_done, SUMS_COUNTERS * sizeof(unsigned))) != cudaSuccess ||
        (e = cudaMemsetAsync(ctx->sums_done, 0, SUMS_COUNTERS * sizeof(unsigned), ctx->stream)) !=
                cudaSuccess ||
        (e = cudaMalloc(&ctx->blas_workspace, CUBLAS_WORKSPACE_BYTES)) != cudaSuccess) {
        snprintf(err, SN_ERR_MAX, "CUDA device %d: cannot allocate %zu bytes of scratch (%s)",
                 device, CUDA_CONTEXT_BYTES, cudaGetErrorString(e));
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
        snprintf(err, SN_ERR_MAX, "no CUDA device %d (at most %d are used)", device,
                 CUDA_MAX_DEVICES);
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
// the last chapter: the replicas' communicators, over the devices' contexts above

#include "cuda/communicators.cuh"

// ----------------------------------------------------------------------------
// what the application asks of this backend besides its tables (segnet.h: Backend)

static size_t cuda_bytes_live_now(void) { return cuda_bytes_live; }
static size_t cuda_bytes_peak_now(void) { return cuda_bytes_peak; }
static void cuda_kernel_timing_set(int on) { cuda_kernel_timing = on; }

const Backend backend_cuda = {
    "cuda", "CUDA", cuda_ops_for_device, cuda_memory_info, cuda_bytes_live_now,
    cuda_bytes_peak_now, cuda_kernel_timing_set, cuda_kernel_times, cuda_kernel_times_reset,
    cuda_comm_local_create, cuda_comm_mpi_create, cuda_comm_destroy,
};
