// SPDX-License-Identifier: Apache-2.0
//
// sideio: an MPI program that also does I/O of its own, for the
// end-to-end test ("nothing lost, whatever the program does").
//
// The main thread runs xchg's all-to-all exchange (irregular message sizes,
// a pseudo-random stream per message, every rank folding what it got into
// its state) until told to stop, and rank 0 prints a checksum that the
// serial computation (-x) must match. Meanwhile a second thread of every
// rank, which calls no MPI, keeps a TCP connection of its own to a server
// outside the job (-H) and sends it a numbered, checkable stream of records,
// each written in one of several ways: send(), write(), writev() of header
// and body at once, sendmsg(), or a header by write() and a body by
// sendfile() from a file the rank wrote at its start (-D). Every -F records
// it forks a child that opens a connection of its own to the server, sends
// a few records the same ways, and exits (exit(3), as a helper process
// would). At the end each connection gets an END record (bytes sent before
// it; the parent's also the number of children it forked), then
// shutdown(SHUT_WR), and the parent reads until the server closes.
//
// The parent's records go through several descriptors of its one connection
// (the socket's own, a dup, an fcntl F_DUPFD_CLOEXEC copy, one received
// over a unix socket with SCM_RIGHTS), a record's header and body through
// the one chosen for it at random, and every 16 records one of the copies
// is closed and made again: held bytes belong to the socket whatever
// descriptor wrote them (libmpi-shim/README.md), so the stream stays in
// order across pauses.
//
// With -B the server also talks back: it sends a numbered stream on every
// rank's own connection, all the time, paused or not, and a third thread of
// the rank reads it with raw syscall(SYS_read) and syscall(SYS_recvfrom),
// which the shim does not wrap, as a program's own client library might,
// checking every byte (back_byte) until the server closes. A byte lost,
// repeated or out of order (the shim's receive-side drain taking bytes from
// a connection that is not the job's: they wait in its stash for a wrapped
// read that never comes) is reported on stderr, with where the bytes it read
// instead come from in the stream, and fails the rank (exit 1); the rank's
// line says how many bytes it read (back=), for the test to compare with
// what the server sent.
//
// Record: a 40-byte header (struct rec) and len bytes of body. A body is
// fill(len, body_seed(rank, child, seq)), or for sendfile bytes
// [arg, arg+len) of the rank's file, which is fill(FILE_SIZE,
// file_seed(rank)). The server regenerates both, so a lost, duplicated,
// reordered or corrupted byte on any connection shows as a mismatch at its
// offset.
//
// Usage: sideio [-n iters] [-s bytes[K|M]] [-E dir] [-H host:port] [-D dir]
//               [-F records] [-z usec] [-k ways] [-B usec] [-x ranks]
//   -E dir   rank 0 looks for dir/stop after every iteration and all ranks
//            stop after the one where it appeared (at most -n iterations);
//            the result line gives the iterations run.
//   -H       the server; without it, no side I/O.
//   -D dir   where each rank writes its sendfile body (dir/body.RANK).
//   -F n     fork a child every n records of the parent (0: never).
//   -z usec  pause between two records of the parent.
//   -k ways  the ways records are sent, among s (send), w (write), v
//            (writev), m (sendmsg) and f (sendfile): all by default.
//   -B usec  read the server's stream back (the server must send one),
//            pausing usec between two reads, so that its bytes wait in the
//            kernel as a slow reader's would.
//   -x ranks print the expected checksum for that many ranks, without MPI.
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <netdb.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include <mpi.h>

#include "stop.h"
#include "stream.h"

// The record format; kernel-tests/sideio_test.go reads the same.
#define REC_MAGIC 0x45444953u // "SIDE"
enum { K_HELLO = 1, K_SEND, K_WRITE, K_WRITEV, K_SENDMSG, K_SENDFILE, K_END };
struct rec {
	uint32_t magic;
	uint16_t kind;
	uint16_t rank;
	uint32_t child; // 0: the rank's own connection; k: its k-th child's
	uint32_t len;   // body bytes after this header
	uint64_t seq;   // record number on this connection, HELLO is 0
	uint64_t arg;   // SENDFILE: file offset; END: bytes sent before END
	uint64_t aux;   // END: children forked (the rank's connection)
};
_Static_assert(sizeof(struct rec) == 40, "record header is 40 bytes");

#define FILE_SIZE (1u << 20)
#define MAX_BODY 32768u

