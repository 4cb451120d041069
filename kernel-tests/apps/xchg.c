// SPDX-License-Identifier: Apache-2.0
//
// xchg: a deterministic MPI exchange for mpipause's multi-node tests.
//
// Every iteration, each rank sends one message to each of its peers (every
// other rank in "a2a" mode, the next rank in "ring" mode) with point-to-point
// MPI_Isend/MPI_Irecv, so the bytes go over the library's TCP connections.
// Message sizes are irregular (0 to 1.25 x -s bytes, varying with sender,
// receiver and iteration). The content of a message is a pseudo-random stream
// seeded from the sender's state, and every rank folds what it received into
// its state, so a lost, duplicated, reordered or corrupted byte changes the
// final checksum that rank 0 prints. The same computation done serially in one
// process (-x) prints the checksum a correct run must print, whatever the MPI
// library, the placement or the number of pauses.
//
// Usage: xchg [-m a2a|ring|pair] [-f] [-n iters] [-s bytes[K|M]] [-w dir] [-t usec] [-z usec] [-S usec] [-B dir] [-R dir] [-E dir] [-U dir] [-L dir] [-O dir] [-x ranks]
//   -m pair  ranks 2k and 2k+1 exchange one message each way per iteration:
//            with a small -s, a latency-bound ping-pong.
//   -f       every message is exactly -s bytes (not irregular).
//   -w dir   hold point: after the first iteration (every connection the
//            pattern needs is established), each rank creates dir/ready.RANK
//            and then waits until dir/go exists.
//   -t usec  compute (busy loop) for usec microseconds after each iteration.
//   -z usec  sleep for usec microseconds after each iteration (many jobs
//            sharing few cores).
//   -S usec  the last rank computes for usec microseconds, calling no MPI, at
//            the start of the middle iteration (after printing a line that
//            says so), while its peers already send it that iteration's
//            messages: a busy receiver with unread data waiting for it.
//   -B dir   a busy receiver without races: at the middle iteration the last
//            rank creates dir/busy and computes until dir/done exists; the
//            others wait (no MPI) for dir/busy before they send, so what
//            they send surely arrives while it computes. The test ends the
//            busy phase by creating dir/done.
//   -R dir   a rank blocked in MPI_Recv for a message sent only later: at
//            the start of the middle iteration rank 0 prints a line that
//            says so and posts a blocking MPI_Recv from the last rank (tag
//            -n, which no iteration uses); the last rank prints a line,
//            creates dir/waiting, waits (no MPI) until dir/send exists and
//            only then sends it (irregular size, content seeded from its
//            state). Rank 0 folds the message into its state before the
//            iteration's exchange; -x folds it the same way, so the
//            checksum stays that of a deterministic run. The other ranks
//            wait (no MPI) for dir/waiting and then go on into the
//            iteration, so what they send the last rank surely arrives
//            while it does not read, and wait for rank 0 and the last rank
//            in MPI_Waitall. The test ends the wait by creating dir/send.
//            Needs 2 ranks or more; not with -E (the middle iteration is
//            that of -n).
//   -E dir   until told: rank 0 looks for dir/stop after every iteration and
//            all ranks stop after the one where it appeared (at most -n
//            iterations); the result line gives the iterations run, and
//            -x with -n that many prints what it must be.
//   -U dir   a send path no shim can gate: after the first iteration rank 0
//            starts a thread that opens a loopback TCP connection of its
//            own, creates dir/leaking, and then writes to it with
//            syscall(SYS_write), one byte at a time for as long as it gets
//            the CPU (at nice -20 if allowed), reading them back at the
//            other end the same way. The exchange and its checksum are
//            untouched.
//   -L dir   one send past the gate, on the test's cue: after the first
//            iteration rank 0 starts a thread that opens a loopback TCP
//            connection of its own, creates dir/late-ready, waits for
//            dir/late-send, writes 40 bytes to it with syscall(SYS_write)
//            (as a send call that read its gate open and was preempted
//            past the drain would), creates dir/late-sent, reads them back
//            with a wrapped read (which serves what a drain stashed),
//            checks them and creates dir/late-read. The exchange and its
//            checksum are untouched.
//   -O dir   -L's thread, but on the cue it first writes 40 bytes 'H' with
//            a wrapped write(2) (held while the gate is closed), then the
//            40 bytes 'L' with syscall(SYS_write), which overtake them; it
//            reads back 80 bytes and writes to dir/late-read the order
//            they came in ("LH" when the raw ones went first).
//   -x ranks print the expected checksum for that many ranks, without MPI.
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/syscall.h>

