// SPDX-License-Identifier: Apache-2.0
// Internal interface between the shim's parts.
#ifndef MPIPAUSE_SHIM_H
#define MPIPAUSE_SHIM_H

#include <dlfcn.h>
#include <stdatomic.h>
#include <stdint.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>

#include "real.h"

#define EXPORT __attribute__((visibility("default")))
#define likely(x) __builtin_expect(!!(x), 1)

// The gate word: a state in the low 2 bits and, above them, the generation
// of the close it belongs to. Open is 0 whatever the generation, so the
// send path compares the whole word with one constant.
enum {
	GATE_OPEN = 0,
	GATE_CLOSED = 1,
	GATE_FLUSHING = 2
};
#define GATE_GEN_MASK 0x1fffffffu
#define GATE_STATE(w) (3 & (w))
#define GATE_GEN(w) (((unsigned)(w) >> 2) & GATE_GEN_MASK)
#define GATE_WORD(state, gen) ((int)(((GATE_GEN_MASK & (unsigned)(gen)) << 2) | (unsigned)(state)))

// mpp_gate is what every wrapped send call loads first (relaxed): anything
// but GATE_OPEN takes the slow path. The word has a page of the library's
// memory to itself so that registration can map a page shared with mpid
// over it (mpp_gate_page): mpid then closes and reopens the gate by writing
// the word, without waiting for the shim's thread to be
// scheduled, while the send path still loads a fixed address.
#define MPP_GATE_PAGE_SIZE 4096
union mpp_gate_page {
	_Atomic int word;
	char pad[MPP_GATE_PAGE_SIZE];
};
extern union mpp_gate_page mpp_gate_pg;
#define mpp_gate (mpp_gate_pg.word)

// The fast path's test: one relaxed load of the gate word.
#define GATE_IS_OPEN() likely(atomic_load_explicit(&mpp_gate, memory_order_relaxed) == GATE_OPEN)

struct mpp_gate_stats {
	int gate;                // GATE_*
	unsigned gated;          // sockets at a call boundary under the closed gate
	unsigned closing;        // TCP sockets still mid-message (last call short)
	unsigned long held;      // bytes held in the shim
	unsigned long flushed;   // bytes sent by the last open
	unsigned flush_errors;   // held chunks the last open could not send (connection gone)
	int flush_errno;         // errno of the last of those
	unsigned long untracked; // gated-mode calls on fds beyond the shim's tables
	unsigned long lost;      // held bytes not sent: their socket was closed by a call the shim does not see
};

// Per-fd flag: the last send call on fd was short. Sized mpp_nfds.
extern unsigned char *mpp_fd_short;
extern int mpp_nfds;

// mpp_note_short is the fast path's only bookkeeping: whether the last call
// on fd left part of the caller's bytes unsent (G2's call boundary,
// docs/guarantees.md).
static inline __attribute__((always_inline)) void mpp_note_short(int fd, ssize_t r, size_t want)
{
	if ((unsigned)fd < (unsigned)mpp_nfds)
		mpp_fd_short[fd] = r >= 0 && (size_t)r < want;
}

int mpp_close_held(int fd);
int mpp_keep_held(int fd);
int mpp_kept(int fd);
int mpp_kept_in(unsigned first, unsigned last, int *out, int max);
int mpp_defer_shutdown(int fd);
void mpp_unheld(int fd, const char *what, char call);
void mpp_gate_end(const char *why);
// The fork hook (shim.c) is one pthread_atfork registration that calls each
// part's functions in one fixed order; mpp_fork_init registers it, once,
// from the constructor or from a blocking wait that comes earlier (wake.c).
// The parts: gateword.c's prepare and parent hold the gate's table's lock
// over a fork, its child makes the child a process of its own.
void mpp_fork_init(void);
void mpp_gate_fork_prepare(void);
void mpp_gate_fork_parent(void);
void mpp_gate_child(void);
void mpp_paths_child(void);
uint64_t mpp_sock_cookie(int fd);
int mpp_is_tcp(int fd);
ssize_t mpp_send_all(int fd, const void *b, size_t n);
void mpp_paths_init(void);
long long mpp_now_ms(void);
// bigbuf.c: memory for held and stashed bytes, from MPP_BIG in mappings
// advised for transparent huge pages; freed with the size it was made with.
#define MPP_BIG ((size_t)2 << 20)
void *mpp_big_alloc(size_t n);
void mpp_big_free(void *p, size_t n);
#ifndef SO_COOKIE
#define SO_COOKIE 57
#endif
// MPP_CONSUMED, or'ed into mpp_gated's flags: the caller took the bytes from
// their source already (sendfile, splice), so they must be held or sent,
// never refused for lack of room. No MSG_ flag uses this bit.
#define MPP_CONSUMED ((int)0x80000000u)

