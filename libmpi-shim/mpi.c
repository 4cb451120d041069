// SPDX-License-Identifier: Apache-2.0
//
// MPI_Init, MPI_Init_thread and MPI_Finalize, interposed without relinking.
// After the real init the rank learns who it is and registers with the
// node's mpid (rankchan.c; rankhello.c writes the HELLO from what it learnt
// here).
//
// The MPI functions are looked up here, when they are called, not in the
// table of real functions (real.h): they are not libc's, and the MPI
// library may not be loaded when the constructor fills that table (a
// program may dlopen it). RTLD_NEXT for the ones the shim wraps (the
// definition after its own), RTLD_DEFAULT for the PMPI calls and the
// handles' objects (wherever the loaded MPI defines them).
//
// The shim is built once for every MPI: it includes no mpi.h. The few PMPI
// calls it makes (only when the job id must be agreed on) use the ABI of
// the library actually loaded: Open MPI's handles are pointers to exported
// objects (ompi_mpi_comm_world, ompi_mpi_char), MPICH's are integers
// (MPI_COMM_WORLD 0x44000000, MPI_CHAR 0x4c000101, mpi.h of MPICH 4.0).
// On x86-64 both are passed in one register, so one prototype with a
// 64-bit handle serves both.
#include "shim.h"

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#define IDLEN 96

typedef uintptr_t handle; // MPI_Comm / MPI_Datatype of either ABI

struct abi {
	handle world, chr;
	int (*comm_rank)(handle, int *);
	int (*comm_size)(handle, int *);
	int (*comm_dup)(handle, handle *);
	int (*comm_free)(handle *);
	int (*bcast)(void *, int, handle, int, handle);
	int (*gather)(const void *, int, handle, void *, int, handle, int, handle);
};

static int load_abi(struct abi *a)
{
	void *w = dlsym(RTLD_DEFAULT, "ompi_mpi_comm_world");
	if (w) {
		a->world = (handle)w;
		a->chr = (handle)dlsym(RTLD_DEFAULT, "ompi_mpi_char");
	} else {
		a->world = 0x44000000;
		a->chr = 0x4c000101;
	}
	a->comm_rank = dlsym(RTLD_DEFAULT, "PMPI_Comm_rank");
	a->comm_size = dlsym(RTLD_DEFAULT, "PMPI_Comm_size");
	a->comm_dup = dlsym(RTLD_DEFAULT, "PMPI_Comm_dup");
	a->comm_free = dlsym(RTLD_DEFAULT, "PMPI_Comm_free");
	a->bcast = dlsym(RTLD_DEFAULT, "PMPI_Bcast");
	a->gather = dlsym(RTLD_DEFAULT, "PMPI_Gather");
	return a->chr && a->comm_rank && a->comm_size && a->comm_dup && a->comm_free && a->bcast && a->gather ? 0 : -1;
}

// env_jobid is the job's id as the scheduler or launcher names it, if any.
static int env_jobid(char *id, size_t n)
{
	const char *v;
	if ((v = getenv("MPIPAUSE_JOBID")) && *v)
		return snprintf(id, n, "%s", v), 0;
	if ((v = getenv("SLURM_JOB_ID")) && *v) {
		const char *step = getenv("SLURM_STEP_ID");
		return snprintf(id, n, "slurm-%s.%s", v, step && *step ? step : "0"), 0;
	}
	if ((v = getenv("PMIX_NAMESPACE")) && *v)
		return snprintf(id, n, "pmix-%s", v), 0;
	if ((v = getenv("OMPI_MCA_ess_base_jobid")) && *v)
		return snprintf(id, n, "ompi-%s", v), 0;
	return -1;
}

