// SPDX-License-Identifier: Apache-2.0
//
// The stashes of the receive-side drain. A pause can commit only when every
// receive queue between the job's ranks is empty, and a rank that computes for
// seconds, or waits somewhere other than in MPI, reads nothing: its queues, and
// then its peers' send queues, stay full. So while a pause is in progress the
// shim's thread reads what waits in the rank's TCP receive queues into a stash
// per socket, in process memory, which the freeze keeps with the rest of the
// process (DMTCP drains sockets the same way before a checkpoint). The wrapped
// reads give those bytes back before anything the kernel holds, in order, and
// the wrapped waits (waits.h) report the fd readable while its stash is not
// empty.
//
// A stash belongs to the socket (its inode), not to a descriptor: every
// descriptor of the socket the process has is attached to the one stash
// (tab[fd]), so a read by any of them gets the stashed bytes first. The drain
// attaches the descriptors it finds in /proc/self/fd; one made later by a
// wrapped call (dup, dup2, dup3, fcntl's F_DUPFD, SCM_RIGHTS) is attached by
// mpp_stash_adopt; closing one detaches it, and the bytes stay for the others.
// mpp_stash_fd_gen counts the wrapped calls that change which socket a number
// names, so a drain that raced one starts again.
//
// Filling the stashes is drain.c's. This file keeps them: which descriptor
// reads which stash, and the reads that give a stash back.
//
// Order is the whole difficulty: the shim's thread and an application
// thread must never both read one socket at once, or bytes could reach the
// application out of order. Each fd has a count of application threads
// inside a wrapped read of it ("busy") and a flag that sends reads to the
// slow path ("slow": SLOW_DRAIN while a drain is taking from the socket,
// SLOW_HELD while its stash holds bytes). A reader increments busy and then
// loads slow; the drain sets slow on every descriptor of the socket and then
// loads their busy counts; both sequentially consistent, so at least one of
// them sees the other (Dekker). A reader that sees slow takes the stash's
// mutex, under which the drain reads, and gets the stash first. A drain
// that sees busy leaves the socket alone: the thread reading it gets the
// bytes. The fast path of a read is therefore one atomic increment, one load
// and one decrement around the real call.
#include "shim.h"
#include "stash.h"
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <pthread.h>
#include <sched.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <unistd.h>

// Per-fd arrays, as large as gate.c's tables (mpp_nfds); calloc'd, so the
// pages of fds never used are never touched. An fd beyond them is never
// stashed.
_Atomic int *mpp_read_busy;
_Atomic unsigned char *mpp_read_slow;
static _Atomic(struct stash *) *tab;
static _Atomic unsigned *edge;
// Every stash made, free ones included: never freed (a reader may hold a
// pointer to one while it is detached), one at most per socket in use, so
// at most mpp_nfds.
static struct stash **pool;
static int npool;
pthread_mutex_t mpp_stash_tab_mu = PTHREAD_MUTEX_INITIALIZER;
_Atomic unsigned mpp_stash_fd_gen;
// Above every descriptor ever attached: a forked child clears tab below it.
static _Atomic int tab_top;
static _Atomic int in_use; // stashes whose ino is set
_Atomic int mpp_stash_live;

// What the stashes hold together; drain.c's cap bounds it.
_Atomic size_t mpp_stash_held;

size_t mpp_stash_bytes(void)
{
	return atomic_load_explicit(&mpp_stash_held, memory_order_relaxed);
}

void mpp_stash_init(void)
{
	mpp_drain_init();
	if (mpp_nfds <= 0)
		return;
	mpp_read_busy = calloc(mpp_nfds, sizeof(*mpp_read_busy));
	mpp_read_slow = calloc(mpp_nfds, sizeof(*mpp_read_slow));
	tab = calloc(mpp_nfds, sizeof(*tab));
	edge = calloc(mpp_nfds, sizeof(*edge));
	pool = calloc(mpp_nfds, sizeof(*pool));
	if (!mpp_read_busy || !mpp_read_slow || !tab || !edge || !pool) {
		free(mpp_read_busy);
		free((void *)mpp_read_slow);
		free(tab);
		free(edge);
		free(pool);
		mpp_read_busy = NULL;
		mpp_read_slow = NULL;
		tab = NULL;
		edge = NULL;
		pool = NULL;
	}
}

