// SPDX-License-Identifier: Apache-2.0
//
// dup, dup2 and dup3. A copy of an epoll fd names the same set in the
// shim's view of the sets (epoll.c), as in the kernel; and dup2 and dup3
// close the file they replace, which the send gate and the drain must see
// as they see close.
#include "waits.h"

#include <errno.h>
#include <fcntl.h>

EXPORT int dup(int fd)
{
	if (likely(!atomic_load_explicit(&mpp_epoll_have_sets, memory_order_relaxed)))
		return RW(dup)(fd);
	mpp_epoll_lock();
	int r = RW(dup)(fd);
	if (r >= 0) {
		int saved = errno;
		mpp_epoll_dup_done(fd, r);
		errno = saved;
	}
	mpp_epoll_unlock();
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
	if (likely(!atomic_load_explicit(&mpp_epoll_have_sets, memory_order_relaxed))) {
		r = three ? RW(dup3)(oldfd, newfd, flags) : RW(dup2)(oldfd, newfd);
	} else {
		mpp_epoll_lock();
		r = three ? RW(dup3)(oldfd, newfd, flags) : RW(dup2)(oldfd, newfd);
		if (r >= 0 && oldfd != newfd) {
			int saved = errno;
			mpp_epoll_dup_done(oldfd, newfd);
			errno = saved;
		}
		mpp_epoll_unlock();
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
