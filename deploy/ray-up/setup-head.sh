#!/usr/bin/env bash
# Head node setup for `ray up` (run by head_setup_commands, as the SSH user):
#  - secrets generated here once, never committed: Redis password and admin token in
#    $SECRETS (mode 600); the autoscaler copies this folder to every worker it starts
#    (head -> worker file mounts), so every node reads the same values;
#  - Redis bound to loopback and the head's private address, with the password and
#    append-only durability (tenants, API keys and quotas live there);
#  - $SECRETS/cluster.env: the environment `ray start` runs under on every node, so every
#    Ray process (Serve controller, ingress, router, engine replicas) inherits it.
set -euo pipefail
SECRETS=${SECRETS:-$HOME/vtoken-secrets}
REDIS_PORT=6379
OTLP_HTTP_PORT=4318

umask 077
mkdir -p "$SECRETS"
chmod 700 "$SECRETS"  # rsync from a laptop folder may have left it wider
for name in redis-password admin-token; do
  [ -s "$SECRETS/$name" ] || python3 -c 'import secrets; print(secrets.token_urlsafe(32))' > "$SECRETS/$name"
done
chmod 600 "$SECRETS"/*

# The private address workers reach the head on (the source of the default route).
HEAD_IP=$(ip -4 route get 1.1.1.1 | sed -n 's/.* src \([0-9.]*\).*/\1/p')
[ -n "$HEAD_IP" ] || { echo "cannot find the head's private address" >&2; exit 1; }

sudo apt-get update -q
sudo apt-get install -y -q redis-server
# Redis reads the last value of a directive: these override Ubuntu's defaults (bind
# 127.0.0.1 -::1, no password, no append-only file).
sudo tee /etc/redis/vtoken.conf > /dev/null <<CONF
bind 127.0.0.1 $HEAD_IP
port $REDIS_PORT
protected-mode yes
requirepass $(cat "$SECRETS/redis-password")
appendonly yes
appendfsync everysec
maxmemory-policy noeviction
CONF
sudo chown redis:redis /etc/redis/vtoken.conf
sudo chmod 640 /etc/redis/vtoken.conf
grep -qx 'include /etc/redis/vtoken.conf' /etc/redis/redis.conf \
  || echo 'include /etc/redis/vtoken.conf' | sudo tee -a /etc/redis/redis.conf > /dev/null
sudo systemctl enable redis-server
sudo systemctl restart redis-server
REDISCLI_AUTH=$(cat "$SECRETS/redis-password") redis-cli -h "$HEAD_IP" -p "$REDIS_PORT" ping

cat > "$SECRETS/cluster.env" <<ENV
VTOKEN_REDIS_URL=redis://:$(cat "$SECRETS/redis-password")@$HEAD_IP:$REDIS_PORT/0
OTEL_EXPORTER_OTLP_ENDPOINT=http://$HEAD_IP:$OTLP_HTTP_PORT
ENV
chmod 600 "$SECRETS/cluster.env"
