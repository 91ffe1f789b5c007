#!/usr/bin/env bash
# Installs the system tools the transport tests and TLS sidecars use, where the
# machine allows it: stunnel (Debian's stunnel4), iproute2 and iptables (with ip6tables).
# As root with apt-get, missing packages are installed (`apt-get update` once,
# then `apt-get install`); otherwise this prints what is missing and exits 0,
# and the tests that need a tool skip with a reason naming it.
set -uo pipefail
missing=()
command -v stunnel4 >/dev/null 2>&1 || command -v stunnel >/dev/null 2>&1 || missing+=(stunnel4)
command -v ip >/dev/null 2>&1 || missing+=(iproute2)
{ command -v iptables && command -v ip6tables; } >/dev/null 2>&1 || missing+=(iptables)  # ip6tables comes with it
if [ ${#missing[@]} -eq 0 ]; then
  exit 0
fi
if [ "$(id -u)" -ne 0 ] || ! command -v apt-get >/dev/null 2>&1; then
  echo "system-deps: missing ${missing[*]}; install them (e.g. 'sudo apt-get install ${missing[*]}')" \
       "to run the transport tests, which skip without them." >&2
  exit 0
fi
echo "system-deps: installing ${missing[*]} with apt-get"
if ! { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}"; } >/dev/null; then
  echo "system-deps: apt-get could not install ${missing[*]}; the transport tests will skip." >&2
fi
exit 0
