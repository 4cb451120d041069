// SPDX-License-Identifier: Apache-2.0
//
// The gate word, and every copy of the gate that is read outside the
// shim's own sends: mpid's two pages, and a forked child's view of its
// parent's held bytes.
//
// The word has a page of its own so that registering can map a page shared
// with mpid over it (mpp_gate_page): mpid closes and reopens the gate by
// writing the word, without waiting for the shim's thread to be scheduled,
// while the send path still loads a fixed address. The state page
// (mpp_state_page) shows mpid every socket's gate, held bytes and "last
// call short" flag without a system call from the rank, so each change to
// a socket's state is mirrored there (mpp_publish) as it is made.
//
// A forked child is not a rank: mpid speaks to the parent, so the child
// gets a gate of its own, on a private page. The parent's held bytes are
// the parent's to send, and a child's write to one of those sockets must
// still come after them: the child reads, in a table the two share, which
// sockets its parent holds bytes for, and its gate stays flushing until
// the parent has sent them.
#include "shim.h"
#include "gate.h"

#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <fcntl.h>
#include <poll.h>
#include <pthread.h>
#include <unistd.h>

union mpp_gate_page mpp_gate_pg __attribute__((aligned(MPP_GATE_PAGE_SIZE))); // GATE_OPEN

// The shared table: which sockets hold bytes, and how many, in a mapping a
// forked child shares with its parent. A child's write to a socket whose
// bytes its parent holds must come after them: the child waits until the
// parent's entry for that socket is gone (mpp_gate_child, mpp_child_wait).
enum {
	SHARED_SLOTS = 4096
};
struct shared_entry {
	_Atomic uint64_t cookie; // 0: free
	_Atomic uint64_t held;
};
static struct shared_entry *shared;        // this process's entries
static struct shared_entry *parent_shared; // in a forked child: its parent's
static pid_t parent_pid;                   // in a forked child
_Atomic int mpp_awaiting;                  // in a forked child: sockets waiting for the parent

static struct shared_entry *new_shared(void)
{
	void *p = mmap(NULL, SHARED_SLOTS * sizeof(struct shared_entry), PROT_READ | PROT_WRITE,
		       MAP_SHARED | MAP_ANONYMOUS, -1, 0);
	return p == MAP_FAILED ? NULL : p;
}

// mpp_shared_init makes the table a forked child reads its parent's held
// bytes from.
void mpp_shared_init(void)
{
	shared = new_shared();
}

// The state page (mpp_state_page) shows mpid every socket's gate without a
// syscall from the rank: the header's gate word, and per fd the last call
// short flag (the fast path's own array, moved into the page), the gated
// flag and the bytes held. NULL until the rank registers.
static struct mpp_page *page;
static unsigned char *page_gated;
static uint64_t *page_held;
static uint64_t *page_from;

// share mirrors s's held bytes into the shared table, taking an entry
// when it starts to hold and giving it back when it stops. Called with
// s->mu held. With no free entry, a child forked meanwhile does not wait
// for this socket.
static void share(struct sock *s)
{
	if (!shared)
		return;
	if (s->held > 0 && s->slot < 0) {
		for (int i = 0; i < SHARED_SLOTS; i++) {
			uint64_t free = 0;
			if (atomic_compare_exchange_strong(&shared[i].cookie, &free, s->cookie)) {
				s->slot = i;
				break;
			}
		}
	}
	if (s->slot < 0)
		return;
	atomic_store(&shared[s->slot].held, s->held);
	if (s->held == 0) {
		atomic_store(&shared[s->slot].cookie, 0);
		s->slot = -1;
	}
}

// mpp_publish mirrors s into the page, at the descriptor its bytes go to, and
// into the shared table. Called with s->mu held.
void mpp_publish(struct sock *s)
{
	share(s);
	if (page && (unsigned)s->fd < (unsigned)mpp_nfds) {
		__atomic_store_n(&page_gated[s->fd], (unsigned char)s->gated, __ATOMIC_RELAXED);
		__atomic_store_n(&page_from[s->fd], s->held_from, __ATOMIC_RELAXED);
		__atomic_store_n(&page_held[s->fd], (uint64_t)s->held, __ATOMIC_RELEASE);
	}
}

// mpp_set_fd makes fd (-1: none) the descriptor s's bytes go to, and moves
// its place in the page: shown at the new place before it is gone from
// the old, so that mpid, reading the page while the rank runs, never
// finds held bytes at neither (internal/node/owners.go, heldSockets).
// Called with s->mu held.
void mpp_set_fd(struct sock *s, int fd)
{
	int old = s->fd;

	s->fd = fd;
	mpp_publish(s);
	if (page && (unsigned)old < (unsigned)mpp_nfds && old != fd) {
		__atomic_store_n(&page_gated[old], 0, __ATOMIC_RELAXED);
		__atomic_store_n(&page_held[old], 0, __ATOMIC_RELEASE);
	}
}

// mpp_page_clear shows fd in the state page as holding nothing: its
// socket's held bytes went to another descriptor.
void mpp_page_clear(int fd)
{
	if (page) {
		page_gated[fd] = 0;
		page_held[fd] = 0;
	}
}

