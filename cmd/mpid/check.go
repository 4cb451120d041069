package main

import (
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"math"
	"net"
	"strconv"
	"strings"

	"github.com/mpipause/mpipause/internal/caps"
	"github.com/mpipause/mpipause/internal/mountinfo"
	"github.com/mpipause/mpipause/internal/term"
	"github.com/mpipause/mpipause/loader"
	"golang.org/x/sys/unix"
)

const checkUsage = `usage: mpid check [--json] [options]

Says whether this node has what mpid needs, one row each: ok; degraded (mpid
runs, but something holds less than docs/guarantees.md states, or is slower);
or missing (mpid does not start, or cannot pause a job). Each row says what
it found and, if not ok, what to do. It takes mpid's options and reads its
settings file as mpid does, so check with the options the service runs with
(the unit's: --config /etc/mpipause/mpid.conf, the default).

It changes nothing on the node: it makes no cgroup and no directory, writes
no file and leaves no BPF program, map or pin. It loads each of mpid's BPF
programs once, and closes it, to see whether the kernel takes it (as mpid
does at start); it binds the peer port for a moment, and connects to the
unix sockets of an mpid already running, to say which process serves them.

exit status:
  0  nothing missing (degraded rows allowed)
  1  something missing: mpid would not start, or not pause jobs, here
  2  bad usage, or an option or settings file mpid itself would refuse

options:
`

// Row statuses.
const (
	statusOK       = "ok"
	statusDegraded = "degraded"
	statusMissing  = "missing"
)

// checkRow is one thing mpid needs on this node; its JSON names are a
// contract for scripts.
type checkRow struct {
	Name   string `json:"name"`
	Status string `json:"status"`
	Detail string `json:"detail"`
	Fix    string `json:"fix"` // what to do; "" when ok
}

// checkReport is what mpid check prints.
type checkReport struct {
	Node     string     `json:"node"`
	Ready    bool       `json:"ready"` // nothing missing
	Missing  int        `json:"missing"`
	Degraded int        `json:"degraded"`
	Rows     []checkRow `json:"rows"`
}

// fileStat is what check reads of a path (lstat).
type fileStat struct {
	Exists bool
	Mode   fs.FileMode
	UID    uint32
}

// nodeFacts is everything mpid check reads of the node: kernelNode asks the
// kernel and the file system; the tests fake it. None of it changes the
// node.
type nodeFacts interface {
	Release() (string, error)
	Stat(path string) (fileStat, error) // lstat; no error for an absent path
	ReadFile(path string) ([]byte, error)
	Glob(pattern string) ([]string, error)
	SubDirs(dir string) ([]string, error)
	Writable(path string) error // access(2) W_OK: root's, and a read-only mount's EROFS
	MissingCaps(want ...caps.Cap) ([]string, error)
	Rlimit(resource int) (unix.Rlimit, error)
	// RaiseMemlock does what loader.CheckBPF does to this process's
	// RLIMIT_MEMLOCK, where the kernel charges BPF maps to it.
	RaiseMemlock() (before, after unix.Rlimit, err error)
	Probe() (loader.Features, error)
	BPFFS() (string, error)
	Mounts() ([]mountinfo.Mount, error)
	SelfCgroup() (string, error) // this process's cgroup v2 directory
	LoadKeys(path string) (int, error)
	// ListenTCP binds addr and closes it at once.
	ListenTCP(addr string) error
	// PortHolder is the process listening on TCP port, if one is found.
	PortHolder(port int) (pid int, comm string, err error)
	// DialUnix says whether a process serves the unix socket addr
	// (ECONNREFUSED or ENOENT: none), and which (SO_PEERCRED).
	DialUnix(addr string) (served bool, pid int, comm string, err error)
	// SocketDir is internal/mpid's rule for the directory of its sockets.
	SocketDir(dir string) error
	Executable() (string, error)
	// Preload runs a program with lib in LD_PRELOAD, no other environment.
	Preload(lib string) error
	LookPath(file string) (string, error)
	Hostname() (string, error)
	LookupHost(name string) ([]string, error)
	LocalAddrs() ([]net.IP, error)
}

// check is mpid check: the exit code.
func check(args []string, stdout, stderr io.Writer, n nodeFacts) int {
	var asJSON bool
	cfg, err := parseCommand("mpid check", checkUsage, args, stdout, func(fs *flag.FlagSet) {
		fs.BoolVar(&asJSON, "json", false, "print the rows as one JSON object")
	})
	err = cfg.blame(err)
	if errors.Is(err, flag.ErrHelp) {
		return 0
	}
	if err != nil {
		fmt.Fprintf(stderr, "mpid check: %v\n", err)
		return 2
	}
	rep := checkNode(cfg, n)
	if asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		if err := enc.Encode(rep); err != nil {
			fmt.Fprintf(stderr, "mpid check: %v\n", err)
			return 1
		}
	} else {
		rep.write(stdout)
	}
	if !rep.Ready {
		return 1
	}
	return 0
}

