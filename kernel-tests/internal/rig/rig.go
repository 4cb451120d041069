package rig

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net/netip"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/mountinfo"
	"github.com/mpipause/mpipause/kernel-tests/internal/links"
)

// Defaults for Config's empty fields.
const (
	DefaultName      = "default"
	DefaultStateRoot = "/run/mpipause-rig" // not in NodeRunMount: `rig exec` inside a node must find it
	DefaultEtcNetns  = "/etc/netns"
	// NameEnv selects the rig a command works on; `rig exec` sets it in
	// every node command, so a launcher inside a node reaches its own rig.
	NameEnv = "MPIPAUSE_RIG"
	// NodeEnv is set to the node's name in every node command.
	NodeEnv = "MPIPAUSE_RIG_NODE"
	// ScopeEnv, if set, is a cgroup (relative to the v2 hierarchy's root;
	// {} stands for the node's name) that `rig exec` and the launcher agent
	// put their command in, made if missing: on a real cluster a node's
	// resource manager places what arrives (systemd puts an ssh session in
	// a scope of its own), and the launcher's daemons and the ranks they
	// fork share it. The launcher's environment carries it to every node.
	ScopeEnv = "MPIPAUSE_RIG_SCOPE"
	// MaxNodes bounds N: the nodes' addresses are .1 to .N of a /24.
	MaxNodes = 250

	bridgeName = "br0"
	nodeIf     = "eth0"
)

// NodeRunMount is where a node sees its NodeRunDir: mpid's default
// directory for its sockets and state, so that each node's mpid has its own
// and two rigs (or a rig and the host's mpid) never share one.
const NodeRunMount = "/run/mpipause"

// DefaultSubnet is the rig's private subnet. It never leaves the rig's
// bridge namespace, so it cannot collide with anything on the host.
var DefaultSubnet = netip.MustParsePrefix("10.77.0.0/24")

// Errors callers check with errors.Is.
var (
	// ErrNotUp: the rig has no nodes (run `rig up N`).
	ErrNotUp = errors.New("rig is not up")
	// ErrNoNode: the node named is not part of the rig.
	ErrNoNode = errors.New("no such node")
)

var validName = regexp.MustCompile(`^[a-z0-9][a-z0-9_-]{0,30}$`)

// Config says which rig to work on and where its pieces go. The zero value
// of each field means its default.
type Config struct {
	Name      string       // rig name: [a-z0-9][a-z0-9_-]*, default "default"
	StateRoot string       // parent of the rig's state directory
	EtcNetns  string       // where the nodes' /etc files go (ip-netns(8) convention)
	Subnet    netip.Prefix // the nodes' subnet, a /24 or larger
	// Exe is the rig binary: `up` runs it in each new node to set up the
	// node's mounts, and the launcher agent runs it to reach a node.
	Exe string
	// BinDir goes first on PATH in node commands (the repository's bin/);
	// `up` starts BinDir/mpid in every node.
	BinDir string
	// NoMPID: `up` starts no mpid (and does not need one in BinDir).
	NoMPID bool
	// MPIDWrap, if set, is a command line that `up` puts before each
	// mpid's and that execs it in place (`setpriv --bounding-set=... --`,
	// to start mpid with what its systemd unit leaves it): the process,
	// its pid and its ready file stay mpid's.
	MPIDWrap []string
}

// EnterScope moves the calling process into the cgroup ScopeEnv names
// for node, if env sets it.
func EnterScope(env []string, node string) error {
	var tmpl string
	for _, kv := range env {
		if v, ok := strings.CutPrefix(kv, ScopeEnv+"="); ok {
			tmpl = v
		}
	}
	if tmpl == "" {
		return nil
	}
	root, err := cgroupv2.Root()
	if err != nil {
		return err
	}
	dir := filepath.Join(root, strings.ReplaceAll(tmpl, "{}", node))
	if !strings.HasPrefix(dir, root+"/") {
		return fmt.Errorf("%s=%s: not a cgroup below %s", ScopeEnv, tmpl, root)
	}
	if err := cgroupv2.Create(dir); err != nil {
		return err
	}
	return cgroupv2.AddProc(dir, os.Getpid())
}

