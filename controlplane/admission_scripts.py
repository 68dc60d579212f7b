"""The admission Lua scripts: each decides and writes atomically inside Redis, on Redis's
clock (see :mod:`controlplane.admission` for the contract they implement together).

Every script names its KEYS and ARGV in the comment above it; :class:`Admission` passes
them in that order.
"""

from controlplane.fair_queue_scripts import QUEUE_FUNCTIONS

# Redis's own clock, in ms: every ingress reads the same clock, so one whose wall clock is
# off can neither purge others' live reservations nor refill a bucket early.
NOW_MS = """
local function now_ms()
  local time = redis.call('TIME')
  return tonumber(time[1]) * 1000 + math.floor(tonumber(time[2]) / 1000)
end
"""

# The cluster's reservation total less `by`, never below 0: a total that started after
# reservations were taken (an upgrade) would otherwise stay negative and over-admit until
# the lapse sweep sets it again (`controlplane.lapse_sweep`).
LOWER_CLUSTER_TOTAL = """
local function lower_cluster_total(key, by)
  if redis.call('DECRBY', key, by) < 0 then redis.call('SET', key, 0) end
end
"""

# A tenant's prompt-token bucket: `capacity` tokens (rate x burst seconds, the same for
# every request) refilled at `rate` per second from its last state. A prompt is taken when
# the bucket holds it, or when the bucket is full: a prompt larger than the bucket leaves
# it in debt, and later prompts wait until it has refilled. The key lapses only once the
# bucket would be full again, so a missing bucket is a full one (an expiry sized on the
# current request let a small prompt reset a bucket in debt: ~110x the rate). Returns 0
# when taken, else the milliseconds until it would be.
TAKE_PROMPT_TOKENS = """
local function take_prompt_tokens(key, rate, capacity, prompt, now)
  local state = redis.call('HMGET', key, 'tokens', 'at_ms')
  local tokens = capacity
  if state[1] and state[2] then
    local refilled = math.max(0, now - tonumber(state[2])) * rate / 1000
    tokens = math.min(capacity, tonumber(state[1]) + refilled)
  end
  local needed = math.min(prompt, capacity)
  if tokens < needed then return math.ceil((needed - tokens) * 1000 / rate) end
  tokens = tokens - prompt
  redis.call('HSET', key, 'tokens', tostring(tokens), 'at_ms', now)
  redis.call('PEXPIRE', key, math.min(math.ceil((capacity - tokens) * 1000 / rate) + 1000, 2^31))
  return 0
end
"""

# A reservation's sequences (the request's `n`): the fifth field of its start record
# (`admitted_ms max_tokens prompt steady n`); 1 for a record written before it had one.
SEQUENCES_OF = """
local function sequences_of(start)
  local fields = {}
  for field in string.gmatch(start or '', '%S+') do fields[#fields + 1] = field end
  return tonumber(fields[5] or '1') or 1
end
"""

