package kerneltests

import (
	"bytes"
	"debug/elf"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/mpipause/mpipause/internal/node"
)

// TestProductionMPIDHasNoFailpoints: the failpoint hook, a file write
// steered by an environment variable in a root daemon, is in the test build
// of mpid only. bin/mpid (what make install and the .deb ship) holds neither
// the variable's name nor a failpoint function; bin/test/mpid, which the
// fault tests run, holds both (so the check can see them where they are).
func TestProductionMPIDHasNoFailpoints(t *testing.T) {
	bin := binDir(t)
	for _, c := range []struct {
		file string
		want bool
	}{{"mpid", false}, {testMPID, true}} {
		p := filepath.Join(bin, c.file)
		b, err := os.ReadFile(p)
		if err != nil {
			t.Fatal(err)
		}
		if got := bytes.Contains(b, []byte(node.FailpointsEnv)); got != c.want {
			t.Errorf("%s holds the string %s: %v, want %v", p, node.FailpointsEnv, got, c.want)
		}
		f, err := elf.Open(p)
		if err != nil {
			t.Fatal(err)
		}
		syms, err := f.Symbols()
		f.Close()
		if err != nil {
			t.Fatalf("%s: %v (built stripped? make build keeps the symbols)", p, err)
		}
		var hook []string
		for _, s := range syms {
			if (strings.Contains(s.Name, "internal/mpid.") || strings.Contains(s.Name, "internal/node.")) && strings.Contains(strings.ToLower(s.Name), "failpoint") {
				hook = append(hook, s.Name)
			}
		}
		if (len(hook) > 0) != c.want {
			t.Errorf("%s has failpoint functions %q, want them: %v", p, hook, c.want)
		}
	}
}
