package main

import (
	"net/netip"
	"reflect"
	"strings"
	"testing"
	"time"

	"github.com/BurntSushi/toml"

	"github.com/proxyd/proxyd/forward"
)

// decodeAll holds every kind of field the config sections use.
type decodeAll struct {
	inner
	S      string            `toml:"s"`
	B      bool              `toml:"b"`
	I      int               `toml:"i"`
	F      float64           `toml:"f"`
	D      time.Duration     `toml:"d"`
	Addr   netip.Addr        `toml:"addr"`
	Nets   []forward.Network `toml:"nets"`
	Ints   []int             `toml:"ints"`
	Strs   []string          `toml:"strs"`
	Table  inner             `toml:"table"`
	Tables []inner           `toml:"tables"`
	Secret string            `toml:"secret,secret"`
	Skip   func()            `toml:"-"`
}

type inner struct {
	Name string `toml:"name"`
	N    int    `toml:"n"`
}

func decodeText(t *testing.T, text string, v *decodeAll) []keyError {
	t.Helper()
	var tree map[string]any
	if _, err := toml.Decode(text, &tree); err != nil {
		t.Fatal(err)
	}
	d := decoder{newElem: func(t reflect.Type) reflect.Value {
		if t == reflect.TypeFor[inner]() {
			return reflect.ValueOf(inner{N: 42}) // each element starts from its defaults
		}
		return reflect.New(t).Elem()
	}}
	d.decodeStruct("", tree, reflect.ValueOf(v).Elem())
	return d.errs
}

// TestDecoderFieldTypes: every field type the sections use decodes, keys
// that are absent keep what the struct held, present ones keep what the
// file says (zero included), and the printer writes what the decoder reads.
func TestDecoderFieldTypes(t *testing.T) {
	text := `
name = "embedded"
s = "x"
b = true
i = 0
f = 2
d = "1m30s"
addr = "192.0.2.1"
nets = ["10.0.0.0/8", "192.0.2.7", "2001:db8::/32"]
ints = [1, 2]
strs = []
secret = "hush"
[table]
name = "t"
[[tables]]
name = "a"
[[tables]]
n = 0
`
	v := decodeAll{I: 7, F: 1, inner: inner{N: 5}}
	if errs := decodeText(t, text, &v); len(errs) > 0 {
		t.Fatal(errs)
	}
	want := decodeAll{
		inner: inner{Name: "embedded", N: 5}, S: "x", B: true, I: 0, F: 2, D: 90 * time.Second,
		Addr: netip.MustParseAddr("192.0.2.1"),
		Nets: []forward.Network{forward.MustParseNetwork("10.0.0.0/8"), forward.MustParseNetwork("192.0.2.7/32"),
			forward.MustParseNetwork("2001:db8::/32")},
		Ints: []int{1, 2}, Strs: nil, Table: inner{Name: "t"}, // an empty array is an absent one
		Tables: []inner{{Name: "a", N: 42}, {N: 0}}, Secret: "hush",
	}
	if !reflect.DeepEqual(v, want) {
		t.Errorf("decoded\n%+v\nwant\n%+v", v, want)
	}
	// The printer writes every type so that the decoder reads it back.
	var b strings.Builder
	printTable(&b, "x", reflect.ValueOf(&v).Elem(), false)
	text = strings.Replace(b.String(), "[x]\n", "", 1)
	text = strings.ReplaceAll(text, "[x.", "[")
	text = strings.ReplaceAll(text, "[[x.", "[[")
	var again decodeAll
	if errs := decodeText(t, text, &again); len(errs) > 0 {
		t.Fatalf("%v in the printed\n%s", errs, text)
	}
	want.Secret = "" // printed as a comment
	if !reflect.DeepEqual(again, want) {
		t.Errorf("printed and read back\n%+v\nwant\n%+v\nfrom\n%s", again, want, text)
	}
}

// TestDecoderProblems: every problem comes at once, each with its full path.
func TestDecoderProblems(t *testing.T) {
	text := `
s = 1
b = "yes"
i = 1.5
f = "x"
d = 30
addr = "not-an-ip"
nets = ["10.0.0.0/33"]
ints = ["1"]
table = 3
bogus = 1
[[tables]]
nam = "typo"
`
	var v decodeAll
	var got []string
	for _, e := range decodeText(t, text, &v) {
		got = append(got, e.Error())
	}
	want := []string{
		`addr: ParseAddr("not-an-ip"): unable to parse IP`,
		"b: must be true or false, got a string",
		"bogus: unknown key",
		`d: a duration must be a string such as "30s", got a number`,
		"f: must be a number, got a string",
		"i: must be a whole number, got a number",
		"ints[0]: must be a whole number, got a string",
		`nets[0]: must be a network such as "10.0.0.0/8" or an IP address, got "10.0.0.0/33"`,
		"s: must be a string, got a number",
		"table: must be a table, got a number",
		"tables[0].nam: unknown key",
	}
	if strings.Join(got, "\n") != strings.Join(want, "\n") {
		t.Errorf("problems:\n%s\nwant:\n%s", strings.Join(got, "\n"), strings.Join(want, "\n"))
	}
}
