// SPDX-License-Identifier: Apache-2.0
//
// C tests of the send gate on plain sockets, run with libmpipause.so
// preloaded (make -C libmpi-shim test). Every check prints what it expected
// and what it got; the first failure exits non-zero.
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <linux/sockios.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/ptrace.h>
#include <sys/socket.h>
#include <sys/syscall.h>
#include <sys/stat.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "shim.h"
#include "check.h"

static void (*gate_close)(void);
static void (*gate_open)(struct mpp_gate_stats *);
static void (*gate_state)(struct mpp_gate_stats *);

// tcp_pair returns a connected loopback TCP pair: s[0] sends, s[1] receives.

static void nonblock(int fd)
{
	fcntl(fd, F_SETFL, fcntl(fd, F_GETFL) | O_NONBLOCK);
}

// pattern byte i of stream id.
static unsigned char pat(unsigned id, uint64_t i)
{
	return (unsigned char)((i * 131 + id * 7 + (i >> 11)) & 0xff);
}

static void fill(unsigned char *b, size_t n, unsigned id, uint64_t from)
{
	for (size_t i = 0; i < n; i++)
		b[i] = pat(id, from + i);
}

// settled waits until the kernel holds nothing unacknowledged for fd (so
// every byte it took is in the peer's receive queue) and returns how many
// bytes the peer can read. A readiness wait, bounded at 10 s.
static int settled(int fd, int peer)
{
	int outq = 1, inq = 0;
	for (int i = 0; i < 10000 && outq; i++) {
		ioctl(fd, SIOCOUTQ, &outq);
		if (outq) {
			struct timespec ts = {0, 1000000};
			nanosleep(&ts, NULL);
		}
	}
	if (outq)
		return -1;
	ioctl(peer, FIONREAD, &inq);
	return inq;
}

// recv_check reads n bytes of stream id from fd, starting at offset *at,
// and checks every byte.
static int recv_check(int fd, size_t n, unsigned id, uint64_t *at)
{
	unsigned char b[65536];
	while (n > 0) {
		ssize_t r = recv(fd, b, n < sizeof(b) ? n : sizeof(b), 0);
		if (r <= 0)
			return -1;
		for (ssize_t i = 0; i < r; i++)
			if (b[i] != pat(id, *at + i)) {
				fprintf(stderr, "stream %u: byte %llu is %u, want %u\n", id,
					(unsigned long long)(*at + i), b[i], pat(id, *at + i));
				return -1;
			}
		*at += r;
		n -= r;
	}
	return 0;
}

// mpid's side of the gate page: it closes the gate by writing the shared
// word (a new generation each time), and a reopen of an older generation
// (a late "REOPEN <gen>") neither opens the gate nor sends a held byte.
static void test_gate_page(void)
{
	int (*page_fd)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "mpipause_test_gate_page");
	int (*reopen)(long, struct mpp_gate_stats *) =
		(int (*)(long, struct mpp_gate_stats *))dlsym(RTLD_DEFAULT, "mpipause_test_reopen");
	int s[2], fd;
	unsigned char b[5000];
	uint64_t sent = 0, got = 0;
	struct mpp_gate_stats st;

	CHECK(page_fd && reopen, "test entry points missing");
	fd = page_fd();
	CHECK(fd >= 0, "gate page: %d", fd);
	_Atomic int *word = mmap(NULL, MPP_GATE_PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	CHECK(word != MAP_FAILED, "map the gate page");
	tcp_pair(s, 0);
	for (unsigned gen = 1; gen <= 2; gen++) {
		atomic_store(word, GATE_WORD(GATE_CLOSED, gen)); // mpid's close
		fill(b, sizeof(b), 4, sent);
		CHECK(send(s[0], b, sizeof(b), 0) == (ssize_t)sizeof(b), "send under mpid's close %u", gen);
		sent += sizeof(b);
		CHECK(settled(s[0], s[1]) == 0, "held bytes reached the kernel under close %u", gen);
	}
	CHECK(reopen(1, &st) == -1 && atomic_load(word) == GATE_WORD(GATE_CLOSED, 2),
	      "a reopen of generation 1 under generation 2's close: word %#x", atomic_load(word));
	CHECK(settled(s[0], s[1]) == 0, "a stale reopen sent held bytes");
	atomic_store(word, GATE_WORD(GATE_FLUSHING, 2)); // mpid's reopen
	CHECK(reopen(2, &st) == 0 && st.flushed == 2 * sizeof(b), "flush: %lu bytes", st.flushed);
	CHECK(atomic_load(word) == GATE_OPEN, "after the flush the word is %#x, want open", atomic_load(word));
	CHECK(recv_check(s[1], sent, 4, &got) == 0, "held bytes in order");
	CHECK(reopen(2, &st) == -1, "a second reopen of an open gate did something");
	munmap((void *)word, MPP_GATE_PAGE_SIZE);
	close(fd);
	close(s[0]);
	close(s[1]);
}

// handed is what the process has handed the kernel to send on fd (its
// write_seq less the first): the bytes acknowledged (tcpi_bytes_acked, at
// its offset in the kernel's struct tcp_info, linux/tcp.h; glibc's copy
// ends before it) and those still queued (SIOCOUTQ), read until no ACK came
// between the two.
static uint64_t handed(int fd)
{
	for (;;) {
		unsigned char ti[256];
		uint64_t a1, a2;
		int q = 0;
		socklen_t l = sizeof(ti);
		if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, ti, &l) < 0 || l < 128)
			die("TCP_INFO");
		memcpy(&a1, ti + 120, sizeof(a1));
		if (ioctl(fd, SIOCOUTQ, &q) < 0)
			die("SIOCOUTQ");
		l = sizeof(ti);
		if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, ti, &l) < 0)
			die("TCP_INFO");
		memcpy(&a2, ti + 120, sizeof(a2));
		if (a1 == a2)
			return a1 + (uint64_t)q;
	}
}

static long long now_ms(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return (long long)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

struct flush_run {
	int (*reopen)(long, struct mpp_gate_stats *);
	long gen;
	int rc;
	struct mpp_gate_stats st;
};

static void *run_reopen(void *arg)
{
	struct flush_run *f = arg;
	f->rc = f->reopen(f->gen, &f->st);
	return NULL;
}

// drain_some reads what waits on fd into b (at *got, at most cap in all) and
// waits up to 1 ms for more: the peer's side of a drain.
static void drain_some(int fd, unsigned char *b, size_t cap, size_t *got)
{
	struct pollfd p = {.fd = fd, .events = POLLIN};
	ssize_t r;
	while (*got < cap && (r = recv(fd, b + *got, cap - *got, MSG_DONTWAIT)) > 0)
		*got += (size_t)r;
	poll(&p, 1, 1);
}

// A resume's flush overtaken by the next pause's close (mpid writes the
// word while the shim's thread still sends what the last pause held, MiBs
// in one held call): the state page counts the flush until its last send
// call has returned, and from then on the kernel takes nothing more from
// it. Otherwise mpid, reading the page, takes the rank for quiet while the
// flush goes on sending the rest of its chunk through the closed gate, and
// the pause fails after the freeze (bytes sent through closed gates on a
// socket with bytes held). What the flush left stays held, in order, for
// the next resume.
static void test_flush_overtaken(void)
{
	int (*page_fd)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "mpipause_test_gate_page");
	int (*state_page)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "mpipause_test_state_page");
	struct flush_run f = {0};
	f.reopen = (int (*)(long, struct mpp_gate_stats *))dlsym(RTLD_DEFAULT, "mpipause_test_reopen");
	CHECK(page_fd && state_page && f.reopen, "test entry points missing");
	int gfd = page_fd(), pfd = state_page(), s[2];
	CHECK(gfd >= 0 && pfd >= 0, "pages: %d %d", gfd, pfd);
	_Atomic int *word = mmap(NULL, MPP_GATE_PAGE_SIZE, PROT_READ | PROT_WRITE, MAP_SHARED, gfd, 0);
	struct stat sb;
	fstat(pfd, &sb);
	struct mpp_page *pg = mmap(NULL, (size_t)sb.st_size, PROT_READ, MAP_SHARED, pfd, 0);
	CHECK(word != MAP_FAILED && pg != MAP_FAILED, "map the pages");
	const size_t n = 4 << 20;
	unsigned char *b = malloc(n), *in = malloc(n);
	size_t got = 0;
	pthread_t t;
	CHECK(b && in, "malloc");
	fill(b, n, 6, 0);
	tcp_pair(s, 65536);
	// Bytes before the pause, so that where the held bytes go in the
	// stream ("held from") is not 0.
	const uint64_t first = handed(s[0]); // the SYN's sequence number
	const size_t pre = 1000;
	CHECK(send(s[0], b, pre, 0) == (ssize_t)pre, "send before the pause");
	CHECK(recv(s[1], in, pre, MSG_WAITALL) == (ssize_t)pre, "read before the pause");
	const uint64_t syn = handed(s[0]);
	const uint64_t *held = (const uint64_t *)((const char *)pg + pg->held_offset);
	const uint64_t *from = (const uint64_t *)((const char *)pg + pg->from_offset);

	atomic_store(word, GATE_WORD(GATE_CLOSED, 1)); // the first pause
	CHECK(send(s[0], b, n, 0) == (ssize_t)n, "held send");
	// Checked at the end: a check that ends the test here would leave the
	// gate closed over held bytes nobody reads, and the exit's flush waits.
	const uint64_t held1 = held[s[0]], from1 = from[s[0]];
	atomic_store(word, GATE_WORD(GATE_FLUSHING, 1)); // its resume
	f.gen = 1;
	CHECK(pthread_create(&t, NULL, run_reopen, &f) == 0, "thread");
	// The flush fills the two socket buffers and waits for room: the peer
	// reads nothing before the close.
	while (handed(s[0]) == syn)
		poll(NULL, 0, 1);
	atomic_store(word, GATE_WORD(GATE_CLOSED, 2)); // the next pause
	long long deadline = now_ms() + 10000;
	while (atomic_load(&pg->flushing) != 0 && now_ms() < deadline)
		drain_some(s[1], in, n, &got);
	CHECK(atomic_load(&pg->flushing) == 0, "the page still counts a flush 10 s after the close");
	uint64_t quiet = handed(s[0]) - syn;
	while (pthread_tryjoin_np(t, NULL) != 0 && now_ms() < deadline)
		drain_some(s[1], in, n, &got);
	uint64_t after = handed(s[0]) - syn;
	CHECK(after == quiet, "the flush handed the kernel %llu bytes after the page said no flush ran (%llu before)",
	      (unsigned long long)(after - quiet), (unsigned long long)quiet);
	CHECK(f.rc == 0 && f.st.flushed == quiet, "the overtaken flush: rc %d, %lu bytes flushed, the kernel took %llu", f.rc,
	      f.st.flushed, (unsigned long long)quiet);
	CHECK(quiet < n, "the whole %zu bytes went before the close: nothing was overtaken", n);
	const uint64_t held2 = held[s[0]], from2 = from[s[0]], want2 = handed(s[0]) - first;
	CHECK(atomic_load(word) == GATE_WORD(GATE_CLOSED, 2), "the overtaken flush changed the word to %#x",
	      atomic_load(word));

	atomic_store(word, GATE_WORD(GATE_FLUSHING, 2)); // the next resume
	f.gen = 2;
	CHECK(pthread_create(&t, NULL, run_reopen, &f) == 0, "thread");
	while (got < n && now_ms() < deadline + 10000)
		drain_some(s[1], in, n, &got);
	pthread_join(t, NULL);
	CHECK(f.rc == 0 && f.st.flushed == n - quiet, "the second flush: rc %d, %lu bytes, want %llu", f.rc, f.st.flushed,
	      (unsigned long long)(n - quiet));
	CHECK(got == n && memcmp(in, b, n) == 0, "the peer read %zu of %zu bytes, in order: %d", got, n,
	      got == n && memcmp(in, b, n) == 0);
	CHECK(atomic_load(word) == GATE_OPEN, "after the second flush the word is %#x, want open", atomic_load(word));
	CHECK(held1 == n && from1 == syn - first,
	      "the page said %llu bytes held from %llu, want %zu from %llu (the kernel's count)", (unsigned long long)held1,
	      (unsigned long long)from1, n, (unsigned long long)(syn - first));
	CHECK(held2 == n - quiet && from2 == want2,
	      "after the overtaken flush the page said %llu bytes held from %llu, want %llu from %llu (the kernel's count)",
	      (unsigned long long)held2, (unsigned long long)from2, (unsigned long long)(n - quiet),
	      (unsigned long long)want2);
	free(b);
	free(in);
	munmap((void *)word, MPP_GATE_PAGE_SIZE);
	munmap(pg, (size_t)sb.st_size);
	close(gfd);
	close(pfd);
	close(s[0]);
	close(s[1]);
}

