package bench

import (
	"bytes"
	"fmt"
	"image/color"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"gonum.org/v1/plot"
	"gonum.org/v1/plot/plotter"
	"gonum.org/v1/plot/vg"
	"gonum.org/v1/plot/vg/draw"
	"gonum.org/v1/plot/vg/vgsvg"
)

// Series is one line of a plot: points (X[i], Y[i]), drawn in order.
type Series struct {
	Name string
	X, Y []float64
}

// Plot is one figure: a latency CDF (Step true, from CDF) or a scaling
// curve. LogX/LogY choose logarithmic axes (base 2 for X when LogX2 is set,
// so that node counts 16..4096 fall on even steps).
type Plot struct {
	Title, XLabel, YLabel string
	LogX, LogX2, LogY     bool
	Step                  bool
	Series                []Series
}

// palette is the colours of the series, in order (matplotlib's tab10, chosen
// to stay distinguishable side by side). Past its end the colours repeat
// with the next pattern of dashes, so that series 0 and 10 still differ.
var palette = []color.RGBA{
	{0x1f, 0x77, 0xb4, 255}, {0xff, 0x7f, 0x0e, 255}, {0x2c, 0xa0, 0x2c, 255}, {0xd6, 0x27, 0x28, 255}, {0x94, 0x67, 0xbd, 255},
	{0x8c, 0x56, 0x4b, 255}, {0xe3, 0x77, 0xc2, 255}, {0x7f, 0x7f, 0x7f, 255}, {0xbc, 0xbd, 0x22, 255}, {0x17, 0xbe, 0xcf, 255},
}

var dashes = [][]vg.Length{nil, {6, 3}, {2, 3}, {8, 3, 2, 3}}

// maxMarkers: past this many points a line is drawn without markers,
// which would merge into a thick smear and only grow the file.
const maxMarkers = 100

// gonum's default face is a serif one, whose thin digits read worse in
// small tick labels; its defaults are globals, and only bench draws plots.
func init() { plot.DefaultFont.Variant, plotter.DefaultFont.Variant = "Sans", "Sans" }

