#!/usr/bin/env bash
# The whole test suite: tools the tests need, go vet, go test -race over every
# package, every benchmark run once, then short fuzz runs of every fuzz
# target. Under CI=true a missing tool fails the run instead of letting its
# tests skip.
set -euo pipefail
cd "$(dirname "$0")"

FUZZTIME=${FUZZTIME:-4s}
export GOFLAGS=${GOFLAGS:--buildvcs=false}

# Tools: curl (client), squid (HTTP upstream), danted (SOCKS5 upstream),
# promtool (metrics and alert rules), openssl, chromium (status page tests).
# Debian package names beside them.
need=()
command -v curl >/dev/null 2>&1 || need+=(curl)
[ -x /usr/sbin/squid ] || need+=(squid)
[ -x /usr/sbin/danted ] || need+=(dante-server)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v openssl >/dev/null 2>&1 || need+=(openssl)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
if [ ${#need[@]} -gt 0 ]; then
	echo "test.sh: installing ${need[*]}"
	sudo=""
	[ "$(id -u)" -eq 0 ] || sudo="sudo"
	# The packages' own services (squid, danted, prometheus) are not ours
	# to run: the tests start their own instances on loopback. Debian's
	# policy-rc.d keeps a package install from starting its service; it is
	# in place only for the install, and only if the machine had none.
	policy=/usr/sbin/policy-rc.d
	own_policy=""
	if [ ! -e "$policy" ] && { [ -z "$sudo" ] || command -v sudo >/dev/null 2>&1; }; then
		printf '#!/bin/sh\n# proxyd test.sh: no service starts during this install\nexit 101\n' | $sudo tee "$policy" >/dev/null &&
			$sudo chmod 755 "$policy" && own_policy=1
	fi
	installed=""
	if { [ -z "$sudo" ] || command -v sudo >/dev/null 2>&1; } &&
		$sudo env DEBIAN_FRONTEND=noninteractive apt-get update -qq &&
		$sudo env DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${need[@]}" >/dev/null; then
		installed=1
	fi
	if [ -n "$own_policy" ]; then $sudo rm -f "$policy"; fi
	if [ -n "$installed" ]; then
		:
	else
		echo "test.sh: could not install ${need[*]}" >&2
		if [ "${CI:-}" = "true" ]; then exit 1; fi
		echo "test.sh: the tests that need them will be skipped" >&2
	fi
fi
if [ "${CI:-}" = "true" ]; then
	for t in curl /usr/sbin/squid /usr/sbin/danted promtool openssl chromium; do
		command -v "$t" >/dev/null 2>&1 || { echo "test.sh: CI=true and $t is missing" >&2; exit 1; }
	done
fi

echo "== go vet"
go vet ./...

echo "== cross builds (darwin, windows, 32-bit linux)"
GOOS=darwin go build ./...
GOOS=windows go build ./...
GOOS=linux GOARCH=386 go build ./...

echo "== cross vet (darwin, windows): the tests compile there too"
GOOS=darwin go vet ./...
GOOS=windows go vet ./...

echo "== go test -race"
go test -race -count=1 -timeout 12m ./...

echo "== benchmarks, one iteration each"
# That they still run; their figures mean nothing on a run this short (see
# BENCHMARKS.md for how to measure). 200 idle tunnels instead of 9,000 keep
# the idle benchmark inside a small open-files limit.
FORWARD_IDLE_TUNNELS=200 go test -run '^$' -bench . -benchtime 1x -timeout 5m ./...

echo "== fuzz (${FUZZTIME} each)"
# Every func FuzzXxx in a _test.go file, run alone in its package.
grep -rl --include='*_test.go' -E '^func Fuzz[A-Za-z0-9_]+\(' . | sort | while read -r file; do
	pkg=./$(dirname "${file#./}")
	grep -oE '^func Fuzz[A-Za-z0-9_]+' "$file" | sed 's/^func //' | while read -r fn; do
		echo "fuzz $pkg $fn"
		fuzz() { go test -run='^$' -fuzz="^${fn}\$" -fuzztime="$FUZZTIME" "$pkg" >/tmp/proxyd-fuzz.$$ 2>&1; }
		# Go 1.26's fuzz coordinator can report a bare "context deadline
		# exceeded" when -fuzztime ends under CPU contention (go.dev/issue/75804,
		# fixed in Go 1.27): no input failed and nothing was written. Such a run
		# is tried once more; any other failure fails at once.
		if ! fuzz; then
			if grep -q 'context deadline exceeded' /tmp/proxyd-fuzz.$$ &&
				! grep -qE 'Failing input written|panic:' /tmp/proxyd-fuzz.$$; then
				echo "fuzz $pkg $fn: the fuzzer's own deadline race (no failing input); once more"
				fuzz || { cat /tmp/proxyd-fuzz.$$; rm -f /tmp/proxyd-fuzz.$$; exit 1; }
			else
				cat /tmp/proxyd-fuzz.$$
				rm -f /tmp/proxyd-fuzz.$$
				exit 1
			fi
		fi
	done
done
rm -f /tmp/proxyd-fuzz.$$
echo "test.sh: all passed"
