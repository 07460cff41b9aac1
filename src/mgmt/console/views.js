// The console's views. Each view is a function (main, params) that builds its frame in
// `main` and returns { refresh, every_ms }: app.js calls refresh() at once and then every
// every_ms after the previous call finished, until the user leaves the view.
"use strict";

/** document.createElement with attributes and children (strings become text). */
function el(tag, attrs = {}, ...children) {
  const e = document.createElement(tag);
  for (const [k, v] of Object.entries(attrs)) {
    if (k === "onclick" || k === "oninput") {
      e[k] = v;
    } else if (v !== false && v !== null && v !== undefined) {
      e.setAttribute(k, v === true ? "" : v);
    }
  }
  for (const c of children.flat()) {
    if (c !== null && c !== undefined) {
      e.append(c instanceof Node ? c : String(c));
    }
  }
  return e;
}

function badge(text, kind = text) {
  return el("span", { class: `badge ${kind}` }, text);
}

// 1536 -> "1.5 KiB", as RabbitMQ's UI writes sizes.
function bytes(n) {
  const units = ["B", "KiB", "MiB", "GiB", "TiB"];
  let i = 0;
  while (n >= 1024 && i < units.length - 1) { n /= 1024; i++; }
  return i === 0 ? `${n} B` : `${n.toFixed(1)} ${units[i]}`;
}

// Milliseconds -> "2d 3h", "3h 4m", "4m 5s", as RabbitMQ's UI writes uptimes.
function duration(ms) {
  const s = Math.floor(ms / 1000), d = Math.floor(s / 86400), h = Math.floor(s / 3600) % 24,
    m = Math.floor(s / 60) % 60;
  if (d > 0) return `${d}d ${h}h`;
  if (h > 0) return `${h}h ${m}m`;
  return `${m}m ${s % 60}s`;
}

function queueLink(vhost, name) {
  return el("a", { href: `#/queue/${seg(vhost)}/${seg(name)}` }, name);
}

/** A table whose columns sort on click: columns are { key, label, num, show(row) }. */
class SortableTable {
  constructor(columns, sortKey) {
    this.columns = columns;
    this.sort = { key: sortKey, reverse: false };
    this.rows = [];
    this.filter = () => true;
    this.element = el("table");
  }

  update(rows) {
    this.rows = rows;
    this.render();
  }

  render() {
    const { key, reverse } = this.sort;
    const column = this.columns.find((c) => c.key === key);
    const value = (r) => (column && column.value ? column.value(r) : r[key]);
    const rows = this.rows.filter(this.filter).sort((a, b) => {
      const [x, y] = [value(a), value(b)];
      const order = typeof x === "number" && typeof y === "number"
        ? x - y : String(x ?? "").localeCompare(String(y ?? ""));
      return reverse ? -order : order;
    });
    const head = el("tr", {}, this.columns.map((c) => {
      const sorted = c.key === key ? (reverse ? " sorted-desc" : " sorted-asc") : "";
      return el("th", {
        class: `sortable${sorted}${c.num ? " num" : ""}`,
        "data-key": c.key,
        onclick: () => {
          this.sort = { key: c.key, reverse: c.key === key ? !reverse : false };
          this.render();
        },
      }, c.label);
    }));
    const body = rows.map((r) => el("tr", {}, this.columns.map((c) =>
      el("td", { class: c.num ? "num" : null }, c.show ? c.show(r) : r[c.key] ?? ""))));
    if (rows.length === 0) {
      body.push(el("tr", {}, el("td", { colspan: this.columns.length, class: "muted" },
        "None.")));
    }
    this.element.replaceChildren(el("thead", {}, head), el("tbody", {}, body));
  }
}

const Views = {};

