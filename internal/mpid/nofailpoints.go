//go:build !failpoints

package mpid

import "context"

// failpoints is the fault tests' hook (FailpointsEnv, failpoints.go); the
// production mpid has none: no variable read, no file looked at.
type failpoints struct{}

func (d *Daemon) failpoints() failpoints { return failpoints{} }

func (failpoints) hold(context.Context, string, string, string) {}
