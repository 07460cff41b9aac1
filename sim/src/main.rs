//! Placeholder harness: the turmoil simulation arrives with the GM issue.
fn main() {
    println!("sim: no scenarios yet");
}
