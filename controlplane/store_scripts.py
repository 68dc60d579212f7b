"""The Lua scripts of `controlplane/store.py`: each batch of reads or writes is one call
(one reply to parse instead of one per replica). Every read tolerates a key of another
type (a foreign record): it is skipped and reported, never a WRONGTYPE error that fails
the whole read (one such key once stopped every plan until its registry entry aged out).
"""

from __future__ import annotations

WRONG_TYPE = "!wrongtype"

# KEYS: report hashes. Returns each one's `report` field ('' where the hash expired, and
# `WRONG_TYPE` where the key holds something else).
READ_REPORTS = f"""
local out = {{}}
for i, key in ipairs(KEYS) do
  local kind = redis.call('TYPE', key)['ok']
  if kind == 'hash' then
    out[i] = redis.call('HGET', key, 'report') or ''
  elseif kind == 'none' then
    out[i] = ''
  else
    out[i] = '{WRONG_TYPE}'
  end
end
return out
"""

# KEYS: report hashes. Returns each one's `prefix_tag` ('' where missing, expired or of
# another type).
READ_PREFIX_TAGS = """
local out = {}
for i, key in ipairs(KEYS) do
  local tag = redis.pcall('HGET', key, 'prefix_tag')
  if type(tag) == 'string' then out[i] = tag else out[i] = '' end
end
return out
"""

# KEYS: registry, then (report hash, prefix keys key) per report. ARGV: ttl_ms, then
# (replica id, heartbeat, report JSON, prefix tag) per report. The prefix keys were SET
# just before when they changed. Returns the replica ids whose prefix keys key is gone
# (it expired while the replica was away): the writer sends their keys again.
PUBLISH_REPORTS = """
local ttl_ms = ARGV[1]
local resend = {}
for i = 2, #KEYS, 2 do
  local at = 2 * (i - 2) + 2
  redis.call('HSET', KEYS[i], 'report', ARGV[at + 2], 'heartbeat_s', ARGV[at + 1],
             'prefix_tag', ARGV[at + 3])
  redis.call('PEXPIRE', KEYS[i], ttl_ms)
  if redis.call('PEXPIRE', KEYS[i + 1], ttl_ms) == 0 then
    resend[#resend + 1] = ARGV[at]
  end
  redis.call('ZADD', KEYS[1], ARGV[at + 1], ARGV[at])
end
return resend
"""

# KEYS: plan slices, plan heartbeat. ARGV: replica id. Returns its slice JSON and the
# heartbeat ('' for either when missing or of another type).
READ_PLAN_SLICE = """
local slice = redis.pcall('HGET', KEYS[1], ARGV[1])
local beat = redis.pcall('GET', KEYS[2])
if type(slice) ~= 'string' then slice = '' end
if type(beat) ~= 'string' then beat = '' end
return {slice, beat}
"""
