#!/usr/bin/env bash
# A/B of this tree against an earlier commit in one job on the GPU machine, for changes that no
# environment switch turns off (a rewritten loop, a new kernel): both binaries built in the same
# job and run alternately on the same GPU, so the difference is not the machine's.
#
#   here:        scripts/gpu_ab.sh prepare BASE
#                  BASE's versions of the tracked files under src/, tests/ and cmake/ and of the
#                  CMakeLists that differ from this tree, into .ab-base/ (ignored by git)
#   GPU machine: scripts/gpu_ab.sh run [ROUNDS] -- BENCH ARGS...      (carry .deps, .third_party and .ab-base)
#                  builds kestrel from this tree, then with BASE's files swapped in (in a build
#                  directory of its own), restores this tree, runs `kestrel bench BENCH ARGS` ROUNDS times
#                  (default 2) alternately, this tree first, and prints the median ms per step of
#                  each batch and their ratio. Results in $OUT/ab (or ./out/ab).
#   here:        scripts/gpu_ab.sh check
#                  swaps BASE's files in, checks the paths file by file against BASE, restores, and
#                  checks that nothing else changed (what `run` does to the tree, without a GPU).
set -euo pipefail
cd "$(dirname "$0")/.."
AB=.ab-base
PATHS=(src tests cmake CMakeLists.txt)

die() { echo "gpu_ab.sh: $*" >&2; exit 1; }

prepare() {
  local base
  base=$(git rev-parse --verify --quiet "$1^{commit}") || die "no commit '$1'"
  rm -rf "$AB"
  mkdir -p "$AB/files"
  : >"$AB/added"
  local status path
  # Against the working tree: M and D (BASE's version goes in), A (this tree only: removed for BASE).
  while IFS=$'\t' read -r status path; do
    case "$status" in
      A) echo "$path" >>"$AB/added" ;;
      M | D | T)
        mkdir -p "$AB/files/$(dirname "$path")"
        git show "$base:$path" >"$AB/files/$path"
        ;;
      *) die "unexpected status '$status' for $path" ;;
    esac
  done < <(git diff --no-renames --name-status "$base" -- "${PATHS[@]}")
  echo "$base" >"$AB/commit"
  echo "$(find "$AB/files" -type f | wc -l) files from ${base:0:12} into $AB, $(wc -l <"$AB/added") to remove for it"
}

