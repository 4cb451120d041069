// SPDX-License-Identifier: Apache-2.0
//
// -E, shared by the test programs that run until told: the test creates
// DIR/stop; rank 0 looks, every rank learns its answer, so all of them
// leave the loop at the same iteration.
#ifndef MPIPAUSE_STOP_H
#define MPIPAUSE_STOP_H

#include <mpi.h>
#include <stdio.h>
#include <sys/stat.h>

static int told_to_stop(const char *dir, int rank)
{
	char path[4096];
	struct stat st;
	int stop = 0;
	if (rank == 0) {
		snprintf(path, sizeof(path), "%s/stop", dir);
		stop = stat(path, &st) == 0;
	}
	MPI_Bcast(&stop, 1, MPI_INT, 0, MPI_COMM_WORLD);
	return stop;
}

#endif
