// run.c -- the training run: options, opening a trainer, passes, checkpoints, metrics.csv, resume.
// Plumbing of the segnet program: segnet.c (the math, the models, the step)
// includes this file at its end, so that the program is one translation unit.

// ----------------------------------------------------------------------------
// optimisation diagnostics (segnet.c's StepStats): limits, and the update ratio

// as text (checkpoint metadata): the fields up to update_ratio, space-separated
#define STEP_STATS_FIELDS 11
// clipping acted on more than this fraction of an epoch's steps
#define WARN_CLIP_FRACTION 0.5
// fp16 overflow skipped more than this fraction of an epoch's steps
#define WARN_SKIP_FRACTION 0.05
// or more than this many steps in a row (the loss scale fell each time)
#define WARN_SKIP_RUN 3
#define WARN_TRAIN_MODE_GAP 0.05      // the train metric below the validation one by more than this

static void step_stats_reset(StepStats *st) {
    *st = (StepStats){0};
    st->loss_scale = 1.0;
    st->update_ratio = NAN;
}

// the trainable weights (t->ranges, packed) into t->update_host: its first half (before a step) or
// second (after)
static void trainable_download(Trainer *t, int after) {
    if (!t->update_host) {
        t->update_host = malloc(sizeof(float) * 2 * (t->n_trainable ? t->n_trainable : 1));
        snCheck(t->update_host != NULL, "out of host memory");
    }
    float *host = t->update_host + (after ? t->n_trainable : 0);
    size_t packed = 0;
    for (int r = 0; r < t->n_ranges; r++) {
        t->o->download(t->o, host + packed, t->net.params + t->ranges[r].offset,
                       sizeof(float) * t->ranges[r].count);
        packed += t->ranges[r].count;
    }
}
// ‖w_after - w_before‖ / ‖w_before‖ in fp64 (trainable_download(t, 0) before the step)
static double trainable_update_ratio(Trainer *t) {
    const size_t n = t->n_trainable;
    trainable_download(t, 1);
    const float *before = t->update_host, *after = t->update_host + n;
    double d = 0.0, w = 0.0;
    for (size_t i = 0; i < n; i++) {
        const double e = (double)after[i] - before[i];
        d += e * e;
        w += (double)before[i] * before[i];
    }
    return w > 0.0 ? sqrt(d / w) : NAN;
}

// ----------------------------------------------------------------------------
// the training run: options, opening a trainer, passes, checkpoints, metrics.csv, resume

void train_cfg_default(TrainCfg *c) {
    memset(c, 0, sizeof *c);
    c->model = model_cfg_default();
    c->model.batch = 8;
    for (int k = 0; k < SN_MAX_CLASSES; k++) c->class_weights[k] = 1.0f;
    c->epochs = 10;
    c->lr = 1e-3f;
    c->adam_eps = ADAM_EPS;
    c->schedule = SCHEDULE_CONSTANT;
    c->plateau = (PlateauCfg){0.1f, 0.0f, 1e-4f, 10};  // Keras' ReduceLROnPlateau defaults
    c->seed = 1;
    // the loader's threads: the cores but one, which the trainer keeps
    const long cores = sysconf(_SC_NPROCESSORS_ONLN);
    c->workers = cores > 2 ? (int)(cores - 1 < 256 ? cores - 1 : 256) : 1;
    c->cache_bytes = (size_t)2 << 30;
    c->progress = 1;
    c->precision = DT_F32;
    c->accum = 1;
    c->loss_scale_interval = LOSS_SCALE_GROWTH_INTERVAL;
    c->loss = loss_cfg_default();
}

static int model_is_classifier(const char *model) { return !strncmp(model, "effv2-", 6); }
// indexed by DType, as --precision spells them
static const char *const DTYPE_NAMES[] = {"fp32", "fp16", "bf16"};

// ",value" in `format` (a printf conversion of one double); "," for NaN
static void csv_value(SfBuf *b, double v, const char *format) {
    char s[48];
    s[0] = ',';
    if (isnan(v)) s[1] = 0;
    else snprintf(s + 1, sizeof s - 1, format, v);
    sb_str(b, s);
}
static void csv_num(SfBuf *b, double v) { csv_value(b, v, "%.6f"); }

// 6 significant digits: the diagnostics span decades
static void csv_sig(SfBuf *b, double v) { csv_value(b, v, "%.6g"); }

// the shortest decimal that reads back as the same float (0.001, not 0.00100000005)
static const char *float_str(char buf[32], float v) {
    for (int digits = 6; digits <= 9; digits++) {
        snprintf(buf, 32, "%.*g", digits, v);
        if (strtof(buf, NULL) == v) break;
    }
    return buf;
}

// --augment's value: none, or its items comma-separated
static void augment_text(const Augment *a, SfBuf *b) {
    char s[96], f[2][32];
    int n = 0;
    if (a->flip) { sb_str(b, "flip"); n++; }
    if (a->brightness > 0) {
        snprintf(s, sizeof s, "%sbrightness=%s", n++ ? "," : "", float_str(f[0], a->brightness));
        sb_str(b, s);
    }
    if (a->contrast_lo > 0 || a->contrast_hi > 0) {
        snprintf(s, sizeof s, "%scontrast=%s:%s", n++ ? "," : "", float_str(f[0], a->contrast_lo),
                 float_str(f[1], a->contrast_hi));
        sb_str(b, s);
    }
    if (a->vflip) { sb_str(b, n++ ? ",vflip" : "vflip"); }
    if (a->scale_hi > 0) {
        snprintf(s, sizeof s, "%sscale=%s:%s", n++ ? "," : "", float_str(f[0], a->scale_lo),
                 float_str(f[1], a->scale_hi));
        sb_str(b, s);
    }
    if (a->rotate > 0) {
        snprintf(s, sizeof s, "%srotate=%s", n++ ? "," : "", float_str(f[0], a->rotate));
        sb_str(b, s);
    }
    if (a->hue > 0) {
        snprintf(s, sizeof s, "%shue=%s", n++ ? "," : "", float_str(f[0], a->hue));
        sb_str(b, s);
    }
    if (a->saturation_hi > 0) {
        snprintf(s, sizeof s, "%ssaturation=%s:%s", n++ ? "," : "",
                 float_str(f[0], a->saturation_lo), float_str(f[1], a->saturation_hi));
        sb_str(b, s);
    }
    if (!n) sb_str(b, "none");
}

// --loss's value: its terms `W*name` joined by +, a weight of 1 left out (ce alone: ce)
static void loss_text(const LossCfg *l, SfBuf *b) {
    char f[32];
    for (int j = 0; j < (l->n ? l->n : 1); j++) {
        if (j) sb_str(b, "+");
        if (l->n && l->weight[j] != 1.0f) {
            sb_str(b, float_str(f, l->weight[j]));
            sb_str(b, "*");
        }
        sb_str(b, LOSS_NAMES[l->n ? l->kind[j] : LOSS_CE]);
    }
}
// the loss menu's settings: --loss, and the constants of the terms it has, as
// `key = value` lines of config.txt (sep "\n", eq " = ") or one `,key:value` token
static void loss_settings_text(const LossCfg *l, const char *sep, const char *eq, SfBuf *b) {
    char f[3][32], s[160];
    loss_text(l, b);
    if (loss_has(l, LOSS_FOCAL)) {
        snprintf(s, sizeof s, "%sfocal-gamma%s%s%sfocal-alpha%s%s", sep, eq,
                 float_str(f[0], l->focal_gamma), sep, eq, float_str(f[1], l->focal_alpha));
        sb_str(b, s);
    }
    if (loss_has_region(l)) {
        snprintf(s, sizeof s, "%sloss-smooth%s%s", sep, eq, float_str(f[0], l->smooth));
        sb_str(b, s);
    }
    if (loss_group_name(l)) {
        snprintf(s, sizeof s, "%sloss-per-image%s%s", sep, eq, l->per_image ? "on" : "off");
        sb_str(b, s);
    }
    if (loss_has(l, LOSS_TVERSKY)) {
        snprintf(s, sizeof s, "%stversky-alpha%s%s%stversky-beta%s%s%stversky-gamma%s%s", sep, eq,
                 float_str(f[0], l->tversky_alpha), sep, eq, float_str(f[1], l->tversky_beta), sep,
                 eq, float_str(f[2], l->tversky_gamma));
        sb_str(b, s);
    }
}

// --class-weights' value: K weights comma-separated
static void class_weights_text(const TrainCfg *c, SfBuf *b) {
    char f[32];
    for (int k = 0; k < c->model.classes; k++) {
        if (k) sb_str(b, ",");
        sb_str(b, float_str(f, c->class_weights[k]));
    }
}

// --ignore-index's value: the mask values comma-separated, or none
static void ignore_text(const MaskRules *m, SfBuf *b) {
    char v[16];
    for (int i = 0; i < m->n_ignore; i++) {
        snprintf(v, sizeof v, "%s%d", i ? "," : "", m->ignore[i]);
        sb_str(b, v);
    }
    if (!m->n_ignore) sb_str(b, "none");
}

// what early stopping and best.safetensors watch: the validation loss, or the
// validation mIoU or mean Dice (segmentation) / accuracy (classification); the
// training run's own values when there is no validation set
static const char *monitor_name(const TrainCfg *c) {
    return !c->monitor_metric                    ? "val_loss"
           : model_is_classifier(c->model.model) ? "val_accuracy"
           : c->monitor_metric == 2              ? "val_dice"
                                                 : "val_mIoU";
}

// the columns' values: norm mean and max, clip fraction, loss scale, skipped steps, update ratio,
// ms per step
#define STEP_STATS_N_COLUMNS 7
static const char *const STEP_STATS_COLUMNS =
        "grad_norm_mean,grad_norm_max,clip_fraction,loss_scale,skipped_steps,"
        "update_ratio,step_ms";
static void step_stats_columns(const StepStats *st, double v[STEP_STATS_N_COLUMNS]) {
    const int64_t applied = st->steps - st->skipped;
    v[0] = applied ? st->norm_sum / (double)applied : NAN;
    v[1] = applied ? st->norm_max : NAN;
    v[2] = st->steps ? (double)st->clipped / (double)st->steps : NAN;
    v[3] = st->steps ? st->loss_scale : NAN;
    v[4] = (double)st->skipped;
    v[5] = st->update_ratio;
    v[6] = st->timed ? 1000.0 * st->seconds / (double)st->timed : NAN;
}

static void step_stats_text(const StepStats *st, char *out, size_t size) {
    snprintf(out, size,
             "%" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 " %" PRId64 " %a %a %a %a %a %a",
             st->steps, st->clipped, st->skipped, st->skip_run, st->skip_run_max, st->norm_sum,
             st->norm_max, st->loss_sum, st->label_sum, st->loss_scale, st->update_ratio);
}
// the text of step_stats_text back, every field checked; -1 with err naming the file and key
static int step_stats_parse(const char *path, const char *key, const char *text, StepStats *st,
                            char err[SN_ERR_MAX]) {
    int64_t n[5];
    double x[6];
    const char *p = text;
    for (int k = 0; k < STEP_STATS_FIELDS; k++) {
        char *end;
        errno = 0;
        if (k < 5) n[k] = strtoll(p, &end, 10);
        else x[k - 5] = strtod(p, &end);
        const char sep = k + 1 < STEP_STATS_FIELDS ? ' ' : 0;
        if (end == p || *p == ' ' || errno == ERANGE || *end != sep || (k < 5 && n[k] < 0)) {
            snprintf(err, SN_ERR_MAX,
                     "%.300s: metadata '%s': item %d is not a number (a damaged checkpoint)", path,
                     key, k + 1);
            return -1;
        }
        p = end + (sep != 0);
    }
    *st = (StepStats){n[0], n[1], n[2], n[3], n[4], x[0], x[1], x[2], x[3], x[4], x[5], 0.0, 0};
    if (st->clipped + st->skipped > st->steps || st->skip_run > st->skip_run_max ||
        st->skip_run_max > st->skipped || !(st->label_sum >= 0) || !(st->loss_scale > 0) ||
        !isfinite(st->loss_scale) || st->update_ratio < 0) {
        snprintf(err, SN_ERR_MAX,
                 "%.250s: metadata '%s' is '%.120s', counts or figures out of range (a damaged "
                 "checkpoint)",
                 path, key, text);
        return -1;
    }
    return 0;
}

// the communicator of a trainer without replicas
static LocalGroup comm_one_group = {.size = 1,
                                    .mu = PTHREAD_MUTEX_INITIALIZER,
                                    .cv = PTHREAD_COND_INITIALIZER,
                                    .failed_rank = -1};
static Comm comm_one = LOCAL_COMM_INIT(&comm_one_group, 0, 1);

static void trainer_close(Trainer *t) {
    Ops *o = t->o;
    if (o) {
        o->free(o, t->adam_m); o->free(o, t->adam_v); o->free(o, t->class_weights);
        o->free(o, t->region_sums); o->free(o, t->region_coefs); o->free(o, t->region_rows);
        o->free(o, t->lovasz_ws);
        o->free(o, t->labels); o->free(o, t->confusion); o->free(o, t->args); o->free(o, t->state);
        o->free(o, t->stage); o->free(o, t->nonfinite);
        if (t->record) o->record_free(o, t->record);
        if (o->host_free) {
            o->host_free(o, t->host_args);
            o->host_free(o, t->host_state);
            o->host_free(o, t->host_seeds);
            o->host_free(o, t->host_images); o->host_free(o, t->host_labels);
        }
    }
    free(t->ranges);
    free(t->accum_images);
    free(t->accum_labels);
    free(t->bn_host);
    free(t->resume_cm);
    free(t->update_host); free(t->steps_csv);
    net_free(&t->net);
    graph_free(&t->g);
    if (t->has_train && !t->borrowed_data) dataset_free(&t->train);
    if (t->has_val && !t->borrowed_data) dataset_free(&t->val);
    memset(t, 0, sizeof *t);
}

// optimiser steps of the whole run: K global batches of model.batch images per step
static void trainer_count_steps(Trainer *t) {
    const TrainCfg *c = t->c;
    int64_t batches = (t->train.n + c->model.batch - 1) / c->model.batch;
    t->total_steps = t->has_train ? (batches + c->accum - 1) / c->accum * c->epochs : 0;
}

// The device of a replica. With replicas, replicas_on_gpus has decided before
// they start: a device communicator (comm->device) means GPUs; --device auto
// without one means the CPU. Without replicas, --device as given.
static Device replica_device(const TrainCfg *c, const Comm *comm) {
    if (comm->size > 1 && c->device == DEVICE_AUTO && !comm->device) return DEVICE_CPU;
    return c->device;
}

// The training set's fingerprint: an FNV-1a hash (64-bit) over its samples in order.
#define FNV1A_OFFSET 0xcbf29ce484222325ull
#define FNV1A_PRIME  0x100000001b3ull

static uint64_t fnv1a(uint64_t h, const void *p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * FNV1A_PRIME;
    return h;
}
// --label-map as a checkpoint's settings record it: the FNV-1a hash of the
// map's contents (wherever the file lies), or none
static void label_map_text(const MaskRules *m, SfBuf *b) {
    if (!m->label_map) { sb_str(b, "none"); return; }
    uint64_t h = FNV1A_OFFSET;
    uint8_t buf[4096];
    FILE *f = fopen(m->label_map, "rb");
    for (size_t n; f && (n = fread(buf, 1, sizeof buf, f)) > 0;) h = fnv1a(h, buf, n);
    if (f) fclose(f);
    char s[24];
    snprintf(s, sizeof s, "%016" PRIx64, h);
    sb_str(b, s);
}
// a sample file's share of the hash: its name under root (whole when outside it) and its size
static uint64_t fingerprint_file(uint64_t h, const char *path, const char *root) {
    const size_t k = strlen(root);
    const char *name = !strncmp(path, root, k) && path[k] == '/' ? path + k + 1 : path;
    struct stat sb;
    const int64_t size = stat(path, &sb) == 0 ? (int64_t)sb.st_size : -1;
    return fnv1a(fnv1a(h, name, strlen(name) + 1), &size, sizeof size);
}
// "<samples> <hash>" of data set d, opened from path (a folder, or a CSV whose folder its paths
// start from)
static void data_fingerprint(const Dataset *d, const char *path, char out[64]) {
    char root[OUT_PATH_MAX];
    struct stat sb;
    if (stat(path, &sb) == 0 && !S_ISDIR(sb.st_mode)) path_folder(path, root);
    else snprintf(root, sizeof root, "%s", path);
    uint64_t h = FNV1A_OFFSET;
    for (int i = 0; i < d->n; i++) {
        h = fingerprint_file(h, d->images[i], root);
        if (d->masks) h = fingerprint_file(h, d->masks[i], root);
        else h = fnv1a(h, &d->labels[i], sizeof d->labels[i]);
    }
    snprintf(out, 64, "%d %016" PRIx64, d->n, h);
}

// A data set holds something the loss weighs: a pixel (sample) of a class
// whose weight is above 0. Without one its loss would be 0/0.
static int dataset_weighted(const Dataset *d, const char *path, const TrainCfg *c,
                            char err[SN_ERR_MAX]) {
    char held[256] = "";
    int n_held = 0;
    for (int k = 0; k < d->classes; k++) {
        if (d->class_counts[k] && c->class_weights[k] > 0.0f) return 0;
        char item[64];
        snprintf(item, sizeof item, "%d (weight %g)", k, c->class_weights[k]);
        if (d->class_counts[k]) list_add(held, sizeof held, &n_held, item);
    }
    if (!n_held) {
        snprintf(err, SN_ERR_MAX,
                 "%.200s: every mask pixel is ignored (--ignore-index): its loss would be 0/0",
                 path);
        return -1;
    }
    snprintf(err, SN_ERR_MAX,
             "%.200s: not one %s of a class whose weight is above 0: its %s only class%s %s, so "
             "its loss would be 0/0 (see --class-weights)",
             path, d->segmentation ? "pixel" : "image",
             d->segmentation ? "masks hold" : "labels are", n_held == 1 ? "" : "es", held);
    return -1;
}

// --freeze base (and --unfreeze-last N) on the graph; -1 with err for an N
// the backbone does not have, or an N without --freeze base (it would do nothing).
static int freeze_apply(Graph *g, const TrainCfg *c, char err[SN_ERR_MAX]) {
    if (!c->freeze_base) {
        if (c->unfreeze_last <= 0) return 0;
        snprintf(err, SN_ERR_MAX,
                 "--unfreeze-last %d does nothing without --freeze base (every layer trains)",
                 c->unfreeze_last);
        return -1;
    }
    const int blocks = graph_freeze_base(g, c->unfreeze_last);
    if (c->unfreeze_last <= blocks) return 0;
    snprintf(err, SN_ERR_MAX, "--unfreeze-last %d: model '%s' has %d blocks in its backbone",
             c->unfreeze_last, c->model.model, blocks);
    return -1;
}

