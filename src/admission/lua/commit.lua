-- commit.lua — mark reservations whose orders the database now holds.
--
-- KEYS[1] open-reservations zset   KEYS[2..] reservation hashes
-- ARGV[1..] the order_nos of KEYS[2..], in the same order
--
-- occupied (or voiding: the reconciler lost the race to the order row) ->
-- committed, and out of the open set. Idempotent. Returns the order_nos that
-- were already released (a conflict for the caller to report).
local conflicts = {}
for i = 2, #KEYS do
  local status = redis.call('HGET', KEYS[i], 'status')
  if status == 'occupied' or status == 'voiding' then
    redis.call('HSET', KEYS[i], 'status', 'committed')
  elseif status == 'released' then
    conflicts[#conflicts + 1] = ARGV[i - 1]
  end
  redis.call('ZREM', KEYS[1], ARGV[i - 1])
end
return conflicts
