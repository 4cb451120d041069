// Package version is mpipause's version as the build stamped it.
package version

import "runtime/debug"

// stamped is set by the Makefile (-ldflags -X, from scripts/version.sh):
// the same string as the .deb's version and the man pages'.
var stamped string

// String returns the stamped version, or, for a plain `go build` or
// `go run`, "dev" with the commit Go recorded, if any, so that a report
// from such a binary still says what it was built from.
func String() string {
	if stamped != "" {
		return stamped
	}
	v := "dev"
	if bi, ok := debug.ReadBuildInfo(); ok {
		var rev, dirty string
		for _, s := range bi.Settings {
			switch s.Key {
			case "vcs.revision":
				rev = s.Value
			case "vcs.modified":
				if s.Value == "true" {
					dirty = "+modified"
				}
			}
		}
		if len(rev) > 7 {
			rev = rev[:7]
		}
		if rev != "" {
			v += " (git " + rev + dirty + ")"
		}
	}
	return v
}
