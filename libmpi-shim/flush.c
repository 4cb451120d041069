// SPDX-License-Identifier: Apache-2.0
//
// The way out of the send gate for what it holds: each socket's held bytes
// sent in order when the gate reopens, before any later send on that socket
// goes to the kernel (a send that arrives while its socket still has held
// bytes is appended to them); and sent before the process's memory goes
// (exit, exec). A close or a shutdown of a socket with held bytes waits for
// them here too: the kernel would have delivered bytes written before
// either, so the shim keeps them under a descriptor of its own, and sends
// the FIN after them. What is held, and how, is gate.c's.
//
// The flush runs on the thread that reopens (the shim's thread). mpid may
// write the gate word itself (the shared gate page, gateword.c): closed in a
// new generation, then flushing in that generation at resume, before it
// asks for the flush ("REOPEN <gen>"). The shim never reopens a gate of
// another generation than the one it was asked to, and a flush stops before
// its next send call when a newer close comes: a resume followed at once by a
// pause must not see the old resume's flush open the new pause's gate, nor
// send through it (send_all).
#include "shim.h"
#include "gate.h"

#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

// other_fd is a descriptor of s's socket other than except whose entry names
// s, checked with the kernel, or -1. Called with s->mu held.
static int other_fd(struct sock *s, int except)
{
	int hi;
	pthread_mutex_lock(&mpp_tab_mu);
	hi = mpp_tab_hi;
	pthread_mutex_unlock(&mpp_tab_mu);
	for (int i = 0; i < hi; i++)
		if (i != except && atomic_load_explicit(&mpp_fd_tab[i], memory_order_acquire) == s &&
		    mpp_sock_cookie(i) == s->cookie)
			return i;
	return -1;
}

// send_all writes b to fd, waiting for room when the socket is
// non-blocking, at most until deadline (CLOCK_MONOTONIC ms; 0: no limit).
// The urgent byte of an MSG_OOB call is the last one of the call, so such a
// chunk goes as its bytes and then its last byte alone with MSG_OOB. It
// returns 0, 1 if it stopped because the gate word is no longer word (a
// newer close; word -1: never stops), or -1 with errno when the connection
// failed or time ran out; *done (if not NULL) is the bytes the kernel took.
//
// The word is loaded before every send call, not once a chunk: a held
// chunk can be MiBs, and one send call takes up to a whole send buffer, so
// a flush that went on to the end of its chunk after mpid's close would
// hand the kernel MiBs under a closed gate (mpid fails such a pause after
// the freeze). A wait for room is cut into STOP_POLL_MS slices for the
// same reason: mpid writes the word without waking this thread, and a
// flush waiting on a peer that the pause's drain has yet to read would
// otherwise keep the rank's answer (this thread's) from mpid until it
// does.
#define STOP_POLL_MS 2
static int send_all(int fd, const char *b, size_t n, int oob, long long deadline, int word, size_t *done)
{
	size_t sent = 0;
	int rc = 0;

	while (n > 0) {
		if (word != -1 && atomic_load(&mpp_gate) != word) {
			rc = 1;
			break;
		}
		// A stoppable flush never sleeps inside a send call: on a blocking
		// socket one call would hand the kernel the whole chunk, whatever
		// the word says meanwhile.
		int fl = MSG_NOSIGNAL | (word != -1 ? MSG_DONTWAIT : 0);
		size_t want = n;
		if (oob && n > 1)
			want = n - 1;
		else if (oob)
			fl |= MSG_OOB;
		ssize_t r = REAL(send)(fd, b, want, fl);
		if (r > 0) {
			b += r;
			n -= r;
			sent += r;
			continue;
		}
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 && (errno == EAGAIN || errno == EWOULDBLOCK)) {
			struct pollfd p = {.fd = fd, .events = POLLOUT};
			int ms = word != -1 ? STOP_POLL_MS : -1;
			if (deadline) {
				long long left = deadline - mpp_now_ms();
				if (left <= 0) {
					errno = ETIMEDOUT;
					rc = -1;
					break;
				}
				if (ms < 0 || left < ms)
					ms = left > INT_MAX ? INT_MAX : (int)left;
			}
			REAL(poll)(&p, 1, ms);
			continue;
		}
		rc = -1;
		break;
	}
	if (done)
		*done = sent;
	return rc;
}

