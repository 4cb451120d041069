// SPDX-License-Identifier: Apache-2.0
//
// callcost: the CPU cost of the socket calls an MPI library makes per
// message, for the overhead benchmark (BenchmarkOverhead/calls). It runs
// with and without libmpipause.so preloaded and inside a cgroup the BPF
// programs watch or not, so that the difference is what the shim's wrappers
// and the sockstat tracepoint programs add to one call.
//
// Usage: callcost [-n pairs] [-p polls] [-c cpu] [-M] [-U]
//   -n pairs  8-byte send + recv pairs over a loopback TCP connection
//   -p polls  recv calls on an empty non-blocking socket (EAGAIN); as
//             many epoll_wait(.., 0) calls on an idle epoll set, the call
//             UCX's progress loop makes while it waits for a message; and
//             as many poll(.., 10) calls on a readable socket, a blocking
//             wait that returns at once
//   -c cpu    run on that CPU only (sched_setaffinity) from the first
//             socket on: a thread that moves between CPUs, or whose
//             loopback softirq lands on another one, varies its time per
//             call by +-10% run to run; pinned, by +-0.3%
//   -M        (callcost.mpich only) MPI_Init first, MPI_Finalize last: with
//             the shim preloaded the process registers with the node's mpid
//             as a rank does, and measures in that state (gate open)
//   -U        if LD_PRELOAD is set, drop it and exec this program again,
//             before anything else: under `mpipause run` the shim's
//             constructor has then moved the process into its job's cgroup
//             (watched by the BPF programs), and the measurement runs there
//             without the shim
// Prints one line: "callcost pair_ns=<per send+recv> poll_ns=<per recv>
// epoll_ns=<per epoll_wait> wait_ns=<per poll> shim=<0|1> shimlib=<path|->
// cgroup=<path>", shim=1 when libmpipause.so is loaded, shimlib the file it
// was loaded from, cgroup the process's cgroup v2 path (the benchmark checks
// all three: a mode that quietly lost the shim or its cgroup would measure
// nothing, and one that loaded another build of the shim than the one it
// names would measure the wrong one).
//
// Times are the thread's CPU time (CLOCK_THREAD_CPUTIME_ID), not wall time:
// on a shared machine a preemption lands in wall time and not here. The
// loopback receive path runs in the sender's softirq, in this thread, so a
// pair's time includes the whole way of the bytes through TCP and any
// BPF program the kernel runs on it.
#define _GNU_SOURCE // sched_setaffinity, CPU_SET, dladdr
#include <dlfcn.h>
#include <errno.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/epoll.h>
#include <sys/socket.h>
#include <time.h>
#include <unistd.h>

#ifdef CALLCOST_MPI
#include <mpi.h>
#endif

static void die(const char *what)
{
	perror(what);
	exit(1);
}

static double cpu_ns(void)
{
	struct timespec ts;
	clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
	return ts.tv_sec * 1e9 + ts.tv_nsec;
}

// tcp_pair connects two TCP sockets over 127.0.0.1, Nagle off on both, as
// MPI libraries set them.
static void tcp_pair(int fd[2])
{
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t alen = sizeof(a);
	int one = 1, l = socket(AF_INET, SOCK_STREAM, 0);
	if (l < 0 || bind(l, (struct sockaddr *)&a, sizeof(a)) < 0 || listen(l, 1) < 0 ||
	    getsockname(l, (struct sockaddr *)&a, &alen) < 0)
		die("listen");
	fd[0] = socket(AF_INET, SOCK_STREAM, 0);
	if (fd[0] < 0 || connect(fd[0], (struct sockaddr *)&a, sizeof(a)) < 0)
		die("connect");
	fd[1] = accept(l, NULL, NULL);
	if (fd[1] < 0)
		die("accept");
	close(l);
	for (int i = 0; i < 2; i++)
		if (setsockopt(fd[i], IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one)) < 0)
			die("TCP_NODELAY");
}

// cgroup_path is the process's cgroup v2 path ("0::<path>" in
// /proc/self/cgroup), or "?".
static void cgroup_path(char *out, size_t n)
{
	char line[4096];
	FILE *f = fopen("/proc/self/cgroup", "r");
	snprintf(out, n, "?");
	if (!f)
		return;
	while (fgets(line, sizeof(line), f))
		if (strncmp(line, "0::", 3) == 0) {
			line[strcspn(line, "\n")] = 0;
			snprintf(out, n, "%s", line + 3);
		}
	fclose(f);
}

