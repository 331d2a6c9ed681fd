// fuzz.c -- fuzz_segnet, the fuzz harness (make fuzz; make test runs its self-test and a few
// seconds per target): test_segnet.c includes it when built with -DSEGNET_FUZZ, in place of
// its test runner, so that the targets use the tests' fixtures.

// ----------------------------------------------------------------------------
// fuzz_segnet: seeded mutation fuzzing of segnet's file readers (make fuzz)
//
// This file built with -DSEGNET_FUZZ under AddressSanitizer and UBSan: the
// tests above are compiled for their fixtures but not run. Each target writes
// an input to a file in a tmpfs folder and calls the real reader on it:
//   safetensors  safetensors_read, then what a loader does with the result (every
//                tensor as fp32, safetensors_find, the metadata, weights_padding) and
//                safetensors_write of what was read, which must read back the same
//   image        image_load_oriented, then the resize of sample_load (image_to_bytes)
//   mask         mask_load at the size the file claims and with K classes
//                drawn, then the resize of sample_load (mask_resize)
//   exif         exif_orientation on a JPEG's bytes, then exif_orient (--exif
//                apply's turn) by that orientation on a small image
//   csv          list_csv (train/eval, with and without a training set's
//                class names) and list_images (predict) on the same file
//   checkpoint   load_checkpoint into a tiny U-Net trainer (--resume)
//   config       parse_train_args reading a run's config.txt (--run, --resume)
//   cli          whole commands (train, predict, eval, export, plan) in a
//                sandbox, outputs checked against what the user owns (below)
// Input k is a function of --seed, the target and k (time decides only where
// a run stops): the seeds first, then a corpus entry with 1..16 stacked
// mutations. The corpus starts as the seeds and keeps each input whose outcome
// is new: the reader's error message without its numbers, paths and quoted
// names, or a success's shape (a cheap stand-in for coverage).
//
// A target runs in a child process, so that a finding does not end the run:
// each input is written into memory shared with the parent before it runs,
// and after a child's death the parent saves it, names the finding and starts
// the next child after that input. Kinds of findings:
//   crash      a sanitizer report, or a signal
//   hang       an input running longer than FUZZ_HANG_S (SIGALRM: its stack)
//   exit       segnet called exit() on an input (an snCheck failed)
//   leak       LeakSanitizer, every FUZZ_RING inputs; the parent then replays
//              those inputs one by one in a fresh child to find the one
//   invariant  a reader's documented contract broken (the child goes on)
// A finding is named by its kind and the first stack frame of the report (or
// the invariant's check): the first input to hit it is saved as
// OUT/TARGET-KIND-K.bin (K: the input's number), and its report, the input
// replayed with symbolized stacks, as OUT/TARGET-KIND-K.txt; later hits are
// counted as repeats. ./fuzz_segnet --replay FILE TARGET runs one input in
// this process.
//
// stb_image is linked instrumented with ASan (make builds fuzz_stb_image.o
// from the Debian header), so that memory errors inside the decoders count.
// Not with UBSan: its integer overflows and shifts there are Debian's and
// upstream's to fix, and would stop the image targets at once.

#if defined(__has_feature)
#if __has_feature(address_sanitizer)
#define FUZZ_ASAN 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define FUZZ_ASAN 1
#endif
#ifndef FUZZ_ASAN
#error "fuzz_segnet needs -fsanitize=address (make fuzz_segnet)"
#endif
#include <sanitizer/common_interface_defs.h>
#include <sanitizer/lsan_interface.h>
#include <stddef.h>
#include <sys/mman.h>

#define FUZZ_MAX_LEN      (64 << 10)  // inputs are cut to this: claimed huge sizes stay small
#define FUZZ_MAX_PIXELS   (1 << 20)   // --max-pixels of the image targets (fuzz_image_setup)
#define FUZZ_HANG_S       5           // an input running longer is a hang
#define FUZZ_RING         64          // inputs between leak checks, all kept to find a leaking one
#define FUZZ_CORPUS_MAX   512
#define FUZZ_CORPUS_BYTES (16 << 20)  // the corpus's bytes, shared by a target's children
#define FUZZ_SIGS         4096        // outcome signatures remembered (a power of 2)
#define FUZZ_MAX_FINDINGS 10          // a target stops after this many distinct findings
#define FUZZ_KEY_MAX      256         // a finding's name: its kind and where it happened
#define FUZZ_EXIT_HANG    124         // a child's exit status: SIGALRM
#define FUZZ_EXIT_SETUP   125         //   its fixtures or seeds failed, or leaked

// The sanitizers' settings the harness relies on; ASAN_OPTIONS and
// UBSAN_OPTIONS in the environment override them. A file may claim any size:
// malloc returns NULL above 512 MB (stb_image and segnet then report an error)
// instead of taking the machine's memory. abort() is reported like a crash.
// Leaks are checked between inputs, not at exit: a child that segnet's exit()
// ends halfway through an input would report that input's memory. Reports are
// not symbolized (that takes 0.1 s, and a known crash may recur every few
// hundred inputs); a new finding's report is made by replaying its input
// with symbolize=1 (fuzz_write_report).
const char *__asan_default_options(void);
const char *__asan_default_options(void) {
    return "allocator_may_return_null=1:max_allocation_size_mb=512:detect_leaks=1:leak_check_at_"
           "exit=0:"
           "handle_abort=1:quarantine_size_mb=64:symbolize=0";
}
const char *__ubsan_default_options(void);
const char *__ubsan_default_options(void) { return "print_stacktrace=1:symbolize=0"; }

typedef struct { const char *s; size_t n; } FuzzToken;
#define TOK(lit) {lit, sizeof lit - 1}

struct FuzzTarget;
typedef struct {
    const struct FuzzTarget *t;
    char dir[200], path[260];     // the target's folder (fixtures) and its input file
    int broken;                   // invariants broken by the current input
    Rng rng;                      // the current input's draws (mask size, classes): from its bytes
    char err[SN_ERR_MAX];         // the current input's error, when refused
    int accepted;                 // the current input was accepted
} FuzzCtx;

typedef struct FuzzTarget {
    const char *name, *file;             // the input's file name in the target's folder
    const FuzzToken *dict;               // tokens inserted and overwritten by the mutator
    int n_dict;
    void (*setup)(FuzzCtx *c);           // fixtures and seeds
    uint64_t (*run)(FuzzCtx *c, const uint8_t *in, size_t n);  // the outcome's signature
    size_t (*mutate)(FuzzCtx *c, Rng *r, uint8_t *b, size_t n);  // NULL: fuzz_mutate
} FuzzTarget;

typedef struct {
    double seconds;
    uint64_t seed, runs;   // runs: inputs per target at most (0: no limit)
    const char *out;
    int hang_s, first_only, verbose;
    int quiet;             // no line per target or finding (the self-test prints its own)
} FuzzOpts;

// Between the parent and a target's children (MAP_SHARED): what a child that
// died was doing, the inputs since the last leak check, the findings so far.
typedef struct {
    uint64_t next;              // the input a new child starts at
    uint64_t current;           // the input being run
    uint64_t check_from;        // the first input since the last leak check
    uint64_t executions, accepted, digest;  // over the target's children
    uint64_t leak_at;           // set by the leak search: the input that leaks alone
    int running;                // 1 while segnet runs the current input
    int sanitizer;              // the death callback ran: a sanitizer report ended the child
    int finished;               // the child stopped at the deadline or the run limit
    int leaked;                 // the child's leak check failed
    int kept, repeats;          // corpus entries kept; deaths at a finding already reported
    int findings;               // distinct findings: keys below, and invariants by call site
    char keys[FUZZ_MAX_FINDINGS][FUZZ_KEY_MAX];
    // the corpus: the seeds (added by the first child's setup), then the inputs kept
    int n_corpus, n_seeds, seeded;
    size_t corpus_at[FUZZ_CORPUS_MAX], corpus_len[FUZZ_CORPUS_MAX], corpus_used;
    uint64_t sigs[FUZZ_SIGS];   // outcome signatures seen (0: free slot)
    // not cleared between targets:
    size_t len[FUZZ_RING];
    uint8_t ring[FUZZ_RING][FUZZ_MAX_LEN];  // input k in slot k % FUZZ_RING
    uint8_t corpus[FUZZ_CORPUS_BYTES];
} FuzzShared;

static FuzzShared *g_fz;
static FuzzCtx *g_fctx;          // the child's (reachable: not a leak)
static char g_flog[300];         // the child's stderr: sanitizer reports, segnet's messages
static int g_freplay;            // --replay: findings are printed, not saved
static const FuzzOpts *g_fopts;
static uint8_t g_fscratch[FUZZ_MAX_LEN];

static uint64_t fuzz_hash(uint64_t h, const void *p, size_t n) {
    for (size_t i = 0; i < n; i++) h = (h ^ ((const uint8_t *)p)[i]) * 1099511628211ull;
    return h;
}
#define FUZZ_HASH0 1469598103934665603ull

static uint64_t fuzz_draw(Rng *r, uint64_t n) { return n ? rng_next(r) % n : 0; }

// OUT/TARGET-KIND-K.bin: input k from the ring
static int fuzz_save(const char *target, const char *kind, uint64_t k, char path[512]) {
    snprintf(path, 512, "%s/%s-%s-%" PRIu64 ".bin", g_fopts->out, target, kind, k);
    return write_file_bytes(path, g_fz->ring[k % FUZZ_RING], g_fz->len[k % FUZZ_RING]);
}

// An error's signature: its letters, without the words that hold digits
// (numbers), without paths (from a word with '/' to one ending in ':', since
// paths may hold spaces), and without what stands between quotes (names,
// labels, stb_image's chunk names): one per kind of refusal, not per input.
// A quote opens after a space or '(' and closes before a space, ':', ',', ')'
// or the end, so that quotes inside a quoted name do not matter.
static uint64_t fuzz_err_sig(const char *e) {
    uint64_t h = FUZZ_HASH0;
    int in_path = 0;
    for (const char *w = e; *w;) {
        const char *end = w;
        if ((*w == '\'' || *w == '"') && (w == e || w[-1] == ' ' || w[-1] == '(')) {
            const char q = *w;  // to the closing quote
            for (end = w + 1; *end && !(*end == q && (!end[1] || strchr(" :,)", end[1]))); end++) {}
            w = *end ? end + 1 : end;
            continue;
        }
        int digits = 0, slash = 0;
        while (*end && *end != ' ') {
            digits |= *end >= '0' && *end <= '9';
            slash |= *end == '/';
            end++;
        }
        in_path |= slash;
        for (; !digits && !in_path && w < end; w++)
            if ((*w >= 'a' && *w <= 'z') || (*w >= 'A' && *w <= 'Z')) h = fuzz_hash(h, w, 1);
        if (end > w && end[-1] == ':') in_path = 0;
        h = fuzz_hash(h, " ", 1);
        w = end;
        while (*w == ' ') w++;
    }
    return h;
}

// whether sig is new (then remembered)
static int fuzz_sig_new(uint64_t sig) {
    uint64_t *sigs = g_fz->sigs;
    for (uint64_t i = sig & (FUZZ_SIGS - 1), k = 0; k < FUZZ_SIGS;
         k++, i = (i + 1) & (FUZZ_SIGS - 1)) {
        if (sigs[i] == sig) return 0;
        if (!sigs[i]) { if (k < FUZZ_SIGS / 2) sigs[i] = sig; return 1; }
    }
    return 0;
}

// appends an entry to the corpus if it has room; 0 if not
static int fuzz_corpus_add(const void *p, size_t n) {
    if (g_fz->n_corpus == FUZZ_CORPUS_MAX || n > FUZZ_CORPUS_BYTES - g_fz->corpus_used) return 0;
    g_fz->corpus_at[g_fz->n_corpus] = g_fz->corpus_used;
    g_fz->corpus_len[g_fz->n_corpus++] = n;
    memcpy(g_fz->corpus + g_fz->corpus_used, p, n);
    g_fz->corpus_used += n;
    return 1;
}

// s with control bytes and bytes outside UTF-8 as \xNN, cut to fit
static const char *fuzz_printable(char *out, size_t cap, const char *s) {
    size_t k = 0, n = strlen(s), u;
    for (size_t i = 0; i < n && k + 5 < cap; i += u ? u : 1) {
        u = utf8_len((const uint8_t *)s + i, n - i);
        if (!u || (uint8_t)s[i] < 0x20 || s[i] == 0x7F)
            k += (size_t)snprintf(out + k, cap - k, "\\x%02x", (uint8_t)s[i]);
        else if (k + u < cap) { memcpy(out + k, s + i, u); k += u; }
        else break;
    }
    out[k] = 0;
    return out;
}

// whether a finding with this key is new (then remembered, if there is room)
static int fuzz_finding_new(const char *key) {
    for (int i = 0; i < g_fz->findings && i < FUZZ_MAX_FINDINGS; i++)
        if (!strcmp(g_fz->keys[i], key)) return 0;
    if (g_fz->findings < FUZZ_MAX_FINDINGS)
        snprintf(g_fz->keys[g_fz->findings], FUZZ_KEY_MAX, "%s", key);
    g_fz->findings++;
    return 1;
}

