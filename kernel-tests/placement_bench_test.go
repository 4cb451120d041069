package kerneltests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/testutil"
	"github.com/mpipause/mpipause/kernel-tests/internal/rig"
	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
)

// BenchmarkPlacement measures what placing ranks where their launcher put
// them costs against the design it replaced, in one run: two identical
// 3 x 2 jobs of each library run side by side on the rig, one whose ranks
// arrive where nobody placed them (mpid moves them into a cgroup of its
// own: placed "created", the old design's one cgroup per job) and one
// whose launcher gives each node a scope (mpid makes a cgroup inside it:
// placed "inner"). Their pauses alternate, so both see the same machine;
// it prints each placement's pause p50 and max and the ratio inner /
// created, and both jobs must end with an unpaused run's output.
// MPIPAUSE_BENCH_CYCLES sets the pauses per job (default 10).
func BenchmarkPlacement(b *testing.B) {
	dir, err := bench.Dir()
	if err != nil {
		b.Fatal(err)
	}
	sharedRig(b)
	root, err := cgroupv2.Root()
	if err != nil {
		b.Fatal(err)
	}
	for _, lib := range mpiLibs {
		b.Run(lib.name, func(b *testing.B) {
			for range b.N {
				benchPlacement(b, dir, root, lib)
			}
		})
	}
}

func benchPlacement(b *testing.B, dir, root string, lib mpiLib) {
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Minute)
	defer cancel()
	scopes := fmt.Sprintf("mpipause-test/bench-scopes-%s-%d", lib.name, os.Getpid())
	if err := cgroupv2.Create(filepath.Join(root, scopes)); err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() {
		for k := range jobNodes {
			d := filepath.Join(root, scopes, fmt.Sprintf("node%d", k))
			testutil.KillTree(d) // waits until they are gone: rmdir fails before
			// mpid removes the cgroup it made inside once its ranks are gone.
			waitFor(b, "mpid to remove its cgroup inside "+d, time.Minute, nil, func() bool {
				inner, _ := filepath.Glob(filepath.Join(d, "mpipause-*"))
				return len(inner) == 0
			})
			if err := cgroupv2.RemoveEmpty(d); err != nil {
				b.Error(err)
			}
		}
		if err := cgroupv2.RemoveEmpty(filepath.Join(root, scopes)); err != nil {
			b.Error(err)
		}
	})
	app := filepath.Join(binDir(b), "apps", "xchg."+lib.name)
	args := []string{"-m", "a2a", "-s", "256K"}
	type run struct {
		placed, id, stop string
		job              *proc
		ms               []float64
	}
	runs := []*run{{placed: "created"}, {placed: "inner"}}
	for _, r := range runs {
		r.id, r.stop = fmt.Sprintf("bench-%s-%s-%d", r.placed, lib.name, os.Getpid()), b.TempDir()
		var env []string
		if r.placed == "inner" {
			env = []string{rig.ScopeEnv + "=" + scopes + "/{}"}
		}
		r.job = runJobEnv(ctx, b, lib, r.id, env, app, append(slices.Clone(args), "-n", "100000000", "-E", r.stop)...)
		defer cli(context.Background(), b, "node0", nil, "resume", r.id)
	}
	for _, r := range runs {
		waitForWhy(b, "job "+r.id+" to be placed "+r.placed+" on every node", time.Minute, r.job.done, func() (bool, string) {
			j, _ := jobJSON(ctx, b, "status", r.id)
			ok := len(j.Cgroups) == jobNodes
			for _, c := range j.Cgroups {
				ok = ok && c.Placed == r.placed
			}
			if !ok {
				return false, fmt.Sprintf("%+v", j.Cgroups)
			}
			return allRegistered(ctx, b, r.id)
		})
	}
	cycles := envCount("MPIPAUSE_BENCH_CYCLES", 10)
	for c := 1; c <= cycles; c++ {
		for _, r := range runs {
			j, res := jobJSON(ctx, b, "pause", r.id)
			if res.code != 0 || j.State != ctl.StatePaused || j.InflightBytes != 0 {
				b.Fatalf("%s pause %d: exit %d, state %q, %d bytes queued: %s", r.placed, c, res.code, j.State, j.InflightBytes, res.stderr)
			}
			r.ms = append(r.ms, j.TotalMs)
			if j, res := jobJSON(ctx, b, "resume", r.id); res.code != 0 || j.State != ctl.StateRunning {
				b.Fatalf("%s resume %d: exit %d, state %q: %s", r.placed, c, res.code, j.State, res.stderr)
			}
		}
	}
	for _, r := range runs {
		r.job.stopAndCheck(ctx, b, "the job placed "+r.placed, r.stop, app, 2*jobNodes, args...)
	}
	p50 := func(r *run) float64 { return bench.Percentile(r.ms, 0.5) }
	ratio := p50(runs[1]) / p50(runs[0])
	b.Logf("placement %s 3x2 a2a, %d pauses each, alternated: created p50 %.1f ms (max %.1f), inner p50 %.1f ms (max %.1f): inner/created %.2f",
		lib.name, cycles, p50(runs[0]), bench.Percentile(runs[0].ms, 1), p50(runs[1]), bench.Percentile(runs[1].ms, 1), ratio)
	for _, r := range runs {
		bench.Record(dir, bench.Row{Section: "placement", Case: lib.name + "/3x2/a2a/" + r.placed, Metric: "pause p50", Value: p50(r), Unit: "ms"})
	}
	bench.Record(dir, bench.Row{Section: "placement", Case: lib.name + "/3x2/a2a", Metric: "pause p50 inner/created", Value: ratio, Unit: "x"})
	b.ReportMetric(ratio, "inner/created")
}