// Rig is one named rig on this machine.
type Rig struct {
	cfg Config
}

// New checks cfg and fills in its defaults.
func New(cfg Config) (*Rig, error) {
	if cfg.Name == "" {
		cfg.Name = DefaultName
	}
	if !validName.MatchString(cfg.Name) {
		return nil, fmt.Errorf("rig name %q: want [a-z0-9][a-z0-9_-]*, at most 31 characters", cfg.Name)
	}
	if cfg.StateRoot == "" {
		cfg.StateRoot = DefaultStateRoot
	}
	if cfg.EtcNetns == "" {
		cfg.EtcNetns = DefaultEtcNetns
	}
	if !cfg.Subnet.IsValid() {
		cfg.Subnet = DefaultSubnet
	}
	if !cfg.Subnet.Addr().Is4() || cfg.Subnet.Bits() > 24 {
		return nil, fmt.Errorf("rig subnet %s: want an IPv4 /24 or larger", cfg.Subnet)
	}
	cfg.Subnet = cfg.Subnet.Masked()
	if cfg.Exe == "" {
		exe, err := os.Executable()
		if err != nil {
			return nil, fmt.Errorf("find rig binary: %w", err)
		}
		cfg.Exe = exe
	}
	return &Rig{cfg: cfg}, nil
}

// Config returns the rig's configuration, defaults filled in.
func (r *Rig) Config() Config { return r.cfg }

// Name returns the rig's name.
func (r *Rig) Name() string { return r.cfg.Name }

// Dir returns the rig's state directory.
func (r *Rig) Dir() string { return filepath.Join(r.cfg.StateRoot, r.cfg.Name) }

func (r *Rig) nsDir() string     { return filepath.Join(r.Dir(), "ns") }
func (r *Rig) bpfDir() string    { return filepath.Join(r.Dir(), "bpf") }
func (r *Rig) stateFile() string { return filepath.Join(r.Dir(), "state.json") }
func (r *Rig) lockFile() string  { return filepath.Join(r.cfg.StateRoot, r.cfg.Name+".lock") }

// Agent returns the launcher agent: a script that takes ssh's arguments
// (`ssh [-x] [options] host command...`) and runs the command in that node.
func (r *Rig) Agent() string { return filepath.Join(r.Dir(), "ssh") }

// NodeName returns the host name of node i.
func NodeName(i int) string { return "node" + strconv.Itoa(i) }

// NodeNetns returns the network namespace name of node i: nodeI for the
// default rig (so `ip netns exec node1` works as one expects), R-nodeI for a
// rig named R.
func (r *Rig) NodeNetns(i int) string {
	if r.cfg.Name == DefaultName {
		return NodeName(i)
	}
	return r.cfg.Name + "-" + NodeName(i)
}

// BridgeNetns returns the name of the namespace that holds the rig's bridge.
func (r *Rig) BridgeNetns() string {
	if r.cfg.Name == DefaultName {
		return "mpipause-rig"
	}
	return "mpipause-rig-" + r.cfg.Name
}

// NodeAddr returns the eth0 address of node i.
func (r *Rig) NodeAddr(i int) netip.Addr {
	a := r.cfg.Subnet.Addr().As4()
	a[3] += byte(i + 1)
	return netip.AddrFrom4(a)
}

// NodeRunDir returns the host's path of the directory node i sees as
// NodeRunMount: what the host reads to see node i's mpid sockets and state
// (NodePath turns a node's path into the host's).
func (r *Rig) NodeRunDir(i int) string { return filepath.Join(r.Dir(), "run", NodeName(i)) }

