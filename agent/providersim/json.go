package providersim

import (
	"bytes"
	"encoding/json"
	"fmt"
	"net/http"
)

// object is a JSON object whose keys are written in the given order, so
// that answers read like the provider's (and golden files stay stable).
type object []field

type field struct {
	Key   string
	Value any
}

// MarshalJSON writes the fields in order.
func (o object) MarshalJSON() ([]byte, error) {
	var b bytes.Buffer
	b.WriteByte('{')
	for i, f := range o {
		if i > 0 {
			b.WriteByte(',')
		}
		k, err := json.Marshal(f.Key)
		if err != nil {
			return nil, fmt.Errorf("encoding key %q: %w", f.Key, err)
		}
		v, err := json.Marshal(f.Value)
		if err != nil {
			return nil, fmt.Errorf("encoding value of %q: %w", f.Key, err)
		}
		b.Write(k)
		b.WriteByte(':')
		b.Write(v)
	}
	b.WriteByte('}')
	return b.Bytes(), nil
}

// money encodes cents as a JSON number (10.5) or, like a PHP backend, as a
// string with two decimals ("10.50").
func money(cents int64, asString bool) any {
	if asString {
		return fmt.Sprintf("%d.%02d", cents/100, cents%100)
	}
	return float64(cents) / 100
}

// integer encodes n as a JSON number or a string ("13068").
func integer(n int, asString bool) any {
	if asString {
		return fmt.Sprint(n)
	}
	return n
}

func writeJSON(w http.ResponseWriter, status int, v any) {
	body, err := json.Marshal(v)
	if err != nil {
		// Only our own types are encoded; failing here is a bug in the simulator.
		writeText(w, http.StatusInternalServerError, "encoding answer: "+err.Error())
		return
	}
	w.Header().Set("Content-Type", "application/json")
	w.WriteHeader(status)
	_, _ = w.Write(body)
}

// writeError answers the provider's JSON error object.
func writeError(w http.ResponseWriter, status int, msg string) {
	writeJSON(w, status, object{{"error", msg}})
}
