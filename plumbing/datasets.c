// datasets.c -- data sets: listing, decoding, resizing, augmentation, batching, prefetch.
// Plumbing of the segnet program: segnet.c (the math, the models, the step)
// includes this file at its end, so that the program is one translation unit.

// ----------------------------------------------------------------------------
// data sets: listing, decoding, resizing, augmentation, batching, prefetch
//
// dataset_open lists the samples, then decodes every one of them on `threads`
// threads: that is the validation, and it fills the cache when the resized
// samples fit. sample_load is the one place that decodes, checks and resizes a
// sample, so dataset_batch, which decodes again when nothing is cached, refuses
// a file that changed on disk with the same message. Threads are pthreads (the
// loader needs long-lived ones anyway); each runs OpenMP regions on one thread.

#include <malloc.h>  // mallopt (glibc), for the loader's large decoded images

static int omp_serial_begin(void) {
#ifdef _OPENMP
    int n = omp_get_max_threads();
    omp_set_num_threads(1);  // a decoding thread is one core's work; no nested teams
    return n;
#else
    return 1;
#endif
}
static void omp_serial_end(int n) {
#ifdef _OPENMP
    omp_set_num_threads(n);
#else
    (void)n;
#endif
}

// a path's file name without its extension, as pointer and length: "d/a.b.png" -> "a.b"
static const char *path_stem(const char *path, int *len) {
    const char *s = strrchr(path, '/'), *dot;
    s = s ? s + 1 : path;
    dot = strrchr(s, '.');
    *len = dot ? (int)(dot - s) : (int)strlen(s);
    return s;
}
static int cmp_stems(const char *a, const char *b) {
    int la, lb;
    const char *sa = path_stem(a, &la), *sb = path_stem(b, &lb);
    int c = memcmp(sa, sb, (size_t)(la < lb ? la : lb));
    return c ? c : la - lb;
}
// by stem, then by path: images and masks pair in one merge, duplicates are adjacent
static int cmp_by_stem(const void *a, const void *b) {
    int c = cmp_stems(*(char *const *)a, *(char *const *)b);
    return c ? c : cmp_str(a, b);
}

// A folder's images, sorted; an empty folder is no error here (callers say
// what is missing). Anything but a readable folder is one.
static int list_folder(const char *dir, PathList *out, char err[SN_ERR_MAX]) {
    struct stat sb;
    memset(out, 0, sizeof *out);
    if (stat(dir, &sb) != 0) {
        snprintf(err, SN_ERR_MAX, "%s: %s", dir, strerror(errno));
        return -1;
    }
    if (!S_ISDIR(sb.st_mode)) { snprintf(err, SN_ERR_MAX, "%s: not a folder", dir); return -1; }
    if (list_images(dir, out, err) == 0) return 0;
    // list_images refuses an empty list
    return out->n == 0 && access(dir, R_OK | X_OK) == 0 ? 0 : -1;
}

// DIR/images/<stem>.{png,jpg,jpeg} paired with DIR/masks/<stem>.png by one merge
// of the two lists sorted by stem; the first problem in that order is reported.
static int list_segmentation(Dataset *d, const char *dir, char err[SN_ERR_MAX]) {
    char sub[2][4096];
    PathList im = {0}, mk = {0};
    snprintf(sub[0], sizeof sub[0], "%s/images", dir);
    snprintf(sub[1], sizeof sub[1], "%s/masks", dir);
    for (int k = 0; k < 2; k++) {
        struct stat sb;
        if (stat(sub[k], &sb) != 0 || !S_ISDIR(sb.st_mode)) {
            snprintf(err, SN_ERR_MAX,
                     "%.300s: no such folder (segmentation data is %s/images/*.{png,jpg,jpeg} and "
                     "%s/masks/*.png)",
                     sub[k], dir, dir);
            return -1;
        }
    }
    if (list_folder(sub[0], &im, err) || list_folder(sub[1], &mk, err)) goto fail;
    if (im.n == 0) {
        snprintf(err, SN_ERR_MAX, "%.300s: no images (*.png, *.jpg, *.jpeg)", sub[0]);
        goto fail;
    }
    sort_n(im.paths, (size_t)im.n, sizeof(char *), cmp_by_stem);
    sort_n(mk.paths, (size_t)mk.n, sizeof(char *), cmp_by_stem);
    for (int k = 0; k < mk.n; k++) {
        const char *dot = strrchr(mk.paths[k], '.');
        if (strcasecmp(dot, ".png")) {  // listed, so it has an image extension
            snprintf(err, SN_ERR_MAX,
                     "%s: a mask must be a PNG (JPEG compression changes class indices)",
                     mk.paths[k]);
            goto fail;
        }
    }
    const PathList *lists[2] = {&im, &mk};
    for (int k = 0; k < 2; k++)
        for (int i = 1; i < lists[k]->n; i++)
            if (cmp_stems(lists[k]->paths[i - 1], lists[k]->paths[i]) == 0) {
                snprintf(err, SN_ERR_MAX, "%s: same name as %s (masks pair with images by name)",
                         lists[k]->paths[i], lists[k]->paths[i - 1]);
                goto fail;
            }
    for (int i = 0; i < im.n || i < mk.n; i++) {
        int c = i == im.n ? 1 : i == mk.n ? -1 : cmp_stems(im.paths[i], mk.paths[i]), len;
        if (c < 0) {
            const char *s = path_stem(im.paths[i], &len);
            snprintf(err, SN_ERR_MAX, "%s: no mask (expected %.300s/%.*s.png)", im.paths[i], sub[1],
                     len, s);
            goto fail;
        }
        if (c > 0) {
            const char *s = path_stem(mk.paths[i], &len);
            snprintf(err, SN_ERR_MAX, "%s: no image (expected %.300s/%.*s.png, .jpg or .jpeg)",
                     mk.paths[i], sub[0], len, s);
            goto fail;
        }
    }
    d->n = im.n;
    d->images = im.paths;
    d->masks = mk.paths;
    return 0;
fail:
    path_list_free(&im);
    path_list_free(&mk);
    return -1;
}

static void add_sample(Dataset *d, PathList *l, int *cap, const char *path, int label) {
    path_list_add(l, NULL, path);
    if (l->cap != *cap) {  // labels grow with the paths
        *cap = l->cap;
        d->labels = realloc(d->labels, sizeof(int32_t) * (size_t)*cap);
        snCheck(d->labels != NULL, "out of host memory");
    }
    d->labels[l->n - 1] = label;
}

// class names: d->names takes `names` (n of them, sorted, owned by d)
static void set_names(Dataset *d, char **names, int n) { d->names = names; d->n_names = n; }
// the index of `name` among names_from's, or -1 (a message naming the known ones in err)
static int name_index(const Dataset *from, const char *name, const char *where,
                      char err[SN_ERR_MAX]) {
    for (int k = 0; k < from->n_names; k++) if (!strcmp(from->names[k], name)) return k;
    int n = snprintf(err, SN_ERR_MAX, "%.400s: class '%.100s' is not one of the training set's (",
                     where, name);
    for (int k = 0; k < from->n_names && n < SN_ERR_MAX - 8; k++)
        n += snprintf(err + n, SN_ERR_MAX - n, "%s%.60s", k ? ", " : "", from->names[k]);
    if (n < SN_ERR_MAX) snprintf(err + n, SN_ERR_MAX - n, ")");
    return -1;
}
// copies of names (n)
static char **names_copy(char *const *names, int n) {
    char **c = malloc(sizeof(char *) * (size_t)(n ? n : 1));
    snCheck(c != NULL, "out of host memory");
    for (int k = 0; k < n; k++) {
        c[k] = strdup(names[k]);
        snCheck(c[k] != NULL, "out of host memory");
    }
    return c;
}

