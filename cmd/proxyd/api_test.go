package main

import (
	"bytes"
	"context"
	"encoding/json"
	"flag"
	"net/http/httptest"
	"os"
	"path/filepath"
	"regexp"
	"strings"
	"testing"
	"time"

	"github.com/proxyd/proxyd/agent/providersim"
)

var update = flag.Bool("update", false, "rewrite golden files")

const simToken = "tok-Zq81-secret-7781"

func startSim(t *testing.T) (*providersim.Sim, string) {
	t.Helper()
	sim := providersim.New(providersim.Config{Token: simToken, Now: func() time.Time {
		return time.Date(2026, 11, 21, 10, 0, 0, 0, time.UTC)
	}})
	srv := httptest.NewServer(sim)
	t.Cleanup(srv.Close)
	return sim, srv.URL
}

// runAPI runs `proxyd api -base-url URL args...` with the token in the
// environment and returns stdout, stderr and the exit code.
func runAPI(t *testing.T, url string, stdin string, args ...string) (string, string, int) {
	t.Helper()
	var out, errb bytes.Buffer
	env := map[string]string{"PROXYD_API_TOKEN": simToken}
	code := runMain(context.Background(), append([]string{"api", "-base-url", url}, args...), stdio{
		in: strings.NewReader(stdin), out: &out, err: &errb, getenv: func(k string) string { return env[k] },
	})
	return out.String(), errb.String(), code
}

// golden compares got with testdata/<name>.golden (rewritten with -update).
func golden(t *testing.T, name, got string) {
	t.Helper()
	path := filepath.Join("testdata", name+".golden")
	if *update {
		os.MkdirAll(filepath.Dir(path), 0o755)
		if err := os.WriteFile(path, []byte(got), 0o644); err != nil {
			t.Fatal(err)
		}
		return
	}
	want, err := os.ReadFile(path)
	if err != nil {
		t.Fatalf("%v (run go test -run %s -update to create it)", err, t.Name())
	}
	if got != string(want) {
		t.Errorf("output differs from %s:\n--- got\n%s--- want\n%s", path, got, want)
	}
}

func TestAPICommandsGolden(t *testing.T) {
	cases := []struct {
		name  string
		args  []string
		stdin string
	}{
		{"clients", []string{"clients"}, ""},
		{"products", []string{"products"}, ""},
		{"products_orderby", []string{"products", "-orderby", "price"}, ""},
		{"product_fpr", []string{"product", "11"}, ""},
		{"product_ppr", []string{"product", "13"}, ""},
		{"order", []string{"order", "11", "-client", "7", "-setip", "192.0.2.55"}, ""},
		{"services", []string{"services"}, ""},
		{"service", []string{"service", "101"}, ""},
		{"service_update", []string{"service-update", "101", "-setip", "192.0.2.77", "-update-list"}, ""},
		{"service_update_password", []string{"service-update", "101", "-password", "-"}, "n3w-pass\n"},
		{"credit", []string{"credit"}, ""},
		{"invoices", []string{"invoices"}, ""},
		{"iplist", []string{"iplist", "101", "-type", "http-auth", "-format", "txt"}, ""},
		{"netstatus", []string{"netstatus", "101"}, ""},
		{"stats", []string{"stats", "102"}, ""},
		{"rate", []string{"rate", "102"}, ""},
		{"sticky_list", []string{"sticky", "list", "102"}, ""},
		{"sticky_rotate", []string{"sticky", "rotate", "102", "gw1.sim.example", "s1"}, ""},
		{"sticky_ttl", []string{"sticky", "ttl", "102", "5"}, ""},
		{"sticky_reset", []string{"sticky", "reset", "102"}, ""},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			sim, url := startSim(t)
			sim.MarkErrored(101, "198.51.100.20")
			sim.MarkInactive(101, "198.51.100.21")
			out, errOut, code := runAPI(t, url, c.stdin, c.args...)
			if code != 0 {
				t.Fatalf("exit %d, stderr %q", code, errOut)
			}
			golden(t, "api/"+c.name, out)
			if strings.Contains(out+errOut, simToken) {
				t.Error("the token appears in the output")
			}
		})
	}
}

