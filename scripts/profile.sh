#!/usr/bin/env bash
# Profiles outboxd draining a backlog against the real broker (Apache Kafka,
# scripts/lib/services.sh). Usage: scripts/profile.sh [ROWS] [callgrind|perf|heaptrack|rss]
# (default 20000 rows, callgrind). PROFILE_TYPES=N spreads the rows over N
# aggregate types, each its own topic of 3 partitions (default 1).
# * callgrind counts instructions: repeatable on a busy machine, but it
#   runs outboxd about 50 times slower, so the broker's answers shape other
#   batches than in a real drain.
# * perf samples the drain at full speed (call graphs through frame
#   pointers and DWARF) and also counts context switches and CPU time per
#   thread (`perf stat --per-thread`), which is where wake-ups show.
# * heaptrack records every allocation with its stack and prints the
#   peak's consumers: where the memory held at the peak RSS was allocated.
# * rss runs outboxd at full speed and prints, once drained, where its
#   resident memory sits (the binary's pages, the heap, other anonymous
#   mappings: glibc's thread arenas and the threads' stacks).
# Prints the functions with the most samples or instructions and leaves the
# full profile in target/profile/.
set -euo pipefail
cd "$(dirname "$0")/.."
rows=${1:-20000}
tool=${2:-callgrind}
case "$tool" in
  callgrind) command -v valgrind >/dev/null || { sudo apt-get install -y valgrind || apt-get install -y valgrind; } ;;
  perf) command -v perf >/dev/null || { sudo apt-get install -y linux-perf || apt-get install -y linux-perf; } ;;
  heaptrack) command -v heaptrack >/dev/null || { sudo apt-get install -y heaptrack || apt-get install -y heaptrack; } ;;
  rss) ;;
  *) echo "profile.sh: unknown profiler $tool (callgrind, perf, heaptrack or rss)" >&2; exit 2 ;;
esac
# PROFILE_BIN: profile that binary (a reference build) instead of building
# this checkout's.
if [ -n "${PROFILE_BIN:-}" ]; then
  bin=$PROFILE_BIN
else
  cargo build --quiet --release --bin outboxd
  bin=${CARGO_TARGET_DIR:-target}/release/outboxd
fi
# shellcheck source=lib/services.sh
source scripts/lib/services.sh
pid=
cleanup() { [ -n "$pid" ] && kill "$pid" 2>/dev/null || true; stop_services; }
trap cleanup EXIT
start_services
"${PSQL[@]}" -f migrations/0001_outbox.sql
"${PSQL[@]}" -c "CREATE PUBLICATION outboxd FOR TABLE outbox WITH (publish = 'insert')" \
  -c "SELECT pg_create_logical_replication_slot('outboxd', 'pgoutput')" >/dev/null
types=${PROFILE_TYPES:-1}
aggregate_type="CASE WHEN $types = 1 THEN 'Order' ELSE 'T' || (g % $types) END"
"${PSQL[@]}" -c "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload)
  SELECT gen_random_uuid(), $aggregate_type, 'warm-up', 'warm-up', '{}' FROM generate_series(1, $types) g"
warm_end=$("${PSQL[@]}" -At -c "SELECT pg_current_wal_lsn()")
services_config $'[log]\nlevel = "warn"'
sed -i 's/^topic_replication_factor = 1$/&\ntopic_partitions = 3/' "$WORK/outboxd.toml"
# PROFILE_KAFKA: extra lines for the [kafka] table, e.g. 'max_inflight = 5000'.
if [ -n "${PROFILE_KAFKA:-}" ]; then
  printf '%s\n' "$PROFILE_KAFKA" >"$WORK/kafka-extra.toml"
  sed -i "/^\[kafka\]$/r $WORK/kafka-extra.toml" "$WORK/outboxd.toml"
fi
# The topics are made, and the broker warmed, by a run over one row per
# topic that is not measured.
"$bin" run --config "$WORK/outboxd.toml" 2>"$WORK/warm-up.log" &
pid=$!
until [ "$("${PSQL[@]}" -At -c "SELECT confirmed_flush_lsn >= '$warm_end' FROM pg_replication_slots WHERE slot_name = 'outboxd'")" = t ]; do
  sleep 0.2
done
kill -TERM "$pid"; wait "$pid" || true; pid=
for ((t = 0; t < rows / 100; t++)); do
  echo "INSERT INTO outbox (id, aggregate_type, aggregate_id, type, payload, headers)
        SELECT gen_random_uuid(), $aggregate_type, 'order-' || ($t * 100 + g) % 5000, 'ordering.order-placed.v1',
               jsonb_build_object('orderId', $t * 100 + g, 'note', repeat('n', 200)),
               jsonb_build_object('correlationId', md5(g::text))
          FROM generate_series(1, 100) g;"
