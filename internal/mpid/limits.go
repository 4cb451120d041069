package mpid

import (
	"fmt"
	"math"
	"net"
	"runtime/debug"
	"runtime/metrics"

	"github.com/mpipause/mpipause/internal/accept"
	"github.com/mpipause/mpipause/internal/ranks"
	"golang.org/x/sys/unix"
)

// Connections one user may hold open on the control socket: the CLI makes
// one per command and holds it for a pause at most, so this is that many
// commands of one user at once; root's too (the SPANK plugin asks for a
// step's key in a few milliseconds).
const ctlPerUID = 64

// A rank holds its connection while it runs; on top of the ranks one user
// may register, its JOINs and HELLOs under way.
const rankPerUID = ranks.MaxRanksPerUID + 4*ranks.MaxPendingPerUID

// A node's peer opens a connection per job it pauses at once and pools a
// few (quiesce.DefaultMaxIdle); metrics are one scraper's few GETs.
const (
	peerPerAddr    = 256
	metricsPerAddr = 8
	metricsTotal   = 32
)

// socketBounds are the per-socket bounds of connections (accept.Options'
// PerKey and Total).
type socketBounds struct {
	ctl, rank, peer, metrics accept.Options
}

// bounds derives each socket's bounds from the file descriptors mpid may
// hold, nofile (RLIMIT_NOFILE's soft limit, which the Go runtime raises to
// the hard limit at start: systemd's default hard limit is 524288, a
// shell's often a few thousand). An eighth is kept for mpid's own (BPF
// maps and programs, cgroup files, pidfds of JOINs, connections it dials);
// of the rest a rank takes two (its connection and its pidfd), so the
// three local and remote sockets together stay below the limit whatever
// each is sent. The caps past the fractions bound memory more than
// descriptors: a connection is a goroutine and its buffers, some tens of
// KiB, and GOMEMLIMIT (dist/systemd/mpid.service) is under 1 GiB.
func bounds(nofile uint64) socketBounds {
	usable := int(min(nofile, math.MaxInt32))
	usable -= max(usable/8, 64)
	usable = max(usable, 64)
	per := func(perKey, total int) accept.Options {
		return accept.Options{PerKey: min(perKey, max(total/2, 1)), Total: total}
	}
	return socketBounds{
		ctl:     per(ctlPerUID, min(usable/4, 4096)),
		rank:    per(rankPerUID, min(usable/6, 32768)),
		peer:    per(peerPerAddr, min(usable/4, 8192)),
		metrics: per(metricsPerAddr, min(usable/16, metricsTotal)),
	}
}

// nofile is mpid's RLIMIT_NOFILE soft limit.
func nofile() uint64 {
	var r unix.Rlimit
	if err := unix.Getrlimit(unix.RLIMIT_NOFILE, &r); err != nil {
		return 1024
	}
	return r.Cur
}

// heapFull is each socket's accept.Options.Busy: past nine tenths of the
// Go memory limit (GOMEMLIMIT), new connections are closed at accept, so
// that a flood makes mpid refuse new work rather than grow into its
// unit's MemoryMax and be killed. Without a limit it never refuses.
func heapFull() error {
	limit := debug.SetMemoryLimit(-1)
	if limit == math.MaxInt64 {
		return nil
	}
	s := []metrics.Sample{{Name: "/memory/classes/total:bytes"}, {Name: "/memory/classes/heap/released:bytes"}}
	metrics.Read(s)
	if s[0].Value.Kind() != metrics.KindUint64 || s[1].Value.Kind() != metrics.KindUint64 {
		return nil
	}
	// What the runtime counts against the limit: all it mapped less what it
	// gave back to the kernel.
	used := s[0].Value.Uint64() - s[1].Value.Uint64()
	if used < uint64(limit)/10*9 {
		return nil
	}
	return fmt.Errorf("mpid uses %d MiB of its %d MiB memory limit", used>>20, limit>>20)
}

// refusedLog logs what socket closes at accept, or the accept errors it
// waits out, a line per cause per quiet period (a flood must not bury
// mpid's own errors under journald's rate limit), and counts each in
// connections_refused_total under label.
func (d *Daemon) refusedLog(socket, label string) func(cause, key string, peer net.Addr, err error) {
	limit := newLogLimiter(refusalQuiet)
	return func(cause, key string, peer net.Addr, err error) {
		d.metrics.ConnectionRefused(label)
		ok, held := limit.allow(cause)
		if !ok {
			return
		}
		var args []any
		if key != "" {
			args = append(args, "from", key)
		}
		// A unix peer's address is its autobind name at best: its uid
		// (key) says who it is.
		if _, isUnix := peer.(*net.UnixAddr); peer != nil && !isUnix && peer.String() != "" {
			args = append(args, "peer", peer.String())
		}
		args = append(args, "error", err)
		if held > 0 {
			args = append(args, "refused_since_last_line", held)
		}
		d.log.Warn(socket+": "+cause, args...)
	}
}
