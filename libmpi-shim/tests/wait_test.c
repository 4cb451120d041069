// SPDX-License-Identifier: Apache-2.0
//
// C tests of the wrapped waits (waits.h) over loopback TCP, run with
// libmpipause.so preloaded (make -C libmpi-shim test). Bytes are moved
// into an fd's stash as the shim's thread does during a pause
// (mpipause_test_stash); the kernel then holds nothing for the fd, and
// only the shim can tell an event loop that it is readable.
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <netinet/in.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/ioctl.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/syscall.h>
// Debian 11's glibc 2.31 predates epoll_pwait2 (Linux 5.11): its number on
// every architecture.
#ifndef SYS_epoll_pwait2
#define SYS_epoll_pwait2 441
#endif
#if __GLIBC_PREREQ(2, 35)
#define HAVE_PWAIT2 1
#else
// Nor the call (glibc 2.35), which no program of such a system makes: its
// cases are left out (the shim's own passes it to a libc that has none).
#define HAVE_PWAIT2 0
#include <signal.h>
#include <sys/epoll.h>
#include <time.h>
__attribute__((weak)) int epoll_pwait2(int epfd, struct epoll_event *events, int maxevents,
				       const struct timespec *timeout, const sigset_t *sigmask);
#endif
#include <time.h>
#include <unistd.h>

#include "check.h"

static ssize_t (*stash)(int fd, unsigned long ino);
static int (*wake_signal)(void);
static unsigned long (*idle_yields)(void);
static void (*gate_close)(void);
static void (*gate_open)(void *);

static void close_pair(int s[2])
{
	close(s[0]);
	close(s[1]);
}

static double now(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return t.tv_sec + t.tv_nsec / 1e9;
}

static void pause_ms(int ms)
{
	struct timespec t = {ms / 1000, (ms % 1000) * 1000000L};
	nanosleep(&t, NULL);
}

// queued waits (bounded, 5 s) until fd's receive queue holds n bytes.
static int queued(int fd, int n)
{
	double end = now() + 5;
	int q = 0;
	while (now() < end) {
		ioctl(fd, FIONREAD, &q);
		if (q >= n)
			return q;
		pause_ms(1);
	}
	return q;
}

// send_stash sends n bytes of c from s[0] and moves them into s[1]'s
// stash; the kernel then holds nothing for s[1]. Returns bytes stashed.
static ssize_t send_stash(int s[2], int n, char c)
{
	char b[4096];
	memset(b, c, sizeof(b));
	if (send(s[0], b, n, 0) != n || queued(s[1], n) < n)
		return -1;
	ssize_t r = stash(s[1], 0);
	int q = -1;
	ioctl(s[1], FIONREAD, &q);
	return q == 0 ? r : -1;
}

// take reads n bytes, all c, from fd.
static int take(int fd, int n, char c)
{
	char b[4096];
	int got = 0;
	while (got < n) {
		ssize_t r = recv(fd, b, sizeof(b) < (size_t)(n - got) ? sizeof(b) : (size_t)(n - got), MSG_DONTWAIT);
		if (r <= 0)
			return got;
		for (ssize_t i = 0; i < r; i++)
			if (b[i] != c)
				return -1;
		got += r;
	}
	return got;
}

static int ep_add(int ep, int fd, uint32_t events, uint64_t data)
{
	struct epoll_event e = {.events = events, .data.u64 = data};
	return epoll_ctl(ep, EPOLL_CTL_ADD, fd, &e);
}

