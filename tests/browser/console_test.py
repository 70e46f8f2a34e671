"""The web console in a real browser (Debian's headless Chromium, driven
through chromedriver by Selenium) against a running seckill server.

    python console_test.py BASE_URL SCREENSHOT_DIR

The buyer page: sign in (development token), buy, watch the order go
PROCESSING -> WAITING_PAY, pay through the mock provider, watch it go PAID;
then the messages for LIMIT_EXCEEDED, SOLD_OUT and RATE_LIMITED, each
caused for real on the server. The operator page: the live figures, creating,
warming up and ending an activity, and a reconciliation run. Screenshots go
to SCREENSHOT_DIR. Every wait is bounded (generous, for slow hosts) and
fails with what the page showed.
"""

import datetime as dt
import hashlib
import json
import pathlib
import sys
import tempfile
import threading
import urllib.error
import urllib.request

from selenium import webdriver
from selenium.common.exceptions import (
    NoSuchElementException,
    StaleElementReferenceException,
    TimeoutException,
)
from selenium.webdriver.chrome.service import Service
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

BASE = sys.argv[1].rstrip("/")
SHOTS = pathlib.Path(sys.argv[2])
SHOTS.mkdir(parents=True, exist_ok=True)
WAIT = 90  # seconds: a 2-core host three times slower than ours still fits


# ---- the API, for setting the stage ----------------------------------------

def call(method, path, body=None, token=None):
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(BASE + path, data=data, method=method)
    if body is not None:
        req.add_header("content-type", "application/json")
    if token:
        req.add_header("authorization", "Bearer " + token)
    try:
        with urllib.request.urlopen(req, timeout=30) as res:
            return res.status, json.loads(res.read() or b"null")
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"null")


def dev_token(user_id, admin=False):
    status, body = call("POST", "/api/v1/dev/token", {"user_id": user_id, "admin": admin})
    assert status == 200, (status, body)
    return body["token"]


ADMIN = dev_token(1, admin=True)


def activity(name, stock, per_user_limit=1):
    now = dt.datetime.now(dt.timezone.utc)
    status, body = call("POST", "/api/v1/admin/activities", {
        "sku_id": 1, "name": name, "price_cents": 1999, "stock": stock,
        "start_at": (now - dt.timedelta(seconds=60)).isoformat(),
        "end_at": (now + dt.timedelta(hours=1)).isoformat(),
        "per_user_limit": per_user_limit, "pay_timeout_secs": 900,
    }, ADMIN)
    assert status == 201, (status, body)
    aid = body["activity_id"]
    status, body = call("POST", f"/api/v1/admin/activities/{aid}/warmup", {}, ADMIN)
    assert status == 200, (status, body)
    return aid


def buy_via_api(user_id, aid, request_id):
    token = dev_token(user_id)
    status, body = call("GET", f"/api/v1/activities/{aid}/token", token=token)
    assert status == 200, (status, body)
    return call("POST", f"/api/v1/activities/{aid}/orders",
                {"request_id": request_id, "token": body["token"]}, token)


def room_activity(name, stock, start_in, rate):
    """A warmed activity with a waiting room whose sale starts `start_in`
    seconds from now (its pre-queue is open already)."""
    start = dt.datetime.now(dt.timezone.utc) + dt.timedelta(seconds=start_in)
    status, body = call("POST", "/api/v1/admin/activities", {
        "sku_id": 1, "name": name, "price_cents": 2999, "stock": stock,
        "start_at": start.isoformat(), "end_at": (start + dt.timedelta(hours=1)).isoformat(),
        "per_user_limit": 1, "pay_timeout_secs": 900,
        "waiting_room": {"prequeue_secs": 600, "admit_per_sec": rate, "pass_ttl_secs": 120,
                         "offer_secs": 60, "pow_difficulty": 2000},
    }, ADMIN)
    assert status == 201, (status, body)
    aid = body["activity_id"]
    status, body = call("POST", f"/api/v1/admin/activities/{aid}/warmup", {}, ADMIN)
    assert status == 200, (status, body)
    return aid


