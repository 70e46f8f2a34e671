-- room_leave.lua — a user leaves the queue; their pass or offer goes with
-- them (an offer's unit passes to the next ticket).
--
-- KEYS[1] room   KEYS[2] users   KEYS[3] states   KEYS[4] active
-- KEYS[5] offers   ARGV[1] user
--
-- Returns the ticket left, 0 when the user holds none, -1 no room.
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local t = redis.call('HGET', KEYS[2], ARGV[1])
if not t then return 0 end
redis.call('HSET', KEYS[3], t, 'L')
redis.call('ZREM', KEYS[4], t)
redis.call('ZREM', KEYS[5], t)
return tonumber(t)
