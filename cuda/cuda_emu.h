// cuda_emu.h -- run CUDA kernel source on the CPU: the emulator behind the cuda_ tests.
// Used only when the translation unit is NOT compiled by nvcc:
//     g++ -std=c++17 -x c++ -I/usr/local/cuda/include -Iproto kernels.cu
// Types (dim3, cudaError_t, __half, cublasHandle_t, ncclComm_t ...) come from the
// real toolkit headers; the *implementations* come from cuda_emu.cpp, which is
// linked instead of libcudart / libcublas / libnccl.
#pragma once
#if defined(__CUDACC__)
#error "cuda_emu.h is for host-compiler builds only"
#endif

// 1. Execution-space qualifiers. Must be defined BEFORE the toolkit headers:
//    crt/host_defines.h only defines them when they are not defined yet, and
//    for a non-nvcc compiler it would make __shared__ expand to nothing
//    (=> a silent per-thread local array).
#define __global__
#define __device__
#define __host__
#define __constant__
#define __managed__
#define __shared__ thread_local      // block-scope thread_local == static per OS thread
                                     // == per block (a worker runs one block at a time)
#define __launch_bounds__(...)
#define __grid_constant__
#include <cuda_runtime.h>
#include <cuda_fp16.h>               // host-side __half arithmetic works with g++

#include <cstddef>
#include <cstdint>
#include <cstring>
#include <cmath>
#include <tuple>
#include <type_traits>
#include <utility>
#include <algorithm>
#include <vector>

// 2. Built-in variables: per OS thread, rewritten by the scheduler before it
//    resumes a fiber (all fibers of a block share the worker's TLS).
extern __thread uint3 threadIdx;
extern __thread uint3 blockIdx;
extern __thread dim3  blockDim;
extern __thread dim3  gridDim;
constexpr int warpSize = 32;