#include <mpi.h>

#include "stop.h"
#include "stream.h"

enum mode { MODE_A2A, MODE_RING, MODE_PAIR };

struct opts {
	enum mode mode;
	int iters;
	size_t bytes;
	const char *hold_dir;
	long compute_usec;
	long sleep_usec;
	const char *busy_dir;
	const char *recv_dir;
	const char *stop_dir;
	const char *leak_dir;
	const char *late_dir;
	const char *overtake_dir;
	long slow_usec;
	int expect_ranks;
};

static int fixed_len; // -f

// msg_len is the irregular size of the message from src to dst in iteration
// it: 0, 1/4, ..., 5/4 of the base size; with -f, the base size.
static size_t msg_len(size_t base, int src, int dst, int it)
{
	if (fixed_len)
		return base;
	unsigned k = (unsigned)(src * 7 + dst * 3 + it * 5) % 6;
	return base / 4 * k;
}

static int is_peer(enum mode m, int nranks, int src, int dst)
{
	if (src == dst)
		return 0;
	if (m == MODE_RING)
		return dst == (src + 1) % nranks;
	if (m == MODE_PAIR)
		return dst == (src ^ 1);
	return 1;
}

static uint64_t seed_of(uint64_t state, int dst, int it)
{
	return mix64(state ^ mix64(((uint64_t)dst << 32) ^ (uint64_t)it));
}

static uint64_t initial_state(int rank)
{
	return mix64(0x6d706970617573ULL + (uint64_t)rank);
}

static const char *mode_name(enum mode m)
{
	return m == MODE_RING ? "ring" : m == MODE_PAIR ? "pair" : "a2a";
}

static void print_result(const struct opts *o, int nranks, uint64_t sum)
{
	printf("xchg mode=%s ranks=%d iters=%d bytes=%zu checksum=%016" PRIx64 "\n", mode_name(o->mode), nranks,
	       o->iters, o->bytes, sum);
	fflush(stdout);
}

// late_len and late_tag are the size and tag of -R's late message, from the
// last rank to rank 0 (its seed: seed_of(last rank's state, 0, tag)).
static size_t late_len(const struct opts *o, int nranks, int it)
{
	return msg_len(o->bytes, nranks - 1, 0, it) + 3;
}

static int late_tag(const struct opts *o)
{
	return o->iters;
}

// expect runs the whole exchange for nranks ranks in this process.
static int expect(const struct opts *o, int nranks)
{
	uint64_t *state = calloc((size_t)nranks, sizeof(*state));
	uint64_t *next = calloc((size_t)nranks, sizeof(*next));
	unsigned char *buf = malloc(o->bytes / 4 * 5 + 8);
	if (!state || !next || !buf) {
		fprintf(stderr, "xchg: out of memory\n");
		return 1;
	}
	for (int r = 0; r < nranks; r++)
		state[r] = initial_state(r);
	for (int it = 0; it < o->iters; it++) {
		if (o->recv_dir && it == o->iters / 2) {
			size_t len = late_len(o, nranks, it);
			fill(buf, len, seed_of(state[nranks - 1], 0, late_tag(o)));
			state[0] = fold(state[0], buf, len);
		}
		for (int dst = 0; dst < nranks; dst++) {
			uint64_t h = state[dst];
			for (int src = 0; src < nranks; src++) {
				if (!is_peer(o->mode, nranks, src, dst))
					continue;
				size_t len = msg_len(o->bytes, src, dst, it);
				fill(buf, len, seed_of(state[src], dst, it));
				h = fold(h, buf, len);
			}
			next[dst] = h;
		}
		memcpy(state, next, (size_t)nranks * sizeof(*state));
	}
	print_result(o, nranks, combine(state, nranks));
	return 0;
}

