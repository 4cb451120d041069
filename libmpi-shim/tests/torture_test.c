// SPDX-License-Identifier: Apache-2.0
//
// The shim's torture suite: what programs do besides MPI, with bytes held
// under a closed gate (libmpi-shim/README.md's tables name its cases). Each
// case has a real TCP peer that checks the exact byte stream it received,
// in order, across a closed and reopened gate. Run with libmpipause.so
// preloaded and MPIPAUSE_HOLD_MAX_MB=1 (make -C libmpi-shim test).
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/errqueue.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/sendfile.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "shim.h"
#include "check.h"

#if !__GLIBC_PREREQ(2, 34)
// Debian 11's glibc 2.31 has neither call: the shim, preloaded in these
// tests, has both.
__attribute__((weak)) int close_range(unsigned first, unsigned last, int flags);
__attribute__((weak)) void closefrom(int low);
#endif

static void (*gate_close)(void);
static void (*gate_open)(struct mpp_gate_stats *);
static void (*gate_state)(struct mpp_gate_stats *);

// listener returns a loopback listening socket and its address.
static int listener(struct sockaddr_in *a)
{
	socklen_t l = sizeof(*a);
	memset(a, 0, sizeof(*a));
	a->sin_family = AF_INET;
	a->sin_addr.s_addr = htonl(INADDR_LOOPBACK);
	int ln = socket(AF_INET, SOCK_STREAM, 0);
	if (ln < 0 || bind(ln, (void *)a, sizeof(*a)) < 0 || listen(ln, 8) < 0 || getsockname(ln, (void *)a, &l) < 0)
		die("listen");
	return ln;
}

// nothing_yet reports whether the peer has no byte and no end of stream to
// read once the sender's kernel queue is empty (held bytes are not in it).
static int nothing_yet(int sender, int peer)
{
	int outq = 1;
	for (int i = 0; i < 10000 && outq; i++) {
		if (ioctl(sender, SIOCOUTQ, &outq) < 0)
			outq = 0; // not a connected socket any more
		if (outq)
			poll(NULL, 0, 1);
	}
	struct pollfd p = {.fd = peer, .events = POLLIN};
	return outq == 0 && poll(&p, 1, 0) == 0;
}

// read_all reads from fd until end of stream (at most n bytes, 10 s) and
// returns how many it got: the exact stream the peer saw.
static ssize_t read_all(int fd, char *b, size_t n)
{
	size_t got = 0;
	for (;;) {
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (poll(&p, 1, 10000) <= 0)
			return -1;
		ssize_t r = recv(fd, b + got, n - got, 0);
		if (r < 0)
			return -1;
		if (r == 0 || (got += (size_t)r) == n)
			return (ssize_t)got;
	}
}

// read_n reads exactly n bytes (10 s at most).
static int read_n(int fd, char *b, size_t n)
{
	size_t got = 0;
	while (got < n) {
		struct pollfd p = {.fd = fd, .events = POLLIN};
		if (poll(&p, 1, 10000) <= 0)
			return -1;
		ssize_t r = recv(fd, b + got, n - got, 0);
		if (r <= 0)
			return -1;
		got += (size_t)r;
	}
	return 0;
}

