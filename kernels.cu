// kernels.cu -- the CUDA ops table (ops_cuda): hand-written kernels, cuBLAS for
// GEMMs, NCCL for all-reduce; no vendor DNN library.
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
// the porting seam: the warp and the tensor-core tile. What the kernels below assume of the
// machine is here: WARP_SIZE, the tensor-core instructions (sm_80 and later: one wrapper
// each, inline PTX on GPUs, the emulator's model of the same instruction otherwise; cuda_emu.h
// states the fragment layouts from the PTX ISA and cuemu_selftest checks them) and the tile
// interface the implicit-GEMM conv uses (tc_load_a, tc_load_b2, tc_mma, tc_acc_row/col). A
// port to another matrix instruction (AMD MFMA, Hopper wgmma) replaces this section; the
// tests cuda_conv_* and cuda_emu_semantics judge it.

// threads that run in lock step (a warp; AMD's wavefront has 64): the conv's warp tiles, the
// squeeze-excitation gate's shuffles and the channel lanes of the row kernels count in it
#define WARP_SIZE 32

struct BF16;  // below: bf16 storage

template <class T> struct IsBF16 { static constexpr bool value = false; };
template <> struct IsBF16<BF16> { static constexpr bool value = true; };

// d (16×8 fp32) += a (16×16) · b (16×8), operands of 16-bit type T in registers
template <class T>
static __device__ __forceinline__ void tc_mma(float d[4], const uint32_t a[4],
                                              const uint32_t b[2]) {
#if defined(__CUDACC__)
#if __CUDA_ARCH__ >= 800
    if (IsBF16<T>::value)
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
    else
        asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, "
                     "{%4,%5,%6,%7}, {%8,%9}, "
                     "{%0,%1,%2,%3};\n"
                     : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
                     : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#else
    __trap();  // the host never launches these kernels below compute capability 8.0
#endif
#else
    cuemu::mma_m16n8k16(d, a, b, d, IsBF16<T>::value ? cuemu::MMA_BF16 : cuemu::MMA_F16);
#endif
}
// four 8×8 matrices of 16-bit elements from shared memory, matrix i's rows at
// the addresses of lanes 8i..8i+7 (TRANS: each matrix transposed)
template <bool TRANS>
static __device__ __forceinline__ void ldmatrix_x4(uint32_t r[4], const void *row) {
#if defined(__CUDACC__)
#if __CUDA_ARCH__ >= 800
    const unsigned a = (unsigned)__cvta_generic_to_shared(row);
    if (TRANS)
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
    else
        asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
                     : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
#else
    __trap();
#endif
#else
    cuemu::ldmatrix(r, 4, row, TRANS);
#endif
}
// 16 bytes global -> shared without passing through registers; src_bytes 0
// (a pixel of the padding, a row past the end) stores 16 zero bytes
static __device__ __forceinline__ void cp_async16(void *dst, const void *src, int src_bytes) {
#if defined(__CUDACC__)
#if __CUDA_ARCH__ >= 800
    const unsigned a = (unsigned)__cvta_generic_to_shared(dst);
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(a), "l"(src),
                 "r"(src_bytes)
                 : "memory");
#else
    __trap();
#endif
#else
    cuemu::cp_async16(dst, src, src_bytes);
#endif
}
static __device__ __forceinline__ void cp_async_commit() {
#if defined(__CUDACC__)
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;\n" ::: "memory");
#endif
#else
    cuemu::cp_async_commit();
#endif
}
// waits until at most `pending` of this thread's newest committed groups are in flight
template <int pending> static __device__ __forceinline__ void cp_async_wait() {
#if defined(__CUDACC__)
#if __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;\n" ::"n"(pending) : "memory");
#endif
#else
    cuemu::cp_async_wait(pending);
#endif
}

// ---- the tile interface: D (TC_M×TC_N, fp32) += A (TC_M×TC_K) · B (TC_K×TC_N), A and B
// 16-bit. An operand tile lies in shared memory as 16 lines of two 16-byte chunks (8
// elements): A as [row][k] or, TRANS, [k][row]; B as [column][k] or, TRANS, [k][column].
// at(line, chunk) gives a chunk's address; each lane passes ldmatrix one address.
#define TC_M 16
#define TC_N 8
#define TC_K 16

// A's registers a0..a3 (mma's A fragment): the four 8×8 matrices (rows 0-7 | 8-15) ×
// (k 0-7 | 8-15), matrix q = lane/8 read at the addresses of lanes 8q..8q+7
template <bool TRANS, class At>
static __device__ __forceinline__ void tc_load_a(uint32_t a[4], At at) {
    const int lane = threadIdx.x % WARP_SIZE, q = lane / 8;
    if constexpr (TRANS) ldmatrix_x4<true>(a, at(lane % 8 + 8 * (q >> 1), q & 1));
    else ldmatrix_x4<false>(a, at(lane % 8 + 8 * (q & 1), q >> 1));
}
// B of two adjacent TC_N-column tiles (16 columns): b0 of columns 0-7, b1 of 8-15, each
// (k 0-7 | 8-15)
template <bool TRANS, class At>
static __device__ __forceinline__ void tc_load_b2(uint32_t b0[2], uint32_t b1[2], At at) {
    const int lane = threadIdx.x % WARP_SIZE, q = lane / 8;
    uint32_t r[4];
    if constexpr (TRANS) ldmatrix_x4<true>(r, at(lane % 8 + 8 * (q & 1), q >> 1));
    else ldmatrix_x4<false>(r, at(lane % 8 + 8 * (q >> 1), q & 1));
    b0[0] = r[0]; b0[1] = r[1]; b1[0] = r[2]; b1[1] = r[3];
}
// where a lane's accumulator r (0..3) of D lies: row lane/4 (+8 for r ≥ 2), column
// 2·(lane%4) + r%2 (mma.m16n8k16's D layout)
static __device__ __forceinline__ unsigned tc_acc_row(int r) {
    return (threadIdx.x % WARP_SIZE) / 4 + 8 * (r >> 1);
}
static __device__ __forceinline__ unsigned tc_acc_col(int r) {
    return 2 * (threadIdx.x % 4) + (r & 1);
}

// ----------------------------------------------------------------------------
// indexing and memory access, for every kernel below
//
// No kernel divides a 64-bit number (a subroutine of dozens of instructions
// on a GPU): an index a kernel splits, or walks in a grid-stride loop, is
// 32-bit, the host splitting an op into launches below LAUNCH_MAX_ELEMENTS
// (chunks of whole rows or images) where its tensors could be larger; a split
// by a launch constant inside a loop is a FastDiv (segnet.h), a multiply-high.
// Offsets that are only multiplied and added may be 64-bit.
//
// An NHWC tensor is (rows, C), a row one pixel's C channels. Two kinds of
// kernel implement the ops:
//   - generic kernels: one element per thread step, storage types read at run
//     time (any mix of fp32/fp16/bf16), any C, any alignment;
//   - vector kernels: 16 bytes per load and store (a Vec of 4 fp32 or 8
//     fp16/bf16 values of consecutive elements), templates over the one
//     storage type T of all the op's tensors. Channel ops lay their threads
//     out over (channel vector, row): threadIdx.x + blockIdx.x·blockDim.x
//     fixes a thread's channels, so per-channel constants are loaded once,
//     and rows are walked by a grid-stride loop without any division.
// An op takes the vector kernel when its tensors share one storage type, C
// (or the length) is a multiple of the vector width and every pointer is
// 16-byte aligned (the memory plan aligns every tensor), else the generic one.
// Both evaluate the CPU op's expression in fp32 and round once when storing,
// so they give the same bits; the cuda_ tests run every op both ways
// (cuda_vector_kernels = 0 forces the generic kernels).

int cuda_vector_kernels = 1;  // declared in segnet.h
// elements per launch, so that indices stay 32-bit; the emulator's can be
// lowered (a test splits small ops into many launches at its boundaries)
#if defined(__CUDACC__)
#define LAUNCH_MAX_ELEMENTS ((size_t)1 << 30)
#else
size_t cuda_launch_max_elements = (size_t)1 << 30;
#define LAUNCH_MAX_ELEMENTS cuda_launch_max_elements
#endif
#define VEC_BYTES 16

// A memory-bound kernel keeps enough loads in flight only with many warps per
// SM: MEMORY_BOUND promises ptxas at most BLOCK threads a block and asks for
// registers for MEMORY_BOUND_BLOCKS of them on an SM (64 a thread: 4 blocks of
// 256 = 32 warps of sm_90's 64); kernels_no_spills checks that none spills.
#define MEMORY_BOUND_BLOCKS 4
#define MEMORY_BOUND __launch_bounds__(BLOCK, MEMORY_BOUND_BLOCKS)

// ---- grids that fill the machine
// Grids are sized for a 132-SM H200 whatever the GPU: a reduction's order
// follows its grid, and its bits must not depend on the GPU. A grid of B
// blocks, b of them resident per SM, runs in W = ceil(B / (132·b)) waves; its
// wave efficiency B / (W·132·b) is the share of the slots its waves keep busy
// (make gpucount prints it per launch).
#define WAVE_SMS 132
#define WAVE_FILL_MIN 0.8
// a grid-stride loop's blocks at most: 8 waves at 4 blocks per SM, 4 at 8
#define GRID_STRIDE_BLOCKS (32 * WAVE_SMS)
static double wave_efficiency(size_t blocks, size_t slots) {
    const size_t waves = (blocks + slots - 1) / slots;
    return waves ? (double)blocks / (double)(waves * slots) : 0.0;
}
// b blocks' worth of grid-stride work in at most `most` blocks that each run the
// same number of rounds r (ceil(b / r) blocks: none runs a round more than the
// others while they wait). Of the 8 smallest r that keep within `most`, the one
// whose grid's waves are fullest at the worst of 4, 5, 6 and 8 blocks per SM.
static size_t balanced_blocks(size_t b, size_t most) {
    if (b < 1) return 1;
    const size_t first = (b + most - 1) / most;
    size_t best = (b + first - 1) / first;
    double best_fill = -1.0;
    for (size_t r = first; r < first + 8; r++) {
        const size_t blocks = (b + r - 1) / r;
        double fill = 1.0;
        for (int per_sm : {4, 5, 6, 8})
            fill = std::min(fill, wave_efficiency(blocks, (size_t)WAVE_SMS * per_sm));
        if (fill > best_fill + 1e-9) {
            best = blocks;
            best_fill = fill;
        }
    }
    return best;
}
// The parts to split a launch's work into, `tiles` blocks a part, per_sm blocks
// resident per SM: the asked-for `want` if its waves are WAVE_FILL_MIN full, else
// the nearest count above it (up to hi) that is, else below it, else want.
// parts_of(n): the parts that asking for n gives (whole rows or tiles a part).
template <class P>
static size_t wave_fill_parts(size_t tiles, size_t want, size_t hi, int per_sm, P parts_of) {
    const size_t slots = (size_t)WAVE_SMS * per_sm;
    auto fills = [&](size_t n) {
        return wave_efficiency(tiles * parts_of(n), slots) >= WAVE_FILL_MIN;
    };
    if (fills(want)) return want;
    for (size_t n = want + 1; n <= hi; n++)
        if (fills(n)) return n;
    for (size_t n = want; n-- > 1;)
        if (fills(n)) return n;
    return want;
}
// rows split into n parts asked for: ceil(rows / n) rows a part, and the parts
// that makes (none empty)
static size_t parts_of_whole_rows(size_t rows, size_t n) {
    if (!rows || !n) return 1;
    const size_t per = (rows + n - 1) / n;
    return (rows + per - 1) / per;
}

// blocks for a grid-stride loop over n elements (bounded: the loop covers the rest)
static unsigned grid_for(size_t n) {
    return (unsigned)balanced_blocks((n + BLOCK - 1) / BLOCK, GRID_STRIDE_BLOCKS);
}

// storage-type load and store by run-time type: the conversions of segnet.h,
// so a value rounds to the same bits on both backends
static __device__ __forceinline__ float ld(const void *p, DType dt, size_t i) {
    if (dt == DT_F32) return ((const float *)p)[i];
    uint16_t h = ((const uint16_t *)p)[i];
    return dt == DT_F16 ? f16_to_f32(h) : bf16_to_f32(h);
}
static __device__ __forceinline__ void st(void *p, DType dt, size_t i, float v) {
    if (dt == DT_F32) ((float *)p)[i] = v;
    else ((uint16_t *)p)[i] = dt == DT_F16 ? f32_to_f16(v) : f32_to_bf16(v);
}
// element i of a buffer of storage type dt
static __host__ __device__ __forceinline__ void *elem_ptr(const void *p, DType dt, size_t i) {
    return (char *)p + i * dtype_size(dt);
}

// An op whose sizes exceed what its kernels index in 32 bits: a shape no model
// of segnet reaches (the callers split everything else), so an internal error.
static void require_below(size_t n, size_t limit, const char *what) {
    if (n < limit) return;
    fprintf(stderr, "segnet: internal error: %s: %zu, at most %zu supported\n", what, n, limit - 1);
    exit(1);
}

// the storage types as template parameters: float, and the 16-bit formats by their bits
struct F16 { uint16_t bits; };
struct BF16 { uint16_t bits; };
// The hardware conversions round to nearest-even like segnet.h's: the same bits
// for every value but NaN payloads (a NaN stays a NaN).
static __device__ __forceinline__ float to_f32(float v) { return v; }
static __device__ __forceinline__ float to_f32(BF16 v) { return bits_f32((uint32_t)v.bits << 16); }
static __device__ __forceinline__ float to_f32(F16 v) {
#if defined(__CUDACC__)
    return __half2float(__ushort_as_half(v.bits));
#else
    return f16_to_f32(v.bits);
#endif
}
template <class T> static __device__ __forceinline__ T from_f32(float v);
template <> __device__ __forceinline__ float from_f32<float>(float v) { return v; }
template <> __device__ __forceinline__ F16 from_f32<F16>(float v) {
#if defined(__CUDACC__)
    return F16{__half_as_ushort(__float2half_rn(v))};
#else
    return F16{f32_to_f16(v)};
#endif
}
template <> __device__ __forceinline__ BF16 from_f32<BF16>(float v) {
#if defined(__CUDACC__)
    return BF16{__bfloat16_as_ushort(__float2bfloat16_rn(v))};
#else
    return BF16{f32_to_bf16(v)};
#endif
}

// BYTES (16 or 8) of consecutive elements, moved by one 128- or 64-bit load or
// store; Vec, the 16-byte one, is the vector kernels' unit. The 8-byte one
// holds half the channels of a 16-bit type, and so half the per-channel
// registers, for kernels that keep many values per channel (NarrowIO).
template <class T, int BYTES> struct alignas(BYTES) VecB {
    static constexpr int N = BYTES / sizeof(T);
    T v[N];
};
template <class T> using Vec = VecB<T, VEC_BYTES>;
// the narrow vector: 4 channels of T (16 bytes of fp32, 8 of fp16/bf16)
#define NARROW_CHANNELS 4
template <class T> constexpr int NARROW_BYTES = NARROW_CHANNELS * sizeof(T);
template <int BYTES> struct VecWord;  // the integer vector type of a BYTES-byte access
template <> struct VecWord<16> { typedef uint4 type; };
template <> struct VecWord<8> { typedef uint2 type; };
template <class T, int BYTES = VEC_BYTES>
static __device__ __forceinline__ VecB<T, BYTES> load_vec(const T *p) {
    VecB<T, BYTES> r;
#if defined(__CUDACC__)
    typedef typename VecWord<BYTES>::type Word;
    *reinterpret_cast<Word *>(&r) = *reinterpret_cast<const Word *>(p);
#else
    cuemu::check_vector_access(p, BYTES);  // the emulator: aligned, inside one allocation
    memcpy(&r, p, BYTES);
#endif
    return r;
}
template <class T, int BYTES>
static __device__ __forceinline__ void store_vec(T *p, const VecB<T, BYTES> &v) {
#if defined(__CUDACC__)
    typedef typename VecWord<BYTES>::type Word;
    *reinterpret_cast<Word *>(p) = *reinterpret_cast<const Word *>(&v);
#else
    cuemu::check_vector_access(p, BYTES);
    memcpy(p, &v, BYTES);
#endif
}

// two consecutive elements, moved by one 32-bit (16-bit types) or 64-bit (fp32)
// store: the conv epilogues' accumulator pairs (tc_acc_col: columns 2q, 2q + 1)
template <class T> struct alignas(2 * sizeof(T)) Pair { T v[2]; };
template <class T> static __device__ __forceinline__ bool pair_aligned(const T *p) {
    return (uintptr_t)p % (2 * sizeof(T)) == 0;
}
template <class T> static __device__ __forceinline__ Pair<T> load_pair(const T *p) {
#if !defined(__CUDACC__)
    cuemu::check_vector_access(p, 2 * sizeof(T));
#endif
    return *reinterpret_cast<const Pair<T> *>(p);
}
template <class T> static __device__ __forceinline__ void store_pair(T *p, float a, float b) {
#if !defined(__CUDACC__)
    cuemu::check_vector_access(p, 2 * sizeof(T));
#endif
    *reinterpret_cast<Pair<T> *>(p) = Pair<T>{{from_f32<T>(a), from_f32<T>(b)}};
}

// whether the vector kernels apply: one storage type, n a multiple of the
// width (elements of a 1-D op, C of a channel op), every pointer aligned
static bool vec_ok(std::initializer_list<DType> dts, size_t n,
                   std::initializer_list<const void *> ptrs) {
    if (!cuda_vector_kernels) return false;
    for (DType d : dts)
        if (d != *dts.begin()) return false;
    if (n % (VEC_BYTES / dtype_size(*dts.begin()))) return false;
    for (const void *p : ptrs)
        if ((uintptr_t)p % VEC_BYTES) return false;
    return true;
}

// runs the statements with T the template type of storage type dt
#define SWITCH_STORAGE(dt, T, ...)                             \
    do {                                                       \
        switch (dt) {                                          \
        case DT_F32: { typedef float T; __VA_ARGS__; } break;  \
        case DT_F16: { typedef F16 T; __VA_ARGS__; } break;    \
        default: { typedef BF16 T; __VA_ARGS__; } break;       \
        }                                                      \
    } while (0)

// Accessors of W consecutive channels at element i of a tensor, so that one
// kernel source serves both kinds: AnyIO (W = 1, run-time storage type) for
// the generic kernels, VecIO<T> (W = Vec<T>::N, one 16-byte access) for the
// vector ones. Values are fp32; a store rounds once to the storage type.
struct AnyIO {
    static constexpr int W = 1;
    void *p; DType dt;
    static AnyIO of(Tensor t) { return {t.data, t.dtype}; }
    __device__ void load(uint32_t i, float *v) const { v[0] = ld(p, dt, i); }
    __device__ void store(uint32_t i, const float *v) const { st(p, dt, i, v[0]); }
};
template <class T, int BYTES = VEC_BYTES> struct VecIO {
    static constexpr int W = BYTES / sizeof(T);
    T *p;
    static VecIO of(Tensor t) { return {(T *)t.data}; }
    __device__ void load(uint32_t i, float *v) const {
        const VecB<T, BYTES> x = load_vec<T, BYTES>(p + i);
        for (int k = 0; k < W; k++) v[k] = to_f32(x.v[k]);
    }
    __device__ void store(uint32_t i, const float *v) const {
        VecB<T, BYTES> x;
        for (int k = 0; k < W; k++) x.v[k] = from_f32<T>(v[k]);
        store_vec(p + i, x);
    }
};
// 4 channels of any storage type (16 bytes of fp32, 8 of fp16/bf16)
template <class T> using NarrowIO = VecIO<T, NARROW_BYTES<T>>;