// NodePath returns the host's path of path as node i sees it, for a path
// under NodeRunMount (the node's /run/mpipause); other paths are the same
// in every node and on the host.
func (r *Rig) NodePath(i int, path string) string {
	if rel, err := filepath.Rel(NodeRunMount, path); err == nil && rel != ".." && !strings.HasPrefix(rel, "../") {
		return filepath.Join(r.NodeRunDir(i), rel)
	}
	return path
}

func (r *Rig) mntFile(i int) string { return filepath.Join(r.nsDir(), NodeName(i)+".mnt") }
func (r *Rig) utsFile(i int) string { return filepath.Join(r.nsDir(), NodeName(i)+".uts") }

// State is what `up` records about a rig that is up.
type State struct {
	Name   string   `json:"name"`
	Nodes  int      `json:"nodes"`
	Subnet string   `json:"subnet"`
	Netns  []string `json:"netns"`
	Bridge string   `json:"bridge_netns"`
	Agent  string   `json:"agent"`
	// HostMountNS is the mount namespace `up` ran in ("mnt:[INODE]"), where
	// the nodes' namespace files are bound.
	HostMountNS string `json:"host_mount_ns"`
	// MPID is the daemon of each node that has one (none with NoMPID).
	MPID []Daemon `json:"mpid,omitempty"`
}

// Load reads the state of a rig that is up, or fails with ErrNotUp.
func (r *Rig) Load() (*State, error) {
	b, err := os.ReadFile(r.stateFile())
	if errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("rig %s: %w (run: kernel-tests/rig up N)", r.cfg.Name, ErrNotUp)
	}
	if err != nil {
		return nil, fmt.Errorf("read rig state: %w", err)
	}
	var st State
	if err := json.Unmarshal(b, &st); err != nil {
		return nil, fmt.Errorf("read rig state %s: %w", r.stateFile(), err)
	}
	return &st, nil
}

// lock serialises up and down of one rig between processes.
func (r *Rig) lock() (release func(), err error) {
	if err := os.MkdirAll(r.cfg.StateRoot, 0o755); err != nil {
		return nil, fmt.Errorf("lock rig: %w", err)
	}
	for {
		f, err := os.OpenFile(r.lockFile(), os.O_RDWR|os.O_CREATE, 0o644)
		if err != nil {
			return nil, fmt.Errorf("lock rig: %w", err)
		}
		if err := unix.Flock(int(f.Fd()), unix.LOCK_EX); err != nil {
			f.Close()
			return nil, fmt.Errorf("lock rig: %w", err)
		}
		// The holder before us removes the file as it releases it, so the
		// lock we got may be on a file no longer at that path: try again.
		var held, now unix.Stat_t
		if unix.Fstat(int(f.Fd()), &held) != nil || unix.Stat(r.lockFile(), &now) != nil || held.Ino != now.Ino {
			f.Close()
			continue
		}
		return func() {
			os.Remove(f.Name())
			f.Close()
		}, nil
	}
}