// Stashed bytes make poll, ppoll, select and pselect report the fd at once
// (a 5 s timeout must not be waited), and recv then gets those bytes.
static void test_poll_select(void)
{
	int s[2];
	tcp_pair(s, 0);
	struct pollfd p = {.fd = s[1], .events = POLLIN};
	CHECK(poll(&p, 1, 0) == 0, "nothing sent, nothing ready");
	ssize_t n = send_stash(s, 100, 'a');
	CHECK(n == 100, "stashed %zd, want 100 and an empty receive queue", n);

	p.revents = 0;
	int r = poll(&p, 1, 0);
	CHECK(r == 1 && (p.revents & POLLIN), "poll(0) = %d revents %#x", r, p.revents);
	double t0 = now();
	p.revents = 0;
	r = poll(&p, 1, 5000);
	CHECK(r == 1 && (p.revents & POLLIN) && now() - t0 < 1, "poll(5000) = %d revents %#x after %.3f s", r,
	      p.revents, now() - t0);
	struct pollfd q = {.fd = s[1], .events = POLLRDNORM};
	r = poll(&q, 1, 0);
	CHECK(r == 1 && q.revents == POLLRDNORM, "poll(POLLRDNORM) = %d revents %#x", r, q.revents);
	q.events = POLLOUT;
	r = poll(&q, 1, 0);
	CHECK(r == 1 && !(q.revents & POLLIN), "POLLOUT only: %d revents %#x (no POLLIN asked)", r, q.revents);
	struct timespec five = {5, 0};
	sigset_t all;
	sigfillset(&all);
	p.revents = 0;
	r = ppoll(&p, 1, &five, &all);
	CHECK(r == 1 && (p.revents & POLLIN), "ppoll = %d revents %#x", r, p.revents);

	fd_set rd, wr;
	FD_ZERO(&rd);
	FD_SET(s[1], &rd);
	struct timeval tv = {5, 0};
	t0 = now();
	r = select(s[1] + 1, &rd, NULL, NULL, &tv);
	CHECK(r == 1 && FD_ISSET(s[1], &rd) && now() - t0 < 1, "select = %d after %.3f s", r, now() - t0);
	// Readable and writable: two bits, a count of 2, as the kernel's.
	FD_ZERO(&rd);
	FD_ZERO(&wr);
	FD_SET(s[1], &rd);
	FD_SET(s[1], &wr);
	tv.tv_sec = 0;
	r = select(s[1] + 1, &rd, &wr, NULL, &tv);
	CHECK(r == 2 && FD_ISSET(s[1], &rd) && FD_ISSET(s[1], &wr), "select(rd+wr) = %d", r);
	FD_ZERO(&rd);
	FD_SET(s[1], &rd);
	r = pselect(s[1] + 1, &rd, NULL, NULL, &five, &all);
	CHECK(r == 1 && FD_ISSET(s[1], &rd), "pselect = %d", r);

	CHECK(take(s[1], 100, 'a') == 100, "recv did not give the 100 stashed bytes");
	p.revents = 0;
	r = poll(&p, 1, 0);
	CHECK(r == 0, "stash read: poll(0) = %d revents %#x", r, p.revents);
	close_pair(s);
}

// epoll, level-triggered: every wait reports the stashed fd, with the
// application's epoll_data, until it is read.
static void test_epoll_lt(void)
{
	int s[2], ep = epoll_create1(EPOLL_CLOEXEC);
	struct epoll_event ev[4];
	tcp_pair(s, 0);
	CHECK(ep_add(ep, s[1], EPOLLIN, 0xfeed0001) == 0, "epoll_ctl: %s", strerror(errno));
	CHECK(send_stash(s, 10, 'b') == 10, "stash");
	for (int i = 0; i < 3; i++) {
		int r = epoll_wait(ep, ev, 4, i == 2 ? 5000 : 0);
		CHECK(r == 1 && ev[0].data.u64 == 0xfeed0001 && (ev[0].events & EPOLLIN),
		      "wait %d: %d events, data %#llx events %#x", i, r, (unsigned long long)ev[0].data.u64,
		      ev[0].events);
	}
	struct timespec zero = {0, 0};
	int r = HAVE_PWAIT2 ? epoll_pwait2(ep, ev, 4, &zero, NULL) : epoll_wait(ep, ev, 4, 0);
	CHECK(r == 1 && ev[0].data.u64 == 0xfeed0001, "epoll_pwait2: %d", r);
	CHECK(take(s[1], 10, 'b') == 10, "recv");
	r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 0, "after the read: %d events", r);
	// DEL: forgotten.
	CHECK(send_stash(s, 10, 'c') == 10, "stash");
	CHECK(epoll_ctl(ep, EPOLL_CTL_DEL, s[1], NULL) == 0, "DEL");
	r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 0, "DEL'd fd reported: %d", r);
	CHECK(take(s[1], 10, 'c') == 10, "recv");
	close(ep);
	close_pair(s);
}