// A reader broke its documented contract on the current input: reported once
// per call site (fmt), saved, counted; fuzzing goes on.
static void fuzz_invariant(FuzzCtx *c, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void fuzz_invariant(FuzzCtx *c, const char *fmt, ...) {
    char msg[SN_ERR_MAX + 256], shown[4 * sizeof msg], key[FUZZ_KEY_MAX], path[512] = "";
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    fuzz_printable(shown, sizeof shown, msg);
    c->broken++;
    if (g_freplay) { printf("fuzz %s: invariant broken: %s\n", c->t->name, shown); return; }
    snprintf(key, sizeof key, "invariant %s", fmt);
    if (!fuzz_finding_new(key)) { g_fz->repeats++; return; }
    if (fuzz_save(c->t->name, "invariant", g_fz->current, path)) path[0] = 0;
    printf("fuzz %s: invariant broken at input %" PRIu64 ": %s%s%s\n", c->t->name, g_fz->current,
           shown, path[0] ? "; reproducer " : "", path);
    fflush(stdout);
}

// err after a refusal: one line naming the file (README, Tests: "one clear
// error naming the file and the problem")
static void fuzz_check_err(FuzzCtx *c) {
    if (!c->err[0]) fuzz_invariant(c, "refused with an empty error message");
    else if (strpbrk(c->err, "\n\r"))
        fuzz_invariant(c, "error message of several lines: %s", c->err);
    else if (!strstr(c->err, c->dir))
        fuzz_invariant(c, "error message does not name the file: %s", c->err);
}

static void fuzz_write_input(FuzzCtx *c, const uint8_t *in, size_t n) {
    snCheck(write_file_bytes(c->path, in, n) == 0, "fuzz: cannot write %s", c->path);
}

// a seed, by the first child's setup (the same seeds come again in the next ones)
static void fuzz_add_seed(FuzzCtx *c, const void *p, size_t n) {
    if (g_fz->seeded) return;
    snCheck(n <= FUZZ_MAX_LEN, "fuzz %s: seed %d is %zu bytes, over FUZZ_MAX_LEN", c->t->name,
            g_fz->n_corpus, n);
    snCheck(fuzz_corpus_add(p, n), "fuzz %s: too many seeds", c->t->name);
    g_fz->n_seeds = g_fz->n_corpus;
}

static void fuzz_add_seed_file(FuzzCtx *c, const char *path) {
    size_t n;
    uint8_t *p = read_file_bytes(path, &n);
    snCheck(p != NULL, "fuzz: cannot read the seed %s", path);
    fuzz_add_seed(c, p, n);
    free(p);
}

// ---- mutations

static const uint64_t FUZZ_INTS[] = {0,           1,
                                     2,           3,
                                     7,           8,
                                     15,          16,
                                     31,          32,
                                     63,          64,
                                     127,         128,
                                     255,         256,
                                     511,         512,
                                     1023,        1024,
                                     4095,        4096,
                                     32767,       32768,
                                     65535,       65536,
                                     1u << 24,    (1u << 24) + 1,
                                     0x7FFFFFFF,  0x80000000u,
                                     0xFFFFFFFFu, 1ull << 32,
                                     1ull << 53,  0x7FFFFFFFFFFFFFFFull,
                                     1ull << 63,  ~0ull};
static const char *const FUZZ_NUMBERS[] = {"0",
                                           "-0",
                                           "1",
                                           "-1",
                                           "00",
                                           "01",
                                           "255",
                                           "256",
                                           "65536",
                                           "2147483647",
                                           "2147483648",
                                           "-2147483649",
                                           "4294967296",
                                           "9223372036854775807",
                                           "9223372036854775808",
                                           "-9223372036854775808",
                                           "18446744073709551616",
                                           "99999999999999999999999999999999",
                                           "1e9",
                                           "1.5",
                                           "0x10",
                                           "+1",
                                           " 1",
                                           "1 "};

// inserts k bytes of src (which may lie in b) at pos, as many as fit
static size_t fuzz_insert(uint8_t *b, size_t n, size_t pos, const void *src, size_t k) {
    if (k > FUZZ_MAX_LEN - n) k = FUZZ_MAX_LEN - n;
    memcpy(g_fscratch, src, k);
    memmove(b + pos + k, b + pos, n - pos);
    memcpy(b + pos, g_fscratch, k);
    return n + k;
}

static size_t fuzz_min(size_t a, size_t b) { return a < b ? a : b; }

// One mutation of b (n bytes, room for FUZZ_MAX_LEN); returns the new length.
static size_t fuzz_mutate(FuzzCtx *c, Rng *r, uint8_t *b, size_t n) {
    const FuzzTarget *t = c->t;
    size_t pos = fuzz_draw(r, n), k;
    uint8_t tmp[512];
    switch (fuzz_draw(r, 14)) {
    case 0: if (n) b[pos] ^= (uint8_t)(1u << fuzz_draw(r, 8)); break;
    case 1:
        if (n)
            b[pos] = (const uint8_t[]){
                    0x00, 0x01, 0x7F, 0x80, 0xFF, 0x20, '0', '9', '\n', '"'}[fuzz_draw(r, 10)];
        break;
    case 2: if (n) b[pos] = (uint8_t)rng_next(r); break;
    case 3: if (n) b[pos] = (uint8_t)(b[pos] + fuzz_draw(r, 33) - 16); break;
    case 4:  // a few random bytes, or a run of one byte
        if (fuzz_draw(r, 4)) {
            k = 1 + fuzz_draw(r, 8);
            for (size_t i = 0; i < k; i++) tmp[i] = (uint8_t)rng_next(r);
        } else {
            k = 1 + fuzz_draw(r, sizeof tmp);
            memset(tmp, n && fuzz_draw(r, 2) ? b[pos] : (int)fuzz_draw(r, 256), k);
        }
        n = fuzz_insert(b, n, fuzz_draw(r, n + 1), tmp, k);
        break;
    case 5:  // delete a range: short, or up to the end
        if (!n) break;
        k = 1 + fuzz_draw(r, fuzz_draw(r, 8) ? fuzz_min(16, n - pos) : n - pos);
        memmove(b + pos, b + pos + k, n - pos - k);
        n -= k;
        break;
    case 6: {  // duplicate a range
        if (!n) break;
        size_t to = fuzz_draw(r, n + 1);
        k = 1 + fuzz_draw(r, fuzz_min(n - pos, 256));
        n = fuzz_insert(b, n, to, b + pos, k);
        break;
    }
    case 7: {  // copy a range over another
        if (!n) break;
        size_t from = fuzz_draw(r, n);
        k = 1 + fuzz_draw(r, fuzz_min(n - (pos > from ? pos : from), 64));
        memmove(b + pos, b + from, k);
        break;
    }
    case 8: {  // splice: this input's head and another's tail, or a piece of another inserted
        const int e = (int)fuzz_draw(r, (uint64_t)g_fz->n_corpus);
        const uint8_t *o = g_fz->corpus + g_fz->corpus_at[e];
        const size_t o_n = g_fz->corpus_len[e];
        if (!o_n) break;
        size_t from = fuzz_draw(r, o_n);
        if (fuzz_draw(r, 2)) { n = fuzz_insert(b, pos, pos, o + from, o_n - from); break; }
        size_t to = fuzz_draw(r, n + 1);
        k = 1 + fuzz_draw(r, fuzz_min(o_n - from, 256));
        n = fuzz_insert(b, n, to, o + from, k);
        break;
    }
    // an integer of 1, 2, 4 or 8 bytes, little- or big-endian, at a boundary (or the input's
    // length)
    case 9: {
        size_t w = (size_t)1 << fuzz_draw(r, 4);
        if (n < w) break;
        pos = fuzz_draw(r, n - w + 1);
        uint64_t v = fuzz_draw(r, 8) ? FUZZ_INTS[fuzz_draw(r, sizeof FUZZ_INTS / sizeof *FUZZ_INTS)]
                                     : n - fuzz_draw(r, 2) * pos;
        v += fuzz_draw(r, 4) ? 0 : fuzz_draw(r, 5) - 2;
        int big = (int)fuzz_draw(r, 2);
        for (size_t i = 0; i < w; i++) b[pos + (big ? w - 1 - i : i)] = (uint8_t)(v >> 8 * i);
        break;
    }
    case 10: {  // a token inserted
        if (!t->n_dict) break;
        const FuzzToken *tk = &t->dict[fuzz_draw(r, (uint64_t)t->n_dict)];
        n = fuzz_insert(b, n, fuzz_draw(r, n + 1), tk->s, tk->n);
        break;
    }
    case 11: {  // a token written over
        if (!n || !t->n_dict) break;
        const FuzzToken *tk = &t->dict[fuzz_draw(r, (uint64_t)t->n_dict)];
        memcpy(b + pos, tk->s, fuzz_min(tk->n, n - pos));
        break;
    }
    case 12: {  // a number in text replaced by a boundary one
        while (pos < n && (b[pos] < '0' || b[pos] > '9')) pos++;
        size_t end = pos;
        while (end < n && b[end] >= '0' && b[end] <= '9') end++;
        if (pos == n) break;
        char num[32];
        const char *s = num;
        if (fuzz_draw(r, 4))
            s = FUZZ_NUMBERS[fuzz_draw(r, sizeof FUZZ_NUMBERS / sizeof *FUZZ_NUMBERS)];
        else snprintf(num, sizeof num, "%" PRIu64, rng_next(r) >> fuzz_draw(r, 64));
        memmove(b + pos, b + end, n - end);
        n = fuzz_insert(b, n - (end - pos), pos, s, strlen(s));
        break;
    }
    default: n = pos; break;  // truncate
    }
    return n;
}

// Input k into b: seed k while k < n_seeds, else a corpus entry with stacked
// mutations: a function of (seed, target, k) and the corpus, which grows only
// from earlier inputs.
static size_t fuzz_input(FuzzCtx *c, uint64_t seed, uint64_t k, uint8_t *b) {
    Rng r;
    rng_seed(&r, rng_mix64(rng_mix64(seed ^ fuzz_hash(FUZZ_HASH0, c->t->name, strlen(c->t->name))) +
                           k));
    const int e =
            k < (uint64_t)g_fz->n_seeds ? (int)k : (int)fuzz_draw(&r, (uint64_t)g_fz->n_corpus);
    size_t n = g_fz->corpus_len[e];
    memcpy(b, g_fz->corpus + g_fz->corpus_at[e], n);
    if (k < (uint64_t)g_fz->n_seeds) return n;
    int m = 1 + (int)fuzz_draw(&r, 4);
    if (!fuzz_draw(&r, 8)) m += (int)fuzz_draw(&r, 13);
    while (m--) n = (c->t->mutate ? c->t->mutate : fuzz_mutate)(c, &r, b, n);
    return n;
}

// ---- safetensors

static const FuzzToken SF_DICT[] = {
        TOK("\""),
        TOK("\\"),
        TOK("\\u"),
        TOK("\\ud83d\\ude00"),
        TOK("\\ud800"),
        TOK("\\udc00"),
        TOK("\\u0000"),
        TOK("\\u001f"),
        TOK("{"),
        TOK("}"),
        TOK("["),
        TOK("]"),
        TOK(":"),
        TOK(","),
        TOK(" "),
        TOK("\t\r\n"),
        TOK("\"__metadata__\""),
        TOK("\"dtype\""),
        TOK("\"shape\""),
        TOK("\"data_offsets\""),
        TOK("\"F32\""),
        TOK("\"F16\""),
        TOK("\"BF16\""),
        TOK("\"I64\""),
        TOK("-1"),
        TOK("0"),
        TOK("00"),
        TOK("1.5"),
        TOK("1e3"),
        TOK("9223372036854775807"),
        TOK("9223372036854775808"),
        TOK("18446744073709551615"),
        TOK("-9223372036854775808"),
        TOK("null"),
        TOK("true"),
        TOK("[]"),
        TOK("[0,0]"),
        TOK("{}"),
        TOK("\xc3\xa9"),
        TOK("\xed\xa0\x80"),
        TOK("\xf4\x90\x80\x80"),
        TOK("\xc0\xaf"),
        TOK("\xff"),
        TOK("\x00"),
        TOK("\"x\":{\"dtype\":\"F16\",\"shape\":[1],\"data_offsets\":[0,2]},"),
        TOK("\"k\":\"v\","),
        TOK("\"padding\""),
        TOK("\"same\""),
        TOK("\"epoch\""),
        TOK("\"conv_stem.weight\""),
        TOK("\"features.0.0.weight\""),
        TOK("\"train_state.adam_m\""),
};

// Half the time the JSON header alone, its 8-byte length then set to match:
// past the length check, into the parser and the layout checks.
static size_t fuzz_sf_mutate(FuzzCtx *c, Rng *r, uint8_t *b, size_t n) {
    static uint8_t data[FUZZ_MAX_LEN];
    uint64_t hlen = 0;
    for (int i = 7; i >= 0 && n >= 8; i--) hlen = hlen << 8 | b[i];
    if (n < 8 || hlen > n - 8 || fuzz_draw(r, 2)) return fuzz_mutate(c, r, b, n);
    size_t tail = n - 8 - (size_t)hlen;
    memcpy(data, b + 8 + hlen, tail);
    memmove(b, b + 8, hlen);
    size_t h = fuzz_min(fuzz_mutate(c, r, b, (size_t)hlen), FUZZ_MAX_LEN - 8);
    memmove(b + 8, b, h);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)h >> 8 * i);
    tail = fuzz_min(tail, FUZZ_MAX_LEN - 8 - h);
    memcpy(b + 8 + h, data, tail);
    return 8 + h + tail;
}

// a safetensors file from header text and data bytes (the length prefix computed)
static void fuzz_sf_seed_text(FuzzCtx *c, const char *header, const void *data, size_t n_data) {
    size_t h = strlen(header);
    uint8_t *b = malloc(8 + h + n_data);
    for (int i = 0; i < 8; i++) b[i] = (uint8_t)((uint64_t)h >> 8 * i);
    memcpy(b + 8, header, h);
    memcpy(b + 8 + h, data, n_data);
    fuzz_add_seed(c, b, 8 + h + n_data);
    free(b);
}

static void fuzz_sf_seed_write(FuzzCtx *c, const SafetensorsTensor *ts, int n,
                               const char *const *keys, const char *const *vals, int n_meta) {
    char path[300], err[SN_ERR_MAX];
    snprintf(path, sizeof path, "%s/seed.safetensors", c->dir);
    snCheck(safetensors_write(path, ts, n, keys, vals, n_meta, err) == 0, "fuzz: %s", err);
    fuzz_add_seed_file(c, path);
}

static void fuzz_sf_setup(FuzzCtx *c) {
    static const float f32[6] = {1.0f, -2.5f, 0.0f, 3.25f, -0.0f, 1e-30f};
    static const uint16_t f16[8] = {0x3C00, 0xC000, 0x7C00, 0x7E00, 0x0001, 0x8000, 0x3555, 0xFBFF};
    static const int64_t i64[1] = {INT64_MIN + 1};
    static const int64_t d23[2] = {2, 3}, d4[1] = {4}, d0_3[2] = {0, 3}, d2111[4] = {2, 1, 1, 1},
                         d8[8] = {1, 1, 1, 1, 1, 1, 1, 2}, d1133[4] = {1, 1, 2, 2};
    const char *k1[2] = {"format", "padding"}, *v1[2] = {"segnet", "same"}, *k3[1] = {"epoch"},
               *v3[1] = {"3"};
    SafetensorsTensor a[3] = {sf_tensor("w", DT_F32, 2, d23, f32),
                              sf_tensor("h", DT_F16, 1, d4, f16),
                              sf_tensor("s", DT_BF16, 0, NULL, f16)};
    fuzz_sf_seed_write(c, a, 3, k1, v1, 2);
    SafetensorsTensor b[4] = {sf_tensor("features.0.0.weight", DT_F32, 4, d2111, f32),
                              sf_tensor("empty", DT_F32, 2, d0_3, f32),
                              sf_tensor("deep", DT_F16, 8, d8, f16),
                              sf_tensor("features.0.1.num_batches_tracked", DT_I64, 0, NULL, i64)};
    fuzz_sf_seed_write(c, b, 4, NULL, NULL, 0);
    SafetensorsTensor t3 = sf_tensor("conv_stem.weight", DT_BF16, 4, d1133, f16);
    fuzz_sf_seed_write(c, &t3, 1, k3, v3, 1);
    // escapes, whitespace, fields in another order, a hole in the data section
    fuzz_sf_seed_text(c,
                      "{ \"a\\u00e9\\ud83d\\ude00\" : "
                      "{\"data_offsets\":[0,8],\"shape\":[2],\"dtype\":\"F32\"} ,\n"
                      "\"b\\\"\\\\\\/\\b\\f\\n\\r\\t\": "
                      "{\"dtype\":\"F16\",\"shape\":[1,1],\"data_offsets\":[12,14]},"
                      "\"__metadata__\":{\"k\":\"v\",\"\\u00ff\":\"\"}}   ",
                      f32, 16);
    fuzz_sf_seed_text(c, "{}      ", "", 0);
}

// What safetensors_read accepted, safetensors_write writes and safetensors_read reads back
// the same: the writer refuses what the reader would refuse, and the reader is as strict.
// err without its leading "PATH: "
static const char *fuzz_after(const char *err, const char *path) {
    size_t k = strlen(path);
    return strncmp(err, path, k) ? err : err + k + (err[k] == ':') + (err[k] && err[k + 1] == ' ');
}

static void fuzz_sf_round_trip(FuzzCtx *c, const SafetensorsFile *f) {
    char path[300], err[SN_ERR_MAX];
    snprintf(path, sizeof path, "%s/copy.safetensors", c->dir);
    const char **keys = malloc(sizeof(char *) * (size_t)(f->n_meta + 1));
    const char **vals = malloc(sizeof(char *) * (size_t)(f->n_meta + 1));
    snCheck(keys && vals, "out of host memory");
    for (int k = 0; k < f->n_meta; k++) { keys[k] = f->meta_keys[k]; vals[k] = f->meta_values[k]; }
    SafetensorsFile g;
    if (safetensors_write(path, f->tensors, f->n_tensors, keys, vals, f->n_meta, err)) {
        fuzz_invariant(
                c,
                "safetensors_read accepts the file, safetensors_write refuses to write it back: %s",
                fuzz_after(err, path));
    } else if (safetensors_read(path, &g, err)) {
        fuzz_invariant(c, "safetensors_write's copy does not read back: %s", fuzz_after(err, path));
    } else {
        int same = g.n_tensors == f->n_tensors && g.n_meta == f->n_meta;
        for (int i = 0; same && i < f->n_tensors; i++) {
            const SafetensorsTensor *x = &f->tensors[i], *y = &g.tensors[i];
            same = !strcmp(x->name, y->name) && x->dtype == y->dtype && x->ndim == y->ndim &&
                   x->numel == y->numel &&
                   !memcmp(x->dims, y->dims, sizeof(int64_t) * (size_t)x->ndim) &&
                   !memcmp(x->data, y->data, x->numel * dtype_size(x->dtype));
        }
        for (int k = 0; same && k < f->n_meta; k++)
            same = !strcmp(f->meta_keys[k], g.meta_keys[k]) &&
                   !strcmp(f->meta_values[k], g.meta_values[k]);
        if (!same) fuzz_invariant(c, "safetensors_write's copy reads back different");
        safetensors_free(&g);
    }
    free(keys);
    free(vals);
}

