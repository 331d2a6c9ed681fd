// cuda/adam.cuh -- chapter 8 of the CUDA backend: the optimiser, Adam over the whole parameter
// buffer, and the step control (loss scale, clip factor, whether Adam skips the step).
// Needs: the seam (vectors, grids).

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