// Up brings up n nodes. Up on a rig that is already up with n nodes repairs
// whatever is missing and is otherwise a no-op; a rig up with another number
// of nodes is an error (take it down first).
func (r *Rig) Up(ctx context.Context, n int) (err error) {
	if n < 1 || n > MaxNodes {
		return fmt.Errorf("rig up %d: want 1 to %d nodes", n, MaxNodes)
	}
	// Before anything is made: a rig without its daemons is not what the
	// caller asked for.
	if err := r.checkMPID(); err != nil {
		return err
	}
	release, err := r.lock()
	if err != nil {
		return err
	}
	defer release()
	prev, err := r.Load()
	if err != nil {
		prev = nil
	} else if prev.Nodes != n {
		return fmt.Errorf("rig %s is up with %d nodes; run `rig down` first", r.cfg.Name, prev.Nodes)
	}

	mounts, err := mountinfo.Read(mountinfo.Self)
	if err != nil {
		return err
	}
	if err := r.makeStateDir(mounts); err != nil {
		return err
	}
	if err := r.makeNetwork(n); err != nil {
		return err
	}
	if err := r.writeEtc(n); err != nil {
		return err
	}
	if err := r.writeAgent(); err != nil {
		return err
	}
	spec := nodeSpecFromHost(mounts)
	for i := 0; i < n; i++ {
		if err := r.makeNodeNamespaces(ctx, i, spec); err != nil {
			return err
		}
	}
	hostNS, err := os.Readlink("/proc/self/ns/mnt")
	if err != nil {
		return fmt.Errorf("read own mount namespace: %w", err)
	}
	st := State{Name: r.cfg.Name, Nodes: n, Subnet: r.cfg.Subnet.String(), Bridge: r.BridgeNetns(), Agent: r.Agent(), HostMountNS: hostNS}
	for i := 0; i < n; i++ {
		st.Netns = append(st.Netns, r.NodeNetns(i))
	}
	if prev != nil {
		// Daemons of the previous up: startDaemons keeps the live ones, and
		// down stops them even when this up goes no further.
		st.MPID = prev.MPID
	}
	if err := r.saveState(&st); err != nil {
		return err
	}
	return r.startDaemons(ctx, &st)
}

func (r *Rig) saveState(st *State) error {
	b, _ := json.MarshalIndent(st, "", "  ")
	if err := writeFileAtomic(r.stateFile(), append(b, '\n'), 0o644); err != nil {
		return fmt.Errorf("write rig state: %w", err)
	}
	return nil
}

// makeStateDir creates the state directory with its two mounts: ns/, a
// private bind mount of itself (the kernel refuses to bind a mount namespace
// onto a file of a shared mount, which could propagate into that namespace
// and pin it in a loop), and bpf/, a bpffs of the rig's own that outlives
// the nodes' processes, so that a daemon's pins survive its restart.
func (r *Rig) makeStateDir(mounts []mountinfo.Mount) error {
	for _, d := range []string{r.nsDir(), r.bpfDir()} {
		if err := os.MkdirAll(d, 0o755); err != nil {
			return fmt.Errorf("make rig state dir: %w", err)
		}
	}
	if !isMountPoint(mounts, r.nsDir()) {
		if err := unix.Mount(r.nsDir(), r.nsDir(), "", unix.MS_BIND, ""); err != nil {
			return fmt.Errorf("bind %s: %w", r.nsDir(), err)
		}
		if err := unix.Mount("", r.nsDir(), "", unix.MS_PRIVATE, ""); err != nil {
			return fmt.Errorf("make %s private: %w", r.nsDir(), err)
		}
	}
	if !isMountPoint(mounts, r.bpfDir()) {
		if err := unix.Mount("bpf", r.bpfDir(), "bpf", 0, "mode=0700"); err != nil {
			return fmt.Errorf("mount bpffs on %s: %w", r.bpfDir(), err)
		}
	}
	return nil
}

// makeNetwork creates the namespaces, the bridge and one veth pair per node.
func (r *Rig) makeNetwork(n int) error {
	if err := links.AddNetns(r.BridgeNetns()); err != nil {
		return err
	}
	br, err := links.OpenNetns(r.BridgeNetns())
	if err != nil {
		return err
	}
	defer br.Close()
	if err := br.SetUp("lo"); err != nil {
		return err
	}
	if err := br.AddBridge(bridgeName); err != nil {
		return err
	}
	for i := 0; i < n; i++ {
		if err := r.makeNodeNetwork(br, i); err != nil {
			return err
		}
	}
	return nil
}

