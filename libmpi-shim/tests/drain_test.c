// SPDX-License-Identifier: Apache-2.0
//
// C tests of the receive-side drain as mpid drives it, over the real rank
// channel (rankchan.c) with libmpipause.so preloaded: this process plays mpid
// on an abstract unix socket, and the rank's part with loopback TCP pairs.
// Run by `make -C libmpi-shim test` with MPIPAUSE_STASH_MAX_MB=1.
//
// - only_job_sockets: a process with a connection of its own (a database
//   client) and a job connection; mpid's DRAIN names only the job one, by
//   its cookie. The drain stashes the job socket's bytes and leaves the
//   other's in the kernel, so a raw read(2) there (a call the shim does not
//   wrap) sees its stream in order: "FIRST-" before "SECOND".
// - aliases: a job socket read by several descriptors (dup, F_DUPFD, one
//   made after the drain) with the one the drain read through closed: the
//   stash belongs to the socket, so each read gets the stream in order.
// - unheld: a call the gate cannot hold, under the closed gate, is named to
//   mpid ("EVENT unheld": the call, the descriptor, the socket's cookie).
// - cap: past MPIPAUSE_STASH_MAX_MB the drain takes nothing more, the rest
//   stays in the kernel, and the shim tells mpid ("EVENT stash full"); after
//   the reopen every byte reaches the program in order.
// - read_first: the program reads a drained socket itself, often before
//   the drain's thread does; once it stops, what arrives next is drained.
// - acks: the ACK of bytes the program read before the gate closed, held
//   by the kernel's delayed-ACK timer, goes with the DRAIN.
// - huge: MiBs drained go into memory the kernel may back with transparent
//   huge pages, and come back in order.
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <signal.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <linux/sockios.h>
#include <sys/syscall.h>
#include <sys/un.h>
#include <unistd.h>

#include "check.h"

#ifndef SO_COOKIE
#define SO_COOKIE 57
#endif

static size_t (*stash_bytes)(void);
static size_t (*stash_max)(void);
static void (*set_max)(size_t);
static void *(*stash_buf)(int, size_t *);

// The fake mpid's end of the rank channel, and what it has read of it.
static int chan = -1;
static char got[8192];
static size_t have;

// line waits (at most 5 s) for the next line from the shim that starts
// with prefix, skipping others, and copies it to out without its newline.
static int line(const char *prefix, char *out, size_t n)
{
	for (;;) {
		char *nl;
		while ((nl = memchr(got, '\n', have))) {
			size_t l = (size_t)(nl - got);
			int match = strncmp(got, prefix, strlen(prefix)) == 0;
			if (match) {
				snprintf(out, n, "%.*s", (int)l, got);
			}
			have -= l + 1;
			memmove(got, nl + 1, have);
			if (match)
				return 0;
		}
		struct pollfd p = {.fd = chan, .events = POLLIN};
		if (poll(&p, 1, 5000) != 1 || have == sizeof(got))
			return -1;
		ssize_t r = recv(chan, got + have, sizeof(got) - have, 0);
		if (r <= 0)
			return -1;
		have += (size_t)r;
	}
}

static int say(const char *s)
{
	return send(chan, s, strlen(s), MSG_NOSIGNAL) == (ssize_t)strlen(s) ? 0 : -1;
}

// peer_send is the other end's send: another process's in a real job, so
// it goes straight to the kernel, past this process's closed gate.
static ssize_t peer_send(int fd, const void *b, size_t n)
{
	return syscall(SYS_sendto, fd, b, n, 0, NULL, 0);
}

static uint64_t cookie(int fd)
{
	uint64_t c = 0;
	socklen_t l = sizeof(c);
	if (getsockopt(fd, SOL_SOCKET, SO_COOKIE, &c, &l) < 0)
		die("SO_COOKIE");
	return c;
}

// unread is what the kernel holds unread for fd.
static int unread(int fd)
{
	int q = -1;
	ioctl(fd, FIONREAD, &q);
	return q;
}

