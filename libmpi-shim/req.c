// SPDX-License-Identifier: Apache-2.0
//
// Decoding of mpid's requests on the rank channel (rankchan.c): the bytes come
// from another process, so this file depends on nothing else of the shim
// and is fuzzed on its own (tests/fuzz_request.c, make fuzz).
#include "req.h"

#include <stdlib.h>
#include <string.h>

ssize_t mpp_each_line(char *buf, size_t have, int (*fn)(char *line, size_t n, void *arg), void *arg)
{
	char *nl;
	while ((nl = memchr(buf, '\n', have))) {
		*nl = 0;
		if (fn(buf, (size_t)(nl - buf), arg) < 0)
			return -1;
		have -= (size_t)(nl + 1 - buf);
		memmove(buf, nl + 1, have);
	}
	return (ssize_t)have;
}

// decimal reads s, decimal digits only (no sign, no spaces), into *v if it
// is at most max: 0, else -1. strtol would take a sign and spaces.
static int decimal(const char *s, long max, long *v)
{
	long x = 0;
	if (*s < '0' || *s > '9')
		return -1;
	for (; *s; s++) {
		if (*s < '0' || *s > '9' || x > (max - (*s - '0')) / 10)
			return -1;
		x = x * 10 + (*s - '0');
	}
	*v = x;
	return 0;
}

enum mpp_req mpp_parse_request(const char *line, size_t n, long *gen)
{
	*gen = -1;
	// A NUL inside a line would hide its tail from the checks below.
	if (memchr(line, 0, n))
		return MPP_REQ_UNKNOWN;
	if (strcmp(line, "CLOSE") == 0)
		return MPP_REQ_CLOSE;
	if (strcmp(line, "STATE") == 0)
		return MPP_REQ_STATE;
	if (strcmp(line, "OPEN") == 0)
		return MPP_REQ_OPEN;
	if (strcmp(line, "DRAIN") == 0) {
		*gen = 0; // an empty set: nothing is drained
		return MPP_REQ_DRAIN;
	}
	if (strncmp(line, "C ", 2) == 0)
		return MPP_REQ_COOKIES;
	if (strncmp(line, "DRAIN ", 6) == 0) {
		long v;
		if (decimal(line + 6, MPP_DRAIN_MAX, &v) < 0)
			return MPP_REQ_BAD_DRAIN;
		*gen = v;
		return MPP_REQ_DRAIN;
	}
	if (strcmp(line, "REOPEN") == 0)
		return MPP_REQ_REOPEN;
	if (strncmp(line, "REOPEN ", 7) != 0)
		return MPP_REQ_UNKNOWN;
	long v;
	if (decimal(line + 7, MPP_GEN_MAX, &v) < 0)
		return MPP_REQ_BAD_GEN;
	*gen = v;
	return MPP_REQ_REOPEN;
}

int mpp_parse_cookies(const char *line, size_t n, uint64_t out[MPP_COOKIES_LINE])
{
	if (memchr(line, 0, n) || n < 3 || line[0] != 'C' || line[1] != ' ')
		return -1;
	int k = 0;
	const char *d = line + 1;
	while (*d) {
		// One space, then 1 to 16 hex digits.
		if (*d != ' ' || k == MPP_COOKIES_LINE)
			return -1;
		d++;
		uint64_t v = 0;
		int digits = 0;
		for (; *d && *d != ' '; d++, digits++) {
			int x = *d >= '0' && *d <= '9'   ? *d - '0'
				: *d >= 'a' && *d <= 'f' ? *d - 'a' + 10
				: *d >= 'A' && *d <= 'F' ? *d - 'A' + 10
							 : -1;
			if (x < 0 || digits == 16)
				return -1;
			v = v << 4 | (uint64_t)x;
		}
		if (digits == 0)
			return -1;
		out[k++] = v;
	}
	return k;
}