// DIR/<class>/*: sub-folders sorted by name are classes 0, 1, ... (or the
// classes of names_from with those names)
static int list_class_folders(Dataset *d, const char *dir, const Dataset *names_from,
                              char err[SN_ERR_MAX]) {
    PathList classes = {0}, all = {0};
    char **names = NULL;  // the folders' names (sorted)
    int cap = 0, rc = -1;
    DIR *dp = opendir(dir);
    if (!dp) { snprintf(err, SN_ERR_MAX, "%s: %s", dir, strerror(errno)); return -1; }
    for (struct dirent *e; (e = readdir(dp));) {
        if (e->d_name[0] == '.') continue;
        path_list_add(&classes, dir, e->d_name);
        struct stat sb;
        if (stat(classes.paths[classes.n - 1], &sb) != 0 || !S_ISDIR(sb.st_mode))
            free(classes.paths[--classes.n]);
    }
    closedir(dp);
    sort_n(classes.paths, (size_t)classes.n, sizeof(char *), cmp_str);
    if (classes.n > d->classes) {
        snprintf(err, SN_ERR_MAX, "%s: %d class folders, but there are %d classes", dir, classes.n,
                 d->classes);
        goto done;
    }
    names = malloc(sizeof(char *) * (size_t)(classes.n ? classes.n : 1));
    snCheck(names != NULL, "out of host memory");
    for (int c = 0; c < classes.n; c++) {
        const char *slash = strrchr(classes.paths[c], '/');
        names[c] = strdup(slash ? slash + 1 : classes.paths[c]);
        snCheck(names[c] != NULL, "out of host memory");
    }
    if (names_from && names_from->names)
        set_names(d, names_copy(names_from->names, names_from->n_names), names_from->n_names);
    else set_names(d, names, classes.n);
    for (int c = 0; c < classes.n; c++) {
        const int label = names_from && names_from->names
                                  ? name_index(names_from, names[c], classes.paths[c], err)
                                  : c;
        if (label < 0) goto done;
        PathList l;
        if (list_folder(classes.paths[c], &l, err)) goto done;
        for (int k = 0; k < l.n; k++) add_sample(d, &all, &cap, l.paths[k], label);
        path_list_free(&l);
    }
    if (all.n == 0) {
        snprintf(err, SN_ERR_MAX,
                 "%s: no images (expected %s/<class>/*.{png,jpg,jpeg}, one sub-folder per class)",
                 dir, dir);
        goto done;
    }
    d->n = all.n;
    d->images = all.paths;
    rc = 0;
done:
    if (rc) path_list_free(&all);
    if (names && d->names != names) {
        for (int c = 0; c < classes.n; c++) free(names[c]);
        free(names);
    }
    path_list_free(&classes);
    return rc;
}

// a CSV `path,label` (an optional header whose first field is "path"); every
// listed file must exist, every label be an integer 0..K-1, or every label a
// class name (the sorted distinct names are classes 0, 1, ..., or names_from's)
static int list_csv(Dataset *d, const char *csv, const Dataset *names_from, char err[SN_ERR_MAX]) {
    FILE *f = fopen_regular(csv, "r", err);
    if (!f) return -1;
    char dir[4096], line[8192], path[4096], label[64];
    snprintf(dir, sizeof dir, "%s", csv);
    char *slash = strrchr(dir, '/');
    if (slash) *slash = 0; else snprintf(dir, sizeof dir, ".");
    PathList all = {0}, texts = {0};  // texts: each sample's label as written, while they are names
    int cap = 0, rc = 0, numeric = -1;   // numeric: -1 no label yet, 1 integers, 0 names
    int first_row[2] = {0, 0};            // the first row with an integer label, with a name
    int nul;
    for (int row = 1; rc == 0 && text_gets(line, sizeof line, f, &nul); row++) {
        const char *s = csv_skip_bom(line, row), *why;
        struct stat sb;
        int more = 0;
        if (nul) {
            snprintf(err, SN_ERR_MAX, "%s: row %d: " TEXT_NUL, csv, row);
            rc = -1;
        } else if (!strchr(line, '\n') && !feof(f)) {
            snprintf(err, SN_ERR_MAX, "%s: row %d: longer than %zu characters", csv, row,
                     sizeof line - 1);
            rc = -1;
        } else if (!s[strspn(s, CSV_BLANKS "\r\n")]) {
            continue;
        } else if ((why = csv_field(&s, path, sizeof path, &more)) ||
                   (why = csv_field(&s, label, sizeof label, &more))) {
            snprintf(err, SN_ERR_MAX, "%s: row %d: %s", csv, row, why);
            rc = -1;
        } else if (more) {
            snprintf(err, SN_ERR_MAX, "%s: row %d: more than two fields (rows are path,label)", csv,
                     row);
            rc = -1;
        } else if (row == 1 && !strcmp(path, "path")) {
            continue;  // header
        } else if (!path[0]) {
            snprintf(err, SN_ERR_MAX, "%s: row %d: empty path", csv, row);
            rc = -1;
        } else {
            char *end;
            errno = 0;
            long v = strtol(label, &end, 10);
            end += strspn(end, " \t");
            char full[8200];
            snprintf(full, sizeof full, "%s%s%s", path[0] == '/' ? "" : dir,
                     path[0] == '/' ? "" : "/", path);
            const int is_int = label[0] && !*end && errno != ERANGE;
            if (label[0] && !first_row[is_int]) first_row[is_int] = row;
            if (!label[0]) {
                snprintf(err, SN_ERR_MAX, "%s: row %d: no label (rows are path,label)", csv, row);
                rc = -1;
            } else if (numeric >= 0 && numeric != is_int) {
                snprintf(
                        err, SN_ERR_MAX,
                        "%s: row %d: label '%s' is %s, but row %d's is %s (labels are all integers "
                        "0..K-1 or all class names)",
                        csv, row, label, is_int ? "an integer" : "a name", first_row[!is_int],
                        is_int ? "a name" : "an integer");
                rc = -1;
            } else if (!is_int) {  // a class name: its index once every name is known
                numeric = 0;
                if (stat(full, &sb) != 0) {
                    snprintf(err, SN_ERR_MAX, "%s: row %d: %.400s: %s", csv, row, full,
                             strerror(errno));
                    rc = -1;
                } else {
                    add_sample(d, &all, &cap, full, -1);
                    path_list_add(&texts, NULL, label);
                }
            } else if ((numeric = 1) && (v < 0 || v >= d->classes)) {
                snprintf(err, SN_ERR_MAX,
                         "%s: row %d: label '%s' is out of range (there are %d classes: 0..%d)",
                         csv, row, label, d->classes, d->classes - 1);
                rc = -1;
            } else if (stat(full, &sb) != 0) {
                snprintf(err, SN_ERR_MAX, "%s: row %d: %.400s: %s", csv, row, full,
                         strerror(errno));
                rc = -1;
            } else {
                add_sample(d, &all, &cap, full, (int)v);
            }
        }
    }
    fclose(f);
    if (rc == 0 && all.n == 0) { snprintf(err, SN_ERR_MAX, "%s: no images listed", csv); rc = -1; }
    if (rc == 0 && numeric == 0) {  // name the classes, then number the samples
        if (names_from && names_from->names) {
            set_names(d, names_copy(names_from->names, names_from->n_names), names_from->n_names);
        } else {
            char **sorted = names_copy(texts.paths, texts.n);
            sort_n(sorted, (size_t)texts.n, sizeof(char *), cmp_str);
            int n = 0;
            for (int i = 0; i < texts.n; i++) {
                if (n && !strcmp(sorted[n - 1], sorted[i])) { free(sorted[i]); continue; }
                sorted[n++] = sorted[i];
            }
            set_names(d, sorted, n);
            if (n > d->classes) {
                snprintf(err, SN_ERR_MAX,
                         "%s: %d class names (%s, %s, ...), but there are %d classes", csv, n,
                         sorted[0], sorted[1], d->classes);
                rc = -1;
            }
        }
        for (int i = 0; rc == 0 && i < texts.n; i++) {
            const int k = name_index(d, texts.paths[i], csv, err);
            if (k < 0) rc = -1;
            else d->labels[i] = k;
        }
    }
    path_list_free(&texts);
    if (rc) { path_list_free(&all); return -1; }
    d->n = all.n;
    d->images = all.paths;
    return 0;
}

