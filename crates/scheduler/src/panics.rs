//! The panic guard: a panic stops one step (or one batch item), not the tick.
//!
//! A panic is logged once, where it happens, with its stack and the name of
//! the innermost guarded step: the process's panic hook ([`install_panic_hook`])
//! reads the step from a thread-local that the guard sets while it polls. The
//! guard keeps the first payload; [`Panics::finish`] raises it again at the end
//! of the tick (with `resume_unwind`, which runs no hook, so it is not logged
//! twice) and `Manager::lead` releases the lease as panicked.

use std::any::Any;
use std::backtrace::Backtrace;
use std::cell::RefCell;
use std::future::Future;
use std::panic::{AssertUnwindSafe, PanicHookInfo};
use std::pin::Pin;
use std::sync::{Arc, Once};
use std::task::{Context, Poll};

use tracing::error;

pub type Payload = Box<dyn Any + Send + 'static>;

thread_local! {
    /// The guarded steps being polled on this thread, innermost last.
    /// Shared with the guards, so a poll pushes a reference count, not a copy
    /// of the name.
    static STEPS: RefCell<Vec<Arc<str>>> = const { RefCell::new(Vec::new()) };
}

/// Install the hook that logs a guarded panic with its step and stack through
/// `tracing`, and leaves unguarded panics to the previous hook. Idempotent.
pub fn install_panic_hook() {
    static ONCE: Once = Once::new();
    ONCE.call_once(|| {
        let previous = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info: &PanicHookInfo<'_>| {
            let step = STEPS.with(|s| s.borrow().last().cloned());
            match step {
                Some(step) => {
                    let location = info.location().map(|l| l.to_string()).unwrap_or_default();
                    error!(
                        step = %step,
                        panic = %panic_message(info.payload()),
                        %location,
                        stack = %Backtrace::force_capture(),
                        "step panicked; running the rest"
                    );
                }
                None => previous(info),
            }
        }));
    });
}

/// The message of a panic payload, when it is a string.
pub fn panic_message(payload: &(dyn Any + Send)) -> String {
    if let Some(s) = payload.downcast_ref::<&str>() {
        (*s).to_owned()
    } else if let Some(s) = payload.downcast_ref::<String>() {
        s.clone()
    } else {
        "non-string panic payload".to_owned()
    }
}

/// Polls `inner` with its step name on the thread-local stack, catching a panic.
///
/// `inner` is boxed when the guard is made, so the guard itself is three
/// words (the box and the name's shared pointer): a task spawned with it, or a
/// future holding it, moves those and not the guarded future, which for a
/// webhook attempt was some 16 KiB (docs/adr/0069).
struct Guarded<F> {
    step: Arc<str>,
    inner: Pin<Box<F>>,
}

impl<F: Future> Future for Guarded<F> {
    type Output = Result<F::Output, Payload>;

    fn poll(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        let step = Arc::clone(&self.step);
        STEPS.with(|s| s.borrow_mut().push(step));
        let result = std::panic::catch_unwind(AssertUnwindSafe(|| self.inner.as_mut().poll(cx)));
        STEPS.with(|s| s.borrow_mut().pop());
        match result {
            Ok(Poll::Pending) => Poll::Pending,
            Ok(Poll::Ready(v)) => Poll::Ready(Ok(v)),
            Err(payload) => Poll::Ready(Err(payload)),
        }
    }
}

/// Run `fut` as the step `step`, returning its panic as a value (for items run
/// concurrently; hand the payload to [`Panics::record`]). `fut` is boxed here,
/// at once, not at the first poll (see [`Guarded`]).
pub fn catch<F: Future>(step: String, fut: F) -> impl Future<Output = Result<F::Output, Payload>> {
    Guarded {
        step: Arc::from(step),
        inner: Box::pin(fut),
    }
}

/// The panics of one tick: run steps and batch items under it, then [`finish`](Panics::finish).
#[must_use = "call finish() at the end of the tick, or a panic is swallowed"]
pub struct Panics {
    scope: String,
    first: Option<Payload>,
    count: usize,
}

impl Panics {
    /// `scope` prefixes each step's name in logs (usually the role).
    pub fn new(scope: impl Into<String>) -> Panics {
        Panics {
            scope: scope.into(),
            first: None,
            count: 0,
        }
    }

    /// Run one step. A panic stops this step only; its value is `None`.
    pub async fn step<F: Future>(&mut self, name: &str, fut: F) -> Option<F::Output> {
        let step = format!("{}/{name}", self.scope);
        match catch(step, fut).await {
            Ok(v) => Some(v),
            Err(payload) => {
                self.keep(payload);
                None
            }
        }
    }

