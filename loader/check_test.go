package loader

import (
	"context"
	"errors"
	"os"
	"os/exec"
	"path/filepath"
	"reflect"
	"strings"
	"testing"

	"github.com/cilium/ebpf/btf"
	"github.com/google/go-cmp/cmp"

	"github.com/mpipause/mpipause/internal/caps"
	"github.com/mpipause/mpipause/internal/testutil"
)

// TestCrossCheck compares the BPF observer with the sock_diag observer on
// connections whose queues hold still: what both report must agree.
func TestCrossCheck(t *testing.T) {
	testutil.RequirePrivileged(t)
	r, client, server := newPair(t)
	cfg := Config{Cgroup: r.cgroup, FollowJob: true}
	b := openBPF(t, cfg)
	d, err := OpenSockDiag(context.Background(), cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer d.Close()

	cli1, srv1 := connect(t, r, client, server)
	cli2, srv2 := connect(t, r, client, server)
	client.do("write %s 50000", cli1.id)
	server.do("read %s 20000", srv1.id)
	server.do("write %s 7000", srv2.id)
	waitFor(t, b, "queues settled", func(cs []Conn) bool {
		c1, ok1 := byCookie(cs, cli1.cookie)
		c2, ok2 := byCookie(cs, srv2.cookie)
		return ok1 && ok2 && c1.SendQueue == 0 && c2.SendQueue == 0
	})

	bc, err := b.Snapshot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	dc, err := d.Snapshot(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	// What sock_diag does not read is zeroed before comparing.
	strip := func(cs []Conn) map[uint64]Conn {
		m := map[uint64]Conn{}
		for _, c := range cs {
			m[c.Cookie] = Conn{Cookie: c.Cookie, Local: c.Local, Remote: c.Remote, State: c.State,
				Netns: c.Netns, Cgroup: c.Cgroup, SendQueue: c.SendQueue, Unread: c.Unread}
		}
		return m
	}
	if diff := cmp.Diff(strip(dc), strip(bc), cmp.Comparer(func(a, b Conn) bool { return a == b })); diff != "" {
		t.Errorf("sock_diag vs BPF (-sock_diag +bpf):\n%s", diff)
	}
	want := map[uint64]uint32{srv1.cookie: 30000, cli2.cookie: 7000, cli1.cookie: 0, srv2.cookie: 0}
	for cookie, unread := range want {
		if c := strip(bc)[cookie]; c.Unread != unread {
			t.Errorf("cookie %d: Unread %d, want %d", cookie, c.Unread, unread)
		}
	}
}

// TestBPFSpill makes the records array smaller than the job so that
// conniter passes the rest through its seq_file.
func TestBPFSpill(t *testing.T) {
	testutil.RequirePrivileged(t)
	recordsMaxEntries = 1
	t.Cleanup(func() { recordsMaxEntries = 0 })
	r := newRig(t)
	h := startHelper(t, r.nsA, r.cgroup)
	o := openBPF(t, Config{Cgroup: r.cgroup, FollowJob: true})
	if o.records.MaxEntries() != 1 {
		t.Fatalf("records has %d entries, want 1", o.records.MaxEntries())
	}
	h.do("mass 127.0.0.1:0 40")
	cs := waitFor(t, o, "80 sockets", func(cs []Conn) bool { return len(cs) == 80 })
	seen := map[uint64]bool{}
	for _, c := range cs {
		if seen[c.Cookie] || c.State != StateEstablished || c.Cgroup != r.cgroupID {
			t.Fatalf("bad or repeated record %+v", c)
		}
		seen[c.Cookie] = true
	}
}

// TestOpenBadInput checks that each kind of bad input gives one clear line
// naming the problem, the right sentinel, and leaves nothing attached or
// pinned.
func TestOpenBadInput(t *testing.T) {
	testutil.RequirePrivileged(t)
	cg := testutil.NewCgroup(t)
	notBPFFS := t.TempDir()
	noMount := filepath.Join(t.TempDir(), "file")
	if err := os.WriteFile(noMount, nil, 0o600); err != nil {
		t.Fatal(err)
	}
	noBPFMountinfo := filepath.Join(t.TempDir(), "mountinfo")
	if err := os.WriteFile(noBPFMountinfo, []byte("22 1 0:21 / /proc rw - proc proc rw\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		cfg     Config
		setup   func(t *testing.T)
		want    error
		wantMsg string
	}{
		{name: "unknown cgroup", cfg: Config{Cgroup: "mpipause-test/no-such-job", Pin: true}, want: ErrNoCgroup, wantMsg: "no-such-job"},
		{name: "empty cgroup", cfg: Config{Pin: true}, want: ErrNoCgroup, wantMsg: "Config.Cgroup"},
		{name: "unknown netns", cfg: Config{Cgroup: cg, Netns: []string{"mpt-no-such-ns"}, Pin: true}, want: ErrNoNetns, wantMsg: "mpt-no-such-ns"},
		{name: "no BTF", cfg: Config{Cgroup: cg, Pin: true}, want: ErrNoBTF, wantMsg: "CONFIG_DEBUG_INFO_BTF",
			setup: func(t *testing.T) { swap(t, &btfPath, "/nonexistent/vmlinux") }},
		{name: "BPFFS not a bpffs", cfg: Config{Cgroup: cg, Pin: true, BPFFS: notBPFFS}, want: ErrNoBPFFS, wantMsg: "not a bpffs"},
		{name: "bpffs not mountable", cfg: Config{Cgroup: cg, Pin: true}, want: ErrNoBPFFS, wantMsg: "mount",
			setup: func(t *testing.T) {
				swap(t, &mountinfoPath, noBPFMountinfo)
				swap(t, &defaultBPFFS, noMount)
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			// Discovery finds this private bpffs (unless setup says
			// otherwise), so a stray pin would show here.
			bpffs := mountBPFFS(t)
			swap(t, &mountinfoPath, writeMountinfo(t, bpffs))
			swap(t, &defaultBPFFS, bpffs)
			if tt.setup != nil {
				tt.setup(t)
			}
			o, err := OpenBPF(context.Background(), tt.cfg)
			if err == nil {
				o.Detach()
				t.Fatal("OpenBPF succeeded")
			}
			if !errors.Is(err, tt.want) {
				t.Errorf("error %q is not %v", err, tt.want)
			}
			if msg := err.Error(); strings.Contains(msg, "\n") || !strings.Contains(msg, tt.wantMsg) {
				t.Errorf("error %q: want one line mentioning %q", msg, tt.wantMsg)
			}
			if _, err := os.Stat(filepath.Join(bpffs, pinRoot)); !os.IsNotExist(err) {
				t.Errorf("%s/%s exists after a failed Open", bpffs, pinRoot)
			}
			if n := sockopsAttached(t, cg); n != 0 {
				t.Errorf("%d sockops programs attached after a failed Open", n)
			}
			// Open falls back only when BPF cannot run (TestOpenNoBTFFallsBack).
			if tt.want != ErrNoBTF {
				if o, err := Open(context.Background(), tt.cfg); !errors.Is(err, tt.want) {
					if err == nil {
						o.Close()
					}
					t.Errorf("Open: %v, want %v and no fallback", err, tt.want)
				}
			}
		})
	}
}

// writeMountinfo writes a mountinfo listing with dir as its one bpffs.
func writeMountinfo(t *testing.T, dir string) string {
	p := filepath.Join(t.TempDir(), "mountinfo")
	if err := os.WriteFile(p, []byte("40 1 0:40 / "+dir+" rw - bpf bpf rw\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	return p
}

func swap[T any](t *testing.T, v *T, to T) {
	old := *v
	*v = to
	t.Cleanup(func() { *v = old })
}

// TestOpenNoBTFFallsBack checks that Open falls back to sock_diag when BPF
// cannot run, and says why.
func TestOpenNoBTFFallsBack(t *testing.T) {
	testutil.RequirePrivileged(t)
	cg := testutil.NewCgroup(t)
	swap(t, &btfPath, "/nonexistent/vmlinux")
	var reason error
	o, err := Open(context.Background(), Config{Cgroup: cg, OnFallback: func(r error) { reason = r }})
	if err != nil {
		t.Fatal(err)
	}
	defer o.Close()
	if o.Kind() != KindSockDiag || !errors.Is(reason, ErrNoBTF) {
		t.Errorf("Open without BTF: kind %s, reason %v; want sock_diag, ErrNoBTF", o.Kind(), reason)
	}
	if _, err := Open(context.Background(), Config{Cgroup: cg, Require: KindBPF}); !errors.Is(err, ErrNoBTF) {
		t.Errorf("Open with Require bpf: %v, want ErrNoBTF", err)
	}
}

// unprivEnv marks the re-executed, capability-less run of
// TestOpenUnprivileged.
const unprivEnv = "MPIPAUSE_LOADER_UNPRIV"

// TestOpenUnprivileged checks what happens without capabilities: OpenBPF
// refuses with ErrNotPrivileged naming what is missing, and Open falls back
// to sock_diag in the own network namespace. As root it runs itself again
// with every capability dropped (setpriv), as `make test-unit` does.
func TestOpenUnprivileged(t *testing.T) {
	missing, err := caps.Missing(caps.BPF, caps.Perfmon, caps.NetAdmin)
	if err != nil {
		t.Fatal(err)
	}
	if len(missing) == 0 {
		if os.Getenv(unprivEnv) != "" {
			t.Fatal("capabilities still there after setpriv")
		}
		setpriv, err := exec.LookPath("setpriv")
		if err != nil {
			t.Skip("privileged, and no setpriv (util-linux) to drop capabilities")
		}
		exe, _ := os.Executable()
		cmd := exec.Command(setpriv, "--inh-caps=-all", "--bounding-set=-all", "--", exe, "-test.run=^TestOpenUnprivileged$", "-test.v")
		cmd.Env = append(os.Environ(), unprivEnv+"=1")
		out, err := cmd.CombinedOutput()
		if err != nil || !strings.Contains(string(out), "--- PASS") {
			t.Fatalf("unprivileged run: %v\n%s", err, out)
		}
		return
	}
	t.Run("OpenBPF refuses", func(t *testing.T) {
		_, err := OpenBPF(context.Background(), Config{Cgroup: "/"})
		if !errors.Is(err, ErrNotPrivileged) || !strings.Contains(err.Error(), "CAP_BPF") || strings.Contains(err.Error(), "\n") {
			t.Errorf("OpenBPF unprivileged: %v; want one line, ErrNotPrivileged, naming CAP_BPF", err)
		}
	})
	t.Run("Open falls back to sock_diag", func(t *testing.T) {
		var reason error
		o, err := Open(context.Background(), Config{Cgroup: "/", OnFallback: func(r error) { reason = r }})
		if err != nil {
			t.Fatalf("Open unprivileged: %v", err)
		}
		defer o.Close()
		if o.Kind() != KindSockDiag || !errors.Is(reason, ErrNotPrivileged) {
			t.Errorf("Open unprivileged: kind %s, reason %v; want sock_diag, ErrNotPrivileged", o.Kind(), reason)
		}
		if _, err := o.Snapshot(context.Background()); err != nil {
			t.Errorf("sock_diag Snapshot unprivileged: %v", err)
		}
	})
	t.Run("sock_diag in another namespace refused", func(t *testing.T) {
		if _, err := Open(context.Background(), Config{Cgroup: "/", Netns: []string{"/proc/1/ns/net"}, Require: KindSockDiag}); !errors.Is(err, ErrNotPrivileged) {
			t.Errorf("sock_diag in another namespace unprivileged: %v, want ErrNotPrivileged", err)
		}
	})
	// Following the whole hierarchy reaches namespaces it may not enter.
	t.Run("namespaces it may not enter skipped", func(t *testing.T) {
		d, err := OpenSockDiag(context.Background(), Config{Cgroup: "/", FollowJob: true})
		if err != nil {
			t.Fatal(err)
		}
		defer d.Close()
		if _, err := d.Snapshot(context.Background()); err != nil {
			t.Errorf("sock_diag following the job unprivileged: %v", err)
		}
		t.Logf("skipped %v", d.Skipped())
	})
}

// TestRecordLayout checks the Go mirror of struct tcp_record, which
// Snapshot reads by casting memory, against the BTF of the compiled object.
func TestRecordLayout(t *testing.T) {
	spec, err := loadConniter()
	if err != nil {
		t.Fatal(err)
	}
	var s *btf.Struct
	if err := spec.Types.TypeByName("tcp_record", &s); err != nil {
		t.Fatal(err)
	}
	if int(s.Size) != recordSize {
		t.Errorf("tcp_record: BTF size %d, recordSize %d", s.Size, recordSize)
	}
	checkLayout(t, s, reflect.TypeFor[record]())
}

func checkLayout(t *testing.T, s *btf.Struct, gt reflect.Type) {
	t.Helper()
	if uintptr(s.Size) != gt.Size() {
		t.Errorf("%s: BTF size %d, Go size %d", s.Name, s.Size, gt.Size())
	}
	fields := map[string]reflect.StructField{}
	for i := range gt.NumField() {
		f := gt.Field(i)
		fields[strings.ToLower(f.Name)] = f
	}
	for _, m := range s.Members {
		name := strings.ReplaceAll(m.Name, "_", "")
		f, ok := fields[name]
		if !ok {
			t.Errorf("%s.%s: no Go field", s.Name, m.Name)
			continue
		}
		if uintptr(m.Offset.Bytes()) != f.Offset {
			t.Errorf("%s.%s: BTF offset %d, Go offset %d", s.Name, m.Name, m.Offset.Bytes(), f.Offset)
		}
		size, err := btf.Sizeof(m.Type)
		if err != nil || uintptr(size) != f.Type.Size() {
			t.Errorf("%s.%s: BTF size %d (%v), Go size %d", s.Name, m.Name, size, err, f.Type.Size())
		}
		if inner, ok := btf.UnderlyingType(m.Type).(*btf.Struct); ok {
			checkLayout(t, inner, f.Type)
		}
	}
}
