// Command benchplot draws, in a results directory of `make bench`, the
// figures of the benchmarks that record only their raw CSV: those of the
// product module (quiesce's BenchmarkScale, loader's BenchmarkSnapshot),
// which links no plotting library (bench.Figures).
//
//	go run ./kernel-tests/tools/bench/benchplot DIR
//
// Exit status: 0 when every figure whose CSV is in DIR was drawn (none is
// not an error: a run may have measured neither), 1 when one could not be,
// 2 for bad usage.
package main

import (
	"fmt"
	"io"
	"os"

	"github.com/mpipause/mpipause/kernel-tests/tools/bench"
)

const usageText = `usage: benchplot DIR

Draws the SVG figures of scale.csv (scale-pause.svg,
scale-root-messages.svg) and snapshot.csv (snapshot-vs-sockets.svg) in DIR,
for those of the two files that are there.

  -h, --help  print this help

Exit status: 0 drawn, 1 a figure could not be drawn, 2 bad usage.
`

func main() {
	os.Exit(run(os.Args[1:], os.Stdout, os.Stderr))
}

func run(args []string, stdout, stderr io.Writer) int {
	if len(args) == 1 && (args[0] == "-h" || args[0] == "-help" || args[0] == "--help") {
		fmt.Fprint(stdout, usageText)
		return 0
	}
	if len(args) != 1 || len(args[0]) == 0 || args[0][0] == '-' {
		fmt.Fprint(stderr, usageText)
		return 2
	}
	names, err := bench.WriteFigures(args[0])
	for _, n := range names {
		fmt.Fprintf(stderr, "benchplot: %s\n", n)
	}
	if err != nil {
		fmt.Fprintf(stderr, "benchplot: %v\n", err)
		return 1
	}
	return 0
}
