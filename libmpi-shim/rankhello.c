// SPDX-License-Identifier: Apache-2.0
//
// The two lines a rank introduces itself to mpid with. The HELLO registers
// it on the rank channel (rankchan.c) after MPI_Init, from what mpi.c
// learnt there; its values are made tokens a line can carry, whatever the
// host or the environment named. The JOIN comes earlier, from the
// library's constructor, on a connection of its own: a rank of a job that
// names itself (MPIPAUSE_JOBID) asks mpid once to move it into the job's
// cgroup (mpp_rankch_join), because the kernel charges a socket to the
// cgroup of the process that creates it, at creation, for good, and mpid
// watches a job's sockets by cgroup, so a rank must be in the job's cgroup
// before MPI_Init opens its sockets.
//
// Both lines are listed, with the rest of the channel's, in
// internal/ranks/doc.go.
#include "shim.h"
#include "rankchan.h"

#include <errno.h>
#include <poll.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <time.h>
#include <unistd.h>

// mpp_hello_value: a value of the HELLO is one token without ',' or '='
// (the hosts list's separator, the fields'), whatever the host or the
// environment named.
void mpp_hello_value(char *s)
{
	for (; *s; s++)
		if (*s <= ' ' || *s == ',' || *s == '=')
			*s = '_';
}

// put appends v (at most max bytes; -1: all of it) at n of the line b,
// made a value the line can carry; the line's new length.
static int put(char *b, size_t len, int n, const char *v, int max)
{
	int at = n;
	n += snprintf(b + n, len - n, "%.*s", max, v);
	mpp_hello_value(b + at);
	return n;
}

// HELLO_ROOM holds a HELLO without its hosts list: the id, the numbers, two
// host names and the key.
#define HELLO_ROOM (256 + 2 * MPP_HOST_MAX + MPP_KEY_MAX)

// mpp_rankch_start registers this rank with what mpi.c learnt at MPI_Init:
//   HELLO 2 job=<id> rank=<r> size=<n> pid=<pid> tstp=<hex> host=<name>[ key=<job key>][ root=<h>][ hosts=<h0,h1,...>]
// (tstp: where the shim's SIGTSTP handler begins, mpp_tstp_entry; hosts:
// rank 0's list of the distinct hosts, in rank order of first appearance). Without h, the MPI library's ABI is unknown and the HELLO
// says only that much: the rank is still gateable.
void mpp_rankch_start(const struct mpp_hello *h)
{
	char small[HELLO_ROOM], *line = small;
	size_t len = sizeof(small);
	const char *key = mpp_job_key();
	int n;

	if (!h) {
		mpp_rankch_open("HELLO 2 job=unknown rank=-1 size=0\n");
		return;
	}
	if (h->hosts) {
		// Room for every host: a truncated list would leave nodes out of
		// every pause (mpid would refuse, short of ranks).
		size_t big = sizeof(small) + (size_t)h->size * (MPP_HOST_MAX + 1);
		char *b = malloc(big);
		if (b)
			line = b, len = big;
	}
	n = snprintf(line, len, "HELLO 2 job=");
	n = put(line, len, n, h->job, -1);
	n += snprintf(line + n, len - n, " rank=%d size=%d pid=%d tstp=%lx host=", h->rank, h->size, (int)getpid(),
		      (unsigned long)mpp_tstp_entry());
	n = put(line, len, n, h->host, -1);
	if (key)
		n += snprintf(line + n, len - n, " key=%s", key);
	if (h->root[0]) {
		n += snprintf(line + n, len - n, " root=");
		n = put(line, len, n, h->root, -1);
	}
	if (h->hosts) {
		n += snprintf(line + n, len - n, " hosts=");
		int first = 1;
		for (int i = 0; i < h->size && (size_t)n < len - MPP_HOST_MAX - 2; i++) {
			const char *x = h->hosts + (size_t)i * MPP_HOST_MAX;
			int seen = 0;
			for (int j = 0; j < i && !seen; j++)
				seen = strncmp(x, h->hosts + (size_t)j * MPP_HOST_MAX, MPP_HOST_MAX) == 0;
			if (seen)
				continue;
			if (!first)
				n += snprintf(line + n, len - n, ",");
			n = put(line, len, n, x, MPP_HOST_MAX);
			first = 0;
		}
	}
	snprintf(line + n, len - n, "\n");
	mpp_rankch_open(line);
	if (line != small)
		free(line);
}

