# Folded stacks (comm;root;...;leaf count) -> the share of samples of each
# stage of an accepted order; the first rule that matches wins.
import sys, collections
RULES = [
    ("librdkafka's own threads (produce requests, delivery reports, fetches)", lambda c, s: c.startswith("rdk:")),
    ("consumer: the Diesel batch (apply_batch, libpq)", lambda c, s: "apply_batch" in s or "diesel::" in s or "PQ" in s and "orders::" in s),
    ("consumer: commit marks in Redis", lambda c, s: "orders::consumer" in s and ("gate::" in s or "redis::" in s)),
    ("consumer: poll, decode, offsets, the rest", lambda c, s: "orders::consumer" in s or "bus::runner" in s or "BaseConsumer" in s or "StreamConsumer" in s),
    ("acknowledgement write (Redis)", lambda c, s: "admission::acks" in s),
    ("reserve.lua (EVALSHA, reply)", lambda c, s: "gate::reserve" in s),
    ("the event's encoding", lambda c, s: "OrderRequested" in s and "encode" in s),
    ("publish: produce call and delivery wait", lambda c, s: "admission::publish" in s or "bus::producer" in s or "rdkafka::" in s),
    ("the id", lambda c, s: "seckill::ids" in s or "snowflake" in s),
    # By frame, not by substring: the route handler's own type names AuthUser.
    ("authentication (JWT)", lambda c, s: any(f.startswith(("seckill::http::auth::", "seckill::auth::", "from_request<seckill::http::auth::")) for f in s.split(";"))),
    ("the purchase token", lambda c, s: "token" in s and "seckill::admission" in s),
    ("admission: the rest (limits, checks, answer)", lambda c, s: "seckill::admission" in s or "routes::orders::place" in s),
    ("Redis connection driver (every call's I/O)", lambda c, s: "redis::aio" in s),
    ("HTTP: actix, parsing, the response", lambda c, s: "actix" in s or c == "actix-server"),
    ("runtime, kernel and the rest", lambda c, s: True),
]
counts = collections.Counter(); total = 0
for line in open(sys.argv[1]):
    stack, n = line.rsplit(" ", 1); n = int(n); total += n
    comm = stack.split(";", 1)[0]
    for name, rule in RULES:
        if rule(comm, stack):
            counts[name] += n; break
us = float(sys.argv[2]) if len(sys.argv) > 2 else None
print(f"samples: {total}")
for name, _ in RULES:
    share = counts[name] / total
    extra = f" | {share * us:5.1f}" if us else ""
    print(f"| {name} | {share * 100:5.1f} %{extra} |")
