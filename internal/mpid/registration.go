package mpid

import (
	"context"
	"errors"
	"slices"
	"strings"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
)

// Registration: the coordinator of a job learns its nodes from the nodes
// themselves, over the authenticated peer port, each presenting the job key
// one of its ranks presented; never from what rank 0 says (docs/security.md).
// The coordinator's side is peer.registered; a node's side is register,
// repeated by sweep until the coordinator has confirmed it.

// nodesLocked is the node list of a pause or resume of j, which this node
// coordinates: this node first, then the nodes that registered ranks of
// it, sorted. The rounds' tree is a function of it (quiesce.Subtree).
func (r *registry) nodesLocked(j *job) []string {
	nodes := make([]string, 0, 1+len(j.remotes))
	nodes = append(nodes, r.node)
	for n := range j.remotes {
		nodes = append(nodes, n)
	}
	slices.Sort(nodes[1:])
	return nodes
}

// noteTreeLocked tells keepWarm that a job this node coordinates has a new
// edge in its tree, whose connection is best made now rather than in the
// job's first pause.
func (r *registry) noteTreeLocked() {
	select {
	case r.treeChanged <- struct{}{}:
	default:
	}
}

// warmable lists, once per node list, the jobs this node coordinates that
// no pause or resume is busy with, with their node lists: the trees whose
// connections keepWarm keeps ready.
func (r *registry) warmable() map[string][]string {
	r.mu.Lock()
	defer r.mu.Unlock()
	out := map[string][]string{}
	seen := map[string]bool{}
	for id, j := range r.jobs {
		if j.coordinator != r.node || j.busy {
			continue
		}
		nodes := r.nodesLocked(j)
		k := strings.Join(nodes, "\x00")
		if !seen[k] {
			seen[k] = true
			out[id] = nodes
		}
	}
	return out
}

const (
	opRegister   = "register"
	opUnregister = "unregister"
)

// registerTimeout bounds one registration call; sweep repeats it.
const registerTimeout = 5 * time.Second

// register tells job key's coordinator that this node has ranks of it, and
// where it placed them.
func (r *registry) register(key, coord, token string, uid uint32) {
	size := 0
	for _, rk := range r.ranks.Ranks(key) {
		size = max(size, rk.Size)
	}
	var places []ctl.Cgroup
	r.mu.Lock()
	if j := r.jobs[key]; j != nil {
		places = r.placedLocked(j)
	}
	r.mu.Unlock()
	if len(places) > maxRemoteCgroups {
		places = places[:maxRemoteCgroups]
	}
	err := r.registration(key, coord, &peerControl{Op: opRegister, UID: uid, Token: token, Node: r.node, Size: size, Cgroups: places})
	r.mu.Lock()
	defer r.mu.Unlock()
	j := r.jobs[key]
	if j == nil {
		return
	}
	if err != nil {
		if ok, held := r.refusals.allow("register " + key); ok {
			r.log.Warn("the job's coordinator did not confirm this node yet; retried", "job", key, "coordinator", coord, "error", err, "repeats_not_logged", held)
		}
		return
	}
	if !j.registered {
		r.log.Info("registered with the job's coordinator", "job", key, "coordinator", coord)
	}
	j.registered = true
	j.token = token
}

// unregister tells the coordinator that the job ended on this node.
func (r *registry) unregister(key, coord, token string, uid uint32) {
	if err := r.registration(key, coord, &peerControl{Op: opUnregister, UID: uid, Token: token, Node: r.node}); err != nil {
		r.log.Info("the job's coordinator was not told that the job ended here", "job", key, "coordinator", coord, "error", err)
	}
}

func (r *registry) registration(key, coord string, c *peerControl) error {
	ctx, cancel := context.WithTimeout(context.Background(), registerTimeout)
	defer cancel()
	m := c.message(key, coord)
	m.Coordinator = coord
	rep, err := r.tr.Call(ctx, coord, m)
	if err == nil && rep.Err != "" {
		err = errors.New(rep.Err)
	}
	if err == nil && rep.Payload != nil {
		// An answer without a payload was taken as done, as before.
		var ans *peerControl
		if ans, err = decodeControl(rep); err == nil && ans.Code != "" {
			err = errors.New(ans.Message)
		}
	}
	return err
}

// remote records (add) or forgets a node's registration of job key on its
// coordinator, making the job here if it is new (a node may register
// before the coordinator's own ranks, or `mpipause run`, made it). The
// key was checked by the caller (peer.registered).
func (r *registry) remote(key string, uid uint32, name, node string, size int, places []ctl.Cgroup, add bool) error {
	r.mu.Lock()
	defer r.mu.Unlock()
	j := r.jobs[key]
	if !add {
		if j != nil && j.remotes[node] {
			delete(j.remotes, node)
			delete(j.remotePlaces, node)
			r.log.Info("job ended on a node", "job", key, "node", node)
			r.maybeEndLocked(j)
		}
		return nil
	}
	if j == nil {
		var err error
		if j, err = r.newJobLocked(uid, name, r.node); err != nil {
			return err
		}
	}
	if j.remotes == nil {
		j.remotes = map[string]bool{}
	}
	if !j.remotes[node] {
		r.log.Info("node registered ranks of the job", "job", key, "node", node)
		r.noteTreeLocked()
	}
	j.remotes[node] = true
	if j.remotePlaces == nil {
		j.remotePlaces = map[string][]ctl.Cgroup{}
	}
	j.remotePlaces[node] = places
	if size > j.size {
		j.size = size
	}
	return nil
}

// coordinatorOf is the coordinator this node knows for job key ("" if the
// job is unknown here, or adopted without a record that names it).
func (r *registry) coordinatorOf(key string) string {
	r.mu.Lock()
	defer r.mu.Unlock()
	if j := r.jobs[key]; j != nil {
		return j.coordinator
	}
	return ""
}
