// SPDX-License-Identifier: Apache-2.0
//
// The wrapped waits' wake and their blocking loop (waits.h).
//
// The wake. A thread may have entered a blocking wait while every stash
// was empty; when the shim's thread then stashes the bytes that woke it,
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
#include "waits.h"

#include <errno.h>
#include <pthread.h>
#include <sched.h>
#include <stdlib.h>
#include <string.h>
#include <sys/syscall.h>
#include <time.h>
#include <unistd.h>

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

// mpp_wait_wake runs on the shim's thread after a stash went from empty
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

// glibc's pthread_cleanup_push (a sigsetjmp in C without -fexceptions)
// trips -Wclobbered on its own variables: GCC bug 61118.
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wclobbered"
int mpp_wait_loop(const struct wait_ops *ops, void *c, const struct timespec *tmo, const sigset_t *app,
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

const sigset_t *mpp_with_wake_blocked(const sigset_t *app, sigset_t *buf)
{
	if (!app || !wake_sig || sigismember(app, wake_sig))
		return app;
	*buf = *app;
	sigaddset(buf, wake_sig);
	return buf;
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
	return REAL(sigaction)(s, NULL, &old) == 0 && !(old.sa_flags & SA_SIGINFO) && old.sa_handler == SIG_DFL;
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

// The fork hook's part (shim.c): wake_mu is held over a fork, so that the
// child never has it locked by a thread that does not go on there.
void mpp_wait_fork_prepare(void)
{
	pthread_mutex_lock(&wake_mu);
}

void mpp_wait_fork_parent(void)
{
	pthread_mutex_unlock(&wake_mu);
}

// The child has one thread, which is in no wait.
void mpp_wait_child(void)
{
	for (int i = 0; i < WAITERS; i++)
		atomic_store_explicit(&waiters[i], 0, memory_order_relaxed);
	my_tid = 0;
	pthread_mutex_unlock(&wake_mu);
}

// mpp_wait_init runs from the library's constructor, before any thread of
// the program can block in a wait that a stash would have to end; a
// blocking wait that comes earlier (another library's constructor) runs it.
static pthread_once_t init_once = PTHREAD_ONCE_INIT;

static void wait_init_once(void)
{
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
		if (REAL(sigaction)(sig, &sa, NULL) == 0)
			wake_sig = sig;
	}
	// A wait before the constructor may come with threads that fork: the
	// fork hook goes in now.
	mpp_fork_init();
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

_Atomic unsigned long mpp_idle_yields;

// mpipause_test_idle_yields is how many waits gave up the CPU (mpp_idle).
EXPORT unsigned long mpipause_test_idle_yields(void)
{
	return atomic_load(&mpp_idle_yields);
}
