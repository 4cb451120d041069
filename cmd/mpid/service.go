package main

import (
	"cmp"
	"fmt"
	"io"
	"os"
	"strconv"

	"github.com/mpipause/mpipause/internal/mpid"
	"github.com/mpipause/mpipause/internal/sdnotify"
)

// parseArgs is parseFlags with each complaint about an option set in the
// settings file pointing at its line.
func parseArgs(args []string, out io.Writer) (config, error) {
	cfg, err := parseFlags(args, out)
	return cfg, cfg.blame(err)
}

// ready is what mpid does once every socket listens: tell the service
// manager (READY=1, Type=notify), then write the ready file, so that a
// waiter on either finds the other done.
func (cfg *config) ready() error {
	node := cfg.Node
	if node == "" {
		node, _ = os.Hostname()
	}
	port := cmp.Or(cfg.PeerPort, mpid.DefaultPeerPort)
	status := fmt.Sprintf("STATUS=serving node %s: peers on %s, ranks on %s, mpipause on %s",
		node, cmp.Or(cfg.PeerListen, ":"+strconv.Itoa(port)), cfg.RankSocket, cfg.CtlSocket)
	if _, err := sdnotify.Notify("READY=1", status, "MAINPID="+strconv.Itoa(os.Getpid())); err != nil {
		// A manager that wanted READY=1 gives up on mpid on its own
		// (TimeoutStartSec=); a stray $NOTIFY_SOCKET must not stop it.
		cfg.Log.Warn("could not tell the service manager that mpid is ready", "error", err)
	}
	if cfg.readyFile == "" {
		return nil
	}
	return writeReady(cfg.readyFile)
}

// stopping tells the service manager that mpid shuts down; a failure to
// tell it changes nothing then.
func stopping() {
	sdnotify.Notify("STOPPING=1", "STATUS=stopping")
}