// mpp_send_all is send_all for a caller that took the bytes from their
// source already (sendfile from a pipe, splice): they must all go. Returns
// n, or -1 with errno.
ssize_t mpp_send_all(int fd, const void *b, size_t n)
{
	return send_all(fd, b, n, 0, 0, -1, NULL) < 0 ? -1 : (ssize_t)n;
}

long long mpp_now_ms(void)
{
	struct timespec t;
	clock_gettime(CLOCK_MONOTONIC, &t);
	return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}

// mpp_flush_fd sends the socket's held bytes in order. New sends to it, by any
// of its descriptors, are appended behind them meanwhile (s->flushing), so
// order holds. It stops before its next send call once the gate word is no
// longer word (a newer close; word -1: never): what is left, to the byte,
// stays held, the socket gated, for that pause's resume. While it runs it
// is counted in the state page (mpp_flush_begin): until its last send call
// has returned, mpid does not take the rank for quiet. Bytes go only to the
// socket they were held for: if the number names another one now, they are
// reported lost (mpp_gone), never sent there.
void mpp_flush_fd(struct sock *s, struct mpp_gate_stats *st, int word, long long deadline)
{
	struct mpp_page *counted;

	pthread_mutex_lock(&s->mu);
	// One flusher a socket: another sending the same chunk would send it
	// twice.
	while (s->flushing) {
		pthread_mutex_unlock(&s->mu);
		REAL(poll)(NULL, 0, 1);
		pthread_mutex_lock(&s->mu);
	}
	s->flushing = 1;
	counted = mpp_flush_begin();
	while (s->head) {
		struct held *h = s->head;
		size_t done = 0;
		int rc, err;

		if (word != -1 && atomic_load(&mpp_gate) != word)
			break;

		int to = s->fd; // read under the lock: a close may move it
		if (to < 0 || mpp_sock_cookie(to) != s->cookie) {
			// That descriptor went by a call the shim does not see:
			// another of the socket's, if it has one.
			to = other_fd(s, to);
			if (to >= 0)
				mpp_set_fd(s, to);
		}
		if (to < 0) {
			size_t n = mpp_gone(s);
			st->flush_errors++;
			st->flush_errno = EBADF;
			pthread_mutex_unlock(&s->mu);
			mpp_hold_release(n);
			pthread_mutex_lock(&s->mu);
			break;
		}
		pthread_mutex_unlock(&s->mu);
		rc = send_all(to, h->data + h->off, h->len - h->off, h->oob, deadline, word, &done);
		err = errno;
		pthread_mutex_lock(&s->mu);
		h->off += done;
		s->held -= done;
		if (s->held_from != MPP_SENT_UNKNOWN)
			s->held_from += done;
		st->flushed += done;
		mpp_hold_release(done);
		if (rc > 0) {
			// Published before mpp_flush_end uncounts the flush: a
			// page that says no flush runs says what it left held.
			mpp_publish(s);
			break;
		}
		if (rc < 0) {
			st->flush_errors++;
			st->flush_errno = err;
			s->held -= h->len - h->off;
			mpp_hold_release(h->len - h->off);
		}
		s->head = h->next;
		if (!s->head)
			s->tail = NULL;
		mpp_publish(s);
		mpp_held_free(h);
	}
	s->flushing = 0;
	mpp_flush_end(counted);
	if (s->head) {
		// Stopped by a newer close: still gated, the rest held.
		mpp_publish(s);
		pthread_mutex_unlock(&s->mu);
		return;
	}
	s->gated = 0;
	if (s->shut) {
		// The shutdown the application asked for, after its bytes.
		s->shut = 0;
		if (s->fd >= 0 && REAL(shutdown)(s->fd, SHUT_WR) < 0 && errno != ENOTCONN) {
			st->flush_errors++;
			st->flush_errno = errno;
		}
	}
	mpp_publish(s);
	if (s->orphan) {
		// Delivered what the application wrote before it closed: now the
		// close it asked for, and the slot is free again.
		int keep = s->fd;
		s->orphan = 0;
		mpp_set_fd(s, -1);
		pthread_mutex_lock(&mpp_tab_mu);
		mpp_bind_fd(keep, NULL);
		pthread_mutex_unlock(&mpp_tab_mu);
		REAL(close)(keep);
	}
	pthread_mutex_unlock(&s->mu);
}

