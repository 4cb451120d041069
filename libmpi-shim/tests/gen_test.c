// SPDX-License-Identifier: Apache-2.0
//
// The shim's model-based torture test: random programs that reach one TCP
// socket by many routes (dup, dup2, dup3, fcntl F_DUPFD and
// F_DUPFD_CLOEXEC, a descriptor passed with SCM_RIGHTS, a stdio stream of
// fdopen) and write it by every call the shim wraps (send, sendto,
// sendmsg, sendmmsg, write, writev, pwritev2, sendfile, splice, fwrite,
// dprintf), a fork whose child writes too, and shutdown, with the gate
// closed and opened at random points. The model: the peer must read
// exactly the bytes each call reported written, in call order, whatever
// was held under the closed gate. Each call writes bytes of its own, so a
// reorder shows as the first byte that differs.
//
// Each seed also runs a receive program (run_recv_program): descriptors of
// one socket made by the same routes, the drain stashing through any of
// them at random points, reads through any of them, each byte checked
// against the stream the peer sent.
//
// Seeded and replayable: program i of a run with seed S is seeded S + i;
// a failure prints its seed, its calls, and the command that reruns it
// alone. Run with libmpipause.so preloaded (make -C libmpi-shim gen-test):
//   GEN_SEED (default: the time)  GEN_PROGRAMS (default 2000)  GEN_VERBOSE=1
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"
#include "check.h"

static void (*gate_close)(void);
static void (*gate_open)(struct mpp_gate_stats *);

enum {
	MAX_ALIASES = 8,
	MAX_OPS = 40,
	MAX_CHUNK = 1500,
	MAX_STREAM = MAX_OPS * MAX_CHUNK
};

// rng: xorshift64*, one state a program.
static uint64_t rng_state;
static uint64_t rnd(void)
{
	uint64_t x = rng_state;
	x ^= x >> 12;
	x ^= x << 25;
	x ^= x >> 27;
	rng_state = x;
	return x * 0x2545F4914F6CDD1DULL;
}
static unsigned pick(unsigned n)
{
	return (unsigned)(rnd() % n);
}

// A program's state: the descriptors that refer to the socket, the stream
// the model says the peer is owed, and the calls made (for the report).
static int alias[MAX_ALIASES], naliases;
static unsigned char owed[MAX_STREAM], got[MAX_STREAM + 1];
static size_t nowed;
static char trace[MAX_OPS * 96];
static size_t ntrace;
static int gate_closed, chunk_no;

static void note(const char *fmt, ...) __attribute__((format(printf, 1, 2)));
static void note(const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int n = vsnprintf(trace + ntrace, sizeof(trace) - ntrace, fmt, ap);
	va_end(ap);
	if (n > 0 && (size_t)n < sizeof(trace) - ntrace)
		ntrace += (size_t)n;
}

// chunk fills b with n bytes no other call of the program writes (its
// number, then a pattern of it).
static void chunk(unsigned char *b, size_t n)
{
	int c = ++chunk_no;
	for (size_t i = 0; i < n; i++)
		b[i] = (unsigned char)(c * 131 + i * 7 + (i >> 8));
}

// wrote adds what a call reported written to the stream the peer is owed.
static void wrote(const unsigned char *b, ssize_t r)
{
	if (r > 0) {
		memcpy(owed + nowed, b, (size_t)r);
		nowed += (size_t)r;
	}
}

static int any_alias(void)
{
	return alias[pick((unsigned)naliases)];
}

// fresh_number: a descriptor number not in use, for dup2 and dup3.
static int fresh_number(void)
{
	for (;;) {
		int n = 200 + (int)pick(300);
		if (fcntl(n, F_GETFD) < 0 && errno == EBADF)
			return n;
	}
}

// close_abort closes fd with a reset once its stream was checked: a
// program's pair then leaves no TIME_WAIT socket behind, and a run of many
// thousand programs does not take the machine's ephemeral ports (other
// tests bind port 0 after it).
static void close_abort(int fd)
{
	struct linger l = {.l_onoff = 1, .l_linger = 0};
	setsockopt(fd, SOL_SOCKET, SO_LINGER, &l, sizeof(l));
	close(fd);
}

