// SPDX-License-Identifier: Apache-2.0
//
// The rank channel: the shim's channel to the node's mpid (whose end is
// internal/ranks), one unix stream connection per rank, opened after
// MPI_Init, served by a thread of the shim. Every line the shim sends on it
// is written here: mpi.c gives the HELLO's values (mpp_rankch_start), the
// constructor asks for the JOIN (mpp_rankch_join).
//
// Its lines (JOIN, HELLO, the requests, this thread's answers and the
// unasked EVENTs) are listed once, in internal/ranks/doc.go, the package
// comment of mpid's parser; a change to a line changes that list.
//
// mpid checks the HELLO's pid against the connection's SO_PEERCRED; the
// shim checks that mpid runs as root or as the rank's own user.
//
// Without an mpid the program runs exactly as without the shim, after one
// line on stderr (MPIPAUSE_QUIET=1 silences it). If mpid goes away while
// the gate is closed, the gate reopens: a job is never left stuck. The
// shim then registers again, with the same HELLO and pages, as soon as an
// mpid answers (attempts back off to one a second).
//
// Before all that, from the library's constructor, a rank of a job that
// names itself (MPIPAUSE_JOBID) asks mpid once, with a JOIN on a connection
// of its own, to move it into the job's cgroup (mpp_rankch_join): the
// kernel charges a socket to the cgroup of the process that creates it, at
// creation, for good, and mpid watches a job's sockets by cgroup, so a rank
// must be in the job's cgroup before MPI_Init opens its sockets.
#include "shim.h"
#include "req.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stddef.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <netinet/in.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

static int rankch_fd = -1;
static pthread_t rankch_thread;
static int have_thread;
static _Atomic int stopping; // MPI_Finalize closed the channel, not mpid
// rankch_fd changes when the channel is lost and made again (serve), while
// mpp_rankch_stop may hang it up from another thread.
static pthread_mutex_t rankch_mu = PTHREAD_MUTEX_INITIALIZER;
// Kept for registering again with a restarted mpid: the same HELLO and the
// same two pages, so the new mpid sees this rank exactly as the old one did.
static char *hello_line;
static int page_fd = -1, gate_fd = -1;
static int wake[2] = {-1, -1}; // mpp_rankch_stop ends the wait between attempts

static void warn(const char *fmt, const char *arg)
{
	const char *q = getenv("MPIPAUSE_QUIET");
	if (q && *q && strcmp(q, "0") != 0)
		return;
	char line[512];
	int n = snprintf(line, sizeof(line), fmt, arg);
	if (n > 0)
		REAL(write)(2, line, (size_t)n < sizeof(line) ? (size_t)n : sizeof(line) - 1);
}

// sock_addr fills in mpid's address: $MPIPAUSE_MPID_SOCKET (a path, or
// @name for an abstract socket), else /run/mpipause/rank.sock, whose
// directory only root may write. Whoever serves it, the shim talks only to
// root or to its own user (SO_PEERCRED, connect_mpid and the JOIN).
static socklen_t sock_addr(struct sockaddr_un *a, const char **name)
{
	const char *p = getenv("MPIPAUSE_MPID_SOCKET");
	size_t n;

	if (!p || !*p)
		p = "/run/mpipause/rank.sock";
	*name = p;
	memset(a, 0, sizeof(*a));
	a->sun_family = AF_UNIX;
	n = strlen(p);
	if (n >= sizeof(a->sun_path))
		n = sizeof(a->sun_path) - 1;
	memcpy(a->sun_path, p, n);
	if (p[0] == '@') {
		a->sun_path[0] = 0; // abstract: no terminating NUL counted
		return (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n);
	}
	return (socklen_t)sizeof(*a);
}

static int send_line(const char *s)
{
	size_t n = strlen(s);
	while (n > 0) {
		ssize_t r = REAL(send)(rankch_fd, s, n, MSG_NOSIGNAL);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return -1;
		s += r;
		n -= r;
	}
	return 0;
}