// row × channel kernels: the thread layout of the elementwise channel ops
//   block (TX channel lanes, TY rows), grid (channel tiles, row blocks[, images])
// and the host's loop over launches of fewer than LAUNCH_MAX_ELEMENTS elements

struct RowGrid { dim3 grid, block; };
// lanes channel lanes (channels, or channel vectors), rows rows per launch; z images
static RowGrid row_grid(int lanes, size_t rows, unsigned z = 1) {
    const unsigned tx = lanes < WARP_SIZE ? (unsigned)lanes : WARP_SIZE, ty = BLOCK / tx;
    // grid-stride beyond: enough blocks for a GPU
    const size_t by = balanced_blocks(
            (rows + ty - 1) / ty,
            GRID_STRIDE_BLOCKS / (z < GRID_STRIDE_BLOCKS ? z : GRID_STRIDE_BLOCKS) + 1);
    RowGrid g = {dim3((lanes + tx - 1) / tx, (unsigned)by, z), dim3(tx, ty)};
    return g;
}
// Whether a row kernel's grid of 16-byte lanes holds fewer warps than
// FEW_WAVES full waves of a 132-SM GPU at 64 warps an SM: then lanes of 4
// channels (8 bytes of fp16/bf16; NarrowIO) give it twice the threads, and
// more waves to even out its tail
#define FEW_WAVES 4
#define SM_WARPS 64  // resident warps an SM holds at most (sm_80 to sm_90)
int cuda_narrow_rows = 1;  // segnet.h
static bool few_warps(const RowGrid &g) {
    if (!cuda_narrow_rows) return false;
    const size_t warps = (size_t)g.grid.x * g.grid.y * g.grid.z *
                         ((g.block.x * g.block.y + WARP_SIZE - 1) / WARP_SIZE);
    return warps < (size_t)FEW_WAVES * WAVE_SMS * SM_WARPS;
}
// run(grid, std::integral_constant<int, BYTES>) for a row kernel of lanes of C
// channels of T: 16-byte lanes, or NARROW_BYTES<T> ones where those leave few warps
template <class T, class Run> static void with_lane_bytes(int C, size_t rows, unsigned z, Run run) {
    const RowGrid g = row_grid(C / Vec<T>::N, rows, z);
    if (few_warps(g))
        run(row_grid(C / NARROW_CHANNELS, rows, z), std::integral_constant<int, NARROW_BYTES<T>>{});
    else
        run(g, std::integral_constant<int, VEC_BYTES>{});
}
// rows [r0, r0 + count) per launch, count·C < LAUNCH_MAX_ELEMENTS
template <class L> static void for_row_launches(size_t rows, int C, L launch) {
    size_t per = LAUNCH_MAX_ELEMENTS / (C > 0 ? (size_t)C : 1);
    if (per < 1) per = 1;
    for (size_t r0 = 0; r0 < rows; r0 += per) launch(r0, rows - r0 < per ? rows - r0 : per);
}
// io[i..i+W) (=|+=) v: the old value plus v when accumulating (the CPU's st_acc)
template <class IO>
static __device__ void store_acc(const IO &io, uint32_t i, float *v, int accumulate) {
    if (accumulate) {
        float old[IO::W];
        io.load(i, old);
        for (int k = 0; k < IO::W; k++) v[k] = old[k] + v[k];
    }
    io.store(i, v);
}
#define FOR_ROWS(r, rows)                                                                      \
    for (uint32_t r = blockIdx.y * blockDim.y + threadIdx.y; r < (uint32_t)(rows);              \
         r += blockDim.y * gridDim.y)

// Bytes a thread keeps in flight in a row loop: by Little's law an SM streams
// (bytes in flight) / (load latency), and an H200's 4.8 TB/s over 132 SMs at
// ~1 µs of latency wants >= 32 KB in flight per SM; MEMORY_BOUND_BLOCKS blocks
// of BLOCK threads hold 1024 threads, so 32 bytes a thread. A GPU issues in
// order: a row's first use of its loads waits for them, so a loop that loads
// a row and then uses it has one row's bytes in flight (make inflight reads
// them from the SASS).
#define THREAD_BYTES_IN_FLIGHT 32
// rows a loop loads ahead when a row's loads are `bytes`, rounded up
static constexpr __host__ __device__ int rows_ahead(int bytes) {
    return bytes >= THREAD_BYTES_IN_FLIGHT ? 1
                                           : (THREAD_BYTES_IN_FLIGHT + bytes - 1) / bytes;
}
// The loop over rows r, r + step, ... < end that does work(r, load(r)) row by
// row, with U rows' loads issued before the first of them is used: load(r)
// gives row r's loaded values, work(r, values) does the rest, in the rows'
// order, so the results are those of the loop a row at a time. A row's stores
// go to its own elements, which no other row's loads read.
template <int U, class Load, class Work>
static __device__ __forceinline__ void rows_loop_ahead(uint32_t r, uint32_t end, uint32_t step,
                                                       Load load, Work work) {
    if constexpr (U > 1) for (; r < end && end - r > (U - 1) * step; r += U * step) {
        decltype(load(r)) v[U];
#pragma unroll
        for (int u = 0; u < U; u++) v[u] = load(r + u * step);
#pragma unroll
        for (int u = 0; u < U; u++) work(r + u * step, v[u]);
    }
    for (; r < end; r += step) work(r, load(r));
}
// FOR_ROWS's loop so
template <int U, class Load, class Work>
static __device__ __forceinline__ void for_rows_ahead(uint32_t rows, Load load, Work work) {
    rows_loop_ahead<U>(blockIdx.y * blockDim.y + threadIdx.y, rows, blockDim.y * gridDim.y, load,
                       work);
}

// ----------------------------------------------------------------------------
// memory: device allocations, copies between host and device

// The backend counts the bytes it hands out (live and peak, as the CPU backend
// does): segnet bench reports the peak as peak_device_bytes.
size_t cuda_bytes_live, cuda_bytes_peak;
// live allocations (every device): their sizes
static std::unordered_map<void *, size_t> cuda_alloc_sizes;
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
        if (it != cuda_alloc_sizes.end()) {
            cuda_bytes_live -= it->second;
            cuda_alloc_sizes.erase(it);
        }
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
static void *cuda_host_alloc(Ops *o, size_t bytes) {
    ctx_of(o);
    void *p = NULL;
    if (cudaMallocHost(&p, bytes ? bytes : 1) != cudaSuccess) {
        cudaGetLastError();
        return NULL;
    }
    return p;
}
static void cuda_host_free(Ops *o, void *p) {
    if (!p) return;
    ctx_of(o);
    cudaCheck(cudaFreeHost(p));
}
static void cuda_upload_async(Ops *o, void *dst, const void *pinned_src, size_t bytes) {
    cudaCheck(cudaMemcpyAsync(dst, pinned_src, bytes, cudaMemcpyHostToDevice, stream_of(o)));
}

// A recorded step is a CUDA graph captured from the context's stream. Not
// with SEGNET_CUDA_SYNC (its synchronisations cannot be captured).
static int cuda_capture_begin(Ops *o) {
    CudaCtx *ctx = ctx_of(o);
    if (ctx->sync_each) return -1;
    cudaCheck(cudaStreamBeginCapture(ctx->stream, cudaStreamCaptureModeGlobal));
    return 0;
}
static void *cuda_capture_end(Ops *o, char *err) {
    CudaCtx *ctx = ctx_of(o);
    cudaGraph_t graph = NULL;
    cudaGraphExec_t exec = NULL;
    cudaError_t e = cudaStreamEndCapture(ctx->stream, &graph);
    if (e == cudaSuccess) e = cudaGraphInstantiate(&exec, graph, 0);
    if (graph) cudaGraphDestroy(graph);
    if (e != cudaSuccess) {
        snprintf(err, SN_ERR_MAX, "CUDA graph capture: %s", cudaGetErrorString(e));
        cudaGetLastError();
        return NULL;
    }
    return exec;
}
static void cuda_replay(Ops *o, void *record) {
    cudaCheck(cudaGraphLaunch((cudaGraphExec_t)record, stream_of(o)));
}
static void cuda_record_free(Ops *o, void *record) {
    ctx_of(o);
    cudaCheck(cudaGraphExecDestroy((cudaGraphExec_t)record));
}

// ----------------------------------------------------------------------------
// utilities over whole buffers
//
// Elementwise ops are one of two map kernels with a functor f(a, b) of the
// elements of up to two inputs (0 where an input is absent):
//   y[i] (=|+=) f(x0[i], x1[i])
// A kernel walks its n elements in chunks of LAUNCH_MAX_ELEMENTS (64-bit
// offsets between chunks, 32-bit indices inside), grid-stride within each; a
// vector kernel walks its vectors of N elements in chunks of
// LAUNCH_MAX_ELEMENTS / N, so that a vector's first element, vec_elem, is a
// 32-bit index too.

#define FOR_CHUNKS_OF(n, per, base, m)                                                         \
    for (size_t base = 0, m; base < (n) && ((m = (n) - base < (per) ? (n) - base : (per)), 1); \
         base += (per))
#define FOR_CHUNKS(n, base, m) FOR_CHUNKS_OF(n, LAUNCH_MAX_ELEMENTS, base, m)
#define FOR_VEC_CHUNKS(n_vec, N, base, m) FOR_CHUNKS_OF(n_vec, LAUNCH_MAX_ELEMENTS / (N), base, m)
// i·N, the first element of vector i of a chunk; the emulator stops a kernel
// whose index would reach LAUNCH_MAX_ELEMENTS (past 32 bits at full size)
template <int N> static __device__ __forceinline__ uint32_t vec_elem(uint32_t i) {
#if !defined(__CUDACC__)
    cuemu::check_index("a vector's first element", (uint64_t)i * N, LAUNCH_MAX_ELEMENTS);
#endif
    return i * N;
}
#define FOR_GRID(i, m)                                                                         \
    for (uint32_t i = blockIdx.x * blockDim.x + threadIdx.x; i < (uint32_t)(m);                 \
         i += blockDim.x * gridDim.x)

template <class F>
__global__ void map_kernel(void *y, DType dty, const void *x0, DType dt0, const void *x1, DType dt1,
                           size_t n, int accumulate, F f) {
    FOR_CHUNKS(n, base, m) {
        void *yc = elem_ptr(y, dty, base);
        const void *a = x0 ? elem_ptr(x0, dt0, base) : NULL,
                   *b = x1 ? elem_ptr(x1, dt1, base) : NULL;
        FOR_GRID(i, m) {
            float v = f(a ? ld(a, dt0, i) : 0.0f, b ? ld(b, dt1, i) : 0.0f);
            st(yc, dty, i, accumulate ? ld(yc, dty, i) + v : v);
        }
    }
}
template <class T, class F>
__global__ void map_vec_kernel(T *y, const T *x0, const T *x1, size_t n_vec, int accumulate, F f) {
    constexpr int N = Vec<T>::N;
    FOR_VEC_CHUNKS(n_vec, N, base, m) {
        T *yc = y + base * N;
        const T *a = x0 ? x0 + base * N : NULL, *b = x1 ? x1 + base * N : NULL;
        FOR_GRID(i, m) {
            const uint32_t e = vec_elem<N>(i);
            Vec<T> va, vb, vy;
            if (a) va = load_vec(a + e);
            if (b) vb = load_vec(b + e);
            if (accumulate) vy = load_vec(yc + e);
            for (int k = 0; k < N; k++) {
                float v = f(a ? to_f32(va.v[k]) : 0.0f, b ? to_f32(vb.v[k]) : 0.0f);
                vy.v[k] = from_f32<T>(accumulate ? to_f32(vy.v[k]) + v : v);
            }
            store_vec(yc + e, vy);
        }
    }
}
// y (=|+=) f(x0, x1) over y's elements; x0, x1 NULL data: absent
template <class F> static void map_op(Ops *o, Tensor y, Tensor x0, Tensor x1, int accumulate, F f) {
    const size_t n = shape_numel(y.shape);
    if (!n || !y.data) return;
    const Traffic t = moves(bytes_of(n, y.dtype) + (x0.data ? bytes_of(n, x0.dtype) : 0.0) +
                            (x1.data ? bytes_of(n, x1.dtype) : 0.0));
    if (vec_ok({y.dtype, x0.data ? x0.dtype : y.dtype, x1.data ? x1.dtype : y.dtype}, n,
               {y.data, x0.data, x1.data})) {
        SWITCH_STORAGE(y.dtype, T, {
            const size_t n_vec = n / Vec<T>::N;
            CU_LAUNCH((map_vec_kernel<T, F>), grid_for(n_vec), BLOCK, 0, stream_of(o), t,
                      (T *)y.data, (const T *)x0.data, (const T *)x1.data, n_vec, accumulate, f);
        });
    } else {
        CU_LAUNCH(map_kernel<F>, grid_for(n), BLOCK, 0, stream_of(o), t, y.data, y.dtype, x0.data,
                  x0.dtype, x1.data, x1.dtype, n, accumulate, f);
    }
    launchCheck();
}
static const Tensor NO_TENSOR = {NULL, {0, 0, 0, 0}, DT_F32};

struct Constant { float value; __device__ float operator()(float, float) const { return value; } };
struct Identity { __device__ float operator()(float a, float) const { return a; } };
struct Scale { float a; __device__ float operator()(float x, float) const { return a * x; } };
struct Axpb { float a, b; __device__ float operator()(float x, float) const { return a * x + b; } };
struct Sum2 { __device__ float operator()(float a, float b) const { return a + b; } };
struct ActForward {
    Act act;
    __device__ float operator()(float x, float) const { return act_apply(act, x); }
};
struct ActBackward {  // a = dy, b = x
    Act act;
    __device__ float operator()(float dy, float x) const { return dy * act_grad(act, x); }
};

static void fill_cuda(Ops *o, Tensor t, float value) {
    map_op(o, t, NO_TENSOR, NO_TENSOR, 0, Constant{value});
}
// dst (=|+=) src, casting between storage types; += adds in fp32 and rounds once
static void copy_cuda(Ops *o, Tensor dst, Tensor src, int accumulate) {
    map_op(o, dst, src, NO_TENSOR, accumulate, Identity{});
}
// t *= a
static void scale_cuda(Ops *o, Tensor t, float a) { map_op(o, t, t, NO_TENSOR, 0, Scale{a}); }
// y (=|+=) a·x + b
static void axpby_cuda(Ops *o, Tensor y, Tensor x, float a, float b, int accumulate) {
    map_op(o, tensor(y.data, x.shape, y.dtype), x, NO_TENSOR, accumulate, Axpb{a, b});
}

// A value another block wrote before it counted itself in last_block: read
// past this SM's L1 (ld.global.cg, from L2, where the writer's fence put it),
// which a plain load does not promise; the one way a last block reads the
// group's partials (last_block_reads_past_l1 checks kernels.cu for it). The
// emulator checks each such read: in a block counted last, after the counting
// thread's fence (cuemu::read_other_blocks); its race checker reports a plain
// read of another block's write.
template <class T> static __device__ __forceinline__ T from_other_blocks(const T *p) {
#if defined(__CUDACC__)
    return __ldcg(p);
#else
    T v;
    cuemu::read_other_blocks(&v, p, sizeof v);
    return v;
#endif
}

// The last block pattern (CUDA Programming Guide, "Memory Fence Functions"):
// every block of a group writes its partial results, fences them, and counts
// itself in *count; true in every thread of the block that counts last, which
// then adds the group's partials (in a fixed order, reading them past L1:
// other SMs wrote them) and sets *count back to 0 for the next launch or
// graph replay. Called by every thread of the block. The two fences make the
// count a release (the writers' fence before it) and an acquire (the last
// block's fence after it, which the barrier passes on to its threads), as the
// PTX memory model asks of relaxed atomics; the emulator checks both
// (cuemu::last_block_arrive, cuemu::read_other_blocks).
static __device__ bool last_block(unsigned *count, unsigned blocks) {
    CU_SHARED(bool, last, );
    __threadfence();  // this thread's partials are visible to every block before the count says so
    __syncthreads();
    if (threadIdx.x == 0 && threadIdx.y == 0) {
#if !defined(__CUDACC__)
        cuemu::last_block_arrive();
#endif
        last = atomicAdd(count, 1u) == blocks - 1;
#if !defined(__CUDACC__)
        cuemu::last_block_counted(last);
#endif
        if (last) {
            __threadfence();  // the others' partials are read after their counts
            atomicExch(count, 0u);
        }
    }
    __syncthreads();
    return last;
}

// ---- deterministic reductions: each block sums a fixed set of elements
// (grid-stride over a grid that depends only on n) in fp64 and reduces them in
// a fixed tree; the last block to finish adds the blocks' partials in block
// order. The same input gives the same bits on any GPU, run to run.