// write prints the report as a table: a row a line, and under each row
// that is not ok, what to do.
func (r checkReport) write(w io.Writer) {
	nw, sw := len("check"), len("status")
	for _, row := range r.Rows {
		nw, sw = max(nw, len(row.Name)), max(sw, len(row.Status))
	}
	fmt.Fprintf(w, "%-*s  %-*s  %s\n", nw, "check", sw, "status", "found")
	for _, row := range r.Rows {
		fmt.Fprintf(w, "%-*s  %-*s  %s\n", nw, row.Name, sw, row.Status, term.Safe(row.Detail))
		if row.Fix != "" {
			fmt.Fprintf(w, "%-*s  %-*s  fix: %s\n", nw, "", sw, "", term.Safe(row.Fix))
		}
	}
	fmt.Fprintln(w)
	switch {
	case !r.Ready:
		fmt.Fprintf(w, "node %s: %d missing, %d degraded: mpid cannot serve here as configured\n", term.Safe(r.Node), r.Missing, r.Degraded)
	case r.Degraded > 0:
		fmt.Fprintf(w, "node %s: ready, %d degraded\n", term.Safe(r.Node), r.Degraded)
	default:
		fmt.Fprintf(w, "node %s: ready\n", term.Safe(r.Node))
	}
}

// checker gathers the rows of one check.
type checker struct {
	cfg  config
	n    nodeFacts
	node string
	rows []checkRow
}

func (c *checker) add(name, status, detail, fix string) {
	if status == statusOK {
		fix = ""
	}
	c.rows = append(c.rows, checkRow{Name: name, Status: status, Detail: detail, Fix: fix})
}

// checkNode checks everything mpid, configured as cfg, needs of the node n.
func checkNode(cfg config, n nodeFacts) checkReport {
	c := &checker{cfg: cfg, n: n, node: cfg.Node}
	if c.node == "" {
		c.node, _ = n.Hostname()
	}
	c.config()
	c.kernel()
	c.capabilities()
	c.memlock() // before the probe, as loader.CheckBPF does
	c.programs()
	c.bpffs()
	root := c.cgroups()
	c.freezer(root)
	c.stateDir()
	c.clusterKey()
	c.nodeName()
	c.peerPort()
	c.socket("rank-socket", cfg.RankSocket)
	c.socket("ctl-socket", cfg.CtlSocket)
	c.metrics()
	c.shim()
	c.slurm()
	rep := checkReport{Node: c.node, Rows: c.rows}
	for _, r := range c.rows {
		switch r.Status {
		case statusMissing:
			rep.Missing++
		case statusDegraded:
			rep.Degraded++
		}
	}
	rep.Ready = rep.Missing == 0
	return rep
}

func (c *checker) config() {
	switch {
	case c.cfg.origin == nil:
		c.add("config", statusOK, fmt.Sprintf("no settings file at %s: every option at its default or as given", c.cfg.configFile), "")
	default:
		c.add("config", statusOK, fmt.Sprintf("%s: %d settings read, as mpid reads them", c.cfg.configFile, len(c.cfg.origin)), "")
	}
}

// floor is the oldest kernel mpid runs on (README, docs/guarantees.md).
var floor = [2]int{5, 10}

func (c *checker) kernel() {
	rel, err := c.n.Release()
	switch v, ok := kernelVersion(rel); {
	case err != nil:
		c.add("kernel", statusMissing, fmt.Sprintf("uname: %v", err), "run mpid check on the node itself, as root")
	case !ok:
		c.add("kernel", statusDegraded, fmt.Sprintf("%s: not a version this check can read; mpid needs Linux %d.%d or later", rel, floor[0], floor[1]), "make sure the kernel is Linux 5.10 or later (the BPF programs' rows say what it loads)")
	case v[0] < floor[0] || v[0] == floor[0] && v[1] < floor[1]:
		c.add("kernel", statusMissing, fmt.Sprintf("Linux %s, below mpid's floor %d.%d", rel, floor[0], floor[1]), "boot Linux 5.10 or later with BTF (Debian 11's kernel or newer)")
	default:
		c.add("kernel", statusOK, fmt.Sprintf("Linux %s (floor %d.%d)", rel, floor[0], floor[1]), "")
	}
	const btf = "/sys/kernel/btf/vmlinux"
	if st, err := c.n.Stat(btf); err == nil && st.Exists {
		c.add("btf", statusOK, btf, "")
	} else {
		c.add("btf", statusMissing, fmt.Sprintf("no %s: the BPF programs need the kernel's BTF", btf), "boot a kernel built with CONFIG_DEBUG_INFO_BTF=y (Debian's are)")
	}
}

