// cli.c -- the command line: options, usage texts, the commands and main.
// Plumbing of the segnet program: segnet.c (the math, the models, the step)
// includes this file at its end, so that the program is one translation unit.

// ----------------------------------------------------------------------------
// command line

// what `segnet train` with no options runs (make train): the bundled data set
#define QUICKSTART_ARGS                                                                     \
    "--model unet --depth 3 --width 16 --size 64x64 --data data/train --val data/val "       \
    "--classes 4 --class-weights 0,1,1,1 --batch 8 --epochs 12 --schedule cosine --augment flip"

// A message on one printable line: bytes below 0x20 and 0x7f (from file names,
// file contents, a decoder's reason) shown as \xNN. UTF-8 stays as it is.
static void print_message(FILE *to, const char *who, const char *msg) {
    fputs(who, to);
    fputs(": ", to);
    for (const unsigned char *p = (const unsigned char *)msg; *p; p++) {
        if (*p < 0x20 || *p == 0x7f) fprintf(to, "\\x%02x", *p);
        else fputc(*p, to);
    }
    fputc('\n', to);
}

// strict integer option: the whole value must be a number in [lo, hi]
static int parse_int(const char *flag, const char *v, int lo, int hi, int *out) {
    char *end;
    long x = strtol(v, &end, 10);
    if (!*v || *end || x < lo || x > hi) {
        fprintf(stderr, "segnet: %s '%s' is not an integer in %d..%d\n", flag, v, lo, hi);
        return -1;
    }
    *out = (int)x;
    return 0;
}

// --max-pixels N: the largest width × height an image file may declare (process-wide, like
// --threads)
static int parse_max_pixels(const char *flag, const char *v) {
    int n;
    if (parse_int(flag, v, 1, INT32_MAX, &n)) return -1;
    image_max_pixels = n;
    return 0;
}

// --exif ignore|apply: images as stored or as their EXIF orientation displays them (process-wide,
// like --max-pixels)
static int parse_exif(const char *flag, const char *v) {
    for (int k = 0; k < 2; k++)
        if (!strcmp(v, EXIF_MODE_NAMES[k])) { image_exif = (ExifMode)k; return 0; }
    fprintf(stderr, "segnet: %s '%s' must be ignore or apply\n", flag, v);
    return -1;
}

// A number option's domain: [lo, hi], a bound excluded where open; why, if any, says what a
// value outside it would do
typedef struct {
    float lo, hi;
    int lo_open, hi_open;
    const char *why;
} FloatRange;
static const FloatRange AT_LEAST_0 = {0.0f, FLT_MAX, 0, 0, NULL},
                        ABOVE_0 = {0.0f, FLT_MAX, 1, 0, NULL};

// The float a number becomes (strtof's rounding, which config.txt's float_str reads back bit
// for bit), refused where that float is inf, where a nonzero number becomes 0 or subnormal,
// or where it is outside r: "" or the problem (why: room for it). *end: past the number.
static const char *float_problem(const char *s, char **end, FloatRange r, float *out,
                                 char why[160]) {
    const double x = strtod(s, end);
    const float f = strtof(s, NULL);
    if (*end == s || isnan(f)) return "is not a number";
    if (isinf(f)) return "is beyond a float (at most 3.40282e+38)";
    if (x != 0.0 && !(fabsf(f) >= FLT_MIN))
        return "is too small for a float (give 0 or at least 1.17549e-38)";
    if ((r.lo_open ? f > r.lo : f >= r.lo) && (r.hi_open ? f < r.hi : f <= r.hi)) {
        *out = f;
        return "";
    }
    if (r.hi == FLT_MAX)
        snprintf(why, 160, "is not a number %s %g", r.lo_open ? ">" : "≥", r.lo);
    else
        snprintf(why, 160, "is not a number in %c%g, %g%c", r.lo_open ? '(' : '[', r.lo, r.hi,
                 r.hi_open ? ')' : ']');
    if (r.why) snprintf(why + strlen(why), 160 - strlen(why), " (%s)", r.why);
    return why;
}

static int parse_number(const char *flag, const char *v, FloatRange r, float *out) {
    char *end, why[160];
    const char *problem = float_problem(v, &end, r, out, why);
    if (*end) problem = "is not a number";
    if (!*problem) return 0;
    fprintf(stderr, "segnet: %s '%s' %s\n", flag, v, problem);
    return -1;
}

// Parses the model options shared by plan (and later train, predict, bench).
// Returns the number of arguments consumed at argv[i] (0: not a model option), -1 on error.
// HxW, each 1..32768
static int parse_size(const char *flag, const char *v, int *h, int *w) {
    int k;
    if (sscanf(v, "%dx%d%n", h, w, &k) != 2 || v[k] || *h < 1 || *w < 1 || *h > 1 << 15 ||
        *w > 1 << 15) {
        fprintf(stderr, "segnet: %s '%s' must be HxW, e.g. 384x384\n", flag, v);
        return -1;
    }
    return 0;
}

static int parse_model_option(ModelCfg *c, int argc, char **argv, int i) {
    const char *f = argv[i];
    int is_model_flag = !strcmp(f, "--model") || !strcmp(f, "--classes") || !strcmp(f, "--size") ||
                        !strcmp(f, "--batch") || !strcmp(f, "--padding") ||
                        !strcmp(f, "--head-hidden") || !strcmp(f, "--depth") ||
                        !strcmp(f, "--width") || !strcmp(f, "--dropout") ||
                        !strcmp(f, "--bottleneck");
    if (!is_model_flag) return 0;
    if (i + 1 >= argc) { fprintf(stderr, "segnet: %s needs a value\n", f); return -1; }
    const char *v = argv[i + 1];
    if (!strcmp(f, "--model")) c->model = v;
    else if (!strcmp(f, "--classes")) { if (parse_int(f, v, 1, 1 << 20, &c->classes)) return -1; }
    else if (!strcmp(f, "--batch")) { if (parse_int(f, v, 1, 1 << 16, &c->batch)) return -1;
    } else if (!strcmp(f, "--head-hidden")) {
        if (parse_int(f, v, 0, 1 << 20, &c->head_hidden)) return -1;
    } else if (!strcmp(f, "--dropout")) {
        const FloatRange rate = {0.0f, 1.0f, 0, 1, "a rate"};
        if (parse_number(f, v, rate, &c->dropout)) return -1;
    } else if (!strcmp(f, "--depth")) {
        if (parse_int(f, v, 1, 8, &c->depth)) return -1;
    } else if (!strcmp(f, "--width")) {
        if (parse_int(f, v, 1, 1 << 16, &c->width_base)) return -1;
    } else if (!strcmp(f, "--bottleneck")) {
        if (!strcmp(v, "head")) c->bottleneck = BOTTLENECK_HEAD;
        else if (!strcmp(v, "stage")) c->bottleneck = BOTTLENECK_STAGE;
        else {
            fprintf(stderr, "segnet: --bottleneck '%s' must be head or stage\n", v);
            return -1;
        }
    } else if (!strcmp(f, "--padding")) {
        c->pad_given = PAD_OPTION;
        if (!strcmp(v, "same")) c->pad = PAD_SAME;
        else if (!strcmp(v, "symmetric")) c->pad = PAD_SYMMETRIC;
        else {
            fprintf(stderr, "segnet: --padding '%s' must be same or symmetric\n", v);
            return -1;
        }
    } else if (parse_size(f, v, &c->height, &c->width)) {  // --size HxW
        return -1;
    }
    return 2;
}

// the input size a model is used at when --size is not given (Keras' defaults for V2-S/M/L)
static void model_default_size(ModelCfg *c) {
    int side = 256;
    if (!strcmp(c->model, "effv2-s")) side = 384;
    else if (!strcmp(c->model, "effv2-m") || !strcmp(c->model, "effv2-l")) side = 480;
    else if (!strcmp(c->model, "effv2-t")) side = 64;
    c->height = c->width = side;
}

// A spec of items (--loss, --augment) fits its parser's buffer of `size` bytes, or is
// refused: cut short, it would lose items
static int spec_fits(const char *flag, const char *v, size_t size) {
    if (strlen(v) < size) return 1;
    fprintf(stderr, "segnet: %s '%.40s...' is %zu characters long, longer than %zu\n", flag, v,
            strlen(v), size - 1);
    return 0;
}

// --loss: terms `[W*]name` joined by +, each name once, W > 0 (a float, which may hold a +
// itself: config.txt writes 1e+06); kept in the menu's order (LOSS_NAMES: ce first, its op
// overwriting the logits' gradient, the others adding into it), whatever the order given,
// so that a run's loss has one spelling
static int parse_loss(const char *v, LossCfg *l) {
    l->n = 0;
    for (const char *item = v;;) {
        char *end, why[160];
        float w = 1.0f;
        strtod(item, &end);
        // a weight starts with a digit: "ce++2*dice" has an empty term, not a weight +2
        const int weighted =
                (isdigit((unsigned char)*item) || *item == '.') && end != item && *end == '*';
        const char *name = weighted ? end + 1 : item;
        const int len = (int)strcspn(name, "+"), item_len = (int)(name + len - item);
        const char *problem = weighted ? float_problem(item, &end, ABOVE_0, &w, why) : "";
        int k = 0;
        while (k < LOSS_KIND_COUNT &&
               (strncmp(name, LOSS_NAMES[k], (size_t)len) || LOSS_NAMES[k][len]))
            k++;
        if (!item_len) {
            fprintf(stderr, "segnet: --loss '%s': an empty term (terms are [W*]NAME joined by "
                    "single +)\n", v);
            return -1;
        }
        if (*problem) {
            fprintf(stderr, "segnet: --loss '%s': the weight of '%.*s' %s\n", v, item_len, item,
                    problem);
            return -1;
        }
        if (k == LOSS_KIND_COUNT) {
            fprintf(stderr, "segnet: --loss '%s': '%.*s' is not [W*]NAME with W > 0 and NAME one "
                    "of ce, focal, dice, jaccard, tversky, lovasz\n", v, item_len, item);
            return -1;
        }
        int at = l->n;
        while (at > 0 && l->kind[at - 1] >= (LossKind)k) at--;
        if (at < l->n && l->kind[at] == (LossKind)k) {
            fprintf(stderr, "segnet: --loss '%s': %s twice\n", v, LOSS_NAMES[k]);
            return -1;
        }
        for (int j = l->n; j > at; j--) {
            l->kind[j] = l->kind[j - 1];
            l->weight[j] = l->weight[j - 1];
        }
        l->kind[at] = (LossKind)k;
        l->weight[at] = w;
        l->n++;
        if (!name[len]) return 0;
        item = name + len + 1;
    }
}

#define AUGMENT_SCALE_MAX 8.0  // --augment scale=LO:HI: the largest zoom

static int parse_augment(const char *v, Augment *a) {
    memset(a, 0, sizeof *a);
    if (!strcmp(v, "none")) return 0;
    char buf[256];
    if (!spec_fits("--augment", v, sizeof buf)) return -1;
    snprintf(buf, sizeof buf, "%s", v);
    for (char *save = NULL, *item = strtok_r(buf, ",", &save); item;
         item = strtok_r(NULL, ",", &save)) {
        char *end;
        if (!strcmp(item, "flip")) a->flip = 1;
        else if (!strncmp(item, "brightness=", 11)) {
            a->brightness = strtof(item + 11, &end);
            if (item[11] == 0 || *end || !(a->brightness >= 0.0f && a->brightness <= 1.0f))
                goto bad;
        } else if (!strncmp(item, "contrast=", 9) || !strncmp(item, "scale=", 6) ||
                   !strncmp(item, "saturation=", 11)) {
            const int contrast = item[1] == 'o', scale = item[1] == 'c';
            float *lo = contrast ? &a->contrast_lo : scale ? &a->scale_lo : &a->saturation_lo,
                  *hi = contrast ? &a->contrast_hi : scale ? &a->scale_hi : &a->saturation_hi;
            char *v = strchr(item, '=') + 1;
            *lo = strtof(v, &end);
            if (*end != ':') goto bad;
            v = end + 1;
            *hi = strtof(v, &end);
            // contrast and scale: 0 < LO ≤ HI; saturation: 0 ≤ LO ≤ HI, HI > 0
            if (!*v || *end || !(*lo <= *hi && *hi > 0.0f && (*lo > 0.0f || !(contrast || scale))))
                goto bad;
            if (scale && *hi > AUGMENT_SCALE_MAX) goto bad;
        } else if (!strncmp(item, "rotate=", 7)) {
            a->rotate = strtof(item + 7, &end);
            if (item[7] == 0 || *end || !(a->rotate > 0.0f && a->rotate <= 180.0f)) goto bad;
        } else if (!strncmp(item, "hue=", 4)) {
            a->hue = strtof(item + 4, &end);
            if (item[4] == 0 || *end || !(a->hue > 0.0f && a->hue <= 0.5f)) goto bad;
        } else if (!strcmp(item, "vflip")) {
            a->vflip = 1;
        } else goto bad;
        continue;
    bad:
        fprintf(stderr,
                "segnet: --augment item '%s' must be flip, vflip, brightness=D (0..1), "
                "contrast=LO:HI (0 < LO ≤ HI), scale=LO:HI (0 < LO ≤ HI ≤ %g), rotate=DEG "
                "(0..180), hue=D (0..0.5) or saturation=LO:HI (0 ≤ LO ≤ HI)\n",
                item, AUGMENT_SCALE_MAX);
        return -1;
    }
    return 0;
}

// --device cpu|cuda|auto
static int parse_device(const char *v, Device *d) {
    for (int k = 0; k < 3; k++)
        if (!strcmp(v, DEVICE_NAMES[k])) { *d = (Device)k; return 0; }
    fprintf(stderr, "segnet: --device '%s' must be cpu, cuda or auto\n", v);
    return -1;
}

// --precision fp32|fp16|bf16 (train, eval's config, bench)
static int parse_precision(const char *v, DType *out) {
    for (int k = 0; k < 3; k++)
        if (!strcmp(v, DTYPE_NAMES[k])) { *out = (DType)k; return 0; }
    fprintf(stderr, "segnet: --precision '%s' must be fp32, fp16 or bf16\n", v);
    return -1;
}