static void nonblock_fd(int fd)
{
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

static void opened(void)
{
	struct mpp_gate_stats st;
	gate_open(&st);
}

// T1: the FIN of a shutdown follows the held bytes, and a send after it
// fails as the kernel's would.
static void test_shutdown(void)
{
	int s[2];
	char b[64];
	tcp_pair(s, 0);
	gate_close();
	CHECK(send(s[0], "HEADER", 6, 0) == 6, "held send");
	CHECK(shutdown(s[0], SHUT_WR) == 0, "shutdown: %s", strerror(errno));
	CHECK(nothing_yet(s[0], s[1]), "the peer saw the end of the stream before the held bytes");
	errno = 0;
	CHECK(send(s[0], "late", 4, MSG_NOSIGNAL) == -1 && errno == EPIPE, "send after shutdown: errno %d", errno);
	opened();
	ssize_t n = read_all(s[1], b, sizeof(b));
	CHECK(n == 6 && memcmp(b, "HEADER", 6) == 0, "the peer read %zd bytes \"%.*s\", want HEADER then EOF", n,
	      (int)(n > 0 ? n : 0), b);
	close(s[0]);
	close(s[1]);
}

// body writes a file of n pattern bytes and returns it open for reading.
static int body(size_t n, char *want)
{
	char name[] = "/tmp/mpipause-torture-XXXXXX";
	int fd = mkstemp(name);
	if (fd < 0)
		die("mkstemp");
	unlink(name);
	for (size_t i = 0; i < n; i++)
		want[i] = (char)('a' + (i * 7 + i / 26) % 26);
	if (write(fd, want, n) != (ssize_t)n || lseek(fd, 0, SEEK_SET) != 0)
		die("write body");
	return fd;
}

// T2: sendfile queues behind the held bytes; the file's offset moves by
// what the call took.
static void test_sendfile(void)
{
	enum {
		N = 300000
	};
	static char want[7 + N], got[7 + N + 1];
	int s[2];
	tcp_pair(s, 0);
	int f = body(N, want + 7);
	memcpy(want, "HEADER:", 7);
	gate_close();
	CHECK(send(s[0], "HEADER:", 7, 0) == 7, "held send");
	size_t sent = 0;
	while (sent < N / 2) {
		ssize_t r = sendfile(s[0], f, NULL, N / 2 - sent);
		CHECK(r > 0, "sendfile: %zd %s", r, strerror(errno));
		sent += (size_t)r;
	}
	CHECK(lseek(f, 0, SEEK_CUR) == N / 2, "file position %lld, want %d", (long long)lseek(f, 0, SEEK_CUR), N / 2);
	off_t off = N / 2;
	while (sent < N) {
		ssize_t r = sendfile(s[0], f, &off, N - sent);
		CHECK(r > 0, "sendfile at an offset: %zd %s", r, strerror(errno));
		sent += (size_t)r;
	}
	CHECK(off == N && lseek(f, 0, SEEK_CUR) == N / 2, "offset %lld, position %lld", (long long)off,
	      (long long)lseek(f, 0, SEEK_CUR));
	CHECK(nothing_yet(s[0], s[1]), "sendfile passed the closed gate");
	opened();
	close(s[0]);
	ssize_t n = read_all(s[1], got, sizeof(got));
	CHECK(n == (ssize_t)sizeof(want) && memcmp(got, want, sizeof(want)) == 0,
	      "the peer read %zd bytes starting \"%.12s\", want %zu starting \"%.12s\"", n, got, sizeof(want), want);
	close(s[1]);
	close(f);
}

// T2, splice: a pipe's bytes spliced to the socket queue behind the held ones.
static void test_splice(void)
{
	int s[2], p[2];
	char b[64];
	tcp_pair(s, 0);
	if (pipe(p) < 0)
		die("pipe");
	CHECK(write(p[1], "BODY", 4) == 4, "pipe write");
	gate_close();
	CHECK(send(s[0], "HEAD:", 5, 0) == 5, "held send");
	CHECK(splice(p[0], NULL, s[0], NULL, 4, 0) == 4, "splice: %s", strerror(errno));
	opened();
	close(s[0]);
	ssize_t n = read_all(s[1], b, sizeof(b));
	CHECK(n == 9 && memcmp(b, "HEAD:BODY", 9) == 0, "the peer read \"%.*s\", want HEAD:BODY", (int)(n > 0 ? n : 0),
	      b);
	close(s[1]);
	close(p[0]);
	close(p[1]);
}

// reuse returns a new socket connected to ln's address with the number fd
// had (as a program's next socket would get it).
static int reuse(int fd, int ln, const struct sockaddr_in *a, int *peer)
{
	int n = socket(AF_INET, SOCK_STREAM, 0);
	if (n != fd) {
		if (dup2(n, fd) < 0)
			die("dup2");
		close(n);
	}
	if (connect(fd, (const void *)a, sizeof(*a)) < 0)
		die("connect");
	*peer = accept(ln, NULL, NULL);
	if (*peer < 0)
		die("accept");
	return fd;
}

enum {
	BY_CLOSE_RANGE,
	BY_CLOSEFROM,
	BY_DUP2,
	BY_RAW_CLOSE
};

// T3: bytes held for a socket go to that socket, whatever then gets its
// number; a close the shim cannot see loses them, and says so, rather than
// give them to the number's next socket.
static void reused_number(int how)
{
	struct sockaddr_in a2;
	int ln2 = listener(&a2), s[2], peer2;
	char b[64];
	struct mpp_gate_stats st;
	tcp_pair(s, 0);
	int fd = s[0];
	if (how == BY_CLOSEFROM && fd < s[1]) {
		// closefrom(fd) must not take the peer: move the sender above it.
		int hi = fcntl(fd, F_DUPFD, s[1] + 1);
		close(fd);
		fd = hi;
	}
	struct mpp_gate_stats before, after;
	gate_state(&before);
	gate_close();
	CHECK(send(fd, "FOR-PEER-1", 10, 0) == 10, "held send");
	switch (how) {
	case BY_CLOSE_RANGE:
		CHECK(close_range(fd, fd, 0) == 0, "close_range: %s", strerror(errno));
		break;
	case BY_CLOSEFROM:
		closefrom(fd);
		break;
	case BY_DUP2:
		break;
	case BY_RAW_CLOSE:
		CHECK(syscall(SYS_close, fd) == 0, "close");
		break;
	}
	reuse(fd, ln2, &a2, &peer2);
	gate_open(&st);
	gate_state(&after);
	CHECK(send(fd, "FOR-PEER-2", 10, 0) == 10, "send to peer 2");
	close(fd);
	ssize_t n = read_all(peer2, b, sizeof(b));
	CHECK(n == 10 && memcmp(b, "FOR-PEER-2", 10) == 0, "peer 2 read \"%.*s\", want FOR-PEER-2",
	      (int)(n > 0 ? n : 0), b);
	if (how == BY_RAW_CLOSE) {
		CHECK(after.lost - before.lost == 10, "lost %lu held bytes, want 10 reported", after.lost - before.lost);
	} else {
		n = read_all(s[1], b, sizeof(b));
		CHECK(n == 10 && memcmp(b, "FOR-PEER-1", 10) == 0, "peer 1 read \"%.*s\", want FOR-PEER-1",
		      (int)(n > 0 ? n : 0), b);
	}
	close(s[1]);
	close(peer2);
	close(ln2);
}

static void test_close_range(void)
{
	reused_number(BY_CLOSE_RANGE);
}

static void test_closefrom(void)
{
	reused_number(BY_CLOSEFROM);
}

static void test_dup2_over_held(void)
{
	reused_number(BY_DUP2);
}

static void test_raw_close(void)
{
	reused_number(BY_RAW_CLOSE);
}

// fclose of a socket stream: its buffer goes behind the held bytes, and the
// held bytes are not lost with the fd.
static void test_fclose(void)
{
	int s[2];
	char b[64];
	tcp_pair(s, 0);
	FILE *f = fdopen(s[0], "w");
	CHECK(f != NULL, "fdopen");
	setvbuf(f, NULL, _IOFBF, 4096);
	gate_close();
	CHECK(send(s[0], "ONE-", 4, 0) == 4, "held send");
	CHECK(fputs("TWO-", f) >= 0, "fputs");
	CHECK(fflush(f) == 0, "fflush");
	CHECK(fputs("THREE", f) >= 0, "fputs");
	CHECK(fclose(f) == 0, "fclose");
	opened();
	ssize_t n = read_all(s[1], b, sizeof(b));
	CHECK(n == 13 && memcmp(b, "ONE-TWO-THREE", 13) == 0, "the peer read \"%.*s\", want ONE-TWO-THREE then EOF",
	      (int)(n > 0 ? n : 0), b);
	close(s[1]);
}

// T4: a forked child is not a rank: its gate is open, it owns none of the
// parent's held bytes, and its notes do not reach the parent's state page.
static void test_fork(void)
{
	int (*gate_page)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "mpipause_test_gate_page");
	int (*state_page)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "mpipause_test_state_page");
	CHECK(gate_page && state_page, "test entry points missing");
	int gfd = gate_page(), pfd = state_page();
	CHECK(gfd >= 0 && pfd >= 0, "pages: %d %d", gfd, pfd);
	struct stat sb;
	fstat(pfd, &sb);
	const unsigned char *pg = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_SHARED, pfd, 0);
	CHECK(pg != MAP_FAILED, "map the state page");
	const unsigned char *shorts = pg + sizeof(struct mpp_page);

	struct sockaddr_in a;
	int ln = listener(&a), s[2];
	char b[64];
	tcp_pair(s, 4096);
	gate_close();
	CHECK(send(s[0], "PARENT", 6, 0) == 6, "held send");
	// A socket the child fills, so that its last call is short.
	int full[2];
	tcp_pair(full, 4096);
	nonblock_fd(full[0]);
	pid_t pid = fork();
	if (pid == 0) {
		struct mpp_gate_stats st;
		gate_state(&st);
		// Not closed: flushing while the parent holds bytes for one of
		// its sockets (test_fork_order), and none of them the child's.
		if (st.gate == GATE_CLOSED || st.held != 0)
			_exit(10);
		int c = socket(AF_INET, SOCK_STREAM, 0);
		if (connect(c, (void *)&a, sizeof(a)) < 0 || send(c, "CHILD-0123", 10, 0) != 10)
			_exit(11);
		char big[1 << 16] = {0};
		for (int i = 0; i < 64 && send(full[0], big, sizeof(big), 0) == (ssize_t)sizeof(big); i++)
			;
		close(c);
		exit(0); // the shim's exit flush must not send the parent's bytes
	}
	struct pollfd p = {.fd = ln, .events = POLLIN};
	int c = poll(&p, 1, 10000) == 1 ? accept(ln, NULL, NULL) : -1;
	ssize_t n = c >= 0 ? read_all(c, b, sizeof(b)) : -1;
	int status = 0;
	waitpid(pid, &status, 0);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child: status %#x (10: gate not open, 11: send)", status);
	CHECK(c >= 0 && n == 10 && memcmp(b, "CHILD-0123", 10) == 0, "the child's peer read \"%.*s\" while the parent's gate was closed",
	      (int)(n > 0 ? n : 0), b);
	CHECK(shorts[full[0]] == 0, "the child's short call was noted in the parent's state page");
	CHECK(nothing_yet(s[0], s[1]), "the parent's held bytes left before its gate opened");
	opened();
	close(s[0]);
	n = read_all(s[1], b, sizeof(b));
	CHECK(n == 6 && memcmp(b, "PARENT", 6) == 0, "the parent's peer read \"%.*s\", want PARENT once",
	      (int)(n > 0 ? n : 0), b);
	close(s[1]);
	close(c);
	close(ln);
	close(full[0]);
	close(full[1]);
}

