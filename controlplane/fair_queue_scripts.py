"""The fair queue's Lua: functions the admission script shares, and the scripts that add a
ticket, take one away and read the queues (:mod:`controlplane.fair_queue` states the
contract). All on Redis's clock.

A queue is the Lua table ``{tickets, leases, active, contending, tenant_leases, pace}`` of
keys: the tenant's tickets (sorted set, ticket -> enqueued ms: its FIFO order), their
leases (ticket -> ms after which it is dead), the active tenants (tenant -> virtual
counter: every tenant with a ticket), the contending tenants (tenant -> virtual counter:
those whose first ticket passed its own limits and waits for the cluster, and those just
served whose own limits will not hold their next ticket), the tenants' leases
(tenant -> the latest lease of its tickets) and the tenants' paces (hash: tenant ->
``pace_ms head_ms count``, see ``expected_wait``). Scripts take the pace hash as their last key.
"""

QUEUE_FUNCTIONS = """
local function counter_of(counters, tenant)
  return tonumber(redis.call('HGET', counters, tenant) or '0') or 0
end

-- Nobody waits for `tenant` any more: it leaves the active and contending tenants.
-- Its pace belongs to this backlog and goes with it.
local function retire(queue, tenant)
  redis.call('ZREM', queue[3], tenant)
  redis.call('ZREM', queue[4], tenant)
  redis.call('ZREM', queue[5], tenant)
  redis.call('HDEL', queue[6], tenant)
end

-- The tenant's pace in its current backlog: the mean time (ms) a ticket of its spent first
-- in its queue before it was admitted (-1: none was admitted since its queue last
-- emptied), since when (ms) its first ticket is first (0: since it joined), and how many
-- times were measured. The first PACE_SAMPLES times are averaged alike, each later one
-- weighs 1 / PACE_SAMPLES (a moving mean that forgets: no single slow start dominates).
-- While the tenant is backlogged, a ticket is admitted about every pace: the time first
-- is the time between the tenant's releases from its queue.
local PACE_SAMPLES = 4
local function pace_of(queue, tenant)
  local raw = redis.call('HGET', queue[6], tenant)
  if not raw then return -1, 0, 0 end
  local pace, head, count = string.match(raw, '^(%S+) (%S+) (%S+)$')
  return tonumber(pace), tonumber(head), tonumber(count)
end

local function set_pace(queue, tenant, pace, head, count)
  redis.call('HSET', queue[6], tenant, string.format('%.17g %.17g %d', pace, head, count))
end

-- The pace once a ticket first for `first_for` ms is admitted.
local function paced(pace, count, first_for)
  return pace + (first_for - pace) / math.min(count + 1, PACE_SAMPLES)
end

-- Another ticket became the tenant's first at `now` (the one before it left or lapsed).
local function new_head(queue, tenant, now)
  local pace, _, count = pace_of(queue, tenant)
  set_pace(queue, tenant, pace, now, count)
end

-- How long (ms) a ticket with `ahead` (>= 1) of its tenant's tickets before it is expected
-- to wait from `now`: what is left of the pace for the first ticket, then a pace for each
-- ticket after it, this one included. Once the first ticket has been first for longer
-- than the pace, the pace counts it as if it were admitted now (the evidence that
-- releases slowed), and nothing is left for it. -1 while no pace is measured.
local function expected_wait(queue, tenant, ahead, now)
  local pace, head, count = pace_of(queue, tenant)
  if pace < 0 then return -1 end
  local first = redis.call('ZRANGE', queue[1], 0, 0, 'WITHSCORES')[2]
  local first_for = now - math.max(head, tonumber(first or now))
  if first_for > pace then return ahead * paced(pace, count, first_for) end
  return (pace - first_for) + ahead * pace
end

-- Drop the tenant's dead tickets (their ingress stopped renewing), and every tenant whose
-- tickets are all dead from the active and contending tenants. A dead first ticket
-- leaves the contention: the next one takes its place at its next poll.
local function purge_tickets(queue, tenant, now)
  local dead = redis.call('ZRANGEBYSCORE', queue[2], '-inf', now)
  local first = #dead > 0 and redis.call('ZRANGE', queue[1], 0, 0)[1]
  for _, ticket in ipairs(dead) do redis.call('ZREM', queue[1], ticket) end
  if #dead > 0 then
    redis.call('ZREMRANGEBYSCORE', queue[2], '-inf', now)
    redis.call('ZREM', queue[4], tenant)
    if first and not redis.call('ZSCORE', queue[1], first) then new_head(queue, tenant, now) end
  end
  local stale = redis.call('ZRANGEBYSCORE', queue[5], '-inf', now)
  for _, name in ipairs(stale) do
    redis.call('ZREM', queue[3], name)
    redis.call('ZREM', queue[4], name)
  end
  if #stale > 0 then redis.call('ZREMRANGEBYSCORE', queue[5], '-inf', now) end
  if redis.call('ZCARD', queue[1]) == 0 then retire(queue, tenant) end
end

-- nil when the request may go on: it is the tenant's first ticket (its lease renewed to
-- `lease_until`), or it has none and no ticket of its tenant waits. Else why it waits,
-- and how many tickets are ahead of it: `queued` (behind its tenant's tickets) or
-- `ticket_lost` (its lease lapsed).
local function take_turn(queue, tenant, ticket, lease_until)
  if ticket == '' then
    local waiting = redis.call('ZCARD', queue[1])
    if waiting > 0 then return 'queued', waiting end
    return nil, 0
  end
  if not redis.call('ZSCORE', queue[2], ticket) then return 'ticket_lost', 0 end
  redis.call('ZADD', queue[2], 'XX', lease_until, ticket)
  redis.call('ZADD', queue[5], 'GT', lease_until, tenant)
  local ahead = redis.call('ZRANK', queue[1], ticket)
  if ahead > 0 then return 'queued', ahead end
  return nil, 0
end

-- Whether `blocks` more fit the cluster's `capacity` (0: unbounded) now and it is the
-- tenant's turn: no tenant contends, or the tenant has the smallest counter among those
-- that do (ties by tenant id). A ticket that passed its tenant's limits contends.
local function cluster_turn(total, contending, tenant, ticket, counter, blocks, capacity)
  if capacity <= 0 then return true end
  if ticket ~= '' then redis.call('ZADD', contending, counter, tenant) end
  local first = redis.call('ZRANGE', contending, 0, 0)[1]
  if first ~= nil and first ~= tenant then return false end
  return tonumber(redis.call('GET', total) or '0') + blocks <= capacity
end

-- Whether the tenant, `blocks` more included, stays within its weighted share of the
-- cluster's `capacity` (capacity x `weight` / the weights of the tenants present) and the
-- cluster's reservation total, `blocks` more included, stays within twice the capacity.
-- Present: the tenant itself, the tenants queued (`active`), and those in `weights`
-- (tenant -> weight, written at each admission) whose reservation total (the string at
-- `total_prefix` .. tenant, kept by the admit, settle, release, renew and lapse scripts)
-- is above 0; an entry whose total is 0 is dropped here. Only asked when the cluster is
-- full; O(present tenants), numbers only (a queued tenant never admitted is the one read
-- from its quota). The reservation totals are read by name: standalone Redis only.
local function within_share(quotas, weights, active, total_prefix, tenant, weight, held,
                            blocks, capacity, cluster_total)
  if cluster_total + blocks > 2 * capacity then return false end
  if held + blocks > capacity then return false end
  local present, sum = {[tenant] = true}, weight
  local known = {}
  local flat = redis.call('HGETALL', weights)
  for i = 1, #flat, 2 do known[flat[i]] = tonumber(flat[i + 1]) end
  for name, other in pairs(known) do
    if not present[name] then
      if tonumber(redis.call('GET', total_prefix .. name) or '0') > 0 then
        present[name] = true
        sum = sum + other
      else
        redis.call('HDEL', weights, name)
      end
    end
  end
  for _, name in ipairs(redis.call('ZRANGE', active, 0, -1)) do
    if not present[name] then
      present[name] = true
      local other = known[name]
      if other == nil then
        local raw = redis.call('HGET', quotas, name)
        other = 0  -- a deleted tenant weighs nothing
        if raw then
          other = cjson.decode(raw)['weight']
          if type(other) ~= 'number' or other <= 0 then other = 1 end
        end
      end
      sum = sum + other
    end
  end
  return held + blocks <= capacity * weight / sum
end

-- The tenant's first ticket is admitted: it leaves the queue, the tenant's counter grows
-- by `cost` (blocks / weight), and the virtual time moves up to the counter it was served
-- at (never down). A tenant that its own limits will hold back (`held`: at its concurrency
-- limit, or no room in its budget for another request of this size) leaves the contention
-- and rejoins at its next ticket's poll, so it does not stall the others meanwhile; any
-- other tenant stays in it at its new counter, so the weights hold when room frees faster
-- than tickets poll. The tenant's pace takes the time the ticket was first (`now`: when it
-- was admitted, which makes the next ticket first).
local function served(queue, counters, vtime, tenant, ticket, counter, cost, held, now)
  local pace, head, count = pace_of(queue, tenant)
  local first_for = now - math.max(head, tonumber(redis.call('ZSCORE', queue[1], ticket)))
  set_pace(queue, tenant, paced(pace, count, first_for), now, count + 1)
  local after = counter + cost
  redis.call('HSET', counters, tenant, string.format('%.17g', after))
  local before = tonumber(redis.call('GET', vtime) or '0') or 0
  redis.call('SET', vtime, string.format('%.17g', math.max(before, counter)))
  redis.call('ZREM', queue[1], ticket)
  redis.call('ZREM', queue[2], ticket)
  if held then
    redis.call('ZREM', queue[4], tenant)
  else
    redis.call('ZADD', queue[4], 'XX', after, tenant)
  end
  if redis.call('ZCARD', queue[1]) == 0 then
    retire(queue, tenant)
  else
    redis.call('ZADD', queue[3], 'XX', after, tenant)
  end
end
"""