static unsigned reduce_grid(size_t n) {
    return (unsigned)balanced_blocks((n + BLOCK - 1) / BLOCK, REDUCE_BLOCKS_MAX);
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

// Where a reduction's sums go: each block's `width` sums (sh[0..width-1] after
// block_sum_tree) into partials[block], then the last block adds them:
// out[j] (=|+=) (float)Σ_b partials[b][j], thread t taking blocks t, t + BLOCK,
// ..., then the same tree. Called by every thread of every block.
struct ReduceOut { double *partials; unsigned *done; float *out; int width, accumulate; };
static ReduceOut reduce_out(Ops *o, float *out, int width, int accumulate) {
    return {ctx_of(o)->reduce_partials, ctx_of(o)->sums_done, out, width, accumulate};
}
static __device__ void reduce_finish(const ReduceOut &r, double *sh) {
    if (threadIdx.x == 0)
        for (int j = 0; j < r.width; j++) r.partials[blockIdx.x * REDUCE_WIDTH + j] = sh[j];
    if (!last_block(r.done, gridDim.x)) return;
    for (int j = 0; j < r.width; j++) {
        double s = 0.0;
        for (unsigned b = threadIdx.x; b < gridDim.x; b += BLOCK)
            s += from_other_blocks(&r.partials[b * REDUCE_WIDTH + j]);
        sh[threadIdx.x * REDUCE_WIDTH + j] = s;
    }
    block_sum_tree(sh, r.width);
    if (threadIdx.x == 0)
        for (int j = 0; j < r.width; j++)
            r.out[j] = r.accumulate ? r.out[j] + (float)sh[j] : (float)sh[j];
}

// *out = Σ t², accumulated in fp64 (as on the CPU), rounded once to fp32
__global__ void sum_squares_kernel(const void *t, DType dt, size_t n, ReduceOut r) {
    CU_SHARED(double, sh, [BLOCK * REDUCE_WIDTH]);
    double s = 0.0;
    FOR_CHUNKS(n, base, m) {
        const void *tc = elem_ptr(t, dt, base);
        FOR_GRID(i, m) {
            double v = ld(tc, dt, i);
            s += v * v;
        }
    }
    sh[threadIdx.x * REDUCE_WIDTH] = s;
    block_sum_tree(sh, 1);
    reduce_finish(r, sh);
}
template <class T> __global__ void sum_squares_vec_kernel(const T *t, size_t n_vec, ReduceOut r) {
    CU_SHARED(double, sh, [BLOCK * REDUCE_WIDTH]);
    constexpr int N = Vec<T>::N;
    double s = 0.0;
    FOR_CHUNKS(n_vec, base, m) {
        FOR_GRID(i, m) {
            Vec<T> v = load_vec(t + (base + i) * N);
            for (int k = 0; k < N; k++) {
                double x = to_f32(v.v[k]);
                s += x * x;
            }
        }
    }
    sh[threadIdx.x * REDUCE_WIDTH] = s;
    block_sum_tree(sh, 1);
    reduce_finish(r, sh);
}
static void sum_squares_cuda(Ops *o, Tensor t, float *out) {
    size_t n = shape_numel(t.shape);
    const ReduceOut r = reduce_out(o, out, 1, 0);
    if (vec_ok({t.dtype}, n, {t.data})) {
        SWITCH_STORAGE(t.dtype, T, {
            CU_LAUNCH(sum_squares_vec_kernel<T>, reduce_grid(n / Vec<T>::N), BLOCK, 0, stream_of(o),
                      moves(bytes_of(t)), (const T *)t.data, n / Vec<T>::N, r);
        });
    } else {
        CU_LAUNCH(sum_squares_kernel, reduce_grid(n), BLOCK, 0, stream_of(o), moves(bytes_of(t)),
                  t.data, t.dtype, n, r);
    }
    launchCheck();
}

// *flag = 1 if any element is inf or NaN; untouched otherwise (so one flag can
// collect the checks of several tensors)
__global__ void nonfinite_kernel(const void *t, DType dt, size_t n, int32_t *flag) {
    FOR_CHUNKS(n, base, m) {
        const void *tc = elem_ptr(t, dt, base);
        FOR_GRID(i, m) if (!isfinite(ld(tc, dt, i))) atomicExch((int *)flag, 1);
    }
}
template <class T> __global__ void nonfinite_vec_kernel(const T *t, size_t n_vec, int32_t *flag) {
    constexpr int N = Vec<T>::N;
    FOR_CHUNKS(n_vec, base, m) {
        FOR_GRID(i, m) {
            Vec<T> v = load_vec(t + (base + i) * N);
            bool bad = false;
            for (int k = 0; k < N; k++) bad |= !isfinite(to_f32(v.v[k]));
            if (bad) atomicExch((int *)flag, 1);
        }
    }
}
static void nonfinite_cuda(Ops *o, Tensor t, int32_t *flag) {
    size_t n = shape_numel(t.shape);
    if (!n) return;
    if (vec_ok({t.dtype}, n, {t.data})) {
        SWITCH_STORAGE(t.dtype, T, {
            CU_LAUNCH(nonfinite_vec_kernel<T>, grid_for(n / Vec<T>::N), BLOCK, 0, stream_of(o),
                      moves(bytes_of(t)), (const T *)t.data, n / Vec<T>::N, flag);
        });
    } else {
        CU_LAUNCH(nonfinite_kernel, grid_for(n), BLOCK, 0, stream_of(o), moves(bytes_of(t)), t.data,
                  t.dtype, n, flag);
    }
    launchCheck();
}

// ----------------------------------------------------------------------------
// per-channel sums over rows: batch norm statistics and gradient sums,
// squeeze-excitation pooling and scale gradient
//
//   out[g][c][q] = Σ_{r < rows} f(row g·rows + r, channel c)[q]
// for G groups of `rows` rows of C channels (batch norm: G = 1, rows = N·H·W;
// squeeze-excitation: G = N, rows = H·W) and NQ quantities at once, summed in
// fp64 in an order fixed by the shape alone (deterministic on any GPU):
//   block: TX channel lanes (threadIdx.x; 1 channel each in the generic kernel,
//          a Vec of N in the vector kernel) × TY row lanes, BLOCK threads
//   grid:  (channel tiles, row chunks, G)
//   a thread sums rows r0 + lane, r0 + lane + TY, ... of its chunk in order,
//   the lanes are added in lane order, and the chunks' partial sums (in the
//   context's scratch) by the block of the (channel tile, g) that finishes
//   last (last_block), summing chunks lane, lane + TY, ... and the lanes in
//   lane order. The order depends on the shape only, so the sums are
//   deterministic; which block finishes last does not matter. One launch.
// The callers are functors. F::Lane is a thread's view of its channels,
// made once (per-channel constants in registers): lane(row, k, v) gives the NQ
// values of channel c0 + k of a row (the generic kernel: k = 0 only). E(g, c, s)
// consumes the NQ sums of channel c.

#define SUMS_MIN_ROWS 32      // rows per chunk at least
// chunks per (channel tile, group) at most: enough blocks to fill a GPU
#define SUMS_MAX_CHUNKS 1024
// The scratch of partial sums, (G, chunks, NQ, C) fp64: its size bounds the chunk
// count (chunks ≤ SUMS_SCRATCH/(G·NQ·C), at least 1, which needs no scratch); it
// never limits the shapes an op accepts.
#define SUMS_SCRATCH ((size_t)1 << 20)  // doubles (8 MiB)
// (SUMS_COUNTERS, at the context: a launch with more tiles × groups runs one chunk)

// whether lane L splits its rows' loads from their adds (has L::Row): sum_rows
template <class L, class = void> struct SplitLoads : std::false_type {};
template <class L> struct SplitLoads<L, std::void_t<typename L::Row>> : std::true_type {};

// a thread's rows of its chunk: r0 + lane, + TY, ... < r1
struct RowChunk { uint32_t r0, r1; };
static __device__ __forceinline__ RowChunk row_chunk(uint32_t rows, uint32_t rows_per_chunk) {
    const uint32_t r0 = blockIdx.y * rows_per_chunk;
    return {r0, r0 + rows_per_chunk < rows ? r0 + rows_per_chunk : rows};
}
// lane sums (TY, TX·W, NQ) in shared memory → lane 0's totals, added in lane order
template <int NQ, int W>
static __device__ __forceinline__ void sum_lanes(double *sh, const double (&acc)[W][NQ],
                                                 double (&s)[W][NQ]) {
    const int TX = blockDim.x, TY = blockDim.y;
    for (int k = 0; k < W; k++)
        for (int q = 0; q < NQ; q++)
            sh[((threadIdx.y * TX + threadIdx.x) * W + k) * NQ + q] = acc[k][q];
    __syncthreads();
    if (threadIdx.y != 0) return;
    for (int k = 0; k < W; k++)
        for (int q = 0; q < NQ; q++) {
            s[k][q] = 0.0;
            for (int l = 0; l < TY; l++) s[k][q] += sh[((l * TX + threadIdx.x) * W + k) * NQ + q];
        }
}
// A thread's rows r0 + lane, + TY, ... < r1 added into acc in that order.
// The textbook loop, a row at a time (the lanes that add(r, acc), the generic ones):
// each iteration waits for its own load, so a thread has one load in flight.
template <class L, class A>
static __device__ __forceinline__ void sum_rows(const L &lane, RowChunk rc, A &acc,
                                                std::false_type) {
    for (uint32_t r = rc.r0 + threadIdx.y; r < rc.r1; r += blockDim.y) lane.add(r, acc);
}
// The fast version of the loop above, for lanes that split a row into its loads
// (Row load(r)) and the rest (add(r, row, acc): arithmetic, stores, the fp64
// adds): L::UNROLL rows' loads ahead (rows_loop_ahead), the rows added in the
// same order as above, so the sums are bit-identical. The rows' stores
// (BnPoolVec, ScaleGradVec, DyResidual) go to rows of their own.
template <class L, class A>
static __device__ __forceinline__ void sum_rows(const L &lane, RowChunk rc, A &acc,
                                                std::true_type) {
    rows_loop_ahead<L::UNROLL>(
            rc.r0 + threadIdx.y, rc.r1, blockDim.y, [&](uint32_t r) { return lane.load(r); },
            [&](uint32_t r, const typename L::Row &row) { lane.add(r, row, acc); });
}
// W channels per thread (1: generic, Vec<T>::N: vector); F::Lane knows its loads
template <int NQ, int W, class F, class E>
__global__ void MEMORY_BOUND channel_sums_kernel(F f, E e, double *partial, unsigned *done,
                                                 uint32_t rows, int C, uint32_t rows_per_chunk) {
    CU_SHARED(double, sh, [BLOCK * W * NQ]);
    const int lane_c = blockIdx.x * blockDim.x + threadIdx.x, c0 = lane_c * W, g = blockIdx.z;
    const uint32_t chunks = gridDim.y;
    const RowChunk rc = row_chunk(rows, rows_per_chunk);
    double acc[W][NQ];
    for (int k = 0; k < W; k++)
        for (int q = 0; q < NQ; q++) acc[k][q] = 0.0;
    if (c0 < C) sum_rows(f.lane(g, c0), rc, acc, SplitLoads<typename F::Lane>{});
    double s[W][NQ] = {};
    sum_lanes<NQ, W>(sh, acc, s);
    const bool owner = threadIdx.y == 0 && c0 < C;  // holds its channels' sums
    if (chunks > 1) {
        if (owner)
            for (int k = 0; k < W; k++)
                for (int q = 0; q < NQ; q++)
                    partial[(((size_t)g * chunks + blockIdx.y) * NQ + q) * C + c0 + k] = s[k][q];
        if (!last_block(done + (size_t)g * gridDim.x + blockIdx.x, chunks)) return;
        for (int k = 0; k < W; k++)
            for (int q = 0; q < NQ; q++) acc[k][q] = 0.0;
        if (c0 < C)
            for (uint32_t j = threadIdx.y; j < chunks; j += blockDim.y)
                for (int k = 0; k < W; k++)
                    for (int q = 0; q < NQ; q++)
                        acc[k][q] += from_other_blocks(
                                &partial[(((size_t)g * chunks + j) * NQ + q) * C + c0 + k]);
        __syncthreads();  // sh is read by sum_lanes above until here
        sum_lanes<NQ, W>(sh, acc, s);
    }
    if (owner)
        for (int k = 0; k < W; k++) e(g, c0 + k, s[k]);
}
// W: channels per thread; bytes: what f reads and writes (Traffic)
template <int NQ, int W, class F, class E>
static void channel_sums(Ops *o, F f, E e, int G, size_t rows, int C, double bytes) {
    // 32-bit row indices, 64-bit offsets
    require_below(rows, (size_t)1 << 32, "rows of per-channel sums");
    const int lanes = (C + W - 1) / W;  // channel lanes
    const unsigned tx = lanes < WARP_SIZE ? (unsigned)lanes : WARP_SIZE, ty = BLOCK / tx;
    size_t chunks = (rows + SUMS_MIN_ROWS - 1) / SUMS_MIN_ROWS;
    size_t fit = SUMS_SCRATCH / ((size_t)G * NQ * C);
    // more chunks than that when they fill the waves: a row a thread at least
    size_t hi = (rows + ty - 1) / ty;
    if (hi > SUMS_MAX_CHUNKS) hi = SUMS_MAX_CHUNKS;
    if (hi > fit) hi = fit;
    if (chunks > hi) chunks = hi;
    const unsigned tiles = (lanes + tx - 1) / tx;
    auto whole = [&](size_t n) { return parts_of_whole_rows(rows, n); };
    if (chunks < 1 || (size_t)tiles * G > SUMS_COUNTERS) {
        chunks = 1;
    } else {
        chunks = wave_fill_parts((size_t)tiles * G, chunks, hi, MEMORY_BOUND_BLOCKS, whole);
    }
    const size_t rows_per_chunk = rows ? (rows + chunks - 1) / chunks : 1;
    chunks = whole(chunks);
    dim3 grid(tiles, (unsigned)chunks, G), block(tx, ty);
    CU_LAUNCH((channel_sums_kernel<NQ, W, F, E>), grid, block, 0, stream_of(o), moves(bytes), f, e,
              ctx_of(o)->sums, ctx_of(o)->sums_done, (uint32_t)rows, C, (uint32_t)rows_per_chunk);
    launchCheck();
}

// The summands. Each comes as a generic functor (run-time storage types, one
// channel per lane) and a vector one (storage type T, Vec<T>::N channels).
// Σ a, or Σ a·b (b NULL: Σ a); rows of group g start at element g·rows·C
struct SumOfProduct {
    const void *a; DType dta; const void *b; DType dtb; int C; uint32_t rows;
    struct Lane {
        const void *a, *b; DType dta, dtb; int C;
        __device__ void add(uint32_t r, double (&acc)[1][1]) const {
            const size_t i = (size_t)r * C;
            acc[0][0] += b ? (double)ld(a, dta, i) * ld(b, dtb, i) : (double)ld(a, dta, i);
        }
    };
    __device__ Lane lane(int g, int c) const {
        const size_t at = (size_t)g * rows * C + c;
        return {elem_ptr(a, dta, at), b ? elem_ptr(b, dtb, at) : NULL, dta, dtb, C};
    }
};
template <class T> struct SumOfProductVec {
    const T *a, *b; int C; uint32_t rows;
    static constexpr int N = Vec<T>::N;
    struct Lane {
        const T *a, *b; int C;
        static constexpr int UNROLL = rows_ahead(VEC_BYTES);  // b may be NULL
        struct Row { Vec<T> a, b; };
        __device__ Row load(uint32_t r) const {
            Row v;
            v.a = load_vec(a + (size_t)r * C);
            if (b) v.b = load_vec(b + (size_t)r * C);
            return v;
        }
        __device__ void add(uint32_t, const Row &v, double (&acc)[N][1]) const {
            for (int k = 0; k < N; k++)
                acc[k][0] += b ? (double)to_f32(v.a.v[k]) * to_f32(v.b.v[k])
                               : (double)to_f32(v.a.v[k]);
        }
    };
    __device__ Lane lane(int g, int c0) const {
        const size_t at = (size_t)g * rows * C + c0;
        return {a + at, b ? b + at : NULL, C};
    }
};
// Σx and Σx² (batch norm statistics in one pass)
struct Moments {
    const void *x; DType dt; int C;
    struct Lane {
        const void *x; DType dt; int C;
        __device__ void add(uint32_t r, double (&acc)[1][2]) const {
            double v = ld(x, dt, (size_t)r * C);
            acc[0][0] += v;
            acc[0][1] += v * v;
        }
    };
    __device__ Lane lane(int, int c) const { return {elem_ptr(x, dt, c), dt, C}; }
};
template <class T, int B = VEC_BYTES> struct MomentsVec {
    const T *x; int C;
    static constexpr int N = VecB<T, B>::N;
    struct Lane {
        const T *x; int C;
        static constexpr int UNROLL = rows_ahead(B);
        typedef VecB<T, B> Row;
        __device__ Row load(uint32_t r) const { return load_vec<T, B>(x + (size_t)r * C); }
        __device__ void add(uint32_t, const Row &v, double (&acc)[N][2]) const {
            for (int k = 0; k < N; k++) {
                double d = to_f32(v.v[k]);
                acc[k][0] += d;
                acc[k][1] += d * d;
            }
        }
    };
    __device__ Lane lane(int, int c0) const { return {x + c0, C}; }
};
// a conv's bias gradient: db[c] += Σ_{n,oy,ox} dout[n,oy,ox,c]
struct AddSum {
    float *dst;
    __device__ void operator()(int, int c, const double *s) const { dst[c] += (float)s[0]; }
};
static void bias_grad(Ops *o, float *db, Tensor dout) {
    const int C = dout.shape.c;
    const size_t M = shape_numel(dout.shape) / C;
    if (!M) return;
    if (vec_ok({dout.dtype}, C, {dout.data})) {
        SWITCH_STORAGE(dout.dtype, T, {
            channel_sums<1, Vec<T>::N>(
                    o, SumOfProductVec<T>{(const T *)dout.data, NULL, C, (uint32_t)M}, AddSum{db},
                    1, M, C, bytes_of(dout));
        });
    } else {
        channel_sums<1, 1>(o, SumOfProduct{dout.data, dout.dtype, NULL, dout.dtype, C, (uint32_t)M},
                           AddSum{db}, 1, M, C, bytes_of(dout));
    }
}

// the consumer: y (G,1,1,C) (=|+=) sum/divisor, in y's storage type
struct StoreSum {
    void *y; DType dt; int C; double divisor; int accumulate;
    __device__ void operator()(int g, int c, const double *s) const {
        uint32_t i = (uint32_t)g * C + c;
        float v = (float)(s[0] / divisor);
        st(y, dt, i, accumulate ? ld(y, dt, i) + v : v);
    }
};

// Σ a·b (or Σ a) per (g, c) of a, b (G, rows, C) into `out`
template <class E>
static void sums_of_product(Ops *o, E e, Tensor a, const Tensor *b, int G, size_t rows, int C) {
    const double bytes = bytes_of(a) + (b ? bytes_of(*b) : 0.0);
    if (vec_ok({a.dtype, b ? b->dtype : a.dtype}, C, {a.data, b ? b->data : NULL})) {
        SWITCH_STORAGE(a.dtype, T, {
            SumOfProductVec<T> f = {(const T *)a.data, b ? (const T *)b->data : NULL, C,
                                    (uint32_t)rows};
            channel_sums<1, Vec<T>::N>(o, f, e, G, rows, C, bytes);
        });
    } else {
        SumOfProduct f = {a.data, a.dtype,       b ? b->data : NULL, b ? b->dtype : DT_F32,
                          C,      (uint32_t)rows};
        channel_sums<1, 1>(o, f, e, G, rows, C, bytes);
    }
}

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

// y[n,oy,ox,c] = max_{dy,dx ∈ {0,1}} x[n, 2·oy + dy, 2·ox + dx, c]; ties and NaN
// as the CPU: the first maximum of the window in row-major order (strict >)
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
// implicit-GEMM convolution, fp16/bf16 on tensor cores
//
// The GEMMs of the im2col lowering above without the column buffer: the
// operand im2col would have copied is gathered straight from the tensor into
// shared memory. They replace im2col + cublasGemmEx (+ col2im) for 16-bit k×k
// convs; that path stays as the reference (SEGNET_CONV=gemm).
//
//   forward (conv_fwd_kernel), per group g, GEMM rows = output pixels p = (n, oy, ox):
//     out[p][g·Coutg + co] = Σ_k A[p][k] · W[g·Coutg + co][k] (+ b),
//     k = (ky, kx, ci), K = kh·kw·Cg
//     A[p][k] = x[n, oy·s - pt + ky, ox·s - pl + kx, g·Cg + ci]  (0 outside x)
//   backward data (conv_dgrad_kernel), GEMM rows = input pixels i = (n, iy, ix):
//     din[i][g·Cg + ci] (=|+=) Σ_{ky,kx,co} dout[n, oy, ox, g·Coutg + co]
//                                             · W[g·Coutg + co][ky, kx, ci]
//     over the taps with iy + pt - ky = oy·s (likewise x), 0 ≤ oy < OH. For s = 2 the
//     input pixels fall into s·s phases (iy % s, ix % s), and in a phase the taps
//     that reach an output are fixed: ky ≡ iy + pt (mod s). Each phase is a GEMM of
//     its own (a slice of the grid) over only its taps: no multiply by a zero tap,
//     no col2im. With iy = py + s·u and ky = ky0 + s·a, oy = u + dy0 - a, where
//     dy0 = (py + pt - ky0)/s: a gather from dout with the taps walked backwards.
// Both read their A operand the same way (Gather): rows of pixels of an NHWC
// tensor, columns k = (a, b, c), A[m][k] = src[n, y_m + dir·a, x_m + dir·b, c0 + c].
//
// Tiling: a block of 4 warps computes BM GEMM rows × BN channels of one group
// (and phase), IgTile: 128×64, 128×32 for narrow layers, 64×32 for small grids
// (ig_tile); warp w the WM×32 sub-tile at rows WM·(w % WARPS_M), channels
// 32·(w / WARPS_M) (64×32 in a 2×2 layout; 32×32 or 16×32 in a 4×1 one), as
// MI×4 mma.m16n8k16 tiles with fp32 accumulators in registers. Each output's
// sum runs over k in the same order whatever the tile: the same bits. K
// is walked IG_BK at a time through IG_STAGES shared-memory buffers that
// cp.async fills while the tensor cores work on an earlier one (ig_mainloop).
//   Loading A: thread t fills 16-byte chunk t%4 (8 consecutive k) of tile rows
//   t/4 + 32i; it decodes its pixels once and walks its k = (a, b, c) by adding
//   IG_BK (TapWalk: no division in the loop). A chunk is 8 channels of one tap
//   when the channel count is a multiple of 8 (one cp.async, zero-filled
//   outside the tensor); otherwise (the stem's 3 channels) 8 scalar loads.
//   Loading B: forward, rows of W (channel co, k-contiguous), like A; backward
//   data, rows k = (tap, co) of IG_BN consecutive ci (a row of W's [co][tap][ci]).
//   Shared memory: a tile row's 16-byte chunks are stored XOR-swizzled by the
//   row, so the 8 rows one ldmatrix reads lie in 8 different bank groups.
//   Fragments: ldmatrix.x4 gives an mma's A operand (16 rows × 16 k) or the B
//   operands of two 8-channel tiles (.trans for backward data's [k][ci] tile).
// Epilogue: the fp32 sum (+ b; + din when accumulating) rounded once to the
// storage type, as the CPU op. Every sum runs in an order fixed by the tile
// shapes: deterministic.

#define IG_BM 128
#define IG_BM_SMALL 64
#define IG_BN 64
#define IG_BN_NARROW 32
#define IG_BK 32
#define IG_STAGES 3
#define IG_THREADS 128
#define IG_MAX_PHASES 4  // backward data: stride ≤ 2 (larger strides take the reference path)
// a block tile of BM rows × BN channels: the warps' layout, MI 16-row mma tiles
// a warp, and a shared-memory stage (the A tile, then the B tile: BN×IG_BK or IG_BK×BN)
template <int BM_, int BN_> struct IgTile {
    static constexpr int BM = BM_, BN = BN_, WARPS_N = BN / 32,
                         WARPS_M = IG_THREADS / WARP_SIZE / WARPS_N, WM = BM / WARPS_M,
                         MI = WM / 16, STAGE_ELEMS = (BM + BN) * IG_BK;
    static_assert(WARPS_N * 32 == BN && WM * WARPS_M == BM && MI * 16 == WM, "tile shape");
};
typedef IgTile<IG_BM, IG_BN> IgWide;
typedef IgTile<IG_BM, IG_BN_NARROW> IgNarrow;
typedef IgTile<IG_BM_SMALL, IG_BN_NARROW> IgSmall;  // grids too small for the others
// The resident blocks per SM of the 16-bit kernels as built for sm_90
// (kernel_resources.txt; test cuda_conv_tiles), by their registers a thread:
// wide 124-128; narrow, the vector kernels (16-byte chunks) 96 (forward) and
// 71-72 (backward data, weight gradient), the others 79, 96, 76; small (no
// weight gradient), the vector kernels 64 and 56, the others 56 and 64
enum { IG_FWD, IG_DGRAD, IG_WGRAD };
static int ig_blocks_per_sm(int tile, int pass, bool vec) {
    static const int narrow[2][3] = {{6, 5, 6}, {5, 7, 7}}, small[2][3] = {{9, 8, 0}, {8, 9, 0}};
    return tile == IG_TILE_WIDE ? 4 : tile == IG_TILE_NARROW ? narrow[vec][pass] : small[vec][pass];
}

// A tile row holds ROW elements of type T, moved in 16-byte chunks of CE
// elements. Chunk c of row r is stored at chunk c ^ (r/2 % 4) in rows of 4
// chunks, c ^ (r % 8) in longer ones: the 8 rows an ldmatrix (or 8 threads of
// the SIMT product) read at one column lie in 8 different 16-byte bank groups.
template <class T> struct Chunk { static constexpr int CE = VEC_BYTES / sizeof(T); };
template <class T, int ROW> static __device__ __forceinline__ int ig_swizzle(int row, int chunk) {
    constexpr int chunks = ROW / Chunk<T>::CE;
    return row * ROW + (chunks == 4 ? chunk ^ ((row >> 1) & 3) : chunk ^ (row & 7)) * Chunk<T>::CE;
}
// element (row, col) of such a tile
template <class T, int ROW> static __device__ __forceinline__ int ig_at(int row, int col) {
    return ig_swizzle<T, ROW>(row, col / Chunk<T>::CE) + col % Chunk<T>::CE;
}

// The A operand of forward and backward data: src (H, W, C) NHWC, columns
// k = (a·taps_x + b)·Ck + c, K of them, A[m][k] = src[n, y_m + dir·a, x_m + dir·b, c0 + c] (0
// outside)
struct Gather { int H, W, C, taps_x, Ck, dir, K; };
// a thread's place in k = (a·taps_x + b)·Ck + c
struct TapWalk {
    int k, a, b, c;
    __device__ void advance(int by, int Ck, int taps_x) {
        k += by; c += by;
        while (c >= Ck) { c -= Ck; if (++b == taps_x) { b = 0; ++a; } }
    }
};
// Which rows and chunk of a [ROWS][ROW] tile a thread fills: chunk t % CPR of
// rows t / CPR + STEP·i, i < N (CPR chunks per row, STEP = threads / CPR)
template <class T, int ROW, int ROWS> struct TileFill {
    static constexpr int CPR = ROW / Chunk<T>::CE, STEP = IG_THREADS / CPR, N = ROWS / STEP;
    static __device__ int chunk() { return threadIdx.x % CPR; }
    static __device__ int row(int i) { return threadIdx.x / CPR + STEP * i; }
};
#define IG_ROW_NONE (INT_MIN / 2)  // a row past the GEMM's end: its taps are never inside

// the A tile [BM][IG_BK] of a Gather: rows y[i], x[i] (top-left tap), base[i] (src's offset of
// (n, 0, 0, c0))
template <class T, bool VEC, int BM, int N>
static __device__ __forceinline__ void load_a(T *As, const T *src, const Gather &gd,
                                              const int (&base)[N], const int (&y)[N],
                                              const int (&x)[N], const TapWalk &walk) {
    typedef TileFill<T, IG_BK, BM> F;
    const int chunk = F::chunk();
    if (VEC) {
        const bool k_in = walk.k < gd.K;
        #pragma unroll
        for (int i = 0; i < N; i++) {
            const int iy = y[i] + gd.dir * walk.a, ix = x[i] + gd.dir * walk.b;
            const bool in = k_in && (unsigned)iy < (unsigned)gd.H && (unsigned)ix < (unsigned)gd.W;
            cp_async16(As + ig_swizzle<T, IG_BK>(F::row(i), chunk),
                       in ? src + base[i] + (iy * gd.W + ix) * gd.C + walk.c : src, in ? 16 : 0);
        }
    } else {
        TapWalk e = walk;
        #pragma unroll
        for (int q = 0; q < Chunk<T>::CE; q++, e.advance(1, gd.Ck, gd.taps_x)) {
            const bool k_in = e.k < gd.K;
            #pragma unroll
            for (int i = 0; i < N; i++) {
                const int iy = y[i] + gd.dir * e.a, ix = x[i] + gd.dir * e.b;
                const bool in =
                        k_in && (unsigned)iy < (unsigned)gd.H && (unsigned)ix < (unsigned)gd.W;
                As[ig_swizzle<T, IG_BK>(F::row(i), chunk) + q] =
                        in ? src[base[i] + (iy * gd.W + ix) * gd.C + e.c] : T{0};
            }
        }
    }
}

// where accumulator r of the warp's tile (i, j) lies in the block's tile: row
// wm + TC_M·i + tc_acc_row(r), column wn + TC_N·j + tc_acc_col(r), with the warp's corner
// (wm, wn) = (WM·(warp % WARPS_M), 32·(warp / WARPS_M))
template <class Tile> static __device__ __forceinline__ unsigned ig_warp_row() {
    return threadIdx.x / WARP_SIZE % Tile::WARPS_M * Tile::WM;
}
template <class Tile> static __device__ __forceinline__ unsigned ig_warp_col() {
    return threadIdx.x / WARP_SIZE / Tile::WARPS_M * 32;
}
template <class Tile> static __device__ __forceinline__ int ig_acc_row(int i, int r) {
    return ig_warp_row<Tile>() + TC_M * i + tc_acc_row(r);
}
template <class Tile> static __device__ __forceinline__ int ig_acc_col(int j, int r) {
    return ig_warp_col<Tile>() + TC_N * j + tc_acc_col(r);
}
// a thread's accumulators: (MI, 4 column tiles, 4)
template <class Tile> using IgAcc = float[Tile::MI][4][4];
// store(row, column, value) for each of the thread's accumulators, at its place in the block's tile
template <class Tile, class Store>
static __device__ __forceinline__ void ig_each_acc(const IgAcc<Tile> &acc, Store store) {
    #pragma unroll
    for (int i = 0; i < Tile::MI; i++)
        #pragma unroll
        for (int j = 0; j < 4; j++)
            #pragma unroll
            for (int r = 0; r < 4; r++)
                store(ig_acc_row<Tile>(i, r), ig_acc_col<Tile>(j, r), acc[i][j][r]);
}

// The K loop of the three kernels: acc[i][j] (the warp's 16×8 tile (i, j)) +=
// A·B over k_tiles tiles of IG_BK; load_stage(buf) issues the copies of the
// next tile into buffer buf. The A tile is [BM][IG_BK] (GEMM rows), or with
// A_TRANS [IG_BK][BM] (reduction rows); the B tile [BN][IG_BK] (channel
// rows), or with B_TRANS [IG_BK][BN]. fp16/bf16: ldmatrix and mma.sync;
// fp32: the same accumulators by a SIMT product (each thread its own 64
// elements, k in order, exact fp32 arithmetic).
template <class T, bool A_TRANS, bool B_TRANS, class Tile, class LoadStage>
static __device__ __forceinline__ void ig_mainloop(IgAcc<Tile> &acc, T *smem, int k_tiles,
                                                   LoadStage load_stage) {
    constexpr int MI = Tile::MI, BM = Tile::BM, BN = Tile::BN;
    const int wm = ig_warp_row<Tile>(), wn = ig_warp_col<Tile>();
    #pragma unroll
    for (int i = 0; i < MI; i++)
        #pragma unroll
        for (int j = 0; j < 4; j++)
            #pragma unroll
            for (int r = 0; r < 4; r++) acc[i][j][r] = 0.0f;
    // one commit per stage, loaded or not: the group count stays fixed
    #pragma unroll
    for (int s = 0; s < IG_STAGES - 1; s++) {
        if (s < k_tiles) load_stage(s);
        cp_async_commit();
    }
    for (int kt = 0; kt < k_tiles; kt++) {
        cp_async_wait<IG_STAGES - 2>();  // this thread's copies of tile kt are in...
        __syncthreads();                  // ...and everybody's; tile kt-1's buffer is free
        if (kt + IG_STAGES - 1 < k_tiles) load_stage((kt + IG_STAGES - 1) % IG_STAGES);
        cp_async_commit();
        const T *As = smem + (kt % IG_STAGES) * Tile::STAGE_ELEMS, *Bs = As + BM * IG_BK;
        if constexpr (sizeof(T) == 4) {
            #pragma unroll 4
            for (int k = 0; k < IG_BK; k++) {
                float a[MI][2], b[4][2];
                #pragma unroll
                for (int i = 0; i < MI; i++)
                    #pragma unroll
                    for (int h = 0; h < 2; h++) {
                        const int m = ig_acc_row<Tile>(i, 2 * h);
                        a[i][h] = to_f32(A_TRANS ? As[ig_at<T, BM>(k, m)]
                                                 : As[ig_at<T, IG_BK>(m, k)]);
                    }
                #pragma unroll
                for (int j = 0; j < 4; j++)
                    #pragma unroll
                    for (int e = 0; e < 2; e++) {
                        const int n = ig_acc_col<Tile>(j, e);
                        b[j][e] = to_f32(B_TRANS ? Bs[ig_at<T, BN>(k, n)]
                                                 : Bs[ig_at<T, IG_BK>(n, k)]);
                    }
                #pragma unroll
                for (int i = 0; i < MI; i++)
                    #pragma unroll
                    for (int j = 0; j < 4; j++)
                        #pragma unroll
                        for (int r = 0; r < 4; r++) acc[i][j][r] += a[i][r >> 1] * b[j][r & 1];
            }
        } else {
            #pragma unroll
            for (int ks = 0; ks < IG_BK / TC_K; ks++) {
                uint32_t af[MI][4], bf[4][2];
                #pragma unroll
                for (int i = 0; i < MI; i++) {
                    const int m = wm + TC_M * i;  // the fragment's first GEMM row
                    tc_load_a<A_TRANS>(af[i], [&](int line, int chunk) {
                        return A_TRANS ? As + ig_swizzle<T, BM>(TC_K * ks + line, m / 8 + chunk)
                                       : As + ig_swizzle<T, IG_BK>(m + line, 2 * ks + chunk);
                    });
                }
                #pragma unroll
                for (int j = 0; j < 2; j++) {
                    const int n = wn + 2 * TC_N * j;  // the first of the two tiles' columns
                    tc_load_b2<B_TRANS>(bf[2 * j], bf[2 * j + 1], [&](int line, int chunk) {
                        return B_TRANS ? Bs + ig_swizzle<T, BN>(TC_K * ks + line, n / 8 + chunk)
                                       : Bs + ig_swizzle<T, IG_BK>(n + line, 2 * ks + chunk);
                    });
                }
                #pragma unroll
                for (int i = 0; i < MI; i++)
                    #pragma unroll
                    for (int j = 0; j < 4; j++) tc_mma<T>(acc[i][j], af[i], bf[j]);
            }
        }
    }
    cp_async_wait<0>();
}

struct ConvFwdArgs {
    Gather gd;                  // over x: (H, W, C), taps_x = kw, Ck = Cg, dir = +1, K = kh·kw·Cg
    int Cout, Cg, Coutg, stride, pt, pl;
    uint32_t M;                 // output pixels N·OH·OW
    FastDiv OW, OH;
};

template <class T, bool VEC, class Tile>
__global__ void __launch_bounds__(IG_THREADS)
        conv_fwd_kernel(T *y, const T *x, const T *w, const float *bias, ConvFwdArgs a) {
    constexpr int BM = Tile::BM, BN = Tile::BN;
    CU_DYN_SHARED(T, smem);  // IG_STAGES × (A: BM rows, B: BN rows) of IG_BK elements
    typedef TileFill<T, IG_BK, BM> FA;
    typedef TileFill<T, IG_BK, BN> FB;
    constexpr int CE = Chunk<T>::CE;
    const int g = blockIdx.z, m0 = blockIdx.x * BM, n0 = blockIdx.y * BN, K = a.gd.K;
    int base[FA::N], py[FA::N], px[FA::N];
    #pragma unroll
    for (int i = 0; i < FA::N; i++) {
        const uint32_t m = (uint32_t)(m0 + FA::row(i));
        const uint32_t t = fastdiv(a.OW, m), ox = m - t * a.OW.d, n = fastdiv(a.OH, t),
                       oy = t - n * a.OH.d;
        base[i] = (int)n * a.gd.H * a.gd.W * a.gd.C + g * a.Cg;
        py[i] = m < a.M ? (int)oy * a.stride - a.pt : IG_ROW_NONE;
        px[i] = (int)ox * a.stride - a.pl;
    }
    TapWalk walk = {0, 0, 0, 0};
    walk.advance(FA::chunk() * CE, a.gd.Ck, a.gd.taps_x);  // FB's chunk is the same column
    const T *wg = w + (size_t)g * a.Coutg * K;
    auto load_stage = [&](int buf) {
        T *As = smem + buf * Tile::STAGE_ELEMS, *Bs = As + BM * IG_BK;
        load_a<T, VEC, BM>(As, x, a.gd, base, py, px, walk);
        #pragma unroll
        for (int j = 0; j < FB::N; j++) {  // W's rows co, k-contiguous, like A's
            const int co = n0 + FB::row(j);
            T *dst = Bs + ig_swizzle<T, IG_BK>(FB::row(j), FB::chunk());
            if (VEC) {
                const bool in = walk.k < K && co < a.Coutg;
                cp_async16(dst, in ? wg + co * K + walk.k : w, in ? 16 : 0);
            } else {
                #pragma unroll
                for (int q = 0; q < CE; q++)
                    dst[q] = walk.k + q < K && co < a.Coutg ? wg[co * K + walk.k + q] : T{0};
            }
        }
        walk.advance(IG_BK, a.gd.Ck, a.gd.taps_x);
    };
    IgAcc<Tile> acc;
    ig_mainloop<T, false, false, Tile>(acc, smem, (K + IG_BK - 1) / IG_BK, load_stage);
    // accumulators r, r + 1 are columns co, co + 1 of one row: one store where both exist
    #pragma unroll
    for (int i = 0; i < Tile::MI; i++)
        #pragma unroll
        for (int r = 0; r < 4; r += 2) {
            const uint32_t m = (uint32_t)(m0 + ig_acc_row<Tile>(i, r));
            if (m >= a.M) continue;
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                const int co = n0 + ig_acc_col<Tile>(j, r), c = g * a.Coutg + co;
                if (co >= a.Coutg) continue;
                T *out = y + m * (uint32_t)a.Cout + c;
                const float v0 = bias ? acc[i][j][r] + bias[c] : acc[i][j][r];
                if (co + 1 < a.Coutg) {
                    const float v1 = bias ? acc[i][j][r + 1] + bias[c + 1] : acc[i][j][r + 1];
                    if (pair_aligned(out)) {
                        store_pair(out, v0, v1);
                        continue;
                    }
                    out[1] = from_f32<T>(v1);
                }
                out[0] = from_f32<T>(v0);
            }
        }
}

