// Command genman writes the man pages mpipause(1) and mpid(8) from what the
// built binaries print for --help (and each subcommand's --help), so that
// the installed manual cannot drift from the commands (package manpage).
//
//	go run ./kernel-tests/tools/manpage/cmd/genman -o DIR [-date YYYY-MM-DD] [-version V] BINDIR
//
// The date in the pages' title lines is -date, else SOURCE_DATE_EPOCH; never
// the clock, so that two builds of one commit give the same pages.
package main

import (
	"context"
	"errors"
	"flag"
	"fmt"
	"io"
	"os"
	"os/exec"
	"path/filepath"
	"strconv"
	"strings"
	"time"

	"github.com/mpipause/mpipause/kernel-tests/tools/manpage"
)

// pages are the pages genman writes: the program (in BINDIR), its section,
// the NAME line, and the other pages to see.
var pages = []struct {
	prog, section, brief, manual string
	seeAlso                      []string
}{
	{"mpipause", "1", "pause and resume a running multi-node MPI job at a consistent point", "User Commands", []string{"mpid(8)"}},
	{"mpid", "8", "mpipause's node daemon", "System Administration", []string{"mpipause(1)"}},
}

const usageText = `usage: genman -o DIR [-date YYYY-MM-DD] [-version V] BINDIR

Runs BINDIR/mpipause and BINDIR/mpid with --help, and each of their
subcommands with --help, and writes DIR/mpipause.1 and DIR/mpid.8 from what
they print. The date is -date, else SOURCE_DATE_EPOCH (seconds), never the
clock.

options:
`

func main() {
	if err := run(os.Args[1:], os.Stdout, os.Getenv("SOURCE_DATE_EPOCH")); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			os.Exit(0)
		}
		fmt.Fprintf(os.Stderr, "genman: %v\n", err)
		os.Exit(2)
	}
}

func run(args []string, stdout io.Writer, epoch string) error {
	fs := flag.NewFlagSet("genman", flag.ContinueOnError)
	fs.SetOutput(io.Discard)
	out := fs.String("o", "", "write the pages to this `directory`")
	date := fs.String("date", "", "the pages' `date`, YYYY-MM-DD (default: from SOURCE_DATE_EPOCH)")
	version := fs.String("version", "", "the `version` the pages' title line names")
	fs.Usage = func() {}
	if err := fs.Parse(args); err != nil {
		if errors.Is(err, flag.ErrHelp) {
			fmt.Fprint(stdout, usageText)
			fs.SetOutput(stdout)
			fs.PrintDefaults()
			return err
		}
		return fmt.Errorf("%v; see genman --help", err)
	}
	if fs.NArg() != 1 || *out == "" {
		return fmt.Errorf("want -o DIR and one BINDIR; see genman --help")
	}
	d, err := pageDate(*date, epoch)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(*out, 0o755); err != nil {
		return err
	}
	for _, pg := range pages {
		p, err := build(fs.Arg(0), pg.prog)
		if err != nil {
			return err
		}
		p.Section, p.Brief, p.Manual, p.SeeAlso = pg.section, pg.brief, pg.manual, pg.seeAlso
		p.Date = d
		p.Source = strings.TrimSpace("mpipause " + *version)
		path := filepath.Join(*out, pg.prog+"."+pg.section)
		if err := os.WriteFile(path, []byte(p.Roff()), 0o644); err != nil {
			return err
		}
	}
	return nil
}

// pageDate is the date of the pages: flagged, or from SOURCE_DATE_EPOCH.
func pageDate(flagged, epoch string) (string, error) {
	if flagged != "" {
		if _, err := time.Parse(time.DateOnly, flagged); err != nil {
			return "", fmt.Errorf("-date %q: want YYYY-MM-DD", flagged)
		}
		return flagged, nil
	}
	if epoch == "" {
		return "", fmt.Errorf("no date: say -date YYYY-MM-DD or set SOURCE_DATE_EPOCH (the pages never take the clock's date, so that builds are reproducible)")
	}
	s, err := strconv.ParseInt(epoch, 10, 64)
	if err != nil {
		return "", fmt.Errorf("SOURCE_DATE_EPOCH %q: want seconds since 1970", epoch)
	}
	return time.Unix(s, 0).UTC().Format(time.DateOnly), nil
}

// build reads prog's help and its subcommands' helps into a page.
func build(bindir, prog string) (*manpage.Page, error) {
	bin := filepath.Join(bindir, prog)
	text, err := help(bin)
	if err != nil {
		return nil, err
	}
	main, err := manpage.Parse(text)
	if err != nil {
		return nil, fmt.Errorf("%s --help: %w", prog, err)
	}
	p := &manpage.Page{
		Name:      prog,
		Main:      main,
		Generator: fmt.Sprintf("Made by kernel-tests/tools/manpage/cmd/genman from '%s --help' and its subcommands' --help; do not edit.", prog),
	}
	for _, s := range manpage.Subcommands(prog, main) {
		text, err := help(bin, s.Name)
		if err != nil {
			return nil, err
		}
		if s.Help, err = manpage.Parse(text); err != nil {
			return nil, fmt.Errorf("%s %s --help: %w", prog, s.Name, err)
		}
		p.Subs = append(p.Subs, s)
	}
	return p, nil
}

// help runs bin [sub] --help, which must succeed and print to stdout.
func help(bin string, sub ...string) (string, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	args := append(sub, "--help")
	cmd := exec.CommandContext(ctx, bin, args...)
	var stderr strings.Builder
	cmd.Stderr = &stderr
	out, err := cmd.Output()
	name := strings.Join(append([]string{filepath.Base(bin)}, args...), " ")
	if err != nil {
		return "", fmt.Errorf("%s: %w: %s", name, err, strings.TrimSpace(stderr.String()))
	}
	if len(out) == 0 {
		return "", fmt.Errorf("%s printed nothing on stdout", name)
	}
	return string(out), nil
}