// kernelVersion is the major and minor version of a kernel release such
// as 6.1.0-13-amd64.
func kernelVersion(rel string) ([2]int, bool) {
	parts := strings.SplitN(rel, ".", 3)
	if len(parts) < 2 {
		return [2]int{}, false
	}
	minor := parts[1]
	if i := strings.IndexFunc(minor, func(r rune) bool { return r < '0' || r > '9' }); i >= 0 {
		minor = minor[:i]
	}
	a, err1 := strconv.Atoi(parts[0])
	b, err2 := strconv.Atoi(minor)
	return [2]int{a, b}, err1 == nil && err2 == nil
}

func (c *checker) capabilities() {
	// loader.CheckBPF's set, with setns (mpid enters the ranks' network
	// namespaces), judged by the running kernel.
	bpf := []caps.Cap{caps.BPF, caps.Perfmon, caps.NetAdmin, caps.SysAdmin}
	if missing, err := c.n.MissingCaps(bpf...); err != nil {
		c.add("capabilities", statusMissing, err.Error(), "run mpid check as root")
	} else if len(missing) > 0 {
		c.add("capabilities", statusMissing, "missing "+strings.Join(missing, ", ")+": mpid does not start (the BPF observer and setns into the ranks' namespaces need them)",
			"run mpid check, and mpid, as root with them (mpid.service grants them)")
	} else {
		c.add("capabilities", statusOK, "CAP_BPF, CAP_PERFMON, CAP_NET_ADMIN, CAP_SYS_ADMIN (as this kernel judges them)", "")
	}
	if missing, err := c.n.MissingCaps(caps.SysPtrace); err != nil {
		c.add("cap-sys-ptrace", statusMissing, err.Error(), "run mpid check as root")
	} else if len(missing) > 0 {
		c.add("cap-sys-ptrace", statusMissing, "missing CAP_SYS_PTRACE: mpid cannot read /proc/PID/ns/net of another user's rank, so it does not find their jobs' connections",
			"run mpid as root with CAP_SYS_PTRACE (mpid.service grants it)")
	} else {
		c.add("cap-sys-ptrace", statusOK, "CAP_SYS_PTRACE (to find the ranks' network namespaces)", "")
	}
	c.scheduling()
}

// scheduling: mpid's --nice below 0 needs CAP_SYS_NICE (or RLIMIT_NICE)
// or mpid does not start; --rt-priority without it runs with --nice alone.
func (c *checker) scheduling() {
	nice, rt := c.cfg.Nice, c.cfg.RTPriority
	if nice >= 0 && rt == 0 {
		c.add("cap-sys-nice", statusOK, fmt.Sprintf("not needed: --nice %d, --rt-priority 0", nice), "")
		return
	}
	missing, err := c.n.MissingCaps(caps.SysNice)
	if err != nil {
		c.add("cap-sys-nice", statusMissing, err.Error(), "run mpid check as root")
		return
	}
	if len(missing) == 0 {
		c.add("cap-sys-nice", statusOK, fmt.Sprintf("CAP_SYS_NICE, for --nice %d and --rt-priority %d", nice, rt), "")
		return
	}
	// Without the capability the kernel allows what the rlimits allow.
	niceOK, rtOK := nice >= 0, rt == 0
	if l, err := c.n.Rlimit(unix.RLIMIT_NICE); err == nil && !niceOK {
		niceOK = l.Cur >= uint64(20-nice)
	}
	if l, err := c.n.Rlimit(unix.RLIMIT_RTPRIO); err == nil && !rtOK {
		rtOK = l.Cur >= uint64(rt)
	}
	switch {
	case !niceOK:
		c.add("cap-sys-nice", statusMissing, fmt.Sprintf("missing CAP_SYS_NICE (and RLIMIT_NICE does not allow it): mpid does not start: --nice %d: permission denied", nice),
			"run mpid as root with CAP_SYS_NICE (mpid.service grants it), or set nice = 0 and rt-priority = 0")
	case !rtOK:
		c.add("cap-sys-nice", statusDegraded, fmt.Sprintf("missing CAP_SYS_NICE: --nice %d is allowed, SCHED_RR (--rt-priority %d) is not: mpid runs with --nice alone, and a resume's replies queue behind busy ranks", nice, rt),
			"run mpid as root with CAP_SYS_NICE (mpid.service grants it)")
	default:
		c.add("cap-sys-nice", statusOK, fmt.Sprintf("no CAP_SYS_NICE, but the rlimits allow --nice %d and --rt-priority %d", nice, rt), "")
	}
}

func rlimitString(v uint64) string {
	if v == unix.RLIM_INFINITY || v == math.MaxUint64 {
		return "unlimited"
	}
	if v%1024 == 0 {
		return fmt.Sprintf("%d KiB", v/1024)
	}
	return fmt.Sprintf("%d bytes", v)
}

