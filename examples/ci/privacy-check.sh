#!/usr/bin/env bash
# The privacy gate as one shell step, for any CI system (GitLab, Jenkins, Buildkite, cron):
# exits 0 when every guarantee holds, 1 when one fails, 2 when the check could not run
# (docs/CI.md). LEDGER_URL, LEDGER_API_KEY and DATASET come from the environment; MODEL and
# MAX_EPSILON are optional. The JSON report is written to privacy-report.json either way.
set -uo pipefail
: "${LEDGER_URL:?}" "${LEDGER_API_KEY:?}" "${DATASET:?}"

args=(--dataset "$DATASET" --json)
[ -n "${MODEL:-}" ] && args+=(--model "$MODEL")
[ -n "${MAX_EPSILON:-}" ] && args+=(--max-epsilon "$MAX_EPSILON")

status=0
ledger check "${args[@]}" > privacy-report.json || status=$?
case $status in
  0) echo "privacy guarantees hold" ;;
  1) echo "a privacy guarantee fails: do not release" >&2 ;;
  *) echo "the privacy check could not run (exit $status)" >&2 ;;
esac
exit "$status"
