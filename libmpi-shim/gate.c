// SPDX-License-Identifier: Apache-2.0
//
// The send gate: wrappers of send, sendto, sendmsg, sendmmsg, write and
// writev that, while the gate is closed, keep the bytes a process hands to
// its TCP sockets out of the kernel.
//
// Fast path (gate open): one relaxed atomic load, the real call, and one
// byte store recording whether the call was short. Nothing else, so that the
// return value and errno of every call are exactly the real call's.
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
// Reopening flushes each socket's held bytes, in order, from the thread that
// reopens (the shim's thread), before any later send on that socket
// goes to the kernel: a send that arrives while its socket still has held
// bytes is appended to them.
//
// mpid may write the gate word itself (the shared gate page): closed in a
// new generation, then flushing in that generation at resume, before it
// asks for the flush ("REOPEN <gen>"). The shim never reopens a gate of
// another generation than the one it was asked to, and a flush stops at a
// chunk boundary when a newer close comes: a resume followed at once by a
// pause must not see the old resume's flush open the new pause's gate.
//
// Receiving is never gated, and no fd but a TCP socket is held. While the
// gate is not open, a read that got bytes asks for a quick ACK (wrap.c).
#include "shim.h"

#include <errno.h>
#include <fcntl.h>
#include <netinet/tcp.h>
#include <stdint.h>
#include <sys/mman.h>
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

union mpp_gate_page mpp_gate_pg __attribute__((aligned(MPP_GATE_PAGE_SIZE))); // GATE_OPEN

struct held {
	struct held *next;
	size_t len, off;
	int oob; // sent with MSG_OOB: its last byte is the urgent one
	char data[];
};

// One TCP socket's state: its gate and its held bytes. Made on the slow
// path for the socket of a descriptor, shared by every descriptor of that
// socket the slow path has seen, and never given to another socket.
struct sock {
	pthread_mutex_t mu;
	// The socket (SO_COOKIE, set at creation): a descriptor's number may
	// name another socket later, if the application closed it by a call
	// the shim does not see.
	uint64_t cookie;
	int gated;    // this socket has passed its call boundary under a closed gate
	int orphan;   // the application closed its descriptors; fd is the shim's dup
	int fd;       // the descriptor the bytes go to (moves on close), -1: none known
	int flushing; // the shim's thread is sending its held bytes
	int shut;     // a shutdown(SHUT_WR) waits for the held bytes (paths.c)
	int refs;     // fd_tab entries naming it (under tab_mu)
	int slot;     // its entry in the shared table while it holds bytes, or -1
	int await;    // in a forked child: the parent's entry to wait for, or -1
	struct held *head, *tail;
	size_t held;
};

// The shared table: which sockets hold bytes, and how many, in a mapping a
// forked child shares with its parent. A child's write to a socket whose
// bytes its parent holds must come after them: the child waits until the
// parent's entry for that socket is gone (mpp_gate_child, child_wait).
enum { SHARED_SLOTS = 4096 };
struct shared_entry {
	_Atomic uint64_t cookie; // 0: free
	_Atomic uint64_t held;
};
static struct shared_entry *shared;        // this process's entries
static struct shared_entry *parent_shared; // in a forked child: its parent's
static pid_t parent_pid;                   // in a forked child
static _Atomic int awaiting;               // in a forked child: sockets waiting for the parent

// Per-fd tables, sized from RLIMIT_NOFILE at load (at most MAX_FDS): the
// fast path's "last call short" flag, and each descriptor's socket. An fd
// beyond them is never gated: it passes through, and is counted.
#define MAX_FDS (1 << 20)
unsigned char *mpp_fd_short;         // last send call on fd was short
int mpp_nfds;                        // size of the tables
static struct sock *_Atomic *fd_tab; // made on the slow path
static int tab_hi;                   // fd_tab is empty from here on (under tab_mu)
#define fd_short mpp_fd_short
#define nfds mpp_nfds
static pthread_mutex_t tab_mu = PTHREAD_MUTEX_INITIALIZER;

static pthread_mutex_t hold_mu = PTHREAD_MUTEX_INITIALIZER;
static pthread_cond_t hold_cv = PTHREAD_COND_INITIALIZER;
static size_t held_total, hold_max = (size_t)256 << 20;
static _Atomic unsigned long untracked; // gated-mode calls on fds beyond the tables
static _Atomic unsigned long lost;      // held bytes whose socket was gone (cookie changed)

