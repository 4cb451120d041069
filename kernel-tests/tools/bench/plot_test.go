package bench

import (
	"bytes"
	"encoding/xml"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// svgDoc is what the tests read back out of a rendered plot.
type svgDoc struct {
	root      string
	texts     []string // every <text> that says something, in order
	lines     int      // paths stroked as a series is (its line, its legend entry)
	markers   int      // filled circles
	badNumber []string // coordinates that are not finite numbers
}

// lineStyle is how gonum writes a series' stroke: colour, then width.
var lineStyle = regexp.MustCompile(`^fill:none;stroke:#[0-9A-F]{6};stroke-width:1.3`)

// parseSVG decodes an SVG document completely, which fails on any XML that
// is not well-formed, and collects what the tests check.
func parseSVG(t *testing.T, b []byte) svgDoc {
	t.Helper()
	var doc svgDoc
	d := xml.NewDecoder(bytes.NewReader(b))
	var text strings.Builder
	for {
		tok, err := d.Token()
		if errors.Is(err, io.EOF) {
			break
		}
		if err != nil {
			t.Fatalf("SVG is not well-formed XML: %v\n%s", err, b)
		}
		switch tok := tok.(type) {
		case xml.StartElement:
			if doc.root == "" {
				doc.root = tok.Name.Local
				if tok.Name.Space != "http://www.w3.org/2000/svg" {
					t.Errorf("root namespace = %q, want the SVG namespace", tok.Name.Space)
				}
			}
			for _, a := range tok.Attr {
				switch a.Name.Local {
				case "x", "y":
					if v, err := strconv.ParseFloat(a.Value, 64); err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
						doc.badNumber = append(doc.badNumber, tok.Name.Local+" "+a.Name.Local+"="+a.Value)
					}
				case "d":
					for _, f := range strings.FieldsFunc(a.Value, func(r rune) bool { return strings.ContainsRune("MLAZ, ", r) }) {
						if v, err := strconv.ParseFloat(f, 64); err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
							doc.badNumber = append(doc.badNumber, "path d "+f)
						}
					}
					if strings.Contains(a.Value, "A") {
						doc.markers++
					}
				case "style":
					if tok.Name.Local == "path" && lineStyle.MatchString(a.Value) {
						doc.lines++
					}
				}
			}
			text.Reset()
		case xml.CharData:
			text.Write(tok)
		case xml.EndElement:
			if s := strings.TrimSpace(text.String()); tok.Name.Local == "text" && s != "" {
				doc.texts = append(doc.texts, s)
			}
			text.Reset()
		}
	}
	return doc
}

