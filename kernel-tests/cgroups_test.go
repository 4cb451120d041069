package kerneltests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/kernel-tests/internal/rig"
	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
	"github.com/mpipause/mpipause/loader"
)

// TestPauseInLaunchersCgroups: a job whose processes arrive on each node
// in a cgroup a resource manager made (the rig's launcher agent puts them
// in a scope per node, as systemd does an ssh session), shared by the
// launcher's daemons and the node's ranks. mpid never takes a rank out of
// it: each node's ranks go into a cgroup mpid makes inside their scope,
// and there they are frozen, while the launcher's daemons beside them are
// not. At every step each rank's /proc/PID/cgroup is inside its node's
// scope; every pause commits verified empty; the output is an unpaused
// run's; the cgroups mpid made go with the job, the scopes stay.
func TestPauseInLaunchersCgroups(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) { testPauseInLaunchersCgroups(t, lib) })
	}
}

func testPauseInLaunchersCgroups(t *testing.T, lib mpiLib) {
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	root, err := cgroupv2.Root()
	if err != nil {
		t.Fatal(err)
	}
	scopes := fmt.Sprintf("mpipause-test/scopes-%s-%d", lib.name, os.Getpid())
	scope := func(k int) string { return filepath.Join(root, scopes, fmt.Sprintf("node%d", k)) }
	t.Cleanup(func() {
		for k := range jobNodes {
			os.WriteFile(filepath.Join(scope(k), "cgroup.kill"), []byte("1"), 0)
		}
		for k := range jobNodes {
			cgroupv2.RemoveEmpty(scope(k))
		}
		cgroupv2.RemoveEmpty(filepath.Join(root, scopes))
	})
	if err := cgroupv2.Create(filepath.Join(root, scopes)); err != nil {
		t.Fatal(err)
	}
	// Progress is read from everything in the scopes, the launcher's own
	// connections too; the kernel checks take the ranks' cgroups alone
	// (the launcher's daemons run on while the job is paused).
	progress := jobObserver(ctx, t, filepath.Join(root, scopes))
	id := fmt.Sprintf("scoped-%s-%d", lib.name, os.Getpid())
	app := filepath.Join(binDir(t), "apps", "xchg."+lib.name)
	// The job runs until told to stop, after the pauses: a fixed count
	// ends too soon on a quiet machine, or too late on a busy one.
	args, stop := []string{"-m", "a2a", "-s", "256K"}, t.TempDir()
	job := runJobEnv(ctx, t, lib, id, []string{rig.ScopeEnv + "=" + scopes + "/{}"}, app, append(slices.Clone(args), "-n", "100000000", "-E", stop)...)
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	t.Cleanup(func() {
		for k := range jobNodes {
			os.WriteFile(filepath.Join(scope(k), "cgroup.kill"), []byte("1"), 0)
		}
	})
	key := jobid.Key(0, id)
	inner := make([]string, jobNodes)
	for k := range inner {
		inner[k] = filepath.Join(scope(k), "mpipause-"+key)
	}
	waitProgress(ctx, t, progress, job.done, 0, 4<<20)
	var obs, check loader.Observer
	for _, kind := range []string{loader.KindBPF, loader.KindSockDiag} {
		o, err := loader.Open(ctx, loader.Config{Cgroups: inner, FollowJob: true, Require: kind})
		if err != nil {
			t.Fatalf("the test's %s reader of %v: %v", kind, inner, err)
		}
		t.Cleanup(func() { o.Close() })
		obs, check = check, o
	}

	// placed checks, at one step, that each node's ranks are in the cgroup
	// mpid made inside the node's scope, and that the scope itself still
	// holds the launcher's processes, unfrozen.
	placed := func(t *testing.T, when string) {
		t.Helper()
		for k := range jobNodes {
			pids, err := cgroupv2.Procs(inner[k])
			if err != nil || len(pids) != 2 {
				t.Fatalf("%s: node%d's ranks: %v in %s (%v), want 2", when, k, pids, inner[k], err)
			}
			for _, pid := range pids {
				cg, err := cgroupv2.Of(pid)
				if err != nil || !strings.HasPrefix(cg, scope(k)+"/") {
					t.Fatalf("%s: node%d's rank pid %d is in %s (%v), outside its scope %s", when, k, pid, cg, err, scope(k))
				}
			}
			if launcher, _ := cgroupv2.Procs(scope(k)); len(launcher) == 0 {
				t.Errorf("%s: node%d's scope holds none of the launcher's processes", when, k)
			}
			if b, _ := os.ReadFile(filepath.Join(scope(k), "cgroup.freeze")); strings.TrimSpace(string(b)) != "0" {
				t.Errorf("%s: node%d's scope %s was frozen", when, k, scope(k))
			}
		}
	}
	t.Run("placed inside the launcher's scopes", func(t *testing.T) {
		placed(t, "running")
		// node0 coordinates: its status lists every node's cgroups, as
		// each node registered them.
		var j ctl.Job
		waitForWhy(t, "node0's status to list every node's cgroup", 30*time.Second, job.done, func() (bool, string) {
			j, _ = jobJSON(ctx, t, "status", id)
			return len(j.Cgroups) == jobNodes, fmt.Sprintf("%+v", j.Cgroups)
		})
		for k, c := range j.Cgroups {
			if c.Node != fmt.Sprintf("node%d", k) || c.Placed != "inner" || c.Dir != inner[k] {
				t.Errorf("status on node0: cgroup %+v; want node%d's, inner, %s", c, k, inner[k])
			}
		}
	})
	t.Run("paused and resumed where they are", func(t *testing.T) {
		var pauseMs []float64
		cycles := envCount("MPIPAUSE_SCOPED_CYCLES", 10)
		for c := 1; c <= cycles; c++ {
			j, r := jobJSON(ctx, t, "pause", id)
			if r.code != 0 {
				t.Fatalf("pause %d: exit %d: %s\n%s", c, r.code, r.stderr, r.stdout)
			}
			pauseMs = append(pauseMs, j.TotalMs)
			checkPaused(ctx, t, fmt.Sprintf("pause %d", c), j, inner, obs, check)
			placed(t, fmt.Sprintf("pause %d", c))
			if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
				t.Fatalf("resume %d: exit %d, state %q: %s", c, r.code, j.State, r.stderr)
			}
			placed(t, fmt.Sprintf("resume %d", c))
		}
		t.Logf("%d pauses inside the launcher's scopes: p50 %.1f ms, max %.1f ms", cycles, bench.Percentile(pauseMs, 0.5), bench.Percentile(pauseMs, 1))
	})
	t.Run("the output is an unpaused run's", func(t *testing.T) {
		job.stopAndCheck(ctx, t, "the job in its launcher's scopes", stop, app, 6, args...)
	})
	t.Run("mpid's cgroups go with the job, the scopes stay", func(t *testing.T) {
		for k := range jobNodes {
			waitFor(t, fmt.Sprintf("node%d's mpid to remove %s", k, inner[k]), time.Minute, nil, func() bool {
				_, err := os.Stat(inner[k])
				return os.IsNotExist(err)
			})
			if _, err := os.Stat(scope(k)); err != nil {
				t.Errorf("node%d's scope: %v", k, err)
			}
		}
	})
}

