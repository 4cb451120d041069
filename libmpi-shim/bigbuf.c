// SPDX-License-Identifier: Apache-2.0
//
// Memory for the MiBs the shim copies while a pause is under way: what a
// closed gate holds (gate.c) and what the drain stashes (stash.c). Both go
// into memory the process has never touched, on the pause's path, and
// faulting that in 4 KiB at a time cost more CPU than the copy itself (on
// the rig: 8 MiB received into fresh 4 KiB pages, 28 ms of CPU; into
// touched memory, or into fresh huge pages, 2 ms), paid by threads that
// share the cores with the job's busy ranks. So a buffer of MPP_BIG or
// more is a mapping of its own, aligned to and advised for transparent
// huge pages (MADV_HUGEPAGE: taken where the system's setting is
// "madvise" or "always"), a fault per 2 MiB; a smaller one is malloc's.
// Its size, given back to mpp_big_free, says which.
#include "shim.h"

#include <stdint.h>
#include <stdlib.h>
#include <sys/mman.h>

static size_t mapped_size(size_t n)
{
	return (n + MPP_BIG - 1) & ~(MPP_BIG - 1);
}

void *mpp_big_alloc(size_t n)
{
	if (n < MPP_BIG)
		return malloc(n);
	size_t len = mapped_size(n);
	// Mapped with MPP_BIG to spare, then trimmed to an aligned start: a
	// huge page backs only a 2 MiB-aligned range.
	char *m = mmap(NULL, len + MPP_BIG, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
	if (m == MAP_FAILED)
		return NULL;
	char *b = (char *)(((uintptr_t)m + MPP_BIG - 1) & ~(uintptr_t)(MPP_BIG - 1));
	if (b > m)
		munmap(m, (size_t)(b - m));
	if (b + len < m + len + MPP_BIG)
		munmap(b + len, (size_t)(m + len + MPP_BIG - (b + len)));
	madvise(b, len, MADV_HUGEPAGE); // refused without THP: 4 KiB pages
	return b;
}

void mpp_big_free(void *p, size_t n)
{
	if (!p)
		return;
	if (n < MPP_BIG)
		free(p);
	else
		munmap(p, mapped_size(n));
}
