package main

import (
	"bytes"
	"encoding/json"
	"errors"
	"io/fs"
	"net"
	"path/filepath"
	"strings"
	"syscall"
	"testing"

	"github.com/mpipause/mpipause/internal/caps"
	"github.com/mpipause/mpipause/internal/mountinfo"
	"github.com/mpipause/mpipause/loader"
	"golang.org/x/sys/unix"
)

// fakeNode is a node as check sees it, set field by field: a healthy one
// by default (healthyNode), each test breaking what it checks.
type fakeNode struct {
	release    string
	subdirs    []string // of every directory
	files      map[string]fileStat
	content    map[string]string
	noCaps     map[caps.Cap]bool
	rlimits    map[int]uint64
	memBefore  uint64
	memAfter   uint64
	memErr     error
	features   loader.Features
	probeErr   error
	bpffs      string
	mounts     []mountinfo.Mount
	self       string
	keys       int
	keyErr     error
	listenErr  map[string]error
	holderPID  int
	holderComm string
	dialed     map[string][3]any // served, pid, comm
	socketDir  error
	exe        string
	preloadErr error
	slurmd     bool
	addrs      []string
	local      []net.IP
}

var _ nodeFacts = (*fakeNode)(nil)

func fullFeatures() loader.Features {
	f := loader.Features{ConnIter: loader.ProgConnIter, Adoption: true, State: true, Signals: true}
	for _, p := range []string{loader.ProgSockops, loader.ProgState, loader.ProgTCPIter, loader.ProgConnIter, loader.ProgConnIterSkc, loader.ProgSignals} {
		f.Loads = append(f.Loads, loader.Load{Program: p})
	}
	return f
}

func healthyNode() *fakeNode {
	file := fileStat{Exists: true, Mode: 0o644}
	return &fakeNode{
		release: "6.12.48+deb13-amd64",
		subdirs: []string{"init.scope"},
		files: map[string]fileStat{
			"/sys/kernel/btf/vmlinux":                   file,
			"/sys/fs/cgroup/init.scope/cgroup.freeze":   file,
			"/sys/fs/cgroup/init.scope/cgroup.procs":    file,
			"/run":                                      {Exists: true, Mode: fs.ModeDir | 0o755},
			"/etc/mpipause/cluster.key":                 {Exists: true, Mode: 0o600},
			"/usr/lib/mpipause/libmpipause.so":          file,
			"/usr/lib/mpipause/mpipause_spank.so":       file,
			"/sys/fs/cgroup/system.slice/cgroup.procs":  file,
			"/sys/fs/cgroup/system.slice/cgroup.freeze": file,
		},
		content:   map[string]string{},
		rlimits:   map[int]uint64{},
		memBefore: 8 << 20, memAfter: 8 << 20,
		features: fullFeatures(),
		bpffs:    "/sys/fs/bpf",
		mounts:   []mountinfo.Mount{{Root: "/", Point: "/sys/fs/cgroup", FSType: "cgroup2"}},
		self:     "/sys/fs/cgroup/init.scope",
		keys:     1,
		exe:      "/usr/sbin/mpid",
		addrs:    []string{"10.0.0.5"},
		local:    []net.IP{net.ParseIP("10.0.0.5"), net.ParseIP("127.0.0.1")},
	}
}