// ---- mask values: the label map, ignored values, palette PNGs

static int value_in(int32_t v, const int32_t *set, int n) {
    for (int i = 0; i < n; i++)
        if (set[i] == v) return 1;
    return 0;
}

// d->value_class from the rules: every value its class (value_class[v] = v
// without a label map), MASK_UNMAPPED where the map lacks it, SN_LABEL_IGNORED
// where the (mapped) value is ignored. A class ≥ K stays: mask_load names the
// pixel. The map's rows: `value,class`, integers 0..65535, each value once.
static int mask_rules_apply(Dataset *d, const MaskRules *r, char err[SN_ERR_MAX]) {
    d->value_class = malloc(sizeof(int32_t) * MASK_VALUES);
    snCheck(d->value_class != NULL, "out of host memory");
    for (int v = 0; v < MASK_VALUES; v++) d->value_class[v] = r && r->label_map ? MASK_UNMAPPED : v;
    if (!r) return 0;
    if (r->label_map) {
        d->label_map = strdup(r->label_map);
        snCheck(d->label_map != NULL, "out of host memory");
        FILE *f = fopen_regular(r->label_map, "r", err);
        if (!f) return -1;
        char line[512], field[2][64];
        int rc = 0, rows = 0, nul;
        for (int row = 1; rc == 0 && text_gets(line, sizeof line, f, &nul); row++) {
            const char *s = csv_skip_bom(line, row), *why = NULL;
            int more = 0;
            long x[2] = {-1, -1};
            if (nul) why = TEXT_NUL;
            else if (!s[strspn(s, CSV_BLANKS "\r\n")]) continue;
            else if (!strchr(line, '\n') && !feof(f)) why = "longer than 511 characters";
            if (!why) why = csv_field(&s, field[0], sizeof field[0], &more);
            if (!why) why = csv_field(&s, field[1], sizeof field[1], &more);
            if (!why && more) why = "more than two fields (rows are value,class)";
            if (!why && rows == 0 && !strcmp(field[0], "value")) continue;  // the header
            for (int k = 0; !why && k < 2; k++) {
                char *end;
                errno = 0;
                x[k] = strtol(field[k], &end, 10);
                if (!field[k][0] || *end || errno || x[k] < 0 || x[k] >= MASK_VALUES)
                    why = "expected value,class: integers 0..65535";
            }
            if (!why && d->value_class[x[0]] != MASK_UNMAPPED) why = "this value is listed twice";
            if (why) {
                snprintf(err, SN_ERR_MAX, "%s: row %d: %s", r->label_map, row, why);
                rc = -1;
            } else {
                d->value_class[x[0]] = (int32_t)x[1];
                rows++;
            }
        }
        fclose(f);
        if (rc == 0 && rows == 0) {
            snprintf(err, SN_ERR_MAX, "%s: no rows (rows are value,class)", r->label_map);
            rc = -1;
        }
        if (rc) return -1;
    }
    for (int v = 0; v < MASK_VALUES; v++)
        if (value_in(d->value_class[v], r->ignore, r->n_ignore))
            d->value_class[v] = SN_LABEL_IGNORED;
    return 0;
}

// A palette PNG read as the grey image of its indices: stb_image turns indices
// into colours, and two palette entries may share one, so the file's bytes are
// relabelled for it instead: IHDR's colour type 3 (palette) becomes 0 (grey),
// and PLTE and tRNS become ancillary chunks of unknown types, which it skips.
// The pixel data, the same bits per sample (1, 2, 4 or 8), is then decoded as
// grey, through stb's own inflate, filters and interlacing. stb_image does not
// check CRCs, so the edited chunks need no new ones. Returns 1 if it was one.
static int png_palette_as_grey(uint8_t *b, size_t n) {
    if (n < 33 || memcmp(b + 12, "IHDR", 4) || b[25] != 3 || b[24] > 8) return 0;
    b[25] = 0;
    for (size_t at = 8; at + 12 <= n;) {  // chunks: length (4, big-endian), type (4), data, CRC (4)
        const size_t len =
                (size_t)b[at] << 24 | (size_t)b[at + 1] << 16 | (size_t)b[at + 2] << 8 | b[at + 3];
        uint8_t *type = b + at + 4;
        if (!memcmp(type, "PLTE", 4)) type[0] = 'p';       // "pLTE"
        else if (!memcmp(type, "tRNS", 4)) type[3] = 's';  // "tRNs"
        else if (!memcmp(type, "IEND", 4)) break;
        if (len > n - at - 12) break;
        at += 12 + len;
    }
    return 1;
}