static void attach(void)
{
	struct abi a;
	char id[IDLEN] = "", host[MPP_HOST_MAX] = "", root[MPP_HOST_MAX] = "";
	char *hosts = NULL;
	int rank = -1, size = 0, have_id;

	if (load_abi(&a) < 0) {
		mpp_rankch_start(NULL); // still gateable
		return;
	}
	a.comm_rank(a.world, &rank);
	a.comm_size(a.world, &size);
	gethostname(host, sizeof(host) - 1);
	mpp_hello_value(host); // as the other ranks will get it
	have_id = env_jobid(id, sizeof(id)) == 0;

	// Collectives on a private duplicate of MPI_COMM_WORLD: nothing the
	// application does on its communicators can match them.
	handle dup = 0;
	if (a.comm_dup(a.world, &dup) == 0) {
		if (!have_id) {
			if (rank == 0) {
				struct timespec ts;
				clock_gettime(CLOCK_REALTIME, &ts);
				snprintf(id, sizeof(id), "%s-%d-%lx", host, (int)getpid(), (unsigned long)ts.tv_sec);
			}
			a.bcast(id, IDLEN, a.chr, 0, dup);
		}
		// Every rank learns rank 0's host and says it (root=), a
		// cross-check only: the job's coordinator, to which the other
		// nodes' mpids pass requests (a rank's SIGTSTP, a user's pause),
		// is the node the job key names (where `mpipause run` ran, or a
		// Slurm step's first node).
		if (rank == 0)
			memcpy(root, host, MPP_HOST_MAX);
		a.bcast(root, MPP_HOST_MAX, a.chr, 0, dup);
		root[MPP_HOST_MAX - 1] = 0;
		if (rank == 0 && size > 0 && size <= 65536)
			hosts = calloc((size_t)size, MPP_HOST_MAX);
		a.gather(host, MPP_HOST_MAX, a.chr, hosts, MPP_HOST_MAX, a.chr, 0, dup);
		a.comm_free(&dup);
	}
	struct mpp_hello h = {.job = id, .rank = rank, .size = size, .host = host, .root = root, .hosts = hosts};
	mpp_rankch_start(&h);
	free(hosts);
}

// attach_once: MPICH's Fortran init calls the C MPI_Init (caught there),
// Open MPI's calls PMPI_Init (caught only by the Fortran wrappers below).
static _Atomic int attached;

static void attach_once(void)
{
	if (!atomic_exchange(&attached, 1))
		attach();
}

EXPORT int MPI_Init(int *argc, char ***argv)
{
	int (*real)(int *, char ***) = dlsym(RTLD_NEXT, "MPI_Init");
	int rc = real(argc, argv);
	if (rc == 0)
		attach_once();
	return rc;
}

EXPORT int MPI_Init_thread(int *argc, char ***argv, int required, int *provided)
{
	int (*real)(int *, char ***, int, int *) = dlsym(RTLD_NEXT, "MPI_Init_thread");
	int rc = real(argc, argv, required, provided);
	if (rc == 0)
		attach_once();
	return rc;
}

EXPORT int MPI_Finalize(void)
{
	int (*real)(void) = dlsym(RTLD_NEXT, "MPI_Finalize");
	mpp_rankch_stop();
	return real();
}

// Fortran entry points (gfortran's names: lower case, one underscore; the
// mpi_f08 module's *_f08_). MPI_Fint is int in both libraries; ierr may be
// absent (NULL) with mpi_f08.
#define FORTRAN_INIT(name)                                     \
	EXPORT void name(int *ierr)                            \
	{                                                      \
		void (*real)(int *) = dlsym(RTLD_NEXT, #name); \
		int e = 0;                                     \
		real(ierr ? ierr : &e);                        \
		if ((ierr ? *ierr : e) == 0)                   \
			attach_once();                         \
	}
#define FORTRAN_INIT_THREAD(name)                                            \
	EXPORT void name(int *required, int *provided, int *ierr)            \
	{                                                                    \
		void (*real)(int *, int *, int *) = dlsym(RTLD_NEXT, #name); \
		int e = 0;                                                   \
		real(required, provided, ierr ? ierr : &e);                  \
		if ((ierr ? *ierr : e) == 0)                                 \
			attach_once();                                       \
	}
#define FORTRAN_FINALIZE(name)                                 \
	EXPORT void name(int *ierr)                            \
	{                                                      \
		void (*real)(int *) = dlsym(RTLD_NEXT, #name); \
		mpp_rankch_stop();                             \
		real(ierr);                                    \
	}

FORTRAN_INIT(mpi_init_)
FORTRAN_INIT(mpi_init_f08_)
FORTRAN_INIT_THREAD(mpi_init_thread_)
FORTRAN_INIT_THREAD(mpi_init_thread_f08_)
FORTRAN_FINALIZE(mpi_finalize_)
FORTRAN_FINALIZE(mpi_finalize_f08_)
