package mpid

import (
	"fmt"
	"os"
	"slices"
	"testing"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/quiesce"
)

// TestPlacesInProcess: three whole mpids, one rank on each, each placed by
// a different launcher: node0's alone in a Slurm task cgroup, node1's in a
// systemd scope beside its launcher, node2's where nobody placed it. No
// rank leaves the cgroup it was launched in (node2's excepted: it had none);
// the pause freezes each where it is, and nothing of the launcher; status
// says what was chosen; a rank's end takes away the cgroup mpid made inside
// its launcher's, and never one of the manager's.
func TestPlacesInProcess(t *testing.T) {
	p := startPlaced(t)
	nodes, pid, want, shims, mem := p.nodes, p.pid, p.want, p.shims, p.mem
	const (
		task     = placedTask
		scope    = placedScope
		launcher = placedLauncher
	)
	t.Run("each rank is placed inside the cgroup it was launched in", func(t *testing.T) {
		for i, n := range nodes {
			got, _ := n.cgroups.Of(pid)
			if got != want[i].dir {
				t.Errorf("node%d: the rank is in %s, want %s", i, got, want[i].dir)
			}
		}
		if got, _ := nodes[1].cgroups.Of(launcher); got != scope {
			t.Errorf("node1: the launcher was moved to %s", got)
		}
	})
	t.Run("no cgroup of mpid's own where a manager placed every rank", func(t *testing.T) {
		key := jobid.Key(uint32(os.Getuid()), "j1")
		for i, n := range nodes[:2] {
			if n.cgroups.exists(n.reg.jobDir(key)) {
				t.Errorf("node%d made %s, where none of the job's ranks is", i, n.reg.jobDir(key))
			}
		}
	})
	t.Run("status says where and why: each node its own, the coordinator every node's", func(t *testing.T) {
		var all []ctl.Cgroup
		for i, n := range nodes {
			cg := ctl.Cgroup{Node: fmt.Sprintf("node%d", i), Dir: want[i].dir, Placed: want[i].placed}
			all = append(all, cg)
			if i == 0 {
				continue
			}
			st := n.ask(t, ctl.OpStatus, "j1")
			if st.Job == nil || len(st.Job.Cgroups) != 1 || st.Job.Cgroups[0] != cg {
				t.Errorf("node%d: status cgroups %+v, want %+v", i, st.Job, cg)
			}
		}
		var got []ctl.Cgroup
		waitFor(t, mem, func() bool {
			st := nodes[0].ask(t, ctl.OpStatus, "j1")
			got = nil
			if st.Job != nil {
				got = st.Job.Cgroups
			}
			return slices.Equal(got, all)
		}, "the coordinator's status lists cgroups %+v, want every node's: %+v", &got, all)
	})
	waitNodes(t, mem, nodes[0], "j1", "node0,node1,node2")
	t.Run("the pause freezes each rank where it is, and nothing else", func(t *testing.T) {
		rep := nodes[0].ask(t, ctl.OpPause, "j1")
		if rep.Err != nil || rep.Job == nil || rep.Job.State != ctl.StatePaused {
			t.Fatalf("pause: %+v %+v", rep.Err, rep.Job)
		}
		for i, n := range nodes {
			if f, _ := n.cgroups.Frozen(want[i].dir); !f {
				t.Errorf("node%d: %s is not frozen", i, want[i].dir)
			}
		}
		if f, _ := nodes[1].cgroups.Frozen(scope); f {
			t.Errorf("node1: the launcher's scope %s was frozen", scope)
		}
		rep = nodes[1].ask(t, ctl.OpResume, "j1")
		if rep.Err != nil || rep.Job == nil || rep.Job.State != ctl.StateRunning {
			t.Fatalf("resume: %+v %+v", rep.Err, rep.Job)
		}
		for i, n := range nodes {
			if f, _ := n.cgroups.Frozen(want[i].dir); f {
				t.Errorf("node%d: %s still frozen after the resume", i, want[i].dir)
			}
		}
	})
	t.Run("a rank's end takes away mpid's cgroup inside the launcher's, never the manager's", func(t *testing.T) {
		for i, n := range nodes {
			n.cgroups.exit(pid)
			shims[i].conn.Close()
		}
		for i, n := range nodes {
			n := n
			waitFor(t, mem, func() bool { return !n.cgroups.exists(want[i].dir) || want[i].placed == PlaceOwn },
				"node%d: %s is still there after its rank ended", i, want[i].dir)
		}
		if !nodes[0].cgroups.exists(task) || !nodes[1].cgroups.exists(scope) {
			t.Errorf("mpid removed a cgroup of the resource manager's")
		}
	})
}