// now_flushing follows the gate word's move to flushing word f: the state
// page shows it, and senders waiting for room (hold_room) go on.
static void now_flushing(int f)
{
	mpp_publish_gate(f);
	mpp_hold_wake();
}

// mpp_gate_flushing is the first half of reopening the gate closed in
// generation gen (-1: the current one): from here on a send goes straight
// to the kernel unless its socket still has held bytes, which it then
// queues behind. It returns the flushing word for mpp_gate_flush, or -1 if
// the gate is open or belongs to another generation: nothing to do.
int mpp_gate_flushing(long gen)
{
	int w = atomic_load_explicit(&mpp_gate, memory_order_acquire), f;
	for (;;) {
		if (w == GATE_OPEN || (gen >= 0 && GATE_GEN(w) != ((unsigned long)gen & GATE_GEN_MASK)))
			return -1;
		f = GATE_WORD(GATE_FLUSHING, GATE_GEN(w));
		if (w == f || atomic_compare_exchange_weak_explicit(&mpp_gate, &w, f, memory_order_acq_rel,
								    memory_order_acquire))
			break;
	}
	now_flushing(f);
	return f;
}

// mpp_gate_flush is the second half: send what was held, in order, then
// open the gate, unless a newer close came meanwhile.
void mpp_gate_flush(struct mpp_gate_stats *st, int word)
{
	memset(st, 0, sizeof(*st));
	for (int fd = 0; fd < mpp_nfds; fd++) {
		struct sock *s = atomic_load_explicit(&mpp_fd_tab[fd], memory_order_acquire);
		if (s)
			mpp_flush_fd(s, st, word, 0);
	}
	if (atomic_compare_exchange_strong_explicit(&mpp_gate, &word, GATE_OPEN, memory_order_acq_rel,
						    memory_order_acquire))
		mpp_publish_gate(GATE_OPEN);
}

// mpp_gate_open opens the gate whatever its state and generation, every
// held byte sent first: the "OPEN" request, and the way out when mpid is
// gone or MPI is finalizing.
void mpp_gate_open(struct mpp_gate_stats *st)
{
	int w = atomic_load_explicit(&mpp_gate, memory_order_acquire);
	int f = GATE_WORD(GATE_FLUSHING, GATE_GEN(w));
	atomic_store_explicit(&mpp_gate, f, memory_order_release);
	now_flushing(f);
	mpp_gate_flush(st, f);
}

// mpp_keep_held is called before the application's fd goes (close, dup2
// over fd, close_range, fclose): the kernel would deliver bytes written
// before a close, so the shim must too. If fd is the descriptor its
// socket's held bytes go to, they move to another descriptor of the socket
// the application still has, or else to a descriptor of the shim's own (a
// dup, so the application's number is free for reuse at once), which the
// reopen flushes and then closes. It returns that dup, or -1: nothing was
// held, another descriptor has them, or they went now, when no descriptor
// was left to keep them under.
int mpp_keep_held(int fd)
{
	struct sock *s;
	int keep;

	if ((unsigned)fd >= (unsigned)mpp_nfds || !(s = atomic_load_explicit(&mpp_fd_tab[fd], memory_order_acquire)))
		return -1;
	pthread_mutex_lock(&s->mu);
	if (s->fd == fd && (keep = other_fd(s, fd)) >= 0)
		mpp_set_fd(s, keep);
	if (s->fd != fd || (!s->head && !s->flushing && !s->shut)) {
		if (s->fd == fd)
			mpp_set_fd(s, -1);
		pthread_mutex_lock(&mpp_tab_mu);
		mpp_bind_fd(fd, NULL);
		pthread_mutex_unlock(&mpp_tab_mu);
		pthread_mutex_unlock(&s->mu);
		return -1;
	}
	// Through the wrapper: the dup is a new descriptor of the socket, which
	// the drain must count and a stash holding bytes attach, as it does any
	// other (stash.c).
	keep = mpp_wrapped_fcntl(fd, F_DUPFD_CLOEXEC, 0);
	if (keep < 0 || keep >= mpp_nfds) {
		// No descriptor to keep it under: the held bytes go now.
		pthread_mutex_unlock(&s->mu);
		if (keep >= 0)
			REAL(close)(keep);
		struct mpp_gate_stats st = {0};
		mpp_flush_fd(s, &st, -1, 0);
		return -1;
	}
	pthread_mutex_lock(&mpp_tab_mu);
	mpp_bind_fd(keep, s);
	mpp_bind_fd(fd, NULL);
	pthread_mutex_unlock(&mpp_tab_mu);
	mpp_set_fd(s, keep);
	mpp_page_clear(fd);
	s->orphan = 1;
	mpp_fd_short[keep] = 0;
	pthread_mutex_unlock(&s->mu);
	return keep;
}