struct ConvDgradArgs {
    // over dout: (OH, OW, Cout), Ck = Coutg, dir = -1; taps_x and K per phase (below)
    Gather gd;
    int H, W, C, Cg, Coutg, Kw; // din (N,H,W,C); Kw = kh·kw·Cg, a row of W
    int kw, stride, phases, accumulate;
    // per phase (py, px) = (phase / stride, phase % stride): its rows N·Hu·Wv
    // (iy = py + s·u, ix = px + s·v), its taps ky = ky0 + s·a (a < nky), kx
    // likewise, and oy = u + dy0 - a, ox = v + dx0 - b
    uint32_t M[IG_MAX_PHASES];
    FastDiv Hu[IG_MAX_PHASES], Wv[IG_MAX_PHASES];
    int py[IG_MAX_PHASES], px[IG_MAX_PHASES], ky0[IG_MAX_PHASES], kx0[IG_MAX_PHASES];
    int nky[IG_MAX_PHASES], nkx[IG_MAX_PHASES], dy0[IG_MAX_PHASES], dx0[IG_MAX_PHASES];
};

template <class T, bool VEC, class Tile>
__global__ void __launch_bounds__(IG_THREADS)
        conv_dgrad_kernel(T *din, const T *dout, const T *w, ConvDgradArgs a) {
    constexpr int BM = Tile::BM, BN = Tile::BN;
    CU_DYN_SHARED(T, smem);  // IG_STAGES × (A: BM rows of IG_BK, B: IG_BK rows of BN)
    typedef TileFill<T, IG_BK, BM> FA;
    typedef TileFill<T, BN, IG_BK> FB;
    constexpr int CE = Chunk<T>::CE;
    const int ph = blockIdx.z % a.phases, g = blockIdx.z / a.phases;
    const int m0 = blockIdx.x * BM, n0 = blockIdx.y * BN;
    const uint32_t M = a.M[ph];
    if ((uint32_t)m0 >= M) return;  // the whole block: this phase has fewer rows
    Gather gd = a.gd;
    gd.taps_x = a.nkx[ph];
    gd.K = a.nky[ph] * a.nkx[ph] * a.Coutg;
    const int s = a.stride;
    int base[FA::N], py[FA::N], px[FA::N];
    #pragma unroll
    for (int i = 0; i < FA::N; i++) {
        const uint32_t m = (uint32_t)(m0 + FA::row(i));
        const uint32_t t = fastdiv(a.Wv[ph], m), v = m - t * a.Wv[ph].d, n = fastdiv(a.Hu[ph], t),
                       u = t - n * a.Hu[ph].d;
        base[i] = (int)n * gd.H * gd.W * gd.C + g * a.Coutg;
        py[i] = m < M ? (int)u + a.dy0[ph] : IG_ROW_NONE;
        px[i] = (int)v + a.dx0[ph];
    }
    TapWalk walk = {0, 0, 0, 0};
    walk.advance(FA::chunk() * CE, gd.Ck, gd.taps_x);
    // B: rows k = (a, b, co) of W's [co][ky][kx][ci], BN consecutive ci from n0
    const int ci = n0 + FB::chunk() * CE;
    TapWalk bwalk[FB::N];
    #pragma unroll
    for (int j = 0; j < FB::N; j++) {
        bwalk[j] = TapWalk{0, 0, 0, 0};
        bwalk[j].advance(FB::row(j), gd.Ck, gd.taps_x);
    }
    const T *wg = w + (size_t)g * a.Coutg * a.Kw;
    auto load_stage = [&](int buf) {
        T *As = smem + buf * Tile::STAGE_ELEMS, *Bs = As + BM * IG_BK;
        load_a<T, VEC, BM>(As, dout, gd, base, py, px, walk);
        walk.advance(IG_BK, gd.Ck, gd.taps_x);
        #pragma unroll
        for (int j = 0; j < FB::N; j++) {
            const TapWalk &b = bwalk[j];
            const int tap = (a.ky0[ph] + s * b.a) * a.kw + a.kx0[ph] + s * b.b;
            const T *src = wg + b.c * a.Kw + tap * a.Cg + ci;
            T *dst = Bs + ig_swizzle<T, BN>(FB::row(j), FB::chunk());
            if (VEC) {
                const bool in = b.k < gd.K && ci < a.Cg;
                cp_async16(dst, in ? src : w, in ? 16 : 0);
            } else {
                #pragma unroll
                for (int q = 0; q < CE; q++) dst[q] = b.k < gd.K && ci + q < a.Cg ? src[q] : T{0};
            }
            bwalk[j].advance(IG_BK, gd.Ck, gd.taps_x);
        }
    };
    IgAcc<Tile> acc;
    ig_mainloop<T, false, true, Tile>(acc, smem, (gd.K + IG_BK - 1) / IG_BK, load_stage);
    #pragma unroll
    for (int i = 0; i < Tile::MI; i++)
        #pragma unroll
        for (int r = 0; r < 4; r += 2) {
            const uint32_t m = (uint32_t)(m0 + ig_acc_row<Tile>(i, r));
            if (m >= M) continue;
            const uint32_t t = fastdiv(a.Wv[ph], m), v = m - t * a.Wv[ph].d,
                           n = fastdiv(a.Hu[ph], t), u = t - n * a.Hu[ph].d;
            const uint32_t pixel = (n * a.H + a.py[ph] + s * u) * a.W + a.px[ph] + s * v;
            #pragma unroll
            for (int j = 0; j < 4; j++) {
                const int c = n0 + ig_acc_col<Tile>(j, r);  // and c + 1: one store where both exist
                if (c >= a.Cg) continue;
                T *out = din + pixel * a.C + g * a.Cg + c;
                float v0 = acc[i][j][r], v1 = acc[i][j][r + 1];
                if (c + 1 < a.Cg && pair_aligned(out)) {
                    if (a.accumulate) {
                        const Pair<T> old = load_pair(out);
                        v0 = to_f32(old.v[0]) + v0;
                        v1 = to_f32(old.v[1]) + v1;
                    }
                    store_pair(out, v0, v1);
                    continue;
                }
                for (int e = 0; e < 2 && c + e < a.Cg; e++) {
                    const float v32 = e ? v1 : v0;
                    out[e] = from_f32<T>(a.accumulate ? to_f32(out[e]) + v32 : v32);
                }
            }
        }
}