def join_via_api(user_id, aid):
    """Solves a challenge and joins as `user_id`: the user's token."""
    token = dev_token(user_id)
    status, c = call("GET", f"/api/v1/activities/{aid}/queue/challenge", token=token)
    assert status == 200, (status, c)
    number = next(n for n in range(c["maxnumber"] + 1)
                  if hashlib.sha256((c["salt"] + str(n)).encode()).hexdigest() == c["challenge"])
    pow_answer = {k: c[k] for k in ("algorithm", "challenge", "salt", "signature")}
    pow_answer["number"] = number
    status, ticket = call("POST", f"/api/v1/activities/{aid}/queue", {"pow": pow_answer}, token)
    assert status in (200, 201), (status, ticket)
    return token


def until(what, check):
    """Polls `check` (an API read) every 200 ms for WAIT seconds."""
    deadline = dt.datetime.now() + dt.timedelta(seconds=WAIT)
    while dt.datetime.now() < deadline:
        found = check()
        if found:
            return found
        threading.Event().wait(0.2)
    raise AssertionError(f"waited {WAIT}s for {what}")


# ---- the browser -------------------------------------------------------------

def browser():
    opts = webdriver.ChromeOptions()
    opts.binary_location = "/usr/bin/chromium"
    for flag in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync",
                 "--disable-dev-shm-usage", "--window-size=1280,1000",
                 "--user-data-dir=" + tempfile.mkdtemp(prefix="seckill-chromium-")):
        opts.add_argument(flag)
    return webdriver.Chrome(service=Service("/usr/bin/chromedriver"), options=opts)


def wait_for(driver, what, check):
    try:
        return WebDriverWait(driver, WAIT, poll_frequency=0.2).until(lambda d: check(d))
    except TimeoutException:
        message = driver.find_element(By.ID, "message").text
        path = SHOTS / "failure.png"
        driver.save_screenshot(str(path))
        raise AssertionError(f"waited {WAIT}s for {what}; the page says {message!r} ({path})")


def click_when_enabled(driver, what, css):
    """Clicks `css` once it is enabled. The operator's table is redrawn every
    second, so a found button may be gone by the click: found again."""
    def attempt(d):
        try:
            button = d.find_element(By.CSS_SELECTOR, css)
            if not button.is_enabled():
                return None
            button.click()
            return True
        except (NoSuchElementException, StaleElementReferenceException):
            return None
    wait_for(driver, what, attempt)


def focus_input(driver, what, css):
    """Clicks into the input at `css` and returns it once it has the focus.
    A table row is redrawn every second until one of its inputs has the
    focus, so a found input may be gone by the click: found again. Type
    into it with send_keys only: clear() blurs it."""
    def attempt(d):
        try:
            field = d.find_element(By.CSS_SELECTOR, css)
            field.click()
            return field if d.switch_to.active_element == field else None
        except (NoSuchElementException, StaleElementReferenceException):
            return None
    return wait_for(driver, what, attempt)


def shot(driver, name):
    """A screenshot of the whole page (the window stretched to its height)."""
    height = driver.execute_script("return document.documentElement.scrollHeight")
    driver.set_window_size(1280, max(1000, height + 200))
    driver.execute_script("window.scrollTo(0, 0)")
    driver.save_screenshot(str(SHOTS / name))
    driver.set_window_size(1280, 1000)


def text(driver, css):
    try:
        found = driver.find_elements(By.CSS_SELECTOR, css)
        return found[0].text if found else ""
    except StaleElementReferenceException:
        return ""


def message_code(driver):
    box = driver.find_element(By.ID, "message")
    return box.get_attribute("data-code") if box.is_displayed() else ""


def click_buy(driver, aid):
    """Clicks Buy on the card of `aid` once it is enabled; returns the
    message code the purchase ends with."""
    driver.execute_script("document.getElementById('message').hidden = true;"
                          "document.getElementById('message').dataset.code = '';")
    click_when_enabled(driver, f"the Buy button of activity {aid}",
                       f'.activity[data-id="{aid}"] .buy')
    return wait_for(driver, f"an answer to the purchase on {aid}", lambda d: message_code(d) or None)