const (
	placedTask     = memRoot + "/system.slice/slurmstepd.scope/job_7/step_0/user/task_0"
	placedScope    = memRoot + "/user.slice/run-r42.scope"
	placedLauncher = 1 << 30 // a pid no test process has
	// placedWatcher is a child of node0's rank in its task cgroup, as
	// Slurm's SPANK plugin leaves one: the job's, not another process.
	placedWatcher = 1<<30 + 1
)

// placed is job j1 on three in-process mpids, its rank on node0 alone in a
// Slurm task cgroup, on node1 in a scope beside its launcher, on node2
// where nobody placed it; want is where each is watched and frozen.
type placed struct {
	nodes []*testNode
	mem   *quiesce.MemNetwork
	k     *quiesce.Keyring
	pid   int
	want  []struct{ dir, placed string }
	shims []*testShim
}

func startPlaced(t *testing.T) *placed {
	t.Helper()
	p := &placed{k: testKeys(t), mem: quiesce.NewMemNetwork(1, quiesce.Faults{}), pid: os.Getpid()}
	t.Cleanup(p.mem.Close)
	for _, name := range []string{"node0", "node1", "node2"} {
		p.nodes = append(p.nodes, startNode(t, name, p.mem, p.k))
	}
	p.nodes[0].cgroups.put(p.pid, placedTask)
	p.nodes[0].cgroups.put(placedWatcher, placedTask)
	p.nodes[0].reg.procs = fakeProcs{parentOf: func(pid int) int {
		if pid == placedWatcher {
			return p.pid
		}
		return 1
	}}
	p.nodes[1].cgroups.put(p.pid, placedScope)
	p.nodes[1].cgroups.put(placedLauncher, placedScope)
	// Where a manager placed every rank, mpid's own parent is never needed:
	// under systemd it cannot even be made (the root is 0555).
	for _, n := range p.nodes[:2] {
		n.cgroups.mu.Lock()
		n.cgroups.deny = n.reg.parent
		n.cgroups.mu.Unlock()
	}
	created := p.nodes[0].ask(t, ctl.OpCreate, "j1")
	if created.Err != nil {
		t.Fatalf("create: %+v", created.Err)
	}
	key := jobid.Key(uint32(os.Getuid()), "j1")
	for i, n := range p.nodes {
		p.shims = append(p.shims, n.rank(t, "j1", created.Token, i, 3))
	}
	p.want = []struct{ dir, placed string }{
		{placedTask, PlaceOwn}, {placedScope + "/mpipause-" + key, PlaceInner}, {p.nodes[2].reg.jobDir(key), PlaceCreated}}
	waitNodes(t, p.mem, p.nodes[0], "j1", "node0,node1,node2")
	return p
}

// TestPlacesAfterRestart: node0's and node1's mpids die while the job is
// paused; their successors find it paused where its ranks are (a Slurm
// task cgroup, a cgroup inside a scope: from the records of the pause, as
// mpid's own cgroups are found by name), and its resume thaws them.
func TestPlacesAfterRestart(t *testing.T) {
	p := startPlaced(t)
	rep := p.nodes[0].ask(t, ctl.OpPause, "j1")
	if rep.Err != nil || rep.Job == nil || rep.Job.State != ctl.StatePaused {
		t.Fatalf("pause: %+v %+v", rep.Err, rep.Job)
	}
	for _, i := range []int{0, 1} {
		old := p.nodes[i]
		old.stop()
		p.nodes[i] = restartNode(t, old.cfg.Node, p.mem, p.k, old.cgroups, old.cfg.StateDir)
	}
	for i, n := range p.nodes {
		st := n.ask(t, ctl.OpStatus, "j1")
		if st.Job == nil || st.Job.State != ctl.StatePaused {
			t.Fatalf("node%d after the restart: status %+v %+v, want paused", i, st.Err, st.Job)
		}
		if f, _ := n.cgroups.Frozen(p.want[i].dir); !f {
			t.Errorf("node%d: %s thawed by the restart", i, p.want[i].dir)
		}
	}
	rep = p.nodes[0].ask(t, ctl.OpResume, "j1")
	if rep.Err != nil || rep.Job == nil || rep.Job.State != ctl.StateRunning {
		t.Fatalf("resume by the new mpids: %+v %+v", rep.Err, rep.Job)
	}
	for i, n := range p.nodes {
		if f, _ := n.cgroups.Frozen(p.want[i].dir); f {
			t.Errorf("node%d: %s still frozen after the resume", i, p.want[i].dir)
		}
	}
}