static uint64_t file_seed(int rank)
{
	return mix64(0x73656e6466696c65ULL + (uint64_t)rank);
}

static uint64_t body_seed(int rank, uint32_t child, uint64_t seq)
{
	return mix64(mix64(0x626f6479ULL ^ ((uint64_t)rank << 40) ^ ((uint64_t)child << 8)) ^ seq);
}

// ---- the exchange (xchg's a2a) ----

static size_t msg_len(size_t base, int src, int dst, int it)
{
	unsigned k = (unsigned)(src * 7 + dst * 3 + it * 5) % 6;
	return base / 4 * k;
}

static uint64_t seed_of(uint64_t state, int dst, int it)
{
	return mix64(state ^ mix64(((uint64_t)dst << 32) ^ (uint64_t)it));
}

static uint64_t initial_state(int rank)
{
	return mix64(0x6d706970617573ULL + (uint64_t)rank);
}

static void print_result(int nranks, int iters, size_t bytes, uint64_t sum)
{
	printf("sideio ranks=%d iters=%d bytes=%zu checksum=%016" PRIx64 "\n", nranks, iters, bytes, sum);
	fflush(stdout);
}

static int expect(int nranks, int iters, size_t bytes)
{
	uint64_t *state = calloc((size_t)nranks, sizeof(*state));
	uint64_t *next = calloc((size_t)nranks, sizeof(*next));
	unsigned char *buf = malloc(bytes / 4 * 5 + 8);
	if (!state || !next || !buf) {
		fprintf(stderr, "sideio: out of memory\n");
		return 1;
	}
	for (int r = 0; r < nranks; r++)
		state[r] = initial_state(r);
	for (int it = 0; it < iters; it++) {
		for (int dst = 0; dst < nranks; dst++) {
			uint64_t h = state[dst];
			for (int src = 0; src < nranks; src++) {
				if (src == dst)
					continue;
				size_t len = msg_len(bytes, src, dst, it);
				fill(buf, len, seed_of(state[src], dst, it));
				h = fold(h, buf, len);
			}
			next[dst] = h;
		}
		memcpy(state, next, (size_t)nranks * sizeof(*state));
	}
	print_result(nranks, iters, bytes, combine(state, nranks));
	return 0;
}

// ---- the side I/O ----

struct side {
	int rank;
	struct sockaddr_storage addr;
	socklen_t addrlen;
	int file; // the sendfile body, FILE_SIZE bytes
	long fork_every;
	long gap_usec;
	atomic_int stop;
	int failed;
	// Children not reaped yet.
	pid_t *kids;
	int nkids, capkids;
	uint32_t forked;
	uint64_t records, bytes;
	// The server's stream back (-B): back_gap < 0 means none.
	long back_gap;
	int back_fd;
	uint64_t back_bytes; // read, up to end of stream
	int back_failed;
};

// conn is one connection's sending state.
enum { ALIASES = 4 };

struct conn {
	int fd;
	int alias[ALIASES]; // descriptors of fd's socket (alias[0] is fd); all 0 in a child's connection: fd alone
	int rank;
	uint32_t child;
	uint64_t seq;
	uint64_t sent; // bytes, headers included
	uint64_t rng;
	unsigned char body[MAX_BODY];
};

static uint64_t next_rand(uint64_t *x)
{
	*x += 0x9e3779b97f4a7c15ULL;
	return mix64(*x);
}

// put_all loops over short calls: a blocking socket still returns short on a
// signal, and the records must arrive whole.
static int put_all(int fd, const void *p, size_t n, int how)
{
	const char *b = p;
	while (n > 0) {
		ssize_t k = how == K_SEND ? send(fd, b, n, MSG_NOSIGNAL) : write(fd, b, n);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		b += k;
		n -= (size_t)k;
	}
	return 0;
}

// put_vec sends header and body in one writev or sendmsg, then whatever a
// short call left with plain writes.
static int put_vec(int fd, struct rec *h, const unsigned char *body, size_t len, int how)
{
	struct iovec iov[2] = {{h, sizeof(*h)}, {(void *)body, len}};
	ssize_t k;
	do {
		if (how == K_WRITEV) {
			k = writev(fd, iov, 2);
		} else {
			struct msghdr m = {.msg_iov = iov, .msg_iovlen = 2};
			k = sendmsg(fd, &m, MSG_NOSIGNAL);
		}
	} while (k < 0 && errno == EINTR);
	if (k < 0)
		return -1;
	size_t done = (size_t)k;
	if (done < sizeof(*h))
		return put_all(fd, (char *)h + done, sizeof(*h) - done, K_WRITE) || put_all(fd, body, len, K_WRITE);
	done -= sizeof(*h);
	return put_all(fd, body + done, len - done, K_WRITE);
}