static int pass_fd(int fd)
{
	int sv[2];
	if (socketpair(AF_UNIX, SOCK_STREAM, 0, sv) < 0)
		die("socketpair");
	char c = 'f', cb[CMSG_SPACE(sizeof(int))];
	struct iovec iov = {.iov_base = &c, .iov_len = 1};
	struct msghdr m = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = cb, .msg_controllen = sizeof(cb)};
	struct cmsghdr *h = CMSG_FIRSTHDR(&m);
	h->cmsg_level = SOL_SOCKET;
	h->cmsg_type = SCM_RIGHTS;
	h->cmsg_len = CMSG_LEN(sizeof(int));
	memcpy(CMSG_DATA(h), &fd, sizeof(int));
	if (sendmsg(sv[0], &m, 0) != 1)
		die("sendmsg SCM_RIGHTS");
	memset(cb, 0, sizeof(cb));
	m.msg_controllen = sizeof(cb);
	if (recvmsg(sv[1], &m, 0) != 1)
		die("recvmsg SCM_RIGHTS");
	h = CMSG_FIRSTHDR(&m);
	int nfd = -1;
	if (h && h->cmsg_type == SCM_RIGHTS)
		memcpy(&nfd, CMSG_DATA(h), sizeof(int));
	close(sv[0]);
	close(sv[1]);
	return nfd;
}

static void add_alias(int fd, const char *how)
{
	if (fd < 0)
		die(how);
	alias[naliases++] = fd;
	note("%s->%d ", how, fd);
}

// A program forks at most once: the child writes one chunk through its
// copy of a descriptor and exits. Two processes writing one socket have no
// order between them but what the shim keeps: the child's chunk must come
// whole, after every byte the parent had written (or had held) when it
// forked, and the parent's stream must be in order around it.
static pid_t child;
static unsigned char child_bytes[MAX_CHUNK];
static size_t child_len, child_after;
static int shut; // shutdown(SHUT_WR) was called: nothing more is owed

static void fork_writer(int fd)
{
	// Random bytes, not a chunk's pattern: a chunk's linear pattern also
	// occurs inside a longer chunk of another number, and the child's
	// bytes are looked for in the stream.
	size_t n = 16 + pick(MAX_CHUNK - 16);
	for (size_t i = 0; i < n; i++)
		child_bytes[i] = (unsigned char)rnd();
	child_after = nowed;
	child_len = n;
	child = fork();
	if (child < 0)
		die("fork");
	if (child == 0) {
		ssize_t r = write(fd, child_bytes, n);
		_exit(r == (ssize_t)n ? 0 : 1);
	}
	note("fork(%d writes %zu after byte %zu) ", fd, n, child_after);
}

