// SPDX-License-Identifier: Apache-2.0
//
// The other ways a program sends on a socket or ends one, which must keep
// the gate's promise (nothing lost, nothing reordered) while bytes are
// held: shutdown, sendfile, splice, close_range and closefrom, fclose and
// fflush of a socket stream, dup2/dup3 (dup.c), and the ends of a process
// as the kernel sees them: fork, exec, exit. Each has the send path's fast
// path (one load of the gate word, then the real call) and does its work
// only while the gate is not open.
//
// Not wrapped, by design: copy_file_range and vmsplice, which cannot write
// to a socket; io_uring and raw system calls, which the shim cannot see
// (on a job connection the pause's kernel check reports their bytes as sent
// through a closed gate). libmpi-shim/README.md lists the limits.
#include "shim.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <dirent.h>
#include <sys/sendfile.h>
#include <sys/syscall.h>
#include <unistd.h>

// Debian 11's glibc 2.31 knows neither close_range (2.34) nor
// SYS_close_range, and its kernel headers (5.10) not CLOSE_RANGE_CLOEXEC
// (5.11): the shim still wraps the call a newer libc or a program making
// the call itself would make. 436 is close_range on every architecture.
#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef CLOSE_RANGE_CLOEXEC
#define CLOSE_RANGE_CLOEXEC (1U << 2)
#endif
int close_range(unsigned first, unsigned last, int flags);
void closefrom(int low);

// A sendfile or splice under a closed gate is taken into the shim at most
// this many bytes a call, as a short call (the caller calls again).
#define CHUNK (1 << 20)

// The process the held bytes belong to. A vfork child shares its parent's
// memory until it execs, and runs no atfork handler: its exec must not send
// the parent's bytes.
static pid_t owner;

// The fork hook's part (shim.c): the held bytes are the parent's.
void mpp_paths_child(void)
{
	owner = getpid();
}

void mpp_paths_init(void)
{
	owner = getpid();
}

// Exit: what is still held goes before the memory holding it (after the
// application's atexit handlers, which may send, and before stdio's final
// flush, which passes the gate). _exit and a crash lose it, as documented.
__attribute__((destructor)) static void at_exit(void)
{
	if (owner == getpid())
		mpp_gate_end("exit");
}

EXPORT int shutdown(int fd, int how)
{
	if (GATE_IS_OPEN() || how == SHUT_RD || !mpp_defer_shutdown(fd))
		return REAL(shutdown)(fd, how);
	// The FIN waits for the held bytes (the flush sends it); the read side
	// closes now, as asked.
	return how == SHUT_RDWR ? REAL(shutdown)(fd, SHUT_RD) : 0;
}

struct taken {
	int fd;
	const char *b;
	size_t n;
	int all; // the bytes left their source: send all of them
};

static ssize_t send_taken(void *a)
{
	struct taken *t = a;
	return t->all ? mpp_send_all(t->fd, t->b, t->n) : REAL(send)(t->fd, t->b, t->n, MSG_NOSIGNAL);
}

// file_send is sendfile under a gate that is not open, to a TCP socket: the
// bytes are read (pread where in can seek, so that only what the gate took
// moves the offset) and go through the gate as a send of them would.
static ssize_t file_send(int out, int in, off64_t *offset, size_t count)
{
	size_t n = count < CHUNK ? count : CHUNK;
	char *b = malloc(n ? n : 1);
	if (!b) {
		errno = ENOMEM;
		return -1;
	}
	off64_t pos = offset ? *offset : lseek64(in, 0, SEEK_CUR);
	int seekable = pos >= 0;
	ssize_t got = seekable ? pread64(in, b, n, pos) : REAL(read)(in, b, n);
	if (got <= 0) {
		free(b);
		return got;
	}
	struct taken t = {out, b, (size_t)got, !seekable};
	struct iovec v = {b, (size_t)got};
	ssize_t r = mpp_gated(out, &v, 1, seekable ? MSG_NOSIGNAL : MSG_NOSIGNAL | MPP_CONSUMED, send_taken, &t);
	int saved = errno;
	if (r > 0 && seekable) {
		if (offset)
			*offset += r;
		else
			lseek64(in, pos + r, SEEK_SET);
	}
	free(b);
	errno = saved;
	return r;
}

EXPORT ssize_t sendfile(int out, int in, off_t *offset, size_t count)
{
	if (GATE_IS_OPEN() || !mpp_is_tcp(out)) {
		ssize_t r = REAL(sendfile)(out, in, offset, count);
		mpp_note_short(out, r, count);
		return r;
	}
	off64_t o = offset ? *offset : 0;
	ssize_t r = file_send(out, in, offset ? &o : NULL, count);
	if (offset)
		*offset = (off_t)o;
	return r;
}

