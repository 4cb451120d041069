// Package metrics holds mpid's Prometheus collectors, on a registry of its
// own (never the global default), and serves them over HTTP. mpid makes one
// Metrics when --metrics-listen is set and passes it to what produces the
// figures (internal/mpid); a nil *Metrics records nothing, so
// instrumented code needs no check of its own when metrics are off.
//
// Job ids are never labels: they are unbounded (every job adds a series that
// would never go away, in mpid and in every Prometheus that scrapes it), and
// the per-job figures are what `mpipause status --json` is for. Every label
// here takes a handful of fixed values.
package metrics