// SVG renders p as an SVG document.
//
// Points that a log axis cannot show (zero, negative) and points that are
// not finite are left out: a latency CDF may well contain a 0. A plot with
// nothing left to draw still renders, as an empty frame that says "no data".
func (p Plot) SVG() ([]byte, error) {
	xs, ys := linear, linear
	if p.LogX {
		xs = log10
	}
	if p.LogX2 {
		xs = log2
	}
	if p.LogY {
		ys = log10
	}
	g := plot.New()
	g.Title.Padding = vg.Points(8)
	g.Title.Text, g.X.Label.Text, g.Y.Label.Text = p.Title, p.XLabel, p.YLabel
	g.Add(plotter.NewGrid())
	legend := plot.NewLegend()
	legend.Top, legend.Left, legend.Padding = true, true, vg.Points(4)
	var xv, yv []float64
	for i, s := range p.Series {
		var xy plotter.XYs
		for j := range min(len(s.X), len(s.Y)) {
			if xs.drawable(s.X[j]) && ys.drawable(s.Y[j]) {
				xy = append(xy, plotter.XY{X: s.X[j], Y: s.Y[j]})
				xv, yv = append(xv, s.X[j]), append(yv, s.Y[j])
			}
		}
		if len(xy) == 0 {
			// Say so, lest a missing line look like one hidden under another.
			legend.Add(s.Name + " (no data)")
			continue
		}
		if p.Step && ys == linear {
			// The empirical CDF is 0 left of the smallest sample: rise from
			// the floor so the first step reads as a jump.
			xy = append(plotter.XYs{{X: xy[0].X, Y: 0}}, xy...)
		}
		l, err := plotter.NewLine(xy)
		if err != nil {
			return nil, err
		}
		l.Color, l.Dashes = palette[i%len(palette)], dashes[(i/len(palette))%len(dashes)]
		l.Width = vg.Points(1.3)
		if p.Step {
			l.StepStyle = plotter.PostStep
		}
		g.Add(l)
		thumbs := []plot.Thumbnailer{l}
		// A single point makes no line: give it a marker even in a step
		// plot, or it would not show at all.
		if (!p.Step && len(xy) <= maxMarkers) || len(xy) == 1 {
			m, err := plotter.NewScatter(xy)
			if err != nil {
				return nil, err
			}
			m.Color, m.Shape, m.Radius = l.Color, draw.CircleGlyph{}, vg.Points(2)
			g.Add(m)
			thumbs = append(thumbs, m)
		}
		legend.Add(s.Name, thumbs...)
	}
	// A step function is cumulative: its axis starts at 0 so that the
	// first riser shows the share below the smallest sample.
	xa, ya := newAxis(xs, xv, false), newAxis(ys, yv, p.Step)
	xa.set(&g.X)
	ya.set(&g.Y)
	if len(xv) == 0 {
		l, err := plotter.NewLabels(plotter.XYLabels{
			XYs: []plotter.XY{{X: xa.s.v((xa.lo + xa.hi) / 2), Y: ya.s.v((ya.lo + ya.hi) / 2)}}, Labels: []string{"no data"}})
		if err != nil {
			return nil, err
		}
		l.TextStyle[0].XAlign, l.TextStyle[0].Color = draw.XCenter, palette[7]
		g.Add(l)
	}

	const w, h = 7 * vg.Inch, 4 * vg.Inch
	lr := legend.Rectangle(draw.New(vgsvg.New(w, h))).Size()
	// The widths are Liberation Sans's: leave room for a wider font where
	// the viewer has not got that one.
	lw := lr.X*1.2 + 0.3*vg.Inch
	c := vgsvg.New(w+lw, max(h, lr.Y+vg.Inch))
	dc := draw.New(c)
	dc.SetColor(color.White)
	dc.Fill(dc.Rectangle.Path())
	// gonum makes room for the Y label as if it stood at the arithmetic
	// mean of the range, which on a log axis is near the top, and shrinks
	// the plot for it: draw the label here instead.
	area := draw.Crop(dc, 0, -lw, 0, 0)
	ly := g.Y.Label.TextStyle
	ly.Rotation, ly.XAlign, ly.YAlign = math.Pi/2, draw.XCenter, draw.YTop
	area.FillText(ly, vg.Point{X: area.Min.X + 2, Y: area.Center().Y}, p.YLabel)
	g.Y.Label.Text = ""
	g.Draw(draw.Crop(area, ly.Height(p.YLabel)+6, 0, 0, 0))
	legend.Draw(draw.Crop(dc, w+0.15*vg.Inch, 0, 0, -0.3*vg.Inch))
	var b bytes.Buffer
	if _, err := c.WriteTo(&b); err != nil {
		return nil, err
	}
	return b.Bytes(), nil
}

// set gives a gonum axis this axis's range and ticks.
func (a axis) set(g *plot.Axis) {
	g.Min, g.Max = a.s.v(a.lo), a.s.v(a.hi)
	if a.s != linear {
		g.Scale = plot.LogScale{}
	}
	var ts plot.ConstantTicks
	for _, t := range a.ticks {
		ts = append(ts, plot.Tick{Value: a.s.v(t.pos), Label: t.label})
	}
	for _, m := range a.minor {
		ts = append(ts, plot.Tick{Value: a.s.v(m)})
	}
	g.Tick.Marker = ts
}

// v is the inverse of t.
func (s scale) v(t float64) float64 {
	switch s {
	case log10:
		return math.Pow(10, t)
	case log2:
		return math.Pow(2, t)
	}
	return t
}

// WritePlot writes p as SVG to dir/name (name ends in .svg).
func WritePlot(dir, name string, p Plot) error {
	b, err := p.SVG()
	if err != nil {
		return fmt.Errorf("bench: plot %s: %w", name, err)
	}
	return os.WriteFile(filepath.Join(dir, name), b, 0o644)
}

