// SPDX-License-Identifier: Apache-2.0
//
// The wrapped waits: poll, ppoll, select, pselect, epoll_wait, epoll_pwait,
// epoll_pwait2 and the fortified __poll_chk and __ppoll_chk. While a pause
// is in progress the control thread empties the rank's TCP receive queues
// into stashes (stash.c); the kernel then reports those sockets empty, so
// an event loop would never learn that its bytes are there. These wrappers
// report an fd readable while its stash holds bytes, merged with what the
// kernel says, and never block when they have something to report.
//
// Fast path: a wait with a zero timeout (UCX calls epoll_wait(.., 0) in a
// busy loop) loads mpp_stash_live once and, when no stash holds bytes,
// makes the real call unchanged. Otherwise the real call is made with a
// zero timeout and the stash-ready fds are added to its answer.
//
// The wake. A thread may have entered a blocking wait while every stash
// was empty; when the control thread then stashes the bytes that woke it,
// the kernel re-checks the socket, finds it empty and sleeps on. So every
// blocking wait (timeout != 0) registers its thread in a small table, and
// mpp_wait_wake sends each registered thread a signal of its own
// (wake_sig) with tgkill; the wrapper takes the EINTR that a wake caused
// (its handler sets a per-thread flag) as "look at the stashes again, then
// wait for what is left of the timeout". A signal rather than a wake fd
// added to the wait: a poll array or fd_set would have to be copied and
// grown on every blocking call, and an fd added to the application's epoll
// set would be visible to (and could be removed by) the application.
//
// The wake signal is blocked in the thread for the whole registered
// stretch except inside the real wait, whose mask (the application's, or
// the thread's own) has it removed: a wake that comes before the thread is
// in the kernel is held pending and interrupts the wait as soon as it
// starts (no lost wake-up between the check and the sleep), and a wake can
// never interrupt an application call outside a wait. The signal is the
// shim's: it is unblocked during the wait even when the application's mask
// (ppoll, pselect, epoll_pwait) blocks every signal, since a thread that
// blocks all signals is exactly the progress thread that must wake. A
// wake that arrives just as the real wait returns stays pending until the
// next wait (harmless: one spurious re-check) or is taken when the mask is
// restored, where it interrupts nothing.
//
// Costs: a zero-timeout wait, one load (epoll_wait(.., 0) on an idle set:
// 160 ns with or without the shim); a blocking wait, two sigprocmask calls,
// a clock read and a compare-and-swap on each side of the real call (a
// poll(.., 10) that returns at once: 520 -> 1,200 ns on the 2-core VM).
// With no signal (MPIPAUSE_WAKE_SIGNAL=none, none free, or more than
// WAITERS threads waiting at once) a blocking wait wakes every 10 ms to
// look at the stashes instead.
#include "shim.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

#define unlikely(x) __builtin_expect(!!(x), 0)
#define LIVE() atomic_load_explicit(&mpp_stash_live, memory_order_relaxed)

int __poll_chk(struct pollfd *fds, nfds_t n, int timeout, size_t fdslen);
int __ppoll_chk(struct pollfd *fds, nfds_t n, const struct timespec *tmo, const sigset_t *mask, size_t fdslen);

static struct {
	int (*poll)(struct pollfd *, nfds_t, int);
	int (*ppoll)(struct pollfd *, nfds_t, const struct timespec *, const sigset_t *);
	int (*select)(int, fd_set *, fd_set *, fd_set *, struct timeval *);
	int (*pselect)(int, fd_set *, fd_set *, fd_set *, const struct timespec *, const sigset_t *);
	int (*epoll_wait)(int, struct epoll_event *, int, int);
	int (*epoll_pwait)(int, struct epoll_event *, int, int, const sigset_t *);
	int (*epoll_pwait2)(int, struct epoll_event *, int, const struct timespec *, const sigset_t *);
	int (*epoll_ctl)(int, int, int, struct epoll_event *);
	int (*epoll_create)(int);
	int (*epoll_create1)(int);
	int (*dup)(int);
	int (*dup2)(int, int);
	int (*dup3)(int, int, int);
	int (*poll_chk)(struct pollfd *, nfds_t, int, size_t);
	int (*ppoll_chk)(struct pollfd *, nfds_t, const struct timespec *, const sigset_t *, size_t);
	int (*sigaction)(int, const struct sigaction *, struct sigaction *);
} rw;

static void wait_resolve(void)
{
#define R(fn, name)                                  \
	if (!rw.fn)                                  \
		rw.fn = dlsym(RTLD_NEXT, name)
	R(poll, "poll");
	R(ppoll, "ppoll");
	R(select, "select");
	R(pselect, "pselect");
	R(epoll_wait, "epoll_wait");
	R(epoll_pwait, "epoll_pwait");
	R(epoll_pwait2, "epoll_pwait2");
	R(epoll_ctl, "epoll_ctl");
	R(epoll_create, "epoll_create");
	R(epoll_create1, "epoll_create1");
	R(dup, "dup");
	R(dup2, "dup2");
	R(dup3, "dup3");
	R(poll_chk, "__poll_chk");
	R(ppoll_chk, "__ppoll_chk");
	R(sigaction, "sigaction");
#undef R
}

// As wrap.c's REAL: resolved by mpp_wait_init, or by the first call that
// comes earlier (another library's constructor).
#define RW(fn) (likely(rw.fn != NULL) ? rw.fn : (wait_resolve(), rw.fn))

static int wake_sig; // 0: no signal; blocking waits then wake every SLICE_NS
static _Atomic int inited;
static __thread volatile sig_atomic_t woken __attribute__((tls_model("initial-exec")));
static __thread pid_t my_tid __attribute__((tls_model("initial-exec")));

