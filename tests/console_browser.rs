//! The web console in a real browser (headless Chromium through chromedriver) against a
//! real three-process cluster: the page logs in, shows the overview, connections, channels
//! and policies, lists (and filters) the queues, draws a mirrored
//! queue's GM ring with its three members, marks the master's member down and shows the
//! new master after `kill -9` of the master's node, and shows the restarted node's mirror
//! syncing and then synchronised after the page's Sync button.
//!
//! Behind the `browser-test` feature (`cargo test --features browser-test --test
//! console_browser`; `.ci/console.sh` installs the browser and runs it), so a machine
//! without Chromium still passes `cargo test --workspace`. Screenshots of every step are
//! written to a temporary directory named on stderr.

mod common;

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use lapin::options::ConfirmSelectOptions;

use common::procs::{channel, connect, declare, locator, publish_acked, Cluster};
use common::webdriver::Browser;
use common::within;

const QUEUE: &str = "ha.console";

/// Upper bound for the page to show a change (failure detection, promotion, a sync, and
/// the page's 1 s refresh).
const SHOW_TIMEOUT: Duration = Duration::from_secs(60);

/// One member of the ring as the page draws it.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Drawn {
    node: String,
    role: String,
    state: String,
}

/// The ring's members as drawn: the data attributes of the SVG's member groups.
fn drawn_ring(browser: &Browser) -> Vec<Drawn> {
    let members = browser.script(
        "return [...document.querySelectorAll('#ring g.member')]\
         .map(g => [g.dataset.node, g.dataset.role, g.dataset.state]);",
    );
    members
        .as_array()
        .map(|list| {
            list.iter()
                .map(|m| {
                    let field = |i: usize| m[i].as_str().unwrap_or_default().to_string();
                    Drawn {
                        node: field(0),
                        role: field(1),
                        state: field(2),
                    }
                })
                .collect()
        })
        .unwrap_or_default()
}

