package cgroupv2

import (
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
)

func TestRootFrom(t *testing.T) {
	tests := []struct {
		name    string
		in      string
		want    string
		wantErr error
	}{
		{
			name: "hybrid",
			in: `31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu rw,relatime - cgroup cgroup rw,cpu
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw
`,
			want: "/sys/fs/cgroup/unified",
		},
		{
			name: "unified with optional fields",
			in:   "29 23 0:26 / /sys/fs/cgroup rw,nosuid shared:4 - cgroup2 cgroup2 rw,nsdelegate\n",
			want: "/sys/fs/cgroup",
		},
		{
			name: "escaped space",
			in:   "29 23 0:26 / /mnt/cg\\040two rw - cgroup2 none rw\n",
			want: "/mnt/cg two",
		},
		{
			name:    "bind mount of a sub-tree is not the root",
			in:      "29 23 0:26 /job /mnt/job rw - cgroup2 none rw\n",
			wantErr: ErrNotMounted,
		},
		{
			name:    "none",
			in:      "31 23 0:28 / /sys/fs/cgroup rw - tmpfs tmpfs rw\n",
			wantErr: ErrNotMounted,
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got, err := rootFrom(strings.NewReader(tt.in))
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("err = %v, want %v", err, tt.wantErr)
			}
			if got != tt.want {
				t.Fatalf("root = %q, want %q", got, tt.want)
			}
		})
	}
}

func TestTreeIDs(t *testing.T) {
	// Any directory tree will do: a cgroup's id is its directory's inode
	// number, which is what TreeIDs reads.
	root := t.TempDir()
	for _, d := range []string{"a/b", "a/c/d", "e"} {
		if err := os.MkdirAll(filepath.Join(root, d), 0o755); err != nil {
			t.Fatal(err)
		}
	}
	if err := os.WriteFile(filepath.Join(root, "a", "cgroup.procs"), nil, 0o644); err != nil {
		t.Fatal(err)
	}
	var want []uint64
	for _, d := range []string{"", "a", "a/b", "a/c", "a/c/d", "e"} {
		id, err := ID(filepath.Join(root, d))
		if err != nil {
			t.Fatal(err)
		}
		want = append(want, id)
	}

	got, err := TreeIDs(root)
	if err != nil {
		t.Fatal(err)
	}
	if len(got) == 0 || got[0] != want[0] {
		t.Fatalf("TreeIDs(%s) = %v, want the root's id %d first", root, got, want[0])
	}
	slices.Sort(got)
	slices.Sort(want)
	if !slices.Equal(got, want) {
		t.Fatalf("TreeIDs(%s) = %v, want %v", root, got, want)
	}

	if _, err := TreeIDs(filepath.Join(root, "missing")); !errors.Is(err, os.ErrNotExist) {
		t.Fatalf("TreeIDs(missing) err = %v, want ErrNotExist", err)
	}
}

// fakeTree makes, below a fresh directory, the cgroups dirs (relative),
// each with a cgroup.procs listing procs[dir]: a stand-in for cgroupfs.
func fakeTree(t *testing.T, dirs []string, procs map[string][]int) string {
	t.Helper()
	root := t.TempDir()
	var all []string
	for _, d := range append([]string{""}, dirs...) {
		for p := d; p != "." && !slices.Contains(all, p); p = filepath.Dir(p) {
			all = append(all, p) // every cgroup has a cgroup.procs
		}
	}
	for _, d := range all {
		p := filepath.Join(root, d)
		if err := os.MkdirAll(p, 0o755); err != nil {
			t.Fatal(err)
		}
		var b strings.Builder
		for _, pid := range procs[d] {
			fmt.Fprintf(&b, "%d\n", pid)
		}
		if err := os.WriteFile(filepath.Join(p, "cgroup.procs"), []byte(b.String()), 0o644); err != nil {
			t.Fatal(err)
		}
	}
	return root
}

// many is n cgroups a%d/b: 2n below the root.
func many(n int) []string {
	var out []string
	for i := range n {
		out = append(out, fmt.Sprintf("a%d/b", i))
	}
	return out
}