// The waiters: tids of threads inside a blocking wait. A slot's owner
// clears it; mpp_wait_wake marks it BUSY around its tgkill so that the
// owner, which waits for BUSY to go before it leaves, still has the signal
// blocked when it arrives, and a tid reused by a new thread is never hit.
// A thread that finds no free slot waits in slices.
#define WAITERS 256
#define BUSY (1 << 30) // above any tid (pid_max <= 2^22)
#define SLICE_NS 10000000L
static _Atomic int waiters[WAITERS];
static pthread_mutex_t wake_mu = PTHREAD_MUTEX_INITIALIZER;

static void on_wake(int sig)
{
	(void)sig;
	woken = 1;
}

static pid_t tid(void)
{
	if (unlikely(my_tid == 0))
		my_tid = (pid_t)syscall(SYS_gettid);
	return my_tid;
}

static int enroll(void)
{
	pid_t t = tid();
	unsigned h = (unsigned)t * 2654435761u;
	for (unsigned k = 0; k < WAITERS; k++) {
		unsigned i = (h + k) % WAITERS;
		int z = 0;
		if (atomic_load_explicit(&waiters[i], memory_order_relaxed) == 0 &&
		    atomic_compare_exchange_strong(&waiters[i], &z, t))
			return (int)i;
	}
	return -1;
}

static void unenroll(int i)
{
	int v = tid();
	while (!atomic_compare_exchange_strong(&waiters[i], &v, 0)) {
		v = tid(); // BUSY: a wake is sending us its signal right now
		sched_yield();
	}
}

// mpp_wait_wake runs on the control thread after a stash went from empty
// to holding bytes (mpp_stash_live already counts it). The fence pairs
// with the one a waiter makes between registering and loading
// mpp_stash_live: a waiter either is seen here or sees the stash.
void mpp_wait_wake(void)
{
	if (!wake_sig)
		return;
	int saved = errno;
	atomic_thread_fence(memory_order_seq_cst);
	pthread_mutex_lock(&wake_mu);
	pid_t pid = getpid();
	for (int i = 0; i < WAITERS; i++) {
		int v = atomic_load(&waiters[i]);
		if (v <= 0)
			continue;
		// A slot that changed meanwhile belongs to a thread that
		// registered after the fence: it sees the stash itself.
		if (!atomic_compare_exchange_strong(&waiters[i], &v, v | BUSY))
			continue;
		syscall(SYS_tgkill, pid, v, wake_sig);
		atomic_store(&waiters[i], v);
	}
	pthread_mutex_unlock(&wake_mu);
	errno = saved;
}

struct waiter {
	int slot;              // in waiters, or -1: wait in slices
	int masked;            // old holds the mask to restore
	sigset_t old;          // the thread's mask before the call
	sigset_t wbuf, hbuf;   // storage for wmask and hmask
	const sigset_t *wmask; // for the real wait: the wake signal unblocked
	const sigset_t *hmask; // for a zero-timeout look: the wake signal blocked
};

static void wait_begin(struct waiter *w, const sigset_t *app)
{
	w->slot = -1;
	w->masked = 0;
	w->wmask = app;
	w->hmask = app;
	if (!wake_sig)
		return;
	sigset_t s;
	sigemptyset(&s);
	sigaddset(&s, wake_sig);
	if (pthread_sigmask(SIG_BLOCK, &s, &w->old) != 0)
		return;
	w->masked = 1;
	w->wbuf = app ? *app : w->old;
	sigdelset(&w->wbuf, wake_sig);
	w->wmask = &w->wbuf;
	if (app) {
		w->hbuf = *app;
		sigaddset(&w->hbuf, wake_sig);
		w->hmask = &w->hbuf;
	} else {
		w->hmask = NULL; // the thread's mask, which now blocks it
	}
	w->slot = enroll();
	atomic_thread_fence(memory_order_seq_cst);
}

static void wait_end(struct waiter *w)
{
	int saved = errno;
	if (w->slot >= 0)
		unenroll(w->slot);
	if (w->masked)
		pthread_sigmask(SIG_SETMASK, &w->old, NULL);
	errno = saved;
}

// A thread cancelled inside the real wait must give its slot back, or a
// later wake could signal another thread that got its tid.
static void wait_cancelled(void *w)
{
	wait_end(w);
}

static void ts_now(struct timespec *t)
{
	clock_gettime(CLOCK_MONOTONIC, t);
}

static void ts_add(struct timespec *a, const struct timespec *b)
{
	a->tv_sec += b->tv_sec;
	a->tv_nsec += b->tv_nsec;
	if (a->tv_nsec >= 1000000000L) {
		a->tv_sec++;
		a->tv_nsec -= 1000000000L;
	}
}

// ts_left is end - now, at least zero.
static struct timespec ts_left(const struct timespec *end)
{
	struct timespec n, d;
	ts_now(&n);
	d.tv_sec = end->tv_sec - n.tv_sec;
	d.tv_nsec = end->tv_nsec - n.tv_nsec;
	if (d.tv_nsec < 0) {
		d.tv_sec--;
		d.tv_nsec += 1000000000L;
	}
	if (d.tv_sec < 0)
		d.tv_sec = d.tv_nsec = 0;
	return d;
}

static int ts_valid(const struct timespec *t)
{
	return t->tv_sec >= 0 && t->tv_nsec >= 0 && t->tv_nsec < 1000000000L;
}

static int ts_zero(const struct timespec *t)
{
	return t && t->tv_sec == 0 && t->tv_nsec == 0;
}

// ts_ms rounds up, as the kernel does a poll timeout: a wait never ends
// before its time.
static int ts_ms(const struct timespec *t)
{
	if (!t)
		return -1;
	if (t->tv_sec >= INT_MAX / 1000 - 1)
		return INT_MAX;
	return (int)(t->tv_sec * 1000 + (t->tv_nsec + 999999) / 1000000);
}

// One kind of wait, for wait_loop: now() makes the real call with a zero
// timeout and adds the stash-ready fds (a count, or -1 and errno);
// block() makes the real call; merge() adds the stash-ready fds to what a
// blocking call returned (n > 0).
struct wait_ops {
	int (*now)(void *c, const sigset_t *mask);
	int (*block)(void *c, const struct timespec *left, const sigset_t *mask);
	int (*merge)(void *c, int n);
};

