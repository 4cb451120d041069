// Package benchrec writes benchmark results: raw samples as CSV files and
// headline rows appended to the summary, in one results directory. The
// product module's benchmarks (quiesce's BenchmarkScale, loader's
// BenchmarkSnapshot) use it directly; the tools module's bench package
// writes with it too and reads the files back (benchtable prints the
// summary, benchplot draws the figures from the CSV files). It uses the
// standard library alone, so that the product module requires no tooling
// module and none of the plotting libraries.
package benchrec

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

// EnvDir names the results directory (bench.EnvDir).
const EnvDir = "MPIPAUSE_BENCH_DIR"

// SummaryFile is the file Record appends to (bench.SummaryFile).
const SummaryFile = "summary.csv"

// Header is the summary's first line (bench.Header).
var Header = []string{"section", "case", "metric", "value", "unit", "target", "met"}

// Dir returns the results directory, $MPIPAUSE_BENCH_DIR or bench-results
// under the current directory, created if missing.
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

// Row is one headline figure. Section groups rows in the table ("pause",
// "overhead", "snapshot", "scale"); Case says what was measured (job,
// workload, method, size); Metric what the value is. Target, if set, is the
// goal as a person reads it ("<= 20 ms"), and Met whether the value reached
// it; rows without a target leave both empty.
type Row struct {
	Section, Case, Metric string
	Value                 float64
	Unit, Target          string
	Met                   *bool
}

// Goal returns r with target text t and Met set to ok.
func (r Row) Goal(t string, ok bool) Row {
	r.Target, r.Met = t, &ok
	return r
}

// Judged returns r with target text t and the verdict met, which may be
// nil: the measurement could not tell (the table says "not resolved").
func (r Row) Judged(t string, met *bool) Row {
	r.Target, r.Met = t, met
	return r
}

var recordMu sync.Mutex

// Record appends rows to the summary in dir, with its header if the file
// is new. Each package's benchmarks run in a binary of their own, one after
// another; within one, benchmarks may record from several goroutines.
func Record(dir string, rows ...Row) error {
	recordMu.Lock()
	defer recordMu.Unlock()
	f, err := os.OpenFile(filepath.Join(dir, SummaryFile), os.O_CREATE|os.O_APPEND|os.O_WRONLY, 0o644)
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
		met := ""
		if r.Met != nil {
			met = strconv.FormatBool(*r.Met)
		}
		w.Write([]string{r.Section, r.Case, r.Metric, strconv.FormatFloat(r.Value, 'g', 6, 64), r.Unit, r.Target, met})
	}
	w.Flush()
	return errors.Join(w.Error(), f.Close())
}

// WriteCSV writes one CSV file of raw samples to dir/name.
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

// Percentile returns the q-quantile (0..1) of v by the nearest-rank method
// (bench.Percentile, which the figures drawn from the CSV files use), NaN
// for no samples. v is not modified.
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