// Backward weight, GEMM rows k = (ky, kx, ci) of W's rows, columns co, the
// reduction over output pixels p = (n, oy, ox):
//   dW[g·Coutg + co][k] += Σ_p A[p][k] · dout[p][g·Coutg + co]   (A: the forward's gather)
// Both tiles hold IG_BK pixels as rows (A [IG_BK][BM] k-contiguous, B
// [IG_BK][BN] co-contiguous), read transposed. The pixels are split into
// `parts` ranges (grid.z = g·parts + part) so that small convs still fill the
// GPU; a part's block writes its fp32 tile to partial[part][Cout][K] and the
// last block of the tile (last_block) adds the parts in part order into dW
// (one part: straight into dW). The split depends on the shape only: the
// same bits on any GPU.
struct ConvWgradArgs {
    int H, W, C, Cg, Cout, Coutg, K, kw, stride, pt, pl, OH, OW;
    uint32_t M;                 // output pixels N·OH·OW
    uint32_t part_pixels;       // pixels per part, a multiple of IG_BK
    int parts;
    FastDiv OW_div, OH_div;
};
// an output pixel (n, oy, ox) walked forward
struct PixelWalk {
    int n, oy, ox;
    __device__ void advance(int by, int OH, int OW) {
        ox += by;
        while (ox >= OW) { ox -= OW; if (++oy == OH) { oy = 0; ++n; } }
    }
};

template <class T, bool VEC, class Tile>
__global__ void __launch_bounds__(IG_THREADS)
        conv_wgrad_kernel(float *dw, float *partial, unsigned *done, const T *dout, const T *x,
                          ConvWgradArgs a) {
    constexpr int BM = Tile::BM, BN = Tile::BN;
    CU_DYN_SHARED(T, smem);  // IG_STAGES × (A: IG_BK rows of BM, B: IG_BK rows of BN)
    typedef TileFill<T, BM, IG_BK> FA;
    typedef TileFill<T, BN, IG_BK> FB;
    constexpr int CE = Chunk<T>::CE;
    const int tid = threadIdx.x, part = blockIdx.z % a.parts, g = blockIdx.z / a.parts;
    const int k0 = blockIdx.x * BM, co0 = blockIdx.y * BN;
    const uint32_t p_begin = part * a.part_pixels;
    const uint32_t p_end = p_begin + a.part_pixels < a.M ? p_begin + a.part_pixels : a.M;
    // A: this thread's column k0 + CE·chunk and pixel rows FA::row(i)
    TapWalk tap = {0, 0, 0, 0};
    tap.advance(k0 + CE * FA::chunk(), a.Cg, a.kw);
    PixelWalk pix[FA::N];
    #pragma unroll
    for (int i = 0; i < FA::N; i++) {
        const uint32_t p = p_begin + FA::row(i), t = fastdiv(a.OW_div, p), n = fastdiv(a.OH_div, t);
        pix[i] = PixelWalk{(int)n, (int)(t - n * a.OH_div.d), (int)(p - t * a.OW_div.d)};
    }
    const int co = co0 + CE * FB::chunk();
    uint32_t p_tile = p_begin;
    auto load_stage = [&](int buf) {
        T *As = smem + buf * Tile::STAGE_ELEMS, *Bs = As + IG_BK * BM;
        #pragma unroll
        for (int i = 0; i < FA::N; i++) {
            const PixelWalk &w = pix[i];
            const bool p_in = p_tile + FA::row(i) < p_end;
            T *dst = As + ig_swizzle<T, BM>(FA::row(i), FA::chunk());
            if (VEC) {
                const int iy = w.oy * a.stride - a.pt + tap.a, ix = w.ox * a.stride - a.pl + tap.b;
                const bool in = p_in && tap.k < a.K && (unsigned)iy < (unsigned)a.H &&
                                (unsigned)ix < (unsigned)a.W;
                cp_async16(dst, in ? x + ((w.n * a.H + iy) * a.W + ix) * a.C + g * a.Cg + tap.c : x,
                           in ? 16 : 0);
            } else {
                TapWalk e = tap;
                #pragma unroll
                for (int q = 0; q < CE; q++, e.advance(1, a.Cg, a.kw)) {
                    const int iy = w.oy * a.stride - a.pt + e.a, ix = w.ox * a.stride - a.pl + e.b;
                    const bool in = p_in && e.k < a.K && (unsigned)iy < (unsigned)a.H &&
                                    (unsigned)ix < (unsigned)a.W;
                    dst[q] = in ? x[((w.n * a.H + iy) * a.W + ix) * a.C + g * a.Cg + e.c] : T{0};
                }
            }
            pix[i].advance(IG_BK, a.OH, a.OW);
        }
        #pragma unroll
        for (int j = 0; j < FB::N; j++) {
            const uint32_t p = p_tile + FB::row(j);
            const T *src = dout + p * a.Cout + g * a.Coutg + co;
            T *dst = Bs + ig_swizzle<T, BN>(FB::row(j), FB::chunk());
            if (VEC) {
                const bool in = p < p_end && co < a.Coutg;
                cp_async16(dst, in ? src : dout, in ? 16 : 0);
            } else {
                #pragma unroll
                for (int q = 0; q < CE; q++) dst[q] = p < p_end && co + q < a.Coutg ? src[q] : T{0};
            }
        }
        p_tile += IG_BK;
    };
    IgAcc<Tile> acc;
    ig_mainloop<T, true, true, Tile>(acc, smem, (int)((p_end - p_begin + IG_BK - 1) / IG_BK),
                                     load_stage);
    // acc row: k0 + ig_acc_row, column: co0 + ig_acc_col; dW and the partials are [Cout][K]
    float *out = a.parts > 1 ? partial + (size_t)part * a.Cout * a.K : dw;
    ig_each_acc<Tile>(acc, [&](int row, int col, float v) {
        const int k = k0 + row, c = co0 + col;
        if (k >= a.K || c >= a.Coutg) return;
        const uint32_t idx = (uint32_t)(g * a.Coutg + c) * a.K + k;
        if (a.parts > 1)
            out[idx] = v;
        else
            out[idx] += v;
    });
    if (a.parts == 1) return;
    if (!last_block(done + (blockIdx.z / a.parts * gridDim.y + blockIdx.y) * gridDim.x + blockIdx.x,
                    a.parts))
        return;
    for (int e = tid; e < BM * BN; e += IG_THREADS) {  // the tile, k fastest
        const int k = k0 + e % BM, c = co0 + e / BM;
        if (k >= a.K || c >= a.Coutg) continue;
        const uint32_t idx = (uint32_t)(g * a.Coutg + c) * a.K + k;
        float sum = 0.0f;
        for (int q = 0; q < a.parts; q++)
            sum += from_other_blocks(&partial[(size_t)q * a.Cout * a.K + idx]);
        dw[idx] += sum;
    }
}

static void conv_check_out(const char *what, const ConvGeom *q, Shape out, const ConvCfg *cfg,
                           Shape in) {
    if (out.n != q->N || out.h != q->OH || out.w != q->OW || out.c != q->Cout)
        conv_fail(what, cfg, in);
}

// depthwise convs have kernels of their own (below, after the implicit GEMMs)
static void depthwise_forward(Ops *o, const ConvCfg *cfg, const ConvGeom *q, Tensor out, Tensor in,
                              const float *w, const float *b);
static void depthwise_backward_data(Ops *o, const ConvCfg *cfg, const ConvGeom *q, Tensor din,
                                    Tensor dout, const float *w, int accumulate);
static void depthwise_backward_weight(Ops *o, const ConvCfg *cfg, const ConvGeom *q, float *dw,
                                      Tensor dout, Tensor in, int parts, float *partial);

int cuda_conv_implicit = 1;  // declared in segnet.h

// whether a conv takes the implicit-GEMM kernels: k×k (not depthwise), stride ≤ 2, on sm_80+
// (cp.async)
static bool conv_takes_implicit(Ops *o, const ConvCfg *cfg) {
    return cuda_conv_implicit && !conv_is_pointwise(cfg) && !conv_is_depthwise(cfg) &&
           cfg->stride * cfg->stride <= IG_MAX_PHASES && ctx_of(o)->sm_major >= 8;
}
static bool aligned16(const void *p) { return (uintptr_t)p % VEC_BYTES == 0; }
static int chunk_elems(DType dt) { return VEC_BYTES / (int)dtype_size(dt); }
// the kernels' dynamic shared memory: IG_STAGES stages of an A and a B tile;
// fp32's 72 KB (wide; 60 KB narrow) need the opt-in that ig_raise_smem_limits gives
template <class Tile> static size_t ig_smem_bytes(size_t elem) {
    return (size_t)IG_STAGES * Tile::STAGE_ELEMS * elem;
}
template <class Tile> static void ig_raise_smem_limits_of() {
    const int f32 = (int)ig_smem_bytes<Tile>(sizeof(float));
    for (const void *k : {(const void *)conv_fwd_kernel<float, true, Tile>,
                          (const void *)conv_fwd_kernel<float, false, Tile>,
                          (const void *)conv_dgrad_kernel<float, true, Tile>,
                          (const void *)conv_dgrad_kernel<float, false, Tile>})
        cudaCheck(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, f32));
    if constexpr (Tile::BM == IG_BM)  // the weight gradient's rows are K: no small tile
        for (const void *k : {(const void *)conv_wgrad_kernel<float, true, Tile>,
                              (const void *)conv_wgrad_kernel<float, false, Tile>})
            cudaCheck(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, f32));
}
static void ig_raise_smem_limits() {
    ig_raise_smem_limits_of<IgWide>();
    ig_raise_smem_limits_of<IgNarrow>();
    ig_raise_smem_limits_of<IgSmall>();
}

// The tile (segnet.h's codes: IG_TILE_WIDE, NARROW, SMALL) of the forward or
// backward data for n output channels a group, M GEMM rows, z groups (and
// phases) in the grid: the first of wide, narrow and small whose grid fills its
// waves (at ig_blocks_per_sm) to WAVE_FILL_MIN, padding channels counted as
// idle, else the one that fills them best. A wide block loads an A tile for
// twice the channels of a narrow one, and a narrow one its B tile for twice the
// rows of a small one, so the larger come first. For n ≤ IG_BN_NARROW, half a
// wide tile's products would be padding: never wide. cuda_conv_tile > 0 forces
// one. All give the same bits.
int cuda_conv_tile = 0;  // segnet.h
static int ig_tile(size_t M, size_t z, int n, int pass, bool vec) {
    if (cuda_conv_tile > 0) return cuda_conv_tile;
    int best = IG_TILE_NARROW;
    double best_fill = -1.0;
    for (int t = n <= IG_BN_NARROW ? IG_TILE_NARROW : IG_TILE_WIDE; t <= IG_TILE_SMALL; t++) {
        const int bn = t == IG_TILE_WIDE ? IG_BN : IG_BN_NARROW;
        const size_t bm = t == IG_TILE_SMALL ? IG_BM_SMALL : IG_BM, n_tiles = (n + bn - 1) / bn,
                     m_tiles = (M + bm - 1) / bm * z;
        const double fill = wave_efficiency(m_tiles * n_tiles,
                                            (size_t)WAVE_SMS * ig_blocks_per_sm(t, pass, vec)) *
                            n / (double)(n_tiles * bn);
        if (fill >= WAVE_FILL_MIN) return t;
        if (fill > best_fill) {
            best = t;
            best_fill = fill;
        }
    }
    return best;
}
// run(a Tile) of the tile's code
template <class Run> static void with_tile(int tile, Run run) {
    if (tile == IG_TILE_WIDE)
        run(IgWide{});
    else if (tile == IG_TILE_NARROW)
        run(IgNarrow{});
    else
        run(IgSmall{});
}
// segnet.h: what ig_tile and wgrad_split assume, against the build
int cuda_conv_assumed_blocks_per_sm(int tile, int pass, int vec) {
    return ig_blocks_per_sm(tile, pass, vec);
}
int cuda_conv_blocks_per_sm(int tile, int pass, int vec, DType dt) {
    if (tile < IG_TILE_WIDE || tile > IG_TILE_SMALL || (tile == IG_TILE_SMALL && pass == IG_WGRAD))
        return -1;
    const void *k = NULL;
    size_t smem = 0;
    with_tile(tile, [&](auto tag) {
        typedef decltype(tag) Tile;
        smem = ig_smem_bytes<Tile>(dtype_size(dt));
        SWITCH_STORAGE(dt, T, {
            if (pass == IG_FWD)
                k = vec ? (const void *)conv_fwd_kernel<T, true, Tile>
                        : (const void *)conv_fwd_kernel<T, false, Tile>;
            else if (pass == IG_DGRAD)
                k = vec ? (const void *)conv_dgrad_kernel<T, true, Tile>
                        : (const void *)conv_dgrad_kernel<T, false, Tile>;
            else if constexpr (Tile::BM == IG_BM)
                k = vec ? (const void *)conv_wgrad_kernel<T, true, Tile>
                        : (const void *)conv_wgrad_kernel<T, false, Tile>;
        });
    });
    int n = -1;
    if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, k, IG_THREADS, smem) != cudaSuccess) {
        cudaGetLastError();
        return -1;
    }
    return n;
}

// whether the weight gradient will take its vector kernel, by the channel counts
// (its tensors are 16-byte aligned as the planner places them)
static bool wgrad_vec_likely(const ConvGeom *q) { return q->Cg % 8 == 0 && q->Coutg % 8 == 0; }
// The weight gradient's tile width: narrow for at most IG_BN_NARROW output
// channels a group (the sums' order follows the tiles: a function of the shape)
static int wgrad_tile(const ConvGeom *q) {
    if (cuda_conv_tile == IG_TILE_WIDE || cuda_conv_tile == IG_TILE_NARROW) return cuda_conv_tile;
    return q->Coutg <= IG_BN_NARROW ? IG_TILE_NARROW : IG_TILE_WIDE;
}
// The weight gradient's pixel split into parts, each at least WGRAD_MIN_TILES
// tiles of IG_BK pixels, at most WGRAD_PARTS_MAX parts, so that the grid
// (tiles × parts blocks) fills the slots of a 132-SM GPU at its tile's blocks
// per SM (a constant: the sums do not depend on the GPU) without a second wave
// that is mostly empty: the fewest parts that fill one wave, or one part fewer
// when that keeps WAVE_FILL_MIN of the wave busy, or else the next count whose
// last wave is that full.
#define WGRAD_MIN_TILES 8
#define WGRAD_PARTS_MAX (8 * WAVE_SMS)
// n parts asked for: pixels per part (whole IG_BK tiles), and the parts that makes
static int wgrad_parts_of(size_t M, size_t n, uint32_t *part_pixels) {
    size_t per = (M + n - 1) / n;
    per = (per + IG_BK - 1) / IG_BK * IG_BK;
    if (per < IG_BK) per = IG_BK;
    *part_pixels = (uint32_t)per;
    const size_t parts = (M + per - 1) / per;
    return parts < 1 ? 1 : (int)parts;
}
static void wgrad_split(const ConvCfg *cfg, const ConvGeom *q, int *parts, uint32_t *part_pixels) {
    const int tile = wgrad_tile(q), bn = tile == IG_TILE_WIDE ? IG_BN : IG_BN_NARROW;
    const size_t slots = (size_t)WAVE_SMS * ig_blocks_per_sm(tile, IG_WGRAD, wgrad_vec_likely(q));
    const size_t tiles =
            (size_t)((q->K + IG_BM - 1) / IG_BM) * ((q->Coutg + bn - 1) / bn) * cfg->groups;
    const size_t M = (size_t)q->N * q->P,
                 most = (M + IG_BK * WGRAD_MIN_TILES - 1) / (IG_BK * WGRAD_MIN_TILES);
    size_t hi = most < WGRAD_PARTS_MAX ? most : WGRAD_PARTS_MAX;
    if (hi < 1) hi = 1;
    size_t n = (slots + tiles - 1) / tiles;
    if (n > hi) n = hi;
    if (n < 1) n = 1;
    uint32_t per;
    int got = wgrad_parts_of(M, n, &per);
    if (wave_efficiency(tiles * got, slots) < WAVE_FILL_MIN) {
        uint32_t per_less;
        const int less = n > 1 ? wgrad_parts_of(M, n - 1, &per_less) : got;
        if (less < got && wave_efficiency(tiles * less, slots) >= WAVE_FILL_MIN) {
            got = less;
            per = per_less;
        } else {
            for (size_t m = n + 1; m <= hi; m++) {
                uint32_t per_m;
                const int more = wgrad_parts_of(M, m, &per_m);
                if (wave_efficiency(tiles * more, slots) >= WAVE_FILL_MIN) {
                    got = more;
                    per = per_m;
                    break;
                }
            }
        }
    }
    *parts = got;
    *part_pixels = per;
}