done | "${PSQL[@]}" >/dev/null
end=$("${PSQL[@]}" -At -c "SELECT pg_current_wal_lsn()")
mkdir -p target/profile
out=target/profile
start=$(date +%s.%N)
case "$tool" in
  callgrind)
    valgrind --tool=callgrind --callgrind-out-file=$out/callgrind.out \
      "$bin" run --config "$WORK/outboxd.toml" 2>"$WORK/valgrind.log" &
    pid=$! ;;
  perf)
    perf record -F 999 ${PERF_CALL_GRAPH:+--call-graph $PERF_CALL_GRAPH} -o $out/perf.data \
      "$bin" run --config "$WORK/outboxd.toml" 2>"$WORK/outboxd.log" &
    rec=$!
    until pid=$(pgrep -P "$rec" -x "$(basename "$bin" | cut -c1-15)"); do sleep 0.01; done
    perf stat --per-thread -e task-clock,context-switches,cpu-migrations,syscalls:sys_enter_poll -p "$pid" -o $out/perf-stat.txt &
    stat=$! ;;
  heaptrack)
    rm -f $out/heaptrack.*
    heaptrack -o $out/heaptrack "$bin" run --config "$WORK/outboxd.toml" >"$WORK/heaptrack.log" 2>&1 &
    rec=$!
    until pid=$(pgrep -P "$rec" -x "$(basename "$bin" | cut -c1-15)"); do sleep 0.01; done ;;
  rss)
    "$bin" run --config "$WORK/outboxd.toml" 2>"$WORK/outboxd.log" &
    pid=$! ;;
esac
until [ "$("${PSQL[@]}" -At -c "SELECT confirmed_flush_lsn >= '$end' FROM pg_replication_slots WHERE slot_name = 'outboxd'")" = t ]; do
  sleep 0.2
done
took=$(echo "$(date +%s.%N) - $start" | bc)
if [ "$tool" = perf ]; then
  cpu=$(awk '{print ($14 + $15) / 100}' "/proc/$pid/stat")
  split=$(awk '{print "user " $14 / 100 "s, system " $15 / 100 "s"}' "/proc/$pid/stat")
  rss=$(awk '/^VmHWM/ {print $2 / 1024}' "/proc/$pid/status")
  kill -INT "$stat"; wait "$stat" 2>/dev/null || true
  kill -TERM "$pid"; wait "$rec" || true; pid=
elif [ "$tool" = rss ]; then
  cpu=$(awk '{print ($14 + $15) / 100}' "/proc/$pid/stat")
  split=$(awk '{print "user " $14 / 100 "s, system " $15 / 100 "s"}' "/proc/$pid/stat")
  rss=$(awk '/^VmHWM/ {print $2 / 1024}' "/proc/$pid/status")
  # Resident KiB per kind of mapping.
  awk '/^[0-9a-f]+-[0-9a-f]+ / { name = ($6 == "") ? "[anonymous]" : $6; sub(/.*\//, "", name) }
       /^Rss:/ { kb[name] += $2 } END { for (n in kb) if (kb[n] >= 256) printf "%8.1f MiB  %s\n", kb[n] / 1024, n }' \
    "/proc/$pid/smaps" | sort -rn >$out/rss.txt
  echo "outboxd threads: $(ls /proc/$pid/task | wc -l)" >>$out/rss.txt
  kill -TERM "$pid"; wait "$pid" || true; pid=
elif [ "$tool" = heaptrack ]; then
  rss=$(awk '/^VmHWM/ {print $2 / 1024}' "/proc/$pid/status")
  kill -TERM "$pid"; wait "$rec" || true; pid=
else
  kill -TERM "$pid"; wait "$pid" || true; pid=
fi
echo "drained $rows rows in ${took}s"
# The record batches the broker stored: how many records each produce
# carried (librdkafka's batching under this broker's answers).
python3 - "$WORK"/kafka/data/[!_]*/*.log <<'PY' | tee $out/batches.txt
import struct, sys
batches = records = 0
for path in sys.argv[1:]:
    data = open(path, "rb").read()
    at = 0
    while at + 61 <= len(data):  # a v2 record batch: its count sits at byte 57
        length = struct.unpack_from(">i", data, at + 8)[0]
        batches += 1
        records += struct.unpack_from(">i", data, at + 57)[0]
        at += 12 + length
print(f"stored batches: {batches}, {records / max(batches, 1):.0f} records per batch")
PY
case "$tool" in
  callgrind)
    callgrind_annotate --inclusive=no $out/callgrind.out >$out/annotate.txt 2>/dev/null
    head -n 40 $out/annotate.txt ;;
  perf)
    echo "outboxd peak RSS: ${rss} MiB"
    echo "outboxd CPU: ${cpu}s ($(echo "$cpu * 100000 / $rows" | bc -l | cut -c1-5) core-s per 100k events; $split)"
    perf report -i $out/perf.data --no-children --sort dso,symbol --stdio 2>/dev/null | grep -v '^$' >$out/report.txt || true
    perf report -i $out/perf.data --no-children --sort comm --stdio 2>/dev/null | grep -v '^#' | grep -v '^$' >$out/threads.txt || true
    sort -k2 -t'|' $out/perf-stat.txt >/dev/null 2>&1 || true
    cat $out/threads.txt | head -20
    grep -E '^ +[0-9.]+%' $out/report.txt | head -40
    cat $out/perf-stat.txt ;;
  rss)
    echo "outboxd peak RSS: ${rss} MiB"
    echo "outboxd CPU: ${cpu}s ($(echo "$cpu * 100000 / $rows" | bc -l | cut -c1-5) core-s per 100k events; $split)"
    echo "resident once drained:"; cat $out/rss.txt ;;
  heaptrack)
    echo "outboxd peak RSS: ${rss} MiB (under heaptrack)"
    heaptrack_print -f $out/heaptrack*.zst --print-peaks 1 --print-allocators 0 --print-temporary 0 \
      --print-leaks 0 --peak-limit 25 >$out/heaptrack.txt 2>/dev/null || true
    sed -n '/PEAK MEMORY CONSUMERS/,$p' $out/heaptrack.txt | grep -vE '^\s+at |^\s+in ' | head -80 ;;
esac
