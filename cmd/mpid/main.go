// Command mpid is mpipause's node daemon (root, one per node). See package
// internal/mpid for what it does and docs/mpid.md for how.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"syscall"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/jobid"
	"github.com/mpipause/mpipause/internal/metrics"
	"github.com/mpipause/mpipause/internal/mpid"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/quiesce"
)

type config struct {
	service // --config, --log-format: config.go, log.go
	mpid.Config
	readyFile string
	keyFile   string
}

// DefaultKeyFile is where mpid looks for the cluster key.
const DefaultKeyFile = "/etc/mpipause/cluster.key"

func main() {
	if len(os.Args) > 1 && os.Args[1] == "keygen" {
		if err := keygen(os.Args[2:], os.Stdout); err != nil {
			if errors.Is(err, flag.ErrHelp) {
				os.Exit(0)
			}
			fmt.Fprintf(os.Stderr, "mpid keygen: %v\n", err)
			os.Exit(2)
		}
		return
	}
	if len(os.Args) > 1 && os.Args[1] == "check" {
		os.Exit(check(os.Args[2:], os.Stdout, os.Stderr, kernelNode{}))
	}
	cfg, err := parseArgs(os.Args[1:], os.Stdout)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "mpid: %v\n", err)
		os.Exit(2)
	}
	if cfg.ClusterKey, err = quiesce.LoadKeys(cfg.keyFile); err != nil {
		if errors.Is(err, fs.ErrNotExist) {
			err = fmt.Errorf("no cluster key at %s: make one with 'mpid keygen %s' and copy it to every node (mode 0600), or point --cluster-key at it", cfg.keyFile, cfg.keyFile)
		}
		fmt.Fprintf(os.Stderr, "mpid: %v\n", err)
		os.Exit(2)
	}
	cfg.Log = slog.New(newLogHandler(os.Stderr, cfg.logFormat, journalStream(os.Stderr)))
	// Packages that log through the default logger write the same
	// key=value lines as the daemon, not the log package's format.
	slog.SetDefault(cfg.Log)
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	context.AfterFunc(ctx, stopping)
	d, err := mpid.New(cfg.Config)
	if err == nil {
		err = d.Run(ctx, cfg.ready)
	}
	if cfg.readyFile != "" {
		os.Remove(cfg.readyFile)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "mpid: %v\n", err)
		os.Exit(1)
	}
}

const usage = `usage: mpid [options]
       mpid check [--json] [options]
       mpid keygen [--next | --promote | --retire] [FILE]

mpipause's node daemon: run one as root on every node of the cluster. It moves
the ranks of jobs started with 'mpipause run' into a cgroup per job, watches
their TCP connections with eBPF, and pauses and resumes them with the other
nodes' mpids (TCP port 7170). The mpipause command talks to it.

The mpids of a cluster authenticate each other with a shared key: make it
once with 'mpid keygen' (default file ` + DefaultKeyFile + `) and copy it to
every node, mode 0600. mpids speak TLS 1.3 to each other with certificates
derived from it: a peer without the key is refused, and a node that answers
for another node's name too. 'mpid keygen --next' starts a move to a new
key without stopping the cluster (docs/install.md).

'mpid check' says whether this node has what mpid needs (the kernel, its
BPF programs, capabilities, cgroup v2, the key, the ports, the shim), one
row each, read with the same options and settings file; run it before
enabling the service. It changes nothing on the node.

Every option can also be set in the settings file (--config, default
` + DefaultConfigFile + `, read if it exists): one "name = value" per
line; the command line wins over it. 'mpid --print-config' prints such a file
with every option at its default. Under systemd (mpid.service, Type=notify)
mpid reports READY=1 once it serves and STOPPING=1 when it stops, and
its log lines carry their syslog priority for the journal.

options:
`

func parseFlags(args []string, out io.Writer) (config, error) {
	return parseCommand("mpid", usage, args, out, nil)
}

