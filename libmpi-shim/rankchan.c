// SPDX-License-Identifier: Apache-2.0
//
// The rank channel: the shim's channel to the node's mpid (whose end is
// internal/ranks), one unix stream connection per rank, opened after
// MPI_Init, served by a thread of the shim. This file keeps the connection:
// it opens it, registers, and hangs up at MPI_Finalize; what the thread
// answers on it, and the drain it runs meanwhile, are rankserve.c's; the
// lines a rank registers with, the HELLO and the early JOIN, are built in
// rankhello.c.
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
#include "shim.h"
#include "rankchan.h"

#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <stdint.h>
#include <stddef.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/un.h>
#include <unistd.h>

int mpp_rankch_fd = -1;
static pthread_t rankch_thread;
static int have_thread;
static _Atomic int stopping; // MPI_Finalize closed the channel, not mpid
// mpp_rankch_fd changes when the channel is lost and made again (serve), while
// mpp_rankch_stop may hang it up from another thread.
static pthread_mutex_t rankch_mu = PTHREAD_MUTEX_INITIALIZER;
// Kept for registering again with a restarted mpid: the same HELLO and the
// same two pages, so the new mpid sees this rank exactly as the old one did.
static char *hello_line;
static int page_fd = -1, gate_fd = -1;
static int wake[2] = {-1, -1}; // mpp_rankch_stop ends the wait between attempts

void mpp_rankch_warn(const char *fmt, const char *arg)
{
	const char *q = getenv("MPIPAUSE_QUIET");
	if (q && *q && strcmp(q, "0") != 0)
		return;
	char line[512];
	int n = snprintf(line, sizeof(line), fmt, arg);
	if (n > 0)
		REAL(write)(2, line, (size_t)n < sizeof(line) ? (size_t)n : sizeof(line) - 1);
}

// mpp_rankch_addr fills in mpid's address: $MPIPAUSE_MPID_SOCKET (a path, or
// @name for an abstract socket), else /run/mpipause/rank.sock, whose
// directory only root may write. Whoever serves it, the shim talks only to
// root or to its own user (SO_PEERCRED, connect_mpid and the JOIN).
socklen_t mpp_rankch_addr(struct sockaddr_un *a, const char **name)
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

int mpp_rankch_send_line(const char *s)
{
	size_t n = strlen(s);
	while (n > 0) {
		ssize_t r = REAL(send)(mpp_rankch_fd, s, n, MSG_NOSIGNAL);
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
	int fds[2] = {pagefd, gatefd}, nfd = pagefd < 0 ? 0 : (gatefd < 0 ? 1 : 2);
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
		r = REAL(sendmsg)(mpp_rankch_fd, &m, MSG_NOSIGNAL);
	while (r < 0 && errno == EINTR);
	if (r < 0)
		return -1;
	if ((size_t)r < v.iov_len)
		return mpp_rankch_send_line(hello + r);
	return 0;
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
	mpp_rankch_fd = fd;
	pthread_mutex_unlock(&rankch_mu);
	if (send_hello(hello_line, page_fd, gate_fd) < 0) {
		*why = "mpipause: mpid at %s closed the connection; this rank runs without pause support\n";
		pthread_mutex_lock(&rankch_mu);
		mpp_rankch_fd = -1;
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
	socklen_t l = mpp_rankch_addr(&a, &name);
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
		mpp_rankch_serve(sigfd);
		if (atomic_load(&stopping))
			break;
		pthread_mutex_lock(&rankch_mu);
		REAL(close)(mpp_rankch_fd);
		mpp_rankch_fd = -1;
		pthread_mutex_unlock(&rankch_mu);
		if (atomic_load(&mpp_gate) != GATE_OPEN) {
			struct mpp_gate_stats st;
			mpp_gate_open(&st);
			mpp_rankch_warn("mpipause: lost mpid while paused; the send gate is open again (%s)\n", "the rank goes on");
		}
		if (again(sigfd) < 0)
			break;
	}
	return NULL;
}

// mpp_rankch_open opens the channel with the HELLO line hello.
void mpp_rankch_open(const char *hello)
{
	struct sockaddr_un a;
	const char *name, *why;
	socklen_t l = mpp_rankch_addr(&a, &name);

	mpp_rankch_drain_init();
	hello_line = strdup(hello);
	if (!hello_line || pipe2(wake, O_CLOEXEC | O_NONBLOCK) < 0) {
		mpp_rankch_warn("mpipause: out of resources (%s); this rank runs without pause support\n", strerror(errno));
		goto fail;
	}
	page_fd = mpp_state_page();
	gate_fd = page_fd >= 0 ? mpp_gate_page() : -1;
	if (connect_mpid(&a, l, &why) < 0) {
		mpp_rankch_warn(why, name);
		goto fail;
	}
	int sigfd = mpp_signals_install();
	if (pthread_create(&rankch_thread, NULL, serve, (void *)(intptr_t)sigfd) != 0) {
		mpp_signals_restore();
		mpp_rankch_warn("mpipause: cannot start the shim thread (%s); this rank runs without pause support\n",
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
	if (mpp_rankch_fd >= 0)
		REAL(close)(mpp_rankch_fd);
	mpp_rankch_fd = -1;
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
	if (mpp_rankch_fd >= 0)
		REAL(close)(mpp_rankch_fd);
	mpp_rankch_fd = -1;
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
	if (mpp_rankch_fd >= 0)
		REAL(shutdown)(mpp_rankch_fd, SHUT_RDWR);
	pthread_mutex_unlock(&rankch_mu);
	if (REAL(write)(wake[1], "", 1) < 0) {
		// The thread polls "stopping" at least once a second anyway.
	}
	pthread_join(rankch_thread, NULL);
	have_thread = 0;
	if (mpp_rankch_fd >= 0)
		REAL(close)(mpp_rankch_fd);
	mpp_rankch_fd = -1;
	if (atomic_load(&mpp_gate) != GATE_OPEN) {
		struct mpp_gate_stats st;
		mpp_gate_open(&st);
	}
}

// mpipause_test_rankch_start and mpipause_test_rankch_stop run the rank channel
// without MPI, for the C tests, which then play mpid's part on
// $MPIPAUSE_MPID_SOCKET.
EXPORT void mpipause_test_rankch_start(const char *hello)
{
	mpp_rankch_open(hello);
}

EXPORT void mpipause_test_rankch_stop(void)
{
	mpp_rankch_stop();
}