// queued waits (at most 5 s, by polling the kernel's count) until fd's
// receive queue holds n bytes.
static int queued(int fd, int n)
{
	for (int i = 0; i < 5000 && unread(fd) < n; i++)
		usleep(1000);
	return unread(fd);
}

// delivered waits (at most 5 s) until the peer acknowledged all fd sent:
// the bytes are in the receiver's queue or read from it, whoever read them.
static int delivered(int fd)
{
	int q = -1;
	for (int i = 0; i < 5000; i++) {
		if (ioctl(fd, SIOCOUTQ, &q) == 0 && q == 0)
			return 1;
		usleep(1000);
	}
	return 0;
}

// drain sends "DRAIN <n>" and the cookies as mpid does, and returns the
// shim's answer in out.
static int drain(const uint64_t *ck, int n, char *out, size_t outn)
{
	char b[256];
	snprintf(b, sizeof(b), "DRAIN %d\n", n);
	if (say(b) < 0)
		return -1;
	for (int i = 0; i < n; i++) {
		snprintf(b, sizeof(b), "C %llx\n", (unsigned long long)ck[i]);
		if (say(b) < 0)
			return -1;
	}
	return line("DRAINING", out, outn);
}

static void test_only_job_sockets(void)
{
	int job[2], own[2];
	char b[64], out[256];
	tcp_pair(job, 0);
	tcp_pair(own, 0);

	CHECK(say("CLOSE\n") == 0 && line("CLOSED", out, sizeof(out)) == 0 && strstr(out, "gate=closed"),
	      "close: %s", out);
	CHECK(peer_send(own[0], "FIRST-", 6) == 6 && peer_send(job[0], "job-bytes", 9) == 9, "send");
	CHECK(delivered(own[0]) && delivered(job[0]), "bytes did not arrive");
	uint64_t ck = cookie(job[1]);
	CHECK(drain(&ck, 1, out, sizeof(out)) == 0, "no DRAINING answer");
	char answer[256];
	snprintf(answer, sizeof(answer), "%s", out);
	int own_left = unread(own[1]);
	CHECK(unread(job[1]) == 0, "the job socket still holds %d bytes", unread(job[1]));
	// More arrives on the job socket while the gate stays closed: the
	// shim's thread takes it.
	CHECK(peer_send(job[0], "more", 4) == 4 && delivered(job[0]), "send");
	for (int i = 0; i < 5000 && unread(job[1]) != 0; i++)
		usleep(1000);
	CHECK(unread(job[1]) == 0, "the drain left %d bytes on the job socket", unread(job[1]));

	// The resume; then the rest of the other stream arrives, and the
	// program reads it with a call the shim does not wrap.
	CHECK(say("OPEN\n") == 0 && line("OPENED", out, sizeof(out)) == 0, "open: %s", out);
	CHECK(peer_send(own[0], "SECOND", 6) == 6 && delivered(own[0]), "send");
	ssize_t r = syscall(SYS_read, own[1], b, 12);
	CHECK(r == 12 && memcmp(b, "FIRST-SECOND", 12) == 0,
	      "raw read got %zd bytes: %.*s, want FIRST-SECOND (the drain took FIRST- into its stash?)", r,
	      (int)(r > 0 ? r : 0), b);
	CHECK(strcmp(answer, "DRAINING sockets=1 stashed=9") == 0, "answer %s, want the job socket alone, 9 bytes",
	      answer);
	CHECK(own_left == 6, "the process's own socket held %d bytes in the kernel after the DRAIN, want 6", own_left);
	r = recv(job[1], b, sizeof(b), 0);
	CHECK(r == 13 && memcmp(b, "job-bytesmore", 13) == 0, "the job socket gave %zd bytes: %.*s", r,
	      (int)(r > 0 ? r : 0), b);
	CHECK(stash_bytes() == 0, "%zu bytes left in the stashes", stash_bytes());
	close(job[0]), close(job[1]), close(own[0]), close(own[1]);
}