// Receiving under a closed gate: every read call returns what the kernel's
// returns, bytes and errno (the shim only asks for a quick ACK after a
// read that got bytes); a pipe reads as ever.
static void test_receive_under_closed_gate(void)
{
	int s[2], p[2];
	unsigned char b[3000], r[3000];
	uint64_t sent = 0, got = 0;
	struct mpp_gate_stats st;

	tcp_pair(s, 0);
	fill(b, sizeof(b), 5, 0);
	CHECK(send(s[0], b, sizeof(b), 0) == (ssize_t)sizeof(b), "send before close");
	sent = sizeof(b);
	CHECK(settled(s[0], s[1]) == (int)sizeof(b), "bytes waiting before close");
	gate_close();
	CHECK(recv_check(s[1], 1000, 5, &got) == 0, "recv under a closed gate");
	CHECK(read(s[1], r, 1000) == 1000 && memcmp(r, b + 1000, 1000) == 0, "read under a closed gate");
	struct iovec v[2] = {{r, 500}, {r + 500, 500}};
	CHECK(readv(s[1], v, 2) == 1000 && memcmp(r, b + 2000, 1000) == 0, "readv under a closed gate");
	got += 2000;
	nonblock(s[1]);
	errno = 0;
	CHECK(recv(s[1], r, 1, 0) == -1 && errno == EAGAIN, "empty non-blocking recv: errno %d", errno);
	errno = 0;
	CHECK(read(-1, r, 1) == -1 && errno == EBADF, "read of a bad fd: errno %d", errno);
	if (pipe(p) < 0)
		die("pipe");
	CHECK(write(p[1], "xy", 2) == 2 && read(p[0], r, 2) == 2 && r[0] == 'x', "pipe under a closed gate");
	gate_open(&st);
	CHECK(got == sent, "read %llu of %llu", (unsigned long long)got, (unsigned long long)sent);
	close(p[0]);
	close(p[1]);
	close(s[0]);
	close(s[1]);
}

// Gate open: results and errno are the kernel's own.
static void test_passthrough(void)
{
	int s[2], p[2];
	char b[4096] = {0};
	struct iovec v[2] = {{b, 10}, {b, 20}};
	struct msghdr m = {.msg_iov = v, .msg_iovlen = 2};

	tcp_pair(s, 0);
	CHECK(send(s[0], b, 100, 0) == 100, "send");
	CHECK(write(s[0], b, 7) == 7, "write");
	CHECK(writev(s[0], v, 2) == 30, "writev");
	CHECK(sendmsg(s[0], &m, 0) == 30, "sendmsg");
	CHECK(sendto(s[0], b, 5, 0, NULL, 0) == 5, "sendto");
	errno = 0;
	CHECK(write(-1, b, 1) == -1 && errno == EBADF, "write(-1): errno %d", errno);
	errno = 0;
	CHECK(send(0 + 1000, b, 1, 0) == -1 && errno == EBADF, "send(bad fd): errno %d", errno);
	errno = 0;
	volatile int bad = -1; // hidden from the compiler's argument check
	CHECK(writev(s[0], v, bad) == -1 && errno == EINVAL, "writev(-1 iov): errno %d", errno);
	if (pipe(p) < 0)
		die("pipe");
	errno = 0;
	CHECK(send(p[1], b, 1, 0) == -1 && errno == ENOTSOCK, "send(pipe): errno %d", errno);
	// A short write on a full non-blocking socket, then EAGAIN, as the kernel says.
	nonblock(s[0]);
	ssize_t r, total = 0;
	while ((r = send(s[0], b, sizeof(b), 0)) == (ssize_t)sizeof(b))
		total += r;
	CHECK(r == -1 ? errno == EAGAIN : r > 0, "full socket: r %zd errno %d", r, errno);
	errno = 0;
	r = send(s[0], b, sizeof(b), 0);
	CHECK(r == -1 && errno == EAGAIN, "after full: r %zd errno %d", r, errno);
	close(s[1]);
	// The peer is gone: EPIPE (no SIGPIPE with MSG_NOSIGNAL), eventually.
	for (int i = 0; i < 1000 && !(r == -1 && errno == EPIPE); i++)
		r = send(s[0], b, 1, MSG_NOSIGNAL);
	CHECK(r == -1 && (errno == EPIPE || errno == ECONNRESET), "closed peer: r %zd errno %d", r, errno);
	close(s[0]);
	close(p[0]);
	close(p[1]);
}

// Gate closed: bytes are held, nothing reaches the kernel, reopening sends
// them in order; other fds pass through.
static void test_hold_and_flush(void)
{
	int s[2], p[2];
	unsigned char b[100000];
	uint64_t sent = 0, got = 0;
	struct mpp_gate_stats st;

	tcp_pair(s, 0);
	fill(b, 1000, 1, sent);
	CHECK(send(s[0], b, 1000, 0) == 1000, "send before close");
	sent += 1000;
	gate_close();
	for (int i = 0; i < 5; i++) {
		size_t n = 20000 + i;
		fill(b, n, 1, sent);
		struct iovec v[2] = {{b, n / 2}, {b + n / 2, n - n / 2}};
		ssize_t r = i % 2 ? writev(s[0], v, 2) : send(s[0], b, n, 0);
		CHECK(r == (ssize_t)n, "gated send %d: %zd", i, r);
		sent += n;
	}
	// sendmmsg and sendmsg are held message by message, counts as the kernel's.
	{
		fill(b, 3000, 1, sent);
		struct iovec v[3] = {{b, 1000}, {b + 1000, 1000}, {b + 2000, 1000}};
		struct mmsghdr mm[2] = {{.msg_hdr = {.msg_iov = v, .msg_iovlen = 2}}, {.msg_hdr = {.msg_iov = v + 2, .msg_iovlen = 1}}};
		CHECK(sendmmsg(s[0], mm, 2, 0) == 2 && mm[0].msg_len == 2000 && mm[1].msg_len == 1000, "sendmmsg: %u %u",
		      mm[0].msg_len, mm[1].msg_len);
		sent += 3000;
		fill(b, 500, 1, sent);
		struct iovec one = {b, 500};
		struct msghdr m = {.msg_iov = &one, .msg_iovlen = 1};
		CHECK(sendmsg(s[0], &m, 0) == 500, "gated sendmsg");
		sent += 500;
	}
	// A pipe is not gated.
	if (pipe(p) < 0)
		die("pipe");
	CHECK(write(p[1], "x", 1) == 1, "pipe write under a closed gate");
	char c;
	CHECK(read(p[0], &c, 1) == 1 && c == 'x', "pipe read");
	int avail = settled(s[0], s[1]);
	CHECK(avail == 1000, "the peer can read %d bytes under the closed gate, want the 1000 sent before", avail);
	gate_state(&st);
	CHECK(st.gate == GATE_CLOSED && st.held == sent - 1000 && st.gated >= 1, "state: gate %d held %lu gated %u", st.gate,
	      st.held, st.gated);
	CHECK(recv_check(s[1], 1000, 1, &got) == 0, "first 1000");
	gate_open(&st);
	CHECK(st.flushed == sent - 1000 && st.flush_errors == 0, "flushed %lu errors %u", st.flushed, st.flush_errors);
	fill(b, 333, 1, sent);
	CHECK(send(s[0], b, 333, 0) == 333, "send after open");
	sent += 333;
	CHECK(recv_check(s[1], sent - got, 1, &got) == 0, "stream after reopen");
	gate_state(&st);
	CHECK(st.gate == GATE_OPEN && st.held == 0, "after open: gate %d held %lu", st.gate, st.held);
	close(s[0]);
	close(s[1]);
	close(p[0]);
	close(p[1]);
}

