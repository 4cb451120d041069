package main

import (
	"bufio"
	"errors"
	"flag"
	"fmt"
	"io"
	"io/fs"
	"os"
	"sort"
	"strconv"
	"strings"

	"github.com/mpipause/mpipause/internal/version"
)

// DefaultConfigFile is the settings file mpid reads when --config names no
// other (and only if it exists).
const DefaultConfigFile = "/etc/mpipause/mpid.conf"

// defaultConfig is DefaultConfigFile; tests point it elsewhere, so that a
// file installed on the test machine does not change what they parse.
var defaultConfig = DefaultConfigFile

// service is what mpid needs to run as a service rather than by hand: the
// settings file, the log format, readiness notification. Its options are
// the ones the file cannot hold.
type service struct {
	configFile   string
	printConfig  bool
	printVersion bool
	logFormat    string
	// origin says where each option the file set was set: "FILE:LINE".
	origin map[string]string
}

// notInFile are the options a settings file cannot set: they say which file
// to read, or what to do instead of running.
var notInFile = map[string]bool{"config": true, "print-config": true, "version": true, "help": true, "h": true, "json": true}

// addFlags adds the service options to set.
func (s *service) addFlags(set *flag.FlagSet) {
	set.StringVar(&s.configFile, "config", defaultConfig, "settings `file`: one \"name = value\" per line, name a long option of mpid (mpid --print-config shows them all); the command line wins over it; a missing "+DefaultConfigFile+" is no error")
	set.BoolVar(&s.printConfig, "print-config", false, "print a settings file listing every option at its default, commented out, and exit")
	set.BoolVar(&s.printVersion, "version", false, "print mpid's version and exit")
	set.StringVar(&s.logFormat, "log-format", "text", "`format` of the log lines on stderr: text (key=value) or json; when stderr is the journal, each line starts with its syslog priority <N> and has no time stamp (journald adds it)")
}

// apply reads the settings file into the options of set not given on the
// command line, or, with --print-config, prints the default file and
// returns flag.ErrHelp (mpid exits 0).
func (s *service) apply(set *flag.FlagSet, out io.Writer) error {
	if s.printVersion {
		fmt.Fprintln(out, "mpid", version.String())
		return flag.ErrHelp
	}
	if s.printConfig {
		printConfig(set, out)
		return flag.ErrHelp
	}
	given := map[string]bool{}
	set.Visit(func(f *flag.Flag) { given[f.Name] = true })
	f, err := os.Open(s.configFile)
	if errors.Is(err, fs.ErrNotExist) && !given["config"] {
		return s.checkLogFormat()
	}
	if err != nil {
		return fmt.Errorf("--config: %w", err)
	}
	defer f.Close()
	if s.origin, err = readConfig(set, f, s.configFile, given); err != nil {
		return err
	}
	return s.checkLogFormat()
}

func (s *service) checkLogFormat() error {
	if s.logFormat != "text" && s.logFormat != "json" {
		return fmt.Errorf("--log-format %q: want text or json", s.logFormat)
	}
	return nil
}

// readConfig sets, from r (the file name), every option of set that given
// does not hold, and returns where each was set.
func readConfig(set *flag.FlagSet, r io.Reader, name string, given map[string]bool) (map[string]string, error) {
	origin := map[string]string{}
	sc := bufio.NewScanner(r)
	for n := 1; sc.Scan(); n++ {
		where := fmt.Sprintf("%s:%d", name, n)
		line := strings.TrimSpace(sc.Text())
		if line == "" || strings.HasPrefix(line, "#") {
			continue
		}
		k, v, ok := strings.Cut(line, "=")
		k, v = strings.TrimSpace(k), strings.TrimSpace(v)
		if !ok || k == "" {
			return nil, fmt.Errorf("%s: %q is not `name = value`; see mpid --print-config", where, line)
		}
		k = strings.TrimLeft(k, "-")
		f := set.Lookup(k)
		if f == nil || notInFile[k] {
			return nil, fmt.Errorf("%s: unknown option %q; the names are mpid's long options (mpid --print-config lists them)", where, k)
		}
		if prev, ok := origin[k]; ok {
			return nil, fmt.Errorf("%s: %s set again (first at %s)", where, k, prev)
		}
		origin[k] = where
		if len(v) >= 2 && v[0] == '"' && v[len(v)-1] == '"' {
			u, err := strconv.Unquote(v)
			if err != nil {
				return nil, fmt.Errorf("%s: %s = %s: bad quoting: %v", where, k, v, err)
			}
			v = u
		}
		if given[k] {
			continue // the command line wins
		}
		if err := set.Set(k, v); err != nil {
			return nil, fmt.Errorf("%s: invalid value %q for %s: %v; see mpid --help", where, v, k, err)
		}
	}
	if err := sc.Err(); err != nil {
		return nil, fmt.Errorf("%s: %w", name, err)
	}
	return origin, nil
}

// blame puts "FILE:LINE: " before a check's complaint about an option
// ("--name ...") that the settings file set.
func (s *service) blame(err error) error {
	if err == nil || errors.Is(err, flag.ErrHelp) {
		return err
	}
	rest, ok := strings.CutPrefix(err.Error(), "--")
	if !ok {
		return err
	}
	name, _, _ := strings.Cut(rest, " ")
	if where, ok := s.origin[name]; ok {
		return fmt.Errorf("%s: %w", where, err)
	}
	return err
}

const configHeader = `# ` + DefaultConfigFile + `: settings of mpid, mpipause's node daemon.
#
# One "name = value" per line, name a long option of mpid without its
# dashes (mpid --help); a value may be "quoted". Lines starting with # are
# comments. An option given on mpid's command line wins over this file; a
# name mpid does not know, or a bad value, stops mpid with FILE:LINE.
#
# Every option is listed below, commented out, at its default, with what it
# does: uncomment a line to change it. (mpid --print-config writes this file.)
`

// printConfig writes the settings file with every option of set at its
// default, commented out.
func printConfig(set *flag.FlagSet, w io.Writer) {
	var flags []*flag.Flag
	set.VisitAll(func(f *flag.Flag) {
		if !notInFile[f.Name] {
			flags = append(flags, f)
		}
	})
	sort.Slice(flags, func(i, j int) bool { return flags[i].Name < flags[j].Name })
	fmt.Fprint(w, configHeader)
	for _, f := range flags {
		_, usage := flag.UnquoteUsage(f)
		fmt.Fprintln(w)
		for _, l := range wrap(f.Name+": "+usage, 76) {
			fmt.Fprintln(w, "# "+l)
		}
		v := f.DefValue
		if v == "" || strings.TrimSpace(v) != v || strings.HasPrefix(v, `"`) {
			v = strconv.Quote(v)
		}
		fmt.Fprintf(w, "#%s = %s\n", f.Name, v)
	}
}

// wrap breaks s into lines of at most width bytes, between words.
func wrap(s string, width int) []string {
	var lines []string
	line := ""
	for _, word := range strings.Fields(s) {
		if line != "" && len(line)+1+len(word) > width {
			lines = append(lines, line)
			line = ""
		}
		if line != "" {
			line += " "
		}
		line += word
	}
	return append(lines, line)
}
