package mpid

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
)

// TestKernelProcsBound: the kernel's Procs, the one read of a rank's
// cgroup placement makes, reads MaxProcs pids and fails past them naming
// the cgroup and the bound. Any directory stands in for the cgroup.
func TestKernelProcsBound(t *testing.T) {
	write := func(n int) string {
		dir := t.TempDir()
		var b strings.Builder
		for i := range n {
			b.WriteString(strconv.Itoa(4000000+i) + "\n")
		}
		if err := os.WriteFile(filepath.Join(dir, "cgroup.procs"), []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
		return dir
	}
	if ps, err := (KernelCgroups{}).Procs(write(MaxProcs)); err != nil || len(ps) != MaxProcs {
		t.Fatalf("%d pids: %d read, %v", MaxProcs, len(ps), err)
	}
	dir := write(MaxProcs + 1)
	_, err := (KernelCgroups{}).Procs(dir)
	if !errors.Is(err, cgroupv2.ErrTooMany) || !strings.Contains(err.Error(), dir) || !strings.Contains(err.Error(), strconv.Itoa(MaxProcs)) {
		t.Fatalf("%d pids: err %v, want ErrTooMany naming %s and %d", MaxProcs+1, err, dir, MaxProcs)
	}
}

// TestJoinPastMaxProcs: a rank that joins from a cgroup holding more than
// MaxProcs processes (a cgroup its user owns and filled) is refused, the
// JOIN's answer saying why: the cgroup and the bound; so is its HELLO.
func TestJoinPastMaxProcs(t *testing.T) {
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	t.Cleanup(mem.Close)
	n := startNode(t, "node0", mem, testKeys(t))
	pid := os.Getpid()
	n.cgroups.put(pid, userScope)
	for i := range MaxProcs {
		n.cgroups.put(4000000+i, userScope)
	}
	created := n.ask(t, ctl.OpCreate, "j1")
	if created.Err != nil {
		t.Fatalf("create: %+v", created.Err)
	}
	ask := func(line string) (string, error) {
		c, err := net.Dial("unix", n.rankAddr)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		fmt.Fprint(c, line)
		c.SetReadDeadline(time.Now().Add(10 * time.Second))
		return bufio.NewReader(c).ReadString('\n')
	}
	reply, _ := ask(fmt.Sprintf("JOIN 2 job=j1 pid=%d key=%s\n", pid, created.Token))
	if !strings.HasPrefix(reply, "ERR") || !strings.Contains(reply, userScope) || !strings.Contains(reply, strconv.Itoa(MaxProcs)) {
		t.Errorf("JOIN: answer %q, want ERR naming %s and %d", reply, userScope, MaxProcs)
	}
	// A HELLO is answered by nothing but its registration: refused, the
	// connection is closed and mpid's log says why.
	if reply, err := ask(fmt.Sprintf("HELLO 2 job=j1 rank=0 size=1 pid=%d host=node0 key=%s\n", pid, created.Token)); err == nil || os.IsTimeout(err) {
		t.Errorf("HELLO: answer %q, %v; want the connection closed", reply, err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for strings.Count(n.log.String(), `msg="rank refused"`) < 2 && time.Now().Before(deadline) {
		time.Sleep(10 * time.Millisecond)
	}
	// The JOIN's refusal and the HELLO's are logged by two connections'
	// goroutines, in either order.
	hello := false
	for _, l := range strings.Split(n.log.String(), "\n") {
		hello = hello || strings.Contains(l, `msg="rank refused"`) && !strings.Contains(l, "JOIN") &&
			strings.Contains(l, userScope) && strings.Contains(l, strconv.Itoa(MaxProcs))
	}
	if !hello {
		t.Errorf("mpid's log has no refusal of the HELLO naming %s and %d\n%s", userScope, MaxProcs, n.log)
	}
	if got, _ := n.cgroups.Of(pid); got != userScope {
		t.Errorf("the refused rank was moved to %s", got)
	}
}

// failingObservers opens observers whose every Snapshot fails with err:
// what the kernel's does when the job's tree is past its bounds.
type failingObservers struct{ err error }

func (o failingObservers) Open(string, []string) (loader.Observer, error) {
	return failingObserver(o), nil
}
func (failingObservers) Unpin(string) error { return nil }

type failingObserver struct{ err error }

func (o failingObserver) Snapshot(context.Context) ([]loader.Conn, error) { return nil, o.err }
func (failingObserver) Kind() string                                      { return "test" }
func (failingObserver) Close() error                                      { return nil }

// TestPauseFailsOnBoundedRead: when the observer cannot read the job's
// whole tree (its owner made more than loader.MaxBelow cgroups below a
// rank's cgroup), the pause fails with that reason, naming the cgroup and
// the bound, and the job is left running, thawed: a view of part of the
// tree never passes the kernel check.
func TestPauseFailsOnBoundedRead(t *testing.T) {
	tree := t.TempDir()
	for i := range loader.MaxBelow + 1 {
		d := filepath.Join(tree, fmt.Sprintf("c%d", i))
		if err := os.Mkdir(d, 0o755); err != nil {
			t.Fatal(err)
		}
	}
	_, berr := (&cgroupv2.Bound{Below: loader.MaxBelow}).TreeIDs(tree)
	if !errors.Is(berr, cgroupv2.ErrTooMany) {
		t.Fatalf("the observer's read of %d cgroups below: %v", loader.MaxBelow+1, berr)
	}
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	t.Cleanup(mem.Close)
	n := startNodeWith(t, "node0", mem, testKeys(t), newMemCgroups(), t.TempDir(), failingObservers{berr})
	n.cgroups.put(os.Getpid(), userScope)
	created := n.ask(t, ctl.OpCreate, "j1")
	if created.Err != nil {
		t.Fatalf("create: %+v", created.Err)
	}
	n.rank(t, "j1", created.Token, 0, 1)
	rep := n.ask(t, ctl.OpPause, "j1")
	t.Logf("pause: %v", rep.Err)
	if rep.Err == nil || !strings.Contains(rep.Err.Message, tree) || !strings.Contains(rep.Err.Message, "more than "+strconv.Itoa(loader.MaxBelow)+" cgroups") {
		t.Fatalf("pause: %+v %+v, want it failed naming %s and %d", rep.Err, rep.Job, tree, loader.MaxBelow)
	}
	st := n.ask(t, ctl.OpStatus, "j1")
	if st.Job == nil || st.Job.State == ctl.StatePaused {
		t.Errorf("after the failed pause: %+v %+v, want the job not paused", st.Err, st.Job)
	}
	if f, _ := n.cgroups.Frozen(userScope); f {
		t.Errorf("%s left frozen by the failed pause", userScope)
	}
}

// TestAdoptPastMaxWalk: mpid dies while a job is paused, and the job's
// owner makes more cgroups below its rank's cgroup (one it owns) than a
// restarted mpid walks (MaxWalk). The new mpid still adopts the job whole,
// paused, with that cgroup among its places, says why it cannot be paused
// again (the cgroup and the bound), and its resume thaws it: the job is
// neither lost nor split, nor left frozen.
func TestAdoptPastMaxWalk(t *testing.T) {
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	t.Cleanup(mem.Close)
	k := testKeys(t)
	n := startNode(t, "node0", mem, k)
	pid := os.Getpid()
	n.cgroups.put(pid, userScope)
	created := n.ask(t, ctl.OpCreate, "j1")
	if created.Err != nil {
		t.Fatalf("create: %+v", created.Err)
	}
	n.rank(t, "j1", created.Token, 0, 1)
	if got, _ := n.cgroups.Of(pid); got != userScope {
		t.Fatalf("the rank alone in its cgroup was moved to %s", got)
	}
	if rep := n.ask(t, ctl.OpPause, "j1"); rep.Err != nil || rep.Job == nil || rep.Job.State != ctl.StatePaused {
		t.Fatalf("pause: %+v %+v", rep.Err, rep.Job)
	}
	n.stop()
	n.cgroups.subtree(userScope, MaxWalk) // 2*MaxWalk cgroups below
	n = restartNode(t, "node0", mem, k, n.cgroups, n.cfg.StateDir)

	st := n.ask(t, ctl.OpStatus, "j1")
	if st.Job == nil || st.Job.State != ctl.StatePaused {
		t.Fatalf("after the restart: %+v %+v, want the job adopted, paused\n%s", st.Err, st.Job, n.log)
	}
	if !strings.Contains(st.Job.Unpausable, userScope) || !strings.Contains(st.Job.Unpausable, strconv.Itoa(MaxWalk)) {
		t.Errorf("status says %q, want why it cannot be paused: %s past %d cgroups", st.Job.Unpausable, userScope, MaxWalk)
	}
	placed := false
	for _, c := range st.Job.Cgroups {
		placed = placed || c.Dir == userScope
	}
	if !placed {
		t.Errorf("status lists the places %+v, without %s", st.Job.Cgroups, userScope)
	}
	if f, _ := n.cgroups.Frozen(userScope); !f {
		t.Errorf("%s thawed by the restart", userScope)
	}
	if rep := n.ask(t, ctl.OpResume, "j1"); rep.Err != nil || rep.Job == nil || rep.Job.State != ctl.StateRunning {
		t.Fatalf("resume: %+v %+v", rep.Err, rep.Job)
	}
	if f, _ := n.cgroups.Frozen(userScope); f {
		t.Errorf("%s still frozen after the resume", userScope)
	}
	rep := n.ask(t, ctl.OpPause, "j1")
	t.Logf("pause after: %v", rep.Err)
	if rep.Err == nil || rep.Err.Code != ctl.CodeUnpausable || !strings.Contains(rep.Err.Message, userScope) {
		t.Errorf("pause after: %+v, want it refused naming %s", rep.Err, userScope)
	}
}

// TestPauseRefusedForAnotherNodesUnwatched: the kernel cannot vouch for a
// job's ranks on node1 (a rank there registered without joining and was
// moved, leaving its older sockets outside every watched cgroup; or a
// restarted mpid could not read a cgroup of the job whole): a pause
// coordinated by node0 is refused, saying why, as one on node1 would be.
func TestPauseRefusedForAnotherNodesUnwatched(t *testing.T) {
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	t.Cleanup(mem.Close)
	k := testKeys(t)
	n0, n1 := startNode(t, "node0", mem, k), startNode(t, "node1", mem, k)
	const launcher = 4000001
	pid := os.Getpid()
	n1.cgroups.put(pid, userScope)
	n1.cgroups.put(launcher, userScope)
	created := n0.ask(t, ctl.OpCreate, "j1")
	if created.Err != nil {
		t.Fatalf("create: %+v", created.Err)
	}
	n0.rank(t, "j1", created.Token, 0, 2)
	n1.hello(t, "j1", created.Token, 1, 2, "")
	waitNodes(t, mem, n0, "j1", "node0,node1")
	if st := n1.ask(t, ctl.OpStatus, "j1"); st.Job == nil || !strings.Contains(st.Job.Unpausable, "without joining") {
		t.Fatalf("node1's status: %+v %+v, want the job unpausable there", st.Err, st.Job)
	}
	rep := n0.ask(t, ctl.OpPause, "j1")
	t.Logf("pause: %v", rep.Err)
	if rep.Err == nil || !strings.Contains(rep.Err.Message, "without joining") {
		t.Fatalf("pause on node0: %+v %+v, want it refused for node1's rank", rep.Err, rep.Job)
	}
	for _, n := range []*testNode{n0, n1} {
		if st := n.ask(t, ctl.OpStatus, "j1"); st.Job == nil || st.Job.State == ctl.StatePaused {
			t.Errorf("%s after the refused pause: %+v %+v", n.cfg.Node, st.Err, st.Job)
		}
	}
}
