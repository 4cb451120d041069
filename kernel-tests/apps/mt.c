// SPDX-License-Identifier: Apache-2.0
//
// mt: a deterministic MPI_THREAD_MULTIPLE exchange for mpipause's
// multi-node tests: several threads per rank talk over the same and over
// different connections at once, while a pause closes and reopens the gate.
//
// Every rank runs -T threads. Thread k of every rank forms a ring with
// shift s(k): each iteration it sends one message to rank (r + s) and
// receives one from rank (r - s) (mod ranks), with tag k on MPI_COMM_WORLD
// (threads of a rank share the communicator; distinct tags keep them
// apart). Threads come in groups of three: with d = 1 + (k / 3) mod
// (ranks - 1), threads 3j and 3j+1 have s = +d and thread 3j+2 has s = -d.
// So two threads of a rank send to the same peer over the same connection
// at the same time, a third sends the other way on that connection's pair
// (rank r - d's first two threads send to r on the connection on which r's
// third thread sends to r - d), and the next group uses other connections:
// with the default 4 threads on 6 ranks, rank r sends to r+1 (threads 0
// and 1), r-1 (thread 2) and r+2 (thread 3). Even iterations use
// MPI_Irecv/MPI_Isend/MPI_Waitall, odd ones MPI_Sendrecv. Message sizes are
// irregular (0 to 1.25 x -s bytes plus 0 to 6, so odd lengths too, varying
// with sender, receiver, iteration and thread); the content is a
// pseudo-random stream seeded from the sender thread's state, and every
// thread folds what it received into its state, so a lost, duplicated,
// reordered or corrupted byte (or a message given to the wrong thread)
// changes the final checksum that rank 0 prints. After every iteration
// thread k takes part in an MPI_Bcast on a communicator of its own (a
// duplicate of MPI_COMM_WORLD per thread) that carries the stop decision,
// so collectives run on every connection too. The same computation done
// serially in one process (-x) prints the checksum a correct run must print.
//
// Usage: mt [-T threads] [-n iters] [-s bytes[K|M]] [-z usec] [-E dir] [-x ranks]
//   -T threads  threads per rank (default 4, at most 64).
//   -n iters    iterations per thread (default 100; with -E, the most).
//   -s bytes    base message size (default 64K).
//   -z usec     each thread sleeps for usec microseconds after each
//               iteration (many ranks sharing few cores).
//   -E dir      until told: rank 0's main thread looks for dir/stop every
//               5 ms; when it appears, every thread of every rank stops
//               after the same iteration (one past the furthest any thread
//               of rank 0 had completed); the result line gives the
//               iterations run, and -x with -n that many prints what it
//               must be.
//   -x ranks    print the expected checksum for that many ranks, without MPI.
//
// The program fails (exit 1, one line on stderr) if MPI_Init_thread provides
// less than MPI_THREAD_MULTIPLE.
#include <errno.h>
#include <inttypes.h>
#include <pthread.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <mpi.h>

#include "stream.h"

#define MAX_THREADS 64

struct opts {
	int threads;
	int iters;
	size_t bytes;
	long sleep_usec;
	const char *stop_dir;
	int expect_ranks;
};

// shift_of is s(k) above, in 1..nranks-1 (-d as nranks - d).
static int shift_of(int k, int nranks)
{
	int d = 1 + (k / 3) % (nranks - 1);
	return k % 3 == 2 ? nranks - d : d;
}

// msg_len is the irregular size of thread k's message from src to dst in
// iteration it.
static size_t msg_len(size_t base, int src, int dst, int it, int k)
{
	unsigned q = (unsigned)(src * 7 + dst * 3 + it * 5 + k * 11) % 6;
	unsigned odd = (unsigned)(it * 13 + k * 3 + src) % 7;
	return base / 4 * q + odd;
}

static uint64_t seed_of(uint64_t state, int dst, int it, int k)
{
	return mix64(state ^ mix64(((uint64_t)dst << 40) ^ ((uint64_t)k << 32) ^ (uint64_t)it));
}

static uint64_t initial_state(int rank, int k)
{
	return mix64(0x6d74706175736500ULL + ((uint64_t)rank << 8) + (uint64_t)k);
}

static void print_result(const struct opts *o, int nranks, int iters, uint64_t sum)
{
	printf("mt ranks=%d threads=%d iters=%d bytes=%zu checksum=%016" PRIx64 "\n", nranks, o->threads, iters,
	       o->bytes, sum);
	fflush(stdout);
}

static size_t cap_of(size_t base)
{
	return base / 4 * 5 + 8;
}

