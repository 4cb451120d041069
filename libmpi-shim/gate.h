// SPDX-License-Identifier: Apache-2.0
//
// The send gate's parts between its files (gate.c holds, flush.c sends
// what was held, gateword.c shows both to mpid and to a forked child): one
// socket's state, the table of them, and what each file does to them for
// the others. Nothing outside the gate includes it: the rest of the shim
// sees the gate through shim.h.
#ifndef MPIPAUSE_GATE_H
#define MPIPAUSE_GATE_H

#include <pthread.h>
#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

struct mpp_gate_stats;
struct mpp_page;

struct held {
	struct held *next;
	size_t len, off;
	int oob; // sent with MSG_OOB: its last byte is the urgent one
	char data[];
};

// One TCP socket's state: its gate and its held bytes. Made on the slow
// path for the socket of a descriptor, shared by every descriptor of that
// socket the slow path has seen, and never given to another socket.
struct sock {
	pthread_mutex_t mu;
	// The socket (SO_COOKIE, set at creation): a descriptor's number may
	// name another socket later, if the application closed it by a call
	// the shim does not see.
	uint64_t cookie;
	int gated;    // this socket has passed its call boundary under a closed gate
	int orphan;   // the application closed its descriptors; fd is the shim's dup
	int fd;       // the descriptor the bytes go to (moves on close), -1: none known
	int flushing; // the shim's thread is sending its held bytes
	int shut;     // a shutdown(SHUT_WR) waits for the held bytes (paths.c)
	int refs;     // mpp_fd_tab entries naming it (under mpp_tab_mu)
	int slot;     // its entry in the shared table while it holds bytes, or -1
	int await;    // in a forked child: the parent's entry to wait for, or -1
	struct held *head, *tail;
	size_t held;
	// While it holds bytes: the kernel's count of the bytes the socket took
	// before them (the state page's "held from"), so mpid can tell a send
	// that reached the kernel late from one that overtook them.
	uint64_t held_from;
};

// Each descriptor's socket, made on the slow path (gate.c): mpp_nfds
// entries, none from mpp_tab_hi on. mpp_tab_mu guards the entries' changes
// and each state's refs; it is a leaf lock.
extern struct sock *_Atomic *mpp_fd_tab;
extern int mpp_tab_hi;
extern pthread_mutex_t mpp_tab_mu;

// gate.c: the table, the room the held bytes take, and a socket whose
// bytes cannot be sent.
void mpp_bind_fd(int fd, struct sock *t);
struct sock *mpp_sock_of(int fd, uint64_t c, int create);
void mpp_hold_release(size_t n);
void mpp_hold_wake(void);
size_t mpp_held_total(void);
void mpp_hold_child(void);
size_t mpp_gone(struct sock *s);
void mpp_held_free(struct held *h);

// flush.c: sending a socket's held bytes.
void mpp_flush_fd(struct sock *s, struct mpp_gate_stats *st, int word, long long deadline);

// gateword.c: the mirrors of each socket's state (the state page, the table
// a forked child reads), the gate word's, and a forked child's wait for its
// parent's held bytes.
void mpp_shared_init(void);
void mpp_publish(struct sock *s);
void mpp_set_fd(struct sock *s, int fd);
void mpp_page_clear(int fd);
void mpp_publish_gate(int g);
struct mpp_page *mpp_flush_begin(void);
void mpp_flush_end(struct mpp_page *p);
extern _Atomic int mpp_awaiting;
void mpp_child_wait(struct sock *s);

#endif