// epoll, EPOLLET: once per stash edge; a re-arm (MOD) reports it once more.
static void test_epoll_et(void)
{
	int s[2], ep = epoll_create1(0);
	struct epoll_event ev[4];
	tcp_pair(s, 0);
	CHECK(ep_add(ep, s[1], EPOLLIN | EPOLLET, 0xe7) == 0, "epoll_ctl");
	CHECK(send_stash(s, 10, 'd') == 10, "stash");
	int r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 1 && ev[0].data.u64 == 0xe7, "first wait: %d", r);
	r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 0, "same edge reported again: %d", r);
	r = epoll_wait(ep, ev, 4, 100);
	CHECK(r == 0, "same edge reported again (blocking): %d", r);
	struct epoll_event m = {.events = EPOLLIN | EPOLLET, .data.u64 = 0xe8};
	CHECK(epoll_ctl(ep, EPOLL_CTL_MOD, s[1], &m) == 0, "MOD");
	r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 1 && ev[0].data.u64 == 0xe8, "after MOD: %d data %#llx", r, (unsigned long long)ev[0].data.u64);
	CHECK(take(s[1], 10, 'd') == 10, "recv");
	// A new edge: empty, then bytes again.
	CHECK(send_stash(s, 20, 'e') == 20, "stash");
	r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 1 && ev[0].data.u64 == 0xe8, "second edge: %d", r);
	r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 0, "second edge twice: %d", r);
	CHECK(take(s[1], 20, 'e') == 20, "recv");
	close(ep);
	close_pair(s);
}

// epoll, EPOLLONESHOT: once until re-armed, whether the report was the
// shim's or the kernel's, and bytes reaching the kernel meanwhile do not
// make the kernel report it a second time.
static void test_epoll_oneshot(void)
{
	int s[2], ep = epoll_create1(0);
	struct epoll_event ev[4], m = {.events = EPOLLIN | EPOLLONESHOT, .data.u64 = 0x05};
	tcp_pair(s, 0);
	CHECK(epoll_ctl(ep, EPOLL_CTL_ADD, s[1], &m) == 0, "epoll_ctl");
	CHECK(send_stash(s, 10, 'f') == 10, "stash");
	int r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 1 && ev[0].data.u64 == 0x05, "first: %d", r);
	r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 0, "not re-armed, reported again: %d", r);
	char b[8] = "gggggggg";
	CHECK(send(s[0], b, 8, 0) == 8 && queued(s[1], 8) == 8, "send");
	r = epoll_wait(ep, ev, 4, 50);
	CHECK(r == 0, "kernel bytes, not re-armed, reported: %d", r);
	CHECK(epoll_ctl(ep, EPOLL_CTL_MOD, s[1], &m) == 0, "MOD");
	r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 1 && ev[0].data.u64 == 0x05, "re-armed (kernel + stash, one event): %d", r);
	r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 0, "again: %d", r);
	CHECK(take(s[1], 10, 'f') == 10 && take(s[1], 8, 'g') == 8, "recv");

	// The kernel reported it (no stash then), then bytes are stashed.
	CHECK(epoll_ctl(ep, EPOLL_CTL_MOD, s[1], &m) == 0, "MOD");
	CHECK(send(s[0], b, 8, 0) == 8 && queued(s[1], 8) == 8, "send");
	r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 1, "kernel's report: %d", r);
	CHECK(stash(s[1], 0) == 8, "stash");
	r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 0, "kernel disarmed it, the shim reported it: %d", r);
	CHECK(take(s[1], 8, 'g') == 8, "recv");
	close(ep);
	close_pair(s);
}

