-- void.lua — claim an open reservation for voiding (SPEC step 4).
--
-- KEYS[1] reservation hash
-- ARGV[1] cutoff (unix ms)
--
-- An occupied reservation that the broker never acknowledged and that was
-- neither made nor sent at or after the cutoff becomes 'voiding': from then
-- on no purchase retry can confirm it (ack.lua leaves it alone) and no
-- sender sends it again. The caller then arbitrates by the order row and
-- either releases or commits it. A reservation already 'voiding' (a run
-- that stopped half-way) is claimed again.
-- Returns 1 when the caller may void it, 0 when not, -1 when it is gone.
local r = redis.call('HMGET', KEYS[1], 'status', 'acked', 'ts', 'sent')
if not r[1] then return -1 end
if r[1] == 'voiding' then return 1 end
if r[1] ~= 'occupied' or r[2] then return 0 end
local last = math.max(tonumber(r[3] or '0'), tonumber(r[4] or '0'))
if last >= tonumber(ARGV[1]) then return 0 end
redis.call('HSET', KEYS[1], 'status', 'voiding')
return 1
