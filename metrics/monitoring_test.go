package metrics

import (
	"encoding/json"
	"fmt"
	"maps"
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
	names, _ := exportedSeries(t)
	return names
}

// exportedSeries is exportedNames and, of those, the names that count: the
// counter families and the _bucket, _sum and _count series of histograms,
// which only make sense under rate or increase.
func exportedSeries(t *testing.T) (names, counters map[string]bool) {
	t.Helper()
	_, families := scriptedFamilies(t)
	names, counters = make(map[string]bool), make(map[string]bool)
	for _, f := range families {
		names[f.GetName()] = true
		switch f.GetType() {
		case dto.MetricType_COUNTER:
			counters[f.GetName()] = true
		case dto.MetricType_HISTOGRAM:
			for _, s := range []string{"_bucket", "_sum", "_count"} {
				names[f.GetName()+s] = true
				counters[f.GetName()+s] = true
			}
		}
	}
	return names, counters
}

// promSelector is one vector selector of a PromQL expression and where it
// stands in it.
type promSelector struct {
	name     string // the metric name; "" for a selector of matchers only
	matchers string // between the braces; "" without braces
	window   string // between the brackets of a range selector; "" when not a range
	within   string // the function or aggregation whose parentheses hold it directly; "" at the top or in plain parentheses
}

var (
	promqlAggregations = map[string]bool{
		"sum": true, "min": true, "max": true, "avg": true, "group": true, "stddev": true, "stdvar": true,
		"count": true, "count_values": true, "bottomk": true, "topk": true, "quantile": true,
		"limitk": true, "limit_ratio": true,
	}
	promqlGroupings = map[string]bool{
		"by": true, "without": true, "on": true, "ignoring": true, "group_left": true, "group_right": true,
	}
	promqlKeywords = map[string]bool{
		"and": true, "or": true, "unless": true, "bool": true, "offset": true, "inf": true, "nan": true, "atan2": true,
	}
)

func isIdentByte(c byte) bool {
	return c == '_' || c == ':' || c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' || c >= '0' && c <= '9'
}

// enclosed returns what lies between expr[open] and its closing byte, and
// the index after the closing byte. Quoted strings inside are skipped whole.
func enclosed(expr string, open int, closing byte) (string, int) {
	for i := open + 1; i < len(expr); i++ {
		switch c := expr[i]; {
		case c == closing:
			return expr[open+1 : i], i + 1
		case c == '"' || c == '\'' || c == '`':
			i = skipQuoted(expr, i) - 1
		}
	}
	return expr[open+1:], len(expr)
}

// skipQuoted returns the index after the quoted string that starts at i.
func skipQuoted(expr string, i int) int {
	q := expr[i]
	for i++; i < len(expr); i++ {
		switch expr[i] {
		case '\\':
			if q != '`' {
				i++
			}
		case q:
			return i + 1
		}
	}
	return len(expr)
}

// promqlSelectors finds the vector selectors of a PromQL expression. It is a
// scanner, not a parser: enough for the expressions of a dashboard, which
// promtool parses for real in TestDashboard.
func promqlSelectors(expr string) []promSelector {
	var (
		out    []promSelector
		open   []string // the owner of each open parenthesis
		caller string   // a function or aggregation waiting for its "("
	)
	within := func() string {
		if len(open) == 0 {
			return ""
		}
		return open[len(open)-1]
	}
	// selector reads the optional matchers and range of a selector whose
	// name ends at i.
	selector := func(name string, i int) int {
		s := promSelector{name: name, within: within()}
		j := i
		for j < len(expr) && expr[j] == ' ' {
			j++
		}
		if j < len(expr) && expr[j] == '{' {
			s.matchers, i = enclosed(expr, j, '}')
		}
		j = i
		for j < len(expr) && expr[j] == ' ' {
			j++
		}
		if j < len(expr) && expr[j] == '[' {
			s.window, i = enclosed(expr, j, ']')
		}
		out = append(out, s)
		return i
	}
	for i := 0; i < len(expr); {
		c := expr[i]
		switch {
		case c == '"' || c == '\'' || c == '`':
			i, caller = skipQuoted(expr, i), ""
		case c == '(':
			open, caller = append(open, caller), ""
			i++
		case c == ')':
			if len(open) > 0 {
				open = open[:len(open)-1]
			}
			i++
		case c == '{':
			i, caller = selector("", i), ""
		case c == '[': // a subquery's range
			_, i = enclosed(expr, i, ']')
		case c >= '0' && c <= '9' || c == '.' || c == '$': // a number, a duration, a variable
			for i++; i < len(expr) && (isIdentByte(expr[i]) || expr[i] == '.' || expr[i] == '{' || expr[i] == '}'); i++ {
			}
			caller = ""
		case isIdentByte(c):
			j := i
			for j < len(expr) && isIdentByte(expr[j]) {
				j++
			}
			word, k := expr[i:j], j
			for k < len(expr) && expr[k] == ' ' {
				k++
			}
			next := byte(0)
			if k < len(expr) {
				next = expr[k]
			}
			lower := strings.ToLower(word)
			switch {
			case promqlGroupings[lower]:
				i = j
				if next == '(' {
					_, i = enclosed(expr, k, ')')
				}
			case promqlKeywords[lower]:
				i, caller = j, ""
			case next == '(' || promqlAggregations[lower]:
				i, caller = j, word
			default:
				i, caller = selector(word, j), ""
			}
		default:
			if c != ' ' && c != '\t' && c != '\n' {
				caller = ""
			}
			i++
		}
	}
	return out
}