func TestSVG(t *testing.T) {
	nodes := []float64{16, 32, 64, 128, 256, 512, 1024, 2048, 4096}
	tests := []struct {
		name       string
		plot       Plot
		wantLines  int // stroked as a series: each line and its legend entry
		wantLegend []string
		wantNoData bool
	}{
		{
			name: "latency CDF on log x with zero samples",
			plot: Plot{Title: "Stop latency", XLabel: "ms (log)", YLabel: "fraction", LogX: true, Step: true, Series: []Series{
				CDF("mpipause pause", []float64{0, 0, 1.5, 2, 3, 12}),
				CDF("SIGSTOP", []float64{0.1, 0.2, 0.2, 0.4}),
			}},
			wantLines:  4,
			wantLegend: []string{"mpipause pause", "SIGSTOP"},
		},
		{
			name: "scaling on log2 x and log y",
			plot: Plot{Title: "Scale", XLabel: "nodes", YLabel: "ms", LogX2: true, LogY: true, Series: []Series{
				{Name: "broadcast", X: nodes, Y: []float64{1, 2, 4, 8, 16, 32, 64, 128, 256}},
				{Name: "tree", X: nodes, Y: []float64{0, 1, 1.2, 1.4, 1.6, 1.8, 2, 2.2, 2.4}},
			}},
			wantLines:  4,
			wantLegend: []string{"broadcast", "tree"},
		},
		{
			name: "NaN and Inf left out on linear axes",
			plot: Plot{Title: "Holes", Series: []Series{
				{Name: "a", X: []float64{1, 2, math.NaN(), 4, 5}, Y: []float64{1, math.Inf(1), 3, math.Inf(-1), 5}},
			}},
			wantLines:  2,
			wantLegend: []string{"a"},
		},
		{
			name: "names and title escaped",
			plot: Plot{Title: `<b>"all" & 'some'</b>`, XLabel: "a<b", YLabel: "c&d", Series: []Series{
				{Name: "x < y & z", X: []float64{1, 2}, Y: []float64{3, 4}},
			}},
			wantLines:  2,
			wantLegend: []string{"x < y & z"},
		},
		{
			name: "only zeros on log axes: no data",
			plot: Plot{Title: "Nothing", LogX: true, LogY: true, Step: true, Series: []Series{
				CDF("zeros", []float64{0, 0, 0}),
				{Name: "negative", X: []float64{-1}, Y: []float64{-1}},
			}},
			wantLines:  0,
			wantLegend: []string{"zeros (no data)", "negative (no data)"},
			wantNoData: true,
		},
		{
			name: "one series drawable, one not",
			plot: Plot{Title: "Half", LogX: true, Series: []Series{
				{Name: "ok", X: []float64{1, 10}, Y: []float64{1, 2}},
				{Name: "empty"},
			}},
			wantLines:  2,
			wantLegend: []string{"ok", "empty (no data)"},
		},
		{
			name:       "no series at all",
			plot:       Plot{Title: "Empty"},
			wantNoData: true,
		},
		{
			name: "one point, constant values",
			plot: Plot{Title: "Dot", LogX: true, LogY: true, Series: []Series{{Name: "p", X: []float64{10}, Y: []float64{10}}}},
			// One point makes no line, only its marker; the legend's line stays.
			wantLines:  1,
			wantLegend: []string{"p"},
		},
		{
			name:       "more series than colours",
			plot:       Plot{Title: "Many", Series: manySeries(13)},
			wantLines:  26,
			wantLegend: []string{"s0", "s1", "s2", "s3", "s4", "s5", "s6", "s7", "s8", "s9", "s10", "s11", "s12"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := tt.plot.SVG()
			if err != nil {
				t.Fatal(err)
			}
			doc := parseSVG(t, b)
			if doc.root != "svg" {
				t.Errorf("root element = %q, want svg", doc.root)
			}
			if !slices.Contains(doc.texts, tt.plot.Title) {
				t.Errorf("title %q not in %q", tt.plot.Title, doc.texts)
			}
			if doc.lines != tt.wantLines {
				t.Errorf("%d series lines (with their legend entries), want %d", doc.lines, tt.wantLines)
			}
			if !tt.wantNoData && len(tt.wantLegend) > 0 && !slices.Equal(tt.wantLegend, doc.texts[len(doc.texts)-len(tt.wantLegend):]) {
				t.Errorf("texts %q, want the legend %q last", doc.texts, tt.wantLegend)
			}
			for _, l := range tt.wantLegend {
				if !slices.Contains(doc.texts, l) {
					t.Errorf("legend entry %q not in %q", l, doc.texts)
				}
			}
			if got := slices.Contains(doc.texts, "no data"); got != tt.wantNoData {
				t.Errorf("no data note = %v, want %v", got, tt.wantNoData)
			}
			if len(doc.badNumber) > 0 {
				t.Errorf("coordinates that are not finite numbers: %q", doc.badNumber)
			}
			again, _ := tt.plot.SVG()
			if !bytes.Equal(b, again) {
				t.Error("two renderings of the same plot differ")
			}
		})
	}
}

func manySeries(n int) []Series {
	var s []Series
	for i := range n {
		s = append(s, Series{Name: "s" + strconv.Itoa(i), X: []float64{0, 1, 2}, Y: []float64{float64(i), float64(i + 1), float64(i)}})
	}
	return s
}

// TestSVGTickLabels checks the labels a reader reads values off: node
// counts on a log2 axis, decades on a log10 axis, round steps on a linear one.
func TestSVGTickLabels(t *testing.T) {
	nodes := []float64{16, 32, 64, 128, 256, 512, 1024, 2048, 4096}
	tests := []struct {
		name string
		plot Plot
		want []string // x labels, then y labels
	}{
		{
			name: "log2 x, linear y",
			plot: Plot{LogX2: true, Series: []Series{{X: nodes, Y: []float64{0, 1, 2, 3, 4, 5, 6, 7, 8}}}},
			want: []string{"16", "32", "64", "128", "256", "512", "1024", "2048", "4096", "0", "2", "4", "6", "8"},
		},
		{
			name: "log10 x over decades, CDF y",
			plot: Plot{LogX: true, Step: true, Series: []Series{CDF("", []float64{0.05, 0.5, 3, 30})}},
			want: []string{"0.01", "0.1", "1", "10", "100", "0", "0.2", "0.4", "0.6", "0.8", "1"},
		},
		{
			name: "log10 y over two decades labels 2 and 5 too",
			plot: Plot{LogY: true, Series: []Series{{X: []float64{0, 1}, Y: []float64{1.5, 80}}}},
			want: []string{"0", "0.2", "0.4", "0.6", "0.8", "1", "1", "2", "5", "10", "20", "50", "100"},
		},
		{
			name: "large linear values in thousands",
			plot: Plot{Series: []Series{{X: []float64{0, 50000}, Y: []float64{12000, 31000}}}},
			want: []string{"0", "10,000", "20,000", "30,000", "40,000", "50,000", "0", "10,000", "20,000", "30,000", "40,000"},
		},
		{
			name: "values far from zero keep their range",
			plot: Plot{Series: []Series{{X: []float64{2, 3}, Y: []float64{2.1, 3.5}}}},
			want: []string{"2", "2.2", "2.4", "2.6", "2.8", "3", "2", "2.5", "3", "3.5"},
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			b, err := tt.plot.SVG()
			if err != nil {
				t.Fatal(err)
			}
			// Nothing else has text: no title, no axis labels, no names.
			if diff := cmp.Diff(tt.want, parseSVG(t, b).texts); diff != "" {
				t.Errorf("tick labels (-want +got):\n%s", diff)
			}
		})
	}
}