func (n *fakeNode) Release() (string, error) { return n.release, nil }
func (n *fakeNode) Stat(p string) (fileStat, error) {
	return n.files[p], nil
}
func (n *fakeNode) ReadFile(p string) ([]byte, error) {
	if c, ok := n.content[p]; ok {
		return []byte(c), nil
	}
	return nil, fs.ErrNotExist
}
func (n *fakeNode) Glob(pattern string) ([]string, error) {
	var out []string
	for p := range n.content {
		if ok, _ := filepath.Match(pattern, p); ok {
			out = append(out, p)
		}
	}
	return out, nil
}
func (n *fakeNode) SubDirs(dir string) ([]string, error) { return n.subdirs, nil }
func (n *fakeNode) Writable(p string) error              { return nil }
func (n *fakeNode) MissingCaps(want ...caps.Cap) ([]string, error) {
	var out []string
	for _, c := range want {
		if n.noCaps[c] {
			out = append(out, c.String())
		}
	}
	return out, nil
}
func (n *fakeNode) Rlimit(r int) (unix.Rlimit, error) {
	return unix.Rlimit{Cur: n.rlimits[r], Max: n.rlimits[r]}, nil
}
func (n *fakeNode) RaiseMemlock() (unix.Rlimit, unix.Rlimit, error) {
	return unix.Rlimit{Cur: n.memBefore, Max: n.memBefore}, unix.Rlimit{Cur: n.memAfter, Max: n.memAfter}, n.memErr
}
func (n *fakeNode) Probe() (loader.Features, error)    { return n.features, n.probeErr }
func (n *fakeNode) BPFFS() (string, error)             { return n.bpffs, nil }
func (n *fakeNode) Mounts() ([]mountinfo.Mount, error) { return n.mounts, nil }
func (n *fakeNode) SelfCgroup() (string, error)        { return n.self, nil }
func (n *fakeNode) LoadKeys(string) (int, error)       { return n.keys, n.keyErr }
func (n *fakeNode) ListenTCP(addr string) error        { return n.listenErr[addr] }
func (n *fakeNode) PortHolder(int) (int, string, error) {
	if n.holderPID == 0 {
		return 0, "", errors.New("none")
	}
	return n.holderPID, n.holderComm, nil
}
func (n *fakeNode) DialUnix(addr string) (bool, int, string, error) {
	d, ok := n.dialed[addr]
	if !ok {
		return false, 0, "", nil
	}
	return d[0].(bool), d[1].(int), d[2].(string), nil
}
func (n *fakeNode) SocketDir(string) error      { return n.socketDir }
func (n *fakeNode) Executable() (string, error) { return n.exe, nil }
func (n *fakeNode) Preload(string) error        { return n.preloadErr }
func (n *fakeNode) LookPath(string) (string, error) {
	if n.slurmd {
		return "/usr/sbin/slurmd", nil
	}
	return "", errors.New("not found")
}
func (n *fakeNode) Hostname() (string, error)           { return "node7", nil }
func (n *fakeNode) LookupHost(string) ([]string, error) { return n.addrs, nil }
func (n *fakeNode) LocalAddrs() ([]net.IP, error)       { return n.local, nil }

// runCheck runs mpid check over n, as a table and as JSON, and checks that
// both say the same and that the exit code follows the rows.
func runCheck(t *testing.T, n *fakeNode, args ...string) (map[string]checkRow, string, int) {
	t.Helper()
	var out, errOut bytes.Buffer
	code := check(args, &out, &errOut, n)
	var jout bytes.Buffer
	jcode := check(append([]string{"--json"}, args...), &jout, &errOut, n)
	if code != jcode {
		t.Fatalf("exit %d as a table, %d as JSON", code, jcode)
	}
	var rep checkReport
	if err := json.Unmarshal(jout.Bytes(), &rep); err != nil {
		t.Fatalf("--json: %v\n%s", err, jout.String())
	}
	rows := map[string]checkRow{}
	missing := false
	lines := strings.Split(out.String(), "\n")
	if !strings.HasPrefix(lines[0], "check ") || !strings.Contains(lines[0], "status") {
		t.Errorf("table header %q", lines[0])
	}
	for _, r := range rep.Rows {
		if _, dup := rows[r.Name]; dup {
			t.Errorf("row %s twice", r.Name)
		}
		rows[r.Name] = r
		switch r.Status {
		case statusOK:
			if r.Fix != "" {
				t.Errorf("row %s is ok with a fix %q", r.Name, r.Fix)
			}
		case statusDegraded, statusMissing:
			missing = missing || r.Status == statusMissing
			if r.Fix == "" {
				t.Errorf("row %s is %s without a fix: %s", r.Name, r.Status, r.Detail)
			}
		default:
			t.Errorf("row %s: status %q", r.Name, r.Status)
		}
		if strings.Contains(r.Detail+r.Fix, "\n") {
			t.Errorf("row %s is more than one line: %q, %q", r.Name, r.Detail, r.Fix)
		}
		// The table has the same row, status and detail on one line.
		found := false
		for _, l := range lines {
			f := strings.Fields(l)
			if len(f) >= 2 && f[0] == r.Name && f[1] == r.Status && strings.HasSuffix(l, r.Detail) {
				found = true
			}
		}
		if !found {
			t.Errorf("row %s %s %q not in the table:\n%s", r.Name, r.Status, r.Detail, out.String())
		}
	}
	want := 0
	if missing {
		want = 1
	}
	if code != want || rep.Ready == missing {
		t.Errorf("exit %d, ready %v; want %d (a row missing: %v)", code, rep.Ready, want, missing)
	}
	return rows, out.String(), code
}

