package manpage

import (
	"fmt"
	"slices"
	"strings"
	"unicode"
)

// Page is one man page: a program's help and its subcommands' helps.
type Page struct {
	// Name is the program's name; Section the manual section ("1", "8").
	Name, Section string
	// Brief is the NAME line's description.
	Brief string
	// Date (YYYY-MM-DD), Source ("mpipause 0.1.0") and Manual go in the
	// title line. The date is given, never read from the clock, so that a
	// build is reproducible.
	Date, Source, Manual string
	Main                 Help
	Subs                 []Sub
	// SeeAlso names other pages, as "mpid(8)".
	SeeAlso []string
	// Generator says what made the page, in a comment at its top.
	Generator string
}

// Roff renders the page in the man(7) macro language.
func (p *Page) Roff() string {
	var w writer
	line := w.line
	if p.Generator != "" {
		line(`.\" %s`, p.Generator)
	}
	line(".TH %s %s %s %s %s", quote(strings.ToUpper(p.Name)), p.Section, quote(p.Date), quote(p.Source), quote(p.Manual))
	// No hyphenation, ragged right: option names and paths must not be
	// split or stretched.
	line(".nh")
	line(".ad l")
	line(".SH NAME")
	line(`%s \- %s`, esc(p.Name), esc(p.Brief))

	line(".SH SYNOPSIS")
	var subs []string
	for _, s := range p.Subs {
		subs = append(subs, s.Name)
	}
	var usages []string
	for _, u := range p.Main.Usage {
		usages = appendNew(usages, u)
	}
	for _, s := range p.Subs {
		for _, u := range s.Help.Usage {
			usages = appendNew(usages, u)
		}
	}
	for i, u := range usages {
		if i > 0 {
			line(".br")
		}
		line("%s", synopsis(u, p.Name, subs))
	}

	// Labelled blocks of the main help get their own sections, the options
	// first and the rest after the commands, in the help's order.
	var options *Block
	var sections []Block
	var desc []Block
	for i, b := range p.Main.Blocks {
		switch {
		case b.Label == "options" && options == nil:
			options = &p.Main.Blocks[i]
		case b.Label == "commands":
			desc = append(desc, b)
		case b.Label != "":
			sections = append(sections, b)
		default:
			desc = append(desc, b)
		}
	}
	if len(desc) > 0 {
		line(".SH DESCRIPTION")
		for _, b := range desc {
			if b.Label == "commands" {
				commandList(line, b)
				continue
			}
			block(line, b)
		}
	}
	if options != nil {
		line(".SH OPTIONS")
		optionList(line, *options)
	}
	if len(p.Subs) > 0 {
		line(".SH COMMANDS")
		for _, s := range p.Subs {
			line(".SS %s", quote(p.Name+" "+s.Name))
			for i, u := range s.Help.Usage {
				if i == 0 {
					line(".PP")
				} else {
					line(".br")
				}
				line("%s", synopsis(u, p.Name, subs))
			}
			for _, b := range s.Help.Blocks {
				if b.Label == "" {
					block(line, b)
					continue
				}
				if slices.ContainsFunc(p.Main.Blocks, func(m Block) bool { return sameBlock(m, b) }) {
					// The main help said it already ("exit status"): once
					// in the page is enough.
					continue
				}
				line(".PP")
				line(`\fB%s:\fR`, esc(capitalize(b.Label)))
				if b.Label == "options" {
					optionList(line, b)
				} else {
					pre(line, b.Lines)
				}
			}
		}
	}
	for _, b := range sections {
		line(".SH %s", quote(strings.ToUpper(b.Label)))
		pre(line, b.Lines)
	}
	if len(p.SeeAlso) > 0 {
		line(".SH SEE ALSO")
		for i, ref := range p.SeeAlso {
			name, sec, _ := strings.Cut(strings.TrimSuffix(ref, ")"), "(")
			sep := ","
			if i == len(p.SeeAlso)-1 {
				sep = ""
			}
			line(".BR %s (%s)%s", esc(name), esc(sec), sep)
		}
	}
	return w.b.String()
}

