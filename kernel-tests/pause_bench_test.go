package kerneltests

import (
	"context"
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ctl"
)

// BenchmarkPause measures the pause as users get it, on one running 3 x 2
// job per library launched with `mpipause run`, beside what a scheduler's
// stop does today, alternately in the same run: SIGSTOP to every rank (time
// until all are stopped, and the bytes then left in the job's TCP queues),
// against `mpipause pause` (request to COMMIT, as mpid measures it, with the
// kernel-verified empty queues) and `mpipause resume`. `make bench-pause`
// runs it; MPIPAUSE_BENCH_CYCLES sets the cycles per method (default 20).
func BenchmarkPause(b *testing.B) {
	for _, lib := range mpiLibs {
		b.Run(lib.name, func(b *testing.B) { benchPause(b, lib) })
	}
}

func benchPause(b *testing.B, lib mpiLib) {
	bin := binDir(b)
	sharedRig(b)
	cycles := envCount("MPIPAUSE_BENCH_CYCLES", 20)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	obs := jobObserver(ctx, b, rigCgroups)
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	id := fmt.Sprintf("bench-%s-%d", lib.name, os.Getpid())
	job := runJob(ctx, b, lib, id, app, "-m", "a2a", "-n", "1000000", "-s", "1M")
	defer cli(context.Background(), b, "node0", nil, "resume", id)
	cgs := nodeJobCgroups(b, id)
	progress := func() { waitProgress(ctx, b, obs, job.done, sentBytes(ctx, obs), 8<<20) }
	progress()
	var pids []int
	for _, cg := range cgs {
		p, err := cgroupv2.Procs(cg)
		if err != nil {
			b.Fatal(err)
		}
		pids = append(pids, p...)
	}
	if len(pids) != 6 {
		b.Fatalf("%d ranks in the job's cgroups, want 6", len(pids))
	}
	inflight := func() (total uint64, nonEmpty int) {
		cs, err := obs.Snapshot(ctx)
		if err != nil {
			b.Fatal(err)
		}
		for _, c := range cs {
			total += uint64(c.SendQueue) + uint64(c.Unread)
			if !c.Empty() {
				nonEmpty++
			}
		}
		return total, nonEmpty
	}
	signalAll := func(sig syscall.Signal) {
		for _, p := range pids {
			syscall.Kill(p, sig)
		}
	}
	stopped := func() bool {
		for _, p := range pids {
			if procState(p) != "T" {
				return false
			}
		}
		return true
	}
	// until polls cond every 200 us: the times measured here are
	// milliseconds, and waitFor's 20 ms step would dominate them.
	until := func(what string, cond func() bool) {
		deadline := time.Now().Add(time.Minute)
		for !cond() {
			if time.Now().After(deadline) {
				b.Fatalf("gave up waiting for %s", what)
			}
			time.Sleep(200 * time.Microsecond)
		}
	}
	var stopT, pauseT, resumeT []float64
	var stopBytes, pauseBytes []uint64
	phases := map[string][]float64{}
	stopDirty := 0
	b.ResetTimer()
	for i := 0; i < cycles; i++ {
		// Naive: SIGSTOP every rank at an arbitrary moment.
		t0 := time.Now()
		signalAll(syscall.SIGSTOP)
		until("every rank stopped", stopped)
		stopT = append(stopT, float64(time.Since(t0).Microseconds())/1000)
		n, dirty := inflight()
		stopBytes = append(stopBytes, n)
		if dirty > 0 {
			stopDirty++
		}
		signalAll(syscall.SIGCONT)
		progress()

		j, r := jobJSON(ctx, b, "pause", id)
		if r.code != 0 || j.State != ctl.StatePaused {
			b.Fatalf("pause %d: exit %d: %s%s", i+1, r.code, r.stderr, r.stdout)
		}
		pauseT = append(pauseT, j.TotalMs)
		for _, p := range j.Phases {
			phases[p.Name] = append(phases[p.Name], p.Ms)
		}
		n, _ = inflight()
		pauseBytes = append(pauseBytes, n)
		j, r = jobJSON(ctx, b, "resume", id)
		if r.code != 0 || j.State != ctl.StateRunning {
			b.Fatalf("resume %d: exit %d: %s", i+1, r.code, r.stderr)
		}
		resumeT = append(resumeT, j.TotalMs)
		progress()
	}
	b.StopTimer()
	mean := func(v []uint64) float64 {
		var s uint64
		for _, x := range v {
			s += x
		}
		return float64(s) / float64(len(v)) / (1 << 20)
	}
	b.ReportMetric(pct(stopT, 0.5), "sigstop-p50-ms")
	b.ReportMetric(mean(stopBytes), "sigstop-inflight-MiB")
	b.ReportMetric(float64(stopDirty)/float64(cycles), "sigstop-dirty-fraction")
	b.ReportMetric(pct(pauseT, 0.5), "pause-p50-ms")
	b.ReportMetric(pct(pauseT, 0.99), "pause-p99-ms")
	b.ReportMetric(mean(pauseBytes), "pause-inflight-MiB")
	b.ReportMetric(pct(resumeT, 0.5), "resume-p50-ms")
	b.ReportMetric(pct(resumeT, 0.99), "resume-p99-ms")
	b.ReportMetric(pct(pauseT, 0.5)/pct(stopT, 0.5), "pause/sigstop-p50")
	var ph []string
	for _, name := range []string{"PREPARE", "DRAIN", "FREEZE", "VERIFY", "COMMIT"} {
		ph = append(ph, fmt.Sprintf("%s p50 %.1f ms", name, pct(phases[name], 0.5)))
	}
	b.Logf("%s: pause phases: %s", lib.name, strings.Join(ph, ", "))
}