func (r *Rig) makeNodeNetwork(br *links.Netns, i int) error {
	name := r.NodeNetns(i)
	if err := links.AddNetns(name); err != nil {
		return err
	}
	node, err := links.OpenNetns(name)
	if err != nil {
		return err
	}
	defer node.Close()
	if err := node.SetUp("lo"); err != nil {
		return err
	}
	// No IPv6 on eth0: no link-local addresses for the MPI libraries to
	// pick (Open MPI's btl tcp and UCX both would), no DAD delay.
	if err := node.WriteSysctl("net.ipv6.conf.default.disable_ipv6", "1"); err != nil {
		return err
	}
	if err := br.AddVeth("veth"+strconv.Itoa(i), bridgeName, node, nodeIf); err != nil {
		return err
	}
	if err := node.WriteSysctl("net.ipv6.conf."+nodeIf+".disable_ipv6", "1"); err != nil {
		return err
	}
	return node.AddAddr(nodeIf, netip.PrefixFrom(r.NodeAddr(i), r.cfg.Subnet.Bits()))
}

// writeEtc writes each node's /etc/hosts under /etc/netns/<netns>/, where
// `ip netns exec` also looks, naming every node by its eth0 address (not
// 127.0.1.1: MPI libraries resolve their own host name to find the address
// their peers should use).
func (r *Rig) writeEtc(n int) error {
	var b strings.Builder
	b.WriteString("# written by mpipause's rig; removed by rig down\n127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n")
	for i := 0; i < n; i++ {
		fmt.Fprintf(&b, "%s\t%s\n", r.NodeAddr(i), NodeName(i))
	}
	for i := 0; i < n; i++ {
		dir := filepath.Join(r.cfg.EtcNetns, r.NodeNetns(i))
		if err := os.MkdirAll(dir, 0o755); err != nil {
			return fmt.Errorf("write hosts of %s: %w", NodeName(i), err)
		}
		if err := writeFileAtomic(filepath.Join(dir, "hosts"), []byte(b.String()), 0o644); err != nil {
			return fmt.Errorf("write hosts of %s: %w", NodeName(i), err)
		}
	}
	return nil
}

// writeAgent writes the launcher agent script. It is a file because Hydra's
// HYDRA_LAUNCHER_EXEC takes a path, not a command line.
func (r *Rig) writeAgent() error {
	script := fmt.Sprintf("#!/bin/sh\n# Launcher agent of mpipause's rig %q: ssh's arguments in, `rig exec` out.\n%s=%s exec %s ssh \"$@\"\n",
		r.cfg.Name, NameEnv, shellQuote(r.cfg.Name), shellQuote(r.cfg.Exe))
	if err := writeFileAtomic(r.Agent(), []byte(script), 0o755); err != nil {
		return fmt.Errorf("write launcher agent: %w", err)
	}
	return nil
}

// makeNodeNamespaces creates node i's mount and UTS namespaces, bound to
// files under ns/ so that they outlive the process that made them: unshare(1)
// makes them and binds them, nsenter(1) puts the setup process in the node's
// network namespace (a sysfs shows the interfaces of the namespace of the
// process that mounts it), and `rig _init-node` mounts what the node needs.
func (r *Rig) makeNodeNamespaces(ctx context.Context, i int, spec NodeSpec) error {
	if isNsfs(r.mntFile(i)) && isNsfs(r.utsFile(i)) {
		return nil
	}
	for _, f := range []string{r.mntFile(i), r.utsFile(i)} {
		unmountFile(f)
		if err := os.WriteFile(f, nil, 0o444); err != nil {
			return fmt.Errorf("create %s: %w", f, err)
		}
	}
	spec.Hostname = NodeName(i)
	spec.EtcDir = filepath.Join(r.cfg.EtcNetns, r.NodeNetns(i))
	spec.BPFDir = filepath.Join(r.bpfDir(), NodeName(i))
	if err := os.MkdirAll(spec.BPFDir, 0o700); err != nil {
		return fmt.Errorf("make bpffs dir of %s: %w", NodeName(i), err)
	}
	// Root's and 0755 whatever the umask: mpid refuses a socket directory
	// others could write.
	spec.RunDir = r.NodeRunDir(i)
	if err := os.MkdirAll(spec.RunDir, 0o755); err != nil {
		return fmt.Errorf("make %s of %s: %w", NodeRunMount, NodeName(i), err)
	}
	if err := os.Chmod(spec.RunDir, 0o755); err != nil {
		return fmt.Errorf("make %s of %s: %w", NodeRunMount, NodeName(i), err)
	}
	js, _ := json.Marshal(spec)
	cmd := exec.CommandContext(ctx, "unshare",
		"--mount="+r.mntFile(i), "--uts="+r.utsFile(i), "--propagation=slave", "--",
		"nsenter", "--net="+links.NetnsPath(r.NodeNetns(i)), "--",
		r.cfg.Exe, InitNodeCommand, string(js))
	if out, err := cmd.CombinedOutput(); err != nil {
		return fmt.Errorf("set up namespaces of %s: %w: %s", NodeName(i), err, strings.TrimSpace(string(out)))
	}
	return nil
}