// writer collects the page's lines. It drops a paragraph macro right after
// a heading, where it would do nothing (mandoc -Tlint warns about it).
type writer struct {
	b       strings.Builder
	heading bool
}

func (w *writer) line(format string, args ...any) {
	l := fmt.Sprintf(format, args...)
	if l == ".PP" && w.heading {
		return
	}
	w.heading = strings.HasPrefix(l, ".SH ") || strings.HasPrefix(l, ".SS ") || l == ".SH"
	w.b.WriteString(l)
	w.b.WriteByte('\n')
}

func appendNew(list []string, s string) []string {
	if slices.Contains(list, s) {
		return list
	}
	return append(list, s)
}

func sameBlock(a, b Block) bool {
	return a.Label == b.Label && a.Pre == b.Pre && slices.Equal(a.Lines, b.Lines)
}

// block renders a paragraph (filled) or indented text (kept as it is).
func block(line func(string, ...any), b Block) {
	if b.Pre {
		pre(line, b.Lines)
		return
	}
	line(".PP")
	for _, l := range b.Lines {
		text(line, l)
	}
}

// pre renders lines as they are, indented, their common indentation removed.
func pre(line func(string, ...any), lines []string) {
	lines = dedent(lines)
	line(".RS 4")
	line(".nf")
	for _, l := range lines {
		if l == "" {
			// A blank line in no-fill mode is a blank output line, but
			// groff -ww warns about it; .sp says the same.
			line(".sp")
			continue
		}
		line("%s", startSafe(escCode(l)))
	}
	line(".fi")
	line(".RE")
}

// optionList renders a flag.PrintDefaults block as a tagged list, or as it
// is when it has another shape.
func optionList(line func(string, ...any), b Block) {
	flags, err := ParseFlags(b.Lines)
	if err != nil {
		pre(line, b.Lines)
		return
	}
	for _, f := range flags {
		line(".TP")
		dash := "--"
		if len(f.Name) == 1 {
			dash = "-"
		}
		tag := `\fB` + escCode(dash+f.Name) + `\fR`
		if f.Arg != "" {
			tag += ` \fI` + escCode(f.Arg) + `\fR`
		}
		line("%s", tag)
		for _, u := range f.Usage {
			text(line, u)
		}
	}
}

// commandList renders a "commands" block (name, then summary) as a tagged list.
func commandList(line func(string, ...any), b Block) {
	for _, l := range b.Lines {
		f := strings.Fields(l)
		if len(f) == 0 {
			continue
		}
		line(".TP")
		line(`\fB%s\fR`, escCode(f[0]))
		if rest := strings.TrimSpace(strings.TrimPrefix(strings.TrimSpace(l), f[0])); rest != "" {
			text(line, rest)
		}
	}
}

// synopsis renders a usage line: the program, its subcommand (one of subs)
// and options in bold, upper-case placeholders in italics.
func synopsis(u, prog string, subs []string) string {
	var w strings.Builder
	word := 0
	for u != "" {
		n := strings.IndexFunc(u, func(r rune) bool { return !isWordRune(r) })
		if n == 0 {
			// A non-word rune: brackets, '|', '=', '.', space.
			r := []rune(u)[0]
			w.WriteString(escCode(string(r)))
			u = u[len(string(r)):]
			continue
		}
		if n < 0 {
			n = len(u)
		}
		tok := u[:n]
		u = u[n:]
		word++
		switch {
		case strings.HasPrefix(tok, "-"), word == 1 && tok == prog, word == 2 && slices.Contains(subs, tok):
			w.WriteString(`\fB` + escCode(tok) + `\fR`)
		case isPlaceholder(tok):
			w.WriteString(`\fI` + escCode(tok) + `\fR`)
		default:
			w.WriteString(escCode(tok))
		}
	}
	return startSafe(w.String())
}