func TestAPIInvoiceAndJSON(t *testing.T) {
	_, url := startSim(t)
	out, _, code := runAPI(t, url, "", "-json", "services")
	if code != 0 || !json.Valid([]byte(out)) || !strings.Contains(out, "service_id") {
		t.Fatalf("-json services: exit %d, %q", code, out)
	}
	// -json gives the API's own body, byte for byte.
	out, _, _ = runAPI(t, url, "", "-json", "credit")
	var credit map[string]any
	if err := json.Unmarshal([]byte(out), &credit); err != nil || credit["credit"] == nil {
		t.Fatalf("-json credit: %q", out)
	}
	out, _, code = runAPI(t, url, "", "-json", "iplist", "101", "-type", "http-auth", "-format", "txt")
	if code != 0 || !strings.Contains(out, ":") {
		t.Fatalf("-json iplist gives the list as served: %q", out)
	}
	// -json service-update sends the body UpdateService sends.
	out, _, code = runAPI(t, url, "n3w-pass\n", "-json", "service-update", "101", "-setip", "192.0.2.77", "-password", "-")
	var upd map[string]any
	if err := json.Unmarshal([]byte(out), &upd); code != 0 || err != nil || upd["setip"] == nil || upd["password"] == nil {
		t.Fatalf("-json service-update: exit %d, %q", code, out)
	}
	out, _, code = runAPI(t, url, "", "invoices")
	if code != 0 {
		t.Fatal(out)
	}
	lines := strings.Split(strings.TrimSpace(out), "\n")
	id := strings.Fields(lines[1])[0]
	out, _, code = runAPI(t, url, "", "invoice", id)
	if code != 0 || !strings.Contains(out, id) {
		t.Fatalf("invoice %s: exit %d %q", id, code, out)
	}
}

func TestAPIErrors(t *testing.T) {
	sim, url := startSim(t)
	cases := []struct {
		args   []string
		code   int
		stderr string
	}{
		{[]string{"product", "999"}, 1, "Unprocessable Entity or product ID not found"},
		{[]string{"order", "11", "-client", "999"}, 1, "ClientID not found"},
		{[]string{"order", "11"}, 2, "order needs -client ID"},
		{[]string{"order", "-client", "7"}, 2, "missing PID (flags come after it)"},
		{[]string{"sticky", "ttl", "102", "4"}, 1, "provider answered 422"},
		{[]string{"service-update", "101", "-setip", "300.1.1.1"}, 1, "Invalid IPv4 format"},
		{[]string{"nosuch"}, 2, `unknown command "nosuch"`},
	}
	for _, c := range cases {
		out, errOut, code := runAPI(t, url, "", c.args...)
		if code != c.code || !strings.Contains(errOut, c.stderr) || out != "" {
			t.Errorf("%v: exit %d stdout %q stderr %q; want exit %d and %q", c.args, code, out, errOut, c.code, c.stderr)
		}
		if strings.Count(strings.TrimSpace(errOut), "\n") > 0 && c.code == 1 {
			t.Errorf("%v: provider errors are one line: %q", c.args, errOut)
		}
	}
	// The token never shows, whatever the provider answers.
	for _, status := range []int{401, 400, 500} {
		sim.FailNext(1, status, "echo "+simToken)
		out, errOut, code := runAPI(t, url, "", "services")
		if code != 1 {
			t.Errorf("status %d: exit %d", status, code)
		}
		if strings.Contains(out+errOut, simToken) {
			t.Errorf("status %d: token in output %q %q", status, out, errOut)
		}
	}
	// A message with line breaks and an escape is still one line.
	sim.FailNext(1, 400, `{"message": "bad thing\nsecond line\r\nthird\u001b[2J"}`)
	if _, errOut, code := runAPI(t, url, "", "services"); code != 1 || !strings.Contains(errOut, "bad thing; second line ; third [2J") ||
		strings.Count(errOut, "\n") != 1 || strings.ContainsAny(errOut, "\r\x1b") {
		t.Errorf("a provider message with line breaks: exit %d, stderr %q; want one line", code, errOut)
	}
	var out, errb bytes.Buffer
	code := runMain(context.Background(), []string{"api", "-base-url", url, "credit"}, stdio{
		in: strings.NewReader(""), out: &out, err: &errb, getenv: func(string) string { return "" },
	})
	if code != 1 || !strings.Contains(errb.String(), "PROXYD_API_TOKEN") {
		t.Errorf("no token: exit %d %q", code, errb.String())
	}
}

// A service update the provider refuses in part (one action's own error
// in a 200) fails, and still shows what became of every action: the IP
// was bound though the password was refused.
func TestAPIServiceUpdatePartlyRefused(t *testing.T) {
	sim, url := startSim(t)
	sim.FailNext(1, 200, `{"setip":{"success":"IP address updated successfully"},"password":{"error":"Password too weak"}}`)
	out, errOut, code := runAPI(t, url, "weak\n", "service-update", "101", "-setip", "192.0.2.77", "-password", "-")
	if code != 1 || !strings.Contains(errOut, "password: Password too weak") {
		t.Errorf("exit %d, stderr %q; want 1 and the refusal", code, errOut)
	}
	for _, row := range []string{`setip\s+IP address updated successfully`, `password\s+Password too weak`} {
		if !regexp.MustCompile(`(?m)^` + row + `$`).MatchString(out) {
			t.Errorf("stdout lacks a row %q:\n%s", row, out)
		}
	}
}