# KEYS: tickets, leases, active, contending, tenant leases, counters, virtual time, paces.
# ARGV: tenant, ticket, max depth, lease_ms, max wait ms (0: none). Returns {joined, depth,
# now_ms, expected wait ms}: joined 1, or 0 when the tenant's queue holds its max depth,
# or 2 when the ticket is expected to wait longer than the max wait (`expected_wait`; a
# ticket that would be first, or of a tenant with no pace yet, is never expected to).
# A tenant that becomes active (its first ticket) starts at the smallest counter of the
# contending tenants: idling earns no credit (VTC). With none contending, at the smallest
# counter of the active ones but not below the virtual time: an active tenant held back by
# its own limits is not served, so its counter may lag behind the others'.
ENQUEUE = (
    "local NOW_TIME = redis.call('TIME')\n"
    + QUEUE_FUNCTIONS
    + """
local now = tonumber(NOW_TIME[1]) * 1000 + math.floor(tonumber(NOW_TIME[2]) / 1000)
local queue = {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[8]}
local tenant, ticket = ARGV[1], ARGV[2]
purge_tickets(queue, tenant, now)
local depth = redis.call('ZCARD', KEYS[1])
if depth >= tonumber(ARGV[3]) then return {0, depth, now, -1} end
local max_wait = tonumber(ARGV[5])
local expected = depth > 0 and expected_wait(queue, tenant, depth, now) or -1
if max_wait > 0 and expected > max_wait then
  return {2, depth, now, string.format('%d', math.ceil(expected))}
end
if depth == 0 then
  local floor = tonumber(redis.call('ZRANGE', KEYS[4], 0, 0, 'WITHSCORES')[2] or '')
  if floor == nil then
    local vtime = tonumber(redis.call('GET', KEYS[7]) or '0') or 0
    local least = tonumber(redis.call('ZRANGE', KEYS[3], 0, 0, 'WITHSCORES')[2] or '')
    floor = math.max(least or vtime, vtime)
  end
  local lifted = math.max(counter_of(KEYS[6], tenant), floor)
  redis.call('HSET', KEYS[6], tenant, string.format('%.17g', lifted))
  redis.call('ZADD', KEYS[3], lifted, tenant)
end
local lease_until = now + tonumber(ARGV[4])
-- Strictly after the last ticket (tickets of one ms would otherwise sort by name).
local last = tonumber(redis.call('ZRANGE', KEYS[1], -1, -1, 'WITHSCORES')[2] or '-1')
redis.call('ZADD', KEYS[1], 'NX', math.max(now, last + 0.001), ticket)
redis.call('ZADD', KEYS[2], lease_until, ticket)
redis.call('ZADD', KEYS[5], 'GT', lease_until, tenant)
return {1, depth + 1, now, string.format('%d', math.ceil(expected))}
"""
)

