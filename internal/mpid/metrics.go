package mpid

import (
	"context"
	"net"
	"time"

	"github.com/mpipause/mpipause/internal/accept"
	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/metrics"
	"github.com/mpipause/mpipause/quiesce"
)

// listenMetrics opens the metrics address, if metrics are on, so that it
// listens before mpid is ready.
func (d *Daemon) listenMetrics() (net.Listener, error) {
	if d.cfg.MetricsListen == "" {
		return nil, nil
	}
	d.metrics.WatchGauges(d.gauges)
	return metrics.Listen(d.cfg.MetricsListen)
}

// serveMetrics serves the metrics on ln until ctx ends, within the
// metrics' bounds (few scrapers, few connections each); the HTTP server
// retries EMFILE and ENFILE on its own, but would end at ENOBUFS or
// ENOMEM, and logs every retry.
func (d *Daemon) serveMetrics(ctx context.Context, ln net.Listener) error {
	if ln == nil {
		return nil
	}
	return d.metrics.Serve(ctx, accept.New(ln, d.bounded(bounds(nofile()).metrics, accept.AddrKey, "metrics", "metrics")), d.log)
}

// gauges reads, at each scrape, what mpid holds anyway: its jobs and, from
// the ranks' shared pages (never asking a rank: frozen ranks cannot
// answer), their gates.
func (d *Daemon) gauges() metrics.Gauges {
	g := metrics.Gauges{Jobs: d.reg.count()}
	for _, r := range d.reg.ranks.Ranks("") {
		g.Ranks++
		if r.GateClosed() {
			g.ClosedGates++
		}
		for _, s := range r.Sockets() {
			if s.Gated {
				g.GatedSockets++
			}
			g.HeldBytes += s.Held
		}
	}
	return g
}

// pauseOutcome is the metrics' outcome of a pause that failed: state is
// the job's state after it.
func pauseOutcome(state string) string {
	if state == ctl.StateFailed {
		return metrics.Failed // some node did not confirm the rollback
	}
	return metrics.RolledBack
}

// metricPhases are a result's phases as the metrics take them.
func metricPhases(res quiesce.Result) []metrics.Phase {
	out := make([]metrics.Phase, 0, len(res.Phases))
	for _, p := range res.Phases {
		out = append(out, metrics.Phase{Name: string(p.Phase), Elapsed: p.Elapsed})
	}
	return out
}

// total is how long an operation took: the coordinator's own figure (what
// mpipause reports as total_ms), or since start if it has none (a pause
// refused by the protocol before its first round).
func total(res quiesce.Result, start time.Time) time.Duration {
	if res.Total > 0 {
		return res.Total
	}
	return time.Since(start)
}
