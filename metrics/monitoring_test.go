package metrics

import (
	"encoding/json"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
)

// exportedNames is every series name proxyd exports after the scripted run:
// the family names, plus _bucket, _sum and _count for histograms.
func exportedNames(t *testing.T) map[string]bool {
	t.Helper()
	_, families := scriptedFamilies(t)
	names := make(map[string]bool)
	for _, f := range families {
		names[f.GetName()] = true
		if f.GetType() == dto.MetricType_HISTOGRAM {
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				names[f.GetName()+s] = true
			}
		}
	}
	return names
}

var (
	promqlString   = regexp.MustCompile(`"(?:[^"\\]|\\.)*"|'(?:[^'\\]|\\.)*'`)
	promqlMatchers = regexp.MustCompile(`\{[^{}]*\}`)
	promqlRange    = regexp.MustCompile(`\[[^\]]*\]`)
	promqlGrouping = regexp.MustCompile(`(?i)\b(by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)`)
	promqlVariable = regexp.MustCompile(`\$\{?\w+\}?`)
	promqlOffset   = regexp.MustCompile(`(?i)\boffset\s+-?\w+`)
	promqlNumber   = regexp.MustCompile(`(?i)(^|[^\w:])(\d+(\.\d+)?(e[+-]?\d+)?|0x[0-9a-f]+)\b`)
	promqlIdent    = regexp.MustCompile(`[a-zA-Z_:][a-zA-Z0-9_:]*\s*\(?`)
	promqlKeywords = map[string]bool{
		"and": true, "or": true, "unless": true, "bool": true, "by": true, "without": true,
		"on": true, "ignoring": true, "group_left": true, "group_right": true, "inf": true, "nan": true,
	}
)

// metricNames returns the metric names a PromQL expression selects: what is
// left once strings, matchers, ranges, grouping clauses, variables, numbers,
// keywords and function calls are taken out.
func metricNames(expr string) []string {
	s := promqlString.ReplaceAllString(expr, `""`)
	s = promqlVariable.ReplaceAllString(s, " ")
	s = promqlMatchers.ReplaceAllString(s, " ")
	s = promqlRange.ReplaceAllString(s, " ")
	s = promqlGrouping.ReplaceAllString(s, " ")
	s = promqlOffset.ReplaceAllString(s, " ")
	s = promqlNumber.ReplaceAllString(s, "$1 ")
	var names []string
	for _, tok := range promqlIdent.FindAllString(s, -1) {
		if strings.HasSuffix(tok, "(") {
			continue // a function
		}
		tok = strings.TrimSpace(tok)
		if !promqlKeywords[strings.ToLower(tok)] {
			names = append(names, tok)
		}
	}
	return names
}

func TestMetricNames(t *testing.T) {
	for expr, want := range map[string][]string{
		`sum by (le, protocol) (rate(proxyd_upstream_dial_seconds_bucket{instance=~"$instance"}[$__rate_interval]))`: {"proxyd_upstream_dial_seconds_bucket"},
		`a / (b > 0) > 0.9 unless on (job) c{x="y z"} offset 5m`:                                                     {"a", "b", "c"},
		`(d - time()) / 86400 * on (instance, service) group_left (product, status) e`:                               {"d", "e"},
		`histogram_quantile(0.9, x) and bool 1e9`:                                                                    {"x"},
	} {
		if got := metricNames(expr); !slices.Equal(got, want) {
			t.Errorf("metricNames(%q) = %q, want %q", expr, got, want)
		}
	}
}

type dashboard struct {
	SchemaVersion int     `json:"schemaVersion"`
	Title         string  `json:"title"`
	UID           string  `json:"uid"`
	Panels        []panel `json:"panels"`
	Templating    struct {
		List []struct {
			Name       string          `json:"name"`
			Type       string          `json:"type"`
			Query      json.RawMessage `json:"query"`
			Definition string          `json:"definition"`
			Datasource *datasource     `json:"datasource"`
		} `json:"list"`
	} `json:"templating"`
}

type datasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type panel struct {
	ID         int         `json:"id"`
	Type       string      `json:"type"`
	Title      string      `json:"title"`
	Datasource *datasource `json:"datasource"`
	GridPos    *struct {
		H, W, X, Y int
	} `json:"gridPos"`
	Targets []struct {
		Expr       string      `json:"expr"`
		RefID      string      `json:"refId"`
		Datasource *datasource `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"`
}

func TestDashboard(t *testing.T) {
	raw, err := os.ReadFile(filepath.Join("grafana", "proxyd.json"))
	if err != nil {
		t.Fatal(err)
	}
	var d dashboard
	dec := json.NewDecoder(strings.NewReader(string(raw)))
	if err := dec.Decode(&d); err != nil {
		t.Fatalf("grafana/proxyd.json is not valid JSON: %v", err)
	}
	if d.SchemaVersion < 36 || d.SchemaVersion > 41 {
		t.Errorf("schemaVersion %d, want one a stock Grafana 9–11 imports (36–41)", d.SchemaVersion)
	}
	if d.Title == "" || d.UID == "" {
		t.Error("dashboard needs a title and a uid")
	}

	// The datasource is a variable, so the dashboard imports anywhere.
	var hasDS bool
	names := exportedNames(t)
	var exprs []string
	for _, v := range d.Templating.List {
		if v.Name == "datasource" {
			hasDS = v.Type == "datasource" && string(v.Query) == `"prometheus"`
			continue
		}
		if v.Datasource == nil || v.Datasource.UID != "${datasource}" {
			t.Errorf("variable %s does not use ${datasource}", v.Name)
		}
		if v.Definition != "" {
			exprs = append(exprs, strings.TrimSuffix(strings.TrimPrefix(v.Definition, "label_values("), ", instance)"))
		}
	}
	if !hasDS {
		t.Error(`no variable "datasource" of type datasource with query "prometheus"`)
	}

	var all []panel
	for _, p := range d.Panels {
		all = append(all, p)
		all = append(all, p.Panels...) // panels of collapsed rows
	}
	ids := make(map[int]bool)
	titles := make(map[string]bool)
	for _, p := range all {
		if ids[p.ID] {
			t.Errorf("panel id %d used twice", p.ID)
		}
		ids[p.ID] = true
		titles[p.Title] = true
		if p.GridPos == nil || p.GridPos.W <= 0 || p.GridPos.H <= 0 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q: bad gridPos", p.Title)
		}
		if p.Type == "row" {
			continue
		}
		if p.Datasource == nil || p.Datasource.UID != "${datasource}" || p.Datasource.Type != "prometheus" {
			t.Errorf("panel %q: datasource is not ${datasource}", p.Title)
		}
		if len(p.Targets) == 0 {
			t.Errorf("panel %q has no query", p.Title)
		}
		for _, tg := range p.Targets {
			if tg.Datasource != nil && tg.Datasource.UID != "${datasource}" {
				t.Errorf("panel %q query %s: datasource is not ${datasource}", p.Title, tg.RefID)
			}
			if strings.TrimSpace(tg.Expr) == "" {
				t.Errorf("panel %q query %s is empty", p.Title, tg.RefID)
			}
			exprs = append(exprs, tg.Expr)
		}
	}

	used := make(map[string]bool)
	for _, e := range exprs {
		ns := metricNames(e)
		if len(ns) == 0 {
			t.Errorf("query %q names no metric", e)
		}
		for _, n := range ns {
			used[strings.TrimSuffix(strings.TrimSuffix(strings.TrimSuffix(n, "_bucket"), "_sum"), "_count")] = true
			if !names[n] {
				t.Errorf("query %q names %s, which proxyd does not export", e, n)
			}
		}
	}
	// What the issue asks the dashboard to show.
	for _, n := range []string{
		"proxyd_connections_total", "proxyd_bytes_total", "proxyd_retries_total", "proxyd_upstreams",
		"proxyd_ejections_total", "proxyd_sticky_rotations_total", "proxyd_api_requests_total",
		"proxyd_api_request_seconds", "proxyd_account_credit_usd", "proxyd_service_due_timestamp_seconds",
		"proxyd_usage_rate", "proxyd_usage_limit", "proxyd_listener_usable_upstreams", "proxyd_listener_panic",
	} {
		if !used[n] {
			t.Errorf("no panel shows %s", n)
		}
	}

	// The queries parse: promtool checks them as recording rules.
	var rules strings.Builder
	rules.WriteString("groups:\n  - name: dashboard\n    rules:\n")
	for i, e := range exprs {
		e = strings.NewReplacer("$__rate_interval", "5m", "$instance", ".*").Replace(e)
		q, _ := json.Marshal(e) // a JSON string is a YAML double-quoted scalar
		fmt.Fprintf(&rules, "      - record: dashboard:query_%d\n        expr: %s\n", i, q)
	}
	promtool := promtoolPath(t)
	file := filepath.Join(t.TempDir(), "dashboard_rules.yml")
	if err := os.WriteFile(file, []byte(rules.String()), 0o600); err != nil {
		t.Fatal(err)
	}
	if out, err := exec.Command(promtool, "check", "rules", file).CombinedOutput(); err != nil {
		t.Errorf("dashboard queries do not parse: %v\n%s", err, out)
	}
}