# swap DIR: this tree's versions of the swapped files into DIR, then BASE's into the tree.
swap() {
  local keep=$1 f
  [ -f "$AB/commit" ] || die "run 'scripts/gpu_ab.sh prepare BASE' first (and carry $AB)"
  rm -rf "$keep"
  mkdir -p "$keep"
  while read -r f; do
    [ -n "$f" ] || continue
    mkdir -p "$keep/$(dirname "$f")"
    mv "$f" "$keep/$f"
  done <"$AB/added"
  (cd "$AB/files" && find . -type f) | while read -r f; do
    f=${f#./}
    if [ -e "$f" ]; then
      mkdir -p "$keep/$(dirname "$f")"
      cp -p "$f" "$keep/$f"
    else
      echo "$f" >>"$keep.absent"  # BASE has it, this tree does not
    fi
    mkdir -p "$(dirname "$f")"
    cp "$AB/files/$f" "$f"
  done
}

# restore DIR: undoes swap DIR (copies, so that the next build sees the files as changed).
restore() {
  local keep=$1 f
  [ -f "$keep.absent" ] && while read -r f; do rm -f "$f"; done <"$keep.absent"
  (cd "$keep" && find . -type f) | while read -r f; do
    f=${f#./}
    mkdir -p "$(dirname "$f")"
    cp "$keep/$f" "$f"
  done
  rm -rf "$keep" "$keep.absent"
}

KEEP=  # where swap put this tree's files; restored on any exit until cleared
trap '[ -z "$KEEP" ] || restore "$KEEP"' EXIT

check() {
  git rev-parse --git-dir >/dev/null 2>&1 || die "check needs the git checkout"
  [ -f "$AB/commit" ] || die "run 'scripts/gpu_ab.sh prepare BASE' first"
  local base before tmp
  base=$(cat "$AB/commit")
  before=$(git status --porcelain --untracked-files=no; git diff | sha256sum)
  tmp=$(mktemp -d)
  KEEP=$tmp/keep
  swap "$KEEP"
  # Every file BASE has under the paths, as BASE has it; none that only this tree's index has.
  local f bad=0
  while read -r f; do
    git show "$base:$f" | cmp -s - "$f" || { echo "differs from ${base:0:12}: $f" >&2; bad=1; }
  done < <(git ls-tree -r --name-only "$base" -- "${PATHS[@]}")
  while read -r f; do
    git cat-file -e "$base:$f" 2>/dev/null || [ ! -e "$f" ] || { echo "not in ${base:0:12}: $f" >&2; bad=1; }
  done < <(git ls-files -- "${PATHS[@]}")
  [ $bad -eq 0 ] || die "the swapped tree is not ${base:0:12}'s"
  restore "$KEEP"
  KEEP=
  rmdir "$tmp"
  [ "$(git status --porcelain --untracked-files=no; git diff | sha256sum)" = "$before" ] || die "restored tree differs"
  echo "check: the swapped paths equal ${base:0:12}, and the tree is back as it was"
}

run() {
  local rounds=2
  if [ "${1:-}" != "--" ]; then rounds=${1:-2}; shift || true; fi
  [ "${1:-}" = "--" ] || die "usage: scripts/gpu_ab.sh run [ROUNDS] -- BENCH ARGS..."
  shift
  [ $# -gt 0 ] || die "no bench arguments"
  OUT=${OUT:-$PWD/out}
  local dir=$OUT/ab
  mkdir -p "$dir"
  source scripts/gpu_env.sh
  echo "building this tree, then with $(cut -c1-12 "$AB/commit")'s files"
  gpu_build "$dir/build_head.log" kestrel || die "build of this tree failed: $dir/build_head.log"
  cp "$BUILD/src/kestrel" "$dir/kestrel_head"
  KEEP=$dir/head_files
  swap "$KEEP"
  # BASE builds in a directory of its own: its objects in $BUILD would be newer than this tree's
  # sources when they arrive on the next machine (build outputs persist, sources keep their times),
  # and the next build there would take them for up to date.
  local head_build=$BUILD
  BUILD=$head_build-ab-base
  gpu_build "$dir/build_base.log" kestrel || die "build with the base files failed: $dir/build_base.log"
  cp "$BUILD/src/kestrel" "$dir/kestrel_base"
  BUILD=$head_build
  restore "$KEEP"
  KEEP=
  local i v
  for ((i = 1; i <= rounds; ++i)); do
    for v in head base; do
      "$dir/kestrel_$v" bench "$@" >"$dir/${v}_$i.txt" 2>"$dir/${v}_$i.err" || die "bench ($v, round $i) failed: $dir/${v}_$i.err"
      echo "$v $i: $(awk '/^ +[0-9]+ +[0-9]+ +[0-9.]+ /{printf "B%s %s  ", $1, $3}' "$dir/${v}_$i.txt")"
    done
  done
  python3 - "$dir" "$rounds" <<'PY'
import re, statistics, sys
d, rounds = sys.argv[1], int(sys.argv[2])
ms = {}  # (variant, batch, context) -> [ms per step]
for v in ('head', 'base'):
    for i in range(1, rounds + 1):
        for line in open(f'{d}/{v}_{i}.txt'):
            m = re.match(r'^ +(\d+) +(\d+) +([0-9.]+) ', line)
            if m:
                ms.setdefault((v, int(m[1]), int(m[2])), []).append(float(m[3]))
print(f'{"batch":>6} {"context":>8} {"head ms":>9} {"base ms":>9} {"head/base":>10}   (medians of {rounds})')
for (v, b, c) in sorted(k for k in ms if k[0] == 'head'):
    h, o = statistics.median(ms[('head', b, c)]), statistics.median(ms.get(('base', b, c), [float('nan')]))
    print(f'{b:>6} {c:>8} {h:>9.3f} {o:>9.3f} {h / o:>10.3f}')
PY
}

case "${1:-}" in
  prepare) [ $# -eq 2 ] || die "usage: scripts/gpu_ab.sh prepare BASE"; prepare "$2" ;;
  run) shift; run "$@" ;;
  check) check ;;
  *) die "usage: scripts/gpu_ab.sh prepare BASE | run [ROUNDS] -- BENCH ARGS... | check" ;;
esac
