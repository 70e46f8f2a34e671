#!/usr/bin/env python3
"""Recompute a waiting room's pre-queue order from what the server publishes.

    scripts/verify_draw.py http://HOST/api/v1/activities/ID/queue/draw
    curl -s .../queue/draw | scripts/verify_draw.py -

Prints the pre-queue tickets in the order they are admitted, one per line
(the ticket drawn first, first). Exits 1 when the published seed does not
match the SHA-256 published before the pre-queue opened (pass it with
--seed-sha256, from GET /api/v1/activities/ID's waiting_room).

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


def main() -> int:
    args = [a for a in sys.argv[1:] if not a.startswith("--seed-sha256=")]
    expected = [a.split("=", 1)[1] for a in sys.argv[1:] if a.startswith("--seed-sha256=")]
    if len(args) != 1:
        print(__doc__, file=sys.stderr)
        return 2
    src = args[0]
    raw = sys.stdin.read() if src == "-" else urllib.request.urlopen(src).read()
    draw = json.loads(raw)
    seed = bytes.fromhex(draw["seed"])
    digest = hashlib.sha256(seed).hexdigest()
    for want in expected + [draw.get("seed_sha256", digest)]:
        if digest != want:
            print(f"the seed's SHA-256 is {digest}, not the published {want}", file=sys.stderr)
            return 1
    where = places(seed, draw["commitment"], int(draw["entrants"]))
    order = sorted(range(len(where)), key=lambda i: where[i])
    for i in order:
        print(i + 1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
