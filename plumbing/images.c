// images.c -- images: listing, decoding (stb_image, EXIF orientation), masks, and prediction.
// Plumbing of the segnet program: segnet.c (the math, the models, the step)
// includes this file at its end, so that the program is one translation unit.

// ----------------------------------------------------------------------------
// images and classifier prediction
//
// Decoding is stb_image's (Debian libstb: the header declares, libstb.so
// implements). Images are RGB, values 0..255 as floats, (H,W,3).

// Lists a prediction's images: a folder's *.png, *.jpg, *.jpeg sorted by name,
// or the first column of a CSV (an optional header whose first field is
// "path"; paths relative to the CSV's folder unless absolute).

void path_list_free(PathList *l) {
    for (int i = 0; i < l->n; i++) free(l->paths[i]);
    free(l->paths);
    memset(l, 0, sizeof *l);
}

static void path_list_add(PathList *l, const char *dir, const char *name) {
    GROW(l->paths, l->n, l->cap);
    size_t len = strlen(name) + (dir ? strlen(dir) + 1 : 0) + 1;
    char *p = malloc(len);
    snCheck(p != NULL, "out of host memory");
    if (dir) snprintf(p, len, "%s/%s", dir, name); else snprintf(p, len, "%s", name);
    l->paths[l->n++] = p;
}

static int has_image_ext(const char *name) {
    const char *dot = strrchr(name, '.');
    return dot &&
           (!strcasecmp(dot, ".png") || !strcasecmp(dot, ".jpg") || !strcasecmp(dot, ".jpeg"));
}

static int cmp_str(const void *a, const void *b) {
    return strcmp(*(char *const *)a, *(char *const *)b);
}

// qsort for arrays that may be empty (and NULL, which qsort may not be given)
static void sort_n(void *base, size_t n, size_t size, int (*cmp)(const void *, const void *)) {
    if (n > 1) qsort(base, n, size, cmp);
}

// One CSV field starting at *s: quoted (with "" for a quote) or up to a comma,
// blanks around it dropped; *s moves past it and its comma. Returns NULL, or
// why the row is malformed. *more (if given): another field follows.
#define CSV_BLANKS " \t"
static const char *csv_field(const char **s, char *out, size_t size, int *more) {
    const char *p = *s + strspn(*s, CSV_BLANKS);
    size_t k = 0, n = 0;
    if (*p == '"') {
        for (p++;; p++) {
            if (!*p || *p == '\n' || *p == '\r') return "unterminated quoted field";
            if (*p == '"') { if (p[1] != '"') { p++; break; } p++; }
            if (k + 1 < size) out[k++] = *p;
            n++;
        }
        p += strspn(p, CSV_BLANKS);
        if (*p && *p != ',' && *p != '\n' && *p != '\r') return "text after a closing quote";
    } else {
        for (; *p && *p != ',' && *p != '\n' && *p != '\r'; p++, n++)
            if (k + 1 < size) out[k++] = *p;
        while (k > 0 && strchr(CSV_BLANKS, out[k - 1])) k--;
    }
    out[k] = 0;
    if (n >= size) return "a field is too long";
    if (more) *more = *p == ',';
    if (*p == ',') p++;
    *s = p;
    return NULL;
}

// fgets that tells a NUL byte from the end of the text (*nul set: a binary file; fgets'
// row would end at the NUL and read as too long or cut short)
static char *text_gets(char *line, int size, FILE *f, int *nul) {
    int k = 0, ch = 0;
    *nul = 0;
    while (k + 1 < size && ch != '\n' && (ch = getc(f)) != EOF) {
        *nul |= ch == 0;
        line[k++] = (char)(ch ? ch : ' ');
    }
    line[k] = 0;
    return k ? line : NULL;
}
#define TEXT_NUL "a NUL byte: not a text file"

// A CSV's first row may start with a UTF-8 byte order mark (spreadsheets write one).
static const char *csv_skip_bom(const char *line, int row) {
    return row == 1 && !memcmp(line, "\xef\xbb\xbf", 3) ? line + 3 : line;
}

// images are recognised by their first bytes, whatever their names say
typedef enum { IMAGE_PNG, IMAGE_JPEG, IMAGE_UNKNOWN } ImageFormat;

static ImageFormat image_format(const uint8_t *b, size_t n) {
    if (n >= 8 && !memcmp(b, "\x89PNG\r\n\x1a\n", 8)) return IMAGE_PNG;
    if (n >= 3 && b[0] == 0xff && b[1] == 0xd8 && b[2] == 0xff) return IMAGE_JPEG;
    return IMAGE_UNKNOWN;
}

int list_images(const char *input, PathList *out, char err[SN_ERR_MAX]) {
    memset(out, 0, sizeof *out);
    struct stat sb;
    if (stat(input, &sb) != 0) {
        snprintf(err, SN_ERR_MAX, "%s: %s", input, strerror(errno));
        return -1;
    }
    if (S_ISDIR(sb.st_mode)) {
        DIR *d = opendir(input);
        if (!d) { snprintf(err, SN_ERR_MAX, "%s: %s", input, strerror(errno)); return -1; }
        for (struct dirent *e; (e = readdir(d));)
            if (e->d_name[0] != '.' && has_image_ext(e->d_name))
                path_list_add(out, input, e->d_name);
        closedir(d);
        sort_n(out->paths, (size_t)out->n, sizeof(char *), cmp_str);
    } else {
        FILE *f = fopen_regular(input, "r", err);
        if (!f) return -1;
        char dir[4096];
        snprintf(dir, sizeof dir, "%s", input);
        char *slash = strrchr(dir, '/');
        if (slash) *slash = 0; else snprintf(dir, sizeof dir, ".");
        char line[8192], field[4096];
        uint8_t head[8] = {0};
        const size_t got = fread(head, 1, sizeof head, f);
        rewind(f);
        if (image_format(head, got) != IMAGE_UNKNOWN) {
            snprintf(err, SN_ERR_MAX,
                     "%s: an image, but --input takes a folder of images or a CSV listing them "
                     "(put the image in a folder of its own)",
                     input);
            fclose(f); return -1;
        }
        int nul;
        for (int row = 1; text_gets(line, sizeof line, f, &nul); row++) {
            if (nul || (!strchr(line, '\n') && !feof(f))) {
                if (nul) snprintf(err, SN_ERR_MAX, "%s: row %d: " TEXT_NUL, input, row);
                else snprintf(err, SN_ERR_MAX, "%s: row %d: longer than %zu characters", input,
                              row, sizeof line - 1);
                fclose(f); path_list_free(out); return -1;
            }
            const char *s = csv_skip_bom(line, row), *why;
            if (!s[strspn(s, CSV_BLANKS "\r\n")]) continue;
            if ((why = csv_field(&s, field, sizeof field, NULL))) {
                snprintf(err, SN_ERR_MAX, "%s: row %d: %s", input, row, why);
                fclose(f); path_list_free(out); return -1;
            }
            if (row == 1 && !strcmp(field, "path")) continue;  // header
            if (!field[0]) {
                snprintf(err, SN_ERR_MAX, "%s: row %d: empty path", input, row);
                fclose(f); path_list_free(out); return -1;
            }
            path_list_add(out, field[0] == '/' ? NULL : dir, field);
        }
        fclose(f);
    }
    if (out->n == 0) {
        snprintf(err, SN_ERR_MAX, "%s: no images (*.png, *.jpg, *.jpeg) listed", input);
        return -1;
    }
    return 0;
}

// stb_image's reason for its last failure, printable: it may have none, and
// for an unknown PNG chunk it quotes the chunk's four raw bytes (from a static
// buffer that other decoding threads may be writing).
static const char *decoder_reason(void) {
    static __thread char shown[64];
    const char *why = stbi_failure_reason();
    if (!why || !why[0]) return "no reason given";
    size_t k = 0;
    for (; why[k] && k + 1 < sizeof shown; k++)
        shown[k] = (uint8_t)why[k] < 0x20 || (uint8_t)why[k] >= 0x7f ? '?' : why[k];
    shown[k] = 0;
    return shown;
}

// ---- image files: read whole (regular files only), recognised by their first
// bytes (PNG or JPEG, whatever the extension says), the size in the header
// checked against --max-pixels before anything is decoded.

// 10^8: a 10000×10000 photograph; a decompression bomb declares more
#define IMAGE_MAX_PIXELS_DEFAULT 100000000
#define TEXT_OF(x) TEXT_OF_(x)              // a macro's value as a string literal (for --help)
#define TEXT_OF_(x) #x
#define IMAGE_FILE_MAX ((size_t)1 << 30)  // stb_image takes an int length
static int64_t image_max_pixels = IMAGE_MAX_PIXELS_DEFAULT;  // --max-pixels