// an implicit GEMM's traffic: its activations, weights of `weight_type`, and
// 2·M·Cout·K FLOPs (M pixels, K = kh·kw·Cin/groups products each)
static Traffic conv_traffic(const ConvGeom *q, Tensor a, Tensor b, DType weight_type) {
    const double weights = (double)q->Cout * q->K;
    return moves(bytes_of(a) + bytes_of(b) + weights * dtype_size(weight_type),
                 2.0 * q->N * q->P * weights);
}

static void conv_implicit_forward(Ops *o, const ConvCfg *cfg, const ConvGeom *q, Tensor out,
                                  Tensor in, const void *wt, const float *b) {
    require_below(shape_numel(in.shape), (size_t)1 << 31, "implicit-GEMM conv input elements");
    require_below(shape_numel(out.shape), (size_t)1 << 31, "implicit-GEMM conv output elements");
    ConvFwdArgs a;
    a.gd = Gather{q->H, q->W, q->C, cfg->kw, q->Cg, +1, q->K};
    a.Cout = q->Cout;
    a.Cg = q->Cg;
    a.Coutg = q->Coutg;
    a.stride = cfg->stride;
    a.pt = q->pt;
    a.pl = q->pl;
    a.M = (uint32_t)(q->N * q->P);
    a.OW = fastdiv_make(q->OW);
    a.OH = fastdiv_make(q->OH);
    const bool vec = cuda_vector_kernels && q->Cg % chunk_elems(in.dtype) == 0 &&
                     aligned16(in.data) && aligned16(wt);
    const Traffic m = conv_traffic(q, out, in, in.dtype);
    with_tile(ig_tile(a.M, cfg->groups, q->Coutg, IG_FWD, vec), [&](auto tag) {
        typedef decltype(tag) Tile;
        const dim3 grid((a.M + Tile::BM - 1) / Tile::BM, (q->Coutg + Tile::BN - 1) / Tile::BN,
                        cfg->groups);
        SWITCH_STORAGE(in.dtype, T, {
            if (vec)
                CU_LAUNCH((conv_fwd_kernel<T, true, Tile>), grid, IG_THREADS,
                          ig_smem_bytes<Tile>(sizeof(T)), stream_of(o), m, (T *)out.data,
                          (const T *)in.data, (const T *)wt, b, a);
            else
                CU_LAUNCH((conv_fwd_kernel<T, false, Tile>), grid, IG_THREADS,
                          ig_smem_bytes<Tile>(sizeof(T)), stream_of(o), m, (T *)out.data,
                          (const T *)in.data, (const T *)wt, b, a);
        });
    });
    launchCheck();
}

static void conv_implicit_backward_data(Ops *o, const ConvCfg *cfg, const ConvGeom *q, Tensor din,
                                        Tensor dout, const void *wt, int accumulate) {
    require_below(shape_numel(din.shape), (size_t)1 << 31, "implicit-GEMM conv input elements");
    require_below(shape_numel(dout.shape), (size_t)1 << 31, "implicit-GEMM conv output elements");
    const int s = cfg->stride;
    ConvDgradArgs a;
    memset(&a, 0, sizeof a);
    a.gd = Gather{q->OH, q->OW, q->Cout, 0, q->Coutg, -1, 0};
    a.H = q->H; a.W = q->W; a.C = q->C; a.Cg = q->Cg; a.Coutg = q->Coutg; a.Kw = q->K;
    a.kw = cfg->kw; a.stride = s; a.phases = s * s; a.accumulate = accumulate;
    uint32_t rows = 0;
    for (int ph = 0; ph < a.phases; ph++) {
        const int py = ph / s, px = ph % s, hu = (q->H - py + s - 1) / s,
                  wv = (q->W - px + s - 1) / s;
        a.py[ph] = py; a.px[ph] = px;
        a.ky0[ph] = (py + q->pt) % s; a.kx0[ph] = (px + q->pl) % s;
        a.nky[ph] = a.ky0[ph] < cfg->kh ? (cfg->kh - a.ky0[ph] + s - 1) / s : 0;
        a.nkx[ph] = a.kx0[ph] < cfg->kw ? (cfg->kw - a.kx0[ph] + s - 1) / s : 0;
        a.dy0[ph] = (py + q->pt - a.ky0[ph]) / s; a.dx0[ph] = (px + q->pl - a.kx0[ph]) / s;
        a.M[ph] = (uint32_t)(q->N * (hu > 0 ? hu : 0) * (wv > 0 ? wv : 0));
        a.Hu[ph] = fastdiv_make(hu > 0 ? hu : 1); a.Wv[ph] = fastdiv_make(wv > 0 ? wv : 1);
        if (a.M[ph] > rows) rows = a.M[ph];
    }
    const unsigned z = cfg->groups * a.phases;
    const bool vec = cuda_vector_kernels && q->Cg % chunk_elems(din.dtype) == 0 &&
                     q->Coutg % chunk_elems(din.dtype) == 0 && aligned16(dout.data) &&
                     aligned16(wt);
    const Traffic m = conv_traffic(q, din, dout, din.dtype);
    with_tile(ig_tile(rows, z, q->Cg, IG_DGRAD, vec), [&](auto tag) {
        typedef decltype(tag) Tile;
        const dim3 grid((rows + Tile::BM - 1) / Tile::BM, (q->Cg + Tile::BN - 1) / Tile::BN, z);
        SWITCH_STORAGE(din.dtype, T, {
            if (vec)
                CU_LAUNCH((conv_dgrad_kernel<T, true, Tile>), grid, IG_THREADS,
                          ig_smem_bytes<Tile>(sizeof(T)), stream_of(o), m, (T *)din.data,
                          (const T *)dout.data, (const T *)wt, a);
            else
                CU_LAUNCH((conv_dgrad_kernel<T, false, Tile>), grid, IG_THREADS,
                          ig_smem_bytes<Tile>(sizeof(T)), stream_of(o), m, (T *)din.data,
                          (const T *)dout.data, (const T *)wt, a);
        });
    });
    launchCheck();
}

static void conv_implicit_backward_weight(Ops *o, const ConvCfg *cfg, const ConvPlan *p, float *dw,
                                          Tensor dout, Tensor in, void *ws) {
    const ConvGeom *q = &p->q;
    require_below(shape_numel(in.shape), (size_t)1 << 31, "implicit-GEMM conv input elements");
    require_below(shape_numel(dout.shape), (size_t)1 << 31, "implicit-GEMM conv output elements");
    ConvWgradArgs a;
    a.H = q->H;
    a.W = q->W;
    a.C = q->C;
    a.Cg = q->Cg;
    a.Cout = q->Cout;
    a.Coutg = q->Coutg;
    a.K = q->K;
    a.kw = cfg->kw; a.stride = cfg->stride; a.pt = q->pt; a.pl = q->pl; a.OH = q->OH; a.OW = q->OW;
    a.M = (uint32_t)(q->N * q->P); a.part_pixels = p->wgrad_part_pixels; a.parts = p->wgrad_parts;
    a.OW_div = fastdiv_make(q->OW); a.OH_div = fastdiv_make(q->OH);
    // wgrad_split's tile
    const int tile = wgrad_tile(q), bn = tile == IG_TILE_WIDE ? IG_BN : IG_BN_NARROW;
    const dim3 grid((q->K + IG_BM - 1) / IG_BM, (q->Coutg + bn - 1) / bn, cfg->groups * a.parts);
    require_below((size_t)grid.x * grid.y * cfg->groups, SUMS_COUNTERS + 1,
                  "implicit-GEMM weight gradient tiles");
    const bool vec = cuda_vector_kernels && q->Cg % chunk_elems(in.dtype) == 0 &&
                     q->Coutg % chunk_elems(in.dtype) == 0 && aligned16(dout.data) &&
                     aligned16(in.data);
    unsigned *done = ctx_of(o)->sums_done;
    const Traffic m = conv_traffic(q, dout, in, DT_F32);  // dw: fp32
    auto launch = [&](auto tag) {
        typedef decltype(tag) Tile;
        SWITCH_STORAGE(in.dtype, T, {
            if (vec)
                CU_LAUNCH((conv_wgrad_kernel<T, true, Tile>), grid, IG_THREADS,
                          ig_smem_bytes<Tile>(sizeof(T)), stream_of(o), m, dw, (float *)ws, done,
                          (const T *)dout.data, (const T *)in.data, a);
            else
                CU_LAUNCH((conv_wgrad_kernel<T, false, Tile>), grid, IG_THREADS,
                          ig_smem_bytes<Tile>(sizeof(T)), stream_of(o), m, dw, (float *)ws, done,
                          (const T *)dout.data, (const T *)in.data, a);
        });
    };
    if (tile == IG_TILE_WIDE)
        launch(IgWide{});
    else
        launch(IgNarrow{});
    launchCheck();
}

static void conv2d_forward_cuda(Ops *o, const ConvCfg *cfg, Tensor out, Tensor in, const float *w,
                                const void *w_cast, const float *b, void *ws) {
    ConvPlan p = conv_plan(o, cfg, in.shape, in.dtype);
    const ConvGeom *q = &p.q;
    conv_check_out("conv2d_forward (out shape)", q, out.shape, cfg, in.shape);
    if (p.depthwise) {
        depthwise_forward(o, cfg, q, out, in, w, b);
        return;
    }
    if (out.dtype != in.dtype)
        conv_fail("conv2d_forward (in and out storage types differ)", cfg, in.shape);
    if (b && !cfg->has_bias)
        conv_fail("conv2d_forward (a bias for a conv without one)", cfg, in.shape);
    const DType dt = in.dtype;
    const void *wt = dt == DT_F32 ? (const void *)w : w_cast;  // [Cout][K] in the storage type
    if (!wt) {
        // the weights, rounded to the storage type
        const Shape ws_shape = shape4(1, 1, q->Cout, q->K);
        copy_cuda(o, tensor(ws, ws_shape, dt), tensor_f32((float *)w, ws_shape), 0);
        wt = ws;
    }
    if (p.implicit) {
        conv_implicit_forward(o, cfg, q, out, in, wt, b);
        return;
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
        else B = elem_ptr(in.data, dt, first * q->C);
        const int via32 = b && dt != DT_F32;
        void *y = via32 ? (void *)rows32 : elem_ptr(out.data, dt, first * q->Cout);
        // out_g[pix][Coutg] = col_g[pix][K]·W_g[Coutg][K]ᵀ; column-major: out_gᵀ (Coutg×pix) =
        // W_gᵀ-as-stored (op T)·col_gᵀ
        for (int g = 0; g < p.G; g++)
            gemm_ex(o, CUBLAS_OP_T, CUBLAS_OP_N, q->Coutg, pix, q->K,
                    elem_ptr(wt, dt, (size_t)g * q->Coutg * q->K), q->K,
                    elem_ptr(B, dt, (size_t)g * q->K), ldb, dt, 0.0f,
                    elem_ptr(y, via32 ? DT_F32 : dt, (size_t)g * q->Coutg), q->Cout,
                    via32 ? DT_F32 : dt);
        if (b) {
            void *dst = elem_ptr(out.data, dt, first * q->Cout);
            bias_rows(o, dst, dt, via32 ? (const float *)rows32 : (const float *)dst, b, q->Cout,
                      pix);
        }
        t0 = t1;
    }
}

static void conv2d_backward_data_cuda(Ops *o, const ConvCfg *cfg, Tensor din, Tensor dout,
                                      const float *w, const void *w_cast, int accumulate,
                                      void *ws) {
    if (!din.data) return;
    ConvPlan p = conv_plan(o, cfg, din.shape, din.dtype);
    const ConvGeom *q = &p.q;
    conv_check_out("conv2d_backward_data (dout shape)", q, dout.shape, cfg, din.shape);
    if (p.depthwise) {
        depthwise_backward_data(o, cfg, q, din, dout, w, accumulate);
        return;
    }
    if (dout.dtype != din.dtype)
        conv_fail("conv2d_backward_data (din and dout storage types differ)", cfg, din.shape);
    const DType dt = din.dtype;
    const void *wt = dt == DT_F32 ? (const void *)w : w_cast;
    if (!wt) {
        // the weights, rounded to the storage type
        const Shape ws_shape = shape4(1, 1, q->Cout, q->K);
        copy_cuda(o, tensor(ws, ws_shape, dt), tensor_f32((float *)w, ws_shape), 0);
        wt = ws;
    }
    if (p.implicit) {
        conv_implicit_backward_data(o, cfg, q, din, dout, wt, accumulate);
        return;
    }
    if (p.pointwise) {
        // din[M][Cin] (=|+=) dout[M][Cout]·W[Cout][Cin]; column-major: dinᵀ (Cin×M) = W-as-stored
        // (Cin×Cout)·doutᵀ
        gemm_ex(o, CUBLAS_OP_N, CUBLAS_OP_N, q->C, (size_t)q->N * q->H * q->W, q->Cout, wt, q->C,
                dout.data, q->Cout, dt, accumulate ? 1.0f : 0.0f, din.data, q->C, dt);
        return;
    }
    float *dcol = (float *)((char *)ws + align_up(p.wcast));  // (rows·OW, G·K) fp32
    const int total = q->N * q->H;
    for (int u0 = 0; u0 < total;) {
        const int u1 = chunk_end(u0, p.bwd_rows, q->H, total);
        int t0, t1;
        bwd_band_out_rows(cfg, q, u0, u1, &t0, &t1);
        const size_t pix = (size_t)(t1 - t0) * q->OW;
        // dcol_g[pix][K] = dout_g[pix][Coutg]·W_g[Coutg][K]; column-major: dcol_gᵀ (K×pix) =
        // W_g-as-stored (K×Coutg)·dout_gᵀ
        for (int g = 0; g < p.G && pix; g++)
            gemm_ex(o, CUBLAS_OP_N, CUBLAS_OP_N, q->K, pix, q->Coutg,
                    elem_ptr(wt, dt, (size_t)g * q->Coutg * q->K), q->K,
                    elem_ptr(dout.data, dt, (size_t)t0 * q->OW * q->Cout + (size_t)g * q->Coutg),
                    q->Cout, dt, 0.0f, dcol + (size_t)g * q->K, p.GK, DT_F32);
        const size_t n = (size_t)(u1 - u0) * q->W * q->C;
        require_below(n, (size_t)1 << 31, "col2im elements in one chunk (cuda_conv_chunk_bytes)");
        require_below(shape_numel(din.shape), (size_t)1 << 31, "col2im output elements");
        const Col2imDivs d = {fastdiv_make(q->C), fastdiv_make(q->W), fastdiv_make(q->H),
                              fastdiv_make(q->Cg)};
        CU_LAUNCH(col2im_kernel, grid_for(n), BLOCK, 0, stream_of(o),
                  moves(bytes_of(n, dt) + bytes_of(pix * p.GK, DT_F32)), din.data, dt, dcol, *cfg,
                  *q, u0, t0, (uint32_t)n, accumulate, d);
        launchCheck();
        u0 = u1;
    }
}

static void conv2d_backward_weight_cuda(Ops *o, const ConvCfg *cfg, float *dw, float *db,
                                        Tensor dout, Tensor in, void *ws) {
    ConvPlan p = conv_plan(o, cfg, in.shape, in.dtype);
    const ConvGeom *q = &p.q;
    conv_check_out("conv2d_backward_weight (dout shape)", q, dout.shape, cfg, in.shape);
    if (db && !cfg->has_bias && !p.depthwise)
        conv_fail("conv2d_backward_weight (a bias gradient for a conv without bias)", cfg,
                  in.shape);
    if (db) bias_grad(o, db, dout);
    if (!dw) return;
    if (p.depthwise) {
        depthwise_backward_weight(o, cfg, q, dw, dout, in, p.parts, (float *)ws);
        return;
    }
    if (dout.dtype != in.dtype)
        conv_fail("conv2d_backward_weight (in and dout storage types differ)", cfg, in.shape);
    const DType dt = in.dtype;
    if (p.implicit) {
        conv_implicit_backward_weight(o, cfg, &p, dw, dout, in, ws);
        return;
    }
    if (p.pointwise) {
        // dW[Cout][Cin] += dout[M][Cout]ᵀ·in[M][Cin]; column-major: dWᵀ (Cin×Cout) += inᵀ
        // (Cin×M)·dout (op T)
        gemm_ex(o, CUBLAS_OP_N, CUBLAS_OP_T, q->C, q->Cout, (size_t)q->N * q->H * q->W, in.data,
                q->C, dout.data, q->Cout, dt, 1.0f, dw, q->C, DT_F32);
        return;
    }
    void *col = ws;  // (rows·OW, G·K), after the bias gradient is done with ws
    const int total = q->N * q->OH;
    for (int t0 = 0; t0 < total;) {
        const int t1 = chunk_end(t0, p.fwd_rows, q->OH, total);
        const size_t pix = (size_t)(t1 - t0) * q->OW;
        im2col(o, col, in, cfg, q, t0, t1);
        // dW_g[Coutg][K] += dout_g[pix][Coutg]ᵀ·col_g[pix][K]; column-major: dW_gᵀ (K×Coutg) +=
        // col_gᵀ·dout_g (op T)
        for (int g = 0; g < p.G; g++)
            gemm_ex(o, CUBLAS_OP_N, CUBLAS_OP_T, q->K, q->Coutg, pix,
                    elem_ptr(col, dt, (size_t)g * q->K), p.GK,
                    elem_ptr(dout.data, dt, (size_t)t0 * q->OW * q->Cout + (size_t)g * q->Coutg),
                    q->Cout, dt, 1.0f, dw + (size_t)g * q->Coutg * q->K, q->K, DT_F32);
        t0 = t1;
    }
}

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

// ----------------------------------------------------------------------------
// fused softmax + weighted cross-entropy, per pixel (row of K logits), as the
// CPU op: p = softmax(z) with the max subtracted, nll = log Σ_k exp(z_k - max) + max - z_y,
// loss += w[y]·nll, wsum += w[y], dz_k = w[y]·(p_k - [k = y])·grad_scale.
// One thread per row (K is small for segmentation); the per-row arithmetic is
// fp32, the sums over rows fp64 through the deterministic reduction (reduce_finish).

