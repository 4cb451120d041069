! SPDX-License-Identifier: Apache-2.0
! fhello: a Fortran MPI program, to check that the shim registers ranks of
! Fortran programs too (their MPI_Init may bypass the C entry point).
program fhello
  use mpi
  implicit none
  integer :: ierr, rank, nranks
  call MPI_Init(ierr)
  call MPI_Comm_rank(MPI_COMM_WORLD, rank, ierr)
  call MPI_Comm_size(MPI_COMM_WORLD, nranks, ierr)
  if (rank == 0) print '(A,I0)', 'fhello ranks=', nranks
  call MPI_Finalize(ierr)
end program fhello
