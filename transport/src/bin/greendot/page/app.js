// The page of `greendot serve`: the real TypeScript client (greendot-client.js,
// compiled from clients/typescript/src) connects by WebTransport first, then
// WebSocket; each watched user is a row whose data-* attributes hold what the
// client's View holds (the Chromium test reads them). The operator view reads
// /metrics every second. Names and messages are put in with textContent only.
//
// The group panel subscribes to one group: its count ("N of M online"), for
// an admin each member's change as it comes, and the member list one page at
// a time (online first; "next page" passes the page's cursor). The page shown
// is watched: its members' changes come as `groupPageDelta` events and
// update the list in place. The watch is renewed every 30 s while the page
// is shown (the server ends it 60 s after the last renewal), watched again
// after a reconnect (a watch ends with its session), and unwatched when the
// panel leaves the page.
//
// Query string: ?transport=websocket skips WebTransport.

import { Client, ErrorCode, KIND_BITS, ServerError } from "/greendot-client.js";

const $ = (id) => document.getElementById(id);
const params = new URLSearchParams(location.search);
let config = null;
let client = null;
const watched = new Map(); // user -> { li, presence }
// The group the panel shows: { id (bigint), role, count, members, version,
// after (the shown page's cursor as asked), next (cursor), watched (the
// shown page is watched), ended }.
let group = null;
const GROUP_PAGE = 20;
const GROUP_CHANGES = 50;
// Half the server's default watch TTL (60 s): one late renewal still lands.
const RENEW_MS = 30_000;
let renewTimer = null;

function hexToBytes(hex) {
  const out = new Uint8Array(hex.length / 2);
  for (let i = 0; i < out.length; i++) out[i] = parseInt(hex.slice(2 * i, 2 * i + 2), 16);
  return out;
}

function url(scheme, where) {
  // A null host: the server listens on every address; use the page's own.
  const host = where.host ?? location.hostname;
  return `${scheme}://${host}:${where.port}/greendot`;
}

function kinds(bits) {
  return Object.entries(KIND_BITS)
    .filter(([, bit]) => (bits & bit) !== 0)
    .map(([name]) => name);
}

function ago(ms) {
  const s = Math.max(0, Math.round((Date.now() - ms) / 1000));
  if (s < 60) return `${s} s ago`;
  if (s < 3600) return `${Math.floor(s / 60)} min ago`;
  return `${Math.floor(s / 3600)} h ago`;
}

function setState(text, connected) {
  $("state").textContent = text;
  $("state").dataset.connected = String(connected);
  if (client) $("state").dataset.binding = connected ? client.binding : "";
}

function row(user) {
  let entry = watched.get(user);
  if (!entry) {
    const li = document.createElement("li");
    li.className = "user";
    li.dataset.user = user;
    li.dataset.online = "false";
    for (const part of ["dot", "name", "version", "status", "devices", "seen"]) {
      const span = document.createElement("span");
      span.className = part;
      li.append(span);
    }
    li.querySelector(".name").textContent = user;
    li.querySelector(".status").textContent = "…";
    $("users").append(li);
    entry = { li, presence: null };
    watched.set(user, entry);
  }
  return entry;
}

function render(user, presence) {
  const entry = row(user);
  entry.presence = presence;
  const li = entry.li;
  const devices = kinds(presence.kinds);
  li.dataset.online = String(presence.online);
  li.dataset.status = presence.status;
  li.dataset.message = presence.message ?? "";
  li.dataset.devices = devices.join(",");
  li.dataset.invisible = String(presence.invisible);
  li.dataset.version = String(presence.version);
  li.dataset.lastSeen = presence.lastSeen === null ? "" : String(presence.lastSeen);
  const status = presence.online
    ? presence.status + (presence.message ? ` — ${presence.message}` : "")
    : "offline";
  li.querySelector(".status").textContent = status + (presence.invisible ? " (invisible)" : "");
  li.querySelector(".devices").textContent = devices.length ? `on ${devices.join(", ")}` : "";
  li.querySelector(".version").textContent = `v${presence.version}`;
  renderSeen(entry);
}

function renderSeen(entry) {
  const p = entry.presence;
  const seen = entry.li.querySelector(".seen");
  if (!p || p.online || p.lastSeen === null) {
    seen.textContent = p && p.online ? "online now" : "";
    return;
  }
  const ms = Number(p.lastSeen);
  seen.textContent = `last seen ${new Date(ms).toLocaleTimeString()} (${ago(ms)})`;
}

