// Package manpage turns a command's own --help text into a roff man page, so
// that the installed manual says what the binary says and cannot drift from
// it: `make install` runs the built binaries and renders what they print
// (kernel-tests/tools/manpage/cmd/genman).
//
// It reads the shape every help text of the project has: a "usage:" line
// (and indented continuation lines), then blocks separated by blank lines,
// each a paragraph (every line at column 0), a labelled block (a line
// "label:" at column 0 and indented lines under it, such as "options:" with
// the flag package's PrintDefaults, or "exit status:"), or indented text
// (kept as it is). Anything it does not recognise is kept preformatted, never
// dropped.
package manpage

import (
	"fmt"
	"regexp"
	"strings"
)

// Help is one --help text, split into what a man page needs.
type Help struct {
	// Usage holds the synopsis lines, without "usage: ".
	Usage []string
	// Blocks is the text after the usage, in order.
	Blocks []Block
}

// Block is one part of a help text: a paragraph (no Label, not Pre), indented
// text to keep as it is (Pre), or a labelled block (Label, such as
// "options", with the indented lines under it, indentation kept).
type Block struct {
	Label string
	Lines []string
	Pre   bool
}

// Parse splits a --help text. The text must start with a "usage:" line.
func Parse(text string) (Help, error) {
	var h Help
	lines := strings.Split(strings.ReplaceAll(text, "\r\n", "\n"), "\n")
	for len(lines) > 0 && strings.TrimSpace(lines[0]) == "" {
		lines = lines[1:]
	}
	if len(lines) == 0 || !strings.HasPrefix(lines[0], "usage: ") {
		return h, fmt.Errorf("help text does not start with a \"usage:\" line")
	}
	h.Usage = append(h.Usage, strings.TrimSpace(strings.TrimPrefix(lines[0], "usage: ")))
	lines = lines[1:]
	for len(lines) > 0 && indented(lines[0]) {
		h.Usage = append(h.Usage, strings.TrimSpace(lines[0]))
		lines = lines[1:]
	}
	for _, chunk := range chunks(lines) {
		h.Blocks = appendChunk(h.Blocks, chunk)
	}
	return h, nil
}

// chunks splits lines at blank lines, trailing spaces removed.
func chunks(lines []string) [][]string {
	var out [][]string
	var cur []string
	for _, l := range lines {
		l = strings.TrimRight(l, " \t")
		if l == "" {
			if cur != nil {
				out = append(out, cur)
				cur = nil
			}
			continue
		}
		cur = append(cur, l)
	}
	if cur != nil {
		out = append(out, cur)
	}
	return out
}

func appendChunk(blocks []Block, chunk []string) []Block {
	first := chunk[0]
	rest := chunk[1:]
	allIndented := func(ls []string) bool {
		for _, l := range ls {
			if !indented(l) {
				return false
			}
		}
		return true
	}
	var last *Block
	if len(blocks) > 0 {
		last = &blocks[len(blocks)-1]
	}
	switch {
	case isLabel(first) && allIndented(rest):
		return append(blocks, Block{Label: strings.TrimSuffix(first, ":"), Lines: rest})
	case allIndented(chunk) && last != nil && last.Label != "":
		// Indented text after a labelled block (a label alone on its line,
		// or a blank line inside the block) still belongs to it.
		if len(last.Lines) > 0 {
			last.Lines = append(last.Lines, "")
		}
		last.Lines = append(last.Lines, chunk...)
		return blocks
	}
	for _, l := range chunk {
		if indented(l) {
			return append(blocks, Block{Lines: chunk, Pre: true})
		}
	}
	return append(blocks, Block{Lines: chunk})
}

// isLabel says l names a block: "exit status:". A sentence that ends in a
// colon ("For example:") starts with a capital and stays a paragraph.
func isLabel(l string) bool {
	return strings.HasSuffix(l, ":") && l[0] >= 'a' && l[0] <= 'z'
}

func indented(l string) bool {
	return strings.HasPrefix(l, " ") || strings.HasPrefix(l, "\t")
}

// Flag is one option as the flag package's PrintDefaults prints it.
type Flag struct {
	// Name is without dashes; Arg is the argument's name ("" for a bool).
	Name, Arg string
	// Usage is the description, "(default ...)" included, one entry per line.
	Usage []string
}

// ParseFlags reads the lines of flag.PrintDefaults. It fails on a line of
// another shape, so that the caller keeps such a block as it is.
func ParseFlags(lines []string) ([]Flag, error) {
	var fs []Flag
	for _, l := range lines {
		switch {
		case strings.HasPrefix(l, "  -") && !strings.HasPrefix(l, "  --"):
			head, usage, short := strings.Cut(l[3:], "\t")
			f := Flag{}
			f.Name, f.Arg, _ = strings.Cut(strings.TrimSpace(head), " ")
			if !flagName.MatchString(f.Name) || strings.Contains(f.Arg, " ") {
				return nil, fmt.Errorf("not a flag line: %q", l)
			}
			if short {
				f.Usage = []string{usage}
			}
			fs = append(fs, f)
		case strings.HasPrefix(l, "    \t") && len(fs) > 0:
			f := &fs[len(fs)-1]
			f.Usage = append(f.Usage, l[len("    \t"):])
		default:
			return nil, fmt.Errorf("not a flag line: %q", l)
		}
	}
	if len(fs) == 0 {
		return nil, fmt.Errorf("no flags")
	}
	return fs, nil
}

var flagName = regexp.MustCompile(`^[A-Za-z0-9][A-Za-z0-9_.-]*$`)

// Sub is a subcommand that has its own --help.
type Sub struct {
	Name    string
	Summary string
	Help    Help
}

var subName = regexp.MustCompile(`^[a-z][a-z0-9-]*$`)

// Subcommands lists the subcommands a help text names: the first word of
// each line of its "commands" block (the rest is the summary), and a
// lowercase word after the program's name in a usage line ("mpid keygen
// [FILE]"), in that order, each once.
func Subcommands(prog string, h Help) []Sub {
	var subs []Sub
	seen := map[string]bool{}
	add := func(name, summary string) {
		if !seen[name] {
			seen[name] = true
			subs = append(subs, Sub{Name: name, Summary: summary})
		}
	}
	for _, b := range h.Blocks {
		if b.Label != "commands" {
			continue
		}
		for _, l := range b.Lines {
			f := strings.Fields(l)
			if len(f) > 0 && subName.MatchString(f[0]) {
				add(f[0], strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(l), f[0])))
			}
		}
	}
	for _, u := range h.Usage {
		f := strings.Fields(u)
		if len(f) > 1 && f[0] == prog && subName.MatchString(f[1]) {
			add(f[1], "")
		}
	}
	return subs
}
