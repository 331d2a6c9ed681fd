// weights.c -- weights by name: safetensors files in PyTorch layout into and out of a Net.
// Plumbing of the segnet program: segnet.c (the math, the models, the step)
// includes this file at its end, so that the program is one translation unit.

// ----------------------------------------------------------------------------
// weights by name: safetensors files in PyTorch layout
//
// Names are the graph's (torchvision's for EfficientNetV2). Files hold
// PyTorch's layout, so that they load into torchvision as they are: conv
// weights OIHW, transposed to and from segnet's OHWI on the way.

// element [o][i][y][x] of OIHW goes to [o][y][x][i]
static void oihw_to_ohwi(const float *src, float *dst, int n_out, int n_in, int kh, int kw) {
    for (int o = 0; o < n_out; o++)
        for (int i = 0; i < n_in; i++)
            for (int y = 0; y < kh; y++)
                for (int x = 0; x < kw; x++)
                    dst[(((size_t)o * kh + y) * kw + x) * n_in + i] =
                            src[(((size_t)o * n_in + i) * kh + y) * kw + x];
}
static void ohwi_to_oihw(const float *src, float *dst, int n_out, int n_in, int kh, int kw) {
    for (int o = 0; o < n_out; o++)
        for (int i = 0; i < n_in; i++)
            for (int y = 0; y < kh; y++)
                for (int x = 0; x < kw; x++)
                    dst[(((size_t)o * n_in + i) * kh + y) * kw + x] =
                            src[(((size_t)o * kh + y) * kw + x) * n_in + i];
}

// a file tensor's values as fp32 (its data may be unaligned and fp16/bf16/int64)
void safetensors_tensor_f32(const SafetensorsTensor *t, float *dst) {
    const uint8_t *p = (const uint8_t *)t->data;
    for (size_t i = 0; i < t->numel; i++) {
        if (t->dtype == DT_F32) { memcpy(&dst[i], p + 4 * i, 4); continue; }
        if (t->dtype == DT_I64) {
            int64_t v;
            memcpy(&v, p + 8 * i, 8);
            dst[i] = (float)v;
            continue;
        }
        uint16_t h;
        memcpy(&h, p + 2 * i, 2);
        dst[i] = t->dtype == DT_F16 ? f16_to_f32(h) : bf16_to_f32(h);
    }
}

// timm's name for an EfficientNetV2 tensor named as torchvision names it
// (timm's tf_efficientnetv2_*: conv_stem/bn1, blocks.{s-1}.{j}.*, conv_head/bn2,
// classifier); 0 where timm has no such tensor. A block's kind decides its
// names: ConvBnAct (fused, expansion 1) conv/bn1; EdgeResidual (fused)
// conv_exp/bn1/conv_pwl/bn2; InvertedResidual (MBConv) conv_pw/bn1/conv_dw/bn2/
// se.conv_reduce/se.conv_expand/conv_pwl/bn3.
int effnet_timm_name(const Graph *g, const char *name, char out[SN_NAME_MAX]) {
    static const char *const IR[4][2] = {
            {"conv_pw", "bn1"}, {"conv_dw", "bn2"}, {NULL, NULL}, {"conv_pwl", "bn3"}};
    static const char *const ER[2][2] = {{"conv_exp", "bn1"}, {"conv_pwl", "bn2"}};
    int s, j, k, m, n = 0;
    if (sscanf(name, "classifier.1.%n", &n) == 0 && n > 0) {
        if (graph_find_param(g, "classifier.4.weight") >= 0) return 0;  // a hidden head: not timm's
        return snprintf(out, SN_NAME_MAX, "classifier.%s", name + n) < SN_NAME_MAX;
    }
    n = 0;
    if (sscanf(name, "features.%d.%n", &s, &n) != 1 || n == 0) return 0;
    const char *rest = name + n;
    int nb = 0;
    if (sscanf(rest, "%d.block.%n", &j, &nb) == 1 && nb > 0) {
        const char *tail = rest + nb, *field;
        char probe[SN_NAME_MAX];
        if (!strncmp(tail, "2.fc1.", 6) || !strncmp(tail, "2.fc2.", 6))
            return snprintf(out, SN_NAME_MAX, "blocks.%d.%d.se.%s.%s", s - 1, j,
                            tail[4] == '1' ? "conv_reduce" : "conv_expand", tail + 6) < SN_NAME_MAX;
        int nk = 0;
        if (sscanf(tail, "%d.%d.%n", &k, &m, &nk) != 2 || nk == 0 || k < 0 || k > 3 || m < 0 ||
            m > 1)
            return 0;
        snprintf(probe, sizeof probe, "features.%d.%d.block.2.fc1.weight", s, j);
        if (graph_find_param(g, probe) >= 0) field = IR[k][m];
        else {
            snprintf(probe, sizeof probe, "features.%d.%d.block.1.0.weight", s, j);
            if (graph_find_param(g, probe) >= 0) field = k < 2 ? ER[k][m] : NULL;
            else field = k == 0 ? (m ? "bn1" : "conv") : NULL;
        }
        return field && snprintf(out, SN_NAME_MAX, "blocks.%d.%d.%s.%s", s - 1, j, field,
                                 tail + nk) < SN_NAME_MAX;
    }
    // stem (features.0) or head (the last features entry): P.0 conv, P.1 BN
    if ((rest[0] != '0' && rest[0] != '1') || rest[1] != '.') return 0;
    const char *field =
            rest[0] == '0' ? (s == 0 ? "conv_stem" : "conv_head") : (s == 0 ? "bn1" : "bn2");
    return snprintf(out, SN_NAME_MAX, "%s.%s", field, rest + 2) < SN_NAME_MAX;
}