func (c *checker) memlock() {
	before, after, err := c.n.RaiseMemlock()
	rel, _ := c.n.Release()
	v, known := kernelVersion(rel)
	switch {
	case known && (v[0] > 5 || v[0] == 5 && v[1] >= 11):
		// Whatever the raise did: without CAP_BPF the library's own test
		// of the kernel's accounting fails and it tries the limit anyway.
		c.add("memlock", statusOK, fmt.Sprintf("not needed: Linux 5.11 and later charge BPF maps to the memory cgroup (RLIMIT_MEMLOCK %s)", rlimitString(before.Cur)), "")
	case err != nil:
		c.add("memlock", statusMissing, fmt.Sprintf("this kernel charges BPF maps to RLIMIT_MEMLOCK (%s) and mpid could not raise it: %v", rlimitString(before.Cur), err),
			"LimitMEMLOCK=infinity in the unit (mpid.service has it), ulimit -l unlimited in a shell")
	case before != after:
		c.add("memlock", statusOK, fmt.Sprintf("this kernel charges BPF maps to RLIMIT_MEMLOCK: %s, which mpid raises to %s at start (as here)", rlimitString(before.Cur), rlimitString(after.Cur)), "")
	default:
		c.add("memlock", statusOK, fmt.Sprintf("not needed: this kernel charges BPF maps to the memory cgroup (RLIMIT_MEMLOCK %s)", rlimitString(before.Cur)), "")
	}
}

// programs reports each BPF program as loader.Probe found it, and the
// observer's mode.
func (c *checker) programs() {
	f, perr := c.n.Probe()
	loaded := map[string]bool{}
	reason := map[string]string{}
	for _, l := range f.Loads {
		loaded[l.Program] = l.Refused == ""
		reason[l.Program] = l.Refused
	}
	instead := map[string]string{}
	for _, fb := range f.Fallbacks {
		instead[fb.Program] = fb.Instead
	}
	connIter := loaded[loader.ProgConnIter] || loaded[loader.ProgConnIterSkc]
	for _, p := range []struct{ name, what string }{
		{loader.ProgSockops, "registers the job's connections"},
		{loader.ProgState, "the FINs and closes of adopted connections"},
		{loader.ProgTCPIter, "adopts connections made before their cgroup was watched"},
		{loader.ProgConnIter, "reads the job's connections at each kernel check (bpf_rdonly_cast)"},
		{loader.ProgConnIterSkc, "the same with bpf_skc_to_tcp_sock"},
		{loader.ProgSignals, "times the ranks' SIGTSTP and SIGCONT (signal_generate)"},
	} {
		name := "bpf-" + strings.ReplaceAll(p.name, "_", "-")
		ok, tried := loaded[p.name]
		switch {
		case !tried && perr != nil:
			c.add(name, statusMissing, "not probed: "+perr.Error(), "see the capabilities, btf and memlock rows")
			continue
		case !tried:
			c.add(name, statusMissing, "not probed", "see the capabilities, btf and memlock rows")
			continue
		case ok:
			c.add(name, statusOK, "loaded: "+p.what, "")
			continue
		}
		detail := "refused: " + reason[p.name]
		if i := instead[p.name]; i != "" {
			detail += "; instead: " + i
		}
		status, fix := statusDegraded, "a newer kernel (6.2 or later loads every program; docs/guarantees.md, \"On older kernels\")"
		switch p.name {
		case loader.ProgSockops:
			status, fix = statusMissing, "Linux 5.10 or later with BTF: nothing else registers the job's connections"
		case loader.ProgSignals:
			fix = "a kernel with BTF that allows tp_btf programs (5.5 or later): docs/mpid.md, \"A rank's SIGTSTP and SIGCONT\""
		case loader.ProgTCPIter:
			if !connIter {
				status = statusMissing
			}
		case loader.ProgConnIter:
			if loaded[loader.ProgConnIterSkc] {
				status = statusOK // the same records: full mode
			} else if !loaded[loader.ProgTCPIter] {
				status = statusMissing
			}
		case loader.ProgConnIterSkc:
			if loaded[loader.ProgConnIter] {
				status, detail = statusOK, "refused: "+reason[p.name]+"; not needed: conniter loaded"
			} else if !loaded[loader.ProgTCPIter] {
				status = statusMissing
			}
		}
		c.add(name, status, detail, fix)
	}
	switch {
	case perr != nil:
		c.add("observer", statusMissing, "mpid does not start: "+perr.Error(), "see the rows above")
	case f.Mode() == loader.ModeFull:
		c.add("observer", statusOK, "mode "+f.String(), "")
	default:
		c.add("observer", statusDegraded, "mode "+f.String()+"; weaker: "+strings.Join(f.Weaker(), "; "),
			"a newer kernel (docs/guarantees.md, \"On older kernels\")")
	}
}