// Builds the model and opens the data (train may be NULL: evaluation only).
// comm: the replicas (NULL: none); each builds the model for its shard,
// model.batch / replicas images.
static int trainer_open_on(Trainer *t, const TrainCfg *c, const char *train, const char *val,
                           Comm *comm, char err[SN_ERR_MAX]) {
    memset(t, 0, sizeof *t);
    t->c = c;
    t->comm = comm ? comm : &comm_one;
    graph_init(&t->g);
    if (input_size_checked(&c->model, err)) return -1;
    const int R = t->comm->size;
    if (c->model.batch % R) {
        snprintf(err, SN_ERR_MAX,
                 "--batch %d is the global batch: it must be a multiple of the %d replicas",
                 c->model.batch, R);
        return -1;
    }
    ModelCfg shard = c->model;
    shard.batch = t->shard = c->model.batch / R;
    t->logits = model_build(&t->g, &shard);
    if (t->logits < 0) { snprintf(err, SN_ERR_MAX, "%s", t->g.err); return -1; }
    Shape out = t->g.tensors[t->logits].shape, in = t->g.tensors[t->g.input].shape;
    t->K = out.c;
    t->segmentation = !model_is_classifier(c->model.model);
    if (t->segmentation && (out.h != in.h || out.w != in.w)) {
        snprintf(err, SN_ERR_MAX, "model '%s' gives (%d,%d) logits for (%d,%d) images",
                 c->model.model, out.h, out.w, in.h, in.w);
        return -1;
    }
    int any_weight = 0;
    for (int k = 0; k < t->K; k++) {
        if (!(c->class_weights[k] >= 0.0f) || isinf(c->class_weights[k])) {
            snprintf(err, SN_ERR_MAX, "class weight %d is %g: weights must be finite and ≥ 0", k,
                     c->class_weights[k]);
            return -1;
        }
        any_weight |= c->class_weights[k] > 0.0f;
    }
    if (!any_weight) {
        snprintf(err, SN_ERR_MAX, "every class weight is 0: nothing to learn");
        return -1;
    }
    if (c->iou_per_image && !t->segmentation) {
        snprintf(err, SN_ERR_MAX, "--iou-per-image: model '%s' is a classifier (an image has one "
                 "label: its accuracy is the metric)", c->model.model);
        return -1;
    }
    if (loss_group_name(&c->loss) && !t->segmentation) {
        snprintf(err, SN_ERR_MAX,
                 "--loss %s: dice, jaccard, tversky and lovasz are region "
                 "losses of segmentation; model '%s' is a classifier",
                 loss_group_name(&c->loss), c->model.model);
        return -1;
    }
    // lovasz over the batch sorts all its pixels together: one sort per micro-batch and replica
    // would be another loss (not built: gathering the errors of all of them)
    if (loss_has(&c->loss, LOSS_LOVASZ) && !c->loss.per_image && (R > 1 || c->accum > 1)) {
        snprintf(err, SN_ERR_MAX,
                 "--loss lovasz over the global batch needs it whole in one "
                 "step (%s): add --loss-per-image",
                 R > 1 ? "--replicas" : "--accum");
        return -1;
    }
    if (train) {
        if (dataset_open_named(&t->train, train, t->segmentation, t->K, in.h, in.w,
                               c->cache_bytes, c->threads > 0 ? c->threads : 2, NULL, &c->masks,
                               err))
            return -1;
        t->has_train = 1;
        data_fingerprint(&t->train, train, t->data_print);
    }
    if (val) {
        if (dataset_open_named(&t->val, val, t->segmentation, t->K, in.h, in.w, c->cache_bytes,
                               c->threads > 0 ? c->threads : 2, train ? &t->train : NULL,
                               &c->masks, err))
            return -1;
        t->has_val = 1;
    }
    if ((train && dataset_weighted(&t->train, train, c, err)) ||
        (val && dataset_weighted(&t->val, val, c, err)))
        return -1;
    if (freeze_apply(&t->g, c, err)) return -1;
    if (c->accum < 1 || c->accum > SN_MAX_ACCUM) {
        snprintf(err, SN_ERR_MAX, "--accum %d must be 1..%d", c->accum, SN_MAX_ACCUM);
        return -1;
    }
    // the device after every input check: a bad input is one line, without the CPU notice before it
    if (!(t->o = ops_for_device(replica_device(c, t->comm), t->comm->local_rank, err))) return -1;
    Ops *o = t->o;
    if (net_create_planned(&t->net, &t->g, o, c->precision, 0, t->logits, c->checkpoint, err))
        return -1;
    // trainable parameters as runs of the parameter buffer: their gradients
    // and Adam moments are packed in the same order; frozen ones have neither
    const Graph *g = &t->g;
    t->ranges = calloc((size_t)g->n_params + 1, sizeof *t->ranges);
    snCheck(t->ranges != NULL, "out of host memory");
    for (int p = 0; p < g->n_params; p++) {  // parameters are laid out in id order
        if (t->net.grad_offset[p] == SIZE_MAX) continue;
        if (t->n_ranges && t->ranges[t->n_ranges - 1].offset + t->ranges[t->n_ranges - 1].count ==
                                   g->params[p].offset)
            t->ranges[t->n_ranges - 1].count += g->params[p].count;
        else
            t->ranges[t->n_ranges++] =
                    (typeof(*t->ranges)){g->params[p].offset, g->params[p].count};
        t->n_trainable += g->params[p].count;
    }
    snCheck(t->n_trainable == t->net.n_grad_floats,
            "trainable ranges and gradient layout disagree");
    size_t T = t->n_trainable, labels = (size_t)in.n * (t->segmentation ? (size_t)in.h * in.w : 1);
    t->per_image = t->segmentation ? (size_t)in.h * in.w : 1;
    t->adam_m = o->alloc(o, sizeof(float) * (T ? T : 1));
    t->adam_v = o->alloc(o, sizeof(float) * (T ? T : 1));
    t->loss = c->loss.n ? c->loss : loss_cfg_default();
    const LossCfg *l = &t->loss;
    t->class_weights = o->alloc(o, sizeof(float) * t->K * (l->n + 1));
    if (loss_has_region(l)) {
        // over the batch: the step's sums and a micro-batch's (region_presum)
        const int groups = l->per_image ? in.n : 1, sum_groups = groups > 2 ? groups : 2;
        t->region_sums = o->alloc(o, sizeof(float) * 3 * t->K * sum_groups);
        t->region_coefs = o->alloc(o, sizeof(float) * (2 * t->K * groups + 1));
        t->region_rows = o->alloc(o, sizeof(float) * 2 * (size_t)in.n * in.h * in.w);
        if (!t->region_sums || !t->region_coefs || !t->region_rows) {
            snprintf(err, SN_ERR_MAX, "out of %s memory for the region losses", o->name);
            return -1;
        }
    }
    if (loss_has(l, LOSS_LOVASZ)) {
        t->lovasz_ws =
                o->alloc(o, lovasz_ws_bytes(l->per_image ? in.n : 1,
                                            (size_t)in.h * in.w * (l->per_image ? 1 : in.n), t->K));
        if (!t->lovasz_ws) {
            snprintf(err, SN_ERR_MAX, "out of %s memory for the lovasz loss's sort", o->name);
            return -1;
        }
    }
    t->labels = o->alloc(o, sizeof(int32_t) * labels);
    t->cm_len = (size_t)t->K * t->K + (c->iou_per_image ? 2 : 0);
    t->confusion = o->alloc(o, sizeof(int64_t) * t->cm_len);
    t->args = o->alloc(o, sizeof(StepArgs));
    t->state = o->alloc(o, sizeof(StepState));
    t->nonfinite = o->alloc(o, sizeof(int32_t));
    const DType dtype = t->net.dtype;  // the storage type, from here on the net's
    t->stage = o->alloc(o, stage_bytes(in, dtype, labels, o->upload_ahead != NULL));
    if (!t->adam_m || !t->adam_v || !t->class_weights || !t->labels || !t->confusion || !t->args ||
        !t->state || !t->nonfinite || !t->stage) {
        snprintf(err, SN_ERR_MAX, "out of %s memory for the optimiser state", o->name);
        return -1;
    }
    t->host_args = o->host_alloc(o, sizeof(StepArgs));
    t->host_state = o->host_alloc(o, sizeof(StepState));
    t->host_seeds = o->host_alloc(o, sizeof(uint64_t) * (size_t)g->n_layers);
    t->host_images = o->host_alloc(o, sizeof(float) * (size_t)in.n * in.h * in.w * 3);
    t->host_labels = o->host_alloc(o, sizeof(int32_t) * labels);
    if (!t->host_args || !t->host_state || !t->host_seeds || !t->host_images || !t->host_labels) {
        snprintf(err, SN_ERR_MAX, "out of pinned host memory for the staging buffers");
        return -1;
    }
    const char *records = getenv("SEGNET_CUDA_GRAPHS");
    t->records = !(records && !strcmp(records, "0"));
    if (c->accum > 1) {
        t->accum_images = malloc(sizeof(float) * (size_t)c->accum * in.n * in.h * in.w * 3);
        t->accum_labels = malloc(sizeof(int32_t) * (size_t)c->accum * labels);
        if (!t->accum_images || !t->accum_labels) {
            snprintf(err, SN_ERR_MAX, "out of host memory for %d micro-batches", c->accum);
            return -1;
        }
    }
    o->fill(o, tensor_f32(t->adam_m, shape4((int)T, 1, 1, 1)), 0.0f);
    o->fill(o, tensor_f32(t->adam_v, shape4((int)T, 1, 1, 1)), 0.0f);
    for (int j = 0; j < l->n; j++) {  // each term's weights (see score_batch)
        float w[SN_MAX_CLASSES];
        const float f = l->kind[j] == LOSS_FOCAL ? l->focal_alpha / (float)t->K : 1.0f;
        for (int k = 0; k < t->K; k++)
            w[k] = loss_is_group(l->kind[j]) ? c->class_weights[k]
                                             : l->weight[j] * f * c->class_weights[k];
        o->upload(o, t->class_weights + (size_t)j * t->K, w, sizeof(float) * t->K);
    }
    o->upload(o, t->class_weights + (size_t)l->n * t->K, c->class_weights, sizeof(float) * t->K);
    t->loss_scale = dtype == DT_F16 ? LOSS_SCALE_INIT : 1.0f;
    trainer_count_steps(t);
    if (R > 1) {
        t->bn_host = malloc(sizeof(double) * (g->n_buffer_floats + 1));
        snCheck(t->bn_host != NULL, "out of host memory");
        if (c->sync_bn) t->net.sync_bn = t->comm;
    }
    net_init_params(&t->net, c->seed);
    t->net.seed = c->seed;
    t->best = INFINITY;
    t->plateau = (Plateau){c->lr, INFINITY, 0};
    step_stats_reset(&t->epoch_stats);
    step_stats_reset(&t->log_stats);
    return 0;
}

static int trainer_open(Trainer *t, const TrainCfg *c, const char *train, const char *val,
                        char err[SN_ERR_MAX]) {
    return trainer_open_on(t, c, train, val, NULL, err);
}

// Local replicas read the data sets opened once (by rank 0)
static void trainer_borrow_data(Trainer *t, const Dataset *train, const Dataset *val) {
    if (train) { t->train = *train; t->has_train = 1; }
    if (val) { t->val = *val; t->has_val = 1; }
    t->borrowed_data = 1;
    trainer_count_steps(t);
}

static int comm_broadcast_backend(Trainer *t, void *buf, size_t bytes) {
    Comm *comm = t->comm;
    if (comm->size == 1 || bytes == 0) return 0;
    if (t->o == &ops_cpu) return comm->broadcast(comm, buf, bytes, 0);
    if (comm->device) return comm->device->broadcast(comm->device, buf, bytes, 0);
    void *host = malloc(bytes);
    snCheck(host != NULL, "out of host memory");
    t->o->download(t->o, host, buf, bytes);
    int rc = comm->broadcast(comm, host, bytes, 0);
    t->o->upload(t->o, buf, host, bytes);
    free(host);
    return rc;
}

// Mirrors rank 0 on every replica (at the start, after loading weights or a
// checkpoint there): parameters, BN statistics, Adam moments and the counters.
static int trainer_broadcast(Trainer *t) {
    const Graph *g = &t->g;
    struct {
        int64_t step, good_steps;
        double best;
        Plateau plateau;
        float loss_scale;
        int epoch, best_epoch, bad_epochs, finished;
    } k = {t->step,        t->good_steps, t->best,       t->plateau, t->loss_scale,
           t->epoch,       t->best_epoch, t->bad_epochs, t->finished};
    if (comm_broadcast_backend(t, t->net.params, sizeof(float) * g->n_param_floats) ||
        comm_broadcast_backend(t, t->net.buffers, sizeof(float) * g->n_buffer_floats) ||
        comm_broadcast_backend(t, t->adam_m, sizeof(float) * t->n_trainable) ||
        comm_broadcast_backend(t, t->adam_v, sizeof(float) * t->n_trainable) ||
        (t->comm->size > 1 && t->comm->broadcast(t->comm, &k, sizeof k, 0)))
        return -1;
    t->step = k.step; t->good_steps = k.good_steps; t->best = k.best; t->loss_scale = k.loss_scale;
    t->plateau = k.plateau;
    t->epoch = k.epoch;
    t->best_epoch = k.best_epoch;
    t->bad_epochs = k.bad_epochs;
    t->finished = k.finished;
    return 0;
}

// The tensors a fine-tuning run may initialise instead of loading, and the
// file's tensors it may leave unused: a classifier's head (another class
// count, a hidden layer); a U-Net on an EfficientNetV2 encoder from a
// classifier's weights: its decoder and head initialised, the classifier's
// head ignored. Plus the user's --allow-missing prefixes.
static LoadRules finetune_rules(const TrainCfg *c, char *init, size_t size) {
    const char *model = c->model.model, *own = "";
    LoadRules r = {init, NULL, 0};
    if (eff_spec(model)) own = "classifier.";
    else if (!strncmp(model, "unet-", 5)) {
        own = "decoder.,segmentation_head.";
        r.ignore = "classifier.";
    }
    snprintf(init, size, "%s%s%s", own, own[0] && c->allow_missing ? "," : "",
             c->allow_missing ? c->allow_missing : "");
    return r;
}

// ref/export_pretrained.py --random writes this metadata: a trial's starting
// weights, which no one should mistake for ImageNet's
#define WEIGHTS_KIND_KEY "weights"
#define WEIGHTS_RANDOM "random"

// Loads the initial weights of a training run (rules above; the report line
// in `report`, and in *random whether the file says its weights are random),
// or, with report NULL, weights to evaluate: every tensor.
static int trainer_load_weights(Trainer *t, const char *path, char *report, int *random,
                                char err[SN_ERR_MAX]) {
    SafetensorsFile f;
    if (safetensors_read(path, &f, err)) return -1;
    char init[SN_ERR_MAX];
    const LoadRules strict = {NULL, NULL, 0},
                    rules = report ? finetune_rules(t->c, init, sizeof init) : strict;
    int rc = net_load_weights_rules(&t->net, &f, path, &rules, report, err);
    const char *kind = safetensors_meta(&f, WEIGHTS_KIND_KEY);
    if (random) *random = kind && !strcmp(kind, WEIGHTS_RANDOM);
    safetensors_free(&f);
    return rc;
}

// A pass's metrics from its confusion record: with --iou-per-image, the mean IoU
// is the mean over the images of each one's (iou_per_image's sums after the K·K counts)
static void pass_metrics(const Trainer *t, const int64_t *cm, Metrics *m) {
    metrics_compute(cm, t->K, t->c->class_weights, m);
    if (!t->c->iou_per_image) return;
    const int64_t *image = cm + (size_t)t->K * t->K;
    m->mean_iou = image[1] ? (double)image[0] / IOU_IMAGE_ONE / (double)image[1] : NAN;
}

static void progress_line(const Trainer *t, int training, int batch_no, int n_batches, double t0,
                          int64_t images, const PassTotals *pt, int tty) {
    double el = now_seconds() - t0, eta = batch_no ? el / batch_no * (n_batches - batch_no) : 0.0;
    double iou[SN_MAX_CLASSES];
    Metrics m = {.iou = iou};
    pass_metrics(t, pt->cm, &m);
    fprintf(stderr, "%sepoch %d/%d %s %d/%d  %d:%02d left  %.1f img/s  loss %.4f  %s %.4f%s",
            tty ? "\r" : "", t->epoch + 1, t->c->epochs, training ? "train" : "val", batch_no,
            n_batches, (int)eta / 60, (int)eta % 60, el > 0 ? images / el : 0.0,
            pt->loss_sum / pt->norm_sum, t->segmentation ? "mIoU" : "accuracy",
            t->segmentation ? m.mean_iou : m.accuracy, tty ? "\033[K" : "\n");
    fflush(stderr);
}

// steps.csv's row for the steps since the last one (every replica calls it: the loss is summed over
// them)
static int steps_log_row(Trainer *t, double lr) {
    StepStats *st = &t->log_stats;
    double sums[2] = {st->loss_sum, st->label_sum}, v[STEP_STATS_N_COLUMNS];
    if (t->comm->size > 1 && t->comm->allreduce_f64(t->comm, sums, 2)) return -1;
    if (t->steps_csv) {
        SfBuf row = {0};
        char s[96], lr_text[32];
        snprintf(s, sizeof s, "%" PRId64 ",%d,%s", t->step, t->epoch + 1,
                 float_str(lr_text, (float)lr));
        sb_str(&row, s);
        csv_num(&row, sums[1] > 0 ? sums[0] / sums[1] : NAN);
        step_stats_columns(st, v);
        for (int k = 0; k < STEP_STATS_N_COLUMNS; k++) csv_sig(&row, v[k]);
        sb_str(&row, "\n");
        sb_put(&row, "", 1);
        FILE *f = row.oom ? NULL : fopen(t->steps_csv, "a");
        if (!f || fputs(row.p, f) < 0 || fclose(f)) {
            fprintf(stderr,
                    "segnet train: warning: %s: cannot append (%s); steps.csv is not written from "
                    "here on\n",
                    t->steps_csv, strerror(errno));
            free(t->steps_csv);
            t->steps_csv = NULL;
        }
        free(row.p);
    }
    step_stats_reset(st);
    return 0;
}

// Images [lo, hi) of a global batch of n images are replica r's of R: the
// shards of a full batch are equal, those of a last, smaller one differ by at
// most one image (and may be empty).
static void shard_range(int n, int R, int r, int *lo, int *hi) {
    *lo = (int)((int64_t)n * r / R);
    *hi = (int)((int64_t)n * (r + 1) / R);
}

// The replicas' sums of a pass added up: loss, normaliser, confusion matrix
static int reduce_totals(Trainer *t, PassTotals *pt) {
    Comm *comm = t->comm;
    if (comm->size == 1) return 0;
    double sums[2] = {pt->loss_sum, pt->norm_sum};
    if (comm->allreduce_f64(comm, sums, 2) ||
        comm->allreduce_i64(comm, pt->cm, t->cm_len))
        return -1;
    pt->loss_sum = sums[0];
    pt->norm_sum = sums[1];
    return 0;
}

// ---- interruption: the first SIGINT or SIGTERM lets the step finish, then
// the run saves where it is (last.safetensors, mid-epoch) and exits 128 +
// the signal; a second one exits at once. The files stay whole either way:
// every write is atomic (a *.tmp.<pid> left behind is removed at the next start).

// interrupt_signal (declared with the data checks, which it also stops) is the first SIGINT/SIGTERM

// Whether to stop now: 0, or the signal (every replica stops at the same
// step: one that saw none stops with the others); -1 if a replica failed.
static int interrupt_poll(Trainer *t) {
    const int hook = t->c->interrupt_at_step && t->step >= t->c->interrupt_at_step;
    int64_t any = interrupt_signal || hook;
    if (t->comm->size > 1 && t->comm->allreduce_i64(t->comm, &any, 1)) return -1;
    return !any ? 0 : interrupt_signal ? (int)interrupt_signal : hook ? SIGINT : SIGTERM;
}

// epoch e's (0-based) stream: its shuffle, and augment_seed_of it its augmentation
static uint64_t epoch_seed_of(uint64_t seed, int epoch) {
    return rng_mix64(seed ^ rng_mix64(0x7261696e00000000ull + (uint64_t)epoch));
}
static uint64_t augment_seed_of(uint64_t epoch_seed) { return rng_mix64(epoch_seed + 1); }

static int mkdir_p(const char *path, char err[SN_ERR_MAX]);

