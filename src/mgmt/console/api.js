// Calls to the management API. The credentials the user logged in with are kept in
// sessionStorage (gone when the tab closes) and sent as HTTP basic auth on every call.
"use strict";

const AUTH_KEY = "warren.console.auth";

/** The API refused the credentials (401): the page shows the login form again. */
class AuthError extends Error {}

const Api = {
  loggedIn() {
    return sessionStorage.getItem(AUTH_KEY) !== null;
  },

  user() {
    const auth = sessionStorage.getItem(AUTH_KEY);
    return auth === null ? null : JSON.parse(auth).user;
  },

  /** Checks the credentials with /api/whoami and keeps them when they work. */
  async login(user, password) {
    const header = basicAuth(user, password);
    const reply = await fetch("api/whoami", { headers: { authorization: header } });
    if (!reply.ok) {
      throw new AuthError(await reasonOf(reply));
    }
    sessionStorage.setItem(AUTH_KEY, JSON.stringify({ user, header }));
    return reply.json();
  },

  logout() {
    sessionStorage.removeItem(AUTH_KEY);
  },

  /** GET path; the JSON body. `accept` lists statuses besides 2xx whose body is wanted
   *  (a failed health check answers 503 with the details). */
  get(path, accept = []) {
    return this.request("GET", path, undefined, accept);
  },

  post(path, body) {
    return this.request("POST", path, body, []);
  },

  async request(method, path, body, accept) {
    const auth = sessionStorage.getItem(AUTH_KEY);
    if (auth === null) {
      throw new AuthError("not logged in");
    }
    const headers = { authorization: JSON.parse(auth).header };
    if (body !== undefined) {
      headers["content-type"] = "application/json";
    }
    const reply = await fetch("api/" + path, {
      method,
      headers,
      body: body === undefined ? undefined : JSON.stringify(body),
      cache: "no-store",
    });
    if (reply.status === 401) {
      throw new AuthError(await reasonOf(reply));
    }
    if (!reply.ok && !accept.includes(reply.status)) {
      throw new Error(`${method} /api/${path}: ${reply.status} ${await reasonOf(reply)}`);
    }
    const text = await reply.text();
    return text === "" ? null : JSON.parse(text);
  },
};

/** A path segment, as the API wants it (`/` is `%2F`). */
function seg(s) {
  return encodeURIComponent(s);
}

function basicAuth(user, password) {
  // btoa takes Latin-1 only: encode the UTF-8 bytes.
  const bytes = new TextEncoder().encode(`${user}:${password}`);
  return "Basic " + btoa(String.fromCharCode(...bytes));
}

async function reasonOf(reply) {
  try {
    const body = await reply.json();
    return body.reason || body.error || reply.statusText;
  } catch (_) {
    return reply.statusText || String(reply.status);
  }
}