# A tenant's reservations whose deadline passed leave its total, the cluster's total and
# its sequences, and are remembered as lapsed (a late renewal reserves them again) for a
# TTL; without a running total yet, the total is counted once. KEYS: admission's first 11
# (`ADMIT`); ARGV[4]: lease_ms. Leaves `sequences` (held now) and `expired` for the rest.
PURGE_LAPSED = """
if redis.call('EXISTS', KEYS[7]) == 0 then
  -- No running total yet (first use, or reservations from before it existed): count once.
  local reserved = 0
  for _, value in ipairs(redis.call('HVALS', KEYS[3])) do reserved = reserved + tonumber(value) end
  redis.call('SET', KEYS[7], reserved)
  redis.call('INCRBY', KEYS[11], reserved)
end
-- The sequences held (KEYS[8]); none when no reservation is held (a count left by a
-- deleted tenant is stale); without a count yet, counted once from the start records.
local sequences = tonumber(redis.call('GET', KEYS[8]) or '-1')
if redis.call('HLEN', KEYS[3]) == 0 then
  sequences = 0
elseif sequences < 0 then
  sequences = 0
  for _, request_id in ipairs(redis.call('HKEYS', KEYS[3])) do
    sequences = sequences + sequences_of(redis.call('HGET', KEYS[6], request_id))
  end
end
local expired = redis.call('ZRANGEBYSCORE', KEYS[4], '-inf', now)
if #expired > 0 then
  local freed = 0
  for _, request_id in ipairs(expired) do
    local held = redis.call('HGET', KEYS[3], request_id)
    if held then
      local start = redis.call('HGET', KEYS[6], request_id) or ''
      sequences = sequences - sequences_of(start)
      freed = freed + tonumber(held)
      -- A renewal that arrives late (its request still runs) reserves it again.
      redis.call('HSET', KEYS[9], request_id, held .. '|' .. start)
      redis.call('ZADD', KEYS[10], now, request_id)
    end
    redis.call('HDEL', KEYS[3], request_id)
    redis.call('HDEL', KEYS[6], request_id)
  end
  -- Forget what lapsed a whole TTL ago: its ingress is gone, no renewal will come.
  local forgotten = redis.call('ZRANGEBYSCORE', KEYS[10], '-inf', now - tonumber(ARGV[4]))
  for _, request_id in ipairs(forgotten) do redis.call('HDEL', KEYS[9], request_id) end
  redis.call('ZREMRANGEBYSCORE', KEYS[10], '-inf', now - tonumber(ARGV[4]))
  redis.call('PEXPIRE', KEYS[9], tonumber(ARGV[4]))
  redis.call('PEXPIRE', KEYS[10], tonumber(ARGV[4]))
  redis.call('ZREMRANGEBYSCORE', KEYS[4], '-inf', now)
  redis.call('DECRBY', KEYS[7], freed)
  lower_cluster_total(KEYS[11], freed)
  redis.call('SET', KEYS[8], math.max(sequences, 0))
end
"""

