// The GM ring of one queue drawn as a ring: members on a circle in ring order (clockwise
// from the top, the direction messages travel), arrows between neighbours, each member
// coloured by its state, the master ringed. Each member's <g> carries data-node,
// data-role and data-state, so tests and tools read what is drawn.
"use strict";

const SVG_NS = "http://www.w3.org/2000/svg";
const RING = { size: 440, radius: 150, node: 30 };

function svg(tag, attrs, parent) {
  const el = document.createElementNS(SVG_NS, tag);
  for (const [k, v] of Object.entries(attrs)) {
    el.setAttribute(k, v);
  }
  if (parent) {
    parent.appendChild(el);
  }
  return el;
}

/** Where member i of n sits. */
function ringPoint(i, n, radius) {
  const angle = -Math.PI / 2 + (2 * Math.PI * i) / n;
  const c = RING.size / 2;
  return [c + radius * Math.cos(angle), c + radius * Math.sin(angle)];
}

/** Replaces container's content with the drawing of `members` (see views.js for their
 *  fields). */
function drawRing(container, members) {
  const root = svg("svg", {
    viewBox: `0 0 ${RING.size} ${RING.size}`,
    role: "img",
    "aria-label": `GM ring of ${members.length} members`,
  });
  const defs = svg("defs", {}, root);
  const marker = svg("marker", {
    id: "arrow", viewBox: "0 0 10 10", refX: "9", refY: "5",
    markerWidth: "7", markerHeight: "7", orient: "auto-start-reverse",
  }, defs);
  svg("path", { d: "M 0 0 L 10 5 L 0 10 z", fill: "#9aa4b1" }, marker);
  const n = members.length;
  if (n > 1) {
    // Arcs between neighbours, stopping short of the member circles.
    const gap = (RING.node + 6) / RING.radius;
    for (let i = 0; i < n; i++) {
      const a0 = -Math.PI / 2 + (2 * Math.PI * i) / n + gap;
      const a1 = -Math.PI / 2 + (2 * Math.PI * (i + 1)) / n - gap;
      if (a1 <= a0) {
        continue;
      }
      const c = RING.size / 2;
      const [x0, y0] = [c + RING.radius * Math.cos(a0), c + RING.radius * Math.sin(a0)];
      const [x1, y1] = [c + RING.radius * Math.cos(a1), c + RING.radius * Math.sin(a1)];
      const large = a1 - a0 > Math.PI ? 1 : 0;
      svg("path", {
        class: "link",
        d: `M ${x0} ${y0} A ${RING.radius} ${RING.radius} 0 ${large} 1 ${x1} ${y1}`,
        "marker-end": "url(#arrow)",
      }, root);
    }
  } else if (n === 1) {
    svg("circle", { class: "link", cx: RING.size / 2, cy: RING.size / 2, r: RING.radius,
      fill: "none", stroke: "#d9dee5" }, root);
  }
  members.forEach((m, i) => drawMember(root, m, ringPoint(i, n, RING.radius)));
  container.replaceChildren(root);
}

function drawMember(root, m, [x, y]) {
  const g = svg("g", {
    class: `member ${m.role} ${m.state}`,
    "data-node": m.node,
    "data-role": m.role,
    "data-state": m.state,
  }, root);
  if (m.role === "master") {
    svg("circle", { class: "halo", cx: x, cy: y, r: RING.node + 5 }, g);
  }
  svg("circle", { class: "node", cx: x, cy: y, r: RING.node }, g);
  const letter = { master: "M", mirror: "m" }[m.role] || "·";
  svg("text", { class: "role", x, y: y + 5 }, g).textContent = letter;
  // Labels go above members in the upper half and below the others, so they never sit
  // on the arcs and neighbours' labels do not meet.
  const below = y >= RING.size / 2 - 1;
  const label = (cls, dy) =>
    svg("text", { class: cls, x, y: below ? y + RING.node + dy : y - RING.node - 40 + dy }, g);
  label("name", 16).textContent = m.node;
  label("state", 31).textContent = memberCaption(m);
  const title = svg("title", {}, g);
  title.textContent = `${m.node}: ${m.role}, ${memberCaption(m)}`;
}

/** "synchronised", "syncing, 1200 behind", "unsynchronised", "down", ... */
function memberCaption(m) {
  if (m.state === "syncing") {
    if (m.sync_remaining !== null && m.sync_remaining !== undefined) {
      return `syncing, ${m.sync_remaining} behind`;
    }
    // The master's node says no copy runs (manual sync mode): waiting for a sync.
    return m.sync_running === false ? "unsynchronised" : "syncing";
  }
  if (m.state === "down" && m.ghost) {
    return "down (left the ring)";
  }
  return m.state;
}