// mpp_valid_jobid: a job id is one token of 1 to MPP_JOBID_MAX printable
// ASCII characters other than '=', ',' and '/', and not "." or "..": the
// rule of internal/jobid.Valid (',' because HELLO turns it into '_',
// '/' and the dot names because the id names a cgroup directory).
int mpp_valid_jobid(const char *id)
{
	size_t n = 0;

	if (!strcmp(id, ".") || !strcmp(id, ".."))
		return 0;
	for (; id[n]; n++) {
		unsigned char c = (unsigned char)id[n];
		if (n >= MPP_JOBID_MAX || c <= ' ' || c >= 0x7f || c == '=' || c == ',' || c == '/')
			return 0;
	}
	return n > 0;
}

// mpp_job_key is the job key the launcher gave this rank (MPIPAUSE_JOBKEY:
// a secret that makes mpid let the rank into its job; docs/security.md),
// or NULL if there is none or it could not travel in a line (1 to
// MPP_KEY_MAX printable characters, no spaces, no '=').
const char *mpp_job_key(void)
{
	const char *k = getenv("MPIPAUSE_JOBKEY");
	size_t n = 0;

	if (!k)
		return NULL;
	for (; k[n]; n++) {
		unsigned char c = (unsigned char)k[n];
		if (n >= MPP_KEY_MAX || c <= ' ' || c >= 0x7f || c == '=')
			return NULL;
	}
	return n > 0 ? k : NULL;
}

// mpp_join_line writes "JOIN 2 job=<id> pid=<pid> key=<key>\n" into b and
// returns its length; -1 if id is not a valid job id, there is no key or b
// is too small.
int mpp_join_line(char *b, size_t n, const char *id, long pid, const char *key)
{
	if (!id || !mpp_valid_jobid(id) || pid <= 0 || !key)
		return -1;
	int r = snprintf(b, n, "JOIN 2 job=%s pid=%ld key=%s\n", id, pid, key);
	return r > 0 && (size_t)r < n ? r : -1;
}

// ms_left is what remains of a deadline on CLOCK_MONOTONIC, in ms (>= 0).
static int ms_left(const struct timespec *end)
{
	struct timespec now;
	clock_gettime(CLOCK_MONOTONIC, &now);
	long ms = (end->tv_sec - now.tv_sec) * 1000 + (end->tv_nsec - now.tv_nsec) / 1000000;
	return ms < 0 ? 0 : (ms > JOIN_TIMEOUT_MAX_S * 1000 ? JOIN_TIMEOUT_MAX_S * 1000 : (int)ms);
}

// join_timeout_s is how long the JOIN waits for mpid's answer, in seconds.
// The first JOIN of a job on a node has mpid load the job's BPF programs
// before it answers, so that no socket of the rank is made unseen: tens of
// ms on a node, over 2 s on a VM under software emulation (docs/vagrant.md).
static int join_timeout_s(void)
{
	const char *v = getenv("MPIPAUSE_JOIN_TIMEOUT");
	char *end;
	long s;

	if (!v || !*v)
		return JOIN_TIMEOUT_S;
	errno = 0;
	s = strtol(v, &end, 10);
	if (errno || *end || s < 1 || s > JOIN_TIMEOUT_MAX_S) {
		char msg[160];
		snprintf(msg, sizeof(msg), "MPIPAUSE_JOIN_TIMEOUT=%.32s is not a number of seconds from 1 to %d; waiting %d s",
			 v, JOIN_TIMEOUT_MAX_S, JOIN_TIMEOUT_S);
		mpp_rankch_warn("mpipause: %s\n", msg);
		return JOIN_TIMEOUT_S;
	}
	return (int)s;
}

// wait_fd polls fd for ev until the deadline: 1 ready, 0 timed out, -1 error.
static int wait_fd(int fd, short ev, const struct timespec *end)
{
	for (;;) {
		struct pollfd p = {.fd = fd, .events = ev};
		int r = REAL(poll)(&p, 1, ms_left(end));
		if (r < 0 && errno == EINTR)
			continue;
		if (r <= 0)
			return r;
		return (p.revents & ev) ? 1 : ((p.revents & (POLLERR | POLLHUP | POLLNVAL)) ? -1 : 0);
	}
}