// expect runs every thread's ring for nranks ranks in this process.
static int expect(const struct opts *o, int nranks)
{
	uint64_t *state = calloc((size_t)nranks * o->threads, sizeof(*state));
	uint64_t *next = calloc((size_t)nranks, sizeof(*next));
	uint64_t *ts = calloc((size_t)o->threads, sizeof(*ts));
	uint64_t *rs = calloc((size_t)nranks, sizeof(*rs));
	unsigned char *buf = malloc(cap_of(o->bytes));
	if (!state || !next || !ts || !rs || !buf) {
		fprintf(stderr, "mt: out of memory\n");
		return 1;
	}
	for (int k = 0; k < o->threads; k++) {
		uint64_t *st = state + (size_t)k * nranks;
		int d = shift_of(k, nranks);
		for (int r = 0; r < nranks; r++)
			st[r] = initial_state(r, k);
		for (int it = 0; it < o->iters; it++) {
			for (int dst = 0; dst < nranks; dst++) {
				int src = (dst - d + nranks) % nranks;
				size_t len = msg_len(o->bytes, src, dst, it, k);
				fill(buf, len, seed_of(st[src], dst, it, k));
				next[dst] = fold(st[dst], buf, len);
			}
			memcpy(st, next, (size_t)nranks * sizeof(*st));
		}
	}
	for (int r = 0; r < nranks; r++) {
		for (int k = 0; k < o->threads; k++)
			ts[k] = state[(size_t)k * nranks + r];
		rs[r] = combine(ts, o->threads);
	}
	print_result(o, nranks, o->iters, combine(rs, nranks));
	return 0;
}

// The stop decision (-E), on rank 0: under mu, each thread publishes how
// many iterations it has completed and reads the target; the main thread
// sets the target to one past the furthest thread, so no thread is past it.
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static int completed[MAX_THREADS];
static int target; // 0: not yet

struct worker {
	const struct opts *o;
	int k, rank, nranks;
	MPI_Comm comm; // this thread's own, for the stop Bcast
	uint64_t state;
	int iters;
	pthread_t tid;
};