// Three receivers: A has bytes in the kernel only, B in its stash only, C
// in both. Every wait reports each once, with the right count, and a
// maxevents of 2 gives 2 distinct events and then, A and C read, B.
static void test_mix(void)
{
	int a[2], b[2], c[2], ep = epoll_create1(0);
	struct epoll_event ev[8];
	char x[8] = "kkkkkkkk";
	tcp_pair(a, 0);
	tcp_pair(b, 0);
	tcp_pair(c, 0);
	CHECK(ep_add(ep, a[1], EPOLLIN, 'A') == 0 && ep_add(ep, b[1], EPOLLIN, 'B') == 0 &&
		      ep_add(ep, c[1], EPOLLIN | EPOLLOUT, 'C') == 0,
	      "epoll_ctl");
	CHECK(send_stash(b, 10, 'k') == 10 && send_stash(c, 10, 'k') == 10, "stash");
	CHECK(send(a[0], x, 8, 0) == 8 && send(c[0], x, 8, 0) == 8 && queued(a[1], 8) == 8 && queued(c[1], 8) == 8,
	      "send");

	int r = epoll_wait(ep, ev, 8, 0), seen = 0;
	for (int i = 0; i < r; i++) {
		int bit = 1 << (ev[i].data.u64 - 'A');
		CHECK(!(seen & bit), "duplicate event for %c", (char)ev[i].data.u64);
		seen |= bit;
		if (ev[i].data.u64 == 'C')
			CHECK((ev[i].events & (EPOLLIN | EPOLLOUT)) == (EPOLLIN | EPOLLOUT), "C: events %#x",
			      ev[i].events);
	}
	CHECK(r == 3 && seen == 7, "epoll: %d events, set %#x", r, seen);

	// A and C stay ready in the kernel: B must still get a slot.
	int gotb = 0;
	for (int k = 0; k < 3; k++) {
		r = epoll_wait(ep, ev, 2, 0);
		CHECK(r == 2 && ev[0].data.u64 != ev[1].data.u64, "maxevents 2: %d events", r);
		gotb |= ev[0].data.u64 == 'B' || ev[1].data.u64 == 'B';
	}
	CHECK(gotb, "maxevents 2: the stashed fd starved behind two kernel-ready ones");
	r = epoll_wait(ep, ev, 1, 1000);
	CHECK(r == 1, "maxevents 1: %d events", r);

	struct pollfd p[4] = {{a[1], POLLIN, 0}, {b[1], POLLIN, 0}, {c[1], POLLIN, 0}, {c[1], POLLIN, 0}};
	r = poll(p, 4, 1000);
	CHECK(r == 4 && p[0].revents && p[1].revents && p[2].revents && p[3].revents, "poll: %d", r);

	fd_set rd;
	FD_ZERO(&rd);
	FD_SET(a[1], &rd);
	FD_SET(b[1], &rd);
	FD_SET(c[1], &rd);
	int nfds = a[1] > b[1] ? a[1] : b[1];
	nfds = (nfds > c[1] ? nfds : c[1]) + 1;
	r = select(nfds, &rd, NULL, NULL, NULL);
	CHECK(r == 3 && FD_ISSET(a[1], &rd) && FD_ISSET(b[1], &rd) && FD_ISSET(c[1], &rd), "select: %d", r);

	CHECK(take(a[1], 8, 'k') == 8 && take(c[1], 18, 'k') == 18, "recv A and C");
	r = epoll_wait(ep, ev, 8, 0);
	CHECK(r == 2, "A, C read: %d events", r); // B, and C writable
	CHECK(take(b[1], 10, 'k') == 10, "recv B");
	close(ep);
	close_pair(a);
	close_pair(b);
	close_pair(c);
}

