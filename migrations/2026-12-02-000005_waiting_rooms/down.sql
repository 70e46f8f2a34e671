DROP TABLE waiting_rooms;