namespace cuemu {
// type-erased callable (no allocation)
struct Thunk { void (*fn)(void*); void* obj; void operator()() const { fn(obj); } };

void* dyn_smem();                       // this block's dynamic shared memory
// A static __shared__ variable of `bytes` at p (CU_SHARED): at its first
// registration in a block it is poisoned (0xff, unless CUEMU_POISON=0) and its
// size added to the block's static shared memory; fatal when that passes
// 48 KB (the static limit) or, with the launch's dynamic shared memory,
// 227 KB (sm_90's per-block maximum). Only the variables a block reaches count.
void static_shared(void* p, size_t bytes, const char* name);
void block_barrier();                   // __syncthreads
void warp_barrier(unsigned mask);       // __syncwarp / every shuffle
enum ShflMode { IDX, UP, DOWN, XOR };
uint64_t shfl_bits(unsigned mask, uint64_t v, ShflMode m, int arg, int width);
unsigned vote(unsigned mask, int pred); // ballot
int block_count(int pred);              // __syncthreads_count
bool is_device_ptr(const void* p);      // allocation registry (cudaMalloc)
void bad_kernel_arg(const char* kernel, int idx, const void* p);

// Kernels call this before every vector load or store of `bytes` (4, 8 or 16)
// at p, under #ifndef __CUDACC__. Fatal (abort, naming the running kernel,
// its block and thread, and the address) unless p is a multiple of `bytes` and
// [p, p + bytes) lies inside one device allocation (cudaMalloc, cudaMallocHost,
// a __device__ symbol) or inside the block's dynamic shared memory or one of
// its static shared variables (CU_SHARED) that the block has reached. With
// CUEMU_ALLOW_HOST_PTRS=1 an address outside every allocation passes the range
// check (the alignment check stays).
void check_vector_access(const void* p, size_t bytes);
// Kernels call this where a 32-bit index must stay below the launch's element
// limit (kernels.cu's LAUNCH_MAX_ELEMENTS): fatal, naming the running kernel,
// its block and thread, unless index < limit.
[[noreturn]] void index_fault(const char* what, uint64_t index, uint64_t limit);
inline void check_index(const char* what, uint64_t index, uint64_t limit) {
  if (index >= limit) index_fault(what, index, limit);
}

// Tensor-core and asynchronous-copy instructions of sm_80+, as kernels.cu's
// wrappers spell them (kernels.cu: "tensor-core tiles"). The fragment layouts
// are those the PTX ISA documents for mma.m16n8k16 with .f16/.bf16 inputs
// and ldmatrix .m8n8 .b16; cuemu_selftest checks them against its own copy of
// the tables. Warp-collective: every lane of a full warp (32 live threads)
// takes part, else fatal.
//   mma_m16n8k16: D (16×8, fp32) = A (16×16, row) · B (16×8, col) + C: the 16
//     products (exact in fp32) summed in k order in fp32, then added to C's
//     element (an fp32 dot product of 17 terms; hardware orders and rounds
//     inside its adder tree, within the same bound).
//   ldmatrix: `num` (1, 2, 4) 8×8 matrices of 16-bit elements, matrix i's
//     rows at the addresses of lanes 8i..8i+7 (16-byte aligned, in the
//     block's dynamic shared memory); register i of lane l holds row l/4,
//     columns 2(l%4), 2(l%4)+1 (trans: the transposed matrix).
//   cp_async16: 16 bytes from global memory to the block's dynamic shared
//     memory, src_bytes (0..16) of them read, the rest zero. The destination
//     holds 0xff bytes (NaN) from the call until the calling thread's
//     cp_async_wait completes its group, so a read before the wait (or
//     before the barrier that follows it) sees NaN. cp_async_commit closes
//     the thread's group; cp_async_wait(n) completes all but its n newest
//     committed groups.
enum MmaType { MMA_F16, MMA_BF16 };
void mma_m16n8k16(float d[4], const uint32_t a[4], const uint32_t b[2], const float c[4],
                  MmaType t);
void ldmatrix(uint32_t* r, int num, const void* row, bool trans);
void cp_async16(void* dst, const void* src, int src_bytes);
void cp_async_commit();
void cp_async_wait(int newest_pending);

// The last-block protocol (kernels.cu: last_block, from_other_blocks), checked
// where it runs. A hazard (a bug the GPU would not report: see cuemu_count's
// "hazards") names the kernel, block and thread when
//   - a thread of a block that counts itself did not __threadfence in the
//     barrier interval before the count (last_block_arrive, called by the
//     counting thread after that barrier), or wrote global memory after its
//     fence (seen in the race-checked build only);
//   - a thread reads other blocks' partials (read_other_blocks, the emulated
//     from_other_blocks) in a block that was not counted last, or before the
//     counting thread fenced after its count (the acquire half).
void thread_fence();                      // __threadfence
void last_block_arrive();
void last_block_counted(bool last);       // the counting thread, right after its atomic
void read_other_blocks(void* dst, const void* src, size_t bytes);

void copy_bytes(void* dst, const void* src, size_t n);   // memcpy, outside the race checker's view
template <class T> void add_pointer(std::vector<const void*>& out, const T& a) {
  if constexpr (std::is_pointer_v<T>)
    if (a) out.push_back((const void*)a);
}
template <class T> void check_arg(const char* k, int i, const T& a) {
  if constexpr (std::is_pointer_v<T>)
    if (a && !is_device_ptr((const void*)a)) bad_kernel_arg(k, i, (const void*)a);
}

// A kernel bound to a copy of its launch's arguments (the launch parameter
// buffer). Every simulated thread calls run(), which passes the arguments BY
// VALUE, so a kernel may modify its parameters. A captured launch (graph node)
// keeps a clone: its replays see the values of the capture.
struct BoundKernel {
  virtual ~BoundKernel() = default;
  virtual void run() = 0;                               // the kernel, as the current thread
  virtual void check_args(const char* name) const = 0;  // pointer arguments are device memory
  virtual void pointers(std::vector<const void*>& out) const = 0;  // its pointer arguments
  virtual BoundKernel* clone() const = 0;
};
template <class F, class... P> struct BoundLaunch final : BoundKernel {
  F kernel;
  std::tuple<P...> params;
  template <class... A>
  explicit BoundLaunch(F k, A &&...a) : kernel(k), params(std::forward<A>(a)...) {}
  // the arguments are copied onto the simulated thread's stack first, by the
  // emulator (copy_bytes, which the race checker does not see): the GPU gives
  // every thread the parameter buffer, which is not memory a kernel could race on
  void run() override {
    static_assert((std::is_trivially_copyable_v<P> && ...), "kernel arguments are copied bytes");
    alignas(std::tuple<P...>) unsigned char own[sizeof params];
    copy_bytes(own, &params, sizeof params);
    F k;
    copy_bytes(&k, &kernel, sizeof k);
    std::apply(k, *reinterpret_cast<std::tuple<P...>*>(own));
  }
  void check_args(const char* name) const override {
    std::apply([&](const auto&... x) { int i = 0; (check_arg(name, i++, x), ...); }, params);
  }
  void pointers(std::vector<const void*>& out) const override {
    std::apply([&](const auto&... x) { (add_pointer(out, x), ...); }, params);
  }
  BoundKernel* clone() const override { return new BoundLaunch(*this); }
};
struct LaunchConfig {
    const char *name;
    const void *func;
    dim3 grid, block;
    size_t smem;
    cudaStream_t stream;
    double bytes, flops;  // what the launch moves and computes (next_launch_traffic)
};
// Runs, counts (CUEMU_COUNT) or captures the launch; a bad configuration is
// the launch error that cudaGetLastError returns.
void submit_launch(const LaunchConfig& c, BoundKernel& k);
// The bytes and FLOPs that the calling thread's next launch declares (kernels.cu's
// Traffic); the count file adds them up by configuration ("traffic" lines).
void next_launch_traffic(double bytes, double flops);

template <class... P, class... A>
void launch(const char *name, void (*k)(P...), dim3 g, dim3 b, size_t smem, cudaStream_t s,
            A &&...a) {
    static_assert(sizeof...(P) == sizeof...(A), "wrong number of kernel arguments");
    BoundLaunch<void (*)(P...), std::decay_t<P>...> bound(k, std::forward<A>(a)...);
    submit_launch(LaunchConfig{name, reinterpret_cast<const void *>(k), g, b, smem, s, 0.0, 0.0},
                  bound);
}

template <class T> T from_bits(uint64_t b) { T r; std::memcpy(&r, &b, sizeof(T)); return r; }
template <class T> uint64_t to_bits(T v) {
    static_assert(sizeof(T) <= 8 && std::is_trivially_copyable_v<T>);
    uint64_t b = 0;
    std::memcpy(&b, &v, sizeof(T));
    return b;
}
template <class T> T cas_add(T* p, T v) {  // float/double atomicAdd via CAS on the bit pattern
  using U = std::conditional_t<sizeof(T) == 4, uint32_t, uint64_t>;
  U* q = reinterpret_cast<U*>(p);
  U old = __atomic_load_n(q, __ATOMIC_RELAXED), nw;
  do { T f; std::memcpy(&f, &old, sizeof f); f += v; std::memcpy(&nw, &f, sizeof f); }
  while (!__atomic_compare_exchange_n(q, &old, nw, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED));
  T r; std::memcpy(&r, &old, sizeof r); return r;
}
}  // namespace cuemu