int main(int argc, char **argv)
{
	long pairs = 100000, polls = 400000;
	int c, fd[2], mpi = 0, cpu = -1;
	char buf[8] = {0}, cg[4096];

	// -U first, before MPI_Init or any socket.
	for (int i = 1; i < argc; i++)
		if (strcmp(argv[i], "-U") == 0 && getenv("LD_PRELOAD")) {
			unsetenv("LD_PRELOAD");
			execv("/proc/self/exe", argv);
			die("exec without LD_PRELOAD");
		}
	while ((c = getopt(argc, argv, "n:p:c:MU")) != -1) {
		switch (c) {
		case 'c':
			cpu = atoi(optarg);
			break;
		case 'M':
#ifndef CALLCOST_MPI
			fprintf(stderr, "callcost: -M needs the MPI build (callcost.mpich)\n");
			return 2;
#endif
			mpi = 1;
			break;
		case 'U':
			break;
		case 'n':
			pairs = atol(optarg);
			break;
		case 'p':
			polls = atol(optarg);
			break;
		default:
			fprintf(stderr, "usage: callcost [-n pairs] [-p polls] [-c cpu] [-M] [-U]\n");
			return 2;
		}
	}
	if (pairs < 1 || polls < 1) {
		fprintf(stderr, "callcost: -n and -p must be positive\n");
		return 2;
	}
#ifdef CALLCOST_MPI
	if (mpi)
		MPI_Init(&argc, &argv);
#else
	(void)mpi;
#endif
	if (cpu >= 0) {
		cpu_set_t set;
		CPU_ZERO(&set);
		CPU_SET(cpu, &set);
		if (sched_setaffinity(0, sizeof(set), &set) < 0)
			die("sched_setaffinity");
	}
	tcp_pair(fd);

	// Warm up: the first calls fault in pages and make the BPF programs
	// adopt the connection (a conns entry, or a foreign mark).
	for (int i = 0; i < 1000; i++) {
		if (send(fd[i & 1], buf, 8, 0) != 8 || recv(fd[!(i & 1)], buf, 8, MSG_WAITALL) != 8)
			die("warm-up");
	}

	// Each direction in turn, so both sockets send and receive.
	double t0 = cpu_ns();
	for (long i = 0; i < pairs; i++) {
		int s = i & 1;
		if (send(fd[s], buf, 8, 0) != 8)
			die("send");
		if (recv(fd[!s], buf, 8, MSG_WAITALL) != 8)
			die("recv");
	}
	double pair = (cpu_ns() - t0) / pairs;

	t0 = cpu_ns();
	for (long i = 0; i < polls; i++) {
		if (recv(fd[1], buf, 8, MSG_DONTWAIT) != -1 || errno != EAGAIN)
			die("recv on an empty socket did not say EAGAIN");
	}
	double rpoll = (cpu_ns() - t0) / polls;

	struct epoll_event ev = {.events = EPOLLIN}, got[8];
	int ep = epoll_create1(EPOLL_CLOEXEC);
	if (ep < 0 || epoll_ctl(ep, EPOLL_CTL_ADD, fd[1], &ev) < 0)
		die("epoll");
	t0 = cpu_ns();
	for (long i = 0; i < polls; i++) {
		if (epoll_wait(ep, got, 8, 0) != 0)
			die("epoll_wait on an idle set did not say 0");
	}
	double epoll = (cpu_ns() - t0) / polls;
	close(ep);

	// fd[1] readable (8 bytes queued, left there): poll returns at once.
	if (send(fd[0], buf, 8, 0) != 8)
		die("send");
	struct pollfd pfd = {.fd = fd[1], .events = POLLIN};
	if (poll(&pfd, 1, 1000) != 1)
		die("poll");
	t0 = cpu_ns();
	for (long i = 0; i < polls; i++) {
		if (poll(&pfd, 1, 10) != 1)
			die("poll on a readable socket did not say 1");
	}
	double wait = (cpu_ns() - t0) / polls;
	if (recv(fd[1], buf, 8, MSG_WAITALL) != 8)
		die("recv");

	close(fd[0]);
	close(fd[1]);
#ifdef CALLCOST_MPI
	if (mpi)
		MPI_Finalize();
#endif
	cgroup_path(cg, sizeof(cg));
	void *gate = dlsym(RTLD_DEFAULT, "mpipause_gate_state");
	Dl_info shim = {0};
	if (gate == NULL || dladdr(gate, &shim) == 0 || shim.dli_fname == NULL)
		shim.dli_fname = "-";
	printf("callcost pair_ns=%.1f poll_ns=%.1f epoll_ns=%.1f wait_ns=%.1f shim=%d shimlib=%s cgroup=%s\n", pair, rpoll,
	       epoll, wait, gate != NULL, shim.dli_fname, cg);
	return 0;
}
