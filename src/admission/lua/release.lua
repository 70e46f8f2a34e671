-- release.lua — give a reservation's stock back, once per order_no.
--
-- KEYS[1] reservation hash   KEYS[2] open-reservations zset
-- KEYS[3] holdings hash      KEYS[4] requests hash
-- KEYS[5..] stock buckets, in bucket order
-- ARGV[1] order_no   ARGV[2] reason
-- ARGV[3] "1" to forget the request_id too (the order never existed: a
--         retry with the same request_id is a new attempt), else "0".
--         That claim holds only for a reservation still open and never
--         acknowledged: one a retry's send got acknowledged (`acked`), or
--         whose order a consumer already wrote (`committed`), is kept.
-- ARGV[4] units to give back if Redis has no record of the reservation
--         (expired or lost; "0" = give nothing back)
-- ARGV[5] the buyer, for that same case
-- ARGV[6] the stock-returned channel   ARGV[7] the activity id
--
-- Units given back are announced on ARGV[6] in the same call, so every
-- instance's sold-out flag for the activity clears (admission/soldout.rs).
-- Returns 1 when released now, 0 when already released or unknown, 2 when
-- kept: asked to forget an order that exists (see ARGV[3]).
local r = redis.call('HMGET', KEYS[1], 'status', 'user', 'qty', 'alloc', 'req', 'acked')
if r[1] == 'released' then return 0 end
if ARGV[3] == '1' and r[1] and (r[1] ~= 'occupied' or r[6]) then return 2 end
if not r[1] then
  local qty = tonumber(ARGV[4])
  if qty <= 0 then return 0 end
  -- Record the release first, so a repeat of this call is a no-op.
  redis.call('HSET', KEYS[1], 'status', 'released', 'reason', ARGV[2],
    'user', ARGV[5], 'qty', qty, 'alloc', '0:' .. qty, 'req', '')
  redis.call('EXPIRE', KEYS[1], 604800)
  redis.call('INCRBY', KEYS[5], qty)
  if redis.call('HINCRBY', KEYS[3], ARGV[5], -qty) <= 0 then
    redis.call('HDEL', KEYS[3], ARGV[5])
  end
  redis.call('PUBLISH', ARGV[6], ARGV[7])
  return 1
end
for part in string.gmatch(r[4], '[^,]+') do
  local b, q = string.match(part, '(%d+):(%d+)')
  redis.call('INCRBY', KEYS[5 + tonumber(b)], tonumber(q))
end
if redis.call('HINCRBY', KEYS[3], r[2], -tonumber(r[3])) <= 0 then
  redis.call('HDEL', KEYS[3], r[2])
end
if ARGV[3] == '1' then
  redis.call('HDEL', KEYS[4], r[2] .. ':' .. r[5])
end
redis.call('HSET', KEYS[1], 'status', 'released', 'reason', ARGV[2])
redis.call('ZREM', KEYS[2], ARGV[1])
redis.call('PUBLISH', ARGV[6], ARGV[7])
return 1
