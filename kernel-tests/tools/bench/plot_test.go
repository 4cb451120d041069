package bench

import (
	"bytes"
	"encoding/xml"
	"errors"
	"io"
	"math"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"
	"github.com/google/go-cmp/cmp/cmpopts"
)

// svgDoc is what the tests read back out of a rendered plot.
type svgDoc struct {
	root      string
	title     string   // the <title> of the document
	series    []int    // per <g class="series">, how many <path> it holds
	legend    []string // the text of each legend entry
	ticks     []string // tick labels, x then y
	noData    bool     // the "no data" note is there
	badNumber []string // coordinates that are not finite numbers
}

// geometry is every attribute that holds a coordinate or a length.
var geometry = map[string]bool{
	"x": true, "y": true, "x1": true, "y1": true, "x2": true, "y2": true,
	"cx": true, "cy": true, "r": true, "width": true, "height": true,
}

// parseSVG decodes an SVG document completely, which fails on any XML that
// is not well-formed, and collects what the tests check.
func parseSVG(t *testing.T, b []byte) svgDoc {
	t.Helper()
	var doc svgDoc
	d := xml.NewDecoder(bytes.NewReader(b))
	var stack []string // class of each open element, "" for none
	inside := func(class string) bool {
		for _, c := range stack {
			if c == class {
				return true
			}
		}
		return false
	}
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
			class := ""
			for _, a := range tok.Attr {
				switch {
				case a.Name.Local == "class":
					class = a.Value
				case geometry[a.Name.Local]:
					if v, err := strconv.ParseFloat(a.Value, 64); err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
						doc.badNumber = append(doc.badNumber, tok.Name.Local+" "+a.Name.Local+"="+a.Value)
					}
				case a.Name.Local == "d":
					for _, f := range strings.FieldsFunc(a.Value, func(r rune) bool { return strings.ContainsRune("MLHV ", r) }) {
						if v, err := strconv.ParseFloat(f, 64); err != nil || math.IsNaN(v) || math.IsInf(v, 0) {
							doc.badNumber = append(doc.badNumber, "path d "+f)
						}
					}
				}
			}
			if class == "series" {
				doc.series = append(doc.series, 0)
			}
			if tok.Name.Local == "path" && inside("series") {
				doc.series[len(doc.series)-1]++
			}
			stack = append(stack, class)
			text.Reset()
		case xml.CharData:
			text.Write(tok)
		case xml.EndElement:
			s := text.String()
			switch {
			case tok.Name.Local == "title" && len(stack) == 2:
				doc.title = s
			case tok.Name.Local == "text" && inside("legend-entry"):
				doc.legend = append(doc.legend, s)
			case tok.Name.Local == "text" && inside("ticklabels"):
				doc.ticks = append(doc.ticks, s)
			case stack[len(stack)-1] == "nodata":
				doc.noData = s == "no data"
			}
			stack = stack[:len(stack)-1]
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
		wantSeries []int // paths per series
		wantLegend []string
		wantNoData bool
	}{
		{
			name: "latency CDF on log x with zero samples",
			plot: Plot{Title: "Stop latency", XLabel: "ms (log)", YLabel: "fraction", LogX: true, Step: true, Series: []Series{
				CDF("mpipause pause", []float64{0, 0, 1.5, 2, 3, 12}),
				CDF("SIGSTOP", []float64{0.1, 0.2, 0.2, 0.4}),
			}},
			wantSeries: []int{1, 1},
			wantLegend: []string{"mpipause pause", "SIGSTOP"},
		},
		{
			name: "scaling on log2 x and log y",
			plot: Plot{Title: "Scale", XLabel: "nodes", YLabel: "ms", LogX2: true, LogY: true, Series: []Series{
				{Name: "broadcast", X: nodes, Y: []float64{1, 2, 4, 8, 16, 32, 64, 128, 256}},
				{Name: "tree", X: nodes, Y: []float64{0, 1, 1.2, 1.4, 1.6, 1.8, 2, 2.2, 2.4}},
			}},
			wantSeries: []int{1, 1},
			wantLegend: []string{"broadcast", "tree"},
		},
		{
			name: "NaN and Inf left out on linear axes",
			plot: Plot{Title: "Holes", Series: []Series{
				{Name: "a", X: []float64{1, 2, math.NaN(), 4, 5}, Y: []float64{1, math.Inf(1), 3, math.Inf(-1), 5}},
			}},
			wantSeries: []int{1},
			wantLegend: []string{"a"},
		},
		{
			name: "names and title escaped",
			plot: Plot{Title: `<b>"all" & 'some'</b>`, XLabel: "a<b", YLabel: "c&d", Series: []Series{
				{Name: "x < y & z", X: []float64{1, 2}, Y: []float64{3, 4}},
			}},
			wantSeries: []int{1},
			wantLegend: []string{"x < y & z"},
		},
		{
			name: "only zeros on log axes: no data",
			plot: Plot{Title: "Nothing", LogX: true, LogY: true, Step: true, Series: []Series{
				CDF("zeros", []float64{0, 0, 0}),
				{Name: "negative", X: []float64{-1}, Y: []float64{-1}},
			}},
			wantSeries: []int{0, 0},
			wantLegend: []string{"zeros (no data)", "negative (no data)"},
			wantNoData: true,
		},
		{
			name: "one series drawable, one not",
			plot: Plot{Title: "Half", LogX: true, Series: []Series{
				{Name: "ok", X: []float64{1, 10}, Y: []float64{1, 2}},
				{Name: "empty"},
			}},
			wantSeries: []int{1, 0},
			wantLegend: []string{"ok", "empty (no data)"},
		},
		{
			name:       "no series at all",
			plot:       Plot{Title: "Empty"},
			wantNoData: true,
		},
		{
			name:       "one point, constant values",
			plot:       Plot{Title: "Dot", LogX: true, LogY: true, Series: []Series{{Name: "p", X: []float64{10}, Y: []float64{10}}}},
			wantSeries: []int{1},
			wantLegend: []string{"p"},
		},
		{
			name:       "more series than colours",
			plot:       Plot{Title: "Many", Series: manySeries(13)},
			wantSeries: []int{1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1},
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
			if doc.title != tt.plot.Title {
				t.Errorf("title = %q, want %q", doc.title, tt.plot.Title)
			}
			if diff := cmp.Diff(tt.wantSeries, doc.series, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("paths per series (-want +got):\n%s", diff)
			}
			if diff := cmp.Diff(tt.wantLegend, doc.legend, cmpopts.EquateEmpty()); diff != "" {
				t.Errorf("legend (-want +got):\n%s", diff)
			}
			if doc.noData != tt.wantNoData {
				t.Errorf("no data note = %v, want %v", doc.noData, tt.wantNoData)
			}
			if len(doc.badNumber) > 0 {
				t.Errorf("coordinates that are not finite numbers: %q", doc.badNumber)
			}
			if !tt.wantNoData && len(doc.ticks) < 4 {
				t.Errorf("tick labels = %q, want at least two per axis", doc.ticks)
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
			if diff := cmp.Diff(tt.want, parseSVG(t, b).ticks); diff != "" {
				t.Errorf("tick labels (-want +got):\n%s", diff)
			}
		})
	}
}

