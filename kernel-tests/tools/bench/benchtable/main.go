// Command benchtable prints the summary that `make bench` recorded in a
// results directory (bench.ReadSummary) as the one table the suite ends
// with: the rows grouped by section, each target met, MISSED or not
// resolved (the measurement's interval straddles it), a line that counts
// the targets, and the plots and raw data beside it.
//
//	go run ./kernel-tests/tools/bench/benchtable [--json] DIR
//
// Exit status: 0 when the table printed (a missed target is a figure, not a
// failure of this command), 1 when there is no summary to read, 2 for bad
// usage.
package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
)

const usageText = `usage: benchtable [--json] DIR

Prints the summary that 'make bench' recorded in DIR/summary.csv as one
table, grouped by section, with each target met, MISSED or not resolved
(the figure's confidence interval straddles the target), then the files
beside it (SVG plots, CSV raw data).

  --json      print one JSON object {"rows": [...], "targets_met": N,
              "targets_unresolved": U, "targets": M, "files": [...]}
              instead (a row not resolved has a target and "met": null)
  -h, --help  print this help

Exit status: 0 the table printed (missed targets included), 1 no summary
in DIR, 2 bad usage.
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

// run executes one command line and returns the exit code.
func run(args []string, stdout, stderr io.Writer) int {
	asJSON := false
	var dirs []string
	for i := 0; i < len(args); i++ {
		switch a := args[i]; {
		case a == "-h" || a == "-help" || a == "--help":
			fmt.Fprint(stdout, usageText)
			return 0
		case a == "-json" || a == "--json":
			asJSON = true
		case a == "--":
			dirs = append(dirs, args[i+1:]...)
			i = len(args)
		case strings.HasPrefix(a, "-") && a != "-":
			fmt.Fprintf(stderr, "benchtable: unknown option %q; see --help\n", a)
			return 2
		default:
			dirs = append(dirs, a)
		}
	}
	if len(dirs) != 1 {
		fmt.Fprintf(stderr, "usage: benchtable [--json] DIR (got %d directories); see --help\n", len(dirs))
		return 2
	}
	dir := dirs[0]
	rows, err := bench.ReadSummary(dir)
	if errors.Is(err, fs.ErrNotExist) {
		fmt.Fprintf(stderr, "benchtable: no summary in %s: run make bench first\n", dir)
		return 1
	}
	if err != nil {
		fmt.Fprintf(stderr, "benchtable: summary in %s unreadable: %v\n", dir, err)
		return 1
	}
	files, err := otherFiles(dir)
	if err != nil {
		fmt.Fprintf(stderr, "benchtable: %v\n", err)
		return 1
	}
	if asJSON {
		return writeJSON(stdout, stderr, rows, files)
	}
	writeTable(stdout, dir, rows, files)
	return 0
}

// otherFiles lists the files in dir other than the summary, sorted.
func otherFiles(dir string) ([]string, error) {
	ents, err := os.ReadDir(dir)
	if err != nil {
		return nil, err
	}
	var out []string
	for _, e := range ents {
		if e.IsDir() || e.Name() == bench.SummaryFile {
			continue
		}
		out = append(out, e.Name())
	}
	return out, nil // ReadDir sorts by name
}

// jsonRow is a bench.Row for --json. Value is null when it is not a finite
// number (a percentile of no samples is NaN), which JSON cannot carry.
type jsonRow struct {
	Section string   `json:"section"`
	Case    string   `json:"case"`
	Metric  string   `json:"metric"`
	Value   *float64 `json:"value"`
	Unit    string   `json:"unit"`
	Target  string   `json:"target"`
	Met     *bool    `json:"met"`
}

type jsonSummary struct {
	Rows              []jsonRow `json:"rows"`
	TargetsMet        int       `json:"targets_met"`
	TargetsUnresolved int       `json:"targets_unresolved"`
	Targets           int       `json:"targets"`
	Files             []string  `json:"files"`
}

func writeJSON(stdout, stderr io.Writer, rows []bench.Row, files []string) int {
	out := jsonSummary{Rows: []jsonRow{}, Files: files}
	if out.Files == nil {
		out.Files = []string{}
	}
	for _, r := range rows {
		j := jsonRow{Section: r.Section, Case: r.Case, Metric: r.Metric, Unit: r.Unit, Target: r.Target, Met: r.Met}
		if !math.IsNaN(r.Value) && !math.IsInf(r.Value, 0) {
			v := r.Value
			j.Value = &v
		}
		out.Rows = append(out.Rows, j)
	}
	met, total, _, unresolved := targets(rows)
	out.TargetsMet, out.Targets, out.TargetsUnresolved = met, total, len(unresolved)
	enc := json.NewEncoder(stdout)
	enc.SetIndent("", "  ")
	enc.SetEscapeHTML(false) // targets read "<= 20 ms", not "\u003c= 20 ms"
	if err := enc.Encode(out); err != nil {
		fmt.Fprintf(stderr, "benchtable: %v\n", err)
		return 1
	}
	return 0
}

// grouped returns rows ordered by section, sections in the order of their
// first row, rows in their order within a section. Benchmarks that run in
// parallel or in sub-benchmarks can interleave the sections they record.
func grouped(rows []bench.Row) []bench.Row {
	var sections []string
	for _, r := range rows {
		if !slices.Contains(sections, r.Section) {
			sections = append(sections, r.Section)
		}
	}
	out := slices.Clone(rows)
	slices.SortStableFunc(out, func(a, b bench.Row) int {
		return slices.Index(sections, a.Section) - slices.Index(sections, b.Section)
	})
	return out
}

// targets counts the rows with a target and those that met it, and
// returns the ones that missed and the ones whose measurement could not
// tell (a target and no verdict).
func targets(rows []bench.Row) (met, total int, missed, unresolved []bench.Row) {
	for _, r := range rows {
		switch {
		case r.Target == "" && r.Met == nil:
			continue
		case r.Met == nil:
			unresolved = append(unresolved, r)
		case *r.Met:
			met++
		default:
			missed = append(missed, r)
		}
		total++
	}
	return met, total, missed, unresolved
}

// writeTable prints the rows as one table: one set of column widths for all
// sections, so that values line up down the whole table, and a heading
// line per section in the order the benchmarks recorded them.
func writeTable(w io.Writer, dir string, rows []bench.Row, files []string) {
	rows = grouped(rows)
	if len(rows) == 0 {
		fmt.Fprintf(w, "no figures recorded in %s\n", filepath.Join(dir, bench.SummaryFile))
	} else {
		t := table{header: []string{"CASE", "METRIC", "VALUE", "UNIT", "TARGET", "RESULT"}, right: 2}
		for i, r := range rows {
			if i == 0 || r.Section != rows[i-1].Section {
				heading := r.Section
				if heading == "" {
					heading = "(no section)"
				}
				t.heading(heading)
			}
			t.add(r.Case, r.Metric, formatValue(r.Value), r.Unit, r.Target, result(r))
		}
		t.write(w)
	}

	met, total, missed, unresolved := targets(rows)
	if total == 0 {
		fmt.Fprintln(w, "targets: none set")
	} else {
		line := fmt.Sprintf("targets: %d of %d met", met, total)
		if len(unresolved) > 0 {
			line += fmt.Sprintf(", %d not resolved", len(unresolved))
		}
		if len(missed) > 0 {
			line += "; missed:"
		}
		fmt.Fprintln(w, line)
		// One line each: a suite run misses dozens on a loaded machine,
		// and a single line of them could not be read at a glance.
		for _, r := range missed {
			v := formatValue(r.Value)
			if r.Unit != "" {
				v += " " + r.Unit
			}
			fmt.Fprintf(w, "  %s %s (%s, target %s)\n", r.Case, r.Metric, v, r.Target)
		}
	}

	var plots, data, other []string
	for _, f := range files {
		switch strings.ToLower(filepath.Ext(f)) {
		case ".svg":
			plots = append(plots, f)
		case ".csv":
			data = append(data, f)
		default:
			other = append(other, f)
		}
	}
	where := filepath.Clean(dir) + string(filepath.Separator)
	list(w, "plots in "+where, plots)
	list(w, "data in "+where, data)
	list(w, "also in "+where, other)
}

// list prints names after a label, wrapped at about 100 columns.
func list(w io.Writer, label string, names []string) {
	if len(names) == 0 {
		return
	}
	line, n := label+":", 0 // n: names on this line
	for _, name := range names {
		if n > 0 && len(line)+1+len(name) > 100 {
			fmt.Fprintln(w, line)
			line, n = "   ", 0
		}
		line += " " + name
		n++
	}
	fmt.Fprintln(w, line)
}

func result(r bench.Row) string {
	switch {
	case r.Met == nil && r.Target != "":
		return "not resolved"
	case r.Met == nil:
		return ""
	case *r.Met:
		return "met"
	}
	return "MISSED"
}

// formatValue prints about three significant digits: the suite's figures
// come from a noisy shared machine, and more digits would only be noise to
// read past. Thousands and up print whole, with separators; whole numbers
// (counts) print whole.
func formatValue(v float64) string {
	switch {
	case math.IsNaN(v):
		return "n/a"
	case math.IsInf(v, 1):
		return "inf"
	case math.IsInf(v, -1):
		return "-inf"
	case v == 0:
		return "0"
	}
	a := math.Abs(v)
	switch {
	case a >= 1e15 || a < 0.001:
		return strconv.FormatFloat(v, 'g', 3, 64)
	case a >= 1000 || v == math.Trunc(v):
		return commas(strconv.FormatFloat(math.Round(v), 'f', 0, 64))
	}
	// 2 decimals at 1.23, 1 at 12.3, 0 at 123, 4 at 0.0123; trailing
	// zeros dropped (0.5, not 0.500).
	dec := max(0, 2-int(math.Floor(math.Log10(a))))
	s := strconv.FormatFloat(v, 'f', dec, 64)
	if strings.Contains(s, ".") {
		s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	}
	return s
}

// commas groups the digits of an integer in threes.
func commas(s string) string {
	sign := ""
	if strings.HasPrefix(s, "-") {
		sign, s = "-", s[1:]
	}
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return sign + b.String()
}

// table prints columns padded to their widest cell, column right (the
// numbers) right aligned, the others left aligned. Headings are lines of
// their own; the rows under them are indented.
type table struct {
	header []string
	right  int
	rows   [][]string // a row of one cell, marked by heading, is a heading
	heads  []bool
}

func (t *table) add(cells ...string) { t.rows, t.heads = append(t.rows, cells), append(t.heads, false) }

func (t *table) heading(s string) {
	t.rows, t.heads = append(t.rows, []string{s}), append(t.heads, true)
}

func (t *table) write(w io.Writer) {
	width := make([]int, len(t.header))
	for i, row := range append([][]string{t.header}, t.rows...) {
		if i > 0 && t.heads[i-1] {
			continue
		}
		for j, c := range row {
			width[j] = max(width[j], len([]rune(c)))
		}
	}
	line := func(row []string) {
		var b strings.Builder
		b.WriteString("  ")
		for j, c := range row {
			if j > 0 {
				b.WriteString("  ")
			}
			pad := strings.Repeat(" ", width[j]-len([]rune(c)))
			if j == t.right {
				b.WriteString(pad + c)
			} else {
				b.WriteString(c + pad)
			}
		}
		fmt.Fprintln(w, strings.TrimRight(b.String(), " "))
	}
	line(t.header)
	for i, row := range t.rows {
		if t.heads[i] {
			fmt.Fprintln(w, row[0])
			continue
		}
		line(row)
	}
}