// TestBoundBelow: a Bound's walks read at most Below cgroups below their
// roots, all the walks together, and fail past them naming the root and
// the bound; the roots are not counted.
func TestBoundBelow(t *testing.T) {
	small := fakeTree(t, many(2), map[string][]int{"": {10}, "a1/b": {11}}) // 4 below
	big := fakeTree(t, many(3), nil)                                        // 6 below
	for _, walk := range []struct {
		name string
		fn   func(*Bound, string) (int, error)
	}{
		{"TreeIDs", func(b *Bound, dir string) (int, error) { ids, err := b.TreeIDs(dir); return len(ids), err }},
		{"Members", func(b *Bound, dir string) (int, error) { ps, err := b.Members(dir); return len(ps), err }},
	} {
		t.Run(walk.name, func(t *testing.T) {
			b := &Bound{Below: 4, Procs: 100}
			if _, err := walk.fn(b, small); err != nil {
				t.Fatalf("a tree of 4 below within a bound of 4: %v", err)
			}
			_, err := walk.fn(&Bound{Below: 5, Procs: 100}, big)
			if !errors.Is(err, ErrTooMany) || !strings.Contains(err.Error(), big+":") || !strings.Contains(err.Error(), "more than 5 cgroups") {
				t.Fatalf("a tree of 6 below a bound of 5: err %v, want ErrTooMany naming %s and 5", err, big)
			}
			// One bound over two trees: 4, then 6 more.
			b = &Bound{Below: 9, Procs: 100}
			if _, err := walk.fn(b, small); err != nil {
				t.Fatal(err)
			}
			if _, err := walk.fn(b, big); !errors.Is(err, ErrTooMany) {
				t.Fatalf("10 below two roots within one bound of 9: err %v, want ErrTooMany", err)
			}
		})
	}
}

// TestBoundProcs: a Bound's Members read at most Procs processes, all its
// walks together, and fail past them naming the root and the bound.
func TestBoundProcs(t *testing.T) {
	dir := fakeTree(t, []string{"x", "y"}, map[string][]int{"": {1, 2}, "x": {3}, "y": {4, 5}})
	if ps, err := (&Bound{Below: 2, Procs: 5}).Members(dir); err != nil || len(ps) != 5 {
		t.Fatalf("5 processes within a bound of 5: %v, %v", ps, err)
	}
	_, err := (&Bound{Below: 2, Procs: 4}).Members(dir)
	if !errors.Is(err, ErrTooMany) || !strings.Contains(err.Error(), dir+":") || !strings.Contains(err.Error(), "more than 4 processes") {
		t.Fatalf("5 processes past a bound of 4: err %v, want ErrTooMany naming %s and 4", err, dir)
	}
	b := &Bound{Below: 4, Procs: 7}
	if _, err := b.Members(dir); err != nil {
		t.Fatal(err)
	}
	if _, err := b.Members(dir); !errors.Is(err, ErrTooMany) {
		t.Fatalf("10 processes in two walks of one bound of 7: err %v, want ErrTooMany", err)
	}
}

// TestProcsMax: ProcsMax reads max pids and fails past them, naming the
// cgroup and the bound.
func TestProcsMax(t *testing.T) {
	const max = 16384
	pids := make([]int, max+1)
	for i := range pids {
		pids[i] = 4000000 + i // 7 digits, as large as a pid gets
	}
	at := fakeTree(t, nil, map[string][]int{"": pids[:max]})
	if got, err := ProcsMax(at, max); err != nil || len(got) != max {
		t.Fatalf("ProcsMax of %d pids, bound %d: %d, %v", max, max, len(got), err)
	}
	past := fakeTree(t, nil, map[string][]int{"": pids})
	_, err := ProcsMax(past, max)
	if !errors.Is(err, ErrTooMany) || !strings.Contains(err.Error(), past) || !strings.Contains(err.Error(), "16384") {
		t.Fatalf("ProcsMax of %d pids, bound %d: err %v, want ErrTooMany naming the cgroup and the bound", max+1, max, err)
	}
}

// TestMembersMax: MembersMax walks max cgroups, its root among them, and
// fails past them.
func TestMembersMax(t *testing.T) {
	dir := fakeTree(t, many(2), map[string][]int{"a0/b": {7}}) // 5 cgroups
	if ps, err := MembersMax(dir, 5); err != nil || len(ps) != 1 {
		t.Fatalf("MembersMax of 5 cgroups, bound 5: %v, %v", ps, err)
	}
	if _, err := MembersMax(dir, 4); !errors.Is(err, ErrTooMany) || !strings.Contains(err.Error(), "more than 4 cgroups") {
		t.Fatalf("MembersMax of 5 cgroups, bound 4: err %v, want ErrTooMany", err)
	}
}