Views.overview = (main) => {
  const cards = el("div", { class: "cards", id: "totals" });
  const rates = el("div", { class: "cards", id: "rates" });
  // A stopped node has no figures: its cells stay empty.
  const of = (used, total, fmt) => (used === undefined ? "" : total ? `${fmt(used)} of ${fmt(total)}` : fmt(used));
  const nodes = new SortableTable([
    { key: "name", label: "Node" },
    { key: "running", label: "State", show: (n) => n.running ? badge("running") : badge("down") },
    { key: "mem_used", label: "Memory", num: true,
      show: (n) => n.mem_used === undefined ? "" : [of(n.mem_used, n.mem_limit, bytes), n.mem_alarm ? badge("alarm") : ""] },
    { key: "disk_free", label: "Disk free", num: true,
      show: (n) => n.disk_free == null ? "" : [bytes(n.disk_free), n.disk_free_alarm ? badge("alarm") : ""] },
    { key: "fd_used", label: "File descriptors", num: true, show: (n) => of(n.fd_used, n.fd_total, String) },
    { key: "sockets_used", label: "Sockets", num: true, show: (n) => of(n.sockets_used, n.sockets_total, String) },
    { key: "uptime", label: "Uptime", num: true, show: (n) => n.uptime === undefined ? "" : duration(n.uptime) },
  ], "name");
  nodes.element.id = "nodes";
  const alarms = el("div", { id: "alarms" });
  main.replaceChildren(
    el("h1", {}, "Overview"),
    cards,
    el("h2", {}, "Message rates on this node"),
    rates,
    el("div", { class: "queue-layout" },
      el("div", { class: "panel" }, el("h2", {}, "Nodes"), nodes.element),
      el("div", { class: "panel" }, el("h2", {}, "Alarms"), alarms)),
  );
  let previous = null;
  const card = (label, value) =>
    el("div", { class: "card" }, el("div", { class: "value" }, value),
      el("div", { class: "label" }, label));
  const refresh = async () => {
    const [o, nodeList, alarmCheck] = await Promise.all([
      Api.get("overview"),
      // Only monitoring users may list nodes (401 "Not monitor user" otherwise).
      Api.get("nodes", [401]),
      Api.get("health/checks/alarms", [503]),
    ]);
    const t = o.object_totals, q = o.queue_totals;
    cards.replaceChildren(
      card("Messages", q.messages), card("Ready", q.messages_ready),
      card("Unacknowledged", q.messages_unacknowledged), card("Queues", t.queues),
      card("Connections", t.connections), card("Channels", t.channels),
      card("Consumers", t.consumers), card("Exchanges", t.exchanges));
    // Rates are differences of this node's counters between two refreshes.
    const now = performance.now();
    const stats = o.message_stats || {};
    const rate = (k) => previous === null ? "…"
      : (((stats[k] || 0) - (previous.stats[k] || 0)) * 1000 / (now - previous.at)).toFixed(1);
    rates.replaceChildren(
      card("Publish /s", rate("publish")), card("Confirm /s", rate("confirm")),
      card("Deliver and get /s", rate("deliver_get")), card("Ack /s", rate("ack")),
      card("Redeliver /s", rate("redeliver")));
    previous = { at: now, stats };
    if (Array.isArray(nodeList)) {
      nodes.update(nodeList);
    } else {
      nodes.element.replaceChildren(el("caption", { class: "muted" },
        "Listing nodes needs the monitoring tag."));
    }
    if (alarmCheck.status === "ok") {
      alarms.replaceChildren(badge("none", "ok"), " No resource alarm.");
    } else {
      alarms.replaceChildren(el("ul", {}, (alarmCheck.alarms || []).map((a) =>
        el("li", {}, badge("alarm"), ` ${a.resource} on ${a.node}`))));
    }
  };
  return { refresh, every_ms: 2000 };
};