// T4: a forked child's write to a socket whose bytes its parent holds
// comes after them: the child waits, as on a full socket, until the
// parent's gate reopens and sends them.
static void test_fork_order(void)
{
	int s[2], ready[2];
	char b[64];
	tcp_pair(s, 0);
	if (pipe(ready) < 0)
		die("pipe");
	gate_close();
	CHECK(send(s[0], "PARENT", 6, 0) == 6, "held send");
	pid_t pid = fork();
	if (pid == 0) {
		close(ready[0]);
		if (write(ready[1], "r", 1) != 1 || send(s[0], "CHILD", 5, 0) != 5)
			_exit(11);
		_exit(0);
	}
	close(ready[1]);
	struct pollfd p = {.fd = ready[0], .events = POLLIN};
	CHECK(poll(&p, 1, 10000) == 1, "the child did not start");
	// The child is at its send: nothing may reach the peer while the
	// parent's bytes are held (a second, long enough for a send that does
	// not wait to arrive).
	p = (struct pollfd){.fd = s[1], .events = POLLIN};
	int early = poll(&p, 1, 1000);
	opened();
	int status = 0;
	waitpid(pid, &status, 0);
	close(s[0]);
	ssize_t n = read_all(s[1], b, sizeof(b));
	CHECK(early == 0, "the child's write reached the peer while its parent held bytes for the socket");
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child: status %#x", status);
	CHECK(n == 11 && memcmp(b, "PARENTCHILD", 11) == 0, "the peer read \"%.*s\", want PARENTCHILD",
	      (int)(n > 0 ? n : 0), b);
	close(s[1]);
	close(ready[0]);
}