// parseCommand is parseFlags for mpid or one of its commands that take
// mpid's options (name, e.g. "mpid check", whose --help prints help and
// the options), with the command's own options added by extra.
func parseCommand(name, help string, args []string, out io.Writer, extra func(*flag.FlagSet)) (config, error) {
	var cfg config
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	if extra != nil {
		extra(fs)
	}
	cfg.service.addFlags(fs)
	fs.StringVar(&cfg.Node, "node", "", "this node's `name`, as peers resolve it and ranks report it (default: the hostname)")
	fs.IntVar(&cfg.PeerPort, "peer-port", mpid.DefaultPeerPort, "TCP `port` of the pause protocol, here and on every peer")
	fs.StringVar(&cfg.PeerListen, "peer-listen", "", "TCP `address` to serve the pause protocol on (default: all addresses, --peer-port)")
	fs.StringVar(&cfg.RankSocket, "rank-socket", ranks.DefaultAddr, "unix `socket` the ranks' shims register on: a path in a directory only root may write (made if missing), or @name (abstract: any user may take it while mpid is down; for tests)")
	fs.StringVar(&cfg.CtlSocket, "ctl-socket", ctl.DefaultAddr, "unix `socket` the mpipause command talks to (a path as --rank-socket, or @name)")
	fs.StringVar(&cfg.CgroupParent, "cgroup-parent", "mpipause", "cgroup v2 `path` (relative to the v2 mount) under which each job gets its cgroup")
	fs.StringVar(&cfg.FixedCgroup, "cgroup", "", "instead: a cgroup v2 `path` the launcher already put every rank in; mpid moves nobody and freezes it whole (one job per node)")
	fs.DurationVar(&cfg.Drain, "drain-timeout", 10*time.Second, "default drain `timeout` of a pause (mpipause --timeout overrides it)")
	fs.IntVar(&cfg.RTPriority, "rt-priority", 1, "run mpid's threads under SCHED_RR at this `priority` (1..99; 0: not real-time, --nice alone): mpid sleeps but for short steps, and among busy-polling ranks a resume's replies would otherwise queue behind them. No thread of a rank is ever raised, and work anyone can cause before mpid knows what they may ask (accepting connections on its sockets, the peer port's TLS handshakes) runs without it, at nice 0")
	fs.IntVar(&cfg.Nice, "nice", -10, "scheduling `niceness` of mpid's threads (-20..19; 0 leaves it): below the ranks', so that a pause's steps are not queued behind busy-polling ranks")
	fs.StringVar(&cfg.StateDir, "state-dir", "", "`directory` of the records that let a restarted mpid resume the jobs paused before (default /run/mpipause/mpid-NODE)")
	fs.StringVar(&cfg.keyFile, "cluster-key", DefaultKeyFile, "the cluster key `file` shared by every node's mpid (mode 0600; make one with mpid keygen)")
	fs.StringVar(&cfg.readyFile, "ready-file", "", "write this `file` (with mpid's pid) once every socket listens; removed at exit")
	fs.StringVar(&cfg.MetricsListen, "metrics-listen", "", "serve Prometheus metrics at http://`address`/metrics: host:port with an explicit host, 127.0.0.1:9717 for this node only, 0.0.0.0:9717 or [::]:9717 for every interface (default: off, nothing listens)")
	fs.BoolVar(&cfg.Unpin, "unpin-on-exit", false, "detach and unpin the jobs' BPF state on exit (default: keep it for the next mpid)")
	fs.BoolVar(&cfg.LogTimeline, "log-timeline", false, "log one line (\"step timeline\") per pause, resume or rollback this node takes part in: when each of its steps ran, how long it took, each drain check's outcome and when each rank answered the DRAIN, in milliseconds from the first step (for finding where a slow pause's time went)")
	// flag prints the usage on every error; only -h gets it here, a mistake
	// gets one line.
	fs.Usage = func() {}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(out, help)
			fs.SetOutput(out)
			fs.PrintDefaults()
			return cfg, err
		}
		return cfg, fmt.Errorf("%v; see %s --help", err, name)
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected argument %q; see %s --help", fs.Arg(0), name)
	}
	if err := cfg.service.apply(fs, out); err != nil {
		return cfg, err
	}
	if cfg.PeerPort <= 0 || cfg.PeerPort > 65535 {
		return cfg, fmt.Errorf("--peer-port %d: want 1-65535", cfg.PeerPort)
	}
	if cfg.Drain <= 0 || cfg.Drain > ctl.MaxTimeout {
		return cfg, fmt.Errorf("--drain-timeout %v: want a positive duration of at most %v, such as 10s", cfg.Drain, ctl.MaxTimeout)
	}
	if cfg.RTPriority < 0 || cfg.RTPriority > 99 {
		return cfg, fmt.Errorf("--rt-priority %d: want 0..99", cfg.RTPriority)
	}
	if cfg.Nice < -20 || cfg.Nice > 19 {
		return cfg, fmt.Errorf("--nice %d: want -20..19", cfg.Nice)
	}
	if cfg.MetricsListen != "" {
		if err := metrics.CheckAddr(cfg.MetricsListen); err != nil {
			return cfg, err
		}
	}
	if filepath.IsAbs(cfg.CgroupParent) || cfg.CgroupParent == "" {
		return cfg, fmt.Errorf("--cgroup-parent %q: want a path relative to the cgroup v2 mount, such as mpipause", cfg.CgroupParent)
	}
	// The node's name is what the ranks' HELLOs must match and what peers
	// and root's terminal see: the same rule as ranks' host names.
	if cfg.Node != "" && !jobid.ValidHostName(cfg.Node) {
		return cfg, fmt.Errorf("--node %q: %s", cfg.Node, jobid.HostNameRule)
	}
	if h, err := os.Hostname(); cfg.Node == "" && err == nil && !jobid.ValidHostName(h) {
		return cfg, fmt.Errorf("the hostname %q is not a node name mpid can use (%s): set --node", h, jobid.HostNameRule)
	}
	return cfg, nil
}

