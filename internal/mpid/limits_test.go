package mpid

import (
	"math"
	"runtime/debug"
	"testing"
)

// TestBounds: whatever the descriptor limit, the sockets' totals together
// (two descriptors a rank) stay below it with room for mpid's own, and one
// peer can never take a whole socket.
func TestBounds(t *testing.T) {
	for _, nofile := range []uint64{256, 1024, 20000, 65536, 524288, math.MaxUint64} {
		b := bounds(nofile)
		fds := b.ctl.Total + 2*b.rank.Total + b.peer.Total + b.metrics.Total
		if uint64(fds) >= min(nofile, math.MaxInt32)*7/8 {
			t.Errorf("nofile %d: the sockets may hold %d descriptors, more than 7/8 of the limit (%+v)", nofile, fds, b)
		}
		for name, o := range map[string]struct{ PerKey, Total int }{"ctl": {b.ctl.PerKey, b.ctl.Total}, "rank": {b.rank.PerKey, b.rank.Total},
			"peer": {b.peer.PerKey, b.peer.Total}, "metrics": {b.metrics.PerKey, b.metrics.Total}} {
			if o.PerKey < 1 || o.Total < 2 || o.PerKey > o.Total/2 {
				t.Errorf("nofile %d: %s per peer %d of %d in all", nofile, name, o.PerKey, o.Total)
			}
		}
	}
	if b := bounds(524288); b.ctl.PerKey != ctlPerUID || b.rank.PerKey != rankPerUID {
		t.Errorf("under systemd's default limit: control %d per uid, rank %d; want %d and %d", b.ctl.PerKey, b.rank.PerKey, ctlPerUID, rankPerUID)
	}
}

// TestHeapFull: refusals start once the Go memory limit is nearly reached,
// and never without a limit.
func TestHeapFull(t *testing.T) {
	old := debug.SetMemoryLimit(math.MaxInt64)
	defer debug.SetMemoryLimit(old)
	if err := heapFull(); err != nil {
		t.Errorf("without a limit: %v", err)
	}
	debug.SetMemoryLimit(1 << 20) // below what any Go process maps
	if err := heapFull(); err == nil {
		t.Error("at 1 MiB of limit: not full")
	}
	debug.SetMemoryLimit(1 << 40)
	if err := heapFull(); err != nil {
		t.Errorf("at 1 TiB of limit: %v", err)
	}
}