func wantRow(t *testing.T, rows map[string]checkRow, name, status, detail string) {
	t.Helper()
	r, ok := rows[name]
	if !ok {
		t.Fatalf("no row %s", name)
	}
	if r.Status != status || !strings.Contains(r.Detail, detail) {
		t.Errorf("row %s: %s %q; want %s saying %q", name, r.Status, r.Detail, status, detail)
	}
}

func TestCheckHealthyNode(t *testing.T) {
	rows, _, code := runCheck(t, healthyNode())
	if code != 0 {
		t.Fatalf("exit %d", code)
	}
	for _, name := range []string{"config", "kernel", "btf", "capabilities", "cap-sys-ptrace", "cap-sys-nice", "memlock",
		"bpf-sockops", "bpf-sockstat", "bpf-tcpiter", "bpf-conniter", "bpf-conniter-skc", "observer", "bpffs",
		"cgroup2", "freezer", "state-dir", "cluster-key", "node-name", "peer-port", "rank-socket", "ctl-socket", "shim", "slurm-plugin"} {
		wantRow(t, rows, name, statusOK, "")
	}
	wantRow(t, rows, "kernel", statusOK, "6.12.48+deb13-amd64")
	wantRow(t, rows, "observer", statusOK, "full")
	wantRow(t, rows, "cgroup2", statusOK, "pure v2")
	wantRow(t, rows, "freezer", statusOK, "cgroup.freeze in /sys/fs/cgroup/init.scope")
	wantRow(t, rows, "state-dir", statusOK, "/run/mpipause/mpid-node7")
	wantRow(t, rows, "shim", statusOK, "/usr/lib/mpipause/libmpipause.so")
	wantRow(t, rows, "slurm-plugin", statusOK, "not installed")
	if _, ok := rows["metrics"]; ok {
		t.Error("a metrics row with metrics off")
	}
}