Views.queues = (main) => {
  const search = el("input", {
    type: "search", id: "queue-filter", placeholder: "Filter by name or vhost",
    oninput: () => {
      const text = search.value.toLowerCase();
      table.filter = (q) => q.name.toLowerCase().includes(text)
        || q.vhost.toLowerCase().includes(text);
      table.render();
    },
  });
  const table = new SortableTable([
    { key: "name", label: "Name", show: (q) => queueLink(q.vhost, q.name) },
    { key: "vhost", label: "Vhost" },
    { key: "node", label: "Master" },
    { key: "mirrors", label: "Mirrors", num: true,
      value: (q) => (q.slave_nodes || []).length,
      show: (q) => mirrorSummary(q) },
    { key: "messages", label: "Messages", num: true },
    { key: "messages_ready", label: "Ready", num: true },
    { key: "messages_unacknowledged", label: "Unacked", num: true },
    { key: "consumers", label: "Consumers", num: true },
    { key: "policy", label: "Policy" },
  ], "name");
  table.element.id = "queues";
  main.replaceChildren(el("h1", {}, "Queues"), search, table.element);
  return { refresh: async () => table.update(await Api.get("queues")), every_ms: 2000 };
};

function mirrorSummary(q) {
  const all = (q.slave_nodes || []).length;
  if (all === 0) {
    return "";
  }
  const synced = (q.synchronised_slave_nodes || []).length;
  return el("span", {}, `${all} `, badge(`${synced}/${all} synchronised`,
    synced === all ? "synchronised" : "syncing"));
}

Views.queue = (main, [vhost, name]) => {
  const path = `queues/${seg(vhost)}/${seg(name)}`;
  const ring = el("div", { id: "ring" });
  const facts = el("dl", { id: "queue-facts" });
  const members = el("table", { id: "members" });
  const note = el("p", { id: "sync-note", class: "muted" });
  const sync = el("button", {
    id: "sync", type: "button",
    onclick: async () => {
      sync.disabled = true;
      try {
        await Api.post(`${path}/actions`, { action: "sync" });
        note.textContent = "Sync requested.";
      } catch (e) {
        if (e instanceof AuthError) {
          App.showLogin(e.message);
          return;
        }
        note.textContent = `Sync refused: ${e.message}`;
      } finally {
        sync.disabled = false;
      }
    },
  }, "Sync");
  main.replaceChildren(
    el("h1", {}, "Queue ", el("span", { id: "queue-name" }, name),
      el("span", { class: "muted" }, ` in ${vhost}`)),
    el("div", { class: "queue-layout" },
      el("div", { class: "panel" }, el("h2", {}, "GM ring"), ring),
      el("div", { class: "panel" }, el("h2", {}, "Queue"), facts,
        el("h2", {}, "Members"), members, el("p", {}, sync), note)),
  );
  // Nodes seen in this queue's ring: one that left the ring and whose node is down is
  // still drawn, marked down, at its last place until its node runs again. The answering
  // node may learn of a promotion (through Raft) before its own failure detector marks the
  // old master's node down, so a node that left while still "running" is remembered for
  // FORGET_MS before it counts as having left normally (a policy change, say).
  const FORGET_MS = 10000;
  const seen = new Map();
  const refresh = async () => {
    const [q, nodeList] = await Promise.all([Api.get(path), Api.get("nodes", [401])]);
    const running = new Map((Array.isArray(nodeList) ? nodeList : [])
      .map((n) => [n.name, n.running]));
    const list = (q.gm_ring || []).map((m) => ({ ...m, ghost: false,
      sync_running: q.sync_running }));
    const present = new Set(list.map((m) => m.node));
    const now = Date.now();
    for (const [node, last] of seen) {
      if (present.has(node)) {
        continue;
      }
      if (running.get(node) === false) {
        last.gone = null;
        list.splice(Math.min(last.at, list.length), 0, {
          node, role: "member", state: "down", sync_remaining: null, gm_member: null,
          ghost: true,
        });
      } else if (last.gone === null) {
        last.gone = now;
      } else if (now - last.gone > FORGET_MS) {
        seen.delete(node);
      }
    }
    list.forEach((m, i) => {
      if (!m.ghost) {
        seen.set(m.node, { at: i, gone: null });
      }
    });
    if (list.length === 0) {
      ring.replaceChildren(el("p", { class: "muted" },
        "Not mirrored: no GM ring (an ha-mode policy mirrors it)."));
    } else {
      drawRing(ring, list);
    }
    showFacts(facts, q);
    showMembers(members, list, q.sync_running);
    members.hidden = list.length === 0;
    sync.hidden = list.length === 0;
  };
  return { refresh, every_ms: 1000 };
};