static int put_file(int fd, int file, off_t off, size_t len)
{
	while (len > 0) {
		ssize_t k = sendfile(fd, file, &off, len);
		if (k < 0 && errno == EINTR)
			continue;
		if (k <= 0)
			return -1;
		len -= (size_t)k;
	}
	return 0;
}

// send_rec sends h and its body the way how says: body, or for K_SENDFILE
// bytes of file (the header by write, the body by sendfile).
static int send_rec(struct conn *c, struct rec *h, const unsigned char *body, int how, int file)
{
	int rc;
	h->magic = REC_MAGIC;
	h->rank = (uint16_t)c->rank;
	h->child = c->child;
	h->seq = c->seq;
	int fd = c->fd;
	if (c->alias[1] > 0) {
		int a = c->alias[next_rand(&c->rng) % ALIASES];
		if (a >= 0)
			fd = a;
	}
	switch (how) {
	case K_SENDFILE:
		rc = put_all(fd, h, sizeof(*h), K_WRITE) || put_file(fd, file, (off_t)h->arg, h->len);
		break;
	case K_WRITEV:
	case K_SENDMSG:
		rc = put_vec(fd, h, body, h->len, how);
		break;
	default:
		rc = put_all(fd, h, sizeof(*h), how) || put_all(fd, body, h->len, how);
	}
	if (rc == 0) {
		c->seq++;
		c->sent += sizeof(*h) + h->len;
	}
	return rc;
}

// ways are the ways records are sent (-k), nways of them.
static int ways[5] = {K_SEND, K_WRITE, K_WRITEV, K_SENDMSG, K_SENDFILE}, nways = 5;

// one_record sends the next record of c in a way chosen at random.
static int one_record(struct conn *c, int file)
{
	struct rec h = {0};
	uint64_t r = next_rand(&c->rng);
	int how = ways[r % (uint64_t)nways];
	h.kind = (uint16_t)how;
	h.len = (uint32_t)((r >> 8) % MAX_BODY);
	if (how == K_SENDFILE) {
		h.arg = (r >> 24) % (FILE_SIZE - h.len);
		return send_rec(c, &h, NULL, how, file);
	}
	fill(c->body, h.len, body_seed(c->rank, c->child, c->seq));
	return send_rec(c, &h, c->body, how, -1);
}

// passed is a copy of fd made by sending it to ourselves over a unix
// socket (SCM_RIGHTS), or -1.
static int passed(int fd)
{
	int sv[2], got = -1;
	if (socketpair(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0, sv) < 0)
		return -1;
	char c = 'f';
	union {
		char b[CMSG_SPACE(sizeof(int))];
		struct cmsghdr align;
	} u;
	struct iovec iov = {&c, 1};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = u.b, .msg_controllen = sizeof(u.b)};
	struct cmsghdr *h = CMSG_FIRSTHDR(&m);
	h->cmsg_level = SOL_SOCKET;
	h->cmsg_type = SCM_RIGHTS;
	h->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(h), &fd, sizeof(int));
	if (sendmsg(sv[0], &m, 0) == 1) {
		m.msg_controllen = sizeof(u.b);
		if (recvmsg(sv[1], &m, MSG_CMSG_CLOEXEC) == 1 && (h = CMSG_FIRSTHDR(&m)) && h->cmsg_type == SCM_RIGHTS)
			memcpy(&got, CMSG_DATA(h), sizeof(int));
	}
	close(sv[0]);
	close(sv[1]);
	return got;
}

// alias makes copy i (1..ALIASES-1) of c's descriptor, each its own way.
static int alias(struct conn *c, int i)
{
	switch (i) {
	case 1:
		return c->alias[1] = dup(c->fd);
	case 2:
		return c->alias[2] = fcntl(c->fd, F_DUPFD_CLOEXEC, 64);
	default:
		return c->alias[3] = passed(c->fd);
	}
}

static int dial(const struct side *s)
{
	int fd = socket(s->addr.ss_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0)
		return -1;
	while (connect(fd, (const struct sockaddr *)&s->addr, s->addrlen) < 0) {
		if (errno != EINTR) {
			close(fd);
			return -1;
		}
	}
	return fd;
}

