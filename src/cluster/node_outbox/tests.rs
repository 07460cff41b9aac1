//! The node outbox: batching, order, and one fate per item whatever happens.

use std::collections::BTreeMap;

use proptest::prelude::*;

use super::NodeOutbox;

fn queue(o: &mut NodeOutbox<u32>, items: &[u32], size: usize) {
    for &i in items {
        o.handle_enqueue(i, size, 10).unwrap();
    }
}

fn batch(o: &mut NodeOutbox<u32>) -> Option<(u64, Vec<u32>)> {
    o.poll_batch()
        .map(|(id, items)| (id, items.into_iter().copied().collect()))
}

#[test]
fn batches_keep_order_and_respect_both_limits() {
    let mut o = NodeOutbox::new(3, 100);
    queue(&mut o, &[1, 2, 3, 4, 5], 10);
    let (a, items) = batch(&mut o).unwrap();
    assert_eq!(items, [1, 2, 3], "three items at most");
    assert!(
        batch(&mut o).is_none(),
        "one batch handed to the link at a time"
    );
    o.handle_handed(a);
    let (b, items) = batch(&mut o).unwrap();
    assert_eq!(items, [4, 5]);
    assert!(b > a);

    let mut o = NodeOutbox::new(10, 100);
    queue(&mut o, &[1, 2], 40);
    queue(&mut o, &[3], 30);
    let (_, items) = batch(&mut o).unwrap();
    assert_eq!(items, [1, 2], "the third would pass 100 bytes");

    let mut o = NodeOutbox::new(10, 100);
    queue(&mut o, &[1], 500);
    queue(&mut o, &[2], 1);
    let (id, items) = batch(&mut o).unwrap();
    assert_eq!(items, [1], "an item bigger than a batch goes alone");
    o.handle_handed(id);
    assert_eq!(batch(&mut o).unwrap().1, [2]);
}

#[test]
fn answers_come_in_batch_order_and_a_skipped_batch_fails() {
    let mut o = NodeOutbox::new(1, 100);
    queue(&mut o, &[1, 2, 3], 10);
    let mut ids = Vec::new();
    while let Some((id, _)) = batch(&mut o) {
        o.handle_handed(id);
        ids.push(id);
    }
    assert_eq!(o.handle_answered(ids[0]), (vec![1], vec![]));
    assert_eq!(
        o.handle_answered(ids[2]),
        (vec![3], vec![2]),
        "batch 2's reply can no longer come"
    );
    assert!(o.is_idle());
    assert_eq!(o.take_held(), 0, "every held byte returned");
}

#[test]
fn a_refused_or_unanswered_batch_fails_and_the_rest_goes_on() {
    let mut o = NodeOutbox::new(1, 100);
    queue(&mut o, &[1, 2, 3], 10);
    let (a, _) = batch(&mut o).unwrap();
    assert_eq!(o.handle_refused(a), [1]);
    let (b, items) = batch(&mut o).unwrap();
    assert_eq!(items, [2]);
    o.handle_handed(b);
    let (c, _) = batch(&mut o).unwrap();
    o.handle_handed(c);
    assert_eq!(o.handle_unanswered(b), [2]);
    assert_eq!(o.handle_answered(c), (vec![3], vec![]));
    assert_eq!(
        o.handle_answered(c),
        (vec![], vec![]),
        "an answer counts once"
    );
    assert_eq!(o.handle_refused(a), Vec::<u32>::new());
}

#[test]
fn a_node_declared_down_fails_everything_at_once_and_everything_after() {
    let mut o = NodeOutbox::new(1, 100);
    queue(&mut o, &[1, 2, 3], 10);
    assert_eq!(o.take_held(), 30);
    let (a, _) = batch(&mut o).unwrap();
    o.handle_handed(a);
    let (b, _) = batch(&mut o).unwrap();
    // Batch b waits for room on a link that stopped draining (a partition).
    assert_eq!(
        o.handle_down(),
        [1, 2, 3],
        "awaited, being handed, queued: oldest first"
    );
    assert_eq!(o.take_held(), -30);
    assert_eq!(o.handle_enqueue(4, 10, 10), Err(4));
    assert_eq!(o.take_held(), 0, "a refused item is never counted");
    assert!(batch(&mut o).is_none());
    // What the driver learns late changes nothing.
    assert_eq!(o.handle_refused(b), Vec::<u32>::new());
    assert_eq!(o.handle_answered(a), (vec![], vec![]));
    assert!(o.is_down() && o.is_idle());
}

