package ranks

import (
	"fmt"
	"os"
	"strconv"
	"strings"
)

// What the kernel shows of a rank's signals that its handlers have not
// told yet: mpid looks while the rank is frozen (internal/mpid/signals.go).

// MaxFramedThreads bounds the threads of one rank SignalFramed reads: a
// rank with more has the rest unread (the cost is its own job's resume).
const MaxFramedThreads = 4096

// SignalFramed says whether a thread of process pid is about to run the
// instruction at entry: read from /proc/PID/task/TID/syscall, whose last
// field is the thread's user instruction pointer (proc(5); the kernel
// gives it for a thread that is not running, as a frozen one is not, and
// to mpid by CAP_SYS_PTRACE). At the shim's SIGTSTP handler's entry, the
// kernel has built that handler's frame: the SIGTSTP was delivered before
// the freeze and its handler runs after the thaw.
func SignalFramed(pid int, entry uint64) bool {
	d, err := os.Open(fmt.Sprintf("/proc/%d/task", pid))
	if err != nil {
		return false
	}
	defer d.Close()
	tids, _ := d.Readdirnames(MaxFramedThreads)
	for _, tid := range tids {
		b, err := os.ReadFile(fmt.Sprintf("/proc/%d/task/%s/syscall", pid, tid))
		if err == nil && syscallAt(string(b), entry) {
			return true
		}
	}
	return false
}

// syscallAt is SignalFramed's reading of a /proc/PID/task/TID/syscall
// text: "running", or its fields ending with the instruction pointer.
func syscallAt(s string, entry uint64) bool {
	f := strings.Fields(s)
	if len(f) < 3 {
		return false
	}
	pc, err := strconv.ParseUint(strings.TrimPrefix(f[len(f)-1], "0x"), 16, 64)
	return err == nil && pc == entry
}
