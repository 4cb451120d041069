package kerneltests

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"syscall"
	"testing"
	"time"
)

// BenchmarkStop compares, on one running 3 x 2 job per library, what a
// scheduler's stop does today with what the shim's gate does, alternately
// in the same run: SIGSTOP to every rank (time until all are stopped, and
// the bytes then left in the job's TCP queues), against closing every
// rank's gate (time until the kernel reports every connection empty). It
// is the baseline the pause's benchmark is read against. `make bench-stop`
// runs it; MPIPAUSE_BENCH_CYCLES sets the cycles per method (default 20).
func BenchmarkStop(b *testing.B) {
	for _, lib := range mpiLibs {
		b.Run(lib.name, func(b *testing.B) { benchStop(b, lib) })
	}
}

func benchStop(b *testing.B, lib mpiLib) {
	bin := binDir(b)
	sharedRig(b)
	cycles := envCount("MPIPAUSE_BENCH_CYCLES", 20)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Minute)
	defer cancel()
	srv := serveNodes(b)
	cg := jobCgroup(b, "stop-"+lib.name)
	obs := jobObserver(ctx, b, cg)
	app := filepath.Join(bin, "apps", "xchg."+lib.name)
	job := startJob(ctx, b, lib, cg, app, shimEnv(bin), "-m", "a2a", "-n", "1000000", "-s", "1M")
	all := registered(b, srv, 6, job.done)
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
	progress := func() { waitProgress(ctx, b, obs, job.done, sentBytes(ctx, obs), 8<<20) }
	signalAll := func(sig syscall.Signal) {
		for _, r := range all {
			syscall.Kill(r.Pid, sig)
		}
	}
	stopped := func() bool {
		for _, r := range all {
			st, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", r.Pid))
			if err != nil {
				return false
			}
			if f := bytes.Fields(st[bytes.LastIndexByte(st, ')')+1:]); len(f) == 0 || string(f[0]) != "T" {
				return false
			}
		}
		return true
	}

	// until polls cond every 200 us: the times measured here are tens of
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
	var stopT, gateT []time.Duration
	var stopBytes, gateBytes []uint64
	stopDirty := 0
	progress()
	b.ResetTimer()
	for i := 0; i < cycles; i++ {
		// Naive: SIGSTOP every rank at an arbitrary moment.
		t0 := time.Now()
		signalAll(syscall.SIGSTOP)
		until("every rank stopped", stopped)
		stopT = append(stopT, time.Since(t0))
		n, dirty := inflight()
		stopBytes = append(stopBytes, n)
		if dirty > 0 {
			stopDirty++
		}
		signalAll(syscall.SIGCONT)
		progress()

		// Gate: close every rank's gate and wait for the kernel to report
		// every job connection empty.
		t0 = time.Now()
		for _, r := range all {
			if _, err := r.Close(ctx); err != nil {
				b.Fatal(err)
			}
		}
		until("every connection empty", func() bool {
			for _, r := range all {
				if g, err := r.State(ctx); err != nil || g.Closing > 0 {
					return false
				}
			}
			n, _ := inflight()
			return n == 0
		})
		gateT = append(gateT, time.Since(t0))
		n, _ = inflight()
		gateBytes = append(gateBytes, n)
		for _, r := range all {
			if _, err := r.Open(ctx); err != nil {
				b.Fatal(err)
			}
		}
		progress()
	}
	b.StopTimer()
	q := func(d []time.Duration, p float64) float64 {
		s := slices.Clone(d)
		slices.Sort(s)
		return float64(s[min(len(s)-1, int(p*float64(len(s))))].Microseconds()) / 1000
	}
	mean := func(v []uint64) float64 {
		var s uint64
		for _, x := range v {
			s += x
		}
		return float64(s) / float64(len(v)) / (1 << 20)
	}
	b.ReportMetric(q(stopT, 0.5), "sigstop-p50-ms")
	b.ReportMetric(mean(stopBytes), "sigstop-inflight-MiB")
	b.ReportMetric(float64(stopDirty)/float64(cycles), "sigstop-dirty-fraction")
	b.ReportMetric(q(gateT, 0.5), "gate-p50-ms")
	b.ReportMetric(q(gateT, 0.99), "gate-p99-ms")
	b.ReportMetric(mean(gateBytes), "gate-inflight-MiB")
	b.ReportMetric(q(gateT, 0.5)/q(stopT, 0.5), "gate/sigstop-p50")
}
