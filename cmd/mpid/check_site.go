package main

import (
	"cmp"
	"errors"
	"fmt"
	"io/fs"
	"net"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"

	"github.com/mpipause/mpipause/internal/mpid"
)

// The rows of mpid check about the node around the kernel: bpffs,
// cgroups, the state directory, the cluster key, the node name, the
// ports and sockets, the shim and the Slurm plugin.

func (c *checker) bpffs() {
	dir, err := c.n.BPFFS()
	switch {
	case err != nil:
		c.add("bpffs", statusDegraded, err.Error(), "mount -t bpf bpf /sys/fs/bpf (systemd mounts it at boot)")
	case dir == "":
		c.add("bpffs", statusDegraded, "none mounted: mpid mounts one at /sys/fs/bpf for its first job (the jobs' BPF state is pinned there, so that a restarted mpid takes them over)",
			"mount -t bpf bpf /sys/fs/bpf (systemd mounts it at boot)")
	case dir != "/sys/fs/bpf":
		// findBPFFS takes the first bpffs mounted anywhere when none is
		// at /sys/fs/bpf (a rig node's, whose /sys is its own).
		c.add("bpffs", statusDegraded, "none at /sys/fs/bpf; mpid would pin the jobs' BPF state in the first one mounted, "+dir+", and a restarted mpid finds it only while that stays mounted",
			"mount -t bpf bpf /sys/fs/bpf (systemd mounts it at boot)")
	default:
		c.add("bpffs", statusOK, "at "+dir+": the jobs' BPF state is pinned under "+filepath.Join(dir, "mpipause"), "")
	}
}

// cgroups reports the cgroup v2 mount and returns it ("" if none).
func (c *checker) cgroups() string {
	ms, err := c.n.Mounts()
	if err != nil {
		c.add("cgroup2", statusMissing, err.Error(), "mount /proc")
		return ""
	}
	var root string
	var v1 []string
	for _, m := range ms {
		if m.FSType == "cgroup2" && m.Root == "/" && root == "" {
			root = m.Point
		}
		if m.FSType == "cgroup" {
			v1 = append(v1, m.Point)
		}
	}
	if root == "" {
		c.add("cgroup2", statusMissing, "cgroup v2 is not mounted (no cgroup2 in /proc/self/mountinfo)",
			"boot with the unified hierarchy (systemd's default), or mount -t cgroup2 none /sys/fs/cgroup/unified")
		return ""
	}
	if err := c.n.Writable(root); err != nil {
		c.add("cgroup2", statusMissing, fmt.Sprintf("at %s, not writable: %v", root, err), "mount the cgroup v2 hierarchy read-write (mpid makes, fills and freezes cgroups in it)")
		return root
	}
	kind := "pure v2"
	if len(v1) > 0 {
		kind = fmt.Sprintf("hybrid: %d v1 hierarchies beside it, such as %s; mpid uses only v2, but Slurm's cgroup/v2 plugin refuses hybrid hosts", len(v1), v1[0])
	}
	c.add("cgroup2", statusOK, fmt.Sprintf("at %s (%s)", root, kind), "")
	return root
}

