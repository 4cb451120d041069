// SPDX-License-Identifier: Apache-2.0
//
// The receive-side drain: what the shim's thread does to a socket the
// rank channel's DRAIN named (rankserve.c), moving what waits in its
// receive queue into its stash (stash.c). A pause can commit only when
// every receive queue between the job's ranks is empty, and a rank that
// computes for seconds, or waits somewhere other than in MPI, reads
// nothing: its queues, and then its peers' send queues, stay full; the
// freeze keeps the stash with the rest of the process.
//
// The drain never reads a socket an application thread is reading: it sets
// the slow flag of every descriptor of the socket and then checks their
// busy counts (stash.c says why that is enough), so it must first know
// every descriptor of the socket, which /proc/self/fd tells. It takes at
// most the cap (MPIPAUSE_STASH_MAX_MB) into the stashes together, so that a
// rank that does not read while its peers send cannot grow without bound.
#include "shim.h"
#include "stash.h"

#include <dirent.h>
#include <errno.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>

// The stashes together hold at most stash_max bytes (MPIPAUSE_STASH_MAX_MB,
// default 256 MiB): a rank that does not read while its peers send for the
// whole drain time would otherwise make the process grow without bound.
// Past it the drain takes nothing more (the bytes stay in the kernel, where
// the pause's check finds them) and says so (mpp_stash_full).
#define STASH_MAX_MB_DEFAULT 256
static size_t stash_max = (size_t)STASH_MAX_MB_DEFAULT << 20;
static _Atomic int stash_full;

size_t mpp_stash_max(void)
{
	return stash_max;
}

// mpipause_test_stash_set_max sets the cap, for the C tests.
EXPORT void mpipause_test_stash_set_max(size_t max)
{
	stash_max = max;
}

int mpp_stash_full(int clear)
{
	return clear ? atomic_exchange(&stash_full, 0) : atomic_load(&stash_full);
}

// mpp_drain_init reads MPIPAUSE_STASH_MAX_MB, from the constructor: decimal
// MiB, 0 allowed (the drain then takes nothing); anything else keeps the
// default.
void mpp_drain_init(void)
{
	const char *e = getenv("MPIPAUSE_STASH_MAX_MB");
	size_t v = 0;
	if (!e || !*e)
		return;
	for (const char *c = e; *c; c++) {
		if (*c < '0' || *c > '9' || v > (SIZE_MAX >> 20) / 10)
			return;
		v = v * 10 + (size_t)(*c - '0');
	}
	if (v <= SIZE_MAX >> 20)
		stash_max = v << 20;
}

// The process's socket descriptors by inode, as /proc/self/fd showed them when
// mpp_stash_fd_gen was scan_gen: one scan serves every socket a drain attaches
// until a wrapped call changes a number's socket (a rank with a thousand
// connections would otherwise read its thousand descriptors a thousand times).
// Used by the drain's thread alone; scan_mu for the C tests, which call the
// drain from theirs.
struct fd_ino {
	ino_t ino;
	int fd;
};
static struct fd_ino *scan;
static int nscan, capscan, scanned;
static unsigned scan_gen;
static pthread_mutex_t scan_mu = PTHREAD_MUTEX_INITIALIZER;

static int by_ino(const void *a, const void *b)
{
	const struct fd_ino *x = a, *y = b;
	return x->ino < y->ino ? -1 : x->ino > y->ino;
}

// rescan reads /proc/self/fd into scan; 0 if it could not.
static int rescan(unsigned gen)
{
	DIR *d = opendir("/proc/self/fd");
	if (!d)
		return 0;
	nscan = 0;
	struct dirent *e;
	while ((e = readdir(d))) {
		char *end;
		long fd = strtol(e->d_name, &end, 10);
		struct stat st;
		if (*end || e->d_name[0] == '.' || fd == dirfd(d) || !mpp_stash_tracked((int)fd))
			continue;
		if (fstat((int)fd, &st) < 0 || !S_ISSOCK(st.st_mode))
			continue;
		if (nscan == capscan) {
			int c = capscan ? capscan * 2 : 64;
			struct fd_ino *n = realloc(scan, (size_t)c * sizeof(*n));
			if (!n) {
				closedir(d);
				scanned = 0;
				return 0;
			}
			scan = n;
			capscan = c;
		}
		scan[nscan++] = (struct fd_ino){st.st_ino, (int)fd};
	}
	closedir(d);
	qsort(scan, (size_t)nscan, sizeof(*scan), by_ino);
	scan_gen = gen;
	scanned = 1;
	return 1;
}

// lookup is where scan's entries of socket ino begin (NULL: none).
static struct fd_ino *lookup(ino_t ino)
{
	struct fd_ino key = {ino, 0};
	struct fd_ino *at = bsearch(&key, scan, (size_t)nscan, sizeof(*scan), by_ino);
	while (at && at > scan && at[-1].ino == ino)
		at--;
	return at;
}

static int listed(const struct fd_ino *at, ino_t ino, int fd)
{
	for (; at && at < scan + nscan && at->ino == ino; at++)
		if (at->fd == fd)
			return 1;
	return 0;
}