// --checkpoint none|blocks (train, bench)
static int parse_checkpoint(const char *v, int *out) {
    if (!strcmp(v, "blocks")) { *out = 1; return 0; }
    if (!strcmp(v, "none")) { *out = 0; return 0; }
    fprintf(stderr, "segnet: --checkpoint '%s' must be none or blocks\n", v);
    return -1;
}

// "12G", "512M", "1.5G", or bytes
static int parse_bytes(const char *v, size_t *out) {
    char *end;
    double x = strtod(v, &end);
    double unit = !strcmp(end, "")        ? 1
                  : !strcasecmp(end, "K") ? 1024.0
                  : !strcasecmp(end, "M") ? 1048576.0
                  : !strcasecmp(end, "G") ? 1073741824.0
                                          : -1;
    if (end == v || unit < 0 || !(x > 0) || x * unit > 1e18) {
        fprintf(stderr,
                "segnet: --memory '%s' must be a size such as 12G, 512M or a number of bytes\n", v);
        return -1;
    }
    *out = (size_t)(x * unit);
    return 0;
}

typedef struct {
    TrainCfg c;
    const char *class_weights, *resume, *run;
    const char *monitor;  // --monitor's metric name as given (checked against the model)
    int weights_auto;     // --class-weights auto: from the training set's frequencies
    int size_given;
    size_t memory;      // --memory: pick the setting that fits (0: not given)
    int fixed;          // --checkpoint or --precision given
    char **kept;        // config.txt's words, which c points into; train_args_free frees them
    int n_kept;
} TrainArgs;

static void train_args_free(TrainArgs *a) {
    for (int i = 0; i < a->n_kept; i++) free(a->kept[i]);
    free(a->kept);
    a->kept = NULL;
    a->n_kept = 0;
}

// --ignore-index: comma-separated mask values 0..65535, added to those given before
static int parse_ignore_index(const char *v, MaskRules *m) {
    for (const char *s = v;;) {
        char *end;
        errno = 0;
        long x = strtol(s, &end, 10);
        if (end == s || (*end && *end != ',') || errno || x < 0 || x >= MASK_VALUES) {
            fprintf(stderr, "segnet: --ignore-index '%s': expected mask values 0..%d, "
                    "comma-separated\n", v, MASK_VALUES - 1);
            return -1;
        }
        int known = 0;
        for (int i = 0; i < m->n_ignore; i++) known |= m->ignore[i] == x;
        if (!known && m->n_ignore == SN_MAX_IGNORE) {
            fprintf(stderr, "segnet: --ignore-index: at most %d values\n", SN_MAX_IGNORE);
            return -1;
        }
        if (!known) m->ignore[m->n_ignore++] = (int32_t)x;
        if (!*end) return 0;
        s = end + 1;
    }
}

// the domains of the number options beyond "a float ≥ 0"
static const FloatRange
        RANGE_LR_FACTOR = {0.0f, 1.0f, 0, 1, "as Keras: the lr must go down"},
        RANGE_ADAM_EPS = {0.0f, FLT_MAX, 1, 0, "at 0 a weight whose gradient is always 0 gets 0/0"},
        RANGE_FOCAL_ALPHA = {0.0f, FLT_MAX, 1, 0, "at 0 the focal term and its gradient are 0"},
        RANGE_TVERSKY_GAMMA = {0.0f, FLT_MAX, 1, 0,
                               "its power of the loss: at 0 a constant 1, no gradient"};

// Parses one train/eval option at argv[i]. Returns the arguments consumed
// (0: unknown), -1 on error.
static int parse_train_option(TrainArgs *a, int argc, char **argv, int i) {
    TrainCfg *c = &a->c;
    const char *f = argv[i];
    a->size_given |= !strcmp(f, "--size");
    // switches; config.txt spells them `... = on|off`
    if (!strcmp(f, "--sync-bn") || !strcmp(f, "--train-eval") || !strcmp(f, "--loss-per-image") ||
        !strcmp(f, "--iou-per-image")) {
        int valued = i + 1 < argc && (!strcmp(argv[i + 1], "on") || !strcmp(argv[i + 1], "off"));
        int *sw = !strcmp(f, "--sync-bn")          ? &c->sync_bn
                  : !strcmp(f, "--train-eval")     ? &c->train_eval
                  : !strcmp(f, "--loss-per-image") ? &c->loss.per_image
                                                   : &c->iou_per_image;
        *sw = !valued || !strcmp(argv[i + 1], "on");
        return valued ? 2 : 1;
    }
    int k = parse_model_option(&c->model, argc, argv, i);
    if (k) return k;
    static const char *const FLAGS[] = {"--data",          "--val",
                                        "--out",           "--resume",
                                        "--weights",       "--class-weights",
                                        "--epochs",        "--lr",
                                        "--adam-eps",      "--weight-decay",
                                        "--clipnorm",      "--schedule",
                                        "--warmup",        "--early-stopping",
                                        "--augment",       "--seed",
                                        "--threads",       "--workers",
                                        "--loss-norm",     "--run",
                                        "--precision",     "--accum",
                                        "--freeze",        "--unfreeze-last",
                                        "--checkpoint",    "--memory",
                                        "--device",        "--replicas",
                                        "--allow-missing", "--monitor",
                                        "--min-delta",     "--max-pixels",
                                        "--log-every",     "--exif",
                                        "--ignore-index",  "--label-map",
                                        "--lr-factor",     "--lr-patience",
                                        "--min-lr",        "--lr-min-delta",
                                        "--loss",          "--loss-smooth",
                                        "--focal-gamma",   "--focal-alpha",
                                        "--tversky-alpha", "--tversky-beta",
                                        "--tversky-gamma"};
    int known = 0;
    for (size_t j = 0; j < sizeof FLAGS / sizeof *FLAGS; j++) known |= !strcmp(f, FLAGS[j]);
    if (!known) return 0;
    if (i + 1 >= argc) { fprintf(stderr, "segnet: %s needs a value\n", f); return -1; }
    const char *v = argv[i + 1];
    int rc = 0, seed;
    a->fixed |= !strcmp(f, "--checkpoint") || !strcmp(f, "--precision");
    if (!strcmp(f, "--data")) c->data = v;
    else if (!strcmp(f, "--memory")) rc = parse_bytes(v, &a->memory);
    else if (!strcmp(f, "--device")) rc = parse_device(v, &c->device);
    else if (!strcmp(f, "--val")) c->val = v;
    else if (!strcmp(f, "--out")) c->out = v;
    else if (!strcmp(f, "--resume")) a->resume = v;
    else if (!strcmp(f, "--run")) a->run = v;
    else if (!strcmp(f, "--weights")) c->weights = v;
    else if (!strcmp(f, "--allow-missing")) c->allow_missing = v;
    else if (!strcmp(f, "--class-weights")) a->class_weights = v;
    else if (!strcmp(f, "--label-map")) c->masks.label_map = v;
    else if (!strcmp(f, "--ignore-index")) rc = parse_ignore_index(v, &c->masks);
    else if (!strcmp(f, "--epochs")) rc = parse_int(f, v, 1, 1 << 20, &c->epochs);
    else if (!strcmp(f, "--warmup")) rc = parse_int(f, v, 0, 1 << 30, &c->warmup);
    else if (!strcmp(f, "--early-stopping")) rc = parse_int(f, v, 0, 1 << 20, &c->patience);
    else if (!strcmp(f, "--min-delta")) rc = parse_number(f, v, AT_LEAST_0, &c->min_delta);
    else if (!strcmp(f, "--lr-factor"))
        rc = parse_number(f, v, RANGE_LR_FACTOR, &c->plateau.factor);
    else if (!strcmp(f, "--lr-patience"))
        rc = parse_int(f, v, 1, 1 << 20, &c->plateau.patience);
    else if (!strcmp(f, "--min-lr")) rc = parse_number(f, v, AT_LEAST_0, &c->plateau.min_lr);
    else if (!strcmp(f, "--lr-min-delta"))
        rc = parse_number(f, v, AT_LEAST_0, &c->plateau.min_delta);
    else if (!strcmp(f, "--loss")) rc = parse_loss(v, &c->loss);
    else if (!strcmp(f, "--loss-smooth")) rc = parse_number(f, v, AT_LEAST_0, &c->loss.smooth);
    else if (!strcmp(f, "--focal-gamma"))
        rc = parse_number(f, v, AT_LEAST_0, &c->loss.focal_gamma);
    else if (!strcmp(f, "--focal-alpha"))
        rc = parse_number(f, v, RANGE_FOCAL_ALPHA, &c->loss.focal_alpha);
    else if (!strcmp(f, "--tversky-alpha"))
        rc = parse_number(f, v, AT_LEAST_0, &c->loss.tversky_alpha);
    else if (!strcmp(f, "--tversky-beta"))
        rc = parse_number(f, v, AT_LEAST_0, &c->loss.tversky_beta);
    else if (!strcmp(f, "--tversky-gamma"))
        rc = parse_number(f, v, RANGE_TVERSKY_GAMMA, &c->loss.tversky_gamma);
    else if (!strcmp(f, "--monitor")) {
        if (!strcmp(v, "val_loss")) c->monitor_metric = 0;
        else if (!strcmp(v, "val_mIoU") || !strcmp(v, "val_accuracy") || !strcmp(v, "val_dice")) {
            c->monitor_metric = strcmp(v, "val_dice") ? 1 : 2;
            a->monitor = v;
        } else {
            fprintf(stderr,
                    "segnet: --monitor '%s' must be val_loss, val_mIoU, val_dice or val_accuracy\n",
                    v);
            rc = -1;
        }
    }
    else if (!strcmp(f, "--threads")) rc = parse_int(f, v, 1, 4096, &c->threads);
    else if (!strcmp(f, "--max-pixels")) rc = parse_max_pixels(f, v);
    else if (!strcmp(f, "--exif")) rc = parse_exif(f, v);
    else if (!strcmp(f, "--workers")) rc = parse_int(f, v, 1, 256, &c->workers);
    else if (!strcmp(f, "--accum")) rc = parse_int(f, v, 1, SN_MAX_ACCUM, &c->accum);
    else if (!strcmp(f, "--log-every")) rc = parse_int(f, v, 0, 1 << 30, &c->log_every);
    else if (!strcmp(f, "--replicas")) rc = parse_int(f, v, 1, SN_MAX_REPLICAS, &c->replicas);
    else if (!strcmp(f, "--unfreeze-last")) rc = parse_int(f, v, 0, 1 << 20, &c->unfreeze_last);
    else if (!strcmp(f, "--checkpoint")) rc = parse_checkpoint(v, &c->checkpoint);
    else if (!strcmp(f, "--freeze")) {
        if (!strcmp(v, "base")) c->freeze_base = 1;
        else if (!strcmp(v, "none")) c->freeze_base = 0;
        else { fprintf(stderr, "segnet: --freeze '%s' must be base or none\n", v); rc = -1; }
    } else if (!strcmp(f, "--precision"))
        rc = parse_precision(v, &c->precision);
    else if (!strcmp(f, "--seed")) {
        rc = parse_int(f, v, 0, 2147483647, &seed);
        c->seed = (uint64_t)seed;
    } else if (!strcmp(f, "--lr"))
        rc = parse_number(f, v, AT_LEAST_0, &c->lr);
    else if (!strcmp(f, "--adam-eps")) rc = parse_number(f, v, RANGE_ADAM_EPS, &c->adam_eps);
    else if (!strcmp(f, "--weight-decay")) rc = parse_number(f, v, AT_LEAST_0, &c->weight_decay);
    else if (!strcmp(f, "--clipnorm")) rc = parse_number(f, v, AT_LEAST_0, &c->clipnorm);
    else if (!strcmp(f, "--augment")) rc = parse_augment(v, &c->augment);
    else if (!strcmp(f, "--schedule")) {
        int k = 0;
        while (k < 4 && strcmp(v, SCHEDULE_NAMES[k])) k++;
        if (k < 4) c->schedule = (Schedule)k;
        else {
            fprintf(stderr, "segnet: --schedule '%s' must be constant, cosine, poly or plateau\n",
                    v);
            rc = -1;
        }
    } else {  // --loss-norm
        if (!strcmp(v, "weighted")) c->loss_norm_keras = 0;
        else if (!strcmp(v, "keras")) c->loss_norm_keras = 1;
        else {
            fprintf(stderr, "segnet: --loss-norm '%s' must be weighted or keras\n", v);
            rc = -1;
        }
    }
    return rc ? -1 : 2;
}

// K comma-separated weights, each a float ≥ 0
static int parse_class_weights(const char *v, int K, float *w) {
    int n = 0;
    for (const char *s = v;; n++) {
        char *end, why[160];
        float x;
        const char *problem = float_problem(s, &end, AT_LEAST_0, &x, why);
        if (*end && *end != ',') problem = "is not a number";
        if (*problem) {
            fprintf(stderr, "segnet: --class-weights '%s': item %d %s\n", v, n + 1, problem);
            return -1;
        }
        if (n < K) w[n] = x;
        if (!*end) { n++; break; }
        s = end + 1;
    }
    if (n != K) {
        fprintf(stderr, "segnet: --class-weights has %d values but there are %d classes\n", n, K);
        return -1;
    }
    return 0;
}

// RUN/config.txt as options: every `key = value` line is `--key value`.
static int read_run_config(TrainArgs *a, const char *run) {
    char path[4200], line[4096];
    snprintf(path, sizeof path, "%s/config.txt", run);
    char err[SN_ERR_MAX];
    FILE *f = fopen_regular(path, "r", err);
    if (!f) {
        char line1[SN_ERR_MAX + 32];
        snprintf(line1, sizeof line1, "%s (not a run folder?)", err);
        print_message(stderr, "segnet", line1);
        return -1;
    }
    int rc = 0;
    for (int row = 1; rc == 0 && fgets(line, sizeof line, f); row++) {
        line[strcspn(line, "\r\n")] = 0;
        if (!line[0] || line[0] == '#') continue;
        char *eq = strstr(line, " = ");
        if (!eq) {
            fprintf(stderr, "segnet: %s: line %d: expected `key = value`\n", path, row);
            rc = -1;
            break;
        }
        *eq = 0;
        char flag[256];
        snprintf(flag, sizeof flag, "--%.200s", line);
        char **grown = realloc(a->kept, sizeof(char *) * (size_t)(a->n_kept + 2));
        snCheck(grown != NULL, "out of host memory");
        a->kept = grown;
        char *argv2[2] = {strdup(flag), strdup(eq + 3)};  // kept: the config points into them
        snCheck(argv2[0] && argv2[1], "out of host memory");
        a->kept[a->n_kept++] = argv2[0];
        a->kept[a->n_kept++] = argv2[1];
        int k = parse_train_option(a, 2, argv2, 0);
        if (k == 0) fprintf(stderr, "segnet: %s: line %d: unknown setting '%s'\n", path, row, line);
        if (k <= 0) rc = -1;
    }
    fclose(f);
    a->size_given = 1;
    return rc;
}