// The bytes of a regular file; a FIFO, device or folder is refused before a
// read could block on it. NULL with err.
static uint8_t *file_read_regular(const char *path, size_t max, size_t *n, char err[SN_ERR_MAX]) {
    struct stat sb;
    const char *why;
    int fd = open_regular(path, &sb, &why);
    if (fd < 0) { snprintf(err, SN_ERR_MAX, "%s: %s", path, why); return NULL; }
    uint8_t *b = NULL;
    if ((uint64_t)sb.st_size > max) {
        snprintf(err, SN_ERR_MAX, "%s: %" PRIu64 " bytes, more than the %zu an image may have",
                 path, (uint64_t)sb.st_size, max);
    } else {
        size_t got = 0, want = (size_t)sb.st_size;
        b = malloc(want ? want : 1);
        snCheck(b != NULL, "out of host memory");
        for (ssize_t r; got < want; got += (size_t)r)
            if ((r = read(fd, b + got, want - got)) <= 0) {
                if (r < 0 && errno == EINTR) { r = 0; continue; }
                snprintf(err, SN_ERR_MAX, "%s: %s after %zu of %zu bytes", path,
                         r ? strerror(errno) : "file shrank while reading", got, want);
                free(b);
                b = NULL;
                break;
            }
        *n = got;
    }
    close(fd);
    return b;
}

static uint32_t be32(const uint8_t *p) {
    return (uint32_t)p[0] << 24 | (uint32_t)p[1] << 16 | (uint32_t)p[2] << 8 | p[3];
}

// A PNG's header and chunk layout, as the PNG specification has them: NULL
// with (h,w) from IHDR, else what is wrong (in why). stb_image's own reasons
// for these are lost when its other decoders try the file after it ("unknown
// image type"), or missing (a chunk past the end reads as a type of NULs).
static const char *png_layout_problem(const uint8_t *b, size_t n, int64_t *h, int64_t *w,
                                      int *damaged, char *why, size_t size) {
    *damaged = 1;  // unless its size is the problem
    if (n < 33 || be32(b + 8) != 13 || memcmp(b + 12, "IHDR", 4))
        return "its first chunk is not the 13-byte IHDR header: a damaged PNG";
    *w = be32(b + 16);
    *h = be32(b + 20);
    const int depth = b[24], colour = b[25];
    // channels by colour type (0 grey, 2 RGB, 3 palette, 4 grey+alpha, 6 RGBA)
    static const int CHANNELS[7] = {1, 0, 3, 1, 2, 0, 4};
    const int any_depth = colour == 0 || (colour == 3 && depth != 16);
    const uint64_t pixels = (uint64_t)*w * (uint64_t)*h;  // < 2^64: each side < 2^32
    const int too_many = pixels > (uint64_t)image_max_pixels;
    *damaged = !pixels || too_many ? 0 : 1;
    if (!pixels) {
        snprintf(why, size, "the header declares a %s of 0 pixels", *w ? "height" : "width");
    } else if (too_many) {
        snprintf(why, size,
                 "%" PRId64 "x%" PRId64 " is %" PRIu64 " pixels, more than the limit of %" PRId64
                 " (--max-pixels)",
                 *w, *h, pixels, image_max_pixels);
    } else if (colour > 6 || !CHANNELS[colour]) {
        snprintf(why, size, "colour type %d (a PNG has 0, 2, 3, 4 or 6)", colour);
    } else if ((depth != 8 && depth != 16 && !(any_depth && (depth == 1 || depth == 2 ||
                                                               depth == 4))) ||
               (colour == 3 && depth == 16)) {
        snprintf(why, size, "bit depth %d with colour type %d (a PNG has %s)", depth, colour,
                 colour == 0 ? "1, 2, 4, 8 or 16" : colour == 3 ? "1, 2, 4 or 8" : "8 or 16");
    } else if (b[26] || b[27] || b[28] > 1) {
        snprintf(why, size, "compression %d, filter %d, interlace %d (a PNG has 0, 0, 0 or 1)",
                 b[26], b[27], b[28]);
    } else if ((double)*w * *h * (colour == 3 ? 4 : CHANNELS[colour]) > (double)(1 << 30)) {
        snprintf(why, size, "%" PRId64 "x%" PRId64 " is more than stb_image decodes (1 GiB)", *w,
                 *h);
    } else {
        int palette = 0;
        for (size_t at = 8; at + 12 <= n;) {  // length, type, data, CRC
            const uint32_t len = be32(b + at);
            const uint8_t *type = b + at + 4;
            int letters = 1;
            for (int k = 0; k < 4; k++) letters &= isalpha(type[k]) != 0;
            if (!letters) {
                snprintf(why, size, "byte %zu: not a chunk: a damaged PNG", at);
                return why;
            }
            if (len > n - at - 12) {
                snprintf(why, size,
                         "chunk %.4s at byte %zu declares %" PRIu32 " bytes, more than the %zu "
                         "left in the file: a damaged or cut-short PNG",
                         (const char *)type, at, len, n - at - 12);
                return why;
            }
            palette |= !memcmp(type, "PLTE", 4);
            if (!memcmp(type, "IDAT", 4) && colour == 3 && !palette)
                return "a palette PNG (colour type 3) without its palette (PLTE) before the "
                       "image data";
            if (!memcmp(type, "IEND", 4)) break;
            at += 12 + (size_t)len;
        }
        return NULL;
    }
    return why;
}

// An image file's bytes, its format and header checked: (h,w) from the header,
// within image_max_pixels. png_only: masks (a JPEG's artefacts change classes).
static uint8_t *image_file_bytes(const char *path, int png_only, size_t *n, int *h, int *w,
                                 char err[SN_ERR_MAX]) {
    uint8_t *b = file_read_regular(path, IMAGE_FILE_MAX, n, err);
    if (!b) return NULL;
    const ImageFormat fmt = image_format(b, *n);
    int comp;
    int64_t ph, pw;
    int damaged;
    char why[SN_ERR_MAX / 2];
    const char *png =
            fmt == IMAGE_PNG ? png_layout_problem(b, *n, &ph, &pw, &damaged, why, sizeof why)
                             : NULL;
    if (png) {
        snprintf(err, SN_ERR_MAX, damaged ? "%s: cannot decode the image (%s)" : "%s: %s", path,
                 png);
    } else if (fmt == IMAGE_UNKNOWN || (png_only && fmt != IMAGE_PNG)) {
        snprintf(err, SN_ERR_MAX, "%s: %s", path,
                 fmt == IMAGE_JPEG ? "holds JPEG data, but a mask must be a PNG (JPEG's "
                                     "compression changes pixel values, so classes)"
                 : png_only        ? "not a PNG file"
                                   : "not a PNG or JPEG file");
    } else if (!stbi_info_from_memory(b, (int)*n, w, h, &comp)) {
        snprintf(err, SN_ERR_MAX, "%s: cannot decode the image (%s)", path, decoder_reason());
    } else if ((int64_t)*w * *h > image_max_pixels) {
        snprintf(err, SN_ERR_MAX,
                 "%s: %dx%d is %" PRId64 " pixels, more than the limit of %" PRId64
                 " (--max-pixels)",
                 path, *w, *h, (int64_t)*w * *h, image_max_pixels);
    } else {
        return b;
    }
    free(b);
    return NULL;
}

// The model's input size is an image too: what an image may not declare, the
// size every image is resized to may not be (decoding buffers are that large).
static int input_size_checked(const ModelCfg *m, char err[SN_ERR_MAX]) {
    if ((int64_t)m->height * m->width <= image_max_pixels) return 0;
    snprintf(err, SN_ERR_MAX,
             "--size %dx%d is %" PRId64 " pixels, more than the limit of %" PRId64
             " (--max-pixels)",
             m->height, m->width, (int64_t)m->height * m->width, image_max_pixels);
    return -1;
}

// ---- EXIF orientation: a JPEG may say how its stored pixels are to be turned
// for display (the Orientation tag, 0x0112, of the TIFF structure in its APP1
// "Exif" segment). --exif ignore (the default, as tf.image.decode_jpeg and
// Keras' loaders) reads the pixels as stored; --exif apply as displayed (PIL's
// ImageOps.exif_transpose), the view masks are drawn on.

typedef enum { EXIF_IGNORE, EXIF_APPLY } ExifMode;
static const char *const EXIF_MODE_NAMES[] = {"ignore", "apply"};
static ExifMode image_exif = EXIF_IGNORE;  // --exif

#define JPEG_SOS 0xda                // start of scan: the entropy-coded data follows
#define JPEG_EOI 0xd9
#define JPEG_APP1 0xe1
#define EXIF_HEADER "Exif\0\0"       // an APP1 segment's first bytes when it holds EXIF
#define EXIF_HEADER_LEN 6
#define TIFF_HEADER_LEN 8            // byte order "II"/"MM", 42, IFD0's offset
#define TIFF_MAGIC 42
#define TIFF_ENTRY_LEN 12            // tag, type, count, value (or its offset)
#define TIFF_SHORT 3
#define EXIF_ORIENTATION_TAG 0x0112

// what display does to the stored pixels, by orientation 1..8 (the EXIF
// specification's "0th row / 0th column" table)
static const char *const EXIF_DISPLAYED[9] = {
    NULL, "shown as stored", "mirrored left to right", "rotated 180°", "mirrored top to bottom",
    "mirrored left to right and rotated 90° anticlockwise", "rotated 90° clockwise",
    "mirrored left to right and rotated 90° clockwise", "rotated 90° anticlockwise"};

