// Command rig runs mpipause's local cluster: N network-namespace "nodes" on
// one machine (see package kernel-tests/internal/rig). kernel-tests/rig is its wrapper.
//
//	rig up [--no-mpid] N        bring up node0..node{N-1}, an mpid in each (idempotent)
//	rig exec NODE -- CMD...     run CMD in NODE (also from inside a node)
//	rig status [--json]         show the nodes
//	rig down                    remove everything (idempotent)
//	rig ssh [opts] HOST CMD...  launcher agent: ssh's arguments, rig exec
//
// MPIPAUSE_RIG (or --name) selects a rig other than "default".
package main

import (
	"context"
	"encoding/json"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"path/filepath"
	"strconv"
	"strings"
	"syscall"
	"text/tabwriter"

	"github.com/mpipause/mpipause/kernel-tests/internal/rig"
)

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err := run(ctx, os.Args[1:], os.Environ(), os.Stdout, os.Stderr)
	stop()
	if errors.Is(err, errUsage) {
		os.Exit(2)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "rig:", err)
		os.Exit(1)
	}
}

var errUsage = errors.New("usage")

// MPIDWrapEnv names the command up puts before each mpid's (rig.Config.MPIDWrap).
const MPIDWrapEnv = "MPIPAUSE_RIG_MPID_WRAP"

const usage = `usage: rig [--name NAME] COMMAND
  up [--no-mpid] N        bring up nodes node0..node{N-1} and start bin/mpid in
                          each, waiting until all are ready (idempotent; restarts
                          dead mpids); --no-mpid starts none
  exec NODE -- CMD...     run CMD in NODE with the MPI launchers set up
  status [--json]         show the rig's nodes
  down                    stop the mpids and remove everything the rig made (idempotent)
  ssh [opts] HOST CMD...  launcher agent: ssh's arguments, runs CMD in HOST
The rig is "default" unless --name or $MPIPAUSE_RIG names another.
up and down fail while another process holds the rig (a test binary using
it holds it until it exits; the processes it starts act for it).
$MPIPAUSE_RIG_MPID_WRAP, if set, is a command (words split at spaces) that up puts
before each mpid's, and that must exec mpid in place: setpriv --bounding-set=...
-- starts mpid with the capabilities of its systemd unit.
mpid logs: /run/mpipause-rig/NAME/mpid-nodeK.log (removed by down); node K's
/run/mpipause (its mpid's sockets and state) is /run/mpipause-rig/NAME/run/nodeK.
`

// env is the process environment, injectable for tests.
type env []string

func (e env) get(k string) string {
	for _, kv := range e {
		if strings.HasPrefix(kv, k+"=") {
			return kv[len(k)+1:]
		}
	}
	return ""
}

var commands = map[string]func(ctx context.Context, r *rig.Rig, args []string, e env, stdout io.Writer) error{
	"up":                runUp,
	"down":              runDown,
	"exec":              runExec,
	"status":            runStatus,
	"ssh":               runSSH,
	rig.InitNodeCommand: runInitNode,
}

func run(ctx context.Context, args []string, e env, stdout, stderr io.Writer) error {
	fs := flag.NewFlagSet("rig", flag.ContinueOnError)
	fs.SetOutput(stderr)
	fs.Usage = func() { fmt.Fprint(stderr, usage) }
	name := fs.String("name", e.get(rig.NameEnv), "rig name (default $"+rig.NameEnv+" or \"default\")")
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			return nil
		}
		return errUsage
	}
	if fs.NArg() == 0 {
		fs.Usage()
		return errUsage
	}
	cmd, ok := commands[fs.Arg(0)]
	if !ok {
		fmt.Fprintf(stderr, "rig: unknown command %q\n", fs.Arg(0))
		fs.Usage()
		return errUsage
	}
	exe, err := os.Executable()
	if err != nil {
		return err
	}
	r, err := rig.New(rig.Config{Name: *name, Exe: exe, BinDir: filepath.Dir(exe)})
	if err != nil {
		return err
	}
	return cmd(ctx, r, fs.Args()[1:], e, stdout)
}