// Many stashed fds and a small maxevents: every fd is reported within a
// few waits (none starves), never more than maxevents at once.
static void test_maxevents(void)
{
	enum {
		N = 6
	};
	int s[N][2], ep = epoll_create1(0), seen = 0;
	struct epoll_event ev[2];
	for (int i = 0; i < N; i++) {
		tcp_pair(s[i], 0);
		CHECK(ep_add(ep, s[i][1], EPOLLIN, (uint64_t)i) == 0, "epoll_ctl");
		CHECK(send_stash(s[i], 5, 'm') == 5, "stash");
	}
	for (int k = 0; k < N; k++) {
		int r = epoll_wait(ep, ev, 2, 0);
		CHECK(r == 2 && ev[0].data.u64 != ev[1].data.u64, "%d events", r);
		for (int i = 0; i < r; i++)
			seen |= 1 << ev[i].data.u64;
	}
	CHECK(seen == (1 << N) - 1, "reported %#x of %#x", seen, (1 << N) - 1);
	for (int i = 0; i < N; i++) {
		CHECK(take(s[i][1], 5, 'm') == 5, "recv");
		close_pair(s[i]);
	}
	close(ep);
}

// A closed fd's registration is not reported for the next socket that gets
// its number; a dup of the epoll fd shares its set.
static void test_reuse_dup(void)
{
	int s[2], t[2], ep = epoll_create1(0);
	struct epoll_event ev[4];
	tcp_pair(s, 0);
	int fd = s[1];
	CHECK(ep_add(ep, s[1], EPOLLIN, 0xdead) == 0, "epoll_ctl");
	int ep2 = dup(ep);
	CHECK(send_stash(s, 5, 'r') == 5, "stash");
	int r = epoll_wait(ep2, ev, 4, 0);
	CHECK(r == 1 && ev[0].data.u64 == 0xdead, "through the dup: %d", r);
	CHECK(take(s[1], 5, 'r') == 5, "recv");
	close(ep2);
	close_pair(s);
	tcp_pair(t, 0);
	if (t[1] != fd && t[0] == fd) { // the sender got the number: swap roles
		int x = t[0];
		t[0] = t[1];
		t[1] = x;
	}
	CHECK(t[1] == fd, "number %d not reused (%d %d)", fd, t[0], t[1]);
	CHECK(send_stash(t, 5, 's') == 5, "stash");
	r = epoll_wait(ep, ev, 4, 0);
	CHECK(r == 0, "the closed socket's registration reported: %d (data %#llx)", r,
	      (unsigned long long)ev[0].data.u64);
	CHECK(take(t[1], 5, 's') == 5, "recv");
	close(ep);
	close_pair(t);
}

// The wake: a thread blocked in a wait before anything was stashed. The
// receiver's SO_RCVLOWAT keeps the kernel from waking the waiter when the
// bytes arrive (as if it had woken, found the socket empty after the drain,
// and slept on); once they are stashed it must return with the fd.
enum {
	W_POLL,
	W_EPOLL,
	W_EPOLL_ET,
	W_SELECT,
	W_PPOLL_MASKED,
	W_EPOLL_PWAIT2
};

struct waiter {
	int kind, fd, ep, timeout_ms;
	_Atomic pid_t tid;
	int ret, err;
	uint64_t data;
	double took;
};

static void *waiter(void *arg)
{
	struct waiter *w = arg;
	struct pollfd p = {.fd = w->fd, .events = POLLIN};
	struct epoll_event ev[4];
	fd_set rd;
	sigset_t all;
	struct timespec ts = {w->timeout_ms / 1000, (w->timeout_ms % 1000) * 1000000L};
	struct timeval tv = {w->timeout_ms / 1000, (w->timeout_ms % 1000) * 1000};
	double t0 = now();
	w->tid = (pid_t)syscall(SYS_gettid);
	switch (w->kind) {
	case W_POLL:
		w->ret = poll(&p, 1, w->timeout_ms);
		break;
	case W_PPOLL_MASKED:
		sigfillset(&all);
		w->ret = ppoll(&p, 1, w->timeout_ms < 0 ? NULL : &ts, &all);
		break;
	case W_SELECT:
		FD_ZERO(&rd);
		FD_SET(w->fd, &rd);
		w->ret = select(w->fd + 1, &rd, NULL, NULL, w->timeout_ms < 0 ? NULL : &tv);
		if (w->ret == 1 && !FD_ISSET(w->fd, &rd))
			w->ret = -2;
		break;
	case W_EPOLL:
	case W_EPOLL_ET:
		w->ret = epoll_wait(w->ep, ev, 4, w->timeout_ms);
		break;
	case W_EPOLL_PWAIT2:
		w->ret = epoll_pwait2(w->ep, ev, 4, w->timeout_ms < 0 ? NULL : &ts, NULL);
		break;
	}
	w->err = errno;
	w->took = now() - t0;
	if (w->ret > 0 && w->kind != W_POLL && w->kind != W_PPOLL_MASKED && w->kind != W_SELECT)
		w->data = ev[0].data.u64;
	return NULL;
}

