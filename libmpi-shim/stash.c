// SPDX-License-Identifier: Apache-2.0
//
// The receive-side drain. A pause can commit only when every receive queue
// between the job's ranks is empty, and a rank that computes for seconds, or
// waits somewhere other than in MPI, reads nothing: its queues, and then its
// peers' send queues, stay full. So while a pause is in progress the
// control thread reads what waits in the rank's TCP receive queues into a
// stash per fd, in process memory, which the freeze keeps with the rest of
// the process (DMTCP drains sockets the same way before a checkpoint). The
// wrapped reads give those bytes back before anything the kernel holds, in
// order, and the wrapped waits (waits.h) report the fd readable while its
// stash is not empty.
//
// Order is the whole difficulty: the control thread and an application
// thread must never both read one socket at once, or bytes could reach the
// application out of order. Each fd has a count of application threads
// inside a wrapped read of it ("busy") and a flag that sends reads to the
// slow path ("slow": SLOW_DRAIN while a drain is taking from the fd,
// SLOW_HELD while its stash holds bytes). A reader increments busy and then loads slow; the drain sets slow
// and then loads busy; both sequentially consistent, so at least one of
// them sees the other (Dekker). A reader that sees slow takes the fd's
// mutex, under which the drain reads, and gets the stash first. A drain
// that sees busy leaves the fd alone: the thread reading it gets the bytes.
// The fast path of a read is therefore one atomic increment, one load and
// one decrement around the real call.
#include "shim.h"
#include <errno.h>
#include <limits.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>

struct stash {
	pthread_mutex_t mu;
	char *buf;
	size_t off, len, cap; // buf[off, len) waits for the application
	int err;              // an error the drain's read got, given after the bytes
};

// Per-fd arrays, as large as gate.c's tables (mpp_nfds); calloc'd, so the
// pages of fds never used are never touched. An fd beyond them is never
// stashed.
_Atomic int *mpp_read_busy;
_Atomic unsigned char *mpp_read_slow;
static _Atomic(struct stash *) *tab;
static _Atomic unsigned *edge;
static pthread_mutex_t tab_mu = PTHREAD_MUTEX_INITIALIZER;
_Atomic int mpp_stash_live;
enum { SLOW_NONE, SLOW_DRAIN, SLOW_HELD };

// The stashes together hold at most stash_max bytes (MPIPAUSE_STASH_MAX_MB,
// default 256 MiB): a rank that does not read while its peers send for the
// whole drain time would otherwise make the process grow without bound.
// Past it the drain takes nothing more (the bytes stay in the kernel, where
// the pause's check finds them) and says so (mpp_stash_full).
#define STASH_MAX_MB_DEFAULT 256
static size_t stash_max = (size_t)STASH_MAX_MB_DEFAULT << 20;
static _Atomic size_t stash_bytes;
static _Atomic int stash_full;

size_t mpp_stash_max(void)
{
	return stash_max;
}

size_t mpp_stash_bytes(void)
{
	return atomic_load_explicit(&stash_bytes, memory_order_relaxed);
}

int mpp_stash_full(int clear)
{
	return clear ? atomic_exchange(&stash_full, 0) : atomic_load(&stash_full);
}

// stash_max_env reads MPIPAUSE_STASH_MAX_MB: decimal MiB, 0 allowed (the
// drain then takes nothing); anything else keeps the default.
static void stash_max_env(void)
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

void mpp_stash_init(void)
{
	stash_max_env();
	if (mpp_nfds <= 0)
		return;
	mpp_read_busy = calloc(mpp_nfds, sizeof(*mpp_read_busy));
	mpp_read_slow = calloc(mpp_nfds, sizeof(*mpp_read_slow));
	tab = calloc(mpp_nfds, sizeof(*tab));
	edge = calloc(mpp_nfds, sizeof(*edge));
	if (!mpp_read_busy || !mpp_read_slow || !tab || !edge) {
		free(mpp_read_busy);
		free((void *)mpp_read_slow);
		free(tab);
		free(edge);
		mpp_read_busy = NULL;
		mpp_read_slow = NULL;
		tab = NULL;
		edge = NULL;
	}
}

static int tracked(int fd)
{
	return tab != NULL && (unsigned)fd < (unsigned)mpp_nfds;
}

static struct stash *get(int fd, int create)
{
	struct stash *s = atomic_load_explicit(&tab[fd], memory_order_acquire);
	if (s || !create)
		return s;
	pthread_mutex_lock(&tab_mu);
	s = atomic_load_explicit(&tab[fd], memory_order_relaxed);
	if (!s && (s = calloc(1, sizeof(*s)))) {
		pthread_mutex_init(&s->mu, NULL);
		atomic_store_explicit(&tab[fd], s, memory_order_release);
	}
	pthread_mutex_unlock(&tab_mu);
	return s;
}