// The emulator's own API (not CUDA's).
// Threads and blocks of the following launches in reverse order (1) or in
// order (0); CUEMU_ORDER=reverse sets it at start. Graph replays then also run
// independent branches in reverse (see cudaGraphLaunch in cuda_emu.cpp).
extern "C" void cuemu_set_reverse(int reverse);
// Blocks, and a block's threads, in a random order drawn from `seed` and the
// launch's number since this call (on = 1), renewed after every barrier; graph replays run
// branches in order. CUEMU_ORDER=random:SEED sets it at start. Off: in order.
extern "C" void cuemu_set_random(int on, unsigned long long seed);
// Device allocations from now on packed back to back between canaries, as the
// planner packs a step's tensors (1), or each before a guard page (0, the
// default); CUEMU_ARENA=1 sets it at start. See "the arena" in cuda_emu.cpp.
extern "C" void cuemu_set_arena(int on);
// Counters since the start, -1 for another name:
//   launches          kernels run (eager or replayed graph nodes; counting mode: would have run)
//   api_launches      host launch calls: eager kernel launches plus cudaGraphLaunch calls
//   graph_launches    cudaGraphLaunch calls
//   blas_calls        cuBLAS GEMMs run (eager or replayed)
//   nccl_calls        NCCL collectives run (eager or replayed)
//   syncs             host waits: device, stream and event synchronisation,
//                     cudaMemcpy to or from the host, and cudaMemcpyAsync
//                     between the device and pageable host memory
//   h2d_bytes, d2h_bytes, d2d_bytes   bytes copied (cudaMemcpy*, replayed copy nodes)
//   allocs            cudaMalloc calls that succeeded
//   alloc_bytes_peak  the most device memory (cudaMalloc) live at once
//   hazards           bugs found that a GPU would not report where they happen
//                     (races, the last-block protocol's fences, writes past
//                     an allocation in arena mode), each also a line on stderr
extern "C" long long cuemu_count(const char* name);
// Counting mode (1): kernels, cuBLAS and NCCL calls are counted and not run;
// new device memory is reserved, not committed (reads as zero, no NaN
// poisoning); copies to and from the host still copy. 0: back to running.
extern "C" void cuemu_set_count_only(int on);
// Counting mode from now on, and at exit the counters written to `path` as
// "name value" lines. CUEMU_COUNT=path in the environment calls it at start.
extern "C" void cuemu_count_to_file(const char* path);
// The emulator's checks of its own semantics (graphs, counting, limits): the
// number that failed, one line per failure in `report`.
extern "C" int cuemu_selftest(char* report, size_t n);

