// safetensors.c -- safetensors files: the reader (a strict parser of the one header shape)
// and the writer.
// Plumbing of the segnet program: segnet.c (the math, the models, the step)
// includes this file at its end, so that the program is one translation unit.

// ----------------------------------------------------------------------------
// safetensors files
//
// The header parser is not a general JSON parser: it follows the one shape a
// safetensors header has (an object whose values are objects holding a string
// and arrays of integers; "__metadata__" an object of strings). It needs no
// recursion, and nesting beyond that shape is refused where it appears. Within
// that shape it is strict: RFC 8259 syntax, UTF-8 checked, no duplicate keys,
// no unknown fields, integers (no fraction or exponent) where integers belong.
//
// Layout rules enforced on read: every tensor's [begin, end) lies inside the
// data section, end - begin = numel·dtype_size, non-empty tensors do not
// overlap. Holes (bytes no tensor covers, between tensors or at the end) are
// accepted: they cost nothing to allow and break no invariant we rely on.
//
// Alignment: the data section starts at byte 8 + N and offsets are arbitrary,
// so SafetensorsTensor.data has no alignment guarantee; callers memcpy out of it.

// a longer header is absurd (real ones are kilobytes)
#define SF_HEADER_MAX   ((uint64_t)100 << 20)
#define SF_QUOTE_MAX    64                      // names shown in messages are cut to this

static const char *const SF_DTYPE_NAMES[] = {"F32", "F16", "BF16", "I64"};  // indexed by DType
#define SF_DTYPES ((int)(sizeof SF_DTYPE_NAMES / sizeof *SF_DTYPE_NAMES))

