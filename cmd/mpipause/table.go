package main

import (
	"fmt"
	"io"
	"strings"

	"github.com/mpipause/mpipause/internal/term"
)

// table prints columns padded to their widest cell: text columns left
// aligned, the columns from index right onwards (numbers) right aligned.
type table struct {
	header []string
	right  int
	rows   [][]string
}

// add adds a row; its cells (job ids, node names, addresses) are shown
// through term.Safe.
func (t *table) add(cells ...string) {
	for i, c := range cells {
		cells[i] = term.Safe(c)
	}
	t.rows = append(t.rows, cells)
}

func (t *table) write(w io.Writer) {
	width := make([]int, len(t.header))
	for _, row := range append([][]string{t.header}, t.rows...) {
		for i, c := range row {
			width[i] = max(width[i], len(c))
		}
	}
	for _, row := range append([][]string{t.header}, t.rows...) {
		var b strings.Builder
		for i, c := range row {
			if i > 0 {
				b.WriteString("  ")
			}
			if i >= t.right {
				fmt.Fprintf(&b, "%*s", width[i], c)
			} else if i < len(row)-1 {
				fmt.Fprintf(&b, "%-*s", width[i], c)
			} else {
				b.WriteString(c)
			}
		}
		fmt.Fprintln(w, b.String())
	}
}
