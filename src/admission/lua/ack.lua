-- ack.lua — record that the broker acknowledged reservations' events.
--
-- KEYS[1..] reservation hashes (one activity)
-- ARGV[1] now (unix ms)
--
-- An open reservation (status occupied) gets `acked`: from then on it is
-- never voided, only published again if the broker lost its event. Any
-- other status is left alone, and a missing record is not re-created.
-- Returns, per key, the status it found ('' when the record is missing):
-- 'occupied' means acknowledged now (or before).
local found = {}
for i = 1, #KEYS do
  local status = redis.call('HGET', KEYS[i], 'status')
  if status == 'occupied' then
    redis.call('HSETNX', KEYS[i], 'acked', ARGV[1])
  end
  found[i] = status or ''
end
return found