// one_op makes one random call of the program.
static void one_op(void)
{
	static unsigned char b[MAX_CHUNK];
	size_t n = 1 + pick(MAX_CHUNK);
	int fd = any_alias(), flags = (int[]){0, MSG_NOSIGNAL, MSG_MORE, MSG_DONTWAIT, MSG_ZEROCOPY}[pick(5)];
	ssize_t r;
	unsigned op = pick(20);
	if (op >= 17)
		op = pick(8); // writes are the common case
	switch (op) {
	case 0:
		chunk(b, n);
		r = send(fd, b, n, flags);
		note("send(%d,%zu,%#x)=%zd ", fd, n, flags, r);
		wrote(b, r);
		break;
	case 1:
		chunk(b, n);
		r = sendto(fd, b, n, flags, NULL, 0);
		note("sendto(%d,%zu)=%zd ", fd, n, r);
		wrote(b, r);
		break;
	case 2: {
		chunk(b, n);
		struct iovec v[3];
		size_t k = 1 + pick(3), off = 0;
		for (size_t i = 0; i < k; i++) {
			size_t l = i == k - 1 ? n - off : pick((unsigned)(n - off + 1));
			v[i] = (struct iovec){.iov_base = b + off, .iov_len = l};
			off += l;
		}
		struct msghdr m = {.msg_iov = v, .msg_iovlen = k};
		// Sometimes with ancillary data a TCP socket takes: a
		// timestamping request (no flags: nothing is recorded).
		union {
			char b[CMSG_SPACE(sizeof(uint32_t))];
			struct cmsghdr align;
		} cb;
		int anc = pick(3) == 0;
		if (anc) {
			memset(&cb, 0, sizeof(cb));
			m.msg_control = cb.b;
			m.msg_controllen = sizeof(cb.b);
			struct cmsghdr *c = CMSG_FIRSTHDR(&m);
			c->cmsg_level = SOL_SOCKET;
			c->cmsg_type = SO_TIMESTAMPING;
			c->cmsg_len = CMSG_LEN(sizeof(uint32_t));
		}
		r = sendmsg(fd, &m, flags);
		note("sendmsg(%d,%zu iov,%zu%s)=%zd ", fd, k, n, anc ? ",cmsg" : "", r);
		wrote(b, r);
		break;
	}
	case 3: {
		chunk(b, n);
		size_t h = n / 2;
		struct iovec v[2] = {{.iov_base = b, .iov_len = h}, {.iov_base = b + h, .iov_len = n - h}};
		struct mmsghdr mm[2] = {{.msg_hdr = {.msg_iov = &v[0], .msg_iovlen = 1}},
					{.msg_hdr = {.msg_iov = &v[1], .msg_iovlen = 1}}};
		int k = sendmmsg(fd, mm, 2, flags);
		note("sendmmsg(%d,2,%zu)=%d ", fd, n, k);
		for (int i = 0; i < k; i++)
			wrote(i == 0 ? b : b + h, (ssize_t)mm[i].msg_len);
		break;
	}
	case 4:
		chunk(b, n);
		if (pick(3) == 0) {
			// dprintf: stdio's formatting straight to the descriptor
			// (text: no NUL to end the string early).
			for (size_t i = 0; i < n; i++)
				b[i] = (unsigned char)('a' + b[i] % 26);
			r = dprintf(fd, "%.*s", (int)n, (const char *)b);
			note("dprintf(%d,%zu)=%zd ", fd, n, r);
		} else {
			r = write(fd, b, n);
			note("write(%d,%zu)=%zd ", fd, n, r);
		}
		wrote(b, r);
		break;
	case 5: {
		chunk(b, n);
		size_t h = pick((unsigned)n + 1);
		struct iovec v[2] = {{.iov_base = b, .iov_len = h}, {.iov_base = b + h, .iov_len = n - h}};
		unsigned how = pick(4);
		if (how == 0) {
			r = writev(fd, v, 2);
			note("writev(%d,%zu)=%zd ", fd, n, r);
		} else {
			// At the position (-1): a writev on a socket; with a flag,
			// a call the gate passes behind what it holds.
			int rwf = how == 3 ? RWF_DSYNC : 0;
			r = pwritev2(fd, v, 2, -1, rwf);
			note("pwritev2(%d,%zu,-1,%#x)=%zd ", fd, n, rwf, r);
		}
		wrote(b, r);
		break;
	}
	case 6: {
		chunk(b, n);
		FILE *t = tmpfile();
		if (!t || fwrite(b, 1, n, t) != n || fflush(t) != 0)
			die("tmpfile");
		off_t off = 0;
		r = sendfile(fd, fileno(t), &off, n);
		note("sendfile(%d,%zu)=%zd ", fd, n, r);
		wrote(b, r);
		fclose(t);
		break;
	}
	case 7: {
		chunk(b, n);
		int p[2];
		if (pipe(p) < 0 || write(p[1], b, n) != (ssize_t)n)
			die("pipe");
		r = splice(p[0], NULL, fd, NULL, n, 0);
		note("splice(%d,%zu)=%zd ", fd, n, r);
		wrote(b, r);
		close(p[0]);
		close(p[1]);
		break;
	}
	case 8: {
		if (naliases == MAX_ALIASES)
			break;
		int how = (int)pick(6);
		switch (how) {
		case 0:
			add_alias(dup(fd), "dup");
			break;
		case 1:
			add_alias(dup2(fd, fresh_number()), "dup2");
			break;
		case 2:
			add_alias(dup3(fd, fresh_number(), O_CLOEXEC), "dup3");
			break;
		case 3:
			add_alias(fcntl(fd, F_DUPFD, 100), "F_DUPFD");
			break;
		case 4:
			add_alias(fcntl(fd, F_DUPFD_CLOEXEC, 100), "F_DUPFD_CLOEXEC");
			break;
		default:
			add_alias(pass_fd(fd), "SCM_RIGHTS");
			break;
		}
		break;
	}
	case 9: {
		if (naliases == 1)
			break;
		unsigned i = pick((unsigned)naliases);
		note("close(%d) ", alias[i]);
		close(alias[i]);
		alias[i] = alias[--naliases];
		break;
	}
	case 10: {
		// stdio through a stream of its own descriptor, closed with it.
		chunk(b, n);
		int d = dup(fd);
		FILE *f = d < 0 ? NULL : fdopen(d, "w");
		if (!f)
			die("fdopen");
		size_t w = fwrite(b, 1, n, f);
		int e = fflush(f);
		note("fwrite(dup %d of %d,%zu)=%zu,%d ", d, fd, n, w, e);
		if (e == 0)
			wrote(b, (ssize_t)w);
		fclose(f);
		break;
	}
	case 11:
	case 12:
		if (!gate_closed) {
			gate_close();
			gate_closed = 1;
			note("CLOSE-GATE ");
		}
		break;
	case 15:
		if (!child && !shut) {
			fork_writer(fd);
			break;
		}
		/* fall through */
	case 16:
		if (op == 16 && !shut && pick(4) == 0) {
			// The FIN follows what is held; every later write fails.
			r = shutdown(fd, SHUT_WR);
			note("shutdown(%d)=%zd ", fd, r);
			shut = r == 0;
			break;
		}
		/* fall through */
	default:
		if (gate_closed) {
			struct mpp_gate_stats st;
			gate_open(&st);
			gate_closed = 0;
			note("OPEN-GATE ");
		}
		break;
	}
}