static int hello(struct conn *c)
{
	struct rec h = {.kind = K_HELLO};
	return send_rec(c, &h, NULL, K_WRITE, -1);
}

static int end(struct conn *c, uint64_t children)
{
	struct rec h = {.kind = K_END, .arg = c->sent, .aux = children};
	return send_rec(c, &h, NULL, K_SEND, -1);
}

// child_main is a forked helper: a connection of its own, a few records,
// END, and exit(3), so that whatever the process left to do at exit runs.
static void child_main(struct side *s, uint32_t k)
{
	static struct conn c; // the body buffer is too big for a forked thread's stack
	c = (struct conn){.rank = s->rank, .child = k, .rng = body_seed(s->rank, k, 0x6b6964)};
	c.fd = dial(s);
	int ok = c.fd >= 0 && hello(&c) == 0;
	int n = 1 + (int)(next_rand(&c.rng) % 8);
	for (int i = 0; ok && i < n; i++)
		ok = one_record(&c, s->file) == 0;
	ok = ok && end(&c, 0) == 0;
	if (!ok)
		fprintf(stderr, "sideio: rank %d child %u: %s\n", s->rank, k, strerror(errno));
	if (c.fd >= 0)
		close(c.fd);
	exit(ok ? 0 : 1);
}

// reap collects exited children: with wait, until all are gone or the
// deadline passes (then the rest are reported, killed and counted failed).
static void reap(struct side *s, int wait)
{
	struct timespec t0, now, tick = {0, 2 * 1000 * 1000};
	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (;;) {
		for (int i = 0; i < s->nkids;) {
			int st;
			pid_t p = waitpid(s->kids[i], &st, WNOHANG);
			if (p == 0) {
				i++;
				continue;
			}
			if (p < 0 && errno != ECHILD) {
				i++;
				continue;
			}
			if (p > 0 && !(WIFEXITED(st) && WEXITSTATUS(st) == 0)) {
				fprintf(stderr, "sideio: rank %d: child pid %d ended with status 0x%x\n", s->rank, (int)p, st);
				s->failed = 1;
			}
			s->kids[i] = s->kids[--s->nkids];
		}
		if (!wait || s->nkids == 0)
			return;
		clock_gettime(CLOCK_MONOTONIC, &now);
		if (now.tv_sec - t0.tv_sec >= 20) {
			for (int i = 0; i < s->nkids; i++) {
				fprintf(stderr, "sideio: rank %d: child pid %d has not exited after 20 s\n", s->rank,
					(int)s->kids[i]);
				kill(s->kids[i], SIGKILL);
				waitpid(s->kids[i], NULL, 0);
			}
			s->nkids = 0;
			s->failed = 1;
			return;
		}
		nanosleep(&tick, NULL);
	}
}

static int spawn(struct side *s)
{
	if (s->nkids == s->capkids) {
		int cap = s->capkids ? 2 * s->capkids : 64;
		pid_t *k = realloc(s->kids, (size_t)cap * sizeof(*k));
		if (!k)
			return -1;
		s->kids = k, s->capkids = cap;
	}
	uint32_t k = s->forked + 1;
	fflush(NULL); // a child's exit must not write the parent's buffered output again
	pid_t p = fork();
	if (p < 0)
		return -1;
	if (p == 0)
		child_main(s, k);
	s->forked = k;
	s->kids[s->nkids++] = p;
	return 0;
}

// ---- the server's stream back (-B) ----

// Byte off of rank's stream back is byte off%8 of word off/8, a 64-bit
// little-endian mix of the word's number: a byte found at the wrong offset
// shows which offset it belongs to (back_where).
static uint64_t back_seed(int rank)
{
	return mix64(0x6261636b73747265ULL + (uint64_t)rank);
}

static uint64_t back_word(uint64_t seed, uint64_t i)
{
	return mix64(seed + i);
}