struct stream_reader {
	int fd;
	size_t n;
	uint64_t at;
	int rc;
};

static void *read_thread(void *arg)
{
	struct stream_reader *r = arg;
	r->rc = recv_check(r->fd, r->n, 2, &r->at);
	return NULL;
}

// hold_huge: a held send of MiBs is copied into memory the kernel may back
// with transparent huge pages (one fault per 2 MiB, not 512: faulting 4 KiB
// pages cost more CPU than the copy, on a thread that shares its core with
// the job's busy ranks), and flushed from there in order.
static void test_hold_huge(void)
{
	int s[2];
	size_t n = 4 << 20;
	unsigned char *b = malloc(n);
	void *(*held)(int) = (void *(*)(int))dlsym(RTLD_DEFAULT, "mpipause_test_held");
	struct mpp_gate_stats st;
	char mode[32];

	CHECK(b && held, "malloc, or no mpipause_test_held");
	tcp_pair(s, 0);
	fill(b, n, 2, 0);
	gate_close();
	CHECK(send(s[0], b, n, 0) == (ssize_t)n, "gated send of %zu bytes", n);
	void *h = held(s[0]);
	int elig = h ? thp_eligible(h) : -1;
	thp_mode(mode, sizeof(mode));
	struct stream_reader r = {.fd = s[1], .n = n};
	pthread_t t;
	CHECK(pthread_create(&t, NULL, read_thread, &r) == 0, "thread");
	gate_open(&st);
	pthread_join(t, NULL);
	close(s[0]);
	close(s[1]);
	free(b);
	CHECK(h != NULL, "nothing held after a gated send");
	if (strcmp(mode, "always") == 0 || strcmp(mode, "madvise") == 0)
		CHECK(elig == 1, "transparent huge pages are \"%s\" here, but the held bytes' memory is not eligible (THPeligible %d)",
		      mode, elig);
	else
		CHECK(elig != 1, "transparent huge pages are \"%s\", yet the held bytes' memory is eligible", mode);
	CHECK(st.flushed == n && st.flush_errors == 0, "flushed %lu of %zu, errors %u", st.flushed, n, st.flush_errors);
	CHECK(r.rc == 0 && r.at == n, "the peer read %lu of %zu bytes in order", (unsigned long)r.at, n);
}

static void *open_thread(void *st)
{
	gate_open(st);
	return NULL;
}

// G2 (docs/guarantees.md): a socket whose last call was short stays open
// until a call completes in full, then is gated.
static void test_call_boundary(void)
{
	int s[2];
	static unsigned char b[1 << 20];
	uint64_t sent = 0, got = 0;
	struct mpp_gate_stats st;
	ssize_t r;

	tcp_pair(s, 16384);
	nonblock(s[0]);
	// Fill the socket until a call is short: the library is mid-message.
	for (;;) {
		fill(b, 50000, 2, sent);
		r = send(s[0], b, 50000, 0);
		CHECK(r > 0, "filling: %zd errno %d", r, errno);
		sent += r;
		if (r < 50000)
			break;
	}
	size_t rest = 50000 - r;
	gate_close();
	gate_state(&st);
	CHECK(st.closing == 1 && st.gated == 0, "closing %u gated %u, want the short socket closing", st.closing, st.gated);
	// Make room, then the remainder of the message goes to the kernel.
	unsigned char *tail = b + r;
	size_t left = rest;
	while (left > 0) {
		int inq = 0;
		ioctl(s[1], FIONREAD, &inq);
		if (inq > 0)
			CHECK(recv_check(s[1], inq, 2, &got) == 0, "drain data");
		r = send(s[0], tail, left, 0);
		if (r > 0) {
			tail += r;
			left -= r;
			sent += r;
		} else
			CHECK(r == -1 && errno == EAGAIN, "remainder: %zd errno %d", r, errno);
	}
	gate_state(&st);
	CHECK(st.closing == 0 && st.gated == 1, "after the message: closing %u gated %u", st.closing, st.gated);
	// The next message is held.
	fill(b, 7000, 2, sent);
	CHECK(send(s[0], b, 7000, 0) == 7000, "held send");
	// Read all the kernel was given; then nothing more may be in flight.
	CHECK(recv_check(s[1], sent - got, 2, &got) == 0, "stream before the held send");
	int avail = settled(s[0], s[1]);
	CHECK(avail == 0, "%d more bytes reached the peer: the held 7000 must not be there", avail);
	sent += 7000;
	// Reopen from another thread while this one reads: the flush waits for room.
	pthread_t t;
	pthread_create(&t, NULL, open_thread, &st);
	CHECK(recv_check(s[1], sent - got, 2, &got) == 0, "stream");
	pthread_join(t, NULL);
	CHECK(st.flushed == 7000, "flushed %lu", st.flushed);
	close(s[0]);
	close(s[1]);
}

// Several threads stream on their own sockets while the gate closes and
// opens under them: every stream arrives whole and in order.
#define NT 4
#define PER_THREAD (4u << 20)
struct streamer {
	int fd;
	unsigned id;
};

static void *stream(void *arg)
{
	struct streamer *x = arg;
	unsigned char b[8192];
	uint64_t at = 0;
	while (at < PER_THREAD) {
		size_t n = 1 + (at * 7919) % sizeof(b);
		if (n > PER_THREAD - at)
			n = PER_THREAD - at;
		fill(b, n, x->id, at);
		ssize_t r = (at & 1) ? write(x->fd, b, n) : send(x->fd, b, n, 0);
		if (r <= 0) {
			perror("stream send");
			exit(2);
		}
		at += r;
	}
	return NULL;
}

struct reader {
	int fd;
	unsigned id;
	int ok;
};

static void *drain(void *arg)
{
	struct reader *x = arg;
	uint64_t at = 0;
	x->ok = recv_check(x->fd, PER_THREAD, x->id, &at) == 0;
	return NULL;
}

static void test_threads(void)
{
	int s[NT][2];
	pthread_t w[NT], rd[NT];
	struct streamer sx[NT];
	struct reader rx[NT];
	struct mpp_gate_stats st;
	unsigned long flushed = 0;

	for (int i = 0; i < NT; i++) {
		tcp_pair(s[i], 0);
		sx[i] = (struct streamer){s[i][0], 10 + i};
		rx[i] = (struct reader){s[i][1], 10 + i, 0};
		pthread_create(&rd[i], NULL, drain, &rx[i]);
		pthread_create(&w[i], NULL, stream, &sx[i]);
	}
	for (int k = 0; k < 50; k++) {
		gate_close();
		struct timespec ts = {0, 200000};
		nanosleep(&ts, NULL); // let the senders run into the closed gate
		gate_open(&st);
		flushed += st.flushed;
	}
	for (int i = 0; i < NT; i++) {
		pthread_join(w[i], NULL);
		pthread_join(rd[i], NULL);
		CHECK(rx[i].ok, "stream %d corrupted", i);
		close(s[i][0]);
		close(s[i][1]);
	}
	CHECK(flushed > 0, "the gate never held anything: the test did not test");
	printf("  threads: %d streams of %u bytes, 50 close/open cycles, %lu bytes held and flushed\n", NT, PER_THREAD,
	       flushed);
}

// Closing a socket with held bytes delivers them at reopen, as the kernel
// delivers what was written before a close, and the fd number's next socket
// gets none of them.
static void test_close_with_held(void)
{
	int a[2], b[2];
	unsigned char buf[5000];
	uint64_t got = 0;
	struct mpp_gate_stats st;

	tcp_pair(a, 0);
	gate_close();
	fill(buf, sizeof(buf), 3, 0);
	CHECK(send(a[0], buf, sizeof(buf), 0) == (ssize_t)sizeof(buf), "held send");
	int n = a[0];
	CHECK(close(a[0]) == 0, "close with held bytes");
	tcp_pair(b, 0); // likely reuses the closed number
	CHECK(send(b[0], "z", 1, 0) == 1, "new socket's send (held)");
	gate_open(&st);
	CHECK(st.flush_errors == 0, "flush errors %u errno %d", st.flush_errors, st.flush_errno);
	CHECK(recv_check(a[1], sizeof(buf), 3, &got) == 0, "the closed socket's bytes arrive");
	char c = 0, eof;
	CHECK(recv(a[1], &eof, 1, 0) == 0, "then the closed socket's FIN");
	CHECK(recv(b[1], &c, 1, 0) == 1 && c == 'z', "the new socket (fd %d, old %d) got %d", b[0], n, c);
	close(a[1]);
	close(b[0]);
	close(b[1]);
}