EXPORT ssize_t sendfile64(int out, int in, off64_t *offset, size_t count)
{
	if (GATE_IS_OPEN() || !mpp_is_tcp(out)) {
		ssize_t r = REAL(sendfile64)(out, in, offset, count);
		mpp_note_short(out, r, count);
		return r;
	}
	return file_send(out, in, offset, count);
}

// splice to a socket reads from a pipe: under a gate that is not open the
// pipe's bytes are read and held (or sent, all of them) as a send would be.
EXPORT ssize_t splice(int in, loff_t *off_in, int out, loff_t *off_out, size_t len, unsigned flags)
{
	if (GATE_IS_OPEN() || off_out != NULL || !mpp_is_tcp(out)) {
		ssize_t r = REAL(splice)(in, off_in, out, off_out, len, flags);
		mpp_note_short(out, r, len);
		return r;
	}
	if (off_in != NULL) {
		errno = ESPIPE; // a socket's other end must be a pipe
		return -1;
	}
	if (flags & SPLICE_F_NONBLOCK) {
		struct pollfd p = {.fd = in, .events = POLLIN};
		if (REAL(poll)(&p, 1, 0) == 0) {
			errno = EAGAIN;
			return -1;
		}
	}
	size_t n = len < CHUNK ? len : CHUNK;
	char *b = malloc(n ? n : 1);
	if (!b) {
		errno = ENOMEM;
		return -1;
	}
	ssize_t got = REAL(read)(in, b, n);
	if (got <= 0) {
		free(b);
		return got;
	}
	struct taken t = {out, b, (size_t)got, 1};
	struct iovec v = {b, (size_t)got};
	ssize_t r = mpp_gated(out, &v, 1, MSG_NOSIGNAL | MPP_CONSUMED, send_taken, &t);
	int saved = errno;
	free(b);
	errno = saved;
	return r;
}

static int close_some(unsigned first, unsigned last, int flags)
{
	enum {
		MAX_KEPT = 256
	};
	int kept[MAX_KEPT], nk;
	DIR *d = opendir("/proc/self/fd");
	if (d) {
		struct dirent *e;
		while ((e = readdir(d))) {
			char *end;
			long fd = strtol(e->d_name, &end, 10);
			if (*end || e->d_name[0] == '.' || fd == dirfd(d) || fd < (long)first || fd > (long)last)
				continue;
			// Through the wrapper: each goes as the application's own
			// close would (its held bytes kept, its stash left).
			if (!mpp_kept((int)fd))
				mpp_wrapped_close((int)fd);
		}
		closedir(d);
	}
	// The dups, the ones made just now among them, in ascending order.
	nk = mpp_kept_in(first, last, kept, MAX_KEPT);
	unsigned from = first;
	int r = 0;
	for (int i = 0; i < nk && r == 0; i++) {
		if ((unsigned)kept[i] > from)
			r = (int)syscall(SYS_close_range, from, (unsigned)kept[i] - 1, flags);
		from = (unsigned)kept[i] + 1; // below MAX_FDS: no overflow
	}
	if (r == 0 && from <= last)
		r = (int)syscall(SYS_close_range, from, last, flags);
	return r;
}

EXPORT int close_range(unsigned first, unsigned last, int flags)
{
	if (first > last || (flags & CLOSE_RANGE_CLOEXEC) ||
	    (GATE_IS_OPEN() && atomic_load_explicit(&mpp_stash_live, memory_order_relaxed) == 0)) {
		if (first <= last && !(flags & CLOSE_RANGE_CLOEXEC) && first < (unsigned)mpp_nfds)
			memset(mpp_fd_short + first, 0, (last < (unsigned)mpp_nfds ? last + 1 : (unsigned)mpp_nfds) - first);
		return (int)syscall(SYS_close_range, first, last, flags);
	}
	return close_some(first, last, flags);
}

// pwritev2 with offset -1 writes at the file's position, which on a socket
// is a writev: with no flags it is one, gated as writev is. A flag
// (RWF_NOWAIT, RWF_DSYNC, ...) would change the call's meaning if held, so
// under a closed gate it passes behind the socket's held bytes
// (mpp_unheld). Any other offset is the kernel's ESPIPE on a socket.
static ssize_t pwritev2_at(ssize_t (*real)(int, const struct iovec *, int, off64_t, int), int fd,
			   const struct iovec *iov, int iovcnt, off64_t off, int flags)
{
	if (off != -1)
		return real(fd, iov, iovcnt, off, flags);
	if (flags == 0)
		return mpp_wrapped_writev(fd, iov, iovcnt); // gated as the writev it is
	if (!GATE_IS_OPEN())
		mpp_unheld(fd, "pwritev2 with flags", MPP_UNHELD_PWRITEV2);
	ssize_t r = real(fd, iov, iovcnt, off, flags);
	if (r >= 0 && iovcnt >= 0 && iovcnt <= IOV_MAX) {
		size_t want = 0;
		for (int i = 0; i < iovcnt; i++)
			want += iov[i].iov_len;
		mpp_note_short(fd, r, want);
	}
	return r;
}

