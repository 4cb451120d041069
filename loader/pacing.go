package loader

import (
	"context"
	"time"
)

// PacingReuse is how old a walk of the job's cgroups for its processes'
// network namespaces may be when a Pacing Snapshot reuses it. The walk
// reads every cgroup.procs of the job and every process's /proc/PID/ns/net:
// on the rig three quarters of a check's cost, and a pause's drain checks
// come a millisecond apart while ranks wait for a core to read on.
const PacingReuse = time.Second

type pacingKey struct{}

// Pacing marks ctx's Snapshots as checks that only decide when a pause goes
// on (the drain's), not what proves it: they may look in the namespaces of
// a recent walk instead of walking the job's cgroups again. A namespace the
// job's processes entered since that holds a connection the programs saw
// is walked for at once (its records are not left out); one whose
// connections predate the programs' attach is seen by the next walk, at
// most PacingReuse later. The check after the freeze, which proves the
// pause, is never Pacing: it walks (docs/guarantees.md, "Drain checks and
// the proof"). Where conniter does not load (Features.ConnIter empty: a
// pass reads only the namespaces listed), a Pacing Snapshot walks as any
// other does.
func Pacing(ctx context.Context) context.Context {
	return context.WithValue(ctx, pacingKey{}, true)
}

// IsPacing says whether ctx is Pacing.
func IsPacing(ctx context.Context) bool {
	p, _ := ctx.Value(pacingKey{}).(bool)
	return p
}

func pacing(ctx context.Context) bool { return IsPacing(ctx) }

// exact is ctx without Pacing.
func exact(ctx context.Context) context.Context {
	return context.WithValue(ctx, pacingKey{}, false)
}