// TestCheckKernels: what each kernel's probe gives becomes the program
// rows, the observer's mode, and the exit code.
func TestCheckKernels(t *testing.T) {
	t.Run("5.10", func(t *testing.T) {
		n := healthyNode()
		n.release = "5.10.0-35-amd64"
		n.memBefore, n.memAfter = 64<<10, unix.RLIM_INFINITY
		f := loader.Features{ConnIter: loader.ProgConnIterSkc, Signals: true}
		r := "load program: invalid argument"
		load := func(p, refused string) loader.Load { return loader.Load{Program: p, Refused: refused} }
		fb := func(p, instead string) loader.Fallback {
			return loader.Fallback{Program: p, Reason: r, Instead: instead}
		}
		f.Loads = []loader.Load{load(loader.ProgSockops, ""), load(loader.ProgState, r), load(loader.ProgTCPIter, r), load(loader.ProgConnIter, r), load(loader.ProgConnIterSkc, ""), load(loader.ProgSignals, "")}
		f.Fallbacks = []loader.Fallback{fb(loader.ProgState, "sockops notes the FINs"), fb(loader.ProgTCPIter, "sock_diag finds them"), fb(loader.ProgConnIter, "conniter_skc")}
		n.features = f
		rows, _, code := runCheck(t, n)
		if code != 0 {
			t.Errorf("exit %d: a degraded kernel is no missing row", code)
		}
		wantRow(t, rows, "kernel", statusOK, "5.10.0-35-amd64")
		wantRow(t, rows, "memlock", statusOK, "64 KiB, which mpid raises to unlimited")
		wantRow(t, rows, "bpf-sockops", statusOK, "loaded")
		wantRow(t, rows, "bpf-sockstat", statusDegraded, "refused: "+r+"; instead: sockops notes the FINs")
		wantRow(t, rows, "bpf-tcpiter", statusDegraded, "sock_diag finds them")
		wantRow(t, rows, "bpf-conniter", statusOK, "refused: "+r+"; instead: conniter_skc")
		wantRow(t, rows, "bpf-conniter-skc", statusOK, "loaded")
		wantRow(t, rows, "bpf-signals", statusOK, "loaded")
		wantRow(t, rows, "observer", statusDegraded, "weaker: a connection made before mpid watched")
	})
	t.Run("4.19", func(t *testing.T) {
		n := healthyNode()
		n.release = "4.19.0-27-amd64"
		n.features = loader.Features{Loads: []loader.Load{{Program: loader.ProgSockops, Refused: "unknown func bpf_sk_storage_get"}}}
		n.probeErr = errors.New("BPF programs refused by the kernel: load sockops: unknown func; the BPF observer needs Linux 5.10 or later with BTF")
		rows, _, code := runCheck(t, n)
		if code != 1 {
			t.Errorf("exit %d, want 1", code)
		}
		wantRow(t, rows, "kernel", statusMissing, "below mpid's floor 5.10")
		wantRow(t, rows, "bpf-sockops", statusMissing, "refused: unknown func bpf_sk_storage_get")
		wantRow(t, rows, "bpf-tcpiter", statusMissing, "not probed")
		wantRow(t, rows, "observer", statusMissing, "mpid does not start")
	})
	t.Run("no BTF, memlock not raised", func(t *testing.T) {
		n := healthyNode()
		delete(n.files, "/sys/kernel/btf/vmlinux")
		n.memErr = syscall.EPERM
		rows, _, _ := runCheck(t, n)
		wantRow(t, rows, "btf", statusMissing, "no /sys/kernel/btf/vmlinux")
		wantRow(t, rows, "memlock", statusOK, "not needed: Linux 5.11 and later")
		n.release = "5.10.0-35-amd64"
		rows, _, _ = runCheck(t, n)
		wantRow(t, rows, "memlock", statusMissing, "could not raise it")
	})
}

func TestCheckCapabilities(t *testing.T) {
	n := healthyNode()
	n.noCaps = map[caps.Cap]bool{caps.BPF: true, caps.SysPtrace: true, caps.SysNice: true}
	n.features, n.probeErr = loader.Features{}, errors.New("create map conns: operation not permitted")
	rows, _, code := runCheck(t, n)
	if code != 1 {
		t.Errorf("exit %d", code)
	}
	wantRow(t, rows, "capabilities", statusMissing, "missing CAP_BPF")
	wantRow(t, rows, "cap-sys-ptrace", statusMissing, "missing CAP_SYS_PTRACE")
	wantRow(t, rows, "cap-sys-nice", statusMissing, "--nice -10: permission denied")
	wantRow(t, rows, "bpf-sockops", statusMissing, "not probed: create map conns")

	// Without real-time scheduling mpid runs on with --nice alone.
	n = healthyNode()
	n.noCaps = map[caps.Cap]bool{caps.SysNice: true}
	rows, _, _ = runCheck(t, n, "--nice", "0")
	wantRow(t, rows, "cap-sys-nice", statusDegraded, "SCHED_RR (--rt-priority 1) is not")
	rows, _, _ = runCheck(t, n, "--nice", "0", "--rt-priority", "0")
	wantRow(t, rows, "cap-sys-nice", statusOK, "not needed")
	n.rlimits[unix.RLIMIT_NICE], n.rlimits[unix.RLIMIT_RTPRIO] = 30, 1
	rows, _, _ = runCheck(t, n)
	wantRow(t, rows, "cap-sys-nice", statusOK, "the rlimits allow --nice -10")
}

