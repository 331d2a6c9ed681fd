// cuda/seam.cuh -- chapter 1 of the CUDA backend (kernels.cu includes the chapters in the
// porting order, doc/porting.md): what every kernel stands on. The porting seam (the warp,
// the tensor-core tile), indexing and memory access (storage types, 16-byte vectors, row
// grids), grids sized to fill the machine, device memory and copies, and the map kernels over
// whole buffers (fill, copy, scale, axpby).
// Needs from kernels.cu: the checks, CU_LAUNCH and Traffic, CudaCtx (ctx_of, stream_of), BLOCK.

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
static void cuda_synchronize(Ops *o) {
    CudaCtx *x = ctx_of(o);
    cudaCheck(cudaStreamSynchronize(x->stream));
    cudaCheck(cudaStreamSynchronize(x->copy_stream));  // the uploads queued ahead, too
}
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
static void cuda_upload_ahead(Ops *o, void *dst, const void *pinned_src, size_t bytes) {
    CudaCtx *x = ctx_of(o);
    cudaCheck(cudaEventRecord(x->copy_start, x->stream));
    cudaCheck(cudaStreamWaitEvent(x->copy_stream, x->copy_start, 0));
    cudaCheck(cudaMemcpyAsync(dst, pinned_src, bytes, cudaMemcpyHostToDevice, x->copy_stream));
}
static void cuda_await_uploads(Ops *o) {
    CudaCtx *x = ctx_of(o);
    cudaCheck(cudaEventRecord(x->copy_done, x->copy_stream));
    cudaCheck(cudaStreamWaitEvent(x->stream, x->copy_done, 0));
}
static void cuda_copy_async(Ops *o, void *dst, const void *src, size_t bytes) {
    cudaCheck(cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, stream_of(o)));
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
// y (=|+=) x between two storage types, CAST_N elements a thread: the fp32 side in two
// 16-byte accesses, the 16-bit side in one, the same values as map_kernel's Identity (one
// element and 2 or 4 bytes in flight a thread: 0.12 of an H200's bandwidth by the SASS,
// for the step's cast of the fp32 weights to the storage type and of the images)
#define CAST_N 8
template <class T> static __device__ __forceinline__ void load_cast_run(const T *p, float *v) {
    constexpr int W = Vec<T>::N;
    Vec<T> x[CAST_N / W];
    for (int h = 0; h < CAST_N / W; h++) x[h] = load_vec(p + h * W);  // every load, then the use
    for (int h = 0; h < CAST_N / W; h++)
        for (int k = 0; k < W; k++) v[h * W + k] = to_f32(x[h].v[k]);
}
template <class T> static __device__ __forceinline__ void store_cast_run(T *p, const float *v) {
    constexpr int W = Vec<T>::N;
    for (int h = 0; h < CAST_N / W; h++) {
        Vec<T> x;
        for (int k = 0; k < W; k++) x.v[k] = from_f32<T>(v[h * W + k]);
        store_vec(p + h * W, x);
    }
}
template <class TY, class TX>
__global__ void cast_vec_kernel(TY *y, const TX *x, size_t n_vec, int accumulate) {
    FOR_VEC_CHUNKS(n_vec, CAST_N, base, m) {
        TY *yc = y + base * CAST_N;
        const TX *xc = x + base * CAST_N;
        FOR_GRID(i, m) {
            const uint32_t e = vec_elem<CAST_N>(i);
            float v[CAST_N], old[CAST_N];
            load_cast_run(xc + e, v);
            if (accumulate) {
                load_cast_run(yc + e, old);
                for (int k = 0; k < CAST_N; k++) v[k] = old[k] + v[k];
            }
            store_cast_run(yc + e, v);
        }
    }
}
// y = x's bytes as values 0..255, CAST_N a thread: one 8-byte load, the stores as
// cast_vec_kernel's (a batch's images upload as 8-bit and widen here)
template <class T> __global__ void widen_bytes_vec_kernel(T *y, const uint8_t *x, size_t n_vec) {
    FOR_VEC_CHUNKS(n_vec, CAST_N, base, m) {
        T *yc = y + base * CAST_N;
        const uint8_t *xc = x + base * CAST_N;
        FOR_GRID(i, m) {
            const uint32_t e = vec_elem<CAST_N>(i);
            const VecB<uint8_t, CAST_N> b = load_vec<uint8_t, CAST_N>(xc + e);
            float v[CAST_N];
            for (int k = 0; k < CAST_N; k++) v[k] = (float)b.v[k];
            store_cast_run(yc + e, v);
        }
    }
}
// the same an element a thread: the tail, or unaligned buffers
__global__ void widen_bytes_kernel(void *y, DType dty, const uint8_t *x, size_t n) {
    FOR_CHUNKS(n, base, m) {
        void *yc = elem_ptr(y, dty, base);
        const uint8_t *xc = x + base;
        FOR_GRID(i, m) st(yc, dty, i, (float)xc[i]);
    }
}
// whether cast_vec_kernel applies: two storage types, at least one run, 16-byte aligned
static bool cast_vec_ok(Tensor y, Tensor x, size_t n) {
    return cuda_vector_kernels && y.dtype != x.dtype && n >= CAST_N &&
           (uintptr_t)y.data % VEC_BYTES == 0 && (uintptr_t)x.data % VEC_BYTES == 0;
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
    const size_t n = shape_numel(dst.shape);
    if (!n || !dst.data || !cast_vec_ok(dst, src, n)) {
        map_op(o, dst, src, NO_TENSOR, accumulate, Identity{});
        return;
    }
    // whole runs here, the last n % CAST_N elements by the map kernel
    const size_t runs = n / CAST_N, head = runs * CAST_N;
    const Traffic t =
            moves(bytes_of(head, dst.dtype) * (accumulate ? 2 : 1) + bytes_of(head, src.dtype));
    SWITCH_STORAGE(dst.dtype, TY, SWITCH_STORAGE(src.dtype, TX, {
        CU_LAUNCH((cast_vec_kernel<TY, TX>), grid_for(runs), BLOCK, 0, stream_of(o), t,
                  (TY *)dst.data, (const TX *)src.data, runs, accumulate);
    }));
    launchCheck();
    if (head == n) return;
    const Shape tail = shape4((int)(n - head), 1, 1, 1);
    map_op(o, tensor(elem_ptr(dst.data, dst.dtype, head), tail, dst.dtype),
           tensor(elem_ptr(src.data, src.dtype, head), tail, src.dtype), NO_TENSOR, accumulate,
           Identity{});
}
static void widen_bytes_cuda(Ops *o, Tensor images, const uint8_t *bytes) {
    const size_t n = shape_numel(images.shape);
    if (!n) return;
    const bool vec = cuda_vector_kernels && (uintptr_t)images.data % VEC_BYTES == 0 &&
                     (uintptr_t)bytes % CAST_N == 0;
    const size_t runs = vec ? n / CAST_N : 0, head = runs * CAST_N;
    if (runs) {
        SWITCH_STORAGE(images.dtype, T, {
            CU_LAUNCH((widen_bytes_vec_kernel<T>), grid_for(runs), BLOCK, 0, stream_of(o),
                      moves(head + bytes_of(head, images.dtype)), (T *)images.data, bytes, runs);
        });
        launchCheck();
    }
    if (head == n) return;
    CU_LAUNCH(widen_bytes_kernel, grid_for(n - head), BLOCK, 0, stream_of(o),
              moves(n - head + bytes_of(n - head, images.dtype)),
              elem_ptr(images.data, images.dtype, head), images.dtype, bytes + head, n - head);
    launchCheck();
}
// t *= a
static void scale_cuda(Ops *o, Tensor t, float a) { map_op(o, t, t, NO_TENSOR, 0, Scale{a}); }
// y (=|+=) a·x + b
static void axpby_cuda(Ops *o, Tensor y, Tensor x, float a, float b, int accumulate) {
    map_op(o, tensor(y.data, x.shape, y.dtype), x, NO_TENSOR, accumulate, Axpb{a, b});
}