#define SMP_ENCODER_PREFIX "encoder.model."  // smp's TimmUniversalEncoder holds the timm model

int unet_smp_name(const Graph *g, const char *name, char out[SN_NAME_MAX]) {
    char timm[SN_NAME_MAX];
    if (strncmp(name, "features.", 9)) return snprintf(out, SN_NAME_MAX, "%s", name) < SN_NAME_MAX;
    return effnet_timm_name(g, name, timm) &&
           snprintf(out, SN_NAME_MAX, SMP_ENCODER_PREFIX "%s", timm) < SN_NAME_MAX;
}

// the PyTorch shape of a segnet parameter: OHWI (4-d) becomes OIHW
static void torch_dims(const ParamInfo *p, int64_t dims[4]) {
    for (int k = 0; k < p->ndim; k++) dims[k] = p->dims[k];
    if (p->ndim == 4) { dims[1] = p->dims[3]; dims[2] = p->dims[1]; dims[3] = p->dims[2]; }
}

static void dims_str(char *buf, size_t size, const int64_t *d, int n) {
    int k = snprintf(buf, size, "(");
    for (int i = 0; i < n && k < (int)size; i++)
        k += snprintf(buf + k, size - k, i ? ",%lld" : "%lld", (long long)d[i]);
    if (k < (int)size) snprintf(buf + k, size - k, ")");
}

// appends "name" to a comma-separated list, at most a few names then "..."
// (a name from a file may hold any byte but NUL: control bytes are shown as '?',
// so that the message stays one line)
static void list_add(char *list, size_t size, int *count, const char *name) {
    if (*count < 4) {
        size_t len = strlen(list);
        snprintf(list + len, size - len, "%s%s", *count ? ", " : "", name);
        for (char *p = list + len; *p; p++) if ((uint8_t)*p < 0x20 || *p == 0x7f) *p = '?';
    } else if (*count == 4) {
        size_t len = strlen(list);
        snprintf(list + len, size - len, ", ...");
    }
    (*count)++;
}

// whether name starts with one of the comma-separated prefixes ("*": any name)
static int has_prefix_in(const char *name, const char *prefixes) {
    if (!prefixes || !prefixes[0]) return 0;
    if (!strcmp(prefixes, "*")) return 1;
    for (const char *p = prefixes; *p;) {
        const char *end = strchr(p, ',');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len && !strncmp(name, p, len)) return 1;
        if (!end) break;
        p = end + 1;
    }
    return 0;
}

#define BN_STAT_SUFFIX ".running_var"       // one per batch norm: where num_batches_tracked goes
#define BN_COUNT_SUFFIX ".num_batches_tracked"

static int name_ends_with(const char *name, const char *suffix) {
    const size_t n = strlen(name), k = strlen(suffix);
    return n >= k && !strcmp(name + n - k, suffix);
}

// Values no model may hold: NaN or inf anywhere (a diverged run's), a
// negative batch-norm variance. -1 with err naming the file, the tensor and
// the first such element.
static int values_allowed(const char *path, const char *name, const float *v, size_t n,
                          char err[SN_ERR_MAX]) {
    const int variance = name_ends_with(name, BN_STAT_SUFFIX);
    for (size_t i = 0; i < n; i++)
        if (!isfinite(v[i]) || (variance && v[i] < 0.0f)) {
            snprintf(err, SN_ERR_MAX, "%.250s: tensor '%.100s' holds %g at element %zu: %s", path,
                     name, v[i], i,
                     isfinite(v[i]) ? "a variance cannot be negative"
                                    : "not a finite number (the weights of a diverged run?)");
            return -1;
        }
    return 0;
}