// A signal interrupting a blocked send (gate open) gives the kernel's EINTR.
static void on_usr1(int sig)
{
	(void)sig;
}

static _Atomic int kick_done;

// kick signals the thread until it is told to stop: one of the signals
// lands while the send is blocked, whatever the scheduling.
static void *kick(void *arg)
{
	while (!kick_done) {
		struct timespec ts = {0, 20000000};
		nanosleep(&ts, NULL);
		if (!kick_done)
			pthread_kill(*(pthread_t *)arg, SIGUSR1);
	}
	return NULL;
}

static void test_signal_during_blocked_send(void)
{
	int s[2];
	static unsigned char b[1 << 20];
	struct sigaction sa = {.sa_handler = on_usr1}; // no SA_RESTART
	sigaction(SIGUSR1, &sa, NULL);
	tcp_pair(s, 16384);
	nonblock(s[0]);
	// Full means: no room came back within 200 ms of the last EAGAIN. On a
	// loaded machine the ACKs of what was sent can free room after the
	// first EAGAIN, and the blocking send would then not block.
	do {
		while (send(s[0], b, sizeof(b), 0) > 0)
			;
	} while (poll(&(struct pollfd){.fd = s[0], .events = POLLOUT}, 1, 200) > 0);
	fcntl(s[0], F_SETFL, fcntl(s[0], F_GETFL) & ~O_NONBLOCK);
	pthread_t self = pthread_self(), t;
	pthread_create(&t, NULL, kick, &self);
	errno = 0;
	ssize_t r = send(s[0], b, 1000, 0);
	int e = errno;
	kick_done = 1;
	pthread_join(t, NULL);
	CHECK(r == -1 && e == EINTR, "blocked send interrupted: r %zd errno %d, want -1 EINTR", r, e);
	close(s[0]);
	close(s[1]);
}

static _Atomic int app_tstp;

static void app_on_tstp(int sig)
{
	(void)sig;
	app_tstp++;
}

// SIGTSTP does not stop a registered rank: the shim's handler tells its
// thread (one byte on a pipe) and then runs the application's own handler,
// which the application installs as usual after the shim took the signal.
static void test_signals(void)
{
	int (*install)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "mpipause_test_signals");
	CHECK(install != NULL, "no mpipause_test_signals");
	int fd = install();
	CHECK(fd >= 0, "install: %d", fd);
	struct sigaction sa = {.sa_handler = app_on_tstp}, old;
	CHECK(sigaction(SIGTSTP, &sa, NULL) == 0, "app's sigaction");
	CHECK(sigaction(SIGTSTP, NULL, &old) == 0 && old.sa_handler == app_on_tstp,
	      "sigaction reports the application's handler back");
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	int64_t before = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
	raise(SIGTSTP); // would stop the process without the shim
	raise(SIGCONT);
	clock_gettime(CLOCK_MONOTONIC, &ts);
	int64_t after = (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
	// Each signal is one whole record stamped when the handler ran, which
	// mpid holds against its last resume (or pause) of the job.
	struct mpp_sig rec[2] = {0};
	CHECK(read(fd, rec, sizeof(rec)) == (ssize_t)sizeof(rec) && rec[0].sig == 'T' && rec[1].sig == 'C',
	      "pipe got %c%c, want TC", rec[0].sig, rec[1].sig);
	CHECK(before <= rec[0].ns && rec[0].ns <= rec[1].ns && rec[1].ns <= after,
	      "stamps %lld %lld not within %lld..%lld", (long long)rec[0].ns, (long long)rec[1].ns, (long long)before,
	      (long long)after);
	CHECK(app_tstp == 1, "the application's handler ran %d times, want 1", app_tstp);
	CHECK(signal(SIGTSTP, SIG_DFL) == app_on_tstp, "signal() returns the application's previous handler");
	raise(SIGTSTP); // SIG_DFL for the application: still not stopped
	CHECK(read(fd, rec, sizeof(rec[0])) == (ssize_t)sizeof(rec[0]) && rec[0].sig == 'T', "pipe after SIG_DFL");
	CHECK(app_tstp == 1, "a SIG_DFL application handler ran");
}

// A SIGTSTP whose handler's frame the kernel had built when the thread was
// stopped (a pause's freeze there), and a SIGCONT sent before the thread
// ran it: the SIGCONT's handler runs first, on top of the SIGTSTP's, and
// the stop it overtook must not become a request to pause: it is reported
// as overtaken ('t'), for mpid to count, never to act on (sig.c, on_cont). ptrace holds the thread at that point as the freezer does: a
// single step into the SIGTSTP's handler stops at its first instruction
// with the frame built, the SIGCONT is sent there, and the thread goes on.
static int overtaken_child(int res)
{
	int (*install)(void) = (int (*)(void))dlsym(RTLD_DEFAULT, "mpipause_test_signals");
	int fd = install ? install() : -1;
	struct sigaction sa = {.sa_handler = app_on_tstp};
	if (fd < 0 || sigaction(SIGTSTP, &sa, NULL) < 0 || ptrace(PTRACE_TRACEME, 0, NULL, NULL) < 0)
		return 2;
	app_tstp = 0;
	raise(SIGSTOP); // the tracer's cue
	while (app_tstp == 0)
		pause();
	char out[16] = {0};
	size_t n = 0;
	struct mpp_sig rec;
	while (n < sizeof(out) - 2 && read(fd, &rec, sizeof(rec)) == (ssize_t)sizeof(rec))
		out[n++] = rec.sig;
	out[n++] = (char)('0' + app_tstp);
	(void)!write(res, out, n);
	return 0;
}

static int traced_stop(pid_t pid)
{
	int st;
	if (waitpid(pid, &st, 0) != pid || !WIFSTOPPED(st))
		return -1;
	return WSTOPSIG(st);
}

static void test_stop_overtaken(void)
{
	int res[2];
	CHECK(pipe(res) == 0, "pipe");
	pid_t pid = fork();
	if (pid == 0)
		_exit(overtaken_child(res[1]));
	close(res[1]);
	CHECK(traced_stop(pid) == SIGSTOP, "the child did not stop for its tracer");
	CHECK(ptrace(PTRACE_CONT, pid, NULL, NULL) == 0, "cont");
	CHECK(kill(pid, SIGTSTP) == 0, "kill TSTP");
	CHECK(traced_stop(pid) == SIGTSTP, "no SIGTSTP delivery stop");
	// Deliver it one step: the handler's frame built, nothing of it run.
	CHECK(ptrace(PTRACE_SINGLESTEP, pid, NULL, (void *)(long)SIGTSTP) == 0, "singlestep");
	CHECK(traced_stop(pid) == SIGTRAP, "no stop at the SIGTSTP handler's entry");
	CHECK(kill(pid, SIGCONT) == 0, "kill CONT");
	CHECK(ptrace(PTRACE_CONT, pid, NULL, NULL) == 0, "cont after the step");
	int sig = traced_stop(pid);
	CHECK(sig == SIGCONT, "stopped by %d, want SIGCONT's delivery", sig);
	CHECK(ptrace(PTRACE_CONT, pid, NULL, (void *)(long)SIGCONT) == 0, "deliver SIGCONT");
	int st;
	for (;;) {
		CHECK(waitpid(pid, &st, 0) == pid, "wait");
		if (!WIFSTOPPED(st))
			break;
		CHECK(ptrace(PTRACE_CONT, pid, NULL, (void *)(long)WSTOPSIG(st)) == 0, "cont");
	}
	CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 0, "child: status %#x", st);
	char got[16] = {0};
	CHECK(read(res[0], got, sizeof(got) - 1) > 0, "no report from the child");
	close(res[0]);
	// The continue, then the stop it overtook, marked so; the
	// application's own SIGTSTP handler still ran, as without the shim.
	CHECK(strcmp(got, "Ct1") == 0, "records and application handler runs %s, want Ct1", got);
}

// launcher_stop runs, as a process named name with the shim and env
// added to the environment, kill(target, SIGSTOP) of a child that handles
// SIGTSTP, and returns what the child got: 'T' (SIGTSTP, handled), 'S'
// (stopped by SIGSTOP), or '?'.
static void on_tstp_note(int sig)
{
	(void)sig;
	(void)!write(3, "T", 1);
}

static char launcher_stop(const char *dir, const char *name, const char *const add[], const char *drop)
{
	char path[512], self[512], pidstr[16];
	int p[2];
	ssize_t n = readlink("/proc/self/exe", self, sizeof(self) - 1);
	if (n < 0 || pipe(p) < 0)
		die("launcher_stop setup");
	self[n] = 0;
	snprintf(path, sizeof(path), "%s/%s", dir, name);
	unlink(path);
	if (symlink(self, path) < 0)
		die("symlink");
	pid_t target = fork();
	if (target == 0) {
		dup2(p[1], 3);
		struct sigaction sa = {.sa_handler = on_tstp_note};
		sigaction(SIGTSTP, &sa, NULL);
		(void)!write(3, "R", 1);
		for (;;)
			pause();
	}
	char c = 0;
	if (read(p[0], &c, 1) != 1 || c != 'R')
		die("target not ready");
	snprintf(pidstr, sizeof(pidstr), "%d", (int)target);
	pid_t killer = fork();
	if (killer == 0) {
		if (drop)
			unsetenv(drop);
		for (int i = 0; add[i]; i++)
			putenv((char *)add[i]);
		execl(path, name, "--kill", pidstr, (char *)NULL);
		_exit(127);
	}
	int st;
	waitpid(killer, &st, 0);
	char got = '?';
	struct pollfd pf = {.fd = p[0], .events = POLLIN};
	for (int i = 0; i < 500 && got == '?'; i++) {
		if (waitpid(target, &st, WUNTRACED | WNOHANG) == target && WIFSTOPPED(st) && WSTOPSIG(st) == SIGSTOP)
			got = 'S';
		else if (poll(&pf, 1, 10) == 1 && read(p[0], &c, 1) == 1 && c == 'T')
			got = 'T';
	}
	kill(target, SIGKILL);
	waitpid(target, &st, 0);
	close(p[0]);
	close(p[1]);
	unlink(path);
	return got;
}

