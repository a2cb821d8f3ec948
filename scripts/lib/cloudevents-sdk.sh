#!/usr/bin/env bash
# The CloudEvents Python SDK (the `cloudevents` package from PyPI, pinned),
# which the tests use to decode outboxd's CloudEvents records as a
# consumer would: in a virtual environment of its own under
# $OUTBOXD_TOOLS (default ~/.cache/outboxd/tools). Prints its python.
# Idempotent.
set -euo pipefail
version=2.2.0
tools="${OUTBOXD_TOOLS:-$HOME/.cache/outboxd/tools}"
venv="$tools/cloudevents-$version"
python="$venv/bin/python"
if ! "$python" -c 'import cloudevents.core.bindings.kafka' >/dev/null 2>&1; then
  rm -rf "$venv"
  python3 -m venv "$venv" >&2
  "$venv/bin/pip" install --quiet --disable-pip-version-check "cloudevents==$version" >&2
  "$python" -c 'import cloudevents.core.bindings.kafka'
fi
echo "$python"
