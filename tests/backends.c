// tests/backends.c -- the backends: the ops table, choosing one, the CUDA backend's whole steps.
// Part of test_segnet.c, which includes it: one program, its tests run in the order
// they are written (test_segnet.c, then tests/harness.c, step.c, backends.c,
// application.c, sources.c).

// ----------------------------------------------------------------------------
// the backends: the ops table, choosing one, the reference table against ops_cpu

// OPS_ENTRIES names every function entry of struct Ops (they follow `ctx`, all
// function pointers), and the CPU table fills them all.
TEST(ops_entries_listed) {
    size_t entries = (sizeof(Ops) - offsetof(Ops, alloc)) / sizeof(void (*)(void));
    CHECK(N_OPS_ENTRIES == entries, "OPS_ENTRIES lists %zu entries, struct Ops has %zu",
          (size_t)N_OPS_ENTRIES, entries);
    for (size_t i = 1; i < N_OPS_ENTRIES; i++)
        CHECK(OPS_ENTRIES[i].offset == OPS_ENTRIES[i - 1].offset + sizeof(void (*)(void)),
              "OPS_ENTRIES[%zu] '%s' out of order", i, OPS_ENTRIES[i].name);
    char missing[4096];
    CHECK(ops_missing(&ops_cpu, missing, sizeof missing) == 0, "ops_cpu lacks %s", missing);
    Ops partial = ops_cpu;
    partial.bn_stats = NULL; partial.adam_update = NULL;
    CHECK(ops_missing(&partial, missing, sizeof missing) == 2 &&
                  !strcmp(missing, "bn_stats, adam_update"),
          "two NULL entries: '%s'", missing);
    char err[SN_ERR_MAX];
    CHECK(ops_for_device(DEVICE_CPU, 0, err) == &ops_cpu, "--device cpu");
}

// ./segnet --device: cpu runs without a notice and records the device in
// config.txt; cuda either runs (a GPU) or is one line naming --device cuda, exit
// 1, no run folder; auto without a GPU is the CPU with one notice line; a bad
// value is refused with exit 2.
TEST(device_choice) {
    const char *data = "/tmp/segnet_test_device_data", *run = "/tmp/segnet_test_device_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 2, 8, 8, 3);
    char args[1024], msg[4096], path[512];
    const char *base =
            "train --model unet --depth 1 --width 2 --size 8x8 --batch 2 --epochs 1 --classes 3";
    snprintf(args, sizeof args, "%s --data %s --out %s/cpu --device cpu", base, data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0 && !contains(msg, "running on the CPU"),
          "--device cpu: %s", msg);
    snprintf(path, sizeof path, "%s/cpu/config.txt", run);
    size_t n;
    char *cfg = read_file(path, &n);
    CHECK(cfg && contains(cfg, "\ndevice = cpu\n"), "config.txt records the device: %s",
          cfg ? cfg : "(missing)");
    free(cfg);
    // config.txt's device read back
    snprintf(args, sizeof args, "train --resume %s/cpu --epochs 2", run);
    CHECK(run_segnet(args, msg, sizeof msg) == 0 && !contains(msg, "running on the CPU"),
          "resume with device = cpu: %s", msg);

    snprintf(args, sizeof args, "%s --data %s --out %s/cuda --device cuda", base, data, run);
    int rc = run_segnet(args, msg, sizeof msg);
    snprintf(path, sizeof path, "%s/cuda", run);
    if (rc != 0) {
        CHECK(rc == 1 && contains(msg, "--device cuda: ") &&
                      strchr(msg, '\n') == msg + strlen(msg) - 1,
              "--device cuda without a GPU: exit %d, %s", rc, msg);
        CHECK(access(path, F_OK) != 0, "--device cuda failed but created %s", path);
        snprintf(args, sizeof args, "%s --data %s --out %s/auto", base, data, run);
        rc = run_segnet(args, msg, sizeof msg);
        const char *notice = strstr(msg, "running on the CPU");
        CHECK(rc == 0 && notice && !strstr(notice + 1, "running on the CPU"),
              "--device auto without a GPU: exit %d, %s", rc, msg);
    }
    snprintf(args, sizeof args, "%s --data %s --out %s/bad --device tpu", base, data, run);
    CHECK(run_segnet(args, msg, sizeof msg) == 2 &&
                  contains(msg, "--device 'tpu' must be cpu, cuda or auto"),
          "%s", msg);
    rm_rf(data); rm_rf(run);
}

// the reference table (ops_ref) against ops_cpu, as the cuda_ tests
// compare the GPU with the CPU: one training forward and backward of effv2-t
// (64², batch 2: depthwise, squeeze-excitation, strided and dense k×k convs,
// batch norm with its fusions) and of a plain U-Net (grouped-free dense
// convs, transposed paths through upsampling), fp32, the same weights and
// inputs. Only the order of the sums differs: the reference adds each output's
// K products in fp64 and rounds once, the fast paths add in fp32 blocks, so
// each op's result is within about √K·2^-24 ≈ 1e-6 relative (K ≤ 9·48) of the
// reference's, and over the ~60 layers a forward and a backward pass through
// the loss agrees to 1e-5, the gradients and BN statistics (L2) to 1e-4.
static void ref_table_step(Ops *o, const char *model, float **grads, size_t *n_grads, float **stats,
                           size_t *n_stats, double *loss) {
    Graph g;
    graph_init(&g);
    ModelCfg c = model_cfg_default();
    c.model = model; c.classes = 3; c.batch = 2; c.height = c.width = 64;
    if (!strcmp(model, "unet")) { c.depth = 2; c.width_base = 4; }
    const int y = model_build(&g, &c);
    Net net;
    char err[SN_ERR_MAX];
    CHECK(y >= 0 && net_create(&net, &g, o, DT_F32, 0, err) == 0, "%s: %s", model,
          y < 0 ? g.err : err);
    net_init_params(&net, 5);
    Rng r;
    rng_seed(&r, 11);
    const size_t n_in = shape_numel(g.tensors[g.input].shape);
    float *x = malloc(sizeof(float) * n_in);
    for (size_t i = 0; i < n_in; i++) x[i] = (float)(rng_next(&r) % 256);
    o->upload(o, net.act[g.input], x, sizeof(float) * n_in);
    net_forward(&net, net_capacity(&net), 1);
    Tensor z = net_tensor(&net, y);
    const size_t n_labels = shape_numel(z.shape) / c.classes;
    int32_t *labels = malloc(sizeof(int32_t) * n_labels);
    for (size_t i = 0; i < n_labels; i++) labels[i] = (int32_t)(rng_next(&r) % 3);
    float weights[3] = {1.0f, 1.0f, 1.0f}, sums[3] = {0, 0, 0}, scale = 1.0f / (float)n_labels;
    o->fill(o, tensor_f32(net.grads, shape4((int)net.n_grad_floats, 1, 1, 1)), 0.0f);
    o->softmax_xent(o, z, labels, weights, 0.0f, &scale, sums, net_grad(&net, y));
    net_backward(&net, net_capacity(&net), y);
    *loss = sums[0] / sums[1];
    *n_grads = net.n_grad_floats;
    *grads = malloc(sizeof(float) * net.n_grad_floats);
    memcpy(*grads, net.grads, sizeof(float) * net.n_grad_floats);
    *n_stats = g.n_buffer_floats;
    *stats = malloc(sizeof(float) * g.n_buffer_floats);
    memcpy(*stats, net.buffers, sizeof(float) * g.n_buffer_floats);
    free(x); free(labels);
    net_free(&net);
    graph_free(&g);
}
TEST(ref_table_vs_cpu) {
    const char *models[2] = {"effv2-t", "unet"};
    // ops_cpu is ops_ref with kernels_cpu.c's versions of exactly these entries
    const char *fast =
            "fill axpby copy sum_squares conv2d_workspace conv2d_forward conv2d_backward_data "
            "conv2d_backward_weight "
            "bn_stats bn_forward bn_backward_reduce bn_backward_data global_avg_pool_forward "
            "global_avg_pool_backward channel_scale_forward channel_scale_backward se_gate_forward "
            "se_gate_backward add_forward add_backward "
            "concat_forward concat_backward dropout_forward dropout_backward maxpool2_forward "
            "maxpool2_backward upsample2_forward upsample2_backward";
    char differ[1024] = "";
    for (size_t i = 0; i < N_OPS_ENTRIES; i++) {
        void (*a)(void), (*b)(void);
        memcpy(&a, (const char *)&ops_cpu + OPS_ENTRIES[i].offset, sizeof a);
        memcpy(&b, (const char *)&ops_ref + OPS_ENTRIES[i].offset, sizeof b);
        if (a != b)
            snprintf(differ + strlen(differ), sizeof differ - strlen(differ), "%s%s",
                     differ[0] ? " " : "", OPS_ENTRIES[i].name);
    }
    CHECK(!strcmp(ops_ref.name, "ref") && !strcmp(ops_cpu.name, "cpu") && !strcmp(differ, fast),
          "ops_cpu differs from ops_ref in: %s (expected: %s)", differ, fast);
    for (int m = 0; m < 2; m++) {
        float *g[2], *st[2];
        size_t ng[2], ns[2];
        double loss[2];
        ref_table_step(&ops_cpu, models[m], &g[0], &ng[0], &st[0], &ns[0], &loss[0]);
        ref_table_step(&ops_ref, models[m], &g[1], &ng[1], &st[1], &ns[1], &loss[1]);
        const double el = fabs(loss[0] - loss[1]) / fabs(loss[1]);
        const double eg = ng[0] == ng[1] ? rel_l2(g[0], g[1], ng[0]) : INFINITY;
        const double es = ns[0] == ns[1] ? rel_l2(st[0], st[1], ns[0]) : INFINITY;
        CHECK(el <= 1e-5 && eg <= 1e-4 && es <= 1e-4,
              "%s: ops_cpu against ops_ref: loss %.3g, gradients %.3g, BN statistics %.3g apart",
              models[m], el, eg, es);
        if (g_verbose)
            printf("      %s: loss %.3g, gradients %.3g, BN statistics %.3g apart (relative, L2)\n",
                   models[m], el, eg, es);
        free(g[0]); free(g[1]); free(st[0]); free(st[1]);
    }
}

// ----------------------------------------------------------------------------
// the CUDA backend's whole steps: the plan, fused layers, graphs, replicas on
// devices (NCCL); its allocator and the emulator

