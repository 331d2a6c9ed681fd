// cuda/reductions.cuh -- chapter 2 of the CUDA backend: the deterministic reductions. The
// last-block protocol (last_block, from_other_blocks), sum_squares and nonfinite, and
// channel_sums, the per-channel sums over rows that batch norm, squeeze-excitation, the bias
// gradients and the region losses share.
// Needs: the seam (cuda/seam.cuh); the context's scratch (CudaCtx: reduce_partials, sums,
// sums_done; REDUCE_BLOCKS_MAX, SUMS_COUNTERS in kernels.cu).

// ----------------------------------------------------------------------------
// the last block: the block of a launch that finishes last adds the others' partials

// A value another block wrote before it counted itself in last_block: read
// past this SM's L1 (ld.global.cg, from L2, where the writer's fence put it),
// which a plain load does not promise; the one way a last block reads the
// group's partials (last_block_reads_past_l1 checks kernels.cu and its chapters). The
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