static uint64_t fuzz_sf_run(FuzzCtx *c, const uint8_t *in, size_t n) {
    SafetensorsFile f;
    fuzz_write_input(c, in, n);
    if (safetensors_read(c->path, &f, c->err)) {
        if (f.tensors || f.meta_keys || f.meta_values || f.bytes || f.n_tensors || f.n_meta)
            fuzz_invariant(c, "safetensors_read failed and left its SafetensorsFile non-empty");
        fuzz_check_err(c);
        for (const char *p = c->err; *p; p++)
            if ((uint8_t)*p < 0x20 || *p == 0x7F) {
                fuzz_invariant(c, "control byte 0x%02x in the error message", (uint8_t)*p);
                break;
            }
        return fuzz_err_sig(c->err);
    }
    c->accepted = 1;
    uint64_t sig = fuzz_hash(FUZZ_HASH0, "st", 2);
    for (int i = 0; i < f.n_tensors; i++) {
        const SafetensorsTensor *t = &f.tensors[i];
        const size_t bytes = t->numel * dtype_size(t->dtype);
        const uint8_t *p = t->data;
        size_t numel;
        if (p < f.bytes + 8 || p > f.bytes + f.n_bytes || bytes > (size_t)(f.bytes + f.n_bytes - p))
            fuzz_invariant(c, "tensor %d's data lies outside the file", i);
        else if (sf_numel(t->dims, t->ndim, dtype_size(t->dtype), &numel) || numel != t->numel)
            fuzz_invariant(c, "tensor %d: numel %zu is not the product of its shape", i, t->numel);
        else {
            float *v = malloc(sizeof(float) * (t->numel ? t->numel : 1));
            snCheck(v != NULL, "out of host memory");
            safetensors_tensor_f32(t, v);
            free(v);
        }
        if (safetensors_find(&f, t->name) != t)
            fuzz_invariant(c, "safetensors_find does not find tensor %d by its name", i);
        int facts[2] = {(int)t->dtype, t->ndim};
        sig = fuzz_hash(sig, facts, sizeof facts);
    }
    for (int k = 0; k < f.n_meta; k++)
        if (!safetensors_meta(&f, f.meta_keys[k]))
            fuzz_invariant(c, "safetensors_meta does not find metadata key %d", k);
    PadMode pad;
    const char *why;
    int follows = weights_padding(&f, &pad, &why),
        facts[3] = {f.n_tensors < 4 ? f.n_tensors : 4, f.n_meta > 0, follows};
    fuzz_sf_round_trip(c, &f);
    safetensors_free(&f);
    return fuzz_hash(sig, facts, sizeof facts) | 1;
}

// ---- images and masks

static const FuzzToken IMG_DICT[] = {
        TOK("\x89PNG\r\n\x1a\n"),
        TOK("IHDR"),
        TOK("IDAT"),
        TOK("IEND"),
        TOK("PLTE"),
        TOK("tRNS"),
        TOK("CgBI"),
        TOK("\x00\x00\x00\x00"),
        TOK("\xff\xd8\xff"),
        TOK("\xff\xc0"),
        TOK("\xff\xc2"),
        TOK("\xff\xc4"),
        TOK("\xff\xda"),
        TOK("\xff\xdb"),
        TOK("\xff\xdd"),
        TOK("\xff\xd9"),
        TOK("\xff\xe0"),
        TOK("\xff\xee"),
        TOK("\xff\xff"),
        TOK("\x78\x01"),
        TOK("\x78\x9c"),
        TOK("\x01\xff\xff\x00\x00"),
        TOK("\x00\x00\xff\xff"),
        TOK("BM"),
        TOK("P5\n"),
};

typedef struct { uint8_t *p; size_t n, cap; } FuzzBuf;
static void fuzz_buf_put(FuzzBuf *b, const void *s, size_t k) {
    if (b->n + k > b->cap) {
        b->cap = 2 * (b->n + k) + 64;
        b->p = realloc(b->p, b->cap);
        snCheck(b->p != NULL, "out of host memory");
    }
    memcpy(b->p + b->n, s, k);
    b->n += k;
}
static void fuzz_buf_u32be(FuzzBuf *b, uint32_t v) {
    uint8_t x[4] = {(uint8_t)(v >> 24), (uint8_t)(v >> 16), (uint8_t)(v >> 8), (uint8_t)v};
    fuzz_buf_put(b, x, 4);
}
static void fuzz_write_func(void *ctx, void *data, int size) {
    fuzz_buf_put(ctx, data, (size_t)size);
}
static void fuzz_add_buf(FuzzCtx *c, FuzzBuf *b) {
    fuzz_add_seed(c, b->p, b->n);
    free(b->p);
    memset(b, 0, sizeof *b);
}

static void fuzz_png_chunk(FuzzBuf *b, const char *type, const uint8_t *data, size_t n) {
    fuzz_buf_u32be(b, (uint32_t)n);
    size_t at = b->n;
    fuzz_buf_put(b, type, 4);
    if (n) fuzz_buf_put(b, data, n);
    fuzz_buf_u32be(b, png_crc(b->p + at, n + 4, 0));
}

// A PNG whose IDAT is stored (uncompressed) deflate, so that mutated bytes
// reach the unfiltering and the pixels instead of stopping at the inflater.
// Samples of 8 and 16 bits are 0..3 (class indices for the mask target);
// `filters` cycles the rows through the five filter types (any bytes are valid).
static void fuzz_png_seed(FuzzCtx *c, int w, int h, int depth, int ctype, int interlace,
                          int filters) {
    static const int CH[7] = {1, 0, 3, 1, 2, 0, 4};
    static const int X0[7] = {0, 4, 0, 2, 0, 1, 0}, Y0[7] = {0, 0, 4, 0, 2, 0, 1},
                     DX[7] = {8, 8, 4, 4, 2, 2, 1}, DY[7] = {8, 8, 8, 4, 4, 2, 2};
    FuzzBuf raw = {0}, png = {0};
    for (int pass = 0; pass < (interlace ? 7 : 1); pass++) {
        const int pw = interlace ? (w - X0[pass] + DX[pass] - 1) / DX[pass] : w;
        const int ph = interlace ? (h - Y0[pass] + DY[pass] - 1) / DY[pass] : h;
        size_t row = ((size_t)pw * CH[ctype] * depth + 7) / 8;
        for (int y = 0; pw > 0 && y < ph; y++) {
            uint8_t f = (uint8_t)(filters ? y % 5 : 0);
            fuzz_buf_put(&raw, &f, 1);
            for (size_t i = 0; i < row; i++) {
                uint8_t v = depth == 16  ? (uint8_t)(i % 2 ? (i / 2 + y) % 4 : 0)
                            : depth == 8 ? (uint8_t)((i + y) % (ctype == 3 ? 3 : 4))
                                         : (uint8_t)(0x5A ^ (i * 7 + y));
                fuzz_buf_put(&raw, &v, 1);
            }
        }
    }
    FuzzBuf z = {0};
    fuzz_buf_put(&z, "\x78\x01", 2);
    for (size_t at = 0; at < raw.n || at == 0; at += 65535) {
        size_t k = fuzz_min(raw.n - at, 65535);
        uint8_t hdr[5] = {(uint8_t)(at + k >= raw.n), (uint8_t)k, (uint8_t)(k >> 8), (uint8_t)~k,
                          (uint8_t)(~k >> 8)};
        fuzz_buf_put(&z, hdr, 5);
        if (k) fuzz_buf_put(&z, raw.p + at, k);
        if (raw.n == 0) break;
    }
    uint32_t a = 1, s = 0;
    for (size_t i = 0; i < raw.n; i++) { a = (a + raw.p[i]) % 65521; s = (s + a) % 65521; }
    fuzz_buf_u32be(&z, s << 16 | a);
    uint8_t ihdr[13] = {(uint8_t)(w >> 24),
                        (uint8_t)(w >> 16),
                        (uint8_t)(w >> 8),
                        (uint8_t)w,
                        (uint8_t)(h >> 24),
                        (uint8_t)(h >> 16),
                        (uint8_t)(h >> 8),
                        (uint8_t)h,
                        (uint8_t)depth,
                        (uint8_t)ctype,
                        0,
                        0,
                        (uint8_t)interlace};
    fuzz_buf_put(&png, "\x89PNG\r\n\x1a\n", 8);
    fuzz_png_chunk(&png, "IHDR", ihdr, 13);
    if (ctype == 3) {
        fuzz_png_chunk(&png, "PLTE", (const uint8_t *)"\x00\x00\x00\xff\x00\x00\x00\xff\x00", 9);
        fuzz_png_chunk(&png, "tRNS", (const uint8_t *)"\xff\x80\x00", 3);
    }
    fuzz_png_chunk(&png, "IDAT", z.p, z.n);
    fuzz_png_chunk(&png, "IEND", NULL, 0);
    fuzz_add_buf(c, &png);
    free(raw.p);
    free(z.p);
}

// The image and mask seeds: PNGs of every colour type and bit depth (stored
// and compressed), baseline JPEGs with and without chroma subsampling, and two
// files of formats stb_image decodes but segnet must refuse by their first
// bytes (stb_image 2.27 reads past its buffer converting a 16-bit PGM, and
// gives a top-down BMP a negative height). --max-pixels is FUZZ_MAX_PIXELS:
// a 64 KB JPEG may claim 10^8 pixels, which decode (missing data as zeros)
// in seconds and gigabytes; the refusal of larger claims is fuzzed with the rest.
static void fuzz_image_setup(FuzzCtx *c) {
    image_max_pixels = FUZZ_MAX_PIXELS;
    uint8_t px[16 * 16 * 4];
    for (size_t i = 0; i < sizeof px; i++)
        px[i] = (uint8_t)((i * 37 + i / 5) % 4 + (i % 3 ? 0 : 96));
    FuzzBuf b = {0};
    stbi_write_png_to_func(fuzz_write_func, &b, 6, 4, 1, px, 6); fuzz_add_buf(c, &b);
    stbi_write_png_to_func(fuzz_write_func, &b, 4, 4, 3, px, 12); fuzz_add_buf(c, &b);
    stbi_write_png_to_func(fuzz_write_func, &b, 3, 3, 4, px, 12); fuzz_add_buf(c, &b);
    uint8_t grey[5 * 3 * 4];  // classes 0..3 stored as RGB and RGBA (R = G = B): masks accept them
    for (int p = 0; p < 15; p++) {
        grey[4 * p] = grey[4 * p + 1] = grey[4 * p + 2] = (uint8_t)(p % 4);
        grey[4 * p + 3] = (uint8_t)(17 * p);
    }
    stbi_write_png_to_func(fuzz_write_func, &b, 5, 3, 4, grey, 20); fuzz_add_buf(c, &b);
    for (int p = 0; p < 15; p++) memmove(grey + 3 * p, grey + 4 * p, 3);
    stbi_write_png_to_func(fuzz_write_func, &b, 5, 3, 3, grey, 15); fuzz_add_buf(c, &b);
    fuzz_png_seed(c, 6, 4, 8, 0, 0, 0);   // 8-bit grey: a mask
    fuzz_png_seed(c, 4, 3, 16, 0, 0, 0);  // 16-bit grey: the mask's 16-bit path
    fuzz_png_seed(c, 3, 3, 8, 3, 0, 0);   // palette with transparency (masks refuse it)
    fuzz_png_seed(c, 9, 2, 1, 0, 0, 0);   // 1-bit grey
    fuzz_png_seed(c, 5, 2, 4, 0, 0, 1);   // 4-bit grey, every filter
    fuzz_png_seed(c, 5, 5, 8, 2, 1, 1);   // interlaced RGB, every filter
    fuzz_png_seed(c, 2, 2, 16, 6, 0, 0);  // 16-bit RGBA
    fuzz_png_seed(c, 3, 2, 8, 4, 0, 0);   // grey + alpha
    stbi_write_jpg_to_func(fuzz_write_func, &b, 8, 8, 1, px, 90); fuzz_add_buf(c, &b);
    // 4:2:0, partial blocks
    stbi_write_jpg_to_func(fuzz_write_func, &b, 17, 9, 3, px, 50); fuzz_add_buf(c, &b);
    stbi_write_jpg_to_func(fuzz_write_func, &b, 16, 16, 3, px, 95); fuzz_add_buf(c, &b);  // 4:4:4
    static const char PGM16[] = "P5\n3 1\n65535\n\x00\x01\x00\x02\x01\x00";
    static const char BMP_TOP_DOWN[] =
            "BM\x4e\0\0\0\0\0\0\0\x36\0\0\0\x28\0\0\0\x03\0\0\0\xfe\xff\xff\xff\x01\0\x18\0"
            "\0\0\0\0\x18\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\0\x01\x02\x03\x01\x02\x03"
            "\x01\x02\x03\0\0\0\x01\x02\x03\x01\x02\x03\x01\x02\x03\0\0\0";
    fuzz_add_seed(c, PGM16, sizeof PGM16 - 1);
    fuzz_add_seed(c, BMP_TOP_DOWN, sizeof BMP_TOP_DOWN - 1);
}

static uint64_t fuzz_image_run(FuzzCtx *c, const uint8_t *in, size_t n) {
    int w, h;
    fuzz_write_input(c, in, n);
    int orientation;
    uint8_t *img = image_load_oriented(c->path, &h, &w, &orientation, c->err);
    if (!img) { fuzz_check_err(c); return fuzz_err_sig(c->err); }
    c->accepted = 1;
    if (h < 1 || w < 1) fuzz_invariant(c, "image_load_oriented accepted a %dx%d image", w, h);
    uint8_t rgb[8 * 8 * 3];
    image_to_bytes(rgb, 8, 8, img, h, w);  // what sample_load does next, for 8x8 samples
    free(img);
    int facts[2] = {w % 8, h % 8};
    return fuzz_hash(fuzz_hash(FUZZ_HASH0, "img", 3), facts, sizeof facts) | 1;
}

// At the size a PNG claims (1 in 8, or not a PNG: another size) and with K
// classes: 4 (the seeds' values), 255, or 1..8; 1 in 2 with 255 ignored.
static uint64_t fuzz_mask_run(FuzzCtx *c, const uint8_t *in, size_t n) {
    int w = 0, h = 0, comp;
    if (n >= 8 && !memcmp(in, "\x89PNG\r\n\x1a\n", 8))  // what mask_load hands to stb_image
        stbi_info_from_memory(in, (int)n, &w, &h, &comp);
    Rng *r = &c->rng;
    if (w < 1 || h < 1 || !fuzz_draw(r, 8)) {
        w = 1 + (int)fuzz_draw(r, 9);
        h = 1 + (int)fuzz_draw(r, 9);
    }
    const int K = fuzz_draw(r, 2) ? 4 : fuzz_draw(r, 2) ? MASK_IGNORED : 1 + (int)fuzz_draw(r, 8);
    const MaskRules void255 = {1, {255}, NULL};
    const int ignoring = (int)fuzz_draw(r, 2);
    Dataset d = {.segmentation = 1, .classes = K};
    snCheck(mask_rules_apply(&d, ignoring ? &void255 : NULL, c->err) == 0, "%s", c->err);
    fuzz_write_input(c, in, n);
    uint8_t *m = mask_load(&d, c->path, h, w, 1, c->err);
    free(d.value_class);
    if (!m) { fuzz_check_err(c); return fuzz_err_sig(c->err); }
    c->accepted = 1;
    for (size_t p = 0; p < (size_t)h * w; p++)
        if (m[p] >= K && !(ignoring && m[p] == MASK_IGNORED)) {
            fuzz_invariant(c, "mask_load gave class %d with %d classes", m[p], K);
            break;
        }
    uint8_t small[8 * 8];
    mask_resize(small, 8, 8, m, h, w);  // what sample_load does next
    free(m);
    int facts[2] = {K, w % 4};
    return fuzz_hash(fuzz_hash(FUZZ_HASH0, "mask", 4), facts, sizeof facts) | 1;
}