// segnet augment: samples 0..n-1 of c->data as epoch `epoch` (1-based) of a run
// with c's settings augments them, written into the folder out (created if
// missing) as aug<epoch>-<i>-<stem>.png (the image the network sees, its
// values clipped to 0..255 and rounded; epoch and i zero-padded to the digits
// of the run's epochs and of n - 1, so that names list in order) and, for segmentation,
// aug<epoch>-<i>-<stem>_overlay.png (the mask's class colours blended 50/50,
// ignored pixels left as they are). An existing file is never replaced, and
// out is never the data folder or inside it.
int augment_write(const TrainCfg *c, const char *out, int n, int epoch, char err[SN_ERR_MAX]) {
    if (path_within_folder(out, c->data)) {
        snprintf(err, SN_ERR_MAX,
                 "--out %.180s is, or is inside, the data set %.180s: segnet augment never "
                 "writes among the samples it reads (a later run would read its files as samples)",
                 out, c->data);
        return -1;
    }
    Dataset d;
    const int seg = !model_is_classifier(c->model.model);
    if (dataset_open_named(&d, c->data, seg, c->model.classes, c->model.height, c->model.width,
                           c->cache_bytes, c->threads > 0 ? c->threads : 2, NULL, &c->masks, err))
        return -1;
    const int H = d.height, W = d.width, count = n < d.n ? n : d.n,
              epoch_digits = snprintf(NULL, 0, "%d", c->epochs > epoch ? c->epochs : epoch),
              i_digits = snprintf(NULL, 0, "%d", count > 1 ? count - 1 : 0);
    const size_t P = (size_t)H * W;
    float *x = malloc(sizeof(float) * 3 * P);
    int32_t *y = malloc(sizeof(int32_t) * (seg ? P : 1));
    uint8_t *rgb = malloc(3 * P), *blend = malloc(3 * P);
    snCheck(x && y && rgb && blend, "out of host memory");
    const uint64_t seed = augment_seed_of(epoch_seed_of(c->seed, epoch - 1));
    int rc = mkdir_p(out, err);
    for (int i = 0; rc == 0 && i < count; i++) {
        rc = dataset_batch(&d, &i, 1, &c->augment, seed, x, y, err);
        for (size_t k = 0; rc == 0 && k < 3 * P; k++) {
            const long v = lrintf(x[k]);
            rgb[k] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
        }
        int len;
        const char *stem = path_stem(d.images[i], &len);
        char path[2][OUT_PATH_MAX];
        for (int k = 0; k < 2; k++)
            snprintf(path[k], OUT_PATH_MAX, "%s/aug%0*d-%0*d-%.*s%s.png", out, epoch_digits,
                     epoch, i_digits, i, len, stem, k ? "_overlay" : "");
        for (int k = 0; rc == 0 && k < 1 + seg; k++)
            if (access(path[k], F_OK) == 0) {
                snprintf(err, SN_ERR_MAX, "%.400s: exists (segnet augment replaces nothing)",
                         path[k]);
                rc = -1;
            }
        if (rc == 0) rc = png_write_atomic(path[0], W, H, 3, rgb, err) ? -1 : 0;
        if (rc || !seg) continue;
        for (size_t p = 0; p < P; p++)
            for (int k = 0; k < 3; k++)
                blend[3 * p + k] = y[p] < 0 ? rgb[3 * p + k]
                                            : (uint8_t)((rgb[3 * p + k] +
                                                         SEG_PALETTE[y[p] % SEG_COLOURS][k] + 1) /
                                                        2);
        rc = png_write_atomic(path[1], W, H, 3, blend, err) ? -1 : 0;
    }
    free(x); free(y); free(rgb); free(blend);
    dataset_free(&d);
    return rc;
}

// One pass over a data set: global batches of model.batch images in a shuffled
// order (training) or in order; this replica runs its shard of each. Returns
// -1 with err if the data failed here (the other replicas are told) or on
// another replica; the signal when interrupted after a step (training: t->resume_batch
// says where the pass goes on; pt holds this replica's totals so far, not
// summed over the replicas).
static int run_pass(Trainer *t, const Dataset *d, int training, PassTotals *pt,
                    char err[SN_ERR_MAX]) {
    const TrainCfg *c = t->c;
    Ops *o = t->o;
    Comm *comm = t->comm;
    const int B = c->model.batch, N = t->shard, K = t->K, R = comm->size;
    const Shape in = t->g.tensors[t->g.input].shape;
    int *order = malloc(sizeof(int) * (size_t)(d->n ? d->n : 1)),
        *mine = malloc(sizeof(int) * (size_t)(d->n ? d->n : 1));
    snCheck(order && mine, "out of host memory");
    for (int i = 0; i < d->n; i++) order[i] = i;
    const uint64_t epoch_seed = epoch_seed_of(c->seed, t->epoch);
    if (training) {  // Fisher-Yates with the epoch's own stream
        Rng r;
        rng_seed(&r, epoch_seed);
        for (int i = d->n - 1; i > 0; i--) {
            int j = (int)(rng_next(&r) % (uint64_t)(i + 1)), tmp = order[i];
            order[i] = order[j]; order[j] = tmp;
        }
    }
    // this replica's shards of the global batches, in order: the loader takes them N at a time
    const int n_batches = (d->n + B - 1) / B, start = training ? t->resume_batch : 0;
    int n_mine = 0, skip = 0, lo, hi;
    for (int j = 0; j < n_batches; j++) {
        shard_range(d->n - j * B < B ? d->n - j * B : B, R, comm->rank, &lo, &hi);
        for (int i = lo; i < hi; i++) mine[n_mine++] = order[j * B + i];
        if (j + 1 == start) skip = n_mine;  // an interrupted epoch goes on after its last step
    }
    Loader *L = n_mine > skip ? loader_start(d, mine + skip, n_mine - skip, N,
                                             training ? &c->augment : NULL,
                                             augment_seed_of(epoch_seed), c->workers, 4, K,
                                             loss_norm_weights(c),
                                             // micro-batches of accumulation are copied instead
                                             !training || c->accum == 1 ? o : NULL, t->net.dtype)
                              : NULL;
    // int64 zeros
    o->fill(o, tensor_f32((float *)t->confusion, shape4(2 * (int)t->cm_len, 1, 1, 1)), 0.0f);
    pt->loss_sum = pt->norm_sum = 0.0;
    // else load_checkpoint restored them
    if (training && !start) step_stats_reset(&t->epoch_stats);
    if (start) {  // the totals of the batches before it, as this replica had them
        o->upload(o, t->confusion, t->resume_cm, sizeof(int64_t) * t->cm_len);
        pt->loss_sum = t->resume_loss_sum;
        pt->norm_sum = t->resume_norm_sum;
        free(t->resume_cm);
        t->resume_cm = NULL;
        t->resume_batch = 0;
    }
    const int tty = isatty(STDERR_FILENO) && comm->rank == 0;
    // With replicas, progress lines are totals over all of them (a collective
    // on every replica at the same batches): a quarter of the epoch apart.
    const int every = tty && R == 1 ? 1 : (n_batches + 3) / 4;
    const size_t image_floats = (size_t)N * in.h * in.w * 3, label_count = (size_t)N * t->per_image;
    double t0 = now_seconds();
    int64_t images = 0;
    // pending: micro-batches gathered for the next optimiser step
    int pending = 0, rc = 0, stopped = 0, stop_signal = 0;
    MicroBatch mb[SN_MAX_ACCUM];
    double weight_sums[SN_MAX_ACCUM];  // the loader's, of the micro-batches in mb
    for (int j = start; j < n_batches && rc == 0 && !stopped; j++) {
        const int nj = d->n - j * B < B ? d->n - j * B : B;
        shard_range(nj, R, comm->rank, &lo, &hi);
        MicroBatch shard = {0, NULL, NULL, pending * B + lo, NULL, NULL, 0};
        if (hi > lo) {
            const double waited = now_seconds();
            const LoaderBatch *b = loader_next(L);
            pt->seconds_loader += now_seconds() - waited;
            if (!b) {  // a file that changed on disk since the start: this replica cannot go on
                snprintf(err, SN_ERR_MAX, "%s", loader_error(L));
                rc = -2;
                break;
            }
            snCheck(b->n == hi - lo, "the loader gave %d images for a shard of %d", b->n, hi - lo);
            shard = (MicroBatch){b->n,         b->images,      b->labels,     pending * B + lo,
                                 &b->weight_sum, b->wire, b->wire_bytes};
        }
        int step_rc = 0;
        const double step_started = now_seconds();
        // the epoch's last step (train_step clears it)
        t->measure_update = training && j + 1 == n_batches;
        if (training && c->accum == 1) {
            // the next step's batch, when the loader has it ready, is uploaded during this step
            const LoaderBatch *nb = j + 1 < n_batches ? loader_peek(L) : NULL;
            const MicroBatch next = nb ? (MicroBatch){nb->n,           nb->images, nb->labels, 0,
                                                      &nb->weight_sum, nb->wire,   nb->wire_bytes}
                                       : (MicroBatch){0, NULL, NULL, 0, NULL, NULL, 0};
            t->next = nb ? &next : NULL;
            step_rc = train_step(t, &shard, 1, pt);
            t->next = NULL;
        } else if (training) {  // the loader reuses its buffers: keep copies until the step
            if (shard.n) {
                memcpy(t->accum_images + pending * image_floats, shard.images,
                       sizeof(float) * (size_t)shard.n * in.h * in.w * 3);
                memcpy(t->accum_labels + pending * label_count, shard.labels,
                       sizeof(int32_t) * (size_t)shard.n * t->per_image);
            }
            weight_sums[pending] = shard.weight_sum ? *shard.weight_sum : 0.0;
            mb[pending] = (MicroBatch){shard.n, t->accum_images + pending * image_floats,
                                       t->accum_labels + pending * label_count, shard.first,
                                       &weight_sums[pending], NULL, 0};
            if (++pending == c->accum || j + 1 == n_batches) {
                step_rc = train_step(t, mb, pending, pt);
                pending = 0;
            }
        } else if (shard.n || region_exchanges(t)) {
            const double norm = shard.weight_sum ? *shard.weight_sum : 0.0;  // the loader's
            double loss;
            if (eval_batch(t, &shard, nj, norm, &loss)) { rc = -1; break; }
            pt->loss_sum += loss;
            pt->norm_sum += norm;
        }
        if (training) pt->seconds_steps += now_seconds() - step_started;
        if (step_rc < 0) { rc = -1; break; }
        // a step (or a validation batch) is complete: stop here if asked
        if (!training || pending == 0) {
            const int sig = interrupt_poll(t);
            if (sig < 0) { rc = -1; break; }
            if (sig) { stopped = j + 1; stop_signal = sig; }
        }
        images += nj;
        if (c->progress && (training || (tty && R == 1)) &&
            ((j + 1) % every == 0 || j + 1 == n_batches)) {
            o->download(o, pt->cm, t->confusion, sizeof(int64_t) * t->cm_len);
            PassTotals now = *pt;
            if (R > 1) {
                now.cm = malloc(sizeof(int64_t) * t->cm_len);
                snCheck(now.cm != NULL, "out of host memory");
                memcpy(now.cm, pt->cm, sizeof(int64_t) * t->cm_len);
                rc = reduce_totals(t, &now);
            }
            if (rc == 0 && comm->rank == 0)
                progress_line(t, training, j + 1, n_batches, t0, images, &now, tty);
            if (R > 1) free(now.cm);
        }
    }
    drop_ahead(t);  // before the loader's buffers go
    if (L) loader_stop(L);
    free(order); free(mine);
    if (stopped && rc == 0) {  // this replica's totals so far; where the pass goes on
        o->download(o, pt->cm, t->confusion, sizeof(int64_t) * t->cm_len);
        if (training) t->resume_batch = stopped;
        if (c->progress && tty) fputs("\r\033[K", stderr);
        return stop_signal;
    }
    // this replica failed: the others stop at their next collective (mpi: the job ends)
    if (rc == -2) {
        if (R > 1) {
            char why[SN_ERR_MAX];
            snprintf(why, sizeof why, "rank %d: %.480s", comm->rank, err);
            snprintf(err, SN_ERR_MAX, "%s", why);
            comm->abort(comm, err);
        }
        return -1;
    }
    o->download(o, pt->cm, t->confusion, sizeof(int64_t) * t->cm_len);
    if (rc == 0 && reduce_totals(t, pt)) rc = -1;
    if (rc) return comm_failure(comm, err);
    if (c->progress && tty && (training || d->n)) fputs("\r\033[K", stderr);
    return 0;
}

// ---- run folder: config.txt, metrics.csv, curves.svg, checkpoints

static int write_text_atomic(const char *path, const char *text, char err[SN_ERR_MAX]) {
    const void *parts[1] = {text};
    size_t sizes[1] = {strlen(text)};
    return file_write_atomic(path, parts, sizes, 1, err);
}

static void run_path(char *buf, size_t size, const char *run, const char *file) {
    snprintf(buf, size, "%s/%s", run, file);
}

// Checkpoint = weights and BN statistics (PyTorch layout, loadable as weights)
// + train_state.adam_m / adam_v (the trainable parameters in segnet's order)
// + the counters as metadata.
#define CHECKPOINT_KEYS 9
static const char *const CHECKPOINT_META[CHECKPOINT_KEYS] = {
        "epoch",     "step",       "seed",
        "best_loss", "best_epoch", "bad_epochs",
        "finished",  "loss_scale", "loss_scale_good_steps"};
// An epoch interrupted part-way: the global batch its training pass goes on
// at, and each replica's totals so far (metadata "batch" and "pass_totals":
// per replica `loss_sum norm_sum cm[0] ... cm[len-1]` with exact hex floats (cm: the
// confusion record, Trainer.cm_len),
// replicas separated by ';').
typedef struct {
    int batch, replicas;
    size_t len;     // a replica's confusion record: Trainer.cm_len
    double *sums;   // (replicas, 2): loss_sum, norm_sum
    int64_t *cms;   // (replicas, len) confusion counts (and the per-image IoU sums)
} PassSaved;

static void pass_saved_free(PassSaved *ps) {
    free(ps->sums);
    free(ps->cms);
    memset(ps, 0, sizeof *ps);
}

static char *pass_totals_text(const PassSaved *ps) {
    SfBuf b = {0};
    char num[64];
    for (int r = 0; r < ps->replicas; r++) {
        snprintf(num, sizeof num, "%s%a %a", r ? ";" : "", ps->sums[2 * r], ps->sums[2 * r + 1]);
        sb_str(&b, num);
        for (size_t k = 0; k < ps->len; k++) {
            snprintf(num, sizeof num, " %" PRId64, ps->cms[(size_t)r * ps->len + k]);
            sb_str(&b, num);
        }
    }
    sb_put(&b, "", 1);
    snCheck(!b.oom, "out of host memory");
    return b.p;
}

static int pass_totals_parse(const char *path, const char *text, size_t len, PassSaved *ps,
                             char err[SN_ERR_MAX]) {
    int R = 1;
    for (const char *p = text; *p; p++) R += *p == ';';
    if (R > SN_MAX_REPLICAS) {
        snprintf(err, SN_ERR_MAX,
                 "%.300s: metadata 'pass_totals' holds %d replicas, more than %d (a damaged "
                 "checkpoint)",
                 path, R, SN_MAX_REPLICAS);
        return -1;
    }
    const size_t KK = len;
    ps->replicas = R;
    ps->len = len;
    ps->sums = malloc(sizeof(double) * 2 * (size_t)R);
    ps->cms = malloc(sizeof(int64_t) * KK * (size_t)R);
    snCheck(ps->sums && ps->cms, "out of host memory");
    const char *p = text;
    for (int r = 0; r < R; r++) {
        for (size_t k = 0; k < 2 + KK; k++) {
            char *end;
            errno = 0;
            if (k < 2) ps->sums[2 * r + k] = strtod(p, &end);
            else ps->cms[(size_t)r * KK + k - 2] = strtoll(p, &end, 10);
            const int count_ok = k < 2 || (errno != ERANGE && ps->cms[(size_t)r * KK + k - 2] >= 0);
            const char sep = k + 1 < 2 + KK ? ' ' : r + 1 < R ? ';' : 0;
            if (end == p || *p == ' ' || !count_ok || *end != sep) {
                snprintf(err, SN_ERR_MAX,
                         "%.300s: metadata 'pass_totals': replica %d, item %zu is not one of "
                         "the %zu numbers a replica has here (a damaged checkpoint)",
                         path, r, k + 1, 2 + KK);
                return -1;
            }
            p = end + (sep != 0);
        }
    }
    return 0;
}

// Whether the model is finite: its weights, batch-norm statistics and Adam's
// moments (one flag over all of them on the backend, one download). If not,
// -1 and `which` names the first tensor holding a NaN or inf (found on the
// host) and how many of its values are. Nothing non-finite is ever saved.
static int model_finite(Trainer *t, char which[SN_ERR_MAX]) {
    Ops *o = t->o;
    const Graph *g = &t->g;
    const size_t T = t->n_trainable;
    const struct { const float *data; size_t n;
    } parts[4] = {{t->net.params, g->n_param_floats},
                  {t->net.buffers, g->n_buffer_floats},
                  {t->adam_m, T},
                  {t->adam_v, T}};
    int32_t flag = 0;
    o->upload(o, t->nonfinite, &flag, sizeof flag);
    for (int k = 0; k < 4; k++)
        if (parts[k].n)
            o->nonfinite(o, tensor_f32((float *)parts[k].data, shape4((int)parts[k].n, 1, 1, 1)),
                         t->nonfinite);
    o->download(o, &flag, t->nonfinite, sizeof flag);
    if (!flag) return 0;
    // unless one is found below (the flag is all the backend says)
    snprintf(which, SN_ERR_MAX, "a tensor holds NaN or inf");
    for (int k = 0; k < 4; k++) {
        float *host = malloc(sizeof(float) * (parts[k].n ? parts[k].n : 1));
        snCheck(host != NULL, "out of host memory");
        o->download(o, host, parts[k].data, sizeof(float) * parts[k].n);
        const int n_tensors = k == 0 || k >= 2 ? g->n_params : g->n_buffers;
        for (int i = 0; i < n_tensors; i++) {
            const ParamInfo *p = k == 1 ? &g->buffers[i] : &g->params[i];
            const size_t at = k < 2 ? p->offset : t->net.grad_offset[i];
            if (k >= 2 && at == SIZE_MAX) continue;  // frozen: no moments
            size_t bad = 0;
            for (size_t j = 0; j < p->count; j++) bad += !isfinite(host[at + j]);
            if (!bad) continue;
            snprintf(which, SN_ERR_MAX, "%s%.200s holds NaN or inf (%zu of its %zu values)",
                     k == 2   ? "Adam's first moment of "
                     : k == 3 ? "Adam's second moment of "
                              : "",
                     p->name, bad, p->count);
            free(host);
            return -1;
        }
        free(host);
    }
    return -1;
}

// ---- what a checkpoint's place in the run depends on
//
// A checkpoint records the training set it was made with (RESUME_DATA_KEY:
// the count of samples and an FNV-1a hash of their files' names under the
// data folder, sizes and labels, in order) and the settings that shape each
// step (RESUME_SETTINGS_KEY, `--flag=value` items). --resume compares them
// with its own. What the monitored loss measures (size, class weights, loss
// normalisation, the monitor) stays for the whole run, so that "best"
// compares like with like. The batch, accumulation, augmentation, the lr's
// settings (schedule, lr, warmup; the epochs of a decaying schedule) and the
// data may change between epochs (said), never inside one: an interrupted
// epoch's place (its batch, its shuffled order, its lr) means nothing under others.

#define RESUME_DATA_KEY     "data"
#define RESUME_SETTINGS_KEY "settings"
static const char *const RESUME_FIXED[] = {"size",      "class-weights", "loss-norm",
                                           "monitor",   "ignore-index",  "label-map",
                                           "loss",      "iou-per-image"};

// cosine and poly: the lr falls to 0 over the run's steps
static int schedule_decays(Schedule s) { return s == SCHEDULE_COSINE || s == SCHEDULE_POLY; }

