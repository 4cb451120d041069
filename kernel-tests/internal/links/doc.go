// Package links makes the test rig's network: named network namespaces and the
// bridges, veths and addresses in them, through vishvananda/netlink.
package links