// aliases: three descriptors of one job socket (its own, dup, fcntl's
// F_DUPFD_CLOEXEC) when the DRAIN comes, a fourth made while its stash
// holds bytes, and the one the drain read through closed: every read, by
// any of them, gets the stream in order, nothing twice, nothing lost.
static void test_aliases(void)
{
	int job[2];
	char b[64], out[256];
	tcp_pair(job, 0);
	int b1 = dup(job[1]), b2 = fcntl(job[1], F_DUPFD_CLOEXEC, 0);
	CHECK(b1 >= 0 && b2 >= 0, "dup");
	CHECK(say("CLOSE\n") == 0 && line("CLOSED", out, sizeof(out)) == 0 && strstr(out, "gate=closed"),
	      "close: %s", out);
	CHECK(peer_send(job[0], "one-", 4) == 4 && delivered(job[0]), "send");
	uint64_t ck = cookie(job[1]);
	CHECK(drain(&ck, 1, out, sizeof(out)) == 0, "no DRAINING answer");
	char answer[256];
	snprintf(answer, sizeof(answer), "%s", out);
	CHECK(unread(job[1]) == 0, "the job socket still holds %d bytes", unread(job[1]));
	int b3 = dup(b2);
	CHECK(b3 >= 0, "dup");
	close(job[1]);
	CHECK(say("OPEN\n") == 0 && line("OPENED", out, sizeof(out)) == 0, "open: %s", out);
	CHECK(peer_send(job[0], "two-", 4) == 4 && delivered(job[0]), "send");
	// two- is in the kernel, one- in the stash: each descriptor must give
	// one- first.
	ssize_t r = recv(b3, b, 2, 0);
	CHECK(r == 2 && memcmp(b, "on", 2) == 0, "the descriptor made after the drain read %zd bytes: %.*s, want on", r,
	      (int)(r > 0 ? r : 0), b);
	r = read(b1, b, 2);
	CHECK(r == 2 && memcmp(b, "e-", 2) == 0, "dup read %zd bytes: %.*s, want e-", r, (int)(r > 0 ? r : 0), b);
	r = recv(b2, b, sizeof(b), 0);
	CHECK(r == 4 && memcmp(b, "two-", 4) == 0, "F_DUPFD read %zd bytes: %.*s, want two-", r, (int)(r > 0 ? r : 0),
	      b);
	CHECK(stash_bytes() == 0, "%zu bytes left in the stashes", stash_bytes());
	CHECK(strcmp(answer, "DRAINING sockets=1 stashed=4") == 0, "answer %s, want one socket, 4 bytes", answer);
	close(job[0]), close(b1), close(b2), close(b3);
}

// read_first: the program reads its job socket itself, a thread blocked
// in recv when the bytes come: the drain's thread sees the socket readable
// but may not read it while a program's read is under way, and when it
// looks again the program has taken the bytes (readable, nothing to
// move). Once the program stops reading (a rank that computes, or gets no
// CPU), what its peer sends next must still be drained: a socket the
// program emptied has not ended.
struct reader {
	int fd;
	pid_t tid;
	ssize_t got;
	char b;
};

static void *read_one(void *arg)
{
	struct reader *r = arg;
	__atomic_store_n(&r->tid, (pid_t)syscall(SYS_gettid), __ATOMIC_SEQ_CST);
	r->got = recv(r->fd, &r->b, 1, 0);
	return NULL;
}

// sleeping says whether thread tid of this process is asleep (state S).
static int sleeping(pid_t tid)
{
	char path[64], st[256];
	snprintf(path, sizeof(path), "/proc/self/task/%d/stat", (int)tid);
	FILE *f = fopen(path, "r");
	if (!f)
		return 0;
	size_t n = fread(st, 1, sizeof(st) - 1, f);
	fclose(f);
	st[n] = 0;
	char *p = strrchr(st, ')');
	return p && p[1] == ' ' && p[2] == 'S';
}

