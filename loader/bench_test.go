package loader

import (
	"context"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/testutil"
)

// BenchmarkSnapshot10k times one Snapshot of a job with 10,000 established
// sockets (5,000 loopback connections, both ends in the job cgroup, in a
// fresh network namespace), for the BPF observer and, in the same run, the
// sock_diag observer; and, for comparison, one iter/tcp pass over the same
// namespace (what a Snapshot through iter/tcp alone would cost).
func BenchmarkSnapshot10k(b *testing.B) {
	testutil.RequirePrivileged(b)
	const conns = 5000
	id := randomID(b)
	ns := "mpt-" + id + "-bench"
	cg := newCgroup(b)
	newNetns(b, ns)
	h := startHelper(b, ns, cg)

	// Open before the connections exist, so that sockops registers them
	// all, as it does for a job started under mpipause.
	bpf, err := OpenBPF(context.Background(), Config{Cgroup: cg, Netns: []string{ns}})
	if err != nil {
		b.Fatal(err)
	}
	defer bpf.Close()
	h.do("mass 127.0.0.1:0 %d", conns)

	run := func(b *testing.B, o Observer) {
		cs, err := o.Snapshot(context.Background())
		if err != nil {
			b.Fatal(err)
		}
		if len(cs) != 2*conns {
			b.Fatalf("%s snapshot has %d connections, want %d", o.Kind(), len(cs), 2*conns)
		}
		b.ResetTimer()
		for b.Loop() {
			if _, err := o.Snapshot(context.Background()); err != nil {
				b.Fatal(err)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/1000, "ms/snapshot")
	}
	b.Run("bpf", func(b *testing.B) { run(b, bpf) })
	b.Run("iter_tcp_pass", func(b *testing.B) {
		ns, ok := bpf.ns.explicit[0], len(bpf.ns.explicit) == 1
		if !ok {
			b.Fatal("no namespace")
		}
		for b.Loop() {
			recs, err := bpf.readTCPIter(ns)
			if err != nil {
				b.Fatal(err)
			}
			if len(recs) != 2*conns {
				b.Fatalf("iter/tcp pass has %d records, want %d", len(recs), 2*conns)
			}
		}
		b.ReportMetric(float64(b.Elapsed().Microseconds())/float64(b.N)/1000, "ms/snapshot")
	})
	d, err := OpenSockDiag(context.Background(), Config{Cgroup: cg, Netns: []string{ns}})
	if err != nil {
		b.Fatal(err)
	}
	defer d.Close()
	b.Run("sock_diag", func(b *testing.B) { run(b, d) })
	// The figure to quote: both observers alternately in one loop, so the
	// machine's noise falls on both alike, and their ratio.
	b.Run("bpf_vs_sock_diag", func(b *testing.B) {
		var tb, td time.Duration
		for b.Loop() {
			t0 := time.Now()
			if _, err := bpf.Snapshot(context.Background()); err != nil {
				b.Fatal(err)
			}
			t1 := time.Now()
			if _, err := d.Snapshot(context.Background()); err != nil {
				b.Fatal(err)
			}
			tb, td = tb+t1.Sub(t0), td+time.Since(t1)
		}
		n := float64(b.N)
		b.ReportMetric(tb.Seconds()*1000/n, "bpf-ms")
		b.ReportMetric(td.Seconds()*1000/n, "sock_diag-ms")
		b.ReportMetric(tb.Seconds()/td.Seconds(), "bpf/sock_diag")
	})
}