// metricNames returns the metric names a PromQL expression selects.
func metricNames(expr string) []string {
	var names []string
	for _, s := range promqlSelectors(expr) {
		if s.name != "" {
			names = append(names, s.name)
		}
	}
	return names
}

// promqlMatchers splits the matchers of a selector into label name and the
// rest (operator and quoted value), spaces removed: {"job": `=~"$job"`}.
func promqlMatchers(s string) map[string]string {
	m := make(map[string]string)
	for len(s) > 0 {
		end := len(s)
		for i := 0; i < len(s); i++ {
			if s[i] == '"' || s[i] == '\'' || s[i] == '`' {
				i = skipQuoted(s, i) - 1
			} else if s[i] == ',' {
				end = i
				break
			}
		}
		part := strings.TrimSpace(s[:end])
		if end < len(s) {
			s = s[end+1:]
		} else {
			s = ""
		}
		i := strings.IndexAny(part, "=!")
		if i < 0 {
			continue
		}
		m[strings.TrimSpace(part[:i])] = strings.ReplaceAll(part[i:], " ", "")
	}
	return m
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

func TestPromqlSelectors(t *testing.T) {
	for expr, want := range map[string][]promSelector{
		`sum by (a) (rate(x{job=~"$job", l="}[)"}[$__rate_interval]))`:  {{"x", `job=~"$job", l="}[)"`, "$__rate_interval", "rate"}},
		`sum(y) / ignoring (r) group_left sum by (l) (increase(z[5m]))`: {{"y", "", "", "sum"}, {"z", "", "5m", "increase"}},
		`max(u{a="1"} > 0) - time() * (v)`:                              {{"u", `a="1"`, "", "max"}, {"v", "", "", ""}},
		`label_values(proxyd_build_info{job=~"$job"}, instance)`:        {{"proxyd_build_info", `job=~"$job"`, "", "label_values"}, {"instance", "", "", "label_values"}},
	} {
		if got := promqlSelectors(expr); !slices.Equal(got, want) {
			t.Errorf("promqlSelectors(%q) =\n%q, want\n%q", expr, got, want)
		}
	}
	if got, want := promqlMatchers(`job=~"$job", instance =~ "$instance",code!~"2..", x="a,b"`),
		map[string]string{"job": `=~"$job"`, "instance": `=~"$instance"`, "code": `!~"2.."`, "x": `="a,b"`}; !maps.Equal(got, want) {
		t.Errorf("promqlMatchers = %q, want %q", got, want)
	}
}

type dashboard struct {
	SchemaVersion int     `json:"schemaVersion"`
	Title         string  `json:"title"`
	UID           string  `json:"uid"`
	Editable      *bool   `json:"editable"`
	Panels        []panel `json:"panels"`
	Templating    struct {
		List []variable `json:"list"`
	} `json:"templating"`
}

type variable struct {
	Name       string          `json:"name"`
	Label      string          `json:"label"`
	Type       string          `json:"type"`
	Query      json.RawMessage `json:"query"`
	Definition string          `json:"definition"`
	Datasource *datasource     `json:"datasource"`
	Multi      bool            `json:"multi"`
	IncludeAll bool            `json:"includeAll"`
	AllValue   string          `json:"allValue"`
	Refresh    int             `json:"refresh"`
}

type datasource struct {
	Type string `json:"type"`
	UID  string `json:"uid"`
}

type panel struct {
	ID          int         `json:"id"`
	Type        string      `json:"type"`
	Title       string      `json:"title"`
	Description string      `json:"description"`
	Datasource  *datasource `json:"datasource"`
	GridPos     *struct {
		H, W, X, Y int
	} `json:"gridPos"`
	FieldConfig struct {
		Defaults struct {
			Unit string `json:"unit"`
		} `json:"defaults"`
	} `json:"fieldConfig"`
	Targets []struct {
		Expr       string      `json:"expr"`
		RefID      string      `json:"refId"`
		Datasource *datasource `json:"datasource"`
	} `json:"targets"`
	Panels []panel `json:"panels"`
}

// allPanels is every panel of d, the panels of collapsed rows included.
func (d dashboard) allPanels() []panel {
	var all []panel
	for _, p := range d.Panels {
		all = append(all, p)
		all = append(all, p.Panels...)
	}
	return all
}

// labelValues matches a label_values(selector, label) variable query.
var labelValues = regexp.MustCompile(`^label_values\((.+),\s*(\w+)\)$`)

// grafanaUnits are the units a panel may have: Grafana's unit IDs that fit
// what proxyd measures. A panel that needs another of Grafana's units adds
// it here.
var grafanaUnits = map[string]bool{
	"none": true, "short": true, "percent": true, "percentunit": true,
	"s": true, "ms": true, "d": true, "dtdurations": true, "dateTimeFromNow": true,
	"bytes": true, "decbytes": true, "Bps": true, "binBps": true,
	"cps": true, "ops": true, "reqps": true, "currencyUSD": true, "bool": true,
}

const templatedDatasource = "${datasource}"

// lintDashboard checks the conventions of Grafana's dashboard-linter that a
// dashboard shipped to other people's Grafana should follow, and returns
// every problem it finds. isCounter says which metric names count.
//
//   - A data source variable named datasource (label "Data source") of
//     Prometheus, used by every panel and every query.
//   - Template variables job and instance, each a multi-select Prometheus
//     query on the templated data source whose All value is ".+", refreshed
//     on time range change; instance lists the instances of the chosen jobs.
//   - Every selector of every query has job=~"$job" and instance=~"$instance".
//   - The dashboard is not editable (changes are made in the file).
//   - Every panel has a title, a description and a unit.
//   - Counters (and histogram series) appear only as the range of rate, irate
//     or increase; rate and irate take $__rate_interval.
func lintDashboard(d dashboard, isCounter func(string) bool) []string {
	var problems []string
	report := func(format string, args ...any) { problems = append(problems, fmt.Sprintf(format, args...)) }

	if d.Editable == nil || *d.Editable {
		report("dashboard: editable is not false")
	}
	vars := make(map[string]variable)
	for _, v := range d.Templating.List {
		vars[v.Name] = v
		if v.Type == "query" && v.Refresh != 2 {
			report("variable %s: refresh %d, want 2 (on time range change)", v.Name, v.Refresh)
		}
	}
	if ds, ok := vars["datasource"]; !ok || ds.Type != "datasource" || string(ds.Query) != `"prometheus"` || ds.Label != "Data source" {
		report(`dashboard: no variable "datasource" of type datasource, query "prometheus", label "Data source"`)
	}
	checkSelectors := func(where, expr string, required ...string) {
		sels := promqlSelectors(expr)
		if len(sels) == 0 {
			report("%s: query %q selects nothing", where, expr)
		}
		for _, s := range sels {
			ms := promqlMatchers(s.matchers)
			for _, label := range required {
				if want := `=~"$` + label + `"`; ms[label] != want {
					report(`%s: selector %s{%s} lacks %s%s`, where, s.name, s.matchers, label, want)
				}
			}
			if isCounter(s.name) && (s.window == "" || !slices.Contains([]string{"rate", "irate", "increase"}, s.within)) {
				report("%s: counter %s is not the range of rate, irate or increase", where, s.name)
			}
			if (s.within == "rate" || s.within == "irate") && s.window != "$__rate_interval" {
				report("%s: %s(%s[%s]) should use $__rate_interval", where, s.within, s.name, s.window)
			}
		}
	}
	for _, name := range []string{"job", "instance"} {
		v, ok := vars[name]
		if !ok {
			report("dashboard: no %s variable", name)
			continue
		}
		where := "variable " + name
		if v.Type != "query" || v.Datasource == nil || v.Datasource.UID != templatedDatasource {
			report("%s: not a query on %s", where, templatedDatasource)
		}
		if want := strings.ToUpper(name[:1]) + name[1:]; v.Label != want {
			report("%s: label %q, want %q", where, v.Label, want)
		}
		if !v.Multi || !v.IncludeAll || v.AllValue != ".+" {
			report(`%s: not a multi-select with All = ".+" (multi %v, includeAll %v, allValue %q)`, where, v.Multi, v.IncludeAll, v.AllValue)
		}
		m := labelValues.FindStringSubmatch(v.Definition)
		if m == nil || m[2] != name {
			report("%s: definition %q is not label_values(<selector>, %s)", where, v.Definition, name)
			continue
		}
		if name == "instance" {
			checkSelectors(where, m[1], "job")
		}
	}

	for _, p := range d.allPanels() {
		if p.Type == "row" {
			continue
		}
		where := fmt.Sprintf("panel %d %q", p.ID, p.Title)
		if p.Title == "" || p.Description == "" {
			report("%s: needs a title and a description", where)
		}
		if !grafanaUnits[p.FieldConfig.Defaults.Unit] {
			report("%s: unit %q is not one of grafanaUnits", where, p.FieldConfig.Defaults.Unit)
		}
		if p.Datasource == nil || p.Datasource.UID != templatedDatasource || p.Datasource.Type != "prometheus" {
			report("%s: datasource is not %s", where, templatedDatasource)
		}
		if len(p.Targets) == 0 {
			report("%s: no query", where)
		}
		for _, tg := range p.Targets {
			where := where + " query " + tg.RefID
			if tg.Datasource == nil || tg.Datasource.UID != templatedDatasource || tg.Datasource.Type != "prometheus" {
				report("%s: datasource is not %s", where, templatedDatasource)
			}
			checkSelectors(where, tg.Expr, "job", "instance")
		}
	}
	return problems
}

func readDashboard(t *testing.T) (raw []byte, d dashboard) {
	t.Helper()
	raw, err := os.ReadFile(filepath.Join("grafana", "proxyd.json"))
	if err != nil {
		t.Fatal(err)
	}
	if err := json.Unmarshal(raw, &d); err != nil {
		t.Fatalf("grafana/proxyd.json is not valid JSON: %v", err)
	}
	return raw, d
}

func TestDashboard(t *testing.T) {
	_, d := readDashboard(t)
	if d.SchemaVersion < 36 || d.SchemaVersion > 41 {
		t.Errorf("schemaVersion %d, want one a stock Grafana 9–11 imports (36–41)", d.SchemaVersion)
	}
	if d.Title == "" || d.UID == "" {
		t.Error("dashboard needs a title and a uid")
	}
	names, counters := exportedSeries(t)
	isCounter := func(name string) bool { return counters[name] || strings.HasSuffix(name, "_total") }
	for _, p := range lintDashboard(d, isCounter) {
		t.Error(p)
	}

	// The datasource is a variable, so the dashboard imports anywhere.
	var exprs []string
	for _, v := range d.Templating.List {
		if v.Name == "datasource" {
			continue
		}
		if v.Datasource == nil || v.Datasource.UID != templatedDatasource {
			t.Errorf("variable %s does not use ${datasource}", v.Name)
		}
		if m := labelValues.FindStringSubmatch(v.Definition); m != nil {
			exprs = append(exprs, m[1])
		} else if v.Definition != "" {
			t.Errorf("variable %s: definition %q is not label_values(<selector>, <label>)", v.Name, v.Definition)
		}
	}

	ids := make(map[int]bool)
	for _, p := range d.allPanels() {
		if ids[p.ID] {
			t.Errorf("panel id %d used twice", p.ID)
		}
		ids[p.ID] = true
		if p.GridPos == nil || p.GridPos.W <= 0 || p.GridPos.H <= 0 || p.GridPos.X+p.GridPos.W > 24 {
			t.Errorf("panel %q: bad gridPos", p.Title)
		}
		if p.Type == "row" {
			continue
		}
		for _, tg := range p.Targets {
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
	// What the issues ask the dashboard to show.
	for _, n := range []string{
		"proxyd_connections_total", "proxyd_bytes_total", "proxyd_retries_total", "proxyd_upstreams",
		"proxyd_ejections_total", "proxyd_sticky_rotations_total", "proxyd_api_requests_total",
		"proxyd_api_request_seconds", "proxyd_account_credit_usd", "proxyd_service_due_timestamp_seconds",
		"proxyd_usage_rate", "proxyd_usage_limit", "proxyd_listener_usable_upstreams", "proxyd_listener_panic",
		"proxyd_hedged_requests_total", "proxyd_invoices_unpaid", "proxyd_invoices_unpaid_usd",
		"proxyd_list_updates_total",
	} {
		if !used[n] {
			t.Errorf("no panel shows %s", n)
		}
	}
	// Connection results are shown with destination_error apart from
	// upstream_error: some panel divides the failed results by all.
	var failures bool
	for _, e := range exprs {
		failures = failures || strings.Contains(e, `proxyd_connections_total{job=~"$job", instance=~"$instance", result!="ok"}`)
	}
	if !failures {
		t.Error("no panel shows the failed connection results (destination_error among them) on their own")
	}

	// The queries parse: promtool checks them as recording rules.
	var rules strings.Builder
	rules.WriteString("groups:\n  - name: dashboard\n    rules:\n")
	for i, e := range exprs {
		e = strings.NewReplacer("$__rate_interval", "5m", "$instance", ".*", "$job", ".*").Replace(e)
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

// TestDashboardLint shows that lintDashboard catches each rule broken once
// in the shipped dashboard, so a panel added later that breaks one fails
// TestDashboard.
func TestDashboardLint(t *testing.T) {
	raw, _ := readDashboard(t)
	isCounter := func(name string) bool { return strings.HasSuffix(name, "_total") }
	// Edits of the JSON: the first panel that is not a row, its first query.
	firstPanel := func(m map[string]any) map[string]any {
		for _, p := range m["panels"].([]any) {
			if p.(map[string]any)["type"] != "row" {
				return p.(map[string]any)
			}
		}
		t.Fatal("no panel")
		return nil
	}
	target := func(m map[string]any) map[string]any {
		return firstPanel(m)["targets"].([]any)[0].(map[string]any)
	}
	variable := func(m map[string]any, name string) map[string]any {
		for _, v := range m["templating"].(map[string]any)["list"].([]any) {
			if v.(map[string]any)["name"] == name {
				return v.(map[string]any)
			}
		}
		t.Fatalf("no variable %s", name)
		return nil
	}
	for _, c := range []struct {
		name, want string
		edit       func(m map[string]any)
	}{
		{"editable", "editable", func(m map[string]any) { m["editable"] = true }},
		{"no job variable", "no job variable", func(m map[string]any) {
			tl := m["templating"].(map[string]any)
			tl["list"] = slices.DeleteFunc(tl["list"].([]any), func(v any) bool { return v.(map[string]any)["name"] == "job" })
		}},
		{"instance All value", `All = ".+"`, func(m map[string]any) { variable(m, "instance")["allValue"] = ".*" }},
		{"instance single", `All = ".+"`, func(m map[string]any) { variable(m, "instance")["multi"] = false }},
		{"instance refresh", "refresh", func(m map[string]any) { variable(m, "instance")["refresh"] = 1 }},
		{"instance ignores job", `lacks job=~"$job"`, func(m map[string]any) {
			variable(m, "instance")["definition"] = "label_values(proxyd_build_info, instance)"
		}},
		{"job label", "label", func(m map[string]any) { variable(m, "job")["label"] = "Scrape job" }},
		{"datasource variable", `"datasource"`, func(m map[string]any) { variable(m, "datasource")["label"] = "" }},
		{"no job matcher", `lacks job=~"$job"`, func(m map[string]any) {
			target(m)["expr"] = `sum(rate(proxyd_connections_total{instance=~"$instance"}[$__rate_interval]))`
		}},
		{"no instance matcher", `lacks instance=~"$instance"`, func(m map[string]any) {
			target(m)["expr"] = `sum(rate(proxyd_connections_total{job=~"$job", instance="a"}[$__rate_interval]))`
		}},
		{"second selector without matchers", `lacks job=~"$job"`, func(m map[string]any) {
			target(m)["expr"] = `sum(rate(proxyd_connections_total{job=~"$job", instance=~"$instance"}[$__rate_interval])) / sum(proxyd_connections_active)`
		}},
		{"panel datasource", "datasource is not", func(m map[string]any) { delete(firstPanel(m), "datasource") }},
		{"query datasource", "datasource is not", func(m map[string]any) { delete(target(m), "datasource") }},
		{"no title", "title", func(m map[string]any) { firstPanel(m)["title"] = "" }},
		{"no description", "description", func(m map[string]any) { delete(firstPanel(m), "description") }},
		{"no unit", "unit", func(m map[string]any) {
			delete(firstPanel(m)["fieldConfig"].(map[string]any)["defaults"].(map[string]any), "unit")
		}},
		{"bare counter", "counter", func(m map[string]any) {
			target(m)["expr"] = `sum(proxyd_connections_total{job=~"$job", instance=~"$instance"})`
		}},
		{"counter under delta", "counter", func(m map[string]any) {
			target(m)["expr"] = `sum(delta(proxyd_connections_total{job=~"$job", instance=~"$instance"}[$__rate_interval]))`
		}},
		{"fixed rate window", "$__rate_interval", func(m map[string]any) {
			target(m)["expr"] = `sum(rate(proxyd_connections_total{job=~"$job", instance=~"$instance"}[5m]))`
		}},
	} {
		var m map[string]any
		if err := json.Unmarshal(raw, &m); err != nil {
			t.Fatal(err)
		}
		c.edit(m)
		b, err := json.Marshal(m)
		if err != nil {
			t.Fatal(err)
		}
		var d dashboard
		if err := json.Unmarshal(b, &d); err != nil {
			t.Fatal(err)
		}
		problems := lintDashboard(d, isCounter)
		if !slices.ContainsFunc(problems, func(p string) bool { return strings.Contains(p, c.want) }) {
			t.Errorf("%s: no problem mentions %q; got %q", c.name, c.want, problems)
		}
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
	// Every alert the issues ask for.
	alerts := []string{
		"ProxydDown", "ProxydNoUsableUpstream", "ProxydListenerPanic", "ProxydProviderAPIFailing",
		"ProxydPoolStateStale", "ProxydCreditLow", "ProxydServiceDueSoon", "ProxydUsageNearLimit",
		"ProxydConfigReloadFailed", "ProxydUpstreamErrors", "ProxydInvoiceUnpaid",
	}
	for _, a := range alerts {
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
	if len(exprs) != len(alerts) {
		t.Errorf("found %d rule expressions, want %d", len(exprs), len(alerts))
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

// TestReadmeMonitoring checks that README_monitoring.md names every metric
// proxyd exports and every alert of alerts.yml, so that the documentation
// follows what is added.
func TestReadmeMonitoring(t *testing.T) {
	readme, err := os.ReadFile("README_monitoring.md")
	if err != nil {
		t.Fatal(err)
	}
	rules, err := os.ReadFile("alerts.yml")
	if err != nil {
		t.Fatal(err)
	}
	_, families := scriptedFamilies(t)
	for _, f := range families {
		if n := f.GetName(); strings.HasPrefix(n, "proxyd_") && !strings.Contains(string(readme), "`"+n+"`") {
			t.Errorf("README_monitoring.md does not list %s", n)
		}
	}
	alerts := regexp.MustCompile(`(?m)^\s*- alert: (\w+)$`).FindAllStringSubmatch(string(rules), -1)
	if len(alerts) == 0 {
		t.Fatal("no alert found in alerts.yml")
	}
	for _, a := range alerts {
		if !strings.Contains(string(readme), "| `"+a[1]+"` |") {
			t.Errorf("README_monitoring.md does not list alert %s", a[1])
		}
	}
}
