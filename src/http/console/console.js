// The seckill web console: a buyer page and an operator page over the
// public HTTP API, with no framework and no build step. Both pages load
// this file; <body data-page> says which one runs.
"use strict";

// ---- the API -------------------------------------------------------------

/** One call: `{status, ok, data}`; errors are RFC 9457 problems with a `code`. */
async function api(method, path, body, token, extra) {
  const headers = Object.assign({}, extra);
  if (body !== undefined) headers["content-type"] = "application/json";
  if (token) headers.authorization = "Bearer " + token;
  let res;
  try {
    res = await fetch(path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
    });
  } catch (e) {
    return { status: 0, ok: false, data: { code: "NETWORK", detail: "the server did not answer" } };
  }
  let data = null;
  try {
    data = await res.json();
  } catch (e) {
    data = null;
  }
  return { status: res.status, ok: res.ok, data };
}

/** What a buyer reads for each code the purchase path can answer. */
const FRIENDLY = {
  SOLD_OUT: "Sold out: every unit has been taken.",
  LIMIT_EXCEEDED: "You already hold as many as this sale allows per person.",
  RATE_LIMITED: "Too many requests right now: wait a moment and try again.",
  NOT_ACTIVE: "This sale is not open.",
  BUSY: "Orders are backed up: try again in a few seconds.",
  RETRY_LATER: "The shop is briefly unavailable: try again in a few seconds.",
  INVALID_TOKEN: "Your purchase token expired: try again.",
  QUEUE_PASS_REQUIRED: "This sale has a waiting room: join the queue and buy when your turn comes.",
  QUEUE_PASS_INVALID: "Your turn in the queue is no longer valid.",
  POW_INVALID: "The puzzle's answer was not accepted: join again.",
  NOT_IN_QUEUE: "You are not in this queue.",
  OPENID_REQUIRED: "This shop pays with WeChat Pay inside WeChat: enter the buyer's openid below, then Pay.",
  UNAUTHORIZED: "Sign in first.",
  FORBIDDEN: "This needs an operator's (admin) token.",
  NETWORK: "The server did not answer.",
};

// ---- small helpers -----------------------------------------------------------

const $ = (sel) => document.querySelector(sel);

function el(tag, attrs, ...children) {
  const node = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs || {})) {
    if (k === "class") node.className = v;
    else if (k.startsWith("data-")) node.setAttribute(k, v);
    else node[k] = v;
  }
  for (const child of children) {
    node.append(child instanceof Node ? child : String(child));
  }
  return node;
}

function money(cents) {
  return cents == null ? "–" : (cents / 100).toFixed(2);
}

function showMessage(text, code, kind) {
  const box = $("#message");
  box.textContent = text;
  box.dataset.code = code || "";
  box.className = kind || "error";
  box.hidden = false;
}

function showProblem(res, fallback) {
  const d = res.data || {};
  const code = d.code || "HTTP_" + res.status;
  const text = FRIENDLY[code] || d.detail || d.message || fallback || "Something went wrong.";
  showMessage(text + (d.detail && FRIENDLY[code] ? " (" + d.detail + ")" : ""), code, "error");
}

function clearMessage() {
  const box = $("#message");
  box.hidden = true;
  box.textContent = "";
  box.dataset.code = "";
}

function requestId() {
  if (window.crypto && crypto.randomUUID) return crypto.randomUUID();
  return "r" + Date.now().toString(36) + Math.random().toString(36).slice(2);
}

const sleep = (ms) => new Promise((r) => setTimeout(r, ms));

// ---- the server's clock ----------------------------------------------------

/** Milliseconds to add to this browser's clock to read the server's. */
let clockOffset = 0;

function serverNow() {
  return Date.now() + clockOffset;
}

/** Takes the offset from a response's `server_time`, halving the round trip. */
function syncClock(serverTime, sentAt, receivedAt) {
  const server = Date.parse(serverTime);
  if (Number.isNaN(server)) return;
  clockOffset = server - (sentAt + receivedAt) / 2;
  const label = $("#clock-offset");
  if (label) {
    const s = (clockOffset / 1000).toFixed(1);
    label.textContent = "this browser is " + (clockOffset >= 0 ? s + " s behind" : -s + " s ahead");
  }
}

function countdown(ms) {
  const t = Math.max(0, Math.floor(ms / 1000));
  const h = Math.floor(t / 3600);
  const m = Math.floor((t % 3600) / 60);
  const s = t % 60;
  const two = (n) => String(n).padStart(2, "0");
  return (h > 0 ? h + ":" : "") + two(m) + ":" + two(s);
}

/** The sale's phase at the server's time now. */
function phase(a) {
  const now = serverNow();
  const start = Date.parse(a.start_at);
  const end = Date.parse(a.end_at);
  if (now >= end || a.status === "ENDED") return { open: false, text: "ended" };
  if (a.status === "PENDING") return { open: false, text: "not warmed up yet" };
  if (now < start) return { open: false, text: "starts in " + countdown(start - now) };
  return { open: true, text: "ends in " + countdown(end - now) };
}

// ---- the session -------------------------------------------------------------

const session = {
  key: "seckill.console." + document.body.dataset.page,
  get token() {
    return sessionStorage.getItem(this.key) || "";
  },
  set token(t) {
    if (t) sessionStorage.setItem(this.key, t);
    else sessionStorage.removeItem(this.key);
  },
};