// glibc's pthread_cleanup_push (a sigsetjmp in C without -fexceptions)
// trips -Wclobbered on its own variables: GCC bug 61118.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wclobbered"
// wait_loop runs a blocking wait (tmo NULL: no limit) with the wake. *left,
// if not NULL, gets the time that remained (select's timeval).
static int wait_loop(const struct wait_ops *ops, void *c, const struct timespec *tmo, const sigset_t *app,
		     struct timespec *left)
{
	struct waiter w;
	struct timespec end, rem = {0, 0};
	int r;

	if (unlikely(!atomic_load_explicit(&inited, memory_order_acquire)))
		mpp_wait_init();
	if (tmo) {
		ts_now(&end);
		ts_add(&end, tmo);
	}
	wait_begin(&w, app);
	pthread_cleanup_push(wait_cancelled, &w);
	for (;;) {
		woken = 0;
		atomic_thread_fence(memory_order_seq_cst);
		if (LIVE() > 0) {
			r = ops->now(c, w.hmask);
			if (r != 0)
				break;
		}
		const struct timespec *t = NULL;
		int sliced = 0;
		if (tmo) {
			rem = ts_left(&end);
			t = &rem;
		}
		if (w.slot < 0 && (!t || rem.tv_sec > 0 || rem.tv_nsec > SLICE_NS)) {
			rem.tv_sec = 0;
			rem.tv_nsec = SLICE_NS;
			t = &rem;
			sliced = 1;
		}
		r = ops->block(c, t, w.wmask);
		if (r < 0 && errno == EINTR && woken)
			continue;
		if (r == 0 && sliced)
			continue;
		if (r > 0 && LIVE() > 0)
			r = ops->merge(c, r);
		break;
	}
	pthread_cleanup_pop(0);
	wait_end(&w);
	if (left) {
		if (tmo)
			*left = ts_left(&end);
		else
			left->tv_sec = left->tv_nsec = 0;
	}
	return r;
}
#pragma GCC diagnostic pop

// with_wake_blocked returns the application's mask with the wake signal
// added, for a wait that must not take a wake left pending (a wait that is
// not registered is never the one a wake is for).
static const sigset_t *with_wake_blocked(const sigset_t *app, sigset_t *buf)
{
	if (!app || !wake_sig || sigismember(app, wake_sig))
		return app;
	*buf = *app;
	sigaddset(buf, wake_sig);
	return buf;
}

// ---- poll, ppoll

struct poll_ctx {
	struct pollfd *fds;
	nfds_t n;
};

static int poll_merge(struct poll_ctx *p, int n)
{
	for (nfds_t i = 0; i < p->n; i++) {
		short want = p->fds[i].events & (POLLIN | POLLRDNORM);
		if (!want || p->fds[i].fd < 0 || !mpp_stash_ready(p->fds[i].fd))
			continue;
		if (p->fds[i].revents == 0)
			n++;
		p->fds[i].revents |= want;
	}
	return n;
}

// poll_now: the kernel's answer now, plus the stashes. An EINTR (an
// application signal, not blocked by its mask) with a stash to report is a
// count, as the kernel gives when something is ready.
static int poll_now(struct pollfd *fds, nfds_t n, const sigset_t *mask)
{
	struct poll_ctx p = {fds, n};
	struct timespec zero = {0, 0};
	int r = RW(ppoll)(fds, n, &zero, mask);
	if (r >= 0)
		return poll_merge(&p, r);
	if (errno != EINTR)
		return -1;
	for (nfds_t i = 0; i < n; i++)
		fds[i].revents = 0;
	r = poll_merge(&p, 0);
	if (r == 0) {
		errno = EINTR;
		return -1;
	}
	return r;
}

static int poll_op_now(void *c, const sigset_t *mask)
{
	struct poll_ctx *p = c;
	return poll_now(p->fds, p->n, mask);
}

static int poll_op_block(void *c, const struct timespec *left, const sigset_t *mask)
{
	struct poll_ctx *p = c;
	return RW(ppoll)(p->fds, p->n, left, mask);
}

static int poll_op_merge(void *c, int n)
{
	return poll_merge(c, n);
}

static const struct wait_ops poll_ops = {poll_op_now, poll_op_block, poll_op_merge};

EXPORT int poll(struct pollfd *fds, nfds_t n, int timeout)
{
	if (timeout == 0) {
		if (likely(LIVE() == 0))
			return RW(poll)(fds, n, 0);
		return poll_now(fds, n, NULL);
	}
	struct poll_ctx p = {fds, n};
	struct timespec t = {timeout / 1000, (timeout % 1000) * 1000000L};
	return wait_loop(&poll_ops, &p, timeout > 0 ? &t : NULL, NULL, NULL);
}

EXPORT int ppoll(struct pollfd *fds, nfds_t n, const struct timespec *tmo, const sigset_t *mask)
{
	sigset_t buf;
	if (ts_zero(tmo)) {
		mask = with_wake_blocked(mask, &buf);
		if (likely(LIVE() == 0))
			return RW(ppoll)(fds, n, tmo, mask);
		return poll_now(fds, n, mask);
	}
	if ((tmo && !ts_valid(tmo)))
		return RW(ppoll)(fds, n, tmo, mask); // the kernel's EINVAL
	struct poll_ctx p = {fds, n};
	return wait_loop(&poll_ops, &p, tmo, mask, NULL);
}

// A fortified build calls these instead (glibc's own poll is not reached
// through the PLT from them). A short buffer goes to the real one, which
// aborts as it should.
EXPORT int __poll_chk(struct pollfd *fds, nfds_t n, int timeout, size_t fdslen)
{
	if (unlikely(fdslen / sizeof(*fds) < n) && RW(poll_chk))
		return rw.poll_chk(fds, n, timeout, fdslen);
	return poll(fds, n, timeout);
}

