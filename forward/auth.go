package forward

import (
	"crypto/subtle"
	"encoding/base64"
	"errors"
	"strings"
)

// errBadCredentials is any authentication failure; the client learns nothing more.
var errBadCredentials = errors.New("bad credentials")

// maxKeyLen is the longest sticky key: 1–64 characters.
const maxKeyLen = 64

// parseUsername splits a local proxy username into the local user and the
// sticky key: "session-<key>", "<user>-session-<key>" or "<user>". The key
// is what follows the first "-session-" (or the leading "session-"); it must be
// 1–64 of A–Z a–z 0–9 _ . — otherwise ok is false.
func parseUsername(name string) (user, key string, ok bool) {
	if rest, found := strings.CutPrefix(name, "session-"); found {
		if !validKey(rest) {
			return "", "", false
		}
		return "", rest, true
	}
	if i := strings.Index(name, "-session-"); i >= 0 {
		key = name[i+len("-session-"):]
		if !validKey(key) {
			return "", "", false
		}
		return name[:i], key, true
	}
	return name, "", true
}

func validKey(k string) bool {
	if len(k) == 0 || len(k) > maxKeyLen {
		return false
	}
	for i := 0; i < len(k); i++ {
		c := k[i]
		if !('a' <= c && c <= 'z' || 'A' <= c && c <= 'Z' || '0' <= c && c <= '9' || c == '_' || c == '.') {
			return false
		}
	}
	return true
}

// authenticator checks local credentials and derives the scoped sticky key.
type authenticator struct {
	users map[string]string // name → password; empty means no local users
}

func newAuthenticator(users []User) authenticator {
	a := authenticator{users: make(map[string]string, len(users))}
	for _, u := range users {
		a.users[u.Name] = u.Password
	}
	return a
}

func (a authenticator) required() bool { return len(a.users) > 0 }

// check validates a username/password (present reports whether the client
// sent any) and returns the sticky key, scoped per local user ("user\x00key"),
// or "" for none.
func (a authenticator) check(username, password string, present bool) (string, error) {
	if !present {
		if a.required() {
			return "", errBadCredentials
		}
		return "", nil
	}
	user, key, ok := parseUsername(username)
	if !ok {
		return "", errBadCredentials
	}
	if a.required() {
		want, found := a.users[user]
		// Compare even when the user is unknown, so timing says nothing.
		eq := subtle.ConstantTimeCompare([]byte(password), []byte(want)) == 1
		if !found || !eq {
			return "", errBadCredentials
		}
	}
	if key == "" {
		return "", nil
	}
	return user + "\x00" + key, nil
}

// parseBasic decodes a "Basic" Proxy-Authorization value.
func parseBasic(v string) (user, pass string, ok bool) {
	const prefix = "basic "
	if len(v) < len(prefix) || !strings.EqualFold(v[:len(prefix)], prefix) {
		return "", "", false
	}
	b, err := base64.StdEncoding.DecodeString(strings.TrimSpace(v[len(prefix):]))
	if err != nil {
		return "", "", false
	}
	user, pass, ok = strings.Cut(string(b), ":")
	return user, pass, ok
}