// run_program runs the program of seed and checks the peer's stream.
static int run_program(uint64_t seed, int verbose)
{
	int s[2];
	rng_state = seed * 2654435761ULL + 0x9E3779B97F4A7C15ULL;
	if (!rng_state)
		rng_state = 1;
	nowed = ntrace = 0;
	chunk_no = 0;
	trace[0] = 0;
	child = 0;
	child_len = 0;
	shut = 0;
	tcp_pair(s, 0);
	alias[0] = s[0];
	naliases = 1;
	unsigned ops = 1 + pick(MAX_OPS);
	for (unsigned i = 0; i < ops; i++)
		one_op();
	if (gate_closed) {
		struct mpp_gate_stats st;
		gate_open(&st);
		gate_closed = 0;
		note("OPEN-GATE ");
	}
	for (int i = 0; i < naliases; i++)
		close(alias[i]);
	if (child) {
		int st = 0;
		if (waitpid(child, &st, 0) != child)
			die("waitpid");
		if (!WIFEXITED(st) || WEXITSTATUS(st) != 0)
			child_len = 0; // its write failed (after a shutdown): nothing owed
		note("child exit %d ", WIFEXITED(st) ? WEXITSTATUS(st) : -1);
	}
	size_t n = 0;
	for (;;) {
		struct pollfd p = {.fd = s[1], .events = POLLIN};
		if (poll(&p, 1, 10000) <= 0)
			break;
		ssize_t r = recv(s[1], got + n, sizeof(got) - n, 0);
		if (r <= 0)
			break;
		n += (size_t)r;
	}
	close_abort(s[1]); // the program's end, in FIN_WAIT2, goes with it
	if (child_len > 0) {
		// The child's chunk, whole, after what the parent owed at the fork.
		unsigned char *at = memmem(got, n, child_bytes, child_len);
		if (at && (size_t)(at - got) < child_after) {
			// Found before it may be: again from there, for a copy by chance.
			unsigned char *later = n > child_after ? memmem(got + child_after, n - child_after, child_bytes, child_len) : NULL;
			if (later)
				at = later;
		}
		if (!at || (size_t)(at - got) < child_after) {
			printf("FAIL seed %llu: the forked child's %zu bytes are %s (at byte %zd, the parent had written %zu)\n     calls: %s\n",
			       (unsigned long long)seed, child_len,
			       at ? "before bytes its parent wrote before the fork" : "not in the stream whole",
			       at ? (ssize_t)(at - got) : (ssize_t)-1, child_after, trace);
			return 1;
		}
		size_t p = (size_t)(at - got);
		memmove(at, at + child_len, n - p - child_len);
		n -= child_len;
	}
	size_t d = 0;
	while (d < n && d < nowed && got[d] == owed[d])
		d++;
	if (n == nowed && d == n) {
		if (verbose)
			printf("ok   seed %llu: %zu bytes: %s\n", (unsigned long long)seed, n, trace);
		return 0;
	}
	printf("FAIL seed %llu: the peer read %zu bytes, the program wrote %zu; first difference at byte %zu\n"
	       "     calls: %s\n",
	       (unsigned long long)seed, n, nowed, d, trace);
	if (getenv("GEN_DEBUG")) {
		unsigned char *c = child_len ? memmem(got, n, child_bytes, 16) : NULL;
		printf("     child's first 16 bytes at %zd; got[d..]:", c ? (ssize_t)(c - got) : (ssize_t)-1);
		for (size_t i = d; i < d + 8 && i < n; i++)
			printf(" %02x", got[i]);
		printf("; owed[d..]:");
		for (size_t i = d; i < d + 8 && i < nowed; i++)
			printf(" %02x", owed[i]);
		printf("\n");
	}
	return 1;
}