# KEYS: tickets, leases, active, contending, tenant leases, paces. ARGV: tenant, ticket.
# 1 iff the ticket was queued. A first ticket that leaves ends its tenant's contention; the
# next one is first from now on.
LEAVE = (
    "local NOW_TIME = redis.call('TIME')\n"
    + QUEUE_FUNCTIONS
    + """
local now = tonumber(NOW_TIME[1]) * 1000 + math.floor(tonumber(NOW_TIME[2]) / 1000)
local queue = {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]}
local tenant, ticket = ARGV[1], ARGV[2]
local first = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
local removed = redis.call('ZREM', KEYS[1], ticket)
redis.call('ZREM', KEYS[2], ticket)
if redis.call('ZCARD', KEYS[1]) == 0 then
  retire(queue, tenant)
elseif first == ticket then
  redis.call('ZREM', KEYS[4], tenant)
  new_head(queue, tenant, now)
end
return removed
"""
)

# KEYS: tickets, leases, active, contending, tenant leases, paces. ARGV: tenant. Read only:
# {depth, expected wait ms of a ticket joining now (-1: it would be first, or no pace)};
# lapsed tickets not yet purged count.
EXPECTED_WAIT = (
    "local NOW_TIME = redis.call('TIME')\n"
    + QUEUE_FUNCTIONS
    + """
local now = tonumber(NOW_TIME[1]) * 1000 + math.floor(tonumber(NOW_TIME[2]) / 1000)
local queue = {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[6]}
local depth = redis.call('ZCARD', KEYS[1])
if depth == 0 then return {0, -1} end
return {depth, string.format('%d', math.ceil(expected_wait(queue, ARGV[1], depth, now)))}
"""
)
