// Package nl is the one place that imports the netlink libraries:
// vishvananda/netlink for links, addresses and namespaces of the test rig,
// and mdlayher/netlink for sock_diag (INET_DIAG) dumps of TCP sockets.
package nl