// Parses train/eval arguments (argv[2..]); `usage` is printed for --help.
// Returns 0, 1 after --help, -1 on error.
static int parse_train_args(TrainArgs *a, int argc, char **argv, const char *cmd,
                            const char *usage) {
    train_cfg_default(&a->c);
    a->c.device = DEVICE_AUTO;
    for (int i = 2; i < argc;) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(usage, stdout);
            return 1;
        }
        int k = parse_train_option(a, argc, argv, i);
        if (k < 0) return -1;
        if (k == 0) {
            fprintf(stderr, "segnet %s: unknown option '%s' (see segnet %s --help)\n", cmd, argv[i],
                    cmd);
            return -1;
        }
        i += k;
    }
    const char *base = a->resume ? a->resume : a->run;
    if (base) {  // the run's settings first, then the command line's on top
        TrainArgs cli = *a;
        train_cfg_default(&a->c);
        a->c.device = DEVICE_AUTO;  // a config.txt written before --device existed
        a->class_weights = NULL;
        if (read_run_config(a, base)) return -1;
        const MaskRules run_masks = a->c.masks;
        for (int i = 2, k; i < argc; i += k)
            if ((k = parse_train_option(a, argc, argv, i)) <= 0) return -1;
        // --ignore-index adds to the run's list: a resumed run that would add one is refused
        // here, naming what was given (before the data are read with the longer list)
        if (a->resume && a->c.masks.n_ignore != run_masks.n_ignore) {
            SfBuf given = {0}, was = {0};
            ignore_text(&cli.c.masks, &given);
            ignore_text(&run_masks, &was);
            sb_put(&given, "", 1);
            sb_put(&was, "", 1);
            snCheck(!given.oom && !was.oom, "out of host memory");
            fprintf(stderr, "segnet %s: --ignore-index %s, but the run was trained with %s: it "
                    "defines the loss that best.safetensors is judged by, so it stays for the "
                    "whole run\n", cmd, given.p, was.p);
            free(given.p);
            free(was.p);
            return -1;
        }
        a->resume = cli.resume; a->run = cli.run;
    }
    if (!a->size_given) model_default_size(&a->c.model);
    if (a->c.model.classes > SN_MAX_CLASSES) {
        fprintf(stderr, "segnet %s: at most %d classes\n", cmd, SN_MAX_CLASSES);
        return -1;
    }
    if (a->monitor && strcmp(a->monitor, monitor_name(&a->c))) {
        fprintf(stderr, "segnet %s: --monitor %s: model '%s' reports %s\n", cmd, a->monitor,
                a->c.model.model, monitor_name(&a->c));
        return -1;
    }
    const LossCfg *l = &a->c.loss;
    if (loss_has(l, LOSS_TVERSKY) && l->tversky_alpha == 0.0f && l->tversky_beta == 0.0f) {
        fprintf(stderr, "segnet %s: --tversky-alpha 0 with --tversky-beta 0: the tversky score "
                "is then 1 whatever the prediction (no gradient); give one above 0\n", cmd);
        return -1;
    }
    a->weights_auto = a->class_weights && !strcmp(a->class_weights, "auto");
    if (a->class_weights && !a->weights_auto) {
        if (parse_class_weights(a->class_weights, a->c.model.classes, a->c.class_weights))
            return -1;
        a->c.class_weights_given = 1;
    }
    return 0;
}

// ---- BLAS kernels as wide as the CPU's vectors
//
// Debian's OpenBLAS (built for every x86-64 core) picks its kernels when it
// loads, from the CPU's family and model numbers. A model it does not know
// gets its oldest x86-64 kernels ("Prescott", SSE3): 0.3.21 on a virtual
// Xeon of model 207 (Emerald Rapids, AVX-512) did, and make bench's unet-64
// step took 4x as long as with the AVX-512 kernels ("SkylakeX"). OpenBLAS
// reads OPENBLAS_CORETYPE in a constructor, as libgomp reads its variables,
// so when the user did not set it and OpenBLAS chose kernels narrower than
// the CPU's vectors, segnet names the matching ones in the same restart.
static int name_in(const char *name, const char *const *names) {
    for (; *names; names++)
        if (!strcasecmp(name, *names)) return 1;
    return 0;
}

// the OpenBLAS core to name instead of `chosen` on this CPU, or NULL when
// `chosen` is as wide as its vectors
static const char *blas_core_for_cpu(const char *chosen) {
#if defined(__x86_64__) && defined(__GNUC__)
    static const char *const AVX512[] = {"SkylakeX", "Cooperlake", "SapphireRapids", NULL};
    static const char *const AVX2[] = {"Haswell", "Zen",        "SkylakeX",
                                       "Cooperlake", "SapphireRapids", NULL};
    __builtin_cpu_init();
    if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
        __builtin_cpu_supports("avx512dq") && __builtin_cpu_supports("avx512vl"))
        return name_in(chosen, AVX512) ? NULL : AVX512[0];
    if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma"))
        return name_in(chosen, AVX2) ? NULL : AVX2[0];
#else
    (void)chosen;
#endif
    return NULL;
}

// Sets OPENBLAS_CORETYPE when the user did not and OpenBLAS's choice is narrower
// than the CPU (for the next start: the caller starts again); 1 if it did. The
// tests' program does the same, so that a run in it and one of ./segnet give
// the same bits.
static int blas_core_default(void) {
    const char *chosen = openblas_get_corename();
    const char *core = getenv("OPENBLAS_CORETYPE") || !chosen ? NULL : blas_core_for_cpu(chosen);
    return core && setenv("OPENBLAS_CORETYPE", core, 0) == 0;
}

#ifndef TESTING

static const char *USAGE =
    "segnet: train U-Net segmentation and EfficientNetV2 classification models\n"
    "\n"
    "usage: segnet COMMAND [options]\n"
    "\n"
    "commands:\n"
    "  plan      print a model's stages and the memory a training step takes;\n"
    "            --memory 12G picks the fastest setting that fits\n"
    "  predict   run a trained model on images: class rows (CSV) for a classifier,\n"
    "            mask and overlay PNGs for a segmentation model\n"
    "  train     train a model and write a run folder (no options: the quickstart\n"
    "            on the bundled data/, as `make train`)\n"
    "  eval      print a model's validation loss and metrics on a data set\n"
    "  export    write a run's weights for PyTorch (torchvision, timm or smp names)\n"
    "  bench     time training steps on synthetic data (segnet bench --help)\n"
    "  augment   write the augmented samples a run would train on, to look at\n"
    "  info      print the build: backend, BLAS, threads\n"
    "  help      this text (also --help, -h); segnet COMMAND --help for a command\n"
    "\n"
    "The test suite is `make test`; see README.md.\n";

static void print_shape(Shape s) {
    char buf[64];
    snprintf(buf, sizeof buf, "(%d,%d,%d,%d)", s.n, s.h, s.w, s.c);
    printf("%-22s", buf);
}

static const char *TRAIN_USAGE =
    "usage: segnet train --data TRAIN --classes K [options]\n"
    "       segnet train --resume RUN [options that override RUN/config.txt, e.g. --epochs]\n"
    "       segnet train              (no options: the quickstart, see below)\n"
    "\n"
    "Trains a model and writes a run folder: config.txt (every setting),\n"
    "metrics.csv (one row per epoch), curves.svg, last.safetensors (weights, BN\n"
    "statistics, Adam moments, step) after every epoch and best.safetensors for\n"
    "the epoch with the lowest val_loss (loss without --val). metrics.csv has the\n"
    "loss and metrics (segmentation: mIoU, pixel_accuracy, IoU_<class>), then the\n"
    "epoch's optimisation diagnostics: grad_norm_mean, grad_norm_max (the\n"
    "global gradient norm before clipping, over the applied steps), clip_fraction\n"
    "(steps that --clipnorm scaled down), loss_scale (fp16, after the epoch),\n"
    "skipped_steps (fp16 overflow: no update), update_ratio (|dw|/|w| of the\n"
    "trainable weights in the epoch's last step) and step_ms, then (segmentation)\n"
    "dice and Dice_<class> (F1 = 2·TP/(2·TP + FP + FN)); curves.svg draws\n"
    "them, and warnings name what to change when clipping acts on most steps,\n"
    "overflow skips steps, or the train metric falls below the validation one.\n"
    "Files are replaced\n"
    "atomically; a run folder that holds another run's files is never\n"
    "overwritten (unless --overwrite), and one run at a time writes it\n"
    "(RUN/.lock). Ctrl-C, SIGTERM, SIGHUP (the terminal closed) or SIGPIPE (the\n"
    "reader of its output gone): the step ends, last.safetensors keeps the place\n"
    "inside the epoch, --resume RUN goes on from it exactly (exit 128 + the\n"
    "signal: 130 for Ctrl-C); a second Ctrl-C stops at once. A model that is no\n"
    "longer finite (NaN or inf in a weight, a batch-norm statistic or Adam's\n"
    "moments) stops the run with exit 1, naming the tensor; it is never saved.\n"
    "\n"
    "Data: segmentation models (unet, unet-effv2-*) read DIR/images/*.{png,jpg}\n"
    "with DIR/masks/*.png of the same name (pixel = class index: grey of 1 to 16\n"
    "bits or a palette PNG's index, as Pascal VOC's); classifiers (effv2-*) read a\n"
    "CSV `path,label` (an optional header `path,label`) or one sub-folder per class.\n"
    "\n"
    "  --model NAME          unet (default), unet-effv2-s|m|l|t, effv2-s|m|l|t\n"
    "  --data TRAIN          training data (required)\n"
    "  --val VAL             validation data (default: none)\n"
    "  --classes K           number of classes (required)\n"
    "  --class-weights LIST  K comma-separated weights ≥ 0 (default all 1); weight 0\n"
    "                        ignores a class, e.g. 0 = \"not annotated\"; auto:\n"
    "                        median-frequency balancing over the training set (w_c =\n"
    "                        median freq / freq_c, freq_c = pixels of c / pixels of\n"
    "                        the masks holding c), printed and kept in config.txt\n"
    "  --ignore-index V      mask value V (comma-separated or repeated, up to 16) marks\n"
    "                        a pixel that counts nothing: not in the loss, its\n"
    "                        normaliser, the gradients or the metrics (VOC's and\n"
    "                        Cityscapes' void: 255)\n"
    "  --label-map FILE      CSV `value,class`: the class of each mask value (e.g.\n"
    "                        Cityscapes' labelIds to trainIds); a value it does not\n"
    "                        list is an error; --ignore-index applies to the class\n"
    "  --loss-norm MODE      weighted (default): Σ w·nll / Σ w over the batch;\n"
    "                        keras: Keras' loss, p[y] clipped to [1e-7, 1-1e-7] before\n"
    "                        the log (no gradient where clipped), Σ w·nll / pixels\n"
    "  --loss SPEC           terms [W*]NAME joined by + (default ce), e.g. ce+dice,\n"
    "                        1*focal+1*dice, kept in this order: ce, focal, dice,\n"
    "                        jaccard, tversky, lovasz. ce: the weighted cross-entropy;\n"
    "                        focal: segmentation_models' CategoricalFocalLoss, Σ w_y·\n"
    "                        α(1-p_y)^γ·(-log p_y) / K over the same normaliser, p_y\n"
    "                        clipped to [1e-7, 1-1e-7] (--focal-gamma 2, --focal-alpha\n"
    "                        0.25); dice, jaccard, tversky: soft scores over the\n"
    "                        global batch per class, S = (a·I + s)/(a·I + α·FP +\n"
    "                        β·FN + s) with I = Σp·[y=c], FP = Σp - I, FN = Σ[y=c] - I\n"
    "                        (dice a = 2, α = β = 1; jaccard a = α = β = 1; tversky\n"
    "                        a = 1, --tversky-alpha 0.5, --tversky-beta 0.5), loss\n"
    "                        (Σ_c w_c·(1 - S_c) / Σ_c w_c)^γ, Σ over every class: one\n"
    "                        absent from the masks adds 0 above but keeps its w_c\n"
    "                        below (γ: --tversky-gamma, else 1), as\n"
    "                        segmentation_models_pytorch; --loss-smooth s (1e-5);\n"
    "                        lovasz: the Lovász-softmax (segmentation_models_pytorch's\n"
    "                        LovaszLoss): per class present, the errors |[y=c] - p_c|\n"
    "                        sorted, dotted with the Jaccard loss's Lovász gradient,\n"
    "                        then Σ_c w_c·L_c / Σ_c w_c over the classes present\n"
    "  --loss-per-image      dice/jaccard/tversky/lovasz per image, averaged over the\n"
    "                        batch (segmentation_models' per_image); without it, over\n"
    "                        the global batch (with --accum, a forward of every micro-\n"
    "                        batch first sums them: one more forward per micro-batch;\n"
    "                        lovasz over the batch: one replica, no --accum)\n"
    "  --size HxW            input size, images are resized to it (default: unet\n"
    "                        256x256, effv2-s 384x384, effv2-m/l 480x480, effv2-t 64x64)\n"
    "  --batch B             images per step (default 8)\n"
    "  --epochs E            (default 10)\n"
    "  --lr LR               Adam learning rate (default 0.001)\n"
    "  --adam-eps EPS        Keras' epsilon-hat (default 1e-07)\n"
    "  --weight-decay WD     decoupled weight decay, AdamW (default 0)\n"
    "  --clipnorm C          clip the gradient's global norm to C (default 0: off)\n"
    "  --schedule S          constant (default), cosine (decays to 0 at the end), poly\n"
    "                        (lr·(1 - p)^0.9 over the steps after warm-up, DeepLab's)\n"
    "                        or plateau (Keras' ReduceLROnPlateau on the --monitor\n"
    "                        value, cooldown 0: after --lr-patience epochs (default\n"
    "                        10) without an improvement by more than --lr-min-delta\n"
    "                        (1e-4), lr × --lr-factor (0.1, below 1), not below\n"
    "                        --min-lr (0))\n"
    "  --warmup STEPS        linear warm-up steps (default 0)\n"
    "  --early-stopping P    stop when the monitored value has not improved for P\n"
    "                        epochs (default 0: off; needs --val)\n"
    "  --monitor M           what early stopping and best.safetensors watch: val_loss\n"
    "                        (default), val_mIoU or val_dice (segmentation: mean\n"
    "                        Dice, the F1 score) or val_accuracy (classification);\n"
    "                        without --val the training values\n"
    "  --iou-per-image       mIoU and val_mIoU as the mean over the images of each\n"
    "                        one's mean IoU, (TP + 1e-5)/(TP + FP + FN + 1e-5) per\n"
    "                        class of weight > 0 (segmentation_models'\n"
    "                        IOUScore(per_image=True) of the argmax); the per-class\n"
    "                        IoU_k stay over the whole epoch\n"
    "  --min-delta D         an epoch improves only by more than D (default 0), as\n"
    "                        Keras' EarlyStopping(min_delta)\n"
    "  --augment LIST        none (default) or any of, comma-separated: flip,\n"
    "                        brightness=D, contrast=LO:HI (tf.image semantics);\n"
    "                        also vflip, scale=LO:HI (zoom by s ~ U[LO,HI], then a\n"
    "                        random crop of --size; a mask follows its image, by\n"
    "                        nearest neighbour, and pixels outside the image are\n"
    "                        ignored), rotate=DEG, hue=D and\n"
    "                        saturation=LO:HI (tf.image.adjust_hue/_saturation).\n"
    "                        segnet augment shows what the network sees\n"
    "  --weights W           initial weights (safetensors, torchvision or timm\n"
    "                        names); a classifier's head may differ in classes or\n"
    "                        be absent; a unet-effv2-* takes its encoder from an\n"
    "                        EfficientNetV2 classifier's weights (decoder and head\n"
    "                        initialised, the classifier's head ignored); one line\n"
    "                        `weights: ...` reports what was loaded\n"
    "  --allow-missing P     with --weights: tensors whose names start with P\n"
    "                        (comma-separated prefixes) may be absent from the file\n"
    "                        or of another shape and are initialised\n"
    "  --out RUN             run folder (default runs/<date>-<time>); one that holds\n"
    "                        another run's files is refused\n"
    "  --overwrite           start a new run in --out RUN, replacing the files of the\n"
    "                        run there (checkpoints, metrics, settings)\n"
    "  --resume RUN          continue RUN from its last.safetensors; the result\n"
    "                        equals an uninterrupted run bit for bit\n"
    "  --precision P         activation storage: fp32 (default), fp16 (dynamic loss\n"
    "                        scaling as Keras: from 2^15, halve and skip the update on\n"
    "                        inf/NaN, double after 2000 finite steps) or bf16; weights\n"
    "                        and Adam state stay fp32\n"
    "  --accum K             K micro-batches of --batch images per optimiser step; the\n"
    "                        loss is normalised over the whole step (default 1)\n"
    "  --memory SIZE         e.g. 12G: choose --batch/--accum (keeping the global batch),\n"
    "                        --checkpoint and --precision so that the run fits, as\n"
    "                        segnet plan --memory does\n"
    "  --checkpoint MODE     none (default) or blocks: keep only each block's inputs in\n"
    "                        the forward and recompute the block before its backward\n"
    "                        (less memory, the same result bit for bit)\n"
    "  --freeze base         train only the head/decoder: the backbone (EfficientNetV2\n"
    "                        trunk, U-Net encoder) is frozen, its BN in inference mode\n"
    "                        (default none)\n"
    "  --unfreeze-last N     with --freeze base, also train the backbone's last N blocks\n"
    "  --replicas N          N data-parallel replicas in this process, each on B/N\n"
    "                        images of every batch B (under `mpirun -np N`: one per\n"
    "                        process); loss, gradients and metrics are those of the\n"
    "                        global batch, so N does not change the result\n"
    "  --sync-bn             batch norm statistics over the global batch (fp64 sums,\n"
    "                        all-reduced): N replicas then train as one does; without\n"
    "                        it each replica normalises its own shard (Keras)\n"
    "  --log-every N         every N optimiser steps a row of steps.csv in the run\n"
    "                        folder: step, epoch, lr, loss and the diagnostics below\n"
    "                        over those N steps (default 0: none)\n"
    "  --train-eval          at each epoch's end, measure the training set again in\n"
    "                        inference mode (as the validation set is) for the train\n"
    "                        columns; without it they are measured while training\n"
    "                        (dropout on, batch norm with batch statistics)\n"
    "  --seed S              initialisation, data order, augmentation, dropout (default 1)\n"
    "  --device D            auto (default: the GPU if there is one, else the CPU,\n"
    "                        saying so), cuda or cpu\n"
    "  --threads T           CPU threads (default: all cores; shared by --replicas)\n"
    "  --workers N           data loading threads (default: the cores but one, at\n"
    "                        least 1); batches are the same for any N\n"
    "  --max-pixels N        refuse an image whose header declares more than N pixels\n"
    "                        (default " TEXT_OF(IMAGE_MAX_PIXELS_DEFAULT) "), before decoding it\n"
    "  --exif MODE           a JPEG's EXIF orientation (a phone's turned photos): ignore\n"
    "                        (default: the pixels as stored, as tf.image and Keras) or\n"
    "                        apply (as displayed: the view masks are drawn on); kept\n"
    "                        in config.txt for --resume, eval --run and predict --run\n"
    "  --padding MODE        EfficientNetV2 convs: same or symmetric; default: as the\n"
    "                        --weights were trained (torchvision names symmetric,\n"
    "                        timm's SAME, segnet's recorded), else same\n"
    "  --head-hidden H       classifier hidden layer width (default 0: none); the\n"
    "                        seed's Keras head GAP → Dropout 0.2 → Dense 128 ReLU →\n"
    "                        Dropout 0.2 → Dense K is --head-hidden 128 --dropout 0.2\n"
    "  --dropout R           the classifier head's dropout rate (both dropouts with\n"
    "                        --head-hidden; default torchvision's: effv2-s 0.2,\n"
    "                        effv2-m 0.3, effv2-l 0.4)\n"
    "  --depth D, --width W  unet levels below the top (default 4), channels at the top (32)\n"
    "  --bottleneck B        unet-effv2-*: where the decoder starts at stride 32: head\n"
    "                        (default: the encoder's 1×1 head conv, 1280 channels, as a\n"
    "                        classifier's features) or stage (the last stage's output:\n"
    "                        segmentation_models_pytorch's Unet on a timm tu- encoder;\n"
    "                        see segnet export --names smp)\n"
    "\n"
    "The quickstart (`segnet train` with no options, or `make train`, from the\n"
    "repository root) is:\n"
    "  segnet train " QUICKSTART_ARGS "\n";

