// SPDX-License-Identifier: Apache-2.0
//
// The real functions: one table of libc's functions behind the shim's
// wrappers, and behind the shim's own I/O (real.c fills it). Everything the
// shim calls of libc that it also wraps goes through REAL(): the shim's own
// poll, read, write or close landing in its own wrapper would see the
// stashes and the gate it is serving, and could hold or report its own
// bytes. Where a wrapper is meant to run, the call says so by name
// (mpp_wrapped_*, shim.h).
#ifndef MPIPAUSE_REAL_H
#define MPIPAUSE_REAL_H

#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdatomic.h>
#include <stdio.h>
#include <sys/epoll.h>
#include <sys/select.h>
#include <sys/socket.h>
#include <sys/types.h>
#include <sys/uio.h>
#include <time.h>

// The two tables below are laid out by hand, one function an entry:
// clang-format would take their parameter lists for expressions (FILE * f).
// clang-format off

// X(type, name, symbol, parameters, arguments): the functions every glibc
// the shim supports has. Each entry starts out as a stub that fills the
// table and then makes the call (real.c), so a call that comes before the
// library's constructor (another library's constructor writing, polling or
// setting a handler) works, and a call after it is one load of the pointer:
// no test on the send path.
#define MPP_REAL_CALLS(X)                                                                                   \
	X(ssize_t, send, "send", (int fd, const void *b, size_t n, int fl), (fd, b, n, fl))                 \
	X(ssize_t, sendto, "sendto",                                                                        \
	  (int fd, const void *b, size_t n, int fl, const struct sockaddr *to, socklen_t tl),               \
	  (fd, b, n, fl, to, tl))                                                                           \
	X(ssize_t, sendmsg, "sendmsg", (int fd, const struct msghdr *m, int fl), (fd, m, fl))               \
	X(int, sendmmsg, "sendmmsg", (int fd, struct mmsghdr *v, unsigned int n, int fl), (fd, v, n, fl))   \
	X(ssize_t, write, "write", (int fd, const void *b, size_t n), (fd, b, n))                           \
	X(ssize_t, writev, "writev", (int fd, const struct iovec *v, int n), (fd, v, n))                    \
	X(int, close, "close", (int fd), (fd))                                                              \
	X(int, shutdown, "shutdown", (int fd, int how), (fd, how))                                          \
	X(ssize_t, recv, "recv", (int fd, void *b, size_t n, int fl), (fd, b, n, fl))                       \
	X(ssize_t, recvfrom, "recvfrom", (int fd, void *b, size_t n, int fl, struct sockaddr *a, socklen_t *l), \
	  (fd, b, n, fl, a, l))                                                                             \
	X(ssize_t, recvmsg, "recvmsg", (int fd, struct msghdr *m, int fl), (fd, m, fl))                     \
	X(ssize_t, read, "read", (int fd, void *b, size_t n), (fd, b, n))                                   \
	X(ssize_t, readv, "readv", (int fd, const struct iovec *v, int n), (fd, v, n))                      \
	X(int, recvmmsg, "recvmmsg", (int fd, struct mmsghdr *v, unsigned int n, int fl, struct timespec *t), \
	  (fd, v, n, fl, t))                                                                                \
	X(ssize_t, sendfile, "sendfile", (int o, int i, off_t *off, size_t n), (o, i, off, n))              \
	X(ssize_t, sendfile64, "sendfile64", (int o, int i, off64_t *off, size_t n), (o, i, off, n))        \
	X(ssize_t, splice, "splice", (int i, loff_t *oi, int o, loff_t *oo, size_t n, unsigned fl),          \
	  (i, oi, o, oo, n, fl))                                                                            \
	X(int, vdprintf, "vdprintf", (int fd, const char *f, va_list ap), (fd, f, ap))                      \
	X(int, fclose, "fclose", (FILE *f), (f))                                                            \
	X(int, fflush, "fflush", (FILE *f), (f))                                                            \
	X(int, execve, "execve", (const char *p, char *const a[], char *const e[]), (p, a, e))             \
	X(int, execv, "execv", (const char *p, char *const a[]), (p, a))                                    \
	X(int, execvp, "execvp", (const char *p, char *const a[]), (p, a))                                  \
	X(int, execvpe, "execvpe", (const char *p, char *const a[], char *const e[]), (p, a, e))           \
	X(int, fexecve, "fexecve", (int fd, char *const a[], char *const e[]), (fd, a, e))                 \
	X(int, poll, "poll", (struct pollfd *f, nfds_t n, int t), (f, n, t))                                \
	X(int, ppoll, "ppoll", (struct pollfd *f, nfds_t n, const struct timespec *t, const sigset_t *m),   \
	  (f, n, t, m))                                                                                     \
	X(int, select, "select", (int n, fd_set *r, fd_set *w, fd_set *e, struct timeval *t), (n, r, w, e, t)) \
	X(int, pselect, "pselect",                                                                          \
	  (int n, fd_set *r, fd_set *w, fd_set *e, const struct timespec *t, const sigset_t *m),            \
	  (n, r, w, e, t, m))                                                                               \
	X(int, epoll_wait, "epoll_wait", (int ep, struct epoll_event *e, int n, int t), (ep, e, n, t))      \
	X(int, epoll_pwait, "epoll_pwait", (int ep, struct epoll_event *e, int n, int t, const sigset_t *m), \
	  (ep, e, n, t, m))                                                                                 \
	X(int, epoll_ctl, "epoll_ctl", (int ep, int op, int fd, struct epoll_event *e), (ep, op, fd, e))    \
	X(int, epoll_create, "epoll_create", (int n), (n))                                                  \
	X(int, epoll_create1, "epoll_create1", (int fl), (fl))                                              \
	X(int, dup, "dup", (int fd), (fd))                                                                  \
	X(int, dup2, "dup2", (int o, int n), (o, n))                                                        \
	X(int, dup3, "dup3", (int o, int n, int fl), (o, n, fl))                                            \
	X(int, sigaction, "sigaction", (int s, const struct sigaction *a, struct sigaction *o), (s, a, o))  \
	X(sighandler_t, signal, "signal", (int s, sighandler_t h), (s, h))                                  \
	X(int, kill, "kill", (pid_t p, int s), (p, s))