// ---- EXIF orientation

static const FuzzToken EXIF_DICT[] = {
        TOK("\xff\xd8"),
        TOK("\xff\xe0"),
        TOK("\xff\xe1"),
        TOK("\xff\xda"),
        TOK("\xff\xd9"),
        TOK("\xff\xff"),
        TOK("Exif\0\0"),
        TOK("MM\0*"),
        TOK("II*\0"),
        TOK("\x01\x12"),
        TOK("\x12\x01"),
        TOK("\x00\x03"),
        TOK("\x03\x00"),
        TOK("\x00\x00\x00\x01"),
        TOK("\x01\x00\x00\x00"),
        TOK("\x00\x00\x00\x08"),
        TOK("\x08\x00\x00\x00"),
        TOK("\x00\x06"),
        TOK("\x06\x00"),
        TOK("\x00\x09"),
        TOK("\xff\xff\xff\xff"),
        TOK("\x00\x00"),
};

// stbi_write_jpg's bytes with exif_app1(o, big) after the SOI marker
static void fuzz_exif_seed(FuzzCtx *c, int w, int h, int quality, int o, int big) {
    uint8_t px[17 * 9 * 3];
    for (size_t i = 0; i < sizeof px; i++) px[i] = (uint8_t)(i * 29 + i / 7);
    FuzzBuf jpg = {0}, b = {0};
    stbi_write_jpg_to_func(fuzz_write_func, &jpg, w, h, 3, px, quality);
    uint8_t app1[EXIF_APP1_LEN];
    exif_app1(app1, o, big);
    fuzz_buf_put(&b, jpg.p, 2);
    fuzz_buf_put(&b, app1, sizeof app1);
    fuzz_buf_put(&b, jpg.p + 2, jpg.n - 2);
    fuzz_add_buf(c, &b);
    free(jpg.p);
}

// JPEGs with every orientation in both byte orders, and a JPEG's head alone
static void fuzz_exif_setup(FuzzCtx *c) {
    for (int o = 1; o <= 8; o++)
        fuzz_exif_seed(c, o % 2 ? 17 : 8, 9, o < 5 ? 95 : 50, o, o > 2 && o < 7);
    uint8_t head[EXIF_HEAD_APP1_END + 4];
    fuzz_add_seed(c, head, exif_jpeg_head(head, 6, 1));
}

// exif_orientation on a copy of exactly the input's length (ASan sees a read
// past it), then exif_orient with that orientation on an h×w image drawn
// (1..9 each), whose pixels are their own indices: the result must hold every
// stored pixel once. The JPEG itself is not decoded: stb_image's decoder is
// the image target's.
static uint64_t fuzz_exif_run(FuzzCtx *c, const uint8_t *in, size_t n) {
    uint8_t *copy = malloc(n ? n : 1);
    snCheck(copy != NULL, "out of host memory");
    if (n) memcpy(copy, in, n);
    const int o = exif_orientation(copy, n);
    free(copy);
    if (o < 1 || o > 8) { fuzz_invariant(c, "exif_orientation gave %d", o); return 0; }
    c->accepted = o != 1;
    const int h = 1 + (int)fuzz_draw(&c->rng, 9), w = 1 + (int)fuzz_draw(&c->rng, 9);
    uint8_t src[9 * 9 * 3];
    for (int p = 0; p < h * w; p++) src[3 * p] = src[3 * p + 1] = src[3 * p + 2] = (uint8_t)p;
    uint8_t *dst = malloc((size_t)3 * h * w);
    snCheck(dst != NULL, "out of host memory");
    exif_orient(dst, src, h, w, o);
    int seen[81] = {0}, bad = 0;
    for (int p = 0; p < h * w; p++) {
        const int v = (int)dst[3 * p];
        if (v < 0 || v >= h * w || seen[v]++ || dst[3 * p + 1] != v || dst[3 * p + 2] != v) bad = 1;
    }
    if (bad) fuzz_invariant(c, "exif_orient %d of %dx%d does not move every pixel once", o, w, h);
    free(dst);
    return fuzz_hash(fuzz_hash(FUZZ_HASH0, "exif", 4), &o, sizeof o) | 1;
}

// ---- CSV lists

static const FuzzToken CSV_DICT[] = {
        TOK("\""),
        TOK("\"\""),
        TOK(","),
        TOK("\n"),
        TOK("\r"),
        TOK("\r\n"),
        TOK("\xef\xbb\xbf"),
        TOK("\x00"),
        TOK("path"),
        TOK("label"),
        TOK("path,label\n"),
        TOK("-1"),
        TOK("0"),
        TOK("1"),
        TOK("2147483648"),
        TOK("9223372036854775808"),
        TOK("99999999999999999999999"),
        TOK(" "),
        TOK("\t"),
        TOK("/"),
        TOK(".."),
        TOK("a.png"),
        TOK("b.jpg"),
        TOK("\"sub dir/c,d.png\""),
        TOK("/dev/null"),
        TOK("cat"),
        TOK("dog"),
        TOK("bird"),
        TOK("+1"),
        TOK("0x10"),
        TOK("1 "),
        TOK("\x1b[31m"),
        TOK("\xff"),
};

static Dataset g_fnames;  // a training set's class names, for list_csv's validation path

// Listed files: a.png, b.jpg, "sub dir/c,d.png", q"x.png (every one exists).
static void fuzz_csv_setup(FuzzCtx *c) {
    char path[400];
    uint8_t px[8 * 8 * 3];
    for (size_t i = 0; i < sizeof px; i++) px[i] = (uint8_t)(i * 13);
    snprintf(path, sizeof path, "%s/sub dir", c->dir);
    snCheck(mkdir(path, 0755) == 0 || errno == EEXIST, "fuzz: mkdir %s", path);
    const char *const pngs[3] = {"a.png", "sub dir/c,d.png", "q\"x.png"};
    for (int i = 0; i < 3; i++) {
        snprintf(path, sizeof path, "%s/%s", c->dir, pngs[i]);
        snCheck(stbi_write_png(path, 8, 8, 3, px, 24), "fuzz: cannot write %s", path);
    }
    snprintf(path, sizeof path, "%s/b.jpg", c->dir);
    snCheck(stbi_write_jpg(path, 8, 8, 3, px, 90), "fuzz: cannot write %s", path);
    static const char *const SEEDS[] = {
        "path,label\na.png,0\nb.jpg,1\n\"sub dir/c,d.png\",2\n",
        "a.png,cat\nb.jpg,dog\n\"q\"\"x.png\",cat\n\"sub dir/c,d.png\",bird\n",
        "\xef\xbb\xbfpath,label\r\na.png,1\r\n/dev/null,0\r\n",
        "path,label\n\na.png, 2 \n\nb.jpg,0\n",
        "path\na.png\nb.jpg\n",
        "\"path\",\"label\"\n\"a.png\",\"bird\"\n\"b.jpg\",\"cat\"\n",
    };
    for (size_t i = 0; i < sizeof SEEDS / sizeof *SEEDS; i++)
        fuzz_add_seed(c, SEEDS[i], strlen(SEEDS[i]));
    if (!g_fnames.names) {
        char *names[3] = {"bird", "cat", "dog"};
        set_names(&g_fnames, names_copy(names, 3), 3);
    }
}

// list_csv as dataset_open_named calls it (K classes, names_from half the
// time), then list_images, predict's reader of the same files
static uint64_t fuzz_csv_run(FuzzCtx *c, const uint8_t *in, size_t n) {
    Rng *r = &c->rng;
    const int named = (int)fuzz_draw(r, 2);
    Dataset d;
    memset(&d, 0, sizeof d);
    d.classes = named ? 3 + (int)fuzz_draw(r, 3) : 1 + (int)fuzz_draw(r, 6);
    d.height = d.width = 8;
    fuzz_write_input(c, in, n);
    uint64_t sig;
    if (list_csv(&d, c->path, named ? &g_fnames : NULL, c->err)) {
        fuzz_check_err(c);
        sig = fuzz_err_sig(c->err);
    } else {
        c->accepted = 1;
        struct stat sb;
        if (d.n < 1 || !d.images || !d.labels)
            fuzz_invariant(c, "list_csv accepted %d samples", d.n);
        if (d.names && (d.n_names < 1 || d.n_names > d.classes))
            fuzz_invariant(c, "%d class names for %d classes", d.n_names, d.classes);
        for (int k = 1; d.names && !named && k < d.n_names; k++)
            if (strcmp(d.names[k - 1], d.names[k]) >= 0) {
                fuzz_invariant(c, "class names not sorted and distinct");
                break;
            }
        for (int i = 0; i < d.n; i++) {
            const int32_t y = d.labels[i];
            if (y < 0 || y >= d.classes || (d.names && y >= d.n_names)) {
                fuzz_invariant(c, "sample %d has label %d", i, y);
                break;
            }
            if (stat(d.images[i], &sb)) {
                fuzz_invariant(c, "listed sample %d does not exist", i);
                break;
            }
        }
        int facts[3] = {d.n < 4 ? d.n : 4, d.names != NULL, named};
        sig = fuzz_hash(fuzz_hash(FUZZ_HASH0, "csv", 3), facts, sizeof facts);
    }
    dataset_free(&d);
    PathList l;
    if (list_images(c->path, &l, c->err)) {
        fuzz_check_err(c);
        sig = fuzz_hash(sig, "li", 2) ^ fuzz_err_sig(c->err);
    } else {
        for (int i = 0; i < l.n; i++)
            if (!l.paths[i][0]) { fuzz_invariant(c, "list_images gave an empty path"); break; }
        sig = fuzz_hash(sig, "li ok", 5);
    }
    path_list_free(&l);
    return sig | 1;
}

// ---- checkpoints

static TrainCfg g_fcfg;
static Trainer g_ftrainer;  // a tiny U-Net's: what --resume loads into

// The trainer's training set: 8 images, 2 batches. Seeds: a checkpoint
// between epochs, one in the middle of an epoch (its pass totals), and
// weights alone (refused).
static void fuzz_ckpt_setup(FuzzCtx *c) {
    static char data[300];  // the trainer's config points to it
    char path[300], err[SN_ERR_MAX];
    snprintf(data, sizeof data, "%s/data", c->dir);
    write_seg_set(data, 8, 8, 8, 1);
    g_fcfg = tiny_seg_cfg(data, NULL);
    g_fcfg.threads = 1;
    snCheck(trainer_open(&g_ftrainer, &g_fcfg, data, NULL, err) == 0, "fuzz: %s", err);
    snprintf(path, sizeof path, "%s/seed.safetensors", c->dir);
    g_ftrainer.epoch = 2;
    g_ftrainer.step = 8;
    g_ftrainer.best = 1.0 / 3.0;
    g_ftrainer.best_epoch = 1;
    snCheck(save_checkpoint(&g_ftrainer, path, NULL, err) == 0, "fuzz: %s", err);
    fuzz_add_seed_file(c, path);
    double sums[2] = {1.5, 4.0};
    int64_t cms[3 * 3] = {4, 0, 1, 0, 3, 0, 2, 0, 6};
    PassSaved mid = {1, 1, 3, sums, cms};
    snCheck(save_checkpoint(&g_ftrainer, path, &mid, err) == 0, "fuzz: %s", err);
    fuzz_add_seed_file(c, path);
    snCheck(net_save_weights(&g_ftrainer.net, path, err) == 0, "fuzz: %s", err);
    fuzz_add_seed_file(c, path);
}

static uint64_t fuzz_ckpt_run(FuzzCtx *c, const uint8_t *in, size_t n) {
    PassSaved ps = {0};
    fuzz_write_input(c, in, n);
    int rc = load_checkpoint(&g_ftrainer, c->path, &ps, c->err);
    pass_saved_free(&ps);
    if (rc) { fuzz_check_err(c); return fuzz_err_sig(c->err); }
    c->accepted = 1;
    return fuzz_hash(FUZZ_HASH0, "ckpt", 4) ^ (uint64_t)ps.batch;
}

// ---- a run's config.txt (--resume RUN, --run RUN)

static const FuzzToken CFG_DICT[] = {
        TOK(" = "),
        TOK("\n"),
        TOK("\r\n"),
        TOK("#"),
        TOK("="),
        TOK(","),
        TOK(":"),
        TOK("x"),
        TOK("model = "),
        TOK("unet-effv2-s"),
        TOK("effv2-t"),
        TOK("classes = "),
        TOK("size = "),
        TOK("class-weights = "),
        TOK("augment = "),
        TOK("brightness="),
        TOK("contrast="),
        TOK("flip"),
        TOK("monitor = "),
        TOK("val_mIoU"),
        TOK("val_accuracy"),
        TOK("memory = "),
        TOK("12G"),
        TOK("max-pixels = "),
        TOK("sync-bn = "),
        TOK("on"),
        TOK("-1"),
        TOK("0"),
        TOK("1e40"),
        TOK("nan"),
        TOK("inf"),
        TOK("2147483648"),
        TOK("18446744073709551616"),
        TOK("\x00"),
        TOK("\xff"),
        TOK("exif = "),
        TOK("apply"),
};

// Seeds: config_text's for a segmentation run and a classifier, and a hand
// edit (comments, blank lines, CRLF).
static void fuzz_config_setup(FuzzCtx *c) {
    TrainCfg cfg = tiny_seg_cfg("data/train", "data/val");
    SfBuf b = {0};
    config_text(&cfg, &b);
    fuzz_add_seed(c, b.p, b.n);
    free(b.p);
    cfg.model.model = "effv2-t";
    cfg.model.classes = 2;
    cfg.augment.flip = 1;
    cfg.augment.brightness = 0.1f;
    cfg.augment.contrast_lo = 0.8f;
    cfg.augment.contrast_hi = 1.2f;
    memset(&b, 0, sizeof b);
    config_text(&cfg, &b);
    fuzz_add_seed(c, b.p, b.n);
    free(b.p);
    static const char EDITED[] = "# edited\r\nmodel = unet\r\n\r\nclasses = 4\r\nsize = "
                                 "64x64\r\nclass-weights = 0,1,1,1\r\n"
                                 "monitor = val_mIoU\r\nsync-bn = on\r\nmemory = 2G\r\n";
    fuzz_add_seed(c, EDITED, sizeof EDITED - 1);
}

// The first line the current input printed on stderr after offset `from`:
// in a child, stderr is its log (with --replay, the terminal: nothing).
static void fuzz_stderr_since(off_t from, char *out, size_t cap) {
    int fd = from < 0 ? -1 : open(g_flog, O_RDONLY | O_CLOEXEC);
    ssize_t got = fd < 0 ? 0 : pread(fd, out, cap - 1, from);
    if (fd >= 0) close(fd);
    out[got > 0 ? got : 0] = 0;
    out[strcspn(out, "\n")] = 0;
}

// parse_train_args with --run DIR, as `segnet eval --run DIR` reads
// DIR/config.txt; its messages go to stderr
static uint64_t fuzz_config_run(FuzzCtx *c, const uint8_t *in, size_t n) {
    fuzz_write_input(c, in, n);
    TrainArgs a = {0};
    char *argv[4] = {"segnet", "eval", "--run", c->dir};
    const off_t from = lseek(2, 0, SEEK_CUR);
    int rc = parse_train_args(&a, 4, argv, "eval", "");
    train_args_free(&a);
    if (rc == 0) { c->accepted = 1; return fuzz_hash(FUZZ_HASH0, "cfg", 3); }
    fuzz_stderr_since(from, c->err, SN_ERR_MAX);
    if (!c->err[0]) snprintf(c->err, SN_ERR_MAX, "refused (the message went to the terminal)");
    if (strpbrk(c->err, "\r")) fuzz_invariant(c, "message of several lines: %s", c->err);
    return fuzz_err_sig(c->err);
}