void mpp_publish_gate(int g)
{
	if (page)
		__atomic_store_n(&page->gate, g, __ATOMIC_RELEASE);
}

// mpp_flush_begin counts a flush in the page's header before it sends
// anything, and returns the page it counted in, for mpp_flush_end (NULL:
// none). A flush sends from a thread mpid cannot see in the per-fd flags:
// a send call it started under the flushing word may still be handing
// bytes to the kernel after mpid has closed the gate again. The count is
// made before the flush's first load of the gate word, mpid's close
// before its load of the count (both sequentially consistent): either mpid
// sees the flush counted, or the flush sees the close and sends nothing.
struct mpp_page *mpp_flush_begin(void)
{
	struct mpp_page *p = page;
	if (p)
		atomic_fetch_add(&p->flushing, 1);
	return p;
}

// mpp_flush_end uncounts the flush mpp_flush_begin counted in p, once its
// last send call has returned.
void mpp_flush_end(struct mpp_page *p)
{
	if (p)
		atomic_fetch_sub(&p->flushing, 1);
}

// mpp_gate_close closes the gate in a new generation (when mpid asks by
// request; with the gate page, mpid writes the word itself).
void mpp_gate_close(void)
{
	int w = atomic_load_explicit(&mpp_gate, memory_order_acquire);
	int c = GATE_WORD(GATE_CLOSED, GATE_GEN(w) + 1);
	atomic_store_explicit(&mpp_gate, c, memory_order_release);
	mpp_publish_gate(c);
}

// parent_done reports whether the parent no longer holds bytes for s's
// socket (or is gone: then they are lost, as when a process dies).
static int parent_done(struct sock *s)
{
	return atomic_load(&parent_shared[s->await].cookie) != s->cookie || getppid() != parent_pid;
}

// mpp_child_wait, in a forked child whose parent held bytes for some sockets
// at the fork, waits, before a write to such a socket, until the parent has
// sent them, like a sender on a full socket; and opens the child's gate
// once no socket waits.
void mpp_child_wait(struct sock *s)
{
	// The other sockets the parent is done with stop waiting too, so the
	// gate opens without a write to each.
	for (int i = 0; i < mpp_tab_hi; i++) {
		struct sock *t = atomic_load_explicit(&mpp_fd_tab[i], memory_order_acquire);
		if (t && t != s) {
			pthread_mutex_lock(&t->mu);
			if (t->await >= 0 && parent_done(t)) {
				t->await = -1;
				if (atomic_fetch_sub(&mpp_awaiting, 1) == 1) {
					int w = GATE_WORD(GATE_FLUSHING, 0);
					atomic_compare_exchange_strong(&mpp_gate, &w, GATE_OPEN);
				}
			}
			pthread_mutex_unlock(&t->mu);
		}
	}
	pthread_mutex_lock(&s->mu);
	if (s->await >= 0) {
		while (!parent_done(s)) {
			pthread_mutex_unlock(&s->mu);
			REAL(poll)(NULL, 0, 1);
			pthread_mutex_lock(&s->mu);
		}
		s->await = -1;
		if (atomic_fetch_sub(&mpp_awaiting, 1) == 1) {
			int w = GATE_WORD(GATE_FLUSHING, 0);
			atomic_compare_exchange_strong(&mpp_gate, &w, GATE_OPEN);
		}
	}
	pthread_mutex_unlock(&s->mu);
}

// mpp_gate_fork_prepare holds mpp_tab_mu across a fork, so that the child's
// table (mpp_fd_tab, mpp_tab_hi and each state's refs) is not half-changed by a
// thread that does not go on in it; mpp_tab_mu is a leaf lock, taken last.
void mpp_gate_fork_prepare(void)
{
	pthread_mutex_lock(&mpp_tab_mu);
}

void mpp_gate_fork_parent(void)
{
	pthread_mutex_unlock(&mpp_tab_mu);
}

