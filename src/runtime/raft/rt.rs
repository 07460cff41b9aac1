//! [`SeededRuntime`]: openraft's tokio runtime, except that its random numbers come from the
//! node's seed.
//!
//! openraft draws each node's election timeout from `AsyncRuntime::thread_rng()`; the stock
//! tokio runtime answers with an OS-seeded RNG, so two runs of the same simulation elect
//! different leaders. `thread_rng()` is a static function with no access to the node, so the
//! seed travels as a tokio task-local: [`with_seed`] wraps the node's start-up future, and
//! [`SeededRuntime::spawn`] hands the same seed source to every task the node spawns. A
//! thread-local would not do: the simulation runs every node on one thread, and a
//! multi-threaded runtime moves a node's tasks between threads.

use std::future::Future;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use openraft::{AsyncRuntime, OptionalSend, TokioRuntime};
use rand::rngs::StdRng;
use rand::{RngCore, SeedableRng};

tokio::task_local! {
    /// The seeded source of the node whose task is running.
    static NODE_RNG: Arc<Mutex<StdRng>>;
}

/// Runs `fut` (and every task openraft spawns from it) with random numbers drawn from `seed`.
pub fn with_seed<F: Future>(seed: u64, fut: F) -> impl Future<Output = F::Output> {
    NODE_RNG.scope(Arc::new(Mutex::new(StdRng::seed_from_u64(seed))), fut)
}

/// tokio for tasks, timers and channels; a per-node seeded RNG.
#[derive(Debug, Default, PartialEq, Eq, Clone, Copy)]
pub struct SeededRuntime;

type Tokio = TokioRuntime;

impl AsyncRuntime for SeededRuntime {
    type JoinError = <Tokio as AsyncRuntime>::JoinError;
    type JoinHandle<T: OptionalSend + 'static> = <Tokio as AsyncRuntime>::JoinHandle<T>;
    type Sleep = <Tokio as AsyncRuntime>::Sleep;
    type Instant = <Tokio as AsyncRuntime>::Instant;
    type TimeoutError = <Tokio as AsyncRuntime>::TimeoutError;
    type Timeout<R, T: Future<Output = R> + OptionalSend> = <Tokio as AsyncRuntime>::Timeout<R, T>;
    type ThreadLocalRng = StdRng;
    type OneshotSender<T: OptionalSend> = <Tokio as AsyncRuntime>::OneshotSender<T>;
    type OneshotReceiverError = <Tokio as AsyncRuntime>::OneshotReceiverError;
    type OneshotReceiver<T: OptionalSend> = <Tokio as AsyncRuntime>::OneshotReceiver<T>;

    fn spawn<T>(future: T) -> Self::JoinHandle<T::Output>
    where
        T: Future + OptionalSend + 'static,
        T::Output: OptionalSend + 'static,
    {
        // Spawned tasks do not inherit task-locals; pass the node's seed source on by hand.
        match NODE_RNG.try_with(Arc::clone) {
            Ok(rng) => tokio::spawn(NODE_RNG.scope(rng, future)),
            Err(_) => tokio::spawn(future),
        }
    }

    fn sleep(duration: Duration) -> Self::Sleep {
        Tokio::sleep(duration)
    }

    fn sleep_until(deadline: Self::Instant) -> Self::Sleep {
        Tokio::sleep_until(deadline)
    }

    fn timeout<R, F: Future<Output = R> + OptionalSend>(
        duration: Duration,
        future: F,
    ) -> Self::Timeout<R, F> {
        Tokio::timeout(duration, future)
    }

    fn timeout_at<R, F: Future<Output = R> + OptionalSend>(
        deadline: Self::Instant,
        future: F,
    ) -> Self::Timeout<R, F> {
        Tokio::timeout_at(deadline, future)
    }

    fn is_panic(join_error: &Self::JoinError) -> bool {
        Tokio::is_panic(join_error)
    }

    fn thread_rng() -> Self::ThreadLocalRng {
        // Each call gets a fresh generator seeded from the node's source, so the sequence of
        // draws depends only on the seed and on the order of calls within the node.
        NODE_RNG
            .try_with(|source| {
                let mut source = source.lock().unwrap_or_else(|e| e.into_inner());
                StdRng::seed_from_u64(source.next_u64())
            })
            // Outside a seeded node (storage tests) there is nothing to replay.
            .unwrap_or_else(|_| StdRng::from_entropy())
    }

    fn oneshot<T>() -> (Self::OneshotSender<T>, Self::OneshotReceiver<T>)
    where
        T: OptionalSend,
    {
        Tokio::oneshot()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::Rng;

    async fn draws() -> Vec<u64> {
        let mut out = vec![SeededRuntime::thread_rng().gen_range(0..1_000_000)];
        // A task spawned through the runtime draws from the same node source.
        let spawned =
            SeededRuntime::spawn(async { SeededRuntime::thread_rng().gen_range(0..1_000_000u64) });
        out.push(spawned.await.unwrap_or(u64::MAX));
        out
    }

    #[tokio::test]
    async fn same_seed_same_draws_across_spawned_tasks() {
        let a = with_seed(7, draws()).await;
        let b = with_seed(7, draws()).await;
        let c = with_seed(8, draws()).await;
        assert_eq!(a, b);
        assert_ne!(a, c);
        assert_ne!(a[0], a[1], "the second draw continues the sequence");
    }
}
