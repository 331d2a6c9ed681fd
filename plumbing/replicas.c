// replicas.c -- replicas' communicators: threads in one process, MPI across processes.
// Plumbing of the segnet program: segnet.c (the math, the models, the step)
// includes this file at its end, so that the program is one translation unit.

// ----------------------------------------------------------------------------
// replicas: communicators
//
// A sum over ranks is ((b0 + b1) + b2) + ... element by element, the same
// expression on every rank and for every communicator, so `--replicas N` and
// `mpirun -np N` give the same bits, and every rank holds the same result.

// dst[i] = ((src[0][i] + src[1][i]) + ...) + src[size-1][i]; dst may be src[0]
#define DEFINE_SUM_RANKS(NAME, T)                                                   \
    static void NAME(T *dst, T *const *src, int size, size_t n) {                    \
        _Pragma("omp parallel for schedule(static) if(PAR(n * size))")               \
        for (size_t i = 0; i < n; i++) {                                             \
            T s = src[0][i];                                                         \
            for (int r = 1; r < size; r++) s += src[r][i];                           \
            dst[i] = s;                                                              \
        }                                                                            \
    }
DEFINE_SUM_RANKS(sum_ranks_f32, float)
DEFINE_SUM_RANKS(sum_ranks_f64, double)
DEFINE_SUM_RANKS(sum_ranks_i64, int64_t)

// "stopped: rank R failed" for a collective that returned -1
static int comm_failure(Comm *c, char err[SN_ERR_MAX]) {
    snprintf(err, SN_ERR_MAX, "stopped because rank %d failed", c->failed_rank(c));
    return -1;
}

int comm_agree(Comm *c, int rc, char err[SN_ERR_MAX]) {
    if (c->size == 1) return rc;
    int64_t failed[SN_MAX_REPLICAS] = {0};
    failed[c->rank] = rc != 0;
    if (c->allreduce_i64(c, failed, (size_t)c->size)) return comm_failure(c, err);
    int first = 0;
    while (first < c->size && !failed[first]) first++;
    if (first == c->size) return 0;
    char msg[SN_ERR_MAX];
    snprintf(msg, sizeof msg, "%s", c->rank == first ? err : "");
    if (c->broadcast(c, msg, sizeof msg, first)) return comm_failure(c, err);
    // the rank that reads the data and writes the run: no prefix
    if (first == 0) snprintf(err, SN_ERR_MAX, "%s", msg);
    else snprintf(err, SN_ERR_MAX, "rank %d: %.480s", first, msg);
    return -1;
}

// ---- local: the ranks are threads of this process that take turns

typedef enum { LOCAL_F32, LOCAL_F64, LOCAL_I64, LOCAL_BCAST } LocalKind;

typedef struct {
    int size;
    pthread_mutex_t mu;
    pthread_cond_t cv;
    int turn;                     // a rank holds the turn (is running)
    int arrived;                  // ranks in the current collective
    uint64_t generation;          // collectives completed
    void *buf[SN_MAX_REPLICAS];   // each rank's buffer in the current collective
    size_t n[SN_MAX_REPLICAS];
    int failed_rank;              // first rank that aborted, -1
    int returned;                 // ranks whose thread has returned 0
} LocalGroup;

// The last rank to arrive combines every rank's buffer (all others are
// waiting, so nothing else runs) and keeps the turn; the others hand it on
// while they wait and take it back after.
int comm_local_gather(Comm *c, void *buf, size_t n, CommCombine combine, void *arg) {
    LocalGroup *g = c->ctx;
    if (g->size == 1) return 0;
    pthread_mutex_lock(&g->mu);
    if (g->failed_rank >= 0) { pthread_mutex_unlock(&g->mu); return -1; }
    g->buf[c->rank] = buf;
    g->n[c->rank] = n;
    int ok = 1;
    if (++g->arrived == g->size) {
        for (int r = 0; r < g->size; r++)
            snCheck(g->n[r] == n, "a collective of %zu elements on rank %d but %zu on rank %d", n,
                    c->rank, g->n[r], r);
        combine(g->buf, g->size, n, arg);
        g->arrived = 0;
        g->generation++;
        pthread_cond_broadcast(&g->cv);
    } else {
        uint64_t gen = g->generation;
        g->turn = 0;
        pthread_cond_broadcast(&g->cv);
        while (g->generation == gen && g->failed_rank < 0) {
            // a rank that returned will never arrive: a mismatch of collectives, not a user error
            snCheck(g->returned == 0,
                    "rank %d waits in a collective that a rank which has returned will never join",
                    c->rank);
            pthread_cond_wait(&g->cv, &g->mu);
        }
        ok = g->generation != gen;
        while (g->turn) pthread_cond_wait(&g->cv, &g->mu);
        g->turn = 1;
    }
    pthread_mutex_unlock(&g->mu);
    return ok ? 0 : -1;
}

// host buffers: sums in rank order into every rank's buffer, or root's bytes to every rank
typedef struct { LocalKind kind; int root; } LocalOp;

