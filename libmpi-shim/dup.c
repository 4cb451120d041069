// SPDX-License-Identifier: Apache-2.0
//
// dup, dup2, dup3 and fcntl's F_DUPFD. A copy of an epoll fd names the same
// set in the shim's view of the sets (epoll.c), as in the kernel; a copy of
// a socket whose stash holds bytes reads them first, as the original does
// (stash.c); and dup2 and dup3 close the file they replace, which the send
// gate and the drain must see as they see close.
#include "waits.h"

#include <errno.h>
#include <fcntl.h>
#include <stdarg.h>

static void adopted(int fd)
{
	int saved = errno;
	mpp_stash_adopt(fd);
	errno = saved;
}

EXPORT int dup(int fd)
{
	int r;
	if (likely(!atomic_load_explicit(&mpp_epoll_have_sets, memory_order_relaxed))) {
		r = REAL(dup)(fd);
	} else {
		mpp_epoll_lock();
		r = REAL(dup)(fd);
		if (r >= 0) {
			int saved = errno;
			mpp_epoll_dup_done(fd, r);
			errno = saved;
		}
		mpp_epoll_unlock();
	}
	if (r >= 0)
		adopted(r);
	return r;
}

// fcntl's third argument is an int or a pointer by the command: passed on
// as a pointer-sized word, as glibc itself reads it.
static int fcntl_with(int (*real)(int, int, ...), int fd, int cmd, void *arg)
{
	int r = real(fd, cmd, arg);
	if (r >= 0 && (cmd == F_DUPFD || cmd == F_DUPFD_CLOEXEC))
		adopted(r);
	return r;
}

EXPORT int fcntl(int fd, int cmd, ...)
{
	va_list ap;
	va_start(ap, cmd);
	void *arg = va_arg(ap, void *);
	va_end(ap);
	return fcntl_with(REAL(fcntl), fd, cmd, arg);
}
extern __typeof__(fcntl) mpp_wrapped_fcntl __attribute__((alias("fcntl")));

// Programs built with 64-bit file offsets on glibc 2.28 and later call
// fcntl64.
EXPORT int fcntl64(int fd, int cmd, ...)
{
	va_list ap;
	va_start(ap, cmd);
	void *arg = va_arg(ap, void *);
	va_end(ap);
	int (*real)(int, int, ...) = REAL(fcntl);
	if (REAL_OPT(fcntl64) != NULL)
		real = REAL(fcntl64);
	return fcntl_with(real, fd, cmd, arg);
}

// dup2 and dup3 close newfd's file as close() does: its held bytes stay
// for that socket (flush.c) and it leaves that socket's stash (stash.c), or
// newfd would read the closed socket's bytes first; then it is a copy of
// oldfd's socket, stash and all. Only if
// they succeed: a dup2 from a bad oldfd leaves newfd and its bytes alone.
static int dup_onto(int oldfd, int newfd, int flags, int three)
{
	int counted = oldfd != newfd ? mpp_stash_enter(newfd) : 0, r;
	// newfd's socket goes as by close(): its held bytes under a dup first.
	if (!GATE_IS_OPEN() && oldfd != newfd && REAL(fcntl)(oldfd, F_GETFD) >= 0)
		mpp_keep_held(newfd);
	if (likely(!atomic_load_explicit(&mpp_epoll_have_sets, memory_order_relaxed))) {
		r = three ? REAL(dup3)(oldfd, newfd, flags) : REAL(dup2)(oldfd, newfd);
	} else {
		mpp_epoll_lock();
		r = three ? REAL(dup3)(oldfd, newfd, flags) : REAL(dup2)(oldfd, newfd);
		if (r >= 0 && oldfd != newfd) {
			int saved = errno;
			mpp_epoll_dup_done(oldfd, newfd);
			errno = saved;
		}
		mpp_epoll_unlock();
	}
	int saved = errno;
	if (r >= 0 && counted) {
		mpp_stash_forget(newfd);
		mpp_stash_adopt(newfd);
	}
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
