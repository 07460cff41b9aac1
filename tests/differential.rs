//! The differential suite (issue 20): short scripts of client actions over raw frames
//! (`differential/scenarios.rs`), run against RabbitMQ 3.10 to record what it answers
//! (`differential/rabbitmq-3.10.8.json`) and replayed against Warren here. Every scenario
//! where Warren answers otherwise must be listed, with its reason, in
//! `differential/differences.json`; an entry that no longer differs fails too, so the list
//! stays true.
//!
//! Recording is a separate command, against a RabbitMQ 3.10 whose `guest` may log in from
//! loopback (`loopback_users = none` is not needed on 127.0.0.1):
//!
//! ```sh
//! DIFF_RECORD=127.0.0.1:5672 cargo test --test differential -- --ignored record
//! ```

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

async fn run_all(addr: std::net::SocketAddr) -> Outcomes {
    let mut out = Outcomes::new();
    for s in scenarios::all() {
        let outcome = runner::run(addr, &s.steps).await;
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
    let addr: std::net::SocketAddr = std::env::var("DIFF_RECORD")
        .expect("DIFF_RECORD=host:port")
        .parse()
        .expect("DIFF_RECORD is host:port");
    let outcomes = run_all(addr).await;
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
    let got = run_all(node.addr).await;
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
    for id in allowed.keys().filter(|id| !got.contains_key(*id)) {
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