// freezer checks that cgroup.freeze is there for the cgroups mpid freezes:
// in the parent mpid would use (or the one fixed cgroup), else, where the
// parent is not made yet, in another non-root cgroup (the root has none),
// else, where there is none to look at, the kernel's version says.
func (c *checker) freezer(root string) {
	if root == "" {
		c.add("freezer", statusMissing, "no cgroup v2 hierarchy", "see the cgroup2 row")
		return
	}
	has := func(dir string) bool {
		st, err := c.n.Stat(filepath.Join(dir, "cgroup.freeze"))
		return err == nil && st.Exists
	}
	isCgroup := func(dir string) bool {
		st, err := c.n.Stat(filepath.Join(dir, "cgroup.procs"))
		return err == nil && st.Exists
	}
	fix := "Linux 5.2 or later has the cgroup v2 freezer (cgroup.freeze)"
	if c.cfg.FixedCgroup != "" {
		dir := c.cfg.FixedCgroup
		if !strings.HasPrefix(dir, root+"/") && dir != root {
			dir = filepath.Join(root, dir)
		}
		switch {
		case !isCgroup(dir):
			c.add("freezer", statusMissing, fmt.Sprintf("--cgroup %s: %s is not a cgroup v2 directory: mpid does not start", c.cfg.FixedCgroup, dir), "make the cgroup, or point --cgroup at the launcher's")
		case !has(dir):
			c.add("freezer", statusMissing, fmt.Sprintf("--cgroup %s has no cgroup.freeze", dir), fix)
		default:
			c.add("freezer", statusOK, fmt.Sprintf("%s/cgroup.freeze (--cgroup: mpid freezes it whole)", dir), "")
		}
		return
	}
	parent := filepath.Join(root, c.cfg.CgroupParent)
	if isCgroup(parent) {
		if has(parent) {
			c.add("freezer", statusOK, fmt.Sprintf("%s/cgroup.freeze (--cgroup-parent, exists)", parent), "")
		} else {
			c.add("freezer", statusMissing, fmt.Sprintf("%s has no cgroup.freeze", parent), fix)
		}
		return
	}
	if st, err := c.n.Stat(parent); err == nil && st.Exists {
		c.add("freezer", statusMissing, fmt.Sprintf("--cgroup-parent %s exists and is not a cgroup", parent), "remove it, or set cgroup-parent to another path")
		return
	}
	// Not made yet: mpid makes it at the first job. Any non-root cgroup
	// says whether the kernel has the freezer: this process's, or one
	// below the root.
	var sample string
	if self, err := c.n.SelfCgroup(); err == nil && self != root && strings.HasPrefix(self, root+"/") {
		sample = self
	}
	any := sample != ""
	if sample == "" || !has(sample) {
		subs, _ := c.n.SubDirs(root)
		for _, s := range subs {
			d := filepath.Join(root, s)
			any = any || isCgroup(d)
			if has(d) {
				sample = d
				break
			}
		}
	}
	if sample == "" && !any {
		// Nothing to look at (a hybrid host's v2 hierarchy before any
		// cgroup is made there): the freezer is in every cgroup v2 of
		// Linux 5.2 and later, with no option to leave it out.
		rel, _ := c.n.Release()
		if v, ok := kernelVersion(rel); ok && (v[0] > 5 || v[0] == 5 && v[1] >= 2) {
			c.add("freezer", statusOK, fmt.Sprintf("no cgroup under %s yet to look at; Linux %s has cgroup.freeze (5.2 and later); --cgroup-parent %s is made at the first job", root, rel, parent), "")
			return
		}
	}
	if sample == "" || !has(sample) {
		c.add("freezer", statusMissing, fmt.Sprintf("no non-root cgroup under %s has cgroup.freeze", root), fix)
		return
	}
	c.add("freezer", statusOK, fmt.Sprintf("cgroup.freeze in %s; --cgroup-parent %s is made at the first job", sample, parent), "")
}

func (c *checker) stateDir() {
	dir := c.cfg.StateDir
	if dir == "" {
		dir = filepath.Join("/run/mpipause", "mpid-"+c.node) // mpid.New's default
	}
	st, err := c.n.Stat(dir)
	switch {
	case err != nil:
		c.add("state-dir", statusMissing, fmt.Sprintf("%s: %v", dir, err), "set state-dir to a directory root may write")
	case st.Exists && !st.Mode.IsDir():
		c.add("state-dir", statusMissing, fmt.Sprintf("%s exists and is not a directory", dir), "remove it, or set state-dir")
	case st.Exists:
		if err := c.n.Writable(dir); err != nil {
			c.add("state-dir", statusMissing, fmt.Sprintf("%s is not writable: %v", dir, err), "make it writable by root (under mpid.service, /run/mpipause is)")
		} else {
			c.add("state-dir", statusOK, dir+" (exists, writable)", "")
		}
	default:
		// mpid makes it (and its parents) at the first record.
		up := filepath.Dir(dir)
		for ; up != "/"; up = filepath.Dir(up) {
			if s, err := c.n.Stat(up); err == nil && s.Exists {
				break
			}
		}
		if s, err := c.n.Stat(up); err == nil && s.Exists && !s.Mode.IsDir() {
			c.add("state-dir", statusMissing, fmt.Sprintf("%s: %s is not a directory", dir, up), "remove it, or set state-dir")
		} else if err := c.n.Writable(up); err != nil {
			c.add("state-dir", statusMissing, fmt.Sprintf("%s cannot be made: %s is not writable: %v", dir, up, err), "set state-dir to a directory root may write (tmpfs: its records must not outlive a reboot)")
		} else {
			c.add("state-dir", statusOK, fmt.Sprintf("%s (absent; mpid makes it in %s)", dir, up), "")
		}
	}
}