/// Polls the page until `ok` accepts the drawn ring; the ring it accepted.
async fn wait_ring(browser: &Browser, what: &str, ok: impl Fn(&[Drawn]) -> bool) -> Vec<Drawn> {
    let start = Instant::now();
    loop {
        let ring = drawn_ring(browser);
        if ok(&ring) {
            eprintln!("{what}: after {:?}: {ring:?}", start.elapsed());
            return ring;
        }
        assert!(
            start.elapsed() < SHOW_TIMEOUT,
            "the page never showed {what}; it draws {ring:?}; status: {}",
            browser.text("#status")
        );
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// Polls until the element `css` exists and its text contains `text`.
async fn wait_text(browser: &Browser, css: &str, text: &str) {
    let start = Instant::now();
    loop {
        let shown = browser.text(css);
        if shown.contains(text) {
            return;
        }
        assert!(
            start.elapsed() < SHOW_TIMEOUT,
            "{css} never showed {text:?}; it shows {shown:?}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// Waits until node 2 lists `n` synchronised mirrors of the queue (warrenctl).
async fn wait_synchronised_mirrors(cluster: &Cluster, n: usize) {
    let start = Instant::now();
    loop {
        let rows = cluster
            .ctl_rows(2, &["list_queues", "name", "synchronised_slave_pids"])
            .await;
        let synced = rows
            .iter()
            .find(|r| r[0] == QUEUE)
            .and_then(|r| r.get(1))
            .map_or(0, |s| s.matches("@test").count());
        if synced == n {
            return;
        }
        assert!(
            start.elapsed() < SHOW_TIMEOUT,
            "{QUEUE}: {synced} synchronised mirrors, not {n}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

fn member<'a>(ring: &'a [Drawn], node: &str) -> Option<&'a Drawn> {
    ring.iter().find(|m| m.node == node)
}

fn masters(ring: &[Drawn]) -> Vec<&Drawn> {
    ring.iter().filter(|m| m.role == "master").collect()
}

struct Shots {
    dir: PathBuf,
    taken: usize,
}

/// Kept for a look when the test fails; removed when it passes.
impl Drop for Shots {
    fn drop(&mut self) {
        if !std::thread::panicking() {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }
}

impl Shots {
    fn new() -> Shots {
        let dir = std::env::temp_dir().join(format!("warren-console-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("screenshot dir");
        eprintln!("screenshots in {}", dir.display());
        Shots { dir, taken: 0 }
    }

    fn take(&mut self, browser: &Browser, name: &str) -> PathBuf {
        self.taken += 1;
        let path = self.dir.join(format!("{}-{name}.png", self.taken));
        browser.screenshot(&path);
        path
    }
}

/// `$CONSOLE_SCREENSHOT`, when set, receives a copy of the failover screenshot (how
/// `docs/console.png` is made).
fn keep(path: &Path) {
    if let Some(to) = std::env::var_os("CONSOLE_SCREENSHOT") {
        std::fs::copy(path, &to).expect("copy the screenshot");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_console_draws_a_mirrored_queues_ring_through_a_failover_and_a_sync() {
    let mut cluster = Cluster::start("console").await;
    // Manual sync: a mirror added to a queue with a backlog stays unsynchronised until the
    // Sync button.
    cluster.set_ha_policy(r#"{"ha-mode":"all"}"#).await;
    let c1 = connect(&cluster.node(1).amqp_uri()).await;
    declare(&channel(&c1).await, QUEUE, true, locator("client-local"))
        .await
        .expect("declare on node 1: its master is there");
    common::close_connection(&c1).await;
    // Mirrors added after the publishes below would start unsynchronised (manual mode):
    // wait for both while the queue is empty.
    wait_synchronised_mirrors(&cluster, 2).await;
    let c2 = connect(&cluster.node(2).amqp_uri()).await;
    let ch = channel(&c2).await;
    within(
        "confirm.select",
        ch.confirm_select(ConfirmSelectOptions::default()),
    )
    .await
    .expect("confirm.select");
    for i in 0..200u32 {
        assert!(
            publish_acked(&ch, "", QUEUE, &i.to_be_bytes()).await,
            "nacked"
        );
    }
    // c2 stays open for the connections view.

    let browser = Browser::start(1200, 800);
    let mut shots = Shots::new();
    // The browser talks to node 2, which survives; node 1 holds the master.
    let base = format!("http://{}:15672/", cluster.node(2).ip);
    browser.goto(&base);
    browser.type_into("#login-user", "guest");
    browser.type_into("#login-password", "guest");
    browser.click("#login-submit");
    wait_text(&browser, "#main h1", "Overview").await;
    wait_text(&browser, "#nodes", "warren3@test").await;
    // Each node's figures, node 1's and 3's fetched by node 2 over the node links: memory
    // against the test clusters' 1 GiB watermark, on all three rows.
    wait_text(&browser, "#nodes thead", "File descriptors").await;
    let start = Instant::now();
    while browser
        .text("#nodes tbody")
        .matches("MiB of 1.0 GiB")
        .count()
        < 3
    {
        assert!(
            start.elapsed() < SHOW_TIMEOUT,
            "not every node shows its memory: {:?}",
            browser.text("#nodes tbody")
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    wait_text(&browser, "#alarms", "No resource alarm").await;
    shots.take(&browser, "overview");

    browser.goto(&format!("{base}#/connections"));
    wait_text(&browser, "#connections tbody", "guest").await;
    wait_text(&browser, "#channels tbody", "confirm").await;
    browser.goto(&format!("{base}#/policies"));
    wait_text(&browser, "#policies tbody", r#"{"ha-mode":"all"}"#).await;
    common::close_connection(&c2).await;

    browser.goto(&format!("{base}#/queues"));
    wait_text(&browser, "#queues", QUEUE).await;
    let row = browser.text("#queues tbody tr");
    assert!(
        row.contains("warren1@test") && row.contains("200"),
        "the queue's row names its master and its 200 messages: {row}"
    );
    shots.take(&browser, "queues");
    // The filter keeps matching rows only; a new view of the list starts unfiltered.
    browser.type_into("#queue-filter", "console-none");
    wait_text(&browser, "#queues tbody", "None.").await;
    browser.goto(&format!("{base}#/overview"));
    browser.goto(&format!("{base}#/queues"));
    wait_text(&browser, "#queues", QUEUE).await;
    browser.click(&format!("#queues a[href*='{QUEUE}']"));

    let ring = wait_ring(&browser, "three synchronised members", |r| {
        r.len() == 3 && r.iter().all(|m| m.state == "synchronised")
    })
    .await;
    assert_eq!(
        masters(&ring),
        [member(&ring, "warren1@test").expect("node 1 in the ring")],
        "node 1 is the master"
    );
    for node in ["warren2@test", "warren3@test"] {
        assert_eq!(member(&ring, node).map(|m| m.role.as_str()), Some("mirror"));
    }
    assert_eq!(browser.text("[data-fact=master]"), "warren1@test");
    shots.take(&browser, "ring");

    cluster.nodes[0].kill();
    let ring = wait_ring(&browser, "node 1 down and a new master", |r| {
        let down = member(r, "warren1@test").is_some_and(|m| m.state == "down");
        let promoted = masters(r)
            .iter()
            .any(|m| m.node != "warren1@test" && m.state == "synchronised");
        down && promoted
    })
    .await;
    let master = masters(&ring)[0].node.clone();
    wait_text(&browser, "[data-fact=master]", &master).await;
    wait_text(&browser, "#members", "down").await;
    keep(&shots.take(&browser, "failover"));

    cluster.restart(1).await;
    let ring = wait_ring(&browser, "node 1 back as a syncing mirror", |r| {
        member(r, "warren1@test").is_some_and(|m| m.role == "mirror" && m.state == "syncing")
    })
    .await;
    assert!(
        ring.iter().all(|m| m.state != "down"),
        "node 1's member is no longer down: {ring:?}"
    );
    shots.take(&browser, "syncing");

    browser.click("#sync");
    wait_text(&browser, "#sync-note", "Sync requested").await;
    let ring = wait_ring(&browser, "the sync finished", |r| {
        r.len() == 3 && r.iter().all(|m| m.state == "synchronised")
    })
    .await;
    assert_eq!(masters(&ring).len(), 1, "one master: {ring:?}");
    assert_eq!(
        masters(&ring)[0].node,
        master,
        "the sync did not move the master"
    );
    shots.take(&browser, "synchronised");
    assert_eq!(shots.taken, 6);
}
