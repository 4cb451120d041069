package rig

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"io/fs"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"time"

	"golang.org/x/sys/unix"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/quiesce"
)

// MPIDBinary is the node daemon's file name in BinDir.
const MPIDBinary = "mpid"

// MPIDEnv, in up's environment, names the mpid binary to start instead of
// BinDir/mpid: the fault tests set it to the test build (bin/test/mpid,
// with the failpoint hook the production mpid does not have).
const MPIDEnv = "MPIPAUSE_RIG_MPID"

// CgroupParent is where, relative to the cgroup v2 root, each node's mpid
// keeps its cgroups: CgroupParent/<rig>/<node>. The nodes share the host's
// hierarchy (no cgroup namespace), so rig and node names keep them apart.
const CgroupParent = "mpipause-rig"

// ErrNoMPID: BinDir has no mpid to start.
var ErrNoMPID = errors.New("no mpid")

// How long daemons get: to write their ready files (all of them, together),
// and to exit after SIGTERM before SIGKILL. Variables for the tests;
// MPIPAUSE_RIG_READY_TIMEOUT (a duration) gives a slower machine more, such
// as a kernel booted under emulation (kernel-tests/kernels/boot.sh
// --host-root), where mpid's check of the kernel observer at start alone
// takes seconds.
var (
	readyTimeout = envDuration("MPIPAUSE_RIG_READY_TIMEOUT", 15*time.Second)
	stopTimeout  = 5 * time.Second
)

// envDuration is the duration in the environment variable name, or def
// when it is unset or not a positive duration.
func envDuration(name string, def time.Duration) time.Duration {
	if d, err := time.ParseDuration(os.Getenv(name)); err == nil && d > 0 {
		return d
	}
	return def
}

const daemonPoll = 20 * time.Millisecond

// Daemon is what state.json records of one node's mpid.
type Daemon struct {
	Node string `json:"node"`
	Pid  int    `json:"pid"`
	// Start is the process's start time (/proc/PID/stat, clock ticks since
	// boot): with Pid it names the process even once the pid is reused.
	Start uint64 `json:"start_ticks"`
	Exe   string `json:"exe"`
	Ready string `json:"ready_file"`
	Log   string `json:"log"`
}

func (r *Rig) mpidPath() string {
	if p := os.Getenv(MPIDEnv); p != "" {
		if abs, err := filepath.Abs(p); err == nil {
			return abs
		}
		return p
	}
	if r.cfg.BinDir == "" {
		return ""
	}
	p, err := filepath.Abs(filepath.Join(r.cfg.BinDir, MPIDBinary))
	if err != nil {
		return filepath.Join(r.cfg.BinDir, MPIDBinary)
	}
	return p
}

func (r *Rig) readyFile(i int) string {
	return filepath.Join(r.Dir(), "mpid-"+NodeName(i)+".ready")
}

func (r *Rig) logFile(i int) string {
	return filepath.Join(r.Dir(), "mpid-"+NodeName(i)+".log")
}

// CgroupDir returns the cgroup, relative to the cgroup v2 root, that node i's
// mpid is given as --cgroup-parent.
func (r *Rig) CgroupDir(i int) string {
	return CgroupParent + "/" + r.cfg.Name + "/" + NodeName(i)
}

// checkMPID fails unless up can start mpid (or is told not to).
func (r *Rig) checkMPID() error {
	if r.cfg.NoMPID {
		return nil
	}
	p := r.mpidPath()
	if p == "" {
		return fmt.Errorf("%w: no bin directory to find it in: run make build", ErrNoMPID)
	}
	if fi, err := os.Stat(p); err != nil || !fi.Mode().IsRegular() || unix.Access(p, unix.X_OK) != nil {
		return fmt.Errorf("%w at %s (rig up --no-mpid starts none): run make build", ErrNoMPID, p)
	}
	return nil
}

// MPIDArgsEnv, in up's environment, holds more arguments for every node's
// mpid, split at white space (e.g. "--metrics-listen 127.0.0.1:9717": each
// node is a network namespace of its own, so every mpid gets its own
// loopback address). They come after the rig's own.
const MPIDArgsEnv = "MPIPAUSE_RIG_MPID_ARGS"

// MPIDArgs returns the arguments, after the program name, of node i's mpid
// in a rig of n nodes. (Peers need no list: a job's coordinator learns the
// job's nodes from their mpids' registrations, and the rig's /etc/hosts
// resolves them.)
func (r *Rig) MPIDArgs(i, n int) []string {
	return append([]string{
		"--node", NodeName(i),
		"--cgroup-parent", r.CgroupDir(i),
		"--ready-file", r.readyFile(i),
		"--cluster-key", r.KeyFile(),
		// Not the machine's own settings (/etc/mpipause/mpid.conf, if
		// mpipause is installed here): the rig's mpids are the rig's.
		"--config", os.DevNull,
	}, strings.Fields(os.Getenv(MPIDArgsEnv))...)
}