async function connect(token) {
  $("login-error").textContent = "";
  if (client) client.close();
  client = null;
  setState("connecting…", false);
  const options = {
    token,
    webTransportUrl: url("https", config.webTransport),
    webSocketUrl: url("wss", config.webSocket ?? config.webTransport),
    webTransport: params.get("transport") !== "websocket",
  };
  if (config.certificateHash) {
    options.serverCertificateHashes = [{ algorithm: "sha-256", value: hexToBytes(config.certificateHash) }];
  }
  try {
    client = await Client.connect(options);
  } catch (e) {
    setState("not connected", false);
    $("login-error").textContent = String(e);
    return;
  }
  const me = client;
  me.on((event) => {
    if (client !== me) return;
    if (event.type === "presence") render(event.target, event.presence);
    else if (event.type === "disconnected") setState(`reconnecting (${event.reason})`, false);
    else if (event.type === "reconnected") setState(`${me.user}/${me.device} over ${event.binding}, session ${event.session}`, true);
    else if (event.type === "closed") setState(`closed (${event.code ?? "-"}: ${event.reason})`, false);
    else if (event.type === "groupCount" || event.type === "groupMember" || event.type === "groupEnded") groupEvent(event);
    else if (event.type === "groupPageDelta") pageDelta(event);
    // The watch ended with the old session, or (resumed) is renewed by this.
    if (event.type === "reconnected" && group && !group.ended) void showPage(group.after);
  });
  setState(`${me.user}/${me.device} over ${me.binding}, session ${me.session}`, true);
  $("users").replaceChildren();
  watched.clear();
  group = null;
  stopRenewing();
  for (const id of ["group-changes", "group-members"]) $(id).replaceChildren();
  renderGroup();
  await watch();
}

function renderGroup() {
  const el = $("group-state");
  $("group-more").hidden = !group || group.next === null;
  $("group-first").hidden = !group || group.ended || group.after === null;
  $("group-changes-label").hidden = !group || group.role !== "admin";
  $("group-members-label").hidden = !group;
  if (!group) {
    el.textContent = "";
    for (const k of Object.keys(el.dataset)) delete el.dataset[k];
    return;
  }
  Object.assign(el.dataset, {
    group: String(group.id),
    role: group.role,
    count: String(group.count),
    members: String(group.members),
    version: String(group.version),
    ended: String(group.ended),
    watched: String(group.watched),
  });
  el.textContent = group.ended
    ? `group ${group.id}: the subscription ended (no longer a member, or the group was removed)`
    : `group ${group.id}: ${group.count} of ${group.members} online` + (group.role === "admin" ? " (admin: changes below)" : "");
}

function dotted(text, online) {
  const li = document.createElement("li");
  li.dataset.online = String(online);
  const dot = document.createElement("span");
  dot.className = "dot";
  const label = document.createElement("span");
  label.textContent = text;
  li.append(dot, label);
  return li;
}

// A member of the list: `user — status`, its view in data-* (the version
// orders a page's entries and the deltas that follow).
function renderMember(li, user, presence) {
  li.dataset.online = String(presence.online);
  li.dataset.status = presence.online ? presence.status : "";
  li.dataset.version = String(presence.version);
  const message = presence.online && presence.message ? ` (${presence.message})` : "";
  li.lastElementChild.textContent = `${user}${presence.online ? ` — ${presence.status}${message}` : " — offline"}`;
}

// Subscribes to the group in the input (again: a fresh count and first page).
async function subscribeGroup() {
  $("group-error").textContent = "";
  if (!client) return;
  const text = $("group").value.trim();
  if (!/^[0-9]{1,20}$/.test(text) || BigInt(text) >= 1n << 64n) {
    $("group-error").textContent = "a group is a number from 0 to 18446744073709551615";
    return;
  }
  const id = BigInt(text);
  try {
    await leavePage();
    if (group && group.id !== id && !group.ended) await client.groupUnsubscribe(group.id).catch(() => {});
    const s = await client.groupSubscribe(id);
    group = { id, role: s.role, count: s.count, members: s.members, version: s.version, after: null, next: null, watched: false, ended: false };
    $("group-changes").replaceChildren();
    $("group-members").replaceChildren();
    $("group-members").dataset.pages = "0";
    renderGroup();
    await showPage(null);
  } catch (e) {
    $("group-error").textContent = String(e);
  }
}