// the settings that shape a step, `--flag=value` items separated by spaces (NUL-terminated,
// malloc'd)
static char *step_settings_text(const TrainCfg *c) {
    SfBuf b = {0};
    char s[160];
    char lr[32];
    snprintf(s, sizeof s,
             "size=%dx%d loss-norm=%s monitor=%s batch=%d accum=%d schedule=%s lr=%s warmup=%d ",
             c->model.height, c->model.width, c->loss_norm_keras ? "keras" : "weighted",
             monitor_name(c), c->model.batch, c->accum, SCHEDULE_NAMES[c->schedule],
             float_str(lr, c->lr), c->warmup);
    sb_str(&b, s);
    // the epochs place a decaying schedule's steps (its lr at step s: lr_at_step)
    if (schedule_decays(c->schedule)) {
        snprintf(s, sizeof s, "epochs=%d ", c->epochs);
        sb_str(&b, s);
    }
    sb_str(&b, "class-weights=");
    class_weights_text(c, &b);
    sb_str(&b, " ignore-index=");
    ignore_text(&c->masks, &b);
    sb_str(&b, " label-map=");
    label_map_text(&c->masks, &b);
    sb_str(&b, " augment=");
    augment_text(&c->augment, &b);
    sb_str(&b, " loss=");
    loss_settings_text(&c->loss, ",", ":", &b);
    sb_str(&b, c->iou_per_image ? " iou-per-image=on" : " iou-per-image=off");
    sb_put(&b, "", 1);
    snCheck(!b.oom, "out of host memory");
    return b.p;
}

// setting `key`'s value in a settings text (its own, up to the next space), or NULL; a
// checkpoint that predates iou-per-image=off wrote the switch only when on
static const char *setting_in(const char *text, const char *key, int *len) {
    const size_t k = strlen(key);
    for (const char *p = text; p && *p; p = strchr(p, ' '), p = p ? p + 1 : p)
        if (!strncmp(p, key, k) && p[k] == '=') {
            *len = (int)strcspn(p + k + 1, " ");
            return p + k + 1;
        }
    if (strcmp(key, "iou-per-image")) return NULL;
    *len = 3;
    return "off";
}

// Whether the checkpoint f was saved under another `key` than this run's settings text `now`
static int setting_changed(const SafetensorsFile *f, const char *now, const char *key) {
    const char *saved = safetensors_meta(f, RESUME_SETTINGS_KEY);
    int was_len, len;
    const char *was = saved ? setting_in(saved, key, &was_len) : NULL,
               *is = setting_in(now, key, &len);
    return was && is && (was_len != len || memcmp(was, is, (size_t)len));
}

// Between epochs, a change of the lr's settings (schedule, lr, warmup, epochs) said as the lr
// of the next step, beside the one the run's own settings give (the lr a finished poly run
// extended by --epochs goes on from, not 0). The plateau schedule's lr is its own state.
static void resume_say_lr(const Trainer *t, const char *saved) {
    const TrainCfg *c = t->c;
    int len;
    const char *v;
    Schedule was_s = c->schedule;
    double was_lr = c->lr;
    int64_t was_warmup = c->warmup, was_total = t->total_steps;
    if ((v = setting_in(saved, "schedule", &len)))
        for (int k = 0; k < 4; k++)
            if ((int)strlen(SCHEDULE_NAMES[k]) == len && !strncmp(v, SCHEDULE_NAMES[k], len))
                was_s = (Schedule)k;
    if ((v = setting_in(saved, "lr", &len))) was_lr = strtod(v, NULL);
    if ((v = setting_in(saved, "warmup", &len))) was_warmup = strtol(v, NULL, 10);
    if ((v = setting_in(saved, "epochs", &len)) && c->epochs > 0)
        was_total = t->total_steps / c->epochs * strtol(v, NULL, 10);
    if (was_s == SCHEDULE_PLATEAU || c->schedule == SCHEDULE_PLATEAU) return;
    const double now = lr_at_step(c->lr, c->schedule, c->warmup, t->total_steps, t->step),
                 was = lr_at_step(was_lr, was_s, was_warmup, was_total, t->step);
    if ((float)now != (float)was)
        fprintf(stderr,
                "segnet train: the lr of step %" PRId64 " is %.4g (the run's settings until now "
                "give %.4g)\n",
                t->step + 1, now, was);
}

// A change of the loss setting (its terms, then `,key:value` items for its constants, as
// loss_settings_text writes them) narrowed to the first part that differs, so that a message
// names the flag and both values: the terms (key stays "loss"), else a constant's item.
static void loss_change_narrowed(char key[32], const char **now, int *now_len, const char **was,
                                 int *was_len) {
    const char *a = *now, *b = *was, *a_end = a + *now_len, *b_end = b + *was_len;
    while (a < a_end && b < b_end) {
        const int al = (int)strcspn(a, ", "), bl = (int)strcspn(b, ", ");
        if (al != bl || memcmp(a, b, (size_t)al)) {
            const char *colon = memchr(a, ':', (size_t)al), *bcolon = memchr(b, ':', (size_t)bl);
            if (colon && bcolon) {
                snprintf(key, 32, "%.*s", (int)(colon - a), a);
                *now = colon + 1; *now_len = al - (int)(colon + 1 - a);
                *was = bcolon + 1; *was_len = bl - (int)(bcolon + 1 - b);
            } else {
                *now = a; *now_len = al;
                *was = b; *was_len = bl;
            }
            return;
        }
        a += al + (a[al] == ',');
        b += bl + (b[bl] == ',');
    }
}

// A checkpoint's data and settings against this run's (see above): -1 with err
// for a change that may not happen now (mid: the checkpoint is inside an
// epoch), else 0, the changes said on stderr. A checkpoint from before they
// were recorded is taken as it is.
static int resume_compare(const Trainer *t, const char *path, const SafetensorsFile *f, int mid,
                          char err[SN_ERR_MAX]) {
    const char *saved = safetensors_meta(f, RESUME_SETTINGS_KEY),
               *data = safetensors_meta(f, RESUME_DATA_KEY);
    const int epoch = t->epoch + 1;  // the epoch that goes on (mid) or starts
    int rc = 0;
    if (saved) {
        char *now = step_settings_text(t->c);
        for (const char *p = now; rc == 0 && *p;) {
            const int klen = (int)strcspn(p, "=");
            int vlen = (int)strcspn(p + klen + 1, " ");
            char key[32];
            snprintf(key, sizeof key, "%.*s", klen, p);
            const char *value = p + klen + 1;
            p = value + vlen + (value[vlen] == ' ');
            int was_len;
            const char *was = setting_in(saved, key, &was_len);
            if (!was || (was_len == vlen && !memcmp(was, value, (size_t)vlen))) continue;
            int fixed = 0;
            for (size_t k = 0; k < sizeof RESUME_FIXED / sizeof *RESUME_FIXED; k++)
                fixed |= !strcmp(key, RESUME_FIXED[k]);
            if (!strcmp(key, "loss")) loss_change_narrowed(key, &value, &vlen, &was, &was_len);
            if (fixed) {
                snprintf(err, SN_ERR_MAX,
                         "%.150s: --%s %.*s, but the run was trained with %.*s: it defines what "
                         "best.safetensors is judged by, so it stays for the whole run (a new run "
                         "can start from the weights: --weights RUN/best.safetensors)",
                         path, key, vlen > 40 ? 40 : vlen, value, was_len > 40 ? 40 : was_len, was);
                rc = -1;
            } else if (mid) {
                snprintf(err, SN_ERR_MAX,
                         "%.150s: --%s %.*s, but the run was interrupted inside epoch %d with "
                         "%.*s: that "
                         "epoch goes on only as it began (resume without the change; it may change "
                         "between epochs)",
                         path, key, vlen > 40 ? 40 : vlen, value, epoch,
                         was_len > 40 ? 40 : was_len, was);
                rc = -1;
            } else if (t->c->progress) {
                fprintf(stderr, "segnet train: --%s %.*s from epoch %d on (until now %.*s)\n", key,
                        vlen, value, epoch, was_len, was);
            }
        }
        if (rc == 0 && !mid && t->c->progress) resume_say_lr(t, saved);
        free(now);
    }
    if (rc == 0 && data && t->has_train) {
        char now[64];
        data_fingerprint(&t->train, t->c->data, now);
        int was_n = 0, now_n = atoi(now);
        sscanf(data, "%d", &was_n);
        if (strcmp(data, now)) {
            char what[160];
            if (was_n != now_n)
                snprintf(what, sizeof what, "%d samples, the run's had %d", now_n, was_n);
            else
                snprintf(what, sizeof what,
                         "%d samples as before, but not the same files (names, sizes or labels)",
                         now_n);
            if (mid) {
                snprintf(err, SN_ERR_MAX,
                         "%.120s: the training set %.100s has %.100s: the run was interrupted "
                         "inside epoch %d, "
                         "whose order and place are those of its data (restore it to finish the "
                         "epoch)",
                         path, t->c->data, what, epoch);
                rc = -1;
            } else if (t->c->progress) {
                fprintf(stderr,
                        "segnet train: the training set %s has changed since the last checkpoint: "
                        "%s; it is used "
                        "from epoch %d on\n",
                        t->c->data, what, epoch);
            }
        }
    }
    return rc;
}

static int save_checkpoint(const Trainer *t, const char *path, const PassSaved *ps,
                           char err[SN_ERR_MAX]) {
    Ops *o = t->o;
    size_t P = t->n_trainable;
    float *m = malloc(sizeof(float) * (P ? P : 1)), *v = malloc(sizeof(float) * (P ? P : 1));
    snCheck(m && v, "out of host memory");
    o->download(o, m, t->adam_m, sizeof(float) * P);
    o->download(o, v, t->adam_v, sizeof(float) * P);
    SafetensorsTensor extra[2];
    memset(extra, 0, sizeof extra);
    for (int k = 0; k < 2; k++) {
        snprintf(extra[k].name, sizeof extra[k].name, TRAIN_STATE_PREFIX "%s",
                 k ? "adam_v" : "adam_m");
        extra[k].dtype = DT_F32;
        extra[k].ndim = 1;
        extra[k].dims[0] = (int64_t)P;
        extra[k].numel = P;
        extra[k].data = k ? v : m;
    }
    char vals[9][64];
    snprintf(vals[0], 64, "%d", t->epoch);
    snprintf(vals[1], 64, "%" PRId64, t->step);
    snprintf(vals[2], 64, "%" PRIu64, t->c->seed);
    snprintf(vals[3], 64, "%a", t->best);  // hex float: exact
    snprintf(vals[4], 64, "%d", t->best_epoch);
    snprintf(vals[5], 64, "%d", t->bad_epochs);
    snprintf(vals[6], 64, "%d", t->finished);
    snprintf(vals[7], 64, "%a", (double)t->loss_scale);
    snprintf(vals[8], 64, "%" PRId64, t->good_steps);
    // the required keys, then "padding" (weights_padding reads it; older checkpoints lack it),
    // then an interrupted epoch's position
    const char *keys[CHECKPOINT_KEYS + 8], *values[CHECKPOINT_KEYS + 8];
    for (int k = 0; k < CHECKPOINT_KEYS; k++) { keys[k] = CHECKPOINT_META[k]; values[k] = vals[k]; }
    int n_keys = CHECKPOINT_KEYS;
    keys[n_keys] = "padding";
    values[n_keys++] = PAD_NAME[t->c->model.pad];
    char plateau[96];  // exact: lr and best as hex floats
    snprintf(plateau, sizeof plateau, "%a %a %d", t->plateau.lr, t->plateau.best, t->plateau.wait);
    keys[n_keys] = "plateau"; values[n_keys++] = plateau;
    char *settings = step_settings_text(t->c);
    keys[n_keys] = RESUME_SETTINGS_KEY; values[n_keys++] = settings;
    if (t->has_train) { keys[n_keys] = RESUME_DATA_KEY; values[n_keys++] = t->data_print; }
    char batch[32], *totals = NULL, epoch_stats[512], log_stats[512];
    if (ps) {
        snprintf(batch, sizeof batch, "%d", ps->batch);
        totals = pass_totals_text(ps);
        step_stats_text(&t->epoch_stats, epoch_stats, sizeof epoch_stats);
        keys[n_keys] = "batch"; values[n_keys++] = batch;
        keys[n_keys] = "pass_totals"; values[n_keys++] = totals;
        keys[n_keys] = "epoch_stats"; values[n_keys++] = epoch_stats;
    }
    if (t->c->log_every > 0) {  // the steps since steps.csv's last row (they may span epochs)
        step_stats_text(&t->log_stats, log_stats, sizeof log_stats);
        keys[n_keys] = "log_stats"; values[n_keys++] = log_stats;
    }
    int rc = net_save_checkpoint(&t->net, path, extra, 2, keys, values, n_keys, err);
    free(m); free(v); free(totals); free(settings);
    return rc;
}

// A checkpoint's metadata is input like any file: each counter an integer in
// its range, each figure a number, or the checkpoint is refused naming both.
static int meta_int(const char *path, const char *key, const char *text, int64_t lo, int64_t hi,
                    int64_t *v, char err[SN_ERR_MAX]) {
    char *end;
    errno = 0;
    long long x = strtoll(text, &end, 10);
    if (!text[0] || *end || errno == ERANGE || x < lo || x > hi ||
        isspace((unsigned char)text[0])) {
        snprintf(err, SN_ERR_MAX,
                 "%.400s: metadata '%s' is '%.40s', not an integer in %" PRId64 "..%" PRId64
                 " (a damaged checkpoint)",
                 path, key, text, lo, hi);
        return -1;
    }
    *v = x;
    return 0;
}
static int meta_num(const char *path, const char *key, const char *text, double *v,
                    char err[SN_ERR_MAX]) {
    char *end;
    *v = strtod(text, &end);
    if (!text[0] || *end || isnan(*v) || isspace((unsigned char)text[0])) {
        snprintf(err, SN_ERR_MAX,
                 "%.400s: metadata '%s' is '%.40s', not a number (a damaged checkpoint)", path, key,
                 text);
        return -1;
    }
    return 0;
}

// The counters of a checkpoint, read and range-checked before anything changes.
typedef struct {
    int64_t epoch, step, best_epoch, bad_epochs, finished, good_steps;
    double best, loss_scale;
} CheckpointCounters;

static int checkpoint_counters(const char *path, const char *const val[CHECKPOINT_KEYS],
                               CheckpointCounters *k, char err[SN_ERR_MAX]) {
    const int64_t most = (int64_t)1 << 53;  // exact in a double: steps and epochs of any real run
    if (meta_int(path, "epoch", val[0], 0, INT32_MAX - 1, &k->epoch, err) ||
        meta_int(path, "step", val[1], 0, most, &k->step, err) ||
        meta_num(path, "best_loss", val[3], &k->best, err) ||
        meta_int(path, "best_epoch", val[4], 0, k->epoch, &k->best_epoch, err) ||
        meta_int(path, "bad_epochs", val[5], 0, k->epoch, &k->bad_epochs, err) ||
        meta_int(path, "finished", val[6], 0, 1, &k->finished, err) ||
        meta_num(path, "loss_scale", val[7], &k->loss_scale, err) ||
        meta_int(path, "loss_scale_good_steps", val[8], 0, k->step, &k->good_steps, err))
        return -1;
    if (!(k->loss_scale > 0.0 && k->loss_scale <= FLT_MAX)) {
        snprintf(err, SN_ERR_MAX,
                 "%.300s: metadata 'loss_scale' is '%.40s', not a positive float (a damaged "
                 "checkpoint)",
                 path, val[7]);
        return -1;
    }
    // no best epoch yet exactly when nothing was finite
    if ((k->best_epoch == 0) != (k->best == INFINITY)) {
        snprintf(err, SN_ERR_MAX,
                 "%.300s: metadata 'best_loss' '%.40s' does not fit 'best_epoch' %" PRId64
                 " (a damaged checkpoint)",
                 path, val[3], k->best_epoch);
        return -1;
    }
    return 0;
}

// Restores everything save_checkpoint wrote; checks it all before changing
// anything. An interrupted epoch's position goes to ps (batch 0 if none).
static int load_checkpoint(Trainer *t, const char *path, PassSaved *ps, char err[SN_ERR_MAX]) {
    SafetensorsFile f;
    if (safetensors_read(path, &f, err)) return -1;
    size_t P = t->n_trainable;
    const SafetensorsTensor *m = safetensors_find(&f, TRAIN_STATE_PREFIX "adam_m"),
                            *v = safetensors_find(&f, TRAIN_STATE_PREFIX "adam_v");
    const char *val[CHECKPOINT_KEYS];
    CheckpointCounters k;
    int rc = -1;
    for (int i = 0; i < CHECKPOINT_KEYS; i++)
        if (!(val[i] = safetensors_meta(&f, CHECKPOINT_META[i]))) {
            snprintf(err, SN_ERR_MAX, "%.400s: not a segnet checkpoint (no '%s' in its metadata)",
                     path, CHECKPOINT_META[i]);
            goto done;
        }
    // the model's tensors first: an edited config.txt shows here
    const LoadRules check = {NULL, NULL, 1};
    if (net_load_weights_rules(&t->net, &f, path, &check, NULL, err)) {
        const size_t len = strlen(err);
        snprintf(err + len, SN_ERR_MAX - len,
                 " (the model of config.txt and the options is not the run's?)");
        goto done;
    }
    if (!m || !v || m->numel != P || v->numel != P || m->dtype != DT_F32 || v->dtype != DT_F32) {
        snprintf(err, SN_ERR_MAX,
                 "%.400s: the optimiser state (" TRAIN_STATE_PREFIX
                 "adam_m/adam_v, %zu floats each) is missing or of another size",
                 path, P);
        goto done;
    }
    char seed_text[32];
    snprintf(seed_text, sizeof seed_text, "%" PRIu64, t->c->seed);
    if (strcmp(val[2], seed_text)) {
        snprintf(err, SN_ERR_MAX,
                 "--seed %s, but the run was trained with seed %.40s (%.200s): a resumed run keeps "
                 "its "
                 "seed, which its data order, augmentation and dropout follow",
                 seed_text, val[2], path);
        goto done;
    }
    if (checkpoint_counters(path, val, &k, err)) goto done;
    const char *batch = safetensors_meta(&f, "batch"),
               *totals = safetensors_meta(&f, "pass_totals");
    // for resume_compare's messages (restored with the rest below)
    t->epoch = (int)k.epoch;
    t->step = k.step;
    if (resume_compare(t, path, &f, batch || totals, err)) goto done;
    memset(ps, 0, sizeof *ps);
    if (batch || totals) {
        const int n_batches = (t->train.n + t->c->model.batch - 1) / t->c->model.batch;
        int64_t b;
        if (!batch || !totals) {
            snprintf(err, SN_ERR_MAX,
                     "%.300s: metadata has '%s' without '%s' (a damaged checkpoint)", path,
                     batch ? "batch" : "pass_totals", batch ? "pass_totals" : "batch");
            goto done;
        }
        if (meta_int(path, "batch", batch, 1, INT32_MAX, &b, err)) goto done;
        if (b > n_batches || (b < n_batches && b % t->c->accum)) {
            snprintf(err, SN_ERR_MAX,
                     "%.300s: interrupted at batch %" PRId64
                     " of an epoch, but the training set has %d batches of %d%s "
                     "(its images changed, or --accum?)",
                     path, b, n_batches, t->c->model.batch,
                     t->c->accum > 1 ? " in steps of --accum" : "");
            goto done;
        }
        ps->batch = (int)b;
        if (pass_totals_parse(path, totals, t->cm_len, ps, err)) {
            pass_saved_free(ps);
            goto done;
        }
    }
    // --schedule plateau's state (a checkpoint without it: the lr as given, nothing seen)
    const char *plateau_text = safetensors_meta(&f, "plateau");
    Plateau plateau = {t->c->lr, INFINITY, 0};
    if (plateau_text) {
        char *end;
        plateau.lr = strtod(plateau_text, &end);
        plateau.best = strtod(end, &end);
        long wait = strtol(end, &end, 10);
        if (*end || !(plateau.lr >= 0.0 && plateau.lr <= FLT_MAX) || isnan(plateau.best) ||
            wait < 0 || wait > INT32_MAX) {
            snprintf(err, SN_ERR_MAX,
                     "%.300s: metadata 'plateau' is '%.60s', not `lr best wait` (a damaged "
                     "checkpoint)",
                     path, plateau_text);
            pass_saved_free(ps);
            goto done;
        }
        plateau.wait = (int)wait;
    }
    // the other schedules start from --lr, which a resumed run may change (between epochs:
    // resume_compare); so does the plateau schedule when --lr changes
    char *now = step_settings_text(t->c);
    if (t->c->schedule != SCHEDULE_PLATEAU || setting_changed(&f, now, "lr"))
        plateau.lr = t->c->lr;
    free(now);
    // the diagnostics so far (a checkpoint without them: from here on)
    const char *epoch_stats = safetensors_meta(&f, "epoch_stats"),
               *log_stats = safetensors_meta(&f, "log_stats");
    StepStats es, ls;
    step_stats_reset(&es);
    step_stats_reset(&ls);
    if ((epoch_stats && step_stats_parse(path, "epoch_stats", epoch_stats, &es, err)) ||
        (log_stats && step_stats_parse(path, "log_stats", log_stats, &ls, err))) {
        pass_saved_free(ps);
        goto done;
    }
    float *host_m = malloc(sizeof(float) * (P ? P : 1)),
          *host_v = malloc(sizeof(float) * (P ? P : 1));
    snCheck(host_m && host_v, "out of host memory");
    safetensors_tensor_f32(m, host_m);
    safetensors_tensor_f32(v, host_v);
    size_t bad = P;  // Adam's second moment is a mean of squares: never negative
    for (size_t i = 0; i < P && bad == P; i++)
        if (!isfinite(host_m[i]) || !isfinite(host_v[i]) || host_v[i] < 0.0f) bad = i;
    if (bad < P)
        snprintf(err, SN_ERR_MAX,
                 "%.300s: the optimiser state holds m = %g, v = %g at element %zu: not finite, or "
                 "a negative "
                 "second moment (a damaged checkpoint)",
                 path, host_m[bad], host_v[bad], bad);
    if (bad < P || net_load_weights(&t->net, &f, path, NULL, 0, err)) {
        free(host_m); free(host_v);
        pass_saved_free(ps);
        goto done;
    }
    t->o->upload(t->o, t->adam_m, host_m, sizeof(float) * P);
    t->o->upload(t->o, t->adam_v, host_v, sizeof(float) * P);
    free(host_m); free(host_v);
    t->epoch = (int)k.epoch;
    t->step = k.step;
    t->best = k.best;
    t->best_epoch = (int)k.best_epoch;
    t->bad_epochs = (int)k.bad_epochs;
    t->finished = (int)k.finished;
    t->plateau = plateau;
    t->loss_scale = (float)k.loss_scale;
    t->good_steps = k.good_steps;
    t->epoch_stats = es;
    t->log_stats = ls;
    rc = 0;
done:
    safetensors_free(&f);
    return rc;
}

