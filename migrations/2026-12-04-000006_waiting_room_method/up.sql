-- How a waiting room lets buyers through (docs/WAITING_ROOM.md, "Queueing
-- methods"), changeable during a sale: `fifo` (the drawn pre-queue, then
-- in the order buyers came), `passthrough` (no pass needed: the room is
-- open without queueing), `reject` (the queue is closed: no join, no
-- admission, no purchase token). Existing rooms keep queueing: `fifo`.
ALTER TABLE waiting_rooms
    ADD COLUMN method TEXT NOT NULL DEFAULT 'fifo'
        CHECK (method IN ('fifo', 'passthrough', 'reject'));
