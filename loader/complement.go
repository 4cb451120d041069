package loader

import (
	"context"
	"errors"
)

// Complemented is the BPF observer on a kernel that cannot adopt
// (Features.Adoption false: iter/tcp does not load): a sock_diag observer
// of the same cgroups adds to each Snapshot the connections the programs
// never registered (made before their cgroup was watched), uncounted, so
// that the kernel check still sees every connection of the job (G1 in
// docs/guarantees.md). What such a connection lacks is only the byte
// counts, so bytes sent through a closed gate on it are not detected.
type Complemented struct {
	*BPFObserver
	diag *SockDiagObserver
}

var (
	_ Observer = (*Complemented)(nil)
	_ Watcher  = (*Complemented)(nil)
)

// openComplemented is OpenBPF, complemented where the kernel cannot adopt.
func openComplemented(ctx context.Context, cfg Config) (Observer, error) {
	b, err := OpenBPF(ctx, cfg)
	if err != nil {
		return nil, err
	}
	if b.Features().Adoption {
		return b, nil
	}
	dcfg := cfg
	dcfg.Pin, dcfg.Cgroup, dcfg.Cgroups = false, "", b.Watched()
	d, err := OpenSockDiag(ctx, dcfg)
	if err != nil {
		b.Close()
		return nil, err
	}
	return &Complemented{BPFObserver: b, diag: d}, nil
}

// Snapshot is the BPF observer's Snapshot and every connection sock_diag
// finds in the watched cgroups that the BPF observer does not have.
func (c *Complemented) Snapshot(ctx context.Context) ([]Conn, error) {
	cs, err := c.BPFObserver.Snapshot(ctx)
	if err != nil {
		return nil, err
	}
	ds, err := c.diag.Snapshot(ctx)
	if err != nil {
		return nil, err
	}
	have := make(map[uint64]bool, len(cs))
	for _, x := range cs {
		have[x.Cookie] = true
	}
	for _, x := range ds {
		if !have[x.Cookie] {
			cs = append(cs, x)
		}
	}
	return cs, nil
}

// Watch watches dir with both observers.
func (c *Complemented) Watch(dir string) error {
	if err := c.BPFObserver.Watch(dir); err != nil {
		return err
	}
	if err := c.diag.Watch(dir); err != nil {
		c.BPFObserver.Unwatch(dir)
		return err
	}
	return nil
}

// Unwatch lets dir go from both observers.
func (c *Complemented) Unwatch(dir string) error {
	return errors.Join(c.BPFObserver.Unwatch(dir), c.diag.Unwatch(dir))
}

// Skipped is what either observer could not see.
func (c *Complemented) Skipped() []string {
	return append(c.BPFObserver.Skipped(), c.diag.Skipped()...)
}

// Close closes both.
func (c *Complemented) Close() error {
	return errors.Join(c.BPFObserver.Close(), c.diag.Close())
}