// TestPauseFailsPastTreeBound: a running job's cgroup on one node gets
// more cgroups below it than the kernel check reads (loader.MaxBelow; a
// rank's owner may make them below a cgroup of its own, root does here).
// Its pause fails, saying which cgroup and the bound, and the job runs on,
// on every node; with them gone it pauses and resumes, and its output is
// an unpaused run's.
func TestPauseFailsPastTreeBound(t *testing.T) {
	sharedRig(t)
	lib := mpiLibs[len(mpiLibs)-1]
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Minute)
	defer cancel()
	id := fmt.Sprintf("treebound-%s-%d", lib.name, os.Getpid())
	app := filepath.Join(binDir(t), "apps", "xchg."+lib.name)
	args, stop := []string{"-m", "a2a", "-s", "64K"}, t.TempDir()
	job := runJobEnv(ctx, t, lib, id, nil, app, append(slices.Clone(args), "-n", "100000000", "-E", stop)...)
	defer cli(context.Background(), t, "node0", nil, "resume", id)
	waitForWhy(t, "the job's ranks on every node", time.Minute, job.done, func() (bool, string) {
		if j, _ := jobJSON(ctx, t, "status", id); len(j.Cgroups) != jobNodes {
			return false, fmt.Sprintf("%+v", j)
		}
		return allRegistered(ctx, t, id)
	})
	cg := nodeJobCgroups(t, id)[1]
	var below []string
	t.Cleanup(func() {
		for _, d := range below {
			cgroupv2.RemoveEmpty(d)
		}
	})
	for i := range loader.MaxBelow + 1 {
		d := filepath.Join(cg, fmt.Sprintf("c%d", i))
		if err := cgroupv2.Create(d); err != nil {
			t.Fatal(err)
		}
		below = append(below, d)
	}
	start := time.Now()
	r := cli(ctx, t, "node0", nil, "pause", id)
	t.Logf("pause with %d cgroups below %s: exit %d in %v: %s", len(below), cg, r.code, time.Since(start).Round(time.Millisecond), strings.TrimSpace(r.stderr))
	if r.code == 0 || !strings.Contains(r.stderr, cg) || !strings.Contains(r.stderr, fmt.Sprintf("more than %d cgroups", loader.MaxBelow)) {
		t.Fatalf("pause: exit %d, stderr %q; want it failed naming %s and %d", r.code, r.stderr, cg, loader.MaxBelow)
	}
	if st, _ := jobJSON(ctx, t, "status", id); st.State != ctl.StateRunning {
		t.Fatalf("after the failed pause the job is %q, want running", st.State)
	}
	for _, d := range nodeJobCgroups(t, id) {
		if f, _ := cgroupv2.Frozen(d); f {
			t.Errorf("%s left frozen by the failed pause", d)
		}
	}
	for _, d := range below {
		if err := cgroupv2.RemoveEmpty(d); err != nil {
			t.Fatal(err)
		}
	}
	below = nil
	if j, r := jobJSON(ctx, t, "pause", id); r.code != 0 || j.State != ctl.StatePaused {
		t.Fatalf("pause with the cgroups gone: exit %d, state %q: %s", r.code, j.State, r.stderr)
	}
	if j, r := jobJSON(ctx, t, "resume", id); r.code != 0 || j.State != ctl.StateRunning {
		t.Fatalf("resume: exit %d, state %q: %s", r.code, j.State, r.stderr)
	}
	job.stopAndCheck(ctx, t, "the job whose pause failed", stop, app, 2*jobNodes, args...)
}