EXPORT int __ppoll_chk(struct pollfd *fds, nfds_t n, const struct timespec *tmo, const sigset_t *mask, size_t fdslen)
{
	if (unlikely(fdslen / sizeof(*fds) < n) && RW(ppoll_chk))
		return rw.ppoll_chk(fds, n, tmo, mask, fdslen);
	return ppoll(fds, n, tmo, mask);
}

// ---- select, pselect
//
// The sets are bit arrays of nfds bits, which may exceed FD_SETSIZE; they
// are handled as arrays of longs (FD_ISSET would trip the fortify check).
// A harvest that finds nothing clears the sets, so the caller's are kept
// and restored before each real call.

#define LBITS (8 * (int)sizeof(long))

struct sel_ctx {
	int nfds;
	fd_set *set[3];
	size_t bytes; // of each set
	unsigned long *save; // the caller's sets, 3 x bytes
};

static int bit(const void *set, int fd)
{
	return (((const unsigned long *)set)[fd / LBITS] >> (fd % LBITS)) & 1;
}

static void sel_restore(struct sel_ctx *s)
{
	for (int k = 0; k < 3; k++)
		if (s->set[k])
			memcpy(s->set[k], (char *)s->save + k * s->bytes, s->bytes);
}

static int sel_merge(struct sel_ctx *s, int n)
{
	fd_set *rd = s->set[0];
	if (!rd)
		return n;
	for (int fd = 0; fd < s->nfds; fd++) {
		if (!bit(s->save, fd) || !mpp_stash_ready(fd) || bit(rd, fd))
			continue;
		((unsigned long *)rd)[fd / LBITS] |= 1UL << (fd % LBITS);
		n++;
	}
	return n;
}

static int sel_op_now(void *c, const sigset_t *mask)
{
	struct sel_ctx *s = c;
	struct timespec zero = {0, 0};
	sel_restore(s);
	int r = RW(pselect)(s->nfds, s->set[0], s->set[1], s->set[2], &zero, mask);
	if (r >= 0)
		return sel_merge(s, r);
	if (errno != EINTR)
		return -1;
	for (int k = 0; k < 3; k++)
		if (s->set[k])
			memset(s->set[k], 0, s->bytes);
	r = sel_merge(s, 0);
	if (r == 0) {
		sel_restore(s); // the kernel leaves the sets as they were on EINTR
		errno = EINTR;
		return -1;
	}
	return r;
}

static int sel_op_block(void *c, const struct timespec *left, const sigset_t *mask)
{
	struct sel_ctx *s = c;
	sel_restore(s);
	return RW(pselect)(s->nfds, s->set[0], s->set[1], s->set[2], left, mask);
}

static int sel_op_merge(void *c, int n)
{
	return sel_merge(c, n);
}

static const struct wait_ops sel_ops = {sel_op_now, sel_op_block, sel_op_merge};

// sel_run makes a select with the stashes: tmo NULL is no limit, a zero
// tmo one look. left gets the time that remained.
static int sel_run(int nfds, fd_set *r, fd_set *w, fd_set *e, const struct timespec *tmo, const sigset_t *mask,
		   struct timespec *left)
{
	unsigned long stack[3 * FD_SETSIZE / LBITS];
	struct sel_ctx s = {nfds, {r, w, e}, (size_t)(nfds + LBITS - 1) / LBITS * sizeof(long), stack};
	int ret;

	if (3 * s.bytes > sizeof(stack) && !(s.save = malloc(3 * s.bytes)))
		return RW(pselect)(nfds, r, w, e, tmo, mask); // no memory: no stashes
	for (int k = 0; k < 3; k++) {
		if (s.set[k])
			memcpy((char *)s.save + k * s.bytes, s.set[k], s.bytes);
		else
			memset((char *)s.save + k * s.bytes, 0, s.bytes);
	}
	if (ts_zero(tmo)) {
		ret = sel_op_now(&s, mask);
		if (left)
			left->tv_sec = left->tv_nsec = 0;
	} else {
		ret = wait_loop(&sel_ops, &s, tmo, mask, left);
	}
	if (s.save != stack) {
		int saved = errno;
		free(s.save);
		errno = saved;
	}
	return ret;
}

EXPORT int select(int nfds, fd_set *r, fd_set *w, fd_set *e, struct timeval *tv)
{
	if (tv && tv->tv_sec == 0 && tv->tv_usec == 0 && likely(LIVE() == 0))
		return RW(select)(nfds, r, w, e, tv);
	if (nfds < 0 || (tv && (tv->tv_sec < 0 || tv->tv_usec < 0 || tv->tv_usec >= 1000000)))
		return RW(select)(nfds, r, w, e, tv); // the kernel's EINVAL
	struct timespec t, left;
	if (tv) {
		t.tv_sec = tv->tv_sec;
		t.tv_nsec = tv->tv_usec * 1000L;
	}
	int ret = sel_run(nfds, r, w, e, tv ? &t : NULL, NULL, &left);
	if (tv) {
		// Linux's select says how much of the timeout was left.
		tv->tv_sec = left.tv_sec;
		tv->tv_usec = left.tv_nsec / 1000;
	}
	return ret;
}

EXPORT int pselect(int nfds, fd_set *r, fd_set *w, fd_set *e, const struct timespec *tmo, const sigset_t *mask)
{
	sigset_t buf;
	if (ts_zero(tmo)) {
		mask = with_wake_blocked(mask, &buf);
		if (likely(LIVE() == 0))
			return RW(pselect)(nfds, r, w, e, tmo, mask);
	}
	if (nfds < 0 || (tmo && !ts_valid(tmo)))
		return RW(pselect)(nfds, r, w, e, tmo, mask);
	return sel_run(nfds, r, w, e, tmo, mask, NULL);
}