int mpp_stash_tracked(int fd)
{
	return tab != NULL && (unsigned)fd < (unsigned)mpp_nfds;
}

int mpp_stash_holding(const struct stash *s)
{
	return s->len > s->off || s->err != 0;
}

// mpp_stash_find is the stash of the socket with inode ino, or NULL; under
// mpp_stash_tab_mu.
struct stash *mpp_stash_find(ino_t ino)
{
	for (int i = 0; i < npool; i++)
		if (pool[i]->ino == ino)
			return pool[i];
	return NULL;
}

// mpp_stash_claim takes a free stash (or makes one) for the socket ino; under
// mpp_stash_tab_mu. The caller locks it before anything else can: a free stash
// is locked only for a moment, by a reader finding it detached.
struct stash *mpp_stash_claim(ino_t ino)
{
	struct stash *s = NULL;
	for (int i = 0; i < npool && !s; i++)
		if (pool[i]->ino == 0)
			s = pool[i];
	if (!s && npool < mpp_nfds && (s = calloc(1, sizeof(*s)))) {
		pthread_mutex_init(&s->mu, NULL);
		pool[npool++] = s;
	}
	if (s) {
		s->ino = ino;
		atomic_fetch_add_explicit(&in_use, 1, memory_order_seq_cst);
	}
	return s;
}

// release frees s once no descriptor is attached and it holds nothing;
// with s->mu held.
static void release(struct stash *s)
{
	pthread_mutex_lock(&mpp_stash_tab_mu);
	s->ino = 0;
	atomic_fetch_sub_explicit(&in_use, 1, memory_order_seq_cst);
	pthread_mutex_unlock(&mpp_stash_tab_mu);
}

static int attached(const struct stash *s, int fd)
{
	for (int i = 0; i < s->nfd; i++)
		if (s->fds[i] == fd)
			return 1;
	return 0;
}

// mpp_stash_attach makes fd one of s's descriptors, with slow as its flag; with
// s->mu held. 0 if there was no memory for it.
int mpp_stash_attach(struct stash *s, int fd, int slow)
{
	if (attached(s, fd))
		return 1;
	if (s->nfd == s->capfd) {
		int c = s->capfd ? s->capfd * 2 : 4;
		int *f = realloc(s->fds, (size_t)c * sizeof(*f));
		if (!f)
			return 0;
		s->fds = f;
		s->capfd = c;
	}
	s->fds[s->nfd++] = fd;
	for (int top = atomic_load_explicit(&tab_top, memory_order_relaxed);
	     fd >= top && !atomic_compare_exchange_weak(&tab_top, &top, fd + 1);)
		;
	atomic_store_explicit(&tab[fd], s, memory_order_seq_cst);
	if (slow == SLOW_HELD)
		atomic_fetch_add_explicit(&edge[fd], 1, memory_order_release);
	atomic_store_explicit(&mpp_read_slow[fd], (unsigned char)slow, memory_order_seq_cst);
	return 1;
}

void mpp_stash_set_slow(struct stash *s, int slow)
{
	for (int i = 0; i < s->nfd; i++) {
		if (slow == SLOW_HELD)
			atomic_fetch_add_explicit(&edge[s->fds[i]], 1, memory_order_release);
		atomic_store_explicit(&mpp_read_slow[s->fds[i]], (unsigned char)slow, memory_order_seq_cst);
	}
}

// mpp_stash_detach_all ends the slow path of every descriptor of s and frees
// it; with s->mu held, and s holding nothing.
void mpp_stash_detach_all(struct stash *s)
{
	for (int i = 0; i < s->nfd; i++) {
		// A number closed by a call the shim does not see may have been
		// attached since to another socket's stash: that one is not
		// undone here.
		if (atomic_load_explicit(&tab[s->fds[i]], memory_order_seq_cst) != s)
			continue;
		atomic_store_explicit(&mpp_read_slow[s->fds[i]], SLOW_NONE, memory_order_seq_cst);
		atomic_store_explicit(&tab[s->fds[i]], NULL, memory_order_relaxed);
	}
	s->nfd = 0;
	release(s);
}

