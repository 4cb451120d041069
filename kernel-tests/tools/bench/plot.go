package bench

import (
	"bytes"
	"encoding/xml"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
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
var palette = []string{
	"#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd",
	"#8c564b", "#e377c2", "#7f7f7f", "#bcbd22", "#17becf",
}

var dashes = []string{"", "6 3", "2 3", "8 3 2 3"}

// Geometry of the figure in pixels. Text widths are estimated from the
// number of characters (no font metrics without a renderer): charW is on
// the generous side for 12 px sans-serif, so that labels do not collide.
const (
	plotW    = 560.0
	plotH    = 340.0
	marginT  = 44.0
	marginB  = 56.0
	marginR  = 16.0
	fontSize = 12.0
	charW    = 7.0
	legendDY = 20.0
	// maxMarkers: past this many points a line is drawn without markers,
	// which would merge into a thick smear and only grow the file.
	maxMarkers = 100
)

// SVG renders p as a self-contained SVG document.
//
// Points that a log axis cannot show (zero, negative) and points that are
// not finite are left out rather than drawn at NaN coordinates: a latency
// CDF may well contain a 0. A plot with nothing left to draw still renders,
// as an empty frame that says "no data".
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
	pts := make([][][2]float64, len(p.Series))
	var xv, yv []float64
	for i, s := range p.Series {
		for j := range min(len(s.X), len(s.Y)) {
			x, y := s.X[j], s.Y[j]
			if !xs.drawable(x) || !ys.drawable(y) {
				continue
			}
			pts[i] = append(pts[i], [2]float64{x, y})
			xv = append(xv, x)
			yv = append(yv, y)
		}
	}
	empty := len(xv) == 0
	// A step function is cumulative: its axis starts at 0 so that the
	// first riser shows the share below the smallest sample.
	xa := newAxis(xs, xv, false)
	ya := newAxis(ys, yv, p.Step)

	// Left of the frame: the rotated Y label, a gap, the widest tick label.
	left := 24.0 + 14.0
	if !empty {
		w := 0
		for _, t := range ya.ticks {
			w = max(w, len(t.label))
		}
		left += float64(w) * charW
	}
	nameW := 0
	for i, s := range p.Series {
		nameW = max(nameW, len([]rune(legendName(s, len(pts[i]) > 0))))
	}
	legendX := left + plotW + 20
	width := legendX + marginR
	if len(p.Series) > 0 {
		width += 32 + float64(nameW)*charW
	}
	height := max(marginT+plotH+marginB, marginT+float64(len(p.Series))*legendDY+8)
	px := func(x float64) float64 { return left + xa.frac(x)*plotW }
	py := func(y float64) float64 { return marginT + (1-ya.frac(y))*plotH }

	var b bytes.Buffer
	b.WriteString(`<?xml version="1.0" encoding="UTF-8" standalone="no"?>` + "\n")
	fmt.Fprintf(&b, `<svg xmlns="http://www.w3.org/2000/svg" version="1.1" width="%s" height="%s" viewBox="0 0 %s %s" font-family="DejaVu Sans, Helvetica, Arial, sans-serif" font-size="%s">`+"\n",
		num(width), num(height), num(width), num(height), num(fontSize))
	b.WriteString("<title>")
	text(&b, p.Title)
	b.WriteString("</title>\n")
	fmt.Fprintf(&b, `<rect width="%s" height="%s" fill="#ffffff"/>`+"\n", num(width), num(height))
	fmt.Fprintf(&b, `<text class="title" x="%s" y="%s" text-anchor="middle" font-size="15" font-weight="bold">`, num(left+plotW/2), num(marginT-18))
	text(&b, p.Title)
	b.WriteString("</text>\n")

	// Grid and ticks, under the data.
	b.WriteString(`<g class="axes" stroke="#000000" stroke-width="1">` + "\n")
	if !empty {
		for _, t := range xa.ticks {
			x := left + xa.fracT(t.pos)*plotW
			line(&b, x, marginT, x, marginT+plotH, ` stroke="#e6e6e6"`)
			line(&b, x, marginT+plotH, x, marginT+plotH+6, "")
		}
		for _, m := range xa.minor {
			x := left + xa.fracT(m)*plotW
			line(&b, x, marginT+plotH, x, marginT+plotH+3, "")
		}
		for _, t := range ya.ticks {
			y := marginT + (1-ya.fracT(t.pos))*plotH
			line(&b, left, y, left+plotW, y, ` stroke="#e6e6e6"`)
			line(&b, left-6, y, left, y, "")
		}
		for _, m := range ya.minor {
			y := marginT + (1-ya.fracT(m))*plotH
			line(&b, left-3, y, left, y, "")
		}
	}
	fmt.Fprintf(&b, `<rect x="%s" y="%s" width="%s" height="%s" fill="none"/>`+"\n", num(left), num(marginT), num(plotW), num(plotH))
	b.WriteString("</g>\n")

	b.WriteString(`<g class="ticklabels" fill="#000000">` + "\n")
	if !empty {
		for _, t := range xa.ticks {
			if t.label == "" {
				continue
			}
			fmt.Fprintf(&b, `<text x="%s" y="%s" text-anchor="middle">`, num(left+xa.fracT(t.pos)*plotW), num(marginT+plotH+20))
			text(&b, t.label)
			b.WriteString("</text>\n")
		}
		for _, t := range ya.ticks {
			if t.label == "" {
				continue
			}
			fmt.Fprintf(&b, `<text x="%s" y="%s" text-anchor="end">`, num(left-9), num(marginT+(1-ya.fracT(t.pos))*plotH+4))
			text(&b, t.label)
			b.WriteString("</text>\n")
		}
	}
	b.WriteString("</g>\n")
	fmt.Fprintf(&b, `<text class="xlabel" x="%s" y="%s" text-anchor="middle">`, num(left+plotW/2), num(marginT+plotH+44))
	text(&b, p.XLabel)
	b.WriteString("</text>\n")
	ylx, yly := 16.0, marginT+plotH/2
	fmt.Fprintf(&b, `<text class="ylabel" x="%s" y="%s" text-anchor="middle" transform="rotate(-90 %s %s)">`, num(ylx), num(yly), num(ylx), num(yly))
	text(&b, p.YLabel)
	b.WriteString("</text>\n")
	if empty {
		fmt.Fprintf(&b, `<text class="nodata" x="%s" y="%s" text-anchor="middle" font-size="16" fill="#7f7f7f">no data</text>`+"\n",
			num(left+plotW/2), num(marginT+plotH/2))
	}

	for i, s := range p.Series {
		colour, dash := style(i)
		fmt.Fprintf(&b, `<g class="series" stroke="%s" fill="none" stroke-width="1.75"`, colour)
		if dash != "" {
			fmt.Fprintf(&b, ` stroke-dasharray="%s"`, dash)
		}
		b.WriteString(">\n<title>")
		text(&b, s.Name)
		b.WriteString("</title>\n")
		ps := pts[i]
		if len(ps) > 0 {
			var d strings.Builder
			x0, y0 := px(ps[0][0]), py(ps[0][1])
			if p.Step && ys == linear && ya.lo == 0 {
				// The empirical CDF is 0 left of the smallest sample: rise
				// from the floor so the first step reads as a jump.
				fmt.Fprintf(&d, "M%s %sV%s", num(x0), num(py(0)), num(y0))
			} else {
				fmt.Fprintf(&d, "M%s %s", num(x0), num(y0))
			}
			for _, q := range ps[1:] {
				if p.Step {
					fmt.Fprintf(&d, "H%sV%s", num(px(q[0])), num(py(q[1])))
				} else {
					fmt.Fprintf(&d, "L%s %s", num(px(q[0])), num(py(q[1])))
				}
			}
			fmt.Fprintf(&b, `<path d="%s"/>`+"\n", d.String())
			// A single point makes no line: give it a marker even in a
			// step plot, or it would not show at all.
			if (!p.Step && len(ps) <= maxMarkers) || len(ps) == 1 {
				for _, q := range ps {
					fmt.Fprintf(&b, `<circle cx="%s" cy="%s" r="2.5" fill="%s" stroke="none"/>`+"\n", num(px(q[0])), num(py(q[1])), colour)
				}
			}
		}
		b.WriteString("</g>\n")
	}

	if len(p.Series) > 0 {
		b.WriteString(`<g class="legend">` + "\n")
		for i, s := range p.Series {
			colour, dash := style(i)
			y := marginT + 8 + float64(i)*legendDY
			b.WriteString(`<g class="legend-entry">`)
			attrs := fmt.Sprintf(` stroke="%s" stroke-width="2"`, colour)
			if dash != "" {
				attrs += fmt.Sprintf(` stroke-dasharray="%s"`, dash)
			}
			line(&b, legendX, y, legendX+24, y, attrs)
			if !p.Step {
				fmt.Fprintf(&b, `<circle cx="%s" cy="%s" r="2.5" fill="%s"/>`, num(legendX+12), num(y), colour)
			}
			fmt.Fprintf(&b, `<text x="%s" y="%s">`, num(legendX+32), num(y+4))
			text(&b, legendName(s, len(pts[i]) > 0))
			b.WriteString("</text></g>\n")
		}
		b.WriteString("</g>\n")
	}
	b.WriteString("</svg>\n")
	return b.Bytes(), nil
}

