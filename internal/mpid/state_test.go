package mpid

import (
	"errors"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
)

// TestRecords: a record reads back as written; a torn file, an altered one
// and one whose name does not match its job are corrupt, never trusted; a
// failed write leaves the previous record whole.
func TestRecords(t *testing.T) {
	dir := t.TempDir()
	r := record{Version: recordVersion, Job: "j1", Owner: 1000, State: ctl.StatePaused, Since: time.Unix(1700000000, 0).UTC(),
		Nodes: []string{"n0", "n1"}, Coordinator: "n0", Ranks: 6, LocalRanks: []int{0, 1}, Last: ctl.Job{TotalMs: 12.5}}
	if err := writeRecord(dir, r); err != nil {
		t.Fatal(err)
	}
	got, err := readRecord(recordPath(dir, "j1"))
	if err != nil || got.Job != "j1" || got.Owner != 1000 || len(got.Nodes) != 2 || got.Last.TotalMs != 12.5 || !got.Since.Equal(r.Since) {
		t.Fatalf("read back %+v, %v", got, err)
	}
	if m, _ := filepath.Glob(filepath.Join(dir, ".tmp-*")); len(m) != 0 {
		t.Errorf("temporary files left: %v", m)
	}
	b, _ := os.ReadFile(recordPath(dir, "j1"))
	for name, content := range map[string][]byte{
		"torn":    b[:len(b)/2],
		"altered": []byte(string(b[:len(b)-20]) + "0000000000000000000\n"),
		"empty":   nil,
	} {
		p := filepath.Join(dir, "j1.json")
		os.WriteFile(p, content, 0o600)
		if _, err := readRecord(p); !errors.Is(err, errCorrupt) {
			t.Errorf("%s record: %v; want errCorrupt", name, err)
		}
	}
	// A record filed under another job's name.
	os.WriteFile(filepath.Join(dir, "j2.json"), b, 0o600)
	if _, err := readRecord(filepath.Join(dir, "j2.json")); !errors.Is(err, errCorrupt) {
		t.Errorf("renamed record: %v; want errCorrupt", err)
	}
	// The write that replaces a record is all or nothing: an unwritable
	// directory fails it and the old file stays as it was.
	os.WriteFile(recordPath(dir, "j1"), b, 0o600)
	os.Chmod(dir, 0o500)
	defer os.Chmod(dir, 0o700)
	if os.Geteuid() != 0 { // root writes anyway
		if err := writeRecord(dir, record{Version: recordVersion, Job: "j1"}); err == nil {
			t.Error("a write into a read-only directory succeeded")
		}
		if got, err := readRecord(recordPath(dir, "j1")); err != nil || got.Owner != 1000 {
			t.Errorf("after a failed write: %+v, %v", got, err)
		}
	}
}