// emptied ends the slow path once the stash, which held something, is
// empty again (or dropped). Called with s->mu held: a drain that refills it
// attaches the descriptors again under the same mutex.
static void emptied(struct stash *s)
{
	atomic_fetch_sub_explicit(&mpp_stash_held, s->len - s->off, memory_order_relaxed);
	mpp_stash_buf_free(s);
	s->off = s->len = 0;
	s->err = 0;
	atomic_fetch_sub_explicit(&mpp_stash_live, 1, memory_order_relaxed);
	mpp_stash_detach_all(s);
}

void mpp_stash_buf_free(struct stash *s)
{
	mpp_big_free(s->buf, s->cap);
	s->buf = NULL;
	s->cap = 0;
}

// Every capacity is 64 KiB doubled: a buffer outgrows malloc's memory
// once, into a mapping (bigbuf.c), and is copied there.
int mpp_stash_grow(struct stash *s, size_t want)
{
	size_t cap = s->cap ? s->cap : 64 << 10;
	char *b;
	while (cap < want)
		cap *= 2;
	if (cap == s->cap)
		return 0;
	if (cap < MPP_BIG) {
		b = realloc(s->buf, cap);
		if (!b)
			return -1;
	} else {
		b = mpp_big_alloc(cap);
		if (!b)
			return -1;
		if (s->len)
			memcpy(b, s->buf, s->len);
		mpp_stash_buf_free(s);
	}
	s->buf = b;
	s->cap = cap;
	return 0;
}

// mpp_stash_ready takes no lock: a wait must not block behind a thread
// that reads fd under its mutex.
int mpp_stash_ready(int fd)
{
	return mpp_stash_tracked(fd) && atomic_load_explicit(&mpp_read_slow[fd], memory_order_acquire) == SLOW_HELD;
}

unsigned mpp_stash_edge(int fd)
{
	return mpp_stash_tracked(fd) ? atomic_load_explicit(&edge[fd], memory_order_acquire) : 0;
}

int mpp_stash_names(int fd, ino_t ino)
{
	struct stat st;
	return fstat(fd, &st) == 0 && S_ISSOCK(st.st_mode) && st.st_ino == ino;
}

// detach takes fd out of its socket's stash, as a close of it does: the
// bytes stay for the socket's other descriptors, and go with the last.
static void detach(int fd)
{
	struct stash *s = atomic_load_explicit(&tab[fd], memory_order_acquire);
	if (!s)
		return;
	pthread_mutex_lock(&s->mu);
	for (int i = 0; i < s->nfd; i++)
		if (s->fds[i] == fd) {
			s->fds[i] = s->fds[--s->nfd];
			if (atomic_load_explicit(&tab[fd], memory_order_seq_cst) == s) {
				atomic_store_explicit(&mpp_read_slow[fd], SLOW_NONE, memory_order_seq_cst);
				atomic_store_explicit(&tab[fd], NULL, memory_order_relaxed);
			}
			break;
		}
	if (s->nfd == 0 && s->ino != 0) {
		if (mpp_stash_holding(s))
			emptied(s);
		else
			release(s);
	}
	pthread_mutex_unlock(&s->mu);
}

// mpp_stash_closing starts a close of fd (dup2 and dup3 over fd use
// mpp_stash_enter, below). It counts as a reader of fd until
// mpp_stash_closed, so no drain starts on its socket meanwhile, and it
// detaches fd from the stash, waiting for a drain already under way.
// Without the count a drain could begin between the detach and the real
// close, stash the closing socket's last bytes, and hand them to the
// number's next socket as the first bytes of its stream. Returns whether
// mpp_stash_closed must undo it.
int mpp_stash_closing(int fd)
{
	if (!mpp_stash_enter(fd))
		return 0;
	if (atomic_load_explicit(&mpp_read_slow[fd], memory_order_seq_cst) != SLOW_NONE)
		detach(fd);
	return 1;
}

// mpp_stash_enter is the count alone, for dup2 and dup3, which may fail
// and leave fd as it was: they detach it once they succeeded.
int mpp_stash_enter(int fd)
{
	if (!mpp_stash_tracked(fd))
		return 0;
	atomic_fetch_add_explicit(&mpp_read_busy[fd], 1, memory_order_seq_cst);
	return 1;
}

