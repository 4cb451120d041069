package main

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
)

// runCLI runs one command line in-process and returns its exit code and output.
func runCLI(t *testing.T, args ...string) (code int, stdout, stderr string) {
	t.Helper()
	var out, errb bytes.Buffer
	code = run(args, &out, &errb)
	return code, out.String(), errb.String()
}

// results writes a summary with bench.Record, as the benchmarks do, and a
// plot and a CSV beside it.
func results(t *testing.T) string {
	t.Helper()
	dir := t.TempDir()
	rows := []bench.Row{
		bench.Row{Section: "scale", Case: "4096 nodes", Metric: "messages", Value: 123456, Unit: "msgs"}.Goal("<= 1e5", false),
		{Section: "pause", Case: "rig link", Metric: "TCP round trip p50", Value: 0.04123, Unit: "ms"},
		bench.Row{Section: "pause", Case: "openmpi/3x2/ring", Metric: "pause p50", Value: 12.345, Unit: "ms"}.Goal("<= 20 ms", true),
		bench.Row{Section: "pause", Case: "openmpi/4x4/ring", Metric: "pause p50", Value: 25.31, Unit: "ms"}.Goal("<= 20 ms", false),
		{Section: "pause", Case: "mpich/4x4/ring", Metric: "pause p99", Value: bench.Percentile(nil, 0.99), Unit: "ms"},
		{Section: "scale", Case: "16 nodes", Metric: "rounds", Value: 4},
		bench.Row{Section: "overhead", Case: "mpich", Metric: "latency with / plain", Value: 1.03, Unit: "x"}.Judged("< 1.02", nil),
	}
	if err := bench.Record(dir, rows[:2]...); err != nil {
		t.Fatal(err)
	}
	if err := bench.Record(dir, rows[2:]...); err != nil {
		t.Fatal(err)
	}
	if err := bench.WriteCSV(dir, "pause.csv", []string{"ms"}, [][]string{{"1"}}); err != nil {
		t.Fatal(err)
	}
	if err := bench.WritePlot(dir, "pause-cdf.svg", bench.Plot{Title: "t"}); err != nil {
		t.Fatal(err)
	}
	return dir
}

func TestTable(t *testing.T) {
	dir := results(t)
	code, out, stderr := runCLI(t, dir)
	if code != 0 || stderr != "" {
		t.Fatalf("exit %d, stderr %q", code, stderr)
	}
	lines := strings.Split(strings.TrimRight(out, "\n"), "\n")
	// Sections in order of first appearance (scale before pause, not
	// sorted), each holding all its rows although they were recorded
	// interleaved.
	var headings []string
	under := map[string]string{} // case → section heading above it
	metricCol := strings.Index(lines[0], "METRIC")
	for _, l := range lines {
		if strings.HasPrefix(l, "targets:") {
			break // the table ends; the missed targets follow, indented
		}
		switch {
		case l != "" && !strings.HasPrefix(l, " ") && !strings.Contains(l, ":"):
			headings = append(headings, l)
		case strings.HasPrefix(l, "  ") && len(headings) > 0:
			under[strings.TrimSpace(l[:metricCol])] = headings[len(headings)-1]
		}
	}
	if diff := cmp.Diff([]string{"scale", "pause", "overhead"}, headings); diff != "" {
		t.Errorf("section headings (-want +got):\n%s\n%s", diff, out)
	}
	wantUnder := map[string]string{
		"4096 nodes": "scale", "16 nodes": "scale", "rig link": "pause",
		"openmpi/3x2/ring": "pause", "openmpi/4x4/ring": "pause", "mpich/4x4/ring": "pause",
		"mpich": "overhead",
	}
	if diff := cmp.Diff(wantUnder, under); diff != "" {
		t.Errorf("section of each case (-want +got):\n%s\n%s", diff, out)
	}
	for _, cells := range [][]string{
		{"CASE", "METRIC", "VALUE", "UNIT", "TARGET", "RESULT"},
		{"rig link", "TCP round trip p50", "0.0412", "ms"},
		{"openmpi/3x2/ring", "pause p50", "12.3", "ms", "<= 20 ms", "met"},
		{"openmpi/4x4/ring", "pause p50", "25.3", "ms", "<= 20 ms", "MISSED"},
		{"4096 nodes", "messages", "123,456", "msgs", "<= 1e5", "MISSED"},
		{"16 nodes", "rounds", "4"},
		{"mpich/4x4/ring", "pause p99", "n/a", "ms"},
		{"mpich", "latency with / plain", "1.03", "x", "< 1.02", "not resolved"},
	} {
		if !hasRow(lines, cells) {
			t.Errorf("no line with %q in\n%s", cells, out)
		}
	}
	for _, want := range []string{
		"targets: 1 of 4 met, 1 not resolved; missed:",
		"  4096 nodes messages (123,456 msgs, target <= 1e5)",
		"  openmpi/4x4/ring pause p50 (25.3 ms, target <= 20 ms)",
	} {
		if !slices.Contains(lines, want) {
			t.Errorf("no line %q in\n%s", want, out)
		}
	}
	for _, f := range []string{"pause-cdf.svg", "pause.csv"} {
		if !strings.Contains(out, f) {
			t.Errorf("output does not name %s:\n%s", f, out)
		}
	}
	if strings.Contains(out, bench.SummaryFile+"\n") {
		t.Errorf("output lists the summary among the other files:\n%s", out)
	}
	// The values line up: each VALUE cell ends in the same column.
	end := -1
	for _, l := range lines {
		if strings.HasPrefix(l, "targets:") {
			break
		}
		for _, v := range []string{"0.0412", " 12.3", "123,456", "n/a"} {
			if i := strings.Index(l, v); i >= 0 && strings.HasPrefix(l, "  ") {
				if end >= 0 && i+len(v) != end {
					t.Errorf("value %q ends in column %d, want %d:\n%s", v, i+len(v), end, out)
				}
				end = i + len(v)
			}
		}
	}
}