// the CUDA backend's tests (each op's in its group above, the whole-step ones
// below; built where nvcc is): a build without nvcc lists them as not run.
// test_cuda_tests_listed checks this list against the tests a CUDA build
// registers.
// nccl: 1 only with NCCL, -1 only without; emulated: 1 only under the emulator
typedef struct {
    const char *name;
    int nccl, emulated;
} CudaTestName;
static const CudaTestName CUDA_TESTS[] __attribute__((unused)) = {
        // (unused in fuzz_segnet)
        {"cuda_fill_copy", 0, 0},
        {"cuda_scale_axpby", 0, 0},
        {"cuda_sum_squares_nonfinite", 0, 0},
        {"cuda_launch_split", 0, 1},
        {"cuda_gemm_ex_types", 0, 0},
        {"cuda_conv_pointwise", 0, 0},
        {"cuda_conv_dense", 0, 0},
        {"cuda_conv_grouped", 0, 0},
        {"cuda_conv_depthwise", 0, 0},
        {"cuda_conv_model_shapes", 0, 0},
        {"cuda_act", 0, 0},
        {"cuda_squeeze_excitation", 0, 0},
        {"cuda_se_gate", 0, 0},
        {"cuda_add_concat", 0, 0},
        {"cuda_dropout", 0, 0},
        {"cuda_pool_upsample", 0, 0},
        {"cuda_resize_bilinear", 0, 0},
        {"cuda_bn_stats", 0, 0},
        {"cuda_bn_forward_backward", 0, 0},
        {"cuda_bn_fused_next", 0, 0},
        {"cuda_softmax_xent", 0, 0},
        {"cuda_softmax_focal", 0, 0},
        {"cuda_region_losses", 0, 0},
        {"cuda_lovasz", 0, 0},
        {"cuda_iou_per_image", 0, 0},
        {"cuda_adam", 0, 0},
        {"cuda_step_control", 0, 0},
        {"cuda_confusion", 0, 0},
        {"cuda_tests_listed", 0, 0},
        {"cuda_alloc_counts", 0, 0},
        {"cuda_ops_complete", 0, 0},
        {"cuda_graph_step", 0, 0},
        {"cuda_kernel_times", 0, 0},
        {"cuda_bench_kernels", 0, 1},
        {"cuda_conv_tiles", 0, 0},
        {"cuda_sync_each", 0, 1},
        {"cuda_emu_semantics", 0, 1},
        {"cuda_emu_count_file", 0, 1},
        {"cuda_train_steps", 0, 0},
        {"cuda_fused_layers_bitwise", 0, 0},
        {"cuda_plan_equals_allocation", 0, 0},
        {"cuda_nccl_comm", 1, 0},
        {"cuda_replicas_sync_bn", 1, 0},
        {"cuda_replicas_train_run", 1, 0},
        {"cuda_replicas_no_nccl", -1, 0},
};

// The CUDA backend's text: kernels.cu and the chapters it includes, in its order. The checks
// that read the backend's source (line lengths, the last block's reads, shared memory, the
// staleness of kernel_inflight.txt) read them all; source_lines_short holds this list to
// cuda/*.cuh and to kernels.cu's #include lines, so that a new chapter is not left out.
static const char *const KERNELS_SOURCES[] = {
        "kernels.cu",          "cuda/seam.cuh",          "cuda/reductions.cuh",
        "cuda/elementwise.cuh", "cuda/batch_norm.cuh",   "cuda/gemm_conv.cuh",
        "cuda/implicit_gemm.cuh", "cuda/losses.cuh",     "cuda/adam.cuh",
        "cuda/communicators.cuh"};
#define KERNELS_SOURCES_N ((int)(sizeof KERNELS_SOURCES / sizeof *KERNELS_SOURCES))

#ifdef SEGNET_CUDA
// CUDA_TESTS names every cuda_ test of this build, and nothing else but the
// tests of the other NCCL case and the emulator's own
TEST(cuda_tests_listed) {
#ifdef SEGNET_NCCL
    const int nccl = 1;
#else
    const int nccl = -1;
#endif
    int listed = 0, registered = 0;
    for (size_t i = 0; i < sizeof CUDA_TESTS / sizeof CUDA_TESTS[0]; i++) {
        const CudaTestName *c = &CUDA_TESTS[i];
        const Test *t = NULL;
        for (int k = 0; k < g_n_tests && !t; k++)
            if (!strcmp(g_tests[k].name, c->name)) t = &g_tests[k];
        if ((c->nccl && c->nccl != nccl) || (c->emulated && !EMULATED_CUDA)) {
            CHECK(!t, "%s: listed for another build, registered in this one", c->name);
            continue;
        }
        CHECK(t != NULL, "%s: listed in CUDA_TESTS, not registered", c->name);
        listed++;
    }
    for (int k = 0; k < g_n_tests; k++) registered += !strncmp(g_tests[k].name, "cuda_", 5);
    CHECK(registered == listed, "%d cuda_ tests registered, %d listed in CUDA_TESTS", registered,
          listed);
}

// cuda_alloc counts the bytes it hands out: live and peak (segnet bench's peak_device_bytes)
TEST(cuda_alloc_counts) {
    Ops *o = cu_ops();
    size_t live = cuda_bytes_live;
    void *a = o->alloc(o, 1000), *b = o->alloc(o, 24);
    CHECK(cuda_bytes_live == live + 1024 && cuda_bytes_peak >= live + 1024,
          "live %zu (was %zu), peak %zu", cuda_bytes_live, live, cuda_bytes_peak);
    o->free(o, a);
    CHECK(cuda_bytes_live == live + 24, "after one free: live %zu (was %zu)", cuda_bytes_live,
          live);
    o->free(o, b);
    CHECK(cuda_bytes_live == live, "after both: live %zu (was %zu)", cuda_bytes_live, live);
}

// Every entry of ops_cuda filled in; otherwise the test fails naming the NULL ones.
static int cu_ops_complete(const char *who) {
    char missing[4096];
    int n = ops_missing(cu_ops(), missing, sizeof missing);
    CHECK(n == 0, "%s: ops_cuda has %d NULL entries: %s", who, n, missing);
    return n == 0;
}
TEST(cuda_ops_complete) { cu_ops_complete("cuda_ops_complete"); }

// A few optimiser steps of a tiny segmentation model through the trainer
// (trainer_open, train_step: upload, forward, loss, backward, clipping, Adam)
// on one backend; losses[s] is step s's loss (Σ w·nll / Σ w of its batch).
// `steps` training steps of `model` (batch 2, 3 classes, a class weight 0,
// clipping) on hw×hw random images from a fixed seed: the loss of each step,
// and with grad1 != NULL the raw gradient sum of step 1 (malloc'd, *n_grad floats)
static void cu_train_losses(const char *model, int hw, DType dt, Device device, int steps,
                            double *losses, float **grad1, size_t *n_grad) {
    TrainCfg c;
    train_cfg_default(&c);
    c.model.model = model;
    c.model.classes = 3; c.model.height = c.model.width = hw; c.model.batch = 2;
    c.model.depth = 2; c.model.width_base = 4;  // plain unet
    c.class_weights[0] = 0.0f; c.class_weights[2] = 2.0f;
    c.lr = 1e-3f; c.clipnorm = 1.0f;  // clipping: sum_squares on the gradients
    c.precision = dt;
    c.device = device;
    c.progress = 0;
    Trainer t;
    char err[SN_ERR_MAX];
    CHECK(trainer_open(&t, &c, NULL, NULL, err) == 0, "%s on %s: %s", model, DEVICE_NAMES[device],
          err);
    Rng r;
    rng_seed(&r, 77);
    float *images = malloc(sizeof(float) * 2 * hw * hw * 3);
    int32_t *labels = malloc(sizeof(int32_t) * 2 * hw * hw);
    int64_t cm[9];
    for (int s = 0; s < steps; s++) {
        random_batch(&r, 2, hw, 3, images, labels);
        MicroBatch mb = {2, images, labels, 0, NULL, NULL, 0};
        PassTotals pt = {.cm = cm};
        train_step(&t, &mb, 1, &pt);
        losses[s] = pt.loss_sum / pt.norm_sum;
        if (s == 0 && grad1) {
            *n_grad = t.n_trainable;
            *grad1 = malloc(sizeof(float) * t.n_trainable);
            t.o->download(t.o, *grad1, t.net.grads, sizeof(float) * t.n_trainable);
        }
    }
    free(images); free(labels);
    trainer_close(&t);
}