def buyer_page(driver, main, sold_out, hot):
    driver.get(BASE + "/console/")
    wait_for(driver, "the activity cards", lambda d: d.find_elements(
        By.CSS_SELECTOR, f'.activity[data-id="{main}"]'))
    # Signed out, Buy is off.
    assert not driver.find_element(By.CSS_SELECTOR, f'.activity[data-id="{main}"] .buy').is_enabled()
    user = driver.find_element(By.ID, "user-id")
    user.clear()
    user.send_keys("501")
    driver.find_element(By.ID, "sign-in").click()
    wait_for(driver, "signed in", lambda d: "user 501" in d.find_element(By.ID, "whoami").text)
    # The countdown runs on the server's clock.
    wait_for(driver, "the sale's countdown", lambda d: "ends in" in text(
        d, f'.activity[data-id="{main}"] .phase'))
    shot(driver, "buyer-activities.png")

    # Buy: PROCESSING, then WAITING_PAY.
    code = click_buy(driver, main)
    assert code == "ACCEPTED", code
    order_no = driver.find_element(By.ID, "order-no").text
    assert order_no.isdigit(), order_no
    wait_for(driver, "WAITING_PAY", lambda d: text(d, "#order-status") == "WAITING_PAY")
    # Pushed by the server (the order's event stream), not polled.
    assert driver.find_element(By.ID, "order-status").get_attribute("data-pushed") == "yes"
    assert "current" in driver.find_element(
        By.CSS_SELECTOR, '#order-steps [data-step="WAITING_PAY"]').get_attribute("class")
    shot(driver, "buyer-waiting-pay.png")

    # Pay through the mock provider: PAID.
    driver.find_element(By.ID, "pay").click()
    wait_for(driver, "PAID", lambda d: text(d, "#order-status") == "PAID")
    wait_for(driver, "the paid message", lambda d: message_code(d) == "PAID")
    # The payment as the server has it, on the page.
    wait_for(driver, "the payment shown", lambda d: text(d, "#payment-status") == "SUCCESS")
    assert "(mock)" in text(driver, "#payment-no"), text(driver, "#payment-no")
    wait_for(driver, "the order in the list", lambda d: text(
        d, f'#orders tr[data-order="{order_no}"] .status') == "PAID")
    shot(driver, "buyer-paid.png")
    # The server agrees.
    status, body = call("GET", f"/api/v1/orders/{order_no}", token=dev_token(501))
    assert status == 200 and body["status"] == "PAID", (status, body)

    # The limit: one per person.
    code = click_buy(driver, main)
    assert code == "LIMIT_EXCEEDED", code
    assert "as many as this sale allows" in driver.find_element(By.ID, "message").text

    # Sold out: the last unit went to someone else.
    status, body = buy_via_api(777, sold_out, "the-last-unit")
    assert status == 202, (status, body)
    code = click_buy(driver, sold_out)
    assert code == "SOLD_OUT", code
    assert "Sold out" in driver.find_element(By.ID, "message").text
    shot(driver, "buyer-sold-out.png")

    # Rate limited: while a crowd floods the hot activity past its rate
    # (admission.activity_rate_per_sec), the buyer's click is turned away.
    stop = threading.Event()
    crowd_token = dev_token(900)

    def crowd():
        while not stop.is_set():
            call("POST", f"/api/v1/activities/{hot}/orders",
                 {"request_id": "crowd", "token": "not-a-token"}, crowd_token)

    threads = [threading.Thread(target=crowd, daemon=True) for _ in range(4)]
    for t in threads:
        t.start()
    try:
        codes = []
        for _ in range(20):
            codes.append(click_buy(driver, hot))
            if codes[-1] == "RATE_LIMITED":
                break
        assert codes[-1] == "RATE_LIMITED", codes
        assert "Too many requests" in driver.find_element(By.ID, "message").text
        shot(driver, "buyer-rate-limited.png")
    finally:
        stop.set()
        for t in threads:
            t.join()
    return order_no


def card_ticket(driver, aid):
    try:
        return driver.find_element(
            By.CSS_SELECTOR, f'.activity[data-id="{aid}"]').get_attribute("data-ticket")
    except (NoSuchElementException, StaleElementReferenceException):
        return None