// hasRow says whether some line holds exactly cells, in order, separated
// by padding only.
func hasRow(lines, cells []string) bool {
	want := strings.Fields(strings.Join(cells, " "))
	for _, l := range lines {
		if slices.Equal(strings.Fields(l), want) {
			return true
		}
	}
	return false
}

func TestJSON(t *testing.T) {
	dir := results(t)
	code, out, stderr := runCLI(t, "--json", dir)
	if code != 0 || stderr != "" {
		t.Fatalf("exit %d, stderr %q", code, stderr)
	}
	var got struct {
		Rows []struct {
			Section, Case, Metric, Unit, Target string
			Value                               *float64
			Met                                 *bool
		}
		TargetsMet        int `json:"targets_met"`
		TargetsUnresolved int `json:"targets_unresolved"`
		Targets           int `json:"targets"`
		Files             []string
	}
	if err := json.Unmarshal([]byte(out), &got); err != nil {
		t.Fatalf("--json output does not parse: %v\n%s", err, out)
	}
	if got.TargetsMet != 1 || got.TargetsUnresolved != 1 || got.Targets != 4 {
		t.Errorf("targets_met, targets_unresolved, targets = %d, %d, %d; want 1, 1, 4", got.TargetsMet, got.TargetsUnresolved, got.Targets)
	}
	if len(got.Rows) != 7 {
		t.Fatalf("%d rows, want 7:\n%s", len(got.Rows), out)
	}
	if r := got.Rows[6]; r.Target != "< 1.02" || r.Met != nil {
		t.Errorf("row not resolved = %+v, want target < 1.02, met null", r)
	}
	if r := got.Rows[2]; r.Case != "openmpi/3x2/ring" || r.Value == nil || *r.Value != 12.345 || r.Met == nil || !*r.Met {
		t.Errorf("row 1 = %+v, want openmpi/3x2/ring 12.345 met", r)
	}
	if r := got.Rows[1]; r.Met != nil {
		t.Errorf("row without a target has met = %v, want null", *r.Met)
	}
	if r := got.Rows[4]; r.Value != nil {
		t.Errorf("NaN value = %v, want null", *r.Value)
	}
	if diff := cmp.Diff([]string{"pause-cdf.svg", "pause.csv"}, got.Files); diff != "" {
		t.Errorf("files (-want +got):\n%s", diff)
	}
}

func TestErrors(t *testing.T) {
	empty := t.TempDir()
	bad := t.TempDir()
	os.WriteFile(filepath.Join(bad, bench.SummaryFile), []byte("a,b\n"), 0o644)
	tests := []struct {
		name       string
		args       []string
		wantCode   int
		wantStdout string
		wantStderr string
	}{
		{name: "missing dir", args: []string{filepath.Join(empty, "nope")}, wantCode: 1, wantStderr: "benchtable: no summary in " + filepath.Join(empty, "nope") + ": run make bench first"},
		{name: "no summary", args: []string{"--json", empty}, wantCode: 1, wantStderr: "no summary in " + empty},
		{name: "bad summary", args: []string{bad}, wantCode: 1, wantStderr: "benchtable: summary in " + bad + " unreadable"},
		{name: "no dir", args: nil, wantCode: 2, wantStderr: "usage: benchtable [--json] DIR"},
		{name: "two dirs", args: []string{empty, bad}, wantCode: 2, wantStderr: "usage:"},
		{name: "unknown option", args: []string{"--csv", empty}, wantCode: 2, wantStderr: `unknown option "--csv"`},
		{name: "-h", args: []string{"-h"}, wantCode: 0, wantStdout: "usage: benchtable [--json] DIR"},
		{name: "--help after dir", args: []string{empty, "--help"}, wantCode: 0, wantStdout: "--json"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			code, stdout, stderr := runCLI(t, tt.args...)
			if code != tt.wantCode {
				t.Errorf("exit code = %d, want %d (stderr %q)", code, tt.wantCode, stderr)
			}
			if !strings.Contains(stdout, tt.wantStdout) {
				t.Errorf("stdout = %q, want it to contain %q", stdout, tt.wantStdout)
			}
			if !strings.Contains(stderr, tt.wantStderr) {
				t.Errorf("stderr = %q, want it to contain %q", stderr, tt.wantStderr)
			}
			if tt.wantCode != 0 && strings.Count(stderr, "\n") != 1 {
				t.Errorf("an error must be one line, got %q", stderr)
			}
		})
	}
}

func TestFormatValue(t *testing.T) {
	tests := []struct {
		v    float64
		want string
	}{
		{0, "0"},
		{0.04123, "0.0412"},
		{0.5, "0.5"},
		{1.234, "1.23"},
		{12.345, "12.3"},
		{123.45, "123"},
		{12, "12"},
		{4096, "4,096"},
		{12345.6, "12,346"},
		{-2500.4, "-2,500"},
		{0.00001234, "1.23e-05"},
		{2e18, "2e+18"},
	}
	for _, tt := range tests {
		if got := formatValue(tt.v); got != tt.want {
			t.Errorf("formatValue(%v) = %q, want %q", tt.v, got, tt.want)
		}
	}
}