// The state page's layout (internal/ranks reads it; keep them in step):
// this header, then nfds "last call short" bytes, nfds "gated" bytes, at
// held_offset (8-aligned) nfds uint64 "bytes held", and at from_offset
// nfds uint64 "held from": where in the socket's stream the held bytes go,
// as the kernel's count of the bytes it took before them (mpp_tcp_sent
// when the socket began to hold, plus what a flush sent since), or
// MPP_SENT_UNKNOWN. Written before "bytes held" leaves 0.
#define MPP_PAGE_MAGIC "MPPSTATE"
#define MPP_PAGE_VERSION 2
struct mpp_page {
	char magic[8];
	uint32_t version;
	uint32_t fds; // entries per array
	uint64_t size;
	uint64_t held_offset;
	int32_t gate; // GATE_*
	// Flushes sending held bytes now (mpp_flush_fd): a sender mpid cannot
	// see in the per-fd flags, which keeps the rank from being quiet.
	_Atomic uint32_t flushing;
	uint64_t from_offset;
};
// tcpsent.c
#define MPP_SENT_UNKNOWN UINT64_MAX
uint64_t mpp_tcp_sent(int fd);
int mpp_state_page(void);
int mpp_gate_page(void);
void mpp_gate_init(void);
void mpp_gate_close(void);
void mpp_gate_open(struct mpp_gate_stats *st); // forced: flush everything, then open
int mpp_gate_flushing(long gen);
void mpp_gate_flush(struct mpp_gate_stats *st, int word);
void mpp_gate_state(struct mpp_gate_stats *st);
// The rank channel to mpid (rankchan.c): start after MPI_Init with what the
// rank learnt there (NULL: the MPI library's ABI is not one the shim knows;
// the rank registers all the same, to be gateable), stop at MPI_Finalize.
// Every line of the channel is written there or in its two parts,
// rankserve.c and rankhello.c (the HELLO, from these values).
struct mpp_hello {
	const char *job;   // the job's id
	int rank, size;    // in MPI_COMM_WORLD
	const char *host;  // this rank's host
	const char *root;  // rank 0's host, "" if not known
	const char *hosts; // on rank 0, every rank's host (size entries of MPP_HOST_MAX bytes), else NULL
};
#define MPP_HOST_MAX 64 // a host name's bytes, its NUL among them
void mpp_rankch_start(const struct mpp_hello *h);
void mpp_rankch_stop(void);
void mpp_rankch_child(void);
// mpp_hello_value makes s a value the HELLO can carry (no space or control
// character, no ',' or '='), in place: mpi.c applies it to the host name before other ranks get
// it, so that every rank's copy is the one the HELLO says.
void mpp_hello_value(char *s);
// The early JOIN (rankhello.c), from the library's constructor: a rank of a job
// named by MPIPAUSE_JOBID asks mpid to move it into the job's cgroup before
// it creates any socket (the kernel charges a socket to its creator's
// cgroup for good). At most JOIN_TIMEOUT_S seconds, or MPIPAUSE_JOIN_TIMEOUT
// (1 to JOIN_TIMEOUT_MAX_S); never fails the process.
// The name of the shim's thread that serves the rank channel (at most 15
// characters): mpid looks for it in /proc/PID/task/*/comm
// (internal/ranks.ShimThreadName).
#define MPP_RANKCH_THREAD_NAME "mpipause-ctl"

#define MPP_JOBID_MAX 128
#define JOIN_TIMEOUT_S 10
#define JOIN_TIMEOUT_MAX_S 600
void mpp_rankch_join(void);
// mpp_is_rank (sig.c): this process is an MPI process a launcher started
// (its rank variable is set), not the launcher or one of its daemons.
int mpp_is_rank(void);
int mpp_valid_jobid(const char *id);
int mpp_join_line(char *b, size_t n, const char *id, long pid, const char *key);
// MPP_KEY_MAX is the longest job key (ranks.MaxKey).
#define MPP_KEY_MAX 320
const char *mpp_job_key(void);

// One SIGTSTP or SIGCONT as sig.c's handler writes it to its pipe: one
// write(2) of fewer than PIPE_BUF bytes, so the thread reads whole records.
// ns is CLOCK_MONOTONIC when the handler ran: mpid, on the same machine,
// leaves alone a request that a resume (or pause) has answered since.
struct mpp_sig {
	int64_t ns; // for 'U': the socket's cookie
	char sig;   // 'T' SIGTSTP, 't' one its SIGCONT overtook, 'C' SIGCONT, 'U' a call the gate cannot hold
	char call;  // for 'U': MPP_UNHELD_*
	int32_t fd; // for 'U'
};
enum {
	MPP_UNHELD_ANCILLARY = 'A',
	MPP_UNHELD_ZEROCOPY = 'Z',
	MPP_UNHELD_FASTOPEN = 'F',
	MPP_UNHELD_PWRITEV2 = 'P'
};
// mpp_report_unheld tells mpid (through the signal pipe and the shim's
// thread: "EVENT unheld") of a call on a TCP socket that passed the closed
// gate unheld, the first few of each closing: a job connection's pause then
// fails naming it. The caller (gate.c) gives the gate word, whose
// generation names the closing, and the socket's cookie.
void mpp_report_unheld(int fd, char call, int gate, uint64_t cookie);