static uint32_t tiff_u16(const uint8_t *p, int big) {
    return big ? (uint32_t)p[0] << 8 | p[1] : (uint32_t)p[1] << 8 | p[0];
}
static uint32_t tiff_u32(const uint8_t *p, int big) {
    return big ? tiff_u16(p, 1) << 16 | tiff_u16(p + 2, 1)
               : tiff_u16(p + 2, 0) << 16 | tiff_u16(p, 0);
}

// IFD0's Orientation in the TIFF structure t[0..n): 1..8, or 1 when it has
// none or anything on the way is malformed (every offset checked against n).
static int tiff_orientation(const uint8_t *t, size_t n) {
    if (n < TIFF_HEADER_LEN) return 1;
    const int big = !memcmp(t, "MM", 2);
    if ((!big && memcmp(t, "II", 2)) || tiff_u16(t + 2, big) != TIFF_MAGIC) return 1;
    const uint32_t ifd = tiff_u32(t + 4, big);
    if (ifd < TIFF_HEADER_LEN || ifd > n - 2) return 1;
    const uint32_t entries = tiff_u16(t + ifd, big);
    if (entries > (n - ifd - 2) / TIFF_ENTRY_LEN) return 1;
    for (uint32_t i = 0; i < entries; i++) {
        const uint8_t *e = t + ifd + 2 + (size_t)TIFF_ENTRY_LEN * i;
        if (tiff_u16(e, big) != EXIF_ORIENTATION_TAG) continue;
        if (tiff_u16(e + 2, big) != TIFF_SHORT || tiff_u32(e + 4, big) != 1) return 1;
        // a single SHORT sits in the value field's first two bytes
        const uint32_t v = tiff_u16(e + 8, big);
        return v >= 1 && v <= 8 ? (int)v : 1;
    }
    return 1;
}

// A JPEG's EXIF orientation 1..8 from its bytes b[0..n): the first APP1
// "Exif" segment before the scan data; 1 for anything else (no tag, not a
// JPEG, a malformed segment). Reads nothing outside b.
static int exif_orientation(const uint8_t *b, size_t n) {
    if (n < 2 || b[0] != 0xff || b[1] != 0xd8) return 1;
    for (size_t p = 2; p + 4 <= n;) {
        if (b[p] != 0xff) return 1;
        const uint8_t marker = b[p + 1];
        if (marker == 0xff) { p++; continue; }  // a fill byte before the marker
        if (marker == JPEG_SOS || marker == JPEG_EOI) return 1;
        const size_t len = (size_t)b[p + 2] << 8 | b[p + 3];  // counts its own two bytes
        if (len < 2 || len > n - p - 2) return 1;
        const uint8_t *seg = b + p + 4;
        if (marker == JPEG_APP1 && len - 2 >= EXIF_HEADER_LEN &&
            !memcmp(seg, EXIF_HEADER, EXIF_HEADER_LEN))
            return tiff_orientation(seg + EXIF_HEADER_LEN, len - 2 - EXIF_HEADER_LEN);
        p += 2 + len;
    }
    return 1;
}

// dst (H,W,3) = src (h,w,3) as displayed under orientation o: (H,W) = (w,h)
// for 5..8. Displayed pixel (y,x) is stored pixel (sy,sx) with
//   sy = a·(h−1) + b·y + c·x,  sx = d·(w−1) + e·y + f·x
// ({a,b,c,d,e,f} per orientation below, from the specification's table: e.g.
// 6, "the 0th row is the visual right-hand side, the 0th column the visual
// top", gives sy = h−1−x, sx = y).
static void exif_orient(uint8_t *dst, const uint8_t *src, int h, int w, int o) {
    static const int8_t M[9][6] = {{0, 1, 0, 0, 0, 1},   {0, 1, 0, 0, 0, 1},   {0, 1, 0, 1, 0, -1},
                                   {1, -1, 0, 1, 0, -1}, {1, -1, 0, 0, 0, 1},  {0, 0, 1, 0, 1, 0},
                                   {1, 0, -1, 0, 1, 0},  {1, 0, -1, 1, -1, 0}, {0, 0, 1, 1, -1, 0}};
    const int8_t *m = M[o >= 1 && o <= 8 ? o : 1];
    const int H = o >= 5 ? w : h, W = o >= 5 ? h : w;
    for (int y = 0; y < H; y++)
        for (int x = 0; x < W; x++) {
            const int sy = m[0] * (h - 1) + m[1] * y + m[2] * x,
                      sx = m[3] * (w - 1) + m[4] * y + m[5] * x;
            const uint8_t *s = src + 3 * ((size_t)sy * w + sx);
            uint8_t *d = dst + 3 * ((size_t)y * W + x);
            d[0] = s[0]; d[1] = s[1]; d[2] = s[2];
        }
}

// For a message about an image's size: what its EXIF orientation o did (--exif
// apply) or would do (ignore) to it; "" when o is 1.
static const char *exif_size_note(char *s, size_t cap, int o) {
    if (o <= 1 || o > 8) s[0] = 0;
    else if (image_exif == EXIF_APPLY)
        snprintf(s, cap,
                 " (the image's EXIF orientation %d was applied: it is read %s; --exif ignore "
                 "reads images as stored)",
                 o, EXIF_DISPLAYED[o]);
    else
        snprintf(s, cap,
                 " (the image's EXIF orientation is %d, %s when displayed; --exif apply reads "
                 "images as displayed)",
                 o, EXIF_DISPLAYED[o]);
    return s;
}

// (h,w,3) RGB values 0..255, malloc'd, as stored or as displayed (--exif);
// *orientation: the file's EXIF orientation (1 without one). NULL with err
// naming the file and the problem.
// (h,w,3) RGB bytes, malloc'd, turned as --exif says (the file's EXIF
// orientation in *orientation); NULL with err naming the file and the problem
static uint8_t *image_load_oriented(const char *path, int *h, int *w, int *orientation,
                                    char err[SN_ERR_MAX]) {
    size_t n;
    int hh, ww, comp;
    uint8_t *b = image_file_bytes(path, 0, &n, &hh, &ww, err);
    if (!b) return NULL;
    *orientation = exif_orientation(b, n);
    unsigned char *px = stbi_load_from_memory(b, (int)n, w, h, &comp, 3);
    free(b);
    if (!px || *w != ww || *h != hh) {
        snprintf(err, SN_ERR_MAX, "%s: cannot decode the image (%s)", path,
                 px ? "its size changed while decoding" : decoder_reason());
        stbi_image_free(px);
        return NULL;
    }
    const size_t count = (size_t)*h * *w * 3;
    uint8_t *img = malloc(count);
    snCheck(img != NULL, "out of host memory");
    if (image_exif == EXIF_APPLY && *orientation != 1) {
        exif_orient(img, px, *h, *w, *orientation);
        if (*orientation >= 5) { *h = ww; *w = hh; }
    } else {
        memcpy(img, px, count);
    }
    stbi_image_free(px);
    return img;
}

// (h,w,3) RGB values 0..255, malloc'd, as --exif says; NULL with err naming the file and the
// problem
float *image_load_rgb(const char *path, int *h, int *w, char err[SN_ERR_MAX]) {
    int orientation;
    uint8_t *px = image_load_oriented(path, h, w, &orientation, err);
    if (!px) return NULL;
    const size_t count = (size_t)*h * *w * 3;
    float *img = malloc(sizeof(float) * count);
    snCheck(img != NULL, "out of host memory");
    for (size_t i = 0; i < count; i++) img[i] = px[i];
    free(px);
    return img;
}

// a path as a CSV field: quoted (with "" for ") when it holds a comma, quote or newline
static void csv_write_field(FILE *f, const char *s) {
    if (!strpbrk(s, ",\"\n\r")) { fputs(s, f); return; }
    fputc('"', f);
    for (; *s; s++) { if (*s == '"') fputc('"', f); fputc(*s, f); }
    fputc('"', f);
}

// a classifier's row: path,pred[,pred_name],p0,...,p{K-1} with p = softmax(z), pred = argmax
// (lowest on ties)
static void csv_write_prediction(FILE *f, const char *path, const float *z, int K,
                                 char *const *names, int n_names) {
    int best = 0;
    double sum = 0;
    for (int k = 1; k < K; k++) if (z[k] > z[best]) best = k;
    for (int k = 0; k < K; k++) sum += exp((double)z[k] - z[best]);
    csv_write_field(f, path);
    fprintf(f, ",%d", best);
    if (n_names) {
        fputc(',', f);
        csv_write_field(f, best < n_names ? names[best] : "");
    }
    for (int k = 0; k < K; k++) fprintf(f, ",%.7g", exp((double)z[k] - z[best]) / sum);
    fputc('\n', f);
}

// PNG through stb_image_write's callback into the shared atomic writer
static void png_put(void *f, void *data, int size) { fwrite(data, 1, (size_t)size, (FILE *)f); }