// join asks mpid at a to move this process into the job's cgroup. It
// returns 0 on OK, else -1 with why (one line, no newline) in why.
static int join(const char *line, const struct sockaddr_un *a, socklen_t al, const char *name, char *why, size_t wn)
{
	struct timespec end;
	struct ucred cr;
	socklen_t cl = sizeof(cr);
	char reply[256];
	size_t have = 0, len = strlen(line), sent = 0;
	int fd, rc = -1, timeout = join_timeout_s();

	clock_gettime(CLOCK_MONOTONIC, &end);
	end.tv_sec += timeout;
	// Non-blocking throughout: connect to a listener whose backlog is full
	// would otherwise block without bound.
	fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC | SOCK_NONBLOCK, 0);
	if (fd < 0) {
		snprintf(why, wn, "no socket: %s", strerror(errno));
		return -1;
	}
	if (connect(fd, (const struct sockaddr *)a, al) < 0) {
		snprintf(why, wn, "nothing answers at %s: %s", name, strerror(errno));
		goto out;
	}
	if (getsockopt(fd, SOL_SOCKET, SO_PEERCRED, &cr, &cl) < 0 || (cr.uid != 0 && cr.uid != getuid())) {
		snprintf(why, wn, "%s is not served by root or by this user", name);
		goto out;
	}
	while (sent < len) {
		ssize_t r = REAL(send)(fd, line + sent, len - sent, MSG_NOSIGNAL);
		if (r > 0) {
			sent += (size_t)r;
			continue;
		}
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 && errno == EAGAIN && wait_fd(fd, POLLOUT, &end) > 0)
			continue;
		snprintf(why, wn, "mpid at %s did not take the request", name);
		goto out;
	}
	for (;;) {
		char *nl = memchr(reply, '\n', have);
		if (nl) {
			*nl = 0;
			break;
		}
		if (have == sizeof(reply) - 1) {
			snprintf(why, wn, "mpid at %s answered a line too long", name);
			goto out;
		}
		ssize_t r = REAL(recv)(fd, reply + have, sizeof(reply) - 1 - have, 0);
		if (r > 0) {
			have += (size_t)r;
			continue;
		}
		if (r < 0 && errno == EINTR)
			continue;
		if (r < 0 && errno == EAGAIN) {
			int w = wait_fd(fd, POLLIN, &end);
			if (w > 0)
				continue;
			if (w == 0) {
				snprintf(why, wn, "no answer from mpid at %s within %d s", name, timeout);
				goto out;
			}
		}
		snprintf(why, wn, "mpid at %s closed the connection without an answer", name);
		goto out;
	}
	// What mpid says is printed: keep it to printable characters.
	for (char *p = reply; *p; p++)
		if ((unsigned char)*p < ' ' || (unsigned char)*p == 0x7f)
			*p = '?';
	if (strcmp(reply, "OK") == 0)
		rc = 0;
	else if (strncmp(reply, "ERR ", 4) == 0)
		snprintf(why, wn, "mpid at %s refused: %s", name, reply + 4);
	else
		snprintf(why, wn, "mpid at %s answered %.64s", name, reply);
out:
	REAL(close)(fd);
	return rc;
}

// mpp_rankch_join runs from the library's constructor: a rank of a job named
// by MPIPAUSE_JOBID asks the node's mpid to move it into the job's cgroup
// before it creates any socket. No mpid, no answer in time, or a
// refusal: one warning line, and the process goes on as it would have.
void mpp_rankch_join(void)
{
	const char *id = getenv("MPIPAUSE_JOBID");
	const char *key = mpp_job_key();
	char line[MPP_JOBID_MAX + MPP_KEY_MAX + 56], why[320];
	struct sockaddr_un a;
	const char *name;
	int saved = errno;

	if (!id || !*id || !mpp_is_rank())
		return;
	if (!key) {
		mpp_rankch_warn("mpipause: this rank has no job key (MPIPAUSE_JOBKEY): launch the job with `mpipause run`; "
				"this rank could not join its job's cgroup, so %s\n",
				"the job will not be pausable cleanly");
		goto out;
	}
	if (mpp_join_line(line, sizeof(line), id, (long)getpid(), key) < 0) {
		mpp_rankch_warn("mpipause: MPIPAUSE_JOBID is not a valid job id (1 to 128 printable characters, no spaces, no '='); "
				"this rank could not join its job's cgroup, so %s\n",
				"the job will not be pausable cleanly");
		goto out;
	}
	socklen_t al = mpp_rankch_addr(&a, &name);
	if (join(line, &a, al, name, why, sizeof(why)) < 0)
		mpp_rankch_warn("mpipause: this rank could not join its job's cgroup (%s); the job will not be pausable cleanly\n",
				why);
out:
	errno = saved;
}