// Open MPI's launcher and daemons turn a SIGTSTP into a SIGSTOP of their
// ranks (sig.c): in a job of mpipause's, the shim in them sends SIGTSTP
// instead; any other program, a launcher outside such a job, and a rank
// itself send what they asked for.
static void test_launcher_stop(void)
{
	char dir[] = "/tmp/mpipause-launcher-XXXXXX";
	if (!mkdtemp(dir))
		die("mkdtemp");
	const char *job[] = {"MPIPAUSE_JOBID=j", NULL};
	const char *rank[] = {"MPIPAUSE_JOBID=j", "OMPI_COMM_WORLD_RANK=0", NULL};
	const char *none[] = {NULL};
	const struct {
		const char *name;
		const char *const *add;
		const char *drop;
		char want;
	} cases[] = {
		{"orted", job, NULL, 'T'},
		{"mpirun.openmpi", job, NULL, 'T'},
		{"prted", job, NULL, 'T'},
		{"orted", none, "MPIPAUSE_JOBID", 'S'},
		{"slurm_script", job, NULL, 'S'},
		{"orted", rank, NULL, 'S'},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		char got = launcher_stop(dir, cases[i].name, (const char *const *)cases[i].add, cases[i].drop);
		if (got != cases[i].want) {
			rmdir(dir);
			CHECK(got == cases[i].want, "kill(SIGSTOP) from %s (%s%s): the target got %c, want %c", cases[i].name,
			      cases[i].add[0] ? cases[i].add[0] : "no job", cases[i].add[0] && cases[i].add[1] ? ", a rank" : "",
			      got, cases[i].want);
		}
	}
	rmdir(dir);
}

// The early JOIN (rankhello.c): the formatting and the job id rules.
static void test_join_line(void)
{
	int (*line)(char *, size_t, const char *, long, const char *) =
		(int (*)(char *, size_t, const char *, long, const char *))dlsym(RTLD_DEFAULT, "mpipause_test_join_line");
	CHECK(line != NULL, "no mpipause_test_join_line");
	char b[256], id128[129], id129[130];
	memset(id128, 'a', 128), id128[128] = 0;
	memset(id129, 'a', 129), id129[129] = 0;
	int n = line(b, sizeof(b), "slurm-42.0", 1234, "n0:ab");
	CHECK(n > 0 && strcmp(b, "JOIN 2 job=slurm-42.0 pid=1234 key=n0:ab\n") == 0 && (size_t)n == strlen(b), "got %d %s", n, b);
	n = line(b, sizeof(b), id128, 7, "k");
	CHECK(n == (int)strlen("JOIN 2 job= pid=7 key=k\n") + 128, "a 128-byte id: %d", n);
	const char *bad[] = {"", "a b", "a=b", "a,b", "a/b", ".", "..", "a\tb", "a\nb", "a\x01", "a\x7f", "caf\xc3\xa9", id129};
	for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++)
		CHECK(line(b, sizeof(b), bad[i], 7, "k") == -1, "invalid id %zu (%s) accepted", i, bad[i]);
	CHECK(line(b, sizeof(b), "x", 0, "k") == -1, "pid 0 accepted");
	CHECK(line(b, sizeof(b), "x", 7, NULL) == -1, "a JOIN without a key");
	CHECK(line(b, 10, "x", 7, "k") == -1, "a line that does not fit accepted");
}

static int join_seq;

// join_listen listens on a fresh abstract socket standing in for mpid's;
// its name ("@...") goes to name.
static int join_listen(char *name, size_t n)
{
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	snprintf(name, n, "@mpipause-shim-test-%d-%d", (int)getpid(), join_seq++);
	size_t l = strlen(name);
	memcpy(a.sun_path, name, l);
	a.sun_path[0] = 0;
	int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (fd < 0 || bind(fd, (void *)&a, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + l)) < 0 ||
	    listen(fd, 4) < 0)
		die("join listen");
	return fd;
}

// inherited counts this process's fds above 2 that a child keeps across
// exec: the child must have exactly these, no more (no fd leaked by JOIN).
static int inherited(void)
{
	int n = 0;
	for (int fd = 3; fd < 1024; fd++) {
		int f = fcntl(fd, F_GETFD);
		n += f >= 0 && !(f & FD_CLOEXEC);
	}
	return n;
}

// spawn re-executes this test with the shim preloaded and only env (plus
// LD_PRELOAD) in its environment: its constructor does the JOIN, then it
// checks its fds (main's "--child"). Its stderr goes to *errfd.
static pid_t spawn(const char *const *env, int *errfd)
{
	char *envp[16], pre[1024], want[16];
	int p[2], k = 0;

	snprintf(pre, sizeof(pre), "LD_PRELOAD=%s", getenv("LD_PRELOAD") ? getenv("LD_PRELOAD") : "");
	envp[k++] = pre;
	for (; *env && k < 15; env++)
		envp[k++] = (char *)*env;
	envp[k] = NULL;
	snprintf(want, sizeof(want), "%d", inherited());
	if (pipe2(p, O_CLOEXEC) < 0)
		die("pipe");
	pid_t pid = fork();
	if (pid < 0)
		die("fork");
	if (pid == 0) {
		char *argv[] = {"gate_test", "--child", want, NULL};
		dup2(p[1], 2);
		execve("/proc/self/exe", argv, envp);
		_exit(127);
	}
	close(p[1]);
	*errfd = p[0];
	return pid;
}

// reap waits for the child (at most 10 s) and reads its stderr; the exit
// status (-1 if it did not end) and how long it ran after the call.
static int reap(pid_t pid, int errfd, char *out, size_t n, double *secs)
{
	struct timespec t0, t1;
	int st = 0, i;
	size_t have = 0;
	ssize_t r;

	clock_gettime(CLOCK_MONOTONIC, &t0);
	for (i = 0; i < 1000 && waitpid(pid, &st, WNOHANG) == 0; i++)
		usleep(10000);
	if (i == 1000) {
		kill(pid, SIGKILL);
		waitpid(pid, &st, 0);
		st = -1;
	}
	clock_gettime(CLOCK_MONOTONIC, &t1);
	if (secs)
		*secs = (double)(t1.tv_sec - t0.tv_sec) + (t1.tv_nsec - t0.tv_nsec) / 1e9;
	while (have < n - 1 && (r = read(errfd, out + have, n - 1 - have)) > 0)
		have += (size_t)r;
	out[have] = 0;
	close(errfd);
	return st == -1 ? -1 : (WIFEXITED(st) ? WEXITSTATUS(st) : 128 + WTERMSIG(st));
}

// take accepts the shim's connection (at most 5 s) and reads its line.
static int take(int ln, char *line, size_t n)
{
	struct pollfd p = {.fd = ln, .events = POLLIN};
	size_t have = 0;

	line[0] = 0;
	if (poll(&p, 1, 5000) != 1)
		return -1;
	int c = accept4(ln, NULL, NULL, SOCK_CLOEXEC);
	if (c < 0)
		return -1;
	while (have < n - 1 && !memchr(line, '\n', have)) {
		struct pollfd q = {.fd = c, .events = POLLIN};
		ssize_t r = poll(&q, 1, 5000) == 1 ? read(c, line + have, n - 1 - have) : -1;
		if (r <= 0)
			break;
		have += (size_t)r;
		line[have] = 0;
	}
	return c;
}

// pending reports whether anyone connected to ln (without waiting).
static int pending(int ln)
{
	struct pollfd p = {.fd = ln, .events = POLLIN};
	return poll(&p, 1, 0) == 1;
}

static int lines(const char *s)
{
	int n = 0;
	for (; *s; s++)
		n += *s == '\n';
	return n;
}

// A rank of a named job sends its JOIN before main; mpid's OK: no word.
static void test_join_ok(void)
{
	char name[64], sockv[96], jobv[200], got[512], want[256], err[1024];
	char id128[129];
	memset(id128, 'j', 128), id128[128] = 0;
	const char *ids[] = {"job-1", id128};
	const char *ranks[] = {"OMPI_COMM_WORLD_RANK=0", "PMIX_RANK=3"};
	int ln = join_listen(name, sizeof(name));
	snprintf(sockv, sizeof(sockv), "MPIPAUSE_MPID_SOCKET=%s", name);
	for (int i = 0; i < 2; i++) {
		snprintf(jobv, sizeof(jobv), "MPIPAUSE_JOBID=%s", ids[i]);
		const char *env[] = {sockv, jobv, ranks[i], "MPIPAUSE_JOBKEY=node0:4b", NULL};
		int errfd;
		pid_t pid = spawn(env, &errfd);
		int c = take(ln, got, sizeof(got));
		if (c >= 0) {
			write(c, "OK\n", 3);
			close(c);
		}
		int st = reap(pid, errfd, err, sizeof(err), NULL);
		snprintf(want, sizeof(want), "JOIN 2 job=%s pid=%d key=node0:4b\n", ids[i], (int)pid);
		CHECK(c >= 0 && strcmp(got, want) == 0, "mpid got %s, want %s", got, want);
		CHECK(st == 0, "the rank exited %d: %s", st, err);
		CHECK(err[0] == 0, "a joined rank printed: %s", err);
	}
	close(ln);
}

