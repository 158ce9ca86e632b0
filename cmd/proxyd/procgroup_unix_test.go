//go:build unix

package main

import (
	"os/exec"
	"syscall"
)

// ownProcessGroup makes cmd, once started, lead a process group of its
// own, which killProcessGroup ends with every helper it forked.
func ownProcessGroup(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
}

// killProcessGroup kills the process group that cmd leads.
func killProcessGroup(cmd *exec.Cmd) error {
	return syscall.Kill(-cmd.Process.Pid, syscall.SIGKILL)
}