// send_hello sends the HELLO line with the state page's fd and the gate
// page's fd attached (SCM_RIGHTS), those there are (the gate page only
// with the state page); mpid maps the state page read-only, the gate page
// read-write. The fds stay open here, for a restarted mpid.
static int send_hello(const char *hello, int pagefd, int gatefd)
{
	struct iovec v = {(void *)hello, strlen(hello)};
	union {
		char buf[CMSG_SPACE(2 * sizeof(int))];
		struct cmsghdr align;
	} u;
	struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1};
	int fds[2] = {pagefd, gatefd}, nfd = pagefd < 0 ? 0 : gatefd < 0 ? 1 : 2;
	ssize_t r;

	if (nfd > 0) {
		memset(&u, 0, sizeof(u));
		m.msg_control = u.buf;
		m.msg_controllen = CMSG_SPACE(nfd * sizeof(int));
		struct cmsghdr *c = CMSG_FIRSTHDR(&m);
		c->cmsg_level = SOL_SOCKET;
		c->cmsg_type = SCM_RIGHTS;
		c->cmsg_len = CMSG_LEN(nfd * sizeof(int));
		memcpy(CMSG_DATA(c), fds, nfd * sizeof(int));
	}
	do
		r = REAL(sendmsg)(rankch_fd, &m, MSG_NOSIGNAL);
	while (r < 0 && errno == EINTR);
	if (r < 0)
		return -1;
	if ((size_t)r < v.iov_len)
		return send_line(hello + r);
	return 0;
}

static const char *gate_name(int g)
{
	return g == GATE_OPEN ? "open" : g == GATE_CLOSED ? "closed" : "flushing";
}

static void state_line(char *b, size_t n, const char *verb)
{
	struct mpp_gate_stats st;
	mpp_gate_state(&st);
	snprintf(b, n, "%s gate=%s gated=%u closing=%u held=%lu\n", verb, gate_name(st.gate), st.gated, st.closing,
		 st.held);
}

// The receive-side drain (DRAIN): the sockets of the process that mpid
// named, by their kernel cookies, as the job's own connections (the other
// end a rank of the same job), as found by the last DRAIN; this thread
// watches them while the gate stays closed. A socket mpid did not name (a
// database client, a monitoring connection of the program's own) is never
// drained: the program may read it with a call the shim does not wrap, and
// its bytes must stay in the kernel, in order. Listening sockets are left
// out (their "readable" is a connection waiting), and a socket that reports
// readable with nothing to move (end of stream, an error) is dropped from
// the set, so the wait cannot spin.
#define DRAIN_MAX 4096 // sockets of this process watched
// MPIPAUSE_RECV_DRAIN=0 turns the drain off, for a program that reads its
// sockets other than through the wrapped calls (io_uring, splice): its
// stashed bytes would be skipped. Its pauses then wait for its ranks to read.
static int drain_disabled;
static struct pollfd drain_fds[DRAIN_MAX];
// The inode of each socket found: the application may close one and get
// its number back as another file while the drain still watches it.
static ino_t drain_ino[DRAIN_MAX];
static unsigned char drain_skip[DRAIN_MAX];
static int drain_n;
// drain_socks counts the sockets among them: descriptors of one socket
// share its stash (stash.c), and each is watched.
static uint64_t drain_ck[DRAIN_MAX];
static int drain_socks;
// The set of the DRAIN being read: "DRAIN <n>" and then n cookies in
// COOKIES lines ("C <hex> ..."), sorted once complete.
static uint64_t drain_set[MPP_DRAIN_MAX];
static long set_want, set_have;
static int collecting;
// full_told: "EVENT stash full" went for this drain already.
static int full_told;

static int cmp_cookie(const void *a, const void *b)
{
	uint64_t x = *(const uint64_t *)a, y = *(const uint64_t *)b;
	return x < y ? -1 : x > y;
}

static int in_set(uint64_t c)
{
	return set_have > 0 && bsearch(&c, drain_set, (size_t)set_have, sizeof(c), cmp_cookie) != NULL;
}

static void drain_scan(void)
{
	DIR *d = opendir("/proc/self/fd");
	drain_n = drain_socks = 0;
	if (!d)
		return;
	struct dirent *e;
	while ((e = readdir(d)) && drain_n < DRAIN_MAX) {
		char *end;
		long fd = strtol(e->d_name, &end, 10);
		int v = 0, dom = 0, lst = 1;
		uint64_t ck = 0;
		socklen_t l = sizeof(v);
		if (*end || e->d_name[0] == '.' || fd == dirfd(d) || fd == rankch_fd)
			continue;
		if (getsockopt((int)fd, SOL_SOCKET, SO_PROTOCOL, &v, &l) < 0 || v != IPPROTO_TCP)
			continue;
		l = sizeof(dom);
		if (getsockopt((int)fd, SOL_SOCKET, SO_DOMAIN, &dom, &l) < 0 || (dom != AF_INET && dom != AF_INET6))
			continue;
		l = sizeof(lst);
		if (getsockopt((int)fd, SOL_SOCKET, SO_ACCEPTCONN, &lst, &l) < 0 || lst)
			continue;
		if ((ck = mpp_sock_cookie((int)fd)) == 0 || !in_set(ck))
			continue;
		struct stat st;
		if (fstat((int)fd, &st) < 0)
			continue;
		int seen = 0;
		for (int i = 0; i < drain_n && !seen; i++)
			seen = drain_ck[i] == ck;
		drain_socks += !seen;
		drain_ck[drain_n] = ck;
		drain_skip[drain_n] = 0;
		drain_ino[drain_n] = st.st_ino;
		drain_fds[drain_n++] = (struct pollfd){.fd = (int)fd, .events = POLLIN};
	}
	closedir(d);
}