// mpid refuses, or does not answer, or is not there: one warning line,
// and the process runs on; MPIPAUSE_QUIET=1 silences it.
static void test_join_refused(void)
{
	char name[64], sockv[96], got[512], err[1024];
	int ln = join_listen(name, sizeof(name)), errfd;
	snprintf(sockv, sizeof(sockv), "MPIPAUSE_MPID_SOCKET=%s", name);
	const char *env[] = {sockv, "MPIPAUSE_JOBID=j", "PMI_RANK=0", "MPIPAUSE_JOBKEY=n:1", NULL};
	const char *env2[] = {sockv, "MPIPAUSE_JOBID=j", "PMI_RANK=0", "MPIPAUSE_JOBKEY=n:1", "MPIPAUSE_JOIN_TIMEOUT=2", NULL};

	pid_t pid = spawn(env, &errfd);
	int c = take(ln, got, sizeof(got));
	if (c >= 0) {
		write(c, "ERR not a process of this job\n", 30);
		close(c);
	}
	int st = reap(pid, errfd, err, sizeof(err), NULL);
	CHECK(c >= 0 && strncmp(got, "JOIN 2 job=j pid=", 17) == 0, "mpid got %s", got);
	CHECK(st == 0, "the refused rank exited %d: %s", st, err);
	CHECK(lines(err) == 1 && strstr(err, "not a process of this job") && strstr(err, "not be pausable cleanly"),
	      "want one warning with mpid's reason, got: %s", err);

	// No answer: the rank waits MPIPAUSE_JOIN_TIMEOUT (here 2 s), no more.
	double secs;
	pid = spawn(env2, &errfd);
	c = take(ln, got, sizeof(got));
	st = reap(pid, errfd, err, sizeof(err), &secs);
	if (c >= 0)
		close(c);
	CHECK(c >= 0, "no JOIN");
	CHECK(st == 0 && secs > 1.5 && secs < 4, "unanswered: exit %d after %.2f s, want 0 after about 2 s: %s", st,
	      secs, err);
	CHECK(lines(err) == 1 && strstr(err, "within 2 s") && strstr(err, "not be pausable cleanly"), "unanswered: %s",
	      err);

	// A timeout that is not a number of seconds: one line naming it, and
	// the JOIN goes on with the default.
	const char *env3[] = {sockv, "MPIPAUSE_JOBID=j", "PMI_RANK=0", "MPIPAUSE_JOBKEY=n:1", "MPIPAUSE_JOIN_TIMEOUT=2m", NULL};
	pid = spawn(env3, &errfd);
	c = take(ln, got, sizeof(got));
	if (c >= 0) {
		write(c, "OK\n", 3);
		close(c);
	}
	st = reap(pid, errfd, err, sizeof(err), NULL);
	CHECK(c >= 0 && st == 0, "with a bad timeout: JOIN %d, exit %d: %s", c >= 0, st, err);
	CHECK(lines(err) == 1 && strstr(err, "MPIPAUSE_JOIN_TIMEOUT=2m is not a number of seconds"), "bad timeout: %s",
	      err);
	close(ln);

	// Nobody listens.
	pid = spawn(env, &errfd);
	st = reap(pid, errfd, err, sizeof(err), NULL);
	CHECK(st == 0, "without mpid the rank exited %d: %s", st, err);
	CHECK(lines(err) == 1 && strstr(err, "could not join its job's cgroup") && strstr(err, "not be pausable cleanly"),
	      "without mpid: %s", err);
	const char *quiet[] = {sockv, "MPIPAUSE_JOBID=j", "PMI_RANK=0", "MPIPAUSE_QUIET=1", "MPIPAUSE_JOBKEY=n:1", NULL};
	pid = spawn(quiet, &errfd);
	st = reap(pid, errfd, err, sizeof(err), NULL);
	CHECK(st == 0 && err[0] == 0, "MPIPAUSE_QUIET=1: exit %d, printed: %s", st, err);
}

// No JOIN from a launcher daemon (no rank variable), without a job id, or
// with an invalid one (one warning for that).
static void test_join_skipped(void)
{
	char name[64], sockv[96], err[1024], long_id[160];
	int ln = join_listen(name, sizeof(name)), errfd;
	snprintf(sockv, sizeof(sockv), "MPIPAUSE_MPID_SOCKET=%s", name);
	snprintf(long_id, sizeof(long_id), "MPIPAUSE_JOBID=%0129d", 0);
	struct {
		const char *env[5];
		int warns;
		const char *says;
	} cases[] = {
		{{sockv, "MPIPAUSE_JOBID=j", NULL}, 0, NULL},
		{{sockv, "MPIPAUSE_JOBID=", "PMI_RANK=0", NULL}, 0, NULL},
		{{sockv, "PMI_RANK=0", NULL}, 0, NULL},
		{{sockv, "MPIPAUSE_JOBID=a b", "SLURM_PROCID=0", "MPIPAUSE_JOBKEY=n:1", NULL}, 1, "not a valid job id"},
		{{sockv, "MPIPAUSE_JOBID=a=b", "PMI_RANK=0", "MPIPAUSE_JOBKEY=n:1", NULL}, 1, "not a valid job id"},
		{{sockv, "MPIPAUSE_JOBID=a\x01", "PMI_RANK=0", "MPIPAUSE_JOBKEY=n:1", NULL}, 1, "not a valid job id"},
		{{sockv, long_id, "PMI_RANK=0", "MPIPAUSE_JOBKEY=n:1", NULL}, 1, "not a valid job id"},
		{{sockv, "MPIPAUSE_JOBID=j", "PMI_RANK=0", NULL}, 1, "no job key"},
		{{sockv, "MPIPAUSE_JOBID=j", "PMI_RANK=0", "MPIPAUSE_JOBKEY=a b", NULL}, 1, "no job key"},
	};
	for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
		pid_t pid = spawn(cases[i].env, &errfd);
		int st = reap(pid, errfd, err, sizeof(err), NULL);
		int joined = pending(ln);
		if (joined) {
			int c = accept4(ln, NULL, NULL, SOCK_CLOEXEC);
			if (c >= 0)
				close(c);
		}
		CHECK(st == 0, "case %zu: exit %d: %s", i, st, err);
		CHECK(!joined, "case %zu: the process sent a JOIN", i);
		CHECK(lines(err) == cases[i].warns && (!cases[i].warns || strstr(err, cases[i].says)),
		      "case %zu: want %d warning lines, got: %s", i, cases[i].warns, err);
	}
	close(ln);
}

// child is main for the re-executed test (spawn): the shim's constructor has
// run; its fds above 2 must be exactly the ones the parent passed on.
static int child(const char *want)
{
	int n = 0;
	for (int fd = 3; fd < 1024; fd++)
		n += fcntl(fd, F_GETFD) >= 0;
	if (n != atoi(want)) {
		fprintf(stderr, "child: %d fds above 2, want %s\n", n, want);
		return 3;
	}
	return 0;
}

// The receive-side drain (drain.c, stash.c): bytes moved out of the kernel's receive
// queue come back first, in order, through every read call.
static ssize_t (*stash_fd)(int fd, unsigned long ino);

static void send_all(int fd, size_t n, unsigned id, uint64_t *at)
{
	unsigned char b[65536];
	while (n > 0) {
		size_t k = n < sizeof(b) ? n : sizeof(b);
		fill(b, k, id, *at);
		ssize_t r = send(fd, b, k, 0);
		if (r <= 0)
			die("send_all");
		*at += r;
		n -= r;
	}
}

// stash_new_socket: a socket made after the drain last looked at the
// process's descriptors (nothing closed or duplicated since) is drained
// all the same, and its read gets the stash.
static void test_stash_new_socket(void)
{
	int s[2], u[2];
	char b[8];
	tcp_pair(s, 0);
	CHECK(syscall(SYS_sendto, s[0], "a", 1, 0, NULL, 0) == 1, "send");
	for (int i = 0; i < 5000 && stash_fd(s[1], 0) == 0; i++)
		usleep(1000);
	CHECK(recv(s[1], b, sizeof(b), MSG_DONTWAIT) == 1 && b[0] == 'a', "the first socket's stash");
	CHECK(socketpair(AF_UNIX, SOCK_STREAM, 0, u) == 0, "socketpair");
	CHECK(syscall(SYS_write, u[0], "new", 3) == 3, "write");
	CHECK(stash_fd(u[1], 0) == 3, "the new socket's 3 bytes not stashed");
	ssize_t r = recv(u[1], b, sizeof(b), MSG_DONTWAIT);
	CHECK(r == 3 && memcmp(b, "new", 3) == 0, "the new socket read %zd bytes after its drain, want its 3", r);
	close(s[0]), close(s[1]), close(u[0]), close(u[1]);
}