static void test_read_first(void)
{
	int job[2];
	char b[64], out[256];
	tcp_pair(job, 0);
	CHECK(say("CLOSE\n") == 0 && line("CLOSED", out, sizeof(out)) == 0 && strstr(out, "gate=closed"),
	      "close: %s", out);
	uint64_t ck = cookie(job[1]);
	CHECK(drain(&ck, 1, out, sizeof(out)) == 0, "no DRAINING answer");
	for (int i = 0; i < 10; i++) {
		struct reader r = {.fd = job[1]};
		pthread_t t;
		CHECK(pthread_create(&t, NULL, read_one, &r) == 0, "thread");
		int asleep = 0;
		for (int w = 0; w < 5000 && !asleep; w++) {
			pid_t tid = __atomic_load_n(&r.tid, __ATOMIC_SEQ_CST);
			asleep = tid > 0 && sleeping(tid);
			if (!asleep)
				usleep(1000);
		}
		CHECK(asleep, "the reading thread never blocked in recv");
		CHECK(peer_send(job[0], "x", 1) == 1, "send %d", i);
		pthread_join(t, NULL);
		CHECK(r.got == 1 && r.b == 'x', "read %d: %zd bytes", i, r.got);
	}
	CHECK(peer_send(job[0], "tail", 4) == 4 && delivered(job[0]), "send");
	for (int i = 0; i < 5000 && unread(job[1]) != 0; i++)
		usleep(1000);
	CHECK(unread(job[1]) == 0, "the drain left %d bytes in the kernel once the program stopped reading",
	      unread(job[1]));
	CHECK(say("OPEN\n") == 0 && line("OPENED", out, sizeof(out)) == 0, "open: %s", out);
	ssize_t r = recv(job[1], b, sizeof(b), 0);
	CHECK(r == 4 && memcmp(b, "tail", 4) == 0, "the job socket gave %zd bytes: %.*s, want tail", r,
	      (int)(r > 0 ? r : 0), b);
	CHECK(stash_bytes() == 0, "%zu bytes left in the stashes", stash_bytes());
	close(job[0]), close(job[1]);
}

// unheld: calls the gate cannot hold (MSG_ZEROCOPY, sendmsg with
// ancillary data) on a socket under the closed gate go to the kernel, and
// the shim tells mpid which call, on which descriptor of which socket
// ("EVENT unheld"), so the pause fails naming it.
static void test_unheld(void)
{
	int job[2];
	char out[256], want[256];
	tcp_pair(job, 0);
	CHECK(say("CLOSE\n") == 0 && line("CLOSED", out, sizeof(out)) == 0 && strstr(out, "gate=closed"),
	      "close: %s", out);
	CHECK(send(job[1], "z", 1, MSG_ZEROCOPY) == 1, "send MSG_ZEROCOPY: %s", strerror(errno));
	snprintf(want, sizeof(want), "EVENT unheld call=msg-zerocopy fd=%d cookie=%llx", job[1],
		 (unsigned long long)cookie(job[1]));
	CHECK(line("EVENT unheld", out, sizeof(out)) == 0 && strcmp(out, want) == 0, "got %s, want %s", out, want);
	union {
		char b[CMSG_SPACE(sizeof(uint32_t))];
		struct cmsghdr align;
	} cb;
	memset(&cb, 0, sizeof(cb));
	struct iovec v = {.iov_base = "a", .iov_len = 1};
	struct msghdr m = {.msg_iov = &v, .msg_iovlen = 1, .msg_control = cb.b, .msg_controllen = sizeof(cb.b)};
	struct cmsghdr *c = CMSG_FIRSTHDR(&m);
	c->cmsg_level = SOL_SOCKET;
	c->cmsg_type = SO_TIMESTAMPING;
	c->cmsg_len = CMSG_LEN(sizeof(uint32_t));
	CHECK(sendmsg(job[1], &m, 0) == 1, "sendmsg with ancillary data: %s", strerror(errno));
	snprintf(want, sizeof(want), "EVENT unheld call=sendmsg-ancillary fd=%d cookie=%llx", job[1],
		 (unsigned long long)cookie(job[1]));
	CHECK(line("EVENT unheld", out, sizeof(out)) == 0 && strcmp(out, want) == 0, "got %s, want %s", out, want);
	CHECK(say("OPEN\n") == 0 && line("OPENED", out, sizeof(out)) == 0, "open: %s", out);
	char b[8];
	CHECK(queued(job[0], 2) == 2 && recv(job[0], b, sizeof(b), 0) == 2 && memcmp(b, "za", 2) == 0,
	      "the peer did not get za");
	close(job[0]), close(job[1]);
}