// metrics.csv: epoch,lr,loss,val_loss, then the metrics (train, then val)
typedef struct {
    char **rows; EpochRecord *rec; int n, cap;
} History;

static void history_free(History *h) {
    for (int i = 0; i < h->n; i++) free(h->rows[i]);
    free(h->rows); free(h->rec);
    memset(h, 0, sizeof *h);
}

// metrics.csv's columns, as they grew: the metrics; then the optimisation
// diagnostics; then (segmentation) mean and per-class Dice
enum { CSV_METRICS = 0, CSV_DIAGNOSTICS = 1, CSV_DICE = 2 };

// the header of a run written at level `columns` (a CSV_* value)
static void csv_header(const Trainer *t, SfBuf *b, int columns) {
    sb_str(b, "epoch,lr,loss,val_loss");
    char name[64];
    for (int pass = 0; pass < 2; pass++) {
        const char *p = pass ? "val_" : "";
        if (!t->segmentation) {
            snprintf(name, sizeof name, ",%saccuracy", p);
            sb_str(b, name);
            continue;
        }
        snprintf(name, sizeof name, ",%smIoU,%spixel_accuracy", p, p);
        sb_str(b, name);
        for (int k = 0; k < t->K; k++) {
            snprintf(name, sizeof name, ",%sIoU_%d", p, k);
            sb_str(b, name);
        }
    }
    if (columns >= CSV_DIAGNOSTICS) { sb_str(b, ","); sb_str(b, STEP_STATS_COLUMNS); }
    for (int pass = 0; columns >= CSV_DICE && t->segmentation && pass < 2; pass++) {
        const char *p = pass ? "val_" : "";
        snprintf(name, sizeof name, ",%sdice", p);
        sb_str(b, name);
        for (int k = 0; k < t->K; k++) {
            snprintf(name, sizeof name, ",%sDice_%d", p, k);
            sb_str(b, name);
        }
    }
}

static void csv_metrics(const Trainer *t, SfBuf *b, const Metrics *m) {
    if (!t->segmentation) { csv_num(b, m ? m->accuracy : NAN); return; }
    csv_num(b, m ? m->mean_iou : NAN);
    csv_num(b, m ? m->accuracy : NAN);
    for (int k = 0; k < t->K; k++) csv_num(b, m ? m->iou[k] : NAN);
}
static void csv_dice(const Trainer *t, SfBuf *b, const Metrics *m) {
    if (!t->segmentation) return;
    csv_num(b, m ? m->mean_dice : NAN);
    for (int k = 0; k < t->K; k++) csv_num(b, m ? m->dice[k] : NAN);
}

static void history_add(History *h, char *row, EpochRecord rec) {
    if (h->n == h->cap) {
        h->cap = h->cap ? 2 * h->cap : 16;
        h->rows = realloc(h->rows, sizeof(char *) * h->cap);
        h->rec = realloc(h->rec, sizeof(EpochRecord) * h->cap);
        snCheck(h->rows && h->rec, "out of host memory");
    }
    h->rows[h->n] = row;
    h->rec[h->n++] = rec;
}

// Reads back the rows of epochs 1..t->epoch (a resumed run), checking the header.
// A file from before the diagnostics' columns gets them empty.
static int history_load(const Trainer *t, const char *path, History *h, char err[SN_ERR_MAX]) {
    FILE *f = fopen_regular(path, "r", err);
    if (!f && errno == ENOENT && t->epoch == 0) return 0;  // interrupted in its first epoch
    if (!f) return -1;
    SfBuf header[CSV_DICE + 1] = {{0}};
    for (int k = CSV_METRICS; k <= CSV_DICE; k++) {
        csv_header(t, &header[k], k);
        sb_put(&header[k], "", 1);
    }
    size_t cap = 1 << 16;
    char *line = malloc(cap);
    snCheck(line != NULL, "out of host memory");
    int rc = 0, row = 0, level = CSV_DICE;
    const int per_pass = t->segmentation ? 2 + t->K : 1, val_col = 4 + per_pass,
              diag_col = 4 + 2 * per_pass, dice_col = diag_col + STEP_STATS_N_COLUMNS,
              dice_per_pass = t->segmentation ? 1 + t->K : 0;
    enum { READ = 7 + STEP_STATS_N_COLUMNS };  // the EpochRecord's numbers
    while (rc == 0 && fgets(line, (int)cap, f)) {
        row++;
        line[strcspn(line, "\r\n")] = 0;
        if (row == 1) {
            while (level >= CSV_METRICS && strcmp(line, header[level].p)) level--;
            if (level < CSV_METRICS) {
                snprintf(err, SN_ERR_MAX,
                         "%.400s: the header does not match this run's model and classes", path);
                rc = -1;
            }
            continue;
        }
        double v[READ];
        int cols[READ] = {1, 2, 3, 4, val_col}, epoch = atoi(line);
        for (int k = 0; k < STEP_STATS_N_COLUMNS; k++) cols[5 + k] = diag_col + k;
        cols[READ - 2] = dice_col;
        cols[READ - 1] = dice_col + dice_per_pass;
        if (epoch != row - 1) {
            snprintf(err, SN_ERR_MAX, "%.400s: row %d: expected epoch %d", path, row, row - 1);
            rc = -1;
            break;
        }
        if (epoch > t->epoch) break;  // written after the checkpoint: that epoch runs again
        for (int k = 0; k < READ; k++) {
            const char *s = line;
            for (int col = 0; col < cols[k] && s; col++) { s = strchr(s, ','); if (s) s++; }
            v[k] = s && *s && *s != ',' ? strtod(s, NULL) : NAN;
        }
        EpochRecord r = {epoch, v[0], v[1], v[2],  v[3],  v[4],  v[5], v[6],
                         v[7],  v[8], v[9], v[10], v[11], v[12], v[13]};
        if (!t->segmentation) r.dice = r.val_dice = NAN;
        // the columns a run of an earlier level lacks, empty
        const size_t len = strlen(line),
                     empty = (level < CSV_DIAGNOSTICS ? STEP_STATS_N_COLUMNS : 0) +
                             (level < CSV_DICE ? 2 * dice_per_pass : 0);
        char *kept = malloc(len + empty + 1);
        snCheck(kept != NULL, "out of host memory");
        memcpy(kept, line, len);
        memset(kept + len, ',', empty);
        kept[len + empty] = 0;
        history_add(h, kept, r);
    }
    if (rc == 0 && h->n != t->epoch) {
        snprintf(err, SN_ERR_MAX, "%.400s: holds %d epochs, the checkpoint %d", path, h->n,
                 t->epoch);
        rc = -1;
    }
    fclose(f);
    free(line);
    for (int k = CSV_METRICS; k <= CSV_DICE; k++) free(header[k].p);
    return rc;
}

// The checkpoint's best figure must be metrics.csv's at its best epoch (the
// file keeps 6 decimals: within 5e-7, plus the double's own rounding).
static double monitored(const TrainCfg *c, const EpochRecord *r, int has_val) {
    const double metric = c->monitor_metric == 2 ? (has_val ? r->val_dice : r->dice)
                          : has_val              ? r->val_metric
                                                 : r->metric;
    return c->monitor_metric ? -metric : has_val ? r->val_loss : r->loss;
}
static int history_check_best(const Trainer *t, const History *h, const char *run,
                              char err[SN_ERR_MAX]) {
    if (t->best_epoch == 0) return 0;
    const double want = monitored(t->c, &h->rec[t->best_epoch - 1], t->has_val);
    if (fabs(want - t->best) <= 1e-6 + 1e-9 * fabs(want)) return 0;
    snprintf(err, SN_ERR_MAX,
             "%.300s/last.safetensors: metadata 'best_loss' is %.6g, but metrics.csv's epoch %d "
             "(its best_epoch) "
             "has %.6g (a damaged checkpoint)",
             run, t->best, t->best_epoch, want);
    return -1;
}

static int history_write(const Trainer *t, const History *h, const char *run,
                         char err[SN_ERR_MAX]) {
    SfBuf b = {0};
    csv_header(t, &b, CSV_DICE);
    sb_str(&b, "\n");
    for (int i = 0; i < h->n; i++) { sb_str(&b, h->rows[i]); sb_str(&b, "\n"); }
    sb_put(&b, "", 1);
    char path[4200];
    run_path(path, sizeof path, run, "metrics.csv");
    int rc = b.oom ? -1 : write_text_atomic(path, b.p, err);
    free(b.p);
    if (rc) return rc;
    run_path(path, sizeof path, run, "curves.svg");
    const CurveMarks marks = {t->best_epoch, t->c->clipnorm};
    return write_curves_svg(path, h->rec, h->n, t->segmentation ? "mIoU" : "accuracy", &marks, err);
}

// steps.csv (--log-every): its header, then the rows that steps_log_row appends.
// A resumed run keeps the whole rows of the steps its checkpoint holds and
// drops the rest (written after it, or cut by a crash), rewriting the file
// atomically; then appends.
static const char *const STEPS_CSV_HEADER = "step,epoch,lr,loss,";
static int steps_csv_start(Trainer *t, const char *run, char err[SN_ERR_MAX]) {
    char path[4200];
    run_path(path, sizeof path, run, "steps.csv");
    SfBuf b = {0};
    sb_str(&b, STEPS_CSV_HEADER);
    sb_str(&b, STEP_STATS_COLUMNS);
    sb_str(&b, "\n");
    const size_t header_len = b.n;
    size_t n = 0;
    char unread[SN_ERR_MAX];  // absent or unreadable: the file starts again
    char *old = t->step > 0 ? (char *)file_read_regular(path, (size_t)1 << 40, &n, unread) : NULL;
    if (old && n >= header_len && !memcmp(old, b.p, header_len)) {
        for (size_t i = header_len; i < n;) {
            const char *nl = memchr(old + i, '\n', n - i);
            if (!nl) break;  // a row cut short
            char *end;
            const long long step = strtoll(old + i, &end, 10);
            if (end == old + i || *end != ',' || step < 1 || step > t->step) break;
            sb_put(&b, old + i, (size_t)(nl + 1 - (old + i)));
            i = (size_t)(nl + 1 - old);
        }
    }
    free(old);
    sb_put(&b, "", 1);
    int rc = b.oom ? -1 : write_text_atomic(path, b.p, err);
    free(b.p);
    if (rc == 0) {
        t->steps_csv = strdup(path);
        snCheck(t->steps_csv != NULL, "out of host memory");
    }
    return rc;
}

// What a user can act on, printed once per run at the first epoch where it holds (warned[k]).
static void training_warnings(const Trainer *t, const EpochRecord *r, const EpochRecord *prev,
                              int warned[3]) {
    const TrainCfg *c = t->c;
    const StepStats *st = &t->epoch_stats;
    if (!warned[0] && c->clipnorm > 0.0f && st->steps &&
        st->clipped > WARN_CLIP_FRACTION * (double)st->steps) {
        warned[0] = 1;
        fprintf(stderr,
                "segnet train: warning: epoch %d: --clipnorm %g scaled down the gradients of "
                "%.0f%% of the steps "
                "(gradient norm: mean %.3g, max %.3g). Clipping that acts on most steps no longer "
                "catches spikes: it "
                "rescales every update, which under Adam weighs the steps with large gradients "
                "down against the others; "
                "a threshold above the typical norm, e.g. --clipnorm %.2g (twice the mean), clips "
                "only the spikes.\n",
                r->epoch, c->clipnorm, 100.0 * r->clip_fraction, r->grad_norm_mean,
                r->grad_norm_max, 2 * r->grad_norm_mean);
    }
    if (!warned[1] && st->steps &&
        (st->skipped > WARN_SKIP_FRACTION * (double)st->steps ||
         st->skip_run_max > WARN_SKIP_RUN)) {
        warned[1] = 1;
        fprintf(stderr,
                "segnet train: warning: epoch %d: fp16 overflow skipped %" PRId64 " of %" PRId64
                " steps (%" PRId64 " in a row at most, the loss scale halved each time; %g now). "
                                   "Every skipped step is an update lost; "
                "if it goes on, --precision bf16 has fp32's range and needs no loss scaling.\n",
                r->epoch, st->skipped, st->steps, st->skip_run_max, r->loss_scale);
    }
    // from the second epoch on: the first one's average lags its end (the weights move most then)
    const double gap = WARN_TRAIN_MODE_GAP;
    const int below = r->epoch > 1 && r->metric < r->val_metric - gap;
    const int falling =
            prev && r->metric < prev->metric - gap && !(r->val_metric < prev->val_metric - gap);
    if (!warned[2] && !c->train_eval && t->has_val && (below || falling)) {
        warned[2] = 1;
        const char *name = t->segmentation ? "mIoU" : "accuracy";
        if (below)
            fprintf(stderr, "segnet train: note: epoch %d: train %s %.3f is below val_%s %.3f.",
                    r->epoch, name, r->metric, name, r->val_metric);
        else
            fprintf(stderr,
                    "segnet train: note: epoch %d: train %s fell from %.3f to %.3f while val_%s "
                    "held (%.3f).",
                    r->epoch, name, prev->metric, r->metric, name, r->val_metric);
        fprintf(stderr, " Train figures are measured while training (dropout on, batch norm with "
                        "each batch's "
                        "statistics, the weights changing through the epoch); validation in "
                        "inference mode with the epoch's "
                        "final weights. --train-eval measures the training set in inference mode "
                        "at each epoch's end, so the "
                        "two curves compare like with like.\n");
    }
}

// RUN/classes.txt: class k's name on line k+1, when the training set names its
// classes (class folders, a CSV's text labels); predict --run reads it back
#define CLASSES_FILE "classes.txt"
static int write_class_names(const Dataset *d, const char *run, char err[SN_ERR_MAX]) {
    if (!d->names) return 0;
    SfBuf b = {0};
    for (int k = 0; k < d->n_names; k++) {
        if (strpbrk(d->names[k], "\r\n")) {
            snprintf(err, SN_ERR_MAX, "class name '%.100s' contains a line break", d->names[k]);
            free(b.p);
            return -1;
        }
        sb_str(&b, d->names[k]);
        sb_str(&b, "\n");
    }
    sb_put(&b, "", 1);  // the terminator
    char path[4200];
    run_path(path, sizeof path, run, CLASSES_FILE);
    int rc = b.oom ? -1 : write_text_atomic(path, b.p, err);
    free(b.p);
    return rc;
}
// the names RUN/classes.txt lists (0 and NULL when there is none)
static int read_class_names(const char *run, char ***names) {
    char path[4200], line[4096];
    run_path(path, sizeof path, run, CLASSES_FILE);
    *names = NULL;
    char err[SN_ERR_MAX];
    FILE *f = fopen_regular(path, "r", err);
    if (!f) return 0;
    int n = 0, cap = 0;
    while (fgets(line, sizeof line, f)) {
        line[strcspn(line, "\r\n")] = 0;
        if (n == cap) {
            cap = cap ? 2 * cap : 16;
            *names = realloc(*names, sizeof(char *) * (size_t)cap);
            snCheck(*names != NULL, "out of host memory");
        }
        (*names)[n] = strdup(line);
        snCheck((*names)[n++] != NULL, "out of host memory");
    }
    fclose(f);
    return n;
}

// the paths config.txt records, by their keys
#define CONFIG_PATHS 4
static const char *const CONFIG_PATH_KEYS[CONFIG_PATHS] = {"data", "val", "weights", "label-map"};
static void config_paths(const TrainCfg *c, const char *paths[CONFIG_PATHS]) {
    paths[0] = c->data; paths[1] = c->val; paths[2] = c->weights; paths[3] = c->masks.label_map;
}