// in_wait waits (bounded) until thread tid sleeps in a system call.
static int in_wait(pid_t tid)
{
	char path[64], buf[64];
	snprintf(path, sizeof(path), "/proc/self/task/%d/syscall", tid);
	double end = now() + 5;
	while (now() < end) {
		FILE *f = fopen(path, "r");
		long nr = -1;
		if (f) {
			if (fgets(buf, sizeof(buf), f))
				nr = strtol(buf, NULL, 10);
			fclose(f);
		}
		if (nr == SYS_ppoll || nr == SYS_epoll_pwait || nr == SYS_epoll_pwait2 || nr == SYS_pselect6 ||
		    nr == SYS_poll || nr == SYS_epoll_wait || nr == SYS_select)
			return 1;
		pause_ms(1);
	}
	return 0;
}

static int join_by(pthread_t t, double secs)
{
	struct timespec end;
	clock_gettime(CLOCK_REALTIME, &end);
	end.tv_sec += (time_t)secs;
	return pthread_timedjoin_np(t, NULL, &end);
}

static void wake_case(int kind, const char *name)
{
	int s[2], ep = -1, lowat = 1 << 20;
	tcp_pair(s, 0);
	CHECK(setsockopt(s[1], SOL_SOCKET, SO_RCVLOWAT, &lowat, sizeof(lowat)) == 0, "SO_RCVLOWAT");
	struct waiter w = {.kind = kind, .fd = s[1], .timeout_ms = -1};
	if (kind == W_EPOLL || kind == W_EPOLL_ET || kind == W_EPOLL_PWAIT2) {
		ep = epoll_create1(0);
		w.ep = ep;
		CHECK(ep_add(ep, s[1], EPOLLIN | (kind == W_EPOLL_ET ? EPOLLET : 0), 0x77) == 0, "epoll_ctl");
	}
	pthread_t t;
	pthread_create(&t, NULL, waiter, &w);
	while (!w.tid)
		sched_yield();
	CHECK(in_wait(w.tid), "%s: the waiter never blocked", name);
	char b[64];
	memset(b, 'w', sizeof(b));
	CHECK(send(s[0], b, sizeof(b), 0) == sizeof(b) && queued(s[1], sizeof(b)) == sizeof(b), "send");
	pause_ms(20);
	CHECK(in_wait(w.tid), "%s: the kernel woke the waiter despite SO_RCVLOWAT (ret %d)", name, w.ret);
	double t0 = now();
	CHECK(stash(s[1], 0) == sizeof(b), "stash");
	if (join_by(t, 5) != 0) {
		pthread_cancel(t);
		pthread_join(t, NULL);
		CHECK(0, "%s: the waiter did not wake within 5 s of the stash", name);
	}
	double late = now() - t0;
	CHECK(w.ret == 1 && (ep < 0 || w.data == 0x77), "%s: ret %d (%s) data %#llx", name, w.ret, strerror(w.err),
	      (unsigned long long)w.data);
	CHECK(late < 1, "%s: woke %.3f s after the stash", name, late);
	CHECK(take(s[1], sizeof(b), 'w') == sizeof(b), "recv");
	if (ep >= 0)
		close(ep);
	close_pair(s);
}