static void mpi_check(int rc, const char *what, int rank, int k)
{
	if (rc != MPI_SUCCESS) {
		fprintf(stderr, "mt: rank %d thread %d: %s failed (%d)\n", rank, k, what, rc);
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
}

static void *work(void *arg)
{
	struct worker *w = arg;
	const struct opts *o = w->o;
	int n = w->nranks, r = w->rank, k = w->k;
	int d = shift_of(k, n);
	int dst = (r + d) % n, src = (r - d + n) % n;
	unsigned char *sbuf = malloc(cap_of(o->bytes)), *rbuf = malloc(cap_of(o->bytes));
	if (!sbuf || !rbuf) {
		fprintf(stderr, "mt: out of memory\n");
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
	uint64_t state = initial_state(r, k);
	int it = 0;
	while (it < o->iters) {
		size_t slen = msg_len(o->bytes, r, dst, it, k), rlen = msg_len(o->bytes, src, r, it, k);
		fill(sbuf, slen, seed_of(state, dst, it, k));
		MPI_Status st[2];
		if (it % 2 == 0) {
			MPI_Request req[2];
			mpi_check(MPI_Irecv(rbuf, (int)rlen, MPI_BYTE, src, k, MPI_COMM_WORLD, &req[0]), "MPI_Irecv", r, k);
			mpi_check(MPI_Isend(sbuf, (int)slen, MPI_BYTE, dst, k, MPI_COMM_WORLD, &req[1]), "MPI_Isend", r, k);
			mpi_check(MPI_Waitall(2, req, st), "MPI_Waitall", r, k);
		} else {
			mpi_check(MPI_Sendrecv(sbuf, (int)slen, MPI_BYTE, dst, k, rbuf, (int)rlen, MPI_BYTE, src, k,
					       MPI_COMM_WORLD, &st[0]),
				  "MPI_Sendrecv", r, k);
		}
		int got;
		MPI_Get_count(&st[0], MPI_BYTE, &got);
		if (got != (int)rlen || st[0].MPI_SOURCE != src || st[0].MPI_TAG != k) {
			fprintf(stderr, "mt: rank %d thread %d iteration %d: got %d bytes from %d tag %d, want %zu from %d tag %d\n",
				r, k, it, got, st[0].MPI_SOURCE, st[0].MPI_TAG, rlen, src, k);
			MPI_Abort(MPI_COMM_WORLD, 1);
		}
		state = fold(state, rbuf, rlen);
		it++;
		if (o->sleep_usec > 0) {
			struct timespec z = {.tv_sec = o->sleep_usec / 1000000, .tv_nsec = o->sleep_usec % 1000000 * 1000};
			nanosleep(&z, NULL);
		}
		if (o->stop_dir) {
			int stop_at = 0;
			if (r == 0) {
				pthread_mutex_lock(&mu);
				completed[k] = it;
				stop_at = target;
				pthread_mutex_unlock(&mu);
			}
			mpi_check(MPI_Bcast(&stop_at, 1, MPI_INT, 0, w->comm), "MPI_Bcast", r, k);
			if (stop_at > 0 && it >= stop_at)
				break;
		}
	}
	w->state = state;
	w->iters = it;
	free(sbuf);
	free(rbuf);
	return NULL;
}

// watch is rank 0's main thread under -E: it waits for dir/stop (or for
// every thread to finish its -n iterations) and sets the target.
static void watch(const struct opts *o)
{
	char path[4096];
	struct stat sb;
	snprintf(path, sizeof(path), "%s/stop", o->stop_dir);
	struct timespec ts = {.tv_sec = 0, .tv_nsec = 5 * 1000 * 1000};
	for (;;) {
		int all = 1;
		pthread_mutex_lock(&mu);
		for (int k = 0; k < o->threads; k++)
			if (completed[k] < o->iters)
				all = 0;
		pthread_mutex_unlock(&mu);
		if (all)
			return;
		if (stat(path, &sb) == 0)
			break;
		nanosleep(&ts, NULL);
	}
	pthread_mutex_lock(&mu);
	int most = 0;
	for (int k = 0; k < o->threads; k++)
		if (completed[k] > most)
			most = completed[k];
	target = most + 1;
	pthread_mutex_unlock(&mu);
}

static int run(const struct opts *o)
{
	int rank, nranks;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &nranks);
	if (nranks < 2) {
		fprintf(stderr, "mt: needs at least 2 ranks\n");
		MPI_Abort(MPI_COMM_WORLD, 2);
	}
	struct worker w[MAX_THREADS];
	for (int k = 0; k < o->threads; k++) {
		w[k] = (struct worker){.o = o, .k = k, .rank = rank, .nranks = nranks};
		mpi_check(MPI_Comm_dup(MPI_COMM_WORLD, &w[k].comm), "MPI_Comm_dup", rank, k);
	}
	for (int k = 0; k < o->threads; k++) {
		int e = pthread_create(&w[k].tid, NULL, work, &w[k]);
		if (e != 0) {
			fprintf(stderr, "mt: rank %d: pthread_create: %s\n", rank, strerror(e));
			MPI_Abort(MPI_COMM_WORLD, 1);
		}
	}
	if (rank == 0) {
		printf("mt: rank 0 runs %d threads per rank on %d ranks\n", o->threads, nranks);
		fflush(stdout);
	}
	if (rank == 0 && o->stop_dir)
		watch(o);
	uint64_t ts[MAX_THREADS];
	int iters = 0;
	for (int k = 0; k < o->threads; k++) {
		pthread_join(w[k].tid, NULL);
		ts[k] = w[k].state;
		if (k == 0)
			iters = w[0].iters;
		if (w[k].iters != iters) {
			fprintf(stderr, "mt: rank %d: thread %d ran %d iterations, thread 0 %d\n", rank, k, w[k].iters, iters);
			MPI_Abort(MPI_COMM_WORLD, 1);
		}
		MPI_Comm_free(&w[k].comm);
	}
	uint64_t mine = combine(ts, o->threads);
	uint64_t *all = rank == 0 ? calloc((size_t)nranks, sizeof(*all)) : NULL;
	int *its = rank == 0 ? calloc((size_t)nranks, sizeof(*its)) : NULL;
	MPI_Gather(&mine, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
	MPI_Gather(&iters, 1, MPI_INT, its, 1, MPI_INT, 0, MPI_COMM_WORLD);
	if (rank == 0) {
		for (int r = 0; r < nranks; r++)
			if (its[r] != iters) {
				fprintf(stderr, "mt: rank %d ran %d iterations, rank 0 %d\n", r, its[r], iters);
				MPI_Abort(MPI_COMM_WORLD, 1);
			}
		print_result(o, nranks, iters, combine(all, nranks));
	}
	return 0;
}

static void usage(FILE *f)
{
	fprintf(f, "usage: mt [-T threads] [-n iters] [-s bytes[K|M]] [-z usec] [-E dir] [-x ranks]\n");
}

int main(int argc, char **argv)
{
	struct opts o = {.threads = 4, .iters = 100, .bytes = 64 << 10};
	int c;
	while ((c = getopt(argc, argv, "hT:n:s:z:E:x:")) != -1) {
		switch (c) {
		case 'T':
			o.threads = atoi(optarg);
			break;
		case 'n':
			o.iters = atoi(optarg);
			break;
		case 's':
			o.bytes = parse_size("mt", optarg, 1ULL << 28);
			break;
		case 'z':
			o.sleep_usec = atol(optarg);
			break;
		case 'E':
			o.stop_dir = optarg;
			break;
		case 'x':
			o.expect_ranks = atoi(optarg);
			break;
		case 'h':
			usage(stdout);
			return 0;
		default:
			usage(stderr);
			return 2;
		}
	}
	if (optind != argc || o.iters < 1 || o.threads < 1 || o.threads > MAX_THREADS) {
		usage(stderr);
		return 2;
	}
	if (o.expect_ranks > 0) {
		if (o.expect_ranks < 2) {
			fprintf(stderr, "mt: needs at least 2 ranks\n");
			return 2;
		}
		return expect(&o, o.expect_ranks);
	}

	int provided;
	MPI_Init_thread(&argc, &argv, MPI_THREAD_MULTIPLE, &provided);
	if (provided < MPI_THREAD_MULTIPLE) {
		int rank;
		MPI_Comm_rank(MPI_COMM_WORLD, &rank);
		fprintf(stderr, "mt: rank %d: MPI_Init_thread provided thread level %d, not MPI_THREAD_MULTIPLE (%d)\n", rank,
			provided, MPI_THREAD_MULTIPLE);
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
	int rc = run(&o);
	MPI_Finalize();
	return rc;
}
