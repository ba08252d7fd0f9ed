/*
 * cp_mpi.c — context parallelism across ranks over MPI, on the CPU: a packed batch whose sequences are split
 * over the MPI ranks, each rank holding a contiguous slice of the tokens; one training step (forward and
 * backward) with the ranks' summaries exchanged by MPI_Allgather, checked on every rank against the unsplit run.
 *
 *   mpirun -np 4 ./cp_mpi [cpu|reference]    (default cpu; reference: the fp64 oracle, with fp64 summaries)
 *
 * The flow (examples/cp_util.h: cp_step; docs/API.md §14), on every rank:
 *   1. kda_cp_forward_summary: the map of this rank's last sequence part, into its own block of the gather;
 *   2. MPI_Allgather, in place: every rank's summary on every rank (kda_args_t.cp_summaries);
 *   3. kda_forward with cp_num_ranks, cp_rank, cp_pre_ranks, cp_post_ranks: the summaries of the ranks before
 *      fold into the state that enters its first sequence; o and the final states of its own sequences;
 *   4. kda_cp_backward_summary, MPI_Allgather (kda_backward_args_t.cp_summaries), kda_backward: the ranks after
 *      fold into the gradient at the end of its last sequence; every gradient of its own tokens;
 *   5. MPI_Allreduce of dA_log and ddt_bias, which each rank sums over its own tokens only.
 * Each rank then runs the unsplit problem itself (it is small) and compares; rank 0 prints one line per rank.
 * The exit status is 0 when every rank agrees within the backend's tolerance, else 1 (on every rank).
 *
 * libkda links no MPI: the collectives are this program's. Build: examples/CMakeLists.txt (find_package(MPI)),
 * or  mpicc cp_mpi.c $(pkg-config --cflags --libs kda) -lm -o cp_mpi
 */
#define _POSIX_C_SOURCE 200809L /* sysconf */
#include <stdio.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

#include <kda.h>

#include "cp_util.h" /* the problem, the split, cp_step, cp_unsplit, cp_check */

enum { LINE = 512 };

/* ---- the transport: MPI_COMM_WORLD -------------------------------------------------------------------- */
static int mpi_allgather(void *self, void *buf, size_t bytes) {
    (void)self;
    if (bytes > (size_t)INT32_MAX) return CP_FAIL; /* MPI counts are int */
    /* in place: this rank's block is already at buf + rank * bytes */
    const int e = MPI_Allgather(MPI_IN_PLACE, 0, MPI_DATATYPE_NULL, buf, (int)bytes, MPI_BYTE, MPI_COMM_WORLD);
    return e == MPI_SUCCESS ? CP_OK : CP_FAIL;
}

static int mpi_allreduce_sum(void *self, float *buf, size_t n) {
    (void)self;
    const int e = MPI_Allreduce(MPI_IN_PLACE, buf, (int)n, MPI_FLOAT, MPI_SUM, MPI_COMM_WORLD);
    return e == MPI_SUCCESS ? CP_OK : CP_FAIL;
}

static int mpi_agree(void *self, int code) {
    (void)self;
    int worst = CP_FAIL;
    MPI_Allreduce(&code, &worst, 1, MPI_INT, MPI_MAX, MPI_COMM_WORLD);
    return worst;
}

int main(int argc, char **argv) {
    MPI_Init(&argc, &argv);
    int rank = 0, R = 1, local_ranks = 1;
    MPI_Comm_rank(MPI_COMM_WORLD, &rank);
    MPI_Comm_size(MPI_COMM_WORLD, &R);
    MPI_Comm host; /* the ranks on this host, which share its cores */
    MPI_Comm_split_type(MPI_COMM_WORLD, MPI_COMM_TYPE_SHARED, rank, MPI_INFO_NULL, &host);
    MPI_Comm_size(host, &local_ranks);
    MPI_Comm_free(&host);

    kda_backend_t be = KDA_BACKEND_CPU;
    if (argc > 1 && !strcmp(argv[1], "reference")) be = KDA_BACKEND_REFERENCE;
    else if (argc > 1 && strcmp(argv[1], "cpu")) {
        if (rank == 0) fprintf(stderr, "usage: mpirun -np R %s [cpu|reference]\n", argv[0]);
        MPI_Finalize();
        return 2;
    }
    const cp_transport_t mpi = {NULL, mpi_allgather, mpi_allreduce_sum, mpi_agree};

    kda_context_t *ctx = NULL;
    cp_problem_t p;
    cp_run_t run;
    memset(&run, 0, sizeof run);
    char line[LINE] = "";
    int code = cp_problem_make(&p);
    CP_CALL(code, rank, be, kda_create(&ctx, be, 0));
    if (code == CP_OK && be == KDA_BACKEND_CPU) { /* this rank's share of the host's cores */
        const long cores = sysconf(_SC_NPROCESSORS_ONLN);
        const int threads = cores > local_ranks ? (int)(cores / local_ranks) : 1;
        CP_CALL(code, rank, be, kda_set_num_threads(ctx, threads));
    }

    /* this rank's slice: its tokens, its local cu_seqlens, cp_pre_ranks and cp_post_ranks */
    cp_slice_t s;
    if (code == CP_OK) {
        cp_slice(&p, R, rank, &s);
        code = cp_run_open(&run, be, &p, &s);
    }
    code = mpi_agree(NULL, code);
    if (code == CP_OK) code = cp_step(ctx, &run, R, rank, NULL, &mpi);

    /* the check, on each rank: the unsplit problem, then its own tokens and sequences against it */
    if (code == CP_OK) code = cp_unsplit(ctx, be, &p, rank, NULL);
    if (code == CP_OK) code = cp_check(&p, &run, rank, R, line, sizeof line);
    else snprintf(line, sizeof line, "rank %d of %d: did not finish (see above)", rank, R);
    char *lines = rank == 0 ? malloc((size_t)R * LINE) : NULL;
    MPI_Gather(line, LINE, MPI_CHAR, lines, LINE, MPI_CHAR, 0, MPI_COMM_WORLD);
    if (rank == 0 && lines) {
        printf("cp_mpi: %d tokens in %d sequences, HQK %d HV %d K %d V %d, over %d rank%s on the %s backend\n",
               (int)p.T, (int)p.N, CP_HQK, CP_HV, CP_K, CP_V, R, R == 1 ? "" : "s", kda_backend_name(be));
        for (int r = 0; r < R; r++) printf("%s\n", lines + (size_t)r * LINE);
    }
    free(lines);
    code = mpi_agree(NULL, code);

    cp_run_close(&run);
    cp_problem_free(&p);
    kda_destroy(ctx);
    MPI_Finalize();
    return cp_exit_status(code);
}