// ---- epoll
//
// epoll_ctl is wrapped to learn, per epoll fd, which fds are registered for
// input, with which mask and which epoll_data: an event made up for a
// stashed fd carries the application's own data. Only registrations that
// ask for EPOLLIN or EPOLLRDNORM are kept. The table is the shim's view of
// the kernel's, kept under one mutex held across the real epoll_ctl (so two
// threads changing one registration leave the view in the kernel's order);
// epoll_ctl is not a hot call, and the waits take the mutex only while a
// stash holds bytes.
//
// Limits. An fd is keyed by its number: closing it (mpp_wait_close, from
// close), or a dup2/dup3 over it, forgets it, even if another descriptor of
// the same file keeps the kernel's registration alive; and since a closed
// number may come back as another socket before the shim hears of it, an
// event is made up only while the fd is still the file it was registered
// as (device and inode). An epoll fd copied by dup/dup2/dup3 shares its
// set; one copied by fcntl(F_DUPFD) or passed over a unix socket is unknown
// here (its waits get the kernel's answer only). After fork, parent and
// child share the kernel's sets but each has its own view. At most MAX_REGS
// registrations and epoll fds below MAX_EPFD are kept; others are counted
// in untracked and get the kernel's answer only.

#define MAX_REGS (1 << 20)
#define MAX_EPFD (1 << 20)
#define IN_EVENTS (EPOLLIN | EPOLLRDNORM)

struct reg {
	int fd; // -1: free slot
	uint32_t events;
	epoll_data_t data;
	dev_t dev; // the file registered, to tell a reused number
	ino_t ino;
	unsigned edge;      // EPOLLET: the stash edge last reported
	unsigned char seen; // edge is valid
	unsigned char off;  // EPOLLONESHOT: reported since the last ADD/MOD
};

struct epset {
	int refs; // epoll fd numbers naming this set
	unsigned n, cap, rot;
	struct reg *tab; // open addressing on fd, linear probing
};

static pthread_mutex_t reg_mu = PTHREAD_MUTEX_INITIALIZER;
static struct epset **sets; // by epoll fd
static int nsets;           // size of sets
static _Atomic int have_sets;
static unsigned long nregs;
static _Atomic unsigned long untracked;

static unsigned reg_hash(int fd, unsigned cap)
{
	return ((unsigned)fd * 2654435761u) & (cap - 1);
}

static struct reg *reg_find(struct epset *s, int fd)
{
	if (!s->cap)
		return NULL;
	for (unsigned i = reg_hash(fd, s->cap);; i = (i + 1) & (s->cap - 1)) {
		if (s->tab[i].fd == fd)
			return &s->tab[i];
		if (s->tab[i].fd < 0)
			return NULL;
	}
}

static int reg_grow(struct epset *s)
{
	unsigned cap = s->cap ? 2 * s->cap : 16;
	struct reg *t = malloc(cap * sizeof(*t));
	if (!t)
		return -1;
	for (unsigned i = 0; i < cap; i++)
		t[i].fd = -1;
	for (unsigned i = 0; i < s->cap; i++) {
		if (s->tab[i].fd < 0)
			continue;
		unsigned j = reg_hash(s->tab[i].fd, cap);
		while (t[j].fd >= 0)
			j = (j + 1) & (cap - 1);
		t[j] = s->tab[i];
	}
	free(s->tab);
	s->tab = t;
	s->cap = cap;
	return 0;
}

static struct reg *reg_add(struct epset *s, int fd)
{
	struct reg *r = reg_find(s, fd);
	if (r)
		return r;
	if (nregs >= MAX_REGS || (2 * (s->n + 1) > s->cap && reg_grow(s) < 0))
		return NULL;
	unsigned i = reg_hash(fd, s->cap);
	while (s->tab[i].fd >= 0)
		i = (i + 1) & (s->cap - 1);
	s->tab[i].fd = fd;
	s->n++;
	nregs++;
	return &s->tab[i];
}

// reg_del frees slot i, moving later entries of its probe run back so that
// no lookup stops early (no tombstones to sweep).
static void reg_del(struct epset *s, struct reg *r)
{
	unsigned m = s->cap - 1, i = (unsigned)(r - s->tab), j = i;
	for (;;) {
		j = (j + 1) & m;
		if (s->tab[j].fd < 0)
			break;
		unsigned k = reg_hash(s->tab[j].fd, s->cap);
		if (((j - k) & m) >= ((j - i) & m)) {
			s->tab[i] = s->tab[j];
			i = j;
		}
	}
	s->tab[i].fd = -1;
	s->n--;
	nregs--;
}

static struct epset *set_get(int epfd, int create)
{
	if (epfd < 0 || epfd >= MAX_EPFD)
		return NULL;
	if (epfd < nsets && sets[epfd])
		return sets[epfd];
	if (!create)
		return NULL;
	if (epfd >= nsets) {
		int n = nsets ? nsets : 64;
		while (n <= epfd)
			n *= 2;
		struct epset **t = realloc(sets, n * sizeof(*t));
		if (!t)
			return NULL;
		memset(t + nsets, 0, (n - nsets) * sizeof(*t));
		sets = t;
		nsets = n;
	}
	struct epset *s = calloc(1, sizeof(*s));
	if (!s)
		return NULL;
	s->refs = 1;
	sets[epfd] = s;
	atomic_store_explicit(&have_sets, 1, memory_order_relaxed);
	return s;
}

static void set_drop(int epfd)
{
	if (epfd < 0 || epfd >= nsets || !sets[epfd])
		return;
	struct epset *s = sets[epfd];
	sets[epfd] = NULL;
	if (--s->refs > 0)
		return;
	nregs -= s->n;
	free(s->tab);
	free(s);
}

// forget_number: fd now names something else (closed, or replaced by
// dup2/dup3, or a new epoll fd): neither a set nor a registration by it
// stays. Called with reg_mu held.
static void forget_number(int fd)
{
	set_drop(fd);
	for (int e = 0; e < nsets; e++) {
		struct reg *r;
		if (sets[e] && (r = reg_find(sets[e], fd)))
			reg_del(sets[e], r);
	}
}

static void identify(struct reg *r)
{
	struct stat st;
	if (fstat(r->fd, &st) == 0) {
		r->dev = st.st_dev;
		r->ino = st.st_ino;
	} else {
		r->dev = 0;
		r->ino = 0;
	}
}

