// SPDX-License-Identifier: Apache-2.0
//
// The send gate's bookkeeping: each TCP socket's state, and the slow path
// of every wrapped send (mpp_gated), which, while the gate is not open,
// holds the bytes a process hands to its TCP sockets out of the kernel.
// Sending them at reopen, and a close's or a shutdown's wait for them, are
// flush.c's; the gate word, and what mpid and a forked child see of the
// gate, are gateword.c's.
//
// The wrappers' fast path (wrap.c; gate open): one relaxed atomic load,
// the real call, and one byte store recording whether the call was short.
// Nothing else, so that the return value and errno of every call are
// exactly the real call's.
//
// What is held belongs to the socket, not to the descriptor or the call
// that wrote it: every descriptor of one socket (dup, dup2, dup3, fcntl's
// F_DUPFD, SCM_RIGHTS, fdopen) maps to the socket's one state, found by
// the kernel's identity of the socket (SO_COOKIE) on the slow path, so a
// write by any route queues behind what another route left held.
//
// Closed gate, per TCP socket (G2, docs/guarantees.md): a socket whose last
// send call was short (the kernel took fewer bytes than asked: the library is
// in the middle of a message and will call again with the rest) stays open
// until one call completes in full; from then on it is gated. A gated
// socket's sends are accepted and held in the shim (accept-and-hold): the
// caller is told every byte went, nothing reaches the kernel, and the library
// goes on receiving, so the job's connections drain. Why hold rather than
// block or refuse with EAGAIN: blocking stops a single-threaded library from
// receiving, so its peers' bytes stay unread and the pause never converges; a
// synthetic EAGAIN leaves an edge-triggered event loop (UCX uses epoll with
// EPOLLET) waiting for an EPOLLOUT edge that never comes, because the
// kernel's socket was never full. Holding is invisible to the library.
//
// Receiving is never gated, and no fd but a TCP socket is held. While the
// gate is not open, a read that got bytes asks for a quick ACK (wrap.c).
#include "shim.h"
#include "gate.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <netinet/in.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdio.h>
#include <time.h>
#include <pthread.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/uio.h>
#include <unistd.h>

// Per-fd tables, sized from RLIMIT_NOFILE at load (at most MAX_FDS): the
// fast path's "last call short" flag, and each descriptor's socket. An fd
// beyond them is never gated: it passes through, and is counted.
#define MAX_FDS (1 << 20)
unsigned char *mpp_fd_short;      // last send call on fd was short
int mpp_nfds;                     // size of the tables
struct sock *_Atomic *mpp_fd_tab; // made on the slow path
int mpp_tab_hi;                   // mpp_fd_tab is empty from here on (under mpp_tab_mu)
#define fd_short mpp_fd_short
#define nfds mpp_nfds
pthread_mutex_t mpp_tab_mu = PTHREAD_MUTEX_INITIALIZER;

static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;
static size_t held_total, hold_max = (size_t)256 << 20;
static _Atomic unsigned long untracked; // gated-mode calls on fds beyond the tables
static _Atomic unsigned long lost;      // held bytes whose socket was gone (cookie changed)

void mpp_gate_init(void)
{
	struct rlimit rl;
	const char *e;

	nfds = 4096;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur > (rlim_t)nfds)
		nfds = rl.rlim_cur > MAX_FDS ? MAX_FDS : (int)rl.rlim_cur;
	fd_short = calloc(nfds, 1);
	mpp_fd_tab = calloc(nfds, sizeof(*mpp_fd_tab));
	if (!fd_short || !mpp_fd_tab) {
		free(fd_short);
		free(mpp_fd_tab);
		fd_short = NULL;
		mpp_fd_tab = NULL;
		nfds = 0;
	}
	if ((e = getenv("MPIPAUSE_HOLD_MAX_MB")) && atol(e) > 0)
		hold_max = (size_t)atol(e) << 20;
	mpp_shared_init();
}

// mpp_is_tcp reports whether fd is a TCP socket (IPv4 or IPv6), leaving errno
// as it found it.
int mpp_is_tcp(int fd)
{
	int saved = errno, v = 0, dom = 0;
	socklen_t l = sizeof(v);
	int ok = getsockopt(fd, SOL_SOCKET, SO_PROTOCOL, &v, &l) == 0 && v == IPPROTO_TCP;
	l = sizeof(dom);
	ok = ok && getsockopt(fd, SOL_SOCKET, SO_DOMAIN, &dom, &l) == 0 && (dom == AF_INET || dom == AF_INET6);
	errno = saved;
	return ok;
}

