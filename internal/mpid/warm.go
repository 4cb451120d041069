package mpid

import (
	"context"
	"time"

	"golang.org/x/sync/errgroup"
)

// Warm connections: a pause's rounds travel its job's tree (this node,
// then the nodes that registered ranks of it), each edge a pooled peer
// connection (quiesce.TCPTransport). A round that finds none dials, and
// pays a TCP and a TLS handshake (Ed25519 and X25519MLKEM768: about a
// millisecond of CPU on an idle core, hundreds on a busy or emulated one)
// on the pause's path, every level of the tree one after another. So the
// coordinator sends WARM over the tree of every job it coordinates when
// the tree gains an edge and every warmEvery after, which is shorter than
// the pool keeps an idle connection and than a server keeps one open: the
// connections a pause or resume takes are made before anyone asks, kept
// for the job's life, and replaced off the pause's path when a node's
// mpid restarted.
const (
	warmEvery   = 10 * time.Second
	warmTimeout = 5 * time.Second
	// warmAtOnce bounds the WARM rounds in flight: the jobs this node
	// coordinates are bounded (per user and in total), and one job with a
	// dead node must not hold the others' back for its timeout.
	warmAtOnce = 8
)

// keepWarm sends the WARM rounds until ctx ends.
func (c *coordinator) keepWarm(ctx context.Context, changed <-chan struct{}) error {
	t := time.NewTicker(warmEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return nil
		case <-t.C:
		case <-changed:
		}
		c.warmAll(ctx)
	}
}

// warmAll sends WARM over each tree of the jobs this node coordinates, at
// most warmAtOnce at a time, and waits for them.
func (c *coordinator) warmAll(ctx context.Context) {
	var g errgroup.Group
	g.SetLimit(warmAtOnce)
	for id, nodes := range c.reg.warmable() {
		g.Go(func() error {
			wctx, cancel := context.WithTimeout(ctx, warmTimeout)
			defer cancel()
			if err := c.protocol(0).Warm(wctx, id, nodes); err != nil && ctx.Err() == nil {
				if ok, held := c.reg.refusals.allow("warm " + err.Error()); ok {
					c.log.Warn("the job's next pause may have to connect to its nodes first", "job", id, "error", err, "repeats_not_logged", held)
				}
			}
			return nil
		})
	}
	_ = g.Wait()
}