// config.txt: `key = value`, one per setting, the keys being the train
// flags without their dashes, so that --resume can read it back as flags.
static void config_text(const TrainCfg *c, SfBuf *b) {
    char s[512];
    const ModelCfg *m = &c->model;
#define CFG(...) do { snprintf(s, sizeof s, __VA_ARGS__); sb_str(b, s); } while (0)
    CFG("# segnet train settings: `segnet train --resume RUN` continues with these\n");
    CFG("model = %s\nclasses = %d\nsize = %dx%d\nbatch = %d\n", m->model, m->classes, m->height,
        m->width, m->batch);
    CFG("padding = %s\n", PAD_NAME[m->pad]);
    if (model_is_classifier(m->model)) CFG("head-hidden = %d\n", m->head_hidden);
    if (!strcmp(m->model, "unet")) CFG("depth = %d\nwidth = %d\n", m->depth, m->width_base);
    if (!strncmp(m->model, "unet-effv2-", 11))
        CFG("bottleneck = %s\n", m->bottleneck == BOTTLENECK_STAGE ? "stage" : "head");
    char d[32];
    if (m->dropout >= 0.0f) CFG("dropout = %s\n", float_str(d, m->dropout));
    // absolute: --resume and predict --run work from any folder
    const char *paths[CONFIG_PATHS];
    config_paths(c, paths);
    for (int k = 0; k < CONFIG_PATHS; k++) {
        if (!paths[k]) continue;
        char abs[PATH_MAX];
        sb_str(b, CONFIG_PATH_KEYS[k]);
        sb_str(b, " = ");
        sb_str(b, realpath(paths[k], abs) ? abs : paths[k]);
        sb_str(b, "\n");
    }
    if (c->allow_missing) CFG("allow-missing = %s\n", c->allow_missing);
    if (c->masks.n_ignore) {
        sb_str(b, "ignore-index = ");
        ignore_text(&c->masks, b);
        sb_str(b, "\n");
    }
    char f[4][32];
    sb_str(b, "class-weights = ");
    class_weights_text(c, b);
    CFG("\nepochs = %d\nlr = %s\nadam-eps = %s\nweight-decay = %s\nclipnorm = %s\n", c->epochs,
        float_str(f[0], c->lr), float_str(f[1], c->adam_eps), float_str(f[2], c->weight_decay),
        float_str(f[3], c->clipnorm));
    CFG("schedule = %s\nwarmup = %d\nearly-stopping = %d\n", SCHEDULE_NAMES[c->schedule],
        c->warmup, c->patience);
    if (c->schedule == SCHEDULE_PLATEAU)
        CFG("lr-factor = %s\nlr-patience = %d\nmin-lr = %s\nlr-min-delta = %s\n",
            float_str(f[0], c->plateau.factor), c->plateau.patience,
            float_str(f[1], c->plateau.min_lr), float_str(f[2], c->plateau.min_delta));
    CFG("monitor = %s\nmin-delta = %s\n", monitor_name(c), float_str(f[0], c->min_delta));
    sb_str(b, "augment = ");
    augment_text(&c->augment, b);
    CFG("\nloss-norm = %s\nloss = ", c->loss_norm_keras ? "keras" : "weighted");
    loss_settings_text(&c->loss, "\n", " = ", b);
    CFG("\niou-per-image = %s\nseed = %" PRIu64 "\n", c->iou_per_image ? "on" : "off", c->seed);
    CFG("precision = %s\naccum = %d\nfreeze = %s\nunfreeze-last = %d\ncheckpoint = %s\n",
        DTYPE_NAMES[c->precision], c->accum, c->freeze_base ? "base" : "none", c->unfreeze_last,
        c->checkpoint ? "blocks" : "none");
    // as asked (auto stays auto: a resumed run may move)
    CFG("device = %s\n", DEVICE_NAMES[c->device]);
    // the replica count is not a setting of the run: any count (or mpirun) continues it
    CFG("sync-bn = %s\n", c->sync_bn ? "on" : "off");
    CFG("log-every = %d\ntrain-eval = %s\n", c->log_every, c->train_eval ? "on" : "off");
    // process-wide, as --max-pixels, but it changes what the run sees
    CFG("exif = %s\n", EXIF_MODE_NAMES[image_exif]);
#undef CFG
}

static int write_config(const TrainCfg *c, const char *run, char err[SN_ERR_MAX]) {
    SfBuf b = {0};
    config_text(c, &b);
    sb_put(&b, "", 1);
    char path[4200];
    run_path(path, sizeof path, run, "config.txt");
    int rc = b.oom ? -1 : write_text_atomic(path, b.p, err);
    free(b.p);
    return rc;
}

static int mkdir_p(const char *path, char err[SN_ERR_MAX]) {
    char buf[4096];
    snprintf(buf, sizeof buf, "%s", path);
    for (char *p = buf + 1;; p++) {
        int end = *p == 0;
        if (*p == '/' || end) {
            *p = 0;
            if (mkdir(buf, 0755) && errno != EEXIST) {
                snprintf(err, SN_ERR_MAX, "%.400s: cannot create: %s", buf, strerror(errno));
                return -1;
            }
            if (end) break;
            *p = '/';
        }
    }
    struct stat sb;
    if (stat(path, &sb) || !S_ISDIR(sb.st_mode)) {
        snprintf(err, SN_ERR_MAX, "%.400s: exists and is not a folder", path);
        return -1;
    }
    return 0;
}

// ---- one run per folder: RUN/.lock, held (flock) for the run's life by the
// process that writes the folder; it holds that process's id for the message
// of a second one. The kernel drops the lock when the holder exits, however
// it exits; the file goes when the holder lets go of it (a killed run's stays
// behind, and the next run takes the lock on it).

#define RUN_LOCK_FILE ".lock"

// Locks run (which must exist) for `who` ("segnet train", "segnet export");
// returns the lock's descriptor, or -1 with err. A reader (export) of a
// folder it cannot write takes no lock when there is none: nothing writes there.
#define RUN_NOT_LOCKED (-2)
static int run_lock(const char *run, const char *who, char err[SN_ERR_MAX]) {
    char path[4200];
    run_path(path, sizeof path, run, RUN_LOCK_FILE);
    const int reader = strcmp(who, "segnet train") != 0;
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0 && reader && (errno == EACCES || errno == EROFS)) {
        fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC);  // flock needs no write access
        if (fd < 0 && errno == ENOENT) return RUN_NOT_LOCKED;
    }
    if (fd < 0) {
        snprintf(err, SN_ERR_MAX, "%.400s: cannot create the run's lock: %s", path,
                 strerror(errno));
        return -1;
    }
    if (flock(fd, LOCK_EX | LOCK_NB)) {
        char holder[64] = "";
        ssize_t n = pread(fd, holder, sizeof holder - 1, 0);
        holder[n > 0 ? n : 0] = 0;
        holder[strcspn(holder, "\r\n")] = 0;
        snprintf(err, SN_ERR_MAX, "%.300s: in use by another process (%s); %s", run,
                 holder[0] ? holder : "process id unknown",
                 reader ? "a run is read when nothing writes it: wait for it to end"
                        : "wait for it to end or choose another --out");
        close(fd);
        return -1;
    }
    char me[64];
    int len = snprintf(me, sizeof me, "pid %ld, %s\n", (long)getpid(), who);
    if (ftruncate(fd, 0) ||
        pwrite(fd, me, (size_t)len, 0) != len) { /* the lock holds without the note */
    }
    return fd;
}

// Lets go of run_lock's lock, its file with it (the descriptor may be RUN_NOT_LOCKED or -1:
// nothing)
static void run_unlock(const char *run, int lock) {
    if (lock < 0) return;
    char path[4200];
    run_path(path, sizeof path, run, RUN_LOCK_FILE);
    unlink(path);
    close(lock);
}

// Temporary files a killed writer left in run ("<file>.tmp.<pid>", see
// atomic_tmp_name): removed once the lock is held, if their process is gone.
static void run_remove_stale(const char *run, int progress) {
    DIR *d = opendir(run);
    if (!d) return;
    int removed = 0;
    for (struct dirent *e; (e = readdir(d));) {
        const long pid = tmp_name_pid(e->d_name);
        // its writer lives (or is not ours to judge)
        if (!pid || !tmp_writer_gone(pid)) continue;
        char path[4096 + sizeof e->d_name + 2];
        run_path(path, sizeof path, run, e->d_name);
        removed += unlink(path) == 0;
    }
    closedir(d);
    if (removed && progress)
        fprintf(stderr, "segnet train: removed %d temporary file%s left in %s by a stopped run\n",
                removed, removed == 1 ? "" : "s", run);
}

// The files a run writes into its folder (besides its lock). A new run never
// replaces one of them unless --overwrite; export never writes one.
static const char *const RUN_FILES[] = {"last.safetensors", "best.safetensors", "config.txt",
                                        "metrics.csv",      "curves.svg",       "steps.csv",
                                        CLASSES_FILE};
#define RUN_N_FILES ((int)(sizeof RUN_FILES / sizeof *RUN_FILES))

static int is_run_file(const char *name) {
    for (int k = 0; k < RUN_N_FILES; k++) if (!strcmp(name, RUN_FILES[k])) return 1;
    return 0;
}

// The run files in run: a list for a message, and how many
static int run_files_held(const char *run, char *list, size_t size) {
    int n = 0;
    list[0] = 0;
    for (int k = 0; k < RUN_N_FILES; k++) {
        char path[4200];
        struct stat sb;
        run_path(path, sizeof path, run, RUN_FILES[k]);
        if (lstat(path, &sb) == 0) list_add(list, size, &n, RUN_FILES[k]);
    }
    return n;
}

// The epochs metrics.csv holds (its rows after the header; 0 when it is absent or unreadable)
static int metrics_rows(const char *run) {
    char path[4200], err[SN_ERR_MAX];
    run_path(path, sizeof path, run, "metrics.csv");
    FILE *f = fopen_regular(path, "r", err);
    if (!f) return 0;
    int rows = 0, c, last = '\n';
    while ((c = getc(f)) != EOF) { rows += c == '\n'; last = c; }
    rows += last != '\n';
    fclose(f);
    return rows > 0 ? rows - 1 : 0;
}

// Takes the run folder for this run: created if new (*made), locked, cleared
// of stale temporary files. A new run refuses a folder that holds any run file
// unless overwrite (*replace: they are removed when writing starts). --resume
// needs last.safetensors; a run that stopped before its first checkpoint
// (its settings, perhaps epoch 1's metrics row) starts again (*fresh); a run
// whose checkpoint is gone but that has trained longer is refused.
static int run_claim(const char *run, const char *resume, int overwrite, int *lock, int *made,
                     int *fresh, int *replace, int progress, char err[SN_ERR_MAX]) {
    struct stat sb;
    if (resume && (stat(run, &sb) != 0 || !S_ISDIR(sb.st_mode))) {
        snprintf(err, SN_ERR_MAX, "--resume %.300s: %s", run,
                 stat(run, &sb) != 0 ? strerror(errno) : "not a folder");
        return -1;
    }
    char ckpt[4200], best[4200], tmp[OUT_PATH_MAX];
    run_path(ckpt, sizeof ckpt, run, "last.safetensors");
    run_path(best, sizeof best, run, "best.safetensors");
    atomic_tmp_name(ckpt, tmp);  // the longest path a run writes
    if (out_path_check(tmp, err)) return -1;
    if (!resume && stat(run, &sb) != 0) {
        if (mkdir_p(run, err)) return -1;
        *made = 1;
    }
    if ((*lock = run_lock(run, "segnet train", err)) < 0) return -1;
    run_remove_stale(run, progress);
    char held[256];
    const int n_held = run_files_held(run, held, sizeof held);
    const int has_ckpt = access(ckpt, F_OK) == 0, has_best = access(best, F_OK) == 0,
              epochs = metrics_rows(run);
    if (!resume) {
        if (n_held && !overwrite) {
            if (has_ckpt)
                snprintf(err, SN_ERR_MAX,
                         "%.150s: already holds a run (last.safetensors); continue it with "
                         "--resume %.150s, "
                         "start it again with --overwrite, or choose another --out",
                         run, run);
            else
                snprintf(err, SN_ERR_MAX,
                         "%.200s: holds an earlier run's files (%s) but no checkpoint; --overwrite "
                         "replaces "
                         "them, or choose another --out",
                         run, held);
            return -1;
        }
        *replace = n_held > 0;
        return 0;
    }
    // killed between epoch 1's best.safetensors and its first last.safetensors: epoch 1 runs again
    if (!has_ckpt && epochs > 1) {
        snprintf(err, SN_ERR_MAX,
                 "%.200s: has no last.safetensors, but %s%s%d epoch%s in metrics.csv: its "
                 "checkpoint is gone, "
                 "so the run cannot go on (--weights %.100s/best.safetensors starts a new one from "
                 "its best weights)",
                 run, has_best ? "best.safetensors" : "", has_best ? " and " : "", epochs,
                 epochs == 1 ? "" : "s", run);
        return -1;
    }
    // metrics.csv is written before last.safetensors: without the checkpoint its row is re-run
    if (!has_ckpt) {
        *fresh = 1;
        if (progress)
            fprintf(stderr,
                    "segnet train: %s has no checkpoint yet (stopped before its first one was "
                    "written%s%s): "
                    "starting it again from the beginning\n",
                    run, epochs ? "; metrics.csv is rewritten" : "",
                    has_best ? ", best.safetensors too" : "");
    }
    return 0;
}

// A new run with --overwrite: the earlier run's files go before the first is written.
static int run_files_remove(const char *run, char err[SN_ERR_MAX]) {
    for (int k = 0; k < RUN_N_FILES; k++) {
        char path[4200];
        run_path(path, sizeof path, run, RUN_FILES[k]);
        if (unlink(path) != 0 && errno != ENOENT) {
            snprintf(err, SN_ERR_MAX, "%.400s: cannot remove it (--overwrite): %s", path,
                     strerror(errno));
            return -1;
        }
    }
    return 0;
}

static void set_threads(int threads) {
    if (threads <= 0) return;
#ifdef _OPENMP
    omp_set_num_threads(threads);
#endif
    openblas_set_num_threads(threads);
}

// What every replica of a run shares (local replicas: one process)
typedef struct {
    const TrainCfg *c;
    const char *resume;
    int share_data;              // local replicas: rank 0 opens the data sets, the others read them
    Dataset train, val;          // ... here, freed by train_run after every replica has returned
    int has_train, has_val;
} RunShared;

typedef struct {
    RunShared *run;
    char err[SN_ERR_MAX];
    int interrupted;  // the signal that stopped the run (saved, to be resumed), 0 if none
} ReplicaArgs;

// Every replica's share of an interrupted epoch's totals, which rank 0 read:
// its own with as many replicas as were saved; else rank 0 takes their sums
// (the same totals, rounded in another order).
static int pass_resume_share(Trainer *t, PassSaved *ps) {
    Comm *comm = t->comm;
    int head[2] = {ps->batch, ps->replicas};
    if (comm->size > 1 && comm->broadcast(comm, head, sizeof head, 0)) return -1;
    if (!head[0]) return 0;
    const size_t KK = t->cm_len, R = (size_t)head[1];
    if (comm->rank != 0) {
        ps->sums = malloc(sizeof(double) * 2 * R);
        ps->cms = malloc(sizeof(int64_t) * KK * R);
        snCheck(ps->sums && ps->cms, "out of host memory");
    }
    if (comm->size > 1 && (comm->broadcast(comm, ps->sums, sizeof(double) * 2 * R, 0) ||
                           comm->broadcast(comm, ps->cms, sizeof(int64_t) * KK * R, 0)))
        return -1;
    t->resume_batch = head[0];
    t->resume_loss_sum = t->resume_norm_sum = 0.0;
    t->resume_cm = calloc(KK, sizeof(int64_t));
    snCheck(t->resume_cm != NULL, "out of host memory");
    for (size_t r = 0; r < R; r++) {
        if (R == (size_t)comm->size ? r != (size_t)comm->rank : comm->rank != 0) continue;
        t->resume_loss_sum += ps->sums[2 * r];
        t->resume_norm_sum += ps->sums[2 * r + 1];
        for (size_t k = 0; k < KK; k++) t->resume_cm[k] += ps->cms[r * KK + k];
    }
    return 0;
}

// An interrupted epoch into last.safetensors: where its training pass goes on
// (t->resume_batch) and every replica's totals, gathered to rank 0 (each in
// its own slot of zeros, so the sums are exact). reduced: the training pass
// had ended and its totals are the replicas' sums already (rank 0 keeps them).
static int save_interrupted(Trainer *t, const PassTotals *tr, int reduced, const char *run,
                            char err[SN_ERR_MAX]) {
    Comm *comm = t->comm;
    const int R = comm->size;
    const size_t KK = t->cm_len;
    PassSaved ps = {t->resume_batch, R, KK, calloc(2 * (size_t)R, sizeof(double)),
                    calloc(KK * (size_t)R, sizeof(int64_t))};
    snCheck(ps.sums && ps.cms, "out of host memory");
    const int slot = reduced ? 0 : comm->rank;
    if (!reduced || comm->rank == 0) {
        ps.sums[2 * slot] = tr->loss_sum;
        ps.sums[2 * slot + 1] = tr->norm_sum;
        memcpy(ps.cms + (size_t)slot * KK, tr->cm, sizeof(int64_t) * KK);
    }
    int rc = 0;
    if (R > 1 && (comm->allreduce_f64(comm, ps.sums, 2 * (size_t)R) ||
                  comm->allreduce_i64(comm, ps.cms, KK * (size_t)R)))
        rc = comm_failure(comm, err);
    if (rc == 0 && comm->rank == 0) {
        char path[4200];
        run_path(path, sizeof path, run, "last.safetensors");
        rc = save_checkpoint(t, path, &ps, err);
    }
    pass_saved_free(&ps);
    return rc;
}

// RUN: --resume's folder, else --out, else runs/<date>-<time> (this replica's clock)
static void run_folder_name(const TrainCfg *c, const char *resume, char *run, size_t size) {
    if (resume) snprintf(run, size, "%s", resume);
    else if (c->out) snprintf(run, size, "%s", c->out);
    else {
        time_t now = time(NULL);
        strftime(run, size, "runs/%Y%m%d-%H%M%S", localtime(&now));
    }
}

// ReduceLROnPlateau (see PlateauCfg): whether it lowered p->lr. A value that
// is not finite never improves (Keras' comparison of a NaN is false).
static int plateau_update(Plateau *p, const PlateauCfg *c, double value) {
    if (value < p->best - c->min_delta) {
        p->best = value;
        p->wait = 0;
        return 0;
    }
    if (++p->wait < c->patience || !(p->lr > c->min_lr)) return 0;
    const float lowered = (float)(p->lr * c->factor);
    p->lr = lowered > c->min_lr ? lowered : c->min_lr;
    p->wait = 0;
    return 1;
}

// Keras' EarlyStopping(monitor, min_delta): an epoch improves when the loss is
// lower than the best by more than min_delta (a metric: higher; t->best holds
// the loss, or the metric negated); patience epochs without: the run finishes
// (and resuming it does nothing). Returns whether this epoch improved.
static int epoch_judged(Trainer *t, const EpochRecord *rec) {
    const TrainCfg *c = t->c;
    const double score = monitored(c, rec, t->has_val);
    // an epoch whose loss is not finite is never the best, whatever the monitored metric says
    const int improved =
            score < t->best - c->min_delta && isfinite(t->has_val ? rec->val_loss : rec->loss);
    if (improved) { t->best = score; t->best_epoch = t->epoch; t->bad_epochs = 0; }
    else t->bad_epochs++;
    if (c->patience > 0 && t->bad_epochs >= c->patience) t->finished = 1;
    if (c->schedule == SCHEDULE_PLATEAU) plateau_update(&t->plateau, &c->plateau, score);
    return improved;
}

// The epoch's row of metrics.csv (rank 0), then best.safetensors when it
// improved and last.safetensors: metrics.csv first, so that a crash in
// between runs the epoch again. vm NULL: no validation set.
static int epoch_written(Trainer *t, History *h, const EpochRecord *rec, const Metrics *m,
                         const Metrics *vm, const double *diag, int improved, const char *run,
                         char err[SN_ERR_MAX]) {
    SfBuf row = {0};
    char s[64], lr_text[32], path[4200];
    snprintf(s, sizeof s, "%d,%s", rec->epoch, float_str(lr_text, (float)rec->lr));
    sb_str(&row, s);
    csv_num(&row, rec->loss);
    csv_num(&row, rec->val_loss);
    csv_metrics(t, &row, m);
    csv_metrics(t, &row, vm);
    for (int k = 0; k < STEP_STATS_N_COLUMNS; k++) csv_sig(&row, diag[k]);
    csv_dice(t, &row, m);
    csv_dice(t, &row, vm);
    sb_put(&row, "", 1);
    snCheck(!row.oom, "out of host memory");
    history_add(h, row.p, *rec);
    int rc = history_write(t, h, run, err);
    if (rc == 0 && improved) {
        run_path(path, sizeof path, run, "best.safetensors");
        rc = save_checkpoint(t, path, NULL, err);
    }
    run_path(path, sizeof path, run, "last.safetensors");
    if (rc == 0) rc = save_checkpoint(t, path, NULL, err);
    return rc;
}