// gamma < 0: cross-entropy, dlogits overwritten; else the focal term (focal_terms, fp64),
// dlogits added into (softmax_focal)
__global__ void softmax_xent_kernel(const void *logits, DType dt, const int32_t *labels,
                                    const float *class_weights, XentClip clip, float gamma, int K,
                                    size_t rows, const float *grad_scale, void *dlogits,
                                    DType dt_grad, ReduceOut r) {
    CU_SHARED(double, sh, [BLOCK * REDUCE_WIDTH]);
    const float scale = dlogits ? *grad_scale : 0.0f;
    double loss = 0.0, wsum = 0.0, invalid = 0.0;
    for (size_t r = blockIdx.x * (size_t)blockDim.x + threadIdx.x; r < rows;
         r += (size_t)blockDim.x * gridDim.x) {
        const int32_t y = labels[r];
        const float wy = y >= 0 && y < K ? class_weights[y] : 0.0f;
        if (y >= K) invalid += 1.0;
        const size_t base = r * (size_t)K;
        float zmax = -INFINITY;
        for (int c = 0; c < K; c++) { float z = ld(logits, dt, base + c); if (z > zmax) zmax = z; }
        float sum = 0.0f;
        for (int c = 0; c < K; c++) sum += expf(ld(logits, dt, base + c) - zmax);
        int flat = 0;
        float h = 1.0f;  // the focal term's factor of (p - onehot(y))
        if (wy != 0.0f) {
            float nll = (float)xent_clip(logf(sum) + zmax - ld(logits, dt, base + y), clip, &flat);
            if (gamma >= 0.0f) {
                double value, dh;
                focal_terms(nll, gamma, &value, &dh);
                nll = (float)value;
                h = (float)dh;
            }
            loss += (double)wy * nll;
            wsum += wy;
        }
        if (dlogits)
            for (int c = 0; c < K; c++) {
                float p = expf(ld(logits, dt, base + c) - zmax) / sum;
                float g = flat ? 0.0f : wy * h * (p - (c == y ? 1.0f : 0.0f)) * scale;
                st(dlogits, dt_grad, base + c,
                   gamma >= 0.0f ? ld(dlogits, dt_grad, base + c) + g : g);
            }
    }
    sh[threadIdx.x * REDUCE_WIDTH + 0] = loss;
    sh[threadIdx.x * REDUCE_WIDTH + 1] = wsum;
    sh[threadIdx.x * REDUCE_WIDTH + 2] = invalid;
    block_sum_tree(sh, 3);
    reduce_finish(r, sh);
}
// logits (N,H,W,K), labels (N·H·W), class_weights (K); stats[0..2] += Σ w·nll, Σ w, labels ≥ K
static void softmax_loss(Ops *o, Tensor logits, const int32_t *labels, const float *class_weights,
                         float gamma, float prob_clip, const float *grad_scale, float *stats,
                         Tensor dlogits) {
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K;
    unsigned grid = reduce_grid(rows);
    // logits, labels, and the logits' gradient when asked for (read too when added into)
    const double grad_bytes = dlogits.data ? bytes_of(dlogits) * (gamma >= 0.0f ? 2 : 1) : 0.0;
    const Traffic m = moves(bytes_of(logits) + rows * sizeof(int32_t) + grad_bytes);
    CU_LAUNCH(softmax_xent_kernel, grid, BLOCK, 0, stream_of(o), m, logits.data, logits.dtype,
              labels, class_weights, xent_clip_bounds(prob_clip), gamma, K, rows, grad_scale,
              dlogits.data, dlogits.dtype, reduce_out(o, stats, 3, 1));
    launchCheck();
}
static void softmax_xent_cuda(Ops *o, Tensor logits, const int32_t *labels,
                              const float *class_weights, float prob_clip, const float *grad_scale,
                              float *stats, Tensor dlogits) {
    softmax_loss(o, logits, labels, class_weights, -1.0f, prob_clip, grad_scale, stats, dlogits);
}
static void softmax_focal_cuda(Ops *o, Tensor logits, const int32_t *labels,
                               const float *class_weights, float gamma, float prob_clip,
                               const float *grad_scale, float *stats, Tensor dlogits) {
    softmax_loss(o, logits, labels, class_weights, gamma, prob_clip, grad_scale, stats, dlogits);
}

// ----------------------------------------------------------------------------
// region terms (segnet.c states them): each row's max and 1/Σexp into the
// scratch (a thread a row), the per-class sums by channel_sums (a lane being one
// class c of a group's rows: p = exp(z_c - max)·(1/Σ), O(1) a value), then the
// coefficients in one thread (region_coefs, groups in order) and the gradient one
// thread a row as softmax_xent's.

// stats (rows,2): max_k z_k and 1/Σ_k exp(z_k - max) of each row, fp32 as softmax_xent_kernel
__global__ void row_softmax_stats_kernel(const void *z, DType dt, int K, size_t rows,
                                         float *stats) {
    for (size_t r = blockIdx.x * (size_t)blockDim.x + threadIdx.x; r < rows;
         r += (size_t)blockDim.x * gridDim.x) {
        const size_t base = r * (size_t)K;
        float zmax = -INFINITY, sum = 0.0f;
        for (int k = 0; k < K; k++) zmax = fmaxf(zmax, ld(z, dt, base + k));
        for (int k = 0; k < K; k++) sum += expf(ld(z, dt, base + k) - zmax);
        stats[2 * r] = zmax;
        stats[2 * r + 1] = 1.0f / sum;
    }
}
// p_c of row r from its row_softmax_stats
static __device__ __forceinline__ float row_prob(const void *z, DType dt, const float *stats,
                                                 size_t r, int K, int c) {
    return expf(ld(z, dt, r * K + c) - stats[2 * r]) * stats[2 * r + 1];
}
struct RegionSums {
    const void *z;
    DType dt;
    const int32_t *labels;
    const float *stats;
    int K;
    uint32_t rows;
    struct Lane {
        const void *z;
        DType dt;
        const int32_t *labels;
        const float *stats;
        int K, c;
        __device__ void add(uint32_t r, double (&acc)[1][3]) const {
            const int32_t y = labels[r];
            if (y < 0 || y >= K) return;
            const double p = row_prob(z, dt, stats, r, K, c);
            acc[0][0] += y == c ? p : 0.0;
            acc[0][1] += p;
            acc[0][2] += y == c ? 1.0 : 0.0;
        }
    };
    __device__ Lane lane(int g, int c) const {
        const size_t at = (size_t)g * rows;
        return {elem_ptr(z, dt, at * K), dt, labels + at, stats + 2 * at, K, c};
    }
};
// sums (G,3,K): I, P, G of class c in group g
struct StoreRegionSums {
    float *sums;
    int K;
    __device__ void operator()(int g, int c, const double *s) const {
        for (int q = 0; q < 3; q++) sums[((size_t)g * 3 + q) * K + c] = (float)s[q];
    }
};
static void region_sums_cuda(Ops *o, Tensor logits, const int32_t *labels, int groups, float *sums,
                             float *rows_ws) {
    const int K = logits.shape.c;
    const size_t all = shape_numel(logits.shape) / K, rows = all / (size_t)groups;
    if (all) {
        CU_LAUNCH(row_softmax_stats_kernel, grid_for(all), BLOCK, 0, stream_of(o),
                  moves(bytes_of(logits) + all * 2 * sizeof(float)), logits.data, logits.dtype, K,
                  all, rows_ws);
        launchCheck();
    }
    channel_sums<3, 1>(o, RegionSums{logits.data, logits.dtype, labels, rows_ws, K, (uint32_t)rows},
                       StoreRegionSums{sums, K}, groups, rows, K,
                       bytes_of(logits) + all * (sizeof(int32_t) + 2 * sizeof(float) * K));
}

__global__ void region_coefs_kernel(int groups, int K, const float *sums, RegionArgs a,
                                    const float *class_weights, float *coefs, float *loss) {
    double total = 0.0;
    for (int g = 0; g < groups; g++)
        total += region_coefs(&a, class_weights, K, sums + (size_t)g * 3 * K,
                              coefs + (size_t)g * 2 * K);
    *loss += (float)total;
}
// blockIdx.y: the group, whose `per` rows the x blocks stride over
__global__ void region_grad_kernel(const void *z, DType dt, const int32_t *labels, int K,
                                   size_t per, const float *coefs, const float *grad_scale,
                                   void *dz, DType dt_grad) {
    const float scale = *grad_scale;
    const float *A = coefs + (size_t)blockIdx.y * 2 * K, *B = A + K;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < per;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t r = blockIdx.y * per + i;
        const int32_t y = labels[r];
        if (y < 0 || y >= K) continue;
        const size_t base = r * (size_t)K;
        float zmax = -INFINITY, sum = 0.0f, pd = 0.0f;
        for (int c = 0; c < K; c++) zmax = fmaxf(zmax, ld(z, dt, base + c));
        for (int c = 0; c < K; c++) sum += expf(ld(z, dt, base + c) - zmax);
        for (int c = 0; c < K; c++) pd += expf(ld(z, dt, base + c) - zmax) / sum * B[c];
        pd += expf(ld(z, dt, base + y) - zmax) / sum * A[y];
        for (int c = 0; c < K; c++) {
            const float p = expf(ld(z, dt, base + c) - zmax) / sum;
            const float d = B[c] + (c == y ? A[c] : 0.0f);
            st(dz, dt_grad, base + c, ld(dz, dt_grad, base + c) + p * (d - pd) * scale);
        }
    }
}
static void region_grad_cuda(Ops *o, Tensor logits, const int32_t *labels, int groups,
                             const float *sums, const RegionArgs *args, const float *class_weights,
                             const float *grad_scale, float *coefs, float *loss, Tensor dlogits) {
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K;
    CU_LAUNCH(region_coefs_kernel, 1, 1, 0, stream_of(o),
              moves(sizeof(float) * (5.0 * K * groups + K)), groups, K, sums, *args, class_weights,
              coefs, loss);
    launchCheck();
    if (!dlogits.data || !rows) return;
    const unsigned per_group = grid_for(rows) / (unsigned)groups;
    CU_LAUNCH(region_grad_kernel, dim3(per_group ? per_group : 1, groups), BLOCK, 0, stream_of(o),
              moves(bytes_of(logits) + rows * sizeof(int32_t) + 2.0 * bytes_of(dlogits)),
              logits.data, logits.dtype, labels, K, rows / (size_t)groups, coefs, grad_scale,
              dlogits.data, dlogits.dtype);
    launchCheck();
}

// ----------------------------------------------------------------------------
// lovasz (lovasz_ref states it): each row's max and 1/Σexp (row_softmax_stats_kernel),
// a sort key per (group, class, pixel) padded to a power of two per (group, class),
// the keys sorted by a bitonic network (each span's own ascending order: the
// direction bit of stage k is bit k of the position inside the span), then the
// walk: a block per chunk of LOVASZ_SORT_TILE sorted positions, F at the chunk's
// start from a scan of the chunks' counts of the class's pixels, F and B at each
// position hence its weight, its error's part of L_c and ∂L_c/∂p. The coefficients
// in one thread, the gradient a thread a row.

// the keys of span-long runs (group, class); a position past `per`, or a pixel without a label
// in 0..K-1, gets LOVASZ_PAD
__global__ void lovasz_keys_kernel(const void *z, DType dt, const int32_t *labels, int K,
                                   size_t per, int span_log2, size_t n, const float *stats,
                                   unsigned long long *keys) {
    const size_t span = (size_t)1 << span_log2;
    for (size_t t = blockIdx.x * (size_t)blockDim.x + threadIdx.x; t < n;
         t += (size_t)blockDim.x * gridDim.x) {
        const size_t i = t & (span - 1);
        const unsigned s = (unsigned)(t >> span_log2);
        const unsigned g = s / (unsigned)K, c = s % (unsigned)K;
        const size_t r = g * per + i;
        const int32_t y = i < per ? labels[r] : -1;
        if (y < 0 || y >= K) {
            keys[t] = LOVASZ_PAD;
            continue;
        }
        const float p = row_prob(z, dt, stats, r, K, (int)c);
        keys[t] = lovasz_key(y == (int32_t)c ? 1.0f - p : p, (uint32_t)i);
    }
}

// one compare-exchange of the bitonic network at pair q of stage (k, j): positions i and
// i + j, in increasing order where bit k of i's position in its span is 0
static __device__ __forceinline__ void bitonic_exchange(unsigned long long *a, size_t q, size_t at,
                                                        size_t span, size_t k, size_t j) {
    const size_t i = ((q & ~(j - 1)) << 1) | (q & (j - 1));
    const bool up = (((at + i) & (span - 1)) & k) == 0;
    const unsigned long long x = a[i], y = a[i + j];
    if ((x > y) == up) {
        a[i] = y;
        a[i + j] = x;
    }
}
// the stages of a LOVASZ_SORT_TILE-key tile in shared memory: k from k_lo to k_hi, j from
// j_top (the first k) or k/2 down to 1
__global__ void bitonic_tile_kernel(unsigned long long *keys, size_t span, size_t k_lo, size_t k_hi,
                                    size_t j_top) {
    CU_SHARED(unsigned long long, tile, [LOVASZ_SORT_TILE]);
    const size_t at = (size_t)blockIdx.x * LOVASZ_SORT_TILE;
    for (int i = threadIdx.x; i < LOVASZ_SORT_TILE; i += blockDim.x) tile[i] = keys[at + i];
    __syncthreads();
    for (size_t k = k_lo; k <= k_hi; k <<= 1)
        for (size_t j = k == k_lo ? j_top : k >> 1; j > 0; j >>= 1) {
            for (size_t q = threadIdx.x; q < LOVASZ_SORT_TILE / 2; q += blockDim.x)
                bitonic_exchange(tile, q, at, span, k, j);
            __syncthreads();
        }
    for (int i = threadIdx.x; i < LOVASZ_SORT_TILE; i += blockDim.x) keys[at + i] = tile[i];
}
// one stage (k, j ≥ LOVASZ_SORT_TILE) over all n keys
__global__ void bitonic_step_kernel(unsigned long long *keys, size_t n, size_t span, size_t k,
                                    size_t j) {
    for (size_t q = blockIdx.x * (size_t)blockDim.x + threadIdx.x; q < n / 2;
         q += (size_t)blockDim.x * gridDim.x)
        bitonic_exchange(keys, q, 0, span, k, j);
}
// each span of n keys (n/span spans, span a power of two ≥ LOVASZ_SORT_TILE) in increasing order
static void bitonic_sort(Ops *o, unsigned long long *keys, size_t n, size_t span) {
    const unsigned tiles = (unsigned)(n / LOVASZ_SORT_TILE), threads = LOVASZ_SORT_TILE / 2;
    const Traffic once = moves(2.0 * sizeof(uint64_t) * n);
    CU_LAUNCH(bitonic_tile_kernel, tiles, threads, 0, stream_of(o), once, keys, span, (size_t)2,
              (size_t)LOVASZ_SORT_TILE, (size_t)1);
    launchCheck();
    for (size_t k = 2 * (size_t)LOVASZ_SORT_TILE; k <= span; k <<= 1) {
        for (size_t j = k / 2; j >= LOVASZ_SORT_TILE; j >>= 1) {
            CU_LAUNCH(bitonic_step_kernel, grid_for(n / 2), BLOCK, 0, stream_of(o), once, keys, n,
                      span, k, j);
            launchCheck();
        }
        CU_LAUNCH(bitonic_tile_kernel, tiles, threads, 0, stream_of(o), once, keys, span, k, k,
                  (size_t)LOVASZ_SORT_TILE / 2);
        launchCheck();
    }
}