// A recorded step (a CUDA graph) replayed does what the step run op by op
// does, to the bit, and so does one whose batches come from the wire: three
// steps of unet-effv2-t (drop-path, whose seeds change every step; the loss
// ce + 0.5·focal + dice + 0.5·lovasz) in fp16 (loss scaling, which here skips
// and doubles), with clipping and a warm-up (a learning rate per step), then a
// smaller last batch (run op by op: other shapes) and a full one again (step
// 2's record). Compared: the losses, the parameters and Adam's moments, the
// loss scale.
// Under the emulator also: which steps were replays (step 1 runs op by op,
// loading every kernel before the capture; step 2 is recorded and replayed),
// and each step waited for the device once (its one download).
// wire: each batch comes as the loader hands it over (MicroBatch.wire, in
// host_alloc memory of its own): the even steps' whole images as bytes, the odd
// steps' (which have fractions) in fp16, rounded on the host; and the next
// step's batch is given to each step (Trainer.next) to upload ahead.
static void cu_graph_run(int records, int wire, double *losses, float **params, float **moments,
                         float *scale, long long replays[5], long long *syncs) {
    TrainCfg c;
    train_cfg_default(&c);
    c.model.model = "unet-effv2-t";
    c.model.classes = 3; c.model.height = c.model.width = 32; c.model.batch = 2;
    c.lr = 1e-3f; c.clipnorm = 0.5f; c.warmup = 10; c.schedule = SCHEDULE_COSINE;
    c.loss_scale_interval = 2;
    c.precision = DT_F16;
    c.device = DEVICE_CUDA;
    c.progress = 0;
    c.loss.n = 4;  // every kind of term: ce, focal, a region term (its sums and coefficients), and
                   // lovasz (its sort)
    c.loss.kind[1] = LOSS_FOCAL; c.loss.weight[1] = 0.5f;
    c.loss.kind[2] = LOSS_DICE; c.loss.weight[2] = 1.0f;
    c.loss.kind[3] = LOSS_LOVASZ; c.loss.weight[3] = 0.5f;
    Trainer t;
    char err[SN_ERR_MAX];
    CHECK(trainer_open(&t, &c, NULL, NULL, err) == 0, "%s", err);
    t.records = records;
    t.total_steps = 20;
    int drop_paths = 0;
    for (int i = 0; i < t.g.n_layers; i++)
        drop_paths += t.g.layers[i].kind == LAYER_DROP_PATH && t.g.layers[i].rate > 0;
    CHECK(drop_paths > 0, "unet-effv2-t has no drop-path layer to test the per-step seeds with");
    Rng r;
    rng_seed(&r, 78);
    const int hw = 32, sizes[5] = {2, 2, 2, 1, 2};
    const size_t values = 2 * hw * hw * 3, pixels = 2 * hw * hw;
    float *images = malloc(sizeof(float) * 5 * values);
    int32_t *labels = malloc(sizeof(int32_t) * 5 * pixels);
    int64_t cm[9];
    MicroBatch mb[5];
    void *wired[5][2];  // step s's images as they travel (bytes or fp16) and labels, host_alloc'd
    for (int s = 0; s < 5; s++) {
        float *x = images + s * values;
        int32_t *y = labels + s * pixels;
        random_batch(&r, sizes[s], hw, 3, x, y);
        if (s % 2)
            for (size_t i = 0; i < values; i++) x[i] += (float)(i % 7) / 7.0f;
        mb[s] = (MicroBatch){sizes[s], x, y, 0, NULL, NULL, 0};
        if (!wire) continue;
        wired[s][0] = t.o->host_alloc(t.o, sizeof(uint16_t) * values);
        wired[s][1] = t.o->host_alloc(t.o, sizeof(int32_t) * pixels);
        const Tensor half = tensor(wired[s][0], shape4((int)values, 1, 1, 1), DT_F16);
        for (size_t i = 0; i < values; i++) {
            if (s % 2) st(half, i, x[i]);
            else ((uint8_t *)wired[s][0])[i] = (uint8_t)x[i];
        }
        memcpy(wired[s][1], y, sizeof(int32_t) * pixels);
        mb[s].wire = wired[s][0];
        mb[s].wire_bytes = s % 2 == 0;
        mb[s].labels = wired[s][1];
    }
#if EMULATED_CUDA
    const long long s0 = cuemu_count("syncs");
#endif
    for (int s = 0; s < 5; s++) {
        PassTotals pt = {.cm = cm};
#if EMULATED_CUDA
        const long long g0 = cuemu_count("graph_launches");
#endif
        t.next = wire && s + 1 < 5 ? &mb[s + 1] : NULL;  // as run_pass gives it
        CHECK(train_step(&t, &mb[s], 1, &pt) >= 0, "step %d failed", s + 1);
        losses[s] = pt.loss_sum / pt.norm_sum;
#if EMULATED_CUDA
        replays[s] = cuemu_count("graph_launches") - g0;
#else
        replays[s] = -1;
#endif
    }
    // steps 2 to 5 found their batch uploaded ahead where the backend can
    CHECK(t.steps_ahead == (wire && t.o->upload_ahead ? 4 : 0), "%lld steps took their batch "
          "uploaded ahead", (long long)t.steps_ahead);
#if EMULATED_CUDA
    *syncs = cuemu_count("syncs") - s0;
#else
    *syncs = -1;
#endif
    *params = malloc(sizeof(float) * t.g.n_param_floats);
    *moments = malloc(sizeof(float) * 2 * t.n_trainable);
    t.o->download(t.o, *params, t.net.params, sizeof(float) * t.g.n_param_floats);
    t.o->download(t.o, *moments, t.adam_m, sizeof(float) * t.n_trainable);
    t.o->download(t.o, *moments + t.n_trainable, t.adam_v, sizeof(float) * t.n_trainable);
    *scale = t.loss_scale;
    for (int s = 0; s < 5 && wire; s++) {
        t.o->host_free(t.o, wired[s][0]);
        t.o->host_free(t.o, wired[s][1]);
    }
    free(images); free(labels);
    trainer_close(&t);
}
SLOW_TEST(cuda_graph_step) {
    if (!cu_ops_complete("cuda_graph_step")) return;
    double eager[5], graph[5], wired[5];
    float *p_eager, *p_graph, *m_eager, *m_graph, scale_eager, scale_graph, *p_wired, *m_wired,
            scale_wired;
    long long replays_eager[5], replays_graph[5], syncs_eager, syncs_graph, replays_wired[5],
            syncs_wired;
    cu_graph_run(0, 0, eager, &p_eager, &m_eager, &scale_eager, replays_eager, &syncs_eager);
    cu_graph_run(1, 0, graph, &p_graph, &m_graph, &scale_graph, replays_graph, &syncs_graph);
    cu_graph_run(1, 1, wired, &p_wired, &m_wired, &scale_wired, replays_wired, &syncs_wired);
    TrainCfg c;
    Graph g;
    graph_init(&g);
    train_cfg_default(&c);
    c.model.model = "unet-effv2-t";
    c.model.classes = 3;
    c.model.height = c.model.width = 32;
    c.model.batch = 2;
    model_build(&g, &c.model);
    const size_t np = g.n_param_floats;
    size_t nt = 0;
    for (int i = 0; i < g.n_params; i++) nt += g.params[i].count;
    graph_free(&g);
    for (int s = 0; s < 5; s++)
        CHECK(eager[s] == graph[s], "step %d: loss %.9g replayed, %.9g op by op", s + 1, graph[s],
              eager[s]);
    CHECK(!memcmp(p_eager, p_graph, sizeof(float) * np),
          "the parameters after 5 steps differ (replayed vs op by op)");
    CHECK(!memcmp(m_eager, m_graph, sizeof(float) * 2 * nt), "Adam's moments after 5 steps differ");
    CHECK(scale_eager == scale_graph, "loss scale %g replayed, %g op by op", scale_graph,
          scale_eager);
    // the batches uploaded from where the loader would put them, outside the record
    for (int s = 0; s < 5; s++)
        CHECK(eager[s] == wired[s], "step %d: loss %.9g from the wire, %.9g staged", s + 1,
              wired[s], eager[s]);
    CHECK(!memcmp(p_eager, p_wired, sizeof(float) * np) &&
                  !memcmp(m_eager, m_wired, sizeof(float) * 2 * nt) && scale_eager == scale_wired,
          "the parameters, moments or loss scale after 5 steps differ (from the wire vs staged)");
#if EMULATED_CUDA
    // step 1 op by op, 2 recorded and replayed, 3 and 5 replayed, 4 (smaller) op by op
    const long long expected[5] = {0, 1, 1, 0, 1};
    for (int s = 0; s < 5; s++)
        CHECK(replays_eager[s] == 0 && replays_graph[s] == expected[s],
              "step %d: graph launches %lld op by op, %lld recorded (expected 0 and %lld)", s + 1,
              replays_eager[s], replays_graph[s], expected[s]);
    for (int s = 0; s < 5; s++)
        CHECK(replays_wired[s] == expected[s], "step %d from the wire: %lld graph launches", s + 1,
              replays_wired[s]);
    CHECK(syncs_eager == 5 && syncs_graph == 5 && syncs_wired == 5,
          "host waits in 5 steps: %lld op by op, %lld recorded, %lld from the wire (expected 5: "
          "one per step)",
          syncs_eager, syncs_graph, syncs_wired);
#endif
    if (g_verbose)
        printf("      5 steps: losses %.6f .. %.6f, loss scale %g, %lld replays, %lld host waits\n",
               graph[0], graph[4], scale_graph,
               replays_graph[1] + replays_graph[2] + replays_graph[4], syncs_graph);
    free(p_eager); free(p_graph); free(m_eager); free(m_graph); free(p_wired); free(m_wired);
}

// Device time per kernel (segnet bench --kernels): while cuda_kernel_timing is
// on, each launch counts in its kernel's row, named as in the source with its
// template arguments: two fills (the Constant functor) and a scale (Scale), on
// the vector or the generic kernels; a launch with timing off counts nothing.
TEST(cuda_kernel_times) {
    Ops *o = cu_ops();
    const Shape s = shape4(1, 1, 1, 1024);
    float *x = o->alloc(o, sizeof(float) * 1024);
    cuda_kernel_times_reset();
    cuda_kernel_timing = 1;
    o->fill(o, tensor_f32(x, s), 1.0f);
    o->fill(o, tensor_f32(x, s), 2.0f);
    o->scale(o, tensor_f32(x, s), 3.0f);
    cuda_kernel_timing = 0;
    o->scale(o, tensor_f32(x, s), 3.0f);  // not timed
    KernelTimeRow rows[8];
    const int n = cuda_kernel_times(rows, 8);
    long long fills = -1, scales = -1, all = 0;
    double fill_bytes = -1, scale_bytes = -1, flops = 0;
    for (int i = 0; i < n && i < 8; i++) {
        all += rows[i].launches;
        flops += rows[i].flops;
        if (contains(rows[i].name, "Constant>"))
            fills = rows[i].launches, fill_bytes = rows[i].bytes;
        if (contains(rows[i].name, "Scale>"))
            scales = rows[i].launches, scale_bytes = rows[i].bytes;
        CHECK(rows[i].ms >= 0.0 && (i == 0 || rows[i].ms <= rows[i - 1].ms),
              "row %d (%s): %g ms, not in decreasing order", i, rows[i].name, rows[i].ms);
        if (g_verbose)
            printf("      %-40s %lld launches %.4f ms\n", rows[i].name, rows[i].launches,
                   rows[i].ms);
    }
    CHECK(n == 2 && fills == 2 && scales == 1 && all == 3,
          "%d rows; fills %lld, scales %lld, %lld launches (expected 2 rows: 2 fills, 1 scale)", n,
          fills, scales, all);
    // declared traffic: a fill writes 1024 floats, a scale reads and writes them
    CHECK(fill_bytes == 2 * 4096.0 && scale_bytes == 2 * 4096.0 && flops == 0.0,
          "bytes: fills %.0f (expected 8192), scale %.0f (expected 8192); flops %.0f (expected 0)",
          fill_bytes, scale_bytes, flops);
    cuda_kernel_times_reset();
    CHECK(cuda_kernel_times(rows, 8) == 0, "rows left after cuda_kernel_times_reset");
    o->free(o, x);
}

