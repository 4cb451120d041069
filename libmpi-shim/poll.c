// SPDX-License-Identifier: Apache-2.0
//
// poll, ppoll, the fortified __poll_chk and __ppoll_chk, select and
// pselect: the wrapped waits (waits.h) over a poll array and over fd sets.
#include "waits.h"

#include <errno.h>
#include <stdlib.h>
#include <string.h>

int __poll_chk(struct pollfd *fds, nfds_t n, int timeout, size_t fdslen);
int __ppoll_chk(struct pollfd *fds, nfds_t n, const struct timespec *tmo, const sigset_t *mask, size_t fdslen);

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
	int r = REAL(ppoll)(fds, n, &zero, mask);
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
	return REAL(ppoll)(p->fds, p->n, left, mask);
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
			return mpp_idle(REAL(poll)(fds, n, 0));
		return mpp_idle(poll_now(fds, n, NULL));
	}
	struct poll_ctx p = {fds, n};
	struct timespec t = {timeout / 1000, (timeout % 1000) * 1000000L};
	return mpp_wait_loop(&poll_ops, &p, timeout > 0 ? &t : NULL, NULL, NULL);
}

EXPORT int ppoll(struct pollfd *fds, nfds_t n, const struct timespec *tmo, const sigset_t *mask)
{
	sigset_t buf;
	if (ts_zero(tmo)) {
		mask = mpp_with_wake_blocked(mask, &buf);
		if (likely(LIVE() == 0))
			return mpp_idle(REAL(ppoll)(fds, n, tmo, mask));
		return mpp_idle(poll_now(fds, n, mask));
	}
	if ((tmo && !ts_valid(tmo)))
		return REAL(ppoll)(fds, n, tmo, mask); // the kernel's EINVAL
	struct poll_ctx p = {fds, n};
	return mpp_wait_loop(&poll_ops, &p, tmo, mask, NULL);
}

// A fortified build calls these instead (glibc's own poll is not reached
// through the PLT from them). A short buffer goes to the real one, which
// aborts as it should.
EXPORT int __poll_chk(struct pollfd *fds, nfds_t n, int timeout, size_t fdslen)
{
	if (unlikely(fdslen / sizeof(*fds) < n) && REAL_OPT(poll_chk))
		return REAL(poll_chk)(fds, n, timeout, fdslen);
	return poll(fds, n, timeout);
}

EXPORT int __ppoll_chk(struct pollfd *fds, nfds_t n, const struct timespec *tmo, const sigset_t *mask, size_t fdslen)
{
	if (unlikely(fdslen / sizeof(*fds) < n) && REAL_OPT(ppoll_chk))
		return REAL(ppoll_chk)(fds, n, tmo, mask, fdslen);
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
	size_t bytes;        // of each set
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
	int r = REAL(pselect)(s->nfds, s->set[0], s->set[1], s->set[2], &zero, mask);
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
	return REAL(pselect)(s->nfds, s->set[0], s->set[1], s->set[2], left, mask);
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
		return REAL(pselect)(nfds, r, w, e, tmo, mask); // no memory: no stashes
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
		ret = mpp_wait_loop(&sel_ops, &s, tmo, mask, left);
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
	int zero = tv && tv->tv_sec == 0 && tv->tv_usec == 0;
	if (zero && likely(LIVE() == 0))
		return mpp_idle(REAL(select)(nfds, r, w, e, tv));
	if (nfds < 0 || (tv && (tv->tv_sec < 0 || tv->tv_usec < 0 || tv->tv_usec >= 1000000)))
		return REAL(select)(nfds, r, w, e, tv); // the kernel's EINVAL
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
	return zero ? mpp_idle(ret) : ret;
}

EXPORT int pselect(int nfds, fd_set *r, fd_set *w, fd_set *e, const struct timespec *tmo, const sigset_t *mask)
{
	sigset_t buf;
	if (ts_zero(tmo)) {
		mask = mpp_with_wake_blocked(mask, &buf);
		if (likely(LIVE() == 0))
			return mpp_idle(REAL(pselect)(nfds, r, w, e, tmo, mask));
	}
	if (nfds < 0 || (tmo && !ts_valid(tmo)))
		return REAL(pselect)(nfds, r, w, e, tmo, mask);
	int ret = sel_run(nfds, r, w, e, tmo, mask, NULL);
	return ts_zero(tmo) ? mpp_idle(ret) : ret;
}
