//! The relay's unit tests: message batches on the wire.

use super::wire::{encode, encode_one};
use super::*;
/// Messages sent alone (a broker cancel, a settle sent again, an abandoned get) decode
/// as the batch the receiver expects.
#[test]
fn a_message_sent_alone_decodes_as_a_batch_of_one() {
    let msg = RelayMsg::GetAbandoned {
        conn: 7,
        channel: 3,
        request: 512,
    };
    let batch: Vec<RelayMsg> = bincode::deserialize(&encode_one(&msg)).expect("a batch of one");
    assert!(matches!(
        batch.as_slice(),
        [RelayMsg::GetAbandoned {
            conn: 7,
            channel: 3,
            request: 512
        }]
    ));
    // What the two senders did before: not a batch.
    assert!(bincode::deserialize::<Vec<RelayMsg>>(&encode(&[&msg])).is_err());
}
