// Package bench is what `make bench` writes its results with: every
// benchmark of the suite (in the packages it measures) records its headline
// figures as rows of one summary (Record), its raw samples as CSV files and
// its figures as SVG plots, all under one results directory; `benchtable`
// then prints the summary as the one table the suite ends with. The
// benchmarks of the product module (quiesce, loader) may not require this
// module: they write the same files with internal/testutil/benchrec, and
// `benchplot` draws their figures from their CSV (Figures).
//
// The directory is $MPIPAUSE_BENCH_DIR, or bench-results under the current
// directory when that is unset. Figures are ratios against a baseline
// measured in the same run wherever there is one: the machine is shared and
// noisy, and a ratio survives that where an absolute time does not.
package bench

import (
	"encoding/csv"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"sync"
)

// EnvDir names the results directory.
const EnvDir = "MPIPAUSE_BENCH_DIR"

// SummaryFile is the file in the results directory that Record appends to.
const SummaryFile = "summary.csv"

// Dir returns the results directory, created if missing.
func Dir() (string, error) {
	d := os.Getenv(EnvDir)
	if d == "" {
		d = "bench-results"
	}
	d, err := filepath.Abs(d)
	if err != nil {
		return "", err
	}
	if err := os.MkdirAll(d, 0o755); err != nil {
		return "", fmt.Errorf("bench: results directory: %w", err)
	}
	return d, nil
}

// Row is one headline figure. Section groups rows in the table (the
// issue's list: "pause", "overhead", "snapshot", "scale"); Case says what
// was measured (job, workload, method, size); Metric what the value is.
// Target, if set, is the goal as a person reads it ("<= 20 ms"), and Met
// whether the value reached it; rows without a target leave both empty.
type Row struct {
	Section string
	Case    string
	Metric  string
	Value   float64
	Unit    string
	Target  string
	Met     *bool
}

// Header is the first line of the summary CSV.
var Header = []string{"section", "case", "metric", "value", "unit", "target", "met"}

// Goal returns r with target text t and Met set to ok.
func (r Row) Goal(t string, ok bool) Row {
	r.Target, r.Met = t, &ok
	return r
}

func (r Row) record() []string {
	met := ""
	if r.Met != nil {
		met = strconv.FormatBool(*r.Met)
	}
	return []string{r.Section, r.Case, r.Metric, strconv.FormatFloat(r.Value, 'g', 6, 64), r.Unit, r.Target, met}
}

var recordMu sync.Mutex

// Record appends rows to the summary in dir. Benchmarks of several
// packages run one after another (go test runs package binaries in
// sequence when -p 1), and each line is written in one append, so rows of
// different benchmarks do not interleave inside a line.
func Record(dir string, rows ...Row) error {
	recordMu.Lock()
	defer recordMu.Unlock()
	path := filepath.Join(dir, SummaryFile)
	f, err := os.OpenFile(path, os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
	if err != nil {
		return err
	}
	st, err := f.Stat()
	if err != nil {
		f.Close()
		return err
	}
	w := csv.NewWriter(f)
	if st.Size() == 0 {
		w.Write(Header)
	}
	for _, r := range rows {
		w.Write(r.record())
	}
	w.Flush()
	return errors.Join(w.Error(), f.Close())
}

// ReadSummary returns the rows Record wrote to dir, in order.
func ReadSummary(dir string) ([]Row, error) {
	f, err := os.Open(filepath.Join(dir, SummaryFile))
	if err != nil {
		return nil, err
	}
	defer f.Close()
	recs, err := csv.NewReader(f).ReadAll()
	if err != nil {
		return nil, fmt.Errorf("bench: %s: %w", SummaryFile, err)
	}
	var out []Row
	for i, rec := range recs {
		if i == 0 && slices.Equal(rec, Header) {
			continue
		}
		if len(rec) != len(Header) {
			return nil, fmt.Errorf("bench: %s line %d: %d fields, want %d", SummaryFile, i+1, len(rec), len(Header))
		}
		v, err := strconv.ParseFloat(rec[3], 64)
		if err != nil {
			return nil, fmt.Errorf("bench: %s line %d: value %q: %w", SummaryFile, i+1, rec[3], err)
		}
		r := Row{Section: rec[0], Case: rec[1], Metric: rec[2], Value: v, Unit: rec[4], Target: rec[5]}
		if rec[6] != "" {
			ok := rec[6] == "true"
			r.Met = &ok
		}
		out = append(out, r)
	}
	return out, nil
}

// WriteCSV writes one CSV file of raw data (samples, curves) to dir/name.
func WriteCSV(dir, name string, header []string, rows [][]string) error {
	f, err := os.Create(filepath.Join(dir, name))
	if err != nil {
		return err
	}
	w := csv.NewWriter(f)
	w.Write(header)
	w.WriteAll(rows)
	return errors.Join(w.Error(), f.Close())
}

// Percentile returns the q-quantile (0..1) of v by the nearest-rank method,
// NaN for no samples. v is not modified.
func Percentile(v []float64, q float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	s := slices.Clone(v)
	slices.Sort(s)
	i := int(math.Ceil(q*float64(len(s)))) - 1
	return s[max(0, min(i, len(s)-1))]
}

// Max returns the largest of v, NaN for none.
func Max(v []float64) float64 {
	if len(v) == 0 {
		return math.NaN()
	}
	return slices.Max(v)
}
