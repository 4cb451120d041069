// SPDX-License-Identifier: Apache-2.0
//
// libucxfinalize.so: keeps UCX progressing while an MPICH rank waits in the
// PMI barrier at the end of MPI_Finalize.
//
// Why (docs/rig.md has the evidence): MPICH 4.0.2's ch4:ucx finalize calls
// ucp_disconnect_nb() on every endpoint, waits for those closes, then blocks
// in a PMI barrier (a read() on the PMI fd) without progressing UCX. Over
// TCP, UCX 1.13's endpoint flush sends a PUT and waits for the peer's ACK,
// which the peer only sends from ucp_worker_progress(). A rank that reached
// the barrier first never answers its late peers: they wait for the ACK, it
// waits for them. MPICH fixed this upstream by dropping that barrier
// (pmodels/mpich#6596); this library does the equivalent from outside: once
// the process has started disconnecting, a read() on the PMI fd waits for
// data while calling ucp_worker_progress().
//
// It is preloaded into every command of a rig node. In a process that never
// calls ucp_disconnect_nb() (anything that is not an MPICH ch4:ucx rank)
// the only cost is one flag test per read(). No UCX headers or library are
// needed to build or load it: UCX's own symbols are found at run time.
#include <dlfcn.h>
#include <errno.h>
#include <poll.h>
#include <stdlib.h>
#include <sys/types.h>
#include <unistd.h>

#define EXPORT __attribute__((visibility("default")))

// UCX handles are opaque pointers (ucp/api/ucp_def.h).
typedef void *ucp_worker_h;
typedef void *ucp_ep_h;
typedef void *ucs_status_ptr_t;

static ucp_worker_h last_worker; // the worker the process last progressed
static int disconnecting;        // set by ucp_disconnect_nb, cleared by ucp_worker_destroy
static int pmi_fd = -2;          // -2: PMI_FD not read yet; -1: none

static unsigned (*real_progress)(ucp_worker_h);

static void *next(const char *sym)
{
	return dlsym(RTLD_NEXT, sym);
}

EXPORT unsigned ucp_worker_progress(ucp_worker_h w)
{
	if (!real_progress)
		real_progress = next("ucp_worker_progress");
	last_worker = w;
	return real_progress(w);
}

EXPORT ucs_status_ptr_t ucp_disconnect_nb(ucp_ep_h ep)
{
	static ucs_status_ptr_t (*real)(ucp_ep_h);
	if (!real)
		real = next("ucp_disconnect_nb");
	disconnecting = 1;
	return real(ep);
}

EXPORT void ucp_worker_destroy(ucp_worker_h w)
{
	static void (*real)(ucp_worker_h);
	if (!real)
		real = next("ucp_worker_destroy");
	if (w == last_worker) {
		last_worker = NULL;
		disconnecting = 0;
	}
	real(w);
}

// wait_progressing returns once fd is readable (or in error), progressing
// the worker meanwhile.
static void wait_progressing(int fd)
{
	struct pollfd p = {.fd = fd, .events = POLLIN};
	for (;;) {
		int n = poll(&p, 1, 1);
		if (n > 0 || (n < 0 && errno != EINTR))
			return;
		if (last_worker && real_progress)
			real_progress(last_worker);
	}
}

EXPORT ssize_t read(int fd, void *buf, size_t count)
{
	static ssize_t (*real)(int, void *, size_t);
	if (!real)
		real = next("read");
	if (disconnecting && last_worker) {
		if (pmi_fd == -2) {
			const char *e = getenv("PMI_FD");
			pmi_fd = e ? atoi(e) : -1;
		}
		if (fd == pmi_fd)
			wait_progressing(fd);
	}
	return real(fd, buf, count);
}
