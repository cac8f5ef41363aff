#!/bin/sh
# The compose Redis's start (docker-compose.yml runs it with redis-server's command line): before
# Redis starts, an append-only file a disk damaged is repaired, so that no manual step is needed.
#
# Redis cuts a torn end by itself (aof-load-truncated), but refuses to start on damage in the
# middle of its file ("Bad file format reading the append only file"), on every restart: the
# container would restart for ever. Here, as the embedded stack does before each start
# (driftline.embedded.repair_redis_aof): a copy of the damaged file (Redis 7: its appendonlydir)
# is kept beside it (<name>.damaged-<unix time>, the newest three), and the file is cut at the
# first bad command (redis-check-aof --fix). Where it cannot be cut (the damage lies in the base
# file of Redis 7, or in the RDB part of 6's), Redis starts without it. Either way what came
# after the damage is lost: the load's marker with it, so serving marks its answers and the
# feature keeper loads the features again; users' recent clicks come back with their next ones.
#
# Then the image's own entrypoint (it drops to the redis user), else redis-server itself.
# Arguments: the command to run, "redis-server" and its flags; --dir is read from them (default:
# the working directory, the image's /data).
set -eu

dir=$PWD
prev=""
for arg in "$@"; do
    [ "$prev" = "--dir" ] && dir=$arg
    prev=$arg
done

if [ -f "$dir/appendonlydir/appendonly.aof.manifest" ]; then  # Redis 7: a manifest and its files
    keep="$dir/appendonlydir" check="$dir/appendonlydir/appendonly.aof.manifest"
elif [ -s "$dir/appendonly.aof" ]; then   # Redis 6: one file (empty after a start on nothing: it reads)
    keep="$dir/appendonly.aof" check="$dir/appendonly.aof"
else
    keep=""
fi

say() { echo "redis-start: $*" >&2; }

if [ -n "$keep" ] && ! redis-check-aof "$check" >/dev/null 2>&1; then
    aside="$keep.damaged-$(date +%s)"
    rm -rf "$aside"
    cp -a "$keep" "$aside"
    said=$(echo y | redis-check-aof --fix "$check" 2>&1 | tail -n 3 | tr '\n' ' ') || true
    if redis-check-aof "$check" >/dev/null 2>&1; then
        say "the append-only file was damaged: kept at $aside; cut at the first bad command ($said)"
    else
        rm -rf "$keep"
        say "the append-only file was damaged and cannot be cut ($said): kept at $aside; Redis starts without it"
    fi
    # the newest three damaged copies are kept (names sort by their time)
    count=$(ls -d "$keep".damaged-* | wc -l)
    for old in $(ls -d "$keep".damaged-* | sort); do
        [ "$count" -le 3 ] && break
        rm -rf "$old"
        say "deleted an older damaged copy: $old"
        count=$((count - 1))
    done
fi

if command -v docker-entrypoint.sh >/dev/null 2>&1; then
    exec docker-entrypoint.sh "$@"
fi
exec "$@"