// KeyFile is the rig's cluster key, shared by its mpids (written by up).
func (r *Rig) KeyFile() string { return filepath.Join(r.Dir(), "cluster.key") }

// ensureKey writes the rig's cluster key unless it has one.
func (r *Rig) ensureKey() error {
	if _, err := os.Stat(r.KeyFile()); err == nil {
		return nil
	}
	k, err := quiesce.GenerateKey()
	if err != nil {
		return err
	}
	return quiesce.WriteKeyFile(r.KeyFile(), k)
}

// daemon returns the recorded daemon of node, if any.
func (st *State) daemon(node string) (Daemon, bool) {
	for _, d := range st.MPID {
		if d.Node == node {
			return d, true
		}
	}
	return Daemon{}, false
}

func (st *State) setDaemon(d Daemon) {
	for k := range st.MPID {
		if st.MPID[k].Node == d.Node {
			st.MPID[k] = d
			return
		}
	}
	st.MPID = append(st.MPID, d)
}

func (st *State) dropDaemons(ds []Daemon) {
	keep := st.MPID[:0]
	for _, d := range st.MPID {
		drop := false
		for _, x := range ds {
			drop = drop || x.Pid == d.Pid && x.Start == d.Start
		}
		if !drop {
			keep = append(keep, d)
		}
	}
	st.MPID = keep
}

// startDaemons starts an mpid in every node that has no live one and waits
// until every node's mpid has written its ready file, so that whoever ran
// `up` can use the daemons at once. If one fails, the ones this call
// started are stopped again.
func (r *Rig) startDaemons(ctx context.Context, st *State) error {
	if r.cfg.NoMPID {
		return nil
	}
	// The cgroup parent is the rig's to make (and down's to remove), so
	// mpid finds it whether or not it makes missing parents itself.
	if root, err := cgroupv2.Root(); err == nil {
		for i := 0; i < st.Nodes; i++ {
			if err := cgroupv2.Create(filepath.Join(root, r.CgroupDir(i))); err != nil {
				return err
			}
		}
	}
	if err := r.ensureKey(); err != nil {
		return fmt.Errorf("rig cluster key: %w", err)
	}
	// The daemon gets what `rig exec` gives a command, but no preload: the
	// finalize fix (and a caller's shim) are for MPI ranks, not for mpid.
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "LD_PRELOAD=") {
			env = append(env, kv)
		}
	}
	type waiting struct {
		d      Daemon
		exited chan error // nil for a daemon this call did not start
		ready  bool
	}
	var started []Daemon
	var ws []*waiting
	for i := 0; i < st.Nodes; i++ {
		if d, ok := st.daemon(NodeName(i)); ok && d.alive() {
			ws = append(ws, &waiting{d: d})
			continue
		}
		d, exited, err := r.startDaemon(st, i, env)
		if err != nil {
			r.undoStart(st, started)
			return err
		}
		st.setDaemon(d)
		started = append(started, d)
		ws = append(ws, &waiting{d: d, exited: exited})
	}
	if len(started) > 0 {
		if err := r.saveState(st); err != nil {
			r.undoStart(st, started)
			return err
		}
	}
	fail := func(err error) error {
		r.undoStart(st, started)
		return err
	}
	deadline := time.Now().Add(readyTimeout)
	tick := time.NewTicker(daemonPoll)
	defer tick.Stop()
	for {
		pending := 0
		for _, w := range ws {
			if w.ready {
				continue
			}
			if _, err := os.Stat(w.d.Ready); err == nil {
				w.ready = true
				continue
			}
			pending++
			if w.exited != nil {
				select {
				case err := <-w.exited:
					if err == nil {
						err = errors.New("exit status 0")
					}
					return fail(fmt.Errorf("mpid on %s exited (%v) before it was ready; %s", w.d.Node, err, logTail(w.d.Log)))
				default:
				}
			} else if !w.d.alive() {
				return fail(fmt.Errorf("mpid on %s (pid %d) died before it was ready; %s", w.d.Node, w.d.Pid, logTail(w.d.Log)))
			}
		}
		if pending == 0 {
			return nil
		}
		if time.Now().After(deadline) {
			for _, w := range ws {
				if !w.ready {
					return fail(fmt.Errorf("mpid on %s not ready after %v (no %s); %s", w.d.Node, readyTimeout, w.d.Ready, logTail(w.d.Log)))
				}
			}
		}
		select {
		case <-ctx.Done():
			return fail(fmt.Errorf("waiting for the mpids to be ready: %w", ctx.Err()))
		case <-tick.C:
		}
	}
}

