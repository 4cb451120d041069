package kerneltests

import (
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
)

// TestVersionStamped: the commands make build leaves in bin say the version
// scripts/version.sh gives (the .deb's and the man pages'), on stdout, exit 0.
func TestVersionStamped(t *testing.T) {
	bin := binDir(t)
	out, err := exec.Command("../scripts/version.sh").Output()
	if err != nil {
		t.Fatalf("scripts/version.sh: %v", err)
	}
	want := strings.TrimSpace(string(out))
	for _, name := range []string{"mpipause", "mpid"} {
		for _, arg := range []string{"--version", "-version"} {
			got, err := exec.Command(filepath.Join(bin, name), arg).Output()
			if err != nil || strings.TrimSpace(string(got)) != name+" "+want {
				t.Errorf("%s %s: %q (%v); want %q", name, arg, got, err, name+" "+want)
			}
		}
	}
	if got, err := exec.Command(filepath.Join(bin, "mpipause"), "version").Output(); err != nil || strings.TrimSpace(string(got)) != "mpipause "+want {
		t.Errorf("mpipause version: %q (%v)", got, err)
	}
}
