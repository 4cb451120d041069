// SPDX-License-Identifier: Apache-2.0
//
// The wrapped waits: poll, ppoll, select, pselect, epoll_wait, epoll_pwait,
// epoll_pwait2 and the fortified __poll_chk and __ppoll_chk. While a pause
// is in progress the shim's thread empties the rank's TCP receive queues
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
// The parts: wake.c wakes a thread blocked in a wait when bytes get
// stashed, around the real call (mpp_wait_loop) that every blocking wait
// makes; poll.c holds poll, ppoll and select, pselect; epoll.c the epoll
// waits over the shim's view of the epoll sets; dup.c the dup family, which
// copies epoll fds and closes what it replaces. This header is what they
// share.
#ifndef MPIPAUSE_WAITS_H
#define MPIPAUSE_WAITS_H

#include "shim.h"

#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <time.h>

#define unlikely(x) __builtin_expect(!!(x), 0)
#define LIVE() atomic_load_explicit(&mpp_stash_live, memory_order_relaxed)

// mpp_idle is what a wait with a zero timeout returns: r, after the
// calling thread gives up its CPU (sched_yield) if the wait found nothing
// while the gate is closed. An MPI library's progress loop (UCX's
// epoll_wait(.., 0), Open MPI's event loop) then spins waiting for bytes
// its peers' closed gates hold, on a node where every core may be busy,
// while the pause waits for the shim's thread (the DRAIN) and for mpid,
// which need a CPU. The yield takes from the rank nothing it could use
// and gives nobody a priority: the scheduler runs whoever else waits for
// the CPU, or the rank again at once. mpp_idle_yields counts the yields,
// for the C tests.
extern _Atomic unsigned long mpp_idle_yields;
static inline int mpp_idle(int r)
{
	if (r == 0 && unlikely(GATE_STATE(atomic_load_explicit(&mpp_gate, memory_order_relaxed)) == GATE_CLOSED)) {
		atomic_fetch_add_explicit(&mpp_idle_yields, 1, memory_order_relaxed);
		sched_yield();
	}
	return r;
}

static inline int ts_valid(const struct timespec *t)
{
	return t->tv_sec >= 0 && t->tv_nsec >= 0 && t->tv_nsec < 1000000000L;
}

static inline int ts_zero(const struct timespec *t)
{
	return t && t->tv_sec == 0 && t->tv_nsec == 0;
}

// ts_ms rounds up, as the kernel does a poll timeout: a wait never ends
// before its time.
static inline int ts_ms(const struct timespec *t)
{
	if (!t)
		return -1;
	if (t->tv_sec >= INT_MAX / 1000 - 1)
		return INT_MAX;
	return (int)(t->tv_sec * 1000 + (t->tv_nsec + 999999) / 1000000);
}

// One kind of wait, for mpp_wait_loop: now() makes the real call with a
// zero timeout and adds the stash-ready fds (a count, or -1 and errno);
// block() makes the real call; merge() adds the stash-ready fds to what a
// blocking call returned (n > 0).
struct wait_ops {
	int (*now)(void *c, const sigset_t *mask);
	int (*block)(void *c, const struct timespec *left, const sigset_t *mask);
	int (*merge)(void *c, int n);
};

// mpp_wait_loop runs a blocking wait (tmo NULL: no limit) with the wake.
// *left, if not NULL, gets the time that remained (select's timeval).
int mpp_wait_loop(const struct wait_ops *ops, void *c, const struct timespec *tmo, const sigset_t *app,
		  struct timespec *left);
// mpp_with_wake_blocked returns the application's mask with the wake
// signal added, for a wait that must not take a wake left pending (a wait
// that is not registered is never the one a wake is for).
const sigset_t *mpp_with_wake_blocked(const sigset_t *app, sigset_t *buf);

// What dup.c needs of epoll.c's view of the epoll sets: mpp_epoll_have_sets
// is nonzero once any set is known (until then a dup has nothing to tell
// it); mpp_epoll_lock and mpp_epoll_unlock take and give back the mutex the
// view is kept under, held across the real call that changes the kernel's
// sets; mpp_epoll_dup_done, with it held, says that newfd is now a copy of
// oldfd.
extern _Atomic int mpp_epoll_have_sets;
void mpp_epoll_lock(void);
void mpp_epoll_unlock(void);
void mpp_epoll_dup_done(int oldfd, int newfd);

#endif