// find_sock is the state of socket c that another descriptor found, or
// NULL. Called with mpp_tab_mu held.
static struct sock *find_sock(uint64_t c)
{
	for (int i = 0; i < mpp_tab_hi; i++) {
		struct sock *t = atomic_load_explicit(&mpp_fd_tab[i], memory_order_relaxed);
		if (t && t->cookie == c)
			return t;
	}
	return NULL;
}

// mpp_bind_fd makes fd's entry name t. Called with mpp_tab_mu held. A state no
// entry names any more stays allocated: a thread may still hold it (it is
// never another socket's), and it is at most one per socket the process
// wrote with the gate not open.
void mpp_bind_fd(int fd, struct sock *t)
{
	struct sock *old = atomic_load_explicit(&mpp_fd_tab[fd], memory_order_relaxed);
	if (old == t)
		return;
	if (old)
		old->refs--;
	if (t)
		t->refs++;
	atomic_store_explicit(&mpp_fd_tab[fd], t, memory_order_release);
	if (t && fd >= mpp_tab_hi)
		mpp_tab_hi = fd + 1;
}

// mpp_sock_of is the state of socket c (fd's, by mpp_sock_cookie), made if no
// descriptor's entry has it yet; NULL if fd is beyond the tables or out of
// memory, or create is 0 and none has it.
struct sock *mpp_sock_of(int fd, uint64_t c, int create)
{
	struct sock *s;

	if ((unsigned)fd >= (unsigned)nfds || c == 0)
		return NULL;
	s = atomic_load_explicit(&mpp_fd_tab[fd], memory_order_acquire);
	if (s && s->cookie == c)
		return s;
	pthread_mutex_lock(&mpp_tab_mu);
	s = find_sock(c);
	if (!s && create && (s = calloc(1, sizeof(*s)))) {
		pthread_mutex_init(&s->mu, NULL);
		s->cookie = c;
		s->fd = fd;
		s->slot = -1;
		s->await = -1;
	}
	if (s)
		mpp_bind_fd(fd, s);
	pthread_mutex_unlock(&mpp_tab_mu);
	return s;
}

// hold_room waits, while the gate is closed, until the process holds less
// than hold_max: a bound on the shim's memory for a job that streams into a
// pause. The caller then sleeps like a sender on a full socket; a caller
// that would not sleep on a full socket (nonblock) gets EAGAIN instead, as
// the kernel would have told it.
static int hold_room(size_t n, int nonblock)
{
	pthread_mutex_lock(&hold_mu);
	while (held_total + n > hold_max && held_total > 0 &&
	       GATE_STATE(atomic_load_explicit(&mpp_gate, memory_order_acquire)) == GATE_CLOSED) {
		if (nonblock) {
			pthread_mutex_unlock(&hold_mu);
			errno = EAGAIN;
			return -1;
		}
		pthread_cond_wait(&hold_cv, &hold_mu);
	}
	held_total += n;
	pthread_mutex_unlock(&hold_mu);
	return 0;
}

void mpp_hold_release(size_t n)
{
	pthread_mutex_lock(&hold_mu);
	held_total -= n;
	pthread_cond_broadcast(&hold_cv);
	pthread_mutex_unlock(&hold_mu);
}

// mpp_hold_wake wakes the senders waiting for room (hold_room): the gate
// is no longer closed, so they go on.
void mpp_hold_wake(void)
{
	pthread_mutex_lock(&hold_mu);
	pthread_cond_broadcast(&hold_cv);
	pthread_mutex_unlock(&hold_mu);
}

// mpp_held_total is what the process holds now, its sockets together.
size_t mpp_held_total(void)
{
	size_t n;
	pthread_mutex_lock(&hold_mu);
	n = held_total;
	pthread_mutex_unlock(&hold_mu);
	return n;
}

// mpp_hold_child: in a forked child, which holds none of its parent's bytes,
// the room is all free, and a thread that does not go on in the child may
// have held hold_mu at the fork.
void mpp_hold_child(void)
{
	pthread_mutex_init(&hold_mu, NULL);
	pthread_cond_init(&hold_cv, NULL);
	held_total = 0;
}

