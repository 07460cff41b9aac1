//! Which publishes of a confirm window came back unroutable (`basic.return`).
//!
//! lapin does not tie a return to the publish it answers. It keeps returns in a queue and
//! hands the oldest to whichever confirm it completes next, and a `multiple` ack completes
//! its tags in a `HashMap`'s order (lapin 4.12, `acknowledgement.rs`). So a return can ride
//! on another publish's confirm of the same window, and that publish's own confirm arrives
//! bare. Only the returned body says which publish came back.

use std::collections::HashSet;

use lapin::Confirmation;

/// The sequence numbers of the returned publishes, from every return carried by any of
/// `confirmations`: `seq_of` reads a body this publisher wrote (`None` for any other).
pub fn returned<'a>(
    confirmations: impl IntoIterator<Item = &'a Confirmation>,
    seq_of: impl Fn(&[u8]) -> Option<u64>,
) -> HashSet<u64> {
    confirmations
        .into_iter()
        .filter_map(|c| match c {
            Confirmation::Ack(Some(m)) | Confirmation::Nack(Some(m)) => seq_of(&m.delivery.data),
            _ => None,
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use lapin::message::{BasicReturnMessage, Delivery};
    use lapin::Confirmation;

    use super::returned;

    fn with_return(seq: u8) -> Confirmation {
        Confirmation::Ack(Some(BasicReturnMessage {
            delivery: Delivery::mock(0, "".into(), "nowhere".into(), false, vec![seq]),
            reply_code: 312,
            reply_text: "NO_ROUTE".into(),
        }))
    }

    #[test]
    fn a_return_counts_for_the_publish_its_body_names_not_the_confirm_it_rode_on() {
        // Publishes 0..4; 1 and 3 were returned, and lapin hung their returns on 0 and 2.
        let confirmations = [
            with_return(3),
            Confirmation::Ack(None),
            with_return(1),
            Confirmation::Ack(None),
        ];
        let got = returned(confirmations.iter(), |b| b.first().map(|&s| s as u64));
        assert_eq!(got, [1, 3].into_iter().collect());
    }

    #[test]
    fn a_body_this_publisher_did_not_write_names_nothing() {
        let confirmations = [with_return(7), Confirmation::Nack(None)];
        assert!(returned(confirmations.iter(), |_| None).is_empty());
    }
}