EXPORT ssize_t pwritev2(int fd, const struct iovec *iov, int iovcnt, off_t off, int flags)
{
	if (!REAL_OPT(pwritev2)) {
		errno = ENOSYS;
		return -1;
	}
	return pwritev2_at((ssize_t(*)(int, const struct iovec *, int, off64_t, int))REAL(pwritev2), fd, iov, iovcnt,
			   off, flags);
}

EXPORT ssize_t pwritev64v2(int fd, const struct iovec *iov, int iovcnt, off64_t off, int flags)
{
	if (!REAL_OPT(pwritev64v2)) {
		errno = ENOSYS;
		return -1;
	}
	return pwritev2_at(REAL(pwritev64v2), fd, iov, iovcnt, off, flags);
}

// dprintf formats into a stream of glibc's own on the descriptor and writes
// it with glibc's internal write, which the gate never sees: under a gate
// that is not open the text is formatted here and written by the wrapped
// write, so it queues behind the socket's held bytes.
int __vasprintf_chk(char **, int, const char *, va_list);

static int print_gated(int fd, char *s, int n)
{
	int done = 0;
	while (n >= 0 && done < n) {
		// Through the wrapper: the text queues behind the held bytes.
		ssize_t w = mpp_wrapped_write(fd, s + done, (size_t)(n - done));
		if (w < 0 && errno == EINTR)
			continue;
		if (w <= 0) {
			done = -1;
			break;
		}
		done += (int)w;
	}
	int saved = errno;
	free(s);
	errno = saved;
	return n < 0 ? -1 : done;
}

EXPORT int vdprintf(int fd, const char *fmt, va_list ap)
{
	if (GATE_IS_OPEN() || !mpp_is_tcp(fd))
		return REAL(vdprintf)(fd, fmt, ap);
	char *s = NULL;
	int n = vasprintf(&s, fmt, ap);
	return print_gated(fd, s, n);
}

EXPORT int dprintf(int fd, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int r = vdprintf(fd, fmt, ap);
	va_end(ap);
	return r;
}

// The fortified entry points (_FORTIFY_SOURCE) keep their checks.
EXPORT int __vdprintf_chk(int fd, int flag, const char *fmt, va_list ap)
{
	if (GATE_IS_OPEN() || !mpp_is_tcp(fd)) {
		if (!REAL_OPT(vdprintf_chk))
			return REAL(vdprintf)(fd, fmt, ap);
		return REAL(vdprintf_chk)(fd, flag, fmt, ap);
	}
	char *s = NULL;
	int n = __vasprintf_chk(&s, flag, fmt, ap);
	return print_gated(fd, s, n);
}

EXPORT int __dprintf_chk(int fd, int flag, const char *fmt, ...)
{
	va_list ap;
	va_start(ap, fmt);
	int r = __vdprintf_chk(fd, flag, fmt, ap);
	va_end(ap);
	return r;
}

EXPORT void closefrom(int low)
{
	if ((low < 0 || close_range((unsigned)low, UINT_MAX, 0) < 0) && REAL_OPT(closefrom))
		REAL(closefrom)(low);
}

// stdio writes a socket stream's buffer with glibc's internal write, which
// the gate never sees: under a gate that is not open, fflush and fclose
// hand the buffer to the gate first, so it queues behind the held bytes.
// If the gate refuses it (the socket was shut down behind its held bytes:
// EPIPE, as the kernel will say), glibc must not write it either, or it
// would reach the kernel before the held bytes: the buffer is dropped and
// the stream marked in error, as the kernel's refusal leaves it unsent.
// Returns -1 with errno then, else 0.
static int buffered_to_gate(FILE *f)
{
	int fd = fileno_unlocked(f);
	size_t n = f->_IO_write_ptr - f->_IO_write_base, done = 0;
	if (fd < 0 || n == 0 || f->_IO_write_base == NULL || !mpp_is_tcp(fd))
		return 0;
	while (done < n) {
		struct taken t = {fd, f->_IO_write_base + done, n - done, 1};
		struct iovec v = {f->_IO_write_base + done, n - done};
		ssize_t r = mpp_gated(fd, &v, 1, MPP_CONSUMED, send_taken, &t);
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0) {
			int e = r < 0 ? errno : EIO;
			f->_IO_write_ptr = f->_IO_write_base;
			f->_flags |= _IO_ERR_SEEN;
			errno = e;
			return -1;
		}
		done += (size_t)r;
	}
	f->_IO_write_ptr = f->_IO_write_base;
	return 0;
}

