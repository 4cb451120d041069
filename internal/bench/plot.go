package bench

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

// SVG renders p as a self-contained SVG document.
func (p Plot) SVG() ([]byte, error) { panic("bench: Plot.SVG not written yet") }

// WritePlot writes p as SVG to dir/name (name ends in .svg).
func WritePlot(dir, name string, p Plot) error { panic("bench: WritePlot not written yet") }

// CDF returns the empirical distribution of samples as a series: X the
// sorted samples, Y the fraction of samples <= X (0..1].
func CDF(name string, samples []float64) Series { panic("bench: CDF not written yet") }