# KEYS: quotas, usage, reservations, deadlines, rate bucket, reservation starts, total,
# sequences, lapsed, lapsed-at, cluster total, then the fair queue's (tenant's tickets,
# their leases, active tenants, contending tenants, tenant leases, counters, virtual time,
# admitted tenants' weights).
# ARGV: tenant, request id, blocks, lease_ms, prompt_tokens, rate burst seconds,
# max_tokens, steady blocks, n (sequences), ticket ('' for a request not queued),
# cluster capacity in blocks (0: none), ticket lease_ms, the reservation totals' key prefix.
# Returns {outcome, reason, retry_after_ms}. A request that can never be admitted as asked
# (over its tenant's budget or the cluster's capacity, `n` over its concurrency limit) is
# rejected before anything else. A request queued behind its tenant's tickets
# is throttled `queued` (a fourth value: how many are ahead of it); one the cluster's
# capacity or another tenant's turn holds back, `cluster_full` (`fair_queue_scripts`),
# unless its tenant stays within its weighted share of the capacity (`within_share`).
ADMIT = (
    NOW_MS
    + LOWER_CLUSTER_TOTAL
    + TAKE_PROMPT_TOKENS
    + SEQUENCES_OF
    + QUEUE_FUNCTIONS
    + """
local raw = redis.call('HGET', KEYS[1], ARGV[1])
if not raw then return {'rejected', 'unknown_tenant', 0} end
local quota = cjson.decode(raw)
local blocks = tonumber(ARGV[3])
local now = now_ms()
-- A request that could never be admitted as asked is refused before it queues: waiting
-- would not make it fit, and a ticket of it would hold its tenant's turn for good.
if blocks > quota['kv_budget_blocks'] then return {'rejected', 'exceeds_budget', 0} end
local capacity = tonumber(ARGV[11])
if capacity > 0 and blocks > capacity then
  return {'rejected', 'exceeds_cluster_capacity', 0}
end
local max_concurrent = quota['max_concurrent_requests']
local n = tonumber(ARGV[9])
if max_concurrent ~= cjson.null and n > max_concurrent then
  return {'rejected', 'exceeds_max_concurrent_requests', 0}
end
"""
    + PURGE_LAPSED
    + """
local same = redis.call('HGET', KEYS[3], ARGV[2])
if same then
  -- The same admission sent again (redis-py retries a script whose reply timed out):
  -- it is admitted once. Another request under a held id is a duplicate.
  local start = redis.call('HGET', KEYS[6], ARGV[2]) or ''
  local asked = ' ' .. ARGV[7] .. ' ' .. ARGV[5] .. ' ' .. ARGV[8] .. ' ' .. ARGV[9]
  if same == ARGV[3] and string.sub(start, -#asked) == asked then
    return {'admitted', 'ok', 0}
  end
  return {'rejected', 'duplicate_request', 0}
end
local tenant, ticket = ARGV[1], ARGV[10]
local queue, contending = {KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16]}, KEYS[15]
purge_tickets(queue, tenant, now)
local turn, ahead = take_turn(queue, tenant, ticket, now + tonumber(ARGV[12]))
if turn then return {'throttled', turn, -1, ahead} end
-- A ticket held back by its tenant's own limits leaves the contention for the cluster.
local function wait(reason, ms)
  if ticket ~= '' then redis.call('ZREM', contending, tenant) end
  return {'throttled', reason, ms}
end
if max_concurrent ~= cjson.null and sequences + n > max_concurrent then
  return wait('max_concurrent_requests', -1)
end
local reserved = tonumber(redis.call('GET', KEYS[7]))
local reported = tonumber(redis.call('HGET', KEYS[2], ARGV[1]) or '0')
if math.max(reserved, reported) + blocks > quota['kv_budget_blocks'] then
  return wait('kv_budget', -1)
end
local counter = counter_of(KEYS[17], tenant)
-- Charged at the stored weight: an ingress's cached quota may predate an admin change.
local weight = quota['weight']
if type(weight) ~= 'number' or weight <= 0 then weight = 1 end
-- The cluster's turn and room first; only when it says no, whether the tenant is within
-- its weighted share (then it does not wait for a full cluster, within a bounded total:
-- `within_share`): a cluster with room costs no read of the other tenants.
local held_now = math.max(reserved, reported)
if not cluster_turn(KEYS[11], contending, tenant, ticket, counter, blocks, capacity)
  and not within_share(KEYS[1], KEYS[19], queue[3], ARGV[13], tenant, weight, held_now,
    blocks, capacity, tonumber(redis.call('GET', KEYS[11]) or '0')) then
  return {'throttled', 'cluster_full', -1}
end
local rate = quota['prompt_tokens_per_s']
if rate ~= cjson.null then
  local capacity = rate * tonumber(ARGV[6])
  local prompt = tonumber(ARGV[5])
  local wait_ms = take_prompt_tokens(KEYS[5], rate, capacity, prompt, now)
  if wait_ms > 0 then return wait('prompt_token_rate', wait_ms) end
end
if ticket ~= '' then
  local held = (max_concurrent ~= cjson.null and sequences + 2 * n > max_concurrent)
    or math.max(reserved, reported) + 2 * blocks > quota['kv_budget_blocks']
    or (rate ~= cjson.null and tonumber(redis.call('HGET', KEYS[5], 'tokens') or '0')
      < math.min(tonumber(ARGV[5]), rate * tonumber(ARGV[6])))
  served(queue, KEYS[17], KEYS[18], tenant, ticket, counter, blocks / weight, held)
end
if capacity > 0 then redis.call('HSET', KEYS[19], tenant, string.format('%.17g', weight)) end
redis.call('HSET', KEYS[3], ARGV[2], blocks)
redis.call('INCRBY', KEYS[7], blocks)
redis.call('INCRBY', KEYS[11], blocks)
redis.call('SET', KEYS[8], sequences + n)
redis.call('HSET', KEYS[6], ARGV[2],
  string.format('%d', now) .. ' ' .. ARGV[7] .. ' ' .. ARGV[5] .. ' ' .. ARGV[8] .. ' ' .. ARGV[9])
redis.call('ZADD', KEYS[4], now + tonumber(ARGV[4]), ARGV[2])
return {'admitted', 'ok', 0}
"""
)

