package agent

import (
	"bytes"
	"cmp"
	"encoding/json"
	"errors"
	"fmt"
	"maps"
	"slices"
	"strconv"
	"strings"
)

// wrapKeys are the object keys under which a list may be wrapped
// ({"data": [...]}), tried in this order.
var wrapKeys = [...]string{"data", "list", "items", "result", "results", "sessions", "proxies"}

// decodeArray returns the elements of a JSON list. It accepts an array,
// null, an empty body, an empty object (PHP's json_encode of an empty array
// sometimes gives {}), an object wrapping an array under one of wrapKeys, and
// an object with numeric keys (a PHP array with gaps), in key order.
func decodeArray(body []byte) ([]json.RawMessage, error) {
	body = bytes.TrimSpace(body)
	if len(body) == 0 || string(body) == "null" {
		return nil, nil
	}
	switch body[0] {
	case '[':
		var elems []json.RawMessage
		if err := json.Unmarshal(body, &elems); err != nil {
			return nil, err
		}
		return elems, nil
	case '{':
		var obj map[string]json.RawMessage
		if err := json.Unmarshal(body, &obj); err != nil {
			return nil, err
		}
		if len(obj) == 0 {
			return nil, nil
		}
		for _, key := range wrapKeys {
			if raw, ok := lookupFold(obj, key); ok {
				raw = bytes.TrimSpace(raw)
				if len(raw) > 0 && (raw[0] == '[' || raw[0] == '{' || string(raw) == "null") {
					elems, err := decodeArray(raw)
					if err == nil && len(elems) == 0 && emptyBesideError(obj) {
						return nil, ErrListRefused
					}
					return elems, err
				}
			}
		}
		elems := make([]json.RawMessage, 0, len(obj))
		for _, k := range sortedKeys(obj) {
			if _, err := strconv.Atoi(k); err != nil {
				return nil, errors.New("expected a list, got an object")
			}
			elems = append(elems, obj[k])
		}
		return elems, nil
	}
	return nil, fmt.Errorf("expected a list, got %q", excerpt(body, maxValueExcerpt))
}

// emptyBesideError reports whether a wrapper object whose list is empty
// carries the provider's error message too ({"data": [], "error": "Service
// is not active"}): the list is not known to be empty, and must not empty
// what proxyd holds.
func emptyBesideError(obj map[string]json.RawMessage) bool {
	return !noError(stringField(obj, "error"))
}

// decodeList decodes a JSON list of objects into []T through decodeArray.
func decodeList[T any](body []byte) ([]T, error) {
	elems, err := decodeArray(body)
	if err != nil {
		return nil, err
	}
	out := make([]T, 0, len(elems))
	for i, raw := range elems {
		var v T
		if err := json.Unmarshal(raw, &v); err != nil {
			return nil, fmt.Errorf("element %d: %w", i, err)
		}
		out = append(out, v)
	}
	return out, nil
}

// decodeObject decodes a JSON object into v and requires at least one of the
// known keys, so that an empty answer ({} or []) is an error rather than a
// zero value.
func decodeObject(body []byte, v any, known ...string) error {
	body = bytes.TrimSpace(body)
	if len(body) == 0 {
		return errors.New("empty body")
	}
	var obj map[string]json.RawMessage
	if err := json.Unmarshal(body, &obj); err != nil {
		// A one-element array holding the object is accepted too.
		var arr []json.RawMessage
		if json.Unmarshal(body, &arr) == nil {
			if len(arr) == 0 {
				return errors.New("empty list instead of an object")
			}
			if first := bytes.TrimSpace(arr[0]); len(arr) == 1 && len(first) > 0 && first[0] == '{' {
				return decodeObject(first, v, known...)
			}
		}
		return err
	}
	found := false
	for _, k := range known {
		if _, ok := lookupFold(obj, k); ok {
			found = true
			break
		}
	}
	if !found {
		return fmt.Errorf("none of the expected fields (%s) present", strings.Join(known, ", "))
	}
	return json.Unmarshal(body, v)
}

// lookupFold finds key in obj, exactly or else case-insensitively.
func lookupFold(obj map[string]json.RawMessage, key string) (json.RawMessage, bool) {
	if v, ok := obj[key]; ok {
		return v, true
	}
	for k, v := range obj {
		if strings.EqualFold(k, key) {
			return v, true
		}
	}
	return nil, false
}

// sortedKeys returns the keys of a decoded JSON object, numeric keys first
// in numeric order (a PHP array's indexes), then the others in byte order,
// so that lists keep their order and duplicates resolve the same way every
// time.
func sortedKeys[V any](obj map[string]V) []string {
	keys := slices.Collect(maps.Keys(obj))
	slices.SortFunc(keys, func(a, b string) int {
		na, errA := strconv.Atoi(a)
		nb, errB := strconv.Atoi(b)
		switch {
		case errA == nil && errB == nil:
			return cmp.Compare(na, nb)
		case errA == nil:
			return -1
		case errB == nil:
			return 1
		}
		return strings.Compare(a, b)
	})
	return keys
}

// normKey lowercases a key and drops '_' and '-', so that "session_id",
// "sessionId" and "SessionID" compare equal.
func normKey(k string) string {
	return strings.Map(func(r rune) rune {
		switch {
		case r == '_' || r == '-' || r == ' ':
			return -1
		case r >= 'A' && r <= 'Z':
			return r + 'a' - 'A'
		}
		return r
	}, k)
}