static void local_combine(void *const *bufs, int size, size_t n, void *arg) {
    const LocalOp *op = arg;
    if (op->kind == LOCAL_BCAST) {
        for (int r = 0; r < size; r++) if (r != op->root) memcpy(bufs[r], bufs[op->root], n);
        return;
    }
    size_t elem = op->kind == LOCAL_F32 ? sizeof(float) : 8;
    if (op->kind == LOCAL_F32) sum_ranks_f32(bufs[0], (float *const *)bufs, size, n);
    else if (op->kind == LOCAL_F64) sum_ranks_f64(bufs[0], (double *const *)bufs, size, n);
    else sum_ranks_i64(bufs[0], (int64_t *const *)bufs, size, n);
    for (int r = 1; r < size; r++) memcpy(bufs[r], bufs[0], n * elem);
}

static int local_collective(Comm *c, void *buf, size_t n, LocalKind kind, int root) {
    LocalOp op = {kind, root};
    return comm_local_gather(c, buf, n, local_combine, &op);
}

static int local_allreduce_f32(Comm *c, float *b, size_t n) {
    return local_collective(c, b, n, LOCAL_F32, 0);
}
static int local_allreduce_f64(Comm *c, double *b, size_t n) {
    return local_collective(c, b, n, LOCAL_F64, 0);
}
static int local_allreduce_i64(Comm *c, int64_t *b, size_t n) {
    return local_collective(c, b, n, LOCAL_I64, 0);
}
static int local_broadcast(Comm *c, void *b, size_t bytes, int root) {
    return local_collective(c, b, bytes, LOCAL_BCAST, root);
}

static void local_abort(Comm *c, const char *why) {
    (void)why;  // the rank's own error is returned by its thread
    LocalGroup *g = c->ctx;
    pthread_mutex_lock(&g->mu);
    if (g->failed_rank < 0) g->failed_rank = c->rank;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
}

static int local_failed_rank(Comm *c) {
    LocalGroup *g = c->ctx;
    pthread_mutex_lock(&g->mu);
    int r = g->failed_rank;
    pthread_mutex_unlock(&g->mu);
    return r;
}

// rank r of n in the local group g (comm_local_create; run.c's trainer without replicas)
#define LOCAL_COMM_INIT(g, r, n)                                                               \
    {.name = "local", .rank = (r), .size = (n), .ctx = (g),                                    \
     .allreduce_f32 = local_allreduce_f32, .allreduce_f64 = local_allreduce_f64,               \
     .allreduce_i64 = local_allreduce_i64, .broadcast = local_broadcast, .abort = local_abort, \
     .failed_rank = local_failed_rank, .local_rank = (r)}

int comm_local_create(Comm *comms, int n) {
    if (n < 1 || n > SN_MAX_REPLICAS) return -1;
    LocalGroup *g = calloc(1, sizeof *g);
    snCheck(g != NULL, "out of host memory");
    g->size = n;
    g->failed_rank = -1;
    pthread_mutex_init(&g->mu, NULL);
    pthread_cond_init(&g->cv, NULL);
    for (int r = 0; r < n; r++) comms[r] = (Comm)LOCAL_COMM_INIT(g, r, n);
    return 0;
}

void comm_local_destroy(Comm *comms, int n) {
    if (n < 1) return;
    LocalGroup *g = comms[0].ctx;
    pthread_mutex_destroy(&g->mu);
    pthread_cond_destroy(&g->cv);
    free(g);
}

typedef struct { Comm *c; int (*fn)(Comm *, void *); void *arg; int rc; } LocalRank;

static void *local_rank_main(void *p) {
    LocalRank *lr = p;
    LocalGroup *g = lr->c->ctx;
    pthread_mutex_lock(&g->mu);
    while (g->turn) pthread_cond_wait(&g->cv, &g->mu);
    g->turn = 1;
    pthread_mutex_unlock(&g->mu);
    lr->rc = lr->fn(lr->c, lr->arg);
    if (lr->rc) local_abort(lr->c, "returned an error");
    pthread_mutex_lock(&g->mu);
    if (!lr->rc) g->returned++;
    g->turn = 0;
    pthread_cond_broadcast(&g->cv);
    pthread_mutex_unlock(&g->mu);
    return NULL;
}

void comm_local_run(Comm *comms, int n, int (*fn)(Comm *c, void *arg), void **args, int *rc) {
    LocalRank lr[SN_MAX_REPLICAS];
    pthread_t th[SN_MAX_REPLICAS];
    for (int r = 0; r < n; r++) lr[r] = (LocalRank){&comms[r], fn, args[r], 0};
    if (n == 1) { rc[0] = fn(&comms[0], args[0]); return; }
    for (int r = 0; r < n; r++)
        snCheck(pthread_create(&th[r], NULL, local_rank_main, &lr[r]) == 0,
                "cannot start a replica thread");
    for (int r = 0; r < n; r++) { pthread_join(th[r], NULL); rc[r] = lr[r].rc; }
}

