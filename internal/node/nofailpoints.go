//go:build !failpoints

package node

import (
	"context"
	"log/slog"
)

// failpoints is the fault tests' hook (FailpointsEnv, failpoints.go); the
// production mpid has none: no variable read, no file looked at.
// The stub is a type of another name, so that nothing of the hook's name is
// left in the binary either (kernel-tests' L5 row looks for it).
type failpoints = noHook

type noHook struct{}

func hookFor(string, *slog.Logger) noHook { return noHook{} }

func (noHook) hold(context.Context, string, string, string) {}
