package metrics

import (
	"context"
	"errors"
	"fmt"
	"log/slog"
	"net"
	"net/http"
	"strconv"
	"time"

	"github.com/prometheus/client_golang/prometheus/promhttp"
	"golang.org/x/time/rate"
)

// Path is where the metrics are served.
const Path = "/metrics"

// ExampleAddr is the address the documentation suggests: this node only.
// mpid's peer port is 7170; 9717 is in the range Prometheus exporters use.
const ExampleAddr = "127.0.0.1:9717"

// CheckAddr checks a --metrics-listen address: host:port with an explicit
// host. A bare ":PORT", which Go would serve on every interface, is refused:
// metrics tell who runs which jobs when, so serving them beyond the node
// must be asked for by name (0.0.0.0:PORT or [::]:PORT).
func CheckAddr(addr string) error {
	host, port, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("--metrics-listen %q: want HOST:PORT, such as %s", addr, ExampleAddr)
	}
	if host == "" {
		return fmt.Errorf("--metrics-listen %q: no host; write 127.0.0.1:%s for this node only, or 0.0.0.0:%s or [::]:%s to serve every interface", addr, port, port, port)
	}
	if n, err := strconv.Atoi(port); err != nil || n < 1 || n > 65535 {
		return fmt.Errorf("--metrics-listen %q: want a port 1-65535, such as %s", addr, ExampleAddr)
	}
	return nil
}

// Listen opens the metrics address (CheckAddr's rules), so that it is
// listening before mpid says it is ready.
func Listen(addr string) (net.Listener, error) {
	if err := CheckAddr(addr); err != nil {
		return nil, err
	}
	ln, err := net.Listen("tcp", addr)
	if err != nil {
		return nil, fmt.Errorf("metrics %s: %w (another program on that port? give --metrics-listen another)", addr, err)
	}
	return ln, nil
}

// Timeouts of the metrics server: a scrape is one small GET, and a client
// that holds a connection open must not hold mpid's resources.
const (
	readTimeout   = 5 * time.Second
	writeTimeout  = 10 * time.Second
	idleTimeout   = time.Minute
	scrapeTimeout = 5 * time.Second
)

// ScrapeRate bounds the scrapes answered a second, all clients together
// (with a burst of twice that): Prometheus scrapes a target every 15 s or
// so, so even several servers need a fraction of one a second, and each
// scrape costs mpid a walk of its jobs and ranks at its own priority.
// Past it a client gets 429 at once, before anything is collected: a
// flood can leave a scrape unanswered, never take mpid's CPU.
const ScrapeRate rate.Limit = 10

// Handler serves the registry at Path; anything else is 404.
func (m *Metrics) Handler() http.Handler {
	mux := http.NewServeMux()
	h := promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{
		Registry:            m.reg, // promhttp_metric_handler_errors_total
		MaxRequestsInFlight: 4,
		Timeout:             scrapeTimeout,
	})
	limit := rate.NewLimiter(ScrapeRate, int(2*ScrapeRate))
	mux.Handle("GET "+Path, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if !limit.Allow() {
			http.Error(w, fmt.Sprintf("more than %v scrapes a second", ScrapeRate), http.StatusTooManyRequests)
			return
		}
		h.ServeHTTP(w, r)
	}))
	return mux
}

// Serve serves the metrics on ln until ctx ends, then closes it and waits
// (briefly) for the scrapes under way.
func (m *Metrics) Serve(ctx context.Context, ln net.Listener, log *slog.Logger) error {
	srv := &http.Server{
		Handler:           m.Handler(),
		ReadHeaderTimeout: readTimeout,
		ReadTimeout:       readTimeout,
		WriteTimeout:      writeTimeout,
		IdleTimeout:       idleTimeout,
		ErrorLog:          slog.NewLogLogger(log.Handler(), slog.LevelWarn),
	}
	done := make(chan struct{})
	go func() {
		defer close(done)
		<-ctx.Done()
		sctx, cancel := context.WithTimeout(context.Background(), time.Second)
		defer cancel()
		if srv.Shutdown(sctx) != nil {
			srv.Close()
		}
	}()
	err := srv.Serve(ln)
	if errors.Is(err, http.ErrServerClosed) {
		err = nil
	}
	if ctx.Err() == nil {
		// Serve failed on its own; the goroutine ends with ctx (mpid's Run
		// cancels it on the first error of any of its servers).
		return err
	}
	<-done
	return err
}