#if EMULATED_CUDA
// SEGNET_CUDA_SYNC=1 (read when a device is opened): every kernel launch and
// every cuBLAS call is followed by a wait for the device, so that a fault is
// reported at the op that caused it; without it an op waits for nothing. The
// emulator counts launches, cuBLAS calls and waits: on a device opened with
// the variable the waits equal launches + cuBLAS calls, on device 0 (opened
// without it) there are none.
TEST(cuda_sync_each) {
    char err[SN_ERR_MAX], devices[16];
    const int dev = SN_MAX_REPLICAS - 1;  // a device no other test opens
    const char *old = getenv("CUEMU_DEVICES");
    char *keep = old ? strdup(old) : NULL;
    snprintf(devices, sizeof devices, "%d", SN_MAX_REPLICAS);
    setenv("CUEMU_DEVICES", devices, 1);
    setenv("SEGNET_CUDA_SYNC", "1", 1);
    Ops *sync_ops = cuda_ops_for_device(dev, err);
    unsetenv("SEGNET_CUDA_SYNC");
    CHECK(sync_ops != NULL, "device %d: %s", dev, err);
    Ops *ops[2] = {cu_ops(), sync_ops};
    for (int k = 0; k < 2 && ops[k]; k++) {
        Ops *o = ops[k];
        const Shape s = shape4(2, 3, 4, 5);
        const ConvCfg cfg = {5, 6, 1, 1, 1, 1, PAD_SAME, 1};  // 1×1: one cuBLAS GEMM
        float *x = o->alloc(o, sizeof(float) * shape_numel(s)),
              *y = o->alloc(o, sizeof(float) * 2 * 3 * 4 * 6);
        float *w = o->alloc(o, sizeof(float) * 30), *b = o->alloc(o, sizeof(float) * 6);
        size_t ws_bytes = o->conv2d_workspace(o, &cfg, s, DT_F32);
        void *ws = ws_bytes ? o->alloc(o, ws_bytes) : NULL;
        long long l0 = cuemu_count("launches"), g0 = cuemu_count("blas_calls"),
                  s0 = cuemu_count("syncs");
        o->fill(o, tensor_f32(x, s), 0.5f);
        o->fill(o, tensor_f32(w, shape4(30, 1, 1, 1)), 0.25f);
        o->fill(o, tensor_f32(b, shape4(6, 1, 1, 1)), 1.0f);
        o->scale(o, tensor_f32(x, s), 2.0f);
        o->conv2d_forward(o, &cfg, tensor_f32(y, shape4(2, 3, 4, 6)), tensor_f32(x, s), w, NULL, b,
                          ws);
        long long launches = cuemu_count("launches") - l0, blas = cuemu_count("blas_calls") - g0,
                  syncs = cuemu_count("syncs") - s0;
        CHECK(launches >= 4 && blas >= 1, "%lld launches and %lld cuBLAS calls counted", launches,
              blas);
        CHECK(syncs == (k ? launches + blas : 0),
              "%s: %lld waits for %lld launches and %lld cuBLAS calls",
              k ? "SEGNET_CUDA_SYNC=1" : "without SEGNET_CUDA_SYNC", syncs, launches, blas);
        float out = 0.0f;
        o->download(o, &out, y, sizeof out);
        CHECK(out == 1.0f + 5 * 0.25f, "1×1 conv of 1.0s with weights 0.25 and bias 1: %g", out);
        o->free(o, x); o->free(o, y); o->free(o, w); o->free(o, b);
        if (ws) o->free(o, ws);
    }
    if (keep) setenv("CUEMU_DEVICES", keep, 1);
    else unsetenv("CUEMU_DEVICES");
    free(keep);
}

// The emulator's own semantics on its own tiny kernels (cuda_emu.cpp,
// cuemu_selftest): graph capture and replay with the captured arguments, the
// order of replays, what a capture refuses, the 48 KB dynamic shared memory
// limit and cudaFuncSetAttribute, the vector access check (aborts, seen from
// a child process), counting mode, thread order and the counters.
int cuemu_selftest(char *report, size_t n);
TEST(cuda_emu_semantics) {
    char report[8192];
    int failed = cuemu_selftest(report, sizeof report);
    CHECK(failed == 0, "%d checks of the emulator failed:\n%s", failed, report);
    // the build's contraction: a·b + c with a = b = 1 + 2^-12, c = -1 is 2^-11 + 2^-24
    // fused (one rounding) and 2^-11 with the product rounded first (a tie to even)
    const float a = 1.0f + 0x1p-12f, fused = 0x1p-11f + 0x1p-24f, rounded = 0x1p-11f;
#ifdef SEGNET_TEST_STRICT
    const int strict = 1;
#else
    const int strict = 0;
#endif
    const float want = strict ? fused : rounded;
    const float got = cuemu_kernels_mul_add(a, a, -1.0f);
    CHECK(got == want, "kernels.cu's a·b + c gave %a, not %a (%s): the %s build", (double)got,
          (double)want, want == fused ? "one FMA" : "two roundings",
          want == fused ? "strict (kernels_strict.o, -ffp-contract=fast)"
                        : "emulator's (kernels_emu.o)");
}

// CUEMU_COUNT=FILE: ./segnet_emu (segnet on the emulator) counts a training
// step's device work without running it and writes the counters at exit.
TEST(cuda_emu_count_file) {
    const char *path = "/tmp/segnet_test_emu_count.txt";
    char cmd[1024], msg[4096];
    unlink(path);
    snprintf(cmd, sizeof cmd,
             "CUEMU_COUNT=%s ./segnet_emu bench --device cuda --model unet --depth 2 --width 8 "
             "--size 32x32 --batch 2 --classes 3 --steps 1 --warmup 0 --threads 1",
             path);
    int rc = run_shell(cmd, msg, sizeof msg);
    CHECK(rc == 0, "%s: exit %d: %s (make segnet_emu builds it)", cmd, rc, msg);
    size_t n;
    char *text = read_file(path, &n);
    CHECK(text != NULL, "%s was not written", path);
    if (!text) return;
    const char *names[] = {"launches",  "api_launches", "blas_calls",
                           "syncs",     "h2d_bytes",    "d2h_bytes",
                           "d2d_bytes", "allocs",       "alloc_bytes_peak"};
    long long v[9];
    for (int i = 0; i < 9; i++) {
        char key[64];
        snprintf(key, sizeof key, "%s ", names[i]);
        const char *at = strstr(text, key);
        while (at && at != text && at[-1] != '\n') at = strstr(at + 1, key);
        v[i] = at ? atoll(at + strlen(key)) : -1;
        CHECK(at != NULL, "no line '%s N' in %s:\n%s", names[i], path, text);
    }
    CHECK(v[0] > 0 && v[1] > 0 && v[1] <= v[0], "launches %lld, api_launches %lld", v[0], v[1]);
    CHECK(v[4] >= 2 * 32 * 32 * 3 * 4, "h2d_bytes %lld: the batch's images were not counted", v[4]);
    CHECK(v[7] > 0 && v[8] > 0, "allocs %lld, alloc_bytes_peak %lld", v[7], v[8]);
    // each launch configuration has its declared traffic, some bytes for every one
    int configs = 0, traffics = 0, no_bytes = 0;
    for (const char *p = text; p && *p; p = strchr(p, '\n'), p = p ? p + 1 : NULL) {
        double bytes = 0.0, flops = 0.0;
        configs += !strncmp(p, "config ", 7);
        if (!strncmp(p, "traffic ", 8)) {
            traffics++;
            no_bytes += sscanf(p + 8, "%lf %lf", &bytes, &flops) != 2 || !(bytes > 0.0);
        }
    }
    CHECK(configs > 0 && traffics == configs && no_bytes == 0,
          "%d config lines, %d traffic lines, %d of them without bytes:\n%s", configs, traffics,
          no_bytes, text);
    free(text);
    unlink(path);
}
#endif

#ifdef SEGNET_CUDA
// kernel_resources.txt (the nvcc build's ptxas report, Makefile): no kernel
// spills registers to local memory or has a stack frame (an array indexed at
// run time, a parameter bound by reference). The first offending line and the
// count of kernels, or 0.
static int resources_problem(const char *text, int *kernels) {
    int line = 0;
    *kernels = 0;
    for (const char *p = text; *p;) {
        const char *end = strchr(p, '\n');
        char name[4096], arch[32];
        int regs;
        long smem, spill, stack;
        line++;
        if (sscanf(p, "%4095s %31s %d %ld %ld %ld", name, arch, &regs, &smem, &spill, &stack) != 6)
            return line;
        (*kernels)++;
        if (spill || stack) return line;
        if (!end) break;
        p = end + 1;
    }
    return 0;
}
TEST(kernels_no_spills) {
    int k;
    CHECK(resources_problem("_Z1ai sm_90 32 0 0 0\n_Z1bi sm_90 255 0 8 0\n", &k) == 2 &&
                  resources_problem("_Z1ai sm_90 32 0 0 16\n", &k) == 1 &&
                  resources_problem("_Z1ai sm_90 32 0 0 0\n_Z1bi sm_90 64 0 0 0\n", &k) == 0 &&
                  k == 2,
          "the checker on planted reports");
    size_t n;
    char *text = read_file("kernel_resources.txt", &n);
    CHECK(text != NULL, "kernel_resources.txt: not written by the nvcc build (make)");
    if (!text) return;
    const int line = resources_problem(text, &k);
    CHECK(line == 0,
          "kernel_resources.txt:%d: a kernel spills registers or has a stack frame "
          "(nvcc -Xptxas -v; kernels_gpu.ptxas has the whole report)",
          line);
    CHECK(k >= 100, "kernel_resources.txt lists %d kernels (kernels.cu has more)", k);
    if (g_verbose) printf("      %d kernels, no spills\n", k);
    free(text);
}
#endif

