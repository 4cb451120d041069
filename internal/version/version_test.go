package version

import (
	"strings"
	"testing"
)

func TestString(t *testing.T) {
	if got := String(); !strings.HasPrefix(got, "dev") {
		t.Errorf("unstamped: %q, want dev...", got)
	}
	stamped = "0.1.0~git20261125.abcdef0"
	defer func() { stamped = "" }()
	if got := String(); got != stamped {
		t.Errorf("stamped: %q, want %q", got, stamped)
	}
}