// mpp_stash_closed ends a close: the number may name another file now,
// which a drain under way must learn (mpp_stash_fd_gen) before its count goes.
void mpp_stash_closed(int fd, int counted)
{
	if (!counted)
		return;
	atomic_fetch_add_explicit(&mpp_stash_fd_gen, 1, memory_order_seq_cst);
	atomic_fetch_sub_explicit(&mpp_read_busy[fd], 1, memory_order_release);
}

void mpp_stash_forget(int fd)
{
	if (mpp_stash_tracked(fd))
		detach(fd);
}

// mpp_stash_adopt follows a wrapped call that made fd a new descriptor of a
// socket (dup, dup2, dup3, F_DUPFD, SCM_RIGHTS): if the socket's stash holds
// bytes, fd reads them first too. A drain under way either sees
// mpp_stash_fd_gen move and starts again, or is seen here (in_use) and waited
// for.
void mpp_stash_adopt(int fd)
{
	if (!mpp_stash_tracked(fd))
		return;
	atomic_fetch_add_explicit(&mpp_stash_fd_gen, 1, memory_order_seq_cst);
	if (atomic_load_explicit(&in_use, memory_order_seq_cst) == 0)
		return;
	struct stat st;
	if (fstat(fd, &st) < 0 || !S_ISSOCK(st.st_mode))
		return;
	pthread_mutex_lock(&mpp_stash_tab_mu);
	struct stash *s = mpp_stash_find(st.st_ino);
	pthread_mutex_unlock(&mpp_stash_tab_mu);
	if (!s)
		return;
	pthread_mutex_lock(&s->mu);
	if (s->ino == st.st_ino && mpp_stash_holding(s) && !mpp_stash_attach(s, fd, SLOW_HELD)) {
		static const char m[] = "mpipause: no memory to follow a new descriptor of a drained socket: its reads may overtake\n";
		ssize_t w = REAL(write)(2, m, sizeof(m) - 1);
		(void)w;
	}
	pthread_mutex_unlock(&s->mu);
}

// mpp_stash_adopt_rights adopts every descriptor a message carried
// (SCM_RIGHTS): one of them may be a socket whose stash holds bytes.
void mpp_stash_adopt_rights(const struct msghdr *msg)
{
	for (struct cmsghdr *c = CMSG_FIRSTHDR(msg); c; c = CMSG_NXTHDR((struct msghdr *)msg, c)) {
		if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
			continue;
		size_t n = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
		for (size_t i = 0; i < n; i++) {
			int fd;
			memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof(fd));
			mpp_stash_adopt(fd);
		}
	}
}

// mpp_stash_fork_prepare holds mpp_stash_tab_mu across a fork, so that the
// child's pool (npool and its entries) is not half-made by a thread that does
// not go on in it; mpp_stash_tab_mu is a leaf lock, taken last.
void mpp_stash_fork_prepare(void)
{
	pthread_mutex_lock(&mpp_stash_tab_mu);
}

void mpp_stash_fork_parent(void)
{
	pthread_mutex_unlock(&mpp_stash_tab_mu);
}

// mpp_stash_child: a forked child is not the process that drained the
// stashes, and the parent keeps their bytes: the child's descriptors read
// the kernel's queue. Only the forking thread runs in the child, and any
// other may have been inside a stash's mutex at the fork (a buffer freed
// and not yet forgotten, fds moved by realloc, the scan grown): the child
// reads nothing those mutexes guard. It finds the descriptors through tab,
// whose entries are single words, and forgets every buffer and array
// instead of freeing it (the parent's copies, which the child never
// touches, so they cost it no memory).
void mpp_stash_child(void)
{
	pthread_mutex_unlock(&mpp_stash_tab_mu); // taken by mpp_stash_fork_prepare
	if (pool == NULL)
		return;
	int top = atomic_load(&tab_top);
	for (int fd = 0; fd < top; fd++) {
		atomic_store(&mpp_read_slow[fd], SLOW_NONE);
		atomic_store(&mpp_read_busy[fd], 0);
		atomic_store(&tab[fd], NULL);
	}
	for (int i = 0; i < npool; i++) {
		struct stash *s = pool[i];
		pthread_mutex_init(&s->mu, NULL);
		s->buf = NULL;
		s->off = s->len = s->cap = 0;
		s->err = 0;
		s->fds = NULL;
		s->nfd = s->capfd = 0;
		s->ino = 0;
	}
	mpp_drain_child();
	atomic_store(&in_use, 0);
	atomic_store(&mpp_stash_live, 0);
	atomic_store(&mpp_stash_held, 0);
}