// A mask's classes (h,w): each value's value_class, MASK_IGNORED for an ignored
// one. A value is the stored value of a PNG's pixel: grey of 1 to 16 bits,
// grey + alpha (alpha ignored), RGB(A) whose every pixel has R = G = B (grey
// stored as colour; a pixel of differing R, G, B is refused: a colour-coded
// mask has no class indices), or a palette PNG's index. Its size must be the
// image's (ih,iw), whose EXIF orientation a mismatch mentions, and every class
// below K.
static uint8_t *mask_load(const Dataset *d, const char *path, int ih, int iw, int image_orientation,
                          char err[SN_ERR_MAX]) {
    const int K = d->classes;
    size_t n;
    int h, w, comp, hh, ww;
    uint8_t *b = image_file_bytes(path, 1, &n, &hh, &ww, err);
    if (!b) return NULL;
    const int palette = png_palette_as_grey(b, n);
    // IHDR, the PNG's first chunk: bit depth at byte 24, colour type at 25
    const int ihdr = n >= 26 && !memcmp(b + 12, "IHDR", 4);
    const int depth = ihdr ? b[24] : 8, colour = ihdr ? b[25] : 0;
    // stb_image scales 1-, 2- and 4-bit grey to 8 bits, v·255/(2^depth − 1): divided back,
    // exactly
    const int grey_scale =
            colour == 0 && (depth == 1 || depth == 2 || depth == 4) ? 255 / ((1 << depth) - 1) : 1;
    const int deep = depth == 16;
    // req_comp 0: the file's channels, comp of them (with tRNS's alpha counted)
    void *px = deep ? (void *)stbi_load_16_from_memory(b, (int)n, &w, &h, &comp, 0)
                    : (void *)stbi_load_from_memory(b, (int)n, &w, &h, &comp, 0);
    free(b);
    if (!px || w != ww || h != hh) {
        snprintf(err, SN_ERR_MAX, "%s: cannot decode the image (%s)", path,
                 px ? "its size changed while decoding" : decoder_reason());
        stbi_image_free(px);
        return NULL;
    }
    uint8_t *m = NULL;
    if (w != iw || h != ih) {
        char note[SN_ERR_MAX];
        snprintf(err, SN_ERR_MAX, "%s: mask is %dx%d but its image is %dx%d%s", path, w, h, iw, ih,
                 exif_size_note(note, sizeof note, image_orientation));
    } else {
        m = malloc((size_t)h * w);
        snCheck(m != NULL, "out of host memory");
        for (size_t p = 0; p < (size_t)h * w; p++) {
            int v[3];
            for (int c = 0; c < 3; c++) {
                const size_t i = p * comp + (comp >= 3 ? c : 0);
                v[c] = deep ? ((const uint16_t *)px)[i] : ((const uint8_t *)px)[i];
            }
            const int value = v[0] / grey_scale, cls = d->value_class[value];
            const int x = (int)(p % w), y = (int)(p / w);
            if (v[1] != v[0] || v[2] != v[0]) {
                snprintf(err, SN_ERR_MAX,
                         "%s: pixel (%d,%d) has the colour (%d,%d,%d), not a class index: save "
                         "masks as 8-bit grey or palette PNGs, pixel value = class index",
                         path, x, y, v[0], v[1], v[2]);
            } else if (cls == MASK_UNMAPPED) {
                snprintf(err, SN_ERR_MAX,
                         "%s: pixel (%d,%d) has the value %d, which %s does not list", path, x, y,
                         value, d->label_map);
            } else if (cls == SN_LABEL_IGNORED || cls < K) {
                m[p] = cls == SN_LABEL_IGNORED ? MASK_IGNORED : (uint8_t)cls;
                continue;
            } else if (d->label_map) {
                snprintf(err, SN_ERR_MAX,
                         "%s: pixel (%d,%d) has the value %d, class %d by %s, but there are %d "
                         "classes (0..%d)",
                         path, x, y, value, cls, d->label_map, K, K - 1);
            } else {
                snprintf(err, SN_ERR_MAX,
                         "%s: pixel (%d,%d) has class %d, but there are %d classes (0..%d)%s%s",
                         path, x, y, cls, K, K - 1, palette ? " (palette index)" : "",
                         value == 255 ? "; 255 marks \"void\" in VOC-style masks: "
                                               "--ignore-index 255" : "");
            }
            free(m);
            m = NULL;
            break;
        }
    }
    stbi_image_free(px);
    return m;
}

// (H,W,3) bytes from (h,w,3) bytes: the model's bilinear resize with
// half-pixel centres (resize_bilinear_forward_ref's taps and arithmetic on the
// bytes' values; what that op gives for the image as floats, rounded to
// nearest), straight from the decoded bytes: no float copy of a large image.
static void image_to_bytes(uint8_t *dst, int H, int W, const uint8_t *src, int h, int w) {
    if (h == H && w == W) { memcpy(dst, src, (size_t)3 * H * W); return; }
    for (int oy = 0; oy < H; oy++) {
        const BilinearTap ty = bilinear_tap(oy, h, H);
        const uint8_t *r0 = src + (size_t)3 * w * ty.i0, *r1 = src + (size_t)3 * w * ty.i1;
        for (int ox = 0; ox < W; ox++) {
            const BilinearTap tx = bilinear_tap(ox, w, W);
            for (int c = 0; c < 3; c++) {
                const long v = lrintf(bilinear_mix(ty, tx, r0[3 * tx.i0 + c], r0[3 * tx.i1 + c],
                                                   r1[3 * tx.i0 + c], r1[3 * tx.i1 + c]));
                dst[((size_t)oy * W + ox) * 3 + c] = (uint8_t)(v < 0 ? 0 : v > 255 ? 255 : v);
            }
        }
    }
}

// (H,W) from (h,w), nearest neighbour with half-pixel centres, exact in integers:
//   dst[oy,ox] = src[⌊(oy + ½)·h/H⌋, ⌊(ox + ½)·w/W⌋]
static void mask_resize(uint8_t *dst, int H, int W, const uint8_t *src, int h, int w) {
    for (int oy = 0; oy < H; oy++) {
        int sy = (int)((2 * (int64_t)oy + 1) * h / (2 * (int64_t)H));
        for (int ox = 0; ox < W; ox++)
            dst[(size_t)oy * W + ox] =
                    src[(size_t)sy * w + (2 * (int64_t)ox + 1) * w / (2 * (int64_t)W)];
    }
}

// Where sample i's bytes are: the cache, else scratch (H,W,3) + (H,W) to decode into.
static void sample_bytes(const Dataset *d, int i, uint8_t *scratch, uint8_t **rgb, uint8_t **mask) {
    const size_t P = (size_t)d->height * d->width;
    *rgb = d->image_cache ? d->image_cache + 3 * P * i : scratch;
    *mask = d->mask_cache ? d->mask_cache + P * i : scratch ? scratch + 3 * P : NULL;
}

// Sample i decoded, checked and resized: rgb (H,W,3), mask (H,W) (segmentation).
static int sample_load(const Dataset *d, int i, uint8_t *rgb, uint8_t *mask, char err[SN_ERR_MAX]) {
    int h, w, orientation;
    uint8_t *img = image_load_oriented(d->images[i], &h, &w, &orientation, err);
    if (!img) return -1;
    uint8_t *m =
            d->segmentation ? mask_load(d, d->masks[i], h, w, orientation, err) : NULL;
    int ok = !d->segmentation || m;
    if (ok) image_to_bytes(rgb, d->height, d->width, img, h, w);
    if (m) mask_resize(mask, d->height, d->width, m, h, w);
    free(img);
    free(m);
    return ok ? 0 : -1;
}

// Starts up to n threads running fn(arg); returns how many started.
#define LOADER_MMAP_THRESHOLD (64 << 20)  // bytes: glibc's mmap threshold while loading

static int threads_start(pthread_t *t, int n, void *(*fn)(void *), void *arg) {
    int k = 0;
    while (k < n && pthread_create(&t[k], NULL, fn, arg) == 0) k++;
    return k;
}

// The first SIGINT or SIGTERM, 0 if none (see "interruption" below): a long
// check of the data stops at it too.
static volatile sig_atomic_t interrupt_signal;

// Validation: workers claim samples in order; the lowest failing sample's
// error wins, so the report does not depend on the threads.
typedef struct {
    const Dataset *d;
    int next;                // next sample to claim (atomic)
    int bad;                 // lowest failing sample so far, n if none (atomic; written under mu)
    char err[SN_ERR_MAX];    // its error
    int64_t *counts;         // (classes) the masks' pixels per class, every worker's added under mu
    int64_t ignored;         // the masks' ignored pixels, likewise
    pthread_mutex_t mu;
} DatasetCheck;