func TestCheckClusterKey(t *testing.T) {
	for _, tc := range []struct {
		name   string
		st     fileStat
		keyErr error
		want   string
		fix    string
	}{
		{"absent", fileStat{}, nil, "no cluster key at /etc/mpipause/cluster.key", "mpid keygen /etc/mpipause/cluster.key"},
		{"open to others", fileStat{Exists: true, Mode: 0o644}, nil, "mode 0644", "chmod 600"},
		{"not root's", fileStat{Exists: true, Mode: 0o600, UID: 1000}, nil, "owned by uid 1000", "chown root"},
		{"does not parse", fileStat{Exists: true, Mode: 0o600}, errors.New("cluster key /etc/mpipause/cluster.key is not 1 to 3 lines"), "is not 1 to 3 lines", "mpid keygen"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			n := healthyNode()
			n.files["/etc/mpipause/cluster.key"] = tc.st
			n.keyErr = tc.keyErr
			rows, _, code := runCheck(t, n)
			wantRow(t, rows, "cluster-key", statusMissing, tc.want)
			if !strings.Contains(rows["cluster-key"].Fix, tc.fix) || code != 1 {
				t.Errorf("fix %q, exit %d; want %q, 1", rows["cluster-key"].Fix, code, tc.fix)
			}
		})
	}
	// --cluster-key names another file, as in mpid.
	n := healthyNode()
	n.files["/srv/k"] = fileStat{Exists: true, Mode: 0o400}
	n.keys = 2
	rows, _, _ := runCheck(t, n, "--cluster-key", "/srv/k")
	wantRow(t, rows, "cluster-key", statusOK, "/srv/k (mode 0400, root's, 2 key(s))")
}

// TestCheckReadsTheSettingsFile: the rows follow mpid's settings file, and
// the command line wins over it, as in mpid; a file mpid refuses is bad
// usage.
func TestCheckReadsTheSettingsFile(t *testing.T) {
	conf := writeConf(t, "peer-port = 7999\ncgroup-parent = site/mpi\nstate-dir = /var/run/mp\n")
	n := healthyNode()
	n.listenErr = map[string]error{":7999": syscall.EADDRINUSE}
	n.holderPID, n.holderComm = 4242, "mpid"
	rows, _, _ := runCheck(t, n, "--config", conf)
	wantRow(t, rows, "config", statusOK, conf+": 3 settings read")
	wantRow(t, rows, "peer-port", statusOK, "TCP :7999 held by mpid (pid 4242)")
	wantRow(t, rows, "freezer", statusOK, "--cgroup-parent /sys/fs/cgroup/site/mpi is made at the first job")
	wantRow(t, rows, "state-dir", statusOK, "/var/run/mp")
	n.holderComm = "nginx"
	rows, _, code := runCheck(t, n, "--config", conf)
	wantRow(t, rows, "peer-port", statusMissing, "held by nginx (pid 4242)")
	if code != 1 {
		t.Errorf("exit %d with the peer port taken", code)
	}
	rows, _, _ = runCheck(t, n, "--config", conf, "--peer-port", "7170")
	wantRow(t, rows, "peer-port", statusOK, "TCP :7170 free")

	var out, errOut bytes.Buffer
	bad := writeConf(t, "peer-port = 0\n")
	for _, args := range [][]string{{"--config", bad}, {"--no-such-option"}, {"extra"}} {
		out.Reset()
		errOut.Reset()
		if code := check(args, &out, &errOut, healthyNode()); code != 2 || out.Len() != 0 || !strings.HasPrefix(errOut.String(), "mpid check: ") {
			t.Errorf("check %q: exit %d, stdout %q, stderr %q; want 2, one line on stderr", args, code, out.String(), errOut.String())
		}
	}
	if !strings.Contains(errOut.String(), "see mpid check --help") {
		t.Errorf("stderr %q does not point at mpid check --help", errOut.String())
	}
	out.Reset()
	if code := check([]string{"--help"}, &out, &errOut, healthyNode()); code != 0 || !strings.Contains(out.String(), "usage: mpid check") || !strings.Contains(out.String(), "-json") || !strings.Contains(out.String(), "-peer-port") {
		t.Errorf("--help: exit %d:\n%s", code, out.String())
	}
}

