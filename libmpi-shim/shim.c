// SPDX-License-Identifier: Apache-2.0
//
// libmpipause.so: the rank-side gate, preloaded into unmodified MPI programs.
//
// gate.c and wrap.c are the send gate. This file is the library's frame:
// its constructor, its one fork hook, and the entry points through which
// the C tests play mpid's part (the rank channel to mpid calls the same
// functions directly).
#include "shim.h"

#include <pthread.h>

// mpipause_shim_version lets mpid and tests check which shim a rank loaded.
EXPORT const char mpipause_shim_version[] = "mpipause-shim 0.2";

// The fork hook: every part's lock that guards a table a forked child
// keeps is held over the fork, so that the child's copy is whole, and the
// child is then made a process of its own. One registration, so that the
// order below is the order, whichever part started first.
//
// Prepare takes epoll.c's reg_mu, wake.c's wake_mu, gate.c's mpp_tab_mu
// and stash.c's mpp_stash_tab_mu, in that order; parent gives them back in
// the reverse order. Each is a leaf lock (no thread waits for another lock
// while it holds one of them), so the forking thread, holding some, never
// waits for a thread that waits for it.
//
// In the child, the gate, the stash, the signals and the rank channel are
// made the child's first (each gives back its own lock, or holds none),
// and the wait table and the epoll view last: until then reg_mu and wake_mu
// are still held, so no part of the child may close, dup or wait through a
// wrapper (the wrapped close takes reg_mu, and would deadlock): they use
// REAL().
static void fork_prepare(void)
{
	mpp_epoll_fork_prepare();
	mpp_wait_fork_prepare();
	mpp_gate_fork_prepare();
	mpp_stash_fork_prepare();
}

static void fork_parent(void)
{
	mpp_stash_fork_parent();
	mpp_gate_fork_parent();
	mpp_wait_fork_parent();
	mpp_epoll_fork_parent();
}

static void fork_child(void)
{
	mpp_paths_child();
	mpp_gate_child();
	mpp_stash_child();
	mpp_signals_child();
	mpp_rankch_child();
	mpp_wait_child();
	mpp_epoll_fork_child();
}

static pthread_once_t fork_once = PTHREAD_ONCE_INIT;

static void fork_register(void)
{
	pthread_atfork(fork_prepare, fork_parent, fork_child);
}

void mpp_fork_init(void)
{
	pthread_once(&fork_once, fork_register);
}

__attribute__((constructor(101))) static void shim_init(void)
{
	// First: every other part calls libc through the table.
	mpp_real_resolve();
	mpp_fork_init();
	mpp_gate_init();
	mpp_paths_init();
	mpp_stash_init();
	mpp_wait_init();
	// Before the program (and MPI_Init) can create a socket: into the job's
	// cgroup, if this is a rank of a named job and mpid agrees.
	mpp_rankch_join();
}

// mpipause_gate_close closes the gate: from now on each TCP socket of the
// process is gated at its next call boundary.
EXPORT void mpipause_gate_close(void)
{
	mpp_gate_close();
}

// mpipause_gate_open reopens the gate, sending every held byte in order
// before it returns; st (may be NULL) gets what happened.
EXPORT void mpipause_gate_open(struct mpp_gate_stats *st)
{
	struct mpp_gate_stats tmp;
	mpp_gate_open(st ? st : &tmp);
}

// mpipause_gate_state reports the gate and its sockets.
EXPORT void mpipause_gate_state(struct mpp_gate_stats *st)
{
	mpp_gate_state(st);
}

// mpipause_test_signals installs the SIGTSTP/SIGCONT handlers as attaching
// to mpid does, for the C tests; it returns the pipe they write to.
EXPORT int mpipause_test_signals(void)
{
	return mpp_signals_install();
}

// mpipause_test_join_line formats the JOIN line as the constructor does,
// for the C tests: its length, or -1 for an invalid job id or no key.
EXPORT int mpipause_test_join_line(char *b, size_t n, const char *id, long pid, const char *key)
{
	return mpp_join_line(b, n, id, pid, key);
}

// mpipause_test_gate_page shares the gate word's page as registering does
// and returns its fd, for the C tests (which then play mpid's part).
EXPORT int mpipause_test_gate_page(void)
{
	return mpp_gate_page();
}

// mpipause_test_reopen is the shim's answer to "REOPEN <gen>": 0 if it
// flushed and reopened, -1 if the gate is open or in another generation.
EXPORT int mpipause_test_reopen(long gen, struct mpp_gate_stats *st)
{
	int f = mpp_gate_flushing(gen);
	if (f < 0)
		return -1;
	mpp_gate_flush(st, f);
	return 0;
}

// mpipause_test_stash moves what waits in fd's receive queue into its
// stash, as the shim's thread does during a pause, if fd is still the file
// with inode ino (0: any); the bytes moved.
EXPORT ssize_t mpipause_test_stash(int fd, unsigned long ino)
{
	return mpp_stash_fd(fd, (ino_t)ino);
}

// mpipause_test_state_page creates the state page as registering does and
// returns its fd, for the C tests (which then read it as mpid does).
EXPORT int mpipause_test_state_page(void)
{
	return mpp_state_page();
}