// gpucount.awk on two hand-written count files (the per-step launches are the
// difference). On 132 SMs: 540 blocks at 4 per SM (528 slots) take 2 waves,
// efficiency 540/1056 = 0.51; 528 blocks exactly one wave, 1.00; 16 blocks at 8
// per SM fill 16 of 1056 slots (under one wave); a conv's 600 blocks, 600/1056
// = 0.57. Warps per SM: 4 blocks of 128 threads = 16; 8 blocks of 256 = 64 (the
// conv, 16, is not memory-bound: the implicit GEMMs use the tensor cores). A
// configuration launched as often in both files is not in the step.
TEST(gpucount_waves_by_hand) {
    const char *one = "/tmp/segnet_test_count1.txt", *two = "/tmp/segnet_test_count2.txt";
    FILE *f = fopen(one, "w");
    fprintf(f, "launches 10\nconfig 1 540 128 0 100 0 4 wgrad<BF16>\n"
               "config 5 7 32 0 10 0 32 setup_kernel\n"
               "traffic 100 100 540 128 0 100 0 4 wgrad<BF16>\n"
               "traffic 50 0 7 32 0 10 0 32 setup_kernel\n");
    fclose(f);
    // one step's bytes (FLOPs) by configuration, per launch in brackets: wgrad of 528
    // blocks 400 (200), of 540 blocks 200 (100), se_gate 10 (10), conv_fwd 5 (5); of 615,
    // 95% is reached by the two wgrad ones, the lower of them 540 / (2·528) = 0.51.
    // FLOPs: conv_fwd 4000 alone reaches 95% of 4200: 600 / (2·528) = 0.57
    f = fopen(two, "w");
    fprintf(f, "launches 20\nconfig 3 540 128 0 100 0 4 wgrad<BF16>\n"
               "config 2 528 128 0 100 0 4 wgrad<BF16>\nconfig 5 7 32 0 10 0 32 setup_kernel\n"
               "config 1 16 256 0 32 0 8 se_gate<BF16, 1>\n"
               "config 1 600 128 0 128 0 4 conv_fwd_kernel<BF16, true>\n"
               "traffic 300 300 540 128 0 100 0 4 wgrad<BF16>\n"
               "traffic 400 0 528 128 0 100 0 4 wgrad<BF16>\n"
               "traffic 50 0 7 32 0 10 0 32 setup_kernel\n"
               "traffic 10 0 16 256 0 32 0 8 se_gate<BF16, 1>\n"
               "traffic 5 4000 600 128 0 128 0 4 conv_fwd_kernel<BF16, true>\n");
    fclose(f);
    char cmd[512], msg[512];
    snprintf(cmd, sizeof cmd, "awk -f cuda/gpucount.awk %s %s", one, two);
    const int rc = run_shell(cmd, msg, sizeof msg);
    size_t n;
    char *out = read_file("/tmp/segnet_test_out.txt", &n);
    CHECK(rc == 0 && out, "%s: exit %d: %s", cmd, rc, msg);
    if (!out) return;
    CHECK(contains(out, "wave_efficiency_min: 0.51 (wgrad<BF16>; 5 of 6 launches carry 95% of the "
                        "bytes and of the FLOPs)") &&
                  contains(out, "wave_efficiency_min_bytes: 0.51 (wgrad<BF16>)") &&
                  contains(out, "wave_efficiency_min_flops: 0.57 (conv_fwd_kernel<BF16, true>)") &&
                  contains(out, "wave_efficiency_min_full_grids: 0.51 (wgrad<BF16>)") &&
                  contains(out, "launches_under_one_wave: 1 of 6") &&
                  contains(out, "warps_per_sm_min: 16 (conv_fwd_kernel<BF16, true>)") &&
                  contains(out, "warps_per_sm_min_memory_bound: 16 (wgrad<BF16>)") &&
                  contains(out, "conv_fwd_kernel<BF16, true>                                    "
                                "         1             600     128  128       0      4     16"
                                "    0.57    0.8   95.2") &&
                  !contains(out, "setup_kernel"),
          "gpucount.awk on hand-made counts:\n%s", out);
    const char *row = strstr(out, "wgrad<BF16>");
    CHECK(row && atoi(row + strlen("wgrad<BF16>")) == 4,
          "the wgrad row does not count 2 + 2 launches per step:\n%s", out);
    free(out);
    unlink(one);
    unlink(two);
}

// gpucount.awk's least step time on an H200 (4.8 TB/s, 790 TFLOP/s), by hand. One step
// (the difference of the two files): copy<BF16> 2 launches moving 9.6e9 bytes, 2.00 ms at
// the bandwidth; mma<BF16> 1.58e12 FLOPs (and 4.8e8 bytes, 0.10 ms), 2.00 ms at the peak;
// one cuBLAS GEMM of 7.9e11 FLOPs, 1.00 ms: step_ms_roofline 5.00 (kernels 4.00). With
// the fills of the third file (make inflight's table through c++filt: parameters and
// templates in the name) copy<BF16> draws a quarter of the bandwidth, 8.00 ms, 6.00 ms
// lost; mma<BF16> has no fill (counted at 1: 4.8e8 of 1.008e10 kernel bytes, 4.8%) and
// is compute-bound anyway: step_ms_at_fill 11.00 (kernels 10.00). Without the third file
// there is no fill to use, and it says so.
TEST(gpucount_step_time_by_hand) {
    const char *one = "/tmp/segnet_test_count1.txt", *two = "/tmp/segnet_test_count2.txt",
               *fills = "/tmp/segnet_test_fills.txt";
    FILE *f = fopen(one, "w");
    fprintf(f, "config 1 1056 256 0 32 0 4 copy<BF16>\n"
               "traffic 4800000000 0 1056 256 0 32 0 4 copy<BF16>\n"
               "gemm 1 0 0 64 64 64 f16/bf16 f32 0\n");
    fclose(f);
    f = fopen(two, "w");
    fprintf(f, "config 3 1056 256 0 32 0 4 copy<BF16>\n"
               "traffic 14400000000 0 1056 256 0 32 0 4 copy<BF16>\n"
               "config 1 132 256 0 32 0 4 mma<BF16>\n"
               "traffic 480000000 1580000000000 132 256 0 32 0 4 mma<BF16>\n"
               "gemm 2 480000000 790000000000 64 64 64 f16/bf16 f32 0\n");
    fclose(f);
    f = fopen(fills, "w");
    fprintf(f, "void copy<BF16>(Vec<BF16, 8>*, Vec<BF16, 8> const*, unsigned long) loop 16 32 "
               "2048 8.0 0.25\n");
    fclose(f);
    char cmd[512], msg[512];
    size_t n;
    for (int with_fills = 0; with_fills < 2; with_fills++) {
        snprintf(cmd, sizeof cmd, "awk -f cuda/gpucount.awk %s %s %s", one, two,
                 with_fills ? fills : "");
        const int rc = run_shell(cmd, msg, sizeof msg);
        char *out = read_file("/tmp/segnet_test_out.txt", &n);
        CHECK(rc == 0 && out, "%s: exit %d: %s", cmd, rc, msg);
        if (!out) continue;
        CHECK(contains(out, "gemm_gbytes: 0.480  gemm_tflops: 0.7900  (1 cuBLAS calls)") &&
                      contains(out, "step_ms_roofline: 5.00 (kernels 4.00, cuBLAS 1.00;"),
              "the roofline by hand:\n%s", out);
        if (with_fills)
            CHECK(contains(out, "step_ms_at_fill: 11.00 (kernels 10.00 at their fill, cuBLAS "
                                "1.00; 4.8% of the kernels' bytes without a fill") &&
                          contains(out, "fill_loss_ms:  6.000  fill 0.25  copy<BF16>\n") &&
                          !contains(out, "fill_loss_ms:  0.000"),
                  "the step at the fills by hand:\n%s", out);
        else
            CHECK(contains(out, "step_ms_at_fill: no fills"), "without fills:\n%s", out);
        free(out);
    }
    unlink(one);
    unlink(two);
    unlink(fills);
}

// cuda/inflight.awk on hand-written SASS. Kernel a (no loop, 40 registers: 6 blocks
// of 256 = 1536 threads an SM): a 16-byte and an 8-byte load, then an add that
// reads the second load's register: 24 B a thread, 24·1536/1024 = 36 KB, fill 1.
// The load addressed through uniform register UR12 while R12 is loaded is not a
// use. Kernel b (not in the resources file: 64 registers, 1024 threads): a load
// before its loop (outside the window, not counted); in the loop two 8-byte
// loads, into R8:R9 and R10:R11, then a DADD that reads R8: 16 B, 16 KB, fill
// 0.50. Kernel c (32 registers: 2048 threads): a DADD of R6 (the pair R6:R7)
// after a 4-byte load into R7 waits for it: 4 B, 8 KB, 0.25. Kernel d: no load,
// left out.
TEST(inflight_awk_by_hand) {
    const char *res = "/tmp/segnet_test_inflight_res.txt", *sass = "/tmp/segnet_test_inflight.sass";
    FILE *f = fopen(res, "w");
    fprintf(f, "_Z1aPf sm_90 40 0 0 0\n_Z1cPf sm_90 32 0 0 0\n");
    fclose(f);
    f = fopen(sass, "w");
    fprintf(f, "\t\tFunction : _Z1aPf\n"
               "        /*0000*/                   LDG.E.128 R12, desc[UR4][R2.64] ;  /* 0x0 */\n"
               "        /*0010*/               @P0 LDG.E.64 R4, desc[UR12][R6.64] ;  /* 0x0 */\n"
               "        /*0020*/                   FADD R0, R4, R1 ;  /* 0x0 */\n"
               "        /*0030*/                   LDG.E R20, desc[UR4][R2.64] ;  /* 0x0 */\n"
               "        /*0040*/                   EXIT ;  /* 0x0 */\n"
               "\t\tFunction : _Z1bPf\n"
               "        /*0000*/                   LDG.E.128 R20, desc[UR4][R2.64] ;  /* 0x0 */\n"
               "        /*0010*/                   IADD3 R1, R1, 0x1, RZ ;  /* 0x0 */\n"
               "        /*0020*/                   LDG.E.64 R8, desc[UR4][R2.64] ;  /* 0x0 */\n"
               "        /*0030*/                   LDG.E.64 R10, desc[UR4][R2.64] ;  /* 0x0 */\n"
               "        /*0040*/                   DADD R12, R8, R12 ;  /* 0x0 */\n"
               "        /*0050*/                   LDG.E.64 R14, desc[UR4][R2.64] ;  /* 0x0 */\n"
               "        /*0060*/               @P1 BRA 0x20 ;  /* 0x0 */\n"
               "        /*0070*/                   EXIT ;  /* 0x0 */\n"
               "\t\tFunction : _Z1cPf\n"
               "        /*0000*/                   LDG.E R7, desc[UR4][R2.64] ;  /* 0x0 */\n"
               "        /*0010*/                   DADD R12, R6, R12 ;  /* 0x0 */\n"
               "        /*0020*/                   EXIT ;  /* 0x0 */\n"
               "\t\tFunction : _Z1dPf\n"
               "        /*0000*/                   EXIT ;  /* 0x0 */\n");
    fclose(f);
    char cmd[512], msg[512];
    snprintf(cmd, sizeof cmd, "awk -f cuda/inflight.awk %s %s", res, sass);
    const int rc = run_shell(cmd, msg, sizeof msg);
    size_t n;
    char *out = read_file("/tmp/segnet_test_out.txt", &n);
    CHECK(rc == 0 && out, "%s: exit %d: %s", cmd, rc, msg);
    if (!out) return;
    CHECK(!strcmp(out, "_Z1aPf kernel 24 40 1536 36.0 1.00\n"
                       "_Z1bPf loop 16 64 1024 16.0 0.50\n"
                       "_Z1cPf kernel 4 32 2048 8.0 0.25\n"),
          "cuda/inflight.awk on hand-written SASS:\n%s", out);
    free(out);
    unlink(res);
    unlink(sass);
}

