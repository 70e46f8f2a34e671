-- reserve.lua — admission, SPEC step 1, in one atomic call.
--
-- KEYS[1] meta hash        (start_ms, end_ms, limit; absent until warmed)
-- KEYS[2] requests hash    ("<user>:<request_id>" -> order_no)
-- KEYS[3] holdings hash    (user -> live quantity)
-- KEYS[4] purchase token   (string, value = user id, or `<user id>:<most units>`)
-- KEYS[5] reservation hash of this order_no
-- KEYS[6] open-reservations zset (order_no scored by reservation time)
-- KEYS[7] dry marker (sharded activities: every other shard was empty)
-- KEYS[8..] stock buckets, in bucket order
-- ARGV[1] user id   ARGV[2] request_id   ARGV[3] quantity   ARGV[4] order_no
-- ARGV[5] now (unix ms)   ARGV[6] first bucket to try (0-based)
-- ARGV[7] reservation ttl (s)   ARGV[8] coupon id ('' for none)
-- ARGV[9] '1' when the activity is sharded (these keys are the buyer's shard)
--
-- Returns {code, order_no}:
--   0 accepted (the given order_no)   1 duplicate (the existing order_no)
--   2 sold out   3 limit exceeded   4 invalid token
--   5 outside the sale window   6 not warm (never warmed, or Redis lost it)
--   7 the order_no already keys a reservation (two instances minted the
--     same number): nothing is written, the existing one is untouched
--   8 this shard lacks the quantity but others may not (sharded, and no
--     dry marker): nothing is written; the caller borrows units and retries
--
-- The reservation keeps everything its order.requested event carries, so
-- the event can be rebuilt and sent again byte for byte (a retry of a
-- purchase whose delivery is unknown; reconciliation after a broker lost it).
local user, req, qty, order_no = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local now = tonumber(ARGV[5])
local req_field = user .. ':' .. req

local existing = redis.call('HGET', KEYS[2], req_field)
if existing then return {1, existing} end
if redis.call('EXISTS', KEYS[5]) == 1 then return {7, ''} end

local meta = redis.call('HMGET', KEYS[1], 'start_ms', 'end_ms', 'limit')
if not meta[1] then return {6, ''} end
if now < tonumber(meta[1]) or now >= tonumber(meta[2]) then return {5, ''} end

-- The token is the user id, or `<user>:<most>` for one that buys at most
-- that many units (a waiting room's offer holds one).
local bound = redis.call('GET', KEYS[4])
local most
if bound then
  local u, m = string.match(bound, '^([^:]+):(%d+)$')
  if u then bound, most = u, tonumber(m) end
end
if bound ~= user then return {4, ''} end
if most and qty > most then return {3, ''} end

local held = tonumber(redis.call('HGET', KEYS[3], user) or '0')
if held + qty > tonumber(meta[3]) then return {3, ''} end

-- Stock: the first bucket (from ARGV[6] on) that holds the whole quantity;
-- failing that, take it from several buckets. SOLD_OUT only when all the
-- buckets together hold less than the quantity.
local n = #KEYS - 7
local first = tonumber(ARGV[6]) % n
local alloc
local partial, sum = {}, 0
for i = 0, n - 1 do
  local b = (first + i) % n
  local s = tonumber(redis.call('GET', KEYS[8 + b]) or '0')
  if s >= qty then
    redis.call('DECRBY', KEYS[8 + b], qty)
    alloc = b .. ':' .. qty
    break
  end
  if s > 0 then
    partial[#partial + 1] = {b, s}
    sum = sum + s
  end
end
if not alloc then
  if sum < qty then
    if ARGV[9] == '1' and redis.call('EXISTS', KEYS[7]) == 0 then return {8, ''} end
    return {2, ''}
  end
  local need, parts = qty, {}
  for _, e in ipairs(partial) do
    local take = math.min(need, e[2])
    redis.call('DECRBY', KEYS[8 + e[1]], take)
    parts[#parts + 1] = e[1] .. ':' .. take
    need = need - take
    if need == 0 then break end
  end
  alloc = table.concat(parts, ',')
end

redis.call('HSET', KEYS[5], 'user', user, 'qty', qty, 'alloc', alloc,
  'req', req, 'status', 'occupied', 'ts', now)
if ARGV[8] ~= '' then redis.call('HSET', KEYS[5], 'coupon', ARGV[8]) end
-- A capped token's cap, so a purchase refused before it was sent gives
-- the same token back (admit.rs), not one that buys up to the limit.
if most then redis.call('HSET', KEYS[5], 'most', most) end
redis.call('EXPIRE', KEYS[5], tonumber(ARGV[7]))
redis.call('ZADD', KEYS[6], now, order_no)
redis.call('HSET', KEYS[2], req_field, order_no)
redis.call('HINCRBY', KEYS[3], user, qty)
redis.call('DEL', KEYS[4])
-- Counted, so an instance's sold-out fast path knows when its list of
-- buyers is out of date (admission/soldout.rs).
redis.call('HINCRBY', KEYS[1], 'accepted', 1)
return {0, order_no}