async function whoAmI() {
  const who = $("#whoami");
  const signedIn = (yes) => {
    $("#sign-in-form").hidden = yes;
    $("#token-form").hidden = yes;
    $("#sign-out").hidden = !yes;
  };
  if (!session.token) {
    who.textContent = "Not signed in";
    who.dataset.userId = "";
    signedIn(false);
    return null;
  }
  const res = await api("GET", "/api/v1/me", undefined, session.token);
  if (!res.ok) {
    session.token = "";
    who.textContent = "Not signed in";
    signedIn(false);
    return null;
  }
  who.textContent = "Signed in as user " + res.data.user_id + " (" + res.data.role + ")";
  who.dataset.userId = res.data.user_id;
  who.dataset.role = res.data.role;
  signedIn(true);
  return res.data;
}

function wireSession(admin, onChange) {
  const userId = $("#user-id");
  if (!userId.value) userId.value = String(1000 + Math.floor(Math.random() * 9000));
  $("#sign-in-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    clearMessage();
    const res = await api("POST", "/api/v1/dev/token", { user_id: Number(userId.value), admin });
    if (!res.ok) {
      if (res.status === 404) {
        showMessage("Development sign-in is off on this server (app.env is not development): paste a token.", "NOT_FOUND");
      } else {
        showProblem(res);
      }
      return;
    }
    session.token = res.data.token;
    await whoAmI();
    onChange();
  });
  $("#token-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    clearMessage();
    session.token = $("#token").value.trim();
    $("#token").value = "";
    if (!(await whoAmI())) showMessage("That token was not accepted.", "UNAUTHORIZED");
    onChange();
  });
  $("#sign-out").addEventListener("click", async () => {
    session.token = "";
    await whoAmI();
    onChange();
  });
}

/** Reads a Server-Sent Events stream through fetch (so the token goes in a
 *  header), calling `onEvent(name, data)` for each event until it returns
 *  true; true when the stream was read to its end or to there, false when
 *  it could not be read. */
async function readEvents(path, onEvent) {
  let res;
  try {
    res = await fetch(path, { headers: { authorization: "Bearer " + session.token } });
  } catch (e) {
    return false;
  }
  if (!res.ok || !res.body) return false;
  const reader = res.body.getReader();
  const decoder = new TextDecoder();
  let buffer = "";
  try {
    for (;;) {
      const { value, done } = await reader.read();
      if (done) return true;
      buffer += decoder.decode(value, { stream: true });
      let end;
      while ((end = buffer.indexOf("\n\n")) >= 0) {
        const block = buffer.slice(0, end);
        buffer = buffer.slice(end + 2);
        const name = /^event: (.*)$/m.exec(block);
        const data = /^data: (.*)$/m.exec(block);
        if (name && (await onEvent(name[1], data && data[1]))) {
          reader.cancel();
          return true;
        }
      }
    }
  } catch (e) {
    return false;
  }
}

// ---- the waiting room --------------------------------------------------------


/** SHA-256's round constants. */
const SHA256_K = new Int32Array([
  0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
  0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
  0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
  0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
  0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
  0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
  0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
  0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2,
]);

/** SHA-256's compression of the 64-byte block at `bytes[at..]` into `h`. */
function sha256Block(h, bytes, at, w) {
  for (let i = 0; i < 16; i++) {
    const j = at + i * 4;
    w[i] = (bytes[j] << 24) | (bytes[j + 1] << 16) | (bytes[j + 2] << 8) | bytes[j + 3];
  }
  for (let i = 16; i < 64; i++) {
    const a = w[i - 15], b = w[i - 2];
    const s0 = ((a >>> 7) | (a << 25)) ^ ((a >>> 18) | (a << 14)) ^ (a >>> 3);
    const s1 = ((b >>> 17) | (b << 15)) ^ ((b >>> 19) | (b << 13)) ^ (b >>> 10);
    w[i] = (w[i - 16] + s0 + w[i - 7] + s1) | 0;
  }
  let a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
  for (let i = 0; i < 64; i++) {
    const S1 = ((e >>> 6) | (e << 26)) ^ ((e >>> 11) | (e << 21)) ^ ((e >>> 25) | (e << 7));
    const t1 = (k + S1 + ((e & f) ^ (~e & g)) + SHA256_K[i] + w[i]) | 0;
    const S0 = ((a >>> 2) | (a << 30)) ^ ((a >>> 13) | (a << 19)) ^ ((a >>> 22) | (a << 10));
    const t2 = (S0 + ((a & b) ^ (a & c) ^ (b & c))) | 0;
    k = g; g = f; f = e; e = (d + t1) | 0; d = c; c = b; b = a; a = (t1 + t2) | 0;
  }
  h[0] = (h[0] + a) | 0; h[1] = (h[1] + b) | 0; h[2] = (h[2] + c) | 0; h[3] = (h[3] + d) | 0;
  h[4] = (h[4] + e) | 0; h[5] = (h[5] + f) | 0; h[6] = (h[6] + g) | 0; h[7] = (h[7] + k) | 0;
}

/** Solves an ALTCHA challenge: the number in 0..=maxnumber whose SHA-256
 *  after the salt is the challenge. SHA-256 in the page, not Web Crypto
 *  (one promise per digest made it about 70,000 tries a second): the
 *  salt's whole 64-byte blocks are hashed once, and each try hashes only
 *  the rest. It yields to the page every 20,000 tries; `progress` gets the
 *  share of the range tried. */