// The batch norm kernels' row loops keep >= 24 KB in flight per SM, by the SASS
// of this build (kernel_inflight.txt, make inflight): per-channel sums with
// vector lanes (statistics, gradient sums, squeeze-excitation pooling), the
// vector apply and data-gradient kernels. The target is 32 KB (kernels.cu's
// THREAD_BYTES_IN_FLIGHT, 1024 threads an SM); four stay at 24 (fill 0.75) for
// their registers: the gradient sums through DyResidual with 2-byte storage (a
// second row would spill) and the apply into ResidualEnd with 16-byte lanes
// (66 registers: 768 threads). Loading one row at a time gave 8 KB.
TEST(inflight_batch_norm_kernels) {
    struct stat table, source;
    int missing = stat("kernel_inflight.txt", &table) != 0, older = 0;
    for (int f = 0; f < KERNELS_SOURCES_N && !missing; f++) {
        missing |= stat(KERNELS_SOURCES[f], &source) != 0;
        older |= !missing && table.st_mtime < source.st_mtime;
    }
    if (missing)
        SKIP("no kernel_inflight.txt (make inflight: needs nvcc and cuobjdump, CUOBJDUMP=path)");
    if (older)
        SKIP("kernel_inflight.txt is older than kernels.cu or a chapter, cuda/*.cuh (make "
             "inflight)");
    size_t n;
    char *text = read_file("kernel_inflight.txt", &n);
    CHECK(text != NULL, "kernel_inflight.txt cannot be read");
    if (!text) return;
    int checked = 0;
    for (char *line = strtok(text, "\n"); line; line = strtok(NULL, "\n")) {
        char name[4096], window[16];
        int bytes, regs, threads;
        double kb, fill;
        if (sscanf(line, "%4095s %15s %d %d %d %lf %lf", name, window, &bytes, &regs, &threads,
                   &kb, &fill) != 7)
            continue;
        int nq, w;
        const int sums = sscanf(name, "_Z19channel_sums_kernelILi%dELi%dE", &nq, &w) == 2;
        if (!(sums && w > 1) && !strstr(name, "bn_forward_vec_kernel") &&
            !strstr(name, "bn_backward_data_vec_kernel"))
            continue;
        checked++;
        CHECK(kb >= 24, "%s keeps %.1f KB in flight per SM (%d B a thread, %d threads)", name, kb,
              bytes, threads);
    }
    // 21 sums (5 lanes × 3 storage types, the squeeze-excitation's with two consumers),
    // 10 apply and 6 data-gradient kernels
    CHECK(checked == 37, "kernel_inflight.txt names %d of the 37 batch norm kernels", checked);
    free(text);
}

#if EMULATED_CUDA
// segnet bench's host time per step: the part of the step outside its device
// work, so at least 0 and at most the step's time (both medians over the same
// steps; the host time of each step is inside that step's time).
TEST(bench_host_time) {
    char msg[4096];
    const int rc = run_shell("./segnet bench --device cpu --model unet --depth 2 --width 8 --size "
                             "32x32 --batch 2 --classes 3 --steps 3 --warmup 1 --threads 1",
                             msg, sizeof msg);
    size_t n;
    char *out = read_file("/tmp/segnet_test_out.txt", &n);
    CHECK(rc == 0 && out, "segnet bench: exit %d: %s", rc, msg);
    if (!out) return;
    const char *step = strstr(out, "train_step_ms: "), *host = strstr(out, "host_ms_per_step: ");
    const double step_ms = step ? atof(step + strlen("train_step_ms: ")) : -1,
                 host_ms = host ? atof(host + strlen("host_ms_per_step: ")) : -1;
    CHECK(step && host && host_ms >= 0 && host_ms <= step_ms,
          "host_ms_per_step %g, train_step_ms %g in:\n%s", host_ms, step_ms, out);
    free(out);
}

// segnet bench --kernels N on the emulated GPU: a header, N rows of kernels
// (launches and time per step, most time first), a sum; on the CPU a one-line
// refusal and a failing exit
TEST(cuda_bench_kernels) {
    char msg[4096];
    const char *cmd = "./segnet_emu bench --device cuda --model unet --depth 2 --width 8 --size "
                      "32x32 --batch 2 --classes 3 --steps 1 --warmup 1 --threads 1 --kernels 3";
    int rc = run_shell(cmd, msg, sizeof msg);
    size_t n;
    char *out = read_file("/tmp/segnet_test_out.txt", &n);
    CHECK(rc == 0 && out, "%s: exit %d: %s", cmd, rc, msg);
    if (!out) return;
    const char *head = strstr(out, "\nkernel "), *sum = strstr(out, "\nsum ");
    int rows = 0;
    double last = 1e300, ms = 0.0;
    const char *p = head ? strchr(head + 1, '\n') : NULL;
    for (; p && p < sum; p = strchr(p + 1, '\n')) {
        double launches;  // the name fills the first 72 columns (spaces in its template arguments)
        if (p + 1 + 72 >= sum || sscanf(p + 1 + 72, "%lf %lf", &launches, &ms) != 2) break;
        CHECK(launches >= 1 && ms >= 0 && ms <= last, "row %d: %s", rows + 1, p + 1);
        last = ms;
        rows++;
    }
    CHECK(head && sum && rows == 3, "segnet bench --kernels 3: %d rows in:\n%s", rows, out);
    free(out);
    rc = run_shell("./segnet bench --device cpu --model unet --depth 2 --width 8 --size 32x32 "
                   "--batch 2 --classes 3 --steps 1 --kernels 3",
                   msg, sizeof msg);
    CHECK(rc != 0 && contains(msg, "--kernels times the CUDA kernels: it needs --device cuda"),
          "segnet bench --device cpu --kernels: exit %d: %s", rc, msg);
}
#endif

// The real trainer on the emulated CUDA backend and on the CPU, from the same
// seed and data, in fp32 and bf16 storage. Only what is well-conditioned is
// compared: a quantity whose value moves by orders of magnitude more than a
// rounding when a last bit changes says nothing about the kernels, and its
// difference depends on the machine's vector unit (AVX-512, AVX2, SSE round
// the CPU's partial sums differently). Measured with three builds of the same
// steps (CPU -march=native on AVX-512, CPU NO_NATIVE=1, emulated CUDA):
// - plain unet (depth 2, width 4) at 32×32, 4 steps: losses within 1.1e-7 of
//   each other, step 1's gradient (L2) within 8.9e-7: checked at 2e-5 and 1e-5;
// - unet-effv2-t: only step 1's loss (the forward at equal weights), at 64×64,
//   where the three agree to 6e-8 (checked at 2e-5). At 32×32 its last stages
//   normalise 2 values per channel and the builds differ by 5e-6 already at
//   step 1; after one Adam update (≈ lr·sign(g), and the gradients upstream of
//   those batch norms are rounding noise) step 2 differs by 3e-3, and even at
//   64×64 step 1's gradient differs by 2% (L2) between two CPU builds, growing
//   ~10× per decoder level from the head. Its backward ops are compared one by
//   one in the other cuda_ tests.
// - bf16: an activation whose fp32 value differs in its last bit now and then
//   rounds to the neighbouring bf16 value (2^-8 relative), so each bf16 run is
//   its own rounding noise around the fp32 run and two of them differ by up to
//   about twice the CPU's bf16-vs-fp32 difference: checked at 3× that, at
//   least 1e-2 (measured: 2.4e-3 at unet's step 4, 2.1e-3 at unet-effv2-t's step 1).
SLOW_TEST(cuda_train_steps) {
    if (!cu_ops_complete("cuda_train_steps")) return;
    const struct {
        const char *model;
        int hw, steps;
    } runs[2] = {{"unet", 32, 4}, {"unet-effv2-t", 64, 1}};
    const DType dts[2] = {DT_F32, DT_BF16};
    const double tol_f32 = 2e-5, tol_bf16 = 1e-2, tol_grad_f32 = 1e-5;
    for (int m = 0; m < 2; m++) {
        double cpu_f32[4];
        for (int k = 0; k < 2; k++) {
            double cpu[4], gpu[4], worst = 0.0, tol_used = 0.0;
            const int steps = runs[m].steps, grads = k == 0 && m == 0;
            float *g_cpu = NULL, *g_gpu = NULL;
            size_t n_cpu = 0, n_gpu = 0;
            cu_train_losses(runs[m].model, runs[m].hw, dts[k], DEVICE_CPU, steps, cpu,
                            grads ? &g_cpu : NULL, &n_cpu);
            cu_train_losses(runs[m].model, runs[m].hw, dts[k], DEVICE_CUDA, steps, gpu,
                            grads ? &g_gpu : NULL, &n_gpu);
            if (k == 0) memcpy(cpu_f32, cpu, sizeof cpu);
            for (int s = 0; s < steps; s++) {
                double e = fabs(gpu[s] - cpu[s]) / fabs(cpu[s]);
                double tol =
                        k == 0 ? tol_f32
                               : fmax(tol_bf16, 3.0 * fabs(cpu[s] - cpu_f32[s]) / fabs(cpu[s]));
                if (!(e <= worst)) worst = e;  // NaN too
                tol_used = fmax(tol_used, tol);
                CHECK(e <= tol,
                      "%s %s step %d: loss %.9g on cuda, %.9g on the CPU (relative error %.3g > "
                      "%.2g)",
                      runs[m].model, DT_NAME[dts[k]], s + 1, gpu[s], cpu[s], e, tol);
            }
            if (g_verbose)
                printf("      %-13s %s %d×%d: %d steps, loss %.6f .. %.6f, worst relative "
                       "difference %.3g (tolerance %.2g)\n",
                       runs[m].model, DT_NAME[dts[k]], runs[m].hw, runs[m].hw, steps, cpu[0],
                       cpu[steps - 1], worst, tol_used);
            if (grads) {
                double e = n_cpu == n_gpu ? rel_l2(g_gpu, g_cpu, n_cpu) : INFINITY;
                CHECK(e <= tol_grad_f32,
                      "%s fp32 step 1: gradient (%zu floats on cuda, %zu on the CPU) %.3g apart "
                      "(L2) > %.1g",
                      runs[m].model, n_gpu, n_cpu, e, tol_grad_f32);
                if (g_verbose)
                    printf("      %-13s fp32 step 1 gradient: %.3g apart (L2, tolerance %.1g)\n",
                           runs[m].model, e, tol_grad_f32);
            }
            free(g_cpu); free(g_gpu);
        }
    }
}

