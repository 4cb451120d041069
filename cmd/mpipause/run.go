package main

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"slices"
	"strings"
	"syscall"
	"time"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/term"
)

// exitStatus is the launcher's own exit status, passed on unchanged.
type exitStatus int

func (s exitStatus) Error() string { return fmt.Sprintf("exit status %d", int(s)) }

const runSynopsis = `[--jobid ID] [--launcher openmpi|hydra] [--shim PATH] -- LAUNCHER ARGS...

Launches an MPI job so that it can be paused cleanly: the launcher (Open MPI's
mpirun, MPICH's Hydra mpiexec) is given the shim (libmpipause.so) and the job
id for every rank, and each rank joins its job's cgroup on its node before it
opens a socket. Prints "job ID" first, then runs the launcher to its end and
exits with its status.

Ctrl-Z pauses the whole job consistently (as 'mpipause ID' does) and then
stops this command, so the shell shows the job stopped; 'fg' resumes the job.
Ctrl-C resumes a paused job and then passes the interrupt to the launcher.
On a terminal the launcher gets no terminal input (it runs in its own process
group, so that Ctrl-Z reaches mpipause and not the launcher).

Needs mpid running on this node and on every node of the job.`

func runCmd(ctx context.Context, e *env, args []string) error {
	var id, kind, shim string
	fs := newFlags(e, "run", runSynopsis)
	fs.StringVar(&id, "jobid", "", "the job's `id` (default: a random one); what 'mpipause ID' takes")
	fs.StringVar(&kind, "launcher", "", "the launcher's `kind`, openmpi or hydra (default: asked of the launcher)")
	fs.StringVar(&shim, "shim", "", "the shim `library` (default: libmpipause.so next to mpipause, or ../lib/mpipause/)")
	if err := parse(fs, args); err != nil {
		return err
	}
	argv := fs.Args()
	if len(argv) == 0 {
		return usageError{"want a launcher command, e.g. mpipause run -- mpirun -np 4 ./app; see --help"}
	}
	if id == "" {
		id = newJobID()
	}
	if err := ctl.ValidJobID(id); err != nil {
		return usageError{err.Error()}
	}
	switch kind {
	case "", "openmpi", "hydra":
	default:
		return usageError{fmt.Sprintf("--launcher %q: want openmpi or hydra", kind)}
	}
	shim, err := findShim(shim)
	if err != nil {
		return err
	}
	path, err := exec.LookPath(argv[0])
	if err != nil {
		return fmt.Errorf("launcher %s: %w", argv[0], err)
	}
	if kind == "" {
		if kind, err = detectLauncher(ctx, path); err != nil {
			return err
		}
	}
	// The job is made before it starts (mpid answers with its job key,
	// which only its ranks get): a job launched without mpid would run,
	// but could not be paused: say so now, not at the first Ctrl-Z.
	pctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	rep, err := ctl.Do(pctx, ctl.Addr(), ctl.Request{Op: ctl.OpCreate, Job: id}, nil)
	cancel()
	if err != nil {
		return err
	}
	if rep.Token == "" {
		return ctl.Errorf(ctl.CodeUnavailable, "mpid at %s made job %s but sent no job key: is it of another release?", ctl.Addr(), id)
	}
	argv, environ := inject(kind, argv, os.Environ(), id, rep.Token, preload(os.Getenv("LD_PRELOAD"), shim))
	fmt.Fprintf(e.stdout, "job %s\n", term.Safe(id))
	return launch(ctx, e, id, argv, environ)
}

func newJobID() string {
	b := make([]byte, 4)
	rand.Read(b)
	return hex.EncodeToString(b)
}

func findShim(flagged string) (string, error) {
	cands := []string{flagged}
	if flagged == "" {
		exe, err := os.Executable()
		if err != nil {
			return "", err
		}
		dir := filepath.Dir(exe)
		cands = []string{filepath.Join(dir, "libmpipause.so"), filepath.Join(dir, "..", "lib", "mpipause", "libmpipause.so")}
	}
	for _, c := range cands {
		if fi, err := os.Stat(c); err == nil && fi.Mode().IsRegular() {
			return filepath.Abs(c)
		}
	}
	return "", usageError{fmt.Sprintf("no shim library at %s: build it (make build) or say --shim PATH", strings.Join(cands, " or "))}
}

// detectLauncher tells Open MPI's mpirun from Hydra's mpiexec, by name when
// the name says it, else by what the launcher says of itself.
func detectLauncher(ctx context.Context, path string) (string, error) {
	base := filepath.Base(path)
	switch {
	case strings.Contains(base, "openmpi"), base == "orterun":
		return "openmpi", nil
	case strings.Contains(base, "mpich"), strings.Contains(base, "hydra"):
		return "hydra", nil
	}
	ctx, cancel := context.WithTimeout(ctx, 10*time.Second)
	defer cancel()
	out, _ := exec.CommandContext(ctx, path, "--version").CombinedOutput()
	switch s := string(out); {
	case strings.Contains(s, "Open MPI"), strings.Contains(s, "OpenRTE"):
		return "openmpi", nil
	case strings.Contains(s, "HYDRA"), strings.Contains(s, "MPICH"):
		return "hydra", nil
	}
	return "", usageError{fmt.Sprintf("cannot tell which MPI launcher %s is (neither Open MPI nor Hydra by its --version); say --launcher openmpi or --launcher hydra", path)}
}