int png_write_atomic(const char *path, int w, int h, int comp, const uint8_t *pixels,
                     char err[SN_ERR_MAX]) {
    snCheck(w >= 1 && h >= 1 && (comp == 1 || comp == 3), "png_write_atomic: %dx%d, %d channels", w,
            h, comp);
    char tmp[OUT_PATH_MAX];
    FILE *f = atomic_file_open(path, tmp, err);
    if (!f) return -1;
    int ok = stbi_write_png_to_func(png_put, f, w, h, comp, pixels, w * comp) != 0;
    if (!ok) snprintf(err, SN_ERR_MAX, "%.400s: cannot encode the PNG", path);
    return atomic_file_commit(f, tmp, path, ok, err);
}

// ---- segmentation outputs: per image OUT/<stem>.png, the mask (8-bit grey,
// pixel = class index), and OUT/<stem>_overlay.png, the image blended 50/50
// with a colour per class; both at the image's own size.

// class k is drawn in SEG_PALETTE[k % SEG_COLOURS]: black for class 0 (background in
// most data sets, as in Pascal VOC's colour map), then 15 colours far apart
// (Trubetskoy's "20 simple, distinct colours"). OUT/legend.png shows them: a
// swatch and the class number per row. SEG_PALETTE_HELP says the same in
// words (predict --help, README).
#define SEG_COLOURS 16
static const uint8_t SEG_PALETTE[SEG_COLOURS][3] = {
        {0, 0, 0},       {230, 25, 75},  {60, 180, 75},   {255, 225, 25},
        {0, 130, 200},   {245, 130, 48}, {145, 30, 180},  {70, 240, 240},
        {240, 50, 230},  {210, 245, 60}, {250, 190, 212}, {0, 128, 128},
        {220, 190, 255}, {170, 110, 40}, {128, 0, 0},     {0, 0, 128},
};
#define SEG_PALETTE_HELP \
    "  0 black, 1 red, 2 green, 3 yellow, 4 blue, 5 orange, 6 purple, 7 cyan,\n" \
    "  8 magenta, 9 lime, 10 pink, 11 teal, 12 lavender, 13 brown, 14 maroon,\n" \
    "  15 navy; class k ≥ 16 takes the colour of k mod 16\n"
#define SEG_LEGEND_NAME "legend.png"

// The legend: per class k a row of LEGEND_ROW pixels, a LEGEND_SWATCH-wide
// swatch of its colour, then k in black digits (a 3×5 pixel font drawn
// LEGEND_SCALE times larger) on white.
#define LEGEND_ROW 24
#define LEGEND_SWATCH 32
#define LEGEND_SCALE 3
#define LEGEND_TEXT_X (LEGEND_SWATCH + 12)
// digit d's 5 rows of 3 pixels, the leftmost pixel in bit 2
static const uint8_t DIGIT_3X5[10][5] = {
    {7, 5, 5, 5, 7}, {2, 6, 2, 2, 7}, {7, 1, 7, 4, 7}, {7, 1, 7, 1, 7}, {5, 5, 7, 1, 1},
    {7, 4, 7, 1, 7}, {7, 4, 7, 5, 7}, {7, 1, 1, 1, 1}, {7, 5, 7, 5, 7}, {7, 5, 7, 1, 7},
};
static void seg_legend_path(const char *out, char path[OUT_PATH_MAX]) {
    snprintf(path, OUT_PATH_MAX, "%.*s/%s", (int)(OUT_PATH_MAX - sizeof SEG_LEGEND_NAME - 1), out,
             SEG_LEGEND_NAME);
}
static int manifest_add(const char *path, char err[SN_ERR_MAX]);
static int seg_legend_write(const char *out, int K, char err[SN_ERR_MAX]) {
    const int digit_w = 4 * LEGEND_SCALE;  // 3 pixels and a space
    const int w = LEGEND_TEXT_X + 3 * digit_w + 4, h = K * LEGEND_ROW;
    uint8_t *rgb = malloc((size_t)w * h * 3);
    snCheck(rgb != NULL, "out of host memory");
    memset(rgb, 255, (size_t)w * h * 3);
    for (int k = 0; k < K; k++) {
        const int y0 = k * LEGEND_ROW;
        for (int y = y0 + 3; y < y0 + LEGEND_ROW - 3; y++)
            for (int x = 4; x < LEGEND_SWATCH; x++)
                memcpy(rgb + 3 * ((size_t)y * w + x), SEG_PALETTE[k % SEG_COLOURS], 3);
        char num[12];  // K ≤ 256: 3 digits
        snprintf(num, sizeof num, "%d", k);
        const int top = y0 + (LEGEND_ROW - 5 * LEGEND_SCALE) / 2;
        for (int d = 0; num[d]; d++)
            for (int gy = 0; gy < 5 * LEGEND_SCALE; gy++)
                for (int gx = 0; gx < 3 * LEGEND_SCALE; gx++)
                    if (DIGIT_3X5[num[d] - '0'][gy / LEGEND_SCALE] >> (2 - gx / LEGEND_SCALE) & 1)
                        memset(rgb + 3 * ((size_t)(top + gy) * w + LEGEND_TEXT_X + d * digit_w +
                                          gx),
                               0, 3);
    }
    char path[OUT_PATH_MAX];
    seg_legend_path(out, path);
    const int rc = png_write_atomic(path, w, h, 3, rgb, err) || manifest_add(path, err);
    free(rgb);
    return rc ? -1 : 0;
}

// the mask and overlay paths of an image: "x/a.b.jpg" → OUT/a.b.png, OUT/a.b_overlay.png
// OUT/<stem>.png, OUT/<stem>_overlay.png and OUT/<stem>_probs.safetensors (--probs)
static void seg_out_paths3(const char *out, const char *image, char mask[OUT_PATH_MAX],
                           char overlay[OUT_PATH_MAX], char probs[OUT_PATH_MAX]) {
    const char *base = strrchr(image, '/');
    base = base ? base + 1 : image;
    const char *dot = strrchr(base, '.');
    int stem = dot && dot != base ? (int)(dot - base) : (int)strlen(base);
    snprintf(mask, OUT_PATH_MAX, "%s/%.*s.png", out, stem, base);
    snprintf(overlay, OUT_PATH_MAX, "%s/%.*s_overlay.png", out, stem, base);
    snprintf(probs, OUT_PATH_MAX, "%s/%.*s_probs.safetensors", out, stem, base);
}
static void seg_out_paths(const char *out, const char *image, char mask[OUT_PATH_MAX],
                          char overlay[OUT_PATH_MAX]) {
    char probs[OUT_PATH_MAX];
    seg_out_paths3(out, image, mask, overlay, probs);
}

typedef struct { char *name; int image; } SegName;
static int cmp_seg_name(const void *a, const void *b) {
    return strcmp(((const SegName *)a)->name, ((const SegName *)b)->name);
}

// ---- outputs never replace what the user owns
//
// predict writes no path that is, or lies inside, its input folder, and never
// replaces an input image or list, whatever the path says (files compared by
// device and inode). Any other existing file it replaces only with
// --overwrite, and only one that it wrote itself: a mask, overlay or legend
// that OUT/.segnet-predict lists (the names it has written into OUT), a
// classifier CSV whose first line is its own header.

#define PREDICT_MANIFEST      ".segnet-predict"
#define PREDICT_MANIFEST_HEAD \
    "segnet predict: the files it wrote in this folder, which --overwrite may replace\n"
#define PREDICT_CSV_HEAD "path,pred"  // what a classifier's CSV starts with (predict_run writes it)

static int stat_same(const struct stat *a, const struct stat *b) {
    return a->st_dev == b->st_dev && a->st_ino == b->st_ino;
}