static const char *EVAL_USAGE =
        "usage: segnet eval --run RUN [--data VAL]\n"
        "       segnet eval --weights W.safetensors --model NAME --classes K --data VAL [options]\n"
        "\n"
        "Evaluates weights on a data set and prints one metric per line, `name: value`:\n"
        "val_loss, then val_mIoU, val_pixel_accuracy, val_dice, val_IoU_<class> and\n"
        "val_Dice_<class> (segmentation) or val_accuracy (classification). With --run,\n"
        "the run's config.txt gives the model and class weights, best.safetensors the\n"
        "weights and its validation set the data (unless --data is given). Otherwise\n"
        "the model options are those of\n"
        "segnet train (--model, --classes, --class-weights, --ignore-index,\n"
        "--label-map, --size, --padding, ...).\n"
        "  --batch B    images per forward pass (default: with --run the run's batch,\n"
        "               else 8); the region terms of val_loss (dice, jaccard, tversky,\n"
        "               lovasz) are computed per batch, so val_loss depends on B (the\n"
        "               metrics do not)\n"
        "  --device D   auto (default), cuda or cpu, as for segnet train\n"
        "  --threads T  CPU threads\n"
        "  --max-pixels N  the largest image, width × height (default " TEXT_OF(
                IMAGE_MAX_PIXELS_DEFAULT) ")\n"
                                          "  --exif MODE     ignore or apply a JPEG's EXIF "
                                          "orientation, as for segnet\n"
                                          "                  train (default: the run's, else "
                                          "ignore)\n";

// --memory: choose the setting, print what was tried and picked; -1 if nothing fits
static int pick_setting(TrainArgs *a, const char *cmd, FILE *out) {
    if (a->fixed) {
        fprintf(stderr,
                "segnet %s: --memory chooses --checkpoint and --precision; leave them out\n", cmd);
        return -1;
    }
    char why[8192], err[SN_ERR_MAX];
    int global = a->c.model.batch * a->c.accum,
        rc = choose_setting(&a->c, a->memory, why, sizeof why, err);
    fprintf(out, "settings tried for %.2f GiB, global batch %d:\n%s", a->memory / 1073741824.0,
            global, why);
    if (rc) {
        char who[64];
        snprintf(who, sizeof who, "segnet %s", cmd);
        print_message(stderr, who, err);
        return -1;
    }
    fprintf(out, "picked: --batch %d --accum %d --precision %s --checkpoint %s\n", a->c.model.batch,
            a->c.accum, DTYPE_NAMES[a->c.precision], a->c.checkpoint ? "blocks" : "none");
    return 0;
}

static int has_flag(int argc, char **argv, const char *flag) {
    for (int i = 2; i < argc; i++) if (!strcmp(argv[i], flag)) return 1;
    return 0;
}

// An option on the command line that does nothing for the model is refused
// (a run would record it as if it did): the classifier head's for a U-Net,
// the plain unet's levels and channels for the others, the masks' for a classifier,
// the EfficientNetV2 U-Net's bottleneck for the others.
static int model_options_used(const char *cmd, const char *model, int argc, char **argv) {
    // head: 1 the classifier head's, 0 the plain unet's, 2 the masks' (segmentation),
    // 3 the unet-effv2-*'s
    static const struct { const char *flag; int head; } OWN[] = {
        {"--head-hidden", 1}, {"--dropout", 1},      {"--depth", 0},     {"--width", 0},
        {"--ignore-index", 2}, {"--label-map", 2}, {"--bottleneck", 3}};
    for (size_t k = 0; k < sizeof OWN / sizeof *OWN; k++) {
        if (!has_flag(argc, argv, OWN[k].flag)) continue;
        if (OWN[k].head == 2 && model_is_classifier(model))
            fprintf(stderr,
                    "segnet %s: %s: model '%s' is a classifier (an option of segmentation "
                    "masks)\n",
                    cmd, OWN[k].flag, model);
        else if (OWN[k].head == 1 && !model_is_classifier(model))
            fprintf(stderr,
                    "segnet %s: %s: model '%s' has no classifier head (an option of the "
                    "classifiers, effv2-*)\n",
                    cmd, OWN[k].flag, model);
        else if (OWN[k].head == 0 && strcmp(model, "unet"))
            fprintf(stderr,
                    "segnet %s: %s: model '%s' does not use it (the levels and channels of the "
                    "plain unet)\n",
                    cmd, OWN[k].flag, model);
        else if (OWN[k].head == 3 && strncmp(model, "unet-effv2-", 11))
            fprintf(stderr,
                    "segnet %s: %s: model '%s' does not use it (the decoder's start in the "
                    "unet-effv2-* models)\n",
                    cmd, OWN[k].flag, model);
        else
            continue;
        return -1;
    }
    return 0;
}

// SIGINT, SIGTERM, SIGHUP (the terminal or ssh session closed) and SIGPIPE
// (the reader of stdout or stderr gone, as `| head` does) set interrupt_signal
// (see run_pass): the step finishes and the run saves. A second SIGINT, SIGTERM
// or SIGHUP exits at once. SIGPIPE comes again with every write to the broken
// pipe: those writes fail (EPIPE) and the progress they carried is dropped.
static void on_interrupt(int sig) {
    if (sig == SIGPIPE) {
        if (!interrupt_signal) interrupt_signal = sig;
        return;
    }
    if (interrupt_signal && interrupt_signal != SIGPIPE) _exit(128 + sig);
    interrupt_signal = sig;
    static const char msg[] =
            "\nsegnet train: stopping after this step to save the run (again to stop at once)\n";
    ssize_t n = write(STDERR_FILENO, msg, sizeof msg - 1);
    (void)n;
}

// fn handles SIGINT, SIGTERM, SIGHUP and, with n_signals 4, SIGPIPE
static void signals_install(void (*fn)(int), int flags, int n_signals) {
    struct sigaction sa;
    memset(&sa, 0, sizeof sa);
    sa.sa_handler = fn;
    sa.sa_flags = flags;
    sigemptyset(&sa.sa_mask);
    static const int signals[] = {SIGINT, SIGTERM, SIGHUP, SIGPIPE};
    for (int k = 0; k < n_signals; k++) sigaction(signals[k], &sa, NULL);
}

// reads and writes in progress go on (SA_RESTART)
static void interrupt_handlers_install(void) { signals_install(on_interrupt, SA_RESTART, 4); }

// the temporary file being written (safetensors.c's tmp_track) removed, exit 128 + sig
static void tmp_cleanup_signal(int sig) {
    const int slot = __atomic_load_n(&tmp_live, __ATOMIC_ACQUIRE);
    if (slot >= 0) unlink(tmp_slots[slot]);
    _exit(128 + sig);
}

// export, predict, augment: SIGINT, SIGTERM and SIGHUP end the command at once, leaving no
// temporary file (a broken pipe does not concern their files)
static void tmp_cleanup_install(void) { signals_install(tmp_cleanup_signal, 0, 3); }

// A command's arguments, which hold the words of a run's config.txt when it
// reads one (--run, --resume): freed after the command, whatever it returns.
static int with_train_args(int (*cmd)(TrainArgs *, int, char **), int argc, char **argv) {
    TrainArgs a = {0};
    int rc = cmd(&a, argc, argv);
    train_args_free(&a);
    return rc;
}