int net_load_weights(Net *net, const SafetensorsFile *f, const char *path,
                     const char *allow_missing, int allow_unexpected, char err[SN_ERR_MAX]) {
    const LoadRules rules = {allow_missing, allow_unexpected ? "*" : NULL, 0};
    return net_load_weights_rules(net, f, path, &rules, NULL, err);
}

int net_load_weights_rules(Net *net, const SafetensorsFile *f, const char *path,
                           const LoadRules *rules, char *report, char err[SN_ERR_MAX]) {
    const Graph *g = net->g;
    const char *allow_missing = rules ? rules->init : NULL;
    int n_loaded = 0, n_timm = 0, n_smp = 0, n_init = 0, n_ignored = 0, n_reshaped = 0;
    char init_list[256] = "", ignored_list[256] = "", reshaped_list[384] = "";
    const int n_entries = g->n_params + g->n_buffers;
    const SafetensorsTensor **src = calloc((size_t)n_entries, sizeof *src);
    char *used = calloc((size_t)f->n_tensors + 1, 1);
    snCheck(src && used, "out of host memory");
    char missing[256] = "", wrong[384] = "", unexpected[256] = "";
    int n_missing = 0, n_wrong = 0, n_unexpected = 0;
    // first every check, then the copy: a refused file changes nothing
    for (int e = 0; e < n_entries; e++) {
        const ParamInfo *p = e < g->n_params ? &g->params[e] : &g->buffers[e - g->n_params];
        const SafetensorsTensor *t = safetensors_find(f, p->name);
        char alias[SN_NAME_MAX];
        // timm's naming, or smp's (a unet-effv2-*'s encoder in timm's names)
        if (!t && effnet_timm_name(g, p->name, alias) && (t = safetensors_find(f, alias)) != NULL)
            n_timm++;
        if (!t && !strncmp(p->name, "features.", 9) && unet_smp_name(g, p->name, alias) &&
            (t = safetensors_find(f, alias)) != NULL)
            n_smp++;
        int skippable = has_prefix_in(p->name, allow_missing);
        if (t) used[t - f->tensors] = 1;
        int64_t want[4];
        torch_dims(p, want);
        int same = t && t->ndim == p->ndim && t->dtype != DT_I64;  // a weight is floating point
        for (int k = 0; same && k < p->ndim; k++) same = t->dims[k] == want[k];
        if (!t) {
            if (!skippable) list_add(missing, sizeof missing, &n_missing, p->name);
            else list_add(init_list, sizeof init_list, &n_init, p->name);
        } else if (!same) {
            // the file's tensor (of another shape) ignored, the model's initialised: said once
            if (skippable) {
                char a[96], b[96], item[SN_NAME_MAX + 2 * 96 + 40];
                dims_str(a, sizeof a, t->dims, t->ndim);
                dims_str(b, sizeof b, want, p->ndim);
                snprintf(item, sizeof item, "%s ignored %s; initialised %s", p->name, a, b);
                list_add(reshaped_list, sizeof reshaped_list, &n_reshaped, item);
            } else {
                char a[96], b[96], item[2 * SN_NAME_MAX + 200];
                dims_str(a, sizeof a, t->dims, t->ndim);
                dims_str(b, sizeof b, want, p->ndim);
                if (t->dtype == DT_I64)
                    snprintf(item, sizeof item,
                             "%s is I64, a weight is floating point (F32, F16 or BF16)", p->name);
                else
                    snprintf(item, sizeof item, "%s is %s, the model needs %s", p->name, a, b);
                list_add(wrong, sizeof wrong, &n_wrong, item);
            }
        } else {
            src[e] = t;
            n_loaded++;
        }
    }
    for (int i = 0; i < f->n_tensors; i++) {
        const char *name = f->tensors[i].name;
        if (used[i] || strstr(name, "num_batches_tracked") ||
            !strncmp(name, TRAIN_STATE_PREFIX, strlen(TRAIN_STATE_PREFIX)))
            continue;
        if (has_prefix_in(name, rules ? rules->ignore : NULL))
            list_add(ignored_list, sizeof ignored_list, &n_ignored, name);
        else list_add(unexpected, sizeof unexpected, &n_unexpected, name);
    }
    int refuse = n_missing || n_wrong || n_unexpected;
    if (refuse) {
        int k = snprintf(err, SN_ERR_MAX, "%s: not loaded:", path);
        if (n_missing && k < SN_ERR_MAX)
            k += snprintf(err + k, SN_ERR_MAX - k, " %d missing (%s);", n_missing, missing);
        if (n_wrong && k < SN_ERR_MAX)
            k += snprintf(err + k, SN_ERR_MAX - k, " %d of the wrong shape or type (%s);", n_wrong,
                          wrong);
        if (n_unexpected && k < SN_ERR_MAX)
            k += snprintf(err + k, SN_ERR_MAX - k, " %d unexpected (%s);", n_unexpected,
                          unexpected);
        if (k < SN_ERR_MAX && (n_missing || n_wrong))
            snprintf(err + k, SN_ERR_MAX - k,
                     " tensors a training run should initialise instead can be named with "
                     "--allow-missing PREFIX");
    }
    size_t max_count = 1;
    for (int e = 0; e < n_entries; e++) {
        const ParamInfo *p = e < g->n_params ? &g->params[e] : &g->buffers[e - g->n_params];
        if (p->count > max_count) max_count = p->count;
    }
    float *vals = malloc(sizeof(float) * max_count), *tmp = malloc(sizeof(float) * max_count);
    snCheck(vals && tmp, "out of host memory");
    for (int e = 0; e < n_entries && !refuse; e++)  // the values, before anything is copied
        if (src[e]) {
            safetensors_tensor_f32(src[e], vals);
            refuse = values_allowed(path, src[e]->name, vals, src[e]->numel, err) != 0;
        }
    if (!refuse && !(rules && rules->check_only)) {
        char reshaped[sizeof reshaped_list + 40] = "";
        if (n_reshaped)
            snprintf(reshaped, sizeof reshaped, ", %d of another shape (%s)", n_reshaped,
                     reshaped_list);
        if (report)
            snprintf(report, SN_ERR_MAX,
                     "weights: %d tensors loaded from %.200s (%s names), %d initialised%s%s%s, "
                     "%d ignored%s%s%s%s",
                     n_loaded, path, n_smp ? "smp" : n_timm ? "timm" : "torchvision", n_init,
                     n_init ? " (" : "", init_list, n_init ? ")" : "", n_ignored,
                     n_ignored ? " (" : "", ignored_list,
                     n_ignored ? ")" : "", reshaped);
        Ops *o = net->o;
        for (int e = 0; e < n_entries; e++) {
            if (!src[e]) continue;  // skipped under allow_missing
            const int is_param = e < g->n_params;
            const ParamInfo *p = is_param ? &g->params[e] : &g->buffers[e - g->n_params];
            safetensors_tensor_f32(src[e], vals);
            if (p->ndim == 4) {
                oihw_to_ohwi(vals, tmp, p->dims[0], p->dims[3], p->dims[1], p->dims[2]);
                memcpy(vals, tmp, sizeof(float) * p->count);
            }
            o->upload(o, (is_param ? net->params : net->buffers) + p->offset, vals,
                      sizeof(float) * p->count);
        }
    }
    free(vals); free(tmp);
    free(src); free(used);
    return refuse ? -1 : 0;
}

