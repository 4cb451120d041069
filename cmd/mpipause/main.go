// Command mpipause pauses a running multi-node MPI job at a consistent point
// and resumes it, through the mpid of its node; it also launches jobs so
// that they can be paused (run) and shows the kernel's view of a job's TCP
// connections (observe).
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/signal"
	"sort"
	"strings"
	"syscall"

	"github.com/mpipause/mpipause/internal/ctl"
	"github.com/mpipause/mpipause/internal/term"
	"github.com/mpipause/mpipause/internal/version"
)

// env is everything a subcommand may touch of the outside world, so that the
// CLI can be run in-process by tests.
type env struct {
	stdout, stderr io.Writer
	// isTTY says stdout is a terminal: live views redraw in place only then.
	isTTY bool
}

type cmd struct {
	name    string
	summary string
	run     func(ctx context.Context, e *env, args []string) error
}

var commands = []cmd{
	{"observe", "show a job's TCP connections and their queues, read from the kernel", observe},
	{"run", "launch an MPI job (mpirun, mpiexec) so that it can be paused; Ctrl-Z pauses it", runCmd},
	{"pause", "pause a job on every node (also: mpipause JOBID)", pauseCmd},
	{"resume", "resume a paused job", resumeCmd},
	{"status", "show a job's state and its last pause or resume", statusCmd},
	{"list", "list the jobs on this node", listCmd},
	{"version", "print mpipause's version (also: mpipause --version)", versionCmd},
}

func versionCmd(ctx context.Context, e *env, args []string) error {
	fs := newFlags(e, "version", "")
	if err := parse(fs, args); err != nil {
		return err
	}
	if fs.NArg() != 0 {
		return usageError{fmt.Sprintf("unexpected argument %q; version takes none", fs.Arg(0))}
	}
	fmt.Fprintln(e.stdout, "mpipause", version.String())
	return nil
}

// usageError is a mistake in how the command was called: exit code 2.
type usageError struct{ msg string }

func (u usageError) Error() string { return u.msg }

func main() {
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	defer stop()
	st, _ := os.Stdout.Stat()
	e := &env{stdout: os.Stdout, stderr: os.Stderr, isTTY: st != nil && st.Mode()&os.ModeCharDevice != 0}
	os.Exit(run(ctx, e, os.Args[1:]))
}

// run executes one command line and returns the process exit code: 0
// success, 1 the operation failed, 2 bad usage, and the codes of exitCodes
// for what mpid refused.
func run(ctx context.Context, e *env, args []string) int {
	if len(args) == 0 {
		usage(e.stderr)
		return 2
	}
	switch args[0] {
	case "-h", "-help", "--help", "help":
		usage(e.stdout)
		return 0
	case "-version", "--version":
		return exit(e, "version", versionCmd(ctx, e, args[1:]))
	}
	for _, c := range commands {
		if c.name == args[0] {
			return exit(e, c.name, c.run(ctx, e, args[1:]))
		}
	}
	if strings.HasPrefix(args[0], "-") {
		fmt.Fprintf(e.stderr, "mpipause: unknown option %q; run 'mpipause --help'\n", args[0])
		return 2
	}
	// mpipause JOBID: the product's one-word pause.
	err := pauseCmd(ctx, e, args)
	var ce *ctl.Error
	if errors.As(err, &ce) && ce.Code == ctl.CodeUnknownJob {
		err = ctl.Errorf(ce.Code, "%s (and %q is not a command: see mpipause --help)", ce.Message, args[0])
	}
	return exit(e, "pause", err)
}

// exit reports err once and turns it into the exit code.
func exit(e *env, name string, err error) int {
	var ce *ctl.Error
	var quiet silent
	switch {
	case err == nil:
		return 0
	case errors.Is(err, flag.ErrHelp):
		return 0
	case errors.As(err, new(usageError)):
		fmt.Fprintf(e.stderr, "mpipause %s: %s\n", name, term.Safe(err.Error()))
		return 2
	case errors.Is(err, context.Canceled):
		return 130
	case errors.As(err, &quiet):
		return exitCodes[quiet.err.Code]
	case errors.As(err, &ce):
		// mpid's messages can quote what a rank or another node said.
		fmt.Fprintf(e.stderr, "mpipause %s: %s\n", name, term.Safe(ce.Message))
		if c, ok := exitCodes[ce.Code]; ok {
			return c
		}
		return 1
	case errors.As(err, new(exitStatus)):
		return int(err.(exitStatus))
	default:
		fmt.Fprintf(e.stderr, "mpipause %s: %s\n", name, term.Safe(err.Error()))
		return 1
	}
}

func usage(w io.Writer) {
	fmt.Fprintln(w, "usage: mpipause COMMAND [OPTIONS]")
	fmt.Fprintln(w)
	fmt.Fprintln(w, "commands:")
	names := make([]cmd, len(commands))
	copy(names, commands)
	sort.Slice(names, func(i, j int) bool { return names[i].name < names[j].name })
	for _, c := range names {
		fmt.Fprintf(w, "  %-10s %s\n", c.name, c.summary)
	}
	fmt.Fprintln(w)
	fmt.Fprintln(w, "Run 'mpipause COMMAND --help' for a command's options.")
	fmt.Fprintln(w)
	fmt.Fprint(w, exitCodeHelp)
}

// newFlags makes a flag set whose errors come back as usageError and whose
// -h prints to stdout and exits 0.
func newFlags(e *env, name, synopsis string) *flag.FlagSet {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	fs.Usage = func() {
		fmt.Fprintf(e.stdout, "usage: mpipause %s %s\n\noptions:\n", name, synopsis)
		fs.SetOutput(e.stdout)
		fs.PrintDefaults()
		fs.SetOutput(io.Discard)
	}
	return fs
}

// parse parses args, mapping flag errors to usageError.
func parse(fs *flag.FlagSet, args []string) error {
	// flag prints the usage on every error; a mistake gets one line, only
	// -h gets the whole usage.
	usage := fs.Usage
	fs.Usage = func() {}
	err := fs.Parse(args)
	fs.Usage = usage
	if err != nil {
		if errors.Is(err, flag.ErrHelp) {
			usage()
			return err
		}
		return usageError{strings.TrimSpace(err.Error()) + "; see --help"}
	}
	return nil
}

// parseMixed is parse for commands whose operands are job ids: options may
// come after them too ('mpipause pause JOB --timeout 1s'), as users of
// scontrol and kill expect. Only "--" ends the options.
func parseMixed(fs *flag.FlagSet, args []string) ([]string, error) {
	var operands []string
	for {
		if err := parse(fs, args); err != nil {
			return nil, err
		}
		rest := fs.Args()
		if len(rest) == 0 {
			return operands, nil
		}
		if n := len(args) - len(rest); n > 0 && args[n-1] == "--" {
			return append(operands, rest...), nil
		}
		operands, args = append(operands, rest[0]), rest[1:]
	}
}

// stringList is a repeatable string flag.
type stringList []string

func (s *stringList) String() string     { return strings.Join(*s, ",") }
func (s *stringList) Set(v string) error { *s = append(*s, v); return nil }
