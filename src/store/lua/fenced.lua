-- fenced.lua — run reconciliation's writes only while its lease is the
-- newest one that wrote here.
--
-- KEYS[1] the slot's fence (the highest lease token that wrote in it)
-- KEYS[2..] every key the commands touch (one slot, for Redis Cluster)
-- ARGV[1] the writer's lease token
-- ARGV[2] the commands, a JSON array of arrays of strings ('[]': only
--         claim the fence)
-- ARGV[3] how long the fence is remembered (s)
--
-- A token below the fence belongs to a run that lost its lease without
-- knowing (a process paused past the lease's lifetime) while a newer holder
-- wrote here: nothing runs. Otherwise the fence moves up to the token and
-- the commands run, in order, atomically with the check.
-- Returns 1 when the commands ran, 0 when the writer was fenced off.
local fence = tonumber(redis.call('GET', KEYS[1]) or '0')
local token = tonumber(ARGV[1])
if token < fence then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[3])
for _, command in ipairs(cjson.decode(ARGV[2])) do
  redis.call(unpack(command))
end
return 1
