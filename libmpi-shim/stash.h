// SPDX-License-Identifier: Apache-2.0
//
// The stashes' parts between stash.c, which keeps them and serves the reads
// from them, and drain.c, which fills them. The rest of the shim sees the
// stashes through shim.h.
#ifndef MPIPAUSE_STASH_H
#define MPIPAUSE_STASH_H

#include <pthread.h>
#include <stdatomic.h>
#include <stddef.h>
#include <sys/types.h>

struct stash {
	pthread_mutex_t mu;
	char *buf;
	size_t off, len, cap; // buf[off, len) waits for the application
	int err;              // an error the drain's read got, given after the bytes
	// The socket (its inode) while the stash is in use, 0 while free: set
	// under tab_mu (claim), cleared under tab_mu and mu (release); atomic,
	// since a reader checks it under mu alone.
	_Atomic(ino_t) ino;
	int *fds; // the descriptors attached (tab[fd] == this), nfd of capfd
	int nfd, capfd;
};

// A descriptor's read flag (mpp_read_slow): SLOW_DRAIN while a drain is
// taking from its socket, SLOW_HELD while its socket's stash holds bytes.
enum {
	SLOW_NONE,
	SLOW_DRAIN,
	SLOW_HELD
};

// stash.c: the stashes by socket, and the descriptors attached to each.
// mpp_stash_tab_mu guards the pool of stashes (a leaf lock: it may be taken
// under a stash's mutex, never the other way); mpp_stash_fd_gen moves with
// every wrapped call that changes which socket a number names; mpp_stash_held
// is what the stashes hold together.
extern pthread_mutex_t mpp_stash_tab_mu;
extern _Atomic unsigned mpp_stash_fd_gen;
extern _Atomic size_t mpp_stash_held;
int mpp_stash_tracked(int fd);
int mpp_stash_holding(const struct stash *s);
struct stash *mpp_stash_find(ino_t ino);
struct stash *mpp_stash_claim(ino_t ino);
int mpp_stash_attach(struct stash *s, int fd, int slow);
void mpp_stash_set_slow(struct stash *s, int slow);
void mpp_stash_detach_all(struct stash *s);
int mpp_stash_names(int fd, ino_t ino);
// A stash's buffer: grown to hold want bytes (0, or -1 if no memory), and
// freed; either with s->mu held.
int mpp_stash_grow(struct stash *s, size_t want);
void mpp_stash_buf_free(struct stash *s);

// drain.c: the cap, read at load; a forked child's drain starts afresh.
void mpp_drain_init(void);
void mpp_drain_child(void);

#endif
