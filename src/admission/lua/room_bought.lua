-- room_bought.lua — a purchase made with a ticket's pass or offer was
-- accepted: the ticket bought. It leaves the waitlist for good (a later
-- cancel does not put it back), and an offer it used stops holding a unit
-- at once (the unit is its order's now), not when the offer's time runs
-- out.
--
-- KEYS[1] room   KEYS[2] users   KEYS[3] states   KEYS[4] active
-- KEYS[5] offers   ARGV[1] user
--
-- States: `U:<exp>` (a used pass) becomes `B:<exp>`, `V:<exp>` (a used
-- offer) becomes `D:<exp>`; any other is left as it is. Each mark counts
-- in the room's `taken`: an admission round subtracts those made since its
-- caller read the units (room_admit.lua).
-- Returns 1 marked now, 0 nothing to mark, -1 no room.
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local t = redis.call('HGET', KEYS[2], ARGV[1])
if not t then return 0 end
local st = redis.call('HGET', KEYS[3], t) or ''
local kind, exp = string.sub(st, 1, 2), string.sub(st, 3)
local bought
if kind == 'U:' then bought = 'B:' elseif kind == 'V:' then bought = 'D:' end
if not bought then return 0 end
redis.call('HSET', KEYS[3], t, bought .. exp)
redis.call('HINCRBY', KEYS[1], 'taken', 1)
redis.call('ZREM', KEYS[4], t)
redis.call('ZREM', KEYS[5], t)
return 1