// TestSVGStep checks that a step plot draws only horizontal and vertical
// segments, rising from 0, and a line plot straight segments with a marker
// on each point.
func TestSVGStep(t *testing.T) {
	s := Series{Name: "s", X: []float64{1, 2, 3, 4}, Y: []float64{0.25, 0.5, 0.75, 1}}
	step, _ := Plot{Step: true, Series: []Series{s}}.SVG()
	pts := seriesPath(t, step)
	for i := 1; i < len(pts); i++ {
		if pts[i][0] != pts[i-1][0] && pts[i][1] != pts[i-1][1] {
			t.Errorf("step path %v: segment %d is slanted", pts, i)
		}
	}
	if len(pts) != 9 { // the riser from 0, then across and up per point
		t.Errorf("step path %v: %d vertices, want 9", pts, len(pts))
	}
	if n := parseSVG(t, step).markers; n != 0 {
		t.Errorf("step plot has %d markers, want none", n)
	}
	line, _ := Plot{Series: []Series{s}}.SVG()
	if pts := seriesPath(t, line); len(pts) != 4 {
		t.Errorf("line path %v, want one vertex per point", pts)
	}
	// 4 points, and one marker in the legend.
	if n := parseSVG(t, line).markers; n != 5 {
		t.Errorf("line plot has %d markers, want 5", n)
	}
}

// seriesPath returns the vertices of the first series' line.
func seriesPath(t *testing.T, svg []byte) [][2]string {
	t.Helper()
	m := regexp.MustCompile(`<path d="([^"]*)" style="fill:none;stroke:#1F77B4;stroke-width:1.3`).FindSubmatch(svg)
	if m == nil {
		t.Fatalf("no series line in %s", svg)
	}
	var pts [][2]string
	for _, p := range strings.FieldsFunc(string(m[1]), func(r rune) bool { return r == 'M' || r == 'L' }) {
		x, y, _ := strings.Cut(p, ",")
		pts = append(pts, [2]string{x, y})
	}
	return pts
}

func TestWritePlot(t *testing.T) {
	dir := t.TempDir()
	p := Plot{Title: "t", Series: []Series{{Name: "a", X: []float64{1, 2}, Y: []float64{1, 2}}}}
	if err := WritePlot(dir, "p.svg", p); err != nil {
		t.Fatal(err)
	}
	got, err := os.ReadFile(filepath.Join(dir, "p.svg"))
	if err != nil {
		t.Fatal(err)
	}
	want, _ := p.SVG()
	if !bytes.Equal(got, want) {
		t.Error("file differs from Plot.SVG")
	}
	if err := WritePlot(filepath.Join(dir, "missing"), "p.svg", p); err == nil {
		t.Error("WritePlot into a missing directory: no error")
	}
}

func TestCDF(t *testing.T) {
	tests := []struct {
		name    string
		samples []float64
		wantX   []float64
		wantY   []float64
	}{
		{name: "none", samples: nil, wantX: nil, wantY: nil},
		{name: "one", samples: []float64{7}, wantX: []float64{7}, wantY: []float64{1}},
		{name: "unsorted with ties", samples: []float64{3, 1, 2, 1}, wantX: []float64{1, 1, 2, 3}, wantY: []float64{0.25, 0.5, 0.75, 1}},
		{name: "zeros kept", samples: []float64{0, 5}, wantX: []float64{0, 5}, wantY: []float64{0.5, 1}},
		{name: "NaN dropped", samples: []float64{math.NaN(), 4, math.NaN(), 2}, wantX: []float64{2, 4}, wantY: []float64{0.5, 1}},
		{name: "only NaN", samples: []float64{math.NaN()}, wantX: nil, wantY: nil},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			in := append([]float64(nil), tt.samples...)
			s := CDF("n", tt.samples)
			if s.Name != "n" {
				t.Errorf("name = %q, want %q", s.Name, "n")
			}
			if diff := cmp.Diff(tt.wantX, s.X, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("X (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.wantY, s.Y, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("Y (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(in, tt.samples, cmpopts.EquateNaNs()); diff != "" {
				t.Errorf("samples modified (-want +got):\n%s", diff)
			}
		})
	}
}

func TestNumLabel(t *testing.T) {
	tests := []struct {
		v, step float64
		want    string
	}{
		{0, 0.2, "0"},
		{0.6000000000000001, 0.2, "0.6"},
		{0.05, 0.05, "0.05"},
		{1500, 500, "1500"},
		{25000, 5000, "25,000"},
		{-25000, 5000, "-25,000"},
		{4e6, 2e6, "4e6"},
		{0.001, 0, "0.001"},
		{1e-5, 0, "1e-5"},
		{1e6, 0, "1e6"},
		{100000, 0, "100,000"},
	}
	for _, tt := range tests {
		if got := numLabel(tt.v, tt.step); got != tt.want {
			t.Errorf("numLabel(%v, %v) = %q, want %q", tt.v, tt.step, got, tt.want)
		}
	}
}
