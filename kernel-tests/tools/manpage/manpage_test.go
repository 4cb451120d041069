package manpage

import (
	"bytes"
	"flag"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
)

func TestParse(t *testing.T) {
	for _, tc := range []struct {
		name string
		text string
		want Help
	}{
		{
			name: "usage continued, paragraphs, labelled blocks",
			text: "usage: prog [options]\n       prog keygen [FILE]\n\nFirst paragraph,\ntwo lines.\n\nenvironment:\n  X  the x\n\noptions:\n  -a\tall\n",
			want: Help{
				Usage: []string{"prog [options]", "prog keygen [FILE]"},
				Blocks: []Block{
					{Lines: []string{"First paragraph,", "two lines."}},
					{Label: "environment", Lines: []string{"  X  the x"}},
					{Label: "options", Lines: []string{"  -a\tall"}},
				},
			},
		},
		{
			name: "a label alone, its lines after a blank line",
			text: "usage: prog\n\nexit status:\n\n  0  done\n  1  failed\n\n\noptions:\n  -json\n    \tprint JSON\n",
			want: Help{
				Usage: []string{"prog"},
				Blocks: []Block{
					{Label: "exit status", Lines: []string{"  0  done", "  1  failed"}},
					{Label: "options", Lines: []string{"  -json", "    \tprint JSON"}},
				},
			},
		},
		{
			name: "a sentence ending in a colon and indented text stay what they are",
			text: "usage: prog\n\nFor example:\n\n  prog -x 1\n\nEnd.\n",
			want: Help{
				Usage: []string{"prog"},
				Blocks: []Block{
					{Lines: []string{"For example:"}},
					{Lines: []string{"  prog -x 1"}, Pre: true},
					{Lines: []string{"End."}},
				},
			},
		},
		{
			name: "a paragraph with an indented line is kept as it is",
			text: "usage: prog\n\nrun it as\n    prog go\nthen wait\n",
			want: Help{
				Usage:  []string{"prog"},
				Blocks: []Block{{Lines: []string{"run it as", "    prog go", "then wait"}, Pre: true}},
			},
		},
	} {
		t.Run(tc.name, func(t *testing.T) {
			got, err := Parse(tc.text)
			if err != nil {
				t.Fatal(err)
			}
			if d := cmp.Diff(tc.want, got); d != "" {
				t.Errorf("Parse (-want +got):\n%s", d)
			}
		})
	}
}

func TestParseNoUsage(t *testing.T) {
	if _, err := Parse("prog does things\n"); err == nil {
		t.Fatal("Parse accepted a help text without a usage line")
	}
}

// printDefaults is what the flag package prints for a flag set like the
// commands'.
func printDefaults() []string {
	fs := flag.NewFlagSet("x", flag.ContinueOnError)
	fs.Bool("json", false, "print JSON")
	fs.Bool("v", false, "verbose")
	fs.String("cgroup", "/", "job cgroup `path`")
	fs.Duration("drain-timeout", 0, "the drain `timeout`\nsecond line")
	fs.Int("n", 3, "`count` of things")
	var b bytes.Buffer
	fs.SetOutput(&b)
	fs.PrintDefaults()
	return strings.Split(strings.TrimRight(b.String(), "\n"), "\n")
}

func TestParseFlags(t *testing.T) {
	got, err := ParseFlags(printDefaults())
	if err != nil {
		t.Fatal(err)
	}
	want := []Flag{
		{Name: "cgroup", Arg: "path", Usage: []string{`job cgroup path (default "/")`}},
		{Name: "drain-timeout", Arg: "timeout", Usage: []string{"the drain timeout", "second line"}},
		{Name: "json", Usage: []string{"print JSON"}},
		{Name: "n", Arg: "count", Usage: []string{"count of things (default 3)"}},
		{Name: "v", Usage: []string{"verbose"}},
	}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("ParseFlags (-want +got):\n%s", d)
	}
	for _, bad := range [][]string{
		nil,
		{"  SEND-Q  bytes written"},
		{"    \tusage before any flag"},
		{"  --long  not the flag package's"},
	} {
		if fs, err := ParseFlags(bad); err == nil {
			t.Errorf("ParseFlags(%q) = %v, want an error", bad, fs)
		}
	}
}

func TestSubcommands(t *testing.T) {
	h := Help{
		Usage: []string{"prog COMMAND [OPTIONS]", "prog keygen [FILE]", "prog [options]"},
		Blocks: []Block{{Label: "commands", Lines: []string{
			"  list       list the jobs",
			"  keygen     make a key",
		}}},
	}
	got := Subcommands("prog", h)
	want := []Sub{{Name: "list", Summary: "list the jobs"}, {Name: "keygen", Summary: "make a key"}}
	if d := cmp.Diff(want, got); d != "" {
		t.Errorf("Subcommands (-want +got):\n%s", d)
	}
}

