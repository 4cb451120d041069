// Package docwalk holds a test that keeps the walks of docs/ARCHITECTURE.md
// ("Walking a pause", "Walking a registration") true of the code: every Go
// name they cite must be declared somewhere in the repository.
package docwalk