struct watchdog {
	pthread_mutex_t mu;
	pthread_cond_t cv;
	int done;
};

// rescue reopens the gate if the test has not finished in 5 s: a call that
// should have returned at once is stuck in the shim, and the test then
// fails instead of hanging.
static void *rescue(void *arg)
{
	struct watchdog *w = arg;
	struct timespec t;
	clock_gettime(CLOCK_REALTIME, &t);
	t.tv_sec += 5;
	pthread_mutex_lock(&w->mu);
	while (!w->done && pthread_cond_timedwait(&w->cv, &w->mu, &t) == 0)
		;
	int stuck = !w->done;
	pthread_mutex_unlock(&w->mu);
	if (stuck)
		opened();
	return NULL;
}

// T5: at the hold cap (1 MiB here) a non-blocking send gets EAGAIN, as on a
// full socket, instead of sleeping until the reopen.
static void test_nonblocking_at_cap(void)
{
	int s[2];
	static char big[1 << 20];
	tcp_pair(s, 0);
	gate_close();
	CHECK(send(s[0], big, sizeof(big), 0) == (ssize_t)sizeof(big), "held send of 1 MiB");
	struct watchdog w = {PTHREAD_MUTEX_INITIALIZER, PTHREAD_COND_INITIALIZER, 0};
	pthread_t t;
	pthread_create(&t, NULL, rescue, &w);
	errno = 0;
	ssize_t r1 = send(s[0], big, 100, MSG_DONTWAIT);
	int e1 = errno;
	nonblock_fd(s[0]);
	errno = 0;
	ssize_t r2 = write(s[0], big, 100);
	int e2 = errno;
	pthread_mutex_lock(&w.mu);
	w.done = 1;
	pthread_cond_signal(&w.cv);
	pthread_mutex_unlock(&w.mu);
	pthread_join(t, NULL);
	opened();
	CHECK(r1 == -1 && e1 == EAGAIN, "MSG_DONTWAIT at the cap: %zd, errno %d", r1, e1);
	CHECK(r2 == -1 && e2 == EAGAIN, "O_NONBLOCK write at the cap: %zd, errno %d", r2, e2);
	close(s[0]);
	size_t got = 0;
	char b[65536];
	ssize_t n;
	while ((n = recv(s[1], b, sizeof(b), 0)) > 0)
		got += (size_t)n;
	CHECK(got == sizeof(big), "the peer read %zu bytes, want %zu", got, sizeof(big));
	close(s[1]);
}