static int holding(const struct stash *s)
{
	return s->len > s->off || s->err != 0;
}

// mpp_stash_ready takes no lock: a wait must not block behind a thread
// that reads fd under its mutex.
int mpp_stash_ready(int fd)
{
	return tracked(fd) && atomic_load_explicit(&mpp_read_slow[fd], memory_order_acquire) == SLOW_HELD;
}

unsigned mpp_stash_edge(int fd)
{
	return tracked(fd) ? atomic_load_explicit(&edge[fd], memory_order_acquire) : 0;
}

// emptied ends fd's slow path once its stash, which held something, is
// empty again. Called with s->mu held: a drain that refills it sets slow
// again under the same mutex.
static void emptied(int fd, struct stash *s)
{
	free(s->buf);
	s->buf = NULL;
	s->off = s->len = s->cap = 0;
	atomic_fetch_sub_explicit(&mpp_stash_live, 1, memory_order_relaxed);
	atomic_store_explicit(&mpp_read_slow[fd], SLOW_NONE, memory_order_seq_cst);
}

ssize_t mpp_stash_fd(int fd, ino_t ino)
{
	if (!tracked(fd))
		return 0;
	struct stash *s = get(fd, 1);
	if (!s)
		return 0;
	if (pthread_mutex_trylock(&s->mu) != 0)
		return -1; // an application thread reads fd under the mutex
	int was = holding(s);
	if (!was) {
		atomic_store_explicit(&mpp_read_slow[fd], SLOW_DRAIN, memory_order_seq_cst);
		if (atomic_load_explicit(&mpp_read_busy[fd], memory_order_seq_cst) != 0) {
			atomic_store_explicit(&mpp_read_slow[fd], SLOW_NONE, memory_order_seq_cst);
			pthread_mutex_unlock(&s->mu);
			return -1;
		}
	}
	// From here until the unlock no wrapped close of fd can finish (see
	// mpp_stash_closing), so the number names one file throughout: the
	// socket the drain found, or, if the application closed that since and
	// the number came back, another file whose bytes are not the drain's
	// to take (a pipe's would even come back as ENOTSOCK from recv).
	struct stat st;
	if (ino != 0 && (fstat(fd, &st) < 0 || st.st_ino != ino)) {
		if (!was)
			atomic_store_explicit(&mpp_read_slow[fd], SLOW_NONE, memory_order_seq_cst);
		pthread_mutex_unlock(&s->mu);
		return 0;
	}
	ssize_t moved = 0;
	int saved = errno;
	for (;;) {
		int n = 0;
		if (s->err || ioctl(fd, FIONREAD, &n) < 0 || n <= 0)
			break;
		// Only this thread adds to stash_bytes, so the room cannot shrink
		// under it (readers only take away).
		size_t used = atomic_load_explicit(&stash_bytes, memory_order_relaxed);
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
			size_t want = s->len + (size_t)n, cap = s->cap ? s->cap : 64 << 10;
			while (cap < want)
				cap *= 2;
			char *b = realloc(s->buf, cap);
			if (!b)
				break; // the bytes stay in the kernel; the pause will say so
			s->buf = b;
			s->cap = cap;
		}
		size_t take = s->cap - s->len < room ? s->cap - s->len : room;
		ssize_t r = mpp_real.recv(fd, s->buf + s->len, take, MSG_DONTWAIT);
		if (r > 0) {
			atomic_fetch_add_explicit(&stash_bytes, (size_t)r, memory_order_relaxed);
			s->len += (size_t)r;
			moved += r;
			continue;
		}
		if (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR)
			s->err = errno; // consumed here: the application must still see it
		break;
	}
	errno = saved;
	if (holding(s) && !was) {
		atomic_fetch_add_explicit(&edge[fd], 1, memory_order_release);
		atomic_store_explicit(&mpp_read_slow[fd], SLOW_HELD, memory_order_seq_cst);
		atomic_fetch_add_explicit(&mpp_stash_live, 1, memory_order_release);
	} else if (!was) {
		atomic_store_explicit(&mpp_read_slow[fd], SLOW_NONE, memory_order_seq_cst);
	}
	int woke = holding(s) && !was;
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