function stopRenewing() {
  if (renewTimer !== null) clearInterval(renewTimer);
  renewTimer = null;
}

// Stops watching the page shown (the panel moves to another page or group).
async function leavePage() {
  stopRenewing();
  const g = group;
  if (!client || !g || !g.watched) return;
  g.watched = false;
  if (!g.ended) await client.groupUnwatchPage(g.id, g.after).catch(() => {});
}

// Shows the page of the member list that starts at `after` (null: the
// first), watched, in place of the one shown; read again when it is the
// same page. Counts as a page read (data-pages).
async function showPage(after) {
  const g = group;
  if (!client || !g || g.ended) return;
  try {
    if (g.watched && g.after !== after) await leavePage();
    const page = await client.groupWatchPage(g.id, after, GROUP_PAGE);
    if (group !== g) {
      await client.groupUnwatchPage(g.id, after).catch(() => {});
      return;
    }
    g.after = after;
    g.next = page.next;
    g.watched = true;
    const items = page.entries.map(({ user, presence }) => {
      const li = dotted("", presence.online);
      li.dataset.user = user;
      renderMember(li, user, presence);
      return li;
    });
    $("group-members").replaceChildren(...items);
    $("group-members").dataset.pages = String(Number($("group-members").dataset.pages ?? 0) + 1);
    stopRenewing();
    renewTimer = setInterval(() => void renew(g), RENEW_MS);
    renderGroup();
  } catch (e) {
    $("group-error").textContent = String(e);
  }
}

// Renews the shown page's watch; one that ran out (a tab the browser
// throttled past the TTL) is watched again, re-reading the page.
async function renew(g) {
  if (!client || group !== g || !g.watched) return;
  try {
    await client.groupRenewWatch(g.id, g.after);
  } catch (e) {
    if (group !== g) return;
    if (e instanceof ServerError && e.error.code === ErrorCode.NotSubscribed) await showPage(g.after);
    else $("group-error").textContent = String(e);
  }
}

// Members of the shown page whose view changed: updated in place when
// newer than what the list shows.
function pageDelta(event) {
  if (!group || event.group !== group.id) return;
  for (const { user, presence } of event.entries) {
    for (const li of $("group-members").children) {
      if (li.dataset.user !== user || BigInt(li.dataset.version) >= presence.version) continue;
      renderMember(li, user, presence);
    }
  }
}

// The client drops pushes older than what it told: each event here is news.
function groupEvent(event) {
  if (!group || event.group !== group.id) return;
  if (event.type === "groupEnded") {
    // The server ended the watch with the subscription.
    group.ended = true;
    group.next = null;
    group.watched = false;
    stopRenewing();
  } else {
    group.count = event.count;
    group.version = event.version;
  }
  if (event.type === "groupMember") {
    const li = dotted(`${new Date().toLocaleTimeString()} ${event.member} ${event.online ? "online" : "offline"}`, event.online);
    li.dataset.member = event.member;
    $("group-changes").prepend(li);
    while ($("group-changes").children.length > GROUP_CHANGES) $("group-changes").lastElementChild.remove();
  }
  renderGroup();
}

async function watch() {
  $("watch-error").textContent = "";
  if (!client) return;
  const users = $("watch").value.split(",").map((u) => u.trim()).filter((u) => u && !watched.has(u));
  if (users.length === 0) return;
  for (const u of users) row(u);
  try {
    const { snapshots, refused } = await client.subscribe(users, "realtime");
    for (const s of snapshots) render(s.target, client.presence(s.target) ?? s.presence);
    if (refused.length) $("watch-error").textContent = refused.map((r) => `${r.target}: ${r.error.message}`).join("\n");
  } catch (e) {
    $("watch-error").textContent = String(e);
  }
}

// Prometheus text: `name{labels} value` lines.
function parseMetrics(text) {
  const samples = [];
  for (const line of text.split("\n")) {
    if (!line || line.startsWith("#")) continue;
    const m = /^([a-z_]+)(\{[^}]*\})? (\S+)$/.exec(line);
    if (m) samples.push({ name: m[1], labels: m[2] ?? "", value: Number(m[3]) });
  }
  const get = (name, labels = "") => samples.find((s) => s.name === name && s.labels === labels)?.value ?? 0;
  const buckets = samples
    .filter((s) => s.name === "greendot_push_latency_seconds_bucket")
    .map((s) => ({ le: /le="([^"]+)"/.exec(s.labels)?.[1] ?? "", count: s.value }));
  return { get, buckets };
}