// T5: MSG_OOB keeps its urgent byte through the hold.
static void test_oob(void)
{
	int s[2];
	char b[8], u = 0;
	tcp_pair(s, 0);
	gate_close();
	CHECK(send(s[0], "ab", 2, 0) == 2, "held send");
	CHECK(send(s[0], "c", 1, MSG_OOB) == 1, "held urgent send");
	opened();
	CHECK(read_n(s[1], b, 2) == 0 && memcmp(b, "ab", 2) == 0, "in-band bytes");
	struct pollfd p = {.fd = s[1], .events = POLLPRI};
	CHECK(poll(&p, 1, 10000) == 1, "no urgent data announced");
	CHECK(recv(s[1], &u, 1, MSG_OOB) == 1 && u == 'c', "urgent byte: %c (%s)", u, strerror(errno));
	close(s[0]);
	close(s[1]);
}

// T5: MSG_FASTOPEN on a socket not yet connected is a connect carrying
// data, which goes now: there is nothing to hold it behind.
static void test_fastopen(void)
{
	struct sockaddr_in a;
	int ln = listener(&a), one = 1;
	char b[8];
	setsockopt(ln, IPPROTO_TCP, TCP_FASTOPEN, &one, sizeof(one));
	int c = socket(AF_INET, SOCK_STREAM, 0);
	gate_close();
	CHECK(sendto(c, "TFO", 3, MSG_FASTOPEN, (void *)&a, sizeof(a)) == 3, "sendto MSG_FASTOPEN: %s",
	      strerror(errno));
	struct pollfd p = {.fd = ln, .events = POLLIN};
	int ready = poll(&p, 1, 10000);
	opened();
	CHECK(ready == 1, "no connection while the gate was closed");
	int peer = accept(ln, NULL, NULL);
	CHECK(read_n(peer, b, 3) == 0 && memcmp(b, "TFO", 3) == 0, "the peer read %.3s", b);
	close(c);
	close(peer);
	close(ln);
}