// drain_pass stashes what waits on every watched socket: the bytes moved.
static ssize_t drain_pass(void)
{
	ssize_t total = 0;
	for (int i = 0; i < drain_n; i++)
		if (drain_fds[i].fd >= 0) {
			ssize_t m = mpp_stash_fd(drain_fds[i].fd, drain_ino[i]);
			if (m > 0)
				total += m;
			drain_skip[i] = m < 0;
		}
	return total;
}

static int draining(void)
{
	return drain_n > 0 && GATE_STATE(atomic_load(&mpp_gate)) == GATE_CLOSED;
}

// full_check stops the drain once the stash is full (MPIPAUSE_STASH_MAX_MB)
// and tells mpid, once per DRAIN, which rank's stash it was: the pause
// cannot empty the kernel's queues then, and must fail saying why rather
// than wait for its deadline. -1 if the channel failed.
static int full_check(void)
{
	char out[128];
	if (!mpp_stash_full(0) || full_told)
		return 0;
	full_told = 1;
	drain_n = 0; // the bytes stay in the kernel
	snprintf(out, sizeof(out), "EVENT stash full bytes=%zu max=%zu\n", mpp_stash_bytes(), mpp_stash_max());
	return send_line(out);
}

// drain_start answers a DRAIN whose set is complete: unless the drain is
// disabled or the gate is not closed, the sockets it names
// are scanned and drained a first time.
static void drain_start(char *out, size_t n)
{
	collecting = 0;
	if (drain_disabled) {
		snprintf(out, n, "DRAINING disabled\n");
		return;
	}
	if (GATE_STATE(atomic_load(&mpp_gate)) != GATE_CLOSED) {
		snprintf(out, n, "DRAINING off\n");
		return;
	}
	qsort(drain_set, (size_t)set_have, sizeof(drain_set[0]), cmp_cookie);
	mpp_stash_full(1);
	full_told = 0;
	drain_scan();
	ssize_t stashed = drain_pass();
	snprintf(out, n, "DRAINING sockets=%d stashed=%zd\n", drain_socks, stashed);
}

// answer serves one request line of mpid: -1 if the channel failed.
static int answer(char *line, size_t n, void *arg)
{
	char out[256];
	long gen;
	(void)arg;
	enum mpp_req req = mpp_parse_request(line, n, &gen);
	if (collecting && req != MPP_REQ_COOKIES) {
		// A set cut short: the DRAIN gets its one answer, and drains
		// nothing, before this request is served.
		collecting = 0;
		set_have = 0;
		drain_n = 0;
		if (send_line("ERROR drain set cut short\n") < 0)
			return -1;
	}
	switch (req) {
	case MPP_REQ_REOPEN: {
		// The answer goes before the flush: the rank runs again as soon as
		// the gate lets sends through (held bytes first), and a resume need
		// not wait for MiBs to be read by the peers. The flush's outcome
		// follows. "REOPEN <gen>" reopens only that generation's close (mpid
		// may have flipped the word already, or closed it again since).
		struct mpp_gate_stats st;
		int f = mpp_gate_flushing(gen);
		if (send_line(f < 0 ? "REOPENED stale\n" : "REOPENED\n") < 0)
			return -1;
		if (f < 0)
			return 0;
		mpp_gate_flush(&st, f);
		snprintf(out, sizeof(out), "EVENT flushed bytes=%lu errors=%u errno=%d\n", st.flushed, st.flush_errors,
			 st.flush_errno);
		break;
	}
	case MPP_REQ_BAD_GEN:
		snprintf(out, sizeof(out), "ERROR bad generation\n");
		break;
	case MPP_REQ_DRAIN:
		set_want = gen;
		set_have = 0;
		if (gen > 0) {
			collecting = 1; // answered once the set is complete
			return 0;
		}
		drain_start(out, sizeof(out));
		break;
	case MPP_REQ_COOKIES: {
		uint64_t ck[MPP_COOKIES_LINE];
		int k = mpp_parse_cookies(line, n, ck);
		if (!collecting)
			return 0; // nobody waits for an answer to a stray line
		if (k < 0 || k > set_want - set_have) {
			collecting = 0;
			set_have = 0;
			drain_n = 0;
			snprintf(out, sizeof(out), "ERROR bad drain set\n");
			break;
		}
		memcpy(drain_set + set_have, ck, (size_t)k * sizeof(ck[0]));
		set_have += k;
		if (set_have < set_want)
			return 0;
		drain_start(out, sizeof(out));
		break;
	}
	case MPP_REQ_BAD_DRAIN:
		snprintf(out, sizeof(out), "ERROR bad drain set\n");
		break;
	case MPP_REQ_CLOSE:
		mpp_gate_close();
		state_line(out, sizeof(out), "CLOSED");
		break;
	case MPP_REQ_STATE:
		state_line(out, sizeof(out), "STATE");
		break;
	case MPP_REQ_OPEN: {
		struct mpp_gate_stats st;
		mpp_gate_open(&st);
		snprintf(out, sizeof(out), "OPENED flushed=%lu errors=%u errno=%d\n", st.flushed, st.flush_errors,
			 st.flush_errno);
		break;
	}
	default:
		snprintf(out, sizeof(out), "ERROR unknown request\n");
	}
	if (send_line(out) < 0)
		return -1;
	return full_check();
}

