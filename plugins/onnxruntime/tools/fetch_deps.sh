#!/usr/bin/env bash
# Fetch build-time headers without root: Debian trixie's libonnxruntime-dev (the onnxruntime
# C/C++ API) and libeigen3-dev (GEMM), downloaded with apt-get and unpacked into third_party/.
#
# The mirror is read from this machine's own apt configuration (one-line .list or deb822
# .sources files), so no host is written down here; only the suite is changed to trixie.
set -euo pipefail
here=$(cd "$(dirname "$0")/.." && pwd)  # the plugin folder
dest="$here/third_party"
packages=(libonnxruntime-dev libeigen3-dev)

if [ -f "$dest/.complete" ]; then
  exit 0
fi

codename=$(. /etc/os-release && echo "${VERSION_CODENAME:-}")

# Print the URIs that serve the base Debian suite (the one named like this release, not -security).
mirror_uris() {
  local file
  for file in /etc/apt/sources.list /etc/apt/sources.list.d/*.list; do
    [ -f "$file" ] || continue
    # deb [options] URI suite component...
    sed -e 's/#.*//' -e 's/\[[^]]*\]//' "$file" |
      awk -v c="$codename" '$1 == "deb" && $3 == c { print $2 }'
  done
  for file in /etc/apt/sources.list.d/*.sources; do
    [ -f "$file" ] || continue
    # Stanzas separated by blank lines; keep URIs of stanzas whose Suites include the codename.
    awk -v c="$codename" '
      function flush() { if (uris != "" && has) print uris; uris = ""; has = 0 }
      /^[[:space:]]*#/ { next }
      /^[[:space:]]*$/ { flush(); next }
      tolower($1) == "uris:" { for (i = 2; i <= NF; i++) uris = uris (uris ? "\n" : "") $i }
      tolower($1) == "suites:" { for (i = 2; i <= NF; i++) if ($i == c) has = 1 }
      END { flush() }' "$file"
  done
}

mapfile -t uris < <(mirror_uris | awk '!seen[$0]++')
if [ "${#uris[@]}" -eq 0 ]; then
  echo "fetch_deps: no Debian mirror for suite '${codename}' found in the apt configuration" >&2
  exit 1
fi

work=$(mktemp -d)
chmod 755 "$work"  # apt drops to its _apt user to download
trap 'rm -rf "$work"' EXIT
mkdir -p "$work/lists/partial" "$work/archives/partial"
for uri in "${uris[@]}"; do
  echo "deb $uri trixie main"
done >"$work/sources.list"

apt_opts=(
  -o "Dir::Etc::SourceList=$work/sources.list"
  -o "Dir::Etc::SourceParts=/dev/null"
  -o "Dir::State::Lists=$work/lists"
  -o "Dir::Cache=$work/cache"
  -o "Debug::NoLocking=1"
)
mkdir -p "$work/cache/archives/partial"
echo "fetch_deps: downloading ${packages[*]} (trixie) from the apt mirror"
apt-get "${apt_opts[@]}" -qq update
(cd "$work/archives" && apt-get "${apt_opts[@]}" -qq download "${packages[@]}")

rm -rf "$dest"
mkdir -p "$dest"
for deb in "$work"/archives/*.deb; do
  dpkg-deb -x "$deb" "$dest"
done
touch "$dest/.complete"
echo "fetch_deps: headers in $dest/usr/include"
