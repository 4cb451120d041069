package loader

import (
	"errors"
	"fmt"
	"os"

	"github.com/cilium/ebpf"
	"github.com/cilium/ebpf/link"
)

// SignalTimes is when the kernel last generated a SIGTSTP and a SIGCONT for
// a watched process, CLOCK_MONOTONIC nanoseconds (the clock of the shim's
// stamps and of bpf_ktime_get_ns); 0: none since it was watched.
type SignalTimes struct {
	Tstp, Cont int64
}

// SignalClock keeps, in the kernel, the generation times of the SIGTSTP
// and SIGCONT sent to the processes it watches (bpf/signals.bpf.c): one
// program for the whole node, beside the job observers. It orders a stop
// against a continue even where their handlers run the other way round.
// Its methods are safe for concurrent use.
type SignalClock struct {
	objs signalsObjects
	link link.Link
}

// OpenSignalClock loads and attaches the signal clock, watching nothing.
// Without BTF or where the kernel refuses the program it returns ErrNoBTF
// or ErrBPFUnavailable, and the caller goes without (Features.Signals says
// beforehand whether the kernel loads it).
func OpenSignalClock() (*SignalClock, error) {
	if _, err := os.Stat(btfPath); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrNoBTF, err)
	}
	c := &SignalClock{}
	if err := loadSignalsObjects(&c.objs, nil); err != nil {
		return nil, loadError(ProgSignals, err)
	}
	l, err := link.AttachTracing(link.TracingOptions{Program: c.objs.MpipauseSignal})
	if err != nil {
		c.objs.Close()
		return nil, fmt.Errorf("%w: attach %s: %w", ErrBPFUnavailable, ProgSignals, err)
	}
	c.link = l
	return c, nil
}

// Watch starts keeping process pid's times, from none; a pid watched
// already keeps what it has (a rank that registers again). It fails when
// the map is full: that process goes without.
func (c *SignalClock) Watch(pid int) error {
	var zero signalsSignalTimes
	err := c.objs.RankSignals.Update(uint32(pid), &zero, ebpf.UpdateNoExist)
	if errors.Is(err, ebpf.ErrKeyExist) {
		return nil
	}
	return err
}

// Forget stops keeping process pid's times.
func (c *SignalClock) Forget(pid int) {
	c.objs.RankSignals.Delete(uint32(pid))
}

// Last returns process pid's times, and false if it is not watched.
func (c *SignalClock) Last(pid int) (SignalTimes, bool) {
	var v signalsSignalTimes
	if err := c.objs.RankSignals.Lookup(uint32(pid), &v); err != nil {
		return SignalTimes{}, false
	}
	return SignalTimes{Tstp: int64(v.TstpNs), Cont: int64(v.ContNs)}, true
}

// Close detaches the program and frees the map.
func (c *SignalClock) Close() error {
	return errors.Join(c.link.Close(), c.objs.Close())
}
