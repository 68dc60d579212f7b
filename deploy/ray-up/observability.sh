#!/usr/bin/env bash
# On the head (run by head_setup_commands): the OpenTelemetry Collector, Prometheus, Jaeger
# and Grafana from deploy/observability/compose.yaml. The collector's OTLP ports listen on
# every address (engine replicas on the workers send to it); the UIs listen on loopback
# only: open them through SSH (`ray attach <cluster file> -p 3000 -p 16686 -p 9090`).
set -euo pipefail
cd "$(dirname "$0")/../observability"
if ! docker compose version > /dev/null 2>&1; then
  echo "docker compose is missing: no collector on the head; spans and metrics are dropped" >&2
  exit 0
fi
sudo docker compose up -d --remove-orphans
