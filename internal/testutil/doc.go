// Package testutil is the project's fixture kit, what its tests share:
//
//   - RequirePrivileged, the privilege gate: privileged tests skip outside
//     CI and fail inside it (PrivEnv), so the kernel tier cannot pass by
//     skipping;
//   - NewNetns, NewNamedNetns and OpenNetns, network namespaces with Do,
//     which runs a function on a locked thread inside one;
//   - NewCgroup, a fresh cgroup v2 directory removed at cleanup;
//   - Buffer, a log's destination a test reads while it is written.
//
// Every helper that needs privileges goes through the gate itself. The
// capability check is internal/caps's and the mount table internal/mountinfo's,
// as the product code reads them.
package testutil
