# Helpers shared by the end-to-end scripts; they need `work` (the scratch directory) set.
failures=0
fail() { echo "FAIL: $*"; failures=$((failures + 1)); }
expect_rc() {  # expect_rc WANT NAME -- command...
  local want=$1 name=$2; shift 3
  "$@" >"$work/$name.out" 2>"$work/$name.err"
  local rc=$?
  [ "$rc" -eq "$want" ] || { fail "$name: exit $rc, expected $want"; cat "$work/$name.err"; }
}
grep_in() { grep -q -- "$2" "$1" || fail "$1 lacks '$2'"; }