def waiting_room_page(driver):
    """The buyer page of a sale with a waiting room: joining the pre-queue
    with the proof of work solved in the page, the live position, the turn
    and the purchase with the pass; then the waitlist, and a unit that comes
    back offered to the buyer."""
    queued = room_activity("Console (waiting room)", 2, 20, 1)
    driver.get(BASE + "/console/")
    card = f'.activity[data-id="{queued}"]'
    wait_for(driver, "the room's card", lambda d: d.find_elements(By.CSS_SELECTOR, card + " .join"))
    click_when_enabled(driver, "Join the queue", card + " .join")
    wait_for(driver, "a pre-queue ticket", lambda d: card_ticket(d, queued) == "PREQUEUE")
    wait_for(driver, "'pre-queue' on the ticket", lambda d: "pre-queue" in text(d, card + " .ticket"))
    assert not driver.find_element(By.CSS_SELECTOR, card + " .buy").is_enabled()
    shot(driver, "buyer-queue-prequeue.png")
    for other in (601, 602, 603):
        join_via_api(other, queued)
    # The start draws the order; one is admitted a second.
    seen = wait_for(driver, "the position, then the turn", lambda d: (
        card_ticket(d, queued) in ("QUEUED", "ADMITTED") and card_ticket(d, queued)))
    if seen == "QUEUED":
        # Read while it lasts: the turn may come between the two reads.
        wait_for(driver, "the position on the ticket", lambda d: "ahead of you" in text(
            d, card + " .ticket") or card_ticket(d, queued) == "ADMITTED")
        shot(driver, "buyer-queue-position.png")
    wait_for(driver, "the buyer's turn", lambda d: card_ticket(d, queued) == "ADMITTED")
    wait_for(driver, "'Your turn' on the ticket", lambda d: "Your turn" in text(d, card + " .ticket"))
    shot(driver, "buyer-queue-turn.png")
    code = click_buy(driver, queued)
    assert code == "ACCEPTED", code
    wait_for(driver, "WAITING_PAY", lambda d: text(d, "#order-status") == "WAITING_PAY")

    # One unit; buyer 611 joins first and buys it; ours is waitlisted.
    last = room_activity("Last console (waiting room)", 1, -30, 5)
    first = join_via_api(611, last)
    ticket = until("buyer 611 admitted", lambda: (lambda r: r[1] if r[1] and r[1].get("state") == "ADMITTED"
                                                  else None)(call("GET", f"/api/v1/activities/{last}/queue/me", token=first)))
    req = urllib.request.Request(BASE + f"/api/v1/activities/{last}/token",
                                 headers={"authorization": "Bearer " + first, "x-queue-pass": ticket["pass"]})
    with urllib.request.urlopen(req, timeout=30) as res:
        purchase_token = json.loads(res.read())["token"]
    status, order = call("POST", f"/api/v1/activities/{last}/orders",
                         {"request_id": "first-in-line", "token": purchase_token}, first)
    assert status == 202, (status, order)
    until("buyer 611's order WAITING_PAY", lambda: call(
        "GET", f"/api/v1/orders/{order['order_no']}", token=first)[1].get("status") == "WAITING_PAY")
    card = f'.activity[data-id="{last}"]'
    wait_for(driver, "the second room's card", lambda d: d.find_elements(By.CSS_SELECTOR, card + " .join"))
    click_when_enabled(driver, "Join the second queue", card + " .join")
    wait_for(driver, "the waitlist", lambda d: card_ticket(d, last) == "SOLD_OUT")
    wait_for(driver, "'waitlist' on the ticket", lambda d: "waitlist" in text(d, card + " .ticket"))
    shot(driver, "buyer-queue-waitlist.png")
    # Buyer 611 cancels: the unit goes to the next ticket, ours.
    status, body = call("POST", f"/api/v1/orders/{order['order_no']}/cancel", {}, first)
    assert status == 200, (status, body)
    wait_for(driver, "the offer", lambda d: card_ticket(d, last) == "OFFERED")
    wait_for(driver, "'came back for you' on the ticket", lambda d: "came back for you" in text(d, card + " .ticket"))
    shot(driver, "buyer-queue-offer.png")
    code = click_buy(driver, last)
    assert code == "ACCEPTED", code
    return queued


# The page's solver before it hashed in JavaScript: one Web Crypto digest
# (a promise) per try, 256 at a time. Timed beside the page's own on the
# same challenges, as the baseline the page's solver was measured against.
WEB_CRYPTO_SOLVER = """
const c = arguments[0], done = arguments[arguments.length - 1];
const hex = (buf) => Array.from(new Uint8Array(buf), (b) => b.toString(16).padStart(2, "0")).join("");
const enc = new TextEncoder(), t0 = performance.now();
(async () => {
  for (let from = 0; from <= c.maxnumber; from += 256) {
    const tries = [];
    for (let n = from; n < from + 256 && n <= c.maxnumber; n++)
      tries.push(crypto.subtle.digest("SHA-256", enc.encode(c.salt + n)).then((h) => [n, hex(h)]));
    for (const [n, h] of await Promise.all(tries)) if (h === c.challenge) return n;
  }
  return null;
})().then((n) => done([n, performance.now() - t0]));
"""