TEST(cuda_fused_layers_bitwise) {
    if (!cu_ops_complete("cuda_fused_layers_bitwise")) return;
    fused_layers_case(DEVICE_CUDA, DT_BF16, 0);
}

// The plan on the CUDA backend: trainer_open allocates exactly what the
// plan counts for the run, and the plan adds the device context's own scratch
// and cuBLAS's workspace (allocated once, when the device is opened), which
// peak_device_bytes counts, and the estimate of what the driver holds.
TEST(cuda_plan_equals_allocation) {
    if (!cu_ops_complete("cuda_plan_equals_allocation")) return;
    const char *models[2] = {"unet", "unet-effv2-t"};
    for (int k = 0; k < 2; k++) {
        TrainCfg c = tiny_seg_cfg(NULL, NULL);
        c.model.model = models[k];
        c.model.height = c.model.width = 32;
        c.model.batch = 2;
        c.model.depth = 2;
        c.checkpoint = k; c.precision = k ? DT_BF16 : DT_F32;
        c.device = DEVICE_CUDA;
        Graph g;
        Plan p;
        Ops *o;
        char err[SN_ERR_MAX];
        int logits = plan_for(&c, &g, &p, &o, err);
        CHECK(logits >= 0 && o == &ops_cuda, "%s", err);
        if (logits < 0) { graph_free(&g); continue; }
        // the vector kernels need every tensor on a 16-byte boundary of the arena
        int misaligned = 0;
        for (int b = 0; b < p.n_bufs; b++) misaligned += p.bufs[b].offset % SN_TENSOR_ALIGN != 0;
        CHECK(misaligned == 0, "%s: %d of %d planned buffers not %d-byte aligned", models[k],
              misaligned, p.n_bufs, SN_TENSOR_ALIGN);
        MemoryReport m;
        memory_report(&g, &p, &c, logits, o, &m);
        CHECK(m.backend == o->context_bytes && m.backend > 0 && cuda_bytes_peak >= m.backend,
              "context %zu bytes, counted %zu, peak %zu", o->context_bytes, m.backend,
              cuda_bytes_peak);
        size_t before = cuda_bytes_live;
        Trainer t;
        CHECK(trainer_open(&t, &c, NULL, NULL, err) == 0, "%s", err);
        size_t used = cuda_bytes_live - before;
        CHECK(m.driver == o->driver_bytes && m.driver > 0,
              "the driver's context: %zu bytes counted", m.driver);
        CHECK(used + m.backend + m.driver == m.total,
              "%s: planned %zu bytes (%zu of them the context's scratch, %zu the driver's), "
              "allocated %zu",
              models[k], m.total, m.backend, m.driver, used);
        trainer_close(&t);
        plan_free(&p); graph_free(&g);
    }
}

#ifdef SEGNET_NCCL
// ---- replicas on emulated devices: NCCL communicators (kernels.cu) over the
// emulator's devices (CUEMU_DEVICES, read at each call) and its NCCL, which sums
// in rank order like the CPU replicas

// The emulator has CU_DEVICES devices (CUEMU_DEVICES, read at each call). On
// real GPUs (test_segnet_gpu, built with SEGNET_TEST_GPU) a test that needs
// more than the machine has is skipped, saying so.
#define CU_DEVICES 3
static int cu_devices(int n, const char *who) {
#ifdef SEGNET_TEST_GPU
    char err[SN_ERR_MAX];
    if (cuda_ops_for_device(n - 1, err)) return 1;
    if (g_verbose) printf("    %s: it needs %d GPUs (%s)\n", who, n, err);
    g_skip = "more GPUs than this machine has";
    return 0;
#else
    (void)n; (void)who;
    setenv("CUEMU_DEVICES", "3", 1);
    return 1;
#endif
}

// One rank of test_cuda_nccl_comm: sums of float, double and int64 device
// buffers, then a broadcast from rank 1; results downloaded into its NcclProbe.
typedef struct {
    const float *f; const double *d; const int64_t *i;  // (3) this rank's values
    float f_out[3]; double d_out[3]; int64_t i_out[3];
    uint8_t bytes[13];  // rank 1's pattern, broadcast
    int ok;
} NcclProbe;

static int nccl_probe(Comm *c, void *arg) {
    NcclProbe *p = arg;
    char err[SN_ERR_MAX];
    Ops *o = cuda_ops_for_device(c->local_rank, err);
    if (!o) return -1;
    float *f = o->alloc(o, sizeof p->f_out);
    double *d = o->alloc(o, sizeof p->d_out);
    int64_t *i = o->alloc(o, sizeof p->i_out);
    uint8_t *b = o->alloc(o, sizeof p->bytes);
    o->upload(o, f, p->f, sizeof p->f_out);
    o->upload(o, d, p->d, sizeof p->d_out);
    o->upload(o, i, p->i, sizeof p->i_out);
    for (int k = 0; k < (int)sizeof p->bytes; k++) p->bytes[k] = (uint8_t)(c->rank * 100 + k);
    o->upload(o, b, p->bytes, sizeof p->bytes);
    Comm *dc = c->device;
    int rc = dc->allreduce_f32(dc, f, 3) || dc->allreduce_f64(dc, d, 3) ||
             dc->allreduce_i64(dc, i, 3) || dc->broadcast(dc, b, sizeof p->bytes, 1);
    o->download(o, p->f_out, f, sizeof p->f_out);
    o->download(o, p->d_out, d, sizeof p->d_out);
    o->download(o, p->i_out, i, sizeof p->i_out);
    o->download(o, p->bytes, b, sizeof p->bytes);
    o->free(o, f); o->free(o, d); o->free(o, i); o->free(o, b);
    return rc;
}

// 3 ranks on 3 emulated devices: the NCCL sums are ((b0 + b1) + b2), which
// differs from any other order for 1 + 2^-24 + 2^-24 (fp32: 1 in rank order,
// 1 + 2^-23 from the right) and 1 + 2^-53 + 2^-53 (fp64); int64 sums exact;
// every rank gets the same bits; the broadcast gives every rank rank 1's bytes.
// Real NCCL (3 GPUs) adds in its ring's or tree's order instead: there the
// sums must be the same bits on every rank and within one rounding (relative
// 2^-23, 2^-52) of the rank-order sum. Replicas on more devices than there are
// is refused, naming the device.
TEST(cuda_nccl_comm) {
    if (!cu_devices(CU_DEVICES, "cuda_nccl_comm")) return;
    const float f[3][3] = {{1.0f, 0.1f, -3.5f}, {0x1p-24f, 0.2f, 1e-3f}, {0x1p-24f, 0.3f, 7.25f}};
    const double d[3][3] = {{1.0, 0.1, -3.5}, {0x1p-53, 0.2, 1e-3}, {0x1p-53, 0.3, 7.25}};
    const int64_t i[3][3] = {{(int64_t)1 << 40, -5, 3}, {7, 11, (int64_t)1 << 50}, {-9, 13, 1}};
    Comm hosts[CU_DEVICES], dcomms[CU_DEVICES];
    NcclProbe p[CU_DEVICES];
    void *args[CU_DEVICES];
    int rc[CU_DEVICES];
    char err[SN_ERR_MAX];
    CHECK(comm_local_create(hosts, CU_DEVICES) == 0, "comm_local_create");
    if (cuda_comm_local_create(dcomms, hosts, CU_DEVICES, err)) {
        CHECK(0, "cuda_comm_local_create(%d): %s", CU_DEVICES, err);
        comm_local_destroy(hosts, CU_DEVICES);
        return;
    }
    for (int r = 0; r < CU_DEVICES; r++) {
        p[r] = (NcclProbe){.f = f[r], .d = d[r], .i = i[r]};
        args[r] = &p[r];
        CHECK(hosts[r].device == &dcomms[r] && !strcmp(dcomms[r].name, "nccl"),
              "rank %d's device communicator", r);
    }
    CHECK(cuda_ops_for_device(1, err) != &ops_cuda &&
                  cuda_ops_for_device(1, err)->ctx != ops_cuda.ctx,
          "device 1 has a table and a context of its own");
    comm_local_run(hosts, CU_DEVICES, nccl_probe, args, rc);
    cuda_comm_destroy(dcomms, CU_DEVICES);
    comm_local_destroy(hosts, CU_DEVICES);
    for (int r = 0; r < CU_DEVICES; r++) {
        CHECK(rc[r] == 0, "rank %d failed", r);
        for (int k = 0; k < 3; k++) {
            float fs = (f[0][k] + f[1][k]) + f[2][k];
            double ds = (d[0][k] + d[1][k]) + d[2][k];
            int64_t is = i[0][k] + i[1][k] + i[2][k];
#ifdef SEGNET_TEST_GPU
            CHECK(!memcmp(&p[r].f_out[k], &p[0].f_out[k], sizeof fs) &&
                          !memcmp(&p[r].d_out[k], &p[0].d_out[k], sizeof ds),
                  "rank %d's sum %d differs from rank 0's", r, k);
            CHECK(fabs(p[r].f_out[k] - fs) <= 0x1p-23 * fabs(fs) &&
                          fabs(p[r].d_out[k] - ds) <= 0x1p-52 * fabs(ds),
                  "rank %d sum %d: %.9g, %.17g; rank order %.9g, %.17g", r, k, p[r].f_out[k],
                  p[r].d_out[k], fs, ds);
#else
            CHECK(!memcmp(&p[r].f_out[k], &fs, sizeof fs),
                  "rank %d float %d: %.9g, rank order %.9g", r, k, p[r].f_out[k], fs);
            CHECK(!memcmp(&p[r].d_out[k], &ds, sizeof ds),
                  "rank %d double %d: %.17g, rank order %.17g", r, k, p[r].d_out[k], ds);
#endif
            CHECK(p[r].i_out[k] == is, "rank %d int64 %d: %lld, expected %lld", r, k,
                  (long long)p[r].i_out[k], (long long)is);
        }
        for (int k = 0; k < 13; k++)
            CHECK(p[r].bytes[k] == 100 + k, "rank %d byte %d after the broadcast: %d", r, k,
                  p[r].bytes[k]);
    }
#ifndef SEGNET_TEST_GPU
    CHECK(p[0].f_out[0] == 1.0f && p[0].d_out[0] == 1.0,
          "1 + 2^-24 + 2^-24 in rank order is 1: %.9g, %.17g", p[0].f_out[0], p[0].d_out[0]);
#endif
    if (cuda_ops_for_device(CU_DEVICES, err)) return;  // a machine with more GPUs
    Comm more[CU_DEVICES + 1], dmore[CU_DEVICES + 1];
    CHECK(comm_local_create(more, CU_DEVICES + 1) == 0, "comm_local_create");
    CHECK(cuda_comm_local_create(dmore, more, CU_DEVICES + 1, err) == -1 &&
                  contains(err, "4 replicas need one CUDA device each") &&
                  contains(err, "no CUDA device 3"),
          "4 replicas on 3 devices: %s", err);
    comm_local_destroy(more, CU_DEVICES + 1);
}

