//! Batches a role runs as tasks of their own, so that the driver claims the
//! next batch while the last ones still call, send or settle (docs/adr/0054,
//! 0068). A role's `run` pushes its batch's task and waits for the batches
//! past the newest `depth - 1`; its `finish` waits for the rest.

use std::collections::VecDeque;
use std::sync::Mutex;

use tokio::task::JoinHandle;

/// Up to `depth` batches in flight, oldest first, each with what the role
/// keeps beside its task (`M`: dunning keeps the batch's run ids).
pub struct InFlight<T, M = ()> {
    depth: usize,
    tasks: Mutex<VecDeque<(M, JoinHandle<T>)>>,
}

impl<T, M> InFlight<T, M> {
    /// # Panics
    /// When `depth` is zero.
    #[must_use]
    pub fn new(depth: usize) -> InFlight<T, M> {
        assert!(depth > 0, "at least one batch in flight");
        InFlight {
            depth,
            tasks: Mutex::new(VecDeque::new()),
        }
    }

    fn queue(&self) -> std::sync::MutexGuard<'_, VecDeque<(M, JoinHandle<T>)>> {
        self.tasks.lock().unwrap_or_else(|e| e.into_inner())
    }

    pub fn push(&self, meta: M, task: JoinHandle<T>) {
        self.queue().push_back((meta, task));
    }

    /// Read what the batches in flight keep beside their tasks.
    pub fn with_meta<R>(&self, f: impl FnOnce(&mut dyn Iterator<Item = &M>) -> R) -> R {
        let q = self.queue();
        f(&mut q.iter().map(|(m, _)| m))
    }

    /// Wait for the batches past the newest `depth - 1`, or for all of them,
    /// oldest first. A task that panicked panics here, as it would have in
    /// the role's `run`.
    ///
    /// # Panics
    /// When a task panicked, or the runtime shut down under it.
    pub async fn wait(&self, all: bool) -> Vec<(M, T)> {
        let due: Vec<(M, JoinHandle<T>)> = {
            let mut q = self.queue();
            let keep = if all { 0 } else { self.depth - 1 };
            let n = q.len().saturating_sub(keep);
            q.drain(..n).collect()
        };
        let mut done = Vec::with_capacity(due.len());
        for (meta, task) in due {
            match task.await {
                Ok(t) => done.push((meta, t)),
                Err(e) if e.is_panic() => std::panic::resume_unwind(e.into_panic()),
                // Only when the runtime shuts down under it.
                Err(e) => panic!("a batch's task ended without finishing: {e}"),
            }
        }
        done
    }
}

#[cfg(test)]
mod tests {
    use super::InFlight;

    #[tokio::test]
    async fn waits_for_the_batches_past_the_newest_and_then_for_all() {
        let q: InFlight<u32, &str> = InFlight::new(2);
        for (name, n) in [("a", 1), ("b", 2), ("c", 3)] {
            q.push(name, tokio::spawn(async move { n }));
        }
        let kept: Vec<&str> = q.with_meta(|m| m.copied().collect());
        assert_eq!(kept, ["a", "b", "c"]);
        assert_eq!(q.wait(false).await, [("a", 1), ("b", 2)]);
        assert_eq!(q.wait(false).await, []);
        assert_eq!(q.wait(true).await, [("c", 3)]);
    }

    #[tokio::test]
    #[should_panic(expected = "a batch panicked")]
    async fn a_task_that_panicked_panics_in_the_wait() {
        let q: InFlight<()> = InFlight::new(1);
        q.push((), tokio::spawn(async { panic!("a batch panicked") }));
        q.wait(false).await;
    }
}