static void test_wake(void)
{
	CHECK(wake_signal() > 0, "no wake signal");
	wake_case(W_POLL, "poll(-1)");
	wake_case(W_EPOLL, "epoll_wait(-1)");
	wake_case(W_EPOLL_ET, "epoll_wait(-1) EPOLLET");
	wake_case(W_SELECT, "select(NULL)");
	wake_case(W_PPOLL_MASKED, "ppoll(all signals blocked)");
	if (HAVE_PWAIT2)
		wake_case(W_EPOLL_PWAIT2, "epoll_pwait2(NULL)");
}

// A wait on an fd that gets nothing ends at its timeout and not before,
// returns 0 (no EINTR), though a stash of another fd wakes it meanwhile;
// select reports no time left.
static void timeout_case(int kind, const char *name)
{
	int s[2], o[2], ep = -1;
	tcp_pair(s, 0);
	tcp_pair(o, 0);
	struct waiter w = {.kind = kind, .fd = s[1], .timeout_ms = 300};
	if (kind == W_EPOLL) {
		ep = epoll_create1(0);
		w.ep = ep;
		CHECK(ep_add(ep, s[1], EPOLLIN, 1) == 0, "epoll_ctl");
	}
	pthread_t t;
	pthread_create(&t, NULL, waiter, &w);
	while (!w.tid)
		sched_yield();
	CHECK(in_wait(w.tid), "%s: never blocked", name);
	CHECK(send_stash(o, 10, 'o') == 10, "stash"); // wakes the waiter, which must wait on
	if (join_by(t, 5) != 0) {
		pthread_cancel(t);
		pthread_join(t, NULL);
		CHECK(0, "%s: 300 ms wait still waiting after 5 s", name);
	}
	CHECK(w.ret == 0, "%s: ret %d (%s), want 0", name, w.ret, strerror(w.err));
	CHECK(w.took >= 0.299 && w.took < 1.5, "%s: took %.3f s, want 0.3", name, w.took);
	CHECK(take(o[1], 10, 'o') == 10, "recv");
	if (ep >= 0)
		close(ep);
	close_pair(s);
	close_pair(o);
}

static void test_timeout(void)
{
	timeout_case(W_POLL, "poll(300)");
	timeout_case(W_EPOLL, "epoll_wait(300)");
	timeout_case(W_SELECT, "select(300 ms)");
	timeout_case(W_PPOLL_MASKED, "ppoll(300 ms, all blocked)");

	// With a stash live the slow path runs: still the full timeout.
	int s[2], o[2];
	tcp_pair(s, 0);
	tcp_pair(o, 0);
	CHECK(send_stash(o, 10, 'q') == 10, "stash");
	struct pollfd p = {.fd = s[1], .events = POLLIN};
	double t0 = now();
	int r = poll(&p, 1, 200);
	double took = now() - t0;
	CHECK(r == 0 && took >= 0.199 && took < 1, "poll(200) beside a stash: %d after %.3f s", r, took);
	fd_set rd;
	FD_ZERO(&rd);
	FD_SET(s[1], &rd);
	struct timeval tv = {0, 100000};
	r = select(s[1] + 1, &rd, NULL, NULL, &tv);
	CHECK(r == 0 && tv.tv_sec == 0 && tv.tv_usec == 0, "select: %d, %ld.%06ld left", r, (long)tv.tv_sec,
	      (long)tv.tv_usec);
	CHECK(take(o[1], 10, 'q') == 10, "recv");
	close_pair(s);
	close_pair(o);
}

// zero_waits makes each kind of wait with a zero timeout on fd (in epoll
// set ep) and returns how many reported it ready, or -1 if one failed.
static int zero_waits(int fd, int ep)
{
	struct pollfd p = {.fd = fd, .events = POLLIN};
	struct epoll_event out[1];
	struct timespec zero = {0, 0};
	struct timeval tv = {0, 0};
	fd_set rs;
	int r[7], n = 0, k = 0;
	r[k++] = poll(&p, 1, 0);
	r[k++] = ppoll(&p, 1, &zero, NULL);
	FD_ZERO(&rs);
	FD_SET(fd, &rs);
	r[k++] = select(fd + 1, &rs, NULL, NULL, &tv);
	FD_ZERO(&rs);
	FD_SET(fd, &rs);
	r[k++] = pselect(fd + 1, &rs, NULL, NULL, &zero, NULL);
	r[k++] = epoll_wait(ep, out, 1, 0);
	r[k++] = epoll_pwait(ep, out, 1, 0, NULL);
#if HAVE_PWAIT2
	r[k++] = epoll_pwait2(ep, out, 1, &zero, NULL);
#endif
	for (int i = 0; i < k; i++) {
		if (r[i] < 0)
			return -1;
		n += r[i];
	}
	return n;
}