// The receive side: programs that read one socket by many descriptors
// (the same routes) while the drain stashes its bytes at random points
// through any of them (mpipause_test_stash, as the shim's thread does in
// a pause), and close descriptors. The model: the reads, in call order,
// get exactly the bytes the peer sent, each once; MSG_PEEK sees the next
// ones. The socket is non-blocking, so a read that bypassed the stash
// shows as EAGAIN while bytes are owed, not as a hang.
static ssize_t (*test_stash)(int, unsigned long);
static unsigned char sent[MAX_STREAM];
static size_t nsent, nread;

static int recv_check(const unsigned char *b, ssize_t r, int peek, const char *call, int fd)
{
	size_t owed_now = nsent - nread;
	if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
		if (owed_now == 0)
			return 0;
		// On loopback the peer's bytes are queued by the time its send
		// returns; a moment for the kernel all the same.
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (poll(&p, 1, 1000) > 0)
			return 0; // the next read will tell
		note("%s(%d): EAGAIN with %zu bytes owed ", call, fd, owed_now);
		return 1;
	}
	if (r < 0) {
		note("%s(%d): %s ", call, fd, strerror(errno));
		return 1;
	}
	if ((size_t)r > owed_now || memcmp(b, sent + nread, (size_t)r) != 0) {
		size_t d = 0;
		while (d < (size_t)r && nread + d < nsent && b[d] == sent[nread + d])
			d++;
		note("%s(%d)=%zd: differs at stream byte %zu ", call, fd, r, nread + d);
		return 1;
	}
	if (!peek)
		nread += (size_t)r;
	return 0;
}

// recv_op makes one random call of a receive program: 1 if the model saw
// a wrong byte.
static int recv_op(int peer)
{
	static unsigned char b[3 * MAX_CHUNK];
	int fd = any_alias();
	ssize_t r;
	size_t want = 1 + pick(sizeof(b));
	switch (pick(12)) {
	case 0:
	case 1: {
		size_t n = 1 + pick(MAX_CHUNK);
		if (nsent + n > sizeof(sent))
			return 0;
		chunk(sent + nsent, n);
		r = send(peer, sent + nsent, n, 0);
		note("peer(%zu)=%zd ", n, r);
		if (r != (ssize_t)n)
			die("peer send");
		nsent += n;
		return 0;
	}
	case 2:
	case 3:
		r = test_stash(fd, 0);
		note("STASH(%d)=%zd ", fd, r);
		return 0;
	case 4:
		r = read(fd, b, want);
		note("read(%d,%zu)=%zd ", fd, want, r);
		return recv_check(b, r, 0, "read", fd);
	case 5: {
		int peek = pick(3) == 0;
		r = recv(fd, b, want, peek ? MSG_PEEK : 0);
		note("recv(%d,%zu%s)=%zd ", fd, want, peek ? ",PEEK" : "", r);
		return recv_check(b, r, peek, "recv", fd);
	}
	case 6: {
		struct iovec v[2] = {{b, want / 2}, {b + want / 2, want - want / 2}};
		struct msghdr m = {.msg_iov = v, .msg_iovlen = 2};
		if (pick(2)) {
			r = recvmsg(fd, &m, 0);
			note("recvmsg(%d,%zu)=%zd ", fd, want, r);
			return recv_check(b, r, 0, "recvmsg", fd);
		}
		r = readv(fd, v, 2);
		note("readv(%d,%zu)=%zd ", fd, want, r);
		return recv_check(b, r, 0, "readv", fd);
	}
	case 7:
	case 8: {
		unsigned how = pick(6);
		int nfd = -1;
		if (naliases == MAX_ALIASES)
			return 0;
		switch (how) {
		case 0:
			nfd = dup(fd);
			break;
		case 1:
			nfd = dup2(fd, fresh_number());
			break;
		case 2:
			nfd = dup3(fd, fresh_number(), O_CLOEXEC);
			break;
		case 3:
			nfd = fcntl(fd, F_DUPFD, 100);
			break;
		case 4:
			nfd = fcntl(fd, F_DUPFD_CLOEXEC, 100);
			break;
		default:
			nfd = pass_fd(fd);
			break;
		}
		add_alias(nfd, (const char *[]){"dup", "dup2", "dup3", "F_DUPFD", "F_DUPFD_CLOEXEC", "SCM_RIGHTS"}[how]);
		return 0;
	}
	default: {
		if (naliases < 2)
			return 0;
		unsigned i = pick((unsigned)naliases);
		note("close(%d) ", alias[i]);
		close(alias[i]);
		alias[i] = alias[--naliases];
		return 0;
	}
	}
}

