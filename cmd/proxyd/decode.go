package main

import (
	"fmt"
	"reflect"
	"sort"
	"strings"
	"time"
)

// duration is a config duration: always a string such as "30s". A bare
// number is an error, never nanoseconds.
type duration time.Duration

func (d duration) D() time.Duration { return time.Duration(d) }

func (d duration) String() string { return time.Duration(d).String() }

var durationType = reflect.TypeOf(duration(0))

// keyError is one problem of a config file, with the full path of its key
// (listener[1].address).
type keyError struct {
	Key string
	Msg string
}

func (e keyError) Error() string {
	if e.Key == "" {
		return e.Msg
	}
	return e.Key + ": " + e.Msg
}

// decoder assigns a generic TOML tree to a struct by its `toml` tags and
// collects every problem with its full key path: unknown keys, wrong types,
// bare numbers where a duration is expected. BurntSushi/toml's own struct
// decoding stops at the first problem and its Undecoded() loses array
// indexes, which `check` needs.
type decoder struct {
	errs []keyError
	// newElem returns the default value of a fresh element of a slice of
	// structs, so that [[listener]] elements get defaults one by one.
	newElem func(t reflect.Type) reflect.Value
}

func (d *decoder) fail(path, format string, args ...any) {
	d.errs = append(d.errs, keyError{Key: path, Msg: fmt.Sprintf(format, args...)})
}

func join(path, key string) string {
	if path == "" {
		return key
	}
	return path + "." + key
}

// fieldsByTag maps toml keys to struct field indexes.
func fieldsByTag(t reflect.Type) map[string]int {
	m := make(map[string]int, t.NumField())
	for i := 0; i < t.NumField(); i++ {
		f := t.Field(i)
		tag := strings.Split(f.Tag.Get("toml"), ",")[0]
		if tag == "" || tag == "-" || !f.IsExported() {
			continue
		}
		m[tag] = i
	}
	return m
}

func (d *decoder) decodeStruct(path string, tree map[string]any, v reflect.Value) {
	fields := fieldsByTag(v.Type())
	keys := make([]string, 0, len(tree))
	for k := range tree {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		i, ok := fields[k]
		if !ok {
			d.fail(join(path, k), "unknown key")
			continue
		}
		d.decodeValue(join(path, k), tree[k], v.Field(i))
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
	if v.Type() == durationType {
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
	case reflect.Int, reflect.Int64:
		n, ok := x.(int64)
		if !ok {
			d.fail(path, "must be a whole number, got %s", tomlType(x))
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
