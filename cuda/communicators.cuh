// cuda/communicators.cuh -- chapter 9 of the CUDA backend: the replicas' NCCL communicators
// (segnet.h's Comm over device buffers); without NCCL, stubs that refuse replicas on GPUs.
// Needs: the devices' contexts (CudaCtx, ctx_of, cuda_ops_for_device): kernels.cu includes
// it after its devices.

// ----------------------------------------------------------------------------
// NCCL communicators: the Comm interface of segnet.h over device buffers
//
// Local replicas (--replicas N --device cuda): replica r on device r, the
// communicators from ncclCommInitAll (like MirroredStrategy). The replicas are
// threads taking turns (comm_local_run), so no rank may block in NCCL waiting
// for another: every collective is a rendezvous of the host communicator
// (comm_local_gather), and the last rank to arrive enqueues the collective of
// every rank in one ncclGroupStart/End, as one thread driving N devices.
// Under mpirun (one process per rank): rank 0 makes the NCCL id, the host
// communicator (MPI) broadcasts it, every rank joins with ncclCommInitRank on
// device local_rank (its index on its machine) and enqueues its own call.
//
// Order of the sums. A collective returns once it is enqueued; it runs on the
// device's comm_stream after the work enqueued on its compute stream before it,
// and the work enqueued after it waits for it (events), so the trainer needs no
// host synchronisation for it. NCCL (ring or tree) adds the ranks in an order
// fixed by the topology, the rank count and the message size, not in rank
// order; every rank receives the same bits (each chunk is reduced once and then
// copied to every rank), so the replicas stay mirrored bit for bit, and a run is
// repeatable on the same machine with the same NCCL (NCCL_ALGO/NCCL_PROTO pin
// the choice). Results differ from the CPU replicas' rank-order sums by the
// fp32 rounding of another order: the tests compare with tolerances made of
// that noise (test_segnet.c, cuda_replicas_*). The emulator (cuda_emu.cpp)
// sums in rank order, as the CPU replicas do.
//
// Overlap, honestly: today nothing overlaps. The gradient all-reduce is one
// call over the whole gradient buffer after the backward pass has finished,
// and the next op on the compute stream (the inf check or Adam) waits for it.
// The second stream and the events are the plumbing for overlap: with buckets
// (runs of layers whose gradients are final once the backward passes them, in
// reverse layer order), net_backward would call the all-reduce per bucket as it
// goes, each waiting only on the compute work before it, so NCCL would run
// while the backward computes the earlier layers; that needs a hook in
// net_backward, buckets in the gradient layout, and the rendezvous of local
// replicas to stop serialising the ranks' host threads.

#ifdef SEGNET_NCCL
#include <nccl.h>

static void nccl_check(ncclResult_t r, const char *what, const char *file, int line) {
    if (r == ncclSuccess) return;
    fprintf(stderr, "segnet: NCCL error at %s:%d: %s: %s\n", file, line, what,
            ncclGetErrorString(r));
    exit(1);
}
#define ncclCheck(call) nccl_check((call), #call, __FILE__, __LINE__)
// a broken invariant of the host code (a bug)
static void internal_check(bool ok, const char *what, const char *file, int line) {
    if (ok) return;
    fprintf(stderr, "segnet: internal error at %s:%d: %s\n", file, line, what);
    exit(1);
}
#define internalCheck(cond) internal_check((cond), #cond, __FILE__, __LINE__)

typedef enum { NCCL_SUM_F32, NCCL_SUM_F64, NCCL_SUM_I64, NCCL_BROADCAST } NcclKind;

struct NcclGroup;
struct NcclRank {
    Ops *o;             // this rank's device table: its streams
    ncclComm_t nccl;
    Comm *host;         // the same rank's host communicator: rendezvous, failures
    NcclGroup *group;
};
struct NcclGroup {      // the ranks this process drives: all of them (local), or one (mpi)
    int n;
    NcclRank ranks[SN_MAX_REPLICAS];
};

