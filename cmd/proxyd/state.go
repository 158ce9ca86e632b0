package main

import (
	"encoding/json"
	"errors"
	"fmt"
	"os"
	"path/filepath"
	"time"

	"github.com/proxyd/proxyd/pool"
)

// stateFileName is the last known pool inside [state] dir. It holds upstream
// credentials: mode 0600, written atomically.
const stateFileName = "pool.json"

const stateVersion = 1

// savedState is what survives restarts and API outages: the upstream set and
// the provider's last word on its health.
type savedState struct {
	Version int       `json:"version"`
	Saved   time.Time `json:"saved"`
	// BaseURL is the provider the pool's lists last came from (as
	// agent.ProviderURL spells it: scheme and host in lower case, no
	// trailing slash), also after a round in which some service failed: a
	// restart against another one does not serve the pool (empty, as in
	// files from before it was kept, or before any list was fetched:
	// served).
	BaseURL string `json:"base_url,omitempty"`
	// Fetched is the last successful refresh of the lists the upstreams
	// come from (zero if none yet): proxyd_state_age_seconds counts from
	// it. It moves once per lists round, so the file is rewritten that
	// often even when nothing else changed.
	Fetched   time.Time                 `json:"fetched,omitzero"`
	Upstreams []savedUpstream           `json:"upstreams"`
	Status    map[int]savedStatus       `json:"status,omitempty"`
	Usage     map[int]pool.ServiceUsage `json:"usage,omitempty"` // ppr services' rate and limit: the quota state follows from them
}

// savedUpstream has the fields of agent.UpstreamSpec, in their JSON names, so
// that loading converts it to one (and fails to compile when they part).
type savedUpstream struct {
	Service  int    `json:"service"`
	Kind     string `json:"kind"`
	Protocol string `json:"protocol"`
	Address  string `json:"address"`
	Username string `json:"username,omitempty"`
	Password string `json:"password,omitempty"`
	Server   string `json:"server,omitempty"`
	Session  string `json:"session,omitempty"`
	ExitIP   string `json:"exit_ip,omitempty"`
	Match    string `json:"match,omitempty"`
	StatusIP string `json:"status_ip,omitempty"`
}

type savedStatus struct {
	Errored  []string `json:"errored,omitempty"`
	Inactive []string `json:"inactive,omitempty"`
}

// writeState replaces dir/pool.json atomically: a temp file in the same
// directory, fsync, rename, fsync of the directory.
func writeState(dir string, s *savedState) error {
	if err := os.MkdirAll(dir, 0o700); err != nil {
		return fmt.Errorf("creating state dir: %w", err)
	}
	b, err := json.Marshal(s)
	if err != nil {
		return fmt.Errorf("encoding state: %w", err)
	}
	f, err := os.CreateTemp(dir, ".pool-*.tmp")
	if err != nil {
		return fmt.Errorf("writing state: %w", err)
	}
	tmp := f.Name()
	ok := false
	defer func() {
		if !ok {
			f.Close()
			os.Remove(tmp)
		}
	}()
	if err := f.Chmod(0o600); err != nil {
		return fmt.Errorf("writing state: %w", err)
	}
	if _, err := f.Write(b); err != nil {
		return fmt.Errorf("writing state: %w", err)
	}
	if err := f.Sync(); err != nil {
		return fmt.Errorf("writing state: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("writing state: %w", err)
	}
	if err := os.Rename(tmp, filepath.Join(dir, stateFileName)); err != nil {
		return fmt.Errorf("writing state: %w", err)
	}
	ok = true
	if d, err := os.Open(dir); err == nil {
		d.Sync()
		d.Close()
	}
	return nil
}

// readState loads dir/pool.json; a missing file is (nil, nil).
func readState(dir string) (*savedState, error) {
	b, err := os.ReadFile(filepath.Join(dir, stateFileName))
	if errors.Is(err, os.ErrNotExist) {
		return nil, nil
	}
	if err != nil {
		return nil, fmt.Errorf("reading state: %w", err)
	}
	var s savedState
	if err := json.Unmarshal(b, &s); err != nil {
		return nil, fmt.Errorf("reading state %s: %w", filepath.Join(dir, stateFileName), err)
	}
	if s.Version != stateVersion {
		return nil, fmt.Errorf("reading state: version %d, want %d", s.Version, stateVersion)
	}
	return &s, nil
}
