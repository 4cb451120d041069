// SPDX-License-Identifier: Apache-2.0
//
// libFuzzer target for the shim's decoder of mpid's requests (req.c): the
// input arrives in pieces as recv would deliver it into the channel's
// 256-byte buffer, and every line decoded must obey what rankserve.c relies on.
// Built and run by `make -C libmpi-shim fuzz` (clang's -fsanitize=fuzzer).
#include "req.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static int check(char *line, size_t n, void *arg)
{
	long gen;
	(void)arg;
	if (strlen(line) > n || memchr(line, '\n', n))
		abort(); // framing handed over a line with its newline, or overran it
	enum mpp_req r = mpp_parse_request(line, n, &gen);
	switch (r) {
	case MPP_REQ_REOPEN:
		if (gen < -1 || gen > MPP_GEN_MAX)
			abort();
		if (gen >= 0 && (strncmp(line, "REOPEN ", 7) != 0 || strtol(line + 7, NULL, 10) != gen))
			abort();
		if (gen == -1 && strcmp(line, "REOPEN") != 0)
			abort();
		break;
	case MPP_REQ_BAD_GEN:
		if (strncmp(line, "REOPEN ", 7) != 0 || gen != -1)
			abort();
		break;
	case MPP_REQ_CLOSE:
	case MPP_REQ_STATE:
	case MPP_REQ_OPEN:
		if (strlen(line) != n)
			abort();
		break;
	case MPP_REQ_DRAIN:
		// The count of cookies to follow: what rankserve.c sizes its set by.
		if (strlen(line) != n || gen < 0 || gen > MPP_DRAIN_MAX)
			abort();
		if (gen > 0 && (strncmp(line, "DRAIN ", 6) != 0 || strtol(line + 6, NULL, 10) != gen))
			abort();
		break;
	case MPP_REQ_BAD_DRAIN:
		if (strncmp(line, "DRAIN ", 6) != 0)
			abort();
		break;
	case MPP_REQ_COOKIES: {
		uint64_t ck[MPP_COOKIES_LINE];
		int k = mpp_parse_cookies(line, n, ck);
		if (strncmp(line, "C ", 2) != 0 || k < -1 || k == 0 || k > MPP_COOKIES_LINE)
			abort();
		if (k > 0) {
			// Each cookie is the next token, in hex, in range.
			char *p = (char *)line + 1;
			for (int i = 0; i < k; i++) {
				if (*p != ' ')
					abort();
				char *end;
				unsigned long long v = strtoull(p + 1, &end, 16);
				if (v != ck[i] || end - (p + 1) > 16 || end == p + 1)
					abort();
				p = end;
			}
			if (*p)
				abort();
		}
		break;
	}
	case MPP_REQ_UNKNOWN:
		break;
	default:
		abort();
	}
	return 0;
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size)
{
	char buf[256];
	size_t have = 0;
	// The first byte chooses the piece size, as a slow or fast peer would.
	size_t piece = size ? (size_t)data[0] % 64 + 1 : 1;
	for (size_t off = size ? 1 : 0; off < size;) {
		size_t n = size - off;
		if (n > piece)
			n = piece;
		if (n > sizeof(buf) - 1 - have)
			n = sizeof(buf) - 1 - have;
		memcpy(buf + have, data + off, n);
		off += n;
		ssize_t left = mpp_each_line(buf, have + n, check, NULL);
		if (left < 0 || (size_t)left > have + n || memchr(buf, '\n', (size_t)left))
			abort();
		have = (size_t)left;
		if (have == sizeof(buf) - 1)
			break; // rankserve.c hangs up here: a line longer than any request
	}
	return 0;
}