// mpp_stash_exec_lost is what an exec now would lose: the bytes of stashes
// with a descriptor that stays open across it.
size_t mpp_stash_exec_lost(void)
{
	size_t lost = 0;
	if (pool == NULL || atomic_load(&mpp_stash_live) == 0)
		return 0;
	// pool[0, n) never changes once made; a stash's mutex is never taken
	// under mpp_stash_tab_mu (release takes them in the other order).
	pthread_mutex_lock(&mpp_stash_tab_mu);
	int n = npool;
	pthread_mutex_unlock(&mpp_stash_tab_mu);
	for (int i = 0; i < n; i++) {
		struct stash *s = pool[i];
		pthread_mutex_lock(&s->mu);
		for (int j = 0; j < s->nfd; j++)
			if (s->ino != 0 && !(REAL(fcntl)(s->fds[j], F_GETFD) & FD_CLOEXEC)) {
				lost += s->len - s->off;
				break;
			}
		pthread_mutex_unlock(&s->mu);
	}
	return lost;
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
		atomic_fetch_sub_explicit(&mpp_stash_held, done, memory_order_relaxed);
	}
	return done;
}

// serve is a read of s's socket with s->mu held: the stash first.
static ssize_t serve(struct stash *s, const struct iovec *iov, int iovcnt, int flags,
		     ssize_t (*real)(void *arg, const struct iovec *rest, int restcnt), void *arg)
{
	int was = mpp_stash_holding(s);
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
	if (was && !mpp_stash_holding(s))
		emptied(s);
	return r;
}

// mpp_stash_read is a read of fd that found its slow flag set. It serves
// the stash, then, for a read that wants more (MSG_WAITALL) or found the
// stash empty, the kernel, all under the stash's mutex so that no drain
// reads in between. real makes the application's call on the part of the
// iovec not yet filled (rest, restcnt). If fd is no longer attached (its
// stash was emptied through another descriptor meanwhile), the read starts
// over as a fast-path read would.
ssize_t mpp_stash_read(int fd, const struct iovec *iov, int iovcnt, int flags,
		       ssize_t (*real)(void *arg, const struct iovec *rest, int restcnt), void *arg)
{
	for (;;) {
		struct stash *s = mpp_stash_tracked(fd) ? atomic_load_explicit(&tab[fd], memory_order_acquire) : NULL;
		if (s) {
			pthread_mutex_lock(&s->mu);
			if (s->ino != 0 && attached(s, fd)) {
				if (!mpp_stash_names(fd, s->ino)) {
					// Closed by a call the shim does not see, and the
					// number reused: these bytes are not this file's.
					pthread_mutex_unlock(&s->mu);
					detach(fd);
					continue;
				}
				ssize_t r = serve(s, iov, iovcnt, flags, real, arg);
				pthread_mutex_unlock(&s->mu);
				return r;
			}
			pthread_mutex_unlock(&s->mu);
		}
		if (!mpp_stash_tracked(fd))
			return real(arg, iov, iovcnt);
		atomic_fetch_add_explicit(&mpp_read_busy[fd], 1, memory_order_seq_cst);
		if (atomic_load_explicit(&mpp_read_slow[fd], memory_order_seq_cst) == SLOW_NONE) {
			ssize_t r = real(arg, iov, iovcnt);
			atomic_fetch_sub_explicit(&mpp_read_busy[fd], 1, memory_order_release);
			return r;
		}
		atomic_fetch_sub_explicit(&mpp_read_busy[fd], 1, memory_order_release);
		sched_yield(); // a drain is attaching the socket's descriptors
	}
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

// mpipause_test_stash_buf is the buffer of fd's stash and its capacity
// (NULL, 0 if fd has none), for the C tests: the caller reads fd from no
// other thread meanwhile.
EXPORT void *mpipause_test_stash_buf(int fd, size_t *cap)
{
	struct stash *s = fd >= 0 && fd < mpp_nfds && tab ? atomic_load(&tab[fd]) : NULL;
	void *b = NULL;
	*cap = 0;
	if (s) {
		pthread_mutex_lock(&s->mu);
		b = s->buf;
		*cap = s->cap;
		pthread_mutex_unlock(&s->mu);
	}
	return b;
}