// serve_conn answers mpid's requests and passes the signals the handler
// saw on as unsolicited "EVENT pause at=<ns>" / "EVENT resume at=<ns>" lines, until the
// channel ends.
static void serve_conn(int sigfd)
{
	char buf[256];
	size_t have = 0;

	for (;;) {
		struct pollfd p[2 + DRAIN_MAX] = {{.fd = rankch_fd, .events = POLLIN}, {.fd = sigfd, .events = POLLIN}};
		nfds_t np = 2;
		int ms = -1;
		if (!draining()) {
			drain_n = 0;
		} else {
			memcpy(p + 2, drain_fds, (size_t)drain_n * sizeof(*p));
			np += (nfds_t)drain_n;
			// A socket an application thread was reading is looked at
			// again in a millisecond rather than polled: it may stay
			// readable until that thread's read returns.
			for (int i = 0; i < drain_n; i++)
				if (drain_skip[i]) {
					p[2 + i].events = 0;
					drain_skip[i] = 0;
					ms = 1;
				}
		}
		if (sigfd < 0)
			p[1].fd = -1;
		// The real poll: the wrapped one reports stashed sockets readable,
		// which here would spin.
		int ready = REAL(poll)(p, np, ms);
		if (ready < 0) {
			if (errno == EINTR)
				continue;
			break;
		}
		for (nfds_t i = 2; i < np; i++) {
			if (ms > 0 && p[i].events == 0) {
				p[i].revents = POLLIN; // skipped last time: try again
			}
			if (p[i].revents & POLLNVAL) {
				// Closed by the application: polled again, it would
				// answer at once, for ever.
				drain_fds[i - 2].fd = -1;
				continue;
			}
			if (!(p[i].revents & (POLLIN | POLLHUP | POLLERR)))
				continue;
			ssize_t m = mpp_stash_fd(p[i].fd, drain_ino[i - 2]);
			if (m < 0)
				drain_skip[i - 2] = 1;
			else if (m == 0)
				drain_fds[i - 2].fd = -1; // readable with nothing to move: end of stream or an error
		}
		if (full_check() < 0)
			goto gone;
		if (sigfd >= 0 && (p[1].revents & POLLIN)) {
			struct mpp_sig rec;
			char out[128];
			while (REAL(read)(sigfd, &rec, sizeof(rec)) == (ssize_t)sizeof(rec)) {
				// at=0: the clock failed in the handler; mpid then takes
				// the request as it comes.
				if (rec.sig == 'U')
					snprintf(out, sizeof(out), "EVENT unheld call=%s fd=%d cookie=%llx\n",
						 rec.call == MPP_UNHELD_ANCILLARY  ? "sendmsg-ancillary"
						 : rec.call == MPP_UNHELD_ZEROCOPY ? "msg-zerocopy"
						 : rec.call == MPP_UNHELD_PWRITEV2 ? "pwritev2-flags"
										   : "msg-fastopen",
						 (int)rec.fd, (unsigned long long)rec.ns);
				else if (rec.ns > 0)
					snprintf(out, sizeof(out), "EVENT %s at=%lld\n", rec.sig == 'T' ? "pause" : "resume",
						 (long long)rec.ns);
				else
					snprintf(out, sizeof(out), "EVENT %s\n", rec.sig == 'T' ? "pause" : "resume");
				if (send_line(out) < 0)
					goto gone;
			}
		}
		if (!(p[0].revents & (POLLIN | POLLHUP | POLLERR)))
			continue;
		ssize_t r = REAL(recv)(rankch_fd, buf + have, sizeof(buf) - 1 - have, 0);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			break;
		ssize_t left = mpp_each_line(buf, have + (size_t)r, answer, NULL);
		if (left < 0)
			goto gone;
		have = (size_t)left;
		if (have == sizeof(buf) - 1)
			break; // a line longer than any request: not mpid
	}
gone:
	// Hang up, so that mpid (or whatever spoke) sees the channel end.
	REAL(shutdown)(rankch_fd, SHUT_RDWR);
}

