#!/usr/bin/env python3
"""One sale through a waiting room, from outside, on a development server.

    scripts/waiting_room_demo.py [--url http://127.0.0.1:8080] [--buyers 10]

Needs `app.env = "development"` (the default of `scripts/run.sh`): it signs
in through POST /api/v1/dev/token. It creates an activity of 5 units whose
pre-queue opens now and whose sale starts 20 s later, admitting 2 buyers a
second. The buyers join during the pre-queue, each solving the proof of
work. At the start it prints the drawn order, recomputed from the
published seed with scripts/verify_draw.py. Then each buyer buys with its
pass as its turn comes.
"""

import argparse
import datetime as dt
import hashlib
import json
import os
import sys
import time
import urllib.error
import urllib.request

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import verify_draw  # noqa: E402


def call(url, method="GET", body=None, token=None, headers=None):
    req = urllib.request.Request(url, method=method)
    if body is not None:
        req.data = json.dumps(body).encode()
        req.add_header("Content-Type", "application/json")
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    for k, v in (headers or {}).items():
        req.add_header(k, v)
    try:
        with urllib.request.urlopen(req) as res:
            return res.status, json.loads(res.read() or b"{}")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


def solve(challenge):
    """ALTCHA v1: the number in 0..=maxnumber whose SHA-256 after the salt
    is the challenge (the salt hashed once, then copied per try)."""
    target = bytes.fromhex(challenge["challenge"])
    salted = hashlib.sha256(challenge["salt"].encode())
    for n in range(challenge["maxnumber"] + 1):
        h = salted.copy()
        h.update(str(n).encode())
        if h.digest() == target:
            return n
    raise SystemExit("the challenge has no solution")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8080")
    ap.add_argument("--buyers", type=int, default=10)
    ap.add_argument("--pow-difficulty", type=int, default=50000,
                    help="the room's pow_difficulty (up to 10,000,000)")
    args = ap.parse_args()
    api = args.url.rstrip("/") + "/api/v1"

    def token(user, admin=False):
        status, body = call(f"{api}/dev/token", "POST", {"user_id": user, "admin": admin})
        if status != 200:
            raise SystemExit(f"no development token ({status} {body}): is app.env development?")
        return body["token"]

    admin = token(1, admin=True)
    _, listing = call(f"{api}/activities")
    now = dt.datetime.fromisoformat(listing["server_time"].replace("Z", "+00:00"))
    # Every buyer joins the pre-queue: the start waits for their proofs of
    # work (about a million hashes a second here, half the range each).
    start = now + dt.timedelta(seconds=20 + args.buyers * args.pow_difficulty / 1_000_000)
    body = {
        "sku_id": 1001, "name": "Console (waiting room demo)", "price_cents": 49900,
        "stock": 5, "per_user_limit": 1,
        "start_at": start.isoformat(), "end_at": (start + dt.timedelta(hours=1)).isoformat(),
        "waiting_room": {"prequeue_secs": 600, "admit_per_sec": 2, "pass_ttl_secs": 120,
                         "offer_secs": 60, "pow_difficulty": args.pow_difficulty},
    }
    status, activity = call(f"{api}/admin/activities", "POST", body, admin)
    assert status == 201, (status, activity)
    aid = activity["activity_id"]
    call(f"{api}/admin/activities/{aid}/warmup", "POST", {}, admin)
    seed_sha256 = activity["waiting_room"]["seed_sha256"]
    print(f"activity {aid}: the sale starts at {start:%H:%M:%S}; seed SHA-256 {seed_sha256}")

    buyers = {u: token(u) for u in range(101, 101 + args.buyers)}
    tickets = {}
    for u, t in buyers.items():
        _, c = call(f"{api}/activities/{aid}/queue/challenge", token=t)
        began = time.monotonic()
        number = solve(c)
        took = time.monotonic() - began
        pow_answer = {k: c[k] for k in ("algorithm", "challenge", "salt", "signature")}
        pow_answer["number"] = number
        status, ticket = call(f"{api}/activities/{aid}/queue", "POST", {"pow": pow_answer}, t)
        assert status == 201, (status, ticket, f"number {number} of {c['maxnumber']}")
        tickets[u] = ticket["ticket"]
        print(f"buyer {u}: proof of work in {took:.2f} s (number {number:,} of "
              f"{c['maxnumber']:,}), ticket {ticket['ticket']} ({status}, {ticket['state']})")

    print("waiting for the start…")
    while True:
        status, draw = call(f"{api}/activities/{aid}/queue/draw")
        if status == 200:
            break
        time.sleep(1)
    where = verify_draw.places(bytes.fromhex(draw["seed"]), draw["commitment"],
                               int(draw["entrants"]))
    order = sorted(range(len(where)), key=lambda i: where[i])
    print(f"drawn order of the {draw['entrants']} pre-queue tickets: {[i + 1 for i in order]}")
    assert hashlib.sha256(bytes.fromhex(draw["seed"])).hexdigest() == seed_sha256

    wrong = []
    for u, number in tickets.items():
        if number <= len(where):
            _, ticket = call(f"{api}/activities/{aid}/queue/me?proof=true", token=buyers[u])
            if ticket["position"] != where[number - 1] + 1:
                wrong.append(f"buyer {u}: ticket {number} is at place {ticket['position']}, "
                             f"the draw puts it at {where[number - 1] + 1}")
            # Each buyer checks their own ticket was among the committed
            # entrants, from their proof alone.
            why = verify_draw.included(number, ticket.get("inclusion") or {"user": u, "salt": "",
                                       "path": []}, int(draw["entrants"]), draw["commitment"])
            if why:
                wrong.append(f"buyer {u}: ticket {number}'s inclusion proof fails: {why}")
            else:
                print(f"buyer {u}: ticket {number} proven among the {draw['entrants']} entrants "
                      f"({len(ticket['inclusion']['path'])} hashes)")

    ordered, sold_out = [], []
    pending = dict(buyers)
    while pending:
        for u, t in list(pending.items()):
            _, ticket = call(f"{api}/activities/{aid}/queue/me", token=t)
            if ticket["state"] in ("QUEUED", "PREQUEUE"):
                continue
            if ticket["state"] == "ADMITTED":
                status, tok = call(f"{api}/activities/{aid}/token", token=t,
                                   headers={"X-Queue-Pass": ticket["pass"]})
                if status == 200:
                    status, order_body = call(
                        f"{api}/activities/{aid}/orders", "POST",
                        {"request_id": f"demo-{u}", "token": tok["token"]}, t)
                    print(f"buyer {u} (place {ticket['position']}): admitted, order "
                          f"{status} {order_body.get('status') or order_body.get('code')}")
                    if status == 202:
                        ordered.append(u)
                    elif order_body.get("code") == "SOLD_OUT":
                        sold_out.append(u)
                else:
                    print(f"buyer {u} (place {ticket['position']}): admitted, {tok['code']}")
                    if tok.get("code") == "SOLD_OUT":
                        sold_out.append(u)
            else:
                print(f"buyer {u} (place {ticket['position']}): {ticket['state']}")
                if ticket["state"] == "SOLD_OUT":
                    sold_out.append(u)
            del pending[u]
        time.sleep(0.5)

    units = min(body["stock"], len(buyers))
    if len(ordered) != units:
        wrong.append(f"{len(ordered)} orders accepted for {units} units")
    if len(ordered) + len(sold_out) != len(buyers):
        wrong.append(f"of {len(buyers)} buyers, {len(ordered)} bought and {len(sold_out)} "
                     "were told it sold out")
    if wrong:
        raise SystemExit("the sale did not go as the room promises:\n  " + "\n  ".join(wrong))
    print(f"{len(ordered)} orders for {units} units, in the drawn order; "
          f"{len(sold_out)} buyers told it sold out")


if __name__ == "__main__":
    main()
