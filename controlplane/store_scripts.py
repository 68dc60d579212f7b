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

# KEYS: report hashes. ARGV: the prefix tag the reader holds for each ('' for none).
# Returns, per hash, its tag and prefix keys JSON where the stored tag differs from the
# reader's, and '', '' where it is the same, or the hash expired or holds another type.
READ_PREFIX_KEYS = """
local out = {}
for i, key in ipairs(KEYS) do
  local tag = redis.pcall('HGET', key, 'prefix_tag')
  if type(tag) == 'string' and tag ~= ARGV[i] then
    out[2 * i - 1] = tag
    out[2 * i] = redis.call('HGET', key, 'prefix_keys') or '[]'
  else
    out[2 * i - 1] = ''
    out[2 * i] = ''
  end
end
return out
"""

# KEYS: registry, then one report hash per report. ARGV: ttl_ms, then (replica id,
# heartbeat, report JSON, prefix tag, prefix keys JSON or '' when they did not change)
# per report. Returns the replica ids whose keys came without their tag being stored
# (the hash expired or was lost): the writer sends their keys again.
PUBLISH_REPORTS = """
local ttl_ms = ARGV[1]
local resend = {}
for i = 2, #KEYS do
  local at = 5 * (i - 2) + 2
  if ARGV[at + 4] ~= '' then
    redis.call('HSET', KEYS[i], 'report', ARGV[at + 2], 'heartbeat_s', ARGV[at + 1],
               'prefix_tag', ARGV[at + 3], 'prefix_keys', ARGV[at + 4])
  else
    redis.call('HSET', KEYS[i], 'report', ARGV[at + 2], 'heartbeat_s', ARGV[at + 1])
    if redis.call('HGET', KEYS[i], 'prefix_tag') ~= ARGV[at + 3] then
      resend[#resend + 1] = ARGV[at]
    end
  end
  redis.call('PEXPIRE', KEYS[i], ttl_ms)
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