// mpp_kept reports whether fd is one of the shim's own descriptors that
// keep a closed socket's held bytes (close_range must leave it open).
int mpp_kept(int fd)
{
	struct sock *s;
	if ((unsigned)fd >= (unsigned)mpp_nfds || !(s = atomic_load_explicit(&mpp_fd_tab[fd], memory_order_acquire)))
		return 0;
	pthread_mutex_lock(&s->mu);
	int k = s->orphan && s->fd == fd;
	pthread_mutex_unlock(&s->mu);
	return k;
}

// mpp_kept_in writes the shim's dups (mpp_kept) numbered first..last to
// out, at most max, in ascending order, and returns how many.
int mpp_kept_in(unsigned first, unsigned last, int *out, int max)
{
	int n = 0;
	pthread_mutex_lock(&mpp_tab_mu);
	int hi = mpp_tab_hi;
	pthread_mutex_unlock(&mpp_tab_mu);
	for (int fd = (int)first; fd < hi && (unsigned)fd <= last && n < max; fd++)
		if (mpp_kept(fd))
			out[n++] = fd;
	return n;
}

// mpp_close_held is close() under a gate that is not open.
int mpp_close_held(int fd)
{
	mpp_keep_held(fd);
	return REAL(close)(fd);
}

// mpp_defer_shutdown is shutdown(fd, SHUT_WR) while fd's socket has held bytes: the
// FIN must follow them, so it is sent by the flush, after the last one.
// Returns 1 if deferred, 0 if nothing is held (the shutdown goes now).
int mpp_defer_shutdown(int fd)
{
	struct sock *s = mpp_sock_of(fd, mpp_sock_cookie(fd), 0);
	if (!s)
		return 0;
	pthread_mutex_lock(&s->mu);
	int defer = s->head || s->flushing;
	if (defer)
		s->shut = 1;
	pthread_mutex_unlock(&s->mu);
	return defer;
}

// mpp_gate_end sends every held byte now, whatever the gate, before the
// process's memory goes (exit, exec): the kernel would have delivered
// bytes written before either. A peer that reads nothing for
// MPIPAUSE_END_FLUSH_MS (10 s) loses what is left, and stderr says so.
void mpp_gate_end(const char *why)
{
	struct mpp_gate_stats st;
	const char *e = getenv("MPIPAUSE_END_FLUSH_MS");
	long ms = e && atol(e) > 0 ? atol(e) : 10000;
	size_t before;

	before = mpp_held_total();
	if (before == 0)
		return;
	memset(&st, 0, sizeof(st));
	long long deadline = mpp_now_ms() + ms;
	for (int fd = 0; fd < mpp_nfds; fd++) {
		struct sock *s = atomic_load_explicit(&mpp_fd_tab[fd], memory_order_acquire);
		if (s)
			mpp_flush_fd(s, &st, -1, deadline);
	}
	if (st.flush_errors && !getenv("MPIPAUSE_QUIET"))
		fprintf(stderr, "mpipause: at %s, %u held sends could not be delivered (%s)\n", why, st.flush_errors,
			strerror(st.flush_errno));
}
