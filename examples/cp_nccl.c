/*
 * cp_nccl.c — examples/cp_mpi.c's training step on the CUDA backend: one GPU per rank, the summaries exchanged
 * by ncclAllGather and the parameters' gradients by ncclAllReduce, on the stream the kda calls run on, so that
 * nothing waits for the host between them.
 *
 *   mpirun -np 2 ./cp_nccl     built with MPI (KDA_EXAMPLE_MPI): a process per rank, GPU = its rank on the host
 *                              (modulo the host's GPU count), the ncclUniqueId sent by MPI_Bcast
 *   ./cp_nccl                  built without MPI: one rank, a communicator of one GPU (ncclCommInitAll)
 *
 * The flow is cp_step's (examples/cp_util.h; docs/API.md §14): summaries into this rank's block of a device
 * buffer, then ncclAllGather with the send buffer at that block of the receive buffer (in place), kda_forward,
 * the backward summary, its all-gather, kda_backward, ncclAllReduce of dA_log and ddt_bias. Each rank then runs
 * the unsplit problem on its GPU and compares; one line per rank.
 *
 * Where the machine or the backend lacks something the step needs (no GPU, more ranks on a host than GPUs, a
 * NOT_SUPPORTED answer of the CUDA backend) every rank says why ("SKIPPED: ...") and the program exits with 77,
 * CTest's "skipped". Otherwise the exit status is 0 when every rank agrees within the tolerance, else 1.
 *
 * libkda links neither NCCL nor MPI: the communicator is this program's. Build: examples/CMakeLists.txt with
 * KDA_EXAMPLE_CUDA=ON (NCCL and, when found, MPI), or
 *   mpicc -DKDA_EXAMPLE_MPI cp_nccl.c $(pkg-config --cflags --libs kda) -I$CUDA/include -L$CUDA/lib64 -lnccl \
 *       -lcudart -lm -o cp_nccl
 */
#ifndef KDA_EXAMPLE_CUDA
#define KDA_EXAMPLE_CUDA 1 /* example_util.h: buffers in device memory on the CUDA backend */
#endif
#include <stdio.h>
#include <string.h>

#include <cuda_runtime_api.h>
#include <nccl.h>
#ifdef KDA_EXAMPLE_MPI
#include <mpi.h>
#endif

#include <kda.h>

#include "cp_util.h" /* the problem, the split, cp_step, cp_unsplit, cp_check */

enum { LINE = 512 };

/* ---- the transport: an NCCL communicator and the stream of the kda calls ---------------------------------- */
typedef struct {
    ncclComm_t comm;
    cudaStream_t stream;
    int rank;
} nccl_t;

static int nccl_code(int rank, const char *call, ncclResult_t r) {
    if (r == ncclSuccess) return CP_OK;
    fprintf(stderr, "rank %d: %s failed: %s (%s)\n", rank, call, ncclGetErrorString(r), ncclGetLastError(NULL));
    return CP_FAIL;
}

static int nccl_allgather(void *self, void *buf, size_t bytes) {
    const nccl_t *t = self;
    const char *mine = (const char *)buf + (size_t)t->rank * bytes; /* in place: this rank's block */
    return nccl_code(t->rank, "ncclAllGather", ncclAllGather(mine, buf, bytes, ncclUint8, t->comm, t->stream));
}

static int nccl_allreduce_sum(void *self, float *buf, size_t n) {
    const nccl_t *t = self;
    return nccl_code(t->rank, "ncclAllReduce", ncclAllReduce(buf, buf, n, ncclFloat32, ncclSum, t->comm, t->stream));
}