// startDaemon starts node i's mpid as `rig exec` would place it, detached:
// a session of its own (no terminal's signals), stdin /dev/null, output
// appended to its log, so it outlives up. exited reports its end, for as
// long as this process lives.
func (r *Rig) startDaemon(st *State, i int, env []string) (d Daemon, exited chan error, err error) {
	exe := r.mpidPath()
	d = Daemon{Node: NodeName(i), Exe: exe, Ready: r.readyFile(i), Log: r.logFile(i)}
	// A ready file left by a dead daemon would pass for the new one's.
	if err := os.Remove(d.Ready); err != nil && !errors.Is(err, os.ErrNotExist) {
		return d, nil, fmt.Errorf("mpid on %s: %w", d.Node, err)
	}
	argv := append(append(append([]string{}, r.cfg.MPIDWrap...), exe), r.MPIDArgs(i, st.Nodes)...)
	x, err := r.nodeCommand(st, i, argv, r.buildNodeEnv(env, i, st, false), "/")
	if err != nil {
		return d, nil, err
	}
	logf, err := os.OpenFile(d.Log, os.O_WRONLY|os.O_CREATE|os.O_APPEND, 0o644)
	if err != nil {
		return d, nil, fmt.Errorf("mpid on %s: %w", d.Node, err)
	}
	defer logf.Close()
	fmt.Fprintf(logf, "%s %s %s\n", logMark, time.Now().Format(time.RFC3339), strings.Join(argv, " "))
	// Stdin nil is /dev/null; no CommandContext: up's context ending must
	// not kill a daemon that is meant to outlive it.
	cmd := &exec.Cmd{
		Path: x.Path, Args: x.Argv, Env: x.Env,
		Stdout: logf, Stderr: logf,
		SysProcAttr: &syscall.SysProcAttr{Setsid: true},
	}
	if err := cmd.Start(); err != nil {
		return d, nil, fmt.Errorf("start mpid on %s: %w", d.Node, err)
	}
	d.Pid = cmd.Process.Pid
	// nsenter execs mpid in place: the pid and start time are mpid's.
	if d.Start, _, err = procStat(d.Pid); err != nil {
		cmd.Process.Kill()
		cmd.Wait()
		return d, nil, fmt.Errorf("start mpid on %s: %w", d.Node, err)
	}
	exited = make(chan error, 1)
	go func() { exited <- cmd.Wait() }() // also reaps it if it dies while we live
	return d, exited, nil
}

// logMark starts the line up writes into a daemon's log before each start,
// which separates the runs of an appended log.
const logMark = "--- rig up:"

// undoStart stops the daemons one failed up started and forgets them.
func (r *Rig) undoStart(st *State, ds []Daemon) {
	if len(ds) == 0 {
		return
	}
	stopDaemonList(context.Background(), ds)
	st.dropDaemons(ds)
	r.saveState(st)
}

// stopDaemons stops the recorded daemons: SIGTERM, up to stopTimeout to
// exit, then SIGKILL. A daemon already gone is not an error, nor is a pid
// now used by another process, which is left alone.
func (r *Rig) stopDaemons(ctx context.Context, st *State) error {
	if len(st.MPID) == 0 {
		return nil
	}
	err := stopDaemonList(ctx, st.MPID)
	st.MPID = nil
	return errors.Join(err, r.saveState(st))
}

func stopDaemonList(ctx context.Context, ds []Daemon) error {
	var live []Daemon
	for _, d := range ds {
		if d.alive() {
			syscall.Kill(d.Pid, syscall.SIGTERM)
			live = append(live, d)
		}
	}
	live = waitGone(ctx, live, stopTimeout)
	for _, d := range live {
		if d.alive() {
			syscall.Kill(d.Pid, syscall.SIGKILL)
		}
	}
	// SIGKILL cannot be refused, but the exit takes a moment, and the
	// caller goes on to remove what the daemon may still be using.
	live = waitGone(context.Background(), live, stopTimeout)
	var errs []error
	for _, d := range ds {
		if err := os.Remove(d.Ready); err != nil && !errors.Is(err, os.ErrNotExist) {
			errs = append(errs, err)
		}
	}
	for _, d := range live {
		errs = append(errs, fmt.Errorf("mpid on %s (pid %d) survives SIGKILL", d.Node, d.Pid))
	}
	return errors.Join(errs...)
}

// waitGone waits until none of ds is alive, ctx ends or timeout passes, and
// returns the ones still alive.
func waitGone(ctx context.Context, ds []Daemon, timeout time.Duration) []Daemon {
	deadline := time.Now().Add(timeout)
	for {
		var live []Daemon
		for _, d := range ds {
			if d.alive() {
				live = append(live, d)
			}
		}
		if len(live) == 0 || time.Now().After(deadline) {
			return live
		}
		ds = live
		select {
		case <-ctx.Done():
			return live
		case <-time.After(daemonPoll):
		}
	}
}

