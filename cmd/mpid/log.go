package main

import (
	"context"
	"fmt"
	"io"
	"log/slog"
	"os"
	"sync"

	"golang.org/x/sys/unix"
)

// newLogHandler is mpid's slog handler on w: key=value lines ("text") or
// JSON lines ("json"). When journal is set, each line starts with the
// syslog priority of its level, "<N>", which journald takes as the entry's
// priority (SyslogLevelPrefix=, on by default: systemd.exec(5)), and has no
// time of its own: journald stamps every line when it reads it.
func newLogHandler(w io.Writer, format string, journal bool) slog.Handler {
	opts := &slog.HandlerOptions{}
	var pw *priorityWriter
	if journal {
		pw = &priorityWriter{w: w}
		w = pw
		opts.ReplaceAttr = func(groups []string, a slog.Attr) slog.Attr {
			if len(groups) == 0 && a.Key == slog.TimeKey {
				return slog.Attr{}
			}
			return a
		}
	}
	var h slog.Handler
	if format == "json" {
		h = slog.NewJSONHandler(w, opts)
	} else {
		h = slog.NewTextHandler(w, opts)
	}
	if pw == nil {
		return h
	}
	return &journalHandler{Handler: h, out: pw}
}

// journalHandler gives each record's line its priority prefix.
type journalHandler struct {
	slog.Handler
	out *priorityWriter // shared by the handlers WithAttrs and WithGroup derive
}

func (h *journalHandler) Handle(ctx context.Context, r slog.Record) error {
	// slog's handlers write each record with one Write: the prefix set
	// here is that record's.
	h.out.mu.Lock()
	defer h.out.mu.Unlock()
	h.out.prefix = fmt.Sprintf("<%d>", syslogPriority(r.Level))
	return h.Handler.Handle(ctx, r)
}

func (h *journalHandler) WithAttrs(as []slog.Attr) slog.Handler {
	return &journalHandler{Handler: h.Handler.WithAttrs(as), out: h.out}
}

func (h *journalHandler) WithGroup(name string) slog.Handler {
	return &journalHandler{Handler: h.Handler.WithGroup(name), out: h.out}
}

// priorityWriter writes each line with the prefix of the record being
// handled (under mu, held by journalHandler.Handle).
type priorityWriter struct {
	mu     sync.Mutex
	w      io.Writer
	prefix string
}

func (p *priorityWriter) Write(b []byte) (int, error) {
	// One write per line: journald reads the stream line by line, and a
	// prefix written apart could be read as a line of its own.
	line := make([]byte, 0, len(p.prefix)+len(b))
	line = append(append(line, p.prefix...), b...)
	if _, err := p.w.Write(line); err != nil {
		return 0, err
	}
	return len(b), nil
}

// syslogPriority maps a slog level to syslog's (sd-daemon(3)): debug 7,
// info 6, warning 4, error 3; levels between take the one below them.
func syslogPriority(l slog.Level) int {
	switch {
	case l < slog.LevelInfo:
		return 7
	case l < slog.LevelWarn:
		return 6
	case l < slog.LevelError:
		return 4
	default:
		return 3
	}
}

// journalStream reports whether f is the journal's stream: systemd sets
// $JOURNAL_STREAM to its "DEVICE:INODE" when it connects a service's
// stdout or stderr to journald (systemd.exec(5)); a stderr redirected
// since (a shell's 2>file) no longer matches it.
func journalStream(f *os.File) bool {
	v := os.Getenv("JOURNAL_STREAM")
	if v == "" {
		return false
	}
	var dev, ino uint64
	if _, err := fmt.Sscanf(v, "%d:%d", &dev, &ino); err != nil {
		return false
	}
	var st unix.Stat_t
	if err := unix.Fstat(int(f.Fd()), &st); err != nil {
		return false
	}
	return uint64(st.Dev) == dev && uint64(st.Ino) == ino
}