static struct shared_entry *new_shared(void)
{
	void *p = mmap(NULL, SHARED_SLOTS * sizeof(struct shared_entry), PROT_READ | PROT_WRITE,
		       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	return p == MAP_FAILED ? NULL : p;
}

void mpp_gate_init(void)
{
	struct rlimit rl;
	const char *e;

	nfds = 4096;
	if (getrlimit(RLIMIT_NOFILE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && rl.rlim_cur > (rlim_t)nfds)
		nfds = rl.rlim_cur > MAX_FDS ? MAX_FDS : (int)rl.rlim_cur;
	fd_short = calloc(nfds, 1);
	fd_tab = calloc(nfds, sizeof(*fd_tab));
	if (!fd_short || !fd_tab) {
		free(fd_short);
		free(fd_tab);
		fd_short = NULL;
		fd_tab = NULL;
		nfds = 0;
	}
	if ((e = getenv("MPIPAUSE_HOLD_MAX_MB")) && atol(e) > 0)
		hold_max = (size_t)atol(e) << 20;
	shared = new_shared();
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
// NULL. Called with tab_mu held.
static struct sock *find_sock(uint64_t c)
{
	for (int i = 0; i < tab_hi; i++) {
		struct sock *t = atomic_load_explicit(&fd_tab[i], memory_order_relaxed);
		if (t && t->cookie == c)
			return t;
	}
	return NULL;
}

// bind_fd makes fd's entry name t. Called with tab_mu held. A state no
// entry names any more stays allocated: a thread may still hold it (it is
// never another socket's), and it is at most one per socket the process
// wrote with the gate not open.
static void bind_fd(int fd, struct sock *t)
{
	struct sock *old = atomic_load_explicit(&fd_tab[fd], memory_order_relaxed);
	if (old == t)
		return;
	if (old)
		old->refs--;
	if (t)
		t->refs++;
	atomic_store_explicit(&fd_tab[fd], t, memory_order_release);
	if (t && fd >= tab_hi)
		tab_hi = fd + 1;
}

// sock_of is the state of socket c (fd's, by mpp_sock_cookie), made if no
// descriptor's entry has it yet; NULL if fd is beyond the tables or out of
// memory, or create is 0 and none has it.
static struct sock *sock_of(int fd, uint64_t c, int create)
{
	struct sock *s;

	if ((unsigned)fd >= (unsigned)nfds || c == 0)
		return NULL;
	s = atomic_load_explicit(&fd_tab[fd], memory_order_acquire);
	if (s && s->cookie == c)
		return s;
	pthread_mutex_lock(&tab_mu);
	s = find_sock(c);
	if (!s && create && (s = calloc(1, sizeof(*s)))) {
		pthread_mutex_init(&s->mu, NULL);
		s->cookie = c;
		s->fd = fd;
		s->slot = -1;
		s->await = -1;
	}
	if (s)
		bind_fd(fd, s);
	pthread_mutex_unlock(&tab_mu);
	return s;
}

// The state page (mpp_state_page) shows mpid every socket's gate without a
// syscall from the rank: the header's gate word, and per fd the last call
// short flag (the fast path's own array, moved into the page), the gated
// flag and the bytes held. NULL until the rank registers.
static struct mpp_page *page;
static unsigned char *page_gated;
static uint64_t *page_held;

// share mirrors s's held bytes into the shared table, taking an entry
// when it starts to hold and giving it back when it stops. Called with
// s->mu held. With no free entry, a child forked meanwhile does not wait
// for this socket.
static void share(struct sock *s)
{
	if (!shared)
		return;
	if (s->held > 0 && s->slot < 0) {
		for (int i = 0; i < SHARED_SLOTS; i++) {
			uint64_t free = 0;
			if (atomic_compare_exchange_strong(&shared[i].cookie, &free, s->cookie)) {
				s->slot = i;
				break;
			}
		}
	}
	if (s->slot < 0)
		return;
	atomic_store(&shared[s->slot].held, s->held);
	if (s->held == 0) {
		atomic_store(&shared[s->slot].cookie, 0);
		s->slot = -1;
	}
}

// publish mirrors s into the page, at the descriptor its bytes go to, and
// into the shared table. Called with s->mu held.
static void publish(struct sock *s)
{
	share(s);
	if (page && (unsigned)s->fd < (unsigned)nfds) {
		__atomic_store_n(&page_gated[s->fd], (unsigned char)s->gated, __ATOMIC_RELAXED);
		__atomic_store_n(&page_held[s->fd], (uint64_t)s->held, __ATOMIC_RELAXED);
	}
}

// set_fd makes fd (-1: none) the descriptor s's bytes go to, and moves
// its place in the page. Called with s->mu held.
static void set_fd(struct sock *s, int fd)
{
	if (page && (unsigned)s->fd < (unsigned)nfds && s->fd != fd) {
		__atomic_store_n(&page_gated[s->fd], 0, __ATOMIC_RELAXED);
		__atomic_store_n(&page_held[s->fd], 0, __ATOMIC_RELAXED);
	}
	s->fd = fd;
	publish(s);
}

// other_fd is a descriptor of s's socket other than not whose entry names
// s, checked with the kernel, or -1. Called with s->mu held.
static int other_fd(struct sock *s, int not)
{
	int hi;
	pthread_mutex_lock(&tab_mu);
	hi = tab_hi;
	pthread_mutex_unlock(&tab_mu);
	for (int i = 0; i < hi; i++)
		if (i != not && atomic_load_explicit(&fd_tab[i], memory_order_acquire) == s &&
		    mpp_sock_cookie(i) == s->cookie)
			return i;
	return -1;
}

static void publish_gate(int g)
{
	if (page)
		__atomic_store_n(&page->gate, g, __ATOMIC_RELEASE);
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

static void hold_release(size_t n)
{
	pthread_mutex_lock(&hold_mu);
	held_total -= n;
	pthread_cond_broadcast(&hold_cv);
	pthread_mutex_unlock(&hold_mu);
}

// mpp_quickack: while the gate is not open, a read that got bytes, the
// drain that moved some, and a socket's first held send ask the kernel to
// acknowledge at once (TCP_QUICKACK: the pending delayed ACK goes now, and
// the socket leaves its ping-pong mode). The pause's drain waits for
// "nothing unacknowledged" on the sender's side, and the receiver's delayed
// ACK of the last segments read otherwise holds that queue for up to the
// delayed-ACK timeout (8 ms under the sockops cap). On a socket that is not
// TCP the call just fails. Out of line: the read wrappers' open-gate path
// never calls it.
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

// drop_held frees s's held queue unsent. Called with s->mu held.
static size_t drop_held(struct sock *s)
{
	size_t n = s->held;
	while (s->head) {
		struct held *h = s->head;
		s->head = h->next;
		free(h);
	}
	s->tail = NULL;
	s->held = 0;
	s->shut = 0;
	return n;
}

// gone reports the held bytes of a socket the application closed by a call
// the shim did not see (a raw close system call): they cannot be sent, and
// the fd number may already be another socket, which must not get them.
// Called with s->mu held; the caller gives the room back.
static size_t gone(struct sock *s)
{
	size_t n = drop_held(s);
	atomic_fetch_add_explicit(&lost, n, memory_order_relaxed);
	publish(s);
	if (!getenv("MPIPAUSE_QUIET"))
		fprintf(stderr, "mpipause: %zu held bytes for fd %d not sent: its socket was closed by a call the shim does not wrap\n",
			n, s->fd);
	return n;
}

// append copies the call's bytes, written through fd, to the socket's
// held queue. Called with s->mu held.
static int append(struct sock *s, int fd, const struct iovec *iov, int iovcnt, size_t total, int oob)
{
	struct held *h = malloc(sizeof(*h) + total);
	size_t off = 0;

	if (!h)
		return -1;
	if (s->fd < 0)
		set_fd(s, fd);
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
	s->held += total;
	publish(s);
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

static void flush_fd(struct sock *s, struct mpp_gate_stats *st, int word, long long deadline);

// parent_done reports whether the parent no longer holds bytes for s's
// socket (or is gone: then they are lost, as when a process dies).
static int parent_done(struct sock *s)
{
	return atomic_load(&parent_shared[s->await].cookie) != s->cookie || getppid() != parent_pid;
}

// child_wait, in a forked child whose parent held bytes for some sockets
// at the fork, waits, before a write to such a socket, until the parent has
// sent them, like a sender on a full socket; and opens the child's gate
// once no socket waits.
static void child_wait(struct sock *s)
{
	// The other sockets the parent is done with stop waiting too, so the
	// gate opens without a write to each.
	for (int i = 0; i < tab_hi; i++) {
		struct sock *t = atomic_load_explicit(&fd_tab[i], memory_order_acquire);
		if (t && t != s) {
			pthread_mutex_lock(&t->mu);
			if (t->await >= 0 && parent_done(t)) {
				t->await = -1;
				if (atomic_fetch_sub(&awaiting, 1) == 1) {
					int w = GATE_WORD(GATE_FLUSHING, 0);
					atomic_compare_exchange_strong(&mpp_gate, &w, GATE_OPEN);
				}
			}
			pthread_mutex_unlock(&t->mu);
		}
	}
	pthread_mutex_lock(&s->mu);
	if (s->await >= 0) {
		while (!parent_done(s)) {
			pthread_mutex_unlock(&s->mu);
			REAL(poll)(NULL, 0, 1);
			pthread_mutex_lock(&s->mu);
		}
		s->await = -1;
		if (atomic_fetch_sub(&awaiting, 1) == 1) {
			int w = GATE_WORD(GATE_FLUSHING, 0);
			atomic_compare_exchange_strong(&mpp_gate, &w, GATE_OPEN);
		}
	}
	pthread_mutex_unlock(&s->mu);
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
	struct sock *s = sock_of(fd, mpp_sock_cookie(fd), 0);
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
	flush_fd(s, &st, -1, 0);
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
	s = sock_of(fd, mpp_sock_cookie(fd), 1);
	if (!s) {
		atomic_fetch_add_explicit(&untracked, 1, memory_order_relaxed);
		return real(arg);
	}
	total = iov_total(iov, iovcnt);
	if (atomic_load_explicit(&awaiting, memory_order_relaxed))
		child_wait(s);
	pthread_mutex_lock(&s->mu);
	// The descriptor the bytes go to may have gone by a call the shim does
	// not see (a close while the gate was open takes the fast path): this
	// caller's is the socket's, checked just now.
	if (s->fd != fd && (s->fd < 0 || mpp_sock_cookie(s->fd) != s->cookie))
		set_fd(s, fd);
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
			publish(s);
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
	publish(s);
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
		hold_release(total);
		r = real(arg);
		mpp_note_short(fd, r, total);
		return r;
	}
	if (append(s, fd, iov, iovcnt, total, (flags & MSG_OOB) != 0) < 0) {
		pthread_mutex_unlock(&s->mu);
		hold_release(total);
		errno = ENOBUFS;
		return -1;
	}
	fd_short[fd] = 0;
	pthread_mutex_unlock(&s->mu);
	return (ssize_t)total;
}

// send_all writes b to fd, waiting for room when the socket is
// non-blocking, at most until deadline (CLOCK_MONOTONIC ms; 0: no limit).
// The urgent byte of an MSG_OOB call is the last one of the call, so such a
// chunk goes as its bytes and then its last byte alone with MSG_OOB. It
// returns 0, or -1 with errno when the connection failed or time ran out.
static int send_all(int fd, const char *b, size_t n, int oob, long long deadline)
{
	while (n > 0) {
		int fl = MSG_NOSIGNAL;
		size_t want = n;
		if (oob && n > 1)
			want = n - 1;
		else if (oob)
			fl |= MSG_OOB;
		ssize_t r = REAL(send)(fd, b, want, fl);
		if (r > 0) {
			b += r;
			n -= r;
			continue;
		}
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			struct pollfd p = {.fd = fd, .events = POLLOUT};
			int ms = -1;
			if (deadline) {
				long long left = deadline - mpp_now_ms();
				if (left <= 0) {
					errno = ETIMEDOUT;
					return -1;
				}
				ms = left > INT_MAX ? INT_MAX : (int)left;
			}
			REAL(poll)(&p, 1, ms);
			continue;
		}
		return -1;
	}
	return 0;
}

// mpp_send_all is send_all for a caller that took the bytes from their
// source already (sendfile from a pipe, splice): they must all go. Returns
// n, or -1 with errno.
ssize_t mpp_send_all(int fd, const void *b, size_t n)
{
	return send_all(fd, b, n, 0, 0) < 0 ? -1 : (ssize_t)n;
}

long long mpp_now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

// flush_fd sends the socket's held bytes in order. New sends to it, by any
// of its descriptors, are appended behind them meanwhile (s->flushing), so
// order holds. It stops between
// chunks once the gate word is no longer word (a newer close; word -1:
// never): what is left stays held, the socket gated, for that pause's
// resume. Bytes go only to the socket they were held for: if the number
// names another one now, they are reported lost (gone), never sent there.
static void flush_fd(struct sock *s, struct mpp_gate_stats *st, int word, long long deadline)
{
	pthread_mutex_lock(&s->mu);
	// One flusher a socket: another sending the same chunk would send it
	// twice.
	while (s->flushing) {
		pthread_mutex_unlock(&s->mu);
		REAL(poll)(NULL, 0, 1);
		pthread_mutex_lock(&s->mu);
	}
	s->flushing = 1;
	while (s->head) {
		struct held *h = s->head;
		int failed;

		if (word != -1 && atomic_load_explicit(&mpp_gate, memory_order_acquire) != word) {
			s->flushing = 0;
			publish(s);
			pthread_mutex_unlock(&s->mu);
			return;
		}

		int to = s->fd; // read under the lock: a close may move it
		if (to < 0 || mpp_sock_cookie(to) != s->cookie) {
			// That descriptor went by a call the shim does not see:
			// another of the socket's, if it has one.
			to = other_fd(s, to);
			if (to >= 0)
				set_fd(s, to);
		}
		if (to < 0) {
			size_t n = gone(s);
			st->flush_errors++;
			st->flush_errno = EBADF;
			pthread_mutex_unlock(&s->mu);
			hold_release(n);
			pthread_mutex_lock(&s->mu);
			break;
		}
		pthread_mutex_unlock(&s->mu);
		failed = send_all(to, h->data + h->off, h->len - h->off, h->oob, deadline) < 0;
		pthread_mutex_lock(&s->mu);
		if (failed) {
			st->flush_errors++;
			st->flush_errno = errno;
		} else
			st->flushed += h->len;
		s->head = h->next;
		if (!s->head)
			s->tail = NULL;
		s->held -= h->len;
		publish(s);
		hold_release(h->len);
		free(h);
	}
	s->flushing = 0;
	s->gated = 0;
	if (s->shut) {
		// The shutdown the application asked for, after its bytes.
		s->shut = 0;
		if (s->fd >= 0 && REAL(shutdown)(s->fd, SHUT_WR) < 0 && errno != ENOTCONN) {
			st->flush_errors++;
			st->flush_errno = errno;
		}
	}
	publish(s);
	if (s->orphan) {
		// Delivered what the application wrote before it closed: now the
		// close it asked for, and the slot is free again.
		int keep = s->fd;
		s->orphan = 0;
		set_fd(s, -1);
		pthread_mutex_lock(&tab_mu);
		bind_fd(keep, NULL);
		pthread_mutex_unlock(&tab_mu);
		REAL(close)(keep);
	}
	pthread_mutex_unlock(&s->mu);
}

// mpp_gate_close closes the gate in a new generation (when mpid asks by
// request; with the gate page, mpid writes the word itself).
void mpp_gate_close(void)
{
	int w = atomic_load_explicit(&mpp_gate, memory_order_acquire);
	int c = GATE_WORD(GATE_CLOSED, GATE_GEN(w) + 1);
	atomic_store_explicit(&mpp_gate, c, memory_order_release);
	publish_gate(c);
}

// now_flushing follows the gate word's move to flushing word f: the state
// page shows it, and senders waiting for room (hold_room) go on.
static void now_flushing(int f)
{
	publish_gate(f);
	pthread_mutex_lock(&hold_mu);
	pthread_cond_broadcast(&hold_cv);
	pthread_mutex_unlock(&hold_mu);
}

// mpp_gate_flushing is the first half of reopening the gate closed in
// generation gen (-1: the current one): from here on a send goes straight
// to the kernel unless its socket still has held bytes, which it then
// queues behind. It returns the flushing word for mpp_gate_flush, or -1 if
// the gate is open or belongs to another generation: nothing to do.
int mpp_gate_flushing(long gen)
{
	int w = atomic_load_explicit(&mpp_gate, memory_order_acquire), f;
	for (;;) {
		if (w == GATE_OPEN || (gen >= 0 && GATE_GEN(w) != ((unsigned long)gen & GATE_GEN_MASK)))
			return -1;
		f = GATE_WORD(GATE_FLUSHING, GATE_GEN(w));
		if (w == f || atomic_compare_exchange_weak_explicit(&mpp_gate, &w, f, memory_order_acq_rel,
								    memory_order_acquire))
			break;
	}
	now_flushing(f);
	return f;
}

// mpp_gate_flush is the second half: send what was held, in order, then
// open the gate, unless a newer close came meanwhile.
void mpp_gate_flush(struct mpp_gate_stats *st, int word)
{
	memset(st, 0, sizeof(*st));
	for (int fd = 0; fd < nfds; fd++) {
		struct sock *s = atomic_load_explicit(&fd_tab[fd], memory_order_acquire);
		if (s)
			flush_fd(s, st, word, 0);
	}
	if (atomic_compare_exchange_strong_explicit(&mpp_gate, &word, GATE_OPEN, memory_order_acq_rel,
						    memory_order_acquire))
		publish_gate(GATE_OPEN);
}

// mpp_gate_open opens the gate whatever its state and generation, every
// held byte sent first: the "OPEN" request, and the way out when mpid is
// gone or MPI is finalizing.
void mpp_gate_open(struct mpp_gate_stats *st)
{
	int w = atomic_load_explicit(&mpp_gate, memory_order_acquire);
	int f = GATE_WORD(GATE_FLUSHING, GATE_GEN(w));
	atomic_store_explicit(&mpp_gate, f, memory_order_release);
	now_flushing(f);
	mpp_gate_flush(st, f);
}

void mpp_gate_state(struct mpp_gate_stats *st)
{
	memset(st, 0, sizeof(*st));
	st->gate = GATE_STATE(atomic_load_explicit(&mpp_gate, memory_order_acquire));
	for (int fd = 0; fd < nfds; fd++) {
		struct sock *s = atomic_load_explicit(&fd_tab[fd], memory_order_acquire);
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

// mpp_keep_held is called before the application's fd goes (close, dup2
// over fd, close_range, fclose): the kernel would deliver bytes written
// before a close, so the shim must too. If fd is the descriptor its
// socket's held bytes go to, they move to another descriptor of the socket
// the application still has, or else to a descriptor of the shim's own (a
// dup, so the application's number is free for reuse at once), which the
// reopen flushes and then closes. It returns that dup, or -1: nothing was
// held, another descriptor has them, or they went now, when no descriptor
// was left to keep them under.
int mpp_keep_held(int fd)
{
	struct sock *s;
	int keep;

	if ((unsigned)fd >= (unsigned)nfds || !(s = atomic_load_explicit(&fd_tab[fd], memory_order_acquire)))
		return -1;
	pthread_mutex_lock(&s->mu);
	if (s->fd == fd && (keep = other_fd(s, fd)) >= 0)
		set_fd(s, keep);
	if (s->fd != fd || (!s->head && !s->flushing && !s->shut)) {
		if (s->fd == fd)
			set_fd(s, -1);
		pthread_mutex_lock(&tab_mu);
		bind_fd(fd, NULL);
		pthread_mutex_unlock(&tab_mu);
		pthread_mutex_unlock(&s->mu);
		return -1;
	}
	// Through the wrapper: the dup is a new descriptor of the socket, which
	// the drain must count and a stash holding bytes attach, as it does any
	// other (stash.c).
	keep = mpp_wrapped_fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (keep < 0 || keep >= nfds) {
		// No descriptor to keep it under: the held bytes go now.
		pthread_mutex_unlock(&s->mu);
		if (keep >= 0)
			REAL(close)(keep);
		struct mpp_gate_stats st = {0};
		flush_fd(s, &st, -1, 0);
		return -1;
	}
	pthread_mutex_lock(&tab_mu);
	bind_fd(keep, s);
	bind_fd(fd, NULL);
	pthread_mutex_unlock(&tab_mu);
	if (page) {
		page_gated[fd] = 0;
		page_held[fd] = 0;
	}
	set_fd(s, keep);
	s->orphan = 1;
	fd_short[keep] = 0;
	pthread_mutex_unlock(&s->mu);
	return keep;
}

// mpp_kept reports whether fd is one of the shim's own descriptors that
// keep a closed socket's held bytes (close_range must leave it open).
int mpp_kept(int fd)
{
	struct sock *s;
	if ((unsigned)fd >= (unsigned)nfds || !(s = atomic_load_explicit(&fd_tab[fd], memory_order_acquire)))
		return 0;
	pthread_mutex_lock(&s->mu);
	int k = s->orphan && s->fd == fd;
	pthread_mutex_unlock(&s->mu);
	return k;
}

// mpp_kept_in writes the shim's dups (mpp_kept) numbered first..last to
// out, at most max, in ascending order, and returns how many.
int mpp_kept_in(unsigned first, unsigned last, int *out, int max)
{
	int n = 0;
	pthread_mutex_lock(&tab_mu);
	int hi = tab_hi;
	pthread_mutex_unlock(&tab_mu);
	for (int fd = (int)first; fd < hi && (unsigned)fd <= last && n < max; fd++)
		if (mpp_kept(fd))
			out[n++] = fd;
	return n;
}

// mpp_close_held is close() under a gate that is not open.
int mpp_close_held(int fd)
{
	mpp_keep_held(fd);
	return REAL(close)(fd);
}

// mpp_defer_shutdown is shutdown(fd, SHUT_WR) while fd's socket has held bytes: the
// FIN must follow them, so it is sent by the flush, after the last one.
// Returns 1 if deferred, 0 if nothing is held (the shutdown goes now).
int mpp_defer_shutdown(int fd)
{
	struct sock *s = sock_of(fd, mpp_sock_cookie(fd), 0);
	if (!s)
		return 0;
	pthread_mutex_lock(&s->mu);
	int defer = s->head || s->flushing;
	if (defer)
		s->shut = 1;
	pthread_mutex_unlock(&s->mu);
	return defer;
}

// mpp_gate_end sends every held byte now, whatever the gate, before the
// process's memory goes (exit, exec): the kernel would have delivered
// bytes written before either. A peer that reads nothing for
// MPIPAUSE_END_FLUSH_MS (10 s) loses what is left, and stderr says so.
void mpp_gate_end(const char *why)
{
	struct mpp_gate_stats st;
	const char *e = getenv("MPIPAUSE_END_FLUSH_MS");
	long ms = e && atol(e) > 0 ? atol(e) : 10000;
	size_t before;

	pthread_mutex_lock(&hold_mu);
	before = held_total;
	pthread_mutex_unlock(&hold_mu);
	if (before == 0)
		return;
	memset(&st, 0, sizeof(st));
	long long deadline = mpp_now_ms() + ms;
	for (int fd = 0; fd < nfds; fd++) {
		struct sock *s = atomic_load_explicit(&fd_tab[fd], memory_order_acquire);
		if (s)
			flush_fd(s, &st, -1, deadline);
	}
	if (st.flush_errors && !getenv("MPIPAUSE_QUIET"))
		fprintf(stderr, "mpipause: at %s, %u held sends could not be delivered (%s)\n", why, st.flush_errors,
			strerror(st.flush_errno));
}

// mpp_gate_fork_prepare holds tab_mu across a fork, so that the child's
// table (fd_tab, tab_hi and each state's refs) is not half-changed by a
// thread that does not go on in it; tab_mu is a leaf lock, taken last.
void mpp_gate_fork_prepare(void)
{
	pthread_mutex_lock(&tab_mu);
}

void mpp_gate_fork_parent(void)
{
	pthread_mutex_unlock(&tab_mu);
}

// mpp_gate_child makes a forked child a process of its own: mpid speaks to
// the parent, so the child gets an open gate on a private page, private
// "last call short" flags (not the parent's state page), and none of the
// parent's held bytes, which are the parent's to send (the child's copies
// of the dups that keep closed sockets' bytes are closed). A socket whose
// bytes the parent holds waits for them before the child's first write to
// it (child_wait); until none waits, the child's gate says flushing, so its
// writes take the slow path. Only the forking thread lives on in the child,
// so the other locks are made anew, and no list or buffer a state's mutex
// guards is walked or freed: another thread may have been changing it at
// the fork.
void mpp_gate_child(void)
{
	int waits = 0;

	parent_shared = shared;
	parent_pid = getppid();
	shared = new_shared();
	if (mmap(&mpp_gate_pg, sizeof(mpp_gate_pg), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
		 -1, 0) != MAP_FAILED)
		atomic_store(&mpp_gate, GATE_OPEN);
	pthread_mutex_unlock(&tab_mu); // taken by mpp_gate_fork_prepare
	pthread_mutex_init(&hold_mu, NULL);
	pthread_cond_init(&hold_cv, NULL);
	held_total = 0;
	if (page) {
		unsigned char *own = calloc(nfds ? nfds : 1, 1);
		if (own)
			memcpy(own, fd_short, nfds);
		size_t size = page->size;
		fd_short = own ? own : fd_short;
		struct mpp_page *p = page;
		page = NULL;
		if (own)
			munmap(p, size);
	}
	// The table is whole (tab_mu was held over the fork) and only the
	// forking thread lives on.
	for (int fd = 0; fd < tab_hi; fd++) {
		struct sock *s = atomic_load_explicit(&fd_tab[fd], memory_order_relaxed);
		if (!s)
			continue;
		pthread_mutex_init(&s->mu, NULL);
		if (s->slot >= 0 && parent_shared && s->await < 0) {
			s->await = s->slot;
			waits++;
		}
		s->slot = -1;
		// Forgotten, not freed: another thread may have been inside s->mu
		// at the fork, its list half-linked or a buffer freed and not yet
		// unlinked. The child never touches the buffers, so its copies of
		// them cost no memory.
		s->head = s->tail = NULL;
		s->held = 0;
		s->shut = 0;
		s->gated = 0;
		s->flushing = 0;
		if (s->orphan && s->fd == fd) {
			s->orphan = 0;
			REAL(close)(fd);
		}
	}
	if (waits) {
		atomic_store(&awaiting, waits);
		atomic_store(&mpp_gate, GATE_WORD(GATE_FLUSHING, 0));
	}
}

// mpp_state_page creates the state page, a sealed memfd that mpid maps
// read-only (sealed against shrinking, so the rank cannot make mpid's reads
// fault), moves the fast path's short flags into it, and returns its fd.
int mpp_state_page(void)
{
	size_t size = sizeof(struct mpp_page) + (size_t)nfds * (1 + 1) + 7;
	size = (size + 7) & ~(size_t)7;
	size += (size_t)nfds * sizeof(uint64_t);
	int fd = memfd_create("mpipause-state", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -1;
	if (ftruncate(fd, (off_t)size) < 0 ||
	    REAL(fcntl)(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		REAL(close)(fd);
		return -1;
	}
	struct mpp_page *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		REAL(close)(fd);
		return -1;
	}
	memcpy(p->magic, MPP_PAGE_MAGIC, sizeof(p->magic));
	p->version = MPP_PAGE_VERSION;
	p->fds = (uint32_t)nfds;
	p->size = size;
	unsigned char *shorts = (unsigned char *)(p + 1);
	page_gated = shorts + nfds;
	page_held = (uint64_t *)(((uintptr_t)(page_gated + nfds) + 7) & ~(uintptr_t)7);
	p->held_offset = (uint64_t)((char *)page_held - (char *)p);
	if (fd_short)
		memcpy(shorts, fd_short, nfds);
	// The fast path now notes short calls straight into the page. A call
	// racing this store may note into the old array: harmless, the rank is
	// not gated before it has registered, and its next call notes again.
	fd_short = shorts;
	p->gate = atomic_load(&mpp_gate);
	page = p;
	for (int i = 0; i < nfds; i++) {
		struct sock *s = atomic_load_explicit(&fd_tab[i], memory_order_acquire);
		if (s) {
			pthread_mutex_lock(&s->mu);
			publish(s);
			pthread_mutex_unlock(&s->mu);
		}
	}
	return fd;
}

// mpp_gate_page shares the gate word's page with mpid: a memfd (sealed
// against resizing, so neither side can make the other's accesses fault)
// holding the word's current value is mapped over the library's own page,
// and its fd is returned for the HELLO. -1, and the word stays private,
// where pages are not the size the library was built for. A forked child
// gets a private page again (mpp_gate_child), since mpid speaks to the
// parent.
int mpp_gate_page(void)
{
	if (sysconf(_SC_PAGESIZE) != MPP_GATE_PAGE_SIZE)
		return -1;
	int fd = memfd_create("mpipause-gate", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -1;
	int w = atomic_load(&mpp_gate);
	if (ftruncate(fd, MPP_GATE_PAGE_SIZE) < 0 || pwrite(fd, &w, sizeof(w), 0) != (ssize_t)sizeof(w) ||
	    REAL(fcntl)(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		REAL(close)(fd);
		return -1;
	}
	// The gate does not move while the rank registers (only mpid's requests
	// move it, and there are none yet), so the copy above stays true.
	if (mmap(&mpp_gate_pg, sizeof(mpp_gate_pg), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) ==
	    MAP_FAILED) {
		REAL(close)(fd);
		return -1;
	}
	return fd;
}