static const char *AUGMENT_USAGE =
        "usage: segnet augment --data DIR --model NAME --classes K --augment LIST --out OUT\n"
        "                      [-n N] [--epoch E] [options of segnet train]\n"
        "       segnet augment --run RUN --out OUT [-n N] [--epoch E]\n"
        "\n"
        "Writes what the network sees: the first N samples of DIR (default 16, in the\n"
        "data set's order) as epoch E (default 1) of a run with these settings\n"
        "resizes and augments them, into the folder OUT (created if missing):\n"
        "OUT/aug<E>-<i>-<stem>.png (E and i zero-padded to the digits of the run's\n"
        "epochs and of N - 1), the image (values clipped to 0..255), and for a\n"
        "segmentation model OUT/aug<E>-<i>-<stem>_overlay.png, its mask's class colours\n"
        "blended 50/50 (pixels that count nothing, outside the image or\n"
        "--ignore-index, left as they are). With --run, the run's config.txt gives\n"
        "the settings (its training data unless --data). An existing file is never\n"
        "replaced, and OUT is never DIR or inside it (a later run would read its\n"
        "files as samples).\n";

// segnet augment: -n and --epoch are its own; the rest goes to train's parser
static int cmd_augment(TrainArgs *a, int argc, char **argv) {
    int n = 16, epoch = 1;
    char **rest = malloc(sizeof(char *) * (size_t)argc);
    snCheck(rest != NULL, "out of host memory");
    int m = 0, rc = 0;
    for (int i = 0; i < argc && rc == 0; i++) {
        const int own = i >= 2 && (!strcmp(argv[i], "-n") || !strcmp(argv[i], "--epoch"));
        if (!own) { rest[m++] = argv[i]; continue; }
        if (i + 1 >= argc) {
            fprintf(stderr, "segnet augment: %s needs a value\n", argv[i]);
            rc = 2;
        } else if (parse_int(argv[i], argv[i + 1], 1, 1 << 20,
                             !strcmp(argv[i], "-n") ? &n : &epoch)) {
            rc = 2;
        }
        i++;
    }
    if (rc == 0) {
        const int p = parse_train_args(a, m, rest, "augment", AUGMENT_USAGE);
        rc = p > 0 ? 0 : p < 0 ? 2 : -1;
    }
    free(rest);
    if (rc >= 0) return rc;
    if (!a->c.data || !a->c.out) {
        fprintf(stderr, "segnet augment: --data (or --run) and --out are required (see segnet "
                        "augment --help)\n");
        return 2;
    }
    char err[SN_ERR_MAX];
    tmp_cleanup_install();
    if (augment_write(&a->c, a->c.out, n, epoch, err)) {
        print_message(stderr, "segnet augment", err);
        return 1;
    }
    fprintf(stderr, "segnet augment: wrote %s\n", a->c.out);
    return 0;
}

// --loss's constants name the terms they are for: one given without its term
// is a mistake (a usage error naming it)
static int loss_flags_check(const LossCfg *l, int argc, char **argv) {
    int has[LOSS_KIND_COUNT] = {0};
    for (int j = 0; j < l->n; j++) has[l->kind[j]] = 1;
    const int region = has[LOSS_DICE] || has[LOSS_JACCARD] || has[LOSS_TVERSKY];
    const struct { const char *flag; int ok; const char *terms; } flags[] = {
            {"--loss-per-image", region || has[LOSS_LOVASZ], "dice, jaccard, tversky and lovasz"},
            {"--loss-smooth", region, "dice, jaccard and tversky"},
            {"--focal-gamma", has[LOSS_FOCAL], "focal"},
            {"--focal-alpha", has[LOSS_FOCAL], "focal"},
            {"--tversky-alpha", has[LOSS_TVERSKY], "tversky"},
            {"--tversky-beta", has[LOSS_TVERSKY], "tversky"},
            {"--tversky-gamma", has[LOSS_TVERSKY], "tversky"},
    };
    for (size_t k = 0; k < sizeof flags / sizeof *flags; k++)
        if (!flags[k].ok && has_flag(argc, argv, flags[k].flag)) {
            fprintf(stderr, "segnet train: %s applies to --loss %s, which the loss has not\n",
                    flags[k].flag, flags[k].terms);
            return -1;
        }
    return 0;
}

static int cmd_train(TrainArgs *a, int argc, char **argv) {
    char *quick[64], words[] = QUICKSTART_ARGS;
    int quickstart = argc == 2;
    if (quickstart) {  // `segnet train` alone: the bundled data set
        quick[0] = argv[0]; quick[1] = argv[1];
        argc = 2;
        for (char *save = NULL, *w = strtok_r(words, " ", &save); w && argc < 64;
             w = strtok_r(NULL, " ", &save))
            quick[argc++] = w;
        argv = quick;
    }
    // train's own switch (eval shares the other options): taken out before parsing
    int overwrite = 0;
    for (int i = 2; i < argc; i++)
        if (!strcmp(argv[i], "--overwrite")) {
            overwrite = 1;
            memmove(&argv[i], &argv[i + 1], sizeof(char *) * (size_t)(argc - i - 1));
            argc--; i--;
        }
    int p = parse_train_args(a, argc, argv, "train", TRAIN_USAGE);
    if (p) return p > 0 ? 0 : 2;
    if (model_options_used("train", a->c.model.model, argc, argv)) return 2;
    if (loss_flags_check(&a->c.loss, argc, argv)) return 2;
    a->c.overwrite = overwrite;
    if (a->resume && (a->c.out || overwrite)) {
        fprintf(stderr, "segnet train: --resume %s continues the run in its own folder; %s\n",
                a->resume,
                overwrite ? "--overwrite starts a new run (give --out instead of --resume)"
                          : "--out would be another one (a new run from its weights: --weights "
                            "RUN/best.safetensors --out NEW)");
        return 2;
    }
    if (!a->resume && (!a->c.data || !has_flag(argc, argv, "--classes"))) {
        fprintf(stderr,
                "segnet train: --data and --classes are required (see segnet train --help)\n");
        return 2;
    }
    if (quickstart)
        fprintf(stderr, "segnet train: the quickstart: segnet train %s\n", QUICKSTART_ARGS);
    char err[SN_ERR_MAX], note[SN_ERR_MAX];
    if (!a->resume && padding_follow_weights(&a->c.model, a->c.weights, "train", note, err)) {
        print_message(stderr, "segnet train", err);
        return 1;
    }
    a->c.weights_note = note;
    if (a->memory && !a->resume && pick_setting(a, "train", stderr)) return 1;
    if (a->weights_auto && a->resume) {
        fprintf(stderr, "segnet train: --class-weights auto: a resumed run keeps the weights in "
                        "its config.txt\n");
        return 2;
    }
    if (a->weights_auto) {  // the numbers go into config.txt: a resumed run keeps them
        TrainCfg *c = &a->c;
        if (class_weights_median_frequency(c->data, !model_is_classifier(c->model.model),
                                           c->model.classes, c->model.height, c->model.width,
                                           &c->masks, c->class_weights, err)) {
            print_message(stderr, "segnet train", err);
            return 1;
        }
        c->class_weights_given = 1;
        fprintf(stderr, "segnet train: --class-weights auto (median frequency over %s): ", c->data);
        char f[32];
        for (int k = 0; k < c->model.classes; k++)
            fprintf(stderr, "%s%s", k ? "," : "", float_str(f, c->class_weights[k]));
        fputc('\n', stderr);
    }
    interrupt_handlers_install();
    const int rc = train_run(&a->c, a->resume, err);
    if (rc < 0) { print_message(stderr, "segnet train", err); return 1; }
    return rc;  // 0, or 128 + the signal that interrupted it (130 SIGINT, 143 SIGTERM)
}

static int cmd_eval(TrainArgs *a, int argc, char **argv) {
    int p = parse_train_args(a, argc, argv, "eval", EVAL_USAGE);
    if (p) return p > 0 ? 0 : 2;
    if (model_options_used("eval", a->c.model.model, argc, argv)) return 2;
    char weights[4200];
    if (a->run) snprintf(weights, sizeof weights, "%s/best.safetensors", a->run);
    else if (a->c.weights) snprintf(weights, sizeof weights, "%s", a->c.weights);
    else {
        fprintf(stderr, "segnet eval: give --run RUN, or --weights W with the model options (see "
                        "segnet eval --help)\n");
        return 2;
    }
    char err[SN_ERR_MAX], note[SN_ERR_MAX];
    if (!a->run && padding_follow_weights(&a->c.model, weights, "eval", note, err)) {
        print_message(stderr, "segnet eval", err);
        return 1;
    }
    const char *data = a->c.val;
    for (int i = 2; i + 1 < argc; i++) if (!strcmp(argv[i], "--data")) data = argv[i + 1];
    if (!data) { fprintf(stderr, "segnet eval: --data VAL is required\n"); return 2; }
    a->c.augment = (Augment){0};
    a->c.progress = isatty(STDERR_FILENO);
    EvalResult r;
    double iou[SN_MAX_CLASSES], dice[SN_MAX_CLASSES];
    r.m.iou = iou;
    r.m.dice = dice;
    if (eval_run(&a->c, weights, data, &r, err)) {
        print_message(stderr, "segnet eval", err);
        return 1;
    }
    printf("val_loss: %.6f\n", r.loss);
    if (model_is_classifier(a->c.model.model)) {
        printf("val_accuracy: %.6f\n", r.m.accuracy);
        return 0;
    }
    printf("val_mIoU: %.6f\nval_pixel_accuracy: %.6f\nval_dice: %.6f\n", r.m.mean_iou,
           r.m.accuracy, r.m.mean_dice);
    for (int k = 0; k < a->c.model.classes; k++)
        if (!isnan(iou[k])) printf("val_IoU_%d: %.6f\n", k, iou[k]);
    for (int k = 0; k < a->c.model.classes; k++)
        if (!isnan(dice[k])) printf("val_Dice_%d: %.6f\n", k, dice[k]);
    return 0;
}

static const char *PREDICT_USAGE =
        "usage: segnet predict --run RUN --input DIR_OR_CSV --out OUT [options]\n"
        "       segnet predict --model NAME --classes K --weights W.safetensors\n"
        "                      --input DIR_OR_CSV --out OUT [options]\n"
        "\n"
        "With --run, the run's config.txt gives the model options (model, classes,\n"
        "size, padding, ...) and RUN/best.safetensors the weights (--last:\n"
        "last.safetensors); options given as well override them.\n"
        "\n"
        "Predicts every image of a folder (*.png, *.jpg, *.jpeg, sorted by name) or of\n"
        "a CSV's first column (paths relative to the CSV; a header 'path' is skipped).\n"
        "Images of the model's input size are used as they are; others are resized\n"
        "(bilinear) for the forward pass.\n"
        "\n"
        "Classifiers (effv2-*): OUT is a CSV with one row per image,\n"
        "path,pred,p0,...,p{K-1} (softmax probabilities); with --run of a run whose\n"
        "classes have names (class folders, text labels: RUN/classes.txt) also\n"
        "pred_name after pred. It is replaced only when every image was read.\n"
        "\n"
        "Segmentation models (unet, unet-effv2-*): OUT is a folder, created if missing,\n"
        "that receives for each image OUT/<stem>.png, the mask (8-bit grey, pixel =\n"
        "predicted class 0..K-1), and OUT/<stem>_overlay.png, the image blended 50/50\n"
        "with a colour per class, both at the image's own size (the mask is brought\n"
        "back by nearest neighbour); OUT/" SEG_LEGEND_NAME " shows each class's colour beside its\n"
        "number. The colours:\n" SEG_PALETTE_HELP
        "Every image is decoded, and no two may share a stem, before anything is\n"
        "written; each PNG is written atomically. A failure while writing (disk\n"
        "full) leaves the PNGs written before it. OUT/" PREDICT_MANIFEST " lists the files\n"
        "predict has written into OUT.\n"
        "\n"
        "Nothing the user owns is replaced: OUT may not be, or lie inside, the input\n"
        "folder; an input image or list is never replaced (whatever its path); an\n"
        "existing file only with --overwrite, and then only one that an earlier\n"
        "segnet predict wrote (listed in OUT/" PREDICT_MANIFEST ", or a CSV starting\n"
        "with its header).\n"
        "Progress goes to stderr: one line rewritten on a terminal, else a line per\n"
        "tenth of the images; with --tile, an image of more than a pass of tiles also\n"
        "shows its tile rows done (a line per tenth of them in a log). Without --tile,\n"
        "the first image of more than 4 times the model's pixels is named in a line:\n"
        "it is resized to the model's size, and --tile predicts at its own size.\n"
        "\n"
        "  --overwrite         replace the outputs of an earlier segnet predict into OUT\n"
        "  --tile HxW          segmentation at the image's own resolution: the model runs\n"
        "                      on HxW tiles (sides multiples of 2^depth for unet, of 32\n"
        "                      for unet-effv2-*) covering the\n"
        "                      image, whose class probabilities are blended with a\n"
        "                      Gaussian weight (σ = tile/8, nnU-Net's) that trusts a\n"
        "                      tile's centre over its borders; 4 tiles a pass, so the\n"
        "                      device memory is that of 4 tiles whatever the image\n"
        "  --overlap F         with --tile: neighbouring tiles overlap by at least this\n"
        "                      fraction of a tile (default 0.5, at most 0.875)\n"
        "  --tta flip          with --tile: also predict each tile mirrored left-right\n"
        "                      and average the two (default none)\n"
        "  --scale S           with --tile: predict the image resized by S (bilinear; e.g.\n"
        "                      0.5 for a model trained on half-resolution images), the\n"
        "                      probabilities resized back: the mask is at the image's\n"
        "                      size (default 1)\n"
        "  --probs             with --tile: also OUT/<stem>_probs.safetensors, the\n"
        "                      blended class probabilities, tensor \"probs\" (H,W,K) fp16\n"
        "  --model NAME        effv2-s (default), effv2-m, effv2-l, effv2-t, unet,\n"
        "                      unet-effv2-s, unet-effv2-m, unet-effv2-l, unet-effv2-t\n"
        "  --weights W         safetensors in PyTorch layout (segnet, torchvision or timm\n"
        "                      names); training checkpoints load as they are\n"
        "  --padding MODE      same (Keras/TF weights) or symmetric (torchvision); default:\n"
        "                      as the weights were trained (their names or metadata), else same\n"
        "  --size HxW          input size (default: effv2-s 384x384, effv2-m/l 480x480,\n"
        "                      effv2-t 64x64, U-Nets 256x256)\n"
        "  --batch B           images per forward pass (default 8)\n"
        "  --head-hidden H     the classifier's hidden layer, as trained (default 0)\n"
        "  --depth D           unet levels below the top, as trained (default 4)\n"
        "  --width W           unet channels at the top level, as trained (default 32)\n"
        "  --bottleneck B      unet-effv2-*: head (default) or stage, as trained\n"
        "  --device D          auto (default), cuda or cpu, as for segnet train\n"
        "  --threads T         CPU threads (default: all cores)\n"
        "  --max-pixels N      the largest image, width × height (default " TEXT_OF(
                IMAGE_MAX_PIXELS_DEFAULT) ")\n"
                                          "  --exif MODE         ignore (default; with --run: the "
                                          "run's) or apply a JPEG's EXIF\n"
                                          "                      orientation, as for segnet train; "
                                          "the outputs are of the\n"
                                          "                      image as read\n";