// TestSVGStep checks that a step plot draws only horizontal and vertical
// segments and a line plot straight segments with a marker on each point.
func TestSVGStep(t *testing.T) {
	s := Series{Name: "s", X: []float64{1, 2, 3, 4}, Y: []float64{0.25, 0.5, 0.75, 1}}
	step, _ := Plot{Step: true, Series: []Series{s}}.SVG()
	d := pathData(t, step)
	if strings.ContainsAny(d, "L") || strings.Count(d, "H") != 3 || strings.Count(d, "V") != 4 {
		t.Errorf("step path = %q, want M, a riser from 0, then H and V per point", d)
	}
	if n := bytes.Count(step, []byte("<circle")); n != 0 {
		t.Errorf("step plot has %d markers, want none", n)
	}
	line, _ := Plot{Series: []Series{s}}.SVG()
	d = pathData(t, line)
	if strings.ContainsAny(d, "HV") || strings.Count(d, "L") != 3 {
		t.Errorf("line path = %q, want M then L per point", d)
	}
	// 4 points, and one marker in the legend.
	if n := bytes.Count(line, []byte("<circle")); n != 5 {
		t.Errorf("line plot has %d markers, want 5", n)
	}
}

func pathData(t *testing.T, svg []byte) string {
	t.Helper()
	_, rest, ok := bytes.Cut(svg, []byte(`<path d="`))
	if !ok {
		t.Fatalf("no path in %s", svg)
	}
	d, _, _ := bytes.Cut(rest, []byte(`"`))
	return string(d)
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
