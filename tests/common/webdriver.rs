//! A small W3C WebDriver client: headless Chromium through `chromedriver`, for the web
//! console's browser test (`tests/console_browser.rs`).
//!
//! It speaks WebDriver's JSON over HTTP with `ureq` (already a dev-dependency): the test
//! needs a dozen commands (navigate, find, click, type, run a script, screenshot), which
//! is less than a WebDriver crate and its HTTP stack would add to the build.
//!
//! `$CHROMEDRIVER` and `$CHROMIUM` override `/usr/bin/chromedriver` and `/usr/bin/chromium`
//! (Debian's `chromium-driver` and `chromium`). The driver process and the browser session
//! end when the [`Browser`] is dropped, on failure too.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use base64::Engine;
use serde_json::{json, Value};

/// How W3C WebDriver names an element reference in JSON.
const ELEMENT_KEY: &str = "element-6066-11e4-a52e-4f735466cecf";

/// Upper bound for chromedriver to answer `/status` and open a session.
const START_TIMEOUT: Duration = Duration::from_secs(30);

/// A headless Chromium session.
pub struct Browser {
    driver: Child,
    base: String,
    session: String,
    agent: ureq::Agent,
    profile: PathBuf,
}

fn binary(var: &str, default: &str) -> PathBuf {
    let path = std::env::var_os(var)
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from(default));
    assert!(
        path.exists(),
        "{} not found: install Debian's chromium and chromium-driver (or set ${var})",
        path.display()
    );
    path
}

impl Browser {
    /// Starts chromedriver and a headless Chromium of `width`×`height` pixels.
    pub fn start(width: u32, height: u32) -> Browser {
        let chromedriver = binary("CHROMEDRIVER", "/usr/bin/chromedriver");
        let chromium = binary("CHROMIUM", "/usr/bin/chromium");
        let port = super::free_port();
        let driver = Command::new(chromedriver)
            .arg(format!("--port={port}"))
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start chromedriver");
        let profile = std::env::temp_dir().join(format!("warren-chromium-{port}"));
        let mut browser = Browser {
            driver,
            base: format!("http://127.0.0.1:{port}"),
            session: String::new(),
            agent: ureq::AgentBuilder::new()
                .timeout(Duration::from_secs(60))
                .build(),
            profile,
        };
        let deadline = Instant::now() + START_TIMEOUT;
        while !browser.ready() {
            assert!(Instant::now() < deadline, "chromedriver did not start");
            std::thread::sleep(Duration::from_millis(100));
        }
        let capabilities = json!({"capabilities": {"alwaysMatch": {
            "browserName": "chrome",
            "goog:chromeOptions": {
                "binary": chromium,
                "args": [
                    "--headless=new",
                    // Containers run tests as root, where Chromium's sandbox cannot start.
                    "--no-sandbox",
                    "--disable-gpu",
                    "--disable-dev-shm-usage",
                    format!("--window-size={width},{height}"),
                    format!("--user-data-dir={}", browser.profile.display()),
                ],
            },
        }}});
        let created = browser.raw("POST", "/session", Some(capabilities));
        browser.session = created["sessionId"]
            .as_str()
            .unwrap_or_else(|| panic!("no session: {created}"))
            .to_string();
        // --window-size counts the (invisible) window frame of headless Chromium; the page
        // itself gets exactly width×height through the DevTools protocol.
        let metrics = json!({"cmd": "Emulation.setDeviceMetricsOverride", "params": {
            "width": width, "height": height, "deviceScaleFactor": 1, "mobile": false,
        }});
        browser.command("POST", "/goog/cdp/execute", Some(metrics));
        browser
    }

    fn ready(&self) -> bool {
        let reply = self.agent.get(&format!("{}/status", self.base)).call();
        let Ok(reply) = reply else { return false };
        let body: Value = reply
            .into_string()
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok())
            .unwrap_or(Value::Null);
        body["value"]["ready"] == true
    }

    /// One command; its `value`, failing the test on a WebDriver error.
    fn raw(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        let request = self.agent.request(method, &format!("{}{path}", self.base));
        let result = match body {
            Some(b) => request
                .set("content-type", "application/json")
                .send_string(&b.to_string()),
            None => request.call(),
        };
        let text = match result {
            Ok(r) => r.into_string().expect("webdriver reply"),
            Err(ureq::Error::Status(code, r)) => {
                let text = r.into_string().unwrap_or_default();
                panic!("webdriver {method} {path}: {code} {text}")
            }
            Err(e) => panic!("webdriver {method} {path}: {e}"),
        };
        let reply: Value = serde_json::from_str(&text).expect("webdriver JSON");
        reply["value"].clone()
    }

    fn command(&self, method: &str, path: &str, body: Option<Value>) -> Value {
        self.raw(method, &format!("/session/{}{path}", self.session), body)
    }

    /// Loads `url`.
    pub fn goto(&self, url: &str) {
        self.command("POST", "/url", Some(json!({"url": url})));
    }

    /// The element `css` selects, if any.
    pub fn find(&self, css: &str) -> Option<String> {
        let found = self.command(
            "POST",
            "/elements",
            Some(json!({"using": "css selector", "value": css})),
        );
        found.as_array()?.first()?[ELEMENT_KEY]
            .as_str()
            .map(String::from)
    }

    fn element(&self, css: &str) -> String {
        self.find(css)
            .unwrap_or_else(|| panic!("no element matches {css}"))
    }

    /// Clicks the element `css` selects.
    pub fn click(&self, css: &str) {
        let id = self.element(css);
        self.command("POST", &format!("/element/{id}/click"), Some(json!({})));
    }

    /// Types `text` into the element `css` selects.
    pub fn type_into(&self, css: &str, text: &str) {
        let id = self.element(css);
        self.command(
            "POST",
            &format!("/element/{id}/value"),
            Some(json!({"text": text})),
        );
    }

    /// The visible text of the element `css` selects (empty when there is none).
    pub fn text(&self, css: &str) -> String {
        match self.find(css) {
            Some(id) => self
                .command("GET", &format!("/element/{id}/text"), None)
                .as_str()
                .unwrap_or_default()
                .to_string(),
            None => String::new(),
        }
    }

    /// Runs `script` (a function body; `return` gives the result) in the page.
    pub fn script(&self, script: &str) -> Value {
        self.command(
            "POST",
            "/execute/sync",
            Some(json!({"script": script, "args": []})),
        )
    }

    /// Saves a PNG of the window to `path`.
    pub fn screenshot(&self, path: &Path) {
        let encoded = self.command("GET", "/screenshot", None);
        let png = base64::engine::general_purpose::STANDARD
            .decode(encoded.as_str().expect("base64 screenshot"))
            .expect("PNG");
        std::fs::write(path, png).expect("write screenshot");
    }
}

impl Drop for Browser {
    fn drop(&mut self) {
        if !self.session.is_empty() {
            let _ = self
                .agent
                .delete(&format!("{}/session/{}", self.base, self.session))
                .call();
        }
        let _ = self.driver.kill();
        let _ = self.driver.wait();
        let _ = std::fs::remove_dir_all(&self.profile);
    }
}