static void test_stash_order(void)
{
	int s[2], inq = -1;
	uint64_t out = 0, in = 0;
	tcp_pair(s, 0);
	send_all(s[0], 100000, 7, &out);
	int want = settled(s[0], s[1]);
	CHECK(want == 100000, "the peer can read %d bytes, want 100000", want);
	ssize_t moved = stash_fd(s[1], 0);
	ioctl(s[1], FIONREAD, &inq);
	CHECK(moved == 100000 && inq == 0, "stash moved %zd, kernel holds %d; want 100000 and 0", moved, inq);
	send_all(s[0], 50000, 7, &out);
	CHECK(settled(s[0], s[1]) == 50000, "the newer bytes did not arrive");
	// Odd-sized reads cross from the stash into the kernel's bytes.
	unsigned char b[7777];
	while (in < out) {
		ssize_t r = recv(s[1], b, sizeof(b), 0);
		CHECK(r > 0, "recv gave %zd (%s) at %llu", r, strerror(errno), (unsigned long long)in);
		for (ssize_t i = 0; i < r; i++)
			CHECK(b[i] == pat(7, in + i), "byte %llu out of order", (unsigned long long)(in + i));
		in += r;
	}
	nonblock(s[1]);
	CHECK(recv(s[1], b, 1, 0) < 0 && errno == EAGAIN, "a byte more than was sent");
	close(s[0]);
	close(s[1]);
}

// peer_closed waits (at most 10 s) until fd's peer has closed: the state
// is CLOSE_WAIT.
static int peer_closed(int fd)
{
	for (int i = 0; i < 10000; i++) {
		struct tcp_info ti;
		socklen_t l = sizeof(ti);
		if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &l) == 0 && ti.tcpi_state == TCP_CLOSE_WAIT)
			return 1;
		struct timespec ts = {0, 1000000};
		nanosleep(&ts, NULL);
	}
	return 0;
}

static void test_stash_calls(void)
{
	int s[2];
	uint64_t out = 0;
	tcp_pair(s, 0);
	send_all(s[0], 30, 3, &out);
	CHECK(settled(s[0], s[1]) == 30, "30 bytes did not arrive");
	CHECK(stash_fd(s[1], 0) == 30, "stash did not take 30 bytes");
	unsigned char b[64], want[64];
	fill(want, sizeof(want), 3, 0);
	// MSG_PEEK leaves them; twice the same.
	CHECK(recv(s[1], b, 10, MSG_PEEK) == 10 && memcmp(b, want, 10) == 0, "peek 1");
	CHECK(recv(s[1], b, 10, MSG_PEEK) == 10 && memcmp(b, want, 10) == 0, "peek 2");
	// readv across iovecs, read, recvmsg, then MSG_WAITALL that needs the
	// kernel for the rest.
	struct iovec v[3] = {{b, 3}, {b + 3, 1}, {b + 4, 4}};
	CHECK(readv(s[1], v, 3) == 8 && memcmp(b, want, 8) == 0, "readv");
	CHECK(read(s[1], b, 6) == 6 && memcmp(b, want + 8, 6) == 0, "read");
	struct iovec mv = {b, 6};
	struct msghdr m = {.msg_iov = &mv, .msg_iovlen = 1};
	CHECK(recvmsg(s[1], &m, 0) == 6 && memcmp(b, want + 14, 6) == 0 && m.msg_flags == 0, "recvmsg");
	send_all(s[0], 34, 3, &out);
	CHECK(recv(s[1], b, 44, MSG_WAITALL) == 44 && memcmp(b, want + 20, 44) == 0,
	      "MSG_WAITALL did not join the stash's 10 bytes and the kernel's 34");
	// The peer's close comes after the stash: bytes, then end of stream.
	send_all(s[0], 5, 9, &(uint64_t){0});
	close(s[0]);
	CHECK(peer_closed(s[1]), "the peer's FIN did not arrive in 10 s");
	CHECK(stash_fd(s[1], 0) == 5, "stash did not take the last 5 bytes");
	CHECK(recv(s[1], b, sizeof(b), 0) == 5, "the last 5 bytes");
	CHECK(recv(s[1], b, sizeof(b), 0) == 0, "no end of stream after the stash");
	close(s[1]);
}

// stashed_pair connects a loopback pair and moves n bytes sent on s[0]
// into s[1]'s stash, as a drain would: whether it all went so.
static int stashed_pair(int s[2], size_t n)
{
	uint64_t out = 0;
	tcp_pair(s, 0);
	send_all(s[0], n, 1, &out);
	return settled(s[0], s[1]) == (int)n && stash_fd(s[1], 0) == (ssize_t)n;
}

// A closed fd's stash is gone: the next socket with that number starts
// empty.
static void test_stash_close(void)
{
	int s[2], t[2];
	CHECK(stashed_pair(s, 1000), "stash 1000");
	int num = s[1];
	close(s[1]);
	tcp_pair(t, 0);
	int again = t[0] == num ? t[0] : (t[1] == num ? t[1] : -1);
	CHECK(again >= 0, "fd %d was not reused (%d, %d)", num, t[0], t[1]);
	nonblock(again);
	char c;
	CHECK(recv(again, &c, 1, 0) < 0 && errno == EAGAIN, "a new socket got an old socket's bytes");
	close(s[0]);
	close(t[0]);
	close(t[1]);
}

// The drain watches fd numbers; the application may close one and get the
// number back as another file meanwhile. A pipe's bytes stay the pipe's
// (stashed through recv, they would come back as ENOTSOCK).
static void test_stash_reused_number(void)
{
	int s[2], p[2];
	struct stat st;
	tcp_pair(s, 0);
	CHECK(fstat(s[1], &st) == 0, "fstat");
	CHECK(pipe(p) == 0, "pipe");
	int num = s[1];
	close(s[1]);
	CHECK(dup2(p[0], num) == num, "a pipe under fd %d", num);
	close(p[0]);
	int rd = num, wr = p[1];
	ssize_t w = write(wr, "abc", 3);
	CHECK(w == 3, "write the pipe: %zd (%s), fds %d %d", w, strerror(errno), rd, wr);
	CHECK(stash_fd(rd, st.st_ino) == 0, "the drain took bytes from a file it did not find");
	char b[8];
	ssize_t r = read(rd, b, sizeof(b));
	CHECK(r == 3 && memcmp(b, "abc", 3) == 0, "the pipe read %zd (%s), want its 3 bytes", r,
	      r < 0 ? strerror(errno) : "");
	close(rd);
	close(wr);
	close(s[0]);
}

// The drain acknowledges what it moves at once. On a connection carrying
// traffic both ways (delayed-ACK "ping-pong" mode) the kernel would hold
// the ACK of a small read for its delayed-ACK timer, and the sender's queue,
// which a pause waits to see empty, with it.
static void test_stash_acks(void)
{
	int s[2], ok = 0;
	tcp_pair(s, 0);
	char b[100] = {0};
	for (int i = 0; i < 200 && !ok; i++) {
		// A request and an answer sent at once put s[1] in ping-pong
		// mode; then a request it only reads.
		CHECK(send(s[0], b, 10, 0) == 10 && recv(s[1], b, 10, MSG_WAITALL) == 10, "request");
		CHECK(send(s[1], b, 10, 0) == 10 && recv(s[0], b, 10, MSG_WAITALL) == 10, "answer");
		CHECK(send(s[0], b, sizeof(b), 0) == (ssize_t)sizeof(b), "send");
		int inq = 0, outq = 0;
		for (int k = 0; k < 10000 && inq < (int)sizeof(b); k++)
			ioctl(s[1], FIONREAD, &inq);
		ioctl(s[0], SIOCOUTQ, &outq);
		if (inq != (int)sizeof(b) || outq == 0) {
			// Acknowledged already (not in ping-pong mode yet): again.
			recv(s[1], b, sizeof(b), MSG_WAITALL);
			continue;
		}
		CHECK(stash_fd(s[1], 0) == (ssize_t)sizeof(b), "stash");
		ioctl(s[0], SIOCOUTQ, &outq);
		CHECK(outq == 0, "the sender still waits for the ACK of %d stashed bytes", outq);
		CHECK(recv(s[1], b, sizeof(b), 0) == (ssize_t)sizeof(b), "the stashed bytes");
		ok = 1;
	}
	CHECK(ok, "no delayed ACK in 200 tries: the test proved nothing");
	close(s[0]);
	close(s[1]);
}

// dup2 over a socket whose stash holds bytes closes that socket: the file
// now under the number does not get its bytes.
static void test_stash_dup2(void)
{
	int s[2], p[2];
	CHECK(stashed_pair(s, 100), "stash 100");
	// A dup2 that fails closes nothing, and the stash stays.
	CHECK(dup2(100000, s[1]) < 0 && errno == EBADF, "dup2 from a bad fd");
	char one;
	CHECK(recv(s[1], &one, 1, MSG_PEEK | MSG_DONTWAIT) == 1, "the stash went with a failed dup2");
	CHECK(pipe(p) == 0 && dup2(p[0], s[1]) == s[1], "dup2 a pipe over the socket");
	CHECK(write(p[1], "xyz", 3) == 3, "write the pipe");
	char b[8];
	ssize_t r = read(s[1], b, sizeof(b));
	CHECK(r == 3 && memcmp(b, "xyz", 3) == 0, "read %zd bytes after the dup2, want the pipe's 3", r);
	close(p[0]);
	close(p[1]);
	close(s[1]);
	close(s[0]);
}

// The shim's thread stashes while an application thread reads the same
// socket without pause: no byte lost, none out of order.
#define RACE_BYTES (64u << 20)
struct race {
	int fd;
	_Atomic int done, stop;
	int ok;
};

// race_check checks r bytes read at stream offset *at against the
// writer's pattern, and moves *at on.
static void race_check(struct race *x, const unsigned char *b, ssize_t r, uint64_t *at, const char *name)
{
	for (ssize_t i = 0; i < r; i++)
		if (b[i] != pat(5, *at + i)) {
			fprintf(stderr, "%s: byte %llu out of order\n", name, (unsigned long long)(*at + i));
			x->ok = 0;
			break;
		}
	*at += (uint64_t)r;
}

