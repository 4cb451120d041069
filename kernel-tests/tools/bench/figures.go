package bench

import (
	"encoding/csv"
	"errors"
	"fmt"
	"io"
	"io/fs"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
)

// Figure is one SVG that Figures draws from a raw CSV file of the results
// directory.
type Figure struct {
	Name string // the SVG's file name
	Plot Plot
}

// Figures returns the plots of the benchmarks that record only CSV (those
// of the product module, which links no plotting): scale-pause.svg and
// scale-root-messages.svg from scale.csv (quiesce's BenchmarkScale),
// snapshot-vs-sockets.svg from snapshot.csv (loader's BenchmarkSnapshot).
// A CSV file that is missing gives no figure; so does a snapshot.csv with
// only the iter/tcp pass, which has no curve against job size.
func Figures(dir string) ([]Figure, error) {
	var out []Figure
	for _, src := range []struct {
		file string
		draw func([][]string) ([]Figure, error)
	}{{"scale.csv", scaleFigures}, {"snapshot.csv", snapshotFigures}} {
		recs, err := readCSV(filepath.Join(dir, src.file))
		if errors.Is(err, fs.ErrNotExist) {
			continue
		}
		if err != nil {
			return nil, err
		}
		figs, err := src.draw(recs)
		if err != nil {
			return nil, fmt.Errorf("bench: %s: %w", src.file, err)
		}
		out = append(out, figs...)
	}
	return out, nil
}

// WriteFigures draws Figures(dir) into dir and returns the files written.
func WriteFigures(dir string) ([]string, error) {
	figs, err := Figures(dir)
	if err != nil {
		return nil, err
	}
	var names []string
	for _, f := range figs {
		if err := WritePlot(dir, f.Name, f.Plot); err != nil {
			return names, err
		}
		names = append(names, f.Name)
	}
	return names, nil
}

func readCSV(path string) ([][]string, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	return csv.NewReader(f).ReadAll()
}

// columns maps the header's names to their indexes and checks that want
// are all there.
func columns(recs [][]string, want ...string) (map[string]int, [][]string, error) {
	if len(recs) == 0 {
		return nil, nil, io.ErrUnexpectedEOF
	}
	col := map[string]int{}
	for i, name := range recs[0] {
		col[name] = i
	}
	for _, w := range want {
		if _, ok := col[w]; !ok {
			return nil, nil, fmt.Errorf("no column %q in %q", w, recs[0])
		}
	}
	return col, recs[1:], nil
}

// group collects values in the order their keys first appear, which is
// the order the benchmark measured them in.
type group[K comparable] struct {
	keys []K
	vals map[K][]float64
}

func (g *group[K]) add(k K, v float64) {
	if g.vals == nil {
		g.vals = map[K][]float64{}
	}
	if _, ok := g.vals[k]; !ok {
		g.keys = append(g.keys, k)
	}
	g.vals[k] = append(g.vals[k], v)
}

func parseFloats(rec []string, idx ...int) ([]float64, error) {
	out := make([]float64, len(idx))
	for i, j := range idx {
		v, err := strconv.ParseFloat(rec[j], 64)
		if err != nil {
			return nil, err
		}
		out[i] = v
	}
	return out, nil
}

// scaleFigures draws, per transport and fanout, the pause's p50 against
// the nodes, and per fanout (its first transport: the counts do not depend
// on it) the mean requests at the root per round.
func scaleFigures(recs [][]string) ([]Figure, error) {
	col, rows, err := columns(recs, "transport", "fanout", "nodes", "pause_ms", "root_msgs")
	if err != nil {
		return nil, err
	}
	type point struct {
		key   string // transport/fanout
		nodes float64
	}
	var pause, root group[point]
	for i, r := range rows {
		if len(r) != len(recs[0]) {
			return nil, fmt.Errorf("line %d: %d fields, want %d", i+2, len(r), len(recs[0]))
		}
		v, err := parseFloats(r, col["nodes"], col["pause_ms"], col["root_msgs"])
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", i+2, err)
		}
		p := point{r[col["transport"]] + "/" + r[col["fanout"]], v[0]}
		pause.add(p, v[1])
		root.add(p, v[2])
	}
	pausePlot := Plot{Title: "Pause time (PREPARE to COMMIT, p50) vs nodes", XLabel: "simulated nodes",
		YLabel: "pause p50 (ms)", LogX2: true, LogY: true}
	rootPlot := Plot{Title: "Messages at the root per round vs nodes", XLabel: "simulated nodes",
		YLabel: "requests in + out at node 0, per round", LogX2: true, LogY: true}
	var keys []string
	for _, p := range pause.keys {
		if !slices.Contains(keys, p.key) {
			keys = append(keys, p.key)
		}
	}
	rootSeen := map[string]bool{}
	for _, key := range keys {
		ps, rs := Series{Name: key}, Series{Name: key}
		for _, p := range pause.keys {
			if p.key != key {
				continue
			}
			ps.X, ps.Y = append(ps.X, p.nodes), append(ps.Y, Percentile(pause.vals[p], 0.5))
			rs.X, rs.Y = append(rs.X, p.nodes), append(rs.Y, mean(root.vals[p]))
		}
		pausePlot.Series = append(pausePlot.Series, ps)
		_, fanout, _ := strings.Cut(key, "/")
		if rootSeen[fanout] {
			continue
		}
		rootSeen[fanout] = true
		rs.Name = fanout
		rootPlot.Series = append(rootPlot.Series, rs)
	}
	return []Figure{{"scale-pause.svg", pausePlot}, {"scale-root-messages.svg", rootPlot}}, nil
}

// snapshotFigures draws each observer's p50 snapshot time against the
// job's sockets.
func snapshotFigures(recs [][]string) ([]Figure, error) {
	col, rows, err := columns(recs, "observer", "sockets", "ms")
	if err != nil {
		return nil, err
	}
	type point struct {
		observer string
		sockets  float64
	}
	var g group[point]
	for i, r := range rows {
		if len(r) != len(recs[0]) {
			return nil, fmt.Errorf("line %d: %d fields, want %d", i+2, len(r), len(recs[0]))
		}
		o := r[col["observer"]]
		if o != "bpf" && o != "sock_diag" {
			continue // the iter/tcp pass alone, at one size: no curve
		}
		v, err := parseFloats(r, col["sockets"], col["ms"])
		if err != nil {
			return nil, fmt.Errorf("line %d: %w", i+2, err)
		}
		g.add(point{o, v[0]}, v[1])
	}
	if len(g.keys) == 0 {
		return nil, nil
	}
	bpfS, diagS := Series{Name: "bpf"}, Series{Name: "sock_diag"}
	for _, p := range g.keys {
		s := &bpfS
		if p.observer == "sock_diag" {
			s = &diagS
		}
		s.X, s.Y = append(s.X, p.sockets), append(s.Y, Percentile(g.vals[p], 0.5))
	}
	return []Figure{{"snapshot-vs-sockets.svg", Plot{
		Title:  "Snapshot time against job size",
		XLabel: "job sockets (log)", YLabel: "snapshot p50, ms (log)",
		LogX: true, LogY: true,
		Series: []Series{bpfS, diagS},
	}}}, nil
}

func mean(v []float64) float64 {
	var s float64
	for _, x := range v {
		s += x
	}
	return s / float64(len(v))
}