// ---- whole commands (target cli)
//
// An input is a command line, one argument per line, that segnet's own main
// (segnet_main: this program holds the command line too) runs in a fresh
// process, under the same sanitizers, in a sandbox: a copy of a template
// folder made once per run (fuzz_cli_template): data sets, a finished run
// runs/r, an earlier prediction preds/ (with its manifest), an earlier export
// exports/m.safetensors and files of the user's own in user/. Lines starting
// with '!' change the sandbox before the command: !rm P, !truncate P, !nan P
// (a NaN in a safetensors file), !corrupt P, !write P (a file of the user's),
// !mkdir P, !symlink P T. A path may not climb out (an argument or line that
// could is dropped), and what would only be slow is tamed (bench, the
// quickstart, big models, sizes, epochs). Findings besides crashes and leaks
// (LeakSanitizer after the command), as invariants:
//   - an exit status other than 0, 1 and 2, or a refusal without a message;
//   - a hang (FUZZ_CLI_HANG_S);
//   - a file that existed before changed or went, unless the command may
//     replace it: the run's own files by `train --resume runs/r` or `--out
//     runs/r --overwrite`, a listed prediction by `predict --out preds
//     --overwrite`, the export by `export --out exports/m.safetensors
//     --overwrite` (its lock file aside);
//   - a temporary file left behind; a safetensors file written or changed
//     that holds NaN or inf.

#define FUZZ_CLI_HANG_S   30          // a command running longer is a hang (tamed inputs take ~1 s)
#define FUZZ_CLI_ARGS     64
#define FUZZ_CLI_OPS      8
#define FUZZ_CLI_LEAK     123         // the command's exit status after LeakSanitizer found a leak

static const FuzzToken CLI_DICT[] = {
        TOK("train\n"),
        TOK("predict\n"),
        TOK("eval\n"),
        TOK("export\n"),
        TOK("plan\n"),
        TOK("--data\n"),
        TOK("--val\n"),
        TOK("--out\n"),
        TOK("--resume\n"),
        TOK("--run\n"),
        TOK("--weights\n"),
        TOK("--input\n"),
        TOK("--overwrite\n"),
        TOK("--last\n"),
        TOK("--best\n"),
        TOK("--names\n"),
        TOK("--epochs\n"),
        TOK("--batch\n"),
        TOK("--size\n"),
        TOK("--classes\n"),
        TOK("--class-weights\n"),
        TOK("--model\n"),
        TOK("--lr\n"),
        TOK("--seed\n"),
        TOK("--accum\n"),
        TOK("--augment\n"),
        TOK("--monitor\n"),
        TOK("--early-stopping\n"),
        TOK("--freeze\n"),
        TOK("--unfreeze-last\n"),
        TOK("--head-hidden\n"),
        TOK("--dropout\n"),
        TOK("--depth\n"),
        TOK("--width\n"),
        TOK("--exif\n"),
        TOK("--max-pixels\n"),
        TOK("--replicas\n"),
        TOK("--sync-bn\n"),
        TOK("--log-every\n"),
        TOK("--precision\n"),
        TOK("--checkpoint\n"),
        TOK("--loss-norm\n"),
        TOK("--clipnorm\n"),
        TOK("--allow-missing\n"),
        TOK("--train-eval\n"),
        TOK("--workers\n"),
        TOK("--padding\n"),
        TOK("--memory\n"),
        TOK("--min-delta\n"),
        TOK("data/train\n"),
        TOK("data/val\n"),
        TOK("data/cls.csv\n"),
        TOK("data/train/images\n"),
        TOK("data/val/images\n"),
        TOK("runs/r\n"),
        TOK("runs/new\n"),
        TOK("runs/r/best.safetensors\n"),
        TOK("runs/r/last.safetensors\n"),
        TOK("runs/r/config.txt\n"),
        TOK("preds\n"),
        TOK("preds/i00.png\n"),
        TOK("user\n"),
        TOK("user/notes.txt\n"),
        TOK("user/photo.png\n"),
        TOK("exports/m.safetensors\n"),
        TOK("exports/new.safetensors\n"),
        TOK("link\n"),
        TOK("unet\n"),
        TOK("unet-effv2-t\n"),
        TOK("effv2-t\n"),
        TOK("0\n"),
        TOK("1\n"),
        TOK("2\n"),
        TOK("3\n"),
        TOK("-1\n"),
        TOK("1e34\n"),
        TOK("1e36\n"),
        TOK("nan\n"),
        TOK("inf\n"),
        TOK("8x8\n"),
        TOK("16x16\n"),
        TOK("0,1,1\n"),
        TOK("1,1,1\n"),
        TOK("0,0,0\n"),
        TOK("flip\n"),
        TOK("none\n"),
        TOK("val_mIoU\n"),
        TOK("val_loss\n"),
        TOK("base\n"),
        TOK("fp16\n"),
        TOK("bf16\n"),
        TOK("blocks\n"),
        TOK("keras\n"),
        TOK("apply\n"),
        TOK("torchvision\n"),
        TOK("timm\n"),
        TOK("segnet\n"),
        // issue 49, part B: augment into the data, tiles, the lr's and IoU's settings on resume
        TOK("augment\n"),
        TOK("--tile\n"),
        TOK("--overlap\n"),
        TOK("0.999\n"),
        TOK("4096x4096\n"),
        TOK("--iou-per-image\n"),
        TOK("--schedule\n"),
        TOK("poly\n"),
        TOK("--warmup\n"),
        TOK("!rm runs/r/last.safetensors\n"),
        TOK("!rm runs/r/best.safetensors\n"),
        TOK("!nan runs/r/best.safetensors\n"),
        TOK("!nan runs/r/last.safetensors\n"),
        TOK("!truncate runs/r/last.safetensors\n"),
        TOK("!rm data/train/images/i03.png\n"),
        TOK("!write runs/new/config.txt\n"),
        TOK("!write preds/user.png\n"),
        TOK("!symlink link runs/r\n"),
        TOK("!symlink link data/val/images\n"),
        TOK("!corrupt data/val/masks/i00.png\n"),
        TOK("!mkdir runs/new\n"),
        TOK("!rm "),
        TOK("!nan "),
        TOK("!truncate "),
        TOK("!corrupt "),
        TOK("!write "),
        TOK("!mkdir "),
        TOK("!symlink "),
};

static const char *const CLI_SEEDS[] = {
        "train\n--model\nunet\n--depth\n1\n--width\n2\n--size\n8x8\n--batch\n2\n--epochs\n1\n--"
        "classes\n3\n--class-weights\n0,1,1\n"
        "--data\ndata/train\n--val\ndata/val\n--out\nruns/new\n--threads\n1\n",
        "train\n--resume\nruns/r\n--epochs\n2\n--threads\n1\n",
        "train\n--model\nunet\n--depth\n1\n--width\n2\n--size\n8x8\n--batch\n2\n--epochs\n1\n--"
        "classes\n3\n--data\ndata/train\n"
        "--out\nruns/r\n--overwrite\n--threads\n1\n",
        "predict\n--run\nruns/r\n--input\ndata/val/"
        "images\n--out\npreds\n--overwrite\n--threads\n1\n",
        "predict\n--run\nruns/r\n--input\ndata/val/images\n--out\npreds2\n--threads\n1\n",
        "export\n--run\nruns/r\n--out\nexports/m.safetensors\n--overwrite\n",
        "export\n--run\nruns/r\n--out\nruns/r/last.safetensors\n",
        "eval\n--run\nruns/r\n--threads\n1\n",
        "train\n--model\neffv2-t\n--size\n16x16\n--batch\n2\n--epochs\n1\n--classes\n3\n--"
        "data\ndata/cls.csv\n--out\nruns/cls\n"
        "--threads\n1\n",
        "plan\n--model\nunet-effv2-t\n--size\n32x32\n",
        "!nan "
        "runs/r/best.safetensors\npredict\n--run\nruns/r\n--input\ndata/val/"
        "images\n--out\npreds3\n",
        // replicas whose shards of the last batch are empty (5 images, batches of 4): staged,
        // accumulated
        "train\n--model\nunet\n--depth\n1\n--width\n2\n--size\n8x8\n--batch\n4\n--replicas\n2\n--"
        "epochs\n1\n--classes\n3\n"
        "--data\ndata/train\n--out\nruns/rep\n--threads\n1\n",
        "train\n--model\nunet\n--depth\n1\n--width\n2\n--size\n8x8\n--batch\n2\n--replicas\n2\n--"
        "accum\n2\n--epochs\n1\n"
        "--classes\n3\n--data\ndata/train\n--out\nruns/acc\n--threads\n1\n",
        // empty folders
        "!mkdir data/empty\npredict\n--run\nruns/r\n--input\ndata/empty\n--out\npreds4\n",
        "!mkdir data/empty\n!mkdir data/empty/images\n!mkdir "
        "data/empty/masks\ntrain\n--model\nunet\n--depth\n1\n--classes\n3\n"
        "--size\n8x8\n--data\ndata/empty\n--out\nruns/e\n",
        "augment\n--run\nruns/r\n--out\ndata/train/images\n-n\n1\n",
        "predict\n--run\nruns/r\n--input\ndata/val/images\n--out\npreds\n--overwrite\n--tile\n"
        "4096x4096\n--overlap\n0.999\n--threads\n1\n",
};

// The template, made once (in a process of its own: the harness's children
// must not start OpenMP's threads, which a fork would not carry): built in
// the sandbox's place, so that the run's config.txt names the sandbox's data.
static void fuzz_cli_template(FuzzCtx *c) {
    char tpl[300], box[300], path[700], err[SN_ERR_MAX];
    snprintf(tpl, sizeof tpl, "%s/template", c->dir);
    snprintf(box, sizeof box, "%s/sandbox", c->dir);
    struct stat sb;
    if (stat(tpl, &sb) == 0) return;
    pid_t pid = fork();
    if (pid == 0) {
        rm_rf(box);
        snCheck(mkdir(box, 0755) == 0 && chdir(box) == 0, "fuzz cli: %s: %s", box, strerror(errno));
        mkdir("data", 0755); mkdir("runs", 0755); mkdir("user", 0755); mkdir("exports", 0755);
        // 5: a last batch smaller than the replicas (seeds)
        write_seg_set("data/train", 5, 8, 8, 3);
        write_seg_set("data/val", 2, 8, 8, 4);
        write_file_bytes("data/cls.csv",
                         "train/images/i00.png,0\ntrain/images/i01.png,1\ntrain/images/i02.png,2\n",
                         69);
        write_file_bytes("user/notes.txt", "the user's\n", 11);
        snCheck(copy_file("data/val/images/i00.png", "user/photo.png"), "fuzz cli: copy");
        TrainCfg t = tiny_seg_cfg("data/train", "data/val");
        t.model.width_base = 2; t.model.batch = 2; t.epochs = 1; t.threads = 1; t.out = "runs/r";
        snCheck(train_run(&t, NULL, err) == 0, "fuzz cli: %s", err);
        PredictCfg pc = {.model = t.model,
                         .weights = "runs/r/best.safetensors",
                         .input = "data/val/images",
                         .out = "preds",
                         .device = DEVICE_CPU};
        snCheck(predict_run(&pc, err) == 0, "fuzz cli: %s", err);
        char report[SN_ERR_MAX];
        snCheck(export_run(&t.model, "runs/r", 0, EXPORT_TORCHVISION, "exports/m.safetensors", 0,
                           report, err) == 0,
                "fuzz cli: %s", err);
        snprintf(path, sizeof path, "mv '%s' '%s'", box, tpl);
        _exit(system(path) == 0 ? 0 : 1);
    }
    int st;
    waitpid(pid, &st, 0);
    snCheck(WIFEXITED(st) && WEXITSTATUS(st) == 0 && stat(tpl, &sb) == 0,
            "fuzz cli: the template was not made");
}

static void fuzz_cli_setup(FuzzCtx *c) {
    fuzz_cli_template(c);
    for (size_t i = 0; i < sizeof CLI_SEEDS / sizeof *CLI_SEEDS; i++)
        fuzz_add_seed(c, CLI_SEEDS[i], strlen(CLI_SEEDS[i]));
}

// a path the sandbox keeps: relative, never climbing out
static int fuzz_cli_path_ok(const char *p) { return p[0] && p[0] != '/' && !strstr(p, ".."); }

// What a slow but correct command would be, tamed: big models, sizes (the
// default ones too, where no run gives the size), epochs, batches. Returns argc.
static int fuzz_cli_tame(char **argv, int argc) {
    static const char *const LIMITS[][2] = {
            {"--epochs", "2"},   {"--batch", "4"}, {"--threads", "2"}, {"--workers", "2"},
            {"--replicas", "2"}, {"--accum", "4"}, {"--classes", "8"}, {"--head-hidden", "16"},
            {"--width", "8"},    {"--depth", "3"}};
    for (int i = 2; i + 1 < argc; i++) {
        for (size_t k = 0; k < sizeof LIMITS / sizeof *LIMITS; k++)
            if (!strcmp(argv[i], LIMITS[k][0]) && atoi(argv[i + 1]) > atoi(LIMITS[k][1]))
                argv[i + 1] = (char *)LIMITS[k][1];
        int h, w;
        if (!strcmp(argv[i], "--size") && sscanf(argv[i + 1], "%dx%d", &h, &w) == 2 &&
            (int64_t)h * w > 32 * 32)
            argv[i + 1] = "16x16";
        if (!strcmp(argv[i], "--model") &&
            (strstr(argv[i + 1], "effv2-s") || strstr(argv[i + 1], "effv2-m") ||
             strstr(argv[i + 1], "effv2-l")))
            argv[i + 1] = "effv2-t";
    }
    if (argc + 2 <= FUZZ_CLI_ARGS + 1 && !has_flag(argc, argv, "--size") &&
        !has_flag(argc, argv, "--run") && !has_flag(argc, argv, "--resume")) {
        argv[argc++] = "--size";
        argv[argc++] = "16x16";
        argv[argc] = NULL;
    }
    return argc;
}

// one entry of a folder's snapshot: what a file holds (hash), or a link's target
typedef struct { char path[600]; int link; uint64_t hash; } CliEntry;
typedef struct { CliEntry *e; int n, cap; } CliSnap;

static void fuzz_cli_walk(CliSnap *s, const char *root, const char *rel) {
    char dir[700];
    snprintf(dir, sizeof dir, "%s%s%s", root, rel[0] ? "/" : "", rel);
    DIR *d = opendir(dir);
    if (!d) return;
    for (struct dirent *e; (e = readdir(d));) {
        if (!strcmp(e->d_name, ".") || !strcmp(e->d_name, "..")) continue;
        char r[600], full[1400];
        snprintf(r, sizeof r, "%s%s%s", rel, rel[0] ? "/" : "", e->d_name);
        snprintf(full, sizeof full, "%s/%s", root, r);
        struct stat sb;
        if (lstat(full, &sb) != 0) continue;
        if (S_ISDIR(sb.st_mode)) { fuzz_cli_walk(s, root, r); continue; }
        GROW(s->e, s->n, s->cap);
        CliEntry *x = &s->e[s->n++];
        snprintf(x->path, sizeof x->path, "%s", r);
        x->link = S_ISLNK(sb.st_mode);
        x->hash = FUZZ_HASH0;
        if (x->link) {
            char target[600];
            const ssize_t k = readlink(full, target, sizeof target);
            x->hash = fuzz_hash(x->hash, target, k > 0 ? (size_t)k : 0);
        } else {
            size_t n;
            uint8_t *p = read_file_bytes(full, &n);
            x->hash = p ? fuzz_hash(x->hash, p, n) : 0;
            free(p);
        }
    }
    closedir(d);
}

static const CliEntry *fuzz_cli_find(const CliSnap *s, const char *path) {
    for (int i = 0; i < s->n; i++) if (!strcmp(s->e[i].path, path)) return &s->e[i];
    return NULL;
}

