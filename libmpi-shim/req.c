// SPDX-License-Identifier: Apache-2.0
//
// Decoding of mpid's requests on the rank channel (ctl.c): the bytes come
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
	if (strcmp(line, "DRAIN") == 0)
		return MPP_REQ_DRAIN;
	if (strcmp(line, "REOPEN") == 0)
		return MPP_REQ_REOPEN;
	if (strncmp(line, "REOPEN ", 7) != 0)
		return MPP_REQ_UNKNOWN;
	// "REOPEN <gen>": decimal digits only, no sign, no spaces, in range.
	const char *d = line + 7;
	if (*d < '0' || *d > '9')
		return MPP_REQ_BAD_GEN;
	long v = 0;
	for (; *d; d++) {
		if (*d < '0' || *d > '9' || v > (MPP_GEN_MAX - (*d - '0')) / 10)
			return MPP_REQ_BAD_GEN;
		v = v * 10 + (*d - '0');
	}
	*gen = v;
	return MPP_REQ_REOPEN;
}