func runUp(ctx context.Context, r *rig.Rig, args []string, e env, stdout io.Writer) error {
	// The flag may come before or after N.
	var pos []string
	noMPID := false
	for _, a := range args {
		switch a {
		case "--no-mpid", "-no-mpid":
			noMPID = true
		default:
			if strings.HasPrefix(a, "-") {
				return fmt.Errorf("up: unknown option %q: rig up [--no-mpid] N", a)
			}
			pos = append(pos, a)
		}
	}
	if len(pos) != 1 {
		return fmt.Errorf("up: want the number of nodes: rig up [--no-mpid] N")
	}
	n, err := strconv.Atoi(pos[0])
	if err != nil {
		return fmt.Errorf("up: %q is not a number of nodes", pos[0])
	}
	if err := r.CheckUser(); err != nil {
		return fmt.Errorf("up: %w", err)
	}
	if noMPID {
		cfg := r.Config()
		cfg.NoMPID = true
		if r, err = rig.New(cfg); err != nil {
			return err
		}
	}
	if w := strings.Fields(e.get(MPIDWrapEnv)); len(w) > 0 {
		cfg := r.Config()
		cfg.MPIDWrap = w
		if r, err = rig.New(cfg); err != nil {
			return err
		}
	}
	if err := r.Up(ctx, n); err != nil {
		if errors.Is(err, rig.ErrNoMPID) {
			return fmt.Errorf("up: %w", err) // nothing was made
		}
		return fmt.Errorf("up: %w (rig down removes what was made)", err)
	}
	daemons := ", an mpid ready in each"
	if noMPID {
		daemons = ", no mpid started"
	}
	fmt.Fprintf(stdout, "rig %s: %d nodes up (node0..node%d)%s\n", r.Name(), n, n-1, daemons)
	return nil
}

func runDown(ctx context.Context, r *rig.Rig, args []string, _ env, stdout io.Writer) error {
	if len(args) != 0 {
		return fmt.Errorf("down takes no arguments")
	}
	if err := r.CheckUser(); err != nil {
		return fmt.Errorf("down: %w", err)
	}
	if err := r.Down(ctx); err != nil {
		return fmt.Errorf("down: %w", err)
	}
	fmt.Fprintf(stdout, "rig %s: down\n", r.Name())
	return nil
}

func runExec(ctx context.Context, r *rig.Rig, args []string, e env, _ io.Writer) error {
	if len(args) < 3 || args[1] != "--" {
		return fmt.Errorf("exec: usage: rig exec NODE -- CMD [ARGS...]")
	}
	return execIn(r, args[0], args[2:], e)
}

// runSSH is the launcher agent: Open MPI's plm_rsh_agent and Hydra's
// launcher-exec call it as they would call ssh.
func runSSH(ctx context.Context, r *rig.Rig, args []string, e env, _ io.Writer) error {
	host, command, err := rig.ParseSSH(args)
	if err != nil {
		return err
	}
	return execIn(r, host, []string{"/bin/sh", "-c", command}, e)
}

func execIn(r *rig.Rig, node string, cmd []string, e env) error {
	if err := rig.EnterScope(e, node); err != nil {
		return fmt.Errorf("exec: %w", err)
	}
	cwd, err := os.Getwd()
	if err != nil {
		cwd = "/"
	}
	x, err := r.Command(node, cmd, e, cwd)
	if err != nil {
		return err
	}
	return fmt.Errorf("exec %s: %w", x.Path, syscall.Exec(x.Path, x.Argv, x.Env))
}

func runStatus(ctx context.Context, r *rig.Rig, args []string, _ env, stdout io.Writer) error {
	fs := flag.NewFlagSet("status", flag.ContinueOnError)
	asJSON := fs.Bool("json", false, "print JSON")
	if err := fs.Parse(args); err != nil {
		return errUsage
	}
	s, err := r.Status()
	if err != nil {
		return err
	}
	if *asJSON {
		enc := json.NewEncoder(stdout)
		enc.SetIndent("", "  ")
		return enc.Encode(s)
	}
	if len(s.Nodes) == 0 {
		fmt.Fprintf(stdout, "rig %s: not up\n", s.Name)
		return nil
	}
	state := "up"
	if !s.Up {
		state = "DEGRADED (rig up N again repairs it; or rig down, then up)"
	}
	fmt.Fprintf(stdout, "rig %s: %s, bridge in netns %s, state in %s\n", s.Name, state, s.Bridge, s.Dir)
	tw := tabwriter.NewWriter(stdout, 0, 4, 2, ' ', 0)
	fmt.Fprintln(tw, "NODE\tNETNS\tADDRESS\tNETNS OK\tETH0 UP\tPROCS\tMPID")
	for _, n := range s.Nodes {
		fmt.Fprintf(tw, "%s\t%s\t%s\t%v\t%v\t%d\t%s\n", n.Name, n.Netns, n.Addr, n.Exists, n.LinkUp, n.Procs, mpidState(n))
	}
	return tw.Flush()
}

// mpidState is the MPID column of status: pid and state, "-" for none.
func mpidState(n rig.NodeStatus) string {
	switch {
	case n.MPIDPid == 0:
		return "-"
	case n.MPIDReady:
		return fmt.Sprintf("%d ready", n.MPIDPid)
	case n.MPIDAlive:
		return fmt.Sprintf("%d alive, not ready", n.MPIDPid)
	default:
		return fmt.Sprintf("%d DEAD (rig up N restarts it)", n.MPIDPid)
	}
}

func runInitNode(ctx context.Context, r *rig.Rig, args []string, _ env, _ io.Writer) error {
	if len(args) != 1 {
		return fmt.Errorf("%s: want one JSON argument", rig.InitNodeCommand)
	}
	return rig.RunInitNode(args[0])
}