struct sender {
	int fd;
	size_t n;
	ssize_t sent;
};

static unsigned char pat(size_t i)
{
	return (unsigned char)(i * 7 + i / 251);
}

static void *send_all(void *arg)
{
	struct sender *s = arg;
	unsigned char b[65536];
	size_t off = 0;
	while (off < s->n) {
		size_t k = s->n - off < sizeof(b) ? s->n - off : sizeof(b);
		for (size_t i = 0; i < k; i++)
			b[i] = pat(off + i);
		ssize_t r = peer_send(s->fd, b, k);
		if (r <= 0)
			break;
		off += (size_t)r;
	}
	s->sent = (ssize_t)off;
	return NULL;
}

static void test_cap(void)
{
	int job[2];
	char out[256];
	size_t max = stash_max();
	CHECK(max == 1 << 20, "MPIPAUSE_STASH_MAX_MB=1 gave a cap of %zu bytes", max);
	tcp_pair(job, 0);
	CHECK(say("CLOSE\n") == 0 && line("CLOSED", out, sizeof(out)) == 0, "close: %s", out);
	uint64_t ck = cookie(job[1]);
	CHECK(drain(&ck, 1, out, sizeof(out)) == 0 && strcmp(out, "DRAINING sockets=1 stashed=0") == 0, "drain: %s",
	      out);
	// Three times the cap, from a thread: what the stash cannot take stays
	// in the kernel and the sender blocks on a full window.
	struct sender s = {.fd = job[0], .n = 3 * max};
	pthread_t t;
	CHECK(pthread_create(&t, NULL, send_all, &s) == 0, "thread");
	int told = line("EVENT stash full", out, sizeof(out)) == 0;
	char want[128];
	snprintf(want, sizeof(want), "EVENT stash full bytes=%zu max=%zu", max, max);
	int ok = told && strcmp(out, want) == 0;
	size_t held = stash_bytes();
	int left = queued(job[1], 1);
	// Read everything back (the gate reopened first, as a resume does),
	// and check the stream: the stash's part, then the kernel's.
	say("OPEN\n");
	line("OPENED", out, sizeof(out));
	size_t at = 0;
	int order = 1;
	unsigned char b[65536];
	while (at < 3 * max) {
		ssize_t r = recv(job[1], b, sizeof(b), 0);
		if (r <= 0)
			break;
		for (ssize_t i = 0; i < r; i++)
			order &= b[i] == pat(at + (size_t)i);
		at += (size_t)r;
	}
	pthread_join(t, NULL);
	close(job[0]), close(job[1]);
	CHECK(told, "no \"EVENT stash full\" within 5 s (stashed %zu bytes)", held);
	CHECK(ok, "event %s, want %s", out, want);
	CHECK(held == max, "the stashes held %zu bytes at the event, want the cap, %zu", held, max);
	CHECK(left > 0, "the kernel held nothing past the cap: the drain did not stop");
	CHECK(at == 3 * max && order, "read back %zu of %zu bytes, in order: %d", at, 3 * max, order);
	CHECK(stash_bytes() == 0, "%zu bytes left in the stashes", stash_bytes());
}

