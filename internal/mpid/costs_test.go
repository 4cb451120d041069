package mpid

import (
	"fmt"
	"os"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/quiesce"
)

// userScope is a cgroup a user owns (systemd delegates one to every
// logged-in user): they may make any number of cgroups below it.
const userScope = memRoot + "/user.slice/user-1001.slice/user@1001.service/app.slice/run-u7.scope"

// subtree makes n cgroups below dir, as its owner may.
func (c *memCgroups) subtree(dir string, n int) {
	c.mu.Lock()
	defer c.mu.Unlock()
	for i := range n {
		c.dirs[fmt.Sprintf("%s/a%d/b", dir, i)] = true
	}
}

// sweepOnce is one round of the registry's sweep: places let go, jobs
// ended.
func (r *registry) sweepOnce() {
	r.mu.Lock()
	defer r.mu.Unlock()
	for _, j := range r.jobs {
		r.pruneLocked(j)
		r.maybeEndLocked(j)
	}
}

// TestPlaceHugeSubtreeNotWalked: a rank that joins from a cgroup with
// 20,000 cgroups below it is placed without any of them read (the
// placement runs under the lock every pause, resume and status takes), one
// level down: a cgroup with cgroups below it is shared. A rank placed
// alone in its cgroup, whose owner then makes 20,000 cgroups below it, is
// swept and its status read without any of them read either.
func TestPlaceHugeSubtreeNotWalked(t *testing.T) {
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	t.Cleanup(mem.Close)
	k := testKeys(t)
	pid := os.Getpid()

	t.Run("join below a tree", func(t *testing.T) {
		n := startNode(t, "node0", mem, k)
		n.cgroups.put(pid, userScope)
		n.cgroups.subtree(userScope, 20000)
		created := n.ask(t, ctl.OpCreate, "j1")
		if created.Err != nil {
			t.Fatalf("create: %+v", created.Err)
		}
		start := time.Now()
		n.rank(t, "j1", created.Token, 0, 1)
		key := jobid.Key(uint32(os.Getuid()), "j1")
		if got, _ := n.cgroups.Of(pid); got != userScope+"/"+innerName(key) {
			t.Errorf("the rank is in %s, want one level down, in %s", got, userScope+"/"+innerName(key))
		}
		n.reg.sweepOnce()
		st := n.ask(t, ctl.OpStatus, "j1")
		if st.Err != nil {
			t.Fatalf("status: %+v", st.Err)
		}
		n.cgroups.mu.Lock()
		walked := n.cgroups.walked
		n.cgroups.mu.Unlock()
		if walked != 0 {
			t.Errorf("mpid walked %d cgroups of the user's tree (JOIN, HELLO, sweep and status in %v)", walked, time.Since(start))
		}
	})

	t.Run("tree made after", func(t *testing.T) {
		n := startNode(t, "node1", mem, k)
		n.cgroups.put(pid, userScope)
		created := n.ask(t, ctl.OpCreate, "j2")
		if created.Err != nil {
			t.Fatalf("create: %+v", created.Err)
		}
		n.rank(t, "j2", created.Token, 0, 1)
		if got, _ := n.cgroups.Of(pid); got != userScope {
			t.Fatalf("the rank alone in its cgroup was moved to %s", got)
		}
		n.cgroups.subtree(userScope, 20000)
		for range 3 {
			n.reg.sweepOnce()
			if st := n.ask(t, ctl.OpStatus, "j2"); st.Err != nil {
				t.Fatalf("status: %+v", st.Err)
			}
		}
		n.cgroups.mu.Lock()
		walked := n.cgroups.walked
		n.cgroups.mu.Unlock()
		if walked != 0 {
			t.Errorf("the sweep and status walked %d cgroups of the user's tree", walked)
		}
	})
}

// TestPauseCrossCheckCost: rank 0 names 16,000 hosts that registered no
// rank: the pause is refused naming them, and the cross-check costs time
// linear in them; a pause of the job while another is under way is refused
// for that, before any cross-check.
func TestPauseCrossCheckCost(t *testing.T) {
	mem := quiesce.NewMemNetwork(1, quiesce.Faults{})
	t.Cleanup(mem.Close)
	n := startNode(t, "node0", mem, testKeys(t))
	created := n.ask(t, ctl.OpCreate, "j1")
	if created.Err != nil {
		t.Fatalf("create: %+v", created.Err)
	}
	hosts := make([]string, 16000)
	for i := range hosts {
		hosts[i] = fmt.Sprintf("h%05d.cluster.example.org", i)
	}
	n.rankWith(t, "j1", created.Token, 0, 2, " hosts=node0,"+strings.Join(hosts, ","))
	key := jobid.Key(uint32(os.Getuid()), "j1")

	rep := n.ask(t, ctl.OpPause, "j1")
	if rep.Err == nil || rep.Err.Code != ctl.CodeUnpausable || !strings.Contains(rep.Err.Message, hosts[0]+", ") ||
		!strings.Contains(rep.Err.Message, "and 15992 more") || len(rep.Err.Message) > 1024 {
		t.Fatalf("pause: %.1024v, want it refused naming the first hosts rank 0 lists and counting the others", rep.Err)
	}
	best := time.Hour
	for range 3 {
		start := time.Now()
		if got := n.coord.unregistered(key, []string{"node0"}); len(got) != len(hosts) {
			t.Fatalf("%d hosts found unregistered, want %d", len(got), len(hosts))
		}
		best = min(best, time.Since(start))
	}
	// Linear: a few milliseconds; quadratic, hundreds.
	if best > 100*time.Millisecond {
		t.Errorf("the cross-check of %d hosts took %v", len(hosts), best)
	}

	op, err := n.reg.begin(key, ctl.OpPause, ctl.Job{})
	if err != nil {
		t.Fatal(err)
	}
	rep = n.ask(t, ctl.OpPause, "j1")
	if rep.Err == nil || rep.Err.Code != ctl.CodeState {
		t.Errorf("a pause while another is under way: %.300v, want it refused for that (%s)", rep.Err, ctl.CodeState)
	}
	op.end(ctl.StateRunning, ctl.Job{})
	rep = n.ask(t, ctl.OpStatus, "j1")
	if rep.Err != nil || rep.Job == nil || rep.Job.State != ctl.StateRunning {
		t.Errorf("status after the refusals: %+v %+v, want running", rep.Err, rep.Job)
	}
}