static void sf_errf(char *err, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void sf_errf(char *err, const char *fmt, ...) {
    if (!err) return;
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(err, SN_ERR_MAX, fmt, ap);
    va_end(ap);
}

// A name as shown in a message: one line (control bytes become '?') and at
// most SF_QUOTE_MAX bytes, cut on a UTF-8 boundary, "..." marking a cut.
static const char *sf_quote(char out[SF_QUOTE_MAX + 4], const char *s) {
    size_t n = strlen(s), k = n;
    if (k > SF_QUOTE_MAX) {
        k = SF_QUOTE_MAX;
        while (k > 0 && ((uint8_t)s[k] & 0xC0) == 0x80) k--;
    }
    for (size_t i = 0; i < k; i++) out[i] = (uint8_t)s[i] < 0x20 || s[i] == 0x7F ? '?' : s[i];
    strcpy(out + k, k < n ? "..." : "");
    return out;
}

// Length of the well-formed UTF-8 sequence at p (RFC 3629: no overlong forms,
// no surrogates, nothing above U+10FFFF), or 0 if there is none.
static size_t utf8_len(const uint8_t *p, size_t avail) {
    uint8_t c = p[0], lo = 0x80, hi = 0xBF;
    size_t n;
    if (c < 0x80) return 1;
    if (c >= 0xC2 && c <= 0xDF) n = 2;
    else if (c >= 0xE0 && c <= 0xEF) { n = 3; if (c == 0xE0) lo = 0xA0; if (c == 0xED) hi = 0x9F; }
    else if (c >= 0xF0 && c <= 0xF4) { n = 4; if (c == 0xF0) lo = 0x90; if (c == 0xF4) hi = 0x8F; }
    else return 0;
    if (avail < n || p[1] < lo || p[1] > hi) return 0;
    for (size_t i = 2; i < n; i++)
        if ((p[i] & 0xC0) != 0x80) return 0;
    return n;
}

static int utf8_valid(const char *s) {
    size_t n = strlen(s), k;
    for (size_t i = 0; i < n; i += k)
        if (!(k = utf8_len((const uint8_t *)s + i, n - i))) return 0;
    return 1;
}

// Encodes code point cp (< 0x110000, not a surrogate) as UTF-8; returns its length.
static size_t utf8_put(uint32_t cp, uint8_t out[4]) {
    if (cp < 0x80) { out[0] = (uint8_t)cp; return 1; }
    if (cp < 0x800) {
        out[0] = (uint8_t)(0xC0 | cp >> 6);
        out[1] = (uint8_t)(0x80 | (cp & 0x3F));
        return 2;
    }
    if (cp < 0x10000) {
        out[0] = (uint8_t)(0xE0 | cp >> 12); out[1] = (uint8_t)(0x80 | (cp >> 6 & 0x3F));
        out[2] = (uint8_t)(0x80 | (cp & 0x3F));
        return 3;
    }
    out[0] = (uint8_t)(0xF0 | cp >> 18); out[1] = (uint8_t)(0x80 | (cp >> 12 & 0x3F));
    out[2] = (uint8_t)(0x80 | (cp >> 6 & 0x3F)); out[3] = (uint8_t)(0x80 | (cp & 0x3F));
    return 4;
}

// numel = Π dims; -1 if it (or numel·elem) does not fit in a size_t.
static int sf_numel(const int64_t *dims, int ndim, size_t elem, size_t *numel) {
    size_t n = 1;
    for (int i = 0; i < ndim; i++)
        if (dims[i] == 0) { *numel = 0; return 0; }  // empty, whatever the other dims
    for (int i = 0; i < ndim; i++) {
        if ((uint64_t)dims[i] > SIZE_MAX / n) return -1;
        n *= (size_t)dims[i];
    }
    if (n > SIZE_MAX / elem) return -1;
    *numel = n;
    return 0;
}

// "[2, 3, 4]"
static const char *sf_shape_str(char *out, size_t cap, const int64_t *dims, int ndim) {
    size_t k = (size_t)snprintf(out, cap, "[");
    for (int i = 0; i < ndim && k < cap; i++)
        k += (size_t)snprintf(out + k, cap - k, "%s%" PRId64, i ? ", " : "", dims[i]);
    if (k < cap) snprintf(out + k, cap - k, "]");
    return out;
}

// ---- reading: the header parser

typedef struct {
    const uint8_t *s, *p, *end;  // header text, cursor, end
    const char *path;
    const char *tensor;          // the entry being parsed (for messages), or NULL
    char *err;
} Json;

static int jfail(Json *j, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int jfail(Json *j, const char *fmt, ...) {
    char msg[SN_ERR_MAX], q[SF_QUOTE_MAX + 4];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (j->tensor) sf_errf(j->err, "%s: tensor '%s': %s", j->path, sf_quote(q, j->tensor), msg);
    else sf_errf(j->err, "%s: %s", j->path, msg);
    return -1;
}
static int jsyntax(Json *j, const char *what) {
    return jfail(j, "header is not valid JSON: %s at byte %zu of the header", what,
                 (size_t)(j->p - j->s));
}

static void jws(Json *j) {
    while (j->p < j->end && (*j->p == ' ' || *j->p == '\t' || *j->p == '\n' || *j->p == '\r'))
        j->p++;
}
static int jpeek(Json *j) { jws(j); return j->p < j->end ? *j->p : -1; }
// consumes c, after whitespace, if it comes next
static int jeat(Json *j, int c) {
    if (jpeek(j) != c) return 0;
    j->p++;
    return 1;
}

static int jhex4(Json *j, uint32_t *v) {
    *v = 0;
    for (int i = 0; i < 4; i++, j->p++) {
        int c = j->p < j->end ? *j->p : -1, d;
        if (c >= '0' && c <= '9') d = c - '0';
        else if (c >= 'a' && c <= 'f') d = c - 'a' + 10;
        else if (c >= 'A' && c <= 'F') d = c - 'A' + 10;
        else return jsyntax(j, "\\u needs 4 hex digits");
        *v = *v << 4 | (uint32_t)d;
    }
    return 0;
}

// A JSON string, decoded into out. At most cap-1 bytes are kept (cut on a
// UTF-8 boundary, NUL-terminated); *len is the full decoded length, so
// *len >= cap means it did not fit. \u0000 is refused: names are C strings.
static int jstring(Json *j, char *out, size_t cap, size_t *len) {
    if (!jeat(j, '"')) return jsyntax(j, "expected a string");
    size_t n = 0, kept = 0;
    for (;;) {
        if (j->p >= j->end) return jsyntax(j, "unterminated string");
        uint8_t c = *j->p, buf[4];
        size_t k = 1;
        if (c == '"') { j->p++; break; }
        if (c < 0x20) return jsyntax(j, "control character inside a string");
        if (c == '\\') {
            if (j->end - j->p < 2) return jsyntax(j, "unterminated string");
            c = j->p[1];
            j->p += 2;
            switch (c) {
            case '"': case '\\': case '/': buf[0] = c; break;
            case 'b': buf[0] = '\b'; break;
            case 'f': buf[0] = '\f'; break;
            case 'n': buf[0] = '\n'; break;
            case 'r': buf[0] = '\r'; break;
            case 't': buf[0] = '\t'; break;
            case 'u': {
                uint32_t cp, lo;
                if (jhex4(j, &cp)) return -1;
                if (cp >= 0xDC00 && cp <= 0xDFFF)
                    return jsyntax(j, "unpaired low surrogate in \\u escape");
                // UTF-16 pair: 0x10000 + (hi - 0xD800)·2^10 + (lo - 0xDC00)
                if (cp >= 0xD800 && cp <= 0xDBFF) {
                    if (j->end - j->p < 2 || j->p[0] != '\\' || j->p[1] != 'u')
                        return jsyntax(j, "unpaired high surrogate in \\u escape");
                    j->p += 2;
                    if (jhex4(j, &lo)) return -1;
                    if (lo < 0xDC00 || lo > 0xDFFF)
                        return jsyntax(j, "unpaired high surrogate in \\u escape");
                    cp = 0x10000 + ((cp - 0xD800) << 10) + (lo - 0xDC00);
                }
                if (cp == 0) return jsyntax(j, "\\u0000 inside a string");
                k = utf8_put(cp, buf);
                break;
            }
            default: j->p -= 2; return jsyntax(j, "unknown escape inside a string");
            }
        } else {
            if (!(k = utf8_len(j->p, (size_t)(j->end - j->p))))
                return jfail(j, "header is not valid UTF-8 at byte %zu of the header",
                             (size_t)(j->p - j->s));
            memcpy(buf, j->p, k);
            j->p += k;
        }
        if (kept == n && n + k < cap) { memcpy(out + n, buf, k); kept += k; }
        n += k;
    }
    if (cap) out[kept] = 0;
    *len = n;
    return 0;
}

// A JSON string of any length into a malloc'd buffer: decoding never makes a
// string longer than its source, so the header's remaining bytes bound it.
static int jstring_alloc(Json *j, char **out) {
    size_t len, cap = (size_t)(j->end - j->p) + 1;
    if (!(*out = malloc(cap))) return jfail(j, "out of memory reading a string of the header");
    if (jstring(j, *out, cap, &len)) return -1;
    char *fit = realloc(*out, len + 1);
    if (fit) *out = fit;
    return 0;
}

// A JSON number that must be an integer within int64.
static int jint(Json *j, int64_t *v, const char *what) {
    jws(j);
    const uint8_t *p = j->p, *q = p;
    int neg = p < j->end && *p == '-';
    if (neg) p++;
    if (p >= j->end || *p < '0' || *p > '9') return jfail(j, "%s must be an integer", what);
    if (*p == '0' && p + 1 < j->end && p[1] >= '0' && p[1] <= '9')
        return jsyntax(j, "number with a leading zero");
    uint64_t u = 0;
    int big = 0;
    for (; p < j->end && *p >= '0' && *p <= '9'; p++) {
        unsigned d = *p - '0';
        if (u > (UINT64_MAX - d) / 10) big = 1;
        else u = u * 10 + d;
    }
    if (p < j->end && (*p == '.' || *p == 'e' || *p == 'E')) {
        while (q < j->end && q - j->p < 32 && strchr("+-.eE0123456789", *q) && *q) q++;
        return jfail(j, "%s %.*s is not an integer", what, (int)(q - j->p), (const char *)j->p);
    }
    if (big || u > (uint64_t)INT64_MAX + neg) return jfail(j, "%s is too large", what);
    j->p = p;
    *v = neg ? (u == (uint64_t)INT64_MAX + 1 ? INT64_MIN : -(int64_t)u) : (int64_t)u;
    return 0;
}

// {"dtype": "F32", "shape": [d0, ...], "data_offsets": [begin, end]}, fields in
// any order, each exactly once. data: the data section, data_len bytes.
static int sf_parse_tensor(Json *j, SafetensorsTensor *t, const uint8_t *data, size_t data_len) {
    char field[32], dtype[16] = "", q[SF_QUOTE_MAX + 4], shape[256];
    size_t len;
    int have_dtype = 0, have_shape = 0, n_off = -1;
    int64_t off[2];
    if (!jeat(j, '{'))
        return jfail(j, "entry must be an object with \"dtype\", \"shape\" and \"data_offsets\"");
    if (!jeat(j, '}')) for (;;) {
        if (jstring(j, field, sizeof field, &len)) return -1;
        if (!jeat(j, ':')) return jsyntax(j, "expected ':'");
        if (!strcmp(field, "dtype")) {
            if (have_dtype++) return jfail(j, "\"dtype\" appears twice");
            if (jpeek(j) != '"') return jfail(j, "\"dtype\" must be a string");
            if (jstring(j, dtype, sizeof dtype, &len)) return -1;
        } else if (!strcmp(field, "shape")) {
            if (have_shape++) return jfail(j, "\"shape\" appears twice");
            if (!jeat(j, '[')) return jfail(j, "\"shape\" must be an array of integers");
            t->ndim = 0;
            if (!jeat(j, ']')) for (;;) {
                    if (t->ndim == SF_MAX_DIMS)
                        return jfail(j, "shape has more than %d dimensions", SF_MAX_DIMS);
                    int64_t d;
                    if (jint(j, &d, "shape entry")) return -1;
                    if (d < 0) return jfail(j, "shape entry %" PRId64 " is negative", d);
                    t->dims[t->ndim++] = d;
                    if (jeat(j, ']')) break;
                    if (!jeat(j, ',')) return jsyntax(j, "expected ',' or ']' in \"shape\"");
            }
        } else if (!strcmp(field, "data_offsets")) {
            if (n_off >= 0) return jfail(j, "\"data_offsets\" appears twice");
            if (!jeat(j, '[')) return jfail(j, "\"data_offsets\" must be an array [begin, end]");
            n_off = 0;
            if (!jeat(j, ']')) for (;;) {
                    if (n_off == 2)
                        return jfail(j,
                                     "\"data_offsets\" must be [begin, end]: more than 2 entries");
                    if (jint(j, &off[n_off], "data_offsets entry")) return -1;
                    if (off[n_off] < 0)
                        return jfail(j, "data_offsets entry %" PRId64 " is negative", off[n_off]);
                    n_off++;
                    if (jeat(j, ']')) break;
                    if (!jeat(j, ',')) return jsyntax(j, "expected ',' or ']' in \"data_offsets\"");
            }
            if (n_off != 2)
                return jfail(j, "\"data_offsets\" must be [begin, end]: %d entries", n_off);
        } else {
            return jfail(j, "unknown field \"%s\"", sf_quote(q, field));
        }
        if (jeat(j, '}')) break;
        if (!jeat(j, ',')) return jsyntax(j, "expected ',' or '}'");
    }
    if (!have_dtype) return jfail(j, "missing \"dtype\"");
    if (!have_shape) return jfail(j, "missing \"shape\"");
    if (n_off < 0) return jfail(j, "missing \"data_offsets\"");

    int dt = -1;
    for (int k = 0; k < SF_DTYPES; k++)
        if (!strcmp(dtype, SF_DTYPE_NAMES[k])) dt = k;
    if (dt < 0)
        return jfail(j, "dtype \"%s\" is not supported (segnet reads F32, F16, BF16, I64)",
                     sf_quote(q, dtype));
    t->dtype = (DType)dt;
    size_t elem = dtype_size(t->dtype);
    sf_shape_str(shape, sizeof shape, t->dims, t->ndim);
    if (sf_numel(t->dims, t->ndim, elem, &t->numel))
        return jfail(j, "shape %s overflows: its byte size does not fit in size_t", shape);
    if (off[0] > off[1])
        return jfail(j, "data_offsets [%" PRId64 ", %" PRId64 "]: begin > end", off[0], off[1]);
    if ((uint64_t)off[1] > data_len)
        return jfail(j,
                     "data_offsets [%" PRId64 ", %" PRId64 "] run past the end of the data section "
                     "(%zu bytes): the file is truncated or the offsets are wrong",
                     off[0], off[1], data_len);
    if ((uint64_t)(off[1] - off[0]) != t->numel * elem)
        return jfail(j,
                     "data_offsets [%" PRId64 ", %" PRId64 "] hold %" PRId64
                     " bytes, but shape %s of %s needs %zu",
                     off[0], off[1], off[1] - off[0], shape, dtype, t->numel * elem);
    t->data = data + off[0];
    return 0;
}

// "__metadata__": {"key": "value", ...}; keys and values of any length (the
// header's limit bounds them), each in its own allocation
static int sf_parse_meta(Json *j, SafetensorsFile *f, size_t *cap) {
    char q[SF_QUOTE_MAX + 4];
    if (!jeat(j, '{')) return jfail(j, "\"__metadata__\" must be an object of strings");
    if (!jeat(j, '}')) for (;;) {
        if (f->n_meta == INT32_MAX) return jfail(j, "too many \"__metadata__\" entries");
        if ((size_t)f->n_meta == *cap) {
            size_t c = *cap ? 2 * *cap : 8;
            void *k = realloc(f->meta_keys, c * sizeof *f->meta_keys);
            if (k) f->meta_keys = k;
            void *v = realloc(f->meta_values, c * sizeof *f->meta_values);
            if (v) f->meta_values = v;
            if (!k || !v) return jfail(j, "out of memory reading \"__metadata__\"");
            *cap = c;
        }
        char **key = &f->meta_keys[f->n_meta], **val = &f->meta_values[f->n_meta];
        *key = *val = NULL;
        f->n_meta++;  // owned from here: safetensors_free frees what is set
        if (jstring_alloc(j, key)) return -1;
        if (!jeat(j, ':')) return jsyntax(j, "expected ':'");
        if (jpeek(j) != '"')
            return jfail(j, "\"__metadata__\" '%s': value must be a string", sf_quote(q, *key));
        if (jstring_alloc(j, val)) return -1;
        if (jeat(j, '}')) break;
        if (!jeat(j, ',')) return jsyntax(j, "expected ',' or '}' in \"__metadata__\"");
    }
    return 0;
}

static int sf_parse_header(Json *j, SafetensorsFile *f, const uint8_t *data, size_t data_len) {
    char name[SN_NAME_MAX], q[SF_QUOTE_MAX + 4];
    size_t len, cap_t = 0, cap_m = 0;
    int have_meta = 0;
    if (!jeat(j, '{'))
        return jfail(j, "header is not a JSON object (no '{' at byte %zu of the header)",
                     (size_t)(j->p - j->s));
    if (!jeat(j, '}')) for (;;) {
        if (jstring(j, name, sizeof name, &len)) return -1;
        if (!jeat(j, ':')) return jsyntax(j, "expected ':'");
        if (!strcmp(name, "__metadata__")) {
            if (have_meta++) return jfail(j, "\"__metadata__\" appears twice");
            if (sf_parse_meta(j, f, &cap_m)) return -1;
        } else {
            if (len >= SN_NAME_MAX)
                return jfail(j, "tensor name '%s' is %zu bytes, longer than the %d allowed",
                             sf_quote(q, name), len, SN_NAME_MAX - 1);
            if (f->n_tensors == INT32_MAX) return jfail(j, "too many tensors");
            if ((size_t)f->n_tensors == cap_t) {
                size_t c = cap_t ? 2 * cap_t : 16;
                SafetensorsTensor *t = realloc(f->tensors, c * sizeof *t);
                if (!t) return jfail(j, "out of memory reading the header");
                f->tensors = t;
                cap_t = c;
            }
            SafetensorsTensor *t = &f->tensors[f->n_tensors];
            memset(t, 0, sizeof *t);
            memcpy(t->name, name, len + 1);
            j->tensor = t->name;
            if (sf_parse_tensor(j, t, data, data_len)) return -1;
            j->tensor = NULL;
            f->n_tensors++;
        }
        if (jeat(j, '}')) break;
        if (!jeat(j, ',')) return jsyntax(j, "expected ',' or '}'");
    }
    jws(j);  // the writer's padding
    if (j->p != j->end) return jsyntax(j, "text after the header object");
    return 0;
}

// ---- reading: whole-file checks

static int cmp_name(const void *a, const void *b) {
    return strcmp(*(const char *const *)a, *(const char *const *)b);
}

// The first name (in sorted order) that occurs twice, or NULL. Sorts names.
static const char *sf_duplicate(const char **names, size_t n) {
    qsort(names, n, sizeof *names, cmp_name);
    for (size_t i = 1; i < n; i++)
        if (!strcmp(names[i - 1], names[i])) return names[i];
    return NULL;
}

static int cmp_tensor_begin(const void *a, const void *b) {
    const uint8_t *x = (*(const SafetensorsTensor *const *)a)->data,
                  *y = (*(const SafetensorsTensor *const *)b)->data;
    return x < y ? -1 : x > y;
}

// Names are unique; non-empty tensors do not overlap (empty ones cover no byte).
static int sf_check_layout(const SafetensorsFile *f, const uint8_t *data, const char *path,
                           char *err) {
    size_t n = (size_t)f->n_tensors;
    char q1[SF_QUOTE_MAX + 4], q2[SF_QUOTE_MAX + 4];
    const char **names = malloc(sizeof *names * (n ? n : 1));
    const SafetensorsTensor **by_begin = malloc(sizeof *by_begin * (n ? n : 1));
    int rc = -1;
    if (!names || !by_begin) {
        sf_errf(err, "%s: out of memory checking the tensor table", path);
        goto done;
    }
    for (size_t i = 0; i < n; i++) names[i] = f->tensors[i].name;
    const char *dup = sf_duplicate(names, n);
    if (dup) {
        sf_errf(err, "%s: tensor '%s' appears twice (duplicate name)", path, sf_quote(q1, dup));
        goto done;
    }
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (f->tensors[i].numel) by_begin[m++] = &f->tensors[i];
    qsort(by_begin, m, sizeof *by_begin, cmp_tensor_begin);
    // sorted by begin, each must start at or after the furthest end so far
    const SafetensorsTensor *reach = NULL;
    const uint8_t *reach_end = NULL;
    for (size_t i = 0; i < m; i++) {
        const SafetensorsTensor *t = by_begin[i];
        const uint8_t *b = t->data, *e = b + t->numel * dtype_size(t->dtype);
        if (reach && b < reach_end) {
            sf_errf(err,
                    "%s: tensors '%s' and '%s' overlap in the data section: bytes [%zu, %zu) and "
                    "[%zu, %zu)",
                    path, sf_quote(q1, reach->name), sf_quote(q2, t->name),
                    (size_t)((const uint8_t *)reach->data - data), (size_t)(reach_end - data),
                    (size_t)(b - data), (size_t)(e - data));
            goto done;
        }
        if (!reach || e > reach_end) { reach = t; reach_end = e; }
    }
    rc = 0;
done:
    free(names);
    free(by_begin);
    return rc;
}

void safetensors_free(SafetensorsFile *f) {
    free(f->tensors);
    for (int i = 0; i < f->n_meta; i++) { free(f->meta_keys[i]); free(f->meta_values[i]); }
    free(f->meta_keys);
    free(f->meta_values);
    free(f->bytes);
    memset(f, 0, sizeof *f);
}

// A descriptor for reading path only if it is a regular file: opening a FIFO
// waits for a writer, reading a device never ends (O_NONBLOCK, then blocking
// again). -1 with *why, errno kept from open (EINVAL: not a regular file).
static int open_regular(const char *path, struct stat *sb, const char **why) {
    int fd = open(path, O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    if (fd < 0) { *why = strerror(errno); return -1; }
    if (fstat(fd, sb) || !S_ISREG(sb->st_mode)) {
        close(fd);
        *why = "not a regular file";
        errno = EINVAL;
        return -1;
    }
    if (fcntl(fd, F_SETFL, 0)) { *why = strerror(errno); close(fd); return -1; }
    return fd;
}

// open_regular as a FILE (NULL with *why)
static FILE *fopen_regular_stat(const char *path, const char *mode, struct stat *sb,
                                const char **why) {
    int fd = open_regular(path, sb, why);
    FILE *f = fd < 0 ? NULL : fdopen(fd, mode);
    if (fd >= 0 && !f) { *why = strerror(errno); close(fd); }
    return f;
}

// ... NULL with err ("path: why"), errno as open_regular's
static FILE *fopen_regular(const char *path, const char *mode, char err[SN_ERR_MAX]) {
    struct stat sb;
    const char *why;
    FILE *f = fopen_regular_stat(path, mode, &sb, &why);
    if (!f) snprintf(err, SN_ERR_MAX, "%.400s: %s", path, why);
    return f;
}

int safetensors_read(const char *path, SafetensorsFile *f, char err[SN_ERR_MAX]) {
    memset(f, 0, sizeof *f);
    struct stat sb;
    const char *why;
    FILE *fp = fopen_regular_stat(path, "rb", &sb, &why);
    if (!fp) { sf_errf(err, "%s: cannot open: %s", path, why); return -1; }
    if ((uint64_t)sb.st_size > SIZE_MAX) {
        sf_errf(err, "%s: too large to load", path);
        fclose(fp);
        return -1;
    }
    size_t n = (size_t)sb.st_size;
    f->bytes = malloc(n ? n : 1);
    if (!f->bytes) {
        sf_errf(err, "%s: out of memory loading %zu bytes", path, n);
        fclose(fp);
        return -1;
    }
    size_t got = fread(f->bytes, 1, n, fp);
    int read_err = ferror(fp);
    fclose(fp);
    if (got != n) {
        sf_errf(err, "%s: %s after %zu of %zu bytes", path,
                read_err ? "read error" : "file shrank while reading", got, n);
        safetensors_free(f);
        return -1;
    }
    f->n_bytes = n;
    if (n < 8) {
        sf_errf(err,
                "%s: file is %zu bytes, too short for safetensors (an 8-byte header length comes "
                "first)",
                path, n);
        safetensors_free(f);
        return -1;
    }
    uint64_t hlen = 0;
    for (int i = 7; i >= 0; i--) hlen = hlen << 8 | f->bytes[i];
    if (hlen > n - 8) {
        sf_errf(err,
                "%s: header length %" PRIu64
                " runs past the end of the file (%zu bytes): truncated or not safetensors",
                path, hlen, n);
        safetensors_free(f);
        return -1;
    }
    if (hlen > SF_HEADER_MAX) {
        sf_errf(err, "%s: header length %" PRIu64 " is absurd (over %" PRIu64 " MB)", path, hlen,
                SF_HEADER_MAX >> 20);
        safetensors_free(f);
        return -1;
    }
    Json j = {f->bytes + 8, f->bytes + 8, f->bytes + 8 + hlen, path, NULL, err};
    const uint8_t *data = f->bytes + 8 + hlen;
    if (sf_parse_header(&j, f, data, n - 8 - (size_t)hlen) || sf_check_layout(f, data, path, err)) {
        safetensors_free(f);
        return -1;
    }
    return 0;
}

const SafetensorsTensor *safetensors_find(const SafetensorsFile *f, const char *name) {
    for (int i = 0; i < f->n_tensors; i++)
        if (!strcmp(f->tensors[i].name, name)) return &f->tensors[i];
    return NULL;
}

// ---- writing

typedef struct { char *p; size_t n, cap; int oom; } SfBuf;

static void sb_put(SfBuf *b, const char *s, size_t k) {
    if (b->oom) return;
    if (b->n + k > b->cap) {
        size_t c = b->cap ? b->cap : 256;
        while (c < b->n + k) c *= 2;
        char *p = realloc(b->p, c);
        if (!p) { b->oom = 1; return; }
        b->p = p;
        b->cap = c;
    }
    memcpy(b->p + b->n, s, k);
    b->n += k;
}
static void sb_str(SfBuf *b, const char *s) { sb_put(b, s, strlen(s)); }

// a JSON string: '"' and '\' escaped, control bytes as \u00XX, UTF-8 as is
static void sb_json(SfBuf *b, const char *s) {
    sb_put(b, "\"", 1);
    for (; *s; s++) {
        char e[8];
        if (*s == '"' || *s == '\\') { e[0] = '\\'; e[1] = *s; sb_put(b, e, 2);
        } else if ((uint8_t)*s < 0x20) {
            snprintf(e, sizeof e, "\\u%04x", (unsigned)(uint8_t)*s);
            sb_put(b, e, 6);
        } else
            sb_put(b, s, 1);
    }
    sb_put(b, "\"", 1);
}

// Refuses what safetensors_read would refuse, so every file written reads back.
static int sf_check_write_args(const char *path, const SafetensorsTensor *ts, int n,
                               const char *const *mk, const char *const *mv, int n_meta,
                               char *err) {
    char q[SF_QUOTE_MAX + 4];
    if (n < 0 || n_meta < 0 || (n && !ts) || (n_meta && (!mk || !mv))) {
        sf_errf(err, "%s: bad arguments (%d tensors, %d metadata entries)", path, n, n_meta);
        return -1;
    }
    for (int i = 0; i < n; i++) {
        const SafetensorsTensor *t = &ts[i];
        if (strnlen(t->name, SN_NAME_MAX) == SN_NAME_MAX) {
            sf_errf(err, "%s: tensor %d: name is not NUL-terminated within %d bytes", path, i,
                    SN_NAME_MAX);
            return -1;
        }
        const char *nm = sf_quote(q, t->name);
        size_t numel;
        if (!utf8_valid(t->name) || !strcmp(t->name, "__metadata__")) {
            sf_errf(err, "%s: tensor '%s': invalid name (not UTF-8, or \"__metadata__\")", path,
                    nm);
            return -1;
        }
        if ((unsigned)t->dtype >= (unsigned)SF_DTYPES) {
            sf_errf(err, "%s: tensor '%s': unknown dtype %d", path, nm, (int)t->dtype);
            return -1;
        }
        if (t->ndim < 0 || t->ndim > SF_MAX_DIMS) {
            sf_errf(err, "%s: tensor '%s': ndim %d is outside 0..%d", path, nm, t->ndim,
                    SF_MAX_DIMS);
            return -1;
        }
        for (int d = 0; d < t->ndim; d++)
            if (t->dims[d] < 0) {
                sf_errf(err, "%s: tensor '%s': negative dimension %" PRId64, path, nm, t->dims[d]);
                return -1;
            }
        if (sf_numel(t->dims, t->ndim, dtype_size(t->dtype), &numel) || numel != t->numel) {
            sf_errf(err, "%s: tensor '%s': numel %zu does not match its shape", path, nm, t->numel);
            return -1;
        }
        if (numel && !t->data) {
            sf_errf(err, "%s: tensor '%s': data is NULL", path, nm);
            return -1;
        }
    }
    for (int i = 0; i < n_meta; i++) {
        if (!mk[i] || !mv[i] || !utf8_valid(mk[i]) || !utf8_valid(mv[i])) {
            sf_errf(err, "%s: metadata entry %d: key and value must be UTF-8 strings", path, i);
            return -1;
        }
    }
    const char **names = malloc(sizeof *names * (size_t)(n > n_meta ? n : n_meta ? n_meta : 1));
    if (!names) { sf_errf(err, "%s: out of memory", path); return -1; }
    const char *dup;
    for (int i = 0; i < n; i++) names[i] = ts[i].name;
    if ((dup = sf_duplicate(names, (size_t)n)))
        sf_errf(err, "%s: tensor '%s' appears twice (duplicate name)", path, sf_quote(q, dup));
    else {
        for (int i = 0; i < n_meta; i++) names[i] = mk[i];
        if ((dup = sf_duplicate(names, (size_t)n_meta)))
            sf_errf(err, "%s: metadata key '%s' appears twice", path, sf_quote(q, dup));
    }
    free(names);
    return dup ? -1 : 0;
}

// ---- atomic replacement of a file: write a temporary file beside path (see
// atomic_tmp_name), fsync it, rename it over path, fsync the folder. A crash
// at any moment leaves either the old file or the new one, never a mix.

#define OUT_PATH_MAX 4200  // the buffers of output paths: a path may have PATH_MAX - 1 bytes
#define TMP_MARK ".tmp."   // "<name>.tmp.<pid>": run_remove_stale finds a dead writer's files by it

// The last component of path (after its last '/').
static const char *path_base(const char *path) {
    const char *slash = strrchr(path, '/');
    return slash ? slash + 1 : path;
}

// The folder path lies in: "." for a bare name, "/" for one at the root.
static void path_folder(const char *path, char dir[OUT_PATH_MAX]) {
    const char *slash = strrchr(path, '/');
    if (!slash) snprintf(dir, OUT_PATH_MAX, ".");
    else if (slash == path) snprintf(dir, OUT_PATH_MAX, "/");
    else snprintf(dir, OUT_PATH_MAX, "%.*s", (int)(slash - path), path);
}

// An output path the file system takes: its name within NAME_MAX bytes, the
// whole within PATH_MAX - 1. Checked with the other inputs, before anything is
// written (a name too long found at the last file would leave the others written).
static int out_path_check(const char *path, char err[SN_ERR_MAX]) {
    const size_t base = strlen(path_base(path)), whole = strlen(path);
    if (base > NAME_MAX)
        snprintf(err, SN_ERR_MAX,
                 "%.300s...: the file name is %zu bytes, more than the %d a file system takes",
                 path, base, NAME_MAX);
    else if (whole >= PATH_MAX)
        snprintf(err, SN_ERR_MAX,
                 "%.300s...: the path is %zu bytes, more than the %d a path may have", path, whole,
                 PATH_MAX - 1);
    else
        return 0;
    return -1;
}

// "<name>.tmp.<pid>" in path's folder, the name cut short so that the whole
// fits NAME_MAX (any legal name may be written; the temporary one is ours).
static void atomic_tmp_name(const char *path, char tmp[OUT_PATH_MAX]) {
    char suffix[32];
    const int n_suffix = snprintf(suffix, sizeof suffix, TMP_MARK "%ld", (long)getpid());
    const char *base = path_base(path);
    const int dir = (int)(base - path), keep = (int)strnlen(base, NAME_MAX - n_suffix);
    snprintf(tmp, OUT_PATH_MAX, "%.*s%.*s%s", dir, path, keep, base, suffix);
}

// The writer's process id in a temporary file's name (after its last TMP_MARK), or 0 when
// the name is not one
static long tmp_name_pid(const char *name) {
    const char *tmp = NULL;  // the last mark: the file's own name may hold one
    for (const char *p = name; (p = strstr(p, TMP_MARK)); p++) tmp = p;
    if (!tmp) return 0;
    char *end;
    const char *digits = tmp + strlen(TMP_MARK);
    const long pid = strtol(digits, &end, 10);
    return end == digits || *end || pid <= 0 || !isdigit((unsigned char)*digits) ? 0 : pid;
}

// the process is gone (not merely another user's, which kill may not signal)
static int tmp_writer_gone(long pid) { return kill((pid_t)pid, 0) != 0 && errno == ESRCH; }

// ---- temporary files of writers that were killed: "<name>.tmp.<pid>" whose
// process is gone is removed at the next write to <name>. The folder is read
// once per folder written (a prediction writes thousands of files into one):
// its stale names are kept until a write goes to another folder.
static struct {
    pthread_mutex_t lock;
    char dir[OUT_PATH_MAX];
    char **names;
    int n, cap;
} stale_tmp = {PTHREAD_MUTEX_INITIALIZER, "", NULL, 0, 0};

static void stale_tmp_remove(const char *path) {
    char dir[OUT_PATH_MAX];
    path_folder(path, dir);
    pthread_mutex_lock(&stale_tmp.lock);
    if (strcmp(dir, stale_tmp.dir)) {
        for (int i = 0; i < stale_tmp.n; i++) free(stale_tmp.names[i]);
        stale_tmp.n = 0;
        snprintf(stale_tmp.dir, OUT_PATH_MAX, "%s", dir);
        DIR *d = opendir(dir);
        for (struct dirent *e; d && (e = readdir(d));) {
            const long pid = tmp_name_pid(e->d_name);
            if (!pid || !tmp_writer_gone(pid)) continue;
            GROW(stale_tmp.names, stale_tmp.n, stale_tmp.cap);
            char *name = strdup(e->d_name);
            snCheck(name != NULL, "out of host memory");
            stale_tmp.names[stale_tmp.n++] = name;
        }
        if (d) closedir(d);
    }
    // <name>'s own: the name cut short as atomic_tmp_name cuts it for that pid's mark
    const char *base = path_base(path);
    for (int i = 0; i < stale_tmp.n; i++) {
        const char *name = stale_tmp.names[i];
        const long pid = tmp_name_pid(name);
        char mark[32];
        const int n_mark = snprintf(mark, sizeof mark, TMP_MARK "%ld", pid),
                  keep = (int)strnlen(base, NAME_MAX - n_mark);
        if ((int)strlen(name) != keep + n_mark || strncmp(name, base, keep) ||
            strcmp(name + keep, mark))
            continue;
        char tmp[OUT_PATH_MAX];
        snprintf(tmp, sizeof tmp, "%.*s%s", (int)(base - path), path, name);
        if (tmp_writer_gone(pid)) unlink(tmp);
        free(stale_tmp.names[i]);
        stale_tmp.names[i--] = stale_tmp.names[--stale_tmp.n];
    }
    pthread_mutex_unlock(&stale_tmp.lock);
}

// ---- a signal during an atomic write (export, predict: cli.c's tmp_cleanup_install):
// the temporary file is removed and the process exits 128 + the signal. The
// path lies in one of two slots, the live one's index stored after it, so that
// a handler on any thread reads a whole path.
static char tmp_slots[2][OUT_PATH_MAX];
static int tmp_live = -1;

static void tmp_track(const char *tmp) {
    const int slot = __atomic_load_n(&tmp_live, __ATOMIC_ACQUIRE) == 0;
    snprintf(tmp_slots[slot], OUT_PATH_MAX, "%s", tmp);
    __atomic_store_n(&tmp_live, slot, __ATOMIC_RELEASE);
}
static void tmp_untrack(void) { __atomic_store_n(&tmp_live, -1, __ATOMIC_RELEASE); }

// The temporary file, created new (O_EXCL): never a file or link that is
// already there (a link planted at the name would redirect the write). A test
// stops the process (SIGSTOP) once its Nth temporary file exists, N from
// SEGNET_TEST_STOP_AT_WRITE, to signal it there.
static FILE *atomic_file_open(const char *path, char tmp[OUT_PATH_MAX], char err[SN_ERR_MAX]) {
    if (out_path_check(path, err)) return NULL;
    stale_tmp_remove(path);
    atomic_tmp_name(path, tmp);
    tmp_track(tmp);
    const int fd = open(tmp, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0666);
    FILE *f = fd < 0 ? NULL : fdopen(fd, "wb");
    if (f) {
        static int writes;
        const char *stop = getenv("SEGNET_TEST_STOP_AT_WRITE");
        if (stop && __atomic_add_fetch(&writes, 1, __ATOMIC_RELAXED) == atoi(stop)) raise(SIGSTOP);
        return f;
    }
    tmp_untrack();
    if (fd >= 0) close(fd);
    if (errno == EEXIST)
        snprintf(err, SN_ERR_MAX,
                 "%.200s: cannot write: its temporary file %.200s is already there (not this "
                 "process's; remove it)",
                 path, path_base(tmp));
    else
        snprintf(err, SN_ERR_MAX, "%.400s: cannot write: %s", path, strerror(errno));
    return NULL;
}

// Closes f and renames tmp over path if ok (else, or on a failure, removes tmp).
// ok = 0 means the writer failed and has already set err.
static int atomic_file_commit(FILE *f, const char *tmp, const char *path, int ok,
                              char err[SN_ERR_MAX]) {
    if (ok && (fflush(f) != 0 || ferror(f) || fsync(fileno(f)) != 0)) {
        snprintf(err, SN_ERR_MAX, "%.400s: cannot write: %s", path, strerror(errno));
        ok = 0;
    }
    if (fclose(f) != 0 && ok) {
        snprintf(err, SN_ERR_MAX, "%.400s: cannot write: %s", path, strerror(errno));
        ok = 0;
    }
    if (ok && rename(tmp, path) != 0) {
        snprintf(err, SN_ERR_MAX, "%.400s: renaming the new file over it failed: %s", path,
                 strerror(errno));
        ok = 0;
    }
    if (!ok) unlink(tmp);
    tmp_untrack();
    if (!ok) return -1;
    // The file is in place; syncing the folder makes the rename itself durable.
    char dir[OUT_PATH_MAX];
    path_folder(path, dir);
    int dfd = open(dir, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (dfd < 0 || fsync(dfd)) {
        snprintf(err, SN_ERR_MAX, "%.400s: written, but syncing its folder failed: %s", path,
                 strerror(errno));
        if (dfd >= 0) close(dfd);
        return -1;
    }
    close(dfd);
    return 0;
}

int file_write_atomic(const char *path, const void *const *parts, const size_t *sizes, int n_parts,
                      char err[SN_ERR_MAX]) {
    char tmp[OUT_PATH_MAX];
    FILE *f = atomic_file_open(path, tmp, err);
    if (!f) return -1;
    int ok = 1;
    // an empty part may be NULL
    for (int i = 0; ok && i < n_parts; i++)
        ok = !sizes[i] || fwrite(parts[i], 1, sizes[i], f) == sizes[i];
    if (!ok) snprintf(err, SN_ERR_MAX, "%.400s: cannot write: %s", path, strerror(errno));
    return atomic_file_commit(f, tmp, path, ok, err);
}

int safetensors_write(const char *path, const SafetensorsTensor *tensors, int n,
                      const char *const *meta_keys, const char *const *meta_values, int n_meta,
                      char err[SN_ERR_MAX]) {
    if (sf_check_write_args(path, tensors, n, meta_keys, meta_values, n_meta, err)) return -1;

    // the header: compact JSON, "__metadata__" first, tensors contiguous in order
    SfBuf h = {0};
    char num[64];
    size_t off = 0;
    sb_str(&h, "{");
    if (n_meta) {
        sb_str(&h, "\"__metadata__\":{");
        for (int i = 0; i < n_meta; i++) {
            if (i) sb_str(&h, ",");
            sb_json(&h, meta_keys[i]);
            sb_str(&h, ":");
            sb_json(&h, meta_values[i]);
        }
        sb_str(&h, "}");
    }
    for (int i = 0; i < n; i++) {
        const SafetensorsTensor *t = &tensors[i];
        size_t bytes = t->numel * dtype_size(t->dtype);
        if (off > SIZE_MAX - bytes) {
            free(h.p);
            sf_errf(err, "%s: total size overflows", path);
            return -1;
        }
        sb_str(&h, n_meta || i ? "," : "");
        sb_json(&h, t->name);
        sb_str(&h, ":{\"dtype\":\"");
        sb_str(&h, SF_DTYPE_NAMES[t->dtype]);
        sb_str(&h, "\",\"shape\":[");
        for (int d = 0; d < t->ndim; d++) {
            snprintf(num, sizeof num, "%s%" PRId64, d ? "," : "", t->dims[d]);
            sb_str(&h, num);
        }
        snprintf(num, sizeof num, "],\"data_offsets\":[%zu,%zu]}", off, off + bytes);
        sb_str(&h, num);
        off += bytes;
    }
    sb_str(&h, "}");
    while ((8 + h.n) % 8) sb_str(&h, " ");  // the data section starts 8-byte aligned
    if (h.oom) {
        free(h.p);
        sf_errf(err, "%s: out of memory building the header", path);
        return -1;
    }
    uint8_t len8[8];
    for (int i = 0; i < 8; i++) len8[i] = (uint8_t)((uint64_t)h.n >> (8 * i));

    const int n_parts = n + 2;
    const void **parts = malloc(sizeof(void *) * (size_t)n_parts);
    size_t *sizes = malloc(sizeof(size_t) * (size_t)n_parts);
    int rc = -1;
    if (parts && sizes) {
        parts[0] = len8; sizes[0] = 8;
        parts[1] = h.p; sizes[1] = h.n;
        for (int i = 0; i < n; i++) {
            parts[2 + i] = tensors[i].data;
            sizes[2 + i] = tensors[i].numel * dtype_size(tensors[i].dtype);
        }
        rc = file_write_atomic(path, parts, sizes, n_parts, err);
    } else {
        sf_errf(err, "%s: out of memory", path);
    }
    free(parts); free(sizes); free(h.p);
    return rc;
}
