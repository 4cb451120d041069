// SPDX-License-Identifier: Apache-2.0
//
// The epoll waits, epoll_wait, epoll_pwait and epoll_pwait2 (waits.h), and
// the shim's view of the epoll sets they report stashed fds from.
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
#include "waits.h"

#include <errno.h>
#include <fcntl.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

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
_Atomic int mpp_epoll_have_sets;
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
	atomic_store_explicit(&mpp_epoll_have_sets, 1, memory_order_relaxed);
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
	int ret = REAL(epoll_ctl)(epfd, op, fd, ev);
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
	if (fd >= 0 && atomic_load_explicit(&mpp_epoll_have_sets, memory_order_relaxed)) {
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
	return new_epfd(REAL(epoll_create)(size));
}

EXPORT int epoll_create1(int flags)
{
	return new_epfd(REAL(epoll_create1)(flags));
}

// mpp_epoll_dup_done (dup.c): newfd is now a copy of oldfd; an epoll fd's
// copy names the same set. Called with reg_mu held.
void mpp_epoll_dup_done(int oldfd, int newfd)
{
	forget_number(newfd);
	struct epset *s = set_get(oldfd, 0);
	if (s && set_get(newfd, 1)) {
		free(sets[newfd]);
		sets[newfd] = s;
		s->refs++;
	}
}

// reg_mu for dup.c, held across its real call as epoll_ctl holds it.
void mpp_epoll_lock(void)
{
	pthread_mutex_lock(&reg_mu);
}

void mpp_epoll_unlock(void)
{
	pthread_mutex_unlock(&reg_mu);
}

// The fork hook's part (shim.c): reg_mu is held over a fork, so that the
// child's view of the sets is whole.
void mpp_epoll_fork_prepare(void)
{
	pthread_mutex_lock(&reg_mu);
}

void mpp_epoll_fork_parent(void)
{
	pthread_mutex_unlock(&reg_mu);
}

void mpp_epoll_fork_child(void)
{
	pthread_mutex_unlock(&reg_mu);
}

// mpp_wait_close is close's part here (wrap.c calls it before the real
// close): fd's registrations go, and so does the set if fd is an epoll fd.
// One load when no epoll set is known.
void mpp_wait_close(int fd)
{
	if (likely(!atomic_load_explicit(&mpp_epoll_have_sets, memory_order_relaxed)))
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
				REAL(epoll_ctl)(epfd, EPOLL_CTL_MOD, r->fd, &d);
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
	int r = REAL(epoll_pwait)(c->epfd, c->ev, kmax, 0, mask);
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
		return REAL(epoll_pwait)(c->epfd, c->ev, c->max, ts_ms(left), mask);
	if (!REAL_OPT(epoll_pwait2)) {
		errno = ENOSYS;
		return -1;
	}
	return REAL(epoll_pwait2)(c->epfd, c->ev, c->max, left, mask);
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
	return mpp_wait_loop(&ep_ops, &c, tmo, mask, NULL);
}

EXPORT int epoll_wait(int epfd, struct epoll_event *ev, int max, int timeout)
{
	if (timeout == 0 && likely(LIVE() == 0))
		return mpp_idle(REAL(epoll_wait)(epfd, ev, max, 0));
	if (max <= 0)
		return REAL(epoll_wait)(epfd, ev, max, timeout);
	struct timespec t = {timeout / 1000, (timeout % 1000) * 1000000L};
	int r = ep_wait(epfd, ev, max, timeout >= 0 ? &t : NULL, NULL, 1);
	return timeout == 0 ? mpp_idle(r) : r;
}

EXPORT int epoll_pwait(int epfd, struct epoll_event *ev, int max, int timeout, const sigset_t *mask)
{
	sigset_t buf;
	if (timeout == 0) {
		mask = mpp_with_wake_blocked(mask, &buf);
		if (likely(LIVE() == 0))
			return mpp_idle(REAL(epoll_pwait)(epfd, ev, max, 0, mask));
	}
	if (max <= 0)
		return REAL(epoll_pwait)(epfd, ev, max, timeout, mask);
	struct timespec t = {timeout / 1000, (timeout % 1000) * 1000000L};
	int r = ep_wait(epfd, ev, max, timeout >= 0 ? &t : NULL, mask, 1);
	return timeout == 0 ? mpp_idle(r) : r;
}

EXPORT int epoll_pwait2(int epfd, struct epoll_event *ev, int max, const struct timespec *tmo, const sigset_t *mask)
{
	sigset_t buf;
	if (!REAL_OPT(epoll_pwait2)) {
		errno = ENOSYS;
		return -1;
	}
	if (ts_zero(tmo)) {
		mask = mpp_with_wake_blocked(mask, &buf);
		if (likely(LIVE() == 0))
			return mpp_idle(REAL(epoll_pwait2)(epfd, ev, max, tmo, mask));
	}
	if (max <= 0 || (tmo && !ts_valid(tmo)))
		return REAL(epoll_pwait2)(epfd, ev, max, tmo, mask);
	int r = ep_wait(epfd, ev, max, tmo, mask, 0);
	return ts_zero(tmo) ? mpp_idle(r) : r;
}

// mpipause_test_wait_untracked counts epoll registrations beyond the
// shim's tables, for the C tests.
EXPORT unsigned long mpipause_test_wait_untracked(void)
{
	return atomic_load(&untracked);
}
