package node

import "github.com/mpipause/mpipause/loader"

// Jobs is what a node's steps need of the jobs known on the node: mpid's
// registry implements it (internal/mpid); tests give their own.
type Jobs interface {
	// Observer returns the kernel reader of the job's sockets. It may see
	// other nodes' namespaces too (on a rig); Role.Netns then selects this
	// node's.
	Observer(job string) (loader.Observer, error)
	// Cgroups returns the cgroup v2 directories that hold the job's ranks
	// on this node, where their resource manager put them or inside those
	// (docs/mpid.md, "Cgroups"): the ones Freeze freezes, together.
	Cgroups(job string) ([]string, error)
	// Unready says why a job known here cannot be gated yet although some
	// of its ranks may be registered (an mpid restarted and not all of
	// them have registered again), or "": a pause of it fails here.
	Unready(job string) string
	// Committed says that a pause of the job commits here, and Thawing
	// that this node begins to thaw it (a resume or a rollback): a rank's
	// pause or resume request signalled before is answered.
	Committed(job string)
	Thawing(job string)
	// WithJob calls fn with the job's owner uid and coordinator (0 and ""
	// if the job is not known here) under the lock that the coordinator's
	// records of its pauses are written under: a node's record of the job
	// is read and written inside fn.
	WithJob(job string, fn func(owner uint32, coordinator string) error) error
}