// The model before anything of epoch `epoch` (1-based) is written or judged:
// a model that is no longer finite stops the run (every replica checks its
// copy; they agree). Nothing of it is saved: the run folder keeps what it had.
static int epoch_model_finite(Trainer *t, int epoch, char err[SN_ERR_MAX]) {
    char which[SN_ERR_MAX];
    int rc = 0;
    if (model_finite(t, which)) {
        char kept[64] = "";
        if (t->best_epoch)
            snprintf(kept, sizeof kept, "; best.safetensors keeps epoch %d", t->best_epoch);
        snprintf(err, SN_ERR_MAX,
                 "epoch %d: the model is no longer finite: %.250s. Training diverged (a lower "
                 "--lr, or "
                 "--clipnorm, may help); nothing of this epoch was saved%s",
                 epoch, which, kept);
        rc = -1;
    }
    return comm_agree(t->comm, rc, err);
}

// the epoch's progress line
static void epoch_print(const Trainer *t, const EpochRecord *rec, double seconds, int improved) {
    const char *metric = t->segmentation ? "mIoU" : "accuracy";
    fprintf(stderr, "epoch %d/%d  loss %.4f  %s %.4f", rec->epoch, t->c->epochs, rec->loss, metric,
            rec->metric);
    if (t->segmentation) fprintf(stderr, "  dice %.4f", rec->dice);
    if (t->has_val)
        fprintf(stderr, "  val_loss %.4f  val_%s %.4f", rec->val_loss, metric, rec->val_metric);
    if (t->has_val && t->segmentation) fprintf(stderr, "  val_dice %.4f", rec->val_dice);
    fprintf(stderr, "  (%.1f s)%s\n", seconds, improved ? "  best" : "");
}

// A replica's trainer, ready for its first epoch: the model and the data
// (rank 0 opens the data sets and, with local replicas, lends them to the
// others), the initial weights of a fresh run or the checkpoint and history
// of a resumed one (rank 0 reads them), then rank 0's state mirrored on every
// replica. claimed: rank 0's run_claim result. Returns 0, -1 with err, or the
// signal that interrupted the data's reading (without replicas; nothing was
// written).
static int replica_open(Comm *comm, RunShared *sh, int claimed, int fresh, const char *run,
                        Trainer *t, History *h, PassSaved *saved, char err[SN_ERR_MAX]) {
    const TrainCfg *c = sh->c;
    const int root = comm->rank == 0;
    char path[4200];
    int rc = claimed;
    if (rc == 0 && (root || !sh->share_data))
        rc = trainer_open_on(t, c, c->data, c->val, comm, err);
    if (rc && interrupt_signal && comm->size == 1) return interrupt_signal;
    if (sh->share_data) {
        if (root && rc == 0) {  // the data sets now belong to the run
            sh->train = t->train; sh->has_train = t->has_train;
            sh->val = t->val; sh->has_val = t->has_val;
            t->borrowed_data = 1;
        }
        if (comm_agree(comm, rc, err)) return -1;
        if (!root) {
            rc = trainer_open_on(t, c, NULL, NULL, comm, err);
            if (rc == 0)
                trainer_borrow_data(t, sh->has_train ? &sh->train : NULL,
                                    sh->has_val ? &sh->val : NULL);
        }
    }
    if (rc == 0 && root && fresh && c->weights) {
        char report[SN_ERR_MAX];
        int random = 0;
        rc = trainer_load_weights(t, c->weights, report, &random, err);
        if (rc == 0) printf("%s%s%s\n", report, c->weights_note && c->weights_note[0] ? "; " : "",
                            c->weights_note ? c->weights_note : "");
        if (rc == 0 && random)
            printf("weights: %s holds random weights (ref/export_pretrained.py --random), not "
                   "ImageNet's: a trial run, "
                   "whose validation figures will be poor\n",
                   c->weights);
    }
    if (rc == 0 && root && !fresh) {
        run_path(path, sizeof path, run, "last.safetensors");
        rc = load_checkpoint(t, path, saved, err);
        run_path(path, sizeof path, run, "metrics.csv");
        if (rc == 0) rc = history_load(t, path, h, err);
        if (rc == 0) rc = history_check_best(t, h, run, err);
    }
    if (comm_agree(comm, rc, err)) return -1;
    if (trainer_broadcast(t) || pass_resume_share(t, saved)) return comm_failure(comm, err);
    return 0;
}

// ---- where a run's time went (the last lines of segnet train; make bench's e2e rows)

// seconds since this process started, from its start time in /proc/self/stat
// (in clock ticks since boot: 10 ms steps), or NAN without /proc
static double process_age_seconds(void) {
    FILE *f = fopen("/proc/self/stat", "r");
    if (!f) return NAN;
    char buf[1024];
    const size_t n = fread(buf, 1, sizeof buf - 1, f);
    fclose(f);
    buf[n] = 0;
    // field 22, counted after the command name's closing parenthesis (field 2)
    const char *p = strrchr(buf, ')');
    unsigned long long start = 0;
    for (int field = 2; p && field < 22; field++) p = strchr(p + 1, ' ');
    struct timespec now;
    if (!p || sscanf(p + 1, "%llu", &start) != 1 || clock_gettime(CLOCK_BOOTTIME, &now))
        return NAN;
    return (double)now.tv_sec + 1e-9 * (double)now.tv_nsec - (double)start / sysconf(_SC_CLK_TCK);
}

typedef struct {
    double startup;     // the process's start to the first training pass
    double steps;       // in train_step
    double loader;      // waiting for the loader's next batch (training passes)
    double validation;  // the validation pass, and --train-eval's pass
    double checkpoint;  // the model checked finite, checkpoints, metrics.csv, curves.svg
} RunTimes;

static void run_times_print(const RunTimes *rt) {
    const double total = process_age_seconds();
    const double rest =
            total - rt->startup - rt->steps - rt->loader - rt->validation - rt->checkpoint;
    fprintf(stderr,
            "segnet train: %.1f s in all: start-up %.1f, steps %.1f, waiting for the loader %.1f, "
            "validation %.1f, checkpoints %.1f, the rest %.1f\n",
            total, rt->startup, rt->steps, rt->loader, rt->validation, rt->checkpoint, rest);
    printf("seconds: total %.3f startup %.3f steps %.3f loader_wait %.3f validation %.3f "
           "checkpoint %.3f other %.3f\n",
           total, rt->startup, rt->steps, rt->loader, rt->validation, rt->checkpoint, rest);
}

// One replica of a run (all of it without replicas). Every replica takes
// every decision from the same mirrored state and the same all-reduced
// figures; only rank 0 reads and writes the run folder. A failure that some
// replicas see and others do not is agreed on (comm_agree) before going on.
static int train_replica(Comm *comm, void *arg) {
    ReplicaArgs *a = arg;
    RunShared *sh = a->run;
    const TrainCfg *c = sh->c;
    const char *resume = sh->resume;
    char *err = a->err;
    const int root = comm->rank == 0;
    set_threads(c->threads);
    if (c->patience > 0 && !c->val) {
        snprintf(err, SN_ERR_MAX, "--early-stopping needs a validation set (--val)");
        return -1;
    }
    char run[4096];
    run_folder_name(c, resume, run, sizeof run);
    // rank 0's clock
    if (comm->size > 1 && comm->broadcast(comm, run, sizeof run, 0)) return comm_failure(comm, err);
    Trainer t;
    memset(&t, 0, sizeof t);
    History h = {0};
    int rc = 0;
    // IoU then Dice per class: train (K), val (K)
    double *iou = malloc(sizeof(double) * 4 * c->model.classes);
    snCheck(iou != NULL, "out of host memory");
    // Trainer.cm_len at most
    const size_t cm_len = (size_t)c->model.classes * c->model.classes + 2;
    int64_t *cm = malloc(sizeof(int64_t) * cm_len), *cm_val = malloc(sizeof(int64_t) * cm_len);
    snCheck(cm && cm_val, "out of host memory");
    PassSaved saved = {0};  // an interrupted epoch's position (rank 0 reads it)
    int lock = -1, made = 0, fresh = !resume, replace = 0, written = 0;
    if (root)
        rc = run_claim(run, resume, c->overwrite, &lock, &made, &fresh, &replace, c->progress, err);
    rc = replica_open(comm, sh, rc, fresh, run, &t, &h, &saved, err);
    if (rc > 0) {  // stopped while reading the data: nothing was written
        if (c->progress)
            fprintf(stderr,
                    "segnet train: interrupted before training started; nothing was written\n");
        a->interrupted = rc;
        rc = 0;
        goto done;
    }
    if (rc) goto done;
    rc = -1;
    if (resume && (t.finished || t.epoch >= c->epochs)) {
        if (c->progress && root && !t.finished && t.resume_batch)
            fprintf(stderr,
                    "segnet train: %s has completed %d epoch%s and was interrupted inside epoch "
                    "%d; --epochs %d asks for "
                    "no more: nothing to do (--epochs %d completes epoch %d)\n",
                    run, t.epoch, t.epoch == 1 ? "" : "s", t.epoch + 1, c->epochs, t.epoch + 1,
                    t.epoch + 1);
        else if (c->progress && root)
            fprintf(stderr,
                    "segnet train: %s has finished (%d epoch%s%s); nothing to do (--epochs N "
                    "trains longer)\n",
                    run, t.epoch, t.epoch == 1 ? "" : "s", t.finished ? ", stopped early" : "");
        rc = 0;
        goto done;
    }
    // every input has been checked: from here on the run folder is written
    written = 1;
    if (comm_agree(comm,
                   root ? (replace && run_files_remove(run, err)) || mkdir_p(run, err) ||
                                   write_config(c, run, err) ||
                                   write_class_names(&t.train, run, err)
                        : 0,
                   err))
        goto done;
    // a backend that records steps (CUDA graphs) says when it will not
    const char *op_by_op = !t.o->capture_begin ? ""
                           : !t.records        ? ", steps run op by op (SEGNET_CUDA_GRAPHS=0)"
                           : comm->size > 1    ? ", steps run op by op (replicas)"
                           : c->accum > 1      ? ", steps run op by op (--accum)"
                                               : "";
    if (c->progress && root)
        fprintf(stderr,
                "segnet train: %s on %s, %d training images%s, %" PRIu64
                " parameters%s%s; run folder %s\n",
                c->model.model, t.o->name, t.train.n, t.has_val ? "" : " (no validation set)",
                (uint64_t)t.g.n_param_floats,
                comm->size > 1 ? (c->sync_bn ? ", replicas with batch norm synchronised"
                                             : ", replicas with batch norm per replica")
                               : "",
                op_by_op, run);
    const int K = c->model.classes;
    Metrics m = {0, 0, iou, 0, iou + 2 * K}, vm = {0, 0, iou + K, 0, iou + 3 * K};
    const int train_batches = (t.train.n + c->model.batch - 1) / c->model.batch;
    int warned[3] = {0, 0, 0};  // each warning once per run
    if (comm_agree(comm, root && c->log_every > 0 ? steps_csv_start(&t, run, err) : 0, err))
        goto done;
    RunTimes times = {0};
    times.startup = process_age_seconds();
    while (t.epoch < c->epochs && !t.finished) {
        double t0 = now_seconds();
        PassTotals tr = {.cm = cm}, va = {.cm = cm_val};
        // asked before the epoch: last.safetensors is its start
        int stop = t.resume_batch ? 0 : interrupt_poll(&t);
        if (stop > 0) {
            if (c->progress && root)
                fprintf(stderr,
                        "segnet train: interrupted before epoch %d; continue with: segnet train "
                        "--resume %s\n",
                        t.epoch + 1, run);
            a->interrupted = stop;
            rc = 0;
            goto done;
        }
        int reduced = 0;
        if (stop == 0) stop = run_pass(&t, &t.train, 1, &tr, err);
        if (stop < 0) goto done;
        times.steps += tr.seconds_steps;
        times.loader += tr.seconds_loader;
        double loss = tr.loss_sum / tr.norm_sum, val_loss = NAN;
        const double validation_started = now_seconds();
        if (stop == 0) {
            pass_metrics(&t, cm, &m);
            // the train figures again, in inference mode (cm_val is free until the validation)
            if (c->train_eval) {
                PassTotals te = {.cm = cm_val};
                if ((stop = run_pass(&t, &t.train, 0, &te, err)) < 0) goto done;
                if (!stop) {
                    pass_metrics(&t, cm_val, &m);
                    loss = te.loss_sum / te.norm_sum;
                }
            }
            if (!stop && t.has_val && (stop = run_pass(&t, &t.val, 0, &va, err)) < 0) goto done;
            // the validation (and --train-eval) runs again
            if (stop) { t.resume_batch = train_batches; reduced = 1; }
            if (t.has_val && !stop) {
                pass_metrics(&t, cm_val, &vm);
                val_loss = va.loss_sum / va.norm_sum;
            }
        }
        times.validation += now_seconds() - validation_started;
        const double checkpoint_started = now_seconds();
        if (stop) {
            if (epoch_model_finite(&t, t.epoch + 1, err) ||
                save_interrupted(&t, &tr, reduced, run, err) || comm_agree(comm, 0, err))
                goto done;
            if (c->progress && root)
                fprintf(stderr,
                        "segnet train: interrupted at epoch %d, step %d of %d (saved in "
                        "last.safetensors); "
                        "continue with: segnet train --resume %s\n",
                        t.epoch + 1, (t.resume_batch + c->accum - 1) / c->accum,
                        (train_batches + c->accum - 1) / c->accum, run);
            a->interrupted = stop;
            rc = 0;
            goto done;
        }
        if (epoch_model_finite(&t, t.epoch + 1, err)) goto done;
        t.epoch++;
        double lr = lr_at_step(t.plateau.lr, c->schedule, c->warmup, t.total_steps, t.step - 1);
        double diag[STEP_STATS_N_COLUMNS];
        step_stats_columns(&t.epoch_stats, diag);
        const double none = NAN;
        EpochRecord rec = {t.epoch, lr, loss, val_loss, t.segmentation ? m.mean_iou : m.accuracy,
                           t.has_val ? (t.segmentation ? vm.mean_iou : vm.accuracy) : NAN,
                           diag[0], diag[1], diag[2], diag[3], diag[4], diag[5], diag[6],
                           t.segmentation ? m.mean_dice : none,
                           t.has_val && t.segmentation ? vm.mean_dice : none};
        const int improved = epoch_judged(&t, &rec);
        if (comm_agree(comm,
                       root ? epoch_written(&t, &h, &rec, &m, t.has_val ? &vm : NULL, diag,
                                            improved, run, err)
                            : 0,
                       err))
            goto done;
        times.checkpoint += now_seconds() - checkpoint_started;
        if (c->progress && root) {
            epoch_print(&t, &rec, now_seconds() - t0, improved);
            training_warnings(&t, &rec, h.n > 1 ? &h.rec[h.n - 2] : NULL, warned);
        }
        if (c->stop_after_epochs && t.epoch >= c->stop_after_epochs && !t.finished) {
            rc = 0;
            goto done;
        }
    }
    if (c->progress && root && c->patience > 0 && t.epoch < c->epochs)
        fprintf(stderr, "early stopping: %s has not improved for %d epochs\n", monitor_name(c),
                c->patience);
    if (t.best_epoch == 0) {
        snprintf(err, SN_ERR_MAX,
                 "no epoch had a finite %s: training diverged (a lower --lr, or --clipnorm, may "
                 "help); "
                 "no best.safetensors was written",
                 t.has_val ? "val_loss" : "loss");
        goto done;
    }
    if (c->progress && root)
        fprintf(stderr, "segnet train: best epoch %d; weights in %s/best.safetensors\n",
                t.best_epoch, run);
    if (root) {  // the best epoch's figures, for the weights that are kept
        const EpochRecord *best = &h.rec[t.best_epoch - 1];
        if (c->progress)
            printf("run: %s\nbest_epoch: %d\nloss: %.6f\n", run, t.best_epoch, best->loss);
        if (c->progress && t.has_val)
            printf("val_loss: %.6f\nval_%s: %.6f\n", best->val_loss,
                   t.segmentation ? "mIoU" : "accuracy", best->val_metric);
        if (c->progress) run_times_print(&times);
    }
    rc = 0;
done:
    history_free(&h);
    trainer_close(&t);
    pass_saved_free(&saved);
    free(iou); free(cm); free(cm_val);
    run_unlock(run, lock);
    // refused before writing: the folder this run created goes again
    if (made && !written) rmdir(run);
    return rc;
}

int train_run_comm(const TrainCfg *c, const char *resume, Comm *comm, char err[SN_ERR_MAX]) {
    RunShared sh = {.c = c, .resume = resume};
    ReplicaArgs a = {&sh, "", 0};
    int rc = train_replica(comm, &a);
    if (rc) snprintf(err, SN_ERR_MAX, "%s", a.err);
    return rc ? rc : a.interrupted ? 128 + a.interrupted : 0;
}

// Replicas on GPUs (--device cuda, or auto with one GPU per replica): NCCL
// communicators over the host ones, hosts[0..n) (local), or this process's
// (mpi), which become their `device`. Returns 0 (on GPUs, or on the CPU: cpu,
// or auto without the GPUs, after the notice), or -1 with err.
static int replicas_on_gpus(const TrainCfg *c, Comm *dcomms, Comm *hosts, int n, int mpi,
                            char err[SN_ERR_MAX]) {
    if (c->device == DEVICE_CPU) return 0;
    char why[SN_ERR_MAX];
    const Backend *b = DEVICE_BACKEND;
    if (!b)
        snprintf(why, sizeof why, "%s", NO_CUDA_BUILD);
    else if ((mpi ? b->comm_mpi_create(dcomms, hosts, why)
                  : b->comm_local_create(dcomms, hosts, n, why)) == 0)
        return 0;
    if (c->device == DEVICE_CUDA) {
        snprintf(err, SN_ERR_MAX, "--device cuda: %.480s", why);
        return -1;
    }
    if (!mpi || hosts->rank == 0) cpu_fallback_notice(why);
    return 0;
}

static void replicas_gpus_close(Comm *dcomms, int n) {
    const Backend *b = DEVICE_BACKEND;
    if (b) b->comm_destroy(dcomms, n);
}

// config.txt holds a setting per line: a path with a line break in it could not be read back
static int config_paths_check(const TrainCfg *c, char err[SN_ERR_MAX]) {
    const char *paths[CONFIG_PATHS];
    config_paths(c, paths);
    for (int k = 0; k < CONFIG_PATHS; k++)
        if (paths[k] && strpbrk(paths[k], "\n\r")) {
            snprintf(err, SN_ERR_MAX,
                     "--%s %.300s: the path holds a line break, which config.txt (a setting per "
                     "line) cannot record for --resume: rename it",
                     CONFIG_PATH_KEYS[k], paths[k]);
            return -1;
        }
    return 0;
}

