// SPDX-License-Identifier: Apache-2.0
//
// libmpipause.so: the rank-side gate, preloaded into unmodified MPI programs.
//
// This is the library's frame only: it loads into any process and changes
// nothing. The interposition of MPI_Init/MPI_Finalize, the signal handlers
// and the send gate are the work of the shim issue (see docs/ARCHITECTURE.md).

// mpipause_shim_version lets mpid and tests check which shim a rank loaded.
__attribute__((visibility("default"))) const char mpipause_shim_version[] = "mpipause-shim 0.1";