// 3. Launch macro (same spelling in both builds, see cuda_compat.h).
//    Template kernels: wrap the name in parentheses: CU_LAUNCH((k<float,256>), ...)
#define CU_LAUNCH_RAW(kernel, grid, block, smem, stream, ...) \
  ::cuemu::launch(#kernel, kernel, dim3(grid), dim3(block), (smem), (stream), ##__VA_ARGS__)
#define CU_LAUNCH CU_LAUNCH_RAW  // kernels.cu times its launches around it
#define CU_DYN_SHARED(T, name) T* name = static_cast<T*>(::cuemu::dyn_smem())
// Static shared memory: a thread_local (one block per OS thread at a time) that
// every thread registers as it passes the declaration; the block's first
// registration fills it with 0xff bytes (NaN), as dynamic shared memory, and
// counts its size against the limits (cuemu::static_shared).
#define CU_SHARED(T, name, dims) \
  thread_local T name dims;      \
  ::cuemu::static_shared(&name, sizeof name, #name)

// cuda_runtime.h hides its C++ symbol templates behind __CUDACC__: provide them.
// __device__/__constant__ variables are plain globals here.
template <class T>
cudaError_t cudaMemcpyToSymbol(const T &sym, const void *src, size_t n, size_t off = 0,
                               cudaMemcpyKind = cudaMemcpyHostToDevice) {
    std::memcpy((char *)&sym + off, src, n);
    return cudaSuccess;
}
template <class T>
cudaError_t cudaMemcpyFromSymbol(void *dst, const T &sym, size_t n, size_t off = 0,
                                 cudaMemcpyKind = cudaMemcpyDeviceToHost) {
    std::memcpy(dst, (const char *)&sym + off, n);
    return cudaSuccess;
}
namespace cuemu { void register_device_range(const void* p, size_t n); }
template <class T> cudaError_t cudaGetSymbolAddress(void **p, const T &sym) {
    *p = (void *)&sym;
    cuemu::register_device_range(&sym, sizeof(T));
    return cudaSuccess;
}
// The kernel-pointer form of cudaFuncSetAttribute (nvcc's headers have it as a
// template too); the attributes are kept per kernel function.
template <class T> cudaError_t cudaFuncSetAttribute(T* kernel, cudaFuncAttribute attr, int value) {
  return ::cudaFuncSetAttribute(reinterpret_cast<const void*>(kernel), attr, value);
}

// 4. Synchronisation, warp intrinsics
inline void __syncthreads() { cuemu::block_barrier(); }
inline int __syncthreads_count(int p) { return cuemu::block_count(p); }
inline int __syncthreads_or(int p) { return cuemu::block_count(p) != 0; }
inline int __syncthreads_and(int p) {
    return cuemu::block_count(p) == (int)(blockDim.x * blockDim.y * blockDim.z);
}
inline void __syncwarp(unsigned mask = 0xffffffffu) { cuemu::warp_barrier(mask); }
template <class T> T __shfl_sync(unsigned m, T v, int src, int w = 32) {
    return cuemu::from_bits<T>(cuemu::shfl_bits(m, cuemu::to_bits(v), cuemu::IDX, src, w));
}
template <class T> T __shfl_up_sync(unsigned m, T v, unsigned d, int w = 32) {
    return cuemu::from_bits<T>(cuemu::shfl_bits(m, cuemu::to_bits(v), cuemu::UP, (int)d, w));
}
template <class T> T __shfl_down_sync(unsigned m, T v, unsigned d, int w = 32) {
    return cuemu::from_bits<T>(cuemu::shfl_bits(m, cuemu::to_bits(v), cuemu::DOWN, (int)d, w));
}
template <class T> T __shfl_xor_sync(unsigned m, T v, int lm, int w = 32) {
    return cuemu::from_bits<T>(cuemu::shfl_bits(m, cuemu::to_bits(v), cuemu::XOR, lm, w));
}
inline unsigned __ballot_sync(unsigned m, int p) { return cuemu::vote(m, p); }
inline int __any_sync(unsigned m, int p) { return cuemu::vote(m, p) != 0; }
inline int __all_sync(unsigned m, int p) { return cuemu::vote(m, !p) == 0; }
inline void __threadfence() { cuemu::thread_fence(); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// 5. Atomics (real atomics: blocks may run on several OS threads)
inline int atomicAdd(int* p, int v) { return __atomic_fetch_add(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned *p, unsigned v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline unsigned long long atomicAdd(unsigned long long *p, unsigned long long v) {
    return __atomic_fetch_add(p, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float* p, float v) { return cuemu::cas_add(p, v); }
inline double atomicAdd(double* p, double v) { return cuemu::cas_add(p, v); }
inline int atomicSub(int* p, int v) { return __atomic_fetch_sub(p, v, __ATOMIC_RELAXED); }
inline int atomicExch(int* p, int v) { return __atomic_exchange_n(p, v, __ATOMIC_RELAXED); }
inline unsigned atomicExch(unsigned* p, unsigned v) {
    return __atomic_exchange_n(p, v, __ATOMIC_RELAXED);
}
inline float atomicExch(float *p, float v) {
    float r;
    __atomic_exchange(p, &v, &r, __ATOMIC_RELAXED);
    return r;
}
inline int atomicCAS(int *p, int c, int v) {
    __atomic_compare_exchange_n(p, &c, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return c;
}
inline unsigned atomicCAS(unsigned *p, unsigned c, unsigned v) {
    __atomic_compare_exchange_n(p, &c, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return c;
}
inline unsigned long long atomicCAS(unsigned long long *p, unsigned long long c,
                                    unsigned long long v) {
    __atomic_compare_exchange_n(p, &c, v, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);
    return c;
}
inline int atomicMax(int *p, int v) {
    int o = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (o < v &&
           !__atomic_compare_exchange_n(p, &o, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return o;
}
inline int atomicMin(int *p, int v) {
    int o = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (o > v &&
           !__atomic_compare_exchange_n(p, &o, v, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {}
    return o;
}

// 6. A few device intrinsics / math (extend as kernels need them)
inline float __expf(float x) { return expf(x); }
inline float __logf(float x) { return logf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
// IEEE operations rounded one by one, never fused into multiply-adds (as nvcc
// promises for the _rn intrinsics), and __fmaf_rn rounded once. The emulator's
// contraction build (-ffp-contract=fast, kernels_strict.o) fuses a * b + c
// wherever it can, as nvcc does: the empty asm makes each result a value the
// compiler cannot fuse with what follows.
namespace cuemu {
inline float rounded(float r) { asm("" : "+x"(r)); return r; }
}
inline float __fadd_rn(float a, float b) { return cuemu::rounded(a + b); }
inline float __fsub_rn(float a, float b) { return cuemu::rounded(a - b); }
inline float __fmul_rn(float a, float b) { return cuemu::rounded(a * b); }
inline float __fdiv_rn(float a, float b) { return cuemu::rounded(a / b); }
inline float __fsqrt_rn(float x) { return cuemu::rounded(sqrtf(x)); }
inline float __fmaf_rn(float a, float b, float c) { return fmaf(a, b, c); }
inline float __saturatef(float x) { return fminf(fmaxf(x, 0.f), 1.f); }
inline int __float_as_int(float f) { int i; std::memcpy(&i, &f, 4); return i; }
inline float __int_as_float(int i) { float f; std::memcpy(&f, &i, 4); return f; }
inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __clz(int x) { return x ? __builtin_clz((unsigned)x) : 32; }
template <class T> inline T __ldg(const T* p) { return *p; }
// CUDA has mixed-type min/max overloads; std::min would reject min(int, unsigned)
template <class A, class B> inline std::common_type_t<A, B> min(A a, B b) { return b < a ? b : a; }
template <class A, class B> inline std::common_type_t<A, B> max(A a, B b) { return a < b ? b : a; }