// connect_mpid opens a channel to mpid at a, checks who serves it and
// registers (HELLO): the fd, or -1 with why in why.
static int connect_mpid(const struct sockaddr_un *a, socklen_t l, const char **why)
{
	struct ucred cr;
	socklen_t cl = sizeof(cr);
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);

	*why = "mpipause: no mpid at %s; this rank runs without pause support\n";
	if (fd < 0 || connect(fd, (const struct sockaddr *)a, l) < 0)
		goto fail;
	*why = "mpipause: %s is not served by root or by this user; not registering\n";
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) < 0 || (cr.uid != 0 && cr.uid != getuid()))
		goto fail;
	pthread_mutex_lock(&rankch_mu);
	rankch_fd = fd;
	pthread_mutex_unlock(&rankch_mu);
	if (send_hello(hello_line, page_fd, gate_fd) < 0) {
		*why = "mpipause: mpid at %s closed the connection; this rank runs without pause support\n";
		pthread_mutex_lock(&rankch_mu);
		rankch_fd = -1;
		pthread_mutex_unlock(&rankch_mu);
		goto fail;
	}
	return fd;
fail:
	if (fd >= 0)
		REAL(close)(fd);
	return -1;
}

// again waits for a restarted mpid and registers with it: 0 once it has,
// -1 if the rank stopped first. Attempts back off to one a second; a
// signal seen meanwhile has nobody to be told to.
static int again(int sigfd)
{
	struct sockaddr_un a;
	const char *name, *why;
	socklen_t l = sock_addr(&a, &name);
	int ms = 50;

	for (;;) {
		struct pollfd p[2] = {{.fd = wake[0], .events = POLLIN}, {.fd = sigfd, .events = POLLIN}};
		int r = REAL(poll)(p, sigfd >= 0 ? 2 : 1, ms);
		if (atomic_load(&stopping) || (r > 0 && (p[0].revents & POLLIN)))
			return -1;
		if (r > 0 && (p[1].revents & POLLIN)) {
			char c;
			while (REAL(read)(sigfd, &c, 1) == 1)
				;
		}
		if (r != 0)
			continue;
		if (connect_mpid(&a, l, &why) >= 0)
			return 0;
		ms = ms < 1000 ? ms * 2 : 1000;
	}
}

// serve runs the channel; when mpid goes away it reopens a closed gate (a
// job is never left stuck) and registers again with the next mpid, which
// finds the job's cgroup and this rank's pages as they were.
static void *serve(void *arg)
{
	int sigfd = (int)(intptr_t)arg;

	for (;;) {
		serve_conn(sigfd);
		if (atomic_load(&stopping))
			break;
		pthread_mutex_lock(&rankch_mu);
		REAL(close)(rankch_fd);
		rankch_fd = -1;
		pthread_mutex_unlock(&rankch_mu);
		if (atomic_load(&mpp_gate) != GATE_OPEN) {
			struct mpp_gate_stats st;
			mpp_gate_open(&st);
			warn("mpipause: lost mpid while paused; the send gate is open again (%s)\n", "the rank goes on");
		}
		if (again(sigfd) < 0)
			break;
	}
	return NULL;
}

// start opens the channel with the HELLO line hello.
static void start(const char *hello)
{
	struct sockaddr_un a;
	const char *name, *why;
	socklen_t l = sock_addr(&a, &name);

	const char *rd = getenv("MPIPAUSE_RECV_DRAIN");
	drain_disabled = rd != NULL && strcmp(rd, "0") == 0;
	hello_line = strdup(hello);
	if (!hello_line || pipe2(wake, O_CLOEXEC | O_NONBLOCK) < 0) {
		warn("mpipause: out of resources (%s); this rank runs without pause support\n", strerror(errno));
		goto fail;
	}
	page_fd = mpp_state_page();
	gate_fd = page_fd >= 0 ? mpp_gate_page() : -1;
	if (connect_mpid(&a, l, &why) < 0) {
		warn(why, name);
		goto fail;
	}
	int sigfd = mpp_signals_install();
	if (pthread_create(&rankch_thread, NULL, serve, (void *)(intptr_t)sigfd) != 0) {
		mpp_signals_restore();
		warn("mpipause: cannot start the shim thread (%s); this rank runs without pause support\n",
		     strerror(errno));
		goto fail;
	}
	have_thread = 1;
	// A restarted mpid counts the processes that run a thread of this name
	// among the ranks it waits for to register again; the name grants
	// nothing (a process names its own threads).
	pthread_setname_np(rankch_thread, MPP_RANKCH_THREAD_NAME);
	return;
fail:
	if (rankch_fd >= 0)
		REAL(close)(rankch_fd);
	rankch_fd = -1;
}