// legendName is what the legend says of s: its name, and that nothing of
// it could be drawn when that is so, lest a missing line look like a
// line hidden under another.
func legendName(s Series, drawn bool) string {
	if drawn {
		return s.Name
	}
	return s.Name + " (no data)"
}

func style(i int) (colour, dash string) {
	return palette[i%len(palette)], dashes[(i/len(palette))%len(dashes)]
}

// line writes one line from (x1, y1) to (x2, y2); attrs, if any, starts
// with a space.
func line(b *bytes.Buffer, x1, y1, x2, y2 float64, attrs string) {
	fmt.Fprintf(b, `<line x1="%s" y1="%s" x2="%s" y2="%s"%s/>`+"\n", num(x1), num(y1), num(x2), num(y2), attrs)
}

// text writes s escaped for XML character data. EscapeText writes to a
// bytes.Buffer, which cannot fail.
func text(b *bytes.Buffer, s string) { xml.EscapeText(b, []byte(s)) }

// num formats a coordinate to 0.1 px: finer is invisible, and a fixed
// precision keeps the output the same bytes for the same plot.
func num(v float64) string {
	r := math.Round(v*10) / 10
	if r == 0 {
		r = 0 // no "-0"
	}
	return strconv.FormatFloat(r, 'f', -1, 64)
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

func (a axis) frac(v float64) float64 { return a.fracT(a.s.t(v)) }

func (a axis) fracT(t float64) float64 { return (t - a.lo) / (a.hi - a.lo) }

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