// The functions a glibc older than the newest the shim supports may lack:
// NULL until the table is filled, and after if absent. Reached through
// REAL_OPT, which fills the table first when a call comes early.
#define MPP_REAL_OPTIONAL(X)                                                                                \
	X(int, vdprintf_chk, "__vdprintf_chk", (int fd, int flag, const char *f, va_list ap), ())            \
	X(ssize_t, pwritev2, "pwritev2", (int fd, const struct iovec *v, int n, off_t off, int fl), ())       \
	X(ssize_t, pwritev64v2, "pwritev64v2", (int fd, const struct iovec *v, int n, off64_t off, int fl), ()) \
	X(int, execveat, "execveat", (int d, const char *p, char *const a[], char *const e[], int fl), ())   \
	X(void, closefrom, "closefrom", (int low), ())                                                      \
	X(int, epoll_pwait2, "epoll_pwait2",                                                                \
	  (int ep, struct epoll_event *e, int n, const struct timespec *t, const sigset_t *m), ())           \
	X(int, poll_chk, "__poll_chk", (struct pollfd *f, nfds_t n, int t, size_t l), ())                   \
	X(int, ppoll_chk, "__ppoll_chk",                                                                    \
	  (struct pollfd *f, nfds_t n, const struct timespec *t, const sigset_t *m, size_t l), ())          \
	X(int, fcntl64, "fcntl64", (int fd, int cmd, ...), ())
// clang-format on

#define MPP_REAL_FIELD(type, name, sym, params, args) type(*name) params;
struct real {
	MPP_REAL_CALLS(MPP_REAL_FIELD)
	// Variadic: its stub is written out in real.c.
	int (*fcntl)(int fd, int cmd, ...);
	MPP_REAL_OPTIONAL(MPP_REAL_FIELD)
};
#undef MPP_REAL_FIELD
extern struct real mpp_real;
extern _Atomic int mpp_real_ready; // the table is filled

// mpp_real_resolve fills the table (dlsym(RTLD_NEXT)): the library's
// constructor first thing, or an earlier call's stub.
void mpp_real_resolve(void);

// REAL(fn) is libc's fn, past every wrapper. REAL_OPT(fn) is the same for a
// function of MPP_REAL_OPTIONAL, NULL if this glibc has none.
#define REAL(fn) (mpp_real.fn)
#define REAL_OPT(fn)                                                                                         \
	(__builtin_expect(atomic_load_explicit(&mpp_real_ready, memory_order_acquire) != 0, 1) ? mpp_real.fn \
											       : (mpp_real_resolve(), mpp_real.fn))

#endif
