// backends.c -- choosing a backend: the ops table a --device gets, and the check that a
// table fills every entry.
// Plumbing of the segnet program: segnet.c (the math, the models, the step)
// includes this file at its end, so that the program is one translation unit.

// ----------------------------------------------------------------------------
// choosing a backend

// Every function entry of struct Ops by name (the test ops_entries_listed checks
// that none is left out); optional ones may be NULL (recording steps).
#define OPS_ENTRY(name) {#name, offsetof(Ops, name), 0}
#define OPS_OPTIONAL(name) {#name, offsetof(Ops, name), 1}
static const struct {
    const char *name;
    size_t offset;
    int optional;
} OPS_ENTRIES[] = {
    OPS_ENTRY(alloc), OPS_ENTRY(free), OPS_ENTRY(upload), OPS_ENTRY(download),
    OPS_ENTRY(synchronize), OPS_ENTRY(host_alloc), OPS_ENTRY(host_free), OPS_ENTRY(upload_async),
    OPS_OPTIONAL(upload_ahead), OPS_OPTIONAL(await_uploads), OPS_OPTIONAL(copy_async),
    OPS_OPTIONAL(capture_begin), OPS_OPTIONAL(capture_end), OPS_OPTIONAL(replay),
    OPS_OPTIONAL(record_free),
#define OPS_COMPUTE_ENTRY(name) OPS_ENTRY(name),
    SN_COMPUTE_OPS(OPS_COMPUTE_ENTRY)
#undef OPS_COMPUTE_ENTRY
};
#define N_OPS_ENTRIES (sizeof OPS_ENTRIES / sizeof *OPS_ENTRIES)

int ops_missing(const Ops *o, char *list, size_t size) {
    int n = 0;
    list[0] = 0;
    for (size_t i = 0; i < N_OPS_ENTRIES; i++) {
        void (*fn)(void);
        memcpy(&fn, (const char *)o + OPS_ENTRIES[i].offset, sizeof fn);
        if (fn || OPS_ENTRIES[i].optional) continue;
        size_t len = strlen(list);
        snprintf(list + len, size - len, "%s%s", n++ ? ", " : "", OPS_ENTRIES[i].name);
    }
    return n;
}

const char *const DEVICE_NAMES[3] = {"cpu", "cuda", "auto"};

#define NO_CUDA_BUILD "this segnet was built without the CUDA backend (no nvcc when it was built)"

// --device auto without a usable GPU: one line on stderr, once per process
static void cpu_fallback_notice(const char *why) {
    static int noticed;
    if (!noticed++) fprintf(stderr, "segnet: not on a GPU: %s; running on the CPU\n", why);
}

Ops *ops_for_device(Device d, int gpu, char err[SN_ERR_MAX]) {
    if (d == DEVICE_CPU) return &ops_cpu;
    char why[SN_ERR_MAX];
    const Backend *b = DEVICE_BACKEND;
    if (b) {
        char missing[SN_ERR_MAX];
        Ops *o = b->ops_for_device(gpu, why);
        if (o) {
            if (!ops_missing(o, missing, sizeof missing)) return o;
            snprintf(why, sizeof why, "the %s backend of this build lacks %.400s", b->title,
                     missing);
        }
    } else {
        snprintf(why, sizeof why, "%s", NO_CUDA_BUILD);
    }
    if (d == DEVICE_CUDA) {
        snprintf(err, SN_ERR_MAX, "--device cuda: %.480s", why);
        return NULL;
    }
    cpu_fallback_notice(why);
    return &ops_cpu;
}
