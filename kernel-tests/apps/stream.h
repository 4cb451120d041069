// SPDX-License-Identifier: Apache-2.0
//
// The deterministic message streams of the test programs (xchg, mt): what a
// sender writes is a function of a seed, and a receiver folds what it got
// into its state, so that a lost, duplicated, reordered or corrupted byte
// changes the checksum the serial computation (-x) must match.
#ifndef MPIPAUSE_STREAM_H
#define MPIPAUSE_STREAM_H

#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

static inline uint64_t mix64(uint64_t x)
{
	// splitmix64 finalizer: a bijective, well-spread 64-bit mix.
	x ^= x >> 30;
	x *= 0xbf58476d1ce4e5b9ULL;
	x ^= x >> 27;
	x *= 0x94d049bb133111ebULL;
	x ^= x >> 31;
	return x;
}

static inline void fill(unsigned char *buf, size_t len, uint64_t seed)
{
	uint64_t x = seed | 1;
	size_t i = 0;
	for (; i + 8 <= len; i += 8) {
		x ^= x << 13;
		x ^= x >> 7;
		x ^= x << 17;
		memcpy(buf + i, &x, 8);
	}
	for (; i < len; i++)
		buf[i] = (unsigned char)(x >> (8 * (i % 8)));
}

static inline uint64_t fold(uint64_t h, const unsigned char *buf, size_t len)
{
	size_t i = 0;
	for (; i + 8 <= len; i += 8) {
		uint64_t w;
		memcpy(&w, buf + i, 8);
		h = (h ^ w) * 0x100000001b3ULL;
	}
	for (; i < len; i++)
		h = (h ^ buf[i]) * 0x100000001b3ULL;
	return mix64(h ^ len);
}

// combine is the checksum of every rank's (or thread's) state, in order.
static inline uint64_t combine(const uint64_t *states, int n)
{
	uint64_t h = 0;
	for (int i = 0; i < n; i++)
		h = mix64(h ^ states[i]) + (uint64_t)i;
	return h;
}

// parse_size reads N, NK or NM (bytes) of option -s; a bad one, or one over
// max, ends prog with a line saying so.
static inline size_t parse_size(const char *prog, const char *s, unsigned long long max)
{
	char *end;
	unsigned long long v = strtoull(s, &end, 10);
	if (*end == 'K' || *end == 'k')
		v <<= 10, end++;
	else if (*end == 'M' || *end == 'm')
		v <<= 20, end++;
	if (*end != '\0' || v > max) {
		fprintf(stderr, "%s: bad size '%s' (want N, NK or NM, at most %lluM)\n", prog, s, max >> 20);
		exit(2);
	}
	return (size_t)v;
}

#endif
