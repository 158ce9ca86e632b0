//go:build !unix

package main

import "os/exec"

// ownProcessGroup: there are no process groups here (Windows).
func ownProcessGroup(*exec.Cmd) {}

// killProcessGroup kills cmd's own process; helpers it started are not
// reached.
func killProcessGroup(cmd *exec.Cmd) error { return cmd.Process.Kill() }
