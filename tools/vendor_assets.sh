#!/usr/bin/env bash
# Put the JavaScript the website needs into _vendor/static/ (git-ignored), so that every page
# works with the network closed: nothing is fetched from a CDN when a reader opens a page.
#
#   mathjax/   MathJax 3: tex-mml-chtml.js, its CHTML fonts, the TeX extensions it autoloads,
#              the menu and the accessibility tools (English speech rules)
#   widgets/   require.js and @jupyter-widgets/html-manager's embed-amd.js (with its icon
#              fonts), which draw saved ipywidgets from their build-time state, no kernel
#
# and, for the tests only, into _vendor/test/ (not on the static path: readers never get it):
#
#   axe-core/  axe.min.js, the accessibility checker tests/test_browser.py runs in every page
#
# The packages come from the npm registry (`npm pack`, through npm's cache), pinned to a version
# and checked against the sha512 below. _config.yml puts _vendor/static on html_static_path, so
# Sphinx copies it to _build/html/_static/. `make book` and `make student` run this script; it
# does nothing when _vendor/ already holds these versions (delete _vendor/ to redo it).
set -euo pipefail
cd "$(dirname "$0")/.."

DEST=_vendor/static
TEST_DEST=_vendor/test
# name@version  sha512 (as npm's "integrity")
PACKAGES=(
  "mathjax@3.2.2 sha512-Bt+SSVU8eBG27zChVewOicYs7Xsdt40qm4+UpHyX7k0/O9NliPc+x77k1/FEsPsjKPZGJvtRZM1vO+geW0OhGw=="
  "@jupyter-widgets/html-manager@1.0.15 sha512-5thBIV6ymNgmPVOHvzx+gGy8ZSKmSazhtGw4/c4xJDVzRhG9PTeQsRjF3FUTopvFi//SABeNz1yp47bCrJ3CQA=="
  "requirejs@2.3.8 sha512-7/cTSLOdYkNBNJcDMWf+luFvMriVm7eYxp4BcFCsAX0wF421Vyce5SXP17c+Jd5otXKGNehIonFlyQXSowL6Mw=="
  "axe-core@4.14.1 sha512-FHfa+lmNjQZfJz1q8wKqIDwC6DExcHt/pkjNQb09a3NPjCKg2rhu5qb2S4r76ASyFNNtuFooJpZe37OgudVGtQ=="
)
want="$(printf '%s\n' "${PACKAGES[@]}")"
if [[ -f $DEST/VERSIONS && "$(cat "$DEST/VERSIONS")" == "$want" \
      && -f $TEST_DEST/axe-core/axe.min.js ]]; then
  exit 0
fi

if ! command -v npm >/dev/null || ! command -v node >/dev/null; then
  echo "tools/vendor_assets.sh: npm and node are needed once, to fetch MathJax, the widget" >&2
  echo "  scripts and axe-core from the npm registry (Debian/Ubuntu: apt-get install nodejs npm;" >&2
  echo "  elsewhere: https://nodejs.org)." >&2
  exit 1
fi

tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT
echo "Fetching the website's scripts from the npm registry into $DEST/ ..."
for entry in "${PACKAGES[@]}"; do
  spec="${entry%% *}" integrity="${entry##* }"
  tarball="$(cd "$tmp" && npm pack --silent --loglevel=error --prefer-offline "$spec" 2>/dev/null | tail -n 1)"
  if [[ -z $tarball || ! -f $tmp/$tarball ]]; then
    echo "tools/vendor_assets.sh: 'npm pack $spec' failed: is the npm registry reachable?" >&2
    exit 1
  fi
  got="sha512-$(node -e 'const c=require("crypto"),f=require("fs");
    process.stdout.write(c.createHash("sha512").update(f.readFileSync(process.argv[1])).digest("base64"))' \
    "$tmp/$tarball")"
  if [[ $got != "$integrity" ]]; then
    echo "tools/vendor_assets.sh: $spec does not match its pinned sha512 (got $got)" >&2
    exit 1
  fi
  name="${spec%@*}"
  mkdir -p "$tmp/pkg/$name"
  tar -xzf "$tmp/$tarball" -C "$tmp/pkg/$name" --strip-components=1
done

new="$tmp/static"
mkdir -p "$new/mathjax/sre/mathmaps" "$new/mathjax/input/tex" "$new/mathjax/output/chtml" \
  "$new/widgets"
mj="$tmp/pkg/mathjax"
cp "$mj/LICENSE" "$new/mathjax/LICENSE"
cp "$mj/es5/tex-mml-chtml.js" "$new/mathjax/"
cp -R "$mj/es5/ui" "$mj/es5/a11y" "$new/mathjax/"
cp -R "$mj/es5/input/tex/extensions" "$new/mathjax/input/tex/"
cp -R "$mj/es5/output/chtml/fonts" "$new/mathjax/output/chtml/"
cp "$mj/es5/sre/mathmaps/"{base,en,nemeth}.json "$new/mathjax/sre/mathmaps/"

hm="$tmp/pkg/@jupyter-widgets/html-manager/dist"
cp "$hm/embed-amd.js" "$hm/embed.js.LICENSE.txt" "$new/widgets/"
cp "$hm/"*.woff2 "$hm/"*.woff "$new/widgets/"  # the icon fonts embed-amd.js asks for
cp "$tmp/pkg/requirejs/require.js" "$new/widgets/require.js"
printf '%s\n' "$want" > "$new/VERSIONS"

new_test="$tmp/test"
mkdir -p "$new_test/axe-core"
cp "$tmp/pkg/axe-core/axe.min.js" "$tmp/pkg/axe-core/LICENSE" "$new_test/axe-core/"

rm -rf "$DEST" "$TEST_DEST"
mkdir -p "$(dirname "$DEST")" "$(dirname "$TEST_DEST")"
mv "$new_test" "$TEST_DEST"
mv "$new" "$DEST"  # last: its VERSIONS says everything is in place
echo "$DEST: $(du -sh "$DEST" | cut -f1) ($(find "$DEST" -type f | wc -l) files)"
echo "$TEST_DEST: $(du -sh "$TEST_DEST" | cut -f1) ($(find "$TEST_DEST" -type f | wc -l) files)"