// attach_found attaches, with SLOW_DRAIN, every descriptor of the socket ino
// the process had at mpp_stash_fd_gen gen (mpp_nfds at most: the table's size),
// fd (the drain's) among them: a scan that does not list it is older than the
// socket (sockets made since do not move mpp_stash_fd_gen) and is made again. 0
// if one could not be attached.
static int attach_found(struct stash *s, ino_t ino, int fd, unsigned gen)
{
	pthread_mutex_lock(&scan_mu);
	int ok = (scanned && scan_gen == gen) || rescan(gen);
	struct fd_ino *at = ok ? lookup(ino) : NULL;
	if (ok && !listed(at, ino, fd) && (ok = rescan(gen)))
		at = lookup(ino);
	for (; ok && at && at < scan + nscan && at->ino == ino; at++)
		ok = mpp_stash_attach(s, at->fd, SLOW_DRAIN);
	if (ok)
		ok = mpp_stash_attach(s, fd, SLOW_DRAIN); // listed or not: it is the one read
	pthread_mutex_unlock(&scan_mu);
	return ok;
}

ssize_t mpp_stash_fd(int fd, ino_t ino)
{
	struct stat st;
	if (!mpp_stash_tracked(fd))
		return 0;
	if (ino == 0) {
		if (fstat(fd, &st) < 0 || !S_ISSOCK(st.st_mode))
			return 0;
		ino = st.st_ino;
	}
	pthread_mutex_lock(&mpp_stash_tab_mu);
	struct stash *s = mpp_stash_find(ino);
	int fresh = s == NULL;
	if (fresh)
		s = mpp_stash_claim(ino);
	pthread_mutex_unlock(&mpp_stash_tab_mu);
	if (!s)
		return 0; // the bytes stay in the kernel; the pause will say so
	if (fresh)
		pthread_mutex_lock(&s->mu);
	else if (pthread_mutex_trylock(&s->mu) != 0)
		return -1; // an application thread reads the socket under the mutex
	if (s->ino != ino) {
		pthread_mutex_unlock(&s->mu); // emptied and freed meanwhile: next time
		return -1;
	}
	int was = mpp_stash_holding(s);
	if (!was) {
		// Every descriptor of the socket to the slow path, then none may
		// be in a read, and none may have been made or closed since the
		// count was read: else the drain tries again in a moment.
		unsigned gen = atomic_load_explicit(&mpp_stash_fd_gen, memory_order_seq_cst);
		int ok = attach_found(s, ino, fd, gen);
		for (int i = 0; ok && i < s->nfd; i++)
			ok = atomic_load_explicit(&mpp_read_busy[s->fds[i]], memory_order_seq_cst) == 0;
		if (!ok || atomic_load_explicit(&mpp_stash_fd_gen, memory_order_seq_cst) != gen) {
			mpp_stash_detach_all(s);
			pthread_mutex_unlock(&s->mu);
			return -1;
		}
	}
	// From here until the unlock no wrapped close of a descriptor of the
	// socket can finish (see mpp_stash_closing), so fd names one file
	// throughout: the socket the drain found, or, if the application closed
	// that since and the number came back, another file whose bytes are not
	// the drain's to take (a pipe's would even come back as ENOTSOCK).
	if (!mpp_stash_names(fd, ino)) {
		if (!was)
			mpp_stash_detach_all(s);
		pthread_mutex_unlock(&s->mu);
		return 0;
	}
	ssize_t moved = 0;
	int saved = errno;
	for (;;) {
		int n = 0;
		if (s->err || ioctl(fd, FIONREAD, &n) < 0 || n <= 0)
			break;
		// Only this thread adds to mpp_stash_held, so the room cannot
		// shrink under it (readers only take away).
		size_t used = atomic_load_explicit(&mpp_stash_held, memory_order_relaxed);
		size_t room = used < stash_max ? stash_max - used : 0;
		if (room == 0) {
			atomic_store(&stash_full, 1); // the bytes stay in the kernel
			break;
		}
		if ((size_t)n > room)
			n = (int)room;
		if (s->cap - s->len < (size_t)n) {
			// Slide what was read already to the front before growing.
			if (s->off > 0) {
				memmove(s->buf, s->buf + s->off, s->len - s->off);
				s->len -= s->off;
				s->off = 0;
			}
			if (mpp_stash_grow(s, s->len + (size_t)n) < 0)
				break; // the bytes stay in the kernel; the pause will say so
		}
		size_t take = s->cap - s->len < room ? s->cap - s->len : room;
		ssize_t r = REAL(recv)(fd, s->buf + s->len, take, MSG_DONTWAIT);
		if (r > 0) {
			atomic_fetch_add_explicit(&mpp_stash_held, (size_t)r, memory_order_relaxed);
			s->len += (size_t)r;
			moved += r;
			continue;
		}
		if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
			s->err = errno; // consumed here: the application must still see it
		break;
	}
	errno = saved;
	int woke = mpp_stash_holding(s) && !was;
	if (woke) {
		mpp_stash_set_slow(s, SLOW_HELD);
		atomic_fetch_add_explicit(&mpp_stash_live, 1, memory_order_release);
	} else if (!was) {
		mpp_stash_detach_all(s);
	}
	pthread_mutex_unlock(&s->mu);
	// As a wrapped read under a closed gate does: the ACK of what was just
	// moved goes now, not at the delayed-ACK timer (up to 8 ms under the
	// sockops cap), since the drain waits for the peer's send queue too.
	if (moved > 0)
		mpp_quickack(fd);
	if (woke)
		mpp_wait_wake();
	return moved;
}

// mpp_drain_child: a forked child never drained (stash.c, mpp_stash_child),
// and another thread may have been inside scan_mu at the fork, the scan half
// grown: forgotten, not freed.
void mpp_drain_child(void)
{
	pthread_mutex_init(&scan_mu, NULL);
	scan = NULL;
	nscan = capscan = scanned = 0;
}