// Down stops everything the rig runs and removes everything it made: node
// processes are killed, namespaces unbound, mounts unmounted, files removed.
// Down on a rig that is not up (or half up) is not an error.
func (r *Rig) Down(ctx context.Context) error {
	release, err := r.lock()
	if err != nil {
		return err
	}
	defer func() {
		release()
		os.Remove(r.cfg.StateRoot) // only if no other rig (or lock) is in it
	}()

	var errs []error
	// The daemons first and gently, so they can clean up; a daemon that
	// does not stop is killed below with the rest of its node.
	if st, err := r.Load(); err == nil {
		if err := r.stopDaemons(ctx, st); err != nil {
			errs = append(errs, err)
		}
	}
	names, err := r.findNetns()
	if err != nil {
		return errors.Join(append(errs, err)...)
	}
	for _, name := range names {
		if err := killNetnsProcs(ctx, name); err != nil {
			errs = append(errs, err)
		}
	}
	if err := r.removeCgroups(); err != nil {
		errs = append(errs, err)
	}
	// The ns/ files: one per node namespace, whatever the state file says.
	if ents, err := os.ReadDir(r.nsDir()); err == nil {
		for _, e := range ents {
			unmountFile(filepath.Join(r.nsDir(), e.Name()))
		}
	}
	for _, name := range names {
		if err := links.DelNetns(name); err != nil {
			errs = append(errs, err)
		}
		if strings.Contains(name, "node") { // not the bridge's
			if err := os.RemoveAll(filepath.Join(r.cfg.EtcNetns, name)); err != nil {
				errs = append(errs, err)
			}
		}
	}
	for _, d := range []string{r.nsDir(), r.bpfDir()} {
		if err := unix.Unmount(d, unix.MNT_DETACH); err != nil && !errors.Is(err, unix.EINVAL) && !errors.Is(err, unix.ENOENT) {
			errs = append(errs, fmt.Errorf("unmount %s: %w", d, err))
		}
	}
	if err := os.RemoveAll(r.Dir()); err != nil {
		errs = append(errs, err)
	}
	// Not NodeRunMount's mount point on the host, even empty: removing it
	// would unmount it in every other rig's nodes.
	os.Remove(r.cfg.EtcNetns) // only if empty
	return errors.Join(errs...)
}

// findNetns lists the rig's namespaces that exist, from their names rather
// than from the state file, so that down also cleans a rig whose up failed
// half way.
func (r *Rig) findNetns() ([]string, error) {
	all, err := links.ListNetns()
	if err != nil {
		return nil, err
	}
	var nodeRe *regexp.Regexp
	if r.cfg.Name == DefaultName {
		nodeRe = regexp.MustCompile(`^node[0-9]+$`)
	} else {
		nodeRe = regexp.MustCompile(`^` + regexp.QuoteMeta(r.cfg.Name) + `-node[0-9]+$`)
	}
	var out []string
	for _, n := range all {
		if n == r.BridgeNetns() || nodeRe.MatchString(n) {
			out = append(out, n)
		}
	}
	// Also leftover /etc/netns entries of nodes whose netns is gone.
	if ents, err := os.ReadDir(r.cfg.EtcNetns); err == nil {
		for _, e := range ents {
			if nodeRe.MatchString(e.Name()) && !contains(out, e.Name()) {
				os.RemoveAll(filepath.Join(r.cfg.EtcNetns, e.Name()))
			}
		}
	}
	return out, nil
}