// ruleExprs extracts the expr of every rule of a rules file, inline or as a
// block scalar (the shape alerts.yml uses).
func ruleExprs(t *testing.T, text string) []string {
	t.Helper()
	var exprs []string
	lines := strings.Split(text, "\n")
	for i := 0; i < len(lines); i++ {
		trimmed := strings.TrimSpace(lines[i])
		rest, ok := strings.CutPrefix(trimmed, "expr:")
		if !ok {
			continue
		}
		rest = strings.TrimSpace(rest)
		if rest != "|" && rest != ">" {
			exprs = append(exprs, rest)
			continue
		}
		indent := len(lines[i]) - len(strings.TrimLeft(lines[i], " "))
		var b strings.Builder
		for i+1 < len(lines) {
			next := lines[i+1]
			if strings.TrimSpace(next) != "" && len(next)-len(strings.TrimLeft(next, " ")) <= indent {
				break
			}
			b.WriteString(next + "\n")
			i++
		}
		exprs = append(exprs, b.String())
	}
	return exprs
}

func TestAlertRules(t *testing.T) {
	raw, err := os.ReadFile("alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	tests, err := os.ReadFile("alerts_test.yml")
	if err != nil {
		t.Fatal(err)
	}
	// Which alerts the unit tests show firing and not firing.
	fires, quiet := make(map[string]bool), make(map[string]bool)
	var current string
	for line := range strings.Lines(string(tests)) {
		line = strings.TrimSpace(line)
		if a, ok := strings.CutPrefix(line, "alertname:"); ok {
			current = strings.TrimSpace(a)
		} else if e, ok := strings.CutPrefix(line, "exp_alerts:"); ok && current != "" {
			if strings.TrimSpace(e) == "[]" {
				quiet[current] = true
			} else {
				fires[current] = true
			}
			current = ""
		}
	}
	// Every alert the issue asks for.
	for _, a := range []string{
		"ProxydDown", "ProxydNoUsableUpstream", "ProxydListenerPanic", "ProxydProviderAPIFailing",
		"ProxydPoolStateStale", "ProxydCreditLow", "ProxydServiceDueSoon", "ProxydUsageNearLimit",
		"ProxydConfigReloadFailed",
	} {
		if !strings.Contains(string(raw), "- alert: "+a+"\n") {
			t.Errorf("alerts.yml lacks %s", a)
		}
		if !fires[a] || !quiet[a] {
			t.Errorf("alerts_test.yml does not show %s both firing (%v) and not firing (%v)", a, fires[a], quiet[a])
		}
	}

	names := exportedNames(t)
	names["up"] = true // from Prometheus itself
	exprs := ruleExprs(t, string(raw))
	if len(exprs) != 9 {
		t.Errorf("found %d rule expressions, want 9", len(exprs))
	}
	for _, e := range exprs {
		for _, n := range metricNames(e) {
			if !names[n] {
				t.Errorf("rule %q names %s, which proxyd does not export", strings.TrimSpace(e), n)
			}
		}
	}

	promtool := promtoolPath(t)
	if out, err := exec.Command(promtool, "check", "rules", "alerts.yml").CombinedOutput(); err != nil {
		t.Errorf("promtool check rules: %v\n%s", err, out)
	}
	if out, err := exec.Command(promtool, "test", "rules", "alerts_test.yml").CombinedOutput(); err != nil {
		t.Errorf("promtool test rules: %v\n%s", err, out)
	}
}
