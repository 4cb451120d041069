package quiesce

import (
	"context"
	"errors"
	"strings"
	"testing"
)

// TestPrepareDrainOneRound: PREPARE carries Check, each node closes its
// gates and answers with the first drain round's check; where every node
// did and all were clean, no DRAIN round follows. A node that does not
// make the check (an older agent: it ignores Check on PREPARE and answers
// empty) must never count as drained: the DRAIN round stays. A check that
// fails is DRAIN's failure, one that finds bytes is followed by DRAIN.
func TestPrepareDrainOneRound(t *testing.T) {
	t.Run("all clean", func(t *testing.T) {
		c := countingCluster(t, 6)
		res, err := NewCoordinator(c.net, fastOpts()).Pause(context.Background(), "j", c.names)
		if err != nil {
			t.Fatal(err)
		}
		if got, want := phaseRounds(res), "PREPARE:1 DRAIN:0 FREEZE:1 VERIFY:0 COMMIT:1"; got != want {
			t.Errorf("phases %s, want %s", got, want)
		}
		checkPaused(t, c)
		for _, f := range c.fakes {
			if s := f.state(); s.calls["prepare"] != 1 || s.calls["drain"] != 1 {
				t.Errorf("%s: %d prepares, %d drain checks; want one each", f.name, s.calls["prepare"], s.calls["drain"])
			}
		}
	})
	t.Run("an older node", func(t *testing.T) {
		c := countingCluster(t, 6)
		old := c.agents[4]
		c.net.Register("node4", func(ctx context.Context, m Message) (Message, error) {
			if m.Kind == KindPrepare {
				m.Check = false
			}
			return old.Handle(ctx, m)
		})
		// Bytes node4's older agent would not have looked for in PREPARE.
		c.fakes[4].left = 1
		res, err := NewCoordinator(c.net, fastOpts()).Pause(context.Background(), "j", c.names)
		if err != nil {
			t.Fatal(err)
		}
		if got := phaseRounds(res); !strings.HasPrefix(got, "PREPARE:1 DRAIN:2 ") {
			t.Errorf("phases %s, want PREPARE:1 DRAIN:2 ...: node4 made no check in PREPARE", got)
		}
		checkPaused(t, c)
	})
	t.Run("bytes found", func(t *testing.T) {
		c := countingCluster(t, 6)
		c.fakes[2].left = 2
		res, err := NewCoordinator(c.net, fastOpts()).Pause(context.Background(), "j", c.names)
		if err != nil {
			t.Fatal(err)
		}
		if got := phaseRounds(res); !strings.HasPrefix(got, "PREPARE:1 DRAIN:2 ") {
			t.Errorf("phases %s, want PREPARE:1 DRAIN:2 ...", got)
		}
		checkPaused(t, c)
	})
	t.Run("check fails", func(t *testing.T) {
		c := countingCluster(t, 6)
		c.fakes[3].fail = KindDrain
		_, err := NewCoordinator(c.net, fastOpts()).Pause(context.Background(), "j", c.names)
		var ae *AbortError
		if !errors.As(err, &ae) || ae.Phase != KindDrain || !strings.Contains(err.Error(), "node3: DRAIN: ") {
			t.Fatalf("want an abort in DRAIN naming node3's check, got %v", err)
		}
		checkRolledBack(t, c)
	})
	t.Run("cancelled on the check", func(t *testing.T) {
		// mpid's listener cancels a pause whose first drain check counts
		// too few ranks: the pause ends in DRAIN, as from a DRAIN round.
		c := countingCluster(t, 6)
		ctx, cancel := context.WithCancel(context.Background())
		defer cancel()
		ctx = WithProgress(ctx, func(p Progress) {
			if p.Phase == KindPrepare && !p.Done && p.Report.DrainChecked == p.Report.Nodes {
				cancel()
			}
		})
		_, err := NewCoordinator(c.net, fastOpts()).Pause(ctx, "j", c.names)
		var ae *AbortError
		if !errors.As(err, &ae) || ae.Phase != KindDrain || !errors.Is(err, context.Canceled) {
			t.Fatalf("want an abort in DRAIN, cancelled, got %v", err)
		}
		checkRolledBack(t, c)
	})
	t.Run("prepare fails", func(t *testing.T) {
		c := countingCluster(t, 6)
		c.fakes[3].fail = KindPrepare
		_, err := NewCoordinator(c.net, fastOpts()).Pause(context.Background(), "j", c.names)
		var ae *AbortError
		if !errors.As(err, &ae) || ae.Phase != KindPrepare {
			t.Fatalf("want an abort in PREPARE, got %v", err)
		}
		checkRolledBack(t, c)
	})
}