static void *check_worker(void *arg) {
    DatasetCheck *c = arg;
    const Dataset *d = c->d;
    const size_t P = (size_t)d->height * d->width;
    uint8_t *scratch = d->image_cache ? NULL : malloc(4 * P);  // (H,W,3) + (H,W) when not cached
    int64_t *counts = calloc((size_t)d->classes, sizeof(int64_t)), ignored = 0;
    snCheck((d->image_cache || scratch) && counts, "out of host memory");
    int omp = omp_serial_begin();
    for (int i; !interrupt_signal && (i = __atomic_fetch_add(&c->next, 1, __ATOMIC_RELAXED)) <
                                             __atomic_load_n(&c->bad, __ATOMIC_RELAXED);) {
        uint8_t *rgb, *mask;
        char e[SN_ERR_MAX];
        sample_bytes(d, i, scratch, &rgb, &mask);
        if (sample_load(d, i, rgb, mask, e) == 0) {
            if (d->segmentation)
                for (size_t p = 0; p < P; p++) {
                    if (mask[p] == MASK_IGNORED) ignored++;
                    else counts[mask[p]]++;
                }
            continue;
        }
        pthread_mutex_lock(&c->mu);
        if (i < c->bad) {
            __atomic_store_n(&c->bad, i, __ATOMIC_RELAXED);
            memcpy(c->err, e, SN_ERR_MAX);
        }
        pthread_mutex_unlock(&c->mu);
    }
    omp_serial_end(omp);
    pthread_mutex_lock(&c->mu);
    for (int k = 0; k < d->classes; k++) c->counts[k] += counts[k];
    c->ignored += ignored;
    pthread_mutex_unlock(&c->mu);
    free(counts);
    free(scratch);
    return NULL;
}

void dataset_free(Dataset *d) {
    for (int i = 0; i < d->n; i++) {
        free(d->images[i]);
        if (d->masks) free(d->masks[i]);
    }
    free(d->images);
    free(d->masks);
    free(d->labels);
    free(d->image_cache);
    free(d->mask_cache);
    free(d->class_counts);
    free(d->value_class);
    free(d->label_map);
    for (int k = 0; k < d->n_names; k++) free(d->names[k]);
    free(d->names);
    memset(d, 0, sizeof *d);
}

int dataset_open(Dataset *d, const char *path, int segmentation, int classes, int height, int width,
                 size_t cache_bytes, int threads, char err[SN_ERR_MAX]) {
    return dataset_open_named(d, path, segmentation, classes, height, width, cache_bytes, threads,
                              NULL, NULL, err);
}

int dataset_open_named(Dataset *d, const char *path, int segmentation, int classes, int height,
                       int width, size_t cache_bytes, int threads, const Dataset *names_from,
                       const MaskRules *masks, char err[SN_ERR_MAX]) {
    snCheck(classes >= 1 && height >= 1 && width >= 1 && threads >= 1,
            "dataset_open: classes %d, size %dx%d, threads %d", classes, width, height, threads);
    memset(d, 0, sizeof *d);
    d->segmentation = segmentation;
    d->classes = classes;
    d->height = height;
    d->width = width;
    if (segmentation && classes > MASK_IGNORED) {
        snprintf(err, SN_ERR_MAX,
                 "%d classes: segmentation supports at most %d (masks hold 8-bit class indices, "
                 "%d marking an ignored pixel)",
                 classes, MASK_IGNORED, MASK_IGNORED);
        return -1;
    }
    if (segmentation && mask_rules_apply(d, masks, err)) { dataset_free(d); return -1; }
    struct stat sb;
    if (stat(path, &sb) != 0) {
        snprintf(err, SN_ERR_MAX, "%s: %s", path, strerror(errno));
        dataset_free(d);  // the mask rules' tables
        return -1;
    }
    int rc = segmentation          ? list_segmentation(d, path, err)
             : S_ISDIR(sb.st_mode) ? list_class_folders(d, path, names_from, err)
                                   : list_csv(d, path, names_from, err);
    if (rc) { dataset_free(d); return -1; }

    // cache the resized bytes when they fit (and can be allocated)
    const size_t P = (size_t)height * width, per = P * (segmentation ? 4 : 3);
    if (per <= cache_bytes / (size_t)d->n) {
        d->image_cache = malloc(3 * P * d->n);
        d->mask_cache = segmentation ? malloc(P * d->n) : NULL;
        if (!d->image_cache || (segmentation && !d->mask_cache)) {
            free(d->image_cache); free(d->mask_cache);
            d->image_cache = d->mask_cache = NULL;
        }
    }
    d->class_counts = calloc((size_t)classes, sizeof(int64_t));
    snCheck(d->class_counts != NULL, "out of host memory");
    if (!segmentation) for (int i = 0; i < d->n; i++) d->class_counts[d->labels[i]]++;
    DatasetCheck c = {d, 0, d->n, "", d->class_counts, 0, PTHREAD_MUTEX_INITIALIZER};
    pthread_t *t = malloc(sizeof(pthread_t) * (size_t)threads);
    snCheck(t != NULL, "out of host memory");
    int started = threads_start(t, threads - 1, check_worker, &c);
    check_worker(&c);  // the calling thread is one of the workers
    for (int k = 0; k < started; k++) pthread_join(t[k], NULL);
    free(t);
    pthread_mutex_destroy(&c.mu);
    d->ignored = c.ignored;
    if (c.bad < d->n) { snprintf(err, SN_ERR_MAX, "%s", c.err); dataset_free(d); return -1; }
    if (interrupt_signal) {
        snprintf(err, SN_ERR_MAX, "%s: interrupted while checking its images", path);
        dataset_free(d);
        return -1;
    }
    return 0;
}

// Sample idx's augmented image (H,W,3) as 0..255 floats from its bytes (and its
// mask as labels): first the geometry, image and mask together, then on 0..1
// values v = x/255 (tf.image semantics; no clipping but saturation's):
//   hue         h + δ (mod 1) in HSV,        δ ~ U[-D, D)
//   saturation  min(s·f, 1) in HSV,          f ~ U[lo, hi)
//   brightness  v + δ,                       δ ~ U[-D, D)
//   contrast    (v - mean_c)·f + mean_c,     f ~ U[lo, hi), mean_c over H·W per channel
// Draw k of sample idx is rng_uniform(seed, idx·AUG_DRAWS + k), and of the
// segmentation draws rng_uniform(seed ^ AUG_SEG_SALT, idx·SEG_DRAWS + k): a
// pure function of (seed, idx), whichever thread builds the batch (their own
// stream keeps the draws of runs that use only flip, brightness and contrast).
enum { AUG_FLIP, AUG_BRIGHTNESS, AUG_CONTRAST, AUG_DRAWS };
enum { SEG_SCALE, SEG_ANGLE, SEG_CROP_X, SEG_CROP_Y, SEG_VFLIP, SEG_HUE, SEG_SATURATION,
       SEG_DRAWS };
#define AUG_SEG_SALT 0x6a09e667f3bcc908ull  // any constant: the segmentation draws' stream