#define PREDICT_SCALE_MAX 4.0  // predict --scale: the largest factor
// predict --overlap: tiles at least σ = tile/8 apart (tile_gaussian), where the Gaussian
// weights of the tiles over a pixel already sum to nearly the same everywhere
#define PREDICT_OVERLAP_MAX 0.875

static int cmd_predict(TrainArgs *ta, int argc, char **argv) {
    PredictCfg pc = {.model = model_cfg_default(), .progress = 1, .device = DEVICE_AUTO,
                     .overlap = 0.5f};
    int tile_h = 0, tile_w = 0, tile_option_given = 0;
    pc.model.model = "effv2-s";
    pc.model.batch = 8;
    int size_given = 0, classes_given = 0, last = 0;
    const char *run = NULL;
    char run_weights[4200];
    for (int i = 2; i + 1 < argc; i++) if (!strcmp(argv[i], "--run")) run = argv[i + 1];
    if (run) {  // the run's model settings first, then the command line's on top
        train_cfg_default(&ta->c);
        if (read_run_config(ta, run)) return 2;
        pc.model = ta->c.model;  // pointing into ta's words
        if (pc.model.pad_given) pc.model.pad_given = PAD_RUN;
        pc.model.batch = 8;
        size_given = classes_given = 1;
    }
    for (int i = 2; i < argc;) {
        const char *f = argv[i];
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) { fputs(PREDICT_USAGE, stdout); return 0; }
        if (!strcmp(f, "--last")) { last = 1; i++; continue; }
        if (!strcmp(f, "--overwrite")) { pc.overwrite = 1; i++; continue; }
        if (!strcmp(f, "--probs")) { pc.probs = 1; i++; continue; }
        if (!strcmp(f, "--tile") || !strcmp(f, "--overlap") || !strcmp(f, "--tta") ||
            !strcmp(f, "--scale")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "segnet predict: %s needs a value\n", f);
                return 2;
            }
            const char *v = argv[i + 1];
            int rc = 0;
            if (!strcmp(f, "--tile")) {
                rc = parse_size(f, v, &tile_h, &tile_w);
                pc.tiled = 1;
            } else if (!strcmp(f, "--overlap")) {
                rc = parse_number(f, v, AT_LEAST_0, &pc.overlap);
                if (!rc && !(pc.overlap <= PREDICT_OVERLAP_MAX)) {
                    fprintf(stderr,
                            "segnet predict: --overlap %s: at most %g (tiles 1/8 of a tile "
                            "apart, the blend's σ; closer ones multiply the tiles by "
                            "1/(1 - F)² and change nothing)\n",
                            v, PREDICT_OVERLAP_MAX);
                    rc = -1;
                }
                tile_option_given = 1;
            } else if (!strcmp(f, "--scale")) {
                rc = parse_number(f, v, AT_LEAST_0, &pc.scale);
                if (!rc && !(pc.scale > 0.0f && pc.scale <= PREDICT_SCALE_MAX)) {
                    fprintf(stderr, "segnet predict: --scale %s must be in (0, %g]\n", v,
                            PREDICT_SCALE_MAX);
                    rc = -1;
                }
                tile_option_given = 1;
            } else if (!strcmp(v, "flip")) {
                pc.tta_flip = 1;
            } else if (strcmp(v, "none")) {
                fprintf(stderr, "segnet predict: --tta '%s' must be flip or none\n", v);
                rc = -1;
            }
            if (rc) return 2;
            i += 2;
            continue;
        }
        if (!strcmp(f, "--run")) { i += 2; continue; }
        if (!strcmp(f, "--max-pixels") || !strcmp(f, "--exif")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "segnet predict: %s needs a value\n", f);
                return 2;
            }
            if ((!strcmp(f, "--exif") ? parse_exif : parse_max_pixels)(f, argv[i + 1])) return 2;
            i += 2;
            continue;
        }
        if (!strcmp(f, "--threads")) {
            int threads;
            if (i + 1 >= argc || parse_int(f, argv[i + 1], 1, 4096, &threads)) {
                if (i + 1 >= argc) fprintf(stderr, "segnet predict: --threads needs a value\n");
                return 2;
            }
            set_threads(threads);
            i += 2;
            continue;
        }
        const char **target = !strcmp(f, "--weights") ? &pc.weights
                              : !strcmp(f, "--input") ? &pc.input
                              : !strcmp(f, "--out")   ? &pc.out
                                                      : NULL;
        if (target) {
            if (i + 1 >= argc) {
                fprintf(stderr, "segnet predict: %s needs a value\n", f);
                return 2;
            }
            *target = argv[i + 1];
            i += 2;
            continue;
        }
        if (!strcmp(f, "--device")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "segnet predict: --device needs a value\n");
                return 2;
            }
            if (parse_device(argv[i + 1], &pc.device)) return 2;
            i += 2;
            continue;
        }
        size_given |= !strcmp(f, "--size");
        classes_given |= !strcmp(f, "--classes");
        int k = parse_model_option(&pc.model, argc, argv, i);
        if (k < 0) return 2;
        if (k == 0) {
            fprintf(stderr, "segnet predict: unknown option '%s' (see segnet predict --help)\n", f);
            return 2;
        }
        i += k;
    }
    if (run && !pc.weights) {
        snprintf(run_weights, sizeof run_weights, "%s/%s.safetensors", run, last ? "last" : "best");
        pc.weights = run_weights;
    }
    if (run) pc.n_class_names = read_class_names(run, &pc.class_names);
    if (!pc.weights || !pc.input || !pc.out || !classes_given) {
        fprintf(stderr, "segnet predict: --input, --out and either --run RUN or --weights and "
                        "--classes are required "
                        "(see segnet predict --help)\n");
        return 2;
    }
    if (!size_given) model_default_size(&pc.model);
    if (model_options_used("predict", pc.model.model, argc, argv)) return 2;
    if ((tile_option_given || pc.tta_flip || pc.probs) && !pc.tiled) {
        fprintf(stderr, "segnet predict: --overlap, --scale, --tta and --probs work on tiles: give "
                        "--tile HxW\n");
        return 2;
    }
    if (pc.tiled) {  // the model runs on tiles: its input is a tile
        pc.model.height = tile_h;
        pc.model.width = tile_w;
        pc.model.batch = 4;
    }
    char err[SN_ERR_MAX], note[SN_ERR_MAX];
    if (padding_follow_weights(&pc.model, pc.weights, "predict", note, err)) {
        print_message(stderr, "segnet predict", err);
        return 1;
    }
    if (note[0]) print_message(stderr, "segnet predict", note);
    tmp_cleanup_install();  // a signal leaves no temporary file behind
    const int rc = predict_run(&pc, err);
    for (int k = 0; k < pc.n_class_names; k++) free(pc.class_names[k]);
    free(pc.class_names);
    if (rc != 0) { print_message(stderr, "segnet predict", err); return 1; }
    fprintf(stderr, "segnet predict: wrote %s\n", pc.out);
    return 0;
}

static const char *EXPORT_USAGE =
    "usage: segnet export --run RUN --out FILE.safetensors [--names N] [--best|--last]\n"
    "                     [--overwrite]\n"
    "\n"
    "Writes a run's weights and batch-norm statistics, without the optimiser\n"
    "state: best.safetensors (--last: last.safetensors), for PyTorch. The run is\n"
    "read while no segnet train writes it (RUN/.lock). FILE is new, or with\n"
    "--overwrite an earlier export; never a run's own file or anything else.\n"
    "  --names torchvision  (default) torchvision's names with batch norm's\n"
    "                       num_batches_tracked: load_state_dict(strict=True) into\n"
    "                       torchvision.models.efficientnet_v2_s/m/l(num_classes=K).\n"
    "                       With --head-hidden the head is classifier.1 and\n"
    "                       classifier.4: nn.Sequential(Dropout, Linear, ReLU,\n"
    "                       Dropout, Linear). A unet-effv2-* has its encoder in\n"
    "                       torchvision's names (features.*) and its decoder as\n"
    "                       ref/parity_live.py's UNetEff, which loads it strictly\n"
    "                       (--bottleneck head);\n"
    "                       a plain unet loads into ref/segnet_unet.py's\n"
    "                       SegnetUNet(classes=K, depth=D, width=W).\n"
    "  --names timm         timm's tf_efficientnetv2_s/m/l (EfficientNetV2\n"
    "                       classifiers without --head-hidden)\n"
    "  --names smp          segmentation_models_pytorch 0.6's names: a unet-effv2-s/m/l\n"
    "                       trained with --bottleneck stage --padding same loads with\n"
    "                       load_state_dict(strict=True) into smp.Unet(encoder_name=\n"
    "                       \"tu-tf_efficientnetv2_s\" (_m, _l), encoder_weights=None,\n"
    "                       classes=K), whose input is RGB 0..255 as x/128 - 1\n"
    "  --names segnet       segnet's names only (segnet --weights reads all four)\n"
    "The padding the weights were trained with is in the file's metadata.\n";

static int cmd_export(TrainArgs *ta, int argc, char **argv) {
    const char *run = NULL, *out = NULL;
    int last = 0, overwrite = 0;
    ExportNames names = EXPORT_TORCHVISION;
    for (int i = 2; i < argc; i++) {
        const char *f = argv[i];
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) { fputs(EXPORT_USAGE, stdout); return 0; }
        if (!strcmp(f, "--last") || !strcmp(f, "--best")) { last = !strcmp(f, "--last"); continue; }
        if (!strcmp(f, "--overwrite")) { overwrite = 1; continue; }
        if (strcmp(f, "--run") && strcmp(f, "--out") && strcmp(f, "--names")) {
            fprintf(stderr, "segnet export: unknown option '%s' (see segnet export --help)\n", f);
            return 2;
        }
        if (i + 1 >= argc) { fprintf(stderr, "segnet export: %s needs a value\n", f); return 2; }
        const char *v = argv[++i];
        if (!strcmp(f, "--run")) run = v;
        else if (!strcmp(f, "--out")) out = v;
        else {
            int k = 0;
            while (k < EXPORT_KINDS && strcmp(v, EXPORT_NAMES[k])) k++;
            if (k == EXPORT_KINDS) {
                fprintf(stderr,
                        "segnet export: --names '%s' must be torchvision, timm, smp or segnet\n",
                        v);
                return 2;
            }
            names = (ExportNames)k;
        }
    }
    if (!run || !out) {
        fprintf(stderr, "segnet export: --run RUN and --out FILE are required (see segnet export "
                        "--help)\n");
        return 2;
    }
    train_cfg_default(&ta->c);
    if (read_run_config(ta, run)) return 2;
    char err[SN_ERR_MAX], report[SN_ERR_MAX];
    tmp_cleanup_install();
    if (export_run(&ta->c.model, run, last, names, out, overwrite, report, err)) {
        print_message(stderr, "segnet export", err);
        return 1;
    }
    print_message(stderr, "segnet export", report);
    if (names == EXPORT_TORCHVISION && ta->c.model.pad == PAD_SAME &&
        model_is_effnet(ta->c.model.model))
        fprintf(stderr, "segnet export: note: the run pads as TensorFlow ('same'), torchvision's "
                        "EfficientNetV2 (and "
                        "UNetEff) symmetrically: there these weights give other outputs. For "
                        "torchvision, train with --padding "
                        "symmetric; timm's tf_efficientnetv2_* pads as 'same' (--names timm)\n");
    return 0;
}

static const char *BENCH_USAGE =
    "usage: segnet bench --model NAME [--size HxW] [--batch B] [--steps S] [options]\n"
    "\n"
    "Times S training steps of segnet train (forward, softmax cross-entropy,\n"
    "backward, fp16 loss scaling, Adam) on synthetic data (random images 0..255,\n"
    "random labels, every class weight 1; the batch ready to travel as the loader\n"
    "makes it: 8-bit images and the labels in the backend's host memory) after\n"
    "warm-up steps, and prints\n"
    "  train_step_ms: X     median over the S steps\n"
    "  host_ms_per_step: H  median of the host's time outside the step's device work:\n"
    "                       before the batch's upload is queued (the loss normaliser,\n"
    "                       the arguments) and after the step's one wait\n"
    "  images_per_s: Y      batch / median step\n"
    "  peak_rss_bytes: Z    the process's peak resident memory (getrusage)\n"
    "  peak_device_bytes: D the backend's peak allocation (the GPU's with --device cuda)\n"
    "ref/bench_torch.py runs the same in PyTorch; `make bench` compares the two.\n"
    "\n"
    "With --loader DATA it times the data loader alone instead: S batches of B\n"
    "images of DATA (a training set; --model says whether it is one of\n"
    "segmentation), decoded, resized to --size, augmented (--augment) and batched\n"
    "on --workers threads, nothing cached, after W batches, and prints\n"
    "  loader_ms_per_batch: X, loader_images_per_s: Y\n"
    "ref/bench_loader_torch.py runs PyTorch's DataLoader on the same; `make bench`'s\n"
    "loader row compares them.\n"
    "\n"
    "  --model NAME        unet (default), effv2-s|m|l|t, unet-effv2-s|m|l|t\n"
    "  --size HxW          input size (defaults as segnet train)\n"
    "  --batch B           images per step (default 4)\n"
    "  --steps S           timed steps (default 5)\n"
    "  --warmup W          untimed steps first (default 1)\n"
    "  --threads T         CPU threads (default: all cores)\n"
    "  --profile           also print the time per op kind per step (forward,\n"
    "                      backward) and GFLOP/s of the convs\n"
    "  --kernels N         also print the N CUDA kernels with the most device time\n"
    "                      per step (CUDA events around each launch; steps run op\n"
    "                      by op, not as a recorded graph), with the GB/s and\n"
    "                      TFLOP/s of the bytes and FLOPs their launches declare\n"
    "  --precision P       activation storage: fp32 (default), fp16 or bf16\n"
    "  --checkpoint C      none (default) or blocks: recompute each block in backward\n"
    "  --seed S            initialisation and data (default 1)\n"
    "  --loss SPEC         the loss and its constants (--loss-per-image, ...), as for\n"
    "                      segnet train (default ce)\n"
    "  --loader DATA       time the loader on DATA (above); --workers N (default as\n"
    "                      segnet train), --augment LIST, --ignore-index,\n"
    "                      --label-map, --exif, --max-pixels as for segnet train\n"
    "  --device D          auto (default), cuda or cpu, as for segnet train\n"
    "  --classes K, --padding MODE, --head-hidden H, --depth D, --width W,\n"
    "  --bottleneck B      the model, as for segnet train\n";