function quantile(buckets, q) {
  const total = buckets.at(-1)?.count ?? 0;
  if (total === 0) return null;
  return buckets.find((b) => b.count >= q * total)?.le ?? null;
}

function seconds(le) {
  if (le === null) return "–";
  if (le === "+Inf") return "∞";
  const s = Number(le);
  return s < 1 ? `${+(s * 1000).toPrecision(3)} ms` : `${s} s`;
}

function setValue(id, value, text = String(value)) {
  $(id).textContent = text;
  $(id).dataset.value = String(value);
}

async function operator() {
  try {
    const response = await fetch("/metrics", { cache: "no-store" });
    if (!response.ok) throw new Error(`/metrics: ${response.status} ${await response.text()}`);
    const { get, buckets } = parseMetrics(await response.text());
    setValue("op-users", get("greendot_users_online"));
    const online = get("greendot_devices", '{state="online"}');
    const lingering = get("greendot_devices", '{state="lingering"}');
    setValue("op-devices", online, `${online} / ${lingering}`);
    setValue("op-quic", get("greendot_connections", '{binding="quic"}'));
    setValue("op-webtransport", get("greendot_connections", '{binding="webtransport"}'));
    setValue("op-websocket", get("greendot_connections", '{binding="websocket"}'));
    setValue("op-migrations", get("greendot_migrations_total"));
    const total = buckets.at(-1)?.count ?? 0;
    setValue("op-pushes", total);
    $("op-latency").textContent = `${seconds(quantile(buckets, 0.5))} / ${seconds(quantile(buckets, 0.99))}`;
    const bars = [];
    let below = 0;
    const max = Math.max(1, ...buckets.map((b, i) => b.count - (i ? buckets[i - 1].count : 0)));
    for (const b of buckets) {
      const n = b.count - below;
      below = b.count;
      const label = document.createElement("span");
      label.textContent = `≤ ${seconds(b.le)}`;
      const bar = document.createElement("div");
      bar.className = "bar";
      bar.style.width = `${(100 * n) / max}%`;
      const count = document.createElement("span");
      count.textContent = String(n);
      bars.push(label, bar, count);
    }
    $("histogram").replaceChildren(...bars);
    $("op-error").textContent = "";
  } catch (e) {
    $("op-error").textContent = String(e);
  }
}

async function start() {
  config = await (await fetch("/page.json", { cache: "no-store" })).json();
  if (config.devTokens) $("dev-form").hidden = false;
  $("dev-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    const user = $("dev-user").value.trim();
    // The code `greendot serve` printed in this page's address (#dev=…):
    // without it the server mints nothing.
    const code = new URLSearchParams(location.hash.slice(1)).get("dev") ?? "";
    const response = await fetch(`/dev/token/${encodeURIComponent(user)}`, {
      cache: "no-store",
      headers: { "greendot-dev-code": code },
    });
    const body = await response.json();
    if (!response.ok) {
      $("login-error").textContent = body.error ?? `HTTP ${response.status}`;
      return;
    }
    await connect(body.token);
  });
  $("token-form").addEventListener("submit", (e) => {
    e.preventDefault();
    void connect($("token").value.trim());
  });
  $("watch-form").addEventListener("submit", (e) => {
    e.preventDefault();
    void watch();
  });
  $("group-form").addEventListener("submit", (e) => {
    e.preventDefault();
    void subscribeGroup();
  });
  $("group-more").addEventListener("click", () => group && void showPage(group.next));
  $("group-first").addEventListener("click", () => void showPage(null));
  $("status-form").addEventListener("submit", async (e) => {
    e.preventDefault();
    if (!client) return;
    const message = $("message").value.trim();
    try {
      await client.setStatus($("status").value, message === "" ? null : message);
    } catch (err) {
      $("watch-error").textContent = String(err);
    }
  });
  $("logout").addEventListener("click", async () => {
    if (!client) return;
    try {
      await client.logout();
    } catch (err) {
      $("watch-error").textContent = String(err);
    }
  });
  setInterval(() => {
    for (const entry of watched.values()) renderSeen(entry);
  }, 1000);
  await operator();
  setInterval(operator, 1000);
  document.body.dataset.ready = "true";
}

void start();
