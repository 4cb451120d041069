// Command mpid is mpipause's node daemon. Today it holds the kernel observer
// of a job's cgroup attached and pinned, so that its counters run from the
// job's start and survive a restart of the daemon, and it serves the rank
// channel on which the shims of the job's ranks register (only processes of
// the job's cgroup are admitted). Driving the gates, draining, freezing and
// the pause protocol arrive with the consistent-pause issue.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"log/slog"
	"os"
	"os/signal"
	"path/filepath"
	"strings"
	"syscall"

	"github.com/mpipause/mpipause/internal/cgroupv2"
	"github.com/mpipause/mpipause/internal/ranks"
	"github.com/mpipause/mpipause/loader"
)

type config struct {
	cgroup     string
	readyFile  string
	unpin      bool
	rankSocket string
}

func main() {
	cfg, err := parseFlags(os.Args[1:], os.Stdout)
	if errors.Is(err, flag.ErrHelp) {
		os.Exit(0)
	}
	if err != nil {
		fmt.Fprintf(os.Stderr, "mpid: %v\n", err)
		os.Exit(2)
	}
	log := slog.New(slog.NewTextHandler(os.Stderr, nil))
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	if err := run(ctx, cfg, log); err != nil {
		fmt.Fprintf(os.Stderr, "mpid: %v\n", err)
		os.Exit(1)
	}
}

func parseFlags(args []string, out io.Writer) (config, error) {
	var cfg config
	fs := flag.NewFlagSet("mpid", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.StringVar(&cfg.cgroup, "cgroup", "", "job cgroup v2 `path` to observe (absolute, or relative to the v2 mount)")
	fs.StringVar(&cfg.readyFile, "ready-file", "", "write this `file` once the observer is attached")
	fs.StringVar(&cfg.rankSocket, "rank-socket", ranks.DefaultAddr, "unix `socket` the ranks' shims register on (@name: abstract, one per network namespace)")
	fs.BoolVar(&cfg.unpin, "unpin-on-exit", false, "detach and unpin the job's BPF state on exit (default: keep it for the next mpid)")
	// flag prints the usage on every error; only -h gets it here, a mistake
	// gets one line.
	fs.Usage = func() {}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprintln(out, "usage: mpid --cgroup PATH [--ready-file FILE] [--rank-socket ADDR] [--unpin-on-exit]")
			fmt.Fprintln(out, "\nmpipause's node daemon (root).\n\noptions:")
			fs.SetOutput(out)
			fs.PrintDefaults()
			return cfg, err
		}
		return cfg, fmt.Errorf("%v; see mpid --help", err)
	}
	if fs.NArg() > 0 {
		return cfg, fmt.Errorf("unexpected argument %q; see mpid --help", fs.Arg(0))
	}
	if cfg.cgroup == "" {
		return cfg, errors.New("--cgroup is required: the job cgroup to observe; see mpid --help")
	}
	return cfg, nil
}

// run holds the observer until ctx ends. The BPF state stays pinned after
// run returns unless cfg.unpin: a restarted mpid picks it up where it was.
func run(ctx context.Context, cfg config, log *slog.Logger) error {
	lc := loader.Config{
		Cgroup:    cfg.cgroup,
		FollowJob: true,
		Pin:       true,
		Require:   loader.KindBPF,
	}
	obs, err := loader.Open(ctx, lc)
	if err != nil {
		return err
	}
	defer obs.Close()
	conns, err := obs.Snapshot(ctx)
	if err != nil {
		return err
	}
	log.Info("observing", "cgroup", cfg.cgroup, "observer", obs.Kind(), "connections", len(conns))
	srv, err := ranks.Listen(cfg.rankSocket)
	if err != nil {
		return err
	}
	jobDir, err := cgroupv2.Resolve(cfg.cgroup)
	if err != nil {
		return err
	}
	srv.Admit = func(r *ranks.Rank) error { return inCgroup(r.Pid, jobDir) }
	srv.OnChange = func(r *ranks.Rank, gone bool, err error) {
		switch {
		case err != nil:
			log.Warn("rank refused", "error", err)
		case gone:
			log.Info("rank gone", "job", r.Job, "rank", r.Rank, "pid", r.Pid)
		default:
			log.Info("rank registered", "job", r.Job, "rank", r.Rank, "size", r.Size, "pid", r.Pid, "host", r.Host)
		}
	}
	srv.OnEvent = func(r *ranks.Rank, ev string) {
		// Acting on it is the pause protocol's work (next issue).
		log.Info("rank asks for "+ev, "job", r.Job, "rank", r.Rank, "pid", r.Pid)
	}
	served := make(chan error, 1)
	go func() { served <- srv.Serve(ctx) }()
	log.Info("serving ranks", "socket", cfg.rankSocket)
	if cfg.readyFile != "" {
		if err := writeReady(cfg.readyFile); err != nil {
			return err
		}
		defer os.Remove(cfg.readyFile)
	}
	select {
	case <-ctx.Done():
	case err := <-served:
		return fmt.Errorf("rank socket: %w", err)
	}
	log.Info("stopping", "unpin", cfg.unpin)
	if cfg.unpin {
		obs.Close()
		return loader.Unpin(lc)
	}
	return nil
}

// inCgroup checks that pid lives in the cgroup v2 directory dir or below,
// from /proc/PID/cgroup ("0::/path"), so only the job's processes register.
func inCgroup(pid int, dir string) error {
	b, err := os.ReadFile(fmt.Sprintf("/proc/%d/cgroup", pid))
	if err != nil {
		return fmt.Errorf("pid %d: %w", pid, err)
	}
	root, err := cgroupv2.Root()
	if err != nil {
		return err
	}
	for _, l := range strings.Split(string(b), "\n") {
		if p, ok := strings.CutPrefix(l, "0::"); ok {
			p = filepath.Join(root, p)
			if p == dir || strings.HasPrefix(p, dir+"/") {
				return nil
			}
			return fmt.Errorf("pid %d is in %s, not in the job's cgroup %s", pid, p, dir)
		}
	}
	return fmt.Errorf("pid %d: no cgroup v2 entry", pid)
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
