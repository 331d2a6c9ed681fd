// cuda_emu_probes.cpp -- tiny kernels with planted bugs (and their correct
// twins) on which cuemu_selftest checks the emulator's hazard checks: the race
// checker, the last-block protocol, the arena's canaries. Compiled like the
// strict build's kernels (-fsanitize=thread: every access goes to the race
// checker; see "the race checker" in cuda_emu.cpp), in every emulated build.
#include "cuda_emu.h"
#include <string>

namespace probes {
// ---- shared memory
// every thread adds 1 to one of two shared counters: plainly (a race) or atomically
__global__ void shared_counter(unsigned *out, int atomic) {
    CU_SHARED(unsigned, counts, [2]);
    if (threadIdx.x < 2) counts[threadIdx.x] = 0;
    __syncthreads();
    if (atomic) atomicAdd(&counts[threadIdx.x % 2], 1u);
    else counts[threadIdx.x % 2] += 1;
    __syncthreads();
    if (threadIdx.x < 2) out[threadIdx.x] = counts[threadIdx.x];
}
// each thread writes its slot and reads the slot of a thread in the other
// warp, with a barrier between (correct) or without (a race)
__global__ void shared_neighbour(float *out, int barrier) {
    CU_DYN_SHARED(float, sm);
    sm[threadIdx.x] = (float)threadIdx.x;
    if (barrier) __syncthreads();
    out[threadIdx.x] = sm[(threadIdx.x + 32) % 64];
}
// the same inside one warp, ordered by __syncwarp (correct) or not (a race)
__global__ void warp_neighbour(float *out, int syncwarp) {
    CU_SHARED(float, sm, [32]);
    sm[threadIdx.x] = (float)threadIdx.x;
    if (syncwarp) __syncwarp();
    out[threadIdx.x] = sm[(threadIdx.x + 1) % 32];
}

// ---- global memory
// block b writes its element, then reads block b + 1's: a race (the last
// block reads a value the first wrote in this launch, whatever the order)
__global__ void global_neighbour(float *x) {
    if (threadIdx.x != 0) return;
    x[blockIdx.x] = (float)blockIdx.x;
    x[gridDim.x + blockIdx.x] = x[(blockIdx.x + 1) % gridDim.x];
}
// every block writes one word: plainly (a race) or atomically
__global__ void global_same_word(int *x, int atomic) {
    if (threadIdx.x != 0) return;
    if (atomic) atomicAdd(x, 1);
    else *x = (int)blockIdx.x;
}
// a 4-byte read at element i of x (a planted read past the end when i is)
__global__ void read_at(const float *x, int i, float *out) {
    if (threadIdx.x == 0) *out = x[i];
}

// ---- the last-block protocol, as kernels.cu's last_block and reduce_finish
// write it, with one step left out or done the wrong way (flaw):
enum Flaw { NONE, NO_FENCE_BEFORE, NO_FENCE_AFTER, PLAIN_READ, READ_IN_OTHER_BLOCK };
__global__ void last_block_sum(float *partials, unsigned *count, float *out, int flaw) {
    CU_SHARED(bool, last, );
    if (threadIdx.x == 0) partials[blockIdx.x] = (float)(blockIdx.x + 1);
    if (flaw != NO_FENCE_BEFORE) __threadfence();
    __syncthreads();
    if (threadIdx.x == 0) {
        cuemu::last_block_arrive();
        last = atomicAdd(count, 1u) == gridDim.x - 1;
        cuemu::last_block_counted(last);
        if (last) {
            if (flaw != NO_FENCE_AFTER) __threadfence();
            atomicExch(count, 0u);
        }
    }
    __syncthreads();
    if (!last && flaw != READ_IN_OTHER_BLOCK) return;
    if (last && flaw == READ_IN_OTHER_BLOCK) return;
    if (threadIdx.x != 0) return;
    float s = 0.0f;
    for (unsigned b = 0; b < gridDim.x; b++) {
        float v;
        if (flaw == PLAIN_READ) v = partials[b];
        else cuemu::read_other_blocks(&v, &partials[b], sizeof v);
        s += v;
    }
    *out = s;
}
}  // namespace probes

// The probes by name, each launched once on the legacy stream with its own
// buffers; the selftest (cuda_emu.cpp, "hazards") reads what they report.
// Returns false for an unknown name.
bool cuemu_run_probe(const char *name) {
    using namespace probes;
    float *f = nullptr, *g = nullptr;
    unsigned *u = nullptr;
    int *word = nullptr;
    cudaMalloc(&f, 256 * sizeof(float));
    cudaMalloc(&g, 256 * sizeof(float));
    cudaMalloc(&u, 2 * sizeof(unsigned));
    cudaMalloc(&word, sizeof(int));
    cudaMemset(u, 0, 2 * sizeof(unsigned));
    bool known = true;
    const std::string n = name;
    if (n == "shared_counter_plain") CU_LAUNCH(shared_counter, 1, 64, 0, nullptr, u, 0);
    else if (n == "shared_counter_atomic") CU_LAUNCH(shared_counter, 1, 64, 0, nullptr, u, 1);
    else if (n == "shared_barrier")
        CU_LAUNCH(shared_neighbour, 1, 64, 64 * sizeof(float), nullptr, f, 1);
    else if (n == "shared_no_barrier")
        CU_LAUNCH(shared_neighbour, 1, 64, 64 * sizeof(float), nullptr, f, 0);
    else if (n == "warp_syncwarp") CU_LAUNCH(warp_neighbour, 1, 32, 0, nullptr, f, 1);
    else if (n == "warp_no_syncwarp") CU_LAUNCH(warp_neighbour, 1, 32, 0, nullptr, f, 0);
    else if (n == "global_neighbour") CU_LAUNCH(global_neighbour, 8, 32, 0, nullptr, f);
    else if (n == "global_same_word_plain") CU_LAUNCH(global_same_word, 8, 32, 0, nullptr, word, 0);
    else if (n == "global_same_word_atomic")
        CU_LAUNCH(global_same_word, 8, 32, 0, nullptr, word, 1);
    else if (n == "read_inside") CU_LAUNCH(read_at, 1, 32, 0, nullptr, f, 255, g);
    else if (n == "read_past_end") CU_LAUNCH(read_at, 1, 32, 0, nullptr, f, 256, g);
    else if (n == "last_block") CU_LAUNCH(last_block_sum, 8, 64, 0, nullptr, f, u, g, (int)NONE);
    else if (n == "last_block_no_fence_before")
        CU_LAUNCH(last_block_sum, 8, 64, 0, nullptr, f, u, g, (int)NO_FENCE_BEFORE);
    else if (n == "last_block_no_fence_after")
        CU_LAUNCH(last_block_sum, 8, 64, 0, nullptr, f, u, g, (int)NO_FENCE_AFTER);
    else if (n == "last_block_plain_read")
        CU_LAUNCH(last_block_sum, 8, 64, 0, nullptr, f, u, g, (int)PLAIN_READ);
    else if (n == "last_block_read_in_other_block")
        CU_LAUNCH(last_block_sum, 8, 64, 0, nullptr, f, u, g, (int)READ_IN_OTHER_BLOCK);
    else known = false;
    cudaDeviceSynchronize();
    cudaFree(f); cudaFree(g); cudaFree(u); cudaFree(word);
    return known;
}
