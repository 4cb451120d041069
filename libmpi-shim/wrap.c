// SPDX-License-Identifier: Apache-2.0
//
// The wrapped send calls. Each one is the fast path of gate.c: load the
// gate; if open, make the real call and note whether it was short; else
// hand the call to mpp_gated with a thunk that makes it unchanged.
#include "shim.h"

#include <errno.h>
#include <limits.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <string.h>

struct send_args {
	int fd;
	const void *buf;
	size_t len;
	int flags;
	const struct sockaddr *to;
	socklen_t tolen;
};

static ssize_t do_send(void *a)
{
	struct send_args *x = a;
	return REAL(send)(x->fd, x->buf, x->len, x->flags);
}

static ssize_t do_sendto(void *a)
{
	struct send_args *x = a;
	return REAL(sendto)(x->fd, x->buf, x->len, x->flags, x->to, x->tolen);
}

static ssize_t do_write(void *a)
{
	struct send_args *x = a;
	return REAL(write)(x->fd, x->buf, x->len);
}

EXPORT ssize_t send(int fd, const void *buf, size_t len, int flags)
{
	if (GATE_IS_OPEN()) {
		ssize_t r = REAL(send)(fd, buf, len, flags);
		mpp_note_short(fd, r, len);
		return r;
	}
	struct send_args a = {fd, buf, len, flags, NULL, 0};
	struct iovec v = {(void *)buf, len};
	return mpp_gated(fd, &v, 1, flags, do_send, &a);
}

EXPORT ssize_t sendto(int fd, const void *buf, size_t len, int flags, const struct sockaddr *to, socklen_t tolen)
{
	if (GATE_IS_OPEN()) {
		ssize_t r = REAL(sendto)(fd, buf, len, flags, to, tolen);
		mpp_note_short(fd, r, len);
		return r;
	}
	struct send_args a = {fd, buf, len, flags, to, tolen};
	struct iovec v = {(void *)buf, len};
	return mpp_gated(fd, &v, 1, flags, do_sendto, &a);
}

EXPORT ssize_t write(int fd, const void *buf, size_t len)
{
	if (GATE_IS_OPEN()) {
		ssize_t r = REAL(write)(fd, buf, len);
		mpp_note_short(fd, r, len);
		return r;
	}
	struct send_args a = {fd, buf, len, 0, NULL, 0};
	struct iovec v = {(void *)buf, len};
	return mpp_gated(fd, &v, 1, 0, do_write, &a);
}

struct vec_args {
	int fd;
	const struct iovec *iov;
	int iovcnt;
	const struct msghdr *msg;
	int flags;
};

static ssize_t do_writev(void *a)
{
	struct vec_args *x = a;
	return REAL(writev)(x->fd, x->iov, x->iovcnt);
}

static ssize_t do_sendmsg(void *a)
{
	struct vec_args *x = a;
	return REAL(sendmsg)(x->fd, x->msg, x->flags);
}

static size_t iov_len(const struct iovec *iov, int n)
{
	size_t t = 0;
	for (int i = 0; i < n; i++)
		t += iov[i].iov_len;
	return t;
}

EXPORT ssize_t writev(int fd, const struct iovec *iov, int iovcnt)
{
	if (GATE_IS_OPEN()) {
		ssize_t r = REAL(writev)(fd, iov, iovcnt);
		if (r >= 0)
			mpp_note_short(fd, r, iov_len(iov, iovcnt));
		return r;
	}
	if (iovcnt < 0 || iovcnt > IOV_MAX)
		return REAL(writev)(fd, iov, iovcnt); // the kernel's EINVAL
	struct vec_args a = {fd, iov, iovcnt, NULL, 0};
	return mpp_gated(fd, iov, iovcnt, 0, do_writev, &a);
}

EXPORT ssize_t sendmsg(int fd, const struct msghdr *msg, int flags)
{
	if (GATE_IS_OPEN()) {
		ssize_t r = REAL(sendmsg)(fd, msg, flags);
		if (r >= 0)
			mpp_note_short(fd, r, iov_len(msg->msg_iov, msg->msg_iovlen));
		return r;
	}
	// Ancillary data (timestamping, ...) means something at the moment of
	// the call: it passes, behind what the socket has held.
	if (msg != NULL && msg->msg_controllen > 0)
		mpp_unheld(fd, "sendmsg with ancillary data", MPP_UNHELD_ANCILLARY);
	if (msg == NULL || msg->msg_controllen > 0 || msg->msg_iovlen > IOV_MAX)
		return REAL(sendmsg)(fd, msg, flags);
	struct vec_args a = {fd, msg->msg_iov, (int)msg->msg_iovlen, msg, flags};
	return mpp_gated(fd, msg->msg_iov, (int)msg->msg_iovlen, flags, do_sendmsg, &a);
}

