"""The fair queue's Lua: functions the admission script shares, and the scripts that add a
ticket, take one away and read the queues (:mod:`controlplane.fair_queue` states the
contract). All on Redis's clock.

A queue is the Lua table ``{tickets, leases, active, contending, tenant_leases}`` of keys:
the tenant's tickets (sorted set, ticket -> enqueued ms: its FIFO order), their leases
(ticket -> ms after which it is dead), the active tenants (tenant -> virtual counter:
every tenant with a ticket), the contending tenants (tenant -> virtual counter: those whose
first ticket passed its own limits and waits for the cluster, and those just served whose
own limits will not hold their next ticket) and the tenants' leases
(tenant -> the latest lease of its tickets).
"""

QUEUE_FUNCTIONS = """
local function counter_of(counters, tenant)
  return tonumber(redis.call('HGET', counters, tenant) or '0') or 0
end

-- Nobody waits for `tenant` any more: it leaves the active and contending tenants.
local function retire(queue, tenant)
  redis.call('ZREM', queue[3], tenant)
  redis.call('ZREM', queue[4], tenant)
  redis.call('ZREM', queue[5], tenant)
end

-- Drop the tenant's dead tickets (their ingress stopped renewing), and every tenant whose
-- tickets are all dead from the active and contending tenants. A dead first ticket
-- leaves the contention: the next one takes its place at its next poll.
local function purge_tickets(queue, tenant, now)
  local dead = redis.call('ZRANGEBYSCORE', queue[2], '-inf', now)
  for _, ticket in ipairs(dead) do redis.call('ZREM', queue[1], ticket) end
  if #dead > 0 then
    redis.call('ZREMRANGEBYSCORE', queue[2], '-inf', now)
    redis.call('ZREM', queue[4], tenant)
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
-- than tickets poll.
local function served(queue, counters, vtime, tenant, ticket, counter, cost, held)
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

# KEYS: tickets, leases, active, contending, tenant leases, counters, virtual time.
# ARGV: tenant, ticket, max depth, lease_ms. Returns {1 if queued else 0, depth, now_ms}.
# A tenant that becomes active (its first ticket) starts at the smallest counter of the
# contending tenants: idling earns no credit (VTC). With none contending, at the smallest
# counter of the active ones but not below the virtual time: an active tenant held back by
# its own limits is not served, so its counter may lag behind the others'.
ENQUEUE = (
    "local NOW_TIME = redis.call('TIME')\n"
    + QUEUE_FUNCTIONS
    + """
local now = tonumber(NOW_TIME[1]) * 1000 + math.floor(tonumber(NOW_TIME[2]) / 1000)
local queue, tenant, ticket = {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]}, ARGV[1], ARGV[2]
purge_tickets(queue, tenant, now)
local depth = redis.call('ZCARD', KEYS[1])
if depth >= tonumber(ARGV[3]) then return {0, depth, now} end
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
return {1, depth + 1, now}
"""
)

# KEYS: tickets, leases, active, contending, tenant leases. ARGV: tenant, ticket.
# 1 iff the ticket was queued. A first ticket that leaves ends its tenant's contention.
LEAVE = (
    QUEUE_FUNCTIONS
    + """
local queue, tenant, ticket = {KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5]}, ARGV[1], ARGV[2]
local first = redis.call('ZRANGE', KEYS[1], 0, 0)[1]
local removed = redis.call('ZREM', KEYS[1], ticket)
redis.call('ZREM', KEYS[2], ticket)
if redis.call('ZCARD', KEYS[1]) == 0 then
  retire(queue, tenant)
elseif first == ticket then
  redis.call('ZREM', KEYS[4], tenant)
end
return removed
"""
)
