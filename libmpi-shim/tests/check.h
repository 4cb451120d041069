// SPDX-License-Identifier: Apache-2.0
//
// What the shim's C tests share: the check that reports and ends a test,
// a loopback TCP pair, and what the kernel says of a buffer's pages.
#ifndef MPIPAUSE_TEST_CHECK_H
#define MPIPAUSE_TEST_CHECK_H

#include <netinet/in.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

static int failures __attribute__((unused));
#define CHECK(cond, ...)                                                                \
	do {                                                                            \
		if (!(cond)) {                                                          \
			fprintf(stderr, "FAIL %s:%d: %s: ", __FILE__, __LINE__, #cond); \
			fprintf(stderr, __VA_ARGS__);                                   \
			fprintf(stderr, "\n");                                          \
			failures++;                                                     \
			return;                                                         \
		}                                                                       \
	} while (0)

static void die(const char *what)
{
	perror(what);
	exit(2);
}

// tcp_pair connects a loopback TCP pair, s[0] to s[1]; sndbuf, if not 0,
// sizes s[0]'s send buffer and s[1]'s receive buffer.
static void tcp_pair(int s[2], int sndbuf)
{
	struct sockaddr_in a = {.sin_family = AF_INET, .sin_addr.s_addr = htonl(INADDR_LOOPBACK)};
	socklen_t l = sizeof(a);
	int ln = socket(AF_INET, SOCK_STREAM, 0);
	if (ln < 0 || bind(ln, (void *)&a, sizeof(a)) < 0 || listen(ln, 1) < 0 || getsockname(ln, (void *)&a, &l) < 0)
		die("listen");
	s[0] = socket(AF_INET, SOCK_STREAM, 0);
	if (sndbuf) {
		setsockopt(s[0], SOL_SOCKET, SO_SNDBUF, &sndbuf, sizeof(sndbuf));
		int rcv = sndbuf;
		setsockopt(ln, SOL_SOCKET, SO_RCVBUF, &rcv, sizeof(rcv));
	}
	if (connect(s[0], (void *)&a, sizeof(a)) < 0)
		die("connect");
	s[1] = accept(ln, NULL, NULL);
	if (s[1] < 0)
		die("accept");
	close(ln);
}

struct test {
	const char *name;
	void (*fn)(void);
};

// run_tests runs each test, prints "ok" or "FAIL" with its name, and
// returns the exit status: 1 if any failed.
static inline int run_tests(const struct test *t, size_t n)
{
	// MPP_TEST=name runs that test alone (to rerun one that failed).
	const char *only = getenv("MPP_TEST");
	for (size_t i = 0; i < n; i++) {
		if (only && *only && strcmp(only, t[i].name) != 0)
			continue;
		int before = failures;
		t[i].fn();
		printf("%s %s\n", failures == before ? "ok  " : "FAIL", t[i].name);
	}
	return failures ? 1 : 0;
}
#define RUN_TESTS(tests) run_tests(tests, sizeof(tests) / sizeof(tests[0]))

// thp_mode is the system's transparent huge page setting (the bracketed
// word of /sys/kernel/mm/transparent_hugepage/enabled), or "none".
static __attribute__((unused)) void thp_mode(char *out, size_t n)
{
	char b[128] = "";
	snprintf(out, n, "none");
	FILE *f = fopen("/sys/kernel/mm/transparent_hugepage/enabled", "r");
	if (!f)
		return;
	if (fgets(b, sizeof(b), f)) {
		char *l = strchr(b, '['), *r = l ? strchr(l, ']') : NULL;
		if (l && r)
			snprintf(out, n, "%.*s", (int)(r - l - 1), l + 1);
	}
	fclose(f);
}

// thp_eligible is the THPeligible line of the mapping that holds addr in
// /proc/self/smaps: 1 or 0, -1 if no mapping holds it, -2 if the kernel
// does not say.
static __attribute__((unused)) int thp_eligible(const void *addr)
{
	FILE *f = fopen("/proc/self/smaps", "r");
	char l[512];
	int in = 0, v = -1;
	if (!f)
		return -1;
	while (fgets(l, sizeof(l), f)) {
		unsigned long lo, hi;
		if (sscanf(l, "%lx-%lx ", &lo, &hi) == 2 && strchr(l, '-') < strchr(l, ' ')) {
			if (in)
				break;
			in = (uintptr_t)addr >= lo && (uintptr_t)addr < hi;
			if (in)
				v = -2;
		} else if (in && sscanf(l, "THPeligible: %d", &v) == 1) {
			break;
		}
	}
	fclose(f);
	return v;
}

#endif