// CDF returns the empirical distribution of samples as a series: X the
// sorted samples, Y the fraction of samples <= X (0..1].
//
// NaN samples are dropped (they are no measurement; Percentile would sort
// them first), and the fractions are of the samples that remain.
func CDF(name string, samples []float64) Series {
	x := make([]float64, 0, len(samples))
	for _, v := range samples {
		if !math.IsNaN(v) {
			x = append(x, v)
		}
	}
	slices.Sort(x)
	y := make([]float64, len(x))
	for i := range y {
		y[i] = float64(i+1) / float64(len(x))
	}
	return Series{Name: name, X: x, Y: y}
}

// scale is how an axis maps values to positions.
type scale int

const (
	linear scale = iota
	log10
	log2
)

func (s scale) drawable(v float64) bool {
	if math.IsNaN(v) || math.IsInf(v, 0) {
		return false
	}
	return s == linear || v > 0
}

// t maps a value into the space in which the axis is linear.
func (s scale) t(v float64) float64 {
	switch s {
	case log10:
		return math.Log10(v)
	case log2:
		return math.Log2(v)
	}
	return v
}

// axis is one axis: its range [lo, hi] and ticks, all in transformed space
// (exponents for a log axis).
type axis struct {
	s      scale
	lo, hi float64
	ticks  []tick
	minor  []float64
}

type tick struct {
	pos   float64
	label string
}

// newAxis fits an axis to the values vs (all drawable on s). With zero set,
// a linear axis of non-negative values starts at 0.
func newAxis(s scale, vs []float64, zero bool) axis {
	if len(vs) == 0 {
		return axis{s: s, lo: 0, hi: 1}
	}
	lo, hi := slices.Min(vs), slices.Max(vs)
	if s == linear {
		return linearAxis(lo, hi, zero)
	}
	base := 10.0
	if s == log2 {
		base = 2
	}
	a := axis{s: s, lo: floorLog(lo, base), hi: ceilLog(hi, base)}
	if a.lo == a.hi {
		a.lo--
		a.hi++
	}
	n := int(a.hi - a.lo)
	// At most about a dozen labels fit under 560 px; past that, label
	// every k-th power and leave the others as bare ticks.
	every := (n + 11) / 12
	for k := int(a.lo); k <= int(a.hi); k++ {
		t := tick{pos: float64(k)}
		if (k-int(a.lo))%every == 0 {
			t.label = powLabel(base, k)
		}
		a.ticks = append(a.ticks, t)
	}
	if s == log10 && n <= 8 {
		for k := int(a.lo); k < int(a.hi); k++ {
			for m := 2; m <= 9; m++ {
				pos := float64(k) + math.Log10(float64(m))
				// With two decades or fewer the decades alone are too few
				// labels to read a value off: label 2 and 5 as well.
				if n <= 2 && (m == 2 || m == 5) {
					a.ticks = append(a.ticks, tick{pos: pos, label: numLabel(float64(m)*math.Pow10(k), 0)})
				} else {
					a.minor = append(a.minor, pos)
				}
			}
		}
		slices.SortFunc(a.ticks, func(x, y tick) int { return cmpFloat(x.pos, y.pos) })
	}
	return a
}

func cmpFloat(a, b float64) int {
	switch {
	case a < b:
		return -1
	case a > b:
		return 1
	}
	return 0
}

// floorLog is the largest k with base^k <= v, exact at powers of base
// (math.Log10(1000) need not be exactly 3).
func floorLog(v, base float64) float64 {
	if !(v > 0) || math.IsInf(v, 0) {
		return 0 // not drawable on a log axis; callers leave such values out
	}
	k := math.Floor(math.Log(v) / math.Log(base))
	for math.Pow(base, k) > v {
		k--
	}
	for math.Pow(base, k+1) <= v {
		k++
	}
	return k
}