function showFacts(facts, q) {
  const rows = [
    ["Master", q.node],
    ["Epoch", q.epoch ?? 0],
    ["Messages", `${q.messages} (${q.messages_ready} ready, ${q.messages_unacknowledged} unacked)`],
    ["Consumers", q.consumers],
    ["Durable", q.durable ? "yes" : "no"],
    ["Policy", q.policy ?? "none"],
    ["Effective definition", JSON.stringify(q.effective_policy_definition || {})],
  ];
  facts.replaceChildren(...rows.flatMap(([k, v]) => [el("dt", {}, k),
    el("dd", { "data-fact": k.toLowerCase() }, v)]));
}

function showMembers(table, list, syncRunning) {
  const lag = (m) => {
    if (m.sync_remaining !== null && m.sync_remaining !== undefined) {
      return String(m.sync_remaining);
    }
    if (m.state !== "syncing") {
      return "—";
    }
    // Only the master's node counts a running copy (sync_running null elsewhere).
    const why = syncRunning === false ? "no sync running" : "counted on the master's node";
    return el("span", { class: "muted" }, why);
  };
  table.replaceChildren(
    el("thead", {}, el("tr", {}, ["Node", "Role", "State", "Lag (sequence numbers)",
      "GM member"].map((h) => el("th", {}, h)))),
    el("tbody", {}, list.map((m) => el("tr", { "data-node": m.node }, el("td", {}, m.node),
      el("td", {}, m.role), el("td", {}, badge(memberCaption(m), m.state)),
      el("td", { class: "num" }, lag(m)), el("td", {}, m.gm_member ?? "—")))));
}

Views.connections = (main) => {
  const connections = new SortableTable([
    { key: "name", label: "Connection" },
    { key: "user", label: "User" },
    { key: "vhost", label: "Vhost" },
    { key: "state", label: "State" },
    { key: "channels", label: "Channels", num: true },
    { key: "protocol", label: "Protocol" },
  ], "name");
  const channels = new SortableTable([
    { key: "name", label: "Channel" },
    { key: "user", label: "User" },
    { key: "vhost", label: "Vhost" },
    { key: "consumer_count", label: "Consumers", num: true },
    { key: "prefetch_count", label: "Prefetch", num: true },
    { key: "messages_unacknowledged", label: "Unacked", num: true },
    { key: "messages_unconfirmed", label: "Unconfirmed", num: true },
    { key: "mode", label: "Mode", value: channelMode, show: channelMode },
  ], "name");
  connections.element.id = "connections";
  channels.element.id = "channels";
  main.replaceChildren(el("h1", {}, "Connections and channels"),
    el("p", { class: "muted" }, "This node's own, as the API lists them."),
    el("h2", {}, "Connections"), connections.element,
    el("h2", {}, "Channels"), channels.element);
  const refresh = async () => {
    const [c, ch] = await Promise.all([Api.get("connections"), Api.get("channels")]);
    connections.update(c);
    channels.update(ch);
  };
  return { refresh, every_ms: 2000 };
};

function channelMode(ch) {
  return ch.transactional ? "transactional" : ch.confirm ? "confirm" : "";
}

Views.policies = (main) => {
  const table = new SortableTable([
    { key: "name", label: "Name" },
    { key: "vhost", label: "Vhost" },
    { key: "pattern", label: "Pattern" },
    { key: "apply-to", label: "Apply to" },
    { key: "priority", label: "Priority", num: true },
    { key: "definition", label: "Definition",
      value: (p) => JSON.stringify(p.definition),
      show: (p) => el("code", {}, JSON.stringify(p.definition)) },
  ], "name");
  table.element.id = "policies";
  main.replaceChildren(el("h1", {}, "Policies"), table.element);
  return { refresh: async () => table.update(await Api.get("policies")), every_ms: 2000 };
};
