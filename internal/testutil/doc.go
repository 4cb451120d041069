// Package testutil holds what the project's tests share: the privilege gate
// that skips privileged tests outside CI and fails them inside it, and
// helpers for fresh network namespaces and cgroups.
package testutil