// race_reader polls without blocking, as UCX's progress loop does: its
// calls overlap the drains' far more often than a blocked reader's would.
static void *race_reader(void *arg)
{
	struct race *x = arg;
	unsigned char b[4096];
	uint64_t at = 0;
	x->ok = 1;
	while (at < RACE_BYTES && x->ok && !atomic_load(&x->stop)) {
		ssize_t r = recv(x->fd, b, sizeof(b), MSG_DONTWAIT);
		if (r < 0 && errno == EAGAIN)
			continue;
		if (r <= 0) {
			x->ok = 0;
			break;
		}
		race_check(x, b, r, &at, "stash_race");
	}
	atomic_store(&x->done, 1);
	return NULL;
}

static void *race_writer(void *arg)
{
	uint64_t at = 0;
	send_all(*(int *)arg, RACE_BYTES, 5, &at);
	return NULL;
}

// race_alias_reader reads the socket through descriptors of its own, made
// and closed as it goes (dup, fcntl F_DUPFD), while the shim's thread
// stashes through the original: the stash belongs to the socket, so every
// descriptor gets the stream in order, whoever drained it.
static void *race_alias_reader(void *arg)
{
	struct race *x = arg;
	unsigned char b[4096];
	uint64_t at = 0;
	unsigned n = 0;
	int mine = dup(x->fd);
	x->ok = mine >= 0;
	while (at < RACE_BYTES && x->ok && !atomic_load(&x->stop)) {
		if (++n % 512 == 0) {
			int next = n % 1024 ? dup(mine) : fcntl(mine, F_DUPFD_CLOEXEC, 0);
			close(mine);
			mine = next;
			if (mine < 0) {
				x->ok = 0;
				break;
			}
		}
		ssize_t r = n % 3 ? recv(mine, b, sizeof(b), MSG_DONTWAIT) : recv(x->fd, b, sizeof(b), MSG_DONTWAIT);
		if (r < 0 && errno == EAGAIN)
			continue;
		if (r <= 0) {
			x->ok = 0;
			break;
		}
		race_check(x, b, r, &at, "stash_race_aliases");
	}
	if (mine >= 0)
		close(mine);
	atomic_store(&x->done, 1);
	return NULL;
}

static void stash_race(void *(*reader)(void *), const char *name)
{
	int s[2];
	tcp_pair(s, 0);
	struct race r = {.fd = s[1]};
	pthread_t rd, wr;
	pthread_create(&rd, NULL, reader, &r);
	pthread_create(&wr, NULL, race_writer, &s[0]);
	long stashed = 0, calls = 0;
	time_t end = time(NULL) + 120; // bytes lost would leave the reader waiting for ever
	while (!atomic_load(&r.done)) {
		ssize_t m = stash_fd(s[1], 0);
		stashed += m > 0;
		calls++;
		if ((calls & 1023) == 0 && time(NULL) > end) {
			atomic_store(&r.stop, 1);
			r.ok = 0;
		}
	}
	pthread_join(rd, NULL);
	if (!r.ok)
		shutdown(s[0], SHUT_RDWR); // frees a writer blocked on a full window
	pthread_join(wr, NULL);
	printf("     %s: %ld of %ld drains took bytes\n", name, stashed, calls);
	CHECK(r.ok, "the reader saw bytes lost or out of order");
	CHECK(stashed > 0, "no drain took a byte while the reader read: the test proved nothing");
	close(s[0]);
	close(s[1]);
}

static void test_stash_race_aliases(void)
{
	stash_race(race_alias_reader, "stash_race_aliases");
}

static void test_stash_race(void)
{
	stash_race(race_reader, "stash_race");
}

// fork_race: one thread forks while the others stash, read, hold and
// flush. Only the forking thread goes on in the child, and any other may
// have been inside a critical section at the fork (a buffer freed and not
// yet forgotten, an array moved by realloc): the child's shim must start
// from what it can trust, and the child exit cleanly.
enum {
	FORKS = 3000
};
struct fork_race {
	_Atomic int stop;
	int hold_fd;
	long forks, bad, holds;
};

static void *fork_loop(void *arg)
{
	struct fork_race *f = arg;
	while (f->forks < FORKS && f->bad == 0) {
		pid_t p = fork();
		if (p == 0)
			_exit(0);
		if (p < 0) {
			fprintf(stderr, "     fork_race: fork: %s\n", strerror(errno));
			f->bad++;
			break;
		}
		int st = 0;
		if (waitpid(p, &st, 0) != p || !WIFEXITED(st) || WEXITSTATUS(st) != 0) {
			fprintf(stderr, "     fork_race: child %d of %ld ended with status 0x%x\n", (int)p, f->forks + 1, st);
			f->bad++;
		}
		f->forks++;
	}
	atomic_store(&f->stop, 1);
	return NULL;
}

// hold_loop writes under a closed gate (each send becomes a held buffer)
// and opens it (each is sent and freed), again and again.
static void *hold_loop(void *arg)
{
	struct fork_race *f = arg;
	char b[512];
	memset(b, 'h', sizeof(b));
	while (!atomic_load(&f->stop)) {
		gate_close();
		for (int i = 0; i < 8; i++)
			if (send(f->hold_fd, b, sizeof(b), 0) == (ssize_t)sizeof(b))
				f->holds++;
		struct mpp_gate_stats st;
		gate_open(&st);
	}
	return NULL;
}

static void *discard_loop(void *arg)
{
	char b[4096];
	while (read(*(int *)arg, b, sizeof(b)) > 0)
		;
	return NULL;
}

static void test_fork_race(void)
{
	int s[2], h[2];
	tcp_pair(s, 0);
	tcp_pair(h, 0);
	struct race r = {.fd = s[1]};
	struct fork_race f = {.hold_fd = h[0]};
	pthread_t rd, wr, fk, hd, dc;
	pthread_create(&rd, NULL, race_alias_reader, &r);
	pthread_create(&wr, NULL, race_writer, &s[0]);
	pthread_create(&dc, NULL, discard_loop, &h[1]);
	pthread_create(&hd, NULL, hold_loop, &f);
	pthread_create(&fk, NULL, fork_loop, &f);
	long stashed = 0;
	while (!atomic_load(&f.stop) && !atomic_load(&r.done))
		stashed += stash_fd(s[1], 0) > 0;
	atomic_store(&f.stop, 1);
	atomic_store(&r.stop, 1);
	pthread_join(fk, NULL);
	pthread_join(hd, NULL);
	pthread_join(rd, NULL);
	shutdown(s[0], SHUT_RDWR); // frees a writer blocked on a full window
	pthread_join(wr, NULL);
	shutdown(h[0], SHUT_RDWR);
	pthread_join(dc, NULL);
	printf("     fork_race: %ld forks, %ld drains took bytes, %ld sends held\n", f.forks, stashed, f.holds);
	CHECK(f.bad == 0, "a child did not exit cleanly after its fork");
	CHECK(r.ok, "the reader saw bytes lost or out of order");
	CHECK(f.forks > 0 && stashed > 0 && f.holds > 0, "forks, drains or holds did not overlap: the test proved nothing");
	close(s[0]);
	close(s[1]);
	close(h[0]);
	close(h[1]);
}

int main(int argc, char **argv)
{
	if (argc == 3 && strcmp(argv[1], "--child") == 0)
		return child(argv[2]);
	if (argc == 3 && strcmp(argv[1], "--kill") == 0)
		return kill(atoi(argv[2]), SIGSTOP) == 0 ? 0 : 1;
	gate_close = (void (*)(void))dlsym(RTLD_DEFAULT, "mpipause_gate_close");
	gate_open = (void (*)(struct mpp_gate_stats *))dlsym(RTLD_DEFAULT, "mpipause_gate_open");
	gate_state = (void (*)(struct mpp_gate_stats *))dlsym(RTLD_DEFAULT, "mpipause_gate_state");
	stash_fd = (ssize_t(*)(int, unsigned long))dlsym(RTLD_DEFAULT, "mpipause_test_stash");
	if (!gate_close || !gate_open || !gate_state || !stash_fd) {
		fprintf(stderr, "FAIL: libmpipause.so is not preloaded (run: make -C libmpi-shim test)\n");
		return 1;
	}
	signal(SIGPIPE, SIG_IGN);
	const struct test tests[] = {
		{"passthrough", test_passthrough},
		{"hold_and_flush", test_hold_and_flush},
		{"hold_huge", test_hold_huge},
		{"call_boundary", test_call_boundary},
		{"threads", test_threads},
		{"close_with_held", test_close_with_held},
		{"signal_during_blocked_send", test_signal_during_blocked_send},
		{"signals", test_signals},
		{"stop_overtaken", test_stop_overtaken},
		{"launcher_stop", test_launcher_stop},
		{"join_line", test_join_line},
		{"join_ok", test_join_ok},
		{"join_refused", test_join_refused},
		{"join_skipped", test_join_skipped},
		{"gate_page", test_gate_page},
		{"receive_under_closed_gate", test_receive_under_closed_gate},
		{"stash_order", test_stash_order},
		{"stash_new_socket", test_stash_new_socket},
		{"stash_calls", test_stash_calls},
		{"stash_close", test_stash_close},
		{"stash_race", test_stash_race},
		{"stash_race_aliases", test_stash_race_aliases},
		{"fork_race", test_fork_race},
		{"stash_reused_number", test_stash_reused_number},
		{"stash_dup2", test_stash_dup2},
		{"stash_acks", test_stash_acks},
		{"flush_overtaken", test_flush_overtaken},
	};
	return RUN_TESTS(tests);
}