func isWordRune(r rune) bool {
	return r == '-' || r == '_' || unicode.IsLetter(r) || unicode.IsDigit(r)
}

func isPlaceholder(tok string) bool {
	letter := false
	for _, r := range tok {
		switch {
		case unicode.IsUpper(r):
			letter = true
		case unicode.IsDigit(r), r == '_':
		default:
			return false
		}
	}
	return letter
}

// text writes one line of running text, escaped, as input lines of at most
// maxLine bytes where its words allow (the output is filled anyway; mandoc
// -Tlint asks for short input lines). A line never ends after a word that
// ends in a period unless the text did: roff would take it for the end of
// a sentence ("e.g.").
func text(line func(string, ...any), l string) {
	const maxLine = 80
	words := strings.Fields(l)
	var cur string
	for i, word := range words {
		ew := escText(word)
		last := i == len(words)-1
		switch {
		case cur == "":
			cur = ew
		case len(cur)+1+len(ew) > maxLine && !strings.HasSuffix(cur, "."):
			line("%s", startSafe(cur))
			cur = ew
		default:
			cur += " " + ew
		}
		if last {
			line("%s", startSafe(cur))
		}
	}
}

// escText escapes running text: backslashes, and the dashes of words that
// are typed, not read (options such as "--timeout", paths, socket names),
// which must print as ASCII minus signs to be typed or pasted back, and
// never break a line; the hyphens of ordinary words ("multi-node") stay
// hyphens.
func escText(s string) string {
	var w strings.Builder
	for i, word := range strings.Split(s, " ") {
		if i > 0 {
			w.WriteByte(' ')
		}
		if isCode(word) {
			w.WriteString(escCode(word))
		} else {
			w.WriteString(strings.ReplaceAll(word, `\`, `\e`))
		}
	}
	return w.String()
}

// isCode says a word is typed, not read: it starts with a dash (after
// opening punctuation) or holds a character prose does not ("/run/x-y",
// "@name-ctl", "a=b").
func isCode(word string) bool {
	return strings.HasPrefix(strings.TrimLeft(word, "([\"'`|"), "-") || strings.ContainsAny(word, "/@_=")
}

// escCode escapes literal text: every dash is a minus sign.
func escCode(s string) string {
	return strings.NewReplacer(`\`, `\e`, "-", `\-`).Replace(s)
}

// esc escapes text that goes in a macro line.
func esc(s string) string { return escText(s) }

// startSafe keeps a line that starts with a control character ('.' or ')
// from being read as a request.
func startSafe(l string) string {
	if strings.HasPrefix(l, ".") || strings.HasPrefix(l, "'") {
		return `\&` + l
	}
	return l
}

// quote makes s one macro argument.
func quote(s string) string {
	return `"` + strings.ReplaceAll(esc(s), `"`, `\(dq`) + `"`
}

func capitalize(s string) string {
	if s == "" {
		return s
	}
	r := []rune(s)
	r[0] = unicode.ToUpper(r[0])
	return string(r)
}

// dedent removes the indentation the lines share, tabs expanded.
func dedent(lines []string) []string {
	out := make([]string, len(lines))
	common := -1
	for i, l := range lines {
		out[i] = expandTabs(l)
		if strings.TrimSpace(out[i]) == "" {
			out[i] = ""
			continue
		}
		n := len(out[i]) - len(strings.TrimLeft(out[i], " "))
		if common < 0 || n < common {
			common = n
		}
	}
	for i, l := range out {
		if l != "" {
			out[i] = l[common:]
		}
	}
	return out
}

func expandTabs(l string) string {
	var w strings.Builder
	col := 0
	for _, r := range l {
		if r == '\t' {
			for {
				w.WriteByte(' ')
				col++
				if col%8 == 0 {
					break
				}
			}
			continue
		}
		w.WriteRune(r)
		col++
	}
	return w.String()
}
