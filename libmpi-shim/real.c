// SPDX-License-Identifier: Apache-2.0
//
// The table of real functions (real.h). Every entry of MPP_REAL_CALLS
// starts as a stub that fills the whole table and then makes its call: the
// library's constructor fills it before the program runs, so after that a
// wrapper's real call is the pointer's load and the call, as the send path
// requires, while a call that another library's constructor makes before
// ours still reaches libc.
//
// The MPI functions (mpi.c) are not here: they are not libc's, their
// library may not be loaded yet when this table is filled, and each is
// looked up once, when it is called.
#include "shim.h"

#define MPP_REAL_STUB(type, name, sym, params, args) \
	static type lazy_##name params               \
	{                                            \
		mpp_real_resolve();                  \
		return mpp_real.name args;           \
	}
MPP_REAL_CALLS(MPP_REAL_STUB)
#undef MPP_REAL_STUB

// fcntl's third argument is an int or a pointer by the command: passed on
// as a pointer-sized word, as glibc itself reads it.
static int lazy_fcntl(int fd, int cmd, ...)
{
	va_list ap;
	va_start(ap, cmd);
	void *arg = va_arg(ap, void *);
	va_end(ap);
	mpp_real_resolve();
	return mpp_real.fcntl(fd, cmd, arg);
}

#define MPP_REAL_INIT(type, name, sym, params, args) .name = lazy_##name,
// Each entry of MPP_REAL_CALLS ends in its own comma, which clang-format
// cannot see: it would indent the next initializer as a continuation.
// clang-format off
struct real mpp_real = {
	MPP_REAL_CALLS(MPP_REAL_INIT)
	.fcntl = lazy_fcntl,
};
// clang-format on
#undef MPP_REAL_INIT
_Atomic int mpp_real_ready;

// Two threads filling it at once (before the constructor) write the same
// values.
void mpp_real_resolve(void)
{
#define MPP_REAL_SYM(type, name, sym, params, args) mpp_real.name = dlsym(RTLD_NEXT, sym);
	MPP_REAL_CALLS(MPP_REAL_SYM)
	mpp_real.fcntl = dlsym(RTLD_NEXT, "fcntl");
	MPP_REAL_OPTIONAL(MPP_REAL_SYM)
#undef MPP_REAL_SYM
	atomic_store_explicit(&mpp_real_ready, 1, memory_order_release);
}