// collective `kind` over bufs[i] (count elements) of ranks[0..n): enqueued on
// every rank's comm_stream, ordered against its compute stream by events
static void nccl_enqueue(NcclRank *ranks, void *const *bufs, int n, size_t count, NcclKind kind,
                         int root) {
    for (int i = 0; i < n; i++) {  // the collective waits for the compute work before it
        CudaCtx *x = ctx_of(ranks[i].o);
        cudaCheck(cudaEventRecord(x->compute_done, x->stream));
        cudaCheck(cudaStreamWaitEvent(x->comm_stream, x->compute_done, 0));
    }
    ncclCheck(ncclGroupStart());
    for (int i = 0; i < n; i++) {
        CudaCtx *x = ctx_of(ranks[i].o);
        if (kind == NCCL_BROADCAST) {
            ncclCheck(ncclBroadcast(bufs[i], bufs[i], count, ncclInt8, root, ranks[i].nccl,
                                    x->comm_stream));
        } else {
            ncclDataType_t type = kind == NCCL_SUM_F32   ? ncclFloat32
                                  : kind == NCCL_SUM_F64 ? ncclFloat64
                                                         : ncclInt64;
            ncclCheck(ncclAllReduce(bufs[i], bufs[i], count, type, ncclSum, ranks[i].nccl,
                                    x->comm_stream));
        }
    }
    ncclCheck(ncclGroupEnd());
    for (int i = 0; i < n; i++) {  // the compute work after it waits for the collective
        CudaCtx *x = ctx_of(ranks[i].o);
        cudaCheck(cudaEventRecord(x->comm_done, x->comm_stream));
        cudaCheck(cudaStreamWaitEvent(x->stream, x->comm_done, 0));
    }
}

struct NcclCall { NcclGroup *group; NcclKind kind; int root; };

// comm_local_gather's combine: the last local rank to arrive enqueues every rank's part
static void nccl_combine(void *const *bufs, int size, size_t count, void *arg) {
    NcclCall *call = (NcclCall *)arg;
    internalCheck(size == call->group->n);  // every local rank is in the group
    nccl_enqueue(call->group->ranks, bufs, size, count, call->kind, call->root);
}

static int nccl_collective(Comm *c, void *buf, size_t count, NcclKind kind, int root) {
    NcclRank *k = (NcclRank *)c->ctx;
    if (c->size == 1 || count == 0) return 0;
    if (k->host->failed_rank(k->host) >= 0) return -1;
    NcclCall call = {k->group, kind, root};
    if (k->group->n > 1) return comm_local_gather(k->host, buf, count, nccl_combine, &call);
    nccl_enqueue(k, &buf, 1, count, kind, root);
    return 0;
}
static int nccl_allreduce_f32(Comm *c, float *buf, size_t n) {
    return nccl_collective(c, buf, n, NCCL_SUM_F32, 0);
}
static int nccl_allreduce_f64(Comm *c, double *buf, size_t n) {
    return nccl_collective(c, buf, n, NCCL_SUM_F64, 0);
}
static int nccl_allreduce_i64(Comm *c, int64_t *buf, size_t n) {
    return nccl_collective(c, buf, n, NCCL_SUM_I64, 0);
}
static int nccl_broadcast(Comm *c, void *buf, size_t bytes, int root) {
    return nccl_collective(c, buf, bytes, NCCL_BROADCAST, root);
}
// a rank that cannot go on stops the others through the host communicator
static void nccl_abort(Comm *c, const char *why) {
    NcclRank *k = (NcclRank *)c->ctx;
    k->host->abort(k->host, why);
}
static int nccl_failed_rank(Comm *c) {
    NcclRank *k = (NcclRank *)c->ctx;
    return k->host->failed_rank(k->host);
}

// dcomms[r] over the host communicator hosts[r], whose `device` it becomes
static void nccl_comm_bind(Comm *dcomm, Comm *host, NcclGroup *g, int i) {
    *dcomm = (Comm){"nccl",
                    host->rank,
                    host->size,
                    &g->ranks[i],
                    nccl_allreduce_f32,
                    nccl_allreduce_f64,
                    nccl_allreduce_i64,
                    nccl_broadcast,
                    nccl_abort,
                    nccl_failed_rank,
                    host->local_rank,
                    NULL};
    g->ranks[i].host = host;
    g->ranks[i].group = g;
    host->device = dcomm;
}