static int same_file(const struct reg *r)
{
	struct stat st;
	return fstat(r->fd, &st) == 0 && st.st_dev == r->dev && st.st_ino == r->ino;
}

EXPORT int epoll_ctl(int epfd, int op, int fd, struct epoll_event *ev)
{
	pthread_mutex_lock(&reg_mu);
	int ret = RW(epoll_ctl)(epfd, op, fd, ev);
	if (ret == 0) {
		int saved = errno;
		struct epset *s = set_get(epfd, (op == EPOLL_CTL_ADD || op == EPOLL_CTL_MOD) && ev && (ev->events & IN_EVENTS));
		struct reg *r = s ? reg_find(s, fd) : NULL;
		if (op == EPOLL_CTL_DEL || !ev || !(ev->events & IN_EVENTS)) {
			if (r)
				reg_del(s, r);
		} else if (s && (r || (r = reg_add(s, fd)))) {
			// A new or re-armed registration is reported once even
			// under EPOLLET, as the kernel does after ADD and MOD.
			r->events = ev->events;
			r->data = ev->data;
			r->seen = 0;
			r->off = 0;
			identify(r);
		} else {
			atomic_fetch_add_explicit(&untracked, 1, memory_order_relaxed);
		}
		errno = saved;
	}
	pthread_mutex_unlock(&reg_mu);
	return ret;
}

// A new epoll fd may reuse the number of one whose close the shim did not
// see.
static int new_epfd(int fd)
{
	if (fd >= 0 && atomic_load_explicit(&have_sets, memory_order_relaxed)) {
		int saved = errno;
		pthread_mutex_lock(&reg_mu);
		forget_number(fd);
		pthread_mutex_unlock(&reg_mu);
		errno = saved;
	}
	return fd;
}

EXPORT int epoll_create(int size)
{
	return new_epfd(RW(epoll_create)(size));
}

EXPORT int epoll_create1(int flags)
{
	return new_epfd(RW(epoll_create1)(flags));
}

// dup_done: newfd is now a copy of oldfd; an epoll fd's copy names the
// same set. Called with reg_mu held.
static void dup_done(int oldfd, int newfd)
{
	forget_number(newfd);
	struct epset *s = set_get(oldfd, 0);
	if (s && set_get(newfd, 1)) {
		free(sets[newfd]);
		sets[newfd] = s;
		s->refs++;
	}
}

EXPORT int dup(int fd)
{
	if (likely(!atomic_load_explicit(&have_sets, memory_order_relaxed)))
		return RW(dup)(fd);
	pthread_mutex_lock(&reg_mu);
	int r = RW(dup)(fd);
	if (r >= 0) {
		int saved = errno;
		dup_done(fd, r);
		errno = saved;
	}
	pthread_mutex_unlock(&reg_mu);
	return r;
}

// dup2 and dup3 close newfd's file as close() does: its held bytes stay
// for that socket (gate.c) and its stash goes
// (stash.c), or newfd would read the closed socket's bytes first. Only if
// they succeed: a dup2 from a bad oldfd leaves newfd and its bytes alone.
static int dup_onto(int oldfd, int newfd, int flags, int three)
{
	int counted = oldfd != newfd ? mpp_stash_enter(newfd) : 0, r;
	// newfd's socket goes as by close(): its held bytes under a dup first.
	if (!GATE_IS_OPEN() && oldfd != newfd && fcntl(oldfd, F_GETFD) >= 0)
		mpp_keep_held(newfd);
	if (likely(!atomic_load_explicit(&have_sets, memory_order_relaxed))) {
		r = three ? RW(dup3)(oldfd, newfd, flags) : RW(dup2)(oldfd, newfd);
	} else {
		pthread_mutex_lock(&reg_mu);
		r = three ? RW(dup3)(oldfd, newfd, flags) : RW(dup2)(oldfd, newfd);
		if (r >= 0 && oldfd != newfd) {
			int saved = errno;
			dup_done(oldfd, newfd);
			errno = saved;
		}
		pthread_mutex_unlock(&reg_mu);
	}
	int saved = errno;
	if (r >= 0 && counted)
		mpp_stash_forget(newfd);
	mpp_stash_closed(newfd, counted);
	errno = saved;
	return r;
}

EXPORT int dup2(int oldfd, int newfd)
{
	return dup_onto(oldfd, newfd, 0, 0);
}

EXPORT int dup3(int oldfd, int newfd, int flags)
{
	return dup_onto(oldfd, newfd, flags, 1);
}

// mpp_wait_close is close's part here (wrap.c calls it before the real
// close): fd's registrations go, and so does the set if fd is an epoll fd.
// One load when no epoll set is known.
void mpp_wait_close(int fd)
{
	if (likely(!atomic_load_explicit(&have_sets, memory_order_relaxed)))
		return;
	int saved = errno;
	pthread_mutex_lock(&reg_mu);
	forget_number(fd);
	pthread_mutex_unlock(&reg_mu);
	errno = saved;
}

// kernel_armed tells whether fd's EPOLLONESHOT registration in epfd is
// still armed for input: the kernel disarms it on its own report, which a
// zero-timeout wait made while no stash was live returned without the
// shim looking. The kernel's mask is in /proc/self/fdinfo/<epfd> ("tfd: N
// events: HEX"): a disarmed one keeps only EPOLLONESHOT and its like (or
// EPOLLERR|EPOLLHUP after the shim's own disarm). Read at most once per
// arming. Raw syscalls: close and read are wrapped, and close would take
// reg_mu. -1 if unknown.
static int kernel_armed(int epfd, int fd)
{
	char path[64], buf[4096];
	snprintf(path, sizeof(path), "/proc/self/fdinfo/%d", epfd);
	int f = open(path, O_RDONLY | O_CLOEXEC);
	if (f < 0)
		return -1;
	size_t have = 0;
	int res = -1;
	for (;;) {
		ssize_t k = syscall(SYS_read, f, buf + have, sizeof(buf) - 1 - have);
		if (k <= 0)
			break;
		have += (size_t)k;
		buf[have] = 0;
		char *line = buf, *nl;
		while ((nl = strchr(line, '\n'))) {
			int tfd;
			unsigned ev;
			*nl = 0;
			if (sscanf(line, "tfd: %d events: %x", &tfd, &ev) == 2 && tfd == fd) {
				res = (ev & IN_EVENTS) != 0;
				goto out;
			}
			line = nl + 1;
		}
		have = strlen(line);
		if (have == sizeof(buf) - 1)
			have = 0; // no line is that long
		memmove(buf, line, have);
	}
out:
	syscall(SYS_close, f);
	return res;
}