// back_where says where n (1..16) bytes read at offset off belong in the
// stream: the first offset within 64 MiB past off where they occur.
static void back_where(uint64_t seed, uint64_t off, const unsigned char *got, size_t n, char *out, size_t outlen)
{
	uint64_t end = (off + (64u << 20)) / 8;
	for (uint64_t j = 0; j < end; j++) {
		unsigned char w[24];
		for (int k = 0; k < 3; k++) {
			uint64_t x = back_word(seed, j + (uint64_t)k);
			for (int b = 0; b < 8; b++)
				w[8 * k + b] = (unsigned char)(x >> (8 * b));
		}
		for (int a = 0; a < 8; a++) {
			if (memcmp(w + a, got, n) != 0)
				continue;
			uint64_t at = 8 * j + (uint64_t)a;
			if (at > off)
				snprintf(out, outlen, "they are bytes %" PRIu64 ".. of the stream: later bytes first, %" PRIu64 " bytes never read", at, at - off);
			else
				snprintf(out, outlen, "they are bytes %" PRIu64 ".. of the stream: earlier bytes again", at);
			return;
		}
	}
	snprintf(out, outlen, "they are not from the stream's first %" PRIu64 " bytes", 8 * end);
}

// raw_read reads with the kernel's own calls, alternately read and
// recvfrom, never the shim's wrappers: a stash the shim made of this
// socket's bytes stays where only a wrapped read would find it.
static ssize_t raw_read(int fd, unsigned char *b, size_t n, unsigned long k)
{
	if (k % 2 == 0)
		return syscall(SYS_read, fd, b, n);
	return syscall(SYS_recvfrom, fd, b, n, 0, NULL, NULL);
}

static void *back_main(void *arg)
{
	struct side *s = arg;
	static unsigned char buf[65536];
	uint64_t seed = back_seed(s->rank), off = 0, wi = UINT64_MAX, w = 0;
	struct timespec gap = {s->back_gap / 1000000, s->back_gap % 1000000 * 1000};
	for (unsigned long k = 0;; k++) {
		ssize_t got = raw_read(s->back_fd, buf, sizeof(buf), k);
		if (got == 0)
			break;
		if (got < 0 && errno == EINTR)
			continue;
		if (got < 0) {
			fprintf(stderr, "sideio: rank %d: back stream: read after %" PRIu64 " bytes: %s\n", s->rank, off,
				strerror(errno));
			s->back_failed = 1;
			break;
		}
		if (s->back_failed) {
			off += (uint64_t)got; // only counts, to the end of stream
			continue;
		}
		for (ssize_t i = 0; i < got; i++, off++) {
			if (off / 8 != wi)
				wi = off / 8, w = back_word(seed, wi);
			if (buf[i] == (unsigned char)(w >> (8 * (off % 8))))
				continue;
			char where[160];
			size_t n = (size_t)(got - i) < 16 ? (size_t)(got - i) : 16;
			back_where(seed, off, buf + i, n, where, sizeof(where));
			fprintf(stderr, "sideio: rank %d: back stream: byte %" PRIu64 " not as sent (read %zd bytes at %" PRIu64 "): %s\n",
				s->rank, off, got, off - (uint64_t)i, where);
			s->back_failed = 1;
			off += (uint64_t)(got - i);
			break;
		}
		if (s->back_gap > 0 && !s->back_failed)
			nanosleep(&gap, NULL);
	}
	s->back_bytes = off;
	return NULL;
}