func TestCheckSockets(t *testing.T) {
	n := healthyNode()
	n.files["/run/mpipause/rank.sock"] = fileStat{Exists: true, Mode: fs.ModeSocket | 0o666}
	n.files["/run/mpipause/ctl.sock"] = fileStat{Exists: true, Mode: fs.ModeSocket | 0o666}
	n.dialed = map[string][3]any{"/run/mpipause/ctl.sock": {true, 77, "mpid"}}
	rows, _, _ := runCheck(t, n)
	wantRow(t, rows, "rank-socket", statusOK, "left by an mpid that is gone")
	wantRow(t, rows, "ctl-socket", statusOK, "served by mpid (pid 77): an mpid already runs")
	n.dialed["/run/mpipause/rank.sock"] = [3]any{true, 78, "socat"}
	n.files["/run/mpipause/ctl.sock"] = fileStat{Exists: true, Mode: 0o644}
	rows, _, _ = runCheck(t, n)
	wantRow(t, rows, "rank-socket", statusMissing, "served by socat (pid 78), not mpid")
	wantRow(t, rows, "ctl-socket", statusMissing, "is not a socket")
	n.socketDir = errors.New("/run/mpipause is writable by group or others (mode 0777)")
	rows, _, _ = runCheck(t, n, "--ctl-socket", "@mpid-test")
	wantRow(t, rows, "rank-socket", statusMissing, "writable by group or others")
	wantRow(t, rows, "ctl-socket", statusDegraded, "abstract")
}

func TestCheckCgroups(t *testing.T) {
	n := healthyNode()
	n.mounts = nil
	rows, _, _ := runCheck(t, n)
	wantRow(t, rows, "cgroup2", statusMissing, "not mounted")
	wantRow(t, rows, "freezer", statusMissing, "no cgroup v2 hierarchy")

	n = healthyNode()
	n.mounts = []mountinfo.Mount{{Root: "/", Point: "/sys/fs/cgroup/freezer", FSType: "cgroup"}, {Root: "/", Point: "/sys/fs/cgroup/unified", FSType: "cgroup2"}}
	n.self = "/sys/fs/cgroup/unified"
	n.files["/sys/fs/cgroup/unified/init.scope/cgroup.freeze"] = fileStat{Exists: true}
	rows, _, _ = runCheck(t, n)
	wantRow(t, rows, "cgroup2", statusOK, "at /sys/fs/cgroup/unified (hybrid")
	wantRow(t, rows, "freezer", statusOK, "cgroup.freeze in /sys/fs/cgroup/unified/init.scope")
	// A hybrid host's v2 hierarchy with no cgroup in it yet: the kernel's
	// version says.
	n.subdirs = nil
	rows, _, _ = runCheck(t, n)
	wantRow(t, rows, "freezer", statusOK, "no cgroup under /sys/fs/cgroup/unified yet to look at; Linux 6.12.48+deb13-amd64 has cgroup.freeze")
	n.release = "5.1.0-1-amd64"
	rows, _, _ = runCheck(t, n)
	wantRow(t, rows, "freezer", statusMissing, "no non-root cgroup under /sys/fs/cgroup/unified has cgroup.freeze")

	n = healthyNode()
	rows, _, _ = runCheck(t, n, "--cgroup", "system.slice")
	wantRow(t, rows, "freezer", statusOK, "/sys/fs/cgroup/system.slice/cgroup.freeze (--cgroup")
	rows, _, _ = runCheck(t, n, "--cgroup", "/sys/fs/cgroup/nope")
	wantRow(t, rows, "freezer", statusMissing, "not a cgroup v2 directory")
	n.files["/sys/fs/cgroup/mpipause/cgroup.procs"] = fileStat{Exists: true}
	rows, _, _ = runCheck(t, n)
	wantRow(t, rows, "freezer", statusMissing, "/sys/fs/cgroup/mpipause has no cgroup.freeze")
}

