// SPDX-License-Identifier: Apache-2.0
#ifndef MPP_REQ_H
#define MPP_REQ_H

#include <stddef.h>
#include <stdint.h>
#include <sys/types.h>

// mpid's requests (internal/ranks/doc.go lists the lines).
enum mpp_req {
	MPP_REQ_UNKNOWN,
	MPP_REQ_CLOSE,
	MPP_REQ_STATE,
	MPP_REQ_OPEN,
	MPP_REQ_REOPEN,    // gen: the generation, or -1 for any
	MPP_REQ_BAD_GEN,   // "REOPEN x" with x not a generation
	MPP_REQ_DRAIN,     // gen: how many socket cookies follow in COOKIES lines
	MPP_REQ_BAD_DRAIN, // "DRAIN x" with x not a count up to MPP_DRAIN_MAX
	MPP_REQ_COOKIES,   // "C <hex> ...": part of a DRAIN's set (mpp_parse_cookies)
};

// A DRAIN names at most MPP_DRAIN_MAX sockets (the job's connections on the
// node: mpid does not know which process holds which), by their kernel cookies
// (SO_COOKIE), MPP_COOKIES_LINE to a line: "C " and 12 cookies of at most 16
// hex digits each fit the channel's 256-byte buffer with room to spare.
#define MPP_DRAIN_MAX 65536
#define MPP_COOKIES_LINE 12

// Generations live in 29 bits of the gate word (GATE_GEN_MASK); anything
// larger is not one.
#define MPP_GEN_MAX 0x1fffffffL

// mpp_each_line calls fn on each complete line at the start of buf (have
// bytes), NUL-terminated in place of its '\n', with its length, and moves
// the bytes after the last one to the front. It returns the bytes left, or
// -1 as soon as fn returns < 0.
ssize_t mpp_each_line(char *buf, size_t have, int (*fn)(char *line, size_t n, void *arg), void *arg);

// mpp_parse_request decodes one request line (n bytes, without its '\n').
enum mpp_req mpp_parse_request(const char *line, size_t n, long *gen);

// mpp_parse_cookies decodes a COOKIES line ("C" and 1 to MPP_COOKIES_LINE
// cookies of 1 to 16 hex digits, each after one space) into out: how many,
// or -1 if the line is not one.
int mpp_parse_cookies(const char *line, size_t n, uint64_t out[MPP_COOKIES_LINE]);

#endif