func (c *checker) clusterKey() {
	path := c.cfg.keyFile
	fix := fmt.Sprintf("mpid keygen %s on one node, then copy it to every node (mode 0600, owned by root)", path)
	st, err := c.n.Stat(path)
	switch {
	case err != nil:
		c.add("cluster-key", statusMissing, fmt.Sprintf("%s: %v", path, err), fix)
		return
	case !st.Exists:
		c.add("cluster-key", statusMissing, fmt.Sprintf("no cluster key at %s: mpid does not start", path), fix)
		return
	case !st.Mode.IsRegular():
		c.add("cluster-key", statusMissing, fmt.Sprintf("%s is not a regular file", path), fix)
		return
	case st.Mode.Perm()&0o077 != 0:
		c.add("cluster-key", statusMissing, fmt.Sprintf("%s has mode %04o, open to group or others: mpid refuses it", path, st.Mode.Perm()), "chmod 600 "+path)
		return
	case st.UID != 0:
		c.add("cluster-key", statusMissing, fmt.Sprintf("%s is owned by uid %d, not root", path, st.UID), "chown root "+path)
		return
	}
	keys, err := c.n.LoadKeys(path)
	if err != nil {
		c.add("cluster-key", statusMissing, err.Error(), fix)
		return
	}
	c.add("cluster-key", statusOK, fmt.Sprintf("%s (mode %04o, root's, %d key(s))", path, st.Mode.Perm(), keys), "")
}

// nodeName: peers dial this node by its name, so it must resolve, on every
// node, to this node; check says what it resolves to here.
func (c *checker) nodeName() {
	fix := fmt.Sprintf("make %s resolve on every node to this node's cluster address (DNS or /etc/hosts), or set node", c.node)
	if c.node == "" {
		c.add("node-name", statusMissing, "no node name (--node unset, no hostname)", "set node")
		return
	}
	addrs, err := c.n.LookupHost(c.node)
	if err != nil || len(addrs) == 0 {
		c.add("node-name", statusDegraded, fmt.Sprintf("%s does not resolve here: peers dial a node by its name", c.node), fix)
		return
	}
	local, _ := c.n.LocalAddrs()
	var here, loop []string
	for _, a := range addrs {
		ip := net.ParseIP(a)
		for _, l := range local {
			if ip != nil && ip.Equal(l) {
				here = append(here, a)
			}
		}
		if ip != nil && ip.IsLoopback() {
			loop = append(loop, a)
		}
	}
	switch {
	case len(here) == 0 && len(loop) == 0:
		c.add("node-name", statusDegraded, fmt.Sprintf("%s resolves to %s, no address of this node's", c.node, strings.Join(addrs, ", ")), fix)
	case len(loop) == len(addrs):
		c.add("node-name", statusOK, fmt.Sprintf("%s resolves here to loopback %s only; the other nodes must resolve it to this node's cluster address", c.node, strings.Join(addrs, ", ")), "")
	default:
		c.add("node-name", statusOK, fmt.Sprintf("%s resolves to %s (this node)", c.node, strings.Join(addrs, ", ")), "")
	}
}

func (c *checker) peerPort() {
	port := cmp.Or(c.cfg.PeerPort, mpid.DefaultPeerPort)
	addr := cmp.Or(c.cfg.PeerListen, ":"+strconv.Itoa(port))
	c.tcpPort("peer-port", addr, "the pause protocol", "free every node's mpid from it, or set peer-port (the same on every node)")
}

func (c *checker) metrics() {
	if c.cfg.MetricsListen == "" {
		return
	}
	c.tcpPort("metrics", c.cfg.MetricsListen, "Prometheus metrics", "stop what holds it, or set metrics-listen to another address")
}

// tcpPort says whether mpid can listen on addr: free, already mpid's, or
// another process's.
func (c *checker) tcpPort(name, addr, what, fix string) {
	err := c.n.ListenTCP(addr)
	if err == nil {
		c.add(name, statusOK, fmt.Sprintf("TCP %s free (%s)", addr, what), "")
		return
	}
	if !errors.Is(err, syscall.EADDRINUSE) {
		c.add(name, statusMissing, fmt.Sprintf("TCP %s: %v", addr, err), fix)
		return
	}
	_, p, _ := net.SplitHostPort(addr)
	port, _ := strconv.Atoi(p)
	pid, comm, herr := c.n.PortHolder(port)
	switch {
	case herr == nil && comm == "mpid":
		c.add(name, statusOK, fmt.Sprintf("TCP %s held by mpid (pid %d): an mpid already serves this node", addr, pid), "")
	case herr == nil && pid > 0:
		c.add(name, statusMissing, fmt.Sprintf("TCP %s held by %s (pid %d)", addr, comm, pid), fix)
	default:
		c.add(name, statusMissing, fmt.Sprintf("TCP %s in use, by a process this check cannot name", addr), fix)
	}
}