// sendmmsg on a closed gate goes message by message through sendmsg's slow
// path, which keeps each message's call boundary; it stops at the first
// failure as the kernel does (an error only if nothing was sent).
EXPORT int sendmmsg(int fd, struct mmsghdr *vec, unsigned int vlen, int flags)
{
	if (GATE_IS_OPEN())
		return REAL(sendmmsg)(fd, vec, vlen, flags);
	if (vec == NULL)
		return REAL(sendmmsg)(fd, vec, vlen, flags);
	unsigned int i;
	for (i = 0; i < vlen; i++) {
		ssize_t r = sendmsg(fd, &vec[i].msg_hdr, flags);
		if (r < 0) {
			if (i == 0)
				return -1;
			break;
		}
		vec[i].msg_len = (unsigned int)r;
		if ((size_t)r < iov_len(vec[i].msg_hdr.msg_iov, vec[i].msg_hdr.msg_iovlen)) {
			i++;
			break;
		}
	}
	return (int)i;
}

// The aliases the shim calls where it means its own wrapper (shim.h).
extern __typeof__(write) mpp_wrapped_write __attribute__((alias("write")));
extern __typeof__(writev) mpp_wrapped_writev __attribute__((alias("writev")));

// close: with the gate open nothing is held anywhere (reopening flushes
// before it says open), so the fast path only forgets the fd's last call.
EXPORT int close(int fd)
{
	if ((unsigned)fd < (unsigned)mpp_nfds)
		mpp_fd_short[fd] = 0;        // the number's next socket starts at a boundary
	int counted = mpp_stash_closing(fd); // nor may it get this one's bytes
	mpp_wait_close(fd);
	int r = GATE_IS_OPEN() ? REAL(close)(fd) : mpp_close_held(fd);
	int saved = errno;
	mpp_stash_closed(fd, counted);
	errno = saved;
	return r;
}
extern __typeof__(close) mpp_wrapped_close __attribute__((alias("close")));

// The receive side is never gated. While the gate is not open (a pause
// draining), a read that got bytes asks the kernel to acknowledge at once
// (mpp_quickack, gate.c). Open gate: one load after the real call, nothing
// else.
#define RECEIVED(fd, r)                         \
	do {                                    \
		if (!GATE_IS_OPEN() && (r) > 0) \
			mpp_quickack(fd);       \
	} while (0)

// The reads. Fast path: the fd's busy count up, its slow flag loaded (see
// stash.c), the real call, the count down. A set flag sends the call to
// mpp_stash_read, which gives the stash first; rd_args and do_read make
// the application's call on what is left of its buffer.
static inline __attribute__((always_inline)) int read_enter(int fd)
{
	if ((unsigned)fd >= (unsigned)mpp_nfds || mpp_read_busy == NULL)
		return 1;
	atomic_fetch_add_explicit(&mpp_read_busy[fd], 1, memory_order_seq_cst);
	if (likely(atomic_load_explicit(&mpp_read_slow[fd], memory_order_seq_cst) == 0))
		return 1;
	atomic_fetch_sub_explicit(&mpp_read_busy[fd], 1, memory_order_release);
	return 0;
}

static inline __attribute__((always_inline)) void read_leave(int fd)
{
	if ((unsigned)fd < (unsigned)mpp_nfds && mpp_read_busy != NULL)
		atomic_fetch_sub_explicit(&mpp_read_busy[fd], 1, memory_order_release);
}

enum rd_kind {
	RD_RECV,
	RD_RECVFROM,
	RD_RECVMSG,
	RD_READ,
	RD_READV
};

struct rd_args {
	enum rd_kind kind;
	int fd, flags;
	struct sockaddr *from;
	socklen_t *fromlen;
	struct msghdr *msg;
};

static ssize_t do_read(void *a, const struct iovec *rest, int n)
{
	struct rd_args *x = a;
	void *b = n > 0 ? rest[0].iov_base : NULL;
	size_t l = n > 0 ? rest[0].iov_len : 0;
	switch (x->kind) {
	case RD_RECV:
		return REAL(recv)(x->fd, b, l, x->flags);
	case RD_RECVFROM:
		return REAL(recvfrom)(x->fd, b, l, x->flags, x->from, x->fromlen);
	case RD_READ:
		return REAL(read)(x->fd, b, l);
	case RD_READV:
		return REAL(readv)(x->fd, rest, n);
	case RD_RECVMSG: {
		struct msghdr m = *x->msg;
		m.msg_iov = (struct iovec *)rest;
		m.msg_iovlen = (size_t)n;
		ssize_t r = REAL(recvmsg)(x->fd, &m, x->flags);
		x->msg->msg_flags = m.msg_flags;
		x->msg->msg_namelen = m.msg_namelen;
		x->msg->msg_controllen = m.msg_controllen;
		return r;
	}
	}
	errno = EINVAL;
	return -1;
}

EXPORT ssize_t recv(int fd, void *buf, size_t len, int flags)
{
	if (read_enter(fd)) {
		ssize_t r = REAL(recv)(fd, buf, len, flags);
		read_leave(fd);
		RECEIVED(fd, r);
		return r;
	}
	struct rd_args a = {.kind = RD_RECV, .fd = fd, .flags = flags};
	struct iovec v = {buf, len};
	return mpp_stash_read(fd, &v, 1, flags, do_read, &a);
}

