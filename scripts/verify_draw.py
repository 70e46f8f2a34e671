#!/usr/bin/env python3
"""Recompute a waiting room's pre-queue order from what the server publishes.

    scripts/verify_draw.py http://HOST/api/v1/activities/ID/queue/draw
    curl -s .../queue/draw | scripts/verify_draw.py -
    scripts/verify_draw.py --ticket=me.json DRAW

Prints the pre-queue tickets in the order they are admitted, one per line
(the ticket drawn first, first). Exits 1 when the published seed does not
match the SHA-256 published before the pre-queue opened (pass it with
--seed-sha256, from GET /api/v1/activities/ID's waiting_room).

With --ticket=FILE (or - for stdin), FILE being a buyer's own
GET .../queue/me?proof=true, checks instead that the buyer's ticket is one
of the entrants the published commitment covers, and that the place the
server told them is the one the draw gives it: prints one line saying so,
or exits 1 saying what does not hold. It needs nobody else's user.

The algorithm (docs/WAITING_ROOM.md), written here apart from the server's
own code so that it checks it rather than repeats it:

    key   = SHA-256("seckill-draw-v1\\n" + seed bytes + "\\n" + commitment
                    + "\\n" + decimal(entrants))
    bits  = number of bits of (entrants - 1); half = max(1, ceil(bits / 2))
    F(r, x) = first 8 bytes (big-endian) of HMAC-SHA-256(key, byte(r) +
              x as 8 bytes big-endian), masked to `half` bits
    E(x)  = 8 Feistel rounds on (x >> half, x & mask):
            (L, R) <- (R, L xor F(r, R)) for r = 0..7
    place(i) = E(i), applied again while the result is >= entrants
The ticket numbered t (1-based) is at place(t - 1).

The commitment is the root of a Merkle tree over the entrants, one leaf
per ticket in ticket order:

    leaf(t) = SHA-256(0x00 + t as 8 bytes + user as 8 bytes (signed) + salt)
    node    = SHA-256(0x01 + left + right); a level's odd last node goes up
              unchanged; the root of one leaf is the leaf
"""

import hashlib
import hmac
import json
import sys
import urllib.request

ROUNDS = 8


def key(seed: bytes, commitment: str, entrants: int) -> bytes:
    return hashlib.sha256(
        b"seckill-draw-v1\n" + seed + b"\n" + commitment.encode() + b"\n"
        + str(entrants).encode()
    ).digest()


def places(seed: bytes, commitment: str, entrants: int) -> list:
    """places[i] = the place (0-based) of the ticket numbered i + 1."""
    k = key(seed, commitment, entrants)
    bits = max(entrants - 1, 0).bit_length()
    half = max(1, (bits + 1) // 2)
    mask = (1 << half) - 1

    def f(r: int, x: int) -> int:
        mac = hmac.new(k, bytes([r]) + x.to_bytes(8, "big"), hashlib.sha256).digest()
        return int.from_bytes(mac[:8], "big") & mask

    def e(x: int) -> int:
        left, right = x >> half, x & mask
        for r in range(ROUNDS):
            left, right = right, left ^ f(r, right)
        return (left << half) | right

    out = []
    for i in range(entrants):
        x = e(i)
        while x >= entrants:
            x = e(x)
        out.append(x)
    return out


def leaf(ticket: int, user: int, salt: bytes) -> bytes:
    return hashlib.sha256(
        b"\x00" + ticket.to_bytes(8, "big") + user.to_bytes(8, "big", signed=True) + salt
    ).digest()


def node(left: bytes, right: bytes) -> bytes:
    return hashlib.sha256(b"\x01" + left + right).digest()


def included(ticket: int, proof: dict, entrants: int, root: str) -> str:
    """'' when `proof` leads from the ticket's leaf to `root` in a tree of
    `entrants` leaves, with the shape the ticket's index must have; else
    what does not hold."""
    if not 1 <= ticket <= entrants:
        return f"ticket {ticket} is not among the {entrants} entrants"
    running = leaf(ticket, int(proof["user"]), bytes.fromhex(proof["salt"]))
    at, width, steps = ticket - 1, entrants, list(proof["path"])
    while width > 1:
        sibling = at ^ 1
        if sibling < width:
            if not steps:
                return "the path is shorter than the tree is deep"
            step = steps.pop(0)
            want = "L" if sibling < at else "R"
            if step["side"] != want:
                return f"a step on side {step['side']} where the ticket's place needs {want}"
            h = bytes.fromhex(step["hash"])
            running = node(h, running) if want == "L" else node(running, h)
        at >>= 1
        width = (width + 1) // 2
    if steps:
        return "the path is longer than the tree is deep"
    if running.hex() != root:
        return f"the path leads to {running.hex()}, not the published commitment {root}"
    return ""


def read(src: str) -> dict:
    if src == "-":
        return json.loads(sys.stdin.read())
    if "://" in src:
        return json.loads(urllib.request.urlopen(src).read())
    with open(src) as f:
        return json.load(f)


def main() -> int:
    opts = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in sys.argv[1:] if "=" in a and a.startswith("--")}
    args = [a for a in sys.argv[1:] if not (a.startswith("--") and "=" in a)]
    if len(args) != 1 or set(opts) - {"--seed-sha256", "--ticket"} or (
        args[0] == "-" and opts.get("--ticket") == "-"
    ):
        print(__doc__, file=sys.stderr)
        return 2
    expected = [opts["--seed-sha256"]] if "--seed-sha256" in opts else []
    draw = read(args[0])
    seed = bytes.fromhex(draw["seed"])
    digest = hashlib.sha256(seed).hexdigest()
    for want in expected + [draw.get("seed_sha256", digest)]:
        if digest != want:
            print(f"the seed's SHA-256 is {digest}, not the published {want}", file=sys.stderr)
            return 1
    entrants = int(draw["entrants"])
    if "--ticket" in opts:
        me = read(opts["--ticket"])
        proof = me.get("inclusion")
        ticket = int(me["ticket"])
        if proof is None:
            print(f"ticket {ticket} carries no proof: not taken in the pre-queue, or not asked "
                  "with ?proof=true", file=sys.stderr)
            return 1
        if int(proof["entrants"]) != entrants or proof["root"] != draw["commitment"]:
            print("the proof is of another tree than the published draw's", file=sys.stderr)
            return 1
        why = included(ticket, proof, entrants, draw["commitment"])
        if why:
            print(why, file=sys.stderr)
            return 1
        where = places(seed, draw["commitment"], entrants)
        place = where[ticket - 1] + 1
        if me.get("position") is not None and int(me["position"]) != place:
            print(f"the server placed ticket {ticket} at {me['position']}, the draw at {place}",
                  file=sys.stderr)
            return 1
        print(f"ticket {ticket} of user {proof['user']} is entrant {ticket} of {entrants} "
              f"under commitment {draw['commitment']}; its place in the draw is {place}")
        return 0
    where = places(seed, draw["commitment"], entrants)
    order = sorted(range(len(where)), key=lambda i: where[i])
    for i in order:
        print(i + 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