// a metadata value of the file, NULL if it has no such key
static const char *safetensors_meta(const SafetensorsFile *f, const char *key) {
    for (int i = 0; i < f->n_meta; i++) if (!strcmp(f->meta_keys[i], key)) return f->meta_values[i];
    return NULL;
}

int weights_padding(const SafetensorsFile *f, PadMode *pad, const char **why) {
    const char *meta = safetensors_meta(f, "padding");
    if (meta && (!strcmp(meta, "same") || !strcmp(meta, "symmetric"))) {
        *pad = strcmp(meta, "same") ? PAD_SYMMETRIC : PAD_SAME;
        *why = "from the file's metadata";
        return 1;
    }
    // a segnet checkpoint from before the padding was recorded
    if (safetensors_meta(f, "epoch")) return 0;
    if (safetensors_find(f, "conv_stem.weight")) {
        *pad = PAD_SAME;
        *why = "timm's tf_efficientnetv2 names: TensorFlow's SAME";
        return 1;
    }
    if (safetensors_find(f, "features.0.0.weight")) {
        *pad = PAD_SYMMETRIC;
        *why = "torchvision names";
        return 1;
    }
    return 0;
}

static const char *PAD_NAME[2] = {"same", "symmetric"};

// An EfficientNetV2 or a U-Net on one: the models whose strided convs --padding changes
static int model_is_effnet(const char *model) {
    return eff_spec(model) || (!strncmp(model, "unet-", 5) && eff_spec(model + 5));
}