// Whether the sandbox paths a and b are the same file or folder
static int fuzz_cli_same(const char *box, const char *a, const char *b) {
    char pa[1400], pb[1400], ra[PATH_MAX], rb[PATH_MAX];
    snprintf(pa, sizeof pa, "%s/%s", box, a);
    snprintf(pb, sizeof pb, "%s/%s", box, b);
    return realpath(pa, ra) && realpath(pb, rb) && !strcmp(ra, rb);
}

// The value after the last `flag` in argv, or NULL
static const char *fuzz_cli_value(char **argv, int argc, const char *flag) {
    const char *v = NULL;
    for (int i = 2; i + 1 < argc; i++) if (!strcmp(argv[i], flag)) v = argv[i + 1];
    return v;
}

// Whether the command may change or remove `path` (which existed before it), by the rules above
static int fuzz_cli_may_change(const char *box, const char *path, char **argv, int argc,
                               const char *listed, size_t n_listed) {
    const char *base = strrchr(path, '/') ? strrchr(path, '/') + 1 : path;
    if (!strcmp(base, RUN_LOCK_FILE)) return 1;
    const char *cmd = argc > 1 ? argv[1] : "", *out = fuzz_cli_value(argv, argc, "--out");
    const char *resume = fuzz_cli_value(argv, argc, "--resume");
    const int overwrite = has_flag(argc, argv, "--overwrite");
    if (!strncmp(path, "runs/r/", 7))
        return !strcmp(cmd, "train") && ((resume && fuzz_cli_same(box, resume, "runs/r")) ||
                                         (overwrite && out && fuzz_cli_same(box, out, "runs/r")));
    if (!strncmp(path, "preds/", 6)) {
        int in_manifest = 0;
        for (size_t i = 0; i < n_listed; i += strlen(listed + i) + 1)
            in_manifest |= !strcmp(listed + i, base);
        return !strcmp(cmd, "predict") && overwrite && out && fuzz_cli_same(box, out, "preds") &&
               (in_manifest || !strcmp(base, PREDICT_MANIFEST));
    }
    if (!strcmp(path, "exports/m.safetensors"))
        return !strcmp(cmd, "export") && overwrite && out && fuzz_cli_same(box, out, path);
    return 0;
}

// Whether a safetensors file holds only finite values (what it holds, if it reads)
static int fuzz_cli_finite(const char *path, char *which, size_t cap) {
    SafetensorsFile f;
    char err[SN_ERR_MAX];
    if (safetensors_read(path, &f, err)) return 1;  // not a model (a truncated copy, another file)
    int ok = 1;
    for (int i = 0; ok && i < f.n_tensors; i++) {
        const SafetensorsTensor *t = &f.tensors[i];
        if (t->dtype == DT_I64) continue;
        float *v = malloc(sizeof(float) * (t->numel ? t->numel : 1));
        snCheck(v != NULL, "out of host memory");
        safetensors_tensor_f32(t, v);
        for (size_t k = 0; ok && k < t->numel; k++)
            if (!isfinite(v[k])) { ok = 0; snprintf(which, cap, "%s", t->name); }
        free(v);
    }
    safetensors_free(&f);
    return ok;
}

// A sandbox change (`!OP PATH [TARGET]`) before the command
static void fuzz_cli_op(const char *box, const char *line) {
    char op[16], p[300], target[300] = "", full[700];
    if (sscanf(line, "!%15s %299s %299s", op, p, target) < 2 || !fuzz_cli_path_ok(p) ||
        (target[0] && !fuzz_cli_path_ok(target)))
        return;
    snprintf(full, sizeof full, "%s/%s", box, p);
    if (!strcmp(op, "rm")) unlink(full);
    else if (!strcmp(op, "mkdir")) mkdir(full, 0755);
    else if (!strcmp(op, "write")) write_file_bytes(full, "the user's\n", 11);
    else if (!strcmp(op, "symlink") && target[0]) {
        char to[700];
        // absolute within the sandbox: the link's own folder may differ
        snprintf(to, sizeof to, "%s/%s", box, target);
        if (symlink(to, full)) {}
    } else if (!strcmp(op, "truncate") || !strcmp(op, "corrupt") || !strcmp(op, "nan")) {
        size_t n;
        uint8_t *b = read_file_bytes(full, &n);
        if (!b) return;
        if (!strcmp(op, "truncate")) n /= 2;
        else if (!strcmp(op, "corrupt") && n) b[n / 2] ^= 0x5a;
        else {  // a NaN at the start of the first F32 tensor's data
            SafetensorsFile f;
            char err[SN_ERR_MAX];
            if (safetensors_read(full, &f, err) == 0) {
                for (int i = 0; i < f.n_tensors; i++)
                    if (f.tensors[i].dtype == DT_F32 && f.tensors[i].numel) {
                        const size_t at = (size_t)((const uint8_t *)f.tensors[i].data - f.bytes);
                        const float nan = NAN;
                        memcpy(b + at, &nan, 4);
                        break;
                    }
                safetensors_free(&f);
            }
        }
        write_file_bytes(full, b, n);
        free(b);
    }
}

static uint64_t fuzz_cli_run(FuzzCtx *c, const uint8_t *in, size_t n) {
    alarm(0);  // the command has its own limit
    char box[300], tpl[300], cmd[800], outp[300], errp[300];
    snprintf(box, sizeof box, "%s/sandbox", c->dir);
    snprintf(tpl, sizeof tpl, "%s/template", c->dir);
    snprintf(outp, sizeof outp, "%s/out.txt", c->dir);
    snprintf(errp, sizeof errp, "%s/err.txt", c->dir);
    // the input's lines: sandbox changes and arguments
    char *text = malloc(n + 1);
    snCheck(text != NULL, "out of host memory");
    memcpy(text, in, n);
    text[n] = 0;
    char *argv[FUZZ_CLI_ARGS + 2], *ops[FUZZ_CLI_OPS];
    int argc = 1, n_ops = 0;
    argv[0] = "segnet";
    for (char *save = NULL, *line = strtok_r(text, "\n", &save); line;
         line = strtok_r(NULL, "\n", &save)) {
        if (line[0] == '!') { if (n_ops < FUZZ_CLI_OPS) ops[n_ops++] = line; }
        // no way out of the sandbox
        else if (argc <= FUZZ_CLI_ARGS && fuzz_cli_path_ok(line)) argv[argc++] = line;
    }
    argv[argc] = NULL;
    if (argc > 1 && !strcmp(argv[1], "bench")) argv[1] = "plan";
    uint64_t sig;
    if (argc < 2 || (argc == 2 && !strcmp(argv[1], "train"))) {  // the quickstart: minutes
        free(text);
        snprintf(c->err, SN_ERR_MAX, "tamed: nothing to run");
        return fuzz_hash(FUZZ_HASH0, "none", 4);
    }
    argc = fuzz_cli_tame(argv, argc);
    snprintf(cmd, sizeof cmd, "rm -rf '%s' && cp -a '%s' '%s'", box, tpl, box);
    snCheck(system(cmd) == 0, "fuzz cli: cannot copy the template");
    for (int i = 0; i < n_ops; i++) fuzz_cli_op(box, ops[i]);
    CliSnap before = {0}, after = {0};
    fuzz_cli_walk(&before, box, "");
    size_t n_listed = 0;
    char manifest[700];
    snprintf(manifest, sizeof manifest, "%s/preds/" PREDICT_MANIFEST, tpl);
    char *listed = (char *)read_file_bytes(manifest, &n_listed);
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        __sanitizer_set_death_callback(NULL);
        signal(SIGALRM, SIG_DFL);
        int fd0 = open("/dev/null", O_RDONLY), fd1 = open(outp, O_WRONLY | O_CREAT | O_TRUNC, 0644),
            fd2 = open(errp, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd0 < 0 || fd1 < 0 || fd2 < 0 || chdir(box) != 0) _exit(FUZZ_EXIT_SETUP);
        dup2(fd0, 0); dup2(fd1, 1); dup2(fd2, 2);
        alarm(FUZZ_CLI_HANG_S);
        const int rc = segnet_main(argc, argv);
        fflush(stdout); fflush(stderr);
        _exit(__lsan_do_recoverable_leak_check() ? FUZZ_CLI_LEAK : rc);
    }
    int st;
    waitpid(pid, &st, 0);
    size_t n_err;
    char *said = read_file(errp, &n_err), last[SN_ERR_MAX] = "";
    const char *report = said ? strstr(said, "ERROR: AddressSanitizer") : NULL;
    if (said && !report) report = strstr(said, "runtime error:");
    if (said && !report) report = strstr(said, "ERROR: LeakSanitizer");
    for (char *p = said, *e; p && *p; p = e + (*e != 0)) {  // the last line said
        e = p + strcspn(p, "\n");
        if (e > p) snprintf(last, sizeof last, "%.*s", (int)(e - p), p);
    }
    const int rc = WIFEXITED(st) ? WEXITSTATUS(st) : -1;
    snprintf(c->err, SN_ERR_MAX, "%s", last);
    if (report)
        fuzz_invariant(c, "`segnet %s` under the sanitizers: %.*s", argv[1],
                       (int)strcspn(report, "\n"), report);
    else if (WIFSIGNALED(st) && WTERMSIG(st) == SIGALRM)
        fuzz_invariant(c, "`segnet %s` still running after %d s", argv[1], FUZZ_CLI_HANG_S);
    else if (WIFSIGNALED(st))
        fuzz_invariant(c, "`segnet %s` killed by %s", argv[1], strsignal(WTERMSIG(st)));
    else if (rc == FUZZ_CLI_LEAK)
        fuzz_invariant(c, "`segnet %s` leaks (LeakSanitizer after the command)", argv[1]);
    else if (rc != 0 && rc != 1 && rc != 2)
        fuzz_invariant(c, "`segnet %s` exited %d: %s", argv[1], rc, last);
    else if (rc != 0 && !last[0])
        fuzz_invariant(c, "`segnet %s` exited %d without a message", argv[1], rc);
    fuzz_cli_walk(&after, box, "");
    for (int i = 0; i < before.n; i++) {
        const CliEntry *b = &before.e[i], *a = fuzz_cli_find(&after, b->path);
        if ((!a || a->hash != b->hash || a->link != b->link) &&
            !fuzz_cli_may_change(box, b->path, argv, argc,
                                 listed ? listed + strlen(PREDICT_MANIFEST_HEAD) : NULL,
                                 listed && n_listed > strlen(PREDICT_MANIFEST_HEAD)
                                         ? n_listed - strlen(PREDICT_MANIFEST_HEAD)
                                         : 0))
            fuzz_invariant(c, "`segnet %s` %s %s, a file it may not replace", argv[1],
                           a ? "changed" : "removed", b->path);
    }
    for (int i = 0; i < after.n; i++) {
        const CliEntry *a = &after.e[i], *b = fuzz_cli_find(&before, a->path);
        char full[1400], which[SN_NAME_MAX] = "";
        snprintf(full, sizeof full, "%s/%s", box, a->path);
        if (strstr(a->path, TMP_MARK) && !(b && b->hash == a->hash))
            fuzz_invariant(c, "`segnet %s` left a temporary file: %s", argv[1], a->path);
        if ((!b || b->hash != a->hash) && !a->link && name_ends_with(a->path, ".safetensors") &&
            !fuzz_cli_finite(full, which, sizeof which))
            fuzz_invariant(c, "`segnet %s` wrote %s holding NaN or inf (%s)", argv[1], a->path,
                           which);
    }
    c->accepted = rc == 0;
    sig = fuzz_hash(fuzz_hash(FUZZ_HASH0, argv[1], strlen(argv[1])), &rc, sizeof rc) ^
          (rc ? fuzz_err_sig(last) : 0);
    free(before.e); free(after.e); free(listed); free(said); free(text);
    return sig | 1;
}

// Mutations of the command as lines, most of them keeping it well formed (a
// value that fits its option, from CLI_OPTIONS, so that commands get past the
// parser into the runs): a value replaced, an option with a value or a switch
// inserted, an option deleted, a sandbox change first, another command; else a
// byte-level mutation or a dictionary token.
static const struct { const char *flag, *values;
} CLI_OPTIONS[] = {
        {"--data", "data/train|data/val|data/cls.csv|data/empty|user|link"},
        {"--val", "data/val|data/train|data/cls.csv"},
        {"--out", "runs/new|runs/r|preds|preds2|user|user/notes.txt|user/photo.png|exports/"
                  "m.safetensors|exports/new.safetensors|"
                  "data/val/images|data/val/images/p|link|runs/r/last.safetensors|runs/r/"
                  "best.safetensors|runs/r/x.safetensors"},
        {"--resume", "runs/r|runs/new|link|preds"},
        {"--run", "runs/r|link|runs/new|data/train"},
        {"--weights",
         "runs/r/best.safetensors|runs/r/last.safetensors|exports/m.safetensors|user/notes.txt"},
        {"--input", "data/val/images|data/train/images|user|preds|data/cls.csv|link|runs/r"},
        {"--epochs", "1|2"},
        {"--batch", "1|2|3|4"},
        {"--size", "8x8|16x16|7x9|32x32"},
        {"--classes", "3|2|4|1"},
        {"--class-weights", "0,1,1|1,1,1|0,0,0|1,0,0|0,1|nan,1,1"},
        {"--model", "unet|unet-effv2-t|effv2-t"},
        {"--lr", "0.001|1e34|1e36|0"},
        {"--seed", "1|5"},
        {"--accum", "1|2|3"},
        {"--augment", "flip|none|brightness=0.5|contrast=0.5:1.5"},
        {"--monitor", "val_loss|val_mIoU|val_accuracy"},
        {"--early-stopping", "1|2"},
        {"--freeze", "base|none"},
        {"--unfreeze-last", "0|1|2"},
        {"--head-hidden", "0|4"},
        {"--dropout", "0.2|0"},
        {"--depth", "1|2"},
        {"--width", "2|4"},
        {"--exif", "apply|ignore"},
        {"--max-pixels", "1|64|100000000"},
        {"--replicas", "1|2"},
        {"--log-every", "1|0"},
        {"--precision", "fp32|fp16|bf16"},
        {"--checkpoint", "none|blocks"},
        {"--loss-norm", "weighted|keras"},
        {"--clipnorm", "0|1"},
        {"--allow-missing", "head.|enc"},
        {"--workers", "1|2"},
        {"--padding", "same|symmetric"},
        {"--memory", "1G|1K"},
        {"--min-delta", "0|0.1"},
        {"--names", "torchvision|timm|segnet"},
        {"--threads", "1|2"},
        {"--warmup", "0|3"},
        {"--schedule", "cosine|constant"},
        {"--weight-decay", "0|0.01"},
};
static const char *const CLI_SWITCHES[] = {"--overwrite", "--last", "--best", "--sync-bn",
                                           "--train-eval"};
static const char *const CLI_COMMANDS[] = {"train", "predict", "eval", "export", "plan"};

// one of `values` ('|'-separated) into out, with its newline
static size_t fuzz_cli_pick(Rng *r, const char *values, char *out, size_t cap) {
    int n = 1;
    for (const char *p = values; *p; p++) n += *p == '|';
    const char *v = values;
    for (int k = (int)fuzz_draw(r, (uint64_t)n); k > 0; k--) v = strchr(v, '|') + 1;
    return (size_t)snprintf(out, cap, "%.*s\n", (int)strcspn(v, "|"), v);
}

