//! The differential suite (issue 20): short scripts of client actions over raw frames
//! (`differential/scenarios.rs`), run against RabbitMQ 3.10 to record what it answers
//! (`differential/rabbitmq-3.10.8.json`) and replayed against Warren here. Every scenario
//! where Warren answers otherwise must be listed, with its reason, in
//! `differential/differences.json`; an entry that no longer differs fails too, so the list
//! stays true.
//!
//! Recording is a separate command (`.ci/differential-record.sh` starts a fresh one),
//! against a RabbitMQ 3.10 with its management plugin, whose `guest` may log in from
//! loopback:
//!
//! ```sh
//! DIFF_RECORD=127.0.0.1:5672 DIFF_RECORD_HTTP=127.0.0.1:15672 \
//!     cargo test --test differential -- --ignored record
//! ```
//!
//! `DIFF_ONLY=<regex>` replays only the scenarios whose ids match it.

mod common;
#[path = "differential/runner.rs"]
mod runner;
#[path = "differential/scenarios.rs"]
mod scenarios;

use std::collections::BTreeMap;
use std::path::PathBuf;

use common::*;

type Outcomes = BTreeMap<String, Vec<Vec<String>>>;

fn dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/differential")
}

const RECORDING: &str = "rabbitmq-3.10.8.json";
const DIFFERENCES: &str = "differences.json";

/// `DIFF_ONLY`, a regex over scenario ids: the replay runs only those (while working on
/// some); the recording always runs all.
fn only() -> Option<regex::Regex> {
    std::env::var("DIFF_ONLY")
        .ok()
        .map(|re| regex::Regex::new(&re).expect("DIFF_ONLY is a regex"))
}

async fn run_all(target: runner::Target, only: Option<&regex::Regex>) -> Outcomes {
    let mut out = Outcomes::new();
    for s in scenarios::all()
        .into_iter()
        .filter(|s| only.is_none_or(|re| re.is_match(&s.id)))
    {
        let outcome = runner::run(target, &s.steps).await;
        assert!(
            out.insert(s.id.clone(), outcome).is_none(),
            "two scenarios named {}",
            s.id
        );
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "records RabbitMQ's answers: needs DIFF_RECORD=host:port of a RabbitMQ 3.10"]
async fn record() {
    let addr = |var: &str| -> std::net::SocketAddr {
        std::env::var(var)
            .unwrap_or_else(|_| panic!("{var}=host:port"))
            .parse()
            .unwrap_or_else(|_| panic!("{var} is host:port"))
    };
    assert!(
        only().is_none(),
        "the recording runs every scenario: unset DIFF_ONLY"
    );
    let outcomes = run_all(
        runner::Target {
            amqp: addr("DIFF_RECORD"),
            http: addr("DIFF_RECORD_HTTP"),
        },
        None,
    )
    .await;
    let text = serde_json::to_string_pretty(&outcomes).expect("json");
    std::fs::write(dir().join(RECORDING), text + "\n").expect("write the recording");
    println!("recorded {} scenarios", outcomes.len());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn warren_answers_as_rabbitmq_3_10_does() {
    let expected: Outcomes = serde_json::from_str(
        &std::fs::read_to_string(dir().join(RECORDING)).expect("read the recording"),
    )
    .expect("the recording is json");
    let allowed: BTreeMap<String, String> = serde_json::from_str(
        &std::fs::read_to_string(dir().join(DIFFERENCES)).expect("read the differences"),
    )
    .expect("the differences are json");
    let node = TestNode::start().await;
    let only = only();
    let got = run_all(
        runner::Target {
            amqp: node.addr,
            http: node.mgmt_addr(),
        },
        only.as_ref(),
    )
    .await;
    node.shutdown().await;

    let mut failures = Vec::new();
    let mut differing = 0;
    for (id, outcome) in &got {
        let Some(want) = expected.get(id) else {
            failures.push(format!(
                "{id}: not recorded (record again against RabbitMQ)"
            ));
            continue;
        };
        let same = want == outcome;
        if !same {
            differing += 1;
        }
        match (same, allowed.get(id)) {
            (true, Some(_)) => failures.push(format!(
                "{id}: listed in {DIFFERENCES} but Warren now answers as RabbitMQ: drop the entry"
            )),
            (false, None) => {
                let mut text = format!("{id}: Warren differs from RabbitMQ 3.10.8");
                for (i, (w, g)) in want.iter().zip(outcome.iter()).enumerate() {
                    if w != g {
                        text.push_str(&format!(
                            "\n    step {i}:\n      rabbitmq: {w:?}\n      warren:   {g:?}"
                        ));
                    }
                }
                failures.push(text);
            }
            _ => {}
        }
    }
    for id in allowed
        .keys()
        .filter(|id| only.as_ref().is_none_or(|re| re.is_match(id)) && !got.contains_key(*id))
    {
        failures.push(format!(
            "{id}: listed in {DIFFERENCES} but no such scenario"
        ));
    }
    println!(
        "{} scenarios, {} answered as RabbitMQ 3.10.8, {differing} differ ({} listed)",
        got.len(),
        got.len() - differing,
        allowed.len()
    );
    assert!(
        failures.is_empty(),
        "{} problems:\n{}",
        failures.len(),
        failures.join("\n")
    );
}

#[test]
fn there_are_at_least_300_scenarios_with_distinct_ids() {
    let all = scenarios::all();
    let ids: std::collections::BTreeSet<&str> = all.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids.len(), all.len(), "duplicate scenario ids");
    assert!(all.len() >= 300, "only {} scenarios", all.len());
}
