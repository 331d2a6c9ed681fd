// tests/harness.c -- what the tests below share: files, data sets, running ./segnet and the shell.
// Part of test_segnet.c, which includes it: one program, its tests run in the order
// they are written (test_segnet.c, then tests/harness.c, step.c, backends.c,
// application.c, sources.c).

// ----------------------------------------------------------------------------
// files, data sets and commands the tests below share

static int write_file_bytes(const char *path, const void *p, size_t n) {
    FILE *f = fopen(path, "wb");
    if (!f) return -1;
    int ok = fwrite(p, 1, n, f) == n;
    return fclose(f) == 0 && ok ? 0 : -1;
}

// the whole file, malloc'ed (NULL if unreadable)
static uint8_t *read_file_bytes(const char *path, size_t *n) {
    FILE *f = fopen(path, "rb");
    if (!f) return NULL;
    fseek(f, 0, SEEK_END);
    long len = ftell(f);
    fseek(f, 0, SEEK_SET);
    uint8_t *p = malloc((size_t)(len > 0 ? len : 0) + 1);  // NUL-terminated, for text files
    *n = fread(p, 1, (size_t)(len > 0 ? len : 0), f);
    p[*n] = 0;
    fclose(f);
    return p;
}

static char *read_file(const char *path, size_t *n) { return (char *)read_file_bytes(path, n); }

static char *read_text(const char *path) {
    size_t n;
    uint8_t *b = read_file_bytes(path, &n);
    if (!b) return NULL;
    char *s = realloc(b, n + 1);
    s[n] = 0;
    return s;
}

static int file_exists(const char *path) { struct stat sb; return stat(path, &sb) == 0; }

// each line without its step_ms field, a wall time (in place): the column of
// that name in the header, the first line (metrics.csv, steps.csv)
static size_t drop_step_ms(char *p, size_t n) {
    int col = -1, k = 0;
    for (size_t i = 0, start = 0; i <= n; i++) {
        const int end = i == n || p[i] == '\n';
        if (!end && p[i] != ',') continue;
        if (i - start == 7 && !memcmp(p + start, "step_ms", 7)) {
            col = k;
            break;
        }
        if (end) break;
        k++;
        start = i + 1;
    }
    if (col < 0) return n;
    size_t out = 0;
    int field = 0;
    for (size_t i = 0; i < n; i++) {
        if (p[i] == '\n')
            field = 0;
        else if (p[i] == ',')
            field++;
        // the field and the comma before it (col > 0: step_ms is never first)
        if (field == col && p[i] != '\n') continue;
        p[out++] = p[i];
    }
    return out;
}
static int ends_with(const char *s, const char *tail) {
    size_t n = strlen(s), m = strlen(tail);
    return n >= m && !strcmp(s + n - m, tail);
}

// The same bytes; metrics.csv and steps.csv the same but for their step_ms
// column (timing), which differs between any two runs.
static int files_equal(const char *a, const char *b) {
    size_t na, nb;
    char *pa = read_file(a, &na), *pb = read_file(b, &nb);
    if (pa && pb && (ends_with(a, "metrics.csv") || ends_with(a, "steps.csv"))) {
        na = drop_step_ms(pa, na);
        nb = drop_step_ms(pb, nb);
    }
    int eq = pa && pb && na == nb && !memcmp(pa, pb, na);
    free(pa); free(pb);
    return eq;
}

static int copy_file(const char *from, const char *to) {
    size_t n;
    char *p = read_file(from, &n);
    FILE *f = p ? fopen(to, "wb") : NULL;
    int ok = f && fwrite(p, 1, n, f) == n;
    if (f) ok &= fclose(f) == 0;
    free(p);
    return ok;
}

// Whether the files at a and b hold the same bytes (both must exist).
static int same_bytes(const char *a, const char *b) {
    size_t na, nb;
    uint8_t *pa = read_file_bytes(a, &na), *pb = read_file_bytes(b, &nb);
    const int eq = pa && pb && na == nb && !memcmp(pa, pb, na);
    free(pa); free(pb);
    return eq;
}