static void *side_main(void *arg)
{
	struct side *s = arg;
	static struct conn c;
	c = (struct conn){.rank = s->rank, .rng = body_seed(s->rank, 0, 0x706172)};
	struct timespec gap = {s->gap_usec / 1000000, s->gap_usec % 1000000 * 1000};
	const char *what = "connect";
	pthread_t back_thread;
	int back = 0;
	c.fd = dial(s);
	if (c.fd < 0)
		goto fail;
	if (s->back_gap >= 0) {
		s->back_fd = c.fd;
		what = "back stream thread";
		if ((errno = pthread_create(&back_thread, NULL, back_main, s)) != 0)
			goto fail;
		back = 1;
		what = "connect";
	}
	c.alias[0] = c.fd;
	what = "copies of the descriptor";
	for (int i = 1; i < ALIASES; i++)
		if (alias(&c, i) < 0)
			goto fail;
	if (hello(&c) != 0)
		goto fail;
	what = "send";
	while (!atomic_load(&s->stop)) {
		if (one_record(&c, s->file) != 0)
			goto fail;
		if (c.seq % 16 == 0) {
			// A copy closed (its held bytes, if any, stay the
			// socket's) and made again.
			int i = 1 + (int)(next_rand(&c.rng) % (ALIASES - 1));
			close(c.alias[i]);
			what = "copies of the descriptor";
			if (alias(&c, i) < 0)
				goto fail;
			what = "send";
		}
		if (s->fork_every > 0 && c.seq % (uint64_t)s->fork_every == 0) {
			what = "fork";
			if (spawn(s) != 0)
				goto fail;
			what = "send";
		}
		reap(s, 0);
		if (s->gap_usec > 0)
			nanosleep(&gap, NULL);
	}
	what = "end";
	if (end(&c, s->forked) != 0 || shutdown(c.fd, SHUT_WR) != 0)
		goto fail;
	// The server closes once it has read everything up to our end of
	// stream: the parent's connection is known delivered.
	if (back) {
		pthread_join(back_thread, NULL);
		s->failed |= s->back_failed;
		goto done;
	}
	what = "read";
	for (char b[256];;) {
		ssize_t k = read(c.fd, b, sizeof(b));
		if (k == 0)
			break;
		if (k < 0 && errno == EINTR)
			continue;
		if (k < 0)
			goto fail;
		fprintf(stderr, "sideio: rank %d: the server sent %zd bytes\n", s->rank, k);
		s->failed = 1;
	}
done:
	for (int i = 1; i < ALIASES; i++)
		close(c.alias[i]);
	close(c.fd);
	reap(s, 1);
	s->records = c.seq, s->bytes = c.sent;
	return NULL;
fail:
	fprintf(stderr, "sideio: rank %d: side connection: %s: %s\n", s->rank, what, strerror(errno));
	s->failed = 1;
	if (back) {
		shutdown(c.fd, SHUT_RDWR); // the reader's end of stream
		pthread_join(back_thread, NULL);
	}
	if (c.fd >= 0)
		close(c.fd);
	reap(s, 1);
	return NULL;
}

static int resolve(const char *hostport, struct side *s)
{
	char host[256];
	const char *colon = strrchr(hostport, ':');
	if (!colon || (size_t)(colon - hostport) >= sizeof(host))
		return -1;
	memcpy(host, hostport, (size_t)(colon - hostport));
	host[colon - hostport] = '\0';
	struct addrinfo hints = {.ai_socktype = SOCK_STREAM}, *ai;
	if (getaddrinfo(host, colon + 1, &hints, &ai) != 0)
		return -1;
	memcpy(&s->addr, ai->ai_addr, ai->ai_addrlen);
	s->addrlen = ai->ai_addrlen;
	freeaddrinfo(ai);
	return 0;
}

// make_body writes the rank's sendfile body, FILE_SIZE bytes.
static int make_body(const char *dir, int rank)
{
	char path[4096];
	snprintf(path, sizeof(path), "%s/body.%d", dir, rank);
	unsigned char *b = malloc(FILE_SIZE);
	int fd = open(path, O_RDWR | O_CREAT | O_TRUNC | O_CLOEXEC, 0644);
	if (!b || fd < 0)
		return -1;
	fill(b, FILE_SIZE, file_seed(rank));
	for (size_t off = 0; off < FILE_SIZE;) {
		ssize_t k = pwrite(fd, b + off, FILE_SIZE - off, (off_t)off);
		if (k <= 0)
			return -1;
		off += (size_t)k;
	}
	free(b);
	return fd;
}