#[derive(Debug, Clone)]
enum Step {
    Enqueue(usize),
    Poll,
    Handed,
    Refused,
    /// The reply to the n-th awaited batch (modulo how many there are).
    Answered(usize),
    Unanswered(usize),
    Down,
}

fn step() -> impl Strategy<Value = Step> {
    prop_oneof![
        4 => (1usize..300).prop_map(Step::Enqueue),
        3 => Just(Step::Poll),
        2 => Just(Step::Handed),
        1 => Just(Step::Refused),
        2 => (0usize..4).prop_map(Step::Answered),
        1 => (0usize..4).prop_map(Step::Unanswered),
        1 => Just(Step::Down),
    ]
}

proptest! {
    /// Whatever the link and the detector do: items leave in order, within the limits;
    /// every item gets exactly one fate, and an answered item was in a batch the link
    /// took; held bytes come back to zero once everything has its fate.
    #[test]
    fn every_item_gets_exactly_one_fate(steps in proptest::collection::vec(step(), 1..80)) {
        let (max_items, max_bytes) = (4, 500);
        let mut o: NodeOutbox<u32> = NodeOutbox::new(max_items, max_bytes);
        let mut next = 0u32;
        let mut sizes = BTreeMap::new();
        let mut fates: BTreeMap<u32, &str> = BTreeMap::new();
        let mut handing: Option<(u64, Vec<u32>)> = None;
        let mut awaiting: Vec<(u64, Vec<u32>)> = Vec::new();
        let mut sent_order = Vec::new();
        let mut held: i64 = 0;
        let fate = |items: Vec<u32>, what: &'static str, fates: &mut BTreeMap<u32, &str>| {
            for i in items {
                prop_assert!(fates.insert(i, what).is_none(), "item {} got a second fate", i);
            }
            Ok(())
        };
        for s in steps {
            match s {
                Step::Enqueue(size) => {
                    match o.handle_enqueue(next, size, size) {
                        Ok(()) => { sizes.insert(next, size); }
                        Err(i) => fate(vec![i], "failed", &mut fates)?,
                    }
                    next += 1;
                }
                Step::Poll => {
                    if let Some((id, items)) = batch(&mut o) {
                        prop_assert!(handing.is_none());
                        prop_assert!(!items.is_empty() && items.len() <= max_items);
                        let bytes: usize = items.iter().map(|i| sizes[i]).sum();
                        prop_assert!(items.len() == 1 || bytes <= max_bytes);
                        sent_order.extend(items.iter().copied());
                        handing = Some((id, items));
                    }
                }
                Step::Handed => {
                    if let Some((id, items)) = handing.take() {
                        o.handle_handed(id);
                        awaiting.push((id, items));
                    }
                }
                Step::Refused => {
                    if let Some((id, items)) = handing.take() {
                        let failed = o.handle_refused(id);
                        prop_assert_eq!(&failed, &items);
                        fate(failed, "failed", &mut fates)?;
                    }
                }
                Step::Answered(n) if !awaiting.is_empty() => {
                    let n = n % awaiting.len();
                    let (id, items) = awaiting[n].clone();
                    let (answered, failed) = o.handle_answered(id);
                    prop_assert_eq!(&answered, &items);
                    let skipped: Vec<u32> =
                        awaiting.drain(..=n).take(n).flat_map(|(_, i)| i).collect();
                    prop_assert_eq!(&failed, &skipped);
                    fate(answered, "answered", &mut fates)?;
                    fate(failed, "failed", &mut fates)?;
                }
                Step::Unanswered(n) if !awaiting.is_empty() => {
                    let (id, items) = awaiting.remove(n % awaiting.len());
                    let failed = o.handle_unanswered(id);
                    prop_assert_eq!(&failed, &items);
                    fate(failed, "failed", &mut fates)?;
                }
                Step::Answered(_) | Step::Unanswered(_) => {}
                Step::Down => {
                    let failed = o.handle_down();
                    handing = None;
                    awaiting.clear();
                    fate(failed, "failed", &mut fates)?;
                }
            }
            held += o.take_held();
            let pending: i64 = sizes
                .iter()
                .filter(|(i, _)| !fates.contains_key(i))
                .map(|(_, s)| *s as i64)
                .sum();
            prop_assert_eq!(held, pending, "held bytes are those without a fate");
        }
        let mut in_order = sent_order.clone();
        in_order.sort_unstable();
        prop_assert_eq!(sent_order, in_order, "items leave in the order queued");
        // Settle what is left: everything gets its fate.
        fate(o.handle_down(), "failed", &mut fates)?;
        held += o.take_held();
        prop_assert_eq!(held, 0);
        prop_assert_eq!(fates.len() as u32, next, "every item has a fate");
    }
}
