package main

import (
	"bytes"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mpipause/mpipause/quiesce"
)

// TestKeygenRotation walks a key file through a move to a new key: each
// step keeps the key in use accepted by the step before it, and a step out
// of order is refused with what to run instead, leaving the file as it was.
func TestKeygenRotation(t *testing.T) {
	path := filepath.Join(t.TempDir(), "cluster.key")
	run := func(args ...string) (string, error) {
		var out bytes.Buffer
		err := keygen(append(args, path), &out)
		return out.String(), err
	}
	load := func() []*quiesce.Key {
		t.Helper()
		r, err := quiesce.LoadKeys(path)
		if err != nil {
			t.Fatal(err)
		}
		return r.All()
	}
	if _, err := run(); err != nil {
		t.Fatal(err)
	}
	first := load()
	for _, c := range []struct {
		args []string
		want string
	}{
		{[]string{"--promote"}, "run --next first"},
		{[]string{"--retire"}, "nothing to retire"},
		{[]string{"--next", "--retire"}, "give one"},
	} {
		if _, err := run(c.args...); err == nil || !strings.Contains(err.Error(), c.want) {
			t.Errorf("%v on a new file: %v; want %q", c.args, err, c.want)
		}
	}
	if len(load()) != 1 {
		t.Fatal("a refused step changed the file")
	}
	if _, err := run("--next"); err != nil {
		t.Fatal(err)
	}
	next := load()
	if len(next) != 2 || next[0] != nil && *next[0] != *first[0] {
		t.Fatalf("--next: %d keys; want the key in use first, then a new one", len(next))
	}
	if _, err := run("--next"); err == nil || !strings.Contains(err.Error(), "--promote") {
		t.Errorf("--next twice: %v", err)
	}
	if _, err := run("--promote"); err != nil {
		t.Fatal(err)
	}
	if p := load(); *p[0] != *next[1] || *p[1] != *first[0] {
		t.Fatal("--promote: want the new key in use, the old one accepted")
	}
	out, err := run("--retire")
	if err != nil || !strings.Contains(out, "restart every mpid") {
		t.Fatalf("--retire: %q %v", out, err)
	}
	if r := load(); len(r) != 1 || *r[0] != *next[1] {
		t.Fatal("--retire: want only the new key")
	}
}
