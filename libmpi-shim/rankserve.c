// SPDX-License-Identifier: Apache-2.0
//
// What the shim's thread does on the rank channel (rankchan.c keeps the
// connection): it answers mpid's requests, one answer a request, in order
// (the gate's CLOSE, REOPEN, OPEN and STATE, and the drain's DRAIN with its
// set of cookies); it passes on what the signal handler saw (sig.c) as
// unasked EVENT lines; and, while a pause drains, it watches the job's own
// sockets in the same poll and moves what arrives into their stashes
// (stash.c, drain.c). One thread does all three so that an answer never
// overtakes an EVENT it follows from, and no lock is needed between them.
#include "shim.h"
#include "rankchan.h"
#include "req.h"

#include <dirent.h>
#include <errno.h>
#include <netinet/in.h>
#include <poll.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>

static const char *gate_name(int g)
{
	return g == GATE_OPEN ? "open" : (g == GATE_CLOSED ? "closed" : "flushing");
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

// mpp_rankch_drain_init reads MPIPAUSE_RECV_DRAIN, once a rank registers.
void mpp_rankch_drain_init(void)
{
	const char *rd = getenv("MPIPAUSE_RECV_DRAIN");
	drain_disabled = rd != NULL && strcmp(rd, "0") == 0;
}

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
		if (*end || e->d_name[0] == '.' || fd == dirfd(d) || fd == mpp_rankch_fd)
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
	return mpp_rankch_send_line(out);
}

// drain_ack acknowledges at once what the program read of every watched
// socket before the DRAIN. On a connection carrying traffic both ways the
// kernel holds the ACK of a small read for its delayed-ACK timer, hoping
// to send it with the reader's next bytes; a rank whose gate closed sends
// none, and the pause's drain, which waits for every sender's queue to
// empty, would wait for the timer. What is read from now on, by the drain
// or the program, is acknowledged as it is read (mpp_quickack).
static void drain_ack(void)
{
	for (int i = 0; i < drain_n; i++)
		if (drain_fds[i].fd >= 0)
			mpp_quickack(drain_fds[i].fd);
}

// drain_start answers a DRAIN whose set is complete: unless the drain is
// disabled or the gate is not closed, the sockets it names
// are scanned, drained a first time and acknowledged.
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
	drain_ack();
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
		if (mpp_rankch_send_line("ERROR drain set cut short\n") < 0)
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
		if (mpp_rankch_send_line(f < 0 ? "REOPENED stale\n" : "REOPENED\n") < 0)
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
	if (mpp_rankch_send_line(out) < 0)
		return -1;
	return full_check();
}

// emptied says whether fd, readable when polled, has nothing waiting now
// and has not ended: an application thread read the bytes between the poll
// and the drain. The socket stays watched (its next bytes wake the poll),
// where dropping it as ended would leave whatever its peer sends next to
// the application alone, which may not read before the pause's deadline
// (a rank computing, or starved of CPU): the drain would never finish.
static int emptied(int fd)
{
	char c;
	int saved = errno;
	ssize_t r = REAL(recv)(fd, &c, 1, MSG_PEEK | MSG_DONTWAIT);
	int empty = r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK);
	errno = saved;
	return empty;
}

// mpp_rankch_serve answers mpid's requests and passes the signals the handler
// saw on as unsolicited "EVENT pause at=<ns>" / "EVENT resume at=<ns>" lines, until the
// channel ends.
void mpp_rankch_serve(int sigfd)
{
	char buf[256];
	size_t have = 0;

	for (;;) {
		struct pollfd p[2 + DRAIN_MAX] = {{.fd = mpp_rankch_fd, .events = POLLIN}, {.fd = sigfd, .events = POLLIN}};
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
			else if (m == 0 && !emptied(p[i].fd))
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
					snprintf(out, sizeof(out), "EVENT %s at=%lld%s\n", rec.sig == 'C' ? "resume" : "pause",
						 (long long)rec.ns, rec.sig == 't' ? " overtaken" : "");
				else
					snprintf(out, sizeof(out), "EVENT %s%s\n", rec.sig == 'C' ? "resume" : "pause",
						 rec.sig == 't' ? " overtaken" : "");
				if (mpp_rankch_send_line(out) < 0)
					goto gone;
			}
		}
		if (!(p[0].revents & (POLLIN | POLLHUP | POLLERR)))
			continue;
		ssize_t r = REAL(recv)(mpp_rankch_fd, buf + have, sizeof(buf) - 1 - have, 0);
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
	REAL(shutdown)(mpp_rankch_fd, SHUT_RDWR);
}
