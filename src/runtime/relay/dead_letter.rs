//! Dead letters for another node's queue: forwarded to the queue's home, and again after a
//! failure (a link that broke, a node recorded down, a master replaced) to wherever the
//! queue lives then, until a home node has taken the letter; only then is the message acked
//! in its source queue ([`LetterHold`]). Letters this node's queues took wait for their
//! group-commit round ([`when_written`]), and are forwarded so if it is voided. A letter
//! still in flight when this node stops is in its source queue again at the next start
//! (`docs/clustering.md`).

use std::sync::Arc;
use std::time::Duration;

use tokio::sync::oneshot;

use super::sender::Outgoing;
use super::wire::{RelayMsg, WireMessage};
use super::Inner;
use crate::broker::dead_letter::{LetterHold, WrittenLetter};
use crate::broker::Message;

/// The first wait before sending a letter again; it doubles up to [`RETRY_MAX`].
const RETRY_MIN: Duration = Duration::from_millis(100);
const RETRY_MAX: Duration = Duration::from_secs(2);

/// Forwards `message`, a dead letter for `queue` of `vhost`, until its home took it; then
/// takes `hold`, which records the ack in the letter's source queue.
pub(super) fn forward(
    inner: Arc<Inner>,
    vhost: String,
    queue: String,
    message: Arc<Message>,
    hold: LetterHold,
) {
    // Held here between attempts, so the memory alarm sees letters piling up in an outage.
    let held = message.body.len() as i64;
    inner.broker.count_relayed(held);
    tokio::spawn(async move {
        let mut wait = RETRY_MIN;
        let mut attempts = 0u32;
        loop {
            if inner.link.strong_count() == 0 {
                // The relay is gone (the node stops): `hold` is dropped untaken, so the
                // source queue keeps the message.
                inner.broker.count_relayed(-held);
                return;
            }
            let home = inner
                .broker
                .snapshot()
                .vhost(&vhost)
                .and_then(|v| v.queues.get(&queue))
                .map(|def| def.home);
            let Some(home) = home else {
                // Deleted: nowhere to go, as for a letter routed to no queue.
                tracing::debug!(vhost = %vhost, queue = %queue, "dead letter dropped: its queue is gone");
                hold.taken();
                break;
            };
            let taken = if home == inner.me {
                let here = inner.broker.dead_letter_here(
                    &vhost,
                    &queue,
                    message.clone(),
                    inner.clock.now(),
                );
                match here {
                    None => false,
                    Some(ticket) => written(&inner, ticket).await,
                }
            } else if inner.broker.node_is_down(home) {
                false
            } else {
                let (tx, rx) = oneshot::channel();
                inner.enqueue(
                    home,
                    Outgoing {
                        msg: RelayMsg::Publish {
                            vhost: vhost.clone(),
                            queues: vec![queue.clone()],
                            message: WireMessage::of(&message),
                        },
                        outcome: 0,
                        after: None,
                        released: 0,
                        reply_to: None,
                        node_reply_to: None,
                        source: None,
                        published: Some(tx),
                    },
                );
                rx.await.unwrap_or(false)
            };
            if taken {
                hold.taken();
                break;
            }
            attempts += 1;
            if attempts == 1 {
                tracing::info!(vhost = %vhost, queue = %queue, node = home, "dead letter not taken by its queue's node; sending it again");
            }
            tokio::time::sleep(wait).await;
            wait = (wait * 2).min(RETRY_MAX);
        }
        inner.broker.count_relayed(-held);
    });
}

/// Whether the write in group-commit round `ticket` (0: none) is durable and its round was
/// not voided; waits for the round.
async fn written(inner: &Inner, ticket: u64) -> bool {
    match inner.broker.durability() {
        Some(d) if ticket != 0 => {
            super::serve::wait_durable(d, ticket).await && !d.any_void(ticket, ticket)
        }
        _ => true,
    }
}

/// Takes the holds of dead letters this node's queues took once their rounds are durable
/// (one wait: rounds are marked durable in order); a letter whose round was voided is
/// forwarded again, to wherever its queue lives by then. Storage that failed takes none
/// (the node stops; the source keeps the messages).
pub(super) fn when_written(inner: Arc<Inner>, letters: Vec<WrittenLetter>) {
    let Some(d) = inner.broker.durability().cloned() else {
        letters.into_iter().for_each(|l| l.hold.taken());
        return;
    };
    let last = letters.iter().map(|l| l.ticket).max().unwrap_or(0);
    tokio::spawn(async move {
        if !super::serve::wait_durable(&d, last).await {
            return;
        }
        for l in letters {
            if d.any_void(l.ticket, l.ticket) {
                tracing::info!(vhost = %l.vhost, queue = %l.queue, "dead letter's round voided (its queue's master was deposed); sending it again");
                forward(inner.clone(), l.vhost, l.queue, l.message, l.hold);
            } else {
                l.hold.taken();
            }
        }
    });
}