EXPORT int fflush(FILE *f)
{
	if (GATE_IS_OPEN() || f == NULL)
		return REAL(fflush)(f);
	flockfile(f);
	int bad = buffered_to_gate(f);
	funlockfile(f);
	if (bad)
		return EOF;
	return REAL(fflush)(f);
}

// glibc 2.38 and later declare fclose's argument nonnull, and gcc then
// warns of the check: a program may pass NULL all the same, and the shim
// hands it to glibc untouched rather than dereference it.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wnonnull-compare"
#endif
EXPORT int fclose(FILE *f)
{
	if (GATE_IS_OPEN() || f == NULL)
		return REAL(fclose)(f);
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic pop
#endif
	flockfile(f);
	int bad = buffered_to_gate(f), err = errno;
	funlockfile(f);
	int fd = fileno(f), counted = 0;
	if (fd >= 0) {
		counted = mpp_stash_closing(fd);
		mpp_wait_close(fd);
		mpp_keep_held(fd);
	}
	int r = REAL(fclose)(f);
	int saved = bad ? err : errno;
	if (fd >= 0)
		mpp_stash_closed(fd, counted);
	errno = saved;
	return bad ? EOF : r;
}

// exec replaces the memory that holds the bytes: they go first.
static void before_exec(void)
{
	if (!GATE_IS_OPEN() && owner == getpid())
		mpp_gate_end("exec");
	// Stashed bytes cannot go back into the kernel: a socket that stays
	// open across the exec loses them, and the log says so.
	size_t lost = mpp_stash_exec_lost();
	if (lost > 0) {
		char m[160];
		int n = snprintf(m, sizeof(m), "mpipause: exec drops %zu received bytes the drain stashed for a socket that stays open\n", lost);
		if (n > 0) {
			ssize_t w = REAL(write)(2, m, (size_t)n);
			(void)w;
		}
	}
}

EXPORT int execve(const char *path, char *const argv[], char *const envp[])
{
	before_exec();
	return REAL(execve)(path, argv, envp);
}

EXPORT int execv(const char *path, char *const argv[])
{
	before_exec();
	return REAL(execv)(path, argv);
}

EXPORT int execvp(const char *file, char *const argv[])
{
	before_exec();
	return REAL(execvp)(file, argv);
}

EXPORT int execvpe(const char *file, char *const argv[], char *const envp[])
{
	before_exec();
	return REAL(execvpe)(file, argv, envp);
}

EXPORT int fexecve(int fd, char *const argv[], char *const envp[])
{
	before_exec();
	return REAL(fexecve)(fd, argv, envp);
}

EXPORT int execveat(int dirfd, const char *path, char *const argv[], char *const envp[], int flags)
{
	before_exec();
	if (!REAL_OPT(execveat)) {
		errno = ENOSYS; // a glibc older than 2.34
		return -1;
	}
	return REAL(execveat)(dirfd, path, argv, envp, flags);
}

// The execl family, which glibc builds on its internal execve: the list
// becomes an argv (and, for execle, the environment after its NULL).
#define ARGV_FROM_LIST(arg, ap, argv)                     \
	do {                                              \
		size_t n_ = 1;                            \
		va_list c_;                               \
		va_copy(c_, ap);                          \
		while (va_arg(c_, char *) != NULL)        \
			n_++;                             \
		va_end(c_);                               \
		argv = alloca((n_ + 1) * sizeof(char *)); \
		argv[0] = (char *)(arg);                  \
		for (size_t i_ = 1; i_ <= n_; i_++)       \
			argv[i_] = va_arg(ap, char *);    \
	} while (0)

EXPORT int execl(const char *path, const char *arg, ...)
{
	char **argv;
	va_list ap;
	va_start(ap, arg);
	ARGV_FROM_LIST(arg, ap, argv);
	va_end(ap);
	return execv(path, argv);
}

EXPORT int execlp(const char *file, const char *arg, ...)
{
	char **argv;
	va_list ap;
	va_start(ap, arg);
	ARGV_FROM_LIST(arg, ap, argv);
	va_end(ap);
	return execvp(file, argv);
}

EXPORT int execle(const char *path, const char *arg, ...)
{
	char **argv;
	char *const *envp;
	va_list ap;
	va_start(ap, arg);
	ARGV_FROM_LIST(arg, ap, argv);
	envp = va_arg(ap, char *const *);
	va_end(ap);
	return execve(path, argv, envp);
}