// mpp_quickack: while the gate is not open, a read that got bytes, the
// drain that moved some or was started on the socket (a DRAIN), and a
// socket's first held send ask the kernel to acknowledge at once
// (TCP_QUICKACK: the pending delayed ACK goes now, and the socket leaves
// its ping-pong mode). The pause's drain waits for "nothing
// unacknowledged" on the sender's side, and the receiver's delayed ACK of
// the last segments read otherwise holds that queue for up to the
// delayed-ACK timeout (8 ms under the sockops cap). On a socket that is
// not TCP the call just fails. Out of line: the read wrappers' open-gate
// path never calls it.
__attribute__((noinline)) void mpp_quickack(int fd)
{
	int saved = errno, one = 1;
	setsockopt(fd, IPPROTO_TCP, TCP_QUICKACK, &one, sizeof(one));
	errno = saved;
}

// mpp_sock_cookie is the kernel's identity of fd's socket (SO_COOKIE),
// which no later socket shares, unlike its number or inode; 0 if fd is not
// a socket. errno is kept.
uint64_t mpp_sock_cookie(int fd)
{
	uint64_t c = 0;
	socklen_t l = sizeof(c);
	int saved = errno;
	if (getsockopt(fd, SOL_SOCKET, SO_COOKIE, &c, &l) < 0)
		c = 0;
	errno = saved;
	return c;
}

// mpipause_test_held is the first chunk fd's socket holds (NULL if none),
// for the C tests: the caller sends on it from no other thread meanwhile.
EXPORT void *mpipause_test_held(int fd)
{
	struct sock *s = fd >= 0 && fd < mpp_tab_hi ? atomic_load(&mpp_fd_tab[fd]) : NULL;
	void *h = NULL;
	if (s) {
		pthread_mutex_lock(&s->mu);
		h = s->head;
		pthread_mutex_unlock(&s->mu);
	}
	return h;
}

void mpp_held_free(struct held *h)
{
	mpp_big_free(h, sizeof(*h) + h->len);
}

// drop_held frees s's held queue unsent. Called with s->mu held.
static size_t drop_held(struct sock *s)
{
	size_t n = s->held;
	while (s->head) {
		struct held *h = s->head;
		s->head = h->next;
		mpp_held_free(h);
	}
	s->tail = NULL;
	s->held = 0;
	s->shut = 0;
	return n;
}

// mpp_gone reports the held bytes of a socket the application closed by a call
// the shim did not see (a raw close system call): they cannot be sent, and
// the fd number may already be another socket, which must not get them.
// Called with s->mu held; the caller gives the room back.
size_t mpp_gone(struct sock *s)
{
	size_t n = drop_held(s);
	atomic_fetch_add_explicit(&lost, n, memory_order_relaxed);
	mpp_publish(s);
	if (!getenv("MPIPAUSE_QUIET"))
		fprintf(stderr, "mpipause: %zu held bytes for fd %d not sent: its socket was closed by a call the shim does not wrap\n",
			n, s->fd);
	return n;
}

// append copies the call's bytes, written through fd, to the socket's
// held queue. Called with s->mu held.
static int append(struct sock *s, int fd, const struct iovec *iov, int iovcnt, size_t total, int oob)
{
	struct held *h = mpp_big_alloc(sizeof(*h) + total);
	size_t off = 0;

	if (!h)
		return -1;
	if (s->fd < 0)
		mpp_set_fd(s, fd);
	for (int i = 0; i < iovcnt; i++) {
		memcpy(h->data + off, iov[i].iov_base, iov[i].iov_len);
		off += iov[i].iov_len;
	}
	h->next = NULL;
	h->len = total;
	h->off = 0;
	h->oob = oob;
	if (s->tail)
		s->tail->next = h;
	else
		s->head = h;
	s->tail = h;
	if (s->held == 0)
		s->held_from = mpp_tcp_sent(fd);
	s->held += total;
	mpp_publish(s);
	return 0;
}

static size_t iov_total(const struct iovec *iov, int iovcnt)
{
	size_t t = 0;
	for (int i = 0; i < iovcnt; i++)
		t += iov[i].iov_len;
	return t;
}

static int nonblocking(int fd, int flags)
{
	int saved = errno, fl;
	if (flags & MSG_DONTWAIT)
		return 1;
	fl = REAL(fcntl)(fd, F_GETFL);
	errno = saved;
	return fl >= 0 && (fl & O_NONBLOCK);
}

