package main

import (
	"encoding"
	"fmt"
	"reflect"
	"sort"
	"strings"
	"time"
)

// keyError is one problem of a config file, with the full path of its key
// (listener[1].address).
type keyError struct {
	Key string
	Msg string
	err error // the cause, when Msg is its text
}

func (e keyError) Unwrap() error { return e.err }

func (e keyError) Error() string {
	if e.Key == "" {
		return e.Msg
	}
	return e.Key + ": " + e.Msg
}

// decoder assigns a generic TOML tree onto a struct that already holds the
// defaults, by the fields' `toml` tags, and collects every problem with its
// full key path: unknown keys, wrong types, bare numbers where a duration is
// expected. A key that is absent leaves its field as it was, so a key that
// is present keeps the value the user wrote, zero included.
//
// BurntSushi/toml decodes structs itself, but it stops at the first problem,
// reads a bare number as nanoseconds for a time.Duration, and its
// Undecoded() loses array indexes, which `check` needs to name
// listener[1].adress. So the library parses the text into a tree, and this
// walks the tree.
type decoder struct {
	errs []keyError
	// written holds the key paths the file wrote (listener[0].upstream),
	// for the defaults that depend on other keys: they fill only what is
	// absent.
	written map[string]bool
	// newElem returns the starting value of a fresh element of a slice of
	// structs, so that each [[listener]] element gets the defaults on its own.
	newElem func(t reflect.Type) reflect.Value
}

var (
	durationType        = reflect.TypeFor[time.Duration]()
	textUnmarshalerType = reflect.TypeFor[encoding.TextUnmarshaler]()
)

func (d *decoder) fail(path, format string, args ...any) {
	d.errs = append(d.errs, keyError{Key: path, Msg: fmt.Sprintf(format, args...)})
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// tomlField is one key of a struct as the file writes it.
type tomlField struct {
	key    string
	index  []int // for reflect.Value.FieldByIndex: embedded structs are flattened
	secret bool  // `toml:"token,secret"`: never printed
}

// tomlFields lists the keys of a struct type in field order. An embedded
// struct without a tag contributes its own keys, so that a section can be
// one package's Config plus the keys the daemon adds (listenerConfig).
func tomlFields(t reflect.Type) []tomlField {
	var out []tomlField
	for i := range t.NumField() {
		f := t.Field(i)
		tag := f.Tag.Get("toml")
		if f.Anonymous && tag == "" && f.Type.Kind() == reflect.Struct {
			for _, sub := range tomlFields(f.Type) {
				sub.index = append([]int{i}, sub.index...)
				out = append(out, sub)
			}
			continue
		}
		name, opts, _ := strings.Cut(tag, ",")
		if name == "" || name == "-" || !f.IsExported() {
			continue
		}
		out = append(out, tomlField{key: name, index: []int{i}, secret: opts == "secret"})
	}
	return out
}

func (d *decoder) decodeStruct(path string, tree map[string]any, v reflect.Value) {
	fields := map[string]tomlField{}
	for _, f := range tomlFields(v.Type()) {
		fields[f.key] = f
	}
	keys := make([]string, 0, len(tree))
	for k := range tree {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		f, ok := fields[k]
		if !ok {
			d.fail(join(path, k), "unknown key")
			continue
		}
		if d.written == nil {
			d.written = make(map[string]bool)
		}
		d.written[join(path, k)] = true
		d.decodeValue(join(path, k), tree[k], v.FieldByIndex(f.index))
	}
}

func tomlType(x any) string {
	switch x.(type) {
	case string:
		return "a string"
	case int64:
		return "a number"
	case float64:
		return "a number"
	case bool:
		return "a boolean"
	case []any, []map[string]any:
		return "an array"
	case map[string]any:
		return "a table"
	case time.Time:
		return "a date"
	}
	return fmt.Sprintf("%T", x)
}

func (d *decoder) decodeValue(path string, x any, v reflect.Value) {
	switch {
	case v.Type() == durationType:
		s, ok := x.(string)
		if !ok {
			d.fail(path, "a duration must be a string such as \"30s\", got %s", tomlType(x))
			return
		}
		dur, err := time.ParseDuration(s)
		if err != nil {
			d.fail(path, "invalid duration %q (use a number with a unit: \"500ms\", \"30s\", \"10m\")", s)
			return
		}
		v.SetInt(int64(dur))
		return
	case reflect.PointerTo(v.Type()).Implements(textUnmarshalerType):
		s, ok := x.(string)
		if !ok {
			d.fail(path, "must be a string, got %s", tomlType(x))
			return
		}
		if err := v.Addr().Interface().(encoding.TextUnmarshaler).UnmarshalText([]byte(s)); err != nil {
			d.fail(path, "%v", err)
		}
		return
	}
	switch v.Kind() {
	case reflect.String:
		s, ok := x.(string)
		if !ok {
			d.fail(path, "must be a string, got %s", tomlType(x))
			return
		}
		v.SetString(s)
	case reflect.Bool:
		b, ok := x.(bool)
		if !ok {
			d.fail(path, "must be true or false, got %s", tomlType(x))
			return
		}
		v.SetBool(b)
	case reflect.Int, reflect.Int64, reflect.Int32:
		n, ok := x.(int64)
		if !ok {
			d.fail(path, "must be a whole number, got %s", tomlType(x))
			return
		}
		if v.OverflowInt(n) {
			d.fail(path, "%d is out of range", n)
			return
		}
		v.SetInt(n)
	case reflect.Float64:
		switch n := x.(type) {
		case int64:
			v.SetFloat(float64(n))
		case float64:
			v.SetFloat(n)
		default:
			d.fail(path, "must be a number, got %s", tomlType(x))
		}
	case reflect.Struct:
		tree, ok := x.(map[string]any)
		if !ok {
			d.fail(path, "must be a table, got %s", tomlType(x))
			return
		}
		d.decodeStruct(path, tree, v)
	case reflect.Slice:
		var elems []any
		switch a := x.(type) {
		case []any:
			elems = a
		case []map[string]any:
			for _, m := range a {
				elems = append(elems, m)
			}
		default:
			d.fail(path, "must be an array, got %s", tomlType(x))
			return
		}
		if len(elems) == 0 {
			// An empty array is the same as an absent one (nil), so that
			// `services = []` and no key compare equal on reload.
			v.Set(reflect.Zero(v.Type()))
			return
		}
		out := reflect.MakeSlice(v.Type(), 0, len(elems))
		for i, e := range elems {
			ev := reflect.New(v.Type().Elem()).Elem()
			if ev.Kind() == reflect.Struct && d.newElem != nil {
				ev.Set(d.newElem(ev.Type()))
			}
			d.decodeValue(fmt.Sprintf("%s[%d]", path, i), e, ev)
			out = reflect.Append(out, ev)
		}
		v.Set(out)
	default:
		d.fail(path, "cannot hold %s", tomlType(x))
	}
}