static void compute(long usec)
{
	struct timespec t0, t;
	if (usec <= 0)
		return;
	clock_gettime(CLOCK_MONOTONIC, &t0);
	do {
		clock_gettime(CLOCK_MONOTONIC, &t);
	} while ((t.tv_sec - t0.tv_sec) * 1000000L + (t.tv_nsec - t0.tv_nsec) / 1000 < usec);
}

static int touch(const char *path)
{
	int fd = open(path, O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (fd < 0)
		return -1;
	return close(fd);
}

// loopback connects *w to *r over a loopback TCP connection of the
// process's own; what fails is reported as opt's.
static void loopback(const char *opt, int *w, int *r)
{
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t al = sizeof(a);
	int l = socket(AF_INET, SOCK_STREAM, 0);
	*w = socket(AF_INET, SOCK_STREAM, 0);
	if (l < 0 || *w < 0 || bind(l, (struct sockaddr *)&a, al) < 0 || listen(l, 1) < 0 ||
	    getsockname(l, (struct sockaddr *)&a, &al) < 0 || connect(*w, (struct sockaddr *)&a, al) < 0 ||
	    (*r = accept(l, NULL, NULL)) < 0) {
		fprintf(stderr, "xchg: %s connection: %s\n", opt, strerror(errno));
		exit(1);
	}
}

// late is what -L's and -O's thread is told.
struct late {
	const char *dir;
	int overtake; // -O: a held write first
};

// late_send is -L's and -O's thread. The write is a raw system call on
// purpose: it is the send a preempted thread's call makes after the gate
// closed, or (-O) a send path past the shim.
static void *late_send(void *arg)
{
	const struct late *l = arg;
	const char *dir = l->dir;
	int w, r;
	loopback(l->overtake ? "-O" : "-L", &w, &r);
	char path[4096];
	snprintf(path, sizeof(path), "%s/late-ready", dir);
	if (touch(path) < 0) {
		perror(path);
		exit(1);
	}
	snprintf(path, sizeof(path), "%s/late-send", dir);
	for (struct timespec z = {.tv_nsec = 1000000}; access(path, F_OK) != 0;)
		nanosleep(&z, NULL);
	char msg[40], held[40], got[80];
	memset(msg, 'L', sizeof(msg));
	memset(held, 'H', sizeof(held));
	if (l->overtake && write(w, held, sizeof(held)) != (ssize_t)sizeof(held)) {
		perror("xchg: -O write");
		exit(1);
	}
	if (syscall(SYS_write, w, msg, sizeof(msg)) != (long)sizeof(msg)) {
		perror("xchg: -L write");
		exit(1);
	}
	snprintf(path, sizeof(path), "%s/late-sent", dir);
	if (touch(path) < 0) {
		perror(path);
		exit(1);
	}
	size_t want = l->overtake ? sizeof(got) : sizeof(msg);
	for (size_t n = 0; n < want;) {
		ssize_t k = read(r, got + n, want - n);
		if (k <= 0) {
			fprintf(stderr, "xchg: -L read: %s\n", k < 0 ? strerror(errno) : "end of stream");
			exit(1);
		}
		n += (size_t)k;
	}
	char order[3] = {0};
	if (l->overtake) {
		// Each run of 40 whole, in one order or the other.
		for (int i = 0; i < 2; i++) {
			order[i] = got[40 * i];
			for (int k = 1; k < 40; k++)
				if (got[40 * i + k] != order[i])
					order[i] = '?';
		}
		if (strcmp(order, "LH") != 0 && strcmp(order, "HL") != 0) {
			fprintf(stderr, "xchg: -O read back other bytes than it wrote (%s)\n", order);
			exit(1);
		}
	} else if (memcmp(got, msg, sizeof(msg)) != 0) {
		fprintf(stderr, "xchg: -L read back other bytes than it wrote\n");
		exit(1);
	}
	snprintf(path, sizeof(path), "%s/late-read", dir);
	FILE *f = fopen(path, "w");
	if (!f || fputs(order, f) < 0 || fclose(f) != 0) {
		perror(path);
		exit(1);
	}
	return NULL;
}

// leak is -U's thread. Raw system calls on purpose: a wrapped write
// would be gated, a wrapped read would serve what a drain stashed.
static void *leak(void *arg)
{
	const char *dir = arg;
	int w, r;
	loopback("-U", &w, &r);
	char path[4096];
	snprintf(path, sizeof(path), "%s/leaking", dir);
	int fd = open(path, O_CREAT | O_WRONLY, 0644);
	if (fd < 0) {
		perror(path);
		exit(1);
	}
	close(fd);
	// At the front of the CPU queue (when allowed): a pause lasts a few
	// milliseconds, and a thread among many busy ones on two cores could
	// sit all of them out and send nothing while the gates are closed.
	setpriority(PRIO_PROCESS, (id_t)syscall(SYS_gettid), -20);
	// The reader must not block: the shim's drain may have taken what it
	// was waiting for (it stashes whatever its process has unread).
	if (fcntl(r, F_SETFL, O_NONBLOCK) < 0) {
		perror("xchg: -U fcntl");
		exit(1);
	}
	for (char b[64];;) {
		if (syscall(SYS_write, w, "x", 1) != 1) {
			perror("xchg: -U write");
			exit(1);
		}
		if (syscall(SYS_read, r, b, sizeof(b)) < 0 && errno != EAGAIN) {
			perror("xchg: -U read");
			exit(1);
		}
	}
	return NULL;
}

// A rank that ends with a non-zero status from inside the MPI library or
// the shim (an exit() of theirs, which prints nothing) says so: a launcher
// only reports "a process returned a non-zero exit code".
static int exit_rank = -1;

static void report_exit(int status, void *arg)
{
	(void)arg;
	if (status != 0)
		fprintf(stderr, "xchg: rank %d (pid %d) exits with status %d\n", exit_rank, (int)getpid(), status);
}

// hold signals that this rank's connections are up and waits for the test to
// let it go on. Polling a file keeps the rank idle (no MPI progress spinning),
// so the test's tools get the CPU while the job holds.
static void hold(const char *dir, int rank)
{
	char path[4096];
	struct stat st;
	snprintf(path, sizeof(path), "%s/ready.%d", dir, rank);
	if (touch(path) != 0) {
		fprintf(stderr, "xchg: rank %d: create %s: %s\n", rank, path, strerror(errno));
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
	snprintf(path, sizeof(path), "%s/go", dir);
	struct timespec ts = {.tv_sec = 0, .tv_nsec = 5 * 1000 * 1000};
	while (stat(path, &st) != 0)
		nanosleep(&ts, NULL);
}

// busy_phase is -B: see the usage above.
static void busy_phase(const char *dir, int rank, int nranks)
{
	char busy[4096], done[4096];
	struct stat st;
	snprintf(busy, sizeof(busy), "%s/busy", dir);
	snprintf(done, sizeof(done), "%s/done", dir);
	if (rank == nranks - 1) {
		printf("xchg: rank %d computes until %s exists\n", rank, done);
		fflush(stdout);
		if (touch(busy) != 0) {
			fprintf(stderr, "xchg: rank %d: create %s: %s\n", rank, busy, strerror(errno));
			MPI_Abort(MPI_COMM_WORLD, 1);
		}
		// A stat every millisecond of computing: still no MPI call.
		while (stat(done, &st) != 0)
			compute(1000);
		return;
	}
	struct timespec ts = {.tv_sec = 0, .tv_nsec = 1000 * 1000};
	while (stat(busy, &st) != 0)
		nanosleep(&ts, NULL);
}

// late_phase is -R: see the usage above. buf holds at least late_len bytes.
static void late_phase(const struct opts *o, int rank, int nranks, int it, uint64_t *state, unsigned char *buf)
{
	size_t len = late_len(o, nranks, it);
	if (rank == 0) {
		printf("xchg: rank 0 waits in MPI_Recv from rank %d\n", nranks - 1);
		fflush(stdout);
		MPI_Status st;
		int got = -1;
		MPI_Recv(buf, (int)len, MPI_BYTE, nranks - 1, late_tag(o), MPI_COMM_WORLD, &st);
		MPI_Get_count(&st, MPI_BYTE, &got);
		if (got != (int)len) {
			fprintf(stderr, "xchg: rank 0: the late message has %d bytes, want %zu\n", got, len);
			MPI_Abort(MPI_COMM_WORLD, 1);
		}
		*state = fold(*state, buf, len);
		printf("xchg: rank 0 got the late message\n");
		fflush(stdout);
		return;
	}
	char path[4096], waiting[4096];
	struct stat sb;
	struct timespec ts = {.tv_sec = 0, .tv_nsec = 1000 * 1000};
	snprintf(waiting, sizeof(waiting), "%s/waiting", o->recv_dir);
	if (rank != nranks - 1) {
		while (stat(waiting, &sb) != 0)
			nanosleep(&ts, NULL);
		return;
	}
	snprintf(path, sizeof(path), "%s/send", o->recv_dir);
	printf("xchg: rank %d sends to rank 0 once %s exists\n", rank, path);
	fflush(stdout);
	if (touch(waiting) != 0) {
		fprintf(stderr, "xchg: rank %d: create %s: %s\n", rank, waiting, strerror(errno));
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
	while (stat(path, &sb) != 0)
		nanosleep(&ts, NULL);
	fill(buf, len, seed_of(*state, 0, late_tag(o)));
	MPI_Send(buf, (int)len, MPI_BYTE, 0, late_tag(o), MPI_COMM_WORLD);
}

static int run(const struct opts *o)
{
	int rank, nranks;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &nranks);

	size_t cap = o->bytes / 4 * 5 + 8;
	unsigned char **sbuf = calloc((size_t)nranks, sizeof(*sbuf));
	unsigned char **rbuf = calloc((size_t)nranks, sizeof(*rbuf));
	MPI_Request *req = calloc(2 * (size_t)nranks, sizeof(*req));
	MPI_Status *st = calloc(2 * (size_t)nranks, sizeof(*st));
	if (!sbuf || !rbuf || !req || !st) {
		fprintf(stderr, "xchg: out of memory\n");
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
	for (int p = 0; p < nranks; p++) {
		if (is_peer(o->mode, nranks, rank, p))
			sbuf[p] = malloc(cap);
		if (is_peer(o->mode, nranks, p, rank))
			rbuf[p] = malloc(cap);
		if ((is_peer(o->mode, nranks, rank, p) && !sbuf[p]) || (is_peer(o->mode, nranks, p, rank) && !rbuf[p])) {
			fprintf(stderr, "xchg: out of memory\n");
			MPI_Abort(MPI_COMM_WORLD, 1);
		}
	}

	unsigned char *late = o->recv_dir ? malloc(cap) : NULL;
	if (o->recv_dir && (!late || nranks < 2)) {
		fprintf(stderr, "xchg: -R: %s\n", late ? "needs 2 ranks or more" : "out of memory");
		MPI_Abort(MPI_COMM_WORLD, 1);
	}

	struct opts done = *o; // as run: -E may end it early
	uint64_t state = initial_state(rank);
	for (int it = 0; it < o->iters; it++) {
		int n = 0;
		if (o->slow_usec > 0 && rank == nranks - 1 && it == o->iters / 2) {
			printf("xchg: rank %d computes for %ld us\n", rank, o->slow_usec);
			fflush(stdout);
			compute(o->slow_usec);
		}
		if (o->busy_dir && it == o->iters / 2)
			busy_phase(o->busy_dir, rank, nranks);
		if (o->recv_dir && it == o->iters / 2)
			late_phase(o, rank, nranks, it, &state, late);
		for (int src = 0; src < nranks; src++)
			if (rbuf[src])
				MPI_Irecv(rbuf[src], (int)msg_len(o->bytes, src, rank, it), MPI_BYTE, src, it,
					  MPI_COMM_WORLD, &req[n++]);
		for (int dst = 0; dst < nranks; dst++) {
			if (!sbuf[dst])
				continue;
			size_t len = msg_len(o->bytes, rank, dst, it);
			fill(sbuf[dst], len, seed_of(state, dst, it));
			MPI_Isend(sbuf[dst], (int)len, MPI_BYTE, dst, it, MPI_COMM_WORLD, &req[n++]);
		}
		MPI_Waitall(n, req, st);
		for (int src = 0; src < nranks; src++)
			if (rbuf[src])
				state = fold(state, rbuf[src], msg_len(o->bytes, src, rank, it));
		if (it == 0 && o->hold_dir)
			hold(o->hold_dir, rank);
		if (it == 0 && (o->late_dir || o->overtake_dir) && rank == 0) {
			static struct late l;
			pthread_t t;
			l.dir = o->late_dir ? o->late_dir : o->overtake_dir;
			l.overtake = o->late_dir == NULL;
			if (pthread_create(&t, NULL, late_send, &l) != 0) {
				fprintf(stderr, "xchg: -L: no thread\n");
				MPI_Abort(MPI_COMM_WORLD, 1);
			}
		}
		if (it == 0 && o->leak_dir && rank == 0) {
			pthread_t t;
			if (pthread_create(&t, NULL, leak, (void *)o->leak_dir) != 0) {
				fprintf(stderr, "xchg: -U: no thread\n");
				MPI_Abort(MPI_COMM_WORLD, 1);
			}
		}
		compute(o->compute_usec);
		if (o->sleep_usec > 0) {
			struct timespec z = {.tv_sec = o->sleep_usec / 1000000, .tv_nsec = o->sleep_usec % 1000000 * 1000};
			nanosleep(&z, NULL);
		}
		if (o->stop_dir && told_to_stop(o->stop_dir, rank)) {
			done.iters = it + 1;
			break;
		}
	}

	uint64_t *all = rank == 0 ? calloc((size_t)nranks, sizeof(*all)) : NULL;
	MPI_Gather(&state, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
	if (rank == 0)
		print_result(&done, nranks, combine(all, nranks));
	return 0;
}

static void usage(FILE *f)
{
	fprintf(f, "usage: xchg [-m a2a|ring|pair] [-f] [-n iters] [-s bytes[K|M]] [-w holddir] [-t usec] [-z usec] [-S usec] [-B dir] [-R dir] [-E dir] [-U dir] [-L dir] [-O dir] [-x ranks]\n");
}

int main(int argc, char **argv)
{
	struct opts o = {.mode = MODE_A2A, .iters = 10, .bytes = 1 << 20};
	int c;
	while ((c = getopt(argc, argv, "hfm:n:s:w:t:z:S:B:R:E:U:L:O:x:")) != -1) {
		switch (c) {
		case 'f':
			fixed_len = 1;
			break;
		case 'm':
			if (strcmp(optarg, "a2a") == 0)
				o.mode = MODE_A2A;
			else if (strcmp(optarg, "ring") == 0)
				o.mode = MODE_RING;
			else if (strcmp(optarg, "pair") == 0)
				o.mode = MODE_PAIR;
			else {
				usage(stderr);
				return 2;
			}
			break;
		case 'n':
			o.iters = atoi(optarg);
			break;
		case 's':
			o.bytes = parse_size("xchg", optarg, 1ULL << 30);
			break;
		case 'w':
			o.hold_dir = optarg;
			break;
		case 't':
			o.compute_usec = atol(optarg);
			break;
		case 'z':
			o.sleep_usec = atol(optarg);
			break;
		case 'S':
			o.slow_usec = atol(optarg);
			break;
		case 'B':
			o.busy_dir = optarg;
			break;
		case 'R':
			o.recv_dir = optarg;
			break;
		case 'E':
			o.stop_dir = optarg;
			break;
		case 'U':
			o.leak_dir = optarg;
			break;
		case 'O':
			o.overtake_dir = optarg;
			break;
		case 'L':
			o.late_dir = optarg;
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
	if (optind != argc || o.iters < 1) {
		usage(stderr);
		return 2;
	}
	if (o.recv_dir && o.stop_dir) {
		fprintf(stderr, "xchg: -R and -E do not go together (the late message comes at the middle of -n)\n");
		return 2;
	}
	if (o.recv_dir && o.expect_ranks == 1) {
		fprintf(stderr, "xchg: -R needs 2 ranks or more\n");
		return 2;
	}
	if (o.expect_ranks > 0)
		return expect(&o, o.expect_ranks);

	MPI_Init(&argc, &argv);
	MPI_Comm_rank(MPI_COMM_WORLD, &exit_rank);
	on_exit(report_exit, NULL);
	int rc = run(&o);
	int f = MPI_Finalize();
	if (f != MPI_SUCCESS)
		fprintf(stderr, "xchg: rank %d: MPI_Finalize returned %d\n", exit_rank, f);
	return rc;
}