// The geometry as one inverse map. Output pixel q (its offset from the centre
// of the (H,W) output, mirrored by the flips) reads the sample at
//   src = c + (R(-θ)·q + d) / s
// c the sample's centre, s the zoom, θ the rotation, d the crop's offset from
// the centre of the zoomed sample (s·W, s·H): d = (s·W - W)·(u - ½) per axis,
// u ~ U[0, 1). The image is read bilinearly, the mask by nearest neighbour;
// outside the sample the image is 0 and the label SN_LABEL_IGNORED (pixels that
// do not exist count nothing). Plain flips (no zoom, rotation or vflip) keep
// the exact copy below.
static void sample_geometry(const Dataset *d, const uint8_t *rgb, const uint8_t *mask,
                            const Augment *a, uint64_t seed, int idx, int hflip, float *out,
                            int32_t *labels) {
    const int H = d->height, W = d->width;
    const uint64_t sseed = seed ^ AUG_SEG_SALT, ctr = (uint64_t)idx * SEG_DRAWS;
    const double u = rng_uniform(sseed, ctr + SEG_SCALE),
                 zoom = a->scale_hi > 0.0f ? a->scale_lo + (a->scale_hi - a->scale_lo) * u : 1.0,
                 theta = a->rotate * (2.0 * rng_uniform(sseed, ctr + SEG_ANGLE) - 1.0) * M_PI / 180,
                 dx = (zoom * W - W) * (rng_uniform(sseed, ctr + SEG_CROP_X) - 0.5),
                 dy = (zoom * H - H) * (rng_uniform(sseed, ctr + SEG_CROP_Y) - 0.5),
                 cx = (W - 1) / 2.0, cy = (H - 1) / 2.0, co = cos(theta), si = sin(theta);
    const int vflip = a->vflip && rng_uniform(sseed, ctr + SEG_VFLIP) < 0.5f;
    for (int oy = 0; oy < H; oy++)
        for (int ox = 0; ox < W; ox++) {
            const double qx = hflip ? cx - ox : ox - cx, qy = vflip ? cy - oy : oy - cy,
                         x = cx + (co * qx + si * qy + dx) / zoom,
                         y = cy + (-si * qx + co * qy + dy) / zoom;
            const size_t o = (size_t)oy * W + ox;
            const int inside = x > -0.5 && x < W - 0.5 && y > -0.5 && y < H - 0.5;
            if (mask) {
                const int mx = (int)floor(x + 0.5), my = (int)floor(y + 0.5);
                const uint8_t m = inside ? mask[(size_t)my * W + mx] : MASK_IGNORED;
                labels[o] = m == MASK_IGNORED ? SN_LABEL_IGNORED : m;
            }
            const double xc = x < 0 ? 0 : x > W - 1 ? W - 1 : x,
                         yc = y < 0 ? 0 : y > H - 1 ? H - 1 : y;
            const int x0 = (int)xc, y0 = (int)yc, x1 = x0 + 1 < W ? x0 + 1 : x0,
                      y1 = y0 + 1 < H ? y0 + 1 : y0;
            const double lx = xc - x0, ly = yc - y0;
            for (int c = 0; c < 3; c++) {
                const uint8_t *p = rgb + c;
                const double top = (1 - lx) * p[3 * ((size_t)y0 * W + x0)] +
                                   lx * p[3 * ((size_t)y0 * W + x1)],
                             bot = (1 - lx) * p[3 * ((size_t)y1 * W + x0)] +
                                   lx * p[3 * ((size_t)y1 * W + x1)];
                out[3 * o + c] = inside ? (float)((1 - ly) * top + ly * bot) : 0.0f;
            }
        }
}

// tf.image's hue and saturation on one pixel of 0..1 values: RGB to HSV (h in
// [0,1)), h + dh mod 1, s·fs clipped to [0,1], back to RGB
static void pixel_hue_saturation(float *v, float dh, float fs) {
    const float r = v[0], g = v[1], b = v[2];
    const float mx = fmaxf(r, fmaxf(g, b)), mn = fminf(r, fminf(g, b)), chroma = mx - mn;
    float h = 0.0f, s = mx > 0.0f ? chroma / mx : 0.0f;
    if (chroma > 0.0f) {
        h = mx == r   ? (g - b) / chroma
            : mx == g ? 2.0f + (b - r) / chroma
                      : 4.0f + (r - g) / chroma;
        h /= 6.0f;
        if (h < 0.0f) h += 1.0f;
    }
    h += dh;
    h -= floorf(h);
    s = fminf(fmaxf(s * fs, 0.0f), 1.0f);
    const float h6 = h * 6.0f, c = mx * s, x = c * (1.0f - fabsf(fmodf(h6, 2.0f) - 1.0f)),
                m = mx - c;
    const int sector = (int)h6 % 6;
    static const int8_t PICK[6][3] = {{0, 1, 2}, {1, 0, 2}, {2, 0, 1},
                                      {2, 1, 0}, {1, 2, 0}, {0, 2, 1}};  // c, x, 0 as R, G, B
    const float parts[3] = {c, x, 0.0f};
    for (int k = 0; k < 3; k++) v[k] = parts[PICK[sector][k]] + m;
}

static int augment_geometric(const Augment *a) {
    return a && (a->scale_hi > 0.0f || a->rotate > 0.0f || a->vflip);
}

static void sample_augment(const Dataset *d, const uint8_t *rgb, const uint8_t *mask, int idx,
                           const Augment *aug, uint64_t seed, float *out, int32_t *labels) {
    const int H = d->height, W = d->width;
    const size_t P = (size_t)H * W;
    const uint64_t ctr = (uint64_t)idx * AUG_DRAWS, sseed = seed ^ AUG_SEG_SALT,
                   sctr = (uint64_t)idx * SEG_DRAWS;
    int flip = aug && aug->flip && rng_uniform(seed, ctr + AUG_FLIP) < 0.5f;
    if (augment_geometric(aug)) {
        sample_geometry(d, rgb, mask, aug, seed, idx, flip, out, labels);
    } else {
        for (int y = 0; y < H; y++)
            for (int x = 0; x < W; x++) {
                size_t o = (size_t)y * W + x, s = (size_t)y * W + (flip ? W - 1 - x : x);
                for (int c = 0; c < 3; c++) out[3 * o + c] = rgb[3 * s + c];
                if (mask) labels[o] = mask[s] == MASK_IGNORED ? SN_LABEL_IGNORED : mask[s];
            }
    }
    int bright = aug && aug->brightness > 0.0f,
        contrast = aug && (aug->contrast_lo != 0.0f || aug->contrast_hi != 0.0f),
        colour = aug && (aug->hue > 0.0f || aug->saturation_hi > 0.0f);
    if (!bright && !contrast && !colour) return;
    if (colour) {
        const float u = rng_uniform(sseed, sctr + SEG_SATURATION),
                    dh = aug->hue * (2.0f * rng_uniform(sseed, sctr + SEG_HUE) - 1.0f),
                    lo = aug->saturation_lo, hi = aug->saturation_hi,
                    fs = hi > 0.0f ? lo + (hi - lo) * u : 1.0f;
        for (size_t p = 0; p < P; p++) {
            float v[3] = {out[3 * p] / 255.0f, out[3 * p + 1] / 255.0f, out[3 * p + 2] / 255.0f};
            pixel_hue_saturation(v, dh, fs);
            for (int c = 0; c < 3; c++) out[3 * p + c] = 255.0f * v[c];
        }
    }
    if (!bright && !contrast) return;
    float delta = bright ? aug->brightness * (2.0f * rng_uniform(seed, ctr + AUG_BRIGHTNESS) - 1.0f)
                         : 0.0f;
    float f = contrast ? aug->contrast_lo + (aug->contrast_hi - aug->contrast_lo) *
                                                    rng_uniform(seed, ctr + AUG_CONTRAST)
                       : 1.0f;
    for (int c = 0; c < 3; c++) {
        double sum = 0.0;
        for (size_t p = 0; p < P; p++) {
            out[3 * p + c] = out[3 * p + c] / 255.0f + delta;
            sum += out[3 * p + c];
        }
        float mean = (float)(sum / (double)P);
        for (size_t p = 0; p < P; p++) {
            float v = out[3 * p + c];
            out[3 * p + c] = 255.0f * (contrast ? (v - mean) * f + mean : v);
        }
    }
}