// socket checks a unix socket of mpid's (listenSocket's rules).
func (c *checker) socket(name, addr string) {
	byWhom := func(pid int, comm string) string {
		if comm == "mpid" {
			return fmt.Sprintf("served by mpid (pid %d): an mpid already runs on this node", pid)
		}
		return fmt.Sprintf("served by %s (pid %d), not mpid", comm, pid)
	}
	if strings.HasPrefix(addr, "@") {
		served, pid, comm, err := c.n.DialUnix(addr)
		switch {
		case err != nil:
			c.add(name, statusMissing, fmt.Sprintf("%s: %v", addr, err), "set "+name+" to a path in /run/mpipause")
		case served && comm != "mpid":
			c.add(name, statusMissing, addr+" "+byWhom(pid, comm), "use a path in a directory only root may write")
		case served:
			c.add(name, statusDegraded, addr+" "+byWhom(pid, comm)+"; abstract: any user may take it while mpid is down", "use a path (the default is in /run/mpipause)")
		default:
			c.add(name, statusDegraded, addr+" free; abstract: any user may take it while mpid is down (for tests)", "use a path (the default is in /run/mpipause)")
		}
		return
	}
	if !filepath.IsAbs(addr) {
		c.add(name, statusMissing, addr+" is neither an absolute path nor @name: mpid does not start", "set an absolute path")
		return
	}
	if err := c.n.SocketDir(filepath.Dir(addr)); err != nil {
		c.add(name, statusMissing, err.Error()+": mpid does not start", "as the message says; mpid makes the directory itself (root's, 0755) when it is absent")
		return
	}
	st, err := c.n.Stat(addr)
	switch {
	case err != nil:
		c.add(name, statusMissing, fmt.Sprintf("%s: %v", addr, err), "set "+name+" to a path in /run/mpipause")
		return
	case !st.Exists:
		c.add(name, statusOK, addr+" free (mpid makes it)", "")
		return
	case st.Mode&fs.ModeSocket == 0:
		c.add(name, statusMissing, addr+" exists and is not a socket: mpid does not start", "remove "+addr)
		return
	}
	served, pid, comm, err := c.n.DialUnix(addr)
	switch {
	case err != nil:
		c.add(name, statusMissing, fmt.Sprintf("%s: cannot tell whether a process serves it: %v", addr, err), "remove "+addr+" if no process serves it")
	case served && comm == "mpid":
		c.add(name, statusOK, addr+" "+byWhom(pid, comm), "")
	case served:
		c.add(name, statusMissing, addr+" "+byWhom(pid, comm)+": mpid does not start", "stop that process, or set "+name+" to another path")
	default:
		c.add(name, statusOK, addr+" left by an mpid that is gone: mpid replaces it", "")
	}
}

// shimPaths are where mpipause run looks for the shim when mpipause is
// installed beside mpid (make install: PREFIX/bin and PREFIX/sbin; a
// build: both in bin/): beside the binary, or in ../lib/mpipause.
func shimPaths(exe string) []string {
	dir := filepath.Dir(exe)
	return []string{filepath.Join(dir, "libmpipause.so"), filepath.Join(filepath.Dir(dir), "lib", "mpipause", "libmpipause.so")}
}

func (c *checker) shim() {
	exe, err := c.n.Executable()
	if err != nil {
		c.add("shim", statusMissing, err.Error(), "run the installed mpid (PREFIX/sbin/mpid)")
		return
	}
	cands := shimPaths(exe)
	for _, p := range cands {
		st, err := c.n.Stat(p)
		if err != nil || !st.Exists || !st.Mode.IsRegular() {
			continue
		}
		if err := c.n.Preload(p); err != nil {
			c.add("shim", statusMissing, fmt.Sprintf("%s does not load: %v", p, err), "reinstall it (make install), built for this machine")
			return
		}
		c.add("shim", statusOK, p+" (loads: preloaded into /bin/true)", "")
		return
	}
	c.add("shim", statusMissing, "no libmpipause.so at "+strings.Join(cands, " or ")+": the ranks get no shim, so no job can be paused",
		"make install (the shim goes to PREFIX/lib/mpipause, beside mpid's PREFIX/sbin)")
}