EXPORT ssize_t recvfrom(int fd, void *buf, size_t len, int flags, struct sockaddr *from, socklen_t *fromlen)
{
	if (read_enter(fd)) {
		ssize_t r = REAL(recvfrom)(fd, buf, len, flags, from, fromlen);
		read_leave(fd);
		RECEIVED(fd, r);
		return r;
	}
	// A connected TCP socket gives no source address: none from the stash.
	if (fromlen)
		*fromlen = 0;
	struct rd_args a = {.kind = RD_RECVFROM, .fd = fd, .flags = flags, .from = from, .fromlen = fromlen};
	struct iovec v = {buf, len};
	return mpp_stash_read(fd, &v, 1, flags, do_read, &a);
}

// A message may carry descriptors (SCM_RIGHTS), one of them of a socket
// whose stash holds bytes: its reads must get them first too.
#define ADOPT_RIGHTS(msg)                                                                                    \
	do {                                                                                                 \
		if (__builtin_expect((msg) != NULL && (msg)->msg_controllen >= sizeof(struct cmsghdr), 0)) { \
			int saved_ = errno;                                                                  \
			mpp_stash_adopt_rights(msg);                                                         \
			errno = saved_;                                                                      \
		}                                                                                            \
	} while (0)

EXPORT ssize_t recvmsg(int fd, struct msghdr *msg, int flags)
{
	if (read_enter(fd)) {
		ssize_t r = REAL(recvmsg)(fd, msg, flags);
		read_leave(fd);
		RECEIVED(fd, r);
		if (r >= 0)
			ADOPT_RIGHTS(msg);
		return r;
	}
	if (msg == NULL || msg->msg_iovlen > IOV_MAX)
		return REAL(recvmsg)(fd, msg, flags); // the kernel's error
	// What the stash gives carries no address and no ancillary data; a call
	// that reaches the kernel sets these again.
	msg->msg_flags = 0;
	msg->msg_namelen = 0;
	msg->msg_controllen = 0;
	struct rd_args a = {.kind = RD_RECVMSG, .fd = fd, .flags = flags, .msg = msg};
	return mpp_stash_read(fd, msg->msg_iov, (int)msg->msg_iovlen, flags, do_read, &a);
}

EXPORT ssize_t read(int fd, void *buf, size_t len)
{
	if (read_enter(fd)) {
		ssize_t r = REAL(read)(fd, buf, len);
		read_leave(fd);
		RECEIVED(fd, r);
		return r;
	}
	struct rd_args a = {.kind = RD_READ, .fd = fd};
	struct iovec v = {buf, len};
	return mpp_stash_read(fd, &v, 1, 0, do_read, &a);
}

EXPORT ssize_t readv(int fd, const struct iovec *iov, int iovcnt)
{
	if (read_enter(fd)) {
		ssize_t r = REAL(readv)(fd, iov, iovcnt);
		read_leave(fd);
		RECEIVED(fd, r);
		return r;
	}
	if (iovcnt < 0 || iovcnt > IOV_MAX)
		return REAL(readv)(fd, iov, iovcnt); // the kernel's EINVAL
	struct rd_args a = {.kind = RD_READV, .fd = fd};
	return mpp_stash_read(fd, iov, iovcnt, 0, do_read, &a);
}

// recvmmsg on a stashed fd gives the stash as one message: a later call
// gets what the kernel holds.
EXPORT int recvmmsg(int fd, struct mmsghdr *vec, unsigned int vlen, int flags, struct timespec *timeout)
{
	if (read_enter(fd)) {
		int r = REAL(recvmmsg)(fd, vec, vlen, flags, timeout);
		read_leave(fd);
		for (int i = 0; i < r; i++)
			ADOPT_RIGHTS(&vec[i].msg_hdr);
		return r;
	}
	if (vec == NULL || vlen == 0)
		return REAL(recvmmsg)(fd, vec, vlen, flags, timeout);
	ssize_t r = recvmsg(fd, &vec[0].msg_hdr, flags & ~MSG_WAITFORONE);
	if (r < 0)
		return -1;
	vec[0].msg_len = (unsigned int)r;
	return 1;
}

// The fortified entry points (_FORTIFY_SOURCE) call glibc's own read and
// recv, not the preloaded ones: they are wrapped too, with their check.
EXPORT ssize_t __read_chk(int fd, void *buf, size_t len, size_t buflen)
{
	if (len > buflen)
		__chk_fail();
	return read(fd, buf, len);
}

EXPORT ssize_t __recv_chk(int fd, void *buf, size_t len, size_t buflen, int flags)
{
	if (len > buflen)
		__chk_fail();
	return recv(fd, buf, len, flags);
}

EXPORT ssize_t __recvfrom_chk(int fd, void *buf, size_t len, size_t buflen, int flags, struct sockaddr *from,
			      socklen_t *fromlen)
{
	if (len > buflen)
		__chk_fail();
	return recvfrom(fd, buf, len, flags, from, fromlen);
}