// mpp_stash_closing starts a close of fd (dup2 and dup3 over fd use
// mpp_stash_enter, below). It counts as a reader of fd until
// mpp_stash_closed, so no drain starts on fd meanwhile, and it forgets the
// stash, waiting for a drain already under way. Without the count a drain
// could begin between the forget and the real close, stash the closing
// socket's last bytes, and hand them to the number's next socket as the
// first bytes of its stream. Returns whether mpp_stash_closed must undo it.
int mpp_stash_closing(int fd)
{
	if (!mpp_stash_enter(fd))
		return 0;
	if (atomic_load_explicit(&mpp_read_slow[fd], memory_order_seq_cst) != SLOW_NONE)
		mpp_stash_forget(fd);
	return 1;
}

// mpp_stash_enter is the count alone, for dup2 and dup3, which may fail
// and leave fd as it was: they forget the stash only once they succeeded.
int mpp_stash_enter(int fd)
{
	if (!tracked(fd))
		return 0;
	atomic_fetch_add_explicit(&mpp_read_busy[fd], 1, memory_order_seq_cst);
	return 1;
}

void mpp_stash_closed(int fd, int counted)
{
	if (counted)
		atomic_fetch_sub_explicit(&mpp_read_busy[fd], 1, memory_order_release);
}

void mpp_stash_forget(int fd)
{
	if (!tracked(fd))
		return;
	struct stash *s = get(fd, 0);
	if (!s)
		return;
	pthread_mutex_lock(&s->mu);
	if (holding(s)) {
		s->err = 0;
		atomic_fetch_sub_explicit(&stash_bytes, s->len - s->off, memory_order_relaxed);
		s->off = s->len;
		emptied(fd, s);
	}
	pthread_mutex_unlock(&s->mu);
}

// copy_out moves up to the iovec's room from the stash into it (or copies,
// for MSG_PEEK).
static size_t copy_out(struct stash *s, const struct iovec *iov, int iovcnt, int peek)
{
	size_t done = 0, avail = s->len - s->off;
	for (int i = 0; i < iovcnt && done < avail; i++) {
		size_t n = iov[i].iov_len < avail - done ? iov[i].iov_len : avail - done;
		memcpy(iov[i].iov_base, s->buf + s->off + done, n);
		done += n;
	}
	if (!peek) {
		s->off += done;
		atomic_fetch_sub_explicit(&stash_bytes, done, memory_order_relaxed);
	}
	return done;
}

// mpp_stash_read is a read of fd that found its slow flag set. It serves
// the stash, then, for a read that wants more (MSG_WAITALL) or found the
// stash empty, the kernel, all under the fd's mutex so that no drain reads
// in between. real makes the application's call on the part of the iovec
// not yet filled (rest, restcnt).
ssize_t mpp_stash_read(int fd, const struct iovec *iov, int iovcnt, int flags,
		       ssize_t (*real)(void *arg, const struct iovec *rest, int restcnt), void *arg)
{
	struct stash *s = get(fd, 0);
	if (!s)
		return real(arg, iov, iovcnt);
	pthread_mutex_lock(&s->mu);
	int was = holding(s);
	size_t want = 0;
	for (int i = 0; i < iovcnt; i++)
		want += iov[i].iov_len;
	ssize_t r;
	if (s->len > s->off) {
		size_t got = copy_out(s, iov, iovcnt, flags & MSG_PEEK);
		r = (ssize_t)got;
		if (got < want && (flags & MSG_WAITALL) && !(flags & MSG_PEEK)) {
			// The rest from the kernel, as one call would have; the caller
			// keeps what it got if that fails (as after a signal).
			struct iovec rest[IOV_MAX];
			int n = 0;
			size_t skip = got;
			for (int i = 0; i < iovcnt && n < IOV_MAX; i++) {
				if (skip >= iov[i].iov_len) {
					skip -= iov[i].iov_len;
					continue;
				}
				rest[n].iov_base = (char *)iov[i].iov_base + skip;
				rest[n].iov_len = iov[i].iov_len - skip;
				skip = 0;
				n++;
			}
			int saved = errno;
			ssize_t more = real(arg, rest, n);
			if (more > 0)
				r += more;
			errno = saved;
		}
	} else if (s->err && !(flags & MSG_PEEK)) {
		errno = s->err;
		s->err = 0;
		r = -1;
	} else {
		r = real(arg, iov, iovcnt);
	}
	if (was && !holding(s))
		emptied(fd, s);
	pthread_mutex_unlock(&s->mu);
	return r;
}


// mpipause_test_stash_bytes is what the stashes hold now, and
// mpipause_test_stash_max their cap, for the C tests.
EXPORT size_t mpipause_test_stash_bytes(void)
{
	return mpp_stash_bytes();
}

EXPORT size_t mpipause_test_stash_max(void)
{
	return mpp_stash_max();
}