func testPage(t *testing.T) *Page {
	t.Helper()
	main, err := Parse("usage: prog COMMAND\n\ncommands:\n  go   start it\n\n" +
		"'prog ID' is short for prog go ID.\n.dot at the start, a \\back\\slash, multi-node, --flag and /run/a-b.\n\n" +
		"exit status:\n  0  done\n  1  failed\n\noptions:\n" + strings.Join(printDefaults(), "\n") + "\n")
	if err != nil {
		t.Fatal(err)
	}
	sub, err := Parse("usage: prog go [--json] ID\n\nStarts it.\n\nexit status:\n  0  done\n  1  failed\n\ncolumns:\n  A-B  the a\n\noptions:\n  -json\n    \tprint JSON\n")
	if err != nil {
		t.Fatal(err)
	}
	return &Page{
		Name: "prog", Section: "1", Brief: "do things", Date: "2026-01-02", Source: "prog 1.0", Manual: "User Commands",
		Main: main, Subs: []Sub{{Name: "go", Summary: "start it", Help: sub}}, SeeAlso: []string{"progd(8)", "other(1)"},
	}
}

func TestRoff(t *testing.T) {
	got := testPage(t).Roff()
	for _, want := range []string{
		".TH \"PROG\" 1 \"2026-01-02\" \"prog 1.0\" \"User Commands\"\n.nh\n.ad l\n.SH NAME\nprog \\- do things\n",
		".SH SYNOPSIS\n\\fBprog\\fR \\fICOMMAND\\fR\n.br\n\\fBprog\\fR \\fBgo\\fR [\\fB\\-\\-json\\fR] \\fIID\\fR\n",
		// A line that starts with ' or . would be a request.
		"\n\\&'prog ID' is short for prog go ID.\n\\&.dot at the start, a \\eback\\eslash, multi-node, \\-\\-flag and /run/a\\-b.\n",
		".SH OPTIONS\n.TP\n\\fB\\-\\-cgroup\\fR \\fIpath\\fR\njob cgroup path (default \"/\")\n",
		".TP\n\\fB\\-v\\fR\nverbose\n",
		".SS \"prog go\"\n\\fBprog\\fR \\fBgo\\fR [\\fB\\-\\-json\\fR] \\fIID\\fR\n.PP\nStarts it.\n",
		".PP\n\\fBColumns:\\fR\n.RS 4\n.nf\nA\\-B  the a\n.fi\n.RE\n",
		".PP\n\\fBOptions:\\fR\n.TP\n\\fB\\-\\-json\\fR\nprint JSON\n",
		".SH \"EXIT STATUS\"\n.RS 4\n.nf\n0  done\n1  failed\n.fi\n.RE\n",
		".SH SEE ALSO\n.BR progd (8),\n.BR other (1)\n",
	} {
		if !strings.Contains(got, want) {
			t.Errorf("page lacks\n%s\n--- page:\n%s", want, got)
		}
	}
	// The subcommand's exit status is the main one: the page says it once.
	if n := strings.Count(got, "0  done"); n != 1 {
		t.Errorf("exit status appears %d times, want once:\n%s", n, got)
	}
	if strings.Contains(got, ".SH DESCRIPTION\n.PP") || strings.Contains(got, ".SS \"prog go\"\n.PP") {
		t.Errorf("a paragraph macro right after a heading:\n%s", got)
	}
	if again := testPage(t).Roff(); again != got {
		t.Error("two renderings of one page differ")
	}
}

func TestTextWraps(t *testing.T) {
	for _, tc := range []struct {
		name, in string
	}{
		{"words", strings.Repeat("word ", 40) + "end"},
		{"an abbreviation where the line would break", strings.Repeat("x", 75) + " e.g. " + strings.Repeat("word ", 20)},
		{"a period at a line's start", strings.Repeat("y", 79) + " .dot"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			var lines []string
			text(func(format string, args ...any) { lines = append(lines, args[0].(string)) }, tc.in)
			for i, l := range lines {
				if strings.HasPrefix(l, ".") || strings.HasPrefix(l, "'") {
					t.Errorf("line starts with a control character: %q", l)
				}
				if i < len(lines)-1 && strings.HasSuffix(l, ".") {
					t.Errorf("line ends after an abbreviation (roff takes it for a sentence end): %q", l)
				}
				if len(l) > 80 && !strings.Contains(l, "e.g. ") {
					t.Errorf("input line of %d bytes: %q", len(l), l)
				}
			}
			got := strings.ReplaceAll(strings.Join(lines, " "), `\&`, "")
			if want := strings.Join(strings.Fields(tc.in), " "); got != want {
				t.Errorf("wrapping changed the text:\n got %q\nwant %q", got, want)
			}
		})
	}
}
