// cuda/implicit_gemm.cuh -- chapter 6 of the CUDA backend: the hand-written convs, implicit
// GEMMs on tensor cores (conv_fwd_kernel, conv_dgrad_kernel, conv_wgrad_kernel), then the
// conv2d entries (conv2d_forward_cuda, ...), which send each conv down this path, cuBLAS's or
// the depthwise kernels.
// Needs: the seam's tile interface (tc_mma, tc_load_a, ...) and cp_async16; the reductions'
// last-block protocol and bias_grad; the conv plan, im2col and the depthwise launchers
// (cuda/gemm_conv.cuh).

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