// run_recv_program runs the receive program of seed: 1 if it failed.
static int run_recv_program(uint64_t seed, int verbose)
{
	int s[2], bad = 0;
	static unsigned char b[MAX_STREAM];
	rng_state = seed * 2654435761ULL + 0x632BE59BD9B4E019ULL;
	if (!rng_state)
		rng_state = 1;
	nsent = nread = ntrace = 0;
	chunk_no = 0;
	trace[0] = 0;
	tcp_pair(s, 0);
	// s[1] reads here; s[0] is the peer.
	if (fcntl(s[1], F_SETFL, O_NONBLOCK) < 0)
		die("O_NONBLOCK");
	alias[0] = s[1];
	naliases = 1;
	unsigned ops = 1 + pick(MAX_OPS);
	for (unsigned i = 0; i < ops && !bad; i++)
		bad = recv_op(s[0]);
	// The rest, through any descriptor.
	for (int tries = 0; !bad && nread < nsent && tries < 1000; tries++) {
		int fd = any_alias();
		ssize_t r = recv(fd, b, sizeof(b), 0);
		note("recv(%d)=%zd ", fd, r);
		bad = recv_check(b, r, 0, "recv", fd);
	}
	if (!bad && nread < nsent) {
		note("end: %zu of %zu bytes read ", nread, nsent);
		bad = 1;
	}
	close_abort(s[0]);
	for (int i = 0; i < naliases; i++)
		close(alias[i]);
	if (!bad) {
		if (verbose)
			printf("ok   seed %llu (receive): %zu bytes: %s\n", (unsigned long long)seed, nsent, trace);
		return 0;
	}
	printf("FAIL seed %llu (receive): the program read %zu of %zu bytes in order, then:\n"
	       "     calls: %s\n",
	       (unsigned long long)seed, nread, nsent, trace);
	return 1;
}

// env is the variable's value, NULL if unset or empty (make passes its
// unset variables as empty).
static const char *env(const char *name)
{
	const char *v = getenv(name);
	return v && *v ? v : NULL;
}

int main(void)
{
	gate_close = (void (*)(void))dlsym(RTLD_DEFAULT, "mpipause_gate_close");
	gate_open = (void (*)(struct mpp_gate_stats *))dlsym(RTLD_DEFAULT, "mpipause_gate_open");
	test_stash = (ssize_t(*)(int, unsigned long))dlsym(RTLD_DEFAULT, "mpipause_test_stash");
	if (!gate_close || !gate_open || !test_stash) {
		fprintf(stderr, "FAIL: libmpipause.so is not preloaded (run: make -C libmpi-shim gen-test)\n");
		return 1;
	}
	signal(SIGPIPE, SIG_IGN);
	setvbuf(stdout, NULL, _IOLBF, 0);
	const char *e = env("GEN_SEED");
	uint64_t seed = e ? strtoull(e, NULL, 10) : (uint64_t)time(NULL);
	e = env("GEN_PROGRAMS");
	long programs = e ? atol(e) : 2000;
	int verbose = env("GEN_VERBOSE") != NULL, failed = 0;
	for (long i = 0; i < programs; i++) {
		int f = run_program(seed + (uint64_t)i, verbose);
		f |= run_recv_program(seed + (uint64_t)i, verbose);
		if (f && ++failed == 1)
			printf("     rerun: make -C libmpi-shim gen-test GEN_SEED=%llu GEN_PROGRAMS=1 GEN_VERBOSE=1\n",
			       (unsigned long long)(seed + (uint64_t)i));
	}
	printf("%s %ld programs from seed %llu: %d failed\n", failed ? "FAIL" : "ok  ", programs,
	       (unsigned long long)seed, failed);
	return failed ? 1 : 0;
}