static size_t fuzz_cli_mutate(FuzzCtx *c, Rng *r, uint8_t *b, size_t n) {
    size_t starts[FUZZ_CLI_ARGS * 2 + 1], k = 0;
    for (size_t i = 0; i < n && k + 1 < sizeof starts / sizeof *starts; i++)
        if (i == 0 || b[i - 1] == '\n') starts[k++] = i;
    starts[k] = n;
    size_t cmd = 0;  // the command word's line: the first that is no sandbox change
    while (cmd < k && b[starts[cmd]] == '!') cmd++;
    const uint64_t how = fuzz_draw(r, 20);
    if (cmd == k || how >= 18) return fuzz_mutate(c, r, b, n);
    char add[256];
    size_t m;
    if (how < 7) {  // a value replaced by one its option takes
        const size_t line = cmd + 1 + fuzz_draw(r, k - cmd), at = starts[line - 1],
                     len = starts[line] - at;
        for (size_t o = 0; line < k && o < sizeof CLI_OPTIONS / sizeof *CLI_OPTIONS; o++)
            if (len == strlen(CLI_OPTIONS[o].flag) + 1 &&
                !memcmp(b + at, CLI_OPTIONS[o].flag, len - 1)) {
                m = fuzz_cli_pick(r, CLI_OPTIONS[o].values, add, sizeof add);
                memmove(b + starts[line], b + starts[line + 1], n - starts[line + 1]);
                return fuzz_insert(b, n - (starts[line + 1] - starts[line]), starts[line], add, m);
            }
        return n;
    }
    // where an option may go: before one, or at the end
    size_t bounds[FUZZ_CLI_ARGS * 2 + 1], n_bounds = 0;
    for (size_t i = cmd + 1; i <= k; i++)
        if (i == k || (b[starts[i]] == '-' && starts[i] + 1 < n && b[starts[i] + 1] == '-'))
            bounds[n_bounds++] = starts[i];
    const size_t pos = bounds[fuzz_draw(r, n_bounds)];
    if (how < 12) {  // an option with a value
        const size_t o = fuzz_draw(r, sizeof CLI_OPTIONS / sizeof *CLI_OPTIONS);
        m = (size_t)snprintf(add, sizeof add, "%s\n", CLI_OPTIONS[o].flag);
        m += fuzz_cli_pick(r, CLI_OPTIONS[o].values, add + m, sizeof add - m);
        return fuzz_insert(b, n, pos, add, m);
    }
    if (how < 14) {  // a switch
        m = (size_t)snprintf(
                add, sizeof add, "%s\n",
                CLI_SWITCHES[fuzz_draw(r, sizeof CLI_SWITCHES / sizeof *CLI_SWITCHES)]);
        return fuzz_insert(b, n, pos, add, m);
    }
    if (how < 16) {  // a line deleted (an option's value then takes the next option as its own)
        const size_t line = cmd + 1 + fuzz_draw(r, k - cmd);
        if (line >= k) return n;
        memmove(b + starts[line], b + starts[line + 1], n - starts[line + 1]);
        return n - (starts[line + 1] - starts[line]);
    }
    if (how == 16) {  // a sandbox change first
        const FuzzToken *tk;
        do tk = &CLI_DICT[fuzz_draw(r, sizeof CLI_DICT / sizeof *CLI_DICT)];
        while (tk->s[0] != '!' || tk->s[tk->n - 1] != '\n');
        return fuzz_insert(b, n, 0, tk->s, tk->n);
    }
    // another command
    m = (size_t)snprintf(add, sizeof add, "%s\n",
                         CLI_COMMANDS[fuzz_draw(r, sizeof CLI_COMMANDS / sizeof *CLI_COMMANDS)]);
    memmove(b + starts[cmd], b + starts[cmd + 1], n - starts[cmd + 1]);
    return fuzz_insert(b, n - (starts[cmd + 1] - starts[cmd]), starts[cmd], add, m);
}

// ---- deliberately faulty readers: --selftest checks that each fault is caught

static void fuzz_faulty_setup(FuzzCtx *c) { fuzz_add_seed(c, "\x02" "abc", 4); }

// trusts its length byte: reads past its copy when in[0] >= n
static uint64_t fuzz_faulty_overflow(FuzzCtx *c, const uint8_t *in, size_t n) {
    (void)c;
    uint8_t *copy = malloc(n ? n : 1);
    memcpy(copy, in, n);
    unsigned sum = 0;
    for (size_t i = 1; n && i <= copy[0]; i++) sum += copy[i];
    free(copy);
    return sum | 1;
}
// forgets its copy of an input longer than 8 bytes
static uint64_t fuzz_faulty_leak(FuzzCtx *c, const uint8_t *in, size_t n) {
    (void)c;
    char *copy = malloc(n + 1);
    memcpy(copy, in, n);
    if (n <= 8) free(copy);
    return (uint64_t)n << 1 | 1;
}
// never returns on an input that starts with 0
static uint64_t fuzz_faulty_hang(FuzzCtx *c, const uint8_t *in, size_t n) {
    (void)c;
    volatile int spin = n && in[0] == 0;
    while (spin) {}
    return (uint64_t)n << 1 | 1;
}

static const FuzzTarget FUZZ_TARGETS[] = {
        {"safetensors", "input.safetensors", SF_DICT, sizeof SF_DICT / sizeof *SF_DICT,
         fuzz_sf_setup, fuzz_sf_run, fuzz_sf_mutate},
        {"image", "input.png", IMG_DICT, sizeof IMG_DICT / sizeof *IMG_DICT, fuzz_image_setup,
         fuzz_image_run, NULL},
        {"mask", "input.png", IMG_DICT, sizeof IMG_DICT / sizeof *IMG_DICT, fuzz_image_setup,
         fuzz_mask_run, NULL},
        {"exif", "input.jpg", EXIF_DICT, sizeof EXIF_DICT / sizeof *EXIF_DICT, fuzz_exif_setup,
         fuzz_exif_run, NULL},
        {"csv", "list.csv", CSV_DICT, sizeof CSV_DICT / sizeof *CSV_DICT, fuzz_csv_setup,
         fuzz_csv_run, NULL},
        {"checkpoint", "input.safetensors", SF_DICT, sizeof SF_DICT / sizeof *SF_DICT,
         fuzz_ckpt_setup, fuzz_ckpt_run, fuzz_sf_mutate},
        {"config", "config.txt", CFG_DICT, sizeof CFG_DICT / sizeof *CFG_DICT, fuzz_config_setup,
         fuzz_config_run, NULL},
        {"cli", "command.txt", CLI_DICT, sizeof CLI_DICT / sizeof *CLI_DICT, fuzz_cli_setup,
         fuzz_cli_run, fuzz_cli_mutate},
};
static const FuzzTarget SELFTEST_TARGETS[] = {
    {"selftest-overflow", "input", NULL, 0, fuzz_faulty_setup, fuzz_faulty_overflow, NULL},
    {"selftest-leak", "input", NULL, 0, fuzz_faulty_setup, fuzz_faulty_leak, NULL},
    {"selftest-hang", "input", NULL, 0, fuzz_faulty_setup, fuzz_faulty_hang, NULL},
};
#define N_FUZZ_TARGETS ((int)(sizeof FUZZ_TARGETS / sizeof *FUZZ_TARGETS))

static const FuzzTarget *fuzz_find_target(const char *name) {
    for (int i = 0; i < N_FUZZ_TARGETS; i++)
        if (!strcmp(FUZZ_TARGETS[i].name, name)) return &FUZZ_TARGETS[i];
    for (int i = 0; i < 3; i++)
        if (!strcmp(SELFTEST_TARGETS[i].name, name)) return &SELFTEST_TARGETS[i];
    return NULL;
}

// ---- the driver

static void fuzz_ctx_open(FuzzCtx *c, const FuzzTarget *t, const char *base) {
    memset(c, 0, sizeof *c);
    c->t = t;
    snprintf(c->dir, sizeof c->dir, "%s/%s", base, t->name);
    snprintf(c->path, sizeof c->path, "%s/%s", c->dir, t->file);
    snCheck(mkdir(c->dir, 0755) == 0 || errno == EEXIST, "fuzz: mkdir %s: %s", c->dir,
            strerror(errno));
    t->setup(c);
    g_fz->seeded = 1;
}

// Runs one input under the hang alarm. Its draws (the mask's size and
// classes, the CSV's) come from its bytes, so that its file alone replays it.
static uint64_t fuzz_run(FuzzCtx *c, const uint8_t *in, size_t n) {
    c->err[0] = 0;
    c->accepted = 0;
    rng_seed(&c->rng, rng_mix64(fuzz_hash(FUZZ_HASH0, in, n)));
    alarm((unsigned)g_fopts->hang_s);
    uint64_t sig = c->t->run(c, in, n);
    alarm(0);
    return sig;
}

// Input k (in its ring slot): run, counted, kept when its outcome is new.
// -v: the seeds' outcomes.
static void fuzz_one(FuzzCtx *c, uint64_t k) {
    const uint8_t *in = g_fz->ring[k % FUZZ_RING];
    const size_t n = g_fz->len[k % FUZZ_RING];
    g_fz->current = k;
    g_fz->running = 1;
    uint64_t sig = fuzz_run(c, in, n);
    g_fz->running = 0;
    if (g_fopts->verbose && k < (uint64_t)g_fz->n_seeds) {
        char shown[4 * SN_ERR_MAX];
        printf("fuzz %s: seed %" PRIu64 " (%zu bytes): %s%s\n", c->t->name, k, n,
               c->accepted ? "accepted" : "refused: ",
               c->accepted ? "" : fuzz_printable(shown, sizeof shown, c->err));
        fflush(stdout);
    }
    g_fz->executions++;
    g_fz->accepted += (uint64_t)c->accepted;
    if (fuzz_sig_new(sig) && fuzz_corpus_add(in, n)) g_fz->kept++;
}

// The sanitizer has printed its report and is about to end the child: the
// input is in the shared ring, so the parent saves it; say which death it was.
static void fuzz_on_death(void) { g_fz->sanitizer = 1; }
// a hang: where it was, then the exit status the parent knows
static void fuzz_on_alarm(int sig) {
    (void)sig;
    fprintf(stderr, "fuzz: input still running after %d s, at:\n", g_fopts->hang_s);
    __sanitizer_print_stack_trace();
    _exit(FUZZ_EXIT_HANG);
}

// A child's start: its stderr into g_flog (the parent shows what matters),
// the death callback, the hang alarm, the target's fixtures and seeds.
static void fuzz_child_open(const FuzzTarget *t, const char *base) {
    int fd = open(g_flog, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
    if (fd >= 0) { dup2(fd, 2); close(fd); }
    __sanitizer_set_death_callback(fuzz_on_death);
    signal(SIGALRM, fuzz_on_alarm);
    g_fctx = malloc(sizeof *g_fctx);
    snCheck(g_fctx != NULL, "out of host memory");
    fuzz_ctx_open(g_fctx, t, base);
    if (__lsan_do_recoverable_leak_check()) _exit(FUZZ_EXIT_SETUP);
}

// The child: inputs from g_fz->next on until the deadline or a limit; exits 0
// having set `finished`, or with `leaked` set, or dies on a finding.
static void fuzz_child(const FuzzTarget *t, const char *base, double deadline) {
    fuzz_child_open(t, base);
    const uint64_t end = g_fopts->runs ? g_fopts->runs : UINT64_MAX;
    const int max_findings = g_fopts->first_only ? 1 : FUZZ_MAX_FINDINGS;
    uint64_t k = g_fz->next;
    for (g_fz->check_from = k; k < end && now_s() < deadline && g_fz->findings < max_findings;
         k++) {
        size_t n = fuzz_input(g_fctx, g_fopts->seed, k, g_fz->ring[k % FUZZ_RING]);
        g_fz->len[k % FUZZ_RING] = n;
        g_fz->digest = fuzz_hash(g_fz->digest, g_fz->ring[k % FUZZ_RING], n);
        fuzz_one(g_fctx, k);
        if (k + 1 - g_fz->check_from == FUZZ_RING) {
            if (__lsan_do_recoverable_leak_check()) { g_fz->leaked = 1; _exit(0); }
            g_fz->check_from = k + 1;
            if (ftruncate(2, 0) == 0) lseek(2, 0, SEEK_SET);  // the log matters only from here on
        }
    }
    if (k > g_fz->check_from && __lsan_do_recoverable_leak_check()) { g_fz->leaked = 1; _exit(0); }
    g_fz->finished = 1;
    fflush(stdout);
    _exit(0);
}

// After a leak check failed: inputs check_from..current one by one in a fresh
// child, a leak check after each; the first that fails names the input (its
// report replaces the child's log).
static int fuzz_find_leak(const FuzzTarget *t, const char *base) {
    const uint64_t from = g_fz->check_from, to = g_fz->current;
    const uint64_t counts[2] = {g_fz->executions, g_fz->accepted};
    const int kept = g_fz->kept, n_corpus = g_fz->n_corpus;
    const size_t used = g_fz->corpus_used;
    g_fz->leak_at = UINT64_MAX;
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        fuzz_child_open(t, base);
        for (uint64_t k = from; k <= to; k++) {
            fuzz_one(g_fctx, k);
            if (__lsan_do_recoverable_leak_check()) { g_fz->leak_at = k; break; }
        }
        _exit(0);
    }
    int st;
    waitpid(pid, &st, 0);
    g_fz->executions = counts[0]; g_fz->accepted = counts[1];
    g_fz->kept = kept; g_fz->n_corpus = n_corpus; g_fz->corpus_used = used;
    return g_fz->leak_at != UINT64_MAX;
}

// From a report: its one-line summary, and the first stack frame that is
// neither the sanitizer's, libc's nor the harness's signal handler, which
// names the finding ("FUNC FILE:LINE" when symbolized, else "MODULE+OFFSET").
static void fuzz_read_log(const char *log, int hang, char *summary, size_t n_summary, char *frame,
                          size_t n_frame) {
    static const char *const SKIP_FUNC[] = {
            "__interceptor_", "__sanitizer", "__asan",  "__lsan", "__ubsan", "fuzz_on_",
            "malloc",         "calloc",      "realloc", "free",   "strdup",  "__strdup",
            "__libc",         "__GI_",       "raise",   "abort",  "_start",  "__restore_rt"};
    static const char *const SKIP_MODULE[] = {"libasan", "libubsan", "liblsan",
                                              "libc.so", "ld-linux", "libgcc"};
    size_t n;
    char *text = (char *)read_file_bytes(log, &n), *save = NULL, *last = NULL;
    // unsymbolized, the alarm handler is the hang's first frame of this program
    int handler = hang;
    summary[0] = frame[0] = 0;
    for (char *line = text ? strtok_r(text, "\n", &save) : NULL; line;
         line = strtok_r(NULL, "\n", &save)) {
        char func[160], where[400];
        const char *sum = strstr(line, "SUMMARY: ");
        if (strstr(line, "runtime error:")) snprintf(summary, n_summary, "%s", line);
        else if (sum && !strstr(summary, "runtime error:"))
            snprintf(summary, n_summary, "%s", sum + 9);
        if (!frame[0] && sscanf(line, " #%*d 0x%*x in %159s %399s", func, where) == 2) {
            int skip = strstr(where, "libsanitizer") != NULL;
            for (size_t i = 0; i < sizeof SKIP_FUNC / sizeof *SKIP_FUNC; i++)
                skip |= !strncmp(func, SKIP_FUNC[i], strlen(SKIP_FUNC[i]));
            const char *file = strrchr(where, '/');
            if (!skip) snprintf(frame, n_frame, "%s %s", func, file ? file + 1 : where);
        } else if (!frame[0] && sscanf(line, " #%*d 0x%*x (%399[^)])", where) == 1) {
            int skip = 0;
            for (size_t i = 0; i < sizeof SKIP_MODULE / sizeof *SKIP_MODULE; i++)
                skip |= strstr(where, SKIP_MODULE[i]) != NULL;
            const char *file = strrchr(where, '/');
            if (!skip && !handler) snprintf(frame, n_frame, "%s", file ? file + 1 : where);
            else if (!skip) handler = 0;
        }
        if (line[strspn(line, " \t")]) last = line;
    }
    // e.g. segnet's internal error
    if (!summary[0] && last) snprintf(summary, n_summary, "%s", last);
    free(text);
}