// ---- mpi: one process per rank

int comm_mpi_launched(void) {
    const char *vars[] = {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE"};
    for (int k = 0; k < 3; k++) {
        const char *v = getenv(vars[k]);
        if (v && atoi(v) > 0) return atoi(v);
    }
    return 1;
}

#ifdef SEGNET_MPI
// A sum in rank order: every rank gathers every rank's chunk (at most
// MPI_CHUNK_BYTES from each) and adds them up itself. MPI_Allreduce would
// choose its own order (and grouping) by message size and rank count.
#define MPI_CHUNK_BYTES ((size_t)1 << 22)

static int mpi_sum(Comm *c, void *buf, size_t n, size_t elem, MPI_Datatype type) {
    if (c->size == 1 || n == 0) return 0;
    size_t chunk = MPI_CHUNK_BYTES / elem;
    if (chunk > n) chunk = n;
    uint8_t *all = malloc(chunk * elem * (size_t)c->size);
    snCheck(all != NULL, "out of host memory");
    void *src[SN_MAX_REPLICAS];
    for (size_t off = 0; off < n; off += chunk) {
        size_t m = n - off < chunk ? n - off : chunk;
        uint8_t *b = (uint8_t *)buf + off * elem;
        MPI_Allgather(b, (int)m, type, all, (int)m, type, MPI_COMM_WORLD);
        for (int r = 0; r < c->size; r++) src[r] = all + (size_t)r * m * elem;
        if (type == MPI_FLOAT) sum_ranks_f32((float *)b, (float *const *)src, c->size, m);
        else if (type == MPI_DOUBLE) sum_ranks_f64((double *)b, (double *const *)src, c->size, m);
        else sum_ranks_i64((int64_t *)b, (int64_t *const *)src, c->size, m);
    }
    free(all);
    return 0;
}
static int mpi_allreduce_f32(Comm *c, float *b, size_t n) {
    return mpi_sum(c, b, n, sizeof(float), MPI_FLOAT);
}
static int mpi_allreduce_f64(Comm *c, double *b, size_t n) {
    return mpi_sum(c, b, n, sizeof(double), MPI_DOUBLE);
}
static int mpi_allreduce_i64(Comm *c, int64_t *b, size_t n) {
    return mpi_sum(c, b, n, sizeof(int64_t), MPI_INT64_T);
}

static int mpi_broadcast(Comm *c, void *buf, size_t bytes, int root) {
    for (size_t off = 0; off < bytes; off += MPI_CHUNK_BYTES) {
        size_t m = bytes - off < MPI_CHUNK_BYTES ? bytes - off : MPI_CHUNK_BYTES;
        MPI_Bcast((uint8_t *)buf + off, (int)m, MPI_BYTE, root, MPI_COMM_WORLD);
    }
    (void)c;
    return 0;
}

static void mpi_abort(Comm *c, const char *why) {
    fprintf(stderr, "segnet: rank %d ends the job (MPI_Abort): %s\n", c->rank, why);
    fflush(stderr);
    MPI_Abort(MPI_COMM_WORLD, 1);
}

static int mpi_failed_rank(Comm *c) { (void)c; return -1; }  // a failed rank has ended the job

static void mpi_finalize_at_exit(void) {
    int done = 0;
    MPI_Finalized(&done);
    if (!done) MPI_Finalize();
}

int comm_mpi_open(Comm *c, char err[SN_ERR_MAX]) {
    int started = 0, rank = 0, size = 1;
    MPI_Initialized(&started);
    if (!started) {
        if (MPI_Init(NULL, NULL) != MPI_SUCCESS) {
            snprintf(err, SN_ERR_MAX, "MPI_Init failed");
            return -1;
        }
        atexit(mpi_finalize_at_exit);
    }
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &size);
    if (size > SN_MAX_REPLICAS) {
        snprintf(err, SN_ERR_MAX, "%d MPI processes: at most %d replicas", size, SN_MAX_REPLICAS);
        return -1;
    }
    // the ranks sharing this machine's memory, numbered from 0: a rank's GPU
    MPI_Comm node;
    int local_rank = 0;
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &node);
    MPI_Comm_rank(node, &local_rank);
    MPI_Comm_free(&node);
    *c = (Comm){"mpi",
                rank,
                size,
                NULL,
                mpi_allreduce_f32,
                mpi_allreduce_f64,
                mpi_allreduce_i64,
                mpi_broadcast,
                mpi_abort,
                mpi_failed_rank,
                .local_rank = local_rank};
    return 0;
}
#else
int comm_mpi_open(Comm *c, char err[SN_ERR_MAX]) {
    (void)c;
    snprintf(err, SN_ERR_MAX,
             "started by mpirun with %d processes, but this segnet was built without MPI "
             "(install libopenmpi-dev and rebuild)",
             comm_mpi_launched());
    return -1;
}
#endif