// mpp_hello_value: a value of the HELLO is one token without ',' or '='
// (the hosts list's separator, the fields'), whatever the host or the
// environment named.
void mpp_hello_value(char *s)
{
	for (; *s; s++)
		if (*s <= ' ' || *s == ',' || *s == '=')
			*s = '_';
}

// put appends v (at most max bytes; -1: all of it) at n of the line b,
// made a value the line can carry; the line's new length.
static int put(char *b, size_t len, int n, const char *v, int max)
{
	int at = n;
	n += snprintf(b + n, len - n, "%.*s", max, v);
	mpp_hello_value(b + at);
	return n;
}

// HELLO_ROOM holds a HELLO without its hosts list: the id, the numbers, two
// host names and the key.
#define HELLO_ROOM (256 + 2 * MPP_HOST_MAX + MPP_KEY_MAX)

// mpp_rankch_start registers this rank with what mpi.c learnt at MPI_Init:
//   HELLO 2 job=<id> rank=<r> size=<n> pid=<pid> host=<name>[ key=<job key>][ root=<h>][ hosts=<h0,h1,...>]
// (hosts: rank 0's list of the distinct hosts, in rank order of first
// appearance). Without h, the MPI library's ABI is unknown and the HELLO
// says only that much: the rank is still gateable.
void mpp_rankch_start(const struct mpp_hello *h)
{
	char small[HELLO_ROOM], *line = small;
	size_t len = sizeof(small);
	const char *key = mpp_job_key();
	int n;

	if (!h) {
		start("HELLO 2 job=unknown rank=-1 size=0\n");
		return;
	}
	if (h->hosts) {
		// Room for every host: a truncated list would leave nodes out of
		// every pause (mpid would refuse, short of ranks).
		size_t big = sizeof(small) + (size_t)h->size * (MPP_HOST_MAX + 1);
		char *b = malloc(big);
		if (b)
			line = b, len = big;
	}
	n = snprintf(line, len, "HELLO 2 job=");
	n = put(line, len, n, h->job, -1);
	n += snprintf(line + n, len - n, " rank=%d size=%d pid=%d host=", h->rank, h->size, (int)getpid());
	n = put(line, len, n, h->host, -1);
	if (key)
		n += snprintf(line + n, len - n, " key=%s", key);
	if (h->root[0]) {
		n += snprintf(line + n, len - n, " root=");
		n = put(line, len, n, h->root, -1);
	}
	if (h->hosts) {
		n += snprintf(line + n, len - n, " hosts=");
		int first = 1;
		for (int i = 0; i < h->size && (size_t)n < len - MPP_HOST_MAX - 2; i++) {
			const char *x = h->hosts + (size_t)i * MPP_HOST_MAX;
			int seen = 0;
			for (int j = 0; j < i && !seen; j++)
				seen = strncmp(x, h->hosts + (size_t)j * MPP_HOST_MAX, MPP_HOST_MAX) == 0;
			if (seen)
				continue;
			if (!first)
				n += snprintf(line + n, len - n, ",");
			n = put(line, len, n, x, MPP_HOST_MAX);
			first = 0;
		}
	}
	snprintf(line + n, len - n, "\n");
	start(line);
	if (line != small)
		free(line);
}

// mpp_rankch_child: a forked child is not a rank (mpid speaks to its parent)
// and has no thread of the shim: its copy of the rank channel is closed, so
// that mpid sees the channel close when the parent's does, and nothing of
// the child's reaches mpid as the parent's. The shim's thread may have
// held rankch_mu at the fork.
void mpp_rankch_child(void)
{
	pthread_mutex_init(&rankch_mu, NULL);
	have_thread = 0;
	if (rankch_fd >= 0)
		REAL(close)(rankch_fd);
	rankch_fd = -1;
	for (int i = 0; i < 2; i++) {
		if (wake[i] >= 0)
			REAL(close)(wake[i]);
		wake[i] = -1;
	}
}