// acks: a connection carrying traffic both ways is in delayed-ACK
// "ping-pong" mode, where the ACK of a small read waits for the receiver's
// next send or its delayed-ACK timer. A rank that read its last bytes
// before its gate closed sends nothing more, so the sender's queue, which
// the pause's drain waits to see empty, would hold them for the timer (up
// to 40 ms; 8 ms under the sockops cap). The DRAIN acknowledges them at
// once.
static void test_acks(void)
{
	int s[2], ok = 0, outq = 0;
	char b[100] = {0}, out[256];
	tcp_pair(s, 0);
	uint64_t ck = cookie(s[1]);
	for (int i = 0; i < 200 && !ok; i++) {
		// A request and an answer put s[1] in ping-pong mode; then a
		// request the program reads with its gate open.
		CHECK(send(s[0], b, 10, 0) == 10 && recv(s[1], b, 10, MSG_WAITALL) == 10, "request");
		CHECK(send(s[1], b, 10, 0) == 10 && recv(s[0], b, 10, MSG_WAITALL) == 10, "answer");
		CHECK(send(s[0], b, sizeof(b), 0) == (ssize_t)sizeof(b) &&
			      recv(s[1], b, sizeof(b), MSG_WAITALL) == (ssize_t)sizeof(b),
		      "read before the close");
		CHECK(say("CLOSE\n") == 0 && line("CLOSED", out, sizeof(out)) == 0, "close: %s", out);
		ioctl(s[0], SIOCOUTQ, &outq);
		if (outq == 0) {
			// Acknowledged already (not in ping-pong mode yet): again.
			CHECK(say("OPEN\n") == 0 && line("OPENED", out, sizeof(out)) == 0, "open: %s", out);
			continue;
		}
		CHECK(drain(&ck, 1, out, sizeof(out)) == 0, "no DRAINING answer");
		ioctl(s[0], SIOCOUTQ, &outq);
		CHECK(outq == 0,
		      "after the DRAIN the sender still waits for the ACK of %d bytes the program read before its gate closed",
		      outq);
		CHECK(say("OPEN\n") == 0 && line("OPENED", out, sizeof(out)) == 0, "open: %s", out);
		ok = 1;
	}
	CHECK(ok, "no delayed ACK in 200 tries: the test proved nothing");
	close(s[0]);
	close(s[1]);
}

// huge: MiBs drained go into a buffer the kernel may back with transparent
// huge pages (one fault per 2 MiB, not 512; faulting in 4 KiB pages cost
// the drain more CPU than its copy), grown there from malloc's memory, and
// read back in order.
static void test_huge(void)
{
	int job[2];
	char out[256], mode[32];
	size_t n = 8 << 20, was = stash_max(), cap = 0;
	set_max(64 << 20);
	tcp_pair(job, 0);
	CHECK(say("CLOSE\n") == 0 && line("CLOSED", out, sizeof(out)) == 0, "close: %s", out);
	uint64_t ck = cookie(job[1]);
	CHECK(drain(&ck, 1, out, sizeof(out)) == 0 && strcmp(out, "DRAINING sockets=1 stashed=0") == 0, "drain: %s",
	      out);
	struct sender sd = {.fd = job[0], .n = n};
	pthread_t t;
	CHECK(pthread_create(&t, NULL, send_all, &sd) == 0, "thread");
	for (int i = 0; i < 5000 && stash_bytes() < n; i++)
		usleep(1000);
	size_t held = stash_bytes();
	void *buf = stash_buf(job[1], &cap);
	int elig = buf ? thp_eligible(buf) : -1;
	thp_mode(mode, sizeof(mode));
	say("OPEN\n");
	line("OPENED", out, sizeof(out));
	size_t at = 0;
	int order = 1;
	unsigned char b[65536];
	while (at < n) {
		ssize_t r = recv(job[1], b, sizeof(b), 0);
		if (r <= 0)
			break;
		for (ssize_t i = 0; i < r; i++)
			order &= b[i] == pat(at + (size_t)i);
		at += (size_t)r;
	}
	pthread_join(t, NULL);
	close(job[0]), close(job[1]);
	set_max(was);
	CHECK(held == n, "the stash held %zu of the %zu bytes sent within 5 s", held, n);
	CHECK(buf != NULL && cap >= n, "the stash's buffer: %p, %zu bytes", buf, cap);
	if (strcmp(mode, "always") == 0 || strcmp(mode, "madvise") == 0)
		CHECK(elig == 1, "transparent huge pages are \"%s\" here, but the stash's buffer is not eligible (THPeligible %d)",
		      mode, elig);
	else
		CHECK(elig != 1, "transparent huge pages are \"%s\", yet the stash's buffer is eligible", mode);
	CHECK(at == n && order, "read back %zu of %zu bytes, in order: %d", at, n, order);
	CHECK(stash_bytes() == 0, "%zu bytes left in the stashes", stash_bytes());
}

