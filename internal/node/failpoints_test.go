//go:build failpoints

package node

import (
	"context"
	"io"
	"log/slog"
	"os"
	"path/filepath"
	"testing"
	"time"
)

// failpointDir makes ROOT/node0 with STEP armed "before" and returns the
// hook for it.
func failpointDir(t *testing.T) (failpoints, string) {
	t.Helper()
	dir := filepath.Join(t.TempDir(), "node0")
	if err := os.Mkdir(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	if err := os.WriteFile(filepath.Join(dir, "PREPARE"), []byte("before\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	return failpoints{dir: dir, log: slog.New(slog.NewTextHandler(io.Discard, nil))}, dir
}

// holdDone runs the hold and returns when it ended on its own: a hold
// that held is ended by cancelling it once .reached is there.
func holdDone(t *testing.T, f failpoints, dir string) (held bool) {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	done := make(chan struct{})
	go func() { f.hold(ctx, "PREPARE", "before", "j1"); close(done) }()
	for {
		select {
		case <-done:
			return held
		default:
		}
		if !held {
			if b, err := os.ReadFile(filepath.Join(dir, "PREPARE.reached")); err == nil && string(b) == "j1" {
				held = true
				cancel()
			}
		}
		time.Sleep(time.Millisecond)
	}
}

func TestFailpointHolds(t *testing.T) {
	f, dir := failpointDir(t)
	if !holdDone(t, f, dir) {
		t.Fatal("an armed failpoint did not hold")
	}
	fi, err := os.Lstat(filepath.Join(dir, "PREPARE.reached"))
	if err != nil || fi.Mode().Perm() != 0o600 {
		t.Errorf("PREPARE.reached: %v, %v; want mode 0600", fi, err)
	}
}

// TestFailpointNeverFollowsOrOverwrites: a .reached that is a symbolic link
// (to a file root would otherwise write) or an existing file is left alone,
// and the hook does not hold.
func TestFailpointNeverFollowsOrOverwrites(t *testing.T) {
	for _, link := range []bool{true, false} {
		f, dir := failpointDir(t)
		victim := filepath.Join(t.TempDir(), "victim")
		if err := os.WriteFile(victim, []byte("keep"), 0o644); err != nil {
			t.Fatal(err)
		}
		reached := filepath.Join(dir, "PREPARE.reached")
		if link {
			if err := os.Symlink(victim, reached); err != nil {
				t.Fatal(err)
			}
		} else {
			victim = reached
			if err := os.WriteFile(victim, []byte("keep"), 0o644); err != nil {
				t.Fatal(err)
			}
		}
		if holdDone(t, f, dir) {
			t.Errorf("link %v: held", link)
		}
		if b, _ := os.ReadFile(victim); string(b) != "keep" {
			t.Errorf("link %v: %s now holds %q, want it untouched", link, victim, b)
		}
	}
}

// TestFailpointRefusesOpenDirectory: a failpoint directory that others may
// write, or one reached through a symbolic link, arms nothing.
func TestFailpointRefusesOpenDirectory(t *testing.T) {
	f, dir := failpointDir(t)
	if err := os.Chmod(dir, 0o777); err != nil {
		t.Fatal(err)
	}
	if holdDone(t, f, dir) {
		t.Error("held in a directory others may write")
	}
	if err := os.Chmod(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	link := filepath.Join(t.TempDir(), "node0")
	if err := os.Symlink(dir, link); err != nil {
		t.Fatal(err)
	}
	f.dir = link
	if holdDone(t, f, dir) {
		t.Error("held in a directory reached through a symbolic link")
	}
	if _, err := os.Lstat(filepath.Join(dir, "PREPARE.reached")); err == nil {
		t.Error("PREPARE.reached written in a refused directory")
	}
	// Another user's directory (needs CAP_CHOWN to make one).
	if err := os.Chown(dir, 65534, 65534); err != nil {
		t.Skipf("no other user's directory to try: %v", err)
	}
	f.dir = dir
	if holdDone(t, f, dir) {
		t.Error("held in another user's directory")
	}
}