// mpp_gate_child makes a forked child a process of its own: mpid speaks to
// the parent, so the child gets an open gate on a private page, private
// "last call short" flags (not the parent's state page), and none of the
// parent's held bytes, which are the parent's to send (the child's copies
// of the dups that keep closed sockets' bytes are closed). A socket whose
// bytes the parent holds waits for them before the child's first write to
// it (mpp_child_wait); until none waits, the child's gate says flushing, so its
// writes take the slow path. Only the forking thread lives on in the child,
// so the other locks are made anew, and no list or buffer a state's mutex
// guards is walked or freed: another thread may have been changing it at
// the fork.
void mpp_gate_child(void)
{
	int waits = 0;

	parent_shared = shared;
	parent_pid = getppid();
	shared = new_shared();
	if (mmap(&mpp_gate_pg, sizeof(mpp_gate_pg), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_FIXED,
		 -1, 0) != MAP_FAILED)
		atomic_store(&mpp_gate, GATE_OPEN);
	pthread_mutex_unlock(&mpp_tab_mu); // taken by mpp_gate_fork_prepare
	mpp_hold_child();
	if (page) {
		unsigned char *own = calloc(mpp_nfds ? mpp_nfds : 1, 1);
		if (own)
			memcpy(own, mpp_fd_short, mpp_nfds);
		size_t size = page->size;
		mpp_fd_short = own ? own : mpp_fd_short;
		struct mpp_page *p = page;
		page = NULL;
		if (own)
			munmap(p, size);
	}
	// The table is whole (mpp_tab_mu was held over the fork) and only the
	// forking thread lives on.
	for (int fd = 0; fd < mpp_tab_hi; fd++) {
		struct sock *s = atomic_load_explicit(&mpp_fd_tab[fd], memory_order_relaxed);
		if (!s)
			continue;
		pthread_mutex_init(&s->mu, NULL);
		if (s->slot >= 0 && parent_shared && s->await < 0) {
			s->await = s->slot;
			waits++;
		}
		s->slot = -1;
		// Forgotten, not freed: another thread may have been inside s->mu
		// at the fork, its list half-linked or a buffer freed and not yet
		// unlinked. The child never touches the buffers, so its copies of
		// them cost no memory.
		s->head = s->tail = NULL;
		s->held = 0;
		s->shut = 0;
		s->gated = 0;
		s->flushing = 0;
		if (s->orphan && s->fd == fd) {
			s->orphan = 0;
			REAL(close)(fd);
		}
	}
	if (waits) {
		atomic_store(&mpp_awaiting, waits);
		atomic_store(&mpp_gate, GATE_WORD(GATE_FLUSHING, 0));
	}
}

// mpp_state_page creates the state page, a sealed memfd that mpid maps
// read-only (sealed against shrinking, so the rank cannot make mpid's reads
// fault), moves the fast path's short flags into it, and returns its fd.
int mpp_state_page(void)
{
	size_t size = sizeof(struct mpp_page) + (size_t)mpp_nfds * (1 + 1) + 7;
	size = (size + 7) & ~(size_t)7;
	size += (size_t)mpp_nfds * sizeof(uint64_t) * 2;
	int fd = memfd_create("mpipause-state", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -1;
	if (ftruncate(fd, (off_t)size) < 0 ||
	    REAL(fcntl)(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		REAL(close)(fd);
		return -1;
	}
	struct mpp_page *p = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
	if (p == MAP_FAILED) {
		REAL(close)(fd);
		return -1;
	}
	memcpy(p->magic, MPP_PAGE_MAGIC, sizeof(p->magic));
	p->version = MPP_PAGE_VERSION;
	p->fds = (uint32_t)mpp_nfds;
	p->size = size;
	unsigned char *shorts = (unsigned char *)(p + 1);
	page_gated = shorts + mpp_nfds;
	page_held = (uint64_t *)(((uintptr_t)(page_gated + mpp_nfds) + 7) & ~(uintptr_t)7);
	p->held_offset = (uint64_t)((char *)page_held - (char *)p);
	page_from = page_held + mpp_nfds;
	p->from_offset = (uint64_t)((char *)page_from - (char *)p);
	if (mpp_fd_short)
		memcpy(shorts, mpp_fd_short, mpp_nfds);
	// The fast path now notes short calls straight into the page. A call
	// racing this store may note into the old array: harmless, the rank is
	// not gated before it has registered, and its next call notes again.
	mpp_fd_short = shorts;
	p->gate = atomic_load(&mpp_gate);
	page = p;
	for (int i = 0; i < mpp_nfds; i++) {
		struct sock *s = atomic_load_explicit(&mpp_fd_tab[i], memory_order_acquire);
		if (s) {
			pthread_mutex_lock(&s->mu);
			mpp_publish(s);
			pthread_mutex_unlock(&s->mu);
		}
	}
	return fd;
}

// mpp_gate_page shares the gate word's page with mpid: a memfd (sealed
// against resizing, so neither side can make the other's accesses fault)
// holding the word's current value is mapped over the library's own page,
// and its fd is returned for the HELLO. -1, and the word stays private,
// where pages are not the size the library was built for. A forked child
// gets a private page again (mpp_gate_child), since mpid speaks to the
// parent.
int mpp_gate_page(void)
{
	if (sysconf(_SC_PAGESIZE) != MPP_GATE_PAGE_SIZE)
		return -1;
	int fd = memfd_create("mpipause-gate", MFD_CLOEXEC | MFD_ALLOW_SEALING);
	if (fd < 0)
		return -1;
	int w = atomic_load(&mpp_gate);
	if (ftruncate(fd, MPP_GATE_PAGE_SIZE) < 0 || pwrite(fd, &w, sizeof(w), 0) != (ssize_t)sizeof(w) ||
	    REAL(fcntl)(fd, F_ADD_SEALS, F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL) < 0) {
		REAL(close)(fd);
		return -1;
	}
	// The gate does not move while the rank registers (only mpid's requests
	// move it, and there are none yet), so the copy above stays true.
	if (mmap(&mpp_gate_pg, sizeof(mpp_gate_pg), PROT_READ | PROT_WRITE, MAP_SHARED | MAP_FIXED, fd, 0) ==
	    MAP_FAILED) {
		REAL(close)(fd);
		return -1;
	}
	return fd;
}