    /// Run a step on its own task (for CPU-heavy or concurrent work); a panic
    /// there is caught and logged the same way.
    pub async fn spawn<F>(&mut self, name: &str, fut: F) -> Option<F::Output>
    where
        F: Future + Send + 'static,
        F::Output: Send + 'static,
    {
        let step = format!("{}/{name}", self.scope);
        match tokio::spawn(catch(step, fut)).await {
            Ok(Ok(v)) => Some(v),
            Ok(Err(payload)) => {
                self.keep(payload);
                None
            }
            Err(join) if join.is_panic() => {
                self.keep(join.into_panic());
                None
            }
            Err(_) => None, // cancelled: the runtime is shutting down
        }
    }

    /// Run `each` on every item in order. An item that panics is left out of
    /// the rest of the tick and the others still run. Returns the outputs of
    /// the items that did not panic.
    pub async fn drain<T, O, F, Fut>(
        &mut self,
        items: Vec<T>,
        label: impl Fn(&T) -> String,
        mut each: F,
    ) -> Vec<O>
    where
        F: FnMut(T) -> Fut,
        Fut: Future<Output = O>,
    {
        let mut out = Vec::with_capacity(items.len());
        for item in items {
            let name = label(&item);
            if let Some(v) = self.step(&name, each(item)).await {
                out.push(v);
            }
        }
        out
    }

    /// How many steps or items panicked so far.
    pub fn panicked(&self) -> usize {
        self.count
    }

    /// Keep a panic caught elsewhere with [`catch`].
    pub fn record(&mut self, payload: Payload) {
        self.keep(payload);
    }

    fn keep(&mut self, payload: Payload) {
        self.count += 1;
        if self.first.is_none() {
            self.first = Some(payload);
        }
    }

    /// End the tick: raise the first panic again, if any.
    ///
    /// # Panics
    /// With the first kept payload, so the lease is released as panicked.
    pub fn finish(self) {
        if let Some(payload) = self.first {
            std::panic::resume_unwind(payload);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};

    #[tokio::test]
    async fn a_panicking_step_stops_only_itself_and_finish_raises_the_first() {
        install_panic_hook();
        let ran = Arc::new(Mutex::new(Vec::new()));
        let mut p = Panics::new("test");
        for (i, boom) in [(1, false), (2, true), (3, false), (4, true)] {
            let ran = ran.clone();
            p.step(&format!("step{i}"), async move {
                if boom {
                    panic!("step {i} exploded");
                }
                ran.lock().unwrap().push(i);
            })
            .await;
        }
        assert_eq!(*ran.lock().unwrap(), vec![1, 3]);
        assert_eq!(p.panicked(), 2);
        let err = std::panic::catch_unwind(AssertUnwindSafe(|| p.finish())).unwrap_err();
        assert_eq!(panic_message(&*err), "step 2 exploded");
    }

    #[tokio::test]
    async fn a_batch_drains_past_a_panicking_item() {
        install_panic_hook();
        let mut p = Panics::new("test");
        let out = p
            .drain(
                vec![1, 2, 3, 4, 5],
                |i| format!("item {i}"),
                |i| async move {
                    assert_ne!(i, 3, "item 3 is malformed");
                    i * 10
                },
            )
            .await;
        assert_eq!(out, vec![10, 20, 40, 50]);
        assert_eq!(p.panicked(), 1);
    }

    #[tokio::test]
    async fn a_panic_in_a_spawned_step_is_caught_the_same_way() {
        install_panic_hook();
        let mut p = Panics::new("test");
        assert_eq!(p.spawn("ok", async { 7 }).await, Some(7));
        assert_eq!(
            p.spawn("boom", async { panic!("in a task") }).await,
            None::<()>
        );
        assert_eq!(p.panicked(), 1);
    }

    /// A panicking job must unwind into the guard, never abort the process:
    /// no profile in the workspace manifest, and no cargo config, sets
    /// `panic = "abort"`.
    #[test]
    fn no_profile_aborts_on_panic() {
        let root = concat!(env!("CARGO_MANIFEST_DIR"), "/../..");
        for file in ["Cargo.toml", ".cargo/config.toml", ".cargo/config"] {
            let Ok(text) = std::fs::read_to_string(format!("{root}/{file}")) else {
                continue;
            };
            let compact: String = text
                .chars()
                .filter(|c| !c.is_whitespace())
                .collect::<String>()
                .replace('\'', "\"");
            assert!(
                !compact.contains("panic=\"abort\""),
                "{file} sets panic = \"abort\""
            );
            assert!(
                !compact.contains("panic=abort"),
                "{file} passes -C panic=abort"
            );
        }
    }
}
