package main

import (
	"encoding"
	"fmt"
	"reflect"
	"strconv"
	"strings"
	"time"
)

// printConfig renders the effective configuration as TOML: every key with
// the value in force, sections in the order of config's fields, keys in the
// order of their struct fields. A secret (`toml:",secret"`) that is set is
// printed as a comment, `# token = (set, hidden)`, never its value. The
// decoder reads the output back to the same config, secrets written inline
// aside, so printing the result again gives the same text.
func printConfig(c config) string {
	var b strings.Builder
	v := reflect.ValueOf(&c).Elem() // addressable: text types marshal through pointers
	for i, f := range tomlFields(v.Type()) {
		fv := v.FieldByIndex(f.index)
		if i > 0 {
			b.WriteByte('\n')
		}
		if fv.Kind() == reflect.Slice && fv.Type().Elem().Kind() == reflect.Struct {
			for j := range fv.Len() {
				if j > 0 {
					b.WriteByte('\n')
				}
				printTable(&b, f.key, fv.Index(j), true)
			}
			continue
		}
		printTable(&b, f.key, fv, false)
	}
	return b.String()
}

// printTable writes one table's header, its keys, then its arrays of tables.
func printTable(b *strings.Builder, path string, v reflect.Value, array bool) {
	if array {
		fmt.Fprintf(b, "[[%s]]\n", path)
	} else {
		fmt.Fprintf(b, "[%s]\n", path)
	}
	type sub struct {
		key   string
		v     reflect.Value
		array bool
	}
	var tables []sub
	for _, f := range tomlFields(v.Type()) {
		fv := v.FieldByIndex(f.index)
		switch {
		case fv.Kind() == reflect.Slice && fv.Type().Elem().Kind() == reflect.Struct && !isText(fv.Type().Elem()):
			tables = append(tables, sub{f.key, fv, true})
			continue
		case fv.Kind() == reflect.Struct && !isText(fv.Type()):
			tables = append(tables, sub{f.key, fv, false})
			continue
		}
		if f.secret {
			if !fv.IsZero() {
				fmt.Fprintf(b, "# %s = (set, hidden)\n", f.key)
				continue
			}
		}
		fmt.Fprintf(b, "%s = %s\n", f.key, tomlValue(fv))
	}
	for _, t := range tables {
		if !t.array {
			printTable(b, path+"."+t.key, t.v, false)
			continue
		}
		for j := range t.v.Len() {
			printTable(b, path+"."+t.key, t.v.Index(j), true)
		}
	}
}

func isText(t reflect.Type) bool {
	return reflect.PointerTo(t).Implements(textUnmarshalerType)
}

// tomlValue is one value in the syntax the decoder reads.
func tomlValue(v reflect.Value) string {
	switch {
	case v.Type() == durationType:
		return tomlString(formatDuration(time.Duration(v.Int())))
	case isText(v.Type()):
		text, err := v.Addr().Interface().(encoding.TextMarshaler).MarshalText()
		if err != nil {
			return tomlString(err.Error())
		}
		return tomlString(string(text))
	}
	switch v.Kind() {
	case reflect.String:
		return tomlString(v.String())
	case reflect.Bool:
		return strconv.FormatBool(v.Bool())
	case reflect.Int, reflect.Int64, reflect.Int32:
		return strconv.FormatInt(v.Int(), 10)
	case reflect.Float64:
		s := strconv.FormatFloat(v.Float(), 'g', -1, 64)
		if !strings.ContainsAny(s, ".eEn") { // n: NaN, Inf
			s += ".0"
		}
		return s
	case reflect.Slice:
		parts := make([]string, v.Len())
		for i := range parts {
			parts[i] = tomlValue(v.Index(i))
		}
		return "[" + strings.Join(parts, ", ") + "]"
	}
	return tomlString(fmt.Sprint(v.Interface()))
}

// formatDuration is time.Duration's text without zero units: "10m", not
// "10m0s"; "0s" for zero.
func formatDuration(d time.Duration) string {
	s := d.String()
	if strings.HasSuffix(s, "m0s") {
		s = strings.TrimSuffix(s, "0s")
	}
	if strings.HasSuffix(s, "h0m") {
		s = strings.TrimSuffix(s, "0m")
	}
	return s
}

// tomlString quotes s as a TOML basic string.
func tomlString(s string) string {
	var b strings.Builder
	b.WriteByte('"')
	for _, r := range s {
		switch r {
		case '"':
			b.WriteString(`\"`)
		case '\\':
			b.WriteString(`\\`)
		case '\n':
			b.WriteString(`\n`)
		case '\t':
			b.WriteString(`\t`)
		case '\r':
			b.WriteString(`\r`)
		default:
			if r < 0x20 || r == 0x7f {
				fmt.Fprintf(&b, `\u%04X`, r)
			} else {
				b.WriteRune(r)
			}
		}
	}
	b.WriteByte('"')
	return b.String()
}