// mpp_rankch_stop unregisters: mpid sees the connection close. The gate is
// opened first so that nothing stays held past MPI_Finalize.
void mpp_rankch_stop(void)
{
	if (!have_thread)
		return;
	atomic_store(&stopping, 1);
	mpp_signals_restore();
	pthread_mutex_lock(&rankch_mu);
	if (rankch_fd >= 0)
		REAL(shutdown)(rankch_fd, SHUT_RDWR);
	pthread_mutex_unlock(&rankch_mu);
	if (REAL(write)(wake[1], "", 1) < 0) {
		// The thread polls "stopping" at least once a second anyway.
	}
	pthread_join(rankch_thread, NULL);
	have_thread = 0;
	if (rankch_fd >= 0)
		REAL(close)(rankch_fd);
	rankch_fd = -1;
	if (atomic_load(&mpp_gate) != GATE_OPEN) {
		struct mpp_gate_stats st;
		mpp_gate_open(&st);
	}
}

// mpp_valid_jobid: a job id is one token of 1 to MPP_JOBID_MAX printable
// ASCII characters other than '=', ',' and '/', and not "." or "..": the
// rule of internal/jobid.Valid (',' because HELLO turns it into '_',
// '/' and the dot names because the id names a cgroup directory).
int mpp_valid_jobid(const char *id)
{
	size_t n = 0;

	if (!strcmp(id, ".") || !strcmp(id, ".."))
		return 0;
	for (; id[n]; n++) {
		unsigned char c = (unsigned char)id[n];
		if (n >= MPP_JOBID_MAX || c <= ' ' || c >= 0x7f || c == '=' || c == ',' || c == '/')
			return 0;
	}
	return n > 0;
}

// mpp_job_key is the job key the launcher gave this rank (MPIPAUSE_JOBKEY:
// a secret that makes mpid let the rank into its job; docs/security.md),
// or NULL if there is none or it could not travel in a line (1 to
// MPP_KEY_MAX printable characters, no spaces, no '=').
const char *mpp_job_key(void)
{
	const char *k = getenv("MPIPAUSE_JOBKEY");
	size_t n = 0;

	if (!k)
		return NULL;
	for (; k[n]; n++) {
		unsigned char c = (unsigned char)k[n];
		if (n >= MPP_KEY_MAX || c <= ' ' || c >= 0x7f || c == '=')
			return NULL;
	}
	return n > 0 ? k : NULL;
}

// mpp_join_line writes "JOIN 2 job=<id> pid=<pid> key=<key>\n" into b and
// returns its length; -1 if id is not a valid job id, there is no key or b
// is too small.
int mpp_join_line(char *b, size_t n, const char *id, long pid, const char *key)
{
	if (!id || !mpp_valid_jobid(id) || pid <= 0 || !key)
		return -1;
	int r = snprintf(b, n, "JOIN 2 job=%s pid=%ld key=%s\n", id, pid, key);
	return r > 0 && (size_t)r < n ? r : -1;
}

// ms_left is what remains of a deadline on CLOCK_MONOTONIC, in ms (>= 0).
static int ms_left(const struct timespec *end)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	long ms = (end->tv_sec - now.tv_sec) * 1000 + (end->tv_nsec - now.tv_nsec) / 1000000;
	return ms < 0 ? 0 : ms > JOIN_TIMEOUT_MAX_S * 1000 ? JOIN_TIMEOUT_MAX_S * 1000 : (int)ms;
}

// join_timeout_s is how long the JOIN waits for mpid's answer, in seconds.
// The first JOIN of a job on a node has mpid load the job's BPF programs
// before it answers, so that no socket of the rank is made unseen: tens of
// ms on a node, over 2 s on a VM under software emulation (docs/vagrant.md).
static int join_timeout_s(void)
{
	const char *v = getenv("MPIPAUSE_JOIN_TIMEOUT");
	char *end;
	long s;

	if (!v || !*v)
		return JOIN_TIMEOUT_S;
	errno = 0;
	s = strtol(v, &end, 10);
	if (errno || *end || s < 1 || s > JOIN_TIMEOUT_MAX_S) {
		char msg[160];
		snprintf(msg, sizeof(msg), "MPIPAUSE_JOIN_TIMEOUT=%.32s is not a number of seconds from 1 to %d; waiting %d s",
			 v, JOIN_TIMEOUT_MAX_S, JOIN_TIMEOUT_S);
		warn("mpipause: %s\n", msg);
		return JOIN_TIMEOUT_S;
	}
	return (int)s;
}

// wait_fd polls fd for ev until the deadline: 1 ready, 0 timed out, -1 error.
static int wait_fd(int fd, short ev, const struct timespec *end)
{
	for (;;) {
		struct pollfd p = {.fd = fd, .events = ev};
		int r = REAL(poll)(&p, 1, ms_left(end));
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return r;
		return (p.revents & ev) ? 1 : (p.revents & (POLLERR | POLLHUP | POLLNVAL)) ? -1 : 0;
	}
}

