package metrics

import (
	"fmt"
	"io"
	"slices"
	"strconv"
	"strings"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

// Samples are the values of one scrape, by series: `name` or
// `name{k="v",...}` with the labels sorted by name; a histogram gives its
// `_count` and `_sum` series and one `_bucket` series per bound (label le).
// For tests and tools that read mpid's metrics back.
type Samples map[string]float64

// Parse reads a scrape in the text exposition format, as a Prometheus
// server would, and fails on anything it would refuse.
func Parse(r io.Reader) (Samples, error) {
	p := expfmt.NewTextParser(model.UTF8Validation)
	fams, err := p.TextToMetricFamilies(r)
	if err != nil {
		return nil, fmt.Errorf("parse metrics: %w", err)
	}
	out := Samples{}
	for name, f := range fams {
		for _, m := range f.GetMetric() {
			switch f.GetType() {
			case dto.MetricType_COUNTER:
				out[Series(name, labels(m)...)] = m.GetCounter().GetValue()
			case dto.MetricType_GAUGE:
				out[Series(name, labels(m)...)] = m.GetGauge().GetValue()
			case dto.MetricType_UNTYPED:
				out[Series(name, labels(m)...)] = m.GetUntyped().GetValue()
			case dto.MetricType_HISTOGRAM:
				h := m.GetHistogram()
				out[Series(name+"_count", labels(m)...)] = float64(h.GetSampleCount())
				out[Series(name+"_sum", labels(m)...)] = h.GetSampleSum()
				for _, b := range h.GetBucket() {
					l := append(labels(m), "le", strconv.FormatFloat(b.GetUpperBound(), 'g', -1, 64))
					out[Series(name+"_bucket", l...)] = float64(b.GetCumulativeCount())
				}
			case dto.MetricType_SUMMARY:
				s := m.GetSummary()
				out[Series(name+"_count", labels(m)...)] = float64(s.GetSampleCount())
				out[Series(name+"_sum", labels(m)...)] = s.GetSampleSum()
			}
		}
	}
	return out, nil
}

func labels(m *dto.Metric) []string {
	var l []string
	for _, p := range m.GetLabel() {
		l = append(l, p.GetName(), p.GetValue())
	}
	return l
}

// Series is the key of a series in Samples: name and label pairs (name,
// value, name, value, ...), in any order.
func Series(name string, kv ...string) string {
	if len(kv) < 2 {
		return name
	}
	var pairs []string
	for i := 0; i+1 < len(kv); i += 2 {
		pairs = append(pairs, kv[i]+"="+strconv.Quote(kv[i+1]))
	}
	slices.Sort(pairs)
	return name + "{" + strings.Join(pairs, ",") + "}"
}