// The walk in chunks of LOVASZ_SORT_TILE positions, a block each, LOVASZ_WALK_ITEMS
// consecutive positions a thread: the class's pixels counted per chunk, those counts
// scanned per (group, class) into each chunk's F at its start and G, then each chunk's
// weights (a scan of its threads' counts gives each thread F at its first position) and
// its part of L_c, added per class in chunk order by the coefficients' thread.
#define LOVASZ_WALK_ITEMS (LOVASZ_SORT_TILE / BLOCK)
// the pixels of class c at the thread's positions of chunk `chunk` (c: the chunk's class)
static __device__ unsigned lovasz_in_class(const unsigned long long *keys, size_t chunk,
                                           int span_log2, const int32_t *labels, int K,
                                           size_t per) {
    const size_t first = chunk * LOVASZ_SORT_TILE + (size_t)threadIdx.x * LOVASZ_WALK_ITEMS;
    const unsigned s = (unsigned)(first >> span_log2), g = s / (unsigned)K, c = s % (unsigned)K;
    unsigned in = 0;
    for (int q = 0; q < LOVASZ_WALK_ITEMS; q++) {
        const unsigned long long key = keys[first + q];
        in += key != LOVASZ_PAD && labels[g * per + (uint32_t)key] == (int32_t)c;
    }
    return in;
}
__global__ void lovasz_count_kernel(const unsigned long long *keys, int span_log2,
                                    const int32_t *labels, int K, size_t per, uint32_t *counts) {
    CU_SHARED(unsigned, part, [BLOCK]);
    part[threadIdx.x] = lovasz_in_class(keys, blockIdx.x, span_log2, labels, K, per);
    __syncthreads();
    for (unsigned s = BLOCK / 2; s > 0; s >>= 1) {
        if (threadIdx.x < s) part[threadIdx.x] += part[threadIdx.x + s];
        __syncthreads();
    }
    if (threadIdx.x == 0) counts[blockIdx.x] = part[0];
}
// a thread a (group, class): its chunks' counts into their exclusive prefix sums, G into seg_in
__global__ void lovasz_offsets_kernel(uint32_t *counts, size_t chunks_per_seg, size_t segs,
                                      uint32_t *seg_in) {
    for (size_t s = blockIdx.x * (size_t)blockDim.x + threadIdx.x; s < segs;
         s += (size_t)blockDim.x * gridDim.x) {
        uint32_t sum = 0;
        for (size_t k = s * chunks_per_seg; k < (s + 1) * chunks_per_seg; k++) {
            const uint32_t c = counts[k];
            counts[k] = sum;
            sum += c;
        }
        seg_in[s] = sum;
    }
}
__global__ void lovasz_walk_kernel(const unsigned long long *keys, int span_log2,
                                   const int32_t *labels, int K, size_t per,
                                   const uint32_t *offsets, const uint32_t *seg_in, float *dl,
                                   double *chunk_loss) {
    CU_SHARED(unsigned, before, [BLOCK]);
    CU_SHARED(double, sh, [BLOCK * REDUCE_WIDTH]);
    const size_t chunk = blockIdx.x, at = chunk * LOVASZ_SORT_TILE, span = (size_t)1 << span_log2;
    const unsigned s = (unsigned)(at >> span_log2), g = s / (unsigned)K, c = s % (unsigned)K;
    const unsigned G = seg_in[s];
    const unsigned mine = G ? lovasz_in_class(keys, chunk, span_log2, labels, K, per) : 0;
    before[threadIdx.x] = mine;
    __syncthreads();
    for (unsigned off = 1; off < BLOCK; off <<= 1) {  // inclusive scan (Hillis-Steele)
        const unsigned v = threadIdx.x >= off ? before[threadIdx.x - off] : 0;
        __syncthreads();
        before[threadIdx.x] += v;
        __syncthreads();
    }
    unsigned F = offsets[chunk] + before[threadIdx.x] - mine;
    const size_t first = (at & (span - 1)) + (size_t)threadIdx.x * LOVASZ_WALK_ITEMS;
    double acc = 0.0;
    for (int q = 0; q < LOVASZ_WALK_ITEMS && G; q++) {
        const unsigned long long key = keys[at + (size_t)threadIdx.x * LOVASZ_WALK_ITEMS + q];
        if (key == LOVASZ_PAD) break;  // the valid keys come first
        const uint32_t i = (uint32_t)key;
        const int in_class = labels[g * per + i] == (int32_t)c;
        const double w = lovasz_weight(G, F, (double)(first + q) - F, in_class);
        acc += lovasz_key_error(key) * w;
        dl[((size_t)g * per + i) * K + c] = (float)(in_class ? -w : w);
        F += in_class;
    }
    sh[threadIdx.x * REDUCE_WIDTH] = acc;
    block_sum_tree(sh, 1);
    if (threadIdx.x == 0) chunk_loss[chunk] = sh[0];
}
// L_c of each (group, class) from its chunks in order, G_c, then the groups' coefficients
__global__ void lovasz_coefs_kernel(int groups, int K, size_t chunks_per_seg,
                                    const double *chunk_loss, const uint32_t *seg_in, float *seg,
                                    const float *w, float scale, float *coef, float *loss) {
    double total = 0.0;
    for (int g = 0; g < groups; g++) {
        float *sg = seg + (size_t)g * 2 * K;
        for (int c = 0; c < K; c++) {
            const size_t s = (size_t)g * K + c;
            double L = 0.0;
            for (size_t k = s * chunks_per_seg; k < (s + 1) * chunks_per_seg; k++)
                L += chunk_loss[k];
            sg[c] = (float)L;
            sg[K + c] = (float)seg_in[s];
        }
        total += lovasz_coefs(sg, w, K, scale, coef + (size_t)g * K);
    }
    *loss += (float)total;
}
// blockIdx.y: the group, whose `per` rows the x blocks stride over. p_k·(d_k - Σ_j p_j·d_j) as
// p_k·(d_k·Σ_j p_j - Σ_j p_j·d_j) = p_k·Σ_j p_j·(d_k - d_j) in fp64: where p_k is near 1 the
// difference is far below d_k, and fp32 p summing to 1 ± K ulp would swamp it
__global__ void lovasz_grad_kernel(const void *z, DType dt, const int32_t *labels, int K,
                                   size_t per, const float *stats, const float *dl,
                                   const float *coefs, const float *grad_scale, void *dz,
                                   DType dt_grad) {
    const float scale = *grad_scale;
    const float *coef = coefs + (size_t)blockIdx.y * K;
    for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < per;
         i += (size_t)blockDim.x * gridDim.x) {
        const size_t r = blockIdx.y * per + i, base = r * (size_t)K;
        const int32_t y = labels[r];
        if (y < 0 || y >= K) continue;
        double ps = 0.0, pd = 0.0;
        for (int c = 0; c < K; c++) {
            const double p = row_prob(z, dt, stats, r, K, c);
            ps += p;
            if (coef[c] != 0.0f) pd += p * ((double)coef[c] * dl[base + c]);
        }
        for (int c = 0; c < K; c++) {
            const double p = row_prob(z, dt, stats, r, K, c);
            const double d = coef[c] != 0.0f ? (double)coef[c] * dl[base + c] : 0.0;
            const float g = (float)(p * (d * ps - pd) * scale);
            st(dz, dt_grad, base + c, ld(dz, dt_grad, base + c) + g);
        }
    }
}
static void lovasz_cuda(Ops *o, Tensor logits, const int32_t *labels, int groups, float scale,
                        const float *class_weights, const float *grad_scale, void *ws, float *loss,
                        Tensor dlogits) {
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K, per = rows / (size_t)groups;
    require_below(per, (size_t)1 << 32, "pixels of a lovasz group");
    const LovaszWs w = lovasz_ws(ws, groups, per, K);
    unsigned long long *keys = (unsigned long long *)w.keys;
    const size_t n = (size_t)groups * K * w.span;
    int span_log2 = 0;
    while (((size_t)1 << span_log2) < w.span) span_log2++;
    if (rows) {
        CU_LAUNCH(row_softmax_stats_kernel, grid_for(rows), BLOCK, 0, stream_of(o),
                  moves(bytes_of(logits) + rows * 2 * sizeof(float)), logits.data, logits.dtype, K,
                  rows, w.rows);
        launchCheck();
    }
    CU_LAUNCH(lovasz_keys_kernel, grid_for(n), BLOCK, 0, stream_of(o),
              moves(bytes_of(logits) + rows * (sizeof(int32_t) + 2 * sizeof(float)) * K +
                    n * sizeof(uint64_t)),
              logits.data, logits.dtype, labels, K, per, span_log2, n, w.rows, keys);
    launchCheck();
    bitonic_sort(o, keys, n, w.span);
    const size_t chunks = n / LOVASZ_SORT_TILE, per_seg = w.span / LOVASZ_SORT_TILE,
                 segs = (size_t)groups * K;
    require_below(chunks, (size_t)1 << 31, "chunks of the lovasz sort");
    const double walk_bytes = n * sizeof(uint64_t) + rows * K * sizeof(int32_t);
    CU_LAUNCH(lovasz_count_kernel, (unsigned)chunks, BLOCK, 0, stream_of(o), moves(walk_bytes),
              keys, span_log2, labels, K, per, w.chunk_in);
    launchCheck();
    CU_LAUNCH(lovasz_offsets_kernel, grid_for(segs), BLOCK, 0, stream_of(o),
              moves(2.0 * chunks * sizeof(uint32_t)), w.chunk_in, per_seg, segs, w.seg_in);
    launchCheck();
    CU_LAUNCH(lovasz_walk_kernel, (unsigned)chunks, BLOCK, 0, stream_of(o),
              moves(walk_bytes + rows * K * sizeof(float)), keys, span_log2, labels, K, per,
              w.chunk_in, w.seg_in, w.dl, w.chunk_loss);
    launchCheck();
    CU_LAUNCH(lovasz_coefs_kernel, 1, 1, 0, stream_of(o),
              moves(chunks * sizeof(double) + sizeof(float) * 4.0 * K * groups), groups, K,
              per_seg, w.chunk_loss, w.seg_in, w.seg, class_weights, scale, w.coef, loss);
    launchCheck();
    if (!dlogits.data || !rows) return;
    const unsigned per_group = grid_for(rows) / (unsigned)groups;
    CU_LAUNCH(lovasz_grad_kernel, dim3(per_group ? per_group : 1, groups), BLOCK, 0, stream_of(o),
              moves(bytes_of(logits) + rows * (sizeof(int32_t) + 2 * sizeof(float) * (1 + K)) +
                    2.0 * bytes_of(dlogits)),
              logits.data, logits.dtype, labels, K, per, w.rows, w.dl, w.coef, grad_scale,
              dlogits.data, dlogits.dtype);
    launchCheck();
}

// the first class of the largest logit of the row at base (ties to the lowest, as the CPU's
// argmax_row: a NaN never wins unless first)
static __device__ int argmax_at(const void *logits, DType dt, size_t base, int K) {
    int best = 0;
    float zbest = ld(logits, dt, base);
    for (int c = 1; c < K; c++) {
        const float z = ld(logits, dt, base + c);
        if (z > zbest) {
            zbest = z;
            best = c;
        }
    }
    return best;
}

// Shared-memory counters are 32-bit: sm_90 adds them with one atomic instruction
// (ATOMS.ADD), where a 64-bit add to shared memory is a compare-and-swap loop
// (ATOMS.CAST.SPIN.64); a block counts fewer than 2^32 pixels (checked by the host).

// iou_per_image: a block per image counts TP, FP, FN per class in shared memory
// (integer atomics: exact), widens them to 64 bits, then its first thread adds
// the image's fixed-point mean IoU (image_iou_fixed, segnet.h).
__global__ void iou_per_image_kernel(const void *logits, DType dt, const int32_t *labels, int K,
                                     size_t per, const float *w, unsigned long long *acc) {
    CU_DYN_SHARED(int64_t, wide);  // (3,K) TP, FP, FN, then as 32-bit counters (3,K)
    unsigned *counts = reinterpret_cast<unsigned *>(wide + 3 * K);
    for (int i = threadIdx.x; i < 3 * K; i += blockDim.x) counts[i] = 0;
    __syncthreads();
    for (size_t i = threadIdx.x; i < per; i += blockDim.x) {
        const size_t r = blockIdx.x * per + i;
        const int32_t y = labels[r];
        if (y < 0 || y >= K || !(w[y] > 0.0f)) continue;
        const int best = argmax_at(logits, dt, r * (size_t)K, K);
        if (best == y) {
            atomicAdd(&counts[y], 1u);
        } else {
            atomicAdd(&counts[K + best], 1u);
            atomicAdd(&counts[2 * K + y], 1u);
        }
    }
    __syncthreads();
    for (int i = threadIdx.x; i < 3 * K; i += blockDim.x) wide[i] = counts[i];
    __syncthreads();
    if (threadIdx.x != 0) return;
    atomicAdd(&acc[0], (unsigned long long)image_iou_fixed(wide, w, K));
    atomicAdd(&acc[1], 1ull);
}
static void iou_per_image_cuda(Ops *o, Tensor logits, const int32_t *labels,
                               const float *class_weights, int64_t *acc) {
    const int K = logits.shape.c, N = logits.shape.n;
    require_below((size_t)K, IOU_IMAGE_MAX_K + 1, "classes of iou_per_image");
    if (!N) return;
    const size_t per = (size_t)logits.shape.h * logits.shape.w;
    require_below(per, (size_t)1 << 32, "pixels of an image (iou_per_image's 32-bit counters)");
    CU_LAUNCH(iou_per_image_kernel, N, BLOCK, (sizeof(int64_t) + sizeof(unsigned)) * 3 * K,
              stream_of(o),
              moves(bytes_of(logits) + N * per * sizeof(int32_t)), logits.data, logits.dtype,
              labels, K, per, class_weights, (unsigned long long *)acc);
    launchCheck();
}

// confusion[y·K + argmax_k z_k] += 1 for labels in 0..K-1, ties to the lowest
// class (the CPU's strict >, so a NaN logit never wins unless it is the first).
// Integer atomics are exact, so the counts are deterministic. For K ≤
// CONFUSION_SHARED_MAX_K each block counts in shared memory first and adds its
// K×K counts once: segmentation has few classes and many pixels, which would
// otherwise all hit the same few counters.
#define CONFUSION_SHARED_MAX_K 64  // K·K·4 bytes = 16 KiB of shared memory at most

__global__ void confusion_kernel(const void *logits, DType dt, const int32_t *labels, int K,
                                 size_t rows, unsigned long long *confusion, int in_shared) {
    CU_DYN_SHARED(unsigned, block_counts);  // (K,K) when in_shared
    if (in_shared) {
        for (int i = threadIdx.x; i < K * K; i += blockDim.x) block_counts[i] = 0;
        __syncthreads();
    }
    for (size_t r = blockIdx.x * (size_t)blockDim.x + threadIdx.x; r < rows;
         r += (size_t)blockDim.x * gridDim.x) {
        const int32_t y = labels[r];
        if (y < 0 || y >= K) continue;
        const int at = y * K + argmax_at(logits, dt, r * (size_t)K, K);
        if (in_shared) atomicAdd(&block_counts[at], 1u);
        else atomicAdd(&confusion[at], 1ull);
    }
    if (in_shared) {
        __syncthreads();
        for (int i = threadIdx.x; i < K * K; i += blockDim.x)
            if (block_counts[i]) atomicAdd(&confusion[i], (unsigned long long)block_counts[i]);
    }
}
// logits (N,H,W,K), labels (N·H·W), confusion (K,K) int64, true class by row
static void confusion_accumulate_cuda(Ops *o, Tensor logits, const int32_t *labels,
                                      int64_t *confusion) {
    const int K = logits.shape.c;
    const size_t rows = shape_numel(logits.shape) / K;
    if (!rows) return;
    const int in_shared = K <= CONFUSION_SHARED_MAX_K && rows < ((size_t)1 << 32);
    const size_t smem = in_shared ? (size_t)K * K * sizeof(unsigned) : 0;
    CU_LAUNCH(confusion_kernel, grid_for(rows), BLOCK, smem, stream_of(o),
              moves(bytes_of(logits) + rows * sizeof(int32_t)), logits.data, logits.dtype, labels,
              K, rows, (unsigned long long *)confusion, in_shared);
    launchCheck();
}

// ----------------------------------------------------------------------------
// Adam over the whole parameter buffer (the formula is at AdamStep in segnet.h),
// elementwise. Every operation is rounded on its own (__fmul_rn and friends
// cannot be fused into multiply-adds) in the CPU op's order, which is compiled
// without contraction too: both backends give the same bits.

struct AdamElement {
    AdamStep s;
    float decay, one_minus_b1, one_minus_b2;
    __device__ void operator()(float &p, float grad, float &m, float &v) const {
        float g = __fmul_rn(grad, s.grad_scale);
        if (decay != 0.0f) p = __fsub_rn(p, __fmul_rn(decay, p));
        m = __fadd_rn(m, __fmul_rn(__fsub_rn(g, m), one_minus_b1));
        v = __fadd_rn(v, __fmul_rn(__fsub_rn(__fmul_rn(g, g), v), one_minus_b2));
        p = __fsub_rn(p, __fdiv_rn(__fmul_rn(s.alpha, m), __fadd_rn(__fsqrt_rn(v), s.eps)));
    }
};
static __device__ AdamElement adam_element(const AdamStep &s) {
    return {s, __fmul_rn(s.lr, s.weight_decay), __fsub_rn(1.0f, s.beta1), __fsub_rn(1.0f, s.beta2)};
}
__global__ void adam_kernel(float *params, const float *grads, float *m, float *v, size_t n,
                            const AdamStep *step) {
    const AdamStep s = *step;
    if (s.skip) return;
    const AdamElement adam = adam_element(s);
    FOR_CHUNKS(n, base, cnt) {
        FOR_GRID(i, cnt) {
            const size_t j = base + i;
            float p = params[j], mj = m[j], vj = v[j];
            adam(p, grads[j], mj, vj);
            params[j] = p; m[j] = mj; v[j] = vj;
        }
    }
}
__global__ void adam_vec_kernel(float *params, const float *grads, float *m, float *v, size_t n_vec,
                                const AdamStep *step) {
    const AdamStep s = *step;
    if (s.skip) return;
    const AdamElement adam = adam_element(s);
    constexpr int N = Vec<float>::N;
    FOR_CHUNKS(n_vec, base, cnt) {
        FOR_GRID(i, cnt) {
            const size_t j = (base + i) * N;
            Vec<float> p = load_vec(params + j), g = load_vec(grads + j), mv = load_vec(m + j),
                       vv = load_vec(v + j);
            for (int k = 0; k < N; k++) adam(p.v[k], g.v[k], mv.v[k], vv.v[k]);
            store_vec(params + j, p); store_vec(m + j, mv); store_vec(v + j, vv);
        }
    }
}
// params, grads, m, v: (n) fp32; s: device memory
static void adam_update_cuda(Ops *o, float *params, const float *grads, float *m, float *v,
                             size_t n, const AdamStep *s) {
    if (!n) return;
    const Traffic t = moves(7.0 * sizeof(float) * n);  // p, g, m, v read; p, m, v written
    if (vec_ok({DT_F32}, n, {params, grads, m, v}))
        CU_LAUNCH(adam_vec_kernel, grid_for(n / Vec<float>::N), BLOCK, 0, stream_of(o), t, params,
                  grads, m, v, n / Vec<float>::N, s);
    else
        CU_LAUNCH(adam_kernel, grid_for(n), BLOCK, 0, stream_of(o), t, params, grads, m, v, n, s);
    launchCheck();
}

// the step's decisions (step_control_apply in segnet.h), on one thread
__global__ void step_control_kernel(const StepArgs *a, StepState *s, StepPhase phase) {
    step_control_apply(a, s, phase);
}
static void step_control_cuda(Ops *o, const StepArgs *a, StepState *s, StepPhase phase) {
    CU_LAUNCH(step_control_kernel, 1, 1, 0, stream_of(o), moves(sizeof *a + sizeof *s), a, s,
              phase);
    launchCheck();
}

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
    o.capture_begin = cuda_capture_begin;
    o.capture_end = cuda_capture_end;
    o.replay = cuda_replay;
    o.record_free = cuda_record_free;
    o.fill = fill_cuda;
    o.scale = scale_cuda;
    o.axpby = axpby_cuda;
    o.copy = copy_cuda;
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
    fprintf(stderr, "segnet: NCCL error at %s:%d: %s: %s\n", file, line, what,
            ncclGetErrorString(r));
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
static void nccl_enqueue(NcclRank *ranks, void *const *bufs, int n, size_t count, NcclKind kind,
                         int root) {
    for (int i = 0; i < n; i++) {  // the collective waits for the compute work before it
        CudaCtx *x = ctx_of(ranks[i].o);
        cudaCheck(cudaEventRecord(x->compute_done, x->stream));
        cudaCheck(cudaStreamWaitEvent(x->comm_stream, x->compute_done, 0));
    }
    ncclCheck(ncclGroupStart());
    for (int i = 0; i < n; i++) {
        CudaCtx *x = ctx_of(ranks[i].o);
        if (kind == NCCL_BROADCAST) {
            ncclCheck(ncclBroadcast(bufs[i], bufs[i], count, ncclInt8, root, ranks[i].nccl,
                                    x->comm_stream));
        } else {
            ncclDataType_t type = kind == NCCL_SUM_F32   ? ncclFloat32
                                  : kind == NCCL_SUM_F64 ? ncclFloat64
                                                         : ncclInt64;
            ncclCheck(ncclAllReduce(bufs[i], bufs[i], count, type, ncclSum, ranks[i].nccl,
                                    x->comm_stream));
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
static int nccl_allreduce_f32(Comm *c, float *buf, size_t n) {
    return nccl_collective(c, buf, n, NCCL_SUM_F32, 0);
}
static int nccl_allreduce_f64(Comm *c, double *buf, size_t n) {
    return nccl_collective(c, buf, n, NCCL_SUM_F64, 0);
}
static int nccl_allreduce_i64(Comm *c, int64_t *buf, size_t n) {
    return nccl_collective(c, buf, n, NCCL_SUM_I64, 0);
}
static int nccl_broadcast(Comm *c, void *buf, size_t bytes, int root) {
    return nccl_collective(c, buf, bytes, NCCL_BROADCAST, root);
}
// a rank that cannot go on stops the others through the host communicator
static void nccl_abort(Comm *c, const char *why) {
    NcclRank *k = (NcclRank *)c->ctx;
    k->host->abort(k->host, why);
}
static int nccl_failed_rank(Comm *c) {
    NcclRank *k = (NcclRank *)c->ctx;
    return k->host->failed_rank(k->host);
}

// dcomms[r] over the host communicator hosts[r], whose `device` it becomes
static void nccl_comm_bind(Comm *dcomm, Comm *host, NcclGroup *g, int i) {
    *dcomm = (Comm){"nccl",
                    host->rank,
                    host->size,
                    &g->ranks[i],
                    nccl_allreduce_f32,
                    nccl_allreduce_f64,
                    nccl_allreduce_i64,
                    nccl_broadcast,
                    nccl_abort,
                    nccl_failed_rank,
                    host->local_rank,
                    NULL};
    g->ranks[i].host = host;
    g->ranks[i].group = g;
    host->device = dcomm;
}

int cuda_comm_local_create(Comm *dcomms, Comm *hosts, int n, char err[SN_ERR_MAX]) {
    if (n < 1 || n > SN_MAX_REPLICAS) {
        snprintf(err, SN_ERR_MAX, "%d replicas: 1 to %d are supported", n, SN_MAX_REPLICAS);
        return -1;
    }
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
    if (!o)
        snprintf(why + strlen(why), SN_ERR_MAX - strlen(why), " (its rank on its machine: %d)",
                 host->local_rank);
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
    snprintf(err, SN_ERR_MAX,
             "%d replicas on CUDA devices need NCCL: this segnet was built without it (NO_NCCL=1)",
             n);
    return -1;
}
int cuda_comm_mpi_create(Comm *dcomm, Comm *host, char err[SN_ERR_MAX]) {
    (void)dcomm;
    snprintf(err, SN_ERR_MAX,
             "%d replicas on CUDA devices need NCCL: this segnet was built without it (NO_NCCL=1)",
             host->size);
    return -1;
}
void cuda_comm_destroy(Comm *dcomms, int n) { (void)dcomms; (void)n; }
#endif

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