// idle: under a closed gate, a wait with a zero timeout that finds nothing
// gives up the CPU: a progress loop spinning on bytes its peers' gates
// hold leaves the CPU to the shim's thread and mpid, which the pause waits
// for. A wait that finds something does not, nor any with the gate open.
static void test_idle(void)
{
	int s[2], waits = HAVE_PWAIT2 ? 7 : 6;
	tcp_pair(s, 0);
	int ep = epoll_create1(0);
	struct epoll_event e = {.events = EPOLLIN, .data.fd = s[1]};
	CHECK(ep >= 0 && epoll_ctl(ep, EPOLL_CTL_ADD, s[1], &e) == 0, "epoll: %s", strerror(errno));
	unsigned long y = idle_yields();
	CHECK(zero_waits(s[1], ep) == 0, "the waits found something on an idle socket");
	CHECK(idle_yields() == y, "%lu waits gave up the CPU with the gate open", idle_yields() - y);
	gate_close();
	y = idle_yields();
	int found = zero_waits(s[1], ep);
	unsigned long idle = idle_yields() - y;
	// A peer's bytes (its send is not this process's, so no gate holds it).
	int sent = syscall(SYS_sendto, s[0], "x", 1, 0, NULL, 0) == 1;
	for (int i = 0; i < 5000 && found == 0 && zero_waits(s[1], ep) == 0; i++)
		usleep(1000);
	y = idle_yields();
	int ready = zero_waits(s[1], ep);
	unsigned long busy = idle_yields() - y;
	gate_open(NULL);
	CHECK(found == 0 && idle == (unsigned long)waits, "under the closed gate %lu of %d idle waits gave up the CPU (found %d)",
	      idle, waits, found);
	CHECK(sent && ready == waits && busy == 0, "with a byte waiting, %d of %d waits found it and %lu gave up the CPU", ready,
	      waits, busy);
	CHECK(take(s[1], 1, 'x') == 1, "recv");
	close(ep);
	close_pair(s);
}

int main(void)
{
	stash = (ssize_t(*)(int, unsigned long))dlsym(RTLD_DEFAULT, "mpipause_test_stash");
	wake_signal = (int (*)(void))dlsym(RTLD_DEFAULT, "mpipause_test_wait_signal");
	idle_yields = (unsigned long (*)(void))dlsym(RTLD_DEFAULT, "mpipause_test_idle_yields");
	gate_close = (void (*)(void))dlsym(RTLD_DEFAULT, "mpipause_gate_close");
	gate_open = (void (*)(void *))dlsym(RTLD_DEFAULT, "mpipause_gate_open");
	if (!stash || !wake_signal || !idle_yields || !gate_close || !gate_open) {
		fprintf(stderr, "FAIL: libmpipause.so (with stash.c and wake.c) is not preloaded "
				"(run: make -C libmpi-shim test)\n");
		return 1;
	}
	signal(SIGPIPE, SIG_IGN);
	const struct test tests[] = {
		{"poll_select", test_poll_select},
		{"epoll_lt", test_epoll_lt},
		{"epoll_et", test_epoll_et},
		{"epoll_oneshot", test_epoll_oneshot},
		{"mix", test_mix},
		{"maxevents", test_maxevents},
		{"reuse_dup", test_reuse_dup},
		{"wake", test_wake},
		{"timeout", test_timeout},
		{"idle", test_idle},
	};
	return RUN_TESTS(tests);
}