// passes says whether a call with these flags goes to the kernel whatever
// the gate. MSG_FASTOPEN on a socket not yet connected is a connect that
// carries data: no connection has bytes to be held behind yet. MSG_ZEROCOPY
// promises the caller a completion for its own buffer, which a held copy
// cannot keep: it passes, and on a job connection the pause's kernel check
// reports bytes sent through a closed gate.
static int passes(int fd, int flags)
{
	if (flags & MSG_ZEROCOPY)
		return 1;
	if (flags & MSG_FASTOPEN) {
		struct sockaddr_storage a;
		socklen_t l = sizeof(a);
		int saved = errno, r = getpeername(fd, (struct sockaddr *)&a, &l);
		errno = saved;
		return r < 0;
	}
	return 0;
}
// mpp_unheld is called, with the gate not open, before a call on fd that
// goes to the kernel because it cannot be held without changing its
// meaning (what: which call): the socket's held bytes go first, now, so
// that nothing is reordered. Bytes on a job connection reach the kernel
// under a closed gate, which the pause's kernel check reports: the pause
// fails rather than commit (G1), naming the call (mpp_report_unheld), and
// stderr names it too.
void mpp_unheld(int fd, const char *what, char call)
{
	if (mpp_is_tcp(fd))
		mpp_report_unheld(fd, call, atomic_load(&mpp_gate), mpp_sock_cookie(fd));
	struct sock *s = mpp_sock_of(fd, mpp_sock_cookie(fd), 0);
	struct mpp_gate_stats st = {0};
	size_t n;

	if (!s)
		return;
	pthread_mutex_lock(&s->mu);
	n = s->held;
	pthread_mutex_unlock(&s->mu);
	if (n == 0)
		return;
	if (!getenv("MPIPAUSE_QUIET"))
		fprintf(stderr, "mpipause: %s on fd %d cannot be held: its socket's %zu held bytes go to the kernel first, under the closed gate\n",
			what, fd, n);
	mpp_flush_fd(s, &st, -1, 0);
}

// send_side_closed: the kernel would refuse a send on fd now (its state is
// past the application's shutdown, or closed by a reset). One getsockopt,
// on a socket's first held call of a closing.
static int send_side_closed(int fd)
{
	struct tcp_info ti;
	socklen_t l = sizeof(ti);
	if (getsockopt(fd, IPPROTO_TCP, TCP_INFO, &ti, &l) < 0)
		return 0;
	switch (ti.tcpi_state) {
	case TCP_FIN_WAIT1:
	case TCP_FIN_WAIT2:
	case TCP_TIME_WAIT:
	case TCP_CLOSE:
	case TCP_LAST_ACK:
	case TCP_CLOSING:
		return 1;
	}
	return 0;
}