// Without replicas and outside mpirun: one replica on a communicator of one.
int train_run(const TrainCfg *c, const char *resume, char err[SN_ERR_MAX]) {
    if (config_paths_check(c, err)) return -1;
    const int procs = comm_mpi_launched(), R = c->replicas > 1 ? c->replicas : 1;
    if (procs > 1) {
        if (R > 1) {
            snprintf(err, SN_ERR_MAX,
                     "--replicas %d under mpirun: one replica per process (mpirun -np N)", R);
            return -1;
        }
        Comm comm, dcomm;
        if (comm_mpi_open(&comm, err) || replicas_on_gpus(c, &dcomm, &comm, 1, 1, err)) return -1;
        int rc = train_run_comm(c, resume, &comm, err);
        if (comm.device) replicas_gpus_close(&dcomm, 1);
        return rc;
    }
    if (R > SN_MAX_REPLICAS) {
        snprintf(err, SN_ERR_MAX, "--replicas %d: at most %d", R, SN_MAX_REPLICAS);
        return -1;
    }
    if (R == 1) return train_run_comm(c, resume, &comm_one, err);
    Comm comms[SN_MAX_REPLICAS];
    RunShared sh = {.c = c, .resume = resume, .share_data = 1};
    ReplicaArgs args[SN_MAX_REPLICAS];
    void *argp[SN_MAX_REPLICAS];
    int rc[SN_MAX_REPLICAS];
    for (int r = 0; r < R; r++) { args[r] = (ReplicaArgs){&sh, "", 0}; argp[r] = &args[r]; }
    snCheck(comm_local_create(comms, R) == 0, "cannot create %d local replicas", R);
    Comm dcomms[SN_MAX_REPLICAS];
    if (replicas_on_gpus(c, dcomms, comms, R, 0, err)) { comm_local_destroy(comms, R); return -1; }
    const int on_gpus = comms[0].device != NULL;
    comm_local_run(comms, R, train_replica, argp, rc);
    if (on_gpus) replicas_gpus_close(dcomms, R);
    // the first rank that failed on its own, else one that stopped with the others (an agreed
    // error)
    int failed = comms[0].failed_rank(&comms[0]), any = 0;
    if (failed < 0) for (int r = R - 1; r >= 0; r--) if (rc[r]) failed = r;
    if (failed >= 0) { snprintf(err, SN_ERR_MAX, "%s", args[failed].err); any = 1; }
    comm_local_destroy(comms, R);
    if (sh.has_train) dataset_free(&sh.train);
    if (sh.has_val) dataset_free(&sh.val);
    return any ? -1 : args[0].interrupted ? 128 + args[0].interrupted : 0;
}

int eval_run(const TrainCfg *c, const char *weights, const char *data, EvalResult *r,
             char err[SN_ERR_MAX]) {
    set_threads(c->threads);
    Trainer t;
    int rc = -1;
    // Trainer.cm_len at most
    int64_t *cm = malloc(sizeof(int64_t) * ((size_t)c->model.classes * c->model.classes + 2));
    snCheck(cm != NULL, "out of host memory");
    if (trainer_open(&t, c, NULL, data, err) || trainer_load_weights(&t, weights, NULL, NULL, err))
        goto done;
    PassTotals pt = {.cm = cm};
    if (run_pass(&t, &t.val, 0, &pt, err)) goto done;
    r->loss = pt.loss_sum / pt.norm_sum;
    pass_metrics(&t, cm, &r->m);
    rc = 0;
done:
    trainer_close(&t);
    free(cm);
    return rc;
}

// ---- export: a run's weights for PyTorch

// The names an export uses: torchvision's (segnet's own, plus batch norm's
// num_batches_tracked, so that load_state_dict(strict=True) takes them), timm's
// tf_efficientnetv2_* (also with num_batches_tracked), segnet's as they are, or
// segmentation_models_pytorch's Unet on a timm tu-tf_efficientnetv2_* encoder (unet_smp_name).
typedef enum {
    EXPORT_TORCHVISION, EXPORT_TIMM, EXPORT_SEGNET, EXPORT_SMP, EXPORT_KINDS
} ExportNames;
// indexed by ExportNames
static const char *const EXPORT_NAMES[EXPORT_KINDS] = {"torchvision", "timm", "segnet", "smp"};

// smp.Unet(encoder_name="tu-tf_efficientnetv2_<s|m|l>") is unet-effv2-<s|m|l> with the
// decoder starting at the last stage (timm's features_only has no head conv), padded as
// TensorFlow (timm's tf_ models: 'same', BN eps 1e-3 as segnet's). -1 with err if m is not.
static int smp_export_allowed(const ModelCfg *m, char err[SN_ERR_MAX]) {
    const char *size = strncmp(m->model, "unet-effv2-", 11) ? "" : m->model + 11;
    if (strcmp(size, "s") && strcmp(size, "m") && strcmp(size, "l"))
        snprintf(err, SN_ERR_MAX,
                 "model '%s': smp names are those of smp.Unet on timm's tf_efficientnetv2_s, _m "
                 "or _l: a unet-effv2-s, -m or -l",
                 m->model);
    else if (m->bottleneck != BOTTLENECK_STAGE)
        snprintf(err, SN_ERR_MAX,
                 "model '%s': its decoder starts at the encoder's 1×1 head conv (--bottleneck "
                 "head); smp's Unet starts at the last stage: train with --bottleneck stage",
                 m->model);
    else if (m->pad != PAD_SAME)
        snprintf(err, SN_ERR_MAX,
                 "model '%s': trained with symmetric padding; smp's tu-tf_efficientnetv2_* pad "
                 "as TensorFlow: train with --padding same",
                 m->model);
    else
        return 0;
    return -1;
}


// An export's metadata names its writer, so that --overwrite recognises an
// earlier export (and nothing else) as replaceable: in the compact header
// safetensors_write makes, the pair appears as EXPORT_WRITER_PAIR.
#define EXPORT_WRITER      "segnet export"
#define EXPORT_WRITER_PAIR "\"writer\":\"" EXPORT_WRITER "\""

// Whether the safetensors file at path was written by export (its header holds the pair).
static int is_export(const char *path) {
    struct stat sb;
    const char *why;
    const int fd = open_regular(path, &sb, &why);
    if (fd < 0) return 0;
    uint8_t len8[8];
    uint64_t hlen = 0;
    char *head = NULL;
    if (read(fd, len8, 8) == 8) {
        for (int i = 7; i >= 0; i--) hlen = hlen << 8 | len8[i];
        if (hlen <= SF_HEADER_MAX && (head = malloc(hlen + 1)) &&
            read(fd, head, hlen) == (ssize_t)hlen)
            head[hlen] = 0;
        else { free(head); head = NULL; }
    }
    close(fd);
    const int ours = head && strstr(head, EXPORT_WRITER_PAIR) != NULL;
    free(head);
    return ours;
}

// Where an export may write: a name the file system takes, never a file a run
// writes in a run folder; an existing file only with overwrite, and only an
// earlier export (a run's checkpoint, pretrained weights, anything else: never).
static int export_out_allowed(const char *out, int overwrite, char err[SN_ERR_MAX]) {
    if (out_path_check(out, err)) return -1;
    const char *base = path_base(out);
    char dir[OUT_PATH_MAX], probe[OUT_PATH_MAX + 32];
    path_folder(out, dir);
    const char *marks[] = {"config.txt", "last.safetensors", RUN_LOCK_FILE};
    int run_folder = 0;
    for (int k = 0; k < 3; k++) {
        snprintf(probe, sizeof probe, "%s/%s", dir, marks[k]);
        run_folder |= access(probe, F_OK) == 0;
    }
    struct stat sb;
    if (run_folder && is_run_file(base))
        snprintf(err, SN_ERR_MAX,
                 "%.300s: a file of the run in %.100s (export writes only a new file of its own "
                 "there)",
                 out, dir);
    else if (lstat(out, &sb) != 0)
        return 0;
    else if (S_ISDIR(sb.st_mode))
        snprintf(err, SN_ERR_MAX, "%.400s: is a folder (--out names the file to write)", out);
    else if (!overwrite)
        snprintf(err, SN_ERR_MAX,
                 "%.300s: exists; export replaces a file only with --overwrite, and only an "
                 "earlier export",
                 out);
    else if (!is_export(out))
        snprintf(err, SN_ERR_MAX,
                 "%.300s: exists and is not an earlier export (no %s in its metadata): --overwrite "
                 "does not "
                 "replace it",
                 out, EXPORT_WRITER_PAIR);
    else
        return 0;
    return -1;
}

// The weights and BN statistics of checkpoint `path` (a run's best or last),
// without the optimiser state, written atomically to out under `names`;
// num_batches_tracked is the checkpoint's step. report: one line.
int export_weights(const ModelCfg *m, const char *path, ExportNames names, const char *out,
                   char report[SN_ERR_MAX], char err[SN_ERR_MAX]) {
    SafetensorsFile f;
    if (safetensors_read(path, &f, err)) return -1;
    Graph g;
    graph_init(&g);
    int rc = -1, n = 0;
    SafetensorsTensor *ts = calloc(2 * (size_t)f.n_tensors + 1, sizeof *ts);
    snCheck(ts != NULL, "out of host memory");
    const char *step_text = safetensors_meta(&f, "step");
    int64_t step = 0;
    if (model_build(&g, m) < 0) { snprintf(err, SN_ERR_MAX, "%s", g.err); goto done; }
    if (names == EXPORT_SMP && smp_export_allowed(m, err)) goto done;
    if (step_text && meta_int(path, "step", step_text, 0, INT64_MAX, &step, err)) goto done;
    for (int i = 0; i < f.n_tensors; i++) {
        const SafetensorsTensor *t = &f.tensors[i];
        if (!strncmp(t->name, TRAIN_STATE_PREFIX, strlen(TRAIN_STATE_PREFIX)) ||
            strstr(t->name, BN_COUNT_SUFFIX))
            continue;
        if (graph_find_param(&g, t->name) < 0 && graph_find_buffer(&g, t->name) < 0) {
            snprintf(err, SN_ERR_MAX,
                     "%.300s: tensor '%.100s' is not one of model '%s''s (another model's "
                     "checkpoint?)",
                     path, t->name, m->model);
            goto done;
        }
        float *v = malloc(sizeof(float) * (t->numel ? t->numel : 1));
        snCheck(v != NULL, "out of host memory");
        safetensors_tensor_f32(t, v);
        const int allowed = values_allowed(path, t->name, v, t->numel, err) == 0;
        free(v);
        if (!allowed) goto done;
        ts[n] = *t;
        if (names == EXPORT_TIMM && !effnet_timm_name(&g, t->name, ts[n].name)) {
            snprintf(err, SN_ERR_MAX,
                     "model '%s': '%.100s' has no timm name (timm's tf_efficientnetv2_* are "
                     "EfficientNetV2 "
                     "classifiers without --head-hidden)",
                     m->model, t->name);
            goto done;
        }
        if (names == EXPORT_SMP && !unet_smp_name(&g, t->name, ts[n].name)) {
            snprintf(err, SN_ERR_MAX, "model '%s': '%.100s' has no smp name", m->model, t->name);
            goto done;
        }
        n++;
        const size_t len = strlen(ts[n - 1].name), suffix = strlen(BN_STAT_SUFFIX);
        if (names != EXPORT_SEGNET && len > suffix &&
            !strcmp(ts[n - 1].name + len - suffix, BN_STAT_SUFFIX)) {
            const SafetensorsTensor *var = &ts[n - 1];
            SafetensorsTensor *c = &ts[n++];
            memset(c, 0, sizeof *c);
            if (len - suffix + strlen(BN_COUNT_SUFFIX) >= sizeof c->name) {
                snprintf(err, SN_ERR_MAX, "'%.100s': its num_batches_tracked name is too long",
                         var->name);
                goto done;
            }
            memcpy(c->name, var->name, len - suffix);
            memcpy(c->name + (len - suffix), BN_COUNT_SUFFIX, strlen(BN_COUNT_SUFFIX) + 1);
            c->dtype = DT_I64;
            c->ndim = 0;
            c->numel = 1;
            c->data = &step;
        }
    }
    const char *keys[3] = {"format", "padding", "writer"},
               *values[3] = {"pt", PAD_NAME[m->pad], EXPORT_WRITER};
    if (safetensors_write(out, ts, n, keys, values, 3, err)) goto done;
    // the plain unet has no torchvision model: its names are those of its PyTorch class;
    // smp's are those of a constructor call
    char smp[200] = "";
    if (names == EXPORT_SMP)  // a unet-effv2-s, -m or -l (smp_export_allowed)
        snprintf(smp, sizeof smp,
                 "segmentation_models_pytorch's Unet(encoder_name=\"tu-tf_efficientnetv2_%s\", "
                 "encoder_weights=None, classes=%d)",
                 m->model + strlen("unet-effv2-"), m->classes);
    const char *named = names == EXPORT_TORCHVISION && !strcmp(m->model, "unet")
                                ? "ref/segnet_unet.py's SegnetUNet"
                        : names == EXPORT_SMP ? smp
                                              : EXPORT_NAMES[names];
    snprintf(report, SN_ERR_MAX, "wrote %.200s: %d tensors in %s names from %.200s (padding %s)",
             out, n, named, path, PAD_NAME[m->pad]);
    rc = 0;
done:
    free(ts);
    graph_free(&g);
    safetensors_free(&f);
    return rc;
}

// export of a run's best (or last) checkpoint: its lock held while it is read
int export_run(const ModelCfg *m, const char *run, int last, ExportNames names, const char *out,
               int overwrite, char report[SN_ERR_MAX], char err[SN_ERR_MAX]) {
    char path[4200];
    run_path(path, sizeof path, run, last ? "last.safetensors" : "best.safetensors");
    if (export_out_allowed(out, overwrite, err)) return -1;
    const int lock = run_lock(run, "segnet export", err);
    if (lock == -1) return -1;
    const int rc = export_weights(m, path, names, out, report, err);
    run_unlock(run, lock);
    return rc;
}

// ---- memory of a run, from its plan (what trainer_open allocates)

typedef struct {
    size_t params, grads, optimizer, statistics, activations, workspace, io, backend, driver, total;
    size_t n_trainable;
} MemoryReport;

static void memory_report(const Graph *g, const Plan *p, const TrainCfg *c, int logits,
                          const Ops *o, MemoryReport *m) {
    memset(m, 0, sizeof *m);
    size_t *grad_offset = malloc(sizeof(size_t) * ((size_t)g->n_params + 1));
    snCheck(grad_offset != NULL, "out of host memory");
    // what net_create gives gradients (and Adam moments)
    m->n_trainable = grad_layout(g, grad_offset);
    free(grad_offset);
    const Shape in = g->tensors[g->input].shape, out = g->tensors[logits].shape;
    const size_t K = (size_t)out.c, labels = (size_t)out.n * out.h * out.w;
    int cmax = 1;
    m->params = sizeof(float) * g->n_param_floats;
    if (o->weights_in_storage_type && c->precision != DT_F32)
        m->params += dtype_size(c->precision) * g->n_param_floats;
    // as net_create allocates them
    m->grads = sizeof(float) * (m->n_trainable ? m->n_trainable : 1);
    m->optimizer = 2 * sizeof(float) * m->n_trainable;
    m->statistics = sizeof(float) * g->n_buffer_floats;
    for (int i = 0; i < g->n_layers; i++)
        if (g->layers[i].kind == LAYER_BN) {
            int C = tshape(g, g->layers[i].in[0]).c;
            m->statistics += 2 * sizeof(float) * (size_t)C;
            if (C > cmax) cmax = C;
        }
    // net->bn_scratch, net->bn_sums
    m->statistics += 2 * (sizeof(float) + sizeof(double)) * (size_t)cmax;
    m->workspace = p->workspace;
    m->activations = p->peak - p->workspace;
    // the loss's buffers, as trainer_open_on allocates them: each term's class weights and the
    // classes' own, the region terms' sums and coefficients, the confusion record
    const LossCfg loss = c->loss.n ? c->loss : loss_cfg_default();
    const size_t groups = loss.per_image ? (size_t)in.n : 1;
    m->io = sizeof(float) * K * (loss.n + 1) + sizeof(int32_t) * labels +
            sizeof(int64_t) * (K * K + (c->iou_per_image ? 2 : 0)) +
            (loss_has_region(&loss) ? sizeof(float) * (3 * K * (groups > 2 ? groups : 2) +
                                                       2 * K * groups + 1 + 2 * labels)
                                    : 0) +
            (loss_has(&loss, LOSS_LOVASZ) ? lovasz_ws_bytes((int)groups, labels / groups, K) : 0) +
            sizeof(StepArgs) + sizeof(StepState) +
            // the last: Trainer.nonfinite
            sizeof(uint64_t) * (size_t)g->n_layers + sizeof(int32_t);
    m->io += stage_bytes(in, c->precision, labels, o->upload_ahead != NULL);
    m->backend = o->context_bytes;
    m->driver = o->driver_bytes;
    m->total = m->params + m->grads + m->optimizer + m->statistics + m->activations + m->workspace +
               m->io + m->backend + m->driver;
}

// Builds the graph of c (frozen layers marked) and its plan. Returns the logits, or -1 with err.
static int plan_for(const TrainCfg *c, Graph *g, Plan *p, Ops **op, char err[SN_ERR_MAX]) {
    graph_init(g);
    Ops *o = *op = ops_for_device(c->device, 0, err);  // its conv workspace sizes, its own memory
    if (!o) return -1;
    int logits = model_build(g, &c->model);
    if (logits < 0) { snprintf(err, SN_ERR_MAX, "%s", g->err); return -1; }
    if (freeze_apply(g, c, err)) return -1;
    int *needs_grad = malloc(sizeof(int) * (size_t)g->n_tensors);
    snCheck(needs_grad != NULL, "out of host memory");
    graph_needs_grad(g, 0, needs_grad);
    plan_build(p, g, o, needs_grad, c->precision, logits, c->checkpoint,
               net_workspace_bytes(g, o, c->precision));
    free(needs_grad);
    return logits;
}

// --memory: the fastest setting that fits, for the global batch c->model.batch
// (× c->accum): the largest micro-batch first; at each, stored activations
// before checkpointing, fp32 before fp16 storage; the micro-batches make up
// the global batch by accumulation. On success c holds the setting and why
// says what was tried; else -1 with err saying what the smallest setting needs.
static int choose_setting(TrainCfg *c, size_t budget, char *why, size_t why_size,
                          char err[SN_ERR_MAX]) {
    const int global = c->model.batch * c->accum;
    size_t smallest = SIZE_MAX;
    int tried = 0;
    why[0] = 0;
    // at each micro-batch, from the fastest to the smallest
    static const struct { int checkpoint; DType precision; } SETTINGS[] = {
        {0, DT_F32}, {1, DT_F32}, {0, DT_F16}, {1, DT_F16}};
    for (int micro = global; micro >= 1; micro = micro > 1 ? (micro + 1) / 2 : 0) {
        for (size_t v = 0; v < sizeof SETTINGS / sizeof *SETTINGS; v++) {
            TrainCfg t = *c;
            t.model.batch = micro;
            t.accum = (global + micro - 1) / micro;
            t.checkpoint = SETTINGS[v].checkpoint;
            t.precision = SETTINGS[v].precision;
            Graph g;
            Plan p;
            Ops *o;
            int logits = plan_for(&t, &g, &p, &o, err);
            if (logits < 0) { graph_free(&g); return -1; }
            MemoryReport m;
            memory_report(&g, &p, &t, logits, o, &m);
            plan_free(&p);
            graph_free(&g);
            tried++;
            if (m.total < smallest) smallest = m.total;
            size_t k = strlen(why);
            snprintf(why + k, why_size - k,
                     "  micro-batch %d × %d, %s, checkpoint %s: %.2f GiB%s\n", micro, t.accum,
                     DTYPE_NAMES[t.precision], t.checkpoint ? "blocks" : "none",
                     m.total / 1073741824.0, m.total <= budget ? "  fits" : "");
            if (m.total <= budget) { *c = t; return 0; }
        }
        if (micro == 1) break;
    }
    snprintf(err, SN_ERR_MAX,
             "nothing fits in %.2f GiB: the smallest setting tried (of %d) needs %zu bytes (%.2f "
             "GiB)",
             budget / 1073741824.0, tried, smallest, smallest / 1073741824.0);
    return -1;
}