// writeReady creates the ready file atomically, so a waiter never sees it half-written.
func writeReady(path string) error {
	tmp := filepath.Join(filepath.Dir(path), "."+filepath.Base(path)+".tmp")
	if err := os.WriteFile(tmp, []byte(fmt.Sprintf("%d\n", os.Getpid())), 0o644); err != nil {
		return fmt.Errorf("write ready file: %w", err)
	}
	if err := os.Rename(tmp, path); err != nil {
		return fmt.Errorf("write ready file: %w", err)
	}
	return nil
}

const keygenUsage = `usage: mpid keygen [--next | --promote | --retire] [FILE]

Writes a new random cluster key to FILE (default ` + DefaultKeyFile + `),
mode 0600, and never over an existing file. Copy the same file to every node
of the cluster; mpid reads it with --cluster-key.

A key file may hold a few keys, one per line: mpid uses the first and accepts
every one. To move a running cluster to a new key, run each step on one
node, copy FILE to every node and restart every mpid before the next step:
  --next     add a new key, accepted but not yet used
  --promote  use the new key; the old one stays accepted
  --retire   drop every key but the one in use
`

// keygen writes a new cluster key file, or takes one step of a move to a
// new key.
func keygen(args []string, out io.Writer) error {
	fs := flag.NewFlagSet("mpid keygen", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {}
	next := fs.Bool("next", false, "")
	promote := fs.Bool("promote", false, "")
	retire := fs.Bool("retire", false, "")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(out, keygenUsage)
			return err
		}
		return fmt.Errorf("%v; see mpid keygen --help", err)
	}
	if fs.NArg() > 1 {
		return fmt.Errorf("want at most one file, got %d arguments; see mpid keygen --help", fs.NArg())
	}
	path := DefaultKeyFile
	if fs.NArg() == 1 {
		path = fs.Arg(0)
	}
	steps := 0
	for _, b := range []bool{*next, *promote, *retire} {
		if b {
			steps++
		}
	}
	if steps > 1 {
		return errors.New("--next, --promote and --retire are steps of their own: give one; see mpid keygen --help")
	}
	if steps == 1 {
		return rotate(path, *next, *promote, out)
	}
	if err := os.MkdirAll(filepath.Dir(path), 0o755); err != nil {
		return err
	}
	k, err := quiesce.GenerateKey()
	if err != nil {
		return err
	}
	if err := quiesce.WriteKeyFile(path, k); err != nil {
		return err
	}
	fmt.Fprintf(out, "wrote a new cluster key to %s (mode 0600): copy it to every node\n", path)
	return nil
}

// rotate takes one step of a move to a new key in the key file at path:
// next adds one, promote makes it the one in use, and neither retires
// every other key.
func rotate(path string, next, promote bool, out io.Writer) error {
	ring, err := quiesce.LoadKeys(path)
	if err != nil {
		return err
	}
	keys := ring.All()
	var what string
	switch {
	case next:
		if len(keys) > 1 {
			return fmt.Errorf("%s already holds %d keys: finish the move first (--promote, then --retire)", path, len(keys))
		}
		k, err := quiesce.GenerateKey()
		if err != nil {
			return err
		}
		keys, what = []*quiesce.Key{keys[0], k}, "added a new key, accepted but not yet used"
	case promote:
		if len(keys) != 2 {
			return fmt.Errorf("%s holds %d key(s), not a key in use and a next one: run --next first", path, len(keys))
		}
		keys, what = []*quiesce.Key{keys[1], keys[0]}, "the new key is in use; the old one is still accepted"
	default:
		if len(keys) == 1 {
			return fmt.Errorf("%s holds only the key in use: nothing to retire", path)
		}
		keys, what = keys[:1], "retired every key but the one in use"
	}
	if err := quiesce.ReplaceKeyFile(path, keys...); err != nil {
		return err
	}
	fmt.Fprintf(out, "%s: %s; copy it to every node and restart every mpid before the next step\n", path, what)
	return nil
}