// The Slurm plugin's defaults (slurm/mpipause_spank.c, docs/slurm.md).
const (
	spankName       = "mpipause_spank.so"
	spankShim       = "/usr/lib/mpipause/libmpipause.so"
	slurmConf       = "/etc/slurm/slurm.conf"
	slurmPlugstack  = "/etc/slurm/plugstack.conf"
	plugstackIncMax = 4 // include depth
)

// plugLine is a line of plugstack.conf that names the plugin.
type plugLine struct {
	where, kind, path string
	args              []string
}

func (c *checker) slurm() {
	_, lookErr := c.n.LookPath("slurmd")
	slurmd, _ := c.n.Stat("/usr/sbin/slurmd")
	etc, _ := c.n.Stat("/etc/slurm")
	if lookErr != nil && !slurmd.Exists && !etc.Exists {
		c.add("slurm-plugin", statusOK, "not needed: Slurm is not installed (no slurmd, no /etc/slurm)", "")
		return
	}
	plugstack := slurmPlugstack
	if b, err := c.n.ReadFile(slurmConf); err == nil {
		for _, l := range strings.Split(string(b), "\n") {
			k, v, ok := strings.Cut(strings.TrimSpace(l), "=")
			if ok && strings.EqualFold(strings.TrimSpace(k), "PlugStackConfig") {
				plugstack = strings.TrimSpace(v)
			}
		}
	}
	// Where make install puts it: beside the shim (in a build, bin/).
	exe, _ := c.n.Executable()
	var installed string
	for _, p := range shimPaths(exe) {
		installed = filepath.Join(filepath.Dir(p), spankName)
		plugin, _ := c.n.Stat(installed)
		shim, _ := c.n.Stat(p)
		if plugin.Exists || shim.Exists {
			break
		}
	}
	var found []plugLine
	c.readPlugstack(plugstack, 0, &found)
	if len(found) == 0 {
		st, _ := c.n.Stat(installed)
		have := "not installed at " + installed
		if st.Exists {
			have = "installed at " + installed
		}
		c.add("slurm-plugin", statusDegraded, fmt.Sprintf("Slurm is here; %s names no %s (%s): scontrol suspend stops jobs with SIGSTOP, without a pause", plugstack, spankName, have),
			fmt.Sprintf("'required %s' in %s (docs/slurm.md); building it needs libslurm-dev", installed, plugstack))
		return
	}
	pl := found[0]
	shimArg := spankShim
	for _, a := range pl.args {
		if v, ok := strings.CutPrefix(a, "shim="); ok {
			shimArg = v
		}
	}
	if !filepath.IsAbs(pl.path) {
		c.add("slurm-plugin", statusOK, fmt.Sprintf("%s: %s %s (looked up in Slurm's PluginDir, not checked here)", pl.where, pl.kind, pl.path), "")
		return
	}
	if st, err := c.n.Stat(pl.path); err != nil || !st.Exists {
		c.add("slurm-plugin", statusMissing, fmt.Sprintf("%s names %s, which does not exist (%s: every srun fails when it is required)", pl.where, pl.path, pl.kind),
			"make install with libslurm-dev installed, or fix the line")
		return
	}
	if st, err := c.n.Stat(shimArg); err != nil || !st.Exists {
		c.add("slurm-plugin", statusMissing, fmt.Sprintf("%s: %s gives the tasks the shim %s, which does not exist", pl.where, pl.path, shimArg),
			"make install, or shim=PATH on the plugin's line")
		return
	}
	c.add("slurm-plugin", statusOK, fmt.Sprintf("%s: %s %s (shim %s)", pl.where, pl.kind, pl.path, shimArg), "")
}

// readPlugstack collects the lines of file (and the files it includes)
// that name the plugin.
func (c *checker) readPlugstack(file string, depth int, found *[]plugLine) {
	b, err := c.n.ReadFile(file)
	if err != nil || depth > plugstackIncMax {
		return
	}
	for i, l := range strings.Split(string(b), "\n") {
		if j := strings.IndexByte(l, '#'); j >= 0 {
			l = l[:j]
		}
		f := strings.Fields(l)
		if len(f) < 2 {
			continue
		}
		if f[0] == "include" {
			matches, _ := c.n.Glob(f[1])
			for _, m := range matches {
				c.readPlugstack(m, depth+1, found)
			}
			continue
		}
		if (f[0] == "required" || f[0] == "optional") && filepath.Base(f[1]) == spankName {
			*found = append(*found, plugLine{where: fmt.Sprintf("%s:%d", file, i+1), kind: f[0], path: f[1], args: f[2:]})
		}
	}
}