async function solvePow(c, progress) {
  const salt = new TextEncoder().encode(c.salt);
  const target = new Int32Array(8);
  for (let i = 0; i < 8; i++) target[i] = parseInt(c.challenge.substr(i * 8, 8), 16) | 0;
  const w = new Int32Array(64);
  const mid = new Int32Array([
    0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19,
  ]);
  const whole = salt.length - (salt.length % 64);
  for (let at = 0; at < whole; at += 64) sha256Block(mid, salt, at, w);
  const rest = salt.length - whole;
  const block = new Uint8Array(128);
  block.set(salt.subarray(whole));
  const h = new Int32Array(8);
  for (let n = 0; n <= c.maxnumber; n++) {
    const digits = String(n);
    let len = rest;
    for (let i = 0; i < digits.length; i++) block[len++] = digits.charCodeAt(i);
    const total = salt.length + digits.length;
    const blocks = len + 9 <= 64 ? 1 : 2;
    block[len] = 0x80;
    block.fill(0, len + 1, blocks * 64);
    const bits = total * 8;
    const end = blocks * 64;
    block[end - 4] = bits >>> 24; block[end - 3] = bits >>> 16; block[end - 2] = bits >>> 8; block[end - 1] = bits;
    block[end - 5] = Math.floor(bits / 0x100000000);
    h.set(mid);
    sha256Block(h, block, 0, w);
    if (blocks === 2) sha256Block(h, block, 64, w);
    if (h[0] === target[0] && h[1] === target[1] && h[2] === target[2] && h[3] === target[3] &&
        h[4] === target[4] && h[5] === target[5] && h[6] === target[6] && h[7] === target[7]) return n;
    if (n % 20000 === 19999) {
      progress(Math.min(1, (n + 1) / (c.maxnumber + 1)));
      await new Promise((r) => setTimeout(r, 0));
    }
  }
  return null;
}

/** What a ticket says to its holder at `now` (the server's clock). */
function ticketText(t, now) {
  if (!t) return "Join the queue to buy.";
  if (t.gone) return "The queue restarted after a failure: join again.";
  const left = t.pass_expires_at ? countdown(Date.parse(t.pass_expires_at) - now) : "";
  switch (t.state) {
    case "PREQUEUE":
      return "Ticket " + t.ticket + " in the pre-queue: your place is drawn when the sale starts.";
    case "QUEUED":
      return "Position " + t.position + ": " + t.ahead + " ahead of you, about " + countdown(t.estimated_wait_secs * 1000) + ".";
    case "ADMITTED":
      return t.pass_used ? "Your turn came: your pass is used." : "Your turn! Buy within " + left + ".";
    case "OFFERED":
      return t.pass_used ? "A unit came back for you: your pass is used." : "A unit came back for you: buy within " + left + ".";
    case "SOLD_OUT":
      return "Sold out. You are on the waitlist: " + (t.ahead == null ? "?" : t.ahead) + " ahead of you.";
    case "EXPIRED":
      return "Your turn passed unused.";
    case "LEFT":
      return "You left the queue.";
    default:
      return t.state;
  }
}

// ---- the buyer page ----------------------------------------------------------