static int cmd_bench(int argc, char **argv) {
    // the model and the options bench shares with train are read by train's parser, into a
    // TrainCfg as for every command; --steps, --warmup (untimed steps) and --profile are its own
    static const char *const SHARED[] = {"--threads",   "--precision", "--checkpoint",
                                         "--seed",      "--device",    "--workers",
                                         "--augment",   "--exif",      "--max-pixels",
                                         "--ignore-index", "--label-map", "--loss",
                                         "--loss-per-image", "--loss-smooth", "--focal-gamma",
                                         "--focal-alpha", "--tversky-alpha", "--tversky-beta",
                                         "--tversky-gamma"};
    TrainArgs a = {0};
    train_cfg_default(&a.c);
    a.c.model.batch = 4;
    a.c.device = DEVICE_AUTO;
    BenchCfg c = {.steps = 5, .warmup = 1};
    for (int i = 2; i < argc;) {
        const char *f = argv[i];
        if (!strcmp(f, "--help") || !strcmp(f, "-h")) { fputs(BENCH_USAGE, stdout); return 0; }
        if (!strcmp(f, "--loader")) {
            if (i + 1 >= argc) {
                fprintf(stderr, "segnet bench: --loader needs a value\n");
                return 2;
            }
            a.c.data = argv[i + 1];
            i += 2;
            continue;
        }
        if (!strcmp(f, "--profile")) { c.profile = 1; i++; continue; }
        if (!strcmp(f, "--steps") || !strcmp(f, "--warmup") || !strcmp(f, "--kernels")) {
            if (i + 1 >= argc) { fprintf(stderr, "segnet bench: %s needs a value\n", f); return 2; }
            int *v = !strcmp(f, "--steps") ? &c.steps : !strcmp(f, "--warmup") ? &c.warmup
                                                                                : &c.kernels;
            if (parse_int(f, argv[i + 1], v != &c.warmup, 1 << 20, v)) return 2;
            i += 2;
            continue;
        }
        int shared = 0;
        for (size_t j = 0; j < sizeof SHARED / sizeof *SHARED; j++) shared |= !strcmp(f, SHARED[j]);
        a.size_given |= !strcmp(f, "--size");
        int k = parse_model_option(&a.c.model, argc, argv, i);
        if (k == 0 && shared) k = parse_train_option(&a, argc, argv, i);
        if (k < 0) return 2;
        if (k == 0) {
            fprintf(stderr, "segnet bench: unknown option '%s' (see segnet bench --help)\n", f);
            return 2;
        }
        i += k;
    }
    if (!a.size_given) model_default_size(&a.c.model);
    c.model = a.c.model;
    c.threads = a.c.threads;
    c.precision = a.c.precision;
    c.checkpoint = a.c.checkpoint;
    c.seed = a.c.seed;
    c.loss = a.c.loss;
    c.device = a.c.device;
    if (model_options_used("bench", c.model.model, argc, argv)) return 2;
    char err[SN_ERR_MAX];
    if (a.c.data) {
        LoaderBench lb = {.batches = c.steps, .warmup = c.warmup};
        if (bench_loader(&a.c, &lb, err)) { print_message(stderr, "segnet bench", err); return 1; }
        printf("loader: %s  %d images  batch %d at %dx%d  workers %d  augment ", a.c.data,
               lb.images, a.c.model.batch, a.c.model.height, a.c.model.width, a.c.workers);
        SfBuf aug = {0};
        augment_text(&a.c.augment, &aug);
        sb_put(&aug, "", 1);
        printf("%s\nloader_ms_per_batch: %.3f\nloader_images_per_s: %.2f\n", aug.p ? aug.p : "",
               lb.ms_per_batch, lb.images_per_s);
        free(aug.p);
        return 0;
    }
    BenchResult r;
    if (bench_run(&c, &r, err)) { print_message(stderr, "segnet bench", err); return 1; }
    printf("model: %s  input (%d,%d,%d,3)  classes %d  parameters %zu  threads %d  backend %s\n",
           c.model.model, c.model.batch, c.model.height, c.model.width, c.model.classes, r.n_params,
           r.threads, r.backend);
    if (c.profile) {
        double total = 0.0;
        for (int k = 0; k < BK_COUNT; k++) total += r.kind_fwd_ms[k] + r.kind_bwd_ms[k];
        printf("%-12s %10s %10s %10s %7s %9s\n", "op kind", "fwd ms", "bwd ms", "total ms", "share",
               "GFLOP/s");
        for (int k = 0; k < BK_COUNT; k++) {
            double t = r.kind_fwd_ms[k] + r.kind_bwd_ms[k];
            printf("%-12s %10.2f %10.2f %10.2f %6.1f%%", BENCH_KIND_NAMES[k], r.kind_fwd_ms[k],
                   r.kind_bwd_ms[k], t, total > 0.0 ? 100.0 * t / total : 0.0);
            if (r.kind_gflop[k] > 0.0 && t > 0.0) printf(" %9.1f", r.kind_gflop[k] / (1e-3 * t));
            printf("\n");
        }
        printf("%-12s %10s %10s %10.2f   (the profiled steps; the median step may differ)\n", "sum",
               "", "", total);
    }
    if (c.kernels > 0) {
        double total = 0.0;
        for (int k = 0; k < r.n_kernels && k < BENCH_KERNEL_ROWS; k++) total += r.kernel_rows[k].ms;
        printf("%-72s %9s %9s %7s %8s %8s  (per step; %d kernels%s)\n", "kernel", "launches", "ms",
               "share", "GB/s", "TFLOP/s", r.n_kernels,
               r.n_kernels > BENCH_KERNEL_ROWS ? ", the share of the first 64" : "");
        // GB/s, TFLOP/s: what the launches declare they move and compute, over their device time
        for (int k = 0; k < c.kernels && k < r.n_kernels && k < BENCH_KERNEL_ROWS; k++) {
            const KernelTimeRow *row = &r.kernel_rows[k];
            const double s = 1e-3 * row->ms;
            printf("%-72.72s %9.1f %9.3f %6.1f%% %8.1f %8.2f\n", row->name,
                   (double)row->launches / c.steps, row->ms / c.steps,
                   total > 0.0 ? 100.0 * row->ms / total : 0.0,
                   s > 0.0 ? row->bytes / s / 1e9 : 0.0, s > 0.0 ? row->flops / s / 1e12 : 0.0);
        }
        printf("%-72s %9s %9.3f   (kernels' device time; train_step_ms below is the host's)\n",
               "sum", "", total / c.steps);
    }
    printf("train_step_ms: %.2f\n", r.step_ms);
    printf("host_ms_per_step: %.3f\n", r.host_ms);
    printf("images_per_s: %.3f\n", r.images_per_s);
    printf("peak_rss_bytes: %zu\n", r.peak_rss_bytes);
    printf("peak_device_bytes: %zu\n", r.peak_device_bytes);
    return 0;
}

static int cmd_info(void) {
    printf("backend: %s\n", ops_cpu.name);
    const Backend *b = DEVICE_BACKEND;
    char why[SN_ERR_MAX];
    size_t free_b, total_b;
    if (!b) {
        printf("cuda: not built (no nvcc)\n");
    } else if (b->memory_info(0, &free_b, &total_b, why) == 0) {
        // what the device holds beyond segnet's own allocations: the driver's
        // context (and other processes' memory, if any share the device)
        size_t held = total_b - free_b, ours = b->bytes_live(),
               driver = held > ours ? held - ours : 0;
        const Ops *o = b->ops_for_device(0, why);  // device 0's table, opened above
        printf("%s: device 0 (--device auto uses it), %.2f GiB, %.2f GiB free\n", b->name,
               total_b / 1073741824.0, free_b / 1073741824.0);
        printf("%s_context_bytes: %zu measured (in use %zu less segnet's %zu; the plan counts "
               "%zu)\n",
               b->name, driver, held, ours, o ? o->driver_bytes : 0);
    } else {
        printf("%s: built, but %s\n", b->name, why);
    }
#ifdef SEGNET_MPI
    printf("mpi: yes\n");
#else
    printf("mpi: no (built without MPI)\n");
#endif
    printf("blas: %s\n", openblas_get_config());
    // the kernels OpenBLAS runs (main's environment_default may have named them)
    const char *core_env = getenv("OPENBLAS_CORETYPE");
    printf("blas_core: %s", openblas_get_corename());
    if (core_env) printf(" (OPENBLAS_CORETYPE=%s)", core_env);
    printf("\n");
    printf("blas_threads: %d\n", openblas_get_num_threads());
#ifdef _OPENMP
    printf("openmp_threads: %d\n", omp_get_max_threads());
    // as libgomp read it at start-up (main's environment_default sets GOMP_SPINCOUNT)
    const char *policy = getenv("OMP_WAIT_POLICY"), *spin = getenv("GOMP_SPINCOUNT");
    if (policy) printf("openmp_wait_policy: %s (OMP_WAIT_POLICY)\n", policy);
    else if (spin) printf("openmp_wait_policy: spin %s times, then sleep (GOMP_SPINCOUNT)\n", spin);
    else printf("openmp_wait_policy: libgomp's default (spin, then sleep)\n");
#else
    printf("openmp_threads: off (built with NO_OMP=1)\n");
#endif
    return 0;
}

static const char *PLAN_USAGE =
    "usage: segnet plan --model NAME [options]\n"
    "\n"
    "Prints the model stage by stage (output shape (N,H,W,C), parameters, the bytes\n"
    "of activations kept for the backward and, with --checkpoint blocks, the bytes\n"
    "recomputed), then the memory a training step takes, from the same plan the\n"
    "run allocates with: parameters, gradients, Adam state, BN statistics,\n"
    "activations and their gradients (one arena laid out by lifetimes), conv\n"
    "workspace, and `peak: N bytes (X.XX GiB)`. Nothing is allocated.\n"
    "\n"
    "  --model NAME        unet (default), effv2-s, effv2-m, effv2-l, effv2-t,\n"
    "                      unet-effv2-s, unet-effv2-m, unet-effv2-l, unet-effv2-t\n"
    "  --classes K         output classes (default 4)\n"
    "  --size HxW          input size (default: effv2-s 384x384, effv2-m/l 480x480,\n"
    "                      effv2-t 64x64, U-Nets 256x256)\n"
    "  --batch B           images per step (default 1); with --memory, the global\n"
    "                      batch to keep\n"
    "  --precision P       fp32 (default), fp16 or bf16 activation storage\n"
    "  --checkpoint MODE   none (default) or blocks\n"
    "  --freeze base, --unfreeze-last N, --accum K   as for segnet train\n"
    "  --memory SIZE       e.g. 12G: pick the fastest setting that fits: the largest\n"
    "                      micro-batch first, then checkpointing, then fp16, then\n"
    "                      accumulation of smaller micro-batches; prints what was\n"
    "                      tried and picked (leave --precision and --checkpoint out)\n"
    "  --padding MODE      same (TensorFlow/Keras, default) or symmetric (torchvision)\n"
    "  --head-hidden H     classifier hidden layer width (default 0: none)\n"
    "  --depth D           unet levels below the top (default 4)\n"
    "  --width W           unet channels at the top level (default 32)\n"
    "  --bottleneck B      unet-effv2-*: head (default) or stage, as for segnet train\n"
    "  --device D          auto (default), cuda or cpu: whose conv workspace is planned\n"
    "  --roofline          also the bytes and FLOPs of a training step by op kind on\n"
    "                      the CUDA kernels, and the least time an H200 needs for them\n";

// ---- a roofline of the training step (segnet plan --roofline)
//
// The bytes each op of a training step moves through device memory, as the
// CUDA kernels and cuBLAS calls of today do it (each tensor read or written
// once per pass; accumulation reads, the weight gradient's partial sums and
// re-reads that L2 may serve (an implicit GEMM reads its input once per tile
// of 64 output channels) left out), and its FLOPs.
// An op takes at least max(bytes / bandwidth, FLOPs / peak): the step at least
// the sum. H200: 4.8 TB/s, 790 TFLOP/s dense bf16 (fp32: the 67 TFLOP/s of
// its CUDA cores).
#define ROOF_BANDWIDTH 4.8e12
#define ROOF_PEAK_16BIT 790e12
#define ROOF_PEAK_FP32 67e12
enum {
    ROOF_CONV_KXK,
    ROOF_CONV_1X1,
    ROOF_DEPTHWISE,
    ROOF_BN,
    ROOF_ELEMENTWISE,
    ROOF_SE,
    ROOF_RESAMPLE,
    ROOF_OPTIMIZER,
    ROOF_KINDS
};
static const char *const ROOF_NAMES[ROOF_KINDS] = {"conv k×k (implicit GEMM)",
                                                   "conv 1×1, dense (GEMM)",
                                                   "depthwise conv",
                                                   "batch norm (+act)",
                                                   "elementwise (act, add, dropout)",
                                                   "squeeze-excitation pool/scale",
                                                   "pool, upsample, resize, concat",
                                                   "optimizer (Adam, cast, zero)"};