/* The ranks agree through MPI (one process per rank); a single rank agrees with itself. */
static int agree(void *self, int code) {
    (void)self;
#ifdef KDA_EXAMPLE_MPI
    int worst = CP_FAIL;
    MPI_Allreduce(&code, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return worst;
#else
    return code;
#endif
}

static int cuda_code(int rank, const char *call, cudaError_t e) {
    if (e == cudaSuccess) return CP_OK;
    fprintf(stderr, "rank %d: %s failed: %s\n", rank, call, cudaGetErrorString(e));
    return CP_FAIL;
}

/* This rank's GPU: its rank among the ranks of its host, when the host has a GPU for each */
static int pick_device(int rank, int local_rank, int local_ranks, int *dev) {
    int n = 0;
    const cudaError_t e = cudaGetDeviceCount(&n);
    if (e != cudaSuccess || n == 0) {
        printf("SKIPPED: rank %d: no CUDA device (%s)\n", rank, e != cudaSuccess ? cudaGetErrorString(e) : "none");
        return CP_SKIP;
    }
    if (local_ranks > n) {
        printf("SKIPPED: rank %d: %d ranks on this host and %d GPU%s: NCCL takes one GPU per rank\n", rank, local_ranks,
               n, n == 1 ? "" : "s");
        return CP_SKIP;
    }
    *dev = local_rank % n;
    return cuda_code(rank, "cudaSetDevice", cudaSetDevice(*dev));
}

/* The communicator of the R ranks: rank 0's ncclUniqueId sent to every rank by MPI; without MPI, one rank. */
static int nccl_open(nccl_t *t, int rank, int R, int dev) {
#ifdef KDA_EXAMPLE_MPI
    ncclUniqueId id;
    memset(&id, 0, sizeof id);
    int code = rank == 0 ? nccl_code(rank, "ncclGetUniqueId", ncclGetUniqueId(&id)) : CP_OK;
    if ((code = agree(NULL, code)) != CP_OK) return code;
    MPI_Bcast(&id, (int)sizeof id, MPI_BYTE, 0, MPI_COMM_WORLD);
    code = nccl_code(rank, "ncclCommInitRank", ncclCommInitRank(&t->comm, R, id, rank));
#else
    (void)R;
    int code = nccl_code(rank, "ncclCommInitAll", ncclCommInitAll(&t->comm, 1, &dev));
#endif
    (void)dev;
    if (code == CP_OK) code = cuda_code(rank, "cudaStreamCreate", cudaStreamCreate(&t->stream));
    t->rank = rank;
    return code;
}

int main(int argc, char **argv) {
    int rank = 0, R = 1, local_rank = 0, local_ranks = 1;
#ifdef KDA_EXAMPLE_MPI
    MPI_Init(&argc, &argv);
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &R);
    MPI_Comm host; /* the ranks on this host, which share its GPUs */
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &host);
    MPI_Comm_rank(host, &local_rank);
    MPI_Comm_size(host, &local_ranks);
    MPI_Comm_free(&host);
#endif
    if (argc > 1) {
        if (rank == 0) fprintf(stderr, "usage: %s (no arguments; mpirun -np R %s with MPI)\n", argv[0], argv[0]);
#ifdef KDA_EXAMPLE_MPI
        MPI_Finalize();
#endif
        return 2;
    }
    const kda_backend_t be = KDA_BACKEND_CUDA;
    kda_context_t *ctx = NULL;
    nccl_t t;
    memset(&t, 0, sizeof t);
    const cp_transport_t nccl = {&t, nccl_allgather, nccl_allreduce_sum, agree};
    cp_problem_t p;
    cp_run_t run;
    memset(&run, 0, sizeof run);
    char line[LINE] = "";
    int dev = 0;

    int code = cp_problem_make(&p);
    if (code == CP_OK) code = pick_device(rank, local_rank, local_ranks, &dev);
    CP_CALL(code, rank, be, kda_create(&ctx, be, dev)); /* NOT_SUPPORTED: a build without CUDA, another arch */
    if ((code = agree(NULL, code)) == CP_OK) code = agree(NULL, nccl_open(&t, rank, R, dev));
    cp_slice_t s;
    if (code == CP_OK) {
        cp_slice(&p, R, rank, &s);
        code = cp_run_open(&run, be, &p, &s);
    }
    code = agree(NULL, code);
    if (code == CP_OK) code = cp_step(ctx, &run, R, rank, t.stream, &nccl);
    if (code == CP_OK) code = cuda_code(rank, "cudaStreamSynchronize", cudaStreamSynchronize(t.stream));

    if (code == CP_OK) code = cp_unsplit(ctx, be, &p, rank, t.stream);
    if (code == CP_OK) code = cp_check(&p, &run, rank, R, line, sizeof line);
    else
        snprintf(line, sizeof line, "rank %d of %d: %s", rank, R,
                 code == CP_SKIP ? "skipped (see above)" : "did not finish (see above)");
#ifdef KDA_EXAMPLE_MPI
    char *lines = rank == 0 ? malloc((size_t)R * LINE) : NULL;
    MPI_Gather(line, LINE, MPI_CHAR, lines, LINE, MPI_CHAR, 0, MPI_COMM_WORLD);
#else
    char *lines = line;
#endif
    if (rank == 0 && lines) {
        printf("cp_nccl: %d tokens in %d sequences, HQK %d HV %d K %d V %d, over %d rank%s on the cuda backend\n",
               (int)p.T, (int)p.N, CP_HQK, CP_HV, CP_K, CP_V, R, R == 1 ? "" : "s");
        for (int r = 0; r < R; r++) printf("%s\n", lines + (size_t)r * LINE);
    }
#ifdef KDA_EXAMPLE_MPI
    free(lines);
#endif
    code = agree(NULL, code);

    cp_run_close(&run);
    cp_problem_free(&p);
    if (t.stream) cudaStreamDestroy(t.stream);
    if (t.comm) ncclCommDestroy(t.comm);
    kda_destroy(ctx);
#ifdef KDA_EXAMPLE_MPI
    MPI_Finalize();
#endif
    return cp_exit_status(code);
}