// preload appends the shim to the caller's LD_PRELOAD list.
func preload(have, shim string) string {
	list := strings.FieldsFunc(have, func(r rune) bool { return r == ':' || r == ' ' })
	if !slices.Contains(list, shim) {
		list = append(list, shim)
	}
	return strings.Join(list, ":")
}

// inject gives every rank the shim and the job id through the launcher's own
// option for it, so that ranks on other nodes get them too and the launcher
// itself runs without the shim. It returns the launcher's command line and
// its environment: the caller's (environ) with the job's id and key.
// The job key is a secret: it goes to the launcher in its environment and
// is passed on by name, never on a command line, which every user of the
// node can read in /proc.
//
// The key is the first variable of that environment, not the last, where
// appending would put it. Hydra (MPICH 4.0.2, Debian 12's, and upstream's
// hydra as of this writing) finds a -genvlist name in mpiexec's environment
// with a loop that never looks at the environment's last variable
// (HYDU_env_lookup: `while (run->next)`), and it is that copy of the
// environment, sent over its control connection, that a proxy started by
// ssh on another node has: a key in the last place reached the ranks of
// mpiexec's own node (whose proxy inherits mpiexec's environment) and none
// elsewhere. The job id, passed with -genv, goes last.
func inject(kind string, argv, environ []string, id, token, preload string) ([]string, []string) {
	out := []string{argv[0]}
	switch kind {
	case "openmpi":
		out = append(out, "-x", "MPIPAUSE_JOBID="+id, "-x", "LD_PRELOAD="+preload, "-x", ctl.TokenEnv)
	case "hydra":
		out = append(out, "-genv", "MPIPAUSE_JOBID", id, "-genv", "LD_PRELOAD", preload, "-genvlist", ctl.TokenEnv)
	}
	env := []string{ctl.TokenEnv + "=" + token}
	for _, kv := range environ {
		if name, _, _ := strings.Cut(kv, "="); name != ctl.TokenEnv && name != "MPIPAUSE_JOBID" {
			env = append(env, kv)
		}
	}
	env = append(env, "MPIPAUSE_JOBID="+id)
	return append(out, argv[1:]...), env
}

// launch runs the launcher and handles the terminal's job-control signals
// for the whole job.
func launch(ctx context.Context, e *env, id string, argv, environ []string) error {
	cmd := exec.Command(argv[0], argv[1:]...)
	cmd.Stdout, cmd.Stderr = e.stdout, e.stderr
	cmd.Env = environ
	tty := isTerminal(os.Stdin)
	if tty {
		// Ctrl-Z and Ctrl-C go to the terminal's foreground process group:
		// the launcher must not be in it, or Open MPI would SIGSTOP the
		// ranks (which no shim can catch) before we pause them cleanly.
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	} else {
		cmd.Stdin = os.Stdin
	}
	sigs := make(chan os.Signal, 4)
	signal.Notify(sigs, syscall.SIGTSTP, syscall.SIGCONT, syscall.SIGINT, syscall.SIGTERM, syscall.SIGHUP)
	defer signal.Stop(sigs)
	if err := cmd.Start(); err != nil {
		return fmt.Errorf("start %s: %w", argv[0], err)
	}
	done := make(chan error, 1)
	go func() { done <- cmd.Wait() }()
	forward := func(s syscall.Signal) {
		if tty {
			syscall.Kill(-cmd.Process.Pid, s)
		} else {
			cmd.Process.Signal(s)
		}
	}
	paused := false
	say := func(format string, args ...any) {
		fmt.Fprintf(e.stderr, "mpipause: %s\n", term.Safe(fmt.Sprintf(format, args...)))
	}
	do := func(op string) (*ctl.Reply, error) {
		// Not ctx: Ctrl-C cancels it, and a resume on the way out must run.
		c, cancel := context.WithTimeout(context.Background(), time.Minute)
		defer cancel()
		return ctl.Do(c, ctl.Addr(), ctl.Request{Op: op, Job: id}, nil)
	}
	for {
		select {
		case err := <-done:
			var ee *exec.ExitError
			if errors.As(err, &ee) {
				if ws, ok := ee.Sys().(syscall.WaitStatus); ok && ws.Signaled() {
					return exitStatus(128 + int(ws.Signal()))
				}
				return exitStatus(ee.ExitCode())
			}
			return err
		case s := <-sigs:
			switch s {
			case syscall.SIGTSTP:
				if paused {
					continue
				}
				say("pausing job %s", id)
				rep, err := do(ctl.OpPause)
				if err != nil {
					say("%v", err)
					continue
				}
				paused = true
				say("job %s paused in %s: %d connections empty after the freeze (kernel-verified); 'fg' resumes it",
					id, msStr(rep.Job.TotalMs), rep.Job.Connections)
				syscall.Kill(os.Getpid(), syscall.SIGSTOP)
			case syscall.SIGCONT:
				if !paused {
					continue
				}
				rep, err := do(ctl.OpResume)
				if err != nil {
					say("%v", err)
					continue
				}
				paused = false
				say("job %s resumed in %s", id, msStr(rep.Job.TotalMs))
			default:
				if paused {
					if _, err := do(ctl.OpResume); err == nil {
						paused = false
					}
				}
				forward(s.(syscall.Signal))
			}
		}
	}
}

func isTerminal(f *os.File) bool {
	fi, err := f.Stat()
	return err == nil && fi.Mode()&os.ModeCharDevice != 0
}
