// SPDX-License-Identifier: Apache-2.0
//
// What the shim's C tests share: the check that reports and ends a test,
// and a loopback TCP pair.
#ifndef MPIPAUSE_TEST_CHECK_H
#define MPIPAUSE_TEST_CHECK_H

#include <netinet/in.h>
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

#endif