// --replicas 2 --sync-bn on 2 emulated devices (NCCL between them) trains 3
// steps of global batches of 4 like one replica on one emulated device, within
// the summation-order noise measured as in the replicas_ tests (compare_to_one:
// the same batches reordered on one replica); the replicas stay mirrored bit for
// bit; and the run matches the CPU backend's 2 replicas: the loss within 2e-5
// relative, the tolerance of cuda_train_steps (the backends add in different
// orders, ~1e-7 per op, carried through the Adam steps), and loss, weights and
// BN statistics within REPLICA_NOISE_FACTOR times what separates the two
// backends' single replicas (measured here). 16×16 keeps these distances at
// ~1e-7; at 32×32 every one of them, the reordered batch's too, is ~2e-4:
// Adam's first steps move a weight by ±lr whatever its gradient's size, so a
// gradient near 0 whose last bits differ moves its weight the other way.
TEST(cuda_replicas_sync_bn) {
    if (!cu_ops_complete("cuda_replicas_sync_bn") || !cu_devices(2, "cuda_replicas_sync_bn"))
        return;
    enum { B = 4, STEPS = 3, HW = 16, R = 2 };
    float *images;
    int32_t *labels;
    replica_batches(STEPS, B, HW, 23, &images, &labels);
    TrainCfg gpu = tiny_seg_cfg(NULL, NULL), cpu;
    gpu.model.depth = 2; gpu.model.height = gpu.model.width = HW; gpu.model.batch = B;
    gpu.sync_bn = 1;
    gpu.threads = 1;
    gpu.device = DEVICE_CUDA;
    cpu = gpu;
    cpu.device = DEVICE_CPU;
    size_t P, NB;
    model_sizes(&gpu, &P, &NB);
    ReplicaJob one = {.c = &gpu,
                      .steps = STEPS,
                      .B = B,
                      .images = images,
                      .labels = labels,
                      .inf_rank = -1},
               rev = one, one_cpu = one;
    rev.reverse = 1;
    one_cpu.c = &cpu;
    ReplicaJob jobs[R], cpus[R];
    for (int r = 0; r < R; r++) { jobs[r] = one; cpus[r] = one_cpu; }
    if (run_replicas(&one, 1) == 0 && run_replicas(&rev, 1) == 0 &&
        run_replicas(&one_cpu, 1) == 0 && run_replicas(jobs, R) == 0 &&
        run_replicas(cpus, R) == 0) {
        check_mirrored("cuda, 2 replicas, sync-bn", jobs, R, P, NB);
        compare_to_one("cuda, 2 replicas, sync-bn", &jobs[0], &one, &rev, P, NB);
        double loss = jobs[0].loss / jobs[0].norm, loss_cpu = cpus[0].loss / cpus[0].norm;
        double dl = fabs(loss - loss_cpu) / loss_cpu,
               dw = rel_l2(jobs[0].params, cpus[0].params, P),
               db = rel_l2(jobs[0].buffers, cpus[0].buffers, NB);
        // the backends' distance on one replica: the noise floor of the comparison
        double nl = fabs(one.loss / one.norm - one_cpu.loss / one_cpu.norm) /
                    (one_cpu.loss / one_cpu.norm),
               nw = rel_l2(one.params, one_cpu.params, P),
               nb = rel_l2(one.buffers, one_cpu.buffers, NB);
        if (g_verbose)
            printf("    cuda vs cpu, 2 replicas: loss %.3g, weights %.3g, BN stats %.3g (1 "
                   "replica: %.3g, %.3g, %.3g)\n",
                   dl, dw, db, nl, nw, nb);
        CHECK(dl <= 2e-5 && dl <= REPLICA_NOISE_FACTOR * fmax(nl, FLT_EPSILON),
              "2 replicas: loss %.9g on cuda, %.9g on the CPU (1 replica: %.3g apart)", loss,
              loss_cpu, nl);
        CHECK(dw <= REPLICA_NOISE_FACTOR * fmax(nw, FLT_EPSILON),
              "2 replicas, cuda vs CPU: weights %.3g apart, 1 replica %.3g", dw, nw);
        CHECK(db <= REPLICA_NOISE_FACTOR * fmax(nb, FLT_EPSILON),
              "2 replicas, cuda vs CPU: BN statistics %.3g apart, 1 replica %.3g", db, nb);
        CHECK(!memcmp(jobs[0].cm, cpus[0].cm, sizeof jobs[0].cm),
              "2 replicas: the confusion matrices differ between backends");
    }
    for (int r = 0; r < R; r++) { replica_job_free(&jobs[r]); replica_job_free(&cpus[r]); }
    replica_job_free(&one); replica_job_free(&rev); replica_job_free(&one_cpu);
    free(images); free(labels);
}

// every fp32 tensor of a safetensors file, concatenated in header order; NULL if unreadable
static float *safetensors_floats(const char *path, size_t *n) {
    SafetensorsFile f;
    char err[SN_ERR_MAX];
    *n = 0;
    if (safetensors_read(path, &f, err)) return NULL;
    size_t total = 0;
    for (int i = 0; i < f.n_tensors; i++)
        if (f.tensors[i].dtype == DT_F32) total += f.tensors[i].numel;
    float *v = malloc(sizeof(float) * (total ? total : 1));
    for (int i = 0; i < f.n_tensors; i++)
        if (f.tensors[i].dtype == DT_F32) {
            memcpy(v + *n, f.tensors[i].data, sizeof(float) * f.tensors[i].numel);
            *n += f.tensors[i].numel;
        }
    safetensors_free(&f);
    return v;
}

// train_run with --replicas 2 --device cuda --sync-bn on 2 emulated devices:
// NCCL communicators made by the run (the weights mirrored by an NCCL
// broadcast, the gradients all-reduced by NCCL), 2 epochs (a last global batch
// of one image: one shard empty) with validation. Against the CPU's
// --replicas 2 run: metrics.csv's losses within cuda_train_steps' fp32
// tolerance, 2e-5 relative, and every float of last.safetensors within 1e-5
// (‖·‖₂ relative): the fp32 rounding of another summation order through a few
// Adam steps, measured 5e-8 (-v prints it); gradients left unsummed put them
// 3e-2 apart. (Both ranks draw the same initial weights, so the broadcast that
// mirrors them changes nothing here; cuda_nccl_comm tests it.) More replicas
// than devices: one line, no run folder.
TEST(cuda_replicas_train_run) {
    if (!cu_ops_complete("cuda_replicas_train_run") || !cu_devices(2, "cuda_replicas_train_run"))
        return;
    const char *data = "/tmp/segnet_test_cuda_rep_data", *run = "/tmp/segnet_test_cuda_rep_run";
    rm_rf(data); rm_rf(run);
    write_seg_set(data, 5, 8, 8, 31);
    TrainCfg c = tiny_seg_cfg(data, data);
    c.epochs = 2;
    c.replicas = 2;
    c.sync_bn = 1;
    c.threads = 1;
    double loss[2][2], val[2][2];
    char out[2][600], path[1300], err[SN_ERR_MAX];
    for (int k = 0; k < 2; k++) {
        c.device = k ? DEVICE_CUDA : DEVICE_CPU;
        snprintf(out[k], sizeof out[k], "%s/%s", run, DEVICE_NAMES[c.device]);
        c.out = out[k];
        CHECK(train_run(&c, NULL, err) == 0, "--replicas 2 --device %s: %s", DEVICE_NAMES[c.device],
              err);
        snprintf(path, sizeof path, "%s/metrics.csv", out[k]);
        CHECK(csv_column(path, "loss", loss[k], 2) == 2 &&
                      csv_column(path, "val_loss", val[k], 2) == 2,
              "%s: 2 epochs", path);
    }
    size_t n[2];
    float *w[2];
    for (int k = 0; k < 2; k++) {
        snprintf(path, sizeof path, "%s/last.safetensors", out[k]);
        w[k] = safetensors_floats(path, &n[k]);
    }
    if (w[0] && w[1] && n[0] == n[1] && n[0] > 0) {
        double dw = rel_l2(w[1], w[0], n[0]);
        if (g_verbose)
            printf("    last.safetensors: %.3g apart (cuda vs cpu, %zu floats)\n", dw, n[0]);
        CHECK(dw <= 1e-5, "last.safetensors: cuda and cpu %.3g apart", dw);
    } else {
        CHECK(0, "last.safetensors: %zu and %zu floats", n[0], n[1]);
    }
    free(w[0]); free(w[1]);
    for (int e = 0; e < 2; e++) {
        double dl = fabs(loss[1][e] - loss[0][e]) / loss[0][e],
               dv = fabs(val[1][e] - val[0][e]) / val[0][e];
        if (g_verbose)
            printf("    epoch %d: loss %.3g, val_loss %.3g apart (cuda vs cpu)\n", e + 1, dl, dv);
        CHECK(dl <= 2e-5 && dv <= 2e-5,
              "epoch %d: loss %.9g / %.9g, val_loss %.9g / %.9g (cuda / cpu)", e + 1, loss[1][e],
              loss[0][e], val[1][e], val[0][e]);
    }
    c.replicas = CU_DEVICES + 1;
    // a machine with more GPUs
    if (cuda_ops_for_device(CU_DEVICES, err)) { rm_rf(data); rm_rf(run); return; }
    snprintf(out[0], sizeof out[0], "%s/more", run);
    c.out = out[0];
    CHECK(train_run(&c, NULL, err) == -1 &&
                  contains(err, "--device cuda: 4 replicas need one CUDA device each") &&
                  !strchr(err, '\n') && access(out[0], F_OK) != 0,
          "4 replicas on 3 devices: %s", err);
    rm_rf(data); rm_rf(run);
}
#else
// A build without NCCL (NO_NCCL=1) refuses replicas on CUDA devices in one line.
TEST(cuda_replicas_no_nccl) {
    TrainCfg c = tiny_seg_cfg("/nonexistent", NULL);
    c.replicas = 2;
    c.device = DEVICE_CUDA;
    char err[SN_ERR_MAX];
    CHECK(train_run(&c, NULL, err) == -1 &&
                  contains(err, "need NCCL: this segnet was built without it"),
          "%s", err);
}
#endif
#endif