int padding_follow_weights(ModelCfg *m, const char *weights, const char *cmd, char *note,
                           char err[SN_ERR_MAX]) {
    note[0] = 0;
    const char *model = m->model;
    if (!weights || !model_is_effnet(model)) return 0;
    SafetensorsFile f;
    if (safetensors_read(weights, &f, err)) return -1;
    PadMode pad;
    const char *why, *source = m->pad_given == PAD_RUN ? "the run's config.txt"
                               : m->pad_given          ? "--padding"
                                                       : "the default";
    if (!weights_padding(&f, &pad, &why)) {
        snprintf(note, SN_ERR_MAX, "padding %s (%s; the weights do not say)", PAD_NAME[m->pad],
                 source);
    } else if (!m->pad_given) {
        m->pad = pad;
        snprintf(note, SN_ERR_MAX, "padding %s (%s)", PAD_NAME[pad], why);
    } else {
        if (m->pad != pad)
            fprintf(stderr,
                    "segnet %s: warning: padding %s (%s), but the weights were trained with %s "
                    "padding (%s)\n",
                    cmd, PAD_NAME[m->pad], source, PAD_NAME[pad], why);
        snprintf(note, SN_ERR_MAX, "padding %s (%s%s)", PAD_NAME[m->pad], source,
                 m->pad != pad ? ", against the weights" : "");
    }
    safetensors_free(&f);
    return 0;
}

int net_save_weights(const Net *net, const char *path, char err[SN_ERR_MAX]) {
    return net_save_checkpoint(net, path, NULL, 0, NULL, NULL, 0, err);
}

int net_save_checkpoint(const Net *net, const char *path, const SafetensorsTensor *extra,
                        int n_extra, const char *const *meta_keys, const char *const *meta_values,
                        int n_meta, char err[SN_ERR_MAX]) {
    const Graph *g = net->g;
    Ops *o = net->o;
    const int n_model = g->n_params + g->n_buffers, n = n_model + n_extra;
    size_t total = g->n_param_floats + g->n_buffer_floats;
    float *host = malloc(sizeof(float) * (total ? total : 1)),
          *tmp = malloc(sizeof(float) * (total ? total : 1));
    SafetensorsTensor *ts = calloc((size_t)n, sizeof *ts);
    snCheck(host && tmp && ts, "out of host memory");
    o->download(o, host, net->params, sizeof(float) * g->n_param_floats);
    o->download(o, host + g->n_param_floats, net->buffers, sizeof(float) * g->n_buffer_floats);
    for (int e = 0; e < n_model; e++) {
        const int is_param = e < g->n_params;
        const ParamInfo *p = is_param ? &g->params[e] : &g->buffers[e - g->n_params];
        float *v = host + (is_param ? 0 : g->n_param_floats) + p->offset;
        if (p->ndim == 4) {  // to OIHW, in the spare copy at the same offset
            float *t = tmp + (is_param ? 0 : g->n_param_floats) + p->offset;
            ohwi_to_oihw(v, t, p->dims[0], p->dims[3], p->dims[1], p->dims[2]);
            v = t;
        }
        SafetensorsTensor *t = &ts[e];
        snprintf(t->name, sizeof t->name, "%s", p->name);
        t->dtype = DT_F32;
        t->ndim = p->ndim;
        torch_dims(p, t->dims);
        t->numel = p->count;
        t->data = v;
    }
    for (int e = 0; e < n_extra; e++) ts[n_model + e] = extra[e];
    const char **keys = calloc((size_t)n_meta + 2, sizeof(char *)),
               **values = calloc((size_t)n_meta + 2, sizeof(char *));
    snCheck(keys && values, "out of host memory");
    keys[0] = "format"; values[0] = "segnet";
    keys[1] = "layout"; values[1] = "pytorch (conv weights OIHW)";
    for (int k = 0; k < n_meta; k++) { keys[2 + k] = meta_keys[k]; values[2 + k] = meta_values[k]; }
    int rc = safetensors_write(path, ts, n, keys, values, n_meta + 2, err);
    free(host); free(tmp); free(ts); free(keys); free(values);
    return rc;
}