const buyer = {
  activities: [],
  order: null, // {order_no, activity_id, status}
  tickets: {}, // activity id -> the caller's ticket in its waiting room
  watching: {},
  solving: false,

  async start() {
    wireSession(false, () => this.refreshOrders());
    await whoAmI();
    $("#pay").addEventListener("click", () => this.pay());
    $("#cancel").addEventListener("click", () => this.cancel());
    await this.loadActivities();
    this.refreshOrders();
    setInterval(() => this.loadActivities(), 5000);
    setInterval(() => this.renderActivities(), 250);
  },

  async loadActivities() {
    const sentAt = Date.now();
    const res = await api("GET", "/api/v1/activities");
    if (!res.ok) return showProblem(res, "Could not load the sales.");
    syncClock(res.data.server_time, sentAt, Date.now());
    this.activities = res.data.activities;
    this.renderActivities(true);
  },

  renderActivities(rebuild) {
    const box = $("#activities");
    if (rebuild) {
      box.replaceChildren();
      if (this.activities.length === 0) box.append(el("p", { class: "hint" }, "No sale right now."));
      for (const a of this.activities) {
        const buy = el("button", { type: "button", class: "buy" }, "Buy");
        buy.addEventListener("click", () => this.buy(a.activity_id));
        const parts = [
          el("h3", {}, a.name),
          el("p", { class: "price" }, money(a.price_cents)),
          el("p", { class: "left" }, a.remaining > 0 ? a.remaining + " of " + a.stock + " left" : "sold out for now"),
          el("p", { class: "phase" }, ""),
        ];
        if (a.waiting_room) {
          const join = el("button", { type: "button", class: "join" }, "Join the queue");
          join.addEventListener("click", () => this.joinQueue(a.activity_id));
          const bar = el("progress", { class: "pow", max: "1", value: "0" });
          bar.hidden = true;
          parts.push(el("div", { class: "queue" }, join, bar, el("p", { class: "ticket" }, "")));
          if (session.token && !this.tickets[a.activity_id]) this.watchTicket(a.activity_id);
        }
        parts.push(buy);
        box.append(el("article", { class: "activity", "data-id": a.activity_id }, ...parts));
      }
    }
    for (const a of this.activities) {
      const card = box.querySelector('[data-id="' + a.activity_id + '"]');
      if (!card) continue;
      const p = phase(a);
      card.querySelector(".phase").textContent = p.text;
      card.dataset.open = p.open;
      // Still a button at 0 left: units come back (cancels, unpaid orders),
      // and only the server knows; it answers SOLD_OUT otherwise.
      card.querySelector(".buy").disabled = !p.open || !session.token;
      if (a.waiting_room) this.renderQueue(a, card);
    }
  },

  /** A waiting room's part of the card: join while the pre-queue or the
   *  sale is open, the ticket's words, Buy only with an unused pass. */
  renderQueue(a, card) {
    const now = serverNow();
    const t = this.tickets[a.activity_id];
    const open = now >= Date.parse(a.waiting_room.prequeue_opens_at) && now < Date.parse(a.end_at);
    const canJoin = session.token && open && !this.solving && (!t || t.gone || t.state === "LEFT");
    card.querySelector(".join").disabled = !canJoin;
    card.querySelector(".ticket").textContent = session.token ? ticketText(t, now) : "Sign in to join the queue.";
    const holds = t && !t.gone && (t.state === "ADMITTED" || t.state === "OFFERED") && !t.pass_used &&
      Date.parse(t.pass_expires_at) > now;
    card.querySelector(".buy").disabled = !holds;
    card.dataset.ticket = t ? (t.gone ? "GONE" : t.state) : "";
    if (!holds && now < Date.parse(a.start_at) && open) {
      card.querySelector(".phase").textContent = "pre-queue open; the sale starts in " + countdown(Date.parse(a.start_at) - now);
    }
  },

  async joinQueue(aid) {
    clearMessage();
    const base = "/api/v1/activities/" + aid + "/queue";
    // A challenge made before the rush may be too easy for the rush by the
    // time it is solved: the room then asks for a new one (400
    // POW_INVALID), solved again, a few times at most.
    let res;
    for (let attempt = 1; attempt <= 3; attempt++) {
      const c = await api("GET", base + "/challenge", undefined, session.token);
      if (!c.ok) return showProblem(c);
      const card = $('#activities [data-id="' + aid + '"]');
      const bar = card.querySelector(".pow");
      bar.hidden = false;
      bar.value = 0;
      this.solving = true;
      let number;
      try {
        number = await solvePow(c.data, (done) => (bar.value = done));
      } finally {
        this.solving = false;
        bar.hidden = true;
      }
      if (number == null) return showMessage("The puzzle has no answer: join again.", "POW_INVALID");
      const d = c.data;
      const pow = { algorithm: d.algorithm, challenge: d.challenge, salt: d.salt, number, signature: d.signature };
      res = await api("POST", base, { pow }, session.token);
      if (res.ok || res.status !== 400 || attempt === 3) break;
    }
    if (!res.ok) return showProblem(res);
    this.tickets[aid] = res.data;
    this.renderActivities();
    this.watchTicket(aid);
  },

  /** Follows the caller's ticket: pushed over the room's event stream,
   *  read again when the stream breaks off. */
  async watchTicket(aid) {
    if (this.watching[aid]) return;
    this.watching[aid] = true;
    try {
      while (session.token) {
        const res = await api("GET", "/api/v1/activities/" + aid + "/queue/me", undefined, session.token);
        if (res.status === 404) {
          const t = this.tickets[aid];
          if (t && !t.gone && res.data && /restarted/.test(res.data.message || "")) t.gone = true;
          else if (!t || t.gone) break;
          this.renderActivities();
          break;
        }
        if (res.ok) this.tickets[aid] = res.data;
        this.renderActivities();
        const t = this.tickets[aid];
        if (!t || t.state === "LEFT") break;
        if (!(await this.ticketStream(aid))) await sleep((t && t.refresh_after_ms) || 2000);
      }
    } finally {
      this.watching[aid] = false;
    }
  },

  /** Reads `…/queue/events` until it ends; false if it could not be read. */
  async ticketStream(aid) {
    return readEvents("/api/v1/activities/" + aid + "/queue/events", (name, data) => {
      if (name === "gone") return true;
      if (name !== "ticket" || !data) return false;
      this.tickets[aid] = Object.assign(JSON.parse(data), { pushed: true });
      this.renderActivities();
      return false;
    });
  },

  async buy(activityId) {
    clearMessage();
    if (!session.token) return showMessage(FRIENDLY.UNAUTHORIZED, "UNAUTHORIZED");
    const ticket = this.tickets[activityId];
    const pass = ticket && ticket.pass ? { "x-queue-pass": ticket.pass } : undefined;
    const tok = await api("GET", "/api/v1/activities/" + activityId + "/token", undefined, session.token, pass);
    if (ticket && pass) ticket.pass_used = tok.ok;
    if (!tok.ok) return showProblem(tok);
    const res = await api(
      "POST",
      "/api/v1/activities/" + activityId + "/orders",
      { request_id: requestId(), token: tok.data.token, quantity: 1 },
      session.token,
    );
    if (!res.ok) {
      showProblem(res);
      this.loadActivities();
      return;
    }
    this.order = { order_no: res.data.order_no, activity_id: activityId, status: res.data.status };
    showMessage("Order " + res.data.order_no + " accepted.", "ACCEPTED", "ok");
    this.renderOrder();
    this.loadActivities();
    await this.follow(["WAITING_PAY", "PAID", "CLOSED", "CANCELLED", "FAILED"]);
  },

  /** Follows the order until its status is one of `until`: pushed by the
   *  server (GET …/events, Server-Sent Events read through fetch so the
   *  token goes in a header), or, if the stream breaks off, polled. */
  async follow(until) {
    const no = this.order.order_no;
    if (await this.stream(no, until)) {
      this.refreshOrders();
      return;
    }
    for (let i = 0; i < 600 && this.order && this.order.order_no === no; i++) {
      const res = await api("GET", "/api/v1/orders/" + no, undefined, session.token);
      if (res.ok) {
        this.order = Object.assign({}, this.order, res.data);
        this.renderOrder();
        if (until.includes(res.data.status)) break;
      }
      await sleep(500);
    }
    this.refreshOrders();
  },

  /** Reads the order's event stream until a status in `until`; false if
   *  the stream could not be read to there. */
  async stream(no, until) {
    let reached = false;
    await readEvents("/api/v1/orders/" + no + "/events", async (name, data) => {
      if (name !== "status" || !data) return false;
      if (!this.order || this.order.order_no !== no) return (reached = true);
      const status = JSON.parse(data).status;
      this.order = Object.assign({}, this.order, { status, pushed: true });
      this.renderOrder();
      if (!until.includes(status)) return false;
      // The rest of the order (amount, deadline) from its row.
      const full = await api("GET", "/api/v1/orders/" + no, undefined, session.token);
      if (full.ok) {
        this.order = Object.assign({}, this.order, full.data, { pushed: true });
        this.renderOrder();
      }
      return (reached = true);
    });
    return reached;
  },

  renderOrder() {
    const o = this.order;
    $("#order").hidden = !o;
    if (!o) return;
    $("#order-no").textContent = o.order_no;
    const status = $("#order-status");
    status.textContent = o.status;
    status.dataset.status = o.status;
    status.dataset.pushed = o.pushed ? "yes" : "no";
    const detail = [];
    if (o.amount_cents != null) detail.push("amount " + money(o.amount_cents));
    if (o.pay_deadline) detail.push("pay by " + new Date(o.pay_deadline).toLocaleTimeString());
    if (o.failure_reason) detail.push(o.failure_reason);
    $("#order-detail").textContent = detail.join(" · ");
    const order = ["PROCESSING", "WAITING_PAY", "PAID"];
    const at = order.indexOf(o.status);
    for (const li of document.querySelectorAll("#order-steps li")) {
      const i = order.indexOf(li.dataset.step);
      li.className = at < 0 ? "" : i < at ? "done" : i === at ? "current" : "";
    }
    $("#pay").hidden = o.status !== "WAITING_PAY";
    $("#cancel").hidden = o.status !== "WAITING_PAY";
    if (o.status !== "WAITING_PAY") {
      $("#pay-qr").hidden = true;
      $("#pay-jsapi").hidden = true;
    }
    const p = o.payment;
    $("#payment").hidden = !p;
    if (p) {
      $("#payment-no").textContent = p.payment_no + " (" + p.provider + ")";
      $("#payment-status").textContent = p.status;
      $("#payment-status").dataset.status = p.status;
      $("#payment-refund").textContent = p.refund_no ? "refund " + p.refund_no : "";
    }
  },

  /** The order's payment as the server has it now. */
  async refreshPayment() {
    const res = await api("GET", "/api/v1/orders/" + this.order.order_no, undefined, session.token);
    if (res.ok && this.order && res.data.order_no === this.order.order_no) {
      this.order.payment = res.data.payment;
      this.renderOrder();
    }
  },

  /** WeChat Pay Native: the code_url as a QR code (fetched with the token). */
  async showQr(no) {
    const res = await fetch("/api/v1/orders/" + no + "/pay/qr", {
      headers: { authorization: "Bearer " + session.token },
    });
    if (!res.ok) return;
    const image = $("#pay-qr-image");
    if (image.src) URL.revokeObjectURL(image.src);
    image.src = URL.createObjectURL(await res.blob());
    $("#pay-qr").hidden = false;
  },

  async pay() {
    clearMessage();
    const no = this.order.order_no;
    $("#pay").disabled = true;
    try {
      const openid = $("#openid").value.trim();
      const payment = await api("POST", "/api/v1/orders/" + no + "/pay", openid ? { openid } : {}, session.token);
      if (!payment.ok) {
        // A WeChat Pay JSAPI shop: the buyer's openid comes from their
        // token, or from here where no mini-program runs.
        if (payment.data && payment.data.code === "OPENID_REQUIRED") $("#openid-row").hidden = false;
        return showProblem(payment);
      }
      await this.refreshPayment();
      if (payment.data.jsapi) {
        $("#pay-jsapi-params").textContent = JSON.stringify(payment.data.jsapi, null, 2);
        $("#pay-jsapi").hidden = false;
        showMessage("Pay " + money(payment.data.amount_cents) + " in the mini-program: wx.requestPayment with the parameters below.", "PENDING", "ok");
        await this.follow(["PAID", "CLOSED", "CANCELLED", "FAILED"]);
        await this.refreshPayment();
        if (this.order.status === "PAID") showMessage("Paid. Thank you!", "PAID", "ok");
        return;
      }
      if (payment.data.code_url) {
        await this.showQr(no);
        showMessage("Scan the code with WeChat to pay " + money(payment.data.amount_cents) + ".", "PENDING", "ok");
        await this.follow(["PAID", "CLOSED", "CANCELLED", "FAILED"]);
        await this.refreshPayment();
        if (this.order.status === "PAID") showMessage("Paid. Thank you!", "PAID", "ok");
        return;
      }
      if (payment.data.client_secret) {
        return showMessage(
          "Stripe payment " + payment.data.payment_no + " is ready: the shop's Stripe.js confirms it with its client secret.",
          "PENDING",
          "ok",
        );
      }
      const sent = await api(
        "POST",
        "/api/v1/dev/payments/" + payment.data.payment_no + "/simulate",
        { status: "SUCCESS" },
        session.token,
      );
      if (!sent.ok) {
        if (sent.status === 404) {
          return showMessage("Payment " + payment.data.payment_no + " is waiting for the provider (no mock provider on this server).", "PENDING", "ok");
        }
        return showProblem(sent);
      }
      await this.follow(["PAID", "CLOSED", "CANCELLED", "FAILED"]);
      await this.refreshPayment();
      if (this.order.status === "PAID") showMessage("Paid. Thank you!", "PAID", "ok");
    } finally {
      $("#pay").disabled = false;
    }
  },

  async cancel() {
    clearMessage();
    const res = await api("POST", "/api/v1/orders/" + this.order.order_no + "/cancel", {}, session.token);
    if (!res.ok) return showProblem(res);
    this.order = Object.assign({}, this.order, res.data);
    this.renderOrder();
    this.refreshOrders();
    this.loadActivities();
  },

  async refreshOrders() {
    const body = $("#orders tbody");
    if (!session.token) return body.replaceChildren();
    const res = await api("GET", "/api/v1/orders?limit=20", undefined, session.token);
    if (!res.ok) return;
    body.replaceChildren(
      ...res.data.orders.map((o) =>
        el(
          "tr",
          { "data-order": o.order_no },
          el("td", {}, o.order_no),
          el("td", {}, o.activity_id),
          el("td", {}, o.quantity),
          el("td", {}, money(o.amount_cents)),
          el("td", { class: "status" }, o.status),
          el("td", {}, o.pay_deadline ? new Date(o.pay_deadline).toLocaleTimeString() : ""),
        ),
      ),
    );
  },
};

