package cgroupv2

import (
	"errors"
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