// ep_merge adds, to the n events the kernel returned in ev, one for each
// registration of epfd whose fd's stash holds bytes: as EPOLLIN (and/or
// EPOLLRDNORM, as asked) ORed into the kernel's event for it if there is
// one (found by its epoll_data: the kernel's events carry nothing else),
// else appended while there is room. EPOLLET: once per stash edge;
// EPOLLONESHOT: once per arming, and the kernel's registration is disarmed
// too (MOD with no input event), so that it does not report it a second
// time before the application re-arms it.
static int ep_merge(int epfd, struct epoll_event *ev, int n, int max)
{
	int nk = n, nstale = 0, stale[8];
	pthread_mutex_lock(&reg_mu);
	struct epset *s = set_get(epfd, 0);
	if (!s || !s->n)
		goto out;
	for (unsigned k = 0; k < s->cap; k++) {
		unsigned i = (s->rot + k) & (s->cap - 1);
		struct reg *r = &s->tab[i];
		if (r->fd < 0 || r->off || !mpp_stash_ready(r->fd))
			continue;
		unsigned e = mpp_stash_edge(r->fd);
		if ((r->events & EPOLLET) && r->seen && r->edge == e)
			continue;
		if (!same_file(r)) {
			// Its number is another file's now: dropped after the
			// walk, which a deletion's moves would upset.
			if (nstale < (int)(sizeof(stale) / sizeof(stale[0])))
				stale[nstale++] = r->fd;
			continue;
		}
		uint32_t want = r->events & IN_EVENTS;
		int j;
		for (j = 0; j < nk && ev[j].data.u64 != r->data.u64; j++)
			;
		if (j == nk) {
			if (r->events & EPOLLONESHOT) {
				int a = kernel_armed(epfd, r->fd);
				if (a == 0) {
					r->off = 1;
					continue;
				}
			}
			if (n >= max) {
				s->rot = i; // start here next time: no fd starves
				break;
			}
			ev[n].events = want;
			ev[n].data = r->data;
			n++;
			if (r->events & EPOLLONESHOT) {
				struct epoll_event d = {.events = r->events & (EPOLLONESHOT | EPOLLET), .data = r->data};
				RW(epoll_ctl)(epfd, EPOLL_CTL_MOD, r->fd, &d);
			}
		} else {
			ev[j].events |= want;
		}
		r->seen = 1;
		r->edge = e;
		if (r->events & EPOLLONESHOT)
			r->off = 1;
	}
	for (int i = 0; i < nstale; i++) {
		struct reg *r = reg_find(s, stale[i]);
		if (r)
			reg_del(s, r);
	}
out:
	pthread_mutex_unlock(&reg_mu);
	return n;
}

struct ep_ctx {
	int epfd;
	struct epoll_event *ev;
	int max;
	int ms; // epoll_wait/epoll_pwait (milliseconds), not epoll_pwait2
};

// ep_pending counts epfd's registrations that ep_merge would report now.
static int ep_pending(int epfd)
{
	int c = 0;
	pthread_mutex_lock(&reg_mu);
	struct epset *s = set_get(epfd, 0);
	for (unsigned i = 0; s && s->n && i < s->cap; i++) {
		struct reg *r = &s->tab[i];
		if (r->fd >= 0 && !r->off && mpp_stash_ready(r->fd) &&
		    !((r->events & EPOLLET) && r->seen && r->edge == mpp_stash_edge(r->fd)))
			c++;
	}
	pthread_mutex_unlock(&reg_mu);
	return c;
}

// ep_now asks the kernel for fewer events than the caller has room for
// when stashed fds are waiting, so that a set whose kernel-ready fds fill
// maxevents at every call does not starve the stashed ones (all but one
// slot at most: the kernel's own events are never held back entirely).
static int ep_now(struct ep_ctx *c, const sigset_t *mask)
{
	int p = c->max > 1 ? ep_pending(c->epfd) : 0;
	int kmax = c->max - (p < c->max - 1 ? p : c->max - 1);
	int r = RW(epoll_pwait)(c->epfd, c->ev, kmax, 0, mask);
	if (r >= 0)
		return ep_merge(c->epfd, c->ev, r, c->max);
	if (errno != EINTR)
		return -1;
	r = ep_merge(c->epfd, c->ev, 0, c->max);
	if (r == 0) {
		errno = EINTR;
		return -1;
	}
	return r;
}

static int ep_op_now(void *c, const sigset_t *mask)
{
	return ep_now(c, mask);
}

static int ep_op_block(void *v, const struct timespec *left, const sigset_t *mask)
{
	struct ep_ctx *c = v;
	if (c->ms)
		return RW(epoll_pwait)(c->epfd, c->ev, c->max, ts_ms(left), mask);
	if (!RW(epoll_pwait2)) {
		errno = ENOSYS;
		return -1;
	}
	return rw.epoll_pwait2(c->epfd, c->ev, c->max, left, mask);
}

static int ep_op_merge(void *v, int n)
{
	struct ep_ctx *c = v;
	return ep_merge(c->epfd, c->ev, n, c->max);
}

static const struct wait_ops ep_ops = {ep_op_now, ep_op_block, ep_op_merge};

static int ep_wait(int epfd, struct epoll_event *ev, int max, const struct timespec *tmo, const sigset_t *mask, int ms)
{
	struct ep_ctx c = {epfd, ev, max, ms};
	if (ts_zero(tmo))
		return ep_now(&c, mask);
	return wait_loop(&ep_ops, &c, tmo, mask, NULL);
}