int dataset_batch(const Dataset *d, const int *idx, int n, const Augment *aug, uint64_t seed,
                  float *images, int32_t *labels, char err[SN_ERR_MAX]) {
    const size_t P = (size_t)d->height * d->width;
    uint8_t *scratch = d->image_cache ? NULL : malloc(4 * P);  // (H,W,3) + (H,W) when not cached
    snCheck(d->image_cache || scratch, "out of host memory");
    int rc = 0;
    for (int j = 0; j < n && rc == 0; j++) {
        const int i = idx[j];
        snCheck(i >= 0 && i < d->n, "dataset_batch: sample %d of %d", i, d->n);
        uint8_t *rgb, *mask;
        sample_bytes(d, i, scratch, &rgb, &mask);
        if (scratch) rc = sample_load(d, i, rgb, mask, err);
        if (rc) break;
        sample_augment(d, rgb, d->segmentation ? mask : NULL, i, aug, seed, images + 3 * P * j,
                       d->segmentation ? labels + P * j : NULL);
        if (!d->segmentation) labels[j] = d->labels[i];
    }
    free(scratch);
    return rc;
}

// The loader: a ring of `depth` batch slots, batch b built in slot b % depth.
// A worker may claim batch b once b < released + depth (the slot's previous
// batch has been given back); loader_next gives back the batch it returned
// last, then waits for the next one in order. Everything below mu is guarded.
struct Loader {
    const Dataset *d;
    int *order, n_order, batch, n_batches, depth;
    Augment aug;
    int has_aug;
    uint64_t seed;
    int K;                       // > 0: the batches' weight sums, with weights (K) or NULL
    float *weights;
    Ops *wire;                   // the backend the batches travel to, or NULL
    DType storage;               // its storage type
    int wire_bytes;              // the images travel as bytes
    LoaderBatch *slots;          // (depth)
    int *built;                  // (depth) the batch whose build finished in each slot, -1 if none
    pthread_t *threads;
    int n_threads;
    pthread_mutex_t mu;
    pthread_cond_t cv;           // any change below
    int next_build;              // next batch a worker claims
    int released;                // batches given back by the consumer
    int next_out;                // next batch loader_next hands out
    int failed;                  // lowest batch whose build failed, n_batches if none
    int stop;
    char build_err[SN_ERR_MAX];  // the error of batch `failed`
    char err[SN_ERR_MAX];        // loader_error's text (the consumer's copy)
};

static void *loader_worker(void *arg) {
    Loader *l = arg;
    omp_serial_begin();
    pthread_mutex_lock(&l->mu);
    for (;;) {
        while (!l->stop && l->next_build < l->n_batches && l->next_build >= l->released + l->depth)
            pthread_cond_wait(&l->cv, &l->mu);
        if (l->stop || l->next_build >= l->n_batches) break;
        const int b = l->next_build++, first = b * l->batch;
        const int n = l->n_order - first < l->batch ? l->n_order - first : l->batch;
        LoaderBatch *s = &l->slots[b % l->depth];
        pthread_mutex_unlock(&l->mu);
        char e[SN_ERR_MAX];
        int rc = dataset_batch(l->d, l->order + first, n, l->has_aug ? &l->aug : NULL, l->seed,
                               s->images, s->labels, e);
        const size_t labels = (size_t)n * (l->d->segmentation ? l->d->height * l->d->width : 1);
        const double weight_sum = l->K > 0 && rc == 0
                                          ? label_weight_sum(s->labels, labels, l->weights, l->K)
                                          : 0.0;
        if (rc == 0 && l->wire && s->wire != s->images) {
            const size_t values = (size_t)n * l->d->height * l->d->width * 3;
            if (l->wire_bytes) {  // whole values 0..255 (augment_keeps_bytes)
                uint8_t *w = s->wire;
                for (size_t i = 0; i < values; i++) w[i] = (uint8_t)s->images[i];
            } else {  // rounded as the device's cast would (the same conversion functions)
                const Tensor w = tensor(s->wire, shape4((int)values, 1, 1, 1), l->storage);
                for (size_t i = 0; i < values; i++) st(w, i, s->images[i]);
            }
        }
        pthread_mutex_lock(&l->mu);
        if (rc == 0) {
            s->n = n;
            s->index = b;
            s->weight_sum = weight_sum;
            s->wire_bytes = l->wire_bytes;
            l->built[b % l->depth] = b;
        }
        else if (b < l->failed) { l->failed = b; memcpy(l->build_err, e, SN_ERR_MAX); }
        pthread_cond_broadcast(&l->cv);
    }
    pthread_mutex_unlock(&l->mu);
    return NULL;
}

// whether augmentation aug leaves every value a whole byte (none, or horizontal flips: a
// permutation), the conditions sample_augment acts on
static int augment_keeps_bytes(const Augment *a) {
    return !a || (!augment_geometric(a) && a->brightness <= 0.0f && a->contrast_lo == 0.0f &&
                  a->contrast_hi == 0.0f && a->hue <= 0.0f && a->saturation_hi <= 0.0f);
}

Loader *loader_start(const Dataset *d, const int *order, int n_order, int batch, const Augment *aug,
                     uint64_t seed, int workers, int depth, int K, const float *weights, Ops *wire,
                     DType storage) {
    snCheck(n_order >= 0 && batch >= 1 && workers >= 1 && depth >= 1,
            "loader_start: n_order %d, batch %d, workers %d, depth %d", n_order, batch, workers,
            depth);
    // A decoded photo (stb_image's buffers: megabytes each) would otherwise be
    // mmap'd and unmapped image after image, its pages faulted in anew each time
    // (a third of a worker's time at 720x1200): keep such blocks in the heap.
    mallopt(M_MMAP_THRESHOLD, LOADER_MMAP_THRESHOLD);
    mallopt(M_TRIM_THRESHOLD, 2 * LOADER_MMAP_THRESHOLD);
    Loader *l = calloc(1, sizeof *l);
    snCheck(l != NULL, "out of host memory");
    const size_t P = (size_t)d->height * d->width;
    l->d = d;
    l->n_order = n_order;
    l->batch = batch;
    l->n_batches = (n_order + batch - 1) / batch;
    l->depth = depth;
    l->has_aug = aug != NULL;
    if (aug) l->aug = *aug;
    l->seed = seed;
    l->K = K;
    l->wire = wire;
    l->storage = storage;
    l->wire_bytes = wire && augment_keeps_bytes(aug);
    if (K > 0 && weights) {
        l->weights = malloc(sizeof(float) * (size_t)K);
        snCheck(l->weights != NULL, "out of host memory");
        memcpy(l->weights, weights, sizeof(float) * (size_t)K);
    }
    l->failed = l->n_batches;
    l->order = malloc(sizeof(int) * (size_t)(n_order ? n_order : 1));
    l->slots = calloc((size_t)depth, sizeof *l->slots);
    l->built = malloc(sizeof(int) * (size_t)depth);
    l->threads = malloc(sizeof(pthread_t) * (size_t)workers);
    snCheck(l->order && l->slots && l->built && l->threads, "out of host memory");
    memcpy(l->order, order, sizeof(int) * (size_t)n_order);
    // with a wire: what travels in its host_alloc memory, the fp32 images too when they travel
    const size_t values = 3 * P * batch,
                 labels = sizeof(int32_t) * (d->segmentation ? P : 1) * batch;
    const int wire_f32 = wire && !l->wire_bytes && storage == DT_F32;
    for (int k = 0; k < depth; k++) {
        LoaderBatch *s = &l->slots[k];
        l->built[k] = -1;
        s->images = wire_f32 ? wire->host_alloc(wire, sizeof(float) * values)
                             : malloc(sizeof(float) * values);
        s->labels = wire ? wire->host_alloc(wire, labels) : malloc(labels);
        s->wire = !wire ? NULL
                  : wire_f32 ? s->images
                             : wire->host_alloc(wire, l->wire_bytes ? values
                                                                    : dtype_size(storage) * values);
        snCheck(s->images && s->labels && (!wire || s->wire),
                "out of host memory for %d batches of %d", depth, batch);
    }
    pthread_mutex_init(&l->mu, NULL);
    pthread_cond_init(&l->cv, NULL);
    l->n_threads = threads_start(l->threads, workers, loader_worker, l);
    if (l->n_threads == 0 && l->n_batches > 0) {  // loader_next reports it
        l->failed = 0;
        snprintf(l->build_err, SN_ERR_MAX, "cannot start a loader thread");
    }
    return l;
}

