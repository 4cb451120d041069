package main

import (
	"bytes"
	"os"
	"path/filepath"
	"strings"
	"testing"
)

func TestRun(t *testing.T) {
	dir := t.TempDir()
	csv := "observer,sockets,sample,ms\nbpf,100,1,0.5\nsock_diag,100,1,2\n"
	if err := os.WriteFile(filepath.Join(dir, "snapshot.csv"), []byte(csv), 0o644); err != nil {
		t.Fatal(err)
	}
	var out, errb bytes.Buffer
	if code := run([]string{dir}, &out, &errb); code != 0 {
		t.Fatalf("run %s = %d, want 0; stderr:\n%s", dir, code, errb.String())
	}
	b, err := os.ReadFile(filepath.Join(dir, "snapshot-vs-sockets.svg"))
	if err != nil {
		t.Fatal(err)
	}
	if !bytes.Contains(b, []byte("Snapshot time against job size")) {
		t.Error("snapshot-vs-sockets.svg lacks its title")
	}
	if !strings.Contains(errb.String(), "benchplot: snapshot-vs-sockets.svg") {
		t.Errorf("stderr %q does not name the figure drawn", errb.String())
	}

	if err := os.WriteFile(filepath.Join(dir, "scale.csv"), []byte("transport\nmem\n"), 0o644); err != nil {
		t.Fatal(err)
	}
	if code := run([]string{dir}, &out, &errb); code != 1 {
		t.Errorf("run with a malformed scale.csv = %d, want 1", code)
	}
	for _, args := range [][]string{nil, {"a", "b"}, {"--bogus"}} {
		if code := run(args, &out, &errb); code != 2 {
			t.Errorf("run %q = %d, want 2", args, code)
		}
	}
	if code := run([]string{"--help"}, &out, &errb); code != 0 {
		t.Errorf("run --help = %d, want 0", code)
	}
}
