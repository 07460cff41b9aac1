// The console's frame: the login form, hash routing (#/overview, #/queues,
// #/queue/VHOST/NAME, #/connections, #/policies) and the refresh loop of the current view.
"use strict";

const ROUTES = {
  overview: Views.overview,
  queues: Views.queues,
  queue: Views.queue,
  connections: Views.connections,
  policies: Views.policies,
};

const App = {
  // Bumped at each route change: a refresh loop of an older view stops.
  generation: 0,

  start() {
    document.getElementById("login").addEventListener("submit", (e) => {
      e.preventDefault();
      App.submitLogin();
    });
    document.getElementById("logout").addEventListener("click", () => {
      Api.logout();
      App.showLogin("");
    });
    window.addEventListener("hashchange", () => App.route());
    if (Api.loggedIn()) {
      App.route();
    } else {
      App.showLogin("");
    }
  },

  async submitLogin() {
    const user = document.getElementById("login-user").value;
    const password = document.getElementById("login-password").value;
    const error = document.getElementById("login-error");
    error.textContent = "";
    try {
      await Api.login(user, password);
    } catch (e) {
      error.textContent = `Login failed: ${e.message}`;
      return;
    }
    document.getElementById("login").hidden = true;
    App.route();
  },

  showLogin(reason) {
    App.generation += 1;
    Api.logout();
    document.getElementById("main").replaceChildren();
    document.getElementById("who").textContent = "";
    document.getElementById("logout").hidden = true;
    document.getElementById("login-error").textContent = reason;
    document.getElementById("login").hidden = false;
  },

  route() {
    if (!Api.loggedIn()) {
      App.showLogin("");
      return;
    }
    document.getElementById("login").hidden = true;
    document.getElementById("who").textContent = Api.user();
    document.getElementById("logout").hidden = false;
    const parts = location.hash.replace(/^#\/?/, "").split("/").map(decodeURIComponent);
    const name = ROUTES[parts[0]] ? parts[0] : "overview";
    for (const a of document.querySelectorAll("#nav a")) {
      const target = a.getAttribute("href").slice(2);
      a.classList.toggle("active", target === name || (name === "queue" && target === "queues"));
    }
    const main = document.getElementById("main");
    const view = ROUTES[name](main, parts.slice(1));
    App.generation += 1;
    App.loop(App.generation, view);
  },

  /** Refreshes `view` until the route changes, each refresh after the previous ended
   *  (never two at once, however slow the node answers). */
  async loop(generation, view) {
    const status = document.getElementById("status");
    while (generation === App.generation) {
      try {
        await view.refresh();
        status.textContent = `Updated ${new Date().toLocaleTimeString()}`;
        status.classList.remove("error");
      } catch (e) {
        if (e instanceof AuthError) {
          if (generation === App.generation) {
            App.showLogin(e.message);
          }
          return;
        }
        status.textContent = `Refresh failed: ${e.message}`;
        status.classList.add("error");
      }
      await new Promise((resolve) => setTimeout(resolve, view.every_ms));
    }
  },
};

App.start();