// SIGTSTP/SIGCONT (sig.c): install returns the pipe the handler writes to.
int mpp_signals_install(void);
// mpp_tstp_entry is the first instruction of the shim's SIGTSTP handler: a
// frozen thread whose next instruction it is holds a SIGTSTP delivered
// before the freeze (internal/mpid/signals.go, framed).
uintptr_t mpp_tstp_entry(void);
void mpp_signals_restore(void);
void mpp_signals_child(void);

// The shim's own wrappers, called on purpose where their bookkeeping must
// happen as for a call of the application's: an application's call served
// by another (close_range's closes, dprintf's write, pwritev2's writev),
// and the dup that keeps a closed socket's held bytes (a new descriptor of
// the socket, which the drain must know). Aliases of the exported wrappers,
// bound inside the library.
int mpp_wrapped_close(int fd);
ssize_t mpp_wrapped_write(int fd, const void *buf, size_t len);
ssize_t mpp_wrapped_writev(int fd, const struct iovec *iov, int iovcnt);
int mpp_wrapped_fcntl(int fd, int cmd, ...);

ssize_t mpp_gated(int fd, const struct iovec *iov, int iovcnt, int flags, ssize_t (*real)(void *), void *arg);
// mpp_quickack sends fd's pending delayed ACK now (TCP_QUICKACK); errno is
// kept, and on a socket that is not TCP it does nothing.
void mpp_quickack(int fd);

// stash.c and drain.c: the receive-side drain. While a pause is in progress the
// shim's thread reads what waits in the receive queues of the rank's TCP
// sockets into a stash per socket in process memory, so that the kernel reports
// them empty whether or not the application reads; the wrapped reads give
// those bytes back first, in order, and the wrapped waits (waits.h) report
// the fd readable while its stash holds bytes.
//
// mpp_stash_live counts the stashes that hold bytes: a wrapped wait
// loads it first and makes the real call unchanged when it is 0.
extern _Atomic int mpp_stash_live;
// mpp_stash_ready is nonzero while fd's stash holds bytes (or an error to
// report); any fd value is accepted.
int mpp_stash_ready(int fd);
// mpp_stash_edge changes each time fd's stash goes from empty to holding
// bytes: an edge-triggered (EPOLLET) registration reports fd once per value.
unsigned mpp_stash_edge(int fd);
// mpp_stash_fd moves what waits in fd's receive queue into its socket's
// stash, unless an application thread is reading a descriptor of the socket
// right now (that thread gets the bytes) or fd is no longer the file with
// inode ino (0: any). Returns the bytes moved, 0 if none, -1 if skipped
// (drain.c).
ssize_t mpp_stash_fd(int fd, ino_t ino);
// mpp_stash_forget detaches fd from its socket's stash (the bytes stay for
// the socket's other descriptors); mpp_stash_closing and mpp_stash_closed
// go around anything that closes fd; mpp_stash_adopt follows anything that
// makes a new descriptor of a socket (stash.c).
void mpp_stash_forget(int fd);
void mpp_stash_adopt(int fd);
void mpp_stash_adopt_rights(const struct msghdr *msg);
void mpp_stash_fork_prepare(void);
void mpp_stash_fork_parent(void);
void mpp_stash_child(void);
size_t mpp_stash_exec_lost(void);
int mpp_stash_closing(int fd);
int mpp_stash_enter(int fd);
void mpp_stash_closed(int fd, int counted);
void mpp_stash_init(void);
// The cap on what the stashes hold together (MPIPAUSE_STASH_MAX_MB), what
// they hold now, and whether a drain found bytes it had no room for since
// the last call with clear set.
size_t mpp_stash_max(void);
size_t mpp_stash_bytes(void);
int mpp_stash_full(int clear);
// The reads' fast path (wrap.c) and slow path.
extern _Atomic int *mpp_read_busy;
extern _Atomic unsigned char *mpp_read_slow;
ssize_t mpp_stash_read(int fd, const struct iovec *iov, int iovcnt, int flags,
		       ssize_t (*real)(void *arg, const struct iovec *rest, int restcnt), void *arg);
void __chk_fail(void) __attribute__((noreturn));

// wake.c: mpp_wait_wake makes every thread blocked in a wrapped wait look
// at the stashes again, without the application seeing an EINTR it would
// not otherwise see. mpp_wait_init runs from the constructor.
void mpp_wait_wake(void);
void mpp_wait_init(void);
void mpp_wait_fork_prepare(void);
void mpp_wait_fork_parent(void);
void mpp_wait_child(void);
// epoll.c's part of the fork hook: its view of the epoll sets is whole in
// the child.
void mpp_epoll_fork_prepare(void);
void mpp_epoll_fork_parent(void);
void mpp_epoll_fork_child(void);
// mpp_wait_close forgets what epoll.c knows of fd (an epoll set, or a
// registration in one), before fd is closed.
void mpp_wait_close(int fd);

#endif