EXPORT int epoll_wait(int epfd, struct epoll_event *ev, int max, int timeout)
{
	if (timeout == 0 && likely(LIVE() == 0))
		return RW(epoll_wait)(epfd, ev, max, 0);
	if (max <= 0)
		return RW(epoll_wait)(epfd, ev, max, timeout);
	struct timespec t = {timeout / 1000, (timeout % 1000) * 1000000L};
	return ep_wait(epfd, ev, max, timeout >= 0 ? &t : NULL, NULL, 1);
}

EXPORT int epoll_pwait(int epfd, struct epoll_event *ev, int max, int timeout, const sigset_t *mask)
{
	sigset_t buf;
	if (timeout == 0) {
		mask = with_wake_blocked(mask, &buf);
		if (likely(LIVE() == 0))
			return RW(epoll_pwait)(epfd, ev, max, 0, mask);
	}
	if (max <= 0)
		return RW(epoll_pwait)(epfd, ev, max, timeout, mask);
	struct timespec t = {timeout / 1000, (timeout % 1000) * 1000000L};
	return ep_wait(epfd, ev, max, timeout >= 0 ? &t : NULL, mask, 1);
}

EXPORT int epoll_pwait2(int epfd, struct epoll_event *ev, int max, const struct timespec *tmo, const sigset_t *mask)
{
	sigset_t buf;
	if (!RW(epoll_pwait2)) {
		errno = ENOSYS;
		return -1;
	}
	if (ts_zero(tmo)) {
		mask = with_wake_blocked(mask, &buf);
		if (likely(LIVE() == 0))
			return rw.epoll_pwait2(epfd, ev, max, tmo, mask);
	}
	if (max <= 0 || (tmo && !ts_valid(tmo)))
		return rw.epoll_pwait2(epfd, ev, max, tmo, mask);
	return ep_wait(epfd, ev, max, tmo, mask, 0);
}

// ---- set-up

// pick_signal chooses the wake signal: MPIPAUSE_WAKE_SIGNAL (a number,
// RTMIN+n or RTMAX-n; 0 or "none" for no signal: blocking waits then wake
// every 10 ms to look), else SIGRTMAX-5. MPI libraries and their
// transports use SIGUSR1/2, SIGALRM, SIGCHLD and SIGRTMIN-based numbers,
// valgrind the highest real-time ones. A signal that already has a handler
// (another preloaded library's constructor) is not taken from it: the next
// lower real-time signal with the default action is used instead, down to
// SIGRTMIN+2; if none is free, no signal. The application setting a
// handler for it later would break the wake (sig.c could record it, as it
// does SIGTSTP's).
static int sig_free(int s)
{
	struct sigaction old;
	return RW(sigaction)(s, NULL, &old) == 0 && !(old.sa_flags & SA_SIGINFO) && old.sa_handler == SIG_DFL;
}

static int pick_signal(void)
{
	const char *v = getenv("MPIPAUSE_WAKE_SIGNAL");
	int sig = SIGRTMAX - 5;
	if (v && *v) {
		char *end;
		if (strncmp(v, "SIG", 3) == 0)
			v += 3;
		if (strcmp(v, "none") == 0)
			return 0;
		if (strncmp(v, "RTMIN+", 6) == 0)
			sig = SIGRTMIN + (int)strtol(v + 6, &end, 10);
		else if (strncmp(v, "RTMAX-", 6) == 0)
			sig = SIGRTMAX - (int)strtol(v + 6, &end, 10);
		else
			sig = (int)strtol(v, &end, 10);
		if (sig == 0)
			return 0;
		if (*end || sig < 1 || sig > SIGRTMAX || sig == SIGKILL || sig == SIGSTOP)
			sig = SIGRTMAX - 5;
	}
	if (sig_free(sig))
		return sig;
	for (int s = SIGRTMAX - 5; s >= SIGRTMIN + 2; s--)
		if (s != sig && sig_free(s))
			return s;
	return 0;
}

static void at_prepare(void)
{
	pthread_mutex_lock(&reg_mu);
	pthread_mutex_lock(&wake_mu);
}

static void at_parent(void)
{
	pthread_mutex_unlock(&wake_mu);
	pthread_mutex_unlock(&reg_mu);
}

// The child has one thread, which is in no wait.
static void at_child(void)
{
	for (int i = 0; i < WAITERS; i++)
		atomic_store_explicit(&waiters[i], 0, memory_order_relaxed);
	my_tid = 0;
	at_parent();
}

// mpp_wait_init runs from the library's constructor, before any thread of
// the program can block in a wait that a stash would have to end; a
// blocking wait that comes earlier (another library's constructor) runs it.
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void wait_init_once(void)
{
	wait_resolve();
	int sig = pick_signal();
	if (sig) {
		// SA_RESTART although the waits are never restarted: a wake
		// taken outside a wait (one left pending, then unblocked by the
		// application) restarts the call it lands in instead of failing
		// it with EINTR.
		struct sigaction sa;
		memset(&sa, 0, sizeof(sa));
		sa.sa_handler = on_wake;
		sa.sa_flags = SA_RESTART;
		sigemptyset(&sa.sa_mask);
		if (RW(sigaction)(sig, &sa, NULL) == 0)
			wake_sig = sig;
	}
	pthread_atfork(at_prepare, at_parent, at_child);
	atomic_store_explicit(&inited, 1, memory_order_release);
}

void mpp_wait_init(void)
{
	pthread_once(&init_once, wait_init_once);
}

// mpipause_test_wait_signal is the wake signal (0: none), for the C tests.
EXPORT int mpipause_test_wait_signal(void)
{
	return wake_sig;
}

// mpipause_test_wait_untracked counts epoll registrations beyond the
// shim's tables, for the C tests.
EXPORT unsigned long mpipause_test_wait_untracked(void)
{
	return atomic_load(&untracked);
}