typedef struct {
    double bytes[ROOF_KINDS], flops[ROOF_KINDS], seconds[ROOF_KINDS];
    double peak;
} Roofline;
static void roof_pass(Roofline *r, int kind, double bytes, double flops) {
    r->bytes[kind] += bytes;
    r->flops[kind] += flops;
    const double tb = bytes / ROOF_BANDWIDTH, tf = flops / r->peak;
    r->seconds[kind] += tb > tf ? tb : tf;
}
static void roofline_step(const Graph *g, DType dt, Roofline *r) {
    memset(r, 0, sizeof *r);
    r->peak = dt == DT_F32 ? ROOF_PEAK_FP32 : ROOF_PEAK_16BIT;
    int *needs = malloc(sizeof(int) * (size_t)g->n_tensors);
    snCheck(needs != NULL, "out of host memory");
    graph_needs_grad(g, 0, needs);
    const double e = (double)dtype_size(dt);
    double trainable = 0;
    for (int i = 0; i < g->n_layers; i++) {
        const Layer *l = &g->layers[i];
        const double X = (double)shape_numel(tshape(g, l->in[0])),
                     Y = (double)shape_numel(tshape(g, l->out));
        const double X2 = l->in[1] >= 0 ? (double)shape_numel(tshape(g, l->in[1])) : 0.0;
        const int bwd = needs[l->out], dx = needs[l->in[0]], dx2 = l->in[1] >= 0 && needs[l->in[1]];
        const int wgrad = bwd && !l->frozen && l->weight >= 0;
        int ids[4];
        for (int k = layer_params(l, ids); k-- > 0;)
            if (!l->frozen) trainable += (double)g->params[ids[k]].count;
        switch (l->kind) {
        case LAYER_CONV: case LAYER_DENSE: {
            const ConvCfg *c = &l->conv;
            const Shape out = tshape(g, l->out);
            const double K = (double)c->kh * c->kw * (tshape(g, l->in[0]).c / c->groups),
                         P = Y / out.c;
            const double flops = 2.0 * Y * K, col = P * K * c->groups, w = (double)out.c * K;
            if (conv_is_depthwise(c)) {
                roof_pass(r, ROOF_DEPTHWISE, (X + Y) * e, flops);
                if (dx) roof_pass(r, ROOF_DEPTHWISE, (X + Y) * e, flops);
                if (wgrad) roof_pass(r, ROOF_DEPTHWISE, (X + Y) * e, flops);
            } else if (conv_is_pointwise(c)) {
                roof_pass(r, ROOF_CONV_1X1, (X + Y + w) * e, flops);
                if (dx) roof_pass(r, ROOF_CONV_1X1, (X + Y + w) * e, flops);
                if (wgrad) roof_pass(r, ROOF_CONV_1X1, (X + Y) * e + w * 4, flops);
            // implicit GEMM: the operands gathered from the tensors themselves
            } else if (c->stride <= 2) {
                roof_pass(r, ROOF_CONV_KXK, (X + Y + w) * e, flops);
                if (dx) roof_pass(r, ROOF_CONV_KXK, (Y + w + X) * e, flops);
                if (wgrad) roof_pass(r, ROOF_CONV_KXK, (X + Y) * e + w * 4, flops);
            // im2col: the columns written and read once per pass; backward data's in fp32, then
            // col2im
            } else {
                roof_pass(r, ROOF_CONV_KXK, X * e + 2 * col * e + (Y + w) * e, flops);
                if (dx) roof_pass(r, ROOF_CONV_KXK, (Y + w) * e + 2 * col * 4 + X * e, flops);
                if (wgrad) roof_pass(r, ROOF_CONV_KXK, X * e + 2 * col * e + Y * e + w * 4, flops);
            }
            if (l->bias >= 0) roof_pass(r, ROOF_ELEMENTWISE, 2 * Y * e, 0);  // bias_rows
            if (l->bias >= 0 && wgrad) roof_pass(r, ROOF_ELEMENTWISE, Y * e, 0);
            break;
        }
        case LAYER_BN:  // statistics, apply; backward reduce, data
            roof_pass(r, ROOF_BN, X * e, 2 * X);
            roof_pass(r, ROOF_BN, 2 * X * e, 4 * X);
            if (bwd) roof_pass(r, ROOF_BN, 2 * X * e, 6 * X);
            if (dx) roof_pass(r, ROOF_BN, 3 * X * e, 6 * X);
            break;
        case LAYER_ACT: case LAYER_RESCALE:
            roof_pass(r, ROOF_ELEMENTWISE, (X + Y) * e, 0);
            if (dx) roof_pass(r, ROOF_ELEMENTWISE, 3 * X * e, 0);
            break;
        case LAYER_ADD: case LAYER_DROPOUT: case LAYER_DROP_PATH:
            roof_pass(r, ROOF_ELEMENTWISE, (X + X2 + Y) * e, 0);
            if (dx || dx2)
                roof_pass(r, ROOF_ELEMENTWISE, (Y + (dx ? X : 0) + (dx2 ? X2 : 0)) * e, 0);
            break;
        // two small GEMMs per image, fp32 weights; the backward recomputes the forward
        case LAYER_SE_GATE: {
            const double w = 2.0 * l->conv.cin * l->conv.cout;  // both weight matrices
            roof_pass(r, ROOF_SE, (X + Y) * e + 4 * w, 2 * w * tshape(g, l->in[0]).n);
            if (bwd)
                roof_pass(r, ROOF_SE, 2 * X * e + Y * e + (wgrad ? 12 : 4) * w,
                          6 * w * tshape(g, l->in[0]).n);
            break;
        }
        case LAYER_GAP: case LAYER_SCALE:
            roof_pass(r, ROOF_SE, (X + (l->kind == LAYER_SCALE ? X : 0)) * e, 0);
            if (dx) roof_pass(r, ROOF_SE, 2 * X * e, 0);
            if (dx2) roof_pass(r, ROOF_SE, 2 * X * e, 0);
            break;
        default:  // pooling, upsampling, resizing, concatenation
            roof_pass(r, ROOF_RESAMPLE, (X + X2 + Y) * e, 0);
            if (dx || dx2) roof_pass(r, ROOF_RESAMPLE, (X + X2 + Y) * e, 0);
            break;
        }
    }
    // Adam reads p, g, m, v and writes p, m, v (fp32); the weights are cast once per forward; the
    // gradients zeroed
    const double params = (double)g->n_param_floats;
    roof_pass(r, ROOF_OPTIMIZER,
              28 * trainable + 4 * trainable + (dt == DT_F32 ? 0 : (4 + e) * params),
              10 * trainable);
    free(needs);
}
static void print_roofline(const Graph *g, DType dt) {
    Roofline r;
    roofline_step(g, dt, &r);
    double B = 0, F = 0, T = 0;
    printf("roofline of a training step (H200: %.1f TB/s, %.0f TFLOP/s %s; each tensor moved once "
           "per pass):\n",
           ROOF_BANDWIDTH / 1e12, r.peak / 1e12, dt == DT_F32 ? "fp32" : "dense 16-bit");
    printf("  %-34s %10s %10s %10s\n", "op kind", "GB moved", "TFLOP", "ms (bound)");
    for (int k = 0; k < ROOF_KINDS; k++) {
        if (r.bytes[k] == 0 && r.flops[k] == 0) continue;
        printf("  %-34s %10.2f %10.3f %10.3f\n", ROOF_NAMES[k], r.bytes[k] / 1e9, r.flops[k] / 1e12,
               1e3 * r.seconds[k]);
        B += r.bytes[k]; F += r.flops[k]; T += r.seconds[k];
    }
    printf("  %-34s %10.2f %10.3f %10.3f\n", "step", B / 1e9, F / 1e12, 1e3 * T);
}

static int cmd_plan(int argc, char **argv) {
    TrainArgs a = {0};
    train_cfg_default(&a.c);
    a.c.model.batch = 1;
    a.c.device = DEVICE_AUTO;
    int roofline = 0;
    for (int i = 2; i < argc;) {
        if (!strcmp(argv[i], "--help") || !strcmp(argv[i], "-h")) {
            fputs(PLAN_USAGE, stdout);
            return 0;
        }
        if (!strcmp(argv[i], "--roofline")) { roofline = 1; i++; continue; }
        int k = parse_train_option(&a, argc, argv, i);
        if (k < 0) return 2;
        if (k == 0) {
            fprintf(stderr, "segnet plan: unknown option '%s' (see segnet plan --help)\n", argv[i]);
            return 2;
        }
        i += k;
    }
    if (!a.size_given) model_default_size(&a.c.model);
    if (model_options_used("plan", a.c.model.model, argc, argv)) return 2;
    TrainCfg *c = &a.c;
    char err[SN_ERR_MAX];
    if (a.memory && pick_setting(&a, "plan", stdout)) return 1;
    Graph g;
    Plan p;
    Ops *o;
    int logits = plan_for(c, &g, &p, &o, err);
    if (logits < 0) { print_message(stderr, "segnet plan", err); graph_free(&g); return 1; }
    MemoryReport m;
    memory_report(&g, &p, c, logits, o, &m);
    printf("model: %s  input (%d,%d,%d,3)  classes %d  precision %s  checkpoint %s  accum %d%s\n",
           c->model.model, c->model.batch, c->model.height, c->model.width, c->model.classes,
           DTYPE_NAMES[c->precision], c->checkpoint ? "blocks" : "none", c->accum,
           c->freeze_base ? "  backbone frozen" : "");
    printf("%-28s %-22s %14s %14s %14s\n", "stage", "output", "parameters", "kept (bytes)",
           "recomputed");
    size_t total = 0, trainable = 0;
    for (int s = 0; s < g.n_stages; s++) {
        size_t n = 0, kept = 0, recomputed = 0;
        int last = -1;
        for (int l = 0; l < g.n_layers; l++) {
            const Layer *L = &g.layers[l];
            if (L->stage != s) continue;
            last = l;
            int ids[4];
            for (int k = layer_params(L, ids); k-- > 0;) {
                n += g.params[ids[k]].count;
                if (!L->frozen) trainable += g.params[ids[k]].count;
            }
        }
        if (last < 0) continue;
        for (int b = 0; b < p.n_bufs; b++) {
            const PlanBuffer *q = &p.bufs[b];
            int prod = g.tensors[q->tensor].producer;
            if (q->is_grad || prod < 0 || g.layers[prod].stage != s) continue;
            if (q->recompute) recomputed += q->bytes;
            else if (q->first <= p.loss_slot && q->last >= p.loss_slot) kept += q->bytes;
        }
        printf("%-28s ", g.stage_names[s]);
        print_shape(g.tensors[g.layers[last].out].shape);
        printf(" %14zu %14zu %14zu\n", n, kept, recomputed);
        total += n;
    }
    printf("parameters: %zu (trainable %zu)\n", total, trainable);
    printf("batch norm statistics: %zu values\n", g.n_buffer_floats);
    printf("memory (bytes):\n");
    printf("  parameters (fp32)       %14zu\n  gradients (fp32)        %14zu\n  optimiser state "
           "(Adam)  %14zu\n",
           m.params, m.grads, m.optimizer);
    printf("  BN statistics           %14zu\n  activations + gradients %14zu\n  conv workspace     "
           "     %14zu\n"
           "  inputs, labels, metrics %14zu\n",
           m.statistics, m.activations, m.workspace, m.io);
    if (m.backend) printf("  backend scratch (%s)   %14zu\n", o->name, m.backend);
    if (m.driver) printf("  CUDA context (estimate) %14zu\n", m.driver);
    printf("peak: %zu bytes (%.2f GiB)\n", m.total, m.total / 1073741824.0);
    if (roofline) print_roofline(&g, c->precision);
    plan_free(&p);
    graph_free(&g);
    return 0;
}

// ---- threads that sleep soon when they wait
//
// libgomp's threads, at a barrier and between two parallel regions, spin on
// their cores GOMP_SPINCOUNT times (300,000 by default, milliseconds) before
// they sleep. On a machine doing other work that spinning takes the cores from
// the thread everyone waits for. Measured on 2 cores (1 epoch of make bench's
// e2e run, medians): beside one busy process 151 s with libgomp's default,
// 64 s spinning 10,000 times, 61 s with no spinning (OMP_WAIT_POLICY=passive);
// on a quiet machine 10,000 took 1.01x the default's time (0.995-1.016 over 4
// pairs) and passive 1.04x 10,000's (1.03-1.05): a short spin keeps the back-
// to-back regions of a step cheap. libgomp reads the setting once, from the
// environment, in a constructor that runs before main (glibc's start-up sets
// `environ` just before it, so not even the executable's preinit array can add
// a variable in time): when the user set neither GOMP_SPINCOUNT nor
// OMP_WAIT_POLICY, segnet sets SEGNET_SPINCOUNT and starts itself again (a few
// milliseconds).
#define SEGNET_SPINCOUNT "10000"

// sets what the runtimes read before main and starts again when it set any
static void environment_default(char **argv) {
    int spin = 0, core = 0;
#ifdef _OPENMP
    if (!getenv("OMP_WAIT_POLICY") && !getenv("GOMP_SPINCOUNT"))
        spin = setenv("GOMP_SPINCOUNT", SEGNET_SPINCOUNT, 0) == 0;
#endif
    core = blas_core_default();
    if (!spin && !core) return;
    execv("/proc/self/exe", argv);
    if (spin) unsetenv("GOMP_SPINCOUNT");  // no /proc: run on as started
    if (core) unsetenv("OPENBLAS_CORETYPE");
}

int main(int argc, char **argv) {
    environment_default(argv);
    // each report line when it happens, in a log too (a file is block-buffered)
    setvbuf(stdout, NULL, _IOLBF, 0);
    if (argc < 2 || !strcmp(argv[1], "help") || !strcmp(argv[1], "--help") ||
        !strcmp(argv[1], "-h")) {
        fputs(USAGE, stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "info")) return cmd_info();
    if (!strcmp(argv[1], "plan")) return cmd_plan(argc, argv);
    if (!strcmp(argv[1], "predict")) return with_train_args(cmd_predict, argc, argv);
    if (!strcmp(argv[1], "train")) return with_train_args(cmd_train, argc, argv);
    if (!strcmp(argv[1], "eval")) return with_train_args(cmd_eval, argc, argv);
    if (!strcmp(argv[1], "bench")) return cmd_bench(argc, argv);
    if (!strcmp(argv[1], "export")) return with_train_args(cmd_export, argc, argv);
    if (!strcmp(argv[1], "augment")) return with_train_args(cmd_augment, argc, argv);
    fprintf(stderr, "segnet: unknown command '%s' (try segnet --help)\n", argv[1]);
    return 2;
}

#endif  // TESTING
