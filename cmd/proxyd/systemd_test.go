package main

import (
	"net/url"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	"github.com/proxyd/proxyd/internal/syncbuf"
)

var (
	buildOnce sync.Once
	builtBin  string
	buildErr  error
)

// proxydBinary builds cmd/proxyd once per test run.
func proxydBinary(t *testing.T) string {
	t.Helper()
	buildOnce.Do(func() {
		dir, err := os.MkdirTemp("", "proxyd-bin-")
		if err != nil {
			buildErr = err
			return
		}
		builtBin = filepath.Join(dir, "proxyd")
		out, err := exec.Command("go", "build", "-o", builtBin, ".").CombinedOutput()
		if err != nil {
			buildErr = err
			builtBin = string(out)
		}
	})
	if buildErr != nil {
		t.Fatalf("building proxyd: %v\n%s", buildErr, builtBin)
	}
	return builtBin
}

// runBinary starts `proxyd run -config cfgPath` with env added to this
// process's environment. It is killed when the test ends, and its stderr is
// logged if the test failed; exited receives its exit.
func runBinary(t *testing.T, bin, cfgPath string, env ...string) (*exec.Cmd, *syncbuf.Buffer, chan error) {
	t.Helper()
	cmd := exec.Command(bin, "run", "-config", cfgPath)
	cmd.Env = append(os.Environ(), env...)
	stderr := &syncbuf.Buffer{}
	cmd.Stderr = stderr
	if err := cmd.Start(); err != nil {
		t.Fatal(err)
	}
	exited := make(chan error, 1)
	go func() { exited <- cmd.Wait() }()
	t.Cleanup(func() {
		cmd.Process.Kill()
		select {
		case <-exited:
		case <-time.After(5 * time.Second):
		}
		if t.Failed() {
			t.Logf("proxyd stderr:\n%s", stderr.String())
		}
	})
	return cmd, stderr, exited
}

func mustURL(s string) *url.URL {
	u, err := url.Parse(s)
	if err != nil {
		panic(err)
	}
	return u
}

func TestMain(m *testing.M) {
	code := m.Run()
	if builtBin != "" && buildErr == nil {
		os.RemoveAll(filepath.Dir(builtBin))
	}
	os.Exit(code)
}

func TestSystemdUnit(t *testing.T) {
	unit, err := os.ReadFile(filepath.Join("..", "..", "systemd", "proxyd.service"))
	if err != nil {
		t.Fatal(err)
	}
	text := string(unit)
	for _, want := range []string{
		"Type=notify", "ExecReload=/bin/kill -HUP $MAINPID", "WatchdogSec=", "Restart=on-failure",
		"DynamicUser=yes", "StateDirectory=proxyd", "ConfigurationDirectory=proxyd", "LoadCredential=token:",
		"LimitNOFILE=65536", "UMask=0077", "ProtectSystem=strict", "ProtectHome=yes", "PrivateTmp=yes",
		"PrivateDevices=yes", "PrivateUsers=yes", "NoNewPrivileges=yes", "CapabilityBoundingSet=\n",
		"RestrictAddressFamilies=AF_INET AF_INET6 AF_UNIX AF_NETLINK", "RestrictNamespaces=yes", "RestrictRealtime=yes",
		"RestrictSUIDSGID=yes", "RemoveIPC=yes", "LockPersonality=yes", "MemoryDenyWriteExecute=yes",
		"ProtectProc=invisible", "ProcSubset=pid", "DevicePolicy=closed", "SystemCallArchitectures=native",
		"SystemCallFilter=@system-service", "SystemCallFilter=~@privileged @resources",
		"ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectKernelLogs=yes",
		"ProtectControlGroups=yes", "ProtectClock=yes",
	} {
		if !strings.Contains(text, want) {
			t.Errorf("unit lacks %q", strings.TrimSpace(want))
		}
	}
	// The issue asks for these checks where systemd-analyze exists; it is
	// part of systemd, not something the test command installs.
	analyze, err := exec.LookPath("systemd-analyze")
	if err != nil {
		t.Skip("systemd-analyze not installed: the unit's lines were checked, not its verification and exposure")
	}
	bin := proxydBinary(t)
	dir := t.TempDir()
	copyPath := filepath.Join(dir, "proxyd.service")
	if err := os.WriteFile(copyPath, []byte(strings.ReplaceAll(text, "/usr/local/bin/proxyd", bin)), 0o644); err != nil {
		t.Fatal(err)
	}
	out, err := exec.Command(analyze, "verify", copyPath).CombinedOutput()
	if err != nil || len(strings.TrimSpace(string(out))) > 0 {
		t.Errorf("systemd-analyze verify: %v\n%s", err, out)
	}
	out, _ = exec.Command(analyze, "security", "--offline=true", copyPath).CombinedOutput()
	m := regexp.MustCompile(`Overall exposure level for \S+: ([0-9.]+)`).FindSubmatch(out)
	if m == nil {
		t.Fatalf("no exposure level in:\n%s", out)
	}
	level, _ := strconv.ParseFloat(string(m[1]), 64)
	if level > 1.5 {
		t.Errorf("exposure %.1f, want ≤ 1.5:\n%s", level, out)
	}
}
