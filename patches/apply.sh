#!/usr/bin/env bash
# Apply (or check / revert) patches/megatron_lm_pretrain_gpt.patch to a Megatron-LM checkout, so that
# a plain `torchrun pretrain_gpt.py ... --sparseloco-algorithm ...` uses megatron_sparseloco.
#
#   patches/apply.sh [--check | --reverse] MEGATRON_LM_DIR
#
#   (default)  apply; a no-op when already applied
#   --check    report whether it applies / is already applied; change nothing
#   --reverse  revert it; a no-op when not applied
#
# Exit status: 0 done (or nothing to do), 1 cannot apply / revert, 2 usage error.
# The patch was made against the commit named in megatron_lm_pretrain_gpt.json; another commit only
# gets a warning, and the patch is applied when `git apply --check` accepts it.
set -euo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
PATCH="$HERE/megatron_lm_pretrain_gpt.patch"
META="$HERE/megatron_lm_pretrain_gpt.json"
TARGET=pretrain_gpt.py

die() { echo "apply.sh: error: $1" >&2; exit "${2:-1}"; }
warn() { echo "apply.sh: warning: $*" >&2; }
info() { echo "apply.sh: $*"; }
usage() { sed -n '5,9p' "${BASH_SOURCE[0]}" | sed 's/^# \{0,1\}//' >&2; exit 2; }

MODE=apply
DIR=
for a in "$@"; do
  case "$a" in
    --check) MODE=check ;;
    --reverse) MODE=reverse ;;
    -h|--help) usage ;;
    -*) echo "apply.sh: unknown option $a" >&2; usage ;;
    *) [ -z "$DIR" ] || { echo "apply.sh: more than one directory given" >&2; usage; }; DIR="$a" ;;
  esac
done
[ -n "$DIR" ] || usage
command -v git >/dev/null || die "git is required (git apply)"
[ -f "$PATCH" ] || die "patch file missing: $PATCH"
[ -d "$DIR" ] || die "no such directory: $DIR" 2
DIR="$(cd "$DIR" && pwd -P)"
[ -f "$DIR/$TARGET" ] || die "$DIR/$TARGET not found: MEGATRON_LM_DIR must be the root of a Megatron-LM checkout" 2

meta() { sed -n "s/^ *\"$1\": *\"\([^\"]*\)\".*/\1/p" "$META" | head -1; }
COMMIT="$(meta commit)"; TAG="$(meta tag)"
SHA_ORIG="$(meta sha256_original)"; SHA_PATCHED="$(meta sha256_patched)"

sha256() {
  if command -v sha256sum >/dev/null; then sha256sum "$1" | cut -d' ' -f1
  elif command -v shasum >/dev/null; then shasum -a 256 "$1" | cut -d' ' -f1
  else echo unknown; fi
}

# 1. Which commit is this? (a warning only: pretrain_gpt.py rarely changes between commits)
if HEAD="$(git -C "$DIR" rev-parse --verify -q HEAD 2>/dev/null)" && \
   [ "$(git -C "$DIR" rev-parse --show-toplevel 2>/dev/null)" = "$DIR" ]; then
  [ "$HEAD" = "$COMMIT" ] || warn "$DIR is at commit $HEAD; the patch was made against $TAG ($COMMIT)"
else
  HEAD=
  info "$DIR is not the root of a git checkout; checking $TARGET's content only"
fi
# When DIR sits inside a larger repository (vendored copy), git apply takes patch paths relative
# to that repository's root: prefix them with DIR's path inside it.
GIT_APPLY=(git -C "$DIR" apply)
PREFIX="$(git -C "$DIR" rev-parse --show-prefix 2>/dev/null || true)"
[ -z "$PREFIX" ] || GIT_APPLY+=("--directory=${PREFIX%/}")

# 2. Where does the file stand?
SHA_NOW="$(sha256 "$DIR/$TARGET")"
state=
if [ "$SHA_NOW" = "$SHA_PATCHED" ]; then state=applied
elif [ "$SHA_NOW" = "$SHA_ORIG" ]; then state=pristine
else
  [ -z "$HEAD" ] || [ "$HEAD" != "$COMMIT" ] || warn "$TARGET has local changes relative to $COMMIT"
  warn "$TARGET differs from $TAG's; relying on git apply's context match"
  if "${GIT_APPLY[@]}" --reverse --check "$PATCH" 2>/dev/null; then state=applied
  elif "${GIT_APPLY[@]}" --check "$PATCH" 2>/dev/null; then state=pristine
  else
    echo "apply.sh: git apply --check says:" >&2
    "${GIT_APPLY[@]}" --check "$PATCH" >&2 || true
    die "the patch neither applies to nor is already applied in $DIR/$TARGET.
  Check out $TAG ($COMMIT), or add the hook by hand (see docs/patches.md),
  or use the patch-free launcher: python -m megatron_sparseloco.run pretrain_gpt.py <args>"
  fi
fi

# 3. Act.
case "$MODE:$state" in
  check:applied)   info "already applied to $DIR/$TARGET" ;;
  check:pristine)  info "applies cleanly to $DIR/$TARGET (nothing changed: --check)" ;;
  apply:applied)   info "already applied to $DIR/$TARGET; nothing to do" ;;
  reverse:pristine) info "not applied to $DIR/$TARGET; nothing to revert" ;;
  apply:pristine)
    "${GIT_APPLY[@]}" "$PATCH" || die "git apply failed"
    info "patched $DIR/$TARGET (revert: $0 --reverse $DIR)" ;;
  reverse:applied)
    "${GIT_APPLY[@]}" --reverse "$PATCH" || die "git apply --reverse failed"
    info "reverted $DIR/$TARGET" ;;
esac