func TestCheckShimAndSlurm(t *testing.T) {
	n := healthyNode()
	n.exe = "/usr/local/sbin/mpid"
	rows, _, _ := runCheck(t, n)
	wantRow(t, rows, "shim", statusMissing, "no libmpipause.so at /usr/local/sbin/libmpipause.so or /usr/local/lib/mpipause/libmpipause.so")
	n = healthyNode()
	n.preloadErr = errors.New("ERROR: ld.so: object '/usr/lib/mpipause/libmpipause.so' from LD_PRELOAD cannot be preloaded (wrong ELF class: ELFCLASS32): ignored.")
	rows, _, _ = runCheck(t, n)
	wantRow(t, rows, "shim", statusMissing, "wrong ELF class")

	n = healthyNode()
	n.slurmd = true
	n.content["/etc/slurm/plugstack.conf"] = "include /etc/slurm/plugstack.conf.d/*.conf\n"
	rows, _, _ = runCheck(t, n)
	wantRow(t, rows, "slurm-plugin", statusDegraded, "names no mpipause_spank.so (installed at /usr/lib/mpipause/mpipause_spank.so)")
	n.content["/etc/slurm/plugstack.conf.d/mpipause.conf"] = "# mpipause\nrequired /usr/lib/mpipause/mpipause_spank.so default=on\n"
	rows, _, _ = runCheck(t, n)
	wantRow(t, rows, "slurm-plugin", statusOK, "/etc/slurm/plugstack.conf.d/mpipause.conf:2: required /usr/lib/mpipause/mpipause_spank.so")
	n.content["/etc/slurm/plugstack.conf.d/mpipause.conf"] = "required /opt/mpipause_spank.so shim=/opt/lib.so\n"
	rows, _, code := runCheck(t, n)
	wantRow(t, rows, "slurm-plugin", statusMissing, "names /opt/mpipause_spank.so, which does not exist")
	if code != 1 {
		t.Errorf("exit %d", code)
	}
	n.files["/opt/mpipause_spank.so"] = fileStat{Exists: true}
	rows, _, _ = runCheck(t, n)
	wantRow(t, rows, "slurm-plugin", statusMissing, "the shim /opt/lib.so, which does not exist")
	// slurm.conf's PlugStackConfig names the file.
	n.content["/etc/slurm/slurm.conf"] = "ClusterName=c\nPlugStackConfig=/etc/slurm/other.conf\n"
	rows, _, _ = runCheck(t, n)
	wantRow(t, rows, "slurm-plugin", statusDegraded, "/etc/slurm/other.conf names no mpipause_spank.so")
}

func TestCheckBPFFS(t *testing.T) {
	n := healthyNode()
	n.bpffs = ""
	rows, _, _ := runCheck(t, n)
	wantRow(t, rows, "bpffs", statusDegraded, "mpid mounts one at /sys/fs/bpf")
	n.bpffs = "/run/other/bpf"
	rows, _, _ = runCheck(t, n)
	wantRow(t, rows, "bpffs", statusDegraded, "none at /sys/fs/bpf; mpid would pin the jobs' BPF state in the first one mounted, /run/other/bpf")
}

func TestCheckNodeName(t *testing.T) {
	n := healthyNode()
	n.addrs = []string{"10.9.9.9"}
	rows, _, _ := runCheck(t, n)
	wantRow(t, rows, "node-name", statusDegraded, "node7 resolves to 10.9.9.9, no address of this node's")
	n.addrs = nil
	rows, _, _ = runCheck(t, n, "--node", "n3")
	wantRow(t, rows, "node-name", statusDegraded, "n3 does not resolve here")
	wantRow(t, rows, "state-dir", statusOK, "/run/mpipause/mpid-n3")
}

func TestKernelVersion(t *testing.T) {
	for rel, want := range map[string][2]int{"6.18.44-fc-v669": {6, 18}, "5.10.0-35-amd64": {5, 10}, "6.1": {6, 1}, "5.4.0rc1": {5, 4}} {
		if v, ok := kernelVersion(rel); !ok || v != want {
			t.Errorf("kernelVersion(%q) = %v, %v; want %v", rel, v, ok, want)
		}
	}
	if _, ok := kernelVersion("linux"); ok {
		t.Error("kernelVersion(linux) ok")
	}
}