// OUT/TARGET-KIND-K.txt: the input replayed by a fresh fuzz_segnet with
// symbolized stacks, its stdout and stderr
static void fuzz_write_report(const char *target, const char *input, const char *report,
                              const char *base) {
    fflush(stdout);
    pid_t pid = fork();
    if (pid == 0) {
        int fd = open(report, O_WRONLY | O_CREAT | O_TRUNC, 0644);
        if (fd < 0) _exit(127);
        dup2(fd, 1);
        dup2(fd, 2);
        static const char *const ENV[2] = {"ASAN_OPTIONS", "UBSAN_OPTIONS"};
        for (int i = 0; i < 2; i++) {
            char opts[4096];
            const char *was = getenv(ENV[i]);
            snprintf(opts, sizeof opts, "%s%ssymbolize=1", was ? was : "",
                     was && was[0] ? ":" : "");
            setenv(ENV[i], opts, 1);
        }
        char hang[16];
        snprintf(hang, sizeof hang, "%d", g_fopts->hang_s);
        char work[300];
        snprintf(work, sizeof work, "%s/replay", base);
        execl("/proc/self/exe", "fuzz_segnet", "--replay", input, target, "--out", g_fopts->out,
              "--hang", hang, "--work", work, (char *)NULL);
        _exit(127);
    }
    int st;
    waitpid(pid, &st, 0);
}

// The parent's account of a child that did not finish: which finding, saved
// with its report (once per finding: a repeat is counted, not saved). Returns
// 0 when the target cannot go on (its setup failed).
static int fuzz_report_death(const FuzzTarget *t, const char *base, int st, char first[512]) {
    char what[600], summary[400], frame[600], key[FUZZ_KEY_MAX], path[512] = "", report[520] = "";
    const char *kind = "crash";
    uint64_t k = g_fz->current, next = k + 1;
    int go_on = 1, hang = WIFEXITED(st) && WEXITSTATUS(st) == FUZZ_EXIT_HANG;
    if (g_fz->leaked) {
        kind = "leak";
        if (fuzz_find_leak(t, base)) k = g_fz->leak_at;
    }
    fuzz_read_log(g_flog, hang && !g_fz->leaked, summary, sizeof summary, frame, sizeof frame);
    if (g_fz->leaked) {
        snprintf(what, sizeof what, "%s%s", summary,
                 k == g_fz->leak_at ? ""
                                    : " (no input of the last ones leaks alone: the last saved)");
    } else if (WIFEXITED(st) && WEXITSTATUS(st) == FUZZ_EXIT_SETUP) {
        snprintf(what, sizeof what, "the target's fixtures and seeds leak: %s", summary);
        go_on = 0;
    } else if (!g_fz->running) {
        snprintf(what, sizeof what, "the child died outside an input (%s %d): %s",
                 WIFSIGNALED(st) ? "signal" : "exit status",
                 WIFSIGNALED(st) ? WTERMSIG(st) : WEXITSTATUS(st), summary);
        go_on = 0;
    } else if (g_fz->sanitizer || strstr(summary, "runtime error:") ||
               strstr(summary, "Sanitizer: ")) {
        snprintf(what, sizeof what, "%s", summary);  // UBSan does not run the death callback
    } else if (hang) {
        kind = "hang";
        snprintf(what, sizeof what, "still running after %d s", g_fopts->hang_s);
    } else if (WIFSIGNALED(st)) {
        snprintf(what, sizeof what, "killed by %s", strsignal(WTERMSIG(st)));
    } else {
        kind = "exit";
        snprintf(what, sizeof what, "segnet called exit(%d): %s", WEXITSTATUS(st), summary);
    }
    snprintf(key, sizeof key, "%s %.200s", kind, frame[0] ? frame : what);
    g_fz->next = next;
    if (!go_on) g_fz->findings++;
    else if (!fuzz_finding_new(key)) { g_fz->repeats++; return 1; }
    else {
        if (fuzz_save(t->name, kind, k, path))
            snprintf(path, sizeof path, "(could not be written)");
        snprintf(report, sizeof report, "%s/%s-%s-%" PRIu64 ".txt", g_fopts->out, t->name, kind, k);
        fuzz_write_report(t->name, path, report, base);
        char again[400], where[600];
        fuzz_read_log(report, 0, again, sizeof again, where, sizeof where);
        if (again[0] && strcmp(kind, "hang") && strcmp(kind, "exit"))
            snprintf(what, sizeof what, "%s", again);
        if (where[0]) snprintf(frame, sizeof frame, "%s", where);
    }
    const char *func_end = strchr(frame, ' ');
    const int named =
            frame[0] && func_end && memmem(what, strlen(what), frame, (size_t)(func_end - frame));
    if (!g_fopts->quiet)
        printf("fuzz %s: %s at input %" PRIu64 ": %s%s%s%s%s%s%s%s\n", t->name,
               go_on ? kind : "failure", k, what, frame[0] && !named ? " (at " : "",
               frame[0] && !named ? frame : "", frame[0] && !named ? ")" : "",
               go_on ? "; reproducer " : "", path, report[0] ? ", report " : "", report);
    fflush(stdout);
    if (first && !first[0]) snprintf(first, 512, "%s", path);
    return go_on;
}

typedef struct { uint64_t executions; int findings; } FuzzTotals;

// Fuzzes one target for o->seconds (a new child after each death); prints its
// line. `first`: the first finding's reproducer path, if not NULL.
static int fuzz_target(const FuzzTarget *t, const char *base, FuzzTotals *tot, char first[512]) {
    memset(g_fz, 0, offsetof(FuzzShared, len));
    if (first) first[0] = 0;
    snprintf(g_flog, sizeof g_flog, "%s/%s.log", base, t->name);
    const double t0 = now_s(), deadline = t0 + g_fopts->seconds;
    for (;;) {
        g_fz->running = g_fz->sanitizer = g_fz->finished = g_fz->leaked = 0;
        fflush(stdout);
        fflush(stderr);
        pid_t pid = fork();
        snCheck(pid >= 0, "fuzz: fork: %s", strerror(errno));
        if (pid == 0) fuzz_child(t, base, deadline);
        int st;
        waitpid(pid, &st, 0);
        if (WIFEXITED(st) && WEXITSTATUS(st) == 0 && g_fz->finished) break;
        if (!fuzz_report_death(t, base, st, first)) break;
        if (now_s() >= deadline || g_fz->findings >= FUZZ_MAX_FINDINGS ||
            (g_fopts->first_only && g_fz->findings))
            break;
        if (g_fopts->runs && g_fz->next >= g_fopts->runs) break;
    }
    const double dt = now_s() - t0;
    const int f = g_fz->findings;
    tot->executions += g_fz->executions;
    tot->findings += f;
    if (g_fopts->quiet) return f;
    printf("fuzz %s: %" PRIu64
           " executions in %.1f s (%.0f/s), %d finding%s; %.0f%% accepted, corpus %d (%d kept)",
           t->name, g_fz->executions, dt, (double)g_fz->executions / (dt > 0 ? dt : 1), f,
           f == 1 ? "" : "s",
           100.0 * (double)g_fz->accepted / (double)(g_fz->executions ? g_fz->executions : 1),
           g_fz->n_corpus, g_fz->kept);
    if (g_fz->repeats)
        printf(", %d repeat%s of a finding", g_fz->repeats, g_fz->repeats == 1 ? "" : "s");
    if (g_fopts->verbose) printf(", inputs digest %016" PRIx64, g_fz->digest);
    printf("\n");
    fflush(stdout);
    return f;
}

// One input in this process: its outcome, and a leak check. 0 when nothing was found.
static int fuzz_replay(const char *file, const FuzzTarget *t, const char *base) {
    size_t n;
    uint8_t *in = read_file_bytes(file, &n);
    if (!in) { fprintf(stderr, "fuzz_segnet: %s: %s\n", file, strerror(errno)); return 2; }
    FuzzCtx *c = malloc(sizeof *c);
    snCheck(c != NULL, "out of host memory");
    g_freplay = 1;
    fuzz_ctx_open(c, t, base);
    signal(SIGALRM, fuzz_on_alarm);
    fuzz_run(c, in, n);
    char shown[4 * SN_ERR_MAX];
    if (c->accepted) printf("replay %s %s: accepted\n", t->name, file);
    else
        printf("replay %s %s: refused: %s\n", t->name, file,
               fuzz_printable(shown, sizeof shown, c->err));
    fflush(stdout);
    int leaked = __lsan_do_recoverable_leak_check(), broken = c->broken;
    free(c);
    free(in);
    return leaked || broken;
}

// Each faulty reader above under the same machinery: each fault must be found,
// saved as its kind, with a report naming the faulty function. One line when
// all are caught; what went wrong with each otherwise.
static int fuzz_selftest(FuzzOpts *o, const char *base) {
    static const char *const KIND[3] = {"crash", "leak", "hang"},
                             *const FAULT[3] = {"overflow", "leak", "hang"},
                             *const FUNC[3] = {"fuzz_faulty_overflow", "fuzz_faulty_leak",
                                               "fuzz_faulty_hang"};
    char out[512], first[3][512], missed[200] = "";
    snprintf(out, sizeof out, "%s/selftest", o->out);
    rm_rf(out);
    snCheck(mkdir(out, 0755) == 0, "fuzz: mkdir %s: %s", out, strerror(errno));
    const char *real_out = o->out;
    o->out = out;
    o->seconds = 20;
    o->hang_s = 1;
    o->first_only = 1;
    o->runs = 0;
    o->quiet = !o->verbose;
    FuzzTotals tot = {0, 0};
    for (int i = 0; i < 3; i++) {
        fuzz_target(&SELFTEST_TARGETS[i], base, &tot, first[i]);
        char want[64], report[520];
        snprintf(want, sizeof want, "-%s-", KIND[i]);
        snprintf(report, sizeof report, "%.*s.txt", (int)strlen(first[i]) - 4, first[i]);
        size_t n;
        char *text = strstr(first[i], want) ? read_file(report, &n) : NULL;
        if (!(text && strstr(text, FUNC[i]))) {
            snprintf(missed + strlen(missed), sizeof missed - strlen(missed), "%s%s",
                     missed[0] ? ", " : "", FAULT[i]);
            printf("fuzz self-test: the planted %s was not caught as a %s naming %s (first "
                   "finding: '%s')\n",
                   FAULT[i], KIND[i], FUNC[i], first[i]);
        }
        free(text);
    }
    o->out = real_out;
    o->quiet = 0;
    if (missed[0]) printf("fuzz self-test: FAILED: %s not caught (reports in %s)\n", missed, out);
    else {
        printf("fuzz self-test: overflow, leak and hang caught\n");
        rm_rf(out);  // the planted findings are no one's to read
    }
    return missed[0] ? 1 : 0;
}

static int fuzz_usage(const char *argv0) {
    fprintf(stderr,
            "usage: %s [--seconds S] [--seed N] [--runs N] [--hang S] [--out DIR] [-v] "
            "[TARGET...]\n"
            "       %s --replay FILE TARGET\n"
            "       %s --selftest [--out DIR]\n"
            "Seeded mutation fuzzing of segnet's readers under AddressSanitizer and UBSan: S "
            "seconds per\n"
            "target (default 60), at most N inputs with --runs; an input running over --hang "
            "seconds\n"
            "(default %d) is a hang. A finding is saved as DIR/TARGET-KIND-K.bin with its report "
            "in\n"
            "DIR/TARGET-KIND-K.txt (default DIR: fuzz-out); the exit status is 1 if there is one.\n"
            "Targets: safetensors image mask exif csv checkpoint config cli (default: all). -v: "
            "the seeds' outcomes.\n"
            "--replay runs one saved input; --selftest checks that the harness catches planted "
            "faults.\n",
            argv0, argv0, argv0, FUZZ_HANG_S);
    return 2;
}

int main(int argc, char **argv) {
    FuzzOpts o = {60.0, 1, 0, "fuzz-out", FUZZ_HANG_S, 0, 0, 0};
    const FuzzTarget *chosen[N_FUZZ_TARGETS];
    const char *names[N_FUZZ_TARGETS], *replay = NULL, *work = NULL;
    int n_chosen = 0, selftest = 0;
    g_fopts = &o;
    for (int i = 1; i < argc; i++) {
        const char *a = argv[i], *v = i + 1 < argc ? argv[i + 1] : NULL;
        char *end = NULL;
        int bad = 0;
        if (!strcmp(a, "--seconds") && v) {
            o.seconds = strtod(v, &end);
            i++;
            bad = !(o.seconds >= 0);
        } else if (!strcmp(a, "--seed") && v) {
            o.seed = strtoull(v, &end, 0);
            i++;
        } else if (!strcmp(a, "--runs") && v) {
            o.runs = strtoull(v, &end, 0);
            i++;
        } else if (!strcmp(a, "--hang") && v) {
            o.hang_s = (int)strtol(v, &end, 10);
            i++;
            bad = o.hang_s < 1;
        } else if (!strcmp(a, "--out") && v) {
            o.out = v;
            i++;
        } else if (!strcmp(a, "--replay") && v) {
            replay = v;
            i++;
        }
        // the replay's folder (the reports' replays: the run's)
        else if (!strcmp(a, "--work") && v) {
            work = v;
            i++;
        } else if (!strcmp(a, "--selftest"))
            selftest = 1;
        else if (!strcmp(a, "-v")) o.verbose = 1;
        else if (a[0] != '-' && n_chosen < N_FUZZ_TARGETS) names[n_chosen++] = a;
        else {
            fprintf(stderr, "fuzz_segnet: unknown argument '%s'\n", a);
            return fuzz_usage(argv[0]);
        }
        if (bad || (end && (end == v || *end))) {
            fprintf(stderr, "fuzz_segnet: %s '%s' is not a valid value\n", a, v);
            return fuzz_usage(argv[0]);
        }
    }
    for (int i = 0; i < n_chosen; i++) {  // the faulty readers only by --replay
        chosen[i] = fuzz_find_target(names[i]);
        if (!chosen[i] || (!replay && chosen[i]->setup == fuzz_faulty_setup)) {
            fprintf(stderr, "fuzz_segnet: unknown target '%s'\n", names[i]);
            return fuzz_usage(argv[0]);
        }
    }
    if ((replay && n_chosen != 1) || (selftest && (replay || n_chosen))) return fuzz_usage(argv[0]);
    if (mkdir(o.out, 0755) && errno != EEXIST) {
        fprintf(stderr, "fuzz_segnet: %s: %s\n", o.out, strerror(errno));
        return 2;
    }
    // inputs and fixtures in memory where there is a tmpfs
    char base[256];
    struct stat sb;
    if (work) snprintf(base, sizeof base, "%s", work);
    else if (stat("/dev/shm", &sb) == 0 && S_ISDIR(sb.st_mode) && access("/dev/shm", W_OK) == 0)
        snprintf(base, sizeof base, "/dev/shm/segnet-fuzz-%ld", (long)getpid());
    else snprintf(base, sizeof base, "%s/work-%ld", o.out, (long)getpid());
    snCheck(mkdir(base, 0755) == 0 || (work && errno == EEXIST), "fuzz: mkdir %s: %s", base,
            strerror(errno));
    g_fz = mmap(NULL, sizeof *g_fz, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_ANONYMOUS, -1, 0);
    snCheck(g_fz != MAP_FAILED, "fuzz: mmap: %s", strerror(errno));
    int rc;
    if (replay) rc = fuzz_replay(replay, chosen[0], base);
    else if (selftest) rc = fuzz_selftest(&o, base);
    else {
        if (!n_chosen)
            for (int i = 0; i < N_FUZZ_TARGETS; i++) chosen[n_chosen++] = &FUZZ_TARGETS[i];
        FuzzTotals tot = {0, 0};
        double t0 = now_s();
        for (int i = 0; i < n_chosen; i++) fuzz_target(chosen[i], base, &tot, NULL);
        printf("fuzz: %d target%s, %" PRIu64 " executions in %.1f s, %d finding%s%s%s\n", n_chosen,
               n_chosen == 1 ? "" : "s", tot.executions, now_s() - t0, tot.findings,
               tot.findings == 1 ? "" : "s", tot.findings ? ": reproducers and reports in " : "",
               tot.findings ? o.out : "");
        rc = tot.findings ? 1 : 0;
    }
    munmap(g_fz, sizeof *g_fz);
    if (!work) rm_rf(base);
    return rc;
}