// A DRAIN whose set is cut short by another request drains nothing and
// answers once; a malformed set is refused.
static void test_bad_sets(void)
{
	int job[2];
	char out[256];
	tcp_pair(job, 0);
	CHECK(say("CLOSE\n") == 0 && line("CLOSED", out, sizeof(out)) == 0, "close: %s", out);
	CHECK(peer_send(job[0], "xy", 2) == 2 && queued(job[1], 2) == 2, "send");
	char b[128];
	snprintf(b, sizeof(b), "DRAIN 2\nC %llx\nSTATE\n", (unsigned long long)cookie(job[1]));
	CHECK(say(b) == 0 && line("ERROR", out, sizeof(out)) == 0 && strcmp(out, "ERROR drain set cut short") == 0,
	      "cut short: %s", out);
	CHECK(line("STATE", out, sizeof(out)) == 0, "the request after it went unanswered");
	CHECK(say("DRAIN 65537\n") == 0 && line("ERROR", out, sizeof(out)) == 0, "DRAIN 65537: %s", out);
	CHECK(say("DRAIN 1\nC 12 34\n") == 0 && line("ERROR", out, sizeof(out)) == 0 &&
		      strcmp(out, "ERROR bad drain set") == 0,
	      "more cookies than announced: %s", out);
	CHECK(unread(job[1]) == 2, "a refused set drained: the kernel holds %d bytes", unread(job[1]));
	CHECK(say("OPEN\n") == 0 && line("OPENED", out, sizeof(out)) == 0, "open");
	close(job[0]), close(job[1]);
}

int main(void)
{
	void (*start)(const char *) = (void (*)(const char *))dlsym(RTLD_DEFAULT, "mpipause_test_rankch_start");
	void (*stop)(void) = (void (*)(void))dlsym(RTLD_DEFAULT, "mpipause_test_rankch_stop");
	stash_bytes = (size_t(*)(void))dlsym(RTLD_DEFAULT, "mpipause_test_stash_bytes");
	stash_max = (size_t(*)(void))dlsym(RTLD_DEFAULT, "mpipause_test_stash_max");
	set_max = (void (*)(size_t))dlsym(RTLD_DEFAULT, "mpipause_test_stash_set_max");
	stash_buf = (void *(*)(int, size_t *))dlsym(RTLD_DEFAULT, "mpipause_test_stash_buf");
	if (!start || !stop || !stash_bytes || !stash_max || !set_max || !stash_buf) {
		fprintf(stderr, "FAIL: libmpipause.so is not preloaded (run: make -C libmpi-shim test)\n");
		return 1;
	}
	signal(SIGPIPE, SIG_IGN);
	char name[64];
	snprintf(name, sizeof(name), "@mpipause-drain-test-%d", (int)getpid());
	struct sockaddr_un a = {.sun_family = AF_UNIX};
	size_t l = strlen(name);
	memcpy(a.sun_path, name, l);
	a.sun_path[0] = 0;
	int ln = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
	if (ln < 0 || bind(ln, (void *)&a, (socklen_t)(offsetof(struct sockaddr_un, sun_path) + l)) < 0 ||
	    listen(ln, 1) < 0)
		die("listen");
	setenv("MPIPAUSE_MPID_SOCKET", name, 1);
	start("HELLO 2 job=t rank=0 size=1 pid=1 host=h key=k\n");
	chan = accept4(ln, NULL, NULL, SOCK_CLOEXEC);
	if (chan < 0)
		die("accept");
	close(ln);
	char hello[256];
	if (line("HELLO", hello, sizeof(hello)) < 0) {
		fprintf(stderr, "FAIL: no HELLO\n");
		return 1;
	}
	const struct test tests[] = {
		{"only_job_sockets", test_only_job_sockets},
		{"aliases", test_aliases},
		{"read_first", test_read_first},
		{"unheld", test_unheld},
		{"cap", test_cap},
		{"bad_sets", test_bad_sets},
		{"acks", test_acks},
		{"huge", test_huge},
	};
	int rc = RUN_TESTS(tests);
	stop();
	return rc;
}