int main(int argc, char **argv)
{
	int iters = 10, expect_ranks = 0, c;
	size_t bytes = 64 << 10;
	const char *stop_dir = NULL, *server = NULL, *body_dir = "/tmp";
	long fork_every = 0, gap_usec = 0, back_gap = -1;
	while ((c = getopt(argc, argv, "n:s:E:H:D:F:z:k:B:x:")) != -1) {
		switch (c) {
		case 'n':
			iters = atoi(optarg);
			break;
		case 's':
			bytes = parse_size("sideio", optarg, 1ULL << 30);
			break;
		case 'E':
			stop_dir = optarg;
			break;
		case 'H':
			server = optarg;
			break;
		case 'D':
			body_dir = optarg;
			break;
		case 'F':
			fork_every = atol(optarg);
			break;
		case 'z':
			gap_usec = atol(optarg);
			break;
		case 'k':
			nways = 0;
			for (const char *k = optarg; *k && nways < 5; k++) {
				const char *all = "swvmf", *at = strchr(all, *k);
				if (!at) {
					fprintf(stderr, "sideio: -k: '%c' is none of %s\n", *k, all);
					return 2;
				}
				ways[nways++] = K_SEND + (int)(at - all);
			}
			if (nways == 0)
				return 2;
			break;
		case 'B':
			back_gap = atol(optarg);
			if (back_gap < 0)
				return 2;
			break;
		case 'x':
			expect_ranks = atoi(optarg);
			break;
		default:
			fprintf(stderr, "usage: sideio [-n iters] [-s bytes] [-E dir] [-H host:port] [-D dir] [-F records] "
					"[-z usec] [-k ways] [-B usec] [-x ranks]\n");
			return 2;
		}
	}
	if (optind != argc || iters < 1)
		return 2;
	if (expect_ranks > 0)
		return expect(expect_ranks, iters, bytes);

	MPI_Init(&argc, &argv);
	int rank, nranks;
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	MPI_Comm_size(MPI_COMM_WORLD, &nranks);

	static struct side s;
	pthread_t side_thread;
	s.rank = rank, s.fork_every = fork_every, s.gap_usec = gap_usec, s.back_gap = back_gap;
	if (server) {
		if (resolve(server, &s) != 0 || (s.file = make_body(body_dir, rank)) < 0) {
			fprintf(stderr, "sideio: rank %d: server %s or body in %s: %s\n", rank, server, body_dir,
				strerror(errno));
			MPI_Abort(MPI_COMM_WORLD, 1);
		}
		if (pthread_create(&side_thread, NULL, side_main, &s) != 0) {
			fprintf(stderr, "sideio: rank %d: no thread\n", rank);
			MPI_Abort(MPI_COMM_WORLD, 1);
		}
	}

	size_t cap = bytes / 4 * 5 + 8;
	unsigned char **sbuf = calloc((size_t)nranks, sizeof(*sbuf));
	unsigned char **rbuf = calloc((size_t)nranks, sizeof(*rbuf));
	MPI_Request *req = calloc(2 * (size_t)nranks, sizeof(*req));
	MPI_Status *st = calloc(2 * (size_t)nranks, sizeof(*st));
	if (!sbuf || !rbuf || !req || !st) {
		fprintf(stderr, "sideio: out of memory\n");
		MPI_Abort(MPI_COMM_WORLD, 1);
	}
	for (int p = 0; p < nranks; p++) {
		if (p == rank)
			continue;
		sbuf[p] = malloc(cap), rbuf[p] = malloc(cap);
		if (!sbuf[p] || !rbuf[p]) {
			fprintf(stderr, "sideio: out of memory\n");
			MPI_Abort(MPI_COMM_WORLD, 1);
		}
	}
	uint64_t state = initial_state(rank);
	int done = iters;
	for (int it = 0; it < iters; it++) {
		int n = 0;
		for (int src = 0; src < nranks; src++)
			if (rbuf[src])
				MPI_Irecv(rbuf[src], (int)msg_len(bytes, src, rank, it), MPI_BYTE, src, it, MPI_COMM_WORLD,
					  &req[n++]);
		for (int dst = 0; dst < nranks; dst++) {
			if (!sbuf[dst])
				continue;
			size_t len = msg_len(bytes, rank, dst, it);
			fill(sbuf[dst], len, seed_of(state, dst, it));
			MPI_Isend(sbuf[dst], (int)len, MPI_BYTE, dst, it, MPI_COMM_WORLD, &req[n++]);
		}
		MPI_Waitall(n, req, st);
		for (int src = 0; src < nranks; src++)
			if (rbuf[src])
				state = fold(state, rbuf[src], msg_len(bytes, src, rank, it));
		if (stop_dir && told_to_stop(stop_dir, rank)) {
			done = it + 1;
			break;
		}
	}

	int failed = 0;
	if (server) {
		atomic_store(&s.stop, 1);
		pthread_join(side_thread, NULL);
		failed = s.failed;
		char back[40] = "";
		if (back_gap >= 0)
			snprintf(back, sizeof(back), " back=%" PRIu64, s.back_bytes);
		printf("sideio rank=%d side records=%" PRIu64 " bytes=%" PRIu64 " children=%u%s%s\n", rank, s.records,
		       s.bytes, s.forked, back, failed ? " FAILED" : "");
		fflush(stdout);
	}
	uint64_t *all = rank == 0 ? calloc((size_t)nranks, sizeof(*all)) : NULL;
	MPI_Gather(&state, 1, MPI_UINT64_T, all, 1, MPI_UINT64_T, 0, MPI_COMM_WORLD);
	if (rank == 0)
		print_result(nranks, done, bytes, combine(all, nranks));
	MPI_Finalize();
	return failed;
}