// ---- the operator page -------------------------------------------------------

/** Prometheus text → {"name{labels}": value}. */
function parseMetrics(text) {
  const out = {};
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const cut = line.lastIndexOf(" ");
    out[line.slice(0, cut)] = Number(line.slice(cut + 1));
  }
  return out;
}

/** The sum of every sample of `name` whose labels match `labelFilter`. */
function sumOf(metrics, name, labelFilter) {
  let total = 0;
  let seen = false;
  for (const [key, value] of Object.entries(metrics)) {
    const brace = key.indexOf("{");
    const base = brace < 0 ? key : key.slice(0, brace);
    if (base !== name) continue;
    if (labelFilter && !labelFilter.some((l) => key.includes(l))) continue;
    total += value;
    seen = true;
  }
  return seen ? total : null;
}

const operator = {
  activities: [],
  // The table is fetched by the refresh timer and again after each action,
  // so answers can come back out of order: only a fetch started after the
  // one on screen may replace it (an older one would show, say, an
  // activity as it was before its warm-up).
  tableStarted: 0,
  tableShown: 0,
  last: null, // {at (ms), metrics}

  async start() {
    wireSession(true, () => this.tick());
    await whoAmI();
    $("#create-form").addEventListener("submit", (e) => {
      e.preventDefault();
      this.create(new FormData(e.target));
    });
    $("#reconcile").addEventListener("click", () => this.reconcile());
    $("#statement").addEventListener("click", () => this.checkStatement());
    await this.tick();
    setInterval(() => this.tick(), 1000);
  },

  ticks: 0,

  async tick() {
    // The statements change once a day: every tenth tick is plenty.
    const statements = this.ticks++ % 10 === 0 ? this.statements() : null;
    await Promise.all([this.live(), this.table(), this.lastReport(), statements]);
  },

  async live() {
    let text;
    try {
      text = await (await fetch("/metrics")).text();
    } catch (e) {
      return;
    }
    const now = Date.now();
    const m = parseMetrics(text);
    const counter = (outcomes) =>
      sumOf(m, "seckill_admission_total", outcomes.map((o) => 'outcome="' + o + '"'));
    const counts = {
      accepted: counter(["accepted"]),
      "sold-out": counter(["sold_out", "sold_out_memory"]),
      "limit-exceeded": counter(["limit_exceeded"]),
      "rate-limited": counter(["rate_limited"]),
    };
    if (this.last) {
      const dt = (now - this.last.at) / 1000;
      for (const [k, v] of Object.entries(counts)) {
        const before = this.last.counts[k];
        const rate = v == null || before == null ? null : Math.max(0, (v - before) / dt);
        $("#rate-" + k).textContent = rate == null ? "–" : rate.toFixed(rate < 10 ? 1 : 0);
      }
    }
    this.last = { at: now, counts };
    const show = (id, v) => ($(id).textContent = v == null ? "–" : String(v));
    const lag = sumOf(m, "seckill_order_consumer_lag");
    show("#consumer-lag", lag === -1 ? "unknown" : lag);
    show("#consumer-stalled", sumOf(m, "seckill_order_consumer_stalled_seconds"));
    show("#consumer-restarts", sumOf(m, "seckill_consumer_restarts_total"));
    const outbox = ["NEW", "RETRY", "DEAD"].map((s) => sumOf(m, "seckill_outbox_rows", ['status="' + s + '"']) ?? 0);
    show("#outbox", outbox.join(" / "));
    $("#outbox").parentElement.classList.toggle("alarm", outbox[2] > 0);
    show("#dead-letters", sumOf(m, "seckill_dead_letters_total"));
    show("#orders-closed", sumOf(m, "seckill_orders_closed_total"));
    const refused = ["wrong", "expired", "replayed"].map(
      (o) => o + " " + (sumOf(m, "seckill_waiting_room_pow_total", ['outcome="' + o + '"']) ?? 0),
    );
    show("#pow-refused", refused.join(" · "));
  },

  async table() {
    const started = ++this.tableStarted;
    const sentAt = Date.now();
    const res = await api("GET", "/api/v1/activities");
    if (!res.ok) return;
    syncClock(res.data.server_time, sentAt, Date.now());
    const activities = res.data.activities;
    const stats = session.token
      ? await Promise.all(
          activities.map((a) =>
            api("GET", "/api/v1/admin/activities/" + a.activity_id + "/stats", undefined, session.token),
          ),
        )
      : [];
    if (started < this.tableShown) return;
    this.tableShown = started;
    this.activities = activities;
    const rows = activities.map((a, i) => {
      const s = stats[i] && stats[i].ok ? stats[i].data : null;
      const cell = (v, cls) => el("td", { class: cls || "num" }, v == null ? "–" : v);
      const orders = s
        ? Object.entries(s.orders)
            .filter(([, n]) => n > 0)
            .map(([k, n]) => k + " " + n)
            .join(", ") || "none"
        : "–";
      const warm = el("button", { type: "button", class: "warmup" }, "Warm up");
      warm.disabled = a.status !== "PENDING";
      warm.addEventListener("click", () => this.act(a.activity_id, "warmup"));
      const end = el("button", { type: "button", class: "end" }, "End");
      end.disabled = a.status === "ENDED";
      end.addEventListener("click", () => this.act(a.activity_id, "end"));
      const row = el(
        "tr",
        { "data-id": a.activity_id },
        cell(a.activity_id),
        cell(a.name, "text"),
        cell(s ? s.status : a.status, "status"),
        cell(phase(a).text, "text"),
        cell(s && s.redis_available, "num redis-available"),
        cell(s && s.db_available, "num db-available"),
        cell(s && s.db_locked, "num db-locked"),
        cell(s && s.db_sold, "num db-sold"),
        cell(s && s.reservations_open, "num open"),
        cell(orders, "text orders"),
        el("td", { class: "actions" }, warm, " ", end),
      );
      // Redis must never show more than the database has free.
      if (s && s.redis_available > s.db_available) row.classList.add("alarm");
      return row;
    });
    $("#activity-table tbody").replaceChildren(...rows);
    this.rooms(activities, stats);
  },

  /** One row per waiting room: its queue from the stats, admitted per
   *  second from the last two reads, and the rate form. */
  rooms(activities, stats) {
    this.roomSeen = this.roomSeen || {};
    const rows = [];
    activities.forEach((a, i) => {
      const r = stats[i] && stats[i].ok ? stats[i].data.waiting_room : null;
      if (!r) return;
      const before = this.roomSeen[a.activity_id];
      const now = Date.now();
      const perSec = before && now > before.at ? ((r.admitted - before.admitted) * 1000) / (now - before.at) : null;
      this.roomSeen[a.activity_id] = { admitted: r.admitted, at: now };
      const cell = (v, cls) => el("td", { class: cls || "num" }, v == null ? "–" : v);
      const rate = el("input", { type: "number", min: "1", value: String(r.admit_per_sec), className: "rate" });
      const cap = el("input", { type: "number", min: "1", value: r.max_active ? String(r.max_active) : "", placeholder: "no cap", className: "cap" });
      const set = el("button", { type: "button", class: "set-rate" }, "Set");
      set.addEventListener("click", () => this.setRate(a.activity_id, rate.value, cap.value));
      // The queueing method, changed as soon as another is chosen.
      const current = r.method || "fifo";
      const method = el(
        "select",
        { className: "method", title: "queueing method" },
        ...["fifo", "passthrough", "reject"].map((m) => {
          const o = el("option", { value: m }, m);
          if (m === current) o.selected = true;
          return o;
        }),
      );
      method.addEventListener("change", () => this.setMethod(a.activity_id, method.value));
      rows.push(
        el(
          "tr",
          { "data-id": a.activity_id },
          cell(a.activity_id),
          cell(r.waiting, "num waiting"),
          cell(r.tickets, "num tickets"),
          cell(r.admitted, "num admitted"),
          cell(perSec == null ? null : perSec.toFixed(1), "num per-sec"),
          cell(r.admit_per_sec_now, "num rate-now"),
          cell(r.admit_window_now, "num window-now"),
          cell(r.passes_outstanding, "num passes"),
          cell(r.offers_open, "num offers"),
          cell(r.sold_out ? "yes" : "no", "text sold-out"),
          el("td", { class: "actions" }, rate, " ", cap, " ", set, " ", method),
        ),
      );
    });
    // Not rebuilt while the operator is typing a rate.
    const typing = document.activeElement && document.activeElement.closest("#room-table");
    if (!typing) $("#room-table tbody").replaceChildren(...rows);
  },

  async setRate(id, rate, cap) {
    clearMessage();
    const body = { admit_per_sec: Number(rate), max_active: cap ? Number(cap) : null };
    const res = await api("PATCH", "/api/v1/admin/activities/" + id + "/waiting-room", body, session.token);
    if (!res.ok) return showProblem(res);
    showMessage("Activity " + id + ": " + res.data.admit_per_sec + " admitted a second.", "OK", "ok");
    // The form is done with: the table may be redrawn again.
    if (document.activeElement && document.activeElement.closest("#room-table")) document.activeElement.blur();
    this.table();
  },

  async setMethod(id, method) {
    clearMessage();
    const res = await api("PATCH", "/api/v1/admin/activities/" + id + "/waiting-room", { method }, session.token);
    if (!res.ok) return showProblem(res);
    showMessage("Activity " + id + ": queueing method " + res.data.method + ".", "OK", "ok");
    if (document.activeElement && document.activeElement.closest("#room-table")) document.activeElement.blur();
    this.table();
  },

  async act(id, what) {
    clearMessage();
    const res = await api("POST", "/api/v1/admin/activities/" + id + "/" + what, {}, session.token);
    if (!res.ok) return showProblem(res);
    showMessage("Activity " + id + ": " + (what === "end" ? "ended" : "warmed up") + ".", "OK", "ok");
    this.table();
  },

  async create(form) {
    clearMessage();
    const n = (k) => Number(form.get(k));
    const start = serverNow() + n("starts_in") * 1000;
    const body = {
      name: form.get("name"),
      sku_id: n("sku_id"),
      price_cents: n("price_cents"),
      stock: n("stock"),
      start_at: new Date(start).toISOString(),
      end_at: new Date(start + n("lasts") * 60000).toISOString(),
      per_user_limit: n("per_user_limit"),
      pay_timeout_secs: n("pay_timeout_secs"),
      buckets: n("buckets"),
    };
    if (form.get("room")) {
      body.waiting_room = {
        prequeue_secs: n("prequeue_secs"),
        admit_per_sec: n("admit_per_sec"),
        pass_ttl_secs: 120,
        offer_secs: 60,
        pow_difficulty: 50000,
      };
    }
    const res = await api("POST", "/api/v1/admin/activities", body, session.token);
    if (!res.ok) return showProblem(res);
    showMessage("Created activity " + res.data.activity_id + ": warm it up before it starts.", "CREATED", "ok");
    this.table();
  },

  async reconcile() {
    clearMessage();
    $("#reconcile").disabled = true;
    try {
      const res = await api("POST", "/api/v1/admin/reconcile", {}, session.token);
      if (!res.ok) return showProblem(res);
      const differing = res.data.activities.filter((r) => !r.consistent).length;
      showMessage(
        "Reconciled " + res.data.activities.length + " activities: " + (differing ? differing + " with differences." : "all consistent."),
        "RECONCILED",
        differing ? "error" : "ok",
      );
      await this.lastReport();
    } finally {
      $("#reconcile").disabled = false;
    }
  },

  async checkStatement() {
    clearMessage();
    $("#statement").disabled = true;
    try {
      const res = await api("POST", "/api/v1/admin/payments/statement", {}, session.token);
      if (!res.ok) return showProblem(res);
      const n = res.data.missing_here.length + res.data.missing_there.length + res.data.mismatched.length;
      showMessage(
        "Statement of " + res.data.bill_date + ": " + (n ? n + " differences." : "it agrees."),
        "STATEMENT",
        n ? "error" : "ok",
      );
      await this.statements();
    } finally {
      $("#statement").disabled = false;
    }
  },

  async statements() {
    if (!session.token) return;
    const res = await api("GET", "/api/v1/admin/payments/statements", undefined, session.token);
    if (!res.ok) return;
    const cents = (c) => (c / 100).toFixed(2);
    const list = (items, text) => (items.length ? el("ul", {}, ...items.map((i) => el("li", {}, text(i)))) : "–");
    $("#statements tbody").replaceChildren(
      ...res.data.reports.map((r) =>
        el(
          "tr",
          {
            "data-day": r.bill_date,
            class: r.missing_here.length + r.missing_there.length + r.mismatched.length ? "alarm" : "",
          },
          el("td", {}, r.bill_date),
          el("td", {}, r.provider),
          el("td", {}, r.provider_rows),
          el("td", {}, r.our_rows),
          el("td", { class: "only-there" }, list(r.missing_here, (l) => l.reference + ": " + cents(l.amount_cents))),
          el("td", { class: "only-here" }, list(r.missing_there, (o) => o.payment_no + ": " + cents(o.amount_cents) + " " + o.status)),
          el(
            "td",
            { class: "amounts-differ" },
            list(r.mismatched, (m) => m.payment_no + ": ours " + cents(m.ours_cents) + ", theirs " + cents(m.theirs_cents)),
          ),
        ),
      ),
    );
  },

  async lastReport() {
    if (!session.token) return;
    const res = await api("GET", "/api/v1/admin/reconcile/last", undefined, session.token);
    if (!res.ok || !res.data.last) return;
    const last = res.data.last;
    $("#reconcile-at").textContent = new Date(last.at).toLocaleString() + " by " + last.by;
    const list = (items) => (items.length ? el("ul", {}, ...items.map((t) => el("li", {}, t))) : "–");
    $("#reconcile-report tbody").replaceChildren(
      ...last.activities.map((r) =>
        el(
          "tr",
          { "data-id": r.activity_id, class: r.consistent ? "" : "alarm" },
          el("td", {}, r.activity_id),
          el("td", {}, r.consistent ? "yes" : "NO"),
          el("td", {}, list(r.differences)),
          el("td", {}, list(r.repaired)),
        ),
      ),
    );
  },
};

document.addEventListener("DOMContentLoaded", () => {
  (document.body.dataset.page === "operator" ? operator : buyer).start();
});