// alive reports whether d's process still runs and is still that mpid: the
// same pid and start time, and its executable or, for a script, its
// arguments name mpid and d's ready file. A zombie counts as gone (where
// nothing reaps orphans, dead daemons stay zombies).
func (d Daemon) alive() bool {
	if d.Pid <= 0 {
		return false
	}
	start, state, err := procStat(d.Pid)
	if err != nil || start != d.Start || state == 'Z' || state == 'X' {
		return false
	}
	proc := "/proc/" + strconv.Itoa(d.Pid)
	if exe, err := os.Readlink(proc + "/exe"); err == nil && strings.TrimSuffix(exe, " (deleted)") == d.Exe {
		return true
	}
	b, err := os.ReadFile(proc + "/cmdline")
	if err != nil {
		return false
	}
	args := strings.Split(string(bytes.TrimRight(b, "\x00")), "\x00")
	return contains(args, d.Exe) && containsPair(args, "--ready-file", d.Ready)
}

func containsPair(args []string, k, v string) bool {
	for j := 0; j+1 < len(args); j++ {
		if args[j] == k && args[j+1] == v {
			return true
		}
	}
	return contains(args, k+"="+v)
}

// procStat returns the start time (clock ticks since boot) and state of pid.
func procStat(pid int) (start uint64, state byte, err error) {
	b, err := os.ReadFile("/proc/" + strconv.Itoa(pid) + "/stat")
	if err != nil {
		return 0, 0, err
	}
	// pid (comm) state ppid ... starttime is field 22; comm may contain
	// spaces and parentheses.
	s := string(b)
	k := strings.LastIndexByte(s, ')')
	if k < 0 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	f := strings.Fields(s[k+1:])
	if len(f) < 20 || len(f[0]) != 1 {
		return 0, 0, fmt.Errorf("/proc/%d/stat: unexpected format", pid)
	}
	start, err = strconv.ParseUint(f[19], 10, 64)
	if err != nil {
		return 0, 0, fmt.Errorf("/proc/%d/stat: %w", pid, err)
	}
	return start, f[0][0], nil
}

// logTail quotes the last lines a daemon wrote to its log, on one line.
func logTail(path string) string {
	const maxLines, maxBytes = 4, 8192
	f, err := os.Open(path)
	if err != nil {
		return fmt.Sprintf("no log: %v", err)
	}
	defer f.Close()
	if fi, err := f.Stat(); err == nil && fi.Size() > maxBytes {
		f.Seek(fi.Size()-maxBytes, 0)
	}
	b := make([]byte, maxBytes)
	n, _ := f.Read(b)
	lines := strings.Split(string(b[:n]), "\n")
	// Only the last run's lines.
	for k := len(lines) - 1; k >= 0; k-- {
		if strings.HasPrefix(lines[k], logMark) {
			lines = lines[k+1:]
			break
		}
	}
	var out []string
	for _, l := range lines {
		if l = strings.TrimSpace(l); l != "" {
			out = append(out, l)
		}
	}
	if len(out) == 0 {
		return path + " is empty"
	}
	if len(out) > maxLines {
		out = out[len(out)-maxLines:]
	}
	return fmt.Sprintf("last lines of %s: %q", path, strings.Join(out, " | "))
}

// removeCgroups removes the rig's cgroups, CgroupParent/<rig> and what is
// below it, leaves first, and CgroupParent itself once no rig uses it. It
// runs after the nodes' processes are killed, so the cgroups are empty;
// cgroupv2.Remove moves anything else still in one to the root rather than
// kill it.
func (r *Rig) removeCgroups() error {
	root, err := cgroupv2.Root()
	if err != nil {
		return nil // no cgroup v2, so no cgroups of ours either
	}
	top := filepath.Join(root, CgroupParent, r.cfg.Name)
	var dirs []string
	err = filepath.WalkDir(top, func(p string, e fs.DirEntry, err error) error {
		if err != nil {
			if errors.Is(err, fs.ErrNotExist) {
				return nil
			}
			return err
		}
		if e.IsDir() {
			dirs = append(dirs, p)
		}
		return nil
	})
	if err != nil {
		return fmt.Errorf("list cgroups under %s: %w", top, err)
	}
	var errs []error
	for k := len(dirs) - 1; k >= 0; k-- { // WalkDir lists parents before their children
		if err := cgroupv2.Remove(dirs[k]); err != nil {
			errs = append(errs, err)
		}
	}
	unix.Rmdir(filepath.Join(root, CgroupParent)) // only if no other rig's is in it
	return errors.Join(errs...)
}