// ceilLog is the smallest k with base^k >= v.
func ceilLog(v, base float64) float64 {
	k := floorLog(v, base)
	if math.Pow(base, k) < v {
		k++
	}
	return k
}

// linearAxis spans [lo, hi] in round steps of 1, 2 or 5 times a power of
// ten, about five to ten of them.
func linearAxis(lo, hi float64, zero bool) axis {
	if lo >= 0 && (zero || lo < hi/2) {
		// Positive values close to zero read best against a zero baseline;
		// values far from it would be squashed into a flat line.
		lo = 0
	}
	if lo == hi {
		d := math.Abs(lo) / 10
		if d == 0 {
			d = 1
		}
		if lo >= 0 && lo-d < 0 {
			lo, hi = 0, hi+d
		} else {
			lo, hi = lo-d, hi+d
		}
	}
	step := niceStep((hi - lo) / 5)
	k0, k1 := math.Floor(lo/step+1e-9), math.Ceil(hi/step-1e-9)
	a := axis{s: linear, lo: k0 * step, hi: k1 * step}
	for k := k0; k <= k1; k++ {
		v := k * step
		a.ticks = append(a.ticks, tick{pos: v, label: numLabel(v, step)})
	}
	return a
}

// niceStep is the smallest of 1, 2, 5 times a power of ten that is >= raw.
func niceStep(raw float64) float64 {
	e := math.Pow10(int(math.Floor(math.Log10(raw))))
	for _, m := range []float64{1, 2, 5, 10} {
		if m*e >= raw*(1-1e-9) {
			return m * e
		}
	}
	return 10 * e
}

// powLabel labels base^k: powers of two as integers (node counts), powers
// of ten in decimal where that stays short.
func powLabel(base float64, k int) string {
	if base == 2 {
		if k >= 0 && k <= 30 {
			return numLabel(float64(int64(1)<<k), 1)
		}
		return "2^" + strconv.Itoa(k)
	}
	return numLabel(math.Pow10(k), 0)
}

// numLabel formats a tick value; step is the distance between ticks (0 on
// a log axis), which says how many decimals are needed to tell ticks apart.
func numLabel(v, step float64) string {
	if v == 0 {
		return "0"
	}
	mag := math.Abs(v)
	if step != 0 {
		mag = step
	}
	if mag >= 1e6 || mag < 1e-4 {
		// 1e+06 → 1e6: short, and unambiguous to a reader of plots.
		s := strconv.FormatFloat(v, 'g', 3, 64)
		s = strings.Replace(s, "e+", "e", 1)
		s = strings.Replace(s, "e-0", "e-", 1)
		return strings.Replace(s, "e0", "e", 1)
	}
	dec := 0
	if step != 0 {
		dec = max(0, -int(math.Floor(math.Log10(step)+1e-9)))
	} else if mag < 1 {
		dec = -int(math.Floor(math.Log10(mag) + 1e-9))
	}
	s := strconv.FormatFloat(v, 'f', dec, 64)
	if strings.Contains(s, ".") {
		// 1 beside 0.8, not 1.0: the zeros add width and nothing else.
		s = strings.TrimRight(strings.TrimRight(s, "0"), ".")
	}
	if math.Abs(v) >= 10000 {
		return commas(s)
	}
	return s
}

// commas groups the integer digits of a formatted number in threes.
func commas(s string) string {
	sign := ""
	if strings.HasPrefix(s, "-") {
		sign, s = "-", s[1:]
	}
	frac := ""
	if i := strings.IndexByte(s, '.'); i >= 0 {
		s, frac = s[:i], s[i:]
	}
	var b strings.Builder
	for i, c := range s {
		if i > 0 && (len(s)-i)%3 == 0 {
			b.WriteByte(',')
		}
		b.WriteRune(c)
	}
	return sign + b.String() + frac
}
