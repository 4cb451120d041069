package node

import (
	"context"
	"io"
	"log/slog"
	"testing"
)

// coordinated is Jobs for one job coordinated by coordinator.
type coordinated struct {
	observed
	coordinator string
}

func (c coordinated) WithJob(_ string, fn func(uint32, string) error) error {
	return fn(1000, c.coordinator)
}

// dropCount counts the records dropped.
type dropCount struct{ dropped []string }

func (d *dropCount) Pausing(string) bool        { return false }
func (d *dropCount) WriteCommit(c Commit) error { return nil }
func (d *dropCount) Drop(job string)            { d.dropped = append(d.dropped, job) }

// TestThawKeepsTheCoordinatorsRecord: a node thawing a job drops its own
// record of the pause committed there, but the job's coordinator keeps
// its record, of the whole pause and its nodes, for its operation to drop
// once every node has confirmed: a resume or rollback that some node did
// not confirm must still be found by a restarted coordinator.
func TestThawKeepsTheCoordinatorsRecord(t *testing.T) {
	for _, tc := range []struct {
		coordinator string
		dropped     int
	}{{"n0", 0}, {"n1", 1}, {"", 1}} {
		recs := &dropCount{}
		s := NewSteps(&Role{Name: "n0", Jobs: coordinated{coordinator: tc.coordinator}, Freezer: noFreezer{},
			Log: slog.New(slog.NewTextHandler(io.Discard, nil))}, slog.New(slog.NewTextHandler(io.Discard, nil)))
		s.Records = recs
		if err := s.Thaw(context.Background(), "1000:j"); err != nil {
			t.Fatal(err)
		}
		if len(recs.dropped) != tc.dropped {
			t.Errorf("node n0 thawing a job coordinated by %q dropped %d records, want %d", tc.coordinator, len(recs.dropped), tc.dropped)
		}
	}
}

// noFreezer freezes nothing: the test's jobs have no cgroups.
type noFreezer struct{}

func (noFreezer) Freeze(context.Context, string) error { return nil }
func (noFreezer) Thaw(context.Context, string) error   { return nil }