# KEYS: admission's first 11 (`ADMIT`). ARGV: -, -, -, lease_ms. Purges the tenant's lapsed
# reservations as an admission would (`controlplane.lapse_sweep`); returns how many lapsed.
SWEEP_LAPSED = (
    NOW_MS
    + LOWER_CLUSTER_TOTAL
    + SEQUENCES_OF
    + """
local now = now_ms()
"""
    + PURGE_LAPSED
    + """
return #expired
"""
)


# KEYS: reservations, total, cluster total. ARGV: request id, steady blocks. Shrinks only
# a held one. The cluster's total moves with every tenant total.
SETTLE = (
    LOWER_CLUSTER_TOTAL
    + """
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if redis.call('EXISTS', KEYS[2]) == 1 then
  redis.call('INCRBY', KEYS[2], tonumber(ARGV[2]) - tonumber(held))
  lower_cluster_total(KEYS[3], tonumber(held) - tonumber(ARGV[2]))
end
return 1
"""
)

# KEYS: reservations, deadlines, starts, total, sequences, lapsed, lapsed-at, cluster total.
# ARGV: request id. 1 iff it was held.
RELEASE = (
    SEQUENCES_OF
    + LOWER_CLUSTER_TOTAL
    + """
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('HDEL', KEYS[6], ARGV[1])
redis.call('ZREM', KEYS[7], ARGV[1])
local start = redis.call('HGET', KEYS[3], ARGV[1])
redis.call('HDEL', KEYS[3], ARGV[1])
local held = redis.call('HGET', KEYS[1], ARGV[1])
if not held then return 0 end
redis.call('HDEL', KEYS[1], ARGV[1])
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('DECRBY', KEYS[4], held)
  lower_cluster_total(KEYS[8], held)
end
if redis.call('EXISTS', KEYS[5]) == 1 then redis.call('DECRBY', KEYS[5], sequences_of(start)) end
return 1
"""
)

# KEYS: deadlines, reservations, lapsed, total, starts, sequences, lapsed-at, cluster
# total. ARGV: request id, lease_ms. 1: renewed; 2: it had lapsed and is reserved again (its
# request still runs, so its KV counts); 0: not held (released, or never admitted).
RENEW = (
    NOW_MS
    + SEQUENCES_OF
    + """
local now = now_ms()
local deadline = redis.call('ZSCORE', KEYS[1], ARGV[1])
local until_ms = now + tonumber(ARGV[2])
if deadline and tonumber(deadline) > now then
  redis.call('ZADD', KEYS[1], 'XX', until_ms, ARGV[1])
  return 1
end
if redis.call('HEXISTS', KEYS[2], ARGV[1]) == 1 then  -- lapsed, not purged yet
  redis.call('ZADD', KEYS[1], until_ms, ARGV[1])
  return 2
end
local lapsed = redis.call('HGET', KEYS[3], ARGV[1])
if not lapsed then return 0 end
redis.call('HDEL', KEYS[3], ARGV[1])
redis.call('ZREM', KEYS[7], ARGV[1])
local blocks, start = string.match(lapsed, '^(%d+)|(.*)$')
redis.call('HSET', KEYS[2], ARGV[1], blocks)
if start ~= '' then redis.call('HSET', KEYS[5], ARGV[1], start) end
if redis.call('EXISTS', KEYS[4]) == 1 then
  redis.call('INCRBY', KEYS[4], blocks)
  redis.call('INCRBY', KEYS[8], blocks)
end
if redis.call('EXISTS', KEYS[6]) == 1 then
  redis.call('INCRBY', KEYS[6], sequences_of(start))
end
redis.call('ZADD', KEYS[1], until_ms, ARGV[1])
return 2
"""
)