// join asks mpid at a to move this process into the job's cgroup. It
// returns 0 on OK, else -1 with why (one line, no newline) in why.
static int join(const char *line, const struct sockaddr_un *a, socklen_t al, const char *name, char *why, size_t wn)
{
	struct timespec end;
	struct ucred cr;
	socklen_t cl = sizeof(cr);
	char reply[256];
	size_t have = 0, len = strlen(line), sent = 0;
	int fd, rc = -1, timeout = join_timeout_s();

	clock_gettime(CLOCK_MONOTONIC, &end);
	end.tv_sec += timeout;
	// Non-blocking throughout: connect to a listener whose backlog is full
	// would otherwise block without bound.
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0) {
		snprintf(why, wn, "no socket: %s", strerror(errno));
		return -1;
	}
	if (connect(fd, (const struct sockaddr *)a, al) < 0) {
		snprintf(why, wn, "nothing answers at %s: %s", name, strerror(errno));
		goto out;
	}
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) < 0 || (cr.uid != 0 && cr.uid != getuid())) {
		snprintf(why, wn, "%s is not served by root or by this user", name);
		goto out;
	}
	while (sent < len) {
		ssize_t r = REAL(send)(fd, line + sent, len - sent, MSG_NOSIGNAL);
		if (r > 0) {
			sent += (size_t)r;
			continue;
		}
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 && errno == EAGAIN && wait_fd(fd, POLLOUT, &end) > 0)
			continue;
		snprintf(why, wn, "mpid at %s did not take the request", name);
		goto out;
	}
	for (;;) {
		char *nl = memchr(reply, '\n', have);
		if (nl) {
			*nl = 0;
			break;
		}
		if (have == sizeof(reply) - 1) {
			snprintf(why, wn, "mpid at %s answered a line too long", name);
			goto out;
		}
		ssize_t r = REAL(recv)(fd, reply + have, sizeof(reply) - 1 - have, 0);
		if (r > 0) {
			have += (size_t)r;
			continue;
		}
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 && errno == EAGAIN) {
			int w = wait_fd(fd, POLLIN, &end);
			if (w > 0)
				continue;
			if (w == 0) {
				snprintf(why, wn, "no answer from mpid at %s within %d s", name, timeout);
				goto out;
			}
		}
		snprintf(why, wn, "mpid at %s closed the connection without an answer", name);
		goto out;
	}
	// What mpid says is printed: keep it to printable characters.
	for (char *p = reply; *p; p++)
		if ((unsigned char)*p < ' ' || (unsigned char)*p == 0x7f)
			*p = '?';
	if (strcmp(reply, "OK") == 0)
		rc = 0;
	else if (strncmp(reply, "ERR ", 4) == 0)
		snprintf(why, wn, "mpid at %s refused: %s", name, reply + 4);
	else
		snprintf(why, wn, "mpid at %s answered %.64s", name, reply);
out:
	REAL(close)(fd);
	return rc;
}

// mpp_rankch_join runs from the library's constructor: a rank of a job named
// by MPIPAUSE_JOBID asks the node's mpid to move it into the job's cgroup
// before it creates any socket. No mpid, no answer in time, or a
// refusal: one warning line, and the process goes on as it would have.
void mpp_rankch_join(void)
{
	const char *id = getenv("MPIPAUSE_JOBID");
	const char *key = mpp_job_key();
	char line[MPP_JOBID_MAX + MPP_KEY_MAX + 56], why[320];
	struct sockaddr_un a;
	const char *name;
	int saved = errno;

	if (!id || !*id || !mpp_is_rank())
		return;
	if (!key) {
		warn("mpipause: this rank has no job key (MPIPAUSE_JOBKEY): launch the job with `mpipause run`; "
		     "this rank could not join its job's cgroup, so %s\n",
		     "the job will not be pausable cleanly");
		goto out;
	}
	if (mpp_join_line(line, sizeof(line), id, (long)getpid(), key) < 0) {
		warn("mpipause: MPIPAUSE_JOBID is not a valid job id (1 to 128 printable characters, no spaces, no '='); "
		     "this rank could not join its job's cgroup, so %s\n",
		     "the job will not be pausable cleanly");
		goto out;
	}
	socklen_t al = sock_addr(&a, &name);
	if (join(line, &a, al, name, why, sizeof(why)) < 0)
		warn("mpipause: this rank could not join its job's cgroup (%s); the job will not be pausable cleanly\n",
		     why);
out:
	errno = saved;
}

// mpipause_test_rankch_start and mpipause_test_rankch_stop run the rank channel
// without MPI, for the C tests, which then play mpid's part on
// $MPIPAUSE_MPID_SOCKET.
EXPORT void mpipause_test_rankch_start(const char *hello)
{
	start(hello);
}

EXPORT void mpipause_test_rankch_stop(void)
{
	mpp_rankch_stop();
}