def pow_solve_times(driver, n=5, difficulty=None, baseline=False):
    """The page's own solver (Web Crypto) on challenges of the default
    difficulty (docs/WAITING_ROOM.md quotes these), or of `difficulty`; each
    answer joins the queue. Seconds per solve, the numbers found, and with
    `baseline` the Web Crypto solver's seconds on the same challenges."""
    now = dt.datetime.now(dt.timezone.utc)
    room = {"prequeue_secs": 0, "admit_per_sec": 1}
    if difficulty is not None:
        room["pow_difficulty"] = difficulty
    status, body = call("POST", "/api/v1/admin/activities", {
        "sku_id": 1, "name": f"Difficulty {difficulty or 'default'}", "price_cents": 1,
        "stock": 1, "start_at": now.isoformat(), "end_at": (now + dt.timedelta(hours=1)).isoformat(),
        "waiting_room": room,
    }, ADMIN)
    assert status == 201 and body["waiting_room"]["pow_difficulty"] == (difficulty or 50000), (status, body)
    aid = body["activity_id"]
    times, numbers, base = [], [], []
    for user in range(701, 701 + n):
        token = dev_token(user)
        status, c = call("GET", f"/api/v1/activities/{aid}/queue/challenge", token=token)
        assert status == 200, (status, c)
        number, ms = driver.execute_async_script(
            "const done = arguments[arguments.length - 1]; const t0 = performance.now();"
            "solvePow(arguments[0], () => {}).then((n) => done([n, performance.now() - t0]));", c)
        assert hashlib.sha256((c["salt"] + str(number)).encode()).hexdigest() == c["challenge"]
        if baseline:
            same, base_ms = driver.execute_async_script(WEB_CRYPTO_SOLVER, c)
            assert same == number, (same, number)
            base.append(base_ms / 1000)
        pow_answer = {k: c[k] for k in ("algorithm", "challenge", "salt", "signature")}
        pow_answer["number"] = number
        status, ticket = call("POST", f"/api/v1/activities/{aid}/queue", {"pow": pow_answer}, token)
        assert status == 201, (status, ticket, f"number {number} of {c['maxnumber']}")
        times.append(ms / 1000)
        numbers.append(number)
    return times, numbers, base