const LoaderBatch *loader_next(Loader *l) {
    const LoaderBatch *out = NULL;
    pthread_mutex_lock(&l->mu);
    l->released = l->next_out;  // the batch returned last is given back
    pthread_cond_broadcast(&l->cv);
    if (!l->err[0] && l->next_out < l->n_batches) {
        const int b = l->next_out, k = b % l->depth;
        while (l->built[k] != b && l->failed != b) pthread_cond_wait(&l->cv, &l->mu);
        if (l->failed == b) {
            memcpy(l->err, l->build_err, SN_ERR_MAX);
            l->stop = 1;
            pthread_cond_broadcast(&l->cv);
        } else {
            out = &l->slots[k];
            l->next_out++;
        }
    }
    pthread_mutex_unlock(&l->mu);
    return out;
}

const LoaderBatch *loader_peek(Loader *l) {
    const LoaderBatch *out = NULL;
    pthread_mutex_lock(&l->mu);
    const int b = l->next_out;
    if (!l->err[0] && b < l->n_batches && l->built[b % l->depth] == b)
        out = &l->slots[b % l->depth];
    pthread_mutex_unlock(&l->mu);
    return out;
}

const char *loader_error(const Loader *l) { return l->err; }

void loader_stop(Loader *l) {
    if (!l) return;
    pthread_mutex_lock(&l->mu);
    l->stop = 1;
    pthread_cond_broadcast(&l->cv);
    pthread_mutex_unlock(&l->mu);
    for (int k = 0; k < l->n_threads; k++) pthread_join(l->threads[k], NULL);
    pthread_cond_destroy(&l->cv);
    pthread_mutex_destroy(&l->mu);
    for (int k = 0; k < l->depth; k++) {
        LoaderBatch *s = &l->slots[k];
        if (!l->wire) {
            free(s->images);
            free(s->labels);
            continue;
        }
        if (s->wire == s->images) l->wire->host_free(l->wire, s->images);
        else { free(s->images); l->wire->host_free(l->wire, s->wire); }
        l->wire->host_free(l->wire, s->labels);
    }
    free(l->slots);
    free(l->built);
    free(l->threads);
    free(l->order);
    free(l->weights);
    free(l);
}

// ----------------------------------------------------------------------------
// --class-weights auto: median-frequency balancing (Eigen & Fergus 2015, as
// SegNet trains): freq_c = (pixels of class c) / (pixels of the masks that hold
// c), w_c = median over the classes present of freq / freq_c; a class that
// never occurs gets 0. Pixels count as the loss sees them: resized to (H,W) by
// nearest neighbour, ignored ones left out. For a classifier, freq_c = (images
// of class c) / (images). Only the masks (or the labels) are read.
int class_weights_median_frequency(const char *path, int segmentation, int K, int H, int W,
                                   const MaskRules *rules, float *w, char err[SN_ERR_MAX]) {
    Dataset d;
    memset(&d, 0, sizeof d);
    d.segmentation = segmentation;
    d.classes = K;
    d.height = H;
    d.width = W;
    struct stat sb;
    if (stat(path, &sb) != 0) {
        snprintf(err, SN_ERR_MAX, "%s: %s", path, strerror(errno));
        return -1;
    }
    int rc = segmentation ? mask_rules_apply(&d, rules, err) || list_segmentation(&d, path, err)
             : S_ISDIR(sb.st_mode) ? list_class_folders(&d, path, NULL, err)
                                   : list_csv(&d, path, NULL, err);
    double *count = calloc((size_t)K, sizeof(double)), *present = calloc((size_t)K, sizeof(double));
    uint8_t *small = malloc((size_t)H * W);
    int *seen = malloc(sizeof(int) * (size_t)K);
    snCheck(count && present && small && seen, "out of host memory");
    for (int i = 0; rc == 0 && i < d.n; i++) {
        if (!segmentation) {
            count[d.labels[i]] += 1.0;
            continue;
        }
        int mh = 0, mw = 0;
        size_t bytes;
        uint8_t *head = image_file_bytes(d.masks[i], 1, &bytes, &mh, &mw, err);
        free(head);
        if (!head) { rc = -1; break; }
        uint8_t *m = mask_load(&d, d.masks[i], mh, mw, 1, err);
        if (!m) { rc = -1; break; }
        mask_resize(small, H, W, m, mh, mw);
        free(m);
        double labelled = 0.0;
        memset(seen, 0, sizeof(int) * (size_t)K);
        for (size_t p = 0; p < (size_t)H * W; p++)
            if (small[p] != MASK_IGNORED) {
                count[small[p]] += 1.0;
                seen[small[p]] = 1;
                labelled++;
            }
        for (int k = 0; k < K; k++) present[k] += seen[k] ? labelled : 0.0;
    }
    if (rc == 0) {
        double freq[SN_MAX_CLASSES], sorted[SN_MAX_CLASSES];
        int n = 0;
        for (int k = 0; k < K; k++) {
            freq[k] = count[k] / (segmentation ? present[k] : (double)d.n);
            if (count[k] > 0) sorted[n++] = freq[k];
        }
        for (int a = 1; a < n; a++)  // insertion sort: K is small
            for (int b = a; b > 0 && sorted[b - 1] > sorted[b]; b--) {
                const double t = sorted[b]; sorted[b] = sorted[b - 1]; sorted[b - 1] = t;
            }
        if (n == 0) {
            snprintf(err, SN_ERR_MAX,
                     "%s: %s: no class frequencies for --class-weights auto", path,
                     segmentation ? "every pixel of its masks is ignored (--ignore-index, "
                                    "--label-map)"
                                  : "no labelled image");
            rc = -1;
        } else {
            const double median =
                    n % 2 ? sorted[n / 2] : (sorted[n / 2 - 1] + sorted[n / 2]) / 2;
            for (int k = 0; k < K; k++) w[k] = count[k] > 0 ? (float)(median / freq[k]) : 0.0f;
        }
    }
    free(count); free(present); free(small); free(seen);
    dataset_free(&d);
    return rc;
}