// a copy of the file at path beside it (path.orig), to compare with afterwards
static void keep_copy(const char *path) {
    char orig[600];
    snprintf(orig, sizeof orig, "%s.orig", path);
    CHECK(copy_file(path, orig), "copy of %s", path);
}
static int unchanged(const char *path) {
    char orig[600];
    snprintf(orig, sizeof orig, "%s.orig", path);
    return same_bytes(path, orig);
}

static void rm_rf(const char *dir) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0, "cleanup of %s", dir);
}

static int count_substr(const char *s, const char *sub) {
    int n = 0;
    for (const char *p = s; (p = strstr(p, sub)); p += strlen(sub)) n++;
    return n;
}

// metrics.csv column `name` as numbers (NaN where empty); returns the row count
static int csv_column(const char *path, const char *name, double *out, int max) {
    size_t n;
    char *text = read_file(path, &n), *save = NULL;
    if (!text) return 0;
    int col = -1, rows = 0;
    for (char *line = strtok_r(text, "\n", &save); line; line = strtok_r(NULL, "\n", &save)) {
        if (col < 0) {
            int k = 0;
            for (char *p = line; p; p = strchr(p, ','), p = p ? p + 1 : p, k++)
                if (!strncmp(p, name, strlen(name)) &&
                    (p[strlen(name)] == ',' || !p[strlen(name)])) {
                    col = k;
                    break;
                }
            if (col < 0) break;
            continue;
        }
        const char *p = line;
        for (int k = 0; k < col && p; k++) { p = strchr(p, ','); if (p) p++; }
        if (rows < max) out[rows] = p && *p && *p != ',' ? strtod(p, NULL) : NAN;
        rows++;
    }
    free(text);
    return rows;
}

// metrics.csv's (or steps.csv's) field `name` of row `row` (1-based) as text, "" if absent
// (malloc'd)
static char *csv_field_text(const char *path, const char *name, int row) {
    char *text = read_text(path), *out = NULL;
    if (!text) return strdup("");
    char *lines[64];
    int n = 0;
    for (char *save = NULL, *l = strtok_r(text, "\n", &save); l && n < 64;
         l = strtok_r(NULL, "\n", &save))
        lines[n++] = l;
    int col = -1, k = 0;
    for (char *p = lines[0]; n > 0 && p; p = strchr(p, ','), p = p ? p + 1 : NULL, k++) {
        size_t len = strcspn(p, ",");
        if (len == strlen(name) && !strncmp(p, name, len)) { col = k; break; }
    }
    if (col >= 0 && row < n) {
        char *p = lines[row];
        for (int i = 0; i < col && p; i++) { p = strchr(p, ','); if (p) p++; }
        if (p) out = strndup(p, strcspn(p, ","));
    }
    free(text);
    return out ? out : strdup("");
}

static SafetensorsTensor sf_tensor(const char *name, DType dt, int ndim, const int64_t *dims,
                                   const void *data) {
    SafetensorsTensor t;
    memset(&t, 0, sizeof t);
    snprintf(t.name, sizeof t.name, "%s", name);
    t.dtype = dt;
    t.ndim = ndim;
    t.numel = 1;
    for (int i = 0; i < ndim; i++) { t.dims[i] = dims[i]; t.numel *= (size_t)dims[i]; }
    t.data = data;
    return t;
}

// /tmp/segnet_test_<pid>_<tag>, created empty, with the given sub-folders
static void ds_fixture(char *dir, size_t cap, const char *tag, const char *const *subs,
                       int n_subs) {
    char cmd[600], sub[600];
    snprintf(dir, cap, "/tmp/segnet_test_%ld_%s", (long)getpid(), tag);
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0 && mkdir(dir, 0755) == 0, "creating %s", dir);
    for (int k = 0; k < n_subs; k++) {
        snprintf(sub, sizeof sub, "%s/%s", dir, subs[k]);
        CHECK(mkdir(sub, 0755) == 0, "creating %s", sub);
    }
}
static void ds_remove(const char *dir) {
    char cmd[600];
    snprintf(cmd, sizeof cmd, "rm -rf '%s'", dir);
    CHECK(system(cmd) == 0, "cleanup");
}