def operator_page(driver, main, room):
    driver.get(BASE + "/console/operator.html")
    driver.find_element(By.ID, "sign-in").click()
    wait_for(driver, "signed in as admin", lambda d: "(admin)" in d.find_element(By.ID, "whoami").text)
    # The paid unit shows as sold, Redis and the database side by side.
    row = f'#activity-table tr[data-id="{main}"]'
    # Read in one wait: the table is redrawn every second, and a cell read
    # just after a redraw reads as "" (text() of a stale element).
    wait_for(driver, "the main activity's figures: 1 sold, 2 available in Redis and the database",
             lambda d: (text(d, row + " .db-sold"), text(d, row + " .redis-available"),
                        text(d, row + " .db-available")) == ("1", "2", "2"))
    # Live figures from /metrics: the accepted purchases were counted.
    wait_for(driver, "the live rates", lambda d: text(d, "#rate-accepted") not in ("", "–"))
    wait_for(driver, "the outbox figures", lambda d: text(d, "#outbox").count("/") == 2)
    # The waiting room: its queue's figures, and its rate changed live.
    room_row = f'#room-table tr[data-id="{room}"]'
    wait_for(driver, "the room's figures", lambda d: text(d, room_row + " .tickets") == "4")
    # Typed over, not cleared: WebDriver's clear takes the focus away, and
    # the table is redrawn under the next keys.
    rate = focus_input(driver, "the room's rate field", room_row + " .rate")
    rate.send_keys(Keys.CONTROL, "a")
    rate.send_keys("7")
    assert rate.get_attribute("value") == "7", rate.get_attribute("value")
    driver.find_element(By.CSS_SELECTOR, room_row + " .set-rate").click()
    wait_for(driver, "the new rate", lambda d: "7 admitted a second" in d.find_element(By.ID, "message").text)
    status, body = call("GET", f"/api/v1/admin/activities/{room}/stats", token=ADMIN)
    assert status == 200 and body["waiting_room"]["admit_per_sec"] == 7, (status, body)
    # The rate admitting now follows (the order consumers keep up here).
    wait_for(driver, "admitting at the new rate", lambda d: text(d, room_row + " .rate-now") == "7")
    # Adaptive admission's window, as the stats route has it: 3/4 of the
    # default lag bound (100,000), less what is in flight.
    def window_shown(d):
        shown = text(d, room_row + " .window-now").replace(",", "")
        _, body = call("GET", f"/api/v1/admin/activities/{room}/stats", token=ADMIN)
        known = body["waiting_room"].get("admit_window_now")
        return shown.isdigit() and known is not None and 0 < int(shown) <= 75000
    wait_for(driver, "adaptive admission's window", window_shown)

    # Create, warm up and end an activity from the forms.
    name = driver.find_element(By.CSS_SELECTOR, '#create-form [name="name"]')
    name.clear()
    name.send_keys("Made in the browser")
    # Far enough ahead that it is still READY (not yet on sale) when checked.
    starts_in = driver.find_element(By.CSS_SELECTOR, '#create-form [name="starts_in"]')
    starts_in.clear()
    starts_in.send_keys("600")
    driver.find_element(By.ID, "create").click()
    wait_for(driver, "the created message", lambda d: message_code(d) == "CREATED")
    new_id = driver.find_element(By.ID, "message").text.split()[2].rstrip(":")
    new_row = f'#activity-table tr[data-id="{new_id}"]'
    wait_for(driver, "the new activity's row", lambda d: text(d, new_row + " .status") == "PENDING")
    click_when_enabled(driver, "its Warm up button", new_row + " .warmup")
    wait_for(driver, "warmed up, 100 units in Redis",
             lambda d: (text(d, new_row + " .status"), text(d, new_row + " .redis-available"))
             == ("READY", "100"))
    status, body = call("GET", f"/api/v1/admin/activities/{new_id}/stats", token=ADMIN)
    assert status == 200 and body["redis_available"] == 100, (status, body)

    # Reconcile now: the report appears.
    driver.find_element(By.ID, "reconcile").click()
    wait_for(driver, "the reconciliation message", lambda d: message_code(d) == "RECONCILED")
    wait_for(driver, "the report", lambda d: d.find_elements(
        By.CSS_SELECTOR, f'#reconcile-report tr[data-id="{main}"]'))
    assert "all consistent" in driver.find_element(By.ID, "message").text, \
        driver.find_element(By.ID, "message").text
    shot(driver, "operator.png")

    click_when_enabled(driver, "its End button", new_row + " .end")
    wait_for(driver, "ended", lambda d: text(d, new_row + " .status") == "ENDED")
    status, body = call("GET", f"/api/v1/activities/{new_id}")
    assert status == 200 and body["status"] == "ENDED", (status, body)


def main():
    main_sale = activity("Phone (browser test)", 3)
    sold_out = activity("Last one", 1)
    hot = activity("Hot item", 100)
    driver = browser()
    try:
        order_no = buyer_page(driver, main_sale, sold_out, hot)
        room = waiting_room_page(driver)
        driver.set_script_timeout(WAIT)
        solves, _, base = pow_solve_times(driver, baseline=True)
        print("browser: proof of work at the default difficulty (maxnumber 50,000) solved by the "
              f"page in {', '.join(f'{t:.2f}' for t in solves)} s "
              f"(mean {sum(solves) / len(solves):.2f} s); by Web Crypto, one digest a try, "
              f"{', '.join(f'{t:.2f}' for t in base)} s (mean {sum(base) / len(base):.2f} s)")
        # A room at 2,000,000: answers above 1,000,000 join too.
        solves, numbers, _ = pow_solve_times(driver, n=3, difficulty=2_000_000)
        print("browser: proof of work at difficulty 2,000,000 solved by the page in "
              f"{', '.join(f'{t:.2f}' for t in solves)} s, numbers "
              f"{', '.join(f'{x:,}' for x in numbers)}; each joined")
        operator_page(driver, main_sale, room)
        logs = driver.get_log("browser") if hasattr(driver, "get_log") else []
        errors = [e for e in logs if e.get("level") == "SEVERE"
                  and "Failed to load resource" not in e.get("message", "")]
        assert not errors, errors
    finally:
        driver.quit()
    print(f"browser: the console sold order {order_no}, paid it, and showed "
          f"LIMIT_EXCEEDED, SOLD_OUT and RATE_LIMITED; through a waiting room it joined "
          f"with the proof of work, was admitted and bought, then was waitlisted and bought "
          f"the unit offered back; the operator page created, "
          f"warmed, ended and reconciled; screenshots in {SHOTS}")


if __name__ == "__main__":
    main()
