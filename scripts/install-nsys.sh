#!/usr/bin/env bash
# Install the Nsight Systems CLI (Debian non-free, 2023.4) into a private prefix, usable on a
# machine without a GPU: `nsys profile` (NVTX), `nsys export`, `nsys stats`.
#
#   scripts/install-nsys.sh [PREFIX]      # default: ~/.cache/kimi-perf/nsys; prints PREFIX/bin/nsys
#
# The apt configuration is derived from this machine's own Debian sources (components and the
# suite that carries the package added), kept under PREFIX, so the system's apt is untouched.
# Two fixes make `nsys profile` work from the Debian packages (docs/nsys-on-a-cpu.md): the
# importer must sit beside the nsys binary (an overlay directory with a copy of the binary),
# and the importer needs libssh (package libssh-4).
set -euo pipefail

case ${1:-} in
  -h|--help) sed -n '2,/^set -euo/p' "$0" | sed -e '$d' -e 's/^# \{0,1\}//'; exit 0 ;;
  -*) echo "install-nsys: unknown option $1 (usage: scripts/install-nsys.sh [PREFIX])" >&2
      exit 2 ;;
esac
prefix=${1:-$HOME/.cache/kimi-perf/nsys}
wrapper=$prefix/bin/nsys
if [ -x "$wrapper" ] && "$wrapper" --version >/dev/null 2>&1; then
  echo "$wrapper"
  exit 0
fi

sources=/etc/apt/sources.list.d/debian.sources
[ -r "$sources" ] || { echo "install-nsys: $sources not found (Debian only)" >&2; exit 1; }
apt_dir=$prefix/apt
mkdir -p "$apt_dir/lists/partial" "$apt_dir/cache/archives/partial" "$apt_dir/sources.d" \
  "$prefix/debs" "$prefix/root"
# The system's own entries, with every component, plus (in the first entry, the archive's
# own: a security archive's suites are named otherwise) the suite that has 2023.4.
sed -e 's/^Components:.*/Components: main contrib non-free non-free-firmware/' \
    -e '0,/^Suites:/{/^Suites:.*\btrixie\b/!s/^Suites:.*/& trixie/}' \
    "$sources" > "$apt_dir/sources.d/debian.sources"
: > "$apt_dir/sources.list"
cat > "$apt_dir/apt.conf" <<EOF
Dir::Etc::SourceList "$apt_dir/sources.list";
Dir::Etc::SourceParts "$apt_dir/sources.d";
Dir::State::Lists "$apt_dir/lists";
Dir::Cache "$apt_dir/cache";
EOF
export APT_CONFIG=$apt_dir/apt.conf
apt-get -q update >/dev/null
version=$(apt-cache madison nsight-systems | awk '$3 ~ /^2023\.4/ {print $3; exit}')
[ -n "$version" ] || { echo "install-nsys: no nsight-systems 2023.4 in the archive" >&2; exit 1; }
(cd "$prefix/debs" && apt-get -q download "nsight-systems=$version" \
  "nsight-systems-target=$version" libssh-4 >/dev/null 2>&1)
for deb in "$prefix"/debs/*.deb; do dpkg-deb -x "$deb" "$prefix/root"; done

target=$prefix/root/usr/lib/x86_64-linux-gnu/nsight-systems/target-linux-x64
host=$prefix/root/usr/lib/nsight-systems/host-linux-x64
overlay=$prefix/overlay
rm -rf "$overlay" && mkdir -p "$overlay/target-linux-x64"
for f in "$target"/*; do ln -s "$f" "$overlay/target-linux-x64/"; done
rm "$overlay/target-linux-x64/nsys" && cp "$target/nsys" "$overlay/target-linux-x64/nsys"
ln -s "$host" "$overlay/host-linux-x64"
libs=$prefix/root/usr/lib/x86_64-linux-gnu
[ -e "$libs/libssh.so" ] || ln -sf libssh.so.4 "$libs/libssh.so"
# `nsys stats` reports import nsysstats from nsys's own python/lib; Debian moved it (and
# gpustats) to dist-packages, where nsys's embedded Python does not look.
for module in nsysstats gpustats; do
  ln -sf "$prefix/root/usr/lib/python3/dist-packages/$module.py" "$host/python/lib/$module.py"
done

mkdir -p "$prefix/bin"
cat > "$wrapper" <<EOF
#!/bin/sh
export LD_LIBRARY_PATH=$libs\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}
exec $overlay/target-linux-x64/nsys "\$@"
EOF
chmod +x "$wrapper"
"$wrapper" --version >/dev/null
echo "$wrapper"