int cuda_comm_local_create(Comm *dcomms, Comm *hosts, int n, char err[SN_ERR_MAX]) {
    if (n < 1 || n > SN_MAX_REPLICAS) {
        snprintf(err, SN_ERR_MAX, "%d replicas: 1 to %d are supported", n, SN_MAX_REPLICAS);
        return -1;
    }
    int devices[SN_MAX_REPLICAS] = {0};
    NcclGroup *g = (NcclGroup *)calloc(1, sizeof *g);
    internalCheck(g != NULL);  // out of host memory
    g->n = n;
    for (int r = 0; r < n; r++) {
        char why[SN_ERR_MAX];
        if (!(g->ranks[r].o = cuda_ops_for_device(r, why))) {
            snprintf(err, SN_ERR_MAX, "%d replicas need one CUDA device each: %.400s", n, why);
            free(g);
            return -1;
        }
        devices[r] = r;
    }
    ncclComm_t comms[SN_MAX_REPLICAS];
    ncclCheck(ncclCommInitAll(comms, n, devices));
    for (int r = 0; r < n; r++) {
        g->ranks[r].nccl = comms[r];
        nccl_comm_bind(&dcomms[r], &hosts[r], g, r);
    }
    return 0;
}

int cuda_comm_mpi_create(Comm *dcomm, Comm *host, char err[SN_ERR_MAX]) {
    char why[SN_ERR_MAX] = "";
    Ops *o = cuda_ops_for_device(host->local_rank, why);
    if (!o)
        snprintf(why + strlen(why), SN_ERR_MAX - strlen(why), " (its rank on its machine: %d)",
                 host->local_rank);
    if (comm_agree(host, o ? 0 : -1, why)) {  // every rank has its device, or none goes on
        snprintf(err, SN_ERR_MAX, "%.480s", why);
        return -1;
    }
    ncclUniqueId id;
    if (host->rank == 0) ncclCheck(ncclGetUniqueId(&id));
    if (host->broadcast(host, &id, sizeof id, 0)) {
        snprintf(err, SN_ERR_MAX, "stopped because rank %d failed", host->failed_rank(host));
        return -1;
    }
    NcclGroup *g = (NcclGroup *)calloc(1, sizeof *g);
    internalCheck(g != NULL);  // out of host memory
    g->n = 1;
    g->ranks[0].o = o;
    ctx_of(o);  // ncclCommInitRank binds the communicator to the current device
    ncclCheck(ncclCommInitRank(&g->ranks[0].nccl, host->size, id, host->rank));
    nccl_comm_bind(dcomm, host, g, 0);
    return 0;
}

void cuda_comm_destroy(Comm *dcomms, int n) {
    if (n < 1) return;
    NcclGroup *g = ((NcclRank *)dcomms[0].ctx)->group;
    for (int i = 0; i < g->n; i++) {
        ctx_of(g->ranks[i].o);
        cudaCheck(cudaStreamSynchronize(((CudaCtx *)g->ranks[i].o->ctx)->comm_stream));
        ncclCheck(ncclCommDestroy(g->ranks[i].nccl));
        g->ranks[i].host->device = NULL;
    }
    free(g);
}
#else
int cuda_comm_local_create(Comm *dcomms, Comm *hosts, int n, char err[SN_ERR_MAX]) {
    (void)dcomms; (void)hosts;
    snprintf(err, SN_ERR_MAX,
             "%d replicas on CUDA devices need NCCL: this segnet was built without it (NO_NCCL=1)",
             n);
    return -1;
}
int cuda_comm_mpi_create(Comm *dcomm, Comm *host, char err[SN_ERR_MAX]) {
    (void)dcomm;
    snprintf(err, SN_ERR_MAX,
             "%d replicas on CUDA devices need NCCL: this segnet was built without it (NO_NCCL=1)",
             host->size);
    return -1;
}
void cuda_comm_destroy(Comm *dcomms, int n) { (void)dcomms; (void)n; }
#endif
