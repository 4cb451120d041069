// SPDX-License-Identifier: Apache-2.0
//
// pingpong: latency and streaming bandwidth between ranks 0 and 1, for the
// shim's overhead benchmark (make bench-shim runs it with and without
// libmpipause.so, alternately, in one run).
//
// Usage: pingpong [-l iters] [-b MiB] [-s bytes]
//   -l iters  round trips of 8-byte messages (latency)
//   -b MiB    MiB streamed from rank 0 to rank 1 in -s byte messages
// Prints one line: "pingpong latency_us=<one-way> bandwidth_mibs=<MiB/s>".
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <mpi.h>

// round_trip sends 8 bytes from rank 0 to rank 1 and back.
static void round_trip(int rank, char *small)
{
	if (rank == 0) {
		MPI_Send(small, 8, MPI_CHAR, 1, 0, MPI_COMM_WORLD);
		MPI_Recv(small, 8, MPI_CHAR, 1, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
	} else if (rank == 1) {
		MPI_Recv(small, 8, MPI_CHAR, 0, 0, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
		MPI_Send(small, 8, MPI_CHAR, 0, 0, MPI_COMM_WORLD);
	}
}

int main(int argc, char **argv)
{
	int iters = 20000, mib = 512, size = 1 << 20, rank, c;
	MPI_Init(&argc, &argv);
	while ((c = getopt(argc, argv, "l:b:s:")) != -1) {
		switch (c) {
		case 'l':
			iters = atoi(optarg);
			break;
		case 'b':
			mib = atoi(optarg);
			break;
		case 's':
			size = atoi(optarg);
			break;
		default:
			fprintf(stderr, "usage: pingpong [-l iters] [-b MiB] [-s bytes]\n");
			MPI_Abort(MPI_COMM_WORLD, 2);
		}
	}
	MPI_Comm_rank(MPI_COMM_WORLD, &rank);
	char small[8] = {0};
	char *big = calloc(1, size);
	if (!big)
		MPI_Abort(MPI_COMM_WORLD, 1);

	// Warm up the connection, then time round trips.
	for (int i = 0; i < 100; i++)
		round_trip(rank, small);
	MPI_Barrier(MPI_COMM_WORLD);
	double t0 = MPI_Wtime();
	for (int i = 0; i < iters; i++)
		round_trip(rank, small);
	double lat = (MPI_Wtime() - t0) / iters / 2 * 1e6;

	long n = (long)mib * (1 << 20) / size;
	MPI_Barrier(MPI_COMM_WORLD);
	t0 = MPI_Wtime();
	for (long i = 0; i < n; i++) {
		if (rank == 0)
			MPI_Send(big, size, MPI_CHAR, 1, 1, MPI_COMM_WORLD);
		else if (rank == 1)
			MPI_Recv(big, size, MPI_CHAR, 0, 1, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
	}
	if (rank == 1)
		MPI_Send(small, 1, MPI_CHAR, 0, 2, MPI_COMM_WORLD);
	else if (rank == 0)
		MPI_Recv(small, 1, MPI_CHAR, 1, 2, MPI_COMM_WORLD, MPI_STATUS_IGNORE);
	double bw = (double)n * size / (1 << 20) / (MPI_Wtime() - t0);
	if (rank == 0)
		printf("pingpong latency_us=%.3f bandwidth_mibs=%.1f\n", lat, bw);
	free(big);
	MPI_Finalize();
	return 0;
}