// NodeIndex resolves a node given as nodeK, K or the node's netns name.
func (r *Rig) NodeIndex(st *State, node string) (int, error) {
	for i := 0; i < st.Nodes; i++ {
		if node == NodeName(i) || node == strconv.Itoa(i) || node == r.NodeNetns(i) {
			return i, nil
		}
	}
	return 0, fmt.Errorf("%w %q in rig %s (it has node0 to node%d)", ErrNoNode, node, r.cfg.Name, st.Nodes-1)
}

// Pids lists the processes in node i's network namespace.
func (r *Rig) Pids(i int) ([]int, error) { return netnsPids(r.NodeNetns(i)) }

// netnsPids lists the processes whose network namespace is the named one.
func netnsPids(name string) ([]int, error) {
	ino, err := links.NetnsInode(name)
	if err != nil {
		return nil, err
	}
	want := fmt.Sprintf("net:[%d]", ino)
	ents, err := os.ReadDir("/proc")
	if err != nil {
		return nil, fmt.Errorf("list processes: %w", err)
	}
	var pids []int
	for _, e := range ents {
		pid, err := strconv.Atoi(e.Name())
		if err != nil {
			continue
		}
		if l, err := os.Readlink("/proc/" + e.Name() + "/ns/net"); err == nil && l == want {
			pids = append(pids, pid)
		}
	}
	return pids, nil
}

// killNetnsProcs kills every process in the named network namespace, except
// this process and its ancestors (down may run inside a node), and waits
// until none is left in it.
func killNetnsProcs(ctx context.Context, name string) error {
	spare := map[int]bool{}
	for p := os.Getpid(); p > 1; p = ppid(p) {
		spare[p] = true
	}
	deadline := time.Now().Add(10 * time.Second)
	for {
		pids, err := netnsPids(name)
		if err != nil {
			return nil // namespace already gone
		}
		left := 0
		for _, p := range pids {
			if spare[p] {
				continue
			}
			left++
			syscall.Kill(p, syscall.SIGKILL)
		}
		if left == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			return fmt.Errorf("netns %s: %d processes survive SIGKILL", name, left)
		}
		select {
		case <-ctx.Done():
			return ctx.Err()
		case <-time.After(20 * time.Millisecond): // a killed process leaves its namespaces as it exits
		}
	}
}

func ppid(pid int) int {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return 0
	}
	// pid (comm) state ppid ...; comm may contain spaces and parentheses.
	s := string(b)
	i := strings.LastIndexByte(s, ')')
	if i < 0 {
		return 0
	}
	f := strings.Fields(s[i+1:])
	if len(f) < 2 {
		return 0
	}
	p, _ := strconv.Atoi(f[1])
	return p
}

// isNsfs reports whether path has a namespace bound onto it.
func isNsfs(path string) bool {
	var st unix.Statfs_t
	return unix.Statfs(path, &st) == nil && st.Type == unix.NSFS_MAGIC
}

func unmountFile(path string) {
	for isNsfs(path) {
		if err := unix.Unmount(path, unix.MNT_DETACH); err != nil {
			break
		}
	}
	os.Remove(path)
}

func writeFileAtomic(path string, b []byte, mode os.FileMode) error {
	tmp := path + ".tmp"
	if err := os.WriteFile(tmp, b, mode); err != nil {
		return err
	}
	if err := os.Chmod(tmp, mode); err != nil {
		return err
	}
	return os.Rename(tmp, path)
}

func shellQuote(s string) string { return "'" + strings.ReplaceAll(s, "'", `'\''`) + "'" }

func contains(ss []string, s string) bool {
	for _, x := range ss {
		if x == s {
			return true
		}
	}
	return false
}