// mpp_gated is the slow path of every wrapper: the gate is not open. real
// makes the caller's own call unchanged (for pass-through); iov describes
// its bytes (for holding); flags are the call's MSG_ flags, and
// MPP_CONSUMED when the caller already took the bytes from their source
// (sendfile, splice): then the call is never refused for lack of room. It
// returns what the call returns.
ssize_t mpp_gated(int fd, const struct iovec *iov, int iovcnt, int flags, ssize_t (*real)(void *), void *arg)
{
	struct sock *s;
	size_t total;
	ssize_t r;
	int g, first;

	if (!mpp_is_tcp(fd))
		return real(arg);
	s = mpp_sock_of(fd, mpp_sock_cookie(fd), 1);
	if (!s) {
		atomic_fetch_add_explicit(&untracked, 1, memory_order_relaxed);
		return real(arg);
	}
	total = iov_total(iov, iovcnt);
	if (atomic_load_explicit(&mpp_awaiting, memory_order_relaxed))
		mpp_child_wait(s);
	pthread_mutex_lock(&s->mu);
	// The descriptor the bytes go to may have gone by a call the shim does
	// not see (a close while the gate was open takes the fast path): this
	// caller's is the socket's, checked just now.
	if (s->fd != fd && (s->fd < 0 || mpp_sock_cookie(s->fd) != s->cookie))
		mpp_set_fd(s, fd);
	if (s->shut) {
		// The application shut the socket down behind its held bytes:
		// the kernel will refuse this call once they are sent, so the
		// shim refuses it now, as the kernel does (EPIPE, and SIGPIPE
		// unless MSG_NOSIGNAL).
		pthread_mutex_unlock(&s->mu);
		if (!(flags & MSG_NOSIGNAL))
			raise(SIGPIPE);
		errno = EPIPE;
		return -1;
	}
	if (passes(fd, flags)) {
		pthread_mutex_unlock(&s->mu);
		if (flags & MSG_ZEROCOPY)
			mpp_unheld(fd, "a send with MSG_ZEROCOPY", MPP_UNHELD_ZEROCOPY);
		else
			mpp_unheld(fd, "a send with MSG_FASTOPEN", MPP_UNHELD_FASTOPEN);
		return real(arg);
	}
	g = atomic_load_explicit(&mpp_gate, memory_order_acquire);
	if (GATE_STATE(g) != GATE_CLOSED) {
		// Open or flushing: bytes held earlier go first.
		if (s->head || s->flushing)
			goto hold;
		pthread_mutex_unlock(&s->mu);
		r = real(arg);
		mpp_note_short(fd, r, total);
		return r;
	}
	if (!s->gated && fd_short[fd]) {
		// Mid-message: this call may complete it. Not under the lock: it
		// can block, and the flush must not wait for it.
		pthread_mutex_unlock(&s->mu);
		r = real(arg);
		mpp_note_short(fd, r, total);
		if (r >= 0 && (size_t)r == total) {
			pthread_mutex_lock(&s->mu);
			s->gated = 1;
			mpp_publish(s);
			pthread_mutex_unlock(&s->mu);
		}
		return r;
	}
	if (!s->head && send_side_closed(fd)) {
		// Shut down (SHUT_WR, while the gate was open) or reset: the kernel
		// refuses the call, and held it would be reported written and
		// then lost at the flush. The kernel answers it now.
		pthread_mutex_unlock(&s->mu);
		return real(arg);
	}
	first = !s->gated;
	s->gated = 1;
	mpp_publish(s);
	// The send held here would have carried the ACK of what this rank last
	// read on the socket; held, it leaves that ACK to the delayed-ACK timer
	// (up to 8 ms under the sockops cap), and the peer's send queue, which
	// the drain waits to see empty, waits with it. In a ping-pong that was
	// most of a pause's DRAIN. Once per socket and pause.
	if (first)
		mpp_quickack(fd);
hold:
	if (total == 0) {
		pthread_mutex_unlock(&s->mu);
		return 0;
	}
	pthread_mutex_unlock(&s->mu);
	if (hold_room(total, !(flags & MPP_CONSUMED) && nonblocking(fd, flags)) < 0)
		return -1;
	pthread_mutex_lock(&s->mu);
	// The gate may have reopened and this socket's queue drained while we
	// waited for room: then the call goes straight to the kernel.
	if (GATE_STATE(atomic_load_explicit(&mpp_gate, memory_order_acquire)) != GATE_CLOSED && !s->head && !s->flushing) {
		pthread_mutex_unlock(&s->mu);
		mpp_hold_release(total);
		r = real(arg);
		mpp_note_short(fd, r, total);
		return r;
	}
	if (append(s, fd, iov, iovcnt, total, (flags & MSG_OOB) != 0) < 0) {
		pthread_mutex_unlock(&s->mu);
		mpp_hold_release(total);
		errno = ENOBUFS;
		return -1;
	}
	fd_short[fd] = 0;
	pthread_mutex_unlock(&s->mu);
	return (ssize_t)total;
}

void mpp_gate_state(struct mpp_gate_stats *st)
{
	memset(st, 0, sizeof(*st));
	st->gate = GATE_STATE(atomic_load_explicit(&mpp_gate, memory_order_acquire));
	for (int fd = 0; fd < nfds; fd++) {
		struct sock *s = atomic_load_explicit(&mpp_fd_tab[fd], memory_order_acquire);
		int gated = 0, counted = 0;

		if (s) {
			// A socket counts once, at the descriptor its bytes go to.
			pthread_mutex_lock(&s->mu);
			counted = s->fd == fd;
			if (counted)
				st->held += s->held;
			gated = s->gated;
			pthread_mutex_unlock(&s->mu);
		}
		if (gated)
			st->gated += counted;
		else if (st->gate == GATE_CLOSED && fd_short[fd] && mpp_is_tcp(fd))
			st->closing++; // mid-message: not at a call boundary yet
	}
	st->untracked = atomic_load_explicit(&untracked, memory_order_relaxed);
	st->lost = atomic_load_explicit(&lost, memory_order_relaxed);
}
