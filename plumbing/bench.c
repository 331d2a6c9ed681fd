// bench.c -- segnet bench: the trainer's own training steps on synthetic data, timed.
// Plumbing of the segnet program: segnet.c (the math, the models, the step)
// includes this file at its end, so that the program is one translation unit.

// ----------------------------------------------------------------------------
// benchmark: the trainer's own training steps (train_step: forward, loss,
// backward, loss scaling, Adam) on synthetic data, in the trainer's planned
// arena, so the time and the peak memory are a run's; optionally a profile by
// op kind from net->layer_seconds, the rest of the step (loss, optimiser,
// uploads) in one row.

typedef enum {
    BK_CONV1, BK_CONVK, BK_DEPTHWISE, BK_BN, BK_ACT, BK_SE, BK_OTHER, BK_REST, BK_COUNT
} BenchKind;
static const char *const BENCH_KIND_NAMES[BK_COUNT] = {
        "conv 1x1",    "conv kxk",    "depthwise", "batch norm",
        "activations", "squeeze-exc", "other",     "loss+optim",
};

#define BENCH_KERNEL_ROWS 64
typedef struct {
    ModelCfg model;
    int steps, warmup;   // timed steps, untimed steps before them
    int threads;         // 0: OpenMP's default
    int profile;         // fill BenchResult's per-kind table
    int kernels;         // > 0: time each CUDA kernel (BenchResult's kernel rows)
    DType precision;     // activation storage
    int checkpoint;      // recompute blocks in backward
    uint64_t seed;
    Device device;
    LossCfg loss;        // n 0: ce alone
} BenchCfg;

typedef struct {
    double step_ms;                  // median over the timed steps
    double images_per_s;             // batch / median step
    double host_ms;                  // median of the steps' host time outside their device work
    size_t peak_rss_bytes;           // getrusage ru_maxrss of the whole process
    size_t peak_device_bytes;        // the most the backend's alloc had handed out at once
    double kind_fwd_ms[BK_COUNT], kind_bwd_ms[BK_COUNT];  // per step (mean), with profile
    double kind_gflop[BK_COUNT];     // per step, forward + backward (convs only)
    size_t n_params;
    int threads;                     // the OpenMP threads it ran with
    const char *backend;             // the ops table's name
    // with kernels: the kernels with the most device time over the timed steps, most first
    KernelTimeRow kernel_rows[BENCH_KERNEL_ROWS];
    int n_kernels;                   // kernels timed (rows beyond BENCH_KERNEL_ROWS left out)
} BenchResult;

// The op kind a layer's time is booked under. The SE pieces are the pooling,
// the scale and the convs and activations on (N,1,1,C) tensors; dense layers
// (the classifier) count as "other".
static BenchKind bench_kind(const Graph *g, const Layer *l) {
    Shape in = tshape(g, l->in[0]);
    int on_pooled = in.h == 1 && in.w == 1;
    switch (l->kind) {
    case LAYER_CONV:
        if (on_pooled) return BK_SE;
        if (conv_is_depthwise(&l->conv)) return BK_DEPTHWISE;
        return l->conv.kh == 1 && l->conv.kw == 1 ? BK_CONV1 : BK_CONVK;
    case LAYER_BN: return BK_BN;
    case LAYER_ACT: return on_pooled ? BK_SE : BK_ACT;
    case LAYER_GAP: case LAYER_SCALE: case LAYER_SE_GATE: return BK_SE;
    default: return BK_OTHER;
    }
}

// multiply-adds ×2 of a conv's forward: 2·N·OH·OW·Cout·(kh·kw·Cin/groups)
static double conv_flops(const Graph *g, const Layer *l) {
    Shape out = tshape(g, l->out);
    return 2.0 * out.n * out.h * out.w * out.c * (double)l->conv.kh * l->conv.kw *
           (l->conv.cin / l->conv.groups);
}