// Whether path, or when it does not exist yet the folder it would be made in,
// is the folder dir or lies inside it. Walks up through "..", so that links,
// mounts and spellings of the path make no difference.
static int path_inside(const char *path, const struct stat *dir) {
    char at[OUT_PATH_MAX];
    snprintf(at, sizeof at, "%s", path);
    struct stat sb;
    for (;;) {  // the nearest part of the path that exists
        if (stat(at, &sb) == 0) break;
        char *slash = strrchr(at, '/');
        if (!slash) { snprintf(at, sizeof at, "."); break; }
        if (slash == at) slash++;  // "/"
        *slash = 0;
    }
    int fd = open(at, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (fd < 0 && errno == ENOTDIR) {  // an existing file: where it lies
        char dir[OUT_PATH_MAX];
        path_folder(at, dir);
        fd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    }
    for (int depth = 0; fd >= 0 && depth < PATH_MAX; depth++) {
        struct stat here, up_sb;
        if (fstat(fd, &here) || stat_same(&here, dir)) break;
        const int up = openat(fd, "..", O_RDONLY | O_DIRECTORY | O_CLOEXEC);
        close(fd);
        fd = up;
        // "/" is its own parent
        if (fd < 0 || fstat(fd, &up_sb) || stat_same(&up_sb, &here)) break;
    }
    if (fd < 0) return 0;
    struct stat last;
    const int inside = fstat(fd, &last) == 0 && stat_same(&last, dir);
    close(fd);
    return inside;
}

int path_within_folder(const char *path, const char *folder) {
    struct stat sb;
    return stat(folder, &sb) == 0 && S_ISDIR(sb.st_mode) && path_inside(path, &sb);
}

// The files a prediction reads, by identity: image i, or the list (-1)
typedef struct { dev_t dev; ino_t ino; int input; } FileId;
static int cmp_file_id(const void *a, const void *b) {
    const FileId *x = a, *y = b;
    if (x->dev != y->dev) return x->dev < y->dev ? -1 : 1;
    return x->ino < y->ino ? -1 : x->ino > y->ino;
}
static FileId *input_ids(const PredictCfg *pc, const PathList *l, int *n) {
    FileId *ids = malloc(sizeof(FileId) * ((size_t)l->n + 1));
    snCheck(ids != NULL, "out of host memory");
    struct stat sb;
    *n = 0;
    for (int i = -1; i < l->n; i++)
        if (stat(i < 0 ? pc->input : l->paths[i], &sb) == 0 && S_ISREG(sb.st_mode))
            ids[(*n)++] = (FileId){sb.st_dev, sb.st_ino, i};
    qsort(ids, (size_t)*n, sizeof(FileId), cmp_file_id);
    return ids;
}
// the input that `path` is ("input image X", "input list X"), or NULL
static const char *input_named(const PredictCfg *pc, const PathList *l, const FileId *ids, int n,
                               const char *path, char what[OUT_PATH_MAX]) {
    struct stat sb;
    if (stat(path, &sb) != 0) return NULL;
    const FileId key = {sb.st_dev, sb.st_ino, 0},
                 *hit = bsearch(&key, ids, (size_t)n, sizeof(FileId), cmp_file_id);
    if (!hit) return NULL;
    snprintf(what, OUT_PATH_MAX, "%s %.400s", hit->input < 0 ? "the input list" : "the input image",
             hit->input < 0 ? pc->input : l->paths[hit->input]);
    return what;
}

// The names OUT's manifest lists, sorted (NULL, 0 when there is none); -1 with err if it is not
// one.
static int manifest_read(const char *out, char **buf, char ***names, int *n, char err[SN_ERR_MAX]) {
    char path[OUT_PATH_MAX];
    snprintf(path, sizeof path, "%s/" PREDICT_MANIFEST, out);
    const size_t head = strlen(PREDICT_MANIFEST_HEAD);
    size_t bytes = 0;
    *buf = NULL; *names = NULL; *n = 0;
    struct stat sb;
    if (lstat(path, &sb) != 0 && errno == ENOENT) return 0;
    char *b = (char *)file_read_regular(path, (size_t)1 << 30, &bytes, err);
    if (!b) return -1;
    if (bytes < head || memcmp(b, PREDICT_MANIFEST_HEAD, head) || (bytes > head && b[bytes - 1])) {
        snprintf(err, SN_ERR_MAX,
                 "%.300s: not segnet predict's list of the files it wrote (it names nothing for "
                 "--overwrite; remove it or choose another --out)",
                 path);
        free(b);
        return -1;
    }
    int cap = 0;
    for (size_t i = head; i < bytes; i += strlen(b + i) + 1) {
        GROW(*names, *n, cap);
        (*names)[(*n)++] = b + i;
    }
    sort_n(*names, (size_t)*n, sizeof(char *), cmp_str);
    *buf = b;
    return 0;
}

// OUT's manifest: the names it listed and `add` (m of them), each once.
static int manifest_write(const char *out, char **listed, int n, const SegName *add, int m,
                          char err[SN_ERR_MAX]) {
    const char **all = malloc(sizeof(char *) * ((size_t)n + m + 1));
    snCheck(all != NULL, "out of host memory");
    int k = 0;
    for (int i = 0; i < n; i++) all[k++] = listed[i];
    for (int i = 0; i < m; i++) all[k++] = path_base(add[i].name);
    qsort(all, (size_t)k, sizeof(char *), cmp_str);
    SfBuf b = {0};
    sb_str(&b, PREDICT_MANIFEST_HEAD);
    for (int i = 0; i < k; i++)
        if (i == 0 || strcmp(all[i - 1], all[i])) sb_put(&b, all[i], strlen(all[i]) + 1);
    free(all);
    snCheck(!b.oom, "out of host memory");
    char path[OUT_PATH_MAX];
    snprintf(path, sizeof path, "%s/" PREDICT_MANIFEST, out);
    const void *parts[1] = {b.p};
    const int rc = file_write_atomic(path, parts, &b.n, 1, err);
    free(b.p);
    return rc;
}

// Lists the file at path, just written into its folder OUT, in OUT's manifest (appended):
// the manifest names only files that exist. One written but not listed (a crash between
// the two) is not replaced by --overwrite, which is the safe side.
static int manifest_add(const char *path, char err[SN_ERR_MAX]) {
    char dir[OUT_PATH_MAX], manifest[OUT_PATH_MAX + sizeof PREDICT_MANIFEST];
    path_folder(path, dir);
    snprintf(manifest, sizeof manifest, "%s/" PREDICT_MANIFEST, dir);
    const int fd = open(manifest, O_WRONLY | O_APPEND | O_NOFOLLOW | O_CLOEXEC);
    const char *base = path_base(path);
    const size_t len = strlen(base) + 1;  // with its NUL, the names' separator
    const int ok = fd >= 0 && write(fd, base, len) == (ssize_t)len;
    if (!ok)
        snprintf(err, SN_ERR_MAX, "%.300s: cannot add %.100s to it: %s", manifest, base,
                 strerror(errno));
    if (fd >= 0 && close(fd) != 0 && ok) {
        snprintf(err, SN_ERR_MAX, "%.400s: cannot write: %s", manifest, strerror(errno));
        return -1;
    }
    return ok ? 0 : -1;
}

// Whether the file at path starts with a classifier CSV's header (segnet predict wrote it).
static int is_prediction_csv(const char *path) {
    struct stat sb;
    const char *why;
    const int fd = open_regular(path, &sb, &why);
    if (fd < 0) return 0;
    char head[sizeof PREDICT_CSV_HEAD] = "";
    const ssize_t got = read(fd, head, sizeof head - 1);
    close(fd);
    return got == (ssize_t)sizeof head - 1 && !memcmp(head, PREDICT_CSV_HEAD, sizeof head - 1);
}

// Refuses an output that predict may not write (see above): out inside the
// input folder, or any of `outs` (m paths) that exists and is an input, a
// folder, or not predict's own: in the manifest (seg: its names, sorted, in
// listed), else a classifier's CSV recognised by its header.
static int outputs_allowed(const PredictCfg *pc, const PathList *l, const SegName *outs, int m,
                           int seg, char **listed, int n_listed, char err[SN_ERR_MAX]) {
    if (path_within_folder(pc->out, pc->input)) {
        snprintf(err, SN_ERR_MAX,
                 "--out %.180s is, or is inside, the input folder %.180s: predictions never go "
                 "among "
                 "the images they are made from",
                 pc->out, pc->input);
        return -1;
    }
    int n_ids, rc = 0;
    FileId *ids = input_ids(pc, l, &n_ids);
    for (int i = 0; i < m && rc == 0; i++) {
        const char *p = outs[i].name, *input;
        char what[OUT_PATH_MAX];
        struct stat sb;
        if (lstat(p, &sb) != 0) continue;  // a new file
        const char *base = path_base(p);
        rc = -1;
        if (S_ISDIR(sb.st_mode))
            snprintf(err, SN_ERR_MAX,
                     "%.400s: is a folder, where segnet predict would write a file", p);
        else if ((input = input_named(pc, l, ids, n_ids, p, what)))
            snprintf(err, SN_ERR_MAX, "%.200s: segnet predict would replace %.250s", p, input);
        else if (!pc->overwrite)
            snprintf(err, SN_ERR_MAX,
                     "%.300s: exists; segnet predict replaces a file only with --overwrite, and "
                     "only "
                     "one it wrote itself (an earlier prediction)",
                     p);
        else if (seg ? !n_listed ||
                                 !bsearch(&base, listed, (size_t)n_listed, sizeof(char *), cmp_str)
                     : !is_prediction_csv(p))
            snprintf(err, SN_ERR_MAX,
                     "%.300s: exists and is not an output of segnet predict (%s): --overwrite does "
                     "not "
                     "replace it",
                     p,
                     seg ? "not listed in " PREDICT_MANIFEST
                         : "its first line is not " PREDICT_CSV_HEAD "...");
        else
            rc = 0;
    }
    free(ids);
    return rc;
}

// Before anything is written: no two images would write the same file (a.png
// and a.jpg, or a_overlay.png beside a.png), every name fits the file system,
// no output replaces what it may not (outputs_allowed) and every image decodes;
// then the folder `out` is created if absent, with its manifest (each file is
// added to it once written: manifest_add). Decoding twice costs far less than
// the forward pass, and a bad image found halfway would leave a partial folder.
static int seg_check_inputs(const PredictCfg *pc, const PathList *l, char err[SN_ERR_MAX]) {
    const char *out = pc->out;
    // the masks, the overlays, the probabilities (--probs) and the legend (image -1)
    const int per = pc->probs ? 3 : 2, n = per * l->n + 1;
    SegName *names = malloc(sizeof(SegName) * n);
    snCheck(names != NULL, "out of host memory");
    for (int i = 0; i < l->n; i++) {
        char paths[3][OUT_PATH_MAX];
        seg_out_paths3(out, l->paths[i], paths[0], paths[1], paths[2]);
        for (int k = 0; k < per; k++) {
            names[per * i + k] = (SegName){strdup(paths[k]), i};
            snCheck(names[per * i + k].name != NULL, "out of host memory");
        }
    }
    char legend[OUT_PATH_MAX];
    seg_legend_path(out, legend);
    names[n - 1] = (SegName){strdup(legend), -1};
    snCheck(names[n - 1].name != NULL, "out of host memory");
    qsort(names, (size_t)n, sizeof(SegName), cmp_seg_name);
    int rc = 0;
    for (int i = 1; i < n && !rc; i++)
        if (!strcmp(names[i - 1].name, names[i].name)) {
            const SegName *a = &names[i - 1], *b = &names[i];
            if (a->image < 0 || b->image < 0)
                snprintf(err, SN_ERR_MAX,
                         "%.200s would overwrite the colour legend %.170s (rename it)",
                         l->paths[a->image < 0 ? b->image : a->image], names[i].name);
            else
                snprintf(err, SN_ERR_MAX, "%.150s and %.150s would both write %.170s (rename one)",
                         l->paths[a->image], l->paths[b->image], names[i].name);
            rc = -1;
        }
    for (int i = 0; i < n && !rc; i++) rc = out_path_check(names[i].name, err);
    char *manifest = NULL, **listed = NULL;
    int n_listed = 0;
    if (!rc) rc = manifest_read(out, &manifest, &listed, &n_listed, err);
    if (!rc) rc = outputs_allowed(pc, l, names, n, 1, listed, n_listed, err);
    for (int i = 0; !rc && i < l->n; i++) {
        int h, w;
        int orientation;
        uint8_t *img = image_load_oriented(l->paths[i], &h, &w, &orientation, err);
        if (!img) rc = -1;
        free(img);
    }
    if (!rc && mkdir(out, 0777) != 0 && errno != EEXIST) {
        snprintf(err, SN_ERR_MAX, "%.400s: cannot create the folder: %s", out, strerror(errno));
        rc = -1;
    }
    if (!rc) rc = manifest_write(out, listed, n_listed, NULL, 0, err);
    for (int i = 0; i < n; i++) free(names[i].name);
    free(names); free(listed); free(manifest);
    return rc;
}

// class = argmax_k z (the lowest k on ties) of each of n rows of K values
static void argmax_rows(uint8_t *cls, const float *z, size_t n, int K) {
    for (size_t p = 0; p < n; p++) {
        const float *zp = z + p * K;
        int best = 0;
        for (int k = 1; k < K; k++) if (zp[k] > zp[best]) best = k;
        cls[p] = (uint8_t)best;
    }
}

// The mask (h,w) of image img (h,w,3) and its overlay: (image + colour + 1) / 2
// per channel (the 50/50 blend, rounded half up).
static int seg_write_mask(const char *out, const char *image, const uint8_t *img, int h, int w,
                          const uint8_t *mask, char err[SN_ERR_MAX]) {
    uint8_t *rgb = malloc((size_t)h * w * 3);
    snCheck(rgb != NULL, "out of host memory");
    for (size_t i = 0; i < (size_t)h * w; i++)
        for (int c = 0; c < 3; c++)
            rgb[3 * i + c] =
                    (uint8_t)(((int)img[3 * i + c] + SEG_PALETTE[mask[i] % SEG_COLOURS][c] + 1) /
                              2);
    char m[OUT_PATH_MAX], o[OUT_PATH_MAX];
    seg_out_paths(out, image, m, o);
    int rc = png_write_atomic(m, w, h, 1, mask, err) || manifest_add(m, err) ||
             png_write_atomic(o, w, h, 3, rgb, err) || manifest_add(o, err);
    free(rgb);
    return rc ? -1 : 0;
}

// The mask and overlay of one image img (h,w,3) from its logits z (oh,ow,K):
// the classes at the model's resolution brought to h×w by nearest neighbour
// with half-pixel centres, src = floor((dst + ½)·in/out).
static int seg_write(const char *out, const char *image, const float *img, int h, int w,
                     const float *z, int oh, int ow, int K, char err[SN_ERR_MAX]) {
    uint8_t *cls = malloc((size_t)oh * ow), *mask = malloc((size_t)h * w),
            *img8 = malloc((size_t)h * w * 3);
    snCheck(cls && mask && img8, "out of host memory");
    for (size_t i = 0; i < (size_t)h * w * 3; i++) img8[i] = (uint8_t)img[i];
    argmax_rows(cls, z, (size_t)oh * ow, K);
    for (int y = 0; y < h; y++) {
        int sy = (int)(((int64_t)2 * y + 1) * oh / (2 * (int64_t)h));
        for (int x = 0; x < w; x++) {
            int sx = (int)(((int64_t)2 * x + 1) * ow / (2 * (int64_t)w));
            mask[(size_t)y * w + x] = cls[(size_t)sy * ow + sx];
        }
    }
    const int rc = seg_write_mask(out, image, img8, h, w, mask, err);
    free(cls); free(mask); free(img8);
    return rc;
}

// ---- tiled prediction at the image's own resolution (--tile HxW)
//
// The image (h,w) is covered by tiles of the model's input size (th,tw): along
// an axis of length L, n = ceil((L - T) / (T·(1 - overlap))) + 1 tiles start at
// round(i·(L - T)/(n - 1)), i = 0..n-1 (one tile at 0 when L ≤ T; the image is
// then padded to T by repeating its last row or column). Each tile's class
// probabilities (softmax of the logits; with --tta flip, the mean of the tile's
// and its mirror image's, mirrored back) are added into the image's with a
// Gaussian importance map g(y,x) = exp(-((y - cy)² / 2σy² + (x - cx)² / 2σx²)),
// c = (T - 1)/2, σ = T/8 (nnU-Net's), so that a pixel near a tile's border,
// whose context the tile cuts off, counts little where another tile sees it
// whole. The result is Σ g·p / Σ g; the mask is its argmax.

// the tiles along an axis of length len
static int tile_count(int len, int tile, float overlap) {
    if (len <= tile) return 1;
    double stride = tile * (1.0 - overlap);
    if (stride < 1.0) stride = 1.0;
    return (int)ceil((len - tile) / stride - 1e-9) + 1;
}

// the tiles' starts along an axis of length len (starts: room for len entries); returns n
static int tile_starts(int len, int tile, float overlap, int *starts) {
    if (len <= tile) { starts[0] = 0; return 1; }
    const int n = tile_count(len, tile, overlap);
    for (int i = 0; i < n; i++)
        starts[i] = (int)lround((double)i * (len - tile) / (n - 1));
    return n;
}

// g (th,tw), the Gaussian importance map above
static void tile_gaussian(float *g, int th, int tw) {
    const double cy = (th - 1) / 2.0, cx = (tw - 1) / 2.0, sy = th / 8.0, sx = tw / 8.0;
    for (int y = 0; y < th; y++)
        for (int x = 0; x < tw; x++)
            g[(size_t)y * tw + x] = (float)exp(-((y - cy) * (y - cy) / (2 * sy * sy) +
                                                 (x - cx) * (x - cx) / (2 * sx * sx)));
}

// logits (n,th,tw,K) of tiles (n,th,tw,3): the model, or a test's stand-in
typedef struct {
    void (*forward)(void *ctx, const float *tiles, int n, float *logits);
    void *ctx;
    int batch;  // tiles per call, at most
    int th, tw, K;
    // an image of more than a pass of tiles, over more than one row of them: its progress on
    // stderr as this image's name (NULL: none) and tile rows done, one line rewritten on a
    // terminal (tty), else a line per tenth of the rows
    const char *name;
    int tty;
} TileModel;

// Host bytes a pixel of a tiled image (at scale 1) hold while its tiles run, the peak: the
// image as decoded (3), the blended probabilities (4K) and their weights Σg (4). After them the
// mask (1) with the image and the probabilities (4 + 4K), then without the probabilities the
// overlay (3) and a PNG's filtered rows (3) and compressed stream: less, for K ≥ 3.
#define TILED_HOST_BYTES(K) (3 + 4 * (K) + 4)

// probs (h,w,K) = Σ g·p / Σ g over the tiles of the image (h,w,3), as above: img8
// (as decoded, 3 bytes a pixel) or, when it is NULL, img (resized, float)
static void predict_tiled(const TileModel *m, const uint8_t *img8, const float *img, int h, int w,
                          float overlap, int tta_flip, float *probs) {
    const int th = m->th, tw = m->tw, K = m->K, B = m->batch;
    const size_t tile_px = (size_t)th * tw;
    int *ys = malloc(sizeof(int) * (size_t)(h > th ? h : th)),
        *xs = malloc(sizeof(int) * (size_t)(w > tw ? w : tw));
    const int ny = tile_starts(h, th, overlap, ys), nx = tile_starts(w, tw, overlap, xs);
    const int views = tta_flip ? 2 : 1;
    float *g = malloc(sizeof(float) * tile_px), *wsum = calloc((size_t)h * w, sizeof(float)),
          *x = malloc(sizeof(float) * 3 * tile_px * B),
          *z = malloc(sizeof(float) * K * tile_px * B);
    snCheck(ys && xs && g && wsum && x && z, "out of host memory");
    tile_gaussian(g, th, tw);
    memset(probs, 0, sizeof(float) * (size_t)h * w * K);
    const int n_tiles = ny * nx * views, rows_said = m->name && n_tiles > B && ny > 1;
    int rows_shown = 0, rows_reported = 0;
    for (int t0 = 0; t0 < n_tiles; t0 += B) {
        const int n = n_tiles - t0 < B ? n_tiles - t0 : B;
        // tile t = (iy, ix, view): the image's pixels there, its edges repeated past them
        for (int j = 0; j < n; j++) {
            const int t = t0 + j, view = t % views, ix = t / views % nx, iy = t / views / nx;
            for (int y = 0; y < th; y++)
                for (int xx = 0; xx < tw; xx++) {
                    const int sy = ys[iy] + y < h ? ys[iy] + y : h - 1,
                              sxx = view ? tw - 1 - xx : xx,
                              sx = xs[ix] + sxx < w ? xs[ix] + sxx : w - 1;
                    float *d = x + 3 * (j * tile_px + (size_t)y * tw + xx);
                    const size_t at = 3 * ((size_t)sy * w + sx);
                    for (int c = 0; c < 3; c++) d[c] = img8 ? img8[at + c] : img[at + c];
                }
        }
        m->forward(m->ctx, x, n, z);
        for (int j = 0; j < n; j++) {
            const int t = t0 + j, view = t % views, ix = t / views % nx, iy = t / views / nx;
            for (int y = 0; y < th && ys[iy] + y < h; y++)
                for (int xx = 0; xx < tw && xs[ix] + xx < w; xx++) {
                    const size_t at = (size_t)(ys[iy] + y) * w + xs[ix] + xx;
                    const float *zp = z + K * (j * tile_px + (size_t)y * tw +
                                               (view ? tw - 1 - xx : xx));
                    const float gy = g[(size_t)y * tw + xx];
                    float zmax = zp[0], sum = 0.0f;
                    for (int k = 1; k < K; k++) zmax = zp[k] > zmax ? zp[k] : zmax;
                    for (int k = 0; k < K; k++) sum += expf(zp[k] - zmax);
                    for (int k = 0; k < K; k++)
                        probs[at * K + k] += gy * (expf(zp[k] - zmax) / sum);
                    wsum[at] += gy;
                }
        }
        const int rows = (t0 + n) / (nx * views);
        if (rows_said && rows > rows_shown && m->tty)
            fprintf(stderr, "\rpredict: %s: tile row %d/%d\033[K", m->name, rows, ny);
        else if (rows_said && rows > rows_shown &&
                 (rows == ny || (int64_t)(rows - rows_reported) * 10 >= ny)) {
            fprintf(stderr, "predict: %s: tile row %d/%d\n", m->name, rows, ny);
            rows_reported = rows;
        }
        rows_shown = rows;
    }
    for (size_t p = 0; p < (size_t)h * w; p++)
        for (int k = 0; k < K; k++) probs[p * K + k] /= wsum[p];
    free(ys); free(xs); free(g); free(wsum); free(x); free(z);
}

// an image side of len resized by scale (each side at least 1; 0: not resized)
static int scaled_side(int len, float scale) {
    return scale > 0.0f ? (int)fmax(1.0, lround(len * (double)scale)) : len;
}

// predict_tiled on img8 (h,w,3) resized by scale (bilinear, the resize op; each
// side at least 1), its probabilities resized back to (h,w) the same way
static void predict_tiled_scaled(const TileModel *m, const uint8_t *img8, int h, int w,
                                 float scale, float overlap, int tta_flip, float *probs) {
    const int sh = scaled_side(h, scale), sw = scaled_side(w, scale);
    if (sh == h && sw == w) {
        predict_tiled(m, img8, NULL, h, w, overlap, tta_flip, probs);
        return;
    }
    float *img = malloc(sizeof(float) * 3 * (size_t)h * w),
          *simg = malloc(sizeof(float) * 3 * (size_t)sh * sw);
    snCheck(img && simg, "out of host memory");
    for (size_t i = 0; i < (size_t)h * w * 3; i++) img[i] = img8[i];
    ops_cpu.resize_bilinear_forward(&ops_cpu, tensor_f32(simg, shape4(1, sh, sw, 3)),
                                    tensor_f32(img, shape4(1, h, w, 3)));
    free(img);
    float *sprobs = malloc(sizeof(float) * m->K * (size_t)sh * sw);
    snCheck(sprobs != NULL, "out of host memory");
    predict_tiled(m, NULL, simg, sh, sw, overlap, tta_flip, sprobs);
    ops_cpu.resize_bilinear_forward(&ops_cpu, tensor_f32(probs, shape4(1, h, w, m->K)),
                                    tensor_f32(sprobs, shape4(1, sh, sw, m->K)));
    free(simg); free(sprobs);
}

// OUT/<stem>_probs.safetensors: the tensor "probs" (h,w,K) in fp16 (round to nearest even),
// converted in place (fp16 i over bytes 2i, 2i+1, of floats already read): probs is spent
static int probs_write(const char *out, const char *image, float *probs, int h, int w, int K,
                       char err[SN_ERR_MAX]) {
    const size_t n = (size_t)h * w * K;
    unsigned char *bytes = (unsigned char *)probs;
    for (size_t i = 0; i < n; i++) {
        float v;
        memcpy(&v, bytes + 4 * i, sizeof v);
        const uint16_t half = f32_to_f16(v);
        memcpy(bytes + 2 * i, &half, sizeof half);
    }
    SafetensorsTensor t = {.name = "probs", .dtype = DT_F16, .ndim = 3, .numel = n,
                           .data = bytes};
    t.dims[0] = h; t.dims[1] = w; t.dims[2] = K;
    char m[OUT_PATH_MAX], o[OUT_PATH_MAX], p[OUT_PATH_MAX];
    seg_out_paths3(out, image, m, o, p);
    const int rc = safetensors_write(p, &t, 1, NULL, NULL, 0, err) || manifest_add(p, err);
    return rc ? -1 : 0;
}

typedef struct { Net *net; Ops *o; int input, output; } NetTiles;
static void net_tiles_forward(void *ctx, const float *tiles, int n, float *logits) {
    NetTiles *nt = ctx;
    const Graph *g = nt->net->g;
    const Shape si = g->tensors[nt->input].shape, so = g->tensors[nt->output].shape;
    nt->o->upload(nt->o, nt->net->act[nt->input], tiles, sizeof(float) * n * si.h * si.w * 3);
    net_forward(nt->net, n, 0);
    nt->o->download(nt->o, logits, nt->net->act[nt->output],
                    sizeof(float) * n * so.h * so.w * so.c);
}

// An image's size as read (--exif), from its header; -1 with err
static int image_size(const char *path, int *h, int *w, char err[SN_ERR_MAX]) {
    size_t n;
    uint8_t *b = image_file_bytes(path, 0, &n, h, w, err);
    if (!b) return -1;
    if (image_exif == EXIF_APPLY && exif_orientation(b, n) >= 5) {
        const int t = *h; *h = *w; *w = t;
    }
    free(b);
    return 0;
}

// --tile on images smaller than a tile: a tile side beyond the largest (scaled)
// image's, rounded up to the model's multiple, adds only repeated edges, and a
// pass need hold no more tiles than an image has. The model's input shrinks to
// that (a 4096x4096 tile on a 1x1 image held gigabytes of activations).
static int tile_model_fit(PredictCfg *pc, char err[SN_ERR_MAX]) {
    PathList l;
    if (list_images(pc->input, &l, err)) return -1;
    ModelCfg *m = &pc->model;
    // the U-Net's input is a multiple of 2^depth (1..8, else model_build says so), others' 32
    const int mult = strcmp(m->model, "unet") ? 32 : m->depth >= 1 && m->depth <= 8 ? 1 << m->depth
                                                                                     : 0;
    int *hw = malloc(sizeof(int) * 2 * (size_t)l.n), max_h = 1, max_w = 1, tiles = 1, rc = 0;
    snCheck(hw != NULL, "out of host memory");
    for (int i = 0; rc == 0 && i < l.n; i++) {
        rc = image_size(l.paths[i], &hw[2 * i], &hw[2 * i + 1], err);
        hw[2 * i] = scaled_side(hw[2 * i], pc->scale);
        hw[2 * i + 1] = scaled_side(hw[2 * i + 1], pc->scale);
        max_h = hw[2 * i] > max_h ? hw[2 * i] : max_h;
        max_w = hw[2 * i + 1] > max_w ? hw[2 * i + 1] : max_w;
    }
    if (rc == 0 && mult) {
        const int fit_h = (max_h + mult - 1) / mult * mult,
                  fit_w = (max_w + mult - 1) / mult * mult;
        if (fit_h < m->height) m->height = fit_h;
        if (fit_w < m->width) m->width = fit_w;
        for (int i = 0; i < l.n; i++) {
            const int t = tile_count(hw[2 * i], m->height, pc->overlap) *
                          tile_count(hw[2 * i + 1], m->width, pc->overlap) * (pc->tta_flip ? 2 : 1);
            tiles = t > tiles ? t : tiles;
        }
        if (tiles < m->batch) m->batch = tiles;
    }
    free(hw);
    path_list_free(&l);
    return rc;
}

// Predicts every listed image. Images of the model's size are used as they
// are, others resized (bilinear, half-pixel centres) for the forward pass.
// A classifier (1×1 output) writes one CSV row `path,pred,p0,...,p{K-1}` per
// image (softmax probabilities) to a temporary file, renamed over `out` only
// when every image has been read. A segmentation model writes a mask and an
// overlay per image into the folder `out`, after checking every input.
int predict_run(const PredictCfg *asked, char err[SN_ERR_MAX]) {
    PredictCfg fitted = *asked;
    const PredictCfg *pc = &fitted;
    if (asked->tiled && tile_model_fit(&fitted, err)) return -1;
    if (input_size_checked(&pc->model, err)) return -1;
    Graph g;
    graph_init(&g);
    int out = model_build(&g, &pc->model);
    if (out < 0) { snprintf(err, SN_ERR_MAX, "%s", g.err); graph_free(&g); return -1; }
    // forward passes only: no layer keeps gradient storage
    for (int l = 0; l < g.n_layers; l++) g.layers[l].frozen = 1;
    const Shape so = g.tensors[out].shape, si = g.tensors[g.input].shape;
    const int seg = so.h > 1 || so.w > 1, K = so.c, N = si.n;
    if (pc->tiled && (!seg || so.h != si.h || so.w != si.w)) {
        snprintf(err, SN_ERR_MAX,
                 "--tile: model '%s' does not predict a class per input pixel (tiles are for "
                 "segmentation models)",
                 pc->model.model);
        graph_free(&g);
        return -1;
    }
    if (seg && K > 256) {
        snprintf(err, SN_ERR_MAX,
                 "model '%s': %d classes do not fit the 8-bit mask PNGs (at most 256)",
                 pc->model.model, K);
        graph_free(&g);
        return -1;
    }
    struct stat sb;
    if (seg && stat(pc->out, &sb) == 0 && !S_ISDIR(sb.st_mode)) {
        snprintf(err, SN_ERR_MAX,
                 "%.300s: exists and is not a folder (for segmentation model '%.60s', --out is the "
                 "folder that receives the masks and overlays)",
                 pc->out, pc->model.model);
        graph_free(&g);
        return -1;
    }
    Net net;
    SafetensorsFile wf;
    PathList list;
    int rc = -1;
    Ops *o = ops_for_device(pc->device, 0, err);
    if (!o || net_create(&net, &g, o, DT_F32, 0, err) != 0) {
        if (o && !strncmp(err, "out of ", 7))  // net_create's advice is training's
            snprintf(err, SN_ERR_MAX,
                     "out of %s memory for the network on %d %s of %dx%d a pass: %s", o->name,
                     N, pc->tiled ? "tiles" : "images", si.h, si.w,
                     pc->tiled ? "a smaller --tile needs less" : "a smaller --batch needs less");
        graph_free(&g);
        return -1;
    }
    if (safetensors_read(pc->weights, &wf, err) != 0) goto done_net;
    if (net_load_weights(&net, &wf, pc->weights, NULL, 0, err) != 0) goto done_weights;
    if (list_images(pc->input, &list, err) != 0) goto done_weights;

    char tmp[OUT_PATH_MAX];
    FILE *f = NULL;
    if (seg) {
        if (seg_check_inputs(pc, &list, err) != 0 || seg_legend_write(pc->out, K, err) != 0)
            goto done_list;
    } else {
        const SegName csv = {(char *)pc->out, -1};
        if (outputs_allowed(pc, &list, &csv, 1, 0, NULL, 0, err) ||
            !(f = atomic_file_open(pc->out, tmp, err)))
            goto done_list;
        fprintf(f, PREDICT_CSV_HEAD "%s", pc->n_class_names ? ",pred_name" : "");
        for (int k = 0; k < K; k++) fprintf(f, ",p%d", k);
        fputc('\n', f);
    }
    const size_t img_floats = (size_t)si.h * si.w * 3, out_floats = (size_t)so.h * so.w * K;
    // (N,H,W,3) on the host, uploaded per batch
    float *x = malloc(sizeof(float) * N * img_floats);
    float *logits = malloc(sizeof(float) * N * out_floats);      // (N,OH,OW,K)
    float **imgs = calloc((size_t)N, sizeof(float *));           // N × (h,w,3)
    int *hw = malloc(sizeof(int) * 2 * N);
    snCheck(x && logits && imgs && hw, "out of host memory");
    int ok = 1, reported = 0;  // images the last progress line counted
    const int tty = isatty(STDERR_FILENO);
    NetTiles nt = {&net, o, g.input, out};
    TileModel tm = {net_tiles_forward, &nt, N, si.h, si.w, K, NULL, tty};
    int said_resized = 0;  // the first image far larger than the model's input is named
    // an image at a time, N tiles a pass; its host memory is TILED_HOST_BYTES(K) a pixel: the
    // image and the blend while the tiles run, the probabilities freed before the overlay
    for (int i = 0; ok && pc->tiled && i < list.n; i++) {
        int h, w, orientation;
        uint8_t *img = image_load_oriented(list.paths[i], &h, &w, &orientation, err), *mask = NULL;
        tm.name = pc->progress ? list.paths[i] : NULL;
        if (img) {
            float *probs = malloc(sizeof(float) * (size_t)h * w * K);
            snCheck(probs != NULL, "out of host memory");
            predict_tiled_scaled(&tm, img, h, w, pc->scale, pc->overlap, pc->tta_flip, probs);
            mask = malloc((size_t)h * w);
            snCheck(mask != NULL, "out of host memory");
            argmax_rows(mask, probs, (size_t)h * w, K);
            ok = !pc->probs || probs_write(pc->out, list.paths[i], probs, h, w, K, err) == 0;
            free(probs);
        }
        ok = ok && img && seg_write_mask(pc->out, list.paths[i], img, h, w, mask, err) == 0;
        free(img); free(mask);
        if (pc->progress) fprintf(stderr, "%spredict: %d/%d images%s", tty ? "\r" : "", i + 1,
                                  list.n, tty ? "\033[K" : "\n");
    }
    for (int start = 0; ok && !pc->tiled && start < list.n; start += N) {
        int count = list.n - start < N ? list.n - start : N;
        memset(x, 0, sizeof(float) * img_floats * N);  // slots past the last image stay empty
        for (int j = 0; ok && j < count; j++) {
            int h, w;
            float *img = imgs[j] = image_load_rgb(list.paths[start + j], &h, &w, err);
            if (!img) { ok = 0; break; }
            hw[2 * j] = h; hw[2 * j + 1] = w;
            // more than 4 times the model's pixels: its mask is coarser than the image; said once
            if (seg && pc->progress && !said_resized &&
                (int64_t)h * w > 4 * (int64_t)si.h * si.w) {
                fprintf(stderr,
                        "%spredict: %s is %dx%d (HxW), resized to the model's %dx%d and its mask "
                        "back (detail is lost); --tile %dx%d predicts at the image's own size\n",
                        tty && start > 0 ? "\n" : "", list.paths[start + j], h, w, si.h, si.w,
                        si.h, si.w);
                said_resized = 1;
            }
            Tensor dst = tensor_f32(x + img_floats * j, shape4(1, si.h, si.w, 3));
            if (h == si.h && w == si.w) memcpy(dst.data, img, sizeof(float) * img_floats);
            else
                ops_cpu.resize_bilinear_forward(&ops_cpu, dst, tensor_f32(img, shape4(1, h, w, 3)));
        }
        if (ok) {
            o->upload(o, net.act[g.input], x, sizeof(float) * N * img_floats);
            net_forward(&net, N, 0);
            o->download(o, logits, net.act[out], sizeof(float) * N * out_floats);
        }
        for (int j = 0; ok && j < count; j++) {
            const char *path = list.paths[start + j];
            if (!seg)
                csv_write_prediction(f, path, logits + (size_t)j * K, K, pc->class_names,
                                     pc->n_class_names);
            else
                ok = seg_write(pc->out, path, imgs[j], hw[2 * j], hw[2 * j + 1],
                               logits + out_floats * j, so.h, so.w, K, err) == 0;
        }
        for (int j = 0; j < count; j++) { free(imgs[j]); imgs[j] = NULL; }
        // a terminal: one line rewritten; a log: a line per tenth of the images and the last
        const int done = start + count;
        if (pc->progress && tty) fprintf(stderr, "\rpredict: %d/%d images", done, list.n);
        else if (pc->progress && (done == list.n || (int64_t)(done - reported) * 10 >= list.n)) {
            fprintf(stderr, "predict: %d/%d images\n", done, list.n);
            reported = done;
        }
    }
    if (pc->progress && tty) fputc('\n', stderr);
    free(x); free(logits); free(imgs); free(hw);
    rc = f ? atomic_file_commit(f, tmp, pc->out, ok, err) : ok ? 0 : -1;
done_list:
    path_list_free(&list);
done_weights:
    safetensors_free(&wf);
done_net:
    net_free(&net);
    graph_free(&g);
    return rc;
}