// T5: MSG_ZEROCOPY promises a completion for the caller's buffer, which a
// held copy cannot keep: the call passes (and the pause's kernel check
// sees it on a job connection); the completion comes.
static void test_zerocopy(void)
{
	int s[2], one = 1;
	char b[8];
	tcp_pair(s, 0);
	CHECK(setsockopt(s[0], SOL_SOCKET, SO_ZEROCOPY, &one, sizeof(one)) == 0, "SO_ZEROCOPY");
	gate_close();
	CHECK(send(s[0], "ZC", 2, MSG_ZEROCOPY) == 2, "send MSG_ZEROCOPY");
	int r = read_n(s[1], b, 2);
	opened();
	CHECK(r == 0 && memcmp(b, "ZC", 2) == 0, "a MSG_ZEROCOPY send was held");
	char ctl[128];
	struct msghdr m = {.msg_control = ctl, .msg_controllen = sizeof(ctl)};
	struct pollfd p = {.fd = s[0], .events = 0};
	poll(&p, 1, 10000);
	CHECK(recvmsg(s[0], &m, MSG_ERRQUEUE) >= 0, "no completion: %s", strerror(errno));
	close(s[0]);
	close(s[1]);
}

// L2: a process that exits or execs with held bytes delivers them first.
static void ends_with_held(int how)
{
	int s[2];
	char b[64];
	tcp_pair(s, 0);
	pid_t pid = fork();
	if (pid == 0) {
		close(s[1]);
		gate_close(); // the child's own gate
		if (send(s[0], "LAST-WORDS", 10, 0) != 10)
			_exit(11);
		if (how == 0)
			exit(0);
		execl("/bin/true", "true", (char *)NULL);
		_exit(12);
	}
	close(s[0]);
	ssize_t n = read_all(s[1], b, sizeof(b));
	int status = 0;
	waitpid(pid, &status, 0);
	CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "child: status %#x", status);
	CHECK(n == 10 && memcmp(b, "LAST-WORDS", 10) == 0, "the peer read \"%.*s\" after the %s, want LAST-WORDS",
	      (int)(n > 0 ? n : 0), b, how == 0 ? "exit" : "exec");
	close(s[1]);
}

static void test_exit(void)
{
	ends_with_held(0);
}

static void test_exec(void)
{
	ends_with_held(1);
}

int main(void)
{
	gate_close = (void (*)(void))dlsym(RTLD_DEFAULT, "mpipause_gate_close");
	gate_open = (void (*)(struct mpp_gate_stats *))dlsym(RTLD_DEFAULT, "mpipause_gate_open");
	gate_state = (void (*)(struct mpp_gate_stats *))dlsym(RTLD_DEFAULT, "mpipause_gate_state");
	if (!gate_close || !gate_open || !gate_state) {
		fprintf(stderr, "FAIL: libmpipause.so is not preloaded (run: make -C libmpi-shim test)\n");
		return 1;
	}
	signal(SIGPIPE, SIG_IGN);
	setvbuf(stdout, NULL, _IONBF, 0); // forked children must not print it again
	const struct test tests[] = {
		{"T1 shutdown after held bytes", test_shutdown},
		{"T2 sendfile after held bytes", test_sendfile},
		{"T2 splice after held bytes", test_splice},
		{"T3 close_range, number reused", test_close_range},
		{"T3 closefrom, number reused", test_closefrom},
		{"T3 dup2 over a socket with held bytes", test_dup2_over_held},
		{"T3 raw close, number reused: lost and reported", test_raw_close},
		{"T3 fclose of a socket stream", test_fclose},
		{"T5 non-blocking send at the hold cap", test_nonblocking_at_cap},
		{"T5 MSG_OOB", test_oob},
		{"T5 MSG_FASTOPEN", test_fastopen},
		{"T5 MSG_ZEROCOPY", test_zerocopy},
		{"L2 exit with held bytes", test_exit},
		{"L2 exec with held bytes", test_exec},
		{"T4 fork: the child writes after its parent's held bytes", test_fork_order},
		{"T4 fork", test_fork}, // last: it shares the gate and state pages
	};
	return RUN_TESTS(tests);
}
