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
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strconv"

	"github.com/mpipause/mpipause/internal/testutil/benchrec"
)

// The results directory and the files in it are benchrec's, which the
// product module's benchmarks write with too: one writer, so that what
// they write and what benchtable and benchplot read cannot drift apart.
const (
	EnvDir      = benchrec.EnvDir
	SummaryFile = benchrec.SummaryFile
)

// Header is the first line of the summary CSV.
var Header = benchrec.Header

// Row is one headline figure (benchrec.Row).
type Row = benchrec.Row

// Dir returns the results directory, created if missing.
func Dir() (string, error) { return benchrec.Dir() }

// Record appends rows to the summary in dir.
func Record(dir string, rows ...Row) error { return benchrec.Record(dir, rows...) }

// WriteCSV writes one CSV file of raw data (samples, curves) to dir/name.
func WriteCSV(dir, name string, header []string, rows [][]string) error {
	return benchrec.WriteCSV(dir, name, header, rows)
}

// Percentile returns the q-quantile (0..1) of v by the nearest-rank method,
// NaN for no samples.
func Percentile(v []float64, q float64) float64 { return benchrec.Percentile(v, q) }

// Max returns the largest of v, NaN for none.
func Max(v []float64) float64 { return benchrec.Max(v) }

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