static int cmp_double(const void *a, const void *b) {
    double x = *(const double *)a, y = *(const double *)b;
    return (x > y) - (x < y);
}
// the median of v (n; sorted in place), 0 when n is 0
static double median_of(double *v, int n) {
    if (n <= 0) return 0.0;
    qsort(v, (size_t)n, sizeof(double), cmp_double);
    return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

int bench_run(const BenchCfg *c, BenchResult *r, char err[SN_ERR_MAX]) {
    memset(r, 0, sizeof *r);
    set_threads(c->threads);
    TrainCfg tc;  // the trainer's defaults: Adam (lr 1e-3), every class weight 1, no clipping
    train_cfg_default(&tc);
    tc.model = c->model;
    tc.precision = c->precision;
    tc.checkpoint = c->checkpoint;
    tc.device = c->device;
    tc.seed = c->seed;
    if (c->loss.n) tc.loss = c->loss;
    tc.progress = 0;
    Trainer t;
    if (trainer_open(&t, &tc, NULL, NULL, err)) { trainer_close(&t); return -1; }
    const Graph *g = &t.g;
    Ops *o = t.o;
    const Backend *b = o->backend;  // NULL: the CPU
    // --kernels: a device backend's per-kernel device time
    const int time_kernels = c->kernels > 0 && b;
    if (c->kernels > 0 && !time_kernels) {
        snprintf(err, SN_ERR_MAX, "--kernels times the CUDA kernels: it needs --device cuda");
        trainer_close(&t);
        return -1;
    }
    r->n_params = g->n_param_floats;
    r->backend = o->name;
#ifdef _OPENMP
    r->threads = omp_get_max_threads();
#else
    r->threads = 1;
#endif
    const Shape in = g->tensors[g->input].shape;
    const int K = t.K, N = in.n;
    const size_t n_in = shape_numel(in), n_labels = (size_t)N * t.per_image;
    // synthetic data: images 0..255, labels 0..K-1, ready to travel as the loader makes a batch
    // without colour augmentation (bytes and labels in host_alloc memory)
    uint8_t *host_in = o->host_alloc(o, n_in);
    int32_t *host_lab = o->host_alloc(o, sizeof(int32_t) * n_labels);
    int64_t *cm = calloc((size_t)K * K, sizeof(int64_t));
    double *times = malloc(sizeof(double) * (size_t)(c->steps > 0 ? c->steps : 1)),
           *host_times = malloc(sizeof(double) * (size_t)(c->steps > 0 ? c->steps : 1));
    double *layer_s = c->profile ? calloc(2 * (size_t)g->n_layers, sizeof(double)) : NULL;
    snCheck(host_in && host_lab && cm && times && host_times && (!c->profile || layer_s),
            "out of host memory");
    Rng rng;
    rng_seed(&rng, c->seed ^ 0x62656e6368ull);
    for (size_t i = 0; i < n_in; i++) host_in[i] = (uint8_t)(rng_next(&rng) % 256);
    for (size_t i = 0; i < n_labels; i++) host_lab[i] = (int32_t)(rng_next(&rng) % (uint64_t)K);
    // as segnet train's loader workers sum it, outside the step
    const double weight_sum = label_weight_sum(host_lab, n_labels, loss_norm_weights(t.c), K);
    // what the layers' times leave of the timed steps: loss, optimiser, copies
    double rest_s = 0.0;
    if (time_kernels) {
        t.records = 0;  // a replayed graph's kernels are not timed one by one
        b->kernel_times_reset();
    }
    for (int step = 0; step < c->warmup + c->steps; step++) {
        const int timed = step >= c->warmup;
        double layers_before = 0.0;
        if (layer_s) for (int i = 0; i < 2 * g->n_layers; i++) layers_before += layer_s[i];
        t.net.layer_seconds = timed ? layer_s : NULL;
        if (b) b->kernel_timing(timed && time_kernels);
        // train_step returns when the device has finished the step (its one wait)
        double t0 = now_seconds();
        MicroBatch mb = {N, NULL, host_lab, 0, &weight_sum, host_in, 1};
        PassTotals pt = {.cm = cm};
        train_step(&t, &mb, 1, &pt);
        double dt = now_seconds() - t0;
        if (timed) {
            times[step - c->warmup] = dt;
            host_times[step - c->warmup] = t.step_host_seconds;
            if (layer_s) {
                double layers = -layers_before;
                for (int i = 0; i < 2 * g->n_layers; i++) layers += layer_s[i];
                rest_s += dt - layers;
            }
        }
    }
    if (b) b->kernel_timing(0);
    if (time_kernels) r->n_kernels = b->kernel_times(r->kernel_rows, BENCH_KERNEL_ROWS);
    const int n = c->steps > 0 ? c->steps : 0;
    const double med = median_of(times, n);
    r->step_ms = 1e3 * med;
    r->host_ms = 1e3 * median_of(host_times, n);
    r->images_per_s = med > 0.0 ? N / med : 0.0;
    struct rusage ru;
    getrusage(RUSAGE_SELF, &ru);
    r->peak_rss_bytes = (size_t)ru.ru_maxrss * 1024;
    r->peak_device_bytes = b ? b->bytes_peak() : cpu_bytes_peak;
    if (c->profile && n) {
        for (int i = 0; i < g->n_layers; i++) {
            const Layer *l = &g->layers[i];
            BenchKind k = bench_kind(g, l);
            r->kind_fwd_ms[k] += 1e3 * layer_s[i] / n;
            r->kind_bwd_ms[k] += 1e3 * layer_s[g->n_layers + i] / n;
            if (l->kind == LAYER_CONV && k != BK_SE) {
                double f = conv_flops(g, l);
                int grads_w = !l->frozen, grads_x = t.net.needs_grad[l->in[0]];
                r->kind_gflop[k] += 1e-9 * f * (1 + grads_w + grads_x);
            }
        }
        r->kind_bwd_ms[BK_REST] += 1e3 * rest_s / n;
    }
    o->host_free(o, host_in); o->host_free(o, host_lab);
    free(cm); free(times); free(host_times); free(layer_s);
    trainer_close(&t);
    return 0;
}

// ----------------------------------------------------------------------------
// the loader alone: decode, resize, augmentation and batching of a data set,
// as the training loop receives them (its Loader, `workers` threads, 4 batches
// ahead), with nothing cached, as a data set larger than memory is read

typedef struct {
    int batches;              // timed batches
    int warmup;               // batches before the timing starts (the workers' start-up)
    int images;               // the data set's samples
    double ms_per_batch;      // wall time per timed batch
    double images_per_s;
} LoaderBench;

// Batches of c->model.batch images of c->data (the model says whether it is a
// segmentation set). Returns 0, or -1 with err (the data set's, or the loader's).
static int bench_loader(const TrainCfg *c, LoaderBench *r, char err[SN_ERR_MAX]) {
    Dataset d;
    const int seg = !model_is_classifier(c->model.model), threads = c->threads > 0 ? c->threads : 2;
    if (dataset_open_named(&d, c->data, seg, c->model.classes, c->model.height, c->model.width, 0,
                           threads, NULL, &c->masks, err))
        return -1;
    r->images = d.n;
    // the samples in order, from the start again as often as needed: every batch is whole
    const int B = c->model.batch, total = r->warmup + r->batches;
    int *order = malloc(sizeof(int) * (size_t)total * B);
    snCheck(order != NULL, "out of host memory");
    for (int i = 0; i < total * B; i++) order[i] = i % d.n;
    // the trainer's loader makes the batches ready for the device (ops_cpu's memory here)
    Loader *l = loader_start(&d, order, total * B, B, &c->augment, c->seed, c->workers, 4, 0, NULL,
                             &ops_cpu, c->precision);
    double t0 = 0.0;
    int got = 0, images = 0;
    for (const LoaderBatch *b; got < total && (b = loader_next(l)); got++) {
        if (got == r->warmup) t0 = now_seconds();
        if (got >= r->warmup) images += b->n;
    }
    const double seconds = now_seconds() - t0;
    int rc = 0;
    if (got < total) {
        const char *why = loader_error(l);
        snprintf(err, SN_ERR_MAX, "%s", why[0] ? why : "the loader stopped");
        rc = -1;
    }
    loader_stop(l);
    free(order);
    dataset_free(&d);
    r->ms_per_batch = 1e3 * seconds / r->batches;
    r->images_per_s = images / seconds;
    return rc;
}
