#!/usr/bin/env bash
# Takes a wheel to a machine without network in parts: bash scripts/tools/wheel_parts.sh pack WHEEL | collect NAME SITE
# For wheels over what one transfer to the GPU machine may hold (64 MiB): the contents xz-compressed in one tar,
# split under .whl_parts/<name>/ with a manifest (part count, sha256 of the whole). Each transfer carries one
# part and the MANIFEST, and `collect` (scripts/gpu/measure.sh runs it) keeps the parts under
# /tmp/wheel_parts/<name> (they stay while the machine does) and, once every part is there, checks the sha256
# and unpacks the wheel's contents into the site folder (as `pip install --target` would).
#   here:            bash scripts/tools/wheel_parts.sh pack <wheel> [part MiB, default 40]
#   on the machine:  bash scripts/tools/wheel_parts.sh collect <name> /tmp/site
set -euo pipefail
cmd=${1:?usage: wheel_parts.sh pack <wheel> [MiB] | collect <name> <site>}
case "$cmd" in
  pack)
    wheel=${2:?the wheel to pack}; mib=${3:-40}
    name=$(basename "$wheel" .whl); out=.whl_parts/$name
    rm -rf "$out" && mkdir -p "$out"
    tmp=$(mktemp -d); trap 'rm -rf "$tmp"' EXIT
    python3 -m zipfile -e "$wheel" "$tmp/contents"
    tar -C "$tmp/contents" -cf - . | xz -T0 -6 > "$tmp/all.tar.xz"
    split -b "${mib}M" "$tmp/all.tar.xz" "$out/part_"
    { echo "parts $(ls "$out" | grep -c '^part_')"; echo "sha256 $(sha256sum "$tmp/all.tar.xz" | cut -d' ' -f1)"; } \
      > "$out/MANIFEST"
    grep -qx '/.whl_parts/' .git/info/exclude 2>/dev/null || echo /.whl_parts/ >> .git/info/exclude
    ls -la "$out"; cat "$out/MANIFEST" ;;
  collect)
    name=${2:?the packed wheel name}; site=${3:?the site folder}
    src=.whl_parts/$name; keep=/tmp/wheel_parts/$name
    [ -f "$src/MANIFEST" ] || { echo "no $src/MANIFEST: carry it with the part" >&2; exit 2; }
    mkdir -p "$keep" && cp "$src"/part_* "$src/MANIFEST" "$keep"/ 2>/dev/null || true
    want=$(awk '$1 == "parts" {print $2}' "$keep/MANIFEST"); have=$(ls "$keep" | grep -c '^part_' || true)
    if [ "$have" -lt "$want" ]; then echo "$name: $have of $want parts here; carry the next one"; exit 0; fi
    sum=$(cat "$keep"/part_* | sha256sum | cut -d' ' -f1)
    [ "$sum" = "$(awk '$1 == "sha256" {print $2}' "$keep/MANIFEST")" ] || { echo "$name: sha256 mismatch" >&2; exit 1; }
    mkdir -p "$site" && cat "$keep"/part_* | xz -d | tar -C "$site" -xf -
    echo "$name: unpacked into $site" ;;
  *) echo "unknown command $cmd (pack | collect)" >&2; exit 2 ;;
esac
