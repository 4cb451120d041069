package main

import (
	"bytes"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
)

// buildCommands builds the real mpipause and mpid into a directory: the
// pages must say what these binaries print, whatever options they grow.
func buildCommands(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	cmd := exec.Command("go", "build", "-o", dir+"/", "./cmd/mpipause", "./cmd/mpid")
	// From the product module's directory: this one is the tools module,
	// which does not require the product's (go.work joins them, when present).
	cmd.Dir = filepath.Join("..", "..", "..", "..", "..")
	if out, err := cmd.CombinedOutput(); err != nil {
		t.Fatalf("go build: %v\n%s", err, out)
	}
	return dir
}

// plain undoes the page's roff escapes and fonts, closely enough to compare
// its words with the help's.
var fonts = regexp.MustCompile(`\\f[BIRP]`)

func plain(roff string) string {
	roff = fonts.ReplaceAllString(roff, "")
	return strings.NewReplacer(`\-`, "-", `\e`, `\`, `\&`, "", `\(dq`, `"`).Replace(roff)
}

var longFlag = regexp.MustCompile(`^-[a-z][a-z0-9-]+$`)

func TestPagesSayWhatTheHelpSays(t *testing.T) {
	bin := buildCommands(t)
	out := t.TempDir()
	if err := run([]string{"-o", out, "-version", "9.9", bin}, new(bytes.Buffer), "1767225600"); err != nil {
		t.Fatal(err)
	}
	for _, pg := range []struct {
		file  string
		helps [][]string
	}{
		{"mpipause.1", [][]string{{}, {"observe"}, {"run"}, {"pause"}, {"resume"}, {"status"}, {"list"}}},
		{"mpid.8", [][]string{{}, {"check"}, {"keygen"}}},
	} {
		b, err := os.ReadFile(filepath.Join(out, pg.file))
		if err != nil {
			t.Fatal(err)
		}
		page := string(b)
		if !strings.Contains(page, `"2026-01-01" "mpipause 9.9"`) {
			t.Errorf("%s: title line lacks the date from SOURCE_DATE_EPOCH and the version:\n%s", pg.file, strings.SplitN(page, "\n", 3)[1])
		}
		words := map[string]bool{}
		// Labels become headings ("exit status:", EXIT STATUS): compare
		// words without case, quotes (macro arguments) and a colon at their end.
		norm := func(w string) string { return strings.ToLower(strings.Trim(strings.TrimSuffix(w, ":"), `"`)) }
		for _, w := range strings.Fields(plain(page)) {
			words[norm(w)] = true
		}
		prog := strings.Split(pg.file, ".")[0]
		for _, sub := range pg.helps {
			text, err := help(filepath.Join(bin, prog), sub...)
			if err != nil {
				t.Fatal(err)
			}
			for _, w := range strings.Fields(text) {
				// Options print as --name in the page, -name in flag's list.
				if longFlag.MatchString(w) {
					w = "-" + w
				}
				if w == "usage:" {
					continue
				}
				if !words[norm(w)] {
					t.Errorf("%s: %q of '%s %s --help' is not in the page", pg.file, w, prog, strings.Join(sub, " "))
				}
			}
		}
	}
}

func TestPagesAreReproducible(t *testing.T) {
	bin := buildCommands(t)
	a, b := t.TempDir(), t.TempDir()
	if err := run([]string{"-o", a, bin}, new(bytes.Buffer), "1767225600"); err != nil {
		t.Fatal(err)
	}
	if err := run([]string{"-o", b, "-date", "2026-01-01", bin}, new(bytes.Buffer), ""); err != nil {
		t.Fatal(err)
	}
	for _, f := range []string{"mpipause.1", "mpid.8"} {
		x, err := os.ReadFile(filepath.Join(a, f))
		if err != nil {
			t.Fatal(err)
		}
		y, err := os.ReadFile(filepath.Join(b, f))
		if err != nil {
			t.Fatal(err)
		}
		if !bytes.Equal(x, y) {
			t.Errorf("%s differs between two runs with the same date", f)
		}
	}
}

func TestBadUsage(t *testing.T) {
	bin := t.TempDir()
	for _, tc := range []struct {
		name  string
		args  []string
		epoch string
		want  string
	}{
		{"no date anywhere", []string{"-o", t.TempDir(), bin}, "", "no date"},
		{"bad date", []string{"-o", t.TempDir(), "-date", "25.11.2026", bin}, "", "want YYYY-MM-DD"},
		{"bad epoch", []string{"-o", t.TempDir(), bin}, "yesterday", "SOURCE_DATE_EPOCH"},
		{"no output directory", []string{bin}, "1", "want -o DIR"},
		{"no binaries there", []string{"-o", t.TempDir(), bin}, "1", "mpipause --help"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			err := run(tc.args, new(bytes.Buffer), tc.epoch)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Errorf("run(%q) = %v, want an error with %q", tc.args, err, tc.want)
			}
		})
	}
}