static void write_png(const char *dir, const char *name, int h, int w, Rng *r) {
    char path[512];
    snprintf(path, sizeof path, "%s/%s", dir, name);
    unsigned char *px = malloc((size_t)h * w * 3);
    for (int i = 0; i < h * w * 3; i++) px[i] = (unsigned char)(rng_next(r) & 255);
    CHECK(stbi_write_png(path, w, h, 3, px, w * 3) != 0, "writing %s", path);
    free(px);
}

// DIR/images/iNN.png + DIR/masks/iNN.png: n RGB images h×w whose mask is
// class 1 + (red > green) on the left half and class 0 on the right 2 columns,
// so class 0 ("not annotated") occurs when K > 2 uses weight 0 for it.
static void write_seg_set(const char *dir, int n, int h, int w, uint64_t seed) {
    char path[512];
    snprintf(path, sizeof path, "mkdir -p '%s/images' '%s/masks'", dir, dir);
    CHECK(system(path) == 0, "mkdir %s", dir);
    Rng r;
    rng_seed(&r, seed);
    uint8_t *img = malloc((size_t)h * w * 3), *mask = malloc((size_t)h * w);
    for (int i = 0; i < n; i++) {
        for (int p = 0; p < h * w; p++) {
            for (int c = 0; c < 3; c++) img[p * 3 + c] = (uint8_t)(rng_next(&r) & 0xFF);
            mask[p] = p % w >= w - 2 ? 0 : 1 + (img[p * 3] > img[p * 3 + 1]);
        }
        snprintf(path, sizeof path, "%s/images/i%02d.png", dir, i);
        CHECK(stbi_write_png(path, w, h, 3, img, w * 3), "write %s", path);
        snprintf(path, sizeof path, "%s/masks/i%02d.png", dir, i);
        CHECK(stbi_write_png(path, w, h, 1, mask, w), "write %s", path);
    }
    free(img); free(mask);
}

static TrainCfg tiny_seg_cfg(const char *data, const char *val) {
    TrainCfg c;
    train_cfg_default(&c);
    c.model.model = "unet";
    c.model.depth = 1; c.model.width_base = 4; c.model.classes = 3;
    c.model.height = 8; c.model.width = 8; c.model.batch = 4;
    c.class_weights[0] = 0.0f;
    c.data = data; c.val = val;
    c.progress = 0;
    c.threads = 0;
    return c;
}

// runs ./segnet, returns its exit status; its stderr lands in *msg
static int run_segnet(const char *args, char *msg, size_t size) {
    char cmd[2048];
    if (access("./segnet", X_OK) != 0) {  // `make test` builds it
        snprintf(msg, size, "./segnet is missing: build it with make");
        return -1;
    }
    snprintf(cmd, sizeof cmd, "./segnet %s >/tmp/segnet_test_out.txt 2>/tmp/segnet_test_err.txt",
             args);
    int rc = system(cmd);
    size_t n;
    char *e = read_file("/tmp/segnet_test_err.txt", &n);
    snprintf(msg, size, "%s", e ? e : "");
    free(e);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}

// runs a shell command; stderr in *msg
static int run_shell(const char *cmd, char *msg, size_t size) {
    char full[4096];
    snprintf(full, sizeof full, "{ %s; } >/tmp/segnet_test_out.txt 2>/tmp/segnet_test_err.txt",
             cmd);
    int rc = system(full);
    size_t n;
    char *e = read_file("/tmp/segnet_test_err.txt", &n);
    snprintf(msg, size, "%s", e ? e : "");
    free(e);
    return WIFEXITED(rc) ? WEXITSTATUS(rc) : -1;
}
