package kerneltests

import (
	"context"
	"fmt"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/node"
	"github.com/mpipause/mpipause/loader"
	"github.com/mpipause/mpipause/quiesce"
)

// TestConsistentPause runs the whole protocol on a real job: three node
// agents (one per rig node, each with its node's rank socket and the
// kernel observer), a coordinator, and an in-memory transport between them;
// the mpid wiring is the next step. At every COMMIT an independent kernel
// reader (sock_diag) finds zero bytes queued on every connection of the
// job, the frozen ranks use no CPU for a second, and after RESUME the job
// goes on; it ends with the output of an unpaused run.
func TestConsistentPause(t *testing.T) {
	for _, lib := range mpiLibs {
		t.Run(lib.name, func(t *testing.T) { testPause(t, lib) })
	}
}

func testPause(t *testing.T, lib mpiLib) {
	bin := binDir(t)
	sharedRig(t)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Minute)
	defer cancel()
	srv := serveNodes(t)
	cg := jobCgroup(t, "pause-"+lib.name)
	obs := jobObserver(ctx, t, cg)
	check, err := loader.Open(ctx, loader.Config{Cgroup: cg, FollowJob: true, Require: loader.KindSockDiag})
	if err != nil {
		t.Fatal(err)
	}
	defer check.Close()

	net := quiesce.NewMemNetwork(1, quiesce.Faults{})
	defer net.Close()
	var names []string
	for k := range srv {
		name := fmt.Sprintf("node%d", k)
		names = append(names, name)
		local := &node.Local{Name: name, Ranks: srv[k], Observer: func(string) (loader.Observer, error) { return obs, nil }, Netns: fmt.Sprintf("%s-node%d", jobRig, k),
			Cgroup: func(string) (string, error) { return cg, nil }}
		net.Register(name, quiesce.NewAgent(local, net, quiesce.DefaultRetry).Handle)
	}
	coord := quiesce.NewCoordinator(net, quiesce.Options{})

	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	args := []string{"-m", "a2a", "-n", "150", "-s", "1M"}
	job := startJob(ctx, t, lib, cg, app, shimEnv(bin), args...)
	all := registered(t, srv, 6, job.done)
	id := all[0].Job
	// Whatever happens, the job must not stay frozen past the test.
	defer coord.Resume(context.Background(), id, names)

	var pauseT, resumeT []time.Duration
	made := 0
	for made < envCount("MPIPAUSE_PAUSE_CYCLES", 10) {
		select {
		case <-job.done:
			t.Fatalf("the job ended after %d pauses; make it longer", made)
		default:
		}
		before := sentBytes(ctx, obs)
		res, err := coord.Pause(ctx, id, names)
		if err != nil {
			t.Fatalf("pause %d: %v (result %+v)", made+1, err, res)
		}
		pauseT = append(pauseT, res.Total)
		// An independent reader of the kernel: every job connection empty.
		conns, err := check.Snapshot(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !allEmpty(conns) {
			t.Fatalf("pause %d committed with bytes queued: %v", made+1, nonEmpty(conns))
		}
		if f, err := cgroupv2.Frozen(cg); err != nil || !f {
			t.Fatalf("pause %d committed but the job is not frozen: %v", made+1, err)
		}
		if made == 0 {
			// Frozen ranks use no CPU: one second of nothing.
			cpu0, t0 := ranksCPU(all), time.Now()
			for time.Since(t0) < time.Second {
				time.Sleep(100 * time.Millisecond)
			}
			if used := ranksCPU(all) - cpu0; used > 20*time.Millisecond {
				t.Errorf("frozen ranks used %v of CPU in %v", used, time.Since(t0))
			}
		}
		res, err = coord.Resume(ctx, id, names)
		if err != nil {
			t.Fatalf("resume %d: %v", made+1, err)
		}
		resumeT = append(resumeT, res.Total)
		made++
		waitProgress(ctx, t, obs, job.done, before, 4<<20)
	}
	job.finish(ctx, t, fmt.Sprintf("the job paused %d times", made), serial(t, app, 6, args...))
	p := func(d []time.Duration, q float64) time.Duration {
		s := slices.Clone(d)
		slices.Sort(s)
		return s[min(len(s)-1, int(q*float64(len(s))))]
	}
	t.Logf("%d consistent pauses: pause p50 %v p99 %v, resume p50 %v p99 %v; every COMMIT verified empty by sock_diag; output unchanged",
		made, p(pauseT, 0.5), p(pauseT, 0.99), p(resumeT, 0.5), p(resumeT, 0.99))
}
