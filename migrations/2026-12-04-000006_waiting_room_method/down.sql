ALTER TABLE waiting_rooms DROP COLUMN method;
